//! `hybrid`: the study's closing recommendation made runnable. Requests whose prompt is
//! shorter than `threshold` tokens keep their whole cache (`full`); longer ones run a
//! compressing or offloading strategy (`long`: `h2o`, `snapkv`, `streaming`,
//! `infinigen`), in one engine and one batch. Each layer's packed rows are split by
//! side, each side attends its own, and the outputs are put back in batch order.
//!
//! Both sides draw on one device KV budget, split once: the full side's pool may grow
//! to `short_share` of it, the long side's to the rest (`reservation=budget`,
//! `KvPolicy::set_device_ceiling`). A split fixed up front, because pools keep what
//! they grew to: ceilings that followed the other side's holdings would let one side's
//! prefill peak starve the other for the rest of the run.

use super::full::FullParams;
use super::registry::{
    bad, parse_f64, parse_usize, unknown, DynParams, Param, Strategy, StrategyParams, Variant,
};
use super::spec::{PolicyEnv, PolicySpec, Reservation, RESERVATION_KEY};
use super::{
    AttendRecord, KvPolicy, LayerInput, PolicyMemory, PolicyStats, SeqId, SeqInfo, StepBatch,
};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::kv::codec::KV_CODEC_KEY;
use crate::kv::KvCodec;
use crate::model::Llama;
use crate::policy::infinigen::skew::Skewing;
use candle_core::Tensor;
use serde_json::json;
use std::collections::HashMap;
use std::sync::Arc;

/// The strategy long prompts run unless `long` says otherwise.
const DEFAULT_LONG: &str = "h2o";

#[derive(Debug, Clone)]
pub struct HybridParams {
    /// Budget of the long side.
    pub budget: f64,
    /// Prompts of at least this many tokens run the long side (default 8192).
    pub threshold: usize,
    /// Share of the device KV budget the full side may use (default 0.5).
    pub short_share: f64,
    /// The long side's strategy, with its parameters (`long.KEY=VALUE`) and the budget.
    pub long: Box<PolicySpec>,
    long_params: Vec<(String, String)>,
}

impl HybridParams {
    /// The strategy a request of `info` runs.
    pub fn route(&self, info: &SeqInfo) -> PolicySpec {
        if info.prompt_len < self.threshold {
            PolicySpec::full()
        } else {
            (*self.long).clone()
        }
    }

    fn side(&self, info: &SeqInfo) -> &dyn DynParams {
        if info.prompt_len < self.threshold {
            &FullParams
        } else {
            self.long.params()
        }
    }

    /// The long side from its name and parameters, checked.
    fn long_spec(name: &str, budget: f64, params: &[(String, String)]) -> Result<PolicySpec> {
        if name == Self::STRATEGY.name || name == FullParams::STRATEGY.name {
            return Err(bad(
                Self::STRATEGY.name,
                "long",
                name,
                "a strategy that compresses or offloads (not `full` or `hybrid`)",
            ));
        }
        for key in [RESERVATION_KEY, KV_CODEC_KEY] {
            if params.iter().any(|(k, _)| k == key) {
                return Err(Error::Config(format!(
                    "hybrid: `long.{key}` is the engine's: set `{key}` itself"
                )));
            }
        }
        PolicySpec::parse(name, budget, params)
    }
}

impl HybridParams {
    /// Both sides grow on demand from one budget: a pool up front is refused before
    /// anything is allocated.
    fn check_reservation(env: &PolicyEnv) -> Result<()> {
        if env.reservation != Reservation::Budget {
            return Err(Error::Config(format!(
                "hybrid: both sides share one KV budget and grow on demand: `{RESERVATION_KEY}=budget` only (got `{}`)",
                env.reservation
            )));
        }
        Ok(())
    }

    fn join(
        &self,
        short: Box<dyn KvPolicy>,
        long: Box<dyn KvPolicy>,
        env: &PolicyEnv,
    ) -> Result<Box<dyn KvPolicy>> {
        let short_bytes = (self.short_share * env.kv_device_bytes as f64) as u64;
        Ok(Box::new(HybridPolicy::new(
            self.threshold,
            (short, short_bytes),
            (long, env.kv_device_bytes - short_bytes),
        )?))
    }
}

