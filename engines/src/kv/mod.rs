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

/// Whether this host can reserve a zeroed buffer of `bytes` (as the pool's per-layer
/// buffers are: `calloc`ed, so untouched pages cost no memory). A trial allocation,
/// freed at once: a pool sized from a capacity the host cannot map is refused with an
/// error instead of the process aborting inside the allocator.
pub fn can_reserve(bytes: u64) -> bool {
    let Ok(size) = usize::try_from(bytes.max(1)) else {
        return false;
    };
    let Ok(layout) = std::alloc::Layout::from_size_align(size, 64) else {
        return false;
    };
    // SAFETY: a non-zero size; the pointer is freed with the layout it was made with.
    unsafe {
        // Kept opaque: an allocation nothing reads may be elided by the compiler.
        let p = std::hint::black_box(std::alloc::alloc_zeroed(layout));
        if p.is_null() {
            return false;
        }
        std::alloc::dealloc(p, layout);
    }
    true
}
