//! Per-cell predictions: memory by component and the OOM outcome, then TTFT, TPOT,
//! decode throughput and end-to-end latency (docs/cost-model.md §6).

use super::device::Device;
use super::fit::PhaseEfficiency;
use super::memory::{memory_held, MemoryHeld, MemoryInputs, Oom};
use super::parallel::TensorParallel;
use super::simulate::Phase;
use super::traffic::{decode_step, prefill, weight_read_bytes};
use super::{CostError, MemoryReport, Result, Setup, StepCost};
use crate::policy::spec::PolicySpec;
use crate::policy::SeqInfo;
use crate::scheduler::SchedulerConfig;
use serde::Serialize;

/// Efficiency constants of one device, per phase.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Efficiency {
    pub prefill: PhaseEfficiency,
    pub decode: PhaseEfficiency,
    /// Where the constants come from (a fit's experiment, or "datasheet peaks").
    pub source: String,
}

impl Efficiency {
    /// Datasheet peaks and no overheads in both phases: the roofline (a lower bound
    /// on every time), not a calibration.
    pub fn peak(d: &Device) -> Result<Self> {
        let p = PhaseEfficiency::peak(d)?;
        Ok(Self {
            prefill: p,
            decode: p,
            source: format!("{} datasheet peaks (roofline, not calibrated)", d.name),
        })
    }

    /// Seconds of one step of `phase`.
    pub fn time(&self, phase: Phase, c: &StepCost) -> f64 {
        match phase {
            Phase::Prefill => self.prefill.time(c),
            Phase::Decode => self.decode.time(c),
        }
    }
}

/// One cell: a setup, a batch of identical requests arriving together, and how the
/// engine is configured.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub setup: Setup,
    pub batch: usize,
    pub prompt_len: usize,
    pub output_len: usize,
    /// GPUs in tensor parallelism.
    pub tensor_parallel: usize,
    pub memory_fraction: f64,
    /// `None`: the model's context, as the engine.
    pub max_model_len: Option<usize>,
    pub max_num_seqs: usize,
    pub max_batched_tokens: usize,
    /// Prefill one prompt at a time (the study's H2O and InfiniGen), or all prompts
    /// together in forwards of `max_batched_tokens`.
    pub sequential_prefill: bool,
    /// Host bytes an offloading policy may use (`None`: the engine's default).
    pub host_memory: Option<u64>,
}

impl Scenario {
    /// The engine's defaults: fraction 0.9, the scheduler's limits, sequential
    /// prefill for every strategy but `full`.
    pub fn new(setup: Setup, batch: usize, prompt_len: usize, output_len: usize) -> Self {
        let sched = SchedulerConfig::default();
        let sequential_prefill = !matches!(setup.policy, PolicySpec::Full(_));
        Self {
            setup,
            batch,
            prompt_len,
            output_len,
            tensor_parallel: 1,
            memory_fraction: 0.9,
            max_model_len: None,
            max_num_seqs: sched.max_num_seqs,
            max_batched_tokens: sched.max_batched_tokens,
            sequential_prefill,
            host_memory: None,
        }
    }

    fn check(&self) -> Result<()> {
        if self.batch == 0 || self.prompt_len == 0 || self.output_len == 0 {
            return Err(CostError::Invalid(
                "batch, prompt length and output length must be ≥ 1".into(),
            ));
        }
        if !(self.memory_fraction > 0.0 && self.memory_fraction <= 1.0) {
            return Err(CostError::Invalid(format!(
                "memory fraction {} must be in (0, 1]",
                self.memory_fraction
            )));
        }
        if self.max_num_seqs == 0 || self.max_batched_tokens == 0 {
            return Err(CostError::Invalid(
                "max_num_seqs and max_batched_tokens must be ≥ 1".into(),
            ));
        }
        self.setup.check()
    }

    fn info(&self) -> SeqInfo {
        SeqInfo {
            prompt_len: self.prompt_len,
            max_new_tokens: self.output_len,
            prefill_len: self.prompt_len,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "outcome")]
pub enum Outcome {
    Ok,
    Oom(Oom),
}

/// A predicted cell. Times are `None` when the outcome is OOM.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Prediction {
    pub outcome: Outcome,
    /// Per GPU; `kv_host` is the host total of the run.
    pub memory: MemoryReport,
    pub capacity: u64,
    /// Requests running at once (`full`: what its pool holds).
    pub concurrency: usize,
    /// Mean over requests.
    pub ttft_s: Option<f64>,
    /// Mean seconds per decode step.
    pub tpot_s: Option<f64>,
    /// Decode tokens per second over the decode phases.
    pub decode_tokens_per_s: Option<f64>,
    /// Mean end-to-end latency per request.
    pub e2e_s: Option<f64>,
    /// Until the last request finishes (the study's "total latency").
    pub total_s: Option<f64>,
    pub prefill_s: Option<f64>,
    pub decode_s: Option<f64>,
    /// Totals of the run, per GPU.
    pub prefill_cost: StepCost,
    pub decode_cost: StepCost,
}

