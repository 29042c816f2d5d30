//! A device's calibration: the efficiency constants of each phase fitted to measured
//! steps ([`fit_phase`]), with how well they explain them, as a YAML file
//! (`kvbench calibrate` writes it, `kvbench predict --calibration` reads it).

use super::device::Device;
use super::fit::{fit_phase, FitReport, Observation, PhaseEfficiency, Term};
use super::predict::Efficiency;
use super::simulate::Phase;
use super::{CostError, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The terms each phase fits. Prefill has no per-sequence term: each prefill step
/// holds one prompt in the study's sequential mode, so it cannot be told from the
/// step overhead. Only prefill gives the statistics passes a rate of their own: there
/// H2O's is a pass over the prompt's keys of its own kernel, where a decode step's
/// statistics are a few FLOPs per key beside attention's (a rate fitted to those
/// would stand for whatever else tells h2o's steps from full's). Terms whose feature
/// is zero in every observation (the host link without offloading, all-reduces on one
/// device) stay at zero.
pub fn terms(phase: Phase) -> Vec<Term> {
    Term::ALL
        .into_iter()
        .filter(|&t| match phase {
            Phase::Prefill => t != Term::PerSequence,
            Phase::Decode => t != Term::StatisticsFlops,
        })
        .collect()
}

/// One phase's fit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PhaseFit {
    pub fit: FitReport,
    /// Terms the fitted runs never exercised (zero in every step): they keep the
    /// datasheet's rate, a lower bound on their time (none where the datasheet has no
    /// figure: then they cost nothing, and predictions that need them say so).
    #[serde(default)]
    pub unobserved: Vec<Term>,
    /// Unobserved terms that take another calibration's fitted value instead
    /// ([`Calibration::rates_from`]): a rate measured on this device by other runs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub taken: Vec<Term>,
    /// Median |predicted − measured| / measured over the observations.
    pub median_relative_error: f64,
    /// Achieved fractions of the device's datasheet peaks (null where unknown).
    pub bandwidth_of_peak: Option<f64>,
    pub flops_of_peak: Option<f64>,
    pub link_of_peak: Option<f64>,
}

impl PhaseFit {
    /// `other`: the same phase of another calibration of the device, whose fitted
    /// values the terms these steps never exercise take where it observed them.
    fn new(
        device: &Device,
        phase: Phase,
        obs: &[Observation],
        other: Option<&PhaseFit>,
    ) -> Result<Self> {
        let unobserved: Vec<Term> = terms(phase)
            .into_iter()
            .filter(|t| obs.iter().all(|o| t.feature(&o.cost) == 0.0))
            .collect();
        let mut fixed = PhaseEfficiency::datasheet(device);
        let mut taken = Vec::new();
        if let Some(o) = other {
            for t in unobserved.iter().filter(|t| !o.unobserved.contains(t)) {
                t.take(&o.fit.efficiency, &mut fixed);
                taken.push(*t);
            }
        }
        let fit = fit_phase(obs, &terms(phase), &fixed)
            .map_err(|e| CostError::Fit(format!("{phase:?} steps: {e}")))?;
        let mut rel: Vec<f64> = obs
            .iter()
            .map(|o| ((fit.efficiency.time(&o.cost) - o.seconds) / o.seconds).abs())
            .collect();
        rel.sort_by(f64::total_cmp);
        let (bandwidth_of_peak, flops_of_peak, link_of_peak) =
            fit.efficiency.fractions_of_peak(device);
        Ok(Self {
            fit,
            unobserved,
            taken,
            median_relative_error: median_sorted(&rel),
            bandwidth_of_peak,
            flops_of_peak,
            link_of_peak,
        })
    }
}

fn median_sorted(xs: &[f64]) -> f64 {
    match xs.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => xs[n / 2],
        n => (xs[n / 2 - 1] + xs[n / 2]) / 2.0,
    }
}

/// Efficiency constants of one device fitted from measured runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    /// The device's name in the device table.
    pub device: String,
    /// The experiments whose steps were fitted.
    pub sources: Vec<String>,
    /// The file of the card's measured rates the fit used in place of the datasheet's
    /// (peaks and the rates of unexercised terms), when one was given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ceilings: Option<String>,
    /// The calibration whose fitted values the unexercised terms took (each phase's
    /// `taken`), when one was given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rates_from: Option<String>,
    /// The builds of kvbench that measured the fitted cells (`not recorded` for cells
    /// from before builds were): the engine whose times the constants describe.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub builds: Vec<String>,
    pub prefill: PhaseFit,
    pub decode: PhaseFit,
}

