//! Forwarding one routed request to its worker and relaying the answer: the booking guard
//! that returns the request's load wherever it is dropped, the one error type that decides
//! retries, the client's status and the metric label, and the relay with its deadlines.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Response, StatusCode, header};
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::openai::{ApiError, Fault};
use super::{InFlight, Router};
use crate::discovery::{WorkerApi, WorkerInfo};
use crate::events::load::LoadShare;
use crate::http::budget::{BodyBudget, GRAIN, Reservation, collect_within};
use crate::http::{Body, BodyError};
use crate::protocol::{SeqHash, WorkerId};
use crate::scheduler::mismatch::MismatchAlarm;
use crate::scheduler::{BookingId, Decision, Scheduler, WorkerKey};

/// A request's booked load, owned by whoever holds the request: the handler, then (for a
/// stream) the relay task. Dropping it, however the request ends (finished, failed, the
/// client gone before the headers or mid-stream), completes the booking here and on the
/// peer replicas. The scheduler's TTL stays only as a backstop.
pub struct Booking {
    scheduler: Arc<Mutex<Scheduler>>,
    load: Option<LoadShare>,
    id: BookingId,
    prefill_open: bool,
    /// The worker, and the last full block of the prompt it was sent: once the worker has
    /// answered (its first token), that block should show up in its events (the
    /// hash-mismatch alarm). Handed to the alarm then, once.
    expect: Option<(WorkerId, SeqHash)>,
    alarm: Arc<Mutex<MismatchAlarm>>,
    clock: Instant,
    /// Signalled when work is released: queued requests may fit now.
    room: Arc<tokio::sync::Notify>,
}

impl Booking {
    /// Takes charge of a booking the scheduler just made, and announces it to peers.
    pub fn new(router: &Router, id: BookingId) -> Booking {
        if let Some(load) = &router.load {
            load.booked(id);
        }
        Booking {
            scheduler: Arc::clone(&router.scheduler),
            load: router.load.clone(),
            id,
            prefill_open: true,
            expect: None,
            alarm: Arc::clone(&router.mismatch),
            clock: router.started,
            room: Arc::clone(&router.room),
        }
    }

    /// The request's prompt ends with full block `last` (none: shorter than a block).
    pub fn expecting(mut self, worker: WorkerId, last: Option<SeqHash>) -> Booking {
        self.expect = last.map(|l| (worker, l));
        self
    }

    /// The worker computed the prompt (a first token, or a whole answer): its blocks are
    /// cached there, and the alarm watches for its last one from now, while the engine
    /// still holds it. A request that ends before (cancelled, failed, timed out) is not
    /// evidence either way, so it never feeds the mismatch alarm.
    pub fn answered(&mut self) {
        if let Some((worker, last)) = self.expect.take() {
            let now_ms = self.clock.elapsed().as_millis() as u64;
            self.alarm.lock().expect(worker, last, now_ms);
        }
    }

    /// Whether its prefill is still booked (no first token yet).
    pub fn prefill_open(&self) -> bool {
        self.prefill_open
    }

    /// The request produced its first token: its prefill no longer loads the worker.
    pub fn first_token(&mut self) {
        self.answered();
        self.prefill_done();
    }

    /// The router saw the prompt's last block in the worker's index while the request ran
    /// (the prefill watch of a whole-answer request): its prefill is done, and the mismatch
    /// alarm has its evidence at once, rather than a later look that an eviction may beat.
    pub fn prompt_cached(&mut self) {
        if let Some((worker, _)) = self.expect.take() {
            self.alarm.lock().seen(worker);
        }
        self.prefill_done();
    }

    fn prefill_done(&mut self) {
        if std::mem::take(&mut self.prefill_open) {
            self.scheduler.lock().first_token(self.id);
            if let Some(load) = &self.load {
                load.first_token(self.id);
            }
            self.room.notify_one();
        }
    }
}

impl Drop for Booking {
    fn drop(&mut self) {
        self.scheduler.lock().complete(self.id);
        if let Some(load) = &self.load {
            load.completed(self.id);
        }
        self.room.notify_one();
    }
}

/// What requests learn of a worker's health, for the scheduler's ejection
/// (`scheduler.ejection`): one that answers is reachable, one that cannot be reached, or
/// whose stream brings no token in time, counts towards sitting out.
pub(super) struct Reach {
    scheduler: Arc<Mutex<Scheduler>>,
    worker: WorkerId,
    clock: Instant,
}

impl Reach {
    pub(super) fn new(router: &Router, worker: WorkerId) -> Reach {
        Reach {
            scheduler: Arc::clone(&router.scheduler),
            worker,
            clock: router.started,
        }
    }

    /// The worker answered: reachable, and no longer ejected.
    pub(super) fn answered(&self) {
        self.scheduler.lock().worker_answered(self.worker);
    }

    /// The worker failed a request as a dead, hung or broken one does.
    pub(super) fn failed(&self) {
        let now_ms = self.clock.elapsed().as_millis() as u64;
        let ejected = self
            .scheduler
            .lock()
            .worker_unreachable(self.worker, now_ms);
        if let Some(ms) = ejected {
            metrics::counter!("kvroute_worker_ejections_total", "worker" => self.worker.to_string())
                .increment(1);
            tracing::warn!(worker = %self.worker, ejected_ms = ms, "worker unreachable, silent or failing several times in a row; it sits out");
        }
    }
}

/// Why a routed request failed. One value decides whether another worker is tried, what
/// the client sees and which metric counts it.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// The chosen worker left between the decision and the call.
    #[error("worker {worker} left before the request was sent")]
    WorkerLeft {
        /// The worker.
        worker: WorkerId,
    },
    /// The worker could not be reached.
    #[error("worker {worker} unreachable: {source}")]
    Connect {
        /// The worker.
        worker: WorkerId,
        /// What the client said.
        #[source]
        source: hyper_util::client::legacy::Error,
    },
    /// The worker did not answer with headers in time.
    #[error("worker {worker} sent no response headers within {ms} ms")]
    HeadersTimeout {
        /// The worker.
        worker: WorkerId,
        /// The deadline.
        ms: u64,
    },
    /// A non-streamed answer (headers and body, which a worker sends once it has generated
    /// every token) did not arrive within what the request's `upstream_body_timeout_ms`
    /// left this worker. Not tried elsewhere: the worker may still be generating it, and the
    /// client has waited the whole deadline.
    #[error("worker {worker} sent no whole answer within {ms} ms (the request's deadline)")]
    AnswerTimeout {
        /// The worker.
        worker: WorkerId,
        /// The deadline.
        ms: u64,
    },
    /// The worker answered with an error status.
    #[error("worker {worker} answered {status}: {message}")]
    Status {
        /// The worker.
        worker: WorkerId,
        /// Its status.
        status: StatusCode,
        /// Its error message (from its OpenAI-shaped body, else the body's text).
        message: String,
        /// Its body, if whole and in OpenAI's shape (a refusal reaches the client as it
        /// came; [`error_parts`]).
        body: Option<Bytes>,
    },
    /// A non-streamed answer failed after its success status: its body broke off, was
    /// over `max_upstream_body_bytes`, or would pass the router's memory budget for bodies
    /// (so would a stream's first events, while its headers were held back: [`forward`]).
    /// Never tried elsewhere: the worker has generated it (its headers come with the last
    /// token), and another worker would generate it again, likely to fail the same way.
    #[error("worker {worker}: its answer failed after its headers: {source}")]
    Answer {
        /// The worker.
        worker: WorkerId,
        /// What went wrong.
        #[source]
        source: BodyError,
    },
    /// A non-streamed answer with a success status whose body is not JSON (empty, a
    /// proxy's HTML page, cut short but ended cleanly). Never tried elsewhere, as
    /// [`ProxyError::Answer`]; counts towards the worker's ejection.
    #[error("worker {worker}: its answer is not JSON: {error}")]
    NotJson {
        /// The worker.
        worker: WorkerId,
        /// What the parser said.
        error: String,
    },
    /// The worker's error body failed or was too slow.
    #[error("worker {worker} ({status}): {source}")]
    Body {
        /// The worker.
        worker: WorkerId,
        /// The error status it came with: whose fault the request's failure is.
        status: StatusCode,
        /// What went wrong.
        #[source]
        source: BodyError,
    },
    /// A stream failed before its first token, while its headers were still held back from
    /// the client ([`forward`]): the client has seen nothing of it, so another worker is
    /// tried, as for a worker that fails before its headers.
    #[error("{message}")]
    StreamFailed {
        /// The worker.
        worker: WorkerId,
        /// How the relay ended.
        end: RelayEnd,
        /// What the client is told if no other worker serves it.
        message: String,
    },
    /// A stream's relay task ended without saying whether the client was answered: it
    /// panicked, and took the in-flight slot and the booking with it. A bug of the
    /// router's; not tried elsewhere, since a retry would run outside `max_inflight`.
    #[error("the relay of worker {worker}'s stream ended without a word")]
    RelayLost {
        /// The worker.
        worker: WorkerId,
    },
}

impl ProxyError {
    /// Whether another worker may be tried: nothing reached the client, and the failure is
    /// the worker's (unreachable, too slow, overloaded, misdirected, broken), not the request's.
    pub fn retry_elsewhere(&self) -> bool {
        match self {
            // A 404 is the worker's registration out of date, not the request: the router
            // sends a model only where it is registered, on a path it chose (vLLM answers
            // 404 for a LoRA adapter unloaded at run time). Tried elsewhere, but still the
            // client's if every worker says so, and no count towards the worker's ejection.
            ProxyError::Status { status, .. } if *status == StatusCode::NOT_FOUND => true,
            ProxyError::Status { status, .. } | ProxyError::Body { status, .. } => {
                worker_side(*status)
            }
            ProxyError::AnswerTimeout { .. }
            | ProxyError::Answer { .. }
            | ProxyError::NotJson { .. }
            | ProxyError::RelayLost { .. } => false,
            // Any other worker would fail the same way.
            _ if self.router_exhausted() => false,
            _ => true,
        }
    }

