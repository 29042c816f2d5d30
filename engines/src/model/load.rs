//! Building a [`Llama`] from a GGUF file, a Hugging Face safetensors directory or a
//! preset with seeded random weights.

use super::{Layer, Linear, Llama, WeightDtype};
use crate::config::{Llama3RopeScaling, ModelConfig};
use crate::error::{Error, Result};
use candle_core::quantized::{gguf_file, QMatMul};
use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use rayon::prelude::*;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Where weights come from, by Hugging Face tensor name.
trait WeightSource {
    /// A matrix `[out, in]`.
    fn linear(&mut self, name: &str, shape: (usize, usize)) -> Result<Linear>;
    /// A dense tensor in the compute dtype.
    fn dense(&mut self, name: &str, shape: &[usize]) -> Result<Tensor>;
    fn has(&self, name: &str) -> bool;
}

fn build(cfg: ModelConfig, wd: WeightDtype, src: &mut dyn WeightSource) -> Result<Llama> {
    cfg.validate().map_err(|m| Error::model(&cfg.name, m))?;
    let (d, hd, ff) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
    let embed = src.dense("model.embed_tokens.weight", &[cfg.vocab_size, d])?;
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for i in 0..cfg.num_layers {
        let p = format!("model.layers.{i}");
        layers.push(Layer {
            wq: src.linear(
                &format!("{p}.self_attn.q_proj.weight"),
                (cfg.num_heads * hd, d),
            )?,
            wk: src.linear(
                &format!("{p}.self_attn.k_proj.weight"),
                (cfg.num_kv_heads * hd, d),
            )?,
            wv: src.linear(
                &format!("{p}.self_attn.v_proj.weight"),
                (cfg.num_kv_heads * hd, d),
            )?,
            wo: src.linear(
                &format!("{p}.self_attn.o_proj.weight"),
                (d, cfg.num_heads * hd),
            )?,
            gate: src.linear(&format!("{p}.mlp.gate_proj.weight"), (ff, d))?,
            up: src.linear(&format!("{p}.mlp.up_proj.weight"), (ff, d))?,
            down: src.linear(&format!("{p}.mlp.down_proj.weight"), (d, ff))?,
            attn_norm: src.dense(&format!("{p}.input_layernorm.weight"), &[d])?,
            ffn_norm: src.dense(&format!("{p}.post_attention_layernorm.weight"), &[d])?,
        });
    }
    let norm = src.dense("model.norm.weight", &[d])?;
    let lm_head = if src.has("lm_head.weight") && !cfg.tie_word_embeddings {
        src.linear("lm_head.weight", (cfg.vocab_size, d))?
    } else if wd == WeightDtype::Quantized {
        // Tied head kept quantized, as llama.cpp and candle's quantized llama do.
        src.linear("model.embed_tokens.weight", (cfg.vocab_size, d))?
    } else {
        Linear::Dense(embed.clone())
    };
    Llama::new(cfg, wd, embed, layers, norm, lm_head)
        .with_packed_rows()?
        .with_weights_in_huge_pages()?
        .with_fused_projections()?
        .with_fused_kernels()?
        .with_gemv()
}

