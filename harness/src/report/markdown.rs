//! report.md: environment, grid, a table per cell, the figures and the claims.

use super::claims::shared::*;
use super::claims::*;
use super::read::*;
use anyhow::Result;
use kvbench_plots::schema;
use polars::prelude::DataFrame;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The report as Markdown; `img` renders a figure reference (a link or inline data).
pub(crate) fn render(
    dir: &Path,
    df: &DataFrame,
    runs: &[Run],
    figs: &[PathBuf],
    img: &dyn Fn(&Path) -> Result<String>,
) -> Result<String> {
    let mut md = String::new();
    let name =
        first(df, kvbench_plots::schema::EXPERIMENT).unwrap_or_else(|| dir.display().to_string());
    writeln!(md, "# kvbench report: {name}\n")?;
    md.push_str(&sections(dir, df, runs, figs, img)?);
    writeln!(md, "## The study's claims\n")?;
    writeln!(
        md,
        "Judged on this experiment's cells only, the repeats of a cell averaged; each verdict gives the claim's number, the tolerance accepted and ours, and what it does not check (thresholds in harness/src/report/claims/).\n"
    )?;
    for c in judge_all(runs, read_accuracy(dir)?.as_deref()) {
        writeln!(
            md,
            "- **{}** {}  \n  *{}*: {}",
            c.id, c.text, c.verdict, c.evidence
        )?;
    }
    Ok(md)
}

/// One experiment of a combined report.
pub(crate) struct Part {
    pub dir: PathBuf,
    pub df: DataFrame,
    pub runs: Vec<Run>,
    pub figs: Vec<PathBuf>,
}

impl Part {
    fn name(&self) -> String {
        first(&self.df, kvbench_plots::schema::EXPERIMENT)
            .unwrap_or_else(|| self.dir.display().to_string())
    }
}

/// One report over several experiments: each one's environment, grid, cells and
/// figures, then each claim judged from the experiments that have its data, in the
/// order given (the first informative verdict leads; the others follow it).
pub(crate) fn render_many(parts: &[Part], img: &dyn Fn(&Path) -> Result<String>) -> Result<String> {
    let mut md = String::new();
    let names: Vec<String> = parts.iter().map(Part::name).collect();
    writeln!(md, "# kvbench report: {}\n", names.join(" + "))?;
    for (p, name) in parts.iter().zip(&names) {
        writeln!(md, "## Experiment {name}\n\n`{}`\n", p.dir.display())?;
        // One level down: the experiment's sections under its own heading.
        let body = sections(&p.dir, &p.df, &p.runs, &p.figs, img)?
            .replace("\n### ", "\n#### ")
            .replace("\n## ", "\n### ");
        let body = body
            .strip_prefix("## ")
            .map_or(body.clone(), |b| format!("### {b}"));
        md.push_str(&body);
        md.push('\n');
    }
    writeln!(md, "## The study's claims\n")?;
    writeln!(
        md,
        "Each claim judged on each experiment's cells alone (repeats averaged), then taken from the first experiment above whose data can speak to it; the others' verdicts follow (thresholds in harness/src/report/claims/).\n"
    )?;
    let judged: Vec<Vec<Claim>> = parts
        .iter()
        .map(|p| Ok(judge_all(&p.runs, read_accuracy(&p.dir)?.as_deref())))
        .collect::<Result<_>>()?;
    for (i, c) in judged[0].iter().enumerate() {
        let all: Vec<(&String, &Claim)> = names.iter().zip(judged.iter().map(|j| &j[i])).collect();
        let told: Vec<&(&String, &Claim)> = all
            .iter()
            .filter(|(_, c)| c.verdict != Verdict::CannotTell)
            .collect();
        match told.split_first() {
            None => {
                let why: Vec<String> = all
                    .iter()
                    .map(|(n, c)| format!("{n}: {}", c.evidence))
                    .collect();
                writeln!(
                    md,
                    "- **{}** {}  \n  *{}*: {}",
                    c.id,
                    c.text,
                    Verdict::CannotTell,
                    why.join("; ")
                )?;
            }
            Some((lead, rest)) => {
                writeln!(
                    md,
                    "- **{}** {}  \n  *{}* (from {}): {}",
                    c.id, c.text, lead.1.verdict, lead.0, lead.1.evidence
                )?;
                // An experiment listed before the lead that checked part of the claim
                // but not enough for a verdict still shows its numbers: the reader
                // ordered it first.
                for (n, other) in all.iter().take_while(|(n, _)| *n != lead.0) {
                    if other.partial() {
                        writeln!(
                            md,
                            "  - before it, {n}: *{}*: {}",
                            other.verdict, other.evidence
                        )?;
                    }
                }
                for (n, other) in rest {
                    writeln!(md, "  - also {n}: *{}*: {}", other.verdict, other.evidence)?;
                }
            }
        }
    }
    Ok(md)
}

