//! In what order a matrix-vector product should read its weight rows, as ratios to the
//! read probe in one run (docs/correctness-and-performance.md, "One weight row at a
//! time"). 538 MB of 576-wide f32 rows in huge pages (SmolLM2-135M's products per decode
//! step), on a pool of `threads` as `Engine::step` runs its forward (on a worker), in
//! blocks of 64 rows; each round reads them
//! - four rows side by side (`dot4_with`, the earlier kernel's pattern),
//! - one row after another (`dot_row_with`, the kernel the engine uses),
//! - one row after another, as matrices of 576 rows with a pass over the pool each (the
//!   engine's products are such matrices), each split as the engine splits a product
//!   (a multiple of the threads of blocks, so that they end together),
//! - the same matrices, each thread taking its fixed share of every matrix in one region
//!   on the pool and waiting for the others at a spinning barrier between matrices (no
//!   hand-off to the pool per matrix, as a forward run by persistent workers would be),
//! - the same shares with a `broadcast` over the pool per matrix (a hand-off each, of
//!   another kind than rayon's stolen blocks),
//! - the matrices with a pass over the pool each while the other workers spin for work
//!   (`rayon::yield_now`) instead of going to sleep between passes,
//! - four rows interleaved in 8-float chunks (a packed layout: one stream of the same
//!   bytes; portable code),
//! - one row after another with eight accumulators (more loads in flight than the
//!   engine's two; another order of sums, so other bits),
//! - the packed layout as 576-row matrices with a pass over the pool each, and in one
//!   region with fixed shares as above,
//! - the matrices stored transposed (`[in, out]`): each block of input columns adds
//!   its rows, scaled by the input, into a partial output held in L1 (one stream per
//!   thread, the layout gemm reads as it is), partials summed after the pass; one row
//!   at a time and two at a time; and split by output columns instead (each thread
//!   reads its part of every row: no partials, but no longer one stream),
//!
//! and the probe (`read_pass`, best of 3) before them; prints the medians in GB/s and
//! as a share of the probe's.
//!
//!   cargo run --release -p kvbench-engines --example row_order -- [threads] [rounds]

mod common;

use anyhow::{Context, Result};
use common::{median, probe_best, Args};
use kvbench_engines::attention::paged::{dot4_with, dot_row_with, has_avx2_fma};
use kvbench_engines::model::pages::huge_vec;
use rayon::prelude::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

const K: usize = 576;

/// One pass over the weights into the outputs.
type Pass<'a> = dyn Fn(&mut [f32]) + Sync + 'a;
const BLOCK: usize = 64;

/// A barrier for `n` threads that spins rather than sleeps (the threads are busy between
/// waits and each wait is short).
struct SpinBarrier {
    n: usize,
    arrived: AtomicUsize,
    generation: AtomicUsize,
}

impl SpinBarrier {
    fn new(n: usize) -> Self {
        Self {
            n,
            arrived: AtomicUsize::new(0),
            generation: AtomicUsize::new(0),
        }
    }

    fn wait(&self) {
        let g = self.generation.load(Ordering::Acquire);
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.n {
            self.arrived.store(0, Ordering::Relaxed);
            self.generation.fetch_add(1, Ordering::Release);
        } else {
            while self.generation.load(Ordering::Acquire) == g {
                std::hint::spin_loop();
            }
        }
    }
}

/// Runs `work` on this pool worker while every other worker of the pool looks for work
/// without sleeping until it returns.
fn spinning<R>(work: impl FnOnce() -> R) -> R {
    let me = rayon::current_thread_index();
    let done = std::sync::atomic::AtomicBool::new(false);
    rayon::in_place_scope(|s| {
        s.spawn_broadcast(|_, ctx| {
            // This worker's own copy returns at once: it may run it while it waits.
            if Some(ctx.index()) == me {
                return;
            }
            while !done.load(Ordering::Acquire) {
                if rayon::yield_now() != Some(rayon::Yield::Executed) {
                    std::hint::spin_loop();
                }
            }
        });
        // Set on the way out, a panic included, so the spinning workers stop.
        struct Done<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Release);
            }
        }
        let _done = Done(&done);
        work()
    })
}

