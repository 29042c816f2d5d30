//! The `kvbench` binary as a user runs it.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn kvbench(models_dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvbench"))
        .args(args)
        .env("KVBENCH_MODELS_DIR", models_dir)
        .env_remove("KVBENCH_MODEL")
        .output()
        .expect("kvbench runs")
}

fn repo_models() -> PathBuf {
    std::env::var_os("KVBENCH_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models"))
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `kvbench run EXP --results RESULTS EXTRA...` in `cwd`, which must succeed; its stdout.
fn sweep_ok(cwd: &Path, exp: &Path, results: &Path, extra: &[&str]) -> String {
    let mut args = common::sweep_args(exp, results).to_vec();
    args.extend(extra);
    let o = kvbench(cwd, &args);
    assert!(o.status.success(), "{}", stderr(&o));
    String::from_utf8(o.stdout).unwrap()
}

#[test]
fn generate_json_is_one_object_with_exact_kv_bytes() {
    let empty = tempfile::tempdir().unwrap();
    let o = kvbench(
        empty.path(),
        &[
            "generate",
            "--model",
            "preset:tiny",
            "--prompt",
            "Hello",
            "--max-new-tokens",
            "7",
            "--ignore-eos",
            "--device-memory",
            "1GiB",
            "--json",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8(o.stdout).unwrap();
    assert_eq!(out.trim().lines().count(), 1, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    for k in [
        "text",
        "prompt_tokens",
        "output_tokens",
        "ttft_s",
        "decode_tok_s",
        "kv_device_bytes",
        "kv_pool_bytes",
        "kv_host_bytes",
        "weights_bytes",
        "engine",
        "device",
    ] {
        assert!(v.get(k).is_some(), "missing {k} in {out}");
    }
    // Byte-level tokenizer (no SmolLM2 in this models dir): 5 prompt tokens.
    assert_eq!(v["prompt_tokens"], 5);
    assert_eq!(v["output_tokens"], 7);
    assert_eq!(v["engine"], "full");
    assert_eq!(v["device"], "cpu");
    assert_eq!(v["kv_codec"], "f32");
    // preset:tiny f32: 2 layers × 2 KV heads × 16 dims × 4 B × (K, V) = 512 B per token;
    // the last generated token has no KV yet.
    assert_eq!(v["kv_device_bytes"], (5 + 7 - 1) * 512);
    assert_eq!(v["kv_host_bytes"], 0);
    let pool = v["kv_pool_bytes"].as_u64().unwrap();
    let weights = v["weights_bytes"].as_u64().unwrap();
    assert!(
        pool + weights <= (1u64 << 30) * 9 / 10 && pool > (1 << 29),
        "{pool}"
    );
    assert!(v["ttft_s"].as_f64().unwrap() > 0.0);
    // At batch 1 the batch's rates are the request's own.
    assert_eq!(v["batch"], 1);
    assert_eq!(v["batch_ttft_s"], v["ttft_s"]);
    let (b, d) = (
        v["batch_decode_tok_s"].as_f64().unwrap(),
        v["decode_tok_s"].as_f64().unwrap(),
    );
    assert!((b - d).abs() <= 1e-9 * d, "{b} vs {d}");
}

#[test]
fn generate_stores_rows_in_the_codec_given_and_names_a_bad_one() {
    let empty = tempfile::tempdir().unwrap();
    let args = |codec: &'static str| {
        [
            "generate",
            "--model",
            "preset:tiny",
            "--prompt",
            "Hello",
            "--max-new-tokens",
            "7",
            "--ignore-eos",
            "--device-memory",
            "1GiB",
            "--json",
            "--set",
            codec,
        ]
    };
    let o = kvbench(empty.path(), &args("kv_codec=int4"));
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["kv_codec"], "int4");
    // preset:tiny: 16-dim rows in 4 bits are 8 bytes of codes and one group's scale and
    // minimum (8 bytes): 2 layers × 2 KV heads × (K, V) × 16 B = 128 B per token.
    assert_eq!(v["kv_device_bytes"], (5 + 7 - 1) * 128);
    let o = kvbench(empty.path(), &args("kv_codec=int3"));
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("kv_codec=int3") && e.contains("int4"), "{e}");
}

