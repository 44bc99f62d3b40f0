//! The worker process (I/O): the engine on its own thread ([`engine_thread`]), an HTTP/1.1
//! server (hyper) whose internal generate endpoint takes token ids and streams OpenAI-shaped
//! SSE chunks as the engine produces tokens, and the event plane: a publisher task fed by a
//! bounded channel (overflow drops batches, which the router detects as a gap and resyncs),
//! snapshot replies and the registration.
//!
//! What blocks what: the engine thread blocks only on its input channel (until its next
//! step is due); it never waits for a client, for NATS or for the HTTP server. Handlers
//! reach it through a bounded channel (full: 503). Each request's outputs go through a
//! bounded channel too: a client that falls that far behind is cut off with an error event,
//! counted, never silently short of tokens.

mod engine_thread;
mod http;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kvroute::discovery::{LeaseConfig, Registration, Registry, WorkerInfo};
use kvroute::events::transport::Transport;
use kvroute::http::HttpConfig;
use kvroute::protocol::{DpRank, EventBatch, WorkerId};
use parking_lot::Mutex;
use tokio::sync::{mpsc, watch};

use crate::EngineConfig;
use crate::engine::Engine;
use crate::plane::{SnapshotRequest, WorkerPlane};
use engine_thread::{EngineHandle, EngineInput};
pub use http::{decode_generate, sidecar_response};

/// The epoch of an incarnation starting now: start time in ms in the high bits, so later
/// incarnations compare larger (`EventBatch` docs), and 16 low bits against ties.
pub fn new_epoch() -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    ((now.as_millis() as u64) << 16) | u64::from(now.subsec_nanos() & 0xffff)
}

/// A worker id that survives restarts: derived from the host name and the port, so a pod
/// (whose host name is its name) or a process on a fixed port keeps its metric series and
/// its registry key. 48 bits, so it stays exact in JSON numbers.
pub fn stable_id(host_name: &str, port: u16) -> WorkerId {
    stable_id_of(host_name, &port.to_string())
}

/// A worker id from this host's name and what tells its workers apart there (a port, or a
/// sidecar's engine URL): the same across restarts.
pub fn stable_id_of(host_name: &str, what: &str) -> WorkerId {
    let h = xxhash_rust::xxh3::xxh3_64(format!("{host_name}:{what}").as_bytes());
    WorkerId((h & 0xffff_ffff_ffff).max(1))
}

/// This machine's host name (`HOSTNAME`, else the kernel's), if it has one.
pub fn host_name() -> Option<String> {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
}

/// How a worker process runs.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Worker id.
    pub id: WorkerId,
    /// Address to listen on (port 0: any free port).
    pub listen: SocketAddr,
    /// URL to register; `None`: `http://<listen address>`.
    pub url: Option<String>,
    /// Cluster name in subjects and the registry bucket.
    pub cluster: String,
    /// Model name served.
    pub model: String,
    /// The engine.
    pub engine: EngineConfig,
    /// Registration lease.
    pub lease: LeaseConfig,
    /// Epoch of this incarnation.
    pub epoch: u64,
    /// Renders `/metrics` (the process's Prometheus recorder), if installed.
    pub metrics: Option<kvroute::process::Metrics>,
    /// Tokenizes text prompts of the OpenAI endpoints.
    pub tokenizer: Arc<kvroute::ingress::tokenizer::Tokenizer>,
    /// The HTTP server's limits.
    pub http: HttpConfig,
    /// Serve `POST /admin/faults` (pause the publisher, stall after headers, fail the
    /// engine): for chaos tests only.
    pub fault_injection: bool,
    /// Required as `Authorization: Bearer` on every endpoint but `GET /health` and `GET
    /// /metrics` (vLLM's `--api-key` guards `/v1/*`; this worker also generates on
    /// `/internal/generate`).
    pub api_key: Option<kvroute::auth::Secret>,
    /// Look like a real engine (`--emulate`): KV events on ZMQ in its wire format, no NATS
    /// and no registration (a sidecar or a router in direct mode does that).
    pub emulate: Option<Arc<crate::emulate::Emulation>>,
}

