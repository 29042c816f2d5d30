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
//! This module holds the dispatch on the experiment's kind (the command's arguments are
//! in commands/run_cell.rs); each kind's
//! cell lives in its own file (`performance`, `accuracy`, `retention`) and everything
//! they share (model set-up, the engine, progress, the failure record) in `shared`, so
//! imports run one way: mod.rs → kinds → shared.

pub mod accuracy;
pub mod performance;
pub mod retention;
pub mod shared;

pub use shared::{parse_progress, progress_line, PROGRESS_ENV};

use crate::experiment::{Cell, Kind, Plan};
use anyhow::Result;
use std::path::Path;

/// Run one cell of `plan` by its kind and return its record (the JSON object `kvbench
/// run-cell` prints); `data_flag` is `--data-dir`, read by accuracy and retention cells.
pub fn run_cell(
    plan: &Plan,
    cell: &Cell,
    models_dir: &Path,
    data_flag: Option<&Path>,
) -> Result<serde_json::Value> {
    Ok(match plan.exp.kind {
        Kind::Performance => serde_json::to_value(performance::run_cell(plan, cell, models_dir)?)?,
        Kind::Accuracy => {
            let data = plan.data_dir(data_flag);
            accuracy::run_cell(plan, cell, models_dir, &data)?
        }
        Kind::Retention => {
            let data = plan.data_dir(data_flag);
            retention::run_cell(plan, cell, models_dir, &data)?
        }
    })
}
