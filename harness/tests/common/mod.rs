//! Setup shared by the end-to-end tests of the `kvbench` binary.
// Each test binary uses only some of these.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use tempfile::TempDir;

/// `kvbench` with `args`, run from `cwd` on one thread; the caller adds the
/// environment its test needs.
pub fn kvbench_in(cwd: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvbench"));
    c.args(args).current_dir(cwd).env("KVBENCH_THREADS", "1");
    c
}

/// A new temporary directory with the experiment `yaml` written to `file` in it;
/// returns the directory (kept alive by the caller) and the experiment's path.
pub fn with_experiment(file: &str, yaml: &str) -> (TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let exp = dir.path().join(file);
    std::fs::write(&exp, yaml).unwrap();
    (dir, exp)
}

/// `run EXP --results RESULTS`: a sweep of the experiment file `exp` into `results`.
pub fn sweep_args<'a>(exp: &'a Path, results: &'a Path) -> [&'a str; 4] {
    [
        "run",
        exp.to_str().unwrap(),
        "--results",
        results.to_str().unwrap(),
    ]
}

/// Runs each of `steps` in order with `kvbench`; the first that does not succeed fails
/// the test with its arguments and stderr.
pub fn run_each(steps: &[&[&str]], kvbench: impl Fn(&[&str]) -> Output) {
    for args in steps {
        let o = kvbench(args);
        assert!(
            o.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

/// The cell files recorded under `exp_dir/cells`, in cell-index order.
pub fn recorded_cells(exp_dir: &Path) -> Vec<serde_json::Value> {
    let mut cells: Vec<serde_json::Value> = kvbench::cell_file::list(&exp_dir.join("cells"))
        .unwrap()
        .iter()
        .map(|f| kvbench::cell_file::read(f).unwrap())
        .collect();
    cells.sort_by_key(|c| c["cell"]["index"].as_u64());
    cells
}

/// Whether `p` is a cell file as `kvbench run` writes it now (`<id>.json.gz`).
pub fn is_cell_gz(p: &Path) -> bool {
    p.to_str().is_some_and(|s| s.ends_with(".json.gz"))
}

/// Replace the content of cell file `f` with `v`, in the form (plain or gzip) its name says.
pub fn rewrite_cell(f: &Path, v: &serde_json::Value) {
    let json = v.to_string();
    let bytes = if is_cell_gz(f) {
        kvbench::cell_file::encode(&json).unwrap()
    } else {
        json.into_bytes()
    };
    std::fs::write(f, bytes).unwrap();
}
