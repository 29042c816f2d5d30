//! One style for every figure: the embedded font, the fixed engine → colour map, line
//! styles by attention implementation, axes (log where the data span decades, with
//! ticks chosen here rather than by the backend), the title and notes around the plot
//! area, legends outside the data, markers for cells that ran out of memory, and error
//! bars over repeats.

use crate::{Draw, Error, FigureId};
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::{FontStyle, RGBColor};
use std::sync::OnceLock;

/// Every figure's canvas, pixels.
pub const SIZE: (u32, u32) = (1600, 1000);
/// The family the embedded font is registered under; SVG viewers without it fall
/// back to their sans-serif.
pub const FONT: &str = "DejaVu Sans, sans-serif";
static FONT_BYTES: &[u8] = include_bytes!("../fonts/DejaVuSans.ttf");

pub const LEGEND_W: u32 = 330;
const GRID: RGBColor = RGBColor(225, 225, 225);
const GRID_LIGHT: RGBColor = RGBColor(242, 242, 242);
pub const INK: RGBColor = RGBColor(30, 30, 30);
pub const MUTED: RGBColor = RGBColor(95, 95, 95);
pub const FAIL_BAND: RGBColor = RGBColor(246, 236, 236);

/// Register the embedded font once per process.
pub fn register_font() -> Result<(), Error> {
    static DONE: OnceLock<bool> = OnceLock::new();
    let ok = *DONE.get_or_init(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, FONT_BYTES).is_ok()
    });
    if ok {
        Ok(())
    } else {
        Err(Error::Font)
    }
}

/// Plotters errors as this crate's.
pub trait DrawResult<T> {
    fn drawn(self) -> Result<T, Error>;
}

impl<T, E: std::fmt::Display> DrawResult<T> for Result<T, E> {
    fn drawn(self) -> Result<T, Error> {
        self.map_err(|e| Error::Draw(e.to_string()))
    }
}

pub fn font(size: u32) -> TextStyle<'static> {
    TextStyle::from((FONT, size).into_font()).color(&INK)
}

/// The fixed engine → colour map: the same engine has the same colour in every
/// figure. Engines not listed get a colour from a second palette by name.
pub fn engine_color(engine: &str) -> RGBColor {
    match engine {
        "full" => RGBColor(31, 119, 180),
        "h2o" => RGBColor(230, 115, 0),
        "infinigen" => RGBColor(44, 160, 44),
        "streaming" => RGBColor(214, 39, 40),
        "snapkv" => RGBColor(148, 103, 189),
        "quest" => RGBColor(140, 86, 75),
        other => {
            const EXTRA: [RGBColor; 4] = [
                RGBColor(227, 119, 194),
                RGBColor(150, 150, 30),
                RGBColor(23, 170, 190),
                RGBColor(90, 90, 90),
            ];
            let h = other
                .bytes()
                .fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(b as u32));
            EXTRA[h as usize % EXTRA.len()]
        }
    }
}

