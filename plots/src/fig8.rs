//! Fig. 8: retention of a fact stated at the start of a conversation, by context
//! bucket (bars per engine) and by turn (lines per engine) (the study's claim C11:
//! `full` 94–96 %, InfiniGen 92–94 %, H2O 70–78 % and worse at longer contexts).
//! Reads the `retention` task's rows of `accuracy.parquet` (engine, correct,
//! `bucket`, `turn`).

use crate::data::AccRow;
use crate::select::{stats, variant_label, variant_of, variant_styles, Variant};
use crate::style::{
    self, Axis, DrawPanel, DrawResult, Fmt, LegendItem, LineStyle, Marker, TwoPanels,
};
use crate::{Error, Prepared, Tables};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::collections::BTreeMap;

pub type Fig8 = TwoPanels<ByBucket, ByTurn>;

/// Retention by context bucket: bars per engine.
pub struct ByBucket {
    buckets: Vec<String>,
    /// Engine variant → retention (%) per bucket.
    by_bucket: BTreeMap<Variant, Vec<Option<f64>>>,
    colors: BTreeMap<Variant, (RGBColor, Marker)>,
}

/// Retention by turn: a line per engine.
pub struct ByTurn {
    /// Engine variant → (turn, retention %).
    by_turn: BTreeMap<Variant, Vec<(f64, f64)>>,
    colors: BTreeMap<Variant, (RGBColor, Marker)>,
}

/// `1K-2K` → 1000, `8192-16384` → 8192: the bucket's lower bound, for ordering.
fn bucket_start(b: &str) -> f64 {
    let head: String = b
        .trim()
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == 'K' || *c == 'k')
        .collect();
    let (num, mult) = match head.strip_suffix(['K', 'k']) {
        Some(n) => (n, 1e3),
        None => (head.as_str(), 1.0),
    };
    num.parse::<f64>().map_or(f64::INFINITY, |v| v * mult)
}

/// The study measured retention at one budget (0.3): per engine, only the rows at its
/// budget nearest 0.3, with a note naming them when an engine has several.
fn at_study_budget(rows: Vec<&AccRow>) -> (Vec<&AccRow>, Option<String>) {
    let mut budgets: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for r in &rows {
        if let Some(b) = r.budget {
            budgets.entry(r.engine.as_str()).or_default().push(b);
        }
    }
    let several = budgets.values().any(|v| v.iter().any(|&b| b != v[0]));
    let chosen: BTreeMap<&str, f64> = budgets
        .iter()
        .filter_map(|(e, v)| {
            let b = v
                .iter()
                .copied()
                .min_by(|a, b| (a - 0.3).abs().total_cmp(&(b - 0.3).abs()))?;
            Some((*e, b))
        })
        .collect();
    let note = several.then(|| {
        format!(
            "Budget 0.3 (the study's) or the nearest per engine: {}.",
            chosen
                .iter()
                .map(|(e, b)| format!("{e} {b}"))
                .collect::<Vec<_>>()
                .join(", ")
        )
    });
    let kept = rows
        .into_iter()
        .filter(|r| match (r.budget, chosen.get(r.engine.as_str())) {
            (Some(b), Some(&c)) => b == c,
            _ => true,
        })
        .collect();
    (kept, note)
}

pub fn prepare(t: &Tables) -> Prepared<Fig8> {
    let rows = t.accuracy_rows().map_err(|e| {
        format!("{e}. Fig. 8 reads the retention task of accuracy.parquet: engine, correct, bucket, turn")
    })?;
    let rows: Vec<&AccRow> = rows.iter().filter(|r| r.task == "retention").collect();
    if rows.is_empty() {
        return Err("accuracy.parquet has no `retention` task rows".into());
    }
    let mut notes = Vec::new();
    let (rows, note) = at_study_budget(rows);
    notes.extend(note);
    notes.extend(t.unfinished_note("retention", &["budget", "bucket"]));
    let mut buckets: Vec<String> = rows.iter().filter_map(|r| r.bucket.clone()).collect();
    buckets.sort_by(|a, b| bucket_start(a).total_cmp(&bucket_start(b)).then(a.cmp(b)));
    buckets.dedup();
    let mut by_bucket = BTreeMap::new();
    let mut by_turn = BTreeMap::new();
    // Variants of an engine (other parameters) are series of their own.
    let mut per_engine: BTreeMap<Variant, Vec<&AccRow>> = BTreeMap::new();
    for r in &rows {
        per_engine.entry(variant_of(r)).or_default().push(r);
    }
    let colors = variant_styles(per_engine.keys());
    for (k, rs) in per_engine {
        let bars: Vec<Option<f64>> = buckets
            .iter()
            .map(|b| {
                let v: Vec<f64> = rs
                    .iter()
                    .filter(|r| r.bucket.as_deref() == Some(b))
                    .map(|r| r.value * 100.0)
                    .collect();
                stats(&v).map(|s| s.0)
            })
            .collect();
        let mut turns: BTreeMap<i64, Vec<f64>> = BTreeMap::new();
        for r in &rs {
            if let Some(t) = r.turn {
                turns.entry(t as i64).or_default().push(r.value * 100.0);
            }
        }
        let line: Vec<(f64, f64)> = turns
            .into_iter()
            .filter_map(|(t, v)| stats(&v).map(|s| (t as f64, s.0)))
            .collect();
        by_bucket.insert(k.clone(), bars);
        by_turn.insert(k, line);
    }
    if buckets.is_empty() {
        notes.push("No `bucket` column or values: retention by bucket not shown.".into());
    }
    if by_turn.values().all(Vec::is_empty) {
        notes.push("No `turn` column or values: retention by turn not shown.".into());
    }
    notes.push("Retention: share of conversations whose answer contains the fact (%).".into());
    let mut legend = vec![LegendItem::Heading("engine".into())];
    for v in by_bucket.keys() {
        let (color, marker) = colors[v];
        legend.push(LegendItem::Line(
            variant_label(v),
            LineStyle {
                color,
                dash: style::Dash::Solid,
                marker,
            },
        ));
    }
    Ok(TwoPanels::new(
        ByBucket {
            buckets,
            by_bucket,
            colors: colors.clone(),
        },
        ByTurn { by_turn, colors },
        50,
        legend,
        notes,
    ))
}

