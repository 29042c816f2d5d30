//! Axes: linear or logarithmic ranges, tick values chosen here (not by the backend)
//! and their labels.

use super::*;

/// How tick labels are printed.
#[derive(Debug, Clone, Copy)]
pub enum Fmt {
    /// 1K, 10K (tokens, batch sizes, tokens/s).
    Count,
    /// 0.01, 2.5, 300 (seconds, GB).
    Num,
    /// Category labels by index.
    Labels,
}

/// One axis. Values are mapped to axis space (log10 on a log axis), so every chart
/// has the same coordinate type; the ticks are chosen here.
#[derive(Debug, Clone)]
pub struct Axis {
    pub log: bool,
    /// Axis-space range.
    pub lo: f64,
    pub hi: f64,
    /// Where the data end and the band for failed cells starts (axis space).
    pub data_hi: f64,
    ticks: Vec<f64>,
    minor: Vec<f64>,
    fmt: Fmt,
    labels: Vec<String>,
}

impl Axis {
    /// An axis over `values` (data units): logarithmic when `log` says so, or when
    /// `log` is None and the positive values span at least a decade. `zero` keeps 0
    /// on a linear axis.
    pub fn auto(values: &[f64], log: Option<bool>, zero: bool, fmt: Fmt) -> Axis {
        let vals: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
        let positive = !vals.is_empty() && vals.iter().all(|v| *v > 0.0);
        let (min, max) = vals
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
                (a.min(*v), b.max(*v))
            });
        let use_log = positive
            && match log {
                Some(l) => l,
                None => max / min >= 10.0,
            };
        if use_log {
            Axis::log(min, max, fmt)
        } else if vals.is_empty() {
            Axis::linear(0.0, 1.0, true, fmt)
        } else {
            Axis::linear(min, max, zero, fmt)
        }
    }

    fn log(min: f64, max: f64, fmt: Fmt) -> Axis {
        let (a, b) = (min.log10(), max.log10());
        let span = (b - a).max(0.6);
        let mid = (a + b) / 2.0;
        let (a, b) = if b - a < 0.6 {
            (mid - span / 2.0, mid + span / 2.0)
        } else {
            (a, b)
        };
        let pad = 0.06 * span;
        let (lo, hi) = (a - pad, b + pad);
        let in_range = |v: f64| v.log10() >= lo - 1e-9 && v.log10() <= hi + 1e-9;
        let decades: Vec<i32> = ((lo.floor() as i32)..=(hi.ceil() as i32)).collect();
        let mult = |ms: &[f64]| -> Vec<f64> {
            decades
                .iter()
                .flat_map(|&e| ms.iter().map(move |m| m * 10f64.powi(e)))
                .filter(|v| in_range(*v))
                .map(f64::log10)
                .collect()
        };
        let mut ticks = mult(&[1.0]);
        if ticks.len() > 7 {
            let step = ticks.len().div_ceil(7);
            ticks = ticks.into_iter().step_by(step).collect();
        }
        if ticks.len() < 3 {
            ticks = mult(&[1.0, 2.0, 5.0]);
        }
        if ticks.len() < 3 {
            ticks = mult(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]);
        }
        let minor = if span <= 6.0 {
            mult(&[2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])
        } else {
            Vec::new()
        };
        Axis {
            log: true,
            lo,
            hi,
            data_hi: hi,
            ticks,
            minor,
            fmt,
            labels: Vec::new(),
        }
    }

    fn linear(min: f64, max: f64, zero: bool, fmt: Fmt) -> Axis {
        let (mut min, mut max) = (min, max);
        if zero {
            min = min.min(0.0);
            max = max.max(0.0);
        }
        if (max - min).abs() < 1e-12 {
            let d = if max.abs() > 0.0 {
                max.abs() * 0.2
            } else {
                1.0
            };
            min -= d;
            max += d;
            if zero && min < 0.0 && max > 0.0 && min > -d * 1.01 {
                min = 0.0;
            }
        }
        let step = nice_step((max - min) / 5.0);
        let (lo, hi) = if zero && min >= 0.0 {
            (0.0, ((max + 0.04 * (max - min)) / step).ceil() * step)
        } else {
            // Not anchored at zero: a margin so that points do not sit on the frame.
            let pad = 0.06 * (max - min);
            (min - pad, max + pad)
        };
        let mut ticks = Vec::new();
        let mut t = (lo / step).ceil() * step;
        while t <= hi + step * 1e-6 {
            ticks.push(if t.abs() < step * 1e-9 { 0.0 } else { t });
            t += step;
        }
        Axis {
            log: false,
            lo,
            hi,
            data_hi: hi,
            ticks,
            minor: Vec::new(),
            fmt,
            labels: Vec::new(),
        }
    }

    /// 0–100 %, ticks every 20.
    pub fn percent() -> Axis {
        Axis {
            log: false,
            lo: 0.0,
            hi: 104.0,
            data_hi: 104.0,
            ticks: (0..=5).map(|i| i as f64 * 20.0).collect(),
            minor: Vec::new(),
            fmt: Fmt::Num,
            labels: Vec::new(),
        }
    }

    /// A categorical axis: one slot per label at 0, 1, ….
    pub fn categories(labels: Vec<String>) -> Axis {
        let n = labels.len().max(1) as f64;
        Axis {
            log: false,
            lo: -0.5,
            hi: n - 0.5,
            data_hi: n - 0.5,
            ticks: (0..labels.len()).map(|i| i as f64).collect(),
            minor: Vec::new(),
            fmt: Fmt::Labels,
            labels,
        }
    }

    /// Labelled ticks at these data values (a few distinct lengths read better than
    /// round numbers); the automatic ticks become light grid lines.
    pub fn with_ticks_at(mut self, values: &[f64]) -> Axis {
        let mut t: Vec<f64> = values
            .iter()
            .filter(|v| self.ok(**v))
            .map(|v| self.map(*v))
            .collect();
        t.sort_by(f64::total_cmp);
        t.dedup_by(|a, b| (*a - *b).abs() < 1e-9);
        if t.is_empty() || t.len() > 9 {
            return self;
        }
        self.minor.append(&mut self.ticks);
        self.ticks = t;
        self
    }

    /// Reserve a band above the data for cells that failed (OOM, error), a fraction
    /// of the axis.
    pub fn with_fail_band(mut self, frac: f64) -> Axis {
        let span = self.hi - self.lo;
        self.data_hi = self.hi;
        self.hi += span * frac;
        self
    }

    /// Start the axis below zero by `frac` of its span (room for engine tags under
    /// bars). The ticks stay where they are.
    pub fn with_floor(mut self, frac: f64) -> Axis {
        self.lo -= (self.hi - self.lo) * frac;
        self
    }

    /// A data value in axis space.
    pub fn map(&self, v: f64) -> f64 {
        if self.log {
            v.log10()
        } else {
            v
        }
    }

    /// A data value from axis space (integers come back exact).
    pub fn unmap(&self, a: f64) -> f64 {
        if !self.log {
            return a;
        }
        let v = 10f64.powf(a);
        if (v - v.round()).abs() <= 1e-9 * v.abs().max(1.0) {
            v.round()
        } else {
            v
        }
    }

    /// Whether a data value can be drawn on this axis.
    pub fn ok(&self, v: f64) -> bool {
        v.is_finite() && (!self.log || v > 0.0)
    }

    pub fn label(&self, a: f64) -> String {
        match self.fmt {
            Fmt::Labels => {
                let i = a.round();
                if (a - i).abs() < 1e-6 && i >= 0.0 {
                    self.labels.get(i as usize).cloned().unwrap_or_default()
                } else {
                    String::new()
                }
            }
            _ if a > self.data_hi + 1e-9 || a < self.lo - 1e-9 => String::new(),
            Fmt::Count => {
                // One style per axis: 1K, 10K when the ticks reach ten thousand,
                // else plain numbers (800, 1000, 1200).
                let big = self.ticks.iter().any(|t| self.unmap(*t).abs() >= 1e4);
                let v = self.unmap(a);
                if big {
                    fmt_count(v)
                } else {
                    fmt_num(v)
                }
            }
            Fmt::Num => fmt_num(self.unmap(a)),
        }
    }

    pub fn coord(&self) -> AxisCoord {
        let ticks: Vec<f64> = self
            .ticks
            .iter()
            .copied()
            .filter(|t| *t >= self.lo - 1e-9 && *t <= self.data_hi + 1e-9)
            .collect();
        let mut light = self.minor.clone();
        light.extend(ticks.iter().copied());
        AxisCoord {
            lo: self.lo,
            hi: self.hi,
            ticks,
            light,
        }
    }
}

