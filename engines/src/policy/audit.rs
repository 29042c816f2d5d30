//! The budget audit: what each strategy may attend per layer and hold on the device at
//! budget `b`, computed from algorithms.md's formulas independently of the policies'
//! own bookkeeping. The engine checks every decode step against it, so a strategy that
//! silently keeps (or reads) everything fails the run instead of looking cheap.
//!
//! Margins, stated: attended tokens must not exceed the nominal count at all; device
//! bytes may exceed the nominal bytes by one block of tokens (paged allocation rounds
//! up) plus 1 %.

use super::spec::PolicySpec;
use super::SeqInfo;
use crate::config::ModelConfig;
use crate::kv::KvCodec;

/// Relative slack on device bytes.
pub const BYTES_MARGIN: f64 = 0.01;

/// Keys one decode query of `layer` may attend with `n` tokens of context (its own
/// included), from the strategy's own formula (its `StrategyParams`).
pub fn nominal_attended(spec: &PolicySpec, layer: usize, info: &SeqInfo, n: usize) -> usize {
    spec.params().nominal_attended(layer, info, n)
}

/// Device KV bytes one sequence may hold after a decode step with `n` tokens of
/// context, the CPU policy storing K/V as it does (the engine's `kv_codec` option
/// `chosen`, else its own given the model's compute dtype `model`) and statistics in
/// f32, before the margin.
pub fn nominal_device_bytes(
    spec: &PolicySpec,
    cfg: &ModelConfig,
    info: &SeqInfo,
    n: usize,
    model: KvCodec,
    chosen: Option<KvCodec>,
) -> u64 {
    device_kv_bytes(
        spec,
        cfg,
        info,
        n,
        spec.params().cpu_kv_codec(model, chosen),
        4,
    )
}

/// Device KV bytes of one sequence after a step with `n` tokens of context, its K/V
/// rows stored as `kv` says and statistics (InfiniGen's partial keys) in
/// `statistic` bytes: the audit's bound ([`nominal_device_bytes`]) and the cost
/// model's memory.
pub fn device_kv_bytes(
    spec: &PolicySpec,
    cfg: &ModelConfig,
    info: &SeqInfo,
    n: usize,
    kv: KvCodec,
    statistic: usize,
) -> u64 {
    spec.params().device_kv_bytes(cfg, info, n, kv, statistic)
}

/// Allowed device bytes: nominal, one block of tokens and the relative margin.
pub fn allowed_device_bytes(nominal: u64, block_size: usize, token_bytes: u64) -> u64 {
    (nominal as f64 * (1.0 + BYTES_MARGIN)) as u64 + block_size as u64 * token_bytes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::evicting::h2o::H2oParams;
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
        assert_eq!(nominal_attended(&PolicySpec::full(), 5, &info, 1050), 1050);
        let ig = PolicySpec::Infinigen(InfinigenParams {
            budget: 0.3,
            ..Default::default()
        });
        assert_eq!(nominal_attended(&ig, 0, &info, 1050), 1050);
        assert_eq!(nominal_attended(&ig, 2, &info, 1050), 331);
    }
}
