//! `kvbench run-cell`: one cell of an experiment in this process: its workload (prompts
//! of exact token length, arrival times), one engine, the measured requests after the
//! warm-up ones, and one JSON object on stdout with the outcome (`ok`, `oom`, `error`)
//! and the metrics. The orchestrator runs each cell in its own process so that an
//! out-of-memory error, a panic or a device fault ends the cell, not the sweep.
//!
//! With `KVBENCH_PROGRESS=1` in its environment (the orchestrator sets it) the cell
//! also reports its progress on stderr, at most every 100 ms, as lines
//! `kvbench-progress tokens=N total=M`: N tokens the engine has computed (prefill and
//! decode) of the M its requests need (Σ prompt + output − 1, warm-up included).

use crate::experiment::{Cell, Kind, Plan, SloSpec};
use crate::metrics::{compute, CellMetrics};
use crate::setup::{
    device_capacity, host_memory_bytes, load_model, seeded_ids, skewing, DtypeArg, ModelArgs, Setup,
};
use anyhow::{bail, Context, Result};
use clap::Args;
use kvbench_datasets::arrivals::{Arrivals, ConcurrencyGate};
use kvbench_datasets::corpus::Corpus;
use kvbench_datasets::prompts::slice_prompts;
use kvbench_datasets::Tokenize;
use kvbench_engines::device::parse_bytes;
use kvbench_engines::engine::{Engine, EngineConfig, Request, StepOutcome};
use kvbench_engines::ledger::MemoryReport;
use kvbench_engines::policy::spec::{split_reservation, PolicySpec};
use kvbench_engines::scheduler::{PrefillMode, SchedulerConfig};
use kvbench_engines::tokenizer::TextTokenizer;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The environment variable that makes `run-cell` report its progress on stderr.
pub const PROGRESS_ENV: &str = "KVBENCH_PROGRESS";
/// What a progress line starts with.
const PROGRESS_PREFIX: &str = "kvbench-progress ";
/// Least time between two progress lines.
const PROGRESS_EVERY: Duration = Duration::from_millis(100);

/// One progress line (without the newline).
pub fn progress_line(tokens: u64, total: u64) -> String {
    format!("{PROGRESS_PREFIX}tokens={tokens} total={total}")
}

/// (tokens, total) of a progress line; `None` for any other line.
pub fn parse_progress(line: &str) -> Option<(u64, u64)> {
    let rest = line.trim_end().strip_prefix(PROGRESS_PREFIX)?;
    let (mut tokens, mut total) = (None, None);
    for field in rest.split_whitespace() {
        match field.split_once('=')? {
            ("tokens", v) => tokens = Some(v.parse().ok()?),
            ("total", v) => total = Some(v.parse().ok()?),
            _ => return None,
        }
    }
    Some((tokens?, total?))
}

/// The cell's token progress, reported on stderr when asked (`KVBENCH_PROGRESS=1`).
pub(crate) struct Progress {
    enabled: bool,
    tokens: u64,
    total: u64,
    last: Option<Instant>,
}

impl Progress {
    pub(crate) fn new(total: u64) -> Self {
        let enabled = std::env::var(PROGRESS_ENV).is_ok_and(|v| v == "1");
        let mut p = Self {
            enabled,
            tokens: 0,
            total,
            last: None,
        };
        p.emit(true);
        p
    }

    fn emit(&mut self, force: bool) {
        if !self.enabled || !(force || self.last.is_none_or(|t| t.elapsed() >= PROGRESS_EVERY)) {
            return;
        }
        self.last = Some(Instant::now());
        use std::io::Write;
        // A progress line that cannot be written is not worth failing the cell for.
        let _ = writeln!(
            std::io::stderr().lock(),
            "{}",
            progress_line(self.tokens, self.total)
        );
    }

    /// Tokens computed by a step (recomputation after a preemption counts too, so the
    /// count is capped at the total).
    pub(crate) fn step(&mut self, tokens: usize) {
        self.tokens = (self.tokens + tokens as u64).min(self.total);
        self.emit(false);
    }

    pub(crate) fn finish(&mut self) {
        self.emit(true);
    }
}

#[derive(Debug, Args)]
pub struct RunCellArgs {
    /// Experiment file (YAML).
    pub experiment: PathBuf,

    /// Index of the cell (as `kvbench run EXP --dry-run` lists them).
    #[arg(long)]
    pub cell: usize,

