//! `kvbench plot`: the study's figures from an experiment's Parquet tables, as PNG
//! and SVG in `results/<experiment>/figures/` (the kvbench-plots crate draws them).

use anyhow::{bail, Context, Result};
use clap::Args;
use kvbench_plots::{parse_figures, render, render_overlay, Context as PlotContext, FigureId};
use std::path::{Path, PathBuf};

#[derive(Debug, Args)]
pub struct PlotArgs {
    /// The experiment's results directory (`results/<name>/`, with runs.parquet), or
    /// just its name under ./results/.
    pub results: PathBuf,

    /// Figures to draw, comma-separated: fig1 … fig8 (or 1 … 8). Default: all.
    #[arg(long)]
    pub figures: Option<String>,

    /// Where to write the figures (default: RESULTS/figures/).
    #[arg(long)]
    pub out: Option<PathBuf>,

    /// More results directories drawn in the same figures, e.g. the prediction of the
    /// same experiment (`kvbench predict`): its cells are series of their own, marked
    /// `(predicted)`. Give `--out` to keep RESULTS/figures/ as it is.
    #[arg(long, num_args = 1..)]
    pub with: Vec<PathBuf>,
}

/// `results/EXP` as given, else `./results/EXP` when only a name was given.
fn resolve(p: &Path) -> PathBuf {
    if p.is_dir() {
        return p.to_path_buf();
    }
    let under = Path::new("results").join(p);
    if p.components().count() == 1 && under.is_dir() {
        under
    } else {
        p.to_path_buf()
    }
}

/// The model named by the experiment's YAML kept beside its results, for titles.
fn model_of(dir: &Path) -> Option<String> {
    crate::experiment::recorded(dir, "model")
}

pub fn run(a: PlotArgs) -> Result<()> {
    let dir = resolve(&a.results);
    let figures = match &a.figures {
        Some(list) => parse_figures(list).with_context(|| format!("--figures {list}"))?,
        None => FigureId::ALL.to_vec(),
    };
    let ctx = PlotContext {
        model: model_of(&dir),
        out_dir: a.out.clone(),
    };
    let reports = if a.with.is_empty() {
        render(&dir, &figures, &ctx)?
    } else {
        let mut dirs = vec![dir.clone()];
        dirs.extend(a.with.iter().map(|d| resolve(d)));
        // Overlays draw each directory's cells as series beside the first's: the same
        // directory twice would count its cells twice, another model's would put its
        // numbers under this one's title.
        if let Some(d) = super::given_twice(&dirs) {
            bail!("--with {}: already drawn (given twice)", d.display());
        }
        for d in &dirs[1..] {
            let (m0, m) = (model_of(&dirs[0]), model_of(d));
            if let (Some(m0), Some(m)) = (&m0, &m) {
                if m0 != m {
                    bail!(
                        "--with {}: a run of {m}, and {} is of {m0}: an overlay draws one model's cells",
                        d.display(),
                        dirs[0].display()
                    );
                }
            }
        }
        render_overlay(&dirs, &figures, &ctx)?
    };
    let empty = reports.iter().filter(|r| r.no_data.is_some()).count();
    for r in &reports {
        println!("{r}");
    }
    let out = a.out.unwrap_or_else(|| dir.join("figures"));
    println!(
        "{} figure(s) in {}: {} drawn, {} without data",
        reports.len(),
        out.display(),
        reports.len() - empty,
        empty
    );
    Ok(())
}
