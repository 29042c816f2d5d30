//! The layer's elementwise work on the CPU (the residual add and RMSNorm, SwiGLU's
//! product, RoPE), split
//! over the thread pool that runs the forward. candle runs these operations on a pool
//! of its own, whose worker sleeps between two of them and is woken for each: in a
//! 576-token prefill, about half of the time the forward's thread ran alone went to
//! waiting for it, and the prefill took about 1.18× as long
//! (docs/correctness-and-performance.md). The arithmetic is candle's, element for
//! element, so the results are the same to the bit, but for SwiGLU's `e^x`: candle
//! calls libm once an element, and a vector `e^x` took SwiGLU from about 35 ms of a
//! 576-token prefill to a few (its own error bound, below).

use crate::error::Result;
use candle_core::{CpuStorage, DType, Storage, Tensor};
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// Elements below which the work stays on the calling thread (a decode step's rows:
/// a few microseconds).
const SERIAL: usize = 1 << 15;
/// Elements a job takes at least.
const MIN_JOB: usize = 1 << 13;

/// Whether `t` is f32 on the CPU (what these kernels take).
pub(crate) fn cpu_f32(t: &Tensor) -> bool {
    t.device().is_cpu() && t.dtype() == DType::F32
}

/// `a + b` for two f32 CPU tensors of one shape; `None` where that does not hold
/// (candle's operation then runs).
pub fn add(a: &Tensor, b: &Tensor) -> Result<Option<Tensor>> {
    zip_with(a, b, |xa, xb, out| {
        for ((o, &x), &y) in out.iter_mut().zip(xa).zip(xb) {
            o.write(x + y);
        }
    })
}

/// `silu(gate) · up` as candle writes it (`g / (1 + e^{−g}) · u`) but with the vector
/// `e^x` of the attention kernels ([`crate::attention::paged::exp`], relative error
/// below 3e-7) in place of libm's, so that the loop runs in vector registers: within
/// 1e-6 of candle's, relative (a test checks), and the same bits on every CPU (no
/// libm in it). `None` unless both are f32 CPU tensors of one shape.
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Option<Tensor>> {
    zip_with(gate, up, silu_mul_run)
}

