//! The tables the figures read: `runs.parquet` (one row per cell) as typed rows, and
//! `accuracy.parquet` when the experiment measured accuracy. Column types follow the
//! recorder (integer columns may be Int64, a column of nulls Float64, a mixed column
//! String): every numeric read casts to f64, and a column that is absent reads as
//! null and is reported by the figures that need it.

use crate::schema::{self, read_table};
use crate::Error;
use polars::prelude::{Column, DataFrame, DataType};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A cell's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    Oom,
    /// `error`, or anything the figures do not know.
    Error,
}

/// A prompt length: fixed, or a distribution (`{"uniform":[1000,10000]}`).
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Fixed(f64),
    Dist(String),
    Unknown,
}

impl Prompt {
    pub fn fixed(&self) -> Option<f64> {
        match self {
            Prompt::Fixed(v) => Some(*v),
            _ => None,
        }
    }

    pub fn label(&self) -> String {
        match self {
            Prompt::Fixed(v) => crate::style::fmt_count(*v),
            Prompt::Dist(s) => s.clone(),
            Prompt::Unknown => "?".into(),
        }
    }
}

pub use crate::schema::METRICS;

/// One cell of `runs.parquet`.
#[derive(Debug, Clone)]
pub struct Run {
    pub cell_id: String,
    /// The cell's readable key (`cell_key`): joins accuracy rows to their cell.
    pub cell_key: Option<String>,
    /// `None` where the table does not say (never taken for repeat 0).
    pub repeat: Option<i64>,
    pub engine: String,
    /// Engine parameters as `k=v,k=v` (from `cell_params_*`), empty when default.
    pub params: String,
    pub budget: Option<f64>,
    pub attention: String,
    pub chunk: Option<f64>,
    pub batch: Option<f64>,
    pub prompt: Prompt,
    pub output: Option<f64>,
    pub rate: Option<f64>,
    pub burstiness: Option<f64>,
    pub concurrency: Option<f64>,
    pub outcome: Outcome,
    pub error: Option<String>,
    /// Non-null values of [`METRICS`].
    pub m: BTreeMap<&'static str, f64>,
}

impl Run {
    pub fn get(&self, metric: &str) -> Option<f64> {
        self.m.get(metric).copied().filter(|v| v.is_finite())
    }
}

/// What the titles say about where the data come from.
#[derive(Debug, Clone, Default)]
pub struct Meta {
    pub experiment: String,
    pub model: Option<String>,
    /// Devices as the environment columns name them, e.g. `NVIDIA H100 80GB HBM3`
    /// or `CPU (AMD EPYC, 2 cores)`.
    pub devices: Vec<String>,
    pub cells: usize,
}

impl Meta {
    /// `model · device · experiment`, for the second title line.
    pub fn describe(&self) -> String {
        let model = self.model.clone().unwrap_or_else(|| "model ?".into());
        let device = if self.devices.is_empty() {
            "device ?".to_string()
        } else {
            self.devices.join(" / ")
        };
        format!(
            "{model} on {device} · experiment {} · {} cells",
            self.experiment, self.cells
        )
    }
}

/// One row of `accuracy.parquet`.
#[derive(Debug, Clone)]
pub struct AccRow {
    pub task: String,
    pub engine: String,
    pub budget: Option<f64>,
    /// `None` where the table does not say (never taken for repeat 0).
    pub repeat: Option<i64>,
    /// 1/0 per item, or an accuracy fraction.
    pub value: f64,
    pub bucket: Option<String>,
    pub turn: Option<f64>,
    /// The key of the cell the row came from (`cell_key`): what tells variants of one
    /// engine apart (parameters, attention, scoring mode).
    pub cell_key: Option<String>,
    /// The engine's parameters as `k=v,k=v` (its cell's in runs.parquet), empty when
    /// default or unknown: variants of one engine are series of their own.
    pub params: String,
}

/// The tables of one experiment's results directory.
#[derive(Debug, Clone)]
pub struct Tables {
    pub dir: PathBuf,
    pub meta: Meta,
    pub runs: Vec<Run>,
    /// Why there are no runs, when there are none (`runs.parquet` absent or empty).
    pub runs_missing: Option<String>,
    /// Headline columns absent from `runs.parquet`.
    pub missing_columns: BTreeSet<String>,
    pub accuracy: Option<DataFrame>,
    /// Why there is no accuracy table.
    pub accuracy_missing: Option<String>,
}

