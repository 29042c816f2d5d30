//! One style for every figure: the embedded font, the fixed engine → colour map, line
//! styles by attention implementation, axes (log where the data span decades, with
//! ticks chosen here rather than by the backend), the title and notes around the plot
//! area, legends outside the data, markers for cells that ran out of memory, and error
//! bars over repeats.

use crate::{Draw, Error};
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::{FontStyle, RGBColor};
use std::sync::OnceLock;

mod axis;
mod legend;
pub use axis::*;
pub use legend::*;

/// Every figure's canvas, pixels.
pub const SIZE: (u32, u32) = (1600, 1000);
/// The family the embedded font is registered under; SVG viewers without it fall
/// back to their sans-serif.
pub const FONT: &str = "DejaVu Sans, sans-serif";
static FONT_BYTES: &[u8] = include_bytes!("../../fonts/DejaVuSans.ttf");

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

/// The fixed engine → colour map, in legend order: the same engine has the same
/// colour in every figure. Every strategy the engines register is listed (a harness
/// test checks it); engines not listed get a colour from a second palette by name.
pub const ENGINE_COLOURS: &[(&str, RGBColor)] = &[
    ("full", RGBColor(31, 119, 180)),
    ("h2o", RGBColor(230, 115, 0)),
    ("infinigen", RGBColor(44, 160, 44)),
    ("streaming", RGBColor(214, 39, 40)),
    ("snapkv", RGBColor(148, 103, 189)),
    ("quest", RGBColor(140, 86, 75)),
    ("kivi", RGBColor(188, 189, 34)),
    ("hybrid", RGBColor(0, 128, 128)),
];

pub fn engine_color(engine: &str) -> RGBColor {
    if let Some((_, c)) = ENGINE_COLOURS.iter().find(|(e, _)| *e == engine) {
        return *c;
    }
    const EXTRA: [RGBColor; 4] = [
        RGBColor(227, 119, 194),
        RGBColor(120, 120, 220),
        RGBColor(23, 170, 190),
        RGBColor(90, 90, 90),
    ];
    let h = engine
        .bytes()
        .fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(b as u32));
    EXTRA[h as usize % EXTRA.len()]
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
    head.draw_text(&title.heading, &font(31), (24, 14))
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
        let listed: Vec<&str> = ENGINE_COLOURS.iter().map(|(e, _)| *e).collect();
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
