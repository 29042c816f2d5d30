//! The tables a report reads: runs.parquet as [`Run`]s (one per cell, or per point
//! with the repeats averaged), accuracy.parquet, and the figure files.

use anyhow::Result;
use kvbench_plots::schema;
use kvbench_plots::AccRow;
use polars::prelude::DataFrame;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One cell of runs.parquet (its headline columns and identity), or a point: the mean of
/// the repeats of one cell (`points`).
#[derive(Debug, Clone, Default)]
pub struct Run {
    pub engine: String,
    /// The strategy's parameters as the cell key writes them (empty when none):
    /// engines with different parameters are different rows.
    pub params: String,
    pub attention: String,
    pub batch: Option<f64>,
    pub prompt_len: String,
    pub output_len: Option<f64>,
    pub budget: Option<f64>,
    pub outcome: String,
    pub ttft_mean_s: Option<f64>,
    pub e2e_mean_s: Option<f64>,
    pub decode_tok_s: Option<f64>,
    pub decode_tok_s_per_gb: Option<f64>,
    pub mem_weights_bytes: Option<f64>,
    pub mem_kv_device_bytes: Option<f64>,
    pub mem_activations_peak_bytes: Option<f64>,
    pub mem_kv_host_bytes: Option<f64>,
    pub mem_host_peak_bytes: Option<f64>,
    /// KV bytes the sequences held at the busiest step (≤ the reserved pool).
    pub mem_kv_device_used_peak_bytes: Option<f64>,
    /// How the device KV was reserved (`fraction`, `budget`); `None` in tables written
    /// before it was recorded, where every CUDA engine reserved the fraction.
    pub mem_kv_reservation: Option<String>,
    /// Requests per second meeting every SLO; null without SLOs.
    pub goodput_req_s: Option<f64>,
    /// The SLOs of the cell's goodput, ms (null: not set).
    pub slo_ttft_ms: Option<f64>,
    pub slo_tpot_ms: Option<f64>,
    pub slo_e2e_ms: Option<f64>,
    /// Bytes copied host → device over the cell (InfiniGen's selected rows; 0 for
    /// engines that move none).
    pub h2d_bytes: Option<f64>,
    /// Output tokens of the cell's measured requests.
    pub output_tokens: Option<f64>,
    /// The walltime breakdown: seconds the compute waited for transfers, in cache
    /// operations, and in all six parts together (null unless every part is recorded).
    pub transfer_s: Option<f64>,
    pub cache_ops_s: Option<f64>,
    pub busy_s: Option<f64>,
    /// Seconds of decode forwards (the breakdown's `decode_compute_s`): a zero-copy
    /// transfer reads host memory inside them, so the host link's rate over the decode
    /// is `h2d_bytes` over these plus `transfer_s`.
    pub decode_compute_s: Option<f64>,
    /// The cell's identity columns (`cell_*` without the prefix; null as ""), less the
    /// repeat and the row's bookkeeping (index, id, key).
    pub cell: BTreeMap<String, String>,
    /// `cell_point` where the table records it: a hash of everything that defines the
    /// cell but its repeat.
    pub point: Option<String>,
}

impl Run {
    pub(crate) fn label(&self) -> String {
        if self.params.is_empty() {
            self.engine.clone()
        } else {
            format!("{} {}", self.engine, self.params)
        }
    }

    pub(crate) fn ok(&self) -> bool {
        self.outcome == "ok"
    }

    pub(crate) fn prompt(&self) -> Option<f64> {
        self.prompt_len.parse().ok()
    }

    /// Device memory the engine held (ledger: weights, device KV, activation peak).
    pub(crate) fn device_bytes(&self) -> Option<f64> {
        Some(self.mem_weights_bytes? + self.mem_kv_device_bytes? + self.mem_activations_peak_bytes?)
    }

    /// Device memory the strategy needed: the KV it held rather than a pool reserved
    /// up front (CUDA reserves one for every strategy); the ledger's where not recorded.
    pub(crate) fn needed_device_bytes(&self) -> Option<f64> {
        match self.mem_kv_device_used_peak_bytes {
            Some(kv) => Some(self.mem_weights_bytes? + kv + self.mem_activations_peak_bytes?),
            None => self.device_bytes(),
        }
    }

    /// Device memory the engine held as its paradigm reserves it: the ledger's where the
    /// table records the reservation (each engine then reserves as its paradigm does);
    /// in older tables, where every CUDA engine reserved the fraction, what it needed
    /// (read as before).
    pub(crate) fn held_device_bytes(&self) -> Option<f64> {
        match self.mem_kv_reservation {
            Some(_) => self.device_bytes(),
            None => self.needed_device_bytes(),
        }
    }

