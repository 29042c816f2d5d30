//! The expansion of an experiment into cells (one point of the matrix × one repeat, per
//! kind) and each cell's identity.

use super::locate::{item_line, key_error, scalar};
use super::spec::*;
use super::Plan;
use anyhow::{Context, Result};
use kvbench_datasets::tasks::Task;
use kvbench_engines::attention::prefill::AttentionImpl;
use kvbench_engines::policy::spec::PolicySpec;
use std::collections::BTreeMap;
use std::path::Path;
use xxhash_rust::xxh3::xxh3_128;

/// Version of what [`identity`] hashes: bumped when its meaning changes, so results
/// recorded under another meaning are not taken for this one's.
const IDENTITY_VERSION: u32 = 1;

/// A cell's identity: a hash of everything that can change its result. That is the
/// cell's own values (engine, parameters, axes, repeat, the SLO of its goodput, absent
/// when none is set) and the settings the whole
/// experiment shares (model, dtype, seed, device and memory, workload, warm-up,
/// scheduler, the retention task's form, facts and turns), the CPU worker threads and
/// the engines' kernel switches that are set (`kvbench_engines::KERNEL_SWITCHES`;
/// none set adds nothing, so identities recorded before switches counted still hold).
/// Left out: the cell's index, the experiment's name, the other cells (so adding an
/// engine or an axis value keeps every other cell's identity) and where the data
/// lives (a path differs between machines that share a sweep).
pub fn identity(exp: &Experiment, cell: &Cell, threads: usize) -> String {
    settings_hash(exp, cell, threads, true)
}

/// [`identity`], with or without the repeat.
fn settings_hash(exp: &Experiment, cell: &Cell, threads: usize, repeat: bool) -> String {
    let mut own = serde_json::to_value(cell).unwrap_or_default();
    if let serde_json::Value::Object(m) = &mut own {
        m.remove("index");
        m.remove("id");
        m.remove("point");
        if !repeat {
            m.remove("repeat");
        }
    }
    let retention = exp.retention.as_ref().map(|r| {
        // Buckets, budgets, limit, batch and attention are the cell's own values.
        serde_json::json!({"form": r.form, "facts": r.facts, "turns": r.turns})
    });
    let mut all = serde_json::json!({
        "identity": IDENTITY_VERSION,
        "kind": exp.kind,
        "cell": own,
        "model": exp.model,
        "dtype": exp.dtype,
        "seed": exp.seed,
        "device": exp.device,
        "workload": exp.workload,
        "warmup": exp.warmup,
        "scheduler": exp.scheduler,
        "retention": retention,
        "threads": threads,
    });
    // Only when set, so that the cells of experiments without it keep their identity.
    if let Some(t) = exp.warmup_tokens {
        all["warmup_tokens"] = serde_json::json!(t);
    }
    let switches = kvbench_engines::kernel_switches();
    if !switches.is_empty() {
        all["switches"] = serde_json::json!(switches);
    }
    format!("{:032x}", xxh3_128(all.to_string().as_bytes()))
}

/// The files of a workload corpus, as the cells read them: `src` itself, or every
/// `.txt` file of the directory `src` in name order (none is an error).
pub(crate) fn corpus_files(src: &Path) -> std::result::Result<Vec<std::path::PathBuf>, String> {
    if !src.is_dir() {
        return Ok(vec![src.to_path_buf()]);
    }
    let entries = std::fs::read_dir(src).map_err(|e| format!("{}: {e}", src.display()))?;
    let mut f: Vec<_> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "txt"))
        .collect();
    if f.is_empty() {
        return Err(format!(
            "{}: no .txt files in the directory: expected UTF-8 text files",
            src.display()
        ));
    }
    f.sort();
    Ok(f)
}

