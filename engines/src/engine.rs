//! The engine: a model, a KV policy and the scheduler, stepped until every request is
//! done. Sizes the KV pool from the device capacity at start-up (vLLM's
//! `gpu_memory_utilization`): allocated then (`reservation=fraction`) or its ceiling as
//! it grows on demand (`reservation=budget`); records a trace per step and events per
//! request.

use crate::attention::prefill::AttentionImpl;
use crate::error::{Component, Error, Result};
use crate::kv::KvCodec;
use crate::ledger::{MemoryLedger, MemoryReport};
use crate::model::Llama;
use crate::policy::audit::{allowed_device_bytes, nominal_attended, nominal_device_bytes};
use crate::policy::full::{FullOptions, FullPolicy};
use crate::policy::spec::{PolicyEnv, PolicySpec, Reservation};
use crate::policy::{KvPolicy, SeqId, SeqInfo, StepBatch};
use crate::scheduler::{Plan, Scheduler, SchedulerConfig, Sequence};
use crate::trace::{EventKind, FinishReason, RequestEvent, RequestOutput, StepKind, StepTrace};
use candle_core::DType;
use std::time::Instant;

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Device name for errors and reports (`cpu`, `cuda:0`).
    pub device_name: String,
    /// Device memory capacity in bytes. Required unless `num_blocks` is given.
    pub device_memory: Option<u64>,
    /// Fraction of the capacity the engine may use (vLLM `gpu_memory_utilization`).
    pub memory_fraction: f64,
    /// Bytes this process can use on the device at start-up (its free memory with the
    /// model loaded, plus the model's weights), when less than the fraction of the
    /// capacity: the pool is planned within it. `None`: the fraction of the capacity.
    pub device_available: Option<u64>,
    /// Fixed pool size in blocks instead of sizing from the capacity.
    pub num_blocks: Option<usize>,
    /// How the device KV is reserved (`None`: the strategy's paradigm,
    /// [`Reservation::default_for`]).
    pub reservation: Option<Reservation>,
    /// How the paged stores keep their K/V rows (`None`: each paradigm's own, see
    /// [`crate::policy::registry::StrategyParams::cpu_kv_codec`]).
    pub kv_codec: Option<KvCodec>,
    pub block_size: usize,
    /// Longest sequence (prompt + output) accepted; default: the model's context.
    pub max_model_len: Option<usize>,
    pub scheduler: SchedulerConfig,
    /// Shuffle the block free list (tests: random block tables).
    pub shuffle_blocks_seed: Option<u64>,
    /// Check the pool's invariants after every step (tests).
    pub check_invariants: bool,
    /// The KV strategy and its budget.
    pub policy: PolicySpec,
    /// Prefill attention implementation.
    pub attention: AttentionImpl,
    /// Query rows per chunk for chunked attention.
    pub chunk_size: usize,
    /// Host memory an offloading policy may use (default: as much as the device KV).
    pub host_memory: Option<u64>,
    /// Fail a step whose decode rows attend or hold more than the nominal budget
    /// (see `policy::audit`).
    pub audit: bool,
    /// Run decode steps from CUDA graphs where the strategy can (`crate::decode_graphs`;
    /// `None`: as `KVBENCH_CUDA_GRAPH` says, on unless `off`). Ignored on the CPU.
    pub cuda_graphs: Option<bool>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            device_name: "cpu".into(),
            device_memory: None,
            memory_fraction: 0.9,
            device_available: None,
            num_blocks: None,
            reservation: None,
            kv_codec: None,
            block_size: 16,
            max_model_len: None,
            scheduler: SchedulerConfig::default(),
            shuffle_blocks_seed: None,
            check_invariants: false,
            policy: PolicySpec::full(),
            attention: AttentionImpl::Flash,
            chunk_size: 512,
            host_memory: None,
            audit: true,
            cuda_graphs: None,
        }
    }
}

impl EngineConfig {
    /// The reservation in effect: the configured one, else the strategy's paradigm.
    pub fn reservation(&self) -> Reservation {
        self.reservation
            .unwrap_or_else(|| Reservation::default_for(&self.policy))
    }
}

/// Charge the ledger with the device KV the policy holds now (its pool as allocated:
/// all of it under `fraction`, what it grew to under `budget`). Growth is checked
/// against the device capacity (the typed OOM); what the policy gave back is released.
fn hold_kv_device(ledger: &mut MemoryLedger, policy: &dyn KvPolicy) -> Result<()> {
    let held = policy.memory().device_reserved;
    let now = ledger.kv_device();
    if held > now {
        ledger.reserve(Component::KvDevice, held - now)
    } else {
        ledger.set(Component::KvDevice, held);
        Ok(())
    }
}

