//! Fig. 7: accuracy vs KV budget, one panel per task, one line per engine variant (an
//! engine with other parameters, e.g. `kv_codec=int4`, is a line of its own), the
//! default full-cache accuracy dashed as the reference (the study's claim C10: budget 0.5 ≈
//! the full cache, near-random accuracy at 0.02–0.04). Reads `accuracy.parquet`
//! (task, engine, budget, correct or accuracy; optional repeat); the retention task
//! is Fig. 8's.

use crate::data::AccRow;
use crate::select::{engine_rank, stats, variant_label, variant_of, variant_styles, Variant};
use crate::style::{self, engine_color, Axis, Fmt, LegendItem, LineStyle};
use crate::{Draw, Error, Prepared, Tables};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::collections::BTreeMap;

/// Accuracy of one engine on one task at one budget: mean, min, max over repeats.
#[derive(Debug, Clone)]
struct Acc {
    budget: f64,
    mean: f64,
    lo: f64,
    hi: f64,
    n: usize,
}

struct Task {
    name: String,
    /// Per engine variant, its points by budget.
    lines: BTreeMap<Variant, Vec<Acc>>,
    reference: Option<f64>,
}

pub struct Fig7 {
    tasks: Vec<Task>,
    x: Axis,
    notes: Vec<String>,
}

/// Mean over items per repeat, then mean and range over repeats. Rows without a
/// repeat form their own group rather than joining repeat 0's.
fn aggregate(rows: &[&AccRow]) -> Option<(f64, f64, f64, usize)> {
    let mut per: BTreeMap<Option<i64>, Vec<f64>> = BTreeMap::new();
    for r in rows {
        per.entry(r.repeat).or_default().push(r.value);
    }
    let means: Vec<f64> = per.values().filter_map(|v| stats(v).map(|s| s.0)).collect();
    stats(&means).map(|(m, lo, hi)| (m, lo, hi, means.len()))
}

pub fn prepare(t: &Tables) -> Prepared<Fig7> {
    let rows = t.accuracy_rows().map_err(|e| {
        format!("{e}. Fig. 7 reads accuracy.parquet: task, engine, budget, correct (or accuracy)")
    })?;
    let rows: Vec<&AccRow> = rows.iter().filter(|r| r.task != "retention").collect();
    if rows.is_empty() {
        return Err("accuracy.parquet has no task other than retention".into());
    }
    let mut by_task: BTreeMap<String, Vec<&AccRow>> = BTreeMap::new();
    for r in &rows {
        by_task.entry(r.task.clone()).or_default().push(r);
    }
    let mut notes = Vec::new();
    notes.extend(t.unfinished_note("accuracy", &["budget", "task"]));
    let mut budgets = Vec::new();
    let mut tasks = Vec::new();
    let mut multi = 0;
    for (name, rs) in by_task {
        // The reference is `full` with its defaults; `full` with other parameters (a KV
        // codec) is a variant like any other.
        let is_ref = |r: &AccRow| r.engine == "full" && r.params.is_empty();
        let full: Vec<&AccRow> = rs.iter().copied().filter(|r| is_ref(r)).collect();
        let reference = aggregate(&full).map(|a| a.0);
        if reference.is_none() {
            notes.push(format!("{name}: no full-cache reference (no `full` rows)."));
        }
        let mut groups: BTreeMap<Variant, BTreeMap<i64, Vec<&AccRow>>> = BTreeMap::new();
        for r in rs.iter().filter(|r| !is_ref(r)) {
            let Some(b) = r.budget.filter(|b| *b > 0.0) else {
                continue;
            };
            groups
                .entry(variant_of(r))
                .or_default()
                .entry((b * 1e6).round() as i64)
                .or_default()
                .push(r);
        }
        let mut lines = BTreeMap::new();
        for (k, per_budget) in groups {
            let mut pts = Vec::new();
            for rs in per_budget.values() {
                let Some(b) = rs[0].budget else { continue };
                if let Some((mean, lo, hi, n)) = aggregate(rs) {
                    budgets.push(b);
                    multi = multi.max(n);
                    pts.push(Acc {
                        budget: b,
                        mean,
                        lo,
                        hi,
                        n,
                    });
                }
            }
            lines.insert(k, pts);
        }
        tasks.push(Task {
            name,
            lines,
            reference,
        });
    }
    if budgets.is_empty() {
        return Err("accuracy.parquet has no rows of a compressing engine with a budget".into());
    }
    if tasks.len() > 6 {
        notes.push(format!(
            "{} tasks: the first 6 are shown ({} left out).",
            tasks.len(),
            tasks.len() - 6
        ));
        tasks.truncate(6);
    }
    if multi > 1 {
        notes.push(format!(
            "Points are means over repeats; bars span min–max (up to {multi} repeats)."
        ));
    }
    let x = Axis::auto(&budgets, None, false, Fmt::Num).with_ticks_at(&budgets);
    Ok(Fig7 { tasks, x, notes })
}

