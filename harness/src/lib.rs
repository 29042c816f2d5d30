//! kvbench: benchmark and characterization of KV-cache management strategies in LLM
//! inference. The `kvbench` binary (src/main.rs) only parses the command line and hands
//! it to [`commands::run`]; the library holds the rest so that tests can call it.

pub mod cell;
pub mod cell_file;
pub mod commands;
pub mod compare;
#[cfg(test)]
mod docs_check;
pub mod environment;
pub mod experiment;
pub mod metrics;
pub mod prediction;
pub mod recorder;
pub mod report;
pub mod run;
pub mod sampler;
pub mod setup;

pub use commands::Cli;