/// The KV pool the engine plans on a device of `capacity` bytes: the `fraction` it
/// may use (or what is `available`, when less), less the weights and the start-up
/// profile's activations (`non_kv`), in whole blocks. `full` reserves it up front;
/// the other strategies grow to it on demand. The cost model plans with it too.
pub fn planned_kv_bytes(
    capacity: u64,
    fraction: f64,
    available: Option<u64>,
    non_kv: u64,
    block_bytes: u64,
) -> u64 {
    let usable = (capacity as f64 * fraction) as u64;
    let usable = available.map_or(usable, |a| usable.min(a));
    usable.saturating_sub(non_kv) / block_bytes.max(1) * block_bytes
}

/// A request to generate greedily.
#[derive(Debug, Clone)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    /// Seconds after the engine started at which the request arrives.
    pub arrival_s: f64,
    /// Generation stops at any of these (empty: always run to `max_new_tokens`).
    pub stop_tokens: Vec<u32>,
    /// Teacher forcing: the tokens to emit in order instead of the argmax (scoring a
    /// continuation through the decode path; comparing engines on the same tokens).
    pub forced_output: Vec<u32>,
    /// Keep the logits (f32) of every generated position in the output.
    pub record_logits: bool,
}

impl Request {
    /// A greedy request arriving at t = 0.
    pub fn greedy(prompt: Vec<u32>, max_new_tokens: usize) -> Self {
        Self {
            prompt,
            max_new_tokens,
            arrival_s: 0.0,
            stop_tokens: Vec::new(),
            forced_output: Vec::new(),
            record_logits: false,
        }
    }
}

#[derive(Debug, Clone)]
pub enum StepOutcome {
    Ran(StepTrace),
    /// Nothing can run before this engine time (waiting for an arrival).
    Idle {
        until_s: f64,
    },
    Done,
}

pub struct Engine {
    model: Llama,
    policy: Box<dyn KvPolicy>,
    sched: Scheduler,
    ledger: MemoryLedger,
    cfg: EngineConfig,
    max_model_len: usize,
    start: Instant,
    next_id: SeqId,
    step_no: u64,
    events: Vec<RequestEvent>,
    traces: Vec<StepTrace>,
    finished: Vec<RequestOutput>,
    /// Decode steps replayed from CUDA graphs (`None`: every step launched as it is).
    #[cfg(feature = "cuda")]
    graphs: Option<crate::cuda::graph::DecodeGraphs>,
}

