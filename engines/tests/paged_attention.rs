//! The paged attention kernel against a naive f64 reference, random inputs.

mod common;
use common::lcg;
use kvbench_engines::attention::paged::{paged_attention, AttnShape, SeqAttn};
use kvbench_engines::kv::{BlockPool, KvCodec, PagedKv};

fn rand_vec(n: usize, seed: &mut u64) -> Vec<f32> {
    (0..n)
        .map(|_| (lcg(seed) % 20001) as f32 / 10000.0 - 1.0)
        .collect()
}

/// o_h(i) = Σ_j softmax_j(q·k_j/√dh) v_j over j ≤ pos(i), in f64.
fn reference(
    q: &[f32],
    k: &[Vec<f32>],
    v: &[Vec<f32>],
    pos: usize,
    h: usize,
    hkv: usize,
    dh: usize,
) -> Vec<f64> {
    let g = h / hkv;
    let mut out = vec![0f64; h * dh];
    for head in 0..h {
        let kh = head / g;
        let qh = &q[head * dh..(head + 1) * dh];
        let s: Vec<f64> = (0..=pos)
            .map(|j| {
                let kj = &k[j][kh * dh..(kh + 1) * dh];
                qh.iter()
                    .zip(kj)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
                    / (dh as f64).sqrt()
            })
            .collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
        for (j, sj) in s.iter().enumerate() {
            let p = (sj - m).exp() / z;
            for d in 0..dh {
                out[head * dh + d] += p * v[j][kh * dh + d] as f64;
            }
        }
    }
    out
}

fn check(dtype: KvCodec, tol: f64) {
    let small = [(0usize, 7usize), (13, 1), (0, 1), (30, 5), (4, 1)];
    check_shape(dtype, tol, 6, 2, 32, 4, &small);
    check_shape(dtype, tol, 9, 3, 64, 16, &small);
    check_shape(dtype, tol, 4, 4, 20, 3, &small);
    // Enough work that the kernel spreads it over the thread pool.
    check_shape(dtype, tol, 9, 3, 64, 16, &[(0, 200), (100, 1), (40, 60)]);
    // Prefill rows taken four together across the end of a 256-key span: rows whose
    // keys end before, at and after it in one tile, and a chunk after a long context.
    check_shape(dtype, tol, 9, 3, 64, 16, &[(0, 300), (250, 10), (511, 3)]);
}