    /// The identity of the cell to run (the orchestrator passes it; `--cell` then only
    /// names it in messages): when the YAML no longer has a cell of this identity, the
    /// run is refused with exit status 3 instead of running something else.
    #[arg(long)]
    pub id: Option<String>,

    /// Directory of fetched weights.
    #[arg(long, env = "KVBENCH_MODELS_DIR", default_value = "models")]
    pub models_dir: PathBuf,

    /// Evaluation data directory (accuracy and retention cells); default: the
    /// experiment's `data_dir`, else data/ (filled by `just fetch-data`).
    #[arg(long, env = "KVBENCH_DATASETS_DIR")]
    pub data_dir: Option<PathBuf>,

    /// Service-level objectives in place of the YAML's, as `kvbench run --slo`.
    #[arg(long, value_name = "ttft:MS,tpot:MS,e2e:MS", value_parser = SloSpec::parse)]
    pub slo: Option<SloSpec>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    Ok,
    Oom,
    Error,
}

#[derive(Debug, Serialize)]
pub struct CellResult {
    /// The cell's identity ([`crate::experiment::identity`]).
    pub id: String,
    pub key: String,
    pub cell: Cell,
    pub outcome: Outcome,
    pub error: Option<String>,
    pub metrics: Option<CellMetrics>,
    pub memory: Option<MemoryReport>,
    /// Bytes moved over the measured requests.
    pub h2d_bytes: Option<u64>,
    pub d2h_bytes: Option<u64>,
    /// Keys attended by decode rows over what full attention would read.
    pub attended_fraction: Option<f64>,
    /// Seconds the cell took, set-up included.
    pub wall_s: f64,
    /// Where it ran.
    pub env: crate::environment::Environment,
    /// Most resident memory of this process and most GPU memory in use (NVML) while
    /// the engine ran; null when not measured.
    pub process_rss_peak_bytes: Option<u64>,
    pub gpu_used_peak_bytes: Option<u64>,
    /// The memory time series (every 100 ms).
    pub samples: Vec<crate::sampler::Sample>,
    /// Per measured request and per engine step, for the requests and steps tables.
    pub requests: Vec<kvbench_engines::trace::RequestOutput>,
    pub steps: Vec<kvbench_engines::trace::StepTrace>,
}

struct Tok<'a>(&'a TextTokenizer);

impl Tokenize for Tok<'_> {
    fn encode(&self, text: &str) -> std::result::Result<Vec<u32>, String> {
        self.0.encode(text).map_err(|e| e.to_string())
    }
}

/// Token stream of a corpus: one UTF-8 file, or every `.txt` file of a directory in
/// name order.
fn corpus_tokens(src: &Path, tok: &TextTokenizer) -> Result<Vec<u32>> {
    let files: Vec<PathBuf> = if src.is_dir() {
        let mut f: Vec<PathBuf> = std::fs::read_dir(src)
            .with_context(|| format!("reading workload directory {}", src.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "txt"))
            .collect();
        f.sort();
        if f.is_empty() {
            bail!(
                "workload source {}: no .txt files in the directory",
                src.display()
            );
        }
        f
    } else {
        vec![src.to_path_buf()]
    };
    let mut tokens = Vec::new();
    for f in files {
        let c = Corpus::from_file(&f)?;
        tokens.extend(c.tokenize(&Tok(tok))?);
    }
    Ok(tokens)
}

/// The cell's requests: `warmup` + the measured requests' prompts and scheduled arrival times,
/// the same for every engine and repeat of a matrix point (seeded by the experiment's
/// seed). Under a concurrency cap a measured request's arrival is when it is sent
/// ([`drive`]).
fn workload(plan: &Plan, cell: &Cell, setup: &Setup) -> Result<Vec<Request>> {
    let e = &plan.exp;
    let w = e
        .workload
        .as_ref()
        .context("a performance cell needs the experiment's `workload`")?;
    let (Some(prompt_len), Some(output_len)) = (&cell.prompt_len, cell.output_len) else {
        bail!(
            "cell {}: a performance cell needs a prompt and an output length",
            cell.index
        );
    };
    let measured = w.requests(cell.batch);
    let n = e.warmup + measured;
    let lengths = prompt_len.dist().sample(n, e.seed)?;
    let vocab = setup.loaded.model.cfg.vocab_size;
    let prompts = match &w.source {
        Some(src) => {
            let tokens = corpus_tokens(src, &setup.loaded.tokenizer)?;
            slice_prompts(&tokens, &lengths, e.seed)?
        }
        None => {
            let mut s = e.seed ^ 0x9e37_79b9_7f4a_7c15;
            lengths
                .iter()
                .map(|&l| seeded_ids(l, vocab, &mut s))
                .collect()
        }
    };
    let arrivals = if cell.request_rate.is_finite() {
        Arrivals::Poisson {
            rate: cell.request_rate,
            burstiness: cell.burstiness,
        }
    } else {
        Arrivals::AllAtZero
    };
    // Warm-up requests arrive at 0; the measured ones follow their process.
    let times = arrivals.times(measured, e.seed)?;
    Ok(prompts
        .into_iter()
        .enumerate()
        .map(|(i, p)| Request {
            arrival_s: if i < e.warmup {
                0.0
            } else {
                times[i - e.warmup]
            },
            ..Request::greedy(p, output_len)
        })
        .collect())
}

