//! How close the CPU paged attention of a batch-1 decode step comes to the machine's
//! read bandwidth, as a ratio measured in one run: SmolLM2-135M's attention shapes (9
//! query heads, 3 KV heads of 64, blocks of 16), an f32 K/V pool per layer for 30
//! layers with shuffled block tables (as a pool that served other requests holds them),
//! `paged_attention` of one query row over each layer's keys on a pool of `threads`
//! (as `Engine::step` runs it, on a worker), against the read probe over a buffer of the
//! same K/V bytes. Each is timed as the best of three passes per round; prints the
//! medians over the rounds for each context length.
//!
//! The block size (16, as vLLM's) can be set to see what longer runs of K/V give.
//!
//!   cargo run --release -p kvbench-engines --example decode_attention -- [threads] [rounds] [block size]

mod common;

use anyhow::{Context, Result};
use common::{best_of, median, probe_best, Args};
use kvbench_engines::attention::paged::{paged_attention, AttnShape, SeqAttn};
use kvbench_engines::kv::paged::KvView;
use kvbench_engines::kv::BlockId;
use kvbench_engines::model::pages::huge_vec;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const LAYERS: usize = 30;

fn main() -> Result<()> {
    let mut args = Args::new();
    let threads = args.next("threads", 2)?.max(1);
    let rounds = args.next("rounds", 7)?.max(1);
    let block_size = args.next("block size", 16)?.max(1);
    let s = AttnShape {
        num_heads: 9,
        num_kv_heads: 3,
        head_dim: 64,
        block_size,
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .context("thread pool")?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    println!(
        "paged attention of one row, {LAYERS} layers of H={} KVH={} D={}, {threads} thread(s), \
         medians of {rounds} rounds:",
        s.num_heads, s.num_kv_heads, s.head_dim
    );
    for ctx in [256usize, 512, 1024, 2048, 4096] {
        let blocks = ctx.div_ceil(s.block_size);
        let per_block = s.num_kv_heads * s.block_size * s.head_dim;
        // One K and one V pool per layer, values in (-1, 1).
        let pools: Vec<(Vec<f32>, Vec<f32>)> = (0..LAYERS)
            .map(|_| {
                let mut k = huge_vec(blocks * per_block, 0.0);
                let mut v = huge_vec(blocks * per_block, 0.0);
                k.iter_mut().for_each(|x| *x = rng.random_range(-1.0..1.0));
                v.iter_mut().for_each(|x| *x = rng.random_range(-1.0..1.0));
                (k, v)
            })
            .collect();
        let mut table: Vec<BlockId> = (0..blocks as BlockId).collect();
        table.shuffle(&mut rng);
        let q: Vec<f32> = (0..s.num_heads * s.head_dim)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let seqs = [SeqAttn {
            q_start: 0,
            q_len: 1,
            kv_len: ctx,
            table: &table,
        }];
        let bytes = LAYERS * 2 * ctx * s.num_kv_heads * s.head_dim * 4;
        let probe = huge_vec(bytes / 4, 1.0);
        let (mut att, mut read, mut pat) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds {
            let best = probe_best(&probe, threads)?;
            read.push(bytes as f64 / best / 1e9);
            // Best of three passes over the layers, as the probe: a single pass right
            // after the probe sometimes runs at one thread's speed.
            let (best, outs) = best_of(3, || {
                pool.install(|| {
                    pools
                        .iter()
                        .map(|(k, v)| paged_attention(&q, &seqs, KvView::F32(k), KvView::F32(v), s))
                        .collect::<Vec<_>>()
                })
            });
            att.push(bytes as f64 / best / 1e9);
            // The same bytes in the kernel's order with nothing but a sum: the table cut
            // into one run of blocks per thread, each block's K rows of every KV head
            // (one contiguous run) and then its V rows.
            let (secs, total) = best_of(3, || -> f32 {
                pool.install(|| {
                    use rayon::prelude::*;
                    let per = table.len().div_ceil(threads);
                    pools
                        .iter()
                        .map(|(k, v)| {
                            table
                                .par_chunks(per)
                                .map(|run| {
                                    let mut lanes = [0f32; 8];
                                    for buf in [k, v] {
                                        for &b in run {
                                            let at = b as usize * per_block;
                                            for c in buf[at..at + per_block].chunks_exact(8) {
                                                for i in 0..8 {
                                                    lanes[i] += c[i];
                                                }
                                            }
                                        }
                                    }
                                    lanes.iter().sum::<f32>()
                                })
                                .sum::<f32>()
                        })
                        .sum()
                })
            });
            anyhow::ensure!(total.is_finite(), "the pattern's sum is not finite");
            pat.push(bytes as f64 / secs / 1e9);
            // Keep the outputs: attention the optimizer could skip would measure nothing.
            anyhow::ensure!(
                outs.iter().flatten().all(|x| x.is_finite()),
                "an attention output is not finite"
            );
        }
        let (a, r, pt) = (median(att), median(read), median(pat));
        println!(
            "  context {ctx:>5}: {:6.2} MB of K/V, attention {a:5.1} GB/s, probe {r:5.1} GB/s, {:3.0} %; the same reads alone {pt:5.1} GB/s",
            bytes as f64 / 1e6,
            100.0 * a / r
        );
    }
    Ok(())
}
