//! The worker's HTTP/1.1 endpoints: `POST /internal/generate` (token ids in; OpenAI
//! completion chunks out, as SSE while the engine produces them, or one JSON body), the
//! OpenAI endpoints with text, `GET /health`, `GET /metrics`, `GET /admin/cache` (a digest
//! of the cache, for consistency checks) and, with fault injection on, `POST /admin/faults`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Response, StatusCode, header};
use kvroute::http::budget::collect_within;
use kvroute::http::{Body, BodyAborted, BodyError, HttpConfig, serve_http};
use kvroute::ingress::openai::{response_id, unix_seconds};
use kvroute::protocol::Salt;
use serde::Deserialize;
use tokio::sync::{mpsc, oneshot, watch};

use super::Faults;
use super::engine_thread::{EngineInput, Job};
use crate::engine::{Output, OutputKind, Request, RequestId};
use crate::plane::SnapshotRequest;

/// Largest request body accepted, bytes.
const MAX_BODY: usize = 16 << 20;
/// Request bodies held at once, bytes, all connections together (as the router's
/// `--body-memory-bytes`): past it a request gets 429. Without it, 10,000 connections of
/// 16 MiB bodies each could hold 160 GB. (1 MiB in this crate's tests, which fill it.)
pub(crate) const BODY_BUDGET: usize = if cfg!(test) { 1 << 20 } else { 256 << 20 };
/// Outputs buffered per request: a client this far behind is cut off (counted).
const OUTPUT_BUFFER: usize = 1024;
/// How long the engine may take to accept or refuse a request, or answer a snapshot.
const ENGINE_DEADLINE: Duration = Duration::from_secs(30);

#[derive(Clone)]
pub(crate) struct State {
    /// Each data-parallel rank's engine (one but for a test engine with several).
    pub engines: Vec<SyncSender<EngineInput>>,
    /// Where the next search for the least loaded rank starts (ties go round).
    pub next_rank: Arc<AtomicUsize>,
    pub metrics: Option<kvroute::process::Metrics>,
    pub tokenizer: Arc<kvroute::ingress::tokenizer::Tokenizer>,
    /// The engine being emulated, which must learn the tokens of every prompt.
    pub emulate: Option<Arc<crate::emulate::Emulation>>,
    pub model: String,
    pub next_id: Arc<AtomicU64>,
    /// Generate requests being served (the drain waits for 0).
    pub active: Arc<AtomicUsize>,
    /// With fault injection on: the faults in force.
    pub faults: Option<Arc<watch::Sender<Faults>>>,
    /// OpenAI's `system_fingerprint`: names this incarnation.
    pub fingerprint: String,
    pub body_read_timeout: Duration,
    /// What the request bodies being read and parsed may hold, together ([`BODY_BUDGET`]).
    pub bodies: kvroute::http::budget::BodyBudget,
    /// Tokenizations (up to `MAX_BODY` of text each) run at once, off the runtime's threads.
    pub tokenize_permits: Arc<tokio::sync::Semaphore>,
    /// One `/admin/cache` digest at a time: each is a snapshot of the whole cache on the
    /// engine's thread, and the endpoint takes no key.
    pub digests: Arc<tokio::sync::Semaphore>,
    /// Required on `/v1/*` (`--api-key`).
    pub api_key: Option<kvroute::auth::Secret>,
    /// Tokens a request's prompt and answer can hold at most: its G1 (a longer one is
    /// refused before its body is parsed into a token list of 4 B a token).
    pub max_tokens_held: usize,
}

/// The internal generate request: what the router sends.
#[derive(Debug, Deserialize)]
struct Generate {
    token_ids: Vec<u32>,
    #[serde(default = "default_max_tokens")]
    max_tokens: u32,
    /// Sequences asked for: this engine generates one, and refuses more.
    #[serde(default)]
    n: Option<u32>,
    /// The client's chat had images or audio (the tokens are the text before them): this
    /// engine has no vision, and refuses.
    #[serde(default)]
    media: bool,
    #[serde(default)]
    stream: bool,
    /// The data-parallel rank its client pinned (OpenAI requests to a test engine with
    /// several); never from the router's body.
    #[serde(skip)]
    dp_rank: Option<usize>,
    #[serde(default)]
    salt: u64,
    /// Answer in the chat completion shape (`chat.completion[.chunk]`, `message`/`delta`).
    #[serde(default)]
    chat: bool,
    /// The model the router routed for: a worker serving another one refuses (421).
    #[serde(default)]
    model: Option<String>,
    /// Streamed: end with a chunk carrying the usage (`stream_options.include_usage`).
    #[serde(default)]
    include_usage: bool,
    /// The LoRA adapter asked for (the test engine's), whose name salts the blocks.
    #[serde(default)]
    lora: Option<String>,
    /// The OpenAI request's `cache_salt` (the test engine's; a router's body has its salt
    /// in `salt` only), which its KV events carry as the engine's do.
    #[serde(skip)]
    cache_salt: Option<String>,
}

