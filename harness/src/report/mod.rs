//! `kvbench report results/EXP`: report.md and a self-contained report.html (figures
//! inline) with the environment, the grid, a summary table per cell and, for each of
//! the study's claims C1–C11 (docs/figures-and-report.md lists them), what our
//! data says: agrees, disagrees, or cannot tell (and why).
//!
//! The command (arguments, writing the files) is in commands/report.rs. `read` turns
//! runs.parquet into [`Run`]s; `claims` judges each claim (the list
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

pub use claims::{judge_all, Claim, Verdict};
pub(crate) use html::to_html;
pub(crate) use markdown::{render, render_many, Part};
pub(crate) use read::{figures, first, read_accuracy};
pub use read::{read_runs, Run};
