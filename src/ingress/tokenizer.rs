//! Text to token ids: a Hugging Face `tokenizer.json` (with the chat template of the
//! `tokenizer_config.json` beside it, rendered with minijinja), or, without a file, the
//! documented byte-level tokenizer so the demo needs no downloads.

use std::path::Path;

use serde::Deserialize;

use super::openai::{ChatMessage, ChatOptions, RequestedTemplates, byte_tokens, render_chat};

mod content_format;
mod request_templates;
pub use content_format::{ContentFormat, ContentFormatOption};
use request_templates::RequestTemplates;
pub use request_templates::{CACHED as REQUEST_TEMPLATES_CACHED, RENDER_FUEL, RequestTemplate};

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
    /// A request brought its own chat template, and this router does not render them.
    #[error("{0}")]
    RequestTemplateRefused(&'static str),
    /// A prompt's text longer than is tokenized (a tokenizer peaks at up to 350 times it).
    #[error("a prompt text of {bytes} bytes or more, over the {limit} tokenized")]
    TooLong {
        /// The text's length (at least: a chat's rendering stops past the limit).
        bytes: usize,
        /// The most tokenized.
        limit: usize,
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
    /// The template environment (template `chat`, and `chat_tool_use` if the model names a
    /// `tool_use` template), if the model has a chat template.
    chat: Option<minijinja::Environment<'static>>,
    /// The content format each template wants: `chat`'s, and `chat_tool_use`'s.
    formats: (ContentFormat, ContentFormat),
    /// Template variables every chat gets unless it sets them itself (the engines'
    /// `--default-chat-template-kwargs`).
    default_kwargs: serde_json::Map<String, serde_json::Value>,
    /// The content format every template gets, if the engines are told one (vLLM's
    /// `--chat-template-content-format`); `None`: as each template wants it.
    given_format: Option<ContentFormat>,
    /// Requests' own chat templates, if trusted (`--trust-request-chat-template`).
    request_templates: Option<RequestTemplates>,
    /// The chat template came from a file given in place of the model's (`--chat-template`).
    template_from_file: bool,
    /// A chat with `tool_choice: none` renders no tools (vLLM's
    /// `--exclude-tools-when-tool-choice-none`).
    exclude_tools_on_none: bool,
    bos_token: String,
    eos_token: String,
}

#[derive(Deserialize, Default)]
struct TokenizerConfig {
    chat_template: Option<serde_json::Value>,
    bos_token: Option<serde_json::Value>,
    eos_token: Option<serde_json::Value>,
}

/// The special tokens an encoding gets, as transformers sets them: a `tokenizer_config.json`
/// that names `add_bos_token` or `add_eos_token` replaces `tokenizer.json`'s post-processor
/// with one adding the BOS and EOS tokens it asks for (`TokenizersBackend.__init__` and
/// `update_post_processor` in transformers 5; in 4.x, Llama's, Gemma's and their kin's
/// tokenizer classes). DeepSeek's distilled Qwen models, say, add their BOS that way to
/// every completion, where their `tokenizer.json` adds none: without it every block of a
/// completion's prompt is one token off the engine's.
fn special_tokens_as_configured(
    tokenizer: &mut tokenizers::Tokenizer,
    config: &serde_json::Value,
    bos: &str,
    eos: &str,
) -> Result<(), String> {
    let (add_bos, add_eos) = (config.get("add_bos_token"), config.get("add_eos_token"));
    if add_bos.is_none() && add_eos.is_none() {
        return Ok(());
    }
    let null = serde_json::Value::Null;
    let (add_bos, add_eos) = (add_bos.unwrap_or(&null), add_eos.unwrap_or(&null));
    // A flag is set by a truthy value. (A token the vocabulary lacks, which transformers
    // would add to it under a new id, is left out.)
    let token = |flag: &serde_json::Value, text: &str| {
        let on = match flag {
            serde_json::Value::Bool(b) => *b,
            serde_json::Value::Number(n) => n.as_f64().is_some_and(|n| n != 0.0),
            _ => false,
        };
        on.then(|| tokenizer.token_to_id(text).map(|id| (text.to_owned(), id)))
            .flatten()
    };
    let (bos, eos) = (token(add_bos, bos), token(add_eos, eos));
    let single = [
        bos.as_ref().map(|(t, _)| format!("{t}:0")),
        Some("$A:0".to_owned()),
        eos.as_ref().map(|(t, _)| format!("{t}:0")),
    ];
    let pair = [
        bos.as_ref().map(|(t, _)| format!("{t}:1")),
        Some("$B:1".to_owned()),
        eos.as_ref().map(|(t, _)| format!("{t}:1")),
    ];
    let single: Vec<String> = single.into_iter().flatten().collect();
    let pair: Vec<String> = single
        .iter()
        .cloned()
        .chain(pair.into_iter().flatten())
        .collect();
    let processor = tokenizers::processors::template::TemplateProcessing::builder()
        .try_single(single.join(" "))?
        .try_pair(pair.join(" "))?
        .special_tokens(bos.into_iter().chain(eos).collect::<Vec<_>>())
        .build()
        .map_err(|e| e.to_string())?;
    tokenizer.with_post_processor(Some(processor));
    Ok(())
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

/// Keeps the last `keep` of `tokens` (all if `None`): vLLM's `truncate_prompt_tokens` on a
/// prompt given as token ids.
pub fn keep_last(tokens: &mut Vec<u32>, keep: Option<usize>) {
    if let Some(keep) = keep
        && keep < tokens.len()
    {
        tokens.drain(..tokens.len() - keep);
    }
}

/// The template of a multimodal model's processor, from `chat_template.json` beside the
/// tokenizer (`{"chat_template": "…"}`, as transformers' processors save it), else from the
/// `chat_template` string of `processor_config.json` (where earlier transformers saved it;
/// later ones still read it, with a warning), if there is one. With both, the file is taken,
/// as transformers 4.x takes it; the newest transformers take the config's key instead.
fn processor_template(tokenizer: &Path) -> Result<Option<String>, String> {
    let file = tokenizer.with_file_name("chat_template.json");
    let text = match std::fs::read_to_string(&file) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(legacy_processor_template(tokenizer));
        }
        Err(e) => return Err(format!("{}: {e}", file.display())),
    };
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", file.display()))?;
    match value.get("chat_template") {
        Some(serde_json::Value::String(template)) => Ok(Some(template.clone())),
        _ => Err(format!(
            "{}: no \"chat_template\" string in it",
            file.display()
        )),
    }
}

