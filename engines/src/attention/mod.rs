//! Attention kernels. `paged` reads K/V through block tables (decode and prefill
//! continuing a cached context); `decode` attends a per-sequence key set (kept slots
//! or a gathered tile) and can return the probabilities H2O accumulates; `prefill`
//! offers the eager / chunked / flash implementations and H2O's column statistics;
//! `dense` is the plain causal attention used as the no-cache reference.

pub mod decode;
pub mod dense;
pub mod paged;
pub mod prefill;
