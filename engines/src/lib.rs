//! kvbench engines: a Llama-family model on candle whose attention delegates to a KV
//! policy, the paged KV storage, attention kernels, the continuous-batching scheduler,
//! step traces and the memory ledger.

pub mod attention;
pub mod compare;
pub mod config;
pub mod cost;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod decode_graphs;
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
/// the flash prefill kernel, the paged decode kernel and its reduction, H2O's exact-statistics kernel,
/// the fused projections, the fused elementwise kernels, the few-row products' kernel
/// and CUDA graphs of decode steps (docs/cuda.md), and the CPU's packed f32 weights
/// (docs/correctness-and-performance.md). A result depends on them, so a cell's
/// identity includes the ones that are set.
pub const KERNEL_SWITCHES: [&str; 11] = [
    "KVBENCH_FLASH_PREFILL",
    "KVBENCH_PAGED_DECODE",
    "KVBENCH_DECODE_REDUCE",
    "KVBENCH_IG_GATHER",
    "KVBENCH_H2O_STATS",
    "KVBENCH_FUSED_PROJECTIONS",
    "KVBENCH_FUSED_KERNELS",
    "KVBENCH_GEMV",
    "KVBENCH_CUDA_GRAPH",
    "KVBENCH_ARGMAX",
    "KVBENCH_PACKED_WEIGHTS",
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

/// The value of kernel switch `var` in `value` (the environment's, `None` when unset)
/// among `options` (name, choice), and whether it was named: unset or blank gives
/// `unset` (described as `unset_is` in the error), any other value an error that names
/// the variable, the value and what it takes. The CUDA paths read their switches
/// through it once per process.
pub fn parse_switch<T: Copy>(
    var: &str,
    value: Option<&str>,
    options: &[(&str, T)],
    unset: T,
    unset_is: &str,
) -> std::result::Result<(T, bool), String> {
    // A switch read here changes results, so it must be part of cell identities.
    debug_assert!(
        KERNEL_SWITCHES.contains(&var),
        "{var} is not in KERNEL_SWITCHES"
    );
    match value.map(str::trim) {
        None | Some("") => Ok((unset, false)),
        Some(v) => options
            .iter()
            .find(|(name, _)| *name == v)
            .map(|&(_, t)| (t, true))
            .ok_or_else(|| {
                let names: Vec<&str> = options.iter().map(|(n, _)| *n).collect();
                format!(
                    "{var}={v}: expected {} (or unset for {unset_is})",
                    names.join(", ")
                )
            }),
    }
}

/// A switch's value from the environment by [`parse_switch`], read once per process
/// into `cell` (the CUDA paths ask at every layer of every step); an unknown value is a
/// configuration error naming it, every time it is asked.
pub fn switch_once<T: Copy + Send + Sync>(
    cell: &'static std::sync::OnceLock<std::result::Result<T, String>>,
    var: &str,
    options: &[(&str, T)],
    unset: T,
    unset_is: &str,
) -> Result<T> {
    cell.get_or_init(|| {
        parse_switch(
            var,
            std::env::var(var).ok().as_deref(),
            options,
            unset,
            unset_is,
        )
        .map(|(c, _)| c)
    })
    .clone()
    .map_err(Error::Config)
}

#[cfg(test)]
mod tests {
    use super::parse_switch;

    #[test]
    fn a_switch_takes_its_names_or_unset_and_refuses_anything_else_by_name() {
        let opts = [("vec1", 1), ("scalar", 2)];
        let p = |v| parse_switch("KVBENCH_PAGED_DECODE", v, &opts, 0, "the default");
        assert_eq!(p(None), Ok((0, false)));
        assert_eq!(p(Some("  ")), Ok((0, false)));
        assert_eq!(p(Some("vec1")), Ok((1, true)));
        assert_eq!(p(Some(" scalar ")), Ok((2, true)));
        let e = p(Some("vec4")).unwrap_err();
        assert_eq!(
            e,
            "KVBENCH_PAGED_DECODE=vec4: expected vec1, scalar (or unset for the default)"
        );
    }
}