/// The per-GPU setup and memory of a scenario.
fn shard_and_memory(
    device: &Device,
    sc: &Scenario,
) -> Result<(Setup, TensorParallel, MemoryHeld, u64)> {
    sc.check()?;
    let tp = TensorParallel::new(sc.tensor_parallel)?;
    let shard = Setup {
        model: tp.shard(&sc.setup.model)?,
        ..sc.setup.clone()
    };
    let capacity = device.capacity()?;
    let inputs = MemoryInputs {
        sequences: sc.batch,
        // Prompts held whole at once before their eviction: one in sequential mode; in
        // chunked mode those a step's token budget reaches, and the one finishing.
        prefill_sequences: if sc.sequential_prefill {
            1
        } else {
            sc.batch
                .min(sc.max_batched_tokens.div_ceil(sc.prompt_len.max(1)) + 1)
        },
        info: sc.info(),
        capacity,
        memory_fraction: sc.memory_fraction,
        max_model_len: sc
            .max_model_len
            .unwrap_or(sc.setup.model.max_position_embeddings),
        max_num_seqs: sc.max_num_seqs,
        max_batched_tokens: sc.max_batched_tokens,
        host_memory: sc.host_memory.map(|h| h / sc.tensor_parallel as u64),
    };
    let mut mem = memory_held(&shard, &inputs)?;
    if mem.oom.is_none() && mem.concurrency == 0 {
        // Not one request fits the pool: the engine rejects it.
        let per_seq = (sc.prompt_len + sc.output_len).div_ceil(shard.block_size) as u64
            * super::memory::block_bytes(&shard)?;
        mem.oom = Some(Oom {
            component: crate::error::Component::KvDevice,
            requested: per_seq,
            available: mem.kv_pool,
            capacity,
        });
    }
    mem.report.kv_host *= sc.tensor_parallel as u64;
    Ok((shard, tp, mem, capacity))
}

/// Memory by component and the OOM outcome only (no timing).
pub fn memory(device: &Device, sc: &Scenario) -> Result<MemoryHeld> {
    Ok(shard_and_memory(device, sc)?.2)
}