/// [`silu_mul`] of one run, in the widest registers the CPU has (the same operations
/// in each: no fused multiply-adds, so the same bits).
fn silu_mul_run(g: &[f32], u: &[f32], out: &mut [MaybeUninit<f32>]) {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::attention::paged::{has_avx2_fma, has_avx512};
        if has_avx512() {
            // SAFETY: the CPU has AVX-512F (checked just above).
            return unsafe { silu_mul_avx512(g, u, out) };
        }
        if has_avx2_fma() {
            // SAFETY: the CPU has AVX2 (checked just above).
            return unsafe { silu_mul_avx2(g, u, out) };
        }
    }
    silu_mul_body(g, u, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f")]
unsafe fn silu_mul_avx512(g: &[f32], u: &[f32], out: &mut [MaybeUninit<f32>]) {
    silu_mul_body(g, u, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_avx2(g: &[f32], u: &[f32], out: &mut [MaybeUninit<f32>]) {
    silu_mul_body(g, u, out)
}

#[inline(always)]
fn silu_mul_body(g: &[f32], u: &[f32], out: &mut [MaybeUninit<f32>]) {
    use crate::attention::paged::exp;
    for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
        o.write(g / (1.0 + exp(-g)) * u);
    }
}

/// Rows of a norm taken together: each row's sum of squares is one chain of additions
/// in element order (candle's), and eight independent chains keep the adder busy
/// where one waits on each addition's latency.
const NORM_ROWS: usize = 8;

/// One job of [`add_rms_norm`]: its rows of both outputs, and the index and rows of
/// its input.
type RowsItem<'a> = (
    (&'a mut [MaybeUninit<f32>], &'a mut [MaybeUninit<f32>]),
    (usize, &'a [f32]),
);

/// `x + r` (the residual, when `r` is given) and RMSNorm of it with weights `w`, in
/// one pass over the rows: candle's arithmetic (the sum of squares in element order
/// from −0.0, `x / √(Σx²/n + ε) · w` element by element), so the same bits as
/// `candle_nn::ops::rms_norm` after the add. `None` unless all are f32 CPU tensors,
/// contiguous, `x` and `r` of one shape and `w` as long as a row.
pub fn add_rms_norm(
    x: &Tensor,
    r: Option<&Tensor>,
    w: &Tensor,
    eps: f32,
) -> Result<Option<(Tensor, Tensor)>> {
    let n = match x.dims().last() {
        Some(&n) if n > 0 => n,
        _ => return Ok(None),
    };
    if !cpu_f32(x)
        || !cpu_f32(w)
        || w.dims() != [n]
        || r.is_some_and(|r| !cpu_f32(r) || r.shape() != x.shape())
    {
        return Ok(None);
    }
    let guards: Vec<_> = [Some(x), r, Some(w)]
        .into_iter()
        .flatten()
        .map(|t| t.storage_and_layout())
        .collect();
    let mut slices = Vec::with_capacity(3);
    for (s, l) in &guards {
        let (Storage::Cpu(CpuStorage::F32(d)), Some((a, b))) = (&**s, l.contiguous_offsets())
        else {
            return Ok(None);
        };
        slices.push(&d[a..b]);
    }
    let (xs, rs, ws) = match slices[..] {
        [xs, rs, ws] => (xs, Some(rs), ws),
        [xs, ws] => (xs, None, ws),
        _ => return Ok(None),
    };
    let (sum, h) = add_rms_norm_rows(xs, rs, ws, eps);
    drop(guards);
    Ok(Some((
        Tensor::from_vec(sum, x.shape(), x.device())?,
        Tensor::from_vec(h, x.shape(), x.device())?,
    )))
}

/// [`add_rms_norm`] on rows of `ws.len()` elements (not none; the tensor form checks
/// it): `xs` (and `rs`, as long) in, the sum and the normed rows out.
pub fn add_rms_norm_rows(
    xs: &[f32],
    rs: Option<&[f32]>,
    ws: &[f32],
    eps: f32,
) -> (Vec<f32>, Vec<f32>) {
    let n = ws.len();
    // Both outputs are written in full below: left unset rather than zeroed first.
    let len = xs.len();
    let (mut sum, mut h) = (
        Vec::<f32>::with_capacity(len),
        Vec::<f32>::with_capacity(len),
    );
    let rows = |((so, ho), (i, xi)): RowsItem<'_>| {
        let start = i * NORM_ROWS * n;
        let ri = rs.map(|rs| &rs[start..start + xi.len()]);
        // The residual's element `e` of these rows (the same sum each time it is read).
        let at = |e: usize| match ri {
            Some(ri) => xi[e] + ri[e],
            None => xi[e],
        };
        let k = xi.len() / n;
        let mut acc = [-0.0f32; NORM_ROWS];
        for j in 0..n {
            for (q, a) in acc.iter_mut().take(k).enumerate() {
                let v = at(q * n + j);
                so[q * n + j].write(v);
                *a += v * v;
            }
        }
        for (q, (hr, s2)) in ho.chunks_exact_mut(n).zip(acc).enumerate() {
            let m = (s2 / n as f32 + eps).sqrt();
            for (j, (d, &a)) in hr.iter_mut().zip(ws).enumerate() {
                d.write(at(q * n + j) / m * a);
            }
        }
    };
    let chunk = NORM_ROWS * n;
    let (so, ho) = (
        &mut sum.spare_capacity_mut()[..len],
        &mut h.spare_capacity_mut()[..len],
    );
    if len < SERIAL || rayon::current_num_threads() == 1 {
        so.chunks_mut(chunk)
            .zip(ho.chunks_mut(chunk))
            .zip(xs.chunks(chunk).enumerate())
            .for_each(rows);
    } else {
        so.par_chunks_mut(chunk)
            .zip(ho.par_chunks_mut(chunk))
            .zip(xs.par_chunks(chunk).enumerate())
            .with_min_len(MIN_JOB.div_ceil(chunk))
            .for_each(rows);
    }
    // SAFETY: the chunks cover both buffers' first `len` elements, and every element of
    // each chunk was written above.
    unsafe {
        sum.set_len(len);
        h.set_len(len);
    }
    (sum, h)
}

/// RoPE of `x` (`[T, heads, dh]`) with row `t`'s `cos`/`sin` (`[T, dh/2]`), in the
/// layout it has: candle's CPU kernel wants `[heads, T, dh]`, and the two transposing
/// copies around it and the kernel took 25-30 ms of a 576-token prefill of SmolLM2
/// (docs/correctness-and-performance.md, "RoPE in the layout it comes in"). Each element
/// is candle's expression (`x0·cos − x1·sin`, `x0·sin + x1·cos`): the same bits. `None`
/// unless all three are contiguous f32 on the CPU of those shapes.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, interleaved: bool) -> Result<Option<Tensor>> {
    if !cpu_f32(x) || !cpu_f32(cos) || !cpu_f32(sin) || x.rank() != 3 {
        return Ok(None);
    }
    let (t, heads, dh) = x.dims3()?;
    let row = heads * dh;
    if row == 0 || dh % 2 != 0 || cos.dims() != [t, dh / 2] || sin.dims() != [t, dh / 2] {
        return Ok(None);
    }
    let (sx, lx) = x.storage_and_layout();
    let (sc, lc) = cos.storage_and_layout();
    let (ss, ls) = sin.storage_and_layout();
    let (
        Storage::Cpu(CpuStorage::F32(dx)),
        Storage::Cpu(CpuStorage::F32(dc)),
        Storage::Cpu(CpuStorage::F32(ds)),
    ) = (&*sx, &*sc, &*ss)
    else {
        return Ok(None);
    };
    let (Some((x0, x1)), Some((c0, c1)), Some((s0, s1))) = (
        lx.contiguous_offsets(),
        lc.contiguous_offsets(),
        ls.contiguous_offsets(),
    ) else {
        return Ok(None);
    };
    let (xs, cs, ss) = (&dx[x0..x1], &dc[c0..c1], &ds[s0..s1]);
    let mut out = xs.to_vec();
    rope_rows(&mut out, row, cs, ss, interleaved);
    drop((sx, sc, ss));
    Ok(Some(Tensor::from_vec(out, x.shape(), x.device())?))
}