fn engine(plan: &Plan, cell: &Cell, setup: &Setup, models_dir: &Path) -> Result<Engine> {
    policy_engine(plan, cell, setup, models_dir, None)
}

/// The cell's engine; InfiniGen's skewing is calibrated on `calibration` text when
/// given (else seeded random tokens).
pub(crate) fn policy_engine(
    plan: &Plan,
    cell: &Cell,
    setup: &Setup,
    models_dir: &Path,
    calibration: Option<&Path>,
) -> Result<Engine> {
    let e = &plan.exp;
    let pairs: Vec<(String, String)> = cell
        .params
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let mut policy = PolicySpec::parse(&cell.engine, cell.budget, &pairs)?;
    if let PolicySpec::Infinigen(p) = &mut policy {
        p.skewing = Some(skewing(setup, calibration, models_dir)?);
    }
    let explicit = match &e.device.memory {
        Some(m) => Some(parse_bytes(m).map_err(anyhow::Error::msg)?),
        None => None,
    };
    let (capacity, available) = device_capacity(setup, explicit, e.device.memory_fraction)?;
    let host = match &e.device.host_memory {
        Some(m) => parse_bytes(m).map_err(anyhow::Error::msg)?,
        None => host_memory_bytes(),
    };
    let cfg = EngineConfig {
        device_name: setup.device.to_string(),
        device_memory: Some(capacity),
        device_available: available,
        memory_fraction: e.device.memory_fraction,
        block_size: e.scheduler.block_size,
        max_model_len: Some(plan.context),
        scheduler: SchedulerConfig {
            max_num_seqs: cell.batch,
            max_batched_tokens: e.scheduler.max_batched_tokens,
            prefill: if e.scheduler.prefill == "sequential" {
                PrefillMode::Sequential
            } else {
                PrefillMode::Chunked
            },
        },
        policy,
        attention: cell.attention.parse().map_err(anyhow::Error::msg)?,
        chunk_size: cell.chunk_size.unwrap_or(512),
        host_memory: Some(host),
        reservation: split_reservation(&pairs)?.0,
        ..Default::default()
    };
    Ok(Engine::new(setup.loaded.model.clone(), cfg)?)
}

/// Hand `reqs` to the engine and step it until all have finished, reporting each
/// step's tokens to `progress`. With a cap, at most `cap` requests are in flight: a
/// request due while the cap is full is sent when one finishes, and its arrival is the
/// finish time that freed its slot (the engine's own finish time, so that TTFT and E2E
/// run from the moment vLLM's client would send it). Without a cap every request goes
/// to the engine at once with its scheduled arrival, and the engine waits for it.
fn drive(
    eng: &mut Engine,
    reqs: &[Request],
    cap: Option<usize>,
    progress: &mut Progress,
) -> Result<()> {
    let mut gate = ConcurrencyGate::new(reqs.iter().map(|r| r.arrival_s).collect(), cap)?;
    let mut seen = eng.finished().len();
    let sleep_until = |eng: &Engine, t: f64| {
        let wait = t - eng.now();
        if wait > 0.0 {
            std::thread::sleep(Duration::from_secs_f64(wait));
        }
    };
    loop {
        for out in &eng.finished()[seen..] {
            gate.release(out.finished_s);
        }
        seen = eng.finished().len();
        for (i, arrival_s) in gate.ready(eng.now()) {
            eng.add_request(Request {
                arrival_s,
                ..reqs[i].clone()
            })?;
        }
        match eng.step()? {
            StepOutcome::Ran(t) => progress.step(t.num_tokens),
            StepOutcome::Idle { until_s } => {
                sleep_until(eng, until_s.min(gate.next_send().unwrap_or(f64::INFINITY)))
            }
            StepOutcome::Done => match gate.next_send() {
                Some(t) => sleep_until(eng, t),
                None if gate.all_sent() => return Ok(()),
                None => bail!(
                    "max concurrency: {} request(s) in flight but none in the engine, {} of {} sent",
                    gate.in_flight(),
                    gate.sent(),
                    reqs.len()
                ),
            },
        }
    }
}

