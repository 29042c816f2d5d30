//! `kvbench recommend`: the study's question answered for a model, a device and a
//! workload with the cost model. Every strategy × budget × prefill mode is predicted
//! on the workload (an experiment built in memory and predicted cell by cell, as
//! `kvbench predict` does), then ranked: runs in memory, meets the objectives, within
//! the accuracy cost allowed, highest output throughput.

use super::calibrate::{efficiency_for, load_device, DeviceArgs};
use crate::cell::performance::Outcome;
use crate::compare::{floats, strings};
use crate::experiment::{Plan, SloSpec};
use crate::metrics::CellMetrics;
use crate::prediction::{model_config, predict_cell, Target};
use anyhow::{bail, Context, Result};
use clap::Args;
use kvbench_engines::cost::DeviceKind;
use kvbench_engines::device::parse_bytes;
use kvbench_engines::ledger::MemoryReport;
use kvbench_plots::crossover::{draw_crossover, CrossoverMap, Winner};
use kvbench_plots::schema;
use kvbench_plots::schema::read_table as read_parquet;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Debug, Args)]
pub struct RecommendArgs {
    /// Model as `kvbench generate --model` takes it (`preset:llama-3.1-8b`, a GGUF
    /// name); only its shapes are read.
    #[arg(long)]
    pub model: String,
    #[command(flatten)]
    pub device: DeviceArgs,
    /// A calibration of the device (`kvbench calibrate`); without one, the datasheet
    /// roofline (lower bounds on every time: the ranking holds, the times are optimistic).
    #[arg(long)]
    pub calibration: Option<PathBuf>,
    /// Prompt lengths: `N`, or `MIN-MAX` drawn uniformly; `K` is a thousand
    /// (`1K-10K`, the study's batch-scaling prompts).
    #[arg(long, required_unless_present = "map")]
    pub prompt_len: Option<String>,
    /// Output tokens per request.
    #[arg(long)]
    pub output_len: usize,
    /// Requests in flight at once; one batch of this many requests, all arriving at 0.
    #[arg(long, required_unless_present_any = ["rate", "map"], conflicts_with = "rate")]
    pub batch: Option<usize>,
    /// Requests per second (Poisson arrivals), `--num-requests` of them, at most 256
    /// in flight.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Requests of the workload (default: one batch with `--batch`, 200 with `--rate`).
    #[arg(long)]
    pub num_requests: Option<usize>,
    /// Measured experiments (results directories of the same model and device): a
    /// measured cell of the same engine, budget, batch, prompt lengths, output length,
    /// attention and prefill mode is shown beside the prediction.
    #[arg(long, num_args = 1..)]
    pub measured: Vec<PathBuf>,
    /// Objectives: `ttft=2s,tpot=100ms,e2e=30s` (a bare number is milliseconds). An
    /// objective is met when every request meets it.
    #[arg(long)]
    pub slo: Option<String>,
    /// Device memory the deployment may use (`40GiB`), in place of the device's.
    #[arg(long)]
    pub max_device_memory: Option<String>,
    /// An accuracy experiment's results (`kvbench run` of a `kind: accuracy` YAML): the
    /// accuracy cost of each strategy and budget, in points against `full`.
    #[arg(long)]
    pub accuracy: Option<PathBuf>,
    /// Largest accuracy drop allowed, in percentage points (needs `--accuracy`); a
    /// configuration whose drop was not measured is ranked after those within it.
    #[arg(long, requires = "accuracy")]
    pub max_accuracy_drop: Option<f64>,
    /// Strategies to consider: any registered one (`kvbench generate --help` lists
    /// them); snapkv, quest, kivi and hybrid are modelled but not yet validated
    /// against measured runs.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "full,h2o,streaming,infinigen"
    )]
    pub engines: Vec<String>,
    /// KV budgets of the compressing and offloading strategies.
    #[arg(long, value_delimiter = ',', default_value = "0.5,0.3,0.2,0.1")]
    pub budgets: Vec<f64>,
    /// Prefill attention (flash, chunked, eager).
    #[arg(long, default_value = "flash")]
    pub attention: String,
    /// Host memory an offloading strategy may use (`512GiB`); default: the size of the
    /// device's KV pool, the engine's default without a host capacity.
    #[arg(long)]
    pub host_memory: Option<String>,
    /// GPUs in tensor parallelism.
    #[arg(long, default_value_t = 1)]
    pub tensor_parallel: usize,
    /// Draw the crossover map instead of one ranking: the configuration ranked first at
    /// each batch × prompt length (`--map-batches` × `--map-prompts`), as PATH.png and
    /// PATH.svg; `--prompt-len` and `--batch` are then not needed.
    #[arg(long, value_name = "PATH")]
    pub map: Option<PathBuf>,
    /// Batches of the crossover map (its rows).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64,128")]
    pub map_batches: Vec<usize>,
    /// Prompt lengths of the crossover map (its columns; `K` is a thousand).
    #[arg(long, value_delimiter = ',', default_value = "1K,4K,16K,32K,64K,128K")]
    pub map_prompts: Vec<String>,
    /// Print the ranking as JSON.
    #[arg(long)]
    pub json: bool,
    /// Directory of fetched weights (a GGUF model's config is read from it).
    #[arg(long, env = "KVBENCH_MODELS_DIR", default_value = "models")]
    pub models_dir: PathBuf,
}

