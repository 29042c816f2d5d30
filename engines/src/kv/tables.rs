//! Block tables of the sequences of a paged pool: the bookkeeping each paradigm shares
//! between its CPU and CUDA storage (the K/V bytes live elsewhere). `full` counts
//! tokens in it, the evicting policies kept slots
//! ([`crate::policy::evicting::book::SlotBook`]).

use super::{BlockId, BlockPool};
use crate::policy::spec::Reservation;
use crate::policy::SeqId;
use std::collections::HashMap;

#[derive(Debug, Default)]
struct SeqBlocks {
    table: Vec<BlockId>,
    /// Tokens whose K/V are stored.
    len: usize,
}

#[derive(Debug)]
pub struct SeqTables {
    pool: BlockPool,
    block_size: usize,
    seqs: HashMap<SeqId, SeqBlocks>,
}

impl SeqTables {
    /// `shuffle_seed`: shuffle the free list (tests: random block tables).
    pub fn new(num_blocks: usize, block_size: usize, shuffle_seed: Option<u64>) -> Self {
        let mut pool = BlockPool::new(num_blocks);
        if let Some(seed) = shuffle_seed {
            pool.shuffle_free(seed);
        }
        Self {
            pool,
            block_size,
            seqs: HashMap::new(),
        }
    }

    /// Tables over a pool that grows on demand up to `limit` blocks.
    pub fn on_demand(limit: usize, block_size: usize) -> Self {
        Self {
            pool: BlockPool::on_demand(limit),
            block_size,
            seqs: HashMap::new(),
        }
    }

    /// Tables over a pool allocated up front (`fraction`) or grown on demand (`budget`)
    /// up to `num_blocks`; `shuffle_seed` shuffles the free list of a pool allocated
    /// up front.
    pub fn with_reservation(
        reservation: Reservation,
        num_blocks: usize,
        block_size: usize,
        shuffle_seed: Option<u64>,
    ) -> Self {
        match reservation {
            Reservation::Fraction => Self::new(num_blocks, block_size, shuffle_seed),
            Reservation::Budget => Self::on_demand(num_blocks, block_size),
        }
    }

    /// Grow a pool reserved on demand to `blocks` blocks ahead of need (see
    /// [`BlockPool::grow_to`]).
    pub fn grow_to(&mut self, blocks: usize) {
        self.pool.grow_to(blocks);
    }

    /// Most blocks the pool may hold.
    pub fn limit(&self) -> usize {
        self.pool.limit()
    }

    /// Move the ceiling of a pool grown on demand ([`BlockPool::set_limit`]).
    pub fn set_limit(&mut self, blocks: usize) -> bool {
        self.pool.set_limit(blocks)
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    pub fn num_free(&self) -> usize {
        self.pool.num_free()
    }

    pub fn num_used(&self) -> usize {
        self.pool.num_used()
    }

    /// Room for `total_tokens` of `seq`, all or nothing.
    pub fn reserve(&mut self, seq: SeqId, total_tokens: usize) -> bool {
        let entry = self.seqs.entry(seq).or_default();
        self.pool
            .grow(&mut entry.table, total_tokens.div_ceil(self.block_size))
    }

    /// Whether a sequence of `total_tokens` could ever fit in the pool.
    pub fn fits(&self, total_tokens: usize) -> bool {
        total_tokens.div_ceil(self.block_size) <= self.pool.limit()
    }

    pub fn release(&mut self, seq: SeqId) {
        if let Some(s) = self.seqs.remove(&seq) {
            self.pool.release_all(s.table);
        }
    }

    /// Return the blocks of `seq` past what `tokens` need.
    pub fn shrink(&mut self, seq: SeqId, tokens: usize) {
        if let Some(s) = self.seqs.get_mut(&seq) {
            while s.table.len() > tokens.div_ceil(self.block_size) {
                if let Some(b) = s.table.pop() {
                    self.pool.release(b);
                }
            }
        }
    }

    /// Whether `seq` holds a table (reserved and not released).
    pub fn contains(&self, seq: SeqId) -> bool {
        self.seqs.contains_key(&seq)
    }

    /// The block table of `seq` (empty when it holds nothing).
    pub fn table(&self, seq: SeqId) -> &[BlockId] {
        self.seqs.get(&seq).map_or(&[], |s| s.table.as_slice())
    }

    /// Pool slot of position `pos` of `seq`.
    pub fn slot(&self, seq: SeqId, pos: usize) -> usize {
        let t = self.table(seq);
        t[pos / self.block_size] as usize * self.block_size + pos % self.block_size
    }

    /// Tokens stored for `seq`.
    pub fn len(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.len)
    }

    pub fn set_len(&mut self, seq: SeqId, len: usize) {
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.len = len;
        }
    }

    pub fn check_invariants(&self) -> Result<(), String> {
        self.pool
            .check_invariants(self.seqs.values().map(|s| s.table.as_slice()))?;
        for (id, s) in &self.seqs {
            if s.len > s.table.len() * self.block_size {
                return Err(format!(
                    "sequence {id}: {} tokens in {} blocks",
                    s.len,
                    s.table.len()
                ));
            }
        }
        Ok(())
    }
}
