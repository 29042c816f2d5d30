//! The cost model against measurements it was not fitted on: a calibration fitted to
//! the steps of the committed CPU batch-scaling baseline predicts the committed CPU
//! output-scaling baseline (other prompts, outputs and batch), cell by cell, within
//! the bounds docs/cost-model.md states. Calls the library directly.

use kvbench::commands::calibrate::load_ceilings;
use kvbench::prediction::{
    calibrate, metric_errors, outcome_mismatches, predict_cell, validate, CellCheck, Measured,
    MetricError, Target,
};
use kvbench_engines::cost::{Calibration, Device, DeviceTable, Efficiency, Term};
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the harness lives in the workspace")
        .to_path_buf()
}

/// `device` with the rates measured on its card (a ceilings file under the repository).
fn with_ceilings(device: &Device, file: &str) -> Device {
    let c = load_ceilings(&repo().join(file)).unwrap_or_else(|e| panic!("{file}: {e:#}"));
    device.with_ceilings(&c, file)
}

/// The held-out error of `metric` over `checks`.
fn metric_error(checks: &[CellCheck], metric: &str) -> MetricError {
    metric_errors(checks)
        .unwrap()
        .into_iter()
        .find(|e| e.metric == metric)
        .unwrap_or_else(|| panic!("no error for {metric}"))
}

/// A committed baseline of `card` (cpu, h100, h200): results/baselines/<card>/<name>.
/// Asserts that `cal` is the calibration committed at `committed` (`just validate-cost`
/// rewrites both), and returns the target that predicts with it on `device`.
fn committed_target(cal: &Calibration, committed: &str, device: Device) -> Target {
    let file = repo().join(committed);
    assert_eq!(&Calibration::load(&file).unwrap(), cal, "{committed}");
    Target {
        device,
        efficiency: cal.efficiency(),
        tensor_parallel: 1,
    }
}

fn measured(card: &str, name: &str) -> Measured {
    let dir = repo().join("results/baselines").join(card).join(name);
    Measured::load(&dir, &repo().join("models")).unwrap_or_else(|e| panic!("{name}: {e:#}"))
}

fn baseline(name: &str) -> Measured {
    measured("cpu", name)
}

/// The device table's `name` with the rates measured on `card`, as `just validate-cost`
/// fits it.
fn card_device(name: &str, card: &str) -> Device {
    let d = DeviceTable::builtin().unwrap().get(name).unwrap().clone();
    with_ceilings(&d, &format!("results/baselines/{card}/ceilings.json"))
}

/// Bounds on the median |error| over the held-out cells of each experiment
/// (docs/cost-model.md, "Validation"). The model's goal is 15 %; these hold it to 8 %,
/// a little above what it is now (2.7 % and 4.1 % on cpu-output-scaling's TTFT and
/// decode throughput, 3.7 % and 1.1 % on cpu-quickstart's), so that a change to the
/// model that loses accuracy fails here first.
const BOUNDS: [(&str, &str, f64); 4] = [
    ("cpu-output-scaling", "ttft_mean_s", 0.08),
    ("cpu-output-scaling", "decode_tok_s", 0.08),
    ("cpu-quickstart", "ttft_mean_s", 0.08),
    ("cpu-quickstart", "decode_tok_s", 0.08),
];

