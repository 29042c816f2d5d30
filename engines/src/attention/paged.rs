//! Paged attention on CPU: each query row reads its keys block by block through the
//! sequence's block table (no gather into a contiguous copy), with an online softmax
//! in f32 so memory stays O(dh) per row whatever the context length.

use crate::kv::paged::KvView;
use crate::kv::BlockId;

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
    run(Simd::detect(), q, seqs, k, v, shape)
}

/// The instruction sets the kernel runs on, checked once per call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Simd {
    Portable,
    /// AVX2 and FMA.
    Avx2,
    /// AVX2 and FMA, and AVX-512 ([`has_avx512`]) for the inner loops that take all the query heads of
    /// a KV head at once (the same sums in the same order: the same results to the
    /// bit as `Avx2`). A 576-token prefill of SmolLM2-135M reached its first token in
    /// 0.92 of the time (docs/correctness-and-performance.md, "The query heads of a KV
    /// head at once").
    Avx512,
}

impl Simd {
    fn detect() -> Self {
        if !has_avx2_fma() {
            Simd::Portable
        } else if has_avx512() {
            Simd::Avx512
        } else {
            Simd::Avx2
        }
    }
}

fn run(
    simd: Simd,
    q: &[f32],
    seqs: &[SeqAttn<'_>],
    k: KvView<'_>,
    v: KvView<'_>,
    s: AttnShape,
) -> Vec<f32> {
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
    let threads = rayon::current_num_threads();
    // One work item = one query row and all of its KV heads: a block's K (and V) rows of
    // every head are one contiguous run in the pool, read as one stream (an item per KV
    // head read a third of each block at a time, at about half the rate:
    // `examples/decode_attention.rs`). Too few rows for the threads split each row's keys
    // instead (below).
    let chunk = h * dh;
    // Handing a few microseconds of work to the pool costs more than it saves.
    let keys: usize = seqs.iter().map(|x| x.q_len * x.kv_len).sum();
    let serial = threads == 1 || keys * h * dh < 1 << 16;
    // Still too few items for the threads (a decode batch of one or two): each row's
    // keys are split too, in runs of whole blocks of at least `MIN_SPLIT` keys, and
    // the runs' partial softmaxes combined (flash-decoding).
    const MIN_SPLIT: usize = 128;
    let longest = seqs.iter().map(|x| x.kv_len).max().unwrap_or(0);
    let splits = if serial || rows >= 2 * threads {
        1
    } else {
        let n = (4 * threads).div_ceil(rows).min(longest / MIN_SPLIT).max(1);
        // Whole rounds over the threads: 5 splits on 2 threads left one thread a third
        // split alone, and a batch-1 step's attention at 650 tokens took 3.8-4.2 ms
        // against 2.2-2.6 ms with 4 (docs/correctness-and-performance.md, "Attention's
        // key splits in whole rounds over the threads").
        if n >= threads {
            n / threads * threads
        } else {
            n
        }
    };
    let group_rows = h;
    // The query heads of one row.
    let query = |row: usize| &q[row * h * dh..][..chunk];
    if splits == 1 {
        // Items of up to `TILE` consecutive rows of one sequence (a prefill's rows read
        // each block of K/V once together); a decode row is an item of its own.
        let mut items: Vec<(usize, usize, &mut [f32])> = Vec::new();
        let mut rest: &mut [f32] = &mut out;
        let mut row = 0;
        while row < rows {
            let mut n = 1;
            if let Some((si, pos)) = row_info[row] {
                while n < TILE && row + n < rows && row_info[row + n] == Some((si, pos + n)) {
                    n += 1;
                }
            }
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(n * chunk);
            items.push((row, n, head));
            rest = tail;
            row += n;
        }
        let work = |(row, n, o): (usize, usize, &mut [f32])| {
            let Some((si, pos)) = row_info[row] else {
                return;
            };
            let mut ml = vec![0f32; 2 * group_rows * n];
            let item = Row {
                qr: &q[row * chunk..(row + n) * chunk],
                q_stride: chunk,
                rows: n,
                keys: 0..pos + 1,
                table: seqs[si].table,
                k,
                v,
                groups: 0..hkv,
                s,
                hints: seqs[si].q_len == 1,
            };
            attend_row(simd, item, o, &mut ml);
            for (or, mlr) in o
                .chunks_exact_mut(chunk)
                .zip(ml.chunks_exact(2 * group_rows))
            {
                normalize(or, mlr, dh);
            }
        };
        if serial {
            items.into_iter().for_each(work);
        } else {
            // Each item taken by whichever thread claims it (on the forward's team, where
            // the calling thread runs one: `model::team`).
            let items: Vec<std::sync::Mutex<Option<_>>> = items
                .into_iter()
                .map(|i| std::sync::Mutex::new(Some(i)))
                .collect();
            crate::model::team::for_each_share(items.len(), &|i| {
                let mut slot = items[i].lock().unwrap_or_else(|e| e.into_inner());
                if let Some(item) = slot.take() {
                    work(item);
                }
            });
        }
        return out;
    }
    // Partial outputs (unnormalized) with their running max and sum, per (row, split),
    // then combined in split order.
    let part = |item: usize| {
        let (row, sp) = (item / splits, item % splits);
        let mut o = vec![0f32; chunk];
        let mut ml = vec![f32::NEG_INFINITY; 2 * group_rows];
        ml[group_rows..].fill(0.0);
        let Some((si, pos)) = row_info[row] else {
            return (o, ml);
        };
        let n = pos + 1;
        let span = n.div_ceil(splits).div_ceil(s.block_size) * s.block_size;
        let keys = (sp * span).min(n)..((sp + 1) * span).min(n);
        if !keys.is_empty() {
            let item = Row {
                qr: query(row),
                q_stride: chunk,
                rows: 1,
                keys,
                table: seqs[si].table,
                k,
                v,
                groups: 0..hkv,
                s,
                hints: seqs[si].q_len == 1,
            };
            attend_row(simd, item, &mut o, &mut ml);
        }
        (o, ml)
    };
    let slots: Vec<std::sync::OnceLock<(Vec<f32>, Vec<f32>)>> = (0..rows * splits)
        .map(|_| std::sync::OnceLock::new())
        .collect();
    crate::model::team::for_each_share(slots.len(), &|i| {
        let _ = slots[i].set(part(i));
    });
    let parts: Vec<(Vec<f32>, Vec<f32>)> = slots
        .into_iter()
        .map(|c| c.into_inner().expect("for_each_share runs every share"))
        .collect();
    for (ri, o) in out.chunks_mut(chunk).enumerate() {
        let ps = &parts[ri * splits..(ri + 1) * splits];
        for hq in 0..group_rows {
            let m = ps
                .iter()
                .map(|(_, ml)| ml[hq])
                .fold(f32::NEG_INFINITY, f32::max);
            if m == f32::NEG_INFINITY {
                continue;
            }
            let mut l = 0f32;
            let oh = &mut o[hq * dh..(hq + 1) * dh];
            for (po, ml) in ps {
                let w = exp(ml[hq] - m);
                l += ml[group_rows + hq] * w;
                for (a, b) in oh.iter_mut().zip(&po[hq * dh..(hq + 1) * dh]) {
                    *a += w * b;
                }
            }
            let inv = 1.0 / l;
            oh.iter_mut().for_each(|x| *x *= inv);
        }
    }
    out
}

/// Divide each query head's accumulated output by its softmax sum (`ml`: running
/// maxima, then sums).
fn normalize(o: &mut [f32], ml: &[f32], dh: usize) {
    let nh = ml.len() / 2;
    for hq in 0..nh {
        let inv = 1.0 / ml[nh + hq];
        o[hq * dh..(hq + 1) * dh].iter_mut().for_each(|x| *x *= inv);
    }
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

/// Whether the 512-bit kernels can run here: AVX2 and FMA, AVX-512F and AVX-512DQ (the
/// attention's loops over a KV head's query heads, [`dot4xn_packed_wide`]).
pub fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        has_avx2_fma()
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512dq")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The work of [`attend_row`]: `rows` consecutive query rows of one sequence, their
/// query heads of KV heads `groups` (`qr`: row `r`'s `[groups × G, dh]` from
/// `r · q_stride`), over `keys` (starting on a block boundary) for the first row and
/// one more key for each next row (consecutive positions), of the sequence with block
/// table `table`. The rows read each block of K/V once together, from the core's first
/// cache for all but the first of them (docs/correctness-and-performance.md, "Prefill
/// rows in fours"); each row's sums are its own, in the order one row alone takes them.
/// Prefetch hints when `hints`: a decode row's K/V come from memory, while a prefill
/// chunk's rows read what the rows before them brought into cache, and hints there
/// cost 2–3 % of a 576-token prefill's TTFT.
struct Row<'a> {
    qr: &'a [f32],
    q_stride: usize,
    rows: usize,
    keys: std::ops::Range<usize>,
    table: &'a [BlockId],
    k: KvView<'a>,
    v: KvView<'a>,
    groups: std::ops::Range<usize>,
    s: AttnShape,
    hints: bool,
}

/// Attention of `row`'s rows, unnormalized: `out` holds each row's Σ e^{s−m}·v
/// (`[rows, heads × dh]`) and `ml` each row's running max `m` of each head then its
/// sum `l` (`[rows, 2 · heads]`), on the instruction sets `simd` (decided once per call
/// by the caller).
fn attend_row(simd: Simd, row: Row<'_>, out: &mut [f32], ml: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    match simd {
        // SAFETY: `Simd::detect` checked the CPU for each.
        Simd::Avx512 => return unsafe { attend_row_avx512(row, out, ml) },
        Simd::Avx2 => return unsafe { attend_row_avx2(row, out, ml) },
        Simd::Portable => {}
    }
    let _ = simd;
    attend_row_impl::<false, false>(row, out, ml)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,avx512f")]
unsafe fn attend_row_avx512(row: Row<'_>, out: &mut [f32], ml: &mut [f32]) {
    attend_row_impl::<true, true>(row, out, ml)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_row_avx2(row: Row<'_>, out: &mut [f32], ml: &mut [f32]) {
    attend_row_impl::<true, false>(row, out, ml)
}

/// Keys scored together before one softmax update (rounded down to whole blocks): a
/// score pass, then a value pass, each a plain run over the span's blocks, with one
/// rescale of the output per span instead of one per block of 16 keys. Measured with
/// the changes around it (whole rows per item, prefetch hints, the vector `exp`:
/// docs/correctness-and-performance.md); alone it made no difference that stood out of
/// the noise (`examples/decode_attention.rs`).
const SPAN: usize = 256;

/// Blocks read ahead by prefetch hints.
const AHEAD: usize = 2;

/// Consecutive prefill rows of one sequence taken together (docs/
/// correctness-and-performance.md, "Prefill rows in fours").
const TILE: usize = 4;

/// `AVX`: called from the AVX2+FMA build only after the CPU was checked; `WIDE`: from
/// the AVX-512F build, likewise.
#[inline(always)]
fn attend_row_impl<const AVX: bool, const WIDE: bool>(
    row: Row<'_>,
    out: &mut [f32],
    ml: &mut [f32],
) {
    let Row {
        qr,
        q_stride,
        rows,
        keys,
        table,
        k,
        v,
        groups,
        s,
        hints,
    } = row;
    let (hkv, dh, bs) = (s.num_kv_heads, s.head_dim, s.block_size);
    let g_size = s.num_heads / hkv;
    let nh = groups.len() * g_size; // query heads of this item
    let scale = 1.0 / (dh as f32).sqrt();
    for mlr in ml.chunks_exact_mut(2 * nh).take(rows) {
        let (m, l) = mlr.split_at_mut(nh);
        m.fill(f32::NEG_INFINITY);
        l.fill(0.0);
    }
    out[..rows * nh * dh].fill(0.0);
    // Storage other than f32: one head's block, decoded once for its G query heads.
    let (mut kf, mut vf) = (Vec::new(), Vec::new());
    let span = (SPAN / bs).max(1) * bs;
    // Each row's query heads' scores over the span, then their softmax weights.
    let mut p = vec![0f32; rows * nh * span];
    // The pieces of `a..b` that lie in one block each: (first key, length).
    let pieces = |a: usize, b: usize| {
        let mut t = a;
        std::iter::from_fn(move || {
            (t < b).then(|| {
                let len = (b - t).min(bs - t % bs);
                t += len;
                (t - len, len)
            })
        })
    };
    // Where head `g`'s rows of the block holding key `t` start in the cache.
    let first = |t: usize, g: usize| (table[t / bs] as usize * hkv + g) * bs + t % bs;
    // Hints for the rows of every head of the keys `t..` to the end of their block
    // (nothing past `to`): issued `AHEAD` blocks before they are read.
    let hint = |view: &KvView<'_>, t: usize, to: usize| {
        if hints && t < to {
            let n = (to - t).min(bs - t % bs);
            for g in groups.clone() {
                view.prefetch(first(t, g), n, dh);
            }
        }
    };
    // The last row's keys; row `r` ends `rows - 1 - r` keys before.
    let last = keys.end + rows - 1;
    let mut start = keys.start;
    while start < last {
        let end = (start + span).min(last);
        // Row `r`'s part of this span: `start..end_of(r)` (empty once its keys end).
        let end_of = |r: usize| (start + span).min(keys.end + r).max(start);
        if start == keys.start {
            for i in 0..AHEAD {
                hint(&k, start + i * bs, end);
            }
        }
        for (t, len) in pieces(start, end) {
            hint(&k, t + AHEAD * bs, end);
            for (gi, g) in groups.clone().enumerate() {
                let kb = k.rows(first(t, g), len, dh, &mut kf);
                for (r, pr) in p.chunks_exact_mut(nh * span).enumerate().take(rows) {
                    let len = len.min(end_of(r).saturating_sub(t));
                    if len == 0 {
                        continue;
                    }
                    let qr = &qr[r * q_stride..][..nh * dh];
                    #[cfg(target_arch = "x86_64")]
                    if WIDE && simd::wide_scores_fit(g_size, dh) {
                        // Every query head of this KV head over four keys at a time,
                        // each key's row loaded once for all of them (the keys of the
                        // block past its last four: one by one below).
                        let qg = &qr[gi * g_size * dh..(gi + 1) * g_size * dh];
                        let quads = len / 4;
                        let at = gi * g_size * span + (t - start);
                        // SAFETY: `WIDE` comes from the AVX-512F build.
                        unsafe { simd::scores_heads(kb, len, qg, dh, scale, &mut pr[at..], span) };
                        for j in 0..g_size {
                            let hq = gi * g_size + j;
                            let qh = &qr[hq * dh..(hq + 1) * dh];
                            let ps = &mut pr[hq * span + (t - start)..][..len];
                            for (pt, kt) in ps[4 * quads..]
                                .iter_mut()
                                .zip(kb[4 * quads * dh..].chunks_exact(dh))
                            {
                                *pt = scale * dot_dispatch::<AVX>(qh, kt);
                            }
                        }
                        continue;
                    }
                    for j in 0..g_size {
                        let hq = gi * g_size + j;
                        let qh = &qr[hq * dh..(hq + 1) * dh];
                        let ps = &mut pr[hq * span + (t - start)..][..len];
                        // Four keys per pass: the query's chunks are loaded once for
                        // them and their sums reduced together.
                        let quads = len / 4;
                        for (pq, kq) in ps[..4 * quads]
                            .chunks_exact_mut(4)
                            .zip(kb.chunks_exact(4 * dh))
                        {
                            let d = dot4_dispatch::<AVX>(kq, qh);
                            for (pt, x) in pq.iter_mut().zip(d) {
                                *pt = scale * x;
                            }
                        }
                        for (pt, kt) in ps[4 * quads..]
                            .iter_mut()
                            .zip(kb[4 * quads * dh..].chunks_exact(dh))
                        {
                            *pt = scale * dot_dispatch::<AVX>(qh, kt);
                        }
                    }
                }
            }
        }
        for i in 0..AHEAD {
            hint(&v, start + i * bs, end);
        }
        for (r, ((pr, mlr), or)) in p
            .chunks_exact_mut(nh * span)
            .zip(ml.chunks_exact_mut(2 * nh))
            .zip(out.chunks_exact_mut(nh * dh))
            .enumerate()
            .take(rows)
        {
            let n = end_of(r) - start;
            if n == 0 {
                continue;
            }
            let (m, l) = mlr.split_at_mut(nh);
            for hq in 0..nh {
                let ps = &mut pr[hq * span..][..n];
                let m_new = m[hq].max(max_of(ps));
                let alpha = exp(m[hq] - m_new);
                if alpha != 1.0 {
                    or[hq * dh..(hq + 1) * dh]
                        .iter_mut()
                        .for_each(|x| *x *= alpha);
                }
                for pt in ps.iter_mut() {
                    *pt = exp(*pt - m_new);
                }
                l[hq] = l[hq] * alpha + sum_of(ps);
                m[hq] = m_new;
            }
        }
        for (t, len) in pieces(start, end) {
            // The last values' blocks ask for the next span's first keys.
            let ahead = t + AHEAD * bs;
            if ahead < end {
                hint(&v, ahead, end);
            } else {
                hint(&k, ahead, (end + span).min(last));
            }
            for (gi, g) in groups.clone().enumerate() {
                let vb = v.rows(first(t, g), len, dh, &mut vf);
                for (r, (pr, or)) in p
                    .chunks_exact(nh * span)
                    .zip(out.chunks_exact_mut(nh * dh))
                    .enumerate()
                    .take(rows)
                {
                    let len = len.min(end_of(r).saturating_sub(t));
                    if len == 0 {
                        continue;
                    }
                    #[cfg(target_arch = "x86_64")]
                    if WIDE && simd::wide_values_fit(g_size, dh) {
                        // Every query head of this KV head at once, each value row
                        // loaded once for all of them.
                        let at = gi * g_size * span + (t - start);
                        let og = &mut or[gi * g_size * dh..(gi + 1) * g_size * dh];
                        // SAFETY: `WIDE` comes from the AVX-512F build.
                        unsafe { simd::accumulate_heads(&pr[at..], span, len, vb, og, g_size, dh) };
                        continue;
                    }
                    for j in 0..g_size {
                        let hq = gi * g_size + j;
                        let ps = &pr[hq * span + (t - start)..][..len];
                        accumulate_dispatch::<AVX>(ps, vb, &mut or[hq * dh..(hq + 1) * dh]);
                    }
                }
            }
        }
        start += span;
    }
}

/// The largest of `x` (−∞ when empty), in eight lanes so that it vectorizes.
#[inline(always)]
fn max_of(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let c = x.chunks_exact(8);
    let rest = c.remainder();
    for ch in c {
        for i in 0..8 {
            acc[i] = if ch[i] > acc[i] { ch[i] } else { acc[i] };
        }
    }
    acc.iter()
        .chain(rest)
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b))
}