/// The default `max_tokens`: a completion's in vLLM (16, its `CompletionRequest.max_tokens`),
/// and a chat's here too. vLLM's chat default is what the context leaves after the prompt,
/// which a real model seldom reaches (it ends at its end-of-sequence token); the simulated
/// model has none, and a chat without a limit would generate for the whole G1 (a quarter of
/// a million tokens by default: an hour at the default timing).
fn default_max_tokens() -> u32 {
    16
}

/// Decodes an internal generate body (what a router sends), as the handler does.
pub fn decode_generate(body: &[u8]) -> Result<(), serde_json::Error> {
    serde_json::from_slice::<Generate>(body).map(|_| ())
}

pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    config: HttpConfig,
    state: State,
    shutdown: watch::Receiver<bool>,
) {
    serve_http(
        "worker",
        listener,
        config,
        move |req| handle(state.clone(), req),
        shutdown,
    )
    .await;
}

fn full(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, content_type)
        .body(kvroute::http::full(body))
        .expect("invariant: static response parts are valid")
}

fn error_json(kind: &str, message: &str, code: Option<&str>) -> serde_json::Value {
    serde_json::json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
}

/// An error in OpenAI's shape.
pub(crate) fn error(status: StatusCode, kind: &str, message: &str) -> Response<Body> {
    full(
        status,
        "application/json",
        error_json(kind, message, None).to_string(),
    )
}

/// A sidecar's answer to `req` on its own port: `GET /metrics` (its series and its
/// bridge's) and `GET /health` (200 while the process serves: the engine's health is
/// `kvroute_engine_healthy`).
pub fn sidecar_response<B>(
    metrics: Option<&kvroute::process::Metrics>,
    req: &hyper::Request<B>,
) -> Response<Body> {
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/metrics") => full(
            StatusCode::OK,
            "text/plain; version=0.0.4",
            metrics.map(|m| m.render()).unwrap_or_default(),
        ),
        (&Method::GET, "/health") => full(StatusCode::OK, "application/json", r#"{"status":"ok"}"#),
        _ => error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "a sidecar serves GET /metrics and GET /health",
        ),
    }
}

/// What a worker started with `--api-key` answers without the key: its probes. vLLM's
/// `--api-key` guards `/v1/*` only, but this worker also generates on `/internal/generate`
/// (the router's path to it) and shows its cache on `/admin/*`, so everything else needs
/// the key.
fn open_without_key(method: &Method, path: &str) -> bool {
    method == Method::GET && matches!(path, "/health" | "/metrics")
}

fn bad_request(message: &str) -> Response<Body> {
    error(StatusCode::BAD_REQUEST, "invalid_request_error", message)
}

async fn handle(state: State, req: hyper::Request<Incoming>) -> Response<Body> {
    if let Some(key) = &state.api_key
        && !open_without_key(req.method(), req.uri().path())
        && !kvroute::auth::bearer_ok(req.headers(), std::slice::from_ref(key))
    {
        // As vLLM answers a request without its --api-key.
        return error(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "Unauthorized",
        );
    }
    match (req.method(), req.uri().path()) {
        (&Method::GET, "/v1/models") => {
            // As vLLM lists them: the base model, and each LoRA adapter with it as `parent`.
            let mut data = vec![
                serde_json::json!({"id": state.model, "object": "model", "created": 0, "owned_by": "kvroute", "root": state.model, "parent": null}),
            ];
            for a in state.emulate.iter().flat_map(|e| e.adapters.iter()) {
                data.push(serde_json::json!({"id": a, "object": "model", "created": 0, "owned_by": "kvroute", "root": a, "parent": state.model}));
            }
            full(
                StatusCode::OK,
                "application/json",
                serde_json::json!({"object": "list", "data": data}).to_string(),
            )
        }
        (&Method::GET, "/health") => full(StatusCode::OK, "application/json", r#"{"status":"ok"}"#),
        (&Method::POST, "/internal/generate") => generate(state, req).await,
        (&Method::POST, "/v1/completions") => openai(state, req, false).await,
        (&Method::POST, "/v1/chat/completions") => openai(state, req, true).await,
        (&Method::GET, "/metrics") => {
            let mut text = state
                .metrics
                .as_ref()
                .map(|h| h.render())
                .unwrap_or_default();
            if let Some(e) = &state.emulate {
                text.push_str(&e.metrics(&state.model));
            }
            full(StatusCode::OK, "text/plain; version=0.0.4", text)
        }
        (&Method::GET, "/admin/cache") => cache_digest(&state).await,
        (&Method::POST, "/admin/faults") if state.faults.is_some() => set_faults(state, req).await,
        _ => error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "no such endpoint",
        ),
    }
}

