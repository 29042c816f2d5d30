//! Model and engine options shared by the commands that run an engine.

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use kvbench_engines::attention::prefill::AttentionImpl;
use kvbench_engines::device::{parse_bytes, DeviceKind};
use kvbench_engines::engine::{Engine, EngineConfig};
use kvbench_engines::model::WeightDtype;
use kvbench_engines::policy::infinigen::skew::{load_or_calibrate, Skewing};
use kvbench_engines::policy::spec::{split_engine_options, PolicySpec};

/// The registered strategies, with what each is (`--engine`'s values).
fn strategy_names() -> Vec<clap::builder::PossibleValue> {
    kvbench_engines::policy::registry::registry()
        .iter()
        .map(|s| clap::builder::PossibleValue::new(s.name).help(s.about))
        .collect()
}
use kvbench_engines::scheduler::{PrefillMode, SchedulerConfig};
use kvbench_engines::source::{LoadOptions, Loaded, ModelSource};
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DtypeArg {
    /// On CPU: f32 (GGUF dequantized, several times faster to decode with candle)
    /// when the f32 weights take at most half the host memory, else quantized for GGUF;
    /// f32 for other sources. On CUDA: quantized for GGUF, bf16 otherwise.
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
pub enum AttentionArg {
    /// Materialize the whole score matrix (the originals' prefill; O(n²) memory).
    Eager,
    /// Query rows in chunks of --chunk-size, each chunk's scores materialized.
    Chunked,
    /// Tiled with online softmax, O(n) extra memory.
    Flash,
}

impl AttentionArg {
    pub fn imp(self) -> AttentionImpl {
        match self {
            AttentionArg::Eager => AttentionImpl::Eager,
            AttentionArg::Chunked => AttentionImpl::Chunked,
            AttentionArg::Flash => AttentionImpl::Flash,
        }
    }
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
    #[arg(
        long,
        short = 'm',
        env = "KVBENCH_MODEL",
        default_value = "smollm2-135m-instruct"
    )]
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
    /// KV-cache strategy (docs/strategies.md): one of the registered names.
    #[arg(long, default_value = "full", value_parser = clap::builder::PossibleValuesParser::new(strategy_names()))]
    pub engine: String,

    /// Device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu", env = "KVBENCH_DEVICE")]
    pub device: String,

    /// Device memory capacity (e.g. 8GiB). On CPU an allocation past it fails with
    /// the same out-of-memory error as a GPU. Default: the machine's physical memory
    /// on CPU, the card's memory (from the driver) on CUDA.
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

    /// KV budget: the fraction of each sequence's KV pairs a layer keeps on the device
    /// (the study's convention; kvpress's compression ratio is 1 − budget). 1 keeps
    /// everything.
    #[arg(long, default_value_t = 1.0)]
    pub budget: f64,

    /// Prefill attention implementation.
    #[arg(long, value_enum, default_value_t = AttentionArg::Flash)]
    pub attention: AttentionArg,

    /// Query rows per chunk for --attention chunked.
    #[arg(long, default_value_t = 512)]
    pub chunk_size: usize,

    /// Strategy parameter KEY=VALUE, repeatable; each strategy's keys and values are
    /// in docs/strategies.md (a wrong key's error lists them). Every engine also takes
    /// reservation=fraction|budget, and all but kivi and infinigen
    /// kv_codec=f32|f16|bf16|int8|int4|int2 (how the paged stores keep K/V rows;
    /// int4/64: a scale per 64 channels).
    #[arg(long = "set", value_name = "KEY=VALUE", value_parser = parse_kv)]
    pub set: Vec<(String, String)>,

    /// Text whose first 2048 tokens calibrate InfiniGen's skewing matrices (cached
    /// next to the models, keyed by the weights). Default: seeded random tokens.
    #[arg(long, env = "KVBENCH_CALIBRATION")]
    pub calibration: Option<std::path::PathBuf>,

    /// Host memory an offloading engine may use (default: physical memory).
    #[arg(long, value_parser = parse_size)]
    pub host_memory: Option<u64>,

    /// Do not fail when a strategy attends or holds more than its budget allows.
    #[arg(long)]
    pub no_audit: bool,
}

