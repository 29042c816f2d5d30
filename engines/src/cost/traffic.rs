//! Bytes and FLOPs of one decode step and of one prefill, per strategy
//! (docs/cost-model.md §2–3 for the equations).
//!
//! Attended-token counts are the budget audit's ([`nominal_attended`]): the numbers the
//! engine enforces every step. InfiniGen is costed at its cap `k_max` (the α rule may
//! select fewer tokens; the cap is what the budget allows).

use super::Setup;
use crate::attention::prefill::{AttentionImpl, ColumnStats};
use crate::config::ModelConfig;
use crate::kv::KvCodec;
use crate::policy::audit::nominal_attended;
use crate::policy::evicting::h2o::H2o;
use crate::policy::evicting::snapkv::snapkv_counts;
use crate::policy::evicting::Eviction;
use crate::policy::spec::PolicySpec;
use crate::policy::SeqInfo;
use serde::Serialize;

/// What one step (or one prefill) reads, writes, moves and computes. Bytes and FLOPs
/// as f64 (exact for integers below 2^53; long prefills of large models exceed u64).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StepCost {
    /// Sequences in the step (decode rows, or prompts).
    pub sequences: f64,
    /// Tokens processed (rows through the linear layers).
    pub tokens: f64,
    /// Forward passes (each reads the weights once and launches one set of kernels).
    pub forwards: f64,
    /// Device-memory bytes: weights read.
    pub weight_read: f64,
    /// KV bytes read by attention.
    pub kv_read: f64,
    /// KV bytes written (new tokens).
    pub kv_write: f64,
    /// Metadata bytes read and written: block tables, H2O scores and positions,
    /// InfiniGen partial keys and projection matrices.
    pub metadata: f64,
    /// Materialized score-matrix bytes written and read (eager / chunked attention,
    /// H2O's eager or chunked statistics).
    pub scores: f64,
    /// Bytes host → device.
    pub h2d: f64,
    /// Bytes device → host.
    pub d2h: f64,
    pub flops_linear: f64,
    /// QKᵀ and PV.
    pub flops_attention: f64,
    /// InfiniGen: speculative query, partial scores, threshold; prefill skewing.
    pub flops_speculation: f64,
    /// Statistics passes: H2O scores, StreamingLLM re-rotation.
    pub flops_statistics: f64,
    /// Tensor parallelism: number of all-reduces and bytes each all-reduces per GPU.
    pub allreduces: f64,
    pub allreduce_bytes: f64,
}

impl StepCost {
    /// All device-memory traffic.
    pub fn device_bytes(&self) -> f64 {
        self.weight_read + self.kv_read + self.kv_write + self.metadata + self.scores
    }

    pub fn flops(&self) -> f64 {
        self.flops_linear + self.flops_attention + self.flops_speculation + self.flops_statistics
    }

    /// FLOPs of dense products: the linear layers and InfiniGen's speculation.
    pub fn matmul_flops(&self) -> f64 {
        self.flops_linear + self.flops_speculation
    }

    /// Bytes over the host link, both directions.
    pub fn transfer_bytes(&self) -> f64 {
        self.h2d + self.d2h
    }

    /// Field-wise sum.
    pub fn add(&mut self, o: &StepCost) {
        self.sequences += o.sequences;
        self.tokens += o.tokens;
        self.forwards += o.forwards;
        self.weight_read += o.weight_read;
        self.kv_read += o.kv_read;
        self.kv_write += o.kv_write;
        self.metadata += o.metadata;
        self.scores += o.scores;
        self.h2d += o.h2d;
        self.d2h += o.d2h;
        self.flops_linear += o.flops_linear;
        self.flops_attention += o.flops_attention;
        self.flops_speculation += o.flops_speculation;
        self.flops_statistics += o.flops_statistics;
        self.allreduces += o.allreduces;
        self.allreduce_bytes += o.allreduce_bytes;
    }