#[test]
fn a_cpu_calibration_predicts_a_held_out_cpu_experiment() {
    let cpu = DeviceTable::builtin().unwrap().get("cpu").unwrap().clone();
    let (cal, obs) = calibrate(&[baseline("cpu-batch-scaling")], &cpu, &[], None).unwrap();
    // The simulation schedules every measured step as the engine did.
    assert!(obs.aligned > 1000, "{} steps paired", obs.aligned);
    assert_eq!(obs.dropped, 0, "the schedule diverged");
    assert!(cal.decode.fit.r_squared > 0.5, "{:?}", cal.decode.fit);
    let target = committed_target(&cal, "results/baselines/cpu/calibration-cpu.yaml", cpu);
    for held in ["cpu-output-scaling", "cpu-quickstart"] {
        let held_out = baseline(held);
        let checks = validate(&held_out, &target).unwrap();
        assert_eq!(checks.len(), held_out.plan.cells.len());
        assert!(outcome_mismatches(&checks).is_empty(), "{held}");
        let errors = metric_errors(&checks).unwrap();
        for (_, metric, bound) in BOUNDS.iter().filter(|b| b.0 == held) {
            let e = errors
                .iter()
                .find(|e| e.metric == *metric)
                .unwrap_or_else(|| panic!("{held}: no {metric} compared"));
            assert_eq!(e.cells, checks.len(), "{held} {metric}");
            assert!(
                e.median_abs_rel <= *bound,
                "{held} {metric}: median |error| {:.1} % over {} cells",
                e.median_abs_rel * 100.0,
                e.cells
            );
        }
    }
}

#[test]
fn a_prediction_is_recorded_as_a_measured_cell_is_with_memory_and_outcome() {
    let m = baseline("cpu-output-scaling");
    let h100 = DeviceTable::builtin()
        .unwrap()
        .get("h100-sxm")
        .unwrap()
        .clone();
    let target = Target {
        efficiency: Efficiency::peak(&h100).unwrap(),
        device: h100,
        tensor_parallel: 1,
    };
    let cell = &m.plan.cells[0];
    let r = predict_cell(&m.plan, cell, &m.cfg, &target).unwrap();
    assert!(r.predicted);
    let metrics = r.metrics.as_ref().expect("an ok cell has metrics");
    assert_eq!(metrics.num_requests, 1);
    assert_eq!(metrics.output_tokens, cell.output_len.unwrap());
    assert!(
        metrics.breakdown.is_none(),
        "the model has no walltime breakdown"
    );
    let mem = r.memory.expect("memory by component");
    assert!(mem.weights > 0 && mem.kv_device > 0);

    // The same cell on a device too small for the weights is an OOM, not a time.
    let mut small = target.device.clone();
    small.measured_memory_bytes = Some(mem.weights / 2);
    let t = Target {
        device: small,
        ..target
    };
    let r = predict_cell(&m.plan, cell, &m.cfg, &t).unwrap();
    assert_eq!(
        serde_json::to_value(r.outcome).unwrap(),
        serde_json::json!("oom")
    );
    assert!(r.metrics.is_none());
    assert!(r.error.unwrap().contains("weights needs"));
}

