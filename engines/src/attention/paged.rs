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
    let g_size = h / hkv;
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
    let scale = 1.0 / (dh as f32).sqrt();
    // One work item = one query row × one KV head (its G query heads).
    out.par_chunks_mut(g_size * dh)
        .enumerate()
        .for_each(|(item, o)| {
            let (row, g) = (item / hkv, item % hkv);
            let Some((si, pos)) = row_info[row] else {
                return;
            };
            let sq = &seqs[si];
            let qg = &q[(row * h + g * g_size) * dh..(row * h + (g + 1) * g_size) * dh];
            attend_row(qg, o, pos + 1, sq.table, k, v, g, s, scale);
        });
    out
}

/// Attention of the `G` query heads in `qg` (`[G, dh]`) over keys `0..n` of KV head `g`.
#[allow(clippy::too_many_arguments)]
fn attend_row<E: KvElem>(
    qg: &[f32],
    out: &mut [f32],
    n: usize,
    table: &[BlockId],
    k: &[E],
    v: &[E],
    g: usize,
    s: AttnShape,
    scale: f32,
) {
    let (hkv, dh, bs) = (s.num_kv_heads, s.head_dim, s.block_size);
    let g_size = qg.len() / dh;
    let mut m = vec![f32::NEG_INFINITY; g_size];
    let mut l = vec![0f32; g_size];
    out.fill(0.0);
    let mut kf = vec![0f32; bs * dh];
    let mut vf = vec![0f32; bs * dh];
    let mut scores = vec![0f32; bs];
    let mut start = 0;
    while start < n {
        let blk = table[start / bs] as usize;
        let len = (n - start).min(bs);
        // Convert this block's keys/values of head g to f32 once for all G heads.
        for t in 0..len {
            let off = ((blk * bs + t) * hkv + g) * dh;
            for (d, x) in kf[t * dh..(t + 1) * dh].iter_mut().zip(&k[off..off + dh]) {
                *d = x.to_f32();
            }
            for (d, x) in vf[t * dh..(t + 1) * dh].iter_mut().zip(&v[off..off + dh]) {
                *d = x.to_f32();
            }
        }
        for hq in 0..g_size {
            let qh = &qg[hq * dh..(hq + 1) * dh];
            let mut bmax = f32::NEG_INFINITY;
            for t in 0..len {
                let sc = dot(qh, &kf[t * dh..(t + 1) * dh]) * scale;
                scores[t] = sc;
                bmax = bmax.max(sc);
            }
            let m_new = m[hq].max(bmax);
            let alpha = (m[hq] - m_new).exp();
            let oh = &mut out[hq * dh..(hq + 1) * dh];
            if alpha != 1.0 {
                oh.iter_mut().for_each(|x| *x *= alpha);
            }
            let mut sum = 0f32;
            for t in 0..len {
                let p = (scores[t] - m_new).exp();
                sum += p;
                axpy(p, &vf[t * dh..(t + 1) * dh], oh);
            }
            l[hq] = l[hq] * alpha + sum;
            m[hq] = m_new;
        }
        start += len;
    }
    for hq in 0..g_size {
        let inv = 1.0 / l[hq];
        out[hq * dh..(hq + 1) * dh]
            .iter_mut()
            .for_each(|x| *x *= inv);
    }
}

/// Dot product with eight independent accumulators so the compiler vectorizes it.
#[inline]
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

#[inline]
fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}
