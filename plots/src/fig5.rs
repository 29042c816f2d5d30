//! Fig. 5: walltime breakdown (prefill, decode, cache operations, scheduling and
//! sampling) stacked per engine vs batch size, and the total latency of the batch
//! (benchmark start → last finish) vs batch size (the study's claim C8: `full` stays
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
    let prefill = |r: &Run| r.get(crate::schema::WALL_PREFILL_S);
    let decode = |r: &Run| r.get(crate::schema::WALL_DECODE_S);
    let cache = |r: &Run| r.get(crate::schema::WALL_CACHE_OPS_S);
    // Both or nothing: a missing half is not measured, not 0.
    let other = |r: &Run| {
        Some(
            r.get(crate::schema::METRICS_BREAKDOWN_SCHEDULING_S)?
                + r.get(crate::schema::METRICS_BREAKDOWN_SAMPLING_S)?,
        )
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
    let total = series(
        &runs,
        |r| r.batch,
        |r| r.get(crate::schema::METRICS_DURATION_S),
    );
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
            crate::schema::WALL_PREFILL_S,
            crate::schema::WALL_DECODE_S,
            crate::schema::WALL_CACHE_OPS_S,
            crate::schema::METRICS_BREAKDOWN_SCHEDULING_S,
            crate::schema::METRICS_BREAKDOWN_SAMPLING_S,
            crate::schema::METRICS_DURATION_S,
        ],
    ));
    let mut total = Panel::fit(
        "Total latency",
        "batch size",
        "total latency, benchmark start → last finish (s)",
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{Outcome, Prompt};

    /// An ok cell of `full` at batch 4 with these metrics.
    fn run(repeat: i64, m: &[(&'static str, f64)]) -> Run {
        Run {
            cell_id: format!("c{repeat}"),
            cell_key: None,
            repeat: Some(repeat),
            engine: "full".into(),
            params: String::new(),
            budget: Some(1.0),
            attention: "flash".into(),
            chunk: None,
            batch: Some(4.0),
            prompt: Prompt::Fixed(64.0),
            output: Some(8.0),
            rate: None,
            burstiness: None,
            concurrency: None,
            outcome: Outcome::Ok,
            error: None,
            m: m.iter().copied().collect(),
        }
    }

    #[test]
    fn a_missing_scheduling_or_sampling_time_is_not_drawn_as_zero() {
        let base = [
            ("wall_prefill_s", 1.0),
            ("wall_decode_s", 2.0),
            ("wall_cache_ops_s", 0.5),
        ];
        let with = |extra: &[(&'static str, f64)]| {
            let mut m = base.to_vec();
            m.extend_from_slice(extra);
            run(0, &m)
        };
        let batch = |r: &Run| r.batch;
        let other = |r: &Run| {
            let runs = [r];
            let b = walltime_bars("w", "batch", &runs, &batch);
            (b.bars[0].parts[3], b.partial())
        };
        let both = with(&[
            ("metrics_breakdown_scheduling_s", 0.25),
            ("metrics_breakdown_sampling_s", 0.5),
        ]);
        assert_eq!(other(&both), (Some(0.75), vec![]));
        // Sampling not recorded: the component is missing (and said so), not
        // scheduling alone with a 0 for sampling.
        let half = with(&[("metrics_breakdown_scheduling_s", 0.25)]);
        assert_eq!(other(&half), (None, vec!["scheduling + sampling"]));
        assert_eq!(other(&with(&[])), (None, vec!["scheduling + sampling"]));
    }

    #[test]
    fn a_repeat_missing_a_component_has_no_total_rather_than_a_smaller_one() {
        let full = [
            ("wall_prefill_s", 1.0),
            ("wall_decode_s", 2.0),
            ("wall_cache_ops_s", 0.5),
        ];
        let a = run(0, &full);
        let b = run(1, &full[..2]); // cache ops not recorded in this repeat
        let c = run(
            2,
            &[
                ("wall_prefill_s", 1.5),
                ("wall_decode_s", 2.0),
                ("wall_cache_ops_s", 0.5),
            ],
        );
        let batch = |r: &Run| r.batch;
        let bars = walltime_bars("w", "batch", &[&a, &b], &batch);
        // One complete repeat: no range (b's 3.0 is not a total of 3.5 with a 0).
        assert_eq!(bars.bars[0].total_range, None);
        assert_eq!(bars.bars[0].parts[2], Some(0.5));
        let bars = walltime_bars("w", "batch", &[&a, &b, &c], &batch);
        assert_eq!(bars.bars[0].total_range, Some((3.5, 4.0)));
    }
}