impl Engine {
    /// Reserve the weights in the ledger, size the KV memory from the device capacity
    /// and build the configured policy (under `reservation=fraction` it holds its whole
    /// pool from here on; under `budget` it grows it as sequences need room).
    pub fn new(model: Llama, cfg: EngineConfig) -> Result<Self> {
        let max_model_len = cfg
            .max_model_len
            .unwrap_or(model.cfg.max_position_embeddings);
        if !(cfg.memory_fraction > 0.0 && cfg.memory_fraction <= 1.0) {
            return Err(Error::Config(format!(
                "memory fraction {} must be in (0, 1]",
                cfg.memory_fraction
            )));
        }
        for (name, v) in [
            ("block size", cfg.block_size),
            ("max_num_seqs", cfg.scheduler.max_num_seqs),
            ("max_batched_tokens", cfg.scheduler.max_batched_tokens),
            ("chunk size", cfg.chunk_size),
        ] {
            if v == 0 {
                return Err(Error::Config(format!("{name} 0: expected at least 1")));
            }
        }
        let mut ledger = MemoryLedger::new(cfg.device_name.clone(), cfg.device_memory)
            .with_host_capacity(cfg.host_memory);
        ledger.reserve(Component::Weights, model.weights_bytes())?;
        // Profile: the largest step the scheduler can build.
        let sched = cfg.scheduler;
        let profile = model.activation_bytes(
            sched.max_batched_tokens,
            sched.max_num_seqs.min(sched.max_batched_tokens),
        );
        ledger.reserve(Component::Activations, profile)?;
        ledger.release(Component::Activations, profile);

        let full_opts = FullOptions {
            block_size: cfg.block_size,
            // The pool is planned in blocks of `full`'s rows: the option's, else the
            // compute dtype's.
            kv_codec: cfg
                .kv_codec
                .unwrap_or_else(|| KvCodec::from_candle(model.dtype())),
            shuffle_seed: cfg.shuffle_blocks_seed,
            attention: cfg.attention,
            chunk_size: cfg.chunk_size,
        };
        let block_bytes = FullPolicy::block_bytes(&model.cfg, &full_opts);
        let kv_bytes = match (cfg.num_blocks, cfg.device_memory) {
            (Some(n), _) => n as u64 * block_bytes,
            (None, Some(cap)) => planned_kv_bytes(
                cap,
                cfg.memory_fraction,
                cfg.device_available,
                model.weights_bytes() + profile,
                block_bytes,
            ),
            (None, None) => {
                return Err(Error::Config(
                    "the KV pool needs a device memory capacity or a block count".into(),
                ))
            }
        };
        let reservation = cfg.reservation();
        // On the CPU a pool reserved up front is one zeroed buffer per layer for K and
        // one for V, mapped in host memory: a capacity the host cannot map is named here.
        let buffer = kv_bytes / (2 * model.cfg.num_layers.max(1)) as u64;
        if model.device().is_cpu()
            && reservation == Reservation::Fraction
            && !crate::kv::can_reserve(buffer)
        {
            return Err(Error::Config(format!(
                "the KV pool of {kv_bytes} bytes (from the device capacity and memory fraction) \
                 cannot be reserved in this host's memory ({buffer} bytes for each layer's K \
                 or V): on the CPU the device's pool lives in host memory; give a smaller \
                 --device-memory (YAML: device.memory) or --memory-fraction"
            )));
        }
        if matches!(cfg.policy, PolicySpec::Full(_)) {
            // As vLLM: fail at start-up if one max_model_len sequence cannot fit.
            let need = max_model_len.div_ceil(cfg.block_size) as u64 * block_bytes;
            if kv_bytes < need {
                return Err(Error::OutOfMemory {
                    device: cfg.device_name.clone(),
                    component: Component::KvDevice,
                    requested: need,
                    available: kv_bytes,
                    capacity: cfg.device_memory.unwrap_or(0),
                });
            }
        }
        let env = PolicyEnv {
            device_name: cfg.device_name.clone(),
            device_capacity: cfg.device_memory,
            kv_device_bytes: kv_bytes,
            reservation,
            kv_host_bytes: cfg.host_memory.unwrap_or(kv_bytes),
            block_size: cfg.block_size,
            attention: cfg.attention,
            chunk_size: cfg.chunk_size,
            compute_codec: KvCodec::from_candle(model.dtype()),
            kv_codec: cfg.kv_codec,
            shuffle_seed: cfg.shuffle_blocks_seed,
        };
        let policy = cfg.policy.build(&model, env)?;
        // A pool allocated up front is held from here on: the first step's scratch
        // limit must already see it (one grown on demand starts empty).
        hold_kv_device(&mut ledger, policy.as_ref())?;
        Self::assemble(model, cfg, policy, ledger, max_model_len)
    }

    /// An engine around a policy built elsewhere (tests: the budget audit must catch
    /// a policy that does not do what `cfg.policy` says). Its memory is not checked
    /// against the device capacity at start-up.
    pub fn with_policy(model: Llama, cfg: EngineConfig, policy: Box<dyn KvPolicy>) -> Result<Self> {
        let max_model_len = cfg
            .max_model_len
            .unwrap_or(model.cfg.max_position_embeddings);
        let mut ledger = MemoryLedger::new(cfg.device_name.clone(), cfg.device_memory)
            .with_host_capacity(cfg.host_memory);
        ledger.reserve(Component::Weights, model.weights_bytes())?;
        Self::assemble(model, cfg, policy, ledger, max_model_len)
    }

    fn assemble(
        model: Llama,
        cfg: EngineConfig,
        policy: Box<dyn KvPolicy>,
        ledger: MemoryLedger,
        max_model_len: usize,
    ) -> Result<Self> {
        #[cfg(feature = "cuda")]
        let graphs = {
            let on = match cfg.cuda_graphs {
                Some(on) => on,
                None => model.device().is_cuda() && crate::cuda::graph::graphs_chosen()?,
            };
            (on && model.device().is_cuda()).then(crate::cuda::graph::DecodeGraphs::new)
        };
        Ok(Self {
            #[cfg(feature = "cuda")]
            graphs,
            model,
            policy,
            sched: Scheduler::new(cfg.scheduler),
            ledger,
            max_model_len,
            cfg,
            start: Instant::now(),
            next_id: 0,
            step_no: 0,
            events: Vec::new(),
            traces: Vec::new(),
            finished: Vec::new(),
        })
    }

