//! `kvbench compare A B`: check a run against a baseline. Both are experiments'
//! results directories (`runs.parquet`, one row per cell); cells are matched by their
//! `cell_key` (the same parameters and repeat).
//!
//! - Outcomes, the ledger's bytes (`mem_weights_bytes`, `mem_kv_device_bytes`,
//!   `mem_kv_host_bytes`, `mem_activations_peak_bytes`) and accuracy columns
//!   (`accuracy*`, when an experiment records them) are compared exactly, cell by
//!   cell: any difference is a regression (an `ok` cell becoming `oom` or `error`, or
//!   a strategy holding other bytes than before).
//! - Timings are compared as ratios B/A with a tolerance, per matrix point: the
//!   repeats of a point are reduced to their best value (least time, most
//!   throughput), since a busy machine only ever slows a run down. A timing more than
//!   `1 + tolerance` times worse is a regression. Tail percentiles (`ttft_p99_s`,
//!   `itl_p99_s`) are shown but do not fail: with a handful of requests they are one
//!   sample each.
//! - With `--relative-to ENGINE`, each point's timings are first divided by those of
//!   the point of ENGINE in the same run with the same parameters (engine, its
//!   parameters and the budget aside), repeat by repeat (a sweep runs repeats in
//!   rounds, so a pair ran seconds apart), the median of these ratios standing for
//!   the point; these within-run ratios are compared between A and B: never absolute
//!   seconds across machines.
//! - Observed peaks (`mem_device_peak_bytes`, `mem_host_peak_bytes`) depend on the
//!   machine: shown as ratios, never a regression.
//!
//! Cells present on one side only are listed. The exit status is non-zero when there
//! is a regression, and the error names each offending cell and metric.

use crate::commands::compare::CompareArgs;
use anyhow::{bail, Context, Result};
use kvbench_plots::schema;
use polars::prelude::{DataFrame, DataType};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Whether a smaller or a larger value of a timing is better.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Better {
    Lower,
    Higher,
}

/// A timing column of runs.parquet compared as a ratio.
struct Timing {
    column: &'static str,
    /// Table heading.
    head: &'static str,
    better: Better,
    /// A slowdown past the tolerance is a regression (tails are shown only).
    gated: bool,
}

const TIMINGS: &[Timing] = &[
    Timing {
        column: schema::TTFT_MEAN_S,
        head: "TTFT",
        better: Better::Lower,
        gated: true,
    },
    Timing {
        column: schema::TTFT_P99_S,
        head: "TTFT99",
        better: Better::Lower,
        gated: false,
    },
    Timing {
        column: schema::TPOT_MEAN_S,
        head: "TPOT",
        better: Better::Lower,
        gated: true,
    },
    Timing {
        column: schema::ITL_P99_S,
        head: "ITL99",
        better: Better::Lower,
        gated: false,
    },
    Timing {
        column: schema::E2E_MEAN_S,
        head: "E2E",
        better: Better::Lower,
        gated: true,
    },
    Timing {
        column: schema::DECODE_TOK_S,
        head: "dec/s",
        better: Better::Higher,
        gated: true,
    },
    Timing {
        column: schema::THROUGHPUT_TOK_S,
        head: "tok/s",
        better: Better::Higher,
        gated: true,
    },
    Timing {
        column: schema::WALL_PREFILL_S,
        head: "prefill",
        better: Better::Lower,
        gated: true,
    },
    Timing {
        column: schema::WALL_DECODE_S,
        head: "decode",
        better: Better::Lower,
        gated: true,
    },
    Timing {
        column: schema::WALL_CACHE_OPS_S,
        head: "cache",
        better: Better::Lower,
        gated: true,
    },
];

/// The ledger's byte counts: exact.
const LEDGER: &[&str] = &[
    schema::MEM_WEIGHTS_BYTES,
    schema::MEM_KV_DEVICE_BYTES,
    schema::MEM_KV_HOST_BYTES,
    schema::MEM_ACTIVATIONS_PEAK_BYTES,
];

/// Observed peaks (vary by machine): shown, never a regression.
const OBSERVED: &[(&str, &str)] = &[
    (schema::MEM_DEVICE_PEAK_BYTES, "devpeak"),
    (schema::MEM_HOST_PEAK_BYTES, "RSS"),
];

/// Columns compared exactly when both runs have them.
const ACCURACY_PREFIX: &str = "accuracy";

/// One row of runs.parquet.
#[derive(Debug, Clone)]
struct Cell {
    /// The key's `name=value` fields in order.
    fields: Vec<(String, String)>,
    outcome: String,
    error: Option<String>,
    timings: Vec<Option<f64>>,
    ledger: Vec<Option<i64>>,
    observed: Vec<Option<f64>>,
    accuracy: BTreeMap<String, Option<f64>>,
}

impl Cell {
    fn field(&self, name: &str) -> &str {
        field(&self.fields, name)
    }
}

fn field<'a>(fields: &'a [(String, String)], name: &str) -> &'a str {
    fields
        .iter()
        .find(|(k, _)| k == name)
        .map_or("", |(_, v)| v.as_str())
}

