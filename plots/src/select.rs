//! From cells to what a figure draws: keep one value of every axis a figure does not
//! show (and say which values were left out), group cells into series (engine, its
//! parameters and budget, attention implementation), aggregate repeats (mean and
//! min–max) and keep the cells that ran out of memory or failed.

use crate::data::{Outcome, Run};
use crate::style::{attention_style, engine_color, fmt_count, fmt_num, shade, LineStyle, Marker};
use std::collections::{BTreeMap, BTreeSet};

/// The matrix axes a figure may show or pin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dim {
    Batch,
    Prompt,
    Output,
    Rate,
    Burstiness,
    Concurrency,
    /// Prefill attention with its chunk size (a series in line figures).
    Attention,
}

impl Dim {
    pub const ALL: [Dim; 7] = [
        Dim::Batch,
        Dim::Prompt,
        Dim::Output,
        Dim::Rate,
        Dim::Burstiness,
        Dim::Concurrency,
        Dim::Attention,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Dim::Batch => "batch",
            Dim::Prompt => "prompt_len",
            Dim::Output => "output_len",
            Dim::Rate => "request_rate",
            Dim::Burstiness => "burstiness",
            Dim::Concurrency => "max_concurrency",
            Dim::Attention => "attention",
        }
    }

    /// A sortable key and a label of the run's value on this axis.
    fn value(self, r: &Run) -> (u8, i64, String) {
        let num = |v: Option<f64>, inf: &str| match v {
            Some(x) => (0, (x * 1000.0).round() as i64, fmt_num(x)),
            None => (1, 0, inf.to_string()),
        };
        match self {
            Dim::Batch => num(r.batch, "?"),
            Dim::Prompt => match r.prompt.fixed() {
                Some(v) => (0, v as i64, fmt_count(v)),
                None => (1, 0, r.prompt.label()),
            },
            Dim::Output => num(r.output, "?"),
            Dim::Rate => num(r.rate, "inf"),
            Dim::Burstiness => num(r.burstiness, "1"),
            Dim::Concurrency => num(r.concurrency, "inf"),
            Dim::Attention => {
                let k = SeriesKey::of(r);
                // Ties go to flash (the default), then chunked, then eager.
                let rank = match r.attention.as_str() {
                    "flash" => 0,
                    "chunked" => 1,
                    "eager" => 2,
                    _ => 3,
                };
                (rank, 0, k.attention)
            }
        }
    }
}

/// Keep the runs at one value of every axis not in `free`: the value with the most
/// cells (ties: the smallest). Each axis pinned among several values gets a note.
pub fn pin<'a>(runs: &[&'a Run], free: &[Dim], notes: &mut Vec<String>) -> Vec<&'a Run> {
    let mut keep: Vec<&Run> = runs.to_vec();
    for d in Dim::ALL {
        if free.contains(&d) {
            continue;
        }
        let mut count: BTreeMap<(u8, i64, String), usize> = BTreeMap::new();
        for r in &keep {
            *count.entry(d.value(r)).or_default() += 1;
        }
        if count.len() <= 1 {
            continue;
        }
        let best = count
            .iter()
            .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))
            .map(|(k, _)| k.clone());
        let Some(best) = best else { continue };
        let others: Vec<String> = count
            .keys()
            .filter(|k| **k != best)
            .map(|k| k.2.clone())
            .collect();
        notes.push(format!(
            "{} = {} shown; cells at {} = {} not shown",
            d.name(),
            best.2,
            d.name(),
            others.join(", ")
        ));
        keep.retain(|r| d.value(r) == best);
    }
    keep
}

/// What makes a series: engine, its parameters, its budget, the attention
/// implementation (with its chunk size).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SeriesKey {
    pub engine_rank: u8,
    pub engine: String,
    pub params: String,
    pub budget: String,
    pub attention_rank: u8,
    pub attention: String,
}

/// An engine variant as a series of the accuracy figures: legend order, engine and its
/// parameters (`k=v,k=v`, empty for the defaults).
pub type Variant = (u8, String, String);

/// The variant an accuracy row belongs to.
pub fn variant_of(r: &crate::data::AccRow) -> Variant {
    (engine_rank(&r.engine), r.engine.clone(), r.params.clone())
}

/// `h2o`, or `h2o (kv_codec=int4)` for a variant with parameters.
pub fn variant_label(v: &Variant) -> String {
    if v.2.is_empty() {
        v.1.clone()
    } else {
        format!("{} ({})", v.1, v.2)
    }
}

