//! `kvbench models`: every preset and named model with its architecture.

use anyhow::Result;
use clap::Args;
use kvbench_engines::config::{preset, ModelConfig, PRESETS};
use kvbench_engines::model::load::GgufFile;
use kvbench_engines::source::{ModelSource, NAMED_MODELS};
use serde::Serialize;

#[derive(Debug, Args)]
pub struct ModelsArgs {
    /// Directory of fetched weights.
    #[arg(long, env = "KVBENCH_MODELS_DIR", default_value = "models")]
    pub models_dir: std::path::PathBuf,

    /// Print a JSON array instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
struct Row {
    model: String,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    vocab: usize,
    context: usize,
    params: u64,
    kv_bytes_per_token_bf16: u64,
    weights: String,
}

fn row(name: String, c: &ModelConfig, weights: String) -> Row {
    Row {
        model: name,
        layers: c.num_layers,
        heads: c.num_heads,
        kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
        vocab: c.vocab_size,
        context: c.max_position_embeddings,
        params: c.num_params(),
        kv_bytes_per_token_bf16: c.kv_bytes_per_token(2),
        weights,
    }
}

pub fn run(a: ModelsArgs) -> Result<()> {
    let mut rows = Vec::new();
    for m in NAMED_MODELS {
        let path = ModelSource::named_path(m, &a.models_dir);
        // Same architecture as the preset of the same family, where the file cannot say.
        let family = || preset("smollm2-135m").expect("preset exists");
        let (cfg, status) = if path.is_file() {
            // A broken file is this row's problem, not the listing's.
            match GgufFile::open(&path).and_then(|g| g.config()) {
                Ok(c) => (c, format!("{} (fetched)", path.display())),
                Err(e) => (
                    family(),
                    format!(
                        "{} is not readable ({e}): run `{}` again",
                        path.display(),
                        m.fetch
                    ),
                ),
            }
        } else {
            (family(), format!("not fetched: run `{}`", m.fetch))
        };
        rows.push(row(
            m.name.to_string(),
            &cfg,
            format!("{}; {status}", m.origin),
        ));
    }
    for p in PRESETS {
        let c = preset(p).expect("listed presets exist");
        rows.push(row(
            format!("preset:{p}"),
            &c,
            "seeded random weights".into(),
        ));
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!(
        "{:<24} {:>6} {:>5} {:>8} {:>8} {:>7} {:>8} {:>9} {:>10}  weights",
        "model",
        "layers",
        "heads",
        "kv_heads",
        "head_dim",
        "vocab",
        "context",
        "params",
        "KV/token"
    );
    for r in rows {
        println!(
            "{:<24} {:>6} {:>5} {:>8} {:>8} {:>7} {:>8} {:>9} {:>10}  {}",
            r.model,
            r.layers,
            r.heads,
            r.kv_heads,
            r.head_dim,
            r.vocab,
            r.context,
            format_params(r.params),
            crate::commands::generate::human(r.kv_bytes_per_token_bf16),
            r.weights
        );
    }
    println!("\nKV/token: K and V of all layers in bf16. Named models also accept a path: --model FILE.gguf | DIR | hf:ORG/NAME[@REV].");
    Ok(())
}

fn format_params(p: u64) -> String {
    if p >= 1_000_000_000 {
        format!("{:.2}B", p as f64 / 1e9)
    } else {
        format!("{:.1}M", p as f64 / 1e6)
    }
}
