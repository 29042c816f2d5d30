//! `quest`: query-aware page selection (algorithms.md §7). The whole cache stays on the
//! device in `full`'s paged pool; per page of P positions and KV head the channel-wise
//! max and min of the keys are kept, updated as tokens are appended. Each decode step
//! of a layer past the dense ones bounds every page's logit by
//! `U(page) = Σ_c max(q_c·M_c, q_c·m_c)`, takes the top `N − 1` pages among all but the
//! current one, plus the current one, `N = max(1, ⌊⌈b·n⌉ / P⌋)`, and attends over those
//! only. Nothing is freed: the saving is the keys read, which the audit counts.
//!
//! [adapt] GQA: a page's bound for a KV head is the max of its group's query heads'
//! bounds, and the pages are selected per KV head (the kernels assume H = Hkv). Ties:
//! the older page. The selected pages are gathered into a head-major tile before the
//! decode kernel (on the CPU that copy is part of the cache-operation time).

use super::full::FullPolicy;
use super::registry::{bad, parse_usize, unknown, Param, Strategy, StrategyParams, Variant};
use super::spec::{PolicyEnv, Reservation};
use super::to_f32;
use super::{
    AttendRecord, KvPolicy, LayerInput, PolicyMemory, PolicyStats, SeqId, SeqInfo, StepBatch,
};
use crate::attention::decode::{decode_attention, DecodeRow, DecodeShape, KeySet};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::kv::KvCodec;
use crate::model::Llama;
use candle_core::Tensor;
use rayon::prelude::*;
use serde_json::json;
use std::collections::HashMap;
use std::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QuestParams {
    /// Fraction of the context read per decode step (`b ≥ 1`: everything).
    pub budget: f64,
    /// Page size P in tokens (default 16).
    pub page: usize,
    /// Leading layers attended densely (default 2).
    pub dense_layers: usize,
}

impl Default for QuestParams {
    fn default() -> Self {
        Self {
            budget: 1.0,
            page: 16,
            dense_layers: 2,
        }
    }
}

impl QuestParams {
    /// Pages a decode row of `n` tokens (its own included) reads in a sparse layer;
    /// `None` when it reads everything.
    pub fn pages_read(&self, n: usize) -> Option<usize> {
        if self.budget >= 1.0 {
            return None;
        }
        let tokens = (self.budget * n as f64).ceil() as usize;
        let pages = (tokens / self.page).max(1);
        (pages < n.div_ceil(self.page)).then_some(pages)
    }

    /// Metadata bytes per token of context (max and min per channel, per page, per KV
    /// head, in the sparse layers), f32.
    fn meta_per_page(&self, cfg: &ModelConfig) -> u64 {
        let sparse = cfg.num_layers.saturating_sub(self.dense_layers);
        (sparse * cfg.num_kv_heads * 2 * cfg.head_dim * 4) as u64
    }
}

