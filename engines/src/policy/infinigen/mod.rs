//! `infinigen`: the full K/V of layers ≥ 2 in a host tier, partial skewed keys on the
//! device, and per decode step a speculative selection of layer ℓ's important tokens
//! made inside layer ℓ−1 from ℓ−1's input (algorithms.md §4). Only the selected K/V are
//! gathered into a device staging buffer (two of them, ping-pong by layer parity);
//! bytes and seconds of every move go into the step's stats.
//!
//! [adapt] choices (algorithms.md §4, §11): one skewing matrix per KV head from the
//! stacked queries of its group; column importance Σ|Q̃| + Σ|K̃| summed over the group;
//! the count k is per sequence; per KV head the estimated score of a token is the max
//! over its query heads; `n ≤ k_max` fetches everything.

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod skew;

use crate::attention::decode::{decode_attention, DecodeRow, DecodeShape, KeySet};
use crate::attention::prefill::{prefill_attention, PrefillShape};
use crate::config::ModelConfig;
use crate::error::{Component, Error, Result};
use crate::kv::host::{CpuHostTier, HostTier};
use crate::kv::{KvCodec, PagedKv, SeqTables};
use crate::model::{Linear, Llama};
use crate::policy::budget::{infinigen_k_max, infinigen_selection_cap};
use crate::policy::infinigen::skew::Skewing;
use crate::policy::registry::{
    bad, parse_bool, parse_f64, parse_usize, unknown, Param, Strategy, StrategyParams, Variant,
};
use crate::policy::spec::{PolicyEnv, Reservation};
use crate::policy::to_f32;
use crate::policy::{
    AttendRecord, KvPolicy, LayerInput, PolicyMemory, PolicyStats, SeqId, SeqInfo, StepBatch,
};
use candle_core::Tensor;
use serde_json::json;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// Where layer ℓ's selection comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Speculation {
    /// Layer ℓ's query projection applied to layer ℓ−1's input (the algorithm).
    Previous,
    /// Layer ℓ's own query (tests: with `partial_ratio = 1` the selection is the true
    /// top-k).
    Oracle,
}

/// How the selected rows reach the device on CUDA (the CPU policy copies them in
/// process either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Transfer {
    /// A gather kernel on a second stream reads the rows from mapped host memory.
    #[default]
    ZeroCopy,
    /// The original's: the selection copied back to the host, the rows gathered there
    /// into pinned staging, then copied to the device on a second stream.
    Memcpy,
}

impl Transfer {
    pub fn name(self) -> &'static str {
        match self {
            Transfer::ZeroCopy => "zero_copy",
            Transfer::Memcpy => "memcpy",
        }
    }
}

#[derive(Debug, Clone)]
pub struct InfinigenParams {
    pub budget: f64,
    /// Threshold in the scaled-logit domain (original Llama default 5).
    pub alpha: f64,
    /// ρ: fraction of head dimensions kept in the partial keys (default 0.2).
    pub partial_ratio: f64,
    /// `k_max = ⌈b·n⌉` of the current length instead of `⌈b·(L0 + T)⌉`.
    pub relative_to_current: bool,
    /// Leading layers attended densely from device memory (default 2).
    pub dense_layers: usize,
    pub speculation: Speculation,
    pub transfer: Transfer,
    /// Skewing matrices from calibration (required to build the policy).
    pub skewing: Option<Arc<Skewing>>,
}

