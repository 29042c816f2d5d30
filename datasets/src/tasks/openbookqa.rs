//! OpenBookQA (main, test split): the question stem as the context, each choice's
//! text after the target delimiter; gold = the position of `answerKey` among the labels.

use super::{shared_context, Item, Record, Task};
use crate::Result;

pub(super) fn item(r: &Record<'_>, index: usize) -> Result<Item> {
    let stem = r.str("question.stem")?;
    let list = r.value["question"]["choices"]
        .as_array()
        .filter(|a| !a.is_empty())
        .ok_or_else(|| r.err("`question.choices`: expected a non-empty list"))?;
    let mut texts = Vec::new();
    let mut labels = Vec::new();
    for c in list {
        match (c["text"].as_str(), c["label"].as_str()) {
            (Some(t), Some(l)) => {
                texts.push(t.to_string());
                labels.push(l);
            }
            _ => return Err(r.err("`question.choices`: expected {\"text\", \"label\"} strings")),
        }
    }
    let key = r.str("answerKey")?.trim_start();
    let gold = labels.iter().position(|&l| l == key).ok_or_else(|| {
        r.err(format!(
            "`answerKey` `{key}` is not one of the labels {labels:?}"
        ))
    })?;
    Ok(shared_context(
        Task::Openbookqa,
        index,
        stem.to_string(),
        texts,
        gold,
    ))
}
