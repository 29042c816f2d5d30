//! Prefill attention of one sequence over contiguous f32 K/V (`[n, Hkv, dh]`), in three
//! implementations that differ in memory (the point of the comparison): `Eager` holds the
//! whole `[H, tq, n]` score matrix like the originals, `Chunked` one chunk of rows at a
//! time, `Flash` only tiles (online softmax). Also H2O's prefill column statistics
//! (algorithms.md §3, §9): from the materialized matrix, exact in two tiled passes, or
//! "within-chunk only" as the study's chunked H2O computed them.

use super::paged::{accumulate_with, exp, has_avx2_fma};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// Keys per tile (flash, P·V, exact statistics).
const KT: usize = 64;
/// Most query rows per flash work item (fewer when the call has few rows, so every
/// core gets work).
const RT: usize = 16;

/// How prefill attention is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttentionImpl {
    /// Full `[H, tq, n]` score matrix (the originals' memory behaviour).
    Eager,
    /// `chunk` query rows at a time, each chunk's scores materialized.
    Chunked,
    /// Tiled online softmax, O(tile) scratch.
    Flash,
}

impl std::str::FromStr for AttentionImpl {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "eager" => Ok(Self::Eager),
            "chunked" => Ok(Self::Chunked),
            "flash" => Ok(Self::Flash),
            _ => Err(format!(
                "attention implementation `{s}`: expected `eager`, `chunked` or `flash`"
            )),
        }
    }
}

impl std::fmt::Display for AttentionImpl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Eager => "eager",
            Self::Chunked => "chunked",
            Self::Flash => "flash",
        })
    }
}

/// How H2O's prefill column statistics are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ColumnStats {
    /// From the materialized full-row probabilities (needs the `[H, tq, n]` matrix).
    Eager,
    /// Each chunk of rows softmaxed over its own keys only, as if it were an independent
    /// prompt (the study's chunked H2O): approximate by design.
    Chunked,
    /// Two tiled passes (§9): exact, O(tile) memory.
    Exact,
}

impl std::str::FromStr for ColumnStats {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "eager" => Ok(Self::Eager),
            "chunked" => Ok(Self::Chunked),
            "exact" => Ok(Self::Exact),
            _ => Err(format!(
                "column statistics `{s}`: expected `eager`, `chunked` or `exact`"
            )),
        }
    }
}