impl InfinigenParams {
    /// The skewing matrices (checked against the model's shape), the number of dense
    /// layers and the partial-key width r = ⌊ρ·dh⌋, or what is wrong with them.
    pub fn checked(
        &self,
        cfg: &crate::config::ModelConfig,
    ) -> Result<(Arc<Skewing>, usize, usize)> {
        let skew = self.skewing.clone().ok_or_else(|| {
            Error::Config("infinigen needs skewing matrices from a calibration run".into())
        })?;
        if (skew.num_layers, skew.num_kv_heads, skew.head_dim)
            != (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        {
            return Err(Error::Config(format!(
                "skewing matrices are for {} layers × {} KV heads × dh {}, the model has {} × {} × {}",
                skew.num_layers, skew.num_kv_heads, skew.head_dim,
                cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
            )));
        }
        let dense = self.dense_layers.min(cfg.num_layers);
        if dense == 0 && self.speculation == Speculation::Previous {
            return Err(Error::Config(
                "infinigen: dense_layers must be ≥ 1 (layer ℓ is speculated in layer ℓ−1)".into(),
            ));
        }
        let r =
            ((self.partial_ratio * cfg.head_dim as f64).floor() as usize).clamp(1, cfg.head_dim);
        Ok((skew, dense, r))
    }
}

impl StrategyParams for InfinigenParams {
    const STRATEGY: &'static Strategy = &Strategy {
        name: "infinigen",
        about: "full KV in host memory, per-step speculative selection and prefetch (InfiniGen)",
        params: &[
            Param {
                key: "alpha",
                values: "a threshold ≥ 0 or `inf`; default 5",
                about: "speculation threshold in the scaled-logit domain",
            },
            Param {
                key: "partial_ratio",
                values: "a fraction in (0, 1]; default 0.2",
                about: "share ρ of head dimensions kept in the partial keys",
            },
            Param {
                key: "relative_to_current",
                values: "true or false (default)",
                about: "k_max = ⌈b·n⌉ of the current length instead of ⌈b·(L0 + T)⌉",
            },
            Param {
                key: "dense_layers",
                values: "an integer ≥ 1; default 2",
                about: "leading layers attended densely from device memory",
            },
            Param {
                key: "speculate",
                values: "`previous` (default) or `oracle`",
                about: "layer ℓ's selection from layer ℓ−1's input, or from its own query (tests)",
            },
            Param {
                key: "transfer",
                values: "`zero_copy` (default) or `memcpy`",
                about: "CUDA: gather from mapped host memory, or the original's copies",
            },
        ],
        budgeted: true,
        // One dense layer, so that a two-layer test model offloads one.
        verify: &[
            Variant::both(&[("dense_layers", "1")]),
            Variant::both(&[("dense_layers", "1"), ("alpha", "inf")]),
            Variant::cuda(&[("dense_layers", "1"), ("transfer", "memcpy")]),
        ],
        audit: &[Variant::both(&[("dense_layers", "1")])],
        // The cap relative to the current length (`⌈b·n⌉`), so the budget does not
        // depend on how many tokens the bench happens to decode.
        bench: &[("relative_to_current", "true")],
        cuda: true,
        kv_codec: false,
    };

    fn at_budget(budget: f64) -> Result<Self> {
        Ok(Self {
            budget,
            ..Default::default()
        })
    }

    fn budget(&self) -> f64 {
        self.budget
    }

    fn set(&mut self, k: &str, v: &str) -> Result<()> {
        let s = Self::STRATEGY.name;
        match k {
            "alpha" => {
                self.alpha = parse_f64(s, k, v)?;
                if self.alpha < 0.0 {
                    return Err(bad(s, k, v, "a threshold ≥ 0 (inf: no threshold)"));
                }
            }
            "partial_ratio" => {
                self.partial_ratio = parse_f64(s, k, v)?;
                if !(self.partial_ratio > 0.0 && self.partial_ratio <= 1.0) {
                    return Err(bad(s, k, v, "a fraction in (0, 1]"));
                }
            }
            "relative_to_current" => self.relative_to_current = parse_bool(s, k, v)?,
            "dense_layers" => {
                self.dense_layers = parse_usize(s, k, v)?;
                if self.dense_layers == 0 && self.speculation == Speculation::Previous {
                    return Err(bad(
                        s,
                        k,
                        v,
                        "at least 1: layer ℓ's selection is speculated in layer ℓ−1",
                    ));
                }
            }
            "speculate" => {
                self.speculation = match v {
                    "previous" => Speculation::Previous,
                    "oracle" => Speculation::Oracle,
                    _ => return Err(bad(s, k, v, "`previous` or `oracle`")),
                }
            }
            "transfer" => {
                self.transfer = match v {
                    "zero_copy" => Transfer::ZeroCopy,
                    "memcpy" => Transfer::Memcpy,
                    _ => return Err(bad(s, k, v, "`zero_copy` or `memcpy`")),
                }
            }
            _ => return Err(unknown(Self::STRATEGY, k)),
        }
        Ok(())
    }

    fn params_json(&self) -> serde_json::Value {
        json!({
            "alpha": if self.alpha.is_finite() { json!(self.alpha) } else { json!("inf") },
            "partial_ratio": self.partial_ratio,
            "relative_to_current": self.relative_to_current,
            "dense_layers": self.dense_layers,
            "speculate": match self.speculation { Speculation::Previous => "previous", Speculation::Oracle => "oracle" },
            "transfer": self.transfer.name(),
        })
    }

    fn build(&self, model: &Llama, env: PolicyEnv) -> Result<Box<dyn KvPolicy>> {
        env.refuse_codec(
            Self::STRATEGY.name,
            "its host tier and partial keys are f32 and its transfers move them as they are",
        )?;
        // The CPU policy copies the selected rows in process either way: a cell that
        // says `memcpy` would record the zero-copy path's numbers under its name.
        if self.transfer != Transfer::ZeroCopy {
            return Err(Error::Config(format!(
                "infinigen parameter `transfer={}`: the transfer mode is the CUDA build's (the CPU policy copies rows in process); run it with --device cuda or leave `transfer` at zero_copy",
                self.transfer.name()
            )));
        }
        Ok(Box::new(InfinigenPolicy::new(self.clone(), model, env)?))
    }

