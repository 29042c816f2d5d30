//! `full` on CUDA: the vLLM paradigm with the pool in device memory. The block tables
//! are kept on the host ([`BlockPool`], as the CPU `full`); K/V live in one bf16 buffer
//! per layer; decode rows read them through the block tables with the paged decode
//! kernel, prefill rows with the flash prefill kernel (in place, tensor cores) or, for
//! `eager`/`chunked`, cuBLAS products over the sequence's keys
//! ([`crate::cuda::prefill_attention`]).

use crate::attention::prefill::AttentionImpl;
use crate::config::ModelConfig;
use crate::cuda::{
    as_i32, device_of, drain_event_seconds, flash_prefill, initial_blocks, kv_gather, kv_write_at,
    paged_decode, rope_write, upload_i32, DecodeShape, DecodeTables, LayerCache,
};
use crate::decode_graphs::{ctx_bucket, GraphBinding, GraphBuffers};
use crate::error::{Error, Result};
use crate::kv::SeqTables;
use crate::policy::full::FullOptions;
use crate::policy::spec::Reservation;
use crate::policy::{
    AttendRecord, KvPolicy, LayerInput, PolicyMemory, PolicyStats, SeqId, StepBatch,
};
use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
use candle_core::cuda_backend::cudarc::driver::{CudaEvent, CudaSlice};
use candle_core::cuda_backend::CudaDevice;
use candle_core::cuda_backend::WrapErr;
use candle_core::{DType, Tensor};

/// Keys per partition of the decode kernel: long contexts split over more blocks.
const PART_SIZE: usize = 512;

pub struct CudaFullPolicy {
    dev: CudaDevice,
    cfg_heads: (usize, usize, usize),
    layers: Vec<LayerCache>,
    tables: SeqTables,
    opts: FullOptions,
    stats: PolicyStats,
    attended: Vec<AttendRecord>,
    scratch_limit: Option<u64>,
    /// Bytes of one block over all layers.
    block_bytes: u64,
    /// Blocks the device buffers hold: the whole pool under `fraction`; under `budget`
    /// what the pool grew to by the last step (grown at the next step's first layer).
    alloc_blocks: usize,
    /// Start and end of each cache write of the current step.
    cache_events: Vec<(CudaEvent, CudaEvent)>,
    /// Events whose time could not be read.
    event_errors: u64,
    /// The step's decode tables, uploaded at layer 0 and used by every layer.
    decode_tables: Option<DecodeTables>,
    /// The step's K/V write slots, likewise.
    write_slots: Option<CudaSlice<i32>>,
    /// Fixed device inputs of decode steps replayed from CUDA graphs, by (rows, table
    /// width), and the epoch of what the graphs read.
    graph_inputs: GraphBuffers<(usize, usize), GraphInputs>,
    /// The inputs `attend` reads this step instead of uploading its own.
    bound: Option<(usize, usize)>,
}

/// A graph step's write slots and decode tables, written in place each step.
struct GraphInputs {
    slots: CudaSlice<i32>,
    tables: DecodeTables,
}

