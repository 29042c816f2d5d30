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
/// The build of kvbench that measured the cell (a hash of its sources; absent from
/// tables written before it was recorded, null for cells recorded before builds were).
pub const ENV_BUILD: &str = "env_build";
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

// The metric columns of `runs.parquet` (one row per cell) that more than one reader
// uses, named after the column; docs/metrics.md defines each.

/// Mean time to first token, seconds.
pub const TTFT_MEAN_S: &str = "ttft_mean_s";
/// 99th percentile of the time to first token, seconds.
pub const TTFT_P99_S: &str = "ttft_p99_s";
/// Mean time per output token after the first, seconds.
pub const TPOT_MEAN_S: &str = "tpot_mean_s";
/// 99th percentile of the inter-token latency, seconds.
pub const ITL_P99_S: &str = "itl_p99_s";
/// Mean end-to-end request latency, seconds.
pub const E2E_MEAN_S: &str = "e2e_mean_s";
/// Decode throughput, tokens/s.
pub const DECODE_TOK_S: &str = "decode_tok_s";
/// Output tokens over the cell's duration, tokens/s.
pub const THROUGHPUT_TOK_S: &str = "throughput_tok_s";
/// Decode throughput per GB (10⁹ B) of the engine's device memory: weights + device KV
/// + activation peak (ledger bytes).
pub const DECODE_TOK_S_PER_GB: &str = "decode_tok_s_per_gb";
/// Output tokens in the busiest second, tokens/s.
pub const PEAK_OUTPUT_TOK_S: &str = "peak_output_tok_s";
/// Requests per second meeting every service-level objective.
pub const GOODPUT_REQ_S: &str = "goodput_req_s";
/// The TTFT objective, milliseconds (null when not set).
pub const SLO_TTFT_MS: &str = "slo_ttft_ms";
/// The TPOT objective, milliseconds (null when not set).
pub const SLO_TPOT_MS: &str = "slo_tpot_ms";
/// The end-to-end objective, milliseconds (null when not set).
pub const SLO_E2E_MS: &str = "slo_e2e_ms";
/// Walltime in prefill, seconds.
pub const WALL_PREFILL_S: &str = "wall_prefill_s";
/// Walltime in decode compute, seconds.
pub const WALL_DECODE_S: &str = "wall_decode_s";
/// Walltime in cache operations (eviction, offload, transfers), seconds.
pub const WALL_CACHE_OPS_S: &str = "wall_cache_ops_s";
/// The ledger's weight bytes.
pub const MEM_WEIGHTS_BYTES: &str = "mem_weights_bytes";
/// The device KV the engine held at its peak (its whole pool under `reservation=fraction`,
/// what the pool grew to under `budget`).
pub const MEM_KV_DEVICE_BYTES: &str = "mem_kv_device_bytes";
/// How the device KV was reserved: `fraction` or `budget`.
pub const MEM_KV_RESERVATION: &str = "mem_kv_reservation";
/// How the paged stores kept their rows (`f32`, `bf16`, `int4`, …).
pub const MEM_KV_CODEC: &str = "mem_kv_codec";
/// Device KV bytes the sequences held at the busiest step.
pub const MEM_KV_DEVICE_USED_PEAK_BYTES: &str = "mem_kv_device_used_peak_bytes";
/// The ledger's host KV bytes (offload).
pub const MEM_KV_HOST_BYTES: &str = "mem_kv_host_bytes";
/// The ledger's activation peak, bytes.
pub const MEM_ACTIVATIONS_PEAK_BYTES: &str = "mem_activations_peak_bytes";
/// Observed device memory peak (NVML), bytes.
pub const MEM_DEVICE_PEAK_BYTES: &str = "mem_device_peak_bytes";
/// Observed process RSS peak, bytes.
pub const MEM_HOST_PEAK_BYTES: &str = "mem_host_peak_bytes";
/// The measured window's duration, seconds (flattened from the cell's metrics).
pub const METRICS_DURATION_S: &str = "metrics_duration_s";
/// Walltime in scheduling, seconds.
pub const METRICS_BREAKDOWN_SCHEDULING_S: &str = "metrics_breakdown_scheduling_s";
/// Walltime in sampling, seconds.
pub const METRICS_BREAKDOWN_SAMPLING_S: &str = "metrics_breakdown_sampling_s";
/// Walltime in host–device transfers, seconds.
pub const METRICS_BREAKDOWN_TRANSFER_S: &str = "metrics_breakdown_transfer_s";
/// Measured requests of the cell.
pub const METRICS_NUM_REQUESTS: &str = "metrics_num_requests";

/// The metric columns of `runs.parquet` the figures read (all as f64).
pub const METRICS: &[&str] = &[
    TTFT_MEAN_S,
    TTFT_P99_S,
    TPOT_MEAN_S,
    E2E_MEAN_S,
    DECODE_TOK_S,
    THROUGHPUT_TOK_S,
    DECODE_TOK_S_PER_GB,
    WALL_PREFILL_S,
    WALL_DECODE_S,
    WALL_CACHE_OPS_S,
    MEM_WEIGHTS_BYTES,
    MEM_KV_DEVICE_BYTES,
    MEM_KV_HOST_BYTES,
    MEM_ACTIVATIONS_PEAK_BYTES,
    MEM_DEVICE_PEAK_BYTES,
    MEM_HOST_PEAK_BYTES,
    METRICS_DURATION_S,
    METRICS_BREAKDOWN_SCHEDULING_S,
    METRICS_BREAKDOWN_SAMPLING_S,
    METRICS_BREAKDOWN_TRANSFER_S,
    METRICS_NUM_REQUESTS,
];

/// `df`, read from `path`, as an experiment's runs table: it names its cells, their
/// outcomes and engines (another table under this name, steps.parquet say, would give
/// empty rows and figures).
pub fn check_runs_table(df: &DataFrame, path: &Path) -> Result<(), Error> {
    for column in [CELL_KEY, "outcome", "engine"] {
        if df.column(column).is_err() {
            return Err(Error::NotThatTable {
                path: path.to_path_buf(),
                kind: "an experiment's runs table",
                column,
            });
        }
    }
    Ok(())
}

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