fn check_shape(model: &str, name: &str, got: &[usize], want: &[usize]) -> Result<()> {
    if got != want {
        return Err(Error::model(
            model,
            format!("tensor {name} has shape {got:?}, expected {want:?}"),
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------- presets

/// Tensors of a preset with seeded random weights, by Hugging Face name: every matrix
/// uniform with standard deviation 0.02 (Hugging Face's `initializer_range`), norms 1.
pub fn random_tensors(
    cfg: &ModelConfig,
    seed: u64,
    dtype: DType,
    device: &Device,
) -> Result<HashMap<String, Tensor>> {
    let (d, hd, ff, v) = (
        cfg.hidden_size,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.vocab_size,
    );
    let mut specs: Vec<(String, Vec<usize>, bool)> = vec![
        ("model.embed_tokens.weight".into(), vec![v, d], true),
        ("model.norm.weight".into(), vec![d], false),
    ];
    if !cfg.tie_word_embeddings {
        specs.push(("lm_head.weight".into(), vec![v, d], true));
    }
    for i in 0..cfg.num_layers {
        let p = format!("model.layers.{i}");
        for (n, s) in [
            ("self_attn.q_proj", vec![cfg.num_heads * hd, d]),
            ("self_attn.k_proj", vec![cfg.num_kv_heads * hd, d]),
            ("self_attn.v_proj", vec![cfg.num_kv_heads * hd, d]),
            ("self_attn.o_proj", vec![d, cfg.num_heads * hd]),
            ("mlp.gate_proj", vec![ff, d]),
            ("mlp.up_proj", vec![ff, d]),
            ("mlp.down_proj", vec![d, ff]),
        ] {
            specs.push((format!("{p}.{n}.weight"), s, true));
        }
        for n in ["input_layernorm", "post_attention_layernorm"] {
            specs.push((format!("{p}.{n}.weight"), vec![d], false));
        }
    }
    let mut out = HashMap::with_capacity(specs.len());
    for (name, shape, random) in specs {
        let n: usize = shape.iter().product();
        let t = if !random {
            Tensor::ones(shape, dtype, device)?
        } else {
            let seed = seed ^ fnv1a(name.as_bytes());
            // Rounded to a 16-bit dtype as they are drawn, so that a device gets half
            // the bytes (16 GB rather than 32 for an 8B preset); the same rounding
            // (to nearest, ties to even) as a cast on the device, so the same weights.
            match dtype {
                DType::BF16 => {
                    Tensor::from_vec(random_uniform(n, seed, half::bf16::from_f32), shape, device)?
                }
                DType::F16 => {
                    Tensor::from_vec(random_uniform(n, seed, half::f16::from_f32), shape, device)?
                }
                _ => Tensor::from_vec(random_uniform(n, seed, |x| x), shape, device)?
                    .to_dtype(dtype)?,
            }
        };
        out.insert(name, t);
    }
    Ok(out)
}

/// Uniform in ±0.02·√3 (std 0.02), each value passed through `f` (a rounding to the
/// weights' dtype), generated in parallel chunks with per-chunk seeds so the values do
/// not depend on the thread count.
fn random_uniform<T: Send>(n: usize, seed: u64, f: impl Fn(f32) -> T + Sync) -> Vec<T> {
    const CHUNK: usize = 1 << 16;
    let a = 0.02f32 * 3f32.sqrt();
    // Written in place by the threads: a buffer filled first would be one more pass
    // over 16 GB on one thread for an 8B preset.
    let mut data = Vec::with_capacity(n);
    data.spare_capacity_mut()[..n]
        .par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(i, c)| {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed.wrapping_add(i as u64));
            for x in c {
                x.write(f(rng.random_range(-a..a)));
            }
        });
    // SAFETY: the chunks above cover all `n` elements, and each was written.
    unsafe { data.set_len(n) };
    data
}

fn fnv1a(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf29ce484222325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x100000001b3)
    })
}

struct MapSource {
    model: String,
    map: HashMap<String, Tensor>,
    dtype: DType,
}

impl WeightSource for MapSource {
    fn linear(&mut self, name: &str, shape: (usize, usize)) -> Result<Linear> {
        Ok(Linear::Dense(self.dense(name, &[shape.0, shape.1])?))
    }
    fn dense(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self
            .map
            .get(name)
            .ok_or_else(|| Error::model(&self.model, format!("missing tensor {name}")))?;
        check_shape(&self.model, name, t.dims(), shape)?;
        Ok(t.to_dtype(self.dtype)?)
    }
    fn has(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }
}

/// A preset's architecture with seeded random weights.
pub fn load_preset(cfg: ModelConfig, wd: WeightDtype, seed: u64, device: &Device) -> Result<Llama> {
    if wd == WeightDtype::Quantized {
        return Err(Error::model(
            &cfg.name,
            "quantized weights need a GGUF file; use f32, f16 or bf16 for presets",
        ));
    }
    let map = random_tensors(&cfg, seed, wd.compute(), device)?;
    load_tensors(cfg, wd, map)
}

/// Build a model from tensors already in memory (Hugging Face names).
pub fn load_tensors(
    cfg: ModelConfig,
    wd: WeightDtype,
    map: HashMap<String, Tensor>,
) -> Result<Llama> {
    let dtype = wd.compute();
    let mut src = MapSource {
        model: cfg.name.clone(),
        map,
        dtype,
    };
    build(cfg, wd, &mut src)
}

// ---------------------------------------------------------------- GGUF

