//! Fig. 1: time to first token vs prompt length, log–log, one line per engine and
//! attention implementation; cells that ran out of memory are marked at their length
//! (the study's claim C1: `full` reaches the longest prompts, eager prefills run out
//! of memory near the score matrix's limit).

use crate::lines::{legend_items, Panel};
use crate::select::{missing_note, pin, series, series_notes, Dim};
use crate::style::{self, fmt_count, Fmt};
use crate::{Draw, Error, Prepared, Tables};
use plotters::coord::Shift;
use plotters::prelude::*;

pub struct Fig1 {
    panel: Panel,
    notes: Vec<String>,
}

pub fn prepare(t: &Tables) -> Prepared<Fig1> {
    if let Some(why) = t.no_runs() {
        return Err(why);
    }
    let mut notes = Vec::new();
    let fixed: Vec<_> = t
        .runs
        .iter()
        .filter(|r| r.prompt.fixed().is_some())
        .collect();
    let dists = t.runs.len() - fixed.len();
    if fixed.is_empty() {
        return Err(format!(
            "no cell has a fixed prompt length (all {} cells use a distribution); \
             TTFT vs prompt length needs prompt_len values such as [1024, 4096, 16384]",
            t.runs.len()
        ));
    }
    if dists > 0 {
        notes.push(format!(
            "{dists} cell(s) with a prompt-length distribution not shown."
        ));
    }
    let runs = pin(&fixed, &[Dim::Prompt, Dim::Attention], &mut notes);
    let s = series(
        &runs,
        |r| r.prompt.fixed(),
        |r| r.get(crate::schema::TTFT_MEAN_S),
    );
    notes.extend(series_notes(&s, "TTFT", fmt_count));
    notes.extend(missing_note(t, &[crate::schema::TTFT_MEAN_S]));
    let xs: Vec<f64> = runs.iter().filter_map(|r| r.prompt.fixed()).collect();
    let mut panel = Panel::fit(
        "",
        "prompt length (tokens, log)",
        "TTFT, mean (s, log)",
        s,
        Some(true),
        Some(true),
        Fmt::Count,
        Fmt::Num,
    );
    panel.x = panel.x.clone().with_ticks_at(&xs);
    // A figure of one empty panel is a figure without data, and says so.
    if panel.is_empty() {
        return Err(format!(
            "TTFT not measured (null) in any of the {} cell(s) at a fixed prompt length",
            runs.len()
        ));
    }
    Ok(Fig1 { panel, notes })
}

impl Draw for Fig1 {
    fn notes(&self) -> Vec<String> {
        self.notes.clone()
    }

    fn draw<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> Result<(), Error> {
        let (plot, legend) = style::with_legend(area);
        self.panel.draw(&plot)?;
        style::legend(&legend, &legend_items(&[&self.panel]))
    }
}