/// Faults a worker can be told to inject (`--fault-injection`), for chaos tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Faults {
    /// Publish no KV events (they queue, then overflow: the router resyncs after).
    pub pause_publisher: bool,
    /// Answer generate requests with headers, then nothing.
    pub stall_after_headers: bool,
    /// Answer generate requests with headers, then end the body without a token (an
    /// engine that died during the prefill).
    pub end_after_headers: bool,
    /// Answer generate requests with nothing at all (not even headers).
    pub stall_before_headers: bool,
    /// Answer generate requests with this error status (e.g. 429, 503, 400).
    pub status: Option<u16>,
    /// Answer generate requests with 200 and an HTML page (a proxy in front of an engine
    /// that failed).
    pub html_answer: bool,
    /// Answer `status` this long after the request came (an engine failing late, after
    /// generating a whole non-streamed answer).
    pub status_delay_ms: Option<u64>,
    /// Streams: send the headers, then wait this long before the first chunk (a long
    /// prefill, or the engine's own queue).
    pub first_chunk_delay_ms: Option<u64>,
    /// Streams: an SSE comment (`: keep-alive`) every this many ms, from the headers on and
    /// after `[DONE]` without end, as a proxy in front of an engine may send.
    pub pings_ms: Option<u64>,
    /// Streams: send the first chunk, then nothing more (an engine hung mid-decode).
    pub stall_after_first_chunk: bool,
    /// Streams: wait this long before the headers (an engine fetching a prompt's media).
    pub headers_delay_ms: Option<u64>,
    /// Streams: send the headers, then this many bytes of one event that does not end (no
    /// blank line), then nothing (an event past a router's limit: `echo` and logprobs of a
    /// long prompt).
    pub event_bytes_without_end: Option<u64>,
}

/// Events queued for the publisher; beyond, batches are dropped (the heartbeat still
/// announces their ids, so the router sees the gap and resyncs from a snapshot).
const EVENT_QUEUE_BATCHES: usize = 1024;

/// A running worker.
pub struct Worker {
    /// Where its HTTP server listens.
    pub addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    registration: Option<Registration>,
    /// Its engines, one per data-parallel rank.
    engines: Vec<EngineHandle>,
    /// Changes to `Some(reason)` when any engine fails.
    failed: watch::Receiver<Option<String>>,
    active: Arc<AtomicUsize>,
    /// The HTTP server: once told to shut down, it ends when its last connection has (a
    /// request still reading its body or being tokenized, an answer still being written).
    serving: tokio::task::JoinHandle<()>,
    /// The injected faults (`POST /admin/faults` changes them where enabled).
    _faults: Arc<watch::Sender<Faults>>,
    /// The request bodies' budget, for tests to wait on it being full or empty.
    #[cfg(test)]
    bodies: kvroute::http::budget::BodyBudget,
}