    /// Whether the worker could not be reached at all (no connection, or no response
    /// headers in time): what counts towards its ejection (`scheduler.ejection`). Not when
    /// the router itself could not open a socket: ejecting healthy workers for it would
    /// take the whole fleet out.
    pub fn unreachable(&self) -> bool {
        matches!(
            self,
            ProxyError::Connect { .. } | ProxyError::HeadersTimeout { .. }
        ) && !self.router_exhausted()
    }

    /// Whether the worker answered with an error status of its own (overloaded, broken,
    /// misconfigured: [`worker_side`]), not one that refuses the request, or with a success
    /// whose body is not JSON. Counts towards
    /// its ejection as not answering does: its bookings are released at once, so it reads
    /// as idle, and with its cached prefixes it would win request after request, each
    /// paying a failed round trip before its retry.
    pub fn worker_broken(&self) -> bool {
        match self {
            ProxyError::Status { status, .. } | ProxyError::Body { status, .. } => {
                worker_side(*status)
            }
            ProxyError::NotJson { .. } => true,
            // Its answer broke off after a success status (a worker that resets its
            // connections mid-body would otherwise never be ejected).
            ProxyError::Answer {
                source: BodyError::Io(_),
                ..
            } => true,
            _ => false,
        }
    }

    /// Whether connecting failed for want of the router's own resources (file
    /// descriptors, socket buffers, memory).
    fn router_exhausted(&self) -> bool {
        match self {
            ProxyError::Connect { source, .. } => local_exhaustion(source),
            _ => false,
        }
    }

    /// Whose fault it is.
    pub fn fault(&self) -> Fault {
        match self {
            ProxyError::Status { status, .. } | ProxyError::Body { status, .. }
                if !worker_side(*status) =>
            {
                Fault::Client
            }
            ProxyError::Answer {
                source: BodyError::OverBudget { .. },
                ..
            }
            | ProxyError::RelayLost { .. } => Fault::Router,
            _ if self.router_exhausted() => Fault::Router,
            _ => Fault::Worker,
        }
    }

    /// The metric label of the failure.
    pub fn label(&self) -> &'static str {
        match self {
            ProxyError::WorkerLeft { .. } => "worker_left",
            ProxyError::Connect { .. } => "connect",
            ProxyError::HeadersTimeout { .. } => "headers_timeout",
            ProxyError::AnswerTimeout { .. } => "answer_timeout",
            ProxyError::Status { status, .. } if worker_side(*status) => "worker_status",
            ProxyError::Status { .. } => "refused",
            ProxyError::Body {
                source: BodyError::TimedOut { .. },
                ..
            } => "body_timeout",
            ProxyError::Body {
                source: BodyError::TooLarge { .. },
                ..
            } => "body_too_large",
            ProxyError::Answer {
                source: BodyError::TooLarge { .. },
                ..
            } => "answer_too_large",
            ProxyError::Answer {
                source: BodyError::OverBudget { .. },
                ..
            } => "answer_over_budget",
            ProxyError::Answer { .. } => "answer_failed",
            ProxyError::NotJson { .. } => "answer_not_json",
            ProxyError::Body { .. } => "body",
            ProxyError::StreamFailed { .. } => "stream_failed",
            ProxyError::RelayLost { .. } => "relay_lost",
        }
    }

    /// What the client is told (when no other worker could serve it).
    pub fn to_api(&self) -> ApiError {
        match self {
            ProxyError::Status {
                status,
                message,
                body,
                ..
            } if !worker_side(*status) => {
                ApiError::refused_by_worker(status.as_u16(), message.clone(), body.clone())
            }
            // The worker refused the request; only its reasons did not come whole.
            ProxyError::Body { status, .. } if !worker_side(*status) => {
                ApiError::refused_by_worker(status.as_u16(), self.to_string(), None)
            }
            ProxyError::HeadersTimeout { .. }
            | ProxyError::AnswerTimeout { .. }
            | ProxyError::Body {
                source: BodyError::TimedOut { .. },
                ..
            } => ApiError::worker_timeout(self.to_string()),
            ProxyError::Answer {
                source: BodyError::OverBudget { budget },
                ..
            } => ApiError::bodies_over_budget(*budget),
            ProxyError::Answer { .. } | ProxyError::NotJson { .. } => {
                ApiError::bad_gateway(self.to_string())
            }
            ProxyError::StreamFailed {
                end: RelayEnd::NoFirstFrame,
                message,
                ..
            } => ApiError::worker_timeout(message.clone()),
            ProxyError::RelayLost { .. } => ApiError::router_exhausted(self.to_string()),
            _ if self.router_exhausted() => ApiError::router_exhausted(self.to_string()),
            _ => ApiError::unavailable(self.to_string()),
        }
    }
}

