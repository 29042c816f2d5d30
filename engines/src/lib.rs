//! kvbench engines: a Llama-family model on candle whose attention delegates to a KV
//! policy, the paged KV storage, attention kernels, the continuous-batching scheduler,
//! step traces and the memory ledger.

pub mod attention;
pub mod compare;
pub mod config;
pub mod cost;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod engine;
pub mod error;
pub mod kv;
pub mod ledger;
pub mod model;
pub mod policy;
pub mod scheduler;
pub mod source;
pub mod tokenizer;
pub mod trace;

pub use error::{Error, Result};
