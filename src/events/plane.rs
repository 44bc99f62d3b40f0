//! The router's event plane: one task owns the fleet ([`Fleet`]): it takes the registry's
//! reports, the workers' event payloads and the clock, and alone opens and closes the
//! per-(worker, rank) stream tasks ([`WorkerStream`], each the only writer of its index
//! lane), and adds and removes the scheduler's entries. Stream tasks apply their batches in
//! order and fetch snapshots when they must resync.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use super::fleet::{
    BatchVerdict, Departure, Fleet, FleetCommand, FleetConfig, Heard, Refusal, StreamKey,
};
use super::stream::{Command, StreamConfig, StreamStats, WorkerStream};
use super::transport::Transport;
use crate::discovery::{RegistryEvent, Watch, WorkerInfo};
use crate::indexer::{ApplyOutcome, Indexer};
use crate::protocol::{
    AssembleError, EventBatch, Limits, MAX_SNAPSHOT_BLOCKS, Snapshot, SnapshotAssembler, WorkerId,
    decode, decode_snapshot_chunk,
};
use crate::scheduler::Scheduler;
use intake::{Delivery, Intake, Watermark, WatermarkGate};

mod intake;

/// Checks a cluster name, which names NATS subjects and the registry bucket: letters,
/// digits, `-` and `_` (a `.` or a wildcard would take other subjects; NATS refuses such a
/// bucket name, which a worker met as a minute of retries).
pub fn check_cluster(cluster: &str) -> Result<(), String> {
    if cluster.is_empty()
        || !cluster
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return Err(format!(
            "cluster {cluster:?}: use letters, digits, '-' and '_' (it names NATS subjects)"
        ));
    }
    Ok(())
}

/// Subject of one worker's events.
pub fn events_subject(cluster: &str, worker: WorkerId) -> String {
    format!("kvroute.{cluster}.events.{worker}")
}

/// First wait before a rank without an index slot resyncs, ms; it doubles up to
/// [`NO_SLOT_MAX_WAIT_MS`] while no slot frees up.
const NO_SLOT_FIRST_WAIT_MS: u64 = 1_000;
const NO_SLOT_MAX_WAIT_MS: u64 = 30_000;

/// Whether `subject` is `worker`'s events subject (its last token is the worker's id).
fn subject_names(subject: &str, worker: WorkerId) -> bool {
    subject
        .rsplit('.')
        .next()
        .and_then(|t| t.parse::<u64>().ok())
        .is_some_and(|id| id == worker.0)
}

/// Subject a worker answers snapshot requests on.
pub fn snapshot_subject(cluster: &str, worker: WorkerId) -> String {
    format!("kvroute.{cluster}.snapshot.{worker}")
}

/// Settings of the router's event plane.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PlaneConfig {
    /// Cluster name in subjects.
    pub cluster: String,
    /// Per-stream ordering and resync limits.
    pub stream: StreamConfig,
    /// Batches queued per stream task; a full queue drops the batch and forces a resync.
    pub queue_batches: usize,
    /// Blocks those queued batches may name in all (a batch naming none counts one): a
    /// worker flooding its subject with large batches, faster than its stream applies
    /// them, must not park gigabytes in the router. Past it, as for a full queue.
    pub queue_blocks: usize,
    /// How often the fleet and the stream tasks check their timers, ms.
    pub tick_ms: u64,
    /// How long a departed worker's late batches are recognised and dropped, ms.
    pub tombstone_ttl_ms: u64,
    /// How often the fleet owner checks that no stream, lane or scheduler entry outlived
    /// its worker, ms.
    pub sweep_ms: u64,
    /// Publish → apply lags kept for [`EventPlane::lag_samples`], and publish → receipt
    /// ones for [`EventPlane::transit_samples`], and receipt → apply ones for
    /// [`EventPlane::router_samples`] (the newest ones; the
    /// `kvroute_event_lag_seconds` and `kvroute_event_transit_seconds` histograms see every
    /// batch). Benchmarks raise it.
    pub lag_samples: usize,
    /// Event messages received and not yet taken by the fleet owner, bytes (payload and
    /// subject, plus 64 each): past it, arriving ones are dropped and counted
    /// (`kvroute_event_intake_dropped_total`), and the streams' gap detection resyncs their
    /// workers. The NATS client's own queue is bounded by a count of messages (65,536), each
    /// up to the server's max_payload, which bounds no memory worth the name.
    pub intake_bytes: usize,
    /// Snapshots in the router at once, all streams together (at least one), from the
    /// fetch until the stream has applied it (or let it go). After a NATS reconnect every
    /// stream resyncs; unbounded, a fleet's every snapshot would be in the router's memory
    /// at once, beside the index it replaces. Fetches beyond it wait their turn in order.
    pub snapshot_fetches: usize,
}

impl Default for PlaneConfig {
    fn default() -> Self {
        PlaneConfig {
            cluster: "default".into(),
            stream: StreamConfig::default(),
            queue_batches: 4096,
            queue_blocks: 1 << 20,
            tick_ms: 50,
            tombstone_ttl_ms: 60_000,
            sweep_ms: 1_000,
            lag_samples: 1_024,
            intake_bytes: 256 << 20,
            snapshot_fetches: 32,
        }
    }
}

/// Counters of the plane as a whole.
#[derive(Debug, Default)]
pub struct PlaneCounters {
    /// Payloads that failed validation.
    pub malformed: AtomicU64,
    /// Batches dropped because a stream's queue was full.
    pub queue_overflows: AtomicU64,
    /// Workers removed after leaving.
    pub workers_left: AtomicU64,
    /// Workers removed after their lease expired.
    pub workers_expired: AtomicU64,
    /// Batches dropped because their worker is not registered (never was, or left).
    pub batches_dropped: AtomicU64,
    /// Registrations refused (a block size conflicting with the model's workers).
    pub registrations_refused: AtomicU64,
    /// Streams, lanes or scheduler entries found without a registered worker and removed
    /// (0 unless something is wrong).
    pub orphans_swept: AtomicU64,
    /// Event messages dropped on arrival: the fleet owner was `intake_bytes` behind.
    pub intake_dropped: AtomicU64,
    /// Registrations read back from the registry older than their lease, kept aside (a
    /// worker that stopped without a goodbye).
    pub stale_registrations: AtomicU64,
    /// Fleet views published (each a copy of every registration; see [`VIEW_EVERY`]).
    pub views_published: AtomicU64,
}

/// What the plane reports of one stream.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StreamStatus {
    /// Its epoch.
    pub epoch: Option<u64>,
    /// Whether it applies live events.
    pub live: bool,
    /// Counters.
    pub stats: StreamStats,
    /// Publish → apply lag of the last batch, ms (from the batch's send time).
    pub last_lag_ms: f64,
    /// Batches applied.
    pub applied: u64,
    /// Times what the index held of this stream was dropped at once, once it had applied a
    /// batch: a new incarnation or a resync (its lane retired), or a `Cleared` event (vLLM's
    /// `reset_prefix_cache`).
    pub wipes: u64,
}

/// The registered workers, as of the fleet owner's last change (readers take a snapshot).
#[derive(Clone, Debug, Default)]
pub struct FleetView {
    /// Registered workers by id.
    pub workers: BTreeMap<WorkerId, WorkerInfo>,
}

impl FleetView {
    /// The block size a model's prompts are hashed at: its workers' (the fleet refuses
    /// registrations that disagree), `None` if no registered worker serves it.
    pub fn block_size(&self, model: &str) -> Option<usize> {
        self.workers
            .values()
            .find(|w| w.model == model || w.adapters.iter().any(|a| a == model))
            .map(|w| w.block_size)
    }