pub struct GgufFile {
    pub path: PathBuf,
    pub content: gguf_file::Content,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let f = std::fs::File::open(path).map_err(|e| Error::Io {
            path: path.into(),
            source: e,
        })?;
        // Buffered: the metadata is read a few bytes at a time (every token string of
        // the vocabulary and merges), one system call each from a bare file.
        let content = gguf_file::Content::read(&mut std::io::BufReader::new(f))
            .map_err(|e| Error::model(path.display(), format!("not a readable GGUF file: {e}")))?;
        let file = Self {
            path: path.into(),
            content,
        };
        file.check_length()?;
        Ok(file)
    }

    fn err(&self, message: impl Into<String>) -> Error {
        Error::model(self.path.display(), message)
    }

    fn md(&self, key: &str) -> Result<&gguf_file::Value> {
        self.content
            .metadata
            .get(key)
            .ok_or_else(|| self.err(format!("GGUF metadata has no `{key}`")))
    }

    /// An unsigned integer key of any GGUF integer type; absent is `None`, any other
    /// type or a negative value is an error naming the key (never a silent default).
    fn md_uint(&self, key: &str) -> Result<Option<usize>> {
        use gguf_file::Value as V;
        let Some(v) = self.content.metadata.get(key) else {
            return Ok(None);
        };
        let n: Option<u64> = match *v {
            V::U8(x) => Some(x.into()),
            V::U16(x) => Some(x.into()),
            V::U32(x) => Some(x.into()),
            V::U64(x) => Some(x),
            V::I8(x) => u64::try_from(x).ok(),
            V::I16(x) => u64::try_from(x).ok(),
            V::I32(x) => u64::try_from(x).ok(),
            V::I64(x) => u64::try_from(x).ok(),
            _ => None,
        };
        n.and_then(|n| usize::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| {
                self.err(format!(
                    "GGUF metadata `{key}` must be a non-negative integer, found {v:?}"
                ))
            })
    }

    fn md_u32(&self, key: &str) -> Result<usize> {
        self.md_uint(key)?
            .ok_or_else(|| self.err(format!("GGUF metadata has no `{key}`")))
    }

    /// A float key (f32 or f64); absent is `None`, any other type an error.
    fn md_float(&self, key: &str) -> Result<Option<f64>> {
        use gguf_file::Value as V;
        match self.content.metadata.get(key) {
            None => Ok(None),
            Some(V::F32(x)) => Ok(Some(f64::from(*x))),
            Some(V::F64(x)) => Ok(Some(*x)),
            Some(v) => Err(self.err(format!(
                "GGUF metadata `{key}` must be a float, found {v:?}"
            ))),
        }
    }

    /// A string key; absent is `None`, any other type an error.
    fn md_str(&self, key: &str) -> Result<Option<&str>> {
        match self.content.metadata.get(key) {
            None => Ok(None),
            Some(gguf_file::Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.err(format!(
                "GGUF metadata `{key}` must be a string, found {v:?}"
            ))),
        }
    }

    /// The tensors' data must lie within the file: a truncated download is named here
    /// rather than as a read error in the middle of loading.
    fn check_length(&self) -> Result<()> {
        let len = std::fs::metadata(&self.path)
            .map_err(|e| Error::Io {
                path: self.path.clone(),
                source: e,
            })?
            .len();
        let end = self
            .content
            .tensor_infos
            .values()
            .map(|t| {
                let dt = t.ggml_dtype;
                let bytes = (t.shape.elem_count() / dt.block_size() * dt.type_size()) as u64;
                self.content.tensor_data_offset + t.offset + bytes
            })
            .max()
            .unwrap_or(self.content.tensor_data_offset);
        if end > len {
            return Err(self.err(format!(
                "truncated GGUF file: its tensors end at byte {end}, the file has {len} bytes"
            )));
        }
        Ok(())
    }

    /// Architecture numbers from the GGUF metadata (llama.cpp keys).
    pub fn config(&self) -> Result<ModelConfig> {
        let arch = self
            .md_str("general.architecture")?
            .ok_or_else(|| self.err("GGUF metadata has no `general.architecture`"))?;
        if arch != "llama" {
            return Err(self.err(format!(
                "architecture `{arch}` is not supported (expected `llama`)"
            )));
        }
        let heads = self.md_u32("llama.attention.head_count")?;
        let hidden = self.md_u32("llama.embedding_length")?;
        let head_dim = self
            .md_uint("llama.rope.dimension_count")?
            .unwrap_or(hidden / heads.max(1));
        let vocab = match self.md_uint("llama.vocab_size")? {
            Some(v) => v,
            None => self
                .md("tokenizer.ggml.tokens")?
                .to_vec()
                .map_err(|e| self.err(format!("`tokenizer.ggml.tokens`: {e}")))?
                .len(),
        };
        let float_or = |k: &str, d: f64| -> Result<f64> { Ok(self.md_float(k)?.unwrap_or(d)) };
        let scaling = match self.md_str("llama.rope.scaling.type")? {
            Some("llama3") => Some(Llama3RopeScaling {
                factor: float_or("llama.rope.scaling.factor", 8.0)? as f32,
                low_freq_factor: float_or("llama.rope.scaling.low_freq_factor", 1.0)? as f32,
                high_freq_factor: float_or("llama.rope.scaling.high_freq_factor", 4.0)? as f32,
                original_max_position_embeddings: self
                    .md_uint("llama.rope.scaling.original_context_length")?
                    .unwrap_or(8192),
            }),
            None | Some("none") => None,
            Some(other) => {
                return Err(self.err(format!(
                    "`llama.rope.scaling.type` `{other}` is not supported (expected llama3 or none)"
                )))
            }
        };
        let name = match self.md_str("general.name")? {
            Some(n) => n.to_string(),
            None => self.path.display().to_string(),
        };
        Ok(ModelConfig {
            name,
            num_layers: self.md_u32("llama.block_count")?,
            hidden_size: hidden,
            intermediate_size: self.md_u32("llama.feed_forward_length")?,
            num_heads: heads,
            num_kv_heads: self
                .md_uint("llama.attention.head_count_kv")?
                .unwrap_or(heads),
            head_dim,
            vocab_size: vocab,
            max_position_embeddings: self.md_uint("llama.context_length")?.unwrap_or(4096),
            rope_theta: float_or("llama.rope.freq_base", 10_000.0)? as f32,
            rope_scaling: scaling,
            rms_norm_eps: float_or("llama.attention.layer_norm_rms_epsilon", 1e-5)?,
            tie_word_embeddings: !self.content.tensor_infos.contains_key("output.weight"),
            rope_interleaved: true,
            bos_token_id: self
                .md_uint("tokenizer.ggml.bos_token_id")?
                .map(|x| x as u32),
            eos_token_ids: self
                .md_uint("tokenizer.ggml.eos_token_id")?
                .map(|x| vec![x as u32])
                .unwrap_or_default(),
        })
    }
}