    /// Every field times `k` (`k` identical steps).
    pub fn scaled(&self, k: f64) -> StepCost {
        let out = self;
        let f = |x: f64| x * k;
        StepCost {
            sequences: f(out.sequences),
            tokens: f(out.tokens),
            forwards: f(out.forwards),
            weight_read: f(out.weight_read),
            kv_read: f(out.kv_read),
            kv_write: f(out.kv_write),
            metadata: f(out.metadata),
            scores: f(out.scores),
            h2d: f(out.h2d),
            d2h: f(out.d2h),
            flops_linear: f(out.flops_linear),
            flops_attention: f(out.flops_attention),
            flops_speculation: f(out.flops_speculation),
            flops_statistics: f(out.flops_statistics),
            allreduces: f(out.allreduces),
            allreduce_bytes: f(out.allreduce_bytes),
        }
    }
}

/// Parameters of all matrix multiplications of one token: per layer Q, K, V, O and
/// the SwiGLU gate, up and down projections, plus the LM head.
pub fn matmul_params(c: &ModelConfig) -> u64 {
    let (d, h, kv, hd, ff, v) = (
        c.hidden_size as u64,
        c.num_heads as u64,
        c.num_kv_heads as u64,
        c.head_dim as u64,
        c.intermediate_size as u64,
        c.vocab_size as u64,
    );
    c.num_layers as u64 * (2 * d * h * hd + 2 * d * kv * hd + 3 * d * ff) + v * d
}

/// Weight bytes one forward reads for `rows` tokens: every matrix and norm once, and
/// `rows` rows of the embedding table (the table itself is not swept).
pub fn weight_read_bytes(c: &ModelConfig, weight_elem: usize, rows: u64) -> u64 {
    let norms = (2 * c.num_layers as u64 + 1) * c.hidden_size as u64;
    (matmul_params(c) + norms + rows * c.hidden_size as u64) * weight_elem as u64
}

/// InfiniGen's partial-key width `r = ⌊ρ·dh⌋` clamped to `[1, dh]` (as
/// `InfinigenParams::checked` and the budget audit compute it).
pub fn infinigen_r(partial_ratio: f64, head_dim: usize) -> usize {
    ((partial_ratio * head_dim as f64).floor() as usize).clamp(1, head_dim)
}

/// H2O's prefill statistics mode, from the policy's own rule.
fn h2o_stats(spec: &PolicySpec, attention: AttentionImpl) -> Option<ColumnStats> {
    match spec {
        PolicySpec::H2o(p) => H2o(*p).prefill_stats(attention),
        PolicySpec::Hybrid(q) => h2o_stats(&q.long, attention),
        _ => None,
    }
}

/// The weights one forward of `rows` tokens reads ([`weight_read_bytes`]), as a cost
/// of one forward: what a step pays once however many sequences it holds.
pub fn forward_weights(c: &ModelConfig, weight_elem: usize, rows: usize) -> StepCost {
    StepCost {
        forwards: 1.0,
        weight_read: weight_read_bytes(c, weight_elem, rows as u64) as f64,
        ..Default::default()
    }
}