/// Reads and parses a JSON body, or answers 413 / 408 / 400.
async fn read_json<T: serde::de::DeserializeOwned>(
    state: &State,
    req: hyper::Request<Incoming>,
) -> Result<T, Response<Body>> {
    read_json_within(state, req, None).await
}

/// JSON values a generate or completion body may hold beside its token list.
const FIELD_VALUES: usize = 4096;

/// As [`read_json`], refusing (413) a body of more than `max_values` JSON values before it
/// is parsed: a chat is read into JSON values whole, 80 B or more each, from as little as
/// two bytes (the router's rule, [`kvroute::ingress::openai::MAX_CHAT_VALUES`]).
async fn read_json_within<T: serde::de::DeserializeOwned>(
    state: &State,
    req: hyper::Request<Incoming>,
    max_values: Option<usize>,
) -> Result<T, Response<Body>> {
    let (body, _held) = collect_within(
        req.into_body(),
        MAX_BODY,
        state.body_read_timeout,
        &state.bodies,
    )
    .await
    .map_err(|e| {
        let status = match e {
            BodyError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            BodyError::TimedOut { .. } => StatusCode::REQUEST_TIMEOUT,
            BodyError::OverBudget { .. } => StatusCode::TOO_MANY_REQUESTS,
            BodyError::Io(_) => StatusCode::BAD_REQUEST,
        };
        error(status, "invalid_request_error", &e.to_string())
    })?;
    if let Some(max_values) = max_values
        && kvroute::ingress::openai::json_values_over(&body, max_values)
    {
        return Err(error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            &format!(
                "a body of more than {max_values} JSON values (a chat's at most {}; a token \
                 prompt at most the {} tokens this engine's G1 holds)",
                kvroute::ingress::openai::MAX_CHAT_VALUES,
                state.max_tokens_held
            ),
        ));
    }
    serde_json::from_slice(&body).map_err(|e| bad_request(&format!("invalid request body: {e}")))
}

/// Longest prompt text this engine tokenizes, bytes: the router's default
/// `max_tokenize_bytes` (a Hugging Face tokenizer peaks at up to 350 times its text); in
/// unit tests, whose body budget is 1 MiB, 64 KiB.
pub(crate) fn max_text_bytes() -> usize {
    if cfg!(test) {
        1 << 16
    } else {
        kvroute::ingress::DEFAULT_MAX_TOKENIZE_BYTES
    }
}

async fn generate(state: State, req: hyper::Request<Incoming>) -> Response<Body> {
    let most = state.max_tokens_held.saturating_add(FIELD_VALUES);
    match read_json_within::<Generate>(&state, req, Some(most)).await {
        Ok(g) => run(state, g).await,
        Err(response) => response,
    }
}

/// Runs a prompt's templating and tokenizing (up to MAX_BODY of text: CPU work) off the
/// runtime's threads, a bounded number at once (as the router does).
async fn tokenize(
    state: &State,
    f: impl FnOnce(
        &kvroute::ingress::tokenizer::Tokenizer,
    ) -> Result<Vec<u32>, kvroute::ingress::tokenizer::TokenizerError>
    + Send
    + 'static,
) -> Result<Vec<u32>, Response<Body>> {
    let tokenizer = Arc::clone(&state.tokenizer);
    let wait = kvroute::http::TOKENIZER_WAIT;
    match kvroute::http::run_blocking(&state.tokenize_permits, wait, move || f(&tokenizer)).await {
        Ok(Ok(tokens)) => Ok(tokens),
        Ok(Err(e @ kvroute::ingress::tokenizer::TokenizerError::TooLong { .. })) => Err(error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            &e.to_string(),
        )),
        Ok(Err(e)) => Err(bad_request(&e.to_string())),
        Err(e) => Err(unavailable(&e.to_string())),
    }
}