/// A thread's outputs and weight rows of one matrix.
type Share<'a> = (&'a mut [f32], &'a [f32]);

/// Each of `threads` workers' rows of every 576-row matrix (its fixed share, in order):
/// `[thread][matrix]` pairs of outputs and weight rows.
fn shares<'a>(y: &'a mut [f32], w: &'a [f32], threads: usize) -> Vec<Vec<Share<'a>>> {
    let mut out: Vec<Vec<_>> = (0..threads).map(|_| Vec::new()).collect();
    for (mut ym, mut wm) in y.chunks_mut(576).zip(w.chunks(576 * K)) {
        let n = ym.len();
        let groups = n / 4;
        for (t, share) in out.iter_mut().enumerate() {
            // Whole groups of four rows, so that a share of a packed matrix is packed.
            let take = 4 * (groups * (t + 1) / threads - groups * t / threads);
            let (yt, yrest) = std::mem::take(&mut ym).split_at_mut(take);
            let (wt, wrest) = wm.split_at(take * K);
            share.push((yt, wt));
            ym = yrest;
            wm = wrest;
        }
    }
    out
}

/// Four rows stored as `[k/8][4][8]` dotted with `x` (AVX2+FMA where the CPU has
/// them, as the engine's kernels).
fn dot4_packed(w: &[f32], x: &[f32]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: AVX2 and FMA checked just above.
        return unsafe { dot4_packed_avx(w, x) };
    }
    let mut acc = [[0f32; 8]; 4];
    for (wc, xc) in w.chunks_exact(32).zip(x.chunks_exact(8)) {
        for (a, wr) in acc.iter_mut().zip(wc.chunks_exact(8)) {
            for l in 0..8 {
                a[l] += wr[l] * xc[l];
            }
        }
    }
    acc.map(|a| a.iter().sum())
}

/// One row with eight accumulators (64 floats a step): more loads in flight than the
/// engine's two, another order of sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_row_wide(w: &[f32], x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let k = x.len();
    assert!(w.len() >= k && k.is_multiple_of(64));
    let (pw, px) = (w.as_ptr(), x.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 8];
    let mut i = 0;
    while i < k {
        for (j, a) in acc.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(
                _mm256_loadu_ps(pw.add(i + 8 * j)),
                _mm256_loadu_ps(px.add(i + 8 * j)),
                *a,
            );
        }
        i += 64;
    }
    let s = acc
        .iter()
        .fold(_mm256_setzero_ps(), |s, a| _mm256_add_ps(s, *a));
    let mut l = [0f32; 8];
    _mm256_storeu_ps(l.as_mut_ptr(), s);
    l.iter().sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot4_packed_avx(w: &[f32], x: &[f32]) -> [f32; 4] {
    use std::arch::x86_64::*;
    assert!(w.len() >= 4 * x.len() && x.len().is_multiple_of(8));
    let mut acc = [_mm256_setzero_ps(); 4];
    for (c, xc) in x.chunks_exact(8).enumerate() {
        let xv = _mm256_loadu_ps(xc.as_ptr());
        let p = w.as_ptr().add(32 * c);
        for (r, a) in acc.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(_mm256_loadu_ps(p.add(8 * r)), xv, *a);
        }
    }
    acc.map(|a| {
        let mut l = [0f32; 8];
        _mm256_storeu_ps(l.as_mut_ptr(), a);
        l.iter().sum()
    })
}