/// One decode row: a sequence with `info` and `n` tokens of context *including* the
/// token being generated (the step appends it). Everything but the weights, which the
/// step's forward reads once for all its rows ([`forward_weights`]).
pub fn decode_row(s: &Setup, info: &SeqInfo, n: usize) -> StepCost {
    if let PolicySpec::Hybrid(q) = &s.policy {
        return decode_row(&s.routed(q.route(info)), info, n);
    }
    let c = &s.model;
    let p = s.precision;
    let (h, hkv, dh, dm) = (
        c.num_heads as f64,
        c.num_kv_heads as f64,
        c.head_dim as f64,
        c.hidden_size as f64,
    );
    let row = s.kv().row_bytes(c.head_dim) as f64; // one token's K (or V) of one head
    let tl = 2.0 * hkv * row; // one token, one layer, K and V
                              // Integer rows are decoded as they are read: a multiply-add per element.
    let decode_flops = if matches!(s.kv(), KvCodec::Int { .. }) {
        4.0 * hkv * dh
    } else {
        0.0
    };
    let stat = p.statistic as f64;
    let nf = n as f64;
    let mut seq = StepCost {
        sequences: 1.0,
        tokens: 1.0,
        flops_linear: 2.0 * matmul_params(c) as f64,
        ..Default::default()
    };
    for layer in 0..c.num_layers {
        let a = nominal_attended(&s.policy, layer, info, n) as f64;
        seq.kv_read += a * tl;
        seq.flops_attention += 4.0 * h * dh * a;
        seq.flops_statistics += decode_flops * a;
        match &s.policy {
            PolicySpec::Full(_) => {
                seq.kv_write += tl;
                // The block table (u32 ids) of the sequence.
                seq.metadata += n.div_ceil(s.block_size) as f64 * 4.0;
            }
            PolicySpec::H2o(_) => {
                seq.kv_write += tl;
                // Score and position of every attended slot read, the score written
                // back (probabilities accumulated, then the victim searched).
                seq.metadata += hkv * a * 3.0 * stat;
                seq.flops_statistics += h * a;
            }
            PolicySpec::Hybrid(_) => unreachable!("routed above"),
            PolicySpec::Kivi(q) => {
                // The codes, scales and residuals held (the formula's bytes for one
                // layer) read instead of the full-precision rows counted above.
                let held =
                    crate::policy::kivi::kivi_layer_bytes(q, n, c.num_kv_heads, c.head_dim) as f64;
                seq.kv_read += held - a * tl;
                seq.kv_write += tl;
                // Dequantization: a multiply-add per element read.
                seq.flops_statistics += 2.0 * hkv * dh * a * 2.0;
            }
            PolicySpec::Quest(q) => {
                seq.kv_write += tl;
                seq.metadata += n.div_ceil(s.block_size) as f64 * 4.0;
                if layer >= q.dense_layers {
                    // Every page's max and min read to bound it, the current page's
                    // updated; q·M and q·m per channel and head, the max over both.
                    let pages = n.div_ceil(q.page) as f64;
                    seq.metadata += pages * hkv * 2.0 * dh * stat + 2.0 * hkv * dh * stat;
                    seq.flops_statistics += pages * h * dh * 3.0;
                }
            }
            PolicySpec::Snapkv(_) => {
                // Decode appends and never evicts: the kept prompt and the decoded
                // tokens are read (`a`), nothing else.
                seq.kv_write += tl;
            }
            PolicySpec::Streaming(q) => {
                seq.kv_write += tl;
                if q.rolling_positions {
                    // Every cached key re-rotated to its cache index: 3 FLOPs per element.
                    seq.flops_statistics += 3.0 * hkv * dh * a;
                }
            }
            PolicySpec::Infinigen(q) => {
                if layer < q.dense_layers.min(c.num_layers) {
                    seq.kv_write += tl;
                } else {
                    let r = infinigen_r(q.partial_ratio, c.head_dim) as f64;
                    let ctx = nf - 1.0;
                    // Partial keys of the whole context and the projection P read, the
                    // new token's partial key appended.
                    seq.metadata += hkv * ctx * r * stat + hkv * dh * r * stat + hkv * r * stat;
                    // Speculative Q projection, q·P, partial scores, threshold count.
                    seq.flops_speculation +=
                        2.0 * dm * h * dh + 2.0 * h * dh * r + 2.0 * h * ctx * r + h * ctx;
                    // Selected tokens fetched; the new token's K/V go to the host.
                    seq.h2d += (a - 1.0) * tl;
                    seq.d2h += tl;
                }
            }
        }
    }
    seq
}

/// One decode step of `batch` sequences alike: each has `info` and `n` tokens of
/// context *including* the token being generated (the step appends it).
pub fn decode_step(s: &Setup, info: &SeqInfo, n: usize, batch: usize) -> StepCost {
    let mut out = decode_row(s, info, n).scaled(batch as f64);
    out.add(&forward_weights(&s.model, s.precision.weight, batch));
    out
}

/// The chunk boundaries `[s, e)` of the rows `start..end` in chunks of `chunk`.
fn chunks(start: usize, end: usize, chunk: usize) -> impl Iterator<Item = (f64, f64)> {
    let chunk = chunk.max(1);
    (start..end)
        .step_by(chunk)
        .map(move |s| (s as f64, (s + chunk).min(end) as f64))
}

