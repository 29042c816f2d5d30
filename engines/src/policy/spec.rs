//! Which strategy an engine runs, with its budget and parameters, and the environment
//! every policy is built in (device capacity, attention implementation).

use super::full::{FullOptions, FullPolicy};
use super::h2o::{H2o, H2oParams, H2oPolicy};
use super::infinigen::{InfinigenParams, InfinigenPolicy, Speculation, Transfer};
use super::streaming::{Streaming, StreamingParams, StreamingPolicy};
use super::{budget::H2oRatio, KvPolicy};
use crate::attention::prefill::{AttentionImpl, ColumnStats};
use crate::error::{Error, Result};
use crate::kv::KvDtype;
use crate::model::Llama;
use serde_json::json;

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
    /// Storage type of `full`'s pool (the model's compute dtype).
    pub kv_dtype: KvDtype,
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
        match spec {
            PolicySpec::Full => Reservation::Fraction,
            _ => Reservation::Budget,
        }
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

/// Split the engine-level `reservation` option off a strategy's `key=value` parameters:
/// the option (`None`: the paradigm's default) and the strategy's own parameters.
pub fn split_reservation(params: &[(String, String)]) -> Result<(Option<Reservation>, Params)> {
    let mut reservation = None;
    let mut rest = Vec::new();
    for (k, v) in params {
        if k == RESERVATION_KEY {
            reservation = Some(v.parse()?);
        } else {
            rest.push((k.clone(), v.clone()));
        }
    }
    Ok((reservation, rest))
}

/// A strategy and its parameters.
#[derive(Debug, Clone)]
pub enum PolicySpec {
    Full,
    H2o(H2oParams),
    Streaming(StreamingParams),
    Infinigen(InfinigenParams),
}

pub const STRATEGIES: &[&str] = &["full", "h2o", "infinigen", "streaming"];

fn bad(strategy: &str, key: &str, value: &str, expected: &str) -> Error {
    Error::Config(format!(
        "{strategy} parameter `{key}={value}`: expected {expected}"
    ))
}

fn parse_f64(s: &str, k: &str, v: &str) -> Result<f64> {
    match v {
        "inf" | "infinity" => Ok(f64::INFINITY),
        _ => v
            .parse::<f64>()
            .ok()
            .filter(|x| !x.is_nan())
            .ok_or_else(|| bad(s, k, v, "a number")),
    }
}

fn parse_bool(s: &str, k: &str, v: &str) -> Result<bool> {
    match v {
        "true" | "1" | "yes" => Ok(true),
        "false" | "0" | "no" => Ok(false),
        _ => Err(bad(s, k, v, "true or false")),
    }
}

fn parse_usize(s: &str, k: &str, v: &str) -> Result<usize> {
    v.parse()
        .map_err(|_| bad(s, k, v, "a non-negative integer"))
}

impl PolicyEnv {
    /// `full`'s options in this environment.
    fn full_options(&self) -> FullOptions {
        FullOptions {
            block_size: self.block_size,
            kv_dtype: self.kv_dtype,
            shuffle_seed: self.shuffle_seed,
            attention: self.attention,
            chunk_size: self.chunk_size,
        }
    }

    /// Blocks of `block_bytes` the KV may occupy at most.
    pub fn kv_blocks(&self, block_bytes: u64) -> usize {
        (self.kv_device_bytes / block_bytes.max(1)) as usize
    }
}

