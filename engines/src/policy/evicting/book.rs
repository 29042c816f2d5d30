//! The evicting paradigm's capacity bookkeeping, written once for its CPU storage
//! ([`crate::kv::slots::SlotStore`]) and its CUDA storage (`cuda.rs`): what each
//! sequence is ([`SeqState`]), its block table and kept slots, the pool they come from,
//! and the bytes they stand for. The storages hold only the bytes (and per-slot
//! positions and scores), addressed through [`SlotBook::table`].

use super::{peak_blocks, Eviction, SeqState};
use crate::kv::{BlockId, SeqTables};
use crate::policy::spec::PolicyEnv;
use crate::policy::{PolicyMemory, SeqId, SeqInfo};
use std::collections::HashMap;

#[derive(Debug)]
pub(crate) struct SlotBook {
    tables: SeqTables,
    seqs: HashMap<SeqId, SeqState>,
    /// Bytes of one slot over all layers: K/V and whatever the storage keeps per slot.
    slot_bytes: u64,
}

impl SlotBook {
    /// The pool of `env` (its reservation, its KV bytes) in slots of `slot_bytes`.
    pub(crate) fn new(env: &PolicyEnv, slot_bytes: u64) -> Self {
        let block = slot_bytes * env.block_size as u64;
        Self {
            tables: SeqTables::with_reservation(
                env.reservation,
                env.kv_blocks(block),
                env.block_size,
                env.shuffle_seed,
            ),
            seqs: HashMap::new(),
            slot_bytes,
        }
    }

    pub(crate) fn block_size(&self) -> usize {
        self.tables.block_size()
    }

    pub(crate) fn block_bytes(&self) -> u64 {
        self.slot_bytes * self.block_size() as u64
    }

    /// Blocks the pool holds (allocated up front, or grown to so far).
    pub(crate) fn num_blocks(&self) -> usize {
        self.tables.num_blocks()
    }

    pub(crate) fn admit<E: Eviction>(&mut self, rule: &E, seq: SeqId, info: SeqInfo) {
        self.seqs.insert(seq, SeqState::admitted(rule, info));
    }

    /// A pool reserved on demand grows to the `held` sequences' peak ahead of the
    /// timed steps; returns the blocks it holds.
    pub(crate) fn prepare<E: Eviction>(&mut self, rule: &E, held: &[SeqInfo]) -> usize {
        self.tables
            .grow_to(peak_blocks(rule, held, self.block_size()));
        self.tables.num_blocks()
    }

    /// Room for `seq` to hold `total_tokens` after this step, all or nothing: the
    /// prefill's positions, then one new slot per new token (eviction returns one).
    pub(crate) fn reserve(&mut self, seq: SeqId, total_tokens: usize) -> bool {
        let st = *self
            .seqs
            .entry(seq)
            .or_insert_with(|| SeqState::unannounced(total_tokens));
        let len = self.tables.len(seq);
        self.tables.reserve(seq, st.slots_for(len, total_tokens))
    }

    /// Whether a sequence of `total_tokens` could ever fit in the pool.
    pub(crate) fn fits(&self, total_tokens: usize) -> bool {
        self.tables.fits(total_tokens)
    }

    /// Move the ceiling of a pool grown on demand to `bytes`.
    pub(crate) fn set_device_ceiling(&mut self, bytes: u64) -> bool {
        self.tables
            .set_limit((bytes / self.block_bytes().max(1)) as usize)
    }

    pub(crate) fn release(&mut self, seq: SeqId) {
        self.tables.release(seq);
        self.seqs.remove(&seq);
    }

    /// Whether `seq` holds a block table (reserved and not released).
    #[cfg(feature = "cuda")]
    pub(crate) fn holds(&self, seq: SeqId) -> bool {
        self.tables.contains(seq)
    }

    pub(crate) fn state(&self, seq: SeqId) -> SeqState {
        self.seqs[&seq]
    }

    pub(crate) fn prefilled(&self, seq: SeqId) -> bool {
        self.seqs[&seq].prefilled()
    }

