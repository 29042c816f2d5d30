//! Where a key is in the YAML text, so that an error names its line.

use std::path::Path;

/// An error naming the file, the line of `key` in it and the key (`exp.yaml:12:
/// `matrix.batch`: ...`).
pub(super) fn key_error(path: &Path, text: &str, key: &str, msg: String) -> anyhow::Error {
    let at = line_of(text, key).map_or(String::new(), |l| format!(":{l}"));
    anyhow::anyhow!("{}{at}: `{key}`: {msg}", path.display())
}

/// Line (1-based) of the key at `path` (`matrix.budget`) in the YAML text: each segment
/// is searched as `name:` below the previous one, more indented.
pub(super) fn line_of(text: &str, path: &str) -> Option<usize> {
    let lines: Vec<&str> = text.lines().collect();
    let mut from = 0;
    let mut indent: Option<usize> = None;
    let mut found = None;
    for seg in path.split('.') {
        let seg = seg.split('[').next().unwrap_or(seg);
        let hit = (from..lines.len()).find(|&i| {
            let l = lines[i];
            let ind = l.len() - l.trim_start().len();
            let t = l.trim_start().trim_start_matches("- ");
            indent.is_none_or(|p| ind > p)
                && (t.starts_with(&format!("{seg}:")) || t.starts_with(&format!("\"{seg}\":")))
        })?;
        indent = Some(lines[hit].len() - lines[hit].trim_start().len());
        from = hit + 1;
        found = Some(hit + 1);
    }
    found
}

/// Line (1-based) of the `i`-th list item under the top-level key `list`.
pub(super) fn item_line(text: &str, list: &str, i: usize) -> Option<usize> {
    let start = line_of(text, list)?;
    let lines: Vec<&str> = text.lines().collect();
    lines
        .iter()
        .enumerate()
        .skip(start)
        .take_while(|(_, l)| l.trim().is_empty() || l.starts_with(' ') || l.starts_with('-'))
        .filter(|(_, l)| l.trim_start().starts_with("- "))
        .nth(i)
        .map(|(n, _)| n + 1)
}

pub(super) fn scalar(v: &serde_yaml::Value) -> Option<String> {
    match v {
        serde_yaml::Value::Bool(b) => Some(b.to_string()),
        serde_yaml::Value::Number(n) => Some(n.to_string()),
        serde_yaml::Value::String(s) => Some(s.clone()),
        _ => None,
    }
}