/// GGUF names for Hugging Face names.
fn gguf_name(hf: &str) -> String {
    let map = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ];
    if let Some((_, g)) = map.iter().find(|(h, _)| *h == hf) {
        return g.to_string();
    }
    let Some(rest) = hf.strip_prefix("model.layers.") else {
        return hf.to_string();
    };
    let (idx, tail) = rest.split_once('.').unwrap_or((rest, ""));
    let t = match tail {
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        "input_layernorm.weight" => "attn_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        other => other,
    };
    format!("blk.{idx}.{t}")
}

struct GgufSource<'a> {
    file: &'a GgufFile,
    reader: std::fs::File,
    wd: WeightDtype,
    device: Device,
}

impl GgufSource<'_> {
    fn qtensor(&mut self, hf: &str) -> Result<candle_core::quantized::QTensor> {
        let name = gguf_name(hf);
        self.file
            .content
            .tensor(&mut self.reader, &name, &self.device)
            .map_err(|e| Error::model(self.file.path.display(), format!("tensor {name}: {e}")))
    }
}

impl WeightSource for GgufSource<'_> {
    fn linear(&mut self, name: &str, shape: (usize, usize)) -> Result<Linear> {
        let q = self.qtensor(name)?;
        let model = self.file.path.display().to_string();
        check_shape(&model, name, q.shape().dims(), &[shape.0, shape.1])?;
        if self.wd == WeightDtype::Quantized {
            let bytes = q.storage_size_in_bytes() as u64;
            Ok(Linear::Quantized {
                mm: QMatMul::from_qtensor(q)?,
                bytes,
            })
        } else {
            Ok(Linear::Dense(
                q.dequantize(&self.device)?.to_dtype(self.wd.compute())?,
            ))
        }
    }
    fn dense(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let q = self.qtensor(name)?;
        let model = self.file.path.display().to_string();
        check_shape(&model, name, q.shape().dims(), shape)?;
        Ok(q.dequantize(&self.device)?.to_dtype(self.wd.compute())?)
    }
    fn has(&self, name: &str) -> bool {
        self.file
            .content
            .tensor_infos
            .contains_key(&gguf_name(name))
    }
}

