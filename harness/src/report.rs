//! `kvbench report results/EXP`: report.md and a self-contained report.html (figures
//! inline) with the environment, the grid, a summary table per cell and, for each of
//! the study's claims C1–C11 (../shared/design/paper-notes.md), what our data says:
//! agrees, disagrees, or cannot tell (and why).

use anyhow::{bail, Context, Result};
use base64::Engine as _;
use clap::Args;
use kvbench_plots::AccRow;
use polars::prelude::{DataFrame, ParquetReader, SerReader};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

#[derive(Debug, Args)]
pub struct ReportArgs {
    /// An experiment's results directory (results/EXP, holding runs.parquet), or just
    /// its name under ./results/.
    pub results: PathBuf,
}

/// One cell of runs.parquet: its headline columns.
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
}

impl Run {
    fn label(&self) -> String {
        if self.params.is_empty() {
            self.engine.clone()
        } else {
            format!("{} {}", self.engine, self.params)
        }
    }

    fn ok(&self) -> bool {
        self.outcome == "ok"
    }

    fn prompt(&self) -> Option<f64> {
        self.prompt_len.parse().ok()
    }

    /// Device memory the engine held (ledger: weights, device KV, activation peak).
    fn device_bytes(&self) -> Option<f64> {
        Some(self.mem_weights_bytes? + self.mem_kv_device_bytes? + self.mem_activations_peak_bytes?)
    }

    /// Device memory the strategy needed: the KV it held rather than a pool reserved
    /// up front (CUDA reserves one for every strategy); the ledger's where not recorded.
    fn needed_device_bytes(&self) -> Option<f64> {
        match self.mem_kv_device_used_peak_bytes {
            Some(kv) => Some(self.mem_weights_bytes? + kv + self.mem_activations_peak_bytes?),
            None => self.device_bytes(),
        }
    }
}

/// A column as strings, all null when the table lacks it.
fn strings(df: &DataFrame, name: &str) -> Vec<Option<String>> {
    kvbench_plots::strs(df, name).unwrap_or_else(|| vec![None; df.height()])
}

/// A column as numbers, all null when the table lacks it.
fn floats(df: &DataFrame, name: &str) -> Vec<Option<f64>> {
    kvbench_plots::f64s(df, name).unwrap_or_else(|| vec![None; df.height()])
}

/// Read runs.parquet of `dir`.
pub fn read_runs(dir: &Path) -> Result<(DataFrame, Vec<Run>)> {
    let path = dir.join("runs.parquet");
    let f = std::fs::File::open(&path).with_context(|| {
        format!(
            "{}: expected the runs table of an experiment (run `kvbench run EXP.yaml`, or \
             `--tables-only` to rebuild it from the cells)",
            path.display()
        )
    })?;
    let df = ParquetReader::new(f)
        .finish()
        .with_context(|| format!("reading {}", path.display()))?;
    let s = |n: &str| strings(&df, n);
    let x = |n: &str| floats(&df, n);
    // The strategy's parameters as the cell key spells them (`params=stats=exact`).
    let params: Vec<Option<String>> = s("cell_key")
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
    let cols: Vec<Vec<Option<f64>>> = [
        "batch",
        "output_len",
        "budget",
        "ttft_mean_s",
        "e2e_mean_s",
        "decode_tok_s",
        "decode_tok_s_per_gb",
        "mem_weights_bytes",
        "mem_kv_device_bytes",
        "mem_activations_peak_bytes",
        "mem_kv_host_bytes",
        "mem_host_peak_bytes",
        "mem_kv_device_used_peak_bytes",
    ]
    .iter()
    .map(|n| x(n))
    .collect();
    let runs = (0..df.height())
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
        })
        .collect();
    Ok((df, runs))
}

/// What our data says of one claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Agrees,
    Disagrees,
    CannotTell,
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Verdict::Agrees => "agrees",
            Verdict::Disagrees => "disagrees",
            Verdict::CannotTell => "cannot tell",
        })
    }
}

pub struct Claim {
    pub id: &'static str,
    pub text: &'static str,
    pub verdict: Verdict,
    /// Our numbers, or why the data cannot speak to it.
    pub evidence: String,
}

const CLAIMS: [(&str, &str); 11] = [
    ("C1", "vLLM (full) has the lowest TTFT at every length and reaches 128K; H2O and InfiniGen run out of memory near 10K tokens."),
    ("C2", "Under tensor parallelism OOM comes at shorter prompts than on one GPU."),
    ("C3", "InfiniGen with FlashAttention: −85% prefill memory and −77% latency vs chunked prefill at 15K."),
    ("C4", "H2O gains nothing from FlashAttention (it needs softmax(QKᵀ) for its statistics)."),
    ("C5", "vLLM pre-allocates its memory regardless of batch; H2O needs about half of it at the largest batch; InfiniGen's host memory is the largest."),
    ("C6", "vLLM and H2O decode throughput grows with batch to a similar peak; InfiniGen is an order of magnitude lower at every batch."),
    ("C7", "Throughput per GB: H2O ≈3× vLLM; InfiniGen poor and falling with batch."),
    ("C8", "Total latency: vLLM about flat across batch; InfiniGen grows superlinearly, 14× vLLM at the largest batch."),
    ("C9", "Output scaling (long prompt): vLLM ≈15× InfiniGen throughput at every output length."),
    ("C10", "Accuracy: budget 0.5 ≈ baseline; at 0.1 InfiniGen −6 pp on average, H2O loses more on some tasks; 0.02–0.04 near random."),
    ("C11", "Retention: vLLM 94–96%, InfiniGen 92–94%, H2O 70–78%, H2O worse at longer contexts."),
];

fn fmt(x: f64) -> String {
    if (x == x.round() && x.abs() < 1e12) || x.abs() >= 100.0 {
        format!("{x:.0}")
    } else if x.abs() >= 1.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.3}")
    }
}

/// Distinct sorted numeric values of an axis among `runs`.
fn axis(runs: &[&Run], f: impl Fn(&Run) -> Option<f64>) -> Vec<f64> {
    let mut v: Vec<f64> = runs.iter().filter_map(|r| f(r)).collect();
    v.sort_by(f64::total_cmp);
    v.dedup();
    v
}

fn find<'a>(runs: &[&'a Run], engine: &str, pred: impl Fn(&Run) -> bool) -> Option<&'a Run> {
    runs.iter().copied().find(|r| r.engine == engine && pred(r))
}

