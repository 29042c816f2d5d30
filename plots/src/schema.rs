//! The Parquet tables `kvbench run` writes into `results/<experiment>/` and the column
//! names more than one reader uses: the recorder, `kvbench compare` and `kvbench
//! report` (in the harness, which depends on this crate) and the figures here. One
//! place, so that a renamed column is renamed for every reader.

use crate::Error;
use polars::prelude::{DataFrame, ParquetReader, SerReader};
use std::path::Path;

/// One row per cell: its parameters, outcome, metrics, memory and environment.
pub const RUNS: &str = "runs";
/// One row per measured request.
pub const REQUESTS: &str = "requests";
/// One row per engine step.
pub const STEPS: &str = "steps";
/// The memory time series.
pub const SAMPLES: &str = "samples";
/// One row per scored item of accuracy and retention cells (written only where
/// accuracy was measured).
pub const ACCURACY: &str = "accuracy";
/// Every table, in the order the recorder writes them.
pub const TABLES: [&str; 5] = [RUNS, REQUESTS, STEPS, SAMPLES, ACCURACY];

/// `runs.parquet`.
pub const RUNS_FILE: &str = "runs.parquet";
/// `accuracy.parquet`.
pub const ACCURACY_FILE: &str = "accuracy.parquet";

/// The file a table is written to (`runs` → `runs.parquet`).
pub fn file_name(table: &str) -> String {
    format!("{table}.parquet")
}

/// The experiment's name, in every row of runs.parquet.
pub const EXPERIMENT: &str = "experiment";
/// What the cell's own fields are prefixed with in runs.parquet (`cell_batch`, ...).
pub const CELL_PREFIX: &str = "cell_";
/// The cell's identity (a hash of everything that can change its result).
pub const CELL_ID: &str = "cell_id";
/// The cell's position in the plan's expansion.
pub const CELL_INDEX: &str = "cell_index";
/// The cell's readable key (`engine=h2o;params=...;repeat=0`).
pub const CELL_KEY: &str = "cell_key";
/// A hash of everything that defines the cell but its repeat.
pub const CELL_POINT: &str = "cell_point";
/// The cell's repeat.
pub const CELL_REPEAT: &str = "cell_repeat";
/// `true` for a cell the cost model predicted (`kvbench predict`), `false` for one
/// measured.
pub const PREDICTED: &str = "predicted";

/// The metric columns of `runs.parquet` the figures read (all as f64).
pub const METRICS: &[&str] = &[
    "ttft_mean_s",
    "ttft_p99_s",
    "tpot_mean_s",
    "e2e_mean_s",
    "decode_tok_s",
    "throughput_tok_s",
    "decode_tok_s_per_gb",
    "wall_prefill_s",
    "wall_decode_s",
    "wall_cache_ops_s",
    "mem_weights_bytes",
    "mem_kv_device_bytes",
    "mem_kv_host_bytes",
    "mem_activations_peak_bytes",
    "mem_device_peak_bytes",
    "mem_host_peak_bytes",
    "metrics_duration_s",
    "metrics_breakdown_scheduling_s",
    "metrics_breakdown_sampling_s",
    "metrics_breakdown_transfer_s",
    "metrics_num_requests",
];

/// Read one table (the one Parquet reader of the figures; the harness wraps its errors
/// in its own messages).
pub fn read_table(path: &Path) -> Result<DataFrame, Error> {
    let f = std::fs::File::open(path).map_err(|e| Error::Parquet {
        path: path.to_path_buf(),
        msg: e.to_string(),
    })?;
    ParquetReader::new(f).finish().map_err(|e| Error::Parquet {
        path: path.to_path_buf(),
        msg: e.to_string(),
    })
}