/// `/v1/completions` and `/v1/chat/completions` with text, tokenized as the router does
/// (same tokenizer options), so any OpenAI client or other router can drive the worker.
async fn openai(state: State, req: hyper::Request<Incoming>, chat: bool) -> Response<Body> {
    use kvroute::ingress::openai::{
        ChatRequest, CompletionRequest, Prompt, check_stream_options, prompt_keep,
    };
    let dp_rank = match pinned_rank(&state, req.headers()) {
        Ok(rank) => rank,
        Err(message) => return bad_request(&message),
    };
    let (model, token_ids, max_tokens, n, stream, options, cache_salt) = if chat {
        let most = kvroute::ingress::openai::MAX_CHAT_VALUES;
        match read_json_within::<ChatRequest>(&state, req, Some(most)).await {
            Ok(r) if r.messages.iter().any(|m| m.media) => {
                return bad_request(
                    "content parts other than text (images, audio) are not supported by this engine",
                );
            }
            Ok(mut r) => {
                if let Err(e) = check_stream_options(r.stream, r.stream_options) {
                    return bad_request(&e.message);
                }
                // Cut as vLLM cuts it (and the router hashes it).
                let keep = match prompt_keep(r.truncate_prompt_tokens) {
                    Ok(keep) => keep,
                    Err(e) => return bad_request(&e.message),
                };
                // The request's own template, refused unless trusted (as vLLM does).
                let templates = match r.take_templates() {
                    Ok(templates) => templates,
                    Err(e) => return bad_request(&e.message),
                };
                let mut chat_options = r.take_options();
                let messages = std::mem::take(&mut r.messages);
                let encoded = tokenize(&state, move |t| {
                    chat_options.template = t.chat_template_for(templates)?;
                    let text = t.chat_text(&messages, &chat_options, max_text_bytes())?;
                    let special = chat_options.add_special_tokens;
                    t.encode_limited(&text, special, keep, max_text_bytes())
                });
                match encoded.await {
                    Ok(tokens) => (
                        std::mem::take(&mut r.model),
                        tokens,
                        r.max_tokens().unwrap_or(default_max_tokens()),
                        r.n,
                        r.stream,
                        r.stream_options,
                        r.cache_salt.take(),
                    ),
                    Err(response) => return response,
                }
            }
            Err(response) => return response,
        }
    } else {
        let most = state.max_tokens_held.saturating_add(FIELD_VALUES);
        match read_json_within::<CompletionRequest>(&state, req, Some(most)).await {
            Ok(r) => {
                if let Err(e) = check_stream_options(r.stream, r.stream_options) {
                    return bad_request(&e.message);
                }
                let max_tokens = r.max_tokens.unwrap_or(default_max_tokens());
                let special = r.add_special_tokens.unwrap_or(true);
                let keep = match prompt_keep(r.truncate_prompt_tokens) {
                    Ok(keep) => keep,
                    Err(e) => return bad_request(&e.message),
                };
                let tokens = match r.prompt {
                    Prompt::Text(text) => {
                        let encoded = tokenize(&state, move |t| {
                            t.encode_limited(&text, special, keep, max_text_bytes())
                        });
                        match encoded.await {
                            Ok(tokens) => tokens,
                            Err(response) => return response,
                        }
                    }
                    Prompt::Tokens(mut t) => {
                        kvroute::ingress::tokenizer::keep_last(&mut t, keep);
                        t
                    }
                    Prompt::Batch(n) => {
                        return bad_request(&format!(
                            "a prompt list of {n} prompts: this engine takes one prompt per request"
                        ));
                    }
                };
                (
                    r.model,
                    tokens,
                    max_tokens,
                    r.n,
                    r.stream,
                    r.stream_options,
                    r.cache_salt,
                )
            }
            Err(response) => return response,
        }
    };
    // No model named: this engine's, as vLLM serves its own.
    let model = model.unwrap_or_else(|| state.model.clone());
    // A LoRA adapter of the test engine, and the request's `cache_salt`, salt its blocks as
    // vLLM's are (and as the router hashes them): a salted prompt shares no cache with
    // another salt's, or with an unsalted one.
    let adapter = state
        .emulate
        .as_ref()
        .is_some_and(|e| e.adapters.contains(&model));
    if cache_salt.as_deref() == Some("") {
        return bad_request("cache_salt must be a non-empty string if provided");
    }
    let salt =
        kvroute::engines::engine_salt(adapter.then_some(model.as_str()), cache_salt.as_deref()).0;
    if model != state.model && !adapter {
        return full(
            StatusCode::NOT_FOUND,
            "application/json",
            error_json(
                "invalid_request_error",
                &format!("the model {model:?} is not served here"),
                Some("model_not_found"),
            )
            .to_string(),
        );
    }
    run(
        state,
        Generate {
            token_ids,
            max_tokens,
            n,
            stream: stream.unwrap_or(false),
            salt,
            chat,
            model: None,
            media: false,
            lora: adapter.then(|| model.clone()),
            include_usage: kvroute::ingress::openai::include_usage(options),
            dp_rank,
            cache_salt,
        },
    )
    .await
}