#[test]
fn recommend_ranks_what_runs_before_what_does_not_and_explains_each() {
    // Llama-3.1-8B on the H100, ranked as JSON, for a workload and options.
    let recommend = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_kvbench"))
            .current_dir(repo())
            .args([
                "recommend",
                "--model",
                "preset:llama-3.1-8b",
                "--device",
                "h100-sxm",
                "--json",
            ])
            .args(args)
            .output()
            .unwrap()
    };
    let out = recommend(&[
        "--prompt-len",
        "1K-10K",
        "--output-len",
        "64",
        "--batch",
        "32",
        "--slo",
        "tpot=100ms",
        "--max-device-memory",
        "30GB",
        "--calibration",
        "results/baselines/h100/calibration-h100-sxm.yaml",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    // 4 engines: full once, three others at 4 budgets; chunked and sequential prefill.
    assert_eq!(rows.len(), 2 * (1 + 3 * 4));
    let ok: Vec<bool> = rows.iter().map(|r| r["outcome"] == "ok").collect();
    assert!(ok[0], "the first configuration runs");
    assert!(
        ok.windows(2).all(|w| w[0] || !w[1]),
        "a configuration that runs is never ranked after one that does not: {ok:?}"
    );
    // 30 GB leaves `full` a pool smaller than one 131K-token sequence (17.2 GB).
    for r in rows.iter().filter(|r| r["engine"] == "full") {
        assert_eq!(r["outcome"], "oom", "{r}");
    }
    for (i, r) in rows.iter().enumerate() {
        assert_eq!(r["rank"], i + 1);
        assert!(!r["why"].as_str().unwrap().is_empty(), "{r}");
        if r["outcome"] == "ok" {
            let tpot = r["tpot_mean_s"].as_f64().unwrap();
            assert!(tpot.is_finite() && tpot > 0.0);
            assert!(r["slo_met"].is_boolean());
        }
    }

    // An accuracy limit: a configuration past it says why, and accuracy measured on
    // another model is said to be.
    let out = recommend(&[
        "--prompt-len",
        "1K",
        "--output-len",
        "8",
        "--batch",
        "1",
        "--accuracy",
        "results/baselines/cpu/cpu-accuracy",
        "--max-accuracy-drop",
        "1",
    ]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("was measured on smollm2-135m-instruct"));
    let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    let past: Vec<&serde_json::Value> = rows
        .iter()
        .filter(|r| r["accuracy_drop_pp"].as_f64().is_some_and(|d| -d > 1.0))
        .collect();
    assert!(!past.is_empty());
    for r in past {
        assert!(
            r["why"]
                .as_str()
                .unwrap()
                .contains("past --max-accuracy-drop 1"),
            "{r}"
        );
    }
}

#[test]
fn the_h100_calibration_predicts_the_ttft_grid_it_was_not_fitted_on() {
    // Copies of the experiments' tables as the first builds left them (the study's
    // sweeps run them again on its build).
    let dir = |name: &str| measured("h100", &format!("calibration-cells/first-builds/{name}"));
    // Only h2o's cells: `full`'s were recorded before the engine synchronized the GPU
    // after each forward (results/baselines/h100/NOTES.md).
    // With the card's measured rates as its peaks, as `just validate-cost` fits it.
    let h100 = card_device("h100-sxm", "h100");
    let (mut cal, obs) =
        calibrate(&[dir("gpu-batch-scaling")], &h100, &["h2o".into()], None).unwrap();
    assert_eq!(obs.dropped, 0);
    cal.ceilings = Some("results/baselines/h100/ceilings.json".into());
    let target = committed_target(
        &cal,
        "results/baselines/h100/calibration-h100-sxm-first-build.yaml",
        h100,
    );
    let checks = validate(&dir("gpu-ttft"), &target).unwrap();
    assert_eq!(checks.len(), 36);
    // Every measured ok / oom outcome on the right side, eager and chunked included.
    assert!(outcome_mismatches(&checks).is_empty());
    // Flash, the attention of the fitted runs: 1K–131K-token prompts from a fit on
    // 1K–10K, median 3.9 % when this was written.
    let flash: Vec<_> = checks
        .iter()
        .filter(|c| c.attention == "flash")
        .cloned()
        .collect();
    let ttft = metric_error(&flash, "ttft_mean_s");
    assert_eq!(ttft.cells, 12);
    assert!(ttft.median_abs_rel <= 0.05, "{ttft:?}");
}

/// The H100's committed calibration describes the engine of the fourth lease
/// (FlashAttention-2 prefill, the vector paged decode, one build): fitted on the
/// paradigms' `full` and `h2o` cells and the 16K/32K prefill cells, with H2O's
/// statistics pass at a rate of its own (its kernel is not FlashAttention-2's), it
/// predicts InfiniGen's TTFT at batch 16 and 32 (held out, recorded by later builds)
/// within 10 % and the same build's `full` decode after a 1K prompt (another
/// experiment) within 20 % (5.4 % and 14.6 % medians when this was written). With
/// the statistics at the attention rate the same fit missed the paradigms' TTFT by a
/// median 10.4 % and the fused forms' 1K prompts' by 53 %.
#[test]
fn the_h100_calibration_of_the_current_engine_times_the_statistics_pass_apart() {
    let h100 = card_device("h100-sxm", "h100");
    let dir = |name: &str| measured("h100", name);
    // Copies of the fitted experiments as that build left them (the study's sweep
    // reruns gpu-paradigms on its own build).
    let fitted = [
        dir("calibration-cells/d4a05e2f/gpu-paradigms"),
        dir("calibration-cells/d4a05e2f/gpu-prefill-kernel"),
    ];
    let full_h2o = ["full".to_string(), "h2o".to_string()];
    let (mut cal, obs) = calibrate(&fitted, &h100, &full_h2o, None).unwrap();
    cal.ceilings = Some("results/baselines/h100/ceilings.json".into());
    assert!(obs.left_out.is_empty(), "{:?}", obs.left_out);
    // The engine whose times these are, named wherever the calibration is used.
    assert_eq!(cal.builds, ["d4a05e2f6e7fa8bf"]);
    assert!(cal
        .efficiency()
        .source
        .ends_with("gpu-paradigms, gpu-prefill-kernel (build d4a05e2f6e7fa8bf)"));
    // The statistics pass has its own rate, below attention's.
    let pre = &cal.prefill.fit.efficiency;
    let (att, stats) = (pre.attention_flops.unwrap(), pre.statistics_flops.unwrap());
    assert!(stats < att / 2.0, "{pre:?}");
    assert_eq!(cal.decode.fit.efficiency.statistics_flops, None);
    let target = committed_target(
        &cal,
        "results/baselines/h100/calibration-h100-sxm.yaml",
        h100,
    );
    let checks = validate(&fitted[0], &target).unwrap();
    let ig: Vec<_> = checks
        .into_iter()
        .filter(|c| c.key.starts_with("engine=infinigen;params=;"))
        .collect();
    assert_eq!(ig.len(), 2);
    let ttft = metric_error(&ig, "ttft_mean_s");
    assert!(ttft.median_abs_rel <= 0.10, "{ttft:?}");
    let fused = validate(&dir("fused-projections/on/gpu-fused-projections"), &target).unwrap();
    assert!(outcome_mismatches(&fused).is_empty());
    let decode = metric_error(&fused, "decode_tok_s");
    assert_eq!(decode.cells, 2);
    assert!(decode.median_abs_rel <= 0.20, "{decode:?}");
}

#[test]
fn predict_records_a_results_directory_that_plot_overlays_on_the_measured_one() {
    let tmp = tempfile::tempdir().unwrap();
    let kvbench = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvbench"))
            .current_dir(repo())
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let results = tmp.path().to_str().unwrap();
    let said = kvbench(&[
        "predict",
        "results/baselines/cpu/cpu-output-scaling/experiment.yaml",
        "--device",
        "cpu",
        "--calibration",
        "results/baselines/cpu/calibration-cpu.yaml",
        "--results",
        results,
    ]);
    assert!(said.contains("9 cells predicted for cpu (9 ok"), "{said}");
    let dir = tmp.path().join("cpu-output-scaling-predicted-cpu");
    let runs = kvbench_plots::schema::read_table(&dir.join("runs.parquet")).unwrap();
    let predicted = runs.column("predicted").unwrap().bool().unwrap();
    assert!(predicted.iter().all(|p| p == Some(true)));
    // The walltime breakdown is not modelled: null, never zero.
    let prefill = runs.column("wall_prefill_s").unwrap();
    assert_eq!(prefill.null_count(), runs.height());
    let figs = tmp.path().join("figs");
    kvbench(&[
        "plot",
        "results/baselines/cpu/cpu-output-scaling",
        "--with",
        dir.to_str().unwrap(),
        "--out",
        figs.to_str().unwrap(),
        "--figures",
        "fig6",
    ]);
    let svg = std::fs::read_to_string(figs.join("fig6.svg")).unwrap();
    assert!(svg.contains("h2o (predicted)") && svg.contains("PREDICTED by the cost model"));
    // The report of predicted cells says so before anything else.
    kvbench(&["report", dir.to_str().unwrap()]);
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    let banner = md.lines().nth(2).unwrap_or_default();
    assert!(
        banner.starts_with("> **Predicted, not measured.** 9 of 9 cells"),
        "{banner}"
    );
    // An overlay of the same directory twice, or of another model's run, is refused.
    let refused = |args: &[&str], what: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvbench"))
            .current_dir(repo())
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(what),
            "{args:?}: {err}"
        );
    };
    let measured = "results/baselines/cpu/cpu-output-scaling";
    let out = figs.to_str().unwrap();
    refused(
        &["plot", measured, "--with", measured, "--out", out],
        "given twice",
    );
    refused(
        &[
            "plot",
            measured,
            "--with",
            "results/baselines/ci/ci-sweep",
            "--out",
            out,
        ],
        "an overlay draws one model's cells",
    );
    refused(&["report", measured, measured, "--out", out], "given twice");
}