    #[cfg(feature = "cuda")]
    fn build_cuda(&self, model: &Llama, env: PolicyEnv) -> Result<Box<dyn KvPolicy>> {
        Ok(Box::new(
            crate::policy::infinigen::cuda::CudaInfinigenPolicy::new(self.clone(), model, env)?,
        ))
    }

    fn nominal_attended(&self, layer: usize, info: &SeqInfo, n: usize) -> usize {
        if layer < self.dense_layers {
            n
        } else {
            let k = infinigen_k_max(
                self.budget,
                info.prompt_len,
                info.max_new_tokens,
                n,
                self.relative_to_current,
            );
            (k + 1).min(n)
        }
    }

    fn device_kv_bytes(
        &self,
        cfg: &ModelConfig,
        info: &SeqInfo,
        n: usize,
        kv: KvCodec,
        statistic: usize,
    ) -> u64 {
        let d = cfg.num_layers;
        let token =
            |layers: usize| (2 * layers * cfg.num_kv_heads * kv.row_bytes(cfg.head_dim)) as u64;
        let dense = self.dense_layers.min(d);
        let off = (d - dense) as u64;
        let (hkv, dh) = (cfg.num_kv_heads as u64, cfg.head_dim as u64);
        let r = ((self.partial_ratio * cfg.head_dim as f64).floor() as u64).clamp(1, dh);
        let n_max = (info.prefill_len + info.max_new_tokens) as u64;
        let cap = infinigen_selection_cap(
            self.budget,
            info.prompt_len,
            info.max_new_tokens,
            info.prefill_len,
            self.relative_to_current,
        ) as u64;
        let staging = if off == 0 {
            0
        } else {
            2 * 2 * hkv * cap * kv.row_bytes(cfg.head_dim) as u64
        };
        n as u64 * token(dense) + off * hkv * (n_max * r + dh * r) * statistic as u64 + staging
    }

    fn needs_skewing(&self) -> bool {
        true
    }

    fn set_skewing(&mut self, skewing: Arc<Skewing>) {
        self.skewing = Some(skewing);
    }
}

impl Default for InfinigenParams {
    fn default() -> Self {
        Self {
            budget: 1.0,
            alpha: 5.0,
            partial_ratio: 0.2,
            relative_to_current: false,
            dense_layers: 2,
            speculation: Speculation::Previous,
            transfer: Transfer::ZeroCopy,
            skewing: None,
        }
    }
}

/// A selection of one layer's tokens gathered into device memory.
#[derive(Debug, Default)]
struct Staging {
    layer: Option<usize>,
    /// `[Hkv, cap, dh]`.
    k: Vec<f32>,
    v: Vec<f32>,
    /// Tokens per KV head (the same k for every head).
    count: usize,
    /// The selected positions per KV head.
    sel: Vec<Vec<u32>>,
    /// Layer of `sel` (kept after the selection is consumed).
    last_layer: Option<usize>,
}

#[derive(Debug)]
struct IgSeq {
    info: SeqInfo,
    computed: usize,
    /// Rows of a staging buffer per KV head.
    cap: usize,
    /// Partial-key columns per (offloaded layer, KV head): `P = A[:, S]`, `[dh, r]`.
    p: Vec<Vec<f32>>,
    /// Σ_t |Q̃[t, c]| over the prefill's rows, per (offloaded layer, KV head), `[dh]`.
    uq: Vec<Vec<f32>>,
    /// Partial keys K̂ per (offloaded layer, KV head): `[n_max, r]`, appended in place.
    khat: Vec<Vec<f32>>,
    staging: [Staging; 2],
    /// Device bytes of K̂, P and the staging buffers.
    fixed_device_bytes: u64,
}

impl IgSeq {
    fn prefilled(&self) -> bool {
        self.computed >= self.info.prefill_len
    }
}

pub struct InfinigenPolicy {
    params: InfinigenParams,
    env: PolicyEnv,
    shape: PrefillShape,
    num_layers: usize,
    dense: usize,
    r: usize,
    skew: Arc<Skewing>,
    /// Every layer's query projection (speculation runs layer ℓ's on ℓ−1's input).
    wq: Vec<Linear>,
    /// Dense layers' K/V on the device.
    dense_kv: PagedKv,
    /// Block tables of the dense layers' pool (the bookkeeping `full` uses too).
    dense_tables: SeqTables,
    host: Box<dyn HostTier>,
    seqs: HashMap<SeqId, IgSeq>,
    stats: PolicyStats,
    attended: Vec<AttendRecord>,
    scratch_limit: Option<u64>,
}

