//! kvbench plots: the study's figures, one renderer per file (`fig1.rs` … `fig8.rs`),
//! Parquet in (`results/<experiment>/runs.parquet`, `accuracy.parquet`), PNG + SVG out.
//!
//! Every figure renders from whatever subset of the data is present: cells that ran
//! out of memory or failed are marked where they would be, values that were not
//! measured are listed in a note on the figure, and a figure with nothing to show is
//! written as a placeholder that says why. Text uses an embedded font (DejaVu Sans,
//! `fonts/`), so a figure looks the same on every machine.
//!
//! ```no_run
//! use kvbench_plots::{render, Context, FigureId};
//! let reports = render(
//!     std::path::Path::new("results/cpu-ttft"),
//!     &FigureId::ALL,
//!     &Context::default(),
//! )?;
//! for r in &reports {
//!     println!("{r}");
//! }
//! # Ok::<(), kvbench_plots::Error>(())
//! ```

mod bars;
pub mod crossover;
mod data;
mod fig1;
mod fig2;
mod fig3;
mod fig4;
mod fig5;
mod fig6;
mod fig7;
mod fig8;
mod lines;
pub mod schema;
mod select;
mod style;

pub use data::{f64s, strs, AccRow, Tables};
pub use style::ENGINE_COLOURS;

use plotters::coord::Shift;
use plotters::prelude::*;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use style::DrawResult;

/// Errors of the figures library.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The results directory does not exist or is not a directory.
    #[error("{0}: not a directory (expected an experiment's results directory, e.g. results/<name>/, with runs.parquet)")]
    NotADirectory(PathBuf),
    /// The directory holds none of the tables the figures read.
    #[error("{0}: no runs.parquet or accuracy.parquet (expected the tables `kvbench run` writes; if cells/ exists, rebuild them with `kvbench run EXP.yaml --tables-only`)")]
    NoTables(PathBuf),
    /// A table exists but cannot be read as Parquet.
    #[error("{path}: not a readable Parquet table: {msg}")]
    Parquet { path: PathBuf, msg: String },
    /// A table that reads as Parquet but lacks the columns of its kind (another
    /// table under its name).
    #[error("{path}: not {kind}: no column `{column}`")]
    NotThatTable {
        path: PathBuf,
        kind: &'static str,
        column: &'static str,
    },
    /// A figure name that is not one of fig1 … fig8.
    #[error("unknown figure `{0}`: expected fig1 … fig8 (comma-separated)")]
    UnknownFigure(String),
    /// The embedded font could not be registered.
    #[error("the embedded font could not be loaded")]
    Font,
    /// Writing a figure file.
    #[error("{path}: {msg}")]
    Io { path: PathBuf, msg: String },
    /// The drawing backend failed.
    #[error("drawing failed: {0}")]
    Draw(String),
}

/// One of the study's figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FigureId {
    Fig1,
    Fig2,
    Fig3,
    Fig4,
    Fig5,
    Fig6,
    Fig7,
    Fig8,
}

impl FigureId {
    /// Every figure, in order.
    pub const ALL: [FigureId; 8] = [
        FigureId::Fig1,
        FigureId::Fig2,
        FigureId::Fig3,
        FigureId::Fig4,
        FigureId::Fig5,
        FigureId::Fig6,
        FigureId::Fig7,
        FigureId::Fig8,
    ];

    /// `fig1` … `fig8`: the file stem and the name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            FigureId::Fig1 => "fig1",
            FigureId::Fig2 => "fig2",
            FigureId::Fig3 => "fig3",
            FigureId::Fig4 => "fig4",
            FigureId::Fig5 => "fig5",
            FigureId::Fig6 => "fig6",
            FigureId::Fig7 => "fig7",
            FigureId::Fig8 => "fig8",
        }
    }

    /// What the figure shows, as its title says.
    pub fn subject(self) -> &'static str {
        match self {
            FigureId::Fig1 => "TTFT vs prompt length",
            FigureId::Fig2 => "Prefill memory and latency by attention implementation",
            FigureId::Fig3 => "Device and host memory by component vs batch",
            FigureId::Fig4 => "Decode throughput and throughput per GB vs batch",
            FigureId::Fig5 => "Walltime breakdown and total latency vs batch",
            FigureId::Fig6 => "Throughput and walltime vs output length",
            FigureId::Fig7 => "Accuracy vs KV budget per task",
            FigureId::Fig8 => "Retention by context bucket and by turn",
        }
    }

    /// Pixel size of the PNG (and the SVG's canvas).
    pub fn size(self) -> (u32, u32) {
        style::SIZE
    }
}

impl fmt::Display for FigureId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for FigureId {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        let t = s.trim().to_ascii_lowercase();
        FigureId::ALL
            .into_iter()
            .find(|f| f.name() == t || f.name()[3..] == t)
            .ok_or_else(|| Error::UnknownFigure(s.trim().to_string()))
    }
}

/// Parse `fig1,fig3` (or `1,3`) into figures, in the order given, without repeats.
pub fn parse_figures(list: &str) -> Result<Vec<FigureId>, Error> {
    let mut out = Vec::new();
    for part in list.split(',').filter(|p| !p.trim().is_empty()) {
        let f: FigureId = part.parse()?;
        if !out.contains(&f) {
            out.push(f);
        }
    }
    if out.is_empty() {
        return Err(Error::UnknownFigure(list.to_string()));
    }
    Ok(out)
}

/// What the caller knows that the tables do not say.
#[derive(Debug, Clone, Default)]
pub struct Context {
    /// The model of the experiment (its YAML's `model`), for the titles, when the
    /// tables have no `model` column.
    pub model: Option<String>,
    /// Where the figures go; default `<results>/figures/`.
    pub out_dir: Option<PathBuf>,
}

