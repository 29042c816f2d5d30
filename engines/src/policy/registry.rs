//! The strategy registry: each paradigm describes itself once (name, parameters and
//! their parsing, budget counts for the audit and the cost model, how it is built on
//! each backend, what `kvbench verify` checks), and the engine, the audit, verify, the
//! harness and the figures iterate over [`REGISTRY`] instead of matching on names.
//!
//! A new strategy is one module implementing [`StrategyParams`] and one line in
//! `strategies!` (policy/spec.rs).

use super::spec::{PolicyEnv, Reservation};
use super::{KvPolicy, SeqInfo};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::kv::codec::{KvCodec, KV_CODEC_KEY};
use crate::model::Llama;
use crate::policy::infinigen::skew::Skewing;
use std::sync::Arc;

/// One parameter of a strategy, for errors, `--help` and the README's table.
#[derive(Debug, Clone, Copy)]
pub struct Param {
    pub key: &'static str,
    /// The values accepted and the default.
    pub values: &'static str,
    pub about: &'static str,
}

/// Where a parameter set runs in `kvbench verify`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backends {
    Both,
    /// The CUDA implementation has a path the CPU one does not (e.g. InfiniGen's
    /// memcpy transfer).
    CudaOnly,
}

/// A parameter set `kvbench verify` runs.
#[derive(Debug, Clone, Copy)]
pub struct Variant {
    pub params: &'static [(&'static str, &'static str)],
    pub on: Backends,
}

impl Variant {
    pub const DEFAULT: Variant = Variant {
        params: &[],
        on: Backends::Both,
    };

    pub const fn both(params: &'static [(&'static str, &'static str)]) -> Self {
        Self {
            params,
            on: Backends::Both,
        }
    }

    pub const fn cuda(params: &'static [(&'static str, &'static str)]) -> Self {
        Self {
            params,
            on: Backends::CudaOnly,
        }
    }

    /// Whether the variant runs on this backend.
    pub fn runs_on(&self, cuda: bool) -> bool {
        cuda || self.on == Backends::Both
    }
}

/// A strategy as the rest of kvbench sees it.
#[derive(Debug, Clone, Copy)]
pub struct Strategy {
    /// As the command line, the YAML `engines:` list and the tables spell it.
    pub name: &'static str,
    /// One line: what it keeps and where.
    pub about: &'static str,
    /// Its `key=value` parameters (the engine-level `reservation` is everyone's, and
    /// `kv_codec` where [`Strategy::kv_codec`] says).
    pub params: &'static [Param],
    /// Whether it compresses (keeps or reads a budget `b < 1` of the tokens); `full`
    /// takes no budget.
    pub budgeted: bool,
    /// Parameter sets `kvbench verify` runs at budget 1.0 against `full`.
    pub verify: &'static [Variant],
    /// Parameter sets whose budget audit `kvbench verify` checks at a small budget.
    pub audit: &'static [Variant],
    /// Parameters of `just bench policies`' decode step.
    pub bench: &'static [(&'static str, &'static str)],
    /// Whether it has a CUDA implementation (else building it on CUDA is refused with
    /// a named error).
    pub cuda: bool,
    /// Whether the engine's `kv_codec` option applies: its K/V rows live in the paged
    /// storage the codecs write (else the option is refused with a named error).
    pub kv_codec: bool,
}

impl Strategy {
    /// The parameter keys, comma-separated (errors).
    pub fn keys(&self) -> String {
        let mut keys: Vec<&str> = self.params.iter().map(|p| p.key).collect();
        keys.push(super::spec::RESERVATION_KEY);
        if self.kv_codec {
            keys.push(KV_CODEC_KEY);
        }
        keys.join(", ")
    }
}

/// A strategy's parameters, and everything that depends on them alone.
pub trait StrategyParams: Clone + std::fmt::Debug + Send + Sync + 'static {
    /// The registry entry.
    const STRATEGY: &'static Strategy;

    /// Defaults at budget `budget` (already checked to be in (0, ∞)).
    fn at_budget(budget: f64) -> Result<Self>;

    /// The fraction of KV pairs kept or read (1 for `full`).
    fn budget(&self) -> f64;

    /// Set one parameter; unknown keys and bad values name what is accepted.
    fn set(&mut self, key: &str, value: &str) -> Result<()>;

    /// Parameters as JSON (reports).
    fn params_json(&self) -> serde_json::Value;

    /// Checks between parameters, once all are set (they may come in any order).
    fn validate(&self) -> Result<()> {
        Ok(())
    }

    /// The paradigm's own KV reservation.
    fn default_reservation(&self) -> Reservation {
        Reservation::Budget
    }

    /// The CPU policy.
    fn build(&self, model: &Llama, env: PolicyEnv) -> Result<Box<dyn KvPolicy>>;

    /// The CUDA policy; refused by default.
    fn build_cuda(&self, _model: &Llama, _env: PolicyEnv) -> Result<Box<dyn KvPolicy>> {
        Err(Error::Config(format!(
            "`{}` has no CUDA implementation yet: run it on the CPU",
            Self::STRATEGY.name
        )))
    }

    /// Keys one decode query of `layer` may attend with `n` tokens of context (its own
    /// included): the budget audit's bound and the cost model's reads.
    fn nominal_attended(&self, layer: usize, info: &SeqInfo, n: usize) -> usize;

    /// Device KV bytes of one sequence after a step with `n` tokens of context, its
    /// K/V rows stored as `kv` says and statistics in `statistic` bytes.
    fn device_kv_bytes(
        &self,
        cfg: &ModelConfig,
        info: &SeqInfo,
        n: usize,
        kv: KvCodec,
        statistic: usize,
    ) -> u64;

    /// The CPU policy's row storage: the engine's `kv_codec` option where given, else
    /// the paradigm's own given the model's compute dtype `model` (`full` stores the
    /// compute dtype; the slot stores keep f32).
    fn cpu_kv_codec(&self, _model: KvCodec, chosen: Option<KvCodec>) -> KvCodec {
        chosen.unwrap_or(KvCodec::F32)
    }

    /// Whether the policy needs InfiniGen's skewing matrices before it is built.
    fn needs_skewing(&self) -> bool {
        false
    }

    fn set_skewing(&mut self, _skewing: Arc<Skewing>) {}
}

