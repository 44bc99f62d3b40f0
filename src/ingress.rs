//! The HTTP front door (hyper 1): OpenAI completions and chat completions, routed by KV
//! overlap and load among the workers serving the requested model, proxied to the chosen
//! worker's internal generate endpoint and relayed back as they stream; health, readiness,
//! models and metrics; and, on their own listener, the admin views.

pub mod admission;
mod batch;
pub mod openai;
pub mod proxy;
pub mod tokenizer;

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::{Method, Response, StatusCode, header};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, Semaphore, watch};
use tokio::time::Instant;

use crate::auth::{Secret, bearer_key, bearer_ok};
use crate::events::fleet::StreamKey;
use crate::events::load::LoadShare;
use crate::events::plane::{EventPlane, StreamStatus};
use crate::events::transport::Transport;
use crate::http::budget::{BodyBudget, Reservation, collect_within};
use crate::http::{
    BlockingError, Body, BodyError, HttpConfig, TOKENIZER_WAIT, run_blocking, serve_http,
};
use crate::protocol::{SeqHash, WorkerId, hash_blocks};
use crate::scheduler::mismatch::{MismatchAlarm, MismatchConfig};
use crate::scheduler::{self, RouteRequest, Scheduler, WorkerKey};
use admission::{Class, ClassHeaders, Entered, Refusal, Routable};
use openai::{ApiError, ChatRequest, CompletionRequest, Prompt};
use proxy::{Booking, ProxyError, forward};
use tokenizer::Tokenizer;

/// Settings of the HTTP front door.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct IngressConfig {
    /// Largest request body, bytes.
    pub max_body_bytes: usize,
    /// Bytes of request bodies held at once, all requests together (read, queued or being
    /// proxied), of non-streamed answers being relayed, and of streamed events on their way
    /// to their clients; a body or answer that would pass it gets 429, and a stream waits
    /// for room (ending with an error event past `relay_idle_timeout_ms`). The parsed
    /// prompt takes more again, uncounted, and so does an engine's copy of the body: a body
    /// of 4 M token ids (8 MiB) raised the peak memory of `kvroute up` (router and four
    /// workers in one process) by about 100 MB. A kvroute worker's generate body (the
    /// prompt's token ids as JSON) is counted. At least `max_body_bytes` and
    /// `max_upstream_body_bytes`.
    pub body_memory_bytes: usize,
    /// Requests accepted at once, queued or in flight, counted from when their body is in
    /// (bodies being read are bounded by `body_memory_bytes`); beyond it new ones get 429. What
    /// is routed is decided by the scheduler's work budgets (`scheduler.admission`); this
    /// bounds the router's own memory and connections.
    pub max_inflight: usize,
    /// Other workers tried when one fails before the client is answered (before its first
    /// byte; a stream, before its first token, for up to `worker_timeout_ms` after its
    /// headers).
    pub retries: usize,
    /// Retries, all requests together, as a percentage of requests ([`RetryBudget`]): when
    /// much of a fleet fails at once, a retry for every failure would multiply the load on
    /// what is left. Beyond it, a request gets its worker's error.
    pub retry_budget_percent: u32,
    /// Retries allowed a second beyond `retry_budget_percent` (and at most held up at once):
    /// a quiet fleet still retries.
    pub retry_budget_per_s: u32,
    /// How long connecting to a worker, and a stream's response headers, may take, ms (a
    /// non-streamed answer's headers come once it is generated: `upstream_body_timeout_ms`);
    /// also how long after them a stream's headers are held back from the client for its
    /// first token, so that a worker failing before it is retried elsewhere.
    pub worker_timeout_ms: u64,
    /// Longest silence mid-stream, ms: a worker that sends no token this long (comments do
    /// not count), or a client that reads nothing this long, ends the stream and frees its slot
    /// and booking.
    pub relay_idle_timeout_ms: u64,
    /// How long an idle connection to a worker is kept for the next request, ms: under the
    /// engines' own keep-alive ([`crate::http::ENGINE_POOL_IDLE_MS`], the default).
    pub worker_pool_idle_ms: u64,
    /// Deadline for a whole non-streamed worker answer, headers included (or an error
    /// body), ms: one for the request, shared by the workers it is retried on.
    pub upstream_body_timeout_ms: u64,
    /// Deadline for a stream's first chunk after its headers, ms: vLLM sends the headers at
    /// once and its first chunk after the prefill and its own queue, which may take longer
    /// than the silence allowed between chunks; a worker that sends nothing this long (hung
    /// after its headers) frees the stream and its booking.
    pub first_token_timeout_ms: u64,
    /// Largest non-streamed worker answer, bytes.
    pub max_upstream_body_bytes: usize,
    /// Longest prompt text the router tokenizes, bytes (a chat's as its template renders
    /// it). A Hugging Face tokenizer peaks at 150 to 350 times the text it is given, so the
    /// default of 1 MiB (about 250 k tokens of prose) costs at most about 350 MiB a
    /// tokenizer thread. A longer prompt is routed on load alone (an engine is sent the
    /// request as it came; a kvroute worker, which needs the router's tokens, answers 413),
    /// and counted in `kvroute_prompts_untokenized_total`.
    pub max_tokenize_bytes: usize,
    /// Threads that parse, template and tokenize request bodies (0: one per core), off the
    /// async runtime's threads.
    pub tokenizer_threads: usize,
    /// The HTTP servers' limits (connections, header and body deadlines).
    pub http: HttpConfig,
    /// Keys accepted on the OpenAI endpoints (`Authorization: Bearer KEY`); empty and no
    /// `api_keys_file`: open.
    pub api_keys: Vec<Secret>,
    /// A file of further keys, one per line, re-read every few seconds
    /// ([`API_KEYS_RELOAD`]): a key added or revoked there (a Kubernetes Secret's mount
    /// updates in place) takes effect without a restart. While it has never been read, or
    /// holds no key, only `api_keys` are accepted; with none, no request is.
    pub api_keys_file: Option<std::path::PathBuf>,
    /// Token required on the admin listener (`Authorization: Bearer TOKEN`); `None`: open
    /// (bind it to loopback, the default).
    pub admin_token: Option<Secret>,
    /// Sent as `Authorization: Bearer` with every request to a worker (vLLM, SGLang and
    /// kvroute workers started with `--api-key`); clients' own keys are never passed on.
    pub engine_api_key: Option<Secret>,
    /// Names of the tenant, priority, session, affinity and receipt request headers.
    pub headers: ClassHeaders,
    /// Answer with the routing headers (`x-kvroute-worker`, `-overlap`, `-cached-blocks`,
    /// `-reachable-blocks`, and the receipt a request asks for). Off by default: they tell a
    /// client how much of a prompt is cached anywhere in the fleet, so one tenant could probe
    /// another's prompts (the attack vLLM's `cache_salt` exists for). `/admin/explain` shows
    /// operators the same.
    pub route_headers: bool,
}

impl Default for IngressConfig {
    fn default() -> Self {
        IngressConfig {
            max_body_bytes: 8 << 20,
            // With the parsed forms, ~768 MiB at most: within the chart's 2 GiB limit.
            body_memory_bytes: 256 << 20,
            max_inflight: 4096,
            retries: 2,
            retry_budget_percent: 20,
            retry_budget_per_s: 10,
            worker_timeout_ms: 10_000,
            relay_idle_timeout_ms: 30_000,
            worker_pool_idle_ms: crate::http::ENGINE_POOL_IDLE_MS,
            upstream_body_timeout_ms: 600_000,
            first_token_timeout_ms: 60_000,
            max_upstream_body_bytes: 64 << 20,
            max_tokenize_bytes: DEFAULT_MAX_TOKENIZE_BYTES,
            tokenizer_threads: 0,
            http: HttpConfig::default(),
            api_keys: Vec::new(),
            api_keys_file: None,
            admin_token: None,
            engine_api_key: None,
            headers: ClassHeaders::default(),
            route_headers: false,
        }
    }
}

/// Retries the router may make, all requests together: a token bucket that every request
/// fills by `percent` / 100 and time by `per_s` a second, up to `per_s` tokens, and that every
/// retry empties by one. When much of a fleet fails at once (a brownout, a request that
/// crashes the engines it reaches), each failure retried would send up to `retries` + 1
/// times the load at what is left; so retries stay a fraction of the requests (Envoy's and
/// Finagle's retry budgets; 20 % by default), and a quiet fleet still has a few a second.
/// No I/O: time is given.
#[derive(Debug)]
pub struct RetryBudget {
    percent: f64,
    per_s: f64,
    tokens: f64,
    at_ms: u64,
}

impl RetryBudget {
    /// A full bucket.
    pub fn new(percent: u32, per_s: u32) -> RetryBudget {
        RetryBudget {
            percent: f64::from(percent),
            per_s: f64::from(per_s),
            tokens: f64::from(per_s),
            at_ms: 0,
        }
    }

    /// The most tokens held: `per_s`, and at least one when requests earn them.
    fn most(&self) -> f64 {
        if self.percent > 0.0 {
            self.per_s.max(1.0)
        } else {
            self.per_s
        }
    }

    fn refill(&mut self, now_ms: u64) {
        let elapsed_s = now_ms.saturating_sub(self.at_ms) as f64 / 1e3;
        self.at_ms = self.at_ms.max(now_ms);
        self.tokens = (self.tokens + elapsed_s * self.per_s).min(self.most());
    }

    /// A request comes (its first attempt).
    pub fn on_request(&mut self, now_ms: u64) {
        self.refill(now_ms);
        self.tokens = (self.tokens + self.percent / 100.0).min(self.most());
    }

    /// Whether the budget has a retry now.
    pub fn has_retry(&mut self, now_ms: u64) -> bool {
        self.refill(now_ms);
        self.tokens >= 1.0
    }

    /// A retry is made (after [`RetryBudget::has_retry`], once a worker to retry on is
    /// found; requests retried at once may take the bucket below zero, made up by the
    /// next ones).
    pub fn spend(&mut self) {
        self.tokens -= 1.0;
    }
}

