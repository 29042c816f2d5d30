//! `streaming`: StreamingLLM's attention sinks plus a sliding window (algorithms.md
//! §5). With rolling positions (the original) keys are cached without RoPE and rotated
//! by their index in the cache at every step, so positions never exceed S + W; without,
//! keys keep their true positions.

use crate::attention::prefill::{AttentionImpl, ColumnStats};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::kv::KvCodec;
use crate::model::Llama;
use crate::policy::budget::streaming_counts;
use crate::policy::evicting::{Counts, EvictingPolicy, Eviction, VictimKind};
use crate::policy::registry::{
    parse_bool, parse_usize, unknown, Param, Strategy, StrategyParams, Variant,
};
use crate::policy::spec::PolicyEnv;
use crate::policy::{KvPolicy, SeqInfo};
use serde_json::json;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StreamingParams {
    pub budget: f64,
    /// Attention sinks S (default 4).
    pub sinks: usize,
    pub rolling_positions: bool,
}

impl Default for StreamingParams {
    fn default() -> Self {
        Self {
            budget: 1.0,
            sinks: 4,
            rolling_positions: true,
        }
    }
}

impl StrategyParams for StreamingParams {
    const STRATEGY: &'static Strategy = &Strategy {
        name: "streaming",
        about: "attention sinks plus a sliding window (StreamingLLM)",
        params: &[
            Param {
                key: "sinks",
                values: "an integer ≥ 0; default 4",
                about: "attention sinks S kept at the start",
            },
            Param {
                key: "rolling_positions",
                values: "true (default) or false",
                about: "keys rotated by their index in the cache at every step (the original); false keeps true positions",
            },
        ],
        budgeted: true,
        verify: &[
            Variant::DEFAULT,
            Variant::both(&[("rolling_positions", "false")]),
        ],
        audit: &[
            Variant::DEFAULT,
            Variant::cuda(&[("rolling_positions", "false")]),
        ],
        bench: &[],
        cuda: true,
        kv_codec: true,
    };

    fn at_budget(budget: f64) -> Result<Self> {
        Ok(Self {
            budget,
            ..Default::default()
        })
    }

    fn budget(&self) -> f64 {
        self.budget
    }

    fn set(&mut self, k: &str, v: &str) -> Result<()> {
        let s = Self::STRATEGY.name;
        match k {
            "sinks" => self.sinks = parse_usize(s, k, v)?,
            "rolling_positions" => self.rolling_positions = parse_bool(s, k, v)?,
            _ => return Err(unknown(Self::STRATEGY, k)),
        }
        Ok(())
    }

    fn params_json(&self) -> serde_json::Value {
        json!({
            "sinks": self.sinks,
            "rolling_positions": self.rolling_positions,
        })
    }

    fn build(&self, model: &Llama, env: PolicyEnv) -> Result<Box<dyn KvPolicy>> {
        Ok(Box::new(StreamingPolicy::new(
            Streaming(*self),
            &model.cfg,
            env,
        )))
    }

    #[cfg(feature = "cuda")]
    fn build_cuda(&self, model: &Llama, env: PolicyEnv) -> Result<Box<dyn KvPolicy>> {
        Ok(Box::new(
            crate::policy::evicting::cuda::CudaEvictingPolicy::new(
                Streaming(*self),
                model.device(),
                &model.cfg,
                env,
            )?,
        ))
    }

    fn nominal_attended(&self, _layer: usize, info: &SeqInfo, n: usize) -> usize {
        streaming_counts(self.budget, info.prompt_len, self.sinks)
            .map_or(n, |(s, w)| (s + w + 1).min(n))
    }

    fn device_kv_bytes(
        &self,
        cfg: &ModelConfig,
        info: &SeqInfo,
        n: usize,
        kv: KvCodec,
        _statistic: usize,
    ) -> u64 {
        let kept = streaming_counts(self.budget, info.prompt_len, self.sinks)
            .map_or(n, |(s, w)| (s + w).min(n));
        kept as u64 * kv.token_bytes(cfg)
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Streaming(pub StreamingParams);

pub type StreamingPolicy = EvictingPolicy<Streaming>;

impl Eviction for Streaming {
    fn victim_kind(&self) -> VictimKind {
        VictimKind::OldestAfterSinks
    }

    fn name(&self) -> &'static str {
        "streaming"
    }

    fn counts(&self, info: &SeqInfo) -> Option<Counts> {
        streaming_counts(self.0.budget, info.prompt_len, self.0.sinks).map(|(s, w)| Counts {
            capacity: s + w,
            recent: w,
        })
    }

    fn prefill_stats(&self, _attention: AttentionImpl) -> Option<ColumnStats> {
        None
    }

    fn decode_probs(&self) -> bool {
        false
    }

    fn rolling_positions(&self) -> bool {
        self.0.rolling_positions
    }

    fn prefill_keep(&self, c: Counts, n: usize, _score: &[f32]) -> Vec<usize> {
        let sinks = c.capacity - c.recent;
        (0..sinks.min(n)).chain(n - c.recent..n).collect()
    }

    fn victim(&self, c: Counts, _n: usize, pos: &[u32], _score: &[f32]) -> usize {
        // The oldest token that is not a sink: the one leaving the window.
        let sinks = (c.capacity - c.recent) as u32;
        pos.iter()
            .enumerate()
            .filter(|(_, &p)| p >= sinks)
            .min_by_key(|(_, &p)| p)
            .map_or(0, |(i, _)| i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_sinks_and_the_last_window() {
        let rule = Streaming(StreamingParams::default());
        let c = Counts {
            capacity: 7,
            recent: 3,
        };
        assert_eq!(rule.prefill_keep(c, 20, &[]), vec![0, 1, 2, 3, 17, 18, 19]);
        // Slots hold sinks, then a rotated window: position 17 leaves.
        let pos = [0, 1, 2, 3, 19, 17, 18, 20];
        assert_eq!(rule.victim(c, 21, &pos, &[]), 5);
    }
}