/// The H200's first-build calibration (scalar paged decode, WMMA prefill) is fitted on
/// the paradigms at batch 16 without InfiniGen's memcpy cell (a transfer the model does not describe: it is named, not
/// fitted, and a validation marks it instead of predicting a number for another
/// system), and predicts the decode of the anchors' cells (batch 1 and 16 after a 1K
/// prompt, another experiment) within 15 % (9.1 % median when this was written).
#[test]
fn the_h200_calibration_leaves_out_the_transfer_it_does_not_model() {
    use kvbench::prediction::NOT_MODELLED;
    let h200 = card_device("h200", "h200");
    // The pinned host-to-device rate measured on the card, not PCIe 5's 64 GB/s.
    assert!((h200.host_link_bandwidth().unwrap() / 1e9 - 55.5).abs() < 0.1);
    let dir = |name: &str| measured("h200", name);
    let (mut cal, obs) = calibrate(&[dir("gpu-paradigms-batch16")], &h200, &[], None).unwrap();
    cal.ceilings = Some("results/baselines/h200/ceilings.json".into());
    assert_eq!(obs.left_out.len(), 1, "{:?}", obs.left_out);
    assert!(obs.left_out[0].0.contains("transfer=memcpy"));
    assert!(
        obs.left_out[0].1.contains("zero-copy"),
        "{}",
        obs.left_out[0].1
    );
    let target = committed_target(
        &cal,
        "results/baselines/h200/calibration-h200-first-build.yaml",
        h200,
    );
    let checks = validate(&dir("gpu-paradigms-batch16"), &target).unwrap();
    assert_eq!(checks.len(), 4);
    let memcpy: Vec<_> = checks
        .iter()
        .filter(|c| c.key.contains("transfer=memcpy"))
        .collect();
    assert_eq!(memcpy.len(), 1);
    assert_eq!(memcpy[0].predicted_outcome, NOT_MODELLED);
    assert!(memcpy[0]
        .values
        .iter()
        .all(|(m, p)| m.is_some() && p.is_none()));
    assert!(outcome_mismatches(&checks).is_empty());
    let anchors = validate(&dir("gpu-anchors"), &target).unwrap();
    let decode = metric_error(&anchors, "decode_tok_s");
    assert_eq!(decode.cells, 2);
    assert!(decode.median_abs_rel <= 0.15, "{decode:?}");
}

