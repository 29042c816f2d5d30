//! C1–C9, judged on the performance cells of runs.parquet.

use super::super::read::*;
use super::shared::*;
use std::collections::BTreeMap;

/// C1: "reaches 128K", read as a prompt of at least 128,000 tokens.
pub(crate) const C1_REACH_TOKENS: f64 = 128_000.0;
/// C1: the baselines run out of memory "near 10K tokens" ...
pub(crate) const C1_OOM_TOKENS: f64 = 10_000.0;
/// ... accepted when the boundary lies within a factor of 2 of it (5K–20K).
pub(crate) const C1_OOM_FACTOR: f64 = 2.0;

pub(crate) fn c1(pts: &[&Run]) -> (Verdict, String) {
    combine(
        contexts(pts, Axis::Prompt)
            .into_iter()
            .filter(|(_, rs)| axis_values(rs, Axis::Prompt) >= 2)
            .map(|(l, rs)| (l, c1_in(&rs)))
            .collect(),
        &[],
    )
}

/// C1 in one workload: full (its fastest attention at each length, as vLLM picks its
/// kernels) against the fastest other engine and variant at each length; full's reach;
/// where the baselines (eager attention, the originals' standard attention) run out of
/// memory.
pub(crate) fn c1_in(rs: &[&Run]) -> (Verdict, String) {
    let prompts = axis(rs, Run::prompt);
    let mut p = Parts::default();
    let mut lowest = true;
    let mut rows = Vec::new();
    for &len in &prompts {
        let at: Vec<&Run> = rs
            .iter()
            .copied()
            .filter(|r| r.prompt() == Some(len) && r.ok())
            .collect();
        let fastest = |full: bool| {
            at.iter()
                .filter(|r| (r.engine == "full") == full)
                .filter_map(|r| Some((r.ttft_mean_s?, *r)))
                .min_by(|a, b| a.0.total_cmp(&b.0))
        };
        let (Some((f, _)), Some((o, other))) = (fastest(true), fastest(false)) else {
            continue;
        };
        // A NaN TTFT at this length: nothing can be said to be lowest.
        let nan = at.iter().any(|r| r.ttft_mean_s.is_some_and(f64::is_nan));
        lowest &= !nan && f <= o;
        rows.push(format!(
            "{}: full {} s, {} {} s",
            fmt(len),
            fmt(f),
            other.variant(),
            fmt(o)
        ));
    }
    if rows.is_empty() {
        p.skip(
            "the lowest TTFT: no prompt length where full and another engine both ran",
            true,
        );
    } else {
        p.check(
            lowest,
            format!(
                "TTFT of full (its fastest attention) and of the fastest other engine or variant by prompt length — {} (claim: full lowest at every length; no tolerance)",
                rows.join(", ")
            ),
        );
    }
    let full_at = |len: f64| -> Vec<&Run> {
        rs.iter()
            .copied()
            .filter(|r| r.engine == "full" && r.prompt() == Some(len))
            .collect()
    };
    let reached = prompts
        .iter()
        .copied()
        .rev()
        .find(|&l| full_at(l).iter().any(|r| r.ok()));
    let failed = prompts.iter().copied().find(|&l| {
        let v = full_at(l);
        !v.is_empty() && !v.iter().any(|r| r.ok())
    });
    let reach = format!(
        "claim: reaches 128K, read as ≥ {} tokens",
        fmt(C1_REACH_TOKENS)
    );
    match (reached, failed) {
        (Some(l), _) if l >= C1_REACH_TOKENS => p.check(
            true,
            format!("full runs a {}-token prompt ({reach})", fmt(l)),
        ),
        (_, Some(l)) => p.check(
            false,
            format!(
                "full does not run a {}-token prompt ({}; {reach})",
                fmt(l),
                full_at(l)[0].outcome
            ),
        ),
        // A grid that stops short of 128K can refute "lowest at every length" but not
        // confirm a claim about the whole range.
        _ => p.skip(
            format!(
                "full reaching 128K: the grid's longest prompt is {}",
                prompts.last().map_or("–".into(), |l| fmt(*l))
            ),
            true,
        ),
    }
    let (lo, hi) = (C1_OOM_TOKENS / C1_OOM_FACTOR, C1_OOM_TOKENS * C1_OOM_FACTOR);
    let oom_claim = format!(
        "claim: out of memory near 10K; accepted when the boundary lies within {}–{} tokens",
        fmt(lo),
        fmt(hi)
    );
    let mut baselines = 0;
    for e in ["h2o", "infinigen"] {
        let eager: Vec<&Run> = rs
            .iter()
            .copied()
            .filter(|r| r.engine == e && r.attention == "eager")
            .collect();
        let (eager, note) = at_study_budget(eager);
        if let Some(n) = note {
            p.say(n);
        }
        let mut variants: BTreeMap<String, Vec<&Run>> = BTreeMap::new();
        for r in eager {
            variants.entry(r.variant_key()).or_default().push(r);
        }
        for v in variants.values() {
            baselines += 1;
            let label = v[0].variant();
            let lens = |ok: bool| -> Vec<f64> {
                v.iter()
                    .filter(|r| if ok { r.ok() } else { r.outcome == "oom" })
                    .filter_map(|r| r.prompt())
                    .collect()
            };
            let first_oom = lens(false).into_iter().reduce(f64::min);
            let last_ok = lens(true)
                .into_iter()
                .filter(|&l| first_oom.is_none_or(|o| l < o))
                .reduce(f64::max);
            match (first_oom, last_ok) {
                (None, Some(l)) if l >= hi => p.check(
                    false,
                    format!("{label} runs {} tokens without running out of memory ({oom_claim})", fmt(l)),
                ),
                (None, l) => p.skip(
                    format!(
                        "{label} running out of memory near 10K: no OOM up to {} tokens, the grid stops short of {}",
                        l.map_or("–".into(), fmt),
                        fmt(hi)
                    ),
                    false,
                ),
                (Some(o), l) => {
                    let l = l.unwrap_or(0.0);
                    let text = format!(
                        "{label} runs out of memory between {} and {} tokens ({oom_claim})",
                        fmt(l),
                        fmt(o)
                    );
                    if o <= lo || l >= hi {
                        p.check(false, text);
                    } else if l >= lo && o <= hi {
                        p.check(true, text);
                    } else {
                        p.skip(format!("{text}: too coarse a grid to place it"), false);
                    }
                }
            }
        }
    }
    if baselines == 0 {
        p.skip(
            "the baselines running out of memory near 10K: no h2o or infinigen under eager attention (the originals' standard attention)",
            false,
        );
    }
    p.skip(
        "the cause (the prefill score matrix, not the KV size)",
        false,
    );
    p.verdict()
}

