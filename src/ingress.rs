//! The HTTP front door (hyper 1): OpenAI completions and chat completions, routed by KV
//! overlap and load, proxied to the chosen worker's internal generate endpoint and relayed
//! back as they stream; plus health, readiness, models, metrics and the admin views.

pub mod openai;
pub mod tokenizer;

use std::convert::Infallible;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Response, StatusCode, header};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::events::load::LoadShare;
use crate::events::plane::EventPlane;
use crate::protocol::{DpRank, Salt, SeqHash, hash_blocks};
use crate::scheduler::{Decision, RouteRequest, Scheduler, WorkerKey};
use openai::{ApiError, ChatRequest, CompletionRequest, Prompt};
use tokenizer::Tokenizer;

/// The response body of every kvroute HTTP endpoint.
pub type Body = BoxBody<Bytes, Infallible>;

/// Settings of the HTTP front door.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct IngressConfig {
    /// Largest request body, bytes.
    pub max_body_bytes: usize,
    /// Requests in flight beyond which new ones get 429.
    pub max_inflight: usize,
    /// Other workers tried when one fails before its first byte.
    pub retries: usize,
    /// How long a worker may take to answer with headers, ms.
    pub worker_timeout_ms: u64,
}

impl Default for IngressConfig {
    fn default() -> Self {
        IngressConfig {
            max_body_bytes: 8 << 20,
            max_inflight: 4096,
            retries: 2,
            worker_timeout_ms: 10_000,
        }
    }
}

/// Everything a request handler needs.
pub struct Router {
    /// The scheduler (shared with load sharing).
    pub scheduler: Arc<Mutex<Scheduler>>,
    /// The event plane (index, fleet).
    pub plane: EventPlane,
    /// Load sharing with other replicas, if any.
    pub load: Option<LoadShare>,
    /// Settings.
    pub config: IngressConfig,
    /// Renders `/metrics`.
    pub metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
    /// Text to token ids.
    pub tokenizer: Tokenizer,
    client: Client<HttpConnector, Full<Bytes>>,
    inflight: AtomicUsize,
    draining: AtomicBool,
    started: Instant,
}

impl Router {
    /// A router over a running plane. Keeps the scheduler's worker list in step with the
    /// fleet the plane follows.
    pub fn new(
        scheduler: Arc<Mutex<Scheduler>>,
        plane: EventPlane,
        load: Option<LoadShare>,
        config: IngressConfig,
        metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
        tokenizer: Tokenizer,
    ) -> Arc<Router> {
        let mut connector = HttpConnector::new();
        // Streamed chunks must not wait for Nagle's algorithm (40 ms stalls per first byte).
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new()).build(connector);
        let router = Arc::new(Router {
            scheduler,
            plane,
            load,
            config,
            metrics,
            tokenizer,
            client,
            inflight: AtomicUsize::new(0),
            draining: AtomicBool::new(false),
            started: Instant::now(),
        });
        let mut changes = router.plane.fleet_changes();
        let r = Arc::clone(&router);
        tokio::spawn(async move {
            use crate::discovery::FleetEvent;
            loop {
                match changes.recv().await {
                    Ok(FleetEvent::Up(info)) => {
                        let mut s = r.scheduler.lock();
                        for rank in 0..info.dp_size.max(1) {
                            s.add_worker((info.id, DpRank(rank)), info.g1_blocks);
                        }
                    }
                    Ok(FleetEvent::Down { id, .. }) => {
                        let mut s = r.scheduler.lock();
                        let keys: Vec<WorkerKey> =
                            s.workers().map(|(k, _)| k).filter(|k| k.0 == id).collect();
                        for k in keys {
                            s.remove_worker(k);
                        }
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(_) => return,
                }
            }
        });
        router
    }

    /// Starts a graceful shutdown: `/ready` fails from now on (the load balancer stops
    /// sending), requests in flight go on.
    pub fn begin_drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
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

