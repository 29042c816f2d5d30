//! Tokenizers: from GGUF metadata, from `tokenizer.json`, or byte-level.

use crate::error::{Error, Result};
use candle_core::quantized::gguf_file;
use candle_core::quantized::tokenizer::TokenizerFromGguf;
use std::path::Path;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::Tokenizer;

/// A tokenizer and where it came from.
#[derive(Clone)]
pub struct TextTokenizer {
    pub inner: Tokenizer,
    /// `gguf`, `tokenizer.json` or `byte-level`.
    pub kind: &'static str,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TextTokenizer({}, {} tokens)",
            self.kind,
            self.vocab_size()
        )
    }
}

impl TextTokenizer {
    /// Build from GGUF metadata. candle's builder has no case for `pre = smollm` and
    /// falls back to a byte-level pre-tokenizer with a prefix space (every special
    /// token then gets a spurious space); SmolLM2's own tokenizer splits digits
    /// individually and adds no prefix space, so that pipeline is set here.
    pub fn from_gguf(content: &gguf_file::Content) -> Result<Self> {
        let mut tok = Tokenizer::from_gguf(content).map_err(|e| Error::Tokenizer(e.to_string()))?;
        let pre = content
            .metadata
            .get("tokenizer.ggml.pre")
            .and_then(|v| v.to_string().ok())
            .map(|s| s.as_str());
        if pre == Some("smollm") {
            tok.with_pre_tokenizer(Some(Sequence::new(vec![
                Digits::new(true).into(),
                ByteLevel::new(false, true, true).into(),
            ])));
            tok.with_decoder(Some(ByteLevelDecoder::new(false, true, true)));
        }
        Ok(Self {
            inner: tok,
            kind: "gguf",
        })
    }

    pub fn from_file(path: &Path) -> Result<Self> {
        let inner = Tokenizer::from_file(path)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
        Ok(Self {
            inner,
            kind: "tokenizer.json",
        })
    }

    /// One token per byte (ids 0–255), for presets when no real tokenizer is at hand.
    pub fn byte_level() -> Result<Self> {
        let vocab: tokenizers::models::bpe::Vocab = ByteLevel::alphabet()
            .into_iter()
            .map(|c| {
                // Id = the byte the character stands for.
                let s = c.to_string();
                let b = byte_of_char(c);
                (s, b as u32)
            })
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, vec![])
            .build()
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        let mut inner = Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(ByteLevel::new(false, false, false)));
        inner.with_decoder(Some(ByteLevelDecoder::new(false, false, false)));
        Ok(Self {
            inner,
            kind: "byte-level",
        })
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .inner
            .encode(text, true)
            .map_err(|e| Error::Tokenizer(e.to_string()))?
            .get_ids()
            .to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| Error::Tokenizer(e.to_string()))
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }
}

/// GPT-2's byte → printable character map, inverted.
fn byte_of_char(c: char) -> u8 {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut n = 0u32;
    for b in 0u32..256 {
        let ch = if printable(b) {
            b
        } else {
            let v = 256 + n;
            n += 1;
            v
        };
        if char::from_u32(ch) == Some(c) {
            return b as u8;
        }
    }
    unreachable!("{c:?} is not in the byte-level alphabet")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_round_trips_any_utf8() {
        let t = TextTokenizer::byte_level().unwrap();
        let s = "Héllo, wörld! 日本 \n\t 123";
        let ids = t.encode(s).unwrap();
        assert_eq!(
            ids,
            s.as_bytes().iter().map(|&b| b as u32).collect::<Vec<_>>()
        );
        assert_eq!(t.decode(&ids).unwrap(), s);
        assert_eq!(t.vocab_size(), 256);
    }
}