/// `N`, `NK`, `MIN-MAX` → the YAML prompt-length value.
fn prompt_yaml(flag: &str, s: &str) -> Result<String> {
    let one = |x: &str| -> Result<usize> {
        let x = x.trim();
        let (num, scale) = match x.strip_suffix(['K', 'k']) {
            Some(n) => (n, 1000.0),
            None => (x, 1.0),
        };
        let v: f64 = num.parse().map_err(|_| {
            if x.is_empty() {
                anyhow::anyhow!("{flag} `{s}`: a length is missing (N, NK or MIN-MAX)")
            } else {
                anyhow::anyhow!("{flag} `{s}`: `{x}` is not a length (N, NK or MIN-MAX)")
            }
        })?;
        let v = v * scale;
        if !(v >= 1.0 && v.fract() == 0.0) {
            bail!("{flag} `{s}`: `{x}` must be a whole number of tokens ≥ 1");
        }
        Ok(v as usize)
    };
    match s.split_once('-') {
        Some((a, b)) => {
            let (a, b) = (one(a)?, one(b)?);
            if a > b {
                bail!("{flag} `{s}`: the minimum is above the maximum");
            }
            Ok(format!("{{uniform: [{a}, {b}]}}"))
        }
        None => Ok(one(s)?.to_string()),
    }
}

/// One predicted configuration.
#[derive(Debug, Clone, Serialize)]
pub struct Candidate {
    pub rank: usize,
    pub engine: String,
    pub budget: f64,
    pub prefill: String,
    pub attention: String,
    pub batch: usize,
    pub outcome: String,
    pub ttft_mean_s: Option<f64>,
    pub tpot_mean_s: Option<f64>,
    pub output_tok_s: Option<f64>,
    pub e2e_mean_s: Option<f64>,
    /// Per GPU.
    pub memory: Option<MemoryReport>,
    /// Fraction of requests meeting each objective given.
    pub slo_ttft_frac: Option<f64>,
    pub slo_tpot_frac: Option<f64>,
    pub slo_e2e_frac: Option<f64>,
    /// Every request meets every objective given (`None` without objectives).
    pub slo_met: Option<bool>,
    /// Mean accuracy over the tasks minus `full`'s, in points (`None`: not measured).
    pub accuracy_drop_pp: Option<f64>,
    /// A measured cell of the same configuration (`--measured`), when there is one.
    pub measured: Option<MeasuredPoint>,
    pub why: String,
}

/// A measured cell beside a prediction.
#[derive(Debug, Clone, Serialize)]
pub struct MeasuredPoint {
    pub experiment: String,
    pub requests: Option<i64>,
    pub outcome: String,
    pub ttft_mean_s: Option<f64>,
    pub tpot_mean_s: Option<f64>,
    pub output_tok_s: Option<f64>,
}

