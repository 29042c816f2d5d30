//! How close the dense products of one batch-1 f32 decode step come to the machine's
//! read bandwidth, as a ratio measured in one run: SmolLM2-135M's shapes
//! (`preset:smollm2-135m`, seeded random weights in huge pages, as `generate` holds
//! them), every layer's Q/K/V, O, gate/up and down products and the output head through
//! the engine's own `Linear` path on a pool of `threads`, against the read probe of
//! `read_bandwidth` over a buffer of the same size, with the matrices packed (as the
//! loader holds them) and in the row layout. Rounds alternate the three so that drift
//! of a shared machine lands on all; prints each round and the median ratios.
//! What a decode step spends beside its products (attention, norms, hand-offs) is
//! the step's time less this.
//!
//!   cargo run --release -p kvbench-engines --example decode_products -- [threads] [rounds]

mod common;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use common::{median, probe_best, products, Args};
use kvbench_engines::config::preset;
use kvbench_engines::model::load::load_preset;
use kvbench_engines::model::pages::huge_vec;
use kvbench_engines::model::{Linear, WeightDtype};
use std::time::Instant;

fn main() -> Result<()> {
    let mut args = Args::new();
    let threads = args.next("threads", 2)?.max(1);
    let rounds = args.next("rounds", 9)?.max(1);
    let cfg = preset("smollm2-135m").context("preset smollm2-135m")?;
    // The loader packs the f32 matrices (`model::packed`); the same weights in the row
    // layout, in a buffer of their own, are timed beside them.
    let model = load_preset(cfg.clone(), WeightDtype::F32, 0, &Device::Cpu)?.pack_rows()?;
    let rows_model = model.clone().unpack_rows()?.with_weights_in_huge_pages()?;
    let bytes: u64 = model
        .layers()
        .iter()
        .flat_map(|l| l.matrices())
        .chain([model.lm_head()])
        .map(Linear::bytes)
        .sum();
    let row = |n: usize| Tensor::ones((1, n), DType::F32, &Device::Cpu);
    let (h, a, m) = (
        row(cfg.hidden_size)?,
        row(cfg.num_heads * cfg.head_dim)?,
        row(cfg.intermediate_size)?,
    );
    let probe = huge_vec(bytes as usize / 4, 1.0);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .context("thread pool")?;
    let gb = |secs: f64| bytes as f64 / secs / 1e9;
    println!(
        "{} MB of products per step, {threads} thread(s); per round: probe best of 3, products median of 5",
        bytes / 1_000_000
    );
    let mut ratios = [Vec::with_capacity(rounds), Vec::with_capacity(rounds)];
    for round in 0..rounds {
        let best = probe_best(&probe, threads)?;
        let mut line = format!("round {round}: probe {:.1} GB/s", gb(best));
        // Which layout runs first alternates, so that neither always follows the probe.
        let mut order = [(0, "packed", &model), (1, "rows", &rows_model)];
        if round % 2 == 1 {
            order.reverse();
        }
        for (ri, name, model) in order {
            let mut times = Vec::with_capacity(5);
            for _ in 0..5 {
                // As the engine runs a step: on a worker of the pool, its products
                // shared with the other workers.
                let t = Instant::now();
                pool.install(|| rayon::scope(|_| products(model, &h, &a, &m)))?;
                times.push(t.elapsed().as_secs_f64());
            }
            let step = median(times);
            ratios[ri].push(best / step);
            line += &format!(
                ", {name} {:.2} ms ({:.1} GB/s, {:.0} %)",
                step * 1e3,
                gb(step),
                100.0 * best / step
            );
        }
        println!("{line}");
    }
    let [packed, rows] = ratios;
    println!(
        "median over {rounds} rounds: products at {:.0} % of the probe packed, {:.0} % in the row layout",
        100.0 * median(packed),
        100.0 * median(rows)
    );
    Ok(())
}