/// `engine=full;params=;batch=2;...;repeat=0` into its fields.
fn parse_key(key: &str) -> Vec<(String, String)> {
    key.split(';')
        .map(|f| match f.split_once('=') {
            Some((k, v)) => (k.to_string(), v.to_string()),
            None => (f.to_string(), String::new()),
        })
        .collect()
}

fn join_fields<'a>(fields: impl Iterator<Item = &'a (String, String)>) -> String {
    fields
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(";")
}

/// A cell's matrix point: its key without the repeat.
fn point_key(fields: &[(String, String)]) -> String {
    join_fields(fields.iter().filter(|(k, _)| k != "repeat"))
}

/// What must be equal for a cell and its reference: the key without engine, the
/// engine's parameters, the budget and the repeat.
fn context_key(fields: &[(String, String)]) -> String {
    join_fields(
        fields
            .iter()
            .filter(|(k, _)| !["engine", "params", "budget", "repeat"].contains(&k.as_str())),
    )
}

/// One side of the comparison: the cells of one runs.parquet.
struct Run {
    /// The path as given.
    shown: String,
    experiment: String,
    /// CPU / GPU and revision of the first cell, when recorded.
    machine: String,
    /// The model and weight dtype, when recorded: runs of different ones are not
    /// compared.
    model: Option<(String, String)>,
    cells: BTreeMap<String, Cell>,
}

/// runs.parquet of a results directory, or the file itself.
fn runs_path(p: &Path) -> Result<PathBuf> {
    let hint = "expected an experiment's results directory (results/<name>/ with runs.parquet) or a runs.parquet file";
    if p.is_dir() {
        let f = p.join(schema::RUNS_FILE);
        if f.is_file() {
            return Ok(f);
        }
        if p.join("cells").is_dir() {
            bail!(
                "{}: no runs.parquet; the cells are recorded but the tables are not built: run `kvbench run EXPERIMENT.yaml --tables-only --results {}`",
                p.display(),
                p.parent().map_or(".".into(), |d| d.display().to_string())
            );
        }
        bail!("{}: no runs.parquet in this directory; {hint}", p.display());
    }
    if p.is_file() {
        return Ok(p.to_path_buf());
    }
    bail!("{}: no such file or directory; {hint}", p.display())
}

/// A column as f64 values (nulls kept), or None when absent.
pub(crate) fn floats(df: &DataFrame, name: &str) -> Result<Option<Vec<Option<f64>>>> {
    let Ok(c) = df.column(name) else {
        return Ok(None);
    };
    let c = c
        .cast(&DataType::Float64)
        .with_context(|| format!("column `{name}`: expected numbers"))?;
    Ok(Some(c.f64()?.iter().collect()))
}

pub(crate) fn ints(df: &DataFrame, name: &str) -> Result<Option<Vec<Option<i64>>>> {
    let Ok(c) = df.column(name) else {
        return Ok(None);
    };
    let c = c
        .cast(&DataType::Int64)
        .with_context(|| format!("column `{name}`: expected integers"))?;
    Ok(Some(c.i64()?.iter().collect()))
}

pub(crate) fn strings(df: &DataFrame, name: &str) -> Result<Option<Vec<Option<String>>>> {
    let Ok(c) = df.column(name) else {
        return Ok(None);
    };
    let c = c
        .cast(&DataType::String)
        .with_context(|| format!("column `{name}`: expected text"))?;
    Ok(Some(
        c.str()?.iter().map(|s| s.map(str::to_owned)).collect(),
    ))
}