impl StrategyParams for HybridParams {
    const STRATEGY: &'static Strategy = &Strategy {
        name: "hybrid",
        about: "full cache below a prompt-length threshold, a compressing or offloading strategy above it, in one batch",
        params: &[
            Param {
                key: "threshold",
                values: "prompt tokens ≥ 1; default 8192",
                about: "prompts at least this long run the long side",
            },
            Param {
                key: "short_share",
                values: "a fraction in (0, 1); default 0.5",
                about: "share of the device KV budget the full side may grow to; the long side has the rest",
            },
            Param {
                key: "long",
                values: "a registered strategy but `full` and `hybrid`; default h2o",
                about: "the long side's strategy (the budget is its)",
            },
            Param {
                key: "long.KEY",
                values: "that strategy's parameters",
                about: "a parameter of the long side, e.g. `long.heavy_fraction=0.3`",
            },
        ],
        budgeted: true,
        // `kvbench verify`'s prompts are 96 and 64 tokens: one on each side.
        verify: &[
            Variant::both(&[("threshold", "80")]),
            Variant::both(&[("threshold", "80"), ("long", "snapkv")]),
        ],
        audit: &[Variant::both(&[("threshold", "80")])],
        bench: &[("threshold", "1")],
        cuda: true,
        kv_codec: true,
    };

    fn at_budget(budget: f64) -> Result<Self> {
        Ok(Self {
            budget,
            threshold: 8192,
            short_share: 0.5,
            long: Box::new(Self::long_spec(DEFAULT_LONG, budget, &[])?),
            long_params: Vec::new(),
        })
    }

    fn budget(&self) -> f64 {
        self.budget
    }

    fn set(&mut self, k: &str, v: &str) -> Result<()> {
        let s = Self::STRATEGY.name;
        if let Some(key) = k.strip_prefix("long.") {
            let mut params = self.long_params.clone();
            params.push((key.to_string(), v.to_string()));
            *self.long = Self::long_spec(self.long.name(), self.budget, &params).map_err(|e| {
                Error::Config(format!(
                    "hybrid parameter `{k}={v}` (the long side, {}): {}",
                    self.long.name(),
                    match e {
                        Error::Config(m) => m,
                        e => e.to_string(),
                    }
                ))
            })?;
            self.long_params = params;
            return Ok(());
        }
        match k {
            "threshold" => {
                self.threshold = parse_usize(s, k, v)?;
                if self.threshold == 0 {
                    return Err(bad(s, k, v, "at least 1 prompt token"));
                }
            }
            "short_share" => {
                self.short_share = parse_f64(s, k, v)?;
                if !(self.short_share > 0.0 && self.short_share < 1.0) {
                    return Err(bad(s, k, v, "a fraction in (0, 1)"));
                }
            }
            // The long side's parameters set so far apply to the new strategy too.
            "long" => *self.long = Self::long_spec(v, self.budget, &self.long_params)?,
            _ => return Err(unknown(Self::STRATEGY, k)),
        }
        Ok(())
    }

    fn params_json(&self) -> serde_json::Value {
        json!({
            "threshold": self.threshold,
            "short_share": self.short_share,
            "long": self.long.name(),
            "long_params": self.long.params_json(),
        })
    }

    fn build(&self, model: &Llama, env: PolicyEnv) -> Result<Box<dyn KvPolicy>> {
        Self::check_reservation(&env)?;
        let short = StrategyParams::build(&FullParams, model, env.clone())?;
        let long = self.long.params().build(model, env.clone())?;
        self.join(short, long, &env)
    }

    /// The same wrapper over the CUDA policies: the split and the merge are tensor
    /// operations on the device. Compile-checked; it has not run on a GPU.
    #[cfg(feature = "cuda")]
    fn build_cuda(&self, model: &Llama, env: PolicyEnv) -> Result<Box<dyn KvPolicy>> {
        Self::check_reservation(&env)?;
        let short = StrategyParams::build_cuda(&FullParams, model, env.clone())?;
        let long = self.long.params().build_cuda(model, env.clone())?;
        self.join(short, long, &env)
    }

    fn nominal_attended(&self, layer: usize, info: &SeqInfo, n: usize) -> usize {
        self.side(info).nominal_attended(layer, info, n)
    }

    fn device_kv_bytes(
        &self,
        cfg: &ModelConfig,
        info: &SeqInfo,
        n: usize,
        kv: KvCodec,
        statistic: usize,
    ) -> u64 {
        self.side(info).device_kv_bytes(cfg, info, n, kv, statistic)
    }

    /// The larger of the two sides' (an upper bound for the side that stores less).
    fn cpu_kv_codec(&self, model: KvCodec, chosen: Option<KvCodec>) -> KvCodec {
        let (short, long) = (
            chosen.unwrap_or(model),
            self.long.params().cpu_kv_codec(model, chosen),
        );
        // Row bytes of an 8-element row order the codecs as any head size would.
        if long.row_bytes(8) > short.row_bytes(8) {
            long
        } else {
            short
        }
    }

    fn needs_skewing(&self) -> bool {
        self.long.needs_skewing()
    }

    fn set_skewing(&mut self, skewing: Arc<Skewing>) {
        self.long.set_skewing(skewing)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Short,
    Long,
}

