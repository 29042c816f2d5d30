//! The engine's schedule without its arithmetic: the engine's own [`Scheduler`] over a
//! KV pool that only counts blocks (the same [`SeqTables`] as `full`'s pool), each
//! step costed by [`traffic`](super::traffic) and timed by a clock the caller gives:
//! an efficiency for a prediction, the measured step durations for a calibration.
//! What it returns has the engine's own types ([`StepTrace`], [`RequestOutput`]), so
//! the harness computes a predicted cell's metrics with the code that computes a
//! measured one's.

use super::parallel::TensorParallel;
use super::traffic::{decode_row, forward_weights, prefill_rows};
use super::{CostError, Result, Setup, StepCost};
use crate::config::ModelConfig;
use crate::engine::StepOutcome;
use crate::kv::tables::SeqTables;
use crate::policy::audit::nominal_attended;
use crate::policy::{
    AttendRecord, KvPolicy, LayerInput, PolicyMemory, PolicyStats, SeqId, SeqInfo, StepBatch,
};
use crate::scheduler::{Scheduler, SchedulerConfig, Sequence};
use crate::trace::{FinishReason, RequestOutput, StepKind, StepTrace};
use candle_core::Tensor;

/// Which efficiency times a step: a step with any prefill rows is a prefill step (the
/// engine's own split of steps into prefill and decode walltime is by rows; a mixed
/// step's time is dominated by its prefill rows).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Prefill,
    Decode,
}

/// A request as the cost model sees it: lengths and an arrival time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimRequest {
    pub prompt_len: usize,
    pub max_new_tokens: usize,
    /// Seconds after the start at which it arrives.
    pub arrival_s: f64,
}

/// The KV pool's bookkeeping and nothing else: blocks reserved and released exactly
/// as `full`'s pool does, so the scheduler admits and preempts as it does in the
/// engine.
struct BlockCounter {
    tables: SeqTables,
}

impl KvPolicy for BlockCounter {
    fn name(&self) -> &'static str {
        "cost-model"
    }

    fn reserve(&mut self, seq: SeqId, total_tokens: usize) -> crate::Result<bool> {
        Ok(self.tables.reserve(seq, total_tokens))
    }

    fn fits(&self, total_tokens: usize) -> bool {
        self.tables.fits(total_tokens)
    }

    fn release(&mut self, seq: SeqId) {
        self.tables.release(seq);
    }

    fn attend(&mut self, _batch: &StepBatch, _input: &LayerInput<'_>) -> crate::Result<Tensor> {
        // The simulator never runs a forward; reaching this is a bug in it.
        Err(crate::error::Error::Config(
            "the cost model's block counter computes no attention".into(),
        ))
    }

    fn memory(&self) -> PolicyMemory {
        PolicyMemory::default()
    }

    fn seq_device_bytes(&self, _seq: SeqId) -> u64 {
        0
    }

    fn take_stats(&mut self) -> PolicyStats {
        PolicyStats::default()
    }

    fn take_attended(&mut self) -> Vec<AttendRecord> {
        Vec::new()
    }
}

/// Seconds of step `i` of the given phase and cost.
type StepTimer<'a> = Box<dyn FnMut(usize, Phase, &StepCost) -> f64 + 'a>;

/// The engine's step loop on the cost model: `add_request`, `step`, `finished`, with
/// a virtual clock ([`SimEngine::wait_until`] stands for sleeping).
pub struct SimEngine<'a> {
    /// The per-GPU shape.
    setup: Setup,
    /// The whole model (all-reduce sizes under tensor parallelism).
    full_model: ModelConfig,
    tp: TensorParallel,
    sched: Scheduler,
    pool: BlockCounter,
    max_model_len: usize,
    clock: f64,
    timer: StepTimer<'a>,
    next_id: SeqId,
    traces: Vec<StepTrace>,
    costs: Vec<StepCost>,
    finished: Vec<RequestOutput>,
}

impl<'a> SimEngine<'a> {
    /// `setup` is the per-GPU shard of `full_model` under `tp`; `kv_blocks` the KV pool
    /// in blocks of `setup.block_size` (`full`), or `None` for a pool that grows on
    /// demand (the other strategies hold their budget: the memory model checks it).
    pub fn new(
        setup: Setup,
        full_model: ModelConfig,
        tp: TensorParallel,
        scheduler: SchedulerConfig,
        kv_blocks: Option<usize>,
        max_model_len: usize,
        timer: impl FnMut(usize, Phase, &StepCost) -> f64 + 'a,
    ) -> Result<Self> {
        setup.check()?;
        if scheduler.max_num_seqs == 0 || scheduler.max_batched_tokens == 0 {
            return Err(CostError::Invalid(
                "max_num_seqs and max_batched_tokens must be ≥ 1".into(),
            ));
        }
        let tables = match kv_blocks {
            Some(n) => SeqTables::new(n, setup.block_size, None),
            None => SeqTables::on_demand(usize::MAX, setup.block_size),
        };
        Ok(Self {
            setup,
            full_model,
            tp,
            sched: Scheduler::new(scheduler),
            pool: BlockCounter { tables },
            max_model_len,
            clock: 0.0,
            timer: Box::new(timer),
            next_id: 0,
            traces: Vec::new(),
            costs: Vec::new(),
            finished: Vec::new(),
        })
    }

