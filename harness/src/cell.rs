//! `kvbench run-cell`: one cell of an experiment in this process: its workload (prompts
//! of exact token length, arrival times), one engine, the measured requests after the
//! warm-up ones, and one JSON object on stdout with the outcome (`ok`, `oom`, `error`)
//! and the metrics. The orchestrator runs each cell in its own process so that an
//! out-of-memory error, a panic or a device fault ends the cell, not the sweep.

use crate::experiment::{Cell, Plan};
use crate::metrics::{compute, CellMetrics, Slo};
use crate::setup::{
    host_memory_bytes, load_model, seeded_ids, skewing, DtypeArg, ModelArgs, Setup,
};
use anyhow::{bail, Context, Result};
use clap::Args;
use kvbench_datasets::arrivals::Arrivals;
use kvbench_datasets::corpus::Corpus;
use kvbench_datasets::prompts::slice_prompts;
use kvbench_datasets::Tokenize;
use kvbench_engines::device::{parse_bytes, DeviceKind};
use kvbench_engines::engine::{Engine, EngineConfig, Request};
use kvbench_engines::ledger::MemoryReport;
use kvbench_engines::policy::spec::PolicySpec;
use kvbench_engines::scheduler::{PrefillMode, SchedulerConfig};
use kvbench_engines::tokenizer::TextTokenizer;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Debug, Args)]
pub struct RunCellArgs {
    /// Experiment file (YAML).
    pub experiment: PathBuf,

    /// Index of the cell (as `kvbench run EXP --dry-run` lists them).
    #[arg(long)]
    pub cell: usize,

    /// Directory of fetched weights.
    #[arg(long, env = "KVBENCH_MODELS_DIR", default_value = "models")]
    pub models_dir: PathBuf,
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

/// The cell's requests: `warmup + num_requests` prompts and arrival times, the same
/// for every engine and repeat of a matrix point (seeded by the experiment's seed).
fn workload(plan: &Plan, cell: &Cell, setup: &Setup) -> Result<Vec<Request>> {
    let e = &plan.exp;
    let n = e.warmup + e.workload.num_requests;
    let lengths = cell.prompt_len.dist().sample(n, e.seed)?;
    let vocab = setup.loaded.model.cfg.vocab_size;
    let prompts = match &e.workload.source {
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
    let times = arrivals.times(e.workload.num_requests, e.seed)?;
    Ok(prompts
        .into_iter()
        .enumerate()
        .map(|(i, p)| Request {
            arrival_s: if i < e.warmup {
                0.0
            } else {
                times[i - e.warmup]
            },
            ..Request::greedy(p, cell.output_len)
        })
        .collect())
}

fn engine(plan: &Plan, cell: &Cell, setup: &Setup, models_dir: &Path) -> Result<Engine> {
    let e = &plan.exp;
    let pairs: Vec<(String, String)> = cell
        .params
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let mut policy = PolicySpec::parse(&cell.engine, cell.budget, &pairs)?;
    if let PolicySpec::Infinigen(p) = &mut policy {
        p.skewing = Some(skewing(setup, None, models_dir)?);
    }
    let capacity = match (&e.device.memory, setup.device) {
        (Some(m), _) => parse_bytes(m).map_err(anyhow::Error::msg)?,
        (None, DeviceKind::Cpu) => host_memory_bytes(),
        (None, DeviceKind::Cuda(_)) => bail!("device.memory is required on CUDA for now"),
    };
    let host = match &e.device.host_memory {
        Some(m) => parse_bytes(m).map_err(anyhow::Error::msg)?,
        None => host_memory_bytes(),
    };
    let cfg = EngineConfig {
        device_name: setup.device.to_string(),
        device_memory: Some(capacity),
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
        ..Default::default()
    };
    Ok(Engine::new(setup.loaded.model.clone(), cfg)?)
}

/// Run one cell; errors of the run itself become the `oom` or `error` outcome.
pub fn run_cell(plan: &Plan, cell: &Cell, models_dir: &Path) -> Result<CellResult> {
    let t0 = Instant::now();
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
    let requests = workload(plan, cell, &setup)?;
    let gpu = match setup.device {
        DeviceKind::Cuda(i) => Some(i as u32),
        DeviceKind::Cpu => None,
    };
    let mut result = CellResult {
        env: crate::environment::Environment::collect(&setup.device.to_string(), gpu),
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
    let run = || -> Result<(Engine, usize, usize)> {
        let mut eng = engine(plan, cell, &setup, models_dir)?;
        let (warm, measured) = requests.split_at(e.warmup);
        for r in warm {
            eng.add_request(r.clone())?;
        }
        eng.run()?;
        let (skip_out, skip_steps) = (eng.finished().len(), eng.traces().len());
        eng.reset_clock();
        for r in measured {
            eng.add_request(r.clone())?;
        }
        eng.run()?;
        Ok((eng, skip_out, skip_steps))
    };
    let outcome = run();
    let samples = sampler.finish();
    result.process_rss_peak_bytes = samples.iter().filter_map(|x| x.process_rss_bytes).max();
    result.gpu_used_peak_bytes = samples.iter().filter_map(|x| x.gpu_used_bytes).max();
    result.samples = samples;
    match outcome {
        Ok((eng, skip_out, skip_steps)) => {
            let outs = &eng.finished()[skip_out..];
            let steps = &eng.traces()[skip_steps..];
            result.metrics = Some(compute(outs, steps, Slo::default()));
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
            let oom = err
                .downcast_ref::<kvbench_engines::Error>()
                .is_some_and(|x| x.is_oom());
            result.outcome = if oom { Outcome::Oom } else { Outcome::Error };
            result.error = Some(format!("{err:#}"));
        }
    }
    result.wall_s = t0.elapsed().as_secs_f64();
    Ok(result)
}

pub fn run(a: RunCellArgs) -> Result<()> {
    let plan = Plan::load(&a.experiment, &a.models_dir)?;
    let cell = plan.cells.get(a.cell).with_context(|| {
        format!(
            "--cell {}: {} has cells 0..{}",
            a.cell,
            a.experiment.display(),
            plan.cells.len()
        )
    })?;
    let r = run_cell(&plan, cell, &a.models_dir)?;
    println!("{}", serde_json::to_string(&r)?);
    Ok(())
}
