//! `kivi`: asymmetric low-bit KV storage (algorithms.md §8, KIVI). Every token is kept;
//! what shrinks is the bytes. Keys are quantized per channel over groups of `Gq`
//! tokens, values per token over groups of `Gq` channels (within each head), with
//! `scale = (max − min) / (2^bits − 1)` and codes `round((x − min) / scale)`; the
//! newest tokens stay in full precision: keys are quantized `R` at a time when their
//! residual fills, values leave theirs one token at a time (the `R` newest stay).
//! Attention reads the codes directly: `q·k̂ = Σ_c (q_c·s_c)·code_c + Σ_c q_c·m_c` per
//! key group, `Σ_t p_t·v̂_t` per value group, so no full-precision copy of the cache
//! is made. A prompt is held in full precision until its prefill ends (prefill
//! attention is exact, as the original's), then quantized by the same rules.
//!
//! [adapt] Scales and minimums are f32 (the original keeps them in fp16); the budget
//! `b` does not apply (the bits set the size): `kivi` runs at budget 1, as `full`.

use super::registry::{bad, parse_usize, unknown, Param, Strategy, StrategyParams, Variant};
use super::spec::{PolicyEnv, Reservation, RESERVATION_KEY};
use super::to_f32;
use super::{
    AttendRecord, KvPolicy, LayerInput, PolicyMemory, PolicyStats, SeqId, SeqInfo, StepBatch,
};
use crate::attention::prefill::{prefill_attention, PrefillShape};
use crate::config::ModelConfig;
use crate::error::{Component, Error, Result};
use crate::kv::codec::{code, quantize_into, unpack};
use crate::kv::KvCodec;
use crate::model::Llama;
use candle_core::Tensor;
use rayon::prelude::*;
use serde_json::json;
use std::collections::HashMap;
use std::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KiviParams {
    /// Bits per code: 2 or 4 (default 2).
    pub bits: usize,
    /// Group size Gq: tokens per key group, channels per value group (default 32).
    pub group: usize,
    /// Full-precision residual R, a multiple of Gq (default 32).
    pub residual: usize,
}

impl Default for KiviParams {
    fn default() -> Self {
        Self {
            bits: 2,
            group: 32,
            residual: 32,
        }
    }
}

/// Tokens of a sequence of `n` whose keys and values are quantized: keys in whole
/// residuals of R (`n − n mod R`), values all but the R newest.
pub fn kivi_quantized(p: &KiviParams, n: usize) -> (usize, usize) {
    (n - n % p.residual, n.saturating_sub(p.residual))
}

/// Bytes of one sequence of `n` tokens in one layer with `hkv × dh` channels: packed
/// codes, an f32 scale and minimum per key channel and group of tokens and per value
/// group of channels, and the full-precision residuals.
pub fn kivi_layer_bytes(p: &KiviParams, n: usize, hkv: usize, dh: usize) -> u64 {
    let (kq, vq) = kivi_quantized(p, n);
    let ch = hkv * dh;
    let codes = |elems: usize| (elems * p.bits).div_ceil(8) as u64;
    let key_groups = (kq / p.group) as u64;
    let value_groups = (hkv * dh.div_ceil(p.group)) as u64;
    let keys = key_groups * (codes(p.group * ch) + 2 * 4 * ch as u64);
    let values = vq as u64 * (codes(ch) + 2 * 4 * value_groups);
    let residual = ((n - kq) + (n - vq)) as u64 * ch as u64 * 4;
    keys + values + residual
}

