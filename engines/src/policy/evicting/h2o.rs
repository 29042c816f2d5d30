//! `h2o`: heavy hitters by accumulated attention plus a recent window, permanent
//! eviction (algorithms.md §3). Per KV head, scores summed over the query heads of its
//! group, in f32, never across the batch; one eviction per (layer, head) per decode
//! step once the cache holds C+1 tokens, after the step's attention.

use crate::attention::prefill::{AttentionImpl, ColumnStats};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::kv::KvCodec;
use crate::model::Llama;
use crate::policy::budget::{h2o_counts, H2oRatio};
use crate::policy::evicting::{Counts, EvictingPolicy, Eviction, VictimKind};
use crate::policy::registry::{
    bad, parse_bool, parse_f64, unknown, Param, Strategy, StrategyParams, Variant,
};
use crate::policy::spec::PolicyEnv;
use crate::policy::{KvPolicy, SeqInfo};
use serde_json::json;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct H2oParams {
    /// Fraction of the sequence's KV pairs kept (`b ≥ 1`: no eviction).
    pub budget: f64,
    /// Heavy-hitter share φ of the kept tokens (default 0.5).
    pub heavy_fraction: f64,
    pub ratio: H2oRatio,
    /// Prefill statistics; `None`: follow the attention implementation (eager →
    /// eager, chunked → chunked, flash → exact).
    pub stats: Option<ColumnStats>,
    /// Keep evicting by score during decode (the originals); `false` freezes the
    /// prefill's heavy hitters and lets only the window slide.
    pub decode_update: bool,
}

impl Default for H2oParams {
    fn default() -> Self {
        Self {
            budget: 1.0,
            heavy_fraction: 0.5,
            ratio: H2oRatio::Total,
            stats: None,
            decode_update: true,
        }
    }
}

impl StrategyParams for H2oParams {
    const STRATEGY: &'static Strategy = &Strategy {
        name: "h2o",
        about:
            "heavy hitters by accumulated attention plus a recent window, permanent eviction (H2O)",
        params: &[
            Param {
                key: "heavy_fraction",
                values: "a fraction in [0, 1]; default 0.5",
                about: "share φ of the kept tokens that are heavy hitters",
            },
            Param {
                key: "ratio",
                values: "`total` (default) or `flexgen_hh`",
                about: "how b splits into heavy and recent: C = b·L0, or FlexGen's b·L0 each",
            },
            Param {
                key: "stats",
                values: "`eager`, `chunked` or `exact`; default follows the attention",
                about: "prefill column statistics",
            },
            Param {
                key: "decode_update",
                values: "true (default) or false",
                about:
                    "keep evicting by score in decode; false freezes the prefill's heavy hitters",
            },
        ],
        budgeted: true,
        verify: &[Variant::DEFAULT],
        audit: &[Variant::DEFAULT, Variant::cuda(&[("stats", "eager")])],
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
            "heavy_fraction" => {
                self.heavy_fraction = parse_f64(s, k, v)?;
                if !(0.0..=1.0).contains(&self.heavy_fraction) {
                    return Err(bad(s, k, v, "a fraction in [0, 1]"));
                }
            }
            "ratio" => {
                self.ratio = match v {
                    "total" => H2oRatio::Total,
                    "flexgen_hh" => H2oRatio::FlexgenHh,
                    _ => return Err(bad(s, k, v, "`total` or `flexgen_hh`")),
                }
            }
            "stats" => {
                self.stats = Some(
                    v.parse::<ColumnStats>()
                        .map_err(|_| bad(s, k, v, "`eager`, `chunked` or `exact`"))?,
                )
            }
            "decode_update" => self.decode_update = parse_bool(s, k, v)?,
            _ => return Err(unknown(Self::STRATEGY, k)),
        }
        Ok(())
    }

    fn params_json(&self) -> serde_json::Value {
        json!({
            "heavy_fraction": self.heavy_fraction,
            "ratio": self.ratio,
            "stats": self.stats.map(|s| s.to_string()),
            "decode_update": self.decode_update,
        })
    }

    fn build(&self, model: &Llama, env: PolicyEnv) -> Result<Box<dyn KvPolicy>> {
        Ok(Box::new(H2oPolicy::new(H2o(*self), &model.cfg, env)))
    }

    #[cfg(feature = "cuda")]
    fn build_cuda(&self, model: &Llama, env: PolicyEnv) -> Result<Box<dyn KvPolicy>> {
        Ok(Box::new(
            crate::policy::evicting::cuda::CudaEvictingPolicy::new(
                H2o(*self),
                model.device(),
                &model.cfg,
                env,
            )?,
        ))
    }

    fn nominal_attended(&self, _layer: usize, info: &SeqInfo, n: usize) -> usize {
        h2o_counts(
            self.budget,
            info.prompt_len,
            self.heavy_fraction,
            self.ratio,
        )
        .map_or(n, |c| (c.capacity + 1).min(n))
    }

    fn device_kv_bytes(
        &self,
        cfg: &ModelConfig,
        info: &SeqInfo,
        n: usize,
        kv: KvCodec,
        _statistic: usize,
    ) -> u64 {
        let kept = h2o_counts(
            self.budget,
            info.prompt_len,
            self.heavy_fraction,
            self.ratio,
        )
        .map_or(n, |c| c.capacity.min(n));
        kept as u64 * kv.token_bytes(cfg)
    }
}

/// The H2O eviction rule.
#[derive(Debug, Clone, Copy)]
pub struct H2o(pub H2oParams);

