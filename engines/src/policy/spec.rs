//! Which strategy an engine runs, with its budget and parameters, and the environment
//! every policy is built in (device capacity, attention implementation).

use super::evicting::h2o::H2oParams;
use super::evicting::snapkv::SnapkvParams;
use super::evicting::streaming::StreamingParams;
use super::full::{FullOptions, FullParams};
use super::hybrid::HybridParams;
use super::infinigen::skew::Skewing;
use super::infinigen::InfinigenParams;
use super::kivi::KiviParams;
use super::quest::QuestParams;
use super::registry::{DynParams, Strategy, StrategyParams};
use super::KvPolicy;
use crate::attention::prefill::AttentionImpl;
use crate::error::{Error, Result};
use crate::kv::codec::{KvCodec, KV_CODEC_KEY};
use crate::model::Llama;
use std::sync::Arc;

/// What a policy is built with.
#[derive(Debug, Clone)]
pub struct PolicyEnv {
    pub device_name: String,
    pub device_capacity: Option<u64>,
    /// Device bytes the KV cache may occupy (capacity × fraction − weights −
    /// activations): allocated up front under [`Reservation::Fraction`], the ceiling
    /// of a pool grown on demand under [`Reservation::Budget`].
    pub kv_device_bytes: u64,
    /// How the device KV is reserved.
    pub reservation: Reservation,
    /// Host bytes an offloading policy may occupy.
    pub kv_host_bytes: u64,
    pub block_size: usize,
    pub attention: AttentionImpl,
    /// Query rows per chunk for `AttentionImpl::Chunked`.
    pub chunk_size: usize,
    /// The model's compute dtype as a row storage: `full`'s own.
    pub compute_codec: KvCodec,
    /// The engine's `kv_codec` option: how every paged store keeps its rows (`None`:
    /// each paradigm's own, [`PolicyEnv::codec_or`]).
    pub kv_codec: Option<KvCodec>,
    /// Shuffle `full`'s free list (tests: random block tables).
    pub shuffle_seed: Option<u64>,
}

/// How an engine reserves its device KV memory (the `reservation` option).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Reservation {
    /// vLLM's paradigm: the fraction of the device capacity (less weights and the
    /// activation profile) is allocated as one pool at start-up and held throughout.
    Fraction,
    /// FlexGen's and InfiniGen's paradigm: the pool holds what the admitted sequences
    /// need at their budget, grown on demand (block by block) as they need more and kept
    /// once grown; the fraction of the capacity is only its ceiling.
    Budget,
}

/// The option's key, as `--set` and an experiment's engine `params` spell it.
pub const RESERVATION_KEY: &str = "reservation";

impl Reservation {
    /// The paradigm's own: `fraction` for `full` (vLLM), `budget` for the strategies
    /// that evict or offload (H2O and StreamingLLM as FlexGen runs them, InfiniGen).
    pub fn default_for(spec: &PolicySpec) -> Self {
        spec.params().default_reservation()
    }

    pub fn name(&self) -> &'static str {
        match self {
            Reservation::Fraction => "fraction",
            Reservation::Budget => "budget",
        }
    }
}

impl std::fmt::Display for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Reservation {
    type Err = Error;
    fn from_str(v: &str) -> Result<Self> {
        match v {
            "fraction" => Ok(Reservation::Fraction),
            "budget" => Ok(Reservation::Budget),
            _ => Err(Error::Config(format!(
                "`{RESERVATION_KEY}={v}`: expected `fraction` (the pool is a fraction of the device, allocated up front) or `budget` (what the admitted sequences need at their budget, grown on demand)"
            ))),
        }
    }
}

/// `key=value` parameters.
pub type Params = Vec<(String, String)>;

/// The engine-level options every strategy's parameters may carry (`None`: the
/// paradigm's own).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineOptions {
    pub reservation: Option<Reservation>,
    pub kv_codec: Option<KvCodec>,
}