/// Whether `error`, or an error it wraps, is the local system refusing a socket: too many
/// open files (the process's or the system's), no buffer space, no memory (Linux's
/// numbers). The router's own state, not the worker's.
pub fn local_exhaustion(error: &(dyn std::error::Error + 'static)) -> bool {
    const EMFILE: i32 = 24;
    const ENFILE: i32 = 23;
    const ENOBUFS: i32 = 105;
    const ENOMEM: i32 = 12;
    let mut next = Some(error);
    while let Some(e) = next {
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && matches!(io.raw_os_error(), Some(EMFILE | ENFILE | ENOBUFS | ENOMEM))
        {
            return true;
        }
        next = e.source();
    }
    false
}

/// What a request's outcome says of its worker's health: `Some(true)` it answered (a
/// refusal of the request included), `Some(false)` it could not be reached or answered
/// with an error of its own (towards its ejection), `None` nothing: a stream's headers
/// (its relay reports its first token, or its silence), a worker gone, one slow to generate
/// a whole answer, a stream that failed before its first token (its relay counted it), an
/// answer the router could not hold (its size or memory budget), or a relay that ended
/// without a word (the router's bug).
pub(super) fn answered(outcome: Result<(), &ProxyError>, stream: bool) -> Option<bool> {
    match outcome {
        Ok(()) => (!stream).then_some(true),
        Err(e) if e.unreachable() || e.worker_broken() => Some(false),
        Err(
            ProxyError::WorkerLeft { .. }
            | ProxyError::AnswerTimeout { .. }
            | ProxyError::StreamFailed { .. }
            | ProxyError::Answer { .. }
            | ProxyError::RelayLost { .. },
        ) => None,
        Err(_) => Some(true),
    }
}

/// Statuses that say the worker, not the request, is the problem: overloaded (429),
/// misdirected (421: it does not serve the model it was sent), timed out (408), any 5xx,
/// refusing the router's own credentials (401, 403: a missing or wrong
/// `--engine-api-key`; clients' keys are never passed on, so never theirs to fix), or a
/// redirect (a worker URL behind an http→https proxy: the router follows none, and the
/// client could not either).
fn worker_side(status: StatusCode) -> bool {
    status.is_server_error()
        || status.is_redirection()
        || matches!(
            status,
            StatusCode::TOO_MANY_REQUESTS
                | StatusCode::MISDIRECTED_REQUEST
                | StatusCode::REQUEST_TIMEOUT
                | StatusCode::UNAUTHORIZED
                | StatusCode::FORBIDDEN
        )
}

/// Most bytes of a worker's error body read for its message (outside the bodies' budget:
/// at 4,096 requests failing at once, 64 MiB; the message kept is its first KiB).
const ERROR_BODY_BYTES: usize = 16 << 10;

/// The message of a worker's error body, read within `deadline`, and the body itself if it
/// is whole and in OpenAI's shape (what the client is sent for a refusal); a body longer than
/// [`ERROR_BODY_BYTES`] is cut there (its message is in its first bytes, if anywhere).
async fn error_body(
    body: hyper::body::Incoming,
    deadline: Duration,
) -> Result<(String, Option<Bytes>), BodyError> {
    let read = async {
        let mut body = std::pin::pin!(body);
        let mut bytes = Vec::new();
        while bytes.len() < ERROR_BODY_BYTES {
            let Some(frame) = body.frame().await else {
                break;
            };
            let frame = frame.map_err(|e| BodyError::Io(e.into()))?;
            if let Ok(data) = frame.into_data() {
                let room = ERROR_BODY_BYTES - bytes.len();
                bytes.extend_from_slice(&data[..data.len().min(room)]);
            }
        }
        Ok(error_parts(bytes))
    };
    tokio::time::timeout(deadline, read)
        .await
        .unwrap_or(Err(BodyError::TimedOut {
            ms: deadline.as_millis() as u64,
        }))
}

/// The error message of a worker's error body: OpenAI's shape (`error.message`), vLLM's
/// older flat one and SGLang's (`{"object": "error", "message": …}`), FastAPI's
/// (`detail`), else its text (at most 1 KiB of it); and the body itself if it is whole (not
/// cut at [`ERROR_BODY_BYTES`]) and in OpenAI's shape. Other shapes are answered in
/// OpenAI's with their message: clients read `error.message` and `error.type`.
fn error_parts(body: Vec<u8>) -> (String, Option<Bytes>) {
    let parsed = serde_json::from_slice::<serde_json::Value>(&body).ok();
    let message = parsed.as_ref().and_then(|v| {
        [&v["error"]["message"], &v["message"], &v["detail"]]
            .into_iter()
            .find_map(|m| m.as_str())
    });
    let message = match message {
        Some(m) => m.chars().take(1024).collect(),
        None => String::from_utf8_lossy(&body[..body.len().min(1024)]).into_owned(),
    };
    let openai =
        body.len() < ERROR_BODY_BYTES && parsed.is_some_and(|v| v["error"]["message"].is_string());
    (message, openai.then(|| Bytes::from(body)))
}

/// A request as each kind of worker takes it.
pub(super) struct Upstream {
    /// For a kvroute worker: the internal generate body (the router's token ids), written
    /// when a kvroute worker is first chosen ([`Upstream::needs_generate`]): engines never
    /// read it, and it is several times the client's body (about 6.5 B a token).
    pub generate: Option<Bytes>,
    /// For an engine: the client's body as it came, less vLLM's full KV event reporting
    /// ([`super::openai::VllmXargs`]).
    pub raw: Bytes,
    /// A chat completion (else a completion).
    pub chat: bool,
    /// The client asked for the decision's receipt header.
    pub receipt: bool,
    /// The prompt has images, audio or video: an engine fetches and decodes them before
    /// it answers with headers (vLLM allows a video URL 30 s, `VLLM_VIDEO_FETCH_TIMEOUT`).
    pub media: bool,
    /// Headers passed on to the worker as they came: the request's id (`x-request-id`,
    /// which vLLM takes for its own with `--enable-request-id-headers`) and the W3C trace
    /// context (`traceparent`, `tracestate`), so that one request is followed from the
    /// router into the engine.
    pub passed: Vec<(header::HeaderName, header::HeaderValue)>,
}

/// The request headers passed on to workers ([`Upstream::passed`]).
pub(super) const PASSED_HEADERS: [&str; 3] = ["x-request-id", "traceparent", "tracestate"];

impl Upstream {
    /// Whether sending to `api` needs the generate body, not written yet.
    pub(super) fn needs_generate(&self, api: WorkerApi) -> bool {
        api == WorkerApi::Kvroute && self.generate.is_none()
    }

    /// The HTTP request for worker `info` (rank `rank` of it), carrying `engine_key`
    /// (vLLM, SGLang and kvroute workers started with `--api-key` refuse requests without
    /// it).
    fn request(
        &self,
        info: &WorkerInfo,
        rank: u32,
        engine_key: Option<&crate::auth::Secret>,
    ) -> hyper::Request<Full<Bytes>> {
        let base = info.url.trim_end_matches('/');
        let (path, body) = match info.api {
            // Written before a kvroute worker is sent to (`forward` checks).
            WorkerApi::Kvroute => (
                "/internal/generate",
                self.generate.clone().unwrap_or_default(),
            ),
            WorkerApi::Openai if self.chat => ("/v1/chat/completions", self.raw.clone()),
            WorkerApi::Openai => ("/v1/completions", self.raw.clone()),
        };
        let mut request = hyper::Request::post(format!("{base}{path}"))
            .header(header::CONTENT_TYPE, "application/json");
        for (name, value) in &self.passed {
            request = request.header(name, value);
        }
        if info.api == WorkerApi::Openai && info.dp_size > 1 {
            // One endpoint fronting several data-parallel ranks: pin the rank the router
            // chose. vLLM reads `X-data-parallel-rank` (OpenAIServing._get_data_parallel_rank
            // in vllm/entrypoints/openai/engine/serving.py); SGLang reads the same header,
            // case-insensitively (serving_base.extract_routed_dp_rank_from_header).
            request = request.header("x-data-parallel-rank", rank.to_string());
        }
        if let Some(key) = engine_key {
            request = request.header(header::AUTHORIZATION, format!("Bearer {}", key.expose()));
        }
        request
            .body(Full::new(body))
            .expect("invariant: a registered URL (validated) and static parts form a request")
    }
}

/// Sends a routed request to its worker and relays the answer. Streams are relayed by a task
/// that takes over the booking and the in-flight slot. A non-streamed answer must arrive by
/// `answer_by`: one deadline for the request, however many workers it is tried on.
///
/// A stream's headers are held back from the client until its first token, for up to
/// `worker_timeout_ms` after the worker's: a worker that fails before then (its connection
/// breaks, its body ends, or `first_token_timeout_ms` passes) has shown the client nothing,
/// so this returns [`ProxyError::StreamFailed`], with the in-flight slot back, and the
/// caller tries another worker. The first token comes with the headers, so holding them
/// costs the client no time; the bound keeps a proxy in front of the router, which may
/// give up on a response that sends nothing for a minute, from cutting a long prefill.
pub(super) async fn forward(
    router: &Arc<Router>,
    decision: &Decision,
    mut booking: Booking,
    body: &Upstream,
    stream: bool,
    answer_by: Instant,
    inflight: &mut Option<InFlight>,
) -> Result<Response<Body>, ProxyError> {
    let key = decision.chosen.key;
    let worker = key.0;
    let Some(info) = router.plane.worker(worker) else {
        return Err(ProxyError::WorkerLeft { worker });
    };
    if body.needs_generate(info.api) {
        // It registered again as a kvroute worker since the caller looked: tried elsewhere,
        // as one that left (its next attempt writes the body).
        return Err(ProxyError::WorkerLeft { worker });
    }
    router.plane.note_routed(key);
    let config = &router.config;
    let request = body.request(&info, key.1.0, config.engine_api_key.as_ref());
    // A stream's headers come with its first bytes; a non-streamed answer's only once the
    // whole answer is generated, so it gets what is left of the request's answer deadline
    // (all of it on the first worker tried), and the body what is left after the headers.
    let started = Instant::now();
    let answer_left = || answer_by.saturating_duration_since(Instant::now());
    // What the request's deadline leaves this worker for a whole answer (what its timeout
    // reports).
    let answer_ms = answer_left().as_millis() as u64;
    let headers_ms = match (stream, body.media) {
        // Slow media is the request's, not the worker's: it gets the first token's
        // deadline, or every worker in turn would be timed out (and counted towards its
        // ejection) on the same slow URL.
        (true, true) => config.worker_timeout_ms.max(config.first_token_timeout_ms),
        (true, false) => config.worker_timeout_ms,
        (false, _) => answer_ms,
    };
    let sent = tokio::time::timeout(
        Duration::from_millis(headers_ms),
        router.client.request(request),
    );
    let sent = if stream {
        sent.await
    } else {
        // A non-streamed answer's headers come with its last token.
        watch_prefill(router, key, &mut booking, sent).await
    };
    let response = match sent {
        Ok(Ok(r)) => r,
        Ok(Err(source)) => return Err(ProxyError::Connect { worker, source }),
        Err(_) if stream => {
            return Err(ProxyError::HeadersTimeout {
                worker,
                ms: headers_ms,
            });
        }
        Err(_) => {
            return Err(ProxyError::AnswerTimeout {
                worker,
                ms: answer_ms,
            });
        }
    };
    let status = response.status();
    if !status.is_success() {
        // Only its message is kept: the first bytes, read under the headers' deadline (a
        // worker stalling after an error status would otherwise hold the client for the
        // whole answer's).
        let mut wait = Duration::from_millis(config.worker_timeout_ms);
        if !stream {
            wait = wait.min(answer_left());
        }
        let (message, body) = error_body(response.into_body(), wait)
            .await
            .map_err(|source| ProxyError::Body {
                worker,
                status,
                source,
            })?;
        return Err(ProxyError::Status {
            worker,
            status,
            message,
            body,
        });
    }
    let o = decision.chosen.overlap;
    let overlap = format!("device={};host={};disk={}", o.device, o.host, o.disk);
    let r = decision.receipt;
    let mut builder = Response::builder().status(StatusCode::OK);
    if config.route_headers {
        builder = builder
            .header("x-kvroute-worker", worker.to_string())
            .header("x-kvroute-overlap", overlap)
            .header("x-kvroute-cached-blocks", r.cached_blocks)
            .header("x-kvroute-reachable-blocks", r.reachable_blocks);
    }
    if config.route_headers && body.receipt {
        builder = builder.header(
            "x-kvroute-receipt",
            format!(
                "worker={worker};dp_rank={};cached={};reachable={};prompt={};cost={:.3}",
                key.1.0, r.cached_blocks, r.reachable_blocks, r.prompt_blocks, r.cost
            ),
        );
    }
    let label = worker.to_string();
    if !stream {
        let left = answer_left();
        // The answer counts against the bodies' memory budget until it is written out.
        let answer = collect_within(
            response.into_body(),
            config.max_upstream_body_bytes,
            left,
            &router.bodies,
        );
        let (bytes, held) = watch_prefill(router, key, &mut booking, answer)
            .await
            .map_err(|source| match source {
                BodyError::TimedOut { .. } => ProxyError::AnswerTimeout {
                    worker,
                    ms: answer_ms,
                },
                source => ProxyError::Answer { worker, source },
            })?;
        // Passed on as it came, but JSON: a 200 whose body is empty, a proxy's HTML page,
        // or cut short yet ended cleanly would reach the client as a success. A large one
        // is read on a blocking thread (64 MiB take about 100 ms, which the streams relayed
        // on this runtime thread would wait).
        if let Some(error) = not_json(&bytes).await {
            return Err(ProxyError::NotJson { worker, error });
        }
        booking.answered();
        drop(booking);
        metrics::histogram!("kvroute_e2e_seconds", "worker" => label)
            .record(started.elapsed().as_secs_f64());
        // The reservation lives until the client's connection has taken the answer; its
        // length stays known (`Content-Length`).
        let body = crate::http::budget::HeldBody::new(bytes, held).map_err(|never| match never {});
        return Ok(builder
            .header(header::CONTENT_TYPE, "application/json")
            .body(BodyExt::boxed(body))
            .expect("invariant: static response parts are valid"));
    }
    let (tx, rx) = mpsc::channel::<Held>(CLIENT_EVENTS);
    let (opening, opened) = oneshot::channel();
    let ending = crate::http::Ending::default();
    let relay = Relay {
        ending: ending.clone(),
        upstream: response.into_body(),
        bodies: router.bodies.clone(),
        held: Reservation::default(),
        booking,
        reach: Reach::new(router, worker),
        inflight: inflight.take(),
        tx,
        idle: Duration::from_millis(config.relay_idle_timeout_ms),
        first_frame: Duration::from_millis(config.first_token_timeout_ms),
        events: SseEvents::default(),
        ttft: metrics::histogram!("kvroute_ttft_seconds", "worker" => label.clone()),
        itl: metrics::histogram!("kvroute_itl_seconds", "worker" => label.clone()),
        worker: label,
        started,
        opening: Some(opening),
        open_by: Instant::now() + Duration::from_millis(config.worker_timeout_ms),
        tokens: false,
        worker_error: None,
    };
    tokio::spawn(tracing::Instrument::in_current_span(relay.run()));
    // Dropped with the client's connection meanwhile, this drops `rx`: the relay sees the
    // client gone and ends.
    let refused = match opened.await {
        Ok(Ok(refused)) => refused,
        Ok(Err(Unopened {
            end,
            message,
            inflight: slot,
        })) => {
            *inflight = slot;
            return Err(match end {
                RelayEnd::OverBudget => ProxyError::Answer {
                    worker,
                    source: BodyError::OverBudget {
                        budget: router.bodies.bytes(),
                    },
                },
                RelayEnd::EventTooLarge => ProxyError::Answer {
                    worker,
                    source: BodyError::TooLarge {
                        limit: MAX_EVENT_BYTES,
                    },
                },
                end => ProxyError::StreamFailed {
                    worker,
                    end,
                    message,
                },
            });
        }
        Err(_) => return Err(ProxyError::RelayLost { worker }),
    };
    if refused {
        builder = builder.extension(Refused);
    }
    Ok(builder
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        // Proxies in front (ingress-nginx's default) would buffer the stream, holding each
        // token back from the client.
        .header("x-accel-buffering", "no")
        .body(crate::http::streamed(rx, ending, |(bytes, _held)| bytes))
        .expect("invariant: static response parts are valid"))
}

/// Marks (in its extensions) a streamed answer that opened with an error event: the worker
/// refused the request and computed no prompt. A stream whose headers went out before its
/// first event (the wait for the first token passed) is answered before its error is seen,
/// unmarked.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Refused;

/// Events on their way to the client, with their share of the bodies' budget.
type Held = (Bytes, Reservation);

/// Events a stream holds for its client, at most (each counted against the bodies' budget
/// by the KiB, so a client that stops reading holds at most 16 KiB of it for small events).
const CLIENT_EVENTS: usize = 16;

/// Grows `held` to cover `bytes` of the worker's stream, waiting for the bodies' budget to
/// have room until `deadline`; a client that leaves meanwhile ends the wait.
async fn make_room(
    tx: &mpsc::Sender<Held>,
    bodies: &BodyBudget,
    held: &mut Reservation,
    bytes: usize,
    deadline: Instant,
) -> Result<(), RelayEnd> {
    tokio::select! {
        biased;
        () = tx.closed() => Err(RelayEnd::ClientGone),
        room = bodies.grow_until(held, bytes, deadline) => {
            if room { Ok(()) } else { Err(RelayEnd::OverBudget) }
        }
    }
}

/// Sends whole events to the client with their share of the budget, by `deadline`.
async fn send_event(
    tx: &mpsc::Sender<Held>,
    events: Bytes,
    share: Reservation,
    deadline: Instant,
) -> Result<(), RelayEnd> {
    match tokio::time::timeout_at(deadline, tx.send((events, share))).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(_)) => Err(RelayEnd::ClientGone),
        Err(_) => Err(RelayEnd::ClientStalled),
    }
}

