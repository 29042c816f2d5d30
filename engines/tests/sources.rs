//! Model sources: Hugging Face directory, hub cache (offline), presets, errors.

mod common;
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device};
use common::smollm2_path;
use kvbench_engines::config::preset;
use kvbench_engines::model::load::{random_tensors, GgufFile, HfConfig};
use kvbench_engines::model::WeightDtype;
use kvbench_engines::source::{LoadOptions, ModelSource};
use kvbench_engines::tokenizer::TextTokenizer;
use std::path::Path;

fn write_hf_dir(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let cfg = preset("tiny").unwrap();
    let map = random_tensors(&cfg, 7, DType::F32, &Device::Cpu).unwrap();
    candle_core::safetensors::save(&map, dir.join("model.safetensors")).unwrap();
    let hf = HfConfig::from_model_config(&cfg);
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&hf).unwrap(),
    )
    .unwrap();
    TextTokenizer::byte_level()
        .unwrap()
        .inner
        .save(dir.join("tokenizer.json"), false)
        .unwrap();
}

fn opts(models_dir: &Path, hub: &Path) -> LoadOptions {
    LoadOptions {
        dtype: None,
        gguf_f32_max_bytes: None,
        seed: 7,
        models_dir: models_dir.into(),
        hub_cache: hf_hub::Cache::new(hub.into()),
    }
}

fn prompt_logits(src: &ModelSource, o: &LoadOptions) -> Vec<f32> {
    let l = src.load(&Device::Cpu, o).unwrap();
    assert_eq!(l.model.weight_dtype, WeightDtype::F32);
    let ids = l.tokenizer.encode("Hello, paged world").unwrap();
    l.model
        .forward_dense(&ids)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

#[test]
fn hf_directory_and_hub_cache_load_the_same_model_as_the_preset() {
    let tmp = tempfile::tempdir().unwrap();
    let empty_models = tmp.path().join("no-models");
    let hub = tmp.path().join("hub");
    let o = opts(&empty_models, &hub);
    // Preset without the SmolLM2 GGUF: byte-level tokenizer, same weights as saved.
    let preset_src = ModelSource::parse("preset:tiny").unwrap();
    let reference = prompt_logits(&preset_src, &o);

    let dir = tmp.path().join("tiny-hf");
    write_hf_dir(&dir);
    let src = ModelSource::parse(dir.to_str().unwrap()).unwrap();
    assert!(matches!(src, ModelSource::HfDir(_)));
    assert_eq!(prompt_logits(&src, &o), reference);

    // Hub cache layout: models--ORG--NAME/refs/REV → snapshots/HASH/*.
    let repo = hub.join("models--kvbench--tiny");
    for rev in ["main", "v1"] {
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs").join(rev), format!("hash-{rev}")).unwrap();
        write_hf_dir(&repo.join("snapshots").join(format!("hash-{rev}")));
    }
    for spec in ["hf:kvbench/tiny", "hf:kvbench/tiny@v1"] {
        let src = ModelSource::parse(spec).unwrap();
        assert_eq!(prompt_logits(&src, &o), reference, "{spec}");
        assert_eq!(src.config(&o).unwrap().num_layers, 2);
    }
}

#[test]
fn bad_model_specs_name_what_was_expected() {
    let e = ModelSource::parse("gpt-5").unwrap_err().to_string();
    assert!(
        e.contains("gpt-5") && e.contains("preset:NAME") && e.contains("smollm2-135m-instruct"),
        "{e}"
    );
    let e = ModelSource::parse("preset:huge").unwrap_err().to_string();
    assert!(e.contains("huge") && e.contains("llama-3.1-8b"), "{e}");
    let e = ModelSource::parse("hf:justaname").unwrap_err().to_string();
    assert!(e.contains("hf:ORG/NAME"), "{e}");
    let tmp = tempfile::tempdir().unwrap();
    let e = ModelSource::parse(tmp.path().to_str().unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("config.json"), "{e}");

    // A named model that was not fetched says how to fetch it.
    let o = opts(&tmp.path().join("empty"), &tmp.path().join("hub"));
    let src = ModelSource::parse("smollm2-135m-instruct").unwrap();
    let e = src.load(&Device::Cpu, &o).err().unwrap().to_string();
    assert!(e.contains("just fetch-model smollm2"), "{e}");

    // A file that is not GGUF.
    let bogus = tmp.path().join("bogus.gguf");
    std::fs::write(&bogus, b"not a gguf").unwrap();
    let src = ModelSource::parse(bogus.to_str().unwrap()).unwrap();
    let e = src.load(&Device::Cpu, &o).err().unwrap().to_string();
    assert!(e.contains("bogus.gguf") && e.contains("GGUF"), "{e}");

    // Quantized weights exist only for GGUF.
    let mut q = o.clone();
    q.dtype = Some(WeightDtype::Quantized);
    let e = ModelSource::parse("preset:tiny")
        .unwrap()
        .load(&Device::Cpu, &q)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("GGUF"), "{e}");
}

#[test]
fn gguf_path_and_named_model_resolve_to_the_same_file() {
    let p = smollm2_path();
    let o = opts(p.parent().unwrap(), Path::new("/nonexistent-hub"));
    let by_path = ModelSource::parse(p.to_str().unwrap()).unwrap();
    assert!(matches!(by_path, ModelSource::Gguf(_)));
    let named = ModelSource::parse("smollm2-135m-instruct").unwrap();
    assert_eq!(by_path.config(&o).unwrap(), named.config(&o).unwrap());
    // Presets use the SmolLM2 tokenizer when it is present.
    let l = ModelSource::parse("preset:tiny")
        .unwrap()
        .load(&Device::Cpu, &o)
        .unwrap();
    assert_eq!(l.tokenizer.kind, "gguf");
}