/// The claims, judged on `runs`.
pub fn judge(runs: &[Run]) -> Vec<Claim> {
    let all: Vec<&Run> = runs.iter().collect();
    let engines: BTreeSet<&str> = runs.iter().map(|r| r.engine.as_str()).collect();
    let prompts = axis(&all, Run::prompt);
    let batches = axis(&all, |r| r.batch);
    let outputs = axis(&all, |r| r.output_len);
    let ttft_grid = prompts.len() >= 2 && outputs.iter().all(|&o| o <= 1.0);
    let batch_grid = batches.len() >= 2;
    let output_grid = outputs.len() >= 2;
    let need = |what: &str| (Verdict::CannotTell, what.to_string());
    let mut out = Vec::new();
    for (id, text) in CLAIMS {
        let (verdict, evidence) = match id {
            "C1" if ttft_grid && engines.len() >= 2 => c1(&all, &prompts),
            "C1" => need("needs a TTFT grid (several prompt lengths, one output token) with full and another engine"),
            "C2" => need("kvbench runs one device; tensor parallelism is not modelled"),
            "C3" if ttft_grid => c3(&all),
            "C3" => need("needs a TTFT grid with InfiniGen under flash and chunked attention"),
            "C4" if ttft_grid => c4(&all),
            "C4" => need("needs a TTFT grid with H2O under flash and eager/chunked attention"),
            "C5" if batch_grid => c5(&all, &batches),
            "C6" if batch_grid => c6(&all, &batches),
            "C7" if batch_grid => c7(&all, &batches),
            "C8" if batch_grid => c8(&all, &batches),
            "C5" | "C6" | "C7" | "C8" => need("needs a batch grid (two or more batch sizes)"),
            "C9" if output_grid => c9(&all, &outputs),
            "C9" => need("needs an output-length grid"),
            _ => need("needs accuracy / retention results (accuracy.parquet), not in this experiment"),
        };
        out.push(Claim {
            id,
            text,
            verdict,
            evidence,
        });
    }
    out
}

/// The claims, judged on `runs` and, where the experiment has them, the rows of
/// accuracy.parquet (C11 from the `retention` task).
pub fn judge_all(runs: &[Run], acc: Option<&[AccRow]>) -> Vec<Claim> {
    let mut claims = judge(runs);
    let retention: Vec<&AccRow> = acc
        .into_iter()
        .flatten()
        .filter(|r| r.task == "retention")
        .collect();
    if !retention.is_empty() {
        if let Some(c) = claims.iter_mut().find(|c| c.id == "C11") {
            (c.verdict, c.evidence) = c11(&retention);
        }
    }
    let mc: Vec<&AccRow> = acc
        .into_iter()
        .flatten()
        .filter(|r| r.task != "retention")
        .collect();
    if !mc.is_empty() {
        if let Some(c) = claims.iter_mut().find(|c| c.id == "C10") {
            (c.verdict, c.evidence) = c10(&mc);
        }
    }
    claims
}

/// Chance accuracy of a multiple-choice task (one over its number of choices).
fn chance(task: &str) -> Option<f64> {
    match task {
        "hellaswag" | "openbookqa" => Some(0.25),
        "piqa" | "copa" | "winogrande" | "boolq" => Some(0.5),
        _ => None,
    }
}

/// Budget 0.5 counts as the baseline when the average drop is at most this.
const C10_NEAR_BASELINE_PP: f64 = 5.0;
/// The smallest budgets count as near random within this of chance on average.
const C10_NEAR_RANDOM_PP: f64 = 10.0;
/// A task shows degradation only where full is this far above chance.
const C10_ABOVE_CHANCE_PP: f64 = 5.0;