/// Rows `start..end` of the prefill of one sequence of `info.prefill_len` tokens, run
/// in one forward that attends to every key before `end` (the keys of `0..start` are
/// cached by earlier forwards). Everything but the weights ([`forward_weights`]). The
/// LM head runs for the last row of the prompt only.
pub fn prefill_rows(s: &Setup, info: &SeqInfo, start: usize, end: usize) -> StepCost {
    if let PolicySpec::Hybrid(q) = &s.policy {
        return prefill_rows(&s.routed(q.route(info)), info, start, end);
    }
    let c = &s.model;
    let p = s.precision;
    let (h, hkv, dh, dm, v) = (
        c.num_heads as f64,
        c.num_kv_heads as f64,
        c.head_dim as f64,
        c.hidden_size as f64,
        c.vocab_size as f64,
    );
    let row = s.kv().row_bytes(c.head_dim) as f64;
    let tl = 2.0 * hkv * row;
    let stat = p.statistic as f64;
    let (a, e) = (start as f64, end as f64);
    let rows = e - a;
    // Query-key pairs under the causal mask: row p attends p + 1 keys.
    let pairs = (e * (e + 1.0) - a * (a + 1.0)) / 2.0;
    let sampled = if end == info.prefill_len { 1.0 } else { 0.0 };
    let mut out = StepCost {
        sequences: 1.0,
        tokens: rows,
        flops_linear: 2.0 * rows * (matmul_params(c) as f64 - v * dm) + sampled * 2.0 * v * dm,
        ..Default::default()
    };
    // Score-matrix entries an eager call materializes: the rows against every key up
    // to the forward's end.
    let eager_entries = rows * e;
    // Materialized scores of the attention implementation, per layer (written, read).
    let attn_chunks: Vec<(f64, f64)> = chunks(start, end, s.chunk_size).collect();
    let attn_scores = match s.attention {
        AttentionImpl::Eager => 2.0 * h * eager_entries * 4.0,
        AttentionImpl::Chunked => attn_chunks
            .iter()
            .map(|&(a, e)| 2.0 * h * (e - a) * e * 4.0)
            .sum(),
        AttentionImpl::Flash => 0.0,
    };
    let stats = h2o_stats(&s.policy, s.attention);
    for layer in 0..c.num_layers {
        // Each forward reads the keys up to its end once.
        out.kv_read += e * tl;
        out.flops_attention += 4.0 * h * dh * pairs;
        out.scores += attn_scores;
        let offloaded = match &s.policy {
            PolicySpec::Infinigen(q) => layer >= q.dense_layers.min(c.num_layers),
            _ => false,
        };
        if offloaded {
            out.d2h += rows * tl;
        } else {
            out.kv_write += rows * tl;
        }
        match stats {
            None => {}
            Some(ColumnStats::Eager) if s.attention == AttentionImpl::Eager => {
                // Column sums of the matrix already there: one more read.
                out.flops_statistics += h * pairs;
                out.scores += h * eager_entries * 4.0;
            }
            Some(ColumnStats::Eager) => {
                // The full matrix materialized for the statistics alone.
                out.flops_statistics += 2.0 * h * dh * eager_entries + 2.0 * h * eager_entries;
                out.scores += 2.0 * h * eager_entries * 4.0;
            }
            Some(ColumnStats::Chunked) => {
                for &(a, e) in &attn_chunks {
                    let w = e - a;
                    out.flops_statistics += 2.0 * h * dh * w * w + 2.0 * h * w * w;
                    out.scores += 2.0 * h * w * w * 4.0;
                }
            }
            Some(ColumnStats::Exact) => {
                // Pass 2 of algorithms.md §9: QKᵀ recomputed, exp and column sums; K
                // read once more.
                out.flops_statistics += 2.0 * h * dh * pairs + 2.0 * h * pairs;
                out.kv_read += e * hkv * row;
            }
        }
        if stats.is_some() {
            // Scores and positions written per KV head.
            out.metadata += hkv * rows * 2.0 * stat;
        }
        if let PolicySpec::Snapkv(q) = &s.policy {
            let compresses = snapkv_counts(q.budget, info.prompt_len, q.window)
                .is_some_and(|c| info.prefill_len > c.capacity);
            if compresses && sampled > 0.0 {
                // The window's vote when the prompt ends: its w queries against every
                // key (QKᵀ, exp, sums), K read once more, the scores written per KV head.
                let w = q.window.min(info.prefill_len) as f64;
                out.flops_statistics += 2.0 * w * h * dh * e + 2.0 * w * h * e;
                out.kv_read += e * hkv * row;
                out.metadata += hkv * e * stat;
            }
        }
        if let PolicySpec::Infinigen(q) = &s.policy {
            if offloaded {
                let r = infinigen_r(q.partial_ratio, c.head_dim) as f64;
                // Skewed Q̃ = Q·A and K̃ = K·A, column importance, K̂ = K·P.
                out.flops_speculation += 2.0 * rows * (h + hkv) * dh * dh
                    + (h + hkv) * rows * dh
                    + 2.0 * rows * hkv * dh * r;
                // K̂ written for the rows; P once, with the prompt's last forward.
                out.metadata += hkv * rows * r * stat + sampled * hkv * dh * r * stat;
            }
        }
    }
    out
}