pub struct HybridPolicy {
    threshold: usize,
    short: Box<dyn KvPolicy>,
    long: Box<dyn KvPolicy>,
    side: HashMap<SeqId, Side>,
    /// The device KV budget both sides share (the sum of their ceilings).
    kv_bytes: u64,
}

impl HybridPolicy {
    /// The two sides with the device bytes each may grow to.
    pub fn new(
        threshold: usize,
        (mut short, short_bytes): (Box<dyn KvPolicy>, u64),
        (mut long, long_bytes): (Box<dyn KvPolicy>, u64),
    ) -> Result<Self> {
        for (p, bytes) in [(&mut short, short_bytes), (&mut long, long_bytes)] {
            if !p.set_device_ceiling(bytes) {
                return Err(Error::Config(format!(
                    "hybrid: `{}`'s device memory cannot share a budget (a pool allocated up front)",
                    p.name()
                )));
            }
        }
        Ok(Self {
            threshold,
            short,
            long,
            side: HashMap::new(),
            kv_bytes: short_bytes + long_bytes,
        })
    }

    fn side_of(&self, seq: SeqId) -> Side {
        self.side.get(&seq).copied().unwrap_or(Side::Short)
    }

    fn policy(&mut self, side: Side) -> &mut dyn KvPolicy {
        match side {
            Side::Short => self.short.as_mut(),
            Side::Long => self.long.as_mut(),
        }
    }

    /// The step's sequences of one side, packed from row 0, and their rows in the step.
    fn sub_batch(&self, batch: &StepBatch, side: Side) -> (StepBatch, Vec<u32>) {
        let mut sub = StepBatch::default();
        let mut rows = Vec::new();
        for s in batch.seqs.iter().filter(|s| self.side_of(s.id) == side) {
            sub.push(s.id, s.ctx_before, s.q_len);
            rows.extend((s.q_start..s.q_start + s.q_len).map(|r| r as u32));
        }
        (sub, rows)
    }
}

