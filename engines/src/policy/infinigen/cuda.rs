//! `infinigen` on CUDA (algorithms.md §4): the offloading paradigm with the full K/V of
//! the offloaded layers in pinned host memory and only the speculated tokens brought
//! to the device each step.
//!
//! - Dense layers (`0..dense_layers`) keep K/V in a device pool and attend like `full`.
//!   The same pool (same block tables) holds the partial keys K̂ = K_rot·A[:, S] of the
//!   offloaded layers, `[slots, KVH, r]` bf16.
//! - The host tier is pinned host memory mapped into the device's address space,
//!   allocated in chunks as sequences reserve blocks. Kernels write each step's new K/V
//!   to it and read the selected rows from it in place (zero-copy over PCIe), so no
//!   host thread gathers rows and no host synchronization sits in the decode loop.
//! - Per decode step, inside layer ℓ−1 (its input `x`): q' = RoPE(W_q^(ℓ) x), the
//!   speculated scores over K̂, the α count and the per-KV-head top-k all run on the
//!   compute stream; then a gather kernel on a second (copy) stream reads the selected
//!   rows of layer ℓ from the host tier into a device staging buffer (two, ping-pong by
//!   layer parity) while the compute stream goes on with layer ℓ−1. Layer ℓ waits on
//!   the gather's event, appends its own new token and attends with the paged decode
//!   kernel over the staging slots.
//! - Prefill: full attention (flash or cuBLAS) over the chunk's K/V (earlier chunks
//!   read back from the host tier), the column importance Σ|Q̃| + Σ|K̃| on the device,
//!   the column choice on the host (KVH × D numbers), K̂ of every prompt token on the
//!   device.
//!
//! Accounting: `h2d_bytes` are the selected rows (from the per-layer counts copied back
//! once per step), `d2h_bytes` the new K/V written to the host tier; `transfer_s` is
//! the time the compute stream waited for gathers (the part of the transfer not hidden
//! behind compute), inside `cache_ops_s` with the cache writes, speculation and
//! selection (device events).

use crate::attention::prefill::AttentionImpl;
use crate::cuda::{
    as_i32, device_of, drain_event_seconds, flash_prefill, flash_prefill_contiguous, grow_slice,
    initial_blocks, join_rows, kv_gather, kv_write_at, paged_decode, prefill_attention,
    tensor_from, upload_i32, view, view_of, DecodeShape, DecodeTables, LayerCache, MODULE, PTX,
};
use crate::error::{Error, Result};
use crate::kv::host::{gather_selected, TierLayout};
use crate::kv::SeqTables;
use crate::model::{Linear, Llama};
use crate::policy::budget::{infinigen_k_max, infinigen_selection_cap};
use crate::policy::infinigen::{top_k, InfinigenParams, Speculation, Transfer};
use crate::policy::spec::PolicyEnv;
use crate::policy::{
    AttendRecord, KvPolicy, LayerInput, PolicyMemory, PolicyStats, SeqId, SeqInfo, StepBatch,
    StepSeq,
};
use candle_core::cuda_backend::cudarc::driver::result::memcpy_htod_async;
use candle_core::cuda_backend::cudarc::driver::sys::{self, CUevent_flags::CU_EVENT_DEFAULT};
use candle_core::cuda_backend::cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, CudaViewMut, DevicePtr, LaunchConfig,
    PinnedHostSlice, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{DType, Tensor};
use half::bf16;
use rayon::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;

/// Keys per partition of the decode kernel.
const PART_SIZE: usize = 512;
/// Slots per block of the staging buffers' block tables.
const STAGE_BLOCK: usize = 16;
/// Threads per block of the count and select kernels (`IG_THREADS` in kernels.cu).
const IG_THREADS: u32 = 256;
/// Warps per block of the gather kernel (one warp per row).
const GATHER_WARPS: usize = 8;
/// Bytes of one pinned host-tier allocation.
const CHUNK_BYTES: u64 = 256 << 20;
/// Query rows per piece of the column-importance products (bounds their scratch).
const COLABS_ROWS: usize = 8192;

/// The host tier: blocks of `[offloaded layers][K, V][block_size][KVH][D]` bf16 in
/// pinned, device-mapped host memory, allocated a chunk at a time.
pub struct PinnedTier {
    ctx: Arc<CudaContext>,
    tables: SeqTables,
    layout: TierLayout,
    chunks: Vec<Option<PinnedHostSlice<bf16>>>,
    /// Device addresses of the chunks (0 until allocated), mirrored in `ptrs_dev`.
    ptrs: Vec<u64>,
    ptrs_dev: CudaSlice<u64>,
    dirty: bool,
}

/// `len` bf16 of pinned, device-mapped host memory and its device address (callable
/// from any thread: the allocation makes the context current on it).
pub(crate) fn pin_chunk(
    ctx: &Arc<CudaContext>,
    len: usize,
) -> Result<(PinnedHostSlice<bf16>, u64)> {
    // SAFETY: the memory is only read where a kernel wrote it first (positions below a
    // sequence's length).
    let host = unsafe {
        ctx.alloc_pinned_with_flags::<bf16>(
            len,
            sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
        )
    }
    .map_err(|e| {
        Error::Config(format!(
            "infinigen: pinning {} MiB of host memory for the host tier failed ({e}); \
             lower --host-memory",
            (len * 2) >> 20
        ))
    })?;
    let hp = host.as_ptr().w()? as *mut std::ffi::c_void;
    let mut dptr: sys::CUdeviceptr = 0;
    // SAFETY: `hp` is a live allocation made with CU_MEMHOSTALLOC_DEVICEMAP, and the
    // allocation made the context current on this thread.
    unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, hp, 0) }
        .result()
        .w()?;
    Ok((host, dptr))
}

impl PinnedTier {
    /// `num_blocks` blocks laid out as `layout` (its `per_chunk` blocks pinned at a
    /// time; nothing allocated yet).
    pub fn new(dev: &CudaDevice, num_blocks: usize, layout: TierLayout) -> Result<Self> {
        let n_chunks = num_blocks.div_ceil(layout.per_chunk.max(1));
        Ok(Self {
            ctx: dev.cuda_stream().context().clone(),
            tables: SeqTables::new(num_blocks, layout.block_size, None),
            layout,
            chunks: (0..n_chunks).map(|_| None).collect(),
            ptrs: vec![0; n_chunks],
            ptrs_dev: dev.alloc_zeros::<u64>(n_chunks.max(1))?,
            dirty: false,
        })
    }

    /// Blocks per pinned allocation for blocks of `layout` in `chunk_bytes`.
    pub fn per_chunk(layout: &TierLayout, chunk_bytes: u64) -> usize {
        (chunk_bytes / (layout.block_elems() * 2).max(1) as u64).max(1) as usize
    }

    /// The allocated chunks as host slices (empty where none is allocated yet).
    pub fn host_views(&self) -> Result<Vec<&[bf16]>> {
        self.chunks
            .iter()
            .map(|c| match c {
                Some(c) => Ok(c.as_slice().w()?),
                None => Ok(&[][..]),
            })
            .collect()
    }

    fn block_bytes(&self) -> u64 {
        (self.layout.block_elems() * 2) as u64
    }

    /// Room for `tokens` of `seq`; allocates the chunks its blocks fall in.
    pub fn reserve(&mut self, seq: SeqId, tokens: usize) -> Result<bool> {
        if !self.tables.reserve(seq, tokens) {
            return Ok(false);
        }
        let need: Vec<usize> = self
            .tables
            .table(seq)
            .iter()
            .map(|&b| b as usize / self.layout.per_chunk)
            .filter(|&c| self.chunks[c].is_none())
            .collect();
        for c in need {
            self.allocate(c)?;
        }
        Ok(true)
    }

    fn allocate(&mut self, c: usize) -> Result<()> {
        if self.chunks[c].is_some() {
            return Ok(());
        }
        let (host, dptr) = pin_chunk(&self.ctx, self.chunk_len(c))?;
        self.ptrs[c] = dptr;
        self.chunks[c] = Some(host);
        self.dirty = true;
        Ok(())
    }

    /// Elements of chunk `c` (the last may hold fewer blocks).
    fn chunk_len(&self, c: usize) -> usize {
        let per = self.layout.per_chunk;
        per.min(self.tables.num_blocks() - c * per) * self.layout.block_elems()
    }

    /// Pin the chunks that the first `blocks` blocks fall in (a fresh pool hands out
    /// the lowest block ids first), several at once: one thread pinned about 2 GB/s on
    /// an H100's host, 8–10 s of an InfiniGen cell's warm-up at batch 16–32.
    pub fn pin_ahead(&mut self, blocks: usize) -> Result<()> {
        let chunks = blocks
            .div_ceil(self.layout.per_chunk)
            .min(self.chunks.len());
        let todo: Vec<(usize, usize)> = (0..chunks)
            .filter(|&c| self.chunks[c].is_none())
            .map(|c| (c, self.chunk_len(c)))
            .collect();
        let ctx = &self.ctx;
        let pinned: Vec<(usize, PinnedHostSlice<bf16>, u64)> = todo
            .into_par_iter()
            .map(|(c, len)| pin_chunk(ctx, len).map(|(h, d)| (c, h, d)))
            .collect::<Result<_>>()?;
        for (c, host, dptr) in pinned {
            self.ptrs[c] = dptr;
            self.chunks[c] = Some(host);
            self.dirty = true;
        }
        Ok(())
    }