/// A workload corpus the cells can slice prompts from: a non-empty UTF-8 text file, or
/// a directory with at least one `.txt` file, each such (what the cells read).
fn check_corpus(src: &Path) -> std::result::Result<(), String> {
    for f in corpus_files(src)? {
        let bytes = std::fs::read(&f).map_err(|e| format!("{}: {e}", f.display()))?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Err(format!(
                "{}: no text: expected a UTF-8 text file",
                f.display()
            ));
        }
        if let Err(e) = std::str::from_utf8(&bytes) {
            return Err(format!(
                "{}: not UTF-8 text (invalid byte at offset {}): expected a UTF-8 text file",
                f.display(),
                e.valid_up_to()
            ));
        }
    }
    Ok(())
}

/// Set every cell's identity and point (with this process's CPU worker threads).
pub(super) fn identify(exp: &Experiment, cells: &mut [Cell]) {
    let threads = candle_core::utils::get_num_threads();
    for c in cells {
        c.id = identity(exp, c, threads);
        c.point = settings_hash(exp, c, threads, false);
    }
}

impl Plan {
    /// Engines with their parameters, each checked at every budget it will run with
    /// (`full` runs once, at 1).
    #[allow(clippy::type_complexity)]
    pub(super) fn engines(
        exp: &Experiment,
        text: &str,
        path: &Path,
        budgets: &[f64],
    ) -> Result<Vec<(String, BTreeMap<String, String>, Vec<f64>)>> {
        let file = path.display();
        let err = |key: &str, msg: String| key_error(path, text, key, msg);
        let mut engines = Vec::new();
        for (i, e) in exp.engines.iter().enumerate() {
            let key = format!("engines[{i}]");
            let mut params = BTreeMap::new();
            for (k, v) in &e.params {
                let v = scalar(v).ok_or_else(|| {
                    err(
                        &format!("{key}.params"),
                        format!("`{k}`: expected a number, a string or a boolean"),
                    )
                })?;
                params.insert(k.clone(), v);
            }
            let pairs: Vec<(String, String)> =
                params.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            // A strategy that takes no budget (`full`) runs once, at 1.
            let budgeted =
                kvbench_engines::policy::registry::lookup(&e.name).is_none_or(|s| s.budgeted);
            let budgets: Vec<f64> = if !budgeted {
                vec![1.0]
            } else {
                budgets.to_vec()
            };
            for &b in &budgets {
                PolicySpec::parse(&e.name, b, &pairs).map_err(|x| {
                    let at =
                        item_line(text, "engines", i).map_or(String::new(), |l| format!(":{l}"));
                    anyhow::anyhow!("{file}{at}: `{key}` (`{}`): {x}", e.name)
                })?;
            }
            engines.push((e.name.clone(), params, budgets));
        }
        Ok(engines)
    }

    /// Budgets in (0, 1], a non-empty list.
    pub(super) fn check_budgets(
        budgets: &[f64],
        key: &str,
        err: &dyn Fn(&str, String) -> anyhow::Error,
    ) -> Result<()> {
        if budgets.is_empty() {
            return Err(err(key, "expected a non-empty list".into()));
        }
        if let Some(b) = budgets.iter().find(|&&b| !(b > 0.0 && b <= 1.0)) {
            return Err(err(
                key,
                format!("{b}: expected a fraction of KV pairs kept, in (0, 1]"),
            ));
        }
        Ok(())
    }

