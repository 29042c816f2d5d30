//! `snapkv`: one-shot prompt compression from an observation window (algorithms.md §6).
//! When the prompt ends, its last `w` queries score every earlier key (softmax over the
//! causal prefix, in f32), the scores are smoothed by 1-D pooling, and per KV head the
//! top `C − w` keys are kept with the whole window, `C = ⌊b·L0⌋`. Decode tokens are
//! appended and never evicted. Prefill attention itself is full.
//!
//! [adapt] GQA: the window probabilities are summed over the query heads of a group
//! and the selection is made per KV head (the original repeats K/V to every query
//! head before caching). A capacity below the window keeps the last `C` tokens. Only
//! the `w` window queries are held, so memory is O(w·L0) under any attention
//! implementation.

use crate::attention::paged::dot;
use crate::attention::prefill::{AttentionImpl, ColumnStats, PrefillShape};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::kv::KvCodec;
use crate::model::Llama;
use crate::policy::evicting::{Counts, EvictingPolicy, Eviction, VictimKind};
use crate::policy::registry::{
    bad, parse_usize, unknown, Param, Strategy, StrategyParams, Variant,
};
use crate::policy::spec::PolicyEnv;
use crate::policy::{KvPolicy, SeqInfo};
use candle_core::{DType, Tensor};
use serde_json::json;

/// How the window scores are smoothed before selection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// PyTorch's `avg_pool1d` with zero padding counted (the original's code default).
    Avg,
    /// `max_pool1d` (the original's LongBench configurations).
    Max,
}

impl Pooling {
    pub fn name(self) -> &'static str {
        match self {
            Pooling::Avg => "avg",
            Pooling::Max => "max",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SnapkvParams {
    /// Fraction of the prompt kept (`b ≥ 1`: no compression).
    pub budget: f64,
    /// Observation window `w`: the last prompt queries that vote (default 32).
    pub window: usize,
    /// Pooling kernel κ, odd (default 5).
    pub kernel: usize,
    pub pooling: Pooling,
}

impl Default for SnapkvParams {
    fn default() -> Self {
        Self {
            budget: 1.0,
            window: 32,
            kernel: 5,
            pooling: Pooling::Avg,
        }
    }
}

/// SnapKV's kept counts for a prompt of `prompt_len` tokens: capacity
/// `C = max(1, ⌊b·L0⌋)` and the window `min(w, C)`; `None` when `b ≥ 1`.
pub fn snapkv_counts(budget: f64, prompt_len: usize, window: usize) -> Option<Counts> {
    if budget >= 1.0 {
        return None;
    }
    let capacity = ((budget * prompt_len as f64).floor() as usize).max(1);
    Some(Counts {
        capacity,
        recent: window.min(capacity),
    })
}

/// Tokens held after a step with `n` tokens of context: the compressed prompt plus
/// every token decoded since (`n` when nothing was compressed).
fn kept_at(c: Option<Counts>, info: &SeqInfo, n: usize) -> usize {
    c.map_or(n, |c| {
        (c.capacity + n.saturating_sub(info.prefill_len)).min(n)
    })
}

impl StrategyParams for SnapkvParams {
    const STRATEGY: &'static Strategy = &Strategy {
        name: "snapkv",
        about: "one-shot prompt compression voted by an observation window (SnapKV)",
        params: &[
            Param {
                key: "window",
                values: "an integer ≥ 1; default 32",
                about: "observation window w: the last prompt queries that score the keys",
            },
            Param {
                key: "kernel",
                values: "an odd integer ≥ 1; default 5",
                about: "pooling kernel κ smoothing the scores",
            },
            Param {
                key: "pooling",
                values: "`avg` (default) or `max`",
                about: "average (zero padding counted) or max pooling",
            },
        ],
        budgeted: true,
        verify: &[Variant::DEFAULT, Variant::both(&[("pooling", "max")])],
        audit: &[Variant::DEFAULT],
        bench: &[],
        cuda: true,
        kv_codec: true,
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
            "window" => {
                self.window = parse_usize(s, k, v)?;
                if self.window == 0 {
                    return Err(bad(s, k, v, "at least 1 query"));
                }
            }
            "kernel" => {
                self.kernel = parse_usize(s, k, v)?;
                if self.kernel.is_multiple_of(2) {
                    return Err(bad(s, k, v, "an odd kernel ≥ 1 (the pooling is centred)"));
                }
            }
            "pooling" => {
                self.pooling = match v {
                    "avg" => Pooling::Avg,
                    "max" => Pooling::Max,
                    _ => return Err(bad(s, k, v, "`avg` or `max`")),
                }
            }
            _ => return Err(unknown(Self::STRATEGY, k)),
        }
        Ok(())
    }

