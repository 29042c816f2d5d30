//! Every CUDA kernel against a plain f64 reference on the host, with fresh random
//! inputs (bf16-rounded, so both sides see the same numbers): `kvbench verify
//! --device cuda` runs these before the model checks.

use super::{
    device_of, flash_prefill_with, kv_gather, kv_write, paged_decode, paged_decode_impl,
    partition_size, prefill_attention, synchronize, DecodeKernel, DecodePin, DecodeReduce,
    DecodeShape, DecodeTables, FlashKernel, LayerCache,
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

/// Block tables of sequences holding `tokens[i]` tokens each, drawn from `blocks`
/// shuffled blocks (so rows read scattered blocks, as a long-running pool's do).
fn random_tables(rng: &mut StdRng, tokens: &[usize], blocks: usize, bs: usize) -> Vec<Vec<i32>> {
    let mut free: Vec<i32> = (0..blocks as i32).collect();
    free.shuffle(rng);
    tokens
        .iter()
        .map(|l| free.split_off(free.len() - l.div_ceil(bs)))
        .collect()
}

/// Pool slots of positions `0..n` of the sequence with block `table`.
fn slots_of(table: &[i32], n: usize, bs: usize) -> Vec<i32> {
    (0..n)
        .map(|p| table[p / bs] * bs as i32 + (p % bs) as i32)
        .collect()
}

/// Random bf16 K and V rows (`[slots, KVH, D]`) written to `slots` of `cache`, returned.
fn write_random(
    rng: &mut StdRng,
    dev: &Device,
    cache: &mut LayerCache,
    slots: &[i32],
    kvh: usize,
    d: usize,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let n = slots.len();
    let k = rand_bf16(rng, n * kvh * d, 1.0);
    let v = rand_bf16(rng, n * kvh * d, 1.0);
    kv_write(
        cache,
        &upload(&k, &[n, kvh, d], dev)?,
        &upload(&v, &[n, kvh, d], dev)?,
        slots,
    )?;
    Ok((k, v))
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
    let p = reference_probs(q, k, n, kvh, d);
    let mut out = vec![0f64; h * d];
    for head in 0..h {
        let kh = head / g;
        for j in 0..n {
            let vr = &v[(j * kvh + kh) * d..(j * kvh + kh + 1) * d];
            for (o, &x) in out[head * d..(head + 1) * d].iter_mut().zip(vr) {
                *o += p[head * n + j] * x as f64;
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
    // (H, KVH, D, block size, decode partition, decode only): SmolLM2-135M,
    // Llama-3.1-8B, MHA, and Llama-3.1-70B's groups of 8 (the decode kernels' other
    // build, and the pipelined kernel's largest tiles, past the 48 KB a block has
    // without opting in), for the cache and decode checks alone.
    for &(h, kvh, d, bs, part, decode_only) in &[
        (9usize, 3usize, 64usize, 16usize, 512usize, false),
        (32, 8, 128, 16, 512, false),
        (4, 4, 128, 16, 64, false),
        (64, 8, 128, 16, 512, true),
    ] {
        let row = kvh * d;
        // Sequences with lengths at and around block and partition boundaries.
        let lens = [1usize, bs, bs + 1, part, part + 1, 3 * part + 7, 2500];
        let total_blocks: usize = lens.iter().map(|l| l.div_ceil(bs)).sum::<usize>() + 5;
        let tables = random_tables(&mut rng, &lens, total_blocks, bs);
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
            let slots = slots_of(&tables[si], l, bs);
            keys.push(write_random(&mut rng, dev, &mut cache, &slots, kvh, d)?);
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

        // Decode: one query row per sequence at its last position, with each partition
        // kernel that takes the shape; then the longest sequence alone (one row: the
        // partitions shrink to fill the card).
        let q = rand_bf16(&mut rng, lens.len() * h * d, 2.0);
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
        let shape = DecodeShape {
            num_heads: h,
            num_kv_heads: kvh,
            head_dim: d,
            block_size: bs,
            part_size: part,
        };
        let last = lens.len() - 1;
        // The kernel the runs use for keys at their own positions (tensor-core products
        // by default, the vector kernel with four rows in flight per lane under
        // KVBENCH_PAGED_DECODE=vec, one under `vec1`, tiles staged in shared memory under
        // `pipe`), each with its reduction folded into it and
        // launched after it: both against the reference, and against each other to the
        // bit (the same device function reduces in both, so any difference is a
        // partition read before its block wrote it).
        let vector = DecodeKernel::vector_form(super::decode_choice()?);
        for kernel in [vector, DecodeKernel::Scalar] {
            let name = kernel.label();
            if !kernel.applies(d, h / kvh) {
                continue;
            }
            for (rows, sub) in [
                (0..lens.len(), "every sequence"),
                (last..lens.len(), "the longest alone"),
            ] {
                let n = rows.len();
                let qr = upload(&q[rows.start * h * d..rows.end * h * d], &[n, h, d], dev)?;
                let t = DecodeTables::new(&cuda, &tables[rows.clone()], &lens[rows.clone()])?;
                let p = partition_size(
                    part,
                    n * kvh,
                    lens[rows.clone()].iter().copied().max().unwrap_or(0),
                );
                let case = format!(
                    "H={h} KVH={kvh} D={d} block={bs} partition {p} (at most {part}), {sub}: contexts {:?}",
                    &lens[rows.clone()]
                );
                let mut outs = Vec::new();
                for reduce in [DecodeReduce::Folded, DecodeReduce::Launched] {
                    let got = paged_decode_impl(
                        &cache,
                        &qr,
                        &t,
                        shape,
                        None,
                        None,
                        DecodePin {
                            kernel: Some(kernel),
                            reduce: Some(reduce),
                            part: None,
                        },
                    )?;
                    synchronize(&cuda)?;
                    let got = download(&got)?;
                    let e = rel_err(&got, &reference[rows.start * h * d..rows.end * h * d]);
                    out.push(bf16_check(
                        name,
                        format!("{case}, reduction {}", reduce.label()),
                        e,
                    ));
                    outs.push(got);
                }
                let same = outs[0].len() == outs[1].len()
                    && outs[0]
                        .iter()
                        .zip(&outs[1])
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                let settled = t.counters_settled(&cuda)?;
                out.push(exact_check(
                    "paged_decode reduction (folded = launched)",
                    format!("{name}, {case}, counters back at zero ({settled})"),
                    same && settled,
                ));
            }
        }
        if decode_only {
            continue;
        }

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
            for (kernel, name) in flash_kernels(d, false)? {
                let o = flash_prefill_with(
                    &cache,
                    &upload(&qp, &[t, h, d], dev)?,
                    &tables[si],
                    before,
                    kvh,
                    bs,
                    None,
                    kernel,
                )?;
                let e = rel_err(&download(&o)?, &reference);
                out.push(bf16_check(
                    name,
                    format!("H={h} KVH={kvh} D={d}, {t} rows after {before}"),
                    e,
                ));
            }
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
            out.push(bf16_check(
                "prefill_attention",
                format!("H={h} KVH={kvh} D={d}, {t} rows after {before}, chunk {chunk}"),
                e,
            ));
        }
        out.extend(evicting_checks(dev, &mut rng, h, kvh, d, bs)?);
        out.extend(infinigen_checks(dev, &mut rng, h, kvh, d, bs)?);
        out.extend(rolling_check(dev, &mut rng, h, kvh, d, bs)?);
    }
    out.extend(fused_elementwise_checks(dev, &mut rng)?);
    out.extend(argmax_checks(dev, &mut rng)?);
    out.extend(fingerprint_checks(dev, &mut rng)?);
    // The few-row products' kernel is opt-in and has not run on a GPU: checked when
    // chosen (`KVBENCH_GEMV=kvbench`, the campaign's verify-gemv), so that it cannot
    // fail the default's checks.
    if crate::model::gemv_chosen()? {
        out.extend(gemv_checks(dev, &mut rng)?);
    }
    Ok(out)
}

/// kvbench's few-row products (`gemv`) against an f64 reference and against cuBLAS's
/// (candle's product, the same call the model makes without it) on random bf16 inputs:
/// SmolLM2's and Llama-3.1-8B's matrices, single and stacked in pairs (whose output
/// interleaves the inputs' rows per matrix: a row written to the wrong place fails), a
/// tall one whose warps take several rows in turn, widths with and without a partial
/// last round of loads, 1 to 4 rows; and the shapes it must refuse.
fn gemv_checks(dev: &Device, rng: &mut StdRng) -> Result<Vec<KernelCheck>> {
    use super::{gemv, GEMV_MAX_ROWS};
    let mut out = Vec::new();
    // (matrices, rows each, width).
    for &(g, nb, k) in &[
        (1usize, 960usize, 576usize),
        (2, 1536, 576),
        (1, 576, 1536),
        (1, 16384, 576),
        (1, 6144, 4096),
        (2, 1024, 4096),
        (1, 4096, 14336),
    ] {
        let w = rand_bf16(rng, g * nb * k, 0.05);
        let x = rand_bf16(rng, GEMV_MAX_ROWS * k, 1.0);
        // reference[(m * rows + r) * nb + j]: input row r with row j of matrix m.
        let dot = |r: usize, i: usize| -> f64 {
            x[r * k..(r + 1) * k]
                .iter()
                .zip(&w[i * k..(i + 1) * k])
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum()
        };
        let all: Vec<Vec<f64>> = (0..GEMV_MAX_ROWS)
            .map(|r| (0..g * nb).map(|i| dot(r, i)).collect())
            .collect();
        let wt = if g == 1 {
            upload(&w, &[nb, k], dev)?
        } else {
            upload(&w, &[g, nb, k], dev)?
        };
        for t in 1..=GEMV_MAX_ROWS {
            let xt = upload(&x[..t * k], &[t, k], dev)?;
            let y = gemv(&xt, &wt)?.ok_or_else(|| {
                crate::error::Error::Config(format!(
                    "gemv refused {t} rows of width {k} with [{g}, {nb}, {k}]"
                ))
            })?;
            let mut reference = Vec::with_capacity(g * t * nb);
            for m in 0..g {
                for row in all.iter().take(t) {
                    reference.extend_from_slice(&row[m * nb..(m + 1) * nb]);
                }
            }
            let cublas = crate::model::candle_product(&xt, &wt)?;
            let want_dims: Vec<usize> = if g == 1 { vec![t, nb] } else { vec![g, t, nb] };
            let case = format!("{t} rows x [{g}, {nb}, {k}]");
            let (ours, theirs) = (download(&y)?, download(&cublas)?);
            let e = if y.dims() == want_dims.as_slice() {
                rel_err(&ours, &reference)
            } else {
                f64::INFINITY
            };
            out.push(bf16_check("gemv", case.clone(), e));
            let theirs64: Vec<f64> = theirs.iter().map(|&v| v as f64).collect();
            out.push(bf16_check(
                "gemv (= cuBLAS)",
                case,
                rel_err(&ours, &theirs64),
            ));
        }
    }
    // Shapes the kernel must leave to cuBLAS: too many rows, a width not a multiple of
    // 8, a start off 16 bytes, f32.
    let w = upload(&rand_bf16(rng, 64 * 72, 0.05), &[64, 72], dev)?;
    let x = upload(&rand_bf16(rng, 8 * 72, 1.0), &[8, 72], dev)?;
    let odd = upload(&rand_bf16(rng, 64 * 68, 0.05), &[64, 68], dev)?;
    let refused = gemv(&x.narrow(0, 0, GEMV_MAX_ROWS + 1)?, &w)?.is_none()
        && gemv(&x.narrow(0, 0, 1)?.narrow(1, 0, 68)?.contiguous()?, &odd)?.is_none()
        && gemv(&x.flatten_all()?.narrow(0, 1, 72)?.reshape((1, 72))?, &w)?.is_none()
        && gemv(&x.narrow(0, 0, 1)?.to_dtype(DType::F32)?, &w)?.is_none();
    out.push(exact_check(
        "gemv (refuses what it does not take)",
        format!(
            "{} rows, width 68, an unaligned row, f32",
            GEMV_MAX_ROWS + 1
        ),
        refused,
    ));
    Ok(out)
}

/// The weights' fingerprint read through a pinned buffer (`skew::hash_staged`, what
/// InfiniGen's skewing cache is keyed by on a GPU) against the same tensors copied to
/// the host (`skew::hash_tensor`), exactly: bf16 and f32, a view at an offset of a
/// larger storage, and a tensor over two buffers' worth.
fn fingerprint_checks(dev: &Device, rng: &mut StdRng) -> Result<Vec<KernelCheck>> {
    use crate::policy::infinigen::skew::{hash_staged, hash_tensor, Stage};
    let cuda = device_of(dev)?;
    let mut stage = Stage::new(&cuda)?;
    let big = 33 << 20; // bf16 elements: 66 MiB, past one 64 MiB buffer
    let stacked = upload(&rand_bf16(rng, 2 * 1000 * 77, 1.0), &[2, 1000, 77], dev)?;
    let cases: Vec<(String, Tensor)> = vec![
        (
            "bf16 [3, 1000, 77]".into(),
            upload(&rand_bf16(rng, 3 * 1000 * 77, 1.0), &[3, 1000, 77], dev)?,
        ),
        (
            "f32 [513, 7]".into(),
            upload(&rand_bf16(rng, 513 * 7, 1.0), &[513, 7], dev)?.to_dtype(DType::F32)?,
        ),
        (
            "bf16 view [1000, 77] at offset 77000".into(),
            stacked.get(1)?,
        ),
        (
            format!("bf16 [{big}]"),
            upload(&rand_bf16(rng, big, 1.0), &[big], dev)?,
        ),
    ];
    let mut out = Vec::new();
    for (case, t) in cases {
        let host = hash_tensor("dense", &t)?;
        let staged = hash_staged("dense", &t, &mut stage)?;
        out.push(exact_check(
            "weights fingerprint (staged)",
            case,
            host == staged,
        ));
    }
    Ok(out)
}

/// The greedy choice on the device (`argmax_rows`) against the host's rule, exactly:
/// rows with their largest value planted twice (ties to the smaller index), NaN (also
/// first in a row), a row of NaN only and a row of -inf only, over vocabularies of
/// SmolLM2 and Llama-3.1-8B, an odd one and one shorter than a block's chunk.
fn argmax_checks(dev: &Device, rng: &mut StdRng) -> Result<Vec<KernelCheck>> {
    let mut out = Vec::new();
    for &vocab in &[49_152usize, 128_256, 1_003, 5] {
        for rows in [1usize, 3, 16] {
            let mut logits: Vec<Vec<f32>> = (0..rows)
                .map(|_| (0..vocab).map(|_| rng.random_range(-8.0f32..8.0)).collect())
                .collect();
            for (r, row) in logits.iter_mut().enumerate() {
                let top = rng.random_range(0..vocab);
                row[top] = 100.0;
                // The same value again, before or after it: the smaller index wins.
                row[rng.random_range(0..vocab)] = 100.0;
                row[rng.random_range(0..vocab)] = f32::NAN;
                match r % 4 {
                    1 => row[0] = f32::NAN,
                    2 if r + 1 == rows => row.fill(f32::NAN),
                    3 => row.fill(f32::NEG_INFINITY),
                    _ => {}
                }
            }
            let want = crate::engine::argmax(&logits);
            let flat: Vec<f32> = logits.concat();
            let t = Tensor::from_slice(&flat, (rows, vocab), dev)?;
            let got = super::argmax_rows(&t)?;
            out.push(exact_check(
                "argmax",
                format!("{rows} rows x vocab {vocab}"),
                got == want,
            ));
        }
    }
    Ok(out)
}

/// The fused elementwise kernels of a layer (`silu_mul`, `add_rms_norm`, `rope_pair`)
/// against f64, at SmolLM2's and Llama-3.1-8B's widths, one row and several.
fn fused_elementwise_checks(dev: &Device, rng: &mut StdRng) -> Result<Vec<KernelCheck>> {
    let mut out = Vec::new();
    let cuda = device_of(dev)?;
    let stream = cuda.cuda_stream();
    // RoPE of queries and keys together: (H, KVH, D) of SmolLM2 and Llama-3.1-8B, rows
    // at positions spread over a long context, cos/sin as the model rounds them (bf16).
    for &(h, kvh, d) in &[(9usize, 3usize, 64usize), (32, 8, 128)] {
        for rows in [1usize, 3, 17] {
            let half = d / 2;
            let (q, k) = (
                rand_bf16(rng, rows * h * d, 2.0),
                rand_bf16(rng, rows * kvh * d, 2.0),
            );
            let (mut cos, mut sin) = (Vec::new(), Vec::new());
            for _ in 0..rows {
                let pos = rng.random_range(0..131_072u32) as f32;
                for i in 0..half {
                    let a = pos * 500_000f32.powf(-((2 * i) as f32) / d as f32);
                    cos.push(bf16::from_f32(a.cos()).to_f32());
                    sin.push(bf16::from_f32(a.sin()).to_f32());
                }
            }
            let rotate = |x: &[f32], heads: usize| -> Vec<f64> {
                let mut o = vec![0f64; x.len()];
                for r in 0..rows {
                    for hh in 0..heads {
                        let at = (r * heads + hh) * d;
                        for i in 0..half {
                            let (c, s_) = (cos[r * half + i] as f64, sin[r * half + i] as f64);
                            let (x0, x1) = (x[at + i] as f64, x[at + i + half] as f64);
                            o[at + i] = x0 * c - x1 * s_;
                            o[at + i + half] = x0 * s_ + x1 * c;
                        }
                    }
                }
                o
            };
            let (qo, ko) = super::rope_pair(
                &upload(&q, &[rows, h, d], dev)?,
                &upload(&k, &[rows, kvh, d], dev)?,
                &upload(&cos, &[rows, half], dev)?,
                &upload(&sin, &[rows, half], dev)?,
            )?
            .ok_or_else(|| {
                crate::error::Error::Config("rope_pair refused [t, H, D] bf16 rows".into())
            })?;
            let case = format!("{rows} rows x H={h} KVH={kvh} D={d}");
            out.push(bf16_check(
                "rope_pair (q)",
                case.clone(),
                rel_err(&download(&qo)?, &rotate(&q, h)),
            ));
            out.push(bf16_check(
                "rope_pair (k)",
                case.clone(),
                rel_err(&download(&ko)?, &rotate(&k, kvh)),
            ));
            // RoPE and the cache write in one kernel against rope_pair + kv_write on
            // the same inputs: the same rotated queries and the same cache, to the bit.
            let v = rand_bf16(rng, rows * kvh * d, 2.0);
            let pool = 4 * rows + 3;
            let mut slots: Vec<i32> = (0..pool as i32).collect();
            slots.shuffle(rng);
            let slots_d = super::upload_i32(&cuda, &slots[..rows])?;
            let (kt, vt) = (
                upload(&k, &[rows, kvh, d], dev)?,
                upload(&v, &[rows, kvh, d], dev)?,
            );
            let (ct, st) = (
                upload(&cos, &[rows, half], dev)?,
                upload(&sin, &[rows, half], dev)?,
            );
            let mut two = LayerCache::new(&cuda, pool, kvh * d)?;
            super::kv_write_at(&mut two, &ko, &vt, &slots_d)?;
            let mut one = LayerCache::new(&cuda, pool, kvh * d)?;
            let qw = super::rope_write(
                &mut one,
                (&upload(&q, &[rows, h, d], dev)?, &kt, &vt),
                (&ct, &st),
                &slots_d,
            )?;
            let host = |c: &candle_core::cuda_backend::cudarc::driver::CudaSlice<bf16>| {
                stream.clone_dtoh(c).map_err(candle_core::Error::wrap)
            };
            let same = download(&qw)?
                .iter()
                .zip(download(&qo)?.iter())
                .all(|(a, b)| a.to_bits() == b.to_bits())
                && host(&one.k)? == host(&two.k)?
                && host(&one.v)? == host(&two.v)?;
            out.push(exact_check(
                "rope_write (= rope_pair + kv_write)",
                format!("{case}, slots of a pool of {pool}"),
                same,
            ));
        }
    }
    // Rolling positions: queries rotated to each row's last cache index, read from the
    // step's parameters on the device, by f32 rotation rows; an index past the rows
    // must give NaN (never another index's rotation).
    for &(h, d) in &[(9usize, 64usize), (32, 128)] {
        let (half, indices) = (d / 2, 300usize);
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for p in 0..indices {
            for i in 0..half {
                let a = p as f32 * 500_000f32.powf(-((2 * i) as f32) / d as f32);
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        let cos_d = stream.clone_htod(&cos).map_err(candle_core::Error::wrap)?;
        let sin_d = stream.clone_htod(&sin).map_err(candle_core::Error::wrap)?;
        for rows in [1usize, 3, 17] {
            let x = rand_bf16(rng, rows * h * d, 2.0);
            let m: Vec<usize> = (0..rows).map(|_| rng.random_range(1..=indices)).collect();
            let params: Vec<i32> = m.iter().flat_map(|&m| [m as i32, 0, 0, 0]).collect();
            let mut want = vec![0f64; x.len()];
            for (r, &mr) in m.iter().enumerate() {
                let at = (mr - 1) * half;
                for hh in 0..h {
                    let o = (r * h + hh) * d;
                    for i in 0..half {
                        let (c, s_) = (cos[at + i] as f64, sin[at + i] as f64);
                        let (x0, x1) = (x[o + i] as f64, x[o + i + half] as f64);
                        want[o + i] = x0 * c - x1 * s_;
                        want[o + i + half] = x0 * s_ + x1 * c;
                    }
                }
            }
            let got = super::rope_last_index(
                &upload(&x, &[rows, h, d], dev)?,
                &super::upload_i32(&cuda, &params)?,
                &cos_d,
                &sin_d,
            )?;
            out.push(bf16_check(
                "rope_last_index",
                format!("{rows} rows x H={h} D={d}, indices up to {indices}"),
                rel_err(&download(&got)?, &want),
            ));
        }
        let past = super::rope_last_index(
            &upload(&rand_bf16(rng, h * d, 2.0), &[1, h, d], dev)?,
            &super::upload_i32(&cuda, &[indices as i32 + 1, 0, 0, 0])?,
            &cos_d,
            &sin_d,
        )?;
        out.push(exact_check(
            "rope_last_index (past the rows)",
            format!("H={h} D={d}: index {indices} of {indices} rows gives NaN"),
            download(&past)?.iter().all(|v| v.is_nan()),
        ));
    }
    for &(hidden, ff) in &[(576usize, 1536usize), (4096, 14336)] {
        for rows in [1usize, 3, 17] {
            let gu = rand_bf16(rng, 2 * rows * ff, 4.0);
            let reference: Vec<f64> = (0..rows * ff)
                .map(|i| {
                    let (g, u) = (gu[i] as f64, gu[rows * ff + i] as f64);
                    g / (1.0 + (-g).exp()) * u
                })
                .collect();
            let got = super::silu_mul(&upload(&gu, &[2, rows, ff], dev)?)?.ok_or_else(|| {
                crate::error::Error::Config("silu_mul refused a [2, t, ff] bf16 tensor".into())
            })?;
            out.push(bf16_check(
                "silu_mul",
                format!("{rows} rows x ff {ff}"),
                rel_err(&download(&got)?, &reference),
            ));

            let eps = 1e-5f32;
            let (x, a) = (
                rand_bf16(rng, rows * hidden, 2.0),
                rand_bf16(rng, rows * hidden, 2.0),
            );
            let w = rand_bf16(rng, hidden, 1.0);
            // The sum as the kernel stores it (bf16), then the norm over that, in f64.
            let sum: Vec<f64> = x
                .iter()
                .zip(&a)
                .map(|(&p, &q)| bf16::from_f32(p + q).to_f64())
                .collect();
            let mut normed = Vec::with_capacity(rows * hidden);
            for r in sum.chunks(hidden) {
                let ms = r.iter().map(|v| v * v).sum::<f64>() / hidden as f64;
                let inv = 1.0 / (ms + eps as f64).sqrt();
                normed.extend(r.iter().zip(&w).map(|(v, &g)| v * inv * g as f64));
            }
            let (xo, h) = super::add_rms_norm(
                &upload(&x, &[rows, hidden], dev)?,
                &upload(&a, &[rows, hidden], dev)?,
                &upload(&w, &[hidden], dev)?,
                eps,
            )?
            .ok_or_else(|| {
                crate::error::Error::Config("add_rms_norm refused [t, hidden] bf16 rows".into())
            })?;
            let case = format!("{rows} rows x hidden {hidden}");
            out.push(bf16_check(
                "add_rms_norm (sum)",
                case.clone(),
                rel_err(&download(&xo)?, &sum),
            ));
            out.push(bf16_check(
                "add_rms_norm (norm)",
                case,
                rel_err(&download(&h)?, &normed),
            ));
        }
    }
    synchronize(&device_of(dev)?)?;
    Ok(out)
}

/// Softmax probabilities `[H, n]` of one query row over `n` keys (`[_, KVH, D]`), f64.
fn reference_probs(q: &[f32], k: &[f32], n: usize, kvh: usize, d: usize) -> Vec<f64> {
    let h = q.len() / d;
    let g = h / kvh;
    let mut out = vec![0f64; h * n];
    for head in 0..h {
        let kh = head / g;
        let qh = &q[head * d..(head + 1) * d];
        let s: Vec<f64> = (0..n)
            .map(|j| {
                let kr = &k[(j * kvh + kh) * d..(j * kvh + kh + 1) * d];
                qh.iter()
                    .zip(kr)
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum::<f64>()
                    / (d as f64).sqrt()
            })
            .collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let l: f64 = s.iter().map(|x| (x - m).exp()).sum();
        for j in 0..n {
            out[head * n + j] = (s[j] - m).exp() / l;
        }
    }
    out
}

/// Column sums `[KVH, n]` of rows `q` (`[T, H, D]` at positions `first..first+T`) whose
/// row `i` attends keys `key0..=first+i` of `k`, f64.
#[allow(clippy::too_many_arguments)]
fn reference_columns(
    q: &[f32],
    k: &[f32],
    first: usize,
    key0: usize,
    n: usize,
    h: usize,
    kvh: usize,
    d: usize,
) -> Vec<f64> {
    let t = q.len() / (h * d);
    let g = h / kvh;
    let mut col = vec![0f64; kvh * n];
    for i in 0..t {
        let seen = first + i + 1 - key0;
        let p = reference_probs(
            &q[i * h * d..(i + 1) * h * d],
            &k[key0 * kvh * d..],
            seen,
            kvh,
            d,
        );
        for head in 0..h {
            for j in 0..seen {
                col[(head / g) * n + key0 + j] += p[head * seen + j];
            }
        }
    }
    col
}

/// The flash prefill kernels checked for head dim `d`, each with its check's name (of
/// the attention, or with `stats` of H2O's exact statistics after it): `mma` and
/// `wmma`, and FlashAttention-2 or -3 when the run prefills with it (FlashAttention-2
/// is the default in builds with the `flash-attn` feature, at head dim 128; `fa3` is
/// named), so a verify checks the kernel its runs use and a build without the vendored
/// kernels does not need them.
fn flash_kernels(d: usize, stats: bool) -> Result<Vec<(FlashKernel, &'static str)>> {
    use crate::policy::evicting::cuda::{stats_choice, StatsChoice};
    let names = if stats {
        [
            // The form the runs use (KVBENCH_H2O_STATS).
            if stats_choice()? == StatsChoice::Keys64 {
                "h2o exact statistics (mma, 64 keys)"
            } else {
                "h2o exact statistics (mma)"
            },
            "h2o exact statistics (wmma)",
            "h2o exact statistics (fa2)",
            "h2o exact statistics (fa3)",
        ]
    } else {
        [
            "flash_prefill (mma)",
            "flash_prefill (wmma)",
            "flash_prefill (fa2)",
            "flash_prefill (fa3)",
        ]
    };
    let mut ks = vec![(FlashKernel::Mma, names[0]), (FlashKernel::Wmma, names[1])];
    // The vendored kernels are built for head dim 128 alone; the other shapes' checks
    // still run the two of kvbench's own.
    match FlashKernel::chosen_for(d)? {
        FlashKernel::Fa2 if d == 128 => ks.push((FlashKernel::Fa2, names[2])),
        FlashKernel::Fa3 if d == 128 => ks.push((FlashKernel::Fa3, names[3])),
        _ => {}
    }
    Ok(ks)
}

/// A check of a bf16 result against its f64 reference.
fn bf16_check(kernel: &'static str, case: String, rel_err: f64) -> KernelCheck {
    KernelCheck {
        kernel,
        case,
        rel_err,
        tolerance: BF16_TOL,
        pass: rel_err <= BF16_TOL,
    }
}

fn exact_check(kernel: &'static str, case: String, ok: bool) -> KernelCheck {
    KernelCheck {
        kernel,
        case,
        rel_err: if ok { 0.0 } else { 1.0 },
        tolerance: 0.0,
        pass: ok,
    }
}

/// The kernels of the evicting strategies (H2O, StreamingLLM) on one shape: exact
/// column statistics (flash log-sum-exp + second pass), statistics from materialized
/// probabilities (eager, chunked), decode probabilities into the scores, the decode
/// eviction of each victim rule and the prefill compaction, against the host.
fn evicting_checks(
    dev: &Device,
    rng: &mut StdRng,
    h: usize,
    kvh: usize,
    d: usize,
    bs: usize,
) -> Result<Vec<KernelCheck>> {
    use super::{paged_decode_with, prefill_attention_stats, DecodeScores};
    use crate::attention::prefill::ColumnStats;
    use crate::policy::evicting::cuda::{
        colsum, compact_slots, decode_scores_accum, evict, h2o_prefill_keep, scores_gather,
        slot_meta_init, SlotLayer,
    };
    use crate::policy::evicting::h2o::{H2o, H2oParams};
    use crate::policy::evicting::streaming::{Streaming, StreamingParams};
    use crate::policy::evicting::{Counts, Eviction, VictimKind};

    let cuda = device_of(dev)?;
    let mut out = Vec::new();
    let lens = [700usize, 130];
    let total_blocks: usize = lens.iter().map(|l| l.div_ceil(bs)).sum::<usize>() + 3;
    let tables = random_tables(rng, &lens, total_blocks, bs);
    let phys = |si: usize, i: usize| tables[si][i / bs] * bs as i32 + (i % bs) as i32;
    let mut sl = SlotLayer::new(&cuda, total_blocks * bs, kvh, d)?;
    let mut keys = Vec::new();
    for (si, &l) in lens.iter().enumerate() {
        let slots = slots_of(&tables[si], l, bs);
        let (k, v) = write_random(rng, dev, &mut sl.kv, &slots, kvh, d)?;
        keys.push((k, v, slots));
    }
    let reset = |sl: &mut SlotLayer| -> Result<()> {
        for (si, &l) in lens.iter().enumerate() {
            let pos: Vec<i32> = (0..l as i32).collect();
            let (slots_d, pos_d) = (
                super::upload_i32(&cuda, &keys[si].2)?,
                super::upload_i32(&cuda, &pos)?,
            );
            slot_meta_init(&cuda, sl, &slots_d, &pos_d, l)?;
        }
        Ok(())
    };
    let tables_d: Vec<_> = tables
        .iter()
        .map(|t| super::upload_i32(&cuda, t))
        .collect::<Result<_>>()?;
    let scores_of = |sl: &SlotLayer, si: usize, n: usize| -> Result<Vec<f32>> {
        let s = scores_gather(&cuda, sl, &tables_d[si], n, kvh, bs)?;
        Ok(cuda
            .cuda_stream()
            .clone_dtoh(&s)
            .map_err(candle_core::Error::wrap)?)
    };

    // Exact statistics: a whole prompt, and the last rows after a cached prefix.
    for (si, t) in [(1usize, lens[1]), (0, 200)] {
        let l = lens[si];
        let before = l - t;
        reset(&mut sl)?;
        let qp = rand_bf16(rng, t * h * d, 2.0);
        let qt = upload(&qp, &[t, h, d], dev)?;
        let reference = reference_columns(&qp, &keys[si].0, before, 0, l, h, kvh, d);
        for (kernel, name) in flash_kernels(d, true)? {
            reset(&mut sl)?;
            let mut lse = cuda.alloc_zeros::<f32>(t * h)?;
            flash_prefill_with(
                &sl.kv,
                &qt,
                &tables[si],
                before,
                kvh,
                bs,
                Some(&mut lse),
                kernel,
            )?;
            colsum(
                &cuda,
                &mut sl,
                &qt,
                &lse,
                &tables_d[si],
                before,
                kvh,
                bs,
                kernel,
            )?;
            let got = scores_of(&sl, si, l)?;
            let e = rel_err(&got, &reference);
            out.push(bf16_check(
                name,
                format!("H={h} KVH={kvh} D={d}, {t} rows after {before}"),
                e,
            ));
        }
    }

    // Statistics from the materialized probabilities (cuBLAS): eager and chunked.
    {
        let (si, t) = (0usize, 150usize);
        let l = lens[si];
        let before = l - t;
        let qp = rand_bf16(rng, t * h * d, 2.0);
        let (k, v, _) = &keys[si];
        for (mode, chunk) in [(ColumnStats::Eager, t), (ColumnStats::Chunked, 37)] {
            let (_, _, col) = prefill_attention_stats(
                &upload(&qp, &[t, h, d], dev)?,
                &upload(k, &[l, kvh, d], dev)?,
                &upload(v, &[l, kvh, d], dev)?,
                before,
                chunk,
                None,
                Some(mode),
            )?;
            let col = match col {
                Some(c) => download(&c)?,
                None => Vec::new(),
            };
            let reference = if mode == ColumnStats::Eager {
                reference_columns(&qp, k, before, 0, l, h, kvh, d)
            } else {
                let mut r = vec![0f64; kvh * l];
                for c0 in (0..t).step_by(chunk) {
                    let c = chunk.min(t - c0);
                    let part = reference_columns(
                        &qp[c0 * h * d..(c0 + c) * h * d],
                        k,
                        before + c0,
                        before + c0,
                        l,
                        h,
                        kvh,
                        d,
                    );
                    for (x, y) in r.iter_mut().zip(part) {
                        *x += y;
                    }
                }
                r
            };
            let e = rel_err(&col, &reference);
            out.push(bf16_check(
                "h2o materialized statistics",
                format!("H={h} KVH={kvh} D={d}, {mode}, {t} rows after {before}"),
                e,
            ));
        }
    }

    // Decode probabilities into the scores: one row per sequence at its last position.
    {
        reset(&mut sl)?;
        let rows = lens.len();
        let q = rand_bf16(rng, rows * h * d, 2.0);
        let dt = DecodeTables::new(&cuda, &tables, &lens)?;
        let stride = lens.iter().copied().max().unwrap_or(1);
        let mut lse = cuda.alloc_zeros::<f32>(rows * h)?;
        let mut raw = cuda.alloc_zeros::<f32>(rows * h * stride)?;
        let scores = DecodeScores {
            lse: &mut lse,
            raw: &mut raw,
            stride,
        };
        let shape = DecodeShape {
            num_heads: h,
            num_kv_heads: kvh,
            head_dim: d,
            block_size: bs,
            part_size: 256,
        };
        paged_decode_with(
            &sl.kv,
            &upload(&q, &[rows, h, d], dev)?,
            &dt,
            shape,
            Some(scores),
        )?;
        let scores = DecodeScores {
            lse: &mut lse,
            raw: &mut raw,
            stride,
        };
        decode_scores_accum(&cuda, &mut sl, &scores, &dt, h / kvh, bs)?;
        let (mut got, mut reference) = (Vec::new(), Vec::new());
        for (si, &l) in lens.iter().enumerate() {
            got.extend(scores_of(&sl, si, l)?);
            reference.extend(reference_columns(
                &q[si * h * d..(si + 1) * h * d],
                &keys[si].0,
                l - 1,
                0,
                l,
                h,
                kvh,
                d,
            ));
        }
        let e = rel_err(&got, &reference);
        out.push(bf16_check(
            "h2o decode probabilities",
            format!("H={h} KVH={kvh} D={d}, contexts {lens:?}"),
            e,
        ));
    }

    // Random positions and scores (with ties) on every slot, for the eviction and
    // compaction checks: positions are a shuffled range per head, scores small
    // integers.
    let scramble = |sl: &mut SlotLayer, rng: &mut StdRng| -> Result<Vec<(Vec<i32>, Vec<f32>)>> {
        let slots = sl.score.len() / kvh;
        let mut pos = vec![0i32; slots * kvh];
        let mut score = vec![0f32; slots * kvh];
        let mut per_seq = Vec::new();
        for (si, &l) in lens.iter().enumerate() {
            let (mut p_all, mut s_all) = (vec![0i32; kvh * l], vec![0f32; kvh * l]);
            for g in 0..kvh {
                let mut p: Vec<i32> = (0..(l + l / 2) as i32).collect();
                p.shuffle(rng);
                for i in 0..l {
                    let slot = phys(si, i) as usize;
                    pos[slot * kvh + g] = p[i];
                    score[slot * kvh + g] = rng.random_range(0..6) as f32;
                    p_all[g * l + i] = p[i];
                    s_all[g * l + i] = score[slot * kvh + g];
                }
            }
            per_seq.push((p_all, s_all));
        }
        let st = cuda.cuda_stream();
        sl.pos = st.clone_htod(&pos).map_err(candle_core::Error::wrap)?;
        sl.score = st.clone_htod(&score).map_err(candle_core::Error::wrap)?;
        Ok(per_seq)
    };
    let download_meta = |sl: &SlotLayer, si: usize, m: usize| -> Result<(Vec<i32>, Vec<f32>)> {
        let st = cuda.cuda_stream();
        let pos = st.clone_dtoh(&sl.pos).map_err(candle_core::Error::wrap)?;
        let score = st.clone_dtoh(&sl.score).map_err(candle_core::Error::wrap)?;
        let (mut p, mut s) = (vec![0i32; kvh * m], vec![0f32; kvh * m]);
        for g in 0..kvh {
            for i in 0..m {
                let slot = phys(si, i) as usize;
                p[g * m + i] = pos[slot * kvh + g];
                s[g * m + i] = score[slot * kvh + g];
            }
        }
        Ok((p, s))
    };

    // Decode eviction: every rule, both sequences, against the rules' own victim.
    let rules: [(&str, Box<dyn Eviction>); 3] = [
        ("h2o", Box::new(H2o(H2oParams::default()))),
        (
            "h2o frozen",
            Box::new(H2o(H2oParams {
                decode_update: false,
                ..H2oParams::default()
            })),
        ),
        ("streaming", Box::new(Streaming(StreamingParams::default()))),
    ];
    for (name, rule) in &rules {
        let meta = scramble(&mut sl, rng)?;
        let k_before = download(&tensor_from_k(&cuda, &sl, &lens, &tables, (bs, kvh, d))?)?;
        let mut params = Vec::new();
        let mut expect = Vec::new();
        for (si, &l) in lens.iter().enumerate() {
            let (m, n) = (l, l + l / 2);
            let c = Counts {
                capacity: m - 1,
                recent: m / 5,
            };
            params.extend([m as i32, n as i32, c.capacity as i32, c.recent as i32]);
            let (mut p, mut s) = meta[si].clone();
            let mut victims = Vec::new();
            for g in 0..kvh {
                let pu: Vec<u32> = p[g * m..(g + 1) * m].iter().map(|&x| x as u32).collect();
                let vi = rule.victim(c, n, &pu, &s[g * m..(g + 1) * m]);
                p[g * m + vi] = p[g * m + m - 1];
                s[g * m + vi] = s[g * m + m - 1];
                victims.push(vi);
            }
            expect.push((p, s, victims));
        }
        let dt = DecodeTables::new(&cuda, &tables, &lens)?;
        let params_d = super::upload_i32(&cuda, &params)?;
        let mode: VictimKind = rule.victim_kind();
        evict(&cuda, &mut sl, &dt, &params_d, d, bs, mode)?;
        let k_after = download(&tensor_from_k(&cuda, &sl, &lens, &tables, (bs, kvh, d))?)?;
        let mut ok = true;
        let mut base = 0;
        for (si, &l) in lens.iter().enumerate() {
            let m = l;
            let (p, s) = download_meta(&sl, si, m)?;
            let (ep, es, victims) = &expect[si];
            for g in 0..kvh {
                // Slots 0..m-1 remain; slot m-1 is dropped.
                ok &= p[g * m..g * m + m - 1] == ep[g * m..g * m + m - 1];
                ok &= s[g * m..g * m + m - 1] == es[g * m..g * m + m - 1];
                let (vi, last) = (victims[g], m - 1);
                let row = |i: usize| base + (i * kvh + g) * d;
                ok &= k_after[row(vi)..row(vi) + d] == k_before[row(last)..row(last) + d];
            }
            base += l * kvh * d;
        }
        out.push(exact_check(
            "evict_one",
            format!("{name}: KVH={kvh} D={d}, slots {lens:?}"),
            ok,
        ));
    }

    // Prefill compaction: H2O's keep sets from random scores.
    {
        let meta = scramble(&mut sl, rng)?;
        let k_before = download(&tensor_from_k(&cuda, &sl, &lens, &tables, (bs, kvh, d))?)?;
        let (si, l) = (0usize, lens[0]);
        let c = Counts {
            capacity: l / 3,
            recent: l / 10,
        };
        let rule = H2o(H2oParams::default());
        let mut keep = Vec::new();
        for g in 0..kvh {
            keep.push(rule.prefill_keep(c, l, &meta[si].1[g * l..(g + 1) * l]));
        }
        let flat: Vec<i32> = keep.iter().flatten().map(|&x| x as i32).collect();
        let flat = super::upload_i32(&cuda, &flat)?;
        compact_slots(&cuda, &mut sl, &tables_d[si], &flat, c.capacity, kvh, d, bs)?;
        let k_after = download(&tensor_from_k(&cuda, &sl, &lens, &tables, (bs, kvh, d))?)?;
        let (p, s) = download_meta(&sl, si, c.capacity)?;
        let mut ok = true;
        for (g, kg) in keep.iter().enumerate() {
            for (dst, &src) in kg.iter().enumerate() {
                ok &= p[g * c.capacity + dst] == meta[si].0[g * l + src];
                ok &= s[g * c.capacity + dst] == meta[si].1[g * l + src];
                let (a, b) = ((dst * kvh + g) * d, (src * kvh + g) * d);
                ok &= k_after[a..a + d] == k_before[b..b + d];
            }
        }
        out.push(exact_check(
            "compact_slots",
            format!("KVH={kvh} D={d}, keep {} of {l}", c.capacity),
            ok,
        ));
    }

    // H2O's prefill keep on the device against the host rule: scores drawn from a few
    // values (ties everywhere, so the tie order is checked), lengths across a block of
    // threads, with and without a window, a capacity of the window alone.
    {
        let rule = H2o(H2oParams::default());
        let mut ok = true;
        let mut cases = Vec::new();
        for &(n, capacity, recent) in &[
            (10usize, 4usize, 2usize),
            (700, 233, 70),
            (3000, 1000, 0),
            (2500, 300, 300),
            (5000, 4999, 1),
        ] {
            let levels = [0.0f32, 0.25, 0.5, 1.0, 3.5];
            let scores: Vec<f32> = (0..kvh * n)
                .map(|_| levels[rng.random_range(0..levels.len())])
                .collect();
            let c = Counts { capacity, recent };
            let scores_d = cuda
                .cuda_stream()
                .clone_htod(&scores)
                .map_err(candle_core::Error::wrap)?;
            let keep_d = h2o_prefill_keep(&cuda, &scores_d, n, c, kvh)?;
            let got = cuda
                .cuda_stream()
                .clone_dtoh(&keep_d)
                .map_err(candle_core::Error::wrap)?;
            for g in 0..kvh {
                let want: Vec<i32> = rule
                    .prefill_keep(c, n, &scores[g * n..(g + 1) * n])
                    .into_iter()
                    .map(|x| x as i32)
                    .collect();
                ok &= got[g * capacity..(g + 1) * capacity] == want[..];
            }
            cases.push(format!("{capacity} of {n}"));
        }
        out.push(exact_check(
            "h2o_prefill_keep",
            format!(
                "KVH={kvh}, keep {} (scores from 5 values)",
                cases.join(", ")
            ),
            ok,
        ));
    }
    Ok(out)
}

/// Every sequence's K in slot order, concatenated (`[Σ l, KVH, D]`).
fn tensor_from_k(
    cuda: &candle_core::cuda_backend::CudaDevice,
    sl: &crate::policy::evicting::cuda::SlotLayer,
    lens: &[usize],
    tables: &[Vec<i32>],
    (bs, kvh, d): (usize, usize, usize),
) -> Result<Tensor> {
    let mut parts = Vec::new();
    for (si, &l) in lens.iter().enumerate() {
        let (k, _) = kv_gather(cuda, &sl.kv, &tables[si], l, bs, kvh, d)?;
        parts.push(k);
    }
    Ok(Tensor::cat(&parts, 0)?)
}

/// The InfiniGen kernels on one shape, against the host: K/V to the pinned host tier
/// and back (several chunks), partial keys, speculated scores, the α counts and top-k
/// selection (from the kernel's own scores, so the comparison is exact), the gather
/// from the host tier on a second stream, the own-token append and the paged decode
/// over the staging layout.
fn infinigen_checks(
    dev: &Device,
    rng: &mut StdRng,
    h: usize,
    kvh: usize,
    d: usize,
    bs: usize,
) -> Result<Vec<KernelCheck>> {
    use crate::policy::infinigen::cuda::{
        gather, gather_order, host_read, host_write, khat_write, speculate_select, stage_own,
        GatherOrder, GatherSrc, IgDims, KhatRows, PinnedTier, SelectOut, SpecRows,
    };
    use crate::policy::infinigen::top_k;
    use candle_core::cuda_backend::WrapErr;
    let cuda = device_of(dev)?;
    let stream = cuda.cuda_stream();
    let mut out = Vec::new();
    let (off, li) = (2usize, 1usize);
    let r = (d / 5).max(1);
    let dims = IgDims {
        num_heads: h,
        num_kv_heads: kvh,
        head_dim: d,
        r,
        off_layers: off,
        block_size: bs,
    };
    let row = kvh * d;
    let shape = format!("H={h} KVH={kvh} D={d} r={r}");
    // Positions before each row's new token, and each row's k_max: all fetched (n ≤
    // k_max) for the first and last, a selection for the others.
    let lens = [1usize, 17, 300, 2500];
    let kmax = [4usize, 10, 50, 3000];
    let nrows = lens.len();

    // Host tier: four blocks per chunk, so the rows span several pinned chunks.
    let layout = crate::kv::host::TierLayout {
        layers: off,
        block_size: bs,
        num_kv_heads: kvh,
        head_dim: d,
        per_chunk: 4,
    };
    let host_blocks: usize = lens.iter().map(|l| (l + 1).div_ceil(bs)).sum::<usize>() + 3;
    let mut tier = PinnedTier::new(&cuda, host_blocks, layout)?;
    for (si, &l) in lens.iter().enumerate() {
        if !tier.reserve(si as u64, l + 1)? {
            return Err(crate::error::Error::Config(
                "check: host tier too small".into(),
            ));
        }
    }
    tier.sync_ptrs(&stream)?;
    // Every position of both tier layers (different values, so a layer mix-up shows).
    let mut host_k = vec![Vec::new(); nrows];
    let mut host_v = vec![Vec::new(); nrows];
    for layer in 0..off {
        for (si, &l) in lens.iter().enumerate() {
            let k = rand_bf16(rng, l * row, 1.0);
            let v = rand_bf16(rng, l * row, 1.0);
            let slots: Vec<i32> = (0..l).map(|p| tier.slot(si as u64, p) as i32).collect();
            host_write(
                &cuda,
                &tier,
                dims,
                layer,
                &upload(&k, &[l, kvh, d], dev)?,
                &upload(&v, &[l, kvh, d], dev)?,
                &super::upload_i32(&cuda, &slots)?,
            )?;
            if layer == li {
                host_k[si] = k;
                host_v[si] = v;
            }
        }
    }
    let mut ok = true;
    for (si, &l) in lens.iter().enumerate() {
        let (k, v) = host_read(&cuda, &tier, dims, li, &tier.table_i32(si as u64), l)?;
        ok &= download(&k)? == host_k[si] && download(&v)? == host_v[si];
    }
    out.push(exact_check(
        "ig_host_write/read",
        format!(
            "{shape}, {nrows} sequences over {} pinned chunks",
            host_blocks.div_ceil(4)
        ),
        ok,
    ));

    // Partial keys in a device pool with shuffled block tables.
    let pool_blocks = host_blocks;
    let with_new: Vec<usize> = lens.iter().map(|l| l + 1).collect();
    let tables = random_tables(rng, &with_new, pool_blocks, bs);
    let a: Vec<f32> = (0..off * kvh * d * d)
        .map(|_| rng.random_range(-1.0f32..1.0) / (d as f32).sqrt())
        .collect();
    let a_t = Tensor::from_slice(&a, (off, kvh, d, d), dev)?;
    let a_l = a_t.get(li)?;
    let per_seq = off * kvh * r;
    let mut cols = vec![0i32; nrows * per_seq];
    for c in cols.chunks_exact_mut(r) {
        let mut all: Vec<i32> = (0..d as i32).collect();
        all.shuffle(rng);
        c.copy_from_slice(&all[..r]);
    }
    let cols_d = super::upload_i32(&cuda, &cols)?;
    let mut khat = cuda.alloc_zeros::<bf16>(pool_blocks * bs * kvh * r)?;
    let slot_of = |si: usize, p: usize| tables[si][p / bs] as usize * bs + p % bs;
    for (si, &l) in lens.iter().enumerate() {
        let src: Vec<i32> = (0..l as i32).collect();
        let dst: Vec<i32> = (0..l).map(|p| slot_of(si, p) as i32).collect();
        let (src_d, dst_d, seq_d) = (
            super::upload_i32(&cuda, &src)?,
            super::upload_i32(&cuda, &dst)?,
            super::upload_i32(&cuda, &vec![si as i32; l])?,
        );
        let rows = KhatRows {
            src: &src_d,
            dst: &dst_d,
            seq: &seq_d,
            count: l,
        };
        let k = upload(&host_k[si], &[l, kvh, d], dev)?;
        khat_write(&cuda, dims, li, &a_l, &cols_d, &k, &rows, &mut khat)?;
    }
    let khat_h: Vec<f32> = stream
        .clone_dtoh(&khat)
        .w()?
        .iter()
        .map(|x| x.to_f32())
        .collect();
    let col = |si: usize, g: usize, c: usize| cols[si * per_seq + (li * kvh + g) * r + c] as usize;
    let a_at = |g: usize, dd: usize, c: usize| a[((li * kvh + g) * d + dd) * d + c] as f64;
    let (mut got, mut want) = (Vec::new(), Vec::new());
    for (si, &l) in lens.iter().enumerate() {
        for p in 0..l {
            for g in 0..kvh {
                for c in 0..r {
                    let kr = &host_k[si][(p * kvh + g) * d..(p * kvh + g + 1) * d];
                    want.push(
                        kr.iter()
                            .enumerate()
                            .map(|(dd, &x)| x as f64 * a_at(g, dd, col(si, g, c)))
                            .sum::<f64>(),
                    );
                    got.push(khat_h[(slot_of(si, p) * kvh + g) * r + c]);
                }
            }
        }
    }
    out.push(bf16_check(
        "ig_khat_write",
        shape.clone(),
        rel_err(&got, &want),
    ));

    // Speculated scores, counts and selections, for a finite α and α = ∞.
    let q = rand_bf16(rng, nrows * h * d, 1.0);
    let q_t = upload(&q, &[nrows, h, d], dev)?;
    let ctx: Vec<usize> = lens.iter().map(|l| l + 1).collect();
    let dense_tables = DecodeTables::new(&cuda, &tables, &ctx)?;
    let nctx: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
    let kmax_i: Vec<i32> = kmax.iter().map(|&k| k as i32).collect();
    let seqs: Vec<i32> = (0..nrows as i32).collect();
    let (nctx_d, kmax_d, seq_d) = (
        super::upload_i32(&cuda, &nctx)?,
        super::upload_i32(&cuda, &kmax_i)?,
        super::upload_i32(&cuda, &seqs)?,
    );
    let stride = lens.iter().copied().max().unwrap_or(1);
    let kcap = lens
        .iter()
        .zip(&kmax)
        .map(|(&l, &k)| l.min(k))
        .max()
        .unwrap_or(1);
    let b = (kcap + 1).div_ceil(16) * 16;
    let stage_rows: Vec<Vec<i32>> = (0..nrows)
        .map(|ri| (0..b / 16).map(|i| (ri * b / 16 + i) as i32).collect())
        .collect();
    let scale = 1.0 / (d as f64).sqrt();
    for alpha in [1.0f32, f32::INFINITY] {
        let mut scores = cuda.alloc_zeros::<f32>(nrows * h * stride)?;
        let mut counts = cuda.alloc_zeros::<i32>(nrows * h)?;
        let mut sel = cuda.alloc_zeros::<i32>(nrows * kvh * kcap)?;
        let mut ks = cuda.alloc_zeros::<i32>(nrows)?;
        let mut stage_tables = DecodeTables::with_max_ctx(&cuda, &stage_rows, &vec![0; nrows], b)?;
        let rows = SpecRows {
            row_seq: &seq_d,
            nctx: &nctx_d,
            kmax: &kmax_d,
            tables: &dense_tables,
            stride,
        };
        let sel_out = SelectOut {
            sel: &mut sel,
            kcap,
            ks: &mut ks,
            stage_ctx: &mut stage_tables.ctx,
            klog: None,
        };
        speculate_select(
            &cuda,
            dims,
            li,
            &q_t,
            &a_l,
            &cols_d,
            &khat,
            &rows,
            alpha,
            &mut scores,
            &mut counts,
            sel_out,
        )?;
        let s_h = stream.clone_dtoh(&scores).w()?;
        // Scores against f64 from the same inputs (K̂ as the kernel wrote it).
        let (mut got, mut want) = (Vec::new(), Vec::new());
        for (ri, &l) in lens.iter().enumerate() {
            for hq in 0..h {
                let g = hq / (h / kvh);
                let qh: Vec<f64> = (0..r)
                    .map(|c| {
                        (0..d)
                            .map(|dd| q[(ri * h + hq) * d + dd] as f64 * a_at(g, dd, col(ri, g, c)))
                            .sum()
                    })
                    .collect();
                for j in 0..l {
                    let kr = &khat_h[(slot_of(ri, j) * kvh + g) * r..][..r];
                    want.push(scale * qh.iter().zip(kr).map(|(&x, &y)| x * y as f64).sum::<f64>());
                    got.push(s_h[(ri * h + hq) * stride + j]);
                }
            }
        }
        let e = rel_err(&got, &want);
        out.push(KernelCheck {
            kernel: "ig_spec_scores",
            case: format!("{shape}, positions {lens:?}"),
            rel_err: e,
            tolerance: 1e-4,
            pass: e <= 1e-4,
        });
        // Selection: the CPU rules applied to the kernel's own scores.
        let sel_h = stream.clone_dtoh(&sel).w()?;
        let ks_h = stream.clone_dtoh(&ks).w()?;
        let ctx_h = stream.clone_dtoh(&stage_tables.ctx).w()?;
        let mut ok = true;
        let mut picked = Vec::new();
        for (ri, &n) in lens.iter().enumerate() {
            let km = kmax[ri].max(1);
            let srow = |hq: usize| &s_h[(ri * h + hq) * stride..(ri * h + hq) * stride + n];
            let k = if n <= km {
                n
            } else {
                let total: usize = (0..h)
                    .map(|hq| {
                        let m = srow(hq).iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                        srow(hq).iter().filter(|&&x| x > m - alpha).count()
                    })
                    .sum();
                (total / h).clamp(1, km)
            };
            ok &= ks_h[ri] as usize == k && ctx_h[ri] as usize == k + 1;
            for g in 0..kvh {
                let want: Vec<u32> = if n <= km {
                    (0..n as u32).collect()
                } else {
                    let mut est = vec![f32::NEG_INFINITY; n];
                    for hq in g * (h / kvh)..(g + 1) * (h / kvh) {
                        for (e, &x) in est.iter_mut().zip(srow(hq)) {
                            *e = e.max(x);
                        }
                    }
                    top_k(&est, k)
                };
                let base = (ri * kvh + g) * kcap;
                let got: Vec<u32> = sel_h[base..base + k.min(kcap)]
                    .iter()
                    .map(|&x| x as u32)
                    .collect();
                ok &= got == want;
            }
            picked.push(k);
        }
        out.push(exact_check(
            "ig_count/ig_select",
            format!("{shape}, alpha {alpha}, k {picked:?} (k_max {kmax:?})"),
            ok,
        ));

        // Gather on a second stream, the own token, attention over the staging slots.
        let mut stage = LayerCache::new(&cuda, nrows * b, row)?;
        let host_tables: Vec<Vec<i32>> = (0..nrows).map(|si| tier.table_i32(si as u64)).collect();
        let mhb = host_tables.iter().map(Vec::len).max().unwrap_or(1);
        let mut flat = vec![0i32; nrows * mhb];
        for (ri, t) in host_tables.iter().enumerate() {
            flat[ri * mhb..ri * mhb + t.len()].copy_from_slice(t);
        }
        let flat_d = super::upload_i32(&cuda, &flat)?;
        let mut marks = cuda.alloc_zeros::<i32>(nrows * kvh * stride)?;
        // The copy stream does not wait on the compute stream: every buffer it writes or
        // reads must be ready (zeroed, uploaded) first.
        synchronize(&cuda)?;
        let copy = stream.context().new_stream().w()?;
        let src = GatherSrc {
            host_tables: &flat_d,
            max_hblocks: mhb,
            sel: &sel,
            kcap,
            ks: &ks,
            rows: nrows,
            nctx: &nctx_d,
            stride,
        };
        gather(
            &copy,
            &cuda,
            &tier,
            dims,
            li,
            &src,
            &mut stage,
            b,
            GatherOrder::Heads,
            &mut marks,
        )?;
        copy.synchronize().w()?;
        // Under KVBENCH_IG_GATHER=tokens, the token order too, into a second staging
        // buffer: the same bytes in the same slots (the head order's are checked against
        // the host tier below), and its marks all zero again after. Checked when asked
        // for, as runs use it only then, so that an opt-in kernel cannot stop a verify
        // of the default ones.
        if gather_order()? == GatherOrder::Tokens {
            let mut stage_t = LayerCache::new(&cuda, nrows * b, row)?;
            synchronize(&cuda)?;
            gather(
                &copy,
                &cuda,
                &tier,
                dims,
                li,
                &src,
                &mut stage_t,
                b,
                GatherOrder::Tokens,
                &mut marks,
            )?;
            copy.synchronize().w()?;
            let same = stream.clone_dtoh(&stage.k).w()? == stream.clone_dtoh(&stage_t.k).w()?
                && stream.clone_dtoh(&stage.v).w()? == stream.clone_dtoh(&stage_t.v).w()?;
            let cleared = stream.clone_dtoh(&marks).w()?.iter().all(|&m| m == 0);
            out.push(exact_check(
                "ig_mark/ig_gather_tokens",
                format!(
                    "{shape}, alpha {alpha}: staging equal to ig_gather's ({same}), marks \
                     cleared ({cleared})"
                ),
                same && cleared,
            ));
        }
        let own_k = rand_bf16(rng, nrows * row, 1.0);
        let own_v = rand_bf16(rng, nrows * row, 1.0);
        stage_own(
            &cuda,
            dims,
            &upload(&own_k, &[nrows, kvh, d], dev)?,
            &upload(&own_v, &[nrows, kvh, d], dev)?,
            &seq_d,
            &ks,
            nrows,
            b,
            &mut stage,
        )?;
        let sk: Vec<f32> = stream
            .clone_dtoh(&stage.k)
            .w()?
            .iter()
            .map(|x| x.to_f32())
            .collect();
        let sv: Vec<f32> = stream
            .clone_dtoh(&stage.v)
            .w()?
            .iter()
            .map(|x| x.to_f32())
            .collect();
        let mut ok = true;
        for ri in 0..nrows {
            let k = ks_h[ri] as usize;
            for g in 0..kvh {
                for j in 0..=k {
                    let at = ((ri * b + j) * kvh + g) * d;
                    let (wk, wv) = if j < k {
                        let p = sel_h[(ri * kvh + g) * kcap + j] as usize;
                        let o = (p * kvh + g) * d;
                        (&host_k[ri][o..o + d], &host_v[ri][o..o + d])
                    } else {
                        let o = (ri * kvh + g) * d;
                        (&own_k[o..o + d], &own_v[o..o + d])
                    };
                    ok &= sk[at..at + d] == *wk && sv[at..at + d] == *wv;
                }
            }
        }
        out.push(exact_check(
            "ig_gather/ig_stage_own",
            format!("{shape}, alpha {alpha}, {nrows} rows from pinned host memory"),
            ok,
        ));
        // The host gather of the `memcpy` transfer reads the same tier the same way.
        let views = tier.host_views()?;
        let mut ok = true;
        for ri in 0..nrows {
            let k = ks_h[ri] as usize;
            let (mut hk, mut hv) = (vec![bf16::ZERO; k * row], vec![bf16::ZERO; k * row]);
            crate::kv::host::gather_selected(
                &layout,
                &views,
                li,
                &host_tables[ri],
                &sel_h[ri * kvh * kcap..(ri + 1) * kvh * kcap],
                kcap,
                k,
                &mut hk,
                &mut hv,
            );
            let at = ri * b * row;
            ok &= hk
                .iter()
                .map(|x| x.to_f32())
                .eq(sk[at..at + k * row].iter().copied())
                && hv
                    .iter()
                    .map(|x| x.to_f32())
                    .eq(sv[at..at + k * row].iter().copied());
        }
        out.push(exact_check(
            "host gather (transfer: memcpy)",
            format!("{shape}, alpha {alpha}, as ig_gather"),
            ok,
        ));
        let o = paged_decode(&stage, &q_t, &stage_tables, dims.stage_shape())?;
        let o = download(&o)?;
        let (mut got, mut want) = (Vec::new(), Vec::new());
        for ri in 0..nrows {
            let n = ks_h[ri] as usize + 1;
            let at = ri * b * row;
            want.extend(reference_row(
                &q[ri * h * d..(ri + 1) * h * d],
                &sk[at..at + n * row],
                &sv[at..at + n * row],
                n,
                kvh,
                d,
            ));
            got.extend_from_slice(&o[ri * h * d..(ri + 1) * h * d]);
        }
        out.push(bf16_check(
            "paged_decode (staging)",
            format!("{shape}, alpha {alpha}"),
            rel_err(&got, &want),
        ));
    }
    Ok(out)
}

/// The paged decode over keys cached without RoPE (StreamingLLM's rolling positions):
/// slots hold the sinks and a contiguous window in shuffled slot order; each key is
/// rotated to its index in the cache (its rank by position), against an f64 reference
/// that rotates on the host.
fn rolling_check(
    dev: &Device,
    rng: &mut StdRng,
    h: usize,
    kvh: usize,
    d: usize,
    bs: usize,
) -> Result<Vec<KernelCheck>> {
    use super::{upload_i32, RollingKeys};
    use candle_core::cuda_backend::WrapErr;
    let cuda = device_of(dev)?;
    let stream = cuda.cuda_stream();
    let row = kvh * d;
    let half = d / 2;
    // (context n, sinks, window): evicting, keeping everything, a window at the start.
    let cases = [
        (900usize, 4usize, 60usize),
        (40, 4, 100),
        (700, 0, 513),
        (65, 4, 60),
    ];
    let kept: Vec<usize> = cases.iter().map(|&(n, s, w)| n.min(s + w)).collect();
    let total_blocks: usize = kept.iter().map(|m| m.div_ceil(bs)).sum::<usize>() + 2;
    let all_tables = random_tables(rng, &kept, total_blocks, bs);
    let mut cache = LayerCache::new(&cuda, total_blocks * bs, row)?;
    let mut pos = vec![0i32; total_blocks * bs * kvh];
    let (mut tables, mut params, mut keys, mut vals) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for ((&(n, sinks, window), &m), table) in cases.iter().zip(&kept).zip(all_tables) {
        // Kept positions: the sinks and the last window, the new token last.
        let mut kept_pos: Vec<usize> = if n <= sinks + window {
            (0..n).collect()
        } else {
            (0..sinks).chain(n - window..n).collect()
        };
        let last = kept_pos.pop().expect("n ≥ 1");
        kept_pos.shuffle(rng);
        kept_pos.push(last);
        let slots = slots_of(&table, m, bs);
        let (k, v) = write_random(rng, dev, &mut cache, &slots, kvh, d)?;
        for (i, &slot) in slots.iter().enumerate() {
            for g in 0..kvh {
                pos[slot as usize * kvh + g] = kept_pos[i] as i32;
            }
        }
        params.extend([m as i32, n as i32, (sinks + window) as i32, window as i32]);
        tables.push(table);
        keys.push((k, kept_pos));
        vals.push(v);
    }
    let max_m = kept.iter().copied().max().unwrap_or(1);
    let inv: Vec<f64> = (0..half)
        .map(|i| 10000f64.powf(-2.0 * i as f64 / d as f64))
        .collect();
    let cos: Vec<f32> = (0..max_m)
        .flat_map(|p| inv.iter().map(move |f| (p as f64 * f).cos() as f32))
        .collect();
    let sin: Vec<f32> = (0..max_m)
        .flat_map(|p| inv.iter().map(move |f| (p as f64 * f).sin() as f32))
        .collect();
    let q = rand_bf16(rng, cases.len() * h * d, 1.0);
    let t = DecodeTables::new(&cuda, &tables, &kept)?;
    let (pos_d, params_d) = (upload_i32(&cuda, &pos)?, upload_i32(&cuda, &params)?);
    let (cos_d, sin_d) = (stream.clone_htod(&cos).w()?, stream.clone_htod(&sin).w()?);
    let shape = DecodeShape {
        num_heads: h,
        num_kv_heads: kvh,
        head_dim: d,
        block_size: bs,
        part_size: 512,
    };
    let mut want = Vec::new();
    for (ri, (&(n, sinks, _), &m)) in cases.iter().zip(&kept).enumerate() {
        let (k, kept_pos) = &keys[ri];
        let mut rot = k.clone();
        for (i, &p) in kept_pos.iter().enumerate() {
            let index = if p < sinks { p } else { p - (n - m) };
            for g in 0..kvh {
                let x = &mut rot[(i * kvh + g) * d..(i * kvh + g + 1) * d];
                for j in 0..half {
                    let (c, s) = (cos[index * half + j], sin[index * half + j]);
                    let (x0, x1) = (x[j], x[j + half]);
                    x[j] = x0 * c - x1 * s;
                    x[j + half] = x0 * s + x1 * c;
                }
            }
        }
        want.extend(reference_row(
            &q[ri * h * d..(ri + 1) * h * d],
            &rot,
            &vals[ri],
            m,
            kvh,
            d,
        ));
    }
    let mut out = Vec::new();
    // The vector kernel the runs use for rolling keys (the pipelined and tensor-core
    // kernels take none).
    let vector = match DecodeKernel::vector_form(super::decode_choice()?) {
        DecodeKernel::VectorOneRow => (
            DecodeKernel::VectorOneRow,
            "paged_decode (rolling positions, vector, 1 row)",
        ),
        _ => (
            DecodeKernel::Vector,
            "paged_decode (rolling positions, vector)",
        ),
    };
    for (kernel, name) in [
        vector,
        (
            DecodeKernel::Scalar,
            "paged_decode (rolling positions, scalar)",
        ),
    ] {
        if !kernel.applies(d, h / kvh) {
            continue;
        }
        let roll = RollingKeys {
            pos: &pos_d,
            params: &params_d,
            cos: &cos_d,
            sin: &sin_d,
        };
        let o = download(&paged_decode_impl(
            &cache,
            &upload(&q, &[cases.len(), h, d], dev)?,
            &t,
            shape,
            None,
            Some(roll),
            DecodePin {
                kernel: Some(kernel),
                ..DecodePin::default()
            },
        )?)?;
        out.push(bf16_check(
            name,
            format!(
                "H={h} KVH={kvh} D={d}, (n, sinks, window) {cases:?}, reduction {}",
                super::decode_reduce()?.label()
            ),
            rel_err(&o, &want),
        ));
    }
    Ok(out)
}