impl Worker {
    /// Starts the engine thread, the event plane and the HTTP server, then registers.
    pub async fn start(
        config: ServerConfig,
        transport: Transport,
        registry: Registry,
    ) -> anyhow::Result<Worker> {
        // The test engine may have several data-parallel ranks; a worker of kvroute's own
        // has one.
        let ranks = config.emulate.as_ref().map_or(1, |e| e.ranks.len().max(1));
        let engines = (0..ranks)
            .map(|r| {
                Engine::new(
                    config.engine.clone(),
                    config.id,
                    DpRank(r as u32),
                    config.epoch,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        let listener = tokio::net::TcpListener::bind(config.listen).await?;
        let addr = listener.local_addr()?;
        let info = Arc::new(Mutex::new(WorkerInfo {
            id: config.id,
            url: config
                .url
                .clone()
                .unwrap_or_else(|| format!("http://{addr}")),
            block_size: config.engine.block_size,
            g1_blocks: config.engine.g1_blocks,
            g2_blocks: config.engine.g2_blocks,
            model: config.model.clone(),
            dp_size: 1,
            epoch: config.epoch,
            last_event_ids: vec![0],
            api: kvroute::discovery::WorkerApi::Kvroute,
            adapters: Vec::new(),
            engine_load: None,
            event_faults: None,
            engine_rank_kv_usage: Vec::new(),
            learns_routes: false,
            left: false,
        }));
        info.lock().validate()?;
        let plane = WorkerPlane::new(transport.clone(), &config.cluster, Arc::clone(&info));
        let (shutdown, shutdown_rx) = watch::channel(false);
        // The worker keeps the sender, with or without fault injection: a dropped sender
        // would end the publisher's wait on the faults.
        let (faults, faults_rx) = watch::channel(Faults::default());
        let faults = Arc::new(faults);
        let mut handles = Vec::new();
        for (rank, engine) in engines.into_iter().enumerate() {
            let (events_tx, events) = mpsc::channel(EVENT_QUEUE_BATCHES);
            let emulation = config.emulate.clone().map(|e| (e, rank));
            handles.push(EngineHandle::spawn(
                engine,
                events_tx,
                plane.clone(),
                emulation,
            )?);
            match &config.emulate {
                Some(emulation) => {
                    tokio::spawn(Arc::clone(emulation).publish(events, shutdown_rx.clone()));
                }
                None => {
                    tokio::spawn(publish(
                        plane.clone(),
                        events,
                        faults_rx.clone(),
                        shutdown_rx.clone(),
                    ));
                }
            }
        }
        let (snapshots_tx, mut snapshots) = mpsc::channel::<SnapshotRequest>(16);
        WorkerPlane::serve_snapshots(transport, &config.cluster, config.id, snapshots_tx).await?;
        let inputs: Vec<_> = handles.iter().map(EngineHandle::inputs).collect();
        tokio::spawn(async move {
            while let Some(request) = snapshots.recv().await {
                // A full engine queue drops the request: the router asks again. A rank
                // this worker does not have is not answered either.
                if let Some(rank) = inputs.get(request.dp_rank.0 as usize) {
                    let _ = rank.try_send(EngineInput::Snapshot(request));
                }
            }
        });
        // Any rank's engine failing fails the worker.
        let (failure, failed) = watch::channel(None);
        for h in &handles {
            let (mut rank_failed, failure) = (h.failed(), failure.clone());
            tokio::spawn(async move {
                if let Ok(reason) = rank_failed.wait_for(Option::is_some).await {
                    failure.send_replace(reason.clone());
                }
            });
        }
        let active = Arc::new(AtomicUsize::new(0));
        let bodies = kvroute::http::budget::BodyBudget::new(http::BODY_BUDGET);
        let serving = tokio::spawn(http::serve(
            listener,
            config.http.clone(),
            http::State {
                engines: handles.iter().map(EngineHandle::inputs).collect(),
                next_rank: Arc::default(),
                metrics: config.metrics.clone(),
                tokenizer: Arc::clone(&config.tokenizer),
                model: config.model.clone(),
                next_id: Arc::default(),
                active: Arc::clone(&active),
                faults: config.fault_injection.then(|| Arc::clone(&faults)),
                fingerprint: format!("fp_{:012x}", config.epoch & 0xffff_ffff_ffff),
                body_read_timeout: Duration::from_millis(config.http.body_read_timeout_ms),
                bodies: bodies.clone(),
                emulate: config.emulate.clone(),
                api_key: config.api_key.clone(),
                tokenize_permits: Arc::new(tokio::sync::Semaphore::new(
                    std::thread::available_parallelism().map_or(1, |n| n.get()),
                )),
                digests: Arc::new(tokio::sync::Semaphore::new(1)),
                max_tokens_held: config
                    .engine
                    .g1_blocks
                    .saturating_mul(config.engine.block_size),
            },
            shutdown_rx,
        ));
        let registration = match config.emulate {
            Some(_) => None,
            None => Some(Registration::start(registry, info, &config.lease).await?),
        };
        Ok(Worker {
            addr,
            shutdown,
            registration,
            engines: handles,
            failed,
            active,
            serving,
            _faults: faults,
            #[cfg(test)]
            bodies,
        })
    }

    /// Bytes of request bodies held now.
    #[cfg(test)]
    pub(crate) fn body_bytes_in_use(&self) -> usize {
        self.bodies.in_use()
    }

    /// Changes to `Some(reason)` when the engine fails; the worker must then leave.
    pub fn failed(&self) -> watch::Receiver<Option<String>> {
        self.failed.clone()
    }

    /// Requests being served.
    pub fn active(&self) -> usize {
        self.active.load(Ordering::Relaxed)
    }

    /// A graceful exit (SIGTERM): deregisters first (routers stop sending), stops accepting
    /// connections, lets requests in flight finish, then stops the engine: all within
    /// `drain` of the call, the goodbye included (a goodbye waiting on an unreachable
    /// registry for a lease once came first, and the drain after it ran into the pod's
    /// SIGKILL). Returns how many requests were still running.
    pub async fn shutdown(mut self, drain: Duration) -> usize {
        let deadline = tokio::time::Instant::now() + drain;
        if tokio::time::timeout_at(deadline, self.leave())
            .await
            .is_err()
        {
            tracing::warn!(
                "goodbye not acknowledged within the drain timeout: routers drop this worker when its lease lapses"
            );
        }
        let _ = self.shutdown.send(true);
        while self.active() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Requests not yet counted as running (reading their body, being tokenized) and
        // answers still being written end with their connections, which the server waits
        // for: within the same deadline.
        let _ = tokio::time::timeout_at(deadline, &mut self.serving).await;
        let left = self.active();
        self.engines.iter().for_each(EngineHandle::stop);
        left
    }

    /// Leaves the fleet (routers stop sending), serving on: what a failed engine's worker
    /// does before it exits, so that its metrics can still be scraped.
    pub async fn leave(&mut self) {
        if let Some(r) = self.registration.take() {
            r.goodbye().await;
        }
    }

    /// Stops at once: deregisters, stops serving and the engine.
    pub async fn stop(mut self) {
        self.leave().await;
        let _ = self.shutdown.send(true);
        self.engines.iter().for_each(EngineHandle::stop);
    }
}

/// Publishes the engine's batches in order. While `pause_publisher` is on, nothing is sent
/// and the queue fills (the engine then drops batches, as under real back-pressure).
async fn publish(
    plane: WorkerPlane,
    mut events: mpsc::Receiver<EventBatch>,
    mut faults: watch::Receiver<Faults>,
    mut shutdown: watch::Receiver<bool>,
) {
    loop {
        let mut batch = match next_batch(&mut events, &mut faults, &mut shutdown).await {
            Next::Batch(b) => b,
            Next::Again => continue,
            Next::Stop => return,
        };
        // The engine's clock is process-relative; the router measures lag in Unix time.
        batch.sent_unix_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        if let Err(e) = plane.publish(&batch).await {
            tracing::warn!(error = %e, "publishing KV events failed; the router will resync");
            plane.note_sent(&batch);
        }
    }
}

/// What the publisher does next.
#[derive(Debug)]
enum Next {
    /// Publish this batch.
    Batch(EventBatch),
    /// The faults changed: look at them again.
    Again,
    /// The engine or the worker stopped.
    Stop,
}

/// Waits for the next batch to publish, a change of the injected faults, or the shutdown.
/// A faults channel whose sender is gone never changes again: it is not a change (an
/// `Err` taken for one would loop without waiting).
async fn next_batch(
    events: &mut mpsc::Receiver<EventBatch>,
    faults: &mut watch::Receiver<Faults>,
    shutdown: &mut watch::Receiver<bool>,
) -> Next {
    if faults.borrow().pause_publisher {
        return tokio::select! {
            Ok(_) = faults.wait_for(|f| !f.pause_publisher) => Next::Again,
            _ = shutdown.changed() => Next::Stop,
        };
    }
    tokio::select! {
        b = events.recv() => b.map_or(Next::Stop, Next::Batch),
        Ok(()) = faults.changed() => Next::Again,
        _ = shutdown.changed() => Next::Stop,
    }
}

#[cfg(test)]
mod tests;
