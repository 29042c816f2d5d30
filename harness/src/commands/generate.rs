//! `kvbench generate`: one prompt through one engine, for sanity.

use crate::setup::{build_engine, load_model, EngineArgs, ModelArgs};
use anyhow::{bail, Context, Result};
use clap::Args;
use kvbench_engines::engine::Request;
use kvbench_engines::policy::budget::kvpress_compression_ratio;
use serde::Serialize;
use std::io::IsTerminal;

#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,

    #[command(flatten)]
    pub engine: EngineArgs,

    /// Prompt text.
    #[arg(long, short = 'p', conflicts_with = "prompt_file")]
    pub prompt: Option<String>,

    /// Read the prompt from a UTF-8 file.
    #[arg(long)]
    pub prompt_file: Option<std::path::PathBuf>,

    /// Tokens to generate (greedy).
    #[arg(long, short = 'n', default_value_t = 32)]
    pub max_new_tokens: usize,

    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,

    /// Print exactly one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
struct Output {
    text: String,
    model: String,
    engine: &'static str,
    /// Fraction of KV pairs kept (the study's convention).
    budget: f64,
    /// The same budget in kvpress's convention (fraction removed).
    kvpress_compression_ratio: f64,
    attention: String,
    chunk_size: usize,
    params: serde_json::Value,
    device: String,
    weights_dtype: String,
    prompt_tokens: usize,
    output_tokens: usize,
    finish_reason: kvbench_engines::trace::FinishReason,
    ttft_s: Option<f64>,
    decode_tok_s: Option<f64>,
    e2e_s: f64,
    /// KV bytes on the device held for this request's tokens.
    kv_device_bytes: u64,
    /// Most KV bytes the engine held on the device (for `full`, its whole pool).
    kv_pool_bytes: u64,
    /// KV bytes in the host tier for this request's tokens.
    kv_host_bytes: u64,
    /// Most KV bytes the engine held in host memory.
    kv_host_peak_bytes: u64,
    /// Bytes moved host→device and device→host over the run.
    h2d_bytes: u64,
    d2h_bytes: u64,
    weights_bytes: u64,
    activations_peak_bytes: u64,
    device_memory_bytes: Option<u64>,
    threads: usize,
    /// vLLM-style metrics of the run (TTFT, TPOT, ITL, E2E, throughputs) and the
    /// walltime breakdown from the step traces.
    metrics: crate::metrics::CellMetrics,
}

pub fn run(a: GenerateArgs) -> Result<()> {
    let prompt = match (&a.prompt, &a.prompt_file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => std::fs::read_to_string(f)
            .with_context(|| format!("reading --prompt-file {}", f.display()))?,
        (None, None) => bail!("give a prompt with --prompt TEXT or --prompt-file FILE"),
    };
    let setup = load_model(&a.model, &a.engine.device)?;
    let mut engine = build_engine(&setup, &a.engine, &a.model.models_dir)?;
    let tok = &setup.loaded.tokenizer;
    let ids = tok.encode(&prompt)?;
    let stop = if a.ignore_eos {
        vec![]
    } else {
        setup.loaded.model.cfg.eos_token_ids.clone()
    };
    engine.reset_clock();
    engine.add_request(Request {
        prompt: ids.clone(),
        max_new_tokens: a.max_new_tokens,
        arrival_s: 0.0,
        stop_tokens: stop,
        forced_output: vec![],
        record_logits: false,
    })?;
    engine.run()?;
    let r = engine
        .finished()
        .first()
        .context("the request did not finish")?;
    let mem = engine.memory();
    let out = Output {
        text: tok.decode(&r.output)?,
        model: setup.spec.clone(),
        engine: engine.policy().name(),
        budget: engine.config().policy.budget(),
        kvpress_compression_ratio: kvpress_compression_ratio(engine.config().policy.budget()),
        attention: engine.config().attention.to_string(),
        chunk_size: engine.config().chunk_size,
        params: engine.config().policy.params_json(),
        device: setup.device.to_string(),
        weights_dtype: setup.loaded.model.weight_dtype.to_string(),
        prompt_tokens: ids.len(),
        output_tokens: r.output.len(),
        finish_reason: r.finish_reason,
        ttft_s: r.ttft_s(),
        decode_tok_s: r.decode_tok_s(),
        e2e_s: r.finished_s - r.arrival_s,
        kv_device_bytes: r.kv_device_bytes,
        kv_pool_bytes: mem.kv_device,
        kv_host_bytes: r.kv_host_bytes,
        kv_host_peak_bytes: mem.kv_host,
        h2d_bytes: engine.traces().iter().map(|t| t.h2d_bytes).sum(),
        d2h_bytes: engine.traces().iter().map(|t| t.d2h_bytes).sum(),
        weights_bytes: mem.weights,
        activations_peak_bytes: mem.activations_peak,
        device_memory_bytes: engine.config().device_memory,
        threads: rayon_threads(),
        metrics: crate::metrics::compute(
            engine.finished(),
            engine.traces(),
            crate::metrics::Slo::default(),
            0.0,
        ),
    };
    if a.json {
        println!("{}", serde_json::to_string(&out)?);
        return Ok(());
    }
    let color = std::io::stdout().is_terminal();
    let dim = |s: &str| {
        if color {
            format!("\x1b[2m{s}\x1b[0m")
        } else {
            s.to_string()
        }
    };
    println!("{}{}", prompt, out.text);
    println!("{}", dim("---"));
    let f = |x: Option<f64>, unit: &str| x.map_or("n/a".into(), |v| format!("{v:.3} {unit}"));
    println!(
        "model     {} ({}, weights {})",
        out.model, setup.loaded.origin, out.weights_dtype
    );
    println!(
        "engine    {} on {} ({} threads), budget {}, {} attention",
        out.engine, out.device, out.threads, out.budget, out.attention
    );
    println!(
        "tokens    prompt {}, output {} ({:?})",
        out.prompt_tokens, out.output_tokens, out.finish_reason
    );
    println!("TTFT      {}", f(out.ttft_s, "s"));
    println!("decode    {}", f(out.decode_tok_s, "tok/s"));
    println!(
        "KV        device {} held for this request (engine peak {}), host {}",
        human(out.kv_device_bytes),
        human(out.kv_pool_bytes),
        human(out.kv_host_bytes)
    );
    if out.h2d_bytes > 0 {
        println!(
            "moved     {} host→device, {} device→host",
            human(out.h2d_bytes),
            human(out.d2h_bytes)
        );
    }
    println!("weights   {}", human(out.weights_bytes));
    if let Some(b) = &out.metrics.breakdown {
        println!(
            "walltime  prefill {:.3} s, decode {:.3} s, cache ops {:.3} s (transfers {:.3} s), scheduling {:.3} s",
            b.prefill_s, b.decode_compute_s, b.cache_ops_s, b.transfer_s, b.scheduling_s
        );
    }
    Ok(())
}

fn rayon_threads() -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

pub fn human(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = b as f64;
    let mut i = 0;
    while x >= 1024.0 && i + 1 < U.len() {
        x /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{x:.2} {}", U[i])
    }
}