    /// Makes sure the scheduler knows every worker the plane has registered. The fleet
    /// broadcast keeps them in step, but a request can arrive between a registration and
    /// its broadcast being handled: it must not find "no worker".
    fn sync_workers(&self, workers: &[crate::discovery::WorkerInfo]) {
        let mut scheduler = self.scheduler.lock();
        let known: Vec<WorkerKey> = scheduler.workers().map(|(k, _)| k).collect();
        for info in workers {
            for rank in 0..info.dp_size.max(1) {
                if !known.contains(&(info.id, DpRank(rank))) {
                    scheduler.add_worker((info.id, DpRank(rank)), info.g1_blocks);
                }
            }
        }
    }
}

/// Serves HTTP on `listener` until `shutdown` turns true.
pub async fn serve(
    router: Arc<Router>,
    listener: tokio::net::TcpListener,
    shutdown: watch::Receiver<bool>,
) {
    serve_http(
        listener,
        move |req| handle(Arc::clone(&router), req),
        shutdown,
    )
    .await;
}

/// An HTTP/1.1 accept loop (router and workers share it): every connection gets
/// TCP_NODELAY, so streamed chunks leave as they are written instead of after Nagle's
/// delay (≈ 40 ms per first byte on a reused connection), and is served by `handler`
/// until `shutdown` turns true.
pub async fn serve_http<F, Fut>(
    listener: tokio::net::TcpListener,
    handler: F,
    mut shutdown: watch::Receiver<bool>,
) where
    F: Fn(hyper::Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Response<Body>> + Send + 'static,
{
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shutdown.changed() => return,
        };
        let Ok((stream, _)) = accepted else { continue };
        let _ = stream.set_nodelay(true);
        let handler = handler.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let response = handler(req);
                async move { Ok::<_, Infallible>(response.await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn json(status: StatusCode, body: String) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)).boxed())
        .expect("invariant: static response parts are valid")
}

fn api_error(e: &ApiError) -> Response<Body> {
    metrics::counter!("kvroute_http_errors_total", "status" => e.status.to_string(), "fault" => e.fault_label()).increment(1);
    let mut r = json(
        StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        e.body(),
    );
    if e.status == 429 {
        r.headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
    }
    r
}

async fn handle(router: Arc<Router>, req: hyper::Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_owned();
    match (req.method().clone(), path.as_str()) {
        (Method::GET, "/health") => json(StatusCode::OK, r#"{"status":"ok"}"#.into()),
        (Method::GET, "/ready") => ready(&router),
        (Method::GET, "/v1/models") => models(&router),
        (Method::GET, "/metrics") => {
            let text = router
                .metrics
                .as_ref()
                .map(|h| h.render())
                .unwrap_or_default();
            Response::builder()
                .header(header::CONTENT_TYPE, "text/plain; version=0.0.4")
                .body(Full::new(Bytes::from(text)).boxed())
                .expect("invariant: static response parts are valid")
        }
        (Method::GET, "/admin/workers") => admin_workers(&router),
        (Method::POST, "/admin/explain") => {
            match read_json::<CompletionRequest>(&router, req).await {
                Ok(r) => explain(&router, r),
                Err(e) => api_error(&e),
            }
        }
        (Method::POST, "/v1/completions") => {
            match read_json::<CompletionRequest>(&router, req).await {
                Ok(r) => match tokens_of(&router, r.prompt) {
                    Ok(tokens) => {
                        complete(&router, r.model, tokens, r.max_tokens, r.stream, false).await
                    }
                    Err(e) => api_error(&e),
                },
                Err(e) => api_error(&e),
            }
        }
        (Method::POST, "/v1/chat/completions") => {
            match read_json::<ChatRequest>(&router, req).await {
                Ok(r) if r.messages.is_empty() => {
                    api_error(&ApiError::bad_request("messages must not be empty"))
                }
                Ok(r) => match router.tokenizer.encode_chat(&r.messages) {
                    Ok(tokens) => {
                        complete(&router, r.model, tokens, r.max_tokens, r.stream, true).await
                    }
                    Err(e) => api_error(&ApiError::bad_request(e.to_string())),
                },
                Err(e) => api_error(&e),
            }
        }
        _ => api_error(&ApiError::not_found()),
    }
}

/// Token ids of a prompt: text goes through the tokenizer, token ids are used as they are.
fn tokens_of(router: &Router, prompt: Prompt) -> Result<Vec<u32>, ApiError> {
    match prompt {
        Prompt::Text(t) => router
            .tokenizer
            .encode(&t)
            .map_err(|e| ApiError::bad_request(e.to_string())),
        Prompt::Tokens(t) => Ok(t),
    }
}

async fn read_json<T: serde::de::DeserializeOwned>(
    router: &Router,
    req: hyper::Request<Incoming>,
) -> Result<T, ApiError> {
    let limit = router.config.max_body_bytes;
    let body = Limited::new(req.into_body(), limit)
        .collect()
        .await
        .map_err(|_| ApiError::too_large(limit))?
        .to_bytes();
    serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))
}

