//! Paged attention on CPU: each query row reads its keys block by block through the
//! sequence's block table (no gather into a contiguous copy), with an online softmax
//! in f32 so memory stays O(dh) per row whatever the context length.

use crate::kv::paged::KvView;
use crate::kv::BlockId;
use rayon::prelude::*;

/// One sequence's part of a packed (varlen) step.
#[derive(Debug, Clone, Copy)]
pub struct SeqAttn<'a> {
    /// First row of this sequence in the packed query tensor.
    pub q_start: usize,
    /// Number of query rows (1 for decode, the chunk length for prefill).
    pub q_len: usize,
    /// Keys visible after this step's K/V were written (context + new tokens).
    pub kv_len: usize,
    pub table: &'a [BlockId],
}

/// Shapes shared by every call of one model.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
}

/// `q`: `[T, H, dh]` packed rows; returns `[T, H, dh]`. Row `i` of a sequence sits at
/// absolute position `kv_len − q_len + i` and attends keys `0..=` that position.
pub fn paged_attention(
    q: &[f32],
    seqs: &[SeqAttn<'_>],
    k: KvView<'_>,
    v: KvView<'_>,
    shape: AttnShape,
) -> Vec<f32> {
    run(q, seqs, k, v, shape)
}

fn run(q: &[f32], seqs: &[SeqAttn<'_>], k: KvView<'_>, v: KvView<'_>, s: AttnShape) -> Vec<f32> {
    let (h, hkv, dh) = (s.num_heads, s.num_kv_heads, s.head_dim);
    let rows: usize = seqs.iter().map(|x| x.q_start + x.q_len).max().unwrap_or(0);
    debug_assert!(q.len() >= rows * h * dh);
    // Row → (sequence, absolute position).
    let mut row_info = vec![None; rows];
    for (si, sq) in seqs.iter().enumerate() {
        for i in 0..sq.q_len {
            row_info[sq.q_start + i] = Some((si, sq.kv_len - sq.q_len + i));
        }
    }
    let mut out = vec![0f32; rows * h * dh];
    // One work item = one query row and a range of KV heads: all of them when there are
    // enough rows, one per item when there are few (small-batch decode) so every core
    // has work.
    let heads_per_item = if rows >= 2 * rayon::current_num_threads() {
        hkv
    } else {
        1
    };
    let items_per_row = hkv / heads_per_item;
    let chunk = heads_per_item * (h / hkv) * dh;
    let avx = has_avx2_fma();
    let work = |(item, o): (usize, &mut [f32])| {
        let (row, part) = (item / items_per_row, item % items_per_row);
        let Some((si, pos)) = row_info[row] else {
            return;
        };
        let g0 = part * heads_per_item;
        let qr = &q[(row * h) * dh + g0 * (h / hkv) * dh..][..chunk];
        let groups = g0..g0 + heads_per_item;
        attend_row(avx, qr, o, pos + 1, seqs[si].table, k, v, groups, s);
    };
    // Handing a few microseconds of work to the pool costs more than it saves.
    let keys: usize = seqs.iter().map(|x| x.q_len * x.kv_len).sum();
    if rayon::current_num_threads() == 1 || keys * h * dh < 1 << 18 {
        out.chunks_mut(chunk).enumerate().for_each(work);
    } else {
        out.par_chunks_mut(chunk).enumerate().for_each(work);
    }
    out
}

/// Whether the AVX2+FMA build of the kernel can run here (the default x86-64 target
/// has only SSE2).
pub fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Attention of the query heads of KV heads `groups` (`qr`: `[groups × G, dh]`) over
/// keys `0..n`, in the AVX2+FMA build when `avx` (decided once per call by the caller).
#[allow(clippy::too_many_arguments)]
fn attend_row(
    avx: bool,
    qr: &[f32],
    out: &mut [f32],
    n: usize,
    table: &[BlockId],
    k: KvView<'_>,
    v: KvView<'_>,
    groups: std::ops::Range<usize>,
    s: AttnShape,
) {
    #[cfg(target_arch = "x86_64")]
    if avx {
        // SAFETY: `avx` comes from `has_avx2_fma`.
        unsafe { attend_row_avx2(qr, out, n, table, k, v, groups, s) };
        return;
    }
    let _ = avx;
    attend_row_impl::<false>(qr, out, n, table, k, v, groups, s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_row_avx2(
    qr: &[f32],
    out: &mut [f32],
    n: usize,
    table: &[BlockId],
    k: KvView<'_>,
    v: KvView<'_>,
    groups: std::ops::Range<usize>,
    s: AttnShape,
) {
    attend_row_impl::<true>(qr, out, n, table, k, v, groups, s)
}

/// `AVX`: called from the AVX2+FMA build only after the CPU was checked.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_row_impl<const AVX: bool>(
    qr: &[f32],
    out: &mut [f32],
    n: usize,
    table: &[BlockId],
    k: KvView<'_>,
    v: KvView<'_>,
    groups: std::ops::Range<usize>,
    s: AttnShape,
) {
    let (hkv, dh, bs) = (s.num_kv_heads, s.head_dim, s.block_size);
    let g_size = s.num_heads / hkv;
    let nh = groups.len() * g_size; // query heads of this item
    let scale = 1.0 / (dh as f32).sqrt();
    let mut m = vec![f32::NEG_INFINITY; nh];
    let mut l = vec![0f32; nh];
    out.fill(0.0);
    // Storage other than f32: one head's block, decoded once for its G query heads.
    let (mut kf, mut vf) = (Vec::new(), Vec::new());
    let mut p = vec![0f32; bs];
    let mut start = 0;
    while start < n {
        let blk = table[start / bs] as usize;
        let len = (n - start).min(bs);
        for (gi, g) in groups.clone().enumerate() {
            // This head's keys/values of the block: `len` contiguous rows of dh.
            let first = (blk * hkv + g) * bs;
            let kb = k.rows(first, len, dh, &mut kf);
            let vb = v.rows(first, len, dh, &mut vf);
            for j in 0..g_size {
                let hq = gi * g_size + j;
                let qh = &qr[hq * dh..(hq + 1) * dh];
                for (pt, kt) in p[..len].iter_mut().zip(kb.chunks_exact(dh)) {
                    *pt = scale * dot_dispatch::<AVX>(qh, kt);
                }
                let bmax = p[..len].iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let m_new = m[hq].max(bmax);
                let alpha = exp(m[hq] - m_new);
                let oh = &mut out[hq * dh..(hq + 1) * dh];
                if alpha != 1.0 {
                    oh.iter_mut().for_each(|x| *x *= alpha);
                }
                // Two loops: the exps vectorize, the ordered f32 sum would not.
                for pt in p[..len].iter_mut() {
                    *pt = exp(*pt - m_new);
                }
                let sum: f32 = p[..len].iter().sum();
                accumulate_dispatch::<AVX>(&p[..len], vb, oh);
                l[hq] = l[hq] * alpha + sum;
                m[hq] = m_new;
            }
        }
        start += len;
    }
    for hq in 0..nh {
        let inv = 1.0 / l[hq];
        out[hq * dh..(hq + 1) * dh]
            .iter_mut()
            .for_each(|x| *x *= inv);
    }
}

/// `e^x` for x ≤ 0 (softmax arguments), branch-free so loops over a block vectorize
/// instead of calling libm per element. Range reduction x = k·ln2 + r, |r| ≤ ln2/2, and a
/// degree-6 polynomial: relative error below 3e-7 (tested against `f32::exp`); 0 below
/// about −87.7.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let x = x.max(-88.0);
    let k = (x * std::f32::consts::LOG2_E).round();
    // ln 2 split in two (Cody–Waite) so k·ln2 is exact enough in f32.
    let r = (x - k * 0.693_359_4) + k * 2.121_944_4e-4;
    let poly = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // 2^k from its exponent bits; k = −127 gives +0.
    f32::from_bits(((k as i32 + 127).max(0) as u32) << 23) * poly
}

/// Dot product with eight independent accumulators so the compiler vectorizes it.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

/// `out += Σ_t p[t] · v[t]` for the `p.len()` rows of `vb` (`[len, dh]`), with the
/// whole output row in registers for the common head sizes (no read-modify-write of
/// `out` per row).
#[inline(always)]
fn accumulate(p: &[f32], vb: &[f32], out: &mut [f32]) {
    match out.len() {
        64 => accumulate_n::<8>(p, vb, out),
        128 => accumulate_n::<16>(p, vb, out),
        32 => accumulate_n::<4>(p, vb, out),
        16 => accumulate_n::<2>(p, vb, out),
        dh => {
            for (t, &pt) in p.iter().enumerate() {
                for (o, x) in out.iter_mut().zip(&vb[t * dh..(t + 1) * dh]) {
                    *o += pt * x;
                }
            }
        }
    }
}

#[inline(always)]
fn accumulate_n<const N: usize>(p: &[f32], vb: &[f32], out: &mut [f32]) {
    let dh = N * 8;
    let mut acc = [[0f32; 8]; N];
    for (t, &pt) in p.iter().enumerate() {
        let row = &vb[t * dh..(t + 1) * dh];
        for (c, a) in acc.iter_mut().enumerate() {
            let r: &[f32; 8] = row[c * 8..c * 8 + 8].try_into().expect("eight lanes");
            for i in 0..8 {
                a[i] += pt * r[i];
            }
        }
    }
    for (c, a) in acc.iter().enumerate() {
        for i in 0..8 {
            out[c * 8 + i] += a[i];
        }
    }
}

/// Dot product for kernels outside this file: the AVX2+FMA version when `avx` (from
/// [`has_avx2_fma`], checked once per call by the caller).
#[inline]
pub fn dot_with(avx: bool, a: &[f32], b: &[f32]) -> f32 {
    // Re-checked (a cached load) so a wrong `avx` cannot reach the AVX2 code.
    if avx && has_avx2_fma() {
        dot_dispatch::<true>(a, b)
    } else {
        dot_dispatch::<false>(a, b)
    }
}

/// `out += Σ_t p[t] · vb[t]` (`vb`: `[p.len(), out.len()]`), AVX2+FMA when `avx`.
#[inline]
pub fn accumulate_with(avx: bool, p: &[f32], vb: &[f32], out: &mut [f32]) {
    if avx && has_avx2_fma() {
        accumulate_dispatch::<true>(p, vb, out)
    } else {
        accumulate_dispatch::<false>(p, vb, out)
    }
}

#[inline(always)]
fn dot_dispatch<const AVX: bool>(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if AVX {
        // SAFETY: `AVX` is only true on CPUs with AVX2 and FMA (see `attend_row`).
        return unsafe { simd::dot(a, b) };
    }
    dot(a, b)
}

#[inline(always)]
fn accumulate_dispatch<const AVX: bool>(p: &[f32], vb: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if AVX {
        // SAFETY: as above.
        match out.len() {
            64 => return unsafe { simd::accumulate::<8>(p, vb, out) },
            128 => return unsafe { simd::accumulate::<16>(p, vb, out) },
            _ => {}
        }
    }
    accumulate(p, vb, out)
}

/// AVX2+FMA versions of the two inner loops (the portable ones are left to the
/// compiler, which does not keep these accumulators in registers).
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    /// Dot product; `a` and `b` have the same length.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut i = 0;
        while i + 16 <= n {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
            acc1 = _mm256_fmadd_ps(
                _mm256_loadu_ps(pa.add(i + 8)),
                _mm256_loadu_ps(pb.add(i + 8)),
                acc1,
            );
            i += 16;
        }
        if i + 8 <= n {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
            i += 8;
        }
        let acc = _mm256_add_ps(acc0, acc1);
        let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        let s = _mm_hadd_ps(s, s);
        let s = _mm_hadd_ps(s, s);
        let mut r = _mm_cvtss_f32(s);
        while i < n {
            r += a[i] * b[i];
            i += 1;
        }
        r
    }

    /// `out += Σ_t p[t] · vb[t]` with `out.len() = 8·N` held in N registers.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn accumulate<const N: usize>(p: &[f32], vb: &[f32], out: &mut [f32]) {
        let dh = 8 * N;
        assert!(out.len() == dh && vb.len() >= p.len() * dh);
        let mut acc = [_mm256_setzero_ps(); N];
        for (t, &pt) in p.iter().enumerate() {
            let w = _mm256_set1_ps(pt);
            let row = vb.as_ptr().add(t * dh);
            for (c, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(w, _mm256_loadu_ps(row.add(8 * c)), *a);
            }
        }
        let o = out.as_mut_ptr();
        for (c, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(
                o.add(8 * c),
                _mm256_add_ps(_mm256_loadu_ps(o.add(8 * c)), *a),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_matches_libm() {
        let mut worst = 0f32;
        let mut x = -87.0f32;
        while x <= 0.0 {
            let (a, b) = (exp(x), x.exp());
            worst = worst.max((a - b).abs() / b);
            x += 0.001;
        }
        assert!(worst < 3e-7, "{worst}");
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(0.0), 1.0);
    }
}
