//! An accuracy experiment end to end on preset:tiny with the task files of the committed
//! fixtures: the sweep writes accuracy.parquet (per item and per task) and runs.parquet,
//! fig7 is drawn from it, the report judges C10 from it; a missing data directory is an
//! error that names the missing file and how to fetch the data.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

const EXPERIMENT: &str = "\
name: acc-e2e
kind: accuracy
model: preset:tiny
dtype: f32
device: {name: cpu, memory: 1GiB}
engines:
  - name: full
  - name: h2o
  - name: infinigen
  - name: streaming
accuracy:
  tasks: [copa, hellaswag]
  limit: 3
  budgets: [0.5, 0.02]
  modes: [decode]
  batch: 4
";

/// The committed fixtures: the first 40 items of each task.
fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../datasets/fixtures")
}

fn kvbench(args: &[&str], cwd: &Path) -> Output {
    common::kvbench_in(cwd, args)
        .env("KVBENCH_MODELS_DIR", cwd.join("models"))
        .env_remove("KVBENCH_DATASETS_DIR")
        .output()
        .expect("running kvbench")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn an_accuracy_sweep_writes_its_tables_figure_and_verdict() {
    let (dir, yaml) = common::with_experiment("acc.yaml", EXPERIMENT);
    let data = data_dir();
    let data = data.to_str().unwrap();
    let run = kvbench(
        &["run", yaml.to_str().unwrap(), "--data-dir", data],
        dir.path(),
    );
    assert!(run.status.success(), "{}", text(&run));
    let out = text(&run);
    // full once, three strategies at two budgets, two tasks: 14 cells.
    assert!(out.contains("14 cells run"), "{out}");
    assert!(!out.contains(" error "), "{out}");
    let exp = dir.path().join("results/acc-e2e");
    let acc = exp.join("accuracy.parquet");
    assert!(acc.is_file() && exp.join("runs.parquet").is_file());

    // A re-run skips what is recorded.
    let again = kvbench(
        &["run", yaml.to_str().unwrap(), "--data-dir", data],
        dir.path(),
    );
    assert!(
        text(&again).contains("0 cells run, 14 already recorded"),
        "{}",
        text(&again)
    );

    let plot = kvbench(&["plot", "acc-e2e", "--figures", "fig7"], dir.path());
    let out = text(&plot);
    assert!(plot.status.success(), "{out}");
    assert!(out.contains("fig7: wrote"), "{out}");
    assert!(exp.join("figures/fig7.png").is_file());

    let report = kvbench(&["report", "acc-e2e"], dir.path());
    assert!(report.status.success(), "{}", text(&report));
    let md = std::fs::read_to_string(exp.join("report.md")).unwrap();
    // Each cell's row names its task and scoring mode.
    assert!(md.contains("| engine | task / bucket |"), "{md}");
    assert!(
        md.contains(" (one_pass) |") || md.contains(" (decode) |"),
        "{md}"
    );
    let c10 = md
        .lines()
        .skip_while(|l| !l.contains("C10"))
        .take(3)
        .collect::<Vec<_>>()
        .join(" ");
    assert!(!c10.is_empty(), "{md}");
    assert!(
        !c10.contains("needs accuracy") && c10.contains("full: "),
        "C10 is judged from accuracy.parquet: {c10}"
    );
}

#[test]
fn a_missing_data_directory_is_named() {
    let (dir, yaml) = common::with_experiment("acc.yaml", EXPERIMENT);
    let missing = dir.path().join("no-data");
    let run = kvbench(
        &[
            "run",
            yaml.to_str().unwrap(),
            "--data-dir",
            missing.to_str().unwrap(),
        ],
        dir.path(),
    );
    assert!(!run.status.success());
    let out = text(&run);
    assert!(
        out.contains(&format!(
            "{} not found",
            missing.join("copa/val.jsonl").display()
        )) && out.contains("just fetch-data"),
        "{out}"
    );
    // Without --data-dir, KVBENCH_DATASETS_DIR or the YAML's data_dir: data/ in the
    // working directory, never a directory outside it.
    let run = kvbench(&["run", yaml.to_str().unwrap()], dir.path());
    assert!(!run.status.success());
    let out = text(&run);
    assert!(
        out.contains("./data/copa/val.jsonl not found") && out.contains("just fetch-data"),
        "{out}"
    );
    assert!(
        !dir.path().join("results/acc-e2e/cells").exists(),
        "no cell ran"
    );
}