    /// Upload the chunk addresses if a chunk was added since the last upload.
    pub fn sync_ptrs(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        if self.dirty && !self.ptrs.is_empty() {
            stream.memcpy_htod(&self.ptrs, &mut self.ptrs_dev).w()?;
            self.dirty = false;
        }
        Ok(())
    }

    fn allocated_bytes(&self) -> u64 {
        self.chunks
            .iter()
            .flatten()
            .map(|c| c.num_bytes() as u64)
            .sum()
    }

    pub fn table_i32(&self, seq: SeqId) -> Vec<i32> {
        self.tables.table(seq).iter().map(|&b| b as i32).collect()
    }

    /// Tier slot of position `pos` of `seq`.
    pub fn slot(&self, seq: SeqId, pos: usize) -> usize {
        self.tables.slot(seq, pos)
    }
}

#[derive(Debug)]
struct Seq {
    info: SeqInfo,
    computed: usize,
    /// Row of the column table `cols`.
    slot: usize,
    /// Largest selection of a step (`k_max` at the full length, as the CPU policy).
    cap: usize,
    /// Σ_t |Q̃[t, c]| of the prefill so far per offloaded layer, `[KVH, D]` f32.
    uq: Vec<Option<Tensor>>,
    /// The chosen columns `[offloaded layers][KVH][r]` (zeros until prefilled).
    cols: Vec<i32>,
}

impl Seq {
    fn prefilled(&self) -> bool {
        self.computed >= self.info.prefill_len
    }
}

/// What the decode rows of one step share across layers, uploaded at its first layer.
struct DecodePlan {
    /// Indices into the batch's sequences.
    rows: Vec<usize>,
    /// Rows of the step's packed tensors (`None`: every row decodes).
    idx: Option<Tensor>,
    positions: Vec<u32>,
    src_rows: CudaSlice<i32>,
    /// Device-pool slot of each row's new token (its K̂ row).
    khat_slots: CudaSlice<i32>,
    row_seq: CudaSlice<i32>,
    /// Positions before the new token (what the selection ranges over).
    nctx: CudaSlice<i32>,
    kmax: CudaSlice<i32>,
    dense_tables: DecodeTables,
    host_tables: CudaSlice<i32>,
    /// The same tables on the host (host gathers of the `memcpy` transfer).
    host_tables_host: Vec<Vec<i32>>,
    max_hblocks: usize,
    /// Per layer parity: row r reads staging slots r·B.. with the selection's count.
    stage_tables: [DecodeTables; 2],
    kcap: usize,
    b: usize,
    stride: usize,
}

struct Plan {
    /// Device-pool and host-tier slots of every new token of the step.
    dense_slots: CudaSlice<i32>,
    host_slots: CudaSlice<i32>,
    dec: Option<DecodePlan>,
    /// Offloaded layers whose decode rows attended a selection this step.
    staged: Vec<usize>,
}

/// Device buffers sized for the largest step so far.
struct StepBuffers {
    stage: [LayerCache; 2],
    stage_slots: usize,
    sel: [CudaSlice<i32>; 2],
    ks: [CudaSlice<i32>; 2],
    scores: CudaSlice<f32>,
    counts: CudaSlice<i32>,
    /// Selected count per (offloaded layer, decode row) of the step.
    klog: CudaSlice<i32>,
    /// The token-major gather's marks (`[R, KVH, stride]`, all zero between gathers;
    /// one element while the head order runs).
    marks: CudaSlice<i32>,
    /// Host side of the `memcpy` transfer.
    pinned: Option<PinnedStaging>,
}

/// Pinned host buffers of the `memcpy` transfer, per layer parity: the selection and
/// counts copied back, and the rows gathered on the host (the device staging's layout).
struct PinnedStaging {
    sel: [PinnedHostSlice<i32>; 2],
    ks: [PinnedHostSlice<i32>; 2],
    k: [PinnedHostSlice<bf16>; 2],
    v: [PinnedHostSlice<bf16>; 2],
}

impl PinnedStaging {
    fn new(ctx: &Arc<CudaContext>, sel: usize, rows: usize, stage: usize) -> Result<Self> {
        // SAFETY: every element is written (by a copy or the host gather) before it is
        // read.
        let pin = |n: usize| unsafe { ctx.alloc_pinned_with_flags::<i32>(n.max(1), 0) };
        let pin_bf16 = |n: usize| unsafe { ctx.alloc_pinned_with_flags::<bf16>(n.max(1), 0) };
        Ok(Self {
            sel: [pin(sel).w()?, pin(sel).w()?],
            ks: [pin(rows).w()?, pin(rows).w()?],
            k: [pin_bf16(stage).w()?, pin_bf16(stage).w()?],
            v: [pin_bf16(stage).w()?, pin_bf16(stage).w()?],
        })
    }

    fn fits(&self, sel: usize, rows: usize, stage: usize) -> bool {
        self.sel[0].len() >= sel && self.ks[0].len() >= rows && self.k[0].len() >= stage
    }

    fn bytes(&self) -> u64 {
        2 * (4 * (self.sel[0].len() + self.ks[0].len()) + 2 * 2 * self.k[0].len()) as u64
    }
}

impl StepBuffers {
    fn new(dev: &CudaDevice, row_elems: usize) -> Result<Self> {
        Ok(Self {
            stage: [
                LayerCache::new(dev, 1, row_elems)?,
                LayerCache::new(dev, 1, row_elems)?,
            ],
            stage_slots: 1,
            sel: [dev.alloc_zeros(1)?, dev.alloc_zeros(1)?],
            ks: [dev.alloc_zeros(1)?, dev.alloc_zeros(1)?],
            scores: dev.alloc_zeros(1)?,
            counts: dev.alloc_zeros(1)?,
            klog: dev.alloc_zeros(1)?,
            marks: dev.alloc_zeros(1)?,
            pinned: None,
        })
    }

    fn bytes(&self, row_elems: usize) -> u64 {
        (2 * 2 * self.stage_slots * row_elems * 2
            + 4 * (self.sel[0].len() * 2
                + self.ks[0].len() * 2
                + self.scores.len()
                + self.counts.len()
                + self.klog.len()
                + self.marks.len())) as u64
    }
}

/// Grow `buf` to at least `len` elements (contents not kept).
fn grow<
    T: candle_core::cuda_backend::cudarc::driver::DeviceRepr
        + candle_core::cuda_backend::cudarc::driver::ValidAsZeroBits,
>(
    dev: &CudaDevice,
    buf: &mut CudaSlice<T>,
    len: usize,
) -> Result<()> {
    if buf.len() < len {
        *buf = dev.alloc_zeros::<T>(len)?;
    }
    Ok(())
}

pub struct CudaInfinigenPolicy {
    params: InfinigenParams,
    dev: CudaDevice,
    /// The stream the gathers run on, beside candle's compute stream.
    copy: Arc<CudaStream>,
    /// H, KVH, D.
    heads: (usize, usize, usize),
    num_layers: usize,
    dense: usize,
    r: usize,
    attention: AttentionImpl,
    chunk_size: usize,
    block_size: usize,
    device_name: String,
    wq: Vec<Linear>,
    /// Skewing matrices `[L, KVH, D, D]` f32 on the device.
    a: Tensor,
    dense_kv: Vec<LayerCache>,
    khat: Vec<CudaSlice<bf16>>,
    tables: SeqTables,
    /// Device bytes of one pool block (dense K/V and K̂ of every layer).
    block_bytes: u64,
    /// Blocks the device buffers hold: the whole pool under `fraction`; under `budget`
    /// what the pool grew to by the last step (grown at the next step's first layer).
    alloc_blocks: usize,
    host: PinnedTier,
    seqs: HashMap<SeqId, Seq>,
    /// Column table `[slots][offloaded layers][KVH][r]`, one row per admitted sequence.
    cols: CudaSlice<i32>,
    col_slots: usize,
    free_slots: Vec<usize>,
    bufs: StepBuffers,
    plan: Option<Plan>,
    stats: PolicyStats,
    attended: Vec<AttendRecord>,
    scratch_limit: Option<u64>,
    /// Cache operations on the compute stream (start, end).
    cache_events: Vec<(CudaEvent, CudaEvent)>,
    /// Compute-stream waits for a gather (start, end).
    stall_events: Vec<(CudaEvent, CudaEvent)>,
    event_errors: u64,
    /// Per layer parity: the gather that filled the staging buffer.
    gathered: [Option<CudaEvent>; 2],
    /// `memcpy` transfer, per layer parity: the selection copied back to the host, the
    /// attention that last read the device staging, the copies out of the pinned one.
    idx_ready: [Option<CudaEvent>; 2],
    attn_done: [Option<CudaEvent>; 2],
    copied: [Option<CudaEvent>; 2],
    /// How the zero-copy gather walks the selection (`KVBENCH_IG_GATHER`).
    gather_order: GatherOrder,
}

impl CudaInfinigenPolicy {
    /// Grow the dense layers' K/V and the K̂ buffers to the blocks the pool handed out
    /// (`budget`).
    fn grow_device(&mut self) -> Result<()> {
        let n = self.tables.num_blocks();
        if n > self.alloc_blocks {
            let (_, kvh, d) = self.heads;
            let slots = n * self.block_size;
            for l in &mut self.dense_kv {
                l.grow(&self.dev, slots, kvh * d)?;
            }
            for k in &mut self.khat {
                grow_slice(&self.dev, k, slots * kvh * self.r)?;
            }
            self.alloc_blocks = n;
        }
        Ok(())
    }

