//! `kvbench run-cell`: one cell of an experiment in this process: its workload (prompts
//! of exact token length, arrival times), one engine, the measured requests after the
//! warm-up ones, and one JSON object on stdout with the outcome (`ok`, `oom`, `error`)
//! and the metrics. The orchestrator runs each cell in its own process so that an
//! out-of-memory error, a panic or a device fault ends the cell, not the sweep.
//!
//! With `KVBENCH_PROGRESS=1` in its environment (the orchestrator sets it) the cell
//! also reports its progress on stderr, at most every 100 ms, as lines
//! `kvbench-progress tokens=N total=M`: N tokens the engine has computed (prefill and
//! decode) of the M its requests need (Σ prompt + output − 1, warm-up included).
//!
//! This module holds the command and the dispatch on the experiment's kind; each kind's
//! cell lives in its own file (`performance`, `accuracy`, `retention`) and everything
//! they share (model set-up, the engine, progress, the failure record) in `shared`, so
//! imports run one way: mod.rs → kinds → shared.

pub mod accuracy;
pub mod performance;
pub mod retention;
pub mod shared;

#[cfg(test)]
pub use shared::progress_line;
pub use shared::{parse_progress, PROGRESS_ENV};

use crate::experiment::{Kind, SloSpec};
use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;

#[derive(Debug, Args)]
pub struct RunCellArgs {
    /// Experiment file (YAML).
    pub experiment: PathBuf,

    /// Index of the cell (as `kvbench run EXP --dry-run` lists them).
    #[arg(long)]
    pub cell: usize,

    /// The identity of the cell to run (the orchestrator passes it; `--cell` then only
    /// names it in messages): when the YAML no longer has a cell of this identity, the
    /// run is refused with exit status 3 instead of running something else.
    #[arg(long)]
    pub id: Option<String>,

    /// Directory of fetched weights.
    #[arg(long, env = "KVBENCH_MODELS_DIR", default_value = "models")]
    pub models_dir: PathBuf,

    /// Evaluation data directory (accuracy and retention cells); default: the
    /// experiment's `data_dir`, else data/ (filled by `just fetch-data`).
    #[arg(long, env = "KVBENCH_DATASETS_DIR")]
    pub data_dir: Option<PathBuf>,

    /// Service-level objectives in place of the YAML's, as `kvbench run --slo`.
    #[arg(long, value_name = "ttft:MS,tpot:MS,e2e:MS", value_parser = SloSpec::parse)]
    pub slo: Option<SloSpec>,
}

pub fn run(a: RunCellArgs) -> Result<()> {
    let plan = crate::experiment::Plan::load_with(&a.experiment, &a.models_dir, a.slo)?;
    let cell = match a.id.as_deref() {
        // By identity: the index only says where it was when the sweep started.
        Some(id) => match plan.cells.iter().find(|c| c.id == id) {
            Some(c) => c,
            None => {
                eprintln!(
                    "{}: no cell has the identity {id} the sweep asked for (cell {}): the \
                     experiment changed while the sweep ran",
                    a.experiment.display(),
                    a.cell
                );
                std::process::exit(crate::run::EXIT_STALE_CELL);
            }
        },
        None => plan.cells.get(a.cell).with_context(|| {
            format!(
                "--cell {}: {} has cells 0..{}",
                a.cell,
                a.experiment.display(),
                plan.cells.len()
            )
        })?,
    };
    let r = match plan.exp.kind {
        Kind::Performance => {
            serde_json::to_value(performance::run_cell(&plan, cell, &a.models_dir)?)?
        }
        Kind::Accuracy => {
            let data = plan.data_dir(a.data_dir.as_deref());
            accuracy::run_cell(&plan, cell, &a.models_dir, &data)?
        }
        Kind::Retention => {
            let data = plan.data_dir(a.data_dir.as_deref());
            retention::run_cell(&plan, cell, &a.models_dir, &data)?
        }
    };
    println!("{}", serde_json::to_string(&r)?);
    Ok(())
}
