#![allow(dead_code)]
use candle_core::Device;
use kvbench_engines::config::preset;
use kvbench_engines::engine::{Engine, EngineConfig, Request};
use kvbench_engines::model::load::load_preset;
use kvbench_engines::model::{Llama, WeightDtype};
use kvbench_engines::policy::infinigen::skew::calibrate;
use kvbench_engines::policy::spec::PolicySpec;
use std::path::PathBuf;
use std::sync::Arc;

pub fn tiny() -> Llama {
    load_preset(preset("tiny").unwrap(), WeightDtype::F32, 7, &Device::Cpu).unwrap()
}

/// The fetched SmolLM2 GGUF. Tests that need it fail (never skip) when it is missing.
pub fn smollm2_path() -> PathBuf {
    let dir = std::env::var_os("KVBENCH_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models"));
    let p = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.is_file(),
        "{} is missing: run `just fetch-model smollm2` first",
        p.display()
    );
    p
}

/// The greedy continuation of `prompt` through the engine: a pool of 600 blocks,
/// invariants checked.
pub fn engine_greedy(model: Llama, prompt: &[u32], max_new_tokens: usize) -> Vec<u32> {
    let cfg = EngineConfig {
        num_blocks: Some(600),
        check_invariants: true,
        ..Default::default()
    };
    let mut e = Engine::new(model, cfg).unwrap();
    e.add_request(Request::greedy(prompt.to_vec(), max_new_tokens))
        .unwrap();
    e.run().unwrap();
    e.finished()[0].output.clone()
}

/// Largest |a − b|; +∞ when any value is not finite (a NaN fails every tolerance).
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    kvbench_engines::compare::max_abs_diff(a.iter().copied().zip(b.iter().copied()))
}

pub fn lcg(seed: &mut u64) -> u64 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    *seed >> 33
}

/// `n` pseudo-random token ids of SmolLM2's vocabulary.
pub fn random_tokens(n: usize, seed: &mut u64) -> Vec<u32> {
    (0..n).map(|_| (lcg(seed) % 49_152) as u32).collect()
}

/// A strategy from its name and parameters; InfiniGen gets skewing calibrated on 96
/// seeded random tokens.
pub fn spec(model: &Llama, name: &str, budget: f64, params: &[(&str, &str)]) -> PolicySpec {
    let params: Vec<(String, String)> = params
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let mut s = PolicySpec::parse(name, budget, &params).unwrap();
    if s.needs_skewing() {
        let mut seed = 99;
        let cal = random_tokens(96, &mut seed);
        s.set_skewing(Arc::new(calibrate(model, &cal).unwrap()));
    }
    s
}