/// For `engine`, its points under flash and under the first of `others` paired by
/// prompt length: ok points alike in everything else but the attention and its chunk
/// size, one list per pair of variants (the study's budget kept, else the nearest).
#[allow(clippy::type_complexity)]
pub(crate) fn attention_pairs<'a>(
    pts: &[&'a Run],
    engine: &str,
    others: &[&str],
) -> (Vec<(String, Vec<(f64, &'a Run, &'a Run)>)>, Vec<String>) {
    let mine: Vec<&Run> = pts
        .iter()
        .copied()
        .filter(|r| r.engine == engine && r.ok() && r.prompt().is_some())
        .collect();
    let (mine, note) = at_study_budget(mine);
    let mut groups: BTreeMap<String, Vec<&Run>> = BTreeMap::new();
    for r in mine {
        let k = join(&r.fields(), |k| {
            !Axis::Prompt.is(k) && k != "attention" && k != "chunk_size"
        });
        groups.entry(k).or_default().push(r);
    }
    let mut out = Vec::new();
    for g in groups.values() {
        let flash: Vec<&Run> = g
            .iter()
            .copied()
            .filter(|r| r.attention == "flash")
            .collect();
        for other in others {
            let mut variants: BTreeMap<String, Vec<&Run>> = BTreeMap::new();
            for r in g.iter().copied().filter(|r| r.attention == *other) {
                variants.entry(r.variant_key()).or_default().push(r);
            }
            let mut found = false;
            for v in variants.values() {
                let pairs: Vec<(f64, &Run, &Run)> = flash
                    .iter()
                    .filter_map(|f| {
                        let o = v.iter().find(|o| o.prompt() == f.prompt())?;
                        Some((f.prompt()?, *f, *o))
                    })
                    .collect();
                if let Some((_, f, o)) = pairs.first() {
                    out.push((format!("{} vs {}", f.variant(), o.variant()), pairs.clone()));
                    found = true;
                }
            }
            if found {
                break;
            }
        }
    }
    (out, note.into_iter().collect())
}