    /// The salt a request for `model` with `cache_salt` is hashed with, as an engine salts
    /// the blocks it computes: by the adapter's name for a LoRA adapter (none for a base
    /// model) and by the request's `cache_salt`.
    pub fn salt(&self, model: &str, cache_salt: Option<&str>) -> crate::protocol::Salt {
        let base = self.workers.values().any(|w| w.model == model);
        crate::engines::engine_salt((!base).then_some(model), cache_salt)
    }

    /// The base models served (no adapters), sorted, each once.
    pub fn base_models(&self) -> Vec<&str> {
        let set: BTreeSet<&str> = self.workers.values().map(|w| w.model.as_str()).collect();
        set.into_iter().collect()
    }

    /// Every model and LoRA adapter served, sorted.
    pub fn models(&self) -> Vec<&str> {
        let set: BTreeSet<&str> = self
            .workers
            .values()
            .flat_map(|w| {
                std::iter::once(w.model.as_str()).chain(w.adapters.iter().map(String::as_str))
            })
            .collect();
        set.into_iter().collect()
    }
}

enum Input {
    /// A batch, and when the plane received it (µs since the epoch).
    Batch(EventBatch, u64),
    Watermark {
        epoch: u64,
        last_id: u64,
    },
    /// A snapshot, the request (resync) it answers, and its fetch's permit, held until the
    /// stream has applied it: a snapshot queued or being applied is still in memory.
    Snapshot(Snapshot, u64, tokio::sync::OwnedSemaphorePermit),
    /// The fetch for this request (resync) has had its turn and asked the worker.
    FetchStarted(u64),
}

impl Input {
    /// What it counts against its stream's `queue_blocks` while queued: a batch's blocks
    /// (at least one); nothing else (snapshots are fetched one at a time, on request).
    fn queued_blocks(&self) -> usize {
        match self {
            Input::Batch(b, _) => b.block_count().max(1),
            _ => 0,
        }
    }
}

/// Requests routed to a stream that never published an event: a worker that serves traffic
/// but publishes nothing gives zero overlap forever (the field's most common KV-router
/// failure). A worker that has published is not silent when its requests store nothing new
/// (a full prefix hit publishes no event), so only a stream never heard from is flagged.
#[derive(Debug, Default)]
struct Silence {
    routed_since_event: AtomicU64,
    /// A batch arrived, or a heartbeat announced events published (`last_id > 0`).
    heard: AtomicBool,
    flagged: AtomicBool,
}

impl Silence {
    fn heard(&self, worker: &str) {
        self.heard.store(true, Ordering::Relaxed);
        self.routed_since_event.store(0, Ordering::Relaxed);
        if self.flagged.swap(false, Ordering::Relaxed) {
            metrics::gauge!("kvroute_worker_silent", "worker" => worker.to_owned()).set(0.0);
        }
    }
}

/// Requests routed to a worker never heard from, before it is flagged as silent.
const SILENT_AFTER_REQUESTS: u64 = 8;

struct StreamHandle {
    tx: mpsc::Sender<Input>,
    /// Blocks named by the batches in `tx`'s queue.
    queued_blocks: Arc<AtomicUsize>,
    overflowed: Arc<AtomicBool>,
    status: Arc<Mutex<StreamStatus>>,
    silence: Arc<Silence>,
    close: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

/// Publish → apply lag samples (ms), the most recent ones, for reports.
#[derive(Debug, Default)]
pub struct LagSamples {
    samples: Vec<f64>,
    next: usize,
    capacity: usize,
}

impl LagSamples {
    fn record(&mut self, ms: f64) {
        if self.samples.len() < self.capacity {
            self.samples.push(ms);
        } else if self.capacity > 0 {
            self.samples[self.next] = ms;
            self.next = (self.next + 1) % self.capacity;
        }
    }
}

struct Shared {
    transport: Transport,
    indexer: Arc<Indexer>,
    config: PlaneConfig,
    /// Open streams. Only the fleet owner inserts and removes; others read.
    streams: Mutex<HashMap<StreamKey, StreamHandle>>,
    view: RwLock<Arc<FleetView>>,
    counters: PlaneCounters,
    /// Publish → applied to the index.
    lags: Mutex<LagSamples>,
    /// Publish → received from the transport (the part of the lag outside the router).
    transit: Mutex<LagSamples>,
    /// Received → applied, for batches applied on arrival (the router's own share).
    router: Mutex<LagSamples>,
    scheduler: Option<Arc<Mutex<Scheduler>>>,
    failure: watch::Sender<Option<String>>,
    /// Permits for snapshots in the router ([`PlaneConfig::snapshot_fetches`]).
    snapshot_fetches: Arc<tokio::sync::Semaphore>,
    /// A fault for tests: streams wait here before applying a snapshot.
    #[cfg(test)]
    hold_snapshot_applies: super::transport::Hold,
}

/// The running plane (a cheap handle).
#[derive(Clone)]
pub struct EventPlane {
    shared: Arc<Shared>,
}

impl EventPlane {
    /// Starts the plane: event subscription, the fleet owner, stream tasks. Workers join and
    /// leave `scheduler` (if given) as the fleet decides. Runs until `shutdown` turns true,
    /// or until its subscription or the registry watch ends, which is fatal (see
    /// [`EventPlane::failed`]).
    pub async fn start(
        transport: Transport,
        indexer: Arc<Indexer>,
        watch: Watch,
        config: PlaneConfig,
        scheduler: Option<Arc<Mutex<Scheduler>>>,
        shutdown: watch::Receiver<bool>,
    ) -> Result<EventPlane, super::transport::TransportError> {
        let subscription = transport
            .subscribe(&format!("kvroute.{}.events.>", config.cluster))
            .await?;
        // Started means subscribed: the server has our interest before we return.
        transport.synced().await;
        // None yet: the gauge exists, at 0, before any worker registers (a fleet that never
        // registered, say under a wrong cluster name, had no series for its alert to see).
        metrics::gauge!("kvroute_workers_registered").set(0.0);
        let fleet = Fleet::new(FleetConfig {
            lease_ttl_ms: watch.lease_ttl_ms,
            tombstone_ttl_ms: config.tombstone_ttl_ms,
        });
        let samples = || {
            Mutex::new(LagSamples {
                capacity: config.lag_samples,
                ..LagSamples::default()
            })
        };
        let (lags, transit, router) = (samples(), samples(), samples());
        let snapshot_fetches =
            Arc::new(tokio::sync::Semaphore::new(config.snapshot_fetches.max(1)));
        let shared = Arc::new(Shared {
            transport,
            indexer,
            config,
            streams: Mutex::default(),
            view: RwLock::default(),
            counters: PlaneCounters::default(),
            lags,
            transit,
            router,
            scheduler,
            failure: watch::channel(None).0,
            snapshot_fetches,
            #[cfg(test)]
            hold_snapshot_applies: Default::default(),
        });
        let owner = FleetOwner {
            shared: Arc::clone(&shared),
            fleet,
            start: Instant::now(),
            closing: Vec::new(),
            commands: Vec::new(),
            registry_healthy: watch.healthy,
            transit_seconds: metrics::histogram!("kvroute_event_transit_seconds"),
            refusals_logged: PerWorkerLog::new(Duration::from_secs(60)),
            lates_logged: PerWorkerLog::new(Duration::from_secs(600)),
            rejoins_logged: PerWorkerLog::new(Duration::from_secs(600)),
            conflicts_logged: PerWorkerLog::new(Duration::from_secs(600)),
            watermarks: WatermarkGate::default(),
            ask_barrier: false,
            view_stale: false,
            view_published: Instant::now(),
        };
        let intake = {
            let shared = Arc::clone(&shared);
            Intake::start(subscription, shared.config.intake_bytes, move || {
                shared
                    .counters
                    .intake_dropped
                    .fetch_add(1, Ordering::Relaxed);
                metrics::counter!("kvroute_event_intake_dropped_total").increment(1);
            })
        };
        tokio::spawn(owner.run(intake, watch.events, shutdown));
        Ok(EventPlane { shared })
    }

