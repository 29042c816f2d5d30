//! Which captured decode step serves a step. A CUDA graph replays a decode step with its
//! kernels' grids and buffer addresses baked in, so one graph serves only steps of its
//! shape: the same number of rows and the same context bucket (the paged decode's
//! partition grid is sized for the bucket's longest context; shorter rows leave
//! partitions empty, which the kernels already handle). A shape is captured only when
//! two steps in a row ask for it: a capture costs about two steps, so shapes that change
//! every step (requests arriving and leaving) run as they are rather than capture each
//! time. Graphs of an earlier device state (a pool that grew, input buffers replaced:
//! the policy's epoch) are dropped, and the least recently used one goes when the cache
//! is full. Device-independent and tested on the CPU; capture and replay are
//! `cuda::graph`'s.

/// A graph serves contexts up to a multiple of this many tokens: a new graph every 512
/// decode steps of a batch, and at most 511 keys' worth of empty partitions per row.
pub const CTX_BUCKET: usize = 512;

use crate::error::{Error, Result};

/// Graphs kept at once (each holds its kernels' parameters and its input buffers).
pub const MAX_GRAPHS: usize = 8;

/// Whether the environment leaves CUDA graphs on: unless `KVBENCH_CUDA_GRAPH=off` (what
/// reports and checks say of a run; the engine itself reads the switch strictly,
/// rejecting other values: `cuda::graph::graphs_chosen`).
pub fn chosen() -> bool {
    chosen_by(std::env::var("KVBENCH_CUDA_GRAPH").ok().as_deref())
}

fn chosen_by(value: Option<&str>) -> bool {
    value.map(str::trim) != Some("off")
}

/// The bucket of a step whose longest context (its new token included) is `max_ctx`.
pub fn ctx_bucket(max_ctx: usize) -> usize {
    max_ctx.max(1).next_multiple_of(CTX_BUCKET)
}

/// The shape a graph was captured for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GraphKey {
    pub rows: usize,
    /// The longest context the step's decode grid is sized for ([`ctx_bucket`] of the
    /// keys a row attends: all of its context for `full`, its kept slots for H2O).
    pub ctx_bucket: usize,
    /// The policy's kind of step (H2O: whether it evicts, whether it accumulates
    /// probabilities): another set of kernels.
    pub variant: u8,
}

/// What a policy's decode step bakes into a graph (`KvPolicy::bind_graph_step`): the
/// device-state epoch, and the bucket and variant that key the graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphBinding {
    pub epoch: u64,
    pub ctx_bucket: usize,
    pub variant: u8,
}

/// How often decode steps ran from graphs: steps that captured one (each run once as
/// it was recorded) and steps replayed from one. Zero where no graphs run (the CPU, the
/// switch off).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphStats {
    pub captured: u64,
    pub replayed: u64,
}

/// Graphs by key, for one device-state epoch, least recently used evicted first.
pub struct GraphCache<G> {
    entries: Vec<(GraphKey, G, u64)>,
    epoch: Option<u64>,
    tick: u64,
    cap: usize,
    /// The shape of the last step no graph served.
    missed: Option<GraphKey>,
}

impl<G> GraphCache<G> {
    pub fn new(cap: usize) -> Self {
        Self {
            entries: Vec::new(),
            epoch: None,
            tick: 0,
            cap: cap.max(1),
            missed: None,
        }
    }

    /// Whether a step of shape `key`, which no graph serves, should capture one: when
    /// the last step that no graph served had the same shape (so the shape repeats).
    pub fn worth_capturing(&mut self, key: GraphKey) -> bool {
        let repeat = self.missed == Some(key);
        self.missed = (!repeat).then_some(key);
        repeat
    }

    /// Whether a step of shape `key` runs from a graph: one this cache holds, or one it
    /// is worth capturing now ([`Self::worth_capturing`]). Otherwise the step runs as
    /// usual, with nothing bound for a graph.
    pub fn runs_from_graph(&mut self, key: GraphKey) -> bool {
        self.entries.iter().any(|(k, _, _)| *k == key) || self.worth_capturing(key)
    }

    /// Enter the device state `epoch`: graphs of any other are dropped (what they
    /// baked in may no longer exist).
    pub fn set_epoch(&mut self, epoch: u64) {
        if self.epoch != Some(epoch) {
            self.entries.clear();
            self.epoch = Some(epoch);
        }
    }

    /// The graph for `key`, marked as just used.
    pub fn get(&mut self, key: GraphKey) -> Option<&mut G> {
        self.tick += 1;
        let tick = self.tick;
        self.entries
            .iter_mut()
            .find(|(k, _, _)| *k == key)
            .map(|(_, g, used)| {
                *used = tick;
                g
            })
    }