/// C3: at "15K" tokens, read as the prompt length nearest 15,000 within a factor of 2
/// (7.5K–30K) ...
pub(crate) const C3_AT_TOKENS: f64 = 15_000.0;
pub(crate) const C3_AT_FACTOR: f64 = 2.0;
/// ... flash cuts InfiniGen's prefill memory by 85% and its prefill latency by 77%
/// against chunked prefill ...
pub(crate) const C3_MEMORY_CUT_PCT: f64 = 85.0;
pub(crate) const C3_TTFT_CUT_PCT: f64 = 77.0;
/// ... each accepted within ±10 pp.
pub(crate) const C3_TOLERANCE_PP: f64 = 10.0;

pub(crate) fn c3(pts: &[&Run]) -> (Verdict, String) {
    let (pairs, notes) = attention_pairs(pts, "infinigen", &["chunked"]);
    if pairs.is_empty() {
        return (
            Verdict::CannotTell,
            "no prompt length with InfiniGen under both flash and chunked attention".into(),
        );
    }
    combine(
        pairs.into_iter().map(|(l, ps)| (l, c3_pair(&ps))).collect(),
        &notes,
    )
}

pub(crate) fn c3_pair(ps: &[(f64, &Run, &Run)]) -> (Verdict, String) {
    let usable = ps.iter().filter_map(|(len, f, c)| {
        Some((
            *len,
            f.mem_activations_peak_bytes? / c.mem_activations_peak_bytes?,
            f.ttft_mean_s? / c.ttft_mean_s?,
        ))
    });
    let Some((len, m, t)) = usable.min_by(|a, b| {
        (a.0 / C3_AT_TOKENS)
            .ln()
            .abs()
            .total_cmp(&(b.0 / C3_AT_TOKENS).ln().abs())
    }) else {
        return (
            Verdict::CannotTell,
            "no prompt length with prefill memory and TTFT under both".into(),
        );
    };
    let (lo, hi) = (C3_AT_TOKENS / C3_AT_FACTOR, C3_AT_TOKENS * C3_AT_FACTOR);
    if len < lo || len > hi {
        return (
            Verdict::CannotTell,
            format!(
                "the prompt length nearest the claim's 15K with both is {} tokens, outside {}–{}",
                fmt(len),
                fmt(lo),
                fmt(hi)
            ),
        );
    }
    let mut p = Parts::default();
    p.say(format!(
        "at {} tokens (the claim's 15K, within a factor of {C3_AT_FACTOR})",
        fmt(len)
    ));
    for (what, ratio, claim) in [
        ("prefill memory", m, C3_MEMORY_CUT_PCT),
        ("TTFT", t, C3_TTFT_CUT_PCT),
    ] {
        let change = 100.0 * (ratio - 1.0);
        p.check(
            change.is_finite() && (change + claim).abs() <= C3_TOLERANCE_PP,
            format!(
                "{what} flash vs chunked {change:+.0}% (claim −{claim:.0}%; accepted ±{C3_TOLERANCE_PP:.0} pp: −{:.0}% to −{:.0}%)",
                claim + C3_TOLERANCE_PP,
                claim - C3_TOLERANCE_PP
            ),
        );
    }
    p.skip("reaching 128K with near-linear latency", false);
    p.verdict()
}

/// C4: H2O "gains nothing" from flash: accepted while flash saves at most 20% of its
/// prefill memory and of its TTFT against eager (else chunked) attention.
pub(crate) const C4_GAIN_TOLERANCE: f64 = 0.2;

pub(crate) fn c4(pts: &[&Run]) -> (Verdict, String) {
    let (pairs, notes) = attention_pairs(pts, "h2o", &["eager", "chunked"]);
    if pairs.is_empty() {
        return (
            Verdict::CannotTell,
            "no prompt length with H2O under flash and eager or chunked attention".into(),
        );
    }
    combine(
        pairs.into_iter().map(|(l, ps)| (l, c4_pair(&ps))).collect(),
        &notes,
    )
}