fn ready(router: &Router) -> Response<Body> {
    let live = router.plane.streams().iter().any(|(_, s)| s.live);
    let workers = router.plane.workers().len();
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

fn models(router: &Router) -> Response<Body> {
    let mut names: Vec<String> = router
        .plane
        .workers()
        .into_iter()
        .map(|w| w.model)
        .collect();
    names.sort();
    names.dedup();
    let data: Vec<_> = names
        .iter()
        .map(|m| serde_json::json!({"id": m, "object": "model", "owned_by": "kvroute"}))
        .collect();
    json(
        StatusCode::OK,
        serde_json::json!({"object": "list", "data": data}).to_string(),
    )
}

fn admin_workers(router: &Router) -> Response<Body> {
    let streams = router.plane.streams();
    let scheduler = router.scheduler.lock();
    let workers: Vec<_> = router
        .plane
        .workers()
        .into_iter()
        .map(|w| {
            let stream = streams.iter().find(|((id, _), _)| *id == w.id).map(|(_, s)| s.clone()).unwrap_or_default();
            let load = scheduler.load((w.id, DpRank(0)));
            serde_json::json!({
                "id": w.id, "url": w.url, "model": w.model, "epoch": w.epoch,
                "block_size": w.block_size, "g1_blocks": w.g1_blocks, "g2_blocks": w.g2_blocks,
                "synced": stream.live, "event_lag_ms": stream.last_lag_ms, "resyncs": stream.stats.resyncs,
                "booked_prefill_blocks": load.map_or(0.0, |l| l.prefill_blocks),
                "booked_blocks": load.map_or(0, |l| l.decode_blocks()),
                "booked_requests": load.map_or(0, |l| l.requests),
            })
        })
        .collect();
    let sizes = router.plane.indexer().sizes();
    json(
        StatusCode::OK,
        serde_json::json!({"workers": workers, "index": {"blocks": sizes.blocks, "entries": sizes.entries}, "silent": router.plane.silent_workers()})
            .to_string(),
    )
}

/// The fleet's block size (workers of one cluster share it) and the model check.
fn fleet_for(router: &Router, model: &str) -> Result<NonZeroUsize, ApiError> {
    let workers = router.plane.workers();
    router.sync_workers(&workers);
    if workers.is_empty() {
        return Err(ApiError::unavailable("no worker registered"));
    }
    let Some(w) = workers.iter().find(|w| w.model == model) else {
        return Err(ApiError::bad_request(format!(
            "model {model:?} is not served here"
        )));
    };
    NonZeroUsize::new(w.block_size)
        .ok_or_else(|| ApiError::unavailable("worker registered block size 0"))
}

/// A prompt ready for the scheduler: its block hashes at the fleet's block size and every
/// worker's cached prefix of it.
struct Prepared {
    tokens: Vec<u32>,
    blocks: Vec<crate::protocol::BlockHash>,
    overlaps: crate::indexer::OverlapScores,
    block_size: usize,
}

impl Prepared {
    fn new(router: &Router, model: &str, tokens: Vec<u32>) -> Result<Prepared, ApiError> {
        let block_size = fleet_for(router, model)?;
        let blocks = hash_blocks(&tokens, block_size, Salt::NONE);
        let seqs: Vec<SeqHash> = blocks.iter().map(|b| b.seq).collect();
        let overlaps = router.plane.indexer().find_matches_seq(&seqs);
        Ok(Prepared {
            tokens,
            blocks,
            overlaps,
            block_size: block_size.get(),
        })
    }

    fn request(&self) -> RouteRequest<'_> {
        RouteRequest {
            blocks: &self.blocks,
            prompt_tokens: self.tokens.len(),
            block_size: self.block_size,
            overlaps: &self.overlaps,
        }
    }
}