impl CudaFullPolicy {
    /// A pool of `num_blocks` blocks, allocated up front under `fraction`; under
    /// `budget` its ceiling, the buffers grown as the pool hands blocks out.
    pub fn new(
        dev: &candle_core::Device,
        cfg: &ModelConfig,
        opts: FullOptions,
        num_blocks: usize,
        reservation: Reservation,
    ) -> Result<Self> {
        let dev = device_of(dev)?;
        let row = cfg.num_kv_heads * cfg.head_dim;
        let alloc_blocks = initial_blocks(reservation, num_blocks);
        let slots = alloc_blocks * opts.block_size;
        let layers = (0..cfg.num_layers)
            .map(|_| LayerCache::new(&dev, slots, row))
            .collect::<Result<Vec<_>>>()?;
        let tables = SeqTables::with_reservation(
            reservation,
            num_blocks,
            opts.block_size,
            opts.shuffle_seed,
        );
        Ok(Self {
            dev,
            cfg_heads: (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
            block_bytes: (2 * cfg.num_layers * opts.block_size * row * 2) as u64,
            alloc_blocks,
            layers,
            tables,
            opts,
            stats: PolicyStats::default(),
            attended: Vec::new(),
            scratch_limit: None,
            cache_events: Vec::new(),
            event_errors: 0,
            decode_tables: None,
            write_slots: None,
            graph_inputs: GraphBuffers::default(),
            bound: None,
        })
    }

    fn token_bytes(&self) -> u64 {
        let (_, kvh, d) = self.cfg_heads;
        (2 * self.layers.len() * kvh * d * 2) as u64
    }

    /// Grow the device buffers to the blocks the pool handed out (`budget`).
    fn grow_device(&mut self) -> Result<()> {
        let n = self.tables.num_blocks();
        if n > self.alloc_blocks {
            let row = self.cfg_heads.1 * self.cfg_heads.2;
            for l in &mut self.layers {
                l.grow(&self.dev, n * self.opts.block_size, row)?;
            }
            self.alloc_blocks = n;
        }
        Ok(())
    }

    /// [`Self::grow_device`] for a graph step: graphs that baked in the old buffers
    /// are stale (a new epoch).
    fn grow_for_graphs(&mut self) -> Result<()> {
        let before = self.alloc_blocks;
        self.grow_device()?;
        if self.alloc_blocks != before {
            self.graph_inputs.moved();
        }
        Ok(())
    }

    fn table_i32(&self, seq: SeqId) -> Vec<i32> {
        self.tables.table(seq).iter().map(|&b| b as i32).collect()
    }

    fn shape(&self) -> DecodeShape {
        let (h, kvh, d) = self.cfg_heads;
        DecodeShape {
            num_heads: h,
            num_kv_heads: kvh,
            head_dim: d,
            block_size: self.opts.block_size,
            part_size: PART_SIZE,
        }
    }

    /// A decode layer of a graph step: the cache write and the paged decode from the
    /// bound inputs, nothing uploaded, recorded or timed (the graph replays exactly this).
    fn attend_bound(&mut self, key: (usize, usize), input: &LayerInput<'_>) -> Result<Tensor> {
        let inputs = self
            .graph_inputs
            .get(&key)
            .ok_or_else(|| Error::Config("graph step bound to inputs that were dropped".into()))?;
        let shape = self.shape();
        let layer = &mut self.layers[input.layer];
        let v = input.v.to_dtype(DType::BF16)?;
        let q = match input.rope_rows {
            // Raw queries and keys (`rotates_on_write`): RoPE and the cache write in one
            // kernel.
            Some(rows) => rope_write(layer, (input.q, input.k, &v), rows, &inputs.slots)?,
            None => {
                let k = input.k.to_dtype(DType::BF16)?;
                kv_write_at(layer, &k, &v, &inputs.slots)?;
                input.q.to_dtype(DType::BF16)?
            }
        };
        let o = paged_decode(layer, &q, &inputs.tables, shape)?;
        Ok(o.to_dtype(input.q.dtype())?)
    }
}

/// The context bucket of a decode step's graph (every row one new token), `None` for
/// any other step.
fn graph_ctx(batch: &StepBatch) -> Option<usize> {
    if batch.seqs.is_empty() || batch.seqs.iter().any(|s| s.q_len != 1) {
        return None;
    }
    let longest = batch.seqs.iter().map(|s| s.ctx_before + 1).max();
    Some(ctx_bucket(longest.unwrap_or(1)))
}

impl KvPolicy for CudaFullPolicy {
    fn name(&self) -> &'static str {
        "full"
    }

    fn reserve(&mut self, seq: SeqId, total_tokens: usize) -> Result<bool> {
        Ok(self.tables.reserve(seq, total_tokens))
    }

    fn fits(&self, total_tokens: usize) -> bool {
        self.tables.fits(total_tokens)
    }

    fn set_device_ceiling(&mut self, bytes: u64) -> bool {
        self.tables
            .set_limit((bytes / self.block_bytes.max(1)) as usize)
    }

    fn release(&mut self, seq: SeqId) {
        self.tables.release(seq);
    }