/// Why the front door's settings cannot work.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IngressConfigError {
    /// A limit that must be positive is zero (or too small to be useful).
    #[error("{field} must be at least {min}")]
    TooSmall {
        /// The setting.
        field: &'static str,
        /// Its smallest useful value.
        min: u64,
    },
    /// A limit above its largest working value.
    #[error("ingress.{field} must be at most {max}")]
    TooLarge {
        /// The field.
        field: &'static str,
        /// Its largest working value.
        max: u64,
    },
    /// The HTTP server limits.
    #[error(transparent)]
    Http(#[from] crate::http::HttpConfigError),
}

/// `max_tokenize_bytes` unless configured: 1 MiB.
pub const DEFAULT_MAX_TOKENIZE_BYTES: usize = 1 << 20;

/// Most `tokenizer_threads` (tokio's blocking pool holds 512 threads).
pub const MAX_TOKENIZER_THREADS: usize = 512;

/// Longest timeout the ingress takes, ms: 30 days (an operator's "never").
pub const MAX_TIMEOUT_MS: u64 = 30 * 24 * 3600 * 1000;

impl IngressConfig {
    /// Checks every limit.
    pub fn validate(&self) -> Result<(), IngressConfigError> {
        let checks = [
            ("max_body_bytes", self.max_body_bytes as u64, 1024),
            (
                "body_memory_bytes",
                self.body_memory_bytes as u64,
                self.max_body_bytes.max(self.max_upstream_body_bytes) as u64,
            ),
            ("max_inflight", self.max_inflight as u64, 1),
            ("max_tokenize_bytes", self.max_tokenize_bytes as u64, 1024),
            ("worker_timeout_ms", self.worker_timeout_ms, 1),
            ("relay_idle_timeout_ms", self.relay_idle_timeout_ms, 1),
            ("worker_pool_idle_ms", self.worker_pool_idle_ms, 1),
            ("upstream_body_timeout_ms", self.upstream_body_timeout_ms, 1),
            ("first_token_timeout_ms", self.first_token_timeout_ms, 1),
            (
                "max_upstream_body_bytes",
                self.max_upstream_body_bytes as u64,
                1024,
            ),
        ];
        if let Some((field, _, min)) = checks.into_iter().find(|(_, v, min)| v < min) {
            return Err(IngressConfigError::TooSmall { field, min });
        }
        // Deadlines are instants these far ahead: one past what an instant can hold
        // (`u64::MAX` meant as "never") panicked every request.
        let timeouts = [
            ("worker_timeout_ms", self.worker_timeout_ms),
            ("relay_idle_timeout_ms", self.relay_idle_timeout_ms),
            ("worker_pool_idle_ms", self.worker_pool_idle_ms),
            ("upstream_body_timeout_ms", self.upstream_body_timeout_ms),
            ("first_token_timeout_ms", self.first_token_timeout_ms),
        ];
        if let Some((field, _)) = timeouts.into_iter().find(|(_, v)| *v > MAX_TIMEOUT_MS) {
            return Err(IngressConfigError::TooLarge {
                field,
                max: MAX_TIMEOUT_MS,
            });
        }
        // Each permit is a thread of tokio's blocking pool (512 by default): past it, work
        // waits in the pool's queue, outside the permits' 10 s deadline.
        if self.tokenizer_threads > MAX_TOKENIZER_THREADS {
            return Err(IngressConfigError::TooLarge {
                field: "tokenizer_threads",
                max: MAX_TOKENIZER_THREADS as u64,
            });
        }
        self.http.validate()?;
        Ok(())
    }
}

/// Everything a request handler needs.
pub struct Router {
    /// The scheduler (the plane adds and removes its workers; load sharing books peers').
    pub scheduler: Arc<Mutex<Scheduler>>,
    /// The event plane (index, fleet).
    pub plane: EventPlane,
    /// Load sharing with other replicas, if any.
    pub load: Option<LoadShare>,
    /// Settings.
    pub config: IngressConfig,
    /// Renders `/metrics`.
    pub metrics: Option<crate::process::Metrics>,
    /// Text to token ids.
    pub tokenizer: Arc<Tokenizer>,
    /// Bounds the threads parsing and tokenizing at once.
    tokenize_permits: Arc<Semaphore>,
    client: Client<HttpConnector, Full<Bytes>>,
    inflight: AtomicUsize,
    /// Of those, slots taken over the limit while their requests are read ([`InFlight`]).
    provisional: AtomicUsize,
    /// The request bodies held at once (`config.body_memory_bytes`).
    bodies: BodyBudget,
    draining: AtomicBool,
    started: Instant,
    /// Whether routed prompts' blocks show up in their workers' events.
    pub(crate) mismatch: Arc<Mutex<MismatchAlarm>>,
    /// Where routed requests' prompts are reported (direct mode: engines without KV events
    /// learn their likely cache from them).
    decisions: Mutex<Option<tokio::sync::mpsc::Sender<RoutedPrompt>>>,
    /// Workers whose index entries are guesses made from the prompts routed to them
    /// (engines without KV events): a prompt shows there as soon as it is routed.
    guessed: Mutex<std::collections::HashSet<WorkerId>>,
    /// Requests waiting for room (lock it before the scheduler, never after).
    queue: Mutex<admission::Queue>,
    /// How many of them wait, by pool.
    waiting_models: admission::WaitingModels,
    /// The last pump ended at a request waiting for the fleet's budget: until a pump finds
    /// otherwise, every request queues behind it.
    fleet_full: AtomicBool,
    /// Signalled when booked work is released: the queue is pumped.
    room: Arc<Notify>,
    /// What retries may still be made.
    retry_budget: Mutex<RetryBudget>,
    /// Under `cfg(test)`, the next walk of the queue panics with it locked (a broken
    /// invariant), for the pump's guard's test.
    #[cfg(test)]
    break_next_walk: AtomicBool,
    /// Under `cfg(test)`, the next walk that routes a ticket panics right after.
    #[cfg(test)]
    break_after_routing: AtomicBool,
    /// The keys accepted on `/v1/*`: `config.api_keys` and the file's, as last read.
    api_keys: Mutex<Arc<ApiKeys>>,
}

/// Routed prompts waiting to be reported to sidecars (each up to a prompt's blocks, 16 B a
/// block: a few MiB at most).
const ROUTED_QUEUE: usize = 64;

/// How long reporting one routed prompt to a sidecar may wait on NATS.
const ROUTED_PUBLISH_DEADLINE: Duration = Duration::from_secs(1);

/// The keys accepted on `/v1/*`, each with its tenant ([`Secret::tenant`]) worked out once
/// when the keys are read rather than hashed again for every request.
pub struct ApiKeys {
    keys: Vec<Secret>,
    /// `tenants[i]` is `keys[i]`'s.
    tenants: Vec<Arc<str>>,
}

impl ApiKeys {
    fn new(keys: Vec<Secret>) -> ApiKeys {
        let tenants = keys.iter().map(|k| Arc::from(k.tenant())).collect();
        ApiKeys { keys, tenants }
    }
}

/// How often `api_keys_file` is re-read.
pub const API_KEYS_RELOAD: Duration = Duration::from_secs(2);

/// The keys of an API keys file: its non-empty lines, trimmed.
pub fn read_api_keys(text: &str) -> ApiKeysFile {
    let mut file = ApiKeysFile::default();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        // Blank lines and `#` comments are no keys.
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        match crate::auth::check_bearer_token(line) {
            Ok(()) => file.keys.push(Secret::new(line)),
            Err(why) => file.bad_lines.push((n + 1, why)),
        }
    }
    file
}

/// What an API keys file holds: its keys, and the lines that cannot be one.
#[derive(Debug, Default)]
pub struct ApiKeysFile {
    /// The keys, in the file's order.
    pub keys: Vec<Secret>,
    /// Lines that are no key (1-based, and why): a space or a control character could never
    /// be sent in a Bearer header. The router refuses to start on such a file, and while it
    /// runs skips them with a warning (the other lines' keys, revocations included, apply).
    pub bad_lines: Vec<(usize, String)>,
}

impl ApiKeysFile {
    /// Logs the lines that are no key (the keys themselves are not shown).
    fn warn(&self, path: &std::path::Path) {
        for (line, why) in &self.bad_lines {
            tracing::warn!(path = %path.display(), line, "an API keys file line that is no key ({why}): skipped");
        }
    }
}

/// How the router connects to workers. Streamed chunks must not wait for Nagle's algorithm
/// (40 ms stalls per first byte). TCP keepalive notices a worker whose host died (no FIN,
/// no RST) in about 25 s: a request sent to it and waiting for a non-streamed answer,
/// which sends nothing meanwhile, then fails as a lost connection and is retried elsewhere,
/// where it waited the whole answer deadline (600 s by default) and answered 504.
pub(crate) fn worker_connector(config: &IngressConfig) -> HttpConnector {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_millis(config.worker_timeout_ms)));
    connector.set_keepalive(Some(Duration::from_secs(10)));
    connector.set_keepalive_interval(Some(Duration::from_secs(5)));
    connector.set_keepalive_retries(Some(3));
    connector
}

/// A prompt the router sent to a worker.
#[derive(Clone, Debug)]
pub struct RoutedPrompt {
    /// Where it went.
    pub key: WorkerKey,
    /// Its full blocks.
    pub blocks: Vec<crate::protocol::BlockHash>,
}