/// The H200's committed calibration describes the current engine (vector paged decode,
/// mma.sync prefill): fitted on the paradigms at batch 32 and the 16K/32K prefill
/// cells, it predicts the decode-kernel experiment's cells (batch 1 and 16, prompts of
/// 1K and 1K-10K tokens, recorded by the same build) within 15 % on decode throughput
/// and TTFT (12.5 % and 13.3 % medians when this was written).
#[test]
fn the_h200_calibration_of_the_current_engine_predicts_the_decode_kernel_cells() {
    let h200 = card_device("h200", "h200");
    let dir = |name: &str| measured("h200", name);
    let fitted = [
        dir("gpu-paradigms-batch32"),
        dir("calibration-cells/third-lease/gpu-prefill-kernel"),
    ];
    let (mut cal, obs) = calibrate(&fitted, &h200, &[], None).unwrap();
    cal.ceilings = Some("results/baselines/h200/ceilings.json".into());
    assert!(obs.left_out.is_empty(), "{:?}", obs.left_out);
    let target = committed_target(&cal, "results/baselines/h200/calibration-h200.yaml", h200);
    let checks = validate(&dir("decode-kernel/vector/gpu-decode-kernel"), &target).unwrap();
    assert_eq!(checks.len(), 8);
    assert!(outcome_mismatches(&checks).is_empty());
    let errors = metric_errors(&checks).unwrap();
    for metric in ["decode_tok_s", "ttft_mean_s"] {
        let e = errors.iter().find(|e| e.metric == metric).unwrap();
        assert_eq!(e.cells, 8, "{e:?}");
        assert!(e.median_abs_rel <= 0.15, "{e:?}");
    }
}