/// The same hue, darker for the k-th variant (other parameters) of an engine.
pub fn shade(c: RGBColor, k: usize) -> RGBColor {
    let f = 1.0 - 0.28 * (k.min(3) as f64);
    let s = |v: u8| (v as f64 * f).round() as u8;
    RGBColor(s(c.0), s(c.1), s(c.2))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dash {
    Solid,
    Dashed,
    Dotted,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Marker {
    Circle,
    Triangle,
    Square,
    Diamond,
}

/// How a series is drawn: the engine's colour, dash and marker by attention.
#[derive(Debug, Clone, Copy)]
pub struct LineStyle {
    pub color: RGBColor,
    pub dash: Dash,
    pub marker: Marker,
}

/// Dash and marker of an attention implementation: flash solid ●, chunked dashed ▲,
/// eager dotted ■.
pub fn attention_style(attention: &str) -> (Dash, Marker) {
    match attention {
        "flash" => (Dash::Solid, Marker::Circle),
        "chunked" => (Dash::Dashed, Marker::Triangle),
        "eager" => (Dash::Dotted, Marker::Square),
        _ => (Dash::Solid, Marker::Diamond),
    }
}

/// Fill colours of memory and time components (stacked bars).
pub fn component_color(name: &str) -> RGBColor {
    match name {
        "weights" => RGBColor(150, 150, 150),
        "KV (device)" => RGBColor(70, 130, 180),
        "activations (peak)" => RGBColor(240, 190, 60),
        "KV (host)" => RGBColor(120, 90, 160),
        "prefill" => RGBColor(100, 150, 200),
        "decode" => RGBColor(245, 170, 80),
        "cache ops" => RGBColor(200, 80, 80),
        "scheduling + sampling" => RGBColor(190, 190, 190),
        _ => RGBColor(180, 180, 180),
    }
}

/// 1, 128, 1.5K, 10K, 2M: token counts and other integers.
pub fn fmt_count(v: f64) -> String {
    let a = v.abs();
    // Exact integers that are not round thousands stay exact (2048, 4000 → 4K).
    if v.fract() == 0.0 && a < 100_000.0 && a % 1000.0 != 0.0 {
        return format!("{v:.0}");
    }
    let (x, suffix) = if a >= 1e6 {
        (v / 1e6, "M")
    } else if a >= 1e3 {
        (v / 1e3, "K")
    } else {
        (v, "")
    };
    format!("{}{suffix}", trim(x, 2))
}

/// A plain number with at most three significant digits: 0.0012, 0.25, 12, 1500.
pub fn fmt_num(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        return "0".into();
    }
    if a >= 100.0 {
        return format!("{:.0}", v);
    }
    let decimals = (2 - a.log10().floor() as i32).clamp(0, 8) as usize;
    trim(v, decimals)
}

fn trim(v: f64, decimals: usize) -> String {
    let s = format!("{v:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// The byte unit for values up to `max`: (divisor, name).
pub fn byte_unit(max: f64) -> (f64, &'static str) {
    if max >= 1e9 {
        (1e9, "GB")
    } else if max >= 1e6 {
        (1e6, "MB")
    } else {
        (1e3, "KB")
    }
}

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

/// A chart on `area` with a caption, axes and grid.
pub fn chart<'a, DB: DrawingBackend>(
    area: &'a DrawingArea<DB, Shift>,
    caption: &str,
    x: &Axis,
    y: &Axis,
    x_desc: &str,
    y_desc: &str,
) -> Result<Chart<'a, DB>, Error> {
    let mut b = ChartBuilder::on(area);
    if !caption.is_empty() {
        b.caption(caption, font(24));
    }
    let mut c = b
        .margin(12)
        .margin_right(24)
        .x_label_area_size(64)
        .y_label_area_size(92)
        .build_cartesian_2d(x.coord(), y.coord())
        .drawn()?;
    let xf = |v: &f64| x.label(*v);
    let yf = |v: &f64| y.label(*v);
    c.configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .x_label_formatter(&xf)
        .y_label_formatter(&yf)
        .label_style(font(19))
        .axis_desc_style(font(21))
        .bold_line_style(GRID)
        .light_line_style(GRID_LIGHT)
        .axis_style(MUTED)
        .draw()
        .drawn()?;
    if y.hi > y.data_hi + 1e-12 {
        // The band where failed cells are marked.
        c.draw_series(std::iter::once(Rectangle::new(
            [(x.lo, y.data_hi), (x.hi, y.hi)],
            FAIL_BAND.filled(),
        )))
        .drawn()?;
    }
    Ok(c)
}

/// The element of a marker at a point (pixel offsets around it).
pub fn marker<DB: DrawingBackend>(
    c: &mut Chart<'_, DB>,
    at: (f64, f64),
    m: Marker,
    color: RGBColor,
    size: i32,
) -> Result<(), Error> {
    let fill = color.filled();
    let edge = WHITE.stroke_width(1);
    match m {
        Marker::Circle => c
            .draw_series(std::iter::once(
                EmptyElement::at(at)
                    + Circle::new((0, 0), size, fill)
                    + Circle::new((0, 0), size, edge),
            ))
            .map(|_| ()),
        Marker::Triangle => c
            .draw_series(std::iter::once(
                EmptyElement::at(at) + TriangleMarker::new((0, 0), size + 2, fill),
            ))
            .map(|_| ()),
        Marker::Square => c
            .draw_series(std::iter::once(
                EmptyElement::at(at) + Rectangle::new([(-size, -size), (size, size)], fill),
            ))
            .map(|_| ()),
        Marker::Diamond => c
            .draw_series(std::iter::once(
                EmptyElement::at(at)
                    + Polygon::new(
                        vec![(0, -size - 2), (size + 2, 0), (0, size + 2), (-size - 2, 0)],
                        fill,
                    ),
            ))
            .map(|_| ()),
    }
    .drawn()
}

/// A line through `pts` (axis space) in a series' style.
pub fn line<DB: DrawingBackend>(
    c: &mut Chart<'_, DB>,
    pts: &[(f64, f64)],
    s: &LineStyle,
) -> Result<(), Error> {
    if pts.len() < 2 {
        return Ok(());
    }
    let st = s.color.stroke_width(3);
    match s.dash {
        Dash::Solid => c
            .draw_series(LineSeries::new(pts.iter().copied(), st))
            .map(|_| ()),
        Dash::Dashed => c
            .draw_series(DashedLineSeries::new(pts.iter().copied(), 14, 8, st))
            .map(|_| ()),
        Dash::Dotted => c
            .draw_series(DashedLineSeries::new(pts.iter().copied(), 4, 6, st))
            .map(|_| ()),
    }
    .drawn()
}

/// A vertical error bar from `lo` to `hi` (axis space) at `x`, with caps.
pub fn error_bar<DB: DrawingBackend>(
    c: &mut Chart<'_, DB>,
    x: f64,
    lo: f64,
    hi: f64,
    color: RGBColor,
) -> Result<(), Error> {
    let st = color.stroke_width(2);
    c.draw_series([
        PathElement::new(vec![(x, lo), (x, hi)], st),
        PathElement::new(vec![(x, lo), (x, lo)], st),
    ])
    .drawn()?;
    c.draw_series([lo, hi].into_iter().map(|y| {
        EmptyElement::at((x, y)) + PathElement::new(vec![(-7, 0), (7, 0)], color.stroke_width(2))
    }))
    .drawn()?;
    Ok(())
}

/// One legend entry.
pub enum LegendItem {
    /// A heading (bold-ish text, no glyph).
    Heading(String),
    Line(String, LineStyle),
    Fill(String, RGBColor),
    Fail(String),
    /// A thin horizontal tick (an observed value marked on a bar).
    Tick(String, RGBColor),
    Dashed(String, RGBColor),
    /// A hatched box (bars of cells that did not finish).
    Hatch(String),
}

/// Draw a legend in its own area (right of the plots, so it never covers data).
pub fn legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    items: &[LegendItem],
) -> Result<(), Error> {
    let mut y = 70;
    let row = 30;
    // Long labels take two lines (or more) instead of running off the canvas.
    let text = |area: &DrawingArea<DB, Shift>, t: &str, y: i32| -> Result<i32, Error> {
        let lines = wrap(t, 25);
        for (i, l) in lines.iter().enumerate() {
            area.draw_text(l.trim(), &font(18), (62, y + 22 * i as i32))
                .drawn()?;
        }
        Ok(22 * (lines.len().max(1) as i32 - 1))
    };
    for it in items {
        let mut extra = 0;
        match it {
            LegendItem::Heading(t) => {
                y += 6;
                area.draw_text(t, &font(19).color(&MUTED), (8, y)).drawn()?;
            }
            LegendItem::Line(t, s) => {
                let st = s.color.stroke_width(3);
                let cy = y + 10;
                match s.dash {
                    Dash::Solid => area
                        .draw(&PathElement::new(vec![(8, cy), (52, cy)], st))
                        .drawn()?,
                    Dash::Dashed => {
                        for x0 in [8, 30] {
                            area.draw(&PathElement::new(vec![(x0, cy), (x0 + 14, cy)], st))
                                .drawn()?
                        }
                    }
                    Dash::Dotted => {
                        for x0 in (8..52).step_by(10) {
                            area.draw(&PathElement::new(vec![(x0, cy), (x0 + 4, cy)], st))
                                .drawn()?
                        }
                    }
                }
                let fill = s.color.filled();
                let c = (30, cy);
                match s.marker {
                    Marker::Circle => area.draw(&Circle::new(c, 6, fill)).drawn()?,
                    Marker::Triangle => area.draw(&TriangleMarker::new(c, 8, fill)).drawn()?,
                    Marker::Square => area
                        .draw(&Rectangle::new([(24, cy - 6), (36, cy + 6)], fill))
                        .drawn()?,
                    Marker::Diamond => area
                        .draw(&Polygon::new(
                            vec![(30, cy - 8), (38, cy), (30, cy + 8), (22, cy)],
                            fill,
                        ))
                        .drawn()?,
                }
                extra = text(area, t, y)?;
            }
            LegendItem::Fill(t, color) => {
                area.draw(&Rectangle::new([(12, y + 1), (48, y + 19)], color.filled()))
                    .drawn()?;
                extra = text(area, t, y)?;
            }
            LegendItem::Fail(t) => {
                let cy = y + 10;
                let st = INK.stroke_width(3);
                area.draw(&PathElement::new(vec![(22, cy - 8), (38, cy + 8)], st))
                    .drawn()?;
                area.draw(&PathElement::new(vec![(22, cy + 8), (38, cy - 8)], st))
                    .drawn()?;
                extra = text(area, t, y)?;
            }
            LegendItem::Tick(t, color) => {
                let cy = y + 10;
                area.draw(&PathElement::new(
                    vec![(10, cy), (50, cy)],
                    color.stroke_width(4),
                ))
                .drawn()?;
                extra = text(area, t, y)?;
            }
            LegendItem::Hatch(t) => {
                area.draw(&Rectangle::new(
                    [(12, y + 1), (48, y + 19)],
                    MUTED.stroke_width(2),
                ))
                .drawn()?;
                for k in 0..4 {
                    let x0 = 12 + 9 * k;
                    area.draw(&PathElement::new(
                        vec![(x0, y + 19), (x0 + 9, y + 1)],
                        MUTED.stroke_width(1),
                    ))
                    .drawn()?;
                }
                extra = text(area, t, y)?;
            }
            LegendItem::Dashed(t, color) => {
                let cy = y + 10;
                for x0 in [8, 30] {
                    area.draw(&PathElement::new(
                        vec![(x0, cy), (x0 + 14, cy)],
                        color.stroke_width(3),
                    ))
                    .drawn()?;
                }
                extra = text(area, t, y)?;
            }
        }
        y += row + extra;
    }
    Ok(())
}

