//! Memory held by component, per GPU, and the out-of-memory check in the ledger's
//! order (docs/cost-model.md §4).

use super::DeviceKind;
use super::{CostError, Result, Setup};
use crate::attention::prefill::{
    cuda_scratch_bytes, scratch_bytes, AttentionImpl, ColumnStats, PrefillShape,
};
use crate::engine::planned_kv_bytes;
use crate::error::Component;
use crate::kv::PagedKv;
use crate::ledger::MemoryReport;
use crate::model::activation_bytes;
use crate::policy::audit::device_kv_bytes;
use crate::policy::evicting::h2o::H2o;
use crate::policy::evicting::Eviction;
use crate::policy::spec::{PolicySpec, Reservation};
use crate::policy::SeqInfo;
use serde::Serialize;

/// What a run holds at once, as the engine would configure it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryInputs {
    /// Sequences held at once.
    pub sequences: usize,
    /// Sequences prefilled in the same forward (1: the study's sequential prefill).
    pub prefill_sequences: usize,
    pub info: SeqInfo,
    /// Device capacity (one GPU).
    pub capacity: u64,
    /// vLLM's `gpu_memory_utilization`.
    pub memory_fraction: f64,
    pub max_model_len: usize,
    pub max_num_seqs: usize,
    pub max_batched_tokens: usize,
    /// Host bytes an offloading policy may use (`None`: as much as the device pool,
    /// the engine's default).
    pub host_memory: Option<u64>,
}

/// Memory held, the pool, and the outcome.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MemoryHeld {
    pub report: MemoryReport,
    /// Bytes the engine plans for KV (`full` reserves all of them up front).
    pub kv_pool: u64,
    /// Sequences the KV memory can hold at once (`full`: the pool's blocks).
    pub concurrency: usize,
    /// `None` when everything fits; else the component whose reservation fails.
    pub oom: Option<Oom>,
}

/// A failed reservation, as the ledger reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Oom {
    pub component: Component,
    pub requested: u64,
    pub available: u64,
    pub capacity: u64,
}

/// Bytes of one block of the paged pool, all layers (the pool's own function).
pub fn block_bytes(s: &Setup) -> Result<u64> {
    let c = &s.model;
    Ok(PagedKv::block_bytes(
        c.num_layers,
        s.block_size,
        c.num_kv_heads,
        c.head_dim,
        s.full_kv(),
    ))
}

/// Device KV bytes of one sequence after a step with `n` tokens of context: the budget
/// audit's own count ([`device_kv_bytes`]) with the rows as the engine stores them
/// ([`Setup::kv`]) and the statistics of `s.precision`.
pub fn kv_device_bytes(s: &Setup, info: &SeqInfo, n: usize) -> u64 {
    device_kv_bytes(&s.policy, &s.model, info, n, s.kv(), s.precision.statistic)
}

/// Host KV bytes of one sequence: InfiniGen's host tier holds every token of the
/// offloaded layers, in blocks; the others hold nothing on the host.
pub fn kv_host_bytes(s: &Setup, info: &SeqInfo) -> u64 {
    let c = &s.model;
    match &s.policy {
        PolicySpec::Hybrid(q) => kv_host_bytes(&s.routed(q.route(info)), info),
        PolicySpec::Infinigen(q) => {
            let off = c.num_layers - q.dense_layers.min(c.num_layers);
            let tokens =
                (info.prefill_len + info.max_new_tokens).div_ceil(s.block_size) * s.block_size;
            tokens as u64 * s.kv().token_bytes(c) / c.num_layers as u64 * off as u64
        }
        _ => 0,
    }
}

/// Activation bytes of the engine's start-up profile: the largest step the scheduler
/// can build (`max_batched_tokens` rows, `min(max_num_seqs, max_batched_tokens)`
/// sampled), as `Engine::new` reserves it.
pub fn profile_activations(s: &Setup, max_num_seqs: usize, max_batched_tokens: usize) -> u64 {
    activation_bytes(
        &s.model,
        s.precision.activation,
        max_batched_tokens,
        max_num_seqs.min(max_batched_tokens),
    )
}

