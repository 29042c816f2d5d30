//! Multiple-choice log-likelihood tasks in lm-evaluation-harness's zero-shot formats:
//! PIQA, COPA, WinoGrande, HellaSwag, OpenBookQA and BoolQ, read from the evaluation
//! data directory ([`default_data_dir`]; `scripts/fetch-data.py` lists the files and the
//! splits lm-eval scores). `datasets/fixtures/` holds the first 40 items of each.
//!
//! An [`Item`] holds, per answer choice, the context and the continuation exactly as
//! lm-eval builds its `loglikelihood` requests (the target delimiter, a space, already
//! joined to the continuation), the gold index, and the character lengths lm-eval
//! divides by for `acc_norm`. Scoring (tokenization, the model) is the harness's job;
//! [`Scores`] turns per-choice log-likelihoods into `acc`/`acc_norm` decisions and
//! [`mean_stderr`] gives lm-eval's standard error over items.

mod boolq;
mod copa;
mod hellaswag;
mod openbookqa;
mod piqa;
mod winogrande;

use crate::{Error, Result};
use std::path::{Path, PathBuf};

/// lm-eval's default `target_delimiter`, put between context and choice.
pub const TARGET_DELIMITER: &str = " ";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Task {
    Piqa,
    Copa,
    Winogrande,
    Hellaswag,
    Openbookqa,
    Boolq,
}

impl Task {
    pub const ALL: [Task; 6] = [
        Task::Piqa,
        Task::Copa,
        Task::Winogrande,
        Task::Hellaswag,
        Task::Openbookqa,
        Task::Boolq,
    ];

    /// lm-eval's task name.
    pub fn name(self) -> &'static str {
        match self {
            Task::Piqa => "piqa",
            Task::Copa => "copa",
            Task::Winogrande => "winogrande",
            Task::Hellaswag => "hellaswag",
            Task::Openbookqa => "openbookqa",
            Task::Boolq => "boolq",
        }
    }

    /// Whether lm-eval reports `acc_norm` for the task (it reports `acc` for all).
    pub fn has_acc_norm(self) -> bool {
        matches!(self, Task::Piqa | Task::Hellaswag | Task::Openbookqa)
    }

    /// The data file(s) under the datasets directory: the split lm-eval scores.
    pub fn files(self) -> &'static [&'static str] {
        match self {
            Task::Piqa => &["piqa/valid.jsonl", "piqa/valid-labels.lst"],
            Task::Copa => &["copa/val.jsonl"],
            Task::Winogrande => &["winogrande/winogrande_xl_dev.jsonl"],
            Task::Hellaswag => &["hellaswag/hellaswag_val.jsonl"],
            Task::Openbookqa => &["openbookqa/test.jsonl"],
            Task::Boolq => &["boolq/val.jsonl"],
        }
    }

    /// Load the first `limit` items (all without a limit), as lm-eval's `--limit`.
    pub fn load(self, data_dir: &Path, limit: Option<usize>) -> Result<Vec<Item>> {
        let f = |i: usize| data_dir.join(self.files()[i]);
        match self {
            Task::Piqa => piqa::load(&f(0), &f(1), limit),
            Task::Copa => read_jsonl(&f(0), limit, copa::item),
            Task::Winogrande => read_jsonl(&f(0), limit, winogrande::item),
            Task::Hellaswag => read_jsonl(&f(0), limit, hellaswag::item),
            Task::Openbookqa => read_jsonl(&f(0), limit, openbookqa::item),
            Task::Boolq => read_jsonl(&f(0), limit, boolq::item),
        }
    }
}

impl std::fmt::Display for Task {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Task {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Task::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown task `{s}`: expected one of {}",
                    Task::ALL.map(|t| t.name()).join(", ")
                )
            })
    }
}

/// One `loglikelihood` request: log P(continuation | context).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pair {
    pub context: String,
    pub continuation: String,
}

/// One multiple-choice item.
#[derive(Debug, Clone, PartialEq)]
pub struct Item {
    pub task: Task,
    /// 0-based index in the split (the line of its record, minus one).
    pub index: usize,
    /// One request per choice.
    pub choices: Vec<Pair>,
    /// Index of the correct choice.
    pub gold: usize,
    /// Characters of each choice as lm-eval measures it for `acc_norm` (the choice
    /// string without the target delimiter); `None` where lm-eval reports no acc_norm.
    pub norm_chars: Option<Vec<usize>>,
}

/// Decisions from the per-choice log-likelihoods of one item.
#[derive(Debug, Clone, PartialEq)]
pub struct Scores {
    /// argmax of the sums (the first on ties, as numpy).
    pub pred: usize,
    pub correct: bool,
    /// argmax of sum / characters; `None` where the task has no acc_norm.
    pub pred_norm: Option<usize>,
    pub correct_norm: Option<bool>,
}

impl Item {
    /// `acc` and `acc_norm` decisions from one log-likelihood per choice.
    pub fn score(&self, loglik: &[f64]) -> Result<Scores> {
        if loglik.len() != self.choices.len() || loglik.iter().any(|x| x.is_nan()) {
            return Err(Error::Invalid(format!(
                "{} item {}: expected {} log-likelihoods (not NaN), got {:?}",
                self.task,
                self.index,
                self.choices.len(),
                loglik
            )));
        }
        let pred = argmax(loglik);
        let pred_norm = self.norm_chars.as_ref().map(|chars| {
            let v: Vec<f64> = loglik
                .iter()
                .zip(chars)
                .map(|(l, &c)| l / c as f64)
                .collect();
            argmax(&v)
        });
        Ok(Scores {
            pred,
            correct: pred == self.gold,
            pred_norm,
            correct_norm: pred_norm.map(|p| p == self.gold),
        })
    }
}