/// The data-parallel rank a request names in `X-data-parallel-rank`, as the emulated
/// engine's front end reads it. vLLM (`OpenAIServing._get_data_parallel_rank`): a value
/// that is not an integer names none. SGLang (`OpenAIServingBase.
/// extract_routed_dp_rank_from_header`): such a value is refused with a 400. A rank past
/// the engine's is refused by both.
fn pinned_rank(state: &State, headers: &hyper::HeaderMap) -> Result<Option<usize>, String> {
    let Some(value) = headers.get("x-data-parallel-rank") else {
        return Ok(None);
    };
    let ranks = state.engines.len();
    let text = value.to_str().unwrap_or("").trim();
    match text.parse::<i64>() {
        Ok(rank) if (0..ranks as i64).contains(&rank) => Ok(Some(rank as usize)),
        Ok(rank) => Err(format!(
            "data_parallel_rank {rank} is out of range [0, {ranks})"
        )),
        Err(_) if sglang(state) => Err(format!(
            "Invalid X-Data-Parallel-Rank header: must be an integer, got '{text}'"
        )),
        Err(_) => Ok(None),
    }
}

/// Whether the emulated engine is SGLang.
fn sglang(state: &State) -> bool {
    state
        .emulate
        .as_ref()
        .is_some_and(|e| e.flavor == crate::emulate::Flavor::Sglang)
}

/// The rank a request that names none goes to: the least loaded, as vLLM's internal load
/// balancer picks it (`DPLBAsyncMPClient.get_core_engine_for_request` in
/// vllm/v1/engine/core_client.py: the lowest `waiting * 4 + running`, the search starting one
/// rank further each time so that ties go round); the next in turn for SGLang (its data
/// parallel controller's default `--load-balance-method round_robin`).
fn balanced_rank(state: &State) -> usize {
    let ranks = state.engines.len();
    let start = state.next_rank.fetch_add(1, Ordering::Relaxed);
    if sglang(state) {
        return start % ranks.max(1);
    }
    let score = |rank: usize| {
        state
            .emulate
            .as_ref()
            .and_then(|e| e.ranks.get(rank))
            .map_or(0, |r| r.load.score())
    };
    (0..ranks)
        .map(|i| (start + i) % ranks.max(1))
        .min_by_key(|&rank| score(rank))
        .unwrap_or(0)
}

/// Counts a generate request as active until dropped (with its response body, for streams).
struct Active(Arc<AtomicUsize>);

impl Active {
    fn new(counter: &Arc<AtomicUsize>) -> Active {
        counter.fetch_add(1, Ordering::Relaxed);
        Active(Arc::clone(counter))
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The response's framing: ids, model, fingerprint, shape.
struct Envelope {
    id: String,
    created: u64,
    model: String,
    fingerprint: String,
    chat: bool,
}

impl Envelope {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.chat, chunk) {
            (true, true) => "chat.completion.chunk",
            (true, false) => "chat.completion",
            (false, _) => "text_completion",
        }
    }

    /// The whole answer.
    fn body(
        &self,
        tokens: &[u32],
        prompt_tokens: usize,
        cached_tokens: usize,
    ) -> serde_json::Value {
        let text = render(tokens);
        let choice = if self.chat {
            serde_json::json!({"index": 0, "message": {"role": "assistant", "content": text, "refusal": null}, "logprobs": null, "finish_reason": "length", "token_ids": tokens})
        } else {
            serde_json::json!({"index": 0, "text": text, "logprobs": null, "finish_reason": "length", "token_ids": tokens})
        };
        serde_json::json!({
            "id": self.id, "object": self.object(false), "created": self.created, "model": self.model,
            "system_fingerprint": self.fingerprint, "choices": [choice],
            "usage": Envelope::usage(prompt_tokens, tokens.len(), cached_tokens),
        })
    }