/// Indices of the `k` largest `score`s, ties to the smaller index (algorithms.md §1
/// rule 2; positions are indices here).
pub(crate) fn top_k(score: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..score.len() as u32).collect();
    let cmp = |a: &u32, b: &u32| {
        score[*b as usize]
            .partial_cmp(&score[*a as usize])
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.cmp(b))
    };
    if k < idx.len() {
        idx.select_nth_unstable_by(k, cmp);
        idx.truncate(k);
    }
    idx.sort_unstable();
    idx
}

/// The speculative selection of one decode row (algorithms.md §4 steps 1–4):
/// `q` `[H, dh]` the (speculative) rotated query, per KV head `p[g]` = `P` (`[dh, r]`)
/// and `khat[g]` the partial keys (`[n, r]`). Per query head the estimated scaled
/// logits ŝ; `k = min(⌊mean_h |{j : ŝ_h(j) > max ŝ_h − α}|⌋, k_max)`, at least 1; per
/// KV head the estimate is the max over its query heads and the top-k positions are
/// selected (ties: older first), ascending.
pub fn select_tokens(
    q: &[f32],
    p: &[&[f32]],
    khat: &[&[f32]],
    shape: PrefillShape,
    r: usize,
    alpha: f32,
    k_max: usize,
) -> Vec<Vec<u32>> {
    let (h, hkv, dh) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
    let g_size = h / hkv;
    let n = khat.first().map_or(0, |k| k.len() / r.max(1));
    let scale = 1.0 / (dh as f32).sqrt();
    let mut counts = 0usize;
    let mut est = vec![vec![f32::NEG_INFINITY; n]; hkv];
    let mut s = vec![0f32; n];
    let mut qhat = vec![0f32; r];
    for hq in 0..h {
        let g = hq / g_size;
        let qh = &q[hq * dh..(hq + 1) * dh];
        qhat.fill(0.0);
        for (d, &x) in qh.iter().enumerate() {
            for (c, y) in qhat.iter_mut().enumerate() {
                *y += x * p[g][d * r + c];
            }
        }
        for (j, sj) in s.iter_mut().enumerate() {
            let kr = &khat[g][j * r..(j + 1) * r];
            *sj = scale * qhat.iter().zip(kr).map(|(a, b)| a * b).sum::<f32>();
        }
        let m = s.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        counts += s.iter().filter(|&&x| x > m - alpha).count();
        for (e, &x) in est[g].iter_mut().zip(&s) {
            *e = e.max(x);
        }
    }
    let k = (counts / h).clamp(1, k_max.max(1));
    est.iter().map(|e| top_k(e, k)).collect()
}

impl InfinigenPolicy {
    /// Positions selected for `layer` of `seq` in the step that just ran (tests,
    /// traces); `None` if that layer attended densely.
    pub fn selection(&self, seq: SeqId, layer: usize) -> Option<&[Vec<u32>]> {
        let b = &self.seqs.get(&seq)?.staging[layer % 2];
        (b.last_layer == Some(layer)).then_some(b.sel.as_slice())
    }

    pub fn new(params: InfinigenParams, model: &Llama, env: PolicyEnv) -> Result<Self> {
        let cfg = &model.cfg;
        let (skew, dense, r) = params.checked(cfg)?;
        let bs = env.block_size;
        let dense_block =
            PagedKv::block_bytes(dense, bs, cfg.num_kv_heads, cfg.head_dim, KvCodec::F32).max(1);
        let dense_blocks = if dense == 0 {
            0
        } else {
            (env.kv_device_bytes / dense_block) as usize
        };
        let offloaded = cfg.num_layers - dense;
        let host_block =
            CpuHostTier::block_bytes(offloaded, bs, cfg.num_kv_heads, cfg.head_dim).max(1);
        let host_blocks = if offloaded == 0 {
            0
        } else {
            (env.kv_host_bytes / host_block) as usize
        };
        Ok(Self {
            shape: PrefillShape {
                num_heads: cfg.num_heads,
                num_kv_heads: cfg.num_kv_heads,
                head_dim: cfg.head_dim,
            },
            num_layers: cfg.num_layers,
            dense,
            r,
            skew,
            wq: model.layers().iter().map(|l| l.wq.clone()).collect(),
            dense_kv: PagedKv::new(
                dense,
                match env.reservation {
                    Reservation::Fraction => dense_blocks,
                    Reservation::Budget => 0,
                },
                bs,
                cfg.num_kv_heads,
                cfg.head_dim,
                KvCodec::F32,
            ),
            dense_tables: SeqTables::with_reservation(env.reservation, dense_blocks, bs, None),
            host: Box::new(CpuHostTier::new(
                dense,
                offloaded,
                host_blocks,
                bs,
                cfg.num_kv_heads,
                cfg.head_dim,
            )),
            seqs: HashMap::new(),
            stats: PolicyStats::default(),
            attended: Vec::new(),
            scratch_limit: None,
            params,
            env,
        })
    }