impl DrawPanel for ByBucket {
    fn draw_panel<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> Result<(), Error> {
        if self.buckets.is_empty() {
            return style::no_data(area, "no context buckets");
        }
        let x = Axis::categories(self.buckets.clone());
        let y = Axis::percent();
        let mut c = style::chart(
            area,
            "By context bucket",
            &x,
            &y,
            "context (tokens)",
            "retention (%)",
        )?;
        let n = self.by_bucket.len().max(1) as f64;
        let bw = 0.8 / n;
        for (slot, (variant, vals)) in self.by_bucket.iter().enumerate() {
            let color = self.colors[variant].0;
            for (g, v) in vals.iter().enumerate() {
                let Some(v) = v else { continue };
                let x0 = g as f64 - 0.4 + bw * slot as f64 + 0.05 * bw;
                // A measured zero gets a sliver and a label, so it does not read
                // as a missing bar.
                let top = if *v == 0.0 { 0.6 } else { *v };
                c.draw_series(std::iter::once(Rectangle::new(
                    [(x0, 0.0), (x0 + 0.9 * bw, top)],
                    color.filled(),
                )))
                .drawn()?;
                if *v == 0.0 {
                    c.draw_series(std::iter::once(Text::new(
                        "0".to_string(),
                        (x0 + 0.45 * bw, top),
                        style::font(15)
                            .color(&color)
                            .pos(Pos::new(HPos::Center, VPos::Bottom)),
                    )))
                    .drawn()?;
                }
            }
        }
        Ok(())
    }
}

impl DrawPanel for ByTurn {
    fn draw_panel<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> Result<(), Error> {
        let turns: Vec<f64> = self.by_turn.values().flatten().map(|p| p.0).collect();
        if turns.is_empty() {
            return style::no_data(area, "no turns");
        }
        let x = Axis::auto(&turns, Some(false), false, Fmt::Num).with_ticks_at(&turns);
        let y = Axis::percent();
        let mut c = style::chart(area, "By turn", &x, &y, "turn", "retention (%)")?;
        let m = self.by_turn.len() as f64;
        for (k, (variant, pts)) in self.by_turn.iter().enumerate() {
            let dx = (k as f64 - (m - 1.0) / 2.0) * 0.008 * (x.hi - x.lo);
            let pts: Vec<(f64, f64)> = pts.iter().map(|p| (p.0 + dx, p.1)).collect();
            let (color, marker) = self.colors[variant];
            let s = LineStyle {
                color,
                dash: style::Dash::Solid,
                marker,
            };
            style::line(&mut c, &pts, &s)?;
            for &p in &pts {
                style::marker(&mut c, p, s.marker, s.color, 6)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::data::AccRow;

    #[test]
    fn only_the_budget_nearest_the_studys_is_drawn() {
        let row = |engine: &str, budget: f64| AccRow {
            task: "retention".into(),
            engine: engine.into(),
            budget: Some(budget),
            repeat: Some(0),
            value: 1.0,
            bucket: Some("1K-2K".into()),
            turn: Some(1.0),
            cell_key: None,
            params: String::new(),
        };
        let rows = [
            row("full", 1.0),
            row("h2o", 0.5),
            row("h2o", 0.3),
            row("h2o", 0.1),
            row("streaming", 0.1),
            row("streaming", 0.04),
        ];
        let (kept, note) = super::at_study_budget(rows.iter().collect());
        let got: Vec<(&str, Option<f64>)> =
            kept.iter().map(|r| (r.engine.as_str(), r.budget)).collect();
        assert_eq!(
            got,
            [
                ("full", Some(1.0)),
                ("h2o", Some(0.3)),
                ("streaming", Some(0.1))
            ]
        );
        assert_eq!(
            note.as_deref(),
            Some("Budget 0.3 (the study's) or the nearest per engine: full 1, h2o 0.3, streaming 0.1.")
        );
        let one = [row("full", 1.0), row("h2o", 0.3)];
        assert_eq!(super::at_study_budget(one.iter().collect()).1, None);
    }

    #[test]
    fn buckets_sort_by_their_start() {
        assert_eq!(super::bucket_start("1K-2K"), 1000.0);
        assert_eq!(super::bucket_start("8192-16384"), 8192.0);
    }
}
