//! The OpenAI surface: request bodies, the byte-level tokenizer of the demo, and errors in
//! OpenAI's shape that also say whose fault they are and whether a retry can help.

use serde::Deserialize;

/// A prompt: text, or token ids used as they are.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Text, tokenized by the router.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    /// Model name; must be one the fleet serves.
    pub model: String,
    /// The prompt.
    pub prompt: Prompt,
    /// Tokens to generate.
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u32,
    /// Stream SSE chunks as they are generated.
    #[serde(default)]
    pub stream: bool,
}

/// One chat message.
#[derive(Debug, Deserialize, serde::Serialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, …
    pub role: String,
    /// Its text.
    pub content: String,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    /// Model name.
    pub model: String,
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    /// Tokens to generate.
    #[serde(default = "default_max_tokens", alias = "max_completion_tokens")]
    pub max_tokens: u32,
    /// Stream SSE chunks.
    #[serde(default)]
    pub stream: bool,
}

fn default_max_tokens() -> u32 {
    16
}

/// The demo tokenizer: one token per UTF-8 byte (ids 0–255). Deterministic and
/// dependency-free, so equal text prefixes give equal block hashes on router and workers.
pub fn byte_tokens(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// Renders a chat as one prompt (a ChatML-style default template): the same conversation
/// prefix always renders to the same text, so later turns reuse earlier turns' blocks.
pub fn render_chat(messages: &[ChatMessage]) -> String {
    let mut out = String::new();
    for m in messages {
        out.push_str("<|im_start|>");
        out.push_str(&m.role);
        out.push('\n');
        out.push_str(&m.content);
        out.push_str("<|im_end|>\n");
    }
    out.push_str("<|im_start|>assistant\n");
    out
}

/// Whose fault an error is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The client sent something wrong.
    Client,
    /// A worker failed.
    Worker,
    /// The router itself (overloaded, no workers).
    Router,
}

/// An error answered to a client.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    /// HTTP status.
    pub status: u16,
    /// OpenAI error type.
    pub kind: &'static str,
    /// Human-readable message.
    pub message: String,
    /// Whose fault.
    pub fault: Fault,
    /// Whether retrying the same request later can succeed.
    pub retryable: bool,
}

impl ApiError {
    /// 400: the request is malformed.
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError {
            status: 400,
            kind: "invalid_request_error",
            message: message.into(),
            fault: Fault::Client,
            retryable: false,
        }
    }

    /// 413: the body is over the limit.
    pub fn too_large(limit: usize) -> Self {
        ApiError {
            status: 413,
            kind: "invalid_request_error",
            message: format!("request body over {limit} bytes"),
            fault: Fault::Client,
            retryable: false,
        }
    }

    /// 429: too many requests in flight.
    pub fn overloaded(limit: usize) -> Self {
        ApiError {
            status: 429,
            kind: "rate_limit_error",
            message: format!("{limit} requests in flight; retry shortly"),
            fault: Fault::Router,
            retryable: true,
        }
    }

    /// 503: no worker could take the request.
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            status: 503,
            kind: "server_error",
            message: message.into(),
            fault: Fault::Worker,
            retryable: true,
        }
    }

    /// 404: no such endpoint.
    pub fn not_found() -> Self {
        ApiError {
            status: 404,
            kind: "invalid_request_error",
            message: "no such endpoint".into(),
            fault: Fault::Client,
            retryable: false,
        }
    }

    /// The JSON body, in OpenAI's shape.
    pub fn body(&self) -> String {
        serde_json::json!({"error": {"message": self.message, "type": self.kind, "param": null, "code": null}}).to_string()
    }

    /// Metric label of the fault.
    pub fn fault_label(&self) -> &'static str {
        match self.fault {
            Fault::Client => "client",
            Fault::Worker => "worker",
            Fault::Router => "router",
        }
    }
}
