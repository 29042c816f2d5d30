//! What the engine reports: one trace per step, timestamped events per request.

use crate::policy::SeqId;
use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StepKind {
    Prefill,
    Decode,
    /// Prefill chunks and decode tokens in one step (continuous batching).
    Mixed,
}

/// One engine step. Seconds are wall time; `compute_s` excludes `cache_ops_s`.
#[derive(Debug, Clone, Serialize)]
pub struct StepTrace {
    pub step: u64,
    pub kind: StepKind,
    /// Engine time at the start of the step.
    pub t_start_s: f64,
    pub num_seqs: usize,
    pub num_tokens: usize,
    pub num_prefill_tokens: usize,
    pub num_decode_tokens: usize,
    pub num_preempted: usize,
    pub schedule_s: f64,
    pub compute_s: f64,
    pub cache_ops_s: f64,
    /// On a GPU: the host's time to issue the forward (until its last launch
    /// returned), before waiting for the device. Near `compute_s + cache_ops_s` when
    /// the host sets the step's pace (or the forward waits on the device inside it),
    /// well under it when the device does: whether CUDA graphs can help. `None` on the
    /// CPU, where every kernel has run when it returns.
    pub launch_s: Option<f64>,
    pub sample_s: f64,
    pub h2d_bytes: u64,
    pub d2h_bytes: u64,
    pub transfer_s: f64,
    /// Device KV bytes holding live tokens after the step.
    pub kv_device_used_bytes: u64,
    pub kv_host_used_bytes: u64,
    /// Activations at the step's peak, score matrices included.
    pub activation_bytes: u64,
    /// Keys attended by the decode rows, summed over rows and layers (`None`
    /// without decode rows); `context_tokens` is what full attention would read.
    pub attended_tokens: Option<u64>,
    pub context_tokens: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    Arrived,
    Admitted,
    FirstToken,
    Token,
    Preempted,
    Finished,
    Rejected,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RequestEvent {
    pub request: SeqId,
    pub kind: EventKind,
    /// Seconds since the engine started.
    pub t_s: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// `max_new_tokens` reached.
    Length,
    /// A stop token was generated.
    Stop,
    /// The model's context is full.
    Context,
}

/// Everything about one finished request.
#[derive(Debug, Clone, Serialize)]
pub struct RequestOutput {
    pub id: SeqId,
    pub prompt_len: usize,
    pub output: Vec<u32>,
    pub arrival_s: f64,
    /// First admission (before any preemption).
    pub admitted_s: f64,
    /// Time of each generated token.
    pub token_times_s: Vec<f64>,
    pub finished_s: f64,
    pub finish_reason: FinishReason,
    pub num_preemptions: usize,
    /// Device KV bytes held for this request's tokens just before it finished.
    pub kv_device_bytes: u64,
    pub kv_host_bytes: u64,
    /// Logits of each generated position when the request asked for them.
    #[serde(skip)]
    pub logits: Vec<Vec<f32>>,
}

impl RequestOutput {
    pub fn ttft_s(&self) -> Option<f64> {
        self.token_times_s.first().map(|t| t - self.arrival_s)
    }

    /// Output tokens after the first, per second of decode.
    pub fn decode_tok_s(&self) -> Option<f64> {
        let n = self.token_times_s.len();
        if n < 2 {
            return None;
        }
        let dt = self.token_times_s[n - 1] - self.token_times_s[0];
        (dt > 0.0).then(|| (n - 1) as f64 / dt)
    }
}
