//! H2O and StreamingLLM on CUDA: the permanent-eviction paradigm with its slots in
//! device memory. As on the CPU ([`crate::policy::evicting`]), slot `i` of (sequence,
//! layer, KV head) holds whichever position that head kept there, so every head of a
//! sequence holds the same number of slots and one block table serves them all; the
//! paged decode and flash prefill kernels of `full` read them unchanged (keys carry
//! their RoPE). Beside K/V each (slot, KV head) has an f32 score and an i32 position.
//! StreamingLLM with rolling positions (its original form) caches keys without RoPE:
//! the decode kernel rotates each key to its index in the cache as it reads it (from
//! the slot's position: the kept set is the sinks and a contiguous window), the query
//! is rotated to the last index, and a prefill chunk rotates its gathered keys to their
//! positions (the indices until the prompt is complete and compacted).
//!
//! Per step and layer: K/V written to the next slots; decode rows attend their slots
//! plus the new token, H2O adds the rows' probabilities (raw scores and log-sum-exp
//! from the decode kernel) to the scores, then one eviction per (row, KV head) on the
//! device moves the last slot into the victim. Prefill rows attend with flash (H2O's
//! exact statistics: a second tiled pass on the tensor cores with the rows'
//! log-sum-exp) or cuBLAS (statistics from the materialized probabilities); when a
//! prompt is complete its heads are compacted to their kept slots. The prefill keep
//! decision runs on the device where the rule is H2O's top scores (`h2o_prefill_keep`),
//! else on the host over the scores copied back once per layer (SnapKV's pooling).
//!
//! The pool (K/V bf16, scores, positions) is allocated once, like `full`'s: memory
//! reports it as reserved and the blocks sequences hold as used.