/// SmolLM2's packed f32 weights (the default on the CPU) and the row layout
/// (`KVBENCH_PACKED_WEIGHTS=0`) generate the same text, alone and in a batch that takes
/// the packed two-input kernel; a value the switch does not take is refused by name.
#[test]
fn packed_weights_keep_the_text_and_the_switch_refuses_other_values() {
    let run = |packed: Option<&str>, batch: &str| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_kvbench"));
        c.args([
            "generate",
            "--model",
            "smollm2-135m-instruct",
            "--dtype",
            "f32",
            "--prompt",
            "The capital of France is",
            "--max-new-tokens",
            "12",
            "--ignore-eos",
            "--json",
            "--batch",
            batch,
        ])
        .env("KVBENCH_MODELS_DIR", repo_models())
        .env_remove("KVBENCH_MODEL")
        .env_remove("KVBENCH_PACKED_WEIGHTS");
        if let Some(v) = packed {
            c.env("KVBENCH_PACKED_WEIGHTS", v);
        }
        c.output().expect("kvbench runs")
    };
    for batch in ["1", "6"] {
        let text = |o: Output| {
            assert!(o.status.success(), "{}", stderr(&o));
            let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
            v["text"].as_str().unwrap().to_string()
        };
        let packed = text(run(None, batch));
        assert!(packed.split_whitespace().count() >= 3, "{packed:?}");
        assert_eq!(packed, text(run(Some("0"), batch)), "batch {batch}");
        assert_eq!(packed, text(run(Some("1"), batch)), "batch {batch}");
    }
    let o = run(Some("off"), "1");
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains("KVBENCH_PACKED_WEIGHTS=off") && e.contains("0, 1"),
        "{e}"
    );
}

#[test]
fn generate_batch_submits_the_prompt_that_many_times() {
    let empty = tempfile::tempdir().unwrap();
    let args = |batch: &'static str| {
        [
            "generate",
            "--model",
            "preset:tiny",
            "--prompt",
            "Hello",
            "--max-new-tokens",
            "7",
            "--ignore-eos",
            "--device-memory",
            "1GiB",
            "--json",
            "--batch",
            batch,
        ]
    };
    let o = kvbench(empty.path(), &args("4"));
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["batch"], 4);
    // The per-request numbers are one request's: its own KV, not the batch's.
    assert_eq!(v["output_tokens"], 7);
    assert_eq!(v["kv_device_bytes"], (5 + 7 - 1) * 512);
    let (ttft, batch_ttft) = (
        v["ttft_s"].as_f64().unwrap(),
        v["batch_ttft_s"].as_f64().unwrap(),
    );
    assert!(batch_ttft >= ttft && ttft > 0.0, "{batch_ttft} {ttft}");
    assert!(v["batch_decode_tok_s"].as_f64().unwrap() > 0.0, "{v}");

    let o = kvbench(empty.path(), &args("0"));
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--batch"), "{}", stderr(&o));
}

#[test]
fn generate_smollm2_answers_in_english() {
    let o = kvbench(
        &repo_models(),
        &[
            "generate",
            "--model",
            "smollm2-135m-instruct",
            "--prompt",
            "The capital of France is",
            "--max-new-tokens",
            "8",
            "--json",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["text"].as_str().unwrap().contains("Paris"), "{v}");
    // `--dtype auto` on the CPU dequantizes a GGUF whose f32 weights fit (538 MB here).
    assert_eq!(v["weights_dtype"], "f32");
    // Text mode prints the continuation and the numbers.
    let o = kvbench(
        &repo_models(),
        &[
            "generate",
            "-m",
            "smollm2-135m-instruct",
            "-p",
            "The capital of France is",
            "-n",
            "4",
        ],
    );
    let text = String::from_utf8(o.stdout).unwrap();
    assert!(text.starts_with("The capital of France is Paris"), "{text}");
    for k in ["TTFT", "decode", "KV", "weights"] {
        assert!(text.contains(k), "{text}");
    }
}

#[test]
fn bad_input_is_named_with_what_was_expected() {
    let empty = tempfile::tempdir().unwrap();
    let cases: &[(&[&str], &[&str])] = &[
        (
            &["generate", "-m", "smollm2-135m-instruct", "-p", "x"],
            &["just fetch-model smollm2"],
        ),
        // The default model is the named SmolLM2: missing here, with the fix named.
        (&["generate", "-p", "x"], &["just fetch-model smollm2"]),
        (
            &[
                "generate",
                "-m",
                "preset:tiny",
                "-p",
                "x",
                "--device-memory",
                "8parsecs",
            ],
            &["8parsecs", "unit"],
        ),
        (
            &[
                "generate",
                "-m",
                "preset:tiny",
                "-p",
                "x",
                "--memory-fraction",
                "2",
            ],
            &["--memory-fraction", "(0, 1]"],
        ),
        (
            &["generate", "-m", "preset:nope", "-p", "x"],
            &["nope", "preset"],
        ),
        (
            &[
                "generate",
                "-m",
                "preset:tiny",
                "-p",
                "x",
                "--device",
                "tpu",
            ],
            &["tpu", "cuda"],
        ),
        (&["generate", "-m", "preset:tiny"], &["--prompt"]),
        // Out of memory is reported, not a crash.
        (
            &[
                "generate",
                "-m",
                "preset:tiny",
                "-p",
                "x",
                "--device-memory",
                "1MiB",
            ],
            &["out of memory", "weights"],
        ),
        (
            &[
                "generate",
                "-m",
                "preset:tiny",
                "-p",
                "x",
                "-n",
                "5000",
                "--device-memory",
                "1GiB",
            ],
            &["max_model_len"],
        ),
    ];
    for (args, wants) in cases {
        let o = kvbench(empty.path(), args);
        assert!(!o.status.success(), "{args:?} should fail");
        let e = stderr(&o);
        for w in *wants {
            assert!(e.contains(w), "{args:?}: {e}");
        }
        assert!(!e.contains("panicked"), "{args:?}: {e}");
    }
}

#[test]
fn models_lists_presets_and_named_models() {
    let empty = tempfile::tempdir().unwrap();
    let o = kvbench(empty.path(), &["models", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let names: Vec<&str> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["model"].as_str().unwrap())
        .collect();
    for n in [
        "smollm2-135m-instruct",
        "preset:tiny",
        "preset:smollm2-135m",
        "preset:llama-3.2-1b",
        "preset:llama-3.1-8b",
        "preset:llama-3.1-70b",
    ] {
        assert!(names.contains(&n), "{names:?}");
    }
    let l8 = v
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["model"] == "preset:llama-3.1-8b")
        .unwrap();
    assert_eq!(
        (
            l8["layers"].as_u64(),
            l8["kv_heads"].as_u64(),
            l8["head_dim"].as_u64()
        ),
        (Some(32), Some(8), Some(128))
    );
    assert!(v[0]["weights"]
        .as_str()
        .unwrap()
        .contains("just fetch-model smollm2"));
}

/// With the projections fused (as on CUDA; `KVBENCH_FUSED_PROJECTIONS=1` on the CPU),
/// verify checks the fused products against the separate ones on the same weights, in
/// a row of its own, and every strategy still passes.
#[test]
fn verify_checks_fused_projections_against_the_separate_ones() {
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "verify",
        "--model",
        "preset:tiny",
        "--dtype",
        "bf16",
        "--json",
    ];
    let o = Command::new(env!("CARGO_BIN_EXE_kvbench"))
        .args(args)
        .env("KVBENCH_MODELS_DIR", dir.path())
        .env("KVBENCH_FUSED_PROJECTIONS", "1")
        .env_remove("KVBENCH_MODEL")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let rows = v["results"].as_array().unwrap();
    assert_eq!(rows[1]["engine"], "fused-projections", "{}", rows[1]);
    let d = rows[1]["max_abs_logit_diff"].as_f64().unwrap();
    assert!(d.is_finite() && rows[1]["pass"] == true, "{}", rows[1]);
    assert!(rows.iter().all(|r| r["pass"] == true));
    // Without the variable the CPU does not fuse, and there is no such row.
    let o = kvbench(dir.path(), &args);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["results"]
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r["engine"] != "fused-projections"));
}

