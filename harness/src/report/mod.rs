//! `kvbench report results/EXP`: report.md and a self-contained report.html (figures
//! inline) with the environment, the grid, a summary table per cell and, for each of
//! the study's claims C1–C11 (docs/figures-and-report.md lists them), what our
//! data says: agrees, disagrees, or cannot tell (and why).
//!
//! `read` turns runs.parquet into [`read::Run`]s; `claims` judges each claim (the list
//! and the dispatch in claims/mod.rs, verdicts and selections in claims/shared.rs,
//! C1–C9 with their thresholds in claims/performance.rs, C10–C11 in
//! claims/accuracy.rs); `markdown` renders report.md and `html` turns that Markdown
//! into report.html.

mod claims;
mod html;
mod markdown;
mod read;
#[cfg(test)]
mod tests;

use anyhow::{bail, Context, Result};
use base64::Engine as _;
use claims::judge_all;
use clap::Args;
use html::to_html;
use markdown::render;
use read::{figures, first, read_accuracy, read_runs};
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
    let title = first(&df, "experiment").unwrap_or_else(|| "kvbench report".into());
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