/// The sum of `x` in eight lanes, so that it vectorizes.
#[inline(always)]
fn sum_of(x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let c = x.chunks_exact(8);
    let rest = c.remainder();
    for ch in c {
        for i in 0..8 {
            acc[i] += ch[i];
        }
    }
    acc.iter().sum::<f32>() + rest.iter().sum::<f32>()
}

/// `e^x` for x ≤ 0 (softmax arguments), branch-free so loops over a block vectorize
/// instead of calling libm per element. Range reduction x = k·ln2 + r, |r| ≤ ln2/2, and a
/// degree-6 polynomial: relative error below 3e-7 (tested against `f32::exp`); 0 below
/// about −87.7.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let x = x.clamp(-88.0, 88.0);
    let k = (x * std::f32::consts::LOG2_E).round();
    // ln 2 split in two (Cody–Waite) so k·ln2 is exact enough in f32.
    let r = (x - k * 0.693_359_4) + k * 2.121_944_4e-4;
    let poly = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // 2^k from its exponent bits, k + 127 (a whole number in 0..=254) read off the
    // mantissa of k + 127 + 2^23: integer operations only, so a loop of these vectorizes
    // (a float-to-int cast checks each element for NaN on its own); k = −127 gives +0.
    let e = (k + (127.0 + 8_388_608.0)).to_bits() & 0x7f_ffff;
    f32::from_bits(e << 23) * poly
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