impl StrategyParams for QuestParams {
    const STRATEGY: &'static Strategy = &Strategy {
        name: "quest",
        about: "query-aware page selection, the whole cache kept on the device (Quest)",
        params: &[
            Param {
                key: "page",
                values: "tokens ≥ 1; default 16",
                about: "page size P of the key metadata and of the selection",
            },
            Param {
                key: "dense_layers",
                values: "an integer ≥ 0; default 2",
                about: "leading layers attended densely",
            },
        ],
        budgeted: true,
        verify: &[Variant::DEFAULT, Variant::both(&[("dense_layers", "0")])],
        audit: &[Variant::both(&[("dense_layers", "0"), ("page", "4")])],
        bench: &[],
        cuda: false,
        kv_codec: true,
    };

    fn at_budget(budget: f64) -> Result<Self> {
        Ok(Self {
            budget,
            ..Default::default()
        })
    }

    fn budget(&self) -> f64 {
        self.budget
    }

    fn set(&mut self, k: &str, v: &str) -> Result<()> {
        let s = Self::STRATEGY.name;
        match k {
            "page" => {
                self.page = parse_usize(s, k, v)?;
                if self.page == 0 {
                    return Err(bad(s, k, v, "at least 1 token"));
                }
            }
            "dense_layers" => self.dense_layers = parse_usize(s, k, v)?,
            _ => return Err(unknown(Self::STRATEGY, k)),
        }
        Ok(())
    }

    fn params_json(&self) -> serde_json::Value {
        json!({ "page": self.page, "dense_layers": self.dense_layers })
    }

    /// The whole cache stays, as `full`'s: the pool up front.
    fn default_reservation(&self) -> Reservation {
        Reservation::Fraction
    }

    fn build(&self, model: &Llama, mut env: PolicyEnv) -> Result<Box<dyn KvPolicy>> {
        // The pages' metadata lives in the KV budget: the pool is what leaves room for
        // the metadata of every token it can hold.
        let cfg = &model.cfg;
        let token = env.full_options().kv_codec.token_bytes(cfg) as f64;
        let meta = self.meta_per_page(cfg) as f64 / self.page as f64;
        env.kv_device_bytes = (env.kv_device_bytes as f64 * token / (token + meta)) as u64;
        Ok(Box::new(QuestPolicy::new(*self, model, env)))
    }

    fn nominal_attended(&self, layer: usize, _info: &SeqInfo, n: usize) -> usize {
        match self.pages_read(n) {
            Some(pages) if layer >= self.dense_layers => (pages * self.page).min(n),
            _ => n,
        }
    }

    fn device_kv_bytes(
        &self,
        cfg: &ModelConfig,
        _info: &SeqInfo,
        n: usize,
        kv: KvCodec,
        statistic: usize,
    ) -> u64 {
        n as u64 * kv.token_bytes(cfg)
            + n.div_ceil(self.page) as u64 * self.meta_per_page(cfg) / 4 * statistic as u64
    }

    fn cpu_kv_codec(&self, model: KvCodec, chosen: Option<KvCodec>) -> KvCodec {
        chosen.unwrap_or(model)
    }
}

/// One KV head's bound on each page's logit for the query heads `q` (`[G, dh]`):
/// `max over heads of Σ_c max(q_c·M_c, q_c·m_c)`. `meta`: `[pages, 2, dh]` (max, min).
pub fn page_bounds(q: &[f32], meta: &[f32], dh: usize) -> Vec<f32> {
    meta.chunks_exact(2 * dh)
        .map(|page| {
            let (hi, lo) = page.split_at(dh);
            q.chunks_exact(dh)
                .map(|qh| {
                    qh.iter()
                        .zip(hi.iter().zip(lo))
                        .map(|(&x, (&m, &l))| (x * m).max(x * l))
                        .sum::<f32>()
                })
                .fold(f32::NEG_INFINITY, f32::max)
        })
        .collect()
}

/// The pages read: the top `pages − 1` of `bounds` but the last (ties: the older),
/// and the last, ascending.
pub fn select_pages(bounds: &[f32], pages: usize) -> Vec<usize> {
    let last = bounds.len() - 1;
    let mut order: Vec<usize> = (0..last).collect();
    order.sort_unstable_by(|&a, &b| bounds[b].total_cmp(&bounds[a]).then(a.cmp(&b)));
    order.truncate(pages.saturating_sub(1));
    order.push(last);
    order.sort_unstable();
    order
}

pub struct QuestPolicy {
    full: FullPolicy,
    params: QuestParams,
    num_layers: usize,
    shape: DecodeShape,
    info: HashMap<SeqId, SeqInfo>,
    /// Per sequence, `sparse layer × Hkv + KV head`: `[pages, 2, dh]` (channel max, then
    /// min), so a head's pages are one slice for the bound.
    meta: HashMap<SeqId, Vec<Vec<f32>>>,
    attended: Vec<AttendRecord>,
    stats: PolicyStats,
    /// Positions each (sequence, layer, KV head) read in its last selection.
    last: HashMap<(SeqId, usize, usize), Vec<u32>>,
}