    /// Keep `g` for `key` (replacing one of the same key), evicting the least recently
    /// used graph when the cache is full.
    pub fn insert(&mut self, key: GraphKey, g: G) -> &mut G {
        self.tick += 1;
        self.entries.retain(|(k, _, _)| *k != key);
        if self.entries.len() >= self.cap {
            if let Some(oldest) = (0..self.entries.len()).min_by_key(|&i| self.entries[i].2) {
                self.entries.swap_remove(oldest);
            }
        }
        self.entries.push((key, g, self.tick));
        &mut self.entries.last_mut().expect("pushed above").1
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// `rows` block tables as one `[rows, width]` array, each cut to `width` blocks (zeros
/// past its end); an error when a row's context exceeds `max_ctx` or its blocks.
pub fn fixed_width_tables(
    tables: &[Vec<i32>],
    ctx: &[usize],
    rows: usize,
    width: usize,
    max_ctx: usize,
    block_size: usize,
) -> Result<Vec<i32>> {
    if tables.len() != rows || ctx.len() != rows {
        return Err(Error::Config(format!(
            "decode tables for {rows} rows given {} tables and {} context lengths",
            tables.len(),
            ctx.len()
        )));
    }
    let mut flat = vec![0i32; rows.max(1) * width];
    for (r, (t, &c)) in tables.iter().zip(ctx).enumerate() {
        let need = c.div_ceil(block_size.max(1));
        if c > max_ctx || need > width || need > t.len() {
            return Err(Error::Config(format!(
                "decode row {r}: context {c} needs {need} blocks of {block_size}; the \
                 table has {} and the fixed buffers {width} (contexts up to {max_ctx})",
                t.len()
            )));
        }
        let n = t.len().min(width);
        flat[r * width..r * width + n].copy_from_slice(&t[..n]);
    }
    Ok(flat)
}

/// Input buffer sets kept by a policy for its graph steps: past this many they are all
/// dropped together with the graphs that read them (a new epoch), so that they cannot
/// grow without bound.
pub const MAX_GRAPH_BUFFERS: usize = 64;

/// A policy's fixed buffers for graph steps, by key, and the epoch of the device state
/// its graphs bake in: the epoch changes whenever anything a graph reads moves (the
/// policy's K/V buffers, or these buffers when the set is dropped for room).
#[derive(Debug)]
pub struct GraphBuffers<K, V> {
    sets: std::collections::HashMap<K, V>,
    epoch: u64,
}

impl<K: std::hash::Hash + Eq, V> Default for GraphBuffers<K, V> {
    fn default() -> Self {
        Self {
            sets: std::collections::HashMap::new(),
            epoch: 0,
        }
    }
}

impl<K: std::hash::Hash + Eq, V> GraphBuffers<K, V> {
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Buffers graphs read moved (a pool grown): every graph is stale.
    pub fn moved(&mut self) {
        self.epoch += 1;
    }

    /// The set for `key`, made by `make` if there is none (all sets dropped first when
    /// [`MAX_GRAPH_BUFFERS`] are kept: a new epoch).
    pub fn get_or_make(&mut self, key: K, make: impl FnOnce() -> Result<V>) -> Result<&mut V> {
        use std::collections::hash_map::Entry;
        if !self.sets.contains_key(&key) && self.sets.len() >= MAX_GRAPH_BUFFERS {
            self.sets.clear();
            self.epoch += 1;
        }
        Ok(match self.sets.entry(key) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert(make()?),
        })
    }

    pub fn get(&self, key: &K) -> Option<&V> {
        self.sets.get(key)
    }

    /// Take the set out for a step (`put` gives it back; its device buffers stay put).
    pub fn take(&mut self, key: &K) -> Option<V> {
        self.sets.remove(key)
    }

    pub fn put(&mut self, key: K, v: V) {
        self.sets.insert(key, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(rows: usize, ctx: usize) -> GraphKey {
        GraphKey {
            rows,
            ctx_bucket: ctx_bucket(ctx),
            variant: 0,
        }
    }

    #[test]
    fn tables_are_cut_to_the_fixed_width_and_must_hold_their_context() {
        let t = vec![vec![4, 9, 2, 7], vec![1]];
        // Block size 16: contexts 40 (3 blocks) and 5 (1 block) in width 3.
        let flat = fixed_width_tables(&t, &[40, 5], 2, 3, 48, 16).unwrap();
        assert_eq!(flat, vec![4, 9, 2, 1, 0, 0]);
        // A context past the bucket, past the width, past the table; rows miscounted.
        assert!(fixed_width_tables(&t, &[49, 5], 2, 3, 48, 16).is_err());
        assert!(fixed_width_tables(&t, &[40, 5], 2, 2, 48, 16).is_err());
        assert!(fixed_width_tables(&t, &[40, 17], 2, 3, 48, 16).is_err());
        assert!(fixed_width_tables(&t, &[40], 2, 3, 48, 16).is_err());
    }

    #[test]
    fn buffer_sets_are_made_once_and_dropped_together_in_a_new_epoch() {
        let mut b: GraphBuffers<usize, usize> = GraphBuffers::default();
        let mut made = 0;
        for k in 0..MAX_GRAPH_BUFFERS {
            *b.get_or_make(k, || {
                made += 1;
                Ok(k)
            })
            .unwrap() += 1000;
        }
        assert_eq!((made, b.epoch()), (MAX_GRAPH_BUFFERS, 0));
        // An existing set is given back as it is, not made again.
        assert_eq!(*b.get_or_make(3, || Ok(0)).unwrap(), 1003);
        // One more key: every set goes, in a new epoch.
        assert_eq!(*b.get_or_make(MAX_GRAPH_BUFFERS, || Ok(7)).unwrap(), 7);
        assert_eq!(b.epoch(), 1);
        assert!(b.get(&3).is_none());
        let v = b.take(&MAX_GRAPH_BUFFERS).unwrap();
        assert!(b.get(&MAX_GRAPH_BUFFERS).is_none());
        b.put(MAX_GRAPH_BUFFERS, v);
        assert_eq!(b.get(&MAX_GRAPH_BUFFERS), Some(&7));
        b.moved();
        assert_eq!(b.epoch(), 2);
        assert!(b
            .get_or_make(9, || Err(Error::Config("no room".into())))
            .is_err());
    }

    #[test]
    fn buckets_round_up_to_whole_buckets() {
        assert_eq!(ctx_bucket(0), CTX_BUCKET);
        assert_eq!(ctx_bucket(1), CTX_BUCKET);
        assert_eq!(ctx_bucket(CTX_BUCKET), CTX_BUCKET);
        assert_eq!(ctx_bucket(CTX_BUCKET + 1), 2 * CTX_BUCKET);
        assert_eq!(key(16, 1025), key(16, 1536));
        assert_ne!(key(16, 1536), key(16, 1537));
        assert_ne!(key(16, 1025), key(15, 1025));
        assert_ne!(
            key(16, 1025),
            GraphKey {
                variant: 1,
                ..key(16, 1025)
            }
        );
    }

    #[test]
    fn the_least_recently_used_graph_goes_first() {
        let mut c = GraphCache::new(2);
        c.set_epoch(0);
        c.insert(key(1, 10), "a");
        c.insert(key(2, 10), "b");
        // Using "a" makes "b" the oldest.
        assert_eq!(c.get(key(1, 10)).copied(), Some("a"));
        c.insert(key(3, 10), "c");
        assert_eq!(c.len(), 2);
        assert!(c.get(key(2, 10)).is_none());
        assert_eq!(c.get(key(1, 10)).copied(), Some("a"));
        assert_eq!(c.get(key(3, 10)).copied(), Some("c"));
        // The same key replaces its graph without evicting another.
        c.insert(key(3, 10), "c2");
        assert_eq!(c.len(), 2);
        assert_eq!(c.get(key(3, 10)).copied(), Some("c2"));
        assert_eq!(c.get(key(1, 10)).copied(), Some("a"));
    }

    #[test]
    fn a_shape_is_captured_when_it_repeats() {
        let mut c: GraphCache<()> = GraphCache::new(4);
        // Steady batch: the first step runs as it is, the second captures.
        assert!(!c.worth_capturing(key(16, 10)));
        assert!(c.worth_capturing(key(16, 10)));
        // After a capture the next miss starts again.
        assert!(!c.worth_capturing(key(16, 10)));
        // Shapes that change every step never capture.
        for rows in [3, 4, 3, 4, 5] {
            assert!(!c.worth_capturing(key(rows, 10)));
        }
        assert!(c.worth_capturing(key(5, 10)));
        // Another context bucket or kind of step is another shape.
        assert!(!c.worth_capturing(key(5, 600)));
        assert!(!c.worth_capturing(GraphKey {
            variant: 1,
            ..key(5, 600)
        }));
    }

    #[test]
    fn a_held_graph_runs_and_a_new_shape_waits_for_its_repeat() {
        let mut c = GraphCache::new(4);
        c.set_epoch(0);
        // A steady batch of 8 rows: launched once, then captured (as the caller
        // inserts it), then replayed.
        assert!(!c.runs_from_graph(key(8, 10)));
        assert!(c.runs_from_graph(key(8, 10)));
        c.insert(key(8, 10), ());
        assert!(c.runs_from_graph(key(8, 10)));
        // Rows arriving and leaving every step: launched, nothing to capture, and the
        // held graph still serves its shape in between.
        for rows in [9, 7, 9, 7] {
            assert!(!c.runs_from_graph(key(rows, 10)));
            assert!(c.runs_from_graph(key(8, 10)));
        }
        // Once the pool moves (a new epoch) the held graph is gone: its shape waits
        // for a repeat again.
        c.set_epoch(1);
        assert!(!c.runs_from_graph(key(8, 10)));
        assert!(c.runs_from_graph(key(8, 10)));
    }

    #[test]
    fn graphs_are_on_unless_switched_off() {
        assert!(chosen_by(None));
        assert!(chosen_by(Some("on")));
        assert!(chosen_by(Some("")));
        assert!(!chosen_by(Some("off")));
        assert!(!chosen_by(Some(" off ")));
    }

    #[test]
    fn another_epoch_drops_every_graph_and_the_same_keeps_them() {
        let mut c = GraphCache::new(4);
        c.set_epoch(7);
        c.insert(key(1, 10), 1);
        c.set_epoch(7);
        assert_eq!(c.get(key(1, 10)).copied(), Some(1));
        c.set_epoch(8);
        assert!(c.is_empty());
        assert!(c.get(key(1, 10)).is_none());
    }
}
