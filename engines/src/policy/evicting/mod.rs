//! The machinery shared by policies that permanently evict tokens per KV head (H2O,
//! StreamingLLM): slot storage, prefill with a selectable attention implementation and
//! column statistics, decode over the kept slots plus the new token (the cache holds
//! C+1 during a step, algorithms.md §3), then one eviction per (layer, head) once full.
//! Each strategy supplies only its [`Eviction`] rule.

pub(crate) mod book;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod h2o;
pub mod snapkv;
pub mod streaming;

use crate::attention::decode::{decode_attention, DecodeRow, DecodeShape, KeySet};
use crate::attention::prefill::{prefill_attention, AttentionImpl, ColumnStats, PrefillShape};
use crate::error::{Component, Error, Result};
use crate::kv::slots::SlotStore;
use crate::policy::spec::PolicyEnv;
use crate::policy::to_f32;
use crate::policy::{
    AttendRecord, KvPolicy, LayerInput, PolicyMemory, PolicyStats, SeqId, SeqInfo, StepBatch,
};
use book::SlotBook;
use candle_core::Tensor;
use rayon::prelude::*;
use std::collections::HashMap;
use std::time::Instant;

/// Kept counts of one sequence once its prefill is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    /// Tokens kept after each step (`C`).
    pub capacity: usize,
    /// The most recent tokens always kept (`R`, or StreamingLLM's window `W`).
    pub recent: usize,
}

/// A decode victim rule as the device kernel implements it (`victim_better` in
/// cuda/kernels.cu): the same total orders as the rules' [`Eviction::victim`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VictimKind {
    /// Lowest score among positions older than the recent window, newest on ties.
    LowestScore = 0,
    /// Newest position older than the window (frozen heavy hitters).
    NewestOutsideWindow = 1,
    /// Oldest position that is not a sink.
    OldestAfterSinks = 2,
}

/// A strategy's eviction rule.
pub trait Eviction: Send + Sync + 'static {
    /// Which device victim rule reproduces [`Eviction::victim`].
    fn victim_kind(&self) -> VictimKind;
    fn name(&self) -> &'static str;
    /// `None`: keep everything (budget ≥ 1).
    fn counts(&self, info: &SeqInfo) -> Option<Counts>;
    /// Column statistics the prefill needs (`None`: no scores).
    fn prefill_stats(&self, attention: AttentionImpl) -> Option<ColumnStats>;
    /// Whether decode accumulates attention probabilities into the slot scores.
    fn decode_probs(&self) -> bool;
    /// Tokens kept after a step with `n` tokens of context: the capacity (H2O,
    /// StreamingLLM), or more when decode tokens are never evicted (SnapKV).
    fn capacity_at(&self, c: Counts, _info: &SeqInfo, _n: usize) -> usize {
        c.capacity
    }
    /// SnapKV: the last `w` prompt queries are held through the prefill and, when it
    /// ends, score the keys (their probabilities summed over the window and the
    /// group) in place of column statistics. 0: none.
    fn observation_window(&self) -> usize {
        0
    }
    /// StreamingLLM: keys are stored without RoPE and rotated by their index in the
    /// cache at every step.
    fn rolling_positions(&self) -> bool {
        false
    }
    /// Slots (= positions after a prefill) of one (layer, head) to keep after a
    /// prefill of `n > capacity` tokens, ascending; `score[j]` of position `j`.
    fn prefill_keep(&self, c: Counts, n: usize, score: &[f32]) -> Vec<usize>;
    /// Whether [`Eviction::prefill_keep`] is the plain rule "the `capacity − recent`
    /// highest scores before the window (ties: the older), then the window": the CUDA
    /// storage then decides it on the device (`h2o_prefill_keep`), with no copy to the
    /// host between a layer's statistics and its compaction.
    fn keeps_top_scores(&self) -> bool {
        false
    }
    /// The slot to evict from `capacity + 1` slots (positions `pos`, scores `score`;
    /// the last slot is the new token) with `n` tokens of context including it.
    fn victim(&self, c: Counts, n: usize, pos: &[u32], score: &[f32]) -> usize;
}