impl QuestPolicy {
    pub fn new(params: QuestParams, model: &Llama, env: PolicyEnv) -> Self {
        let cfg = &model.cfg;
        let opts = env.full_options();
        let blocks = env.kv_blocks(FullPolicy::block_bytes(cfg, &opts));
        let full = match env.reservation {
            Reservation::Fraction => FullPolicy::new(cfg, opts, blocks),
            Reservation::Budget => FullPolicy::on_demand(cfg, opts, blocks),
        };
        Self {
            full,
            params,
            num_layers: cfg.num_layers,
            shape: DecodeShape {
                num_heads: cfg.num_heads,
                num_kv_heads: cfg.num_kv_heads,
                head_dim: cfg.head_dim,
            },
            info: HashMap::new(),
            meta: HashMap::new(),
            attended: Vec::new(),
            stats: PolicyStats::default(),
            last: HashMap::new(),
        }
    }

    fn sparse(&self, layer: usize) -> bool {
        layer >= self.params.dense_layers
    }

    fn meta_bytes(&self, seq: SeqId) -> u64 {
        self.meta
            .get(&seq)
            .map_or(0, |m| m.iter().map(|l| l.len() as u64 * 4).sum())
    }

    /// Fold the step's new keys of a sparse `layer` into their pages' max and min.
    fn update_meta(&mut self, batch: &StepBatch, layer: usize, kf: &[f32]) {
        let (hkv, dh, page) = (
            self.shape.num_kv_heads,
            self.shape.head_dim,
            self.params.page,
        );
        let li = layer - self.params.dense_layers;
        let sparse_layers = self.num_layers - self.params.dense_layers;
        for s in &batch.seqs {
            let m = self
                .meta
                .entry(s.id)
                .or_insert_with(|| vec![Vec::new(); sparse_layers * hkv]);
            for i in 0..s.q_len {
                let p = (s.ctx_before + i) / page;
                let row = &kf[(s.q_start + i) * hkv * dh..][..hkv * dh];
                for g in 0..hkv {
                    let m = &mut m[li * hkv + g];
                    if m.len() < (p + 1) * 2 * dh {
                        let start = m.len();
                        m.resize((p + 1) * 2 * dh, 0.0);
                        for chunk in m[start..].chunks_exact_mut(2 * dh) {
                            chunk[..dh].fill(f32::NEG_INFINITY);
                            chunk[dh..].fill(f32::INFINITY);
                        }
                    }
                    let at = p * 2 * dh;
                    let (hi, lo) = m[at..at + 2 * dh].split_at_mut(dh);
                    for ((h, l), &x) in hi.iter_mut().zip(lo.iter_mut()).zip(&row[g * dh..][..dh]) {
                        *h = h.max(x);
                        *l = l.min(x);
                    }
                }
            }
        }
    }
}

