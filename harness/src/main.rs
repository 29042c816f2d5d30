//! `kvbench`: benchmark and characterization of KV-cache management strategies. The
//! command line and everything behind it are in the library (src/lib.rs), so that tests
//! reach them without spawning this binary.

use clap::Parser;

fn main() -> anyhow::Result<()> {
    kvbench::commands::run(kvbench::commands::Cli::parse())
}