    fn oom(&self, component: Component, requested: u64, available: u64) -> Error {
        Error::OutOfMemory {
            device: self.env.device_name.clone(),
            component,
            requested,
            available,
            capacity: self.env.device_capacity.unwrap_or(0),
        }
    }

    fn dense_block_bytes(&self) -> u64 {
        self.dense_kv.bytes_per_block()
    }

    fn fixed_device_bytes(&self) -> u64 {
        self.seqs.values().map(|s| s.fixed_device_bytes).sum()
    }

    fn device_used(&self) -> u64 {
        self.dense_tables.num_used() as u64 * self.dense_block_bytes() + self.fixed_device_bytes()
    }

    /// Device bytes held: the dense pool as allocated (all of it under `fraction`, what
    /// it grew to under `budget`) and the sequences' buffers.
    fn device_reserved(&self) -> u64 {
        self.dense_tables.num_blocks() as u64 * self.dense_block_bytes() + self.fixed_device_bytes()
    }

    /// What counts against the KV bytes: the live tokens within a pool allocated up
    /// front, everything held when the pool grows on demand.
    fn device_charged(&self) -> u64 {
        match self.env.reservation {
            Reservation::Fraction => self.device_used(),
            Reservation::Budget => self.device_reserved(),
        }
    }

    fn k_max(&self, s: &IgSeq, n: usize) -> usize {
        infinigen_k_max(
            self.params.budget,
            s.info.prompt_len,
            s.info.max_new_tokens,
            n,
            self.params.relative_to_current,
        )
    }

    /// Fixed per-sequence device buffers for a sequence of up to `n_max` tokens whose
    /// staging buffers hold `cap` rows.
    fn fixed_bytes(&self, n_max: usize, cap: usize) -> u64 {
        let (hkv, dh, r) = (self.shape.num_kv_heads, self.shape.head_dim, self.r);
        let off = (self.num_layers - self.dense) as u64;
        let khat = off * (hkv * n_max * r) as u64 * 4;
        let p = off * (hkv * dh * r) as u64 * 4;
        let staging = if off == 0 {
            0
        } else {
            2 * 2 * (hkv * cap * dh) as u64 * 4
        };
        khat + p + staging
    }

    /// Select layer `layer`'s tokens for one decode row from the speculative query
    /// `q` (`[H, dh]`, rotated) and gather them into the staging buffer of that layer.
    fn select_and_fetch(&mut self, seq: SeqId, layer: usize, q: &[f32], n: usize) {
        let (hkv, r) = (self.shape.num_kv_heads, self.r);
        let t0 = Instant::now();
        let st = &self.seqs[&seq];
        let k_max = self.k_max(st, n + 1).min(st.cap);
        let li = layer - self.dense;
        let sel = if n <= k_max {
            vec![(0..n as u32).collect(); hkv]
        } else {
            let p: Vec<&[f32]> = (0..hkv).map(|g| st.p[li * hkv + g].as_slice()).collect();
            let khat: Vec<&[f32]> = (0..hkv).map(|g| &st.khat[li * hkv + g][..n * r]).collect();
            select_tokens(q, &p, &khat, self.shape, r, self.params.alpha as f32, k_max)
        };
        let spec_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let st = self.seqs.get_mut(&seq).expect("admitted");
        let cap = st.cap;
        let buf = &mut st.staging[layer % 2];
        let bytes = self
            .host
            .gather(seq, layer, &sel, cap, &mut buf.k, &mut buf.v);
        buf.layer = Some(layer);
        buf.count = sel[0].len();
        buf.sel = sel;
        buf.last_layer = Some(layer);
        let transfer = t1.elapsed().as_secs_f64();
        self.stats.h2d_bytes += bytes;
        self.stats.transfer_s += transfer;
        self.stats.cache_ops_s += spec_s + transfer;
    }

    /// Speculative queries `[rows, H, dh]` of layer `target` from this layer's input.
    fn speculative_q(
        &self,
        input: &LayerInput<'_>,
        rows: &[usize],
        target: usize,
    ) -> Result<Vec<f32>> {
        let (h, dh) = (self.shape.num_heads, self.shape.head_dim);
        let idx = Tensor::new(
            rows.iter().map(|&r| r as u32).collect::<Vec<_>>(),
            input.x.device(),
        )?;
        let x = input.x.index_select(&idx, 0)?;
        let q = self.wq[target].forward(&x)?.reshape((rows.len(), h, dh))?;
        let pos: Vec<u32> = rows.iter().map(|&r| input.positions[r]).collect();
        to_f32(&input.rope.rotate(&q, &pos)?)
    }

