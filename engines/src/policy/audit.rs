//! The budget audit: what each strategy may attend per layer and hold on the device at
//! budget `b`, computed from algorithms.md's formulas independently of the policies'
//! own bookkeeping. The engine checks every decode step against it, so a strategy that
//! silently keeps (or reads) everything fails the run instead of looking cheap.
//!
//! Margins, stated: attended tokens must not exceed the nominal count at all; device
//! bytes may exceed the nominal bytes by one block of tokens (paged allocation rounds
//! up) plus 1 %.

use super::budget::{h2o_counts, infinigen_k_max, infinigen_selection_cap, streaming_counts};
use super::spec::PolicySpec;
use super::SeqInfo;
use crate::config::ModelConfig;

/// Relative slack on device bytes.
pub const BYTES_MARGIN: f64 = 0.01;

/// Keys one decode query of `layer` may attend with `n` tokens of context (its own
/// included).
pub fn nominal_attended(spec: &PolicySpec, layer: usize, info: &SeqInfo, n: usize) -> usize {
    match spec {
        PolicySpec::Full => n,
        PolicySpec::H2o(p) => h2o_counts(p.budget, info.prompt_len, p.heavy_fraction, p.ratio)
            .map_or(n, |c| (c.capacity + 1).min(n)),
        PolicySpec::Streaming(p) => streaming_counts(p.budget, info.prompt_len, p.sinks)
            .map_or(n, |(s, w)| (s + w + 1).min(n)),
        PolicySpec::Infinigen(p) => {
            if layer < p.dense_layers {
                n
            } else {
                let k = infinigen_k_max(
                    p.budget,
                    info.prompt_len,
                    info.max_new_tokens,
                    n,
                    p.relative_to_current,
                );
                (k + 1).min(n)
            }
        }
    }
}

/// Device KV bytes one sequence may hold after a decode step with `n` tokens of
/// context, for strategies whose storage is f32 slots (`h2o`, `streaming`,
/// `infinigen` on CPU) or `elem` bytes (`full`), before the margin.
pub fn nominal_device_bytes(
    spec: &PolicySpec,
    cfg: &ModelConfig,
    info: &SeqInfo,
    n: usize,
    elem: usize,
) -> u64 {
    let kv = match spec {
        PolicySpec::Full => elem,
        _ => 4,
    };
    device_kv_bytes(spec, cfg, info, n, kv, 4)
}

/// Device KV bytes of one sequence after a step with `n` tokens of context, its K/V
/// rows stored in `kv` bytes per element and InfiniGen's partial keys in `statistic`
/// bytes: the audit's bound ([`nominal_device_bytes`]) and the cost model's memory.
pub fn device_kv_bytes(
    spec: &PolicySpec,
    cfg: &ModelConfig,
    info: &SeqInfo,
    n: usize,
    kv: usize,
    statistic: usize,
) -> u64 {
    let token = |layers: usize| (2 * layers * cfg.num_kv_heads * cfg.head_dim * kv) as u64;
    let d = cfg.num_layers;
    match spec {
        PolicySpec::Full => n as u64 * token(d),
        PolicySpec::H2o(p) => {
            let kept = h2o_counts(p.budget, info.prompt_len, p.heavy_fraction, p.ratio)
                .map_or(n, |c| c.capacity.min(n));
            kept as u64 * token(d)
        }
        PolicySpec::Streaming(p) => {
            let kept = streaming_counts(p.budget, info.prompt_len, p.sinks)
                .map_or(n, |(s, w)| (s + w).min(n));
            kept as u64 * token(d)
        }
        PolicySpec::Infinigen(p) => {
            let dense = p.dense_layers.min(d);
            let off = (d - dense) as u64;
            let (hkv, dh) = (cfg.num_kv_heads as u64, cfg.head_dim as u64);
            let r = ((p.partial_ratio * cfg.head_dim as f64).floor() as u64).clamp(1, dh);
            let n_max = (info.prefill_len + info.max_new_tokens) as u64;
            let cap = infinigen_selection_cap(
                p.budget,
                info.prompt_len,
                info.max_new_tokens,
                info.prefill_len,
                p.relative_to_current,
            ) as u64;
            let staging = if off == 0 {
                0
            } else {
                2 * 2 * hkv * cap * dh * kv as u64
            };
            n as u64 * token(dense) + off * hkv * (n_max * r + dh * r) * statistic as u64 + staging
        }
    }
}

/// Allowed device bytes: nominal, one block of tokens and the relative margin.
pub fn allowed_device_bytes(nominal: u64, block_size: usize, token_bytes: u64) -> u64 {
    (nominal as f64 * (1.0 + BYTES_MARGIN)) as u64 + block_size as u64 * token_bytes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::h2o::H2oParams;
    use crate::policy::infinigen::InfinigenParams;

    #[test]
    fn nominal_counts_follow_the_budget() {
        let info = SeqInfo {
            prompt_len: 1000,
            max_new_tokens: 100,
            prefill_len: 1000,
        };
        let h2o = PolicySpec::H2o(H2oParams {
            budget: 0.3,
            ..Default::default()
        });
        assert_eq!(nominal_attended(&h2o, 5, &info, 1050), 301);
        assert_eq!(nominal_attended(&PolicySpec::Full, 5, &info, 1050), 1050);
        let ig = PolicySpec::Infinigen(InfinigenParams {
            budget: 0.3,
            ..Default::default()
        });
        assert_eq!(nominal_attended(&ig, 0, &info, 1050), 1050);
        assert_eq!(nominal_attended(&ig, 2, &info, 1050), 331);
    }
}