/// A tiny GGUF with the given metadata and one small F32 tensor.
fn write_gguf(path: &Path, metadata: &[(&str, gguf_file::Value)]) {
    let t = candle_core::Tensor::zeros((4, 8), DType::F32, &Device::Cpu).unwrap();
    let q = QTensor::quantize(&t, GgmlDType::F32).unwrap();
    let md: Vec<(&str, &gguf_file::Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let mut f = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut f, &md, &[("token_embd.weight", &q)]).unwrap();
}

fn llama_metadata() -> Vec<(&'static str, gguf_file::Value)> {
    use gguf_file::Value as V;
    vec![
        ("general.architecture", V::String("llama".into())),
        ("llama.attention.head_count", V::U32(2)),
        ("llama.embedding_length", V::U32(8)),
        ("llama.block_count", V::U32(1)),
        ("llama.feed_forward_length", V::U32(16)),
        ("llama.vocab_size", V::U32(4)),
        ("llama.rope.freq_base", V::F32(10_000.0)),
    ]
}

#[test]
fn gguf_metadata_of_the_wrong_type_is_an_error_naming_file_and_key() {
    use gguf_file::Value as V;
    let tmp = tempfile::tempdir().unwrap();
    let o = opts(&tmp.path().join("empty"), &tmp.path().join("hub"));
    let good = tmp.path().join("good.gguf");
    write_gguf(&good, &llama_metadata());
    let cfg = GgufFile::open(&good).unwrap().config().unwrap();
    assert_eq!((cfg.num_heads, cfg.hidden_size, cfg.vocab_size), (2, 8, 4));
    assert_eq!(cfg.rope_theta, 10_000.0);

    // Each wrong type used to fall back to a default silently.
    for (key, value) in [
        ("llama.rope.freq_base", V::String("1e4".into())),
        ("llama.attention.head_count_kv", V::F32(2.0)),
        ("llama.context_length", V::I32(-1)),
        ("llama.attention.layer_norm_rms_epsilon", V::U32(1)),
        ("general.name", V::U32(7)),
        ("tokenizer.ggml.eos_token_id", V::String("2".into())),
        ("llama.rope.scaling.type", V::String("yarn".into())),
        ("llama.attention.head_count", V::String("2".into())),
    ] {
        let mut md: Vec<_> = llama_metadata()
            .into_iter()
            .filter(|(k, _)| *k != key)
            .collect();
        md.push((key, value));
        let path = tmp.path().join("wrong.gguf");
        write_gguf(&path, &md);
        let src = ModelSource::parse(path.to_str().unwrap()).unwrap();
        let e = src.config(&o).unwrap_err().to_string();
        assert!(e.contains("wrong.gguf") && e.contains(key), "{key}: {e}");
    }
}

#[test]
fn truncated_model_files_are_errors_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let o = opts(&tmp.path().join("empty"), &tmp.path().join("hub"));
    let truncate = |path: &Path, keep: u64| {
        let len = std::fs::metadata(path).unwrap().len();
        assert!(keep < len);
        let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        f.set_len(keep).unwrap();
    };

    // GGUF cut in its tensor data: named at open, not mid-load.
    let gguf = tmp.path().join("cut.gguf");
    write_gguf(&gguf, &llama_metadata());
    let len = std::fs::metadata(&gguf).unwrap().len();
    truncate(&gguf, len - 16);
    let e = GgufFile::open(&gguf).err().unwrap().to_string();
    assert!(e.contains("cut.gguf") && e.contains("truncated"), "{e}");
    let src = ModelSource::parse(gguf.to_str().unwrap()).unwrap();
    let e = src.config(&o).unwrap_err().to_string();
    assert!(e.contains("cut.gguf") && e.contains("truncated"), "{e}");

    // Safetensors, config.json and tokenizer.json of a Hugging Face directory.
    for (file, keep_of) in [
        ("model.safetensors", 2u64),
        ("config.json", 2),
        ("tokenizer.json", 2),
    ] {
        let dir = tmp.path().join(format!("cut-{file}"));
        write_hf_dir(&dir);
        let path = dir.join(file);
        let len = std::fs::metadata(&path).unwrap().len();
        truncate(&path, len / keep_of);
        let src = ModelSource::parse(dir.to_str().unwrap()).unwrap();
        let e = src.load(&Device::Cpu, &o).err().unwrap().to_string();
        assert!(e.contains(file), "{file}: {e}");
    }
}

#[test]
fn config_json_fields_of_the_wrong_type_are_errors_naming_file_and_key() {
    let tmp = tempfile::tempdir().unwrap();
    let o = opts(&tmp.path().join("empty"), &tmp.path().join("hub"));
    for (key, patch) in [
        (
            "rope_scaling.factor",
            r#"{"rope_type": "llama3", "factor": "8"}"#,
        ),
        ("eos_token_id", r#""</s>""#),
        ("eos_token_id", r#"[2, -1]"#),
        ("hidden_size", r#""64""#),
    ] {
        let dir = tmp.path().join("wrong");
        write_hf_dir(&dir);
        let path = dir.join("config.json");
        let mut cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let field = key.split('.').next().unwrap();
        cfg[field] = serde_json::from_str(patch).unwrap();
        std::fs::write(&path, cfg.to_string()).unwrap();
        let src = ModelSource::parse(dir.to_str().unwrap()).unwrap();
        let e = src.config(&o).unwrap_err().to_string();
        assert!(e.contains("config.json") && e.contains(field), "{key}: {e}");
    }
}