    pub fn new(params: InfinigenParams, model: &Llama, env: PolicyEnv) -> Result<Self> {
        let cfg = &model.cfg;
        let dev = device_of(model.device())?;
        let (skew, dense, r) = params.checked(cfg)?;
        let (h, kvh, d) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let off = cfg.num_layers - dense;
        let row = kvh * d;
        let bs = env.block_size;
        let a = Tensor::from_slice(skew.all(), (cfg.num_layers, kvh, d, d), model.device())?;
        let a_bytes = (a.elem_count() * 4) as u64;
        // One pool block: dense layers' K/V and every offloaded layer's K̂, bf16.
        let block_bytes = ((dense * 2 * row + off * kvh * r) * 2 * bs) as u64;
        let num_blocks =
            (env.kv_device_bytes.saturating_sub(a_bytes) / block_bytes.max(1)) as usize;
        let alloc_blocks = initial_blocks(env.reservation, num_blocks);
        let slots = alloc_blocks * bs;
        let dense_kv = (0..dense)
            .map(|_| LayerCache::new(&dev, slots, row))
            .collect::<Result<Vec<_>>>()?;
        let khat = (0..off)
            .map(|_| Ok(dev.alloc_zeros::<bf16>((slots * kvh * r).max(1))?))
            .collect::<Result<Vec<_>>>()?;
        let mut layout = TierLayout {
            layers: off,
            block_size: bs,
            num_kv_heads: kvh,
            head_dim: d,
            per_chunk: 1,
        };
        layout.per_chunk = PinnedTier::per_chunk(&layout, CHUNK_BYTES);
        let host_blocks = if off == 0 {
            0
        } else {
            (env.kv_host_bytes / (layout.block_elems() * 2) as u64) as usize
        };
        let host = PinnedTier::new(&dev, host_blocks, layout)?;
        let copy = dev.cuda_stream().context().new_stream().w()?;
        Ok(Self {
            gather_order: gather_order()?,
            copy,
            heads: (h, kvh, d),
            num_layers: cfg.num_layers,
            dense,
            r,
            attention: env.attention,
            chunk_size: env.chunk_size,
            block_size: bs,
            device_name: env.device_name.clone(),
            wq: model.layers().iter().map(|l| l.wq.clone()).collect(),
            a,
            dense_kv,
            khat,
            tables: SeqTables::with_reservation(env.reservation, num_blocks, bs, env.shuffle_seed),
            block_bytes,
            alloc_blocks,
            host,
            seqs: HashMap::new(),
            cols: dev.alloc_zeros::<i32>(1)?,
            col_slots: 0,
            free_slots: Vec::new(),
            bufs: StepBuffers::new(&dev, row)?,
            plan: None,
            stats: PolicyStats::default(),
            attended: Vec::new(),
            scratch_limit: None,
            cache_events: Vec::new(),
            stall_events: Vec::new(),
            event_errors: 0,
            gathered: [None, None],
            idx_ready: [None, None],
            attn_done: [None, None],
            copied: [None, None],
            dev,
            params,
        })
    }

    fn off(&self) -> usize {
        self.num_layers - self.dense
    }

    fn dims(&self) -> IgDims {
        IgDims {
            num_heads: self.heads.0,
            num_kv_heads: self.heads.1,
            head_dim: self.heads.2,
            r: self.r,
            off_layers: self.off(),
            block_size: self.block_size,
        }
    }

    fn cols_per_seq(&self) -> usize {
        self.off() * self.heads.1 * self.r
    }

    fn event(&self) -> Result<CudaEvent> {
        Ok(self
            .dev
            .cuda_stream()
            .record_event(Some(CU_EVENT_DEFAULT))
            .w()?)
    }

    fn table_i32(&self, seq: SeqId) -> Vec<i32> {
        self.tables.table(seq).iter().map(|&b| b as i32).collect()
    }

    /// A column-table row for a new sequence, growing the table (and re-uploading
    /// every live sequence's columns) when full.
    fn take_slot(&mut self) -> Result<usize> {
        if let Some(s) = self.free_slots.pop() {
            return Ok(s);
        }
        let slot = self.col_slots;
        let per = self.cols_per_seq().max(1);
        if (slot + 1) * per > self.cols.len() {
            let cap = ((slot + 1) * 2).max(8);
            let mut host = vec![0i32; cap * per];
            for s in self.seqs.values() {
                host[s.slot * per..s.slot * per + s.cols.len()].copy_from_slice(&s.cols);
            }
            self.cols = upload_i32(&self.dev, &host)?;
        }
        self.col_slots += 1;
        Ok(slot)
    }

    fn admit_seq(&mut self, seq: SeqId, info: SeqInfo) -> Result<()> {
        let cap = infinigen_selection_cap(
            self.params.budget,
            info.prompt_len,
            info.max_new_tokens,
            info.prefill_len,
            self.params.relative_to_current,
        );
        let slot = match self.seqs.get(&seq) {
            Some(s) => s.slot,
            None => self.take_slot()?,
        };
        let off = self.off();
        self.seqs.insert(
            seq,
            Seq {
                info,
                computed: 0,
                slot,
                cap,
                uq: vec![None; off],
                cols: vec![0; self.cols_per_seq()],
            },
        );
        Ok(())
    }

    /// `k_max` of a decode row with `n` tokens before the new one.
    fn k_max(&self, s: &Seq, n: usize) -> usize {
        infinigen_k_max(
            self.params.budget,
            s.info.prompt_len,
            s.info.max_new_tokens,
            n + 1,
            self.params.relative_to_current,
        )
        .min(s.cap)
    }

    /// Step buffers for `nrows` decode rows selecting up to `kcap` tokens (staging rows
    /// of `b` slots) among up to `stride` positions; grown, never shrunk.
    fn ensure_buffers(&mut self, nrows: usize, kcap: usize, b: usize, stride: usize) -> Result<()> {
        let (h, kvh, d) = self.heads;
        let row = kvh * d;
        let need_stage = nrows * b;
        if need_stage > self.bufs.stage_slots {
            self.bufs.stage = [
                LayerCache::new(&self.dev, need_stage, row)?,
                LayerCache::new(&self.dev, need_stage, row)?,
            ];
            self.bufs.stage_slots = need_stage;
        }
        for p in 0..2 {
            grow(&self.dev, &mut self.bufs.sel[p], nrows * kvh * kcap)?;
            grow(&self.dev, &mut self.bufs.ks[p], nrows)?;
        }
        grow(&self.dev, &mut self.bufs.scores, nrows * h * stride)?;
        if self.gather_order == GatherOrder::Tokens && self.params.transfer == Transfer::ZeroCopy {
            // Zeros when grown, and kept zero by every gather.
            grow(&self.dev, &mut self.bufs.marks, nrows * kvh * stride)?;
        }
        grow(&self.dev, &mut self.bufs.counts, nrows * h)?;
        let klog = (self.off() * nrows).max(1);
        grow(&self.dev, &mut self.bufs.klog, klog)?;
        if self.params.transfer == Transfer::Memcpy {
            let (ns, nst) = (self.bufs.sel[0].len(), self.bufs.stage_slots * row);
            if !self
                .bufs
                .pinned
                .as_ref()
                .is_some_and(|p| p.fits(ns, nrows, nst))
            {
                let ctx = self.dev.cuda_stream().context().clone();
                self.bufs.pinned = Some(PinnedStaging::new(&ctx, ns, nrows, nst)?);
            }
        }
        Ok(())
    }

