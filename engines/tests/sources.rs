//! Model sources: Hugging Face directory, hub cache (offline), presets, errors.

mod common;
use candle_core::{DType, Device};
use common::smollm2_path;
use kvbench_engines::config::preset;
use kvbench_engines::model::load::{random_tensors, HfConfig};
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
