//! Experiment specs: a YAML file names a model, a device, engines with parameters and a
//! matrix of axes; it expands into cells (one point of the matrix × one repeat). Every
//! key and value is checked before anything runs, and errors name the file, the line
//! and the key with what was expected.
//!
//! Three kinds: `performance` (the default: `matrix` + `workload`), `accuracy`
//! (multiple-choice log-likelihood tasks, an `accuracy:` section) and `retention` (a
//! `retention:` section). An accuracy cell is one engine × budget × scoring mode × task.

use anyhow::{Context, Result};
use kvbench_datasets::prompts::LengthDist;
use kvbench_datasets::tasks::Task;
use kvbench_engines::attention::prefill::AttentionImpl;
use kvbench_engines::device::parse_bytes;
use kvbench_engines::policy::spec::PolicySpec;
use kvbench_engines::source::{LoadOptions, ModelSource};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use xxhash_rust::xxh3::xxh3_128;

/// What an experiment measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// Latency, throughput and memory over a matrix of axes.
    #[default]
    Performance,
    /// Multiple-choice log-likelihood accuracy (lm-eval's tasks) per engine and budget.
    Accuracy,
    /// Fact retention over long multi-turn contexts per engine and budget.
    Retention,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Performance => "performance",
            Kind::Accuracy => "accuracy",
            Kind::Retention => "retention",
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Experiment {
    pub name: String,
    /// performance (default), accuracy or retention.
    #[serde(default)]
    pub kind: Kind,
    /// Model as `kvbench generate --model` takes it.
    pub model: String,
    /// Weights: auto, quantized, f32, f16, bf16.
    #[serde(default = "default_dtype")]
    pub dtype: String,
    #[serde(default)]
    pub seed: u64,
    #[serde(default = "default_device")]
    pub device: Device,
    pub engines: Vec<EngineEntry>,
    /// Axes of a performance experiment (required there, rejected elsewhere).
    pub matrix: Option<Matrix>,
    /// Requests of a performance experiment (required there, rejected elsewhere).
    pub workload: Option<Workload>,
    /// Tasks, limit, budgets and scoring modes of an accuracy experiment.
    pub accuracy: Option<AccuracySpec>,
    /// Buckets, turns, facts and form of a retention experiment.
    pub retention: Option<RetentionSpec>,
    /// Evaluation data directory (accuracy, retention). `--data-dir` (or
    /// `$KVBENCH_DATASETS_DIR`) overrides it; default `data/`, filled by `just fetch-data`.
    pub data_dir: Option<PathBuf>,
    #[serde(default)]
    pub scheduler: Scheduler,
    /// Runs of every matrix point.
    #[serde(default = "one")]
    pub repeats: usize,
    /// Requests run and discarded before each cell's measured requests.
    #[serde(default)]
    pub warmup: usize,
    /// Service-level objectives for goodput (performance experiments); `kvbench run
    /// --slo` replaces them.
    pub slo: Option<SloSpec>,
}

/// Service-level objectives in milliseconds, vLLM's `--goodput ttft:… tpot:… e2el:…`:
/// a request is good when it meets every objective given. Each is optional.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SloSpec {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub e2e_ms: Option<f64>,
}

impl SloSpec {
    /// The objectives in seconds, for [`crate::metrics::compute`].
    pub fn seconds(&self) -> crate::metrics::Slo {
        crate::metrics::Slo {
            ttft_s: self.ttft_ms.map(|x| x / 1000.0),
            tpot_s: self.tpot_ms.map(|x| x / 1000.0),
            e2e_s: self.e2e_ms.map(|x| x / 1000.0),
        }
    }

    /// The objectives by YAML key, in order.
    fn keys(&self) -> [(&'static str, Option<f64>); 3] {
        [
            ("ttft_ms", self.ttft_ms),
            ("tpot_ms", self.tpot_ms),
            ("e2e_ms", self.e2e_ms),
        ]
    }

    /// The first bad objective as (YAML key, why): each given one a positive finite
    /// number of milliseconds, at least one given.
    pub fn check(&self) -> std::result::Result<(), (&'static str, String)> {
        if self.keys().iter().all(|(_, v)| v.is_none()) {
            return Err((
                "",
                "expected at least one of ttft_ms, tpot_ms, e2e_ms (milliseconds)".into(),
            ));
        }
        for (k, v) in self.keys() {
            if let Some(x) = v.filter(|x| !(x.is_finite() && *x > 0.0)) {
                return Err((
                    k,
                    format!("{x}: expected a positive number of milliseconds"),
                ));
            }
        }
        Ok(())
    }

    /// `--slo ttft:500,tpot:50,e2e:2000`: vLLM's `--goodput` pairs in milliseconds
    /// (`e2el` is taken for `e2e`), separated by commas or spaces.
    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        let usage = "expected KEY:MS pairs such as ttft:500,tpot:50,e2e:2000 (keys ttft, \
                     tpot, e2e or e2el; milliseconds > 0)";
        let mut slo = SloSpec::default();
        for pair in s.split([',', ' ']).filter(|p| !p.trim().is_empty()) {
            let (k, v) = pair
                .split_once(':')
                .ok_or_else(|| format!("`{pair}`: {usage}"))?;
            let v: f64 = v
                .trim()
                .parse()
                .map_err(|_| format!("`{pair}`: `{v}` is not a number; {usage}"))?;
            let slot = match k.trim() {
                "ttft" => &mut slo.ttft_ms,
                "tpot" => &mut slo.tpot_ms,
                "e2e" | "e2el" => &mut slo.e2e_ms,
                other => return Err(format!("`{pair}`: unknown objective `{other}`; {usage}")),
            };
            if slot.replace(v).is_some() {
                return Err(format!("`{pair}`: `{}` is given twice", k.trim()));
            }
        }
        slo.check().map_err(|(_, why)| format!("`{s}`: {why}"))?;
        Ok(slo)
    }
}

impl std::fmt::Display for SloSpec {
    /// The `--slo` form ([`SloSpec::parse`] reads it back exactly).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = [
            ("ttft", self.ttft_ms),
            ("tpot", self.tpot_ms),
            ("e2e", self.e2e_ms),
        ]
        .iter()
        .filter_map(|(k, v)| v.map(|v| format!("{k}:{v}")))
        .collect();
        f.write_str(&parts.join(","))
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Device {
    /// cpu, cuda or cuda:N.
    #[serde(default = "default_device_name")]
    pub name: String,
    /// Capacity such as `8GiB` (default: the machine's physical memory on CPU).
    pub memory: Option<String>,
    #[serde(default = "default_fraction")]
    pub memory_fraction: f64,
    /// Host memory an offloading engine may use.
    pub host_memory: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineEntry {
    /// full, h2o, infinigen, streaming.
    pub name: String,
    /// Strategy parameters, as `--set KEY=VALUE`.
    #[serde(default)]
    pub params: BTreeMap<String, serde_yaml::Value>,
}

/// A prompt-length axis value: a length, `{uniform: [min, max]}` or `{list: [...]}`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum PromptLen {
    Fixed(usize),
    Uniform { uniform: [usize; 2] },
    List { list: Vec<usize> },
}

impl PromptLen {
    pub fn dist(&self) -> LengthDist {
        match self {
            PromptLen::Fixed(n) => LengthDist::Fixed(*n),
            PromptLen::Uniform { uniform: [a, b] } => LengthDist::Uniform { min: *a, max: *b },
            PromptLen::List { list } => LengthDist::List(list.clone()),
        }
    }