    /// The block table of `seq` (empty when it holds nothing).
    pub(crate) fn table(&self, seq: SeqId) -> &[BlockId] {
        self.tables.table(seq)
    }

    /// Slots holding kept tokens (the same in every layer and head).
    pub(crate) fn len(&self, seq: SeqId) -> usize {
        self.tables.len(seq)
    }

    /// Pool slot of slot `i` of `seq`.
    #[cfg(feature = "cuda")]
    pub(crate) fn phys(&self, seq: SeqId, i: usize) -> usize {
        self.tables.slot(seq, i)
    }

    /// The first slot this step's new tokens of `seq` go to: after the kept ones, or
    /// at their positions while the prompt is being prefilled.
    pub(crate) fn first_write_slot(&self, seq: SeqId, ctx_before: usize) -> usize {
        if self.prefilled(seq) {
            self.len(seq)
        } else {
            ctx_before
        }
    }

    /// After a step's last layer: `seq` computed `computed` tokens; it keeps what the
    /// rule's capacity allows (eviction ran in every layer) and returns the blocks past
    /// that, keeping one slot for the next token once it decodes.
    pub(crate) fn end_step<E: Eviction>(&mut self, rule: &E, seq: SeqId, computed: usize) {
        let Some(st) = self.seqs.get_mut(&seq) else {
            return;
        };
        let was_prefilled = st.prefilled();
        st.computed = computed;
        let st = *st;
        let held = if was_prefilled {
            self.tables.len(seq) + 1
        } else {
            computed
        };
        let len = match st.counts {
            Some(c) if st.prefilled() => held.min(rule.capacity_at(c, &st.info, computed)),
            _ => held,
        };
        self.tables.set_len(seq, len);
        let keep = if st.prefilled() { len + 1 } else { len };
        self.tables.shrink(seq, keep);
    }

    /// The pool's bytes: `allocated_blocks` as the storage holds them (on CUDA the
    /// buffers grow at the next step's first layer), the blocks sequences hold.
    pub(crate) fn memory(&self, allocated_blocks: usize) -> PolicyMemory {
        let block = self.block_bytes();
        PolicyMemory {
            device_reserved: block * self.tables.num_blocks().max(allocated_blocks) as u64,
            device_used: block * self.tables.num_used() as u64,
            host_reserved: 0,
            host_used: 0,
        }
    }

    /// Bytes of the tokens `seq` keeps.
    pub(crate) fn seq_device_bytes(&self, seq: SeqId) -> u64 {
        self.tables.len(seq) as u64 * self.slot_bytes
    }

    /// The pool's and the tables' invariants, then each sequence's kept count against
    /// its capacity and, where the storage can tell without a copy (`kept`: the
    /// positions of each (layer, head) of a sequence), its most recent positions kept.
    pub(crate) fn check_invariants<E: Eviction>(
        &self,
        rule: &E,
        kept: Option<&dyn Fn(SeqId) -> Vec<Vec<u32>>>,
    ) -> Result<(), String> {
        self.tables.check_invariants()?;
        for (&id, s) in &self.seqs {
            if !self.tables.contains(id) {
                continue;
            }
            let len = self.tables.len(id);
            if let (Some(c), true) = (s.counts, s.prefilled()) {
                let capacity = rule.capacity_at(c, &s.info, s.computed);
                if len > capacity {
                    return Err(format!(
                        "sequence {id}: {len} tokens kept, capacity {capacity}"
                    ));
                }
                // The most recent R positions are present in every (layer, head).
                let n = s.computed as u32;
                let r = c.recent.min(len) as u32;
                for p in kept.map(|f| f(id)).unwrap_or_default() {
                    let held = &p[..len.min(p.len())];
                    for q in n.saturating_sub(r)..n {
                        if !held.contains(&q) {
                            return Err(format!("sequence {id}: recent position {q} missing"));
                        }
                    }
                }
            }
        }
        Ok(())
    }
}
