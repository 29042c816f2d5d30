//! How close whole batch-1 f32 decode steps come to the machine's read bandwidth, as a
//! ratio measured in one run: an engine (`full`, audit on, as `kvbench generate` runs
//! it) over SmolLM2-135M's shapes (`preset:smollm2-135m`, seeded random weights, loaded
//! as the loader holds real ones: packed, in huge pages) on a pool of `threads`, one
//! request of `context` prompt tokens, its decode steps timed in rounds against the read
//! probe over a buffer as large as the weights. A step must read every weight once and
//! the request's K/V, so its bound is those bytes at the probe's rate; each round prints
//! the median step against that bound, and the run the median of the rounds' ratios.
//! Rounds alternate probe and steps so that drift of a shared machine lands on both.
//!
//!   cargo run --release -p kvbench-engines --example decode_step -- [threads] [rounds] [context] [steps]

mod common;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use common::{median, probe_best, products, Args};
use kvbench_engines::config::preset;
use kvbench_engines::engine::{Engine, EngineConfig, Request, StepOutcome};
use kvbench_engines::model::load::load_preset;
use kvbench_engines::model::pages::huge_vec;
use kvbench_engines::model::team::run_awake;
use kvbench_engines::model::WeightDtype;
use std::time::Instant;

fn main() -> Result<()> {
    let mut args = Args::new();
    let threads = args.next("threads", 2)?.max(1);
    let rounds = args.next("rounds", 7)?.max(1);
    let context = args.next("context", 1)?.max(1);
    let steps = args.next("steps", 32)?.max(1);
    // The global pool, as `kvbench generate --threads` sets it, before anything uses it
    // (an engine is not `Send` in CUDA builds: it cannot be handed to a pool of its own).
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .context("thread pool")?;
    let cfg = preset("smollm2-135m").context("preset smollm2-135m")?;
    let model = load_preset(cfg.clone(), WeightDtype::F32, 0, &Device::Cpu)?;
    let weights = model.weights_bytes();
    // K and V of one token over every layer, f32.
    let kv_per_token = (cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4) as u64;
    let total = context + rounds * steps + 1;
    let engine_cfg = EngineConfig {
        num_blocks: Some(total.div_ceil(16) + 1),
        max_model_len: Some(total + 1),
        ..EngineConfig::default()
    };
    let row = |n: usize| Tensor::ones((1, n), DType::F32, &Device::Cpu);
    let (h, a, m) = (
        row(cfg.hidden_size)?,
        row(cfg.num_heads * cfg.head_dim)?,
        row(cfg.intermediate_size)?,
    );
    let mut engine = Engine::new(model, engine_cfg)?;
    // The engine's own weights (a clone shares their buffers).
    let weights_of = engine.model().clone();
    // Token ids spread over the vocabulary; no stop tokens, so every step decodes.
    let prompt: Vec<u32> = (0..context as u32)
        .map(|i| (i * 7919 + 13) % cfg.vocab_size as u32)
        .collect();
    engine.add_request(Request::greedy(prompt, rounds * steps + 1))?;
    let probe = huge_vec(weights as usize / 4, 1.0);
    let step = |engine: &mut Engine| -> Result<()> {
        match engine.step()? {
            StepOutcome::Ran(_) => Ok(()),
            other => anyhow::bail!("expected a decode step, the engine answered {other:?}"),
        }
    };
    // The prompt's prefill (not timed).
    step(&mut engine)?;
    println!(
        "{} MB of weights, {} KB of K/V a token, {context}-token prompt, {threads} thread(s); \
         per round: probe best of 3, {steps} steps' median, the products' median of 5",
        weights / 1_000_000,
        kv_per_token / 1000
    );
    let mut ratios = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let best = probe_best(&probe, threads)?;
        let bw = weights as f64 / best;
        let mut times = Vec::with_capacity(steps);
        for _ in 0..steps {
            let t = Instant::now();
            step(&mut engine)?;
            times.push(t.elapsed().as_secs_f64());
        }
        let mut prod = Vec::with_capacity(5);
        for _ in 0..5 {
            // As the engine runs a step: on a worker of the pool, the others awake.
            let t = Instant::now();
            run_awake(|| products(&weights_of, &h, &a, &m))?;
            prod.push(t.elapsed().as_secs_f64());
        }
        let prod = median(prod);
        // K/V read by the round's middle step: the prompt and what was decoded before it.
        let cached = (context + round * steps + steps / 2) as u64;
        let bound = (weights + cached * kv_per_token) as f64 / bw;
        let med = median(times);
        ratios.push(bound / med);
        println!(
            "round {round}: probe {:.1} GB/s, step {:.2} ms against a bound of {:.2} ms: {:.0} %; \
             products {:.2} ms, the rest {:.2} ms",
            bw / 1e9,
            med * 1e3,
            bound * 1e3,
            100.0 * bound / med,
            prod * 1e3,
            (med - prod) * 1e3
        );
    }
    println!(
        "median over {rounds} rounds: decode steps at {:.0} % of the bound",
        100.0 * median(ratios)
    );
    Ok(())
}
