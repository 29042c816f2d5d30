//! Efficiency constants and their least-squares fit from measured step times
//! (docs/cost-model.md §5). Plain data in: the caller pairs each measured step (or
//! phase) with the [`StepCost`] the model computes for it.
//!
//! Time model of one step (additive: no overlap between terms):
//! `t = forwards·o + sequences·s + device_bytes/BW + matmul_flops/F
//!      + attention_flops/Fa + statistics_flops/Fs + transfer_bytes/L + allreduces·a
//!      + allreduce_bytes/I`.
//! It is linear in `θ = (o, s, 1/BW, 1/F, 1/Fa, 1/Fs, 1/L, a, 1/I)`, which is fitted by
//! non-negative least squares on relative errors (each step weighted by 1/its time).
//! The statistics passes (H2O's column sums, SnapKV's vote, StreamingLLM's
//! re-rotation) run at the attention rate unless a rate of their own explains the
//! steps better: on a GPU they are kernels of their own, FlashAttention-2's forward
//! several times faster than kvbench's statistics pass.

use super::device::Device;
use super::{CostError, Result, StepCost};
use serde::{Deserialize, Serialize};

/// Achieved rates and overheads of one phase (prefill or decode) on one device.
/// A rate of `None` contributes no time: the fit found that term hidden (coefficient
/// zero), or the device has no such link.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PhaseEfficiency {
    /// Seconds per forward pass (kernel launches, synchronization, host scheduling).
    pub step_overhead_s: f64,
    /// Host seconds per sequence per forward (sampling, per-row host work).
    pub per_sequence_s: f64,
    /// Achieved device-memory bandwidth, bytes/s.
    pub bandwidth: Option<f64>,
    /// Achieved FLOP/s of the dense products (linear layers, InfiniGen's speculation).
    pub flops: Option<f64>,
    /// Achieved FLOP/s of attention (QKᵀ and PV): kernels of their own, far from the
    /// GEMMs' rate; also of the statistics passes unless `statistics_flops` is set.
    #[serde(default)]
    pub attention_flops: Option<f64>,
    /// Achieved FLOP/s of the statistics passes (H2O's column sums, SnapKV's vote,
    /// StreamingLLM's re-rotation) where it differs from attention's; `None`: at the
    /// attention rate (calibrations written before this term read so).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub statistics_flops: Option<f64>,
    /// Achieved host-link bandwidth, bytes/s.
    pub link: Option<f64>,
    /// Seconds per all-reduce beyond its bytes.
    pub allreduce_latency_s: f64,
    /// Achieved interconnect bandwidth per GPU and direction, bytes/s.
    pub interconnect: Option<f64>,
}

impl PhaseEfficiency {
    /// The device's datasheet peaks and no overheads: the roofline, a lower bound on
    /// time (no calibration). Needs the memory bandwidth and FLOP/s.
    pub fn peak(d: &Device) -> Result<Self> {
        Ok(Self {
            step_overhead_s: 0.0,
            per_sequence_s: 0.0,
            bandwidth: Some(d.bandwidth()?),
            flops: Some(d.flops()?),
            attention_flops: Some(d.flops()?),
            statistics_flops: None,
            link: d.host_link_bandwidth().ok(),
            allreduce_latency_s: 0.0,
            interconnect: d.interconnect_bandwidth().ok(),
        })
    }

    /// The datasheet figures the device has (`None` where unknown), no overheads: what
    /// a calibration keeps for the terms its runs never exercised.
    pub fn datasheet(d: &Device) -> Self {
        Self {
            bandwidth: d.memory_bandwidth,
            flops: d.bf16_flops,
            attention_flops: d.bf16_flops,
            link: d.host_link.as_ref().map(|l| l.bytes_per_s),
            interconnect: d.interconnect.as_ref().map(|l| l.bytes_per_s),
            ..Default::default()
        }
    }

    /// Predicted seconds of a step.
    pub fn time(&self, c: &StepCost) -> f64 {
        let per = |x: f64, rate: Option<f64>| rate.map_or(0.0, |r| x / r);
        c.forwards * self.step_overhead_s
            + c.sequences * self.per_sequence_s
            + per(c.device_bytes(), self.bandwidth)
            + per(c.matmul_flops(), self.flops)
            + per(c.flops_attention, self.attention_flops)
            + per(c.flops_statistics, self.statistics_rate())
            + per(c.transfer_bytes(), self.link)
            + c.allreduces * self.allreduce_latency_s
            + per(c.allreduce_bytes, self.interconnect)
    }