/// numpy's argmax: the first index of the largest value.
fn argmax(v: &[f64]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// Mean and lm-eval's standard error of the mean (sample standard deviation with
/// n − 1, over √n); the error is `None` below two items.
pub fn mean_stderr(values: &[f64]) -> (Option<f64>, Option<f64>) {
    let n = values.len();
    if n == 0 {
        return (None, None);
    }
    let mean = values.iter().sum::<f64>() / n as f64;
    if n < 2 {
        return (Some(mean), None);
    }
    let var = values.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    (Some(mean), Some((var / n as f64).sqrt()))
}

/// The evaluation data directory: `$KVBENCH_DATASETS_DIR`, else `data/` under
/// `repo_root` (git-ignored; `just fetch-data` fills it).
pub fn default_data_dir(repo_root: &Path) -> PathBuf {
    std::env::var_os("KVBENCH_DATASETS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root.join("data"))
}

/// A data file's bytes; a missing one is [`Error::Missing`] (it says how to fetch it).
pub(crate) fn read_data_file(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => Error::Missing { path: path.into() },
        _ => Error::Io {
            path: path.into(),
            source: e,
        },
    })
}

/// A JSON record of a JSONL file: its fields, the file and line for errors.
pub(crate) struct Record<'a> {
    pub path: &'a Path,
    pub line: usize,
    pub value: serde_json::Value,
}

impl Record<'_> {
    pub fn err(&self, message: impl Into<String>) -> Error {
        Error::Line {
            path: self.path.to_path_buf(),
            line: self.line,
            message: message.into(),
        }
    }

    /// A string field (`a.b` for a nested one).
    pub fn str(&self, key: &str) -> Result<&str> {
        let mut v = &self.value;
        for k in key.split('.') {
            v = &v[k];
        }
        v.as_str()
            .ok_or_else(|| self.err(format!("expected a string field `{key}`")))
    }

    pub fn field(&self, key: &str) -> &serde_json::Value {
        &self.value[key]
    }
}

fn read_text(path: &Path) -> Result<String> {
    let bytes = read_data_file(path)?;
    String::from_utf8(bytes).map_err(|e| Error::Format {
        path: path.into(),
        message: format!(
            "not UTF-8 text (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        ),
    })
}

/// Items from the first `limit` records of a JSONL file (blank lines are errors: they
/// would shift the alignment with label files).
fn read_jsonl(
    path: &Path,
    limit: Option<usize>,
    make: fn(&Record<'_>, usize) -> Result<Item>,
) -> Result<Vec<Item>> {
    let text = read_text(path)?;
    let mut items = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if limit.is_some_and(|n| items.len() >= n) {
            break;
        }
        let value = serde_json::from_str::<serde_json::Value>(line).map_err(|e| Error::Line {
            path: path.into(),
            line: i + 1,
            message: format!("expected one JSON object per line: {e}"),
        })?;
        let rec = Record {
            path,
            line: i + 1,
            value,
        };
        if !rec.value.is_object() {
            return Err(rec.err("expected a JSON object"));
        }
        items.push(make(&rec, i)?);
    }
    if items.is_empty() {
        return Err(Error::Format {
            path: path.into(),
            message: "no records".into(),
        });
    }
    Ok(items)
}

/// The same context for every choice, the delimiter before each choice.
fn shared_context(
    task: Task,
    index: usize,
    context: String,
    choices: Vec<String>,
    gold: usize,
) -> Item {
    let norm_chars = task
        .has_acc_norm()
        .then(|| choices.iter().map(|c| c.chars().count()).collect());
    Item {
        task,
        index,
        choices: choices
            .into_iter()
            .map(|c| Pair {
                context: context.clone(),
                continuation: format!("{TARGET_DELIMITER}{c}"),
            })
            .collect(),
        gold,
        norm_chars,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_takes_the_first_of_ties_and_norm_divides_by_characters() {
        let item = shared_context(
            Task::Piqa,
            0,
            "Q".into(),
            vec!["ab".into(), "abcd".into()],
            1,
        );
        assert_eq!(item.choices[1].continuation, " abcd");
        // Sums: -3 vs -4 → choice 0; per character: -1.5 vs -1 → choice 1.
        let s = item.score(&[-3.0, -4.0]).unwrap();
        assert_eq!((s.pred, s.correct), (0, false));
        assert_eq!((s.pred_norm, s.correct_norm), (Some(1), Some(true)));
        assert_eq!(item.score(&[-2.0, -2.0]).unwrap().pred, 0);
        assert!(item.score(&[-2.0]).is_err());
        assert!(item.score(&[-2.0, f64::NAN]).is_err());
    }

    #[test]
    fn stderr_is_the_sample_deviation_over_root_n() {
        let (m, se) = mean_stderr(&[1.0, 0.0, 1.0, 1.0]);
        assert_eq!(m, Some(0.75));
        // Sample variance 0.25 (n − 1 = 3), over n = 4: √(0.0625) = 0.25.
        assert!((se.unwrap() - 0.25).abs() < 1e-12);
        assert_eq!(mean_stderr(&[1.0]), (Some(1.0), None));
        assert_eq!(mean_stderr(&[]), (None, None));
    }
}