/// What happened to one figure.
#[derive(Debug, Clone)]
pub struct Report {
    pub figure: FigureId,
    /// The PNG and SVG written (a placeholder when `no_data` is set).
    pub png: PathBuf,
    pub svg: PathBuf,
    /// Set when the figure had nothing to draw: why (the placeholder says the same).
    pub no_data: Option<String>,
    /// What the figure leaves out or could not measure (also written on it).
    pub notes: Vec<String>,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.no_data {
            Some(why) => write!(
                f,
                "{}: skipped, no data: {why} (placeholder {})",
                self.figure,
                self.png.display()
            )?,
            None => write!(
                f,
                "{}: wrote {} and {}",
                self.figure,
                self.png.display(),
                self.svg.display()
            )?,
        }
        for n in &self.notes {
            write!(f, "\n    {n}")?;
        }
        Ok(())
    }
}

/// A figure ready to draw on any backend.
pub(crate) trait Draw {
    /// The figure's notes: what is left out, missing or marked.
    fn notes(&self) -> Vec<String>;
    /// Draw the plot area (title and notes are drawn around it).
    fn draw<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> Result<(), Error>;
}

/// What a figure module gives back: a drawable figure, or why there is nothing to draw.
pub(crate) type Prepared<F> = Result<F, String>;

/// Render `figures` of the experiment in `dir` into `dir/figures/` (or
/// `ctx.out_dir`). A figure without data is written as a placeholder and reported
/// with `no_data`; only unreadable input or an unwritable output is an error.
pub fn render(dir: &Path, figures: &[FigureId], ctx: &Context) -> Result<Vec<Report>, Error> {
    let tables = Tables::load(dir, ctx.model.clone())?;
    render_tables(&tables, figures, ctx)
}

/// [`render`] over several results directories drawn together: the first gives the
/// output directory, the others' cells join it (a measured experiment and its
/// prediction, whose cells are series of their own, `(predicted)`).
pub fn render_overlay(
    dirs: &[PathBuf],
    figures: &[FigureId],
    ctx: &Context,
) -> Result<Vec<Report>, Error> {
    let Some((first, rest)) = dirs.split_first() else {
        return Ok(Vec::new());
    };
    let mut tables = Tables::load(first, ctx.model.clone())?;
    for d in rest {
        tables.merge(Tables::load(d, ctx.model.clone())?);
    }
    render_tables(&tables, figures, ctx)
}

/// Render from tables already loaded (tests build them in memory).
pub fn render_tables(
    tables: &Tables,
    figures: &[FigureId],
    ctx: &Context,
) -> Result<Vec<Report>, Error> {
    style::register_font()?;
    let out = ctx
        .out_dir
        .clone()
        .unwrap_or_else(|| tables.dir.join("figures"));
    std::fs::create_dir_all(&out).map_err(|e| Error::Io {
        path: out.clone(),
        msg: format!("cannot create the figures directory: {e}"),
    })?;
    let mut reports = Vec::new();
    for &fig in figures {
        let base = out.join(fig.name());
        let r = match fig {
            FigureId::Fig1 => emit(fig, tables, fig1::prepare(tables), &base)?,
            FigureId::Fig2 => emit(fig, tables, fig2::prepare(tables), &base)?,
            FigureId::Fig3 => emit(fig, tables, fig3::prepare(tables), &base)?,
            FigureId::Fig4 => emit(fig, tables, fig4::prepare(tables), &base)?,
            FigureId::Fig5 => emit(fig, tables, fig5::prepare(tables), &base)?,
            FigureId::Fig6 => emit(fig, tables, fig6::prepare(tables), &base)?,
            FigureId::Fig7 => emit(fig, tables, fig7::prepare(tables), &base)?,
            FigureId::Fig8 => emit(fig, tables, fig8::prepare(tables), &base)?,
        };
        reports.push(r);
    }
    Ok(reports)
}

/// Write one figure (or its placeholder) as PNG and SVG.
fn emit<F: Draw>(
    fig: FigureId,
    tables: &Tables,
    prepared: Prepared<F>,
    base: &Path,
) -> Result<Report, Error> {
    let png = base.with_extension("png");
    let svg = base.with_extension("svg");
    let title = style::Title {
        heading: format!("Fig. {} — {}", &fig.name()[3..], fig.subject()),
        context: tables.meta.describe(),
    };
    let (notes, no_data) = match &prepared {
        Ok(f) => (f.notes(), None),
        Err(why) => (Vec::new(), Some(why.clone())),
    };
    let size = fig.size();
    {
        let root = BitMapBackend::new(&png, size).into_drawing_area();
        paint(&root, &title, &notes, &prepared).map_err(|e| at(&png, e))?;
        root.present().drawn().map_err(|e| at(&png, e))?;
    }
    {
        let root = SVGBackend::new(&svg, size).into_drawing_area();
        paint(&root, &title, &notes, &prepared).map_err(|e| at(&svg, e))?;
        root.present().drawn().map_err(|e| at(&svg, e))?;
    }
    Ok(Report {
        figure: fig,
        png,
        svg,
        no_data,
        notes,
    })
}

fn paint<DB: DrawingBackend, F: Draw>(
    root: &DrawingArea<DB, Shift>,
    title: &style::Title,
    notes: &[String],
    prepared: &Prepared<F>,
) -> Result<(), Error> {
    let body = style::frame(root, title, notes)?;
    match prepared {
        Ok(f) => f.draw(&body),
        Err(why) => style::no_data(&body, why),
    }
}

fn at(path: &Path, e: Error) -> Error {
    match e {
        Error::Draw(msg) => Error::Io {
            path: path.to_path_buf(),
            msg,
        },
        other => other,
    }
}
