//! kvbench engines: a Llama-family model on candle whose attention delegates to a KV
//! policy, the paged KV storage, attention kernels, the continuous-batching scheduler,
//! step traces and the memory ledger.

pub mod attention;
pub mod compare;
pub mod config;
pub mod cost;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod engine;
pub mod error;
pub mod kv;
pub mod ledger;
pub mod model;
pub mod policy;
pub mod scheduler;
pub mod source;
pub mod tokenizer;
pub mod trace;

pub use error::{Error, Result};

/// Environment variables that choose among an engine's interchangeable kernels and
/// code paths (the same results within the checks' tolerances, not the same speed):
/// the flash prefill kernel, the paged decode kernel, H2O's exact-statistics kernel,
/// the fused projections and the fused elementwise kernels (docs/cuda.md). A result
/// depends on them, so a cell's identity includes the ones that are set.
pub const KERNEL_SWITCHES: [&str; 5] = [
    "KVBENCH_FLASH_PREFILL",
    "KVBENCH_PAGED_DECODE",
    "KVBENCH_H2O_STATS",
    "KVBENCH_FUSED_PROJECTIONS",
    "KVBENCH_FUSED_KERNELS",
];

/// The [`KERNEL_SWITCHES`] set in this process's environment (non-empty), by name.
pub fn kernel_switches() -> std::collections::BTreeMap<String, String> {
    KERNEL_SWITCHES
        .iter()
        .filter_map(|k| {
            let v = std::env::var(k).ok()?;
            (!v.trim().is_empty()).then(|| (k.to_string(), v))
        })
        .collect()
}