    pub fn now(&self) -> f64 {
        self.clock
    }

    /// Let time pass until `t` (what the harness's driver does by sleeping).
    pub fn wait_until(&mut self, t: f64) {
        if t.is_finite() {
            self.clock = self.clock.max(t);
        }
    }

    pub fn finished(&self) -> &[RequestOutput] {
        &self.finished
    }

    pub fn traces(&self) -> &[StepTrace] {
        &self.traces
    }

    /// What each step read, moved and computed, in step order.
    pub fn costs(&self) -> &[StepCost] {
        &self.costs
    }

    /// Queue a request; one the engine would reject is an error naming why.
    pub fn add_request(&mut self, r: SimRequest) -> Result<SeqId> {
        let total = r.prompt_len + r.max_new_tokens;
        if r.prompt_len == 0 || r.max_new_tokens == 0 {
            return Err(CostError::Invalid(
                "a request needs a prompt and at least one output token".into(),
            ));
        }
        if !(r.arrival_s.is_finite() && r.arrival_s >= 0.0) {
            return Err(CostError::Invalid(format!(
                "arrival time {} s must be finite and non-negative",
                r.arrival_s
            )));
        }
        if total > self.max_model_len {
            return Err(CostError::Invalid(format!(
                "prompt {} + output {} tokens exceed max_model_len {}",
                r.prompt_len, r.max_new_tokens, self.max_model_len
            )));
        }
        if !self.pool.fits(total) {
            return Err(CostError::Invalid(format!(
                "{total} tokens need more KV than the whole pool holds"
            )));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.sched.add(Sequence {
            id,
            // Only the lengths matter here: the token ids are never read.
            prompt: vec![0; r.prompt_len],
            output: Vec::new(),
            max_new_tokens: r.max_new_tokens,
            stop_tokens: Vec::new(),
            arrival_s: r.arrival_s,
            num_computed: 0,
            num_preemptions: 0,
            admitted_s: None,
            token_times_s: Vec::new(),
            info: None,
            forced: Vec::new(),
            record_logits: false,
            logits: Vec::new(),
            prompt_logits_from: None,
        });
        Ok(id)
    }

    /// One step, as [`crate::engine::Engine::step`] schedules and accounts it.
    pub fn step(&mut self) -> Result<StepOutcome> {
        if self.sched.is_empty() {
            return Ok(StepOutcome::Done);
        }
        let t_start = self.clock;
        // The block counter allocates nothing that can fail.
        let plan = self
            .sched
            .schedule(t_start, &mut self.pool)
            .map_err(|e| CostError::Invalid(format!("scheduling: {e}")))?;
        if plan.entries.is_empty() {
            if self.sched.running.is_empty() {
                if let Some(next) = self.sched.next_arrival() {
                    if next > t_start {
                        return Ok(StepOutcome::Idle { until_s: next });
                    }
                }
            }
            return Err(CostError::Invalid(
                "scheduler made no progress: no request can be scheduled".into(),
            ));
        }
        for &id in &plan.admitted {
            if let Some(s) = self.sched.seqs.get_mut(&id) {
                s.admitted_s.get_or_insert(t_start);
            }
        }
        let mut cost = StepCost::default();
        let (mut prefill, mut decode, mut tokens) = (0, 0, 0);
        let (mut attended, mut context) = (0u64, 0u64);
        let mut sampled = Vec::new();
        let layers = self.setup.model.num_layers;
        for &(id, n) in &plan.entries {
            let s = &self.sched.seqs[&id];
            let start = s.num_computed;
            let info = s.info.unwrap_or(SeqInfo {
                prompt_len: s.prompt.len(),
                max_new_tokens: s.max_new_tokens,
                prefill_len: s.total_len(),
            });
            // The engine's rule: one new token after the whole prompt is a decode row.
            if n == 1 && start >= s.prompt.len() {
                decode += 1;
                let ctx = start + 1;
                cost.add(&decode_row(&self.setup, &info, ctx));
                attended += (0..layers)
                    .map(|l| nominal_attended(&self.setup.policy, l, &info, ctx) as u64)
                    .sum::<u64>();
                context += (layers * ctx) as u64;
            } else {
                prefill += n;
                cost.add(&prefill_rows(&self.setup, &info, start, start + n));
            }
            tokens += n;
            if start + n == s.total_len() {
                sampled.push(id);
            }
        }
        cost.add(&forward_weights(
            &self.setup.model,
            self.setup.precision.weight,
            tokens,
        ));
        self.tp
            .add_allreduces(&mut cost, &self.full_model, self.setup.precision.activation);
        let phase = if prefill > 0 {
            Phase::Prefill
        } else {
            Phase::Decode
        };
        let seconds = (self.timer)(self.traces.len(), phase, &cost);
        if !(seconds.is_finite() && seconds >= 0.0) {
            return Err(CostError::Invalid(format!(
                "step {}: a step time of {seconds} s",
                self.traces.len()
            )));
        }
        self.clock += seconds;
        let now = self.clock;
        for &(id, n) in &plan.entries {
            if let Some(s) = self.sched.seqs.get_mut(&id) {
                s.num_computed += n;
            }
        }
        for id in sampled {
            self.on_token(id, now);
        }
        let trace = StepTrace {
            step: self.traces.len() as u64,
            kind: match (prefill > 0, decode > 0) {
                (true, false) => StepKind::Prefill,
                (false, true) => StepKind::Decode,
                _ => StepKind::Mixed,
            },
            t_start_s: t_start,
            num_seqs: plan.entries.len(),
            num_tokens: tokens,
            num_prefill_tokens: prefill,
            num_decode_tokens: decode,
            num_preempted: plan.preempted.len(),
            // The model's time is one number: all of it is the step's compute.
            schedule_s: 0.0,
            compute_s: seconds,
            cache_ops_s: 0.0,
            // The host's share is not modelled apart.
            launch_s: None,
            sample_s: 0.0,
            h2d_bytes: cost.h2d as u64,
            d2h_bytes: cost.d2h as u64,
            transfer_s: 0.0,
            // Not modelled per step (the memory model gives the run's bytes).
            kv_device_used_bytes: 0,
            kv_host_used_bytes: 0,
            activation_bytes: 0,
            attended_tokens: (decode > 0).then_some(attended),
            context_tokens: (decode > 0).then_some(context),
        };
        self.traces.push(trace.clone());
        self.costs.push(cost);
        Ok(StepOutcome::Ran(trace))
    }

    /// The engine's `on_token` without a sampled token: no stop tokens, so a request
    /// ends at its output limit or at the model's context.
    fn on_token(&mut self, id: SeqId, now: f64) {
        let max_len = self.max_model_len;
        let Some(s) = self.sched.seqs.get_mut(&id) else {
            return;
        };
        s.output.push(0);
        s.token_times_s.push(now);
        let reason = if s.output.len() >= s.max_new_tokens {
            Some(FinishReason::Length)
        } else if s.total_len() >= max_len {
            Some(FinishReason::Context)
        } else {
            None
        };
        if let Some(reason) = reason {
            self.pool.release(id);
            if let Some(s) = self.sched.finish(id) {
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
                    kv_device_bytes: 0,
                    kv_host_bytes: 0,
                    logits: Vec::new(),
                });
            }
        }
    }

    /// Run every queued request to its end, waiting for arrivals.
    pub fn run_to_end(&mut self) -> Result<()> {
        loop {
            match self.step()? {
                StepOutcome::Ran(_) => {}
                StepOutcome::Idle { until_s } => self.wait_until(until_s),
                StepOutcome::Done => return Ok(()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::preset;
    use crate::cost::device::DeviceTable;
    use crate::cost::predict::{predict, Efficiency, Scenario};
    use crate::cost::Precision;
    use crate::policy::evicting::h2o::H2oParams;
    use crate::policy::spec::PolicySpec;
    use crate::scheduler::PrefillMode;

    fn setup(policy: PolicySpec) -> Setup {
        Setup::new(preset("smollm2-135m").unwrap(), policy, Precision::F32)
    }

    fn sched(max_num_seqs: usize, prefill: PrefillMode) -> SchedulerConfig {
        SchedulerConfig {
            max_num_seqs,
            max_batched_tokens: 8192,
            prefill,
        }
    }

    fn sim<'a>(
        s: &Setup,
        cfg: SchedulerConfig,
        blocks: Option<usize>,
        timer: impl FnMut(usize, Phase, &StepCost) -> f64 + 'a,
    ) -> SimEngine<'a> {
        SimEngine::new(
            s.clone(),
            s.model.clone(),
            TensorParallel::new(1).unwrap(),
            cfg,
            blocks,
            s.model.max_position_embeddings,
            timer,
        )
        .unwrap()
    }

    fn req(prompt_len: usize, max_new_tokens: usize) -> SimRequest {
        SimRequest {
            prompt_len,
            max_new_tokens,
            arrival_s: 0.0,
        }
    }

    #[test]
    fn sequential_prefill_then_decode_steps_as_the_engine_schedules_them() {
        let s = setup(PolicySpec::H2o(H2oParams {
            budget: 0.3,
            ..Default::default()
        }));
        let mut e = sim(&s, sched(2, PrefillMode::Sequential), None, |_, _, _| 1.0);
        for _ in 0..3 {
            e.add_request(req(100, 4)).unwrap();
        }
        e.run_to_end().unwrap();
        let kinds: Vec<(usize, usize)> = e
            .traces()
            .iter()
            .map(|t| (t.num_prefill_tokens, t.num_decode_tokens))
            .collect();
        // Two admitted one prompt per step (at most 2 running), three decode steps of
        // both, then the third request alone.
        assert_eq!(
            kinds,
            vec![
                (100, 0),
                (100, 0),
                (0, 2),
                (0, 2),
                (0, 2),
                (100, 0),
                (0, 1),
                (0, 1),
                (0, 1)
            ]
        );
        let f = e.finished();
        assert_eq!(f.len(), 3);
        // One second per step: first tokens at the end of steps 1, 2 and 6.
        let ttft: Vec<f64> = f.iter().map(|r| r.ttft_s().unwrap()).collect();
        assert_eq!(ttft, vec![1.0, 2.0, 6.0]);
        assert!(f.iter().all(|r| r.output.len() == 4));
        // Decode rows attend at most the budget: C = ⌊0.3·100⌋ = 30, + 1.
        let t = &e.traces()[2];
        let layers = s.model.num_layers as u64;
        assert_eq!(t.attended_tokens, Some(2 * layers * 31));
        assert_eq!(t.context_tokens, Some(2 * layers * 101));
    }

    #[test]
    fn a_full_pool_preempts_as_the_scheduler_does() {
        let s = setup(PolicySpec::full());
        // 4 blocks of 16: two sequences of 20 + 8 tokens need 2 blocks each to start,
        // then a third block each past 32 tokens: one is preempted and recomputed.
        let mut e = sim(&s, sched(8, PrefillMode::Chunked), Some(4), |_, _, _| 0.5);
        e.add_request(req(20, 20)).unwrap();
        e.add_request(req(20, 20)).unwrap();
        e.run_to_end().unwrap();
        let f = e.finished();
        assert_eq!(f.len(), 2);
        assert!(f.iter().map(|r| r.num_preemptions).sum::<usize>() >= 1);
        assert!(e.traces().iter().any(|t| t.num_preempted > 0));
        // A request larger than the pool is refused as the engine refuses it.
        assert!(e.add_request(req(60, 10)).is_err());
    }

    #[test]
    fn one_wave_of_identical_requests_matches_the_closed_form_prediction() {
        let d = DeviceTable::builtin()
            .unwrap()
            .get("h100-sxm")
            .unwrap()
            .clone();
        let eff = Efficiency::peak(&d).unwrap();
        for policy in [
            PolicySpec::full(),
            PolicySpec::H2o(H2oParams {
                budget: 0.3,
                ..Default::default()
            }),
        ] {
            let s = Setup::new(preset("llama-3.1-8b").unwrap(), policy, Precision::BF16);
            let mut sc = Scenario::new(s.clone(), 4, 512, 16);
            sc.max_model_len = Some(4096);
            sc.sequential_prefill = true;
            let p = predict(&d, &eff, &sc).unwrap();
            let mut e = sim(
                &s,
                sched(4, PrefillMode::Sequential),
                None,
                |_, phase, c: &StepCost| eff.time(phase, c),
            );
            for _ in 0..4 {
                e.add_request(req(512, 16)).unwrap();
            }
            e.run_to_end().unwrap();
            let f = e.finished();
            let ttft = f.iter().map(|r| r.ttft_s().unwrap()).sum::<f64>() / 4.0;
            let rel = |a: f64, b: f64| (a / b - 1.0).abs();
            assert!(rel(ttft, p.ttft_s.unwrap()) < 1e-9, "{ttft} vs {p:?}");
            let end = f.iter().map(|r| r.finished_s).fold(0.0, f64::max);
            assert!(
                rel(end, p.total_s.unwrap()) < 1e-9,
                "{end} vs {:?}",
                p.total_s
            );
            // The same bytes in all.
            let mut all = StepCost::default();
            for c in e.costs() {
                all.add(c);
            }
            let mut want = p.prefill_cost;
            want.add(&p.decode_cost);
            assert!(rel(all.device_bytes(), want.device_bytes()) < 1e-9);
            assert!(rel(all.flops(), want.flops()) < 1e-9);
        }
    }
}