#[allow(clippy::too_many_arguments)]
fn check_shape(
    dtype: KvCodec,
    tol: f64,
    h: usize,
    hkv: usize,
    dh: usize,
    bs: usize,
    seqs_spec: &[(usize, usize)],
) {
    let shape = AttnShape {
        num_heads: h,
        num_kv_heads: hkv,
        head_dim: dh,
        block_size: bs,
    };
    let mut seed = 42;
    // Ragged: (context before, new rows) per sequence; prefill, decode and a continued chunk.
    let blocks: usize = seqs_spec.iter().map(|&(c, n)| (c + n).div_ceil(bs)).sum();
    let blocks = blocks.max(64);
    let mut pool = BlockPool::new(blocks);
    pool.shuffle_free(3);
    let mut store = PagedKv::new(1, blocks, bs, hkv, dh, dtype);
    let mut tables = Vec::new();
    let mut keys = Vec::new();
    let mut vals = Vec::new();
    for &(ctx, n) in seqs_spec {
        let len = ctx + n;
        let table = pool.allocate(len.div_ceil(bs)).unwrap();
        let ks: Vec<Vec<f32>> = (0..len).map(|_| rand_vec(hkv * dh, &mut seed)).collect();
        let vs: Vec<Vec<f32>> = (0..len).map(|_| rand_vec(hkv * dh, &mut seed)).collect();
        for p in 0..len {
            let slot = store.slot(&table, p);
            store.write(0, slot, &ks[p], &vs[p]);
        }
        // Reference sees the stored (rounded) values.
        let round = |x: &Vec<f32>| -> Vec<f32> {
            x.chunks_exact(dh)
                .flat_map(|r| dtype.round_trip(r))
                .collect()
        };
        keys.push(ks.iter().map(round).collect::<Vec<_>>());
        vals.push(vs.iter().map(round).collect::<Vec<_>>());
        tables.push(table);
    }
    let rows: usize = seqs_spec.iter().map(|s| s.1).sum();
    let q = rand_vec(rows * h * dh, &mut seed);
    let mut views = Vec::new();
    let mut start = 0;
    for (i, &(ctx, n)) in seqs_spec.iter().enumerate() {
        views.push(SeqAttn {
            q_start: start,
            q_len: n,
            kv_len: ctx + n,
            table: &tables[i],
        });
        start += n;
    }
    let (kv, vv) = store.views(0);
    let out = paged_attention(&q, &views, kv, vv, shape);
    let mut worst = 0f64;
    for (i, &(ctx, n)) in seqs_spec.iter().enumerate() {
        for r in 0..n {
            let row = views[i].q_start + r;
            let want = reference(
                &q[row * h * dh..(row + 1) * h * dh],
                &keys[i],
                &vals[i],
                ctx + r,
                h,
                hkv,
                dh,
            );
            for (a, b) in out[row * h * dh..(row + 1) * h * dh].iter().zip(&want) {
                let rel = (*a as f64 - b).abs() / b.abs().max(1e-2);
                worst = worst.max(rel);
            }
        }
    }
    assert!(
        worst < tol,
        "{dtype:?} h={h} hkv={hkv} dh={dh} bs={bs}: worst relative error {worst}"
    );
}

#[test]
fn paged_attention_matches_reference_f32() {
    check(KvCodec::F32, 1e-5);
}

/// The same cases with the items handed out by a forward's team of three threads
/// (`model::team`, as `Engine::step` runs the kernel): prefill tiles, decode rows and
/// their key splits each taken once, whichever thread claims them.
#[test]
fn paged_attention_on_a_forward_team_matches_reference() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    pool.install(|| {
        kvbench_engines::model::team::run_awake(|| {
            check(KvCodec::F32, 1e-5);
            check_shape(KvCodec::F32, 1e-4, 9, 3, 64, 16, &[(300, 1), (999, 1)]);
            check_shape(KvCodec::F32, 1e-4, 4, 4, 20, 3, &[(3517, 1)]);
        })
    });
}

#[test]
fn paged_attention_matches_reference_bf16_and_f16_storage() {
    check(KvCodec::Bf16, 1e-4);
    check(KvCodec::F16, 1e-4);
}

/// One or two decode rows over long contexts on a pool of four threads: each row's keys
/// are split into runs whose partial softmaxes are combined (flash-decoding); the
/// result is the same attention, with f32 and coded rows.
#[test]
fn split_decode_rows_match_reference() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(4)
        .build()
        .unwrap();
    pool.install(|| {
        for codec in [KvCodec::F32, KvCodec::Int { bits: 4, group: 8 }] {
            // Contexts long enough for the parallel path (keys × H × dh ≥ 2^16).
            check_shape(codec, 1e-4, 6, 2, 32, 16, &[(3000, 1)]);
            check_shape(codec, 1e-4, 9, 3, 64, 16, &[(300, 1), (999, 1)]);
            // A context that is not a whole number of blocks or of runs.
            check_shape(codec, 1e-4, 4, 4, 20, 3, &[(3517, 1)]);
        }
    });
}

/// Integer rows (head sizes 32, 64 and 20: a ragged last group of 8): the kernel
/// decodes each block once per KV head and attends exactly what was stored.
#[test]
fn paged_attention_matches_reference_over_integer_rows() {
    for bits in [8, 4, 2] {
        check(KvCodec::Int { bits, group: 8 }, 1e-4);
    }
}
