//! CUDA graphs of decode steps (on by default; `KVBENCH_CUDA_GRAPH=off` launches every
//! kernel from the host, as before). A decode step launches some
//! fifteen kernels a layer, each a few microseconds of host time, and at batch 1 the
//! host barely keeps ahead of the card (docs/cuda.md, `launch_s`). A graph records the
//! step's kernels once and replays them in one launch.
//!
//! What a replay may not do, and how it is avoided: read anything from the host (the
//! token ids, RoPE rows, write slots, block tables and context lengths live in fixed
//! device buffers, written before each replay: [`KvPolicy::bind_graph_step`] and the
//! ids and rows here), change a grid or an argument (one graph per row count and context
//! bucket, [`crate::decode_graphs`]: the paged decode's grid is sized for the bucket and
//! shorter rows leave partitions empty), allocate outside the stream (candle allocates
//! stream-ordered, so the step's temporaries become the graph's own allocations, freed
//! inside it), or upload kernel parameters (a warm-up run fills candle's cache of them
//! before capture). The logits are copied into a buffer of the graph's; the argmax
//! after it runs as for any other step. A shape is captured when two steps in a row
//! need it ([`GraphCache::runs_from_graph`]); a step of any other shape runs as it
//! would without graphs, its shape known from [`KvPolicy::plan_graph_step`] before
//! anything is bound for it.
//!
//! On an H100 graphs passed `kvbench verify --device cuda` (identical logits to the
//! launched steps for H2O at 0.3) and made decode steps 2–13 % shorter
//! (results/baselines/h100/NOTES.md, fifth lease).

use crate::cuda::{device_of, view_of};
use crate::decode_graphs::{GraphCache, GraphKey, GraphStats, MAX_GRAPHS};
use crate::error::{Error, Result};
use crate::model::Llama;
use crate::policy::{KvPolicy, StepBatch};
use candle_core::cuda_backend::cudarc::driver::sys::{
    CUgraphInstantiate_flags, CUstreamCaptureMode,
};
use candle_core::cuda_backend::cudarc::driver::{result, CudaGraph, DevicePtr, DeviceRepr};
use candle_core::cuda_backend::{CudaDType, WrapErr};
use candle_core::{DType, Tensor};
use half::bf16;

/// Whether decode steps run from CUDA graphs: unless `KVBENCH_CUDA_GRAPH=off` (launched
/// kernel by kernel), read once per process.
pub fn graphs_chosen() -> Result<bool> {
    static CHOICE: std::sync::OnceLock<std::result::Result<bool, String>> =
        std::sync::OnceLock::new();
    crate::switch_once(
        &CHOICE,
        "KVBENCH_CUDA_GRAPH",
        &[("on", true), ("off", false)],
        true,
        "decode steps from CUDA graphs",
    )
}

/// One captured decode step and the buffers it reads and writes.
struct Captured {
    graph: CudaGraph,
    ids: Tensor,
    cos: Tensor,
    sin: Tensor,
    /// The logits, `[rows, vocab]` f32.
    out: Tensor,
}

/// The decode graphs of one engine.
pub struct DecodeGraphs {
    cache: GraphCache<Captured>,
    stats: GraphStats,
}

impl Default for DecodeGraphs {
    fn default() -> Self {
        Self::new()
    }
}

impl DecodeGraphs {
    pub fn new() -> Self {
        Self {
            cache: GraphCache::new(MAX_GRAPHS),
            stats: GraphStats::default(),
        }
    }

    pub fn stats(&self) -> GraphStats {
        self.stats
    }

    /// The logits of a decode step (every row one new token, every row sampled) run
    /// from a graph, captured first if none has its shape; `None` where the step runs
    /// as usual (a policy without decode graphs, other weights than bf16, streams that
    /// synchronize through events, which a capture cannot take).
    pub fn forward(
        &mut self,
        model: &Llama,
        policy: &mut dyn KvPolicy,
        tokens: &[u32],
        positions: &[u32],
        batch: &StepBatch,
    ) -> Result<Option<Tensor>> {
        if tokens.is_empty() || model.dtype() != DType::BF16 || batch.num_tokens != tokens.len() {
            return Ok(None);
        }
        let dev = device_of(model.device())?;
        if dev
            .cuda_stream()
            .context()
            .is_managing_stream_synchronization()
        {
            return Ok(None);
        }
        let Some(plan) = policy.plan_graph_step(batch)? else {
            return Ok(None);
        };
        let key = GraphKey {
            rows: tokens.len(),
            ctx_bucket: plan.ctx_bucket,
            variant: plan.variant,
        };
        self.cache.set_epoch(plan.epoch);
        if !self.cache.runs_from_graph(key) {
            // A shape no graph holds, seen once so far: the step runs as usual, with
            // no fixed buffers made for it.
            return Ok(None);
        }
        let Some(bound) = policy.bind_graph_step(batch)? else {
            return Err(Error::Config(format!(
                "a decode step planned for a CUDA graph ({} rows, contexts up to {}) \
                 could not be bound to one",
                key.rows, key.ctx_bucket
            )));
        };
        if (bound.ctx_bucket, bound.variant) != (plan.ctx_bucket, plan.variant) {
            return Err(Error::Config(format!(
                "a decode step planned for the CUDA graph of contexts up to {} (variant \
                 {}) was bound to contexts up to {} (variant {})",
                plan.ctx_bucket, plan.variant, bound.ctx_bucket, bound.variant
            )));
        }
        // Binding may have dropped every fixed buffer set for room (a new epoch): the
        // graphs that read them go, and this step captures its shape again.
        self.cache.set_epoch(bound.epoch);
        let (c, s) = model.rope_rows(positions);
        let to_bf16 = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<_>>();
        let (cos, sin) = (to_bf16(c), to_bf16(s));
        if let Some(g) = self.cache.get(key) {
            write_tensor(&g.ids, tokens)?;
            write_tensor(&g.cos, &cos)?;
            write_tensor(&g.sin, &sin)?;
            g.graph.launch().w()?;
            self.stats.replayed += 1;
            return Ok(Some(g.out.clone()));
        }
        let inputs = Inputs::new(model, tokens, &cos, &sin)?;
        // The step that captures is the warm-up run: it is not replayed, since a step
        // that evicts is not idempotent (its probabilities would be added twice and its
        // victims moved again).
        let g = capture(model, policy, batch, positions, inputs).map_err(|e| {
            Error::Config(format!(
                "CUDA graph of a decode step ({} rows, contexts up to {}, variant {}): \
                 {e} (KVBENCH_CUDA_GRAPH=off runs without graphs)",
                key.rows, key.ctx_bucket, key.variant
            ))
        })?;
        self.stats.captured += 1;
        let out = g.out.clone();
        self.cache.insert(key, g);
        Ok(Some(out))
    }
}

