//! How a claim is judged: the verdict, points selected along an axis, the parts of a
//! claim checked against a tolerance and their combination, and small numeric helpers.

use super::super::read::*;
use std::collections::{BTreeMap, BTreeSet};

/// What our data says of one claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Agrees,
    Disagrees,
    CannotTell,
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Verdict::Agrees => "agrees",
            Verdict::Disagrees => "disagrees",
            Verdict::CannotTell => "cannot tell",
        })
    }
}

pub struct Claim {
    pub id: &'static str,
    pub text: &'static str,
    pub verdict: Verdict,
    /// Our numbers, or why the data cannot speak to it.
    pub evidence: String,
}

impl Claim {
    /// A verdict that could not be given although some part of the claim was checked
    /// and held (a batch's ratio without the batch grid the claim also needs). A part
    /// that failed would have made the verdict "disagrees".
    pub fn partial(&self) -> bool {
        self.verdict == Verdict::CannotTell && self.evidence.contains(HELD)
    }
}

/// How [`Parts::check`] marks a part that held.
const HELD: &str = ": holds";

pub(crate) fn fmt(x: f64) -> String {
    if (x == x.round() && x.abs() < 1e12) || x.abs() >= 100.0 {
        format!("{x:.0}")
    } else if x.abs() >= 1.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.3}")
    }
}

/// Distinct sorted numeric values of an axis among `runs`.
pub(crate) fn axis(runs: &[&Run], f: impl Fn(&Run) -> Option<f64>) -> Vec<f64> {
    let mut v: Vec<f64> = runs.iter().filter_map(|r| f(r)).collect();
    v.sort_by(f64::total_cmp);
    v.dedup();
    v
}

/// The study ran H2O and InfiniGen at budget 0.3 (InfiniGen's KV budget, H2O's
/// heavy-hitter ratio).
pub(crate) const STUDY_BUDGET: f64 = 0.3;

/// One engine's points at the study's budget, else at the budget nearest it, with a
/// note naming the budget kept when others were set aside.
pub(crate) fn at_study_budget(pts: Vec<&Run>) -> (Vec<&Run>, Option<String>) {
    let d = |r: &Run| r.budget.map_or(f64::INFINITY, |b| (b - STUDY_BUDGET).abs());
    let best = pts.iter().map(|r| d(r)).fold(f64::INFINITY, f64::min);
    if !best.is_finite() {
        return (pts, None);
    }
    let budgets = |v: &[&Run]| {
        let mut b: Vec<f64> = v.iter().filter_map(|r| r.budget).collect();
        b.sort_by(f64::total_cmp);
        b.dedup();
        b.iter().map(f64::to_string).collect::<Vec<_>>().join(", ")
    };
    let all = budgets(&pts);
    let (kept, rest): (Vec<&Run>, Vec<&Run>) =
        pts.into_iter().partition(|r| (d(r) - best).abs() < 1e-9);
    let also = if rest.is_empty() {
        String::new()
    } else {
        format!("; it ran at {all}")
    };
    let note = if best > 1e-9 {
        Some(format!("the nearest to the study's {STUDY_BUDGET}{also}"))
    } else {
        (!rest.is_empty()).then(|| format!("the study's{also}"))
    };
    let note = note.map(|n| format!("{} at budget {} ({n})", kept[0].engine, budgets(&kept)));
    (kept, note)
}

/// `pts` grouped by the workload they ran along `axis`, each group with a label naming
/// the fields that tell it from the others (empty when there is one group).
pub(crate) fn contexts<'a>(pts: &[&'a Run], axis: Axis) -> Vec<(String, Vec<&'a Run>)> {
    let mut groups: BTreeMap<BTreeMap<String, String>, Vec<&Run>> = BTreeMap::new();
    for &r in pts {
        groups.entry(r.context(axis)).or_default().push(r);
    }
    let mut values: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for c in groups.keys() {
        for (k, v) in c {
            values.entry(k.as_str()).or_default().insert(v.as_str());
        }
    }
    let differ: BTreeSet<String> = values
        .into_iter()
        .filter(|(_, v)| v.len() > 1)
        .map(|(k, _)| k.to_string())
        .collect();
    groups
        .into_iter()
        .map(|(c, rs)| (join(&c, |k| differ.contains(k)), rs))
        .collect()
}

/// How many distinct values of `axis` `rs` has.
pub(crate) fn axis_values(rs: &[&Run], axis: Axis) -> usize {
    self::axis(rs, |r| axis.of(r)).len()
}