impl Calibration {
    /// Fit both phases of `device` to measured steps.
    pub fn fit(
        device: &Device,
        sources: Vec<String>,
        prefill: &[Observation],
        decode: &[Observation],
    ) -> Result<Self> {
        Self::fit_with(device, sources, prefill, decode, None)
    }

    /// [`Calibration::fit`], the terms these steps never exercise taking the values
    /// `other` (named `name`, a calibration of the same device) fitted, where it
    /// exercised them, instead of the datasheet's: e.g. the host link fitted on
    /// another experiment's offloading cells, for a fit on runs that do not offload.
    pub fn fit_with(
        device: &Device,
        sources: Vec<String>,
        prefill: &[Observation],
        decode: &[Observation],
        other: Option<(&Calibration, &str)>,
    ) -> Result<Self> {
        if let Some((o, name)) = other {
            if o.device != device.name {
                return Err(CostError::Invalid(format!(
                    "{name}: a calibration of {}, expected one of {}",
                    o.device, device.name
                )));
            }
        }
        Ok(Self {
            device: device.name.clone(),
            sources,
            ceilings: None,
            rates_from: other.map(|(_, name)| name.to_string()),
            builds: Vec::new(),
            prefill: PhaseFit::new(device, Phase::Prefill, prefill, other.map(|o| &o.0.prefill))?,
            decode: PhaseFit::new(device, Phase::Decode, decode, other.map(|o| &o.0.decode))?,
        })
    }

    /// The constants the predictions use.
    pub fn efficiency(&self) -> Efficiency {
        Efficiency {
            prefill: self.prefill.fit.efficiency,
            decode: self.decode.fit.efficiency,
            source: format!(
                "{} calibrated on {}{}",
                self.device,
                self.sources.join(", "),
                match self.builds.as_slice() {
                    [] => String::new(),
                    [one] => format!(" (build {one})"),
                    many => format!(" (builds {})", many.join(", ")),
                }
            ),
        }
    }

    pub fn to_yaml(&self) -> Result<String> {
        serde_yaml::to_string(self).map_err(|e| CostError::Invalid(e.to_string()))
    }

