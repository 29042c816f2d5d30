//! `kvbench`: benchmark and characterization of KV-cache management strategies.

mod cell;
mod compare;
#[cfg(test)]
mod docs_check;
mod environment;
mod experiment;
mod generate;
mod metrics;
mod models;
mod plot;
mod recorder;
mod report;
mod run;
mod sampler;
mod setup;
mod verify;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "kvbench", version, about, long_about = None)]
struct Cli {
    /// Worker threads for CPU kernels (default: all cores). Sets RAYON_NUM_THREADS.
    #[arg(long, global = true, env = "KVBENCH_THREADS")]
    threads: Option<usize>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Generate from one prompt with one engine and print timings and KV bytes.
    Generate(generate::GenerateArgs),
    /// List the named models and presets with their architecture numbers.
    Models(models::ModelsArgs),
    /// Draw the study's figures (PNG + SVG) from an experiment's results.
    Plot(plot::PlotArgs),
    /// Run an experiment (performance, accuracy or retention): each cell in its own
    /// process, resumable, results as Parquet in results/<name>/ (`--dry-run` lists
    /// the cells).
    Run(run::RunArgs),
    /// Run one cell of an experiment and print its outcome and metrics as one JSON
    /// object (what the orchestrator runs in a child process per cell).
    RunCell(cell::RunCellArgs),
    /// Check every strategy × attention implementation against full + eager at budget
    /// 1.0, and each strategy's KV bytes against a small budget.
    Verify(verify::VerifyArgs),
    /// Compare a run with a baseline (both results directories): ratios of timings,
    /// exact outcomes and ledger bytes; non-zero exit on a regression.
    Compare(compare::CompareArgs),
    /// Write results/EXP/report.md and a self-contained report.html: environment,
    /// grid, a table per cell, the figures, and what the data says of each of the
    /// study's claims.
    Report(report::ReportArgs),
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    if let Some(n) = cli.threads {
        anyhow::ensure!(n > 0, "--threads must be at least 1");
        // Read by rayon and by candle's CPU matmuls; set before either starts a pool.
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Models(a) => models::run(a),
        Command::Plot(a) => plot::run(a),
        Command::Verify(a) => verify::run(a),
        Command::Run(a) => run::run(a),
        Command::RunCell(a) => cell::run(a),
        Command::Compare(a) => compare::run(a),
        Command::Report(a) => report::run(a),
    }
}
