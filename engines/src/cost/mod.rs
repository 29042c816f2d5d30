//! Analytical cost model of the KV strategies: what each step reads, moves and
//! computes, what each run holds, and from those, with a device description and
//! efficiency constants fitted from measured runs, TTFT, TPOT, throughput, E2E and
//! out-of-memory outcomes. Pure functions; docs/cost-model.md states every equation
//! and its limits.
//!
//! One source of truth: token counts come from `policy::budget` / `policy::audit`
//! (the numbers the engine's budget audit enforces), per-token KV bytes from
//! [`ModelConfig::kv_bytes_per_token`], activation bytes from
//! [`crate::model::activation_bytes`], score-matrix scratch from
//! [`crate::attention::prefill::scratch_bytes`], H2O's statistics mode from the
//! policy's own rule.
//!
//! - [`device`]: the device table (`engines/devices.yaml`, or a user file).
//! - [`traffic`]: bytes and FLOPs of one decode step and of one prefill, per strategy.
//! - [`memory`]: memory held by component ([`MemoryReport`], the ledger's type).
//! - [`parallel`]: tensor parallelism (the per-GPU shard, all-reduces).
//! - [`fit`]: least-squares fit of efficiency constants from measured step times.
//! - [`calibrate`]: a device's fitted constants per phase, as a YAML file.
//! - [`predict`]: per-cell predictions, OOM included (closed form, one wave of alike
//!   requests).
//! - [`simulate`]: the engine's scheduler over a counting KV pool, each step costed
//!   and timed: predictions of any workload, and the steps a calibration fits.

pub mod calibrate;
pub mod device;
pub mod fit;
pub mod memory;
pub mod parallel;
pub mod predict;
pub mod simulate;
pub mod traffic;

pub use crate::ledger::MemoryReport;
pub use calibrate::Calibration;
pub use device::{Ceilings, Device, DeviceKind, DeviceTable, Link};
pub use fit::{fit_phase, FitReport, Observation, PhaseEfficiency, Term};
pub use memory::{memory_held, MemoryHeld, MemoryInputs, Oom};
pub use parallel::TensorParallel;
pub use predict::{
    memory, oom_boundary_prompt_len, predict, Efficiency, Outcome, Prediction, Scenario,
};
pub use simulate::{Phase, SimEngine, SimRequest};
pub use traffic::{decode_row, decode_step, forward_weights, prefill, prefill_rows, StepCost};

use crate::attention::prefill::AttentionImpl;
use crate::config::ModelConfig;
use crate::kv::KvCodec;
use crate::policy::infinigen::Transfer;
use crate::policy::spec::PolicySpec;
use std::path::PathBuf;

/// Errors of the cost model.
#[derive(Debug, thiserror::Error)]
pub enum CostError {
    /// A device file that does not parse or holds an impossible value.
    #[error("{file}: {key}: {message}")]
    DeviceFile {
        file: String,
        key: String,
        message: String,
    },
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("unknown device `{name}` (known: {known})")]
    UnknownDevice { name: String, known: String },
    /// A figure the prediction needs is `null` in the device file.
    #[error("device {device}: `{field}` is unknown (null in the device file); fit it from measured runs or give it")]
    UnknownFigure { device: String, field: String },
    /// Too few or degenerate observations.
    #[error("fit: {0}")]
    Fit(String),
    #[error("invalid input: {0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, CostError>;

/// Bytes per element of each kind of data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Precision {
    /// Bytes per weight (dense weights).
    pub weight: usize,
    /// Bytes per K or V element (device and host tiers).
    pub kv: usize,
    /// Bytes per activation element (and per all-reduced element).
    pub activation: usize,
    /// Bytes per statistic: H2O scores and positions, InfiniGen partial keys and
    /// projection matrices (f32 in every implementation, algorithms.md §1 rule 1).
    pub statistic: usize,
}

