//! Fig. 5: walltime breakdown (prefill, decode, cache operations, scheduling and
//! sampling) stacked per engine vs batch size, and the total latency of the batch
//! (first arrival → last finish) vs batch size (the study's claim C8: `full` stays
//! flat, InfiniGen grows superlinearly with decode-phase transfers).

use crate::bars::Bars;
use crate::data::Run;
use crate::lines::{legend_items, Panel};
use crate::select::{missing_note, pin, series, series_notes, Dim};
use crate::style::{fmt_count, Fmt, LegendItem, TwoPanels};
use crate::{Prepared, Tables};

/// The walltime components of a cell, seconds.
pub fn walltime_bars(
    caption: &str,
    x_desc: &str,
    runs: &[&Run],
    x: &dyn Fn(&Run) -> Option<f64>,
) -> Bars {
    let prefill = |r: &Run| r.get("wall_prefill_s");
    let decode = |r: &Run| r.get("wall_decode_s");
    let cache = |r: &Run| r.get("wall_cache_ops_s");
    let other = |r: &Run| match (
        r.get("metrics_breakdown_scheduling_s"),
        r.get("metrics_breakdown_sampling_s"),
    ) {
        (None, None) => None,
        (a, b) => Some(a.unwrap_or(0.0) + b.unwrap_or(0.0)),
    };
    Bars::build(
        caption,
        x_desc,
        "walltime (s)",
        runs,
        x,
        fmt_count,
        &[
            ("prefill", &prefill),
            ("decode", &decode),
            ("cache ops", &cache),
            ("scheduling + sampling", &other),
        ],
        None,
    )
}

/// Legend of a figure with a bar panel and a line panel: components, then engines.
pub fn bar_line_legend(bars: &Bars, lines: &Panel) -> Vec<LegendItem> {
    let mut items: Vec<LegendItem> = bars
        .legend_items(false)
        .into_iter()
        .filter(|i| !matches!(i, LegendItem::Hatch(_)))
        .collect();
    items.extend(legend_items(&[lines]));
    if bars.has_fails() {
        items.push(LegendItem::Hatch("did not finish (bars)".into()));
    }
    items
}

pub type Fig5 = TwoPanels<Bars, Panel>;

pub fn prepare(t: &Tables) -> Prepared<Fig5> {
    if let Some(why) = t.no_runs() {
        return Err(why);
    }
    let all: Vec<&Run> = t.runs.iter().collect();
    let mut notes = Vec::new();
    let runs = pin(&all, &[Dim::Batch], &mut notes);
    let batch = |r: &Run| r.batch;
    let breakdown = walltime_bars("Walltime breakdown", "batch size", &runs, &batch);
    if breakdown.is_empty() {
        return Err("no cell has a batch size".into());
    }
    let total = series(&runs, |r| r.batch, |r| r.get("metrics_duration_s"));
    notes.extend(
        breakdown
            .notes()
            .into_iter()
            .filter(|n| !n.contains("did not finish")),
    );
    notes.extend(series_notes(&total, "Total latency", fmt_count));
    notes.push(
        "Cache ops include host↔device transfers; the engine label is the tag under each bar."
            .into(),
    );
    notes.extend(missing_note(
        t,
        &[
            "wall_prefill_s",
            "wall_decode_s",
            "wall_cache_ops_s",
            "metrics_duration_s",
        ],
    ));
    let mut total = Panel::fit(
        "Total latency",
        "batch size",
        "total latency, first arrival → last finish (s)",
        total,
        None,
        None,
        Fmt::Count,
        Fmt::Num,
    );
    let xs: Vec<f64> = runs.iter().filter_map(|r| r.batch).collect();
    total.x = total.x.clone().with_ticks_at(&xs);
    let legend = bar_line_legend(&breakdown, &total);
    Ok(TwoPanels::new(breakdown, total, 55, legend, notes))
}