    /// At the end of a sequence's prefill in offloaded layer `layer`: choose the
    /// partial columns and build K̂ for every prefilled token.
    fn finish_prefill(&mut self, seq: SeqId, layer: usize, k: &[f32], n: usize) {
        let (hkv, dh, r) = (self.shape.num_kv_heads, self.shape.head_dim, self.r);
        let li = layer - self.dense;
        for g in 0..hkv {
            let a = self.skew.matrix(layer, g);
            let st = self.seqs.get_mut(&seq).expect("admitted");
            let mut u = st.uq[li * hkv + g].clone();
            for j in 0..n {
                let kr = &k[(j * hkv + g) * dh..][..dh];
                for (c, uc) in u.iter_mut().enumerate() {
                    let mut x = 0f32;
                    for d in 0..dh {
                        x += kr[d] * a[d * dh + c];
                    }
                    *uc += x.abs();
                }
            }
            let cols = top_k(&u, r);
            let mut p = vec![0f32; dh * r];
            for d in 0..dh {
                for (ci, &c) in cols.iter().enumerate() {
                    p[d * r + ci] = a[d * dh + c as usize];
                }
            }
            let khat = &mut st.khat[li * hkv + g];
            for j in 0..n {
                let kr = &k[(j * hkv + g) * dh..][..dh];
                for c in 0..r {
                    khat[j * r + c] = (0..dh).map(|d| kr[d] * p[d * r + c]).sum();
                }
            }
            st.p[li * hkv + g] = p;
        }
    }
}