impl Precision {
    /// bf16 weights, KV and activations (the GPU runs).
    pub const BF16: Precision = Precision {
        weight: 2,
        kv: 2,
        activation: 2,
        statistic: 4,
    };
    /// f32 everywhere (the CPU runs, and the CPU policies' slot storage).
    pub const F32: Precision = Precision {
        weight: 4,
        kv: 4,
        activation: 4,
        statistic: 4,
    };
}

/// A model, a strategy and how it runs: the inputs every cost function shares.
#[derive(Debug, Clone)]
pub struct Setup {
    pub model: ModelConfig,
    pub policy: PolicySpec,
    pub precision: Precision,
    /// Tokens per KV block (paged pool, host tier).
    pub block_size: usize,
    /// Prefill attention implementation.
    pub attention: AttentionImpl,
    /// Query rows per chunk for chunked attention.
    pub chunk_size: usize,
    /// Which engine backend's kernels: their attention scratch differs (f32 scores on
    /// the CPU, [`crate::attention::prefill::CUDA_SCORE_BYTES`] per score on CUDA).
    pub backend: DeviceKind,
    /// The engine's `kv_codec` option (`None`: each paradigm's own storage).
    pub kv_codec: Option<KvCodec>,
}

impl Setup {
    /// `model` running `policy` with kvbench's defaults (block 16, flash, chunk 512),
    /// on the CPU engine for f32 and the CUDA engine for bf16 (set `backend` otherwise).
    pub fn new(model: ModelConfig, policy: PolicySpec, precision: Precision) -> Self {
        let backend = if precision == Precision::F32 {
            DeviceKind::Cpu
        } else {
            DeviceKind::Gpu
        };
        Self {
            model,
            policy,
            precision,
            block_size: 16,
            attention: AttentionImpl::Flash,
            chunk_size: 512,
            backend,
            kv_codec: None,
        }
    }

    /// How the policy stores its K/V rows, as the engine does: on the CPU the option,
    /// else the paradigm's own given the precision (the slot stores keep f32); on CUDA
    /// the precision's (bf16).
    pub fn kv(&self) -> KvCodec {
        let own = match self.precision.kv {
            2 => KvCodec::Bf16,
            _ => KvCodec::F32,
        };
        match self.backend {
            DeviceKind::Cpu => self.policy.params().cpu_kv_codec(own, self.kv_codec),
            _ => self.kv_codec.unwrap_or(own),
        }
    }

    /// What of this setup the model does not describe, if anything: a prediction of it
    /// would be a number for another system, so calibrations leave such cells out and
    /// predictions refuse them.
    pub fn not_modelled(&self) -> Option<&'static str> {
        match &self.policy {
            // The CPU policy copies the selected rows in process either way.
            PolicySpec::Infinigen(p)
                if p.transfer == Transfer::Memcpy && self.backend == DeviceKind::Gpu =>
            {
                Some(
                    "InfiniGen's `transfer: memcpy` on a GPU (a host gather, a copy, then the \
                     layers, one after another): the model's host-link term is the zero-copy \
                     gather that runs beside the layers",
                )
            }
            _ => None,
        }
    }

    /// Rows of `full`'s pool (the engine plans its KV in its blocks).
    pub fn full_kv(&self) -> KvCodec {
        let own = match self.precision.kv {
            2 => KvCodec::Bf16,
            _ => KvCodec::F32,
        };
        self.kv_codec.unwrap_or(own)
    }

    /// The same set-up running `policy` instead (a hybrid's side for one request).
    pub(crate) fn routed(&self, policy: PolicySpec) -> Self {
        Self {
            policy,
            ..self.clone()
        }
    }

    pub(crate) fn check(&self) -> Result<()> {
        self.model.validate().map_err(CostError::Invalid)?;
        if self.block_size == 0 || self.chunk_size == 0 {
            return Err(CostError::Invalid(
                "block size and chunk size must be > 0".into(),
            ));
        }
        Ok(())
    }
}