    /// The rate the statistics passes run at: their own, else attention's.
    pub fn statistics_rate(&self) -> Option<f64> {
        self.statistics_flops.or(self.attention_flops)
    }

    /// Achieved fractions of the device's peaks: (bandwidth, dense FLOP/s, host link);
    /// `None` where either side is unknown.
    pub fn fractions_of_peak(&self, d: &Device) -> (Option<f64>, Option<f64>, Option<f64>) {
        let frac = |a: Option<f64>, p: Option<f64>| Some(a? / p?);
        (
            frac(self.bandwidth, d.memory_bandwidth),
            frac(self.flops, d.bf16_flops),
            frac(self.link, d.host_link.as_ref().map(|l| l.bytes_per_s)),
        )
    }
}

/// The terms of the time model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Term {
    StepOverhead,
    PerSequence,
    Bandwidth,
    Flops,
    AttentionFlops,
    StatisticsFlops,
    Link,
    AllreduceLatency,
    Interconnect,
}

impl Term {
    pub const ALL: [Term; 9] = [
        Term::StepOverhead,
        Term::PerSequence,
        Term::Bandwidth,
        Term::Flops,
        Term::AttentionFlops,
        Term::StatisticsFlops,
        Term::Link,
        Term::AllreduceLatency,
        Term::Interconnect,
    ];

    pub fn feature(&self, c: &StepCost) -> f64 {
        match self {
            Term::StepOverhead => c.forwards,
            Term::PerSequence => c.sequences,
            Term::Bandwidth => c.device_bytes(),
            Term::Flops => c.matmul_flops(),
            Term::AttentionFlops => c.flops_attention,
            Term::StatisticsFlops => c.flops_statistics,
            Term::Link => c.transfer_bytes(),
            Term::AllreduceLatency => c.allreduces,
            Term::Interconnect => c.allreduce_bytes,
        }
    }

    fn set(&self, e: &mut PhaseEfficiency, theta: f64) {
        let rate = (theta > 0.0).then(|| 1.0 / theta);
        match self {
            Term::StepOverhead => e.step_overhead_s = theta,
            Term::PerSequence => e.per_sequence_s = theta,
            Term::Bandwidth => e.bandwidth = rate,
            Term::Flops => e.flops = rate,
            Term::AttentionFlops => e.attention_flops = rate,
            Term::StatisticsFlops => e.statistics_flops = rate,
            Term::Link => e.link = rate,
            Term::AllreduceLatency => e.allreduce_latency_s = theta,
            Term::Interconnect => e.interconnect = rate,
        }
    }

    fn clear(&self, e: &mut PhaseEfficiency) {
        self.set(e, 0.0)
    }

    /// This term's value in `from` written into `to` (the others untouched).
    pub fn take(&self, from: &PhaseEfficiency, to: &mut PhaseEfficiency) {
        match self {
            Term::StepOverhead => to.step_overhead_s = from.step_overhead_s,
            Term::PerSequence => to.per_sequence_s = from.per_sequence_s,
            Term::Bandwidth => to.bandwidth = from.bandwidth,
            Term::Flops => to.flops = from.flops,
            Term::AttentionFlops => to.attention_flops = from.attention_flops,
            Term::StatisticsFlops => to.statistics_flops = from.statistics_flops,
            Term::Link => to.link = from.link,
            Term::AllreduceLatency => to.allreduce_latency_s = from.allreduce_latency_s,
            Term::Interconnect => to.interconnect = from.interconnect,
        }
    }

    /// The rate this term stands for in `e` (bytes/s or FLOP/s); `None` for the
    /// overheads, which are seconds and have no ceiling.
    fn rate(&self, e: &PhaseEfficiency) -> Option<f64> {
        match self {
            Term::StepOverhead | Term::PerSequence | Term::AllreduceLatency => None,
            Term::Bandwidth => e.bandwidth,
            Term::Flops => e.flops,
            Term::AttentionFlops => e.attention_flops,
            Term::StatisticsFlops => e.statistics_rate(),
            Term::Link => e.link,
            Term::Interconnect => e.interconnect,
        }
    }
}

/// One measured step (or a whole phase: costs and times add up).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Observation {
    pub cost: StepCost,
    pub seconds: f64,
}

