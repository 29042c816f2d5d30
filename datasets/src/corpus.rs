//! A long English text to slice prompts from (`prose/` of the evaluation data directory
//! or any UTF-8 file), cleaned: no BOM, LF line ends, and for Project Gutenberg books
//! only the text between the `*** START OF` and `*** END OF` lines.

use crate::{Error, Result, Tokenize};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone)]
pub struct Corpus {
    pub path: PathBuf,
    pub text: String,
}

impl Corpus {
    pub fn from_file(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| Error::Io {
            path: path.into(),
            source: e,
        })?;
        let raw = String::from_utf8(bytes).map_err(|e| Error::Format {
            path: path.into(),
            message: format!(
                "not UTF-8 text (invalid byte at offset {})",
                e.utf8_error().valid_up_to()
            ),
        })?;
        let text = clean(&raw);
        if text.trim().is_empty() {
            return Err(Error::Format {
                path: path.into(),
                message: "no text left after removing the Project Gutenberg header and footer"
                    .into(),
            });
        }
        Ok(Self {
            path: path.into(),
            text,
        })
    }

    /// The whole corpus as one token stream.
    pub fn tokenize(&self, tok: &dyn Tokenize) -> Result<Vec<u32>> {
        tok.encode(&self.text)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", self.path.display())))
    }
}

/// BOM and CRLF removed, Gutenberg header and footer cut.
pub fn clean(raw: &str) -> String {
    let text = raw
        .strip_prefix('\u{feff}')
        .unwrap_or(raw)
        .replace("\r\n", "\n");
    let is_marker = |line: &str, word: &str| {
        let l = line.trim_start();
        l.starts_with("***") && l.trim_start_matches('*').trim_start().starts_with(word)
    };
    let mut start = 0;
    let mut end = text.len();
    let mut offset = 0;
    for line in text.split_inclusive('\n') {
        if start == 0 && is_marker(line, "START OF") {
            start = offset + line.len();
        } else if start > 0 && is_marker(line, "END OF") {
            end = offset;
            break;
        }
        offset += line.len();
    }
    text[start..end].trim().to_string()
}