    pub(super) fn accuracy_cells(
        exp: &Experiment,
        text: &str,
        path: &Path,
        context: usize,
    ) -> Result<Vec<Cell>> {
        let err = |key: &str, msg: String| key_error(path, text, key, msg);
        let a = exp
            .accuracy
            .as_ref()
            .context("an accuracy experiment needs an `accuracy:` section")?;
        if a.tasks.is_empty() {
            return Err(err(
                "accuracy.tasks",
                format!("expected a non-empty list of {}", task_names()),
            ));
        }
        let mut tasks: Vec<Task> = Vec::new();
        for t in &a.tasks {
            let task: Task = t.parse().map_err(|e: String| err("accuracy.tasks", e))?;
            if tasks.contains(&task) {
                return Err(err("accuracy.tasks", format!("`{t}` is listed twice")));
            }
            tasks.push(task);
        }
        if a.limit == Some(0) {
            return Err(err(
                "accuracy.limit",
                "0: expected at least 1 item per task (or no limit)".into(),
            ));
        }
        Self::check_budgets(&a.budgets, "accuracy.budgets", &err)?;
        if a.modes.is_empty() {
            return Err(err(
                "accuracy.modes",
                "expected a non-empty list of decode, one_pass".into(),
            ));
        }
        if a.batch == 0 {
            return Err(err("accuracy.batch", "0: expected at least 1".into()));
        }
        a.attention
            .parse::<AttentionImpl>()
            .map_err(|e| err("accuracy.attention", e.to_string()))?;
        if context < 64 {
            return Err(err(
                "scheduler.max_model_len",
                format!("{context}: too short to score the tasks' items (expected ≥ 64)"),
            ));
        }
        let engines = Self::engines(exp, text, path, &a.budgets)?;
        let mut cells = Vec::new();
        for (name, params, budgets) in &engines {
            for &budget in budgets {
                for &mode in &a.modes {
                    for &task in &tasks {
                        for repeat in 0..exp.repeats {
                            cells.push(Cell {
                                index: cells.len(),
                                id: String::new(),
                                point: String::new(),
                                engine: name.clone(),
                                params: params.clone(),
                                batch: a.batch,
                                prompt_len: None,
                                output_len: None,
                                budget,
                                attention: a.attention.clone(),
                                chunk_size: None,
                                request_rate: f64::INFINITY,
                                burstiness: 1.0,
                                max_concurrency: None,
                                slo: None,
                                repeat,
                                task: Some(task.name().to_string()),
                                mode: Some(mode),
                                limit: a.limit,
                                bucket: None,
                            });
                        }
                    }
                }
            }
        }
        Ok(cells)
    }

