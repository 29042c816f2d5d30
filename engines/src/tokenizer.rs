//! Tokenizers: from GGUF metadata, from `tokenizer.json`, or byte-level; and the chat
//! template that turns a conversation into the text the model was tuned on.

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
    /// How conversations are rendered for this model; `None` when its template is not
    /// one kvbench knows.
    pub chat_template: Option<ChatTemplate>,
}

/// A chat template kvbench can render. Derived from the model's own template
/// (`tokenizer.chat_template` in GGUF metadata) when there is one, else from its
/// special tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatTemplate {
    /// ChatML: `<|im_start|>ROLE\nCONTENT<|im_end|>\n` per message, generation
    /// prompt `<|im_start|>assistant\n`. `default_system` is the system message the
    /// model's template inserts when a conversation starts without one (SmolLM2's
    /// "You are a helpful AI assistant named SmolLM, ...").
    ChatMl { default_system: Option<String> },
}

pub const CHATML_START: &str = "<|im_start|>";
pub const CHATML_END: &str = "<|im_end|>";

impl ChatTemplate {
    /// Recognize a Jinja chat template (as Hugging Face and GGUF store it).
    pub fn from_jinja(template: &str) -> Option<Self> {
        if !(template.contains(CHATML_START) && template.contains(CHATML_END)) {
            return None;
        }
        // The default system message is a literal inside the template:
        // `'<|im_start|>system\nTEXT<|im_end|>\n'`.
        let marker = format!("{CHATML_START}system\n");
        let default_system = template.find(&marker).and_then(|i| {
            let rest = &template[i + marker.len()..];
            rest.find(CHATML_END).map(|j| rest[..j].to_string())
        });
        Some(ChatTemplate::ChatMl { default_system })
    }

    /// From the vocabulary alone: ChatML when it has the ChatML tokens.
    fn from_vocab(tok: &Tokenizer) -> Option<Self> {
        (tok.token_to_id(CHATML_START).is_some() && tok.token_to_id(CHATML_END).is_some())
            .then_some(ChatTemplate::ChatMl {
                default_system: None,
            })
    }

    /// The conversation as the model expects it, `(role, content)` per message,
    /// ending with the assistant's generation prompt when `add_generation_prompt`.
    pub fn render(&self, messages: &[(&str, &str)], add_generation_prompt: bool) -> String {
        match self {
            ChatTemplate::ChatMl { default_system } => {
                let mut out = String::new();
                let has_system = messages.first().is_some_and(|(r, _)| *r == "system");
                if let (false, Some(sys)) = (has_system, default_system) {
                    out.push_str(&format!("{CHATML_START}system\n{sys}{CHATML_END}\n"));
                }
                for (role, content) in messages {
                    out.push_str(&format!("{CHATML_START}{role}\n{content}{CHATML_END}\n"));
                }
                if add_generation_prompt {
                    out.push_str(&format!("{CHATML_START}assistant\n"));
                }
                out
            }
        }
    }

    /// The text that ends an assistant turn (generation stops at its token).
    pub fn end_of_turn(&self) -> &'static str {
        match self {
            ChatTemplate::ChatMl { .. } => CHATML_END,
        }
    }
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
        let chat_template = content
            .metadata
            .get("tokenizer.chat_template")
            .and_then(|v| v.to_string().ok())
            .and_then(|t| ChatTemplate::from_jinja(t))
            .or_else(|| ChatTemplate::from_vocab(&tok));
        Ok(Self {
            inner: tok,
            kind: "gguf",
            chat_template,
        })
    }

    pub fn from_file(path: &Path) -> Result<Self> {
        let inner = Tokenizer::from_file(path)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
        Ok(Self {
            chat_template: ChatTemplate::from_vocab(&inner),
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
        // Its ids stand for bytes, so ChatML's markers are spelled out byte by byte:
        // enough for random-weight presets.
        Ok(Self {
            inner,
            kind: "byte-level",
            chat_template: Some(ChatTemplate::ChatMl {
                default_system: None,
            }),
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

    /// Ids that end an assistant turn: the template's end-of-turn token when the
    /// vocabulary has it as one token (byte-level has none).
    pub fn end_of_turn_ids(&self) -> Vec<u32> {
        self.chat_template
            .as_ref()
            .and_then(|t| self.token_id(t.end_of_turn()))
            .into_iter()
            .collect()
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

    #[test]
    fn chatml_is_recognized_with_its_default_system_message() {
        // SmolLM2's template as its GGUF stores it (newlines inside the literals).
        let jinja = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are SmolLM<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
        let t = ChatTemplate::from_jinja(jinja).unwrap();
        assert_eq!(
            t,
            ChatTemplate::ChatMl {
                default_system: Some("You are SmolLM".into())
            }
        );
        assert!(ChatTemplate::from_jinja("{{ bos_token }}[INST]").is_none());
    }

    #[test]
    fn chatml_renders_messages_and_the_generation_prompt() {
        let t = ChatTemplate::ChatMl {
            default_system: Some("S".into()),
        };
        assert_eq!(
            t.render(&[("user", "hi"), ("assistant", "yo")], true),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            t.render(&[("system", "X"), ("user", "hi")], false),
            "<|im_start|>system\nX<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        );
    }
}