/// `y += Σ_i x[i]·wt[i]` over the rows of a transposed block (`wt`: `[x.len(), n]`),
/// `rows_at_once` rows (1 or 2) for each load and store of `y`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy_rows(wt: &[f32], x: &[f32], y: &mut [f32], rows_at_once: usize) {
    use std::arch::x86_64::*;
    let n = y.len();
    assert!(n.is_multiple_of(8) && wt.len() >= x.len() * n);
    let py = y.as_mut_ptr();
    let mut i = 0;
    if rows_at_once == 2 {
        while i + 2 <= x.len() {
            let (b0, b1) = (_mm256_set1_ps(x[i]), _mm256_set1_ps(x[i + 1]));
            let (w0, w1) = (wt.as_ptr().add(i * n), wt.as_ptr().add((i + 1) * n));
            for j in (0..n).step_by(8) {
                let a = _mm256_fmadd_ps(b0, _mm256_loadu_ps(w0.add(j)), _mm256_loadu_ps(py.add(j)));
                _mm256_storeu_ps(
                    py.add(j),
                    _mm256_fmadd_ps(b1, _mm256_loadu_ps(w1.add(j)), a),
                );
            }
            i += 2;
        }
    }
    while i < x.len() {
        let b = _mm256_set1_ps(x[i]);
        let w = wt.as_ptr().add(i * n);
        for j in (0..n).step_by(8) {
            _mm256_storeu_ps(
                py.add(j),
                _mm256_fmadd_ps(b, _mm256_loadu_ps(w.add(j)), _mm256_loadu_ps(py.add(j))),
            );
        }
        i += 1;
    }
}

/// One pass over transposed 576×576 matrices: each split into `parts` blocks of input
/// rows, each block's partial output in `partial` (`[parts, 576]`), then summed into `y`.
fn transposed_pass(w: &[f32], x: &[f32], y: &mut [f32], parts: usize, rows_at_once: usize) {
    let kb = K.div_ceil(parts);
    let mut partial = vec![0f32; parts * 576];
    for (ym, wm) in y.chunks_mut(576).zip(w.chunks(576 * K)) {
        partial
            .par_chunks_mut(576)
            .zip(wm.par_chunks(kb * 576))
            .zip(x.par_chunks(kb))
            .for_each(|((p, wb), xb)| {
                p.fill(0.0);
                // The last matrix may be short.
                let xb = &xb[..wb.len() / 576];
                #[cfg(target_arch = "x86_64")]
                if has_avx2_fma() {
                    // SAFETY: AVX2 and FMA checked just above.
                    unsafe { axpy_rows(wb, xb, p, rows_at_once) };
                }
            });
        ym.fill(0.0);
        for p in partial.chunks_exact(576) {
            ym.iter_mut().zip(p).for_each(|(a, b)| *a += b);
        }
    }
}

/// One pass over transposed 576×576 matrices split by output columns instead: each
/// block of `576 / parts` outputs reads its part of every row (no partials to sum).
fn transposed_columns_pass(w: &[f32], x: &[f32], y: &mut [f32], parts: usize) {
    let cb = 576usize.div_ceil(parts).next_multiple_of(8);
    for (ym, wm) in y.chunks_mut(576).zip(w.chunks(576 * K)) {
        let rows = wm.len() / 576;
        ym.par_chunks_mut(cb).enumerate().for_each(|(c, yb)| {
            let mut acc = vec![0f32; cb];
            let acc = &mut acc[..yb.len().next_multiple_of(8).min(cb)];
            #[cfg(target_arch = "x86_64")]
            if has_avx2_fma() {
                for (i, &xi) in x[..rows].iter().enumerate() {
                    let row = &wm[i * 576 + c * cb..];
                    // SAFETY: AVX2 and FMA checked just above.
                    unsafe { axpy_rows(row, &[xi], acc, 1) };
                }
            }
            yb.copy_from_slice(&acc[..yb.len()]);
        });
    }
}