impl std::fmt::Display for ColumnStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Eager => "eager",
            Self::Chunked => "chunked",
            Self::Exact => "exact",
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// Scratch memory requested beyond the limit (the caller turns it into its OOM error).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("attention scratch of {requested} bytes exceeds the {limit} bytes available")]
pub struct ScratchExceeded {
    pub requested: u64,
    pub limit: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct PrefillOutput {
    /// `[tq, H, dh]`
    pub out: Vec<f32>,
    /// Row log-sum-exp of the scaled scores, `[tq, H]` (row-major: row, then head).
    pub lse: Vec<f32>,
    /// H2O column statistics `[Hkv, n]` when requested:
    /// c_g(j) = Σ_{h: g(h)=g} Σ_{rows i of this call} p_h(i, j).
    pub col: Option<Vec<f32>>,
    /// Largest scratch buffer allocated (bytes), e.g. the score matrix for eager.
    pub scratch_bytes: u64,
}

/// `q`: `[tq, H, dh]`; `k`, `v`: `[n, Hkv, dh]` holding positions 0..n. Row i (0 ≤ i < tq)
/// is at absolute position n − tq + i and attends keys 0..=n − tq + i (causal). Scale
/// 1/sqrt(dh), softmax in f32. `chunk`: query rows per chunk for `Chunked` attention and
/// `Chunked` statistics (≥ 1). `stats`: which column statistics to compute.
/// `scratch_limit`: bytes the call may allocate for scores, checked before any allocation
/// (this is how the originals' prefill OOM is reproduced under a device capacity).
#[allow(clippy::too_many_arguments)]
pub fn prefill_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    tq: usize,
    n: usize,
    shape: PrefillShape,
    imp: AttentionImpl,
    chunk: usize,
    stats: Option<ColumnStats>,
    scratch_limit: Option<u64>,
) -> Result<PrefillOutput, ScratchExceeded> {
    let (h, hkv, dh) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
    debug_assert!(hkv > 0 && h % hkv == 0, "H must be a multiple of Hkv");
    debug_assert!(tq <= n, "query rows beyond the keys");
    debug_assert_eq!(q.len(), tq * h * dh);
    debug_assert!(k.len() >= n * hkv * dh && v.len() >= n * hkv * dh);
    debug_assert!(chunk >= 1);
    let requested = scratch_bytes(tq, n, shape, imp, chunk, stats);
    if let Some(limit) = scratch_limit.filter(|&l| requested > l) {
        return Err(ScratchExceeded { requested, limit });
    }
    let mut out = vec![0f32; tq * h * dh];
    let mut lse = vec![0f32; tq * h];
    let mut col = stats.map(|_| vec![0f32; hkv * n]);
    let output = |out, lse, col| PrefillOutput {
        out,
        lse,
        col,
        scratch_bytes: requested,
    };
    if tq == 0 || tq > n || hkv == 0 || h % hkv != 0 {
        return Ok(output(out, lse, col));
    }
    let c = Ctx {
        q,
        k,
        v,
        tq,
        n,
        off: n - tq,
        h,
        hkv,
        g: h / hkv,
        dh,
        scale: 1.0 / (dh as f32).sqrt(),
        avx: has_avx2_fma(),
    };
    let chunk = chunk.max(1);
    let chunks = (0..tq).step_by(chunk).map(|s| (s, (s + chunk).min(tq)));
    let eager_stats = stats == Some(ColumnStats::Eager);
    match imp {
        AttentionImpl::Eager => {
            // One materialized matrix serves both the output and eager statistics.
            let col = col.as_deref_mut().filter(|_| eager_stats);
            materialize(&c, 0, tq, 0, Some((&mut out, &mut lse)), col);
        }
        AttentionImpl::Chunked => {
            for (s, e) in chunks.clone() {
                materialize(&c, s, e, 0, Some((&mut out, &mut lse)), None);
            }
        }
        AttentionImpl::Flash => flash(&c, &mut out, &mut lse),
    }
    if let (Some(st), Some(cv)) = (stats, col.as_deref_mut()) {
        match st {
            ColumnStats::Eager if imp != AttentionImpl::Eager => {
                materialize(&c, 0, tq, 0, None, Some(cv))
            }
            ColumnStats::Eager => {}
            ColumnStats::Exact => exact_columns(&c, &lse, cv),
            ColumnStats::Chunked => {
                for (s, e) in chunks {
                    // The chunk's rows see only the chunk's own keys.
                    materialize(&c, s, e, c.off + s, None, Some(&mut *cv));
                }
            }
        }
    }
    Ok(output(out, lse, col))
}

/// Bytes per score element the CUDA cuBLAS paths (eager and chunked) hold at their
/// peak: the bf16 product, f32 scores, the f32 softmax and bf16 probabilities.
pub const CUDA_SCORE_BYTES: u64 = 14;

/// Scratch of the CUDA eager or chunked prefill of `tq` rows over `n` keys: one
/// `[H, chunk, n]` score block at [`CUDA_SCORE_BYTES`] each (eager: the whole `tq`
/// rows at once). H2O's statistics on these paths come from the same matrix. The
/// flash kernels hold tiles only: as the CPU's [`scratch_bytes`].
pub fn cuda_scratch_bytes(
    tq: usize,
    n: usize,
    shape: PrefillShape,
    imp: AttentionImpl,
    chunk: usize,
    stats: Option<ColumnStats>,
) -> u64 {
    let rows = match imp {
        AttentionImpl::Eager => tq,
        AttentionImpl::Chunked => chunk.clamp(1, tq.max(1)),
        AttentionImpl::Flash => return scratch_bytes(tq, n, shape, imp, chunk, stats),
    };
    (shape.num_heads * rows * n) as u64 * CUDA_SCORE_BYTES
}