/// The first `k` of `items` under `order`, a total order (ties broken, e.g. by
/// position), in no particular order: the set a sort then truncation keeps, found by
/// selection in O(n) rather than sorting (a 32K-token prompt is kept this way per
/// layer and KV head, on the host, inside the prefill).
pub(crate) fn first_k(
    mut items: Vec<usize>,
    k: usize,
    order: impl FnMut(&usize, &usize) -> std::cmp::Ordering,
) -> Vec<usize> {
    if k == 0 {
        items.clear();
    } else if k < items.len() {
        items.select_nth_unstable_by(k - 1, order);
        items.truncate(k);
    }
    items
}

/// What an evicting policy knows of one sequence (shared with the CUDA storage).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SeqState {
    pub(crate) info: SeqInfo,
    pub(crate) counts: Option<Counts>,
    /// Tokens computed so far (K/V written in every layer).
    pub(crate) computed: usize,
}

impl SeqState {
    /// A sequence admitted under `rule`.
    pub(crate) fn admitted<E: Eviction>(rule: &E, info: SeqInfo) -> Self {
        Self {
            info,
            counts: rule.counts(&info),
            computed: 0,
        }
    }

    /// A sequence reserved without an admission (tests driving a policy directly):
    /// its whole length is its prompt and nothing is evicted.
    pub(crate) fn unannounced(total_tokens: usize) -> Self {
        Self {
            info: SeqInfo::unannounced(total_tokens),
            counts: None,
            computed: 0,
        }
    }

    /// Slots the sequence needs to hold `total_tokens` after this step when it holds
    /// `len` now: the prefill's positions, then one new slot per new token.
    pub(crate) fn slots_for(&self, len: usize, total_tokens: usize) -> usize {
        if self.prefilled() {
            len + (total_tokens - self.computed)
        } else {
            total_tokens
        }
    }

    pub(crate) fn prefilled(&self) -> bool {
        self.computed >= self.info.prefill_len
    }
}

/// Blocks of `block_size` slots the `held` sequences need at once at their peak:
/// each at its capacity after eviction plus the token being added, and the largest
/// prompt whole besides (a prefill holds every token until the eviction that ends it).
/// Exact for one prompt prefilled at a time; a chunked step that prefills several
/// grows the pool past it.
pub(crate) fn peak_blocks<E: Eviction>(rule: &E, held: &[SeqInfo], block_size: usize) -> usize {
    let bs = block_size.max(1);
    let total = |i: &SeqInfo| i.prompt_len + i.max_new_tokens;
    let kept = |i: &SeqInfo| match rule.counts(i) {
        Some(c) => (rule.capacity_at(c, i, total(i)) + 1).min(total(i)),
        None => total(i),
    };
    let prompt_extra = held
        .iter()
        .map(|i| {
            i.prefill_len
                .div_ceil(bs)
                .saturating_sub(kept(i).div_ceil(bs))
        })
        .max()
        .unwrap_or(0);
    held.iter().map(|i| kept(i).div_ceil(bs)).sum::<usize>() + prompt_extra
}

pub struct EvictingPolicy<E: Eviction> {
    rule: E,
    env: PolicyEnv,
    book: SlotBook,
    store: SlotStore,
    num_layers: usize,
    shape: PrefillShape,
    stats: PolicyStats,
    attended: Vec<AttendRecord>,
    scratch_limit: Option<u64>,
    /// cos, sin and length of the rotation table of cache indices (rolling positions).
    rope_cache: (Vec<f32>, Vec<f32>, usize),
    /// Observation-window queries (`[w, H, dh]` per layer) of sequences in prefill.
    window_q: HashMap<SeqId, Vec<Vec<f32>>>,
}