fn load(p: &Path) -> Result<Run> {
    let file = runs_path(p)?;
    let df = schema::read_table(&file)
        .map_err(|e| anyhow::anyhow!("{e}; expected the runs.parquet written by `kvbench run`"))?;
    if df.height() == 0 {
        bail!("{}: no cells recorded", file.display());
    }
    let need = |name: &str| -> anyhow::Error {
        anyhow::anyhow!(
            "{}: no column `{name}`; expected the runs.parquet of `kvbench run` (rebuild it from the cells with `kvbench run EXPERIMENT.yaml --tables-only`)",
            file.display()
        )
    };
    let keys = strings(&df, schema::CELL_KEY)?.ok_or_else(|| need(schema::CELL_KEY))?;
    let outcomes = strings(&df, "outcome")?.ok_or_else(|| need("outcome"))?;
    let errors = strings(&df, "error")?.ok_or_else(|| need("error"))?;
    let mut timings = Vec::new();
    for t in TIMINGS {
        timings.push(floats(&df, t.column)?.ok_or_else(|| need(t.column))?);
    }
    let mut ledger = Vec::new();
    for c in LEDGER {
        ledger.push(ints(&df, c)?.ok_or_else(|| need(c))?);
    }
    let mut observed = Vec::new();
    for (c, _) in OBSERVED {
        observed.push(floats(&df, c)?.ok_or_else(|| need(c))?);
    }
    let mut accuracy = Vec::new();
    for name in df.get_column_names() {
        if name.starts_with(ACCURACY_PREFIX) {
            let v = floats(&df, name)?.unwrap_or_default();
            accuracy.push((name.to_string(), v));
        }
    }
    let first = |c: &str| -> Option<String> {
        strings(&df, c)
            .ok()
            .flatten()
            .and_then(|v| v.into_iter().flatten().next())
    };
    let experiment = first(schema::EXPERIMENT).unwrap_or_default();
    let machine = [
        first("env_gpu_name"),
        first("env_cpu_model"),
        first("env_cpu_cores").map(|n| format!("{n} cores")),
        first("env_git_revision").map(|r| format!("rev {}", &r[..r.len().min(10)])),
    ]
    .into_iter()
    .flatten()
    .collect::<Vec<_>>()
    .join(", ");
    let mut cells = BTreeMap::new();
    for i in 0..df.height() {
        let key = keys[i]
            .clone()
            .with_context(|| format!("{}: row {i} has no cell_key", file.display()))?;
        let cell = Cell {
            fields: parse_key(&key),
            outcome: outcomes[i].clone().unwrap_or_default(),
            error: errors[i].clone(),
            timings: timings.iter().map(|c| c[i]).collect(),
            ledger: ledger.iter().map(|c| c[i]).collect(),
            observed: observed.iter().map(|c| c[i]).collect(),
            accuracy: accuracy
                .iter()
                .map(|(n, v)| (n.clone(), v.get(i).copied().flatten()))
                .collect(),
        };
        if cells.insert(key.clone(), cell).is_some() {
            bail!("{}: cell_key `{key}` appears twice", file.display());
        }
    }
    // A dtype left to its default is "default", and matches any.
    let model = file.parent().and_then(|d| {
        let r = |k| crate::experiment::recorded(d, k);
        Some((r("model")?, r("dtype").unwrap_or_else(|| "default".into())))
    });
    Ok(Run {
        shown: p.display().to_string(),
        experiment,
        machine,
        model,
        cells,
    })
}

/// The repeats of one matrix point in one run.
struct Point<'a> {
    fields: &'a [(String, String)],
    cells: Vec<&'a Cell>,
}

impl Point<'_> {
    fn engine(&self) -> &str {
        field(self.fields, "engine")
    }

    /// Best value of timing `i` over the point's `ok` repeats.
    fn best(&self, i: usize) -> Option<f64> {
        let vals = self
            .cells
            .iter()
            .filter(|c| c.outcome == "ok")
            .filter_map(|c| c.timings[i])
            .filter(|v| v.is_finite());
        match TIMINGS[i].better {
            Better::Lower => vals.reduce(f64::min),
            Better::Higher => vals.reduce(f64::max),
        }
    }

    /// Timing `i` relative to the point `r` of the reference engine: the median over
    /// repeats of the ratio of this point's repeat to the reference's repeat of the
    /// same number (both `ok`). A sweep runs repeats in rounds, so the two cells of a
    /// pair ran seconds apart under the same load; the median leaves out a round where
    /// either was disturbed, where the ratio of the two points' bests would divide
    /// values measured at different times.
    fn relative(&self, i: usize, r: &Point<'_>) -> Option<f64> {
        let value = |c: &Cell| c.timings[i].filter(|v| c.outcome == "ok" && v.is_finite());
        let mut ratios: Vec<f64> = self
            .cells
            .iter()
            .filter_map(|c| {
                let repeat = c.field("repeat");
                let d = r.cells.iter().find(|rc| rc.field("repeat") == repeat)?;
                let (x, d) = (value(c)?, value(d)?);
                (d > 0.0).then_some(x / d)
            })
            .collect();
        ratios.sort_by(f64::total_cmp);
        let n = ratios.len();
        match n {
            0 => None,
            _ if n % 2 == 1 => Some(ratios[n / 2]),
            _ => Some((ratios[n / 2 - 1] + ratios[n / 2]) / 2.0),
        }
    }

    /// Largest value of observed peak `i` over the point's repeats.
    fn observed(&self, i: usize) -> Option<f64> {
        self.cells
            .iter()
            .filter_map(|c| c.observed[i])
            .reduce(f64::max)
    }
}

fn points(run: &Run) -> BTreeMap<String, Point<'_>> {
    let mut out: BTreeMap<String, Point<'_>> = BTreeMap::new();
    for c in run.cells.values() {
        out.entry(point_key(&c.fields))
            .or_insert_with(|| Point {
                fields: &c.fields,
                cells: Vec::new(),
            })
            .cells
            .push(c);
    }
    out
}

/// The point of engine `reference` with the same parameters as `p` (its engine, the
/// engine's parameters and the budget aside). Among several, the one with the same
/// budget, then with the same parameters; None when there is none or no single one.
fn reference_of<'a>(
    p: &Point<'_>,
    all: &'a BTreeMap<String, Point<'a>>,
    reference: &str,
) -> Option<&'a Point<'a>> {
    let ctx = context_key(p.fields);
    let mut cands: Vec<&Point> = all
        .values()
        .filter(|q| q.engine() == reference && context_key(q.fields) == ctx)
        .collect();
    for name in ["budget", "params"] {
        if cands.len() > 1 {
            let same: Vec<&Point> = cands
                .iter()
                .copied()
                .filter(|q| field(q.fields, name) == field(p.fields, name))
                .collect();
            if !same.is_empty() {
                cands = same;
            }
        }
    }
    (cands.len() == 1).then(|| cands[0])
}