/// An experiment's sections: the predicted banner, environment, grid, cells and
/// figures.
fn sections(
    dir: &Path,
    df: &DataFrame,
    runs: &[Run],
    figs: &[PathBuf],
    img: &dyn Fn(&Path) -> Result<String>,
) -> Result<String> {
    let mut md = String::new();
    let predicted = strings(df, kvbench_plots::schema::PREDICTED)
        .iter()
        .filter(|p| p.as_deref() == Some("true"))
        .count();
    if predicted > 0 {
        writeln!(
            md,
            "> **Predicted, not measured.** {predicted} of {} cells were predicted by the cost \
             model (`kvbench predict`{}); every number and verdict below is the model's \
             (docs/cost-model.md gives its validation and limits).\n",
            df.height(),
            first(df, "env_prediction").map_or(String::new(), |p| format!(": {p}"))
        )?;
    }
    writeln!(md, "## Environment\n")?;
    // The model as the experiment names it (its YAML is kept beside the results).
    let spec: Option<serde_yaml::Value> = std::fs::read_to_string(dir.join("experiment.yaml"))
        .ok()
        .and_then(|y| serde_yaml::from_str(&y).ok());
    for key in ["model", "dtype"] {
        if let Some(v) = spec
            .as_ref()
            .and_then(|s| s.get(key))
            .and_then(|v| v.as_str())
        {
            writeln!(md, "- {key}: {v}")?;
        }
    }
    for (label, col) in [
        ("device", "env_device"),
        ("GPU", "env_gpu_name"),
        ("driver", "env_driver_version"),
        ("CPU", "env_cpu_model"),
        ("cores", "env_cpu_cores"),
        ("host memory (bytes)", "env_host_memory_bytes"),
        ("kvbench", "env_kvbench_version"),
        ("git revision", "env_git_revision"),
    ] {
        // Cells kept from other processors (`--keep-other-processors`) are named.
        let distinct: BTreeSet<String> = if matches!(col, "env_gpu_name" | "env_cpu_model") {
            strings(df, col).into_iter().flatten().collect()
        } else {
            BTreeSet::new()
        };
        if distinct.len() > 1 {
            let list: Vec<&str> = distinct.iter().map(String::as_str).collect();
            writeln!(
                md,
                "- {label}: {} (the cells ran on different processors)",
                list.join(", ")
            )?;
        } else if let Some(v) = first(df, col) {
            writeln!(md, "- {label}: {v}")?;
        }
    }
    // Every build that recorded a cell: one line when the sweep is one build's.
    if df
        .get_column_names()
        .iter()
        .any(|c| c.as_str() == schema::ENV_BUILD)
    {
        let builds: BTreeSet<String> = strings(df, schema::ENV_BUILD)
            .into_iter()
            .map(|b| b.unwrap_or_else(|| "not recorded".into()))
            .collect();
        let list: Vec<&str> = builds.iter().map(String::as_str).collect();
        if list.len() == 1 {
            writeln!(md, "- build: {}", list[0])?;
        } else {
            writeln!(
                md,
                "- builds: {} (the cells were recorded by different code)",
                list.join(", ")
            )?;
        }
    }
    let outcomes: BTreeMap<&str, usize> = runs.iter().fold(BTreeMap::new(), |mut m, r| {
        *m.entry(r.outcome.as_str()).or_default() += 1;
        m
    });
    writeln!(md, "\n## Grid\n")?;
    let distinct = |f: &dyn Fn(&Run) -> String| -> String {
        let s: BTreeSet<String> = runs.iter().map(f).collect();
        s.into_iter().collect::<Vec<_>>().join(", ")
    };
    let num = |x: Option<f64>| x.map_or("–".into(), fmt);
    writeln!(
        md,
        "- cells: {} ({})",
        runs.len(),
        outcomes
            .iter()
            .map(|(k, v)| format!("{v} {k}"))
            .collect::<Vec<_>>()
            .join(", ")
    )?;
    writeln!(md, "- engines: {}", distinct(&|r| r.label()))?;
    writeln!(md, "- attention: {}", distinct(&|r| r.attention.clone()))?;
    writeln!(md, "- batch: {}", distinct(&|r| num(r.batch)))?;
    writeln!(
        md,
        "- prompt length: {}",
        distinct(&|r| r.prompt_len.clone())
    )?;
    writeln!(md, "- output length: {}", distinct(&|r| num(r.output_len)))?;
    writeln!(md, "- budget: {}", distinct(&|r| num(r.budget)))?;
    // Goodput is shown only where a cell was measured against SLOs.
    let slo_of = |r: &Run| {
        [
            ("TTFT", r.slo_ttft_ms),
            ("TPOT", r.slo_tpot_ms),
            ("E2E", r.slo_e2e_ms),
        ]
        .iter()
        .filter_map(|(k, v)| v.map(|v| format!("{k} ≤ {} ms", fmt(v))))
        .collect::<Vec<_>>()
        .join(", ")
    };
    let with_slo = runs.iter().any(|r| !slo_of(r).is_empty());
    if with_slo {
        writeln!(
            md,
            "- SLOs for goodput (requests meeting every one, per second): {}",
            distinct(&|r| {
                let s = slo_of(r);
                if s.is_empty() {
                    "none".into()
                } else {
                    s
                }
            })
        )?;
    }

    writeln!(md, "\n## Cells\n")?;
    let (goodput_head, goodput_align) = if with_slo {
        (" goodput req/s |", "---:|")
    } else {
        ("", "")
    };
    // Accuracy and retention cells differ by their task (and scoring mode) or bucket.
    let cases = runs.iter().any(|r| !r.is_performance());
    let (case_head, case_align) = if cases {
        (" task / bucket |", "---|")
    } else {
        ("", "")
    };
    writeln!(md, "| engine |{case_head} attention | batch | prompt | output | budget | outcome | TTFT s | decode tok/s | tok/s per GB | E2E s | device GiB | host KV GiB |{goodput_head}")?;
    writeln!(
        md,
        "|---|{case_align}---|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|{goodput_align}"
    )?;
    let gib =
        |x: Option<f64>| x.map_or("–".into(), |b| format!("{:.2}", b / (1u64 << 30) as f64));
    for r in runs {
        let goodput = if with_slo {
            format!(" {} |", num(r.goodput_req_s))
        } else {
            String::new()
        };
        let case = if cases {
            let f = |k: &str| r.cell.get(k).filter(|v| !v.is_empty()).cloned();
            let c = match (f("task"), f("mode"), f("bucket")) {
                (Some(t), Some(m), _) => format!("{t} ({m})"),
                (Some(t), None, _) => t,
                (None, _, Some(b)) => b,
                _ => "–".into(),
            };
            format!(" {c} |")
        } else {
            String::new()
        };
        let prompt = if r.prompt_len.is_empty() {
            "–"
        } else {
            r.prompt_len.as_str()
        };
        writeln!(
            md,
            "| {} |{case} {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |{goodput}",
            r.label(),
            r.attention,
            num(r.batch),
            prompt,
            num(r.output_len),
            num(r.budget),
            r.outcome,
            num(r.ttft_mean_s),
            num(r.decode_tok_s),
            num(r.decode_tok_s_per_gb),
            num(r.e2e_mean_s),
            gib(r.device_bytes()),
            gib(r.mem_kv_host_bytes),
        )?;
    }
    if let Some(t) = against_full(&points(runs)) {
        md.push_str(&t);
    }
    writeln!(md, "\n## Figures\n")?;
    if figs.is_empty() {
        writeln!(
            md,
            "No figures yet: run `kvbench plot {}` first.",
            dir.display()
        )?;
    }
    for f in figs {
        let stem = f
            .file_stem()
            .map_or(String::new(), |s| s.to_string_lossy().into_owned());
        writeln!(md, "### {stem}\n\n{}\n", img(f)?)?;
    }
    Ok(md)
}