impl<E: Eviction> EvictingPolicy<E> {
    pub fn new(rule: E, cfg: &crate::config::ModelConfig, env: PolicyEnv) -> Self {
        // The slot stores keep f32 unless the engine's `kv_codec` says otherwise.
        let dtype = env.codec_or(crate::kv::KvCodec::F32);
        let slot_bytes = SlotStore::slot_bytes(
            cfg.num_layers,
            env.block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            dtype,
        );
        let book = SlotBook::new(&env, slot_bytes);
        let mut store = SlotStore::new(
            cfg.num_layers,
            env.block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            dtype,
        );
        store.ensure_blocks(book.num_blocks());
        Self {
            rule,
            book,
            store,
            env,
            num_layers: cfg.num_layers,
            shape: PrefillShape {
                num_heads: cfg.num_heads,
                num_kv_heads: cfg.num_kv_heads,
                head_dim: cfg.head_dim,
            },
            stats: PolicyStats::default(),
            attended: Vec::new(),
            scratch_limit: None,
            rope_cache: (Vec::new(), Vec::new(), 0),
            window_q: HashMap::new(),
        }
    }

    pub fn rule(&self) -> &E {
        &self.rule
    }

    /// Scores of the kept slots, same order as [`Self::kept_positions`].
    pub fn kept_scores(&self, seq: SeqId, layer: usize, g: usize) -> Option<Vec<f32>> {
        let s = self.store.meta.get(&seq)?;
        let p = &s.score[layer * self.shape.num_kv_heads + g];
        Some(p[..self.book.len(seq).min(p.len())].to_vec())
    }

    fn oom(&self, requested: u64) -> Error {
        Error::OutOfMemory {
            device: self.env.device_name.clone(),
            component: Component::Activations,
            requested,
            available: self.scratch_limit.unwrap_or(u64::MAX),
            capacity: self.env.device_capacity.unwrap_or(0),
        }
    }

    /// cos/sin of cache indices `0..m` (StreamingLLM's rolling positions), cached.
    fn rope_rows(&mut self, rope: &dyn crate::policy::Rope, m: usize) {
        if self.rope_cache.2 < m {
            let idx: Vec<u32> = (0..m.next_power_of_two() as u32).collect();
            let (c, s) = rope.tables(&idx);
            self.rope_cache = (c, s, idx.len());
        }
    }

    /// Keys of `seq` ordered by position and rotated to their index in the cache
    /// `0..m` (StreamingLLM's rolling positions), values in the same order:
    /// `[m, Hkv, dh]`, or `[Hkv, m, dh]` when `head_major` (the decode kernel's layout).
    fn rolled(
        &self,
        layer: usize,
        seq: SeqId,
        m: usize,
        interleaved: bool,
        head_major: bool,
    ) -> (Vec<f32>, Vec<f32>) {
        let (hkv, dh) = (self.shape.num_kv_heads, self.shape.head_dim);
        let half = dh / 2;
        let s = &self.store.meta[&seq];
        let table = self.book.table(seq);
        let (kview, vview) = self.store.kv.views(layer);
        let bs = self.store.block_size();
        let mut scratch = Vec::new();
        let mut k = vec![0f32; m * hkv * dh];
        let mut v = vec![0f32; m * hkv * dh];
        for g in 0..hkv {
            let pos = &s.pos[layer * hkv + g][..m];
            let mut order: Vec<usize> = (0..m).collect();
            order.sort_unstable_by_key(|&i| pos[i]);
            for (rank, &slot) in order.iter().enumerate() {
                let src = (table[slot / bs] as usize * hkv + g) * bs + slot % bs;
                let dst = if head_major {
                    (g * m + rank) * dh
                } else {
                    (rank * hkv + g) * dh
                };
                k[dst..dst + dh].copy_from_slice(kview.rows(src, 1, dh, &mut scratch));
                v[dst..dst + dh].copy_from_slice(vview.rows(src, 1, dh, &mut scratch));
                let (c, sn) = (&self.rope_cache.0, &self.rope_cache.1);
                crate::policy::rotate_in_place(
                    &mut k[dst..dst + dh],
                    &c[rank * half..(rank + 1) * half],
                    &sn[rank * half..(rank + 1) * half],
                    interleaved,
                );
            }
        }
        (k, v)
    }
}