impl KvPolicy for InfinigenPolicy {
    fn name(&self) -> &'static str {
        "infinigen"
    }

    fn admit(&mut self, seq: SeqId, info: SeqInfo) -> Result<()> {
        let (hkv, dh) = (self.shape.num_kv_heads, self.shape.head_dim);
        let off = self.num_layers - self.dense;
        let n_max = info.prefill_len + info.max_new_tokens;
        let cap = infinigen_selection_cap(
            self.params.budget,
            info.prompt_len,
            info.max_new_tokens,
            info.prefill_len,
            self.params.relative_to_current,
        );
        let fixed_device_bytes = self.fixed_bytes(n_max, cap);
        let staging = || Staging {
            layer: None,
            k: vec![0f32; if off == 0 { 0 } else { hkv * cap * dh }],
            v: vec![0f32; if off == 0 { 0 } else { hkv * cap * dh }],
            count: 0,
            sel: Vec::new(),
            last_layer: None,
        };
        self.seqs.insert(
            seq,
            IgSeq {
                info,
                computed: 0,
                cap,
                p: vec![Vec::new(); off * hkv],
                uq: vec![vec![0f32; dh]; off * hkv],
                khat: vec![vec![0f32; n_max * self.r]; off * hkv],
                staging: [staging(), staging()],
                fixed_device_bytes,
            },
        );
        Ok(())
    }

    fn set_scratch_limit(&mut self, limit: Option<u64>) {
        self.scratch_limit = limit;
    }

    fn reserve(&mut self, seq: SeqId, total_tokens: usize) -> Result<bool> {
        if !self.seqs.contains_key(&seq) {
            self.admit(seq, SeqInfo::unannounced(total_tokens))?;
        }
        // The per-sequence buffers count against the device's KV bytes.
        if self.device_charged() > self.env.kv_device_bytes {
            return Ok(false);
        }
        if self.dense > 0 {
            let grown = self.dense_tables.reserve(seq, total_tokens);
            self.dense_kv.ensure_blocks(self.dense_tables.num_blocks());
            if !grown {
                return Ok(false);
            }
        }
        if self.device_charged() > self.env.kv_device_bytes {
            return Ok(false);
        }
        Ok(self.num_layers == self.dense || self.host.reserve(seq, total_tokens))
    }

    fn fits(&self, total_tokens: usize) -> bool {
        let dense_ok = self.dense == 0 || self.dense_tables.fits(total_tokens);
        let host_ok = self.num_layers == self.dense || self.host.fits(total_tokens);
        dense_ok
            && host_ok
            && self.fixed_bytes(total_tokens, total_tokens) <= self.env.kv_device_bytes
    }

    fn set_device_ceiling(&mut self, bytes: u64) -> bool {
        if self.env.reservation != Reservation::Budget {
            return false;
        }
        // The sequences' buffers are checked against the KV bytes in `reserve`; the
        // dense pool may grow into what they leave.
        self.env.kv_device_bytes = bytes;
        let block = self.dense_block_bytes().max(1);
        let room = bytes.saturating_sub(self.fixed_device_bytes()) / block;
        self.dense_tables.set_limit(room as usize)
    }

    fn release(&mut self, seq: SeqId) {
        self.dense_tables.release(seq);
        self.host.release(seq);
        self.seqs.remove(&seq);
    }

    fn attend(&mut self, batch: &StepBatch, input: &LayerInput<'_>) -> Result<Tensor> {
        let layer = input.layer;
        let (h, hkv, dh) = (
            self.shape.num_heads,
            self.shape.num_kv_heads,
            self.shape.head_dim,
        );
        let stride = hkv * dh;
        let offloaded = layer >= self.dense;
        let t0 = Instant::now();
        let kf = to_f32(input.k)?;
        let vf = to_f32(input.v)?;
        // Store the step's K/V: device pool for dense layers, host tier otherwise.
        for s in &batch.seqs {
            for i in 0..s.q_len {
                let row = s.q_start + i;
                let (k, v) = (
                    &kf[row * stride..(row + 1) * stride],
                    &vf[row * stride..(row + 1) * stride],
                );
                if offloaded {
                    self.host.write(s.id, layer, s.ctx_before + i, k, v);
                } else {
                    let slot = self
                        .dense_kv
                        .slot(self.dense_tables.table(s.id), s.ctx_before + i);
                    self.dense_kv.write(layer, slot, k, v);
                }
            }
            if offloaded {
                self.stats.d2h_bytes += (2 * s.q_len * stride * 4) as u64;
            }
        }
        self.stats.cache_ops_s += t0.elapsed().as_secs_f64();

        let qf = to_f32(input.q)?;
        let mut out = vec![0f32; batch.num_tokens * h * dh];
        let (decode, prefill) = batch.split(|id| self.seqs[&id].prefilled());

        // Prefill rows: full attention over the sequence's context.
        for s in &prefill {
            let n = s.ctx_before + s.q_len;
            let (k, v) = if offloaded {
                self.host.read_prefix(s.id, layer, n)
            } else {
                self.dense_kv
                    .gather(layer, self.dense_tables.table(s.id), n)
            };
            let q = &qf[s.q_start * h * dh..(s.q_start + s.q_len) * h * dh];
            let r = prefill_attention(
                q,
                &k,
                &v,
                s.q_len,
                n,
                self.shape,
                self.env.attention,
                self.env.chunk_size,
                None,
                self.scratch_limit,
            )
            .map_err(|e| self.oom(Component::Activations, e.requested, e.limit))?;
            self.stats.add_scratch(r.scratch_bytes);
            out[s.q_start * h * dh..(s.q_start + s.q_len) * h * dh].copy_from_slice(&r.out);
            if offloaded {
                // Column importance of the skewed queries (summed over the group).
                let t = Instant::now();
                let g_size = h / hkv;
                let li = layer - self.dense;
                for g in 0..hkv {
                    let a = self.skew.matrix(layer, g);
                    let st = self.seqs.get_mut(&s.id).expect("admitted");
                    let uq = &mut st.uq[li * hkv + g];
                    for row in 0..s.q_len {
                        for hq in g * g_size..(g + 1) * g_size {
                            let qr = &q[(row * h + hq) * dh..][..dh];
                            for (c, u) in uq.iter_mut().enumerate() {
                                let mut x = 0f32;
                                for d in 0..dh {
                                    x += qr[d] * a[d * dh + c];
                                }
                                *u += x.abs();
                            }
                        }
                    }
                }
                if n >= self.seqs[&s.id].info.prefill_len {
                    self.finish_prefill(s.id, layer, &k, n);
                }
                self.stats.cache_ops_s += t.elapsed().as_secs_f64();
            }
        }

        // Decode rows.
        if !decode.is_empty() {
            if offloaded {
                let t = Instant::now();
                let r = self.r;
                let li = layer - self.dense;
                // Append the new token's partial key; make sure a selection is ready.
                let mut oracle_rows = Vec::new();
                for s in &decode {
                    let st = self.seqs.get_mut(&s.id).expect("admitted");
                    let pos = s.ctx_before;
                    for g in 0..hkv {
                        let kr = &kf[(s.q_start * hkv + g) * dh..][..dh];
                        let p = &st.p[li * hkv + g];
                        let khat = &mut st.khat[li * hkv + g];
                        for c in 0..r {
                            khat[pos * r + c] = (0..dh).map(|d| kr[d] * p[d * r + c]).sum();
                        }
                    }
                    if st.staging[layer % 2].layer != Some(layer)
                        || self.params.speculation == Speculation::Oracle
                    {
                        oracle_rows.push(*s);
                    }
                }
                self.stats.cache_ops_s += t.elapsed().as_secs_f64();
                for s in oracle_rows {
                    let q = qf[s.q_start * h * dh..(s.q_start + 1) * h * dh].to_vec();
                    self.select_and_fetch(s.id, layer, &q, s.ctx_before);
                }
                let rows: Vec<DecodeRow<'_>> = decode
                    .iter()
                    .map(|s| {
                        let st = &self.seqs[&s.id];
                        let b = &st.staging[layer % 2];
                        DecodeRow {
                            row: s.q_start,
                            keys: KeySet::Tile {
                                k: &b.k,
                                v: &b.v,
                                cap: st.cap,
                                len: b.count,
                                own_k: &kf[s.q_start * stride..(s.q_start + 1) * stride],
                                own_v: &vf[s.q_start * stride..(s.q_start + 1) * stride],
                            },
                        }
                    })
                    .collect();
                let shape = DecodeShape {
                    num_heads: h,
                    num_kv_heads: hkv,
                    head_dim: dh,
                };
                decode_attention(&qf, &rows, &mut out, shape, false);
                for (s, row) in decode.iter().zip(&rows) {
                    self.attended.push(AttendRecord {
                        seq: s.id,
                        layer,
                        attended: row.keys.count(),
                        context: s.ctx_before + 1,
                    });
                }
                for s in &decode {
                    let st = self.seqs.get_mut(&s.id).expect("admitted");
                    st.staging[layer % 2].layer = None;
                }
            } else {
                let (k, v) = self.dense_kv.views(layer);
                let rows: Vec<DecodeRow<'_>> = decode
                    .iter()
                    .map(|s| DecodeRow {
                        row: s.q_start,
                        keys: KeySet::Paged {
                            k,
                            v,
                            table: self.dense_tables.table(s.id),
                            len: s.ctx_before + 1,
                            block_size: self.env.block_size,
                        },
                    })
                    .collect();
                let shape = DecodeShape {
                    num_heads: h,
                    num_kv_heads: hkv,
                    head_dim: dh,
                };
                decode_attention(&qf, &rows, &mut out, shape, false);
                for s in &decode {
                    self.attended
                        .push(AttendRecord::whole(s.id, layer, s.ctx_before + 1));
                }
            }
            // Speculate the next layer's selection from this layer's input.
            let next = layer + 1;
            if self.params.speculation == Speculation::Previous
                && next >= self.dense
                && next < self.num_layers
            {
                let t = Instant::now();
                let rows: Vec<usize> = decode.iter().map(|s| s.q_start).collect();
                let q = self.speculative_q(input, &rows, next)?;
                self.stats.cache_ops_s += t.elapsed().as_secs_f64();
                for (i, s) in decode.iter().enumerate() {
                    self.select_and_fetch(
                        s.id,
                        next,
                        &q[i * h * dh..(i + 1) * h * dh],
                        s.ctx_before,
                    );
                }
            }
        }

        if layer + 1 == self.num_layers {
            for s in &batch.seqs {
                if let Some(st) = self.seqs.get_mut(&s.id) {
                    st.computed = s.ctx_before + s.q_len;
                }
            }
        }
        Ok(
            Tensor::from_vec(out, (batch.num_tokens, h, dh), input.q.device())?
                .to_dtype(input.q.dtype())?,
        )
    }

    fn memory(&self) -> PolicyMemory {
        let host = self.host.used_bytes();
        PolicyMemory {
            device_reserved: self.device_reserved(),
            device_used: self.device_used(),
            host_reserved: host,
            host_used: host,
        }
    }

    fn seq_device_bytes(&self, seq: SeqId) -> u64 {
        let dense = self.dense_tables.table(seq).len() as u64 * self.dense_block_bytes();
        dense + self.seqs.get(&seq).map_or(0, |s| s.fixed_device_bytes)
    }

    fn seq_host_bytes(&self, seq: SeqId) -> u64 {
        self.host.seq_bytes(seq)
    }

    fn take_stats(&mut self) -> PolicyStats {
        std::mem::take(&mut self.stats)
    }

    fn take_attended(&mut self) -> Vec<AttendRecord> {
        std::mem::take(&mut self.attended)
    }

    fn kept_positions(&self, seq: SeqId, layer: usize, g: usize) -> Option<Vec<u32>> {
        self.selection(seq, layer).and_then(|s| s.get(g).cloned())
    }

    fn check_invariants(&self) -> std::result::Result<(), String> {
        self.dense_tables.check_invariants()?;
        self.host.check_invariants()
    }
}
