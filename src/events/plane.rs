//! The router's event plane: subscribes to every worker's event subject, runs one task per
//! (worker, rank) stream ([`WorkerStream`]) that applies its batches to the index in order,
//! fetches snapshots when a stream must resync, and follows the fleet registry (heartbeat
//! watermarks, restarts, leaves and lease expiries).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, mpsc, watch};
use tokio::time::Instant;

use super::stream::{Command, StreamConfig, StreamStats, WorkerStream};
use super::transport::Transport;
use crate::discovery::FleetEvent;
use crate::indexer::Indexer;
use crate::protocol::{
    DpRank, EventBatch, Limits, Snapshot, SnapshotAssembler, WorkerId, decode,
    decode_snapshot_chunk,
};

/// Subject of one worker's events.
pub fn events_subject(cluster: &str, worker: WorkerId) -> String {
    format!("kvroute.{cluster}.events.{worker}")
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
    /// How often stream tasks check their timers, ms.
    pub tick_ms: u64,
    /// How long one snapshot fetch may take, ms.
    pub snapshot_fetch_ms: u64,
}

impl Default for PlaneConfig {
    fn default() -> Self {
        PlaneConfig {
            cluster: "default".into(),
            stream: StreamConfig::default(),
            queue_batches: 4096,
            tick_ms: 50,
            snapshot_fetch_ms: 2_000,
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
}

enum Input {
    Batch(EventBatch),
    Watermark { epoch: u64, last_id: u64 },
    Snapshot(Snapshot),
}

struct StreamHandle {
    tx: mpsc::Sender<Input>,
    overflowed: Arc<AtomicBool>,
    status: Arc<Mutex<StreamStatus>>,
    task: tokio::task::JoinHandle<()>,
}

type Streams = Arc<Mutex<HashMap<(WorkerId, DpRank), StreamHandle>>>;

/// The running plane.
#[derive(Clone)]
pub struct EventPlane {
    streams: Streams,
    counters: Arc<PlaneCounters>,
    indexer: Arc<Indexer>,
    fleet: Arc<Mutex<HashMap<WorkerId, crate::discovery::WorkerInfo>>>,
    lags: Arc<Mutex<LagSamples>>,
    silence: Arc<Mutex<HashMap<WorkerId, Silence>>>,
    changes: broadcast::Sender<FleetEvent>,
}

/// Publish → apply lag samples (ms), the most recent ones, for reports.
#[derive(Debug, Default)]
pub struct LagSamples {
    samples: Vec<f64>,
    next: usize,
}

const LAG_SAMPLES: usize = 100_000;

impl LagSamples {
    fn record(&mut self, ms: f64) {
        if self.samples.len() < LAG_SAMPLES {
            self.samples.push(ms);
        } else {
            self.samples[self.next] = ms;
            self.next = (self.next + 1) % LAG_SAMPLES;
        }
    }
}

/// Requests routed to a worker since its last event: a worker that serves traffic but
/// publishes nothing gives zero overlap forever (the field's most common KV-router failure).
#[derive(Debug, Default)]
struct Silence {
    routed_since_event: u64,
    flagged: bool,
}

/// Requests routed to a worker with no event since, before it is flagged as silent.
const SILENT_AFTER_REQUESTS: u64 = 8;

struct Shared {
    transport: Transport,
    indexer: Arc<Indexer>,
    config: PlaneConfig,
    streams: Streams,
    counters: Arc<PlaneCounters>,
    limits: Limits,
    lags: Arc<Mutex<LagSamples>>,
    silence: Arc<Mutex<HashMap<WorkerId, Silence>>>,
    changes: broadcast::Sender<FleetEvent>,
}

impl EventPlane {
    /// Starts the plane: event subscription, fleet watch, stream tasks. Runs until
    /// `shutdown` turns true.
    pub async fn start(
        transport: Transport,
        indexer: Arc<Indexer>,
        mut fleet_events: mpsc::Receiver<FleetEvent>,
        config: PlaneConfig,
        mut shutdown: watch::Receiver<bool>,
    ) -> Result<EventPlane, super::transport::TransportError> {
        let mut subscription = transport
            .subscribe(&format!("kvroute.{}.events.>", config.cluster))
            .await?;
        // Started means subscribed: the server has our interest before we return.
        transport.synced().await;
        let limits = Limits {
            max_payload_bytes: transport.max_payload().max(1 << 20),
            ..Limits::default()
        };
        let shared = Arc::new(Shared {
            transport,
            indexer: Arc::clone(&indexer),
            config,
            streams: Arc::default(),
            counters: Arc::default(),
            limits,
            lags: Arc::default(),
            silence: Arc::default(),
            changes: broadcast::channel(1024).0,
        });
        let plane = EventPlane {
            streams: Arc::clone(&shared.streams),
            counters: Arc::clone(&shared.counters),
            indexer,
            fleet: Arc::default(),
            lags: Arc::clone(&shared.lags),
            silence: Arc::clone(&shared.silence),
            changes: shared.changes.clone(),
        };
        if let Some(mut reconnects) = shared.transport.reconnects() {
            let (plane, mut shutdown) = (plane.clone(), shutdown.clone());
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        changed = reconnects.changed() => {
                            if changed.is_err() {
                                return;
                            }
                            tracing::warn!("reconnected to NATS: resyncing every worker stream");
                            plane.resync_all();
                        }
                        _ = shutdown.changed() => return,
                    }
                }
            });
        }
        let fleet = Arc::clone(&plane.fleet);
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    message = subscription.next() => {
                        let Some(message) = message else { break };
                        shared.on_payload(&message.subject, &message.payload);
                    }
                    event = fleet_events.recv() => {
                        let Some(event) = event else { continue };
                        shared.on_fleet(event, &fleet);
                    }
                    _ = shutdown.changed() => break,
                }
            }
            for (_, handle) in shared.streams.lock().drain() {
                handle.task.abort();
            }
        });
        Ok(plane)
    }

    /// Plane-wide counters.
    pub fn counters(&self) -> &PlaneCounters {
        &self.counters
    }

    /// Status of every stream.
    pub fn streams(&self) -> Vec<((WorkerId, DpRank), StreamStatus)> {
        let mut v: Vec<_> = self
            .streams
            .lock()
            .iter()
            .map(|(k, h)| (*k, h.status.lock().clone()))
            .collect();
        v.sort_by_key(|(k, _)| *k);
        v
    }

    /// The workers registered now.
    pub fn workers(&self) -> Vec<crate::discovery::WorkerInfo> {
        let mut v: Vec<_> = self.fleet.lock().values().cloned().collect();
        v.sort_by_key(|w| w.id);
        v
    }

    /// One registered worker.
    pub fn worker(&self, id: WorkerId) -> Option<crate::discovery::WorkerInfo> {
        self.fleet.lock().get(&id).cloned()
    }

    /// The index the plane feeds.
    pub fn indexer(&self) -> &Arc<Indexer> {
        &self.indexer
    }

    /// Fleet changes, after the index has applied them: the scheduler adds and removes
    /// workers from these, so a worker that leaves or expires is gone from both at once.
    pub fn fleet_changes(&self) -> broadcast::Receiver<FleetEvent> {
        self.changes.subscribe()
    }

    /// The recent publish → apply lags, ms (up to the last 100,000 batches).
    pub fn lag_samples(&self) -> Vec<f64> {
        self.lags.lock().samples.clone()
    }

    /// The ingress routed a request to `worker`. A worker that keeps receiving requests but
    /// publishes no events is flagged (`kvroute_worker_silent`, and a warning).
    pub fn note_routed(&self, worker: WorkerId) {
        let mut silence = self.silence.lock();
        let s = silence.entry(worker).or_default();
        s.routed_since_event += 1;
        if s.routed_since_event >= SILENT_AFTER_REQUESTS && !s.flagged {
            s.flagged = true;
            metrics::gauge!("kvroute_worker_silent", "worker" => worker.to_string()).set(1.0);
            tracing::warn!(
                %worker,
                requests = s.routed_since_event,
                "worker serves traffic but publishes no KV events: its overlap will read zero (check its event publisher and NATS subject)"
            );
        }
    }

    /// Workers flagged as serving traffic without publishing events.
    pub fn silent_workers(&self) -> Vec<WorkerId> {
        let mut v: Vec<_> = self
            .silence
            .lock()
            .iter()
            .filter(|(_, s)| s.flagged)
            .map(|(w, _)| *w)
            .collect();
        v.sort();
        v
    }

    /// Asks every stream to resync (after a transport outage, when events may have been
    /// lost unseen).
    pub fn resync_all(&self) {
        for handle in self.streams.lock().values() {
            handle.overflowed.store(true, Ordering::Relaxed);
        }
    }
}