/// Each variant's colour and marker: its engine's colour, darker for each further
/// variant of that engine among `all`, and a marker of its own (the defaults first,
/// ●; include them even where they are drawn otherwise, as `full`'s reference, so that
/// its variants read apart from it).
pub fn variant_styles<'a>(
    all: impl IntoIterator<Item = &'a Variant>,
) -> std::collections::BTreeMap<Variant, (plotters::style::RGBColor, Marker)> {
    let mut per: std::collections::BTreeMap<&str, std::collections::BTreeSet<&str>> =
        Default::default();
    let all: Vec<&Variant> = all.into_iter().collect();
    for v in &all {
        per.entry(v.1.as_str()).or_default().insert(v.2.as_str());
    }
    all.into_iter()
        .map(|v| {
            let k = per[v.1.as_str()]
                .iter()
                .position(|p| *p == v.2)
                .unwrap_or(0);
            const MARKERS: [Marker; 4] = [
                Marker::Circle,
                Marker::Diamond,
                Marker::Square,
                Marker::Triangle,
            ];
            (v.clone(), (shade(engine_color(&v.1), k), MARKERS[k % 4]))
        })
        .collect()
}

/// Legend order: the fixed colour table's, then the others.
pub fn engine_rank(e: &str) -> u8 {
    crate::style::ENGINE_COLOURS
        .iter()
        .position(|(name, _)| *name == e)
        .map_or(u8::MAX, |i| i as u8)
}

impl SeriesKey {
    pub fn of(r: &Run) -> SeriesKey {
        let budget = match r.budget {
            Some(b) if b < 1.0 && r.engine != "full" => format!("b={}", fmt_num(b)),
            _ => String::new(),
        };
        let attention = match (r.attention.as_str(), r.chunk) {
            ("chunked", Some(c)) => format!("chunked({})", fmt_count(c)),
            (a, _) => a.to_string(),
        };
        SeriesKey {
            engine_rank: engine_rank(&r.engine),
            engine: r.engine.clone(),
            params: r.params.clone(),
            budget,
            attention_rank: match r.attention.as_str() {
                "eager" => 0,
                "chunked" => 1,
                "flash" => 2,
                _ => 3,
            },
            attention,
        }
    }

    /// The engine with its parameters and budget: `h2o (stats=exact) b=0.3`.
    pub fn engine_label(&self) -> String {
        let mut s = self.engine.clone();
        if !self.params.is_empty() {
            s.push_str(&format!(" ({})", self.params));
        }
        if !self.budget.is_empty() {
            s.push(' ');
            s.push_str(&self.budget);
        }
        s
    }

    /// The series without its attention implementation (engine variant).
    pub fn variant(&self) -> (u8, String, String, String) {
        (
            self.engine_rank,
            self.engine.clone(),
            self.params.clone(),
            self.budget.clone(),
        )
    }

    fn attention_base(&self) -> &str {
        self.attention.split('(').next().unwrap_or(&self.attention)
    }
}

/// One point: the mean over repeats and their range.
#[derive(Debug, Clone)]
pub struct Point {
    pub x: f64,
    pub y: f64,
    pub lo: f64,
    pub hi: f64,
    pub n: usize,
}

/// Cells of a series at one x that did not finish: out of memory or an error.
#[derive(Debug, Clone)]
pub struct Failed {
    pub x: f64,
    pub oom: bool,
}

#[derive(Debug, Clone)]
pub struct Series {
    pub key: SeriesKey,
    pub label: String,
    pub style: LineStyle,
    pub points: Vec<Point>,
    pub fails: Vec<Failed>,
    /// Cells that finished but whose y value was not measured (null).
    pub unmeasured: Vec<f64>,
}

/// Mean, min and max.
pub fn stats(v: &[f64]) -> Option<(f64, f64, f64)> {
    if v.is_empty() {
        return None;
    }
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    Some((mean, lo, hi))
}

/// Group `runs` into series of (x, y) points, repeats aggregated.
pub fn series(
    runs: &[&Run],
    x: impl Fn(&Run) -> Option<f64>,
    y: impl Fn(&Run) -> Option<f64>,
) -> Vec<Series> {
    type Cells = BTreeMap<i64, (f64, Vec<f64>, usize, usize, usize)>;
    let mut by: BTreeMap<SeriesKey, Cells> = BTreeMap::new();
    for r in runs {
        let Some(xv) = x(r) else { continue };
        let e = by
            .entry(SeriesKey::of(r))
            .or_default()
            .entry((xv * 1000.0).round() as i64)
            .or_insert((xv, Vec::new(), 0, 0, 0));
        match r.outcome {
            Outcome::Ok => match y(r) {
                Some(v) if v.is_finite() => e.1.push(v),
                _ => e.4 += 1,
            },
            Outcome::Oom => e.2 += 1,
            Outcome::Error => e.3 += 1,
        }
    }
    let mut out: Vec<Series> = by
        .into_iter()
        .map(|(key, cells)| {
            let mut s = Series {
                label: String::new(),
                style: LineStyle {
                    color: engine_color(&key.engine),
                    dash: attention_style(key.attention_base()).0,
                    marker: attention_style(key.attention_base()).1,
                },
                key,
                points: Vec::new(),
                fails: Vec::new(),
                unmeasured: Vec::new(),
            };
            for (xv, ys, oom, err, unmeasured) in cells.into_values() {
                if let Some((m, lo, hi)) = stats(&ys) {
                    s.points.push(Point {
                        x: xv,
                        y: m,
                        lo,
                        hi,
                        n: ys.len(),
                    });
                }
                if oom > 0 {
                    s.fails.push(Failed { x: xv, oom: true });
                }
                if err > 0 {
                    s.fails.push(Failed { x: xv, oom: false });
                }
                if unmeasured > 0 {
                    s.unmeasured.push(xv);
                }
            }
            s
        })
        .collect();
    label(&mut out);
    out
}

