//! Line panels shared by the figures: one line per series with markers, min–max bars
//! over repeats, and failed cells marked in a band above the data at their x.

use crate::select::Series;
use crate::style::{self, Axis, DrawPanel, DrawResult, Fmt, LegendItem, MUTED};
use crate::Error;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::collections::BTreeMap;

/// One chart of lines.
pub struct Panel {
    pub caption: String,
    pub x_desc: String,
    pub y_desc: String,
    pub x: Axis,
    pub y: Axis,
    pub series: Vec<Series>,
}

impl DrawPanel for Panel {
    fn draw_panel<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> Result<(), Error> {
        self.draw(area)
    }
}

impl Panel {
    /// A panel whose axes fit its series (failed cells included on x). `x_log` /
    /// `y_log`: force (Some) or choose by span (None).
    #[allow(clippy::too_many_arguments)]
    pub fn fit(
        caption: &str,
        x_desc: &str,
        y_desc: &str,
        series: Vec<Series>,
        x_log: Option<bool>,
        y_log: Option<bool>,
        x_fmt: Fmt,
        y_fmt: Fmt,
    ) -> Panel {
        let xs: Vec<f64> = series
            .iter()
            .flat_map(|s| {
                s.points
                    .iter()
                    .map(|p| p.x)
                    .chain(s.fails.iter().map(|f| f.x))
            })
            .collect();
        let ys: Vec<f64> = series
            .iter()
            .flat_map(|s| s.points.iter().flat_map(|p| [p.lo, p.hi, p.y]))
            .collect();
        let x = Axis::auto(&xs, x_log, false, x_fmt);
        let mut y = Axis::auto(&ys, y_log, !matches!(y_log, Some(true)), y_fmt);
        if series.iter().any(|s| !s.fails.is_empty()) {
            y = y.with_fail_band(0.13);
        }
        Panel {
            caption: caption.to_string(),
            x_desc: x_desc.to_string(),
            y_desc: y_desc.to_string(),
            x,
            y,
            series,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.series
            .iter()
            .all(|s| s.points.is_empty() && s.fails.is_empty())
    }

    pub fn draw<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> Result<(), Error> {
        let (x, y) = (&self.x, &self.y);
        if self.is_empty() {
            let what = if self.caption.is_empty() {
                "nothing measured".to_string()
            } else {
                format!("{}: nothing measured", self.caption)
            };
            return style::no_data(area, &what);
        }
        let mut c = style::chart(area, &self.caption, x, y, &self.x_desc, &self.y_desc)?;
        // Series that coincide would hide each other: each is moved sideways by a
        // small fraction of the axis (at most ±3 %).
        let m = self.series.len() as f64;
        let step = if m > 1.0 {
            (0.06 / (m - 1.0)).min(0.007)
        } else {
            0.0
        };
        let dodge = |s: &Series| {
            let k = self.series.iter().position(|t| t.key == s.key).unwrap_or(0) as f64;
            (k - (m - 1.0) / 2.0) * step * (x.hi - x.lo)
        };
        for s in &self.series {
            let dx = dodge(s);
            let pts: Vec<(f64, f64)> = s
                .points
                .iter()
                .filter(|p| x.ok(p.x) && y.ok(p.y))
                .map(|p| (x.map(p.x) + dx, y.map(p.y)))
                .collect();
            style::line(&mut c, &pts, &s.style)?;
            for p in &s.points {
                if !(x.ok(p.x) && y.ok(p.y)) {
                    continue;
                }
                if p.n > 1 && p.hi > p.lo && y.ok(p.lo) {
                    style::error_bar(
                        &mut c,
                        x.map(p.x) + dx,
                        y.map(p.lo),
                        y.map(p.hi),
                        s.style.color,
                    )?;
                }
            }
            for &(px, py) in &pts {
                style::marker(&mut c, (px, py), s.style.marker, s.style.color, 6)?;
            }
        }
        // Failed cells: crosses side by side in the band at their x, one label per x.
        let mut at: BTreeMap<i64, (f64, Vec<(RGBColor, bool)>)> = BTreeMap::new();
        for s in &self.series {
            for f in &s.fails {
                if !x.ok(f.x) {
                    continue;
                }
                at.entry((f.x * 1000.0).round() as i64)
                    .or_insert((f.x, Vec::new()))
                    .1
                    .push((s.style.color, f.oom));
            }
        }
        let band_y = y.data_hi + (y.hi - y.data_hi) * 0.42;
        for (fx, marks) in at.into_values() {
            let n = marks.len() as i32;
            let label = match (marks.iter().any(|m| m.1), marks.iter().any(|m| !m.1)) {
                (true, true) => "OOM / error",
                (true, false) => "OOM",
                _ => "error",
            };
            let at = (x.map(fx), band_y);
            c.draw_series(std::iter::once(
                EmptyElement::at(at)
                    + Text::new(
                        label.to_string(),
                        (0, -32),
                        style::font(16)
                            .color(&MUTED)
                            .pos(Pos::new(HPos::Center, VPos::Top)),
                    ),
            ))
            .drawn()?;
            c.draw_series(marks.iter().enumerate().map(|(k, (color, _))| {
                let dx = k as i32 * 18 - (n - 1) * 9;
                let st = color.stroke_width(3);
                EmptyElement::at(at)
                    + PathElement::new(vec![(dx - 7, -7), (dx + 7, 7)], st)
                    + PathElement::new(vec![(dx - 7, 7), (dx + 7, -7)], st)
            }))
            .drawn()?;
        }
        Ok(())
    }
}

/// Legend entries for the series of several panels (each label once), then the
/// failed-cell mark when any panel has one.
pub fn legend_items(panels: &[&Panel]) -> Vec<LegendItem> {
    let mut items = vec![LegendItem::Heading("engine".into())];
    let mut seen = Vec::new();
    let mut fails = false;
    for p in panels {
        for s in &p.series {
            fails |= !s.fails.is_empty();
            if !seen.contains(&s.label) {
                seen.push(s.label.clone());
                items.push(LegendItem::Line(s.label.clone(), s.style));
            }
        }
    }
    if fails {
        items.push(LegendItem::Fail("out of memory / error".into()));
    }
    items
}