    fn label(&self) -> String {
        match self {
            PromptLen::Fixed(n) => n.to_string(),
            PromptLen::Uniform { uniform: [a, b] } => format!("uniform:{a}-{b}"),
            PromptLen::List { list } => format!(
                "list:{}",
                list.iter()
                    .map(|x| x.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        }
    }
}

/// Request rate: requests per second, or `inf` (all at t = 0, the study's offline batch).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum Rate {
    PerSecond(f64),
    Named(RateName),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RateName {
    Inf,
}

impl Rate {
    pub fn per_second(&self) -> f64 {
        match self {
            Rate::PerSecond(r) => *r,
            Rate::Named(RateName::Inf) => f64::INFINITY,
        }
    }
}

/// A max-concurrency axis value: most requests in flight (sent and not finished), or
/// `inf` (no cap), as vLLM benchmark_serving's `--max-concurrency`.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum Concurrency {
    Requests(f64),
    Named(RateName),
}

impl Concurrency {
    /// The cap (`None`: no cap), or what was wrong with the value.
    pub fn cap(&self) -> std::result::Result<Option<usize>, String> {
        match *self {
            Concurrency::Named(RateName::Inf) => Ok(None),
            Concurrency::Requests(x) if x == f64::INFINITY => Ok(None),
            Concurrency::Requests(x) if x >= 1.0 && x.fract() == 0.0 && x <= u32::MAX as f64 => {
                Ok(Some(x as usize))
            }
            Concurrency::Requests(x) => Err(format!(
                "{x}: expected an integer ≥ 1 (most requests in flight), or inf"
            )),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Matrix {
    /// Most sequences decoding together (the scheduler's `max_num_seqs`).
    #[serde(default = "one_vec")]
    pub batch: Vec<usize>,
    pub prompt_len: Vec<PromptLen>,
    pub output_len: Vec<usize>,
    /// Fraction of KV pairs kept; `full` runs once at 1.
    #[serde(default = "budget_one")]
    pub budget: Vec<f64>,
    #[serde(default = "flash")]
    pub attention: Vec<String>,
    /// Query rows per chunk, for `chunked` attention only.
    #[serde(default = "chunk")]
    pub chunk_size: Vec<usize>,
    #[serde(default = "inf_rate")]
    pub request_rate: Vec<Rate>,
    /// Gamma shape of inter-arrival times (1 = Poisson), vLLM's convention.
    #[serde(default = "burst")]
    pub burstiness: Vec<f64>,
    /// Most requests in flight (sent and not finished), or `inf`: vLLM's
    /// `--max-concurrency`. A request due while the cap is full is sent when one
    /// finishes, and that is its arrival.
    #[serde(default = "inf_concurrency")]
    pub max_concurrency: Vec<Concurrency>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    /// A UTF-8 text file or a directory of them, prompts are sliced from; absent:
    /// seeded random token ids (enough for presets, whose weights are random).
    pub source: Option<PathBuf>,
    /// Measured requests per cell (this or `batches`).
    #[serde(default)]
    pub num_requests: Option<usize>,
    /// Measured requests per cell as a number of full batches: `batches × batch`, so
    /// every batch point runs the same number of waves (the study's fixed 300 prompts
    /// cut to fit a short lease).
    #[serde(default)]
    pub batches: Option<usize>,
}

impl Workload {
    /// Measured requests of a cell with `batch` concurrent sequences.
    pub fn requests(&self, batch: usize) -> usize {
        match (self.num_requests, self.batches) {
            (Some(n), _) => n,
            (None, Some(b)) => b * batch,
            (None, None) => 0,
        }
    }

    /// How the requests per cell are set, for headers and logs.
    pub fn describe(&self) -> String {
        match (self.num_requests, self.batches) {
            (Some(n), _) => format!("{n} requests per cell"),
            (None, Some(b)) => format!("{b} × batch requests per cell"),
            (None, None) => "no requests".into(),
        }
    }
}

/// How a continuation's log-likelihood is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ScoringMode {
    /// The context is prefilled with the policy active, then the continuation is fed
    /// token by token through decode steps (eviction and selection act on what the
    /// model sees).
    Decode,
    /// Context and continuation in one prefill, as lm-eval scores (a policy that only
    /// compresses after the prefill changes nothing).
    OnePass,
}

impl ScoringMode {
    pub fn name(self) -> &'static str {
        match self {
            ScoringMode::Decode => "decode",
            ScoringMode::OnePass => "one_pass",
        }
    }
}

impl std::str::FromStr for ScoringMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "decode" => Ok(ScoringMode::Decode),
            "one_pass" => Ok(ScoringMode::OnePass),
            _ => Err(format!("`{s}`: expected decode or one_pass")),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AccuracySpec {
    /// piqa, copa, winogrande, hellaswag, openbookqa, boolq.
    pub tasks: Vec<String>,
    /// First items of each task's split (lm-eval's `--limit`); absent: all.
    pub limit: Option<usize>,
    /// Fractions of KV pairs kept; `full` runs once at 1.
    #[serde(default = "budget_one")]
    pub budgets: Vec<f64>,
    /// Scoring modes: decode, one_pass.
    #[serde(default = "decode_mode")]
    pub modes: Vec<ScoringMode>,
    /// Most requests (one per choice) scored together.
    #[serde(default = "acc_batch")]
    pub batch: usize,
    /// Prefill attention implementation.
    #[serde(default = "flash_one")]
    pub attention: String,
}

/// Parameters of the retention task (run by `crate::retention`).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RetentionSpec {
    /// Context-length buckets in tokens, such as `1K-2K`.
    pub buckets: Vec<String>,
    /// Turns at which recall is asked.
    #[serde(default = "default_turns")]
    pub turns: Vec<usize>,
    /// Facts planted per conversation.
    pub facts: usize,
    /// `chat` (the study's multi-turn form) or `passkey`.
    pub form: String,
    /// Conversations per bucket; absent: the task's default.
    pub limit: Option<usize>,
    #[serde(default = "budget_one")]
    pub budgets: Vec<f64>,
    /// Most conversations decoding together.
    #[serde(default = "acc_batch")]
    pub batch: usize,
    #[serde(default = "flash_one")]
    pub attention: String,
}

/// A retention bucket `A-B` in tokens (`1K-2K`, `512-1K`; K = 1024): (A, B), A < B.
pub fn parse_bucket(s: &str) -> std::result::Result<(usize, usize), String> {
    let num = |x: &str| -> Option<usize> {
        let x = x.trim();
        match x.strip_suffix(['K', 'k']) {
            Some(k) => k.parse::<usize>().ok()?.checked_mul(1024),
            None => x.parse().ok(),
        }
    };
    match s.split_once('-').map(|(a, b)| (num(a), num(b))) {
        Some((Some(a), Some(b))) if a < b => Ok((a, b)),
        _ => Err(format!(
            "`{s}`: expected a token range such as 1K-2K (lower below upper; K = 1024)"
        )),
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Scheduler {
    #[serde(default = "batched_tokens")]
    pub max_batched_tokens: usize,
    /// chunked or sequential.
    #[serde(default = "chunked")]
    pub prefill: String,
    #[serde(default = "block")]
    pub block_size: usize,
    pub max_model_len: Option<usize>,
}

impl Default for Scheduler {
    fn default() -> Self {
        Self {
            max_batched_tokens: batched_tokens(),
            prefill: chunked(),
            block_size: block(),
            max_model_len: None,
        }
    }
}

fn default_dtype() -> String {
    "auto".into()
}
fn default_device_name() -> String {
    "cpu".into()
}
fn default_device() -> Device {
    Device {
        name: default_device_name(),
        memory: None,
        memory_fraction: default_fraction(),
        host_memory: None,
    }
}
fn default_fraction() -> f64 {
    0.9
}
fn one() -> usize {
    1
}
fn one_vec() -> Vec<usize> {
    vec![1]
}
fn budget_one() -> Vec<f64> {
    vec![1.0]
}
fn flash() -> Vec<String> {
    vec!["flash".into()]
}
fn chunk() -> Vec<usize> {
    vec![512]
}
fn inf_rate() -> Vec<Rate> {
    vec![Rate::Named(RateName::Inf)]
}
fn inf_concurrency() -> Vec<Concurrency> {
    vec![Concurrency::Named(RateName::Inf)]
}
fn decode_mode() -> Vec<ScoringMode> {
    vec![ScoringMode::Decode]
}
fn acc_batch() -> usize {
    16
}
fn flash_one() -> String {
    "flash".into()
}
fn default_turns() -> Vec<usize> {
    vec![2, 4, 6, 8, 10, 12]
}
fn burst() -> Vec<f64> {
    vec![1.0]
}
fn batched_tokens() -> usize {
    8192
}
fn chunked() -> String {
    "chunked".into()
}
fn block() -> usize {
    16
}

/// One point of the matrix, one repeat.
#[derive(Debug, Clone, Serialize)]
pub struct Cell {
    /// Position in the plan's expansion (what `--dry-run` lists); not part of the
    /// cell's identity, so inserting an engine or an axis value renumbers cells
    /// without re-running them.
    pub index: usize,
    /// Hash of everything that can change the cell's result ([`identity`]): names
    /// its result file and ties the result to the spec.
    pub id: String,
    /// The same hash without the repeat: the cells of one matrix point share it, so
    /// repeats are averaged over exactly the runs of one setting.
    pub point: String,
    pub engine: String,
    pub params: BTreeMap<String, String>,
    pub batch: usize,
    /// Performance cells only (null elsewhere).
    pub prompt_len: Option<PromptLen>,
    pub output_len: Option<usize>,
    pub budget: f64,
    pub attention: String,
    /// `None` unless the attention implementation is `chunked`.
    pub chunk_size: Option<usize>,
    pub request_rate: f64,
    pub burstiness: f64,
    /// Most requests in flight; `None`: no cap.
    pub max_concurrency: Option<usize>,
    /// Performance cells with objectives: goodput is measured against them. Absent
    /// otherwise, so the identities of cells recorded before SLOs existed stand.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slo: Option<SloSpec>,
    pub repeat: usize,
    /// Accuracy cells: the task, the scoring mode and the item limit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub task: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mode: Option<ScoringMode>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit: Option<usize>,
    /// Retention cells: the context bucket.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bucket: Option<String>,
}

impl Cell {
    /// Stable identity of a cell: a sweep skips cells whose key is already recorded.
    pub fn key(&self) -> String {
        let params: Vec<String> = self
            .params
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        let limit = self.limit.map_or("all".into(), |l| l.to_string());
        if let (Some(task), Some(mode)) = (&self.task, self.mode) {
            return format!(
                "kind=accuracy;engine={};params={};budget={};task={task};mode={};limit={limit};batch={};attention={};repeat={}",
                self.engine,
                params.join(","),
                self.budget,
                mode.name(),
                self.batch,
                self.attention,
                self.repeat
            );
        }
        if let Some(bucket) = &self.bucket {
            return format!(
                "kind=retention;engine={};params={};budget={};bucket={bucket};limit={limit};batch={};attention={};repeat={}",
                self.engine,
                params.join(","),
                self.budget,
                self.batch,
                self.attention,
                self.repeat
            );
        }
        // The cap joins the key only when there is one: keys recorded before the
        // axis existed stay valid.
        let cap = self
            .max_concurrency
            .map_or(String::new(), |c| format!(";max_concurrency={c}"));
        format!(
            "engine={};params={};batch={};prompt={};output={};budget={};attention={};chunk={};rate={};burstiness={}{cap};repeat={}",
            self.engine,
            params.join(","),
            self.batch,
            self.prompt_len.as_ref().map_or("-".into(), |p| p.label()),
            self.output_len.map_or("-".into(), |o| o.to_string()),
            self.budget,
            self.attention,
            self.chunk_size.map_or("-".into(), |c| c.to_string()),
            self.request_rate,
            self.burstiness,
            self.repeat
        )
    }
}

/// Version of what [`identity`] hashes: bumped when its meaning changes, so results
/// recorded under another meaning are not taken for this one's.
const IDENTITY_VERSION: u32 = 1;

/// A cell's identity: a hash of everything that can change its result. That is the
/// cell's own values (engine, parameters, axes, repeat, the SLO of its goodput, absent
/// when none is set) and the settings the whole
/// experiment shares (model, dtype, seed, device and memory, workload, warm-up,
/// scheduler, the retention task's form, facts and turns) and the CPU worker threads.
/// Left out: the cell's index, the experiment's name, the other cells (so adding an
/// engine or an axis value keeps every other cell's identity) and where the data
/// lives (a path differs between machines that share a sweep).
pub fn identity(exp: &Experiment, cell: &Cell, threads: usize) -> String {
    settings_hash(exp, cell, threads, true)
}

/// [`identity`], with or without the repeat.
fn settings_hash(exp: &Experiment, cell: &Cell, threads: usize, repeat: bool) -> String {
    let mut own = serde_json::to_value(cell).unwrap_or_default();
    if let serde_json::Value::Object(m) = &mut own {
        m.remove("index");
        m.remove("id");
        m.remove("point");
        if !repeat {
            m.remove("repeat");
        }
    }
    let retention = exp.retention.as_ref().map(|r| {
        // Buckets, budgets, limit, batch and attention are the cell's own values.
        serde_json::json!({"form": r.form, "facts": r.facts, "turns": r.turns})
    });
    let all = serde_json::json!({
        "identity": IDENTITY_VERSION,
        "kind": exp.kind,
        "cell": own,
        "model": exp.model,
        "dtype": exp.dtype,
        "seed": exp.seed,
        "device": exp.device,
        "workload": exp.workload,
        "warmup": exp.warmup,
        "scheduler": exp.scheduler,
        "retention": retention,
        "threads": threads,
    });
    format!("{:032x}", xxh3_128(all.to_string().as_bytes()))
}

/// Set every cell's identity and point (with this process's CPU worker threads).
fn identify(exp: &Experiment, cells: &mut [Cell]) {
    let threads = candle_core::utils::get_num_threads();
    for c in cells {
        c.id = identity(exp, c, threads);
        c.point = settings_hash(exp, c, threads, false);
    }
}

/// A parsed, checked experiment and where it came from.
#[derive(Debug, Clone)]
pub struct Plan {
    pub exp: Experiment,
    pub cells: Vec<Cell>,
    /// The model's context length (prompt + output must fit).
    pub context: usize,
}

/// An error naming the file, the line of `key` in it and the key (`exp.yaml:12:
/// `matrix.batch`: ...`).
fn key_error(path: &Path, text: &str, key: &str, msg: String) -> anyhow::Error {
    let at = line_of(text, key).map_or(String::new(), |l| format!(":{l}"));
    anyhow::anyhow!("{}{at}: `{key}`: {msg}", path.display())
}

/// Line (1-based) of the key at `path` (`matrix.budget`) in the YAML text: each segment
/// is searched as `name:` below the previous one, more indented.
fn line_of(text: &str, path: &str) -> Option<usize> {
    let lines: Vec<&str> = text.lines().collect();
    let mut from = 0;
    let mut indent: Option<usize> = None;
    let mut found = None;
    for seg in path.split('.') {
        let seg = seg.split('[').next().unwrap_or(seg);
        let hit = (from..lines.len()).find(|&i| {
            let l = lines[i];
            let ind = l.len() - l.trim_start().len();
            let t = l.trim_start().trim_start_matches("- ");
            indent.is_none_or(|p| ind > p)
                && (t.starts_with(&format!("{seg}:")) || t.starts_with(&format!("\"{seg}\":")))
        })?;
        indent = Some(lines[hit].len() - lines[hit].trim_start().len());
        from = hit + 1;
        found = Some(hit + 1);
    }
    found
}

/// Line (1-based) of the `i`-th list item under the top-level key `list`.
fn item_line(text: &str, list: &str, i: usize) -> Option<usize> {
    let start = line_of(text, list)?;
    let lines: Vec<&str> = text.lines().collect();
    lines
        .iter()
        .enumerate()
        .skip(start)
        .take_while(|(_, l)| l.trim().is_empty() || l.starts_with(' ') || l.starts_with('-'))
        .filter(|(_, l)| l.trim_start().starts_with("- "))
        .nth(i)
        .map(|(n, _)| n + 1)
}

fn scalar(v: &serde_yaml::Value) -> Option<String> {
    match v {
        serde_yaml::Value::Bool(b) => Some(b.to_string()),
        serde_yaml::Value::Number(n) => Some(n.to_string()),
        serde_yaml::Value::String(s) => Some(s.clone()),
        _ => None,
    }
}

impl Plan {
    /// `path`, or the file it names under experiments/ without `.yaml`
    /// (`cpu/quickstart`).
    pub fn resolve(path: &Path) -> PathBuf {
        let named = Path::new("experiments").join(path).with_extension("yaml");
        if !path.exists() && named.is_file() {
            named
        } else {
            path.to_path_buf()
        }
    }

    /// Read, parse, check and expand an experiment file.
    /// `path` may also be a name under experiments/ without `.yaml` (`cpu/quickstart`).
    pub fn load(path: &Path, models_dir: &Path) -> Result<Self> {
        let resolved = Self::resolve(path);
        let path = resolved.as_path();
        let text = std::fs::read_to_string(path).with_context(|| {
            format!(
                "reading experiment {}: expected a YAML file or a name under experiments/ \
                 such as cpu/quickstart",
                path.display()
            )
        })?;
        Self::parse(&text, path, models_dir)
    }

    /// [`Plan::load`], then the objectives of `--slo` in place of the YAML's.
    pub fn load_with(path: &Path, models_dir: &Path, slo: Option<SloSpec>) -> Result<Self> {
        let plan = Self::load(path, models_dir)?;
        match slo {
            Some(s) => plan.with_slo(s),
            None => Ok(plan),
        }
    }

    pub fn parse(text: &str, path: &Path, models_dir: &Path) -> Result<Self> {
        let file = path.display();
        let exp: Experiment = serde_yaml::from_str(text).map_err(|e| {
            let at = e
                .location()
                .map_or(String::new(), |l| format!(":{}", l.line()));
            anyhow::anyhow!("{file}{at}: {e}")
        })?;
        let err = |key: &str, msg: String| key_error(path, text, key, msg);
        // The name is a directory under results/: `.`, `..` or a separator would
        // write elsewhere.
        if exp.name.trim().is_empty()
            || exp.name.chars().all(|c| c == '.')
            || !exp
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return Err(err(
                "name",
                format!("`{}`: expected a name of letters, digits, `-`, `_`, `.`, not only dots (it names the directory results/<name>/)", exp.name),
            ));
        }
        if !["auto", "quantized", "f32", "f16", "bf16"].contains(&exp.dtype.as_str()) {
            return Err(err(
                "dtype",
                format!(
                    "`{}`: expected auto, quantized, f32, f16 or bf16",
                    exp.dtype
                ),
            ));
        }
        exp.device
            .name
            .parse::<kvbench_engines::device::DeviceKind>()
            .map_err(|e| err("device.name", e.to_string()))?;
        for (k, v) in [
            ("device.memory", &exp.device.memory),
            ("device.host_memory", &exp.device.host_memory),
        ] {
            if let Some(v) = v {
                parse_bytes(v).map_err(|e| err(k, e))?;
            }
        }
        let f = exp.device.memory_fraction;
        if !(f > 0.0 && f <= 1.0) {
            return Err(err(
                "device.memory_fraction",
                format!("{f}: expected a number in (0, 1]"),
            ));
        }
        if exp.engines.is_empty() {
            return Err(err("engines", "expected at least one engine".into()));
        }
        if exp.repeats == 0 {
            return Err(err("repeats", "expected at least 1".into()));
        }
        let s = &exp.scheduler;
        if !["chunked", "sequential"].contains(&s.prefill.as_str()) {
            return Err(err(
                "scheduler.prefill",
                format!("`{}`: expected chunked or sequential", s.prefill),
            ));
        }
        if s.max_batched_tokens == 0 || s.block_size == 0 {
            return Err(err(
                "scheduler",
                "max_batched_tokens and block_size must be ≥ 1".into(),
            ));
        }
        // The model's context, from its config only (no weights are read).
        let src = ModelSource::parse(&exp.model).map_err(|e| err("model", e.to_string()))?;
        let opts = LoadOptions {
            models_dir: models_dir.to_path_buf(),
            ..Default::default()
        };
        let cfg = src.config(&opts).map_err(|e| err("model", e.to_string()))?;
        let context = s.max_model_len.unwrap_or(cfg.max_position_embeddings);
        if context > cfg.max_position_embeddings {
            return Err(err(
                "scheduler.max_model_len",
                format!(
                    "{context}: longer than the model's context of {}",
                    cfg.max_position_embeddings
                ),
            ));
        }
        // Each kind's own section, and no other kind's.
        let kind = exp.kind;
        for (key, present, owner) in [
            ("matrix", exp.matrix.is_some(), Kind::Performance),
            ("workload", exp.workload.is_some(), Kind::Performance),
            ("accuracy", exp.accuracy.is_some(), Kind::Accuracy),
            ("retention", exp.retention.is_some(), Kind::Retention),
        ] {
            if present && owner != kind {
                return Err(err(
                    key,
                    format!(
                        "`{key}` belongs to `kind: {}` experiments; this one is `kind: {}`",
                        owner.name(),
                        kind.name()
                    ),
                ));
            }
            if !present && owner == kind {
                let at = line_of(text, "kind").map_or(String::new(), |l| format!(":{l}"));
                return Err(anyhow::anyhow!(
                    "{file}{at}: a `kind: {}` experiment needs a `{key}:` section",
                    kind.name()
                ));
            }
        }
        if let Some(slo) = &exp.slo {
            if kind != Kind::Performance {
                return Err(err(
                    "slo",
                    format!(
                        "`slo` belongs to `kind: performance` experiments; this one is `kind: {}`",
                        kind.name()
                    ),
                ));
            }
            slo.check().map_err(|(k, why)| {
                let key = if k.is_empty() {
                    "slo".to_string()
                } else {
                    format!("slo.{k}")
                };
                err(&key, why)
            })?;
        }
        let mut cells = match kind {
            Kind::Performance => Self::performance_cells(&exp, text, path, context)?,
            Kind::Accuracy => Self::accuracy_cells(&exp, text, path, context)?,
            Kind::Retention => Self::retention_cells(&exp, text, path)?,
        };
        identify(&exp, &mut cells);
        Ok(Plan {
            exp,
            cells,
            context,
        })
    }

    /// The plan with the objectives of `kvbench run --slo` in place of the YAML's:
    /// every cell's identity changes with them (goodput is measured against them).
    pub fn with_slo(mut self, slo: SloSpec) -> Result<Self> {
        if self.exp.kind != Kind::Performance {
            anyhow::bail!(
                "--slo {slo}: objectives apply to performance experiments; `{}` is `kind: {}`",
                self.exp.name,
                self.exp.kind.name()
            );
        }
        slo.check()
            .map_err(|(_, why)| anyhow::anyhow!("--slo {slo}: {why}"))?;
        self.exp.slo = Some(slo);
        for c in &mut self.cells {
            c.slo = Some(slo);
        }
        identify(&self.exp, &mut self.cells);
        Ok(self)
    }

    /// Engines with their parameters, each checked at every budget it will run with
    /// (`full` runs once, at 1).
    #[allow(clippy::type_complexity)]
    fn engines(
        exp: &Experiment,
        text: &str,
        path: &Path,
        budgets: &[f64],
    ) -> Result<Vec<(String, BTreeMap<String, String>, Vec<f64>)>> {
        let file = path.display();
        let err = |key: &str, msg: String| key_error(path, text, key, msg);
        let mut engines = Vec::new();
        for (i, e) in exp.engines.iter().enumerate() {
            let key = format!("engines[{i}]");
            let mut params = BTreeMap::new();
            for (k, v) in &e.params {
                let v = scalar(v).ok_or_else(|| {
                    err(
                        &format!("{key}.params"),
                        format!("`{k}`: expected a number, a string or a boolean"),
                    )
                })?;
                params.insert(k.clone(), v);
            }
            let pairs: Vec<(String, String)> =
                params.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            let budgets: Vec<f64> = if e.name == "full" {
                vec![1.0]
            } else {
                budgets.to_vec()
            };
            for &b in &budgets {
                PolicySpec::parse(&e.name, b, &pairs).map_err(|x| {
                    let at =
                        item_line(text, "engines", i).map_or(String::new(), |l| format!(":{l}"));
                    anyhow::anyhow!("{file}{at}: `{key}` (`{}`): {x}", e.name)
                })?;
            }
            engines.push((e.name.clone(), params, budgets));
        }
        Ok(engines)
    }

    /// Budgets in (0, 1], a non-empty list.
    fn check_budgets(
        budgets: &[f64],
        key: &str,
        err: &dyn Fn(&str, String) -> anyhow::Error,
    ) -> Result<()> {
        if budgets.is_empty() {
            return Err(err(key, "expected a non-empty list".into()));
        }
        if let Some(b) = budgets.iter().find(|&&b| !(b > 0.0 && b <= 1.0)) {
            return Err(err(
                key,
                format!("{b}: expected a fraction of KV pairs kept, in (0, 1]"),
            ));
        }
        Ok(())
    }

    fn accuracy_cells(
        exp: &Experiment,
        text: &str,
        path: &Path,
        context: usize,
    ) -> Result<Vec<Cell>> {
        let err = |key: &str, msg: String| key_error(path, text, key, msg);
        let a = exp
            .accuracy
            .as_ref()
            .context("an accuracy experiment needs an `accuracy:` section")?;
        if a.tasks.is_empty() {
            return Err(err(
                "accuracy.tasks",
                format!("expected a non-empty list of {}", task_names()),
            ));
        }
        let mut tasks: Vec<Task> = Vec::new();
        for t in &a.tasks {
            let task: Task = t.parse().map_err(|e: String| err("accuracy.tasks", e))?;
            if tasks.contains(&task) {
                return Err(err("accuracy.tasks", format!("`{t}` is listed twice")));
            }
            tasks.push(task);
        }
        if a.limit == Some(0) {
            return Err(err(
                "accuracy.limit",
                "0: expected at least 1 item per task (or no limit)".into(),
            ));
        }
        Self::check_budgets(&a.budgets, "accuracy.budgets", &err)?;
        if a.modes.is_empty() {
            return Err(err(
                "accuracy.modes",
                "expected a non-empty list of decode, one_pass".into(),
            ));
        }
        if a.batch == 0 {
            return Err(err("accuracy.batch", "0: expected at least 1".into()));
        }
        a.attention
            .parse::<AttentionImpl>()
            .map_err(|e| err("accuracy.attention", e.to_string()))?;
        if context < 64 {
            return Err(err(
                "scheduler.max_model_len",
                format!("{context}: too short to score the tasks' items (expected ≥ 64)"),
            ));
        }
        let engines = Self::engines(exp, text, path, &a.budgets)?;
        let mut cells = Vec::new();
        for (name, params, budgets) in &engines {
            for &budget in budgets {
                for &mode in &a.modes {
                    for &task in &tasks {
                        for repeat in 0..exp.repeats {
                            cells.push(Cell {
                                index: cells.len(),
                                id: String::new(),
                                point: String::new(),
                                engine: name.clone(),
                                params: params.clone(),
                                batch: a.batch,
                                prompt_len: None,
                                output_len: None,
                                budget,
                                attention: a.attention.clone(),
                                chunk_size: None,
                                request_rate: f64::INFINITY,
                                burstiness: 1.0,
                                max_concurrency: None,
                                slo: None,
                                repeat,
                                task: Some(task.name().to_string()),
                                mode: Some(mode),
                                limit: a.limit,
                                bucket: None,
                            });
                        }
                    }
                }
            }
        }
        Ok(cells)
    }

    fn retention_cells(exp: &Experiment, text: &str, path: &Path) -> Result<Vec<Cell>> {
        let err = |key: &str, msg: String| key_error(path, text, key, msg);
        let r = exp
            .retention
            .as_ref()
            .context("a retention experiment needs a `retention:` section")?;
        if r.buckets.is_empty() {
            return Err(err(
                "retention.buckets",
                "expected a non-empty list such as [1K-2K, 2K-4K]".into(),
            ));
        }
        for b in &r.buckets {
            parse_bucket(b).map_err(|e| err("retention.buckets", e))?;
        }
        if r.turns.is_empty() || r.turns.contains(&0) {
            return Err(err(
                "retention.turns",
                "expected a non-empty list of turns ≥ 1".into(),
            ));
        }
        if r.facts == 0 {
            return Err(err("retention.facts", "0: expected at least 1 fact".into()));
        }
        if !["chat", "passkey"].contains(&r.form.as_str()) {
            return Err(err(
                "retention.form",
                format!("`{}`: expected chat or passkey", r.form),
            ));
        }
        // The builder's rules, checked before anything runs.
        if r.form == "chat" && r.turns.iter().any(|&t| t < 2) {
            return Err(err(
                "retention.turns",
                format!(
                    "{:?}: expected turns ≥ 2 for the chat form (turn 1 states the fact)",
                    r.turns
                ),
            ));
        }
        if r.form == "passkey" && r.turns != [1] {
            return Err(err(
                "retention.turns",
                format!(
                    "{:?}: expected [1] for the passkey form (the key and the question share \
                     one message)",
                    r.turns
                ),
            ));
        }
        if r.limit == Some(0) {
            return Err(err(
                "retention.limit",
                "0: expected at least 1 conversation per bucket".into(),
            ));
        }
        Self::check_budgets(&r.budgets, "retention.budgets", &err)?;
        if r.batch == 0 {
            return Err(err("retention.batch", "0: expected at least 1".into()));
        }
        r.attention
            .parse::<AttentionImpl>()
            .map_err(|e| err("retention.attention", e.to_string()))?;
        let engines = Self::engines(exp, text, path, &r.budgets)?;
        let mut cells = Vec::new();
        for (name, params, budgets) in &engines {
            for &budget in budgets {
                for bucket in &r.buckets {
                    for repeat in 0..exp.repeats {
                        cells.push(Cell {
                            index: cells.len(),
                            id: String::new(),
                            point: String::new(),
                            engine: name.clone(),
                            params: params.clone(),
                            batch: r.batch,
                            prompt_len: None,
                            output_len: None,
                            budget,
                            attention: r.attention.clone(),
                            chunk_size: None,
                            request_rate: f64::INFINITY,
                            burstiness: 1.0,
                            max_concurrency: None,
                            slo: None,
                            repeat,
                            task: None,
                            mode: None,
                            limit: r.limit,
                            bucket: Some(bucket.clone()),
                        });
                    }
                }
            }
        }
        Ok(cells)
    }

    fn performance_cells(
        exp: &Experiment,
        text: &str,
        path: &Path,
        context: usize,
    ) -> Result<Vec<Cell>> {
        let err = |key: &str, msg: String| key_error(path, text, key, msg);
        let w = exp
            .workload
            .as_ref()
            .context("a performance experiment needs a `workload:` section")?;
        match (w.num_requests, w.batches) {
            (Some(_), Some(_)) => {
                return Err(err(
                    "workload.batches",
                    "expected either `num_requests` or `batches`, not both".into(),
                ))
            }
            (None, None) => {
                return Err(err(
                    "workload",
                    "expected `num_requests` (requests per cell) or `batches` (full \
                     batches per cell)"
                        .into(),
                ))
            }
            (Some(0), _) => return Err(err("workload.num_requests", "expected at least 1".into())),
            (_, Some(0)) => return Err(err("workload.batches", "expected at least 1".into())),
            _ => {}
        }
        if let Some(src) = &w.source {
            if !src.exists() {
                return Err(err(
                    "workload.source",
                    format!(
                        "{} does not exist: expected a UTF-8 text file or a directory of them",
                        src.display()
                    ),
                ));
            }
        }
        let m = exp
            .matrix
            .as_ref()
            .context("a performance experiment needs a `matrix:` section")?;
        for (key, empty) in [
            ("matrix.batch", m.batch.is_empty()),
            ("matrix.prompt_len", m.prompt_len.is_empty()),
            ("matrix.output_len", m.output_len.is_empty()),
            ("matrix.budget", m.budget.is_empty()),
            ("matrix.attention", m.attention.is_empty()),
            ("matrix.chunk_size", m.chunk_size.is_empty()),
            ("matrix.request_rate", m.request_rate.is_empty()),
            ("matrix.burstiness", m.burstiness.is_empty()),
            ("matrix.max_concurrency", m.max_concurrency.is_empty()),
        ] {
            if empty {
                return Err(err(key, "expected a non-empty list".into()));
            }
        }
        if let Some(b) = m.batch.iter().find(|&&b| b == 0) {
            return Err(err(
                "matrix.batch",
                format!("{b}: expected batch sizes ≥ 1"),
            ));
        }
        if let Some(o) = m.output_len.iter().find(|&&o| o == 0) {
            return Err(err(
                "matrix.output_len",
                format!("{o}: expected output lengths ≥ 1"),
            ));
        }
        Self::check_budgets(&m.budget, "matrix.budget", &err)?;
        for a in &m.attention {
            a.parse::<AttentionImpl>()
                .map_err(|e| err("matrix.attention", e.to_string()))?;
        }
        if let Some(c) = m.chunk_size.iter().find(|&&c| c == 0) {
            return Err(err("matrix.chunk_size", format!("{c}: expected ≥ 1")));
        }
        if let Some(r) = m
            .request_rate
            .iter()
            .find(|r| r.per_second().is_nan() || r.per_second() <= 0.0)
        {
            return Err(err(
                "matrix.request_rate",
                format!("{r:?}: expected requests per second > 0, or inf"),
            ));
        }
        if let Some(b) = m.burstiness.iter().find(|&&b| !(b > 0.0 && b.is_finite())) {
            return Err(err(
                "matrix.burstiness",
                format!("{b}: expected a gamma shape > 0 (1 = Poisson)"),
            ));
        }
        let caps: Vec<Option<usize>> = m
            .max_concurrency
            .iter()
            .map(|c| c.cap().map_err(|e| err("matrix.max_concurrency", e)))
            .collect::<Result<_>>()?;
        for p in &m.prompt_len {
            p.dist()
                .validate()
                .map_err(|e| err("matrix.prompt_len", e.to_string()))?;
        }
        let longest = m
            .prompt_len
            .iter()
            .map(|p| p.dist().max())
            .max()
            .unwrap_or(0)
            + m.output_len.iter().copied().max().unwrap_or(0);
        if longest > context {
            return Err(err(
                "matrix.prompt_len",
                format!(
                    "the longest prompt + output is {longest} tokens, longer than the model's context of {context}"
                ),
            ));
        }
        let engines = Self::engines(exp, text, path, &m.budget)?;
        let mut cells = Vec::new();
        for (name, params, budgets) in &engines {
            for &batch in &m.batch {
                for prompt_len in &m.prompt_len {
                    for &output_len in &m.output_len {
                        for &budget in budgets {
                            for attention in &m.attention {
                                let chunks: Vec<Option<usize>> = if attention == "chunked" {
                                    m.chunk_size.iter().map(|&c| Some(c)).collect()
                                } else {
                                    vec![None]
                                };
                                for chunk_size in chunks {
                                    for rate in &m.request_rate {
                                        for &burstiness in &m.burstiness {
                                            for &max_concurrency in &caps {
                                                for repeat in 0..exp.repeats {
                                                    cells.push(Cell {
                                                        index: cells.len(),
                                                        id: String::new(),
                                                        point: String::new(),
                                                        engine: name.clone(),
                                                        params: params.clone(),
                                                        batch,
                                                        prompt_len: Some(prompt_len.clone()),
                                                        output_len: Some(output_len),
                                                        budget,
                                                        attention: attention.clone(),
                                                        chunk_size,
                                                        request_rate: rate.per_second(),
                                                        burstiness,
                                                        max_concurrency,
                                                        slo: exp.slo,
                                                        repeat,
                                                        task: None,
                                                        mode: None,
                                                        limit: None,
                                                        bucket: None,
                                                    });
                                                }
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(cells)
    }

    /// The evaluation data directory: `flag` (`--data-dir`, or `$KVBENCH_DATASETS_DIR`
    /// through it), else the YAML's `data_dir`, else `data/` under the working directory
    /// (the repository root, where the recipes run; `just fetch-data` fills it).
    pub fn data_dir(&self, flag: Option<&Path>) -> PathBuf {
        match (flag, &self.exp.data_dir) {
            (Some(f), _) => f.to_path_buf(),
            (None, Some(d)) => d.clone(),
            (None, None) => kvbench_datasets::tasks::default_data_dir(Path::new(".")),
        }
    }
}

fn task_names() -> String {
    Task::ALL.map(|t| t.name()).join(", ")
}

/// `i/n`: run every n-th cell starting at i (a sweep split over machines).
pub fn parse_shard(s: &str) -> Result<(usize, usize)> {
    let (i, n) = s
        .split_once('/')
        .and_then(|(i, n)| Some((i.parse::<usize>().ok()?, n.parse::<usize>().ok()?)))
        .filter(|&(i, n)| n > 0 && i < n)
        .with_context(|| format!("--shard `{s}`: expected i/n with 0 ≤ i < n"))?;
    Ok((i, n))
}

/// The cells of shard `i/n`.
pub fn shard(cells: &[Cell], shard: Option<(usize, usize)>) -> Vec<&Cell> {
    match shard {
        None => cells.iter().collect(),
        Some((i, n)) => cells.iter().filter(|c| c.index % n == i).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "\
name: t
model: preset:tiny
engines:
  - name: full
  - name: h2o
    params: {stats: exact}
matrix:
  batch: [1, 2]
  prompt_len: [32, {uniform: [16, 64]}]
  output_len: [8]
  budget: [0.5, 0.25]
  attention: [flash, chunked]
  chunk_size: [16, 32]
workload:
  num_requests: 4
repeats: 2
";

    fn parse(text: &str) -> Result<Plan> {
        Plan::parse(text, Path::new("exp.yaml"), Path::new("models"))
    }

    /// The error message, or "" when the text is valid.
    fn err(text: &str) -> String {
        parse(text)
            .err()
            .map_or(String::new(), |e| format!("{e:#}"))
    }

    #[test]
    fn the_matrix_expands_with_full_once_and_chunk_sizes_only_for_chunked() {
        let p = parse(GOOD).unwrap();
        // full: 2 batch × 2 prompt × 1 budget × (flash + 2 chunk sizes) × 2 repeats = 24;
        // h2o: the same × 2 budgets = 48.
        assert_eq!(p.cells.len(), 72);
        assert!(p
            .cells
            .iter()
            .filter(|c| c.engine == "full")
            .all(|c| c.budget == 1.0));
        assert!(p
            .cells
            .iter()
            .all(|c| (c.attention == "chunked") == c.chunk_size.is_some()));
        let keys: std::collections::HashSet<String> = p.cells.iter().map(|c| c.key()).collect();
        assert_eq!(keys.len(), p.cells.len(), "cell keys are unique");
        assert_eq!(p.cells[5].index, 5);
        let s = shard(&p.cells, Some((1, 3)));
        assert_eq!(s.len(), 24);
        assert!(s.iter().all(|c| c.index % 3 == 1));
        let tiny = kvbench_engines::config::preset("tiny").unwrap();
        assert_eq!(p.context, tiny.max_position_embeddings);
    }

    #[test]
    fn bad_values_name_the_file_line_and_key() {
        let e = err(&GOOD.replace("batch: [1, 2]", "batch: [1, -2]"));
        assert!(e.starts_with("exp.yaml:8"), "{e}");
        assert!(e.contains("matrix.batch"), "{e}");
        let e = err(&GOOD.replace("budget: [0.5, 0.25]", "budget: [0.5, 1.5]"));
        assert!(e.starts_with("exp.yaml:11: `matrix.budget`: 1.5"), "{e}");
        let e = err(&GOOD.replace("repeats: 2", "repeats: 2\nrepeat: 3"));
        assert!(
            e.contains("unknown field `repeat`") && e.contains("repeats"),
            "{e}"
        );
        let e = err(&GOOD.replace("output_len: [8]", "output_len: [100000]"));
        assert!(
            e.contains("`matrix.prompt_len`") && e.contains("context"),
            "{e}"
        );
        let e = err(&GOOD.replace("stats: exact", "stats: maybe"));
        assert!(
            e.starts_with("exp.yaml:5: `engines[1]` (`h2o`)") && e.contains("stats=maybe"),
            "{e}"
        );
        let e = err(&GOOD.replace("attention: [flash, chunked]", "attention: [flash, paged]"));
        assert!(
            e.contains("`matrix.attention`") && e.contains("paged"),
            "{e}"
        );
        let e = err(&GOOD.replace("model: preset:tiny", "model: preset:nope"));
        assert!(e.contains("exp.yaml:2: `model`"), "{e}");
        let e = err(&GOOD.replace("name: t", "name: a/b"));
        assert!(e.contains("`name`"), "{e}");
        let e = err(&GOOD.replace("- name: full", "- name: lru"));
        assert!(e.contains("unknown engine `lru`"), "{e}");
        let e = err(&GOOD.replace(
            "chunk_size: [16, 32]",
            "chunk_size: [16, 32]\n  request_rate: [0]",
        ));
        assert!(e.contains("`matrix.request_rate`"), "{e}");
        let e = err(&GOOD.replace(
            "chunk_size: [16, 32]",
            "chunk_size: [16, 32]\n  request_rate: [inf, 2.5]",
        ));
        assert!(e.is_empty(), "{e}");
        assert!(parse_shard("3/3").is_err() && parse_shard("0/0").is_err());
        assert_eq!(parse_shard("2/5").unwrap(), (2, 5));
    }

    #[test]
    fn requests_per_cell_are_a_count_or_a_number_of_batches() {
        let w = |p: &Plan| p.exp.workload.clone().unwrap();
        let p = parse(GOOD).unwrap();
        assert_eq!((w(&p).requests(1), w(&p).requests(2)), (4, 4));
        let p = parse(&GOOD.replace("num_requests: 4", "batches: 3")).unwrap();
        assert_eq!((w(&p).requests(1), w(&p).requests(2)), (3, 6));
        // The cell key does not change with the workload: recorded cells stay valid.
        assert_eq!(parse(GOOD).unwrap().cells[0].key(), p.cells[0].key());
        let e = err(&GOOD.replace("num_requests: 4", "num_requests: 4\n  batches: 2"));
        assert!(e.contains("`workload.batches`: expected either"), "{e}");
        let e = err(&GOOD.replace("num_requests: 4", "batches: 0"));
        assert!(e.contains("`workload.batches`: expected at least 1"), "{e}");
        let e = err(&GOOD.replace("num_requests: 4", "source: null"));
        assert!(e.contains("`workload`: expected `num_requests`"), "{e}");
    }

    #[test]
    fn max_concurrency_is_checked_and_joins_the_key_only_when_finite() {
        let with = |v: &str| {
            GOOD.replace(
                "chunk_size: [16, 32]",
                &format!("chunk_size: [16, 32]\n  max_concurrency: {v}"),
            )
        };
        let e = err(&with("[0]"));
        assert!(
            e.starts_with("exp.yaml:14: `matrix.max_concurrency`: 0: expected an integer ≥ 1"),
            "{e}"
        );
        for bad in ["[2.5]", "[-1]", "[]"] {
            let e = err(&with(bad));
            assert!(e.contains("`matrix.max_concurrency`"), "{bad}: {e}");
        }
        // Without the axis, and with `inf`, cells are uncapped and their keys are the
        // keys recorded before the axis existed.
        let plain = parse(GOOD).unwrap();
        assert!(plain.cells.iter().all(|c| c.max_concurrency.is_none()));
        assert_eq!(
            plain.cells[0].key(),
            "engine=full;params=;batch=1;prompt=32;output=8;budget=1;attention=flash;chunk=-;rate=inf;burstiness=1;repeat=0"
        );
        let p = parse(&with("[inf, 2]")).unwrap();
        assert_eq!(p.cells.len(), 2 * plain.cells.len());
        assert_eq!(p.cells[0].key(), plain.cells[0].key());
        // The axis sits between burstiness and repeats: cell 2 is repeat 0 at cap 2.
        assert_eq!(p.cells[2].max_concurrency, Some(2));
        assert_eq!(
            p.cells[2].key(),
            plain.cells[0]
                .key()
                .replace(";repeat=0", ";max_concurrency=2;repeat=0")
        );
        let keys: std::collections::HashSet<String> = p.cells.iter().map(|c| c.key()).collect();
        assert_eq!(keys.len(), p.cells.len());
    }

    const ACC: &str = "\
name: a
kind: accuracy
model: preset:tiny
engines:
  - name: full
  - name: h2o
accuracy:
  tasks: [piqa, boolq]
  limit: 5
  budgets: [0.5, 0.1]
  modes: [decode, one_pass]
";

    #[test]
    fn accuracy_experiments_expand_per_engine_budget_mode_and_task() {
        let p = parse(ACC).unwrap();
        // full: 1 budget × 2 modes × 2 tasks = 4; h2o: 2 budgets × 4 = 8.
        assert_eq!(p.cells.len(), 12);
        let c = &p.cells[1];
        assert_eq!(
            (c.engine.as_str(), c.task.as_deref(), c.mode, c.limit),
            ("full", Some("boolq"), Some(ScoringMode::Decode), Some(5))
        );
        assert!(p
            .cells
            .iter()
            .all(|c| c.prompt_len.is_none() && c.output_len.is_none()));
        assert_eq!(
            c.key(),
            "kind=accuracy;engine=full;params=;budget=1;task=boolq;mode=decode;limit=5;batch=16;attention=flash;repeat=0"
        );
        let keys: std::collections::HashSet<String> = p.cells.iter().map(|c| c.key()).collect();
        assert_eq!(keys.len(), p.cells.len());
        // Flag beats the YAML key, which beats the default.
        let with = parse(&format!("{ACC}data_dir: /d\n")).unwrap();
        assert_eq!(with.data_dir(None), PathBuf::from("/d"));
        assert_eq!(with.data_dir(Some(Path::new("/f"))), PathBuf::from("/f"));
        // The default is data/ in the working directory (the environment variable
        // reaches it only through the flag, or when a test run sets it).
        if std::env::var_os("KVBENCH_DATASETS_DIR").is_none() {
            assert_eq!(p.data_dir(None), Path::new("./data"));
        }
    }

    #[test]
    fn accuracy_and_retention_sections_are_checked() {
        let e = err(&ACC.replace("[piqa, boolq]", "[piqa, mmlu]"));
        assert!(
            e.starts_with("exp.yaml:8: `accuracy.tasks`: unknown task `mmlu`"),
            "{e}"
        );
        let e = err(&ACC.replace("limit: 5", "limit: 0"));
        assert!(e.starts_with("exp.yaml:9: `accuracy.limit`"), "{e}");
        let e = err(&ACC.replace("[0.5, 0.1]", "[0.5, 2]"));
        assert!(e.starts_with("exp.yaml:10: `accuracy.budgets`: 2"), "{e}");
        let e = err(&ACC.replace("[decode, one_pass]", "[decode, greedy]"));
        assert!(e.contains("exp.yaml:11") && e.contains("greedy"), "{e}");
        let e = err(&ACC.replace("  limit: 5", "  limt: 5"));
        assert!(e.contains("unknown field `limt`"), "{e}");
        // Sections of another kind, and a missing one.
        let e = err(&format!("{ACC}workload:\n  num_requests: 1\n"));
        assert!(
            e.contains("`workload` belongs to `kind: performance`"),
            "{e}"
        );
        let e = err(&ACC.replace("kind: accuracy", "kind: retention"));
        assert!(e.contains("`accuracy` belongs to `kind: accuracy`"), "{e}");
        let e = err(&GOOD.replace("name: t", "name: t\nkind: accuracy"));
        assert!(e.contains("`matrix` belongs to `kind: performance`"), "{e}");
        let ret = "\
name: r
kind: retention
model: preset:tiny
engines:
  - name: full
  - name: h2o
retention:
  buckets: [1K-2K, 512-1K]
  facts: 4
  form: chat
  budgets: [0.3]
";
        let p = parse(ret).unwrap();
        assert_eq!(p.cells.len(), 4);
        assert_eq!(p.cells[0].bucket.as_deref(), Some("1K-2K"));
        assert_eq!(
            p.exp.retention.as_ref().unwrap().turns,
            vec![2, 4, 6, 8, 10, 12]
        );
        let e = err(&ret.replace("1K-2K", "2K-1K"));
        assert!(
            e.starts_with("exp.yaml:8: `retention.buckets`: `2K-1K`"),
            "{e}"
        );
        let e = err(&ret.replace("form: chat", "form: essay"));
        assert!(e.starts_with("exp.yaml:10: `retention.form`"), "{e}");
        // Each form's turns, checked before anything runs.
        let e = err(&ret.replace("form: chat", "form: passkey"));
        assert!(e.contains("`retention.turns`"), "{e}");
        assert!(e.contains("expected [1] for the passkey form"), "{e}");
        let passkey = ret.replace("form: chat", "form: passkey\n  turns: [1]");
        assert_eq!(parse(&passkey).unwrap().cells.len(), 4);
        let e = err(&ret.replace("form: chat", "form: chat\n  turns: [1, 2]"));
        assert!(e.contains("expected turns ≥ 2 for the chat form"), "{e}");
        let e = err(&ret.replace("facts: 4", "facts: 0"));
        assert!(e.starts_with("exp.yaml:9: `retention.facts`"), "{e}");
        assert_eq!(parse_bucket("1K-2K"), Ok((1024, 2048)));
        assert!(parse_bucket("2K").is_err());
    }

    /// Identities of a plan's cells by readable key.
    fn ids(text: &str) -> BTreeMap<String, String> {
        parse(text)
            .unwrap()
            .cells
            .iter()
            .map(|c| (c.key(), c.id.clone()))
            .collect()
    }

    #[test]
    fn a_cell_identity_covers_every_setting_that_changes_its_result() {
        let base = ids(GOOD);
        assert_eq!(base.len(), 72);
        let distinct: std::collections::HashSet<&String> = base.values().collect();
        assert_eq!(
            distinct.len(),
            72,
            "every cell (repeats too) has its own identity"
        );
        // Each edit leaves the readable keys alone and must change every identity.
        for edit in [
            GOOD.replace("model: preset:tiny", "model: preset:smollm2-135m"),
            GOOD.replace("name: t\n", "name: t\ndtype: f32\n"),
            GOOD.replace("name: t\n", "name: t\nseed: 7\n"),
            GOOD.replace("name: t\n", "name: t\ndevice:\n  memory: 2GiB\n"),
            GOOD.replace("name: t\n", "name: t\ndevice:\n  memory_fraction: 0.5\n"),
            GOOD.replace("name: t\n", "name: t\ndevice:\n  host_memory: 4GiB\n"),
            GOOD.replace("num_requests: 4", "num_requests: 5"),
            GOOD.replace("num_requests: 4", "num_requests: 4\n  source: Cargo.toml"),
            GOOD.replace("num_requests: 4", "batches: 4"),
            GOOD.replace("repeats: 2", "repeats: 2\nwarmup: 1"),
            GOOD.replace(
                "repeats: 2",
                "repeats: 2\nscheduler:\n  max_batched_tokens: 64",
            ),
            GOOD.replace(
                "repeats: 2",
                "repeats: 2\nscheduler:\n  prefill: sequential",
            ),
            GOOD.replace("repeats: 2", "repeats: 2\nscheduler:\n  block_size: 32"),
            GOOD.replace("repeats: 2", "repeats: 2\nscheduler:\n  max_model_len: 512"),
            GOOD.replace("repeats: 2", "repeats: 2\nslo:\n  ttft_ms: 500"),
            GOOD.replace("repeats: 2", "repeats: 2\nslo:\n  tpot_ms: 50"),
            GOOD.replace("repeats: 2", "repeats: 2\nslo:\n  e2e_ms: 2000"),
        ] {
            let after = ids(&edit);
            assert_eq!(after.len(), 72, "{edit}");
            for (key, id) in &base {
                assert_ne!(
                    after.get(key),
                    Some(id),
                    "{key} kept its identity after:\n{edit}"
                );
            }
        }
        // Repeats share their point, and only repeats do.
        let p = parse(GOOD).unwrap();
        let points: std::collections::HashSet<&str> =
            p.cells.iter().map(|c| c.point.as_str()).collect();
        assert_eq!(points.len(), 36);
        for c in &p.cells {
            let twin = p.cells.iter().filter(|d| d.point == c.point).count();
            assert_eq!(twin, 2, "{}", c.key());
            assert_ne!(c.point, c.id);
        }
        // The thread count is part of it.
        let c = &p.cells[0];
        assert_ne!(identity(&p.exp, c, 1), identity(&p.exp, c, 2));
        assert_eq!(identity(&p.exp, c, 3), identity(&p.exp, c, 3));
    }

    #[test]
    fn slo_keys_are_checked_with_the_file_line_and_key() {
        let with = |slo: &str| GOOD.replace("repeats: 2", &format!("repeats: 2\nslo:\n{slo}"));
        let p = parse(&with("  ttft_ms: 500\n  e2e_ms: 2500")).unwrap();
        let want = SloSpec {
            ttft_ms: Some(500.0),
            tpot_ms: None,
            e2e_ms: Some(2500.0),
        };
        assert!(p.cells.iter().all(|c| c.slo == Some(want)));
        assert_eq!(want.seconds().ttft_s, Some(0.5));
        assert_eq!(want.seconds().e2e_s, Some(2.5));
        assert_eq!(want.seconds().tpot_s, None);
        for (bad, line, key, value) in [
            ("  ttft_ms: -5", 18, "slo.ttft_ms", "-5"),
            ("  ttft_ms: 100\n  tpot_ms: 0", 19, "slo.tpot_ms", "0"),
            ("  e2e_ms: .inf", 18, "slo.e2e_ms", "inf"),
            ("  e2e_ms: .nan", 18, "slo.e2e_ms", "NaN"),
        ] {
            let e = err(&with(bad));
            assert!(
                e.starts_with(&format!(
                    "exp.yaml:{line}: `{key}`: {value}: expected a positive number of milliseconds"
                )),
                "{bad}: {e}"
            );
        }
        let e = err(&with("  {}"));
        assert!(
            e.starts_with("exp.yaml:17: `slo`: expected at least one of ttft_ms"),
            "{e}"
        );
        let e = err(&with("  ttft: 500"));
        assert!(
            e.contains("unknown field `ttft`") && e.contains("ttft_ms"),
            "{e}"
        );
        let e = err(&with("  ttft_ms: fast"));
        assert!(e.starts_with("exp.yaml:18"), "{e}");
        // Objectives are for performance experiments only.
        let e = err(&format!("{ACC}slo:\n  ttft_ms: 500\n"));
        assert!(e.contains("`slo` belongs to `kind: performance`"), "{e}");
    }

    #[test]
    fn slo_flags_parse_like_vllms_goodput_and_replace_the_yamls() {
        let s = SloSpec::parse("ttft:500,tpot:50,e2el:2000").unwrap();
        assert_eq!(
            (s.ttft_ms, s.tpot_ms, s.e2e_ms),
            (Some(500.0), Some(50.0), Some(2000.0))
        );
        // vLLM's space-separated form, `e2e` for `e2el`, any subset; the printed form
        // reads back exactly (the orchestrator hands it to each cell's process).
        let t = SloSpec::parse("tpot:12.5 e2e:900").unwrap();
        assert_eq!(
            (t.ttft_ms, t.tpot_ms, t.e2e_ms),
            (None, Some(12.5), Some(900.0))
        );
        assert_eq!(t.to_string(), "tpot:12.5,e2e:900");
        for x in [s, t] {
            assert_eq!(SloSpec::parse(&x.to_string()).unwrap(), x);
        }
        for (bad, says) in [
            ("ttft=500", "expected KEY:MS pairs"),
            ("ttft:abc", "`abc` is not a number"),
            ("itl:5", "unknown objective `itl`"),
            ("ttft:0", "0: expected a positive number"),
            ("ttft:-1", "-1: expected a positive number"),
            ("ttft:inf", "inf: expected a positive number"),
            ("ttft:NaN", "NaN: expected a positive number"),
            ("e2e:1,e2el:2", "`e2el` is given twice"),
            ("", "expected at least one of"),
        ] {
            let e = SloSpec::parse(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
        // The flag's objectives replace the YAML's, keep the readable keys and change
        // every identity; the same objectives as the YAML's give the YAML's identities.
        let yaml = parse(&GOOD.replace("repeats: 2", "repeats: 2\nslo:\n  ttft_ms: 500")).unwrap();
        let plain = parse(GOOD).unwrap();
        let flagged = plain
            .clone()
            .with_slo(SloSpec::parse("ttft:500").unwrap())
            .unwrap();
        let other = plain
            .clone()
            .with_slo(SloSpec::parse("tpot:50").unwrap())
            .unwrap();
        for ((p, f), (y, o)) in plain
            .cells
            .iter()
            .zip(&flagged.cells)
            .zip(yaml.cells.iter().zip(&other.cells))
        {
            assert_eq!(p.key(), f.key());
            assert_ne!(p.id, f.id);
            assert_ne!(p.point, f.point);
            assert_eq!((&f.id, &f.point), (&y.id, &y.point));
            assert_ne!(f.id, o.id);
            assert_eq!(o.slo.and_then(|s| s.ttft_ms), None, "replaced, not merged");
        }
        assert_eq!(flagged.exp.slo, yaml.exp.slo);
        // Without objectives a cell hashes as before SLOs existed: no `slo` field.
        let v = serde_json::to_value(&plain.cells[0]).unwrap();
        assert!(v.get("slo").is_none(), "{v}");
        assert!(serde_json::to_value(&flagged.cells[0]).unwrap()["slo"].is_object());
        let e = parse(ACC)
            .unwrap()
            .with_slo(SloSpec::parse("ttft:5").unwrap())
            .unwrap_err();
        assert!(format!("{e}").contains("performance"), "{e}");
    }

    #[test]
    fn inserting_an_engine_or_renaming_keeps_the_other_cells_identities() {
        let base = ids(GOOD);
        let more = ids(&GOOD.replace(
            "engines:\n",
            "engines:\n  - name: streaming\n    params: {sinks: 2}\n",
        ));
        assert!(more.len() > base.len());
        for (key, id) in &base {
            assert_eq!(more.get(key), Some(id), "{key}");
        }
        // Indices move, identities do not; the name and comments are not results.
        let renamed = ids(&format!(
            "# a comment\n{}",
            GOOD.replace("name: t", "name: u")
        ));
        assert_eq!(renamed, base);
        let p = parse(GOOD).unwrap();
        let mut c = p.cells[5].clone();
        c.index = 99;
        assert_eq!(identity(&p.exp, &c, 1), identity(&p.exp, &p.cells[5], 1));
    }

    #[test]
    fn a_retention_cell_identity_covers_form_facts_and_turns() {
        let ret = "\
name: r
kind: retention
model: preset:tiny
engines:
  - name: full
retention:
  buckets: [512-1K]
  facts: 4
  form: chat
";
        let base = ids(ret);
        for edit in [
            ret.replace("facts: 4", "facts: 2"),
            ret.replace("form: chat", "form: chat\n  turns: [2, 4]"),
            ret.replace(
                "facts: 4\n  form: chat",
                "facts: 1\n  form: passkey\n  turns: [1]",
            ),
        ] {
            let after = ids(&edit);
            assert_eq!(after.len(), 1);
            assert_ne!(after.values().next(), base.values().next(), "{edit}");
        }
    }

    #[test]
    fn a_name_that_would_leave_the_results_directory_is_rejected() {
        for bad in [".", "..", "...", "a/b", "../x", "a\\\\b", ""] {
            let e = err(&GOOD.replace("name: t", &format!("name: \"{bad}\"")));
            assert!(e.contains("exp.yaml:1: `name`"), "{bad}: {e}");
            assert!(e.contains("not only dots"), "{bad}: {e}");
        }
        assert_eq!(err(&GOOD.replace("name: t", "name: v1.2_x-y")), "");
    }
}
