//! Attention kernels. `paged` reads K/V through block tables (decode and prefill
//! continuing a cached context); `dense` is the plain causal attention used as the
//! no-cache reference.

pub mod dense;
pub mod paged;