pub fn load_gguf(file: &GgufFile, wd: WeightDtype, device: &Device) -> Result<Llama> {
    let cfg = file.config()?;
    let reader = std::fs::File::open(&file.path).map_err(|e| Error::Io {
        path: file.path.clone(),
        source: e,
    })?;
    let mut src = GgufSource {
        file,
        reader,
        wd,
        device: device.clone(),
    };
    build(cfg, wd, &mut src)
}

// ---------------------------------------------------------------- safetensors

/// Hugging Face `config.json` of a Llama model (the fields kvbench reads).
#[derive(Debug, serde::Deserialize, serde::Serialize)]
pub struct HfConfig {
    #[serde(default)]
    pub architectures: Vec<String>,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    pub num_hidden_layers: usize,
    pub vocab_size: usize,
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "default_ctx")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_theta")]
    pub rope_theta: f32,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
}

fn default_ctx() -> usize {
    4096
}
fn default_theta() -> f32 {
    10_000.0
}
fn default_eps() -> f64 {
    1e-6
}

impl HfConfig {
    pub fn to_model_config(&self, name: &str) -> Result<ModelConfig> {
        if let Some(a) = self.architectures.first() {
            if a != "LlamaForCausalLM" {
                return Err(Error::model(
                    name,
                    format!("architecture `{a}` is not supported (expected LlamaForCausalLM)"),
                ));
            }
        }
        let rope_scaling = match &self.rope_scaling {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => {
                let ty = v
                    .get("rope_type")
                    .or_else(|| v.get("type"))
                    .and_then(|t| t.as_str())
                    .unwrap_or("");
                if ty != "llama3" {
                    return Err(Error::model(
                        name,
                        format!("rope_scaling type `{ty}` is not supported (expected llama3)"),
                    ));
                }
                // Absent: the Llama 3.1 value; present with another type: an error.
                let f = |k: &str, d: f64| -> Result<f64> {
                    match v.get(k) {
                        None => Ok(d),
                        Some(x) => x.as_f64().ok_or_else(|| {
                            Error::model(
                                name,
                                format!(
                                    "config.json `rope_scaling.{k}` must be a number, found {x}"
                                ),
                            )
                        }),
                    }
                };
                Some(Llama3RopeScaling {
                    factor: f("factor", 8.0)? as f32,
                    low_freq_factor: f("low_freq_factor", 1.0)? as f32,
                    high_freq_factor: f("high_freq_factor", 4.0)? as f32,
                    original_max_position_embeddings: f("original_max_position_embeddings", 8192.0)?
                        as usize,
                })
            }
        };
        let token_id = |x: &serde_json::Value| {
            x.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| {
                    Error::model(
                        name,
                        format!("config.json `eos_token_id` must hold token ids, found {x}"),
                    )
                })
        };
        let eos = match &self.eos_token_id {
            None | Some(serde_json::Value::Null) => vec![],
            Some(serde_json::Value::Array(a)) => a.iter().map(token_id).collect::<Result<_>>()?,
            Some(x) => vec![token_id(x)?],
        };
        Ok(ModelConfig {
            name: name.to_string(),
            num_layers: self.num_hidden_layers,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_heads: self.num_attention_heads,
            num_kv_heads: self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            head_dim: self
                .head_dim
                .unwrap_or(self.hidden_size / self.num_attention_heads.max(1)),
            vocab_size: self.vocab_size,
            max_position_embeddings: self.max_position_embeddings,
            rope_theta: self.rope_theta,
            rope_scaling,
            rms_norm_eps: self.rms_norm_eps,
            tie_word_embeddings: self.tie_word_embeddings,
            rope_interleaved: false,
            bos_token_id: self.bos_token_id,
            eos_token_ids: eos,
        })
    }

    pub fn from_model_config(c: &ModelConfig) -> Self {
        HfConfig {
            architectures: vec!["LlamaForCausalLM".into()],
            hidden_size: c.hidden_size,
            intermediate_size: c.intermediate_size,
            num_attention_heads: c.num_heads,
            num_key_value_heads: Some(c.num_kv_heads),
            num_hidden_layers: c.num_layers,
            vocab_size: c.vocab_size,
            head_dim: Some(c.head_dim),
            max_position_embeddings: c.max_position_embeddings,
            rope_theta: c.rope_theta,
            rope_scaling: c.rope_scaling.map(|s| {
                serde_json::json!({
                    "rope_type": "llama3",
                    "factor": s.factor,
                    "low_freq_factor": s.low_freq_factor,
                    "high_freq_factor": s.high_freq_factor,
                    "original_max_position_embeddings": s.original_max_position_embeddings,
                })
            }),
            rms_norm_eps: c.rms_norm_eps,
            tie_word_embeddings: c.tie_word_embeddings,
            bos_token_id: c.bos_token_id,
            eos_token_id: Some(serde_json::json!(c.eos_token_ids)),
        }
    }
}