/// The note of fig7 and fig8 for cells that did not finish: the first few by name.
pub(crate) fn unfinished_note(cells: &[String]) -> String {
    const SHOWN: usize = 6;
    let more = cells.len().saturating_sub(SHOWN);
    format!(
        "{} cell(s) did not finish, so not drawn: {}{}.",
        cells.len(),
        cells[..cells.len().min(SHOWN)].join("; "),
        if more > 0 {
            format!("; and {more} more")
        } else {
            String::new()
        }
    )
}

impl Tables {
    /// The cells of `kind` (`accuracy`, `retention`) that did not finish, as the
    /// notes of fig7 and fig8 name them (`h2o budget=0.3 bucket=4K-8K: error`): they
    /// have no rows in accuracy.parquet, so no bar or point can stand for them.
    pub fn unfinished(&self, kind: &str, fields: &[&str]) -> Vec<String> {
        self.runs
            .iter()
            .filter(|r| r.outcome != Outcome::Ok)
            .filter_map(|r| {
                let key = r.cell_key.as_deref()?;
                let f: BTreeMap<&str, &str> =
                    key.split(';').filter_map(|p| p.split_once('=')).collect();
                (f.get("kind") == Some(&kind)).then(|| {
                    let mut s = r.engine.clone();
                    if !r.params.is_empty() {
                        s.push_str(&format!(" [{}]", r.params));
                    }
                    for k in fields {
                        if let Some(v) = f.get(k) {
                            s.push_str(&format!(" {k}={v}"));
                        }
                    }
                    let what = match r.outcome {
                        Outcome::Oom => "OOM",
                        _ => "error",
                    };
                    format!("{s}: {what}")
                })
            })
            .collect()
    }

    /// [`Tables::unfinished`] as fig7's or fig8's note, when there are any.
    pub(crate) fn unfinished_note(&self, kind: &str, fields: &[&str]) -> Option<String> {
        let cells = self.unfinished(kind, fields);
        (!cells.is_empty()).then(|| unfinished_note(&cells))
    }

    /// Add another results directory's cells to these, for figures that overlay them
    /// (a measured experiment and its prediction): runs and devices join, the
    /// experiment names are listed, the accuracy table stays this one's.
    pub fn merge(&mut self, other: Tables) {
        if !other.runs.is_empty() {
            self.runs_missing = None;
        }
        self.runs.extend(other.runs);
        for d in other.meta.devices {
            if !self.meta.devices.contains(&d) {
                self.meta.devices.push(d);
            }
        }
        self.meta.cells += other.meta.cells;
        if !other.meta.experiment.is_empty() && other.meta.experiment != self.meta.experiment {
            self.meta.experiment = format!("{} + {}", self.meta.experiment, other.meta.experiment);
        }
        if self.meta.model.is_none() {
            self.meta.model = other.meta.model;
        }
        self.missing_columns.extend(other.missing_columns);
    }
}

/// A column as f64 values (numbers cast, strings parsed where they are numbers).
pub fn f64s(df: &DataFrame, name: &str) -> Option<Vec<Option<f64>>> {
    let c = df.column(name).ok()?;
    let c = if c.dtype() == &DataType::String {
        let s = c.str().ok()?;
        return Some(
            s.iter()
                .map(|v| v.and_then(|v| v.trim().parse::<f64>().ok()))
                .collect(),
        );
    } else if c.dtype() == &DataType::Boolean {
        let b = c.bool().ok()?;
        return Some(
            b.iter()
                .map(|v| v.map(|v| if v { 1.0 } else { 0.0 }))
                .collect(),
        );
    } else {
        c.cast(&DataType::Float64).ok()?
    };
    Some(c.f64().ok()?.iter().collect())
}

/// A column as strings (numbers printed).
pub fn strs(df: &DataFrame, name: &str) -> Option<Vec<Option<String>>> {
    let c: &Column = df.column(name).ok()?;
    if c.dtype() == &DataType::String {
        return Some(c.str().ok()?.iter().map(|v| v.map(str::to_owned)).collect());
    }
    let c = c.cast(&DataType::String).ok()?;
    Some(c.str().ok()?.iter().map(|v| v.map(str::to_owned)).collect())
}

/// `{"uniform":[1000,10000]}` → `uniform 1K–10K`.
fn dist_label(s: &str) -> String {
    let cleaned: String = s
        .chars()
        .map(|c| match c {
            '{' | '}' | '"' | '[' | ']' => ' ',
            ':' => ' ',
            ',' => '|',
            c => c,
        })
        .collect();
    let words: Vec<String> = cleaned
        .split_whitespace()
        .map(|w| {
            w.split('|')
                .filter(|p| !p.is_empty())
                .map(|p| {
                    p.parse::<f64>()
                        .map(crate::style::fmt_count)
                        .unwrap_or_else(|_| p.to_string())
                })
                .collect::<Vec<_>>()
                .join("–")
        })
        .filter(|w| !w.is_empty())
        .collect();
    words.join(" ")
}