/// `key=value` errors in one wording.
pub(crate) fn bad(strategy: &str, key: &str, value: &str, expected: &str) -> Error {
    Error::Config(format!(
        "{strategy} parameter `{key}={value}`: expected {expected}"
    ))
}

/// An unknown key of `s`, listing the accepted ones.
pub(crate) fn unknown(s: &Strategy, key: &str) -> Error {
    Error::Config(format!(
        "unknown {} parameter `{key}`: expected {}",
        s.name,
        s.keys()
    ))
}

pub(crate) fn parse_f64(s: &str, k: &str, v: &str) -> Result<f64> {
    match v {
        "inf" | "infinity" => Ok(f64::INFINITY),
        _ => v
            .parse::<f64>()
            .ok()
            .filter(|x| !x.is_nan())
            .ok_or_else(|| bad(s, k, v, "a number")),
    }
}

pub(crate) fn parse_bool(s: &str, k: &str, v: &str) -> Result<bool> {
    match v {
        "true" | "1" | "yes" => Ok(true),
        "false" | "0" | "no" => Ok(false),
        _ => Err(bad(s, k, v, "true or false")),
    }
}

pub(crate) fn parse_usize(s: &str, k: &str, v: &str) -> Result<usize> {
    v.parse()
        .map_err(|_| bad(s, k, v, "a non-negative integer"))
}

/// The registered strategies, in the order tables and legends list them.
pub fn registry() -> &'static [&'static Strategy] {
    super::spec::REGISTRY
}

/// The registry entry named `name`.
pub fn lookup(name: &str) -> Option<&'static Strategy> {
    registry().iter().copied().find(|s| s.name == name)
}

/// [`StrategyParams`] without its associated items, so a spec can hand out one
/// `&dyn` for every method instead of a match per method.
pub trait DynParams: Send + Sync {
    fn strategy(&self) -> &'static Strategy;
    fn budget(&self) -> f64;
    fn set(&mut self, key: &str, value: &str) -> Result<()>;
    fn params_json(&self) -> serde_json::Value;
    fn validate(&self) -> Result<()>;
    fn default_reservation(&self) -> Reservation;
    fn build(&self, model: &Llama, env: PolicyEnv) -> Result<Box<dyn KvPolicy>>;
    fn build_cuda(&self, model: &Llama, env: PolicyEnv) -> Result<Box<dyn KvPolicy>>;
    fn nominal_attended(&self, layer: usize, info: &SeqInfo, n: usize) -> usize;
    fn device_kv_bytes(
        &self,
        cfg: &ModelConfig,
        info: &SeqInfo,
        n: usize,
        kv: KvCodec,
        statistic: usize,
    ) -> u64;
    fn cpu_kv_codec(&self, model: KvCodec, chosen: Option<KvCodec>) -> KvCodec;
    fn needs_skewing(&self) -> bool;
    fn set_skewing(&mut self, skewing: Arc<Skewing>);
}

impl<T: StrategyParams> DynParams for T {
    fn strategy(&self) -> &'static Strategy {
        T::STRATEGY
    }
    fn budget(&self) -> f64 {
        StrategyParams::budget(self)
    }
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        StrategyParams::set(self, key, value)
    }
    fn params_json(&self) -> serde_json::Value {
        StrategyParams::params_json(self)
    }
    fn validate(&self) -> Result<()> {
        StrategyParams::validate(self)
    }
    fn default_reservation(&self) -> Reservation {
        StrategyParams::default_reservation(self)
    }
    fn build(&self, model: &Llama, env: PolicyEnv) -> Result<Box<dyn KvPolicy>> {
        StrategyParams::build(self, model, env)
    }
    fn build_cuda(&self, model: &Llama, env: PolicyEnv) -> Result<Box<dyn KvPolicy>> {
        StrategyParams::build_cuda(self, model, env)
    }
    fn nominal_attended(&self, layer: usize, info: &SeqInfo, n: usize) -> usize {
        StrategyParams::nominal_attended(self, layer, info, n)
    }
    fn device_kv_bytes(
        &self,
        cfg: &ModelConfig,
        info: &SeqInfo,
        n: usize,
        kv: KvCodec,
        statistic: usize,
    ) -> u64 {
        StrategyParams::device_kv_bytes(self, cfg, info, n, kv, statistic)
    }
    fn cpu_kv_codec(&self, model: KvCodec, chosen: Option<KvCodec>) -> KvCodec {
        StrategyParams::cpu_kv_codec(self, model, chosen)
    }
    fn needs_skewing(&self) -> bool {
        StrategyParams::needs_skewing(self)
    }
    fn set_skewing(&mut self, skewing: Arc<Skewing>) {
        StrategyParams::set_skewing(self, skewing)
    }
}
