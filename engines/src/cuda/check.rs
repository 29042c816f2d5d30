//! Every CUDA kernel against a plain f64 reference on the host, with fresh random
//! inputs (bf16-rounded, so both sides see the same numbers): `kvbench verify
//! --device cuda` runs these before the model checks.

use super::{
    device_of, flash_prefill, kv_gather, kv_write, paged_decode, prefill_attention, synchronize,
    DecodeShape, DecodeTables, LayerCache,
};
use crate::error::Result;
use candle_core::{DType, Device, Tensor};
use half::bf16;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::Serialize;

/// One kernel check: ‖out − ref‖ / ‖ref‖ against its tolerance.
#[derive(Debug, Clone, Serialize)]
pub struct KernelCheck {
    pub kernel: &'static str,
    pub case: String,
    pub rel_err: f64,
    pub tolerance: f64,
    pub pass: bool,
}

/// bf16 output against an f64 reference: bf16 rounding of the result is ≈ 4e-3 relative.
const BF16_TOL: f64 = 1e-2;

fn rand_bf16(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| bf16::from_f32(rng.random_range(-1.0f32..1.0) * scale).to_f32())
        .collect()
}

fn upload(v: &[f32], shape: &[usize], dev: &Device) -> Result<Tensor> {
    Ok(Tensor::from_slice(v, shape, dev)?.to_dtype(DType::BF16)?)
}

