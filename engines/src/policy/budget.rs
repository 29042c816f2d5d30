//! The KV budget `b` (the study's convention: the fraction of a sequence's KV pairs a
//! layer keeps on the device) turned into each strategy's token counts, exactly as
//! algorithms.md §3–7 specify. `b ≥ 1` always means "keep everything".

use serde::Serialize;

/// kvpress's convention is the fraction *removed*: `compression_ratio = 1 − b`.
pub fn kvpress_compression_ratio(budget: f64) -> f64 {
    (1.0 - budget).clamp(0.0, 1.0)
}

/// How H2O's total is split between heavy hitters and the recent window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum H2oRatio {
    /// Total `C = b·L0`, heavy = ⌊φ·C⌋, recent = the rest (kvbench default, φ = 0.5).
    Total,
    /// FlexGen's `--hh-ratio`: heavy = recent = ⌊b·L0⌋ (total 2b).
    FlexgenHh,
}

/// H2O's retained counts for a prompt of `prompt_len` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct H2oCounts {
    /// Kept after each step (the cache holds `capacity + 1` during a step).
    pub capacity: usize,
    pub heavy: usize,
    pub recent: usize,
}

/// `None` when `b ≥ 1`: no eviction.
pub fn h2o_counts(
    budget: f64,
    prompt_len: usize,
    heavy_fraction: f64,
    ratio: H2oRatio,
) -> Option<H2oCounts> {
    if budget >= 1.0 {
        return None;
    }
    let kept = (budget * prompt_len as f64).floor() as usize;
    Some(match ratio {
        H2oRatio::Total => {
            let c = kept.max(1);
            let mut heavy = (heavy_fraction * c as f64).floor() as usize;
            let mut recent = c - heavy;
            if recent == 0 {
                recent = 1;
                heavy = c - 1;
            }
            H2oCounts {
                capacity: c,
                heavy,
                recent,
            }
        }
        H2oRatio::FlexgenHh => {
            let n = kept.max(1);
            H2oCounts {
                capacity: 2 * n,
                heavy: n,
                recent: n,
            }
        }
    })
}

/// StreamingLLM: (sinks, window) with `sinks + window = max(sinks + 1, ⌊b·L0⌋)`;
/// `None` when `b ≥ 1`.
pub fn streaming_counts(budget: f64, prompt_len: usize, sinks: usize) -> Option<(usize, usize)> {
    if budget >= 1.0 {
        return None;
    }
    let total = ((budget * prompt_len as f64).floor() as usize).max(sinks + 1);
    Some((sinks, total - sinks))
}

/// InfiniGen's cap on selected tokens per layer: `⌈b·(L0 + T_max)⌉` (the originals'
/// convention), or `⌈b·n⌉` of the current length `n` when `relative_to_current`.
pub fn infinigen_k_max(
    budget: f64,
    prompt_len: usize,
    max_new_tokens: usize,
    current_len: usize,
    relative_to_current: bool,
) -> usize {
    let n = if relative_to_current {
        current_len
    } else {
        prompt_len + max_new_tokens
    };
    ((budget * n as f64).ceil() as usize).max(1)
}

/// The most tokens one InfiniGen selection of a sequence may hold over its life:
/// `k_max` at its full length `prefill_len + max_new_tokens` (the larger of the two
/// conventions when `relative_to_current`), at most that length.
pub fn infinigen_selection_cap(
    budget: f64,
    prompt_len: usize,
    max_new_tokens: usize,
    prefill_len: usize,
    relative_to_current: bool,
) -> usize {
    let n_max = prefill_len + max_new_tokens;
    let fixed = infinigen_k_max(budget, prompt_len, max_new_tokens, n_max, false);
    let relative = if relative_to_current {
        infinigen_k_max(budget, 0, 0, n_max, true)
    } else {
        0
    };
    fixed.max(relative).min(n_max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn h2o_splits_the_total_and_clamps_a_zero_window() {
        let c = h2o_counts(0.3, 1000, 0.5, H2oRatio::Total).unwrap();
        assert_eq!((c.capacity, c.heavy, c.recent), (300, 150, 150));
        let c = h2o_counts(0.3, 1001, 0.5, H2oRatio::Total).unwrap();
        assert_eq!((c.capacity, c.heavy, c.recent), (300, 150, 150));
        // Budget smaller than one token: C = 1, all of it the recent window.
        let c = h2o_counts(0.001, 100, 0.5, H2oRatio::Total).unwrap();
        assert_eq!((c.capacity, c.heavy, c.recent), (1, 0, 1));
        // φ = 1 would leave no window: R = 1, Hh = C − 1.
        let c = h2o_counts(0.1, 100, 1.0, H2oRatio::Total).unwrap();
        assert_eq!((c.capacity, c.heavy, c.recent), (10, 9, 1));
        let c = h2o_counts(0.3, 1000, 0.5, H2oRatio::FlexgenHh).unwrap();
        assert_eq!((c.capacity, c.heavy, c.recent), (600, 300, 300));
        assert!(h2o_counts(1.0, 1000, 0.5, H2oRatio::Total).is_none());
    }

    #[test]
    fn streaming_and_infinigen_counts() {
        assert_eq!(streaming_counts(0.1, 1000, 4), Some((4, 96)));
        assert_eq!(streaming_counts(0.001, 1000, 4), Some((4, 1)));
        assert_eq!(streaming_counts(1.0, 1000, 4), None);
        assert_eq!(infinigen_k_max(0.3, 10_000, 0, 0, false), 3000);
        assert_eq!(infinigen_k_max(0.3, 1000, 1, 5000, false), 301);
        assert_eq!(infinigen_k_max(0.3, 1000, 1, 5000, true), 1500);
        assert!((kvpress_compression_ratio(0.3) - 0.7).abs() < 1e-12);
    }
}
