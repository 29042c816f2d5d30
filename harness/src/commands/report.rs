//! `kvbench report results/EXP`: writes report.md and report.html (see `crate::report`).

use crate::report::{figures, first, judge_all, read_accuracy, read_runs, render, to_html};
use anyhow::{bail, Context, Result};
use base64::Engine as _;
use clap::Args;
use std::path::{Path, PathBuf};

#[derive(Debug, Args)]
pub struct ReportArgs {
    /// An experiment's results directory (results/EXP, holding runs.parquet), or just
    /// its name under ./results/.
    pub results: PathBuf,
}

pub fn run(a: ReportArgs) -> Result<()> {
    // A name stands for results/<name>, as for `kvbench plot`.
    let named = Path::new("results").join(&a.results);
    let dir = if !a.results.is_dir() && named.is_dir() {
        &named
    } else {
        &a.results
    };
    if !dir.is_dir() {
        bail!(
            "{}: expected an experiment's results directory (results/EXP)",
            dir.display()
        );
    }
    let (df, runs) = read_runs(dir)?;
    let figs = figures(dir);
    let md = render(dir, &df, &runs, &figs, &|f| {
        let rel = f.strip_prefix(dir).unwrap_or(f);
        Ok(format!("![{}]({})", rel.display(), rel.display()))
    })?;
    let html_md = render(dir, &df, &runs, &figs, &|f| {
        let bytes = std::fs::read(f).with_context(|| format!("reading {}", f.display()))?;
        Ok(format!(
            "<img alt=\"{}\" src=\"data:image/png;base64,{}\">",
            f.file_name()
                .map_or(String::new(), |n| n.to_string_lossy().into_owned()),
            base64::engine::general_purpose::STANDARD.encode(bytes)
        ))
    })?;
    let title =
        first(&df, kvbench_plots::schema::EXPERIMENT).unwrap_or_else(|| "kvbench report".into());
    let html = to_html(&html_md, &format!("kvbench report: {title}"));
    let md_path = dir.join("report.md");
    let html_path = dir.join("report.html");
    std::fs::write(&md_path, &md).with_context(|| format!("writing {}", md_path.display()))?;
    std::fs::write(&html_path, html).with_context(|| format!("writing {}", html_path.display()))?;
    let claims = judge_all(&runs, read_accuracy(dir).as_deref());
    println!(
        "wrote {} and {} ({} cells, {} figures; claims: {})",
        md_path.display(),
        html_path.display(),
        runs.len(),
        figs.len(),
        claims
            .iter()
            .map(|c| format!("{} {}", c.id, c.verdict))
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}