impl Router {
    /// A router over a running plane (which keeps the scheduler's workers in step with the
    /// fleet).
    pub fn new(
        scheduler: Arc<Mutex<Scheduler>>,
        plane: EventPlane,
        load: Option<LoadShare>,
        config: IngressConfig,
        metrics: Option<crate::process::Metrics>,
        tokenizer: Tokenizer,
    ) -> Arc<Router> {
        let connector = worker_connector(&config);
        // Idle connections to workers are dropped before the engines drop them (a request
        // failed that way counts against its worker).
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_millis(config.worker_pool_idle_ms))
            .pool_timer(hyper_util::rt::TokioTimer::new())
            .build(connector);
        let bodies = BodyBudget::new(config.body_memory_bytes);
        let queue = scheduler::queue::AdmissionQueue::new(scheduler.lock().config().queue.clone());
        let threads = match config.tokenizer_threads {
            0 => std::thread::available_parallelism().map_or(2, |n| n.get()),
            n => n,
        };
        let mut keys = config.api_keys.clone();
        if let Some(path) = &config.api_keys_file {
            // Read now as well, so that no request meets the router before its keys do.
            match std::fs::read_to_string(path) {
                // Its bad lines are said by the watch's first read, right after.
                Ok(text) => keys.extend(read_api_keys(&text).keys),
                Err(e) => {
                    tracing::error!(path = %path.display(), error = %e, "cannot read the API keys file: its keys are refused until it can be read");
                }
            }
        }
        let api_keys = Mutex::new(Arc::new(ApiKeys::new(keys)));
        let retry_budget = Mutex::new(RetryBudget::new(
            config.retry_budget_percent,
            config.retry_budget_per_s,
        ));
        // Peers freeing room wake the queue as this replica's own completions do.
        let room = load
            .as_ref()
            .map_or_else(|| Arc::new(Notify::new()), LoadShare::freed);
        let router = Arc::new(Router {
            api_keys,
            scheduler,
            plane,
            load,
            config,
            metrics,
            tokenizer: Arc::new(tokenizer),
            tokenize_permits: Arc::new(Semaphore::new(threads)),
            client,
            inflight: AtomicUsize::new(0),
            provisional: AtomicUsize::new(0),
            bodies,
            draining: AtomicBool::new(false),
            started: Instant::now(),
            mismatch: Arc::new(Mutex::new(MismatchAlarm::new(MismatchConfig::default()))),
            decisions: Mutex::new(None),
            guessed: Mutex::default(),
            queue: Mutex::new(queue),
            waiting_models: Arc::default(),
            fleet_full: AtomicBool::new(false),
            retry_budget,
            room,
            #[cfg(test)]
            break_next_walk: AtomicBool::new(false),
            #[cfg(test)]
            break_after_routing: AtomicBool::new(false),
        });
        for end in proxy::RelayEnd::ALL {
            metrics::counter!("kvroute_relay_ended_total", "how" => end.label()).increment(0);
        }
        tokio::spawn(watch_hashes(Arc::downgrade(&router)));
        if let Some(path) = router.config.api_keys_file.clone() {
            tokio::spawn(watch_api_keys(Arc::downgrade(&router), path));
        }
        tokio::spawn(admission::drive_queue(
            Arc::downgrade(&router),
            Arc::clone(&router.room),
        ));
        router
    }

    /// Reports every routed request's prompt to `sink` from now on, as it is sent (dropped
    /// when the sink is full: the approximate cache it feeds is a guess anyway), for the
    /// `guessed` workers' caches to be guessed from.
    pub fn report_decisions(
        &self,
        sink: tokio::sync::mpsc::Sender<RoutedPrompt>,
        guessed: std::collections::HashSet<WorkerId>,
    ) {
        *self.decisions.lock() = Some(sink);
        *self.guessed.lock() = guessed;
    }

    /// Reports the prompts routed to workers whose registrations say they learn from routes
    /// (engines without KV events: [`Router::guessed`] ones, the only ones put on the queue),
    /// as they are sent, to their sidecars on their routed subjects over `transport`
    /// ([`crate::events::routed`]): each sidecar guesses its engine's cache from every
    /// replica's decisions and publishes the guess as its event stream. Dropped when the
    /// queue is full or NATS does not take it in time (a guess anyway); a prompt too large
    /// for one message is not reported.
    pub fn publish_decisions(&self, transport: Transport, cluster: String) {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<RoutedPrompt>(ROUTED_QUEUE);
        // The router holds the sender: the task ends with it.
        *self.decisions.lock() = Some(tx);
        tokio::spawn(async move {
            while let Some(routed) = rx.recv().await {
                let message = crate::events::routed::Routed::new(routed.key.1, &routed.blocks);
                let Some(payload) = message
                    .encode()
                    .filter(|p| p.len() <= transport.max_payload())
                else {
                    metrics::counter!("kvroute_routed_reports_dropped_total", "reason" => "too_large").increment(1);
                    continue;
                };
                let subject = crate::events::routed::routed_subject(&cluster, routed.key.0);
                let sent = tokio::time::timeout(
                    ROUTED_PUBLISH_DEADLINE,
                    transport.publish(&subject, None, payload.into()),
                )
                .await;
                if !matches!(sent, Ok(Ok(()))) {
                    metrics::counter!("kvroute_routed_reports_dropped_total", "reason" => "publish").increment(1);
                }
            }
        });
    }

    /// Whether `worker`'s index entries are guessed from the prompts routed to it (an
    /// engine without KV events: followed in this process, or by a sidecar that learns
    /// from routes).
    pub fn guessed(&self, worker: WorkerId) -> bool {
        self.guessed.lock().contains(&worker)
            || self
                .plane
                .view()
                .workers
                .get(&worker)
                .is_some_and(|w| w.learns_routes)
    }

    /// The keys accepted on `/v1/*` now.
    pub fn api_keys(&self) -> Arc<ApiKeys> {
        Arc::clone(&self.api_keys.lock())
    }

    /// Whether `/v1/*` needs a key: some are configured, or a keys file is (even one that
    /// could not be read: then no request is let in).
    fn keys_required(&self) -> bool {
        !self.config.api_keys.is_empty() || self.config.api_keys_file.is_some()
    }

    /// Replaces the file's keys (`config.api_keys` stay); true if the set changed.
    pub fn set_file_keys(&self, file_keys: Vec<Secret>) -> bool {
        let mut keys = self.config.api_keys.clone();
        keys.extend(file_keys);
        let mut current = self.api_keys.lock();
        let same = current.keys.len() == keys.len()
            && current
                .keys
                .iter()
                .zip(&keys)
                .all(|(a, b)| a.matches(b.expose().as_bytes()));
        if !same {
            *current = Arc::new(ApiKeys::new(keys));
        }
        !same
    }

    /// Starts a graceful shutdown: `/ready` fails from now on (the load balancer stops
    /// sending), requests in flight go on, and requests waiting in the queue (or that would)
    /// get 503 with `Retry-After`, for their clients to try another replica.
    pub fn begin_drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
        self.refuse_queued();
    }

    /// Requests in flight (accepted, not yet finished streaming).
    pub fn inflight(&self) -> usize {
        self.inflight.load(Ordering::Relaxed)
    }

    /// Waits until no request is in flight or `timeout` has passed; returns how many were
    /// still in flight.
    pub async fn drained(&self, timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        while self.inflight() > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.inflight()
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Runs `f` (parsing, templating, tokenizing: up to `max_body_bytes` of CPU work) on the
    /// blocking pool, at most `tokenizer_threads` at a time, so it never stalls the async
    /// threads that relay streams. The blocking task holds the permit: a client that leaves
    /// drops this future, not the work already started, which still counts until it ends.
    async fn off_runtime<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, ApiError> {
        run_blocking(&self.tokenize_permits, TOKENIZER_WAIT, f)
            .await
            .map_err(|e| match e {
                BlockingError::Busy { wait } => ApiError::tokenizer_busy(wait),
                BlockingError::Failed(_) => ApiError::unavailable("tokenizer failed"),
            })
    }

    /// What a request learnt of `key`'s health: a worker that could not be reached, or
    /// answered with an error status of its own (5xx, 429, ...), counts towards its
    /// ejection; one that answered otherwise (a refusal of the request included) is
    /// healthy. A stream's headers say neither: its relay reports its first token, or its
    /// silence.
    fn note_reachability(&self, key: WorkerKey, outcome: Result<(), &ProxyError>, stream: bool) {
        let reach = proxy::Reach::new(self, key.0);
        match proxy::answered(outcome, stream) {
            Some(true) => reach.answered(),
            Some(false) => reach.failed(),
            None => {}
        }
    }

    /// Sets the gauges that are read off the router's state at scrape time.
    fn refresh_gauges(&self) {
        let (open, expired) = {
            let s = self.scheduler.lock();
            (s.open_bookings(), s.expired_bookings())
        };
        metrics::gauge!("kvroute_scheduler_bookings_open").set(open as f64);
        metrics::counter!("kvroute_scheduler_bookings_expired_total").absolute(expired);
        metrics::gauge!("kvroute_requests_inflight").set(self.inflight() as f64);
        metrics::gauge!("kvroute_request_body_bytes_held").set(self.bodies.in_use() as f64);
        self.queue_gauges();
    }
}

/// Serves the OpenAI API, health, readiness and metrics on `listener` until `shutdown`.
pub async fn serve(
    router: Arc<Router>,
    listener: tokio::net::TcpListener,
    shutdown: watch::Receiver<bool>,
) {
    let http = router.config.http.clone();
    serve_http(
        "api",
        listener,
        http,
        move |req| handle(Arc::clone(&router), req),
        shutdown,
    )
    .await;
}

/// Connections the status listener serves at once: probes and scrapes are few and short.
const STATUS_MAX_CONNECTIONS: usize = 256;

/// How long a status connection may take to send its headers, and stay idle between
/// requests, ms: below the kubelet's probe timeout (the chart's is 2 s). With the API's 30 s,
/// 64 connections that sent nothing held every slot, and the probes waited in the accept
/// queue past their timeout until the kubelet restarted the router (an audit found).
const STATUS_HEADER_TIMEOUT_MS: u64 = 1_000;

/// How long a status connection may leave what it is sent unread, ms (as
/// [`STATUS_HEADER_TIMEOUT_MS`], for a client that pipelines requests and reads nothing).
const STATUS_WRITE_STALL_MS: u64 = 2_000;

