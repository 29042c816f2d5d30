//! The paged decode kernels timed on their own (`kvbench bench-decode`): each partition
//! kernel over the same synthetic caches, batch × context cases at Llama-3.1-8B's shapes
//! by default, beside the card's device-to-device copy rate measured in the same run
//! (and a step's small kernels, RoPE and the greedy choice, beside candle's). A
//! lease's seconds then tell which kernel reads K/V fastest, where a performance cell per
//! kernel would take minutes. Every kernel's output is compared with the four-row vector
//! kernel's with its reduction launched (which `kvbench verify` checks against an f64
//! reference: trust these rows where `verify --kernels-only` passed on the same build)
//! and a kernel whose output differs, or whose folded reduction leaves its counters
//! raised, is reported as failed, not timed as if it were right.

use super::{
    device_of, kv_write, paged_decode_impl, partition_size, synchronize, DecodeKernel, DecodePin,
    DecodeReduce, DecodeShape, DecodeTables, LayerCache, MODULE, PTX,
};
use crate::error::Result;
use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{DType, Device, Tensor};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::Serialize;
use std::time::Instant;

/// Relative difference (max |a − b| / max |b|) accepted between a kernel's output and
/// the vector kernel's: both are bf16 results of f32 sums in other orders.
const AGREE_TOL: f64 = 1e-2;
/// The same for RoPE against candle's `rope_thd`, which rounds each product and the
/// difference to bf16 (kvbench's kernel rounds once): a few bf16 steps of the largest
/// operand, where a wrong pairing or table row differs by the order of the values.
const ROPE_AGREE_TOL: f64 = 3e-2;

/// A partition kernel and how its partitions' outputs are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeForm {
    pub kernel: DecodeKernel,
    pub reduce: DecodeReduce,
}

/// The forms timed, in order: the vector kernel with its reduction launched (the
/// reference) and folded, the one-row and pipelined kernels with it folded, then the
/// tensor-core kernel (the default) folded and launched, which decides the default
/// reduction (the scalar kernel is left out: it is the fallback, several times slower,
/// and would take most of the run).
pub const FORMS: [DecodeForm; 6] = [
    DecodeForm {
        kernel: DecodeKernel::Vector,
        reduce: DecodeReduce::Launched,
    },
    DecodeForm {
        kernel: DecodeKernel::Vector,
        reduce: DecodeReduce::Folded,
    },
    DecodeForm {
        kernel: DecodeKernel::VectorOneRow,
        reduce: DecodeReduce::Folded,
    },
    DecodeForm {
        kernel: DecodeKernel::Pipelined,
        reduce: DecodeReduce::Folded,
    },
    DecodeForm {
        kernel: DecodeKernel::TensorCore,
        reduce: DecodeReduce::Folded,
    },
    DecodeForm {
        kernel: DecodeKernel::TensorCore,
        reduce: DecodeReduce::Launched,
    },
];

/// The form every other is compared with.
pub const REFERENCE: DecodeForm = FORMS[0];

/// One decode launch shape: `rows` sequences of `ctx` cached tokens each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BenchCase {
    pub rows: usize,
    pub ctx: usize,
}

