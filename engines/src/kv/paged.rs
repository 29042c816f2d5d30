//! Per-layer paged K/V buffers of shape `[num_blocks, Hkv, block_size, dh]`: a block's
//! keys of one KV head are contiguous (as in vLLM's own layout, which also puts the
//! head before the token), so attention streams them instead of striding per token.
//!
//! The buffers are zero-allocated up front (the vLLM pool, `reservation=fraction`); on
//! CPU untouched pages cost no resident memory, so reserving a large pool is cheap while
//! its bytes still count in the ledger. A pool grown on demand (`reservation=budget`)
//! extends them block by block ([`PagedKv::ensure_blocks`]).

use crate::kv::BlockId;
use half::{bf16, f16};

/// Element type of the stored K/V.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    F32,
    F16,
    Bf16,
}

impl KvDtype {
    pub fn size(&self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
        }
    }

    pub fn from_candle(d: candle_core::DType) -> Self {
        match d {
            candle_core::DType::F16 => KvDtype::F16,
            candle_core::DType::BF16 => KvDtype::Bf16,
            _ => KvDtype::F32,
        }
    }
}

/// A stored K/V element; the kernels compute in f32.
pub trait KvElem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    /// The slice itself when the storage already is f32 (kernels then read it in place).
    fn as_f32(_s: &[Self]) -> Option<&[f32]> {
        None
    }
}

impl KvElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        Some(s)
    }
}

impl KvElem for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

impl KvElem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

/// Raw storage; 16-bit types are kept as `u16` so the allocation is `calloc`ed.
#[derive(Debug)]
enum Buf {
    F32(Vec<f32>),
    U16(Vec<u16>),
}

/// A read view of one layer's K or V, typed.
#[derive(Clone, Copy)]
pub enum KvView<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    Bf16(&'a [bf16]),
}