use crate::attention::prefill::{AttentionImpl, ColumnStats};
use crate::config::ModelConfig;
use crate::cuda::{
    as_i32, device_of, drain_event_seconds, flash_prefill, flash_prefill_contiguous,
    flash_prefill_with, flash_smem_bytes, grow_slice, initial_blocks, join_rows, kv_gather,
    kv_write_at, paged_decode_rolling, paged_decode_with, prefill_attention_stats, rope_last_index,
    upload_i32, DecodeScores, DecodeShape, DecodeTables, FlashKernel, LayerCache, RollingKeys,
    MODULE, PTX,
};
use crate::decode_graphs::{ctx_bucket, GraphBinding, GraphBuffers};
use crate::error::{Error, Result};
use crate::policy::evicting::book::SlotBook;
use crate::policy::evicting::{Counts, Eviction, VictimKind};
use crate::policy::spec::PolicyEnv;
use crate::policy::{
    AttendRecord, KvPolicy, LayerInput, PolicyMemory, PolicyStats, SeqId, SeqInfo, StepBatch,
};
use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
use candle_core::cuda_backend::cudarc::driver::{
    CudaEvent, CudaSlice, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{DType, Tensor};
use std::collections::HashMap;

/// Keys per partition of the decode kernel.
const PART_SIZE: usize = 512;
/// Keys per block of the decode-probability kernel.
const ACCUM_THREADS: usize = 128;
/// Slots staged per round of the compaction kernel (`COMPACT_CHUNK` in kernels.cu).
const COMPACT_CHUNK: usize = 32;

/// One layer's slots: K/V, and a score and a position per (slot, KV head).
pub struct SlotLayer {
    pub kv: LayerCache,
    pub score: CudaSlice<f32>,
    pub pos: CudaSlice<i32>,
    pub num_kv_heads: usize,
}

impl SlotLayer {
    pub fn new(
        dev: &CudaDevice,
        slots: usize,
        num_kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        Ok(Self {
            kv: LayerCache::new(dev, slots, num_kv_heads * head_dim)?,
            score: dev.alloc_zeros::<f32>(slots * num_kv_heads)?,
            pos: dev.alloc_zeros::<i32>(slots * num_kv_heads)?,
            num_kv_heads,
        })
    }

    /// Grow to `slots` slots, keeping what they hold (a pool grown on demand).
    pub fn grow(&mut self, dev: &CudaDevice, slots: usize, head_dim: usize) -> Result<()> {
        let kvh = self.num_kv_heads;
        self.kv.grow(dev, slots, kvh * head_dim)?;
        grow_slice(dev, &mut self.score, slots * kvh)?;
        grow_slice(dev, &mut self.pos, slots * kvh)
    }
}

/// What the layers of one step share on the device, built at its first layer.
struct StepDecode {
    /// Slots and positions of the step's new K/V, one per row.
    write_slots: CudaSlice<i32>,
    write_pos: CudaSlice<i32>,
    /// Indices into the batch's sequences.
    rows: Vec<usize>,
    /// Slots each row attends (its kept tokens and the new one).
    kept: Vec<usize>,
    tables: DecodeTables,
    /// Per row: slots m (with the new token), context n, capacity, recent.
    params: CudaSlice<i32>,
    /// Whether any row evicts this step.
    evicts: bool,
    /// Whether the decode probabilities are accumulated this step.
    probs: bool,
    lse: CudaSlice<f32>,
    raw: CudaSlice<f32>,
    stride: usize,
}

/// Fixed step buffers for `rows` decode rows of `heads` query heads attending up to
/// `bucket` slots in blocks of `block_size`.
fn graph_step_buffers(
    dev: &CudaDevice,
    heads: usize,
    block_size: usize,
    rows: usize,
    bucket: usize,
    probs: bool,
) -> Result<StepDecode> {
    let n = rows.max(1);
    Ok(StepDecode {
        write_slots: dev.alloc_zeros::<i32>(n)?,
        write_pos: dev.alloc_zeros::<i32>(n)?,
        tables: DecodeTables::fixed(dev, rows, bucket.div_ceil(block_size), bucket)?,
        params: dev.alloc_zeros::<i32>(4 * n)?,
        evicts: false,
        probs,
        lse: dev.alloc_zeros::<f32>(n * heads)?,
        raw: dev.alloc_zeros::<f32>(if probs { n * heads * bucket } else { 1 })?,
        stride: bucket,
        kept: Vec::new(),
        rows: Vec::new(),
    })
}

pub struct CudaEvictingPolicy<E: Eviction> {
    rule: E,
    dev: CudaDevice,
    /// H, KVH, D.
    heads: (usize, usize, usize),
    attention: AttentionImpl,
    chunk_size: usize,
    block_size: usize,
    device_name: String,
    layers: Vec<SlotLayer>,
    /// Sequences, block tables and the pool (shared with the CPU policy).
    book: SlotBook,
    /// Blocks the device buffers hold: the whole pool under `fraction`; under `budget`
    /// what the pool grew to by the last step (grown at the next step's first layer).
    alloc_blocks: usize,
    stats: PolicyStats,
    attended: Vec<AttendRecord>,
    scratch_limit: Option<u64>,
    /// Start and end of each cache operation of the current step (device timeline).
    events: Vec<(CudaEvent, CudaEvent)>,
    event_errors: u64,
    step: Option<StepDecode>,
    /// Rotation rows cos, sin (`[indices, D/2]`) of cache indices for rolling
    /// positions, and how many indices they cover.
    rope: Option<(CudaSlice<f32>, CudaSlice<f32>, usize)>,
    /// Rotation rows outgrown, kept: a CUDA graph captured before they grew still reads
    /// them (their rows are the new ones' first rows).
    rope_retired: Vec<(CudaSlice<f32>, CudaSlice<f32>)>,
    /// SnapKV: the observation window's queries of sequences in prefill, per layer.
    window_q: HashMap<SeqId, Vec<Vec<Tensor>>>,
    /// Fixed step buffers of decode steps replayed from CUDA graphs, by (rows, context
    /// bucket, variant), and the epoch of what the graphs read; a bound step's buffers
    /// are `step` until `end_step`.
    graph_steps: GraphBuffers<GraphStepKey, StepDecode>,
    bound: Option<GraphStepKey>,
    /// The host values of this step made by `plan_graph_step`, taken by the step's
    /// bind or, when it runs launched, its first layer (cleared at the step's end).
    graph_plan: Option<StepValues>,
}

type GraphStepKey = (usize, usize, u8);

/// The context bucket and variant of a graph step planned as `v`.
fn graph_shape(v: &StepValues) -> (usize, u8) {
    let bucket = ctx_bucket(v.kept.iter().copied().max().unwrap_or(1));
    (bucket, u8::from(v.evicts) | (u8::from(v.probs) << 1))
}

/// A step's plan on the host, before it is put on the device.
struct StepValues {
    slots: Vec<i32>,
    positions: Vec<i32>,
    rows: Vec<usize>,
    tables: Vec<Vec<i32>>,
    kept: Vec<usize>,
    params: Vec<i32>,
    evicts: bool,
    probs: bool,
}

impl<E: Eviction> CudaEvictingPolicy<E> {
    /// Bytes of one slot over all layers (K and V in bf16, score and position).
    pub fn slot_bytes(cfg: &ModelConfig) -> u64 {
        (cfg.num_layers * cfg.num_kv_heads * (4 * cfg.head_dim + 8)) as u64
    }

    pub fn new(
        rule: E,
        dev: &candle_core::Device,
        cfg: &ModelConfig,
        env: PolicyEnv,
    ) -> Result<Self> {
        if rule.rolling_positions() && cfg.rope_interleaved {
            return Err(Error::Config(format!(
                "`{}` with rolling positions rotates cached keys in the decode kernel, which \
                 pairs dimension i with i + D/2; {} pairs adjacent dimensions: set \
                 rolling_positions=false or run it with --device cpu",
                rule.name(),
                cfg.name
            )));
        }
        let dev = device_of(dev)?;
        let book = SlotBook::new(&env, Self::slot_bytes(cfg));
        let bs = env.block_size;
        let alloc_blocks = initial_blocks(env.reservation, book.num_blocks());
        let slots = alloc_blocks * bs;
        let layers = (0..cfg.num_layers)
            .map(|_| SlotLayer::new(&dev, slots, cfg.num_kv_heads, cfg.head_dim))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            rule,
            dev,
            heads: (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
            attention: env.attention,
            chunk_size: env.chunk_size,
            block_size: bs,
            device_name: env.device_name,
            layers,
            book,
            alloc_blocks,
            stats: PolicyStats::default(),
            attended: Vec::new(),
            scratch_limit: None,
            events: Vec::new(),
            event_errors: 0,
            step: None,
            rope: None,
            rope_retired: Vec::new(),
            window_q: HashMap::new(),
            graph_steps: GraphBuffers::default(),
            bound: None,
            graph_plan: None,
        })
    }

    /// Whether `batch` is a step a graph can run: every row decoding one token of a
    /// prompt already prefilled (rolling positions too: the query is rotated on the
    /// device, to an index the step's parameters hold); prefill rows and rows finishing
    /// their prompt run as usual.
    fn graph_step(&self, batch: &StepBatch) -> bool {
        !batch.seqs.is_empty()
            && batch
                .seqs
                .iter()
                .all(|s| s.q_len == 1 && self.book.prefilled(s.id))
    }

    /// [`Self::grow_device`] for a graph step: graphs that baked in the old buffers
    /// are stale (a new epoch).
    fn grow_for_graphs(&mut self) -> Result<()> {
        let before = self.alloc_blocks;
        self.grow_device()?;
        if self.alloc_blocks != before {
            self.graph_steps.moved();
        }
        Ok(())
    }

    /// Grow the device buffers to the blocks the pool handed out (`budget`).
    fn grow_device(&mut self) -> Result<()> {
        let n = self.book.num_blocks();
        if n > self.alloc_blocks {
            let slots = n * self.block_size;
            for l in &mut self.layers {
                l.grow(&self.dev, slots, self.heads.2)?;
            }
            self.alloc_blocks = n;
        }
        Ok(())
    }

    fn phys(&self, seq: SeqId, slot: usize) -> i32 {
        self.book.phys(seq, slot) as i32
    }

    fn table_i32(&self, seq: SeqId) -> Vec<i32> {
        self.book.table(seq).iter().map(|&b| b as i32).collect()
    }

    fn begin(&self) -> Result<CudaEvent> {
        Ok(self
            .dev
            .cuda_stream()
            .record_event(Some(CU_EVENT_DEFAULT))
            .w()?)
    }

    fn end(&mut self, start: CudaEvent) -> Result<()> {
        let end = self.begin()?;
        self.events.push((start, end));
        Ok(())
    }

    /// What every layer of the step shares, uploaded once: the slots and positions of
    /// the new K/V, and the decode rows' block tables, eviction parameters and
    /// probability buffers.
    fn step_plan(&mut self, batch: &StepBatch) -> Result<StepDecode> {
        let h = self.heads.0;
        let v = self.planned_values(batch)?;
        let stride = v.kept.iter().copied().max().unwrap_or(1).max(1);
        let n = v.rows.len().max(1);
        Ok(StepDecode {
            write_slots: upload_i32(&self.dev, &v.slots)?,
            write_pos: upload_i32(&self.dev, &v.positions)?,
            tables: DecodeTables::new(&self.dev, &v.tables, &v.kept)?,
            params: upload_i32(&self.dev, &v.params)?,
            evicts: v.evicts,
            probs: v.probs,
            lse: self.dev.alloc_zeros::<f32>(n * h)?,
            raw: self
                .dev
                .alloc_zeros::<f32>(if v.probs { n * h * stride } else { 1 })?,
            stride,
            kept: v.kept,
            rows: v.rows,
        })
    }

    /// This step's host values: those `plan_graph_step` computed for it when it did
    /// (the book has not moved since), else computed now.
    fn planned_values(&mut self, batch: &StepBatch) -> Result<StepValues> {
        match self.graph_plan.take() {
            Some(v) => Ok(v),
            None => self.step_values(batch),
        }
    }

    /// [`Self::step_plan`]'s values on the host.
    fn step_values(&self, batch: &StepBatch) -> Result<StepValues> {
        let mut slots = Vec::with_capacity(batch.num_tokens);
        let mut positions = Vec::with_capacity(batch.num_tokens);
        for s in &batch.seqs {
            let first = self.book.first_write_slot(s.id, s.ctx_before);
            for i in 0..s.q_len {
                slots.push(self.phys(s.id, first + i));
                positions.push(as_i32(s.ctx_before + i, "position")?);
            }
        }
        let rows: Vec<usize> = (0..batch.seqs.len())
            .filter(|&i| self.book.prefilled(batch.seqs[i].id))
            .collect();
        let mut tables = Vec::with_capacity(rows.len());
        let mut ctx = Vec::with_capacity(rows.len());
        let mut params = Vec::with_capacity(rows.len() * 4);
        let (mut evicts, mut counted) = (false, false);
        for &i in &rows {
            let s = batch.seqs[i];
            let m = self.book.len(s.id) + 1;
            tables.push(self.table_i32(s.id));
            ctx.push(m);
            let st = self.book.state(s.id);
            let (cap, rec) = match st.counts {
                Some(c) => {
                    counted = true;
                    // SnapKV's capacity grows with every decoded token.
                    let cap = self.rule.capacity_at(c, &st.info, s.ctx_before + 1);
                    evicts |= m > cap;
                    (cap, c.recent)
                }
                None => (usize::MAX >> 33, 0),
            };
            params.extend([
                as_i32(m, "slots")?,
                as_i32(s.ctx_before + 1, "context")?,
                as_i32(cap, "capacity")?,
                as_i32(rec, "recent window")?,
            ]);
        }
        let probs = counted && self.rule.decode_probs();
        Ok(StepValues {
            slots,
            positions,
            rows,
            tables,
            kept: ctx,
            params,
            evicts,
            probs,
        })
    }

    /// The step's new K/V into its next slots of `layer`, with their positions (until a
    /// prompt is complete) and zero scores: `tokens` rows of the planned step.
    fn write_new(&mut self, layer: usize, k: &Tensor, v: &Tensor, tokens: usize) -> Result<()> {
        let step = self
            .step
            .as_ref()
            .ok_or_else(|| Error::Config("a step's K/V written before its plan".into()))?;
        let sl = &mut self.layers[layer];
        kv_write_at(&mut sl.kv, k, v, &step.write_slots)?;
        slot_meta_init(&self.dev, sl, &step.write_slots, &step.write_pos, tokens)
    }

    /// An out-of-memory error from a kernel wrapper with this policy's device name.
    fn named_oom(&self, e: Error) -> Error {
        match e {
            Error::OutOfMemory {
                requested,
                available,
                capacity,
                component,
                ..
            } => Error::OutOfMemory {
                device: self.device_name.clone(),
                component,
                requested,
                available,
                capacity,
            },
            other => other,
        }
    }

    /// The budget audit's record of each decode row's keys.
    fn decoded(&mut self, layer: usize, batch: &StepBatch, step: &StepDecode) {
        for &i in &step.rows {
            let s = batch.seqs[i];
            self.attended.push(AttendRecord {
                seq: s.id,
                layer,
                attended: self.book.len(s.id) + 1,
                context: s.ctx_before + 1,
            });
        }
    }

    /// Rotation rows of cache indices `0..m` on the device (rolling positions), built
    /// by the model's RoPE on the host as the CPU policy's, grown by powers of two (the
    /// outgrown rows kept for graphs that read them).
    fn rope_rows(&mut self, rope: &dyn crate::policy::Rope, m: usize) -> Result<()> {
        if self.rope.as_ref().is_some_and(|r| r.2 >= m) {
            return Ok(());
        }
        let idx: Vec<u32> = (0..m.next_power_of_two() as u32).collect();
        let (c, s) = rope.tables(&idx);
        let stream = self.dev.cuda_stream();
        let grown = (
            stream.clone_htod(&c).w()?,
            stream.clone_htod(&s).w()?,
            idx.len(),
        );
        if let Some((c, s, _)) = self.rope.replace(grown) {
            self.rope_retired.push((c, s));
        }
        Ok(())
    }

    /// Decode rows: attention over their slots and the new token, H2O's probabilities
    /// into the scores, one eviction per (row, KV head). Returns `[R, H, D]`.
    fn decode(
        &mut self,
        layer: usize,
        q: &Tensor,
        batch: &StepBatch,
        input: &LayerInput<'_>,
    ) -> Result<Option<Tensor>> {
        let (h, kvh, d) = self.heads;
        let Some(step) = self.step.take() else {
            return Ok(None);
        };
        if step.rows.is_empty() {
            self.step = Some(step);
            return Ok(None);
        }
        let mut step = step;
        let idx: Vec<u32> = step
            .rows
            .iter()
            .map(|&i| batch.seqs[i].q_start as u32)
            .collect();
        let qd = if step.rows.len() == batch.num_tokens {
            q.clone()
        } else {
            q.index_select(&Tensor::new(idx.as_slice(), q.device())?, 0)?
        };
        let shape = DecodeShape {
            num_heads: h,
            num_kv_heads: kvh,
            head_dim: d,
            block_size: self.block_size,
            part_size: PART_SIZE,
        };
        let out = if self.rule.rolling_positions() {
            // The query at its cache's last index (from the step's parameters, on the
            // device); the kernel rotates each key to its. A graph's replays may reach
            // any index of its context bucket: the rows cover the bucket.
            let most = match self.bound {
                Some((_, bucket, _)) => bucket,
                None => step.kept.iter().copied().max().unwrap_or(1),
            };
            self.rope_rows(input.rope, most)?;
            let (cos, sin, _) = self.rope.as_ref().expect("built above");
            let raw = input.q_raw.to_dtype(DType::BF16)?;
            let raw = if step.rows.len() == batch.num_tokens {
                raw
            } else {
                raw.index_select(&Tensor::new(idx.as_slice(), q.device())?, 0)?
            };
            let qr = rope_last_index(&raw, &step.params, cos, sin)?;
            let roll = RollingKeys {
                pos: &self.layers[layer].pos,
                params: &step.params,
                cos,
                sin,
            };
            paged_decode_rolling(&self.layers[layer].kv, &qr, &step.tables, shape, roll)?
        } else if step.probs {
            let scores = DecodeScores {
                lse: &mut step.lse,
                raw: &mut step.raw,
                stride: step.stride,
            };
            paged_decode_with(
                &self.layers[layer].kv,
                &qd,
                &step.tables,
                shape,
                Some(scores),
            )?
        } else {
            paged_decode_with(&self.layers[layer].kv, &qd, &step.tables, shape, None)?
        };
        // A graph step's records were made when it was bound; nothing is timed inside
        // a capture.
        let bound = self.bound.is_some();
        if !bound {
            self.decoded(layer, batch, &step);
        }
        if step.probs || step.evicts {
            let start = if bound { None } else { Some(self.begin()?) };
            let sl = &mut self.layers[layer];
            if step.probs {
                let scores = DecodeScores {
                    lse: &mut step.lse,
                    raw: &mut step.raw,
                    stride: step.stride,
                };
                decode_scores_accum(
                    &self.dev,
                    sl,
                    &scores,
                    &step.tables,
                    h / kvh,
                    self.block_size,
                )?;
            }
            if step.evicts {
                let mode = self.rule.victim_kind();
                evict(
                    &self.dev,
                    sl,
                    &step.tables,
                    &step.params,
                    d,
                    self.block_size,
                    mode,
                )?;
            }
            if let Some(start) = start {
                self.end(start)?;
            }
        }
        self.step = Some(step);
        Ok(Some(out))
    }

    /// A complete prompt of `n` tokens over its capacity: each KV head keeps the
    /// rule's slots, decided on the host from the scores, moved to slots `0..C`.
    fn compact(
        &mut self,
        layer: usize,
        seq: SeqId,
        n: usize,
        c: Counts,
        table: &CudaSlice<i32>,
    ) -> Result<()> {
        let (_, kvh, d) = self.heads;
        let bs = self.block_size;
        let scores = scores_gather(&self.dev, &self.layers[layer], table, n, kvh, bs)?;
        let keep = if self.rule.keeps_top_scores() {
            h2o_prefill_keep(&self.dev, &scores, n, c, kvh)?
        } else {
            let host = self.dev.cuda_stream().clone_dtoh(&scores).w()?;
            let mut keep = Vec::with_capacity(kvh * c.capacity);
            for g in 0..kvh {
                let k = self.rule.prefill_keep(c, n, &host[g * n..(g + 1) * n]);
                if k.len() != c.capacity {
                    return Err(Error::Config(format!(
                        "sequence {seq}: `{}` kept {} of {n} tokens for capacity {}",
                        self.rule.name(),
                        k.len(),
                        c.capacity
                    )));
                }
                keep.extend(k.into_iter().map(|x| x as i32));
            }
            upload_i32(&self.dev, &keep)?
        };
        compact_slots(
            &self.dev,
            &mut self.layers[layer],
            table,
            &keep,
            c.capacity,
            kvh,
            d,
            bs,
        )
    }

    /// One prefill chunk of `s`: attention over its first `n` slots (= positions),
    /// the rule's column statistics, and the compaction once the prompt is complete.
    fn prefill(
        &mut self,
        layer: usize,
        s: crate::policy::StepSeq,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        rope: &dyn crate::policy::Rope,
    ) -> Result<Tensor> {
        let (h, kvh, d) = self.heads;
        let st = self.book.state(s.id);
        let n = s.ctx_before + s.q_len;
        let stats = st
            .counts
            .and_then(|_| self.rule.prefill_stats(self.attention));
        let table = self.table_i32(s.id);
        let table_d = upload_i32(&self.dev, &table)?;
        let qs = q.narrow(0, s.q_start, s.q_len)?;
        let out = if self.rule.rolling_positions() {
            // Keys are cached without RoPE; until the prompt is complete slots are
            // positions, which are also the cache indices they rotate to.
            let (kk, vv) = kv_gather(
                &self.dev,
                &self.layers[layer].kv,
                &table,
                n,
                self.block_size,
                kvh,
                d,
            )?;
            let positions: Vec<u32> = (0..n as u32).collect();
            let kk = rope.rotate(&kk, &positions)?.to_dtype(DType::BF16)?;
            let gathered = (2 * n * kvh * d * 2) as u64;
            if self.attention == AttentionImpl::Flash {
                let (o, scratch) = flash_prefill_contiguous(&qs, &kk, &vv, s.ctx_before)?;
                self.stats.add_scratch(scratch + gathered);
                o
            } else {
                let chunk = match self.attention {
                    AttentionImpl::Eager => usize::MAX,
                    _ => self.chunk_size,
                };
                let (o, scratch, _) = prefill_attention_stats(
                    &qs,
                    &kk,
                    &vv,
                    s.ctx_before,
                    chunk,
                    self.scratch_limit,
                    None,
                )
                .map_err(|e| self.named_oom(e))?;
                self.stats.add_scratch(scratch + gathered);
                o
            }
        } else if self.attention == AttentionImpl::Flash {
            match stats {
                None => flash_prefill(
                    &self.layers[layer].kv,
                    &qs,
                    &table,
                    s.ctx_before,
                    kvh,
                    self.block_size,
                )?,
                Some(ColumnStats::Exact) => {
                    // The statistics pass follows the attention pass's design.
                    let kernel = FlashKernel::chosen_for(qs.dims3()?.2)?;
                    let mut lse = self.dev.alloc_zeros::<f32>(s.q_len * h)?;
                    let o = flash_prefill_with(
                        &self.layers[layer].kv,
                        &qs,
                        &table,
                        s.ctx_before,
                        kvh,
                        self.block_size,
                        Some(&mut lse),
                        kernel,
                    )?;
                    let start = self.begin()?;
                    let sl = &mut self.layers[layer];
                    colsum(
                        &self.dev,
                        sl,
                        &qs,
                        &lse,
                        &table_d,
                        s.ctx_before,
                        kvh,
                        self.block_size,
                        kernel,
                    )?;
                    self.end(start)?;
                    o
                }
                Some(other) => {
                    return Err(Error::Config(format!(
                        "`{}` with {other} statistics needs the probabilities materialized: \
                         on CUDA run it with --attention eager or chunked, or use exact \
                         statistics with flash",
                        self.rule.name()
                    )))
                }
            }
        } else {
            let chunk = match self.attention {
                AttentionImpl::Eager => usize::MAX,
                _ => self.chunk_size,
            };
            let (kk, vv) = if s.ctx_before == 0 {
                (
                    k.narrow(0, s.q_start, s.q_len)?,
                    v.narrow(0, s.q_start, s.q_len)?,
                )
            } else {
                kv_gather(
                    &self.dev,
                    &self.layers[layer].kv,
                    &table,
                    n,
                    self.block_size,
                    kvh,
                    d,
                )?
            };
            let (o, scratch, col) = prefill_attention_stats(
                &qs,
                &kk,
                &vv,
                s.ctx_before,
                chunk,
                self.scratch_limit,
                stats,
            )
            .map_err(|e| self.named_oom(e))?;
            self.stats.add_scratch(scratch);
            if let Some(col) = col {
                let start = self.begin()?;
                add_columns(
                    &self.dev,
                    &mut self.layers[layer],
                    &col,
                    &table_d,
                    self.block_size,
                )?;
                self.end(start)?;
            }
            o
        };
        // SnapKV: the window's queries are held through the prefill and vote when
        // it ends (tensor operations on the device; scores added to the slots).
        let w = self.rule.observation_window();
        let plen = st.info.prefill_len;
        if w > 0 && st.counts.is_some_and(|c| plen > c.capacity) {
            let first = plen.saturating_sub(w);
            let lo = first.max(s.ctx_before);
            let layers = self.layers.len();
            let held = self
                .window_q
                .entry(s.id)
                .or_insert_with(|| vec![Vec::new(); layers]);
            if lo < n {
                held[layer].push(qs.narrow(0, lo - s.ctx_before, n - lo)?);
            }
            if n == plen {
                let wq = Tensor::cat(&std::mem::take(&mut held[layer]), 0)?;
                if layer + 1 == layers {
                    self.window_q.remove(&s.id);
                }
                let (kk, _) = kv_gather(
                    &self.dev,
                    &self.layers[layer].kv,
                    &table,
                    n,
                    self.block_size,
                    kvh,
                    d,
                )?;
                let start = self.begin()?;
                let col = crate::policy::evicting::snapkv::window_votes(&wq, first, &kk)?;
                self.stats.add_scratch((2 * w.min(plen) * h * n * 4) as u64);
                add_columns(
                    &self.dev,
                    &mut self.layers[layer],
                    &col,
                    &table_d,
                    self.block_size,
                )?;
                self.end(start)?;
            }
        }
        if n >= st.info.prefill_len {
            if let Some(c) = st.counts.filter(|c| n > c.capacity) {
                let start = self.begin()?;
                self.compact(layer, s.id, n, c, &table_d)?;
                self.end(start)?;
            }
        }
        Ok(out)
    }
}