impl StrategyParams for KiviParams {
    const STRATEGY: &'static Strategy = &Strategy {
        name: "kivi",
        about: "every token kept, keys and values in 2- or 4-bit codes with a full-precision residual (KIVI)",
        params: &[
            Param {
                key: "bits",
                values: "2 (default) or 4",
                about: "bits per code",
            },
            Param {
                key: "group",
                values: "an integer ≥ 1; default 32",
                about: "Gq: tokens per key group, channels per value group",
            },
            Param {
                key: "residual",
                values: "a multiple of group; default 32",
                about: "R: the newest tokens kept in full precision",
            },
        ],
        budgeted: false,
        // A residual above every verify prompt keeps everything exact.
        verify: &[Variant::both(&[("residual", "256"), ("group", "32")])],
        // Quantizing: the bytes held against the formula.
        audit: &[Variant::both(&[("residual", "8"), ("group", "4")])],
        bench: &[],
        cuda: false,
        kv_codec: false,
    };

    fn at_budget(budget: f64) -> Result<Self> {
        if budget < 1.0 {
            return Err(Error::Config(format!(
                "budget {budget}: `kivi` keeps every token (its size is set by `bits`): run it at budget 1"
            )));
        }
        Ok(Self::default())
    }

    fn budget(&self) -> f64 {
        1.0
    }

    fn set(&mut self, k: &str, v: &str) -> Result<()> {
        let s = Self::STRATEGY.name;
        match k {
            "bits" => {
                self.bits = parse_usize(s, k, v)?;
                if self.bits != 2 && self.bits != 4 {
                    return Err(bad(s, k, v, "2 or 4"));
                }
            }
            "group" => {
                self.group = parse_usize(s, k, v)?;
                if self.group == 0 {
                    return Err(bad(s, k, v, "at least 1"));
                }
            }
            "residual" => self.residual = parse_usize(s, k, v)?,
            _ => return Err(unknown(Self::STRATEGY, k)),
        }
        Ok(())
    }

    fn validate(&self) -> Result<()> {
        if self.residual == 0 || !self.residual.is_multiple_of(self.group) {
            return Err(Error::Config(format!(
                "kivi: residual {} must be a positive multiple of group {} (keys are quantized a residual at a time)",
                self.residual, self.group
            )));
        }
        Ok(())
    }

    fn params_json(&self) -> serde_json::Value {
        json!({ "bits": self.bits, "group": self.group, "residual": self.residual })
    }

    fn build(&self, model: &Llama, env: PolicyEnv) -> Result<Box<dyn KvPolicy>> {
        env.refuse_codec(
            Self::STRATEGY.name,
            "it stores its own codes (set `bits`, `group` and `residual`)",
        )?;
        // Its codes grow with each sequence; no pool is reserved up front, so a cell
        // that says `fraction` would record the on-demand numbers under its name.
        if env.reservation != Reservation::Budget {
            return Err(Error::Config(format!(
                "kivi: its codes grow with each sequence: `{RESERVATION_KEY}=budget` only (got `{}`)",
                env.reservation
            )));
        }
        Ok(Box::new(KiviPolicy::new(*self, &model.cfg, env)))
    }

    fn nominal_attended(&self, _layer: usize, _info: &SeqInfo, n: usize) -> usize {
        n
    }

    fn device_kv_bytes(
        &self,
        cfg: &ModelConfig,
        _info: &SeqInfo,
        n: usize,
        _kv: KvCodec,
        _statistic: usize,
    ) -> u64 {
        cfg.num_layers as u64 * kivi_layer_bytes(self, n, cfg.num_kv_heads, cfg.head_dim)
    }
}

/// Codes of `x` (min/max asymmetric, `bits` wide) packed low bits first, with the
/// scale and minimum: `x̂ = code·scale + min` (the codec's quantizer, on its own
/// buffer).
fn quantize(x: &[f32], bits: usize) -> (f32, f32, Vec<u8>) {
    let mut codes = vec![0u8; (x.len() * bits).div_ceil(8)];
    let (scale, min) = quantize_into(x, bits, &mut codes, 0);
    (scale, min, codes)
}

/// Bytes a layer's codes, scales and residuals take.
fn layer_bytes(l: &Layer) -> u64 {
    let k: usize = l
        .keys
        .iter()
        .map(|g| g.codes.len() + 4 * (g.scale.len() + g.min.len()))
        .sum();
    let v: usize = l
        .values
        .iter()
        .map(|r| r.codes.len() + 4 * (r.scale.len() + r.min.len()))
        .sum();
    (k + v + 4 * (l.k_res.len() + l.v_res.len())) as u64
}