fn parse_kv(s: &str) -> std::result::Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() && !v.is_empty() => Ok((k.trim().into(), v.trim().into())),
        _ => Err(format!("`{s}`: expected KEY=VALUE")),
    }
}

/// Tokens InfiniGen calibrates on: the first 2048 of the given text, or seeded random
/// ids (enough for shapes; real text gives better skewing on trained weights).
fn calibration_tokens(setup: &Setup, calibration: Option<&std::path::Path>) -> Result<Vec<u32>> {
    const N: usize = 2048;
    let cfg = &setup.loaded.model.cfg;
    let n = N.min(cfg.max_position_embeddings);
    if let Some(path) = calibration {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading --calibration {}", path.display()))?;
        let mut ids = setup.loaded.tokenizer.encode(&text)?;
        if ids.len() < 64 {
            bail!(
                "--calibration {}: {} tokens, expected at least 64",
                path.display(),
                ids.len()
            );
        }
        ids.truncate(n);
        return Ok(ids);
    }
    let mut state = 0x2545_f491_4f6c_dd1du64;
    Ok(seeded_ids(n, cfg.vocab_size, &mut state))
}

/// `n` token ids from a xorshift stream (`state` carries on between calls): prompts
/// and calibration text for models whose weights are random.
pub fn seeded_ids(n: usize, vocab: usize, state: &mut u64) -> Vec<u32> {
    (0..n)
        .map(|_| {
            *state ^= *state << 13;
            *state ^= *state >> 7;
            *state ^= *state << 17;
            (*state % vocab as u64) as u32
        })
        .collect()
}

/// The strategy with its budget and parameters; InfiniGen's skewing matrices are
/// loaded from the cache or calibrated.
pub fn policy_spec(
    setup: &Setup,
    e: &EngineArgs,
    models_dir: &std::path::Path,
) -> Result<PolicySpec> {
    let mut spec = PolicySpec::parse(&e.engine, e.budget, &e.set)?;
    if spec.needs_skewing() {
        spec.set_skewing(skewing(setup, e.calibration.as_deref(), models_dir)?);
    }
    Ok(spec)
}

/// InfiniGen's skewing matrices for the loaded model: from the cache under
/// `models_dir/skewing` (keyed by the weights and the calibration tokens) or
/// calibrated now.
pub fn skewing(
    setup: &Setup,
    calibration: Option<&std::path::Path>,
    models_dir: &std::path::Path,
) -> Result<Arc<Skewing>> {
    let tokens = calibration_tokens(setup, calibration)?;
    let dir = models_dir.join("skewing");
    let (skew, cached) = load_or_calibrate(&setup.loaded.model, &tokens, &dir)
        .context("InfiniGen skewing calibration")?;
    if !cached {
        eprintln!(
            "calibrated InfiniGen skewing on {} tokens, cached in {}",
            tokens.len(),
            dir.display()
        );
    }
    Ok(Arc::new(skew))
}

/// A size of memory given on the command line: parsed, and above 0.
pub(crate) fn parse_size(s: &str) -> std::result::Result<u64, String> {
    match parse_bytes(s)? {
        0 => Err(format!("`{s}`: expected a size above 0")),
        n => Ok(n),
    }
}