/// C4 on one pair of variants at the largest prompt where both ran.
pub(crate) fn c4_pair(ps: &[(f64, &Run, &Run)]) -> (Verdict, String) {
    let Some((len, m, t, other)) = ps
        .iter()
        .filter_map(|(len, f, o)| {
            Some((
                *len,
                f.mem_activations_peak_bytes? / o.mem_activations_peak_bytes?,
                f.ttft_mean_s? / o.ttft_mean_s?,
                o.attention.as_str(),
            ))
        })
        .max_by(|a, b| a.0.total_cmp(&b.0))
    else {
        return (
            Verdict::CannotTell,
            "no prompt length with prefill memory and TTFT under both".into(),
        );
    };
    let mut p = Parts::default();
    p.say(format!("at {} tokens", fmt(len)));
    let floor = 1.0 - C4_GAIN_TOLERANCE;
    for (what, r) in [("prefill memory", m), ("TTFT", t)] {
        p.check(
            r.is_finite() && r >= floor,
            format!(
                "{what} flash/{other} ×{} (claim: no gain; accepted ≥ ×{floor}, flash saving at most {:.0}%)",
                fmt(r),
                100.0 * C4_GAIN_TOLERANCE
            ),
        );
    }
    p.skip(
        "chunked prefill (chunks up to 6K) reaching 128K, and evictions decided on incomplete attention",
        false,
    );
    p.verdict()
}