/// The figure's title lines.
pub struct Title {
    pub figure: FigureId,
    pub context: String,
}

/// Split `body` into the plot area and the legend column on its right.
pub fn with_legend<DB: DrawingBackend>(
    body: &DrawingArea<DB, Shift>,
) -> (DrawingArea<DB, Shift>, DrawingArea<DB, Shift>) {
    let (w, _) = body.dim_in_pixel();
    body.split_horizontally(w.saturating_sub(LEGEND_W))
}

/// What fills one panel of a [`TwoPanels`] figure.
pub trait DrawPanel {
    fn draw_panel<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> Result<(), Error>;
}

/// A figure of two panels side by side with the legend in a column on their right.
pub struct TwoPanels<L, R> {
    left: L,
    right: R,
    /// The left panel's share of the plot width, percent (at most 100).
    left_percent: u32,
    legend: Vec<LegendItem>,
    notes: Vec<String>,
}

impl<L, R> TwoPanels<L, R> {
    pub fn new(
        left: L,
        right: R,
        left_percent: u32,
        legend: Vec<LegendItem>,
        notes: Vec<String>,
    ) -> Self {
        TwoPanels {
            left,
            right,
            left_percent: left_percent.min(100),
            legend,
            notes,
        }
    }
}

impl<L: DrawPanel, R: DrawPanel> Draw for TwoPanels<L, R> {
    fn notes(&self) -> Vec<String> {
        self.notes.clone()
    }