/// Serves liveness (`/health`), readiness (`/ready`) and `/metrics`, open and nothing else,
/// on `listener` until `shutdown`: the kubelet's probes and Prometheus's scrapes on their own
/// port and connection cap. On the API port they queue behind client connections once
/// `max_connections` is reached, so a connection flood would fail liveness and restart a
/// router that is only busy, cutting every stream it serves. Kept serving through a drain
/// (the caller stops it when the process ends), `/ready` answering 503 meanwhile.
pub async fn serve_status(
    router: Arc<Router>,
    listener: tokio::net::TcpListener,
    shutdown: watch::Receiver<bool>,
) {
    let http = HttpConfig {
        max_connections: STATUS_MAX_CONNECTIONS,
        header_read_timeout_ms: STATUS_HEADER_TIMEOUT_MS
            .min(router.config.http.header_read_timeout_ms),
        // A client that asks and never reads holds its slot no longer either.
        write_stall_timeout_ms: STATUS_WRITE_STALL_MS
            .min(router.config.http.write_stall_timeout_ms),
        ..router.config.http.clone()
    };
    serve_http(
        "status",
        listener,
        http,
        move |req| {
            let router = Arc::clone(&router);
            async move { handle_status(&router, &req) }
        },
        shutdown,
    )
    .await;
}

fn handle_status(router: &Router, req: &hyper::Request<Incoming>) -> Response<Body> {
    let result = match (req.method(), req.uri().path()) {
        (&Method::GET, "/health") => Ok(health()),
        (&Method::GET, "/ready") => Ok(ready(router)),
        (&Method::GET, "/metrics") => Ok(metrics_text(router)),
        _ => Err(ApiError::not_found()),
    };
    result.unwrap_or_else(|e| api_error(&e))
}

/// Serves the admin views (`/admin/workers`, `/admin/explain`), behind the admin token if
/// one is set, plus health and metrics, on `listener` until `shutdown`.
pub async fn serve_admin(
    router: Arc<Router>,
    listener: tokio::net::TcpListener,
    shutdown: watch::Receiver<bool>,
) {
    let http = HttpConfig {
        max_connections: 64,
        ..router.config.http.clone()
    };
    serve_http(
        "admin",
        listener,
        http,
        move |req| handle_admin(Arc::clone(&router), req),
        shutdown,
    )
    .await;
}

fn json(status: StatusCode, body: String) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(crate::http::full(body))
        .expect("invariant: static response parts are valid")
}

fn api_error(e: &ApiError) -> Response<Body> {
    metrics::counter!("kvroute_http_errors_total", "status" => e.status.to_string(), "fault" => e.fault_label()).increment(1);
    let mut r = json(
        StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        e.body(),
    );
    if e.retryable {
        r.headers_mut().insert(
            header::RETRY_AFTER,
            header::HeaderValue::from(e.retry_after_s),
        );
    }
    if e.status == 401 {
        r.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Bearer"),
        );
    }
    r
}

fn metrics_text(router: &Router) -> Response<Body> {
    router.refresh_gauges();
    let text = router
        .metrics
        .as_ref()
        .map(|h| h.render())
        .unwrap_or_default();
    Response::builder()
        .header(header::CONTENT_TYPE, "text/plain; version=0.0.4")
        .body(crate::http::full(text))
        .expect("invariant: static response parts are valid")
}

async fn handle(router: Arc<Router>, mut req: hyper::Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_owned();
    let api = path.starts_with("/v1/");
    // Every answer of the completions endpoints names its request, a refused key's and a
    // wrong method's included.
    let named = matches!(path.as_str(), "/v1/completions" | "/v1/chat/completions")
        .then(|| request_id(req.headers()));
    let name = |mut r: Response<Body>| {
        if let Some(id) = &named {
            r.headers_mut().insert(REQUEST_ID, id.clone());
        }
        r
    };
    if api && router.keys_required() && !bearer_ok(req.headers(), &router.api_keys().keys) {
        return name(api_error(&ApiError::unauthorized()));
    }
    let result = match (req.method().clone(), path.as_str()) {
        (Method::GET, "/health") => Ok(health()),
        (Method::GET, "/ready") => Ok(ready(&router)),
        (Method::GET, "/metrics") => Ok(metrics_text(&router)),
        (Method::GET, "/v1/models") => Ok(models(&router)),
        // OpenAI's "retrieve model" (`client.models.retrieve(id)`); an id may hold slashes.
        (Method::GET, p) if p.starts_with("/v1/models/") => {
            model(&router, &p["/v1/models/".len()..])
        }
        (Method::POST, "/v1/completions" | "/v1/chat/completions") => {
            let chat = path == "/v1/chat/completions";
            let id = named
                .clone()
                .expect("invariant: a completions path is named");
            req.headers_mut().insert(REQUEST_ID, id.clone());
            let span = tracing::info_span!("request", id = %id.to_str().unwrap_or_default());
            let answer =
                tracing::Instrument::instrument(completions(&router, req, chat), span).await;
            return name(answer.unwrap_or_else(|e| api_error(&e)));
        }
        (method, p) => match allowed_methods(p) {
            // A known endpoint asked with another method: 405 with `Allow`, as vLLM's
            // FastAPI answers (a 404 read as a wrong URL).
            Some(allow) => {
                let mut r = api_error(&ApiError::method_not_allowed(&method, allow));
                r.headers_mut()
                    .insert(header::ALLOW, header::HeaderValue::from_static(allow));
                return name(r);
            }
            None => Err(ApiError::not_found()),
        },
    };
    result.unwrap_or_else(|e| api_error(&e))
}

/// The header naming a request, end to end: the client's, or one made up here; answered
/// with the response, and passed on to the worker ([`proxy::PASSED_HEADERS`]).
const REQUEST_ID: header::HeaderName = header::HeaderName::from_static("x-request-id");

/// The client's request id if it is one (1 to 128 visible ASCII characters), else a new
/// one (`req-` and 24 hex digits).
fn request_id(headers: &hyper::HeaderMap) -> header::HeaderValue {
    headers
        .get(&REQUEST_ID)
        .filter(|v| {
            (1..=128).contains(&v.len()) && v.as_bytes().iter().all(|b| (0x21..=0x7e).contains(b))
        })
        .cloned()
        .unwrap_or_else(|| {
            header::HeaderValue::from_str(&openai::response_id("req-"))
                .expect("invariant: a made-up id is ASCII")
        })
}

/// The methods the API listener answers at `path`, if it is one of its endpoints.
fn allowed_methods(path: &str) -> Option<&'static str> {
    match path {
        "/health" | "/ready" | "/metrics" | "/v1/models" => Some("GET"),
        p if p.starts_with("/v1/models/") => Some("GET"),
        "/v1/completions" | "/v1/chat/completions" => Some("POST"),
        _ => None,
    }
}

async fn handle_admin(router: Arc<Router>, req: hyper::Request<Incoming>) -> Response<Body> {
    if let Some(token) = &router.config.admin_token
        && !bearer_ok(req.headers(), std::slice::from_ref(token))
    {
        return api_error(&ApiError::unauthorized());
    }
    let path = req.uri().path().to_owned();
    let result = match (req.method().clone(), path.as_str()) {
        (Method::GET, "/health") => Ok(health()),
        (Method::GET, "/metrics") => Ok(metrics_text(&router)),
        (Method::GET, "/admin/workers") => Ok(admin_workers(&router)),
        (Method::GET, "/admin/index") => Ok(admin_index(&router).await),
        (Method::GET, "/admin/queues") => {
            Ok(json(StatusCode::OK, router.queues_view().to_string()))
        }
        (Method::POST, "/admin/explain") => explain(&router, req).await,
        _ => Err(ApiError::not_found()),
    };
    result.unwrap_or_else(|e| api_error(&e))
}

/// Reads a request body under the size cap and the body deadline.
/// Reads a request body under the size cap, the body deadline and the bodies' memory
/// budget: the body and its share of the budget, to keep while the body is held.
async fn read_body(
    router: &Router,
    req: hyper::Request<Incoming>,
) -> Result<(Bytes, Reservation), ApiError> {
    let limit = router.config.max_body_bytes;
    let deadline = Duration::from_millis(router.config.http.body_read_timeout_ms);
    collect_within(req.into_body(), limit, deadline, &router.bodies)
        .await
        .map_err(|e| match e {
            BodyError::TooLarge { limit } => ApiError::too_large(limit),
            BodyError::TimedOut { ms } => ApiError::body_timeout(ms),
            BodyError::OverBudget { budget } => ApiError::bodies_over_budget(budget),
            BodyError::Io(e) => ApiError::bad_request(format!("reading the request body: {e}")),
        })
}

/// Liveness: the process answers.
fn health() -> Response<Body> {
    json(StatusCode::OK, r#"{"status":"ok"}"#.into())
}

fn ready(router: &Router) -> Response<Body> {
    let live = router.plane.streams().iter().any(|(_, s)| s.live);
    let workers = router.plane.view().workers.len();
    let draining = router.draining.load(Ordering::Relaxed);
    let status = if live && workers > 0 && !draining {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    json(
        status,
        serde_json::json!({"workers": workers, "synced": live, "draining": draining}).to_string(),
    )
}

/// A model as OpenAI's API describes it.
fn model_object(id: &str) -> serde_json::Value {
    serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "kvroute"})
}

fn models(router: &Router) -> Response<Body> {
    let view = router.plane.view();
    let data: Vec<_> = view.models().iter().map(|m| model_object(m)).collect();
    json(
        StatusCode::OK,
        serde_json::json!({"object": "list", "data": data}).to_string(),
    )
}

/// One model served here, or 404 `model_not_found`. The id may come percent-encoded (SDKs
/// encode a path parameter: `Qwen%2FQwen3-8B`).
fn model(router: &Router, id: &str) -> Result<Response<Body>, ApiError> {
    let id = percent_decoded(id);
    let id = id.as_ref();
    let view = router.plane.view();
    match view.models().into_iter().find(|m| *m == id) {
        Some(m) => Ok(json(StatusCode::OK, model_object(m).to_string())),
        None => Err(ApiError::model_not_found(id)),
    }
}

/// `s` with its `%XX` escapes decoded; `s` itself where an escape is malformed or the
/// result is not UTF-8.
pub(crate) fn percent_decoded(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.contains('%') {
        return s.into();
    }
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .filter(|h| h.iter().all(u8::is_ascii_hexdigit))
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok());
            let Some(byte) = hex else {
                return s.into();
            };
            out.push(byte);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_or(s.into(), Into::into)
}