/// The whole prefill of one sequence of `info.prefill_len` tokens, run as forwards of
/// at most `forward_tokens` tokens each (the scheduler's `max_batched_tokens`, chunked
/// prefill); later forwards read the earlier ones' cached K/V.
pub fn prefill(s: &Setup, info: &SeqInfo, forward_tokens: usize) -> StepCost {
    let len = info.prefill_len;
    let mut out = StepCost::default();
    let step = forward_tokens.max(1);
    for start in (0..len).step_by(step) {
        let end = (start + step).min(len);
        out.add(&prefill_rows(s, info, start, end));
        out.add(&forward_weights(&s.model, s.precision.weight, end - start));
    }
    // One prompt, whatever the number of forwards.
    out.sequences = out.sequences.min(1.0);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::Precision;
    use crate::policy::budget::H2oRatio;
    use crate::policy::evicting::h2o::H2oParams;
    use crate::policy::evicting::streaming::StreamingParams;
    use crate::policy::infinigen::InfinigenParams;

    /// D=2, H=4, Hkv=2, dh=8, dm=16, ff=32, V=100.
    pub(crate) fn tiny() -> ModelConfig {
        let mut c = crate::config::preset("tiny").expect("preset");
        c.num_layers = 2;
        c.num_heads = 4;
        c.num_kv_heads = 2;
        c.head_dim = 8;
        c.hidden_size = 16;
        c.intermediate_size = 32;
        c.vocab_size = 100;
        c
    }

    fn setup(policy: PolicySpec) -> Setup {
        Setup::new(tiny(), policy, Precision::F32)
    }

    #[test]
    fn only_infinigens_memcpy_transfer_on_a_gpu_is_not_modelled() {
        let memcpy = || {
            PolicySpec::parse("infinigen", 0.3, &[("transfer".into(), "memcpy".into())]).unwrap()
        };
        let mut gpu = setup(memcpy());
        gpu.backend = crate::cost::DeviceKind::Gpu;
        assert!(gpu.not_modelled().is_some_and(|w| w.contains("memcpy")));
        // The CPU policy copies rows in process whatever the transfer.
        assert_eq!(setup(memcpy()).not_modelled(), None);
        for (name, budget) in [
            ("full", 1.0),
            ("h2o", 0.3),
            ("infinigen", 0.3),
            ("streaming", 0.3),
        ] {
            let mut s = setup(PolicySpec::parse(name, budget, &[]).unwrap());
            s.backend = crate::cost::DeviceKind::Gpu;
            assert_eq!(s.not_modelled(), None, "{name}");
        }
    }

    fn info(l0: usize, t: usize) -> SeqInfo {
        SeqInfo {
            prompt_len: l0,
            max_new_tokens: t,
            prefill_len: l0,
        }
    }

    // Per-token matmul params: 2 layers × (2·16·4·8 + 2·16·2·8 + 3·16·32) + 100·16
    //   = 2 × (1024 + 512 + 1536) + 1600 = 7744.
    // Weights read, 1 row: (7744 + 5·16 + 16) × 4 = 31,360 bytes.
    // One token, one layer, K+V, f32: 2·2·8·4 = 128 bytes.

    #[test]
    fn full_decode_by_hand() {
        assert_eq!(matmul_params(&tiny()), 7744);
        let c = decode_step(&setup(PolicySpec::full()), &info(100, 10), 101, 1);
        assert_eq!(c.weight_read, 31_360.0);
        assert_eq!(c.kv_read, 2.0 * 101.0 * 128.0);
        assert_eq!(c.kv_write, 2.0 * 128.0);
        // ⌈101/16⌉ = 7 block ids of 4 bytes per layer.
        assert_eq!(c.metadata, 2.0 * 7.0 * 4.0);
        assert_eq!(c.flops_linear, 2.0 * 7744.0);
        assert_eq!(c.flops_attention, 2.0 * 4.0 * 4.0 * 8.0 * 101.0);
        assert_eq!((c.h2d, c.d2h, c.flops_speculation), (0.0, 0.0, 0.0));
        // Batch 3: weights once (+2 embedding rows), the rest ×3.
        let c3 = decode_step(&setup(PolicySpec::full()), &info(100, 10), 101, 3);
        assert_eq!(c3.weight_read, 31_360.0 + 2.0 * 16.0 * 4.0);
        assert_eq!(c3.kv_read, 3.0 * c.kv_read);
        assert_eq!(c3.flops_linear, 3.0 * c.flops_linear);
    }

    #[test]
    fn snapkv_by_hand() {
        let s = setup(PolicySpec::Snapkv(
            crate::policy::evicting::snapkv::SnapkvParams {
                budget: 0.3,
                window: 4,
                ..Default::default()
            },
        ));
        // C = 30 kept of the prompt; at n = 105 (5th decode row) 30 + 5 read per layer.
        let c = decode_step(&s, &info(100, 10), 105, 1);
        assert_eq!(c.kv_read, 2.0 * 35.0 * 128.0);
        assert_eq!(c.kv_write, 2.0 * 128.0);
        assert_eq!((c.metadata, c.flops_statistics), (0.0, 0.0));
        // The vote at the prompt's end: 4 queries × 4 heads against 100 keys (dot of 8,
        // then exp and sum), K read again, one f32 score per key and KV head.
        let p = prefill(&s, &info(100, 10), 8192);
        let f = prefill(&setup(PolicySpec::full()), &info(100, 10), 8192);
        assert_eq!(
            p.flops_statistics,
            2.0 * (2.0 * 4.0 * 4.0 * 8.0 * 100.0 + 2.0 * 4.0 * 4.0 * 100.0)
        );
        assert_eq!(p.kv_read - f.kv_read, 2.0 * 100.0 * 2.0 * 8.0 * 4.0);
        assert_eq!(p.metadata - f.metadata, 2.0 * 2.0 * 100.0 * 4.0);
        // Budget 1: nothing voted, nothing dropped.
        let one = setup(PolicySpec::parse("snapkv", 1.0, &[]).unwrap());
        assert_eq!(prefill(&one, &info(100, 10), 8192), f);
        assert_eq!(
            decode_step(&one, &info(100, 10), 105, 1).kv_read,
            2.0 * 105.0 * 128.0
        );
    }

    #[test]
    fn hybrid_costs_each_request_as_its_side() {
        let h =
            setup(PolicySpec::parse("hybrid", 0.3, &[("threshold".into(), "50".into())]).unwrap());
        let h2o = setup(PolicySpec::parse("h2o", 0.3, &[]).unwrap());
        let full = setup(PolicySpec::full());
        assert_eq!(
            decode_row(&h, &info(100, 10), 105),
            decode_row(&h2o, &info(100, 10), 105)
        );
        assert_eq!(
            decode_row(&h, &info(40, 10), 45),
            decode_row(&full, &info(40, 10), 45)
        );
        assert_eq!(
            prefill(&h, &info(100, 10), 64),
            prefill(&h2o, &info(100, 10), 64)
        );
        assert_eq!(
            prefill(&h, &info(40, 10), 64),
            prefill(&full, &info(40, 10), 64)
        );
        assert_ne!(
            decode_row(&h2o, &info(100, 10), 105),
            decode_row(&full, &info(100, 10), 105)
        );
    }

    #[test]
    fn h2o_decode_by_hand() {
        let s = setup(PolicySpec::H2o(H2oParams {
            budget: 0.3,
            ..Default::default()
        }));
        // C = ⌊0.3·100⌋ = 30, attended C + 1 = 31 per layer.
        let c = decode_step(&s, &info(100, 10), 105, 1);
        assert_eq!(c.kv_read, 2.0 * 31.0 * 128.0);
        assert_eq!(c.metadata, 2.0 * (2.0 * 31.0 * 3.0 * 4.0));
        assert_eq!(c.flops_statistics, 2.0 * 4.0 * 31.0);
        assert_eq!(c.flops_attention, 2.0 * 4.0 * 4.0 * 8.0 * 31.0);
        // FlexGen's hh-ratio keeps twice as many.
        let s = setup(PolicySpec::H2o(H2oParams {
            budget: 0.3,
            ratio: H2oRatio::FlexgenHh,
            ..Default::default()
        }));
        let c = decode_step(&s, &info(100, 10), 105, 1);
        assert_eq!(c.kv_read, 2.0 * 61.0 * 128.0);
    }

    #[test]
    fn streaming_decode_by_hand() {
        let s = setup(PolicySpec::Streaming(StreamingParams {
            budget: 0.1,
            sinks: 4,
            rolling_positions: true,
        }));
        // S + W = 10, attended 11.
        let c = decode_step(&s, &info(100, 10), 105, 1);
        assert_eq!(c.kv_read, 2.0 * 11.0 * 128.0);
        assert_eq!(c.flops_statistics, 2.0 * 3.0 * 2.0 * 8.0 * 11.0);
        assert_eq!(c.metadata, 0.0);
    }

    #[test]
    fn infinigen_decode_by_hand() {
        let s = setup(PolicySpec::Infinigen(InfinigenParams {
            budget: 0.3,
            partial_ratio: 0.25,
            dense_layers: 1,
            ..Default::default()
        }));
        // k_max = ⌈0.3·(100 + 10)⌉ = 33; layer 0 dense (105), layer 1 attends 34.
        // r = ⌊0.25·8⌋ = 2.
        let c = decode_step(&s, &info(100, 10), 105, 1);
        assert_eq!(c.kv_read, (105.0 + 34.0) * 128.0);
        assert_eq!(c.kv_write, 128.0);
        assert_eq!(c.h2d, 33.0 * 128.0);
        assert_eq!(c.d2h, 128.0);
        // K̂ of 104 tokens, P (8×2) and the new partial key, per KV head, f32.
        assert_eq!(c.metadata, 2.0 * (104.0 * 2.0 + 16.0 + 2.0) * 4.0);
        let spec =
            2.0 * 16.0 * 4.0 * 8.0 + 2.0 * 4.0 * 8.0 * 2.0 + 2.0 * 4.0 * 104.0 * 2.0 + 4.0 * 104.0;
        assert_eq!(c.flops_speculation, spec);
        assert_eq!(c.flops_attention, 4.0 * 4.0 * 8.0 * (105.0 + 34.0));
        // At n ≤ k_max = ⌈0.3·120⌉ = 36 everything is fetched.
        let c = decode_step(&s, &info(20, 100), 21, 1);
        assert_eq!(c.h2d, 20.0 * 128.0);
    }

    #[test]
    fn infinigen_transfers_match_the_specs_llama_8b_example() {
        // algorithms.md §4: Llama-3.1-8B, n = 10K, b = 0.3 → k = 3000: 12.3 MB per
        // layer, ~370 MB per token per sequence (30 speculated layers).
        let s = Setup::new(
            crate::config::preset("llama-3.1-8b").expect("preset"),
            PolicySpec::Infinigen(InfinigenParams {
                budget: 0.3,
                ..Default::default()
            }),
            Precision::BF16,
        );
        let c = decode_step(&s, &info(10_000, 0), 10_000, 1);
        assert_eq!(c.h2d, 30.0 * 3000.0 * 8.0 * 128.0 * 2.0 * 2.0);
        assert!((c.h2d / 30.0 / 1e6 - 12.3).abs() < 0.05);
        assert!((c.h2d / 1e6 - 369.0).abs() < 1.0);
        // New token to the host, 30 offloaded layers.
        assert_eq!(c.d2h, 30.0 * 8.0 * 128.0 * 2.0 * 2.0);
    }

    #[test]
    fn budget_one_of_evicting_strategies_costs_what_full_costs() {
        let full = decode_step(&setup(PolicySpec::full()), &info(1000, 50), 1020, 4);
        for policy in [
            PolicySpec::H2o(H2oParams {
                budget: 1.0,
                ..Default::default()
            }),
            PolicySpec::Streaming(StreamingParams {
                budget: 1.0,
                rolling_positions: false,
                ..Default::default()
            }),
        ] {
            let c = decode_step(&setup(policy), &info(1000, 50), 1020, 4);
            assert_eq!(c.kv_read, full.kv_read);
            assert_eq!(c.kv_write, full.kv_write);
            assert_eq!(c.weight_read, full.weight_read);
            assert_eq!(c.flops_attention, full.flops_attention);
            assert_eq!(c.flops_linear, full.flops_linear);
            assert_eq!(c.transfer_bytes(), 0.0);
        }
        // InfiniGen at b = 1 attends everything but fetches it over the host link.
        let ig = decode_step(
            &setup(PolicySpec::Infinigen(InfinigenParams {
                budget: 1.0,
                dense_layers: 1,
                ..Default::default()
            })),
            &info(1000, 50),
            1020,
            4,
        );
        assert_eq!(ig.kv_read, full.kv_read);
        assert!(ig.h2d > 0.0);
    }

    #[test]
    fn prefill_by_hand() {
        // Full, flash, 10 tokens in one forward.
        let c = prefill(&setup(PolicySpec::full()), &info(10, 5), 8192);
        assert_eq!(c.forwards, 1.0);
        assert_eq!(c.weight_read, (7744.0 + 80.0 + 10.0 * 16.0) * 4.0);
        assert_eq!(
            c.flops_linear,
            2.0 * 10.0 * (7744.0 - 1600.0) + 2.0 * 1600.0
        );
        assert_eq!(c.flops_attention, 2.0 * 4.0 * 4.0 * 8.0 * 55.0);
        assert_eq!(c.kv_write, 2.0 * 10.0 * 128.0);
        assert_eq!(c.kv_read, 2.0 * 10.0 * 128.0);
        assert_eq!(c.scores, 0.0);
        // Two forwards of 8 and 2: weights read twice, keys 8 + 10.
        let c2 = prefill(&setup(PolicySpec::full()), &info(10, 5), 8);
        assert_eq!(c2.forwards, 2.0);
        assert_eq!(c2.weight_read, c.weight_read + (7744.0 + 80.0) * 4.0);
        assert_eq!(c2.kv_read, 2.0 * 18.0 * 128.0);
        assert_eq!(c2.flops_attention, c.flops_attention);
        // Eager over two forwards: 8×8 and 2×10 score entries per head.
        let mut e = setup(PolicySpec::full());
        e.attention = AttentionImpl::Eager;
        let c3 = prefill(&e, &info(10, 5), 8);
        assert_eq!(c3.scores, 2.0 * 2.0 * 4.0 * (64.0 + 20.0) * 4.0);
        // H2O with eager attention: the [H, L, L] matrix written, read, read for sums.
        let mut s = setup(PolicySpec::H2o(H2oParams {
            budget: 0.5,
            ..Default::default()
        }));
        s.attention = AttentionImpl::Eager;
        let c = prefill(&s, &info(10, 5), 8192);
        assert_eq!(c.scores, 2.0 * 3.0 * 4.0 * 100.0 * 4.0);
        assert_eq!(c.flops_statistics, 2.0 * 4.0 * 55.0);
        // Flash: exact statistics, +50 % of the attention FLOPs in QKᵀ.
        s.attention = AttentionImpl::Flash;
        let c = prefill(&s, &info(10, 5), 8192);
        assert_eq!(c.scores, 0.0);
        assert_eq!(
            c.flops_statistics,
            2.0 * (2.0 * 4.0 * 8.0 * 55.0 + 2.0 * 4.0 * 55.0)
        );
        // InfiniGen: offloaded layers' KV go to the host.
        let s = setup(PolicySpec::Infinigen(InfinigenParams {
            budget: 0.3,
            dense_layers: 1,
            ..Default::default()
        }));
        let c = prefill(&s, &info(10, 5), 8192);
        assert_eq!((c.kv_write, c.d2h), (10.0 * 128.0, 10.0 * 128.0));
        assert!(c.flops_speculation > 0.0);
    }
}