/// Bytes of scratch `imp` (and `stats`) would need for this call, without running it:
/// the largest buffer the call allocates (score matrices; for the tiled paths one work
/// item's tile buffers). Output, LSE and statistics vectors are not counted.
pub fn scratch_bytes(
    tq: usize,
    n: usize,
    shape: PrefillShape,
    imp: AttentionImpl,
    chunk: usize,
    stats: Option<ColumnStats>,
) -> u64 {
    if tq == 0 {
        return 0;
    }
    let (h, dh) = (shape.num_heads as u64, shape.head_dim as u64);
    let (tq64, off) = (tq as u64, n.saturating_sub(tq) as u64);
    let chunk = chunk.max(1);
    let chunks = (0..tq)
        .step_by(chunk)
        .map(|s| (s as u64, (s + chunk).min(tq) as u64));
    let full = h * tq64 * n as u64 * 4;
    let attn = match imp {
        AttentionImpl::Eager => full,
        AttentionImpl::Chunked => chunks
            .clone()
            .map(|(s, e)| h * (e - s) * (off + e) * 4)
            .max()
            .unwrap_or(0),
        // m and l per (row, head), one tile of probabilities, one K and one V tile.
        AttentionImpl::Flash => (2 * RT as u64 * h + KT as u64 + 2 * KT as u64 * dh) * 4,
    };
    let st = match stats {
        None => 0,
        Some(ColumnStats::Eager) => full,
        Some(ColumnStats::Chunked) => chunks
            .map(|(s, e)| h * (e - s) * (e - s) * 4)
            .max()
            .unwrap_or(0),
        // One K tile, its scores and f64 column accumulators.
        Some(ColumnStats::Exact) => KT as u64 * (dh * 4 + 4 + 8),
    };
    attn.max(st)
}

/// One call's inputs and derived constants.
struct Ctx<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    tq: usize,
    n: usize,
    /// Absolute position of row 0.
    off: usize,
    h: usize,
    hkv: usize,
    /// Group size G = H / Hkv.
    g: usize,
    dh: usize,
    scale: f32,
    avx: bool,
}

impl Ctx<'_> {
    fn q_row(&self, i: usize, h: usize) -> &[f32] {
        &self.q[(i * self.h + h) * self.dh..][..self.dh]
    }

    fn k_row(&self, j: usize, g: usize) -> &[f32] {
        &self.k[(j * self.hkv + g) * self.dh..][..self.dh]
    }

    /// Keys visible to row i: `0..end(i)`.
    fn end(&self, i: usize) -> usize {
        self.off + i + 1
    }

    /// K rows `k0..k1` of KV head `g` transposed to `[dh, KT]`: one query's scores
    /// against the tile are then one `accumulate_with` with the KT scores held in
    /// registers (no horizontal sum per key, unlike a dot per key). Columns past `k1`
    /// keep an earlier tile's (finite) keys; their scores are never read.
    fn gather_kt(&self, g: usize, k0: usize, k1: usize, buf: &mut [f32]) {
        for (t, j) in (k0..k1).enumerate() {
            for (d, &x) in self.k_row(j, g).iter().enumerate() {
                buf[d * KT + t] = x;
            }
        }
    }

    /// Scaled scores of query `q` against a tile from `gather_kt`.
    fn tile_scores(&self, q: &[f32], kt: &[f32], out: &mut [f32; KT]) {
        out.fill(0.0);
        accumulate_with(self.avx, q, kt, out);
        out.iter_mut().for_each(|x| *x *= self.scale);
    }

    /// V rows `k0..k1` of KV head `g` made contiguous, as `accumulate_with` wants them.
    fn gather_v(&self, g: usize, k0: usize, k1: usize, buf: &mut [f32]) {
        for (j, d) in (k0..k1).zip(buf.chunks_exact_mut(self.dh)) {
            d.copy_from_slice(&self.v[(j * self.hkv + g) * self.dh..][..self.dh]);
        }
    }
}