    pub fn model(&self) -> &Llama {
        &self.model
    }

    /// How many decode steps ran from CUDA graphs (zero on the CPU and with graphs off).
    pub fn graph_stats(&self) -> crate::decode_graphs::GraphStats {
        #[cfg(feature = "cuda")]
        if let Some(g) = &self.graphs {
            return g.stats();
        }
        crate::decode_graphs::GraphStats::default()
    }

    pub fn policy(&self) -> &dyn KvPolicy {
        self.policy.as_ref()
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Seconds since the engine started (or was last reset).
    pub fn now(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Allocate ahead what the policy would otherwise allocate inside timed steps, for
    /// the `held` sequences running at once (see [`KvPolicy::prepare`]), and hold it
    /// in the ledger.
    pub fn prepare(&mut self, held: &[SeqInfo]) -> Result<()> {
        self.policy.prepare(held)?;
        hold_kv_device(&mut self.ledger, self.policy.as_ref())
    }

    /// Restart the engine clock (call just before submitting a workload).
    pub fn reset_clock(&mut self) {
        self.start = Instant::now();
    }

    /// The ledger's bytes, with the reservation they were held under and the codec
    /// of their rows.
    pub fn memory(&self) -> MemoryReport {
        MemoryReport {
            reservation: Some(self.cfg.reservation()),
            kv_codec: self.kv_codec(),
            ..self.ledger.report()
        }
    }

    /// How the policy's paged stores keep their rows (`None`: storage of its own).
    pub fn kv_codec(&self) -> Option<KvCodec> {
        let spec = &self.cfg.policy;
        if !spec.strategy().kv_codec {
            return None;
        }
        let compute = KvCodec::from_candle(self.model.dtype());
        Some(if self.model.device().is_cuda() {
            KvCodec::Bf16
        } else {
            spec.params().cpu_kv_codec(compute, self.cfg.kv_codec)
        })
    }

    pub fn events(&self) -> &[RequestEvent] {
        &self.events
    }

    pub fn traces(&self) -> &[StepTrace] {
        &self.traces
    }

    pub fn finished(&self) -> &[RequestOutput] {
        &self.finished
    }

    /// Hand over the outputs finished so far (a long scoring run need not keep every
    /// request's logits).
    pub fn take_finished(&mut self) -> Vec<RequestOutput> {
        std::mem::take(&mut self.finished)
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.sched
    }

    fn event(&mut self, request: SeqId, kind: EventKind, t_s: f64) {
        self.events.push(RequestEvent { request, kind, t_s });
    }

    /// Queue a request. A request that can never run (empty, tokens outside the
    /// vocabulary, longer than `max_model_len`, more KV than the whole pool) is
    /// rejected here with an error rather than left to loop in the scheduler.
    pub fn add_request(&mut self, req: Request) -> Result<SeqId> {
        self.add_request_inner(req, None)
    }

    /// As [`Engine::add_request`] with `record_logits`, also keeping the logits of the
    /// prompt positions `from..prompt.len() - 1` (the row at position p predicts token
    /// p + 1): one-pass scoring of a continuation that is part of the prompt. Those
    /// rows come first in `RequestOutput::logits`, then one per generated token.
    pub fn add_request_with_prompt_logits(&mut self, req: Request, from: usize) -> Result<SeqId> {
        if from >= req.prompt.len() {
            return Err(Error::Config(format!(
                "prompt logits from position {from}: the prompt has {} tokens",
                req.prompt.len()
            )));
        }
        self.add_request_inner(
            Request {
                record_logits: true,
                ..req
            },
            Some(from),
        )
    }

    fn add_request_inner(
        &mut self,
        req: Request,
        prompt_logits_from: Option<usize>,
    ) -> Result<SeqId> {
        let id = self.next_id;
        self.next_id += 1;
        let total = req.prompt.len() + req.max_new_tokens;
        let vocab = self.model.cfg.vocab_size;
        let reason = if req.prompt.is_empty() {
            Some("empty prompt".to_string())
        } else if req.max_new_tokens == 0 {
            Some("max_new_tokens must be at least 1".to_string())
        } else if let Some(t) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
            Some(format!("token id {t} is outside the vocabulary of {vocab}"))
        } else if let Some(t) = req.forced_output.iter().find(|&&t| t as usize >= vocab) {
            // A forced token is emitted as-is and fed back as the next input: checked
            // like the prompt so it cannot index past the embedding table.
            Some(format!(
                "forced output token id {t} is outside the vocabulary of {vocab}"
            ))
        } else if !(req.arrival_s.is_finite() && req.arrival_s >= 0.0) {
            Some(format!(
                "arrival time {} s must be finite and non-negative",
                req.arrival_s
            ))
        } else if total > self.max_model_len {
            Some(format!(
                "prompt {} + output {} tokens exceed max_model_len {}",
                req.prompt.len(),
                req.max_new_tokens,
                self.max_model_len
            ))
        } else if !self.policy.fits_request(&SeqInfo {
            prompt_len: req.prompt.len(),
            max_new_tokens: req.max_new_tokens,
            prefill_len: req.prompt.len(),
        }) {
            Some(format!(
                "{total} tokens need more KV than the whole pool holds"
            ))
        } else {
            None
        };
        // Events keep finite times even for a request rejected for its arrival time.
        let arrived = if req.arrival_s.is_finite() {
            req.arrival_s.max(0.0)
        } else {
            self.now()
        };
        self.event(id, EventKind::Arrived, arrived);
        if let Some(reason) = reason {
            let t = self.now().max(arrived);
            self.event(id, EventKind::Rejected, t);
            return Err(Error::RequestRejected { id, reason });
        }
        self.sched.add(Sequence {
            id,
            prompt: req.prompt,
            output: Vec::new(),
            max_new_tokens: req.max_new_tokens,
            stop_tokens: req.stop_tokens,
            arrival_s: req.arrival_s,
            num_computed: 0,
            num_preemptions: 0,
            admitted_s: None,
            token_times_s: Vec::new(),
            info: None,
            forced: req.forced_output,
            record_logits: req.record_logits,
            logits: Vec::new(),
            prompt_logits_from,
        });
        Ok(id)
    }

    pub fn has_unfinished(&self) -> bool {
        !self.sched.is_empty()
    }

    /// Step until every queued request has finished, sleeping until arrivals.
    pub fn run(&mut self) -> Result<()> {
        self.run_with(|_| {})
    }

    /// As [`Engine::run`], calling `on_step` after every step (progress bars).
    pub fn run_with(&mut self, mut on_step: impl FnMut(&StepTrace)) -> Result<()> {
        loop {
            match self.step()? {
                StepOutcome::Done => return Ok(()),
                StepOutcome::Idle { until_s } => {
                    let wait = until_s - self.now();
                    if wait > 0.0 {
                        std::thread::sleep(std::time::Duration::from_secs_f64(wait));
                    }
                }
                StepOutcome::Ran(t) => on_step(&t),
            }
        }
    }

    /// One scheduler step and one forward pass.
    pub fn step(&mut self) -> Result<StepOutcome> {
        if self.sched.is_empty() {
            return Ok(StepOutcome::Done);
        }
        let t_start = self.now();
        let t0 = Instant::now();
        let plan = self.sched.schedule(t_start, self.policy.as_mut())?;
        if plan.entries.is_empty() {
            if self.sched.running.is_empty() {
                if let Some(next) = self.sched.next_arrival() {
                    if next > t_start {
                        return Ok(StepOutcome::Idle { until_s: next });
                    }
                }
            }
            return Err(Error::Config(
                "scheduler made no progress: no request can be scheduled".into(),
            ));
        }
        for &id in &plan.preempted {
            self.event(id, EventKind::Preempted, t_start);
        }
        for &id in &plan.admitted {
            self.event(id, EventKind::Admitted, t_start);
            let s = self
                .sched
                .seqs
                .get_mut(&id)
                .expect("admitted ids are known");
            s.admitted_s.get_or_insert(t_start);
        }
        let (tokens, positions, batch, mut sample_rows, sample_ids, counts, prompt_rows) =
            self.pack(&plan);
        // Rows kept only for their logits (one-pass scoring) follow the sampled rows.
        let n_sampled = sample_rows.len();
        sample_rows.extend(prompt_rows.iter().map(|&(row, _)| row));
        let schedule_s = t0.elapsed().as_secs_f64();

        // A pool grown on demand may have grown while the step was scheduled: the
        // device must hold it (a typed OOM past the capacity) before the forward.
        hold_kv_device(&mut self.ledger, self.policy.as_ref())?;
        let act = self.model.activation_bytes(tokens.len(), sample_rows.len());
        self.ledger.reserve(Component::Activations, act)?;
        self.policy.set_scratch_limit(
            self.ledger
                .device_capacity()
                .map(|_| self.ledger.device_free()),
        );
        let t1 = Instant::now();
        // On the CPU the forward runs on a worker of the thread pool, the others kept
        // awake for its kernels (`model::team::run_awake`). (A GPU forward stays on the
        // thread its device is bound to.)
        let (model, policy) = (&self.model, self.policy.as_mut());
        let logits = if model.device().is_cpu() {
            crate::model::team::run_awake(|| {
                model.forward(&tokens, &positions, &batch, &sample_rows, policy)
            })
        } else {
            // A decode step whose every row is sampled may replay a CUDA graph.
            let every_row = counts.1 == tokens.len()
                && sample_rows.len() == tokens.len()
                && sample_rows.iter().zip(0u32..).all(|(&r, i)| r == i);
            #[cfg(feature = "cuda")]
            let replayed = match (every_row, &mut self.graphs) {
                (true, Some(g)) => g.forward(model, &mut *policy, &tokens, &positions, &batch),
                _ => Ok(None),
            };
            #[cfg(not(feature = "cuda"))]
            let replayed: Result<Option<candle_core::Tensor>> = {
                let _ = every_row;
                Ok(None)
            };
            match replayed {
                Ok(Some(l)) => Ok(l),
                Ok(None) => model.forward(&tokens, &positions, &batch, &sample_rows, policy),
                Err(e) => Err(e),
            }
        };
        self.ledger.release(Component::Activations, act);
        let logits = logits.map_err(|e| self.name_oom(e))?;
        self.policy.end_step(&batch)?;
        let launch_s = self
            .model
            .device()
            .is_cuda()
            .then(|| t1.elapsed().as_secs_f64());
        // A GPU runs the step asynchronously: wait for it so the forward's time is its
        // own and not the sampling's (a no-op on the CPU).
        self.model.device().synchronize()?;
        let forward_s = t1.elapsed().as_secs_f64();
        let stats = self.policy.take_stats();
        // Score matrices count as activations at the step's peak.
        if stats.scratch_bytes > 0 {
            self.ledger
                .reserve(Component::Activations, act + stats.scratch_bytes)?;
            self.ledger
                .release(Component::Activations, act + stats.scratch_bytes);
        }
        let mem = self.policy.memory();
        hold_kv_device(&mut self.ledger, self.policy.as_ref())?;
        self.ledger.set(Component::KvHost, mem.host_reserved);
        let (attended, context) = self.audit(&batch)?;

        let t2 = Instant::now();
        let wants_rows = !prompt_rows.is_empty()
            || sample_ids
                .iter()
                .any(|id| self.sched.seqs.get(id).is_some_and(|s| s.record_logits));
        let next = if self.model.device().is_cuda() && !wants_rows && !sample_ids.is_empty() {
            // The argmax on the device: copying [rows, vocab] f32 logits to the host and
            // scanning them there costs tens of milliseconds a step at large batches.
            let mut next = device_argmax(&logits)?;
            for (i, id) in sample_ids.iter().enumerate() {
                let forced = self
                    .sched
                    .seqs
                    .get(id)
                    .and_then(|s| s.forced.get(s.output.len()));
                if let Some(&t) = forced {
                    next[i] = t;
                }
            }
            next
        } else {
            let mut rows = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            let kept = rows.split_off(n_sampled);
            for (row, (_, id)) in kept.into_iter().zip(&prompt_rows) {
                let s = self
                    .sched
                    .seqs
                    .get_mut(id)
                    .expect("scheduled ids are known");
                s.logits.push(row);
            }
            let mut next = argmax(&rows);
            for (i, id) in sample_ids.iter().enumerate() {
                let s = self
                    .sched
                    .seqs
                    .get_mut(id)
                    .expect("scheduled ids are known");
                if let Some(&t) = s.forced.get(s.output.len()) {
                    next[i] = t;
                }
                if s.record_logits {
                    s.logits.push(rows[i].clone());
                }
            }
            next
        };
        let now = self.now();
        for &(id, n) in &plan.entries {
            let s = self
                .sched
                .seqs
                .get_mut(&id)
                .expect("scheduled ids are known");
            s.num_computed += n;
        }
        for (id, tok) in sample_ids.into_iter().zip(next) {
            self.on_token(id, tok, now);
        }
        let sample_s = t2.elapsed().as_secs_f64();
        if self.cfg.check_invariants {
            self.policy
                .check_invariants()
                .map_err(|e| Error::Config(format!("KV pool invariant broken: {e}")))?;
        }
        let (prefill, decode) = counts;
        let trace = StepTrace {
            step: self.step_no,
            kind: match (prefill > 0, decode > 0) {
                (true, false) => StepKind::Prefill,
                (false, true) => StepKind::Decode,
                _ => StepKind::Mixed,
            },
            t_start_s: t_start,
            num_seqs: plan.entries.len(),
            num_tokens: tokens.len(),
            num_prefill_tokens: prefill,
            num_decode_tokens: decode,
            num_preempted: plan.preempted.len(),
            schedule_s,
            compute_s: (forward_s - stats.cache_ops_s).max(0.0),
            cache_ops_s: stats.cache_ops_s,
            launch_s,
            sample_s,
            h2d_bytes: stats.h2d_bytes,
            d2h_bytes: stats.d2h_bytes,
            transfer_s: stats.transfer_s,
            kv_device_used_bytes: mem.device_used,
            kv_host_used_bytes: mem.host_used,
            activation_bytes: act + stats.scratch_bytes,
            attended_tokens: attended,
            context_tokens: context,
        };
        self.step_no += 1;
        self.traces.push(trace.clone());
        Ok(StepOutcome::Ran(trace))
    }

    /// Give an out-of-memory error from inside a policy the device's name and capacity.
    fn name_oom(&self, e: Error) -> Error {
        match e {
            Error::OutOfMemory {
                component,
                requested,
                available,
                ..
            } => Error::OutOfMemory {
                device: self.cfg.device_name.clone(),
                component,
                requested,
                available,
                capacity: self.cfg.device_memory.unwrap_or(0),
            },
            other => other,
        }
    }

    /// The budget audit of one step: every decode row's attended keys per layer and
    /// its device bytes against the nominal budget. Returns the attended and context
    /// tokens summed over decode rows and layers (`None` without decode rows).
    fn audit(&mut self, batch: &StepBatch) -> Result<(Option<u64>, Option<u64>)> {
        let records = self.policy.take_attended();
        if records.is_empty() {
            return Ok((None, None));
        }
        let attended = records.iter().map(|r| r.attended as u64).sum();
        let context = records.iter().map(|r| r.context as u64).sum();
        if !self.cfg.audit {
            return Ok((Some(attended), Some(context)));
        }
        let spec = &self.cfg.policy;
        let info_of = |id: SeqId| self.sched.seqs.get(&id).and_then(|s| s.info);
        for r in &records {
            let Some(info) = info_of(r.seq) else { continue };
            let allowed = nominal_attended(spec, r.layer, &info, r.context);
            if r.attended > allowed {
                return Err(Error::Budget(format!(
                    "{} at budget {}: sequence {} layer {} attended {} keys of {}, the budget allows {}",
                    spec.name(),
                    spec.budget(),
                    r.seq,
                    r.layer,
                    r.attended,
                    r.context,
                    allowed
                )));
            }
        }
        let cfg = &self.model.cfg;
        let compute = KvCodec::from_candle(self.model.dtype());
        let token_bytes = (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4) as u64;
        for s in batch.seqs.iter().filter(|s| s.q_len == 1) {
            let Some(info) = info_of(s.id) else { continue };
            if s.ctx_before < info.prefill_len {
                continue;
            }
            let n = s.ctx_before + 1;
            let held = self.policy.seq_device_bytes(s.id);
            let nominal = nominal_device_bytes(spec, cfg, &info, n, compute, self.cfg.kv_codec);
            let allowed = allowed_device_bytes(nominal, self.cfg.block_size, token_bytes);
            if held > allowed {
                return Err(Error::Budget(format!(
                    "{} at budget {}: sequence {} holds {held} device KV bytes at {n} tokens, the budget allows {allowed} ({nominal} nominal)",
                    spec.name(),
                    spec.budget(),
                    s.id
                )));
            }
        }
        Ok((Some(attended), Some(context)))
    }

    /// Pack the plan's sequences row-wise: tokens, positions, the batch layout, the rows
    /// (and sequences) that produce a token, (prefill tokens, decode tokens), and the
    /// prompt rows whose logits are kept (with their sequences).
    #[allow(clippy::type_complexity)]
    fn pack(
        &self,
        plan: &Plan,
    ) -> (
        Vec<u32>,
        Vec<u32>,
        StepBatch,
        Vec<u32>,
        Vec<SeqId>,
        (usize, usize),
        Vec<(u32, SeqId)>,
    ) {
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut batch = StepBatch::default();
        let mut rows = Vec::new();
        let mut ids = Vec::new();
        let mut kept = Vec::new();
        let (mut prefill, mut decode) = (0, 0);
        for &(id, n) in &plan.entries {
            let s = &self.sched.seqs[&id];
            let start = s.num_computed;
            let keep = s.prompt_logit_positions();
            // After a preemption the prompt is recomputed: rows already kept are not
            // kept again.
            let done = keep.start + s.logits.len().min(keep.len());
            for p in start..start + n {
                if p >= done && keep.contains(&p) {
                    kept.push((tokens.len() as u32, id));
                }
                tokens.push(s.token(p));
                positions.push(p as u32);
            }
            batch.push(id, start, n);
            // Decode = one new token after the prompt was fully computed.
            if n == 1 && start >= s.prompt.len() {
                decode += 1;
            } else {
                prefill += n;
            }
            if start + n == s.total_len() {
                rows.push((tokens.len() - 1) as u32);
                ids.push(id);
            }
        }
        (tokens, positions, batch, rows, ids, (prefill, decode), kept)
    }

    fn on_token(&mut self, id: SeqId, tok: u32, now: f64) {
        let max_len = self.max_model_len;
        let s = self.sched.seqs.get_mut(&id).expect("sampled ids are known");
        s.output.push(tok);
        s.token_times_s.push(now);
        let first = s.output.len() == 1;
        let reason = if s.stop_tokens.contains(&tok) {
            Some(FinishReason::Stop)
        } else if s.output.len() >= s.max_new_tokens {
            Some(FinishReason::Length)
        } else if s.total_len() >= max_len {
            Some(FinishReason::Context)
        } else {
            None
        };
        self.event(
            id,
            if first {
                EventKind::FirstToken
            } else {
                EventKind::Token
            },
            now,
        );
        if let Some(reason) = reason {
            let kv_device_bytes = self.policy.seq_device_bytes(id);
            let kv_host_bytes = self.policy.seq_host_bytes(id);
            self.policy.release(id);
            let s = self.sched.finish(id).expect("finished ids are known");
            self.event(id, EventKind::Finished, now);
            self.finished.push(RequestOutput {
                id,
                prompt_len: s.prompt.len(),
                output: s.output,
                arrival_s: s.arrival_s,
                admitted_s: s.admitted_s.unwrap_or(now),
                token_times_s: s.token_times_s,
                finished_s: now,
                finish_reason: reason,
                num_preemptions: s.num_preemptions,
                logits: s.logits,
                kv_device_bytes,
                kv_host_bytes,
            });
        }
    }
}

/// Greedy choice per row: the index of the largest logit, ties to the smallest index,
/// NaN skipped (0 for a row of NaN only).
pub fn argmax_rows(logits: &candle_core::Tensor) -> Result<Vec<u32>> {
    Ok(argmax(&logits.to_dtype(DType::F32)?.to_vec2::<f32>()?))
}

/// [`argmax_rows`] of logits on a CUDA device, computed there (kvbench's kernel, or
/// candle's with `KVBENCH_ARGMAX=candle`, whose ties are its own): only the ids come back.
fn device_argmax(logits: &candle_core::Tensor) -> Result<Vec<u32>> {
    #[cfg(feature = "cuda")]
    if crate::cuda::argmax_choice()? == crate::cuda::ArgmaxChoice::Kvbench {
        return crate::cuda::argmax_rows(logits);
    }
    Ok(logits
        .argmax(candle_core::D::Minus1)?
        .to_dtype(DType::U32)?
        .to_vec1::<u32>()?)
}

/// The greedy rule of [`argmax_rows`] on host rows (the CUDA kernel `argmax_part_f32`
/// follows the same rule).
pub fn argmax(rows: &[Vec<f32>]) -> Vec<u32> {
    rows.iter()
        .map(|r| {
            let mut best: Option<usize> = None;
            for (i, &x) in r.iter().enumerate() {
                if !x.is_nan() && best.is_none_or(|b| x > r[b]) {
                    best = Some(i);
                }
            }
            best.unwrap_or(0) as u32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::argmax;

    #[test]
    fn greedy_choice_takes_the_first_largest_and_skips_nan() {
        let nan = f32::NAN;
        let ninf = f32::NEG_INFINITY;
        let rows = vec![
            vec![1.0, 3.0, 2.0, 3.0],     // a tie: the smaller index
            vec![nan, 0.5, 2.0, nan],     // NaN first: skipped, not kept as the best
            vec![ninf, ninf, ninf],       // nothing larger than -inf: the first
            vec![nan, nan],               // NaN only: 0
            vec![ninf, -0.0, 0.0, 1e-30], // -0 and 0 tie; a tiny value beats both
            vec![],                       // an empty row: 0
        ];
        assert_eq!(argmax(&rows), vec![1, 2, 0, 0, 3, 0]);
    }
}