impl KvPolicy for HybridPolicy {
    fn name(&self) -> &'static str {
        "hybrid"
    }

    fn admit(&mut self, seq: SeqId, info: SeqInfo) -> Result<()> {
        let side = if info.prompt_len < self.threshold {
            Side::Short
        } else {
            Side::Long
        };
        self.side.insert(seq, side);
        self.policy(side).admit(seq, info)
    }

    fn prepare(&mut self, held: &[SeqInfo]) -> Result<()> {
        let (short, long): (Vec<SeqInfo>, Vec<SeqInfo>) =
            held.iter().partition(|i| i.prompt_len < self.threshold);
        self.short.prepare(&short)?;
        self.long.prepare(&long)
    }

    fn set_scratch_limit(&mut self, limit: Option<u64>) {
        self.short.set_scratch_limit(limit);
        self.long.set_scratch_limit(limit);
    }

    fn reserve(&mut self, seq: SeqId, total_tokens: usize) -> Result<bool> {
        let side = *self.side.entry(seq).or_insert(Side::Short);
        self.policy(side).reserve(seq, total_tokens)
    }

    fn fits(&self, total_tokens: usize) -> bool {
        self.short.fits(total_tokens)
    }

    fn fits_request(&self, info: &SeqInfo) -> bool {
        if info.prompt_len < self.threshold {
            self.short.fits_request(info)
        } else {
            self.long.fits_request(info)
        }
    }

    fn release(&mut self, seq: SeqId) {
        let side = self.side_of(seq);
        self.policy(side).release(seq);
        self.side.remove(&seq);
    }

    fn attend(&mut self, batch: &StepBatch, input: &LayerInput<'_>) -> Result<Tensor> {
        let long = batch
            .seqs
            .iter()
            .filter(|s| self.side_of(s.id) == Side::Long)
            .count();
        if long == 0 {
            return self.short.attend(batch, input);
        }
        if long == batch.seqs.len() {
            return self.long.attend(batch, input);
        }
        let device = input.q.device();
        let mut outs = Vec::with_capacity(2);
        let mut order: Vec<u32> = Vec::with_capacity(batch.num_tokens);
        for side in [Side::Short, Side::Long] {
            let (sub, rows) = self.sub_batch(batch, side);
            let idx = Tensor::from_vec(rows.clone(), rows.len(), device)?;
            let pick = |t: &Tensor| t.index_select(&idx, 0);
            let (x, q, k, v) = (
                pick(input.x)?,
                pick(input.q)?,
                pick(input.k)?,
                pick(input.v)?,
            );
            let (q_raw, k_raw) = (pick(input.q_raw)?, pick(input.k_raw)?);
            let positions: Vec<u32> = rows.iter().map(|&r| input.positions[r as usize]).collect();
            let part = LayerInput {
                layer: input.layer,
                x: &x,
                q: &q,
                k: &k,
                v: &v,
                q_raw: &q_raw,
                k_raw: &k_raw,
                positions: &positions,
                rope: input.rope,
                // A hybrid never asks to rotate (`KvPolicy::rotates_on_write`): its
                // rows come rotated.
                rope_rows: None,
            };
            outs.push(self.policy(side).attend(&sub, &part)?);
            order.extend(rows);
        }
        // Back to batch order: row `order[i]` of the step is row `i` of the concatenation.
        let mut back = vec![0u32; order.len()];
        for (i, &r) in order.iter().enumerate() {
            back[r as usize] = i as u32;
        }
        let back = Tensor::from_vec(back, order.len(), device)?;
        Ok(Tensor::cat(&outs, 0)?.index_select(&back, 0)?)
    }

    fn end_step(&mut self, batch: &StepBatch) -> Result<()> {
        for side in [Side::Short, Side::Long] {
            let (sub, _) = self.sub_batch(batch, side);
            self.policy(side).end_step(&sub)?;
        }
        Ok(())
    }

    fn memory(&self) -> PolicyMemory {
        let (a, b) = (self.short.memory(), self.long.memory());
        PolicyMemory {
            device_reserved: a.device_reserved + b.device_reserved,
            device_used: a.device_used + b.device_used,
            host_reserved: a.host_reserved + b.host_reserved,
            host_used: a.host_used + b.host_used,
        }
    }

    fn seq_device_bytes(&self, seq: SeqId) -> u64 {
        match self.side_of(seq) {
            Side::Short => self.short.seq_device_bytes(seq),
            Side::Long => self.long.seq_device_bytes(seq),
        }
    }

    fn seq_host_bytes(&self, seq: SeqId) -> u64 {
        match self.side_of(seq) {
            Side::Short => self.short.seq_host_bytes(seq),
            Side::Long => self.long.seq_host_bytes(seq),
        }
    }

    fn take_stats(&mut self) -> PolicyStats {
        let mut s = self.short.take_stats();
        s.merge(&self.long.take_stats());
        s
    }

    fn take_attended(&mut self) -> Vec<AttendRecord> {
        let mut a = self.short.take_attended();
        a.extend(self.long.take_attended());
        a
    }

    fn kept_positions(&self, seq: SeqId, layer: usize, kv_head: usize) -> Option<Vec<u32>> {
        match self.side_of(seq) {
            Side::Short => self.short.kept_positions(seq, layer, kv_head),
            Side::Long => self.long.kept_positions(seq, layer, kv_head),
        }
    }

    fn check_invariants(&self) -> std::result::Result<(), String> {
        self.short.check_invariants()?;
        self.long.check_invariants()?;
        let held = self.memory().device_reserved;
        if held > self.kv_bytes {
            return Err(format!(
                "the two sides hold {held} device bytes, over the shared {}",
                self.kv_bytes
            ));
        }
        Ok(())
    }
}