fn admin_workers(router: &Router) -> Response<Body> {
    let streams = router.plane.streams();
    let view = router.plane.view();
    // Each worker's streams, found once (not by a scan of every stream per worker).
    let mut ranks_of: HashMap<WorkerId, Vec<&(StreamKey, StreamStatus)>> = HashMap::new();
    for stream in &streams {
        ranks_of.entry(stream.0.0).or_default().push(stream);
    }
    // What the scheduler and the alarm say, copied out under their locks (routing and
    // every first token need them), the rest built after.
    let (figures, open_bookings, expired_bookings) = {
        let scheduler = router.scheduler.lock();
        let alarm = router.mismatch.lock();
        let figures: Vec<_> = view
            .workers
            .values()
            .map(|w| {
                let (mut prefill, mut held, mut requests) = (0.0, 0, 0);
                for ((_, rank), _) in ranks_of.get(&w.id).into_iter().flatten() {
                    if let Some(l) = scheduler.load((w.id, *rank)) {
                        prefill += l.prefill_blocks;
                        held += l.decode_blocks();
                        requests += l.requests;
                    }
                }
                // The scheduler's copy of the engine's load: the view is published again
                // only when a registration changes shape, not for each heartbeat's load.
                let engine_load = scheduler.engine_load((w.id, crate::protocol::DpRank(0)));
                (alarm.status(w.id), prefill, held, requests, engine_load)
            })
            .collect();
        (
            figures,
            scheduler.open_bookings(),
            scheduler.expired_bookings(),
        )
    };
    let workers: Vec<_> = view
        .workers
        .values()
        .zip(figures)
        .map(|(w, (mismatch, prefill, held, requests, engine_load))| {
            let ranks: &[&(StreamKey, StreamStatus)] =
                ranks_of.get(&w.id).map_or(&[], Vec::as_slice);
            let synced = !ranks.is_empty() && ranks.iter().all(|(_, s)| s.live);
            serde_json::json!({
                "id": w.id, "url": w.url, "model": w.model, "epoch": w.epoch, "dp_size": w.dp_size,
                "block_size": w.block_size, "g1_blocks": w.g1_blocks, "g2_blocks": w.g2_blocks,
                "synced": synced,
                "event_lag_ms": ranks.iter().map(|(_, s)| s.last_lag_ms).fold(0.0, f64::max),
                "resyncs": ranks.iter().map(|(_, s)| s.stats.resyncs).sum::<u64>(),
                "booked_prefill_blocks": prefill, "booked_blocks": held, "booked_requests": requests,
                "hash_mismatch": mismatch.raised, "routed_blocks_seen": mismatch.seen, "routed_blocks_missing": mismatch.missing,
                "engine_event_faults": w.event_faults,
                "engine_load": engine_load,
            })
        })
        .collect();
    let sizes = router.plane.indexer().sizes();
    let c = router.plane.counters();
    json(
        StatusCode::OK,
        serde_json::json!({
            "workers": workers,
            "index": {"blocks": sizes.blocks, "entries": sizes.entries},
            "silent": router.plane.silent_workers(),
            "bookings": {"open": open_bookings, "expired": expired_bookings},
            "fleet": {
                "batches_dropped": c.batches_dropped.load(Ordering::Relaxed),
                "registrations_refused": c.registrations_refused.load(Ordering::Relaxed),
                "orphans_swept": c.orphans_swept.load(Ordering::Relaxed),
            },
        })
        .to_string(),
    )
}

/// Per worker, rank and tier, how many blocks the index holds and an order-independent
/// digest of them (xor of their hashes), to compare with the workers' own (`kvroute-bench
/// soak`). Read on a blocking thread, not the runtime's, nor a tokenizer's slot: it walks
/// the whole index.
async fn admin_index(router: &Router) -> Response<Body> {
    let indexer = Arc::clone(router.plane.indexer());
    match tokio::task::spawn_blocking(move || indexer.digest()).await {
        Ok(rows) => {
            let rows: Vec<_> = rows
                .into_iter()
                .map(|d| serde_json::json!({"worker": d.worker, "dp_rank": d.dp_rank.0, "tier": format!("{:?}", d.tier), "blocks": d.blocks, "digest": format!("{:016x}", d.xor)}))
                .collect();
            json(
                StatusCode::OK,
                serde_json::json!({"ranks": rows}).to_string(),
            )
        }
        Err(e) => api_error(&ApiError::unavailable(format!(
            "the index digest failed: {e}"
        ))),
    }
}

/// Reads `path` now and every [`API_KEYS_RELOAD`]: a key added to or revoked from the
/// file takes effect within that. A file that cannot be read keeps the keys last read (the
/// failure is logged once). Ends with the router.
async fn watch_api_keys(router: std::sync::Weak<Router>, path: std::path::PathBuf) {
    let mut tick = tokio::time::interval(API_KEYS_RELOAD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    // The bad lines last warned of: each said once, not every reload.
    let mut warned: Vec<(usize, String)> = Vec::new();
    loop {
        tick.tick().await;
        let read = tokio::fs::read_to_string(&path).await;
        let Some(router) = router.upgrade() else {
            return;
        };
        match read {
            Ok(text) => {
                failing = false;
                let file = read_api_keys(&text);
                if file.bad_lines != warned {
                    file.warn(&path);
                    warned = file.bad_lines.clone();
                }
                let count = file.keys.len();
                if router.set_file_keys(file.keys) {
                    tracing::info!(path = %path.display(), keys = count, "API keys file read");
                }
            }
            Err(e) if !failing => {
                failing = true;
                tracing::error!(path = %path.display(), error = %e, "cannot read the API keys file; keeping the keys last read");
            }
            Err(_) => {}
        }
    }
}

/// Once a second, looks for each routed prompt's last block in the chosen worker's index:
/// seen once, it counts as seen; still not seen when its grace period is over, as missing.
/// Raises `kvroute_worker_hash_mismatch` (and logs once, with
/// the likely causes) for a worker where most are not. Then drops the metric series of
/// workers gone for longer than [`crate::process::series::WORKER_SERIES_GRACE_MS`]. Ends
/// with the router.
async fn watch_hashes(router: std::sync::Weak<Router>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Per worker, its streams' wipes as of the last look.
    let mut wipes: rustc_hash::FxHashMap<WorkerId, u64> = Default::default();
    loop {
        tick.tick().await;
        let Some(router) = router.upgrade() else {
            return;
        };
        // A worker whose cache was wiped since the last look (a restart under its id, a
        // resync, `Cleared`) lost the blocks its watched requests left: those are not
        // judged.
        let mut now_wipes: rustc_hash::FxHashMap<WorkerId, u64> = Default::default();
        for ((worker, _), status) in router.plane.streams() {
            *now_wipes.entry(worker).or_default() += status.wipes;
        }
        {
            let mut alarm = router.mismatch.lock();
            for (worker, n) in &now_wipes {
                if wipes.get(worker).is_some_and(|before| before != n) {
                    alarm.forget(*worker);
                }
            }
        }
        wipes = now_wipes;
        // The index is read without the alarm's lock, which every request's first token
        // takes: up to 256 lookups a worker, a few ms at hundreds of workers.
        let indexer = router.plane.indexer();
        let wanted = router.mismatch.lock().pending();
        let held: rustc_hash::FxHashSet<(WorkerId, SeqHash)> = wanted
            .into_iter()
            .filter(|&(w, seq)| {
                indexer
                    .find_matches_seq(&[seq])
                    .workers
                    .iter()
                    .any(|o| o.worker == w && o.device + o.host + o.disk > 0)
            })
            .collect();
        let mut alarm = router.mismatch.lock();
        // Expectations added since the snapshot read as not held: none is due yet (each has
        // its grace period), so they wait for the next look.
        let checked = alarm.check(
            router.now_ms(),
            |w, seq| held.contains(&(w, seq)),
            |w| router.plane.worker(w).is_some(),
        );
        for w in checked.departed {
            metrics::gauge!("kvroute_worker_hash_mismatch", "worker" => w.to_string()).set(0.0);
        }
        for w in checked.raised {
            let info = router.plane.worker(w);
            tracing::warn!(
                worker = %w,
                url = info.as_ref().map(|i| i.url.as_str()).unwrap_or(""),
                "routed prompts' blocks never show up in this worker's KV events: the router and \
                 the engine hash prompts differently. Likely: the router's --tokenizer or chat \
                 template is not the engine's, the block size differs, or the engine salts its \
                 hashes (LoRA, cache_salt). Its cache overlaps read as zero until fixed"
            );
        }
        let workers = router.plane.workers();
        for w in &workers {
            let raised = alarm.status(w.id).raised;
            metrics::gauge!("kvroute_worker_hash_mismatch", "worker" => w.id.to_string())
                .set(if raised { 1.0 } else { 0.0 });
        }
        drop(alarm);
        if let Some(metrics) = &router.metrics {
            metrics.sweep_workers(workers.iter().map(|w| w.id), router.now_ms());
        }
    }
}

/// A parsed request, ready to route.
#[derive(Debug)]
struct Parsed {
    model: String,
    tokens: Vec<u32>,
    /// Tokens to generate per sequence, if limited (a chat may set none).
    max_tokens: Option<u32>,
    /// Sequences to generate (`n`).
    n: u32,
    stream: bool,
    /// Streamed: end with the usage chunk.
    include_usage: bool,
    /// vLLM's `priority` (lower first), if sent.
    priority: Option<i64>,
    /// OpenAI's `service_tier`, if sent.
    service_tier: Option<String>,
    /// vLLM's `cache_salt`, if sent: it salts the prompt's blocks, as the engine does.
    cache_salt: Option<String>,
    /// The chat has images or audio: `tokens` are the conversation before them only.
    media: bool,
    /// The prompt's text is longer than the router tokenizes (`max_tokenize_bytes`):
    /// `tokens` is empty, the request is routed on load alone, and booked at this estimate
    /// of its tokens ([`untokenized_estimate`]).
    untokenized: Option<usize>,
    /// It asks vLLM for full KV event reporting ([`openai::VllmXargs`]).
    reports_full: bool,
}

impl Parsed {
    /// The prompt's tokens as booked and weighed in the queue: counted, or for a text too
    /// long to tokenize estimated (a zero booked its prefill as free: the worker looked
    /// idle, and its tenant was charged decode alone).
    fn prompt_tokens(&self) -> usize {
        self.untokenized.unwrap_or(self.tokens.len())
    }

    /// Tokens each sequence may generate, for its booking (the scheduler caps it at
    /// `admission.decode_cap_tokens`, then counts it `n` times): its limit, or none.
    fn booked_max_tokens(&self) -> u32 {
        self.max_tokens.unwrap_or(u32::MAX)
    }
}

/// What a bundled worker (`kvroute-worker`) is sent: the tokens, the salt its blocks get
/// (as the router hashed them), and of the client's fields those it acts on; `max_tokens`
/// only if the client set one (the worker's default otherwise), `n` for it to refuse more
/// than one sequence. Written straight from the parsed request: a tree of JSON values
/// costs about 80 B a token (an 8 MiB body of token ids took 330 MB of the router's
/// memory, which the body budget does not count).
fn generate_body(p: &Parsed, salt: crate::protocol::Salt, chat: bool) -> Bytes {
    #[derive(serde::Serialize)]
    struct Generate<'a> {
        model: &'a str,
        token_ids: &'a [u32],
        salt: u64,
        stream: bool,
        include_usage: bool,
        n: u32,
        chat: bool,
        #[serde(skip_serializing_if = "Option::is_none")]
        max_tokens: Option<u32>,
        /// The tokens are a prefix: the worker must refuse rather than answer the text
        /// alone.
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        media: bool,
    }
    let body = Generate {
        model: &p.model,
        token_ids: &p.tokens,
        salt: salt.0,
        stream: p.stream,
        include_usage: p.include_usage,
        n: p.n,
        chat,
        max_tokens: p.max_tokens,
        media: p.media,
    };
    Bytes::from(serde_json::to_vec(&body).expect("invariant: plain fields serialize"))
}

