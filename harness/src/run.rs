//! `kvbench run EXP.yaml`: parse and check an experiment, expand its matrix into cells
//! and run each cell in a child process (`kvbench run-cell`), so that an out-of-memory
//! error, a panic or a device fault ends that cell, not the sweep. Each cell's result is
//! written atomically (temporary file, then rename) under `results/<name>/cells/`, as
//! gzip-compressed JSON (`<id>.json.gz`, [`crate::cell_file`]); a
//! sweep killed at any moment loses at most the cell in flight, and a re-run skips
//! cells already recorded under the same key unless `--force`.
//!
//! Two progress bars (indicatif, on stderr, hidden when stderr is not a terminal): one
//! over cells, one over the current cell's tokens, fed by the child's
//! `kvbench-progress` lines on its stderr. Every other line the child writes there is
//! printed above the bars and its end kept for the error of a cell whose process dies.

use crate::cell::{parse_progress, PROGRESS_ENV};
use crate::commands::run::RunArgs;
use crate::environment::BUILD_ID;
use crate::experiment::{Cell, Kind, Plan, SloSpec};
use anyhow::{bail, Context, Result};
use indicatif::{MultiProgress, ProgressBar, ProgressState, ProgressStyle};
use kvbench_datasets::tasks::Task;
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use xxhash_rust::xxh3::xxh3_64;

/// The result recorded in `dir` for exactly this cell (same identity), if any; the file
/// is named by the cell's identity alone, so that inserting an engine or an axis value
/// in the YAML renames nothing. An unreadable file is no result (the cell runs again and
/// replaces it); the cell held in two files is an error.
fn recorded(dir: &Path, c: &Cell) -> Result<Option<serde_json::Value>> {
    Ok(crate::cell_file::find(dir, &c.id)?
        .and_then(|f| crate::cell_file::read(&f).ok())
        .filter(|v| v["id"] == c.id.as_str()))
}

/// Write `bytes` to `path` durably: a uniquely named temporary file in the same
/// directory (two writers never share one), flushed to disk, then renamed into place;
/// on failure nothing is left behind.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let dir = path
        .parent()
        .with_context(|| format!("{}: no parent directory", path.display()))?;
    let mut tmp = tempfile::Builder::new()
        .prefix(".tmp-")
        .tempfile_in(dir)
        .with_context(|| format!("creating a temporary file in {}", dir.display()))?;
    tmp.write_all(bytes)
        .and_then(|_| tmp.as_file().sync_all())
        .with_context(|| format!("writing {}", tmp.path().display()))?;
    tmp.persist(path)
        .map_err(|e| e.error)
        .with_context(|| format!("renaming a temporary file to {}", path.display()))?;
    // The rename itself is durable once the directory is.
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Temporary files a killed sweep left in `dir` (nobody else writes there while the
/// lock is held).
fn remove_stale_temporaries(dir: &Path) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.file_name().to_string_lossy().starts_with(".tmp-") {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// An exclusive lock on an experiment's results directory, held while a sweep writes
/// to it: a second `kvbench run` on the same directory is refused instead of running
/// the same cells at once and recording contended timings. Released when dropped or
/// when the process dies.
pub struct ResultsLock {
    _file: std::fs::File,
}

impl ResultsLock {
    pub fn take(exp_dir: &Path) -> Result<Self> {
        use std::io::{Seek, Write};
        std::fs::create_dir_all(exp_dir)
            .with_context(|| format!("creating {}", exp_dir.display()))?;
        let path = exp_dir.join(".lock");
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let holder = std::fs::read_to_string(&path).unwrap_or_default();
                let holder = holder.trim();
                bail!(
                    "{}: another kvbench run (pid {}) is writing to this results directory; \
                     wait for it to end or stop it, or pass another --results",
                    exp_dir.display(),
                    if holder.is_empty() { "unknown" } else { holder }
                );
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(e).with_context(|| format!("locking {}", path.display()))
            }
        }
        file.set_len(0)
            .and_then(|_| file.rewind())
            .and_then(|_| writeln!(file, "{}", std::process::id()))
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(Self { _file: file })
    }
}