    fn draw<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> Result<(), Error> {
        let (plots, legend_area) = with_legend(area);
        let (w, _) = plots.dim_in_pixel();
        let (a, b) = plots.split_horizontally(w.saturating_mul(self.left_percent) / 100);
        self.left.draw_panel(&a)?;
        self.right.draw_panel(&b)?;
        legend(&legend_area, &self.legend)
    }
}

/// Wrap `text` at about `width` characters.
pub fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines = Vec::new();
    let mut cur = String::new();
    for w in text.split_whitespace() {
        if !cur.is_empty() && cur.chars().count() + 1 + w.chars().count() > width {
            lines.push(std::mem::take(&mut cur));
            cur.push_str("    ");
        } else if !cur.is_empty() && !cur.trim().is_empty() {
            cur.push(' ');
        }
        cur.push_str(w);
    }
    if !cur.trim().is_empty() {
        lines.push(cur);
    }
    lines
}

const MAX_NOTE_LINES: usize = 7;

/// White canvas, the title (figure, subject; model, device, experiment) on top, the
/// notes at the bottom; returns the area in between.
pub fn frame<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &Title,
    notes: &[String],
) -> Result<DrawingArea<DB, Shift>, Error> {
    root.fill(&WHITE).drawn()?;
    let (_, h) = root.dim_in_pixel();
    let (head, rest) = root.split_vertically(92);
    let num = &title.figure.name()[3..];
    head.draw_text(
        &format!("Fig. {num} — {}", title.figure.subject()),
        &font(31),
        (24, 14),
    )
    .drawn()?;
    head.draw_text(&title.context, &font(20).color(&MUTED), (24, 56))
        .drawn()?;
    let mut lines: Vec<String> = notes.iter().flat_map(|n| wrap(n, 150)).collect();
    if lines.len() > MAX_NOTE_LINES {
        let more = lines.len() - (MAX_NOTE_LINES - 1);
        lines.truncate(MAX_NOTE_LINES - 1);
        lines.push(format!(
            "… {more} more note line(s): see the output of `kvbench plot`"
        ));
    }
    let foot_h = if lines.is_empty() {
        8
    } else {
        16 + 24 * lines.len() as u32
    };
    let (body, foot) = rest.split_vertically((h - 92).saturating_sub(foot_h));
    if !lines.is_empty() {
        foot.draw(&PathElement::new(
            vec![(24, 4), (SIZE.0 as i32 - 24, 4)],
            GRID.stroke_width(1),
        ))
        .drawn()?;
    }
    for (i, l) in lines.iter().enumerate() {
        foot.draw_text(l, &font(17).color(&MUTED), (24, 12 + 24 * i as i32))
            .drawn()?;
    }
    Ok(body)
}

