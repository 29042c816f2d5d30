//! A recorded result is always the result of the experiment as written: the ways a
//! user can run a sweep (editing its YAML between runs, two sweeps on one directory,
//! killing one, rebuilding the binary during one, a crash, a corrupt or unwritable
//! cell file) never record or tabulate a result that does not belong to it, and never
//! lose one that does.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

/// `kvbench ARGS` on one thread, from `dir` (preset models need no weights).
fn kvbench(dir: &Path, args: &[&str]) -> Output {
    common::kvbench_in(dir, args)
        .env("KVBENCH_MODELS_DIR", dir)
        .output()
        .expect("kvbench runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A sweep of `exp` into `results` that must succeed; its stdout and stderr.
fn sweep(dir: &Path, exp: &Path, results: &Path, extra: &[&str]) -> (String, String) {
    let mut args = common::sweep_args(exp, results).to_vec();
    args.extend(extra);
    let o = kvbench(dir, &args);
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    (stdout(&o), stderr(&o))
}

fn runs_rows(exp_dir: &Path) -> usize {
    use polars::prelude::*;
    let f = std::fs::File::open(exp_dir.join("runs.parquet")).unwrap();
    ParquetReader::new(f).finish().unwrap().height()
}

fn files_in(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.map(|e| e.unwrap().path()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// The cells of `exp` as `run --dry-run --json` lists them.
fn planned(dir: &Path, exp: &Path) -> Vec<serde_json::Value> {
    let o = kvbench(dir, &["run", exp.to_str().unwrap(), "--dry-run", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    serde_json::from_slice::<Vec<serde_json::Value>>(&o.stdout).unwrap()
}

const ONE_CELL: &str = "name: edits\nmodel: preset:tiny\ndtype: f32\ndevice:\n  memory: 1GiB\nengines:\n  - name: full\nmatrix:\n  batch: [1]\n  prompt_len: [24]\n  output_len: [4]\n  budget: [0.5]\nworkload:\n  num_requests: 2\n";

#[test]
fn editing_the_yaml_reruns_exactly_the_cells_it_changes_and_tables_hold_only_the_plan() {
    let (dir, exp) = common::with_experiment("e.yaml", ONE_CELL);
    let results = dir.path().join("results");
    let exp_dir = results.join("edits");
    let (out, _) = sweep(dir.path(), &exp, &results, &[]);
    assert!(out.contains("1 cells run, 0 already recorded"), "{out}");

    // An engine inserted before the recorded one: only the new cell runs.
    let two = ONE_CELL.replace("engines:\n", "engines:\n  - name: h2o\n");
    std::fs::write(&exp, &two).unwrap();
    let (out, _) = sweep(dir.path(), &exp, &results, &[]);
    assert!(out.contains("1 cells run, 1 already recorded"), "{out}");
    assert_eq!(runs_rows(&exp_dir), 2);

    // A setting outside the matrix (the seed) changes every cell: both run again, the
    // tables hold the two new results only, and the old files are named.
    std::fs::write(&exp, two.replace("dtype: f32\n", "dtype: f32\nseed: 7\n")).unwrap();
    let (out, err) = sweep(dir.path(), &exp, &results, &[]);
    assert!(out.contains("2 cells run, 0 already recorded"), "{out}");
    assert_eq!(runs_rows(&exp_dir), 2);
    assert!(err.contains("2 file(s) in"), "{err}");
    assert!(
        err.contains("belong to no cell of this experiment"),
        "{err}"
    );
    assert!(err.contains("--prune"), "{err}");

    // Each YAML that produced a cell is kept, and each cell names its own.
    let specs = files_in(&exp_dir.join("specs"));
    assert_eq!(specs.len(), 3, "{specs:?}");
    let seeded = std::fs::read_to_string(&exp).unwrap();
    let current: Vec<serde_json::Value> = planned(dir.path(), &exp)
        .iter()
        .map(|c| c["id"].clone())
        .collect();
    let recorded = common::recorded_cells(&exp_dir);
    assert_eq!(recorded.len(), 4);
    for c in recorded {
        let spec = exp_dir
            .join("specs")
            .join(format!("{}.yaml", c["spec"].as_str().unwrap()));
        let text = std::fs::read_to_string(&spec).unwrap();
        // The new cells point at today's YAML, the old ones at the one they came from.
        assert_eq!(
            current.contains(&c["id"]),
            text == seeded,
            "{}",
            spec.display()
        );
        assert_eq!(current.contains(&c["id"]), text.contains("seed: 7"));
    }

    // --prune moves the two stale files aside; the tables are unchanged.
    let (out, err) = sweep(dir.path(), &exp, &results, &["--prune"]);
    assert!(
        out.contains("2 file(s) of no cell of this experiment moved to"),
        "{out}"
    );
    assert!(out.contains("0 cells run, 2 already recorded"), "{out}");
    assert!(!err.contains("belong to no cell"), "{err}");
    assert_eq!(files_in(&exp_dir.join("pruned")).len(), 2);
    assert_eq!(files_in(&exp_dir.join("cells")).len(), 2);
    assert_eq!(runs_rows(&exp_dir), 2);
}

#[test]
fn cells_recorded_with_another_thread_count_are_named_with_the_flag_that_reads_them() {
    let (dir, exp) = common::with_experiment("e.yaml", ONE_CELL);
    let results = dir.path().join("results");
    let exp_dir = results.join("edits");
    // Recorded with one thread (the tests' `KVBENCH_THREADS`), whatever the cores.
    sweep(dir.path(), &exp, &results, &[]);
    let [cell] = &files_in(&exp_dir.join("cells"))[..] else {
        panic!("one cell file")
    };
    assert_eq!(kvbench::cell_file::read(cell).unwrap()["env"]["threads"], 1);

    // `--prune` with another thread count keeps them.
    let (out, _) = sweep(
        dir.path(),
        &exp,
        &results,
        &["--tables-only", "--prune", "--threads", "2"],
    );
    assert!(
        out.contains("0 file(s) of no cell") && out.contains("1 file(s) kept"),
        "{out}"
    );
    assert_eq!(files_in(&exp_dir.join("cells")).len(), 1);
    assert!(files_in(&exp_dir.join("pruned")).is_empty());

    // A cell recorded before `env.threads` existed ran with one thread per core.
    let mut v = kvbench::cell_file::read(cell).unwrap();
    v["env"].as_object_mut().unwrap().remove("threads");
    v["env"]["cpu_cores"] = 1.into();
    common::rewrite_cell(cell, &v);

    let (_, err) = sweep(
        dir.path(),
        &exp,
        &results,
        &["--tables-only", "--threads", "2"],
    );
    // Named as the plan's, not as files of no cell (which `--prune` would move).
    assert!(!err.contains("belong to no cell"), "{err}");
    assert!(
        err.contains("1 file(s) in")
            && err.contains("are this plan's cells recorded with 1 CPU worker threads")
            && err.contains("`--threads 1` puts them there"),
        "{err}"
    );
    assert_eq!(runs_rows(&exp_dir), 0);
    // The flag named reads them.
    let (_, err) = sweep(dir.path(), &exp, &results, &["--tables-only"]);
    assert!(!err.contains("CPU worker threads"), "{err}");
    assert_eq!(runs_rows(&exp_dir), 1);
}

#[test]
fn a_second_sweep_on_a_locked_results_directory_is_refused_with_the_holder() {
    let (dir, exp) = common::with_experiment("e.yaml", ONE_CELL);
    let results = dir.path().join("results");
    let exp_dir = results.join("edits");
    std::fs::create_dir_all(exp_dir.join("cells")).unwrap();
    // Another sweep holds the directory (as kvbench does: the lock file, and its pid).
    let lock = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(exp_dir.join(".lock"))
        .unwrap();
    lock.try_lock().unwrap();
    std::fs::write(exp_dir.join(".lock"), "4242\n").unwrap();
    for extra in [&[][..], &["--tables-only"][..]] {
        let mut args = common::sweep_args(&exp, &results).to_vec();
        args.extend(extra);
        let o = kvbench(dir.path(), &args);
        assert!(!o.status.success(), "{extra:?}: {}", stdout(&o));
        assert!(
            stderr(&o).contains("another kvbench run (pid 4242)"),
            "{extra:?}: {}",
            stderr(&o)
        );
    }
    assert!(files_in(&exp_dir.join("cells")).is_empty());
    // Released: the sweep runs.
    drop(lock);
    let (out, _) = sweep(dir.path(), &exp, &results, &[]);
    assert!(out.contains("1 cells run"), "{out}");
}

/// Pids of live `kvbench run-cell` processes of the experiment file `exp`.
fn cell_processes(exp: &Path) -> Vec<u32> {
    let exp = exp.to_string_lossy().into_owned();
    files_in(Path::new("/proc"))
        .into_iter()
        .filter_map(|p| {
            let pid: u32 = p.file_name()?.to_str()?.parse().ok()?;
            let cmd = std::fs::read(p.join("cmdline")).ok()?;
            let args: Vec<String> = cmd
                .split(|&b| b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            let stat = std::fs::read_to_string(p.join("stat")).ok()?;
            // A zombie has exited; it only waits to be reaped.
            let zombie = stat.rsplit(')').next()?.trim_start().starts_with('Z');
            (!zombie && args.iter().any(|a| a == "run-cell") && args.contains(&exp)).then_some(pid)
        })
        .collect()
}

#[test]
#[cfg(target_os = "linux")]
fn a_sweep_killed_with_sigkill_leaves_no_cell_running() {
    // One cell far longer than the test waits: it must end with its sweep.
    let (dir, exp) = common::with_experiment(
        "long.yaml",
        "name: long\nmodel: preset:tiny\ndtype: f32\ndevice:\n  memory: 1GiB\nengines:\n  - name: full\nmatrix:\n  batch: [1]\n  prompt_len: [16]\n  output_len: [256]\nworkload:\n  num_requests: 100000\n",
    );
    let results = dir.path().join("results");
    let mut child = common::kvbench_in(dir.path(), &common::sweep_args(&exp, &results))
        .env("KVBENCH_MODELS_DIR", dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while cell_processes(&exp).is_empty() && start.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let cells = cell_processes(&exp);
    assert_eq!(cells.len(), 1, "the cell never started");
    child.kill().unwrap(); // SIGKILL: no handler of the sweep runs
    child.wait().unwrap();
    let start = Instant::now();
    while !cell_processes(&exp).is_empty() && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let left = cell_processes(&exp);
    if !left.is_empty() {
        for pid in &left {
            let _ = std::process::Command::new("kill")
                .args(["-9", &pid.to_string()])
                .status();
        }
        panic!("cell process(es) {left:?} outlived their sweep");
    }
    assert!(files_in(&results.join("long/cells")).is_empty());
}

/// Tables built before a sweep describe the cells as they were: a sweep that measures a
/// cell removes them first, so one killed part-way leaves none that disagree with
/// `cells/` (here a row of another build's cell that the sweep was rerunning), and
/// `--tables-only` builds them again from what is recorded.
#[test]
#[cfg(target_os = "linux")]
fn a_sweep_killed_part_way_leaves_no_tables_of_cells_it_was_replacing() {
    let yaml = "name: long\nmodel: preset:tiny\ndtype: f32\ndevice:\n  memory: 1GiB\nengines:\n  - name: full\nmatrix:\n  batch: [1]\n  prompt_len: [16]\n  output_len: [256]\nworkload:\n  num_requests: 100000\n";
    let (dir, exp) = common::with_experiment("long.yaml", yaml);
    let results = dir.path().join("results");
    let exp_dir = results.join("long");
    let plan = planned(dir.path(), &exp);
    let cells = exp_dir.join("cells");
    std::fs::create_dir_all(&cells).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&record(&plan[0], "ok")).unwrap();
    v["env"]["build"] = "0123456789abcdef".into();
    kvbench::cell_file::write(&cells, plan[0]["id"].as_str().unwrap(), &v.to_string()).unwrap();
    sweep(dir.path(), &exp, &results, &["--tables-only"]);
    assert_eq!(runs_rows(&exp_dir), 1);
    let mut child = common::kvbench_in(dir.path(), &common::sweep_args(&exp, &results))
        .env("KVBENCH_MODELS_DIR", dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while cell_processes(&exp).is_empty() && start.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let running = !cell_processes(&exp).is_empty();
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(running, "the cell never started");
    for name in ["runs", "requests", "steps", "samples", "accuracy"] {
        let f = exp_dir.join(format!("{name}.parquet"));
        assert!(
            !f.exists(),
            "{} outlived a sweep that was replacing its rows",
            f.display()
        );
    }
    // The record is still there (the rerun never finished), and tabulated on request.
    sweep(dir.path(), &exp, &results, &["--tables-only"]);
    assert_eq!(runs_rows(&exp_dir), 1);
}

/// A rebuild replaces the binary while a sweep runs (`cargo build` writes a new file at
/// the same path): the sweep's later cells still start, from the build that started
/// the sweep. Here the binary the sweep was started from is deleted as soon as it runs.
#[test]
#[cfg(target_os = "linux")]
fn a_sweep_runs_its_cells_with_its_own_build_after_the_binary_is_replaced() {
    let (dir, exp) = common::with_experiment(
        "rebuilt.yaml",
        &ONE_CELL.replace("batch: [1]", "batch: [1, 2]"),
    );
    let copy = dir.path().join("kvbench-copy");
    std::fs::copy(env!("CARGO_BIN_EXE_kvbench"), &copy).unwrap();
    let results = dir.path().join("results");
    let child = std::process::Command::new(&copy)
        .args(common::sweep_args(&exp, &results))
        .current_dir(dir.path())
        .env("KVBENCH_THREADS", "1")
        .env("KVBENCH_MODELS_DIR", dir.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // spawn() returns once the program has been executed: the sweep runs from here on
    // without the file, as after a rebuild.
    std::fs::remove_file(&copy).unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let cells = common::recorded_cells(&results.join("edits"));
    assert_eq!(cells.len(), 2, "{}", stderr(&o));
    assert!(cells.iter().all(|c| c["outcome"] == "ok"), "{cells:?}");
}

/// The JSON record of a cell that `planned` lists, with `outcome`, as this build
/// records it.
fn record(cell: &serde_json::Value, outcome: &str) -> String {
    serde_json::json!({
        "id": cell["id"],
        "key": cell["key"],
        "cell": cell,
        "outcome": outcome,
        "error": format!("recorded as {outcome} by the test"),
        "metrics": null,
        "env": {"build": kvbench::environment::BUILD_ID},
    })
    .to_string()
}

/// ONE_CELL swept once into a fresh directory, with its one cell's record.
struct Swept {
    dir: tempfile::TempDir,
    exp: PathBuf,
    results: PathBuf,
    cells: PathBuf,
    id: String,
    file: PathBuf,
    record: serde_json::Value,
}

fn swept_once() -> Swept {
    let (dir, exp) = common::with_experiment("e.yaml", ONE_CELL);
    let results = dir.path().join("results");
    let cells = results.join("edits/cells");
    let plan = planned(dir.path(), &exp);
    let id = plan[0]["id"].as_str().unwrap().to_string();
    let (out, _) = sweep(dir.path(), &exp, &results, &[]);
    assert!(out.contains("1 cells run, 0 already recorded"), "{out}");
    let file = kvbench::cell_file::find(&cells, &id).unwrap().unwrap();
    let record = kvbench::cell_file::read(&file).unwrap();
    Swept {
        dir,
        exp,
        results,
        cells,
        id,
        file,
        record,
    }
}

/// A kernel switch (`KVBENCH_FLASH_PREFILL`, ...) changes what a cell measures: a cell
/// recorded with one set is not taken for the plain cell, nor the plain one for it, and
/// the record names the switch.
#[test]
fn a_cell_recorded_with_a_kernel_switch_is_not_taken_for_one_without() {
    let (dir, exp) = common::with_experiment("e.yaml", ONE_CELL);
    let results = dir.path().join("results");
    let switched = |args: &[&str]| {
        let o = common::kvbench_in(dir.path(), args)
            .env("KVBENCH_MODELS_DIR", dir.path())
            .env("KVBENCH_FUSED_PROJECTIONS", "1")
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o)
    };
    let plain_id = planned(dir.path(), &exp)[0]["id"].clone();
    let args = common::sweep_args(&exp, &results);
    let out = switched(&args);
    assert!(out.contains("1 cells run, 0 already recorded"), "{out}");
    let cells = common::recorded_cells(&results.join("edits"));
    assert_eq!(cells.len(), 1);
    assert_ne!(
        cells[0]["id"], plain_id,
        "the switch is not in the identity"
    );
    assert_eq!(
        cells[0]["env"]["switches"]["KVBENCH_FUSED_PROJECTIONS"],
        "1"
    );
    let (out, _) = sweep(dir.path(), &exp, &results, &[]);
    assert!(out.contains("1 cells run, 0 already recorded"), "{out}");
    let plain: Vec<_> = common::recorded_cells(&results.join("edits"))
        .into_iter()
        .filter(|c| c["id"] == plain_id)
        .collect();
    assert_eq!(plain.len(), 1);
    assert!(
        plain[0]["env"].get("switches").is_none(),
        "{}",
        plain[0]["env"]
    );
    let out = switched(&args);
    assert!(out.contains("0 cells run, 1 already recorded"), "{out}");
}

impl Swept {
    /// The cell's record rewritten with `env[field]` = `other`: kept by a sweep with
    /// `keep`, run again by one without (the summary giving `reason`, stderr saying
    /// `named`), after which the record is this machine's again. Returns that record.
    fn run_again_unless_kept(
        &self,
        mut v: serde_json::Value,
        (field, other): (&str, &str),
        keep: &str,
        reason: &str,
        named: &str,
    ) -> serde_json::Value {
        let here = v["env"][field].clone();
        v["env"][field] = other.into();
        kvbench::cell_file::write(&self.cells, &self.id, &v.to_string()).unwrap();
        let (out, _) = sweep(self.dir.path(), &self.exp, &self.results, &[keep]);
        assert!(out.contains("0 cells run, 1 already recorded"), "{out}");
        let (out, err) = sweep(self.dir.path(), &self.exp, &self.results, &[]);
        assert!(
            out.contains(&format!(
                "1 cells run (1 {reason}, run again), 0 already recorded"
            )),
            "{out}"
        );
        assert!(err.contains(named), "{err}");
        let v = kvbench::cell_file::read(&self.file).unwrap();
        assert_eq!(v["env"][field], here);
        v
    }

    /// The cell's record rewritten without `env[field]`, and what a sweep then prints.
    fn sweep_without(&self, mut v: serde_json::Value, field: &str) -> (String, String) {
        v["env"].as_object_mut().unwrap().remove(field);
        kvbench::cell_file::write(&self.cells, &self.id, &v.to_string()).unwrap();
        sweep(self.dir.path(), &self.exp, &self.results, &[])
    }
}

#[test]
fn a_cell_recorded_by_another_build_is_run_again_unless_kept() {
    // A real run records this build.
    let s = swept_once();
    assert_eq!(s.record["env"]["build"], kvbench::environment::BUILD_ID);
    assert_eq!(kvbench::environment::BUILD_ID.len(), 16);
    let (out, _) = sweep(s.dir.path(), &s.exp, &s.results, &[]);
    assert!(out.contains("0 cells run, 1 already recorded"), "{out}");
    // The same cell as another build recorded it: kept when asked, else measured again.
    let v = s.run_again_unless_kept(
        s.record.clone(),
        ("build", "0123456789abcdef"),
        "--keep-other-builds",
        "recorded by another build",
        "build 0123456789abcdef",
    );
    // A cell recorded before builds were: run again too.
    let (out, err) = s.sweep_without(v, "build");
    assert!(out.contains("1 recorded by another build"), "{out}");
    assert!(err.contains("build not recorded"), "{err}");
}

/// A results directory carried to another machine: a cell recorded on another
/// processor (here another CPU model) is measured again unless asked to keep it, so one
/// card's or CPU's timings are never resumed as another's.
#[test]
fn a_cell_recorded_on_another_processor_is_run_again_unless_kept() {
    let s = swept_once();
    let here = s.record["env"]["cpu_model"].clone();
    assert_eq!(
        here.as_str(),
        kvbench::environment::processor("cpu").as_deref(),
        "the record names this machine's processor"
    );
    assert!(
        here.is_string(),
        "this machine's CPU model is not readable, so the check has nothing to compare: {}",
        s.record["env"]
    );
    let v = s.run_again_unless_kept(
        s.record.clone(),
        ("cpu_model", "Another CPU 9000"),
        "--keep-other-processors",
        "recorded on another processor",
        "Another CPU 9000",
    );
    // A record without a processor (older, or unreadable there) is not taken for another.
    let (out, _) = s.sweep_without(v, "cpu_model");
    assert!(out.contains("0 cells run, 1 already recorded"), "{out}");
}

#[test]
fn a_crashed_cell_is_retried_unless_asked_not_to_and_an_oom_stays_a_result() {
    let (dir, exp) = common::with_experiment("e.yaml", ONE_CELL);
    let results = dir.path().join("results");
    let cells = results.join("edits/cells");
    let plan = planned(dir.path(), &exp);
    assert_eq!(plan.len(), 1);
    let id = plan[0]["id"].as_str().unwrap();
    assert_eq!(id.len(), 32, "{id}");
    std::fs::create_dir_all(&cells).unwrap();
    // Recorded as plain JSON, as kvbench did before cells were compressed.
    let plain = cells.join(format!("{id}.json"));
    let gz = cells.join(format!("{id}.json.gz"));
    std::fs::write(&plain, record(&plan[0], "error")).unwrap();
    // Kept, tabulated, and the sweep fails naming it.
    let mut args = common::sweep_args(&exp, &results).to_vec();
    args.push("--no-retry");
    let o = kvbench(dir.path(), &args);
    assert!(!o.status.success());
    assert!(
        stdout(&o).contains("0 cells run, 1 already recorded"),
        "{}",
        stdout(&o)
    );
    assert!(
        stderr(&o).contains("1 of 1 cells ended in an error")
            && stderr(&o).contains("cell 0 (full"),
        "{}",
        stderr(&o)
    );
    assert_eq!(runs_rows(&results.join("edits")), 1);
    let (out, _) = sweep(dir.path(), &exp, &results, &[]);
    assert!(
        out.contains("1 cells run (1 retried after an error), 0 already recorded"),
        "{out}"
    );
    // The new result replaced the plain file: one file for the cell, compressed.
    assert!(!plain.exists());
    let v = kvbench::cell_file::read(&gz).unwrap();
    assert_eq!(v["outcome"], "ok", "{v}");
    assert_eq!(v["id"], id);

    // An oom stays, in either form.
    kvbench::cell_file::write(&cells, id, &record(&plan[0], "oom")).unwrap();
    let (out, _) = sweep(dir.path(), &exp, &results, &[]);
    assert!(out.contains("0 cells run, 1 already recorded"), "{out}");
    assert_eq!(runs_rows(&results.join("edits")), 1);

    // Both forms of the cell: no choice is made between them, by a sweep or a rebuild.
    std::fs::write(&plain, record(&plan[0], "oom")).unwrap();
    for extra in [&[][..], &["--tables-only"]] {
        let mut args = common::sweep_args(&exp, &results).to_vec();
        args.extend(extra);
        let o = kvbench(dir.path(), &args);
        assert!(!o.status.success(), "{extra:?}: {}", stdout(&o));
        let err = stderr(&o);
        assert!(
            err.contains(&plain.display().to_string()) && err.contains(&gz.display().to_string()),
            "{extra:?}: {err}"
        );
        assert!(!err.contains("cells run"), "{err}");
    }
    std::fs::remove_file(&gz).unwrap();
    let (out, _) = sweep(dir.path(), &exp, &results, &[]);
    assert!(out.contains("0 cells run, 1 already recorded"), "{out}");
    assert_eq!(runs_rows(&results.join("edits")), 1);
}

#[test]
fn a_corrupt_cell_file_is_named_and_skipped_and_an_unwritable_result_is_printed() {
    let (dir, exp) = common::with_experiment("e.yaml", ONE_CELL);
    let results = dir.path().join("results");
    let exp_dir = results.join("edits");
    sweep(dir.path(), &exp, &results, &[]);
    let cells = exp_dir.join("cells");
    std::fs::write(cells.join("broken.json"), "{\"id\": \"ab").unwrap();
    std::fs::write(cells.join("list.json"), "[1, 2]").unwrap();
    // Compressed: not gzip at all, a stream cut short, broken JSON inside, not a cell.
    std::fs::write(cells.join("plain.json.gz"), "{\"id\": \"ab\"}").unwrap();
    let whole = kvbench::cell_file::encode("{\"id\": \"ab\", \"cell\": {}}").unwrap();
    std::fs::write(cells.join("cut.json.gz"), &whole[..whole.len() / 2]).unwrap();
    let inside = kvbench::cell_file::encode("{\"id\": \"ab").unwrap();
    std::fs::write(cells.join("inside.json.gz"), inside).unwrap();
    let list = kvbench::cell_file::encode("[1, 2]").unwrap();
    std::fs::write(cells.join("array.json.gz"), list).unwrap();
    let (out, err) = sweep(dir.path(), &exp, &results, &["--tables-only"]);
    assert!(out.contains("runs.parquet (1 rows)"), "{out}");
    for f in [
        "broken.json",
        "list.json",
        "plain.json.gz",
        "cut.json.gz",
        "inside.json.gz",
        "array.json.gz",
    ] {
        assert!(
            err.lines()
                .any(|l| l.starts_with("warning:") && l.contains(f) && l.contains("skipped")),
            "{f}: {err}"
        );
    }
    for f in ["plain.json.gz", "cut.json.gz"] {
        assert!(
            err.lines()
                .any(|l| l.contains(f) && l.contains("not a complete gzip stream")),
            "{f}: {err}"
        );
    }
    assert_eq!(runs_rows(&exp_dir), 1);

    // The result cannot be written (its path is taken by a directory, as a full disk
    // would fail it): the sweep fails, and the measured result is on stderr.
    let id = planned(dir.path(), &exp)[0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let file = exp_dir.join(format!("cells/{id}.json.gz"));
    std::fs::remove_file(&file).unwrap();
    std::fs::create_dir(&file).unwrap();
    let o = kvbench(dir.path(), &common::sweep_args(&exp, &results));
    assert!(!o.status.success(), "{}", stdout(&o));
    let err = stderr(&o);
    assert!(err.contains("could not record cell 0"), "{err}");
    let json = err
        .lines()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no result on stderr: {err}"));
    let v: serde_json::Value = serde_json::from_str(json).unwrap();
    assert_eq!(v["id"], id.as_str());
    assert_eq!(v["outcome"], "ok");
    assert_eq!(v["metrics"]["num_requests"], 2);
    // No temporary file is left behind.
    assert!(files_in(&exp_dir.join("cells")).iter().all(|p| !p
        .file_name()
        .unwrap()
        .to_string_lossy()
        .starts_with(".tmp")));
    // Saved by hand where the message says, as printed, it is the cell's result.
    let by_hand = exp_dir.join(format!("cells/{id}.json"));
    assert!(
        err.contains(&format!("to be saved as {}", by_hand.display())),
        "{err}"
    );
    std::fs::remove_dir(&file).unwrap();
    std::fs::write(&by_hand, json).unwrap();
    let (out, _) = sweep(dir.path(), &exp, &results, &[]);
    assert!(out.contains("0 cells run, 1 already recorded"), "{out}");
}

#[test]
fn a_cell_asked_for_by_an_identity_the_yaml_no_longer_has_is_refused() {
    let (dir, exp) = common::with_experiment("e.yaml", ONE_CELL);
    let plan = planned(dir.path(), &exp);
    let id = plan[0]["id"].as_str().unwrap();
    let cell = |id: &str| {
        kvbench(
            dir.path(),
            &["run-cell", exp.to_str().unwrap(), "--cell", "0", "--id", id],
        )
    };
    let o = cell(id);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["id"], id);
    assert_eq!(v["cell"]["id"], id);
    // The YAML edited after the sweep listed its cells: the old identity is gone.
    std::fs::write(&exp, ONE_CELL.replace("num_requests: 2", "num_requests: 3")).unwrap();
    let o = cell(id);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(o.stdout.is_empty());
    assert!(
        stderr(&o).contains("the experiment changed while the sweep ran"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn a_yaml_edited_while_its_sweep_runs_stops_the_sweep_and_keeps_what_it_recorded() {
    // Cells of a second or so each, so that the edit lands while the sweep runs.
    let yaml = "name: moving\nmodel: preset:tiny\ndtype: f32\ndevice:\n  memory: 1GiB\nengines:\n  - name: full\nmatrix:\n  batch: [1, 2, 3, 4, 5, 6]\n  prompt_len: [32]\n  output_len: [64]\nworkload:\n  num_requests: 24\n";
    let (dir, exp) = common::with_experiment("m.yaml", yaml);
    let results = dir.path().join("results");
    let cells = results.join("moving/cells");
    let json = |p: &PathBuf| common::is_cell_gz(p);
    let child = common::kvbench_in(dir.path(), &common::sweep_args(&exp, &results))
        .env("KVBENCH_MODELS_DIR", dir.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !files_in(&cells).iter().any(json) && start.elapsed() < Duration::from_secs(120) {
        std::thread::sleep(Duration::from_millis(10));
    }
    std::fs::write(&exp, format!("{yaml}# edited\n")).unwrap();
    let o = child.wait_with_output().unwrap();
    let recorded = files_in(&cells).into_iter().filter(json).count();
    assert!(recorded >= 1, "nothing recorded");
    assert!(
        recorded < 6,
        "the sweep ended before the edit; make its cells longer"
    );
    assert!(!o.status.success(), "{}", stdout(&o));
    assert!(
        stderr(&o).contains("changed while the sweep ran"),
        "{}",
        stderr(&o)
    );
    // The edit changed no setting: the next run keeps the recorded cells.
    let (out, _) = sweep(dir.path(), &exp, &results, &[]);
    let expect = format!("{} cells run, {recorded} already recorded", 6 - recorded);
    assert!(out.contains(&expect), "{out}");
}

#[test]
fn a_sweep_whose_output_is_closed_early_still_writes_its_tables() {
    let (dir, exp) = common::with_experiment("e.yaml", ONE_CELL);
    let results = dir.path().join("results");
    // `kvbench run ... | true`: the reader is gone before anything is printed.
    let mut child = common::kvbench_in(dir.path(), &common::sweep_args(&exp, &results))
        .env("KVBENCH_MODELS_DIR", dir.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("kvbench runs");
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("kvbench ends");
    assert!(!stderr(&out).contains("panicked"), "{}", stderr(&out));
    assert_eq!(runs_rows(&results.join("edits")), 1);
}