/// The exit status with which `run-cell` says that the experiment no longer has the
/// cell it was asked for (the YAML changed under a running sweep).
pub const EXIT_STALE_CELL: i32 = 3;

/// Characters of a dead child's stderr kept for its error message.
const TAIL_CHARS: usize = 2000;

/// Read a child's stderr line by line until it closes: progress lines go to
/// `on_progress(tokens, total)`, every other line to `on_line`. Returns the end of the
/// other lines (at most [`TAIL_CHARS`] characters) for the error of a failed cell.
fn pump_stderr(
    mut r: impl BufRead,
    mut on_progress: impl FnMut(u64, u64),
    mut on_line: impl FnMut(&str),
) -> String {
    let mut kept: VecDeque<String> = VecDeque::new();
    let mut kept_len = 0;
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match r.read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let line = String::from_utf8_lossy(&buf);
        let line = line.trim_end_matches(['\n', '\r']);
        if let Some((tokens, total)) = parse_progress(line) {
            on_progress(tokens, total);
            continue;
        }
        on_line(line);
        kept_len += line.len() + 1;
        kept.push_back(line.to_string());
        while kept_len > 4 * TAIL_CHARS && kept.len() > 1 {
            kept_len -= kept.pop_front().map_or(0, |l| l.len() + 1);
        }
    }
    let all = Vec::from(kept).join("\n");
    let n = all.chars().count();
    all.chars().skip(n.saturating_sub(TAIL_CHARS)).collect()
}

/// The bars of a sweep: cells, and the current cell's tokens.
struct Bars {
    multi: MultiProgress,
    cells: ProgressBar,
    tokens: ProgressBar,
}