/// How often a non-streamed request looks for its prefill's end in the index.
const PREFILL_POLL: Duration = Duration::from_millis(50);

/// Awaits a non-streamed answer while watching for the end of its prefill. Its worker sends
/// no first token to see, and the answer comes only once every token is generated, so the
/// prefill would stay booked for the whole generation, making the worker look loaded with
/// prefill it finished long before. The prompt's last full block shows up in the worker's
/// KV events once computed: the prefill is released then. A prompt shorter than a block,
/// or a block evicted between two looks, keeps it booked until the answer.
///
/// A prompt not computed by `first_token_timeout_ms` counts once towards the worker's
/// ejection, as a stream's missing first token does: a hung engine still takes the
/// connection, and a non-streamed answer's headers come only with its last token, so it
/// would otherwise hold request after request for the whole answer's deadline and never sit
/// out. The request waits on for its answer (the engine may still be queueing it).
pub(super) async fn watch_prefill<F: std::future::Future>(
    router: &Router,
    key: WorkerKey,
    booking: &mut Booking,
    answer: F,
) -> F::Output {
    let Some((_, last)) = booking.expect else {
        return answer.await;
    };
    if router.guessed(key.0) {
        // Its index entries are guesses made when the request was routed: the prompt
        // shows there at once, whatever the engine has computed.
        return answer.await;
    }
    let computed = || {
        router
            .plane
            .indexer()
            .find_matches_seq(&[last])
            .get(key.0, key.1)
            .device
            > 0
    };
    let mut answer = std::pin::pin!(answer);
    let mut look = tokio::time::interval(PREFILL_POLL);
    look.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut silent_at = Some(
        tokio::time::Instant::now() + Duration::from_millis(router.config.first_token_timeout_ms),
    );
    loop {
        tokio::select! {
            out = &mut answer => return out,
            _ = look.tick(), if booking.prefill_open() => {
                if computed() {
                    booking.prompt_cached();
                } else if silent_at.is_some_and(|at| tokio::time::Instant::now() >= at) {
                    silent_at = None;
                    // Blamed only while this router hears the worker's events: with its
                    // NATS link down, or the stream resyncing, the prompt cannot show.
                    if router.plane.hears(key) {
                        tracing::warn!(worker = %key.0, "a non-streamed request's prompt not computed within the first-token timeout");
                        Reach::new(router, key.0).failed();
                    } else {
                        tracing::debug!(worker = %key.0, "a non-streamed request's prompt not seen, but the worker's events are not heard: not counted");
                    }
                }
            }
        }
    }
}

/// A stream being relayed from its worker to its client. It owns the worker's body (a
/// client that goes away drops it, so the worker sees the connection close and cancels),
/// the booking and the in-flight slot; all three go when it ends.
struct Relay {
    upstream: hyper::body::Incoming,
    booking: Booking,
    /// Told of the first token, or of a worker silent past a deadline: a hung engine still
    /// sends its headers, and would otherwise look healthy and idle.
    reach: Reach,
    inflight: Option<InFlight>,
    tx: mpsc::Sender<Held>,
    /// Set once the client's stream has ended as it should (`[DONE]`, or the error events
    /// queued): without it, the client's body fails when the relay goes.
    ending: crate::http::Ending,
    /// The router's budget for bodies held: what the worker sent counts from when it is
    /// read until the client's connection takes it.
    bodies: BodyBudget,
    /// The share of `bodies` of the bytes read and not yet sent on (an event held back for
    /// its end); whole events take theirs with them.
    held: Reservation,
    /// Longest wait for the worker's next token, and for the client to take an event.
    idle: Duration,
    /// Longest wait for the worker's first token after its headers (the prefill, and the
    /// engine's queue).
    first_frame: Duration,
    /// The worker's bytes cut at event boundaries.
    events: SseEvents,
    /// The worker's TTFT and inter-token histograms, looked up once (not per token).
    ttft: metrics::Histogram,
    itl: metrics::Histogram,
    worker: String,
    started: Instant,
    /// Told when the client is answered (the first token came, or `open_by` passed; true if
    /// the stream opened with an error event): until then a worker that fails is the
    /// handler's to try elsewhere. `None` once told.
    opening: Option<oneshot::Sender<Result<bool, Unopened>>>,
    /// When the headers go to the client without a token.
    open_by: Instant,
    /// The worker has sent a token.
    tokens: bool,
    /// What the worker said when it failed in its stream before the first token.
    worker_error: Option<String>,
}

/// A stream that failed before its client was answered: why, and the in-flight slot for
/// the next worker.
struct Unopened {
    end: RelayEnd,
    message: String,
    inflight: Option<InFlight>,
}

/// How a relay ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RelayEnd {
    /// The worker finished the stream.
    Done,
    /// The client went away.
    ClientGone,
    /// The client stopped reading for longer than the idle timeout.
    ClientStalled,
    /// The worker sent no token for longer than the idle timeout.
    WorkerStalled,
    /// The worker sent no first token within the first-token timeout of its headers.
    NoFirstFrame,
    /// The worker's connection failed mid-stream.
    WorkerFailed,
    /// The worker's body ended cleanly before `data: [DONE]` (vLLM, SGLang and kvroute's
    /// workers always send it): the client is told the answer is cut off.
    Truncated,
    /// The router's budget for bodies held had no room for what the worker sent within
    /// the idle timeout (many clients reading slowly, or an event larger than the budget).
    OverBudget,
    /// The worker sent an event over the router's limit ([`MAX_EVENT_BYTES`]; `echo` and
    /// logprobs of a long prompt make one): as a non-streamed answer over
    /// `max_upstream_body_bytes`, neither counted towards the worker's ejection nor tried
    /// elsewhere, where it would be generated again and fail the same way.
    EventTooLarge,
}

impl RelayEnd {
    /// Every way a relay ends (its metric's series exist from the start, at 0: a series
    /// born at 1 is not an `increase()` to Prometheus, and one burst of a kind never seen
    /// before raised no alert).
    pub(super) const ALL: [RelayEnd; 9] = [
        RelayEnd::Done,
        RelayEnd::ClientGone,
        RelayEnd::ClientStalled,
        RelayEnd::WorkerStalled,
        RelayEnd::NoFirstFrame,
        RelayEnd::WorkerFailed,
        RelayEnd::Truncated,
        RelayEnd::OverBudget,
        RelayEnd::EventTooLarge,
    ];

    pub(super) fn label(self) -> &'static str {
        match self {
            RelayEnd::Done => "done",
            RelayEnd::ClientGone => "client_gone",
            RelayEnd::ClientStalled => "client_stalled",
            RelayEnd::WorkerStalled => "worker_stalled",
            RelayEnd::NoFirstFrame => "no_first_frame",
            RelayEnd::WorkerFailed => "worker_failed",
            RelayEnd::Truncated => "truncated",
            RelayEnd::OverBudget => "over_budget",
            RelayEnd::EventTooLarge => "event_too_large",
        }
    }
}

impl Relay {
    /// Grows `held` to cover `bytes` ([`make_room`]); how long that took, by which the
    /// worker's deadlines move.
    async fn room(&mut self, bytes: usize, deadline: Instant) -> Result<Duration, RelayEnd> {
        let from = Instant::now();
        loop {
            // The client's headers go at `open_by`, however long the wait for room (the wait
            // goes on after them; it is cancel-safe).
            let holding = self.opening.is_some();
            tokio::select! {
                room = make_room(&self.tx, &self.bodies, &mut self.held, bytes, deadline) => {
                    room?;
                    return Ok(from.elapsed());
                }
                () = tokio::time::sleep_until(self.open_by), if holding => self.open(),
            }
        }
    }

    /// Answers the client: its headers go, with what follows.
    fn open(&mut self) {
        self.open_with(false);
    }

