//! KV storage: the paged block pool and its per-layer buffers, slot storage for
//! policies that keep a per-head subset of tokens, and the host tier of offloading
//! policies.

pub mod block_pool;
pub mod host;
pub mod paged;
pub mod slots;
pub mod tables;

pub use block_pool::{BlockId, BlockPool};
pub use paged::{KvDtype, PagedKv};
pub use tables::SeqTables;