/// Keys of Gq tokens: per channel (`[Hkv·dh]`) a scale and a minimum over the group;
/// codes token-major.
struct KeyGroup {
    scale: Vec<f32>,
    min: Vec<f32>,
    codes: Vec<u8>,
}

/// One token's values: per group of channels (within each head) a scale and minimum.
struct ValueRow {
    scale: Vec<f32>,
    min: Vec<f32>,
    codes: Vec<u8>,
}

#[derive(Default)]
struct Layer {
    keys: Vec<KeyGroup>,
    values: Vec<ValueRow>,
    /// Full-precision rows `[t, Hkv·dh]` after the quantized ones.
    k_res: Vec<f32>,
    v_res: Vec<f32>,
}

struct KiviSeq {
    info: SeqInfo,
    layers: Vec<Layer>,
    /// Tokens held (all layers alike).
    len: usize,
}

pub struct KiviPolicy {
    params: KiviParams,
    shape: PrefillShape,
    num_layers: usize,
    env: PolicyEnv,
    seqs: HashMap<SeqId, KiviSeq>,
    /// Tokens each sequence may grow to (its reservation).
    reserved: HashMap<SeqId, usize>,
    stats: PolicyStats,
    attended: Vec<AttendRecord>,
    scratch_limit: Option<u64>,
}

impl KiviPolicy {
    pub fn new(params: KiviParams, cfg: &ModelConfig, env: PolicyEnv) -> Self {
        Self {
            params,
            shape: PrefillShape {
                num_heads: cfg.num_heads,
                num_kv_heads: cfg.num_kv_heads,
                head_dim: cfg.head_dim,
            },
            num_layers: cfg.num_layers,
            env,
            seqs: HashMap::new(),
            reserved: HashMap::new(),
            stats: PolicyStats::default(),
            attended: Vec::new(),
            scratch_limit: None,
        }
    }

    fn channels(&self) -> usize {
        self.shape.num_kv_heads * self.shape.head_dim
    }

    /// Bytes a sequence holds with `n` tokens: full precision until its prefill ends.
    fn bytes_at(&self, info: &SeqInfo, n: usize) -> u64 {
        let layers = self.num_layers as u64;
        if n <= info.prefill_len {
            layers * 2 * (n * self.channels() * 4) as u64
        } else {
            layers
                * kivi_layer_bytes(
                    &self.params,
                    n,
                    self.shape.num_kv_heads,
                    self.shape.head_dim,
                )
        }
    }

    /// Bytes the sequences hold now.
    fn held(&self) -> u64 {
        self.seqs
            .values()
            .map(|s| s.layers.iter().map(layer_bytes).sum::<u64>())
            .sum()
    }

    /// Quantize what the rules say of one layer of a sequence holding `n` tokens.
    fn settle(&self, l: &mut Layer, n: usize) {
        let (p, ch, dh) = (self.params, self.channels(), self.shape.head_dim);
        let (kq, vq) = kivi_quantized(&p, n);
        // Keys: whole groups of Gq tokens leave the residual, a residual at a time.
        while l.keys.len() * p.group < kq {
            let rows: Vec<f32> = l.k_res.drain(..p.group * ch).collect();
            let mut scale = vec![0f32; ch];
            let mut min = vec![0f32; ch];
            let mut codes = vec![0u8; (p.group * ch * p.bits).div_ceil(8)];
            for c in 0..ch {
                let col: Vec<f32> = (0..p.group).map(|t| rows[t * ch + c]).collect();
                let (s, m, cc) = quantize(&col, p.bits);
                scale[c] = s;
                min[c] = m;
                for t in 0..p.group {
                    let i = t * ch + c;
                    codes[i * p.bits / 8] |= (code(&cc, t, p.bits) as u8) << (i * p.bits % 8);
                }
            }
            l.keys.push(KeyGroup { scale, min, codes });
        }
        // Values: each token past the R newest, one at a time.
        while l.values.len() < vq {
            let row: Vec<f32> = l.v_res.drain(..ch).collect();
            let (mut scale, mut min) = (Vec::new(), Vec::new());
            let mut codes = vec![0u8; (ch * p.bits).div_ceil(8)];
            let mut at = 0;
            for head in row.chunks_exact(dh) {
                for g in head.chunks(p.group) {
                    let (s, m) = quantize_into(g, p.bits, &mut codes, at);
                    scale.push(s);
                    min.push(m);
                    at += g.len();
                }
            }
            l.values.push(ValueRow { scale, min, codes });
        }
    }

