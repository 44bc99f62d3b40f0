//! Text to token ids: a Hugging Face `tokenizer.json` (with the chat template of the
//! `tokenizer_config.json` beside it, rendered with minijinja), or, without a file, the
//! documented byte-level tokenizer so the demo needs no downloads.

use std::path::Path;

use serde::Deserialize;

use super::openai::{ChatMessage, ChatOptions, byte_tokens, render_chat};

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
                let mut env = chat_environment();
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

    /// Token ids of a prompt; with `add_special_tokens`, the tokenizer's own (BOS) added as
    /// its post-processor says.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        match self {
            Tokenizer::Bytes => Ok(byte_tokens(text)),
            Tokenizer::Hf(hf) => hf
                .tokenizer
                .encode(text, add_special_tokens)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| TokenizerError::Encode {
                    reason: e.to_string(),
                }),
        }
    }

    /// Token ids of a chat, rendered with the model's template (or the default one) as
    /// vLLM renders it through Hugging Face's `apply_chat_template`: the template sees the
    /// messages, `tools`, `documents`, `add_generation_prompt`, the special tokens and the
    /// request's `chat_template_kwargs`; the text is tokenized without special tokens
    /// unless asked (the template writes its BOS; adding another shifts every block).
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        options: &ChatOptions,
    ) -> Result<Vec<u32>, TokenizerError> {
        let template_error = |e: minijinja::Error| TokenizerError::Template {
            reason: e.to_string(),
        };
        let text = match self {
            Tokenizer::Hf(hf) => match &hf.chat {
                Some(env) => {
                    // Hugging Face: the special tokens, overridden by the kwargs, under the
                    // fixed variables.
                    let mut context: std::collections::BTreeMap<String, minijinja::Value> =
                        std::collections::BTreeMap::new();
                    context.insert("bos_token".into(), hf.bos_token.as_str().into());
                    context.insert("eos_token".into(), hf.eos_token.as_str().into());
                    for (k, v) in &options.kwargs {
                        context.insert(
                            k.clone(),
                            minijinja::Value::from(minijinja::value::Serde(v)),
                        );
                    }
                    context.insert(
                        "messages".into(),
                        minijinja::Value::from(minijinja::value::Serde(messages)),
                    );
                    context.insert(
                        "tools".into(),
                        minijinja::Value::from(minijinja::value::Serde(&options.tools)),
                    );
                    context.insert(
                        "documents".into(),
                        minijinja::Value::from(minijinja::value::Serde(&options.documents)),
                    );
                    context.insert(
                        "add_generation_prompt".into(),
                        options.add_generation_prompt.into(),
                    );
                    env.get_template("chat")
                        .map_err(template_error)?
                        .render(context)
                        .map_err(template_error)?
                }
                None => render_chat(messages, options.add_generation_prompt),
            },
            Tokenizer::Bytes => render_chat(messages, options.add_generation_prompt),
        };
        let text = if options.continue_final_message {
            continued(&text, messages)?
        } else {
            text
        };
        self.encode(&text, options.add_special_tokens)
    }
}

/// The rendered chat cut right after the last message's content, so the model continues it
/// (Hugging Face's `continue_final_message`: the content's last occurrence, or its trimmed
/// form's, since some templates strip whitespace).
fn continued(text: &str, messages: &[ChatMessage]) -> Result<String, TokenizerError> {
    let last = messages.last().map_or("", |m| m.content.as_str());
    for needle in [last, last.trim()] {
        if let Some(at) = text.rfind(needle) {
            return Ok(text[..at + needle.len()].to_owned());
        }
    }
    Err(TokenizerError::Template {
        reason: "continue_final_message: the last message's content is not in the rendered chat"
            .into(),
    })
}

/// The environment chat templates are rendered in: what Hugging Face's renderer (Jinja2,
/// which vLLM and SGLang use) gives templates beyond minijinja's builtins, so a template
/// renders here as it does in the engine (the router must hash the engine's tokens):
/// Python's string and dict methods, `raise_exception` (templates reject a malformed
/// conversation with it) and `strftime_now` (Llama 3.x date their system prompt).
fn chat_environment() -> minijinja::Environment<'static> {
    let mut env = minijinja::Environment::new();
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |message: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                message,
            ))
        },
    );
    env.add_function("strftime_now", |format: String| {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        strftime(now, &format)
    });
    env
}