pub type H2oPolicy = EvictingPolicy<H2o>;

/// Total order of rule 2 (algorithms.md §1): higher score first, then older.
fn better(sa: f32, pa: usize, sb: f32, pb: usize) -> bool {
    sa > sb || (sa == sb && pa < pb)
}

impl Eviction for H2o {
    fn name(&self) -> &'static str {
        "h2o"
    }

    fn victim_kind(&self) -> VictimKind {
        if self.0.decode_update {
            VictimKind::LowestScore
        } else {
            VictimKind::NewestOutsideWindow
        }
    }

    fn counts(&self, info: &SeqInfo) -> Option<Counts> {
        let p = &self.0;
        h2o_counts(p.budget, info.prompt_len, p.heavy_fraction, p.ratio).map(|c| Counts {
            capacity: c.capacity,
            recent: c.recent,
        })
    }

    fn prefill_stats(&self, attention: AttentionImpl) -> Option<ColumnStats> {
        Some(self.0.stats.unwrap_or(match attention {
            AttentionImpl::Eager => ColumnStats::Eager,
            AttentionImpl::Chunked => ColumnStats::Chunked,
            AttentionImpl::Flash => ColumnStats::Exact,
        }))
    }

    fn decode_probs(&self) -> bool {
        true
    }

    fn keeps_top_scores(&self) -> bool {
        true
    }

    fn prefill_keep(&self, c: Counts, n: usize, score: &[f32]) -> Vec<usize> {
        let recent = c.recent.min(c.capacity).min(n);
        let heavy = c.capacity - recent;
        let mut old = super::first_k((0..n - recent).collect(), heavy, |&a, &b| {
            if better(score[a], a, score[b], b) {
                std::cmp::Ordering::Less
            } else if better(score[b], b, score[a], a) {
                std::cmp::Ordering::Greater
            } else {
                std::cmp::Ordering::Equal
            }
        });
        old.extend(n - recent..n);
        old.sort_unstable();
        old
    }

    fn victim(&self, c: Counts, n: usize, pos: &[u32], score: &[f32]) -> usize {
        // Candidates: everything older than the R most recent positions.
        let window_start = n.saturating_sub(c.recent);
        let mut best: Option<usize> = None;
        for (i, &p) in pos.iter().enumerate() {
            if (p as usize) >= window_start {
                continue;
            }
            best = Some(match best {
                None => i,
                Some(b) if self.0.decode_update => {
                    // Lowest score; ties: the newest goes.
                    if score[i] < score[b] || (score[i] == score[b] && p > pos[b]) {
                        i
                    } else {
                        b
                    }
                }
                // Frozen heavy hitters: the token that just left the window goes.
                Some(b) => {
                    if p > pos[b] {
                        i
                    } else {
                        b
                    }
                }
            });
        }
        // With R ≥ 1 and C + 1 slots there is always a candidate; fall back to the
        // oldest slot if the window covered everything.
        best.unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_keeps_the_window_and_the_top_scores_with_ties_to_the_older() {
        let rule = H2o(H2oParams::default());
        let c = Counts {
            capacity: 4,
            recent: 2,
        };
        let score = [0.5, 3.0, 1.0, 3.0, 9.0, 0.1, 0.2];
        // Window: 5, 6. Heavy: 4 (9.0), then 1 and 3 tie at 3.0 → the older (1).
        assert_eq!(rule.prefill_keep(c, 7, &score), vec![1, 4, 5, 6]);
    }

    /// The selection keeps exactly the set a full sort by (score, then the older)
    /// keeps, at every capacity, with many ties among the scores.
    #[test]
    fn prefill_keep_by_selection_equals_the_sorted_choice() {
        use rand::{Rng, SeedableRng};
        let rule = H2o(H2oParams::default());
        // The CUDA storage decides this rule on the device (`h2o_prefill_keep`) on the
        // strength of the flag: the rule below is what that kernel implements.
        assert!(rule.keeps_top_scores());
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for n in [1usize, 2, 17, 300] {
            // Eight distinct values: most scores tie with others.
            let score: Vec<f32> = (0..n).map(|_| rng.random_range(0..8) as f32).collect();
            for capacity in 1..=n {
                for recent in [0, 1, capacity / 2, capacity] {
                    let c = Counts { capacity, recent };
                    let recent = recent.min(capacity).min(n);
                    let mut sorted: Vec<usize> = (0..n - recent).collect();
                    sorted
                        .sort_by(|&a, &b| score[b].partial_cmp(&score[a]).unwrap().then(a.cmp(&b)));
                    sorted.truncate(capacity - recent);
                    sorted.extend(n - recent..n);
                    sorted.sort_unstable();
                    assert_eq!(rule.prefill_keep(c, n, &score), sorted, "n {n} c {c:?}");
                }
            }
        }
    }

    #[test]
    fn decode_evicts_the_lowest_score_outside_the_window_newest_on_ties() {
        let rule = H2o(H2oParams::default());
        let c = Counts {
            capacity: 4,
            recent: 2,
        };
        // n = 10: window is positions 8, 9.
        let pos = [1, 4, 7, 8, 9];
        let score = [2.0, 0.5, 0.5, 0.0, 0.0];
        assert_eq!(rule.victim(c, 10, &pos, &score), 2);
        let frozen = H2o(H2oParams {
            decode_update: false,
            ..H2oParams::default()
        });
        assert_eq!(frozen.victim(c, 10, &pos, &[0.0, 9.0, 9.0, 0.0, 0.0]), 2);
    }
}
