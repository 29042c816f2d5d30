//! Decode tokens/s of SmolLM2-135M-Instruct (the Q4_1 GGUF) at batch 1 and 16 after a
//! 512-token prompt: kvbench's engine (`full`, paged) against candle-transformers' own
//! quantized llama on the same file, in the same run.
//!
//! `f32`: weights dequantized on both sides (candle via `CANDLE_DEQUANTIZE_ALL`);
//! `q4_1`: weights kept quantized, batch 1 only (a 16×512 Q4_1 prefill takes minutes on
//! CPUs without a fast Q4_1 kernel). One iteration = one decode step of the whole batch;
//! criterion's elements/s is tokens/s. The context grows by one token per iteration
//! from 512 during measurement. Run: `just bench` (set RAYON_NUM_THREADS to pin threads).

mod common;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvbench_engines::engine::{argmax_rows, Engine, EngineConfig, Request, StepOutcome};
use kvbench_engines::model::load::{load_gguf, GgufFile};
use kvbench_engines::model::WeightDtype;
use std::path::PathBuf;
use std::time::{Duration, Instant};

const PROMPT: usize = 512;

fn gguf() -> PathBuf {
    let dir = std::env::var_os("KVBENCH_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models"));
    let p = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.is_file(),
        "{} missing: run `just fetch-model smollm2`",
        p.display()
    );
    p
}

fn prompt(seed: u64) -> Vec<u32> {
    common::seeded_tokens(PROMPT, seed)
}

/// Our engine with `batch` sequences prefilled, ready to decode.
fn ours(wd: WeightDtype, batch: usize) -> Engine {
    let file = GgufFile::open(&gguf()).unwrap();
    let model = load_gguf(&file, wd, &Device::Cpu).unwrap();
    let cfg = EngineConfig {
        num_blocks: Some(batch * 8192 / 16),
        max_model_len: Some(8192),
        ..Default::default()
    };
    let mut e = Engine::new(model, cfg).unwrap();
    for b in 0..batch {
        e.add_request(Request {
            prompt: prompt(b as u64),
            max_new_tokens: 8192 - PROMPT,
            arrival_s: 0.0,
            stop_tokens: vec![],
            forced_output: vec![],
            record_logits: false,
        })
        .unwrap();
    }
    // Prefill everything: step until a step decodes all sequences.
    loop {
        match e.step().unwrap() {
            StepOutcome::Ran(t) if t.num_decode_tokens == batch => break,
            StepOutcome::Ran(_) => {}
            other => panic!("{other:?}"),
        }
    }
    e
}

/// candle's model with `batch` copies... of distinct prompts prefilled; returns the model,
/// the next input tokens and the next position.
fn theirs(batch: usize, dequantize: bool) -> (ModelWeights, Vec<u32>, usize) {
    let load = move || {
        let p = gguf();
        let mut f = std::fs::File::open(&p).unwrap();
        let ct = gguf_file::Content::read(&mut f).unwrap();
        ModelWeights::from_gguf(ct, &mut f, &Device::Cpu).unwrap()
    };
    let mut m = if dequantize {
        // candle reads the variable once per thread: load on a fresh thread.
        std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
        let m = std::thread::spawn(load).join().unwrap();
        std::env::remove_var("CANDLE_DEQUANTIZE_ALL");
        m
    } else {
        load()
    };
    let ids: Vec<u32> = (0..batch).flat_map(|b| prompt(b as u64)).collect();
    let x = Tensor::from_vec(ids, (batch, PROMPT), &Device::Cpu).unwrap();
    let l = m.forward(&x, 0).unwrap();
    (m, argmax_rows(&l).unwrap(), PROMPT)
}

// Setup runs lazily inside the benchmark so a filtered-out benchmark costs nothing.

fn bench_ours(c: &mut Criterion, group: &str, wd: WeightDtype, batch: usize) {
    let mut state = None;
    let mut g = c.benchmark_group(group);
    g.throughput(Throughput::Elements(batch as u64));
    g.bench_function(format!("kvbench/batch{batch}"), |b| {
        let e = state.get_or_insert_with(|| ours(wd, batch));
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                e.step().unwrap();
            }
            t.elapsed()
        })
    });
    g.finish();
}

fn bench_theirs(c: &mut Criterion, group: &str, dequantize: bool, batch: usize) {
    let mut state = None;
    let mut g = c.benchmark_group(group);
    g.throughput(Throughput::Elements(batch as u64));
    g.bench_function(format!("candle_quantized_llama/batch{batch}"), |b| {
        let (m, next, pos) = state.get_or_insert_with(|| theirs(batch, dequantize));
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                let x = Tensor::from_vec(next.clone(), (batch, 1), &Device::Cpu).unwrap();
                let l = m.forward(&x, *pos).unwrap();
                *next = argmax_rows(&l).unwrap();
                *pos += 1;
            }
            t.elapsed()
        })
    });
    g.finish();
}

fn decode(c: &mut Criterion) {
    for batch in [1, 16] {
        bench_ours(c, "decode_f32", WeightDtype::F32, batch);
        bench_theirs(c, "decode_f32", true, batch);
    }
    bench_ours(c, "decode_q4_1", WeightDtype::Quantized, 1);
    bench_theirs(c, "decode_q4_1", false, 1);
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(10));
    targets = decode
}
criterion_main!(benches);