/// A regression: the cell (or point) and what went wrong.
#[derive(Debug)]
struct Regression {
    key: String,
    what: String,
}

/// How timing `i` of a point compares: the ratio B/A (of within-run ratios when
/// relative), and whether it is past the tolerance.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Verdict {
    /// Not comparable (unmeasured on both sides, no reference, zero baseline).
    None,
    Ratio {
        ratio: f64,
        regressed: bool,
    },
}

/// Compare baseline value `a` with `b` for a timing where `better` is better.
fn judge(a: f64, b: f64, better: Better, tolerance: f64, gated: bool) -> Verdict {
    if !(a.is_finite() && b.is_finite()) || a < 0.0 || b < 0.0 {
        return Verdict::None;
    }
    if a == 0.0 {
        return if b == 0.0 {
            Verdict::Ratio {
                ratio: 1.0,
                regressed: false,
            }
        } else {
            Verdict::None
        };
    }
    let ratio = b / a;
    let slowdown = match better {
        Better::Lower => ratio,
        Better::Higher if ratio > 0.0 => 1.0 / ratio,
        Better::Higher => f64::INFINITY,
    };
    Verdict::Ratio {
        ratio,
        regressed: gated && slowdown > 1.0 + tolerance,
    }
}

fn fmt_bytes(v: Option<i64>) -> String {
    v.map_or("null".into(), |x| x.to_string())
}

fn fmt_num(v: f64) -> String {
    if v != 0.0 && (v.abs() >= 1e4 || v.abs() < 1e-3) {
        format!("{v:.3e}")
    } else {
        format!("{v:.4}")
    }
}

fn short(s: &str, n: usize) -> String {
    let s = s.lines().next().unwrap_or("");
    if s.chars().count() <= n {
        s.to_string()
    } else {
        format!("{}…", s.chars().take(n).collect::<String>())
    }
}

/// A point's fields for the table: defaults left out.
fn label(fields: &[(String, String)]) -> String {
    let mut out = Vec::new();
    for (k, v) in fields {
        let s = match (k.as_str(), v.as_str()) {
            ("repeat", _) | ("params", "") | ("chunk", "-") | ("rate", "inf") => continue,
            ("burstiness", "1") => continue,
            ("engine", v) => v.to_string(),
            ("params", v) => format!("[{v}]"),
            ("batch", v) => format!("b{v}"),
            ("prompt", v) => format!("p{v}"),
            ("output", v) => format!("o{v}"),
            ("budget", v) => format!("@{v}"),
            ("attention", v) => v.to_string(),
            ("chunk", v) => format!("c{v}"),
            ("max_concurrency", v) => format!("conc{v}"),
            (k, v) => format!("{k}={v}"),
        };
        out.push(s);
    }
    out.join(" ")
}

/// Everything found, for printing and the exit status.
struct Report {
    table: Vec<Vec<String>>,
    only_a: Vec<String>,
    only_b: Vec<String>,
    no_reference: Vec<String>,
    regressions: Vec<Regression>,
    /// The largest slowdown factor among gated timings, and where.
    worst: Option<(f64, String)>,
    matched_cells: usize,
    matched_points: usize,
}

/// Outcomes, ledger bytes and accuracy of the cells both runs have, compared exactly.
struct Exact {
    regressions: Vec<Regression>,
    /// Per point: whether the ledger bytes of every matched cell are equal.
    exact_ok: BTreeMap<String, bool>,
    /// Per point: its outcome, or `A→B` where it changed.
    outcome_of: BTreeMap<String, String>,
    matched_cells: usize,
}

fn exact_checks(a: &Run, b: &Run) -> Exact {
    let mut regressions = Vec::new();
    let mut exact_ok: BTreeMap<String, bool> = BTreeMap::new();
    let mut outcome_of: BTreeMap<String, String> = BTreeMap::new();
    let mut matched_cells = 0;
    for (key, ca) in &a.cells {
        let Some(cb) = b.cells.get(key) else {
            continue;
        };
        matched_cells += 1;
        let pk = point_key(&ca.fields);
        let mut bytes_equal = true;
        if ca.outcome != cb.outcome {
            let kind = if ca.outcome == "ok" {
                "regression"
            } else {
                "changed"
            };
            let err = cb
                .error
                .as_deref()
                .map_or(String::new(), |e| format!(": {}", short(e, 160)));
            regressions.push(Regression {
                key: key.clone(),
                what: format!(
                    "outcome {} → {} ({kind}; outcomes are compared exactly){err}",
                    ca.outcome, cb.outcome
                ),
            });
            outcome_of
                .entry(pk.clone())
                .or_insert(format!("{}→{}", ca.outcome, cb.outcome));
        } else {
            outcome_of.entry(pk.clone()).or_insert(ca.outcome.clone());
            for (i, col) in LEDGER.iter().enumerate() {
                if ca.ledger[i] != cb.ledger[i] {
                    bytes_equal = false;
                    regressions.push(Regression {
                        key: key.clone(),
                        what: format!(
                            "{col}: A {}, B {} (ledger bytes are compared exactly)",
                            fmt_bytes(ca.ledger[i]),
                            fmt_bytes(cb.ledger[i])
                        ),
                    });
                }
            }
            for (col, va) in &ca.accuracy {
                let Some(vb) = cb.accuracy.get(col) else {
                    continue;
                };
                if va != vb {
                    regressions.push(Regression {
                        key: key.clone(),
                        what: format!(
                            "{col}: A {}, B {} (accuracy is compared exactly)",
                            va.map_or("null".into(), fmt_num),
                            vb.map_or("null".into(), fmt_num)
                        ),
                    });
                }
            }
        }
        let e = exact_ok.entry(pk).or_insert(true);
        *e &= bytes_equal;
    }
    Exact {
        regressions,
        exact_ok,
        outcome_of,
        matched_cells,
    }
}