/// C10 from the per-item rows of the multiple-choice tasks: for H2O and InfiniGen, the
/// average change against full (in pp over the tasks where full is above chance) at
/// the budget nearest 0.5, at 0.1, and at the smallest budget, and how far the smallest
/// budget is from chance.
fn c10(rows: &[&AccRow]) -> (Verdict, String) {
    let mean = |v: &[f64]| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
    let acc = |engine: &str, task: &str, budget: Option<f64>| -> Option<f64> {
        let v: Vec<f64> = rows
            .iter()
            .filter(|r| r.engine == engine && r.task == task)
            .filter(|r| budget.is_none() || r.budget == budget)
            .map(|r| r.value)
            .collect();
        mean(&v)
    };
    let tasks: BTreeSet<&str> = rows.iter().map(|r| r.task.as_str()).collect();
    let n_full = rows.iter().filter(|r| r.engine == "full").count();
    let full: BTreeMap<&str, f64> = tasks
        .iter()
        .filter_map(|&t| Some((t, acc("full", t, None)?)))
        .collect();
    if full.is_empty() {
        return (
            Verdict::CannotTell,
            "needs the full cache's accuracy on the same tasks as the baseline".into(),
        );
    }
    let usable: Vec<&str> = full
        .iter()
        .filter(|(t, &a)| chance(t).is_some_and(|c| a - c >= C10_ABOVE_CHANCE_PP / 100.0))
        .map(|(t, _)| *t)
        .collect();
    let mut ev = format!(
        "full: {} ({n_full} items)",
        full.iter()
            .map(|(t, a)| format!("{t} {:.0}%", 100.0 * a))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if usable.is_empty() {
        ev.push_str("; full is at chance on every task: no task can show a loss");
        return (Verdict::CannotTell, ev);
    }
    if usable.len() < full.len() {
        ev.push_str(&format!(
            "; tasks where full is above chance: {}",
            usable.join(", ")
        ));
    }
    // The sampling error of full's accuracy per task (binomial, n − 1), averaged over
    // the usable tasks: differences below it are noise.
    let se: Vec<f64> = usable
        .iter()
        .filter_map(|&t| {
            let n = rows
                .iter()
                .filter(|r| r.engine == "full" && r.task == t)
                .count();
            (n > 1).then(|| 100.0 * (full[t] * (1.0 - full[t]) / (n - 1) as f64).sqrt())
        })
        .collect();
    if let Some(se) = mean(&se) {
        ev.push_str(&format!("; standard error per task ≈ {se:.1} pp"));
    }
    // Average change against full over the usable tasks, in pp.
    let delta = |engine: &str, b: f64| -> Option<f64> {
        let v: Vec<f64> = usable
            .iter()
            .filter_map(|&t| Some(100.0 * (acc(engine, t, Some(b))? - full[t])))
            .collect();
        (v.len() == usable.len()).then(|| mean(&v)).flatten()
    };
    // Distance of an engine's average accuracy from chance, in pp.
    let above_chance = |engine: &str, b: f64| -> Option<f64> {
        let v: Vec<f64> = usable
            .iter()
            .filter_map(|&t| Some(100.0 * (acc(engine, t, Some(b))? - chance(t)?)))
            .collect();
        (v.len() == usable.len()).then(|| mean(&v)).flatten()
    };
    let mut judged = 0;
    let mut agrees = true;
    for engine in ["h2o", "infinigen"] {
        let mut budgets: Vec<f64> = rows
            .iter()
            .filter(|r| r.engine == engine)
            .filter_map(|r| r.budget)
            .collect();
        budgets.sort_by(f64::total_cmp);
        budgets.dedup();
        let (Some(&lo), Some(&hi)) = (budgets.first(), budgets.last()) else {
            continue;
        };
        if hi < 0.5 || lo > 0.04 {
            ev.push_str(&format!(
                "; {engine}: budgets {lo}–{hi} do not reach both ≥ 0.5 and ≤ 0.04"
            ));
            continue;
        }
        // The budget nearest 0.5 from above.
        let half = budgets.iter().copied().find(|&b| b >= 0.5).unwrap_or(hi);
        let (Some(d_half), Some(d_lo), Some(c_lo)) = (
            delta(engine, half),
            delta(engine, lo),
            above_chance(engine, lo),
        ) else {
            continue;
        };
        judged += 1;
        let at_01 = budgets
            .iter()
            .find(|&&b| (b - 0.1).abs() < 1e-9)
            .and_then(|&b| delta(engine, b))
            .map_or(String::new(), |d| format!(", {d:+.1} pp at 0.1"));
        ev.push_str(&format!(
            "; {engine}: {d_half:+.1} pp at {half}{at_01}, {d_lo:+.1} pp at {lo} ({c_lo:+.1} pp from chance)"
        ));
        agrees &= d_half.abs() <= C10_NEAR_BASELINE_PP && c_lo <= C10_NEAR_RANDOM_PP;
    }
    if judged == 0 {
        ev.push_str("; needs h2o or infinigen at budgets ≥ 0.5 and ≤ 0.04 on the same tasks");
        return (Verdict::CannotTell, ev);
    }
    ev.push_str(&format!(
        " (agrees: within {C10_NEAR_BASELINE_PP:.0} pp of full at 0.5 and within {C10_NEAR_RANDOM_PP:.0} pp of chance at the smallest budget, averaged over tasks)"
    ));
    (
        if agrees {
            Verdict::Agrees
        } else {
            Verdict::Disagrees
        },
        ev,
    )
}

/// The rows of accuracy.parquet beside runs.parquet, if any.
fn read_accuracy(dir: &Path) -> Option<Vec<AccRow>> {
    kvbench_plots::Tables::load(dir, None)
        .ok()?
        .accuracy_rows()
        .ok()
}

/// The study ran H2O and InfiniGen at budget 0.3 for retention.
const C11_BUDGET: f64 = 0.3;
/// InfiniGen tracks full: at most this far below it (the study: 1–4 pp).
const C11_INFINIGEN_PP: f64 = 5.0;
/// H2O falls clearly below full: at least this far (the study: 17–27 pp).
const C11_H2O_PP: f64 = 10.0;
/// Below this, full itself does not retain the fact: the model cannot do the task.
const C11_FULL_MIN: f64 = 50.0;

/// C11 from retention rows: full, InfiniGen and H2O (at budget 0.3, else the budget
/// nearest it) overall and, with two buckets or more, H2O's gap to full by bucket.
fn c11(rows: &[&AccRow]) -> (Verdict, String) {
    let pct = |v: &[f64]| 100.0 * v.iter().sum::<f64>() / v.len() as f64;
    // An engine's rows at the budget nearest the study's.
    let of = |engine: &str| -> Option<(f64, Vec<&AccRow>)> {
        let mine: Vec<&AccRow> = rows
            .iter()
            .copied()
            .filter(|r| r.engine == engine)
            .collect();
        let b = mine
            .iter()
            .filter_map(|r| r.budget)
            .min_by(|a, b| (a - C11_BUDGET).abs().total_cmp(&(b - C11_BUDGET).abs()))?;
        let at: Vec<&AccRow> = mine.into_iter().filter(|r| r.budget == Some(b)).collect();
        Some((b, at))
    };
    let (Some(full), Some(inf), Some(h2o)) = (of("full"), of("infinigen"), of("h2o")) else {
        return (
            Verdict::CannotTell,
            "needs retention rows of full, infinigen and h2o".into(),
        );
    };
    let acc = |rs: &[&AccRow]| pct(&rs.iter().map(|r| r.value).collect::<Vec<_>>());
    let (f, i, h) = (acc(&full.1), acc(&inf.1), acc(&h2o.1));
    let mut ev = format!(
        "retention full {f:.0}% ({} prompts), InfiniGen {i:.0}% and H2O {h:.0}% at budget {}/{}",
        full.1.len(),
        inf.0,
        h2o.0
    );
    if f < C11_FULL_MIN {
        ev.push_str(&format!(
            "; full itself recalls under {C11_FULL_MIN:.0}%: the model cannot do this form of the task, so the strategies cannot be compared"
        ));
        return (Verdict::CannotTell, ev);
    }
    // H2O's gap to full by bucket, buckets in order of their lower bound.
    let mut buckets: Vec<(usize, String)> = rows
        .iter()
        .filter_map(|r| r.bucket.clone())
        .map(|b| {
            let lo = kvbench_datasets::retention::Bucket::parse(&b).map_or(usize::MAX, |x| x.lo);
            (lo, b)
        })
        .collect();
    buckets.sort();
    buckets.dedup();
    let gaps: Vec<(String, f64)> = buckets
        .iter()
        .filter_map(|(_, b)| {
            let sel = |rs: &[&AccRow]| -> Option<f64> {
                let v: Vec<f64> = rs
                    .iter()
                    .filter(|r| r.bucket.as_deref() == Some(b))
                    .map(|r| r.value)
                    .collect();
                (!v.is_empty()).then(|| pct(&v))
            };
            Some((b.clone(), sel(&full.1)? - sel(&h2o.1)?))
        })
        .collect();
    let tracks = f - i <= C11_INFINIGEN_PP;
    let h2o_low = f - h >= C11_H2O_PP && i > h;
    let widening = match (gaps.first(), gaps.last()) {
        (Some(a), Some(b)) if gaps.len() >= 2 => {
            ev.push_str(&format!(
                "; H2O below full by {}",
                gaps.iter()
                    .map(|(b, g)| format!("{g:.0} pp at {b}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
            Some(b.1 > a.1)
        }
        _ => {
            ev.push_str("; one bucket: H2O's trend with context length is not checked");
            None
        }
    };
    ev.push_str(&format!(
        " (agrees: InfiniGen within {C11_INFINIGEN_PP:.0} pp of full, H2O ≥ {C11_H2O_PP:.0} pp below it and below InfiniGen, its gap wider in the longest bucket)"
    ));
    let verdict = if tracks && h2o_low && widening != Some(false) {
        Verdict::Agrees
    } else {
        Verdict::Disagrees
    };
    (verdict, ev)
}

fn c1(runs: &[&Run], prompts: &[f64]) -> (Verdict, String) {
    let mut lowest_everywhere = true;
    let mut compared = 0;
    let mut notes = Vec::new();
    for &p in prompts {
        let at: Vec<&Run> = runs
            .iter()
            .copied()
            .filter(|r| r.prompt() == Some(p))
            .collect();
        let best_full = at
            .iter()
            .filter(|r| r.engine == "full" && r.ok())
            .filter_map(|r| r.ttft_mean_s)
            .fold(f64::INFINITY, f64::min);
        let best_other = at
            .iter()
            .filter(|r| r.engine != "full" && r.ok())
            .filter_map(|r| r.ttft_mean_s)
            .fold(f64::INFINITY, f64::min);
        if best_full.is_finite() && best_other.is_finite() {
            compared += 1;
            lowest_everywhere &= best_full <= best_other;
            notes.push(format!(
                "{p}: full {} s vs best other {} s",
                fmt(best_full),
                fmt(best_other)
            ));
        }
    }
    let reach = |e: &str| {
        runs.iter()
            .filter(|r| r.engine == e && r.ok())
            .filter_map(|r| r.prompt())
            .fold(0.0, f64::max)
    };
    let mut reached: Vec<String> = BTreeSet::from_iter(runs.iter().map(|r| r.engine.as_str()))
        .into_iter()
        .map(|e| format!("{e} reaches {}", reach(e)))
        .collect();
    reached.sort();
    if compared == 0 {
        return (
            Verdict::CannotTell,
            format!(
                "no prompt length where full and another engine both ran; {}",
                reached.join(", ")
            ),
        );
    }
    let v = if lowest_everywhere {
        Verdict::Agrees
    } else {
        Verdict::Disagrees
    };
    (
        v,
        format!("TTFT {}; {}", notes.join("; "), reached.join(", ")),
    )
}

/// Prefill memory and TTFT of `engine` under flash vs another attention at the largest
/// prompt where both ran.
fn flash_vs(runs: &[&Run], engine: &str, other: &str) -> Option<(f64, f64, f64)> {
    let mut best = None;
    for r in runs
        .iter()
        .filter(|r| r.engine == engine && r.attention == "flash" && r.ok())
    {
        let p = r.prompt()?;
        if let Some(o) = find(runs, engine, |o| {
            o.attention == other && o.ok() && o.prompt() == Some(p)
        }) {
            let (Some(mf), Some(mo), Some(tf), Some(to)) = (
                r.mem_activations_peak_bytes,
                o.mem_activations_peak_bytes,
                r.ttft_mean_s,
                o.ttft_mean_s,
            ) else {
                continue;
            };
            if best.is_none_or(|(bp, _, _, _)| p > bp) {
                best = Some((p, mf / mo, tf / to, 0.0));
            }
        }
    }
    best.map(|(p, m, t, _)| (p, m, t))
}

fn c3(runs: &[&Run]) -> (Verdict, String) {
    let Some((p, m, t)) = flash_vs(runs, "infinigen", "chunked") else {
        return (
            Verdict::CannotTell,
            "no prompt length with InfiniGen under both flash and chunked attention".into(),
        );
    };
    let v = if m < 0.5 && t < 1.0 {
        Verdict::Agrees
    } else {
        Verdict::Disagrees
    };
    (
        v,
        format!(
            "at {p} tokens flash/chunked: prefill memory ×{} ({:+.0}%), TTFT ×{} ({:+.0}%)",
            fmt(m),
            (m - 1.0) * 100.0,
            fmt(t),
            (t - 1.0) * 100.0
        ),
    )
}

fn c4(runs: &[&Run]) -> (Verdict, String) {
    let cmp = flash_vs(runs, "h2o", "eager").or_else(|| flash_vs(runs, "h2o", "chunked"));
    let Some((p, m, t)) = cmp else {
        return (
            Verdict::CannotTell,
            "no prompt length with H2O under flash and eager or chunked attention".into(),
        );
    };
    // The study: no gain. Ours computes exact statistics without the matrix, so a
    // clear gain (≥ 20% less time or memory) disagrees.
    let v = if t > 0.8 && m > 0.8 {
        Verdict::Agrees
    } else {
        Verdict::Disagrees
    };
    (
        v,
        format!(
            "at {p} tokens H2O flash vs eager/chunked: prefill memory ×{}, TTFT ×{}",
            fmt(m),
            fmt(t)
        ),
    )
}

fn per_batch(
    runs: &[&Run],
    batches: &[f64],
    engine: &str,
    f: impl Fn(&Run) -> Option<f64>,
) -> Vec<(f64, f64)> {
    batches
        .iter()
        .filter_map(|&b| {
            let r = find(runs, engine, |r| r.batch == Some(b) && r.ok())?;
            Some((b, f(r)?))
        })
        .collect()
}

fn series(v: &[(f64, f64)], unit: &str) -> String {
    v.iter()
        .map(|(b, x)| format!("{b}: {}{unit}", fmt(*x)))
        .collect::<Vec<_>>()
        .join(", ")
}

fn c5(runs: &[&Run], batches: &[f64]) -> (Verdict, String) {
    let gib = |r: &Run| r.device_bytes().map(|b| b / (1u64 << 30) as f64);
    let needed = |r: &Run| r.needed_device_bytes().map(|b| b / (1u64 << 30) as f64);
    let full = per_batch(runs, batches, "full", gib);
    let h2o = per_batch(runs, batches, "h2o", needed);
    let host = |e| {
        per_batch(runs, batches, e, |r| {
            r.mem_host_peak_bytes.map(|b| b / (1u64 << 30) as f64)
        })
    };
    if full.len() < 2 {
        return (
            Verdict::CannotTell,
            "full ran at fewer than two batch sizes".into(),
        );
    }
    let spread = full.iter().map(|x| x.1).fold(f64::NEG_INFINITY, f64::max)
        / full.iter().map(|x| x.1).fold(f64::INFINITY, f64::min);
    let mut ev = format!("device GiB (ledger) full {}", series(&full, ""));
    let mut ok = spread < 1.05;
    if let (Some(f), Some(h)) = (
        full.last(),
        h2o.iter().find(|x| Some(&x.0) == full.last().map(|f| &f.0)),
    ) {
        write!(ev, "; h2o needs (KV held) {}", series(&h2o, "")).ok();
        ok &= h.1 <= 0.6 * f.1;
    } else {
        ev.push_str("; no h2o at the largest batch");
        return (Verdict::CannotTell, ev);
    }
    let ig = host("infinigen");
    if !ig.is_empty() {
        write!(
            ev,
            "; host RSS GiB infinigen {}, full {}",
            series(&ig, ""),
            series(&host("full"), "")
        )
        .ok();
    }
    (
        if ok {
            Verdict::Agrees
        } else {
            Verdict::Disagrees
        },
        ev,
    )
}

fn c6(runs: &[&Run], batches: &[f64]) -> (Verdict, String) {
    let t = |e| per_batch(runs, batches, e, |r| r.decode_tok_s);
    let (full, h2o, ig) = (t("full"), t("h2o"), t("infinigen"));
    if full.len() < 2 || ig.is_empty() {
        return (
            Verdict::CannotTell,
            format!(
                "decode tok/s full {}; needs full at two batches and infinigen",
                series(&full, "")
            ),
        );
    }
    let grows = full.windows(2).all(|w| w[1].1 >= w[0].1);
    let ratios: Vec<(f64, f64)> = ig
        .iter()
        .filter_map(|(b, x)| full.iter().find(|f| f.0 == *b).map(|f| (*b, f.1 / x)))
        .collect();
    let order = ratios.iter().all(|r| r.1 >= 5.0);
    let v = if grows && order && !ratios.is_empty() {
        Verdict::Agrees
    } else {
        Verdict::Disagrees
    };
    (
        v,
        format!(
            "decode tok/s full {}; h2o {}; infinigen {}; full/infinigen {}",
            series(&full, ""),
            series(&h2o, ""),
            series(&ig, ""),
            series(&ratios, "×")
        ),
    )
}

fn c7(runs: &[&Run], batches: &[f64]) -> (Verdict, String) {
    // full per GB of what it reserves (its paradigm pre-allocates); the others per GB
    // of what they need, as in C5 (on CUDA every engine reserves its pool up front).
    let needed = |r: &Run| match (r.decode_tok_s, r.needed_device_bytes()) {
        (Some(t), Some(b)) if b > 0.0 => Some(t / (b / 1e9)),
        _ => r.decode_tok_s_per_gb,
    };
    let full = per_batch(runs, batches, "full", |r| r.decode_tok_s_per_gb);
    let (h2o, ig) = (
        per_batch(runs, batches, "h2o", needed),
        per_batch(runs, batches, "infinigen", needed),
    );
    let ratios: Vec<(f64, f64)> = h2o
        .iter()
        .filter_map(|(b, x)| full.iter().find(|f| f.0 == *b).map(|f| (*b, x / f.1)))
        .collect();
    if ratios.is_empty() {
        return (
            Verdict::CannotTell,
            "needs full and h2o at the same batch sizes".into(),
        );
    }
    let v = if ratios.iter().all(|r| r.1 >= 1.5) {
        Verdict::Agrees
    } else {
        Verdict::Disagrees
    };
    (
        v,
        format!(
            "tok/s per GB full {}; per GB needed h2o {}, infinigen {}; h2o/full {}",
            series(&full, ""),
            series(&h2o, ""),
            series(&ig, ""),
            series(&ratios, "×")
        ),
    )
}

fn c8(runs: &[&Run], batches: &[f64]) -> (Verdict, String) {
    let t = |e| per_batch(runs, batches, e, |r| r.e2e_mean_s);
    let (full, ig) = (t("full"), t("infinigen"));
    let ratios: Vec<(f64, f64)> = ig
        .iter()
        .filter_map(|(b, x)| full.iter().find(|f| f.0 == *b).map(|f| (*b, x / f.1)))
        .collect();
    if ratios.len() < 2 {
        return (
            Verdict::CannotTell,
            format!(
                "mean E2E s full {}; needs infinigen and full at two batch sizes",
                series(&full, "")
            ),
        );
    }
    let rising = ratios.windows(2).all(|w| w[1].1 >= w[0].1);
    let v = if rising && ratios.last().is_some_and(|r| r.1 >= 3.0) {
        Verdict::Agrees
    } else {
        Verdict::Disagrees
    };
    (
        v,
        format!(
            "mean E2E s full {}; infinigen {}; infinigen/full {}",
            series(&full, ""),
            series(&ig, ""),
            series(&ratios, "×")
        ),
    )
}

fn c9(runs: &[&Run], outputs: &[f64]) -> (Verdict, String) {
    let t = |e: &str| -> Vec<(f64, f64)> {
        outputs
            .iter()
            .filter_map(|&o| {
                let r = find(runs, e, |r| r.output_len == Some(o) && r.ok())?;
                Some((o, r.decode_tok_s?))
            })
            .collect()
    };
    let (full, ig) = (t("full"), t("infinigen"));
    let ratios: Vec<(f64, f64)> = ig
        .iter()
        .filter_map(|(o, x)| full.iter().find(|f| f.0 == *o).map(|f| (*o, f.1 / x)))
        .collect();
    if ratios.is_empty() {
        return (
            Verdict::CannotTell,
            format!(
                "decode tok/s full {}; needs infinigen at the same output lengths",
                series(&full, "")
            ),
        );
    }
    let v = if ratios.iter().all(|r| r.1 >= 5.0) {
        Verdict::Agrees
    } else {
        Verdict::Disagrees
    };
    (
        v,
        format!(
            "decode tok/s by output length full {}; infinigen {}; full/infinigen {}",
            series(&full, ""),
            series(&ig, ""),
            series(&ratios, "×")
        ),
    )
}

/// Figure files written by `kvbench plot` (results/EXP/figures/*.png), in name order.
fn figures(dir: &Path) -> Vec<PathBuf> {
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

fn first(df: &DataFrame, name: &str) -> Option<String> {
    strings(df, name).into_iter().flatten().next()
}

/// The report as Markdown; `img` renders a figure reference (a link or inline data).
fn render(
    dir: &Path,
    df: &DataFrame,
    runs: &[Run],
    figs: &[PathBuf],
    img: &dyn Fn(&Path) -> Result<String>,
) -> Result<String> {
    let mut md = String::new();
    let name = first(df, "experiment").unwrap_or_else(|| dir.display().to_string());
    writeln!(md, "# kvbench report: {name}\n")?;
    writeln!(md, "## Environment\n")?;
    // The model as the experiment names it (its YAML is kept beside the results).
    let spec: Option<serde_yaml::Value> = std::fs::read_to_string(dir.join("experiment.yaml"))
        .ok()
        .and_then(|y| serde_yaml::from_str(&y).ok());
    for key in ["model", "dtype"] {
        if let Some(v) = spec
            .as_ref()
            .and_then(|s| s.get(key))
            .and_then(|v| v.as_str())
        {
            writeln!(md, "- {key}: {v}")?;
        }
    }
    for (label, col) in [
        ("device", "env_device"),
        ("GPU", "env_gpu_name"),
        ("driver", "env_driver_version"),
        ("CPU", "env_cpu_model"),
        ("cores", "env_cpu_cores"),
        ("host memory (bytes)", "env_host_memory_bytes"),
        ("kvbench", "env_kvbench_version"),
        ("git revision", "env_git_revision"),
    ] {
        if let Some(v) = first(df, col) {
            writeln!(md, "- {label}: {v}")?;
        }
    }
    let outcomes: BTreeMap<&str, usize> = runs.iter().fold(BTreeMap::new(), |mut m, r| {
        *m.entry(r.outcome.as_str()).or_default() += 1;
        m
    });
    writeln!(md, "\n## Grid\n")?;
    let distinct = |f: &dyn Fn(&Run) -> String| -> String {
        let s: BTreeSet<String> = runs.iter().map(f).collect();
        s.into_iter().collect::<Vec<_>>().join(", ")
    };
    let num = |x: Option<f64>| x.map_or("–".into(), fmt);
    writeln!(
        md,
        "- cells: {} ({})",
        runs.len(),
        outcomes
            .iter()
            .map(|(k, v)| format!("{v} {k}"))
            .collect::<Vec<_>>()
            .join(", ")
    )?;
    writeln!(md, "- engines: {}", distinct(&|r| r.label()))?;
    writeln!(md, "- attention: {}", distinct(&|r| r.attention.clone()))?;
    writeln!(md, "- batch: {}", distinct(&|r| num(r.batch)))?;
    writeln!(
        md,
        "- prompt length: {}",
        distinct(&|r| r.prompt_len.clone())
    )?;
    writeln!(md, "- output length: {}", distinct(&|r| num(r.output_len)))?;
    writeln!(md, "- budget: {}", distinct(&|r| num(r.budget)))?;

    writeln!(md, "\n## Cells\n")?;
    writeln!(md, "| engine | attention | batch | prompt | output | budget | outcome | TTFT s | decode tok/s | tok/s per GB | E2E s | device GiB | host KV GiB |")?;
    writeln!(
        md,
        "|---|---|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"
    )?;
    let gib =
        |x: Option<f64>| x.map_or("–".into(), |b| format!("{:.2}", b / (1u64 << 30) as f64));
    for r in runs {
        writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.label(),
            r.attention,
            num(r.batch),
            r.prompt_len,
            num(r.output_len),
            num(r.budget),
            r.outcome,
            num(r.ttft_mean_s),
            num(r.decode_tok_s),
            num(r.decode_tok_s_per_gb),
            num(r.e2e_mean_s),
            gib(r.device_bytes()),
            gib(r.mem_kv_host_bytes),
        )?;
    }
    writeln!(md, "\n## Figures\n")?;
    if figs.is_empty() {
        writeln!(
            md,
            "No figures yet: run `kvbench plot {}` first.",
            dir.display()
        )?;
    }
    for f in figs {
        let stem = f
            .file_stem()
            .map_or(String::new(), |s| s.to_string_lossy().into_owned());
        writeln!(md, "### {stem}\n\n{}\n", img(f)?)?;
    }
    writeln!(md, "## The study's claims\n")?;
    writeln!(
        md,
        "Judged on this experiment's cells only; thresholds are in src/report.rs.\n"
    )?;
    for c in judge_all(runs, read_accuracy(dir).as_deref()) {
        writeln!(
            md,
            "- **{}** {}  \n  *{}*: {}",
            c.id, c.text, c.verdict, c.evidence
        )?;
    }
    Ok(md)
}

/// Markdown to a self-contained HTML page: headings, lists, tables, paragraphs and the
/// inline images this report produces (not a general Markdown renderer).
fn to_html(md: &str, title: &str) -> String {
    let esc = |s: &str| {
        s.replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;")
    };
    let inline = |s: &str| {
        let mut out = String::new();
        let mut bold = false;
        let mut it = s.split("**");
        if let Some(first) = it.next() {
            out.push_str(&esc(first));
        }
        for part in it {
            bold = !bold;
            out.push_str(if bold { "<b>" } else { "</b>" });
            out.push_str(&esc(part));
        }
        out
    };
    let mut html = format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>{}</title><style>\
         body{{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}}\
         table{{border-collapse:collapse;font-size:90%}}td,th{{border:1px solid #ccc;padding:2px 6px}}\
         img{{max-width:100%}}</style></head><body>\n",
        esc(title)
    );
    let mut in_table = false;
    let mut in_list = false;
    for line in md.lines() {
        let t = line.trim_end();
        if !t.starts_with('|') && in_table {
            html.push_str("</table>\n");
            in_table = false;
        }
        let list_item = t.starts_with("- ");
        let continuation = in_list && t.starts_with("  ") && !t.trim().is_empty();
        if !list_item && !continuation && in_list {
            html.push_str("</ul>\n");
            in_list = false;
        }
        if let Some(h) = t.strip_prefix("### ") {
            writeln!(html, "<h3>{}</h3>", esc(h)).ok();
        } else if let Some(h) = t.strip_prefix("## ") {
            writeln!(html, "<h2>{}</h2>", esc(h)).ok();
        } else if let Some(h) = t.strip_prefix("# ") {
            writeln!(html, "<h1>{}</h1>", esc(h)).ok();
        } else if t.starts_with('|') {
            if t.starts_with("|---") {
                continue;
            }
            let cells: Vec<&str> = t.trim_matches('|').split('|').map(str::trim).collect();
            let tag = if in_table { "td" } else { "th" };
            if !in_table {
                html.push_str("<table>\n");
                in_table = true;
            }
            html.push_str("<tr>");
            for c in cells {
                write!(html, "<{tag}>{}</{tag}>", inline(c)).ok();
            }
            html.push_str("</tr>\n");
        } else if let Some(item) = t.strip_prefix("- ") {
            if !in_list {
                html.push_str("<ul>\n");
                in_list = true;
            }
            write!(html, "<li>{}", inline(item.trim_end_matches("  "))).ok();
        } else if continuation {
            let c = t.trim();
            let c = c.strip_prefix('*').and_then(|c| c.split_once("*:"));
            match c {
                Some((v, rest)) => write!(html, "<br><i>{}</i>:{}", esc(v), inline(rest)).ok(),
                None => write!(html, " {}", inline(t.trim())).ok(),
            };
        } else if t.starts_with("<img") {
            html.push_str(t);
            html.push('\n');
        } else if !t.is_empty() {
            writeln!(html, "<p>{}</p>", inline(t)).ok();
        }
    }
    if in_table {
        html.push_str("</table>\n");
    }
    if in_list {
        html.push_str("</ul>\n");
    }
    html.push_str("</body></html>\n");
    html
}

pub fn run(a: ReportArgs) -> Result<()> {
    // A name stands for results/<name>, as for `kvbench plot`.
    let named = Path::new("results").join(&a.results);
    let dir = if !a.results.is_dir() && named.is_dir() {
        &named
    } else {
        &a.results
    };
    if !dir.is_dir() {
        bail!(
            "{}: expected an experiment's results directory (results/EXP)",
            dir.display()
        );
    }
    let (df, runs) = read_runs(dir)?;
    let figs = figures(dir);
    let md = render(dir, &df, &runs, &figs, &|f| {
        let rel = f.strip_prefix(dir).unwrap_or(f);
        Ok(format!("![{}]({})", rel.display(), rel.display()))
    })?;
    let html_md = render(dir, &df, &runs, &figs, &|f| {
        let bytes = std::fs::read(f).with_context(|| format!("reading {}", f.display()))?;
        Ok(format!(
            "<img alt=\"{}\" src=\"data:image/png;base64,{}\">",
            f.file_name()
                .map_or(String::new(), |n| n.to_string_lossy().into_owned()),
            base64::engine::general_purpose::STANDARD.encode(bytes)
        ))
    })?;
    let title = first(&df, "experiment").unwrap_or_else(|| "kvbench report".into());
    let html = to_html(&html_md, &format!("kvbench report: {title}"));
    let md_path = dir.join("report.md");
    let html_path = dir.join("report.html");
    std::fs::write(&md_path, &md).with_context(|| format!("writing {}", md_path.display()))?;
    std::fs::write(&html_path, html).with_context(|| format!("writing {}", html_path.display()))?;
    let claims = judge_all(&runs, read_accuracy(dir).as_deref());
    println!(
        "wrote {} and {} ({} cells, {} figures; claims: {})",
        md_path.display(),
        html_path.display(),
        runs.len(),
        figs.len(),
        claims
            .iter()
            .map(|c| format!("{} {}", c.id, c.verdict))
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(engine: &str, batch: f64, tok_s: f64, dev_gib: f64) -> Run {
        Run {
            engine: engine.into(),
            params: String::new(),
            attention: "flash".into(),
            batch: Some(batch),
            prompt_len: "512".into(),
            output_len: Some(32.0),
            budget: Some(0.3),
            outcome: "ok".into(),
            decode_tok_s: Some(tok_s),
            decode_tok_s_per_gb: Some(tok_s / dev_gib),
            e2e_mean_s: Some(100.0 / tok_s),
            mem_weights_bytes: Some(0.0),
            mem_kv_device_bytes: Some(dev_gib * (1u64 << 30) as f64),
            mem_activations_peak_bytes: Some(0.0),
            ..Default::default()
        }
    }

    #[test]
    fn c5_reads_the_kv_held_when_every_pool_is_reserved_up_front() {
        // CUDA: h2o reserves the same pool as full but holds a third of it.
        let mut runs = vec![
            run("full", 4.0, 100.0, 10.0),
            run("full", 8.0, 180.0, 10.0),
            run("h2o", 4.0, 90.0, 10.0),
            run("h2o", 8.0, 170.0, 10.0),
        ];
        let c5 = |runs: &[Run]| judge(runs).into_iter().find(|c| c.id == "C5").unwrap();
        assert_eq!(c5(&runs).verdict, Verdict::Disagrees);
        let c7 = judge(&runs).into_iter().find(|c| c.id == "C7").unwrap();
        assert_eq!(c7.verdict, Verdict::Disagrees, "{}", c7.evidence);
        for r in runs.iter_mut().filter(|r| r.engine == "h2o") {
            r.mem_kv_device_used_peak_bytes = Some(3.0 * (1u64 << 30) as f64);
        }
        let c = c5(&runs);
        assert_eq!(c.verdict, Verdict::Agrees, "{}", c.evidence);
        assert!(c.evidence.contains("KV held"), "{}", c.evidence);
        // C7 likewise: h2o's throughput per GB of what it needs, ≈3× full's.
        let c7 = judge(&runs).into_iter().find(|c| c.id == "C7").unwrap();
        assert_eq!(c7.verdict, Verdict::Agrees, "{}", c7.evidence);
    }

    #[test]
    fn batch_claims_follow_the_numbers() {
        // The study's picture: full flat memory, h2o a third, infinigen 10× slower.
        let runs = vec![
            run("full", 4.0, 100.0, 10.0),
            run("full", 8.0, 180.0, 10.0),
            run("h2o", 4.0, 90.0, 3.0),
            run("h2o", 8.0, 170.0, 3.0),
            run("infinigen", 4.0, 9.0, 3.0),
            run("infinigen", 8.0, 10.0, 3.0),
        ];
        let c = judge(&runs);
        let v = |id: &str| c.iter().find(|c| c.id == id).unwrap().verdict.clone();
        assert_eq!(v("C5"), Verdict::Agrees);
        assert_eq!(v("C6"), Verdict::Agrees);
        assert_eq!(v("C7"), Verdict::Agrees);
        assert_eq!(v("C1"), Verdict::CannotTell);
        assert_eq!(v("C2"), Verdict::CannotTell);
        assert_eq!(v("C10"), Verdict::CannotTell);
        // InfiniGen as fast as full: C6 no longer holds.
        let mut fast = runs.clone();
        fast[4].decode_tok_s = Some(100.0);
        fast[5].decode_tok_s = Some(180.0);
        let c = judge(&fast);
        assert_eq!(
            c.iter().find(|c| c.id == "C6").unwrap().verdict,
            Verdict::Disagrees
        );
    }

    fn ret(engine: &str, budget: f64, bucket: &str, correct: usize, of: usize) -> Vec<AccRow> {
        (0..of)
            .map(|i| AccRow {
                task: "retention".into(),
                engine: engine.into(),
                budget: Some(budget),
                repeat: 0,
                value: if i < correct { 1.0 } else { 0.0 },
                bucket: Some(bucket.into()),
                turn: Some(2.0),
            })
            .collect()
    }

    #[test]
    fn retention_claim_follows_the_retention_rows() {
        let c11 = |acc: &[AccRow]| {
            let c = judge_all(&[], Some(acc));
            let c = c.into_iter().find(|c| c.id == "C11").unwrap();
            (c.verdict, c.evidence)
        };
        // The study's picture: full 95, InfiniGen 93, H2O 78 then 68.
        let mut study = Vec::new();
        for (b, h) in [("1K-2K", 78), ("2K-4K", 68)] {
            study.extend(ret("full", 1.0, b, 95, 100));
            study.extend(ret("infinigen", 0.3, b, 93, 100));
            study.extend(ret("h2o", 0.3, b, h, 100));
            // Other budgets are not the study's and do not count.
            study.extend(ret("h2o", 0.02, b, 100, 100));
        }
        let (v, ev) = c11(&study);
        assert_eq!(v, Verdict::Agrees, "{ev}");
        assert!(ev.contains("full 95%") && ev.contains("H2O 73%"), "{ev}");
        assert!(ev.contains("17 pp at 1K-2K, 27 pp at 2K-4K"), "{ev}");
        // H2O's gap narrowing with length contradicts the claim.
        let mut narrowing = study.clone();
        for r in narrowing
            .iter_mut()
            .filter(|r| r.engine == "h2o" && r.budget == Some(0.3))
        {
            if r.bucket.as_deref() == Some("2K-4K") {
                r.value = 1.0;
            }
        }
        assert_eq!(c11(&narrowing).0, Verdict::Disagrees);
        // H2O as good as full.
        let same: Vec<AccRow> = ["full", "infinigen", "h2o"]
            .iter()
            .flat_map(|e| ret(e, if *e == "full" { 1.0 } else { 0.3 }, "1K-2K", 90, 100))
            .collect();
        let (v, ev) = c11(&same);
        assert_eq!(v, Verdict::Disagrees, "{ev}");
        assert!(ev.contains("one bucket"), "{ev}");
        // The model fails with the full cache: nothing to compare.
        let weak: Vec<AccRow> = ["full", "infinigen", "h2o"]
            .iter()
            .flat_map(|e| ret(e, 0.3, "1K-2K", 20, 100))
            .collect();
        assert_eq!(c11(&weak).0, Verdict::CannotTell);
        // A strategy missing; no retention rows at all.
        assert_eq!(
            c11(&ret("full", 1.0, "1K-2K", 9, 10)).0,
            Verdict::CannotTell
        );
        let c = judge_all(&[], None);
        assert_eq!(
            c.iter().find(|c| c.id == "C11").unwrap().verdict,
            Verdict::CannotTell
        );
    }

    /// `of` items of a task for one engine and budget, `correct` of them right.
    fn mc(task: &str, engine: &str, budget: f64, correct: usize, of: usize) -> Vec<AccRow> {
        (0..of)
            .map(|i| AccRow {
                task: task.into(),
                engine: engine.into(),
                budget: Some(budget),
                repeat: 0,
                value: if i < correct { 1.0 } else { 0.0 },
                bucket: None,
                turn: None,
            })
            .collect()
    }

    #[test]
    fn c10_is_judged_from_the_accuracy_rows() {
        // full: piqa 80%, hellaswag 60%, boolq at chance (50%: left out of the average).
        let grid = |half_piqa: usize, low_piqa: usize| -> Vec<AccRow> {
            let mut rows = Vec::new();
            rows.extend(mc("piqa", "full", 1.0, 80, 100));
            rows.extend(mc("hellaswag", "full", 1.0, 60, 100));
            rows.extend(mc("boolq", "full", 1.0, 50, 100));
            for e in ["h2o", "infinigen"] {
                rows.extend(mc("piqa", e, 0.5, half_piqa, 100));
                rows.extend(mc("hellaswag", e, 0.5, 58, 100));
                rows.extend(mc("boolq", e, 0.5, 40, 100));
                rows.extend(mc("piqa", e, 0.02, low_piqa, 100));
                rows.extend(mc("hellaswag", e, 0.02, 27, 100));
                rows.extend(mc("boolq", e, 0.02, 50, 100));
            }
            rows
        };
        let c10 = |rows: &[AccRow]| {
            judge_all(&[], Some(rows))
                .into_iter()
                .find(|c| c.id == "C10")
                .unwrap()
        };
        let c = c10(&grid(78, 52));
        assert_eq!(c.verdict, Verdict::Agrees, "{}", c.evidence);
        assert!(c.evidence.contains("h2o: -2.0 pp at 0.5"), "{}", c.evidence);
        assert!(
            c.evidence.contains("above chance: hellaswag, piqa"),
            "{}",
            c.evidence
        );
        // A 20 pp loss at 0.5 disagrees, and so does staying far above chance at 0.02.
        assert_eq!(c10(&grid(40, 52)).verdict, Verdict::Disagrees);
        assert_eq!(c10(&grid(78, 80)).verdict, Verdict::Disagrees);
        // Without small budgets, or without full, it cannot tell.
        let no_small: Vec<AccRow> = grid(78, 52)
            .into_iter()
            .filter(|r| r.budget != Some(0.02))
            .collect();
        assert_eq!(c10(&no_small).verdict, Verdict::CannotTell);
        let no_full: Vec<AccRow> = grid(78, 52)
            .into_iter()
            .filter(|r| r.engine != "full")
            .collect();
        assert_eq!(c10(&no_full).verdict, Verdict::CannotTell);
        assert_eq!(
            judge_all(&[], None)
                .into_iter()
                .find(|c| c.id == "C10")
                .unwrap()
                .verdict,
            Verdict::CannotTell
        );
    }

    #[test]
    fn html_keeps_tables_lists_and_images() {
        let md = "# T\n\n- a **b**  \n  *agrees*: x\n\n| h | i |\n|---|---|\n| 1 | 2 |\n\n<img src=\"data:image/png;base64,AA\">\n";
        let h = to_html(md, "t");
        assert!(h.contains("<h1>T</h1>"));
        assert!(h.contains("<li>a <b>b</b><br><i>agrees</i>: x"));
        assert!(h.contains("<tr><th>h</th><th>i</th></tr>"));
        assert!(h.contains("<tr><td>1</td><td>2</td></tr>"));
        assert!(h.contains("<img src=\"data:image/png;base64,AA\">"));
    }
}