    /// Decode throughput per GB of [`Run::held_device_bytes`].
    pub(crate) fn held_tok_s_per_gb(&self) -> Option<f64> {
        if self.mem_kv_reservation.is_some() {
            return self.decode_tok_s_per_gb;
        }
        match (self.decode_tok_s, self.needed_device_bytes()) {
            (Some(t), Some(b)) if b > 0.0 => Some(t / (b / 1e9)),
            _ => self.decode_tok_s_per_gb,
        }
    }

    /// Everything that defines the cell but its repeat, by field name.
    pub(crate) fn fields(&self) -> BTreeMap<String, String> {
        let num = |x: Option<f64>| x.map_or(String::new(), |x| x.to_string());
        let mut m = self.cell.clone();
        for (k, v) in [
            ("engine", self.engine.clone()),
            ("params", self.params.clone()),
            ("attention", self.attention.clone()),
            ("batch", num(self.batch)),
            ("prompt_len", self.prompt_len.clone()),
            ("output_len", num(self.output_len)),
            ("budget", num(self.budget)),
        ] {
            m.insert(k.to_string(), v);
        }
        m
    }

    /// The point this row is a repeat of: `cell_point` where recorded, else its fields.
    pub(crate) fn point_key(&self) -> String {
        match &self.point {
            Some(p) => format!("cell_point={p}"),
            None => join(&self.fields(), |_| true),
        }
    }

    /// A performance cell: accuracy and retention cells have a task or a bucket.
    pub(crate) fn is_performance(&self) -> bool {
        ["task", "bucket", "mode"]
            .iter()
            .all(|k| self.cell.get(*k).is_none_or(String::is_empty))
    }

    /// The workload the point ran: its fields but the strategy's and `axis`.
    pub(crate) fn context(&self, axis: Axis) -> BTreeMap<String, String> {
        self.fields()
            .into_iter()
            .filter(|(k, _)| !is_strategy(k) && !axis.is(k))
            .collect()
    }

    /// The strategy's settings but the engine: two points of one engine in one workload
    /// that differ here are different variants.
    pub(crate) fn variant_key(&self) -> String {
        join(&self.fields(), |k| is_strategy(k) && k != "engine")
    }

    /// The variant as the evidence names it (`h2o stats=exact @0.3 chunked 6144`).
    pub(crate) fn variant(&self) -> String {
        let mut s = vec![self.engine.clone()];
        if !self.params.is_empty() {
            s.push(self.params.clone());
        }
        if let (false, Some(b)) = (self.engine == "full", self.budget) {
            s.push(format!("@{b}"));
        }
        if !self.attention.is_empty() {
            s.push(self.attention.clone());
        }
        if let Some(c) = self.cell.get("chunk_size").filter(|c| !c.is_empty()) {
            s.push(c.clone());
        }
        s.join(" ")
    }
}

/// `k=v;k=v` of the fields that `keep` keeps.
pub(crate) fn join(m: &BTreeMap<String, String>, keep: impl Fn(&str) -> bool) -> String {
    m.iter()
        .filter(|(k, _)| keep(k))
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(";")
}

/// Fields that choose the strategy rather than the workload.
pub(crate) fn is_strategy(field: &str) -> bool {
    matches!(
        field,
        "engine" | "params" | "budget" | "attention" | "chunk_size"
    ) || field.starts_with("params_")
}

/// A column as strings, all null when the table lacks it.
pub(crate) fn strings(df: &DataFrame, name: &str) -> Vec<Option<String>> {
    kvbench_plots::strs(df, name).unwrap_or_else(|| vec![None; df.height()])
}

/// A column as numbers, all null when the table lacks it.
pub(crate) fn floats(df: &DataFrame, name: &str) -> Vec<Option<f64>> {
    kvbench_plots::f64s(df, name).unwrap_or_else(|| vec![None; df.height()])
}

/// Read runs.parquet of `dir`.
pub fn read_runs(dir: &Path) -> Result<(DataFrame, Vec<Run>)> {
    let path = dir.join(schema::RUNS_FILE);
    if !path.is_file() {
        anyhow::bail!(
            "{}: expected the runs table of an experiment (run `kvbench run EXP.yaml`, or \
             `--tables-only` to rebuild it from the cells)",
            path.display()
        );
    }
    let df = schema::read_table(&path)?;
    schema::check_runs_table(&df, &path)?;
    let runs = runs_of(&df);
    Ok((df, runs))
}

/// Columns named `cell_*` that are not the cell's identity: the repeat and the row's
/// bookkeeping, and the point (read apart).
pub(crate) const NOT_IDENTITY: [&str; 5] = [
    schema::CELL_REPEAT,
    schema::CELL_INDEX,
    schema::CELL_ID,
    schema::CELL_KEY,
    schema::CELL_POINT,
];