/// Keys of the cells of `a` that `b` does not have.
fn only_in(a: &Run, b: &Run) -> Vec<String> {
    a.cells
        .keys()
        .filter(|k| !b.cells.contains_key(*k))
        .cloned()
        .collect()
}

/// The timing comparison: one table row per matched point, its regressions and the
/// largest slowdown.
struct Timings {
    table: Vec<Vec<String>>,
    no_reference: Vec<String>,
    regressions: Vec<Regression>,
    worst: Option<(f64, String)>,
    matched_points: usize,
}

/// Timings, point by point (best over repeats), as ratios B/A, or with `relative_to`
/// as ratios of ratios to the reference engine's point (repeat by repeat, the median).
fn timing_rows(
    a: &Run,
    b: &Run,
    exact: &Exact,
    tolerance: f64,
    relative_to: Option<&str>,
) -> Timings {
    let (exact_ok, outcome_of) = (&exact.exact_ok, &exact.outcome_of);
    let mut regressions = Vec::new();
    let (pa, pb) = (points(a), points(b));
    let mut table = Vec::new();
    let mut no_reference = Vec::new();
    let mut matched_points = 0;
    let mut worst: Option<(f64, String)> = None;
    for (pk, p) in &pa {
        let Some(q) = pb.get(pk) else {
            continue;
        };
        if !exact_ok.contains_key(pk) {
            // No cell of this point on both sides (repeats differ): nothing matched.
            continue;
        }
        matched_points += 1;
        let both_ok =
            p.cells.iter().any(|c| c.outcome == "ok") && q.cells.iter().any(|c| c.outcome == "ok");
        let is_reference = relative_to.is_some_and(|r| p.engine() == r);
        let refs = match relative_to {
            Some(r) if !is_reference => {
                let (ra, rb) = (reference_of(p, &pa, r), reference_of(q, &pb, r));
                if (ra.is_none() || rb.is_none()) && both_ok {
                    no_reference.push(pk.clone());
                }
                Some((ra, rb))
            }
            _ => None,
        };
        let mut row = vec![
            label(p.fields),
            outcome_of.get(pk).cloned().unwrap_or_default(),
        ];
        for (i, t) in TIMINGS.iter().enumerate() {
            let (va, vb) = (p.best(i), q.best(i));
            if !both_ok || is_reference {
                row.push(if is_reference { "ref" } else { "-" }.into());
                continue;
            }
            if let (Some(x), None) = (va, vb) {
                if t.gated {
                    regressions.push(Regression {
                        key: pk.clone(),
                        what: format!("{}: measured in A ({}), null in B", t.column, fmt_num(x)),
                    });
                }
                row.push("null".into());
                continue;
            }
            let pair = match refs {
                None => va.zip(vb),
                Some((ra, rb)) => ra
                    .and_then(|r| p.relative(i, r))
                    .zip(rb.and_then(|r| q.relative(i, r))),
            };
            let Some((x, y)) = pair else {
                row.push("-".into());
                continue;
            };
            match judge(x, y, t.better, tolerance, t.gated) {
                Verdict::None => row.push("n/a".into()),
                Verdict::Ratio { ratio, regressed } => {
                    row.push(format!("{ratio:.2}{}", if regressed { "!" } else { "" }));
                    let (factor, dir) = match t.better {
                        Better::Lower => (ratio, "slower"),
                        Better::Higher => (1.0 / ratio, "lower throughput"),
                    };
                    if t.gated && worst.as_ref().is_none_or(|w| factor > w.0) {
                        worst = Some((factor, format!("{}, {}", t.column, label(p.fields))));
                    }
                    if regressed {
                        let rel =
                            relative_to.map_or(String::new(), |r| format!(" relative to `{r}`"));
                        regressions.push(Regression {
                            key: pk.clone(),
                            what: format!(
                                "{}{rel}: A {}, B {} (B/A {ratio:.3}: {factor:.2}× {dir}, tolerance {:.0}%)",
                                t.column,
                                fmt_num(x),
                                fmt_num(y),
                                tolerance * 100.0
                            ),
                        });
                    }
                }
            }
        }
        row.push(if exact_ok[pk] { "=" } else { "≠!" }.into());
        for i in 0..OBSERVED.len() {
            row.push(match (p.observed(i), q.observed(i)) {
                (Some(x), Some(y)) if x > 0.0 => format!("{:.2}", y / x),
                _ => "-".into(),
            });
        }
        table.push(row);
    }
    Timings {
        table,
        no_reference,
        regressions,
        worst,
        matched_points,
    }
}