/// One kernel on one case.
#[derive(Debug, Clone, Serialize)]
pub struct BenchRow {
    pub kernel: &'static str,
    /// `folded` (in the partition kernel) or `launched` (a second kernel).
    pub reduction: &'static str,
    pub rows: usize,
    pub ctx: usize,
    /// Keys per partition the launch used.
    pub partition: usize,
    /// K and V bytes one launch reads (one layer).
    pub kv_bytes: u64,
    /// Median over the rounds of the mean time of a launch (partition pass and
    /// reduction, one kernel or two).
    pub seconds: f64,
    /// `kv_bytes / seconds`, GB/s.
    pub gb_per_s: f64,
    /// `gb_per_s` over the copy rate measured in the same run.
    pub of_copy: f64,
    /// Max |out − reference| / max |reference| of layer 0's output (the reference: the
    /// vector kernel with its reduction launched).
    pub rel_diff: f64,
    /// Whether the kernel takes this shape (head dim, group); where it does not, the
    /// row's measurements are null and it does not count as failed.
    pub applies: bool,
    /// Agrees with the reference, was timed, and left the folded reduction's counters
    /// at zero.
    pub pass: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct DecodeBench {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    /// Largest partition the launches may use (smaller when few rows would leave SMs idle).
    pub max_partition: usize,
    /// Device-to-device copy of 1 GiB: bytes read plus bytes written per second, GB/s
    /// (best of five).
    pub copy_gb_per_s: f64,
    pub rows: Vec<BenchRow>,
    /// RoPE and the greedy choice beside candle's operations ([`small_kernels`]).
    pub small: Vec<SmallRow>,
    /// InfiniGen's warm-up costs beside the forms they replaced ([`warmup_costs`]).
    pub warmup: Vec<WarmupRow>,
    /// A decode step's few-row products, kvbench's kernel beside cuBLAS's
    /// ([`products`]).
    pub products: Vec<ProductRow>,
    /// The default kernel at a few rows with each partition size pinned ([`run`] with
    /// `pinned`): whether the sizes the engine picks to fill the card (64 keys at one
    /// row of 1K) are the fastest where latency, not bytes, bounds a launch.
    pub partitions: Vec<BenchRow>,
}

/// Launches per timed round (cycling over the layers' caches) and rounds per kernel.
const LAUNCHES: usize = 32;
const ROUNDS: usize = 5;
/// Each case's caches span at least this many bytes in all, so that a launch reads its
/// layer from memory and not from the last launches' L2 (50 MB on an H100).
const SPAN_BYTES: u64 = 1 << 30;

/// Time `forms` on each case with heads `h`, KV heads `kvh`, head dim `d`, blocks of
/// `bs` tokens and partitions of at most `part` keys (exactly `part` keys where
/// `pinned`). `progress` is told each case.
#[allow(clippy::too_many_arguments)]
pub fn run(
    dev: &Device,
    (h, kvh, d): (usize, usize, usize),
    bs: usize,
    part: usize,
    cases: &[BenchCase],
    forms: &[DecodeForm],
    pinned: bool,
    seed: u64,
    progress: &mut dyn FnMut(&str),
) -> Result<DecodeBench> {
    if !REFERENCE.kernel.applies(d, h / kvh) {
        return Err(crate::error::Error::Config(format!(
            "bench-decode: the reference ({}) does not take head dim {d} with groups of {}: \
             choose a preset with head dim 64 or 128 and at most 8 query heads a KV head",
            REFERENCE.kernel.label(),
            h / kvh
        )));
    }
    let cuda = device_of(dev)?;
    let copy_gb_per_s = copy_rate(&cuda)?;
    progress(&format!(
        "device-to-device copy: {copy_gb_per_s:.0} GB/s (read + written)"
    ));
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    let shape = DecodeShape {
        num_heads: h,
        num_kv_heads: kvh,
        head_dim: d,
        block_size: bs,
        part_size: part,
    };
    let row_elems = kvh * d;
    for &c in cases {
        let blocks_per_row = c.ctx.div_ceil(bs);
        let blocks = c.rows * blocks_per_row;
        let kv_bytes = (2 * c.rows * c.ctx * row_elems * 2) as u64;
        let layers = SPAN_BYTES.div_ceil(kv_bytes.max(1)).clamp(1, 32) as usize;
        // Every row's blocks scattered over the pool, as a pool that has served many
        // requests holds them.
        let mut ids: Vec<i32> = (0..blocks as i32).collect();
        ids.shuffle(&mut rng);
        let tables: Vec<Vec<i32>> = ids.chunks(blocks_per_row).map(<[i32]>::to_vec).collect();
        let t = DecodeTables::new(&cuda, &tables, &vec![c.ctx; c.rows])?;
        let mut caches = Vec::with_capacity(layers);
        for _ in 0..layers {
            caches.push(random_cache(dev, &cuda, blocks * bs, kvh, d)?);
        }
        let q = Tensor::randn(0f32, 1f32, (c.rows, h, d), dev)?.to_dtype(DType::BF16)?;
        let p = if pinned {
            part
        } else {
            partition_size(part, c.rows * kvh, c.ctx)
        };
        let reference = launch(&caches[0], &q, &t, shape, REFERENCE, None)?;
        let pin = pinned.then_some(p);
        for &f in forms {
            let applies = f.kernel.applies(d, h / kvh);
            let (rel_diff, seconds, settled) = if applies {
                let o = launch(&caches[0], &q, &t, shape, f, pin)?;
                let rel_diff = rel_diff(&o, &reference)?;
                let seconds = time(&cuda, &caches, &q, &t, shape, f, pin)?;
                (rel_diff, seconds, t.counters_settled(&cuda)?)
            } else {
                (f64::NAN, f64::NAN, true)
            };
            let gb_per_s = kv_bytes as f64 / seconds / 1e9;
            let pass = !applies || (rel_diff <= AGREE_TOL && seconds.is_finite() && settled);
            progress(&format!(
                "{:<30} {:<8} batch {:>3} × {:>6} tokens (partition {p}): {:>8.1} µs, \
                 {:>6.0} GB/s, {:>5.1} % of the copy rate{}",
                f.kernel.label(),
                f.reduce.label(),
                c.rows,
                c.ctx,
                seconds * 1e6,
                gb_per_s,
                100.0 * gb_per_s / copy_gb_per_s,
                if !applies {
                    " (does not take this shape)".to_string()
                } else if !settled {
                    " FAILED (folded-reduction counters left raised)".to_string()
                } else if pass {
                    String::new()
                } else {
                    format!(" FAILED (differs from the reference by {rel_diff:.1e})")
                }
            ));
            out.push(BenchRow {
                kernel: f.kernel.label(),
                reduction: f.reduce.label(),
                rows: c.rows,
                ctx: c.ctx,
                partition: p,
                kv_bytes,
                seconds,
                gb_per_s,
                of_copy: gb_per_s / copy_gb_per_s,
                rel_diff,
                applies,
                pass,
            });
        }
    }
    Ok(DecodeBench {
        heads: h,
        kv_heads: kvh,
        head_dim: d,
        block_size: bs,
        max_partition: part,
        copy_gb_per_s,
        rows: out,
        small: Vec::new(),
        warmup: Vec::new(),
        products: Vec::new(),
        partitions: Vec::new(),
    })
}

/// A layer cache of `slots` slots of random bf16 K and V (drawn on the device).
fn random_cache(
    dev: &Device,
    cuda: &CudaDevice,
    slots: usize,
    kvh: usize,
    d: usize,
) -> Result<LayerCache> {
    let mut cache = LayerCache::new(cuda, slots, kvh * d)?;
    const CHUNK: usize = 1 << 16;
    for s0 in (0..slots).step_by(CHUNK) {
        let n = CHUNK.min(slots - s0);
        let k = Tensor::randn(0f32, 1f32, (n, kvh, d), dev)?.to_dtype(DType::BF16)?;
        let v = Tensor::randn(0f32, 1f32, (n, kvh, d), dev)?.to_dtype(DType::BF16)?;
        let ids: Vec<i32> = (s0 as i32..(s0 + n) as i32).collect();
        kv_write(&mut cache, &k, &v, &ids)?;
    }
    Ok(cache)
}

fn launch(
    cache: &LayerCache,
    q: &Tensor,
    t: &DecodeTables,
    s: DecodeShape,
    f: DecodeForm,
    part: Option<usize>,
) -> Result<Tensor> {
    let pin = DecodePin {
        kernel: Some(f.kernel),
        reduce: Some(f.reduce),
        part,
    };
    paged_decode_impl(cache, q, t, s, None, None, pin)
}

fn rel_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a = a.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let b = b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let scale = b.iter().fold(0f64, |m, x| m.max(x.abs() as f64));
    let diff = a
        .iter()
        .zip(&b)
        .fold(0f64, |m, (x, y)| m.max((x - y).abs() as f64));
    // A NaN anywhere makes the comparison fail rather than pass.
    if a.iter().chain(&b).any(|x| !x.is_finite()) || scale == 0.0 {
        return Ok(f64::INFINITY);
    }
    Ok(diff / scale)
}