/// `unix_s` (UTC) formatted as Python's `strftime` would, for the directives chat
/// templates use: `%d %m %Y %y %b %B %a %A %H %M %S %%`.
fn strftime(unix_s: u64, format: &str) -> Result<String, minijinja::Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
    ];
    let days = unix_s / 86_400;
    let (year, month, day) = civil_from_days(days);
    let weekday = DAYS[((days + 4) % 7) as usize]; // 1970-01-01 was a Thursday.
    let month_name = MONTHS[month as usize - 1];
    let secs = unix_s % 86_400;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('b') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('a') => out.push_str(&weekday[..3]),
            Some('A') => out.push_str(weekday),
            Some('H') => out.push_str(&format!("{:02}", secs / 3600)),
            Some('M') => out.push_str(&format!("{:02}", secs / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", secs % 60)),
            Some('%') => out.push('%'),
            other => {
                return Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported directive %{}",
                        other.map(String::from).unwrap_or_default()
                    ),
                ));
            }
        }
    }
    Ok(out)
}

/// (year, month 1–12, day 1–31) of a day counted from 1970-01-01: Howard Hinnant's
/// `civil_from_days` ("chrono-Compatible Low-Level Date Algorithms"), for days ≥ 0.
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny word-level tokenizer in the Hugging Face format, and a chat template.
    fn write_tokenizer(dir: &Path, with_template: bool) -> std::path::PathBuf {
        std::fs::create_dir_all(dir).unwrap();
        let tokenizer = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "decoder": null,
            // As Llama's: BOS added to every encoding that asks for special tokens.
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "BOS", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": "BOS", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"BOS": {"id": "BOS", "ids": [6], "tokens": ["BOS"]}}
            },
            "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1, "world": 2, "user": 3, "assistant": 4, ":": 5, "BOS": 6, "tool": 7, "search": 8, "think": 9}, "unk_token": "[UNK]"}
        });
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, tokenizer.to_string()).unwrap();
        let config = if with_template {
            serde_json::json!({
                "bos_token": {"content": "BOS"},
                "chat_template": "{{ bos_token }}{% if tools %} tool {% for t in tools %}{{ t.function.name }}{% endfor %}{% endif %}{% if enable_thinking %} think{% endif %}{% for m in messages %} {{ m.role }} : {{ m.content }}{% if m.tool_calls %} tool {{ m.tool_calls[0].function.name }}{% endif %}{% endfor %}{% if add_generation_prompt %} assistant :{% endif %}"
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
        // A completion gets the tokenizer's BOS (vLLM's default), unless asked not to.
        assert_eq!(
            t.encode("hello world nope", true).unwrap(),
            vec![6, 1, 2, 0]
        );
        assert_eq!(t.encode("hello world nope", false).unwrap(), vec![1, 2, 0]);
        // A chat's BOS is the template's alone: adding the tokenizer's too shifted every
        // block against the engine's (vLLM tokenizes chats without special tokens).
        let hello = [ChatMessage::text("user", "hello")];
        let chat = t.encode_chat(&hello, &ChatOptions::default()).unwrap();
        assert_eq!(chat, vec![6, 3, 5, 1, 4, 5]);
        let both = ChatOptions {
            add_special_tokens: true,
            ..ChatOptions::default()
        };
        assert_eq!(
            t.encode_chat(&hello, &both).unwrap(),
            vec![6, 6, 3, 5, 1, 4, 5]
        );
        let plain = Tokenizer::load(&write_tokenizer(&dir.join("plain"), false)).unwrap();
        assert!(
            !plain
                .encode_chat(&hello, &ChatOptions::default())
                .unwrap()
                .is_empty()
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    /// The template sees what Hugging Face's `apply_chat_template` gives it in vLLM: tools,
    /// the messages' tool calls, `chat_template_kwargs`, `add_generation_prompt`; and
    /// `continue_final_message` cuts after the last message.
    #[test]
    fn templates_render_tools_kwargs_and_open_turns() {
        let dir = std::env::temp_dir().join(format!("kvroute-tok-tools-{}", std::process::id()));
        let t = Tokenizer::load(&write_tokenizer(&dir, true)).unwrap();
        let request: crate::ingress::openai::ChatRequest = serde_json::from_value(serde_json::json!({
            "model": "m",
            "messages": [
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": null,
                 "tool_calls": [{"id": "1", "type": "function", "function": {"name": "search", "arguments": "{}"}}]}
            ],
            "tools": [{"type": "function", "function": {"name": "search"}}],
            "chat_template_kwargs": {"enable_thinking": true},
            "max_tokens": null,
            "stream": null
        }))
        .unwrap();
        let mut request = request;
        let options = request.take_options();
        assert_eq!(
            t.encode_chat(&request.messages, &options).unwrap(),
            // BOS, tool search, think, user : hello, assistant : tool search, assistant :
            vec![6, 7, 8, 9, 3, 5, 1, 4, 5, 7, 8, 4, 5]
        );
        let open = ChatOptions {
            add_generation_prompt: false,
            continue_final_message: true,
            ..ChatOptions::default()
        };
        let turns = [
            ChatMessage::text("user", "hello"),
            ChatMessage::text("assistant", "world"),
        ];
        // Cut after "world": no generation prompt, nothing the template adds after it.
        assert_eq!(
            t.encode_chat(&turns, &open).unwrap(),
            vec![6, 3, 5, 1, 4, 5, 2]
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Templates as Hugging Face ships them call Python's string methods (Qwen3's on every
    /// user turn), `raise_exception` and `strftime_now`; minijinja alone refused them all.
    #[test]
    fn templates_get_what_jinja2_gives_them() {
        let dir = std::env::temp_dir().join(format!("kvroute-tok-py-{}", std::process::id()));
        write_tokenizer(&dir, false);
        let template = "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system') }}{% endif %}\
            {% if not m.content.startswith('<tool_response>') %}{{ m.role }} : {{ m.content.split('|')[-1].strip() }} {% endif %}{% endfor %}\
            {% if strftime_now('%Y') | int < 2024 %}world{% endif %}";
        std::fs::write(
            dir.join("tokenizer_config.json"),
            serde_json::json!({ "chat_template": template }).to_string(),
        )
        .unwrap();
        let t = Tokenizer::load(&dir.join("tokenizer.json")).unwrap();
        let turn = ChatMessage::text;
        assert_eq!(
            t.encode_chat(&[turn("user", "nope | hello ")], &ChatOptions::default())
                .unwrap(),
            vec![3, 5, 1]
        );
        let e = t
            .encode_chat(&[turn("system", "x")], &ChatOptions::default())
            .unwrap_err();
        assert!(e.to_string().contains("no system"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn strftime_formats_utc_dates_as_python_does() {
        assert_eq!(strftime(0, "%d %b %Y").unwrap(), "01 Jan 1970");
        // 2000-02-29 (a leap day), a Tuesday; 2023-11-14 22:13:20.
        assert_eq!(
            strftime(951_782_400, "%A %a %d %B %m %y").unwrap(),
            "Tuesday Tue 29 February 02 00"
        );
        assert_eq!(
            strftime(1_700_000_000, "%Y-%m-%d %H:%M:%S %%").unwrap(),
            "2023-11-14 22:13:20 %"
        );
        assert!(strftime(0, "%Q").is_err());
    }

    #[test]
    fn missing_or_bad_files_are_clear_errors() {
        let e = Tokenizer::load(Path::new("/nonexistent/tokenizer.json"))
            .err()
            .unwrap();
        assert!(e.to_string().contains("/nonexistent/tokenizer.json"), "{e}");
        assert_eq!(Tokenizer::Bytes.encode("ab", true).unwrap(), vec![97, 98]);
    }
}