/// Labels and shades: the attention implementation appears in the label only when
/// the figure has several; variants of an engine (parameters, budgets) get darker
/// shades of its colour.
pub fn label(series: &mut [Series]) {
    let attentions: BTreeSet<&str> = series.iter().map(|s| s.key.attention.as_str()).collect();
    let several = attentions.len() > 1;
    let mut variants: BTreeMap<String, Vec<(u8, String, String, String)>> = BTreeMap::new();
    for s in series.iter() {
        let v = variants.entry(s.key.engine.clone()).or_default();
        if !v.contains(&s.key.variant()) {
            v.push(s.key.variant());
        }
    }
    for s in series.iter_mut() {
        let vs = &variants[&s.key.engine];
        let k = vs.iter().position(|v| *v == s.key.variant()).unwrap_or(0);
        s.style.color = shade(engine_color(&s.key.engine), k);
        // One variant of an engine: its settings go to a note, the label stays short.
        let engine = if vs.len() > 1 {
            s.key.engine_label()
        } else {
            s.key.engine.clone()
        };
        s.label = if several {
            format!("{engine} · {}", s.key.attention)
        } else {
            engine
        };
    }
}

/// Settings of engines that appear with one variant only (their labels omit them).
pub fn settings_note(series: &[Series]) -> Option<String> {
    let mut per: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
    for s in series {
        per.entry(s.key.engine.as_str())
            .or_default()
            .insert(s.key.engine_label());
    }
    let parts: Vec<String> = per
        .into_iter()
        .filter(|(e, v)| v.len() == 1 && v.iter().next().is_some_and(|l| l != e))
        .filter_map(|(_, v)| v.into_iter().next())
        .collect();
    (!parts.is_empty()).then(|| format!("Engine settings: {}.", parts.join("; ")))
}

/// Notes a line figure shares: failed cells, spread over repeats, unmeasured values,
/// the single attention implementation when only one appears.
pub fn series_notes(series: &[Series], what: &str, x_fmt: fn(f64) -> String) -> Vec<String> {
    let mut notes: Vec<String> = settings_note(series).into_iter().collect();
    let fails: Vec<String> = series
        .iter()
        .filter(|s| !s.fails.is_empty())
        .map(|s| {
            let xs: Vec<String> = s
                .fails
                .iter()
                .map(|f| format!("{}{}", x_fmt(f.x), if f.oom { "" } else { " (error)" }))
                .collect();
            format!("{} at {}", s.label, xs.join(", "))
        })
        .collect();
    if !fails.is_empty() {
        notes.push(format!(
            "Out of memory or failed (× in the shaded band): {}",
            fails.join("; ")
        ));
    }
    let n = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.n))
        .max()
        .unwrap_or(0);
    if n > 1 {
        notes.push(format!(
            "Points are means over repeats; bars span min–max (up to {n} repeats per point)."
        ));
    }
    let unmeasured: Vec<String> = series
        .iter()
        .filter(|s| !s.unmeasured.is_empty())
        .map(|s| {
            let xs: Vec<String> = s.unmeasured.iter().map(|x| x_fmt(*x)).collect();
            format!("{} at {}", s.label, xs.join(", "))
        })
        .collect();
    if !unmeasured.is_empty() {
        notes.push(format!(
            "{what} not measured (null) for cells that finished: {}",
            unmeasured.join("; ")
        ));
    }
    let attentions: BTreeSet<&str> = series.iter().map(|s| s.key.attention.as_str()).collect();
    if attentions.len() == 1 {
        if let Some(a) = attentions.iter().next() {
            notes.push(format!("Prefill attention: {a} for every series."));
        }
    }
    notes
}

/// A note for headline columns the table lacks.
pub fn missing_note(t: &crate::Tables, cols: &[&str]) -> Option<String> {
    let m: Vec<&str> = cols
        .iter()
        .copied()
        .filter(|c| t.missing_columns.contains(*c))
        .collect();
    (!m.is_empty()).then(|| {
        format!(
            "runs.parquet has no column {} (drawn as not measured)",
            m.join(", ")
        )
    })
}