/// Most completions one request may ask for (`n`): each is booked on its worker as
/// `max_tokens` of decode, so an unbounded `n` let one request hold a worker's whole budget
/// (and, with `--fleet-budget-tokens`, every model's queue) until it ended.
pub const MAX_N: u32 = 1_024;

/// Parses and tokenizes a completion or chat body, with the default `max_tokenize_bytes`.
fn parse(tokenizer: &Tokenizer, body: &[u8], chat: bool) -> Result<Parsed, ApiError> {
    parse_within(tokenizer, body, chat, DEFAULT_MAX_TOKENIZE_BYTES)
}

/// Bytes a token of text is taken to cover where a prompt is too long to tokenize: about
/// 4 for English prose with the BPE vocabularies of current models (OpenAI's rule of thumb,
/// "one token is roughly 4 characters"); code and other languages take fewer.
const BYTES_PER_TOKEN: usize = 4;

/// The tokens a prompt too long to tokenize is taken to have: its `bytes` of text at
/// [`BYTES_PER_TOKEN`] (at least those: a chat's rendering is stopped at the limit), at
/// most the `keep` the engine cuts it to (`truncate_prompt_tokens`).
fn untokenized_estimate(bytes: usize, keep: Option<usize>) -> usize {
    bytes
        .div_ceil(BYTES_PER_TOKEN)
        .min(keep.unwrap_or(usize::MAX))
        .max(1)
}

/// Tokens of a prompt of `bytes` of text encoded within the text limit, or none and its
/// estimate (untokenized).
fn or_untokenized(
    encoded: Option<Vec<u32>>,
    bytes: usize,
    keep: Option<usize>,
) -> (Vec<u32>, Option<usize>) {
    match encoded {
        Some(tokens) => (tokens, None),
        None => (Vec::new(), Some(untokenized_estimate(bytes, keep))),
    }
}

/// Parses and tokenizes a completion or chat body (on the tokenizer pool), tokenizing at
/// most `text_limit` bytes of prompt text: a longer one is not tokenized at all. A Hugging
/// Face tokenizer's peak memory is 150 to 350 times the text it tokenizes (its encoding's
/// per-token records and per-byte alignments; measured with a byte-level BPE at one token a
/// byte), so one 8 MiB prompt took up to 2.8 GB.
fn parse_within(
    tokenizer: &Tokenizer,
    body: &[u8],
    chat: bool,
    text_limit: usize,
) -> Result<Parsed, ApiError> {
    let invalid =
        |e: serde_json::Error| ApiError::bad_request(format!("invalid request body: {e}"));
    let rejected = |e: tokenizer::TokenizerError| ApiError::bad_request(e.to_string());
    // `None`: longer than the limit, not tokenized.
    let encode = |text: &str, special: bool, keep: Option<usize>| match tokenizer
        .encode_limited(text, special, keep, text_limit)
    {
        Ok(tokens) => Ok(Some(tokens)),
        Err(tokenizer::TokenizerError::TooLong { .. }) => {
            metrics::counter!("kvroute_prompts_untokenized_total").increment(1);
            Ok(None)
        }
        Err(e) => Err(e),
    };
    let parsed = if chat {
        if openai::json_values_over(body, openai::MAX_CHAT_VALUES) {
            return Err(ApiError::too_many_values());
        }
        let mut r: ChatRequest = serde_json::from_slice(body).map_err(invalid)?;
        if r.messages.is_empty() {
            return Err(ApiError::bad_request("messages must not be empty"));
        }
        openai::check_stream_options(r.stream, r.stream_options)?;
        // vLLM refuses both set (`check_generation_prompt`), and with `add_generation_prompt`
        // left at its default of true, transformers' renderer refuses the pair.
        if r.continue_final_message == Some(true) && r.add_generation_prompt != Some(false) {
            return Err(ApiError::bad_request(
                "continue_final_message needs add_generation_prompt: false (both cannot be true)",
            ));
        }
        let template = tokenizer
            .chat_template_for(r.take_templates()?)
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        if !tokenizer.renders_tools(r.tool_choice.as_ref()) {
            r.tools = None;
        }
        let options = tokenizer.with_default_kwargs(openai::ChatOptions {
            template,
            ..r.take_options()
        });
        // Images and audio get tokens only the engine knows: hash the conversation before
        // the first message that has them (its own rendering is a prefix of the whole one's),
        // and forward the request as it came.
        let media_at = r.messages.iter().position(|m| m.media);
        let keep = openai::prompt_keep(r.truncate_prompt_tokens)?;
        let (tokens, untokenized) = match media_at {
            // The engine cuts the whole rendering, media tokens included, which the router
            // cannot count: no prefix of the cut one is known.
            Some(_) if keep.is_some() => (Vec::new(), None),
            // A rendering longer than is tokenized is stopped at the limit.
            None => match tokenizer.chat_text(&r.messages, &options, text_limit) {
                Ok(text) => {
                    let encoded =
                        encode(&text, options.add_special_tokens, keep).map_err(rejected)?;
                    or_untokenized(encoded, text.len(), keep)
                }
                Err(tokenizer::TokenizerError::TooLong { bytes, .. }) => {
                    metrics::counter!("kvroute_prompts_untokenized_total").increment(1);
                    (Vec::new(), Some(untokenized_estimate(bytes, keep)))
                }
                Err(e) => return Err(rejected(e)),
            },
            Some(0) => (Vec::new(), None),
            // A template may refuse the shortened conversation (a system turn with no user
            // turn after it) where it takes the whole one, which the engine renders: the
            // request is then routed without a prefix, not refused.
            Some(k) => {
                let mut before = openai::ChatOptions {
                    add_generation_prompt: false,
                    continue_final_message: false,
                    ..options
                };
                // The kwargs win over the fixed variables: not over this one, or the text
                // before the media would not be a prefix of the whole.
                before.kwargs.shift_remove("add_generation_prompt");
                let tokens = tokenizer
                    .chat_text(&r.messages[..k], &before, text_limit)
                    .ok()
                    .and_then(|text| encode(&text, before.add_special_tokens, None).ok())
                    .flatten()
                    .unwrap_or_default();
                (tokens, None)
            }
        };
        Parsed {
            untokenized,
            media: media_at.is_some(),
            max_tokens: r.max_tokens(),
            n: r.n.unwrap_or(1),
            stream: r.stream.unwrap_or(false),
            include_usage: openai::include_usage(r.stream_options),
            model: r.model.unwrap_or_default(),
            tokens,
            priority: r.priority,
            service_tier: r.service_tier,
            cache_salt: r.cache_salt,
            reports_full: openai::VllmXargs::reports_full(r.vllm_xargs.as_ref()),
        }
    } else {
        let r: CompletionRequest = serde_json::from_slice(body).map_err(invalid)?;
        openai::check_stream_options(r.stream, r.stream_options)?;
        let max_tokens = r.max_tokens;
        let keep = openai::prompt_keep(r.truncate_prompt_tokens)?;
        let (tokens, untokenized) = match r.prompt {
            Prompt::Text(t) => or_untokenized(
                encode(&t, r.add_special_tokens.unwrap_or(true), keep).map_err(rejected)?,
                t.len(),
                keep,
            ),
            Prompt::Tokens(mut t) => {
                tokenizer::keep_last(&mut t, keep);
                (t, None)
            }
            Prompt::Batch(n) => return Err(ApiError::prompt_batch(n)),
        };
        Parsed {
            untokenized,
            media: false,
            model: r.model.unwrap_or_default(),
            tokens,
            max_tokens,
            n: r.n.unwrap_or(1),
            stream: r.stream.unwrap_or(false),
            include_usage: openai::include_usage(r.stream_options),
            priority: r.priority,
            service_tier: r.service_tier,
            cache_salt: r.cache_salt,
            reports_full: openai::VllmXargs::reports_full(r.vllm_xargs.as_ref()),
        }
    };
    if parsed.n == 0 || parsed.n > MAX_N {
        return Err(ApiError::bad_request(format!(
            "n must be between 1 and {MAX_N}"
        )));
    }
    if parsed.cache_salt.as_deref() == Some("") {
        // As vLLM refuses it.
        return Err(ApiError::bad_request(
            "cache_salt must be a non-empty string if provided",
        ));
    }
    if parsed.tokens.is_empty() && !parsed.media && parsed.untokenized.is_none() {
        return Err(ApiError::bad_request("prompt must not be empty"));
    }
    Ok(parsed)
}