/// Run one cell; errors of the run itself become the `oom` or `error` outcome.
/// On a GPU, the driver compiles each kernel module the first time a process on that
/// machine loads it (seconds to tens of seconds on a fresh machine): one small forward
/// and the kvbench kernels' module load here, before anything is timed.
#[cfg(feature = "cuda")]
fn warm_up_device(setup: &crate::setup::Setup) -> Result<()> {
    let model = &setup.loaded.model;
    if model.device().is_cuda() {
        let ids: Vec<u32> = (0..16u32).collect();
        model.forward_dense(&ids).context("warming up the device")?;
        kvbench_engines::cuda::load_kernels(model.device())?;
        model.device().synchronize()?;
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn warm_up_device(_setup: &crate::setup::Setup) -> Result<()> {
    Ok(())
}

/// The experiment's model on its device, warmed up.
pub(crate) fn load_setup(plan: &Plan, models_dir: &Path) -> Result<Setup> {
    let e = &plan.exp;
    let dtype = match e.dtype.as_str() {
        "quantized" => DtypeArg::Quantized,
        "f32" => DtypeArg::F32,
        "f16" => DtypeArg::F16,
        "bf16" => DtypeArg::Bf16,
        _ => DtypeArg::Auto,
    };
    let margs = ModelArgs {
        model: e.model.clone(),
        dtype,
        seed: e.seed,
        models_dir: models_dir.to_path_buf(),
    };
    let setup = load_model(&margs, &e.device.name)?;
    warm_up_device(&setup)?;
    Ok(setup)
}

pub fn run_cell(plan: &Plan, cell: &Cell, models_dir: &Path) -> Result<CellResult> {
    let t0 = Instant::now();
    let e = &plan.exp;
    let setup = load_setup(plan, models_dir)?;
    let requests = workload(plan, cell, &setup)?;
    let mut progress = Progress::new(
        requests
            .iter()
            .map(|r| (r.prompt.len() + r.max_new_tokens - 1) as u64)
            .sum(),
    );
    let gpu = setup.gpu_index();
    let mut result = CellResult {
        env: crate::environment::Environment::collect(&setup.device.to_string(), gpu),
        id: cell.id.clone(),
        key: cell.key(),
        cell: cell.clone(),
        outcome: Outcome::Ok,
        error: None,
        metrics: None,
        memory: None,
        h2d_bytes: None,
        d2h_bytes: None,
        attended_fraction: None,
        wall_s: 0.0,
        process_rss_peak_bytes: None,
        gpu_used_peak_bytes: None,
        samples: Vec::new(),
        requests: Vec::new(),
        steps: Vec::new(),
    };
    let sampler = crate::sampler::Sampler::start(std::time::Duration::from_millis(100), gpu);
    let mut run = || -> Result<(Engine, usize, usize)> {
        let mut eng = engine(plan, cell, &setup, models_dir)?;
        // At most `batch` requests are held at once: room for the longest ones is
        // allocated before anything is timed.
        let mut lengths: Vec<usize> = requests
            .iter()
            .map(|r| r.prompt.len() + r.max_new_tokens)
            .collect();
        lengths.sort_unstable_by(|a, b| b.cmp(a));
        eng.prepare(&lengths[..cell.batch.min(lengths.len())])?;
        let (warm, measured) = requests.split_at(e.warmup);
        // Warm-up requests all go at once, whatever the cap.
        drive(&mut eng, warm, None, &mut progress)?;
        let (skip_out, skip_steps) = (eng.finished().len(), eng.traces().len());
        eng.reset_clock();
        drive(&mut eng, measured, cell.max_concurrency, &mut progress)?;
        Ok((eng, skip_out, skip_steps))
    };
    let outcome = run();
    progress.finish();
    let samples = sampler.finish();
    result.process_rss_peak_bytes = samples.iter().filter_map(|x| x.process_rss_bytes).max();
    result.gpu_used_peak_bytes = samples.iter().filter_map(|x| x.gpu_used_bytes).max();
    result.samples = samples;
    match outcome {
        Ok((eng, skip_out, skip_steps)) => {
            let outs = &eng.finished()[skip_out..];
            let steps = &eng.traces()[skip_steps..];
            // The clock was reset at the benchmark's start: 0 on it.
            let slo = cell.slo.map(|s| s.seconds()).unwrap_or_default();
            result.metrics = Some(compute(outs, steps, slo, 0.0));
            result.memory = Some(eng.memory());
            result.h2d_bytes = Some(steps.iter().map(|t| t.h2d_bytes).sum());
            result.d2h_bytes = Some(steps.iter().map(|t| t.d2h_bytes).sum());
            let att: u64 = steps.iter().filter_map(|t| t.attended_tokens).sum();
            let ctx: u64 = steps.iter().filter_map(|t| t.context_tokens).sum();
            result.attended_fraction = (ctx > 0).then(|| att as f64 / ctx as f64);
            result.requests = outs.to_vec();
            result.steps = steps.to_vec();
        }
        Err(err) => {
            result.outcome = if is_oom(&err) {
                Outcome::Oom
            } else {
                Outcome::Error
            };
            result.error = Some(format!("{err:#}"));
        }
    }
    result.wall_s = t0.elapsed().as_secs_f64();
    Ok(result)
}

pub fn run(a: RunCellArgs) -> Result<()> {
    let plan = Plan::load_with(&a.experiment, &a.models_dir, a.slo)?;
    let cell = match a.id.as_deref() {
        // By identity: the index only says where it was when the sweep started.
        Some(id) => match plan.cells.iter().find(|c| c.id == id) {
            Some(c) => c,
            None => {
                eprintln!(
                    "{}: no cell has the identity {id} the sweep asked for (cell {}): the \
                     experiment changed while the sweep ran",
                    a.experiment.display(),
                    a.cell
                );
                std::process::exit(crate::run::EXIT_STALE_CELL);
            }
        },
        None => plan.cells.get(a.cell).with_context(|| {
            format!(
                "--cell {}: {} has cells 0..{}",
                a.cell,
                a.experiment.display(),
                plan.cells.len()
            )
        })?,
    };
    let r = match plan.exp.kind {
        Kind::Performance => serde_json::to_value(run_cell(&plan, cell, &a.models_dir)?)?,
        Kind::Accuracy => {
            let data = plan.data_dir(a.data_dir.as_deref());
            crate::accuracy::run_cell(&plan, cell, &a.models_dir, &data)?
        }
        Kind::Retention => {
            let data = plan.data_dir(a.data_dir.as_deref());
            crate::retention::run_cell(&plan, cell, &a.models_dir, &data)?
        }
    };
    println!("{}", serde_json::to_string(&r)?);
    Ok(())
}

/// Whether a cell failed by running out of (device or host) memory: recorded as `oom`,
/// a result, rather than `error`.
pub fn is_oom(err: &anyhow::Error) -> bool {
    err.downcast_ref::<kvbench_engines::Error>()
        .is_some_and(|x| x.is_oom())
}

/// A failed accuracy or retention cell's outcome and error in its JSON record.
pub fn record_failure(v: &mut serde_json::Value, err: &anyhow::Error) {
    v["outcome"] = if is_oom(err) { "oom" } else { "error" }.into();
    v["error"] = format!("{err:#}").into();
}

/// The JSON record an accuracy or retention cell starts from: key, cell, environment
/// and sampled memory peaks, outcome `ok` until the caller records a failure.
pub fn scored_cell_record(
    cell: &crate::experiment::Cell,
    setup: &crate::setup::Setup,
    gpu: Option<u32>,
    samples: &[crate::sampler::Sample],
) -> serde_json::Value {
    serde_json::json!({
        "id": cell.id,
        "key": cell.key(),
        "cell": cell,
        "outcome": "ok",
        "error": null,
        "metrics": null,
        "memory": null,
        "accuracy": null,
        "env": crate::environment::Environment::collect(&setup.device.to_string(), gpu),
        "process_rss_peak_bytes": samples.iter().filter_map(|x| x.process_rss_bytes).max(),
        "gpu_used_peak_bytes": samples.iter().filter_map(|x| x.gpu_used_bytes).max(),
        "accuracy_rows": [],
    })
}