fn explain(router: &Router, r: CompletionRequest) -> Response<Body> {
    let tokens = match tokens_of(router, r.prompt) {
        Ok(t) => t,
        Err(e) => return api_error(&e),
    };
    let prepared = match Prepared::new(router, &r.model, tokens) {
        Ok(p) => p,
        Err(e) => return api_error(&e),
    };
    let request = prepared.request();
    let mut candidates = router.scheduler.lock().candidates(&request);
    candidates.sort_by(|a, b| a.cost.total_cmp(&b.cost));
    let rows: Vec<_> = candidates
        .iter()
        .map(|c| serde_json::json!({
            "worker": c.key.0, "dp_rank": c.key.1.0, "device_blocks": c.overlap.device, "host_blocks": c.overlap.host,
            "disk_blocks": c.overlap.disk, "booked_prefix_blocks": c.booked_prefix, "cost": c.cost, "busy": c.busy,
        }))
        .collect();
    let pick = candidates.first().map(|c| c.key.0);
    json(
        StatusCode::OK,
        serde_json::json!({"prompt_blocks": prepared.blocks.len(), "would_pick": pick, "candidates": rows})
            .to_string(),
    )
}

/// An in-flight slot, released on drop: when the answer is complete, which for a stream is
/// when its relay ends, not when its headers go out.
struct InFlight(Arc<Router>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn complete(
    router: &Arc<Router>,
    model: String,
    tokens: Vec<u32>,
    max_tokens: u32,
    stream: bool,
    chat: bool,
) -> Response<Body> {
    if tokens.is_empty() {
        return api_error(&ApiError::bad_request("prompt must not be empty"));
    }
    if router.inflight.fetch_add(1, Ordering::Relaxed) >= router.config.max_inflight {
        router.inflight.fetch_sub(1, Ordering::Relaxed);
        return api_error(&ApiError::overloaded(router.config.max_inflight));
    }
    let mut guard = Some(InFlight(Arc::clone(router)));
    let prepared = match Prepared::new(router, &model, tokens) {
        Ok(p) => p,
        Err(e) => return api_error(&e),
    };
    let request = prepared.request();
    let body = Bytes::from(
        serde_json::json!({"token_ids": prepared.tokens, "max_tokens": max_tokens, "stream": stream, "chat": chat})
            .to_string(),
    );
    let mut failed: Vec<WorkerKey> = Vec::new();
    for _ in 0..=router.config.retries {
        let decision = router
            .scheduler
            .lock()
            .route_excluding(router.now_ms(), &request, &failed);
        let Some(decision) = decision else { break };
        let key = decision.chosen.key;
        match forward(router, &decision, body.clone(), stream, &mut guard).await {
            Ok(response) => return response,
            Err(Forward::Retry(reason)) => {
                tracing::warn!(worker = %key.0, %reason, "worker failed before its first byte; trying another");
                router.scheduler.lock().complete(decision.booking);
                if let Some(load) = &router.load {
                    load.completed(decision.booking);
                }
                failed.push(key);
            }
            Err(Forward::Client(e)) => {
                router.scheduler.lock().complete(decision.booking);
                return api_error(&e);
            }
        }
    }
    api_error(&ApiError::unavailable("no worker could take the request"))
}

enum Forward {
    /// Nothing reached the client; another worker may serve it.
    Retry(String),
    /// The worker refused the request itself (a client error).
    Client(ApiError),
}

/// Sends the request to the decision's worker; relays its answer.
async fn forward(
    router: &Arc<Router>,
    decision: &Decision,
    body: Bytes,
    stream: bool,
    inflight: &mut Option<InFlight>,
) -> Result<Response<Body>, Forward> {
    let key = decision.chosen.key;
    let Some(info) = router.plane.worker(key.0) else {
        return Err(Forward::Retry("worker left".into()));
    };
    router.plane.note_routed(key.0);
    if let Some(load) = &router.load {
        load.booked(decision.booking);
    }
    let request = hyper::Request::post(format!(
        "{}/internal/generate",
        info.url.trim_end_matches('/')
    ))
    .header(header::CONTENT_TYPE, "application/json")
    .body(Full::new(body))
    .map_err(|e| Forward::Retry(e.to_string()))?;
    let timeout = Duration::from_millis(router.config.worker_timeout_ms);
    let response = match tokio::time::timeout(timeout, router.client.request(request)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return Err(Forward::Retry(e.to_string())),
        Err(_) => return Err(Forward::Retry("timed out".into())),
    };
    let status = response.status();
    if status.is_client_error() {
        let bytes = response
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let message = String::from_utf8_lossy(&bytes).into_owned();
        return Err(Forward::Client(ApiError::bad_request(message)));
    }
    if !status.is_success() {
        return Err(Forward::Retry(format!("worker answered {status}")));
    }
    let o = decision.chosen.overlap;
    let overlap = format!("device={};host={};disk={}", o.device, o.host, o.disk);
    let builder = Response::builder()
        .status(StatusCode::OK)
        .header("x-kvroute-worker", key.0.to_string())
        .header("x-kvroute-overlap", overlap);
    let booking = decision.booking;
    let worker = key.0.to_string();
    let started = Instant::now();
    if !stream {
        let bytes = match response.into_body().collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => return Err(Forward::Retry(e.to_string())),
        };
        finish(router, booking, true).await;
        metrics::histogram!("kvroute_e2e_seconds", "worker" => worker)
            .record(started.elapsed().as_secs_f64());
        return Ok(builder
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(bytes).boxed())
            .expect("invariant: static response parts are valid"));
    }
    // Relay frames as they arrive; the relay task owns the worker's body, so a client that
    // goes away drops it (the worker sees the connection close and cancels the request).
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    let r = Arc::clone(router);
    let mut upstream = response.into_body();
    let inflight = inflight.take();
    tokio::spawn(async move {
        let mut first = true;
        let mut last = started;
        loop {
            match upstream.frame().await {
                Some(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    let now = Instant::now();
                    let (name, since) = if first {
                        ("kvroute_ttft_seconds", started)
                    } else {
                        ("kvroute_itl_seconds", last)
                    };
                    metrics::histogram!(name, "worker" => worker.clone())
                        .record(now.duration_since(since).as_secs_f64());
                    last = now;
                    if first {
                        first = false;
                        r.scheduler.lock().first_token(booking);
                        if let Some(load) = &r.load {
                            load.first_token(booking);
                        }
                    }
                    if tx.send(data).await.is_err() {
                        break; // client gone
                    }
                }
                Some(Err(e)) => {
                    let err = ApiError::unavailable(format!("worker failed mid-stream: {e}"));
                    let _ = tx
                        .send(Bytes::from(format!(
                            "data: {}\n\ndata: [DONE]\n\n",
                            err.body()
                        )))
                        .await;
                    break;
                }
                None => break,
            }
        }
        drop(upstream);
        drop(inflight);
        finish(&r, booking, false).await;
        metrics::histogram!("kvroute_e2e_seconds", "worker" => worker)
            .record(started.elapsed().as_secs_f64());
    });
    let body = StreamBody::new(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
    }));
    Ok(builder
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(BodyExt::boxed(body))
        .expect("invariant: static response parts are valid"))
}

async fn finish(router: &Router, booking: crate::scheduler::BookingId, first_token: bool) {
    {
        let mut s = router.scheduler.lock();
        if first_token {
            s.first_token(booking);
        }
        s.complete(booking);
    }
    if let Some(load) = &router.load {
        load.completed(booking);
    }
}
