//! Model and engine options shared by the commands that run an engine.

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use kvbench_engines::device::{parse_bytes, DeviceKind};
use kvbench_engines::engine::{Engine, EngineConfig};
use kvbench_engines::model::WeightDtype;
use kvbench_engines::scheduler::{PrefillMode, SchedulerConfig};
use kvbench_engines::source::{LoadOptions, Loaded, ModelSource};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DtypeArg {
    /// Quantized for GGUF files; f32 on CPU and bf16 on CUDA otherwise.
    Auto,
    /// Keep GGUF matrices quantized (candle QMatMul).
    Quantized,
    F32,
    F16,
    Bf16,
}

impl DtypeArg {
    fn weight_dtype(self) -> Option<WeightDtype> {
        match self {
            DtypeArg::Auto => None,
            DtypeArg::Quantized => Some(WeightDtype::Quantized),
            DtypeArg::F32 => Some(WeightDtype::F32),
            DtypeArg::F16 => Some(WeightDtype::F16),
            DtypeArg::Bf16 => Some(WeightDtype::Bf16),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EngineArg {
    /// Paged full cache with continuous batching (the vLLM paradigm).
    Full,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PrefillArg {
    /// Prompts chunked to the step's token budget, batched with decodes (vLLM V1).
    Chunked,
    /// One whole prompt per step, all prefills before decoding.
    Sequential,
}

#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// Model: a named model (smollm2-135m-instruct), preset:NAME (random weights of an
    /// exact architecture; see `kvbench models`), a .gguf file, a Hugging Face
    /// directory, or hf:ORG/NAME[@REV].
    #[arg(long, short = 'm', env = "KVBENCH_MODEL")]
    pub model: String,

    /// How to hold the weights.
    #[arg(long, value_enum, default_value_t = DtypeArg::Auto)]
    pub dtype: DtypeArg,

    /// Seed of preset weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Directory of fetched weights.
    #[arg(long, env = "KVBENCH_MODELS_DIR", default_value = "models")]
    pub models_dir: std::path::PathBuf,
}

#[derive(Debug, Clone, Args)]
pub struct EngineArgs {
    /// KV-cache strategy.
    #[arg(long, value_enum, default_value_t = EngineArg::Full)]
    pub engine: EngineArg,

    /// Device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu", env = "KVBENCH_DEVICE")]
    pub device: String,

    /// Device memory capacity (e.g. 8GiB). On CPU an allocation past it fails with
    /// the same out-of-memory error as a GPU. Default: the machine's physical memory.
    #[arg(long, value_parser = parse_size)]
    pub device_memory: Option<u64>,

    /// Fraction of the device memory the engine may use (vLLM's gpu_memory_utilization).
    #[arg(long, default_value_t = 0.9)]
    pub memory_fraction: f64,

    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,

    /// Longest prompt + output accepted (default: the model's context length).
    #[arg(long)]
    pub max_model_len: Option<usize>,

    /// Most sequences running at once.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,

    /// Token budget of one step.
    #[arg(long, default_value_t = 8192)]
    pub max_batched_tokens: usize,

    /// How prompts are prefilled.
    #[arg(long, value_enum, default_value_t = PrefillArg::Chunked)]
    pub prefill: PrefillArg,
}

fn parse_size(s: &str) -> std::result::Result<u64, String> {
    parse_bytes(s)
}

/// Physical memory of this machine, the CPU device's default capacity.
pub fn host_memory_bytes() -> u64 {
    use sysinfo::{MemoryRefreshKind, RefreshKind, System};
    let sys = System::new_with_specifics(
        RefreshKind::nothing().with_memory(MemoryRefreshKind::everything()),
    );
    sys.total_memory()
}

pub struct Setup {
    pub loaded: Loaded,
    pub device: DeviceKind,
    pub spec: String,
}

pub fn load_model(m: &ModelArgs, device: &str) -> Result<Setup> {
    let device: DeviceKind = device.parse()?;
    let cd = device.candle()?;
    let src = ModelSource::parse(&m.model)?;
    let opts = LoadOptions {
        dtype: m.dtype.weight_dtype(),
        seed: m.seed,
        models_dir: m.models_dir.clone(),
        ..Default::default()
    };
    let loaded = src
        .load(&cd, &opts)
        .with_context(|| format!("loading model `{}`", m.model))?;
    Ok(Setup {
        loaded,
        device,
        spec: m.model.clone(),
    })
}

pub fn build_engine(setup: &Setup, e: &EngineArgs) -> Result<Engine> {
    if !(e.memory_fraction > 0.0 && e.memory_fraction <= 1.0) {
        bail!(
            "--memory-fraction {}: expected a number in (0, 1]",
            e.memory_fraction
        );
    }
    let capacity = match (e.device_memory, setup.device) {
        (Some(c), _) => c,
        (None, DeviceKind::Cpu) => host_memory_bytes(),
        (None, DeviceKind::Cuda(_)) => {
            bail!("--device-memory is required on CUDA until the CUDA backend reads it from the driver")
        }
    };
    let cfg = EngineConfig {
        device_name: setup.device.to_string(),
        device_memory: Some(capacity),
        memory_fraction: e.memory_fraction,
        num_blocks: None,
        block_size: e.block_size,
        max_model_len: e.max_model_len,
        scheduler: SchedulerConfig {
            max_num_seqs: e.max_num_seqs,
            max_batched_tokens: e.max_batched_tokens,
            prefill: match e.prefill {
                PrefillArg::Chunked => PrefillMode::Chunked,
                PrefillArg::Sequential => PrefillMode::Sequential,
            },
        },
        shuffle_blocks_seed: None,
        check_invariants: false,
    };
    Engine::new(setup.loaded.model.clone(), cfg).context("starting the engine")
}