    /// Plane-wide counters.
    pub fn counters(&self) -> &PlaneCounters {
        &self.shared.counters
    }

    /// Status of every open stream, by key.
    pub fn streams(&self) -> Vec<(StreamKey, StreamStatus)> {
        let mut v: Vec<_> = self
            .shared
            .streams
            .lock()
            .iter()
            .map(|(k, h)| (*k, h.status.lock().clone()))
            .collect();
        v.sort_by_key(|(k, _)| *k);
        v
    }

    /// Whether this router hears `key`'s events now: its transport is connected and the
    /// stream applies live batches (no gap being repaired, no snapshot awaited). While it
    /// does not, a prompt missing from the index says nothing of the worker.
    pub fn hears(&self, key: StreamKey) -> bool {
        self.shared.transport.is_connected()
            && self
                .shared
                .streams
                .lock()
                .get(&key)
                .is_some_and(|h| h.status.lock().live)
    }

    /// The registered workers (a snapshot; cheap).
    pub fn view(&self) -> Arc<FleetView> {
        Arc::clone(&self.shared.view.read())
    }

    /// The workers registered now.
    pub fn workers(&self) -> Vec<WorkerInfo> {
        self.view().workers.values().cloned().collect()
    }

    /// One registered worker.
    pub fn worker(&self, id: WorkerId) -> Option<WorkerInfo> {
        self.view().workers.get(&id).cloned()
    }

    /// The index the plane feeds.
    pub fn indexer(&self) -> &Arc<Indexer> {
        &self.shared.indexer
    }

    /// Changes to `Some(reason)` if the plane stopped for good (its event subscription or
    /// the registry watch ended): the router can no longer follow the fleet and must exit.
    pub fn failed(&self) -> watch::Receiver<Option<String>> {
        self.shared.failure.subscribe()
    }

    /// The recent publish → apply lags, ms (up to the last `lag_samples` batches).
    pub fn lag_samples(&self) -> Vec<f64> {
        self.shared.lags.lock().samples.clone()
    }

    /// The recent publish → receipt lags, ms: the part of [`EventPlane::lag_samples`] spent
    /// before the router had the batch (publisher, NATS, network).
    pub fn transit_samples(&self) -> Vec<f64> {
        self.shared.transit.lock().samples.clone()
    }

    /// The recent receipt → apply times, ms, of batches applied on arrival (not held for a
    /// gap or a resync): the router's own share of the lag, its queue and the apply.
    pub fn router_samples(&self) -> Vec<f64> {
        self.shared.router.lock().samples.clone()
    }

    /// The ingress routed a request to `key`. A worker that keeps receiving requests but
    /// publishes no events is flagged (`kvroute_worker_silent`, and a warning).
    pub fn note_routed(&self, key: StreamKey) {
        let streams = self.shared.streams.lock();
        let Some(handle) = streams.get(&key) else {
            return;
        };
        let s = &handle.silence;
        if s.heard.load(Ordering::Relaxed) {
            return;
        }
        let routed = s.routed_since_event.fetch_add(1, Ordering::Relaxed) + 1;
        if routed >= SILENT_AFTER_REQUESTS && !s.flagged.swap(true, Ordering::Relaxed) {
            metrics::gauge!("kvroute_worker_silent", "worker" => key.0.to_string()).set(1.0);
            tracing::warn!(
                worker = %key.0,
                requests = routed,
                "worker serves traffic but has never published a KV event: its overlap will read zero (check its event publisher and NATS subject)"
            );
        }
    }

    /// Workers flagged as serving traffic without publishing events.
    pub fn silent_workers(&self) -> Vec<WorkerId> {
        let set: BTreeSet<WorkerId> = self
            .shared
            .streams
            .lock()
            .iter()
            .filter(|(_, h)| h.silence.flagged.load(Ordering::Relaxed))
            .map(|((w, _), _)| *w)
            .collect();
        set.into_iter().collect()
    }

    /// Asks every stream to resync (after a transport outage, when events may have been
    /// lost unseen).
    pub fn resync_all(&self) {
        self.shared.resync_all();
    }
}

impl Shared {
    /// What a payload may hold, by the server's `max_payload` now: a server restarted with
    /// a larger one (as the workers' own errors advise) lets workers send larger snapshot
    /// chunks and batches, which limits fixed when the router started refused for good.
    fn limits(&self) -> Limits {
        Limits::for_payload(self.transport.max_payload().max(1 << 20))
    }

    fn resync_all(&self) {
        for handle in self.streams.lock().values() {
            handle.overflowed.store(true, Ordering::Relaxed);
        }
    }

    fn send(&self, key: StreamKey, input: Input) {
        let streams = self.streams.lock();
        let Some(handle) = streams.get(&key) else {
            return;
        };
        let blocks = input.queued_blocks();
        let queued = handle.queued_blocks.fetch_add(blocks, Ordering::Relaxed);
        let over = blocks > 0 && queued + blocks > self.config.queue_blocks;
        if over || handle.tx.try_send(input).is_err() {
            handle.queued_blocks.fetch_sub(blocks, Ordering::Relaxed);
            self.counters
                .queue_overflows
                .fetch_add(1, Ordering::Relaxed);
            handle.overflowed.store(true, Ordering::Relaxed);
            metrics::counter!("kvroute_event_queue_overflows_total", "worker" => key.0.to_string())
                .increment(1);
        }
    }

    fn fail(&self, reason: &str) {
        tracing::error!(
            reason,
            "the event plane stopped: the router can no longer follow its fleet"
        );
        self.failure.send_replace(Some(reason.to_owned()));
    }
}

/// The one task that owns the fleet: registrations, leases, which streams exist.
struct FleetOwner {
    shared: Arc<Shared>,
    fleet: Fleet,
    start: Instant,
    /// Streams told to close whose tasks have not finished removing their lanes yet.
    closing: Vec<(StreamKey, tokio::task::JoinHandle<()>)>,
    commands: Vec<FleetCommand>,
    /// Whether workers can refresh their registrations now and the router hears them (see
    /// [`crate::discovery::Watch::healthy`]).
    registry_healthy: watch::Receiver<bool>,
    /// `kvroute_event_transit_seconds`, resolved once (it is recorded per batch, on the one
    /// task that reads every worker's events).
    transit_seconds: metrics::Histogram,
    /// Refused workers, logged once a minute each: a refused worker's every heartbeat is
    /// refused again (each is counted).
    refusals_logged: PerWorkerLog,
    /// Workers whose heartbeat came late, logged once per 10 minutes each (each late one
    /// is counted).
    lates_logged: PerWorkerLog,
    /// Workers registered again after their key was deleted under them, logged once per
    /// 10 minutes each (each is counted).
    rejoins_logged: PerWorkerLog,
    /// Ids two processes register under, logged once per 10 minutes each (each ignored
    /// registration is counted).
    conflicts_logged: PerWorkerLog,
    /// Heartbeats' watermarks held until the events they count have been read ([`intake`]).
    watermarks: WatermarkGate,
    /// The gate wants a barrier the intake has not been asked for yet (asked after the
    /// owner's next step).
    ask_barrier: bool,
    /// The fleet changed since the view was last published, and when that was.
    view_stale: bool,
    view_published: Instant,
}

/// Longest a changed fleet waits for its view while registrations keep arriving. A view is
/// a copy of every registration; published at each change, a router reading 10,000 workers'
/// registrations at start copied 5 × 10⁷ of them on the one task that reads every event.
/// It is published once the registrations waiting have been read, or after this long.
const VIEW_EVERY: Duration = Duration::from_millis(50);

/// Invalid registrations are logged at most this often, all together (each is counted).
static INVALID_LOGGED: crate::process::LogEvery =
    crate::process::LogEvery::new(Duration::from_secs(10));

/// Malformed event payloads are logged at most this often, all together (each is counted):
/// a publisher of another format version (a rolling upgrade) sends nothing else, and a
/// warning per payload on the task that reads every event slowed it until the intake
/// dropped good ones.
static MALFORMED_LOGGED: crate::process::LogEvery =
    crate::process::LogEvery::new(Duration::from_secs(10));

/// A warning said at most once per `every` for each worker. Workers logged within `every`
/// are remembered; the others are forgotten once [`PER_WORKER_LOGS`] are remembered.
#[derive(Debug)]
struct PerWorkerLog {
    every: Duration,
    at: HashMap<WorkerId, Instant>,
}

/// Workers a [`PerWorkerLog`] remembers before it forgets those logged long enough ago.
const PER_WORKER_LOGS: usize = 4096;

impl PerWorkerLog {
    fn new(every: Duration) -> PerWorkerLog {
        PerWorkerLog {
            every,
            at: HashMap::new(),
        }
    }