impl PolicySpec {
    pub fn name(&self) -> &'static str {
        match self {
            PolicySpec::Full => "full",
            PolicySpec::H2o(_) => "h2o",
            PolicySpec::Streaming(_) => "streaming",
            PolicySpec::Infinigen(_) => "infinigen",
        }
    }

    /// The fraction of KV pairs kept (1 for `full`).
    pub fn budget(&self) -> f64 {
        match self {
            PolicySpec::Full => 1.0,
            PolicySpec::H2o(p) => p.budget,
            PolicySpec::Streaming(p) => p.budget,
            PolicySpec::Infinigen(p) => p.budget,
        }
    }

    /// From a strategy name, the budget `b` (fraction of KV pairs kept) and
    /// `key=value` parameters. Unknown names, keys and values are errors that list
    /// what is accepted.
    pub fn parse(name: &str, budget: f64, params: &[(String, String)]) -> Result<Self> {
        if budget.is_nan() || budget <= 0.0 {
            return Err(Error::Config(format!(
                "budget {budget}: expected the fraction of KV pairs kept, in (0, 1] (≥ 1 keeps everything)"
            )));
        }
        let mut spec = match name {
            "full" => {
                if budget < 1.0 {
                    return Err(Error::Config(format!(
                        "budget {budget}: `full` keeps every token; budgets apply to h2o, infinigen and streaming"
                    )));
                }
                PolicySpec::Full
            }
            "h2o" => PolicySpec::H2o(H2oParams {
                budget,
                ..Default::default()
            }),
            "streaming" => PolicySpec::Streaming(StreamingParams {
                budget,
                ..Default::default()
            }),
            "infinigen" => PolicySpec::Infinigen(InfinigenParams {
                budget,
                ..Default::default()
            }),
            other => {
                return Err(Error::Config(format!(
                    "unknown engine `{other}`: expected one of {}",
                    STRATEGIES.join(", ")
                )))
            }
        };
        for (k, v) in params {
            if k == RESERVATION_KEY {
                // An engine option, not the strategy's: checked here, taken by
                // `split_reservation` into `EngineConfig::reservation`.
                v.parse::<Reservation>()?;
                continue;
            }
            spec.set(k, v)?;
        }
        Ok(spec)
    }

    /// Set one parameter.
    pub fn set(&mut self, k: &str, v: &str) -> Result<()> {
        let s = self.name();
        match self {
            PolicySpec::Full => {
                return Err(Error::Config(format!(
                    "`full` takes no parameters but `{RESERVATION_KEY}` (got `{k}={v}`)"
                )))
            }
            PolicySpec::H2o(p) => match k {
                "heavy_fraction" => {
                    p.heavy_fraction = parse_f64(s, k, v)?;
                    if !(0.0..=1.0).contains(&p.heavy_fraction) {
                        return Err(bad(s, k, v, "a fraction in [0, 1]"));
                    }
                }
                "ratio" => {
                    p.ratio = match v {
                        "total" => H2oRatio::Total,
                        "flexgen_hh" => H2oRatio::FlexgenHh,
                        _ => return Err(bad(s, k, v, "`total` or `flexgen_hh`")),
                    }
                }
                "stats" => {
                    p.stats = Some(
                        v.parse::<ColumnStats>()
                            .map_err(|_| bad(s, k, v, "`eager`, `chunked` or `exact`"))?,
                    )
                }
                "decode_update" => p.decode_update = parse_bool(s, k, v)?,
                _ => {
                    return Err(Error::Config(format!(
                        "unknown h2o parameter `{k}`: expected heavy_fraction, ratio, stats, decode_update, reservation"
                    )))
                }
            },
            PolicySpec::Streaming(p) => match k {
                "sinks" => p.sinks = parse_usize(s, k, v)?,
                "rolling_positions" => p.rolling_positions = parse_bool(s, k, v)?,
                _ => {
                    return Err(Error::Config(format!(
                        "unknown streaming parameter `{k}`: expected sinks, rolling_positions, reservation"
                    )))
                }
            },
            PolicySpec::Infinigen(p) => match k {
                "alpha" => {
                    p.alpha = parse_f64(s, k, v)?;
                    if p.alpha < 0.0 {
                        return Err(bad(s, k, v, "a threshold ≥ 0 (inf: no threshold)"));
                    }
                }
                "partial_ratio" => {
                    p.partial_ratio = parse_f64(s, k, v)?;
                    if !(p.partial_ratio > 0.0 && p.partial_ratio <= 1.0) {
                        return Err(bad(s, k, v, "a fraction in (0, 1]"));
                    }
                }
                "relative_to_current" => p.relative_to_current = parse_bool(s, k, v)?,
                "dense_layers" => {
                    p.dense_layers = parse_usize(s, k, v)?;
                    if p.dense_layers == 0 && p.speculation == Speculation::Previous {
                        return Err(bad(
                            s,
                            k,
                            v,
                            "at least 1: layer ℓ's selection is speculated in layer ℓ−1",
                        ));
                    }
                }
                "speculate" => {
                    p.speculation = match v {
                        "previous" => Speculation::Previous,
                        "oracle" => Speculation::Oracle,
                        _ => return Err(bad(s, k, v, "`previous` or `oracle`")),
                    }
                }
                "transfer" => {
                    p.transfer = match v {
                        "zero_copy" => Transfer::ZeroCopy,
                        "memcpy" => Transfer::Memcpy,
                        _ => return Err(bad(s, k, v, "`zero_copy` or `memcpy`")),
                    }
                }
                _ => {
                    return Err(Error::Config(format!(
                        "unknown infinigen parameter `{k}`: expected alpha, partial_ratio, relative_to_current, dense_layers, speculate, transfer, reservation"
                    )))
                }
            },
        }
        Ok(())
    }

    /// Parameters as JSON (reports).
    pub fn params_json(&self) -> serde_json::Value {
        match self {
            PolicySpec::Full => json!({}),
            PolicySpec::H2o(p) => json!({
                "heavy_fraction": p.heavy_fraction,
                "ratio": p.ratio,
                "stats": p.stats.map(|s| s.to_string()),
                "decode_update": p.decode_update,
            }),
            PolicySpec::Streaming(p) => json!({
                "sinks": p.sinks,
                "rolling_positions": p.rolling_positions,
            }),
            PolicySpec::Infinigen(p) => json!({
                "alpha": if p.alpha.is_finite() { json!(p.alpha) } else { json!("inf") },
                "partial_ratio": p.partial_ratio,
                "relative_to_current": p.relative_to_current,
                "dense_layers": p.dense_layers,
                "speculate": match p.speculation { Speculation::Previous => "previous", Speculation::Oracle => "oracle" },
                "transfer": p.transfer.name(),
            }),
        }
    }

    /// Build the policy for `model`.
    pub fn build(&self, model: &Llama, env: PolicyEnv) -> Result<Box<dyn KvPolicy>> {
        let cfg = &model.cfg;
        if model.device().is_cuda() {
            return self.build_cuda(model, env);
        }
        Ok(match self {
            PolicySpec::Full => {
                let opts = env.full_options();
                let num_blocks = env.kv_blocks(FullPolicy::block_bytes(cfg, &opts));
                Box::new(match env.reservation {
                    Reservation::Fraction => FullPolicy::new(cfg, opts, num_blocks),
                    Reservation::Budget => FullPolicy::on_demand(cfg, opts, num_blocks),
                })
            }
            PolicySpec::H2o(p) => Box::new(H2oPolicy::new(H2o(*p), cfg, env)),
            PolicySpec::Streaming(p) => Box::new(StreamingPolicy::new(Streaming(*p), cfg, env)),
            PolicySpec::Infinigen(p) => Box::new(InfinigenPolicy::new(p.clone(), model, env)?),
        })
    }
}

