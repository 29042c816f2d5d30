//! `kvbench run-cell`: one cell of an experiment in this process, its record as one JSON
//! object on stdout (the orchestrator runs one such process per cell; see `crate::cell`).

use crate::experiment::{Plan, SloSpec};
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
    let plan = Plan::load_with(&a.experiment, &a.models_dir, a.slo)?;
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
    let r = crate::cell::run_cell(&plan, cell, &a.models_dir, a.data_dir.as_deref())?;
    println!("{}", serde_json::to_string(&r)?);
    Ok(())
}
