//! The host tier of offloading policies (InfiniGen): every token's K/V of the
//! offloaded layers lives here, and each decode step gathers the selected tokens into
//! a device staging buffer. On CPU the tier is a separate capacity-tracked paged pool
//! and a "transfer" is the gather copy; on CUDA it is pinned host memory with
//! asynchronous copies (same trait).

use crate::kv::{BlockId, BlockPool, KvDtype, PagedKv};
use crate::policy::SeqId;
use std::collections::HashMap;

pub trait HostTier: Send {
    /// Make `seq` hold `tokens` positions; `false` when the tier is full.
    fn reserve(&mut self, seq: SeqId, tokens: usize) -> bool;
    /// Whether one sequence of `tokens` positions could ever fit.
    fn fits(&self, tokens: usize) -> bool;
    fn release(&mut self, seq: SeqId);
    /// Store one token's K and V (`[Hkv, dh]`) of `layer` at `position`.
    fn write(&mut self, seq: SeqId, layer: usize, position: usize, k: &[f32], v: &[f32]);
    /// Gather, per KV head `g`, positions `sel[g]` of `layer` into rows `0..sel[g].len()`
    /// of `k_out`/`v_out` (`[Hkv, cap, dh]`). Returns the bytes moved.
    #[allow(clippy::too_many_arguments)]
    fn gather(
        &self,
        seq: SeqId,
        layer: usize,
        sel: &[Vec<u32>],
        cap: usize,
        k_out: &mut [f32],
        v_out: &mut [f32],
    ) -> u64;
    /// Positions `0..n` of `layer`, contiguous `[n, Hkv, dh]` (prefill attention).
    fn read_prefix(&self, seq: SeqId, layer: usize, n: usize) -> (Vec<f32>, Vec<f32>);
    /// Bytes held for live tokens.
    fn used_bytes(&self) -> u64;
    /// Bytes held for one sequence.
    fn seq_bytes(&self, seq: SeqId) -> u64;
    /// Bytes of one token (all stored layers, K and V).
    fn token_bytes(&self) -> u64;
    fn check_invariants(&self) -> Result<(), String>;
}

/// Host tier in this process's memory: a paged f32 pool over the offloaded layers.
pub struct CpuHostTier {
    kv: PagedKv,
    pool: BlockPool,
    tables: HashMap<SeqId, Vec<BlockId>>,
    /// Model layer of the tier's layer 0.
    first_layer: usize,
    num_kv_heads: usize,
    head_dim: usize,
}

impl CpuHostTier {
    /// Layers `first_layer..first_layer + num_layers`, capacity `num_blocks` blocks.
    pub fn new(
        first_layer: usize,
        num_layers: usize,
        num_blocks: usize,
        block_size: usize,
        num_kv_heads: usize,
        head_dim: usize,
    ) -> Self {
        Self {
            kv: PagedKv::new(
                num_layers,
                num_blocks,
                block_size,
                num_kv_heads,
                head_dim,
                KvDtype::F32,
            ),
            pool: BlockPool::new(num_blocks),
            tables: HashMap::new(),
            first_layer,
            num_kv_heads,
            head_dim,
        }
    }

    /// Bytes of one block over the stored layers.
    pub fn block_bytes(
        num_layers: usize,
        block_size: usize,
        num_kv_heads: usize,
        head_dim: usize,
    ) -> u64 {
        PagedKv::block_bytes(num_layers, block_size, num_kv_heads, head_dim, KvDtype::F32)
    }
}

impl HostTier for CpuHostTier {
    fn reserve(&mut self, seq: SeqId, tokens: usize) -> bool {
        let bs = self.kv.block_size();
        let t = self.tables.entry(seq).or_default();
        self.pool.grow(t, tokens.div_ceil(bs))
    }

    fn fits(&self, tokens: usize) -> bool {
        tokens.div_ceil(self.kv.block_size()) <= self.pool.num_blocks()
    }

    fn release(&mut self, seq: SeqId) {
        if let Some(t) = self.tables.remove(&seq) {
            self.pool.release_all(t);
        }
    }

    fn write(&mut self, seq: SeqId, layer: usize, position: usize, k: &[f32], v: &[f32]) {
        let table = &self.tables[&seq];
        let slot = self.kv.slot(table, position);
        self.kv.write(layer - self.first_layer, slot, k, v);
    }

    fn gather(
        &self,
        seq: SeqId,
        layer: usize,
        sel: &[Vec<u32>],
        cap: usize,
        k_out: &mut [f32],
        v_out: &mut [f32],
    ) -> u64 {
        let (hkv, dh, bs) = (self.num_kv_heads, self.head_dim, self.kv.block_size());
        let table = &self.tables[&seq];
        let (k, v) = self
            .kv
            .f32_views(layer - self.first_layer)
            .expect("the CPU host tier stores f32");
        let mut rows = 0;
        for (g, positions) in sel.iter().enumerate().take(hkv) {
            for (i, &p) in positions.iter().enumerate() {
                let p = p as usize;
                let src = ((table[p / bs] as usize * hkv + g) * bs + p % bs) * dh;
                let dst = (g * cap + i) * dh;
                k_out[dst..dst + dh].copy_from_slice(&k[src..src + dh]);
                v_out[dst..dst + dh].copy_from_slice(&v[src..src + dh]);
            }
            rows += positions.len();
        }
        (2 * rows * dh * 4) as u64
    }

    fn read_prefix(&self, seq: SeqId, layer: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
        self.kv
            .gather(layer - self.first_layer, &self.tables[&seq], n)
    }

    fn used_bytes(&self) -> u64 {
        self.pool.num_used() as u64 * (self.kv.bytes() / self.pool.num_blocks().max(1) as u64)
    }

    fn seq_bytes(&self, seq: SeqId) -> u64 {
        self.tables.get(&seq).map_or(0, |t| {
            t.len() as u64 * (self.kv.bytes() / self.pool.num_blocks().max(1) as u64)
        })
    }

    fn token_bytes(&self) -> u64 {
        self.kv.bytes() / (self.pool.num_blocks().max(1) * self.kv.block_size()) as u64
    }

    fn check_invariants(&self) -> Result<(), String> {
        self.pool
            .check_invariants(self.tables.values().map(|t| t.as_slice()))
    }
}