pub(crate) fn series(v: &[(f64, f64)], unit: &str) -> String {
    if v.is_empty() {
        return "–".into();
    }
    v.iter()
        .map(|(b, x)| format!("{b}: {}{unit}", fmt(*x)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// C5: full's device memory "regardless of batch": the same at every batch within 5%.
pub(crate) const C5_FLAT_TOLERANCE: f64 = 0.05;
/// C5: full's device memory over what H2O needs at the largest batch, "≈2× less" (the
/// study: ≈72 GB against under 40 GB) ...
pub(crate) const C5_FULL_OVER_H2O: f64 = 2.0;
/// ... accepted within a factor of 1.5 either way (1.33–3×).
pub(crate) const C5_FACTOR: f64 = 1.5;
/// C5: InfiniGen's device memory "similar to H2O's": their ratio within a factor of 1.5
/// of 1.
pub(crate) const C5_LIKE_FACTOR: f64 = 1.5;
/// C5: InfiniGen's host memory over each other engine's at the largest batch, "more than
/// 2.5×" (a bound: no tolerance).
pub(crate) const C5_HOST_OVER: f64 = 2.5;

/// Whether the table records how `engine` reserved its device KV (its ledger is then
/// what it held as its paradigm reserves).
fn recorded(s: &Sel, engine: &str) -> bool {
    !s.vals(engine, |r| r.mem_kv_reservation.as_ref().map(|_| 0.0))
        .is_empty()
}

/// How C5 names an engine's device memory: held as reserved where recorded, else the
/// KV it held at the busiest step (older tables).
fn held_word(s: &Sel, engine: &str) -> &'static str {
    if recorded(s, engine) {
        "holds (as reserved)"
    } else {
        "needs (KV held)"
    }
}

pub(crate) fn c5(s: &Sel) -> (Verdict, String) {
    let gib = |b: f64| b / (1u64 << 30) as f64;
    let full = s.vals("full", |r| r.device_bytes().map(gib));
    let held = |e| s.vals(e, |r| r.held_device_bytes().map(gib));
    let host = |e| s.vals(e, |r| r.mem_host_peak_bytes.map(gib));
    let (h2o, ig) = (held("h2o"), held("infinigen"));
    let Some(&(b, f)) = full.last().filter(|_| full.len() >= 2) else {
        return (
            Verdict::CannotTell,
            "full ran at fewer than two batch sizes".into(),
        );
    };
    let at = |v: &[(f64, f64)]| v.iter().find(|x| x.0 == b).map(|x| x.1);
    let mut p = Parts::default();
    let sp = spread(&full);
    p.check(
        sp <= 1.0 + C5_FLAT_TOLERANCE,
        format!(
            "device GiB (ledger) full {}, max/min {} (claim: the same regardless of batch; accepted ≤ {})",
            series(&full, ""),
            fmt(sp),
            1.0 + C5_FLAT_TOLERANCE
        ),
    );
    if !h2o.is_empty() {
        p.say(format!("h2o {} {}", held_word(s, "h2o"), series(&h2o, "")));
    }
    if !ig.is_empty() {
        p.say(format!(
            "infinigen {} {}",
            held_word(s, "infinigen"),
            series(&ig, "")
        ));
    }
    match at(&h2o) {
        Some(h) => p.check(
            within_factor(f / h, C5_FULL_OVER_H2O, C5_FACTOR),
            format!(
                "full/h2o at batch {b}: {}× (claim ≈{C5_FULL_OVER_H2O}×, 72 GB against under 40 GB; accepted within a factor of {C5_FACTOR}: {})",
                fmt(f / h),
                accepted(C5_FULL_OVER_H2O, C5_FACTOR)
            ),
        ),
        None => p.skip(
            format!("H2O needing about half at the largest batch: no h2o at batch {b}"),
            true,
        ),
    }
    match (at(&ig), at(&h2o)) {
        (Some(i), Some(h)) => p.check(
            within_factor(i / h, 1.0, C5_LIKE_FACTOR),
            format!(
                "infinigen/h2o device memory held at batch {b}: {}× (claim: alike; accepted within a factor of {C5_LIKE_FACTOR}: {})",
                fmt(i / h),
                accepted(1.0, C5_LIKE_FACTOR)
            ),
        ),
        _ => p.skip(
            format!("InfiniGen's device memory like H2O's: no infinigen and h2o at batch {b}"),
            false,
        ),
    }
    let others: Vec<(f64, f64)> = ["full", "h2o"]
        .iter()
        .filter_map(|&e| Some((0.0, at(&host(e))?)))
        .collect();
    match (at(&host("infinigen")), others.is_empty()) {
        (Some(i), false) => {
            let r = i / peak(&others);
            p.check(
                r.is_finite() && r > C5_HOST_OVER,
                format!(
                    "host peak GiB at batch {b}: infinigen {}, the others at most {}: {}× (claim: more than {C5_HOST_OVER}×)",
                    fmt(i),
                    fmt(peak(&others)),
                    fmt(r)
                ),
            );
        }
        _ => p.skip(
            format!("InfiniGen's host memory over {C5_HOST_OVER}× the others': no host peak of infinigen and another engine at batch {b}"),
            false,
        ),
    }
    p.skip(
        "the absolute sizes (≈72 GB, under 40 GB, over 100 GB: the study's H100 and host)",
        false,
    );
    p.verdict()
}

/// C6: InfiniGen's decode throughput "an order of magnitude lower": full/infinigen 10× ...
pub(crate) const C6_FULL_OVER_IG: f64 = 10.0;
/// ... accepted within half an order of magnitude either way (a factor of √10:
/// 3.2–32×), at every batch.
pub(crate) const C6_FACTOR: f64 = 3.162_277_660_168_379;
/// C6: "a similar peak": H2O's highest throughput within a factor of 1.25 of full's.
pub(crate) const C6_PEAK_FACTOR: f64 = 1.25;

pub(crate) fn c6(s: &Sel) -> (Verdict, String) {
    let t = |e| s.vals(e, |r| r.decode_tok_s);
    let (full, h2o, ig) = (t("full"), t("h2o"), t("infinigen"));
    if full.is_empty() {
        return (
            Verdict::CannotTell,
            "decode tok/s: no full; needs full at two batches".into(),
        );
    }
    let mut p = Parts::default();
    p.say(format!(
        "decode tok/s full {}; h2o {}; infinigen {}",
        series(&full, ""),
        series(&h2o, ""),
        series(&ig, "")
    ));
    // Growth and peaks need two batches; InfiniGen's ratio is judged at each batch
    // there is (one can refute "at every batch").
    if full.len() >= 2 {
        p.check(
            rising(&full),
            "full's higher at every larger batch (claim: grows with batch)".into(),
        );
    } else {
        p.skip("full growing with batch: full at one batch", true);
    }
    if h2o.len() >= 2 {
        p.check(
            rising(&h2o),
            "h2o's higher at every larger batch (claim: grows with batch)".into(),
        );
    } else {
        p.skip(
            "H2O growing with batch: h2o at fewer than two batches",
            false,
        );
    }
    if h2o.is_empty() {
        p.skip("H2O's similar peak: no h2o", false);
    } else if full.len() < 2 || h2o.len() < 2 {
        p.skip("H2O's similar peak: full or h2o at one batch", false);
    } else {
        let r = peak(&h2o) / peak(&full);
        p.check(
            within_factor(r, 1.0, C6_PEAK_FACTOR),
            format!(
                "peak h2o/full {}× (claim: a similar peak; accepted within a factor of {C6_PEAK_FACTOR}: {})",
                fmt(r),
                accepted(1.0, C6_PEAK_FACTOR)
            ),
        );
    }
    let r = ratios(&full, &ig);
    if r.is_empty() {
        p.skip(
            "InfiniGen an order of magnitude lower: no infinigen at full's batches",
            true,
        );
    } else {
        p.check(
            r.iter().all(|x| within_factor(x.1, C6_FULL_OVER_IG, C6_FACTOR)),
            format!(
                "full/infinigen {} (claim: an order of magnitude, {C6_FULL_OVER_IG}×, at every batch; accepted within a factor of √10: {})",
                series(&r, "×"),
                accepted(C6_FULL_OVER_IG, C6_FACTOR)
            ),
        );
    }
    p.skip("that the growth is linear", false);
    p.verdict()
}

/// C7: H2O's throughput per GB over full's, "≈3×" ...
pub(crate) const C7_H2O_OVER_FULL: f64 = 3.0;
/// ... accepted within a factor of 1.5 either way (2–4.5×), at every batch.
pub(crate) const C7_FACTOR: f64 = 1.5;

pub(crate) fn c7(s: &Sel) -> (Verdict, String) {
    // Each engine per GB of what it held as its paradigm reserves (full: the fraction,
    // up front; the others: what their batch needed, grown on demand), as in C5.
    let held = |r: &Run| r.held_tok_s_per_gb();
    let full = s.vals("full", |r| r.decode_tok_s_per_gb);
    let (h2o, ig) = (s.vals("h2o", held), s.vals("infinigen", held));
    let mut p = Parts::default();
    p.say(format!(
        "tok/s per GB full {}; per GB {} h2o {}, infinigen {}",
        series(&full, ""),
        if recorded(s, "h2o") { "held" } else { "needed" },
        series(&h2o, ""),
        series(&ig, "")
    ));
    let r = ratios(&h2o, &full);
    if r.is_empty() {
        p.skip(
            "H2O ≈3× full: needs full and h2o at the same batch sizes",
            true,
        );
    } else {
        p.check(
            r.iter().all(|x| within_factor(x.1, C7_H2O_OVER_FULL, C7_FACTOR)),
            format!(
                "h2o/full {} (claim ≈{C7_H2O_OVER_FULL}× at every batch; accepted within a factor of {C7_FACTOR}: {})",
                series(&r, "×"),
                accepted(C7_H2O_OVER_FULL, C7_FACTOR)
            ),
        );
    }
    if ig.is_empty() {
        p.skip("InfiniGen poor and falling with batch: no infinigen", false);
    } else {
        let others: Vec<(f64, f64)> = full.iter().chain(&h2o).copied().collect();
        let below = ig.iter().all(|(b, x)| {
            others
                .iter()
                .filter(|o| o.0 == *b)
                .all(|o| x.is_finite() && *x < o.1)
        });
        p.check(
            below,
            "infinigen below full and h2o at every batch (claim: poor)".into(),
        );
        if ig.len() >= 2 {
            p.check(
                falling(&ig),
                "infinigen lower at every larger batch (claim: falling with batch)".into(),
            );
        } else {
            p.skip(
                "InfiniGen falling with batch: infinigen at one batch",
                false,
            );
        }
    }
    p.verdict()
}

/// C8: full's total latency "about flat across batch" (≈20 s): its largest over its
/// smallest at most 1.25.
pub(crate) const C8_FLAT_FACTOR: f64 = 1.25;
/// C8: InfiniGen's total latency over full's at the largest batch, 14× ...
pub(crate) const C8_IG_OVER_FULL: f64 = 14.0;
/// ... accepted within a factor of 2 either way (7–28×).
pub(crate) const C8_FACTOR: f64 = 2.0;

pub(crate) fn c8(s: &Sel) -> (Verdict, String) {
    let t = |e| s.vals(e, |r| r.e2e_mean_s);
    let (full, h2o, ig) = (t("full"), t("h2o"), t("infinigen"));
    let r = ratios(&ig, &full);
    let Some(&(b, last)) = r.last().filter(|_| r.len() >= 2) else {
        return (
            Verdict::CannotTell,
            format!(
                "mean E2E s full {}; needs infinigen and full at two batch sizes",
                series(&full, "")
            ),
        );
    };
    let mut p = Parts::default();
    p.say(format!(
        "mean E2E s full {}; h2o {}; infinigen {}; infinigen/full {}",
        series(&full, ""),
        series(&h2o, ""),
        series(&ig, ""),
        series(&r, "×")
    ));
    p.check(
        within_factor(last, C8_IG_OVER_FULL, C8_FACTOR),
        format!(
            "infinigen/full at batch {b}: {}× (claim {C8_IG_OVER_FULL}× at the largest batch; accepted within a factor of {C8_FACTOR}: {})",
            fmt(last),
            accepted(C8_IG_OVER_FULL, C8_FACTOR)
        ),
    );
    let sp = spread(&full);
    p.check(
        sp <= C8_FLAT_FACTOR,
        format!(
            "full's max/min {} (claim: flat across batch; accepted ≤ {C8_FLAT_FACTOR})",
            fmt(sp)
        ),
    );
    // Superlinear: latency per request of the batch grows with the batch.
    let per: Vec<(f64, f64)> = ig.iter().map(|(b, x)| (*b, x / b)).collect();
    p.check(
        rising(&per),
        format!(
            "infinigen's E2E over batch size {} (claim: grows superlinearly; accepted: higher at every larger batch)",
            series(&per, " s")
        ),
    );
    let growth = |v: &[(f64, f64)]| match (v.first(), v.last()) {
        (Some(a), Some(z)) if v.len() >= 2 => Some(z.1 / a.1),
        _ => None,
    };
    match (growth(&h2o), growth(&ig)) {
        (Some(gh), Some(gi)) => p.check(
            gh > 1.0 && gh < gi,
            format!(
                "h2o's E2E grows ×{} over its batches, infinigen's ×{} (claim: H2O grows moderately; accepted: grows, less than InfiniGen)",
                fmt(gh),
                fmt(gi)
            ),
        ),
        _ => p.skip("H2O growing moderately: h2o at fewer than two batches", false),
    }
    p.skip(
        "the absolute ≈20 s, and decode-phase transfers dominating InfiniGen's time",
        false,
    );
    p.verdict()
}

/// C9: full's decode throughput over InfiniGen's at every output length, "≈15×" ...
pub(crate) const C9_FULL_OVER_IG: f64 = 15.0;
/// ... accepted within a factor of 2 either way (7.5–30×).
pub(crate) const C9_FACTOR: f64 = 2.0;

pub(crate) fn c9(s: &Sel) -> (Verdict, String) {
    let t = |e| s.vals(e, |r| r.decode_tok_s);
    let (full, ig) = (t("full"), t("infinigen"));
    let r = ratios(&full, &ig);
    if r.is_empty() {
        return (
            Verdict::CannotTell,
            format!(
                "decode tok/s full {}; needs infinigen at the same output lengths",
                series(&full, "")
            ),
        );
    }
    let prompt = s
        .series
        .get("full")
        .and_then(|v| v.first())
        .map_or(String::new(), |(_, r)| r.prompt_len.clone());
    let mut p = Parts::default();
    p.say(format!(
        "decode tok/s by output length (prompt {prompt}) full {}; infinigen {}",
        series(&full, ""),
        series(&ig, "")
    ));
    p.check(
        r.iter().all(|x| within_factor(x.1, C9_FULL_OVER_IG, C9_FACTOR)),
        format!(
            "full/infinigen {} (claim ≈{C9_FULL_OVER_IG}× at every output length; accepted within a factor of {C9_FACTOR}: {})",
            series(&r, "×"),
            accepted(C9_FULL_OVER_IG, C9_FACTOR)
        ),
    );
    p.skip(
        "the absolute rates (InfiniGen flat at ≈8 tok/s; over 16 min against ≈1 min at 8,192 outputs; H2O ≈3 min)",
        false,
    );
    p.verdict()
}
