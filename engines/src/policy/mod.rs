//! The KV policy trait: one implementation per strategy (algorithms.md §2–7).
//!
//! A policy owns where each sequence's keys and values live and what attention sees.
//! The model calls it once per layer with the step's projected q/k/v; the policy
//! stores the new K/V, runs attention over what it keeps (so it sees the attention
//! probabilities when it needs them) and may evict, select or move data. The
//! scheduler asks it for room before a step and releases finished sequences.

pub mod audit;
pub mod budget;
pub mod evicting;
pub mod full;
pub mod hybrid;
pub mod infinigen;
pub mod kivi;
pub mod quest;
pub mod registry;
pub mod spec;

use crate::error::Result;
use candle_core::Tensor;
use serde::Serialize;

/// Identifier of a sequence (one request).
pub type SeqId = u64;

/// One sequence's rows in a packed step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepSeq {
    pub id: SeqId,
    /// First row of the sequence in the packed tensors.
    pub q_start: usize,
    /// New tokens of this sequence in this step.
    pub q_len: usize,
    /// Tokens whose K/V were computed before this step (= position of the first new token).
    pub ctx_before: usize,
}

/// Layout of one forward step: sequences of different lengths packed row-wise.
#[derive(Debug, Clone, Default)]
pub struct StepBatch {
    pub seqs: Vec<StepSeq>,
    pub num_tokens: usize,
}

impl StepBatch {
    pub fn push(&mut self, id: SeqId, ctx_before: usize, q_len: usize) {
        self.seqs.push(StepSeq {
            id,
            q_start: self.num_tokens,
            q_len,
            ctx_before,
        });
        self.num_tokens += q_len;
    }

    /// The sequences split into decode rows (`decoding(id)`) and prefill chunks, each in
    /// batch order.
    pub fn split(&self, decoding: impl Fn(SeqId) -> bool) -> (Vec<StepSeq>, Vec<StepSeq>) {
        self.seqs.iter().copied().partition(|s| decoding(s.id))
    }
}

/// Rotary position embedding of the model, for policies that place keys at positions
/// other than their own (StreamingLLM's rolling positions).
pub trait Rope {
    /// Rotate `x` (`[T, heads, dh]`, not yet rotated) to `positions` (one per row).
    fn rotate(&self, x: &Tensor, positions: &[u32]) -> Result<Tensor>;

    /// f32 cos and sin of each position's angles (`[T, dh/2]` each), for kernels that
    /// rotate in place with [`rotate_in_place`].
    fn tables(&self, positions: &[u32]) -> (Vec<f32>, Vec<f32>);

    /// Whether rotated pairs are adjacent (`2i, 2i+1`) rather than halves (`i, i+dh/2`).
    fn interleaved(&self) -> bool;
}

/// A tensor's elements as f32 (the CPU kernels' input).
pub(crate) fn to_f32(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?)
}

/// Rotate `x` (`[heads, dh]` of one row) with one position's `cos`/`sin` (`[dh/2]`).
pub fn rotate_in_place(x: &mut [f32], cos: &[f32], sin: &[f32], interleaved: bool) {
    let half = cos.len();
    for head in x.chunks_exact_mut(2 * half) {
        for i in 0..half {
            let (a, b) = if interleaved {
                (2 * i, 2 * i + 1)
            } else {
                (i, i + half)
            };
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0 * cos[i] - x1 * sin[i];
            head[b] = x0 * sin[i] + x1 * cos[i];
        }
    }
}

/// What one layer hands its KV policy in one step.
pub struct LayerInput<'a> {
    pub layer: usize,
    /// The layer's input after its RMSNorm, `[T, hidden]`.
    pub x: &'a Tensor,
    /// Queries `[T, H, dh]` and keys `[T, Hkv, dh]` with RoPE at their positions.
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    /// Values `[T, Hkv, dh]`.
    pub v: &'a Tensor,
    /// Queries and keys before RoPE.
    pub q_raw: &'a Tensor,
    pub k_raw: &'a Tensor,
    /// Absolute position of each row.
    pub positions: &'a [u32],
    pub rope: &'a dyn Rope,
    /// `Some` only where the policy asked to rotate the queries and keys itself
    /// ([`KvPolicy::rotates_on_write`]) and the model could leave them to it: then `q`
    /// and `k` are the raw ones, and these are the rows' RoPE cos and sin (`[T, dh/2]`,
    /// the model's dtype).
    pub rope_rows: Option<(&'a Tensor, &'a Tensor)>,
}

