//! Fig. 6: decode throughput and the walltime breakdown vs output length (the
//! study's claim C9: `full` ≈15× InfiniGen's throughput at every length, InfiniGen's
//! walltime grows to many times `full`'s).

use crate::bars::Bars;
use crate::data::Run;
use crate::fig5::{bar_line_legend, walltime_bars};
use crate::lines::Panel;
use crate::select::{missing_note, pin, series, series_notes, Dim};
use crate::style::{fmt_count, Fmt, TwoPanels};
use crate::{Prepared, Tables};

pub type Fig6 = TwoPanels<Panel, Bars>;

pub fn prepare(t: &Tables) -> Prepared<Fig6> {
    if let Some(why) = t.no_runs() {
        return Err(why);
    }
    let all: Vec<&Run> = t.runs.iter().collect();
    let mut notes = Vec::new();
    let runs = pin(&all, &[Dim::Output], &mut notes);
    let output = |r: &Run| r.output;
    let tput = series(&runs, |r| r.output, |r| r.get(crate::schema::DECODE_TOK_S));
    let walltime = walltime_bars(
        "Walltime breakdown",
        "output length (tokens)",
        &runs,
        &output,
    );
    let no_tput = tput
        .iter()
        .all(|s| s.points.is_empty() && s.fails.is_empty());
    if no_tput
        && walltime
            .bars
            .iter()
            .all(|b| b.fail.is_none() && b.parts.iter().all(Option::is_none))
    {
        return Err(if runs.iter().any(|r| r.output.is_some()) {
            "neither decode throughput (decode_tok_s) nor the walltime breakdown (wall_*_s) was measured (null) in any cell".into()
        } else {
            "no cell has an output length".into()
        });
    }
    notes.extend(series_notes(&tput, "Decode throughput", fmt_count));
    notes.extend(
        walltime
            .notes()
            .into_iter()
            .filter(|n| !n.contains("did not finish")),
    );
    notes.extend(missing_note(
        t,
        &[
            crate::schema::DECODE_TOK_S,
            crate::schema::WALL_PREFILL_S,
            crate::schema::WALL_DECODE_S,
            crate::schema::WALL_CACHE_OPS_S,
        ],
    ));
    let mut throughput = Panel::fit(
        "Decode throughput",
        "output length (tokens)",
        "decode throughput (tokens/s)",
        tput,
        None,
        None,
        Fmt::Count,
        Fmt::Count,
    );
    let xs: Vec<f64> = runs.iter().filter_map(|r| r.output).collect();
    throughput.x = throughput.x.clone().with_ticks_at(&xs);
    let legend = bar_line_legend(&walltime, &throughput);
    Ok(TwoPanels::new(throughput, walltime, 45, legend, notes))
}
