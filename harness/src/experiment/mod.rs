//! Experiment specs: a YAML file names a model, a device, engines with parameters and a
//! matrix of axes; it expands into cells (one point of the matrix × one repeat). Every
//! key and value is checked before anything runs, and errors name the file, the line
//! and the key with what was expected.
//!
//! Three kinds: `performance` (the default: `matrix` + `workload`), `accuracy`
//! (multiple-choice log-likelihood tasks, an `accuracy:` section) and `retention` (a
//! `retention:` section). An accuracy cell is one engine × budget × scoring mode × task.//!
//! The spec's types are in `spec`, the YAML location of a key for error messages in
//! `locate`, the expansion of each kind into cells and their identities in `matrix`;
//! this file reads and checks a file into a [`Plan`].

mod locate;
pub mod matrix;
mod spec;

pub use spec::*;

use anyhow::{Context, Result};
use kvbench_engines::device::parse_bytes;
use kvbench_engines::source::{LoadOptions, ModelSource};
use locate::{key_error, line_of};
use matrix::identify;
use std::path::{Path, PathBuf};

/// A parsed, checked experiment and where it came from.
#[derive(Debug, Clone)]
pub struct Plan {
    pub exp: Experiment,
    pub cells: Vec<Cell>,
    /// The model's context length (prompt + output must fit).
    pub context: usize,
}

impl Plan {
    /// `path`, or the file it names under experiments/ without `.yaml`
    /// (`cpu/quickstart`).
    pub fn resolve(path: &Path) -> PathBuf {
        let named = Path::new("experiments").join(path).with_extension("yaml");
        if !path.exists() && named.is_file() {
            named
        } else {
            path.to_path_buf()
        }
    }

    /// Read, parse, check and expand an experiment file.
    /// `path` may also be a name under experiments/ without `.yaml` (`cpu/quickstart`).
    pub fn load(path: &Path, models_dir: &Path) -> Result<Self> {
        let resolved = Self::resolve(path);
        let path = resolved.as_path();
        let text = std::fs::read_to_string(path).with_context(|| {
            format!(
                "reading experiment {}: expected a YAML file or a name under experiments/ \
                 such as cpu/quickstart",
                path.display()
            )
        })?;
        Self::parse(&text, path, models_dir)
    }

    /// [`Plan::load`], then the objectives of `--slo` in place of the YAML's.
    pub fn load_with(path: &Path, models_dir: &Path, slo: Option<SloSpec>) -> Result<Self> {
        let plan = Self::load(path, models_dir)?;
        match slo {
            Some(s) => plan.with_slo(s),
            None => Ok(plan),
        }
    }