    /// In a graph step: RoPE and the cache write in one kernel ([`rope_write`]).
    fn rotates_on_write(&self) -> bool {
        self.bound.is_some()
    }

    fn attend(&mut self, batch: &StepBatch, input: &LayerInput<'_>) -> Result<Tensor> {
        if let Some(key) = self.bound {
            return self.attend_bound(key, input);
        }
        let (_, kvh, d) = self.cfg_heads;
        let bs = self.opts.block_size;
        let layer = input.layer;
        let q = input.q.to_dtype(DType::BF16)?;
        let k = input.k.to_dtype(DType::BF16)?;
        let v = input.v.to_dtype(DType::BF16)?;

        // Cache write, timed with device events (kernels run asynchronously; the
        // events are read once the step's logits have synchronized the stream).
        let stream = self.dev.cuda_stream();
        let start = stream.record_event(Some(CU_EVENT_DEFAULT)).w()?;
        if layer == 0 || self.write_slots.is_none() {
            self.grow_device()?;
            // The same slots in every layer: uploaded once per step.
            let mut slots = Vec::with_capacity(batch.num_tokens);
            for s in &batch.seqs {
                for pos in s.ctx_before..s.ctx_before + s.q_len {
                    slots.push(self.tables.slot(s.id, pos) as i32);
                }
            }
            self.write_slots = Some(upload_i32(&self.dev, &slots)?);
        }
        let slots = self.write_slots.as_ref().expect("uploaded above");
        kv_write_at(&mut self.layers[layer], &k, &v, slots)?;
        let end = stream.record_event(Some(CU_EVENT_DEFAULT)).w()?;
        self.cache_events.push((start, end));
        if layer + 1 == self.layers.len() {
            for s in &batch.seqs {
                self.tables.set_len(s.id, s.ctx_before + s.q_len);
            }
        }

        // Decode rows (one new token) together through the paged kernel.
        let decode: Vec<usize> = (0..batch.seqs.len())
            .filter(|&i| batch.seqs[i].q_len == 1)
            .collect();
        let dec_out = if decode.is_empty() {
            None
        } else {
            let rows: Vec<u32> = decode
                .iter()
                .map(|&i| batch.seqs[i].q_start as u32)
                .collect();
            let qd = if decode.len() == batch.num_tokens {
                q.clone()
            } else {
                q.index_select(&Tensor::new(rows.as_slice(), q.device())?, 0)?
            };
            if layer == 0 || self.decode_tables.is_none() {
                let tables: Vec<Vec<i32>> = decode
                    .iter()
                    .map(|&i| self.table_i32(batch.seqs[i].id))
                    .collect();
                let ctx: Vec<usize> = decode
                    .iter()
                    .map(|&i| batch.seqs[i].ctx_before + 1)
                    .collect();
                self.decode_tables = Some(DecodeTables::new(&self.dev, &tables, &ctx)?);
            }
            let tables = self.decode_tables.as_ref().expect("built above");
            for &i in &decode {
                let s = batch.seqs[i];
                self.attended
                    .push(AttendRecord::whole(s.id, layer, s.ctx_before + 1));
            }
            Some(paged_decode(
                &self.layers[layer],
                &qd,
                tables,
                self.shape(),
            )?)
        };
        if decode.len() == batch.num_tokens {
            if let Some(o) = dec_out {
                return Ok(o.to_dtype(input.q.dtype())?);
            }
        }

        // Prefill chunks one sequence at a time; pieces joined in row order.
        let chunk = match self.opts.attention {
            AttentionImpl::Eager => usize::MAX,
            _ => self.opts.chunk_size,
        };
        let mut pieces = Vec::with_capacity(batch.seqs.len());
        let mut next_dec = 0;
        for s in &batch.seqs {
            if s.q_len == 1 {
                let o = dec_out.as_ref().expect("decode rows were computed");
                pieces.push(o.narrow(0, next_dec, 1)?);
                next_dec += 1;
                continue;
            }
            let qs = q.narrow(0, s.q_start, s.q_len)?;
            if self.opts.attention == AttentionImpl::Flash {
                let table = self.table_i32(s.id);
                let cache = &self.layers[layer];
                pieces.push(flash_prefill(cache, &qs, &table, s.ctx_before, kvh, bs)?);
                continue;
            }
            let n = s.ctx_before + s.q_len;
            let (kk, vv) = if s.ctx_before == 0 {
                (
                    k.narrow(0, s.q_start, s.q_len)?,
                    v.narrow(0, s.q_start, s.q_len)?,
                )
            } else {
                let table = self.table_i32(s.id);
                kv_gather(&self.dev, &self.layers[layer], &table, n, bs, kvh, d)?
            };
            let (o, scratch) = crate::cuda::prefill_attention(
                &qs,
                &kk,
                &vv,
                s.ctx_before,
                chunk,
                self.scratch_limit,
            )?;
            self.stats.add_scratch(scratch);
            pieces.push(o);
        }
        Ok(Tensor::cat(&pieces, 0)?.to_dtype(input.q.dtype())?)
    }