/// What identifies a configuration across experiments.
#[derive(Debug, Clone, PartialEq)]
struct Point {
    engine: String,
    budget: f64,
    batch: usize,
    prompt: Option<crate::experiment::PromptLen>,
    output_len: Option<usize>,
    attention: String,
    prefill: String,
    rate: f64,
}

fn point(plan: &Plan, c: &crate::experiment::Cell) -> Point {
    Point {
        engine: c.engine.clone(),
        budget: c.budget,
        batch: c.batch,
        prompt: c.prompt_len.clone(),
        output_len: c.output_len,
        attention: c.attention.clone(),
        prefill: plan.exp.scheduler.prefill.clone(),
        rate: c.request_rate,
    }
}

/// Every recorded cell of the measured experiments with its metrics.
fn measured_points(dirs: &[PathBuf], models_dir: &Path) -> Result<Vec<(Point, MeasuredPoint)>> {
    let mut out = Vec::new();
    for d in dirs {
        let m = crate::prediction::Measured::load(d, models_dir)?;
        let path = d.join(schema::RUNS_FILE);
        let df = read_parquet(&path)?;
        let col = |n: &str| -> Result<Vec<Option<f64>>> {
            Ok(floats(&df, n)?.unwrap_or_else(|| vec![None; df.height()]))
        };
        let (ttft, tpot, tok) = (
            col(schema::TTFT_MEAN_S)?,
            col(schema::TPOT_MEAN_S)?,
            col(schema::THROUGHPUT_TOK_S)?,
        );
        let reqs = col(schema::METRICS_NUM_REQUESTS)?;
        for r in m.runs()? {
            out.push((
                point(&m.plan, &r.cell),
                MeasuredPoint {
                    experiment: m.name(),
                    requests: reqs[r.row].map(|x| x as i64),
                    outcome: r.outcome.clone(),
                    ttft_mean_s: ttft[r.row],
                    tpot_mean_s: tpot[r.row],
                    output_tok_s: tok[r.row],
                },
            ));
        }
    }
    Ok(out)
}

/// Mean accuracy per (engine, budget) of an accuracy experiment, and `full`'s.
fn accuracy_by_config(dir: &Path) -> Result<BTreeMap<(String, String), f64>> {
    let path = dir.join(schema::RUNS_FILE);
    let df = read_parquet(&path)?;
    let engine = strings(&df, "engine")?
        .with_context(|| format!("{}: no column `engine`", path.display()))?;
    let budget = floats(&df, "budget")?
        .with_context(|| format!("{}: no column `budget`", path.display()))?;
    let acc = floats(&df, "accuracy_acc")?.with_context(|| {
        format!(
            "{}: no column `accuracy_acc`; expected the results of an accuracy experiment",
            path.display()
        )
    })?;
    let mut sums: BTreeMap<(String, String), (f64, usize)> = BTreeMap::new();
    for i in 0..df.height() {
        if let (Some(e), Some(b), Some(a)) = (&engine[i], budget[i], acc[i]) {
            let s = sums.entry((e.clone(), format!("{b}"))).or_default();
            s.0 += a;
            s.1 += 1;
        }
    }
    Ok(sums
        .into_iter()
        .map(|(k, (s, n))| (k, s / n as f64))
        .collect())
}

fn secs(x: Option<f64>) -> String {
    match x {
        None => "–".into(),
        Some(v) if v < 1.0 => format!("{:.0} ms", v * 1e3),
        Some(v) => format!("{v:.2} s"),
    }
}

fn gb(x: u64) -> String {
    format!("{:.1} GB", x as f64 / 1e9)
}