/// Rows `s..e` against keys `lo..off+e` with the `[H, e−s, off+e−lo]` probabilities
/// materialized (masked entries 0). Writes output rows and their LSE into `attend`
/// (`[tq, H, dh]`, `[tq, H]`) when given, and adds the group's column sums into `col`
/// (`[Hkv, n]`) when given. Requires `lo ≤ off + s` (every row sees a key).
fn materialize(
    c: &Ctx<'_>,
    s: usize,
    e: usize,
    lo: usize,
    attend: Option<(&mut [f32], &mut [f32])>,
    col: Option<&mut [f32]>,
) {
    let (rows, width, dh) = (e - s, c.off + e - lo, c.dh);
    let with_pv = attend.is_some();
    let mut probs = vec![0f32; c.h * rows * width];
    let per_head: Vec<(Vec<f32>, Vec<f32>)> = probs
        .par_chunks_mut(rows * width)
        .enumerate()
        .map(|(h, ph)| {
            let g = h / c.g;
            let mut lse = vec![0f32; rows];
            let (mut kt, mut sc) = (vec![0f32; c.dh * KT], [0f32; KT]);
            for k0 in (lo..c.off + e).step_by(KT) {
                let k1 = (k0 + KT).min(c.off + e);
                c.gather_kt(g, k0, k1, &mut kt);
                for ri in 0..rows {
                    let len = k1.min(c.end(s + ri)).saturating_sub(k0);
                    if len > 0 {
                        c.tile_scores(c.q_row(s + ri, h), &kt, &mut sc);
                        ph[ri * width + k0 - lo..][..len].copy_from_slice(&sc[..len]);
                    }
                }
            }
            for (ri, row) in ph.chunks_exact_mut(width).enumerate() {
                let vis = &mut row[..c.end(s + ri) - lo];
                let m = vis.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                vis.iter_mut().for_each(|x| *x = exp(*x - m));
                let sum = vis.iter().map(|&x| x as f64).sum::<f64>() as f32;
                let inv = 1.0 / sum;
                vis.iter_mut().for_each(|x| *x *= inv);
                lse[ri] = m + sum.ln();
            }
            let mut o = Vec::new();
            if with_pv {
                o = vec![0f32; rows * dh];
                let mut vt = vec![0f32; KT * dh];
                for k0 in (lo..c.off + e).step_by(KT) {
                    let k1 = (k0 + KT).min(c.off + e);
                    c.gather_v(g, k0, k1, &mut vt);
                    for (ri, or) in o.chunks_exact_mut(dh).enumerate() {
                        let len = k1.min(c.end(s + ri)).saturating_sub(k0);
                        if len > 0 {
                            let p = &ph[ri * width + k0 - lo..][..len];
                            accumulate_with(c.avx, p, &vt[..len * dh], or);
                        }
                    }
                }
            }
            (o, lse)
        })
        .collect();
    if let Some((out, lse_out)) = attend {
        for (h, (o, l)) in per_head.iter().enumerate() {
            for ri in 0..rows {
                lse_out[(s + ri) * c.h + h] = l[ri];
                out[((s + ri) * c.h + h) * dh..][..dh].copy_from_slice(&o[ri * dh..][..dh]);
            }
        }
    }
    if let Some(col) = col {
        col.par_chunks_mut(c.n).enumerate().for_each(|(g, cg)| {
            let mut acc = vec![0f64; width];
            for ph in probs[g * c.g * rows * width..][..c.g * rows * width].chunks_exact(width) {
                acc.iter_mut().zip(ph).for_each(|(a, &p)| *a += p as f64);
            }
            for (x, a) in cg[lo..c.off + e].iter_mut().zip(acc) {
                *x += a as f32;
            }
        });
    }
}

/// Tiled attention with online softmax (running max `m` and sum `l` per row and head, the
/// output accumulator rescaled when the max grows). A work item is a tile of rows and
/// all heads, so its output rows are one contiguous slice; each V tile is gathered once
/// per item and reused by its G × rows (head, row) pairs.
fn flash(c: &Ctx<'_>, out: &mut [f32], lse: &mut [f32]) {
    let (h, dh, gs) = (c.h, c.dh, c.g);
    let rt = c.tq.div_ceil(4 * rayon::current_num_threads()).clamp(1, RT);
    let work = |(t, (o, ls)): (usize, (&mut [f32], &mut [f32]))| {
        let (r0, nr) = (t * rt, ls.len() / h);
        let mut m = vec![f32::NEG_INFINITY; nr * h];
        let mut l = vec![0f32; nr * h];
        let mut p = [0f32; KT];
        let (mut kt, mut vt) = (vec![0f32; dh * KT], vec![0f32; KT * dh]);
        let kend = c.end(r0 + nr - 1);
        for g in 0..c.hkv {
            for k0 in (0..kend).step_by(KT) {
                let k1 = (k0 + KT).min(kend);
                c.gather_kt(g, k0, k1, &mut kt);
                c.gather_v(g, k0, k1, &mut vt);
                for ri in 0..nr {
                    let len = k1.min(c.end(r0 + ri)).saturating_sub(k0);
                    if len == 0 {
                        continue;
                    }
                    for hq in g * gs..(g + 1) * gs {
                        let x = ri * h + hq;
                        c.tile_scores(c.q_row(r0 + ri, hq), &kt, &mut p);
                        let bmax = p[..len].iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                        let m_new = m[x].max(bmax);
                        let alpha = exp(m[x] - m_new);
                        let oh = &mut o[x * dh..][..dh];
                        if alpha != 1.0 {
                            oh.iter_mut().for_each(|y| *y *= alpha);
                        }
                        // Two loops: the exps vectorize, the ordered sum would not.
                        p[..len].iter_mut().for_each(|y| *y = exp(*y - m_new));
                        let sum: f32 = p[..len].iter().sum();
                        accumulate_with(c.avx, &p[..len], &vt[..len * dh], oh);
                        l[x] = l[x] * alpha + sum;
                        m[x] = m_new;
                    }
                }
            }
        }
        for (x, oh) in o.chunks_exact_mut(dh).enumerate() {
            let inv = 1.0 / l[x];
            oh.iter_mut().for_each(|y| *y *= inv);
            ls[x] = m[x] + l[x].ln();
        }
    };
    let items = out
        .par_chunks_mut(rt * h * dh)
        .zip(lse.par_chunks_mut(rt * h));
    items.enumerate().for_each(work);
}

