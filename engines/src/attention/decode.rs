//! Decode attention (one query row per sequence) over a per-sequence key set that is
//! not a plain prefix of positions: paged slots read through a block table (H2O and
//! StreamingLLM keep per-head token sets in fixed slots) or a gathered tile followed by
//! the step's own token (InfiniGen). Optionally returns each key's attention
//! probability summed over the query heads of its KV head: H2O's per-step statistic.

use super::paged::{accumulate_with, dot_with, exp, has_avx2_fma};
use crate::kv::{BlockId, KvView};
use rayon::prelude::*;

/// Where one decode row's keys and values are.
#[derive(Clone, Copy)]
pub enum KeySet<'a> {
    /// Slots `0..len` of a paged store `[blocks, Hkv, block_size, row]`, through
    /// `table`, stored as its codec says.
    Paged {
        k: KvView<'a>,
        v: KvView<'a>,
        table: &'a [BlockId],
        len: usize,
        block_size: usize,
    },
    /// `len` contiguous rows per KV head (`[Hkv, len, dh]`), the row's own token among
    /// them (keys re-rotated to their cache index, StreamingLLM).
    Dense {
        k: &'a [f32],
        v: &'a [f32],
        len: usize,
    },
    /// `len` gathered rows per KV head (`[Hkv, cap, dh]`), then the row's own token
    /// (`own_k`, `own_v`: `[Hkv, dh]`) as key `len`.
    Tile {
        k: &'a [f32],
        v: &'a [f32],
        cap: usize,
        len: usize,
        own_k: &'a [f32],
        own_v: &'a [f32],
    },
}

/// Which half of a key set.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Half {
    K,
    V,
}

impl KeySet<'_> {
    /// Keys the row attends (per KV head).
    pub fn count(&self) -> usize {
        match *self {
            KeySet::Paged { len, .. } | KeySet::Dense { len, .. } => len,
            KeySet::Tile { len, .. } => len + 1,
        }
    }

    /// The runs of keys that are contiguous for one head, `(start, len)` in order: a
    /// paged set's blocks, a dense set whole, a tile and then its own token.
    fn runs(&self) -> Vec<(usize, usize)> {
        match *self {
            KeySet::Paged {
                len, block_size, ..
            } => (0..len)
                .step_by(block_size.max(1))
                .map(|s| (s, block_size.min(len - s)))
                .collect(),
            KeySet::Dense { len, .. } => vec![(0, len)],
            KeySet::Tile { len, .. } => vec![(0, len), (len, 1)],
        }
    }

    /// Head `g`'s keys or values `start..start + n` (one run) as f32 rows of `dh`: in
    /// place where they are f32, decoded into `scratch` otherwise.
    #[inline]
    fn rows<'s>(
        &'s self,
        half: Half,
        g: usize,
        (start, n): (usize, usize),
        (hkv, dh): (usize, usize),
        scratch: &'s mut Vec<f32>,
    ) -> &'s [f32] {
        let pick = |k: &'s [f32], v: &'s [f32]| if half == Half::K { k } else { v };
        match *self {
            KeySet::Paged {
                k,
                v,
                table,
                block_size: bs,
                ..
            } => {
                let view = if half == Half::K { k } else { v };
                let first = (table[start / bs] as usize * hkv + g) * bs + start % bs;
                view.rows(first, n, dh, scratch)
            }
            KeySet::Dense { k, v, len } => {
                let base = (g * len + start) * dh;
                &pick(k, v)[base..base + n * dh]
            }
            KeySet::Tile {
                k,
                v,
                cap,
                len,
                own_k,
                own_v,
            } => {
                if start == len {
                    &pick(own_k, own_v)[g * dh..(g + 1) * dh]
                } else {
                    let base = (g * cap + start) * dh;
                    &pick(k, v)[base..base + n * dh]
                }
            }
        }
    }
}