/// The rows of a runs table.
pub(crate) fn runs_of(df: &DataFrame) -> Vec<Run> {
    let s = |n: &str| strings(df, n);
    let x = |n: &str| floats(df, n);
    // The strategy's parameters as the cell key spells them (`params=stats=exact`).
    let params: Vec<Option<String>> = s(schema::CELL_KEY)
        .into_iter()
        .map(|k| {
            k.and_then(|k| {
                k.split(';')
                    .find_map(|p| p.strip_prefix("params=").map(str::to_owned))
            })
            .filter(|p| !p.is_empty())
        })
        .collect();
    let (engine, attention, prompt, outcome) =
        (s("engine"), s("attention"), s("prompt_len"), s("outcome"));
    let reservation = s(schema::MEM_KV_RESERVATION);
    let cols: Vec<Vec<Option<f64>>> = [
        "batch",
        "output_len",
        "budget",
        schema::TTFT_MEAN_S,
        schema::E2E_MEAN_S,
        schema::DECODE_TOK_S,
        schema::DECODE_TOK_S_PER_GB,
        schema::MEM_WEIGHTS_BYTES,
        schema::MEM_KV_DEVICE_BYTES,
        schema::MEM_ACTIVATIONS_PEAK_BYTES,
        schema::MEM_KV_HOST_BYTES,
        schema::MEM_HOST_PEAK_BYTES,
        schema::MEM_KV_DEVICE_USED_PEAK_BYTES,
        schema::GOODPUT_REQ_S,
        schema::SLO_TTFT_MS,
        schema::SLO_TPOT_MS,
        schema::SLO_E2E_MS,
        "h2d_bytes",
        "metrics_output_tokens",
        schema::METRICS_BREAKDOWN_TRANSFER_S,
        "metrics_breakdown_cache_ops_s",
        "metrics_breakdown_decode_compute_s",
    ]
    .iter()
    .map(|n| x(n))
    .collect();
    // The breakdown's six parts, summed where all are recorded.
    let parts: Vec<Vec<Option<f64>>> = BREAKDOWN.iter().map(|n| x(n)).collect();
    let busy: Vec<Option<f64>> = (0..df.height())
        .map(|i| parts.iter().map(|p| p[i]).sum::<Option<f64>>())
        .collect();
    let identity: Vec<(String, Vec<Option<String>>)> = df
        .get_column_names()
        .iter()
        .map(|n| n.as_str())
        .filter(|n| n.starts_with(schema::CELL_PREFIX) && !NOT_IDENTITY.contains(n))
        .map(|n| (n[schema::CELL_PREFIX.len()..].to_string(), s(n)))
        .collect();
    let point = df
        .column(schema::CELL_POINT)
        .is_ok()
        .then(|| s(schema::CELL_POINT));
    (0..df.height())
        .map(|i| Run {
            engine: engine[i].clone().unwrap_or_default(),
            params: params[i].clone().unwrap_or_default(),
            attention: attention[i].clone().unwrap_or_default(),
            prompt_len: prompt[i].clone().unwrap_or_default(),
            outcome: outcome[i].clone().unwrap_or_default(),
            batch: cols[0][i],
            output_len: cols[1][i],
            budget: cols[2][i],
            ttft_mean_s: cols[3][i],
            e2e_mean_s: cols[4][i],
            decode_tok_s: cols[5][i],
            decode_tok_s_per_gb: cols[6][i],
            mem_weights_bytes: cols[7][i],
            mem_kv_device_bytes: cols[8][i],
            mem_activations_peak_bytes: cols[9][i],
            mem_kv_host_bytes: cols[10][i],
            mem_host_peak_bytes: cols[11][i],
            mem_kv_device_used_peak_bytes: cols[12][i],
            mem_kv_reservation: reservation[i].clone(),
            goodput_req_s: cols[13][i],
            slo_ttft_ms: cols[14][i],
            slo_tpot_ms: cols[15][i],
            slo_e2e_ms: cols[16][i],
            h2d_bytes: cols[17][i],
            output_tokens: cols[18][i],
            transfer_s: cols[19][i],
            cache_ops_s: cols[20][i],
            decode_compute_s: cols[21][i],
            busy_s: busy[i],
            cell: identity
                .iter()
                .map(|(k, v)| (k.clone(), v[i].clone().unwrap_or_default()))
                .collect(),
            point: point.as_ref().and_then(|p| p[i].clone()),
        })
        .collect()
}

