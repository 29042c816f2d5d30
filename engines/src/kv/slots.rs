//! Slot storage for policies that keep a subset of each sequence's tokens per KV head
//! (H2O, StreamingLLM). A sequence owns a block table of paged f32 buffers, as in the
//! full cache, but slot `s` of (layer, KV head) holds whichever position that head
//! kept there: a slot→position map and a score per slot travel with the data. Every
//! (layer, head) of a sequence holds the same number of slots, so one table serves all.

use crate::kv::{BlockId, BlockPool, KvDtype, PagedKv};
use crate::policy::SeqId;
use std::collections::HashMap;

#[derive(Debug, Default)]
pub struct SlotSeq {
    pub table: Vec<BlockId>,
    /// Slots holding kept tokens (the same in every layer and head).
    pub len: usize,
    /// Position held by each slot, per `layer × Hkv + head`.
    pub pos: Vec<Vec<u32>>,
    /// Accumulated score per slot (f32, never summed across sequences), same indexing.
    pub score: Vec<Vec<f32>>,
}

#[derive(Debug)]
pub struct SlotStore {
    pub kv: PagedKv,
    pool: BlockPool,
    pub seqs: HashMap<SeqId, SlotSeq>,
    num_layers: usize,
    num_kv_heads: usize,
}

impl SlotStore {
    pub fn new(
        num_layers: usize,
        num_blocks: usize,
        block_size: usize,
        num_kv_heads: usize,
        head_dim: usize,
    ) -> Self {
        Self::with_pool(
            BlockPool::new(num_blocks),
            num_layers,
            block_size,
            num_kv_heads,
            head_dim,
        )
    }

    /// A store whose pool grows on demand, up to `limit` blocks.
    pub fn on_demand(
        num_layers: usize,
        limit: usize,
        block_size: usize,
        num_kv_heads: usize,
        head_dim: usize,
    ) -> Self {
        Self::with_pool(
            BlockPool::on_demand(limit),
            num_layers,
            block_size,
            num_kv_heads,
            head_dim,
        )
    }

    fn with_pool(
        pool: BlockPool,
        num_layers: usize,
        block_size: usize,
        num_kv_heads: usize,
        head_dim: usize,
    ) -> Self {
        Self {
            kv: PagedKv::new(
                num_layers,
                pool.num_blocks(),
                block_size,
                num_kv_heads,
                head_dim,
                KvDtype::F32,
            ),
            pool,
            seqs: HashMap::new(),
            num_layers,
            num_kv_heads,
        }
    }

    pub fn block_size(&self) -> usize {
        self.kv.block_size()
    }

    /// Blocks the pool holds (allocated up front, or grown to so far).
    pub fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    /// Most blocks the pool may hold.
    pub fn limit(&self) -> usize {
        self.pool.limit()
    }

    /// Move the ceiling of a pool grown on demand ([`BlockPool::set_limit`]).
    pub fn set_limit(&mut self, blocks: usize) -> bool {
        self.pool.set_limit(blocks)
    }

    pub fn num_used_blocks(&self) -> usize {
        self.pool.num_used()
    }

    /// Bytes of one block over all layers.
    pub fn block_bytes(&self) -> u64 {
        self.kv.bytes_per_block()
    }

    /// Bytes of one token (slot) over all layers, K and V.
    pub fn slot_bytes(&self) -> u64 {
        (2 * self.num_layers * self.kv.token_stride() * self.kv.dtype().size()) as u64
    }

    /// Grow a pool reserved on demand to `blocks` blocks ahead of need (see
    /// [`BlockPool::grow_to`]).
    pub fn grow_to(&mut self, blocks: usize) {
        self.pool.grow_to(blocks);
        self.kv.ensure_blocks(self.pool.num_blocks());
    }

    /// Make `seq` own at least `slots` slots; all or nothing.
    pub fn reserve(&mut self, seq: SeqId, slots: usize) -> bool {
        let (layers, hkv) = (self.num_layers, self.num_kv_heads);
        let bs = self.kv.block_size();
        let e = self.seqs.entry(seq).or_insert_with(|| SlotSeq {
            pos: vec![Vec::new(); layers * hkv],
            score: vec![Vec::new(); layers * hkv],
            ..Default::default()
        });
        let ok = self.pool.grow(&mut e.table, slots.div_ceil(bs));
        self.kv.ensure_blocks(self.pool.num_blocks());
        ok
    }

    /// Return blocks past what `slots` slots need.
    pub fn shrink(&mut self, seq: SeqId, slots: usize) {
        let bs = self.kv.block_size();
        if let Some(e) = self.seqs.get_mut(&seq) {
            while e.table.len() > slots.div_ceil(bs) {
                if let Some(b) = e.table.pop() {
                    self.pool.release(b);
                }
            }
        }
    }

    pub fn release(&mut self, seq: SeqId) {
        if let Some(e) = self.seqs.remove(&seq) {
            self.pool.release_all(e.table);
        }
    }

    /// Write one token's K and V (`[Hkv, dh]`) into `slot` of `layer` for every head,
    /// recording `position` with score 0.
    pub fn write(
        &mut self,
        seq: SeqId,
        layer: usize,
        slot: usize,
        position: u32,
        k: &[f32],
        v: &[f32],
    ) {
        let hkv = self.num_kv_heads;
        let e = self.seqs.get_mut(&seq).expect("reserved before writing");
        let phys = self.kv.slot(&e.table, slot);
        self.kv.write(layer, phys, k, v);
        for g in 0..hkv {
            let (p, s) = (&mut e.pos[layer * hkv + g], &mut e.score[layer * hkv + g]);
            if p.len() <= slot {
                p.resize(slot + 1, 0);
                s.resize(slot + 1, 0.0);
            }
            p[slot] = position;
            s[slot] = 0.0;
        }
    }

    /// Keep only `keep` (ascending slots) of (layer, head), moved to slots `0..keep.len()`
    /// in that order. Moving forward never overwrites a slot still to be read.
    pub fn compact(&mut self, seq: SeqId, layer: usize, g: usize, keep: &[usize]) {
        let hkv = self.num_kv_heads;
        let e = self.seqs.get_mut(&seq).expect("known sequence");
        let i = layer * hkv + g;
        for (dst, &src) in keep.iter().enumerate() {
            debug_assert!(src >= dst);
            if src != dst {
                let (a, b) = (self.kv.slot(&e.table, src), self.kv.slot(&e.table, dst));
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
    pub fn replace(&mut self, seq: SeqId, layer: usize, g: usize, dst: usize, src: usize) {
        let hkv = self.num_kv_heads;
        let e = self.seqs.get_mut(&seq).expect("known sequence");
        let i = layer * hkv + g;
        debug_assert_eq!(src + 1, e.pos[i].len());
        if dst != src {
            let (a, b) = (self.kv.slot(&e.table, src), self.kv.slot(&e.table, dst));
            self.kv.copy_head(layer, g, a, b);
            e.pos[i][dst] = e.pos[i][src];
            e.score[i][dst] = e.score[i][src];
        }
        e.pos[i].truncate(src);
        e.score[i].truncate(src);
    }

    pub fn check_invariants(&self) -> Result<(), String> {
        self.pool
            .check_invariants(self.seqs.values().map(|s| s.table.as_slice()))?;
        let bs = self.kv.block_size();
        for (id, s) in &self.seqs {
            if s.len > s.table.len() * bs {
                return Err(format!(
                    "sequence {id}: {} slots in {} blocks",
                    s.len,
                    s.table.len()
                ));
            }
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