/// Median over [`ROUNDS`] of the mean time of a launch, [`LAUNCHES`] launches a round
/// over the layers in turn (after one warm launch per layer: every layer's first read,
/// the module loaded).
fn time(
    cuda: &CudaDevice,
    caches: &[LayerCache],
    q: &Tensor,
    t: &DecodeTables,
    s: DecodeShape,
    f: DecodeForm,
    part: Option<usize>,
) -> Result<f64> {
    for c in caches {
        launch(c, q, t, s, f, part)?;
    }
    time_launches(cuda, LAUNCHES, |i| {
        launch(&caches[i % caches.len()], q, t, s, f, part).map(drop)
    })
}

/// Median over [`ROUNDS`] of the mean device time of `f(i)` for `i` in `0..launches`.
/// Each round is queued behind a kernel that keeps the device busy for a few
/// milliseconds, so the host has queued every launch before the first runs and the
/// events time the kernels back to back, not the host's pace; a round whose queueing
/// outlasted that kernel is measured again behind a longer one.
fn time_launches(
    cuda: &CudaDevice,
    launches: usize,
    mut f: impl FnMut(usize) -> Result<()>,
) -> Result<f64> {
    let stream = cuda.cuda_stream();
    synchronize(cuda)?;
    let mut rounds = Vec::with_capacity(ROUNDS);
    let mut spin_s = 5e-3;
    while rounds.len() < ROUNDS {
        spin(cuda, (spin_s * 1e9) as u64)?;
        let queued = Instant::now();
        let start = stream.record_event(Some(CU_EVENT_DEFAULT)).w()?;
        for i in 0..launches {
            f(i)?;
        }
        let end = stream.record_event(Some(CU_EVENT_DEFAULT)).w()?;
        let queueing = queued.elapsed().as_secs_f64();
        synchronize(cuda)?;
        let ms = start.elapsed_ms(&end).w()?;
        if queueing > 0.8 * spin_s && spin_s < 1.0 {
            spin_s = 2.0 * queueing;
            continue;
        }
        rounds.push(ms as f64 / 1e3 / launches as f64);
    }
    rounds.sort_by(f64::total_cmp);
    Ok(rounds[ROUNDS / 2])
}

