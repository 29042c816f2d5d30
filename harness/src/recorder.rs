//! The recorder: Parquet tables (Polars) built from the per-cell result files of an
//! experiment (`cells/<id>.json.gz`, [`crate::cell_file`]), which stay the source of
//! truth (each written atomically when its cell ends). `runs.parquet` has one row per
//! cell (its parameters, outcome, metrics, memory and the environment),
//! `requests.parquet` one per measured request,
//! `steps.parquet` one per engine step and `samples.parquet` the memory time series;
//! every row carries its cell's index and key. `runs.parquet` starts with headline
//! columns under stable names (`engine`, `ttft_mean_s`, `decode_tok_s`, `goodput_req_s`,
//! `mem_kv_device_bytes`, ...); then nested fields follow, flattened with `_`
//! (`metrics_ttft_s_p99`). A value never measured is null. Accuracy and retention
//! cells carry `accuracy_rows`, which become `accuracy.parquet` (written only when
//! there are any).

use anyhow::{Context, Result};
use kvbench_plots::schema;
use polars::prelude::{Column, DataFrame, DataType, NamedFrom, ParquetWriter, Series};
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Flatten nested objects into `prefix_key` columns; arrays become JSON strings.
fn flatten(prefix: &str, v: &Value, out: &mut Map<String, Value>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}_{k}")
                };
                flatten(&key, x, out);
            }
        }
        Value::Array(_) => {
            out.insert(prefix.to_string(), Value::String(v.to_string()));
        }
        _ => {
            out.insert(prefix.to_string(), v.clone());
        }
    }
}

/// A data frame from flat rows: integer columns stay integers, any float makes the
/// column f64, booleans stay booleans, anything else (or a mix) is a string column.
pub fn frame(rows: &[Map<String, Value>]) -> Result<DataFrame> {
    let mut names: Vec<String> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for r in rows {
        for k in r.keys() {
            if seen.insert(k.clone()) {
                names.push(k.clone());
            }
        }
    }
    let mut cols: Vec<Column> = Vec::with_capacity(names.len());
    for name in &names {
        let vals: Vec<Option<&Value>> = rows
            .iter()
            .map(|r| r.get(name).filter(|v| !v.is_null()))
            .collect();
        let present = || vals.iter().flatten();
        let all_int = present().all(|v| v.is_i64() || v.is_u64());
        let all_num = present().all(|v| v.is_number());
        let all_bool = present().all(|v| v.is_boolean());
        let s = if present().next().is_none() {
            Series::full_null(name.as_str().into(), rows.len(), &DataType::Float64)
        } else if all_int {
            Series::new(
                name.as_str().into(),
                vals.iter()
                    .map(|v| v.and_then(|v| v.as_i64().or_else(|| v.as_u64().map(|u| u as i64))))
                    .collect::<Vec<Option<i64>>>(),
            )
        } else if all_num {
            Series::new(
                name.as_str().into(),
                vals.iter()
                    .map(|v| v.and_then(Value::as_f64))
                    .collect::<Vec<Option<f64>>>(),
            )
        } else if all_bool {
            Series::new(
                name.as_str().into(),
                vals.iter()
                    .map(|v| v.and_then(Value::as_bool))
                    .collect::<Vec<Option<bool>>>(),
            )
        } else {
            Series::new(
                name.as_str().into(),
                vals.iter()
                    .map(|v| {
                        v.map(|v| match v {
                            Value::String(s) => s.clone(),
                            other => other.to_string(),
                        })
                    })
                    .collect::<Vec<Option<String>>>(),
            )
        };
        cols.push(s.into());
    }
    Ok(DataFrame::new(rows.len(), cols)?)
}