    pub fn parse(text: &str, path: &Path, models_dir: &Path) -> Result<Self> {
        let file = path.display();
        let mut exp: Experiment = serde_yaml::from_str(text).map_err(|e| {
            let at = e
                .location()
                .map_or(String::new(), |l| format!(":{}", l.line()));
            anyhow::anyhow!("{file}{at}: {e}")
        })?;
        if let Some(r) = exp.retention.as_mut() {
            r.settle();
        }
        let err = |key: &str, msg: String| key_error(path, text, key, msg);
        // The name is a directory under results/: `.`, `..` or a separator would
        // write elsewhere.
        if exp.name.trim().is_empty()
            || exp.name.chars().all(|c| c == '.')
            || !exp
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return Err(err(
                "name",
                format!("`{}`: expected a name of letters, digits, `-`, `_`, `.`, not only dots (it names the directory results/<name>/)", exp.name),
            ));
        }
        if !["auto", "quantized", "f32", "f16", "bf16"].contains(&exp.dtype.as_str()) {
            return Err(err(
                "dtype",
                format!(
                    "`{}`: expected auto, quantized, f32, f16 or bf16",
                    exp.dtype
                ),
            ));
        }
        exp.device
            .name
            .parse::<kvbench_engines::device::DeviceKind>()
            .map_err(|e| err("device.name", e.to_string()))?;
        for (k, v) in [
            ("device.memory", &exp.device.memory),
            ("device.host_memory", &exp.device.host_memory),
        ] {
            if let Some(v) = v {
                if parse_bytes(v).map_err(|e| err(k, e))? == 0 {
                    return Err(err(k, format!("`{v}`: expected a size above 0")));
                }
            }
        }
        let f = exp.device.memory_fraction;
        if !(f > 0.0 && f <= 1.0) {
            return Err(err(
                "device.memory_fraction",
                format!("{f}: expected a number in (0, 1]"),
            ));
        }
        if exp.engines.is_empty() {
            return Err(err("engines", "expected at least one engine".into()));
        }
        if exp.repeats == 0 {
            return Err(err("repeats", "expected at least 1".into()));
        }
        match exp.warmup_tokens {
            Some(0) => {
                return Err(err(
                    "warmup_tokens",
                    "expected at least 1 (a request generates a token)".into(),
                ))
            }
            Some(_) if exp.warmup == 0 => {
                return Err(err(
                    "warmup_tokens",
                    "set, but `warmup` runs no warm-up requests".into(),
                ))
            }
            _ => {}
        }
        let s = &exp.scheduler;
        if !["chunked", "sequential"].contains(&s.prefill.as_str()) {
            return Err(err(
                "scheduler.prefill",
                format!("`{}`: expected chunked or sequential", s.prefill),
            ));
        }
        if s.max_batched_tokens == 0 || s.block_size == 0 {
            return Err(err(
                "scheduler",
                "max_batched_tokens and block_size must be ≥ 1".into(),
            ));
        }
        // The model's context, from its config only (no weights are read).
        let src = ModelSource::parse(&exp.model).map_err(|e| err("model", e.to_string()))?;
        let opts = LoadOptions {
            models_dir: models_dir.to_path_buf(),
            ..Default::default()
        };
        let cfg = src.config(&opts).map_err(|e| err("model", e.to_string()))?;
        let context = s.max_model_len.unwrap_or(cfg.max_position_embeddings);
        if context == 0 || context > cfg.max_position_embeddings {
            return Err(err(
                "scheduler.max_model_len",
                format!(
                    "{context}: expected 1 to the model's context of {} tokens",
                    cfg.max_position_embeddings
                ),
            ));
        }
        // Each kind's own section, and no other kind's.
        let kind = exp.kind;
        for (key, present, owner) in [
            ("matrix", exp.matrix.is_some(), Kind::Performance),
            ("workload", exp.workload.is_some(), Kind::Performance),
            ("accuracy", exp.accuracy.is_some(), Kind::Accuracy),
            ("retention", exp.retention.is_some(), Kind::Retention),
        ] {
            if present && owner != kind {
                return Err(err(
                    key,
                    format!(
                        "`{key}` belongs to `kind: {}` experiments; this one is `kind: {}`",
                        owner.name(),
                        kind.name()
                    ),
                ));
            }
            if !present && owner == kind {
                let at = line_of(text, "kind").map_or(String::new(), |l| format!(":{l}"));
                return Err(anyhow::anyhow!(
                    "{file}{at}: a `kind: {}` experiment needs a `{key}:` section",
                    kind.name()
                ));
            }
        }
        if let Some(slo) = &exp.slo {
            if kind != Kind::Performance {
                return Err(err(
                    "slo",
                    format!(
                        "`slo` belongs to `kind: performance` experiments; this one is `kind: {}`",
                        kind.name()
                    ),
                ));
            }
            slo.check().map_err(|(k, why)| {
                let key = if k.is_empty() {
                    "slo".to_string()
                } else {
                    format!("slo.{k}")
                };
                err(&key, why)
            })?;
        }
        let mut cells = match kind {
            Kind::Performance => Self::performance_cells(&exp, text, path, context)?,
            Kind::Accuracy => Self::accuracy_cells(&exp, text, path, context)?,
            Kind::Retention => Self::retention_cells(&exp, text, path, context)?,
        };
        identify(&exp, &mut cells);
        // Two cells of one setting would be recorded as one (the same identity).
        let mut seen = std::collections::HashMap::new();
        for c in &cells {
            if let Some(first) = seen.insert(c.id.as_str(), c.index) {
                anyhow::bail!(
                    "{}: cells {first} and {} are the same setting ({}): a value is listed \
                     twice in `matrix`, or an engine twice with the same parameters",
                    path.display(),
                    c.index,
                    c.key()
                );
            }
        }
        Ok(Plan {
            exp,
            cells,
            context,
        })
    }

    /// The plan with the objectives of `kvbench run --slo` in place of the YAML's:
    /// every cell's identity changes with them (goodput is measured against them).
    pub fn with_slo(mut self, slo: SloSpec) -> Result<Self> {
        if self.exp.kind != Kind::Performance {
            anyhow::bail!(
                "--slo {slo}: objectives apply to performance experiments; `{}` is `kind: {}`",
                self.exp.name,
                self.exp.kind.name()
            );
        }
        slo.check()
            .map_err(|(_, why)| anyhow::anyhow!("--slo {slo}: {why}"))?;
        self.exp.slo = Some(slo);
        for c in &mut self.cells {
            c.slo = Some(slo);
        }
        identify(&self.exp, &mut self.cells);
        Ok(self)
    }

    /// The evaluation data directory: `flag` (`--data-dir`, or `$KVBENCH_DATASETS_DIR`
    /// through it), else the YAML's `data_dir`, else `data/` under the working directory
    /// (the repository root, where the recipes run; `just fetch-data` fills it).
    pub fn data_dir(&self, flag: Option<&Path>) -> PathBuf {
        match (flag, &self.exp.data_dir) {
            (Some(f), _) => f.to_path_buf(),
            (None, Some(d)) => d.clone(),
            (None, None) => kvbench_datasets::tasks::default_data_dir(Path::new(".")),
        }
    }
}

