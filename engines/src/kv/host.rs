//! The host tier of offloading policies (InfiniGen): every token's K/V of the
//! offloaded layers lives here, and each decode step gathers the selected tokens into
//! a device staging buffer. On CPU the tier is a separate capacity-tracked paged pool
//! and a "transfer" is the gather copy; on CUDA it is pinned host memory with
//! asynchronous copies (same trait).

use crate::kv::{BlockId, BlockPool, KvCodec, PagedKv};
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
                KvCodec::F32,
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
        PagedKv::block_bytes(num_layers, block_size, num_kv_heads, head_dim, KvCodec::F32)
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
        let (k, v) = self.kv.views(layer - self.first_layer);
        let (Some(k), Some(v)) = (k.as_f32(), v.as_f32()) else {
            unreachable!("the CPU host tier is built with f32 rows")
        };
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

/// Layout of the pinned host tier of InfiniGen on CUDA: blocks of
/// `[layers][K, V][block_size][KVH][D]`, `per_chunk` blocks per allocation (the
/// `ig_*` kernels address it the same way).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierLayout {
    pub layers: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub per_chunk: usize,
}

impl TierLayout {
    pub fn block_elems(&self) -> usize {
        self.layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
    }

    /// Chunk and element offset in it of (`slot`, `layer`, K = 0 / V = 1, KV head `g`).
    pub fn locate(&self, slot: usize, layer: usize, kv: usize, g: usize) -> (usize, usize) {
        let (b, o) = (slot / self.block_size, slot % self.block_size);
        let row = self.num_kv_heads * self.head_dim;
        let at = (((b % self.per_chunk) * self.layers + layer) * 2 + kv) * self.block_size + o;
        (b / self.per_chunk, at * row + g * self.head_dim)
    }
}

/// One decode row's selection gathered on the host (InfiniGen's original transfer: a
/// host gather into pinned staging, then one copy): for KV head `g`, positions
/// `sel[g·kcap..][..k]` of the sequence with host block `table` are read from
/// `chunks` (the tier, laid out as `layout`) at `layer` into `out_k`/`out_v` rows
/// `[j][g][D]`, `j < k`.
#[allow(clippy::too_many_arguments)]
pub fn gather_selected<T: Copy>(
    layout: &TierLayout,
    chunks: &[&[T]],
    layer: usize,
    table: &[i32],
    sel: &[i32],
    kcap: usize,
    k: usize,
    out_k: &mut [T],
    out_v: &mut [T],
) {
    let (kvh, d, bs) = (layout.num_kv_heads, layout.head_dim, layout.block_size);
    for g in 0..kvh {
        for (j, &p) in sel[g * kcap..g * kcap + k].iter().enumerate() {
            let p = p as usize;
            let slot = table[p / bs] as usize * bs + p % bs;
            let dst = (j * kvh + g) * d;
            let (c, at) = layout.locate(slot, layer, 0, g);
            out_k[dst..dst + d].copy_from_slice(&chunks[c][at..at + d]);
            let (c, at) = layout.locate(slot, layer, 1, g);
            out_v[dst..dst + d].copy_from_slice(&chunks[c][at..at + d]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every element of the tier names itself: (block, layer, kv, offset, head, dim).
    fn tier(layout: &TierLayout, blocks: usize) -> Vec<Vec<u64>> {
        let (kvh, d, bs) = (layout.num_kv_heads, layout.head_dim, layout.block_size);
        let mut chunks = vec![
            vec![0u64; layout.per_chunk * layout.block_elems()];
            blocks.div_ceil(layout.per_chunk)
        ];
        for b in 0..blocks {
            for l in 0..layout.layers {
                for kv in 0..2 {
                    for o in 0..bs {
                        for g in 0..kvh {
                            let (c, at) = layout.locate(b * bs + o, l, kv, g);
                            for x in 0..d {
                                chunks[c][at + x] = (((((b * 10 + l) * 2 + kv) * 100 + o) * 10 + g)
                                    * 1000
                                    + x) as u64;
                            }
                        }
                    }
                }
            }
        }
        chunks
    }

    #[test]
    fn the_host_gather_reads_each_heads_positions_of_one_layer() {
        let layout = TierLayout {
            layers: 3,
            block_size: 4,
            num_kv_heads: 2,
            head_dim: 3,
            per_chunk: 2,
        };
        let chunks = tier(&layout, 5);
        let views: Vec<&[u64]> = chunks.iter().map(Vec::as_slice).collect();
        // Positions 0..12 in blocks 4, 0, 3 (over three chunks).
        let table = [4, 0, 3];
        let kcap = 5;
        let sel = [1, 4, 9, 11, -1, 0, 2, 3, 8, -1];
        let k = 4;
        let (kvh, d) = (2, 3);
        let mut out_k = vec![0u64; kcap * kvh * d];
        let mut out_v = vec![0u64; kcap * kvh * d];
        gather_selected(
            &layout, &views, 2, &table, &sel, kcap, k, &mut out_k, &mut out_v,
        );
        for g in 0..kvh {
            for j in 0..k {
                let p = sel[g * kcap + j] as usize;
                let (b, o) = (table[p / 4] as usize, p % 4);
                for x in 0..d {
                    let want = |kv: usize| {
                        (((((b * 10 + 2) * 2 + kv) * 100 + o) * 10 + g) * 1000 + x) as u64
                    };
                    assert_eq!(out_k[(j * kvh + g) * d + x], want(0), "K g{g} j{j} x{x}");
                    assert_eq!(out_v[(j * kvh + g) * d + x], want(1), "V g{g} j{j} x{x}");
                }
            }
        }
        // Rows past the count are left alone.
        assert!(out_k[k * kvh * d..].iter().all(|&x| x == 0));
    }
}
