//! Architecture numbers of a Llama-family model and the built-in presets.

use serde::{Deserialize, Serialize};

/// Llama 3 RoPE frequency scaling (`rope_scaling.rope_type = "llama3"`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Llama3RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub name: String,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub rope_theta: f32,
    pub rope_scaling: Option<Llama3RopeScaling>,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
    /// Q/K rows in llama.cpp's interleaved rotary order (GGUF files): RoPE rotates
    /// adjacent pairs instead of the two halves. Dot products are unchanged.
    pub rope_interleaved: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    pub fn group_size(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// Number of parameters (embeddings counted once when tied).
    pub fn num_params(&self) -> u64 {
        let (d, h, kv, hd, ff, v) = (
            self.hidden_size as u64,
            self.num_heads as u64,
            self.num_kv_heads as u64,
            self.head_dim as u64,
            self.intermediate_size as u64,
            self.vocab_size as u64,
        );
        let attn = d * h * hd * 2 + d * kv * hd * 2;
        let mlp = 3 * d * ff;
        let layer = attn + mlp + 2 * d;
        let head = if self.tie_word_embeddings { 0 } else { v * d };
        self.num_layers as u64 * layer + v * d + head + d
    }

    /// KV bytes of one token over all layers (K and V).
    pub fn kv_bytes_per_token(&self, elem_bytes: usize) -> u64 {
        (2 * self.num_layers * self.num_kv_heads * self.head_dim * elem_bytes) as u64
    }

    pub fn validate(&self) -> Result<(), String> {
        let checks = [
            (self.num_layers > 0, "num_layers must be > 0"),
            (self.num_heads > 0, "num_heads must be > 0"),
            (self.num_kv_heads > 0, "num_kv_heads must be > 0"),
            (
                self.num_kv_heads > 0 && self.num_heads.is_multiple_of(self.num_kv_heads),
                "num_heads must be a multiple of num_kv_heads",
            ),
            (
                self.head_dim > 0 && self.head_dim.is_multiple_of(2),
                "head_dim must be even and > 0",
            ),
            (self.vocab_size > 0, "vocab_size must be > 0"),
            (self.hidden_size > 0, "hidden_size must be > 0"),
        ];
        for (ok, msg) in checks {
            if !ok {
                return Err(format!("{}: {msg}", self.name));
            }
        }
        Ok(())
    }
}

/// Names of the built-in architecture presets (`preset:NAME`).
pub const PRESETS: &[&str] = &[
    "tiny",
    "smollm2-135m",
    "llama-3.2-1b",
    "llama-3.1-8b",
    "llama-3.1-70b",
];

const LLAMA3_SCALING_8B: Llama3RopeScaling = Llama3RopeScaling {
    factor: 8.0,
    low_freq_factor: 1.0,
    high_freq_factor: 4.0,
    original_max_position_embeddings: 8192,
};

/// The exact architecture of a preset (random weights are made by the loader).
pub fn preset(name: &str) -> Option<ModelConfig> {
    let base = |name: &str| ModelConfig {
        name: format!("preset:{name}"),
        num_layers: 0,
        hidden_size: 0,
        intermediate_size: 0,
        num_heads: 0,
        num_kv_heads: 0,
        head_dim: 0,
        vocab_size: 0,
        max_position_embeddings: 0,
        rope_theta: 10_000.0,
        rope_scaling: None,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: false,
        rope_interleaved: false,
        bos_token_id: None,
        eos_token_ids: vec![],
    };
    let cfg = match name {
        // For tests: 2 layers with GQA (group 2), the SmolLM2 vocabulary so either
        // tokenizer fits. Untied head: with tied random embeddings greedy decoding
        // just repeats the input token, which would make token-equality tests weak.
        "tiny" => ModelConfig {
            num_layers: 2,
            hidden_size: 64,
            intermediate_size: 128,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
            vocab_size: 49_152,
            max_position_embeddings: 4096,
            ..base(name)
        },
        "smollm2-135m" => ModelConfig {
            num_layers: 30,
            hidden_size: 576,
            intermediate_size: 1536,
            num_heads: 9,
            num_kv_heads: 3,
            head_dim: 64,
            vocab_size: 49_152,
            max_position_embeddings: 8192,
            rope_theta: 100_000.0,
            tie_word_embeddings: true,
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
            ..base(name)
        },
        "llama-3.2-1b" => ModelConfig {
            num_layers: 16,
            hidden_size: 2048,
            intermediate_size: 8192,
            num_heads: 32,
            num_kv_heads: 8,
            head_dim: 64,
            vocab_size: 128_256,
            max_position_embeddings: 131_072,
            rope_theta: 500_000.0,
            rope_scaling: Some(Llama3RopeScaling {
                factor: 32.0,
                ..LLAMA3_SCALING_8B
            }),
            tie_word_embeddings: true,
            bos_token_id: Some(128_000),
            eos_token_ids: vec![128_001, 128_008, 128_009],
            ..base(name)
        },
        "llama-3.1-8b" => llama31(name, 32, 4096, 14_336, 32),
        "llama-3.1-70b" => llama31(name, 80, 8192, 28_672, 64),
        _ => return None,
    };
    Some(cfg)
}