/// `i/n`: run every n-th cell starting at i (a sweep split over machines).
pub fn parse_shard(s: &str) -> Result<(usize, usize)> {
    let (i, n) = s
        .split_once('/')
        .and_then(|(i, n)| Some((i.parse::<usize>().ok()?, n.parse::<usize>().ok()?)))
        .filter(|&(i, n)| n > 0 && i < n)
        .with_context(|| format!("--shard `{s}`: expected i/n with 0 ≤ i < n"))?;
    Ok((i, n))
}

/// A top-level text field (`model`, `dtype`) of the experiment.yaml a sweep keeps in
/// its results directory `dir`, when there is one.
pub fn recorded(dir: &Path, key: &str) -> Option<String> {
    let text = std::fs::read_to_string(dir.join("experiment.yaml")).ok()?;
    let v: serde_yaml::Value = serde_yaml::from_str(&text).ok()?;
    v.get(key)?.as_str().map(str::to_owned)
}

/// The cells of shard `i/n`.
pub fn shard(cells: &[Cell], shard: Option<(usize, usize)>) -> Vec<&Cell> {
    match shard {
        None => cells.iter().collect(),
        Some((i, n)) => cells.iter().filter(|c| c.index % n == i).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::matrix::identity;
    use super::*;
    use std::collections::BTreeMap;

    const GOOD: &str = "\
name: t
model: preset:tiny
engines:
  - name: full
  - name: h2o
    params: {stats: exact}
matrix:
  batch: [1, 2]
  prompt_len: [32, {uniform: [16, 64]}]
  output_len: [8]
  budget: [0.5, 0.25]
  attention: [flash, chunked]
  chunk_size: [16, 32]
workload:
  num_requests: 4
repeats: 2
";

    fn parse(text: &str) -> Result<Plan> {
        Plan::parse(text, Path::new("exp.yaml"), Path::new("models"))
    }

    /// The error message, or "" when the text is valid.
    fn err(text: &str) -> String {
        parse(text)
            .err()
            .map_or(String::new(), |e| format!("{e:#}"))
    }

    #[test]
    fn warmup_tokens_need_warmup_requests_and_change_the_identity_only_when_set() {
        let with = |extra: &str| GOOD.replace("repeats: 2", &format!("repeats: 2\n{extra}"));
        let e = err(&with("warmup_tokens: 4"));
        assert!(
            e.contains("warmup_tokens") && e.contains("no warm-up requests"),
            "{e}"
        );
        let e = err(&with("warmup: 1\nwarmup_tokens: 0"));
        assert!(
            e.contains("warmup_tokens") && e.contains("at least 1"),
            "{e}"
        );
        let ids = |text: &str| -> Vec<String> {
            parse(text)
                .unwrap()
                .cells
                .into_iter()
                .map(|c| c.id)
                .collect()
        };
        let plain = ids(&with("warmup: 1"));
        let short = ids(&with("warmup: 1\nwarmup_tokens: 4"));
        assert!(plain.iter().zip(&short).all(|(a, b)| a != b));
        assert_eq!(ids(&with("warmup: 1\nwarmup_tokens: 4")), short);
    }

    #[test]
    fn the_matrix_expands_with_full_once_and_chunk_sizes_only_for_chunked() {
        let p = parse(GOOD).unwrap();
        // full: 2 batch × 2 prompt × 1 budget × (flash + 2 chunk sizes) × 2 repeats = 24;
        // h2o: the same × 2 budgets = 48.
        assert_eq!(p.cells.len(), 72);
        assert!(p
            .cells
            .iter()
            .filter(|c| c.engine == "full")
            .all(|c| c.budget == 1.0));
        assert!(p
            .cells
            .iter()
            .all(|c| (c.attention == "chunked") == c.chunk_size.is_some()));
        let keys: std::collections::HashSet<String> = p.cells.iter().map(|c| c.key()).collect();
        assert_eq!(keys.len(), p.cells.len(), "cell keys are unique");
        assert_eq!(p.cells[5].index, 5);
        let s = shard(&p.cells, Some((1, 3)));
        assert_eq!(s.len(), 24);
        assert!(s.iter().all(|c| c.index % 3 == 1));
        let tiny = kvbench_engines::config::preset("tiny").unwrap();
        assert_eq!(p.context, tiny.max_position_embeddings);
    }

    #[test]
    fn bad_values_name_the_file_line_and_key() {
        let e = err(&GOOD.replace("batch: [1, 2]", "batch: [1, -2]"));
        assert!(e.starts_with("exp.yaml:8"), "{e}");
        assert!(e.contains("matrix.batch"), "{e}");
        let e = err(&GOOD.replace("budget: [0.5, 0.25]", "budget: [0.5, 1.5]"));
        assert!(e.starts_with("exp.yaml:11: `matrix.budget`: 1.5"), "{e}");
        let e = err(&GOOD.replace("repeats: 2", "repeats: 2\nrepeat: 3"));
        assert!(
            e.contains("unknown field `repeat`") && e.contains("repeats"),
            "{e}"
        );
        let e = err(&GOOD.replace("output_len: [8]", "output_len: [100000]"));
        assert!(
            e.contains("`matrix.prompt_len`") && e.contains("context"),
            "{e}"
        );
        let e = err(&GOOD.replace("stats: exact", "stats: maybe"));
        assert!(
            e.starts_with("exp.yaml:5: `engines[1]` (`h2o`)") && e.contains("stats=maybe"),
            "{e}"
        );
        let e = err(&GOOD.replace("attention: [flash, chunked]", "attention: [flash, paged]"));
        assert!(
            e.contains("`matrix.attention`") && e.contains("paged"),
            "{e}"
        );
        let e = err(&GOOD.replace("model: preset:tiny", "model: preset:nope"));
        assert!(e.contains("exp.yaml:2: `model`"), "{e}");
        let e = err(&GOOD.replace("name: t", "name: a/b"));
        assert!(e.contains("`name`"), "{e}");
        let e = err(&GOOD.replace("- name: full", "- name: lru"));
        assert!(e.contains("unknown engine `lru`"), "{e}");
        let e = err(&GOOD.replace(
            "chunk_size: [16, 32]",
            "chunk_size: [16, 32]\n  request_rate: [0]",
        ));
        assert!(e.contains("`matrix.request_rate`"), "{e}");
        let e = err(&GOOD.replace(
            "chunk_size: [16, 32]",
            "chunk_size: [16, 32]\n  request_rate: [inf, 2.5]",
        ));
        assert!(e.is_empty(), "{e}");
        assert!(parse_shard("3/3").is_err() && parse_shard("0/0").is_err());
        assert_eq!(parse_shard("2/5").unwrap(), (2, 5));
    }

    #[test]
    fn settings_that_would_record_nothing_or_one_result_twice_are_refused() {
        // A value listed twice: two cells of one identity.
        let e = err(&GOOD.replace("batch: [1, 2]", "batch: [1, 2, 1]"));
        assert!(e.contains("are the same setting"), "{e}");
        // A parameter given twice (a plain map would keep the last).
        let e = err(&GOOD.replace("stats: exact", "stats: exact, stats: eager"));
        assert!(e.contains("`stats` given twice"), "{e}");
        let e = err(&GOOD.replace("repeats: 2", "repeats: 2\ndevice:\n  memory: 0GiB"));
        assert!(
            e.contains("`device.memory`") && e.contains("above 0"),
            "{e}"
        );
        let e = err(&GOOD.replace("{uniform: [16, 64]}", "{uniform: [256]}"));
        assert!(e.contains("expected a length in tokens, {uniform"), "{e}");
        // A corpus the cells could not read.
        let dir = tempfile::tempdir().unwrap();
        let with_source = |p: &std::path::Path| {
            err(&GOOD.replace(
                "num_requests: 4",
                &format!("num_requests: 4\n  source: {}", p.display()),
            ))
        };
        let e = with_source(dir.path());
        assert!(e.contains("no .txt files"), "{e}");
        let empty = dir.path().join("empty.txt");
        std::fs::write(&empty, " \n").unwrap();
        assert!(with_source(&empty).contains("no text"));
        let binary = dir.path().join("b.txt");
        std::fs::write(&binary, [0xffu8, 0xfe, 0x00]).unwrap();
        std::fs::remove_file(&empty).unwrap();
        assert!(with_source(dir.path()).contains("not UTF-8"));
        std::fs::write(&binary, "Some prose.").unwrap();
        assert!(with_source(dir.path()).is_empty());
    }

    #[test]
    fn requests_per_cell_are_a_count_or_a_number_of_batches() {
        let w = |p: &Plan| p.exp.workload.clone().unwrap();
        let p = parse(GOOD).unwrap();
        assert_eq!((w(&p).requests(1), w(&p).requests(2)), (4, 4));
        let p = parse(&GOOD.replace("num_requests: 4", "batches: 3")).unwrap();
        assert_eq!((w(&p).requests(1), w(&p).requests(2)), (3, 6));
        // The cell key does not change with the workload: recorded cells stay valid.
        assert_eq!(parse(GOOD).unwrap().cells[0].key(), p.cells[0].key());
        let e = err(&GOOD.replace("num_requests: 4", "num_requests: 4\n  batches: 2"));
        assert!(e.contains("`workload.batches`: expected either"), "{e}");
        let e = err(&GOOD.replace("num_requests: 4", "batches: 0"));
        assert!(e.contains("`workload.batches`: expected at least 1"), "{e}");
        let e = err(&GOOD.replace("num_requests: 4", "source: null"));
        assert!(e.contains("`workload`: expected `num_requests`"), "{e}");
    }

    #[test]
    fn max_concurrency_is_checked_and_joins_the_key_only_when_finite() {
        let with = |v: &str| {
            GOOD.replace(
                "chunk_size: [16, 32]",
                &format!("chunk_size: [16, 32]\n  max_concurrency: {v}"),
            )
        };
        let e = err(&with("[0]"));
        assert!(
            e.starts_with("exp.yaml:14: `matrix.max_concurrency`: 0: expected an integer ≥ 1"),
            "{e}"
        );
        for bad in ["[2.5]", "[-1]", "[]"] {
            let e = err(&with(bad));
            assert!(e.contains("`matrix.max_concurrency`"), "{bad}: {e}");
        }
        // Without the axis, and with `inf`, cells are uncapped and their keys are the
        // keys recorded before the axis existed.
        let plain = parse(GOOD).unwrap();
        assert!(plain.cells.iter().all(|c| c.max_concurrency.is_none()));
        assert_eq!(
            plain.cells[0].key(),
            "engine=full;params=;batch=1;prompt=32;output=8;budget=1;attention=flash;chunk=-;rate=inf;burstiness=1;repeat=0"
        );
        let p = parse(&with("[inf, 2]")).unwrap();
        assert_eq!(p.cells.len(), 2 * plain.cells.len());
        assert_eq!(p.cells[0].key(), plain.cells[0].key());
        // The axis sits between burstiness and repeats: cell 2 is repeat 0 at cap 2.
        assert_eq!(p.cells[2].max_concurrency, Some(2));
        assert_eq!(
            p.cells[2].key(),
            plain.cells[0]
                .key()
                .replace(";repeat=0", ";max_concurrency=2;repeat=0")
        );
        let keys: std::collections::HashSet<String> = p.cells.iter().map(|c| c.key()).collect();
        assert_eq!(keys.len(), p.cells.len());
    }

    const ACC: &str = "\
name: a
kind: accuracy
model: preset:tiny
engines:
  - name: full
  - name: h2o
accuracy:
  tasks: [piqa, boolq]
  limit: 5
  budgets: [0.5, 0.1]
  modes: [decode, one_pass]
";

    #[test]
    fn accuracy_experiments_expand_per_engine_budget_mode_and_task() {
        let p = parse(ACC).unwrap();
        // full: 1 budget × 2 modes × 2 tasks = 4; h2o: 2 budgets × 4 = 8.
        assert_eq!(p.cells.len(), 12);
        let c = &p.cells[1];
        assert_eq!(
            (c.engine.as_str(), c.task.as_deref(), c.mode, c.limit),
            ("full", Some("boolq"), Some(ScoringMode::Decode), Some(5))
        );
        assert!(p
            .cells
            .iter()
            .all(|c| c.prompt_len.is_none() && c.output_len.is_none()));
        assert_eq!(
            c.key(),
            "kind=accuracy;engine=full;params=;budget=1;task=boolq;mode=decode;limit=5;batch=16;attention=flash;repeat=0"
        );
        let keys: std::collections::HashSet<String> = p.cells.iter().map(|c| c.key()).collect();
        assert_eq!(keys.len(), p.cells.len());
        // Flag beats the YAML key, which beats the default.
        let with = parse(&format!("{ACC}data_dir: /d\n")).unwrap();
        assert_eq!(with.data_dir(None), PathBuf::from("/d"));
        assert_eq!(with.data_dir(Some(Path::new("/f"))), PathBuf::from("/f"));
        // The default is data/ in the working directory (the environment variable
        // reaches it only through the flag, or when a test run sets it).
        if std::env::var_os("KVBENCH_DATASETS_DIR").is_none() {
            assert_eq!(p.data_dir(None), Path::new("./data"));
        }
    }

    #[test]
    fn accuracy_and_retention_sections_are_checked() {
        let e = err(&ACC.replace("[piqa, boolq]", "[piqa, mmlu]"));
        assert!(
            e.starts_with("exp.yaml:8: `accuracy.tasks`: unknown task `mmlu`"),
            "{e}"
        );
        let e = err(&ACC.replace("limit: 5", "limit: 0"));
        assert!(e.starts_with("exp.yaml:9: `accuracy.limit`"), "{e}");
        let e = err(&ACC.replace("[0.5, 0.1]", "[0.5, 2]"));
        assert!(e.starts_with("exp.yaml:10: `accuracy.budgets`: 2"), "{e}");
        let e = err(&ACC.replace("[decode, one_pass]", "[decode, greedy]"));
        assert!(e.contains("exp.yaml:11") && e.contains("greedy"), "{e}");
        let e = err(&ACC.replace("  limit: 5", "  limt: 5"));
        assert!(e.contains("unknown field `limt`"), "{e}");
        // Sections of another kind, and a missing one.
        let e = err(&format!("{ACC}workload:\n  num_requests: 1\n"));
        assert!(
            e.contains("`workload` belongs to `kind: performance`"),
            "{e}"
        );
        let e = err(&ACC.replace("kind: accuracy", "kind: retention"));
        assert!(e.contains("`accuracy` belongs to `kind: accuracy`"), "{e}");
        let e = err(&GOOD.replace("name: t", "name: t\nkind: accuracy"));
        assert!(e.contains("`matrix` belongs to `kind: performance`"), "{e}");
        let ret = "\
name: r
kind: retention
model: preset:tiny
engines:
  - name: full
  - name: h2o
retention:
  buckets: [1K-2K, 512-1K]
  facts: 4
  form: chat
  budgets: [0.3]
";
        let p = parse(ret).unwrap();
        assert_eq!(p.cells.len(), 4);
        assert_eq!(p.cells[0].bucket.as_deref(), Some("1K-2K"));
        assert_eq!(
            p.exp.retention.as_ref().unwrap().turns,
            vec![2, 4, 6, 8, 10, 12]
        );
        let e = err(&ret.replace("1K-2K", "2K-1K"));
        assert!(
            e.starts_with("exp.yaml:8: `retention.buckets`: `2K-1K`"),
            "{e}"
        );
        let e = err(&ret.replace("form: chat", "form: essay"));
        assert!(e.starts_with("exp.yaml:10: `retention.form`"), "{e}");
        // Each form's turns, checked before anything runs; the passkey form's default
        // is its one turn, and it needs no facts.
        let e = err(&ret.replace("form: chat", "form: passkey\n  turns: [2]"));
        assert!(e.contains("`retention.turns`"), "{e}");
        assert!(e.contains("expected [1] for the passkey form"), "{e}");
        let passkey = ret.replace("form: chat", "form: passkey\n  turns: [1]");
        assert_eq!(parse(&passkey).unwrap().cells.len(), 4);
        let p = parse(
            &ret.replace("form: chat", "form: passkey")
                .replace("  facts: 4\n", ""),
        )
        .unwrap();
        assert_eq!(p.exp.retention.as_ref().unwrap().turns, vec![1]);
        let e = err(&ret.replace("  facts: 4\n", ""));
        assert!(e.contains("the chat form needs `facts`"), "{e}");
        let e = err(&ret.replace("form: chat", "form: chat\n  turns: [1, 2]"));
        assert!(e.contains("expected turns ≥ 2 for the chat form"), "{e}");
        let e = err(&ret.replace("facts: 4", "facts: 0"));
        assert!(e.starts_with("exp.yaml:9: `retention.facts`"), "{e}");
        // Buckets past the context, one bucket twice, turns out of order.
        let e = err(&ret.replace("1K-2K", "4K-8K"));
        assert!(e.contains("past the model's context of 4096"), "{e}");
        let e = err(&ret.replace("1K-2K", "1024-2048, 1k-2k"));
        assert!(e.contains("are the same bucket"), "{e}");
        let e = err(&ret.replace("form: chat", "form: chat\n  turns: [6, 2]"));
        assert!(e.contains("increasing"), "{e}");
        assert_eq!(parse_bucket("1K-2K"), Ok((1024, 2048)));
        assert!(parse_bucket("2K").is_err());
    }

    /// Identities of a plan's cells by readable key.
    fn ids(text: &str) -> BTreeMap<String, String> {
        parse(text)
            .unwrap()
            .cells
            .iter()
            .map(|c| (c.key(), c.id.clone()))
            .collect()
    }

    #[test]
    fn a_cell_identity_covers_every_setting_that_changes_its_result() {
        let base = ids(GOOD);
        assert_eq!(base.len(), 72);
        let distinct: std::collections::HashSet<&String> = base.values().collect();
        assert_eq!(
            distinct.len(),
            72,
            "every cell (repeats too) has its own identity"
        );
        // Each edit leaves the readable keys alone and must change every identity.
        for edit in [
            GOOD.replace("model: preset:tiny", "model: preset:smollm2-135m"),
            GOOD.replace("name: t\n", "name: t\ndtype: f32\n"),
            GOOD.replace("name: t\n", "name: t\nseed: 7\n"),
            GOOD.replace("name: t\n", "name: t\ndevice:\n  memory: 2GiB\n"),
            GOOD.replace("name: t\n", "name: t\ndevice:\n  memory_fraction: 0.5\n"),
            GOOD.replace("name: t\n", "name: t\ndevice:\n  host_memory: 4GiB\n"),
            GOOD.replace("num_requests: 4", "num_requests: 5"),
            GOOD.replace("num_requests: 4", "num_requests: 4\n  source: Cargo.toml"),
            GOOD.replace("num_requests: 4", "batches: 4"),
            GOOD.replace("repeats: 2", "repeats: 2\nwarmup: 1"),
            GOOD.replace("repeats: 2", "repeats: 2\nwarmup: 1\nwarmup_tokens: 4"),
            GOOD.replace(
                "repeats: 2",
                "repeats: 2\nscheduler:\n  max_batched_tokens: 64",
            ),
            GOOD.replace(
                "repeats: 2",
                "repeats: 2\nscheduler:\n  prefill: sequential",
            ),
            GOOD.replace("repeats: 2", "repeats: 2\nscheduler:\n  block_size: 32"),
            GOOD.replace("repeats: 2", "repeats: 2\nscheduler:\n  max_model_len: 512"),
            GOOD.replace("repeats: 2", "repeats: 2\nslo:\n  ttft_ms: 500"),
            GOOD.replace("repeats: 2", "repeats: 2\nslo:\n  tpot_ms: 50"),
            GOOD.replace("repeats: 2", "repeats: 2\nslo:\n  e2e_ms: 2000"),
        ] {
            let after = ids(&edit);
            assert_eq!(after.len(), 72, "{edit}");
            for (key, id) in &base {
                assert_ne!(
                    after.get(key),
                    Some(id),
                    "{key} kept its identity after:\n{edit}"
                );
            }
        }
        // Repeats share their point, and only repeats do.
        let p = parse(GOOD).unwrap();
        let points: std::collections::HashSet<&str> =
            p.cells.iter().map(|c| c.point.as_str()).collect();
        assert_eq!(points.len(), 36);
        for c in &p.cells {
            let twin = p.cells.iter().filter(|d| d.point == c.point).count();
            assert_eq!(twin, 2, "{}", c.key());
            assert_ne!(c.point, c.id);
        }
        // The thread count is part of it.
        let c = &p.cells[0];
        assert_ne!(identity(&p.exp, c, 1), identity(&p.exp, c, 2));
        assert_eq!(identity(&p.exp, c, 3), identity(&p.exp, c, 3));
    }

    #[test]
    fn slo_keys_are_checked_with_the_file_line_and_key() {
        let with = |slo: &str| GOOD.replace("repeats: 2", &format!("repeats: 2\nslo:\n{slo}"));
        let p = parse(&with("  ttft_ms: 500\n  e2e_ms: 2500")).unwrap();
        let want = SloSpec {
            ttft_ms: Some(500.0),
            tpot_ms: None,
            e2e_ms: Some(2500.0),
        };
        assert!(p.cells.iter().all(|c| c.slo == Some(want)));
        assert_eq!(want.seconds().ttft_s, Some(0.5));
        assert_eq!(want.seconds().e2e_s, Some(2.5));
        assert_eq!(want.seconds().tpot_s, None);
        for (bad, line, key, value) in [
            ("  ttft_ms: -5", 18, "slo.ttft_ms", "-5"),
            ("  ttft_ms: 100\n  tpot_ms: 0", 19, "slo.tpot_ms", "0"),
            ("  e2e_ms: .inf", 18, "slo.e2e_ms", "inf"),
            ("  e2e_ms: .nan", 18, "slo.e2e_ms", "NaN"),
        ] {
            let e = err(&with(bad));
            assert!(
                e.starts_with(&format!(
                    "exp.yaml:{line}: `{key}`: {value}: expected a positive number of milliseconds"
                )),
                "{bad}: {e}"
            );
        }
        let e = err(&with("  {}"));
        assert!(
            e.starts_with("exp.yaml:17: `slo`: expected at least one of ttft_ms"),
            "{e}"
        );
        let e = err(&with("  ttft: 500"));
        assert!(
            e.contains("unknown field `ttft`") && e.contains("ttft_ms"),
            "{e}"
        );
        let e = err(&with("  ttft_ms: fast"));
        assert!(e.starts_with("exp.yaml:18"), "{e}");
        // Objectives are for performance experiments only.
        let e = err(&format!("{ACC}slo:\n  ttft_ms: 500\n"));
        assert!(e.contains("`slo` belongs to `kind: performance`"), "{e}");
    }

    #[test]
    fn slo_flags_parse_like_vllms_goodput_and_replace_the_yamls() {
        let s = SloSpec::parse("ttft:500,tpot:50,e2el:2000").unwrap();
        assert_eq!(
            (s.ttft_ms, s.tpot_ms, s.e2e_ms),
            (Some(500.0), Some(50.0), Some(2000.0))
        );
        // vLLM's space-separated form, `e2e` for `e2el`, any subset; the printed form
        // reads back exactly (the orchestrator hands it to each cell's process).
        let t = SloSpec::parse("tpot:12.5 e2e:900").unwrap();
        assert_eq!(
            (t.ttft_ms, t.tpot_ms, t.e2e_ms),
            (None, Some(12.5), Some(900.0))
        );
        assert_eq!(t.to_string(), "tpot:12.5,e2e:900");
        for x in [s, t] {
            assert_eq!(SloSpec::parse(&x.to_string()).unwrap(), x);
        }
        // `=` and units: `kvbench recommend --slo ttft=2s,tpot=100ms`.
        let u = SloSpec::parse("ttft=2s,tpot=100ms,e2e=1500").unwrap();
        assert_eq!(
            (u.ttft_ms, u.tpot_ms, u.e2e_ms),
            (Some(2000.0), Some(100.0), Some(1500.0))
        );
        for (bad, says) in [
            ("ttft500", "expected KEY:MS pairs"),
            ("ttft=2h", "`2h` is not a number"),
            ("ttft:abc", "`abc` is not a number"),
            ("itl:5", "unknown objective `itl`"),
            ("ttft:0", "0: expected a positive number"),
            ("ttft:-1", "-1: expected a positive number"),
            ("ttft:inf", "inf: expected a positive number"),
            ("ttft:NaN", "NaN: expected a positive number"),
            ("e2e:1,e2el:2", "`e2el` is given twice"),
            ("", "expected at least one of"),
        ] {
            let e = SloSpec::parse(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
        // The flag's objectives replace the YAML's, keep the readable keys and change
        // every identity; the same objectives as the YAML's give the YAML's identities.
        let yaml = parse(&GOOD.replace("repeats: 2", "repeats: 2\nslo:\n  ttft_ms: 500")).unwrap();
        let plain = parse(GOOD).unwrap();
        let flagged = plain
            .clone()
            .with_slo(SloSpec::parse("ttft:500").unwrap())
            .unwrap();
        let other = plain
            .clone()
            .with_slo(SloSpec::parse("tpot:50").unwrap())
            .unwrap();
        for ((p, f), (y, o)) in plain
            .cells
            .iter()
            .zip(&flagged.cells)
            .zip(yaml.cells.iter().zip(&other.cells))
        {
            assert_eq!(p.key(), f.key());
            assert_ne!(p.id, f.id);
            assert_ne!(p.point, f.point);
            assert_eq!((&f.id, &f.point), (&y.id, &y.point));
            assert_ne!(f.id, o.id);
            assert_eq!(o.slo.and_then(|s| s.ttft_ms), None, "replaced, not merged");
        }
        assert_eq!(flagged.exp.slo, yaml.exp.slo);
        // Without objectives a cell hashes as before SLOs existed: no `slo` field.
        let v = serde_json::to_value(&plain.cells[0]).unwrap();
        assert!(v.get("slo").is_none(), "{v}");
        assert!(serde_json::to_value(&flagged.cells[0]).unwrap()["slo"].is_object());
        let e = parse(ACC)
            .unwrap()
            .with_slo(SloSpec::parse("ttft:5").unwrap())
            .unwrap_err();
        assert!(format!("{e}").contains("performance"), "{e}");
    }

    #[test]
    fn inserting_an_engine_or_renaming_keeps_the_other_cells_identities() {
        let base = ids(GOOD);
        let more = ids(&GOOD.replace(
            "engines:\n",
            "engines:\n  - name: streaming\n    params: {sinks: 2}\n",
        ));
        assert!(more.len() > base.len());
        for (key, id) in &base {
            assert_eq!(more.get(key), Some(id), "{key}");
        }
        // Indices move, identities do not; the name and comments are not results.
        let renamed = ids(&format!(
            "# a comment\n{}",
            GOOD.replace("name: t", "name: u")
        ));
        assert_eq!(renamed, base);
        let p = parse(GOOD).unwrap();
        let mut c = p.cells[5].clone();
        c.index = 99;
        assert_eq!(identity(&p.exp, &c, 1), identity(&p.exp, &p.cells[5], 1));
    }

    #[test]
    fn a_retention_cell_identity_covers_form_facts_and_turns() {
        let ret = "\
name: r
kind: retention
model: preset:tiny
engines:
  - name: full
retention:
  buckets: [512-1K]
  facts: 4
  form: chat
";
        let base = ids(ret);
        for edit in [
            ret.replace("facts: 4", "facts: 2"),
            ret.replace("form: chat", "form: chat\n  turns: [2, 4]"),
            ret.replace(
                "facts: 4\n  form: chat",
                "facts: 1\n  form: passkey\n  turns: [1]",
            ),
        ] {
            let after = ids(&edit);
            assert_eq!(after.len(), 1);
            assert_ne!(after.values().next(), base.values().next(), "{edit}");
        }
    }

    #[test]
    fn a_name_that_would_leave_the_results_directory_is_rejected() {
        for bad in [".", "..", "...", "a/b", "../x", "a\\\\b", ""] {
            let e = err(&GOOD.replace("name: t", &format!("name: \"{bad}\"")));
            assert!(e.contains("exp.yaml:1: `name`"), "{bad}: {e}");
            assert!(e.contains("not only dots"), "{bad}: {e}");
        }
        assert_eq!(err(&GOOD.replace("name: t", "name: v1.2_x-y")), "");
    }
}