/// Predict one cell on `sc.tensor_parallel` devices like `device`.
pub fn predict(device: &Device, eff: &Efficiency, sc: &Scenario) -> Result<Prediction> {
    let (shard, tp, mem, capacity) = shard_and_memory(device, sc)?;
    let mut pred = Prediction {
        outcome: Outcome::Ok,
        memory: mem.report,
        capacity,
        concurrency: mem.concurrency,
        ttft_s: None,
        tpot_s: None,
        decode_tokens_per_s: None,
        e2e_s: None,
        total_s: None,
        prefill_s: None,
        decode_s: None,
        prefill_cost: StepCost::default(),
        decode_cost: StepCost::default(),
    };
    if let Some(o) = mem.oom {
        pred.outcome = Outcome::Oom(o);
        return Ok(pred);
    }
    let full_model = &sc.setup.model;
    let act = sc.setup.precision.activation;
    let info = sc.info();
    let needs = |c: &StepCost, e: &PhaseEfficiency| -> Result<()> {
        if c.transfer_bytes() > 0.0 && e.link.is_none() && device.host_link.is_none() {
            return Err(CostError::UnknownFigure {
                device: device.name.clone(),
                field: "host_link".into(),
            });
        }
        if c.allreduce_bytes > 0.0 && e.interconnect.is_none() && device.interconnect.is_none() {
            return Err(CostError::UnknownFigure {
                device: device.name.clone(),
                field: "interconnect".into(),
            });
        }
        Ok(())
    };
    let mut one = prefill(&shard, &info, sc.max_batched_tokens);
    tp.add_allreduces(&mut one, full_model, act);

    let (mut clock, mut ttft_sum, mut e2e_sum) = (0.0, 0.0, 0.0);
    let (mut prefill_s, mut decode_s, mut decode_tokens, mut steps) = (0.0, 0.0, 0.0, 0.0);
    let conc = mem.concurrency.max(1);
    let mut left = sc.batch;
    while left > 0 {
        let w = left.min(conc);
        left -= w;
        // Prefill of the wave.
        let (cost, firsts): (StepCost, Vec<f64>) = if sc.sequential_prefill {
            let tp1 = eff.prefill.time(&one);
            (
                one.scaled(w as f64),
                (1..=w).map(|i| i as f64 * tp1).collect(),
            )
        } else {
            let rows = (w * sc.prompt_len) as u64;
            let forwards = rows.div_ceil(sc.max_batched_tokens as u64);
            let mut c = one.scaled(w as f64);
            c.forwards = forwards as f64;
            c.weight_read = weight_read_bytes(&shard.model, shard.precision.weight, rows) as f64
                + (forwards as f64 - 1.0)
                    * weight_read_bytes(&shard.model, shard.precision.weight, 0) as f64;
            c.allreduces = 0.0;
            c.allreduce_bytes = 0.0;
            tp.add_allreduces(&mut c, full_model, act);
            let total = eff.prefill.time(&c);
            let l = sc.prompt_len as u64;
            let firsts = (1..=w as u64)
                .map(|i| {
                    total * (i * l).div_ceil(sc.max_batched_tokens as u64) as f64 / forwards as f64
                })
                .collect();
            (c, firsts)
        };
        needs(&cost, &eff.prefill)?;
        let t_prefill = eff.prefill.time(&cost);
        pred.prefill_cost.add(&cost);
        // Decode of the wave: steps t = 1 … T−1 with n = L0 + t tokens of context.
        let mut t_decode = 0.0;
        for t in 1..sc.output_len {
            let mut c = decode_step(&shard, &info, sc.prompt_len + t, w);
            tp.add_allreduces(&mut c, full_model, act);
            needs(&c, &eff.decode)?;
            t_decode += eff.decode.time(&c);
            pred.decode_cost.add(&c);
        }
        for f in &firsts {
            ttft_sum += clock + f;
        }
        e2e_sum += w as f64 * (clock + t_prefill + t_decode);
        clock += t_prefill + t_decode;
        prefill_s += t_prefill;
        decode_s += t_decode;
        decode_tokens += (w * (sc.output_len - 1)) as f64;
        steps += (sc.output_len - 1) as f64;
    }
    let b = sc.batch as f64;
    pred.ttft_s = Some(ttft_sum / b);
    pred.e2e_s = Some(e2e_sum / b);
    pred.total_s = Some(clock);
    pred.prefill_s = Some(prefill_s);
    pred.decode_s = Some(decode_s);
    if steps > 0.0 {
        pred.tpot_s = Some(decode_s / steps);
        pred.decode_tokens_per_s = Some(decode_tokens / decode_s);
    }
    Ok(pred)
}

