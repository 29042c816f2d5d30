//! KV storage: the paged block pool and its per-layer buffers.

pub mod block_pool;
pub mod paged;

pub use block_pool::{BlockId, BlockPool};
pub use paged::{KvDtype, PagedKv};
