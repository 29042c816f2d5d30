//! Per-layer paged K/V buffers of shape `[num_blocks, Hkv, block_size, row]`: a block's
//! rows of one KV head are contiguous (as in vLLM's own layout, which also puts the
//! head before the token), so attention streams them instead of striding per token.
//! A row is stored as its [`KvCodec`] says: f32, 16-bit, or integer codes with their
//! scales (kept in a parallel buffer of the same layout).
//!
//! The buffers are zero-allocated up front (the vLLM pool, `reservation=fraction`); on
//! CPU untouched pages cost no resident memory, so reserving a large pool is cheap while
//! its bytes still count in the ledger. A pool grown on demand (`reservation=budget`)
//! extends them block by block ([`PagedKv::ensure_blocks`]).

use crate::kv::codec::{decode_int, KvCodec};
use crate::kv::BlockId;
use half::{bf16, f16};

/// Raw storage; 16-bit types are kept as `u16` so the allocation is `calloc`ed.
#[derive(Debug)]
enum Buf {
    F32(Vec<f32>),
    U16(Vec<u16>),
    /// Codes (`code_bytes` per row) and parameters (`param_floats` per row).
    Int {
        codes: Vec<u8>,
        params: Vec<f32>,
    },
}

/// A read view of one layer's K or V.
#[derive(Clone, Copy)]
pub enum KvView<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    Bf16(&'a [bf16]),
    Int {
        codes: &'a [u8],
        params: &'a [f32],
        bits: u8,
        group: usize,
        /// Bytes of codes and f32 parameters per row.
        code_bytes: usize,
        param_floats: usize,
    },
}

impl<'a> KvView<'a> {
    /// Ask the CPU to start loading rows `first..first + n` into its caches (a hint;
    /// nothing where the platform has no prefetch or the storage is coded): a block's
    /// rows are one short stream that the hardware prefetchers do not reach before it
    /// is read, since the next block lies anywhere in the pool.
    #[inline]
    pub fn prefetch(&self, first: usize, n: usize, dh: usize) {
        let (a, b) = (first * dh, (first + n) * dh);
        match *self {
            KvView::F32(x) => prefetch_range(&x[a..b.min(x.len())]),
            KvView::F16(x) => prefetch_range(&x[a..b.min(x.len())]),
            KvView::Bf16(x) => prefetch_range(&x[a..b.min(x.len())]),
            KvView::Int { .. } => {}
        }
    }

    /// Rows `first..first + n` (`dh` wide each, row indices as the buffer's layout
    /// numbers them) in f32: the storage itself when it is f32, else decoded into
    /// `scratch` (grown as needed).
    #[inline]
    pub fn rows<'s>(
        &self,
        first: usize,
        n: usize,
        dh: usize,
        scratch: &'s mut Vec<f32>,
    ) -> &'s [f32]
    where
        'a: 's,
    {
        let (a, b) = (first * dh, (first + n) * dh);
        match *self {
            KvView::F32(x) => &x[a..b],
            KvView::F16(x) => {
                fill(scratch, x[a..b].iter().map(|v| v.to_f32()), n * dh);
                &scratch[..n * dh]
            }
            KvView::Bf16(x) => {
                fill(scratch, x[a..b].iter().map(|v| v.to_f32()), n * dh);
                &scratch[..n * dh]
            }
            KvView::Int {
                codes,
                params,
                bits,
                group,
                code_bytes,
                param_floats,
            } => {
                if scratch.len() < n * dh {
                    scratch.resize(n * dh, 0.0);
                }
                for (r, out) in scratch[..n * dh].chunks_exact_mut(dh).enumerate() {
                    let row = first + r;
                    decode_int(
                        &codes[row * code_bytes..(row + 1) * code_bytes],
                        &params[row * param_floats..(row + 1) * param_floats],
                        bits,
                        group,
                        out,
                    );
                }
                &scratch[..n * dh]
            }
        }
    }

    /// The storage itself when it is f32.
    pub fn as_f32(&self) -> Option<&'a [f32]> {
        match *self {
            KvView::F32(x) => Some(x),
            _ => None,
        }
    }
}

fn fill(scratch: &mut Vec<f32>, it: impl Iterator<Item = f32>, n: usize) {
    if scratch.len() < n {
        scratch.resize(n, 0.0);
    }
    for (d, v) in scratch.iter_mut().zip(it) {
        *d = v;
    }
}

#[derive(Debug)]
pub struct PagedKv {
    codec: KvCodec,
    block_size: usize,
    num_kv_heads: usize,
    head_dim: usize,
    num_blocks: usize,
    /// (K, V) per layer.
    layers: Vec<(Buf, Buf)>,
}