/// Memory a policy holds, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PolicyMemory {
    /// Reserved on the device (the whole pool for `full`).
    pub device_reserved: u64,
    /// Of which holds live tokens.
    pub device_used: u64,
    pub host_reserved: u64,
    pub host_used: u64,
}

/// Work a policy did in one step besides attention itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct PolicyStats {
    /// Seconds in cache operations: writing K/V, eviction, statistics, selection,
    /// speculation, transfers (`transfer_s` is part of it).
    pub cache_ops_s: f64,
    pub h2d_bytes: u64,
    pub d2h_bytes: u64,
    pub transfer_s: f64,
    /// Largest attention scratch (score matrices) allocated in the step.
    pub scratch_bytes: u64,
}

impl PolicyStats {
    pub fn add_scratch(&mut self, bytes: u64) {
        self.scratch_bytes = self.scratch_bytes.max(bytes);
    }

    /// Two policies' work in one step: times and bytes added, the larger scratch.
    pub fn merge(&mut self, o: &PolicyStats) {
        self.cache_ops_s += o.cache_ops_s;
        self.h2d_bytes += o.h2d_bytes;
        self.d2h_bytes += o.d2h_bytes;
        self.transfer_s += o.transfer_s;
        self.add_scratch(o.scratch_bytes);
    }
}

/// What the scheduler tells a policy when it admits a sequence (again after a
/// preemption): budgets are computed from these.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqInfo {
    /// The request's prompt length `L0`.
    pub prompt_len: usize,
    /// The request's output limit `T`.
    pub max_new_tokens: usize,
    /// Tokens this admission prefills: the prompt, or prompt + generated tokens when
    /// re-admitted after a preemption (recompute). Decode starts after them.
    pub prefill_len: usize,
}

impl SeqInfo {
    /// A sequence reserved without being admitted first (tests, direct policy use):
    /// all of its `total_tokens` are prompt, no output.
    pub fn unannounced(total_tokens: usize) -> Self {
        Self {
            prompt_len: total_tokens,
            max_new_tokens: 0,
            prefill_len: total_tokens,
        }
    }
}

/// One decode row's attention in one layer, for the budget audit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct AttendRecord {
    pub seq: SeqId,
    pub layer: usize,
    /// Keys the kernel read for the row's query (the most over the KV heads),
    /// including the token's own.
    pub attended: usize,
    /// Context length including the token.
    pub context: usize,
}

impl AttendRecord {
    /// A decode row that read every key of its context (`context` with the token).
    pub fn whole(seq: SeqId, layer: usize, context: usize) -> Self {
        Self {
            seq,
            layer,
            attended: context,
            context,
        }
    }
}

pub trait KvPolicy: Send {
    /// Strategy name as used on the command line (`full`, `h2o`, ...).
    fn name(&self) -> &'static str;

    /// A sequence is (re-)admitted; called before its first `reserve`. An error (a
    /// device allocation that failed) ends the step.
    fn admit(&mut self, _seq: SeqId, _info: SeqInfo) -> Result<()> {
        Ok(())
    }

    /// Before a workload: make room ahead for the `held` sequences running at once, so
    /// that one-off allocations (pinning an offloading policy's host memory, its
    /// transfer buffers, growing a pool reserved on demand) do not fall inside timed
    /// steps.
    fn prepare(&mut self, _held: &[SeqInfo]) -> Result<()> {
        Ok(())
    }

    /// Bytes the next step's attention may allocate for scratch (score matrices);
    /// `None`: unlimited. Past it, `attend` fails with the typed out-of-memory error.
    fn set_scratch_limit(&mut self, _limit: Option<u64>) {}

    /// Make room so `seq` holds `total_tokens` tokens after this step, all or nothing.
    /// `Ok(false)` when the pool is full: the scheduler then preempts. An error (a
    /// device or host allocation that failed) ends the step.
    fn reserve(&mut self, seq: SeqId, total_tokens: usize) -> Result<bool>;

    /// Whether a sequence of `total_tokens` could ever run, alone, on this policy.
    fn fits(&self, total_tokens: usize) -> bool;

    /// Whether the request `info` could ever run, alone (a policy that routes by the
    /// prompt length overrides it).
    fn fits_request(&self, info: &SeqInfo) -> bool {
        self.fits(info.prompt_len + info.max_new_tokens)
    }