impl KvPolicy for QuestPolicy {
    fn name(&self) -> &'static str {
        "quest"
    }

    fn admit(&mut self, seq: SeqId, info: SeqInfo) -> Result<()> {
        self.info.insert(seq, info);
        self.meta.remove(&seq);
        self.full.admit(seq, info)
    }

    fn prepare(&mut self, held: &[SeqInfo]) -> Result<()> {
        self.full.prepare(held)
    }

    fn set_scratch_limit(&mut self, limit: Option<u64>) {
        self.full.set_scratch_limit(limit);
    }

    fn reserve(&mut self, seq: SeqId, total_tokens: usize) -> Result<bool> {
        self.info
            .entry(seq)
            .or_insert_with(|| SeqInfo::unannounced(total_tokens));
        self.full.reserve(seq, total_tokens)
    }

    fn fits(&self, total_tokens: usize) -> bool {
        self.full.fits(total_tokens)
    }

    fn set_device_ceiling(&mut self, bytes: u64) -> bool {
        self.full.set_device_ceiling(bytes)
    }

    fn release(&mut self, seq: SeqId) {
        self.full.release(seq);
        self.info.remove(&seq);
        self.meta.remove(&seq);
        self.last.retain(|(s, _, _), _| *s != seq);
    }

    fn attend(&mut self, batch: &StepBatch, input: &LayerInput<'_>) -> Result<Tensor> {
        let layer = input.layer;
        let (h, hkv, dh) = (
            self.shape.num_heads,
            self.shape.num_kv_heads,
            self.shape.head_dim,
        );
        let t0 = Instant::now();
        let kf = to_f32(input.k)?;
        self.full.write(batch, layer, &kf, &to_f32(input.v)?);
        if self.sparse(layer) {
            // The bounds are over the keys as stored, so U(page) bounds what is read.
            let stored = self.full.codec().round_trip_rows(&kf, dh);
            self.update_meta(batch, layer, &stored);
        }
        self.stats.cache_ops_s += t0.elapsed().as_secs_f64();
        let qf = to_f32(input.q)?;
        // Decode rows past their prefill in a sparse layer whose budget is below the
        // context: the page selection; every other row as `full` attends it.
        let selected: HashMap<SeqId, usize> = batch
            .seqs
            .iter()
            .filter(|s| {
                self.sparse(layer)
                    && s.q_len == 1
                    && self
                        .info
                        .get(&s.id)
                        .is_some_and(|i| s.ctx_before >= i.prefill_len)
            })
            .filter_map(|s| {
                self.params
                    .pages_read(s.ctx_before + 1)
                    .map(|pages| (s.id, pages))
            })
            .collect();
        let mut out = self
            .full
            .attend_seqs(batch, layer, &qf, |s| selected.contains_key(&s.id))?;
        if selected.is_empty() {
            return Ok(
                Tensor::from_vec(out, (batch.num_tokens, h, dh), input.q.device())?
                    .to_dtype(input.q.dtype())?,
            );
        }
        // Bound, select and gather per (row, KV head), rows in parallel.
        let t1 = Instant::now();
        let (page, group) = (self.params.page, h / hkv);
        let li = layer - self.params.dense_layers;
        let rows: Vec<_> = batch
            .seqs
            .iter()
            .filter(|s| selected.contains_key(&s.id))
            .collect();
        let this = &*self;
        type Tile = (usize, usize, Vec<f32>, Vec<f32>, Vec<Vec<u32>>);
        let tiles: Vec<Tile> = rows
            .par_iter()
            .map(|s| {
                let n = s.ctx_before + 1;
                let pages = selected[&s.id];
                let meta = &this.meta[&s.id][li * hkv..(li + 1) * hkv];
                let (store, table) = this.full.kv_of(s.id);
                let q = &qf[s.q_start * h * dh..][..h * dh];
                let (mut k, mut v, mut read) = (Vec::new(), Vec::new(), Vec::new());
                for g in 0..hkv {
                    let bounds =
                        page_bounds(&q[g * group * dh..(g + 1) * group * dh], &meta[g], dh);
                    let keep = select_pages(&bounds, pages);
                    let positions: Vec<usize> = keep
                        .iter()
                        .flat_map(|&p| p * page..((p + 1) * page).min(n))
                        .collect();
                    store.gather_head(layer, table, g, positions.iter().copied(), &mut k, &mut v);
                    read.push(positions.iter().map(|&p| p as u32).collect());
                }
                (s.q_start, k.len() / (hkv * dh), k, v, read)
            })
            .collect();
        let decode_rows: Vec<DecodeRow<'_>> = tiles
            .iter()
            .map(|(row, m, k, v, _)| DecodeRow {
                row: *row,
                keys: KeySet::Dense { k, v, len: *m },
            })
            .collect();
        // Bounds, selection and gathers are cache operations; the attention is compute.
        self.stats.cache_ops_s += t1.elapsed().as_secs_f64();
        decode_attention(&qf, &decode_rows, &mut out, self.shape, false);
        for (s, (_, m, _, _, read)) in rows.iter().zip(tiles) {
            self.attended.push(AttendRecord {
                seq: s.id,
                layer,
                attended: m,
                context: s.ctx_before + 1,
            });
            for (g, r) in read.into_iter().enumerate() {
                self.last.insert((s.id, layer, g), r);
            }
        }
        Ok(
            Tensor::from_vec(out, (batch.num_tokens, h, dh), input.q.device())?
                .to_dtype(input.q.dtype())?,
        )
    }

    fn memory(&self) -> PolicyMemory {
        let meta: u64 = self.meta.keys().map(|&s| self.meta_bytes(s)).sum();
        let m = self.full.memory();
        PolicyMemory {
            device_reserved: m.device_reserved + meta,
            device_used: m.device_used + meta,
            ..m
        }
    }

    fn seq_device_bytes(&self, seq: SeqId) -> u64 {
        self.full.seq_device_bytes(seq) + self.meta_bytes(seq)
    }

    fn take_stats(&mut self) -> PolicyStats {
        let mut s = self.full.take_stats();
        s.merge(&std::mem::take(&mut self.stats));
        s
    }

    fn take_attended(&mut self) -> Vec<AttendRecord> {
        let mut a = self.full.take_attended();
        a.append(&mut self.attended);
        a
    }

    /// The positions read by the last page selection of (layer, KV head).
    fn kept_positions(&self, seq: SeqId, layer: usize, kv_head: usize) -> Option<Vec<u32>> {
        self.last.get(&(seq, layer, kv_head)).cloned()
    }

    fn check_invariants(&self) -> std::result::Result<(), String> {
        self.full.check_invariants()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// `U(page)` bounds the true maximum logit of every page, for random keys and
    /// queries of both signs (the property Quest's selection rests on).
    #[test]
    fn page_bounds_are_upper_bounds_of_every_true_logit() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for trial in 0..200 {
            let (dh, page, group) = (1 + trial % 9, 1 + trial % 5, 1 + trial % 3);
            let n = 1 + rng.random_range(0..40usize);
            let keys: Vec<f32> = (0..n * dh).map(|_| rng.random_range(-3.0..3.0)).collect();
            let q: Vec<f32> = (0..group * dh)
                .map(|_| rng.random_range(-3.0..3.0))
                .collect();
            let pages = n.div_ceil(page);
            let mut meta = vec![0f32; pages * 2 * dh];
            for p in 0..pages {
                for c in 0..dh {
                    let col = (p * page..((p + 1) * page).min(n)).map(|j| keys[j * dh + c]);
                    meta[p * 2 * dh + c] = col.clone().fold(f32::NEG_INFINITY, f32::max);
                    meta[p * 2 * dh + dh + c] = col.fold(f32::INFINITY, f32::min);
                }
            }
            let u = page_bounds(&q, &meta, dh);
            for j in 0..n {
                for qh in q.chunks_exact(dh) {
                    let logit: f32 = qh
                        .iter()
                        .zip(&keys[j * dh..][..dh])
                        .map(|(a, b)| a * b)
                        .sum();
                    assert!(
                        u[j / page] >= logit - 1e-4,
                        "trial {trial}: page {} bound {} < logit {logit}",
                        j / page,
                        u[j / page]
                    );
                }
            }
        }
    }

    #[test]
    fn selection_keeps_the_current_page_and_the_best_others_older_on_ties() {
        let b = [0.5, 3.0, 1.0, 3.0, -9.0];
        assert_eq!(select_pages(&b, 3), vec![1, 3, 4]);
        assert_eq!(select_pages(&b, 2), vec![1, 4]);
        assert_eq!(select_pages(&b, 1), vec![4]);
        let p = QuestParams {
            budget: 0.25,
            page: 4,
            dense_layers: 2,
        };
        // ⌈0.25·40⌉ = 10 tokens: 2 pages of 4 of the 10.
        assert_eq!(p.pages_read(40), Some(2));
        assert_eq!(p.nominal_attended(2, &SeqInfo::unannounced(40), 40), 8);
        assert_eq!(p.nominal_attended(1, &SeqInfo::unannounced(40), 40), 40);
        // Below one page of budget, the current page alone.
        assert_eq!(p.pages_read(8), Some(1));
        // A budget covering every page reads everything.
        assert_eq!(QuestParams { budget: 0.9, ..p }.pages_read(8), None);
        assert_eq!(QuestParams::default().pages_read(1000), None);
    }
}
