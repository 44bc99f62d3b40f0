//! The worker's HTTP/1.1 endpoints: `POST /internal/generate` (token ids in; OpenAI
//! completion chunks out, as SSE while the engine produces them, or one JSON body) and
//! `GET /health`.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Response, StatusCode, header};
use kvroute::protocol::Salt;
use serde::Deserialize;
use tokio::sync::{mpsc, watch};

use super::Job;
use crate::engine::{Output, OutputKind, Request, RequestId};

pub(crate) use kvroute::ingress::Body;

/// Largest request body accepted, bytes.
const MAX_BODY: usize = 16 << 20;

#[derive(Clone)]
pub(crate) struct State {
    pub jobs: mpsc::Sender<Job>,
    pub metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
    pub tokenizer: Arc<kvroute::ingress::tokenizer::Tokenizer>,
    pub model: String,
    pub next_id: Arc<AtomicU64>,
}

/// The internal generate request: what the router sends.
#[derive(Debug, Deserialize)]
struct Generate {
    token_ids: Vec<u32>,
    #[serde(default = "default_max_tokens")]
    max_tokens: u32,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    salt: u64,
    /// Answer in the chat completion shape (`chat.completion[.chunk]`, `message`/`delta`).
    #[serde(default)]
    chat: bool,
}

fn default_max_tokens() -> u32 {
    16
}

pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    state: State,
    shutdown: watch::Receiver<bool>,
) {
    kvroute::ingress::serve_http(listener, move |req| handle(state.clone(), req), shutdown).await;
}

fn full(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, content_type)
        .body(Full::new(body.into()).boxed())
        .expect("invariant: static response parts are valid")
}

/// An error in OpenAI's shape.
pub(crate) fn error(status: StatusCode, kind: &str, message: &str) -> Response<Body> {
    let body = serde_json::json!({"error": {"message": message, "type": kind, "param": null, "code": null}});
    full(status, "application/json", body.to_string())
}

async fn handle(state: State, req: hyper::Request<Incoming>) -> Response<Body> {
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/health") => full(StatusCode::OK, "application/json", r#"{"status":"ok"}"#),
        (&Method::POST, "/internal/generate") => generate(state, req).await,
        (&Method::POST, "/v1/completions") => openai(state, req, false).await,
        (&Method::POST, "/v1/chat/completions") => openai(state, req, true).await,
        (&Method::GET, "/metrics") => {
            let text = state
                .metrics
                .as_ref()
                .map(|h| h.render())
                .unwrap_or_default();
            full(StatusCode::OK, "text/plain; version=0.0.4", text)
        }
        _ => error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "no such endpoint",
        ),
    }
}

/// Reads and parses a JSON body, or answers 413 / 400.
async fn read_json<T: serde::de::DeserializeOwned>(
    req: hyper::Request<Incoming>,
) -> Result<T, Response<Body>> {
    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => {
            return Err(error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                "request body too large",
            ));
        }
    };
    serde_json::from_slice(&body).map_err(|e| {
        error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            &format!("invalid request body: {e}"),
        )
    })
}

async fn generate(state: State, req: hyper::Request<Incoming>) -> Response<Body> {
    match read_json::<Generate>(req).await {
        Ok(g) => run(state, g).await,
        Err(response) => response,
    }
}

/// `/v1/completions` and `/v1/chat/completions` with text, tokenized as the router does
/// (same tokenizer options), so any OpenAI client or other router can drive the worker.
async fn openai(state: State, req: hyper::Request<Incoming>, chat: bool) -> Response<Body> {
    use kvroute::ingress::openai::{ChatRequest, CompletionRequest, Prompt};
    let bad = |e: kvroute::ingress::tokenizer::TokenizerError| {
        error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            &e.to_string(),
        )
    };
    let (model, token_ids, max_tokens, stream) = if chat {
        match read_json::<ChatRequest>(req).await {
            Ok(r) => match state.tokenizer.encode_chat(&r.messages) {
                Ok(tokens) => (r.model, tokens, r.max_tokens, r.stream),
                Err(e) => return bad(e),
            },
            Err(response) => return response,
        }
    } else {
        match read_json::<CompletionRequest>(req).await {
            Ok(r) => {
                let tokens = match r.prompt {
                    Prompt::Text(t) => match state.tokenizer.encode(&t) {
                        Ok(tokens) => tokens,
                        Err(e) => return bad(e),
                    },
                    Prompt::Tokens(t) => t,
                };
                (r.model, tokens, r.max_tokens, r.stream)
            }
            Err(response) => return response,
        }
    };
    if model != state.model {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            &format!("model {model:?} is not served here"),
        );
    }
    run(
        state,
        Generate {
            token_ids,
            max_tokens,
            stream,
            salt: 0,
            chat,
        },
    )
    .await
}