/// One variant of each engine a claim compares, in one workload: their ok points along
/// the axis.
pub(crate) struct Sel<'a> {
    /// What tells this selection from the others.
    pub(crate) label: String,
    pub(crate) series: BTreeMap<&'static str, Vec<(f64, &'a Run)>>,
}

impl Sel<'_> {
    /// `engine`'s values of `f` along the axis, where it has one.
    pub(crate) fn vals(&self, engine: &str, f: impl Fn(&Run) -> Option<f64>) -> Vec<(f64, f64)> {
        self.series
            .get(engine)
            .into_iter()
            .flatten()
            .filter_map(|(x, r)| Some((*x, f(r)?)))
            .collect()
    }
}

/// For each workload with at least `min_values` values of `axis` (a grid: two), every
/// combination of one variant of each of `engines` (H2O and InfiniGen at the study's
/// budget, else the nearest): the claim is judged on each. Also the notes on the
/// budgets kept.
pub(crate) fn selections<'a>(
    pts: &[&'a Run],
    axis: Axis,
    engines: &[&'static str],
    min_values: usize,
) -> (Vec<Sel<'a>>, Vec<String>) {
    type Series<'a> = BTreeMap<&'static str, Vec<(f64, &'a Run)>>;
    /// Runs of one variant of an engine: its label and its points on the axis.
    type Variant<'a> = (String, Vec<(f64, &'a Run)>);
    let mine: Vec<&Run> = pts
        .iter()
        .copied()
        .filter(|r| engines.contains(&r.engine.as_str()) && axis.of(r).is_some())
        .collect();
    let mut out = Vec::new();
    let mut notes = BTreeSet::new();
    for (ctx, rs) in contexts(&mine, axis) {
        if axis_values(&rs, axis) < min_values {
            continue;
        }
        let mut combos: Vec<(Vec<String>, Series<'a>)> = vec![(Vec::new(), BTreeMap::new())];
        for &e in engines {
            let of_e: Vec<&Run> = rs.iter().copied().filter(|r| r.engine == e).collect();
            let of_e = if e == "full" {
                of_e
            } else {
                let (kept, note) = at_study_budget(of_e);
                notes.extend(note);
                kept
            };
            let mut variants: BTreeMap<String, Variant<'a>> = BTreeMap::new();
            for r in of_e.into_iter().filter(|r| r.ok()) {
                if let Some(x) = axis.of(r) {
                    let v = variants
                        .entry(r.variant_key())
                        .or_insert_with(|| (r.variant(), Vec::new()));
                    v.1.push((x, r));
                }
            }
            if variants.is_empty() {
                continue;
            }
            combos = combos
                .into_iter()
                .flat_map(|(labels, series)| {
                    variants
                        .values()
                        .map(|(l, s)| {
                            let mut labels = labels.clone();
                            labels.push(l.clone());
                            let mut s = s.clone();
                            s.sort_by(|a, b| a.0.total_cmp(&b.0));
                            let mut series = series.clone();
                            series.insert(e, s);
                            (labels, series)
                        })
                        .collect::<Vec<_>>()
                })
                .collect();
        }
        for (labels, series) in combos {
            if series.is_empty() {
                continue;
            }
            let label = std::iter::once(ctx.clone())
                .filter(|c| !c.is_empty())
                .chain(labels)
                .collect::<Vec<_>>()
                .join(", ");
            out.push(Sel { label, series });
        }
    }
    (out, notes.into_iter().collect())
}

/// A claim judged on each selection: as is when there is one; with several, each is
/// named and the claim agrees only when every one that can be judged agrees.
pub(crate) fn each<'a>(
    sels: &[Sel<'a>],
    notes: &[String],
    none: &str,
    f: impl Fn(&Sel<'a>) -> (Verdict, String),
) -> (Verdict, String) {
    if sels.is_empty() {
        return (Verdict::CannotTell, none.to_string());
    }
    combine(
        sels.iter().map(|s| (s.label.clone(), f(s))).collect(),
        notes,
    )
}

/// Verdicts on several variants or workloads as one: any disagreeing makes the claim
/// disagree; otherwise it agrees when at least one could be judged.
pub(crate) fn combine(
    results: Vec<(String, (Verdict, String))>,
    notes: &[String],
) -> (Verdict, String) {
    let prefix: String = notes.iter().map(|n| format!("{n}; ")).collect();
    match results.len() {
        0 => (
            Verdict::CannotTell,
            format!("{prefix}no points of the engines the claim compares"),
        ),
        1 => {
            let (v, e) = results.into_iter().next().unwrap().1;
            (v, format!("{prefix}{e}"))
        }
        n => {
            let judged: Vec<&Verdict> = results
                .iter()
                .map(|r| &r.1 .0)
                .filter(|v| **v != Verdict::CannotTell)
                .collect();
            let v = if judged.is_empty() {
                Verdict::CannotTell
            } else if judged.contains(&&Verdict::Disagrees) {
                Verdict::Disagrees
            } else {
                Verdict::Agrees
            };
            let each: Vec<String> = results
                .iter()
                .map(|(l, (v, e))| format!("[{l}] {v}: {e}"))
                .collect();
            (
                v,
                format!(
                    "{prefix}judged on each of {n} variants (agrees only if every one that can be judged agrees) — {}",
                    each.join(" ")
                ),
            )
        }
    }
}

/// The parts of one claim: what we measured, each part checked (with the claim's
/// number, the tolerance and ours) and whether it held, and what was not checked. A
/// part that fails makes the claim disagree; a required part that cannot be checked
/// makes it "cannot tell".
#[derive(Default)]
pub(crate) struct Parts {
    said: Vec<String>,
    held: Vec<bool>,
    unchecked: Vec<String>,
    required_missing: bool,
}

impl Parts {
    pub(crate) fn say(&mut self, s: String) {
        self.said.push(s);
    }

    pub(crate) fn check(&mut self, ok: bool, s: String) {
        self.held.push(ok);
        self.said
            .push(format!("{s}{}", if ok { HELD } else { ": fails" }));
    }

    /// A part of the claim the data does not speak to; `required`: no verdict without it.
    pub(crate) fn skip(&mut self, s: impl Into<String>, required: bool) {
        self.unchecked.push(s.into());
        self.required_missing |= required;
    }

    pub(crate) fn verdict(self) -> (Verdict, String) {
        let v = if self.held.contains(&false) {
            Verdict::Disagrees
        } else if self.required_missing || self.held.is_empty() {
            Verdict::CannotTell
        } else {
            Verdict::Agrees
        };
        let mut ev = self.said;
        ev.extend(
            self.unchecked
                .into_iter()
                .map(|u| format!("not checked: {u}")),
        );
        (v, ev.join("; "))
    }
}

/// Whether `x` is within a factor `f` of `claim` either way (a NaN never is).
pub(crate) fn within_factor(x: f64, claim: f64, f: f64) -> bool {
    x.is_finite() && x >= claim / f && x <= claim * f
}

/// The range a factor `f` around `claim` accepts, as the evidence writes it.
pub(crate) fn accepted(claim: f64, f: f64) -> String {
    format!("{}–{}×", fmt(claim / f), fmt(claim * f))
}

/// Largest over smallest of `v` (NaN when any value is not finite or positive).
pub(crate) fn spread(v: &[(f64, f64)]) -> f64 {
    if v.iter().any(|x| !(x.1.is_finite() && x.1 > 0.0)) {
        return f64::NAN;
    }
    let hi = v.iter().map(|x| x.1).fold(f64::NEG_INFINITY, f64::max);
    let lo = v.iter().map(|x| x.1).fold(f64::INFINITY, f64::min);
    hi / lo
}

/// The largest of `v` (NaN when any value is NaN).
pub(crate) fn peak(v: &[(f64, f64)]) -> f64 {
    if v.iter().any(|x| x.1.is_nan()) {
        return f64::NAN;
    }
    v.iter().map(|x| x.1).fold(f64::NEG_INFINITY, f64::max)
}

/// Higher at every larger step (a NaN is not).
pub(crate) fn rising(v: &[(f64, f64)]) -> bool {
    v.windows(2).all(|w| w[1].1 > w[0].1)
}

/// Lower at every larger step (a NaN is not).
pub(crate) fn falling(v: &[(f64, f64)]) -> bool {
    v.windows(2).all(|w| w[1].1 < w[0].1)
}

/// `a / b` where both have the same axis value.
pub(crate) fn ratios(a: &[(f64, f64)], b: &[(f64, f64)]) -> Vec<(f64, f64)> {
    a.iter()
        .filter_map(|(x, y)| b.iter().find(|z| z.0 == *x).map(|z| (*x, y / z.1)))
        .collect()
}

pub(crate) const ENGINES: [&str; 3] = ["full", "h2o", "infinigen"];