    /// Everything the step's layers share, uploaded once.
    fn plan(&mut self, batch: &StepBatch) -> Result<Plan> {
        let (_, kvh, d) = self.heads;
        let stream = self.dev.cuda_stream();
        self.host.sync_ptrs(&stream)?;
        let mut dense_slots = Vec::with_capacity(batch.num_tokens);
        let mut host_slots = Vec::with_capacity(batch.num_tokens);
        for s in &batch.seqs {
            for pos in s.ctx_before..s.ctx_before + s.q_len {
                dense_slots.push(as_i32(self.tables.slot(s.id, pos), "pool slot")?);
                if self.off() > 0 {
                    host_slots.push(as_i32(self.host.tables.slot(s.id, pos), "host slot")?);
                }
            }
        }
        let rows: Vec<usize> = (0..batch.seqs.len())
            .filter(|&i| self.seqs[&batch.seqs[i].id].prefilled())
            .collect();
        let dec = if rows.is_empty() {
            None
        } else {
            let nrows = rows.len();
            let mut src = Vec::with_capacity(nrows);
            let mut khat_slots = Vec::with_capacity(nrows);
            let mut row_seq = Vec::with_capacity(nrows);
            let mut nctx = Vec::with_capacity(nrows);
            let mut kmax = Vec::with_capacity(nrows);
            let mut tables = Vec::with_capacity(nrows);
            let mut ctx = Vec::with_capacity(nrows);
            let mut htables = Vec::with_capacity(nrows);
            let mut positions = Vec::with_capacity(nrows);
            let mut kcap = 1;
            for &i in &rows {
                let s = batch.seqs[i];
                let st = &self.seqs[&s.id];
                let n = s.ctx_before;
                let km = self.k_max(st, n);
                kcap = kcap.max(km.min(n).max(1));
                src.push(as_i32(s.q_start, "row")?);
                khat_slots.push(as_i32(self.tables.slot(s.id, n), "pool slot")?);
                row_seq.push(as_i32(st.slot, "sequence slot")?);
                nctx.push(as_i32(n, "context")?);
                kmax.push(as_i32(km, "k_max")?);
                tables.push(self.table_i32(s.id));
                ctx.push(n + 1);
                htables.push(self.host.table_i32(s.id));
                positions.push(n as u32);
            }
            let max_hblocks = htables.iter().map(Vec::len).max().unwrap_or(0).max(1);
            let mut hflat = vec![0i32; nrows * max_hblocks];
            for (r, t) in htables.iter().enumerate() {
                hflat[r * max_hblocks..r * max_hblocks + t.len()].copy_from_slice(t);
            }
            let b = (kcap + 1).div_ceil(STAGE_BLOCK) * STAGE_BLOCK;
            let per_row = b / STAGE_BLOCK;
            let stage_tables: Vec<Vec<i32>> = (0..nrows)
                .map(|r| (0..per_row).map(|i| (r * per_row + i) as i32).collect())
                .collect();
            let stride = nctx.iter().map(|&n| n as usize).max().unwrap_or(1).max(1);
            // Buffers for the largest step so far (kept between steps), within the
            // step's scratch room.
            let row = kvh * d;
            self.ensure_buffers(nrows, kcap, b, stride)?;
            let after = self.bufs.bytes(row);
            if let Some(limit) = self.scratch_limit.filter(|&l| after > l) {
                return Err(Error::OutOfMemory {
                    device: self.device_name.clone(),
                    component: crate::error::Component::Activations,
                    requested: after,
                    available: limit,
                    capacity: limit,
                });
            }
            let idx = if nrows == batch.num_tokens {
                None
            } else {
                let r: Vec<u32> = rows.iter().map(|&i| batch.seqs[i].q_start as u32).collect();
                Some(Tensor::new(
                    r.as_slice(),
                    &candle_core::Device::Cuda(self.dev.clone()),
                )?)
            };
            let zeros = vec![0usize; nrows];
            Some(DecodePlan {
                rows,
                idx,
                positions,
                src_rows: upload_i32(&self.dev, &src)?,
                khat_slots: upload_i32(&self.dev, &khat_slots)?,
                row_seq: upload_i32(&self.dev, &row_seq)?,
                nctx: upload_i32(&self.dev, &nctx)?,
                kmax: upload_i32(&self.dev, &kmax)?,
                dense_tables: DecodeTables::new(&self.dev, &tables, &ctx)?,
                host_tables: upload_i32(&self.dev, &hflat)?,
                host_tables_host: htables,
                max_hblocks,
                stage_tables: [
                    DecodeTables::with_max_ctx(&self.dev, &stage_tables, &zeros, b)?,
                    DecodeTables::with_max_ctx(&self.dev, &stage_tables, &zeros, b)?,
                ],
                kcap,
                b,
                stride,
            })
        };
        self.stats.add_scratch(self.bufs.bytes(kvh * d));
        Ok(Plan {
            dense_slots: upload_i32(&self.dev, &dense_slots)?,
            host_slots: upload_i32(
                &self.dev,
                &host_slots.iter().copied().chain([0]).collect::<Vec<_>>(),
            )?,
            dec,
            staged: Vec::new(),
        })
    }

    /// Layer `target`'s selection for the decode rows from rotated queries `q`
    /// (`[R, H, D]` bf16), then its gather on the copy stream.
    fn speculate(&mut self, target: usize, q: &Tensor) -> Result<()> {
        let dims = self.dims();
        let li = target - self.dense;
        let p = target % 2;
        let plan = self.plan.as_mut().expect("planned");
        let dp = plan.dec.as_mut().expect("decode rows");
        let nrows = dp.rows.len();
        let stream = self.dev.cuda_stream();
        let start = stream.record_event(Some(CU_EVENT_DEFAULT)).w()?;
        let rows = SpecRows {
            row_seq: &dp.row_seq,
            nctx: &dp.nctx,
            kmax: &dp.kmax,
            tables: &dp.dense_tables,
            stride: dp.stride,
        };
        let out = SelectOut {
            sel: &mut self.bufs.sel[p],
            kcap: dp.kcap,
            ks: &mut self.bufs.ks[p],
            stage_ctx: &mut dp.stage_tables[p].ctx,
            klog: Some(self.bufs.klog.slice_mut(li * nrows..(li + 1) * nrows)),
        };
        speculate_select(
            &self.dev,
            dims,
            li,
            q,
            &self.a.get(target)?,
            &self.cols,
            &self.khat[li],
            &rows,
            self.params.alpha as f32,
            &mut self.bufs.scores,
            &mut self.bufs.counts,
            out,
        )?;
        if self.params.transfer == Transfer::Memcpy {
            // The original's path: the selection goes back to the host, which gathers
            // the rows when the layer comes ([`Self::fetch`]).
            let pin = self.bufs.pinned.as_mut().expect("planned for memcpy");
            let n_sel = nrows * dims.num_kv_heads * dp.kcap;
            // The host sides cut to the rows copied: cudarc copies as many bytes as the
            // destination holds, which would be the buffers' whole planned capacity.
            let sel_dst = &mut pin.sel[p].as_mut_slice().w()?[..n_sel];
            stream
                .memcpy_dtoh(&self.bufs.sel[p].slice(0..n_sel), sel_dst)
                .w()?;
            let ks_dst = &mut pin.ks[p].as_mut_slice().w()?[..nrows];
            stream
                .memcpy_dtoh(&self.bufs.ks[p].slice(0..nrows), ks_dst)
                .w()?;
            let copied_back = stream.record_event(Some(CU_EVENT_DEFAULT)).w()?;
            self.cache_events.push((start, copied_back));
            self.idx_ready[p] = Some(stream.record_event(Some(CU_EVENT_DEFAULT)).w()?);
            return Ok(());
        }
        let selected = stream.record_event(Some(CU_EVENT_DEFAULT)).w()?;
        // The gather waits for the selection, which the compute stream issued after
        // layer target−2's attention: the staging buffer of this parity is free.
        self.copy.wait(&selected).w()?;
        self.cache_events.push((start, selected));
        let src = GatherSrc {
            host_tables: &dp.host_tables,
            max_hblocks: dp.max_hblocks,
            sel: &self.bufs.sel[p],
            kcap: dp.kcap,
            ks: &self.bufs.ks[p],
            rows: nrows,
            nctx: &dp.nctx,
            stride: dp.stride,
        };
        gather(
            &self.copy,
            &self.dev,
            &self.host,
            dims,
            li,
            &src,
            &mut self.bufs.stage[p],
            dp.b,
            self.gather_order,
            &mut self.bufs.marks,
        )?;
        self.gathered[p] = Some(self.copy.record_event(Some(CU_EVENT_DEFAULT)).w()?);
        Ok(())
    }

    /// Speculated queries of layer `target` for the decode rows, from this layer's
    /// input.
    fn speculative_q(&self, input: &LayerInput<'_>, target: usize) -> Result<Tensor> {
        let (h, _, d) = self.heads;
        let dp = self
            .plan
            .as_ref()
            .and_then(|p| p.dec.as_ref())
            .expect("decode rows");
        let x = match &dp.idx {
            Some(idx) => input.x.index_select(idx, 0)?,
            None => input.x.clone(),
        };
        let q = self.wq[target]
            .forward(&x)?
            .reshape((dp.rows.len(), h, d))?;
        input.rope.rotate(&q, &dp.positions)
    }