/// One row of a matrix-vector product: `w · x` with exactly the arithmetic of one row
/// of [`dot4_with`] (the same accumulators and order of sums, so the same result to the
/// bit), but reading the row alone. Rows taken one after another make one sequential
/// stream per thread, which the prefetchers follow closer to the memory's rate than
/// four rows read side by side (docs/correctness-and-performance.md).
#[inline]
pub fn dot_row_with(avx: bool, w: &[f32], x: &[f32]) -> f32 {
    debug_assert!(w.len() >= x.len());
    #[cfg(target_arch = "x86_64")]
    if avx && has_avx2_fma() {
        // SAFETY: AVX2 and FMA checked just above.
        return unsafe { simd::dot_row(w, x) };
    }
    dot(&w[..x.len()], x)
}

/// Dot products of four rows of `w` (`[4, x.len()]`, contiguous) with `x`: one pass
/// that loads each chunk of `x` once for the four rows and reduces the four sums
/// together (a matrix-vector product's inner loop), AVX2+FMA when `avx`.
#[inline]
pub fn dot4_with(avx: bool, w: &[f32], x: &[f32]) -> [f32; 4] {
    debug_assert!(w.len() >= 4 * x.len());
    // Re-checked (a cached load) so a wrong `avx` cannot reach the AVX2 code.
    if avx && has_avx2_fma() {
        dot4_dispatch::<true>(w, x)
    } else {
        dot4_dispatch::<false>(w, x)
    }
}