/// The shortest prompt at which the scenario runs out of memory (the TTFT figure's
/// OOM boundary), searching prompt lengths `1 ..= max` with everything else fixed;
/// `None` when even `max` fits. Assumes memory grows with the prompt.
pub fn oom_boundary_prompt_len(
    device: &Device,
    sc: &Scenario,
    max: usize,
) -> Result<Option<usize>> {
    let oom = |l: usize| -> Result<bool> {
        let mut s = sc.clone();
        s.prompt_len = l;
        Ok(memory(device, &s)?.oom.is_some())
    };
    if max == 0 || !oom(max)? {
        return Ok(None);
    }
    let (mut lo, mut hi) = (0usize, max); // oom(lo) false (or lo = 0), oom(hi) true
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if oom(mid)? {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Ok(Some(hi))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::prefill::AttentionImpl;
    use crate::config::preset;
    use crate::cost::device::DeviceTable;
    use crate::cost::Precision;
    use crate::error::Component;
    use crate::policy::evicting::h2o::H2oParams;

    fn h100() -> Device {
        DeviceTable::builtin()
            .unwrap()
            .get("h100-sxm")
            .unwrap()
            .clone()
    }

    #[test]
    fn roofline_of_llama_8b_decode_at_batch_1_on_h100_sxm() {
        let d = h100();
        let s = Setup::new(
            preset("llama-3.1-8b").unwrap(),
            PolicySpec::full(),
            Precision::BF16,
        );
        let mut sc = Scenario::new(s, 1, 16, 2);
        sc.max_model_len = Some(4096);
        let p = predict(&d, &Efficiency::peak(&d).unwrap(), &sc).unwrap();
        assert_eq!(p.outcome, Outcome::Ok);
        // 16.06 GB of weights held; 15.0 GB read per step (the embedding table is not
        // swept): 15.01 GB / 3.35 TB/s = 4.48 ms, the "≈ 16 GB / 3.35 TB/s ≈ 4.8 ms"
        // floor less the embedding table.
        assert!((p.memory.weights as f64 / 1e9 - 16.06).abs() < 0.01);
        let tpot = p.tpot_s.unwrap() * 1e3;
        assert!((4.4..4.9).contains(&tpot), "{tpot} ms");
        let weights_only = weight_read_bytes(&sc.setup.model, 2, 1) as f64 / 3.35e12 * 1e3;
        assert!(
            (tpot / weights_only - 1.0).abs() < 0.01,
            "{tpot} vs {weights_only}"
        );
    }

    #[test]
    fn oom_is_predicted_exactly_when_memory_exceeds_capacity() {
        let mut s = Setup::new(
            preset("smollm2-135m").unwrap(),
            PolicySpec::H2o(H2oParams {
                budget: 0.3,
                ..Default::default()
            }),
            Precision::F32,
        );
        s.attention = AttentionImpl::Eager;
        let mut sc = Scenario::new(s, 4, 2000, 16);
        // A start-up profile smaller than the prefill's eager score matrices, so the
        // step's activations are what the capacity must hold.
        sc.max_batched_tokens = 2048;
        let mut d = h100();
        let m = memory(&d, &sc).unwrap();
        assert!(m.oom.is_none());
        let need = m.report.device_total();
        d.measured_memory_bytes = Some(need);
        assert!(memory(&d, &sc).unwrap().oom.is_none());
        d.measured_memory_bytes = Some(need - 1);
        let oom = memory(&d, &sc).unwrap().oom.unwrap();
        assert_eq!(oom.component, Component::Activations);
        assert_eq!(oom.capacity, need - 1);
        let p = predict(&d, &Efficiency::peak(&d).unwrap(), &sc).unwrap();
        assert!(matches!(p.outcome, Outcome::Oom(_)) && p.ttft_s.is_none());

        // The boundary search lands where the outcome flips.
        d.measured_memory_bytes = Some(need);
        let b = oom_boundary_prompt_len(&d, &sc, 100_000).unwrap().unwrap();
        let at = |l: usize| {
            let mut s = sc.clone();
            s.prompt_len = l;
            memory(&d, &s).unwrap().oom.is_some()
        };
        assert!(b > 2000 && at(b) && !at(b - 1), "{b}");
    }

    #[test]
    fn llama_70b_needs_four_h100s_and_tensor_parallelism_splits_weights() {
        let d = h100();
        let eff = Efficiency::peak(&d).unwrap();
        let s = Setup::new(
            preset("llama-3.1-70b").unwrap(),
            PolicySpec::full(),
            Precision::BF16,
        );
        let mut sc = Scenario::new(s, 8, 1000, 32);
        sc.max_model_len = Some(8192);
        let one = predict(&d, &eff, &sc).unwrap();
        match one.outcome {
            Outcome::Oom(o) => assert_eq!(o.component, Component::Weights),
            Outcome::Ok => panic!("70B bf16 cannot fit one H100"),
        }
        sc.tensor_parallel = 4;
        let four = predict(&d, &eff, &sc).unwrap();
        assert_eq!(four.outcome, Outcome::Ok);
        let per_gpu = four.memory.weights as f64 / 1e9;
        assert!((per_gpu - 141.1 / 4.0).abs() < 0.1, "{per_gpu} GB");
        assert!(four.decode_cost.allreduces > 0.0);

        // 8B on two GPUs: each reads half the weights, and pays the all-reduces.
        let s = Setup::new(
            preset("llama-3.1-8b").unwrap(),
            PolicySpec::full(),
            Precision::BF16,
        );
        let mut sc = Scenario::new(s, 1, 16, 2);
        sc.max_model_len = Some(4096);
        let p1 = predict(&d, &eff, &sc).unwrap();
        sc.tensor_parallel = 2;
        let p2 = predict(&d, &eff, &sc).unwrap();
        let r = p2.decode_cost.weight_read / p1.decode_cost.weight_read;
        assert!((r - 0.5).abs() < 1e-3, "{r}");
        let c = p2.decode_cost;
        let ar = c.allreduce_bytes / 450e9;
        let t2 = p2.tpot_s.unwrap();
        let expected = c.device_bytes() / 3.35e12 + c.flops() / 989.5e12 + ar;
        assert!(
            (t2 - expected).abs() < 1e-9 * expected,
            "{t2} vs {expected}"
        );
        assert!(ar > 0.0 && t2 < p1.tpot_s.unwrap());
    }
}
