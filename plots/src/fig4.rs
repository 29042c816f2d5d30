//! Fig. 4: decode throughput and decode throughput per GB of the engine's device
//! memory vs batch size (the study's claims C6/C7: `full` and H2O scale with the
//! batch, InfiniGen stays an order of magnitude lower; H2O is the most efficient
//! per GB).

use crate::data::Run;
use crate::lines::{legend_items, Panel};
use crate::select::{missing_note, pin, series, series_notes, Dim};
use crate::style::{fmt_count, Fmt, TwoPanels};
use crate::{Prepared, Tables};

pub type Fig4 = TwoPanels<Panel, Panel>;

pub fn prepare(t: &Tables) -> Prepared<Fig4> {
    if let Some(why) = t.no_runs() {
        return Err(why);
    }
    let all: Vec<&Run> = t.runs.iter().collect();
    let mut notes = Vec::new();
    let runs = pin(&all, &[Dim::Batch, Dim::Attention], &mut notes);
    let tput = series(&runs, |r| r.batch, |r| r.get(crate::schema::DECODE_TOK_S));
    let per_gb = series(
        &runs,
        |r| r.batch,
        |r| r.get(crate::schema::DECODE_TOK_S_PER_GB),
    );
    let nothing =
        |v: &[crate::select::Series]| v.iter().all(|s| s.points.is_empty() && s.fails.is_empty());
    if nothing(&tput) && nothing(&per_gb) {
        return Err(if runs.iter().any(|r| r.batch.is_some()) {
            "decode throughput (decode_tok_s, decode_tok_s_per_gb) not measured (null) in any cell"
                .into()
        } else {
            "no cell has a batch size".into()
        });
    }
    notes.extend(series_notes(&tput, "Decode throughput", fmt_count));
    notes.extend(
        series_notes(&per_gb, "Throughput per GB", fmt_count)
            .into_iter()
            .filter(|n| n.starts_with("Throughput per GB not measured")),
    );
    notes.push(
        "Per GB: decode tokens/s over the engine's device memory (weights + device KV + activation peak, 10⁹ B)."
            .into(),
    );
    notes.extend(missing_note(
        t,
        &[
            crate::schema::DECODE_TOK_S,
            crate::schema::DECODE_TOK_S_PER_GB,
        ],
    ));
    let mut throughput = Panel::fit(
        "Decode throughput",
        "batch size",
        "decode throughput (tokens/s)",
        tput,
        None,
        None,
        Fmt::Count,
        Fmt::Count,
    );
    let mut per_gb = Panel::fit(
        "Throughput per GB",
        "batch size",
        "decode throughput per GB (tokens/s/GB)",
        per_gb,
        None,
        None,
        Fmt::Count,
        Fmt::Count,
    );
    let xs: Vec<f64> = runs.iter().filter_map(|r| r.batch).collect();
    throughput.x = throughput.x.clone().with_ticks_at(&xs);
    per_gb.x = per_gb.x.clone().with_ticks_at(&xs);
    let legend = legend_items(&[&throughput, &per_gb]);
    Ok(TwoPanels::new(throughput, per_gb, 50, legend, notes))
}