    pub fn from_yaml(text: &str, file: &str) -> Result<Self> {
        let c: Calibration = serde_yaml::from_str(text).map_err(|e| CostError::DeviceFile {
            file: file.into(),
            key: "calibration".into(),
            message: e.to_string(),
        })?;
        for (phase, f) in [("prefill", &c.prefill), ("decode", &c.decode)] {
            let e = &f.fit.efficiency;
            let bad = |x: f64| !(x.is_finite() && x >= 0.0);
            let bad_rate = |r: Option<f64>| r.is_some_and(|r| !(r.is_finite() && r > 0.0));
            if bad(e.step_overhead_s)
                || bad(e.per_sequence_s)
                || bad(e.allreduce_latency_s)
                || bad_rate(e.bandwidth)
                || bad_rate(e.flops)
                || bad_rate(e.link)
                || bad_rate(e.interconnect)
            {
                return Err(CostError::DeviceFile {
                    file: file.into(),
                    key: format!("{phase}.fit.efficiency"),
                    message: "expected non-negative overheads and positive rates".into(),
                });
            }
        }
        Ok(c)
    }

    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| CostError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_yaml(&text, &path.display().to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::device::DeviceTable;
    use crate::cost::StepCost;

    fn obs(forwards: f64, sequences: f64, bytes: f64, flops: f64, t: f64) -> Observation {
        Observation {
            cost: StepCost {
                forwards,
                sequences,
                tokens: sequences,
                weight_read: bytes,
                flops_linear: flops,
                ..Default::default()
            },
            seconds: t,
        }
    }

    #[test]
    fn fits_known_constants_and_round_trips_through_yaml() {
        let d = DeviceTable::builtin()
            .unwrap()
            .get("h100-sxm")
            .unwrap()
            .clone();
        // t = 1 ms + 20 µs per sequence + bytes / 2.5 TB/s (+ flops / 600 TFLOP/s).
        let mut dec = Vec::new();
        let mut pre = Vec::new();
        for b in [1.0, 4.0, 16.0, 64.0] {
            for ctx in [1e9, 4e9, 8e9] {
                let bytes = 16e9 + b * ctx / 8.0;
                let t = 1e-3 + 20e-6 * b + bytes / 2.5e12;
                dec.push(obs(1.0, b, bytes, 0.0, t));
            }
        }
        for l in [1e3, 4e3, 16e3, 64e3] {
            let flops = 16e9 * l;
            // Keys re-read per forward grow as l²: not a combination of the other
            // features (a line in l would be the overhead and the FLOPs again).
            let bytes = 16e9 + l * l * 50.0;
            pre.push(obs(
                1.0,
                1.0,
                bytes,
                flops,
                2e-3 + bytes / 2.5e12 + flops / 6e14,
            ));
        }
        let c = Calibration::fit(&d, vec!["synthetic".into()], &pre, &dec).unwrap();
        let e = c.decode.fit.efficiency;
        assert!((e.bandwidth.unwrap() / 2.5e12 - 1.0).abs() < 1e-6);
        assert!((e.per_sequence_s / 20e-6 - 1.0).abs() < 1e-6);
        assert!((c.prefill.fit.efficiency.flops.unwrap() / 6e14 - 1.0).abs() < 1e-6);
        assert!(c.decode.median_relative_error < 1e-9);
        // No step moved bytes over the host link: the link keeps the datasheet's rate
        // (a transfer still costs time in a prediction), and the file says so.
        assert!(c.decode.unobserved.contains(&Term::Link));
        assert_eq!(e.link, Some(64e9));
        let f = c.decode.bandwidth_of_peak.unwrap();
        assert!((f - 2.5e12 / 3.35e12).abs() < 1e-6, "{f}");
        let back = Calibration::from_yaml(&c.to_yaml().unwrap(), "c.yaml").unwrap();
        assert_eq!(back, c);
        // A negative rate in a file is refused with the field named.
        let bad = c
            .to_yaml()
            .unwrap()
            .replacen("bandwidth: ", "bandwidth: -", 1);
        let err = Calibration::from_yaml(&bad, "c.yaml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("c.yaml") && err.contains("efficiency"),
            "{err}"
        );
    }

    #[test]
    fn unexercised_terms_take_another_calibrations_fitted_values() {
        let d = DeviceTable::builtin()
            .unwrap()
            .get("h100-sxm")
            .unwrap()
            .clone();
        let step = |b: f64, ctx: f64, h2d: f64| {
            let bytes = 16e9 + b * ctx / 8.0;
            let mut o = obs(1.0, b, bytes, 0.0, 1e-3 + 20e-6 * b + bytes / 2.5e12);
            o.cost.h2d = h2d;
            o.seconds += h2d / 30e9;
            o
        };
        let pre: Vec<Observation> = [1e3, 4e3, 16e3]
            .iter()
            .map(|&l| {
                let (bytes, flops) = (16e9 + l * l * 50.0, 16e9 * l);
                obs(1.0, 1.0, bytes, flops, 2e-3 + bytes / 2.5e12 + flops / 6e14)
            })
            .collect();
        let grid = |h2d: f64| -> Vec<Observation> {
            [1.0, 4.0, 16.0]
                .iter()
                .flat_map(|&b| [1e9, 4e9].map(|ctx| step(b, ctx, h2d * b * b)))
                .collect()
        };
        // Runs that offload fit the link (their bytes moved grow as b², not as a
        // combination of the other features); runs that do not take it from them.
        let offload = Calibration::fit(&d, vec!["offload".into()], &pre, &grid(1e8)).unwrap();
        assert!((offload.decode.fit.efficiency.link.unwrap() / 30e9 - 1.0).abs() < 1e-6);
        let c = Calibration::fit_with(
            &d,
            vec!["dense".into()],
            &pre,
            &grid(0.0),
            Some((&offload, "offload.yaml")),
        )
        .unwrap();
        assert_eq!(c.rates_from.as_deref(), Some("offload.yaml"));
        assert!(c.decode.unobserved.contains(&Term::Link));
        assert_eq!(c.decode.taken, vec![Term::Link]);
        assert_eq!(
            c.decode.fit.efficiency.link,
            offload.decode.fit.efficiency.link
        );
        // The fitted terms are this run's own, unchanged by the other calibration.
        let alone = Calibration::fit(&d, vec!["dense".into()], &pre, &grid(0.0)).unwrap();
        assert_eq!(
            c.decode.fit.efficiency.bandwidth,
            alone.decode.fit.efficiency.bandwidth
        );
        // Neither prefill moved bytes: the link keeps the datasheet's rate.
        assert!(c.prefill.taken.is_empty());
        assert_eq!(c.prefill.fit.efficiency.link, Some(64e9));
        let back = Calibration::from_yaml(&c.to_yaml().unwrap(), "c.yaml").unwrap();
        assert_eq!(back, c);
        // A calibration of another device is refused, named.
        let mut other = offload.clone();
        other.device = "a100-80g".into();
        let err = Calibration::fit_with(&d, vec![], &pre, &grid(0.0), Some((&other, "other.yaml")))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("other.yaml") && err.contains("a100-80g"),
            "{err}"
        );
    }
}
