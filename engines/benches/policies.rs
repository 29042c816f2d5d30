//! One decode step of each strategy at budget 0.3, batch 16, 2K-token prompts, on the
//! SmolLM2-135M architecture with seeded random f32 weights (`preset:smollm2-135m`:
//! speed depends on shapes, not trained values). One iteration = one decode step of
//! the whole batch; criterion's elements/s is tokens/s. After each strategy the mean
//! split of a step from the engine's own traces is printed: compute, cache operations
//! (H2O's score bookkeeping and eviction, InfiniGen's speculation, gathers and
//! transfers) and bytes moved.
//!
//! InfiniGen runs with `relative_to_current` (k_max = ⌈0.3·n⌉ of the current length)
//! so its budget does not depend on how many tokens the bench decodes.
//!
//! `KVBENCH_BENCH_PROMPT` and `KVBENCH_BENCH_BATCH` shrink the setup (the prefill of
//! 16 × 2K tokens takes minutes on a laptop CPU). Run: `just bench policies`.

mod common;

use candle_core::Device;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvbench_engines::attention::prefill::AttentionImpl;
use kvbench_engines::config::preset;
use kvbench_engines::engine::{Engine, EngineConfig, Request, StepOutcome};
use kvbench_engines::model::load::load_preset;
use kvbench_engines::model::{Llama, WeightDtype};
use kvbench_engines::policy::infinigen::skew::calibrate;
use kvbench_engines::policy::registry::registry;
use kvbench_engines::policy::spec::PolicySpec;
use kvbench_engines::scheduler::{PrefillMode, SchedulerConfig};
use std::sync::Arc;
use std::time::Duration;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// An engine running `spec` with `batch` prompts prefilled (one at a time, as the
/// study ran H2O and InfiniGen), ready to decode.
fn engine(model: &Llama, spec: PolicySpec, batch: usize, prompt: usize) -> Engine {
    let max_len = prompt + 4096;
    let cfg = EngineConfig {
        num_blocks: Some(batch * max_len.div_ceil(16) + 16),
        host_memory: Some((batch * max_len * 30 * 2 * 3 * 64 * 4 * 2) as u64),
        max_model_len: Some(max_len),
        policy: spec,
        attention: AttentionImpl::Flash,
        scheduler: SchedulerConfig {
            max_num_seqs: batch,
            max_batched_tokens: prompt,
            prefill: PrefillMode::Sequential,
        },
        ..Default::default()
    };
    let mut e = Engine::new(model.clone(), cfg).unwrap();
    for b in 0..batch {
        e.add_request(Request::greedy(
            common::seeded_tokens(prompt, b as u64),
            max_len - prompt,
        ))
        .unwrap();
    }
    loop {
        match e.step().unwrap() {
            StepOutcome::Ran(t) if t.num_decode_tokens == batch => break,
            StepOutcome::Ran(_) => {}
            other => panic!("{other:?}"),
        }
    }
    e
}

fn bench(c: &mut Criterion) {
    let prompt = env("KVBENCH_BENCH_PROMPT", 2048);
    let batch = env("KVBENCH_BENCH_BATCH", 16);
    let model = load_preset(
        preset("smollm2-135m").unwrap(),
        WeightDtype::F32,
        0,
        &Device::Cpu,
    )
    .unwrap();
    let skew = Arc::new(calibrate(&model, &common::seeded_tokens(256, 99)).unwrap());
    let mut g = c.benchmark_group(format!("decode_step_b{batch}_p{prompt}_budget0.3"));
    g.throughput(Throughput::Elements(batch as u64))
        .sample_size(10)
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(10));
    for strategy in registry() {
        let name = strategy.name;
        let budget = if strategy.budgeted { 0.3 } else { 1.0 };
        let params: Vec<(String, String)> = strategy
            .bench
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let mut spec = PolicySpec::parse(name, budget, &params).unwrap();
        if spec.needs_skewing() {
            spec.set_skewing(skew.clone());
        }
        let mut e: Option<Engine> = None;
        g.bench_function(name, |b| {
            let e = e.get_or_insert_with(|| engine(&model, spec.clone(), batch, prompt));
            b.iter(|| e.step().unwrap())
        });
        if let Some(e) = e {
            let steps: Vec<_> = e
                .traces()
                .iter()
                .filter(|t| t.num_decode_tokens == batch && t.num_prefill_tokens == 0)
                .collect();
            let n = steps.len().max(1) as f64;
            let mean = |f: &dyn Fn(&kvbench_engines::trace::StepTrace) -> f64| {
                steps.iter().map(|t| f(t)).sum::<f64>() / n
            };
            eprintln!(
                "{name:<10} per decode step: compute {:.1} ms, cache ops {:.1} ms (transfers {:.1} ms), h2d {:.2} MB, attended {:.0}% of context",
                1e3 * mean(&|t| t.compute_s),
                1e3 * mean(&|t| t.cache_ops_s),
                1e3 * mean(&|t| t.transfer_s),
                mean(&|t| t.h2d_bytes as f64) / 1e6,
                100.0 * mean(&|t| t.attended_tokens.unwrap_or(0) as f64)
                    / mean(&|t| t.context_tokens.unwrap_or(1) as f64),
            );
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
