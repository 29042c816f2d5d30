//! `kvbench run EXP.yaml`: parse and check an experiment, expand its matrix into cells
//! and run each cell in a child process (`kvbench run-cell`), so that an out-of-memory
//! error, a panic or a device fault ends that cell, not the sweep. Each cell's result is
//! written atomically (temporary file, then rename) under `results/<name>/cells/`; a
//! sweep killed at any moment loses at most the cell in flight, and a re-run skips
//! cells already recorded under the same key unless `--force`.

use crate::experiment::{parse_shard, shard, Cell, Plan};
use anyhow::{Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::{Path, PathBuf};
use std::process::Command;
use xxhash_rust::xxh3::xxh3_64;

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Experiment file (YAML).
    pub experiment: std::path::PathBuf,

    /// List the cells the experiment expands into, without running them.
    #[arg(long)]
    pub dry_run: bool,

    /// Run only every n-th cell starting at i (`i/n`), to split a sweep over machines.
    #[arg(long)]
    pub shard: Option<String>,

    /// With --dry-run: print the cells as one JSON array.
    #[arg(long)]
    pub json: bool,

    /// Directory of fetched weights (the model's config is read from it).
    #[arg(long, env = "KVBENCH_MODELS_DIR", default_value = "models")]
    pub models_dir: std::path::PathBuf,

    /// Re-run cells already recorded.
    #[arg(long)]
    pub force: bool,

    /// Where results go: `<results>/<experiment name>/`.
    #[arg(long, env = "KVBENCH_RESULTS", default_value = "results")]
    pub results: PathBuf,
}

/// File of a cell's result: its index and a hash of its key.
fn cell_file(dir: &Path, c: &Cell) -> PathBuf {
    dir.join(format!(
        "{:05}-{:016x}.json",
        c.index,
        xxh3_64(c.key().as_bytes())
    ))
}

/// Whether `path` holds a result recorded for exactly this key.
fn recorded(path: &Path, key: &str) -> bool {
    std::fs::read(path)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .is_some_and(|v| v["key"] == key)
}

/// Write `bytes` to `path` through a temporary file in the same directory.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {} into place", tmp.display()))
}

/// Run one cell in a child process; a child that dies without a result is recorded
/// as an `error` with the end of its stderr.
fn run_child(exp: &Path, c: &Cell, models_dir: &Path) -> Result<serde_json::Value> {
    let exe = std::env::current_exe().context("locating the kvbench binary")?;
    let out = Command::new(exe)
        .arg("run-cell")
        .arg(exp)
        .arg("--cell")
        .arg(c.index.to_string())
        .arg("--models-dir")
        .arg(models_dir)
        .output()
        .context("starting kvbench run-cell")?;
    if out.status.success() {
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&out.stdout) {
            return Ok(v);
        }
    }
    let err = String::from_utf8_lossy(&out.stderr);
    let tail: String = err
        .chars()
        .rev()
        .take(2000)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    Ok(serde_json::json!({
        "key": c.key(),
        "cell": c,
        "outcome": "error",
        "error": format!("the cell's process ended with {}: {}", out.status, tail.trim()),
        "metrics": null,
    }))
}