/// Parses and tokenizes a completion (`chat = false`) or chat completion body exactly as the
/// handlers do: the prompt's token count, or the client's error (`kvroute-bench fuzz` feeds
/// it arbitrary bytes).
pub fn decode_request(tokenizer: &Tokenizer, body: &[u8], chat: bool) -> Result<usize, ApiError> {
    parse(tokenizer, body, chat).map(|p| p.tokens.len())
}

/// Requests asking vLLM for full KV event reporting are logged at most this often (each is
/// counted).
static REPORT_MODE_LOGGED: crate::process::LogEvery =
    crate::process::LogEvery::new(Duration::from_secs(60));

/// A prompt ready for the scheduler: its block hashes at its model's block size and every
/// worker's cached prefix of it.
struct Prepared {
    parsed: Parsed,
    /// The client's body as it came, less vLLM's full KV event reporting (what an engine's
    /// own OpenAI endpoint is sent; [`openai::VllmXargs`]).
    raw: Bytes,
    /// `raw`'s share of the bodies' memory budget, released with it.
    _held: Reservation,
    /// What the prompt's blocks are salted with (adapter, cache_salt).
    salt: crate::protocol::Salt,
    blocks: Vec<crate::protocol::BlockHash>,
    overlaps: crate::indexer::OverlapScores,
    block_size: usize,
}

impl Prepared {
    /// Reads, parses, tokenizes and hashes a request.
    async fn read(
        router: &Router,
        req: hyper::Request<Incoming>,
        chat: bool,
    ) -> Result<Prepared, ApiError> {
        let (body, held) = read_body(router, req).await?;
        Prepared::parse(router, body, held, chat).await
    }

    /// Parses, tokenizes and hashes a body read by [`read_body`]; `/admin/explain` and the
    /// completion endpoints share it.
    async fn parse(
        router: &Router,
        body: Bytes,
        held: Reservation,
        chat: bool,
    ) -> Result<Prepared, ApiError> {
        let tokenizer = Arc::clone(&router.tokenizer);
        let text_limit = router.config.max_tokenize_bytes;
        let view = router.plane.view();
        let (parsed, block_size, blocks, salt, raw) = router
            .off_runtime(move || {
                let mut parsed = parse_within(&tokenizer, &body, chat, text_limit)?;
                // What an engine is sent: as it came, less vLLM's full KV event reporting,
                // which its mirror would take for copies that are never removed.
                let raw = match parsed.reports_full {
                    false => body,
                    true => openai::without_report_mode(&body)
                        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))?
                        .unwrap_or(body),
                };
                if view.workers.is_empty() {
                    return Err(ApiError::no_workers());
                }
                if parsed.model.is_empty() {
                    // No model named: vLLM serves its (first) model; the router, the one
                    // its fleet serves, if there is one. The body goes on without a name.
                    parsed.model = match view.base_models()[..] {
                        [only] => only.to_owned(),
                        ref several => {
                            return Err(ApiError::bad_request(format!(
                                "model is required: this fleet serves {}",
                                several.join(", ")
                            )));
                        }
                    };
                }
                let block_size = view
                    .block_size(&parsed.model)
                    .and_then(NonZeroUsize::new)
                    .ok_or_else(|| ApiError::model_not_found(&parsed.model))?;
                // A LoRA adapter's blocks are salted with its name and a request's
                // cache_salt, by the engine as here.
                let salt = view.salt(&parsed.model, parsed.cache_salt.as_deref());
                let blocks = hash_blocks(&parsed.tokens, block_size, salt);
                Ok((parsed, block_size.get(), blocks, salt, raw))
            })
            .await??;
        let seqs: Vec<SeqHash> = blocks.iter().map(|b| b.seq).collect();
        let overlaps = router.plane.indexer().find_matches_seq(&seqs);
        Ok(Prepared {
            parsed,
            raw,
            _held: held,
            salt,
            blocks,
            overlaps,
            block_size,
        })
    }

    fn request(&self) -> RouteRequest<'_> {
        RouteRequest {
            model: &self.parsed.model,
            blocks: &self.blocks,
            prompt_tokens: self.parsed.prompt_tokens(),
            block_size: self.block_size,
            overlaps: &self.overlaps,
            max_tokens: self.parsed.booked_max_tokens(),
            n: self.parsed.n,
            session: None,
        }
    }
}

async fn explain(
    router: &Router,
    req: hyper::Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let prepared = Prepared::read(router, req, false).await?;
    let request = prepared.request();
    let now = router.now_ms();
    let (mut candidates, out) = {
        let s = router.scheduler.lock();
        let candidates = s.candidates(now, &request);
        let out = s.sitting_out(now, &candidates);
        (candidates, out)
    };
    let reachable = candidates
        .iter()
        .map(scheduler::Candidate::cached_blocks)
        .max()
        .unwrap_or(0);
    candidates.sort_by(|a, b| a.cost.total_cmp(&b.cost));
    let rows: Vec<_> = candidates
        .iter()
        .map(|c| serde_json::json!({
            "worker": c.key.0, "dp_rank": c.key.1.0, "device_blocks": c.overlap.device, "host_blocks": c.overlap.host,
            "disk_blocks": c.overlap.disk, "booked_prefix_blocks": c.booked_prefix, "cost": c.cost, "busy": c.busy,
            "cached_blocks": c.cached_blocks(), "work_tokens": c.work.total(), "booked_work_tokens": c.booked_work_tokens,
            "room": c.room, "sitting_out": out.contains(&c.key),
        }))
        .collect();
    // What a decision now would report: the lowest cost among those with room, leaving out
    // those sitting out an ejection as a decision does (a session's affinity and a band's
    // share of the budget are not known here).
    let eligible: Vec<&scheduler::Candidate> = candidates
        .iter()
        .filter(|c| !out.contains(&c.key))
        .collect();
    let pick = eligible
        .iter()
        .find(|c| c.room && !c.busy)
        .or(eligible.first())
        .copied();
    let receipt = pick.map(|c| {
        serde_json::json!({
            "worker": c.key.0, "dp_rank": c.key.1.0, "cached_blocks": c.cached_blocks(),
            "reachable_blocks": reachable, "prompt_blocks": prepared.blocks.len(), "cost": c.cost,
        })
    });
    Ok(json(
        StatusCode::OK,
        serde_json::json!({"model": prepared.parsed.model, "prompt_blocks": prepared.blocks.len(),
            "would_pick": pick.map(|c| c.key.0), "receipt": receipt, "candidates": rows})
        .to_string(),
    ))
}

/// An in-flight slot, released on drop: when the answer is complete, which for a stream is
/// when its relay ends, not when its headers go out.
pub(crate) struct InFlight {
    router: Arc<Router>,
    /// Taken over the limit while the request is read, until its band says whether a
    /// queued request of a lower band gives it its place ([`InFlight::confirm`]).
    provisional: bool,
}

/// Requests read at once over `max_inflight`, each on a provisional slot, to learn whether
/// a queued request of a lower band gives it its place.
const PROVISIONAL_SLOTS: usize = 64;

impl InFlight {
    /// One of the `max_inflight` slots; with every one taken while requests are queued,
    /// a provisional one (of [`PROVISIONAL_SLOTS`] over the limit) for the request to be
    /// read, its band to be known ([`InFlight::confirm`]); else 429.
    fn take(router: &Arc<Router>) -> Result<InFlight, ApiError> {
        let limit = router.config.max_inflight;
        let slot = |provisional| InFlight {
            router: Arc::clone(router),
            provisional,
        };
        if router.inflight.fetch_add(1, Ordering::Relaxed) < limit {
            return Ok(slot(false));
        }
        if router.provisional.fetch_add(1, Ordering::Relaxed) < PROVISIONAL_SLOTS
            && !router.queue.lock().is_empty()
        {
            return Ok(slot(true));
        }
        router.provisional.fetch_sub(1, Ordering::Relaxed);
        router.inflight.fetch_sub(1, Ordering::Relaxed);
        Err(ApiError::overloaded(limit))
    }