    /// Answers the client, `refused` if with an error event.
    fn open_with(&mut self, refused: bool) {
        if let Some(opening) = self.opening.take() {
            let _ = opening.send(Ok(refused));
        }
    }

    async fn run(mut self) {
        let end = self.pump().await;
        if matches!(end, RelayEnd::NoFirstFrame | RelayEnd::WorkerStalled)
            // Before its first token, a worker whose stream breaks fails as a dead engine
            // does.
            || (!self.tokens && matches!(end, RelayEnd::WorkerFailed | RelayEnd::Truncated))
        {
            self.reach.failed();
        }
        let failed = matches!(
            end,
            RelayEnd::WorkerStalled
                | RelayEnd::WorkerFailed
                | RelayEnd::NoFirstFrame
                | RelayEnd::Truncated
                | RelayEnd::OverBudget
                | RelayEnd::EventTooLarge
        );
        // The client has seen nothing of a stream that failed unopened: the handler tries
        // another worker (or, out of budget, answers with a status), and the answer's time is
        // that attempt's, not this one's.
        let handed_back = failed && self.opening.is_some();
        if handed_back && let Some(opening) = self.opening.take() {
            let unopened = Unopened {
                end,
                message: self.end_message(end),
                inflight: self.inflight.take(),
            };
            let _ = opening.send(Err(unopened));
        } else if failed {
            let err = ApiError::unavailable(self.end_message(end));
            // A client that reads gets it, behind what it has not read yet; one that has not
            // read for a while does not hold the relay longer than this. Outside the
            // budget: a few hundred bytes, to say why the stream ends.
            let event = (error_events(&err), Reservation::default());
            let wait = self.idle.min(ERROR_EVENT_WAIT);
            if let Ok(Ok(())) = tokio::time::timeout(wait, self.tx.send(event)).await {
                self.ending.complete();
            }
        } else if end == RelayEnd::Done {
            self.ending.complete();
        }
        metrics::counter!("kvroute_relay_ended_total", "how" => end.label()).increment(1);
        if !handed_back {
            metrics::histogram!("kvroute_e2e_seconds", "worker" => self.worker.clone())
                .record(self.started.elapsed().as_secs_f64());
        }
        drop(self.inflight.take());
    }

    /// Why the stream ended, for its client.
    fn end_message(&self, end: RelayEnd) -> String {
        match end {
            RelayEnd::EventTooLarge => format!(
                "worker {} sent a server-sent event over the router's limit of {MAX_EVENT_BYTES} bytes",
                self.worker
            ),
            RelayEnd::OverBudget => format!(
                "the router's budget of {} bytes for bodies held had no room for the stream within {} ms",
                self.bodies.bytes(),
                self.idle.as_millis()
            ),
            RelayEnd::WorkerStalled => format!(
                "worker {} sent no token for {} ms mid-stream",
                self.worker,
                self.idle.as_millis()
            ),
            RelayEnd::NoFirstFrame => format!(
                "worker {} sent no token within {} ms",
                self.worker,
                self.first_frame.as_millis()
            ),
            RelayEnd::WorkerFailed if let Some(error) = &self.worker_error => format!(
                "worker {} failed before the first token: {error}",
                self.worker
            ),
            RelayEnd::Truncated | RelayEnd::WorkerFailed if !self.tokens => format!(
                "worker {} broke off its stream before the first token",
                self.worker
            ),
            RelayEnd::Truncated => {
                format!("worker {} ended the stream before [DONE]", self.worker)
            }
            _ => format!("worker {} failed mid-stream", self.worker),
        }
    }

    async fn pump(&mut self) -> RelayEnd {
        let mut first = true;
        // The stream opened with an error event: no event is a token.
        let mut refused = false;
        let mut last = self.started;
        // The first token is due by then, `first_frame` after the headers (the relay starts
        // once they came; a prompt's media was fetched before them), whatever arrives before
        // it: keep-alive comments from a proxy in front of the worker do not push it back.
        let mut first_by = Instant::now() + self.first_frame;
        // `[DONE]` was relayed: the answer is whole, only the body's end is awaited, until
        // then at the latest (a worker or a proxy that keeps sending after it does not hold
        // the stream, its booking and its slot).
        let mut done_by: Option<Instant> = None;
        // Mid-stream silence is the worker's from here: the last token was relayed then (the
        // relay reads nothing from the worker while a slow client makes it wait).
        let mut quiet_from = Instant::now();
        loop {
            if self.opening.is_some() && Instant::now() >= self.open_by {
                // Whatever kept the relay from its frame timeout (waits for room, a proxy's
                // comments), the client has waited long enough for its headers.
                self.open();
            }
            let done = done_by.is_some();
            // The worker's deadline.
            let due = match done_by {
                Some(by) => by,
                None if first => first_by,
                // The next token: comments in between do not make a stalled worker live.
                None => quiet_from + self.idle,
            };
            let wait = match self.opening {
                Some(_) => due.min(self.open_by),
                None => due,
            };
            // A client that leaves is noticed at once, not at the next frame: before the
            // first one that can be the whole prefill and the engine's queue, during which
            // the booking, the in-flight slot and the engine's work would stay taken.
            // Dropping the worker's body then closes its connection, and the engine aborts.
            let next = tokio::select! {
                biased;
                () = self.tx.closed() => return RelayEnd::ClientGone,
                next = tokio::time::timeout_at(wait, self.upstream.frame()) => next,
            };
            let frame = match next {
                // The client waited long enough for its headers; the worker still has until
                // its deadline.
                Err(_) if Instant::now() < due => {
                    self.open();
                    continue;
                }
                // A worker (or a proxy before it) that keeps the body open after `[DONE]`
                // holds nothing longer: the client has its whole answer.
                Err(_) | Ok(Some(Err(_))) if done => return RelayEnd::Done,
                Err(_) if first => return RelayEnd::NoFirstFrame,
                Err(_) => return RelayEnd::WorkerStalled,
                Ok(None) if done => return RelayEnd::Done,
                Ok(None) => {
                    // Whatever whole lines the worker left unterminated go, with their
                    // share; before the client is answered, only if they hold data, and an
                    // error there is the worker failing, as in a whole event.
                    let rest = ended(self.events.finish());
                    let whole = holds_done(&rest);
                    let share = self.held.split_off(0);
                    if carries_data(&rest) {
                        if self.opening.is_some()
                            && let Some(error) = worker_error(&rest)
                        {
                            tracing::warn!(worker = %self.worker, %error, "worker failed in its stream before the first token");
                            self.worker_error = Some(error);
                            return RelayEnd::WorkerFailed;
                        }
                        self.tokens = true;
                        self.open();
                    }
                    if !rest.is_empty()
                        && self.opening.is_none()
                        && let Err(end) =
                            send_event(&self.tx, rest, share, Instant::now() + self.idle).await
                    {
                        return end;
                    }
                    return if whole {
                        RelayEnd::Done
                    } else {
                        RelayEnd::Truncated
                    };
                }
                Ok(Some(Err(e))) => {
                    tracing::warn!(worker = %self.worker, error = %e, "worker failed mid-stream");
                    return RelayEnd::WorkerFailed;
                }
                Ok(Some(Ok(frame))) => frame,
            };
            let Ok(data) = frame.into_data() else {
                continue;
            };
            if done {
                continue; // nothing follows `[DONE]`
            }
            // Before the client has its headers, a read of whole events without data (a
            // proxy's `: keep-alive`) is dropped below once it has room; it is dropped here
            // instead, without asking the budget for room that nothing keeps: a budget full
            // for the idle timeout would otherwise end the held stream with a 429.
            if self.opening.is_some()
                && self.events.held() == 0
                && event_end(&data) == Some(data.len())
                && !carries_data(&data)
            {
                continue;
            }
            // The bytes read count against the budget before they are kept: the relay waits
            // for room (a slow client's events still to be taken, other streams' and bodies')
            // within the idle timeout, for the event and its send together.
            // The wait is the router's: the worker's deadlines move by it.
            let deadline = Instant::now() + self.idle;
            let waited = match self.room(self.events.held() + data.len(), deadline).await {
                Ok(waited) => waited,
                Err(end) => return end,
            };
            (quiet_from, first_by) = (quiet_from + waited, first_by + waited);
            let data = match self.events.push(data) {
                Ok(Some(events)) => events,
                Ok(None) => continue,
                Err(len) => {
                    tracing::warn!(worker = %self.worker, bytes = len, limit = MAX_EVENT_BYTES, "worker sent an event over the router's limit");
                    return RelayEnd::EventTooLarge;
                }
            };
            // Comments alone (`: keep-alive`) are relayed but are no token.
            let token = carries_data(&data);
            if !token && self.opening.is_some() {
                // The client has no headers yet: nothing of its connection to keep alive.
                drop(self.held.split_off(self.events.held()));
                continue;
            }
            // An error in the stream before anything reached the client is the worker
            // failing (vLLM's stream generator catching an exception, an engine that
            // dropped the request): tried elsewhere, as a failed connection is, not relayed
            // as the answer and counted as its first token. The client's own errors are
            // relayed (another worker would say the same).
            if token
                && self.opening.is_some()
                && let Some(error) = worker_error(&data)
            {
                tracing::warn!(worker = %self.worker, %error, "worker failed in its stream before the first token");
                self.worker_error = Some(error);
                return RelayEnd::WorkerFailed;
            }
            // An error event first (the client's, relayed; or one past the wait for the
            // first token) is no first token: the engine computed no prompt to be found
            // cached, and it says nothing of the worker's latency.
            // Nor is anything after it (the `[DONE]` that follows it, a separate event).
            if token && first && error_first(&data) {
                self.open_with(true);
                self.tokens = true;
                first = false;
                refused = true;
            } else if token && !refused {
                self.open();
                let now = Instant::now();
                let (histogram, since) = if first {
                    (&self.ttft, self.started)
                } else {
                    (&self.itl, last)
                };
                histogram.record(now.duration_since(since).as_secs_f64());
                last = now;
                if first {
                    first = false;
                    self.tokens = true;
                    self.booking.first_token();
                    self.reach.answered();
                }
            }
            if holds_done(&data) {
                done_by = Some(Instant::now() + self.idle.min(DONE_GRACE));
            }
            // Each send takes at least its own bytes' share, rounded up to grains (what the
            // held-back rest leaves of the rounded whole can be less), and the rest keeps its.
            let bytes = data.len().next_multiple_of(GRAIN) + self.events.held();
            let waited = match self.room(bytes, deadline).await {
                Ok(waited) => waited,
                Err(end) => return end,
            };
            (quiet_from, first_by) = (quiet_from + waited, first_by + waited);
            let share = self.held.split_off(self.events.held());
            // The wait for the client to take it is the client's: the worker's deadlines
            // move by it, as by the waits for room (a token's resets them anyway).
            let sending = Instant::now();
            if let Err(end) = send_event(&self.tx, data, share, deadline).await {
                return end;
            }
            let waited = sending.elapsed();
            (quiet_from, first_by) = (quiet_from + waited, first_by + waited);
            if token {
                quiet_from = Instant::now();
            }
        }
    }
}

