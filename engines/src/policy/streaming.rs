//! `streaming`: StreamingLLM's attention sinks plus a sliding window (algorithms.md
//! §5). With rolling positions (the original) keys are cached without RoPE and rotated
//! by their index in the cache at every step, so positions never exceed S + W; without,
//! keys keep their true positions.

use super::budget::streaming_counts;
use super::evicting::{Counts, EvictingPolicy, Eviction, VictimKind};
use super::SeqInfo;
use crate::attention::prefill::{AttentionImpl, ColumnStats};

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