async fn run(state: State, g: Generate) -> Response<Body> {
    let id = RequestId(state.next_id.fetch_add(1, Ordering::Relaxed));
    let prompt_tokens = g.token_ids.len();
    let request = Request {
        id,
        prompt: g.token_ids.into(),
        max_tokens: g.max_tokens,
        salt: Salt(g.salt),
    };
    let (tx, mut rx) = mpsc::channel(1024);
    if state
        .jobs
        .send(Job {
            request,
            outputs: tx,
        })
        .await
        .is_err()
    {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "engine stopped",
        );
    }
    let completion_id = format!("cmpl-{}", id.0);
    if !g.stream {
        let mut tokens = Vec::new();
        while let Some(o) = rx.recv().await {
            match o.kind {
                OutputKind::Token { token, .. } => tokens.push(token),
                OutputKind::Finished => break,
                OutputKind::Rejected(reason) => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        "invalid_request_error",
                        &reason.to_string(),
                    );
                }
                _ => {}
            }
        }
        let usage = serde_json::json!({"prompt_tokens": prompt_tokens, "completion_tokens": tokens.len(), "total_tokens": prompt_tokens + tokens.len()});
        let body = if g.chat {
            serde_json::json!({
                "id": completion_id, "object": "chat.completion", "model": state.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": render(&tokens)}, "token_ids": tokens, "finish_reason": "length"}],
                "usage": usage,
            })
        } else {
            serde_json::json!({
                "id": completion_id, "object": "text_completion", "model": state.model,
                "choices": [{"index": 0, "text": render(&tokens), "token_ids": tokens, "finish_reason": "length"}],
                "usage": usage,
            })
        };
        return full(StatusCode::OK, "application/json", body.to_string());
    }
    let model = state.model.clone();
    let shape = if g.chat { Shape::Chat } else { Shape::Text };
    let stream = futures_util::stream::unfold((rx, false, true), move |(mut rx, done, first)| {
        let (completion_id, model) = (completion_id.clone(), model.clone());
        async move {
            if done {
                return None;
            }
            loop {
                let Some(o) = rx.recv().await else {
                    return Some((
                        Ok(Frame::data(Bytes::from_static(b"data: [DONE]\n\n"))),
                        (rx, true, false),
                    ));
                };
                if let Some(chunk) = sse_chunk(&completion_id, &model, shape, first, &o) {
                    let last = matches!(o.kind, OutputKind::Finished | OutputKind::Rejected(_));
                    let mut bytes = chunk.into_bytes();
                    if last {
                        bytes.extend_from_slice(b"data: [DONE]\n\n");
                    }
                    return Some((
                        Ok::<_, Infallible>(Frame::data(Bytes::from(bytes))),
                        (rx, last, false),
                    ));
                }
            }
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(BodyExt::boxed(StreamBody::new(stream)))
        .expect("invariant: static response parts are valid")
}

/// Which OpenAI response shape a stream uses.
#[derive(Clone, Copy)]
enum Shape {
    /// `text_completion` chunks with `text`.
    Text,
    /// `chat.completion.chunk` with `delta` (the first one names the role).
    Chat,
}

/// One SSE event for an output, if it is one the client sees.
fn sse_chunk(id: &str, model: &str, shape: Shape, first: bool, o: &Output) -> Option<String> {
    let (text, token_ids, finish) = match o.kind {
        OutputKind::Token { token, .. } => (render(&[token]), vec![token], None),
        OutputKind::Finished => (String::new(), Vec::new(), Some("length")),
        OutputKind::Rejected(reason) => {
            let e = serde_json::json!({"error": {"message": reason.to_string(), "type": "invalid_request_error"}});
            return Some(format!("data: {e}\n\n"));
        }
        _ => return None,
    };
    let chunk = match shape {
        Shape::Text => serde_json::json!({
            "id": id, "object": "text_completion", "model": model,
            "choices": [{"index": 0, "text": text, "token_ids": token_ids, "finish_reason": finish}],
        }),
        Shape::Chat => {
            let mut delta = serde_json::json!({});
            if first {
                delta["role"] = "assistant".into();
            }
            if finish.is_none() {
                delta["content"] = text.into();
            }
            serde_json::json!({
                "id": id, "object": "chat.completion.chunk", "model": model,
                "choices": [{"index": 0, "delta": delta, "token_ids": token_ids, "finish_reason": finish}],
            })
        }
    };
    Some(format!("data: {chunk}\n\n"))
}

/// Text of generated tokens. The engine has no model: its tokens are synthetic ids, shown
/// as lowercase letters (`a + id mod 26`) so streams are readable.
pub(crate) fn render(tokens: &[u32]) -> String {
    tokens
        .iter()
        .map(|t| char::from(b'a' + (t % 26) as u8))
        .collect()
}