/// The KV pool `Engine::new` plans ([`planned_kv_bytes`]): `⌊(capacity·fraction −
/// weights − profile) / block⌋` blocks.
pub fn kv_pool_bytes(s: &Setup, m: &MemoryInputs, weights: u64) -> Result<u64> {
    let non_kv = weights + profile_activations(s, m.max_num_seqs, m.max_batched_tokens);
    Ok(planned_kv_bytes(
        m.capacity,
        m.memory_fraction,
        None,
        non_kv,
        block_bytes(s)?,
    ))
}

/// Largest activation footprint of a prefill forward of `rows` rows of one sequence
/// whose context reaches `n`: the model's activations plus the attention scratch
/// (score matrices) of one call.
pub fn prefill_activations(s: &Setup, rows: usize, n: usize, sampled: usize) -> u64 {
    let c = &s.model;
    let shape = PrefillShape {
        num_heads: c.num_heads,
        num_kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
    };
    let stats: Option<ColumnStats> = match &s.policy {
        PolicySpec::H2o(q) => H2o(*q).prefill_stats(s.attention),
        // The long side's (the larger scratch).
        PolicySpec::Hybrid(q) => match &*q.long {
            PolicySpec::H2o(h) => H2o(*h).prefill_stats(s.attention),
            _ => None,
        },
        _ => None,
    };
    let imp: AttentionImpl = s.attention;
    let scratch = match s.backend {
        DeviceKind::Cpu => scratch_bytes(rows, n, shape, imp, s.chunk_size, stats),
        DeviceKind::Gpu => cuda_scratch_bytes(rows, n, shape, imp, s.chunk_size, stats),
    };
    activation_bytes(c, s.precision.activation, rows, sampled) + scratch
}

