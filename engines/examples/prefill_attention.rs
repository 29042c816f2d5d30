//! The CPU paged attention of one prompt's prefill, as arithmetic: SmolLM2-135M's
//! attention shapes (9 query heads, 3 KV heads of 64, blocks of 16), `paged_attention`
//! of every row of a `prompt`-token prompt over one layer's keys (causal) on a pool of
//! `threads`, as the forward runs it for each layer. Prints the best of 5 passes per
//! round as GFLOP/s (two multiply-adds a query head and key: the scores and the
//! values; the softmax not counted), and the median over the rounds.
//!
//!   cargo run --release -p kvbench-engines --example prefill_attention -- [threads] [rounds] [prompt]

mod common;

use anyhow::{Context, Result};
use common::{best_of, median, Args};
use kvbench_engines::attention::paged::{paged_attention, AttnShape, SeqAttn};
use kvbench_engines::kv::paged::KvView;
use kvbench_engines::kv::BlockId;
use rand::{Rng, SeedableRng};

fn main() -> Result<()> {
    let mut args = Args::new();
    let threads = args.next("threads", 2)?.max(1);
    let rounds = args.next("rounds", 5)?.max(1);
    let prompt = args.next("prompt", 579)?.max(1);
    let s = AttnShape {
        num_heads: 9,
        num_kv_heads: 3,
        head_dim: 64,
        block_size: 16,
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .context("thread pool")?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let blocks = prompt.div_ceil(s.block_size);
    let per_block = s.num_kv_heads * s.block_size * s.head_dim;
    let mut random =
        |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0..1.0)).collect() };
    let (k, v) = (random(blocks * per_block), random(blocks * per_block));
    let q = random(prompt * s.num_heads * s.head_dim);
    let table: Vec<BlockId> = (0..blocks as BlockId).collect();
    let seqs = [SeqAttn {
        q_start: 0,
        q_len: prompt,
        kv_len: prompt,
        table: &table,
    }];
    // Query head × key pairs of the causal prefill, two multiply-adds of dh each.
    let pairs = (prompt * (prompt + 1) / 2 * s.num_heads) as f64;
    let flop = pairs * 4.0 * s.head_dim as f64;
    let mut rates = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let (secs, out) = best_of(5, || {
            pool.install(|| paged_attention(&q, &seqs, KvView::F32(&k), KvView::F32(&v), s))
        });
        anyhow::ensure!(out.iter().all(|x| x.is_finite()), "an output is not finite");
        rates.push(flop / secs / 1e9);
        println!(
            "round {round}: {:.3} ms, {:.1} GFLOP/s",
            secs * 1e3,
            flop / secs / 1e9
        );
    }
    println!(
        "{prompt}-token prefill, one layer, {threads} thread(s): median {:.1} GFLOP/s",
        median(rates)
    );
    Ok(())
}