/// [`dot4_with`] over four rows packed as [`crate::model::packed`] lays them out
/// (`4 · x.len()` floats): the same results to the bit, read as one stream.
#[inline]
pub fn dot4_packed_with(avx: bool, w: &[f32], x: &[f32]) -> [f32; 4] {
    debug_assert!(w.len() >= 4 * x.len());
    #[cfg(target_arch = "x86_64")]
    if avx && has_avx2_fma() {
        // SAFETY: AVX2 and FMA checked just above.
        return unsafe { simd::dot4_packed(w, x) };
    }
    dot4_unpacked(w, &[x]).remove(0)
}

/// The portable form of the packed kernels: the group unpacked once, then each row
/// dotted with each input as [`dot`] does for the row layout.
fn dot4_unpacked(w: &[f32], xs: &[&[f32]]) -> Vec<[f32; 4]> {
    let k = xs.first().map_or(0, |x| x.len());
    let mut rows = vec![0f32; 4 * k];
    crate::model::packed::unpack_group(w, k, &mut rows);
    xs.iter()
        .map(|x| std::array::from_fn(|r| dot(&rows[r * k..(r + 1) * k], x)))
        .collect()
}

/// Four packed rows (as [`dot4_packed_with`] reads them) dotted with two inputs in one
/// pass over the rows, AVX2+FMA when `avx`; the sums run in another order than
/// [`dot4_packed_with`]'s (within f32 rounding of it).
#[inline]
pub fn dot4x2_packed_with(avx: bool, w: &[f32], x0: &[f32], x1: &[f32]) -> [[f32; 4]; 2] {
    debug_assert!(w.len() >= 4 * x0.len() && x0.len() == x1.len());
    #[cfg(target_arch = "x86_64")]
    if avx && has_avx2_fma() {
        // SAFETY: AVX2 and FMA checked just above.
        return unsafe { simd::dot4x2_packed(w, x0, x1) };
    }
    let d = dot4_unpacked(w, &[x0, x1]);
    [d[0], d[1]]
}