impl Shared {
    fn on_payload(self: &Arc<Self>, subject: &str, payload: &Bytes) {
        let batch = match decode(payload, &self.limits) {
            Ok(batch) => batch,
            Err(e) => {
                self.counters.malformed.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("kvroute_event_malformed_total").increment(1);
                tracing::warn!(subject, error = %e, "dropping malformed event payload");
                return;
            }
        };
        let key = (batch.worker, batch.dp_rank);
        self.send(key, Input::Batch(batch));
    }

    fn note_event(&self, worker: WorkerId) {
        let mut silence = self.silence.lock();
        if let Some(s) = silence.get_mut(&worker) {
            if s.flagged {
                metrics::gauge!("kvroute_worker_silent", "worker" => worker.to_string()).set(0.0);
            }
            *s = Silence::default();
        }
    }

    fn send(self: &Arc<Self>, key: (WorkerId, DpRank), input: Input) {
        let mut streams = self.streams.lock();
        let handle = streams.entry(key).or_insert_with(|| self.spawn_stream(key));
        if handle.tx.try_send(input).is_err() {
            self.counters
                .queue_overflows
                .fetch_add(1, Ordering::Relaxed);
            handle.overflowed.store(true, Ordering::Relaxed);
            metrics::counter!("kvroute_event_queue_overflows_total", "worker" => key.0.to_string())
                .increment(1);
        }
    }