#[test]
fn verify_tiny_passes_and_reports_every_combination_as_json() {
    let dir = tempfile::tempdir().unwrap();
    let o = kvbench(dir.path(), &["verify", "--model", "preset:tiny", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let rows = v["results"].as_array().unwrap();
    // The reference against cache-free attention, every registered strategy's verify
    // sets × 3 attention implementations at budget 1, its audit sets.
    let cpu = |v: &&kvbench_engines::policy::registry::Variant| v.runs_on(false);
    let strategies = kvbench_engines::policy::registry::registry();
    let verified: usize = strategies
        .iter()
        .map(|s| s.verify.iter().filter(cpu).count())
        .sum();
    let audited: usize = strategies
        .iter()
        .map(|s| s.audit.iter().filter(cpu).count())
        .sum();
    assert_eq!(rows.len(), 1 + 3 * verified + audited);
    assert!(verified >= strategies.len() && audited >= strategies.len() - 1);
    for s in strategies {
        assert!(
            rows.iter().any(|r| r["engine"] == s.name),
            "{} not verified",
            s.name
        );
    }
    assert_eq!(rows[0]["engine"], "dense-reference");
    assert!(rows[0]["max_abs_logit_diff"].as_f64().unwrap() < 1e-3);
    // The dense forward holds no cache: its KV bytes are not measured, not 0.
    assert!(rows[0]["kv_device_bytes"].is_null(), "{}", rows[0]);
    assert!(rows[1..]
        .iter()
        .all(|r| r["kv_device_bytes"].as_u64() > Some(0)));
    assert_eq!(v["kernels"].as_array().map(Vec::len), Some(0));
    for r in rows {
        for k in [
            "engine",
            "attention",
            "budget",
            "max_abs_logit_diff",
            "kv_device_bytes",
            "pass",
        ] {
            assert!(r.get(k).is_some(), "{k} missing in {r}");
        }
        assert_eq!(r["pass"], true, "{r}");
    }
    // Audit rows carry the bytes allowed (at 0.3, or at 1 for a strategy without a
    // budget, KIVI).
    let audit: Vec<_> = rows
        .iter()
        .filter(|r| !r["kv_device_allowed_bytes"].is_null())
        .collect();
    assert_eq!(audit.len(), audited);
    assert!(audit
        .iter()
        .all(|r| r["budget"] == 0.3 || r["engine"] == "kivi"));
    let full = rows[1]["kv_device_bytes"].as_u64().unwrap();
    let h2o = audit[0]["kv_device_bytes"].as_u64().unwrap();
    // The 96-token request keeps ⌊0.3·96⌋ = 28 of its 111 tokens.
    assert_eq!(rows[1]["engine"], "full");
    assert!(h2o * 3 < full, "h2o {h2o} vs full {full}");
    // The skewing matrices were calibrated once and cached under the models dir.
    assert!(dir.path().join("skewing").read_dir().unwrap().count() == 1);
}

#[test]
fn verify_smollm2_passes() {
    let o = kvbench(
        &repo_models(),
        &[
            "verify",
            "--model",
            "smollm2-135m-instruct",
            "--prompt-tokens",
            "64",
            "--steps",
            "8",
        ],
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    assert!(out.contains("all passed"), "{out}");
    assert!(out.contains("f32 weights"), "{out}");
}

#[test]
fn generate_with_each_engine_reports_its_budget_and_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(12);
    let mut device = Vec::new();
    for (engine, extra) in [
        ("full", vec![]),
        ("h2o", vec!["--budget", "0.25", "--attention", "eager"]),
        ("streaming", vec!["--budget", "0.25", "--set", "sinks=2"]),
        (
            "infinigen",
            vec![
                "--budget",
                "0.25",
                "--set",
                "dense_layers=1",
                "--set",
                "alpha=3",
            ],
        ),
    ] {
        let mut args = vec![
            "generate",
            "--model",
            "preset:tiny",
            "--prompt",
            &prompt,
            "--max-new-tokens",
            "6",
            "--ignore-eos",
            "--device-memory",
            "1GiB",
            "--json",
            "--engine",
            engine,
        ];
        args.extend(extra);
        let o = kvbench(dir.path(), &args);
        assert!(o.status.success(), "{engine}: {}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["engine"], engine);
        let b = v["budget"].as_f64().unwrap();
        assert!((v["kvpress_compression_ratio"].as_f64().unwrap() - (1.0 - b)).abs() < 1e-9);
        device.push(v["kv_device_bytes"].as_u64().unwrap());
        if engine == "infinigen" {
            assert!(v["kv_host_bytes"].as_u64().unwrap() > 0, "{v}");
            assert!(v["h2d_bytes"].as_u64().unwrap() > 0, "{v}");
            assert_eq!(v["params"]["alpha"], 3.0);
        } else {
            assert_eq!(v["kv_host_bytes"], 0, "{v}");
        }
    }
    // Budgets show in the bytes held: h2o and streaming keep a quarter of the prompt.
    assert!(device[1] * 3 < device[0], "{device:?}");
    assert!(device[2] * 3 < device[0], "{device:?}");
    // Bad parameters are named.
    let o = kvbench(
        dir.path(),
        &[
            "generate",
            "--model",
            "preset:tiny",
            "--prompt",
            "x",
            "--engine",
            "h2o",
            "--set",
            "stats=maybe",
        ],
    );
    assert!(!o.status.success());
    assert!(stderr(&o).contains("stats=maybe"), "{}", stderr(&o));
}

#[test]
fn the_shipped_experiments_parse_and_list_their_cells() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    // Every shipped YAML.
    let mut shipped = Vec::new();
    for d in ["ci", "cpu", "gpu", "paper"] {
        for e in std::fs::read_dir(root.join("experiments").join(d)).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "yaml") {
                shipped.push(p);
            }
        }
    }
    assert!(shipped.len() >= 12, "{shipped:?}");
    for exp in &shipped {
        let exp = exp.to_str().unwrap();
        let o = kvbench(&repo_models(), &["run", exp, "--dry-run", "--json"]);
        assert!(o.status.success(), "{exp}: {}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let cells = v.as_array().unwrap();
        assert!(!cells.is_empty(), "{exp}");
        assert!(cells
            .iter()
            .all(|c| c["key"].as_str().unwrap().contains("engine=")));
    }
    // A name under experiments/ stands for its file (run from the repository root).
    let o = Command::new(env!("CARGO_BIN_EXE_kvbench"))
        .current_dir(&root)
        .args(["run", "cpu/quickstart", "--dry-run"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("6 of 6 cells"));
    let o = kvbench(&repo_models(), &["run", "no/such-experiment", "--dry-run"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("no/such-experiment"), "{}", stderr(&o));
}

#[test]
fn run_cell_prints_one_result_with_ok_and_oom_outcomes() {
    let dir = tempfile::tempdir().unwrap();
    // The experiment on a device of `memory`, written to `file`.
    let exp = |file: &str, memory: &str| {
        let path = dir.path().join(file);
        std::fs::write(
            &path,
            format!(
                "name: t\nmodel: preset:tiny\ndtype: f32\ndevice:\n  memory: {memory}\nengines:\n  - name: h2o\nmatrix:\n  batch: [2]\n  prompt_len: [40]\n  output_len: [6]\n  budget: [0.25]\n  request_rate: [50]\nworkload:\n  num_requests: 3\nwarmup: 1\n"
            ),
        )
        .unwrap();
        path
    };
    let run_cell = |exp: &Path, cell: &str| {
        kvbench(
            dir.path(),
            &["run-cell", exp.to_str().unwrap(), "--cell", cell],
        )
    };
    let ok = exp("ok.yaml", "1GiB");
    let o = run_cell(&ok, "0");
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["outcome"], "ok", "{v}");
    let m = &v["metrics"];
    // The warm-up request is not measured.
    assert_eq!(m["num_requests"], 3);
    assert_eq!(m["output_tokens"], 18);
    assert_eq!(m["tpot_s"]["n"], 3);
    assert!(m["ttft_s"]["p99"].as_f64().unwrap() > 0.0);
    assert!(v["attended_fraction"].as_f64().unwrap() < 0.5, "{v}");
    assert!(v["key"].as_str().unwrap().contains("engine=h2o"));
    // Where the time outside the measurement went: loading, then the warm-up.
    let secs = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {v}"));
    let (load, warm, wall) = (secs("load_s"), secs("warmup_s"), secs("wall_s"));
    assert!(load > 0.0 && warm > 0.0 && load + warm < wall, "{v}");
    // Run by hand, the cell reports no progress.
    assert!(!stderr(&o).contains("kvbench-progress"), "{}", stderr(&o));
    // A device smaller than the weights: the cell's outcome is oom, still one object.
    let o = run_cell(&exp("oom.yaml", "1MiB"), "0");
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["outcome"], "oom", "{v}");
    // The engine never started its warm-up: no time is made up for it.
    assert!(v["warmup_s"].is_null(), "{v}");
    assert!(
        v["error"].as_str().unwrap().contains("out of memory"),
        "{v}"
    );
    assert!(v["metrics"].is_null());
    // A cell index past the plan is a named error.
    let o = run_cell(&ok, "9");
    assert!(!o.status.success());
    assert!(stderr(&o).contains("cells 0..1"), "{}", stderr(&o));
}

#[test]
fn a_sweep_records_each_cell_once_and_resumes() {
    let (dir, exp) = common::with_experiment(
        "e.yaml",
        "name: sweep\nmodel: preset:tiny\ndtype: f32\ndevice:\n  memory: 1GiB\nengines:\n  - name: full\n  - name: streaming\nmatrix:\n  batch: [1, 2]\n  prompt_len: [24]\n  output_len: [4]\n  budget: [0.5]\nworkload:\n  num_requests: 2\n",
    );
    let results = dir.path().join("results");
    let run = |extra: &[&str]| sweep_ok(dir.path(), &exp, &results, extra);
    let out = run(&["--shard", "0/2"]);
    assert!(out.contains("2 cells run, 0 already recorded"), "{out}");
    let out = run(&[]);
    assert!(out.contains("2 cells run, 2 already recorded"), "{out}");
    let cells = results.join("sweep/cells");
    let files: Vec<_> = std::fs::read_dir(&cells).unwrap().collect();
    assert_eq!(files.len(), 4);
    for f in files {
        let f = f.unwrap().path();
        assert!(common::is_cell_gz(&f), "{}", f.display());
        let v = kvbench::cell_file::read(&f).unwrap();
        assert_eq!(v["outcome"], "ok", "{v}");
        assert_eq!(v["requests"].as_array().unwrap().len(), 2);
        assert!(!v["steps"].as_array().unwrap().is_empty());
    }
    assert!(results.join("sweep/experiment.yaml").is_file());
    let out = run(&["--force", "--shard", "1/2"]);
    assert!(out.contains("2 cells run, 0 already recorded"), "{out}");
    // The Parquet tables, rebuilt from the cell files.
    use polars::prelude::*;
    let read = |t: &str| {
        let f = std::fs::File::open(results.join(format!("sweep/{t}.parquet"))).unwrap();
        ParquetReader::new(f).finish().unwrap()
    };
    let runs = read("runs");
    assert_eq!(runs.height(), 4);
    let has_columns = |columns: &[&str]| {
        for c in columns {
            assert!(
                runs.column(c).is_ok(),
                "runs.parquet lacks {c}: {:?}",
                runs.get_column_names()
            );
        }
    };
    // The headline columns under their stable names.
    has_columns(&[
        "experiment",
        "cell_id",
        "repeat",
        "engine",
        "budget",
        "attention",
        "batch",
        "prompt_len",
        "output_len",
        "outcome",
        "error",
        "ttft_mean_s",
        "ttft_p99_s",
        "tpot_mean_s",
        "itl_p99_s",
        "e2e_mean_s",
        "decode_tok_s",
        "throughput_tok_s",
        "decode_tok_s_per_gb",
        "wall_prefill_s",
        "wall_decode_s",
        "wall_cache_ops_s",
        "mem_weights_bytes",
        "mem_kv_device_bytes",
        "mem_kv_host_bytes",
        "mem_activations_peak_bytes",
        "mem_device_peak_bytes",
        "mem_host_peak_bytes",
    ]);
    assert_eq!(runs.get_column_names()[0].as_str(), "experiment");
    let exp_names = runs.column("experiment").unwrap().str().unwrap();
    assert!((0..exp_names.len()).all(|i| exp_names.get(i) == Some("sweep")));
    // Per-GB throughput = decode throughput / (weights + device KV + activations) in GB.
    let f = |c: &str| runs.column(c).unwrap().cast(&DataType::Float64).unwrap();
    let (t, g) = (f("decode_tok_s"), f("decode_tok_s_per_gb"));
    let bytes: Vec<f64> = [
        "mem_weights_bytes",
        "mem_kv_device_bytes",
        "mem_activations_peak_bytes",
    ]
    .iter()
    .map(|c| f(c).f64().unwrap().get(0).unwrap())
    .collect();
    let expect = t.f64().unwrap().get(0).unwrap() / (bytes.iter().sum::<f64>() / 1e9);
    assert!((g.f64().unwrap().get(0).unwrap() - expect).abs() < 1e-9 * expect.abs().max(1.0));
    // No GPU here: the observed device peak is null, not zero.
    assert_eq!(
        runs.column("mem_device_peak_bytes").unwrap().null_count(),
        4
    );
    has_columns(&[
        "cell_index",
        "cell_key",
        "cell_engine",
        "cell_budget",
        "outcome",
        "metrics_ttft_s_p99",
        "metrics_decode_throughput",
        "memory_weights",
        "env_cpu_cores",
        "env_kvbench_version",
        "process_rss_peak_bytes",
    ]);
    // No GPU here: the GPU peak is null, not zero.
    assert_eq!(runs.column("gpu_used_peak_bytes").unwrap().null_count(), 4);
    let requests = read("requests");
    assert_eq!(requests.height(), 8);
    let ttft = requests.column("ttft_s").unwrap();
    assert_eq!(ttft.null_count(), 0);
    assert!(read("steps").height() >= 8);
    assert!(read("samples").height() >= 4);
    // --tables-only rebuilds lost tables from the cells and runs nothing.
    std::fs::remove_file(results.join("sweep/runs.parquet")).unwrap();
    let out = run(&["--tables-only"]);
    assert!(out.contains("runs.parquet (4 rows)"), "{out}");
    assert!(!out.contains("cells run"), "{out}");
    assert_eq!(read("runs").height(), 4);
}

#[test]
fn a_concurrency_cap_sends_requests_as_others_finish_and_progress_stays_in_the_parent() {
    let (dir, exp) = common::with_experiment(
        "c.yaml",
        "name: capped\nmodel: preset:tiny\ndtype: f32\ndevice:\n  memory: 1GiB\nengines:\n  - name: full\nmatrix:\n  batch: [4]\n  prompt_len: [16]\n  output_len: [4]\n  max_concurrency: [inf, 1]\nworkload:\n  num_requests: 3\nwarmup: 1\n",
    );
    let path = exp.to_str().unwrap();
    // --dry-run shows the cap.
    let o = kvbench(dir.path(), &["run", path, "--dry-run"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8(o.stdout).unwrap();
    assert!(out.contains("conc"), "{out}");
    let rows: Vec<&str> = out.lines().filter(|l| l.contains(" full ")).collect();
    assert_eq!(rows.len(), 2, "{out}");
    // The cap is the column before the repeat.
    let conc = |r: &str| r.split_whitespace().rev().nth(1).unwrap().to_string();
    assert_eq!(
        (conc(rows[0]), conc(rows[1])),
        ("inf".into(), "1".into()),
        "{out}"
    );
    // The child reports progress when asked: 4 requests × (16 + 4 − 1) tokens.
    let o = Command::new(env!("CARGO_BIN_EXE_kvbench"))
        .args(["run-cell", path, "--cell", "1"])
        .env("KVBENCH_MODELS_DIR", dir.path())
        .env("KVBENCH_PROGRESS", "1")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let progress: Vec<String> = stderr(&o)
        .lines()
        .filter(|l| l.starts_with("kvbench-progress "))
        .map(String::from)
        .collect();
    assert_eq!(
        progress.first().map(String::as_str),
        Some("kvbench-progress tokens=0 total=76")
    );
    assert_eq!(
        progress.last().map(String::as_str),
        Some("kvbench-progress tokens=76 total=76")
    );
    // The sweep: stderr is not a terminal, so no bar and no progress line shows.
    let results = dir.path().join("results");
    let o = kvbench(
        dir.path(),
        &["run", path, "--results", results.to_str().unwrap()],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        !err.contains("kvbench-progress") && !err.contains("tokens"),
        "{err}"
    );
    let cells = common::recorded_cells(&results.join("capped"));
    assert_eq!(cells.len(), 2);
    let times = |v: &serde_json::Value| -> Vec<(f64, f64)> {
        let mut t: Vec<(f64, f64)> = v["requests"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r["arrival_s"].as_f64().unwrap(),
                    r["finished_s"].as_f64().unwrap(),
                )
            })
            .collect();
        t.sort_by(|a, b| a.0.total_cmp(&b.0));
        t
    };
    // Uncapped: all three at t = 0, and the key is the one recorded before the axis.
    assert_eq!(cells[0]["outcome"], "ok", "{}", cells[0]);
    assert!(times(&cells[0]).iter().all(|t| t.0 == 0.0));
    assert!(!cells[0]["key"]
        .as_str()
        .unwrap()
        .contains("max_concurrency"));
    assert!(cells[0]["cell"]["max_concurrency"].is_null());
    // One in flight: each request arrives when the previous one finishes, exactly.
    assert_eq!(cells[1]["outcome"], "ok", "{}", cells[1]);
    assert!(cells[1]["key"]
        .as_str()
        .unwrap()
        .contains(";max_concurrency=1;"));
    let t = times(&cells[1]);
    assert_eq!(t.len(), 3);
    assert_eq!(t[0].0, 0.0);
    assert_eq!(t[1].0, t[0].1, "{t:?}");
    assert_eq!(t[2].0, t[1].1, "{t:?}");
    // TTFT runs from that arrival: the mean is that of each first token less its own
    // arrival, not a wait that includes the requests before it.
    let ttft = cells[1]["metrics"]["ttft_s"]["mean"].as_f64().unwrap();
    let own: Vec<f64> = cells[1]["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["token_times_s"][0].as_f64().unwrap() - r["arrival_s"].as_f64().unwrap())
        .collect();
    let mean = own.iter().sum::<f64>() / own.len() as f64;
    assert!((ttft - mean).abs() < 1e-9, "{ttft} {own:?}");
    assert!(own.iter().all(|&x| x > 0.0), "{own:?}");
    // runs.parquet: the cap, null when uncapped.
    use polars::prelude::*;
    let f = std::fs::File::open(results.join("capped/runs.parquet")).unwrap();
    let runs = ParquetReader::new(f).finish().unwrap();
    let cap = runs.column("cell_max_concurrency").unwrap();
    assert_eq!(cap.get(0).unwrap(), AnyValue::Null);
    assert_eq!(cap.get(1).unwrap(), AnyValue::Int64(1));
}

#[test]
fn a_sweep_killed_in_the_middle_of_a_cell_resumes_without_loss_or_duplicates() {
    // Six cells of a fraction of a second each.
    let (dir, exp) = common::with_experiment(
        "k.yaml",
        "name: killed\nmodel: preset:tiny\ndtype: f32\ndevice:\n  memory: 1GiB\nengines:\n  - name: full\n  - name: h2o\nmatrix:\n  batch: [1, 2, 4]\n  prompt_len: [48]\n  output_len: [24]\n  budget: [0.5]\nworkload:\n  num_requests: 4\n",
    );
    let results = dir.path().join("results");
    let cells = results.join("killed/cells");
    let args = common::sweep_args(&exp, &results);
    let all_files = || -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(&cells)
            .map(|d| d.map(|e| e.unwrap().path()).collect())
            .unwrap_or_default();
        v.sort();
        v
    };
    let recorded = || -> Vec<PathBuf> {
        all_files()
            .into_iter()
            .filter(|p| common::is_cell_gz(p))
            .collect()
    };
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvbench"))
        .args(args)
        .env("KVBENCH_MODELS_DIR", dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Kill the sweep once a cell is recorded, while the next one runs.
    let start = std::time::Instant::now();
    while recorded().is_empty() && start.elapsed().as_secs() < 120 {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let before = recorded();
    assert!(!before.is_empty() && before.len() < 6, "{before:?}");
    let kept: Vec<Vec<u8>> = before.iter().map(|p| std::fs::read(p).unwrap()).collect();

    let o = kvbench(dir.path(), &args);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8(o.stdout).unwrap();
    let expect = format!(
        "{} cells run, {} already recorded",
        6 - before.len(),
        before.len()
    );
    assert!(out.contains(&expect), "{out}");
    // Every cell once, the ones recorded before the kill untouched, nothing half-written.
    let after = all_files();
    assert_eq!(after.len(), 6, "{after:?}");
    assert!(after.iter().all(|p| common::is_cell_gz(p)), "{after:?}");
    for (p, bytes) in before.iter().zip(&kept) {
        assert_eq!(&std::fs::read(p).unwrap(), bytes, "{} changed", p.display());
    }
    let mut keys: Vec<String> = after
        .iter()
        .map(|p| {
            let v = kvbench::cell_file::read(p).unwrap();
            assert_eq!(v["outcome"], "ok", "{v}");
            v["key"].as_str().unwrap().to_string()
        })
        .collect();
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), 6);
}

#[test]
fn slos_from_the_yaml_or_the_flag_give_goodput_and_per_objective_fractions() {
    let (dir, exp) = common::with_experiment(
        "s.yaml",
        "name: slo\nmodel: preset:tiny\ndtype: f32\ndevice:\n  memory: 1GiB\nengines:\n  - name: full\nmatrix:\n  batch: [2]\n  prompt_len: [16]\n  output_len: [3]\n  request_rate: [40]\nworkload:\n  num_requests: 3\nslo:\n  ttft_ms: 600000\n  e2e_ms: 600000\n",
    );
    let results = dir.path().join("results");
    let run = |extra: &[&str]| sweep_ok(dir.path(), &exp, &results, extra);
    use polars::prelude::*;
    let runs = || {
        let f = std::fs::File::open(results.join("slo/runs.parquet")).unwrap();
        ParquetReader::new(f).finish().unwrap()
    };
    let get = |df: &DataFrame, c: &str| -> Option<f64> {
        let col = df
            .column(c)
            .unwrap_or_else(|_| panic!("runs.parquet lacks {c}"));
        col.cast(&DataType::Float64).unwrap().f64().unwrap().get(0)
    };
    // The YAML's objectives, ten minutes each: every request meets them.
    let out = run(&[]);
    assert!(out.contains("1 cells run, 0 already recorded"), "{out}");
    let df = runs();
    assert_eq!(get(&df, "slo_ttft_ms"), Some(600000.0));
    assert_eq!(get(&df, "slo_tpot_ms"), None);
    assert_eq!(get(&df, "slo_e2e_ms"), Some(600000.0));
    assert_eq!(get(&df, "slo_ttft_frac"), Some(1.0));
    assert_eq!(get(&df, "slo_tpot_frac"), None, "no TPOT objective: null");
    assert_eq!(get(&df, "slo_e2e_frac"), Some(1.0));
    let goodput = get(&df, "goodput_req_s").unwrap();
    let duration = get(&df, "duration_s").unwrap();
    assert!(
        (goodput * duration - 3.0).abs() < 1e-9,
        "{goodput} × {duration}"
    );
    assert_eq!(get(&df, "metrics_request_throughput"), Some(goodput));
    // At 40 requests/s the last of 3 arrives at 3/40 s after the start, which the
    // duration counts.
    assert!(duration > 3.0 / 40.0, "{duration}");
    assert!(get(&df, "peak_concurrency").unwrap() >= 1.0);
    assert!(get(&df, "peak_output_tok_s").unwrap() >= 1.0);
    assert!(get(&df, "metrics_e2e_s_std").unwrap() >= 0.0);
    // --slo replaces them (a TPOT no step can meet), runs the cell again under its
    // own identity and keeps the YAML's result.
    let out = run(&["--slo", "tpot:0.000001,e2el:600000"]);
    assert!(out.contains("1 cells run, 0 already recorded"), "{out}");
    let df = runs();
    assert_eq!(get(&df, "slo_ttft_ms"), None);
    assert_eq!(get(&df, "slo_tpot_ms"), Some(0.000001));
    assert_eq!(get(&df, "slo_tpot_frac"), Some(0.0));
    assert_eq!(get(&df, "slo_e2e_frac"), Some(1.0));
    assert_eq!(
        get(&df, "goodput_req_s"),
        Some(0.0),
        "measured: none was good"
    );
    assert_eq!(
        std::fs::read_dir(results.join("slo/cells"))
            .unwrap()
            .count(),
        2
    );
    let out = run(&["--slo", "tpot:0.000001,e2e:600000"]);
    assert!(out.contains("0 cells run, 1 already recorded"), "{out}");
    // A bad flag is refused before anything runs.
    let mut args = common::sweep_args(&exp, &results).to_vec();
    args.extend(["--slo", "ttft:-3"]);
    let o = kvbench(dir.path(), &args);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("expected a positive number"),
        "{}",
        stderr(&o)
    );
}

