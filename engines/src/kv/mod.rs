//! KV storage: the paged block pool and its per-layer buffers, the codecs rows are
//! stored in, slot storage for
//! policies that keep a per-head subset of tokens, and the host tier of offloading
//! policies.

pub mod block_pool;
pub mod codec;
pub mod host;
pub mod paged;
pub mod slots;
pub mod tables;

pub use block_pool::{BlockId, BlockPool};
pub use codec::KvCodec;
pub use paged::{KvView, PagedKv};
pub use tables::SeqTables;