impl<E: Eviction> KvPolicy for EvictingPolicy<E> {
    fn name(&self) -> &'static str {
        self.rule.name()
    }

    fn admit(&mut self, seq: SeqId, info: SeqInfo) -> Result<()> {
        self.book.admit(&self.rule, seq, info);
        self.window_q.remove(&seq);
        Ok(())
    }

    fn prepare(&mut self, held: &[SeqInfo]) -> Result<()> {
        // A pool reserved on demand grows to the batch's peak before the timed steps.
        let blocks = self.book.prepare(&self.rule, held);
        self.store.ensure_blocks(blocks);
        Ok(())
    }

    fn set_scratch_limit(&mut self, limit: Option<u64>) {
        self.scratch_limit = limit;
    }

    fn reserve(&mut self, seq: SeqId, total_tokens: usize) -> Result<bool> {
        let ok = self.book.reserve(seq, total_tokens);
        self.store.ensure_blocks(self.book.num_blocks());
        Ok(ok)
    }

    fn fits(&self, total_tokens: usize) -> bool {
        self.book.fits(total_tokens)
    }

    fn set_device_ceiling(&mut self, bytes: u64) -> bool {
        self.book.set_device_ceiling(bytes)
    }

    fn release(&mut self, seq: SeqId) {
        self.book.release(seq);
        self.store.release(seq);
        self.window_q.remove(&seq);
    }

    fn attend(&mut self, batch: &StepBatch, input: &LayerInput<'_>) -> Result<Tensor> {
        let layer = input.layer;
        let (h, hkv, dh) = (
            self.shape.num_heads,
            self.shape.num_kv_heads,
            self.shape.head_dim,
        );
        let rolling = self.rule.rolling_positions();
        let t0 = Instant::now();
        let kf = to_f32(if rolling { input.k_raw } else { input.k })?;
        let vf = to_f32(input.v)?;
        let stride = hkv * dh;
        for s in &batch.seqs {
            let first_slot = self.book.first_write_slot(s.id, s.ctx_before);
            let rows = s.q_start * stride..(s.q_start + s.q_len) * stride;
            self.store.write(
                s.id,
                self.book.table(s.id),
                layer,
                first_slot,
                s.ctx_before as u32,
                &kf[rows.clone()],
                &vf[rows],
            );
        }
        self.stats.cache_ops_s += t0.elapsed().as_secs_f64();

        let qf = to_f32(input.q)?;
        let mut out = vec![0f32; batch.num_tokens * h * dh];
        let (decode, prefill) = batch.split(|id| self.book.prefilled(id));

        // Decode: the query over the kept slots and its own token (last slot).
        let mut probs = Vec::new();
        if !decode.is_empty() && !rolling {
            let (kv_k, kv_v) = self.store.kv.views(layer);
            let rows: Vec<DecodeRow<'_>> = decode
                .iter()
                .map(|s| DecodeRow {
                    row: s.q_start,
                    keys: KeySet::Paged {
                        k: kv_k,
                        v: kv_v,
                        table: self.book.table(s.id),
                        len: self.book.len(s.id) + 1,
                        block_size: self.store.block_size(),
                    },
                })
                .collect();
            let shape = DecodeShape {
                num_heads: h,
                num_kv_heads: hkv,
                head_dim: dh,
            };
            probs = decode_attention(&qf, &rows, &mut out, shape, self.rule.decode_probs());
        } else if rolling {
            // Every cached key re-rotated to its index in the cache, the query to the
            // last index: the original's per-step cost, paid in place in f32.
            let qraw = to_f32(input.q_raw)?;
            let interleaved = input.rope.interleaved();
            let half = dh / 2;
            let mut qrot = qraw.clone();
            let lens: Vec<usize> = decode.iter().map(|s| self.book.len(s.id) + 1).collect();
            self.rope_rows(input.rope, lens.iter().copied().max().unwrap_or(0));
            // Gathering and rotating is the bulk of the per-step cost: one sequence per
            // worker.
            let this = &*self;
            let tiles: Vec<_> = decode
                .par_iter()
                .zip(&lens)
                .map(|(s, &m)| (m, this.rolled(layer, s.id, m, interleaved, true)))
                .collect();
            for (s, &m) in decode.iter().zip(&lens) {
                let (c, sn) = (&self.rope_cache.0, &self.rope_cache.1);
                crate::policy::rotate_in_place(
                    &mut qrot[s.q_start * h * dh..(s.q_start + 1) * h * dh],
                    &c[(m - 1) * half..m * half],
                    &sn[(m - 1) * half..m * half],
                    interleaved,
                );
            }
            let rows: Vec<DecodeRow<'_>> = decode
                .iter()
                .zip(&tiles)
                .map(|(s, (m, (k, v)))| DecodeRow {
                    row: s.q_start,
                    keys: KeySet::Dense { k, v, len: *m },
                })
                .collect();
            let shape = DecodeShape {
                num_heads: h,
                num_kv_heads: hkv,
                head_dim: dh,
            };
            decode_attention(&qrot, &rows, &mut out, shape, false);
        }
        for s in &decode {
            self.attended.push(AttendRecord {
                seq: s.id,
                layer,
                attended: self.book.len(s.id) + 1,
                context: s.ctx_before + 1,
            });
        }

        // Prefill rows: slots are positions until the prefill ends.
        let stats_mode = self.rule.prefill_stats(self.env.attention);
        for s in &prefill {
            let n = s.ctx_before + s.q_len;
            let (k, v) = if rolling {
                self.rope_rows(input.rope, n);
                self.rolled(layer, s.id, n, input.rope.interleaved(), false)
            } else {
                self.store.kv.gather(layer, self.book.table(s.id), n)
            };
            let q = &qf[s.q_start * h * dh..(s.q_start + s.q_len) * h * dh];
            let r = prefill_attention(
                q,
                &k,
                &v,
                s.q_len,
                n,
                self.shape,
                self.env.attention,
                self.env.chunk_size,
                stats_mode,
                self.scratch_limit,
            )
            .map_err(|e| self.oom(e.requested))?;
            self.stats.add_scratch(r.scratch_bytes);
            out[s.q_start * h * dh..(s.q_start + s.q_len) * h * dh].copy_from_slice(&r.out);
            if let Some(col) = r.col {
                let e = self.store.meta.get_mut(&s.id).expect("written above");
                for g in 0..hkv {
                    let sc = &mut e.score[layer * hkv + g];
                    for (x, c) in sc[..n].iter_mut().zip(&col[g * n..(g + 1) * n]) {
                        *x += c;
                    }
                }
            }
            let w = self.rule.observation_window();
            let st = self.book.state(s.id);
            let plen = st.info.prefill_len;
            if w > 0 && st.counts.is_some_and(|c| plen > c.capacity) {
                // Hold the window's queries until the prompt ends, then let them vote.
                let first = plen.saturating_sub(w);
                let layers = self.num_layers;
                let held = self
                    .window_q
                    .entry(s.id)
                    .or_insert_with(|| vec![Vec::new(); layers]);
                for i in 0..s.q_len {
                    if s.ctx_before + i >= first {
                        held[layer].extend_from_slice(&q[i * h * dh..(i + 1) * h * dh]);
                    }
                }
                if n == plen {
                    let rows = std::mem::take(&mut held[layer]);
                    let votes = crate::policy::evicting::snapkv::window_scores(
                        &rows, first, &k, n, self.shape,
                    );
                    self.stats
                        .add_scratch(((rows.len() + votes.len() + n) * 4) as u64);
                    let e = self.store.meta.get_mut(&s.id).expect("written above");
                    for g in 0..hkv {
                        e.score[layer * hkv + g][..n].copy_from_slice(&votes[g * n..(g + 1) * n]);
                    }
                    if layer + 1 == self.num_layers {
                        self.window_q.remove(&s.id);
                    }
                }
            }
        }

        // Statistics and eviction: cache operations.
        let t1 = Instant::now();
        for (i, s) in decode.iter().enumerate() {
            let st = self.book.state(s.id);
            let m = self.book.len(s.id) + 1;
            let e = self.store.meta.get_mut(&s.id).expect("written above");
            if self.rule.decode_probs() {
                for g in 0..hkv {
                    let sc = &mut e.score[layer * hkv + g];
                    for (x, p) in sc[..m].iter_mut().zip(&probs[i][g * m..(g + 1) * m]) {
                        *x += p;
                    }
                }
            }
            if let Some(c) = st.counts {
                let n = s.ctx_before + 1;
                if m > self.rule.capacity_at(c, &st.info, n) {
                    let table = self.book.table(s.id);
                    for g in 0..hkv {
                        let e = &self.store.meta[&s.id];
                        let victim = self.rule.victim(
                            c,
                            n,
                            &e.pos[layer * hkv + g][..m],
                            &e.score[layer * hkv + g][..m],
                        );
                        self.store.replace(s.id, table, layer, g, victim, m - 1);
                    }
                }
            }
        }
        for s in &prefill {
            let st = self.book.state(s.id);
            let n = s.ctx_before + s.q_len;
            if n < st.info.prefill_len {
                continue;
            }
            if let Some(c) = st.counts {
                if n > c.capacity {
                    for g in 0..hkv {
                        let keep = {
                            let e = &self.store.meta[&s.id];
                            self.rule.prefill_keep(c, n, &e.score[layer * hkv + g][..n])
                        };
                        let table = self.book.table(s.id);
                        self.store.compact(s.id, table, layer, g, &keep);
                    }
                }
            }
        }
        if layer + 1 == self.num_layers {
            for s in &batch.seqs {
                self.book.end_step(&self.rule, s.id, s.ctx_before + s.q_len);
            }
        }
        self.stats.cache_ops_s += t1.elapsed().as_secs_f64();
        Ok(
            Tensor::from_vec(out, (batch.num_tokens, h, dh), input.q.device())?
                .to_dtype(input.q.dtype())?,
        )
    }

    fn memory(&self) -> PolicyMemory {
        // The pool as allocated: all of it under `fraction`, what it grew to under
        // `budget`.
        self.book.memory(self.book.num_blocks())
    }

    fn seq_device_bytes(&self, seq: SeqId) -> u64 {
        self.book.seq_device_bytes(seq)
    }

    fn take_stats(&mut self) -> PolicyStats {
        std::mem::take(&mut self.stats)
    }

    fn take_attended(&mut self) -> Vec<AttendRecord> {
        std::mem::take(&mut self.attended)
    }

    /// Kept positions in slot order.
    fn kept_positions(&self, seq: SeqId, layer: usize, g: usize) -> Option<Vec<u32>> {
        let s = self.store.meta.get(&seq)?;
        let p = &s.pos[layer * self.shape.num_kv_heads + g];
        Some(p[..self.book.len(seq).min(p.len())].to_vec())
    }

    fn check_invariants(&self) -> std::result::Result<(), String> {
        self.store.check_invariants()?;
        let kept = |id: SeqId| {
            self.store
                .meta
                .get(&id)
                .map_or_else(Vec::new, |m| m.pos.clone())
        };
        self.book.check_invariants(&self.rule, Some(&kept))
    }
}
