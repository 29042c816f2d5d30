//! Continuous batching with vLLM V1 semantics (algorithms.md §2): a token budget per
//! step, running requests first (decode or the next prefill chunk), then FCFS
//! admission when nothing was preempted; preemption by recompute of the most recently
//! admitted request when the KV pool runs out.

use crate::error::Result;
use crate::policy::{KvPolicy, SeqId, SeqInfo};
use std::collections::{HashMap, VecDeque};

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefillMode {
    /// V1: prompts are chunked to the step's token budget and batched with decodes.
    Chunked,
    /// One whole prompt per step, prefills before decodes (the study's H2O/InfiniGen setup).
    Sequential,
}

impl std::str::FromStr for PrefillMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "chunked" | "batched" => Ok(PrefillMode::Chunked),
            "sequential" => Ok(PrefillMode::Sequential),
            _ => Err(format!(
                "prefill mode `{s}`: expected `chunked` or `sequential`"
            )),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    pub max_num_seqs: usize,
    pub max_batched_tokens: usize,
    pub prefill: PrefillMode,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        // vLLM V1 offline defaults for cards under 70 GiB.
        Self {
            max_num_seqs: 256,
            max_batched_tokens: 8192,
            prefill: PrefillMode::Chunked,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Sequence {
    pub id: SeqId,
    pub prompt: Vec<u32>,
    pub output: Vec<u32>,
    pub max_new_tokens: usize,
    pub stop_tokens: Vec<u32>,
    pub arrival_s: f64,
    /// Tokens whose K/V are computed (0 after a preemption).
    pub num_computed: usize,
    pub num_preemptions: usize,
    pub admitted_s: Option<f64>,
    pub token_times_s: Vec<f64>,
    /// What the policy was told at the last admission.
    pub info: Option<SeqInfo>,
    /// Teacher forcing: emit these tokens instead of the argmax (scoring, verify).
    pub forced: Vec<u32>,
    /// Keep the logits of every generated position.
    pub record_logits: bool,
    pub logits: Vec<Vec<f32>>,
    /// Also keep the logits of prompt positions from this one on (one-pass scoring of a
    /// continuation placed in the prompt); they come first in `logits`.
    pub prompt_logits_from: Option<usize>,
}

impl Sequence {
    pub fn total_len(&self) -> usize {
        self.prompt.len() + self.output.len()
    }

    pub fn remaining(&self) -> usize {
        self.total_len() - self.num_computed
    }

    fn admission_info(&self) -> SeqInfo {
        SeqInfo {
            prompt_len: self.prompt.len(),
            max_new_tokens: self.max_new_tokens,
            prefill_len: self.total_len(),
        }
    }

    /// Prompt positions whose logits are kept besides the sampled row: from
    /// `prompt_logits_from` to the one before the last prompt token (the last one is
    /// the sampled row).
    pub fn prompt_logit_positions(&self) -> std::ops::Range<usize> {
        match self.prompt_logits_from {
            Some(from) if self.record_logits => from.min(self.prompt.len())..self.prompt.len() - 1,
            _ => 0..0,
        }
    }

    /// Token at absolute position `i` (prompt, then generated tokens).
    pub fn token(&self, i: usize) -> u32 {
        if i < self.prompt.len() {
            self.prompt[i]
        } else {
            self.output[i - self.prompt.len()]
        }
    }
}

/// What one step runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// (sequence, new tokens) in row order.
    pub entries: Vec<(SeqId, usize)>,
    pub admitted: Vec<SeqId>,
    pub preempted: Vec<SeqId>,
}

#[derive(Debug, Default)]
pub struct Scheduler {
    pub cfg: SchedulerConfig,
    pub seqs: HashMap<SeqId, Sequence>,
    /// FCFS by arrival; preempted requests go back to the front.
    pub waiting: VecDeque<SeqId>,
    /// In admission order.
    pub running: Vec<SeqId>,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> Self {
        Self {
            cfg,
            ..Default::default()
        }
    }

    /// Queue a request, keeping `waiting` ordered by arrival.
    pub fn add(&mut self, seq: Sequence) {
        let pos = self
            .waiting
            .iter()
            .position(|id| self.seqs[id].arrival_s > seq.arrival_s)
            .unwrap_or(self.waiting.len());
        self.waiting.insert(pos, seq.id);
        self.seqs.insert(seq.id, seq);
    }

    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Arrival of the first waiting request, if any.
    pub fn next_arrival(&self) -> Option<f64> {
        self.waiting.front().map(|id| self.seqs[id].arrival_s)
    }

    fn arrived(&self, id: SeqId, now: f64) -> bool {
        self.seqs[&id].arrival_s <= now
    }

    /// The next step's plan; a policy's failed allocation is the error.
    pub fn schedule(&mut self, now: f64, policy: &mut dyn KvPolicy) -> Result<Plan> {
        let mut plan = Plan::default();
        if self.cfg.prefill == PrefillMode::Sequential {
            if let Some(&id) = self.waiting.front() {
                if self.arrived(id, now) && self.running.len() < self.cfg.max_num_seqs {
                    let s = &self.seqs[&id];
                    let info = s.admission_info();
                    policy.admit(id, info)?;
                    if policy.reserve(id, s.total_len())? {
                        let n = s.remaining();
                        self.seqs.get_mut(&id).expect("waiting ids are known").info = Some(info);
                        self.waiting.pop_front();
                        self.running.push(id);
                        plan.entries.push((id, n));
                        plan.admitted.push(id);
                        return Ok(plan);
                    }
                    policy.release(id);
                }
            }
            self.schedule_running(usize::MAX, policy, &mut plan)?;
            return Ok(plan);
        }

        let mut budget = self.cfg.max_batched_tokens;
        budget = self.schedule_running(budget, policy, &mut plan)?;
        if !plan.preempted.is_empty() {
            return Ok(plan);
        }
        while budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            if !self.arrived(id, now) {
                break;
            }
            let s = &self.seqs[&id];
            let n = s.remaining().min(budget);
            let info = s.admission_info();
            policy.admit(id, info)?;
            if !policy.reserve(id, s.num_computed + n)? {
                policy.release(id);
                break;
            }
            self.seqs.get_mut(&id).expect("waiting ids are known").info = Some(info);
            self.waiting.pop_front();
            self.running.push(id);
            plan.entries.push((id, n));
            plan.admitted.push(id);
            budget -= n;
        }
        Ok(plan)
    }

    /// Running requests in order; returns the budget left.
    fn schedule_running(
        &mut self,
        mut budget: usize,
        policy: &mut dyn KvPolicy,
        plan: &mut Plan,
    ) -> Result<usize> {
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let s = &self.seqs[&id];
            let n = s.remaining().min(budget);
            let want = s.num_computed + n;
            loop {
                if policy.reserve(id, want)? {
                    plan.entries.push((id, n));
                    budget -= n;
                    i += 1;
                    break;
                }
                // Out of blocks: preempt the most recently admitted request (recompute).
                let victim = self.running.pop().expect("running is not empty here");
                policy.release(victim);
                let v = self.seqs.get_mut(&victim).expect("running ids are known");
                v.num_computed = 0;
                v.num_preemptions += 1;
                self.waiting.push_front(victim);
                plan.preempted.push(victim);
                if victim == id {
                    break;
                }
            }
        }
        Ok(budget)
    }

    /// Remove a finished request from the running set.
    pub fn finish(&mut self, id: SeqId) -> Option<Sequence> {
        self.running.retain(|&x| x != id);
        self.seqs.remove(&id)
    }
}