    /// The usage object, as OpenAI and vLLM report it.
    fn usage(
        prompt_tokens: usize,
        completion_tokens: usize,
        cached_tokens: usize,
    ) -> serde_json::Value {
        serde_json::json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}})
    }

    /// The last chunk of a stream asked for its usage: no choices, the usage.
    fn usage_chunk(&self, usage: serde_json::Value) -> String {
        let chunk = serde_json::json!({
            "id": self.id, "object": self.object(true), "created": self.created, "model": self.model,
            "system_fingerprint": self.fingerprint, "choices": [], "usage": usage,
        });
        format!("data: {chunk}\n\n")
    }

    /// One SSE event for an output, if it is one the client sees.
    fn chunk(&self, first: bool, o: &Output) -> Option<String> {
        let (text, token_ids, finish) = match o.kind {
            OutputKind::Token { token, .. } => (render(&[token]), vec![token], None),
            OutputKind::Finished => (String::new(), Vec::new(), Some("length")),
            OutputKind::Rejected(reason) => {
                let e = error_json("invalid_request_error", &reason.to_string(), None);
                return Some(format!("data: {e}\n\n"));
            }
            _ => return None,
        };
        let choice = if self.chat {
            let mut delta = serde_json::json!({});
            if first {
                delta["role"] = "assistant".into();
            }
            if finish.is_none() {
                delta["content"] = text.into();
            }
            serde_json::json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish, "token_ids": token_ids})
        } else {
            serde_json::json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish, "token_ids": token_ids})
        };
        let chunk = serde_json::json!({
            "id": self.id, "object": self.object(true), "created": self.created, "model": self.model,
            "system_fingerprint": self.fingerprint, "choices": [choice],
        });
        Some(format!("data: {chunk}\n\n"))
    }
}