    /// Decode rows of offloaded layer `layer`: wait for the gather, add each row's own
    /// token, attend over the staging slots. Returns `[R, H, D]`.
    fn attend_staged(
        &mut self,
        layer: usize,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Tensor> {
        let dims = self.dims();
        let p = layer % 2;
        let gathered = self.gathered[p].take().ok_or_else(|| {
            Error::Config(format!(
                "infinigen: layer {layer} has no selection (it is made in layer {})",
                layer.saturating_sub(1)
            ))
        })?;
        let stream = self.dev.cuda_stream();
        let w0 = stream.record_event(Some(CU_EVENT_DEFAULT)).w()?;
        stream.wait(&gathered).w()?;
        let w1 = stream.record_event(Some(CU_EVENT_DEFAULT)).w()?;
        self.stall_events.push((w0, w1));
        let plan = self.plan.as_mut().expect("planned");
        plan.staged.push(layer);
        let dp = plan.dec.as_ref().expect("decode rows");
        stage_own(
            &self.dev,
            dims,
            k,
            v,
            &dp.src_rows,
            &self.bufs.ks[p],
            dp.rows.len(),
            dp.b,
            &mut self.bufs.stage[p],
        )?;
        let qd = match &dp.idx {
            Some(idx) => q.index_select(idx, 0)?,
            None => q.clone(),
        };
        let out = paged_decode(
            &self.bufs.stage[p],
            &qd,
            &dp.stage_tables[p],
            dims.stage_shape(),
        )?;
        self.attn_done[p] = Some(stream.record_event(Some(CU_EVENT_DEFAULT)).w()?);
        Ok(out)
    }

    /// The `memcpy` transfer of layer `layer`'s selection: wait for it on the host,
    /// gather the rows from the host tier into pinned staging (rows in parallel), and
    /// copy each row's rows to the device staging on the copy stream once the
    /// attention that last read it (layer − 2) is done.
    fn fetch(&mut self, layer: usize) -> Result<()> {
        let dims = self.dims();
        let (kvh, row) = (dims.num_kv_heads, dims.num_kv_heads * dims.head_dim);
        let p = layer % 2;
        let li = layer - self.dense;
        let ready = self.idx_ready[p].take().ok_or_else(|| {
            Error::Config(format!(
                "infinigen: layer {layer} has no selection to fetch"
            ))
        })?;
        ready.synchronize().w()?;
        if let Some(c) = self.copied[p].take() {
            c.synchronize().w()?;
        }
        let dp = self
            .plan
            .as_ref()
            .and_then(|p| p.dec.as_ref())
            .expect("decode rows");
        let (nrows, kcap, b) = (dp.rows.len(), dp.kcap, dp.b);
        let layout = self.host.layout;
        let views = self.host.host_views()?;
        let PinnedStaging { sel, ks, k, v } = self.bufs.pinned.as_mut().expect("planned");
        let (sel, ks) = (sel[p].as_slice().w()?, ks[p].as_slice().w()?);
        let (sk, sv) = (k[p].as_mut_slice().w()?, v[p].as_mut_slice().w()?);
        sk.par_chunks_mut(b * row)
            .zip(sv.par_chunks_mut(b * row))
            .take(nrows)
            .enumerate()
            .for_each(|(r, (ok, ov))| {
                gather_selected(
                    &layout,
                    &views,
                    li,
                    &dp.host_tables_host[r],
                    &sel[r * kvh * kcap..(r + 1) * kvh * kcap],
                    kcap,
                    ks[r].max(0) as usize,
                    ok,
                    ov,
                )
            });
        if let Some(a) = &self.attn_done[p] {
            self.copy.wait(a).w()?;
        }
        let stage = &self.bufs.stage[p];
        let (kp, _rk) = stage.k.device_ptr(&self.copy);
        let (vp, _rv) = stage.v.device_ptr(&self.copy);
        for (r, &kr) in ks.iter().enumerate().take(nrows) {
            let (at, n) = (r * b * row, kr.max(0) as usize * row);
            if n == 0 {
                continue;
            }
            let off = (at * 2) as u64;
            // SAFETY: the destinations lie inside the staging buffers (n ≤ b·row per
            // row), the sources in pinned memory that is not written again before
            // `copied[p]` completes.
            unsafe {
                memcpy_htod_async(kp + off, &sk[at..at + n], self.copy.cu_stream()).w()?;
                memcpy_htod_async(vp + off, &sv[at..at + n], self.copy.cu_stream()).w()?;
            }
        }
        self.gathered[p] = Some(self.copy.record_event(Some(CU_EVENT_DEFAULT)).w()?);
        self.copied[p] = Some(self.copy.record_event(Some(CU_EVENT_DEFAULT)).w()?);
        Ok(())
    }

    /// The step's new K/V of offloaded layer `li` to the host tier.
    fn host_write(&mut self, li: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let plan = self.plan.as_ref().expect("planned");
        host_write(
            &self.dev,
            &self.host,
            self.dims(),
            li,
            k,
            v,
            &plan.host_slots,
        )?;
        self.stats.d2h_bytes += (2 * k.elem_count() * 2) as u64;
        Ok(())
    }

    /// One prefill chunk of `s` in `layer`: attention over its first `n` positions;
    /// in an offloaded layer also the column importance and, once the prompt is
    /// complete, the column choice and K̂ of every prompt token.
    fn prefill(
        &mut self,
        layer: usize,
        s: StepSeq,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Tensor> {
        let (_, kvh, d) = self.heads;
        let n = s.ctx_before + s.q_len;
        let qs = q.narrow(0, s.q_start, s.q_len)?;
        let (kr, vr) = (
            k.narrow(0, s.q_start, s.q_len)?,
            v.narrow(0, s.q_start, s.q_len)?,
        );
        let chunk = match self.attention {
            AttentionImpl::Eager => usize::MAX,
            _ => self.chunk_size,
        };
        if layer < self.dense {
            let table = self.table_i32(s.id);
            if self.attention == AttentionImpl::Flash {
                return flash_prefill(
                    &self.dense_kv[layer],
                    &qs,
                    &table,
                    s.ctx_before,
                    kvh,
                    self.block_size,
                );
            }
            let (kk, vv) = if s.ctx_before == 0 {
                (kr, vr)
            } else {
                kv_gather(
                    &self.dev,
                    &self.dense_kv[layer],
                    &table,
                    n,
                    self.block_size,
                    kvh,
                    d,
                )?
            };
            let (o, scratch) =
                prefill_attention(&qs, &kk, &vv, s.ctx_before, chunk, self.scratch_limit)?;
            self.stats.add_scratch(scratch);
            return Ok(o);
        }
        let li = layer - self.dense;
        // The chunk's keys with the earlier chunks' (read back from the host tier).
        let (kk, vv) = if s.ctx_before == 0 {
            (kr.contiguous()?, vr.contiguous()?)
        } else {
            let table = self.host.table_i32(s.id);
            let (pk, pv) = host_read(&self.dev, &self.host, self.dims(), li, &table, s.ctx_before)?;
            (Tensor::cat(&[&pk, &kr], 0)?, Tensor::cat(&[&pv, &vr], 0)?)
        };
        let kv_bytes = (2 * n * kvh * d * 2) as u64;
        let out = if self.attention == AttentionImpl::Flash {
            let (o, scratch) = flash_prefill_contiguous(&qs, &kk, &vv, s.ctx_before)?;
            self.stats.add_scratch(scratch + kv_bytes);
            o
        } else {
            let (o, scratch) =
                prefill_attention(&qs, &kk, &vv, s.ctx_before, chunk, self.scratch_limit)?;
            self.stats.add_scratch(scratch + kv_bytes);
            o
        };
        // Column importance (algorithms.md §4): Σ_t |Q̃[t, c]| over the group's heads.
        let start = self.event()?;
        let a_l = self.a.get(layer)?;
        let uq = colabs(&qs, kvh, &a_l)?;
        let st = self.seqs.get_mut(&s.id).expect("admitted");
        st.uq[li] = Some(match st.uq[li].take() {
            Some(u) => (u + uq)?,
            None => uq,
        });
        if n >= st.info.prefill_len {
            let u = (st.uq[li].take().expect("set above") + colabs(&kk, kvh, &a_l)?)?;
            let u = u.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            let r = self.r;
            let mut cols = Vec::with_capacity(kvh * r);
            for g in 0..kvh {
                cols.extend(
                    top_k(&u[g * d..(g + 1) * d], r)
                        .into_iter()
                        .map(|c| c as i32),
                );
            }
            let per_layer = kvh * r;
            st.cols[li * per_layer..(li + 1) * per_layer].copy_from_slice(&cols);
            let slot = st.slot;
            let per = self.cols_per_seq();
            let mut dst = self
                .cols
                .slice_mut(slot * per + li * per_layer..slot * per + (li + 1) * per_layer);
            self.dev.cuda_stream().memcpy_htod(&cols, &mut dst).w()?;
            let slots: Vec<i32> = (0..n)
                .map(|p| as_i32(self.tables.slot(s.id, p), "pool slot"))
                .collect::<Result<_>>()?;
            let src: Vec<i32> = (0..n as i32).collect();
            let (src_d, dst_d, seq_d) = (
                upload_i32(&self.dev, &src)?,
                upload_i32(&self.dev, &slots)?,
                upload_i32(&self.dev, &vec![as_i32(slot, "sequence slot")?; n])?,
            );
            let rows = KhatRows {
                src: &src_d,
                dst: &dst_d,
                seq: &seq_d,
                count: n,
            };
            khat_write(
                &self.dev,
                self.dims(),
                li,
                &a_l,
                &self.cols,
                &kk,
                &rows,
                &mut self.khat[li],
            )?;
        }
        let end = self.event()?;
        self.cache_events.push((start, end));
        Ok(out)
    }
}

/// Σ_t |(x_t A_g)[c]| per KV head g over the rows of `x` (`[T, heads, D]`, heads a
/// multiple of KVH: each group's heads summed) with `a` `[KVH, D, D]` f32. `[KVH, D]`.
fn colabs(x: &Tensor, kvh: usize, a: &Tensor) -> Result<Tensor> {
    let (t, heads, d) = x.dims3()?;
    let g = heads / kvh;
    let rows = (COLABS_ROWS / g).max(1);
    let mut acc: Option<Tensor> = None;
    for t0 in (0..t).step_by(rows) {
        let c = rows.min(t - t0);
        let part = x
            .narrow(0, t0, c)?
            .to_dtype(DType::F32)?
            .reshape((c, kvh, g, d))?
            .permute((1, 0, 2, 3))?
            .contiguous()?
            .reshape((kvh, c * g, d))?
            .matmul(a)?
            .abs()?
            .sum(1)?;
        acc = Some(match acc {
            None => part,
            Some(s) => (s + part)?,
        });
    }
    match acc {
        Some(a) => Ok(a),
        None => Ok(Tensor::zeros((kvh, d), DType::F32, x.device())?),
    }
}

/// Sizes the InfiniGen kernels share.
#[derive(Debug, Clone, Copy)]
pub struct IgDims {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Partial-key columns per KV head.
    pub r: usize,
    /// Offloaded layers (layers of the host tier).
    pub off_layers: usize,
    /// Tokens per block of the device pool and the host tier.
    pub block_size: usize,
}

impl IgDims {
    fn row(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// The paged decode over staging buffers (rows of `B` slots in blocks of
    /// `STAGE_BLOCK`).
    pub fn stage_shape(&self) -> DecodeShape {
        DecodeShape {
            num_heads: self.num_heads,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            block_size: STAGE_BLOCK,
            part_size: PART_SIZE,
        }
    }
}

/// K/V rows `[T, KVH, D]` (bf16) to host-tier `slots` (one per row) of offloaded layer
/// `li`.
pub fn host_write(
    dev: &CudaDevice,
    tier: &PinnedTier,
    dims: IgDims,
    li: usize,
    k: &Tensor,
    v: &Tensor,
    slots: &CudaSlice<i32>,
) -> Result<()> {
    let t = k.dim(0)?;
    if t == 0 {
        return Ok(());
    }
    let (k, v) = (k.contiguous()?, v.contiguous()?);
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let kv = view(&ks, kl, "host_write k")?;
    let vv = view(&vs, vl, "host_write v")?;
    let (li_i, off_i, bs_i) = (
        as_i32(li, "layer")?,
        as_i32(dims.off_layers, "layers")?,
        as_i32(dims.block_size, "block size")?,
    );
    let (re_i, bpc_i) = (
        as_i32(dims.row(), "KV row")?,
        as_i32(tier.layout.per_chunk, "blocks per chunk")?,
    );
    let f = dev.get_or_load_custom_func("ig_host_write", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&kv)
        .arg(&vv)
        .arg(&tier.ptrs_dev)
        .arg(slots)
        .arg(&li_i)
        .arg(&off_i)
        .arg(&bs_i)
        .arg(&re_i)
        .arg(&bpc_i);
    let cfg = LaunchConfig {
        grid_dim: (t as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// Positions `0..n` of offloaded layer `li` of a sequence (host block `table`) as
/// contiguous `[n, KVH, D]` K and V on the device.
pub fn host_read(
    dev: &CudaDevice,
    tier: &PinnedTier,
    dims: IgDims,
    li: usize,
    table: &[i32],
    n: usize,
) -> Result<(Tensor, Tensor)> {
    let (kvh, d) = (dims.num_kv_heads, dims.head_dim);
    let row = dims.row();
    // SAFETY: the kernel writes every element.
    let (mut k, mut v) = unsafe { (dev.alloc::<bf16>(n * row)?, dev.alloc::<bf16>(n * row)?) };
    if n > 0 {
        let table = upload_i32(dev, table)?;
        let (li_i, off_i, bs_i) = (
            as_i32(li, "layer")?,
            as_i32(dims.off_layers, "layers")?,
            as_i32(dims.block_size, "block size")?,
        );
        let (re_i, bpc_i) = (
            as_i32(row, "KV row")?,
            as_i32(tier.layout.per_chunk, "blocks per chunk")?,
        );
        let f = dev.get_or_load_custom_func("ig_host_read", MODULE, PTX)?;
        let mut b = f.builder();
        b.arg(&tier.ptrs_dev)
            .arg(&table)
            .arg(&li_i)
            .arg(&off_i)
            .arg(&bs_i)
            .arg(&re_i)
            .arg(&bpc_i)
            .arg(&mut k)
            .arg(&mut v);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        unsafe { b.launch(cfg) }.w()?;
    }
    Ok((
        tensor_from(dev, k, (n, kvh, d)),
        tensor_from(dev, v, (n, kvh, d)),
    ))
}

/// Which rows of `k` become which partial keys: `count` rows `src` of `k`, written to
/// pool slots `dst` with the columns of sequence slot `seq` of each.
pub struct KhatRows<'a> {
    pub src: &'a CudaSlice<i32>,
    pub dst: &'a CudaSlice<i32>,
    pub seq: &'a CudaSlice<i32>,
    pub count: usize,
}

/// Partial keys `K̂ = K·A[:, cols]` of offloaded layer `li` (`a_l` its `[KVH, D, D]`
/// f32 skewing matrices, `cols` the column table) into `khat` (`[slots, KVH, r]`).
#[allow(clippy::too_many_arguments)]
pub fn khat_write(
    dev: &CudaDevice,
    dims: IgDims,
    li: usize,
    a_l: &Tensor,
    cols: &CudaSlice<i32>,
    k: &Tensor,
    rows: &KhatRows<'_>,
    khat: &mut CudaSlice<bf16>,
) -> Result<()> {
    if rows.count == 0 {
        return Ok(());
    }
    let k = k.contiguous()?;
    let (ks, kl) = k.storage_and_layout();
    let kv = view(&ks, kl, "khat_write k")?;
    let (as_, al) = a_l.storage_and_layout();
    let av = view_of::<f32>(&as_, al, "skewing matrices")?;
    let (li_i, off_i) = (as_i32(li, "layer")?, as_i32(dims.off_layers, "layers")?);
    let (kvh_i, d_i, r_i) = (
        as_i32(dims.num_kv_heads, "KV heads")?,
        as_i32(dims.head_dim, "D")?,
        as_i32(dims.r, "r")?,
    );
    let f = dev.get_or_load_custom_func("ig_khat_write", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&kv)
        .arg(rows.src)
        .arg(rows.dst)
        .arg(rows.seq)
        .arg(&av)
        .arg(cols)
        .arg(&li_i)
        .arg(&off_i)
        .arg(&kvh_i)
        .arg(&d_i)
        .arg(&r_i)
        .arg(khat);
    let cfg = LaunchConfig {
        grid_dim: (rows.count as u32, dims.num_kv_heads as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: (dims.head_dim * 4) as u32,
    };
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// The decode rows a speculation ranges over: per row its column-table slot, the
/// positions before the new token (`nctx`), `k_max`, and its pool block table; `stride`
/// ≥ the largest `nctx` (the score buffer's row length).
pub struct SpecRows<'a> {
    pub row_seq: &'a CudaSlice<i32>,
    pub nctx: &'a CudaSlice<i32>,
    pub kmax: &'a CudaSlice<i32>,
    pub tables: &'a DecodeTables,
    pub stride: usize,
}

/// Where a selection goes: positions `[R, KVH, kcap]`, counts `ks[R]`, the staging
/// attention's context lengths (count + 1) and optionally a log of the counts.
pub struct SelectOut<'a> {
    pub sel: &'a mut CudaSlice<i32>,
    pub kcap: usize,
    pub ks: &'a mut CudaSlice<i32>,
    pub stage_ctx: &'a mut CudaSlice<i32>,
    pub klog: Option<CudaViewMut<'a, i32>>,
}

/// Speculated scores (`scores` `[R, H, stride]`), the α counts (`counts` `[R, H]`) and
/// the per-KV-head top-k selection of offloaded layer `li` for queries `q` (`[R, H, D]`,
/// rotated), as algorithms.md §4 steps 1–4.
#[allow(clippy::too_many_arguments)]
pub fn speculate_select(
    dev: &CudaDevice,
    dims: IgDims,
    li: usize,
    q: &Tensor,
    a_l: &Tensor,
    cols: &CudaSlice<i32>,
    khat: &CudaSlice<bf16>,
    rows: &SpecRows<'_>,
    alpha: f32,
    scores: &mut CudaSlice<f32>,
    counts: &mut CudaSlice<i32>,
    out: SelectOut<'_>,
) -> Result<()> {
    let (h, kvh, d) = (dims.num_heads, dims.num_kv_heads, dims.head_dim);
    let nrows = rows.tables.rows;
    if nrows == 0 {
        return Ok(());
    }
    if scores.len() < nrows * h * rows.stride
        || counts.len() < nrows * h
        || out.sel.len() < nrows * kvh * out.kcap
        || out.ks.len() < nrows
    {
        return Err(Error::Config(format!(
            "infinigen selection: buffers too small for {nrows} rows of up to {} positions",
            rows.stride
        )));
    }
    let q = q.to_dtype(DType::BF16)?.contiguous()?;
    let (qs, ql) = q.storage_and_layout();
    let qv = view(&qs, ql, "speculation q")?;
    let (as_, al) = a_l.storage_and_layout();
    let av = view_of::<f32>(&as_, al, "skewing matrices")?;
    let (li_i, off_i) = (as_i32(li, "layer")?, as_i32(dims.off_layers, "layers")?);
    let (h_i, kvh_i, d_i, r_i) = (
        as_i32(h, "heads")?,
        as_i32(kvh, "KV heads")?,
        as_i32(d, "D")?,
        as_i32(dims.r, "r")?,
    );
    let (bs_i, mb_i, stride_i) = (
        as_i32(dims.block_size, "block size")?,
        as_i32(rows.tables.max_blocks, "blocks")?,
        as_i32(rows.stride, "stride")?,
    );
    let scale = 1.0f32 / (d as f32).sqrt();
    let f = dev.get_or_load_custom_func("ig_spec_scores", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&qv)
        .arg(&av)
        .arg(cols)
        .arg(rows.row_seq)
        .arg(&li_i)
        .arg(&off_i)
        .arg(khat)
        .arg(&rows.tables.tables)
        .arg(&mb_i)
        .arg(rows.nctx)
        .arg(&mut *scores)
        .arg(&stride_i)
        .arg(&h_i)
        .arg(&kvh_i)
        .arg(&d_i)
        .arg(&r_i)
        .arg(&bs_i)
        .arg(&scale);
    let cfg = LaunchConfig {
        grid_dim: (
            nrows as u32,
            kvh as u32,
            rows.stride.div_ceil(IG_THREADS as usize) as u32,
        ),
        block_dim: (IG_THREADS, 1, 1),
        shared_mem_bytes: ((h / kvh) * (d + dims.r) * 4) as u32,
    };
    unsafe { b.launch(cfg) }.w()?;

    let f = dev.get_or_load_custom_func("ig_count", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&*scores)
        .arg(rows.nctx)
        .arg(&stride_i)
        .arg(&alpha)
        .arg(&mut *counts);
    let cfg = LaunchConfig {
        grid_dim: (nrows as u32, h as u32, 1),
        block_dim: (IG_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { b.launch(cfg) }.w()?;

    let kcap_i = as_i32(out.kcap, "selection capacity")?;
    let null: u64 = 0;
    let f = dev.get_or_load_custom_func("ig_select", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&*scores)
        .arg(&*counts)
        .arg(rows.nctx)
        .arg(rows.kmax)
        .arg(&stride_i)
        .arg(&h_i)
        .arg(&kvh_i)
        .arg(out.sel)
        .arg(&kcap_i)
        .arg(out.ks)
        .arg(out.stage_ctx);
    let mut klog = out.klog;
    match klog.as_mut() {
        Some(l) => b.arg(l),
        None => b.arg(&null),
    };
    let cfg = LaunchConfig {
        grid_dim: (nrows as u32, kvh as u32, 1),
        block_dim: (IG_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// What a gather reads: each decode row's host block table (`[R, max_hblocks]`) and
/// its selection (positions `[R, KVH, kcap]`, counts `ks`).
pub struct GatherSrc<'a> {
    pub host_tables: &'a CudaSlice<i32>,
    pub max_hblocks: usize,
    pub sel: &'a CudaSlice<i32>,
    pub kcap: usize,
    pub ks: &'a CudaSlice<i32>,
    pub rows: usize,
    /// Positions each row selected among (`[R]`), at most `stride`: the token-major
    /// gather walks them.
    pub nctx: &'a CudaSlice<i32>,
    pub stride: usize,
}

/// In which order a zero-copy gather reads the host tier (`KVBENCH_IG_GATHER`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GatherOrder {
    /// A warp per selected (row, KV head, j), in the selection's order (`ig_gather`).
    Heads,
    /// A warp per position of a row, copying the slices of every head that selected it
    /// (`ig_mark`, then `ig_gather_tokens`): a token's selected slices are read together,
    /// a block's reads ascend through the row's host blocks.
    Tokens,
}

/// [`GatherOrder`] from the environment, read once per process: unset, the head order;
/// `tokens`, the token order (not yet the default: it has not run on a GPU); any other
/// value is an error naming it.
pub fn gather_order() -> Result<GatherOrder> {
    static CHOICE: std::sync::OnceLock<std::result::Result<GatherOrder, String>> =
        std::sync::OnceLock::new();
    crate::switch_once(
        &CHOICE,
        "KVBENCH_IG_GATHER",
        &[
            ("tokens", GatherOrder::Tokens),
            ("heads", GatherOrder::Heads),
        ],
        GatherOrder::Heads,
        "the head order",
    )
}

/// The selected K/V rows of offloaded layer `li` from the host tier into `stage`
/// (row r's j-th selection of KV head g at slot `r·b + j`, head g), on `stream`.
/// With [`GatherOrder::Tokens`], `marks` (at least `rows · KVH · stride` elements, all
/// zero) holds the selection's marks between its two passes and is all zero again after.
#[allow(clippy::too_many_arguments)]
pub fn gather(
    stream: &Arc<CudaStream>,
    dev: &CudaDevice,
    tier: &PinnedTier,
    dims: IgDims,
    li: usize,
    src: &GatherSrc<'_>,
    stage: &mut LayerCache,
    b: usize,
    order: GatherOrder,
    marks: &mut CudaSlice<i32>,
) -> Result<()> {
    if src.rows == 0 {
        return Ok(());
    }
    // The token order needs a mark per (row, KV head, position) and a lane per KV head;
    // asked for past 32 KV heads it is refused, not swapped for the head order under a
    // cell identity that names it.
    let tokens = order == GatherOrder::Tokens;
    if tokens && dims.num_kv_heads > 32 {
        return Err(Error::Config(format!(
            "KVBENCH_IG_GATHER=tokens gathers up to 32 KV heads a lane each, not {}: \
             use KVBENCH_IG_GATHER=heads",
            dims.num_kv_heads
        )));
    }
    if stage.k.len() < src.rows * b * dims.row()
        || src.kcap >= b
        || (tokens && marks.len() < src.rows * dims.num_kv_heads * src.stride)
    {
        return Err(Error::Config(format!(
            "infinigen gather: staging of {} elements for {} rows of {b} slots (selection \
             capacity {}); {} marks for {} positions a row",
            stage.k.len(),
            src.rows,
            src.kcap,
            marks.len(),
            src.stride
        )));
    }
    let (mhb_i, kcap_i, li_i) = (
        as_i32(src.max_hblocks, "host blocks")?,
        as_i32(src.kcap, "selection capacity")?,
        as_i32(li, "layer")?,
    );
    let (off_i, bs_i, kvh_i, d_i) = (
        as_i32(dims.off_layers, "layers")?,
        as_i32(dims.block_size, "block size")?,
        as_i32(dims.num_kv_heads, "KV heads")?,
        as_i32(dims.head_dim, "D")?,
    );
    let (bpc_i, b_i, stride_i) = (
        as_i32(tier.layout.per_chunk, "blocks per chunk")?,
        as_i32(b, "staging slots")?,
        as_i32(src.stride, "positions")?,
    );
    let block_dim = ((GATHER_WARPS * 32) as u32, 1, 1);
    if !tokens {
        let f = dev.get_or_load_custom_func("ig_gather", MODULE, PTX)?;
        let mut lb = stream.launch_builder(&f);
        lb.arg(&tier.ptrs_dev)
            .arg(src.host_tables)
            .arg(&mhb_i)
            .arg(src.sel)
            .arg(&kcap_i)
            .arg(src.ks)
            .arg(&li_i)
            .arg(&off_i)
            .arg(&bs_i)
            .arg(&kvh_i)
            .arg(&d_i)
            .arg(&bpc_i)
            .arg(&mut stage.k)
            .arg(&mut stage.v)
            .arg(&b_i);
        let cfg = LaunchConfig {
            grid_dim: (
                src.rows as u32,
                dims.num_kv_heads as u32,
                src.kcap.div_ceil(GATHER_WARPS) as u32,
            ),
            block_dim,
            shared_mem_bytes: 0,
        };
        unsafe { lb.launch(cfg) }.w()?;
        return Ok(());
    }

    // Token order: the marks (`ig_mark`), then a warp per position (`ig_gather_tokens`).
    const MARK_THREADS: usize = 256;
    let f = dev.get_or_load_custom_func("ig_mark", MODULE, PTX)?;
    let mut lb = stream.launch_builder(&f);
    lb.arg(src.sel)
        .arg(&kcap_i)
        .arg(src.ks)
        .arg(&kvh_i)
        .arg(&stride_i)
        .arg(&mut *marks);
    let cfg = LaunchConfig {
        grid_dim: (
            src.rows as u32,
            dims.num_kv_heads as u32,
            src.kcap.div_ceil(MARK_THREADS) as u32,
        ),
        block_dim: (MARK_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { lb.launch(cfg) }.w()?;
    let f = dev.get_or_load_custom_func("ig_gather_tokens", MODULE, PTX)?;
    let mut lb = stream.launch_builder(&f);
    lb.arg(&tier.ptrs_dev)
        .arg(src.host_tables)
        .arg(&mhb_i)
        .arg(&mut *marks)
        .arg(&stride_i)
        .arg(src.nctx)
        .arg(&li_i)
        .arg(&off_i)
        .arg(&bs_i)
        .arg(&kvh_i)
        .arg(&d_i)
        .arg(&bpc_i)
        .arg(&mut stage.k)
        .arg(&mut stage.v)
        .arg(&b_i);
    let cfg = LaunchConfig {
        grid_dim: (src.stride.div_ceil(GATHER_WARPS) as u32, src.rows as u32, 1),
        block_dim,
        shared_mem_bytes: 0,
    };
    unsafe { lb.launch(cfg) }.w()?;
    Ok(())
}

/// Each decode row's new K/V (rows `src_rows` of `k`/`v` `[T, KVH, D]`) into staging
/// slot `r·b + ks[r]`, after its selection.
#[allow(clippy::too_many_arguments)]
pub fn stage_own(
    dev: &CudaDevice,
    dims: IgDims,
    k: &Tensor,
    v: &Tensor,
    src_rows: &CudaSlice<i32>,
    ks: &CudaSlice<i32>,
    rows: usize,
    b: usize,
    stage: &mut LayerCache,
) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    let (k, v) = (k.contiguous()?, v.contiguous()?);
    let (ks_, kl) = k.storage_and_layout();
    let (vs_, vl) = v.storage_and_layout();
    let kv = view(&ks_, kl, "stage_own k")?;
    let vv = view(&vs_, vl, "stage_own v")?;
    let (b_i, re_i) = (as_i32(b, "staging slots")?, as_i32(dims.row(), "KV row")?);
    let f = dev.get_or_load_custom_func("ig_stage_own", MODULE, PTX)?;
    let mut lb = f.builder();
    lb.arg(&kv)
        .arg(&vv)
        .arg(src_rows)
        .arg(ks)
        .arg(&b_i)
        .arg(&re_i)
        .arg(&mut stage.k)
        .arg(&mut stage.v);
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (dims.row().min(1024) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    unsafe { lb.launch(cfg) }.w()?;
    Ok(())
}

impl KvPolicy for CudaInfinigenPolicy {
    fn name(&self) -> &'static str {
        "infinigen"
    }

    fn admit(&mut self, seq: SeqId, info: SeqInfo) -> Result<()> {
        self.admit_seq(seq, info)
    }

    fn set_scratch_limit(&mut self, limit: Option<u64>) {
        self.scratch_limit = limit;
    }

    /// Pin the host tier and size the step buffers for the workload ahead: pinning
    /// takes tens of milliseconds per chunk, which would otherwise land in the steps
    /// that first reach it.
    fn prepare(&mut self, held: &[SeqInfo]) -> Result<()> {
        let held: Vec<usize> = held
            .iter()
            .map(|i| i.prompt_len + i.max_new_tokens)
            .collect();
        if self.off() == 0 || held.is_empty() {
            return Ok(());
        }
        let tokens: usize = held.iter().sum();
        self.host
            .pin_ahead(tokens.div_ceil(self.block_size) + held.len())?;
        // A selection holds at most k_max at the full length (budget × length).
        let longest = held.iter().copied().max().unwrap_or(1);
        let kcap = held
            .iter()
            .map(|&n| ((self.params.budget * n as f64).ceil() as usize).min(n))
            .max()
            .unwrap_or(1)
            .max(1);
        let b = (kcap + 1).div_ceil(STAGE_BLOCK) * STAGE_BLOCK;
        self.ensure_buffers(held.len(), kcap, b, longest)
    }

    fn reserve(&mut self, seq: SeqId, total_tokens: usize) -> Result<bool> {
        if !self.seqs.contains_key(&seq) {
            self.admit_seq(seq, SeqInfo::unannounced(total_tokens))?;
        }
        if !self.tables.reserve(seq, total_tokens) {
            return Ok(false);
        }
        if self.off() == 0 {
            return Ok(true);
        }
        // A failed pinning is the step's error, not a full pool.
        self.host.reserve(seq, total_tokens)
    }

    fn fits(&self, total_tokens: usize) -> bool {
        self.tables.fits(total_tokens) && (self.off() == 0 || self.host.tables.fits(total_tokens))
    }

    fn release(&mut self, seq: SeqId) {
        self.tables.release(seq);
        self.host.tables.release(seq);
        if let Some(s) = self.seqs.remove(&seq) {
            self.free_slots.push(s.slot);
        }
    }

    fn attend(&mut self, batch: &StepBatch, input: &LayerInput<'_>) -> Result<Tensor> {
        let layer = input.layer;
        let q = input.q.to_dtype(DType::BF16)?;
        let k = input.k.to_dtype(DType::BF16)?.contiguous()?;
        let v = input.v.to_dtype(DType::BF16)?.contiguous()?;
        if layer == 0 || self.plan.is_none() {
            self.grow_device()?;
            self.plan = Some(self.plan(batch)?);
        }
        let offloaded = layer >= self.dense;

        // The step's K/V: the device pool (dense layers) or the host tier; the decode
        // rows' partial keys.
        let start = self.event()?;
        if offloaded {
            let li = layer - self.dense;
            self.host_write(li, &k, &v)?;
            let plan = self.plan.take().expect("planned");
            if let Some(dp) = &plan.dec {
                let rows = KhatRows {
                    src: &dp.src_rows,
                    dst: &dp.khat_slots,
                    seq: &dp.row_seq,
                    count: dp.rows.len(),
                };
                khat_write(
                    &self.dev,
                    self.dims(),
                    li,
                    &self.a.get(layer)?,
                    &self.cols,
                    &k,
                    &rows,
                    &mut self.khat[li],
                )?;
            }
            self.plan = Some(plan);
        } else {
            let plan = self.plan.as_ref().expect("planned");
            kv_write_at(&mut self.dense_kv[layer], &k, &v, &plan.dense_slots)?;
        }
        let end = self.event()?;
        self.cache_events.push((start, end));

        let has_dec = self.plan.as_ref().is_some_and(|p| p.dec.is_some());
        let next = layer + 1;
        if has_dec
            && self.params.speculation == Speculation::Previous
            && next >= self.dense
            && next < self.num_layers
        {
            // Layer ℓ+1's selection from this layer's input, issued before this
            // layer's attention so its gather overlaps it.
            let qn = self.speculative_q(input, next)?;
            self.speculate(next, &qn)?;
        }

        let dec_out = if !has_dec {
            None
        } else if offloaded {
            if self.params.speculation == Speculation::Oracle {
                let dp = self
                    .plan
                    .as_ref()
                    .and_then(|p| p.dec.as_ref())
                    .expect("decode");
                let qd = match &dp.idx {
                    Some(idx) => q.index_select(idx, 0)?,
                    None => q.clone(),
                };
                self.speculate(layer, &qd)?;
            }
            if self.params.transfer == Transfer::Memcpy {
                self.fetch(layer)?;
            }
            Some(self.attend_staged(layer, &q, &k, &v)?)
        } else {
            let (h, kvh, d) = self.heads;
            let dp = self
                .plan
                .as_ref()
                .and_then(|p| p.dec.as_ref())
                .expect("decode");
            let qd = match &dp.idx {
                Some(idx) => q.index_select(idx, 0)?,
                None => q.clone(),
            };
            for (&i, &pos) in dp.rows.iter().zip(&dp.positions) {
                self.attended.push(AttendRecord {
                    seq: batch.seqs[i].id,
                    layer,
                    attended: pos as usize + 1,
                    context: pos as usize + 1,
                });
            }
            let shape = DecodeShape {
                num_heads: h,
                num_kv_heads: kvh,
                head_dim: d,
                block_size: self.block_size,
                part_size: PART_SIZE,
            };
            Some(paged_decode(
                &self.dense_kv[layer],
                &qd,
                &dp.dense_tables,
                shape,
            )?)
        };

        let decode: Vec<bool> = batch
            .seqs
            .iter()
            .map(|s| self.seqs[&s.id].prefilled())
            .collect();
        let out = join_rows(batch, &decode, dec_out.as_ref(), |s| {
            self.prefill(layer, s, &q, &k, &v)
        })?;

        if layer + 1 == self.num_layers {
            for s in &batch.seqs {
                self.tables.set_len(s.id, s.ctx_before + s.q_len);
                self.host.tables.set_len(s.id, s.ctx_before + s.q_len);
                if let Some(st) = self.seqs.get_mut(&s.id) {
                    st.computed = s.ctx_before + s.q_len;
                }
            }
        }
        Ok(out.to_dtype(input.q.dtype())?)
    }

    fn end_step(&mut self, batch: &StepBatch) -> Result<()> {
        let Some(plan) = self.plan.take() else {
            return Ok(());
        };
        self.gathered = [None, None];
        self.idx_ready = [None, None];
        self.attn_done = [None, None];
        self.copied = [None, None];
        let (Some(dp), false) = (plan.dec.as_ref(), plan.staged.is_empty()) else {
            return Ok(());
        };
        // Each offloaded layer's selected counts (this synchronizes the step).
        let nrows = dp.rows.len();
        let (_, kvh, d) = self.heads;
        let counts = self
            .dev
            .cuda_stream()
            .clone_dtoh(&self.bufs.klog.slice(0..self.off() * nrows))
            .w()?;
        for &layer in &plan.staged {
            let li = layer - self.dense;
            for (r, (&i, &pos)) in dp.rows.iter().zip(&dp.positions).enumerate() {
                let k = counts[li * nrows + r].max(0) as usize;
                self.stats.h2d_bytes += (2 * k * kvh * d * 2) as u64;
                self.attended.push(AttendRecord {
                    seq: batch.seqs[i].id,
                    layer,
                    attended: k + 1,
                    context: pos as usize + 1,
                });
            }
        }
        Ok(())
    }

    fn memory(&self) -> PolicyMemory {
        // The step buffers (staging, scores, selections) are charged to each step's
        // scratch, like attention's score matrices.
        let fixed = (self.a.elem_count() * 4) as u64;
        PolicyMemory {
            // The pool as allocated, or as it grows at the next step's first layer.
            device_reserved: self.block_bytes
                * self.tables.num_blocks().max(self.alloc_blocks) as u64
                + fixed,
            device_used: self.block_bytes * self.tables.num_used() as u64 + fixed,
            host_reserved: self.host.allocated_bytes()
                + self.bufs.pinned.as_ref().map_or(0, PinnedStaging::bytes),
            host_used: self.host.tables.num_used() as u64 * self.host.block_bytes(),
        }
    }

    fn seq_device_bytes(&self, seq: SeqId) -> u64 {
        self.tables.table(seq).len() as u64 * self.block_bytes
    }

    fn seq_host_bytes(&self, seq: SeqId) -> u64 {
        self.host.tables.table(seq).len() as u64 * self.host.block_bytes()
    }

    fn take_stats(&mut self) -> PolicyStats {
        // The step's logits were read back, so its events have completed.
        let stalled = drain_event_seconds(&mut self.stall_events, &mut self.event_errors);
        self.stats.cache_ops_s +=
            drain_event_seconds(&mut self.cache_events, &mut self.event_errors) + stalled;
        self.stats.transfer_s += stalled;
        std::mem::take(&mut self.stats)
    }

    fn take_attended(&mut self) -> Vec<AttendRecord> {
        std::mem::take(&mut self.attended)
    }

    fn check_invariants(&self) -> std::result::Result<(), String> {
        self.tables.check_invariants()?;
        self.host.tables.check_invariants()
    }
}