/// `--version` names the build every cell records, so a binary that travelled can be
/// matched with the cells it wrote.
#[test]
fn version_names_the_build_cells_record() {
    let dir = tempfile::tempdir().unwrap();
    let o = kvbench(dir.path(), &["--version"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let want = format!("(build {})", kvbench::environment::BUILD_ID);
    assert!(out.contains(&want), "{out}");
}

/// A broken weights file is its row's problem in `models`; verify's flags are checked
/// before a model loads; a dry run of an accuracy plan says when its data is missing
/// (and still lists the plan).
#[test]
fn broken_weights_bad_verify_flags_and_missing_data_are_named() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("SmolLM2-135M-Instruct.Q4_1.gguf"),
        b"GGUF truncated",
    )
    .unwrap();
    let o = kvbench(dir.path(), &["models"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("is not readable") && out.contains("preset:tiny"),
        "{out}"
    );

    for (flag, v) in [
        ("--tolerance", "-1"),
        ("--tolerance", "inf"),
        ("--steps", "0"),
    ] {
        let o = kvbench(dir.path(), &["verify", "--model", "preset:tiny", flag, v]);
        assert!(!o.status.success());
        assert!(
            stderr(&o).contains(&format!("{flag} {v}")),
            "{flag} {v}: {}",
            stderr(&o)
        );
    }

    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let exp = root.join("experiments/cpu/accuracy.yaml");
    let missing = dir.path().join("no-data");
    let o = kvbench(
        &repo_models(),
        &[
            "run",
            exp.to_str().unwrap(),
            "--dry-run",
            "--data-dir",
            missing.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("would stop before its first cell") && stderr(&o).contains("no-data"),
        "{}",
        stderr(&o)
    );
}
