//! Stacked bars by component (memory, walltime) for groups of cells (batch sizes,
//! output lengths), one bar per series in each group. Fills are components; the
//! engine is the coloured tag under each bar (its fixed colour). Failed cells get a
//! hatched bar labelled OOM or error at their place; repeats give min–max bars on the
//! total; an observed value (e.g. the NVML device peak) can be marked on each bar.

use crate::data::{Outcome, Run};
use crate::select::{label, stats, Series, SeriesKey};
use crate::style::{
    self, component_color, Axis, DrawPanel, DrawResult, Fmt, LegendItem, INK, MUTED,
};
use crate::Error;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::collections::BTreeMap;

/// One bar: a series at a group.
#[derive(Debug, Clone)]
pub struct Bar {
    pub group: usize,
    pub slot: usize,
    /// Mean of each component over the cells that finished (None: never measured).
    pub parts: Vec<Option<f64>>,
    /// Min–max of the total over repeats, when there are several.
    pub total_range: Option<(f64, f64)>,
    pub n: usize,
    /// Mean of the observed value marked on the bar.
    pub mark: Option<f64>,
    /// `OOM` or `error` when no cell of the bar finished.
    pub fail: Option<&'static str>,
}

pub struct Bars {
    pub caption: String,
    pub x_desc: String,
    pub y_desc: String,
    pub groups: Vec<String>,
    /// One per slot: the series (label, colour).
    pub slots: Vec<Series>,
    pub components: Vec<&'static str>,
    pub bars: Vec<Bar>,
    /// What the mark on each bar is, if any.
    pub mark_label: Option<String>,
    pub y: Axis,
}

/// How a component or mark is read from a run, in display units.
pub type Getter<'a> = &'a dyn Fn(&Run) -> Option<f64>;

impl DrawPanel for Bars {
    fn draw_panel<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> Result<(), Error> {
        self.draw(area)
    }
}

