//! Fig. 2: prefill memory (the ledger's activation peak, score matrices included)
//! and prefill time per request vs prompt length, one line per engine and attention
//! implementation (the study's claims C3/C4: flash attention cuts InfiniGen's prefill
//! memory and latency, eager prefills run out of memory).

use crate::lines::{legend_items, Panel};
use crate::select::{missing_note, pin, series, series_notes, Dim};
use crate::style::{byte_unit, fmt_count, Fmt, TwoPanels};
use crate::{Prepared, Tables};

pub type Fig2 = TwoPanels<Panel, Panel>;

/// Prefill walltime per request (the cell's prefill time over its requests).
fn prefill_per_request(r: &crate::data::Run) -> Option<f64> {
    Some(
        r.get(crate::schema::WALL_PREFILL_S)?
            / r.get(crate::schema::METRICS_NUM_REQUESTS)
                .filter(|n| *n > 0.0)?,
    )
}

pub fn prepare(t: &Tables) -> Prepared<Fig2> {
    if let Some(why) = t.no_runs() {
        return Err(why);
    }
    let fixed: Vec<_> = t
        .runs
        .iter()
        .filter(|r| r.prompt.fixed().is_some())
        .collect();
    if fixed.is_empty() {
        return Err(format!(
            "no cell has a fixed prompt length (all {} cells use a distribution)",
            t.runs.len()
        ));
    }
    let mut notes = Vec::new();
    if fixed.len() < t.runs.len() {
        notes.push(format!(
            "{} cell(s) with a prompt-length distribution not shown.",
            t.runs.len() - fixed.len()
        ));
    }
    let runs = pin(&fixed, &[Dim::Prompt, Dim::Attention], &mut notes);
    let peak = runs
        .iter()
        .filter_map(|r| r.get(crate::schema::MEM_ACTIVATIONS_PEAK_BYTES))
        .fold(0.0, f64::max);
    let (div, unit) = byte_unit(peak);
    let mem = series(
        &runs,
        |r| r.prompt.fixed(),
        |r| {
            r.get(crate::schema::MEM_ACTIVATIONS_PEAK_BYTES)
                .map(|b| b / div)
        },
    );
    // Prefill time: the step traces' prefill walltime per request where measured,
    // else TTFT (which includes queueing when requests wait for each other).
    let finished: Vec<_> = runs
        .iter()
        .filter(|r| r.outcome == crate::data::Outcome::Ok)
        .collect();
    let use_wall =
        !finished.is_empty() && finished.iter().all(|r| prefill_per_request(r).is_some());
    let (lat, what) = if use_wall {
        (
            series(&runs, |r| r.prompt.fixed(), prefill_per_request),
            "prefill time per request (s, log)",
        )
    } else {
        let missing = finished
            .iter()
            .filter(|r| prefill_per_request(r).is_none())
            .count();
        notes.push(format!(
            "Prefill walltime (wall_prefill_s) not measured in {missing} of {} finished cells: TTFT shown instead.",
            finished.len()
        ));
        (
            series(
                &runs,
                |r| r.prompt.fixed(),
                |r| r.get(crate::schema::TTFT_MEAN_S),
            ),
            "TTFT, mean (s, log)",
        )
    };
    notes.extend(series_notes(&mem, "Activation peak", fmt_count));
    let lat_notes = series_notes(&lat, "Prefill time", fmt_count);
    notes.extend(
        lat_notes
            .into_iter()
            .filter(|n| n.starts_with("Prefill time not measured")),
    );
    notes.extend(missing_note(
        t,
        &[
            crate::schema::MEM_ACTIVATIONS_PEAK_BYTES,
            crate::schema::WALL_PREFILL_S,
        ],
    ));
    let mut memory = Panel::fit(
        "Peak activation memory",
        "prompt length (tokens, log)",
        &format!("activations, peak ({unit})"),
        mem,
        Some(true),
        None,
        Fmt::Count,
        Fmt::Num,
    );
    let mut latency = Panel::fit(
        "Prefill latency",
        "prompt length (tokens, log)",
        what,
        lat,
        Some(true),
        Some(true),
        Fmt::Count,
        Fmt::Num,
    );
    let xs: Vec<f64> = runs.iter().filter_map(|r| r.prompt.fixed()).collect();
    memory.x = memory.x.clone().with_ticks_at(&xs);
    latency.x = latency.x.clone().with_ticks_at(&xs);
    if memory.is_empty() && latency.is_empty() {
        return Err("no cell has an activation peak or a prefill time".into());
    }
    let legend = legend_items(&[&memory, &latency]);
    Ok(TwoPanels::new(memory, latency, 50, legend, notes))
}