/// The `chat_template` string of `processor_config.json` beside the tokenizer. A file that
/// cannot be read or parsed gives none, with a warning: vLLM then falls back to the
/// tokenizer's template too (it loads the processor in a `try`).
fn legacy_processor_template(tokenizer: &Path) -> Option<String> {
    let file = tokenizer.with_file_name("processor_config.json");
    let text = std::fs::read_to_string(&file).ok()?;
    match serde_json::from_str::<serde_json::Value>(&text) {
        Ok(config) => config
            .get("chat_template")
            .and_then(|t| t.as_str())
            .map(str::to_owned),
        Err(e) => {
            tracing::warn!(file = %file.display(), error = %e, "unreadable processor config: its chat template, if any, is not used");
            None
        }
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json` and, if present beside it, `tokenizer_config.json` and
    /// `chat_template.jinja` (where recent transformers save the template; it wins over
    /// the config's, as in transformers), else `chat_template.json` or the `chat_template`
    /// of `processor_config.json` (a multimodal model's processor template, which vLLM
    /// prefers to the tokenizer's for requests without tools).
    pub fn load(path: &Path) -> Result<Tokenizer, TokenizerError> {
        Tokenizer::load_with(path, None)
    }

    /// As [`Tokenizer::load`], with the chat template of the file `chat_template` instead
    /// of the model's (what vLLM's and SGLang's `--chat-template FILE` do).
    pub fn load_with(
        path: &Path,
        chat_template: Option<&Path>,
    ) -> Result<Tokenizer, TokenizerError> {
        let err = |reason: String| TokenizerError::Load {
            path: path.display().to_string(),
            reason,
        };
        let mut tokenizer =
            tokenizers::Tokenizer::from_file(path).map_err(|e| err(e.to_string()))?;
        // The file's own truncation and padding are not the engines': transformers turns
        // both off for every call that does not ask for them (`set_truncation_and_padding`
        // in `tokenization_utils_fast.py`), so vLLM and SGLang see whole, unpadded prompts.
        // Some repacks ship `"truncation": {"max_length": 2048}`, which cut every prompt.
        tokenizer
            .with_truncation(None)
            .map_err(|e| err(e.to_string()))?;
        tokenizer.with_padding(None);
        let config_path = path.with_file_name("tokenizer_config.json");
        let raw: serde_json::Value = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text)
                .map_err(|e| err(format!("{}: {e}", config_path.display())))?,
            Err(_) => serde_json::json!({}),
        };
        let config = TokenizerConfig::deserialize(&raw)
            .map_err(|e| err(format!("{}: {e}", config_path.display())))?;
        let bos_token = token_text(config.bos_token.clone());
        let eos_token = token_text(config.eos_token.clone());
        special_tokens_as_configured(&mut tokenizer, &raw, &bos_token, &eos_token)
            .map_err(|e| err(format!("{}: {e}", config_path.display())))?;
        // A template is a string, or a list of named templates: "default", and "tool_use"
        // for requests with tools (transformers' `get_chat_template`).
        let named = |name: &str| match &config.chat_template {
            Some(serde_json::Value::String(s)) if name == "default" => Some(s.clone()),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some(name))
                .and_then(|t| t.get("template")?.as_str().map(str::to_owned)),
            _ => None,
        };
        // A named template saved as its own file (transformers'
        // `additional_chat_templates/<name>.jinja`, beside `chat_template.jinja`, the
        // default): it takes the place of the config's template of that name.
        let additional = |name: &str| {
            let file = path
                .with_file_name("additional_chat_templates")
                .join(format!("{name}.jinja"));
            match std::fs::read_to_string(&file) {
                Ok(source) => Ok(Some(source)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(err(format!("{}: {e}", file.display()))),
            }
        };
        let tool_use_file = additional("tool_use")?;
        // The config's `tool_use` template counts only beside its `default` one: a template
        // file (the engine's `--chat-template`, or `chat_template.jinja`, which makes
        // transformers ignore the config's) serves every request but those with tools,
        // which a `tool_use.jinja` beside `chat_template.jinja` serves (transformers loads
        // the two as one named set, and vLLM asks it for `tool_use` when a request has
        // tools).
        let (template, tool_use) = match chat_template {
            Some(file) => (
                Some(
                    std::fs::read_to_string(file)
                        .map_err(|e| err(format!("chat template {}: {e}", file.display())))?,
                ),
                None,
            ),
            None => {
                let file = path.with_file_name("chat_template.jinja");
                match std::fs::read_to_string(&file) {
                    Ok(source) => (Some(source), tool_use_file),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        let tool_use = tool_use_file.or_else(|| named("tool_use"));
                        match processor_template(path).map_err(err)? {
                            // vLLM's order (`resolve_chat_template`): the processor's
                            // template, unless the request has tools; then the tokenizer's
                            // (`get_chat_template`: its `tool_use`, else its `default`).
                            Some(processor) => {
                                (Some(processor), tool_use.or_else(|| named("default")))
                            }
                            None => (named("default"), tool_use),
                        }
                    }
                    Err(e) => return Err(err(format!("{}: {e}", file.display()))),
                }
            }
        };
        let mut formats = (ContentFormat::String, ContentFormat::String);
        let chat = match template {
            Some(source) => {
                let compile = |e: minijinja::Error| TokenizerError::Template {
                    reason: e.to_string(),
                };
                let mut env = chat_environment();
                let source = generation_as_if(&source);
                formats.0 = content_format::detect(&source);
                env.add_template_owned("chat", source).map_err(compile)?;
                if let Some(tool_use) = tool_use {
                    let tool_use = generation_as_if(&tool_use);
                    formats.1 = content_format::detect(&tool_use);
                    env.add_template_owned("chat_tool_use", tool_use)
                        .map_err(compile)?;
                }
                tracing::info!(
                    format = ?formats.0,
                    "the chat template takes message content in this format (as vLLM detects it)"
                );
                Some(env)
            }
            None => None,
        };
        Ok(Tokenizer::Hf(Box::new(HfTokenizer {
            tokenizer,
            chat,
            formats,
            default_kwargs: serde_json::Map::new(),
            given_format: None,
            request_templates: None,
            template_from_file: chat_template.is_some(),
            exclude_tools_on_none: false,
            bos_token,
            eos_token,
        })))
    }

    /// The content format the chat templates get: as each wants it (`Auto`, the default),
    /// or the one the engines are told (vLLM's `--chat-template-content-format`).
    pub fn set_content_format(&mut self, option: ContentFormatOption) {
        let given = match option {
            ContentFormatOption::Auto => return,
            ContentFormatOption::String => ContentFormat::String,
            ContentFormatOption::OpenAi => ContentFormat::OpenAi,
        };
        if let Tokenizer::Hf(hf) = self {
            hf.formats = (given, given);
            hf.given_format = Some(given);
        }
    }

    /// Render the chat templates requests bring (vLLM's `--trust-request-chat-template`);
    /// without it they are refused, as vLLM refuses them. The byte tokenizer refuses them
    /// either way (it has no template engine settings to render them with).
    pub fn trust_request_chat_templates(&mut self) {
        if let Tokenizer::Hf(hf) = self {
            hf.request_templates = Some(RequestTemplates::default());
        }
    }

    /// Render no tools for a chat whose `tool_choice` is `none` (vLLM's
    /// `--exclude-tools-when-tool-choice-none`: `render_chat` drops them then).
    pub fn exclude_tools_when_tool_choice_none(&mut self) {
        if let Tokenizer::Hf(hf) = self {
            hf.exclude_tools_on_none = true;
        }
    }

    /// Whether a chat with `tool_choice` renders its tools.
    pub fn renders_tools(&self, tool_choice: Option<&serde_json::Value>) -> bool {
        match self {
            Tokenizer::Hf(hf) => {
                !(hf.exclude_tools_on_none && tool_choice.and_then(|c| c.as_str()) == Some("none"))
            }
            Tokenizer::Bytes => true,
        }
    }

    /// Whether the chat template was given in place of the model's (`--chat-template FILE`,
    /// as the engines' own flag): vLLM renders it in place of a request's `chat_template`
    /// in its kwargs.
    fn has_own_template(&self) -> bool {
        matches!(self, Tokenizer::Hf(hf) if hf.template_from_file)
    }

    /// The template a chat that brought `requested` renders with, compiled (or from the
    /// cache of recent ones); `None`: the model's. A request that brought any is refused
    /// unless this tokenizer renders request templates, whichever would render, as vLLM
    /// refuses it.
    pub fn chat_template_for(
        &self,
        requested: RequestedTemplates,
    ) -> Result<Option<std::sync::Arc<RequestTemplate>>, TokenizerError> {
        if !requested.any() {
            return Ok(None);
        }
        let cache = self.request_template_cache()?;
        requested
            .pick(self.has_own_template())
            .map(|source| cache.get(&source))
            .transpose()
    }

    /// A request's chat template, compiled (or from the cache of recent ones), if this
    /// tokenizer renders them.
    pub fn request_template(
        &self,
        source: &str,
    ) -> Result<std::sync::Arc<RequestTemplate>, TokenizerError> {
        self.request_template_cache()?.get(source)
    }

    fn request_template_cache(&self) -> Result<&RequestTemplates, TokenizerError> {
        match self {
            Tokenizer::Hf(hf) => match &hf.request_templates {
                Some(templates) => Ok(templates),
                None => Err(TokenizerError::RequestTemplateRefused(
                    "Chat template is passed with request, but --trust-request-chat-template \
                     is not set. Refused request with untrusted chat template (as vLLM \
                     refuses it; kvroute serve --trust-request-chat-template, with the \
                     engines', renders it)",
                )),
            },
            Tokenizer::Bytes => Err(TokenizerError::RequestTemplateRefused(
                "Chat template is passed with request, but the router has no tokenizer to \
                 render it with (kvroute serve --tokenizer)",
            )),
        }
    }

    /// Template variables every chat gets unless its `chat_template_kwargs` set them (vLLM's
    /// and SGLang's `--default-chat-template-kwargs`, e.g. `{"enable_thinking": false}`).
    pub fn set_default_chat_kwargs(&mut self, kwargs: serde_json::Map<String, serde_json::Value>) {
        if let Tokenizer::Hf(hf) = self {
            hf.default_kwargs = kwargs;
        }
    }

    /// A chat's options with the default template variables it does not set itself.
    pub fn with_default_kwargs(&self, mut options: ChatOptions) -> ChatOptions {
        if let Tokenizer::Hf(hf) = self {
            for (k, v) in &hf.default_kwargs {
                if !options.kwargs.contains_key(k) {
                    options.kwargs.insert(k.clone(), v.clone());
                }
            }
        }
        options
    }

    /// Token ids of a prompt; with `add_special_tokens`, the tokenizer's own (BOS) added as
    /// its post-processor says.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        self.encode_within(text, add_special_tokens, None)
    }

    /// As [`Tokenizer::encode`], keeping at most `keep` tokens as vLLM does for a request's
    /// `truncate_prompt_tokens`: it has the tokenizer truncate on the left (a generating
    /// model's `truncation_side`), and Hugging Face's tokenizers cut the text's tokens before
    /// adding the special ones, leaving room for them: a Llama-style tokenizer keeps its BOS
    /// and the last `keep - 1` tokens of the text (`TokenizerImpl::post_process`).
    pub fn encode_within(
        &self,
        text: &str,
        add_special_tokens: bool,
        keep: Option<usize>,
    ) -> Result<Vec<u32>, TokenizerError> {
        let failed = |e: tokenizers::Error| TokenizerError::Encode {
            reason: e.to_string(),
        };
        match self {
            Tokenizer::Bytes => {
                let mut tokens = byte_tokens(text);
                keep_last(&mut tokens, keep);
                Ok(tokens)
            }
            Tokenizer::Hf(hf) => {
                let tokenizer = &hf.tokenizer;
                let encoding = match keep {
                    None => tokenizer.encode(text, add_special_tokens).map_err(failed)?,
                    Some(keep) => {
                        let text_only = tokenizer.encode(text, false).map_err(failed)?;
                        let added = match tokenizer.get_post_processor() {
                            Some(p) if add_special_tokens => {
                                tokenizers::PostProcessor::added_tokens(p, false)
                            }
                            _ => 0,
                        };
                        let kept = last_tokens(&text_only, keep.saturating_sub(added));
                        drop(text_only);
                        tokenizer
                            .post_process(kept, None, add_special_tokens)
                            .map_err(failed)?
                    }
                };
                Ok(encoding.get_ids().to_vec())
            }
        }
    }

    /// As [`Tokenizer::encode_within`], refusing text longer than `limit` bytes before it
    /// is tokenized ([`TokenizerError::TooLong`]): a Hugging Face tokenizer peaks at 150 to
    /// 350 times the text it is given.
    pub fn encode_limited(
        &self,
        text: &str,
        add_special_tokens: bool,
        keep: Option<usize>,
        limit: usize,
    ) -> Result<Vec<u32>, TokenizerError> {
        if text.len() > limit {
            return Err(TokenizerError::TooLong {
                bytes: text.len(),
                limit,
            });
        }
        self.encode_within(text, add_special_tokens, keep)
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
        self.encode_chat_within(messages, options, None)
    }

    /// As [`Tokenizer::encode_chat`], keeping at most `keep` tokens as
    /// [`Tokenizer::encode_within`] does.
    pub fn encode_chat_within(
        &self,
        messages: &[ChatMessage],
        options: &ChatOptions,
        keep: Option<usize>,
    ) -> Result<Vec<u32>, TokenizerError> {
        let text = self.render(messages, options)?;
        self.encode_within(&text, options.add_special_tokens, keep)
    }

    /// The chat's text as the template renders it, before it is tokenized
    /// ([`Tokenizer::encode_chat`] is this and [`Tokenizer::encode_within`]); a rendering
    /// longer than `limit` bytes is stopped there ([`TokenizerError::TooLong`], with the
    /// bytes it had reached): a template is a program, and a request's own may write
    /// gigabytes in a few instructions, which fuel does not count.
    pub fn chat_text(
        &self,
        messages: &[ChatMessage],
        options: &ChatOptions,
        limit: usize,
    ) -> Result<String, TokenizerError> {
        self.render_within(messages, options, limit)
    }

    /// The chat's text as the template renders it ([`Tokenizer::encode_chat`] tokenizes it).
    fn render(
        &self,
        messages: &[ChatMessage],
        options: &ChatOptions,
    ) -> Result<String, TokenizerError> {
        self.render_within(messages, options, usize::MAX)
    }

    /// [`Tokenizer::render`], at most `limit` bytes of it.
    fn render_within(
        &self,
        messages: &[ChatMessage],
        options: &ChatOptions,
        limit: usize,
    ) -> Result<String, TokenizerError> {
        let template_error = |e: minijinja::Error| TokenizerError::Template {
            reason: e.to_string(),
        };
        // The template: the request's own (trusted, see [`Tokenizer::request_template`]),
        // else the model's (its `tool_use` one for a request with tools, if it has one).
        let tools = options.tools.as_ref().is_some_and(|t| !t.is_null());
        let chosen = match (&options.template, self) {
            (Some(own), Tokenizer::Hf(hf)) => Some((
                own.env(),
                "chat",
                hf.given_format.unwrap_or(own.format()),
                &**hf,
            )),
            (Some(_), Tokenizer::Bytes) => {
                return Err(TokenizerError::RequestTemplateRefused(
                    "the byte tokenizer renders no request chat templates",
                ));
            }
            (None, Tokenizer::Hf(hf)) => hf.chat.as_ref().map(|env| {
                if tools && env.get_template("chat_tool_use").is_ok() {
                    (env, "chat_tool_use", hf.formats.1, &**hf)
                } else {
                    (env, "chat", hf.formats.0, &**hf)
                }
            }),
            (None, Tokenizer::Bytes) => None,
        };
        let mut format = ContentFormat::String;
        let text = match chosen {
            Some((env, name, content_format, hf)) => {
                // vLLM's `_preprocess_chat`: `add_generation_prompt`, `tools` and
                // `documents`, overridden by the request's `chat_template_kwargs`; then
                // Hugging Face's renderer puts the special tokens under those and the
                // messages over them.
                fn value<T: serde::Serialize>(v: &T) -> minijinja::Value {
                    minijinja::Value::from(minijinja::value::Serde(v))
                }
                let mut context: std::collections::BTreeMap<String, minijinja::Value> =
                    std::collections::BTreeMap::new();
                context.insert("bos_token".into(), hf.bos_token.as_str().into());
                context.insert("eos_token".into(), hf.eos_token.as_str().into());
                context.insert("tools".into(), value(&options.tools));
                context.insert("documents".into(), value(&options.documents));
                context.insert(
                    "add_generation_prompt".into(),
                    options.add_generation_prompt.into(),
                );
                for (k, v) in &options.kwargs {
                    context.insert(k.clone(), value(v));
                }
                format = content_format;
                let messages = match format {
                    ContentFormat::String => value(&messages),
                    ContentFormat::OpenAi => value(&with_parts(messages)?),
                };
                context.insert("messages".into(), messages);
                let mut out = Bounded {
                    text: Vec::new(),
                    limit,
                    over: None,
                };
                let rendered = env
                    .get_template(name)
                    .map_err(template_error)?
                    .render_captured_to(context, &mut out)
                    .map(drop);
                if let Some(bytes) = out.over {
                    return Err(TokenizerError::TooLong { bytes, limit });
                }
                rendered.map_err(template_error)?;
                String::from_utf8(out.text).map_err(|e| TokenizerError::Template {
                    reason: format!("the template wrote text that is not UTF-8: {e}"),
                })?
            }
            None => render_chat(messages, options.add_generation_prompt),
        };
        if options.continue_final_message {
            continued(&text, messages, format)
        } else {
            Ok(text)
        }
    }
}

/// A rendering's text, refusing to grow past `limit` bytes (the write fails, which ends the
/// rendering; `over` says how far it had reached).
struct Bounded {
    text: Vec<u8>,
    limit: usize,
    over: Option<usize>,
}

impl std::io::Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let reached = self.text.len().saturating_add(buf.len());
        if reached > self.limit {
            self.over = Some(reached);
            return Err(std::io::Error::other("the rendering is over its limit"));
        }
        self.text.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The messages with each one's content as its list of parts (the "openai" format). A tool
/// result's text parts are joined back into a string with newlines, since most templates
/// take a tool result as a string (vLLM's `_parse_chat_message_content`, which keeps a list
/// only for parts other than text).
fn with_parts(messages: &[ChatMessage]) -> Result<Vec<serde_json::Value>, TokenizerError> {
    messages
        .iter()
        .map(|m| {
            let mut v = serde_json::to_value(m).map_err(|e| TokenizerError::Template {
                reason: e.to_string(),
            })?;
            if let Some(content) = v.get_mut("content") {
                *content = if m.role == "tool" {
                    let texts: Vec<&str> = m
                        .parts
                        .iter()
                        .map(|p| p.get("text").and_then(|t| t.as_str()).unwrap_or(""))
                        .collect();
                    serde_json::Value::String(texts.join("\n"))
                } else {
                    serde_json::Value::Array(m.parts.clone())
                };
            }
            Ok(v)
        })
        .collect()
}

/// The rendered chat cut right after the last message's content, so the model continues it,
/// as Hugging Face's renderer cuts it for `continue_final_message` (`render_jinja_template`
/// in transformers' `utils/chat_template_utils.py`): at the last occurrence of the trimmed
/// content (some templates trim it), ending after its untrimmed end where the rendering
/// kept that whole, else after the trimmed end; of a list of parts, the last part with text.
fn continued(
    text: &str,
    messages: &[ChatMessage],
    format: ContentFormat,
) -> Result<String, TokenizerError> {
    let fail = |what: &str| TokenizerError::Template {
        reason: format!("continue_final_message: {what}"),
    };
    let last = match (messages.last(), format) {
        (None, _) => "",
        (Some(m), ContentFormat::String) => m.content.as_str(),
        (Some(m), ContentFormat::OpenAi) => m
            .parts
            .iter()
            .rev()
            .find_map(|p| p.get("text")?.as_str())
            .ok_or_else(|| fail("the last message has no text to continue"))?,
    };
    let trimmed = last.trim();
    let at = text
        .rfind(trimmed)
        .ok_or_else(|| fail("the last message's content is not in the rendered chat"))?;
    let whole = last.trim_start().len();
    let end = if text.get(at..at + whole) == Some(last) {
        at + whole
    } else {
        at + trimmed.len()
    };
    Ok(text[..end].to_owned())
}

/// `source` with transformers' `{% generation %}…{% endgeneration %}` blocks (its
/// `AssistantTracker` extension, which marks the assistant's tokens for training recipes
/// such as TRL's `assistant_only_loss`; fine-tunes ship templates with them) written as
/// `{% if true %}…{% endif %}`, which renders the same: the extension renders a block's
/// body unchanged, and Jinja2 trims around any block tag alike. minijinja has no custom
/// tags, and refused such templates (a router that would not start on the model).
pub(crate) fn generation_as_if(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        // `{%`, a whitespace control mark, spaces, the name, spaces, a mark, `%}`.
        let inner_from = 2 + usize::from(tag[2..].starts_with(['-', '+']));
        let inner = &tag[inner_from..];
        let name_from = inner.len() - inner.trim_start().len();
        let name_len = inner[name_from..]
            .find(|c: char| !c.is_ascii_alphanumeric() && c != '_')
            .unwrap_or(inner.len() - name_from);
        let name = &inner[name_from..name_from + name_len];
        let after = inner[name_from + name_len..].trim_start();
        let closes = after.starts_with("%}")
            || (after.starts_with(['-', '+']) && after[1..].starts_with("%}"));
        let replacement = match name {
            "generation" if closes => Some("if true"),
            "endgeneration" if closes => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                out.push_str(&tag[..inner_from + name_from]);
                out.push_str(r);
                rest = &tag[inner_from + name_from + name_len..];
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// The environment chat templates are rendered in: what Hugging Face's renderer (Jinja2,
/// which vLLM and SGLang use) gives templates beyond minijinja's builtins, so a template
/// renders here as it does in the engine (the router must hash the engine's tokens):
/// Python's string and dict methods, `raise_exception` (templates reject a malformed
/// conversation with it) and `strftime_now` (Llama 3.x date their system prompt).
fn chat_environment() -> minijinja::Environment<'static> {
    let mut env = minijinja::Environment::new();
    // transformers' `_compile_jinja_template`: `ImmutableSandboxedEnvironment(trim_blocks=
    // True, lstrip_blocks=True, extensions=[..., loopcontrols])`, and its own `tojson`.
    if let Ok(syntax) = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
    {
        env.set_syntax(syntax);
    }
    env.add_filter("tojson", tojson);
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

/// transformers' `tojson` filter: `json.dumps(x, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`. Python's separators (`", "` and `": "`;
/// `","` between items when indented), maps in their order, nothing escaped for HTML
/// (minijinja's own escapes `<`, `>`, `&` and `'`), non-ASCII as it is unless
/// `ensure_ascii`.
fn tojson(
    value: &minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> Result<String, minijinja::Error> {
    let indent = kwargs
        .get::<Option<minijinja::Value>>("indent")?
        .and_then(|v| match v.kind() {
            minijinja::value::ValueKind::Number => i64::try_from(v)
                .ok()
                .map(|n| " ".repeat(n.clamp(0, 64) as usize)),
            minijinja::value::ValueKind::String => v.as_str().map(str::to_owned),
            _ => None,
        });
    let ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let sort = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let separators = kwargs.get::<Option<Vec<String>>>("separators")?;
    kwargs.assert_all_used()?;
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                "tojson: separators must be two strings",
            ));
        }
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let style = JsonStyle {
        indent,
        item,
        key,
        ascii,
        sort,
    };
    let mut out = String::new();
    style.write(&mut out, value, 0)?;
    Ok(out)
}

/// How [`tojson`] writes.
struct JsonStyle {
    indent: Option<String>,
    item: String,
    key: String,
    ascii: bool,
    sort: bool,
}

impl JsonStyle {
    fn write(
        &self,
        out: &mut String,
        v: &minijinja::Value,
        depth: usize,
    ) -> Result<(), minijinja::Error> {
        use minijinja::value::ValueKind;
        if depth > 128 {
            return Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                "tojson: nested too deeply",
            ));
        }
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => out.push_str(&python_number(v)),
            ValueKind::String | ValueKind::Bytes | ValueKind::Plain | ValueKind::Invalid => {
                self.string(out, &v.to_string())
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<minijinja::Value> = v.try_iter()?.collect();
                self.open(out, '[', ']', items.len(), depth, |out, i, depth| {
                    self.write(out, &items[i], depth)
                })?;
            }
            ValueKind::Map => {
                let mut keys: Vec<minijinja::Value> = v.try_iter()?.collect();
                if self.sort {
                    keys.sort_by_key(|k| k.to_string());
                }
                self.open(out, '{', '}', keys.len(), depth, |out, i, depth| {
                    self.string(out, &keys[i].to_string());
                    out.push_str(&self.key);
                    self.write(out, &v.get_item(&keys[i])?, depth)
                })?;
            }
            _ => self.string(out, &v.to_string()),
        }
        Ok(())
    }

    /// A container of `n` items, each written by `item`, in Python's layout.
    fn open(
        &self,
        out: &mut String,
        start: char,
        end: char,
        n: usize,
        depth: usize,
        mut item: impl FnMut(&mut String, usize, usize) -> Result<(), minijinja::Error>,
    ) -> Result<(), minijinja::Error> {
        out.push(start);
        if n == 0 {
            out.push(end);
            return Ok(());
        }
        let newline = |out: &mut String, level: usize| {
            if let Some(indent) = &self.indent {
                out.push('\n');
                for _ in 0..level {
                    out.push_str(indent);
                }
            }
        };
        for i in 0..n {
            if i > 0 {
                out.push_str(&self.item);
            }
            newline(out, depth + 1);
            item(out, i, depth + 1)?;
        }
        newline(out, depth);
        out.push(end);
        Ok(())
    }

    /// A JSON string as Python writes it (`\uXXXX` for control characters, and for all
    /// non-ASCII with `ensure_ascii`, as UTF-16 units).
    fn string(&self, out: &mut String, s: &str) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ascii && (c as u32) > 0x7e) => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{u:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// A number as Python's `json.dumps` writes it: integers as they are, floats by `repr`
/// (`1.0`, `0.1`, `1e+20`, `NaN`, `Infinity`).
fn python_number(v: &minijinja::Value) -> String {
    if v.is_integer() {
        return v.to_string();
    }
    let Ok(f) = f64::try_from(v.clone()) else {
        return v.to_string();
    };
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // Python's repr: the shortest digits that read back (Rust's `{:e}` gives the same),
    // positional when the decimal exponent is in -4..16, else exponent form with a sign
    // and at least two digits.
    let shortest = format!("{f:e}");
    let (mantissa, e) = shortest.split_once('e').unwrap_or((&shortest, "0"));
    let exp: i32 = e.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let s = format!("{f}");
        if s.contains('.') { s } else { format!("{s}.0") }
    } else {
        format!(
            "{mantissa}e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.abs()
        )
    }
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

/// The last `n` tokens of `e`, as `Encoding::truncate(n, 0, Left)` keeps them but without
/// its overflowing pieces: it makes one encoding of every window of `n` tokens it drops
/// (and post-processing copies them twice more), so a 4 M-token text cut to its last two
/// took gigabytes.
fn last_tokens(e: &tokenizers::Encoding, n: usize) -> tokenizers::Encoding {
    let cut = e.len().saturating_sub(n);
    tokenizers::Encoding::new(
        e.get_ids()[cut..].to_vec(),
        e.get_type_ids()[cut..].to_vec(),
        e.get_tokens()[cut..].to_vec(),
        e.get_word_ids()[cut..].to_vec(),
        e.get_offsets()[cut..].to_vec(),
        e.get_special_tokens_mask()[cut..].to_vec(),
        e.get_attention_mask()[cut..].to_vec(),
        Vec::new(),
        Default::default(),
    )
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

    /// A `tokenizer.json` that carries its own truncation and padding is read as
    /// transformers reads it for the engines: neither applies (control: the file's
    /// settings do cut and pad when the tokenizers crate is used as the file says).
    #[test]
    fn the_file_s_truncation_and_padding_do_not_apply() {
        let dir = std::env::temp_dir().join(format!("kvroute-tok-trunc-{}", std::process::id()));
        let path = write_tokenizer(&dir, false);
        let mut json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        json["truncation"] = serde_json::json!({"direction": "Right", "max_length": 3, "strategy": "LongestFirst", "stride": 0});
        json["padding"] = serde_json::json!({"strategy": {"Fixed": 8}, "direction": "Right", "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "[UNK]"});
        std::fs::write(&path, json.to_string()).unwrap();
        let text = "hello world world hello";
        let control = tokenizers::Tokenizer::from_file(&path).unwrap();
        assert_eq!(
            control.encode(text, true).unwrap().get_ids(),
            [6, 1, 2, 0, 0, 0, 0, 0]
        );
        let t = Tokenizer::load(&path).unwrap();
        assert_eq!(t.encode(text, true).unwrap(), [6, 1, 2, 2, 1]);
        assert_eq!(t.encode("hello", true).unwrap(), [6, 1]);
        assert_eq!(t.encode_within(text, true, Some(4)).unwrap(), [6, 2, 2, 1]);
        std::fs::remove_dir_all(&dir).ok();
    }

    /// `truncate_prompt_tokens` cuts as Hugging Face's tokenizers cut for vLLM: the text's
    /// tokens on the left, with room left for the special tokens, which are added after
    /// (Llama's BOS stays first); without special tokens, the last `keep`.
    #[test]
    fn a_cut_prompt_keeps_its_special_tokens() {
        let dir = std::env::temp_dir().join(format!("kvroute-tok-cut-{}", std::process::id()));
        let t = Tokenizer::load(&write_tokenizer(&dir, false)).unwrap();
        let text = "hello world world hello";
        assert_eq!(t.encode(text, true).unwrap(), [6, 1, 2, 2, 1]);
        assert_eq!(t.encode_within(text, true, Some(3)).unwrap(), [6, 2, 1]);
        assert_eq!(t.encode_within(text, false, Some(3)).unwrap(), [2, 2, 1]);
        assert_eq!(t.encode_within(text, true, Some(1)).unwrap(), [6]);
        assert_eq!(
            t.encode_within(text, true, Some(5)).unwrap(),
            [6, 1, 2, 2, 1]
        );
        assert_eq!(
            t.encode_within(text, true, Some(100)).unwrap(),
            [6, 1, 2, 2, 1]
        );
        std::fs::remove_dir_all(&dir).ok();
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

    /// The engines' default template variables reach every chat that does not set them.
    #[test]
    fn default_kwargs_apply_unless_the_chat_sets_them() {
        let (dir, mut t) = with_config(
            "defaults",
            serde_json::json!({"chat_template": "{% if enable_thinking is defined %}{{ enable_thinking }}{% else %}unset{% endif %}"}),
        );
        let hello = [ChatMessage::text("user", "hi")];
        let render = |t: &Tokenizer, kwargs: serde_json::Value| {
            let mut options = ChatOptions::default();
            if let serde_json::Value::Object(map) = kwargs {
                options.kwargs = map;
            }
            t.render(&hello, &t.with_default_kwargs(options)).unwrap()
        };
        assert_eq!(render(&t, serde_json::json!({})), "unset");
        let mut defaults = serde_json::Map::new();
        defaults.insert("enable_thinking".into(), false.into());
        t.set_default_chat_kwargs(defaults);
        // (Booleans print as Python's do.)
        assert_eq!(render(&t, serde_json::json!({})), "False");
        assert_eq!(
            render(&t, serde_json::json!({"enable_thinking": true})),
            "True"
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    /// `add_bos_token` / `add_eos_token` in `tokenizer_config.json` decide the special
    /// tokens of an encoding, whatever `tokenizer.json`'s post-processor adds (transformers
    /// rebuilds it from them); without either flag, the post-processor stands.
    #[test]
    fn configured_bos_and_eos_replace_the_post_processor() {
        let cases = [
            (serde_json::json!({}), vec![6, 1, 2]),
            (serde_json::json!({"add_bos_token": false}), vec![1, 2]),
            (
                serde_json::json!({"add_bos_token": true, "add_eos_token": true, "eos_token": "tool"}),
                vec![6, 1, 2, 7],
            ),
            (
                serde_json::json!({"add_eos_token": true, "eos_token": "tool"}),
                vec![1, 2, 7],
            ),
        ];
        for (i, (config, ids)) in cases.into_iter().enumerate() {
            let mut config = config;
            if config.get("bos_token").is_none() {
                config["bos_token"] = "BOS".into();
            }
            let (dir, t) = with_config(&format!("special-{i}"), config.clone());
            assert_eq!(t.encode("hello world", true).unwrap(), ids, "{config}");
            assert_eq!(t.encode("hello world", false).unwrap(), vec![1, 2]);
            std::fs::remove_dir_all(&dir).ok();
        }
    }

    /// `continue_final_message` cuts where transformers cuts: at the last occurrence of the
    /// trimmed content, keeping its trailing whitespace only where the rendering kept it.
    /// The untrimmed content searched first (as before) found "yes " inside the user's turn.
    #[test]
    fn a_continued_message_is_cut_as_transformers_cuts_it() {
        let turns = |last: &str| {
            [
                ChatMessage::text("user", "yes please"),
                ChatMessage::text("assistant", last),
            ]
        };
        let cut = |text: &str, last: &str, format| continued(text, &turns(last), format).unwrap();
        // A template that trims (Llama 3.x's `| trim`).
        let trimmed = "<user>yes please</s><assistant>yes</s>";
        assert_eq!(
            cut(trimmed, "yes ", ContentFormat::String),
            "<user>yes please</s><assistant>yes"
        );
        // One that keeps the content whole keeps its trailing space.
        let kept = "<user>yes please</s><assistant>yes </s>";
        assert_eq!(
            cut(kept, "yes ", ContentFormat::String),
            "<user>yes please</s><assistant>yes "
        );
        // Leading whitespace: the trimmed end (transformers compares with the whole).
        let led = "<user>yes please</s><assistant> yes </s>";
        assert_eq!(
            cut(led, " yes ", ContentFormat::String),
            "<user>yes please</s><assistant> yes"
        );
        // Parts: the last one with text, past an image after it.
        let mut last = ChatMessage::text("assistant", "yes");
        last.parts
            .push(serde_json::json!({"type": "image_url", "image_url": {"url": "x"}}));
        let messages = [ChatMessage::text("user", "yes please"), last];
        assert_eq!(
            continued(trimmed, &messages, ContentFormat::OpenAi).unwrap(),
            "<user>yes please</s><assistant>yes"
        );
        assert!(continued("<user>no</s>", &turns("yes"), ContentFormat::String).is_err());
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

    /// A model saved by recent transformers with a default and a `tool_use` template
    /// (`chat_template.jinja` and `additional_chat_templates/tool_use.jinja`): requests
    /// with tools render with `tool_use`, as vLLM asks transformers for it; the others with
    /// the default. Before, the default rendered both, and tool-calling traffic never
    /// matched the engine's cache.
    #[test]
    fn a_tool_use_template_file_serves_requests_with_tools() {
        let (dir, _) = with_config("tool-file", serde_json::json!({}));
        std::fs::write(
            dir.join("chat_template.jinja"),
            "default:{{ messages | length }}",
        )
        .unwrap();
        std::fs::create_dir_all(dir.join("additional_chat_templates")).unwrap();
        std::fs::write(
            dir.join("additional_chat_templates/tool_use.jinja"),
            "tools:{{ tools | length }}",
        )
        .unwrap();
        let t = Tokenizer::load(&dir.join("tokenizer.json")).unwrap();
        let one = [ChatMessage::text("user", "hi")];
        assert_eq!(
            t.render(&one, &ChatOptions::default()).unwrap(),
            "default:1"
        );
        let tools = ChatOptions {
            tools: Some(serde_json::json!([{"type": "function", "function": {"name": "f"}}])),
            ..ChatOptions::default()
        };
        assert_eq!(t.render(&one, &tools).unwrap(), "tools:1");
        // Without `chat_template.jinja` the file takes the config's `tool_use` place too.
        std::fs::remove_file(dir.join("chat_template.jinja")).unwrap();
        std::fs::write(
            dir.join("tokenizer_config.json"),
            serde_json::json!({"chat_template": [
                {"name": "default", "template": "config-default"},
                {"name": "tool_use", "template": "config-tools"},
            ]})
            .to_string(),
        )
        .unwrap();
        let t = Tokenizer::load(&dir.join("tokenizer.json")).unwrap();
        assert_eq!(t.render(&one, &tools).unwrap(), "tools:1");
        assert_eq!(
            t.render(&one, &ChatOptions::default()).unwrap(),
            "config-default"
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Templates with transformers' `{% generation %}` blocks (fine-tunes made with
    /// assistant-only loss ship them) load and render the block's body, whitespace control
    /// marks kept; the request's own template too. minijinja refused the tag, and the
    /// router would not start on such a model.
    #[test]
    fn generation_blocks_render_their_body() {
        let template = "{% for m in messages %}{% if m.role == 'assistant' %}{%- generation -%} [{{ m.content }}] {%- endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}";
        let (dir, t) = with_config("generation", serde_json::json!({"chat_template": template}));
        let (m, options) = chat(serde_json::json!({
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
            "add_generation_prompt": false,
        }));
        assert_eq!(t.render(&m, &options).unwrap(), "hi[yo]");
        std::fs::remove_dir_all(&dir).ok();
        assert_eq!(
            generation_as_if("{%generation%}a{%+ endgeneration -%}{% if x %}{% generations %}"),
            "{%if true%}a{%+ endif -%}{% if x %}{% generations %}"
        );
    }

    /// A tokenizer directory whose `tokenizer_config.json` holds `config`.
    fn with_config(name: &str, config: serde_json::Value) -> (std::path::PathBuf, Tokenizer) {
        let dir = std::env::temp_dir().join(format!("kvroute-tok-{name}-{}", std::process::id()));
        write_tokenizer(&dir, false);
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        let t = Tokenizer::load(&dir.join("tokenizer.json")).unwrap();
        (dir, t)
    }

    fn chat(value: serde_json::Value) -> (Vec<ChatMessage>, ChatOptions) {
        let mut request: crate::ingress::openai::ChatRequest =
            serde_json::from_value(value).unwrap();
        let options = request.take_options();
        (request.messages, options)
    }

    /// Content reaches a template in the shape vLLM hands it over: a template that loops
    /// over content parts (Llama 4's shape, which trims each text part) gets a list of text
    /// parts for every message, a string content as one part and null as none; any other
    /// template gets the non-empty text parts joined with newlines.
    #[test]
    fn content_reaches_the_template_in_the_shape_it_loops_over() {
        let looping = "{% for m in messages %}<{{ m.role }}>{% if m['content'] is string %}{{ m['content'] }}{% else %}[{% for p in m['content'] %}{{ p['text'] | trim }}|{% endfor %}]{% endif %}{% endfor %}";
        let messages = serde_json::json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": " Be brief. "},
                {"role": "user", "content": [
                    {"type": "text", "text": "a "}, {"type": "text", "text": ""},
                    "b", {"type": "input_text", "text": " c"},
                    {"type": "thinking", "thinking": "t"}, {"type": "text", "text": null}]},
                {"role": "assistant", "content": null},
                {"role": "tool", "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": ""}, "r2"]},
            ],
        });
        let (dir, t) = with_config("parts", serde_json::json!({"chat_template": looping}));
        let (m, options) = chat(messages.clone());
        // A tool result's text parts come back as one string (vLLM joins them).
        assert_eq!(
            t.render(&m, &options).unwrap(),
            "<system>[Be brief.|]<user>[a||b|c|t|]<assistant>[]<tool>r1\n\nr2"
        );
        std::fs::remove_dir_all(&dir).ok();
        let whole = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}";
        let (dir, t) = with_config("whole", serde_json::json!({"chat_template": whole}));
        let (m, options) = chat(messages);
        assert_eq!(
            t.render(&m, &options).unwrap(),
            "<system> Be brief. <user>a \nb\n c\nt<assistant><tool>r1\nr2"
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Tools and tool calls reach the template as vLLM hands them over: each tool through
    /// its pydantic model (`type`, then `function` with `name`, `description`,
    /// `parameters`, nulls included, in that order), arguments parsed from their JSON
    /// string; and `tojson` writes them as Python's `json.dumps` does (its separators,
    /// the maps' order, nothing HTML-escaped, non-ASCII as it is).
    #[test]
    fn tools_and_tool_calls_render_as_in_vllm() {
        let (dir, t) = with_config(
            "tojson",
            serde_json::json!({"chat_template": "{{ tools | tojson }}|{% for m in messages %}{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments | tojson }}|{{ m.tool_calls | length }}{% endif %}{% endfor %}|{{ tools[0] | tojson(indent=2) }}"}),
        );
        let (messages, options) = chat(serde_json::json!({
            "model": "m",
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\", \"days\": 2}"}}]},
                {"role": "assistant", "content": "none", "tool_calls": []},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Ber"}}]}
            ],
            "tools": [{"function": {"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "name": "get_weather", "strict": true}, "type": "function"}]
        }));
        assert!(
            !messages[2].extra.contains_key("tool_calls"),
            "an empty tool_calls is dropped"
        );
        // Arguments cut off mid-JSON (a generation that hit its max_tokens) read as {}.
        assert_eq!(
            messages[3].extra["tool_calls"][0]["function"]["arguments"],
            serde_json::json!({})
        );
        let text = t.render(&messages, &options).unwrap();
        let (tools, rest) = text.split_once('|').unwrap();
        assert_eq!(
            tools,
            r#"[{"type": "function", "function": {"name": "get_weather", "description": null, "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": true}}]"#
        );
        let (arguments, indented) = rest
            .split_once("||")
            .unwrap_or_else(|| rest.rsplit_once('|').unwrap());
        assert_eq!(arguments, r#"{"city": "Zürich", "days": 2}|1{}|1"#);
        assert!(
            indented.starts_with("{\n  \"type\": \"function\",\n  \"function\": {\n    \"name\""),
            "{indented}"
        );
        // Python's escapes, not HTML's; floats as Python writes them.
        let env = chat_environment();
        let render = |src: &str, ctx: serde_json::Value| {
            env.render_str(src, minijinja::Value::from(minijinja::value::Serde(&ctx)))
                .unwrap()
        };
        assert_eq!(
            render(
                "{{ x | tojson }}",
                serde_json::json!({"x": ["<a href='b'>&", "tab\t", 1.0, 0.5, 1e20, 3]})
            ),
            r#"["<a href='b'>&", "tab\t", 1.0, 0.5, 1e+20, 3]"#
        );
        assert_eq!(
            render(
                "{{ x | tojson(ensure_ascii=true) }}",
                serde_json::json!({"x": "é\u{7f}"})
            ),
            r#""\u00e9\u007f""#
        );
        // Python's repr at the edges of its positional range.
        assert_eq!(
            render(
                "{{ x | tojson }}",
                serde_json::json!({"x": [9999999999999998.0, 9.999999999999999e-05, 1e16, 0.0001]})
            ),
            "[9999999999999998.0, 9.999999999999999e-05, 1e+16, 0.0001]"
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    /// As in transformers' Jinja2 environment: a block tag alone on its line leaves no blank
    /// line or indentation (`trim_blocks`, `lstrip_blocks`), `{% break %}` and macros work;
    /// `chat_template_kwargs` win over `add_generation_prompt` (vLLM's `_preprocess_chat`);
    /// with tools, a `tool_use` template is used where the model names one; and
    /// `chat_template.jinja` beside the tokenizer wins over the config's template.
    #[test]
    fn templates_render_in_transformers_environment() {
        let template = "{% macro turn(m) %}<{{ m.role }}>{{ m.content }}{% endmacro %}\n{% for m in messages %}\n    {% if loop.index > 1 %}\n        {% break %}\n    {% endif %}\n{{ turn(m) }}\n{% endfor %}\n{% if add_generation_prompt %}\n<assistant>\n{% endif %}";
        let (dir, t) = with_config(
            "env",
            serde_json::json!({"chat_template": [
                {"name": "default", "template": template},
                {"name": "tool_use", "template": "tools:{{ tools | length }}"}
            ]}),
        );
        let two = [
            ChatMessage::text("user", "hi"),
            ChatMessage::text("user", "again"),
        ];
        assert_eq!(
            t.render(&two, &ChatOptions::default()).unwrap(),
            "<user>hi\n<assistant>\n"
        );
        let mut kwargs = serde_json::Map::new();
        kwargs.insert("add_generation_prompt".into(), false.into());
        let no_prompt = ChatOptions {
            kwargs,
            ..ChatOptions::default()
        };
        assert_eq!(t.render(&two, &no_prompt).unwrap(), "<user>hi\n");
        let tools = ChatOptions {
            tools: Some(serde_json::json!([{"type": "function", "function": {"name": "f"}}])),
            ..ChatOptions::default()
        };
        assert_eq!(t.render(&two, &tools).unwrap(), "tools:1");
        std::fs::write(
            dir.join("chat_template.jinja"),
            "file:{{ messages | length }}",
        )
        .unwrap();
        let t = Tokenizer::load(&dir.join("tokenizer.json")).unwrap();
        assert_eq!(t.render(&two, &ChatOptions::default()).unwrap(), "file:2");
        // A template file serves every request: the config's tool_use template no longer
        // counts (transformers ignores the config's templates then).
        assert_eq!(t.render(&two, &tools).unwrap(), "file:2");
        // The engine's `--chat-template FILE`, given to the router, wins over both.
        std::fs::write(dir.join("mine.jinja"), "mine:{{ messages[0].content }}").unwrap();
        let t = Tokenizer::load_with(&dir.join("tokenizer.json"), Some(&dir.join("mine.jinja")))
            .unwrap();
        assert_eq!(t.render(&two, &ChatOptions::default()).unwrap(), "mine:hi");
        std::fs::remove_dir_all(&dir).ok();
    }

    /// A multimodal model's processor template (`chat_template.json`, else the
    /// `chat_template` of `processor_config.json`) renders requests without tools, the
    /// tokenizer's those with tools, as vLLM picks them; `chat_template.jinja` wins over
    /// both; a `chat_template.json` without a template string is refused at load.
    #[test]
    fn a_processor_template_serves_requests_without_tools() {
        let (dir, _) = with_config(
            "processor",
            serde_json::json!({"chat_template": "tokenizer:{{ messages | length }}"}),
        );
        std::fs::write(
            dir.join("chat_template.json"),
            serde_json::json!({"chat_template": "processor:{{ messages | length }}"}).to_string(),
        )
        .unwrap();
        let t = Tokenizer::load(&dir.join("tokenizer.json")).unwrap();
        let one = [ChatMessage::text("user", "hi")];
        assert_eq!(
            t.render(&one, &ChatOptions::default()).unwrap(),
            "processor:1"
        );
        let tools = ChatOptions {
            tools: Some(serde_json::json!([{"type": "function", "function": {"name": "f"}}])),
            ..ChatOptions::default()
        };
        assert_eq!(t.render(&one, &tools).unwrap(), "tokenizer:1");
        std::fs::write(dir.join("chat_template.jinja"), "file").unwrap();
        let t = Tokenizer::load(&dir.join("tokenizer.json")).unwrap();
        assert_eq!(t.render(&one, &ChatOptions::default()).unwrap(), "file");
        std::fs::remove_file(dir.join("chat_template.jinja")).unwrap();
        // Where earlier transformers saved it: in the processor's config, used when there is
        // no `chat_template.json`.
        std::fs::write(
            dir.join("processor_config.json"),
            serde_json::json!({"processor_class": "P", "chat_template": "legacy"}).to_string(),
        )
        .unwrap();
        let t = Tokenizer::load(&dir.join("tokenizer.json")).unwrap();
        assert_eq!(
            t.render(&one, &ChatOptions::default()).unwrap(),
            "processor:1"
        );
        std::fs::remove_file(dir.join("chat_template.json")).unwrap();
        let t = Tokenizer::load(&dir.join("tokenizer.json")).unwrap();
        assert_eq!(t.render(&one, &ChatOptions::default()).unwrap(), "legacy");
        assert_eq!(t.render(&one, &tools).unwrap(), "tokenizer:1");
        // A processor config without a template, or one that does not parse, leaves the
        // tokenizer's.
        for config in ["{\"processor_class\": \"P\"}", "{"] {
            std::fs::write(dir.join("processor_config.json"), config).unwrap();
            let t = Tokenizer::load(&dir.join("tokenizer.json")).unwrap();
            assert_eq!(
                t.render(&one, &ChatOptions::default()).unwrap(),
                "tokenizer:1"
            );
        }
        std::fs::write(dir.join("chat_template.json"), "{}").unwrap();
        let e = Tokenizer::load(&dir.join("tokenizer.json")).err().unwrap();
        assert!(e.to_string().contains("chat_template.json"), "{e}");
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

    /// A request's own template (vLLM's `chat_template`, or one in `chat_template_kwargs`,
    /// which wins) renders the chat in place of the model's, only where trusted; otherwise
    /// the request is refused with vLLM's words. Both templates see the same variables.
    #[test]
    fn a_request_template_renders_only_where_trusted() {
        let (dir, mut t) = with_config(
            "request",
            serde_json::json!({"bos_token": "BOS", "chat_template": "{{ bos_token }}{% for m in messages %} {{ m.role }} : {{ m.content }}{% endfor %}"}),
        );
        let own = "{{ bos_token }}{% for m in messages %} {{ m.content }} {{ m.role }}{% endfor %}{% if enable_thinking %} think{% endif %}";
        let request = |body: serde_json::Value| {
            let mut r: crate::ingress::openai::ChatRequest = serde_json::from_value(body).unwrap();
            let source = r.take_templates().unwrap().pick(false);
            (std::mem::take(&mut r.messages), source, r.take_options())
        };
        let hello = serde_json::json!([{"role": "user", "content": "hello"}]);
        let (messages, source, options) = request(serde_json::json!({
            "model": "m", "messages": hello, "chat_template": own,
            "chat_template_kwargs": {"enable_thinking": true},
        }));
        assert_eq!(source.as_deref(), Some(own));
        let refused = t.request_template(own).unwrap_err();
        assert!(
            refused
                .to_string()
                .contains("--trust-request-chat-template is not set"),
            "{refused}"
        );
        let bytes = Tokenizer::Bytes.request_template(own).unwrap_err();
        assert!(matches!(bytes, TokenizerError::RequestTemplateRefused(_)));
        // The model's template, without the request's: user : hello.
        assert_eq!(t.encode_chat(&messages, &options).unwrap(), [6, 3, 5, 1]);
        t.trust_request_chat_templates();
        let with_own = ChatOptions {
            template: Some(t.request_template(own).unwrap()),
            ..options
        };
        // The request's: hello user think (its kwargs reach it as the model's would).
        assert_eq!(t.encode_chat(&messages, &with_own).unwrap(), [6, 1, 3, 9]);
        // A `chat_template` among the kwargs renders where the field names none, and is no
        // variable; the field wins over it (vLLM main), and so does a template the server
        // was given (`--chat-template`); null is none.
        let (_, source, options) = request(serde_json::json!({
            "model": "m", "messages": hello,
            "chat_template_kwargs": {"chat_template": own},
        }));
        assert_eq!(source.as_deref(), Some(own));
        assert!(!options.kwargs.contains_key("chat_template"));
        let (_, source, _) = request(serde_json::json!({
            "model": "m", "messages": hello, "chat_template": "field",
            "chat_template_kwargs": {"chat_template": own},
        }));
        assert_eq!(source.as_deref(), Some("field"));
        let mut r: crate::ingress::openai::ChatRequest =
            serde_json::from_value(serde_json::json!({
                "model": "m", "messages": hello, "chat_template_kwargs": {"chat_template": own},
            }))
            .unwrap();
        let templates = r.take_templates().unwrap();
        assert!(templates.any());
        assert_eq!(
            templates.pick(true),
            None,
            "the server's own template renders"
        );
        let (_, source, _) = request(serde_json::json!({
            "model": "m", "messages": hello, "chat_template_kwargs": {"chat_template": null},
        }));
        assert_eq!(source, None);
        let mut wrong: crate::ingress::openai::ChatRequest = serde_json::from_value(
            serde_json::json!({"model": "m", "messages": hello, "chat_template_kwargs": {"chat_template": 3}}),
        )
        .unwrap();
        assert!(wrong.take_templates().is_err());
        std::fs::remove_dir_all(&dir).ok();
    }

    /// `reasoning_effort` reaches the template, and sets `enable_thinking` (true unless
    /// `none`) where the request's kwargs do not, over the engines' default: as vLLM's
    /// `build_chat_params` does. (Booleans render as Jinja2 renders Python's.)
    #[test]
    fn reasoning_effort_reaches_the_template_and_sets_enable_thinking() {
        let (dir, mut t) = with_config(
            "effort",
            serde_json::json!({"chat_template": "{{ reasoning_effort }}|{{ enable_thinking }}"}),
        );
        let mut defaults = serde_json::Map::new();
        defaults.insert("enable_thinking".into(), true.into());
        t.set_default_chat_kwargs(defaults);
        let hello = serde_json::json!([{"role": "user", "content": "hi"}]);
        for (body, want) in [
            (
                serde_json::json!({"model": "m", "messages": hello, "reasoning_effort": "none"}),
                "none|False",
            ),
            (
                serde_json::json!({"model": "m", "messages": hello, "reasoning_effort": "high"}),
                "high|True",
            ),
            (
                serde_json::json!({"model": "m", "messages": hello, "reasoning_effort": "none",
                    "chat_template_kwargs": {"enable_thinking": true}}),
                "none|True",
            ),
            (
                serde_json::json!({"model": "m", "messages": hello}),
                "|True",
            ),
        ] {
            let (messages, options) = chat(body);
            let rendered = t
                .render(&messages, &t.with_default_kwargs(options))
                .unwrap();
            assert_eq!(rendered, want);
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    /// A request's template is bounded: one that loops for ever runs out of fuel (an error,
    /// not a held thread); one that does not compile is a clear error; compiled templates
    /// are kept, at most [`REQUEST_TEMPLATES_CACHED`], the same one reused.
    #[test]
    fn request_templates_are_bounded_and_cached() {
        let (dir, mut t) = with_config("request-bounds", serde_json::json!({}));
        t.trust_request_chat_templates();
        let hello = [ChatMessage::text("user", "hello")];
        let endless =
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
        let options = ChatOptions {
            template: Some(t.request_template(endless).unwrap()),
            ..ChatOptions::default()
        };
        let e = t.encode_chat(&hello, &options).unwrap_err();
        assert!(e.to_string().contains("fuel"), "{e}");
        // Few instructions can write much: a rendering stops at the text limit (this one
        // wrote 64 MB, and with `~` doubling gigabytes, before it was cut afterwards).
        let writer = r#"{% for i in range(64) %}{{ "x" * 1000000 }}{% endfor %}"#;
        let options = ChatOptions {
            template: Some(t.request_template(writer).unwrap()),
            ..ChatOptions::default()
        };
        let e = t.chat_text(&hello, &options, 1 << 20).unwrap_err();
        assert!(
            matches!(e, TokenizerError::TooLong { bytes, limit } if limit == 1 << 20 && bytes > limit),
            "{e}"
        );
        assert_eq!(
            t.chat_text(&hello, &options, 64 << 20).unwrap().len(),
            64_000_000
        );
        let e = t.request_template("{% for %}").unwrap_err();
        assert!(e.to_string().contains("the request's chat template"), "{e}");
        let first = t.request_template("{{ messages[0].content }}").unwrap();
        let again = t.request_template("{{ messages[0].content }}").unwrap();
        assert!(std::sync::Arc::ptr_eq(&first, &again));
        for i in 0..2 * REQUEST_TEMPLATES_CACHED {
            t.request_template(&format!("{i}{{{{ messages[0].content }}}}"))
                .unwrap();
        }
        let Tokenizer::Hf(hf) = &t else {
            unreachable!("loaded from a file")
        };
        let cached = hf.request_templates.as_ref().map(|c| c.len());
        assert_eq!(cached, Some(REQUEST_TEMPLATES_CACHED));
        std::fs::remove_dir_all(&dir).ok();
    }
}
