//! COPA (SuperGLUE validation), lm-eval's `copa`: the premise without its final
//! period, then ` because` (cause) or ` therefore` (effect); each choice with its first
//! letter lower-cased and a leading space, after the target delimiter — so the
//! continuation starts with two spaces.

use super::{shared_context, Item, Record, Task};
use crate::Result;

pub(super) fn item(r: &Record<'_>, index: usize) -> Result<Item> {
    let connector = match r.str("question")? {
        "cause" => "because",
        "effect" => "therefore",
        other => {
            return Err(r.err(format!(
                "`question`: expected cause or effect, found `{other}`"
            )))
        }
    };
    let premise = r.str("premise")?.trim();
    let mut chars = premise.chars();
    chars.next_back();
    let context = format!("{} {connector}", chars.as_str());
    let convert = |s: &str| -> String {
        let mut c = s.chars();
        match c.next() {
            Some(f) => format!(" {}{}", f.to_lowercase(), c.as_str()),
            None => " ".into(),
        }
    };
    let choices = vec![convert(r.str("choice1")?), convert(r.str("choice2")?)];
    let gold = match r.field("label").as_u64() {
        Some(g @ (0 | 1)) => g as usize,
        _ => return Err(r.err("`label`: expected 0 or 1")),
    };
    Ok(shared_context(Task::Copa, index, context, choices, gold))
}