impl<E: Eviction> KvPolicy for CudaEvictingPolicy<E> {
    fn name(&self) -> &'static str {
        self.rule.name()
    }

    fn admit(&mut self, seq: SeqId, info: SeqInfo) -> Result<()> {
        self.book.admit(&self.rule, seq, info);
        self.window_q.remove(&seq);
        Ok(())
    }

    fn prepare(&mut self, held: &[SeqInfo]) -> Result<()> {
        // A pool reserved on demand grows to the batch's peak before the timed steps
        // (device buffers included), not inside them.
        self.book.prepare(&self.rule, held);
        self.grow_device()
    }

    fn set_scratch_limit(&mut self, limit: Option<u64>) {
        self.scratch_limit = limit;
    }

    fn reserve(&mut self, seq: SeqId, total_tokens: usize) -> Result<bool> {
        Ok(self.book.reserve(seq, total_tokens))
    }

    fn fits(&self, total_tokens: usize) -> bool {
        self.book.fits(total_tokens)
    }

    fn set_device_ceiling(&mut self, bytes: u64) -> bool {
        self.book.set_device_ceiling(bytes)
    }

    fn release(&mut self, seq: SeqId) {
        self.book.release(seq);
        self.window_q.remove(&seq);
    }

    fn attend(&mut self, batch: &StepBatch, input: &LayerInput<'_>) -> Result<Tensor> {
        let layer = input.layer;
        let q = input.q.to_dtype(DType::BF16)?;
        // Rolling positions cache keys without RoPE (rotated as they are read).
        let k = if self.rule.rolling_positions() {
            input.k_raw
        } else {
            input.k
        }
        .to_dtype(DType::BF16)?;
        let v = input.v.to_dtype(DType::BF16)?;

        if self.bound.is_some() {
            // A graph step: every row decodes, its plan is bound, nothing recorded.
            self.write_new(layer, &k, &v, batch.num_tokens)?;
            let out = self
                .decode(layer, &q, batch, input)?
                .ok_or_else(|| Error::Config("graph step without decode rows".into()))?;
            return Ok(out.to_dtype(input.q.dtype())?);
        }
        if layer == 0 || self.step.is_none() {
            self.grow_device()?;
            self.step = Some(self.step_plan(batch)?);
        }
        let start = self.begin()?;
        self.write_new(layer, &k, &v, batch.num_tokens)?;
        self.end(start)?;

        let dec_out = self.decode(layer, &q, batch, input)?;
        let decode: Vec<bool> = batch
            .seqs
            .iter()
            .map(|s| self.book.prefilled(s.id))
            .collect();
        let out = join_rows(batch, &decode, dec_out.as_ref(), |s| {
            self.prefill(layer, s, &q, &k, &v, input.rope)
        })?;

        if layer + 1 == self.layers.len() {
            for s in &batch.seqs {
                self.book.end_step(&self.rule, s.id, s.ctx_before + s.q_len);
            }
        }
        Ok(out.to_dtype(input.q.dtype())?)
    }

    fn end_step(&mut self, _batch: &StepBatch) -> Result<()> {
        self.graph_plan = None;
        let step = self.step.take();
        // A graph step's buffers go back to their key: its graph reads them again.
        if let (Some(key), Some(step)) = (self.bound.take(), step) {
            self.graph_steps.put(key, step);
        }
        Ok(())
    }

    fn plan_graph_step(&mut self, batch: &StepBatch) -> Result<Option<GraphBinding>> {
        self.graph_plan = None;
        if !self.graph_step(batch) {
            return Ok(None);
        }
        self.grow_for_graphs()?;
        let v = self.step_values(batch)?;
        let (bucket, variant) = graph_shape(&v);
        self.graph_plan = Some(v);
        Ok(Some(GraphBinding {
            epoch: self.graph_steps.epoch(),
            ctx_bucket: bucket,
            variant,
        }))
    }

    fn bind_graph_step(&mut self, batch: &StepBatch) -> Result<Option<GraphBinding>> {
        if !self.graph_step(batch) {
            return Ok(None);
        }
        self.grow_for_graphs()?;
        let v = self.planned_values(batch)?;
        let rows = v.rows.len();
        let (bucket, variant) = graph_shape(&v);
        let key = (rows, bucket, variant);
        let (dev, heads, bs) = (&self.dev, self.heads.0, self.block_size);
        self.graph_steps.get_or_make(key, || {
            graph_step_buffers(dev, heads, bs, rows, bucket, v.probs)
        })?;
        // Out for the step; `end_step` gives it back.
        let mut step = self.graph_steps.take(&key).expect("made above");
        let stream = self.dev.cuda_stream();
        stream.memcpy_htod(&v.slots, &mut step.write_slots).w()?;
        stream.memcpy_htod(&v.positions, &mut step.write_pos).w()?;
        stream.memcpy_htod(&v.params, &mut step.params).w()?;
        step.tables
            .write(&self.dev, &v.tables, &v.kept, self.block_size)?;
        // As a planned step's: probabilities start from zero.
        stream.memset_zeros(&mut step.lse).w()?;
        stream.memset_zeros(&mut step.raw).w()?;
        step.evicts = v.evicts;
        step.rows = v.rows;
        step.kept = v.kept;
        // What `attend` records over the layers and does after the last one.
        for layer in 0..self.layers.len() {
            self.decoded(layer, batch, &step);
        }
        for s in &batch.seqs {
            self.book.end_step(&self.rule, s.id, s.ctx_before + s.q_len);
        }
        self.step = Some(step);
        self.bound = Some(key);
        Ok(Some(GraphBinding {
            epoch: self.graph_steps.epoch(),
            ctx_bucket: bucket,
            variant,
        }))
    }

    fn memory(&self) -> PolicyMemory {
        // The buffers as allocated, or as they grow at the next step's first layer.
        self.book.memory(self.alloc_blocks)
    }

    fn seq_device_bytes(&self, seq: SeqId) -> u64 {
        self.book.seq_device_bytes(seq)
    }

    fn take_stats(&mut self) -> PolicyStats {
        // The step's logits were read back, so its events have completed.
        self.stats.cache_ops_s += drain_event_seconds(&mut self.events, &mut self.event_errors);
        std::mem::take(&mut self.stats)
    }

    fn take_attended(&mut self) -> Vec<AttendRecord> {
        std::mem::take(&mut self.attended)
    }

    /// Kept positions in slot order (copies the layer's positions back: tests only).
    fn kept_positions(&self, seq: SeqId, layer: usize, g: usize) -> Option<Vec<u32>> {
        if !self.book.holds(seq) {
            return None;
        }
        let kvh = self.heads.1;
        let all = self
            .dev
            .cuda_stream()
            .clone_dtoh(&self.layers[layer].pos)
            .ok()?;
        Some(
            (0..self.book.len(seq))
                .map(|i| all[self.phys(seq, i) as usize * kvh + g] as u32)
                .collect(),
        )
    }

    /// Positions stay on the device: the recent window is checked on the CPU policy.
    fn check_invariants(&self) -> std::result::Result<(), String> {
        self.book.check_invariants(&self.rule, None)
    }
}