fn compare(a: &Run, b: &Run, tolerance: f64, relative_to: Option<&str>) -> Report {
    let exact = exact_checks(a, b);
    let t = timing_rows(a, b, &exact, tolerance, relative_to);
    let mut regressions = exact.regressions;
    regressions.extend(t.regressions);
    Report {
        table: t.table,
        only_a: only_in(a, b),
        only_b: only_in(b, a),
        no_reference: t.no_reference,
        regressions,
        worst: t.worst,
        matched_cells: exact.matched_cells,
        matched_points: t.matched_points,
    }
}

fn print_table(rows: &[Vec<String>]) {
    let mut head: Vec<String> = vec!["point (A = baseline, B/A ratios)".into(), "outcome".into()];
    head.extend(TIMINGS.iter().map(|t| t.head.to_string()));
    head.push("bytes".into());
    head.extend(OBSERVED.iter().map(|(_, h)| h.to_string()));
    let n = head.len();
    let mut w = vec![0; n];
    for r in std::iter::once(&head).chain(rows) {
        for (j, s) in r.iter().enumerate() {
            w[j] = w[j].max(s.chars().count());
        }
    }
    let line = |r: &[String]| {
        let cells: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(j, s)| {
                let pad = w[j] - s.chars().count();
                if j < 2 {
                    format!("{s}{}", " ".repeat(pad))
                } else {
                    format!("{}{s}", " ".repeat(pad))
                }
            })
            .collect();
        println!("{}", cells.join("  ").trim_end());
    };
    line(&head);
    for r in rows {
        line(r);
    }
}

fn describe(tag: &str, r: &Run) {
    let machine = if r.machine.is_empty() {
        String::new()
    } else {
        format!(", {}", r.machine)
    };
    println!(
        "{tag}: {} (experiment `{}`, {} cells{machine})",
        r.shown,
        r.experiment,
        r.cells.len()
    );
}

