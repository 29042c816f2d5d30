//! The types of an experiment file, as serde reads them, with their defaults.

use kvbench_datasets::prompts::LengthDist;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

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
    /// New tokens each warm-up request generates (default: the cell's output length).
    /// A warm-up is there to pay the one-time costs (kernel loading, allocation, the
    /// first graphs) before the clock starts; a few tokens do that without a long
    /// decode that nothing measures (docs/experiments.md has what it cost on the H100).
    pub warmup_tokens: Option<usize>,
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
    /// (`e2el` is taken for `e2e`), separated by commas or spaces. `=` may stand for
    /// `:`, and a value may carry its unit: `ttft=2s,tpot=100ms`.
    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        let usage = "expected KEY:MS pairs such as ttft:500,tpot:50,e2e:2000 or \
                     ttft=2s,tpot=100ms (keys ttft, tpot, e2e or e2el; a bare number is \
                     milliseconds; > 0)";
        let mut slo = SloSpec::default();
        for pair in s.split([',', ' ']).filter(|p| !p.trim().is_empty()) {
            let (k, v) = pair
                .split_once([':', '='])
                .ok_or_else(|| format!("`{pair}`: {usage}"))?;
            let v = v.trim();
            let (num, scale) = if let Some(x) = v.strip_suffix("ms") {
                (x, 1.0)
            } else if let Some(x) = v.strip_suffix('s') {
                (x, 1000.0)
            } else {
                (v, 1.0)
            };
            let v: f64 = num
                .trim()
                .parse::<f64>()
                .map(|x| x * scale)
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
    /// A registered strategy (`full`, `h2o`, ...).
    pub name: String,
    /// Strategy parameters, as `--set KEY=VALUE`; a key given twice is an error.
    #[serde(default, deserialize_with = "unique_keys")]
    pub params: BTreeMap<String, serde_yaml::Value>,
}

/// A map whose keys are each given once (a plain map keeps the last of two silently).
fn unique_keys<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<BTreeMap<String, serde_yaml::Value>, D::Error> {
    struct Unique;
    impl<'de> serde::de::Visitor<'de> for Unique {
        type Value = BTreeMap<String, serde_yaml::Value>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a map of parameter names to values")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut m: A,
        ) -> std::result::Result<Self::Value, A::Error> {
            let mut out = BTreeMap::new();
            while let Some((k, v)) = m.next_entry::<String, serde_yaml::Value>()? {
                if out.contains_key(&k) {
                    return Err(serde::de::Error::custom(format!(
                        "parameter `{k}` given twice"
                    )));
                }
                out.insert(k, v);
            }
            Ok(out)
        }
    }
    d.deserialize_map(Unique)
}

/// A prompt-length axis value: a length, `{uniform: [min, max]}` or `{list: [...]}`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(untagged, try_from = "serde_yaml::Value")]
pub enum PromptLen {
    Fixed(usize),
    Uniform { uniform: [usize; 2] },
    List { list: Vec<usize> },
}

/// Read by hand so that a value of none of the three forms is named with them (an
/// untagged enum's error names only the Rust type).
impl TryFrom<serde_yaml::Value> for PromptLen {
    type Error = String;
    fn try_from(v: serde_yaml::Value) -> std::result::Result<Self, String> {
        let lengths = |x: &serde_yaml::Value| -> Option<Vec<usize>> {
            x.as_sequence()?
                .iter()
                .map(|n| n.as_u64().map(|n| n as usize))
                .collect()
        };
        let form = match &v {
            serde_yaml::Value::Number(n) => n.as_u64().map(|n| PromptLen::Fixed(n as usize)),
            serde_yaml::Value::Mapping(m) if m.len() == 1 => {
                if let Some(u) = m.get("uniform") {
                    match lengths(u).as_deref() {
                        Some(&[a, b]) => Some(PromptLen::Uniform { uniform: [a, b] }),
                        _ => None,
                    }
                } else {
                    m.get("list")
                        .and_then(lengths)
                        .map(|list| PromptLen::List { list })
                }
            }
            _ => None,
        };
        form.ok_or_else(|| {
            format!(
                "`{}`: expected a length in tokens, {{uniform: [min, max]}} or {{list: [a, b, ...]}}",
                serde_json::to_string(&v).unwrap_or_default()
            )
        })
    }
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
    /// Turns at which recall is asked, as the YAML gives them.
    #[serde(default, rename = "turns")]
    pub turns_given: Option<Vec<usize>>,
    /// The turns run: those given, else the form's default (`chat` 2, 4, …, 12;
    /// `passkey` 1, the one message that holds the key and the question).
    #[serde(skip)]
    pub turns: Vec<usize>,
    /// Distinct facts cycled over the conversations (the chat form's; the passkey form
    /// plants one key and needs none).
    #[serde(default)]
    pub facts: Option<usize>,
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
impl RetentionSpec {
    /// Fill [`RetentionSpec::turns`] from the YAML or the form's default.
    pub fn settle(&mut self) {
        self.turns = self
            .turns_given
            .clone()
            .unwrap_or_else(|| match self.form.as_str() {
                "passkey" => vec![1],
                _ => vec![2, 4, 6, 8, 10, 12],
            });
    }
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