/// [`rope`] in place on rows of `row` elements (`x`: `[T, heads, dh]` as one slice),
/// row `t` by `cos`/`sin`'s row `t` (`[T, dh/2]`).
pub fn rope_rows(x: &mut [f32], row: usize, cos: &[f32], sin: &[f32], interleaved: bool) {
    let t = x.len() / row.max(1);
    let half = cos.len() / t.max(1);
    let rotate = |(i, r): (usize, &mut [f32])| {
        let (c, s) = (
            &cos[i * half..(i + 1) * half],
            &sin[i * half..(i + 1) * half],
        );
        crate::policy::rotate_in_place(r, c, s, interleaved);
    };
    if x.len() < SERIAL || rayon::current_num_threads() == 1 {
        x.chunks_mut(row).enumerate().for_each(rotate);
    } else {
        x.par_chunks_mut(row)
            .enumerate()
            .with_min_len(MIN_JOB.div_ceil(row))
            .for_each(rotate);
    }
}

/// `f` over matching runs of `a` and `b` into a new tensor of their shape (each run
/// written in full by `f`), split over the pool for many elements.
fn zip_with(
    a: &Tensor,
    b: &Tensor,
    f: impl Fn(&[f32], &[f32], &mut [MaybeUninit<f32>]) + Sync,
) -> Result<Option<Tensor>> {
    if !cpu_f32(a) || !cpu_f32(b) || a.shape() != b.shape() {
        return Ok(None);
    }
    let (sa, la) = a.storage_and_layout();
    let (sb, lb) = b.storage_and_layout();
    let (Storage::Cpu(CpuStorage::F32(da)), Storage::Cpu(CpuStorage::F32(db))) = (&*sa, &*sb)
    else {
        return Ok(None);
    };
    let (Some((a0, a1)), Some((b0, b1))) = (la.contiguous_offsets(), lb.contiguous_offsets())
    else {
        return Ok(None);
    };
    let out = zip_slices(&da[a0..a1], &db[b0..b1], f);
    drop((sa, sb));
    Ok(Some(Tensor::from_vec(out, a.shape(), a.device())?))
}