/// A linear coordinate in axis space whose ticks (labelled) and light grid lines are
/// the ones [`Axis`] chose.
#[derive(Debug, Clone)]
pub struct AxisCoord {
    lo: f64,
    hi: f64,
    ticks: Vec<f64>,
    light: Vec<f64>,
}

impl Ranged for AxisCoord {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        let f = (v - self.lo) / (self.hi - self.lo);
        let len = (limit.1 - limit.0) as f64;
        if !f.is_finite() {
            return limit.0;
        }
        limit.0 + (len * f + 1e-3).floor() as i32
    }

    fn key_points<H: KeyPointHint>(&self, hint: H) -> Vec<f64> {
        if hint.weight().allow_light_points() {
            self.light.clone()
        } else {
            self.ticks.clone()
        }
    }

    fn range(&self) -> std::ops::Range<f64> {
        self.lo..self.hi
    }
}

fn nice_step(raw: f64) -> f64 {
    if raw <= 0.0 || !raw.is_finite() {
        return 1.0;
    }
    let mag = 10f64.powf(raw.log10().floor());
    let n = raw / mag;
    let m = if n < 1.5 {
        1.0
    } else if n < 3.0 {
        2.0
    } else if n < 7.0 {
        5.0
    } else {
        10.0
    };
    m * mag
}

pub type Chart<'a, DB> = ChartContext<'a, DB, Cartesian2d<AxisCoord, AxisCoord>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_axes_have_ticks_even_inside_one_decade() {
        let a = Axis::auto(&[0.3, 0.9], Some(true), false, Fmt::Num);
        assert!(a.log);
        assert!(a.ticks.len() >= 3, "{:?}", a.ticks);
        let b = Axis::auto(&[1.0, 1e5], None, false, Fmt::Count);
        assert!(b.log, "five decades: log");
        let c = Axis::auto(&[1.0, 4.0], None, true, Fmt::Count);
        assert!(!c.log, "less than a decade: linear");
        assert_eq!(c.lo, 0.0);
    }
}
