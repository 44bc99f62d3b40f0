//! Chat templates that requests bring: vLLM's `chat_template` request field, and a
//! `chat_template` inside `chat_template_kwargs` (which renders where the field names none
//! and the server has no `--chat-template`: vLLM main merges the template over the kwargs,
//! `ChatParams.get_apply_chat_template_kwargs` in vllm/renderers/params.py; its older
//! `_preprocess_chat` merged the kwargs over the template instead;
//! [`crate::ingress::openai::RequestedTemplates::pick`]).
//!
//! vLLM renders them only when started with `--trust-request-chat-template` and refuses
//! them otherwise; the router does the same with its flag of that name. Trusted or not, a
//! template is a program run on the router's tokenizer threads, so each render is bounded:
//! at most [`RENDER_FUEL`] template instructions (minijinja's fuel; a template that loops
//! for ever fails with a clear error instead of holding a thread), its text at most the
//! router's `max_tokenize_bytes` (a longer rendering is stopped there and the request
//! routed untokenized: a loop of few instructions may write gigabytes), and minijinja's own
//! limits on recursion and on repeated strings and lists. Not bounded: the values a template
//! builds without writing them (`~` joins strings without a limit; `a ~ a` four times over a
//! string of minijinja's largest repeat is over a gigabyte). Only an operator who trusts
//! the clients with their templates sets `--trust-request-chat-template`, as with vLLM.
//!
//! A client that sends its own template usually sends the same one on every request, so the
//! last [`CACHED`] compiled templates are kept, most recently used first.

use std::collections::VecDeque;
use std::sync::Arc;

use super::{ContentFormat, TokenizerError, chat_environment, content_format};

/// Most template instructions one render of a request's template may run. The models'
/// templates take a few thousand per message (Qwen3's, a 100-message chat with tools: under
/// 10⁶), so this leaves room for the longest chats the body limit lets through while a
/// render stays within tens of milliseconds.
pub const RENDER_FUEL: u64 = 20_000_000;

/// Compiled request templates kept.
pub const CACHED: usize = 16;

/// A request's chat template, compiled.
pub struct RequestTemplate {
    source: Box<str>,
    env: minijinja::Environment<'static>,
    format: ContentFormat,
}

impl std::fmt::Debug for RequestTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestTemplate")
            .field("bytes", &self.source.len())
            .field("format", &self.format)
            .finish()
    }
}

impl RequestTemplate {
    /// Compiles `source` in the environment the models' templates get, with fuel.
    fn compile(source: &str) -> Result<RequestTemplate, TokenizerError> {
        let mut env = chat_environment();
        env.set_fuel(Some(RENDER_FUEL));
        let compiled = super::generation_as_if(source);
        let format = content_format::detect(&compiled);
        env.add_template_owned("chat", compiled)
            .map_err(|e| TokenizerError::Template {
                reason: format!("the request's chat template: {e}"),
            })?;
        Ok(RequestTemplate {
            source: source.into(),
            env,
            format,
        })
    }

    /// The environment holding the template, as `chat`.
    pub(super) fn env(&self) -> &minijinja::Environment<'static> {
        &self.env
    }

    /// The content format the template wants (as vLLM detects it for a request's template).
    pub(super) fn format(&self) -> ContentFormat {
        self.format
    }
}

/// The compiled request templates, most recently used first.
#[derive(Debug, Default)]
pub(super) struct RequestTemplates {
    cache: parking_lot::Mutex<VecDeque<Arc<RequestTemplate>>>,
}

impl RequestTemplates {
    /// `source` compiled: from the cache, or compiled now (outside the lock) and cached.
    pub(super) fn get(&self, source: &str) -> Result<Arc<RequestTemplate>, TokenizerError> {
        {
            let mut cache = self.cache.lock();
            if let Some(at) = cache.iter().position(|t| &*t.source == source)
                && let Some(found) = cache.remove(at)
            {
                cache.push_front(Arc::clone(&found));
                return Ok(found);
            }
        }
        let compiled = Arc::new(RequestTemplate::compile(source)?);
        let mut cache = self.cache.lock();
        cache.push_front(Arc::clone(&compiled));
        cache.truncate(CACHED);
        Ok(compiled)
    }

    /// Templates cached.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.cache.lock().len()
    }
}