/// [`zip_with`] on two slices of one length.
fn zip_slices(
    xa: &[f32],
    xb: &[f32],
    f: impl Fn(&[f32], &[f32], &mut [MaybeUninit<f32>]) + Sync,
) -> Vec<f32> {
    let n = xa.len().min(xb.len());
    let mut out: Vec<f32> = Vec::with_capacity(n);
    let o = &mut out.spare_capacity_mut()[..n];
    if n < SERIAL || rayon::current_num_threads() == 1 {
        f(&xa[..n], &xb[..n], o);
    } else {
        o.par_chunks_mut(MIN_JOB)
            .zip(xa.par_chunks(MIN_JOB).zip(xb.par_chunks(MIN_JOB)))
            .for_each(|(o, (x, y))| f(x, y, o));
    }
    // SAFETY: `f` wrote every element of each run, and the runs cover the first `n`.
    unsafe { out.set_len(n) };
    out
}

/// [`silu_mul`] of two slices of one length.
pub fn silu_mul_rows(gate: &[f32], up: &[f32]) -> Vec<f32> {
    zip_slices(gate, up, silu_mul_run)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn random(shape: (usize, usize), seed: u64) -> Tensor {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let v: Vec<f32> = (0..shape.0 * shape.1)
            .map(|_| rng.random_range(-12.0f32..12.0))
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    /// Whether `a` and `b` have one shape and the same bits.
    fn same_bits(a: &Tensor, b: &Tensor) -> bool {
        a.dims() == b.dims()
            && values(a)
                .iter()
                .zip(&values(b))
                .all(|(x, y)| x.to_bits() == y.to_bits())
    }

    fn pool() -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap()
    }

    /// The residual add, the add with RMSNorm and RoPE give candle's bits, on the
    /// calling thread (few rows) and split over the pool, for contiguous views at an
    /// offset (the halves of a batched gate/up product).
    #[test]
    fn add_norm_and_rope_match_candle_to_the_bit() {
        let pool = pool();
        for rows in [1, 576] {
            let y = Tensor::stack(&[random((rows, 1536), 1), random((rows, 1536), 2)], 0).unwrap();
            let (g, u) = (y.get(0).unwrap(), y.get(1).unwrap());
            let got = pool
                .install(|| add(&g, &u))
                .unwrap()
                .expect("f32 on the CPU");
            assert!(same_bits(&got, &(&g + &u).unwrap()), "add, {rows} rows");
        }
        // With and without the add, rows in whole groups of eight and not.
        for rows in [1, 3, 16, 579] {
            let x = random((rows, 576), 9);
            let r = random((rows, 576), 10);
            let w = random((1, 576), 11).squeeze(0).unwrap();
            for with_r in [true, false] {
                let sum = if with_r {
                    (&x + &r).unwrap()
                } else {
                    x.clone()
                };
                let want = candle_nn::ops::rms_norm(&sum, &w, 1e-5).unwrap();
                let (got_sum, got) = pool
                    .install(|| add_rms_norm(&x, with_r.then_some(&r), &w, 1e-5))
                    .unwrap()
                    .expect("f32 on the CPU");
                assert!(same_bits(&got_sum, &sum), "sum, {rows} rows, add {with_r}");
                assert!(same_bits(&got, &want), "norm, {rows} rows, add {with_r}");
            }
        }
        // RoPE against candle's kernels on the head-major layout, both pairings.
        for rows in [1, 577] {
            let x = random((rows, 9 * 64), 6).reshape((rows, 9, 64)).unwrap();
            let cos = random((rows, 32), 7);
            let sin = random((rows, 32), 8);
            let hm = x
                .transpose(0, 1)
                .unwrap()
                .unsqueeze(0)
                .unwrap()
                .contiguous()
                .unwrap();
            for interleaved in [false, true] {
                let want = if interleaved {
                    candle_nn::rotary_emb::rope_i(&hm, &cos, &sin).unwrap()
                } else {
                    candle_nn::rotary_emb::rope(&hm, &cos, &sin).unwrap()
                };
                let want = want.squeeze(0).unwrap().transpose(0, 1).unwrap();
                let got = pool
                    .install(|| rope(&x, &cos, &sin, interleaved))
                    .unwrap()
                    .expect("f32 on the CPU");
                assert!(
                    same_bits(&got, &want),
                    "{rows} rows, interleaved {interleaved}"
                );
            }
        }
    }

    /// `silu(gate) · up` within 1e-6 of candle's (libm's `e^x`), relative, or absolute
    /// near 0, over the model's range and past the end of `e^x`'s; the same bits on
    /// one thread as over the pool.
    #[test]
    fn silu_mul_is_within_1e_6_of_candle() {
        let pool = pool();
        for rows in [1, 576] {
            let mut y =
                Tensor::stack(&[random((rows, 1536), 1), random((rows, 1536), 2)], 0).unwrap();
            if rows == 1 {
                let edges = [
                    -100.0f32, -88.5, -87.0, -20.0, -1e-6, 0.0, 1e-6, 20.0, 88.5, 100.0,
                ];
                let mut v = values(&y);
                v[..edges.len()].copy_from_slice(&edges);
                y = Tensor::from_vec(v, y.shape(), &Device::Cpu).unwrap();
            }
            let (g, u) = (y.get(0).unwrap(), y.get(1).unwrap());
            let want = values(&(candle_nn::ops::silu(&g).unwrap() * &u).unwrap());
            let got = pool
                .install(|| silu_mul(&g, &u))
                .unwrap()
                .expect("f32 on the CPU");
            let worst = values(&got)
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs() / b.abs().max(1e-3))
                .fold(0f32, f32::max);
            assert!(worst < 1e-6, "silu · up off by {worst}, {rows} rows");
            let one = silu_mul(&g, &u).unwrap().expect("f32 on the CPU");
            assert!(same_bits(&one, &got), "{rows} rows");
        }
    }

    #[test]
    fn other_inputs_are_left_to_candle() {
        let a = random((4, 8), 3);
        assert!(
            add(&a, &random((8, 4), 4)).unwrap().is_none(),
            "shapes differ"
        );
        assert!(
            add(&a.t().unwrap(), &random((8, 4), 5)).unwrap().is_none(),
            "strided"
        );
        let bf = a.to_dtype(DType::BF16).unwrap();
        assert!(silu_mul(&bf, &bf).unwrap().is_none(), "bf16");
        // No rows, or rows of no heads: nothing to rotate, and no panic.
        let none = Tensor::zeros((0, 9, 64), DType::F32, &Device::Cpu).unwrap();
        let cs = Tensor::zeros((0, 32), DType::F32, &Device::Cpu).unwrap();
        let y = rope(&none, &cs, &cs, false)
            .unwrap()
            .expect("f32 on the CPU");
        assert_eq!(y.dims(), &[0, 9, 64]);
        let empty = Tensor::zeros((2, 0, 64), DType::F32, &Device::Cpu).unwrap();
        let cs = Tensor::zeros((2, 32), DType::F32, &Device::Cpu).unwrap();
        assert!(rope(&empty, &cs, &cs, false).unwrap().is_none(), "no heads");
        let w = random((1, 8), 6).squeeze(0).unwrap();
        assert!(add_rms_norm(&bf, None, &w, 1e-5).unwrap().is_none(), "bf16");
        assert!(
            add_rms_norm(&a, None, &random((1, 4), 7).squeeze(0).unwrap(), 1e-5)
                .unwrap()
                .is_none(),
            "weights of another length"
        );
    }
}
