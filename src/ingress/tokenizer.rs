//! Text to token ids: a Hugging Face `tokenizer.json` (with the chat template of the
//! `tokenizer_config.json` beside it, rendered with minijinja), or, without a file, the
//! documented byte-level tokenizer so the demo needs no downloads.

use std::path::Path;

use serde::Deserialize;

use super::openai::{ChatMessage, byte_tokens, render_chat};

/// Why a tokenizer could not be loaded or used.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// `tokenizer.json` could not be read or parsed.
    #[error("cannot load tokenizer {path}: {reason}")]
    Load {
        /// The file.
        path: String,
        /// What went wrong.
        reason: String,
    },
    /// The chat template did not compile or render.
    #[error("chat template: {reason}")]
    Template {
        /// What minijinja said.
        reason: String,
    },
    /// Encoding failed.
    #[error("tokenizing: {reason}")]
    Encode {
        /// What the tokenizer said.
        reason: String,
    },
}

/// The router's tokenizer.
pub enum Tokenizer {
    /// One token per UTF-8 byte; a ChatML-style default chat template.
    Bytes,
    /// A Hugging Face tokenizer, with the model's chat template if it has one.
    Hf(Box<HfTokenizer>),
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tokenizer::Bytes => f.write_str("Tokenizer::Bytes"),
            Tokenizer::Hf(hf) => write!(f, "Tokenizer::Hf(chat template: {})", hf.chat.is_some()),
        }
    }
}

/// A loaded Hugging Face tokenizer.
pub struct HfTokenizer {
    tokenizer: tokenizers::Tokenizer,
    /// The template environment (template `chat`), if the model has a chat template.
    chat: Option<minijinja::Environment<'static>>,
    bos_token: String,
    eos_token: String,
}

#[derive(Deserialize, Default)]
struct TokenizerConfig {
    chat_template: Option<serde_json::Value>,
    bos_token: Option<serde_json::Value>,
    eos_token: Option<serde_json::Value>,
}

/// A special token in `tokenizer_config.json`: a string or `{"content": …}`.
fn token_text(v: Option<serde_json::Value>) -> String {
    match v {
        Some(serde_json::Value::String(s)) => s,
        Some(serde_json::Value::Object(o)) => o
            .get("content")
            .and_then(|c| c.as_str())
            .unwrap_or_default()
            .to_owned(),
        _ => String::new(),
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json` and, if present beside it, `tokenizer_config.json`.
    pub fn load(path: &Path) -> Result<Tokenizer, TokenizerError> {
        let err = |reason: String| TokenizerError::Load {
            path: path.display().to_string(),
            reason,
        };
        let tokenizer = tokenizers::Tokenizer::from_file(path).map_err(|e| err(e.to_string()))?;
        let config_path = path.with_file_name("tokenizer_config.json");
        let config: TokenizerConfig = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text)
                .map_err(|e| err(format!("{}: {e}", config_path.display())))?,
            Err(_) => TokenizerConfig::default(),
        };
        // A template is a string, or a list of named templates of which "default" is used.
        let template = match config.chat_template {
            Some(serde_json::Value::String(s)) => Some(s),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str().map(str::to_owned)),
            _ => None,
        };
        let chat = match template {
            Some(source) => {
                let mut env = minijinja::Environment::new();
                env.add_template_owned("chat", source)
                    .map_err(|e| TokenizerError::Template {
                        reason: e.to_string(),
                    })?;
                Some(env)
            }
            None => None,
        };
        Ok(Tokenizer::Hf(Box::new(HfTokenizer {
            tokenizer,
            chat,
            bos_token: token_text(config.bos_token),
            eos_token: token_text(config.eos_token),
        })))
    }

    /// Token ids of a prompt.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        match self {
            Tokenizer::Bytes => Ok(byte_tokens(text)),
            Tokenizer::Hf(hf) => hf
                .tokenizer
                .encode(text, true)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| TokenizerError::Encode {
                    reason: e.to_string(),
                }),
        }
    }

    /// Token ids of a chat, rendered with the model's template (or the default one).
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, TokenizerError> {
        let template_error = |e: minijinja::Error| TokenizerError::Template {
            reason: e.to_string(),
        };
        match self {
            Tokenizer::Hf(hf) => match &hf.chat {
                Some(env) => {
                    let text = env
                        .get_template("chat")
                        .map_err(template_error)?
                        .render(minijinja::context! {
                            messages => minijinja::Value::from(minijinja::value::Serde(messages)),
                            add_generation_prompt => true,
                            bos_token => &hf.bos_token,
                            eos_token => &hf.eos_token,
                        })
                        .map_err(template_error)?;
                    self.encode(&text)
                }
                None => self.encode(&render_chat(messages)),
            },
            Tokenizer::Bytes => self.encode(&render_chat(messages)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny word-level tokenizer in the Hugging Face format, and a chat template.
    fn write_tokenizer(dir: &Path, with_template: bool) -> std::path::PathBuf {
        std::fs::create_dir_all(dir).unwrap();
        let tokenizer = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1, "world": 2, "user": 3, "assistant": 4, ":": 5, "BOS": 6}, "unk_token": "[UNK]"}
        });
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, tokenizer.to_string()).unwrap();
        let config = if with_template {
            serde_json::json!({
                "bos_token": {"content": "BOS"},
                "chat_template": "{{ bos_token }}{% for m in messages %} {{ m.role }} : {{ m.content }}{% endfor %}{% if add_generation_prompt %} assistant :{% endif %}"
            })
        } else {
            serde_json::json!({})
        };
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        path
    }

    #[test]
    fn hf_tokenizer_and_chat_template() {
        let dir = std::env::temp_dir().join(format!("kvroute-tok-{}", std::process::id()));
        let t = Tokenizer::load(&write_tokenizer(&dir, true)).unwrap();
        assert_eq!(t.encode("hello world nope").unwrap(), vec![1, 2, 0]);
        let chat = t
            .encode_chat(&[ChatMessage {
                role: "user".into(),
                content: "hello".into(),
            }])
            .unwrap();
        assert_eq!(chat, vec![6, 3, 5, 1, 4, 5]);
        let plain = Tokenizer::load(&write_tokenizer(&dir.join("plain"), false)).unwrap();
        assert!(
            !plain
                .encode_chat(&[ChatMessage {
                    role: "user".into(),
                    content: "hello".into()
                }])
                .unwrap()
                .is_empty()
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn missing_or_bad_files_are_clear_errors() {
        let e = Tokenizer::load(Path::new("/nonexistent/tokenizer.json"))
            .err()
            .unwrap();
        assert!(e.to_string().contains("/nonexistent/tokenizer.json"), "{e}");
        assert_eq!(Tokenizer::Bytes.encode("ab").unwrap(), vec![97, 98]);
    }
}
