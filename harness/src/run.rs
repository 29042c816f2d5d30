//! `kvbench run EXP.yaml`: parse and check an experiment, expand its matrix into cells.

use crate::experiment::{parse_shard, shard, Plan};
use anyhow::{bail, Result};
use clap::Args;

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
}

pub fn run(a: RunArgs) -> Result<()> {
    let plan = Plan::load(&a.experiment, &a.models_dir)?;
    let shard_sel = a.shard.as_deref().map(parse_shard).transpose()?;
    let cells = shard(&plan.cells, shard_sel);
    if !a.dry_run {
        bail!(
            "{}: {} cells are valid, but running them needs the orchestrator, which is not built yet; use --dry-run to list them",
            a.experiment.display(),
            cells.len()
        );
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
