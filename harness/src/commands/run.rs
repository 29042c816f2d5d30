//! `kvbench run EXP.yaml`: its arguments and handler: the dry-run listing, the tables
//! rebuilt from recorded cells, or the sweep itself (`crate::run`: child processes,
//! progress, atomic cell records).

use crate::experiment::{parse_shard, shard, Plan, SloSpec};
use crate::run::{print_tables, sweep, tidy_cells, ResultsLock};
use anyhow::{bail, Result};
use clap::Args;
use std::path::PathBuf;

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Experiment file (YAML), or a name under experiments/ (`cpu/quickstart`).
    pub experiment: std::path::PathBuf,

    /// List the cells the experiment expands into, without running them.
    #[arg(long)]
    pub dry_run: bool,

    /// Run only every n-th cell starting at i (`i/n`), to split a sweep over machines.
    #[arg(long)]
    pub shard: Option<String>,

    /// With --dry-run: print the cells as one JSON array.
    #[arg(long, requires = "dry_run")]
    pub json: bool,

    /// Directory of fetched weights (the model's config is read from it).
    #[arg(long, env = "KVBENCH_MODELS_DIR", default_value = "models")]
    pub models_dir: std::path::PathBuf,

    /// Re-run cells already recorded.
    #[arg(long)]
    pub force: bool,

    /// Keep cells recorded by another build of kvbench (other code: its `env.build`
    /// differs from this binary's) as this sweep's; by default they are run again, so
    /// a sweep resumed after a rebuild holds one build's cells.
    #[arg(long, conflicts_with = "force")]
    pub keep_other_builds: bool,

    /// Keep cells recorded on another processor (another GPU model, or CPU model for a
    /// CPU experiment: `env.gpu_name` / `env.cpu_model`) as this sweep's; by default
    /// they are run again, so a results directory carried between machines never holds
    /// one card's timings under another's.
    #[arg(long, conflicts_with = "force")]
    pub keep_other_processors: bool,

    /// Run nothing: rebuild the Parquet tables from the cells already recorded (after
    /// a sweep was stopped, or with cells gathered from several machines).
    #[arg(long, conflicts_with_all = ["dry_run", "force"])]
    pub tables_only: bool,

    /// Where results go: `<results>/<experiment name>/`.
    #[arg(long, env = "KVBENCH_RESULTS", default_value = "results")]
    pub results: PathBuf,

    /// Evaluation data directory (accuracy and retention experiments); default: the
    /// experiment's `data_dir`, else data/ (filled by `just fetch-data`).
    #[arg(long, env = "KVBENCH_DATASETS_DIR")]
    pub data_dir: Option<PathBuf>,

    /// Keep cells whose outcome is `error` (a crash) as recorded; by default the next
    /// run retries them (an `oom` is a result and is never retried).
    #[arg(long)]
    pub no_retry: bool,

    /// Move the files of cells/ that belong to no cell of this experiment (an older
    /// version of its YAML, another experiment) to pruned/ beside it.
    #[arg(long, conflicts_with = "dry_run")]
    pub prune: bool,

    /// Service-level objectives for goodput in milliseconds, in place of the YAML's
    /// `slo`: vLLM's `--goodput` keys, `ttft:500,tpot:50,e2e:2000` (`e2el` = `e2e`;
    /// any subset). They are part of every cell's identity.
    #[arg(long, value_name = "ttft:MS,tpot:MS,e2e:MS", value_parser = SloSpec::parse)]
    pub slo: Option<SloSpec>,

    /// Take cells recorded by kvbench before cell identities existed (files without
    /// an `id`) as this experiment's cells where their key matches one: only when you
    /// know they were run from this YAML, model and settings.
    #[arg(long, conflicts_with = "dry_run")]
    pub adopt_legacy: bool,
}

pub fn run(a: RunArgs) -> Result<()> {
    let plan = Plan::load_with(&a.experiment, &a.models_dir, a.slo)?;
    let shard_sel = a.shard.as_deref().map(parse_shard).transpose()?;
    let cells = shard(&plan.cells, shard_sel);
    if a.tables_only {
        let exp_dir = a.results.join(&plan.exp.name);
        if !exp_dir.join("cells").is_dir() {
            bail!(
                "{}: no recorded cells to build tables from",
                exp_dir.join("cells").display()
            );
        }
        let _lock = ResultsLock::take(&exp_dir)?;
        tidy_cells(&a, &plan, &exp_dir)?;
        return print_tables(&exp_dir, &plan, &a.experiment);
    }
    if !a.dry_run {
        return sweep(&a, &plan, &cells);
    }
    // The data a run would read, checked as the run checks it: said, not fatal, so
    // that a plan can be listed where its data is not (CI lists every shipped YAML).
    if plan.exp.kind != crate::experiment::Kind::Performance {
        let data_dir = plan.data_dir(a.data_dir.as_deref());
        match crate::run::check_data(&plan, &data_dir) {
            Ok(()) => eprintln!("evaluation data: {}", data_dir.display()),
            Err(e) => {
                eprintln!("warning: a run of this plan would stop before its first cell: {e:#}")
            }
        }
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
        "{}: experiment `{}`, model {} on {}, context {}, {} (+{} warm-up{}), {} repeat(s), seed {}",
        a.experiment.display(),
        e.name,
        e.model,
        e.device.name,
        plan.context,
        e.workload
            .as_ref()
            .map_or("no requests".into(), |w| w.describe()),
        e.warmup,
        e.warmup_tokens
            .map_or(String::new(), |t| format!(" of {t} tokens")),
        e.repeats,
        e.seed
    );
    if let Some(slo) = &e.slo {
        println!("SLO (ms) for goodput: {slo}");
    }
    println!(
        "{:>5}  {:<10} {:<22} {:>5} {:>18} {:>6} {:>6} {:<8} {:>5} {:>6} {:>5} {:>5} {:>3}",
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
        "conc",
        "rep"
    );
    for c in &cells {
        let params: Vec<String> = c.params.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let prompt = match (&c.prompt_len, &c.task, &c.bucket) {
            (Some(p), _, _) => serde_json::to_string(p)?,
            (None, Some(t), _) => format!("{t} {}", c.mode.map_or("", |m| m.name())),
            (None, None, Some(b)) => format!("retention {b}"),
            _ => "-".into(),
        };
        println!(
            "{:>5}  {:<10} {:<22} {:>5} {:>18} {:>6} {:>6} {:<8} {:>5} {:>6} {:>5} {:>5} {:>3}",
            c.index,
            c.engine,
            params.join(","),
            c.batch,
            prompt,
            c.output_len.map_or("-".into(), |o| o.to_string()),
            c.budget,
            c.attention,
            c.chunk_size.map_or("-".into(), |x| x.to_string()),
            c.request_rate,
            c.burstiness,
            c.max_concurrency.map_or("inf".into(), |x| x.to_string()),
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
