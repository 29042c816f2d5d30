//! `kvbench compare A B`: its arguments; `crate::compare` compares, prints and fails
//! on a regression.

use anyhow::Result;
use clap::Args;
use std::path::PathBuf;

/// Default tolerance on timing ratios (see docs/experiments.md: the spread of within-run
/// ratios over repeated CI sweeps on the development machine, with margin).
pub const DEFAULT_TOLERANCE: &str = "75%";

#[derive(Debug, Args)]
pub struct CompareArgs {
    /// Baseline: an experiment's results directory (`results/<name>/`, holding
    /// runs.parquet), or its runs.parquet.
    pub a: PathBuf,

    /// The run checked against the baseline, likewise.
    pub b: PathBuf,

    /// Largest slowdown of a timing that is not a regression, as `25%` or `0.25`: a
    /// time more than (1 + tolerance) × A's, or a throughput below A's / (1 + tolerance).
    #[arg(long, default_value = DEFAULT_TOLERANCE, value_parser = parse_tolerance)]
    pub tolerance: f64,

    /// Compare timings relative to this engine's cell of the same run with the same
    /// parameters (e.g. `full`) rather than in seconds: for runs on different machines.
    #[arg(long, value_name = "ENGINE")]
    pub relative_to: Option<String>,
}

/// `25%` or `0.25`; positive and finite.
pub fn parse_tolerance(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let (v, bare) = match t.strip_suffix('%') {
        Some(p) => (p.trim().parse::<f64>().map(|x| x / 100.0), false),
        None => (t.parse::<f64>(), true),
    };
    let v = v.map_err(|_| {
        format!("`{s}`: expected a fraction such as 0.25 or a percentage such as 25%")
    })?;

    if !(v.is_finite() && v > 0.0) {
        return Err(format!(
            "`{s}`: expected a positive tolerance such as 0.25 or 25%"
        ));
    }
    // `75` for 75 % would be a tolerance of 7,500 %: a whole share is written with `%`.
    if bare && v >= 1.0 {
        return Err(format!(
            "`{s}`: expected a fraction without `%` (0.75 is 75%); write {s}% or {}",
            v / 100.0
        ));
    }
    Ok(v)
}

pub fn run(a: CompareArgs) -> Result<()> {
    crate::compare::run(&a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tolerances_parse_as_fractions_or_percentages() {
        assert_eq!(parse_tolerance("25%"), Ok(0.25));
        assert_eq!(parse_tolerance("0.4"), Ok(0.4));
        assert_eq!(parse_tolerance(" 150 % "), Ok(1.5));
        for bad in ["", "0", "-5%", "abc", "inf", "NaN%", "75", "1"] {
            let e = parse_tolerance(bad).unwrap_err();
            assert!(e.contains("expected"), "{bad}: {e}");
        }
    }
}