impl PolicySpec {
    /// The CUDA implementations: `full`, `h2o` and `streaming` with their pools in
    /// device memory, `infinigen` with its host tier in pinned host memory.
    #[cfg(feature = "cuda")]
    fn build_cuda(&self, model: &Llama, env: PolicyEnv) -> Result<Box<dyn KvPolicy>> {
        use crate::cuda::evicting::CudaEvictingPolicy;
        let cfg = &model.cfg;
        if model.dtype() != candle_core::DType::BF16 {
            return Err(Error::Config(format!(
                "the CUDA kernels keep K/V in bf16: load the model with bf16 weights (got {})",
                model.weight_dtype
            )));
        }
        match self {
            PolicySpec::H2o(p) => Ok(Box::new(CudaEvictingPolicy::new(
                H2o(*p),
                model.device(),
                cfg,
                env,
            )?)),
            PolicySpec::Streaming(p) => Ok(Box::new(CudaEvictingPolicy::new(
                Streaming(*p),
                model.device(),
                cfg,
                env,
            )?)),
            PolicySpec::Full => {
                let opts = env.full_options();
                let num_blocks = env.kv_blocks(FullPolicy::block_bytes(cfg, &opts));
                Ok(Box::new(crate::cuda::full::CudaFullPolicy::new(
                    model.device(),
                    cfg,
                    opts,
                    num_blocks,
                    env.reservation,
                )?))
            }
            PolicySpec::Infinigen(p) => Ok(Box::new(
                crate::cuda::infinigen::CudaInfinigenPolicy::new(p.clone(), model, env)?,
            )),
        }
    }

    #[cfg(not(feature = "cuda"))]
    fn build_cuda(&self, _model: &Llama, env: PolicyEnv) -> Result<Box<dyn KvPolicy>> {
        Err(Error::DeviceUnavailable(env.device_name))
    }
}