impl PagedKv {
    pub fn new(
        num_layers: usize,
        num_blocks: usize,
        block_size: usize,
        num_kv_heads: usize,
        head_dim: usize,
        codec: KvCodec,
    ) -> Self {
        let rows = num_blocks * block_size * num_kv_heads;
        let alloc = || match codec {
            KvCodec::F32 => Buf::F32(vec![0f32; rows * head_dim]),
            KvCodec::F16 | KvCodec::Bf16 => Buf::U16(vec![0u16; rows * head_dim]),
            KvCodec::Int { .. } => Buf::Int {
                codes: vec![0u8; rows * codec.code_bytes(head_dim)],
                params: vec![0f32; rows * codec.param_floats(head_dim)],
            },
        };
        let layers = (0..num_layers).map(|_| (alloc(), alloc())).collect();
        Self {
            codec,
            block_size,
            num_kv_heads,
            head_dim,
            num_blocks,
            layers,
        }
    }

    /// Bytes of one block over all layers, K and V.
    pub fn block_bytes(
        num_layers: usize,
        block_size: usize,
        num_kv_heads: usize,
        head_dim: usize,
        codec: KvCodec,
    ) -> u64 {
        (2 * num_layers * block_size * num_kv_heads * codec.row_bytes(head_dim)) as u64
    }

    /// Bytes of one block of this storage over all layers, K and V.
    pub fn bytes_per_block(&self) -> u64 {
        Self::block_bytes(
            self.layers.len(),
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            self.codec,
        )
    }

    /// Blocks the buffers hold.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Grow the buffers to hold at least `num_blocks` blocks (an on-demand pool that
    /// grew); the stored blocks keep their contents.
    pub fn ensure_blocks(&mut self, num_blocks: usize) {
        if num_blocks <= self.num_blocks {
            return;
        }
        let rows = num_blocks * self.block_size * self.num_kv_heads;
        let (dh, codec) = (self.head_dim, self.codec);
        for (k, v) in &mut self.layers {
            for b in [k, v] {
                match b {
                    Buf::F32(x) => x.resize(rows * dh, 0.0),
                    Buf::U16(x) => x.resize(rows * dh, 0),
                    Buf::Int { codes, params } => {
                        codes.resize(rows * codec.code_bytes(dh), 0);
                        params.resize(rows * codec.param_floats(dh), 0.0);
                    }
                }
            }
        }
        self.num_blocks = num_blocks;
    }

    pub fn bytes(&self) -> u64 {
        Self::block_bytes(
            self.layers.len(),
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            self.codec,
        ) * self.num_blocks as u64
    }