/// The device's capacity for the engine: `explicit`, else the machine's memory on the
/// CPU or the card's total on CUDA; and on CUDA without an explicit size, what this
/// process can use (free memory with the model loaded, plus its weights), said on
/// stderr when it is less than `fraction` of the card (another process holds the rest).
pub fn device_capacity(
    setup: &Setup,
    explicit: Option<u64>,
    fraction: f64,
) -> Result<(u64, Option<u64>)> {
    if let Some(c) = explicit {
        return Ok((c, None));
    }
    let model = &setup.loaded.model;
    match kvbench_engines::device::device_memory(model.device())? {
        None => Ok((host_memory_bytes(), None)),
        Some((total, free)) => {
            let available = free + model.weights_bytes();
            let planned = (total as f64 * fraction) as u64;
            if available < planned {
                eprintln!(
                    "{}: {:.1} GiB free with the model loaded, less than {fraction} of {:.1} \
                     GiB: the KV pool is planned within what is free",
                    setup.device,
                    free as f64 / GIB,
                    total as f64 / GIB
                );
            }
            Ok((total, Some(available)))
        }
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// `--dtype auto` for a GGUF file on the CPU: f32 (dequantized) when its f32 weights
/// take at most half the host's memory, the rest left for the cache and activations;
/// quantized otherwise. On CPU candle's f32 matmuls decode several times faster than
/// its quantized ones (docs/correctness-and-performance.md).
pub fn auto_gguf_dtype_on_cpu(num_params: u64, host_memory: u64) -> WeightDtype {
    kvbench_engines::source::gguf_dtype(num_params, Some(host_memory / 2))
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

impl Setup {
    /// NVML index of the device, for the samplers (`None` on the CPU).
    pub fn gpu_index(&self) -> Option<u32> {
        match self.device {
            DeviceKind::Cuda(i) => Some(i as u32),
            DeviceKind::Cpu => None,
        }
    }
}

pub fn load_model(m: &ModelArgs, device: &str) -> Result<Setup> {
    let device: DeviceKind = device.parse()?;
    let cd = device.candle()?;
    let src = ModelSource::parse(&m.model)?;
    let mut opts = LoadOptions {
        dtype: m.dtype.weight_dtype(),
        seed: m.seed,
        models_dir: m.models_dir.clone(),
        ..Default::default()
    };
    if m.dtype == DtypeArg::Auto && device == DeviceKind::Cpu && src.is_gguf() {
        // Decided by the load from the header it reads (auto_gguf_dtype_on_cpu's rule).
        opts.gguf_f32_max_bytes = Some(host_memory_bytes() / 2);
    }
    let loaded = src
        .load(&cd, &opts)
        .with_context(|| format!("loading model `{}`", m.model))?;
    Ok(Setup {
        loaded,
        device,
        spec: m.model.clone(),
    })
}

pub fn build_engine(setup: &Setup, e: &EngineArgs, models_dir: &std::path::Path) -> Result<Engine> {
    if !(e.memory_fraction > 0.0 && e.memory_fraction <= 1.0) {
        bail!(
            "--memory-fraction {}: expected a number in (0, 1]",
            e.memory_fraction
        );
    }
    if let Some(len) = e.max_model_len {
        let context = setup.loaded.model.cfg.max_position_embeddings;
        if len == 0 || len > context {
            bail!("--max-model-len {len}: expected 1 to the model's context of {context} tokens");
        }
    }
    let (capacity, available) = device_capacity(setup, e.device_memory, e.memory_fraction)?;
    let (opts, _) = split_engine_options(&e.set)?;
    let cfg = EngineConfig {
        device_name: setup.device.to_string(),
        device_memory: Some(capacity),
        device_available: available,
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
        policy: policy_spec(setup, e, models_dir)?,
        attention: e.attention.imp(),
        chunk_size: e.chunk_size,
        host_memory: Some(e.host_memory.unwrap_or_else(host_memory_bytes)),
        audit: !e.no_audit,
        reservation: opts.reservation,
        kv_codec: opts.kv_codec,
        // KVBENCH_CUDA_GRAPH decides (a kernel switch: part of a cell's identity).
        cuda_graphs: None,
    };
    Engine::new(setup.loaded.model.clone(), cfg).context("starting the engine")
}

#[cfg(test)]
mod dtype_tests {
    use super::*;

    #[test]
    fn auto_takes_f32_on_cpu_only_when_it_fits_in_half_the_host() {
        let smol = 134_515_008u64; // SmolLM2-135M: 538 MB in f32
        assert_eq!(auto_gguf_dtype_on_cpu(smol, 24 << 30), WeightDtype::F32);
        let llama8b = 8_030_261_248u64; // 32 GB in f32
        assert_eq!(
            auto_gguf_dtype_on_cpu(llama8b, 24 << 30),
            WeightDtype::Quantized
        );
        assert_eq!(auto_gguf_dtype_on_cpu(llama8b, 128 << 30), WeightDtype::F32);
        // The boundary: exactly half the host is f32, one parameter more is not.
        assert_eq!(auto_gguf_dtype_on_cpu(1 << 20, 8 << 20), WeightDtype::F32);
        assert_eq!(
            auto_gguf_dtype_on_cpu((1 << 20) + 1, 8 << 20),
            WeightDtype::Quantized
        );
    }
}
