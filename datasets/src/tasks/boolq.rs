//! BoolQ (SuperGLUE validation): `{passage}\nQuestion: {question}?\nAnswer:` →
//! ` no` / ` yes`; the label is the string "true" or "false".

use super::{shared_context, Item, Record, Task};
use crate::Result;

pub(super) fn item(r: &Record<'_>, index: usize) -> Result<Item> {
    let passage = r.str("passage")?;
    let question = r.str("question")?;
    let gold = match r.field("label") {
        serde_json::Value::String(s) if s == "true" => 1,
        serde_json::Value::String(s) if s == "false" => 0,
        serde_json::Value::Bool(b) => usize::from(*b),
        other => {
            return Err(r.err(format!(
                "`label`: expected \"true\" or \"false\", found {other}"
            )))
        }
    };
    Ok(shared_context(
        Task::Boolq,
        index,
        format!("{passage}\nQuestion: {question}?\nAnswer:"),
        vec!["no".into(), "yes".into()],
        gold,
    ))
}
