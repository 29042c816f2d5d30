//! The study's claims C1–C11: each judged on the data (C1–C9 in performance.rs, C10 and
//! C11 in accuracy.rs) with the framework of shared.rs.

mod accuracy;
mod performance;
pub(crate) mod shared;

use super::read::*;
use accuracy::{acc_parts, c10, c11};
use kvbench_plots::AccRow;
use performance::*;
use shared::*;
pub use shared::{Claim, Verdict};
use std::collections::BTreeSet;

pub(crate) const CLAIMS: [(&str, &str); 11] = [
    ("C1", "vLLM (full) has the lowest TTFT at every length and reaches 128K; baseline H2O and InfiniGen run out of memory near 10K tokens."),
    ("C2", "Under tensor parallelism OOM comes at shorter prompts than on one GPU."),
    ("C3", "InfiniGen with FlashAttention: −85% prefill memory and −77% latency vs chunked prefill at 15K."),
    ("C4", "H2O gains nothing from FlashAttention (it needs softmax(QKᵀ) for its statistics)."),
    ("C5", "vLLM pre-allocates its memory regardless of batch; H2O needs about half of it at the largest batch; InfiniGen's GPU memory is like H2O's, its host memory over 2.5× the others'."),
    ("C6", "vLLM and H2O decode throughput grows with batch to a similar peak; InfiniGen is an order of magnitude lower at every batch."),
    ("C7", "Throughput per GB: H2O ≈3× vLLM; InfiniGen poor and falling with batch."),
    ("C8", "Total latency: vLLM about flat across batch; H2O grows moderately; InfiniGen grows superlinearly, 14× vLLM at the largest batch."),
    ("C9", "Output scaling (long prompt): vLLM ≈15× InfiniGen throughput at every output length."),
    ("C10", "Accuracy: budget 0.5 ≈ baseline; at 0.1 InfiniGen −6 pp on average, H2O loses more on some tasks; 0.02–0.04 near random; budget ≥ 0.3 keeps most tasks within 10 pp."),
    ("C11", "Retention: vLLM 94–96%, InfiniGen 92–94%, H2O 70–78%, H2O worse at longer contexts."),
];

/// The batch sizes of the study's batch grid (§IV-B), smallest and largest.
pub(crate) const STUDY_BATCHES: (f64, f64) = (16.0, 96.0);

/// The claims, judged on `runs` (repeats of a cell averaged into one point).
pub fn judge(runs: &[Run]) -> Vec<Claim> {
    let pts = points(runs);
    let perf: Vec<&Run> = pts.iter().filter(|r| r.is_performance()).collect();
    let engines: BTreeSet<&str> = perf.iter().map(|r| r.engine.as_str()).collect();
    let prompts = axis(&perf, Run::prompt);
    let batches = axis(&perf, |r| r.batch);
    let outputs = axis(&perf, |r| r.output_len);
    let ttft_grid = prompts.len() >= 2 && outputs.iter().all(|&o| o <= 1.0);
    let batch_grid = batches.len() >= 2;
    // One batch size inside the study's grid (16–96): the claims made for every batch
    // of that grid can be refuted there.
    let one_study_batch =
        matches!(batches[..], [b] if (STUDY_BATCHES.0..=STUDY_BATCHES.1).contains(&b));
    let output_grid = outputs.len() >= 2;
    let need = |what: &str| (Verdict::CannotTell, what.to_string());
    let along = |axis: Axis, f: fn(&Sel) -> (Verdict, String)| {
        let (sels, notes) = selections(&perf, axis, &ENGINES, 2);
        each(&sels, &notes, "no ok full, h2o or infinigen point", f)
    };
    // A claim made for every batch size can be refuted at one batch size, never
    // confirmed: judged there, "agrees" becomes "cannot tell".
    let one_batch = |f: fn(&Sel) -> (Verdict, String)| {
        let (sels, notes) = selections(&perf, Axis::Batch, &ENGINES, 1);
        let (v, ev) = each(&sels, &notes, "no ok full, h2o or infinigen point", f);
        let ev = format!("at one batch size: {ev}");
        match v {
            Verdict::Agrees => (
                Verdict::CannotTell,
                format!("{ev}; not checked: the other batch sizes (one batch size can refute the claim, not confirm it)"),
            ),
            v => (v, ev),
        }
    };
    let mut out = Vec::new();
    for (id, text) in CLAIMS {
        let (verdict, evidence) = match id {
            "C1" if ttft_grid && engines.len() >= 2 => c1(&perf),
            "C1" => need("needs a TTFT grid (several prompt lengths, one output token) with full and another engine"),
            "C2" => need("kvbench runs one device; tensor parallelism is not modelled"),
            "C3" if ttft_grid => c3(&perf),
            "C3" => need("needs a TTFT grid with InfiniGen under flash and chunked attention"),
            "C4" if ttft_grid => c4(&perf),
            "C4" => need("needs a TTFT grid with H2O under flash and eager/chunked attention"),
            "C5" if batch_grid => along(Axis::Batch, c5),
            "C6" if batch_grid => along(Axis::Batch, c6),
            "C7" if batch_grid => along(Axis::Batch, c7),
            "C8" if batch_grid => along(Axis::Batch, c8),
            "C6" if one_study_batch => one_batch(c6),
            "C7" if one_study_batch => one_batch(c7),
            "C5" | "C6" | "C7" | "C8" => need("needs a batch grid (two or more batch sizes)"),
            "C9" if output_grid => along(Axis::Output, c9),
            "C9" => need("needs an output-length grid"),
            _ => need("needs accuracy / retention results (accuracy.parquet), not in this experiment"),
        };
        out.push(Claim {
            id,
            text,
            verdict,
            evidence,
        });
    }
    out
}

/// The claims, judged on `runs` and, where the experiment has them, the rows of
/// accuracy.parquet (C11 from the `retention` task).
pub fn judge_all(runs: &[Run], acc: Option<&[AccRow]>) -> Vec<Claim> {
    let mut claims = judge(runs);
    let retention: Vec<&AccRow> = acc
        .into_iter()
        .flatten()
        .filter(|r| r.task == "retention")
        .collect();
    if !retention.is_empty() {
        if let Some(c) = claims.iter_mut().find(|c| c.id == "C11") {
            (c.verdict, c.evidence) = combine(
                acc_parts(&retention)
                    .into_iter()
                    .map(|(l, rows)| (l, c11(&rows)))
                    .collect(),
                &[],
            );
        }
    }
    let mc: Vec<&AccRow> = acc
        .into_iter()
        .flatten()
        .filter(|r| r.task != "retention")
        .collect();
    if !mc.is_empty() {
        if let Some(c) = claims.iter_mut().find(|c| c.id == "C10") {
            (c.verdict, c.evidence) = combine(
                acc_parts(&mc)
                    .into_iter()
                    .map(|(l, rows)| (l, c10(&rows)))
                    .collect(),
                &[],
            );
        }
    }
    claims
}