pub fn run(a: RecommendArgs) -> Result<()> {
    let mut device = load_device(&a.device)?;
    if let Some(m) = &a.max_device_memory {
        let cap = parse_bytes(m).map_err(|e| anyhow::anyhow!("--max-device-memory: {e}"))?;
        let whole = device.capacity()?;
        if cap == 0 || cap > whole {
            bail!(
                "--max-device-memory `{m}`: expected a size above 0 and at most {}'s {whole} bytes",
                device.name
            );
        }
        device.measured_memory_bytes = Some(cap);
    }
    let efficiency = efficiency_for(a.calibration.as_deref(), &device)?;
    let slo = a
        .slo
        .as_deref()
        .map(SloSpec::parse)
        .transpose()
        .map_err(|e| anyhow::anyhow!("--slo: {e}"))?;
    if a.output_len == 0 {
        bail!("--output-len must be at least 1");
    }
    if a.batch == Some(0) {
        bail!("--batch must be at least 1");
    }
    // Checked here so that the error names the flag, not the experiment recommend
    // writes for it.
    if let Some(e) = a
        .engines
        .iter()
        .enumerate()
        .find_map(|(i, e)| a.engines[..i].contains(e).then_some(e))
    {
        bail!("--engines: `{e}` listed twice");
    }
    if let Some(d) = a.max_accuracy_drop {
        if !(d.is_finite() && d >= 0.0) {
            bail!("--max-accuracy-drop {d}: expected percentage points ≥ 0");
        }
    }
    if a.budgets.iter().any(|b| !(*b > 0.0 && *b <= 1.0)) {
        bail!("--budgets: each budget must be in (0, 1]");
    }
    let accuracy = a.accuracy.as_deref().map(accuracy_by_config).transpose()?;
    // Accuracy is a property of the model's weights: another model's numbers are
    // shown, but said to be another model's.
    if let Some(dir) = &a.accuracy {
        if let Some(m) = crate::experiment::recorded(dir, "model").filter(|m| *m != a.model) {
            eprintln!(
                "note: --accuracy {} was measured on {m}; its drops are applied to {} as they are",
                dir.display(),
                a.model
            );
        }
    }
    let full_acc = accuracy
        .as_ref()
        .and_then(|m| m.get(&("full".to_string(), "1".to_string())).copied());
    let prompt = match (&a.prompt_len, &a.map) {
        (Some(p), _) => prompt_yaml("--prompt-len", p)?,
        (None, Some(_)) => String::new(),
        (None, None) => bail!("give --prompt-len (or --map)"),
    };
    let (batch, rate_line, workload) = match (a.batch, a.rate) {
        (Some(b), None) => (
            b,
            String::new(),
            format!("num_requests: {}", a.num_requests.unwrap_or(b)),
        ),
        (None, Some(r)) => {
            if !(r.is_finite() && r > 0.0) {
                bail!("--rate {r}: expected requests per second > 0");
            }
            (
                256,
                format!("\n  request_rate: [{r}]"),
                format!("num_requests: {}", a.num_requests.unwrap_or(200)),
            )
        }
        _ if a.map.is_some() => (0, String::new(), String::new()),
        _ => bail!("give --batch or --rate"),
    };
    let engines: String = a
        .engines
        .iter()
        .map(|e| format!("\n  - name: {e}"))
        .collect();
    let budgets: Vec<String> = a.budgets.iter().map(|b| b.to_string()).collect();
    let slo_yaml = slo.map_or(String::new(), |s| {
        let mut y = String::from("\nslo:");
        for (k, v) in [
            ("ttft_ms", s.ttft_ms),
            ("tpot_ms", s.tpot_ms),
            ("e2e_ms", s.e2e_ms),
        ] {
            if let Some(v) = v {
                y.push_str(&format!("\n  {k}: {v}"));
            }
        }
        y
    });
    let device_name = match device.kind {
        DeviceKind::Cpu => "cpu",
        DeviceKind::Gpu => "cuda",
    };
    let host_line = match &a.host_memory {
        Some(h) => {
            crate::setup::parse_size(h).map_err(|e| anyhow::anyhow!("--host-memory: {e}"))?;
            format!("\n  host_memory: \"{h}\"")
        }
        None => String::new(),
    };
    let search = Search {
        a: &a,
        target: Target {
            device: device.clone(),
            efficiency,
            tensor_parallel: a.tensor_parallel,
        },
        head: format!("name: recommend\nmodel: \"{}\"\ndtype: auto\ndevice:\n  name: {device_name}{host_line}\nengines:{engines}\n", a.model),
        budgets: budgets.join(", "),
        slo,
        slo_yaml,
        accuracy,
        full_acc,
        measured: measured_points(&a.measured, &a.models_dir)?,
    };
    if let Some(base) = &a.map {
        return search.map(base);
    }
    let target = &search.target;
    let rows = search.ranked(&prompt, batch, &rate_line, &workload)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!(
        "{} on {}{} — prompts {}, {} output tokens, {}; {}",
        a.model,
        device.name,
        if a.tensor_parallel > 1 {
            format!(" ×{}", a.tensor_parallel)
        } else {
            String::new()
        },
        a.prompt_len.as_deref().unwrap_or_default(),
        a.output_len,
        match a.rate {
            Some(r) => format!("{r} requests/s"),
            None => format!("batch {batch}"),
        },
        target.efficiency.source
    );
    println!(
        "| # | strategy | budget | prefill | TTFT | TPOT | output tok/s | device memory | SLO | accuracy | why |"
    );
    println!("|---:|---|---:|---|---:|---:|---:|---:|---|---:|---|");
    for c in &rows {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            c.rank,
            c.engine,
            c.budget,
            c.prefill,
            secs(c.ttft_mean_s),
            secs(c.tpot_mean_s),
            c.output_tok_s.map_or("–".into(), |t| format!("{t:.0}")),
            c.memory.map_or("–".into(), |m| gb(m.device_total())),
            match c.slo_met {
                None => "–",
                Some(true) => "met",
                Some(false) => "missed",
            },
            c.accuracy_drop_pp
                .map_or("not measured".into(), |d| format!("{d:+.1} pp")),
            c.why
        );
    }
    Ok(())
}

