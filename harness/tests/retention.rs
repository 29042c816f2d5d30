//! A retention sweep end to end on `preset:tiny`: cells per engine × budget × bucket,
//! one accuracy row per prompt, accuracy.parquet, fig8 and the report's C11 line.

mod common;

use std::path::{Path, PathBuf};

const EXPERIMENT: &str = "\
name: retention-e2e
kind: retention
model: preset:tiny
dtype: f32
seed: 0
device: {name: cpu, memory: 512MiB}
engines:
  - name: full
  - name: h2o
  - name: infinigen
    params: {dense_layers: 1}
retention:
  form: passkey
  buckets: [256-512, 512-1K]
  turns: [1]
  facts: 20
  limit: 2
  budgets: [0.3]
  batch: 2
repeats: 1
";

/// The committed fixtures (the passkey prose is a slice of the book).
fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../datasets/fixtures")
}

fn kvbench(args: &[&str], cwd: &Path) -> std::process::Output {
    common::kvbench_in(cwd, args)
        // An empty models directory: the preset gets the byte-level tokenizer.
        .env("KVBENCH_MODELS_DIR", cwd)
        .env("KVBENCH_DATASETS_DIR", data_dir())
        .output()
        .expect("running kvbench")
}

#[test]
fn a_retention_sweep_records_a_row_per_prompt_and_feeds_fig8_and_c11() {
    let (dir, _) = common::with_experiment("e.yaml", EXPERIMENT);
    let d = dir.path();
    common::run_each(
        &[
            &["run", "e.yaml"],
            &["plot", "results/retention-e2e", "--figures", "fig8"],
            &["report", "results/retention-e2e"],
        ],
        |args| kvbench(args, d),
    );
    let exp = d.join("results/retention-e2e");
    // full once, h2o and infinigen at 0.3; two buckets each.
    let cells = common::recorded_cells(&exp);
    assert_eq!(cells.len(), 6);
    for c in &cells {
        assert_eq!(c["outcome"], "ok", "{}", c["error"]);
        let rows = c["accuracy_rows"].as_array().unwrap();
        assert_eq!(rows.len(), 2, "limit 2 per bucket");
        let bucket = c["cell"]["bucket"].as_str().unwrap();
        let (lo, hi) = if bucket == "256-512" {
            (256, 512)
        } else {
            (512, 1024)
        };
        for r in rows {
            assert_eq!(r["task"], "retention");
            assert_eq!(r["form"], "passkey");
            assert_eq!(r["engine"], c["cell"]["engine"]);
            assert_eq!(r["budget"], c["cell"]["budget"]);
            assert_eq!(r["bucket"], bucket);
            assert_eq!(r["turn"], 1);
            let n = r["context_tokens"].as_u64().unwrap();
            assert!(lo <= n && n < hi, "{n} tokens in {bucket}");
            assert!(r["correct"].is_boolean());
        }
        assert_eq!(c["accuracy"]["prompts"], 2);
    }
    assert!(exp.join("accuracy.parquet").is_file());
    assert!(exp.join("figures/fig8.png").is_file());
    let md = std::fs::read_to_string(exp.join("report.md")).unwrap();
    assert!(md.contains("| engine | task / bucket |"), "{md}");
    let c11 = md
        .lines()
        .skip_while(|l| !l.contains("**C11**"))
        .nth(1)
        .unwrap();
    // Random weights recall nothing: the report says why it cannot judge.
    assert!(
        c11.contains("retention full") && c11.contains("cannot do this form"),
        "{c11}"
    );
}