impl Bars {
    /// Bars of `runs` grouped by `group` (a numeric key, labelled by `group_label`),
    /// one slot per series, stacked `components`.
    #[allow(clippy::too_many_arguments)]
    pub fn build(
        caption: &str,
        x_desc: &str,
        y_desc: &str,
        runs: &[&Run],
        group: &dyn Fn(&Run) -> Option<f64>,
        group_label: fn(f64) -> String,
        components: &[(&'static str, Getter<'_>)],
        mark: Option<(&str, Getter<'_>)>,
    ) -> Bars {
        type Cell<'r> = Vec<&'r Run>;
        let mut by: BTreeMap<SeriesKey, BTreeMap<i64, (f64, Cell)>> = BTreeMap::new();
        for r in runs {
            let Some(g) = group(r) else { continue };
            by.entry(SeriesKey::of(r))
                .or_default()
                .entry((g * 1000.0).round() as i64)
                .or_insert((g, Vec::new()))
                .1
                .push(r);
        }
        let mut gkeys: Vec<(i64, f64)> = by
            .values()
            .flat_map(|m| m.iter().map(|(k, (g, _))| (*k, *g)))
            .collect();
        gkeys.sort_by_key(|k| k.0);
        gkeys.dedup_by_key(|k| k.0);
        let gindex: BTreeMap<i64, usize> =
            gkeys.iter().enumerate().map(|(i, k)| (k.0, i)).collect();
        let mut slots: Vec<Series> = by
            .keys()
            .map(|k| {
                let (dash, marker) = style::attention_style(&k.attention);
                Series {
                    key: k.clone(),
                    label: String::new(),
                    style: style::LineStyle {
                        color: style::engine_color(&k.engine),
                        dash,
                        marker,
                    },
                    points: Vec::new(),
                    fails: Vec::new(),
                    unmeasured: Vec::new(),
                }
            })
            .collect();
        label(&mut slots);
        let mut bars = Vec::new();
        for (slot, cells) in by.values().enumerate() {
            for (gk, (_, rs)) in cells {
                let ok: Vec<&&Run> = rs.iter().filter(|r| r.outcome == Outcome::Ok).collect();
                let parts: Vec<Option<f64>> = components
                    .iter()
                    .map(|(_, get)| {
                        let v: Vec<f64> = ok.iter().filter_map(|r| get(r)).collect();
                        stats(&v).map(|s| s.0)
                    })
                    .collect();
                // A repeat's total over the components the bar stacks; a repeat missing
                // one of them has no total (its missing part is not a 0).
                let stacked: Vec<&Getter<'_>> = components
                    .iter()
                    .zip(&parts)
                    .filter(|(_, p)| p.is_some())
                    .map(|((_, g), _)| g)
                    .collect();
                let totals: Vec<f64> = ok
                    .iter()
                    .filter_map(|r| {
                        let v: Option<Vec<f64>> = stacked.iter().map(|g| g(r)).collect();
                        v.filter(|v| !v.is_empty()).map(|v| v.iter().sum())
                    })
                    .collect();
                let total_range = (totals.len() > 1)
                    .then(|| stats(&totals).map(|s| (s.1, s.2)))
                    .flatten();
                let mark = mark.and_then(|(_, get)| {
                    let v: Vec<f64> = ok.iter().filter_map(|r| get(r)).collect();
                    stats(&v).map(|s| s.0)
                });
                let fail = if !ok.is_empty() {
                    None
                } else if rs.iter().any(|r| r.outcome == Outcome::Oom) {
                    Some("OOM")
                } else {
                    Some("error")
                };
                bars.push(Bar {
                    group: gindex[gk],
                    slot,
                    parts,
                    total_range,
                    n: ok.len(),
                    mark,
                    fail,
                });
            }
        }
        let top = bars
            .iter()
            .flat_map(|b| {
                [
                    b.parts.iter().flatten().sum::<f64>(),
                    b.total_range.map_or(0.0, |r| r.1),
                    b.mark.unwrap_or(0.0),
                ]
            })
            .fold(0.0, f64::max);
        let y = Axis::auto(&[0.0, top], Some(false), true, Fmt::Num).with_floor(0.06);
        let mark_label = mark
            .filter(|_| bars.iter().any(|b| b.mark.is_some()))
            .map(|m| m.0.to_string());
        Bars {
            caption: caption.to_string(),
            x_desc: x_desc.to_string(),
            y_desc: y_desc.to_string(),
            groups: gkeys.iter().map(|k| group_label(k.1)).collect(),
            slots,
            components: components.iter().map(|c| c.0).collect(),
            bars,
            mark_label,
            y,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.bars.is_empty()
    }

    pub fn has_fails(&self) -> bool {
        self.bars.iter().any(|b| b.fail.is_some())
    }

    /// Components not measured (null) in some bar whose cells finished.
    pub fn partial(&self) -> Vec<&'static str> {
        self.components
            .iter()
            .enumerate()
            .filter(|(i, _)| {
                self.bars
                    .iter()
                    .any(|b| b.fail.is_none() && b.parts[*i].is_none())
            })
            .map(|(_, c)| *c)
            .collect()
    }

    pub fn draw<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> Result<(), Error> {
        if self.is_empty() {
            return style::no_data(area, &format!("{}: no cells", self.caption));
        }
        let x = Axis::categories(self.groups.clone());
        let y = &self.y;
        let mut c = style::chart(area, &self.caption, &x, y, &self.x_desc, &self.y_desc)?;
        let n = self.slots.len().max(1) as f64;
        let w = 0.84 / n;
        let span = y.data_hi - 0.0;
        let tag = (y.lo * 0.85, y.lo * 0.2);
        for b in &self.bars {
            let cx = b.group as f64 - 0.42 + w * (b.slot as f64 + 0.5);
            let (x0, x1) = (cx - 0.44 * w, cx + 0.44 * w);
            let color = self.slots[b.slot].style.color;
            c.draw_series(std::iter::once(Rectangle::new(
                [(x0, tag.0), (x1, tag.1)],
                color.filled(),
            )))
            .drawn()?;
            if let Some(what) = b.fail {
                // Hatched bar: the cell is there, it did not finish.
                let h = span * 0.22;
                c.draw_series(std::iter::once(Rectangle::new(
                    [(x0, 0.0), (x1, h)],
                    color.stroke_width(2),
                )))
                .drawn()?;
                let k = 6;
                c.draw_series((0..k).map(|i| {
                    let f0 = i as f64 / k as f64;
                    let f1 = (i + 1) as f64 / k as f64;
                    PathElement::new(
                        vec![(x0, h * f0), (x1, h * f1)],
                        color.mix(0.7).stroke_width(1),
                    )
                }))
                .drawn()?;
                label_at(&mut c, (cx, h), what, INK)?;
                continue;
            }
            let mut base = 0.0;
            for (i, v) in b.parts.iter().enumerate() {
                let Some(v) = v else { continue };
                let fill = component_color(self.components[i]);
                c.draw_series(std::iter::once(Rectangle::new(
                    [(x0, base), (x1, base + v)],
                    fill.filled(),
                )))
                .drawn()?;
                base += v;
            }
            if b.parts.iter().all(Option::is_none) {
                label_at(&mut c, (cx, 0.0), "n/a", MUTED)?;
            } else {
                c.draw_series(std::iter::once(Rectangle::new(
                    [(x0, 0.0), (x1, base)],
                    WHITE.mix(0.9).stroke_width(1),
                )))
                .drawn()?;
            }
            if let Some((lo, hi)) = b.total_range.filter(|(lo, hi)| hi - lo > 0.004 * span) {
                style::error_bar(&mut c, cx, lo, hi, INK)?;
            }
            if let Some(m) = b.mark {
                c.draw_series(std::iter::once(PathElement::new(
                    vec![(x0 - 0.05 * w, m), (x1 + 0.05 * w, m)],
                    INK.stroke_width(4),
                )))
                .drawn()?;
            }
        }
        Ok(())
    }

    /// Legend: components, engines (their tags), the mark, failed cells.
    pub fn legend_items(&self, with_engines: bool) -> Vec<LegendItem> {
        let mut items = vec![LegendItem::Heading(self.caption_short())];
        for c in &self.components {
            items.push(LegendItem::Fill(c.to_string(), component_color(c)));
        }
        if let Some(m) = &self.mark_label {
            items.push(LegendItem::Tick(m.clone(), INK));
        }
        if with_engines {
            items.push(LegendItem::Heading("engine (tag under bar)".into()));
            for s in &self.slots {
                items.push(LegendItem::Fill(s.label.clone(), s.style.color));
            }
        }
        if self.bars.iter().any(|b| b.fail.is_some()) {
            items.push(LegendItem::Hatch("did not finish (OOM / error)".into()));
        }
        items
    }

    fn caption_short(&self) -> String {
        self.caption.to_lowercase()
    }

    /// Notes: repeats, unmeasured components, failed cells.
    pub fn notes(&self) -> Vec<String> {
        let mut notes = Vec::new();
        let n = self.bars.iter().map(|b| b.n).max().unwrap_or(0);
        if n > 1 {
            notes.push(format!(
                "{}: bars are means over repeats; whiskers span the min–max of the total (up to {n} repeats).",
                self.caption
            ));
        }
        let partial = self.partial();
        if !partial.is_empty() {
            notes.push(format!(
                "{}: not measured (null) in cells that finished: {} (left out of those bars; n/a: nothing measured).",
                self.caption,
                partial.join(", ")
            ));
        }
        let fails: Vec<String> = self
            .bars
            .iter()
            .filter_map(|b| {
                b.fail.map(|f| {
                    format!(
                        "{} at {} ({f})",
                        self.slots[b.slot].label, self.groups[b.group]
                    )
                })
            })
            .collect();
        if !fails.is_empty() {
            notes.push(format!(
                "{}: did not finish (hatched): {}.",
                self.caption,
                fails.join(", ")
            ));
        }
        notes
    }
}

fn label_at<DB: DrawingBackend>(
    c: &mut style::Chart<'_, DB>,
    at: (f64, f64),
    text: &str,
    color: RGBColor,
) -> Result<(), Error> {
    c.draw_series(std::iter::once(
        EmptyElement::at(at)
            + Text::new(
                text.to_string(),
                (0, -4),
                style::font(16)
                    .color(&color)
                    .pos(Pos::new(HPos::Center, VPos::Bottom)),
            ),
    ))
    .drawn()?;
    Ok(())
}