/// Llama 3.1 (8B, 70B): 8 KV heads of 128 dims, the Llama 3 vocabulary and 128K context.
fn llama31(name: &str, layers: usize, hidden: usize, ff: usize, heads: usize) -> ModelConfig {
    ModelConfig {
        name: format!("preset:{name}"),
        num_layers: layers,
        hidden_size: hidden,
        intermediate_size: ff,
        num_heads: heads,
        num_kv_heads: 8,
        head_dim: 128,
        vocab_size: 128_256,
        max_position_embeddings: 131_072,
        rope_theta: 500_000.0,
        rope_scaling: Some(LLAMA3_SCALING_8B),
        rms_norm_eps: 1e-5,
        tie_word_embeddings: false,
        rope_interleaved: false,
        bos_token_id: Some(128_000),
        eos_token_ids: vec![128_001, 128_008, 128_009],
    }
}

/// Inverse RoPE frequencies, with Llama 3 scaling when configured.
pub fn rope_inv_freq(cfg: &ModelConfig) -> Vec<f32> {
    let d = cfg.head_dim;
    let base: Vec<f32> = (0..d)
        .step_by(2)
        .map(|i| 1f32 / cfg.rope_theta.powf(i as f32 / d as f32))
        .collect();
    let Some(s) = cfg.rope_scaling else {
        return base;
    };
    // Same piecewise rule as Hugging Face `_compute_llama3_parameters`.
    let old_ctx = s.original_max_position_embeddings as f32;
    let low_wavelen = old_ctx / s.low_freq_factor;
    let high_wavelen = old_ctx / s.high_freq_factor;
    base.into_iter()
        .map(|f| {
            let wavelen = 2.0 * std::f32::consts::PI / f;
            if wavelen < high_wavelen {
                f
            } else if wavelen > low_wavelen {
                f / s.factor
            } else {
                let smooth = (old_ctx / wavelen - s.low_freq_factor)
                    / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * f / s.factor + smooth * f
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid_and_have_known_sizes() {
        for p in PRESETS {
            let c = preset(p).unwrap();
            c.validate().unwrap();
        }
        // Llama-3.1-8B: 8.03B parameters, 128 KiB of bf16 KV per token (algorithms.md §1).
        let c = preset("llama-3.1-8b").unwrap();
        assert_eq!(c.kv_bytes_per_token(2), 128 * 1024);
        let p = c.num_params() as f64 / 1e9;
        assert!((p - 8.03).abs() < 0.01, "{p}");
        let s = preset("smollm2-135m").unwrap();
        let p = s.num_params() as f64 / 1e6;
        assert!((p - 134.5).abs() < 1.0, "{p}");
    }

    #[test]
    fn llama3_scaling_leaves_high_frequencies_and_divides_low_ones() {
        let c = preset("llama-3.1-8b").unwrap();
        let mut plain = c.clone();
        plain.rope_scaling = None;
        let (a, b) = (rope_inv_freq(&c), rope_inv_freq(&plain));
        assert_eq!(a[0], b[0]);
        let last = a.len() - 1;
        assert!((a[last] - b[last] / 8.0).abs() < 1e-12);
        assert!(a.iter().zip(&b).all(|(x, y)| x <= y));
    }
}
