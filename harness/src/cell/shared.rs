//! What every kind of cell shares: the experiment's model on its device, the cell's
//! engine, progress lines on stderr, and the JSON record of an accuracy or retention
//! cell with its failure.

use crate::experiment::{Cell, Plan};
use crate::setup::{
    device_capacity, host_memory_bytes, load_model, skewing, DtypeArg, ModelArgs, Setup,
};
#[cfg(feature = "cuda")]
use anyhow::Context;
use anyhow::Result;
use kvbench_engines::device::parse_bytes;
use kvbench_engines::engine::{Engine, EngineConfig};
use kvbench_engines::policy::spec::{split_engine_options, PolicySpec};
use kvbench_engines::scheduler::{PrefillMode, SchedulerConfig};
use std::path::Path;
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
    if policy.needs_skewing() {
        policy.set_skewing(skewing(setup, calibration, models_dir)?);
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
    let (opts, _) = split_engine_options(&pairs)?;
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
        reservation: opts.reservation,
        kv_codec: opts.kv_codec,
        ..Default::default()
    };
    Ok(Engine::new(setup.loaded.model.clone(), cfg)?)
}

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