fn main() -> Result<()> {
    let mut args = Args::new();
    let threads = args.next("threads", 2)?.max(1);
    let rounds = args.next("rounds", 7)?.max(1);
    let rows = 538_000_000 / 4 / K / BLOCK * BLOCK;
    let w = huge_vec(rows * K, 0.5);
    let probe = huge_vec(rows * K, 1.0);
    let x: Vec<f32> = (0..K).map(|i| (i % 7) as f32 * 0.1).collect();
    let mut y = vec![0f32; rows];
    let avx = has_avx2_fma();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .context("thread pool")?;
    // A matrix's blocks as the engine splits them: a multiple of the threads, so that
    // they end together.
    let mb = 576usize.div_ceil(576usize.div_ceil(BLOCK).next_multiple_of(threads));
    let gb = |secs: f64| (rows * K * 4) as f64 / secs / 1e9;
    let names = [
        "probe",
        "four rows side by side",
        "one row after another",
        "the same, 576-row matrices",
        "four rows packed",
        "one row after another, 8 acc.",
        "576-row matrices, one region",
        "576-row matrices, a broadcast each",
        "576-row matrices, workers spinning",
        "packed, 576-row matrices",
        "transposed, one row at a time",
        "transposed, two rows at a time",
        "transposed, columns split",
        "packed, 576-row matrices, one region",
    ];
    let mut runs: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    for _ in 0..rounds {
        let best = probe_best(&probe, threads)?;
        runs[0].push(gb(best));
        let passes: [&Pass<'_>; 5] = [
            &|y| {
                y.par_chunks_mut(BLOCK)
                    .zip(w.par_chunks(BLOCK * K))
                    .for_each(|(yb, wb)| {
                        for (yq, wq) in yb.chunks_exact_mut(4).zip(wb.chunks_exact(4 * K)) {
                            yq.copy_from_slice(&dot4_with(avx, wq, &x));
                        }
                    })
            },
            &|y| {
                y.par_chunks_mut(BLOCK)
                    .zip(w.par_chunks(BLOCK * K))
                    .for_each(|(yb, wb)| {
                        for (yr, wr) in yb.iter_mut().zip(wb.chunks_exact(K)) {
                            *yr = dot_row_with(avx, wr, &x);
                        }
                    })
            },
            &|y| {
                for (ym, wm) in y.chunks_mut(576).zip(w.chunks(576 * K)) {
                    ym.par_chunks_mut(mb)
                        .zip(wm.par_chunks(mb * K))
                        .for_each(|(yb, wb)| {
                            for (yr, wr) in yb.iter_mut().zip(wb.chunks_exact(K)) {
                                *yr = dot_row_with(avx, wr, &x);
                            }
                        })
                }
            },
            &|y| {
                y.par_chunks_mut(BLOCK)
                    .zip(w.par_chunks(BLOCK * K))
                    .for_each(|(yb, wb)| {
                        for (yq, wq) in yb.chunks_exact_mut(4).zip(wb.chunks_exact(4 * K)) {
                            yq.copy_from_slice(&dot4_packed(wq, &x));
                        }
                    })
            },
            &|y| {
                y.par_chunks_mut(BLOCK)
                    .zip(w.par_chunks(BLOCK * K))
                    .for_each(|(yb, wb)| {
                        for (yr, wr) in yb.iter_mut().zip(wb.chunks_exact(K)) {
                            // SAFETY: AVX2 and FMA checked when `avx` was set.
                            *yr = if avx {
                                unsafe { dot_row_wide(wr, &x) }
                            } else {
                                0.0
                            };
                        }
                    })
            },
        ];
        for (run, pass) in runs[1..].iter_mut().zip(passes) {
            let t = Instant::now();
            pool.install(|| rayon::scope(|_| pass(&mut y)));
            run.push(gb(t.elapsed().as_secs_f64()));
            // Keep the products: a pass the optimizer could skip would measure nothing.
            anyhow::ensure!(y.iter().all(|v| v.is_finite()), "a product is not finite");
        }
        // One region: the shares are laid out before the clock starts, as a forward
        // would know them from the model's shapes.
        let barrier = SpinBarrier::new(threads);
        let slots: Vec<Mutex<Vec<Share<'_>>>> = shares(&mut y, &w, threads)
            .into_iter()
            .map(Mutex::new)
            .collect();
        // Seconds for every thread to do `share` over each of its matrices in turn,
        // waiting for the others between matrices.
        let region = |share: &(dyn Fn(&mut [f32], &[f32]) + Sync)| {
            let t = Instant::now();
            pool.broadcast(|ctx| {
                let mut mine = slots[ctx.index()].lock().unwrap_or_else(|e| e.into_inner());
                for (ym, wm) in mine.iter_mut() {
                    share(ym, wm);
                    barrier.wait();
                }
            });
            t.elapsed().as_secs_f64()
        };
        runs[6].push(gb(region(&|ym, wm| {
            for (yr, wr) in ym.iter_mut().zip(wm.chunks_exact(K)) {
                *yr = dot_row_with(avx, wr, &x);
            }
        })));
        // The same region over the packed layout: each share is whole groups of four.
        runs[13].push(gb(region(&|ym, wm| {
            for (yq, wq) in ym.chunks_exact_mut(4).zip(wm.chunks_exact(4 * K)) {
                yq.copy_from_slice(&dot4_packed(wq, &x));
            }
        })));
        // The same shares with a hand-off per matrix, by broadcast rather than by
        // splitting the matrix into stolen blocks.
        {
            let mut guards: Vec<_> = slots
                .iter()
                .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()))
                .collect();
            let mut iters: Vec<_> = guards.iter_mut().map(|g| g.iter_mut()).collect();
            let mut matrices: Vec<Vec<Mutex<&mut Share<'_>>>> = Vec::new();
            while let Some(m) = iters
                .iter_mut()
                .map(|i| i.next())
                .collect::<Option<Vec<_>>>()
            {
                matrices.push(m.into_iter().map(Mutex::new).collect());
            }
            let t = Instant::now();
            for m in &matrices {
                pool.broadcast(|ctx| {
                    let mut share = m[ctx.index()].lock().unwrap_or_else(|e| e.into_inner());
                    let (ym, wm) = &mut **share;
                    for (yr, wr) in ym.iter_mut().zip(wm.chunks_exact(K)) {
                        *yr = dot_row_with(avx, wr, &x);
                    }
                });
            }
            runs[7].push(gb(t.elapsed().as_secs_f64()));
        }
        drop(slots);
        // A pass over the pool per matrix, as the engine's products, with the other
        // workers kept awake: each steals the next pass's blocks as soon as they exist.
        let t = Instant::now();
        pool.install(|| {
            spinning(|| {
                for (ym, wm) in y.chunks_mut(576).zip(w.chunks(576 * K)) {
                    ym.par_chunks_mut(mb)
                        .zip(wm.par_chunks(mb * K))
                        .for_each(|(yb, wb)| {
                            for (yr, wr) in yb.iter_mut().zip(wb.chunks_exact(K)) {
                                *yr = dot_row_with(avx, wr, &x);
                            }
                        })
                }
            })
        });
        runs[8].push(gb(t.elapsed().as_secs_f64()));
        anyhow::ensure!(y.iter().all(|v| v.is_finite()), "a product is not finite");
        // Packed, a pass per matrix: groups of four rows split into a multiple of the
        // threads of blocks.
        let groups: usize = 576 / 4;
        let gb4 = 4 * groups.div_ceil(groups.div_ceil(16).next_multiple_of(threads));
        let t = Instant::now();
        pool.install(|| {
            for (ym, wm) in y.chunks_mut(576).zip(w.chunks(576 * K)) {
                ym.par_chunks_mut(gb4)
                    .zip(wm.par_chunks(gb4 * K))
                    .for_each(|(yb, wb)| {
                        for (yq, wq) in yb.chunks_exact_mut(4).zip(wb.chunks_exact(4 * K)) {
                            yq.copy_from_slice(&dot4_packed(wq, &x));
                        }
                    })
            }
        });
        runs[9].push(gb(t.elapsed().as_secs_f64()));
        for (i, at_once) in [(10, 1), (11, 2)] {
            let t = Instant::now();
            pool.install(|| transposed_pass(&w, &x, &mut y, 16, at_once));
            runs[i].push(gb(t.elapsed().as_secs_f64()));
        }
        let t = Instant::now();
        pool.install(|| transposed_columns_pass(&w, &x, &mut y, threads));
        runs[12].push(gb(t.elapsed().as_secs_f64()));
        anyhow::ensure!(y.iter().all(|v| v.is_finite()), "a product is not finite");
    }
    println!(
        "{} MB of {K}-wide rows, {threads} thread(s), medians of {rounds} rounds:",
        rows * K * 4 / 1_000_000
    );
    let probe = median(runs[0].clone());
    for (name, run) in names.iter().zip(runs) {
        let m = median(run);
        println!(
            "  {name:<28} {m:5.1} GB/s  {:3.0} % of the probe",
            100.0 * m / probe
        );
    }
    Ok(())
}