    /// The request was read and is of `band`: a provisional slot becomes its own if a
    /// queued request of a lower band gives it its place ([`Router::displace_for`],
    /// answered 429), else the request is refused 429 (dropped, the slot goes). A request
    /// that does not parse, or names no model served, displaces nobody. Until a displaced
    /// request's handler wakes and lets go of its slot, the count is over the limit by one.
    fn confirm(&mut self, band: i64) -> Result<(), ApiError> {
        if !std::mem::take(&mut self.provisional) {
            return Ok(());
        }
        self.router.provisional.fetch_sub(1, Ordering::Relaxed);
        if self.router.displace_for(band) {
            Ok(())
        } else {
            Err(ApiError::overloaded(self.router.config.max_inflight))
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.router.inflight.fetch_sub(1, Ordering::Relaxed);
        if self.provisional {
            self.router.provisional.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

async fn completions(
    router: &Arc<Router>,
    req: hyper::Request<Incoming>,
    chat: bool,
) -> Result<Response<Body>, ApiError> {
    // Read once, here: the tenant of the key the request was let in with (a key list
    // re-read since `handle` checked it could name none).
    let keys = router.api_keys();
    let api_key: Option<Arc<str>> = match bearer_key(req.headers(), &keys.keys) {
        Some(i) => Some(Arc::clone(&keys.tenants[i])),
        None if router.keys_required() => return Err(ApiError::unauthorized()),
        None => None,
    };
    let headers = req.headers().clone();
    let (body, mut held) = read_body(router, req).await?;
    // The request's headers are kept with it (its class, its id, what is passed on), through
    // the queue too: up to the connection's 64 KiB head each, counted with its body.
    let header_bytes: usize = headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len())
        .sum();
    let with_headers = held.bytes() + header_bytes;
    if !router.bodies.cover(&mut held, with_headers) {
        return Err(ApiError::bodies_over_budget(router.bodies.bytes()));
    }
    match complete(router, &headers, api_key.clone(), body.clone(), held, chat).await {
        // A completions prompt list: one request per prompt, answers merged.
        Err(e) if e.code == Some(openai::PROMPT_BATCH) && !chat => {
            batch::complete_batch(router, &headers, api_key, body).await
        }
        answer => answer,
    }
}

/// Answers one request whose body is read.
async fn complete(
    router: &Arc<Router>,
    headers: &hyper::HeaderMap,
    api_key: Option<Arc<str>>,
    body: Bytes,
    held: Reservation,
    chat: bool,
) -> Result<Response<Body>, ApiError> {
    // The slot is taken once the body is in: a client uploading slowly holds a connection
    // and its body's share of the memory budget, not one of the requests the router
    // processes at once (4,096 slow uploads would otherwise turn everyone away).
    let mut inflight = Some(InFlight::take(router)?);
    let prepared = Prepared::parse(router, body, held, chat).await?;
    let p = &prepared.parsed;
    let mut class = Class::read(
        &router.config.headers,
        headers,
        api_key.as_deref(),
        p.priority,
        p.service_tier.as_deref(),
    )?;
    if let Some(slot) = &mut inflight {
        slot.confirm(class.band)?;
    }
    class.scope_session(&p.model);
    if p.reports_full {
        // Counted here, for a request on its way to a worker (each prompt of a batch).
        metrics::counter!("kvroute_kv_report_mode_removed_total").increment(1);
        if REPORT_MODE_LOGGED.due() {
            tracing::warn!(
                "a request asked vLLM for full KV event reporting (vllm_xargs.kv_cache_report_mode: full): taken out of the body an engine is sent, as the re-announced blocks would stay in the router's index after the engine evicted them (each is counted in kvroute_kv_report_mode_removed_total; said at most every minute)"
            );
        }
    }
    let mut body = proxy::Upstream {
        generate: None,
        raw: prepared.raw.clone(),
        chat,
        receipt: class.receipt,
        media: p.media,
        passed: proxy::PASSED_HEADERS
            .iter()
            .filter_map(|name| {
                Some((
                    header::HeaderName::from_static(name),
                    headers.get(*name)?.clone(),
                ))
            })
            .collect(),
    };
    let mut request = prepared.request();
    request.session = class
        .session
        .as_ref()
        .map(|(id, hard)| scheduler::SessionRef { id, hard: *hard });
    let (mut decision, booking) = admit(router, &prepared, &class, &request).await?;
    let mut booking = Some(booking);
    // The generate body's share of the bodies' memory budget, once written.
    let mut generate_held = Reservation::default();
    let mut failed: Vec<WorkerKey> = Vec::new();
    let mut last_error: Option<ProxyError> = None;
    // One deadline for a non-streamed answer, the retries included: each retry gets what
    // the workers tried before left of it, not a whole one more.
    let answer_by = Instant::now() + Duration::from_millis(router.config.upstream_body_timeout_ms);
    // Less than this left is no chance for a worker (its 504 would blame it): the client
    // gets the last worker's error instead.
    let retry_floor = Duration::from_millis(router.config.worker_timeout_ms.min(1_000));
    for attempt in 0..=router.config.retries {
        if attempt > 0
            && !p.stream
            && answer_by.saturating_duration_since(Instant::now()) < retry_floor
        {
            break;
        }
        if attempt == 0 {
            router.retry_budget.lock().on_request(router.now_ms());
        } else if !router.retry_budget.lock().has_retry(router.now_ms()) {
            metrics::counter!("kvroute_retries_refused_total").increment(1);
            tracing::debug!("no retry left in the budget: the client gets the worker's error");
            break;
        }
        if attempt > 0 {
            // Retried where it was not tried: the request was admitted, the budgets are
            // not applied again.
            let retry = router
                .scheduler
                .lock()
                .route_excluding(router.now_ms(), &request, &failed);
            let Some(retry) = retry else { break };
            router.retry_budget.lock().spend();
            admission::record_decision(&retry);
            decision = retry;
            booking = Some(Booking::new(router, decision.booking));
        }
        // A worker whose cache is guessed from the prompts routed to it shows them all: it
        // says nothing of how the engine hashes (the hash-mismatch alarm).
        let guessed = router.guessed(decision.chosen.key.0);
        let last = prepared.blocks.last().map(|b| b.seq).filter(|_| !guessed);
        let booking = booking
            .take()
            .expect("invariant: every attempt has its booking")
            .expecting(decision.chosen.key.0, last);
        let key = decision.chosen.key;
        let api = router.plane.view().workers.get(&key.0).map(|w| w.api);
        if api.is_some_and(|api| body.needs_generate(api)) {
            if p.untokenized.is_some() {
                // A kvroute worker generates from the router's tokens.
                return Err(ApiError::prompt_not_tokenized(
                    router.config.max_tokenize_bytes,
                ));
            }
            let generate = generate_body(p, prepared.salt, chat);
            if !router.bodies.cover(&mut generate_held, generate.len()) {
                // Beside its own body it could never fit: no retry would pass.
                let never = generate.len() + prepared._held.bytes() > router.bodies.bytes();
                return Err(if never {
                    ApiError::too_large(router.bodies.bytes() - prepared._held.bytes())
                } else {
                    ApiError::bodies_over_budget(router.bodies.bytes())
                });
            }
            body.generate = Some(generate);
        }
        let outcome = forward(
            router,
            &decision,
            booking,
            &body,
            p.stream,
            answer_by,
            &mut inflight,
        )
        .await;
        router.note_reachability(key, outcome.as_ref().map(|_| ()), p.stream);
        match outcome {
            Ok(response) => {
                // Reported once the worker has taken the prompt (a stream's first token, or
                // its headers held as long as they may be; a whole answer), before the
                // conversation's next turn: a worker that failed or refused it never
                // computed it, and a guess that it holds it would send the next turns after
                // a cache hit that is not there.
                // A stream that opened with an error event is such a refusal.
                let refused = response.extensions().get::<proxy::Refused>().is_some();
                if let (true, false, Some(sink)) =
                    (guessed, refused, router.decisions.lock().as_ref())
                    && sink
                        .try_send(RoutedPrompt {
                            key,
                            blocks: prepared.blocks.clone(),
                        })
                        .is_err()
                {
                    metrics::counter!("kvroute_routed_reports_dropped_total", "reason" => "queue_full").increment(1);
                }
                return Ok(response);
            }
            Err(e) => {
                metrics::counter!("kvroute_proxy_errors_total", "kind" => e.label(), "fault" => fault_label(&e)).increment(1);
                if !e.retry_elsewhere() {
                    return Err(e.to_api());
                }
                tracing::warn!(worker = %decision.chosen.key.0, error = %e, "worker failed before the client was answered; trying another");
                // Its other ranks sit behind the same endpoint (and the same engine), which
                // fails them the same way; and a request counts against a worker's ejection
                // once.
                failed.push(decision.chosen.key);
                failed.extend(router.scheduler.lock().ranks(decision.chosen.key.0));
                last_error = Some(e);
            }
        }
    }
    Err(match last_error {
        Some(e) => e.to_api(),
        // Workers of the model were registered when the request was read, none now.
        None => ApiError::model_not_found(&p.model),
    })
}

/// Routes the request at once if nothing waits and a worker has room; else queues it and
/// waits for its turn: a worker with room for its work, routed and booked; or 429 once its
/// band's deadline passes; or 503 if every worker left. If the client goes away meanwhile,
/// this future is dropped and its ticket leaves the queue.
async fn admit(
    router: &Arc<Router>,
    prepared: &Prepared,
    class: &Class,
    request: &RouteRequest<'_>,
) -> Result<(scheduler::Decision, Booking), ApiError> {
    let p = &prepared.parsed;
    let routable = || Routable {
        model: p.model.clone(),
        blocks: prepared.blocks.clone(),
        prompt_tokens: p.prompt_tokens(),
        block_size: prepared.block_size,
        max_tokens: p.booked_max_tokens(),
        n: p.n,
        session: class.session.clone(),
    };
    let (mut guard, rx, ttl_ms) = match router.enter(class, request, routable)? {
        Entered::Admitted(admitted) => return Ok(*admitted),
        Entered::Queued { guard, rx, ttl_ms } => (guard, rx, ttl_ms),
    };
    let band = guard.band;
    // The queue's driver admits it: one pump at a time, however fast requests arrive.
    router.room.notify_one();
    // The pump answers by the deadline; the extra seconds are a backstop, not the rule.
    let outcome =
        tokio::time::timeout(Duration::from_millis(ttl_ms.saturating_add(5_000)), rx).await;
    guard.reason = "deadline";
    drop(guard);
    match outcome {
        Ok(Ok(Ok(admitted))) => Ok(admitted),
        Ok(Ok(Err(Refusal::Expired { band, waited_ms }))) => {
            let retry_after_s = (waited_ms / 1000).clamp(1, 60);
            Err(ApiError::queue_deadline(band, waited_ms, retry_after_s))
        }
        Ok(Ok(Err(Refusal::NoWorkers))) => Err(ApiError::no_workers()),
        Ok(Ok(Err(Refusal::ShuttingDown))) => Err(ApiError::shutting_down()),
        Ok(Ok(Err(Refusal::Displaced { band, by }))) => Err(ApiError::displaced(band, by)),
        Ok(Err(_)) | Err(_) => Err(ApiError::queue_deadline(band, ttl_ms, 1)),
    }
}

fn fault_label(e: &ProxyError) -> &'static str {
    match e.fault() {
        openai::Fault::Client => "client",
        openai::Fault::Worker => "worker",
        openai::Fault::Router => "router",
    }
}

#[cfg(test)]
mod tests;