impl Tables {
    /// Read the tables of `dir` (`results/<experiment>/`). `model` names the model
    /// when the tables do not.
    pub fn load(dir: &Path, model: Option<String>) -> Result<Tables, Error> {
        if !dir.is_dir() {
            return Err(Error::NotADirectory(dir.to_path_buf()));
        }
        let runs_path = dir.join(schema::RUNS_FILE);
        let acc_path = dir.join(schema::ACCURACY_FILE);
        if !runs_path.is_file() && !acc_path.is_file() {
            return Err(Error::NoTables(dir.to_path_buf()));
        }
        let runs = if runs_path.is_file() {
            let df = read_table(&runs_path)?;
            schema::check_runs_table(&df, &runs_path)?;
            Some(df)
        } else {
            None
        };
        let accuracy = if acc_path.is_file() {
            Some(read_table(&acc_path)?)
        } else {
            None
        };
        let mut t = Tables::from_frames(dir, runs.as_ref(), accuracy, model);
        if runs.is_none() {
            t.runs_missing = Some(format!(
                "{} not found (run the experiment first)",
                runs_path.display()
            ));
        }
        if t.accuracy.is_none() {
            t.accuracy_missing = Some(format!(
                "{} not found (the experiment has no accuracy or retention cells: `kind: accuracy` or `kind: retention` experiments record them)",
                acc_path.display()
            ));
        }
        Ok(t)
    }