/// Pass 2 of §9: with each row's LSE known (pass 1 = the attention pass), recompute the
/// scores tile by tile, P = exp(S − LSE), and add column sums. A work item owns one
/// (KV head, key tile) of `col` (`[Hkv, n]`), so no two items write the same sums; the
/// G query heads of the group add into it.
fn exact_columns(c: &Ctx<'_>, lse: &[f32], col: &mut [f32]) {
    col.par_chunks_mut(c.n).enumerate().for_each(|(g, cg)| {
        cg.par_chunks_mut(KT).enumerate().for_each(|(b, cb)| {
            let k0 = b * KT;
            let mut acc = [0f64; KT];
            let (mut kt, mut sc) = (vec![0f32; c.dh * KT], [0f32; KT]);
            c.gather_kt(g, k0, k0 + cb.len(), &mut kt);
            // Row i sees key j iff j ≤ off + i.
            for i in k0.saturating_sub(c.off)..c.tq {
                let len = cb.len().min(c.end(i) - k0);
                for hq in g * c.g..(g + 1) * c.g {
                    c.tile_scores(c.q_row(i, hq), &kt, &mut sc);
                    let l = lse[i * c.h + hq];
                    for (a, &x) in acc[..len].iter_mut().zip(&sc[..len]) {
                        *a += exp(x - l) as f64;
                    }
                }
            }
            for (x, a) in cb.iter_mut().zip(acc) {
                *x += a as f32;
            }
        });
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    const IMPS: [AttentionImpl; 3] = [
        AttentionImpl::Eager,
        AttentionImpl::Chunked,
        AttentionImpl::Flash,
    ];
    const STATS: [ColumnStats; 3] = [ColumnStats::Eager, ColumnStats::Chunked, ColumnStats::Exact];
    type Naive = (Vec<f64>, Vec<f64>, Vec<f64>);

    fn shape(h: usize, hkv: usize, dh: usize) -> PrefillShape {
        PrefillShape {
            num_heads: h,
            num_kv_heads: hkv,
            head_dim: dh,
        }
    }

    fn rand_vec(rng: &mut StdRng, len: usize, amp: f32) -> Vec<f32> {
        (0..len)
            .map(|_| amp * (2.0 * rng.random::<f32>() - 1.0))
            .collect()
    }

    /// A prompt of `n` tokens: q `[n, H, dh]`, k and v `[n, Hkv, dh]`.
    struct Prompt {
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        s: PrefillShape,
    }

    impl Prompt {
        fn random(seed: u64, n: usize, s: PrefillShape) -> Self {
            let mut rng = StdRng::seed_from_u64(seed);
            let (qw, kw) = (s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim);
            let q = rand_vec(&mut rng, n * qw, 2.0);
            let k = rand_vec(&mut rng, n * kw, 2.0);
            let v = rand_vec(&mut rng, n * kw, 1.0);
            Prompt { q, k, v, s }
        }

        fn widths(&self) -> (usize, usize) {
            (
                self.s.num_heads * self.s.head_dim,
                self.s.num_kv_heads * self.s.head_dim,
            )
        }

        /// Tokens `a..b` as a prompt of their own.
        fn slice(&self, a: usize, b: usize) -> Self {
            let (qw, kw) = self.widths();
            let (q, k, v) = (
                &self.q[a * qw..b * qw],
                &self.k[a * kw..b * kw],
                &self.v[a * kw..b * kw],
            );
            Prompt {
                q: q.to_vec(),
                k: k.to_vec(),
                v: v.to_vec(),
                s: self.s,
            }
        }

        /// Rows `a..b` attending keys `0..b` (the context `0..a` cached).
        fn try_call(
            &self,
            a: usize,
            b: usize,
            imp: AttentionImpl,
            chunk: usize,
            st: Option<ColumnStats>,
            limit: Option<u64>,
        ) -> Result<PrefillOutput, ScratchExceeded> {
            let (qw, kw) = self.widths();
            let (q, k, v) = (
                &self.q[a * qw..b * qw],
                &self.k[..b * kw],
                &self.v[..b * kw],
            );
            prefill_attention(q, k, v, b - a, b, self.s, imp, chunk, st, limit)
        }

        fn call(
            &self,
            a: usize,
            b: usize,
            imp: AttentionImpl,
            chunk: usize,
            st: Option<ColumnStats>,
        ) -> PrefillOutput {
            self.try_call(a, b, imp, chunk, st, None)
                .unwrap_or_else(|e| panic!("{e}"))
        }

        /// Plain f64 reference for rows `a..b` over keys `0..b`, row i (absolute position)
        /// softmaxed over keys `lo(i)..=i`. Returns (out `[b−a, H, dh]`, lse `[b−a, H]`,
        /// col `[Hkv, b]`).
        fn naive(&self, a: usize, b: usize, lo: impl Fn(usize) -> usize) -> Naive {
            let (h, hkv, dh) = (self.s.num_heads, self.s.num_kv_heads, self.s.head_dim);
            let (g_size, tq) = (h / hkv, b - a);
            let (mut out, mut lse, mut col) = (
                vec![0.0; tq * h * dh],
                vec![0.0; tq * h],
                vec![0.0; hkv * b],
            );
            for i in a..b {
                for hq in 0..h {
                    let (g, r) = (hq / g_size, (i - a) * h + hq);
                    let keys = lo(i)..i + 1;
                    let sc: Vec<f64> = keys
                        .clone()
                        .map(|j| {
                            let kj = &self.k[(j * hkv + g) * dh..][..dh];
                            let qi = &self.q[(i * h + hq) * dh..][..dh];
                            qi.iter()
                                .zip(kj)
                                .map(|(&x, &y)| x as f64 * y as f64)
                                .sum::<f64>()
                                / (dh as f64).sqrt()
                        })
                        .collect();
                    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let sum: f64 = sc.iter().map(|x| (x - m).exp()).sum();
                    lse[r] = m + sum.ln();
                    for (j, sj) in keys.zip(&sc) {
                        let p = (sj - m).exp() / sum;
                        col[g * b + j] += p;
                        for x in 0..dh {
                            out[r * dh + x] += p * self.v[(j * hkv + g) * dh + x] as f64;
                        }
                    }
                }
            }
            (out, lse, col)
        }
    }

    fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (idx, (&a, &b)) in got.iter().zip(want).enumerate() {
            let err = (a as f64 - b).abs();
            assert!(err <= tol * b.abs().max(1.0), "{what}[{idx}]: {a} vs {b}");
        }
    }

    fn to_f64(x: &[f32]) -> Vec<f64> {
        x.iter().map(|&y| y as f64).collect()
    }

    /// Cases (tq, n): whole prompt, continuation of a cached context, one row, and sizes
    /// spanning several key tiles and flash row tiles.
    const CASES: [(usize, usize); 6] = [(23, 23), (5, 37), (1, 37), (150, 150), (20, 150), (1, 1)];

    #[test]
    fn prefill_impls_match_naive_reference() {
        for (si, s) in [shape(6, 2, 16), shape(4, 1, 64), shape(2, 2, 128)]
            .into_iter()
            .enumerate()
        {
            for (ci, &(tq, n)) in CASES.iter().enumerate() {
                let p = Prompt::random(7 + ci as u64 + 100 * si as u64, n, s);
                let (want_out, want_lse, _) = p.naive(n - tq, n, |_| 0);
                for imp in IMPS {
                    for chunk in [1, 3, 64] {
                        let r = p.call(n - tq, n, imp, chunk, None);
                        let what = format!("{imp} chunk {chunk} tq {tq} n {n} {s:?}");
                        assert_close(&r.out, &want_out, 1e-5, &format!("out {what}"));
                        assert_close(&r.lse, &want_lse, 1e-5, &format!("lse {what}"));
                        assert!(r.col.is_none());
                    }
                }
            }
        }
    }

    #[test]
    fn prefill_exact_and_eager_stats_match_naive_columns() {
        let s = shape(6, 2, 16);
        for (ci, &(tq, n)) in CASES.iter().chain(&[(300, 300), (257, 512)]).enumerate() {
            let p = Prompt::random(40 + ci as u64, n, s);
            let (_, _, want) = p.naive(n - tq, n, |_| 0);
            for imp in IMPS {
                for st in [ColumnStats::Exact, ColumnStats::Eager] {
                    let col = p.call(n - tq, n, imp, 7, Some(st)).col.unwrap_or_default();
                    assert_close(&col, &want, 1e-5, &format!("col {imp} {st} tq {tq} n {n}"));
                    for cg in col.chunks(n) {
                        // G = 3 heads per group, each row's probabilities sum to 1.
                        let total: f64 = cg.iter().map(|&x| x as f64).sum();
                        assert!(
                            (total / (3.0 * tq as f64) - 1.0).abs() < 1e-3,
                            "Σ col {imp} {st}: {total}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn prefill_exact_stats_invariant_to_call_split() {
        let n = 100;
        let p = Prompt::random(3, n, shape(6, 2, 16));
        let (_, _, want) = p.naive(0, n, |_| 0);
        for imp in IMPS {
            let mut first: Option<Vec<f32>> = None;
            for size in [1, 7, 64, 100] {
                // The engine's chunked prefill: each call sees the cache of the earlier ones.
                let mut total = vec![0f32; 2 * n];
                for a in (0..n).step_by(size) {
                    let b = (a + size).min(n);
                    let col = p
                        .call(a, b, imp, 5, Some(ColumnStats::Exact))
                        .col
                        .unwrap_or_default();
                    for (t, c) in total.chunks_mut(n).zip(col.chunks(b)) {
                        t.iter_mut().zip(c).for_each(|(x, y)| *x += y);
                    }
                }
                assert_close(&total, &want, 1e-5, &format!("{imp} split {size}"));
                match &first {
                    None => first = Some(total),
                    Some(w) => assert_close(
                        &total,
                        &to_f64(w),
                        1e-5,
                        &format!("{imp} split {size} vs 1"),
                    ),
                }
            }
        }
    }

    #[test]
    fn prefill_chunked_stats_are_within_chunk() {
        let s = shape(6, 2, 16);
        // Chunk ≥ n on a whole prompt: exactly the exact statistics.
        let p = Prompt::random(11, 40, s);
        let exact = p
            .call(0, 40, AttentionImpl::Flash, 1, Some(ColumnStats::Exact))
            .col
            .unwrap_or_default();
        let big = p
            .call(0, 40, AttentionImpl::Eager, 64, Some(ColumnStats::Chunked))
            .col
            .unwrap_or_default();
        assert_close(&big, &to_f64(&exact), 1e-5, "chunk ≥ n");
        // A continuation (rows 23..60 after a cached context) in chunks of 16: each
        // chunk's rows are an independent prompt over the chunk's own keys; cached keys
        // get nothing; the output is still the full causal attention.
        let (n, off, chunk) = (60, 23, 16);
        let p = Prompt::random(12, n, s);
        let r = p.call(
            off,
            n,
            AttentionImpl::Flash,
            chunk,
            Some(ColumnStats::Chunked),
        );
        let col = r.col.unwrap_or_default();
        let (full_out, _, full_col) = p.naive(off, n, |_| 0);
        assert_close(&r.out, &full_out, 1e-5, "chunked-stats output");
        let (_, _, want) = p.naive(off, n, |i| off + (i - off) / chunk * chunk);
        assert_close(&col, &want, 1e-5, "within-chunk columns");
        // Keys of chunk 0 = column sums of chunk 0's rows alone, as a prompt of its own
        // 16 tokens; later rows (which do see those keys) add nothing.
        let alone = p.slice(off, off + chunk).call(
            0,
            chunk,
            AttentionImpl::Eager,
            1,
            Some(ColumnStats::Exact),
        );
        let alone = alone.col.unwrap_or_default();
        for (cg, ag) in col.chunks(n).zip(alone.chunks(chunk)) {
            assert!(cg[..off].iter().all(|&x| x == 0.0), "cached keys");
            assert_close(&cg[off..off + chunk], &to_f64(ag), 1e-5, "chunk 0 alone");
            let total: f32 = cg.iter().sum();
            assert!(
                (total / (3.0 * (n - off) as f32) - 1.0).abs() < 1e-3,
                "Σ col {total}"
            );
        }
        // ...so they differ from the exact statistics, by a lot.
        let diff: f64 = col
            .iter()
            .zip(&full_col)
            .map(|(&a, b)| (a as f64 - b).abs())
            .sum();
        assert!(diff > 10.0, "within-chunk vs exact: {diff}");
    }

    #[test]
    fn prefill_scratch_limit_and_accounting() {
        let (s, n) = (shape(6, 2, 16), 200);
        let p = Prompt::random(5, n, s);
        let eager = (6 * n * n * 4) as u64;
        let limit = Some(eager - 1);
        let err = p.try_call(0, n, AttentionImpl::Eager, 1, None, limit).err();
        assert_eq!(
            err,
            Some(ScratchExceeded {
                requested: eager,
                limit: eager - 1
            })
        );
        // Eager statistics need the full matrix whatever the attention implementation.
        let err = p
            .try_call(
                0,
                n,
                AttentionImpl::Flash,
                1,
                Some(ColumnStats::Eager),
                limit,
            )
            .err();
        assert_eq!(err.map(|e| e.requested), Some(eager));
        for (imp, st) in [
            (AttentionImpl::Flash, Some(ColumnStats::Exact)),
            (AttentionImpl::Flash, None),
            (AttentionImpl::Chunked, Some(ColumnStats::Chunked)),
        ] {
            let Ok(r) = p.try_call(0, n, imp, 32, st, limit) else {
                panic!("{imp} {st:?} should fit")
            };
            assert!(r.scratch_bytes < eager / 4, "{imp}: {}", r.scratch_bytes);
        }
        for imp in IMPS {
            for st in [
                None,
                Some(ColumnStats::Eager),
                Some(ColumnStats::Chunked),
                Some(ColumnStats::Exact),
            ] {
                let r = p.call(0, n, imp, 32, st);
                assert_eq!(
                    r.scratch_bytes,
                    scratch_bytes(n, n, s, imp, 32, st),
                    "{imp} {st:?}"
                );
            }
        }
        assert_eq!(scratch_bytes(n, n, s, AttentionImpl::Eager, 1, None), eager);
        // Chunks of 32 rows: the last (rows 192..200, 8 rows) sees all 200 keys, the
        // previous one (160..192) sees 192: max(32·192, 8·200) rows × keys.
        assert_eq!(
            scratch_bytes(n, n, s, AttentionImpl::Chunked, 32, None),
            6 * 32 * 192 * 4
        );
    }

    #[test]
    fn prefill_dominant_key_gets_all_mass() {
        let (n, hot) = (50, 3);
        let mut rng = StdRng::seed_from_u64(9);
        let mut p = Prompt::random(9, n, shape(6, 2, 16));
        // Queries near the all-ones direction; the hot key is 10 × all-ones (score ≈ 40),
        // the others small (scores below 0.5).
        p.q.iter_mut()
            .for_each(|x| *x = 1.0 + 0.1 * rng.random_range(-1.0..1.0f32));
        p.k.iter_mut().for_each(|x| *x *= 0.05);
        p.k[hot * 32..(hot + 1) * 32]
            .iter_mut()
            .for_each(|x| *x = 10.0);
        for (tq, st) in [
            (n, ColumnStats::Exact),
            (n, ColumnStats::Eager),
            (20, ColumnStats::Exact),
        ] {
            for imp in IMPS {
                let col = p.call(n - tq, n, imp, 8, Some(st)).col.unwrap_or_default();
                let rows_seeing = (tq - hot.saturating_sub(n - tq)) as f32;
                for cg in col.chunks(n) {
                    let c = cg[hot];
                    assert!(
                        (c - 3.0 * rows_seeing).abs() < 1e-3,
                        "{imp} {st} tq {tq}: {c}"
                    );
                    assert!(
                        cg[hot + 1..].iter().all(|&x| x < 1e-6),
                        "{imp} {st} later keys"
                    );
                }
            }
        }
    }

    #[test]
    fn prefill_names_round_trip() {
        for imp in IMPS {
            assert_eq!(imp.to_string().parse::<AttentionImpl>(), Ok(imp));
        }
        for st in STATS {
            assert_eq!(st.to_string().parse::<ColumnStats>(), Ok(st));
        }
        let err = "paged".parse::<AttentionImpl>().err().unwrap_or_default();
        assert!(err.contains("paged") && err.contains("flash"), "{err}");
        let err = "naive".parse::<ColumnStats>().err().unwrap_or_default();
        assert!(err.contains("naive") && err.contains("exact"), "{err}");
        assert_eq!(
            serde_json::to_string(&ColumnStats::Exact).ok().as_deref(),
            Some("\"exact\"")
        );
    }
}
