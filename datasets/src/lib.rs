//! kvbench datasets: corpora → prompts of exact token length, arrival processes, the
//! multiple-choice log-likelihood tasks (lm-eval's formats), chat conversations and the
//! retention task.
//!
//! The crate knows nothing of the engines: text is turned into tokens through the
//! [`Tokenize`] trait, which the harness implements with the model's tokenizer.

pub mod arrivals;
pub mod corpus;
pub mod prompts;
pub mod retention;
pub mod tasks;

use std::path::PathBuf;

/// How to get the evaluation data: the end of every error about a missing data file.
pub const FETCH_HINT: &str = "fetch the evaluation data with `just fetch-data` (into data/ by \
     default), or point --data-dir, KVBENCH_DATASETS_DIR or the experiment's data_dir at a copy";

/// Text → token ids, as the model's tokenizer does it.
pub trait Tokenize {
    fn encode(&self, text: &str) -> std::result::Result<Vec<u32>, String>;
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A data file that is not there (the data directory was never filled, or points
    /// elsewhere).
    #[error("{path} not found: {hint}", hint = FETCH_HINT)]
    Missing { path: PathBuf },
    #[error("{path}: {message}")]
    Format { path: PathBuf, message: String },
    #[error("{path}:{line}: {message}")]
    Line {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("invalid workload: {0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, Error>;
