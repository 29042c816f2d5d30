//! HellaSwag (validation) with lm-eval's preprocessing: the query is
//! `activity_label: ctx_a Ctx_b` (Python's `capitalize()`: the first character upper,
//! the rest lower), and query and endings are cleaned of WikiHow's bracket tags.

use super::{shared_context, Item, Record, Task};
use crate::Result;

/// lm-eval's `preprocess`: strip, ` [title]` → `. `, drop `[...]` (not across a line
/// break, as the regex `\[.*?\]`), then one pass of `"  "` → `" "`.
pub fn preprocess(text: &str) -> String {
    let text = text.trim().replace(" [title]", ". ");
    let mut out = String::with_capacity(text.len());
    let mut rest = text.as_str();
    while let Some(open) = rest.find('[') {
        let after = &rest[open + 1..];
        match after.find([']', '\n']) {
            Some(close) if after.as_bytes()[close] == b']' => {
                out.push_str(&rest[..open]);
                rest = &after[close + 1..];
            }
            _ => {
                out.push_str(&rest[..=open]);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out.replace("  ", " ")
}

/// Python's `str.capitalize()`.
pub fn capitalize(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) => f
            .to_uppercase()
            .chain(c.as_str().to_lowercase().chars())
            .collect(),
        None => String::new(),
    }
}

pub(super) fn item(r: &Record<'_>, index: usize) -> Result<Item> {
    let ctx = format!("{} {}", r.str("ctx_a")?, capitalize(r.str("ctx_b")?));
    let query = preprocess(&format!("{}: {ctx}", r.str("activity_label")?));
    let endings = r
        .field("endings")
        .as_array()
        .filter(|a| a.len() >= 2)
        .ok_or_else(|| r.err("`endings`: expected a list of at least two strings"))?
        .iter()
        .map(|e| {
            e.as_str()
                .map(preprocess)
                .ok_or_else(|| r.err("`endings`: expected strings"))
        })
        .collect::<Result<Vec<_>>>()?;
    let gold = match r.field("label") {
        serde_json::Value::Number(n) => n.as_u64(),
        serde_json::Value::String(s) => s.parse().ok(),
        _ => None,
    }
    .map(|g| g as usize)
    .filter(|&g| g < endings.len())
    .ok_or_else(|| {
        r.err(format!(
            "`label`: expected an index below {}",
            endings.len()
        ))
    })?;
    Ok(shared_context(Task::Hellaswag, index, query, endings, gold))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preprocess_matches_lm_eval() {
        assert_eq!(
            preprocess(" Home and Garden: [header] How to x [title] Buy it. [step] Go  "),
            "Home and Garden: How to x. Buy it. Go"
        );
        assert_eq!(preprocess("a [b\n] c"), "a [b\n] c");
        assert_eq!(preprocess("a [open"), "a [open");
        assert_eq!(capitalize("the LADY"), "The lady");
        assert_eq!(capitalize(""), "");
    }
}
