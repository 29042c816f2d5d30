//! PIQA (validation): `Question: {goal}\nAnswer:` → ` {sol1}` / ` {sol2}`; the labels
//! are a separate file, one `0`/`1` per line aligned with the records.

use super::{read_jsonl, read_text, shared_context, Item, Task};
use crate::{Error, Result};
use std::path::Path;

pub(super) fn load(data: &Path, labels: &Path, limit: Option<usize>) -> Result<Vec<Item>> {
    let text = read_text(labels)?;
    let mut gold = Vec::new();
    for (i, l) in text.lines().enumerate() {
        if limit.is_some_and(|n| gold.len() >= n) {
            break;
        }
        gold.push(match l.trim() {
            "0" => 0,
            "1" => 1,
            other => {
                return Err(Error::Line {
                    path: labels.into(),
                    line: i + 1,
                    message: format!("expected a label 0 or 1, found `{other}`"),
                })
            }
        });
    }
    let mut items = read_jsonl(data, limit, |r, i| {
        let goal = r.str("goal")?;
        let choices = vec![r.str("sol1")?.to_string(), r.str("sol2")?.to_string()];
        // The label is filled in below, from the aligned file.
        Ok(shared_context(
            Task::Piqa,
            i,
            format!("Question: {goal}\nAnswer:"),
            choices,
            0,
        ))
    })?;
    if gold.len() < items.len() {
        return Err(Error::Format {
            path: labels.into(),
            message: format!(
                "{} labels for {} records of {}: expected one label per record",
                gold.len(),
                items.len(),
                data.display()
            ),
        });
    }
    for (item, g) in items.iter_mut().zip(gold) {
        item.gold = g;
    }
    Ok(items)
}