    /// Cap the device bytes a pool grown on demand may reach (it never shrinks below
    /// what it holds), so that two policies can share one KV budget. `false`: the
    /// policy's device memory cannot be capped (a pool allocated up front).
    fn set_device_ceiling(&mut self, _bytes: u64) -> bool {
        false
    }

    /// Free everything held for `seq`.
    fn release(&mut self, seq: SeqId);

    /// Store the step's new K/V and return the attention output `[T, H, dh]` for the
    /// layer's queries. Everything the layer knows is in `input`, including its (normed)
    /// input, which InfiniGen uses to speculate on the next layer.
    fn attend(&mut self, batch: &StepBatch, input: &LayerInput<'_>) -> Result<Tensor>;

    /// Whether [`KvPolicy::attend_rows`] serves this policy's every step on the CPU: the
    /// forward then keeps a decode step's rows in buffers of its own and calls it in
    /// place of `attend` (no tensors made per layer for the policy).
    fn takes_rows(&self) -> bool {
        false
    }

    /// [`KvPolicy::attend`] on f32 rows: the layer's rotated queries `q` (`[T, H, dh]`)
    /// and its keys `k` and values `v` (`[T, Hkv, dh]`, keys rotated), the output
    /// `[T, H, dh]`; only where [`KvPolicy::takes_rows`].
    fn attend_rows(
        &mut self,
        _batch: &StepBatch,
        _layer: usize,
        _rows: (&[f32], &[f32], &[f32]),
    ) -> Result<Vec<f32>> {
        Err(crate::error::Error::Config(format!(
            "policy {} takes its layers' inputs as tensors only",
            self.name()
        )))
    }

    /// Whether this step's queries and keys may reach [`KvPolicy::attend`] without RoPE,
    /// with their rotation rows in [`LayerInput::rope_rows`], for the policy to rotate
    /// them as it writes the keys (CUDA `full` in a graph step: RoPE and the cache write
    /// in one kernel). The model leaves them unrotated only where it would have rotated
    /// them in its own fused kernel; `attend` must take either form.
    fn rotates_on_write(&self) -> bool {
        false
    }

    /// After all layers of a step.
    fn end_step(&mut self, _batch: &StepBatch) -> Result<()> {
        Ok(())
    }

    /// The graph a decode step (every row one new token) would run from, without
    /// binding anything: the epoch, context bucket and variant that
    /// [`KvPolicy::bind_graph_step`] would return for `batch`, so that a step whose shape
    /// no graph serves (yet) runs as usual with no fixed buffers made for it. May grow
    /// the device pool (as the step's first layer would). `None` where this policy runs
    /// no graph for this step.
    fn plan_graph_step(
        &mut self,
        _batch: &StepBatch,
    ) -> Result<Option<crate::decode_graphs::GraphBinding>> {
        Ok(None)
    }

    /// Prepare a decode step (every row one new token) to run from a CUDA graph
    /// (`crate::decode_graphs`): do now the step's bookkeeping that `attend` would do
    /// over its layers, write what the rows' attention needs on the device (write slots,
    /// block tables, context lengths, eviction parameters) into buffers that stay where
    /// they are, sized for the returned context bucket, and have `attend` read those and
    /// record nothing until `end_step`, so that a captured forward replays the step.
    /// The binding names the epoch of the device state a graph bakes in (the K/V and
    /// input buffers' addresses), which changes whenever any of it moves; `None` where
    /// this policy runs no graph for this step (it then runs as usual).
    fn bind_graph_step(
        &mut self,
        _batch: &StepBatch,
    ) -> Result<Option<crate::decode_graphs::GraphBinding>> {
        Ok(None)
    }

    fn memory(&self) -> PolicyMemory;

    /// Device bytes held for this sequence's tokens.
    fn seq_device_bytes(&self, seq: SeqId) -> u64;

    /// Host bytes held for this sequence.
    fn seq_host_bytes(&self, _seq: SeqId) -> u64 {
        0
    }

    /// Counters since the last call.
    fn take_stats(&mut self) -> PolicyStats;

    /// Keys attended by each decode row per layer since the last call (budget audit).
    fn take_attended(&mut self) -> Vec<AttendRecord>;

    /// Positions (layer, KV head) of `seq` holds on the device or attended in the last
    /// step, for policies that keep or select a subset (tests, traces).
    fn kept_positions(&self, _seq: SeqId, _layer: usize, _kv_head: usize) -> Option<Vec<u32>> {
        None
    }

    /// Internal consistency (pool accounting); a description of the first violation.
    fn check_invariants(&self) -> std::result::Result<(), String> {
        Ok(())
    }
}