    fn on_fleet(
        self: &Arc<Self>,
        event: FleetEvent,
        fleet: &Mutex<HashMap<WorkerId, crate::discovery::WorkerInfo>>,
    ) {
        let change = event.clone();
        match event {
            FleetEvent::Up(info) => {
                for (rank, last_id) in info.last_event_ids.iter().enumerate() {
                    let key = (info.id, DpRank(rank as u32));
                    self.send(
                        key,
                        Input::Watermark {
                            epoch: info.epoch,
                            last_id: *last_id,
                        },
                    );
                }
                let mut fleet = fleet.lock();
                fleet.insert(info.id, info);
                metrics::gauge!("kvroute_workers_registered").set(fleet.len() as f64);
            }
            FleetEvent::Down { id, expired } => {
                {
                    let mut fleet = fleet.lock();
                    fleet.remove(&id);
                    metrics::gauge!("kvroute_workers_registered").set(fleet.len() as f64);
                }
                self.silence.lock().remove(&id);
                let removed: Vec<StreamHandle> = {
                    let mut streams = self.streams.lock();
                    let keys: Vec<_> = streams.keys().filter(|(w, _)| *w == id).copied().collect();
                    keys.iter().filter_map(|k| streams.remove(k)).collect()
                };
                for handle in removed {
                    handle.task.abort();
                }
                self.indexer.remove_worker(id);
                let counter = if expired {
                    &self.counters.workers_expired
                } else {
                    &self.counters.workers_left
                };
                counter.fetch_add(1, Ordering::Relaxed);
                if expired {
                    metrics::counter!("kvroute_workers_expired_total").increment(1);
                } else {
                    metrics::counter!("kvroute_workers_left_total").increment(1);
                }
            }
        }
        let _ = self.changes.send(change);
    }

    fn spawn_stream(self: &Arc<Self>, key: (WorkerId, DpRank)) -> StreamHandle {
        let (tx, rx) = mpsc::channel(self.config.queue_batches);
        let overflowed = Arc::new(AtomicBool::new(false));
        let status = Arc::new(Mutex::new(StreamStatus::default()));
        let task = tokio::spawn(run_stream(
            Arc::clone(self),
            key,
            rx,
            tx.clone(),
            Arc::clone(&overflowed),
            Arc::clone(&status),
        ));
        StreamHandle {
            tx,
            overflowed,
            status,
            task,
        }
    }
}

fn now_ms(start: Instant) -> u64 {
    start.elapsed().as_millis() as u64
}

fn unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