    fn params_json(&self) -> serde_json::Value {
        json!({
            "window": self.window,
            "kernel": self.kernel,
            "pooling": self.pooling.name(),
        })
    }

    fn build(&self, model: &Llama, env: PolicyEnv) -> Result<Box<dyn KvPolicy>> {
        Ok(Box::new(SnapkvPolicy::new(Snapkv(*self), &model.cfg, env)))
    }

    /// H2O's CUDA machinery with the vote as tensor operations. Compile-checked; it has
    /// not run on a GPU.
    #[cfg(feature = "cuda")]
    fn build_cuda(&self, model: &Llama, env: PolicyEnv) -> Result<Box<dyn KvPolicy>> {
        Ok(Box::new(super::cuda::CudaEvictingPolicy::new(
            Snapkv(*self),
            model.device(),
            &model.cfg,
            env,
        )?))
    }

    fn nominal_attended(&self, _layer: usize, info: &SeqInfo, n: usize) -> usize {
        kept_at(
            snapkv_counts(self.budget, info.prompt_len, self.window),
            info,
            n,
        )
    }

    fn device_kv_bytes(
        &self,
        cfg: &ModelConfig,
        info: &SeqInfo,
        n: usize,
        kv: KvCodec,
        _statistic: usize,
    ) -> u64 {
        let c = snapkv_counts(self.budget, info.prompt_len, self.window);
        kept_at(c, info, n) as u64 * kv.token_bytes(cfg)
    }
}

/// The SnapKV rule.
#[derive(Debug, Clone, Copy)]
pub struct Snapkv(pub SnapkvParams);

pub type SnapkvPolicy = EvictingPolicy<Snapkv>;

/// Smooth `x` with a centred window of `kernel` (PyTorch's `avg_pool1d` /
/// `max_pool1d`, stride 1, padding κ/2; the average counts the zero padding).
pub fn pool(x: &[f32], kernel: usize, pooling: Pooling) -> Vec<f32> {
    let half = kernel / 2;
    (0..x.len())
        .map(|j| {
            let w = &x[j.saturating_sub(half)..(j + half + 1).min(x.len())];
            match pooling {
                Pooling::Avg => w.iter().sum::<f32>() / kernel as f32,
                Pooling::Max => w.iter().copied().fold(f32::NEG_INFINITY, f32::max),
            }
        })
        .collect()
}

/// The window's votes: per KV head, each key's softmax probability summed over the
/// window rows (`q`: `[rows, H, dh]` at positions `first..first + rows`, each
/// attending the keys up to its own) and over the group's query heads. `k`:
/// `[n, Hkv, dh]`. Returns `[Hkv, n]`, in f32.
pub fn window_scores(
    q: &[f32],
    first: usize,
    k: &[f32],
    n: usize,
    shape: PrefillShape,
) -> Vec<f32> {
    use rayon::prelude::*;
    let (h, hkv, dh) = (shape.num_heads, shape.num_kv_heads, shape.head_dim);
    let group = h / hkv;
    let rows = q.len() / (h * dh);
    let scale = 1.0 / (dh as f32).sqrt();
    let mut out = vec![0f32; hkv * n];
    out.par_chunks_mut(n).enumerate().for_each(|(g, acc)| {
        let mut logits = vec![0f32; n];
        for r in 0..rows {
            let len = (first + r + 1).min(n);
            for head in g * group..(g + 1) * group {
                let qh = &q[(r * h + head) * dh..][..dh];
                let mut max = f32::NEG_INFINITY;
                for (j, l) in logits[..len].iter_mut().enumerate() {
                    *l = dot(qh, &k[(j * hkv + g) * dh..][..dh]) * scale;
                    max = max.max(*l);
                }
                let mut sum = 0f32;
                for l in &mut logits[..len] {
                    *l = (*l - max).exp();
                    sum += *l;
                }
                for (a, l) in acc[..len].iter_mut().zip(&logits[..len]) {
                    *a += l / sum;
                }
            }
        }
    });
    out
}