pub fn run(a: RunArgs) -> Result<()> {
    let plan = Plan::load(&a.experiment, &a.models_dir)?;
    let shard_sel = a.shard.as_deref().map(parse_shard).transpose()?;
    let cells = shard(&plan.cells, shard_sel);
    if !a.dry_run {
        return sweep(&a, &plan, &cells);
    }
    if a.json {
        let rows: Vec<serde_json::Value> = cells
            .iter()
            .map(|c| {
                let mut v = serde_json::to_value(c)?;
                v["key"] = c.key().into();
                Ok(v)
            })
            .collect::<Result<_>>()?;
        println!("{}", serde_json::Value::Array(rows));
        return Ok(());
    }
    let e = &plan.exp;
    println!(
        "{}: experiment `{}`, model {} on {}, context {}, {} requests per cell (+{} warm-up), {} repeat(s), seed {}",
        a.experiment.display(),
        e.name,
        e.model,
        e.device.name,
        plan.context,
        e.workload.num_requests,
        e.warmup,
        e.repeats,
        e.seed
    );
    println!(
        "{:>5}  {:<10} {:<22} {:>5} {:>18} {:>6} {:>6} {:<8} {:>5} {:>6} {:>5} {:>3}",
        "cell",
        "engine",
        "params",
        "batch",
        "prompt",
        "output",
        "budget",
        "attn",
        "chunk",
        "rate",
        "burst",
        "rep"
    );
    for c in &cells {
        let params: Vec<String> = c.params.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let prompt = serde_json::to_string(&c.prompt_len)?;
        println!(
            "{:>5}  {:<10} {:<22} {:>5} {:>18} {:>6} {:>6} {:<8} {:>5} {:>6} {:>5} {:>3}",
            c.index,
            c.engine,
            params.join(","),
            c.batch,
            prompt,
            c.output_len,
            c.budget,
            c.attention,
            c.chunk_size.map_or("-".into(), |x| x.to_string()),
            c.request_rate,
            c.burstiness,
            c.repeat
        );
    }
    println!(
        "{} of {} cells{}",
        cells.len(),
        plan.cells.len(),
        a.shard.map_or(String::new(), |s| format!(" (shard {s})"))
    );
    Ok(())
}

fn sweep(a: &RunArgs, plan: &Plan, cells: &[&Cell]) -> Result<()> {
    let dir = a.results.join(&plan.exp.name).join("cells");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    // The experiment as run, next to its results.
    let spec = std::fs::read(&a.experiment)
        .with_context(|| format!("reading {}", a.experiment.display()))?;
    write_atomic(
        &a.results.join(&plan.exp.name).join("experiment.yaml"),
        &spec,
    )?;
    let bar = ProgressBar::new(cells.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} cells {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut rows = Vec::new();
    let (mut skipped, mut ran) = (0, 0);
    for c in cells {
        let path = cell_file(&dir, c);
        if !a.force && recorded(&path, &c.key()) {
            skipped += 1;
            bar.inc(1);
            let v = std::fs::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
            rows.extend(v);
            continue;
        }
        bar.set_message(format!(
            "cell {} {} b{} budget {}",
            c.index, c.engine, c.batch, c.budget
        ));
        let v = run_child(&a.experiment, c, &a.models_dir)?;
        write_atomic(&path, serde_json::to_string(&v)?.as_bytes())?;
        ran += 1;
        rows.push(v);
        bar.inc(1);
    }
    bar.finish_and_clear();
    println!(
        "{}: {} cells run, {} already recorded (under {})",
        plan.exp.name,
        ran,
        skipped,
        dir.display()
    );
    let exp_dir = a.results.join(&plan.exp.name);
    let counts = crate::recorder::write_tables(&exp_dir)?;
    println!(
        "tables in {}: {}",
        exp_dir.display(),
        counts
            .iter()
            .map(|(t, n)| format!("{t}.parquet ({n} rows)"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "{:>5}  {:<10} {:>5} {:>6} {:<8} {:<6} {:>10} {:>12} {:>10} {:>11} {:>11}",
        "cell",
        "engine",
        "batch",
        "budget",
        "attn",
        "result",
        "TTFT s",
        "decode tok/s",
        "E2E p50 s",
        "KV dev MiB",
        "RSS MiB"
    );
    let f = |v: &serde_json::Value| v.as_f64().map_or("-".to_string(), |x| format!("{x:.3}"));
    let mib = |v: &serde_json::Value| {
        v.as_f64()
            .map_or("-".to_string(), |x| format!("{:.1}", x / 1048576.0))
    };
    for v in &rows {
        let c = &v["cell"];
        let m = &v["metrics"];
        println!(
            "{:>5}  {:<10} {:>5} {:>6} {:<8} {:<6} {:>10} {:>12} {:>10} {:>11} {:>11}",
            c["index"].to_string(),
            c["engine"].as_str().unwrap_or("?"),
            c["batch"].to_string(),
            c["budget"].to_string(),
            c["attention"].as_str().unwrap_or("?"),
            v["outcome"].as_str().unwrap_or("?"),
            f(&m["ttft_s"]["mean"]),
            f(&m["decode_throughput"]),
            f(&m["e2e_s"]["p50"]),
            mib(&v["memory"]["kv_device"]),
            mib(&v["process_rss_peak_bytes"]),
        );
    }
    Ok(())
}
