//! `kvbench report` end to end: a small real batch sweep on preset:tiny with the three
//! strategies of the study, its figures, then report.md and report.html.

mod common;

use std::path::Path;

const EXPERIMENT: &str = "\
name: report-e2e
model: preset:tiny
dtype: f32
seed: 0
device: {name: cpu, memory: 512MiB}
engines:
  - name: full
  - name: h2o
  - name: infinigen
    params: {dense_layers: 1}
matrix:
  batch: [1, 2]
  prompt_len: [64]
  output_len: [8]
  budget: [0.3]
workload:
  num_requests: 2
repeats: 1
";

fn kvbench(args: &[&str], cwd: &Path) -> std::process::Output {
    common::kvbench_in(cwd, args)
        .env("KVBENCH_MODELS_DIR", cwd)
        .output()
        .expect("running kvbench")
}

#[test]
fn the_report_lists_every_figure_and_judges_the_claims_the_data_can_speak_to() {
    let (dir, _) = common::with_experiment("e.yaml", EXPERIMENT);
    let d = dir.path();
    common::run_each(
        &[
            &["run", "e.yaml"],
            &["plot", "results/report-e2e"],
            &["report", "results/report-e2e"],
        ],
        |args| kvbench(args, d),
    );
    let exp = d.join("results/report-e2e");
    let md = std::fs::read_to_string(exp.join("report.md")).unwrap();
    let html = std::fs::read_to_string(exp.join("report.html")).unwrap();
    let figures: Vec<String> = std::fs::read_dir(exp.join("figures"))
        .unwrap()
        .filter_map(|e| {
            let p = e.unwrap().path();
            (p.extension()? == "png").then(|| p.file_name().unwrap().to_string_lossy().into())
        })
        .collect();
    assert!(figures.len() >= 6, "{figures:?}");
    for f in &figures {
        assert!(
            md.contains(&format!("(figures/{f})")),
            "report.md lacks {f}"
        );
    }
    // Every figure inline in the HTML, nothing linked outside it.
    assert_eq!(
        html.matches("src=\"data:image/png;base64,").count(),
        figures.len()
    );
    assert!(!html.contains("src=\"figures/"));
    // Every claim is listed with a verdict; a batch grid speaks to C5–C8, nothing here
    // to tensor parallelism or accuracy.
    let verdict = |id: &str| -> String {
        let line = md
            .lines()
            .skip_while(|l| !l.starts_with(&format!("- **{id}**")))
            .nth(1)
            .unwrap_or_else(|| panic!("{id} missing"));
        line.trim()
            .trim_start_matches('*')
            .split("*:")
            .next()
            .unwrap()
            .to_string()
    };
    for id in ["C5", "C6", "C7", "C8"] {
        let v = verdict(id);
        assert!(v == "agrees" || v == "disagrees", "{id}: {v}");
    }
    for id in ["C1", "C2", "C3", "C4", "C9", "C10", "C11"] {
        assert_eq!(verdict(id), "cannot tell", "{id}");
    }
    // The cells table has one row per cell, with the engines of the sweep.
    assert_eq!(md.lines().filter(|l| l.starts_with("| full ")).count(), 2);
    assert!(md.contains("| infinigen dense_layers=1 |"), "{md}");
    // A directory without results is named.
    let o = kvbench(&["report", "results/none"], d);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("results/none"));

    // Tables that are not what their names say are named, not reported or drawn.
    let fails = |args: &[&str], what: &str| {
        let o = kvbench(args, d);
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(!o.status.success() && err.contains(what), "{args:?}: {err}");
    };
    std::fs::write(exp.join("accuracy.parquet"), b"PAR1 not a table").unwrap();
    fails(&["report", "results/report-e2e"], "accuracy.parquet");
    std::fs::remove_file(exp.join("accuracy.parquet")).unwrap();
    std::fs::copy(exp.join("steps.parquet"), exp.join("runs.parquet")).unwrap();
    fails(
        &["report", "results/report-e2e"],
        "not an experiment's runs table",
    );
    fails(
        &["plot", "results/report-e2e"],
        "not an experiment's runs table",
    );
}

#[test]
fn one_report_over_several_experiments_takes_each_claim_from_the_one_with_its_data() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let out = tempfile::tempdir().unwrap();
    let o = out.path().join("combined");
    let dirs = [
        "results/baselines/h100/gpu-ttft",
        "results/baselines/cpu/cpu-accuracy",
    ];
    let mut args = vec!["report"];
    args.extend(dirs);
    // Several directories need a place for the combined report.
    let no_out = kvbench(&args, repo);
    assert!(!no_out.status.success());
    assert!(String::from_utf8_lossy(&no_out.stderr).contains("give --out DIR"));
    args.extend(["--out", o.to_str().unwrap()]);
    let r = kvbench(&args, repo);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let md = std::fs::read_to_string(o.join("report.md")).unwrap();
    assert!(md.starts_with("# kvbench report: gpu-ttft + cpu-accuracy"));
    for name in ["gpu-ttft", "cpu-accuracy"] {
        assert!(md.contains(&format!("## Experiment {name}")), "{name}");
    }
    let claim = |id: &str| {
        let at = md.find(&format!("- **{id}**")).unwrap();
        md[at..].lines().nth(1).unwrap_or_default().to_string()
    };
    // C1 from the TTFT grid, C10 from the accuracy runs, C2 from neither.
    assert!(claim("C1").contains("(from gpu-ttft)"), "{}", claim("C1"));
    assert!(
        claim("C10").contains("(from cpu-accuracy)"),
        "{}",
        claim("C10")
    );
    assert!(claim("C2").contains("*cannot tell*"), "{}", claim("C2"));
    // The figures are linked from where the report is.
    assert!(md.contains("gpu-ttft/figures/fig1.png"));
    assert!(o.join("report.html").is_file());
}