/// InfiniGen's decode on the H200, held out on each build: a fit on the full and h2o
/// cells alone, the host link taken from the other build's committed calibration
/// (fitted on its own InfiniGen cell, another experiment and batch; the gather kernel
/// is the same), predicts the InfiniGen cell's decode throughput within 15 % (12.6 %
/// too slow at batch 32 and 11.7 % too fast at batch 16 when this was written; with
/// the pinned copy rate instead, 19 % and 28 % too fast).
#[test]
fn the_h200_link_fitted_on_one_build_predicts_the_other_builds_infinigen() {
    let h200 = card_device("h200", "h200");
    let dir = |name: &str| measured("h200", name);
    let cal = |file: &str| Calibration::load(&repo().join("results/baselines/h200").join(file));
    let (first, now) = (
        cal("calibration-h200-first-build.yaml").unwrap(),
        cal("calibration-h200.yaml").unwrap(),
    );
    let batch32 = [
        dir("gpu-paradigms-batch32"),
        dir("calibration-cells/third-lease/gpu-prefill-kernel"),
    ];
    let batch16 = [dir("gpu-paradigms-batch16")];
    let full_h2o = ["full".to_string(), "h2o".to_string()];
    for (fitted, other, link) in [
        (&batch32[..], &first, first.decode.fit.efficiency.link),
        (&batch16[..], &now, now.decode.fit.efficiency.link),
    ] {
        let (c, _) = calibrate(fitted, &h200, &full_h2o, Some((other, "other.yaml"))).unwrap();
        assert_eq!(c.decode.taken, vec![Term::Link]);
        assert_eq!(c.decode.fit.efficiency.link, link);
        let target = Target {
            device: h200.clone(),
            efficiency: c.efficiency(),
            tensor_parallel: 1,
        };
        let checks = validate(&fitted[0], &target).unwrap();
        let ig: Vec<_> = checks
            .into_iter()
            .filter(|c| c.key.starts_with("engine=infinigen;params=;"))
            .collect();
        assert_eq!(ig.len(), 1, "{}", fitted[0].name());
        let decode = metric_error(&ig, "decode_tok_s");
        assert!(
            decode.median_abs_rel <= 0.15,
            "{}: {decode:?}",
            fitted[0].name()
        );
    }
}

/// The README's table of held-out errors is the one `just validate-cost` makes from
/// docs/cost-validation.md (scripts/validation-table.py, which recomputes each row's
/// medians from the cells), and a table that differs by one number is refused.
#[test]
fn the_readme_validation_table_is_generated_from_the_validation_document() {
    let check = |readme: &Path| {
        std::process::Command::new("python3")
            .arg(repo().join("scripts/validation-table.py"))
            .arg("--check")
            .arg("--readme")
            .arg(readme)
            .arg("--doc")
            .arg(repo().join("docs/cost-validation.md"))
            .output()
            .expect("python3 runs (CI installs just with it)")
    };
    let o = check(&repo().join("README.md"));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let row = text
        .lines()
        .find(|l| l.starts_with("| 2-core CPU | batch scaling"))
        .expect("the CPU row");
    let changed = row.replacen(" %", "1 %", 1);
    let tmp = tempfile::tempdir().unwrap();
    let edited = tmp.path().join("README.md");
    std::fs::write(&edited, text.replacen(row, &changed, 1)).unwrap();
    let o = check(&edited);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("just validate-cost"));
}