/// Which form of the `mma.sync` exact-statistics kernel `KVBENCH_H2O_STATS` asks for:
/// unset, 128 keys a block over 8 warps with the mask skipped off the diagonal; `mma64`,
/// the form of earlier builds (64 keys over 4 warps, every tile masked), a fallback
/// should the default fail on a card and its "before" in one sitting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatsChoice {
    Default,
    Keys64,
}

/// [`StatsChoice`] from the environment, read once per process; any other value is an
/// error naming it.
pub fn stats_choice() -> Result<StatsChoice> {
    static CHOICE: std::sync::OnceLock<std::result::Result<StatsChoice, String>> =
        std::sync::OnceLock::new();
    crate::switch_once(
        &CHOICE,
        "KVBENCH_H2O_STATS",
        &[("mma64", StatsChoice::Keys64)],
        StatsChoice::Default,
        "128 keys a block",
    )
}

/// Column statistics of one prefill chunk, second pass: `q` `[T, H, D]` at positions
/// `ctx_before..` with its rows' log-sum-exp `lse` `[T, H]`; the sum over rows and each
/// group's heads of the probabilities is added to the scores of keys `0..ctx_before+T`,
/// on the kernel of the given flash design (that of the pass that computed `lse`).
#[allow(clippy::too_many_arguments)]
pub fn colsum(
    dev: &CudaDevice,
    sl: &mut SlotLayer,
    q: &Tensor,
    lse: &CudaSlice<f32>,
    table: &CudaSlice<i32>,
    ctx_before: usize,
    num_kv_heads: usize,
    block_size: usize,
    kernel: FlashKernel,
) -> Result<()> {
    let (t, h, d) = q.dims3()?;
    let kernel = kernel.stats();
    let keys64 = stats_choice()? == StatsChoice::Keys64;
    let name = match (kernel, d) {
        (FlashKernel::Mma, 64) if keys64 => "attn_colsum_mma64_d64_bf16",
        (FlashKernel::Mma, 128) if keys64 => "attn_colsum_mma64_d128_bf16",
        (FlashKernel::Mma, 64) => "attn_colsum_mma_d64_bf16",
        (FlashKernel::Mma, 128) => "attn_colsum_mma_d128_bf16",
        (FlashKernel::Wmma, 64) => "attn_colsum_d64_bf16",
        (FlashKernel::Wmma, 128) => "attn_colsum_d128_bf16",
        _ => {
            return Err(Error::Config(format!(
                "exact H2O statistics have kernels for head dims 64 and 128, not {d}: use \
                 --attention eager or chunked"
            )))
        }
    };
    let q = q.contiguous()?;
    let (qs, ql) = q.storage_and_layout();
    let qv = crate::cuda::view(&qs, ql, "attn_colsum q")?;
    // Keys per block and threads (the mma kernel's WARPS in kernels.cu: 8 warps of 16
    // keys, 4 in its earlier form; the WMMA one has 4 warps over 64 keys).
    let (keys, threads, smem) = match kernel {
        // The block's keys, then two query tiles of 64 rows, D + 8 bf16 a row, and two
        // tiles' lse.
        FlashKernel::Mma | FlashKernel::Fa2 | FlashKernel::Fa3 => {
            let keys = if keys64 { 64 } else { 128 };
            (
                keys,
                2 * keys as u32,
                (keys + 2 * 64) * (d + 8) * 2 + 2 * 64 * 4,
            )
        }
        FlashKernel::Wmma => (64, 128, flash_smem_bytes(d)),
    };
    let f = dev.get_or_load_custom_func(name, MODULE, PTX)?;
    f.set_attribute(
        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem as i32,
    )
    .w()?;
    let (t_i, cb_i) = (as_i32(t, "rows")?, as_i32(ctx_before, "context")?);
    let (h_i, kvh_i, bs_i) = (
        as_i32(h, "heads")?,
        as_i32(num_kv_heads, "KV heads")?,
        as_i32(block_size, "block size")?,
    );
    let scale = 1.0f32 / (d as f32).sqrt();
    let mut b = f.builder();
    b.arg(&qv)
        .arg(&sl.kv.k)
        .arg(table)
        .arg(lse)
        .arg(&mut sl.score)
        .arg(&t_i)
        .arg(&cb_i)
        .arg(&h_i)
        .arg(&kvh_i)
        .arg(&bs_i)
        .arg(&scale);
    let cfg = LaunchConfig {
        grid_dim: (
            (ctx_before + t).div_ceil(keys) as u32,
            num_kv_heads as u32,
            1,
        ),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// Column sums `[KVH, n]` (f32) added to the scores of a sequence's first `n` slots.
pub fn add_columns(
    dev: &CudaDevice,
    sl: &mut SlotLayer,
    col: &Tensor,
    table: &CudaSlice<i32>,
    block_size: usize,
) -> Result<()> {
    let (kvh, n) = col.dims2()?;
    let col = col.to_dtype(DType::F32)?.contiguous()?;
    let (cs, cl) = col.storage_and_layout();
    let candle_core::Storage::Cuda(c) = &*cs else {
        return Err(Error::Config(
            "column statistics: expected a CUDA tensor".into(),
        ));
    };
    let start = cl.start_offset();
    let cv = c.as_cuda_slice::<f32>()?.slice(start..start + kvh * n);
    let (n_i, kvh_i, bs_i) = (
        as_i32(n, "keys")?,
        as_i32(kvh, "KV heads")?,
        as_i32(block_size, "block size")?,
    );
    let f = dev.get_or_load_custom_func("scores_add", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&mut sl.score)
        .arg(&cv)
        .arg(table)
        .arg(&n_i)
        .arg(&kvh_i)
        .arg(&bs_i);
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// Scores of a sequence's first `n` slots as `[KVH, n]`.
pub fn scores_gather(
    dev: &CudaDevice,
    sl: &SlotLayer,
    table: &CudaSlice<i32>,
    n: usize,
    num_kv_heads: usize,
    block_size: usize,
) -> Result<CudaSlice<f32>> {
    let mut out = dev.alloc_zeros::<f32>((num_kv_heads * n).max(1))?;
    if n == 0 {
        return Ok(out);
    }
    let (n_i, kvh_i, bs_i) = (
        as_i32(n, "keys")?,
        as_i32(num_kv_heads, "KV heads")?,
        as_i32(block_size, "block size")?,
    );
    let f = dev.get_or_load_custom_func("scores_gather", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&sl.score)
        .arg(&mut out)
        .arg(table)
        .arg(&n_i)
        .arg(&kvh_i)
        .arg(&bs_i);
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { b.launch(cfg) }.w()?;
    Ok(out)
}

/// Decode rows' probabilities (from [`paged_decode_with`]'s scores) added to the
/// scores of their slots, summed over each group's heads.
pub fn decode_scores_accum(
    dev: &CudaDevice,
    sl: &mut SlotLayer,
    scores: &DecodeScores<'_>,
    tables: &DecodeTables,
    group: usize,
    block_size: usize,
) -> Result<()> {
    let kvh = sl.num_kv_heads;
    let (kvh_i, g_i, bs_i) = (
        as_i32(kvh, "KV heads")?,
        as_i32(group, "group")?,
        as_i32(block_size, "block size")?,
    );
    let (mb_i, stride_i) = (
        as_i32(tables.max_blocks, "blocks")?,
        as_i32(scores.stride, "score stride")?,
    );
    let f = dev.get_or_load_custom_func("decode_scores_accum", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&*scores.raw)
        .arg(&*scores.lse)
        .arg(&tables.tables)
        .arg(&tables.ctx)
        .arg(&mut sl.score)
        .arg(&kvh_i)
        .arg(&g_i)
        .arg(&bs_i)
        .arg(&mb_i)
        .arg(&stride_i);
    let cfg = LaunchConfig {
        grid_dim: (
            tables.rows as u32,
            kvh as u32,
            scores.stride.div_ceil(ACCUM_THREADS) as u32,
        ),
        block_dim: (ACCUM_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// One eviction per (row, KV head) where the row holds more than its capacity:
/// `params` per row: slots m (the last holds the step's token), context n, capacity,
/// recent window.
pub fn evict(
    dev: &CudaDevice,
    sl: &mut SlotLayer,
    tables: &DecodeTables,
    params: &CudaSlice<i32>,
    head_dim: usize,
    block_size: usize,
    mode: VictimKind,
) -> Result<()> {
    let kvh = sl.num_kv_heads;
    let (kvh_i, d_i, bs_i) = (
        as_i32(kvh, "KV heads")?,
        as_i32(head_dim, "D")?,
        as_i32(block_size, "block size")?,
    );
    let (mb_i, mode_i) = (as_i32(tables.max_blocks, "blocks")?, mode as i32);
    let f = dev.get_or_load_custom_func("evict_one", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&mut sl.kv.k)
        .arg(&mut sl.kv.v)
        .arg(&mut sl.score)
        .arg(&mut sl.pos)
        .arg(&tables.tables)
        .arg(params)
        .arg(&kvh_i)
        .arg(&d_i)
        .arg(&bs_i)
        .arg(&mb_i)
        .arg(&mode_i);
    let cfg = LaunchConfig {
        grid_dim: (tables.rows as u32, kvh as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// H2O's prefill keep of one sequence on the device (`H2o::prefill_keep` exactly): from
/// `scores` `[KVH, n]` in position order ([`scores_gather`]), each KV head's
/// `capacity − recent` highest scores before the window (ties: the older), then the
/// window, ascending, as `[KVH, capacity]` slots.
pub fn h2o_prefill_keep(
    dev: &CudaDevice,
    scores: &CudaSlice<f32>,
    n: usize,
    c: Counts,
    num_kv_heads: usize,
) -> Result<CudaSlice<i32>> {
    let recent = c.recent.min(c.capacity).min(n);
    let heavy = c.capacity.min(n) - recent;
    if scores.len() < num_kv_heads * n {
        return Err(Error::Config(format!(
            "h2o_prefill_keep: {} scores for {num_kv_heads} KV heads x {n} positions",
            scores.len()
        )));
    }
    let mut keep = dev.alloc_zeros::<i32>((num_kv_heads * (heavy + recent)).max(1))?;
    let (n_i, r_i, h_i) = (
        as_i32(n, "positions")?,
        as_i32(recent, "recent")?,
        as_i32(heavy, "heavy")?,
    );
    let f = dev.get_or_load_custom_func("h2o_prefill_keep", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(scores).arg(&mut keep).arg(&n_i).arg(&r_i).arg(&h_i);
    let cfg = LaunchConfig {
        grid_dim: (num_kv_heads as u32, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { b.launch(cfg) }.w()?;
    Ok(keep)
}

/// Keep slots `keep[g * C..(g + 1) * C]` (ascending) of each KV head `g` of a sequence,
/// moved to slots `0..C` with their scores and positions.
#[allow(clippy::too_many_arguments)]
pub fn compact_slots(
    dev: &CudaDevice,
    sl: &mut SlotLayer,
    table: &CudaSlice<i32>,
    keep_d: &CudaSlice<i32>,
    c: usize,
    num_kv_heads: usize,
    head_dim: usize,
    block_size: usize,
) -> Result<()> {
    if c == 0 {
        return Ok(());
    }
    if keep_d.len() < c * num_kv_heads {
        return Err(Error::Config(format!(
            "compact_slots: {} kept slots for {num_kv_heads} KV heads x {c}",
            keep_d.len()
        )));
    }
    let (c_i, kvh_i) = (as_i32(c, "capacity")?, as_i32(num_kv_heads, "KV heads")?);
    let (d_i, bs_i) = (as_i32(head_dim, "D")?, as_i32(block_size, "block size")?);
    let f = dev.get_or_load_custom_func("compact_slots", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&mut sl.kv.k)
        .arg(&mut sl.kv.v)
        .arg(&mut sl.score)
        .arg(&mut sl.pos)
        .arg(table)
        .arg(keep_d)
        .arg(&c_i)
        .arg(&kvh_i)
        .arg(&d_i)
        .arg(&bs_i);
    let cfg = LaunchConfig {
        grid_dim: (num_kv_heads as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: (COMPACT_CHUNK * (4 * head_dim + 8)) as u32,
    };
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// Positions and zero scores for the first `n` of the (already written) `slots`, every
/// KV head; both lists on the device.
pub fn slot_meta_init(
    dev: &CudaDevice,
    sl: &mut SlotLayer,
    slots: &CudaSlice<i32>,
    positions: &CudaSlice<i32>,
    n: usize,
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let kvh = sl.num_kv_heads;
    let kvh_i = as_i32(kvh, "KV heads")?;
    let f = dev.get_or_load_custom_func("slot_meta_init", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(slots)
        .arg(positions)
        .arg(&mut sl.score)
        .arg(&mut sl.pos)
        .arg(&kvh_i);
    let cfg = LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (kvh.min(1024) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}