/// A fit and how well it explains its observations.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FitReport {
    pub efficiency: PhaseEfficiency,
    pub observations: usize,
    /// Terms with a non-zero coefficient.
    pub active_terms: usize,
    pub rmse_s: f64,
    pub r_squared: f64,
    /// Largest |predicted − measured| / measured.
    pub max_relative_error: f64,
}

/// Least squares on columns scaled to unit maximum; `None` when singular.
fn least_squares(cols: &[Vec<f64>], y: &[f64]) -> Option<Vec<f64>> {
    let k = cols.len();
    let scale: Vec<f64> = cols
        .iter()
        .map(|c| c.iter().fold(0.0f64, |m, x| m.max(x.abs())))
        .collect();
    if scale.contains(&0.0) {
        return None;
    }
    // Normal equations [AᵀA | Aᵀy] on the scaled columns.
    let mut m = vec![vec![0.0; k + 1]; k];
    for i in 0..k {
        for j in 0..k {
            m[i][j] = cols[i]
                .iter()
                .zip(&cols[j])
                .map(|(a, b)| a / scale[i] * b / scale[j])
                .sum();
        }
        m[i][k] = cols[i].iter().zip(y).map(|(a, b)| a / scale[i] * b).sum();
    }
    let max_diag = (0..k).map(|i| m[i][i]).fold(0.0f64, f64::max);
    for col in 0..k {
        let piv = (col..k).max_by(|&a, &b| m[a][col].abs().total_cmp(&m[b][col].abs()))?;
        if m[piv][col].abs() <= 1e-12 * max_diag {
            return None;
        }
        m.swap(col, piv);
        let pivot_row = m[col].clone();
        for (r, row) in m.iter_mut().enumerate() {
            if r != col {
                let f = row[col] / pivot_row[col];
                for (x, p) in row.iter_mut().zip(&pivot_row).skip(col) {
                    *x -= f * p;
                }
            }
        }
    }
    Some((0..k).map(|i| m[i][k] / m[i][i] / scale[i]).collect())
}