    pub(super) fn retention_cells(
        exp: &Experiment,
        text: &str,
        path: &Path,
        context: usize,
    ) -> Result<Vec<Cell>> {
        let err = |key: &str, msg: String| key_error(path, text, key, msg);
        let r = exp
            .retention
            .as_ref()
            .context("a retention experiment needs a `retention:` section")?;
        if r.buckets.is_empty() {
            return Err(err(
                "retention.buckets",
                "expected a non-empty list such as [1K-2K, 2K-4K]".into(),
            ));
        }
        let mut seen = BTreeMap::new();
        for b in &r.buckets {
            let (lo, hi) = parse_bucket(b).map_err(|e| err("retention.buckets", e))?;
            // A conversation is built to reach the bucket's length: past the context
            // every cell of it would end in an error.
            if hi > context {
                return Err(err(
                    "retention.buckets",
                    format!("`{b}`: reaches {hi} tokens, past the model's context of {context}"),
                ));
            }
            if let Some(first) = seen.insert((lo, hi), b) {
                return Err(err(
                    "retention.buckets",
                    format!("`{first}` and `{b}` are the same bucket"),
                ));
            }
        }
        if r.turns.is_empty() || r.turns.contains(&0) || !r.turns.windows(2).all(|w| w[0] < w[1]) {
            return Err(err(
                "retention.turns",
                format!(
                    "{:?}: expected a non-empty, increasing list of turns ≥ 1",
                    r.turns
                ),
            ));
        }
        match (r.facts, r.form.as_str()) {
            (Some(0), _) => {
                return Err(err("retention.facts", "0: expected at least 1 fact".into()))
            }
            (None, "chat") => {
                return Err(err(
                    "retention",
                    "the chat form needs `facts`: distinct facts cycled over the conversations"
                        .into(),
                ))
            }
            _ => {}
        }
        if !["chat", "passkey"].contains(&r.form.as_str()) {
            return Err(err(
                "retention.form",
                format!("`{}`: expected chat or passkey", r.form),
            ));
        }
        // The builder's rules, checked before anything runs.
        if r.form == "chat" && r.turns.iter().any(|&t| t < 2) {
            return Err(err(
                "retention.turns",
                format!(
                    "{:?}: expected turns ≥ 2 for the chat form (turn 1 states the fact)",
                    r.turns
                ),
            ));
        }
        if r.form == "passkey" && r.turns != [1] {
            return Err(err(
                "retention.turns",
                format!(
                    "{:?}: expected [1] for the passkey form (the key and the question share \
                     one message)",
                    r.turns
                ),
            ));
        }
        if r.limit == Some(0) {
            return Err(err(
                "retention.limit",
                "0: expected at least 1 conversation per bucket".into(),
            ));
        }
        Self::check_budgets(&r.budgets, "retention.budgets", &err)?;
        if r.batch == 0 {
            return Err(err("retention.batch", "0: expected at least 1".into()));
        }
        r.attention
            .parse::<AttentionImpl>()
            .map_err(|e| err("retention.attention", e.to_string()))?;
        let engines = Self::engines(exp, text, path, &r.budgets)?;
        let mut cells = Vec::new();
        for (name, params, budgets) in &engines {
            for &budget in budgets {
                for bucket in &r.buckets {
                    for repeat in 0..exp.repeats {
                        cells.push(Cell {
                            index: cells.len(),
                            id: String::new(),
                            point: String::new(),
                            engine: name.clone(),
                            params: params.clone(),
                            batch: r.batch,
                            prompt_len: None,
                            output_len: None,
                            budget,
                            attention: r.attention.clone(),
                            chunk_size: None,
                            request_rate: f64::INFINITY,
                            burstiness: 1.0,
                            max_concurrency: None,
                            slo: None,
                            repeat,
                            task: None,
                            mode: None,
                            limit: r.limit,
                            bucket: Some(bucket.clone()),
                        });
                    }
                }
            }
        }
        Ok(cells)
    }

