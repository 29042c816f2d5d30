//! Tensor parallelism over N GPUs (Megatron layout, as vLLM runs it): Q/K/V and
//! gate/up column-parallel, O and down row-parallel, embedding and LM head split over
//! the vocabulary, norms replicated; attention heads and KV heads split (KV heads
//! replicated when N > Hkv); two all-reduces of the hidden state per layer.
//!
//! Every per-GPU quantity comes from the *shard*: a [`ModelConfig`] with the heads,
//! KV heads, FFN width and vocabulary of one GPU, run through the same functions as a
//! single GPU.

use super::{CostError, Result, StepCost};
use crate::config::ModelConfig;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorParallel {
    /// Number of GPUs (1 = no parallelism).
    pub size: usize,
}

impl TensorParallel {
    pub fn new(size: usize) -> Result<Self> {
        if size == 0 {
            return Err(CostError::Invalid(
                "tensor parallel size must be ≥ 1".into(),
            ));
        }
        Ok(Self { size })
    }

    /// The shape one GPU holds and computes.
    pub fn shard(&self, c: &ModelConfig) -> Result<ModelConfig> {
        let n = self.size;
        if n == 1 {
            return Ok(c.clone());
        }
        let bad = |what: &str| {
            CostError::Invalid(format!("{}: {what} is not divisible over {n} GPUs", c.name))
        };
        if !c.num_heads.is_multiple_of(n) {
            return Err(bad("num_heads"));
        }
        if !c.intermediate_size.is_multiple_of(n) {
            return Err(bad("intermediate_size"));
        }
        let kv = if c.num_kv_heads.is_multiple_of(n) {
            c.num_kv_heads / n
        } else if n.is_multiple_of(c.num_kv_heads) {
            1 // each KV head replicated on N / Hkv GPUs
        } else {
            return Err(bad("num_kv_heads"));
        };
        let mut s = c.clone();
        s.name = format!("{} (1 of {n} tensor-parallel shards)", c.name);
        s.num_heads = c.num_heads / n;
        s.num_kv_heads = kv;
        s.intermediate_size = c.intermediate_size / n;
        s.vocab_size = c.vocab_size.div_ceil(n);
        Ok(s)
    }

    /// All-reduces per forward: after attention's O projection and after the MLP's
    /// down projection, in every layer.
    pub fn allreduces_per_forward(&self, c: &ModelConfig) -> f64 {
        if self.size > 1 {
            2.0 * c.num_layers as f64
        } else {
            0.0
        }
    }

    /// Bytes each GPU sends in one ring all-reduce of `tokens` hidden-state rows:
    /// `2(N−1)/N · tokens · dm · elem`.
    pub fn ring_bytes(&self, c: &ModelConfig, tokens: f64, elem: usize) -> f64 {
        let n = self.size as f64;
        2.0 * (n - 1.0) / n * tokens * c.hidden_size as f64 * elem as f64
    }

    /// Adds the all-reduces of a step (`cost.forwards` forwards over `cost.tokens`
    /// rows) computed on the shard of `full`.
    pub fn add_allreduces(&self, cost: &mut StepCost, full: &ModelConfig, elem: usize) {
        cost.allreduces += cost.forwards * self.allreduces_per_forward(full);
        if self.size > 1 {
            cost.allreduce_bytes +=
                2.0 * full.num_layers as f64 * self.ring_bytes(full, cost.tokens, elem);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::preset;
    use crate::cost::traffic::weight_read_bytes;

    #[test]
    fn shards_split_heads_and_replicate_kv_heads_past_hkv() {
        let c = preset("llama-3.1-70b").unwrap();
        let s = TensorParallel::new(4).unwrap().shard(&c).unwrap();
        assert_eq!((s.num_heads, s.num_kv_heads), (16, 2));
        assert_eq!(s.intermediate_size, 7168);
        s.validate().unwrap();
        let s = TensorParallel::new(16).unwrap().shard(&c).unwrap();
        assert_eq!((s.num_heads, s.num_kv_heads), (4, 1));
        let e = TensorParallel::new(3).unwrap().shard(&c).unwrap_err();
        assert!(e.to_string().contains("num_heads"), "{e}");
        assert!(TensorParallel::new(0).is_err());
    }

    #[test]
    fn two_gpus_halve_the_weights_each_reads() {
        let c = preset("llama-3.1-8b").unwrap();
        let one = weight_read_bytes(&c, 2, 1) as f64;
        let two =
            weight_read_bytes(&TensorParallel::new(2).unwrap().shard(&c).unwrap(), 2, 1) as f64;
        // Only the norms and the embedding row are replicated.
        let ratio = two / one;
        assert!((ratio - 0.5).abs() < 1e-4, "{ratio}");
        let mut cost = StepCost {
            forwards: 1.0,
            tokens: 8.0,
            ..Default::default()
        };
        TensorParallel::new(2)
            .unwrap()
            .add_allreduces(&mut cost, &c, 2);
        assert_eq!(cost.allreduces, 64.0);
        // Ring: 2·(1/2)·8 rows·4096·2 bytes, 64 times.
        assert_eq!(cost.allreduce_bytes, 64.0 * 8.0 * 4096.0 * 2.0);
    }
}