async fn run_stream(
    shared: Arc<Shared>,
    key: (WorkerId, DpRank),
    mut rx: mpsc::Receiver<Input>,
    tx: mpsc::Sender<Input>,
    overflowed: Arc<AtomicBool>,
    status: Arc<Mutex<StreamStatus>>,
) {
    let start = Instant::now();
    let mut stream = WorkerStream::new(shared.config.stream.clone());
    let mut tick = tokio::time::interval(Duration::from_millis(shared.config.tick_ms.max(1)));
    let mut commands = Vec::new();
    loop {
        tokio::select! {
            input = rx.recv() => {
                let Some(input) = input else { return };
                let now = now_ms(start);
                match input {
                    Input::Batch(batch) => {
                        let lag_ms = (batch.sent_unix_us > 0)
                            .then(|| unix_us().saturating_sub(batch.sent_unix_us) as f64 / 1e3);
                        stream.on_batch(now, batch, &mut commands);
                        if let Some(lag) = lag_ms {
                            status.lock().last_lag_ms = lag;
                            shared.lags.lock().record(lag);
                            metrics::histogram!("kvroute_event_lag_seconds").record(lag / 1e3);
                        }
                        shared.note_event(key.0);
                    }
                    Input::Watermark { epoch, last_id } => stream.on_watermark(now, epoch, last_id, &mut commands),
                    Input::Snapshot(snapshot) => stream.on_snapshot(now, snapshot, &mut commands),
                }
            }
            _ = tick.tick() => {
                let now = now_ms(start);
                if overflowed.swap(false, Ordering::Relaxed) {
                    stream.resync(now, &mut commands);
                }
                stream.on_tick(now, &mut commands);
            }
        }
        let mut applied = 0;
        let worker = key.0.to_string();
        for command in commands.drain(..) {
            match command {
                Command::Reset => {
                    shared.indexer.remove_rank(key.0, key.1);
                }
                Command::Apply(batch) => {
                    let outcome = shared.indexer.apply(&batch);
                    applied += 1;
                    record_apply_metrics(&worker, &outcome);
                }
                Command::RequestSnapshot { .. } => {
                    tokio::spawn(fetch_snapshot(Arc::clone(&shared), key, tx.clone()));
                }
            }
        }
        let mut s = status.lock();
        let (before, after) = (s.stats, stream.stats());
        record_stream_metrics(&worker, &before, &after);
        s.epoch = stream.epoch();
        s.live = stream.is_live();
        s.stats = after;
        s.applied += applied;
    }
}

fn record_apply_metrics(worker: &str, outcome: &crate::indexer::ApplyOutcome) {
    let w = || worker.to_owned();
    metrics::counter!("kvroute_event_batches_applied_total", "worker" => w()).increment(1);
    metrics::counter!("kvroute_event_blocks_stored_total", "worker" => w())
        .increment(outcome.stored);
    metrics::counter!("kvroute_event_blocks_removed_total", "worker" => w())
        .increment(outcome.removed);
    metrics::counter!("kvroute_event_blocks_rejected_total", "worker" => w())
        .increment(outcome.rejected_blocks + outcome.capped);
    metrics::counter!("kvroute_event_unknown_removed_total", "worker" => w())
        .increment(outcome.unknown_removed);
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

/// Asks the worker for a snapshot of `key`'s rank and feeds the assembled result back to
/// the stream task. A fetch that times out or fails is simply not delivered: the stream
/// asks again after its snapshot timeout.
async fn fetch_snapshot(shared: Arc<Shared>, key: (WorkerId, DpRank), tx: mpsc::Sender<Input>) {
    let inbox = shared.transport.new_inbox();
    let Ok(mut replies) = shared.transport.subscribe(&inbox).await else {
        return;
    };
    let subject = snapshot_subject(&shared.config.cluster, key.0);
    let request = Bytes::copy_from_slice(&key.1.0.to_le_bytes());
    if let Err(e) = shared
        .transport
        .publish(&subject, Some(&inbox), request)
        .await
    {
        tracing::warn!(worker = %key.0, error = %e, "snapshot request failed");
        return;
    }
    let deadline = Duration::from_millis(shared.config.snapshot_fetch_ms);
    let mut assembler = SnapshotAssembler::default();
    let result = tokio::time::timeout(deadline, async {
        while let Some(message) = replies.next().await {
            if message.payload.is_empty() {
                // NATS' "no responders" status: nobody serves this worker's snapshots.
                tracing::warn!(worker = %key.0, "no snapshot responder for worker");
                return None;
            }
            match decode_snapshot_chunk(&message.payload, &shared.limits) {
                Ok(chunk) if (chunk.worker, chunk.dp_rank) == key => match assembler.add(chunk) {
                    Ok(Some(snapshot)) => return Some(snapshot),
                    Ok(None) => {}
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
    })
    .await;
    match result {
        Ok(Some(snapshot)) => {
            let _ = tx.send(Input::Snapshot(snapshot)).await;
        }
        _ => tracing::warn!(worker = %key.0, rank = %key.1, "snapshot fetch timed out"),
    }
}