/// The events that end a stream with `err`: the error, then `[DONE]` (what OpenAI's clients
/// read as an answer that failed).
pub(super) fn error_events(err: &ApiError) -> Bytes {
    Bytes::from(format!("data: {}\n\ndata: [DONE]\n\n", err.openai_body()))
}

/// How long a relay that failed waits for room to send its client the error event: a full
/// channel is a client behind by [`CLIENT_EVENTS`] events, and the stream must not end
/// without saying why.
const ERROR_EVENT_WAIT: Duration = Duration::from_secs(1);

/// How long the relay waits for a worker's body to end once `[DONE]` has been relayed.
const DONE_GRACE: Duration = Duration::from_secs(1);

/// Whether whole server-sent events hold a `data` field with a value (a token, an error, or
/// `[DONE]`), not only comments (lines starting `:`), other fields, or empty `data:` pings.
fn carries_data(events: &[u8]) -> bool {
    events.split(|&b| b == b'\n').any(|line| {
        line.strip_prefix(b"data:")
            .is_some_and(|value| !value.trim_ascii().is_empty())
    })
}

/// The message of a server-side error event among whole server-sent events, if one is
/// there: a `data` value that is an object with an `error` (OpenAI's, SGLang's and recent
/// vLLM's shape, `{"error": {"message", "type", "code"}}`) or that is one (older vLLM's
/// `{"object": "error", …}`). An error whose `code` is a 4xx status, or whose `type` is
/// `invalid_request_error` (OpenAI's) or `BadRequestError` (vLLM's), is the client's: `None`.
fn worker_error(events: &[u8]) -> Option<String> {
    stream_errors(events)
        .find(|e| !e.clients)
        .map(|e| e.message)
}

/// An error event in a stream.
struct StreamError {
    message: String,
    /// The client's error (a 4xx `code`, or an `invalid_request_error` or `BadRequestError`
    /// `type`), which another worker would repeat.
    clients: bool,
}

/// Whether the first of whole server-sent events that carries data is an error (in any of
/// the shapes [`worker_error`] reads), the client's or the worker's.
fn error_first(events: &[u8]) -> bool {
    let mut rest = events;
    while !rest.is_empty() {
        let end = (1..rest.len())
            .find(|&i| ends_blank_line(rest, i))
            .map_or(rest.len(), |i| i + 1);
        let (event, after) = rest.split_at(end);
        if carries_data(event) {
            return stream_errors(event).next().is_some();
        }
        rest = after;
    }
    false
}

/// The error events among whole server-sent events, in order, in any of the shapes
/// [`worker_error`] reads.
fn stream_errors(events: &[u8]) -> impl Iterator<Item = StreamError> + '_ {
    events.split(|&b| b == b'\n').filter_map(|line| {
        let value = line.strip_prefix(b"data:")?.trim_ascii();
        if !value.starts_with(b"{") {
            return None;
        }
        let v: serde_json::Value = serde_json::from_slice(value).ok()?;
        let error = match v.get("error") {
            Some(e @ serde_json::Value::Object(_)) => e,
            Some(serde_json::Value::String(message)) => {
                return Some(StreamError {
                    message: message.clone(),
                    clients: false,
                });
            }
            _ if v.get("object").and_then(|o| o.as_str()) == Some("error") => &v,
            _ => return None,
        };
        let code = match error.get("code") {
            Some(serde_json::Value::Number(n)) => n.as_u64(),
            Some(serde_json::Value::String(s)) => s.parse().ok(),
            _ => None,
        };
        let kind = error.get("type").and_then(|t| t.as_str()).unwrap_or("");
        let clients = code.is_some_and(|c| (400..500).contains(&c))
            || matches!(kind, "invalid_request_error" | "BadRequestError");
        let message = error
            .get("message")
            .and_then(|m| m.as_str())
            .unwrap_or("an error event")
            .to_owned();
        Some(StreamError { message, clients })
    })
}

/// Whether server-sent events hold OpenAI's stream terminator, `data: [DONE]`, as an event
/// of its own (a proxy may send comments after it in the same chunk).
fn holds_done(events: &[u8]) -> bool {
    events.split(|&b| b == b'\n').any(|line| {
        let line = line.trim_ascii_end();
        line == b"data: [DONE]" || line == b"data:[DONE]"
    })
}

/// A non-streamed answer longer than this is checked as JSON on a blocking thread.
const BLOCKING_CHECK_BYTES: usize = 1 << 20;

/// Why `bytes` is not one JSON value, if it is not; over [`BLOCKING_CHECK_BYTES`], found
/// on a blocking thread.
async fn not_json(bytes: &Bytes) -> Option<String> {
    fn check(bytes: &[u8]) -> Option<String> {
        serde_json::from_slice::<serde::de::IgnoredAny>(bytes)
            .err()
            .map(|e| e.to_string())
    }
    if bytes.len() <= BLOCKING_CHECK_BYTES {
        return check(bytes);
    }
    let whole = bytes.clone();
    tokio::task::spawn_blocking(move || check(&whole))
        .await
        .unwrap_or_else(|e| Some(format!("the check failed: {e}")))
}

/// Largest server-sent event held back for its end, bytes.
const MAX_EVENT_BYTES: usize = 8 << 20;

/// Cuts a worker's stream at server-sent event boundaries (a blank line), so that a client
/// never gets half an event: an error event sent after a worker failed mid-event would
/// otherwise be glued to it, and the client would read neither. Bytes after the last
/// boundary wait for the rest of their event. No I/O.
#[derive(Debug, Default)]
struct SseEvents {
    partial: bytes::BytesMut,
}

impl SseEvents {
    /// The whole events this data completes (`None`: still inside one), or the held
    /// length if an event grew past [`MAX_EVENT_BYTES`].
    fn push(&mut self, data: Bytes) -> Result<Option<Bytes>, usize> {
        if self.partial.is_empty() && event_end(&data) == Some(data.len()) {
            // A copy: `data` is a slice of the worker connection's read buffer, which hyper
            // allocates afresh (8 KiB or more) while a slice of the last one lives, so each
            // event a slow client had yet to take kept one alive, counted as its own bytes.
            return Ok(Some(Bytes::copy_from_slice(&data)));
        }
        // What is held has no blank line (it would have been sent): only the new bytes,
        // and the 3 before them a blank line may start in, are looked through. Scanning
        // all of it again per frame would be quadratic in an event's length.
        let from = self.partial.len().saturating_sub(3);
        self.partial.extend_from_slice(&data);
        match event_end(&self.partial[from..]).map(|end| from + end) {
            Some(end) => {
                // Copied out, and what follows kept in a buffer of its own size: a frozen
                // split shares the buffer, which then stayed as large as a long event had
                // grown it (MiBs, with `echo` and logprobs) for the rest of the stream,
                // uncounted by the body budget, which counts the bytes held.
                let events = Bytes::copy_from_slice(&self.partial[..end]);
                self.partial = bytes::BytesMut::from(&self.partial[end..]);
                Ok(Some(events))
            }
            None if self.partial.len() > MAX_EVENT_BYTES => Err(self.partial.len()),
            None => Ok(None),
        }
    }

    /// Bytes held back for their event's end.
    fn held(&self) -> usize {
        self.partial.len()
    }

    /// What is held back (the stream ended).
    fn finish(&mut self) -> Bytes {
        self.partial.split().freeze()
    }
}

/// Just past the last blank line in `b` (`\n\n`, `\r\n\r\n` or `\n\r\n`): where the
/// whole server-sent events in `b` end (the relay, and `kvroute-bench online`, cut streams
/// so).
pub fn event_end(b: &[u8]) -> Option<usize> {
    (1..b.len())
        .rev()
        .find(|&i| ends_blank_line(b, i))
        .map(|i| i + 1)
}

/// Whether `b[i]` is the line feed that ends a blank line (`\n\n`, `\n\r\n`; so also
/// `\r\n\r\n`): the end of a server-sent event. `i` is at least 1.
fn ends_blank_line(b: &[u8], i: usize) -> bool {
    b[i] == b'\n' && (b[i - 1] == b'\n' || (i >= 2 && &b[i - 2..i] == b"\n\r"))
}

