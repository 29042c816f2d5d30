//! Paged attention on CPU: each query row reads its keys block by block through the
//! sequence's block table (no gather into a contiguous copy), with an online softmax
//! in f32 so memory stays O(dh) per row whatever the context length.

use crate::kv::paged::{KvElem, KvView};
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
    match (k, v) {
        (KvView::F32(k), KvView::F32(v)) => run(q, seqs, k, v, shape),
        (KvView::Bf16(k), KvView::Bf16(v)) => run(q, seqs, k, v, shape),
        (KvView::F16(k), KvView::F16(v)) => run(q, seqs, k, v, shape),
        _ => unreachable!("K and V of one pool share a dtype"),
    }
}

fn run<E: KvElem>(q: &[f32], seqs: &[SeqAttn<'_>], k: &[E], v: &[E], s: AttnShape) -> Vec<f32> {
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
    // One work item = one query row and a range of KV heads. With enough rows, all KV
    // heads: a token's K (and V) row of all heads is then read as one contiguous run,
    // which the hardware prefetcher follows; with few rows (small-batch decode), one KV
    // head per item so every core has work.
    let heads_per_item = if rows >= 2 * rayon::current_num_threads() {
        hkv
    } else {
        1
    };
    let items_per_row = hkv / heads_per_item;
    let chunk = heads_per_item * (h / hkv) * dh;
    out.par_chunks_mut(chunk).enumerate().for_each(|(item, o)| {
        let (row, part) = (item / items_per_row, item % items_per_row);
        let Some((si, pos)) = row_info[row] else {
            return;
        };
        let g0 = part * heads_per_item;
        let qr = &q[(row * h) * dh + g0 * (h / hkv) * dh..][..chunk];
        attend_row(
            qr,
            o,
            pos + 1,
            seqs[si].table,
            k,
            v,
            g0..g0 + heads_per_item,
            s,
        );
    });
    out
}

/// Attention of the query heads of KV heads `groups` (`qr`: `[groups × G, dh]`) over
/// keys `0..n`. Dispatches to a copy compiled for AVX2+FMA when the CPU has it (the
/// default x86-64 target has only SSE2).
#[allow(clippy::too_many_arguments)]
fn attend_row<E: KvElem>(
    qr: &[f32],
    out: &mut [f32],
    n: usize,
    table: &[BlockId],
    k: &[E],
    v: &[E],
    groups: std::ops::Range<usize>,
    s: AttnShape,
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU supports the features the function is compiled for.
        unsafe { attend_row_avx2(qr, out, n, table, k, v, groups, s) };
        return;
    }
    attend_row_impl(qr, out, n, table, k, v, groups, s)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_row_avx2<E: KvElem>(
    qr: &[f32],
    out: &mut [f32],
    n: usize,
    table: &[BlockId],
    k: &[E],
    v: &[E],
    groups: std::ops::Range<usize>,
    s: AttnShape,
) {
    attend_row_impl(qr, out, n, table, k, v, groups, s)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_row_impl<E: KvElem>(
    qr: &[f32],
    out: &mut [f32],
    n: usize,
    table: &[BlockId],
    k: &[E],
    v: &[E],
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
    let row = hkv * dh;
    let span = groups.start * dh..groups.end * dh;
    let direct = E::as_f32(k).zip(E::as_f32(v));
    // 16-bit storage: this block's rows of the item's heads, converted once.
    let (mut kf, mut vf) = match direct {
        Some(_) => (Vec::new(), Vec::new()),
        None => (vec![0f32; bs * span.len()], vec![0f32; bs * span.len()]),
    };
    // Scores then probabilities, [head, t].
    let mut p = vec![0f32; nh * bs];
    let mut start = 0;
    while start < n {
        let blk = table[start / bs] as usize;
        let len = (n - start).min(bs);
        let (kb, vb, stride): (&[f32], &[f32], usize) = match direct {
            Some((k32, v32)) => {
                let base = blk * bs * row + span.start;
                (&k32[base..], &v32[base..], row)
            }
            None => {
                let w = span.len();
                for t in 0..len {
                    let off = (blk * bs + t) * row;
                    let (src_k, src_v) = (
                        &k[off + span.start..off + span.end],
                        &v[off + span.start..off + span.end],
                    );
                    for (d, x) in kf[t * w..(t + 1) * w].iter_mut().zip(src_k) {
                        *d = x.to_f32();
                    }
                    for (d, x) in vf[t * w..(t + 1) * w].iter_mut().zip(src_v) {
                        *d = x.to_f32();
                    }
                }
                (&kf, &vf, w)
            }
        };
        // Scores: token-major so the K rows stream in order.
        for t in 0..len {
            let kt = &kb[t * stride..];
            for hq in 0..nh {
                let gi = hq / g_size;
                p[hq * bs + t] =
                    dot(&qr[hq * dh..(hq + 1) * dh], &kt[gi * dh..(gi + 1) * dh]) * scale;
            }
        }
        // Online softmax per head.
        for hq in 0..nh {
            let ph = &mut p[hq * bs..hq * bs + len];
            let bmax = ph.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let m_new = m[hq].max(bmax);
            let alpha = exp(m[hq] - m_new);
            let mut sum = 0f32;
            for x in ph.iter_mut() {
                *x = exp(*x - m_new);
                sum += *x;
            }
            if alpha != 1.0 {
                out[hq * dh..(hq + 1) * dh]
                    .iter_mut()
                    .for_each(|x| *x *= alpha);
            }
            l[hq] = l[hq] * alpha + sum;
            m[hq] = m_new;
        }
        // Values: token-major again.
        for t in 0..len {
            let vt = &vb[t * stride..];
            for hq in 0..nh {
                let gi = hq / g_size;
                axpy(
                    p[hq * bs + t],
                    &vt[gi * dh..(gi + 1) * dh],
                    &mut out[hq * dh..(hq + 1) * dh],
                );
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

/// `e^x` for x ≤ 0 (softmax arguments), inlined so the score loops stay in registers
/// instead of calling libm per element. Range reduction x = k·ln2 + r, |r| ≤ ln2/2, and
/// a degree-6 polynomial: relative error below 3e-7 (tested against `f32::exp`).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    if x < -87.0 {
        return 0.0;
    }
    let k = (x * std::f32::consts::LOG2_E).round();
    // ln 2 split in two (Cody–Waite) so k·ln2 is exact enough in f32.
    let r = (x - k * 0.693_359_4) + k * 2.121_944_4e-4;
    let poly = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // 2^k by building the exponent bits; k ≥ -126 here.
    f32::from_bits(((k as i32 + 127) as u32) << 23) * poly
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

#[inline(always)]
fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
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