    /// One decode row's attention (`q`: `[H, dh]`) over a layer's codes and residuals.
    fn attend_row(&self, l: &Layer, q: &[f32], out: &mut [f32]) {
        let (p, h, hkv, dh) = (
            self.params,
            self.shape.num_heads,
            self.shape.num_kv_heads,
            self.shape.head_dim,
        );
        let ch = hkv * dh;
        let group = h / hkv;
        let (nk_q, nv_q) = (l.keys.len() * p.group, l.values.len());
        let n = nk_q + l.k_res.len() / ch;
        let scale = 1.0 / (dh as f32).sqrt();
        let groups_per_head = dh.div_ceil(p.group);
        // Codes are unpacked once per KV head into a small tile (one key group, or one
        // value row) and shared by the group's query heads.
        let mut tile = vec![0f32; p.group * dh];
        let mut logits = vec![0f32; group * n];
        let mut row = vec![0f32; dh];
        for g in 0..hkv {
            let heads = g * group..(g + 1) * group;
            for (gi, kg) in l.keys.iter().enumerate() {
                for t in 0..p.group {
                    unpack(
                        &kg.codes,
                        t * ch + g * dh,
                        p.bits,
                        &mut tile[t * dh..(t + 1) * dh],
                    );
                }
                let (s, m) = (
                    &kg.scale[g * dh..(g + 1) * dh],
                    &kg.min[g * dh..(g + 1) * dh],
                );
                for (j, head) in heads.clone().enumerate() {
                    // q·k̂ = Σ_c (q_c·s_c)·code + Σ_c q_c·m_c.
                    let qh = &q[head * dh..(head + 1) * dh];
                    let qs: Vec<f32> = qh.iter().zip(s).map(|(a, b)| a * b).collect();
                    let bias: f32 = qh.iter().zip(m).map(|(a, b)| a * b).sum();
                    for t in 0..p.group {
                        let d: f32 = qs
                            .iter()
                            .zip(&tile[t * dh..(t + 1) * dh])
                            .map(|(a, b)| a * b)
                            .sum();
                        logits[j * n + gi * p.group + t] = (d + bias) * scale;
                    }
                }
            }
            for (t, r) in l.k_res.chunks_exact(ch).enumerate() {
                let k = &r[g * dh..(g + 1) * dh];
                for (j, head) in heads.clone().enumerate() {
                    let qh = &q[head * dh..(head + 1) * dh];
                    logits[j * n + nk_q + t] =
                        qh.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale;
                }
            }
            for j in 0..group {
                let lg = &mut logits[j * n..(j + 1) * n];
                let max = lg.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0f32;
                for x in lg.iter_mut() {
                    *x = (*x - max).exp();
                    sum += *x;
                }
                for x in lg.iter_mut() {
                    *x /= sum;
                }
                out[(g * group + j) * dh..(g * group + j + 1) * dh].fill(0.0);
            }
            for (t, vr) in l.values.iter().enumerate() {
                unpack(&vr.codes, g * dh, p.bits, &mut row);
                for (c, x) in row.iter_mut().enumerate() {
                    let gi = g * groups_per_head + c / p.group;
                    *x = *x * vr.scale[gi] + vr.min[gi];
                }
                for j in 0..group {
                    let w = logits[j * n + t];
                    let o = &mut out[(g * group + j) * dh..(g * group + j + 1) * dh];
                    for (o, &v) in o.iter_mut().zip(&row) {
                        *o += w * v;
                    }
                }
            }
            for (t, r) in l.v_res.chunks_exact(ch).enumerate() {
                let v = &r[g * dh..(g + 1) * dh];
                for j in 0..group {
                    let w = logits[j * n + nv_q + t];
                    let o = &mut out[(g * group + j) * dh..(g * group + j + 1) * dh];
                    for (o, &x) in o.iter_mut().zip(v) {
                        *o += w * x;
                    }
                }
            }
        }
    }
}