impl Bars {
    fn new(cells: usize) -> Self {
        let multi = MultiProgress::new();
        let cells = multi.add(ProgressBar::new(cells as u64));
        cells.set_style(
            ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} cells {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        let tokens = multi.add(ProgressBar::new(0));
        tokens.set_style(
            ProgressStyle::with_template(
                "{elapsed_precise} [{bar:30}] {pos}/{len} tokens, {tok_per_s} tok/s, eta {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .with_key(
                "tok_per_s",
                |s: &ProgressState, w: &mut dyn std::fmt::Write| {
                    let _ = write!(w, "{:.0}", s.per_sec());
                },
            ),
        );
        Self {
            multi,
            cells,
            tokens,
        }
    }

    /// A line of the child's stderr, above the bars (plainly when they are hidden).
    fn println(&self, line: &str) {
        if self.multi.is_hidden() || self.multi.println(line).is_err() {
            eprintln!("{line}");
        }
    }
}

/// Make the child cell die with this process: a sweep killed with `kill -9` must not
/// leave its cell running, competing with the resumed sweep for cores and memory
/// (and on a GPU, causing a spurious out-of-memory). The signal fires when the thread
/// that spawned the child ends; cells are spawned from the sweep's main thread.
#[cfg(target_os = "linux")]
fn die_with_parent(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id();
    // SAFETY: between fork and exec only async-signal-safe calls (prctl, getppid).
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may have died before the prctl: then nobody waits for us.
            if libc::getppid() as u32 != parent {
                return Err(std::io::Error::other(
                    "the sweep ended before its cell started",
                ));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_parent(_cmd: &mut Command) {}

/// The binary the cells run: this process's own. On Linux that is /proc/self/exe,
/// which stays this build when a rebuild replaces the file during a sweep (the path
/// would then start another build's cells, or name a deleted file and fail).
fn own_binary() -> Result<PathBuf> {
    #[cfg(target_os = "linux")]
    {
        let p = PathBuf::from("/proc/self/exe");
        if p.exists() {
            return Ok(p);
        }
    }
    std::env::current_exe().context("locating the kvbench binary")
}

/// Run one cell in a child process; a child that dies without a result is recorded
/// as an `error` with the end of its stderr.
fn run_child(
    exp: &Path,
    c: &Cell,
    models_dir: &Path,
    data_dir: &Path,
    slo: Option<SloSpec>,
    bars: &Bars,
) -> Result<serde_json::Value> {
    let mut cmd = Command::new(own_binary()?);
    cmd.arg("run-cell")
        .arg(exp)
        .arg("--cell")
        .arg(c.index.to_string())
        .arg("--id")
        .arg(&c.id)
        .arg("--models-dir")
        .arg(models_dir)
        .arg("--data-dir")
        .arg(data_dir)
        // The child must plan the same cells (the SLO is in their identities).
        .args(
            slo.iter()
                .flat_map(|s| ["--slo".to_string(), s.to_string()]),
        )
        .env(PROGRESS_ENV, "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    die_with_parent(&mut cmd);
    let mut child = cmd.spawn().context("starting kvbench run-cell")?;
    // stdout on its own thread, so that neither pipe can fill while the other is read.
    let mut stdout = child.stdout.take().context("the child's stdout")?;
    let reader = std::thread::spawn(move || {
        let mut b = Vec::new();
        stdout.read_to_end(&mut b).map(|_| b)
    });
    let stderr = child.stderr.take().context("the child's stderr")?;
    bars.tokens.reset();
    bars.tokens.set_length(0);
    let tail = pump_stderr(
        BufReader::new(stderr),
        |tokens, total| {
            bars.tokens.set_length(total);
            bars.tokens.set_position(tokens);
        },
        |line| bars.println(line),
    );
    let status = child.wait().context("waiting for kvbench run-cell")?;
    let stdout = reader
        .join()
        .map_err(|_| anyhow::anyhow!("reading the cell's output panicked"))?
        .context("reading the cell's output")?;
    if status.success() {
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&stdout) {
            return Ok(v);
        }
    }
    if status.code() == Some(EXIT_STALE_CELL) {
        // Not a result of this cell: the sweep stops rather than record one.
        bail!("{}", tail.trim());
    }
    Ok(serde_json::json!({
        "id": c.id,
        "key": c.key(),
        "cell": c,
        "outcome": "error",
        "error": format!("the cell's process ended with {}: {}", status, tail.trim()),
        "metrics": null,
    }))
}

/// The order cells run in: in rounds of repeats (repeat 0 of every point in the plan's
/// order, then repeat 1, …). A machine whose speed drifts during a sweep (another
/// tenant, a thermal limit) then slows every point's repeats alike instead of the
/// points that happen to run last, so each point's best repeat and its ratio to
/// another point of the same run are measured under the same conditions.
fn run_order<'a>(cells: &[&'a Cell]) -> Vec<&'a Cell> {
    let mut order = cells.to_vec();
    order.sort_by_key(|c| (c.repeat, c.index));
    order
}

/// The evaluation data an accuracy or retention experiment reads, checked before
/// its first cell (and by `--dry-run`): a missing directory or file is one clear
/// error, not one per cell.
pub(crate) fn check_data(plan: &Plan, data_dir: &Path) -> Result<()> {
    match plan.exp.kind {
        Kind::Performance => {}
        Kind::Accuracy => {
            // Every task's files before the first cell: a missing directory is one
            // clear error, not one per cell.
            let a = plan.exp.accuracy.as_ref().context("the accuracy section")?;
            for t in &a.tasks {
                let task: Task = t.parse().map_err(anyhow::Error::msg)?;
                for f in task.files() {
                    let p = data_dir.join(f);
                    if !p.is_file() {
                        bail!(
                            "{task}: {} not found in the evaluation data directory {}: {}",
                            p.display(),
                            data_dir.display(),
                            kvbench_datasets::FETCH_HINT
                        );
                    }
                }
            }
        }
        Kind::Retention => {
            let r = plan
                .exp
                .retention
                .as_ref()
                .context("the retention section")?;
            crate::cell::retention::check_data(&r.form, data_dir)?;
        }
    }
    Ok(())
}

