//! `kvbench report results/EXP`: writes report.md and report.html (see `crate::report`);
//! with several results directories and `--out`, one report over all of them.

use crate::report::{
    figures, first, judge_all, read_accuracy, read_runs, render, render_many, to_html, Part,
};
use anyhow::{bail, Context, Result};
use base64::Engine as _;
use clap::Args;
use std::path::{Path, PathBuf};

#[derive(Debug, Args)]
pub struct ReportArgs {
    /// An experiment's results directory (results/EXP, holding runs.parquet), or just
    /// its name under ./results/. Several, with `--out`: one report over all of them,
    /// each claim judged from the first that has its data.
    #[arg(required = true)]
    pub results: Vec<PathBuf>,
    /// Where the combined report of several results directories goes (report.md,
    /// report.html, and the figures it shows); a single directory's report goes into it.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// A results directory as given, or `results/<name>`.
fn resolve(p: &Path) -> Result<PathBuf> {
    // A name stands for results/<name>, as for `kvbench plot`.
    let named = Path::new("results").join(p);
    let dir = if !p.is_dir() && named.is_dir() {
        named
    } else {
        p.to_path_buf()
    };
    if !dir.is_dir() {
        bail!(
            "{}: expected an experiment's results directory (results/EXP)",
            dir.display()
        );
    }
    Ok(dir)
}

/// `![name](path)` with the path relative to the report's directory, for report.md.
fn link(base: &Path, f: &Path) -> String {
    let rel = relative(base, f);
    format!("![{}]({})", rel.display(), rel.display())
}

/// `f` as seen from the directory `base` (`../other/figures/fig1.png`); as given when
/// either cannot be resolved.
fn relative(base: &Path, f: &Path) -> PathBuf {
    let (Ok(b), Ok(t)) = (base.canonicalize(), f.canonicalize()) else {
        return f.to_path_buf();
    };
    let (bc, tc): (Vec<_>, Vec<_>) = (b.components().collect(), t.components().collect());
    let common = bc.iter().zip(&tc).take_while(|(x, y)| x == y).count();
    let mut rel = PathBuf::new();
    for _ in common..bc.len() {
        rel.push("..");
    }
    for c in &tc[common..] {
        rel.push(c);
    }
    rel
}

/// A figure inline as PNG data, for report.html.
fn inline(f: &Path) -> Result<String> {
    let bytes = std::fs::read(f).with_context(|| format!("reading {}", f.display()))?;
    Ok(format!(
        "<img alt=\"{}\" src=\"data:image/png;base64,{}\">",
        f.file_name()
            .map_or(String::new(), |n| n.to_string_lossy().into_owned()),
        base64::engine::general_purpose::STANDARD.encode(bytes)
    ))
}

pub fn run(a: ReportArgs) -> Result<()> {
    // One directory twice would judge each claim from it twice.
    let resolved: Vec<PathBuf> = a.results.iter().filter_map(|p| resolve(p).ok()).collect();
    if let Some(d) = super::given_twice(&resolved) {
        bail!("{}: given twice", d.display());
    }
    if a.results.len() > 1 {
        return combined(&a);
    }
    let dir = &resolve(&a.results[0])?;
    let out = a.out.clone().unwrap_or_else(|| dir.clone());
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let (df, runs) = read_runs(dir)?;
    let figs = figures(dir);
    let md = render(dir, &df, &runs, &figs, &|f| Ok(link(&out, f)))?;
    let html_md = render(dir, &df, &runs, &figs, &inline)?;
    let title =
        first(&df, kvbench_plots::schema::EXPERIMENT).unwrap_or_else(|| "kvbench report".into());
    let (md_path, html_path) = write(&out, &md, &html_md, &title)?;
    let claims = judge_all(&runs, read_accuracy(dir)?.as_deref());
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

/// report.md and report.html into `out`.
fn write(out: &Path, md: &str, html_md: &str, title: &str) -> Result<(PathBuf, PathBuf)> {
    let html = to_html(html_md, &format!("kvbench report: {title}"));
    let md_path = out.join("report.md");
    let html_path = out.join("report.html");
    std::fs::write(&md_path, md).with_context(|| format!("writing {}", md_path.display()))?;
    std::fs::write(&html_path, html).with_context(|| format!("writing {}", html_path.display()))?;
    Ok((md_path, html_path))
}

/// One report over several results directories, into `--out`.
fn combined(a: &ReportArgs) -> Result<()> {
    let out = a
        .out
        .as_ref()
        .context("several results directories make one combined report: give --out DIR for it")?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let mut parts = Vec::new();
    for r in &a.results {
        let dir = resolve(r)?;
        let (df, runs) = read_runs(&dir)?;
        let figs = figures(&dir);
        parts.push(Part {
            dir,
            df,
            runs,
            figs,
        });
    }
    let md = render_many(&parts, &|f| Ok(link(out, f)))?;
    let html_md = render_many(&parts, &inline)?;
    let (md_path, html_path) = write(out, &md, &html_md, &format!("{} experiments", parts.len()))?;
    println!(
        "wrote {} and {} ({} experiments, {} cells)",
        md_path.display(),
        html_path.display(),
        parts.len(),
        parts.iter().map(|p| p.runs.len()).sum::<usize>()
    );
    Ok(())
}