/// Fit `terms` to the observations by non-negative least squares (exhaustive over
/// subsets of the terms, exact for these few unknowns); every other term, and every
/// term whose feature is zero in every observation, is taken from `fixed` and its
/// time subtracted first. A rate `fixed` knows (the datasheet's) is a ceiling: a
/// solution that runs a term faster than it is not physical and is not taken (the
/// term is then either slower or hidden, 0 s, behind the others).
pub fn fit_phase(
    obs: &[Observation],
    terms: &[Term],
    fixed: &PhaseEfficiency,
) -> Result<FitReport> {
    if obs.is_empty() {
        return Err(CostError::Fit("no observations".into()));
    }
    if let Some(o) = obs
        .iter()
        .find(|o| !(o.seconds.is_finite() && o.seconds > 0.0))
    {
        return Err(CostError::Fit(format!(
            "measured time {} s: expected a positive number",
            o.seconds
        )));
    }
    // Terms whose feature is zero in every observation cannot be fitted: they keep
    // their value in `fixed` (a calibration passes the datasheet's, so a transfer
    // never seen in the fitted runs still costs its time at the link's peak).
    let mut live: Vec<Term> = terms
        .iter()
        .copied()
        .filter(|t| obs.iter().any(|o| t.feature(&o.cost) != 0.0))
        .collect();
    // The statistics passes' FLOPs count with attention's where their own rate is not
    // among the terms to fit: their column is then only ever merged into attention's.
    let stats_own = live.contains(&Term::StatisticsFlops);
    if !stats_own
        && live.contains(&Term::AttentionFlops)
        && obs
            .iter()
            .any(|o| Term::StatisticsFlops.feature(&o.cost) != 0.0)
    {
        live.push(Term::StatisticsFlops);
    }
    let ceilings: Vec<Option<f64>> = live.iter().map(|t| t.rate(fixed)).collect();
    let mut base = *fixed;
    for t in &live {
        t.clear(&mut base);
    }
    // The statistics passes either run at a rate of their own or at attention's: a
    // subset without their term fits attention on both features together.
    let stats_j = live.iter().position(|&t| t == Term::StatisticsFlops);
    let att_j = live.iter().position(|&t| t == Term::AttentionFlops);
    if stats_j.is_some() {
        // Fitted below: no time of theirs in the base (cleared, they would fall back
        // to attention's rate, which is the base's where attention is not fitted).
        base.statistics_flops = Some(f64::INFINITY);
    }
    let y: Vec<f64> = obs.iter().map(|o| o.seconds - base.time(&o.cost)).collect();
    if live.is_empty() {
        return Err(CostError::Fit(
            "every term to fit has a zero feature in every observation".into(),
        ));
    }
    if obs.len() < live.len() {
        return Err(CostError::Fit(format!(
            "{} observations for {} unknowns",
            obs.len(),
            live.len()
        )));
    }
    // Relative least squares: each step weighs by 1/its measured time, so the fit
    // minimizes relative errors (what a prediction is judged by) and long steps do
    // not drown short ones.
    let y: Vec<f64> = y.iter().zip(obs).map(|(y, o)| y / o.seconds).collect();
    let cols: Vec<Vec<f64>> = live
        .iter()
        .map(|t| obs.iter().map(|o| t.feature(&o.cost) / o.seconds).collect())
        .collect();
    let sse = |theta: &[f64], sub: &[Vec<f64>]| -> f64 {
        (0..obs.len())
            .map(|i| {
                let p: f64 = sub.iter().zip(theta).map(|(c, t)| c[i] * t).sum();
                (y[i] - p).powi(2)
            })
            .sum()
    };
    let mut best: Option<(f64, Vec<usize>, Vec<f64>)> = None;
    for mask in 1u32..(1 << live.len()) {
        let idx: Vec<usize> = (0..live.len()).filter(|j| mask & (1 << j) != 0).collect();
        if !stats_own && stats_j.is_some_and(|s| idx.contains(&s)) {
            continue;
        }
        let merged = stats_j.filter(|s| !idx.contains(s));
        let sub: Vec<Vec<f64>> = idx
            .iter()
            .map(|&j| match merged {
                Some(s) if Some(j) == att_j => {
                    cols[j].iter().zip(&cols[s]).map(|(a, b)| a + b).collect()
                }
                _ => cols[j].clone(),
            })
            .collect();
        let Some(theta) = least_squares(&sub, &y) else {
            continue;
        };
        if theta.iter().any(|&t| t < 0.0) {
            continue;
        }
        // A rate of their own that is infinite is no rate: the statistics take
        // attention's in the subset without their term.
        if idx
            .iter()
            .zip(&theta)
            .any(|(&j, &t)| Some(j) == stats_j && t == 0.0)
        {
            continue;
        }
        // θ is seconds per unit: above its ceiling's rate when 1/θ exceeds it.
        if idx
            .iter()
            .zip(&theta)
            .any(|(&j, &t)| t > 0.0 && ceilings[j].is_some_and(|c| 1.0 / t > c))
        {
            continue;
        }
        let e = sse(&theta, &sub);
        if best.as_ref().is_none_or(|(b, _, _)| e < *b) {
            best = Some((e, idx, theta));
        }
    }
    let Some((_, idx, theta)) = best else {
        return Err(CostError::Fit(
            "no non-negative solution: the observations are degenerate for these terms".into(),
        ));
    };
    let mut eff = base;
    if stats_j.is_some_and(|s| !idx.contains(&s)) {
        eff.statistics_flops = None;
    }
    for (&j, &t) in idx.iter().zip(&theta) {
        live[j].set(&mut eff, t);
    }
    let measured: Vec<f64> = obs.iter().map(|o| o.seconds).collect();
    let predicted: Vec<f64> = obs.iter().map(|o| eff.time(&o.cost)).collect();
    let n = obs.len() as f64;
    let mean = measured.iter().sum::<f64>() / n;
    let ss_res: f64 = measured
        .iter()
        .zip(&predicted)
        .map(|(m, p)| (m - p).powi(2))
        .sum();
    let ss_tot: f64 = measured.iter().map(|m| (m - mean).powi(2)).sum();
    Ok(FitReport {
        efficiency: eff,
        observations: obs.len(),
        active_terms: idx.len(),
        rmse_s: (ss_res / n).sqrt(),
        r_squared: if ss_tot > 0.0 {
            1.0 - ss_res / ss_tot
        } else {
            1.0
        },
        max_relative_error: measured
            .iter()
            .zip(&predicted)
            .map(|(m, p)| ((p - m) / m).abs())
            .fold(0.0, f64::max),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::preset;
    use crate::cost::device::DeviceTable;
    use crate::cost::traffic::decode_step;
    use crate::cost::{Precision, Setup};
    use crate::policy::infinigen::InfinigenParams;
    use crate::policy::spec::PolicySpec;
    use crate::policy::SeqInfo;

    /// Deterministic noise in [−1, 1].
    fn noise(state: &mut u64) -> f64 {
        *state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((*state >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
    }

    #[test]
    fn the_fit_recovers_known_constants_from_noisy_synthetic_steps() {
        let table = DeviceTable::builtin().unwrap();
        let h100 = table.get("h100-sxm").unwrap();
        let peak = PhaseEfficiency::peak(h100).unwrap();
        let truth = PhaseEfficiency {
            step_overhead_s: 4e-3,
            per_sequence_s: 3e-4,
            bandwidth: Some(1.1e12),
            link: Some(18e9),
            ..peak
        };
        let cfg = preset("llama-3.1-8b").unwrap();
        let ig = PolicySpec::Infinigen(InfinigenParams {
            budget: 0.3,
            ..Default::default()
        });
        let mut rng = 7u64;
        let mut obs = Vec::new();
        for policy in [PolicySpec::full(), ig] {
            let s = Setup::new(cfg.clone(), policy, Precision::BF16);
            for batch in [1, 4, 16, 64] {
                for l0 in [1000, 4000, 16000] {
                    let info = SeqInfo {
                        prompt_len: l0,
                        max_new_tokens: 256,
                        prefill_len: l0,
                    };
                    let c = decode_step(&s, &info, l0 + 100, batch);
                    let t = truth.time(&c) * (1.0 + 0.01 * noise(&mut rng));
                    obs.push(Observation {
                        cost: c,
                        seconds: t,
                    });
                }
            }
        }
        let terms = [
            Term::StepOverhead,
            Term::PerSequence,
            Term::Bandwidth,
            Term::Link,
        ];
        let fit = fit_phase(&obs, &terms, &peak).unwrap();
        let e = fit.efficiency;
        let close = |a: f64, b: f64, tol: f64| ((a - b) / b).abs() < tol;
        assert!(close(e.bandwidth.unwrap(), 1.1e12, 0.03), "{e:?}");
        assert!(close(e.link.unwrap(), 18e9, 0.03), "{e:?}");
        assert!(close(e.per_sequence_s, 3e-4, 0.15), "{e:?}");
        assert!(close(e.step_overhead_s, 4e-3, 0.25), "{e:?}");
        assert_eq!(e.flops, peak.flops);
        assert!(
            fit.r_squared > 0.999 && fit.max_relative_error < 0.03,
            "{fit:?}"
        );
        let (bw, _, link) = e.fractions_of_peak(h100);
        assert!(close(bw.unwrap(), 1.1e12 / 3.35e12, 0.03));
        assert!(close(link.unwrap(), 18e9 / 64e9, 0.03));

        // Degenerate input is a typed error, not a panic.
        assert!(fit_phase(&obs[..2], &terms, &peak).is_err());
        assert!(fit_phase(&[], &terms, &peak).is_err());
        let bad = [Observation {
            cost: obs[0].cost,
            seconds: f64::NAN,
        }];
        assert!(fit_phase(&bad, &terms, &peak).is_err());
    }

    /// Prefills of `full` and `h2o` (its exact statistics pass) whose statistics run
    /// at a quarter of attention's rate: fitted with their own term the two rates come
    /// back; without it (decode's terms) their FLOPs are charged at the one attention
    /// rate both in the fit and in its predictions; and an efficiency without the
    /// field, as calibrations written before it read, times them at attention's.
    #[test]
    fn the_statistics_pass_gets_a_rate_of_its_own_only_where_it_is_fitted() {
        use crate::cost::traffic::prefill;
        use crate::policy::evicting::h2o::H2oParams;
        let table = DeviceTable::builtin().unwrap();
        let h100 = table.get("h100-sxm").unwrap();
        let peak = PhaseEfficiency::peak(h100).unwrap();
        let truth = PhaseEfficiency {
            step_overhead_s: 2e-3,
            flops: Some(500e12),
            attention_flops: Some(300e12),
            statistics_flops: Some(75e12),
            ..peak
        };
        let cfg = preset("llama-3.1-8b").unwrap();
        let h2o = PolicySpec::H2o(H2oParams {
            budget: 0.3,
            ..Default::default()
        });
        let mut rng = 11u64;
        let mut obs = Vec::new();
        for policy in [PolicySpec::full(), h2o] {
            let s = Setup::new(cfg.clone(), policy, Precision::BF16);
            for len in [1000, 4000, 16000, 32000] {
                let info = SeqInfo {
                    prompt_len: len,
                    max_new_tokens: 1,
                    prefill_len: len,
                };
                let c = prefill(&s, &info, 1 << 20);
                let t = truth.time(&c) * (1.0 + 0.005 * noise(&mut rng));
                obs.push(Observation {
                    cost: c,
                    seconds: t,
                });
            }
        }
        assert!(obs.iter().any(|o| o.cost.flops_statistics > 0.0));
        let close = |a: Option<f64>, b: f64| a.is_some_and(|a| ((a - b) / b).abs() < 0.05);
        let own = [
            Term::StepOverhead,
            Term::Flops,
            Term::AttentionFlops,
            Term::StatisticsFlops,
        ];
        let e = fit_phase(&obs, &own, &peak).unwrap().efficiency;
        assert!(close(e.attention_flops, 300e12), "{e:?}");
        assert!(close(e.statistics_flops, 75e12), "{e:?}");
        // Without their term: one attention rate, used for both, and a worse fit.
        let merged = fit_phase(&obs, &own[..3], &peak).unwrap();
        let m = merged.efficiency;
        assert_eq!(m.statistics_flops, None);
        assert_eq!(m.statistics_rate(), m.attention_flops);
        assert!(merged.max_relative_error > 0.02, "{merged:?}");
        let h2o_step = obs.last().unwrap().cost;
        let as_attention = StepCost {
            flops_attention: h2o_step.flops_attention + h2o_step.flops_statistics,
            flops_statistics: 0.0,
            ..h2o_step
        };
        let (t, by_hand) = (m.time(&h2o_step), m.time(&as_attention));
        assert!((t - by_hand).abs() <= 1e-9 * by_hand, "{t} {by_hand}");
        assert!(e.time(&h2o_step) != e.time(&as_attention));
        // A calibration file from before the field: the statistics at attention's rate.
        let yaml = "step_overhead_s: 0.0\nper_sequence_s: 0.0\nbandwidth: null\n\
                    flops: 5.0e14\nattention_flops: 3.0e14\nlink: null\n\
                    allreduce_latency_s: 0.0\ninterconnect: null\n";
        let old: PhaseEfficiency = serde_yaml::from_str(yaml).unwrap();
        assert_eq!(old.statistics_flops, None);
        assert_eq!(old.statistics_rate(), Some(3.0e14));
    }

    #[test]
    fn no_fitted_rate_runs_faster_than_the_datasheet() {
        // Steps of two features whose times are mostly a constant: unconstrained least
        // squares pays for them with a tiny bandwidth coefficient (a rate far above
        // the device's) plus an overhead. The fit must instead keep every rate at or
        // below its ceiling.
        let table = DeviceTable::builtin().unwrap();
        let h100 = table.get("h100-sxm").unwrap();
        let peak = PhaseEfficiency::peak(h100).unwrap();
        let cfg = preset("llama-3.1-8b").unwrap();
        let s = Setup::new(cfg, PolicySpec::full(), Precision::BF16);
        let mut rng = 3u64;
        let obs: Vec<Observation> = [1, 2, 4, 8, 16, 32, 64]
            .into_iter()
            .map(|batch| {
                let info = SeqInfo {
                    prompt_len: 1000,
                    max_new_tokens: 64,
                    prefill_len: 1000,
                };
                let c = decode_step(&s, &info, 1100, batch);
                // 5 ms per step, plus a little that grows with the bytes read at 40x
                // the device's bandwidth.
                let t = 5e-3 + c.device_bytes() / (40.0 * 3.35e12);
                Observation {
                    cost: c,
                    seconds: t * (1.0 + 0.002 * noise(&mut rng)),
                }
            })
            .collect();
        let terms = [Term::StepOverhead, Term::Bandwidth];
        // Only the bandwidth has a ceiling here (the other rates would add their
        // peak time to the steps).
        let ceiling = PhaseEfficiency {
            bandwidth: peak.bandwidth,
            ..Default::default()
        };
        // Without a ceiling the fit takes the super-peak rate ...
        let loose = fit_phase(&obs, &terms, &PhaseEfficiency::default())
            .unwrap()
            .efficiency;
        assert!(loose.bandwidth.is_some_and(|b| b > 3.35e12), "{loose:?}");
        // ... with the datasheet's it does not.
        let e = fit_phase(&obs, &terms, &ceiling).unwrap().efficiency;
        assert!(e.bandwidth.is_none_or(|b| b <= 3.35e12), "{e:?}");
        assert!(e.step_overhead_s > 0.0, "{e:?}");
    }
}