/// A step's token ids and RoPE rows on the device, the inputs a graph reads.
struct Inputs {
    ids: Tensor,
    cos: Tensor,
    sin: Tensor,
}

impl Inputs {
    fn new(model: &Llama, tokens: &[u32], cos: &[bf16], sin: &[bf16]) -> Result<Self> {
        let d = model.device();
        let rows = tokens.len();
        let half = cos.len() / rows;
        let inputs = Self {
            ids: Tensor::zeros(rows, DType::U32, d)?,
            cos: Tensor::zeros((rows, half), DType::BF16, d)?,
            sin: Tensor::zeros((rows, half), DType::BF16, d)?,
        };
        write_tensor(&inputs.ids, tokens)?;
        write_tensor(&inputs.cos, cos)?;
        write_tensor(&inputs.sin, sin)?;
        Ok(inputs)
    }
}

/// The step's forward from `inputs`: its logits into `out` (set to them when `None`,
/// copied into it otherwise: a graph's buffer).
fn run(
    model: &Llama,
    policy: &mut dyn KvPolicy,
    batch: &StepBatch,
    positions: &[u32],
    inputs: &Inputs,
    out: &mut Option<Tensor>,
) -> Result<()> {
    let rotates = policy.rotates_on_write();
    let logits = model.forward_device(
        &inputs.ids,
        (&inputs.cos, &inputs.sin),
        positions,
        rotates,
        &mut |i| policy.attend(batch, i),
    )?;
    match out {
        Some(o) => o.slice_set(&logits, 0, 0)?,
        None => *out = Some(logits),
    }
    Ok(())
}

/// Capture the step: a warm-up run from `inputs` that is the step itself (it also loads
/// every kernel and fills candle's cache of kernel parameters; its logits land in the
/// graph's buffer), then the same forward under stream capture, which records kernels
/// without running them.
fn capture(
    model: &Llama,
    policy: &mut dyn KvPolicy,
    batch: &StepBatch,
    positions: &[u32],
    inputs: Inputs,
) -> Result<Captured> {
    let d = model.device();
    let dev = device_of(d)?;
    let rows = inputs.ids.elem_count();
    let mut out = Some(Tensor::zeros((rows, model.cfg.vocab_size), DType::F32, d)?);
    let _params = dev.enable_cuda_graph_htod_cache();
    run(model, policy, batch, positions, &inputs, &mut out)?;
    let stream = dev.cuda_stream();
    stream.synchronize().w()?;
    // Relaxed: other threads' allocations (the host's own work) do not end the capture.
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .w()?;
    let recorded = run(model, policy, batch, positions, &inputs, &mut out);
    // Always end the capture, so that a failure leaves the stream usable.
    let ended = stream
        .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
    recorded?;
    let graph = ended
        .w()?
        .ok_or_else(|| Error::Config("the capture recorded no graph".into()))?;
    graph.upload().w()?;
    let out = out.ok_or_else(|| Error::Config("a captured step left no logits".into()))?;
    Ok(Captured {
        graph,
        ids: inputs.ids,
        cos: inputs.cos,
        sin: inputs.sin,
        out,
    })
}

/// Overwrite the contiguous device tensor `t` with `src` (same element type and count),
/// in stream order: kernels queued before it read the old values.
fn write_tensor<T: CudaDType + DeviceRepr>(t: &Tensor, src: &[T]) -> Result<()> {
    if !t.is_contiguous() || t.elem_count() != src.len() {
        return Err(Error::Config(format!(
            "graph input of {} elements written with {}",
            t.elem_count(),
            src.len()
        )));
    }
    let dev = device_of(t.device())?;
    let stream = dev.cuda_stream();
    let (s, l) = t.storage_and_layout();
    let v = view_of::<T>(&s, l, "graph input")?;
    let (ptr, _record) = v.device_ptr(&stream);
    // SAFETY: `ptr` addresses `src.len()` elements of T inside `t`'s buffer (checked
    // above); a pageable copy has taken `src` by the time the call returns.
    unsafe { result::memcpy_htod_async(ptr, src, stream.cu_stream()) }.w()?;
    Ok(())
}