/// Split the engine-level options (`reservation`, `kv_codec`) off a strategy's
/// `key=value` parameters: the options and the strategy's own parameters.
pub fn split_engine_options(params: &[(String, String)]) -> Result<(EngineOptions, Params)> {
    let mut opts = EngineOptions::default();
    let mut rest = Vec::new();
    for (k, v) in params {
        match k.as_str() {
            RESERVATION_KEY => opts.reservation = Some(v.parse()?),
            KV_CODEC_KEY => opts.kv_codec = Some(v.parse()?),
            _ => rest.push((k.clone(), v.clone())),
        }
    }
    Ok((opts, rest))
}

/// Declares the strategies: the spec enum, the registry and the dispatch, from one
/// line per strategy (variant and parameter type).
macro_rules! strategies {
    ($($variant:ident($params:ty)),* $(,)?) => {
        /// A strategy and its parameters.
        #[derive(Debug, Clone)]
        pub enum PolicySpec {
            $($variant($params)),*
        }

        /// Every registered strategy, in the order tables and legends list them.
        pub const REGISTRY: &[&Strategy] = &[$(<$params as StrategyParams>::STRATEGY),*];

        impl PolicySpec {
            /// The strategy's parameters behind one interface.
            pub fn params(&self) -> &dyn DynParams {
                match self {
                    $(PolicySpec::$variant(p) => p),*
                }
            }

            fn params_mut(&mut self) -> &mut dyn DynParams {
                match self {
                    $(PolicySpec::$variant(p) => p),*
                }
            }

            /// The defaults of the strategy `name` at budget `budget`.
            fn named(name: &str, budget: f64) -> Option<Result<Self>> {
                $(
                    if name == <$params as StrategyParams>::STRATEGY.name {
                        return Some(<$params as StrategyParams>::at_budget(budget).map(PolicySpec::$variant));
                    }
                )*
                None
            }
        }
    };
}

strategies! {
    Full(FullParams),
    H2o(H2oParams),
    Infinigen(InfinigenParams),
    Streaming(StreamingParams),
    Snapkv(SnapkvParams),
    Quest(QuestParams),
    Kivi(KiviParams),
    Hybrid(HybridParams),
}