/// [`window_scores`] as tensor operations, on any device (the CUDA policy's vote):
/// `q` `[w, H, dh]` the window's queries at positions `first..first + w`, `k`
/// `[n, Hkv, dh]`; returns `[Hkv, n]` in f32.
pub fn window_votes(q: &Tensor, first: usize, k: &Tensor) -> Result<Tensor> {
    let (w, h, dh) = q.dims3()?;
    let (n, hkv, _) = k.dims3()?;
    let group = h / hkv;
    // Query heads of a group are contiguous: [Hkv, G·w, dh] against [Hkv, n, dh].
    let q = q
        .to_dtype(DType::F32)?
        .transpose(0, 1)?
        .contiguous()?
        .reshape((hkv, group * w, dh))?;
    let k = k.to_dtype(DType::F32)?.transpose(0, 1)?.contiguous()?;
    let logits = (q.matmul(&k.t()?)? * (1.0 / (dh as f64).sqrt()))?;
    // Row i (position first + i) sees the keys up to its own.
    let mask: Vec<f32> = (0..w)
        .flat_map(|i| {
            (0..n).map(move |j| {
                if j <= first + i {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    let mask = Tensor::from_vec(mask, (1, 1, w, n), q.device())?;
    let logits = logits.reshape((hkv, group, w, n))?.broadcast_add(&mask)?;
    Ok(candle_nn::ops::softmax_last_dim(&logits)?.sum((1, 2))?)
}

impl Eviction for Snapkv {
    fn victim_kind(&self) -> VictimKind {
        // Never asked: decode does not evict (`capacity_at` grows with every token).
        VictimKind::OldestAfterSinks
    }

    fn name(&self) -> &'static str {
        "snapkv"
    }

    fn counts(&self, info: &SeqInfo) -> Option<Counts> {
        snapkv_counts(self.0.budget, info.prompt_len, self.0.window)
    }

    fn capacity_at(&self, c: Counts, info: &SeqInfo, n: usize) -> usize {
        kept_at(Some(c), info, n)
    }

    fn prefill_stats(&self, _attention: AttentionImpl) -> Option<ColumnStats> {
        None
    }

    fn observation_window(&self) -> usize {
        self.0.window
    }

    fn decode_probs(&self) -> bool {
        false
    }

    /// `score` holds the window's summed probabilities; the keys before the window are
    /// pooled and the best `C − w` kept (ties: the older), with the window.
    fn prefill_keep(&self, c: Counts, n: usize, score: &[f32]) -> Vec<usize> {
        let recent = c.recent.min(c.capacity).min(n);
        let heavy = c.capacity - recent;
        let prefix = n - recent;
        let pooled = pool(&score[..prefix], self.0.kernel, self.0.pooling);
        let mut old = super::first_k((0..prefix).collect(), heavy, |&a, &b| {
            pooled[b]
                .partial_cmp(&pooled[a])
                .unwrap_or(std::cmp::Ordering::Equal)
                .then(a.cmp(&b))
        });
        old.extend(prefix..n);
        old.sort_unstable();
        old
    }

    fn victim(&self, _c: Counts, _n: usize, pos: &[u32], _score: &[f32]) -> usize {
        // Unreachable while `capacity_at` grows with each decoded token; the newest slot
        // is the harmless answer.
        pos.len().saturating_sub(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pooling_matches_torch_with_padding() {
        let x = [1.0, 2.0, 3.0, 4.0, 5.0];
        // avg_pool1d(k=3, pad=1): zero padding counted at the edges.
        let a = pool(&x, 3, Pooling::Avg);
        let want = [1.0, 2.0, 3.0, 4.0, 3.0];
        for (g, w) in a.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{a:?}");
        }
        assert_eq!(pool(&x, 3, Pooling::Max), vec![2.0, 3.0, 4.0, 5.0, 5.0]);
        assert_eq!(pool(&x, 1, Pooling::Avg), x.to_vec());
    }

    #[test]
    fn keeps_the_window_and_the_pooled_top_with_ties_to_the_older() {
        let rule = Snapkv(SnapkvParams {
            budget: 0.5,
            window: 2,
            kernel: 1,
            pooling: Pooling::Avg,
        });
        let c = snapkv_counts(0.5, 8, 2).unwrap();
        assert_eq!((c.capacity, c.recent), (4, 2));
        // Prefix 0..6 scored; 4 is best, 1 and 3 tie → the older (1).
        let score = [0.5, 3.0, 1.0, 3.0, 9.0, 0.1, 7.0, 7.0];
        assert_eq!(rule.prefill_keep(c, 8, &score), vec![1, 4, 6, 7]);
        // Pooling moves the choice: with κ = 3 (avg), the neighbourhood of 1–3 wins.
        let pooled = Snapkv(SnapkvParams {
            kernel: 3,
            ..rule.0
        });
        let score = [0.0, 4.0, 0.0, 4.0, 0.0, 5.0, 0.0, 0.0];
        // pooled[0..6] = [4/3, 4/3, 8/3, 4/3, 3, 5/3]: 4, then 2.
        assert_eq!(pooled.prefill_keep(c, 8, &score), vec![2, 4, 6, 7]);
        // Capacity under the window: the last C tokens.
        let small = snapkv_counts(0.25, 8, 4).unwrap();
        assert_eq!(rule.prefill_keep(small, 8, &score), vec![6, 7]);
    }

    #[test]
    fn window_scores_are_the_summed_softmax_of_the_window_rows() {
        // Two query heads share one KV head; dh = 2; 4 keys; window rows at 2 and 3.
        let shape = PrefillShape {
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 2,
        };
        let k = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, -1.0, 0.0];
        let q = [1.0, 2.0, 0.5, -1.0, 0.0, 3.0, 2.0, 2.0];
        let got = window_scores(&q, 2, &k, 4, shape);
        // The reference: softmax of each (row, head) over its causal prefix, summed.
        let mut want = [0f64; 4];
        for (r, pos) in [(0usize, 2usize), (1, 3)] {
            for head in 0..2 {
                let qh = &q[(r * 2 + head) * 2..][..2];
                let l: Vec<f64> = (0..=pos)
                    .map(|j| (qh[0] * k[j * 2] + qh[1] * k[j * 2 + 1]) as f64 / 2f64.sqrt())
                    .collect();
                let z: f64 = l.iter().map(|x| x.exp()).sum();
                for (j, x) in l.iter().enumerate() {
                    want[j] += x.exp() / z;
                }
            }
        }
        for (g, w) in got.iter().zip(want) {
            assert!((*g as f64 - w).abs() < 1e-6, "{got:?} vs {want:?}");
        }
        // Four (row, head) pairs, each a distribution.
        assert!((got.iter().sum::<f32>() - 4.0).abs() < 1e-5);
    }

    /// The tensor version (the CUDA policy's) equals the CPU loop, with GQA.
    #[test]
    fn window_votes_equal_window_scores() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let (h, hkv, dh, n, w) = (6, 2, 8, 23, 5);
        let q: Vec<f32> = (0..w * h * dh)
            .map(|_| rng.random_range(-2.0..2.0))
            .collect();
        let k: Vec<f32> = (0..n * hkv * dh)
            .map(|_| rng.random_range(-2.0..2.0))
            .collect();
        let shape = PrefillShape {
            num_heads: h,
            num_kv_heads: hkv,
            head_dim: dh,
        };
        let first = n - w;
        let want = window_scores(&q, first, &k, n, shape);
        let dev = candle_core::Device::Cpu;
        let got = window_votes(
            &Tensor::from_vec(q, (w, h, dh), &dev).unwrap(),
            first,
            &Tensor::from_vec(k, (n, hkv, dh), &dev).unwrap(),
        )
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() < 1e-5, "{got:?} vs {want:?}");
        }
    }

    #[test]
    fn decode_tokens_are_added_to_the_capacity() {
        let info = SeqInfo {
            prompt_len: 100,
            max_new_tokens: 10,
            prefill_len: 100,
        };
        let p = SnapkvParams {
            budget: 0.3,
            ..Default::default()
        };
        // C = 30; after the 5th decode step (n = 105) 35 are held, the 6th row reads 36.
        assert_eq!(p.nominal_attended(0, &info, 106), 36);
        let full = SnapkvParams::default();
        assert_eq!(full.nominal_attended(0, &info, 106), 106);
    }
}