/// Memory held by component on one GPU (`s.model` is the shard) and whether each
/// reservation fits, in the ledger's order: weights, the start-up profile, the KV
/// pool (`full`: all of it, and one `max_model_len` sequence must fit), then the
/// largest step's activations over the KV held, then the host tier.
pub fn memory_held(s: &Setup, m: &MemoryInputs) -> Result<MemoryHeld> {
    s.check()?;
    if m.sequences == 0 || m.info.prefill_len == 0 {
        return Err(CostError::Invalid(
            "memory of no sequences or of an empty prompt".into(),
        ));
    }
    if !(m.memory_fraction > 0.0 && m.memory_fraction <= 1.0) {
        return Err(CostError::Invalid(format!(
            "memory fraction {} must be in (0, 1]",
            m.memory_fraction
        )));
    }
    let c = &s.model;
    let weights = c.num_params() * s.precision.weight as u64;
    let cap = m.capacity;
    let oom = |component, requested: u64, used: u64| Oom {
        component,
        requested,
        available: cap.saturating_sub(used),
        capacity: cap,
    };
    let profile = profile_activations(s, m.max_num_seqs, m.max_batched_tokens);
    let pool = kv_pool_bytes(s, m, weights)?;
    let info = m.info;
    let n_final = info.prefill_len + info.max_new_tokens;
    let l0 = info.prefill_len;
    // Largest activations: a prefill forward, or a decode step of every sequence.
    let prefill_rows = (m.prefill_sequences.max(1) * l0).min(m.max_batched_tokens.max(1));
    let per_seq_rows = prefill_rows.min(l0);
    let act_prefill = prefill_activations(s, per_seq_rows, l0, 1)
        + activation_bytes(c, s.precision.activation, prefill_rows - per_seq_rows, 0);
    let act_decode = activation_bytes(c, s.precision.activation, m.sequences, m.sequences);
    let act = act_prefill.max(act_decode);

    let (kv_device, concurrency) = match &s.policy {
        PolicySpec::Full(_) => {
            let per_seq = n_final.div_ceil(s.block_size) as u64 * block_bytes(s)?;
            let conc = (pool / per_seq.max(1)) as usize;
            (pool, conc.min(m.sequences).min(m.max_num_seqs))
        }
        _ => {
            // Sequences prefilled now hold their whole prompt (evicted after); the
            // others hold their budget at the final length.
            let pre = m.prefill_sequences.clamp(1, m.sequences.max(1));
            let full_prompt = kv_device_bytes(
                &Setup {
                    policy: PolicySpec::full(),
                    ..s.clone()
                },
                &info,
                l0,
            )
            .max(kv_device_bytes(s, &info, l0));
            let kept = kv_device_bytes(s, &info, n_final);
            let peak = |k: usize| {
                let p = pre.min(k);
                p as u64 * full_prompt.max(kept) + (k - p) as u64 * kept
            };
            // The pool grows on demand up to the plan: past it `reserve` fails and the
            // scheduler preempts or waits, so fewer sequences run at once. Only a
            // sequence that cannot fit alone is out of memory.
            let mut conc = m.sequences.min(m.max_num_seqs).max(1);
            if peak(conc) > pool {
                let (mut lo, mut hi) = (1, conc);
                while lo < hi {
                    let mid = (lo + hi).div_ceil(2);
                    if peak(mid) <= pool {
                        lo = mid;
                    } else {
                        hi = mid - 1;
                    }
                }
                conc = lo;
            }
            (peak(conc), conc)
        }
    };
    let kv_host = kv_host_bytes(s, &info) * m.sequences as u64;
    let report = MemoryReport {
        weights,
        kv_device,
        kv_host,
        activations_peak: act.max(profile),
        transfer_buffers: 0,
        // The model predicts each strategy under its paradigm's own reservation: the
        // pool up front for `full`, what the batch needs for the others.
        reservation: Some(Reservation::default_for(&s.policy)),
        kv_codec: s.policy.strategy().kv_codec.then(|| s.kv()),
    };
    let mut held = MemoryHeld {
        report,
        kv_pool: pool,
        concurrency,
        oom: None,
    };
    held.oom = if weights > cap {
        Some(oom(Component::Weights, weights, 0))
    } else if weights + profile > cap {
        Some(oom(Component::Activations, profile, weights))
    } else if matches!(s.policy, PolicySpec::Full(_))
        && pool < m.max_model_len.div_ceil(s.block_size) as u64 * block_bytes(s)?
    {
        // As `Engine::new`: the pool must hold one `max_model_len` sequence.
        Some(Oom {
            component: Component::KvDevice,
            requested: m.max_model_len.div_ceil(s.block_size) as u64 * block_bytes(s)?,
            available: pool,
            capacity: cap,
        })
    } else if !matches!(s.policy, PolicySpec::Full(_)) && kv_device > pool {
        // One sequence alone needs more than the pool may grow to.
        Some(Oom {
            component: Component::KvDevice,
            requested: kv_device,
            available: pool,
            capacity: cap,
        })
    } else if weights + kv_device > cap {
        Some(oom(Component::KvDevice, kv_device, weights))
    } else if weights + kv_device + act > cap {
        Some(oom(Component::Activations, act, weights + kv_device))
    } else {
        let host_cap = m.host_memory.unwrap_or(pool);
        (kv_host > host_cap).then_some(Oom {
            component: Component::KvHost,
            requested: kv_host,
            available: host_cap,
            capacity: host_cap,
        })
    };
    Ok(held)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::Precision;
    use crate::policy::audit::nominal_device_bytes;
    use crate::policy::evicting::h2o::H2oParams;
    use crate::policy::evicting::streaming::StreamingParams;
    use crate::policy::infinigen::InfinigenParams;

    #[test]
    fn kv_bytes_equal_the_audits_and_the_pools_own_functions() {
        let cfg = crate::config::preset("smollm2-135m").unwrap();
        let info = SeqInfo {
            prompt_len: 700,
            max_new_tokens: 64,
            prefill_len: 700,
        };
        let specs = [
            PolicySpec::full(),
            PolicySpec::H2o(H2oParams {
                budget: 0.3,
                ..Default::default()
            }),
            PolicySpec::Streaming(StreamingParams {
                budget: 0.1,
                ..Default::default()
            }),
            PolicySpec::Infinigen(InfinigenParams {
                budget: 0.3,
                ..Default::default()
            }),
        ];
        for spec in specs {
            let s = Setup::new(cfg.clone(), spec.clone(), Precision::F32);
            for n in [1, 100, 700, 701, 764] {
                assert_eq!(
                    kv_device_bytes(&s, &info, n),
                    nominal_device_bytes(&spec, &cfg, &info, n, crate::kv::KvCodec::F32, None),
                    "{} n={n}",
                    spec.name()
                );
            }
        }
        let s = Setup::new(cfg.clone(), PolicySpec::full(), Precision::BF16);
        assert_eq!(
            block_bytes(&s).unwrap(),
            crate::policy::full::FullPolicy::block_bytes(
                &cfg,
                &crate::policy::full::FullOptions {
                    kv_codec: crate::kv::KvCodec::Bf16,
                    ..Default::default()
                }
            )
        );
        // Empty inputs are typed errors, not panics.
        let bad = MemoryInputs {
            sequences: 0,
            prefill_sequences: 1,
            info,
            capacity: 1 << 30,
            memory_fraction: 0.9,
            max_model_len: 1024,
            max_num_seqs: 1,
            max_batched_tokens: 1024,
            host_memory: None,
        };
        assert!(memory_held(&s, &bad).is_err());
        // Llama-3.1-8B bf16: 128 KiB per token (algorithms.md §1).
        let l = crate::config::preset("llama-3.1-8b").unwrap();
        let s = Setup::new(l, PolicySpec::full(), Precision::BF16);
        assert_eq!(kv_device_bytes(&s, &info, 10), 10 * 128 * 1024);
    }

    #[test]
    fn a_budget_pool_past_its_plan_runs_fewer_sequences_rather_than_out_of_memory() {
        let cfg = crate::config::preset("smollm2-135m").unwrap();
        let s = Setup::new(
            cfg,
            PolicySpec::H2o(H2oParams {
                budget: 0.5,
                ..Default::default()
            }),
            Precision::F32,
        );
        let info = SeqInfo {
            prompt_len: 4000,
            max_new_tokens: 100,
            prefill_len: 4000,
        };
        let m = |sequences: usize, capacity: u64| MemoryInputs {
            sequences,
            prefill_sequences: 1,
            info,
            capacity,
            memory_fraction: 0.9,
            max_model_len: 8192,
            max_num_seqs: 256,
            max_batched_tokens: 8192,
            host_memory: None,
        };
        let big = memory_held(&s, &m(4, 4 << 30)).unwrap();
        assert_eq!((big.concurrency, big.oom), (4, None));
        // 64 sequences need far more than a 2 GiB card's plan: as many run as fit.
        let held = memory_held(&s, &m(64, 2 << 30)).unwrap();
        assert!(held.oom.is_none(), "{:?}", held.oom);
        assert!(
            held.concurrency > 1 && held.concurrency < 64,
            "{}",
            held.concurrency
        );
        assert!(held.report.kv_device <= held.kv_pool);
        let one_more = held.concurrency + 1;
        let p = |k: usize| {
            (k - 1) as u64 * kv_device_bytes(&s, &info, 4100)
                + kv_device_bytes(
                    &Setup {
                        policy: PolicySpec::full(),
                        ..s.clone()
                    },
                    &info,
                    4000,
                )
                .max(kv_device_bytes(&s, &info, 4100))
        };
        assert!(p(held.concurrency) <= held.kv_pool && p(one_more) > held.kv_pool);
        // A card whose plan cannot hold one prompt: out of memory, in the KV.
        let non_kv = held.report.weights + profile_activations(&s, 256, 8192);
        let cap = ((non_kv + (100 << 20)) as f64 / 0.9) as u64;
        let tiny = memory_held(&s, &m(1, cap)).unwrap();
        assert_eq!(tiny.oom.map(|o| o.component), Some(Component::KvDevice));
    }
}
