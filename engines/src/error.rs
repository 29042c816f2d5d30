//! Typed errors of the engines crate.

use std::path::PathBuf;

/// Memory components tracked by the [`crate::ledger::MemoryLedger`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Component {
    Weights,
    KvDevice,
    KvHost,
    Activations,
    TransferBuffers,
}

impl std::fmt::Display for Component {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            Component::Weights => "weights",
            Component::KvDevice => "KV cache (device)",
            Component::KvHost => "KV cache (host)",
            Component::Activations => "activations",
            Component::TransferBuffers => "transfer buffers",
        };
        f.write_str(s)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Candle(#[from] candle_core::Error),

    /// An allocation went past the device (or host) capacity. The same error on every
    /// device, so OOM boundaries can be studied on CPU with a capacity.
    #[error(
        "out of memory on {device}: {component} needs {requested} bytes, {available} of {capacity} bytes available"
    )]
    OutOfMemory {
        device: String,
        component: Component,
        requested: u64,
        available: u64,
        capacity: u64,
    },

    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("model {model}: {message}")]
    Model { model: String, message: String },

    #[error("tokenizer: {0}")]
    Tokenizer(String),

    /// A request that can never run with this engine's configuration.
    #[error("request {id} rejected: {reason}")]
    RequestRejected { id: u64, reason: String },

    /// The budget audit found a policy attending or holding more than its budget.
    #[error("budget audit failed: {0}")]
    Budget(String),

    #[error("invalid configuration: {0}")]
    Config(String),

    #[error("device {0} is not available in this build: a CUDA kvbench is built with `just build-cuda` (the `cuda` feature; docs/cuda.md)")]
    DeviceUnavailable(String),
}

impl Error {
    pub fn model(model: impl std::fmt::Display, message: impl Into<String>) -> Self {
        Error::Model {
            model: model.to_string(),
            message: message.into(),
        }
    }

    pub fn is_oom(&self) -> bool {
        matches!(self, Error::OutOfMemory { .. })
    }
}

pub type Result<T> = std::result::Result<T, Error>;