/// Four packed rows dotted with each of `N` inputs in one pass over the rows, in
/// 512-bit registers where [`has_avx512`] (two rows of an 8-column chunk a
/// register): each input's results are [`dot4x2_packed_with`]'s AVX2 results to the
/// bit, whatever it is grouped with. Elsewhere, [`dot4x2_packed_with`]'s portable
/// form.
#[inline]
pub fn dot4xn_packed_wide<const N: usize>(w: &[f32], xs: [&[f32]; N]) -> [[f32; 4]; N] {
    let k = xs.first().map_or(0, |x| x.len());
    assert!(w.len() >= 4 * k && xs.iter().all(|x| x.len() == k));
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU features checked just above; lengths asserted.
        return unsafe { simd::dot4xn_packed_z(w, xs) };
    }
    let d = dot4_unpacked(w, &xs);
    std::array::from_fn(|j| d[j])
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
fn dot4_dispatch<const AVX: bool>(w: &[f32], x: &[f32]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if AVX {
        // SAFETY: `AVX` is only true on CPUs with AVX2 and FMA (see `attend_row`).
        return unsafe { simd::dot4(w, x) };
    }
    let k = x.len();
    std::array::from_fn(|i| dot(&w[i * k..(i + 1) * k], x))
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

    /// The products of `pa[i]·pb[i]` for `i` below `n` in whole chunks of 8, summed in
    /// two accumulators over chunks of 16 (a last chunk of 8 into the first), and where
    /// the scalar tail starts: [`dot`] and [`dot_row`] then reduce them in their own
    /// orders. Both pointers must be valid for `n` floats.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn two_accumulators(
        pa: *const f32,
        pb: *const f32,
        n: usize,
    ) -> (__m256, __m256, usize) {
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
        (acc0, acc1, i)
    }

    /// Dot product; `a` and `b` have the same length.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (acc0, acc1, mut i) = two_accumulators(a.as_ptr(), b.as_ptr(), n);
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

    /// Four rows of `w` (`[4, k]`) dotted with `x` (`k`): two accumulators per row,
    /// each chunk of `x` loaded once for the four rows.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot4(w: &[f32], x: &[f32]) -> [f32; 4] {
        let k = x.len();
        assert!(w.len() >= 4 * k);
        let (pw, px) = (w.as_ptr(), x.as_ptr());
        let rows = [pw, pw.add(k), pw.add(2 * k), pw.add(3 * k)];
        let mut acc = [[_mm256_setzero_ps(); 2]; 4];
        let mut i = 0;
        while i + 16 <= k {
            let (x0, x1) = (_mm256_loadu_ps(px.add(i)), _mm256_loadu_ps(px.add(i + 8)));
            for (a, r) in acc.iter_mut().zip(rows) {
                a[0] = _mm256_fmadd_ps(_mm256_loadu_ps(r.add(i)), x0, a[0]);
                a[1] = _mm256_fmadd_ps(_mm256_loadu_ps(r.add(i + 8)), x1, a[1]);
            }
            i += 16;
        }
        if i + 8 <= k {
            let x0 = _mm256_loadu_ps(px.add(i));
            for (a, r) in acc.iter_mut().zip(rows) {
                a[0] = _mm256_fmadd_ps(_mm256_loadu_ps(r.add(i)), x0, a[0]);
            }
            i += 8;
        }
        let mut out = reduce4(&acc);
        while i < k {
            for (o, r) in out.iter_mut().zip(rows) {
                *o += *r.add(i) * x[i];
            }
            i += 1;
        }
        out
    }

    /// Four rows' two accumulators each reduced to their sums at once: pairwise adds,
    /// then the two 128-bit halves ([`dot_row`] follows the same tree for one row).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn reduce4(acc: &[[__m256; 2]; 4]) -> [f32; 4] {
        let s: [__m256; 4] = std::array::from_fn(|r| _mm256_add_ps(acc[r][0], acc[r][1]));
        let h01 = _mm256_hadd_ps(s[0], s[1]);
        let h23 = _mm256_hadd_ps(s[2], s[3]);
        let h = _mm256_hadd_ps(h01, h23);
        let sum = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        let mut out = [0f32; 4];
        _mm_storeu_ps(out.as_mut_ptr(), sum);
        out
    }

    /// The two 256-bit halves of `z`: lanes 0-7 and 8-15.
    #[inline]
    #[target_feature(enable = "avx2,fma,avx512f")]
    unsafe fn halves(z: __m512) -> [__m256; 2] {
        [
            _mm512_castps512_ps256(z),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(z))),
        ]
    }

    /// Whether [`scores_heads`] takes `g` query heads of `dh` (registers: `4g` sums).
    pub fn wide_scores_fit(g: usize, dh: usize) -> bool {
        (1..=4).contains(&g) && dh.is_multiple_of(16) && dh > 0
    }

    /// The scaled scores of a block's whole quads of keys (`kb`: `[len, dh]`, the first
    /// `4·(len/4)` keys) against each of the `G ≤ 4` query heads of `qg` (`[G, dh]`):
    /// `scale ·` [`dot4`] of each four keys and head, written to `p[j·stride + key]`
    /// for head `j`. Each key's 16-float chunk is loaded once for every head; lanes
    /// 0-7 of each 512-bit sum take exactly [`dot4`]'s first accumulator's sums and
    /// lanes 8-15 its second's, in the same order, and [`reduce16`] adds the same
    /// pairs as [`reduce4`], so the results are [`dot4`]'s to the bit. `dh` a multiple
    /// of 16 ([`wide_scores_fit`]).
    #[target_feature(enable = "avx2,fma,avx512f")]
    pub unsafe fn scores_heads(
        kb: &[f32],
        len: usize,
        qg: &[f32],
        dh: usize,
        scale: f32,
        p: &mut [f32],
        stride: usize,
    ) {
        match qg.len() / dh {
            1 => scores_heads_g::<1>(kb, len, qg, dh, scale, p, stride),
            2 => scores_heads_g::<2>(kb, len, qg, dh, scale, p, stride),
            3 => scores_heads_g::<3>(kb, len, qg, dh, scale, p, stride),
            _ => scores_heads_g::<4>(kb, len, qg, dh, scale, p, stride),
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,avx512f")]
    unsafe fn scores_heads_g<const G: usize>(
        kb: &[f32],
        len: usize,
        qg: &[f32],
        dh: usize,
        scale: f32,
        p: &mut [f32],
        stride: usize,
    ) {
        let quads = len / 4;
        assert!(kb.len() >= 4 * quads * dh && qg.len() >= G * dh && dh.is_multiple_of(16));
        assert!(quads == 0 || p.len() >= (G - 1) * stride + 4 * quads);
        let (pk, pq) = (kb.as_ptr(), qg.as_ptr());
        let sv = _mm512_set1_ps(scale);
        for qi in 0..quads {
            let pk = pk.add(4 * qi * dh);
            let mut acc = [_mm512_setzero_ps(); 16];
            let mut i = 0;
            while i + 16 <= dh {
                let kr: [__m512; 4] = std::array::from_fn(|r| _mm512_loadu_ps(pk.add(r * dh + i)));
                for j in 0..G {
                    let x = _mm512_loadu_ps(pq.add(j * dh + i));
                    for (r, kv) in kr.iter().enumerate() {
                        acc[4 * j + r] = _mm512_fmadd_ps(*kv, x, acc[4 * j + r]);
                    }
                }
                i += 16;
            }
            // `scale · x` per sum, as the scalar loop multiplied them.
            let d = _mm512_mul_ps(sv, reduce16(acc));
            let mut out = [0f32; 16];
            _mm512_storeu_ps(out.as_mut_ptr(), d);
            for j in 0..G {
                p[j * stride + 4 * qi..][..4].copy_from_slice(&out[4 * j..4 * j + 4]);
            }
        }
    }

    /// The sums of 16 registers at once, each reduced as [`reduce4`] reduces one row's
    /// two 256-bit accumulators (lanes 0-7 and 8-15 of the register): the lanes added
    /// pairwise across the halves, then `((s0+s1)+(s2+s3)) + ((s4+s5)+(s6+s7))`. The
    /// same pairs are added (in one order or the other: addition commutes), so the
    /// same bits, but each step adds two registers' lanes in one instruction where
    /// [`reduce4`] reduces four rows with a dozen shuffles: 45 instructions for 16 sums
    /// against about 75 for four (docs/correctness-and-performance.md, "Scores reduced
    /// sixteen at a time").
    #[inline]
    #[target_feature(enable = "avx2,fma,avx512f")]
    unsafe fn reduce16(x: [__m512; 16]) -> __m512 {
        // Register a's lanes l + a's lanes l + 8 (a quarter q0 + q2, q1 + q3), then b's.
        let s: [__m512; 8] = std::array::from_fn(|m| {
            let (a, b) = (x[2 * m], x[2 * m + 1]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
                _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
            )
        });
        // Within each 128-bit quarter: [a0 + a1, a2 + a3, b0 + b1, b2 + b3].
        let pairs = |a: __m512, b: __m512| {
            _mm512_add_ps(
                _mm512_shuffle_ps::<0b10_00_10_00>(a, b),
                _mm512_shuffle_ps::<0b11_01_11_01>(a, b),
            )
        };
        let p: [__m512; 4] = std::array::from_fn(|n| pairs(s[2 * n], s[2 * n + 1]));
        let q: [__m512; 2] = std::array::from_fn(|n| pairs(p[2 * n], p[2 * n + 1]));
        // Each sum's first half (quarters 0 and 2) plus its second (1 and 3): registers
        // 0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15 in that order, put back
        // in order by the permutation.
        let r = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(q[0], q[1]),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(q[0], q[1]),
        );
        let order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
        _mm512_permutexvar_ps(order, r)
    }

    /// Whether [`accumulate_heads`] takes `g` query heads of `dh` (registers: `g + 1`
    /// rows of `dh / 16`).
    pub fn wide_values_fit(g: usize, dh: usize) -> bool {
        matches!((g, dh), (1..=4, 64) | (1..=2, 128))
    }

    /// [`accumulate`] for the `g` query heads of one KV head at once: head `j` adds
    /// `Σ_t p[j·stride + t] · vb[t]` over `t < len` into `out[j·dh..]`, each value row
    /// loaded once for every head. Lanes of each 512-bit sum take [`accumulate`]'s sums
    /// in its order: the same results to the bit. [`wide_values_fit`] must hold.
    #[target_feature(enable = "avx2,fma,avx512f")]
    pub unsafe fn accumulate_heads(
        p: &[f32],
        stride: usize,
        len: usize,
        vb: &[f32],
        out: &mut [f32],
        g: usize,
        dh: usize,
    ) {
        match (g, dh) {
            (1, 64) => acc_heads::<1, 4>(p, stride, len, vb, out),
            (2, 64) => acc_heads::<2, 4>(p, stride, len, vb, out),
            (3, 64) => acc_heads::<3, 4>(p, stride, len, vb, out),
            (4, 64) => acc_heads::<4, 4>(p, stride, len, vb, out),
            (1, 128) => acc_heads::<1, 8>(p, stride, len, vb, out),
            (2, 128) => acc_heads::<2, 8>(p, stride, len, vb, out),
            _ => panic!("accumulate_heads: {g} heads of {dh} do not fit its registers"),
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,avx512f")]
    unsafe fn acc_heads<const G: usize, const N: usize>(
        p: &[f32],
        stride: usize,
        len: usize,
        vb: &[f32],
        out: &mut [f32],
    ) {
        let dh = 16 * N;
        assert!(p.len() >= (G - 1) * stride + len && vb.len() >= len * dh);
        assert!(out.len() >= G * dh);
        let (pp, pv) = (p.as_ptr(), vb.as_ptr());
        let mut acc = [[_mm512_setzero_ps(); N]; G];
        for t in 0..len {
            let row: [__m512; N] =
                std::array::from_fn(|c| _mm512_loadu_ps(pv.add(t * dh + 16 * c)));
            for (j, aj) in acc.iter_mut().enumerate() {
                let w = _mm512_set1_ps(*pp.add(j * stride + t));
                for (a, r) in aj.iter_mut().zip(row) {
                    *a = _mm512_fmadd_ps(w, r, *a);
                }
            }
        }
        let o = out.as_mut_ptr();
        for (j, aj) in acc.iter().enumerate() {
            for (c, a) in aj.iter().enumerate() {
                let at = o.add(j * dh + 16 * c);
                _mm512_storeu_ps(at, _mm512_add_ps(_mm512_loadu_ps(at), *a));
            }
        }
    }

    /// How far ahead of its reads [`dot4_packed`] asks for the packed rows' cache lines
    /// (into L2: `prefetcht1`). The hardware prefetchers alone left a batch-1 decode
    /// step's products well under the read probe's rate on an Intel Xeon host with
    /// AVX-512 (the probe at 31-37 GB/s on 2 threads). Passes over 537 MB of packed
    /// rows split in halves, as shares of the probe: no hints 77-79 %, `prefetcht0` 6 KB
    /// ahead 80-86 %, 2-3 KB 88-92 %; with the loads in address order (below), `t0` 3 KB
    /// 89-91 %, `t1` 3 KB 92-94 %, `t1` 6 KB 86 % (docs/correctness-and-performance.md,
    /// "Prefetching the packed rows: into L2, 3 KB ahead").
    const PACKED_PREFETCH_AHEAD: usize = 3 << 10;

    /// [`dot4`] over four rows packed as [`crate::model::packed`] lays them out (each
    /// 8-column chunk of the four rows side by side, then the four rows' last `k % 8`
    /// columns): the same accumulators, order of sums and tail, so the same results to
    /// the bit, read as one stream.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot4_packed(w: &[f32], x: &[f32]) -> [f32; 4] {
        let k = x.len();
        assert!(w.len() >= 4 * k);
        let (pw, px) = (w.as_ptr(), x.as_ptr());
        let mut acc = [[_mm256_setzero_ps(); 2]; 4];
        let mut i = 0;
        // Column `i` (a multiple of 8) of the four rows starts at float `4 * i`.
        while i + 16 <= k {
            let (x0, x1) = (_mm256_loadu_ps(px.add(i)), _mm256_loadu_ps(px.add(i + 8)));
            let (p0, p1) = (pw.add(4 * i), pw.add(4 * (i + 8)));
            // The step's four cache lines, `PACKED_PREFETCH_AHEAD` bytes on (past this
            // group's end: the next group's, which the block reads next). A hint: it
            // never faults, so the address may lie past the slice.
            let ahead = (p0 as *const i8).wrapping_add(PACKED_PREFETCH_AHEAD);
            for line in 0..4 {
                _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(64 * line));
            }
            // The four lines in address order (interleaving the two halves read lines
            // 0, 2, 0, 2, 1, 3, 1, 3: 2 points of the probe slower). Each accumulator
            // takes the same sums in the same order either way.
            for (r, a) in acc.iter_mut().enumerate() {
                a[0] = _mm256_fmadd_ps(_mm256_loadu_ps(p0.add(8 * r)), x0, a[0]);
            }
            for (r, a) in acc.iter_mut().enumerate() {
                a[1] = _mm256_fmadd_ps(_mm256_loadu_ps(p1.add(8 * r)), x1, a[1]);
            }
            i += 16;
        }
        if i + 8 <= k {
            let x0 = _mm256_loadu_ps(px.add(i));
            let p0 = pw.add(4 * i);
            for (r, a) in acc.iter_mut().enumerate() {
                a[0] = _mm256_fmadd_ps(_mm256_loadu_ps(p0.add(8 * r)), x0, a[0]);
            }
            i += 8;
        }
        let mut out = reduce4(&acc);
        let (full, tail) = (i, k - i);
        let pt = pw.add(4 * full);
        while i < k {
            for (r, o) in out.iter_mut().enumerate() {
                *o += *pt.add(r * tail + i - full) * x[i];
            }
            i += 1;
        }
        out
    }

    /// Four packed rows (as [`dot4_packed`] reads them) dotted with two inputs at once:
    /// each chunk of the rows loaded once for both, one accumulator per row and input
    /// (eight FMAs to six loads, where one input takes five loads to four FMAs). Its
    /// sums run in another order than [`dot4_packed`]'s.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot4x2_packed(w: &[f32], x0: &[f32], x1: &[f32]) -> [[f32; 4]; 2] {
        let k = x0.len();
        assert!(w.len() >= 4 * k && x1.len() == k);
        let (pw, p0, p1) = (w.as_ptr(), x0.as_ptr(), x1.as_ptr());
        let mut acc = [[_mm256_setzero_ps(); 4]; 2];
        let mut i = 0;
        while i + 8 <= k {
            let (a, b) = (_mm256_loadu_ps(p0.add(i)), _mm256_loadu_ps(p1.add(i)));
            let pc = pw.add(4 * i);
            let [acc0, acc1] = &mut acc;
            for (r, (c0, c1)) in acc0.iter_mut().zip(acc1.iter_mut()).enumerate() {
                let wr = _mm256_loadu_ps(pc.add(8 * r));
                *c0 = _mm256_fmadd_ps(wr, a, *c0);
                *c1 = _mm256_fmadd_ps(wr, b, *c1);
            }
            i += 8;
        }
        let zero = _mm256_setzero_ps();
        let mut out =
            acc.map(|a| reduce4(&[[a[0], zero], [a[1], zero], [a[2], zero], [a[3], zero]]));
        let (full, tail) = (i, k - i);
        let pt = pw.add(4 * full);
        while i < k {
            let [o0, o1] = &mut out;
            for (r, (a, b)) in o0.iter_mut().zip(o1.iter_mut()).enumerate() {
                let wv = *pt.add(r * tail + i - full);
                *a += wv * x0[i];
                *b += wv * x1[i];
            }
            i += 1;
        }
        out
    }

    /// [`dot4x2_packed`] for `N` inputs: each 8-column chunk of the four rows is two
    /// 512-bit registers (rows 0-1, rows 2-3), each input's chunk broadcast to both
    /// halves, so that lanes 0-7 and 8-15 of a sum take exactly the sums of
    /// [`dot4x2_packed`]'s accumulators for two rows, in the same order; then the same
    /// reduction and tail.
    #[target_feature(enable = "avx2,fma,avx512f,avx512dq")]
    pub unsafe fn dot4xn_packed_z<const N: usize>(w: &[f32], xs: [&[f32]; N]) -> [[f32; 4]; N] {
        let k = xs.first().map_or(0, |x| x.len());
        assert!(w.len() >= 4 * k && xs.iter().all(|x| x.len() == k));
        let pw = w.as_ptr();
        let px = xs.map(|x| x.as_ptr());
        let mut acc = [[_mm512_setzero_ps(); 2]; N];
        let mut i = 0;
        while i + 8 <= k {
            let pc = pw.add(4 * i);
            let (w01, w23) = (_mm512_loadu_ps(pc), _mm512_loadu_ps(pc.add(16)));
            for (a, p) in acc.iter_mut().zip(px) {
                let x = _mm512_broadcast_f32x8(_mm256_loadu_ps(p.add(i)));
                a[0] = _mm512_fmadd_ps(w01, x, a[0]);
                a[1] = _mm512_fmadd_ps(w23, x, a[1]);
            }
            i += 8;
        }
        let zero = _mm256_setzero_ps();
        let mut out = acc.map(|a| {
            let ([r0, r1], [r2, r3]) = (halves(a[0]), halves(a[1]));
            reduce4(&[[r0, zero], [r1, zero], [r2, zero], [r3, zero]])
        });
        let (full, tail) = (i, k - i);
        let pt = pw.add(4 * full);
        while i < k {
            for (o, x) in out.iter_mut().zip(xs) {
                for (r, a) in o.iter_mut().enumerate() {
                    *a += *pt.add(r * tail + i - full) * x[i];
                }
            }
            i += 1;
        }
        out
    }

    /// One row as [`dot4`] computes each of its four: two accumulators over chunks of
    /// 16, then the same tree of horizontal sums (hadd pairs, then the two halves).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_row(w: &[f32], x: &[f32]) -> f32 {
        let k = x.len();
        assert!(w.len() >= k);
        let pw = w.as_ptr();
        let (a0, a1, mut i) = two_accumulators(pw, x.as_ptr(), k);
        // dot4's reduction for its first row: lanes (0+1)+(2+3) and (4+5)+(6+7), then
        // the low half plus the high half.
        let s = _mm256_add_ps(a0, a1);
        let h = _mm256_hadd_ps(s, s);
        let h = _mm256_hadd_ps(h, h);
        let sum = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        let mut out = _mm_cvtss_f32(sum);
        while i < k {
            out += *pw.add(i) * x[i];
            i += 1;
        }
        out
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

    /// The AVX-512F inner loops (all query heads of a KV head at once) give the AVX2
    /// build's results to the bit: decode rows over long contexts (split keys) and a
    /// prefill chunk whose keys end inside a block and past a multiple of four, over
    /// shuffled block tables, for head shapes that take the wide loops for both passes,
    /// for the scores only (`dh` 48; 4 heads of 128) and for neither (8 heads a group).
    /// On a CPU without AVX-512F and DQ the dispatch must not choose it.
    #[test]
    fn avx512_heads_match_avx2_to_the_bit() {
        use rand::seq::SliceRandom;
        use rand::{Rng, SeedableRng};
        if !has_avx512() {
            assert_ne!(Simd::detect(), Simd::Avx512, "no AVX-512F/DQ here");
            eprintln!("avx512_heads_match_avx2_to_the_bit: this CPU has no AVX-512F/DQ");
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let bs = 16;
        for (h, hkv, dh) in [
            (9, 3, 64),
            (8, 2, 64),
            (4, 4, 64),
            (8, 4, 128),
            (8, 2, 128),
            (12, 4, 48),
            (8, 1, 64),
        ] {
            let s = AttnShape {
                num_heads: h,
                num_kv_heads: hkv,
                head_dim: dh,
                block_size: bs,
            };
            let blocks = 80;
            let n = blocks * hkv * bs * dh;
            let kp: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
            let vp: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
            let mut ids: Vec<BlockId> = (0..blocks as BlockId).collect();
            ids.shuffle(&mut rng);
            let (ta, tb, tc) = (&ids[..40], &ids[40..43], &ids[43..80]);
            // (rows, keys) per sequence: decode rows at 600 and 37 keys, a prefill
            // chunk of 21 rows ending at 37 keys.
            for seqs in [
                vec![SeqAttn {
                    q_start: 0,
                    q_len: 1,
                    kv_len: 600,
                    table: ta,
                }],
                vec![
                    SeqAttn {
                        q_start: 0,
                        q_len: 1,
                        kv_len: 37,
                        table: tb,
                    },
                    SeqAttn {
                        q_start: 1,
                        q_len: 1,
                        kv_len: 590,
                        table: tc,
                    },
                ],
                vec![SeqAttn {
                    q_start: 0,
                    q_len: 21,
                    kv_len: 37,
                    table: tb,
                }],
            ] {
                let rows: usize = seqs.iter().map(|x| x.q_len).sum();
                let q: Vec<f32> = (0..rows * h * dh)
                    .map(|_| rng.random_range(-2.0..2.0))
                    .collect();
                let (kv, vv) = (KvView::F32(&kp), KvView::F32(&vp));
                let narrow = run(Simd::Avx2, &q, &seqs, kv, vv, s);
                let wide = run(Simd::Avx512, &q, &seqs, kv, vv, s);
                assert!(narrow.iter().all(|x| x.is_finite()));
                let same = narrow
                    .iter()
                    .zip(&wide)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "heads {h}/{hkv} of {dh}, rows {rows}: the wide loops differ"
                );
            }
        }
    }

    /// Four rows at once equal four plain dot products (f64), with and without the
    /// AVX2 build, for widths that leave every remainder.
    #[test]
    fn four_row_dots_match_plain_dots() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        for k in [1, 7, 8, 15, 16, 17, 24, 64, 100, 576] {
            let w: Vec<f32> = (0..4 * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let x: Vec<f32> = (0..k).map(|_| rng.random_range(-1.0..1.0)).collect();
            for avx in [false, has_avx2_fma()] {
                let got = dot4_with(avx, &w, &x);
                for (r, g) in got.iter().enumerate() {
                    let want: f64 = w[r * k..(r + 1) * k]
                        .iter()
                        .zip(&x)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum();
                    assert!((*g as f64 - want).abs() < 1e-4, "k {k} avx {avx} row {r}");
                }
            }
        }
    }

    /// One row alone gives the bits its four-row pass gives it (the matrix-vector
    /// product's results do not depend on which kernel ran), with and without AVX2.
    #[test]
    fn one_row_dots_are_the_four_row_dots_to_the_bit() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for k in [1, 7, 8, 15, 16, 17, 24, 40, 64, 100, 576, 1536] {
            let w: Vec<f32> = (0..4 * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let x: Vec<f32> = (0..k).map(|_| rng.random_range(-1.0..1.0)).collect();
            for avx in [false, has_avx2_fma()] {
                let four = dot4_with(avx, &w, &x);
                for (r, f) in four.iter().enumerate() {
                    let one = dot_row_with(avx, &w[r * k..], &x);
                    assert_eq!(one.to_bits(), f.to_bits(), "k {k} avx {avx} row {r}");
                }
            }
        }
    }

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
        // Just above 0 (a rounded softmax argument) still e^x.
        assert!((exp(0.5) - 0.5f32.exp()).abs() / 0.5f32.exp() < 3e-7);
    }
}