    /// Tables from data frames already in memory.
    pub fn from_frames(
        dir: &Path,
        runs: Option<&DataFrame>,
        accuracy: Option<DataFrame>,
        model: Option<String>,
    ) -> Tables {
        let mut missing_columns = BTreeSet::new();
        let mut rows = Vec::new();
        let mut meta = Meta {
            experiment: dir
                .file_name()
                .map_or(String::new(), |n| n.to_string_lossy().into_owned()),
            model,
            ..Meta::default()
        };
        if let Some(df) = runs {
            let n = df.height();
            let mut need_s = |name: &str| -> Vec<Option<String>> {
                strs(df, name).unwrap_or_else(|| {
                    missing_columns.insert(name.to_string());
                    vec![None; n]
                })
            };
            let cell_id = need_s(schema::CELL_ID);
            let engine = need_s("engine");
            let attention = need_s("attention");
            let prompt_s = need_s("prompt_len");
            let outcome = need_s("outcome");
            let error = need_s("error");
            let experiment = need_s(schema::EXPERIMENT);
            let mut need_f = |name: &str| -> Vec<Option<f64>> {
                f64s(df, name).unwrap_or_else(|| {
                    missing_columns.insert(name.to_string());
                    vec![None; n]
                })
            };
            let repeat = need_f("repeat");
            let budget = need_f("budget");
            let batch = need_f("batch");
            let output = need_f("output_len");
            let metrics: Vec<(&'static str, Vec<Option<f64>>)> =
                METRICS.iter().map(|&m| (m, need_f(m))).collect();
            let opt_f = |name: &str| f64s(df, name).unwrap_or_else(|| vec![None; n]);
            let chunk = opt_f("cell_chunk_size");
            let rate = opt_f("cell_request_rate");
            let burst = opt_f("cell_burstiness");
            let conc = opt_f("cell_max_concurrency");
            let names: Vec<String> = df
                .get_column_names()
                .iter()
                .map(|s| s.to_string())
                .collect();
            let params: Vec<(String, Vec<Option<String>>)> = names
                .iter()
                .filter_map(|c| {
                    let k = c.strip_prefix("cell_params_")?;
                    Some((k.to_string(), strs(df, c)?))
                })
                .collect();
            let opt_s = |name: &str| strs(df, name).unwrap_or_else(|| vec![None; n]);
            let model_col = {
                let a = opt_s("model");
                if a.iter().any(Option::is_some) {
                    a
                } else {
                    opt_s("cell_model")
                }
            };
            let predicted = opt_s(schema::PREDICTED);
            let cell_key = opt_s(schema::CELL_KEY);
            let gpu = opt_s("env_gpu_name");
            let cpu = opt_s("env_cpu_model");
            let cores = opt_f("env_cpu_cores");
            let dev = opt_s("env_device");
            let prompt_f = f64s(df, "prompt_len").unwrap_or_else(|| vec![None; n]);
            let mut devices = BTreeSet::new();
            let mut models = BTreeSet::new();
            for i in 0..n {
                let p = match (&prompt_s[i], prompt_f[i]) {
                    (_, Some(v)) => Prompt::Fixed(v),
                    (Some(s), None) => Prompt::Dist(dist_label(s)),
                    (None, None) => Prompt::Unknown,
                };
                let mut params: Vec<String> = params
                    .iter()
                    .filter_map(|(k, v)| v[i].as_ref().map(|v| format!("{k}={v}")))
                    .collect();
                // A cell of `kvbench predict` is a series of its own beside the
                // measured one of the same engine (figures overlaying both).
                if predicted[i].as_deref() == Some("true") {
                    params.push("predicted".into());
                }
                let outcome = match outcome[i].as_deref() {
                    Some("ok") => Outcome::Ok,
                    Some("oom") => Outcome::Oom,
                    _ => Outcome::Error,
                };
                let m = metrics
                    .iter()
                    .filter_map(|(k, v)| v[i].map(|x| (*k, x)))
                    .collect();
                let predicted_for = dev[i].as_deref().and_then(|d| d.strip_prefix("predicted:"));
                let device = match (&gpu[i], &cpu[i], &dev[i]) {
                    // A cell of `kvbench predict`: said in every figure's subtitle.
                    _ if predicted_for.is_some() => predicted_for
                        .map(|d| format!("{d} (PREDICTED by the cost model, not measured)")),
                    (Some(g), _, _) => Some(g.clone()),
                    (None, Some(c), d) if d.as_deref().is_none_or(|d| d == "cpu") => {
                        Some(match cores[i] {
                            Some(k) => format!("CPU ({c}, {k} cores)"),
                            None => format!("CPU ({c})"),
                        })
                    }
                    (None, _, Some(d)) => Some(d.clone()),
                    _ => None,
                };
                devices.extend(device);
                models.extend(model_col[i].clone());
                if let Some(e) = &experiment[i] {
                    meta.experiment = e.clone();
                }
                rows.push(Run {
                    cell_id: cell_id[i].clone().unwrap_or_default(),
                    cell_key: cell_key[i].clone(),
                    repeat: repeat[i].map(|r| r as i64),
                    engine: engine[i].clone().unwrap_or_else(|| "?".into()),
                    params: params.join(","),
                    budget: budget[i],
                    attention: attention[i].clone().unwrap_or_else(|| "?".into()),
                    chunk: chunk[i],
                    batch: batch[i],
                    prompt: p,
                    output: output[i],
                    rate: rate[i].filter(|r| r.is_finite()),
                    burstiness: burst[i],
                    concurrency: conc[i],
                    outcome,
                    error: error[i].clone(),
                    m,
                });
            }
            meta.devices = devices.into_iter().collect();
            if !models.is_empty() {
                meta.model = Some(models.into_iter().collect::<Vec<_>>().join(" / "));
            }
        }
        meta.cells = rows.len();
        let runs_missing = if runs.is_some() && rows.is_empty() {
            Some("runs.parquet has no rows".to_string())
        } else if runs.is_none() {
            Some("no runs table".to_string())
        } else {
            None
        };
        let accuracy_missing = accuracy
            .is_none()
            .then(|| "no accuracy table (no accuracy or retention cells)".to_string());
        Tables {
            dir: dir.to_path_buf(),
            meta,
            runs: rows,
            runs_missing,
            missing_columns,
            accuracy,
            accuracy_missing,
        }
    }

    /// Rows of `accuracy.parquet`, or why there are none. Expected columns: `task`,
    /// `engine`, `budget`, and `correct` (per item: bool or 0/1) or `accuracy` (a
    /// fraction per row); optional `repeat`, and for the retention task `bucket`
    /// (context bucket, e.g. `1K-2K`) and `turn`.
    pub fn accuracy_rows(&self) -> Result<Vec<AccRow>, String> {
        let Some(df) = &self.accuracy else {
            return Err(self
                .accuracy_missing
                .clone()
                .unwrap_or_else(|| "no accuracy table".into()));
        };
        let n = df.height();
        if n == 0 {
            return Err("accuracy.parquet has no rows".into());
        }
        let need = |c: &str| {
            strs(df, c).ok_or_else(|| {
                format!(
                    "accuracy.parquet has no column `{c}` (expected task, engine, budget and correct or accuracy)"
                )
            })
        };
        let task = need("task")?;
        let engine = need("engine")?;
        let budget = f64s(df, "budget").ok_or_else(|| {
            "accuracy.parquet has no column `budget` (expected task, engine, budget and correct or accuracy)"
                .to_string()
        })?;
        let value = f64s(df, "correct")
            .or_else(|| f64s(df, "accuracy"))
            .ok_or_else(|| {
                "accuracy.parquet has neither `correct` nor `accuracy` (expected one of them)"
                    .to_string()
            })?;
        let repeat = f64s(df, "repeat").unwrap_or_else(|| vec![None; n]);
        let bucket = strs(df, "bucket").unwrap_or_else(|| vec![None; n]);
        let turn = f64s(df, "turn").unwrap_or_else(|| vec![None; n]);
        let cell_key = strs(df, schema::CELL_KEY).unwrap_or_else(|| vec![None; n]);
        let params_of: BTreeMap<&str, &str> = self
            .runs
            .iter()
            .filter_map(|r| Some((r.cell_key.as_deref()?, r.params.as_str())))
            .collect();
        Ok((0..n)
            .filter_map(|i| {
                Some(AccRow {
                    task: task[i].clone()?,
                    engine: engine[i].clone()?,
                    budget: budget[i],
                    repeat: repeat[i].map(|r| r as i64),
                    value: value[i]?,
                    bucket: bucket[i].clone(),
                    turn: turn[i],
                    params: cell_key[i]
                        .as_deref()
                        .and_then(|k| params_of.get(k))
                        .map_or_else(String::new, |p| p.to_string()),
                    cell_key: cell_key[i].clone(),
                })
            })
            .collect())
    }

    /// Why a figure built on `runs.parquet` has nothing to draw, if so.
    pub fn no_runs(&self) -> Option<String> {
        self.runs_missing.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_that_did_not_finish_are_named_by_kind() {
        use polars::prelude::{NamedFrom, Series};
        let s = |name: &str, v: Vec<Option<&str>>| Column::from(Series::new(name.into(), v));
        let df = DataFrame::new(
            3,
            vec![
                s("engine", vec![Some("full"), Some("h2o"), Some("h2o")]),
                s("outcome", vec![Some("ok"), Some("error"), Some("oom")]),
                s(
                    schema::CELL_KEY,
                    vec![
                        Some("kind=retention;engine=full;params=;budget=1;bucket=1K-2K"),
                        Some("kind=retention;engine=h2o;params=;budget=0.3;bucket=4K-8K"),
                        Some("kind=accuracy;engine=h2o;params=;budget=0.3;task=copa"),
                    ],
                ),
            ],
        )
        .unwrap();
        let t = Tables::from_frames(Path::new("x"), Some(&df), None, None);
        assert_eq!(
            t.unfinished("retention", &["budget", "bucket"]),
            ["h2o budget=0.3 bucket=4K-8K: error"]
        );
        assert_eq!(t.unfinished("accuracy", &["task"]), ["h2o task=copa: OOM"]);
        assert!(unfinished_note(&vec!["a".to_string(); 8]).ends_with("; and 2 more."));
    }

    #[test]
    fn a_missing_repeat_or_metric_reads_as_null_not_zero() {
        use polars::prelude::{NamedFrom, Series};
        let col = |name: &str, v: Vec<Option<f64>>| Column::from(Series::new(name.into(), v));
        let s = |name: &str, v: Vec<Option<&str>>| Column::from(Series::new(name.into(), v));
        let df = DataFrame::new(
            2,
            vec![
                s("engine", vec![Some("full"), Some("h2o")]),
                s("outcome", vec![Some("ok"), Some("ok")]),
                col("repeat", vec![Some(1.0), None]),
                col("metrics_duration_s", vec![Some(2.0), None]),
            ],
        )
        .unwrap();
        let t = Tables::from_frames(Path::new("x"), Some(&df), None, None);
        assert_eq!(t.runs[0].repeat, Some(1));
        assert_eq!(t.runs[1].repeat, None);
        assert_eq!(t.runs[0].get("metrics_duration_s"), Some(2.0));
        assert_eq!(t.runs[1].get("metrics_duration_s"), None);
        // An older table without these columns: null, and named as missing.
        let old = df
            .drop("repeat")
            .unwrap()
            .drop("metrics_duration_s")
            .unwrap();
        let t = Tables::from_frames(Path::new("x"), Some(&old), None, None);
        assert!(t.runs.iter().all(|r| r.repeat.is_none()));
        assert!(t.runs.iter().all(|r| r.get("metrics_duration_s").is_none()));
        assert!(t.missing_columns.contains("metrics_duration_s"));
    }

    #[test]
    fn distribution_labels_are_short() {
        assert_eq!(dist_label(r#"{"uniform":[1000,10000]}"#), "uniform 1K–10K");
        assert_eq!(dist_label(r#"{"list":[64,96]}"#), "list 64–96");
    }
}