#[cfg(test)]
impl KeySet<'_> {
    /// Head `g`'s key and value `j` (tests).
    fn key(&self, g: usize, j: usize, hkv: usize, dh: usize) -> (Vec<f32>, Vec<f32>) {
        let mut s = Vec::new();
        let k = self.rows(Half::K, g, (j, 1), (hkv, dh), &mut s).to_vec();
        let v = self.rows(Half::V, g, (j, 1), (hkv, dh), &mut s).to_vec();
        (k, v)
    }
}

/// One decode row: its index in the packed query tensor and its keys.
#[derive(Clone, Copy)]
pub struct DecodeRow<'a> {
    pub row: usize,
    pub keys: KeySet<'a>,
}

#[derive(Debug, Clone, Copy)]
pub struct DecodeShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// Attention of each row's query heads over its key set. `q`: `[total_rows, H, dh]`;
/// writes the rows' outputs into `out` (`[total_rows, H, dh]`, other rows untouched).
/// With `probs`, returns per row `[Hkv × count]`: `Σ_{h∈g} p_h(j)` (f32).
pub fn decode_attention(
    q: &[f32],
    rows: &[DecodeRow<'_>],
    out: &mut [f32],
    s: DecodeShape,
    probs: bool,
) -> Vec<Vec<f32>> {
    let (h, hkv, dh) = (s.num_heads, s.num_kv_heads, s.head_dim);
    let g_size = h / hkv;
    let avx = has_avx2_fma();
    let scale = 1.0 / (dh as f32).sqrt();
    // One work item = one row's KV head: its G query heads share each run of keys,
    // read (and decoded, where stored otherwise) once per pass.
    let item = |(ri, g): (usize, usize)| -> (Vec<f32>, Vec<f32>) {
        let r = &rows[ri];
        let n = r.keys.count();
        let runs = r.keys.runs();
        let mut o = vec![0f32; g_size * dh];
        let mut sc = vec![0f32; g_size * n];
        let mut scratch = Vec::new();
        let qh = |j: usize| &q[(r.row * h + g * g_size + j) * dh..][..dh];
        for &run in &runs {
            let kb = r.keys.rows(Half::K, g, run, (hkv, dh), &mut scratch);
            for j in 0..g_size {
                let qj = qh(j);
                for (x, kt) in sc[j * n + run.0..][..run.1]
                    .iter_mut()
                    .zip(kb.chunks_exact(dh))
                {
                    *x = scale * dot_with(avx, qj, kt);
                }
            }
        }
        for j in 0..g_size {
            let p = &mut sc[j * n..(j + 1) * n];
            let m = p.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            p.iter_mut().for_each(|x| *x = exp(*x - m));
            let inv = 1.0 / p.iter().sum::<f32>();
            p.iter_mut().for_each(|x| *x *= inv);
        }
        for &run in &runs {
            let vb = r.keys.rows(Half::V, g, run, (hkv, dh), &mut scratch);
            for j in 0..g_size {
                let p = &sc[j * n + run.0..][..run.1];
                accumulate_with(avx, p, vb, &mut o[j * dh..(j + 1) * dh]);
            }
        }
        let col = if probs {
            let mut col = vec![0f32; n];
            for j in 0..g_size {
                col.iter_mut()
                    .zip(&sc[j * n..(j + 1) * n])
                    .for_each(|(c, p)| *c += p);
            }
            col
        } else {
            Vec::new()
        };
        (o, col)
    };
    let items: Vec<(usize, usize)> = (0..rows.len())
        .flat_map(|ri| (0..hkv).map(move |g| (ri, g)))
        .collect();
    let work: usize = rows.iter().map(|r| r.keys.count()).sum::<usize>() * h * dh;
    let results: Vec<(Vec<f32>, Vec<f32>)> = if rayon::current_num_threads() == 1 || work < 1 << 16
    {
        items.iter().copied().map(item).collect()
    } else {
        items.par_iter().copied().map(item).collect()
    };
    let mut all_probs: Vec<Vec<f32>> = rows
        .iter()
        .map(|r| {
            if probs {
                vec![0f32; hkv * r.keys.count()]
            } else {
                Vec::new()
            }
        })
        .collect();
    for (&(ri, g), (o, col)) in items.iter().zip(results) {
        let row = rows[ri].row;
        out[(row * h + g * g_size) * dh..][..g_size * dh].copy_from_slice(&o);
        if probs {
            let n = rows[ri].keys.count();
            all_probs[ri][g * n..(g + 1) * n].copy_from_slice(&col);
        }
    }
    all_probs
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// Plain softmax attention of one query head over explicit keys (f64).
    fn reference(q: &[f32], keys: &[&[f32]], vals: &[&[f32]]) -> (Vec<f64>, Vec<f64>) {
        let dh = q.len();
        let s: Vec<f64> = keys
            .iter()
            .map(|k| {
                q.iter()
                    .zip(*k)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
                    / (dh as f64).sqrt()
            })
            .collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let z: f64 = e.iter().sum();
        let p: Vec<f64> = e.iter().map(|x| x / z).collect();
        let mut o = vec![0f64; dh];
        for (pj, v) in p.iter().zip(vals) {
            for (oi, vi) in o.iter_mut().zip(*v) {
                *oi += pj * *vi as f64;
            }
        }
        (o, p)
    }

    #[test]
    fn paged_slots_and_tiles_match_plain_softmax_with_group_probabilities() {
        let mut rng = StdRng::seed_from_u64(7);
        let (h, hkv, dh, bs) = (6, 2, 16, 4);
        let g_size = h / hkv;
        let blocks = 8;
        let mut rnd =
            |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random::<f32>() * 2.0 - 1.0).collect() };
        let kp = rnd(blocks * hkv * bs * dh);
        let vp = rnd(blocks * hkv * bs * dh);
        let table: Vec<BlockId> = vec![5, 2, 7];
        let len = 11;
        let (cap, tlen) = (9, 6);
        let kt = rnd(hkv * cap * dh);
        let vt = rnd(hkv * cap * dh);
        let own_k = rnd(hkv * dh);
        let own_v = rnd(hkv * dh);
        let kd = rnd(hkv * 5 * dh);
        let vd = rnd(hkv * 5 * dh);
        let q = rnd(4 * h * dh);
        let rows = [
            DecodeRow {
                row: 0,
                keys: KeySet::Paged {
                    k: KvView::F32(&kp),
                    v: KvView::F32(&vp),
                    table: &table,
                    len,
                    block_size: bs,
                },
            },
            DecodeRow {
                row: 2,
                keys: KeySet::Tile {
                    k: &kt,
                    v: &vt,
                    cap,
                    len: tlen,
                    own_k: &own_k,
                    own_v: &own_v,
                },
            },
            DecodeRow {
                row: 3,
                keys: KeySet::Dense {
                    k: &kd,
                    v: &vd,
                    len: 5,
                },
            },
        ];
        let mut out = vec![7f32; 4 * h * dh];
        let shape = DecodeShape {
            num_heads: h,
            num_kv_heads: hkv,
            head_dim: dh,
        };
        let probs = decode_attention(&q, &rows, &mut out, shape, true);
        // Row 1 is not a decode row: untouched.
        assert!(out[h * dh..2 * h * dh].iter().all(|&x| x == 7.0));
        for (ri, r) in rows.iter().enumerate() {
            let n = r.keys.count();
            for g in 0..hkv {
                let kv: Vec<_> = (0..n).map(|j| r.keys.key(g, j, hkv, dh)).collect();
                let keys: Vec<&[f32]> = kv.iter().map(|x| x.0.as_slice()).collect();
                let vals: Vec<&[f32]> = kv.iter().map(|x| x.1.as_slice()).collect();
                let mut col = vec![0f64; n];
                for hq in g * g_size..(g + 1) * g_size {
                    let qh = &q[(r.row * h + hq) * dh..][..dh];
                    let (o, p) = reference(qh, &keys, &vals);
                    for (a, b) in out[(r.row * h + hq) * dh..][..dh].iter().zip(&o) {
                        assert!((*a as f64 - b).abs() < 1e-5, "{a} vs {b}");
                    }
                    col.iter_mut().zip(&p).for_each(|(c, x)| *c += x);
                }
                for (a, b) in probs[ri][g * n..(g + 1) * n].iter().zip(&col) {
                    assert!((*a as f64 - b).abs() < 1e-5);
                }
                let total: f32 = probs[ri][g * n..(g + 1) * n].iter().sum();
                assert!((total - g_size as f32).abs() < 1e-4, "{total}");
            }
        }
        // The paged row read the slots through the table: slot 5 is block 2's second row.
        let (k5, _) = rows[0].keys.key(1, 5, hkv, dh);
        let base = ((2 * hkv + 1) * bs + 1) * dh;
        assert_eq!(k5, &kp[base..base + dh]);
    }

    /// Slots stored as integer codes: attention equals plain softmax attention over
    /// the rows as stored and read back (the codec's round trip), with the group's
    /// probabilities; only the reading differs from f32 storage.
    #[test]
    fn coded_paged_slots_match_attention_over_the_decoded_rows() {
        use crate::kv::{KvCodec, PagedKv};
        let mut rng = StdRng::seed_from_u64(9);
        let (h, hkv, dh, bs) = (4, 2, 16, 4);
        let g_size = h / hkv;
        for codec in [
            KvCodec::Int { bits: 4, group: 8 },
            KvCodec::Int { bits: 2, group: 16 },
            KvCodec::Bf16,
        ] {
            let mut store = PagedKv::new(1, 6, bs, hkv, dh, codec);
            let table: Vec<BlockId> = vec![4, 1, 3];
            let len = 10;
            let mut rows = Vec::new();
            for j in 0..len {
                let k: Vec<f32> = (0..hkv * dh).map(|_| rng.random_range(-2.0..2.0)).collect();
                let v: Vec<f32> = (0..hkv * dh).map(|_| rng.random_range(-2.0..2.0)).collect();
                store.write(0, store.slot(&table, j), &k, &v);
                rows.push((k, v));
            }
            let q: Vec<f32> = (0..h * dh).map(|_| rng.random_range(-1.0..1.0)).collect();
            let (kv, vv) = store.views(0);
            let row = DecodeRow {
                row: 0,
                keys: KeySet::Paged {
                    k: kv,
                    v: vv,
                    table: &table,
                    len,
                    block_size: bs,
                },
            };
            let mut out = vec![0f32; h * dh];
            let shape = DecodeShape {
                num_heads: h,
                num_kv_heads: hkv,
                head_dim: dh,
            };
            let probs = decode_attention(&q, &[row], &mut out, shape, true);
            for g in 0..hkv {
                let dec = |x: &[f32]| codec.round_trip(&x[g * dh..(g + 1) * dh]);
                let keys: Vec<Vec<f32>> = rows.iter().map(|(k, _)| dec(k)).collect();
                let vals: Vec<Vec<f32>> = rows.iter().map(|(_, v)| dec(v)).collect();
                let kr: Vec<&[f32]> = keys.iter().map(|x| x.as_slice()).collect();
                let vr: Vec<&[f32]> = vals.iter().map(|x| x.as_slice()).collect();
                let mut col = vec![0f64; len];
                for hq in g * g_size..(g + 1) * g_size {
                    let (o, p) = reference(&q[hq * dh..(hq + 1) * dh], &kr, &vr);
                    for (a, b) in out[hq * dh..(hq + 1) * dh].iter().zip(&o) {
                        assert!((*a as f64 - b).abs() < 1e-5, "{codec}: {a} vs {b}");
                    }
                    col.iter_mut().zip(&p).for_each(|(c, x)| *c += x);
                }
                for (a, b) in probs[0][g * len..(g + 1) * len].iter().zip(&col) {
                    assert!((*a as f64 - b).abs() < 1e-5);
                }
            }
        }
    }
}