impl KvPolicy for KiviPolicy {
    fn name(&self) -> &'static str {
        "kivi"
    }

    fn admit(&mut self, seq: SeqId, info: SeqInfo) -> Result<()> {
        self.seqs.insert(
            seq,
            KiviSeq {
                info,
                layers: (0..self.num_layers).map(|_| Layer::default()).collect(),
                len: 0,
            },
        );
        Ok(())
    }

    fn set_scratch_limit(&mut self, limit: Option<u64>) {
        self.scratch_limit = limit;
    }

    /// Room for every sequence at what it holds after this step, at its reservation.
    fn reserve(&mut self, seq: SeqId, total_tokens: usize) -> Result<bool> {
        if !self.seqs.contains_key(&seq) {
            self.admit(seq, SeqInfo::unannounced(total_tokens))?;
        }
        let before = self.reserved.insert(seq, total_tokens);
        let need: u64 = self
            .reserved
            .iter()
            .map(|(id, &n)| self.bytes_at(&self.seqs[id].info, n))
            .sum();
        if need > self.env.kv_device_bytes {
            match before {
                Some(b) => self.reserved.insert(seq, b),
                None => self.reserved.remove(&seq),
            };
            return Ok(false);
        }
        Ok(true)
    }

    fn fits(&self, total_tokens: usize) -> bool {
        let info = SeqInfo::unannounced(total_tokens);
        self.bytes_at(&info, total_tokens) <= self.env.kv_device_bytes
    }

    fn release(&mut self, seq: SeqId) {
        self.seqs.remove(&seq);
        self.reserved.remove(&seq);
    }

    fn attend(&mut self, batch: &StepBatch, input: &LayerInput<'_>) -> Result<Tensor> {
        let layer = input.layer;
        let (h, dh) = (self.shape.num_heads, self.shape.head_dim);
        let ch = self.channels();
        let t0 = Instant::now();
        let (kf, vf) = (to_f32(input.k)?, to_f32(input.v)?);
        for s in &batch.seqs {
            let e = self.seqs.get_mut(&s.id).expect("reserved before attending");
            let l = &mut e.layers[layer];
            l.k_res
                .extend_from_slice(&kf[s.q_start * ch..(s.q_start + s.q_len) * ch]);
            l.v_res
                .extend_from_slice(&vf[s.q_start * ch..(s.q_start + s.q_len) * ch]);
        }
        self.stats.cache_ops_s += t0.elapsed().as_secs_f64();
        let qf = to_f32(input.q)?;
        let mut out = vec![0f32; batch.num_tokens * h * dh];
        let decoding = |s: &&super::StepSeq| {
            let e = &self.seqs[&s.id];
            s.ctx_before >= e.info.prefill_len
        };
        // Prefill rows: exact attention over the full-precision prompt held so far.
        for s in batch.seqs.iter().filter(|s| !decoding(s)) {
            let l = &self.seqs[&s.id].layers[layer];
            let n = s.ctx_before + s.q_len;
            let r = prefill_attention(
                &qf[s.q_start * h * dh..(s.q_start + s.q_len) * h * dh],
                &l.k_res,
                &l.v_res,
                s.q_len,
                n,
                self.shape,
                self.env.attention,
                self.env.chunk_size,
                None,
                self.scratch_limit,
            )
            .map_err(|e| Error::OutOfMemory {
                device: self.env.device_name.clone(),
                component: Component::Activations,
                requested: e.requested,
                available: e.limit,
                capacity: self.env.device_capacity.unwrap_or(0),
            })?;
            self.stats.add_scratch(r.scratch_bytes);
            out[s.q_start * h * dh..(s.q_start + s.q_len) * h * dh].copy_from_slice(&r.out);
        }
        // Decode rows read the codes, in parallel. The dequantization is fused into the
        // attention, so the whole of it is counted as cache operations.
        let t1 = Instant::now();
        let rows: Vec<_> = batch.seqs.iter().filter(|s| decoding(s)).collect();
        let this = &*self;
        let outs: Vec<(usize, Vec<f32>)> = rows
            .par_iter()
            .map(|s| {
                let mut o = vec![0f32; h * dh];
                let q = &qf[s.q_start * h * dh..(s.q_start + 1) * h * dh];
                this.attend_row(&this.seqs[&s.id].layers[layer], q, &mut o);
                (s.q_start, o)
            })
            .collect();
        for (start, o) in outs {
            out[start * h * dh..(start + 1) * h * dh].copy_from_slice(&o);
        }
        for s in &rows {
            self.attended
                .push(AttendRecord::whole(s.id, layer, s.ctx_before + 1));
        }
        // Quantize what the rules say once the prompt is in (every layer alike).
        for s in &batch.seqs {
            let n = s.ctx_before + s.q_len;
            let prefilled = n >= self.seqs[&s.id].info.prefill_len;
            if prefilled {
                let mut l =
                    std::mem::take(&mut self.seqs.get_mut(&s.id).expect("known").layers[layer]);
                self.settle(&mut l, n);
                self.seqs.get_mut(&s.id).expect("known").layers[layer] = l;
            }
            if layer + 1 == self.num_layers {
                self.seqs.get_mut(&s.id).expect("known").len = n;
            }
        }
        self.stats.cache_ops_s += t1.elapsed().as_secs_f64();
        Ok(
            Tensor::from_vec(out, (batch.num_tokens, h, dh), input.q.device())?
                .to_dtype(input.q.dtype())?,
        )
    }

    fn memory(&self) -> PolicyMemory {
        let held = self.held();
        PolicyMemory {
            device_reserved: held,
            device_used: held,
            host_reserved: 0,
            host_used: 0,
        }
    }

    /// What the sequence's codes, scales and residuals take (the audit compares it
    /// with the formula).
    fn seq_device_bytes(&self, seq: SeqId) -> u64 {
        self.seqs
            .get(&seq)
            .map_or(0, |s| s.layers.iter().map(layer_bytes).sum())
    }

    fn take_stats(&mut self) -> PolicyStats {
        std::mem::take(&mut self.stats)
    }

    fn take_attended(&mut self) -> Vec<AttendRecord> {
        std::mem::take(&mut self.attended)
    }

    /// The bytes held equal the formula for each sequence's length.
    fn check_invariants(&self) -> std::result::Result<(), String> {
        for (id, s) in &self.seqs {
            if s.len <= s.info.prefill_len {
                continue;
            }
            let want = kivi_layer_bytes(
                &self.params,
                s.len,
                self.shape.num_kv_heads,
                self.shape.head_dim,
            );
            for (i, l) in s.layers.iter().enumerate() {
                let got = layer_bytes(l);
                if got != want {
                    return Err(format!(
                        "sequence {id} layer {i}: {got} bytes held, the formula says {want}"
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn codes_round_trip_within_half_a_scale() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for bits in [2, 4] {
            for len in [1, 7, 32, 33] {
                let x: Vec<f32> = (0..len).map(|_| rng.random_range(-5.0..5.0)).collect();
                let (s, m, c) = quantize(&x, bits);
                assert_eq!(c.len(), (len * bits).div_ceil(8));
                for (i, &v) in x.iter().enumerate() {
                    let back = code(&c, i, bits) * s + m;
                    assert!(
                        (back - v).abs() <= s / 2.0 + 1e-5,
                        "bits {bits}: {v} → {back}, scale {s}"
                    );
                }
            }
        }
        // A constant group has scale 0 and comes back exactly.
        let (s, m, c) = quantize(&[1.5; 8], 2);
        assert_eq!((s, m), (0.0, 1.5));
        assert_eq!(code(&c, 3, 2) * s + m, 1.5);
    }

    /// A decode row over codes and residuals equals plain attention over the
    /// dequantized keys and values (f64), with GQA.
    #[test]
    fn attention_over_codes_equals_attention_over_dequantized_rows() {
        for bits in [2, 4] {
            attention_matches(bits);
        }
    }

    fn attention_matches(bits: usize) {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let (h, hkv, dh) = (4, 2, 8);
        let params = KiviParams {
            bits,
            group: 4,
            residual: 8,
        };
        let env = PolicyEnv::cpu_for_tests();
        let mut cfg = crate::config::preset("tiny").expect("preset");
        (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) = (h, hkv, dh);
        let policy = KiviPolicy::new(params, &cfg, env);
        let n = 21;
        let ch = hkv * dh;
        let k: Vec<f32> = (0..n * ch).map(|_| rng.random_range(-2.0..2.0)).collect();
        let v: Vec<f32> = (0..n * ch).map(|_| rng.random_range(-2.0..2.0)).collect();
        let mut l = Layer {
            k_res: k.clone(),
            v_res: v.clone(),
            ..Default::default()
        };
        policy.settle(&mut l, n);
        assert_eq!((l.keys.len(), l.values.len()), (4, 13));
        assert_eq!(layer_bytes(&l), kivi_layer_bytes(&params, n, hkv, dh));
        // The dequantized rows, from the codes alone.
        let mut kd = k.clone();
        for (gi, g) in l.keys.iter().enumerate() {
            for t in 0..4 {
                for c in 0..ch {
                    kd[(gi * 4 + t) * ch + c] =
                        code(&g.codes, t * ch + c, bits) * g.scale[c] + g.min[c];
                }
            }
        }
        let mut vd = v.clone();
        for (t, r) in l.values.iter().enumerate() {
            for c in 0..ch {
                let gi = (c / dh) * dh.div_ceil(4) + (c % dh) / 4;
                vd[t * ch + c] = code(&r.codes, c, bits) * r.scale[gi] + r.min[gi];
            }
        }
        for (a, b) in kd.iter().zip(&k).chain(vd.iter().zip(&v)) {
            // Half a scale: 4/15 at 2 bits over [-2, 2], less at 4 bits.
            assert!(
                (a - b).abs() <= 4.0 / 3.0 / 2.0 + 1e-5,
                "dequantized {a} vs {b}"
            );
        }
        let q: Vec<f32> = (0..h * dh).map(|_| rng.random_range(-2.0..2.0)).collect();
        let mut got = vec![0f32; h * dh];
        policy.attend_row(&l, &q, &mut got);
        for head in 0..h {
            let g = head / (h / hkv);
            let logits: Vec<f64> = (0..n)
                .map(|t| {
                    (0..dh)
                        .map(|c| q[head * dh + c] as f64 * kd[t * ch + g * dh + c] as f64)
                        .sum::<f64>()
                        / (dh as f64).sqrt()
                })
                .collect();
            let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = logits.iter().map(|x| (x - m).exp()).sum();
            for c in 0..dh {
                let want: f64 = (0..n)
                    .map(|t| (logits[t] - m).exp() / z * vd[t * ch + g * dh + c] as f64)
                    .sum();
                let d = (got[head * dh + c] as f64 - want).abs();
                assert!(
                    d < 1e-4,
                    "head {head} channel {c}: {} vs {want}",
                    got[head * dh + c]
                );
            }
        }
    }

    #[test]
    fn the_byte_formula_counts_codes_scales_and_residuals() {
        let p = KiviParams {
            bits: 2,
            group: 4,
            residual: 8,
        };
        // n = 21: keys 16 quantized (4 groups), 5 residual; values 13 quantized, 8 residual.
        assert_eq!(kivi_quantized(&p, 21), (16, 13));
        let (hkv, dh) = (2, 8);
        let ch = 16;
        let keys = 4 * ((4 * ch * 2) / 8 + 2 * 4 * ch) as u64;
        let values = 13 * ((ch * 2) / 8 + 2 * 4 * (hkv * 2)) as u64;
        let residual = ((21 - 16) + (21 - 13)) as u64 * ch as u64 * 4;
        assert_eq!(kivi_layer_bytes(&p, 21, hkv, dh), keys + values + residual);
        // A residual above the length keeps everything in f32.
        let big = KiviParams { residual: 32, ..p };
        assert_eq!(kivi_layer_bytes(&big, 21, hkv, dh), 2 * 21 * ch as u64 * 4);
    }
}