pub(crate) fn sweep(a: &RunArgs, plan: &Plan, cells: &[&Cell]) -> Result<()> {
    let data_dir = plan.data_dir(a.data_dir.as_deref());
    check_data(plan, &data_dir)?;
    let exp_dir = a.results.join(&plan.exp.name);
    let _lock = ResultsLock::take(&exp_dir)?;
    let dir = exp_dir.join("cells");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    remove_stale_temporaries(&dir);
    // A cell held twice (plain and compressed) stops the sweep before it runs anything.
    crate::cell_file::list(&dir)?;
    // Every distinct YAML a cell was run from, by hash (the cell records it), and the
    // latest as experiment.yaml for the figures and the report.
    let file = Plan::resolve(&a.experiment);
    let spec = std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
    let spec_hash = format!("{:016x}", xxh3_64(&spec));
    let specs = exp_dir.join("specs");
    std::fs::create_dir_all(&specs).with_context(|| format!("creating {}", specs.display()))?;
    let kept = specs.join(format!("{spec_hash}.yaml"));
    if !kept.is_file() {
        write_atomic(&kept, &spec)?;
    }
    write_atomic(&exp_dir.join("experiment.yaml"), &spec)?;
    tidy_cells(a, plan, &exp_dir)?;
    let bars = Bars::new(cells.len());
    let bar = &bars.cells;
    let mut rows = Vec::new();
    let (mut skipped, mut ran, mut retried, mut rebuilt, mut moved) = (0, 0, 0, 0, 0);
    // The processor this sweep's cells run on; a cell recorded on another one (both
    // known and different) is not this machine's result.
    let here = (!a.keep_other_processors)
        .then(|| crate::environment::processor(&plan.exp.device.name))
        .flatten();
    for c in run_order(cells) {
        if let Some(v) = recorded(&dir, c)?.filter(|_| !a.force) {
            let elsewhere = here
                .as_deref()
                .and_then(|h| crate::environment::recorded_processor(&v).filter(|r| *r != h));
            if let Some(other) = elsewhere {
                if moved == 0 {
                    bars.println(&format!(
                        "cells recorded on another processor ({other}, this one {}) are run \
                         again; --keep-other-processors keeps them",
                        here.as_deref().unwrap_or_default()
                    ));
                }
                moved += 1;
            } else if !a.keep_other_builds && v["env"]["build"].as_str() != Some(BUILD_ID) {
                // Recorded by other code (or before builds were recorded): not this
                // build's result, so it is measured again.
                if rebuilt == 0 {
                    bars.println(&format!(
                        "cells recorded by another build of kvbench (build {}, this one {BUILD_ID}) \
                         are run again; --keep-other-builds keeps them",
                        v["env"]["build"].as_str().unwrap_or("not recorded")
                    ));
                }
                rebuilt += 1;
            } else if a.no_retry || v["outcome"] != "error" {
                let mut v = v;
                // Shown under its place in today's plan.
                v["cell"]["index"] = c.index.into();
                skipped += 1;
                bar.inc(1);
                rows.push(v);
                continue;
            } else {
                retried += 1;
            }
        }
        // The YAML must still be the one the plan came from: a cell run from an
        // edited file would be recorded under an identity that is not its own.
        if std::fs::read(&file).ok().as_deref() != Some(&spec[..]) {
            bail!(
                "{} changed while the sweep ran; {ran} cells were recorded and are kept; \
                 run again to continue with the new version",
                file.display()
            );
        }
        if ran == 0 && crate::recorder::remove_tables(&exp_dir)? > 0 {
            bars.println(&format!(
                "tables of {} removed until the sweep ends (rebuilt from cells/ then, or with --tables-only)",
                exp_dir.display()
            ));
        }
        bar.set_message(format!(
            "cell {} {} b{} budget {}",
            c.index, c.engine, c.batch, c.budget
        ));
        let mut v = run_child(&a.experiment, c, &a.models_dir, &data_dir, a.slo, &bars)?;
        v["spec"] = spec_hash.clone().into();
        let json = serde_json::to_string(&v)?;
        if let Err(e) = crate::cell_file::write(&dir, &c.id, &json) {
            // The measurement is not lost with the write (a full disk, say); saved as
            // it is printed, plain JSON, the file is read like a compressed one.
            bars.println(&format!(
                "could not record cell {} ({e:#}); its result follows, to be saved as {}:\n{json}",
                c.index,
                dir.join(format!("{}{}", c.id, crate::cell_file::PLAIN))
                    .display()
            ));
            return Err(e);
        }
        ran += 1;
        rows.push(v);
        bar.inc(1);
    }
    bars.tokens.finish_and_clear();
    bar.finish_and_clear();
    // Listed in the plan's order, whatever order they ran in.
    rows.sort_by_key(|v| v["cell"]["index"].as_u64());
    // The tables first: nothing printed below can lose them (a closed pipe ends the
    // process).
    let tables = crate::recorder::write_tables(&exp_dir, &plan.cells)?;
    println!(
        "{}: {} cells run{}, {} already recorded (under {})",
        plan.exp.name,
        ran,
        [
            (retried > 0).then(|| format!("{retried} retried after an error")),
            (rebuilt > 0).then(|| format!("{rebuilt} recorded by another build, run again")),
            (moved > 0).then(|| format!("{moved} recorded on another processor, run again")),
        ]
        .into_iter()
        .flatten()
        .map(|s| format!(" ({s})"))
        .collect::<String>(),
        skipped,
        dir.display()
    );
    print_written_tables(&exp_dir, plan, &a.experiment, &tables);
    if plan.exp.kind == Kind::Accuracy {
        print_accuracy(&rows);
        println!(
            "results: {} (cells/, runs.parquet and accuracy.parquet)\n\
             figures: kvbench plot {0}   (just figures {1})\n\
             report:  kvbench report {0}   (just report {1})",
            exp_dir.display(),
            plan.exp.name
        );
        return errors_left(&rows);
    }
    println!(
        "{:>5}  {:<10} {:<16} {:>5} {:>6} {:<8} {:<6} {:>10} {:>12} {:>10} {:>11} {:>11}",
        "cell",
        "engine",
        "params",
        "batch",
        "budget",
        "attn",
        "result",
        "TTFT s",
        "decode tok/s",
        "E2E p50 s",
        "KV dev MiB",
        "RSS MiB"
    );
    let f = |v: &serde_json::Value| v.as_f64().map_or("-".to_string(), |x| format!("{x:.3}"));
    let mib = |v: &serde_json::Value| {
        v.as_f64()
            .map_or("-".to_string(), |x| format!("{:.1}", x / 1048576.0))
    };
    for v in &rows {
        let c = &v["cell"];
        let m = &v["metrics"];
        println!(
            "{:>5}  {:<10} {:<16} {:>5} {:>6} {:<8} {:<6} {:>10} {:>12} {:>10} {:>11} {:>11}",
            c["index"].to_string(),
            c["engine"].as_str().unwrap_or("?"),
            params_of(c),
            c["batch"].to_string(),
            c["budget"].to_string(),
            c["attention"].as_str().unwrap_or("?"),
            v["outcome"].as_str().unwrap_or("?"),
            f(&m["ttft_s"]["mean"]),
            f(&m["decode_throughput"]),
            f(&m["e2e_s"]["p50"]),
            mib(&v["memory"]["kv_device"]),
            mib(&v["process_rss_peak_bytes"]),
        );
    }
    println!(
        "results: {} (cells/ and runs, requests, steps, samples .parquet)\n\
         figures: kvbench plot {0}   (just figures {1})\n\
         report:  kvbench report {0}   (just report {1})",
        exp_dir.display(),
        plan.exp.name
    );
    errors_left(&rows)
}