    /// Whether to say it of `id` now (and, if so, it counts as said).
    fn due(&mut self, id: WorkerId) -> bool {
        let now = Instant::now();
        if self
            .at
            .get(&id)
            .is_some_and(|at| now.duration_since(*at) < self.every)
        {
            return false;
        }
        if self.at.len() >= PER_WORKER_LOGS {
            let every = self.every;
            self.at.retain(|_, at| now.duration_since(*at) < every);
        }
        self.at.insert(id, now);
        true
    }
}

impl FleetOwner {
    async fn run(
        mut self,
        mut subscription: Intake,
        mut registry: mpsc::Receiver<RegistryEvent>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let mut tick =
            tokio::time::interval(Duration::from_millis(self.shared.config.tick_ms.max(1)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let sweep_every = self.shared.config.sweep_ms.max(1);
        let mut last_sweep = 0u64;
        let mut reconnects = self.shared.transport.reconnects();
        loop {
            if std::mem::take(&mut self.ask_barrier) {
                subscription.ask_barrier();
            }
            if self.view_stale
                && (registry.is_empty() || self.view_published.elapsed() >= VIEW_EVERY)
            {
                self.publish_view();
            }
            tokio::select! {
                delivery = subscription.next() => {
                    match delivery {
                        Some(Delivery::Message(message)) => {
                            self.on_payload(&message.subject, &message.payload);
                        }
                        Some(Delivery::Barrier) => {
                            let (released, again) = self.watermarks.on_barrier();
                            for (key, Watermark { epoch, last_id }) in released {
                                self.shared.send(key, Input::Watermark { epoch, last_id });
                            }
                            self.ask_barrier = again;
                        }
                        None => {
                            if !*shutdown.borrow() {
                                self.shared.fail("the event subscription ended");
                            }
                            break;
                        }
                    }
                }
                event = registry.recv() => {
                    let Some(event) = event else {
                        // At shutdown the watch goes first; only an unasked end is a failure.
                        if !*shutdown.borrow() {
                            self.shared.fail("the worker registry watch ended");
                        }
                        break;
                    };
                    self.on_registry(event);
                }
                _ = tick.tick() => {
                    let now = self.now_ms();
                    let heard =
                        self.shared.transport.is_connected() && *self.registry_healthy.borrow();
                    // A registry whose watch cannot be made again (a consumer limit, a
                    // revoked permission) leaves the router deaf for good while its own
                    // writes land: only this says so.
                    metrics::gauge!("kvroute_registry_heard").set(if heard { 1.0 } else { 0.0 });
                    if !heard {
                        // Deaf, not abandoned: no lease lapses while NATS is out of reach or
                        // the registry takes no heartbeats (the workers' HTTP may well be
                        // fine; routing to them goes on).
                        self.fleet.on_deaf_tick(now);
                    } else {
                        self.fleet.on_tick(now, &mut self.commands);
                    }
                    self.execute();
                    if now.saturating_sub(last_sweep) >= sweep_every {
                        last_sweep = now;
                        self.sweep();
                    }
                }
                changed = async { reconnects.as_mut().expect("guarded by the branch condition").changed().await }, if reconnects.is_some() => {
                    if changed.is_err() {
                        reconnects = None;
                        continue;
                    }
                    tracing::warn!("reconnected to NATS: resyncing every worker stream");
                    // Out of earshot, the router heard no heartbeat: that says nothing of
                    // the workers. A blip pauses their leases, a longer outage renews them.
                    self.fleet.on_reconnected(self.now_ms());
                    self.shared.resync_all();
                }
                _ = shutdown.changed() => break,
            }
        }
        let streams: Vec<StreamHandle> =
            self.shared.streams.lock().drain().map(|(_, h)| h).collect();
        for handle in streams {
            handle.task.abort();
        }
    }

    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    fn on_payload(&mut self, subject: &str, payload: &Bytes) {
        let received_us = unix_us();
        let batch = match decode(payload, &self.shared.limits()) {
            Ok(batch) => batch,
            Err(e) => {
                self.shared
                    .counters
                    .malformed
                    .fetch_add(1, Ordering::Relaxed);
                metrics::counter!("kvroute_event_malformed_total").increment(1);
                if MALFORMED_LOGGED.due() {
                    tracing::warn!(subject, error = %e, "dropping malformed event payload (each is counted in kvroute_event_malformed_total; this is said at most every 10 s)");
                }
                return;
            }
        };
        if !subject_names(subject, batch.worker) {
            // A worker publishes on its own subject only (which NATS permissions can
            // enforce): a batch naming another worker would write into that worker's
            // stream, and one of a larger epoch would retire its live incarnation.
            self.shared
                .counters
                .malformed
                .fetch_add(1, Ordering::Relaxed);
            metrics::counter!("kvroute_event_malformed_total").increment(1);
            if MALFORMED_LOGGED.due() {
                tracing::warn!(subject, worker = %batch.worker, "dropping a batch published on another worker's subject (each is counted in kvroute_event_malformed_total; this is said at most every 10 s)");
            }
            return;
        }
        if let Some(ms) = lag_ms(batch.sent_unix_us, received_us) {
            self.shared.transit.lock().record(ms);
            self.transit_seconds.record(ms / 1e3);
        }
        let key = (batch.worker, batch.dp_rank);
        match self
            .fleet
            .wake(self.now_ms(), key.0, batch.epoch, &mut self.commands)
        {
            None => {}
            Some(Err(refusal)) => self.refused(&refusal),
            Some(Ok(())) => {
                // Its registration was read back older than its lease.
                tracing::info!(
                    worker = %key.0,
                    "a worker whose registration was older than its lease publishes events: registered"
                );
                self.execute();
                // Its registration's engine load is older than a lease: none is better.
                if let Some(s) = &self.shared.scheduler {
                    s.lock().set_engine_load(key.0, None, &[]);
                }
                self.view_stale = true;
            }
        }
        let reason = match self.fleet.on_batch(self.now_ms(), key, batch.epoch) {
            BatchVerdict::Deliver => {
                return self.shared.send(key, Input::Batch(batch, received_us));
            }
            BatchVerdict::Unregistered => "unregistered",
            BatchVerdict::Departed => "departed",
            BatchVerdict::NoSuchRank => "no_such_rank",
        };
        self.shared
            .counters
            .batches_dropped
            .fetch_add(1, Ordering::Relaxed);
        metrics::counter!("kvroute_fleet_batches_dropped_total", "reason" => reason).increment(1);
        tracing::debug!(worker = %key.0, rank = %key.1, reason, "dropping a batch of a worker not in the fleet");
    }

    fn on_registry(&mut self, event: RegistryEvent) {
        let now = self.now_ms();
        match event {
            RegistryEvent::Put(info) => self.on_registration(now, info, None),
            RegistryEvent::Replayed { info, age_ms } => {
                self.on_registration(now, info, Some(age_ms));
            }
            RegistryEvent::Delete(id) => {
                self.fleet.on_goodbye(now, id, &mut self.commands);
                self.execute();
            }
        }
    }

    /// A registration, live or (with its age) read back from the registry's history.
    fn on_registration(&mut self, now: u64, info: WorkerInfo, replayed_age_ms: Option<u64>) {
        // Every registry's reports pass here: bound them before they cost anything.
        if let Err(e) = info.validate() {
            metrics::counter!("kvroute_registry_invalid_total").increment(1);
            if INVALID_LOGGED.due() {
                tracing::warn!(error = %e, "ignoring invalid worker registration (each is counted in kvroute_registry_invalid_total; this is said at most every 10 s)");
            }
            return;
        }
        if info.left {
            // A goodbye naming its incarnation, live or read back from the history: never
            // a registration.
            self.fleet
                .on_left(now, info.id, info.epoch, &mut self.commands);
            self.execute();
            return;
        }
        let changed = self
            .fleet
            .worker(info.id)
            .is_none_or(|old| !same_shape(old, &info));
        let reported = (info.id, info.engine_load, info.engine_rank_kv_usage.clone());
        let registered = match replayed_age_ms {
            None => self.fleet.on_registration(now, info, &mut self.commands),
            Some(age_ms) => {
                match self
                    .fleet
                    .on_replayed_registration(now, info, age_ms, &mut self.commands)
                {
                    Ok(Heard::KeptAside) => {
                        self.shared
                            .counters
                            .stale_registrations
                            .fetch_add(1, Ordering::Relaxed);
                        metrics::counter!("kvroute_registry_stale_total").increment(1);
                        tracing::info!(
                            worker = %reported.0,
                            age_ms,
                            "keeping aside a registration older than its lease (its worker stopped without a goodbye, or cannot reach the registry): not routed to until a batch of its events arrives"
                        );
                        return;
                    }
                    registered => registered,
                }
            }
        };
        let taken = match registered {
            Ok(heard) => heard == Heard::Registered,
            Err(refusal) => {
                self.refused(&refusal);
                false
            }
        };
        self.execute();
        // An older incarnation's heartbeat, ignored, reports another engine's load.
        if !taken {
            return;
        }
        if let (Some(s), (id, load, ranks)) = (&self.shared.scheduler, reported) {
            s.lock().set_engine_load(id, load, &ranks);
        }
        if changed {
            self.view_stale = true;
        }
    }

    /// Counts and reports a registration the fleet refused.
    fn refused(&mut self, refusal: &Refusal) {
        self.shared
            .counters
            .registrations_refused
            .fetch_add(1, Ordering::Relaxed);
        metrics::counter!("kvroute_fleet_registrations_refused_total").increment(1);
        let id = match refusal {
            Refusal::BlockSize { id, .. } => *id,
        };
        if self.refusals_logged.due(id) {
            tracing::error!(%refusal, "refusing a worker registration (each heartbeat of it is refused and counted; logged once a minute)");
        }
    }

    /// Carries out the fleet's commands.
    fn execute(&mut self) {
        if self.commands.is_empty() {
            return;
        }
        let mut membership = false;
        for command in std::mem::take(&mut self.commands) {
            match command {
                FleetCommand::OpenStream(key) => {
                    let old = self.shared.streams.lock().remove(&key);
                    if let Some(old) = old {
                        // Cannot happen (the fleet opens a key once); close it properly anyway.
                        self.close(key, old);
                    }
                    // A stream of this key still closing (its worker left and came back at
                    // once) retires the key's lane when it ends: the new one starts after
                    // it, or that retirement would wipe the new incarnation's lane, and the
                    // old stream's last applies would land in it.
                    let (before, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut self.closing)
                        .into_iter()
                        .partition(|(k, _)| *k == key);
                    self.closing = rest;
                    let before = before.into_iter().map(|(_, task)| task).collect();
                    let handle = spawn_stream(&self.shared, key, before);
                    self.shared.streams.lock().insert(key, handle);
                }
                FleetCommand::Watermark {
                    key,
                    epoch,
                    last_id,
                } => {
                    if self.watermarks.hold(key, Watermark { epoch, last_id }) {
                        self.ask_barrier = true;
                    }
                }
                FleetCommand::CloseStream(key) => {
                    let handle = self.shared.streams.lock().remove(&key);
                    if let Some(handle) = handle {
                        self.close(key, handle);
                    }
                }
                FleetCommand::Routable {
                    key,
                    model,
                    adapters,
                    capacity_blocks,
                } => {
                    if let Some(s) = &self.shared.scheduler {
                        let mut s = s.lock();
                        s.add_worker(key, capacity_blocks, &model);
                        s.set_adapters(key, adapters);
                        // At 0 from the start, so that its first ejection is an
                        // `increase()` to Prometheus.
                        metrics::counter!("kvroute_worker_ejections_total", "worker" => key.0.to_string())
                            .increment(0);
                    }
                }
                FleetCommand::Unroutable(key) => {
                    if let Some(s) = &self.shared.scheduler {
                        s.lock().remove_worker(key);
                    }
                }
                FleetCommand::LateHeartbeat { id, gap_ms } => {
                    metrics::counter!("kvroute_registry_late_heartbeats_total").increment(1);
                    if self.lates_logged.due(id) {
                        let lease_ms = self.fleet.lease_ttl_ms();
                        match gap_ms {
                            Some(gap_ms) => {
                                tracing::warn!(worker = %id, gap_ms, ?lease_ms, "a worker's heartbeat came late for this router's lease: its heartbeat period (--heartbeat-ms) or the registry's delay does not fit --lease-ttl-ms, and each lapse drops what the index holds of it")
                            }
                            None => {
                                tracing::warn!(worker = %id, ?lease_ms, "a worker's lease lapsed and the same incarnation heartbeats again: its heartbeat period (--heartbeat-ms) or the registry's delay does not fit --lease-ttl-ms, and each lapse drops what the index holds of it")
                            }
                        }
                    }
                }
                FleetCommand::IdConflict {
                    id,
                    ignored_url,
                    kept_url,
                } => {
                    metrics::counter!("kvroute_registry_id_conflicts_total").increment(1);
                    if self.conflicts_logged.due(id) {
                        tracing::error!(worker = %id, %kept_url, %ignored_url, "two processes register under one worker id: the older incarnation's registration is ignored while the later one is alive (a replaced pod whose predecessor still runs, or an id given to two workers)");
                    }
                }
                FleetCommand::Rejoined(id) => {
                    metrics::counter!("kvroute_registry_rejoined_total").increment(1);
                    if self.rejoins_logged.due(id) {
                        tracing::warn!(worker = %id, "a worker that had said goodbye heartbeats again as the same incarnation: its registration was deleted under it (an operator's `nats kv del`, or a worker of an earlier version leaving under its id); registered again");
                    }
                }
                FleetCommand::Reincarnated(id) => {
                    if let Some(s) = &self.shared.scheduler {
                        s.lock().worker_answered(id);
                    }
                }
                FleetCommand::Departed { id, reason } => {
                    membership = true;
                    let c = &self.shared.counters;
                    match reason {
                        Departure::Left => {
                            c.workers_left.fetch_add(1, Ordering::Relaxed);
                            metrics::counter!("kvroute_workers_left_total").increment(1);
                        }
                        Departure::Expired => {
                            c.workers_expired.fetch_add(1, Ordering::Relaxed);
                            metrics::counter!("kvroute_workers_expired_total").increment(1);
                            tracing::warn!(worker = %id, "worker lease expired");
                        }
                        Departure::Refused => {}
                    }
                }
            }
        }
        if membership {
            self.view_stale = true;
        }
    }

    /// Tells a stream task to stop; it removes its index lane and ends.
    fn close(&mut self, key: StreamKey, handle: StreamHandle) {
        self.watermarks.forget(key);
        if handle.silence.flagged.load(Ordering::Relaxed) {
            metrics::gauge!("kvroute_worker_silent", "worker" => key.0.to_string()).set(0.0);
        }
        let _ = handle.close.send(());
        self.closing.push((key, handle.task));
    }

    fn publish_view(&mut self) {
        let view = FleetView {
            workers: self.fleet.workers().map(|w| (w.id, w.clone())).collect(),
        };
        metrics::gauge!("kvroute_workers_registered").set(view.workers.len() as f64);
        *self.shared.view.write() = Arc::new(view);
        self.view_stale = false;
        self.view_published = Instant::now();
        self.shared
            .counters
            .views_published
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Removes any stream, index lane or scheduler entry whose worker is not registered
    /// (they should not exist; each one found is counted and logged).
    fn sweep(&mut self) {
        self.closing.retain(|(_, task)| !task.is_finished());
        let closing: BTreeSet<StreamKey> = self.closing.iter().map(|(k, _)| *k).collect();
        let streams: Vec<StreamKey> = self.shared.streams.lock().keys().copied().collect();
        let mut found = 0u64;
        for key in self.fleet.orphans(streams) {
            found += 1;
            let handle = self.shared.streams.lock().remove(&key);
            if let Some(handle) = handle {
                self.close(key, handle);
            }
        }
        let lanes = self
            .shared
            .indexer
            .ranks()
            .into_iter()
            .filter(|k| !closing.contains(k));
        for key in self.fleet.orphans(lanes) {
            found += 1;
            self.shared.indexer.retire_rank(key.0, key.1);
            reap_later(&self.shared.indexer);
        }
        if let Some(scheduler) = &self.shared.scheduler {
            let mut s = scheduler.lock();
            let keys: Vec<StreamKey> = s.workers().map(|(k, _)| k).collect();
            for key in self.fleet.orphans(keys) {
                found += 1;
                s.remove_worker(key);
            }
        }
        if found > 0 {
            self.shared
                .counters
                .orphans_swept
                .fetch_add(found, Ordering::Relaxed);
            metrics::counter!("kvroute_fleet_orphans_swept_total").increment(found);
            tracing::warn!(found, "removed state of workers that are not registered");
        }
    }
}

/// Whether two registrations of a worker differ only in what changes every heartbeat.
fn same_shape(a: &WorkerInfo, b: &WorkerInfo) -> bool {
    (
        a.epoch,
        &a.url,
        &a.model,
        a.block_size,
        a.g1_blocks,
        a.g2_blocks,
        a.dp_size,
        &a.adapters,
        a.api,
        a.event_faults,
        a.learns_routes,
    ) == (
        b.epoch,
        &b.url,
        &b.model,
        b.block_size,
        b.g1_blocks,
        b.g2_blocks,
        b.dp_size,
        &b.adapters,
        b.api,
        b.event_faults,
        b.learns_routes,
    )
}

/// Starts the stream of `key`, once the streams of the same key in `before` have ended.
fn spawn_stream(
    shared: &Arc<Shared>,
    key: StreamKey,
    before: Vec<tokio::task::JoinHandle<()>>,
) -> StreamHandle {
    let (tx, rx) = mpsc::channel(shared.config.queue_batches.max(1));
    let (close, closed) = oneshot::channel();
    let queued_blocks = Arc::new(AtomicUsize::new(0));
    let overflowed = Arc::new(AtomicBool::new(false));
    let status = Arc::new(Mutex::new(StreamStatus::default()));
    let silence = Arc::new(Silence::default());
    let task = tokio::spawn(run_stream(
        StreamTask {
            shared: Arc::clone(shared),
            key,
            tx: tx.clone(),
            queued_blocks: Arc::clone(&queued_blocks),
            overflowed: Arc::clone(&overflowed),
            status: Arc::clone(&status),
            silence: Arc::clone(&silence),
        },
        rx,
        closed,
        before,
    ));
    StreamHandle {
        tx,
        queued_blocks,
        overflowed,
        status,
        silence,
        close,
        task,
    }
}

fn unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// A batch's first event id (0 for an empty batch), which with its epoch names it.
fn first_id(batch: &EventBatch) -> u64 {
    batch.events.first().map_or(0, |e| e.id)
}

/// Milliseconds from a batch's send time to `now_us`, if the publisher stamped it (a clock
/// behind the publisher's counts as no lag).
fn lag_ms(sent_unix_us: u64, now_us: u64) -> Option<f64> {
    (sent_unix_us > 0).then(|| now_us.saturating_sub(sent_unix_us) as f64 / 1e3)
}

struct StreamTask {
    shared: Arc<Shared>,
    key: StreamKey,
    /// For snapshot fetches to deliver into.
    tx: mpsc::Sender<Input>,
    queued_blocks: Arc<AtomicUsize>,
    overflowed: Arc<AtomicBool>,
    status: Arc<Mutex<StreamStatus>>,
    silence: Arc<Silence>,
}

/// One stream: applies its batches to its index lane in order until told to close, then
/// removes the lane (it is the lane's only writer, so nothing can re-create it after). It
/// starts once the earlier streams of its key (`before`) have removed theirs.
async fn run_stream(
    task: StreamTask,
    mut rx: mpsc::Receiver<Input>,
    mut closed: oneshot::Receiver<()>,
    before: Vec<tokio::task::JoinHandle<()>>,
) {
    for earlier in before {
        // An earlier stream ends at its next await (its close is sent); a panic there
        // ended it too.
        let _ = earlier.await;
    }
    let StreamTask {
        shared,
        key,
        tx,
        queued_blocks,
        overflowed,
        status,
        silence,
    } = task;
    let start = Instant::now();
    let now_ms = || start.elapsed().as_millis() as u64;
    let mut stream = WorkerStream::new(shared.config.stream.clone());
    let mut tick = tokio::time::interval(Duration::from_millis(shared.config.tick_ms.max(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut commands = Vec::new();
    let worker = key.0.to_string();
    let apply_metrics = ApplyMetrics::new(&worker);
    // One snapshot fetch at a time: a new request supersedes the one before (its answer
    // would be refused as stale), so that fetch is stopped, with its reply subscription. A
    // worker changing epoch at every batch otherwise left a fetch per batch waiting out its
    // deadline. A fetch still waiting for its turn (the plane's permits) takes the new
    // request over instead: what it will fetch is newer than both, and it keeps its place.
    let mut fetching: Option<(tokio::task::AbortHandle, Arc<Mutex<FetchTurn>>)> = None;
    let mut request_snapshot = |request: u64, wait_ms: u64, epoch: u64| {
        let wait = Duration::from_millis(wait_ms);
        if let Some((_, turn)) = &fetching
            && turn.lock().take_over(request, wait, epoch)
        {
            return;
        }
        let turn = Arc::new(Mutex::new(FetchTurn {
            request,
            wait,
            epoch,
            started: false,
        }));
        let fetch = tokio::spawn(fetch_snapshot(
            Arc::clone(&shared),
            key,
            tx.clone(),
            Arc::clone(&turn),
        ));
        if let Some((superseded, _)) = fetching.replace((fetch.abort_handle(), turn)) {
            superseded.abort();
        }
    };
    // A rank the index has no slot for resyncs after a wait that doubles, not at once: a
    // worker answers a snapshot request in a round trip, and every snapshot would be
    // refused again while no slot frees up.
    let mut no_slot_retry_at: Option<u64> = None;
    let mut no_slot_wait_ms = NO_SLOT_FIRST_WAIT_MS;
    loop {
        // The batch that just arrived: (epoch, its first event's id, received at, µs).
        let mut arrived = None;
        // The permit of the snapshot that just arrived: let go once it is applied below.
        let mut snapshot_permit = None;
        tokio::select! {
            biased;
            _ = &mut closed => break,
            input = rx.recv() => {
                // Every sender gone means the plane dropped this stream.
                let Some(input) = input else { break };
                queued_blocks.fetch_sub(input.queued_blocks(), Ordering::Relaxed);
                let now = now_ms();
                match input {
                    Input::Batch(batch, received_us) => {
                        arrived = Some((batch.epoch, first_id(&batch), received_us));
                        stream.on_batch(now, batch, &mut commands);
                        silence.heard(&worker);
                    }
                    Input::Watermark { epoch, last_id } => {
                        if last_id > 0 {
                            silence.heard(&worker);
                        }
                        stream.on_watermark(now, epoch, last_id, &mut commands);
                    }
                    Input::FetchStarted(request) => stream.on_fetch_started(now, request),
                    Input::Snapshot(snapshot, request, permit) => {
                        stream.on_snapshot(now, request, snapshot, &mut commands);
                        snapshot_permit = Some(permit);
                    }
                }
            }
            _ = tick.tick() => {
                let now = now_ms();
                if overflowed.swap(false, Ordering::Relaxed) {
                    stream.resync(now, &mut commands);
                }
                if no_slot_retry_at.is_some_and(|at| now >= at) {
                    no_slot_retry_at = None;
                    stream.resync(now, &mut commands);
                }
                stream.on_tick(now, &mut commands);
            }
        }
        let mut applied = 0;
        let mut wipes = 0;
        let applied_before = status.lock().applied;
        let mut dropped = false;
        for command in commands.drain(..) {
            match command {
                Command::Reset => {
                    shared.indexer.retire_rank(key.0, key.1);
                    reap_later(&shared.indexer);
                    // A wipe only once the stream has applied something: its first
                    // contact's reset drops nothing the router had (counted, it made the
                    // mismatch alarm drop the requests routed before the first batch).
                    if applied_before + applied > 0 {
                        wipes += 1;
                    }
                }
                Command::Apply(_) | Command::ApplySnapshot(_) if dropped => {
                    // After a batch the index dropped, the rest cannot follow it.
                }
                Command::ApplySnapshot(snapshot) => {
                    #[cfg(test)]
                    shared.hold_snapshot_applies.until_released().await;
                    let blocks = snapshot.blocks.len();
                    let Some((outcome, _)) =
                        apply(&shared.indexer, blocks, move || snapshot.to_batch()).await
                    else {
                        return;
                    };
                    dropped = apply_metrics.count(&outcome, &mut applied, &mut wipes);
                }
                Command::Apply(batch) => {
                    let Some((outcome, batch)) =
                        apply(&shared.indexer, batch.block_count(), move || batch).await
                    else {
                        return;
                    };
                    dropped = apply_metrics.count(&outcome, &mut applied, &mut wipes);
                    let now_us = unix_us();
                    if let Some(lag) = lag_ms(batch.sent_unix_us, now_us) {
                        status.lock().last_lag_ms = lag;
                        shared.lags.lock().record(lag);
                        apply_metrics.lag_seconds.record(lag / 1e3);
                    }
                    if let Some((epoch, id, received_us)) = arrived
                        && (epoch, id) == (batch.epoch, first_id(&batch))
                    {
                        shared
                            .router
                            .lock()
                            .record(now_us.saturating_sub(received_us) as f64 / 1e3);
                    }
                }
                Command::RequestSnapshot {
                    request,
                    wait_ms,
                    epoch,
                } => request_snapshot(request, wait_ms, epoch),
            }
        }
        // Applied, or not wanted: another snapshot may come into memory.
        drop(snapshot_permit);
        if dropped {
            // The index had no slot for this rank (more ranks than `max_workers`, or slots
            // of departed ones not yet freed): what it holds of the rank is not what the
            // stream applied. Resync once a wait is over, and again after each snapshot
            // until a slot is free.
            if no_slot_retry_at.is_none() {
                no_slot_retry_at = Some(now_ms() + no_slot_wait_ms);
                no_slot_wait_ms = (no_slot_wait_ms * 2).min(NO_SLOT_MAX_WAIT_MS);
            }
        } else if applied > 0 && no_slot_retry_at.is_none() {
            no_slot_wait_ms = NO_SLOT_FIRST_WAIT_MS;
        }
        let mut s = status.lock();
        let (before, after) = (s.stats, stream.stats());
        record_stream_metrics(&worker, &before, &after);
        s.epoch = stream.epoch();
        s.live = stream.is_live();
        s.stats = after;
        s.applied += applied;
        s.wipes += wipes;
    }
    if let Some((fetch, _)) = fetching.take() {
        fetch.abort();
    }
    shared.indexer.retire_rank(key.0, key.1);
    reap_later(&shared.indexer);
}

/// Blocks in a batch beyond which it is applied on the blocking pool: at about 10 M block
/// operations a second, 16 Ki take a runtime thread for over a millisecond, and a snapshot
/// (up to 2^24 blocks) for seconds, while requests wait behind it on that thread.
const INLINE_APPLY_BLOCKS: usize = 16 << 10;

/// Applies the batch `make` gives (a batch, or a snapshot's conversion) to the index, one of
/// more than [`INLINE_APPLY_BLOCKS`] blocks on the blocking pool: the stream's task waits
/// for it, so its batches still apply in order. `None` if the runtime is shutting down.
async fn apply(
    indexer: &Arc<Indexer>,
    blocks: usize,
    make: impl FnOnce() -> EventBatch + Send + 'static,
) -> Option<(ApplyOutcome, EventBatch)> {
    if blocks <= INLINE_APPLY_BLOCKS {
        let batch = make();
        return Some((indexer.apply(&batch), batch));
    }
    let indexer = Arc::clone(indexer);
    match tokio::task::spawn_blocking(move || {
        let batch = make();
        (indexer.apply(&batch), batch)
    })
    .await
    {
        Ok(applied) => Some(applied),
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => None,
    }
}

/// Strips retired ranks' entries from the index on the blocking pool: the walk of the whole
/// map stays off the runtime's threads, and removals that come together share one walk.
fn reap_later(indexer: &Arc<Indexer>) {
    let indexer = Arc::clone(indexer);
    tokio::task::spawn_blocking(move || indexer.reap());
}

/// A stream's per-batch counters, registered once when the stream starts (registering
/// per batch cost a label allocation and a registry lookup for each).
struct ApplyMetrics {
    batches: metrics::Counter,
    stored: metrics::Counter,
    removed: metrics::Counter,
    rejected: metrics::Counter,
    unknown_removed: metrics::Counter,
    /// `kvroute_event_lag_seconds` (one histogram for every worker).
    lag_seconds: metrics::Histogram,
}

impl ApplyMetrics {
    fn new(worker: &str) -> Self {
        let w = || worker.to_owned();
        ApplyMetrics {
            batches: metrics::counter!("kvroute_event_batches_applied_total", "worker" => w()),
            stored: metrics::counter!("kvroute_event_blocks_stored_total", "worker" => w()),
            removed: metrics::counter!("kvroute_event_blocks_removed_total", "worker" => w()),
            rejected: metrics::counter!("kvroute_event_blocks_rejected_total", "worker" => w()),
            unknown_removed: metrics::counter!("kvroute_event_unknown_removed_total", "worker" => w()),
            lag_seconds: metrics::histogram!("kvroute_event_lag_seconds"),
        }
    }

    /// Counts an applied batch: in the stream's tallies (`applied`, and `wipes` if it
    /// cleared the rank) and its metrics. True if the index had no slot for the rank (the
    /// batches after it cannot follow).
    fn count(&self, outcome: &ApplyOutcome, applied: &mut u64, wipes: &mut u64) -> bool {
        *applied += 1;
        *wipes += u64::from(outcome.cleared > 0);
        self.record(outcome);
        outcome.no_slot
    }

    fn record(&self, outcome: &ApplyOutcome) {
        self.batches.increment(1);
        self.stored.increment(outcome.stored);
        self.removed.increment(outcome.removed);
        self.rejected
            .increment(outcome.rejected_blocks + outcome.capped);
        self.unknown_removed.increment(outcome.unknown_removed);
    }
}

/// Emits the increments between two readings of a stream's counters.
fn record_stream_metrics(worker: &str, before: &StreamStats, after: &StreamStats) {
    let w = || worker.to_owned();
    let delta = |a: u64, b: u64| b.saturating_sub(a);
    if after.gaps > before.gaps {
        metrics::counter!("kvroute_event_gaps_total", "worker" => w())
            .increment(delta(before.gaps, after.gaps));
    }
    if after.resyncs > before.resyncs {
        metrics::counter!("kvroute_event_resyncs_total", "worker" => w())
            .increment(delta(before.resyncs, after.resyncs));
    }
    if after.snapshots > before.snapshots {
        let ms = delta(before.resync_ms, after.resync_ms) as f64;
        metrics::histogram!("kvroute_event_resync_seconds", "worker" => w()).record(ms / 1e3);
    }
    if after.overflows > before.overflows {
        metrics::counter!("kvroute_event_buffer_overflows_total", "worker" => w())
            .increment(delta(before.overflows, after.overflows));
    }
    if after.duplicates > before.duplicates {
        metrics::counter!("kvroute_event_duplicates_total", "worker" => w())
            .increment(delta(before.duplicates, after.duplicates));
    }
    if after.stale_epoch > before.stale_epoch {
        metrics::counter!("kvroute_event_stale_epoch_total", "worker" => w())
            .increment(delta(before.stale_epoch, after.stale_epoch));
    }
}

/// A stream's snapshot fetch: the request it answers, how long it may take once started,
/// and whether it has started (holds one of the plane's permits).
#[derive(Debug)]
struct FetchTurn {
    request: u64,
    wait: Duration,
    /// The stream's epoch when it asked: an answer of an earlier one is no answer.
    epoch: u64,
    started: bool,
}

impl FetchTurn {
    /// Makes a fetch not started yet answer `request` instead; false once it has started.
    fn take_over(&mut self, request: u64, wait: Duration, epoch: u64) -> bool {
        if self.started {
            return false;
        }
        (self.request, self.wait, self.epoch) = (request, wait, epoch);
        true
    }
}

/// Asks the worker for a snapshot of `key`'s rank, once one of the plane's fetch permits
/// is free, and feeds the assembled result back to the stream task. A fetch that times out
/// or fails is simply not delivered: the stream asks again after its snapshot timeout.
async fn fetch_snapshot(
    shared: Arc<Shared>,
    key: StreamKey,
    tx: mpsc::Sender<Input>,
    turn: Arc<Mutex<FetchTurn>>,
) {
    let Ok(permit) = Arc::clone(&shared.snapshot_fetches).acquire_owned().await else {
        return;
    };
    let (request, deadline, epoch) = {
        let mut turn = turn.lock();
        turn.started = true;
        (turn.request, turn.wait, turn.epoch)
    };
    // Its wait runs from now (if the queue is full, the stream asks again a little early).
    let _ = tx.try_send(Input::FetchStarted(request));
    // As long as the stream waits before asking again (doubling with each retry): a
    // snapshot slower to come than that is asked for again anyway.
    let asks_again_at = tokio::time::Instant::now() + deadline;
    let fetched = tokio::time::timeout_at(asks_again_at, fetch(&shared, key, epoch)).await;
    match fetched {
        Ok(Some(snapshot)) => {
            // Queued behind the stream's batches, as long as the answer is still wanted (a
            // full queue dropped it, and the fetch of perhaps millions of blocks was made
            // again and again under load). The stream may have closed meanwhile; then
            // nobody wants it.
            let queued = tx.send(Input::Snapshot(snapshot, request, permit));
            let _ = tokio::time::timeout_at(asks_again_at, queued).await;
        }
        Ok(None) => {}
        Err(_) => tracing::warn!(worker = %key.0, rank = %key.1, "snapshot fetch timed out"),
    }
}

/// The first whole snapshot of `key` of epoch `epoch` or later: an earlier incarnation
/// still draining under the same id answers too, and its answer, refused by the stream,
/// left the later one's unheard until the fetch was asked again.
async fn fetch(shared: &Shared, key: StreamKey, epoch: u64) -> Option<Snapshot> {
    let inbox = shared.transport.new_inbox();
    let mut replies = shared.transport.subscribe(&inbox).await.ok()?;
    let subject = snapshot_subject(&shared.config.cluster, key.0);
    let request = Bytes::copy_from_slice(&key.1.0.to_le_bytes());
    if let Err(e) = shared
        .transport
        .publish(&subject, Some(&inbox), request)
        .await
    {
        tracing::warn!(worker = %key.0, error = %e, "snapshot request failed");
        return None;
    }
    let mut assembler = SnapshotAssembler::default();
    while let Some(message) = replies.next().await {
        if message.payload.is_empty() {
            // NATS' "no responders" status: nobody serves this worker's snapshots.
            tracing::warn!(worker = %key.0, "no snapshot responder for worker");
            return None;
        }
        match decode_snapshot_chunk(&message.payload, &shared.limits()) {
            Ok(chunk) if (chunk.worker, chunk.dp_rank) == key => match assembler.add(chunk) {
                Ok(Some(snapshot)) if snapshot.epoch >= epoch => return Some(snapshot),
                Ok(Some(old)) => {
                    tracing::debug!(worker = %key.0, epoch = old.epoch, "a snapshot of an earlier incarnation; waiting for the present one's");
                }
                Ok(None) => {}
                Err(AssembleError::TooLarge) => {
                    // Its chunks are gone: waiting out the deadline for the rest would only
                    // hold a fetch permit. Workers refuse a cache that large at start.
                    tracing::error!(worker = %key.0, "snapshot over the limit of {MAX_SNAPSHOT_BLOCKS} blocks: refused");
                    return None;
                }
                Err(e) => {
                    tracing::warn!(worker = %key.0, error = %e, "inconsistent snapshot chunks")
                }
            },
            Ok(_) => tracing::warn!(worker = %key.0, "snapshot chunk for another worker"),
            Err(e) => {
                shared.counters.malformed.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(worker = %key.0, error = %e, "malformed snapshot chunk");
            }
        }
    }
    None
}

#[cfg(test)]
pub(crate) mod tests;