/// What a stream cut inside an event leaves to relay: its complete lines, ended as an
/// event (a client drops an unfinished one, `[DONE]` included). A line cut short is
/// dropped, unless it is `[DONE]`: glued to the error event sent after it, it would garble
/// both.
fn ended(rest: Bytes) -> Bytes {
    let cut = rest.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    let (keep, end): (usize, &[u8]) = if holds_done(&rest[cut..]) {
        (rest.len(), b"\n\n")
    } else {
        (cut, b"\n")
    };
    if keep == 0 {
        return Bytes::new();
    }
    let mut event = rest[..keep].to_vec();
    event.extend_from_slice(end);
    Bytes::from(event)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The steps `Relay::pump` takes for the bytes it reads (room for what is read, room for
    /// the whole events' own shares, the split, the send) leave every event sent with at
    /// least its own bytes' share of the bodies' budget, even where a read ends inside an
    /// event, and the held-back rest with its own; the share goes when the client takes
    /// the event, and a client that stops reading makes the relay wait for room and end
    /// over budget past its deadline.
    #[tokio::test(start_paused = true)]
    async fn relayed_events_hold_their_share_until_the_client_takes_them() {
        use futures_util::StreamExt;
        let bodies = BodyBudget::new(3 * GRAIN);
        let soon = || Instant::now() + Duration::from_secs(1);
        let (tx, rx) = mpsc::channel::<Held>(CLIENT_EVENTS);
        let mut held = Reservation::default();
        let mut events = SseEvents::default();
        // Reads of 300 bytes that end in the middle of 300-byte events: 150 held back.
        let event = |c: u8| {
            let mut e = vec![c; 298];
            e.extend_from_slice(b"\n\n");
            Bytes::from(e)
        };
        let a = event(b'a');
        let b = event(b'b');
        let reads = [a.slice(..150), Bytes::from([&a[150..], &b[..150]].concat())];
        for read in reads {
            make_room(&tx, &bodies, &mut held, events.held() + read.len(), soon())
                .await
                .unwrap();
            let Some(whole) = events.push(read).unwrap() else {
                assert_eq!(held.bytes(), GRAIN);
                continue;
            };
            let bytes = whole.len().next_multiple_of(GRAIN) + events.held();
            make_room(&tx, &bodies, &mut held, bytes, soon())
                .await
                .unwrap();
            let share = held.split_off(events.held());
            assert_eq!(
                (share.bytes(), held.bytes()),
                (GRAIN, GRAIN),
                "the event and the rest"
            );
            send_event(&tx, whole, share, soon()).await.unwrap();
        }
        assert_eq!(
            bodies.in_use(),
            2 * GRAIN,
            "one event on its way, half of one held back"
        );
        // A client that reads nothing: one more grain, then no room.
        let mut more = Reservation::default();
        make_room(&tx, &bodies, &mut more, 1, soon()).await.unwrap();
        assert_eq!(
            make_room(&tx, &bodies, &mut held, 2 * GRAIN, soon()).await,
            Err(RelayEnd::OverBudget)
        );
        assert_eq!(held.bytes(), GRAIN, "a failed wait leaves what was held");
        let body =
            crate::http::streamed(rx, crate::http::Ending::default(), |(bytes, _held)| bytes);
        let mut body = Box::pin(body.into_data_stream());
        assert_eq!(body.next().await.unwrap().unwrap(), a);
        assert_eq!(
            bodies.in_use(),
            2 * GRAIN,
            "the event taken left the budget"
        );
        drop((body, held, more));
        assert_eq!(bodies.in_use(), 0);
    }

    /// A client that leaves while its relay waits for room ends the wait at once, not at
    /// the wait's deadline (an over-budget end).
    #[tokio::test(start_paused = true)]
    async fn a_client_leaving_ends_the_wait_for_room() {
        let bodies = BodyBudget::new(GRAIN);
        let hog = bodies.reserve(GRAIN, Duration::ZERO).await.unwrap();
        let (tx, rx) = mpsc::channel::<Held>(CLIENT_EVENTS);
        let waiting = tokio::spawn({
            let bodies = bodies.clone();
            async move {
                let mut held = Reservation::default();
                let deadline = Instant::now() + Duration::from_secs(30);
                make_room(&tx, &bodies, &mut held, 1, deadline).await
            }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!waiting.is_finished(), "no room yet");
        drop(rx);
        assert_eq!(waiting.await.unwrap(), Err(RelayEnd::ClientGone));
        drop(hog);
    }

    /// A client that stops reading holds its relay no longer than the send's deadline: with
    /// its channel full, the next event's send gives up then (the relay ends the stream as
    /// `client_stalled`), and the event's share of the bodies' budget goes back with it. A
    /// client that takes an event in time lets the send through.
    #[tokio::test(start_paused = true)]
    async fn a_client_that_stops_reading_stalls_its_relay_at_the_deadline() {
        let bodies = BodyBudget::new(2 * CLIENT_EVENTS * GRAIN);
        let (tx, mut rx) = mpsc::channel::<Held>(CLIENT_EVENTS);
        let event = || Bytes::from_static(b"data: {}\n\n");
        async fn share(bodies: &BodyBudget) -> Reservation {
            bodies.reserve(GRAIN, Duration::ZERO).await.expect("room")
        }
        let far = Instant::now() + Duration::from_secs(3600);
        for _ in 0..CLIENT_EVENTS {
            send_event(&tx, event(), share(&bodies).await, far)
                .await
                .unwrap();
        }
        let start = Instant::now();
        let idle = Duration::from_secs(30);
        let sent = tokio::time::timeout_at(
            far,
            send_event(&tx, event(), share(&bodies).await, start + idle),
        )
        .await
        .expect("the send waited past its deadline");
        assert_eq!(sent, Err(RelayEnd::ClientStalled));
        assert_eq!(Instant::now(), start + idle, "it gave up at its deadline");
        assert_eq!(
            bodies.in_use(),
            CLIENT_EVENTS * GRAIN,
            "the stalled event's share stayed taken"
        );
        // A client that reads one event in time makes room for the next.
        let reader = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let taken = rx.recv().await;
            (taken.is_some(), rx)
        });
        let sent = send_event(&tx, event(), share(&bodies).await, Instant::now() + idle).await;
        assert_eq!(sent, Ok(()));
        let (taken, rx) = reader.await.unwrap();
        assert!(taken);
        drop(rx);
        assert_eq!(
            send_event(&tx, event(), share(&bodies).await, Instant::now() + idle).await,
            Err(RelayEnd::ClientGone)
        );
    }

    /// An error body that breaks or stalls is judged by the status it followed: after a 503
    /// the worker is broken (counted towards its ejection, tried elsewhere), after a 400 the
    /// request is (neither). Taken for an answer, a 503 with a broken body reset the
    /// worker's failures, and a client's 400 was tried on other workers.
    #[test]
    fn a_broken_error_body_is_judged_by_its_status() {
        let body = |status| ProxyError::Body {
            worker: WorkerId(1),
            status,
            source: BodyError::TimedOut { ms: 10 },
        };
        let unavailable = body(StatusCode::SERVICE_UNAVAILABLE);
        assert!(unavailable.worker_broken() && unavailable.retry_elsewhere());
        let refused = body(StatusCode::BAD_REQUEST);
        assert!(!refused.worker_broken() && !refused.retry_elsewhere());
        // The client is told the worker's refusal, as its own fault; the 503, the worker's.
        assert_eq!(refused.fault(), Fault::Client);
        assert_eq!(refused.to_api().status, 400);
        assert_eq!(unavailable.fault(), Fault::Worker);
        assert_eq!(unavailable.to_api().status, 504);
    }

    /// The worker's message is found in every shape engines answer errors in; only a body
    /// in OpenAI's shape goes to the client as it came.
    #[test]
    fn worker_error_messages_are_read_in_each_shape() {
        for (body, kept) in [
            (
                &br#"{"error":{"message":"too long","type":"BadRequestError"}}"#[..],
                true,
            ),
            (
                br#"{"object":"error","message":"too long","type":"BadRequestError","code":400}"#,
                false,
            ),
            (br#"{"detail":"too long"}"#, false),
            (b"too long", false),
        ] {
            let (message, as_it_came) = error_parts(body.to_vec());
            let shown = String::from_utf8_lossy(body);
            assert_eq!(message, "too long", "{shown}");
            assert_eq!(as_it_came.is_some(), kept, "{shown}");
        }
    }

    /// `[DONE]` is found as an event of its own wherever it is among the events, not only
    /// at their end; data is told from comments.
    #[test]
    fn done_and_data_are_found_among_the_events() {
        assert!(holds_done(b"data: {}\n\ndata: [DONE]\n\n"));
        assert!(holds_done(b"data:[DONE]\r\n\r\n: keep-alive\n\n"));
        assert!(!holds_done(b"data: {\"text\":\"data: [DONE]\"}\n\n"));
        assert!(!holds_done(b": data: [DONE]\n\n"));
        assert!(carries_data(b": keep-alive\n\ndata: {}\n\n"));
        assert!(!carries_data(b"data\n\ndata: \r\n\r\n"));
        assert!(!carries_data(b": keep-alive\n\n: ping\n\n"));
        assert!(!carries_data(b"event: ping\n\n"));
    }

    /// A worker's own error in its stream is told from the client's, in OpenAI's, SGLang's
    /// and both of vLLM's shapes; tokens, comments and `[DONE]` are no error.
    #[test]
    fn a_worker_s_error_event_is_told_from_the_client_s() {
        let vllm = br#"data: {"error":{"message":"engine died","type":"InternalServerError","param":null,"code":500}}"#;
        assert_eq!(worker_error(vllm).as_deref(), Some("engine died"));
        let older = b"data: {\"object\":\"error\",\"message\":\"oom\",\"type\":\"InternalServerError\",\"code\":500}\n\n";
        assert_eq!(worker_error(older).as_deref(), Some("oom"));
        let openai = b"data: {\"error\":{\"message\":\"cut off\",\"type\":\"server_error\",\"code\":null}}\n\ndata: [DONE]\n\n";
        assert_eq!(worker_error(openai).as_deref(), Some("cut off"));
        for client in [
            &br#"data: {"error":{"message":"too long","type":"BadRequestError","code":400}}"#[..],
            br#"data: {"error":{"message":"bad","type":"invalid_request_error","code":null}}"#,
            br#"data: {"error":{"message":"bad","type":"x","code":"422"}}"#,
        ] {
            assert_eq!(worker_error(client), None);
            // Still an error event: no first token.
            assert!(stream_errors(client).next().is_some_and(|e| e.clients));
            assert!(error_first(client));
        }
        assert!(stream_errors(vllm).next().is_some_and(|e| !e.clients));
        // A worker's error after a client's in the same read is still found; an error after
        // a token is not the first event.
        let both = [
            &br#"data: {"error":{"message":"bad","type":"x","code":400}}"#[..],
            b"\n\n",
            vllm,
        ]
        .concat();
        assert_eq!(worker_error(&both).as_deref(), Some("engine died"));
        let after_token = [&b": ping\n\ndata: {\"choices\":[]}\n\n"[..], vllm].concat();
        assert!(!error_first(&after_token));
        for not_error in [
            &b"data: {\"choices\":[{\"text\":\"error\"}]}\n\n"[..],
            b"data: [DONE]\n\n",
            b": {\"error\":\"comment\"}\n\n",
        ] {
            assert_eq!(worker_error(not_error), None);
            assert!(stream_errors(not_error).next().is_none());
            assert!(!error_first(not_error));
        }
    }

    /// A stream cut inside an event: its whole lines go as an event ended there, a line
    /// cut short is dropped (the error event after it stays readable), `[DONE]` is kept.
    #[test]
    fn a_stream_cut_inside_an_event_leaves_only_whole_lines() {
        let cases: [(&[u8], &[u8]); 6] = [
            (b"", b""),
            (b"data: {\"choi", b""),
            (b"data: {\"a\":1}\n", b"data: {\"a\":1}\n\n"),
            (b"data: {\"a\":1}\r\n", b"data: {\"a\":1}\r\n\n"),
            (b": ping\ndata: {\"b", b": ping\n\n"),
            (b"data: [DONE]", b"data: [DONE]\n\n"),
        ];
        for (rest, relayed) in cases {
            let got = ended(Bytes::from_static(rest));
            assert_eq!(got, Bytes::from_static(relayed), "{rest:?}");
            if !got.is_empty() {
                assert_eq!(
                    event_end(&got),
                    Some(got.len()),
                    "{got:?} is no whole event"
                );
            }
        }
        assert_eq!(event_end(b"data: 1\n\r\n"), Some(10));
        assert_eq!(event_end(b"data: 1\r\n\r\n"), Some(11));
        assert_eq!(event_end(b"data: 1\r\n"), None);
    }

    /// An event relayed as it came is copied out of the buffer it was read into: kept while
    /// a slow client takes its time, a slice would keep the worker connection's whole read
    /// buffer (hyper's, 8 KiB or more, allocated afresh for the next read) alive.
    #[test]
    fn a_whole_event_is_copied_out_of_the_read_buffer() {
        let mut read = bytes::BytesMut::with_capacity(8192);
        let base = read.as_ptr() as usize;
        read.extend_from_slice(b"data: {\"a\":1}\n\n");
        let frame = read.split().freeze();
        let out = SseEvents::default().push(frame.clone()).unwrap().unwrap();
        assert_eq!(out, frame);
        let at = out.as_ptr() as usize;
        assert!(
            !(base..base + 8192).contains(&at),
            "the event still points into the read buffer"
        );
    }

    /// Answers are checked as JSON, small ones in place and large ones on a blocking
    /// thread, with the same verdicts.
    #[tokio::test]
    async fn answers_small_and_large_are_checked_as_json() {
        let large = |body: &str| {
            let mut v = b"[".to_vec();
            while v.len() <= BLOCKING_CHECK_BYTES {
                v.extend_from_slice(b"0,");
            }
            v.extend_from_slice(body.as_bytes());
            Bytes::from(v)
        };
        for (bytes, json) in [
            (Bytes::from_static(b"{\"a\":1}"), true),
            (Bytes::from_static(b"<html>"), false),
            (large("0]"), true),
            (large("0"), false),
        ] {
            assert_eq!(
                not_json(&bytes).await.is_none(),
                json,
                "{} bytes",
                bytes.len()
            );
        }
    }

    /// The buffer a long event grew is not kept for the events after it: the events were
    /// split off it frozen, so what followed them shared it (MiBs for the rest of a stream,
    /// uncounted by the body budget, which counts the bytes held).
    #[test]
    fn a_long_event_s_buffer_goes_with_it() {
        let mut e = SseEvents::default();
        for _ in 0..16 {
            assert_eq!(e.push(Bytes::from(vec![b'x'; 64 << 10])), Ok(None));
        }
        let long = e
            .push(Bytes::from_static(b"\n\ndata: {\"a"))
            .unwrap()
            .unwrap();
        assert_eq!(long.len(), (16 << 16) + 2);
        drop(long);
        assert!(e.partial.capacity() < 64 << 10, "{}", e.partial.capacity());
        assert_eq!(
            e.push(Bytes::from_static(b"\":1}\n\n")),
            Ok(Some(Bytes::from_static(b"data: {\"a\":1}\n\n")))
        );
    }

    /// Events cut anywhere reach the client whole; an unterminated event waits, and what
    /// is left at the end is handed back as it is (for [`ended`]).
    #[test]
    fn sse_bytes_are_forwarded_in_whole_events() {
        let mut e = SseEvents::default();
        let whole = Bytes::from_static(b"data: {\"a\":1}\n\n");
        assert_eq!(e.push(whole.clone()), Ok(Some(whole)));
        assert_eq!(e.push(Bytes::from_static(b"data: {\"b\"")), Ok(None));
        assert_eq!(
            e.push(Bytes::from_static(b":2}\n\ndata: {\"c")),
            Ok(Some(Bytes::from_static(b"data: {\"b\":2}\n\n")))
        );
        assert_eq!(e.push(Bytes::from_static(b"\":3}\r\n")), Ok(None));
        assert_eq!(
            e.push(Bytes::from_static(b"\r\n")),
            Ok(Some(Bytes::from_static(b"data: {\"c\":3}\r\n\r\n")))
        );
        // A long event in many frames, its blank line split across two of them: only the
        // new bytes (and 3 before them) are looked through each time.
        let mut long = Vec::new();
        for i in 0..1000 {
            let frame = format!("{}", i % 10).repeat(100);
            long.extend_from_slice(frame.as_bytes());
            assert_eq!(e.push(Bytes::from(frame)), Ok(None));
        }
        assert_eq!(e.push(Bytes::from_static(b"\n")), Ok(None));
        long.extend_from_slice(b"\n\n");
        assert_eq!(
            e.push(Bytes::from_static(b"\n")),
            Ok(Some(Bytes::from(long)))
        );
        assert_eq!(e.push(Bytes::from_static(b"data: [DO")), Ok(None));
        assert_eq!(e.finish(), Bytes::from_static(b"data: [DO"));
        assert!(
            e.push(Bytes::from(vec![b'x'; MAX_EVENT_BYTES + 1]))
                .is_err()
        );
    }

    fn info(api: WorkerApi, dp_size: u32) -> WorkerInfo {
        WorkerInfo {
            id: WorkerId(1),
            url: "http://10.0.0.1:8000/".into(),
            block_size: 16,
            g1_blocks: 1,
            g2_blocks: 0,
            model: "m".into(),
            dp_size,
            epoch: 1,
            last_event_ids: Vec::new(),
            api,
            adapters: Vec::new(),
            engine_load: None,
            event_faults: None,
            engine_rank_kv_usage: Vec::new(),
            learns_routes: false,
            left: false,
        }
    }

    /// What an outcome says of the worker's health: a body broken off after a success
    /// status counts towards its ejection (it counted as answered, so a worker resetting
    /// its connections mid-body was never ejected), and neither an answer over the router's
    /// own limits nor a relay lost to a router bug clears its failures.
    #[test]
    fn outcomes_say_what_they_know_of_the_worker() {
        let worker = WorkerId(1);
        let answer = |source| ProxyError::Answer { worker, source };
        let status = |status| ProxyError::Status {
            worker,
            status,
            message: String::new(),
            body: None,
        };
        let broke = answer(BodyError::Io(Box::new(std::io::Error::other("reset"))));
        assert_eq!(answered(Err(&broke), false), Some(false));
        assert_eq!(
            answered(Err(&answer(BodyError::OverBudget { budget: 1 })), false),
            None
        );
        assert_eq!(
            answered(Err(&answer(BodyError::TooLarge { limit: 1 })), false),
            None
        );
        assert_eq!(answered(Err(&ProxyError::RelayLost { worker }), true), None);
        assert_eq!(
            answered(Err(&status(StatusCode::SERVICE_UNAVAILABLE)), false),
            Some(false)
        );
        assert_eq!(
            answered(Err(&status(StatusCode::BAD_REQUEST)), false),
            Some(true),
            "a refusal of the request is an answer"
        );
        assert_eq!(answered(Ok(()), false), Some(true));
        assert_eq!(answered(Ok(()), true), None, "a stream's relay reports");
    }

    #[test]
    fn each_kind_of_worker_gets_its_own_request() {
        let up = Upstream {
            generate: Some(Bytes::from_static(b"{\"token_ids\":[1]}")),
            raw: Bytes::from_static(b"{\"prompt\":\"hi\"}"),
            chat: true,
            receipt: false,
            media: false,
            passed: vec![(
                header::HeaderName::from_static("x-request-id"),
                header::HeaderValue::from_static("req-7"),
            )],
        };
        let key = crate::auth::Secret::new("engine-secret");
        let r = up.request(&info(WorkerApi::Kvroute, 1), 0, Some(&key));
        assert_eq!(r.uri(), "http://10.0.0.1:8000/internal/generate");
        // A kvroute worker started with --api-key guards /internal/generate too.
        assert_eq!(r.headers()["authorization"], "Bearer engine-secret");
        let r = up.request(&info(WorkerApi::Kvroute, 1), 0, None);
        assert!(r.headers().get("authorization").is_none(), "no key set");
        // An engine gets the client's body on its own endpoint; a single rank, no pin; the
        // engine's key when one is set (never the client's).
        let r = up.request(&info(WorkerApi::Openai, 1), 0, Some(&key));
        assert_eq!(r.uri(), "http://10.0.0.1:8000/v1/chat/completions");
        assert_eq!(
            r.headers()["x-request-id"],
            "req-7",
            "the request's id goes along"
        );
        assert!(r.headers().get("x-data-parallel-rank").is_none());
        assert_eq!(r.headers()["authorization"], "Bearer engine-secret");
        // Several ranks behind one endpoint: the chosen one is pinned.
        let r = up.request(&info(WorkerApi::Openai, 4), 3, None);
        assert_eq!(r.headers()["x-data-parallel-rank"], "3");
        assert!(r.headers().get("authorization").is_none());
        let completion = Upstream { chat: false, ..up };
        assert_eq!(
            completion
                .request(&info(WorkerApi::Openai, 4), 0, None)
                .uri()
                .path(),
            "/v1/completions"
        );
    }
}