#[derive(Debug)]
pub struct PagedKv {
    dtype: KvDtype,
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
        dtype: KvDtype,
    ) -> Self {
        let n = num_blocks * block_size * num_kv_heads * head_dim;
        let alloc = || match dtype {
            KvDtype::F32 => Buf::F32(vec![0f32; n]),
            KvDtype::F16 | KvDtype::Bf16 => Buf::U16(vec![0u16; n]),
        };
        let layers = (0..num_layers).map(|_| (alloc(), alloc())).collect();
        Self {
            dtype,
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
        dtype: KvDtype,
    ) -> u64 {
        (2 * num_layers * block_size * num_kv_heads * head_dim * dtype.size()) as u64
    }

    /// Bytes of one block of this storage over all layers, K and V.
    pub fn bytes_per_block(&self) -> u64 {
        Self::block_bytes(
            self.layers.len(),
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
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
        let n = num_blocks * self.block_size * self.num_kv_heads * self.head_dim;
        for (k, v) in &mut self.layers {
            for b in [k, v] {
                match b {
                    Buf::F32(x) => x.resize(n, 0.0),
                    Buf::U16(x) => x.resize(n, 0),
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
            self.dtype,
        ) * self.num_blocks as u64
    }

    pub fn dtype(&self) -> KvDtype {
        self.dtype
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
        let (kb, vb) = &mut self.layers[layer];
        let dtype = self.dtype;
        for (buf, src) in [(kb, k), (vb, v)] {
            for g in 0..hkv {
                let dst = ((blk * hkv + g) * bs + t) * dh;
                let (dst, src) = (dst..dst + dh, &src[g * dh..(g + 1) * dh]);
                match buf {
                    Buf::F32(b) => b[dst].copy_from_slice(src),
                    Buf::U16(b) => {
                        for (d, &s) in b[dst].iter_mut().zip(src) {
                            *d = match dtype {
                                KvDtype::Bf16 => bf16::from_f32(s).to_bits(),
                                _ => f16::from_f32(s).to_bits(),
                            };
                        }
                    }
                }
            }
        }
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
        let (bs, hkv, dh) = (self.block_size, self.num_kv_heads, self.head_dim);
        let (kb, vb) = &self.layers[layer];
        for p in positions {
            let src = ((table[p / bs] as usize * hkv + g) * bs + p % bs) * dh;
            for (buf, dst) in [(kb, &mut *k), (vb, &mut *v)] {
                match buf {
                    Buf::F32(b) => dst.extend_from_slice(&b[src..src + dh]),
                    Buf::U16(b) => dst.extend(b[src..src + dh].iter().map(|&y| match self.dtype {
                        KvDtype::Bf16 => bf16::from_bits(y).to_f32(),
                        _ => f16::from_bits(y).to_f32(),
                    })),
                }
            }
        }
    }

    /// Positions `0..n` of a sequence's K and V in `layer`, contiguous `[n, Hkv, dh]`
    /// f32 (for attention implementations that want a plain matrix).
    pub fn gather(&self, layer: usize, table: &[BlockId], n: usize) -> (Vec<f32>, Vec<f32>) {
        let (bs, hkv, dh) = (self.block_size, self.num_kv_heads, self.head_dim);
        let (kb, vb) = &self.layers[layer];
        let mut out = (vec![0f32; n * hkv * dh], vec![0f32; n * hkv * dh]);
        for (buf, dst) in [(kb, &mut out.0), (vb, &mut out.1)] {
            for p in 0..n {
                let (blk, t) = (table[p / bs] as usize, p % bs);
                for g in 0..hkv {
                    let src = ((blk * hkv + g) * bs + t) * dh;
                    let d = &mut dst[(p * hkv + g) * dh..][..dh];
                    match buf {
                        Buf::F32(b) => d.copy_from_slice(&b[src..src + dh]),
                        Buf::U16(b) => {
                            for (x, &y) in d.iter_mut().zip(&b[src..src + dh]) {
                                *x = match self.dtype {
                                    KvDtype::Bf16 => bf16::from_bits(y).to_f32(),
                                    _ => f16::from_bits(y).to_f32(),
                                };
                            }
                        }
                    }
                }
            }
        }
        out
    }

    /// Copy KV head `g`'s K and V of `src` slot into `dst` slot in `layer` (per-head
    /// eviction: the new token takes the evicted token's slot).
    pub fn copy_head(&mut self, layer: usize, g: usize, src: usize, dst: usize) {
        let (bs, hkv, dh) = (self.block_size, self.num_kv_heads, self.head_dim);
        let at = |slot: usize| ((slot / bs * hkv + g) * bs + slot % bs) * dh;
        let (a, b) = (at(src), at(dst));
        let (kb, vb) = &mut self.layers[layer];
        for buf in [kb, vb] {
            match buf {
                Buf::F32(x) => x.copy_within(a..a + dh, b),
                Buf::U16(x) => x.copy_within(a..a + dh, b),
            }
        }
    }

    /// f32 storage of `layer`'s K and V (`None` for 16-bit pools).
    pub fn f32_views(&self, layer: usize) -> Option<(&[f32], &[f32])> {
        match &self.layers[layer] {
            (Buf::F32(k), Buf::F32(v)) => Some((k, v)),
            _ => None,
        }
    }

    /// Typed views of `layer`'s K and V.
    pub fn views(&self, layer: usize) -> (KvView<'_>, KvView<'_>) {
        let (k, v) = &self.layers[layer];
        (self.view(k), self.view(v))
    }

    fn view<'a>(&self, b: &'a Buf) -> KvView<'a> {
        match (b, self.dtype) {
            (Buf::F32(x), _) => KvView::F32(x),
            (Buf::U16(x), KvDtype::Bf16) => KvView::Bf16(bytemuck::cast_slice(x)),
            (Buf::U16(x), _) => KvView::F16(bytemuck::cast_slice(x)),
        }
    }
}