fn unavailable(message: &str) -> Response<Body> {
    error(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
}

async fn run(state: State, g: Generate) -> Response<Body> {
    if let Some(model) = &g.model
        && *model != state.model
    {
        // Misdirected: the router believes this worker serves another model.
        return full(
            StatusCode::MISDIRECTED_REQUEST,
            "application/json",
            error_json(
                "invalid_request_error",
                &format!("this worker serves {:?}, not {model:?}", state.model),
                Some("model_not_found"),
            )
            .to_string(),
        );
    }
    if g.n.is_some_and(|n| n != 1) {
        return bad_request("n: this engine generates one sequence per request");
    }
    if g.media {
        return bad_request(
            "content parts other than text (images, audio) are not supported by this engine",
        );
    }
    let active = Active::new(&state.active);
    if let Some(faults) = &state.faults {
        let f = *faults.borrow();
        if f.stall_before_headers {
            std::future::pending::<()>().await;
        }
        if let Some(code) = f.status {
            if let Some(ms) = f.status_delay_ms {
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            let status = StatusCode::from_u16(code).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
            return error(status, "server_error", "fault injected");
        }
        if f.html_answer {
            return full(
                StatusCode::OK,
                "text/html",
                "<html><body><h1>502 Bad Gateway</h1></body></html>".to_owned(),
            );
        }
        if let Some(bytes) = f.event_bytes_without_end {
            use futures_util::StreamExt as _;
            let mut event = b"data: ".to_vec();
            event.resize(usize::try_from(bytes).unwrap_or(usize::MAX).max(6), b'x');
            let body = futures_util::stream::once(async move {
                Ok::<_, BodyAborted>(Frame::data(Bytes::from(event)))
            })
            .chain(futures_util::stream::pending());
            return Response::builder()
                .status(StatusCode::OK)
                .header(header::CONTENT_TYPE, "text/event-stream")
                .body(BodyExt::boxed(StreamBody::new(body)))
                .expect("invariant: static response parts are valid");
        }
        if f.stall_after_headers || f.end_after_headers {
            use futures_util::future::Either;
            let nothing = if f.stall_after_headers {
                Either::Left(futures_util::stream::pending::<
                    Result<Frame<Bytes>, BodyAborted>,
                >())
            } else {
                Either::Right(futures_util::stream::empty())
            };
            return Response::builder()
                .status(StatusCode::OK)
                .header(header::CONTENT_TYPE, "text/event-stream")
                .body(BodyExt::boxed(StreamBody::new(nothing)))
                .expect("invariant: static response parts are valid");
        }
    }
    let id = RequestId(state.next_id.fetch_add(1, Ordering::Relaxed));
    let prompt_tokens = g.token_ids.len();
    // As the engine admits it: the last output token is sampled, never held.
    if let Some(e) = &state.emulate
        && prompt_tokens
            .saturating_add(g.max_tokens as usize)
            .saturating_sub(1)
            <= e.capacity_tokens
    {
        // Events describe blocks by their tokens: learn every block this request can fill,
        // its output included (decode tokens are a function of the request id). A request
        // longer than G1 fills none (the engine refuses it), and is not learnt: its
        // `max_tokens` comes from the client and would size the allocation.
        let mut all = g.token_ids.clone();
        all.extend((0..g.max_tokens).map(|i| crate::engine::output_token(id, i, e.vocab)));
        let lora = g.lora.as_deref();
        e.book.learn(
            &all,
            kvroute::protocol::Salt(g.salt),
            lora,
            g.cache_salt.as_deref(),
        );
    }
    let request = Request {
        id,
        prompt: g.token_ids.into(),
        max_tokens: g.max_tokens,
        salt: Salt(g.salt),
    };
    let (tx, mut rx) = mpsc::channel(OUTPUT_BUFFER);
    let rank = g.dp_rank.unwrap_or_else(|| balanced_rank(&state));
    match state.engines[rank].try_send(EngineInput::Job(Job {
        request,
        outputs: tx,
    })) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) => return unavailable("engine queue full"),
        Err(TrySendError::Disconnected(_)) => return unavailable("engine stopped"),
    }
    // The engine accepts (Queued) or refuses at once: refusals get a status, not a stream.
    let first = match tokio::time::timeout(ENGINE_DEADLINE, rx.recv()).await {
        Ok(Some(o)) => o,
        Ok(None) => return unavailable("engine stopped"),
        Err(_) => return unavailable("engine did not accept the request in time"),
    };
    if let OutputKind::Rejected(reason) = first.kind {
        return bad_request(&reason.to_string());
    }
    let envelope = Envelope {
        id: response_id(if g.chat { "chatcmpl-" } else { "cmpl-" }),
        created: unix_seconds(),
        model: g.lora.or(g.model).unwrap_or(state.model),
        fingerprint: state.fingerprint,
        chat: g.chat,
    };
    if !g.stream {
        let mut tokens = Vec::new();
        let mut cached = 0;
        loop {
            let Some(o) = rx.recv().await else {
                return unavailable("the request was cut off before it finished");
            };
            match o.kind {
                // Prompt tokens served from the cache (G1, or onboarded from G2), as vLLM
                // reports them in `usage.prompt_tokens_details.cached_tokens`.
                OutputKind::Admitted {
                    device_tokens,
                    host_tokens,
                } => cached = device_tokens + host_tokens,
                OutputKind::Token { token, .. } => tokens.push(token),
                OutputKind::Finished => break,
                OutputKind::Rejected(reason) => return bad_request(&reason.to_string()),
                _ => {}
            }
        }
        let body = envelope.body(&tokens, prompt_tokens, cached);
        return full(StatusCode::OK, "application/json", body.to_string());
    }
    let include_usage = g.include_usage;
    let faults = state.faults.as_ref().map(|f| *f.borrow());
    let first_delay = faults
        .and_then(|f| f.first_chunk_delay_ms)
        .map(Duration::from_millis);
    let pings = faults
        .and_then(|f| f.pings_ms)
        .map(|ms| Duration::from_millis(ms.max(1)));
    let stall_after_first = faults.is_some_and(|f| f.stall_after_first_chunk);
    if let Some(ms) = faults.and_then(|f| f.headers_delay_ms) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    // State: the outputs, the framing, the active count, done, first chunk, and the cached
    // prompt tokens and tokens generated so far (for the usage chunk).
    let stream = futures_util::stream::unfold(
        (rx, envelope, active, false, true, 0usize, 0usize),
        move |(mut rx, envelope, active, done, first, mut cached, mut generated)| async move {
            if done {
                return None;
            }
            if first && let Some(delay) = first_delay {
                tokio::time::sleep(delay).await;
            }
            if !first && stall_after_first {
                std::future::pending::<()>().await;
            }
            loop {
                let Some(o) = rx.recv().await else {
                    // The engine dropped the request before it finished: its client fell
                    // too far behind (or the engine stopped). Say so; never end silently.
                    let e = error_json(
                        "server_error",
                        "the stream was cut off before it finished (client too slow, or the worker stopped)",
                        None,
                    );
                    let bytes = Bytes::from(format!("data: {e}\n\ndata: [DONE]\n\n"));
                    return Some((
                        Ok(Frame::data(bytes)),
                        (rx, envelope, active, true, false, cached, generated),
                    ));
                };
                match o.kind {
                    OutputKind::Admitted {
                        device_tokens,
                        host_tokens,
                    } => cached = device_tokens + host_tokens,
                    OutputKind::Token { .. } => generated += 1,
                    _ => {}
                }
                if let Some(chunk) = envelope.chunk(first, &o) {
                    let last = matches!(o.kind, OutputKind::Finished | OutputKind::Rejected(_));
                    let mut bytes = chunk.into_bytes();
                    if last {
                        if include_usage {
                            let usage = Envelope::usage(prompt_tokens, generated, cached);
                            bytes.extend_from_slice(envelope.usage_chunk(usage).as_bytes());
                        }
                        bytes.extend_from_slice(b"data: [DONE]\n\n");
                    }
                    return Some((
                        Ok::<_, BodyAborted>(Frame::data(Bytes::from(bytes))),
                        (rx, envelope, active, last, false, cached, generated),
                    ));
                }
            }
        },
    );
    let body = match pings {
        None => BodyExt::boxed(StreamBody::new(stream)),
        Some(every) => {
            // The answer, with comments interleaved and going on after it: a body that never
            // ends, whose reader must stop at `[DONE]`.
            let comments = futures_util::stream::unfold((), move |()| async move {
                tokio::time::sleep(every).await;
                let ping = Frame::data(Bytes::from_static(b": keep-alive\n\n"));
                Some((Ok::<_, BodyAborted>(ping), ()))
            });
            BodyExt::boxed(StreamBody::new(futures_util::stream::select(
                stream, comments,
            )))
        }
    };
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(body)
        .expect("invariant: static response parts are valid")
}

