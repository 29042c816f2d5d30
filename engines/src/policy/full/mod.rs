//! `full`: the vLLM paradigm. One paged block pool sized at start-up, a block table per
//! sequence, no eviction; attention reads K/V through the block tables.

#[cfg(feature = "cuda")]
pub mod cuda;

use crate::attention::paged::{paged_attention, AttnShape, SeqAttn};
use crate::attention::prefill::{prefill_attention, AttentionImpl, PrefillShape};
use crate::config::ModelConfig;
use crate::error::{Component, Error, Result};
use crate::kv::{BlockId, KvCodec, PagedKv, SeqTables};
use crate::model::Llama;
use crate::policy::registry::{unknown, Param, Strategy, StrategyParams, Variant};
use crate::policy::spec::{PolicyEnv, Reservation};
use crate::policy::to_f32;
use crate::policy::{
    AttendRecord, KvPolicy, LayerInput, PolicyMemory, PolicyStats, SeqId, SeqInfo, StepBatch,
};
use candle_core::Tensor;
use std::time::Instant;

/// `full` takes no parameters but the engine's `reservation` and `kv_codec`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FullParams;

impl StrategyParams for FullParams {
    const STRATEGY: &'static Strategy = &Strategy {
        name: "full",
        about: "paged full cache with continuous batching (the vLLM paradigm)",
        params: &[] as &[Param],
        budgeted: false,
        verify: &[Variant::DEFAULT],
        audit: &[],
        bench: &[],
        cuda: true,
        kv_codec: true,
    };

    fn at_budget(budget: f64) -> Result<Self> {
        if budget < 1.0 {
            return Err(Error::Config(format!(
                "budget {budget}: `full` keeps every token; budgets apply to the other strategies"
            )));
        }
        Ok(FullParams)
    }

    fn budget(&self) -> f64 {
        1.0
    }

    fn set(&mut self, k: &str, _v: &str) -> Result<()> {
        // The engine's options (`reservation`, `kv_codec`) are taken before this.
        Err(unknown(Self::STRATEGY, k))
    }

    fn params_json(&self) -> serde_json::Value {
        serde_json::json!({})
    }

    fn default_reservation(&self) -> Reservation {
        Reservation::Fraction
    }

    fn build(&self, model: &Llama, env: PolicyEnv) -> Result<Box<dyn KvPolicy>> {
        let opts = env.full_options();
        let num_blocks = env.kv_blocks(FullPolicy::block_bytes(&model.cfg, &opts));
        Ok(Box::new(match env.reservation {
            Reservation::Fraction => FullPolicy::new(&model.cfg, opts, num_blocks),
            Reservation::Budget => FullPolicy::on_demand(&model.cfg, opts, num_blocks),
        }))
    }

    #[cfg(feature = "cuda")]
    fn build_cuda(&self, model: &Llama, env: PolicyEnv) -> Result<Box<dyn KvPolicy>> {
        let opts = env.full_options();
        let num_blocks = env.kv_blocks(FullPolicy::block_bytes(&model.cfg, &opts));
        Ok(Box::new(crate::policy::full::cuda::CudaFullPolicy::new(
            model.device(),
            &model.cfg,
            opts,
            num_blocks,
            env.reservation,
        )?))
    }

    fn nominal_attended(&self, _layer: usize, _info: &SeqInfo, n: usize) -> usize {
        n
    }

    fn device_kv_bytes(
        &self,
        cfg: &ModelConfig,
        _info: &SeqInfo,
        n: usize,
        kv: KvCodec,
        _statistic: usize,
    ) -> u64 {
        n as u64 * kv.token_bytes(cfg)
    }

    fn cpu_kv_codec(&self, model: KvCodec, chosen: Option<KvCodec>) -> KvCodec {
        chosen.unwrap_or(model)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FullOptions {
    /// Tokens per block (vLLM default 16).
    pub block_size: usize,
    /// How the pool stores its rows.
    pub kv_codec: KvCodec,
    /// Shuffle the free list (tests: random block tables).
    pub shuffle_seed: Option<u64>,
    /// Prefill attention: `flash` reads the blocks in place (online softmax); `eager`
    /// and `chunked` gather the sequence's K/V and materialize scores.
    pub attention: AttentionImpl,
    pub chunk_size: usize,
}

impl Default for FullOptions {
    fn default() -> Self {
        Self {
            block_size: 16,
            kv_codec: KvCodec::F32,
            shuffle_seed: None,
            attention: AttentionImpl::Flash,
            chunk_size: 512,
        }
    }
}

pub struct FullPolicy {
    shape: AttnShape,
    num_layers: usize,
    store: PagedKv,
    tables: SeqTables,
    stats: PolicyStats,
    opts: FullOptions,
    attended: Vec<AttendRecord>,
    scratch_limit: Option<u64>,
}

impl FullPolicy {
    /// A pool of `num_blocks` allocated up front (vLLM).
    pub fn new(cfg: &ModelConfig, opts: FullOptions, num_blocks: usize) -> Self {
        let tables = SeqTables::new(num_blocks, opts.block_size, opts.shuffle_seed);
        Self::with_tables(cfg, opts, tables)
    }

    /// A pool that grows on demand up to `limit` blocks (`reservation=budget`).
    pub fn on_demand(cfg: &ModelConfig, opts: FullOptions, limit: usize) -> Self {
        Self::with_tables(cfg, opts, SeqTables::on_demand(limit, opts.block_size))
    }

    fn with_tables(cfg: &ModelConfig, opts: FullOptions, tables: SeqTables) -> Self {
        let store = PagedKv::new(
            cfg.num_layers,
            tables.num_blocks(),
            opts.block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            opts.kv_codec,
        );
        Self {
            shape: AttnShape {
                num_heads: cfg.num_heads,
                num_kv_heads: cfg.num_kv_heads,
                head_dim: cfg.head_dim,
                block_size: opts.block_size,
            },
            num_layers: cfg.num_layers,
            store,
            tables,
            stats: PolicyStats::default(),
            opts,
            attended: Vec::new(),
            scratch_limit: None,
        }
    }

    /// Bytes of one block over all layers.
    pub fn block_bytes(cfg: &ModelConfig, opts: &FullOptions) -> u64 {
        PagedKv::block_bytes(
            cfg.num_layers,
            opts.block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            opts.kv_codec,
        )
    }

    pub fn num_blocks(&self) -> usize {
        self.tables.num_blocks()
    }

    pub fn num_free_blocks(&self) -> usize {
        self.tables.num_free()
    }

    /// The block table of a sequence (for tests and traces).
    pub fn table(&self, seq: SeqId) -> Option<&[BlockId]> {
        Some(self.tables.table(seq)).filter(|t| !t.is_empty())
    }

    /// Store the step's new K and V (`[T, Hkv, dh]` f32 rows) of `layer` (the caller
    /// times it as cache operations).
    pub(crate) fn write(&mut self, batch: &StepBatch, layer: usize, kf: &[f32], vf: &[f32]) {
        let stride = self.store.token_stride();
        for s in &batch.seqs {
            let table = self.tables.table(s.id);
            for i in 0..s.q_len {
                let slot = self.store.slot(table, s.ctx_before + i);
                let row = s.q_start + i;
                self.store.write(
                    layer,
                    slot,
                    &kf[row * stride..(row + 1) * stride],
                    &vf[row * stride..(row + 1) * stride],
                );
            }
        }
        if layer + 1 == self.num_layers {
            for s in &batch.seqs {
                self.tables.set_len(s.id, s.ctx_before + s.q_len);
            }
        }
    }

    /// Attention of the step's rows (`qf`: `[T, H, dh]` f32) over the cache, but for the
    /// sequences `skip` picks (left zero for the caller: Quest's selected pages).
    pub(crate) fn attend_seqs(
        &mut self,
        batch: &StepBatch,
        layer: usize,
        qf: &[f32],
        skip: impl Fn(&crate::policy::StepSeq) -> bool,
    ) -> Result<Vec<f32>> {
        let (h, dh) = (self.shape.num_heads, self.shape.head_dim);
        // Prefill chunks under eager/chunked attention: a plain matrix per sequence.
        let materialize = |s: &&crate::policy::StepSeq| {
            s.q_len > 1 && self.opts.attention != AttentionImpl::Flash
        };
        let mut dense_out = Vec::new();
        for s in batch.seqs.iter().filter(materialize).filter(|s| !skip(s)) {
            let n = s.ctx_before + s.q_len;
            let (kc, vc) = self.store.gather(layer, self.tables.table(s.id), n);
            let shape = PrefillShape {
                num_heads: h,
                num_kv_heads: self.shape.num_kv_heads,
                head_dim: dh,
            };
            let rows = &qf[s.q_start * h * dh..(s.q_start + s.q_len) * h * dh];
            let r = prefill_attention(
                rows,
                &kc,
                &vc,
                s.q_len,
                n,
                shape,
                self.opts.attention,
                self.opts.chunk_size,
                None,
                self.scratch_limit,
            )
            .map_err(|e| Error::OutOfMemory {
                device: "device".into(),
                component: Component::Activations,
                requested: e.requested,
                available: e.limit,
                capacity: e.limit,
            })?;
            self.stats.add_scratch(r.scratch_bytes);
            dense_out.push((s.q_start, r.out));
        }
        for s in batch.seqs.iter().filter(|s| s.q_len == 1 && !skip(s)) {
            self.attended
                .push(AttendRecord::whole(s.id, layer, s.ctx_before + 1));
        }
        let views: Vec<SeqAttn<'_>> = batch
            .seqs
            .iter()
            .filter(|s| !materialize(s) && !skip(s))
            .map(|s| SeqAttn {
                q_start: s.q_start,
                q_len: s.q_len,
                kv_len: s.ctx_before + s.q_len,
                table: self.tables.table(s.id),
            })
            .collect();
        let (kv_k, kv_v) = self.store.views(layer);
        let mut out = if views.is_empty() {
            vec![0f32; batch.num_tokens * h * dh]
        } else {
            paged_attention(qf, &views, kv_k, kv_v, self.shape)
        };
        // The kernel sizes its output by the rows it saw.
        out.resize(batch.num_tokens * h * dh, 0.0);
        for (start, o) in dense_out {
            out[start * h * dh..start * h * dh + o.len()].copy_from_slice(&o);
        }
        Ok(out)
    }

    /// How the pool stores its rows.
    pub(crate) fn codec(&self) -> crate::kv::KvCodec {
        self.store.codec()
    }

    /// The paged storage and a sequence's block table (Quest reads selected pages).
    pub(crate) fn kv_of(&self, seq: SeqId) -> (&PagedKv, &[BlockId]) {
        (&self.store, self.tables.table(seq))
    }

    fn token_bytes(&self) -> u64 {
        self.store.bytes_per_block() / self.store.block_size() as u64
    }
}

impl KvPolicy for FullPolicy {
    fn name(&self) -> &'static str {
        "full"
    }

    fn reserve(&mut self, seq: SeqId, total_tokens: usize) -> Result<bool> {
        let ok = self.tables.reserve(seq, total_tokens);
        self.store.ensure_blocks(self.tables.num_blocks());
        Ok(ok)
    }

    fn fits(&self, total_tokens: usize) -> bool {
        self.tables.fits(total_tokens)
    }

    fn set_device_ceiling(&mut self, bytes: u64) -> bool {
        let block = self.store.bytes_per_block().max(1);
        self.tables.set_limit((bytes / block) as usize)
    }

    fn release(&mut self, seq: SeqId) {
        self.tables.release(seq);
    }

    fn attend(&mut self, batch: &StepBatch, input: &LayerInput<'_>) -> Result<Tensor> {
        let t0 = Instant::now();
        let kf = to_f32(input.k)?;
        self.write(batch, input.layer, &kf, &to_f32(input.v)?);
        self.stats.cache_ops_s += t0.elapsed().as_secs_f64();
        let qf = to_f32(input.q)?;
        let out = self.attend_seqs(batch, input.layer, &qf, |_| false)?;
        let (h, dh) = (self.shape.num_heads, self.shape.head_dim);
        Ok(
            Tensor::from_vec(out, (batch.num_tokens, h, dh), input.q.device())?
                .to_dtype(input.q.dtype())?,
        )
    }

    fn takes_rows(&self) -> bool {
        true
    }

    fn attend_rows(
        &mut self,
        batch: &StepBatch,
        layer: usize,
        (q, k, v): (&[f32], &[f32], &[f32]),
    ) -> Result<Vec<f32>> {
        // As `attend`, the same operations on the same rows.
        let t0 = Instant::now();
        self.write(batch, layer, k, v);
        self.stats.cache_ops_s += t0.elapsed().as_secs_f64();
        self.attend_seqs(batch, layer, q, |_| false)
    }

    fn memory(&self) -> PolicyMemory {
        let block_bytes = self.store.bytes_per_block();
        PolicyMemory {
            device_reserved: self.store.bytes(),
            device_used: self.tables.num_used() as u64 * block_bytes,
            host_reserved: 0,
            host_used: 0,
        }
    }

    fn seq_device_bytes(&self, seq: SeqId) -> u64 {
        self.tables.len(seq) as u64 * self.token_bytes()
    }

    fn take_stats(&mut self) -> PolicyStats {
        std::mem::take(&mut self.stats)
    }

    fn take_attended(&mut self) -> Vec<AttendRecord> {
        std::mem::take(&mut self.attended)
    }

    fn set_scratch_limit(&mut self, limit: Option<u64>) {
        self.scratch_limit = limit;
    }

    fn check_invariants(&self) -> std::result::Result<(), String> {
        self.tables.check_invariants()
    }
}