/// Write a data frame as Parquet through a uniquely named temporary file, flushed,
/// then renamed into place (removed on failure).
pub fn write_parquet(df: &mut DataFrame, path: &Path) -> Result<()> {
    let dir = path
        .parent()
        .with_context(|| format!("{}: no parent directory", path.display()))?;
    let tmp = tempfile::Builder::new()
        .prefix(".tmp-")
        .tempfile_in(dir)
        .with_context(|| format!("creating a temporary file in {}", dir.display()))?;
    ParquetWriter::new(tmp.as_file())
        .finish(df)
        .map_err(anyhow::Error::from)
        .and_then(|_| tmp.as_file().sync_all().map_err(anyhow::Error::from))
        .with_context(|| format!("writing {}", tmp.path().display()))?;
    tmp.persist(path)
        .map_err(|e| e.error)
        .with_context(|| format!("renaming a temporary file to {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
pub fn read_parquet(path: &Path) -> Result<DataFrame> {
    Ok(schema::read_table(path)?)
}

/// The headline columns of `runs.parquet`, first in each row, under stable names
/// (the flattened fields follow with every detail). Null where not measured.
fn headline(cell: &Value, experiment: &str, cell_id: &str) -> Vec<(&'static str, Value)> {
    let c = &cell["cell"];
    let m = &cell["metrics"];
    let mem = &cell["memory"];
    let b = &m["breakdown"];
    let num = |v: &Value| v.as_f64().map_or(Value::Null, Value::from);
    let int = |v: &Value| v.as_u64().map_or(Value::Null, Value::from);
    let prompt = match &c["prompt_len"] {
        v @ Value::Number(_) => v.clone(),
        Value::Null => Value::Null,
        other => Value::String(other.to_string()),
    };
    // Throughput per GB of the engine's device memory (weights, device KV and the
    // activation peak from the ledger), the study's efficiency measure.
    let device = ["weights", "kv_device", "activations_peak"]
        .iter()
        .map(|k| mem[*k].as_u64())
        .sum::<Option<u64>>();
    // KV bytes the sequences held at the busiest step (a pool reserved up front, as
    // on CUDA, holds more than the strategy needs).
    let kv_used_peak = cell["steps"].as_array().and_then(|steps| {
        steps
            .iter()
            .filter_map(|s| s["kv_device_used_bytes"].as_u64())
            .max()
    });
    let per_gb = match (m["decode_throughput"].as_f64(), device) {
        (Some(t), Some(d)) if d > 0 => Value::from(t / (d as f64 / 1e9)),
        _ => Value::Null,
    };
    vec![
        (schema::EXPERIMENT, Value::from(experiment)),
        (schema::CELL_ID, Value::from(cell_id)),
        ("repeat", c["repeat"].clone()),
        ("engine", c["engine"].clone()),
        ("budget", c["budget"].clone()),
        ("attention", c["attention"].clone()),
        ("batch", c["batch"].clone()),
        ("prompt_len", prompt),
        ("output_len", c["output_len"].clone()),
        ("outcome", cell["outcome"].clone()),
        ("error", cell["error"].clone()),
        // Measured, or predicted by the cost model (`kvbench predict`).
        (
            schema::PREDICTED,
            Value::from(cell["predicted"].as_bool().unwrap_or(false)),
        ),
        (schema::TTFT_MEAN_S, num(&m["ttft_s"]["mean"])),
        (schema::TTFT_P99_S, num(&m["ttft_s"]["p99"])),
        (schema::TPOT_MEAN_S, num(&m["tpot_s"]["mean"])),
        (schema::ITL_P99_S, num(&m["itl_s"]["p99"])),
        (schema::E2E_MEAN_S, num(&m["e2e_s"]["mean"])),
        (schema::DECODE_TOK_S, num(&m["decode_throughput"])),
        (schema::THROUGHPUT_TOK_S, num(&m["output_throughput"])),
        (schema::DECODE_TOK_S_PER_GB, per_gb),
        ("duration_s", num(&m["duration_s"])),
        (schema::PEAK_OUTPUT_TOK_S, num(&m["peak_output_throughput"])),
        ("peak_concurrency", int(&m["peak_concurrency"])),
        // The objectives (null when not set) beside what was measured against them.
        (schema::SLO_TTFT_MS, num(&c["slo"]["ttft_ms"])),
        (schema::SLO_TPOT_MS, num(&c["slo"]["tpot_ms"])),
        (schema::SLO_E2E_MS, num(&c["slo"]["e2e_ms"])),
        (schema::GOODPUT_REQ_S, num(&m["goodput"])),
        ("slo_ttft_frac", num(&m["slo_ttft_frac"])),
        ("slo_tpot_frac", num(&m["slo_tpot_frac"])),
        ("slo_e2e_frac", num(&m["slo_e2e_frac"])),
        (schema::WALL_PREFILL_S, num(&b["prefill_s"])),
        (schema::WALL_DECODE_S, num(&b["decode_compute_s"])),
        (schema::WALL_CACHE_OPS_S, num(&b["cache_ops_s"])),
        (schema::MEM_WEIGHTS_BYTES, int(&mem["weights"])),
        (schema::MEM_KV_DEVICE_BYTES, int(&mem["kv_device"])),
        // How that KV was reserved (`fraction`: a pool up front, `budget`: grown on
        // demand); null in tables written before it was recorded.
        (schema::MEM_KV_RESERVATION, mem["reservation"].clone()),
        // How the paged stores kept their rows (`f32`, `bf16`, `int4`, …); null for
        // strategies with storage of their own and in tables written before it was
        // recorded.
        (schema::MEM_KV_CODEC, mem["kv_codec"].clone()),
        (
            schema::MEM_KV_DEVICE_USED_PEAK_BYTES,
            kv_used_peak.map_or(Value::Null, Value::from),
        ),
        (schema::MEM_KV_HOST_BYTES, int(&mem["kv_host"])),
        (
            schema::MEM_ACTIVATIONS_PEAK_BYTES,
            int(&mem["activations_peak"]),
        ),
        (
            schema::MEM_DEVICE_PEAK_BYTES,
            int(&cell["gpu_used_peak_bytes"]),
        ),
        (
            schema::MEM_HOST_PEAK_BYTES,
            int(&cell["process_rss_peak_bytes"]),
        ),
    ]
}

/// Rows of the four tables from one cell's result.
fn rows_of(
    cell: &Value,
    experiment: &str,
    cell_id: &str,
    tables: &mut BTreeMap<&'static str, Vec<Map<String, Value>>>,
) {
    let index = cell["cell"]["index"].clone();
    let key = cell["key"].clone();
    let tag = |m: &mut Map<String, Value>| {
        m.insert(schema::CELL_INDEX.into(), index.clone());
        m.insert(schema::CELL_KEY.into(), key.clone());
    };
    let mut run: Map<String, Value> = headline(cell, experiment, cell_id)
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    tag(&mut run);
    if let Value::Object(m) = cell {
        for (k, v) in m {
            if ["requests", "steps", "samples", "key", "accuracy_rows"].contains(&k.as_str()) {
                continue;
            }
            flatten(k, v, &mut run);
        }
    }
    tables.entry(schema::RUNS).or_default().push(run);
    for (table, field) in [
        (schema::REQUESTS, "requests"),
        (schema::STEPS, "steps"),
        (schema::SAMPLES, "samples"),
        (schema::ACCURACY, "accuracy_rows"),
    ] {
        for r in cell[field].as_array().into_iter().flatten() {
            let mut m = Map::new();
            tag(&mut m);
            flatten("", r, &mut m);
            if table == schema::REQUESTS {
                add_request_metrics(r, &mut m);
            }
            tables.entry(table).or_default().push(m);
        }
    }
}

/// Per-request TTFT, TPOT and E2E next to the raw times (vLLM's definitions).
fn add_request_metrics(r: &Value, m: &mut Map<String, Value>) {
    let times: Vec<f64> = r["token_times_s"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_f64).collect())
        .unwrap_or_default();
    let (Some(arrival), Some(finish)) = (r["arrival_s"].as_f64(), r["finished_s"].as_f64()) else {
        return;
    };
    let ttft = times.first().map(|t| t - arrival);
    let e2e = finish - arrival;
    let tpot = ttft
        .filter(|_| times.len() > 1)
        .map(|t| (e2e - t) / (times.len() - 1) as f64);
    m.insert("output_len".into(), (times.len() as u64).into());
    m.insert("ttft_s".into(), ttft.map_or(Value::Null, Value::from));
    m.insert("tpot_s".into(), tpot.map_or(Value::Null, Value::from));
    m.insert("e2e_s".into(), e2e.into());
    m.remove("output");
}

/// The experiment's name from the copy of its YAML kept beside the results, else the
/// directory's name.
fn experiment_name(exp_dir: &Path) -> String {
    std::fs::read_to_string(exp_dir.join("experiment.yaml"))
        .ok()
        .and_then(|y| serde_yaml::from_str::<serde_yaml::Value>(&y).ok())
        .and_then(|v| v.get("name").and_then(|n| n.as_str()).map(str::to_owned))
        .unwrap_or_else(|| {
            exp_dir
                .file_name()
                .map_or(String::new(), |n| n.to_string_lossy().into_owned())
        })
}

/// Remove the experiment's Parquet tables, returning how many there were. A sweep does
/// this before it measures its first cell: the tables describe the cells as they were
/// when they were last built, and a sweep stopped part-way (killed, out of time) must
/// not leave tables that disagree with `cells/` (rows of cells since rerun by another
/// build, none for the cells it added). They are rebuilt when the sweep ends, or with
/// `--tables-only`.
pub fn remove_tables(exp_dir: &Path) -> Result<usize> {
    let mut removed = 0;
    for name in schema::TABLES {
        let f = exp_dir.join(schema::file_name(name));
        match std::fs::remove_file(&f) {
            Ok(()) => removed += 1,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("removing {}", f.display())),
        }
    }
    Ok(removed)
}

/// What [`write_tables`] wrote and what it left out.
#[derive(Debug, Default)]
pub struct Tables {
    /// Rows per table written.
    pub counts: BTreeMap<&'static str, usize>,
    /// Cell files of no cell of the plan (another version of the YAML, or recorded
    /// before cells had identities).
    pub foreign: Vec<PathBuf>,
    /// Files that could not be read as a cell result, with why.
    pub unreadable: Vec<(PathBuf, String)>,
}

/// Rebuild `runs`, `requests`, `steps` and `samples` Parquet tables of
/// `results/<name>/` from the results in `cells/` of the plan's `cells` (matched by
/// identity; each row carries the cell's index in this plan). Other files are listed,
/// not used; an unreadable one does not stop the others, a cell held in two files
/// (plain and compressed) does.
pub fn write_tables(exp_dir: &Path, cells: &[crate::experiment::Cell]) -> Result<Tables> {
    let mut tables: BTreeMap<&'static str, Vec<Map<String, Value>>> = BTreeMap::new();
    let mut out = Tables::default();
    let experiment = experiment_name(exp_dir);
    let index: std::collections::HashMap<&str, usize> =
        cells.iter().map(|c| (c.id.as_str(), c.index)).collect();
    let mut ours = Vec::new();
    for f in crate::cell_file::list(&exp_dir.join("cells"))? {
        let v = crate::cell_file::decode(&f)
            .map_err(|e| format!("{e:#}"))
            .and_then(|v| {
                if v.is_object() && v.get("cell").is_some() {
                    Ok(v)
                } else {
                    Err("expected a JSON object with a `cell`".to_string())
                }
            });
        let mut v = match v {
            Ok(v) => v,
            Err(why) => {
                out.unreadable.push((f, why));
                continue;
            }
        };
        let Some(&i) = v["id"].as_str().and_then(|id| index.get(id)) else {
            out.foreign.push(f);
            continue;
        };
        v["cell"]["index"] = i.into();
        ours.push((i, v));
    }
    // Rows in the plan's order, whatever the files are called.
    ours.sort_by_key(|(i, _)| *i);
    for (_, v) in &ours {
        let id = v["id"].as_str().unwrap_or_default();
        rows_of(v, &experiment, id, &mut tables);
    }
    let counts = &mut out.counts;
    for name in schema::TABLES {
        let rows = tables.remove(name).unwrap_or_default();
        // accuracy.parquet exists only where accuracy was measured (its absence is
        // what the figures and the report go by).
        if name == schema::ACCURACY && rows.is_empty() {
            let stale = exp_dir.join(schema::ACCURACY_FILE);
            if stale.is_file() {
                std::fs::remove_file(&stale)
                    .with_context(|| format!("removing {}", stale.display()))?;
            }
            continue;
        }
        counts.insert(name, rows.len());
        let mut df = frame(&rows)?;
        if name == schema::RUNS && !rows.is_empty() {
            // Headline columns first, in their documented order.
            let first: Vec<&str> = headline(&Value::Null, "", "")
                .into_iter()
                .map(|(k, _)| k)
                .collect();
            let names: Vec<String> = first
                .iter()
                .map(|s| s.to_string())
                .chain(
                    df.get_column_names()
                        .iter()
                        .map(|n| n.to_string())
                        .filter(|n| !first.contains(&n.as_str())),
                )
                .collect();
            df = df.select(names)?;
        }
        write_parquet(&mut df, &exp_dir.join(schema::file_name(name)))?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn flat_rows_keep_types_and_nulls_through_parquet() {
        let rows: Vec<Map<String, Value>> = [
            json!({"a": 1, "b": 0.5, "c": "x", "d": true, "m": {"p99": 2.0}, "n": null}),
            json!({"a": 2, "b": 1, "c": null, "d": false, "m": {"p99": null}, "n": null}),
        ]
        .iter()
        .map(|v| {
            let mut m = Map::new();
            flatten("", v, &mut m);
            m
        })
        .collect();
        let mut df = frame(&rows).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.parquet");
        write_parquet(&mut df, &p).unwrap();
        let back = read_parquet(&p).unwrap();
        assert_eq!(back.shape(), (2, 6));
        assert_eq!(back.column("a").unwrap().dtype(), &DataType::Int64);
        assert_eq!(back.column("b").unwrap().dtype(), &DataType::Float64);
        assert_eq!(back.column("c").unwrap().dtype(), &DataType::String);
        assert_eq!(back.column("d").unwrap().dtype(), &DataType::Boolean);
        let p99 = back.column("m_p99").unwrap().f64().unwrap();
        assert_eq!(p99.get(0), Some(2.0));
        assert_eq!(p99.get(1), None, "a missing measurement stays null");
        assert_eq!(back.column("n").unwrap().null_count(), 2);
        // Only the table is left: no temporary file.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["t.parquet"]);
    }

    /// `runs.parquet` of `cells`, written and read back.
    fn runs_table(cells: &[Value]) -> DataFrame {
        let mut tables = BTreeMap::new();
        for (i, c) in cells.iter().enumerate() {
            rows_of(c, "e", &format!("id{i}"), &mut tables);
        }
        let mut df = frame(&tables["runs"]).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("runs.parquet");
        write_parquet(&mut df, &p).unwrap();
        read_parquet(&p).unwrap()
    }

    #[test]
    fn runs_carry_the_slo_goodput_and_peaks_and_an_older_cell_reads_as_null() {
        let with_slo = json!({
            "cell": {"engine": "full", "repeat": 0, "slo": {"ttft_ms": 500.0, "tpot_ms": null, "e2e_ms": 2000.0}},
            "outcome": "ok",
            "metrics": {
                "duration_s": 4.0, "goodput": 0.5, "slo_ttft_frac": 0.75,
                "slo_tpot_frac": null, "slo_e2e_frac": 1.0,
                "peak_output_throughput": 12.0, "peak_concurrency": 3,
                "ttft_s": {"mean": 0.1, "std": 0.02, "p50": 0.1, "p90": 0.1, "p99": 0.1},
                "breakdown": null
            },
        });
        // Recorded before SLOs, peaks and std existed: the new columns are null.
        let older = json!({
            "cell": {"engine": "h2o", "repeat": 0},
            "outcome": "ok",
            "metrics": {"duration_s": 3.0, "goodput": null,
                        "ttft_s": {"mean": 0.2, "p50": 0.2, "p90": 0.2, "p99": 0.2},
                        "breakdown": {"prefill_s": 1.0}},
        });
        let df = runs_table(&[with_slo, older]);
        let f = |c: &str| {
            let col = df.column(c).unwrap_or_else(|_| panic!("no {c}"));
            let col = col.cast(&DataType::Float64).unwrap();
            let v: Vec<Option<f64>> = col.f64().unwrap().iter().collect();
            v
        };
        assert_eq!(f("slo_ttft_ms"), [Some(500.0), None]);
        assert_eq!(f("slo_tpot_ms"), [None, None]);
        assert_eq!(f("slo_e2e_ms"), [Some(2000.0), None]);
        assert_eq!(f("goodput_req_s"), [Some(0.5), None]);
        assert_eq!(f("slo_ttft_frac"), [Some(0.75), None]);
        assert_eq!(f("slo_tpot_frac"), [None, None]);
        assert_eq!(f("slo_e2e_frac"), [Some(1.0), None]);
        assert_eq!(f("peak_output_tok_s"), [Some(12.0), None]);
        assert_eq!(f("peak_concurrency"), [Some(3.0), None]);
        assert_eq!(f("duration_s"), [Some(4.0), Some(3.0)]);
        assert_eq!(f("metrics_ttft_s_std"), [Some(0.02), None]);
        // No breakdown: the walltime columns are null, not 0.
        assert_eq!(f("wall_prefill_s"), [None, Some(1.0)]);
        assert_eq!(
            df.column("peak_concurrency").unwrap().dtype(),
            &DataType::Int64
        );
    }
}