/// The walltime breakdown's columns in runs.parquet (docs/metrics.md).
const BREAKDOWN: [&str; 6] = [
    "metrics_breakdown_prefill_s",
    "metrics_breakdown_decode_compute_s",
    "metrics_breakdown_cache_ops_s",
    schema::METRICS_BREAKDOWN_TRANSFER_S,
    schema::METRICS_BREAKDOWN_SAMPLING_S,
    schema::METRICS_BREAKDOWN_SCHEDULING_S,
];

/// The points of `runs`: the rows of one cell but for their repeat merged into one, in
/// the order of their first row. Each metric is the mean over the repeats that have it
/// (null when none has; a NaN stays NaN); the outcome is the repeats' when they agree,
/// else `mixed (…)`, which is not ok.
pub fn points(runs: &[Run]) -> Vec<Run> {
    let mut order = Vec::new();
    let mut groups: BTreeMap<String, Vec<&Run>> = BTreeMap::new();
    for r in runs {
        let k = r.point_key();
        let g = groups.entry(k.clone()).or_default();
        if g.is_empty() {
            order.push(k);
        }
        g.push(r);
    }
    order.iter().map(|k| merge(&groups[k])).collect()
}

pub(crate) fn merge(rs: &[&Run]) -> Run {
    let mean = |f: fn(&Run) -> Option<f64>| -> Option<f64> {
        let v: Vec<f64> = rs.iter().filter_map(|r| f(r)).collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    };
    let mut outcomes: BTreeMap<&str, usize> = BTreeMap::new();
    for r in rs {
        *outcomes.entry(r.outcome.as_str()).or_default() += 1;
    }
    let outcome = if outcomes.len() == 1 {
        rs[0].outcome.clone()
    } else {
        format!(
            "mixed ({})",
            outcomes
                .iter()
                .map(|(o, n)| format!("{n} {o}"))
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    Run {
        outcome,
        ttft_mean_s: mean(|r| r.ttft_mean_s),
        e2e_mean_s: mean(|r| r.e2e_mean_s),
        decode_tok_s: mean(|r| r.decode_tok_s),
        decode_tok_s_per_gb: mean(|r| r.decode_tok_s_per_gb),
        mem_weights_bytes: mean(|r| r.mem_weights_bytes),
        mem_kv_device_bytes: mean(|r| r.mem_kv_device_bytes),
        mem_activations_peak_bytes: mean(|r| r.mem_activations_peak_bytes),
        mem_kv_host_bytes: mean(|r| r.mem_kv_host_bytes),
        mem_host_peak_bytes: mean(|r| r.mem_host_peak_bytes),
        mem_kv_device_used_peak_bytes: mean(|r| r.mem_kv_device_used_peak_bytes),
        goodput_req_s: mean(|r| r.goodput_req_s),
        h2d_bytes: mean(|r| r.h2d_bytes),
        output_tokens: mean(|r| r.output_tokens),
        transfer_s: mean(|r| r.transfer_s),
        cache_ops_s: mean(|r| r.cache_ops_s),
        decode_compute_s: mean(|r| r.decode_compute_s),
        busy_s: mean(|r| r.busy_s),
        ..rs[0].clone()
    }
}

/// The rows of accuracy.parquet beside runs.parquet: none when the experiment has no
/// such table, an error naming it when it has one that cannot be read as one.
pub(crate) fn read_accuracy(dir: &Path) -> Result<Option<Vec<AccRow>>> {
    if !dir.join(schema::ACCURACY_FILE).is_file() {
        return Ok(None);
    }
    let rows = kvbench_plots::Tables::load(dir, None)?
        .accuracy_rows()
        .map_err(|e| anyhow::anyhow!("{}: {e}", dir.display()))?;
    Ok(Some(rows))
}

/// Figure files written by `kvbench plot` (results/EXP/figures/*.png), in name order.
pub(crate) fn figures(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir.join("figures"))
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "png"))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

pub(crate) fn first(df: &DataFrame, name: &str) -> Option<String> {
    strings(df, name).into_iter().flatten().next()
}

/// The grid dimension a claim reads along.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Axis {
    Prompt,
    Batch,
    Output,
}

impl Axis {
    pub(crate) fn of(self, r: &Run) -> Option<f64> {
        match self {
            Axis::Prompt => r.prompt(),
            Axis::Batch => r.batch,
            Axis::Output => r.output_len,
        }
    }

    /// Whether `field` is this axis (a prompt-length distribution flattens into
    /// `prompt_len_*`).
    pub(crate) fn is(self, field: &str) -> bool {
        let name = match self {
            Axis::Prompt => "prompt_len",
            Axis::Batch => "batch",
            Axis::Output => "output_len",
        };
        field == name || field.strip_prefix(name).is_some_and(|t| t.starts_with('_'))
    }
}