pub fn read_hf_config(path: &Path, name: &str) -> Result<ModelConfig> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::Io {
        path: path.into(),
        source: e,
    })?;
    let de = &mut serde_json::Deserializer::from_str(&text);
    let hf: HfConfig = serde_path_to_error::deserialize(de).map_err(|e| {
        Error::model(
            path.display(),
            format!("invalid config.json at `{}`: {}", e.path(), e.inner()),
        )
    })?;
    // Errors name the file rather than the model: it is the file the user must fix.
    hf.to_model_config(name).map_err(|e| match e {
        Error::Model { message, .. } => Error::model(path.display(), message),
        e => e,
    })
}

struct SafetensorsSource {
    model: String,
    st: candle_core::safetensors::MmapedSafetensors,
    dtype: DType,
    device: Device,
}

impl WeightSource for SafetensorsSource {
    fn linear(&mut self, name: &str, shape: (usize, usize)) -> Result<Linear> {
        Ok(Linear::Dense(self.dense(name, &[shape.0, shape.1])?))
    }
    fn dense(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self
            .st
            .load(name, &self.device)
            .map_err(|e| Error::model(&self.model, format!("tensor {name}: {e}")))?;
        check_shape(&self.model, name, t.dims(), shape)?;
        Ok(t.to_dtype(self.dtype)?)
    }
    fn has(&self, name: &str) -> bool {
        self.st.get(name).is_ok()
    }
}

pub fn load_safetensors(
    cfg: ModelConfig,
    files: &[PathBuf],
    wd: WeightDtype,
    device: &Device,
) -> Result<Llama> {
    if wd == WeightDtype::Quantized {
        return Err(Error::model(
            &cfg.name,
            "quantized weights need a GGUF file; use f32, f16 or bf16 for safetensors",
        ));
    }
    // SAFETY (both blocks): the files are memory-mapped read-only; kvbench does not
    // modify them while the model is loaded (the usual caveat of mmap applies to other
    // writers).
    // Each file alone first, so a truncated or corrupt one is named.
    for f in files {
        unsafe { candle_core::safetensors::MmapedSafetensors::new(f) }.map_err(|e| {
            Error::model(f.display(), format!("not a readable safetensors file: {e}"))
        })?;
    }
    let st = unsafe { candle_core::safetensors::MmapedSafetensors::multi(files) }
        .map_err(|e| Error::model(&cfg.name, format!("cannot read safetensors: {e}")))?;
    let mut src = SafetensorsSource {
        model: cfg.name.clone(),
        st,
        dtype: wd.compute(),
        device: device.clone(),
    };
    build(cfg, wd, &mut src)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Weights generated in a 16-bit dtype are the f32 weights cast to it, bit for bit
    /// (what a cast on the device gave before they were rounded on the host).
    #[test]
    fn preset_weights_in_16_bits_are_the_f32_weights_cast() {
        let cfg = crate::config::preset("tiny").unwrap();
        let f32s = random_tensors(&cfg, 3, DType::F32, &Device::Cpu).unwrap();
        for dtype in [DType::BF16, DType::F16] {
            let narrow = random_tensors(&cfg, 3, dtype, &Device::Cpu).unwrap();
            assert_eq!(narrow.len(), f32s.len());
            for (name, w) in &f32s {
                let cast = w.to_dtype(dtype).unwrap();
                let got = &narrow[name];
                assert_eq!(got.dtype(), dtype, "{name}");
                assert_eq!(got.dims(), cast.dims(), "{name}");
                // Compared as the bits of the 16-bit values, so that -0 and NaN count.
                let bits = |t: &Tensor| -> Vec<u16> {
                    let flat = t.flatten_all().unwrap();
                    match dtype {
                        DType::BF16 => flat
                            .to_vec1::<half::bf16>()
                            .unwrap()
                            .iter()
                            .map(|v| v.to_bits())
                            .collect(),
                        _ => flat
                            .to_vec1::<half::f16>()
                            .unwrap()
                            .iter()
                            .map(|v| v.to_bits())
                            .collect(),
                    }
                };
                assert_eq!(bits(got), bits(&cast), "{name} in {dtype:?}");
            }
        }
    }
}