/// A decode step's small kernels against the candle operations they replace, at
/// `rows` rows each.
#[derive(Debug, Clone, Serialize)]
pub struct SmallRow {
    /// `rope` (queries and keys of a step) or `argmax` (the greedy choice).
    pub op: &'static str,
    /// `kvbench` (`rope_qk_bf16`; `argmax_part_f32` + `argmax_merge`) or `candle`
    /// (`rope_thd` once per tensor; `argmax`).
    pub form: &'static str,
    pub rows: usize,
    /// RoPE: the median device time of a launch, queued back to back (as a CUDA graph
    /// replays it). argmax: the median host time of a call, which waits for the ids
    /// (as the engine does after each step).
    pub seconds: f64,
    /// RoPE: max |Δ| / max |candle's| over both outputs; argmax: the share of rows
    /// whose id differs from candle's (random logits: no ties).
    pub rel_diff: f64,
    pub pass: bool,
}

/// RoPE and the greedy choice, kvbench's kernels and candle's operations, at each of
/// `rows` with heads `h`, KV heads `kvh`, head dim `d` and `vocab` logits a row.
pub fn small_kernels(
    dev: &Device,
    (h, kvh, d): (usize, usize, usize),
    vocab: usize,
    rows: &[usize],
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<SmallRow>> {
    use candle_nn::rotary_emb::rope_thd;
    let cuda = device_of(dev)?;
    let mut out = Vec::new();
    let mut push = |out: &mut Vec<SmallRow>, r: SmallRow| {
        progress(&format!(
            "{:<6} {:<7} {:>3} rows: {:>8.1} µs{}",
            r.op,
            r.form,
            r.rows,
            r.seconds * 1e6,
            if r.pass {
                String::new()
            } else {
                format!(" FAILED (differs from candle's by {:.1e})", r.rel_diff)
            }
        ));
        out.push(r);
    };
    for &n in rows {
        let q = Tensor::randn(0f32, 1f32, (n, h, d), dev)?.to_dtype(DType::BF16)?;
        let k = Tensor::randn(0f32, 1f32, (n, kvh, d), dev)?.to_dtype(DType::BF16)?;
        let angles = (Tensor::rand(0f32, 1f32, (n, d / 2), dev)? * 1000.0)?;
        let cos = angles.cos()?.to_dtype(DType::BF16)?;
        let sin = angles.sin()?.to_dtype(DType::BF16)?;
        let ours = || -> Result<(Tensor, Tensor)> {
            super::rope_pair(&q, &k, &cos, &sin)?.ok_or_else(|| {
                crate::error::Error::Config("rope_pair refused the bench's tensors".into())
            })
        };
        let candles = || -> Result<(Tensor, Tensor)> {
            let one = |x: &Tensor| -> Result<Tensor> {
                Ok(rope_thd(&x.unsqueeze(0)?, &cos, &sin)?.squeeze(0)?)
            };
            Ok((one(&q)?, one(&k)?))
        };
        let (a, b) = (ours()?, candles()?);
        let diff = rel_diff(&a.0, &b.0)?.max(rel_diff(&a.1, &b.1)?);
        for (form, seconds) in [
            (
                "kvbench",
                time_launches(&cuda, SMALL_LAUNCHES, |_| ours().map(drop))?,
            ),
            (
                "candle",
                time_launches(&cuda, SMALL_LAUNCHES, |_| candles().map(drop))?,
            ),
        ] {
            push(
                &mut out,
                SmallRow {
                    op: "rope",
                    form,
                    rows: n,
                    seconds,
                    rel_diff: diff,
                    pass: diff <= ROPE_AGREE_TOL && seconds.is_finite(),
                },
            );
        }

        let logits = Tensor::randn(0f32, 1f32, (n, vocab), dev)?;
        let ours = || super::argmax_rows(&logits);
        let candles = || -> Result<Vec<u32>> {
            Ok(logits
                .argmax(candle_core::D::Minus1)?
                .to_dtype(DType::U32)?
                .to_vec1::<u32>()?)
        };
        let (a, b) = (ours()?, candles()?);
        let differ = a.iter().zip(&b).filter(|(x, y)| x != y).count() as f64 / n as f64;
        for (form, seconds) in [
            ("kvbench", host_median(|| ours().map(drop))?),
            ("candle", host_median(|| candles().map(drop))?),
        ] {
            push(
                &mut out,
                SmallRow {
                    op: "argmax",
                    form,
                    rows: n,
                    seconds,
                    rel_diff: differ,
                    pass: differ == 0.0 && a.len() == n && seconds.is_finite(),
                },
            );
        }
    }
    Ok(out)
}

/// Launches a round of the small kernels' timing (each a few microseconds).
const SMALL_LAUNCHES: usize = 200;

/// One of InfiniGen's costs before a cell's first step, in the current and the earlier
/// form.
#[derive(Debug, Clone, Serialize)]
pub struct WarmupRow {
    /// `fingerprint` (the weights' hash keying the skewing cache) or `pin` (the host
    /// tier's pinned, device-mapped chunks).
    pub op: &'static str,
    /// fingerprint: `staged` (through one pinned buffer) or `candle` (a pageable copy
    /// of the storage); pin: `parallel` (chunks on all cores) or `serial` (one thread).
    pub form: &'static str,
    pub bytes: u64,
    /// The better of two rounds.
    pub seconds: f64,
    /// `bytes / seconds`, GB/s.
    pub gb_per_s: f64,
    /// fingerprint: both forms gave the same digest; pin: every chunk was pinned.
    pub pass: bool,
}

/// The weights' fingerprint of `bytes` of bf16 on the device, staged and through
/// candle (the digests compared), then `bytes` of host tier pinned in 256 MiB chunks
/// in parallel and on one thread: what an InfiniGen cell spends before its first step
/// (about 18 s and 8-10 s of each cell of Llama-3.1-8B at batch 16-32 in the earlier
/// forms on an H100).
pub fn warmup_costs(
    dev: &Device,
    bytes: usize,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<WarmupRow>> {
    use crate::policy::infinigen::cuda::pin_chunk;
    use crate::policy::infinigen::skew::{hash_staged, hash_tensor, Stage};
    use rayon::prelude::*;
    let cuda = device_of(dev)?;
    let mut out = Vec::new();
    let mut push = |out: &mut Vec<WarmupRow>, op, form, seconds: f64, pass| {
        let gb_per_s = bytes as f64 / seconds / 1e9;
        progress(&format!(
            "{op:<11} {form:<8} {:>5.2} GiB: {seconds:>7.3} s, {gb_per_s:>6.1} GB/s{}",
            bytes as f64 / (1u64 << 30) as f64,
            if pass { "" } else { " FAILED" }
        ));
        out.push(WarmupRow {
            op,
            form,
            bytes: bytes as u64,
            seconds,
            gb_per_s,
            pass: pass && seconds.is_finite(),
        });
    };
    let t = Tensor::rand(-1f32, 1f32, bytes / 2, dev)?.to_dtype(DType::BF16)?;
    synchronize(&cuda)?;
    let mut stage = Stage::new(&cuda)?;
    let best = |f: &mut dyn FnMut() -> Result<u64>| -> Result<(f64, u64)> {
        let mut fastest = f64::INFINITY;
        let mut digest = 0;
        for _ in 0..2 {
            let t0 = Instant::now();
            digest = f()?;
            fastest = fastest.min(t0.elapsed().as_secs_f64());
        }
        Ok((fastest, digest))
    };
    let (staged_s, staged) = best(&mut || hash_staged("dense", &t, &mut stage))?;
    let (candle_s, host) = best(&mut || hash_tensor("dense", &t))?;
    drop((t, stage));
    push(&mut out, "fingerprint", "staged", staged_s, staged == host);
    push(&mut out, "fingerprint", "candle", candle_s, staged == host);

    let chunk = 256usize << 20; // bytes, as the host tier's
    let chunks = bytes.div_ceil(chunk);
    let ctx = cuda.cuda_stream().context().clone();
    // The better of two rounds of pinning alone: the chunks are unpinned after the
    // clock stops (a warm-up never unpins).
    let pin = |parallel: bool| -> Result<(f64, u64)> {
        let mut fastest = f64::INFINITY;
        let mut n = 0;
        for _ in 0..2 {
            let t0 = Instant::now();
            let pinned: Vec<_> = if parallel {
                (0..chunks)
                    .into_par_iter()
                    .map(|_| pin_chunk(&ctx, chunk / 2))
                    .collect::<Result<_>>()?
            } else {
                (0..chunks)
                    .map(|_| pin_chunk(&ctx, chunk / 2))
                    .collect::<Result<_>>()?
            };
            fastest = fastest.min(t0.elapsed().as_secs_f64());
            n = pinned.len() as u64;
            drop(pinned);
        }
        Ok((fastest, n))
    };
    let (parallel_s, n_par) = pin(true)?;
    let (serial_s, n_ser) = pin(false)?;
    let all = |n: u64| n == chunks as u64;
    push(&mut out, "pin", "parallel", parallel_s, all(n_par));
    push(&mut out, "pin", "serial", serial_s, all(n_ser));
    Ok(out)
}

/// One of a decode step's products at a few rows, in kvbench's kernel or cuBLAS's.
#[derive(Debug, Clone, Serialize)]
pub struct ProductRow {
    /// `qkv` (Q, K and V as one matrix, as one row takes them), `o`, `gate_up` (the
    /// stacked pair, the input broadcast over it), `down` or `head`.
    pub matrix: &'static str,
    /// `kvbench` (`gemv_bf16`) or `cublas` (candle's product, the call the model makes
    /// without it).
    pub form: &'static str,
    pub rows: usize,
    /// Weight bytes one product reads.
    pub bytes: u64,
    /// Median over the rounds of the mean device time of a product, queued back to back
    /// (as a CUDA graph replays them), each over another copy of the matrix.
    pub seconds: f64,
    /// `bytes / seconds`, GB/s.
    pub gb_per_s: f64,
    /// `gb_per_s` over the copy rate measured in the same run.
    pub of_copy: f64,
    /// max |kvbench's − cuBLAS's| / max |cuBLAS's| (the same on both forms' rows).
    pub rel_diff: f64,
    pub pass: bool,
}

/// Each of a decode step's matrices (`[g, n, k]`: Q/K/V, O, gate/up, down, the head of
/// `cfg`) at each of `rows` input rows, in kvbench's matrix-vector kernel and in
/// cuBLAS's: the rate each reads the weights at, against the copy rate of the same run
/// (`copy_gb_per_s`). The weights the step reads bound a batch-1 step, so this says
/// whether a product kernel of its own could bring it closer to that bound.
pub fn products(
    dev: &Device,
    cfg: &crate::config::ModelConfig,
    rows: &[usize],
    copy_gb_per_s: f64,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<ProductRow>> {
    let cuda = device_of(dev)?;
    let (d, q, kv, ff) = (
        cfg.hidden_size,
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    );
    let matrices: [(&'static str, usize, usize, usize); 5] = [
        ("qkv", 1, q + 2 * kv, d),
        ("o", 1, d, q),
        ("gate_up", 2, ff, d),
        ("down", 1, d, ff),
        ("head", 1, cfg.vocab_size, d),
    ];
    let mut out = Vec::new();
    for (matrix, g, n, k) in matrices {
        let bytes = (g * n * k * 2) as u64;
        // Copies enough that a product reads its matrix from memory, not from the L2
        // the one before left.
        let copies = SPAN_BYTES.div_ceil(bytes).clamp(1, 32) as usize;
        let ws: Vec<Tensor> = (0..copies)
            .map(|_| {
                let w =
                    (Tensor::randn(0f32, 1f32, (g * n, k), dev)? * 0.02)?.to_dtype(DType::BF16)?;
                Ok(if g == 1 { w } else { w.reshape((g, n, k))? })
            })
            .collect::<Result<_>>()?;
        for &t in rows {
            let x = Tensor::randn(0f32, 1f32, (t, k), dev)?.to_dtype(DType::BF16)?;
            let ours = |w: &Tensor| -> Result<Tensor> {
                super::gemv(&x, w)?.ok_or_else(|| {
                    crate::error::Error::Config(format!(
                        "gemv refused {t} rows with [{g}, {n}, {k}]"
                    ))
                })
            };
            let cublas = |w: &Tensor| crate::model::candle_product(&x, w);
            let diff = rel_diff(&ours(&ws[0])?, &cublas(&ws[0])?)?;
            for c in &ws {
                ours(c)?;
                cublas(c)?;
            }
            for (form, seconds) in [
                (
                    "kvbench",
                    time_launches(&cuda, LAUNCHES, |i| ours(&ws[i % copies]).map(drop))?,
                ),
                (
                    "cublas",
                    time_launches(&cuda, LAUNCHES, |i| cublas(&ws[i % copies]).map(drop))?,
                ),
            ] {
                let gb_per_s = bytes as f64 / seconds / 1e9;
                let pass = diff <= AGREE_TOL && seconds.is_finite();
                progress(&format!(
                    "product {matrix:<8} {form:<8} {t} row(s), {:>7.1} MB: {:>8.1} µs, \
                     {gb_per_s:>6.0} GB/s, {:>5.1} % of the copy rate{}",
                    bytes as f64 / 1e6,
                    seconds * 1e6,
                    100.0 * gb_per_s / copy_gb_per_s,
                    if pass {
                        String::new()
                    } else {
                        format!(" FAILED (kvbench's differs from cuBLAS's by {diff:.1e})")
                    }
                ));
                out.push(ProductRow {
                    matrix,
                    form,
                    rows: t,
                    bytes,
                    seconds,
                    gb_per_s,
                    of_copy: gb_per_s / copy_gb_per_s,
                    rel_diff: diff,
                    pass,
                });
            }
        }
    }
    Ok(out)
}

/// Median host time of 51 calls of `f` (after one), each of which waits for its result.
fn host_median(mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let mut t: Vec<f64> = (0..51)
        .map(|_| {
            let at = std::time::Instant::now();
            f().map(|()| at.elapsed().as_secs_f64())
        })
        .collect::<Result<_>>()?;
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// Keep the device busy for `ns` nanoseconds (kernels.cu's `spin_ns`).
fn spin(cuda: &CudaDevice, ns: u64) -> Result<()> {
    let f = cuda.get_or_load_custom_func("spin_ns", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&ns);
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// Best of five device-to-device copies of 1 GiB: (read + written bytes) per second, GB/s.
fn copy_rate(cuda: &CudaDevice) -> Result<f64> {
    let n = 1usize << 29; // u16 elements: 1 GiB
    let src = cuda.alloc_zeros::<u16>(n)?;
    let mut dst = cuda.alloc_zeros::<u16>(n)?;
    let stream = cuda.cuda_stream();
    stream.memcpy_dtod(&src, &mut dst).w()?;
    synchronize(cuda)?;
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let start = stream.record_event(Some(CU_EVENT_DEFAULT)).w()?;
        stream.memcpy_dtod(&src, &mut dst).w()?;
        let end = stream.record_event(Some(CU_EVENT_DEFAULT)).w()?;
        synchronize(cuda)?;
        best = best.min(start.elapsed_ms(&end).w()? as f64 / 1e3);
    }
    Ok(2.0 * (n * 2) as f64 / best / 1e9)
}