/// The placeholder of a figure with nothing to draw.
pub fn no_data<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, why: &str) -> Result<(), Error> {
    let (w, h) = area.dim_in_pixel();
    area.draw(&Rectangle::new(
        [(40, 20), (w as i32 - 40, h as i32 - 20)],
        GRID.stroke_width(2),
    ))
    .drawn()?;
    let center = Pos::new(HPos::Center, VPos::Center);
    area.draw_text(
        "No data",
        &font(44).color(&MUTED).pos(center),
        (w as i32 / 2, h as i32 / 2 - 60),
    )
    .drawn()?;
    for (i, l) in wrap(why, 100).iter().enumerate() {
        area.draw_text(
            l.trim(),
            &font(21).color(&INK).pos(center),
            (w as i32 / 2, h as i32 / 2 + 10 + 30 * i as i32),
        )
        .drawn()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_short() {
        assert_eq!(fmt_count(128.0), "128");
        assert_eq!(fmt_count(1000.0), "1K");
        assert_eq!(fmt_count(1500.0), "1500");
        assert_eq!(fmt_count(2048.0), "2048");
        assert_eq!(fmt_count(4000.0), "4K");
        assert_eq!(fmt_count(1.5e6), "1.5M");
        assert_eq!(fmt_count(131_000.0), "131K");
        assert_eq!(fmt_num(0.00123), "0.00123");
        assert_eq!(fmt_num(0.25), "0.25");
        assert_eq!(fmt_num(12.0), "12");
        assert_eq!(fmt_num(1500.0), "1500");
    }

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

    #[test]
    fn engines_keep_their_documented_colours() {
        // The hue a colour reads as: its strongest channel, orange a red with half the green.
        let hue = |c: RGBColor| {
            let (r, g, b) = (c.0 as u32, c.1 as u32, c.2 as u32);
            if b > r && b > g {
                "blue"
            } else if g > r && g > b {
                "green"
            } else if r > g && g > b && 3 * g > r {
                "orange"
            } else if r > g && r > b {
                "red"
            } else {
                "other"
            }
        };
        // docs/figures-and-report.md: full blue, h2o orange, infinigen green, streaming red.
        let documented = [
            ("full", "blue"),
            ("h2o", "orange"),
            ("infinigen", "green"),
            ("streaming", "red"),
        ];
        for (engine, want) in documented {
            let c = engine_color(engine);
            assert_eq!(hue(c), want, "{engine}: {c:?}");
        }
        // Every listed engine has its own colour, and an engine not listed gets none of
        // theirs.
        let listed = ["full", "h2o", "infinigen", "streaming", "snapkv", "quest"];
        let colours: Vec<RGBColor> = listed.iter().map(|e| engine_color(e)).collect();
        for (i, a) in colours.iter().enumerate() {
            for (j, b) in colours.iter().enumerate().skip(i + 1) {
                assert_ne!(a, b, "{} and {}", listed[i], listed[j]);
            }
        }
        let other = engine_color("my-policy");
        assert!(!colours.contains(&other), "{other:?}");
        // Variants are darker shades of the same hue.
        let dark = shade(engine_color("h2o"), 1);
        assert_eq!(hue(dark), "orange");
        assert!(dark.0 < engine_color("h2o").0);
    }
}
