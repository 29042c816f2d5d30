//! WinoGrande (winogrande_xl validation) with lm-eval's partial evaluation: the context
//! is the sentence up to the blank with the option in it (one context per option), the
//! continuation the rest of the sentence after the blank, stripped, after the target
//! delimiter; the same continuation is scored under each context.

use super::{Item, Pair, Record, Task, TARGET_DELIMITER};
use crate::Result;

pub(super) fn item(r: &Record<'_>, index: usize) -> Result<Item> {
    let sentence = r.str("sentence")?;
    let blank = sentence
        .find('_')
        .ok_or_else(|| r.err("`sentence`: expected a blank `_`"))?;
    let rest = sentence[blank + 1..].trim();
    let gold = match r.str("answer")? {
        "1" => 0,
        "2" => 1,
        other => {
            return Err(r.err(format!(
                "`answer`: expected \"1\" or \"2\", found `{other}`"
            )))
        }
    };
    let choices = [r.str("option1")?, r.str("option2")?]
        .iter()
        .map(|o| Pair {
            context: format!("{}{o}", &sentence[..blank]),
            continuation: format!("{TARGET_DELIMITER}{rest}"),
        })
        .collect();
    Ok(Item {
        task: Task::Winogrande,
        index,
        choices,
        gold,
        norm_chars: None,
    })
}