/// The registered names (errors, `--help`).
pub fn strategy_names() -> String {
    REGISTRY
        .iter()
        .map(|s| s.name)
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
impl PolicyEnv {
    /// A CPU environment with room for any test's cache (f32 rows, blocks of 16, flash
    /// prefill, 1 GiB of host memory for an offloading policy).
    pub(crate) fn cpu_for_tests() -> Self {
        Self {
            device_name: "cpu".into(),
            device_capacity: None,
            kv_device_bytes: u64::MAX,
            reservation: Reservation::Budget,
            kv_host_bytes: 1 << 30,
            block_size: 16,
            attention: crate::attention::prefill::AttentionImpl::Flash,
            chunk_size: 512,
            compute_codec: KvCodec::F32,
            kv_codec: None,
            shuffle_seed: None,
        }
    }
}

impl PolicyEnv {
    /// `full`'s options in this environment.
    pub(crate) fn full_options(&self) -> FullOptions {
        FullOptions {
            block_size: self.block_size,
            kv_codec: self.codec_or(self.compute_codec),
            shuffle_seed: self.shuffle_seed,
            attention: self.attention,
            chunk_size: self.chunk_size,
        }
    }

    /// How a paged store keeps its rows: the `kv_codec` option, else `own` (the
    /// paradigm's).
    pub fn codec_or(&self, own: KvCodec) -> KvCodec {
        self.kv_codec.unwrap_or(own)
    }

    /// Refuse the `kv_codec` option for a policy whose rows live elsewhere.
    pub fn refuse_codec(&self, strategy: &str, why: &str) -> Result<()> {
        match self.kv_codec {
            Some(c) => Err(Error::Config(format!(
                "`{KV_CODEC_KEY}={c}` does not apply to `{strategy}`: {why}"
            ))),
            None => Ok(()),
        }
    }

    /// Blocks of `block_bytes` the KV may occupy at most.
    pub fn kv_blocks(&self, block_bytes: u64) -> usize {
        (self.kv_device_bytes / block_bytes.max(1)) as usize
    }
}

impl PolicySpec {
    /// `full` (no parameters).
    pub const fn full() -> Self {
        PolicySpec::Full(FullParams)
    }

    /// The registry entry.
    pub fn strategy(&self) -> &'static Strategy {
        self.params().strategy()
    }

    pub fn name(&self) -> &'static str {
        self.strategy().name
    }

    /// The fraction of KV pairs kept (1 for `full`).
    pub fn budget(&self) -> f64 {
        self.params().budget()
    }

    /// From a strategy name, the budget `b` (fraction of KV pairs kept) and
    /// `key=value` parameters. Unknown names, keys and values are errors that list
    /// what is accepted.
    pub fn parse(name: &str, budget: f64, params: &[(String, String)]) -> Result<Self> {
        if budget.is_nan() || budget <= 0.0 {
            return Err(Error::Config(format!(
                "budget {budget}: expected the fraction of KV pairs kept, above 0 (1 or more keeps everything)"
            )));
        }
        let mut spec = Self::named(name, budget).ok_or_else(|| {
            Error::Config(format!(
                "unknown engine `{name}`: expected one of {}",
                strategy_names()
            ))
        })??;
        // A nested key (`long.sinks`) after the plain ones (`long`), whatever the order
        // given: it may name a parameter of what a plain one chooses.
        for (i, (k, v)) in params.iter().enumerate() {
            if let Some((_, first)) = params[..i].iter().find(|(k0, _)| k0 == k) {
                return Err(Error::Config(format!(
                    "{name} parameter `{k}` given twice (`{first}` and `{v}`)"
                )));
            }
        }
        let (plain, nested): (Vec<_>, Vec<_>) = params.iter().partition(|(k, _)| !k.contains('.'));
        for (k, v) in plain.into_iter().chain(nested) {
            if k == RESERVATION_KEY {
                // An engine option, not the strategy's: checked here, taken by
                // `split_engine_options` into `EngineConfig::options`.
                v.parse::<Reservation>()?;
                continue;
            }
            if k == KV_CODEC_KEY {
                let codec: KvCodec = v.parse()?;
                if !spec.strategy().kv_codec {
                    return Err(Error::Config(format!(
                        "`{KV_CODEC_KEY}={codec}` does not apply to `{name}`: it keeps its K/V in storage of its own"
                    )));
                }
                continue;
            }
            spec.set(k, v)?;
        }
        spec.params().validate()?;
        Ok(spec)
    }

    /// Set one parameter.
    pub fn set(&mut self, k: &str, v: &str) -> Result<()> {
        self.params_mut().set(k, v)
    }

    /// Parameters as JSON (reports).
    pub fn params_json(&self) -> serde_json::Value {
        self.params().params_json()
    }

    /// Whether InfiniGen's skewing matrices must be set before the policy is built.
    pub fn needs_skewing(&self) -> bool {
        self.params().needs_skewing()
    }

    pub fn set_skewing(&mut self, skewing: Arc<Skewing>) {
        self.params_mut().set_skewing(skewing)
    }

    /// Build the policy for `model`.
    pub fn build(&self, model: &Llama, env: PolicyEnv) -> Result<Box<dyn KvPolicy>> {
        if model.device().is_cuda() {
            return self.build_cuda(model, env);
        }
        self.params().build(model, env)
    }

    /// The CUDA implementations keep K/V in bf16.
    #[cfg(feature = "cuda")]
    fn build_cuda(&self, model: &Llama, env: PolicyEnv) -> Result<Box<dyn KvPolicy>> {
        if model.dtype() != candle_core::DType::BF16 {
            return Err(Error::Config(format!(
                "the CUDA kernels keep K/V in bf16: load the model with bf16 weights (got {})",
                model.weight_dtype
            )));
        }
        if let Some(c) = env.kv_codec.filter(|&c| c != KvCodec::Bf16) {
            return Err(Error::Config(format!(
                "`{KV_CODEC_KEY}={c}`: the CUDA kernels keep K/V in bf16; other codecs run with --device cpu"
            )));
        }
        self.params().build_cuda(model, env)
    }

    #[cfg(not(feature = "cuda"))]
    fn build_cuda(&self, _model: &Llama, env: PolicyEnv) -> Result<Box<dyn KvPolicy>> {
        Err(Error::DeviceUnavailable(env.device_name))
    }
}