/// Each engine beside `full` on the same workload and attention (points, repeats
/// averaged): decode throughput and mean E2E as multiples of full's, and where its time
/// went (the study's ratios and their reasons, from the walltime breakdown and the bytes
/// moved). None when no engine has a full point to stand beside.
pub(crate) fn against_full(points: &[Run]) -> Option<String> {
    let ok: Vec<&Run> = points
        .iter()
        .filter(|r| r.is_performance() && r.ok())
        .collect();
    // The workload and attention (with its chunk): a point's fields but the strategy's.
    let workload = |r: &Run| {
        join(&r.fields(), |k| {
            !is_strategy(k) || k == "attention" || k == "chunk_size"
        })
    };
    let mut fulls: BTreeMap<String, &Run> = BTreeMap::new();
    for r in ok.iter().filter(|r| r.engine == "full") {
        fulls.entry(workload(r)).or_insert(r);
    }
    let mut groups: Vec<(&Run, Vec<&Run>)> = Vec::new();
    for (w, f) in &fulls {
        let others: Vec<&Run> = ok
            .iter()
            .filter(|r| r.engine != "full" && workload(r) == *w)
            .copied()
            .collect();
        if !others.is_empty() {
            groups.push((f, others));
        }
    }
    if groups.is_empty() {
        return None;
    }
    let key = |r: &Run| {
        (
            r.batch.unwrap_or(0.0),
            r.prompt().unwrap_or(0.0),
            r.output_len.unwrap_or(0.0),
        )
    };
    groups.sort_by(|a, b| {
        key(a.0)
            .partial_cmp(&key(b.0))
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    let times = |x: Option<f64>, of: Option<f64>| match (x, of) {
        (Some(x), Some(f)) if f > 0.0 => format!("{:.2}×", x / f),
        _ => "–".into(),
    };
    let share = |part: Option<f64>, r: &Run| match (part, r.busy_s) {
        (Some(p), Some(b)) if b > 0.0 => format!("{:.1}", 100.0 * p / b),
        _ => "–".into(),
    };
    let mb_per_token = |r: &Run| match (r.h2d_bytes, r.output_tokens) {
        (Some(b), Some(t)) if t > 0.0 => fmt(b / t / 1e6),
        _ => "–".into(),
    };
    // The host link's rate while decoding: zero-copy reads happen inside the forwards
    // (so their transfer wait is 0 however link-bound they are), copies partly beside
    // them. Engines that move nothing have no rate.
    let link_gb_s = |r: &Run| match (r.h2d_bytes, r.decode_compute_s, r.transfer_s) {
        (Some(b), Some(d), Some(w)) if b > 0.0 && d + w > 0.0 => fmt(b / (d + w) / 1e9),
        _ => "–".into(),
    };
    let num = |x: Option<f64>| x.map_or("–".into(), fmt);
    let mut md = String::new();
    let _ = writeln!(md, "\n## Against full\n");
    let _ = writeln!(
        md,
        "Each engine beside `full` on the same workload and attention (repeats averaged): decode throughput and mean E2E as multiples of full's, the host-to-device bytes per output token and their rate over the decode (bytes over decode compute and transfer wait: a zero-copy transfer reads host memory inside the forwards, so its wait is 0 however bound by the link it is), and the shares of the engine's time spent waiting for transfers and in cache operations (the walltime breakdown, docs/metrics.md).\n"
    );
    let _ = writeln!(md, "| batch | prompt | output | engine | decode tok/s | × full | E2E s | × full | H2D MB per output token | H2D GB/s in decode | transfer wait % | cache ops % |");
    let _ = writeln!(
        md,
        "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for (f, others) in &groups {
        for r in std::iter::once(f).chain(others.iter()) {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                num(r.batch),
                r.prompt_len,
                num(r.output_len),
                r.variant(),
                num(r.decode_tok_s),
                times(r.decode_tok_s, f.decode_tok_s),
                num(r.e2e_mean_s),
                times(r.e2e_mean_s, f.e2e_mean_s),
                mb_per_token(r),
                link_gb_s(r),
                share(r.transfer_s, r),
                share(r.cache_ops_s, r),
            );
        }
    }
    Some(md)
}