    pub fn codec(&self) -> KvCodec {
        self.codec
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Elements of one token's K (or V) in one layer: `Hkv × dh`.
    pub fn token_stride(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Slot of logical position `pos` of a sequence with block table `table`.
    #[inline]
    pub fn slot(&self, table: &[BlockId], pos: usize) -> usize {
        table[pos / self.block_size] as usize * self.block_size + pos % self.block_size
    }

    /// Write one token's K and V (`[Hkv, dh]` each, f32) into `slot` of `layer`.
    pub fn write(&mut self, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        let (bs, hkv, dh) = (self.block_size, self.num_kv_heads, self.head_dim);
        let (blk, t) = (slot / bs, slot % bs);
        let codec = self.codec;
        let (kb, vb) = &mut self.layers[layer];
        for (buf, src) in [(kb, k), (vb, v)] {
            for g in 0..hkv {
                let row = (blk * hkv + g) * bs + t;
                let src = &src[g * dh..(g + 1) * dh];
                match buf {
                    Buf::F32(b) => b[row * dh..(row + 1) * dh].copy_from_slice(src),
                    Buf::U16(b) => {
                        for (d, &s) in b[row * dh..(row + 1) * dh].iter_mut().zip(src) {
                            *d = match codec {
                                KvCodec::Bf16 => bf16::from_f32(s).to_bits(),
                                _ => f16::from_f32(s).to_bits(),
                            };
                        }
                    }
                    Buf::Int { codes, params } => {
                        let (cb, pf) = (codec.code_bytes(dh), codec.param_floats(dh));
                        let c = &mut codes[row * cb..(row + 1) * cb];
                        c.fill(0);
                        codec.encode_int(src, c, &mut params[row * pf..(row + 1) * pf]);
                    }
                }
            }
        }
    }

    /// Row index of (slot, KV head `g`) in the layout.
    #[inline]
    fn row(&self, slot: usize, g: usize) -> usize {
        let bs = self.block_size;
        (slot / bs * self.num_kv_heads + g) * bs + slot % bs
    }

    /// KV head `g`'s K and V at `positions` of a sequence in `layer`, appended to
    /// `k` and `v` as f32 rows of `dh` (Quest's selected pages, head-major tiles).
    pub fn gather_head(
        &self,
        layer: usize,
        table: &[BlockId],
        g: usize,
        positions: impl Iterator<Item = usize>,
        k: &mut Vec<f32>,
        v: &mut Vec<f32>,
    ) {
        let dh = self.head_dim;
        let (kv, vv) = self.views(layer);
        let mut scratch = Vec::new();
        for p in positions {
            let row = self.row(self.slot(table, p), g);
            k.extend_from_slice(kv.rows(row, 1, dh, &mut scratch));
            v.extend_from_slice(vv.rows(row, 1, dh, &mut scratch));
        }
    }

    /// Positions `0..n` of a sequence's K and V in `layer`, contiguous `[n, Hkv, dh]`
    /// f32 (for attention implementations that want a plain matrix).
    pub fn gather(&self, layer: usize, table: &[BlockId], n: usize) -> (Vec<f32>, Vec<f32>) {
        let (bs, hkv, dh) = (self.block_size, self.num_kv_heads, self.head_dim);
        let (kv, vv) = self.views(layer);
        let mut out = (vec![0f32; n * hkv * dh], vec![0f32; n * hkv * dh]);
        let mut scratch = Vec::new();
        for (view, dst) in [(kv, &mut out.0), (vv, &mut out.1)] {
            let mut start = 0;
            while start < n {
                let len = (n - start).min(bs);
                let blk = table[start / bs] as usize;
                for g in 0..hkv {
                    // One head's rows of the block are contiguous in the layout.
                    let rows = view.rows((blk * hkv + g) * bs, len, dh, &mut scratch);
                    for (t, r) in rows.chunks_exact(dh).enumerate() {
                        dst[((start + t) * hkv + g) * dh..][..dh].copy_from_slice(r);
                    }
                }
                start += len;
            }
        }
        out
    }

    /// Copy KV head `g`'s K and V of `src` slot into `dst` slot in `layer` (per-head
    /// eviction: the new token takes the evicted token's slot).
    pub fn copy_head(&mut self, layer: usize, g: usize, src: usize, dst: usize) {
        let (a, b) = (self.row(src, g), self.row(dst, g));
        let (dh, codec) = (self.head_dim, self.codec);
        let (kb, vb) = &mut self.layers[layer];
        for buf in [kb, vb] {
            match buf {
                Buf::F32(x) => x.copy_within(a * dh..(a + 1) * dh, b * dh),
                Buf::U16(x) => x.copy_within(a * dh..(a + 1) * dh, b * dh),
                Buf::Int { codes, params } => {
                    let (cb, pf) = (codec.code_bytes(dh), codec.param_floats(dh));
                    codes.copy_within(a * cb..(a + 1) * cb, b * cb);
                    params.copy_within(a * pf..(a + 1) * pf, b * pf);
                }
            }
        }
    }

    /// Views of `layer`'s K and V.
    pub fn views(&self, layer: usize) -> (KvView<'_>, KvView<'_>) {
        let (k, v) = &self.layers[layer];
        (self.view(k), self.view(v))
    }

    fn view<'a>(&self, b: &'a Buf) -> KvView<'a> {
        match (b, self.codec) {
            (Buf::F32(x), _) => KvView::F32(x),
            (Buf::U16(x), KvCodec::Bf16) => KvView::Bf16(bytemuck::cast_slice(x)),
            (Buf::U16(x), _) => KvView::F16(bytemuck::cast_slice(x)),
            (Buf::Int { codes, params }, KvCodec::Int { bits, group }) => KvView::Int {
                codes,
                params,
                bits,
                group: group as usize,
                code_bytes: self.codec.code_bytes(self.head_dim),
                param_floats: self.codec.param_floats(self.head_dim),
            },
            (Buf::Int { .. }, _) => unreachable!("integer buffers belong to integer codecs"),
        }
    }
}

/// Prefetch hints for every cache line of `x`.
#[inline]
fn prefetch_range<T>(x: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let p = x.as_ptr() as *const i8;
        let bytes = std::mem::size_of_val(x);
        for off in (0..bytes).step_by(64) {
            // SAFETY: a prefetch is a hint that never faults; the address lies inside `x`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.add(off)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}