/// A sweep whose cells ended in `error` (a crash, a refused configuration) fails after
/// its tables are written, naming them: their results are recorded, and a run again
/// retries them (`--no-retry` keeps them as they are).
fn errors_left(rows: &[serde_json::Value]) -> Result<()> {
    let errors: Vec<String> = rows
        .iter()
        .filter(|v| v["outcome"] == "error")
        .map(|v| {
            let c = &v["cell"];
            let why = v["error"].as_str().unwrap_or("no message");
            format!(
                "cell {} ({} b{} budget {}): {}",
                c["index"],
                c["engine"].as_str().unwrap_or("?"),
                c["batch"],
                c["budget"],
                why.lines().next().unwrap_or(why)
            )
        })
        .collect();
    if errors.is_empty() {
        return Ok(());
    }
    const SHOWN: usize = 5;
    bail!(
        "{} of {} cells ended in an error (recorded; `kvbench run` again retries them):\n  {}{}",
        errors.len(),
        rows.len(),
        errors[..errors.len().min(SHOWN)].join("\n  "),
        if errors.len() > SHOWN { "\n  ..." } else { "" }
    )
}

/// A cell's parameters as `k=v,k=v` (`-` for the engine's defaults), so variants of
/// one engine read apart in the summaries.
fn params_of(c: &serde_json::Value) -> String {
    let p: Vec<String> = c["params"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| {
                    format!(
                        "{k}={}",
                        v.as_str().map_or_else(|| v.to_string(), str::to_string)
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    if p.is_empty() {
        "-".into()
    } else {
        p.join(",")
    }
}

/// One line per accuracy cell: its task, mode and scores.
fn print_accuracy(rows: &[serde_json::Value]) {
    println!(
        "{:>5}  {:<10} {:<16} {:>6} {:<11} {:<9} {:<6} {:>5} {:>15} {:>15} {:>8}",
        "cell",
        "engine",
        "params",
        "budget",
        "task",
        "mode",
        "result",
        "items",
        "acc ± se",
        "acc_norm ± se",
        "wall s"
    );
    let pm = |v: &serde_json::Value, se: &serde_json::Value| match (v.as_f64(), se.as_f64()) {
        (Some(x), Some(e)) => format!("{x:.3} ± {e:.3}"),
        (Some(x), None) => format!("{x:.3}"),
        _ => "-".into(),
    };
    for v in rows {
        let c = &v["cell"];
        let s = &v["accuracy"];
        println!(
            "{:>5}  {:<10} {:<16} {:>6} {:<11} {:<9} {:<6} {:>5} {:>15} {:>15} {:>8}",
            c["index"].to_string(),
            c["engine"].as_str().unwrap_or("?"),
            params_of(c),
            c["budget"].to_string(),
            c["task"].as_str().unwrap_or("?"),
            c["mode"].as_str().unwrap_or("?"),
            v["outcome"].as_str().unwrap_or("?"),
            s["items"].as_u64().map_or("-".into(), |n| n.to_string()),
            pm(&s["acc"], &s["acc_stderr"]),
            pm(&s["acc_norm"], &s["acc_norm_stderr"]),
            v["wall_s"]
                .as_f64()
                .map_or("-".into(), |w| format!("{w:.1}")),
        );
    }
}

/// Rebuild the experiment's Parquet tables from the recorded results of the plan's
/// cells and say what they hold, which files were left out and why.
pub(crate) fn print_tables(exp_dir: &Path, plan: &Plan, yaml: &Path) -> Result<()> {
    let t = crate::recorder::write_tables(exp_dir, &plan.cells)?;
    print_written_tables(exp_dir, plan, yaml, &t);
    Ok(())
}

/// What [`crate::recorder::write_tables`] wrote (`t`), and the cell files it left out.
fn print_written_tables(exp_dir: &Path, plan: &Plan, yaml: &Path, t: &crate::recorder::Tables) {
    println!(
        "tables in {}: {}",
        exp_dir.display(),
        t.counts
            .iter()
            .map(|(t, n)| format!("{t}.parquet ({n} rows)"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    for (f, why) in &t.unreadable {
        eprintln!(
            "warning: {}: skipped, not a cell result: {why}",
            f.display()
        );
    }
    // This plan's cells recorded with another thread count, by that count; the rest
    // belong to no cell of it.
    let mut theirs: std::collections::BTreeMap<usize, usize> = Default::default();
    let mut rest = Vec::new();
    for f in &t.foreign {
        match crate::cell_file::read(f)
            .ok()
            .and_then(|v| plan_cell_with_other_threads(plan, &v))
        {
            Some(threads) => *theirs.entry(threads).or_default() += 1,
            None => rest.push(f),
        }
    }
    if !rest.is_empty() {
        const SHOWN: usize = 5;
        let names: Vec<String> = rest
            .iter()
            .take(SHOWN)
            .map(|f| {
                f.file_name()
                    .map_or(String::new(), |n| n.to_string_lossy().into_owned())
            })
            .collect();
        eprintln!(
            "note: {} file(s) in {} belong to no cell of this experiment (an older version \
             of its YAML, or recorded by an older kvbench) and are not in the tables: {}{}; \
             `kvbench run {} --prune` moves them to pruned/",
            rest.len(),
            exp_dir.join("cells").display(),
            names.join(", "),
            if rest.len() > SHOWN { ", ..." } else { "" },
            yaml.display(),
        );
    }
    let here = candle_core::utils::get_num_threads();
    for (threads, n) in theirs {
        eprintln!(
            "note: {n} file(s) in {} are this plan's cells recorded with {threads} CPU worker \
             threads (this process has {here}; a cell's identity includes them) and are not \
             in the tables: `--threads {threads}` puts them there",
            exp_dir.join("cells").display(),
        );
    }
}

/// The thread count a recorded cell `v` ran with, when it is not this process's and
/// the cell is one of `plan`'s under it (a cell's identity includes its threads). Cells
/// recorded before `env.threads` existed ran with one thread per core.
fn plan_cell_with_other_threads(plan: &Plan, v: &serde_json::Value) -> Option<usize> {
    let id = v["id"].as_str()?;
    let env = &v["env"];
    let threads = env["threads"].as_u64().or(env["cpu_cores"].as_u64())? as usize;
    (threads != candle_core::utils::get_num_threads()
        && plan
            .cells
            .iter()
            .any(|c| crate::experiment::matrix::identity(&plan.exp, c, threads) == id))
    .then_some(threads)
}

/// `--adopt-legacy` and `--prune`: cell files recorded before cell identities existed
/// take the identity of the plan's cell with their key; files of no plan cell move to
/// pruned/.
pub(crate) fn tidy_cells(a: &RunArgs, plan: &Plan, exp_dir: &Path) -> Result<()> {
    if !a.adopt_legacy && !a.prune {
        return Ok(());
    }
    let dir = exp_dir.join("cells");
    let by_key: std::collections::HashMap<String, &Cell> =
        plan.cells.iter().map(|c| (c.key(), c)).collect();
    let ids: std::collections::HashSet<&str> = plan.cells.iter().map(|c| c.id.as_str()).collect();
    let (mut adopted, mut pruned) = (0, 0);
    // This plan's cells recorded with another thread count: never pruned.
    let mut other_threads: std::collections::BTreeMap<usize, usize> = Default::default();
    for f in crate::cell_file::list(&dir)? {
        let v = crate::cell_file::read(&f).ok();
        if let Some(v) = &v {
            if v["id"].as_str().is_some_and(|id| ids.contains(id)) {
                continue;
            }
            if let Some(threads) = plan_cell_with_other_threads(plan, v) {
                *other_threads.entry(threads).or_default() += 1;
                continue;
            }
            if a.adopt_legacy && v.get("id").is_none() {
                if let Some(c) = v["key"].as_str().and_then(|k| by_key.get(k)) {
                    if crate::cell_file::find(&dir, &c.id)?.is_none() {
                        let mut v = v.clone();
                        v["id"] = c.id.clone().into();
                        v["adopted_legacy"] = true.into();
                        crate::cell_file::write(&dir, &c.id, &serde_json::to_string(&v)?)?;
                        std::fs::remove_file(&f)
                            .with_context(|| format!("removing {}", f.display()))?;
                        adopted += 1;
                        continue;
                    }
                }
            }
        }
        if a.prune {
            let aside = exp_dir.join("pruned");
            std::fs::create_dir_all(&aside)
                .with_context(|| format!("creating {}", aside.display()))?;
            let to = aside.join(f.file_name().context("a cell file's name")?);
            std::fs::rename(&f, &to)
                .with_context(|| format!("moving {} to {}", f.display(), to.display()))?;
            pruned += 1;
        }
    }
    if a.adopt_legacy {
        println!("{adopted} cell(s) recorded by an older kvbench adopted by their key");
    }
    if a.prune {
        println!(
            "{pruned} file(s) of no cell of this experiment moved to {}",
            exp_dir.join("pruned").display()
        );
        for (threads, n) in other_threads {
            println!(
                "{n} file(s) kept: this plan's cells recorded with {threads} CPU worker threads \
                 (this process has {}); `--threads {threads}` reads them",
                candle_core::utils::get_num_threads()
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cell::progress_line;

    #[test]
    fn cells_run_in_rounds_of_repeats() {
        let text = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../experiments/ci/sweep.yaml"),
        )
        .unwrap();
        let plan = Plan::parse(&text, Path::new("sweep.yaml"), Path::new("models")).unwrap();
        let cells: Vec<&Cell> = plan.cells.iter().collect();
        let repeats = plan.exp.repeats;
        let points = cells.len() / repeats;
        assert!(repeats > 1 && points > 1);
        let order = run_order(&cells);
        assert_eq!(order.len(), cells.len());
        // Round r holds repeat r of every point, in the plan's order of points.
        for (round, chunk) in order.chunks(points).enumerate() {
            assert!(chunk.iter().all(|c| c.repeat == round), "round {round}");
            let distinct: std::collections::BTreeSet<&str> =
                chunk.iter().map(|c| c.point.as_str()).collect();
            assert_eq!(distinct.len(), points, "every point once in round {round}");
            assert!(chunk.windows(2).all(|w| w[0].index < w[1].index));
        }
    }

    #[test]
    fn progress_lines_round_trip_and_anything_else_is_not_one() {
        assert_eq!(parse_progress(&progress_line(12, 340)), Some((12, 340)));
        assert_eq!(
            parse_progress("kvbench-progress tokens=0 total=7\r\n"),
            Some((0, 7))
        );
        for other in [
            "",
            "kvbench-progress",
            "kvbench-progress tokens=3",
            "kvbench-progress tokens=x total=4",
            "kvbench-progress tokens=-1 total=4",
            "kvbench-progress tokens=1 total=4 eta=2",
            " kvbench-progress tokens=1 total=4",
            "calibrated InfiniGen skewing on 2048 tokens",
        ] {
            assert_eq!(parse_progress(other), None, "{other:?}");
        }
    }

    #[test]
    fn the_parent_feeds_progress_to_the_bar_and_keeps_every_other_line() {
        let mut input = Vec::new();
        input.extend(b"kvbench-progress tokens=0 total=100\n");
        input.extend(b"calibrated InfiniGen skewing\n");
        input.extend(b"kvbench-progress tokens=40 total=100\r\n");
        input.extend(b"kvbench-progress tokens=oops total=100\n");
        input.extend(b"bad byte \xff here\n");
        input.extend(b"kvbench-progress tokens=100 total=100\n");
        input.extend(b"thread 'main' panicked at the end"); // no final newline
        let mut progress = Vec::new();
        let mut lines = Vec::new();
        let tail = pump_stderr(
            std::io::Cursor::new(input),
            |n, m| progress.push((n, m)),
            |l| lines.push(l.to_string()),
        );
        assert_eq!(progress, [(0, 100), (40, 100), (100, 100)]);
        assert_eq!(
            lines,
            [
                "calibrated InfiniGen skewing",
                "kvbench-progress tokens=oops total=100",
                "bad byte \u{fffd} here",
                "thread 'main' panicked at the end",
            ]
        );
        assert_eq!(tail, lines.join("\n"));
        // A long stderr keeps its last TAIL_CHARS characters.
        let long: String = (0..1000).map(|i| format!("line {i}\n")).collect();
        let tail = pump_stderr(std::io::Cursor::new(long.clone()), |_, _| {}, |_| {});
        assert_eq!(tail.chars().count(), TAIL_CHARS);
        assert!(long.trim_end().ends_with(&tail), "{tail}");
        assert!(tail.ends_with("line 999"));
    }
}