/// Compare, print the table and fail on a regression (`kvbench compare`).
pub fn run(args: &CompareArgs) -> Result<()> {
    let a = load(&args.a)?;
    let b = load(&args.b)?;
    if let (Some(ma), Some(mb)) = (&a.model, &b.model) {
        // A dtype left to its default matches any.
        if ma.0 != mb.0 || (ma.1 != mb.1 && ma.1 != "default" && mb.1 != "default") {
            bail!(
                "A ({}) ran {} (dtype {}), B ({}) ran {} (dtype {}): timings, outcomes and \
                 bytes of different models or weight formats are not a regression of one another",
                a.shown,
                ma.0,
                ma.1,
                b.shown,
                mb.0,
                mb.1
            );
        }
    }
    if let Some(r) = &args.relative_to {
        for side in [&a, &b] {
            if !side.cells.values().any(|c| c.field("engine") == r) {
                let engines: BTreeSet<&str> =
                    side.cells.values().map(|c| c.field("engine")).collect();
                bail!(
                    "--relative-to {r}: {} has no `{r}` cells to divide by; expected one of its engines: {}",
                    side.shown,
                    engines.into_iter().collect::<Vec<_>>().join(", ")
                );
            }
        }
    }
    let rep = compare(&a, &b, args.tolerance, args.relative_to.as_deref());
    describe("A", &a);
    describe("B", &b);
    if rep.matched_cells == 0 {
        bail!(
            "{} and {} have no cell in common (no equal cell_key): expected two runs of the same experiment",
            a.shown,
            b.shown
        );
    }
    let gated: Vec<&str> = TIMINGS
        .iter()
        .filter(|t| t.gated)
        .map(|t| t.column)
        .collect();
    println!(
        "timings: ratios B/A{}",
        args.relative_to.as_deref().map_or(
            " of the best of each point's repeats".to_string(),
            |r| format!(
                " of each point's timings relative to the same parameters' `{r}` point of its \
                 own run (`ref`): the median over repeats of repeat-by-repeat ratios"
            )
        )
    );
    println!(
        "  a regression: more than {:.0}% worse ({:.2}×) in {}; TTFT99 and ITL99 shown only",
        args.tolerance * 100.0,
        1.0 + args.tolerance,
        gated.join(", ")
    );
    println!(
        "  exact: outcomes, ledger bytes (`bytes`), accuracy; shown only: observed peaks (devpeak, RSS); `!` marks a regression"
    );
    print_table(&rep.table);
    println!(
        "{} cells matched ({} points)",
        rep.matched_cells, rep.matched_points
    );
    for (tag, keys) in [
        ("only in A", &rep.only_a),
        ("only in B", &rep.only_b),
        (
            "timings not compared: no single reference cell in A or B",
            &rep.no_reference,
        ),
    ] {
        if !keys.is_empty() {
            println!("{tag} ({}):", keys.len());
            for k in keys {
                println!("  {k}");
            }
        }
    }
    if let Some((f, at)) = &rep.worst {
        println!(
            "largest timing slowdown: {f:.2}× ({at}); tolerance {:.0}% ({:.2}×)",
            args.tolerance * 100.0,
            1.0 + args.tolerance
        );
    }
    if rep.regressions.is_empty() {
        println!("no regressions");
        return Ok(());
    }
    let cells: BTreeSet<&str> = rep.regressions.iter().map(|r| r.key.as_str()).collect();
    let mut msg = format!(
        "{} regression(s) in {} cell(s) of {} against {}:",
        rep.regressions.len(),
        cells.len(),
        b.shown,
        a.shown
    );
    for r in &rep.regressions {
        msg.push_str(&format!("\n  {}: {}", r.key, r.what));
    }
    bail!(msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(key: &str, outcome: &str, decode: f64) -> Cell {
        let mut timings = vec![Some(1.0); TIMINGS.len()];
        let i = TIMINGS
            .iter()
            .position(|t| t.column == "decode_tok_s")
            .unwrap();
        timings[i] = Some(decode);
        Cell {
            fields: parse_key(key),
            outcome: outcome.into(),
            error: None,
            timings,
            ledger: vec![Some(100); LEDGER.len()],
            observed: vec![None; OBSERVED.len()],
            accuracy: BTreeMap::new(),
        }
    }

    fn run_of(cells: Vec<Cell>) -> Run {
        Run {
            shown: "x".into(),
            experiment: "e".into(),
            machine: String::new(),
            model: None,
            cells: cells
                .into_iter()
                .map(|c| (join_fields(c.fields.iter()), c))
                .collect(),
        }
    }

    fn key(engine: &str, params: &str, budget: &str, repeat: usize) -> String {
        format!("engine={engine};params={params};batch=2;prompt=64;output=16;budget={budget};attention=flash;chunk=-;rate=inf;burstiness=1;repeat={repeat}")
    }

    #[test]
    fn keys_split_into_points_and_contexts() {
        let f = parse_key(&key("h2o", "stats=exact,ratio=total", "0.5", 2));
        assert_eq!(field(&f, "params"), "stats=exact,ratio=total");
        assert_eq!(field(&f, "repeat"), "2");
        assert!(!point_key(&f).contains("repeat"));
        assert_eq!(
            context_key(&f),
            context_key(&parse_key(&key("full", "", "1", 0)))
        );
        assert_eq!(
            label(&f),
            "h2o [stats=exact,ratio=total] b2 p64 o16 @0.5 flash"
        );
    }

    #[test]
    fn slowdowns_past_the_tolerance_are_regressions_in_both_directions() {
        let t = 0.25;
        let r = |a, b, better| match judge(a, b, better, t, true) {
            Verdict::Ratio { regressed, .. } => Some(regressed),
            Verdict::None => None,
        };
        assert_eq!(r(1.0, 1.2, Better::Lower), Some(false));
        assert_eq!(r(1.0, 1.3, Better::Lower), Some(true));
        assert_eq!(r(1.0, 0.1, Better::Lower), Some(false), "faster is fine");
        assert_eq!(r(100.0, 81.0, Better::Higher), Some(false));
        assert_eq!(r(100.0, 79.0, Better::Higher), Some(true), "1/0.79 > 1.25");
        assert_eq!(r(100.0, 0.0, Better::Higher), Some(true));
        assert_eq!(r(0.0, 0.0, Better::Lower), Some(false));
        assert_eq!(r(0.0, 1.0, Better::Lower), None, "no ratio to a zero");
        assert_eq!(r(f64::NAN, 1.0, Better::Lower), None);
        assert!(matches!(
            judge(1.0, 9.0, Better::Lower, t, false),
            Verdict::Ratio {
                regressed: false,
                ..
            }
        ));
    }

    #[test]
    fn the_reference_is_the_same_parameters_under_the_reference_engine() {
        let run = run_of(vec![
            cell(&key("full", "", "1", 0), "ok", 100.0),
            cell(&key("h2o", "stats=exact", "0.5", 0), "ok", 100.0),
            cell(
                &key("h2o", "stats=exact", "0.5", 0).replace("batch=2", "batch=4"),
                "ok",
                100.0,
            ),
        ]);
        let all = points(&run);
        let h2o = &all[&point_key(&parse_key(&key("h2o", "stats=exact", "0.5", 0)))];
        let r = reference_of(h2o, &all, "full").unwrap();
        assert_eq!(r.engine(), "full");
        // batch 4 has no full point.
        let b4 = all
            .values()
            .find(|p| field(p.fields, "batch") == "4")
            .unwrap();
        assert!(reference_of(b4, &all, "full").is_none());
        assert!(reference_of(h2o, &all, "infinigen").is_none());
    }

    #[test]
    fn relative_mode_cancels_a_uniformly_slower_machine_and_keeps_a_real_slowdown() {
        let a = run_of(vec![
            cell(&key("full", "", "1", 0), "ok", 1000.0),
            cell(&key("h2o", "", "0.5", 0), "ok", 800.0),
        ]);
        // B: a machine three times slower, h2o as fast relative to full as before.
        let b = run_of(vec![
            cell(&key("full", "", "1", 0), "ok", 1000.0 / 3.0),
            cell(&key("h2o", "", "0.5", 0), "ok", 800.0 / 3.0),
        ]);
        assert!(!compare(&a, &b, 0.25, None).regressions.is_empty());
        let rep = compare(&a, &b, 0.25, Some("full"));
        assert!(rep.regressions.is_empty(), "{:?}", rep.regressions);
        // h2o alone halved relative to full: named.
        let c = run_of(vec![
            cell(&key("full", "", "1", 0), "ok", 1000.0),
            cell(&key("h2o", "", "0.5", 0), "ok", 400.0),
        ]);
        let rep = compare(&a, &c, 0.25, Some("full"));
        assert_eq!(rep.regressions.len(), 1, "{:?}", rep.regressions);
        assert!(rep.regressions[0].key.contains("engine=h2o"));
        assert!(rep.regressions[0]
            .what
            .contains("decode_tok_s relative to `full`"));
    }

    #[test]
    fn relative_mode_pairs_repeats_so_one_disturbed_round_is_no_regression() {
        let run = |full: [f64; 3], h2o: [f64; 3]| {
            let mut cells = Vec::new();
            for r in 0..3 {
                cells.push(cell(&key("full", "", "1", r), "ok", full[r]));
                cells.push(cell(&key("h2o", "", "0.5", r), "ok", h2o[r]));
            }
            run_of(cells)
        };
        let a = run([1000.0; 3], [400.0; 3]);
        // Round 0 of h2o disturbed, rounds 1 and 2 of the whole machine slower: every
        // undisturbed round keeps h2o at 0.4 of full. The ratio of the two bests
        // (160 / 1000) would call it 2.5× slower.
        let b = run([1000.0, 400.0, 400.0], [160.0, 160.0, 160.0]);
        let rep = compare(&a, &b, 0.25, Some("full"));
        assert!(rep.regressions.is_empty(), "{:?}", rep.regressions);
        // Every round at 0.16 of full: a regression.
        let c = run([1000.0; 3], [160.0; 3]);
        let rep = compare(&a, &c, 0.25, Some("full"));
        assert_eq!(rep.regressions.len(), 1, "{:?}", rep.regressions);
        // The median of an even number of rounds is the mean of the middle two; a
        // repeat missing on the reference's side is left out of the pairs.
        let mut d = run([1000.0, 1000.0, 1000.0], [400.0, 300.0, 100.0]);
        let all = points(&d);
        let (h, f) = (
            &all[&point_key(&parse_key(&key("h2o", "", "0.5", 0)))],
            &all[&point_key(&parse_key(&key("full", "", "1", 0)))],
        );
        let i = TIMINGS
            .iter()
            .position(|t| t.column == "decode_tok_s")
            .unwrap();
        assert_eq!(h.relative(i, f), Some(0.3));
        d.cells.retain(|k, _| k != &key("full", "", "1", 2));
        let all = points(&d);
        let (h, f) = (
            &all[&point_key(&parse_key(&key("h2o", "", "0.5", 0)))],
            &all[&point_key(&parse_key(&key("full", "", "1", 0)))],
        );
        assert_eq!(h.relative(i, f), Some(0.35));
    }

    #[test]
    fn repeats_reduce_to_their_best_and_outcomes_and_bytes_are_exact() {
        let a = run_of(vec![
            cell(&key("full", "", "1", 0), "ok", 1000.0),
            cell(&key("full", "", "1", 1), "ok", 500.0),
        ]);
        // One disturbed repeat on each side: the best of each point is equal.
        let b = run_of(vec![
            cell(&key("full", "", "1", 0), "ok", 300.0),
            cell(&key("full", "", "1", 1), "ok", 1000.0),
        ]);
        let rep = compare(&a, &b, 0.25, None);
        assert!(rep.regressions.is_empty(), "{:?}", rep.regressions);
        assert_eq!((rep.matched_cells, rep.matched_points), (2, 1));
        let mut c = run_of(vec![
            cell(&key("full", "", "1", 0), "oom", 1000.0),
            cell(&key("full", "", "1", 1), "ok", 1000.0),
        ]);
        c.cells.values_mut().nth(1).unwrap().ledger[1] = Some(101);
        let rep = compare(&a, &c, 0.25, None);
        let what: Vec<&str> = rep.regressions.iter().map(|r| r.what.as_str()).collect();
        assert_eq!(what.len(), 2, "{what:?}");
        assert!(what[0].starts_with("outcome ok → oom"), "{what:?}");
        assert!(
            what[1].starts_with("mem_kv_device_bytes: A 100, B 101"),
            "{what:?}"
        );
    }
}
