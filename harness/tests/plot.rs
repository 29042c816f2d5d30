//! `kvbench plot` end to end: a small real sweep on preset:tiny (two engines, two
//! prompt lengths, eager and flash attention, one eager cell out of memory), then
//! every figure as PNG and SVG, what was written and skipped on stdout, and errors
//! that name the path.

mod common;

use std::path::Path;

const EXPERIMENT: &str = "\
name: plot-e2e
model: preset:tiny
dtype: f32
seed: 0
device: {name: cpu, memory: 256MiB}
engines:
  - name: full
  - name: streaming
matrix:
  batch: [1, 2]
  prompt_len: [64, 2048]
  output_len: [4]
  budget: [0.3]
  attention: [eager, flash]
workload:
  num_requests: 2
scheduler: {prefill: sequential, max_batched_tokens: 4096}
repeats: 1
";

fn kvbench(args: &[&str], cwd: &Path) -> std::process::Output {
    common::kvbench_in(cwd, args)
        .output()
        .expect("running kvbench")
}

/// Width and height from a PNG's IHDR chunk.
fn png_size(path: &Path) -> (u32, u32) {
    let b = std::fs::read(path).unwrap();
    assert_eq!(
        &b[..8],
        b"\x89PNG\r\n\x1a\n",
        "{} is not a PNG",
        path.display()
    );
    let be = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    (be(16), be(20))
}

#[test]
fn plot_draws_every_figure_of_a_real_run() {
    let (dir, yaml) = common::with_experiment("plot-e2e.yaml", EXPERIMENT);
    let run = kvbench(
        &["run", yaml.to_str().unwrap(), "--results", "results"],
        dir.path(),
    );
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let exp = dir.path().join("results/plot-e2e");
    assert!(exp.join("runs.parquet").is_file());

    // By name under ./results/, as `just figures NAME` passes it.
    let out = kvbench(&["plot", "plot-e2e"], dir.path());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for n in 1..=8 {
        let png = exp.join(format!("figures/fig{n}.png"));
        let svg = exp.join(format!("figures/fig{n}.svg"));
        assert_eq!(png_size(&png), (1600, 1000), "fig{n}");
        let text = std::fs::read_to_string(&svg).unwrap();
        assert!(text.starts_with("<svg") && text.contains("Fig. "), "fig{n}");
        // The title names the model (from the experiment's YAML), the device and the
        // experiment.
        assert!(
            text.contains("preset:tiny") && text.contains("plot-e2e"),
            "fig{n}"
        );
    }
    for n in 1..=6 {
        assert!(stdout.contains(&format!("fig{n}: wrote")), "{stdout}");
    }
    assert!(stdout.contains("fig7: skipped, no data"), "{stdout}");
    assert!(stdout.contains("accuracy.parquet"), "{stdout}");
    assert!(
        stdout.contains("full · eager at 2048"),
        "the OOM cell is named: {stdout}"
    );
    assert!(stdout.contains("8 figure(s)"), "{stdout}");

    // A chosen subset, into another directory.
    let out = kvbench(
        &[
            "plot",
            exp.to_str().unwrap(),
            "--figures",
            "fig1,3",
            "--out",
            "some/where",
        ],
        dir.path(),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(dir.path().join("some/where/fig1.png").is_file());
    assert!(dir.path().join("some/where/fig3.svg").is_file());
    assert!(!dir.path().join("some/where/fig2.png").exists());

    // Errors name the path or the figure and what was expected.
    let bad = kvbench(&["plot", "results/nope"], dir.path());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success());
    assert!(
        err.contains("results/nope") && err.contains("runs.parquet"),
        "{err}"
    );
    let bad = kvbench(
        &["plot", exp.to_str().unwrap(), "--figures", "fig9"],
        dir.path(),
    );
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success());
    assert!(err.contains("fig9") && err.contains("fig1 … fig8"), "{err}");
}