/// Everything fixed across the workloads one `recommend` compares.
struct Search<'a> {
    a: &'a RecommendArgs,
    target: Target,
    /// The experiment's name, model, device and engines, as YAML.
    head: String,
    budgets: String,
    slo: Option<SloSpec>,
    slo_yaml: String,
    accuracy: Option<BTreeMap<(String, String), f64>>,
    full_acc: Option<f64>,
    measured: Vec<(Point, MeasuredPoint)>,
}

impl Search<'_> {
    /// Every configuration predicted on one workload, ranked and explained.
    fn ranked(
        &self,
        prompt: &str,
        batch: usize,
        rate_line: &str,
        workload: &str,
    ) -> Result<Vec<Candidate>> {
        let a = self.a;
        let mut rows: Vec<Candidate> = Vec::new();
        for prefill in ["chunked", "sequential"] {
            let yaml = format!(
                "{}matrix:\n  batch: [{batch}]\n  prompt_len: [{prompt}]\n  \
                 output_len: [{}]\n  budget: [{}]\n  attention: [{}]{rate_line}\n\
                 workload:\n  {workload}\nscheduler:\n  prefill: {prefill}{}\n",
                self.head, a.output_len, self.budgets, a.attention, self.slo_yaml
            );
            let plan = Plan::parse(&yaml, Path::new("recommend.yaml"), &a.models_dir)
                .context("building the configurations to compare")?;
            let cfg = model_config(&plan, &a.models_dir)?;
            for cell in &plan.cells {
                let r = predict_cell(&plan, cell, &cfg, &self.target)
                    .with_context(|| format!("predicting {}", cell.key()))?;
                let m: Option<&CellMetrics> = r.metrics.as_ref();
                let fracs = m.map(|m| [m.slo_ttft_frac, m.slo_tpot_frac, m.slo_e2e_frac]);
                let slo_met = self.slo.map(|_| {
                    r.outcome == Outcome::Ok && fracs.iter().flatten().flatten().all(|f| *f >= 1.0)
                });
                let acc = self.accuracy.as_ref().and_then(|t| {
                    let mine = t.get(&(cell.engine.clone(), format!("{}", cell.budget)))?;
                    Some((mine - self.full_acc?) * 100.0)
                });
                rows.push(Candidate {
                    rank: 0,
                    engine: cell.engine.clone(),
                    budget: cell.budget,
                    prefill: prefill.to_string(),
                    attention: cell.attention.clone(),
                    batch: cell.batch,
                    outcome: match r.outcome {
                        Outcome::Ok => "ok",
                        Outcome::Oom => "oom",
                        Outcome::Error => "error",
                    }
                    .to_string(),
                    ttft_mean_s: m.and_then(|m| m.ttft_s.as_ref().map(|d| d.mean)),
                    tpot_mean_s: m.and_then(|m| m.tpot_s.as_ref().map(|d| d.mean)),
                    output_tok_s: m.and_then(|m| m.output_throughput),
                    e2e_mean_s: m.and_then(|m| m.e2e_s.as_ref().map(|d| d.mean)),
                    memory: r.memory,
                    slo_ttft_frac: fracs.and_then(|f| f[0]),
                    slo_tpot_frac: fracs.and_then(|f| f[1]),
                    slo_e2e_frac: fracs.and_then(|f| f[2]),
                    slo_met,
                    accuracy_drop_pp: acc,
                    measured: {
                        let p = point(&plan, cell);
                        self.measured
                            .iter()
                            .find(|(q, _)| *q == p)
                            .map(|(_, m)| m.clone())
                    },
                    why: r.error.unwrap_or_default(),
                });
            }
        }
        rank(&mut rows, a.max_accuracy_drop);
        explain(&mut rows, &self.slo, a.max_accuracy_drop);
        Ok(rows)
    }

    /// The crossover map: the first-ranked configuration at every batch × prompt
    /// length of `--map-batches` × `--map-prompts` (one batch of requests each).
    fn map(&self, base: &Path) -> Result<()> {
        let a = self.a;
        let prompts: Vec<usize> = a
            .map_prompts
            .iter()
            .map(|p| {
                prompt_yaml("--map-prompts", p)?
                    .parse::<usize>()
                    .map_err(|_| anyhow::anyhow!("--map-prompts `{p}`: expected one length"))
            })
            .collect::<Result<_>>()?;
        if a.map_batches.is_empty() || prompts.is_empty() || a.map_batches.contains(&0) {
            bail!("--map-batches and --map-prompts need at least one value each, batches ≥ 1");
        }
        let total = a.map_batches.len() * prompts.len();
        let mut cells = Vec::new();
        let mut done = 0;
        for &b in &a.map_batches {
            let mut row = Vec::new();
            for &l in &prompts {
                let ranked = self.ranked(&l.to_string(), b, "", "batches: 1")?;
                done += 1;
                eprintln!("crossover map: {done}/{total} (batch {b}, prompt {l})");
                row.push(
                    ranked
                        .first()
                        .filter(|c| c.outcome == "ok")
                        .map(|c| Winner {
                            engine: c.engine.clone(),
                            detail: if c.engine == "full" {
                                c.prefill.clone()
                            } else {
                                format!("b={} · {}", c.budget, c.prefill)
                            },
                            tok_s: c.output_tok_s.unwrap_or(0.0),
                        }),
                );
            }
            cells.push(row);
        }
        let mut notes = vec![format!(
            "Ranked as `kvbench recommend` ranks: fits in memory, {}then output throughput; engines {}, budgets {}, chunked and sequential prefill, {} attention.",
            if self.slo.is_some() { "meets every objective, " } else { "" },
            a.engines.join(", "),
            self.budgets,
            a.attention
        )];
        notes.push(format!(
            "Predicted by the cost model ({}), not measured: docs/cost-model.md gives its validation and limits.",
            self.target.efficiency.source
        ));
        let map = CrossoverMap {
            context: format!(
                "{} on {} (PREDICTED) · {} output tokens per request, one batch of requests",
                a.model, self.target.device.name, a.output_len
            ),
            batches: a.map_batches.clone(),
            prompt_lens: prompts,
            cells,
            notes,
        };
        let (png, svg) = draw_crossover(base, &map)?;
        println!("crossover map → {} and {}", png.display(), svg.display());
        Ok(())
    }
}