/// Per tier, the blocks the cache holds and the xor of their hashes (the router's
/// `/admin/index` reports the same of its mirror).
async fn cache_digest(state: &State) -> Response<Body> {
    let Ok(Ok(_one)) = tokio::time::timeout(ENGINE_DEADLINE, state.digests.acquire()).await else {
        return unavailable("cache digests busy");
    };
    let (mut rows, mut head) = (Vec::new(), None);
    for (rank, engine) in state.engines.iter().enumerate() {
        let (reply, answer) = oneshot::channel();
        let request = SnapshotRequest {
            dp_rank: kvroute::protocol::DpRank(rank as u32),
            reply,
        };
        if engine.try_send(EngineInput::Snapshot(request)).is_err() {
            return unavailable("engine busy or stopped");
        }
        let Ok(Ok(snapshot)) = tokio::time::timeout(ENGINE_DEADLINE, answer).await else {
            return unavailable("engine did not answer");
        };
        let mut tiers = std::collections::BTreeMap::new();
        for b in &snapshot.blocks {
            let row = tiers.entry(format!("{:?}", b.tier)).or_insert((0u64, 0u64));
            row.0 += 1;
            row.1 ^= b.block.seq.0;
        }
        rows.extend(tiers.into_iter().map(|(t, (n, x))| serde_json::json!({"worker": snapshot.worker, "dp_rank": snapshot.dp_rank.0, "tier": t, "blocks": n, "digest": format!("{x:016x}")})));
        // Every rank has the worker's epoch; the watermark shown is rank 0's.
        head.get_or_insert((snapshot.epoch, snapshot.watermark));
    }
    let (epoch, watermark) = head.unwrap_or_default();
    full(
        StatusCode::OK,
        "application/json",
        serde_json::json!({"epoch": epoch, "watermark": watermark, "ranks": rows}).to_string(),
    )
}

/// `POST /admin/faults` (fault injection on): `{"pause_publisher": bool,
/// "stall_after_headers": bool}` replaces the faults in force; `{"fail_engine": true}` makes
/// the engine fail as a broken one would.
async fn set_faults(state: State, req: hyper::Request<Incoming>) -> Response<Body> {
    let mut value = match read_json::<serde_json::Value>(&state, req).await {
        Ok(v) => v,
        Err(response) => return response,
    };
    let fail_engine = value
        .as_object_mut()
        .and_then(|m| m.remove("fail_engine"))
        .and_then(|f| f.as_bool())
        .unwrap_or(false);
    let faults = match serde_json::from_value::<Faults>(value) {
        Ok(faults) => faults,
        Err(e) => return bad_request(&format!("invalid faults: {e}")),
    };
    if fail_engine {
        let _ = state.engines[0].try_send(EngineInput::Fail);
    }
    if let Some(sender) = &state.faults {
        sender.send_replace(faults);
    }
    tracing::warn!(?faults, fail_engine, "fault injection");
    full(StatusCode::OK, "application/json", r#"{"ok":true}"#)
}
/// Text of generated tokens. The engine has no model: its tokens are synthetic ids, shown
/// as lowercase letters (`a + id mod 26`) so streams are readable.
pub(crate) fn render(tokens: &[u32]) -> String {
    tokens
        .iter()
        .map(|t| char::from(b'a' + (t % 26) as u8))
        .collect()
}