fn download(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

fn rel_err(out: &[f32], reference: &[f64]) -> f64 {
    if out.len() != reference.len() {
        return f64::INFINITY;
    }
    let (mut num, mut den) = (0f64, 0f64);
    for (&o, &r) in out.iter().zip(reference) {
        if !o.is_finite() {
            return f64::INFINITY;
        }
        num += (o as f64 - r).powi(2);
        den += r * r;
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

/// Causal attention of one query row over `n` keys (`k`/`v` as `[n, KVH, D]`), f64.
fn reference_row(q: &[f32], k: &[f32], v: &[f32], n: usize, kvh: usize, d: usize) -> Vec<f64> {
    let h = q.len() / d;
    let g = h / kvh;
    let mut out = vec![0f64; h * d];
    for head in 0..h {
        let kh = head / g;
        let qh = &q[head * d..(head + 1) * d];
        let scores: Vec<f64> = (0..n)
            .map(|j| {
                let kr = &k[(j * kvh + kh) * d..(j * kvh + kh + 1) * d];
                qh.iter()
                    .zip(kr)
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum::<f64>()
                    / (d as f64).sqrt()
            })
            .collect();
        let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
        let l: f64 = w.iter().sum();
        for (j, wj) in w.iter().enumerate() {
            let vr = &v[(j * kvh + kh) * d..(j * kvh + kh + 1) * d];
            for (o, &x) in out[head * d..(head + 1) * d].iter_mut().zip(vr) {
                *o += wj / l * x as f64;
            }
        }
    }
    out
}

/// Run every kernel check on `dev` (a CUDA device) with inputs drawn from `seed`.
pub fn run(dev: &Device, seed: u64) -> Result<Vec<KernelCheck>> {
    let cuda = device_of(dev)?;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::new();
    // (H, KVH, D, block size, decode partition): SmolLM2-135M, Llama-3.1-8B, MHA.
    for &(h, kvh, d, bs, part) in &[
        (9usize, 3usize, 64usize, 16usize, 512usize),
        (32, 8, 128, 16, 512),
        (4, 4, 128, 16, 64),
    ] {
        let row = kvh * d;
        // Sequences with lengths at and around block and partition boundaries.
        let lens = [1usize, bs, bs + 1, part, part + 1, 3 * part + 7, 2500];
        let total_blocks: usize = lens.iter().map(|l| l.div_ceil(bs)).sum::<usize>() + 5;
        let mut free: Vec<i32> = (0..total_blocks as i32).collect();
        free.shuffle(&mut rng);
        let mut tables = Vec::new();
        for &l in &lens {
            let nb = l.div_ceil(bs);
            tables.push(free.split_off(free.len() - nb));
        }
        let mut cache = LayerCache::new(&cuda, total_blocks * bs, row)?;
        // Poison the pool so a read of an unwritten slot shows.
        let poison = upload(
            &vec![f32::NAN; total_blocks * bs * row],
            &[total_blocks * bs, kvh, d],
            dev,
        )?;
        kv_write(
            &mut cache,
            &poison,
            &poison,
            &(0..(total_blocks * bs) as i32).collect::<Vec<_>>(),
        )?;
        let mut keys = Vec::new();
        for (si, &l) in lens.iter().enumerate() {
            let k = rand_bf16(&mut rng, l * row, 1.0);
            let v = rand_bf16(&mut rng, l * row, 1.0);
            let slots: Vec<i32> = (0..l)
                .map(|p| tables[si][p / bs] * bs as i32 + (p % bs) as i32)
                .collect();
            kv_write(
                &mut cache,
                &upload(&k, &[l, kvh, d], dev)?,
                &upload(&v, &[l, kvh, d], dev)?,
                &slots,
            )?;
            keys.push((k, v));
        }
        // Gather: exact round trip of every sequence.
        let mut worst = 0f64;
        for (si, &l) in lens.iter().enumerate() {
            let (kg, vg) = kv_gather(&cuda, &cache, &tables[si], l, bs, kvh, d)?;
            let (kg, vg) = (download(&kg)?, download(&vg)?);
            let exact = kg == keys[si].0 && vg == keys[si].1;
            worst = worst.max(if exact { 0.0 } else { 1.0 });
        }
        out.push(KernelCheck {
            kernel: "kv_write+kv_gather",
            case: format!("KVH={kvh} D={d} block={bs}, {} sequences", lens.len()),
            rel_err: worst,
            tolerance: 0.0,
            pass: worst == 0.0,
        });

        // Decode: one query row per sequence at its last position.
        let q = rand_bf16(&mut rng, lens.len() * h * d, 2.0);
        let got = paged_decode(
            &cache,
            &upload(&q, &[lens.len(), h, d], dev)?,
            &DecodeTables::new(&cuda, &tables, &lens)?,
            DecodeShape {
                num_heads: h,
                num_kv_heads: kvh,
                head_dim: d,
                block_size: bs,
                part_size: part,
            },
        )?;
        synchronize(&cuda)?;
        let got = download(&got)?;
        let mut reference = Vec::new();
        for (si, &l) in lens.iter().enumerate() {
            let (k, v) = &keys[si];
            reference.extend(reference_row(
                &q[si * h * d..(si + 1) * h * d],
                k,
                v,
                l,
                kvh,
                d,
            ));
        }
        let e = rel_err(&got, &reference);
        out.push(KernelCheck {
            kernel: "paged_decode",
            case: format!("H={h} KVH={kvh} D={d} block={bs} partition={part}, contexts {lens:?}"),
            rel_err: e,
            tolerance: BF16_TOL,
            pass: e <= BF16_TOL,
        });

        // Flash prefill through the block tables: a whole prompt (sequence 4) and the
        // last 200 rows of sequence 6 after its cached prefix.
        for (si, t) in [(4usize, lens[4]), (6, 200.min(lens[6]))] {
            let l = lens[si];
            let before = l - t;
            let (k, v) = &keys[si];
            let qp = rand_bf16(&mut rng, t * h * d, 2.0);
            let mut reference = Vec::new();
            for i in 0..t {
                let row = &qp[i * h * d..(i + 1) * h * d];
                reference.extend(reference_row(row, k, v, before + i + 1, kvh, d));
            }
            let o = flash_prefill(
                &cache,
                &upload(&qp, &[t, h, d], dev)?,
                &tables[si],
                before,
                kvh,
                bs,
            )?;
            let e = rel_err(&download(&o)?, &reference);
            out.push(KernelCheck {
                kernel: "flash_prefill",
                case: format!("H={h} KVH={kvh} D={d}, {t} rows after {before}"),
                rel_err: e,
                tolerance: BF16_TOL,
                pass: e <= BF16_TOL,
            });
        }

        // Prefill: the last sequence's final rows after a cached prefix, in one chunk
        // and in small chunks.
        let l = *lens.last().expect("lengths");
        let (k, v) = &keys[lens.len() - 1];
        let t = 200.min(l);
        let before = l - t;
        let qp = rand_bf16(&mut rng, t * h * d, 2.0);
        let mut reference = Vec::new();
        for i in 0..t {
            reference.extend(reference_row(
                &qp[i * h * d..(i + 1) * h * d],
                k,
                v,
                before + i + 1,
                kvh,
                d,
            ));
        }
        for chunk in [t, 37] {
            let (o, _) = prefill_attention(
                &upload(&qp, &[t, h, d], dev)?,
                &upload(k, &[l, kvh, d], dev)?,
                &upload(v, &[l, kvh, d], dev)?,
                before,
                chunk,
                None,
            )?;
            let e = rel_err(&download(&o)?, &reference);
            out.push(KernelCheck {
                kernel: "prefill_attention",
                case: format!("H={h} KVH={kvh} D={d}, {t} rows after {before}, chunk {chunk}"),
                rel_err: e,
                tolerance: BF16_TOL,
                pass: e <= BF16_TOL,
            });
        }
    }
    Ok(out)
}
