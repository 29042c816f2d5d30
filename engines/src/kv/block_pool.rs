//! Free-block pool with reference counts (vLLM's block manager, without prefix caching).

/// Index of a block in the paged KV pool; the same slot range in every layer.
pub type BlockId = u32;

#[derive(Debug, Clone)]
pub struct BlockPool {
    ref_counts: Vec<u32>,
    /// Free blocks; allocation pops from the end.
    free: Vec<BlockId>,
    /// Most blocks the pool may hold: its size when allocated up front, the ceiling
    /// it grows to when allocated on demand.
    limit: usize,
    /// Allocated on demand (its limit may then be moved).
    grows: bool,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        // Lowest ids first, so a fresh pool hands out 0, 1, 2, ...
        let free = (0..num_blocks as BlockId).rev().collect();
        Self {
            ref_counts: vec![0; num_blocks],
            free,
            limit: num_blocks,
            grows: false,
        }
    }

    /// An empty pool that grows on demand, one block at a time as allocations need
    /// them, up to `limit` blocks, and keeps what it grew to (the storage behind it is
    /// allocated as it grows and not given back).
    pub fn on_demand(limit: usize) -> Self {
        Self {
            ref_counts: Vec::new(),
            free: Vec::new(),
            limit,
            grows: true,
        }
    }

    /// Move an on-demand pool's ceiling to `limit` blocks (never below what it holds:
    /// a pool does not give storage back). `false` for a pool allocated up front.
    pub fn set_limit(&mut self, limit: usize) -> bool {
        if self.grows {
            self.limit = limit.max(self.num_blocks());
        }
        self.grows
    }

    /// Most blocks the pool may hold (its size when allocated up front).
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Reorder the free list with a seeded shuffle: tests use it to get random block
    /// tables, so no code path may assume blocks are contiguous.
    pub fn shuffle_free(&mut self, seed: u64) {
        use rand::seq::SliceRandom;
        use rand::SeedableRng;
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        self.free.shuffle(&mut rng);
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.num_free()
    }

    /// Take `n` blocks, all or nothing; an on-demand pool first grows by what its free
    /// blocks lack, within its limit.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.free.len() {
            let extra = n - self.free.len();
            if self.num_blocks() + extra > self.limit {
                return None;
            }
            // New ids go under the free list: they are handed out after the free ones.
            let start = self.ref_counts.len();
            self.ref_counts.resize(start + extra, 0);
            self.free
                .splice(0..0, (start as BlockId..(start + extra) as BlockId).rev());
        }
        let out = self.free.split_off(self.free.len() - n);
        for &b in &out {
            debug_assert_eq!(self.ref_counts[b as usize], 0);
            self.ref_counts[b as usize] = 1;
        }
        // Keep the pop order (last pushed first) so allocation order is predictable.
        Some(out.into_iter().rev().collect())
    }

    /// An on-demand pool grows to hold at least `blocks` blocks (within its limit)
    /// without handing them out; a pool allocated up front already holds its limit.
    pub fn grow_to(&mut self, blocks: usize) {
        let target = blocks.min(self.limit);
        if target > self.num_blocks() {
            let start = self.ref_counts.len();
            let extra = target - start;
            self.ref_counts.resize(target, 0);
            // As `allocate`: new ids under the free list.
            self.free
                .splice(0..0, (start as BlockId..(start + extra) as BlockId).rev());
        }
    }

    /// Grow a block table to `blocks` blocks, all or nothing (`false`: the pool is
    /// short). A table already that long is left as it is.
    pub fn grow(&mut self, table: &mut Vec<BlockId>, blocks: usize) -> bool {
        if blocks <= table.len() {
            return true;
        }
        match self.allocate(blocks - table.len()) {
            Some(b) => {
                table.extend(b);
                true
            }
            None => false,
        }
    }

    /// Release every block of a table.
    pub fn release_all(&mut self, table: impl IntoIterator<Item = BlockId>) {
        for b in table {
            self.release(b);
        }
    }

    /// Share a block (copy-on-write fork).
    pub fn retain(&mut self, b: BlockId) {
        self.ref_counts[b as usize] += 1;
    }

    /// Drop one reference; the block returns to the pool at zero.
    pub fn release(&mut self, b: BlockId) {
        let rc = &mut self.ref_counts[b as usize];
        assert!(*rc > 0, "block {b} released more often than allocated");
        *rc -= 1;
        if *rc == 0 {
            self.free.push(b);
        }
    }

    pub fn ref_count(&self, b: BlockId) -> u32 {
        self.ref_counts[b as usize]
    }

    /// Check `free + used = pool` and that every ref count equals the number of
    /// tables holding the block. Returns a description of the first violation.
    pub fn check_invariants<'a>(
        &self,
        tables: impl IntoIterator<Item = &'a [BlockId]>,
    ) -> Result<(), String> {
        let mut holders = vec![0u32; self.num_blocks()];
        for t in tables {
            for &b in t {
                holders[b as usize] += 1;
            }
        }
        let mut is_free = vec![false; self.num_blocks()];
        for &b in &self.free {
            if is_free[b as usize] {
                return Err(format!("block {b} is twice in the free list"));
            }
            is_free[b as usize] = true;
        }
        let used = holders.iter().filter(|&&h| h > 0).count();
        if used + self.free.len() != self.num_blocks() {
            return Err(format!(
                "free {} + used {used} != pool {}",
                self.free.len(),
                self.num_blocks()
            ));
        }
        for (b, (&h, &rc)) in holders.iter().zip(&self.ref_counts).enumerate() {
            if h != rc {
                return Err(format!("block {b}: ref count {rc}, held by {h} tables"));
            }
            if (h == 0) != is_free[b] {
                return Err(format!(
                    "block {b}: held by {h} tables, free = {}",
                    is_free[b]
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ceiling_moves_only_on_demand_and_never_below_what_is_held() {
        let mut p = BlockPool::on_demand(8);
        p.allocate(3).unwrap();
        assert!(p.set_limit(1));
        assert_eq!(p.limit(), 3, "never below the blocks grown");
        assert!(p.allocate(1).is_none());
        assert!(p.set_limit(5));
        assert!(p.allocate(2).is_some());
        let mut fixed = BlockPool::new(4);
        assert!(!fixed.set_limit(9));
        assert_eq!(fixed.limit(), 4);
    }

    #[test]
    fn an_on_demand_pool_grows_by_what_is_missing_up_to_its_limit_and_keeps_it() {
        let mut p = BlockPool::on_demand(5);
        assert_eq!((p.num_blocks(), p.limit()), (0, 5));
        let a = p.allocate(2).unwrap();
        assert_eq!((p.num_blocks(), p.num_used()), (2, 2));
        p.release_all(a);
        // Two free blocks are reused, one more is grown.
        let b = p.allocate(3).unwrap();
        assert_eq!((p.num_blocks(), p.num_used()), (3, 3));
        assert!(p.allocate(3).is_none(), "past the limit: all or nothing");
        assert_eq!(p.num_blocks(), 3, "a failed allocation grows nothing");
        let c = p.allocate(2).unwrap();
        assert_eq!((p.num_blocks(), p.num_free()), (5, 0));
        p.check_invariants([b.as_slice(), c.as_slice()]).unwrap();
        p.release_all(b);
        assert_eq!(p.num_blocks(), 5, "released blocks stay in the pool");
    }

    #[test]
    fn allocation_fails_when_exhausted_and_takes_nothing() {
        let mut p = BlockPool::new(4);
        let a = p.allocate(3).unwrap();
        assert_eq!(a, vec![0, 1, 2]);
        assert!(p.allocate(2).is_none());
        assert_eq!(p.num_free(), 1);
        p.check_invariants([a.as_slice()]).unwrap();
    }

    #[test]
    fn shared_blocks_return_only_when_last_holder_releases() {
        let mut p = BlockPool::new(2);
        let a = p.allocate(1).unwrap();
        p.retain(a[0]);
        let b = a.clone();
        p.check_invariants([a.as_slice(), b.as_slice()]).unwrap();
        p.release(a[0]);
        assert_eq!(p.num_free(), 1);
        p.release(b[0]);
        assert_eq!(p.num_free(), 2);
        p.check_invariants(std::iter::empty()).unwrap();
    }

    #[test]
    fn invariant_check_catches_a_leak() {
        let mut p = BlockPool::new(3);
        let _leaked = p.allocate(1).unwrap();
        assert!(p.check_invariants(std::iter::empty()).is_err());
    }
}