impl Draw for Fig7 {
    fn notes(&self) -> Vec<String> {
        self.notes.clone()
    }

    fn draw<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> Result<(), Error> {
        let (plots, legend) = style::with_legend(area);
        let n = self.tasks.len();
        let cols = if n <= 2 { n.max(1) } else { n.div_ceil(2) };
        let rows = n.div_ceil(cols);
        let cells = plots.split_evenly((rows, cols));
        let y = Axis::percent();
        // `full`'s defaults are the dashed reference: its variants are darker.
        let reference: Variant = (engine_rank("full"), "full".into(), String::new());
        let mut colors = variant_styles(
            self.tasks
                .iter()
                .flat_map(|t| t.lines.keys())
                .chain(std::iter::once(&reference)),
        );
        colors.remove(&reference);
        for (task, cell) in self.tasks.iter().zip(cells.iter()) {
            let mut c = style::chart(
                cell,
                &task.name,
                &self.x,
                &y,
                "KV budget (fraction kept)",
                "accuracy (%)",
            )?;
            if let Some(r) = task.reference {
                c.draw_series(DashedLineSeries::new(
                    [(self.x.lo, r * 100.0), (self.x.hi, r * 100.0)],
                    12,
                    8,
                    engine_color("full").stroke_width(3),
                ))
                .map_err(|e| Error::Draw(e.to_string()))?;
            }
            let m = task.lines.len() as f64;
            for (k, (variant, pts)) in task.lines.iter().enumerate() {
                // Engines with equal accuracy would hide each other: a small sideways shift.
                let dx = (k as f64 - (m - 1.0) / 2.0) * 0.008 * (self.x.hi - self.x.lo);
                let (color, marker) = colors[variant];
                let s = LineStyle {
                    color,
                    dash: style::Dash::Solid,
                    marker,
                };
                let xy: Vec<(f64, f64)> = pts
                    .iter()
                    .filter(|p| self.x.ok(p.budget))
                    .map(|p| (self.x.map(p.budget) + dx, p.mean * 100.0))
                    .collect();
                style::line(&mut c, &xy, &s)?;
                for p in pts.iter().filter(|p| p.n > 1 && p.hi > p.lo) {
                    style::error_bar(
                        &mut c,
                        self.x.map(p.budget) + dx,
                        p.lo * 100.0,
                        p.hi * 100.0,
                        s.color,
                    )?;
                }
                for &pt in &xy {
                    style::marker(&mut c, pt, s.marker, s.color, 6)?;
                }
            }
        }
        let mut items = vec![LegendItem::Heading("engine".into())];
        items.push(LegendItem::Dashed(
            "full cache (reference)".into(),
            engine_color("full"),
        ));
        for (v, &(color, marker)) in &colors {
            items.push(LegendItem::Line(
                variant_label(v),
                LineStyle {
                    color,
                    dash: style::Dash::Solid,
                    marker,
                },
            ));
        }
        style::legend(&legend, &items)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(repeat: Option<i64>, value: f64) -> AccRow {
        AccRow {
            task: "piqa".into(),
            engine: "full".into(),
            budget: Some(1.0),
            repeat,
            value,
            bucket: None,
            turn: None,
            cell_key: None,
            params: String::new(),
        }
    }

    /// Variants of one engine (other parameters, here a KV codec) are lines of their
    /// own, and only `full` with its defaults is the reference: `full` in int4 is a
    /// variant, not averaged into it.
    #[test]
    fn engine_variants_are_lines_of_their_own() {
        use polars::prelude::{Column, DataFrame, NamedFrom, Series};
        let keys = ["k-full", "k-full-int4", "k-h2o", "k-h2o-int4"];
        let runs = DataFrame::new(
            4,
            vec![
                Column::from(Series::new("cell_key".into(), keys.to_vec())),
                Column::from(Series::new(
                    "engine".into(),
                    vec!["full", "full", "h2o", "h2o"],
                )),
                Column::from(Series::new(
                    "cell_params_kv_codec".into(),
                    vec![None, Some("int4"), None, Some("int4")],
                )),
            ],
        )
        .unwrap();
        // (cell, engine, budget, correct of 4 items)
        let cells = [
            ("k-full", "full", 1.0, 4),
            ("k-full-int4", "full", 1.0, 1),
            ("k-h2o", "h2o", 0.5, 3),
            ("k-h2o-int4", "h2o", 0.5, 2),
        ];
        let (mut key, mut engine, mut budget, mut correct) = (vec![], vec![], vec![], vec![]);
        for (k, e, b, c) in cells {
            for item in 0..4 {
                key.push(k);
                engine.push(e);
                budget.push(b);
                correct.push(item < c);
            }
        }
        let acc = DataFrame::new(
            16,
            vec![
                Column::from(Series::new("task".into(), vec!["piqa"; 16])),
                Column::from(Series::new("engine".into(), engine)),
                Column::from(Series::new("budget".into(), budget)),
                Column::from(Series::new("correct".into(), correct)),
                Column::from(Series::new("cell_key".into(), key)),
            ],
        )
        .unwrap();
        let t = Tables::from_frames(std::path::Path::new("x"), Some(&runs), Some(acc), None);
        let f = prepare(&t).unwrap();
        let task = &f.tasks[0];
        assert_eq!(task.reference, Some(1.0));
        let lines: Vec<(String, f64)> = task
            .lines
            .iter()
            .map(|(v, pts)| (variant_label(v), pts[0].mean))
            .collect();
        assert_eq!(
            lines,
            vec![
                ("full (kv_codec=int4)".to_string(), 0.25),
                ("h2o".to_string(), 0.75),
                ("h2o (kv_codec=int4)".to_string(), 0.5),
            ]
        );
        let colors = variant_styles(task.lines.keys());
        let v = |e: &str, p: &str| (engine_rank(e), e.to_string(), p.to_string());
        assert_ne!(
            colors[&v("h2o", "")].0,
            colors[&v("h2o", "kv_codec=int4")].0
        );
        assert_ne!(
            colors[&v("h2o", "")].1,
            colors[&v("h2o", "kv_codec=int4")].1
        );
    }

    #[test]
    fn rows_without_a_repeat_are_not_taken_for_repeat_zero() {
        // Repeat 0 scores 1 on both items; rows that do not say their repeat score 0.
        let rows = [
            row(Some(0), 1.0),
            row(Some(0), 1.0),
            row(None, 0.0),
            row(None, 0.0),
        ];
        let refs: Vec<&AccRow> = rows.iter().collect();
        assert_eq!(aggregate(&refs), Some((0.5, 0.0, 1.0, 2)));
        // A table without repeats at all: one group, as before.
        let none = [row(None, 1.0), row(None, 0.0)];
        let refs: Vec<&AccRow> = none.iter().collect();
        assert_eq!(aggregate(&refs), Some((0.5, 0.5, 0.5, 1)));
    }
}