    fn memory(&self) -> PolicyMemory {
        let block = self.block_bytes;
        PolicyMemory {
            // The buffers as allocated, or as they grow at the next step's first layer.
            device_reserved: self.tables.num_blocks().max(self.alloc_blocks) as u64 * block,
            device_used: self.tables.num_used() as u64 * block,
            host_reserved: 0,
            host_used: 0,
        }
    }

    fn seq_device_bytes(&self, seq: SeqId) -> u64 {
        self.tables.len(seq) as u64 * self.token_bytes()
    }

    fn end_step(&mut self, _batch: &StepBatch) -> Result<()> {
        self.decode_tables = None;
        self.write_slots = None;
        self.bound = None;
        Ok(())
    }

    fn plan_graph_step(&mut self, batch: &StepBatch) -> Result<Option<GraphBinding>> {
        let Some(max_ctx) = graph_ctx(batch) else {
            return Ok(None);
        };
        self.grow_for_graphs()?;
        Ok(Some(GraphBinding {
            epoch: self.graph_inputs.epoch(),
            ctx_bucket: max_ctx,
            variant: 0,
        }))
    }

    fn bind_graph_step(&mut self, batch: &StepBatch) -> Result<Option<GraphBinding>> {
        let Some(max_ctx) = graph_ctx(batch) else {
            return Ok(None);
        };
        let bs = self.opts.block_size;
        self.grow_for_graphs()?;
        let rows = batch.seqs.len();
        let key = (rows, max_ctx.div_ceil(bs));
        // What `attend` does over the layers, done once: write slots, lengths, records.
        let mut slots = Vec::with_capacity(rows);
        let mut tables = Vec::with_capacity(rows);
        let mut ctx = Vec::with_capacity(rows);
        for s in &batch.seqs {
            slots.push(as_i32(self.tables.slot(s.id, s.ctx_before), "slot")?);
            tables.push(self.table_i32(s.id));
            ctx.push(s.ctx_before + 1);
        }
        let dev = &self.dev;
        let inputs = self.graph_inputs.get_or_make(key, || {
            Ok(GraphInputs {
                slots: dev.alloc_zeros::<i32>(rows)?,
                tables: DecodeTables::fixed(dev, rows, key.1, max_ctx)?,
            })
        })?;
        dev.cuda_stream()
            .memcpy_htod(&slots, &mut inputs.slots)
            .w()?;
        inputs.tables.write(dev, &tables, &ctx, bs)?;
        for layer in 0..self.layers.len() {
            for s in &batch.seqs {
                self.attended
                    .push(AttendRecord::whole(s.id, layer, s.ctx_before + 1));
            }
        }
        for s in &batch.seqs {
            self.tables.set_len(s.id, s.ctx_before + 1);
        }
        self.bound = Some(key);
        Ok(Some(GraphBinding {
            epoch: self.graph_inputs.epoch(),
            ctx_bucket: max_ctx,
            variant: 0,
        }))
    }

    fn take_stats(&mut self) -> PolicyStats {
        // The step's logits were read back, so its events have completed.
        self.stats.cache_ops_s +=
            drain_event_seconds(&mut self.cache_events, &mut self.event_errors);
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