    pub(super) fn performance_cells(
        exp: &Experiment,
        text: &str,
        path: &Path,
        context: usize,
    ) -> Result<Vec<Cell>> {
        let err = |key: &str, msg: String| key_error(path, text, key, msg);
        let w = exp
            .workload
            .as_ref()
            .context("a performance experiment needs a `workload:` section")?;
        match (w.num_requests, w.batches) {
            (Some(_), Some(_)) => {
                return Err(err(
                    "workload.batches",
                    "expected either `num_requests` or `batches`, not both".into(),
                ))
            }
            (None, None) => {
                return Err(err(
                    "workload",
                    "expected `num_requests` (requests per cell) or `batches` (full \
                     batches per cell)"
                        .into(),
                ))
            }
            (Some(0), _) => return Err(err("workload.num_requests", "expected at least 1".into())),
            (_, Some(0)) => return Err(err("workload.batches", "expected at least 1".into())),
            _ => {}
        }
        if let Some(src) = &w.source {
            if !src.exists() {
                return Err(err(
                    "workload.source",
                    format!(
                        "{} does not exist: expected a UTF-8 text file or a directory of them",
                        src.display()
                    ),
                ));
            }
            check_corpus(src).map_err(|e| err("workload.source", e))?;
        }
        let m = exp
            .matrix
            .as_ref()
            .context("a performance experiment needs a `matrix:` section")?;
        for (key, empty) in [
            ("matrix.batch", m.batch.is_empty()),
            ("matrix.prompt_len", m.prompt_len.is_empty()),
            ("matrix.output_len", m.output_len.is_empty()),
            ("matrix.budget", m.budget.is_empty()),
            ("matrix.attention", m.attention.is_empty()),
            ("matrix.chunk_size", m.chunk_size.is_empty()),
            ("matrix.request_rate", m.request_rate.is_empty()),
            ("matrix.burstiness", m.burstiness.is_empty()),
            ("matrix.max_concurrency", m.max_concurrency.is_empty()),
        ] {
            if empty {
                return Err(err(key, "expected a non-empty list".into()));
            }
        }
        if let Some(b) = m.batch.iter().find(|&&b| b == 0) {
            return Err(err(
                "matrix.batch",
                format!("{b}: expected batch sizes ≥ 1"),
            ));
        }
        if let Some(o) = m.output_len.iter().find(|&&o| o == 0) {
            return Err(err(
                "matrix.output_len",
                format!("{o}: expected output lengths ≥ 1"),
            ));
        }
        Self::check_budgets(&m.budget, "matrix.budget", &err)?;
        for a in &m.attention {
            a.parse::<AttentionImpl>()
                .map_err(|e| err("matrix.attention", e.to_string()))?;
        }
        if let Some(c) = m.chunk_size.iter().find(|&&c| c == 0) {
            return Err(err("matrix.chunk_size", format!("{c}: expected ≥ 1")));
        }
        if let Some(r) = m
            .request_rate
            .iter()
            .find(|r| r.per_second().is_nan() || r.per_second() <= 0.0)
        {
            return Err(err(
                "matrix.request_rate",
                format!(
                    "{}: expected requests per second > 0, or inf",
                    r.per_second()
                ),
            ));
        }
        if let Some(b) = m.burstiness.iter().find(|&&b| !(b > 0.0 && b.is_finite())) {
            return Err(err(
                "matrix.burstiness",
                format!("{b}: expected a gamma shape > 0 (1 = Poisson)"),
            ));
        }
        let caps: Vec<Option<usize>> = m
            .max_concurrency
            .iter()
            .map(|c| c.cap().map_err(|e| err("matrix.max_concurrency", e)))
            .collect::<Result<_>>()?;
        for p in &m.prompt_len {
            p.dist()
                .validate()
                .map_err(|e| err("matrix.prompt_len", e.to_string()))?;
        }
        let longest = m
            .prompt_len
            .iter()
            .map(|p| p.dist().max())
            .max()
            .unwrap_or(0)
            + m.output_len.iter().copied().max().unwrap_or(0);
        if longest > context {
            return Err(err(
                "matrix.prompt_len",
                format!(
                    "the longest prompt + output is {longest} tokens, longer than the model's context of {context}"
                ),
            ));
        }
        let engines = Self::engines(exp, text, path, &m.budget)?;
        let mut cells = Vec::new();
        for (name, params, budgets) in &engines {
            for &batch in &m.batch {
                for prompt_len in &m.prompt_len {
                    for &output_len in &m.output_len {
                        for &budget in budgets {
                            for attention in &m.attention {
                                let chunks: Vec<Option<usize>> = if attention == "chunked" {
                                    m.chunk_size.iter().map(|&c| Some(c)).collect()
                                } else {
                                    vec![None]
                                };
                                for chunk_size in chunks {
                                    for rate in &m.request_rate {
                                        for &burstiness in &m.burstiness {
                                            for &max_concurrency in &caps {
                                                for repeat in 0..exp.repeats {
                                                    cells.push(Cell {
                                                        index: cells.len(),
                                                        id: String::new(),
                                                        point: String::new(),
                                                        engine: name.clone(),
                                                        params: params.clone(),
                                                        batch,
                                                        prompt_len: Some(prompt_len.clone()),
                                                        output_len: Some(output_len),
                                                        budget,
                                                        attention: attention.clone(),
                                                        chunk_size,
                                                        request_rate: rate.per_second(),
                                                        burstiness,
                                                        max_concurrency,
                                                        slo: exp.slo,
                                                        repeat,
                                                        task: None,
                                                        mode: None,
                                                        limit: None,
                                                        bucket: None,
                                                    });
                                                }
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(cells)
    }
}

fn task_names() -> String {
    Task::ALL.map(|t| t.name()).join(", ")
}