/// Order: runs, within the accuracy allowed (measured first), meets the objectives,
/// then the highest output throughput.
fn rank(rows: &mut [Candidate], max_drop: Option<f64>) {
    let key = |c: &Candidate| {
        let runs = c.outcome == "ok";
        let acc = match (max_drop, c.accuracy_drop_pp) {
            (None, _) => 0,
            (Some(m), Some(d)) if -d <= m => 0,
            (Some(_), None) => 1,
            (Some(_), Some(_)) => 2,
        };
        let slo = c.slo_met.unwrap_or(true);
        (
            !runs,
            acc,
            !slo,
            std::cmp::Reverse(ordered(c.output_tok_s.unwrap_or(0.0))),
        )
    };
    rows.sort_by_key(key);
    for (i, c) in rows.iter_mut().enumerate() {
        c.rank = i + 1;
    }
}

/// A total order on non-negative finite throughputs.
fn ordered(x: f64) -> u64 {
    if x.is_finite() && x > 0.0 {
        x.to_bits()
    } else {
        0
    }
}

/// One line per configuration: what decided its place.
fn explain(rows: &mut [Candidate], slo: &Option<SloSpec>, max_drop: Option<f64>) {
    let full = rows
        .iter()
        .find(|c| c.engine == "full" && c.outcome == "ok")
        .and_then(|c| c.output_tok_s);
    for c in rows.iter_mut() {
        if c.outcome != "ok" {
            continue;
        }
        let mut why = Vec::new();
        if let Some(m) = max_drop {
            match c.accuracy_drop_pp {
                Some(d) if -d > m => why.push(format!(
                    "accuracy {d:+.1} pp against full, past --max-accuracy-drop {m}"
                )),
                None => why.push("accuracy not measured at this budget".into()),
                _ => {}
            }
        }
        if let Some(s) = slo {
            let mut missed = Vec::new();
            for (name, goal, frac) in [
                ("TTFT", s.ttft_ms, c.slo_ttft_frac),
                ("TPOT", s.tpot_ms, c.slo_tpot_frac),
                ("E2E", s.e2e_ms, c.slo_e2e_frac),
            ] {
                if let (Some(g), Some(f)) = (goal, frac) {
                    if f < 1.0 {
                        missed.push(format!(
                            "{name} ≤ {g} ms for {:.0} % of requests",
                            f * 100.0
                        ));
                    }
                }
            }
            if missed.is_empty() {
                why.push("meets every objective".to_string());
            } else {
                why.push(format!("misses: {}", missed.join(", ")));
            }
        }
        if let (Some(f), Some(t)) = (full, c.output_tok_s) {
            if c.engine != "full" {
                why.push(format!("{:.2}× full's throughput", t / f));
            }
        }
        if let Some(m) = c.memory {
            why.push(format!(
                "KV {} on the device{}",
                gb(m.kv_device),
                if m.kv_host > 0 {
                    format!(", {} on the host", gb(m.kv_host))
                } else {
                    String::new()
                }
            ));
        }
        if let Some(m) = &c.measured {
            why.push(format!(
                "measured in {} ({} requests, {}): TTFT {}, TPOT {}, {} tok/s",
                m.experiment,
                m.requests.map_or("?".into(), |n| n.to_string()),
                m.outcome,
                secs(m.ttft_mean_s),
                secs(m.tpot_mean_s),
                m.output_tok_s.map_or("–".into(), |t| format!("{t:.0}"))
            ));
        }
        c.why = why.join("; ");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_lengths_read_as_the_study_writes_them() {
        let p = |s: &str| prompt_yaml("--prompt-len", s);
        assert_eq!(p("1K-10K").unwrap(), "{uniform: [1000, 10000]}");
        assert_eq!(p("512").unwrap(), "512");
        assert_eq!(p("4k").unwrap(), "4000");
        for bad in ["", "x", "10K-1K", "0", "1.5"] {
            assert!(p(bad).is_err(), "{bad}");
        }
        // The flag given is the one named.
        let e = prompt_yaml("--map-prompts", "1K-").unwrap_err().to_string();
        assert!(
            e.starts_with("--map-prompts `1K-`: a length is missing"),
            "{e}"
        );
    }
}