/// A ceilings file that is not scripts/gpu-ceilings.py's JSON, names no rate, or gives
/// a rate that is not positive is refused with the file and the key named.
#[test]
fn a_ceilings_file_without_usable_rates_is_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let file = |name: &str, text: &str| {
        let p = tmp.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let err = |p: &Path| format!("{:#}", load_ceilings(p).unwrap_err());
    let bad = file("bad.json", "copy 4 TB/s");
    assert!(err(&bad).contains("bad.json") && err(&bad).contains("gpu-ceilings.py"));
    let none = file("none.json", r#"{"device": "NVIDIA H200"}"#);
    assert!(
        err(&none).contains("h2d_pinned_bytes_per_s"),
        "{}",
        err(&none)
    );
    let neg = file("neg.json", r#"{"h2d_pinned_bytes_per_s": -1}"#);
    assert!(
        err(&neg).contains("`h2d_pinned_bytes_per_s` is -1"),
        "{}",
        err(&neg)
    );
    let nan = file("str.json", r#"{"copy_bandwidth_bytes_per_s": "fast"}"#);
    assert!(
        err(&nan).contains("copy_bandwidth_bytes_per_s"),
        "{}",
        err(&nan)
    );
    assert!(err(&tmp.path().join("missing.json")).contains("missing.json"));
    // Only the rates given replace the datasheet's.
    let link = file("link.json", r#"{"h2d_pinned_bytes_per_s": 5e10}"#);
    let c = load_ceilings(&link).unwrap();
    let h200 = DeviceTable::builtin().unwrap().get("h200").unwrap().clone();
    let d = h200.with_ceilings(&c, "link.json");
    assert_eq!(d.host_link_bandwidth().unwrap(), 5e10);
    assert_eq!(d.memory_bandwidth, h200.memory_bandwidth);
    assert_eq!(d.bf16_flops, h200.bf16_flops);
    assert!(d.sources.iter().any(|s| s.contains("link.json")));
}

/// A CPU's runs are not fitted as a card's constants (nor a card's ceilings as a
/// CPU's), and an output path that cannot be written is refused before the fit.
#[test]
fn calibrate_refuses_runs_of_another_kind_of_device_before_fitting() {
    let out = tempfile::tempdir().unwrap();
    let calibrate = |args: &[&str]| {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_kvbench"))
            .current_dir(repo())
            .env("RUST_BACKTRACE", "0")
            .arg("calibrate")
            .args(args)
            .output()
            .unwrap();
        assert!(!o.status.success(), "{args:?} passed");
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    let file = out.path().join("c.yaml");
    let file = file.to_str().unwrap();
    let cpu = "results/baselines/cpu/cpu-quickstart";
    let e = calibrate(&[cpu, "--device", "h100-sxm", "-o", file]);
    assert!(
        e.contains("ran on `cpu`") && e.contains("h100-sxm is a GPU"),
        "{e}"
    );
    let e = calibrate(&[
        cpu,
        "--device",
        "cpu",
        "--ceilings",
        "results/baselines/h100/ceilings.json",
        "-o",
        file,
    ]);
    assert!(e.contains("--ceilings") && e.contains("is a CPU"), "{e}");
    let missing = out.path().join("no/c.yaml");
    let e = calibrate(&[cpu, "--device", "cpu", "-o", missing.to_str().unwrap()]);
    assert!(e.contains("no directory"), "{e}");
    let e = calibrate(&[cpu, "--device", "cpu", "-o", file, "--validate", "no/such"]);
    assert!(e.contains("no/such"), "{e}");
    assert!(
        !std::path::Path::new(file).exists(),
        "a calibration was written"
    );
}
