//! Slot storage for policies that keep a subset of each sequence's tokens per KV head
//! (H2O, StreamingLLM, SnapKV). A sequence's block table (kept by the policy's
//! bookkeeping, [`crate::policy::evicting::book::SlotBook`]) addresses paged buffers as
//! in the full cache, but slot `s` of (layer, KV head) holds whichever position that
//! head kept there: a slot→position map and a score per slot travel with the data.
//! Every (layer, head) of a sequence holds the same number of slots, so one table
//! serves all.

use crate::kv::{BlockId, KvCodec, PagedKv};
use crate::policy::SeqId;
use std::collections::HashMap;

/// Position and accumulated score of each slot, per `layer × Hkv + head`.
#[derive(Debug, Default)]
pub struct SlotMeta {
    pub pos: Vec<Vec<u32>>,
    /// f32, never summed across sequences.
    pub score: Vec<Vec<f32>>,
}

#[derive(Debug)]
pub struct SlotStore {
    pub kv: PagedKv,
    pub meta: HashMap<SeqId, SlotMeta>,
    num_layers: usize,
    num_kv_heads: usize,
}

impl SlotStore {
    pub fn new(
        num_layers: usize,
        block_size: usize,
        num_kv_heads: usize,
        head_dim: usize,
        dtype: KvCodec,
    ) -> Self {
        Self {
            kv: PagedKv::new(num_layers, 0, block_size, num_kv_heads, head_dim, dtype),
            meta: HashMap::new(),
            num_layers,
            num_kv_heads,
        }
    }

    /// Bytes of one token (slot) over all layers, K and V.
    pub fn slot_bytes(
        num_layers: usize,
        block_size: usize,
        num_kv_heads: usize,
        head_dim: usize,
        dtype: KvCodec,
    ) -> u64 {
        PagedKv::block_bytes(num_layers, block_size, num_kv_heads, head_dim, dtype)
            / block_size.max(1) as u64
    }

    pub fn block_size(&self) -> usize {
        self.kv.block_size()
    }

    /// Hold the buffers of `num_blocks` blocks (the pool allocated, or grown to).
    pub fn ensure_blocks(&mut self, num_blocks: usize) {
        self.kv.ensure_blocks(num_blocks);
    }

    pub fn release(&mut self, seq: SeqId) {
        self.meta.remove(&seq);
    }

    /// Write `n` tokens' K and V (`[n, Hkv, dh]` rows) into slots `first..first + n`
    /// of `layer` for every head, recording positions `pos0..pos0 + n` with score 0.
    #[allow(clippy::too_many_arguments)]
    pub fn write(
        &mut self,
        seq: SeqId,
        table: &[BlockId],
        layer: usize,
        first: usize,
        pos0: u32,
        k: &[f32],
        v: &[f32],
    ) {
        let (layers, hkv) = (self.num_layers, self.num_kv_heads);
        let stride = self.kv.token_stride();
        let n = k.len() / stride.max(1);
        for i in 0..n {
            let phys = self.kv.slot(table, first + i);
            let rows = i * stride..(i + 1) * stride;
            self.kv.write(layer, phys, &k[rows.clone()], &v[rows]);
        }
        let e = self.meta.entry(seq).or_insert_with(|| SlotMeta {
            pos: vec![Vec::new(); layers * hkv],
            score: vec![Vec::new(); layers * hkv],
        });
        for g in 0..hkv {
            let (p, s) = (&mut e.pos[layer * hkv + g], &mut e.score[layer * hkv + g]);
            if p.len() < first + n {
                p.resize(first + n, 0);
                s.resize(first + n, 0.0);
            }
            for i in 0..n {
                p[first + i] = pos0 + i as u32;
            }
            s[first..first + n].fill(0.0);
        }
    }

    /// Keep only `keep` (ascending slots) of (layer, head), moved to slots `0..keep.len()`
    /// in that order. Moving forward never overwrites a slot still to be read.
    pub fn compact(
        &mut self,
        seq: SeqId,
        table: &[BlockId],
        layer: usize,
        g: usize,
        keep: &[usize],
    ) {
        let hkv = self.num_kv_heads;
        let Some(e) = self.meta.get_mut(&seq) else {
            return;
        };
        let i = layer * hkv + g;
        for (dst, &src) in keep.iter().enumerate() {
            debug_assert!(src >= dst);
            if src != dst {
                let (a, b) = (self.kv.slot(table, src), self.kv.slot(table, dst));
                self.kv.copy_head(layer, g, a, b);
                e.pos[i][dst] = e.pos[i][src];
                e.score[i][dst] = e.score[i][src];
            }
        }
        e.pos[i].truncate(keep.len());
        e.score[i].truncate(keep.len());
    }

    /// Move (layer, head)'s slot `src` into `dst` (the evicted one) and drop `src`,
    /// which must be the last slot.
    #[allow(clippy::too_many_arguments)]
    pub fn replace(
        &mut self,
        seq: SeqId,
        table: &[BlockId],
        layer: usize,
        g: usize,
        dst: usize,
        src: usize,
    ) {
        let hkv = self.num_kv_heads;
        let Some(e) = self.meta.get_mut(&seq) else {
            return;
        };
        let i = layer * hkv + g;
        debug_assert_eq!(src + 1, e.pos[i].len());
        if dst != src {
            let (a, b) = (self.kv.slot(table, src), self.kv.slot(table, dst));
            self.kv.copy_head(layer, g, a, b);
            e.pos[i][dst] = e.pos[i][src];
            e.score[i][dst] = e.score[i][src];
        }
        e.pos[i].truncate(src);
        e.score[i].truncate(src);
    }

    /// No position held twice in any (layer, head).
    pub fn check_invariants(&self) -> Result<(), String> {
        for (id, s) in &self.meta {
            for p in &s.pos {
                let mut sorted = p.clone();
                sorted.sort_unstable();
                sorted.dedup();
                if sorted.len() != p.len() {
                    return Err(format!("sequence {id}: a position is held twice"));
                }
            }
        }
        Ok(())
    }
}
