//! The command line: the arguments and the handler of each subcommand, one file each;
//! the logic they call lives in the library's modules (`crate::run` the sweep,
//! `crate::compare` the comparison, `crate::report`, `crate::prediction`, ...).

pub mod bench_decode;
pub mod calibrate;
pub mod compare;
pub mod generate;
pub mod models;
pub mod plot;
pub mod predict;
pub mod recommend;
pub mod report;
pub mod run;
pub mod run_cell;
pub mod verify;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
// The version names the build (the hash of the code it was built from, which every
// cell records as env.build), so a binary that travelled can be told from another.
#[command(name = "kvbench", version = concat!(env!("CARGO_PKG_VERSION"), " (build ", env!("KVBENCH_BUILD_ID"), ")"), about, long_about = None)]
pub struct Cli {
    /// Worker threads for CPU kernels (default: all cores). Sets RAYON_NUM_THREADS.
    #[arg(long, global = true, env = "KVBENCH_THREADS")]
    pub threads: Option<usize>,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
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
    RunCell(run_cell::RunCellArgs),
    /// Check every strategy × attention implementation against full + eager at budget
    /// 1.0, and each strategy's KV bytes against a small budget (on CUDA, every kernel
    /// against an f64 reference first, and decode steps both replayed from CUDA graphs
    /// and launched kernel by kernel).
    Verify(verify::VerifyArgs),
    /// Time the CUDA paged decode kernels (vector with its reduction launched and
    /// folded; one-row, pipelined, tensor-core with it folded) on their own over
    /// synthetic caches (batch × context cases), beside the card's copy rate, each
    /// output checked against the vector kernel's with the reduction launched; then a step's
    /// RoPE and greedy choice, kvbench's kernels beside candle's operations, outputs
    /// checked against candle's; then InfiniGen's warm-up costs (the weights'
    /// fingerprint, the host tier's pinning) on 1 GiB beside their earlier forms; then
    /// the default decode kernel at up to 4 rows with each partition size pinned; then
    /// a step's products at 1, 2 and 4 rows in kvbench's matrix-vector kernel beside
    /// cuBLAS's.
    BenchDecode(bench_decode::BenchDecodeArgs),
    /// Compare a run with a baseline (both results directories): ratios of timings,
    /// exact outcomes and ledger bytes; non-zero exit on a regression.
    Compare(compare::CompareArgs),
    /// Write results/EXP/report.md and a self-contained report.html: environment,
    /// grid, a table per cell, the figures, and what the data says of each of the
    /// study's claims.
    Report(report::ReportArgs),
    /// Fit the cost model's efficiency constants of a device to the steps of measured
    /// experiments (a calibration file); `--validate` predicts held-out experiments and
    /// reports the error per metric.
    Calibrate(calibrate::CalibrateArgs),
    /// Predict every cell of a performance experiment on a device with the cost model,
    /// recorded like measured cells (runs.parquet, `predicted = true`) in
    /// results/<name>-predicted-<device>/.
    Predict(predict::PredictArgs),
    /// Rank KV strategies and budgets for a model, a device and a workload with the
    /// cost model: predicted TTFT, TPOT, throughput and memory, whether each objective
    /// is met, the measured accuracy cost, and why.
    Recommend(recommend::RecommendArgs),
}

/// The first of `dirs` that names a directory given before it (paths compared as the
/// file system resolves them): results read twice would count twice.
pub(crate) fn given_twice(dirs: &[std::path::PathBuf]) -> Option<&std::path::PathBuf> {
    let real: Vec<_> = dirs.iter().map(|d| d.canonicalize().ok()).collect();
    dirs.iter()
        .enumerate()
        .find(|&(i, _)| real[i].is_some() && real[..i].contains(&real[i]))
        .map(|(_, d)| d)
}

/// Run the parsed command line.
pub fn run(cli: Cli) -> Result<()> {
    if let Some(n) = cli.threads {
        anyhow::ensure!(n > 0, "--threads must be at least 1");
        // Each is an OS thread started up front: a mistyped count would hang the start.
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        anyhow::ensure!(
            n <= 64 * cores,
            "--threads {n}: expected at most {} (64 per core of this machine's {cores})",
            64 * cores
        );
        // Read by rayon and by candle's CPU matmuls; set before either starts a pool.
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
    match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Models(a) => models::run(a),
        Command::Plot(a) => plot::run(a),
        Command::Verify(a) => verify::run(a),
        Command::BenchDecode(a) => bench_decode::run(a),
        Command::Run(a) => run::run(a),
        Command::RunCell(a) => run_cell::run(a),
        Command::Compare(a) => compare::run(a),
        Command::Report(a) => report::run(a),
        Command::Calibrate(a) => calibrate::run(a),
        Command::Predict(a) => predict::run(a),
        Command::Recommend(a) => recommend::run(a),
    }
}
