//! `kvbench compare` on small sweeps of `preset:tiny`: an identical copy passes,
//! planted regressions are named, a uniformly slower machine passes relative to
//! `full`, unmatched cells are listed and bad paths are named.

mod common;

use polars::prelude::{DataType, NamedFrom, ParquetReader, ParquetWriter, SerReader, Series};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const EXP: &str = "name: cmp\nmodel: preset:tiny\ndtype: f32\ndevice:\n  memory: 1GiB\nengines:\n  - name: full\n  - name: h2o\nmatrix:\n  batch: [1, 2]\n  prompt_len: [24]\n  output_len: [4]\n  budget: [0.5]\nworkload:\n  num_requests: 2\n";

fn kvbench(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvbench"))
        .args(args)
        .env("KVBENCH_MODELS_DIR", dir)
        .output()
        .expect("kvbench runs")
}

fn out(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A sweep of four cells (full and h2o at batch 1 and 2) under `dir/a/cmp`; returns
/// the experiment file and the results directory.
fn sweep(dir: &Path) -> (PathBuf, PathBuf) {
    let exp = dir.join("cmp.yaml");
    std::fs::write(&exp, EXP).unwrap();
    let results = dir.join("a");
    let o = kvbench(
        dir,
        &[
            "run",
            exp.to_str().unwrap(),
            "--results",
            results.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", err(&o));
    (exp, results.join("cmp"))
}

/// A copy of results directory `from` (the experiment's directory) under
/// `dir/<name>/cmp`.
fn copy(from: &Path, dir: &Path, name: &str) -> PathBuf {
    let to = dir.join(name).join("cmp");
    std::fs::create_dir_all(to.join("cells")).unwrap();
    for sub in ["", "cells"] {
        for f in std::fs::read_dir(from.join(sub)).unwrap() {
            let p = f.unwrap().path();
            if p.is_file() {
                std::fs::copy(&p, to.join(sub).join(p.file_name().unwrap())).unwrap();
            }
        }
    }
    to
}

fn cell_files(exp_dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(exp_dir.join("cells"))
        .unwrap()
        .map(|f| f.unwrap().path())
        .collect();
    v.sort();
    v
}

/// Rewrite the cell of `exp_dir` whose key has `engine` and `batch` with `edit`;
/// returns its key.
fn edit_cell(exp_dir: &Path, engine: &str, batch: u64, edit: impl Fn(&mut Value)) -> String {
    for f in cell_files(exp_dir) {
        let mut v: Value = kvbench::cell_file::read(&f).unwrap();
        if v["cell"]["engine"] == engine && v["cell"]["batch"] == batch {
            edit(&mut v);
            common::rewrite_cell(&f, &v);
            return v["key"].as_str().unwrap().to_string();
        }
    }
    panic!("no {engine} cell at batch {batch}");
}

/// `kvbench run EXP --tables-only` for a copied results directory.
fn rebuild(exp: &Path, exp_dir: &Path) {
    let o = kvbench(
        exp_dir,
        &[
            "run",
            exp.to_str().unwrap(),
            "--tables-only",
            "--results",
            exp_dir.parent().unwrap().to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", err(&o));
}

fn compare(dir: &Path, a: &Path, b: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["compare", a.to_str().unwrap(), b.to_str().unwrap()];
    args.extend(extra);
    kvbench(dir, &args)
}

#[test]
fn compare_passes_an_identical_copy() {
    let dir = tempfile::tempdir().unwrap();
    let (_, a) = sweep(dir.path());
    let b = copy(&a, dir.path(), "b");
    for extra in [&[][..], &["--relative-to", "full"][..]] {
        let o = compare(dir.path(), &a, &b, extra);
        let text = out(&o);
        assert!(o.status.success(), "{extra:?}: {text}{}", err(&o));
        assert!(text.contains("4 cells matched (4 points)"), "{text}");
        assert!(text.contains("no regressions"), "{text}");
        assert!(!text.contains("only in"), "{text}");
        // One table row per point, every ratio 1.
        let rows: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("full ") || l.starts_with("h2o "))
            .collect();
        assert_eq!(rows.len(), 4, "{text}");
        for r in &rows {
            assert!(r.contains("1.00") && !r.contains('!'), "{r}");
        }
        if !extra.is_empty() {
            // The reference cells are the denominators.
            assert!(rows.iter().any(|r| r.contains("ref")), "{text}");
        }
    }
    // The same directory against itself, given as runs.parquet files.
    let o = compare(
        dir.path(),
        &a.join("runs.parquet"),
        &b.join("runs.parquet"),
        &[],
    );
    assert!(o.status.success(), "{}", err(&o));
}

#[test]
fn compare_flags_planted_regressions_and_names_cells_and_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let (exp, a) = sweep(dir.path());
    let b = copy(&a, dir.path(), "b");
    // Decode throughput of h2o at batch 2 halved, full at batch 1 out of memory,
    // h2o at batch 1 holding one more byte of device KV.
    let slow = edit_cell(&b, "h2o", 2, |v| {
        let t = v["metrics"]["decode_throughput"].as_f64().unwrap();
        v["metrics"]["decode_throughput"] = (t / 2.0).into();
    });
    let oom = edit_cell(&b, "full", 1, |v| {
        v["outcome"] = "oom".into();
        v["error"] = "out of memory: planted".into();
    });
    let bytes = edit_cell(&b, "h2o", 1, |v| {
        let k = v["memory"]["kv_device"].as_u64().unwrap();
        v["memory"]["kv_device"] = (k + 1).into();
    });
    rebuild(&exp, &b);
    let o = compare(dir.path(), &a, &b, &[]);
    assert!(!o.status.success(), "{}", out(&o));
    let e = err(&o);
    assert!(e.contains("3 regression(s) in 3 cell(s)"), "{e}");
    let slow_point = slow.replace(";repeat=0", "");
    assert!(
        e.contains(&format!("{slow_point}: decode_tok_s: A ")),
        "{e}"
    );
    assert!(e.contains("B/A 0.500"), "{e}");
    assert!(
        e.contains(&format!("{oom}: outcome ok → oom (regression")),
        "{e}"
    );
    assert!(e.contains("out of memory: planted"), "{e}");
    assert!(
        e.contains(&format!("{bytes}: mem_kv_device_bytes: A ")),
        "{e}"
    );
    // The table marks them.
    let text = out(&o);
    assert!(text.contains("ok→oom"), "{text}");
    assert!(text.contains("0.50!"), "{text}");
    assert!(text.contains("≠!"), "{text}");
    // Relative to full (whose batch 2 cell is untouched) the halving still shows.
    let o = compare(dir.path(), &a, &b, &["--relative-to", "full"]);
    assert!(!o.status.success());
    assert!(
        err(&o).contains(&format!("{slow_point}: decode_tok_s relative to `full`")),
        "{}",
        err(&o)
    );
    // A tolerance past the slowdown lets the timing pass; outcomes and bytes still fail.
    let o = compare(dir.path(), &a, &b, &["--tolerance", "150%"]);
    assert!(!o.status.success());
    assert!(err(&o).contains("2 regression(s)"), "{}", err(&o));
    assert!(!err(&o).contains("decode_tok_s"), "{}", err(&o));
}

#[test]
fn a_uniformly_slower_machine_fails_in_seconds_and_passes_relative_to_full() {
    let dir = tempfile::tempdir().unwrap();
    let (_, a) = sweep(dir.path());
    let b = copy(&a, dir.path(), "b");
    // Rewrite B's runs.parquet: every time three times longer, every throughput a
    // third, as on a machine three times slower.
    let path = b.join("runs.parquet");
    let mut df = ParquetReader::new(std::fs::File::open(&path).unwrap())
        .finish()
        .unwrap();
    for (col, f) in [
        ("ttft_mean_s", 3.0),
        ("ttft_p99_s", 3.0),
        ("tpot_mean_s", 3.0),
        ("itl_p99_s", 3.0),
        ("e2e_mean_s", 3.0),
        ("wall_prefill_s", 3.0),
        ("wall_decode_s", 3.0),
        ("wall_cache_ops_s", 3.0),
        ("decode_tok_s", 1.0 / 3.0),
        ("throughput_tok_s", 1.0 / 3.0),
        ("decode_tok_s_per_gb", 1.0 / 3.0),
    ] {
        let c = df.column(col).unwrap().cast(&DataType::Float64).unwrap();
        let v: Vec<Option<f64>> = c.f64().unwrap().iter().map(|x| x.map(|x| x * f)).collect();
        df.replace(col, Series::new(col.into(), v).into()).unwrap();
    }
    ParquetWriter::new(std::fs::File::create(&path).unwrap())
        .finish(&mut df)
        .unwrap();
    let o = compare(dir.path(), &a, &b, &[]);
    assert!(!o.status.success(), "{}", out(&o));
    let e = err(&o);
    assert!(e.contains("regression(s) in 4 cell(s)"), "{e}");
    assert!(e.contains("3.00× slower"), "{e}");
    assert!(e.contains("3.00× lower throughput"), "{e}");
    let o = compare(dir.path(), &a, &b, &["--relative-to", "full"]);
    assert!(o.status.success(), "{}{}", out(&o), err(&o));
    assert!(out(&o).contains("no regressions"), "{}", out(&o));
}

#[test]
fn compare_lists_cells_present_on_one_side_only() {
    let dir = tempfile::tempdir().unwrap();
    let (exp, a) = sweep(dir.path());
    let b = copy(&a, dir.path(), "b");
    let gone = cell_files(&b).pop().unwrap();
    let key: Value = kvbench::cell_file::read(&gone).unwrap();
    let key = key["key"].as_str().unwrap().to_string();
    std::fs::remove_file(&gone).unwrap();
    rebuild(&exp, &b);
    let o = compare(dir.path(), &a, &b, &[]);
    let text = out(&o);
    assert!(o.status.success(), "{text}{}", err(&o));
    assert!(text.contains("3 cells matched"), "{text}");
    assert!(
        text.contains(&format!("only in A (1):\n  {key}\n")),
        "{text}"
    );
    let o = compare(dir.path(), &b, &a, &[]);
    assert!(o.status.success(), "{}", err(&o));
    assert!(
        out(&o).contains(&format!("only in B (1):\n  {key}\n")),
        "{}",
        out(&o)
    );
}

#[test]
fn bad_paths_and_flags_are_named_with_what_was_expected() {
    let dir = tempfile::tempdir().unwrap();
    let (_, a) = sweep(dir.path());
    let missing = dir.path().join("no-such-run");
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let cells_only = dir.path().join("cells-only");
    std::fs::create_dir_all(cells_only.join("cells")).unwrap();
    let junk = dir.path().join("junk.parquet");
    std::fs::write(&junk, "not parquet").unwrap();
    let cases: Vec<(Vec<&str>, Vec<String>)> = vec![
        (
            vec![missing.to_str().unwrap()],
            vec![
                missing.display().to_string(),
                "no such file or directory".into(),
                "expected an experiment's results directory".into(),
            ],
        ),
        (
            vec![empty.to_str().unwrap()],
            vec![
                empty.display().to_string(),
                "no runs.parquet".into(),
                "expected an experiment's results directory".into(),
            ],
        ),
        (
            vec![cells_only.to_str().unwrap()],
            vec![cells_only.display().to_string(), "--tables-only".into()],
        ),
        (
            vec![junk.to_str().unwrap()],
            vec![
                junk.display().to_string(),
                "not a readable Parquet table".into(),
            ],
        ),
        (
            vec!["--relative-to", "nosuch"],
            vec![
                "--relative-to nosuch".into(),
                "no `nosuch` cells".into(),
                "full, h2o".into(),
            ],
        ),
        (
            vec!["--tolerance", "lots"],
            vec!["lots".into(), "expected a fraction".into()],
        ),
    ];
    for (args, want) in cases {
        // A bad path as B (then as A); a bad flag with the good run on both sides.
        let mut full = vec!["compare", a.to_str().unwrap()];
        if args[0].starts_with("--") {
            full.push(a.to_str().unwrap());
        }
        full.extend(&args);
        let o = kvbench(dir.path(), &full);
        assert!(!o.status.success(), "{full:?}");
        let e = err(&o);
        for w in &want {
            assert!(e.contains(w.as_str()), "{full:?}: want {w:?} in {e}");
        }
        if !args[0].starts_with("--") {
            let o = kvbench(dir.path(), &["compare", args[0], a.to_str().unwrap()]);
            assert!(!o.status.success());
            assert!(err(&o).contains(&want[0]), "{}", err(&o));
        }
    }
    // Two runs with no cell in common.
    let other = dir.path().join("other.yaml");
    std::fs::write(&other, EXP.replace("batch: [1, 2]", "batch: [3]")).unwrap();
    let o = kvbench(
        dir.path(),
        &[
            "run",
            other.to_str().unwrap(),
            "--results",
            dir.path().join("o").to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", err(&o));
    let o = compare(dir.path(), &a, &dir.path().join("o/cmp"), &[]);
    assert!(!o.status.success());
    assert!(err(&o).contains("no cell in common"), "{}", err(&o));
}

#[test]
fn the_committed_ci_baseline_has_every_cell_of_the_ci_sweep_and_compare_judges_copies_of_it() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let dir = tempfile::tempdir().unwrap();
    let exp = root.join("experiments/ci/sweep.yaml");
    let o = kvbench(
        dir.path(),
        &["run", exp.to_str().unwrap(), "--dry-run", "--json"],
    );
    assert!(o.status.success(), "{}", err(&o));
    let cells: Value = serde_json::from_slice(&o.stdout).unwrap();
    let mut keys: Vec<String> = cells
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["key"].as_str().unwrap().to_string())
        .collect();
    keys.sort();
    let base = root.join("results/baselines/ci/ci-sweep");
    let runs = ParquetReader::new(std::fs::File::open(base.join("runs.parquet")).unwrap())
        .finish()
        .unwrap();
    let mut recorded: Vec<String> = runs
        .column("cell_key")
        .unwrap()
        .str()
        .unwrap()
        .iter()
        .map(|k| k.unwrap().to_string())
        .collect();
    recorded.sort();
    assert_eq!(
        keys, recorded,
        "experiments/ci/sweep.yaml changed: re-record results/baselines/ci/ci-sweep (docs/experiments.md)"
    );
    assert_eq!(cell_files(&base).len(), keys.len());
    let outcomes = runs.column("outcome").unwrap();
    assert_eq!(
        outcomes
            .str()
            .unwrap()
            .iter()
            .filter(|o| *o == Some("ok"))
            .count(),
        keys.len()
    );
    // An identical copy passes.
    let copied = copy(&base, dir.path(), "copy");
    let o = compare(dir.path(), &base, &copied, &["--relative-to", "full"]);
    assert!(o.status.success(), "{}", err(&o));
    assert!(out(&o).contains("no regressions"), "{}", out(&o));
    // The copy with one point planted slower (h2o under flash decoding at half speed in
    // every repeat) fails relative to full, naming that point and no other.
    let path = copied.join("runs.parquet");
    let mut df = ParquetReader::new(std::fs::File::open(&path).unwrap())
        .finish()
        .unwrap();
    let text = |c: &str| -> Vec<Option<String>> {
        df.column(c)
            .unwrap()
            .str()
            .unwrap()
            .iter()
            .map(|s| s.map(str::to_owned))
            .collect()
    };
    let (engine, attention) = (text("engine"), text("attention"));
    let tok = df
        .column("decode_tok_s")
        .unwrap()
        .cast(&DataType::Float64)
        .unwrap();
    let slowed: Vec<Option<f64>> = tok
        .f64()
        .unwrap()
        .iter()
        .zip(engine.iter().zip(&attention))
        .map(|(t, (e, a))| {
            let planted = e.as_deref() == Some("h2o") && a.as_deref() == Some("flash");
            t.map(|t| if planted { t / 2.0 } else { t })
        })
        .collect();
    assert!(engine
        .iter()
        .zip(&attention)
        .any(|(e, a)| { e.as_deref() == Some("h2o") && a.as_deref() == Some("flash") }));
    df.replace(
        "decode_tok_s",
        Series::new("decode_tok_s".into(), slowed).into(),
    )
    .unwrap();
    ParquetWriter::new(std::fs::File::create(&path).unwrap())
        .finish(&mut df)
        .unwrap();
    let o = compare(dir.path(), &base, &copied, &["--relative-to", "full"]);
    assert!(!o.status.success(), "{}", out(&o));
    let e = err(&o);
    let named: Vec<&str> = e
        .lines()
        .filter(|l| l.contains("decode_tok_s relative to `full`"))
        .collect();
    assert!(!named.is_empty(), "{e}");
    for l in named {
        assert!(
            l.contains("engine=h2o") && l.contains("attention=flash"),
            "{l}"
        );
    }
}
