//! Simulated workers: a real worker-core engine per worker, driven as fast as it goes on its
//! own virtual clock, publishing over the real event plane, registered with a real lease.
//! The engine's block manager is the truth the router's index is checked against.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvroute::discovery::{LeaseConfig, Registration, Registry, WorkerInfo};
use kvroute::events::transport::Transport;
use kvroute::indexer::Indexer;
use kvroute::protocol::{DpRank, EventBatch, Salt, SeqHash, Tier, WorkerId};
use kvroute_worker::EngineConfig;
use kvroute_worker::block_manager::BlockManager;
use kvroute_worker::engine::{Engine, Request, RequestId};
use kvroute_worker::plane::{SnapshotRequest, WorkerPlane};
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};

/// Faults a simulated worker injects into its own event stream.
#[derive(Clone, Copy, Debug, Default)]
pub struct Faults {
    /// Share of batches never sent (they still count as sent in heartbeats).
    pub drop: f64,
    /// Share of batches sent twice.
    pub duplicate: f64,
    /// Share of batches held back and sent after the next one.
    pub reorder: f64,
}

/// The engine configuration of the tests: small G1 and G2 so eviction and offload happen.
pub fn small_engine() -> EngineConfig {
    EngineConfig {
        block_size: 16,
        g1_blocks: 96,
        g2_blocks: 160,
        max_num_batched_tokens: 512,
        max_num_seqs: 16,
        // Offload every evicted block, so G2 traffic is heavy.
        offload_min_hits: 0,
        ..EngineConfig::default()
    }
}

static EPOCHS: AtomicU64 = AtomicU64::new(0);

/// A fresh epoch: start time (ms) in the high bits, so later incarnations compare larger.
pub fn new_epoch() -> u64 {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    (ms << 16) | (EPOCHS.fetch_add(1, Ordering::Relaxed) & 0xffff)
}

/// A prompt of `len` tokens: family `family`'s shared prefix, then request-specific tokens.
pub fn prompt(family: u32, variant: u32, len: usize) -> Arc<[u32]> {
    (0..len as u32)
        .map(|i| {
            if i < 64 {
                family * 1_000_000 + i
            } else {
                family * 1_000_000 + variant * 10_000 + i
            }
        })
        .collect()
}

enum Control {
    Submit(Vec<Request>),
    Stop {
        goodbye: bool,
        done: oneshot::Sender<()>,
    },
}

/// One simulated worker.
pub struct SimWorker {
    /// Its id.
    pub id: WorkerId,
    blocks: Arc<Mutex<BlockManager>>,
    control: mpsc::Sender<Control>,
    idle: Arc<tokio::sync::Notify>,
    pending: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
    snapshot_task: tokio::task::JoinHandle<()>,
}

impl SimWorker {
    /// Starts a worker: registers it, serves snapshots, and runs its engine.
    pub async fn start(
        transport: Transport,
        registry: Registry,
        cluster: &str,
        id: WorkerId,
        config: EngineConfig,
        faults: Faults,
    ) -> anyhow::Result<SimWorker> {
        let epoch = new_epoch();
        let engine = Engine::new(config.clone(), id, DpRank(0), epoch)?;
        let blocks = Arc::new(Mutex::new(engine.blocks().clone()));
        let info = Arc::new(Mutex::new(WorkerInfo {
            id,
            url: format!("http://127.0.0.1:0/{id}"),
            block_size: config.block_size,
            g1_blocks: config.g1_blocks,
            g2_blocks: config.g2_blocks,
            model: "sim".into(),
            dp_size: 1,
            epoch,
            last_event_ids: vec![0],
            api: kvroute::discovery::WorkerApi::Kvroute,
            adapters: Vec::new(),
            engine_load: None,
            event_faults: None,
            engine_rank_kv_usage: Vec::new(),
            learns_routes: false,
            left: false,
        }));
        let lease = LeaseConfig {
            heartbeat_ms: 200,
            ttl_ms: 1_000,
        };
        let registration = Registration::start(registry, Arc::clone(&info), &lease).await?;
        let plane = WorkerPlane::new(transport.clone(), cluster, info);
        let (snap_tx, snap_rx) = mpsc::channel(16);
        let snapshot_task = WorkerPlane::serve_snapshots(transport, cluster, id, snap_tx).await?;
        let (control, control_rx) = mpsc::channel(64);
        let idle = Arc::new(tokio::sync::Notify::new());
        let pending = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn(run(
            engine,
            plane,
            registration,
            control_rx,
            snap_rx,
            faults,
            Arc::clone(&idle),
            Arc::clone(&pending),
        ));
        Ok(SimWorker {
            id,
            blocks,
            control,
            idle,
            pending,
            task,
            snapshot_task,
        })
    }

    /// Queues requests.
    pub async fn submit(&self, requests: Vec<Request>) {
        self.pending
            .fetch_add(requests.len() as u64, Ordering::SeqCst);
        let _ = self.control.send(Control::Submit(requests)).await;
    }

    /// Waits until every submitted request finished.
    pub async fn wait_idle(&self) {
        while self.pending.load(Ordering::SeqCst) > 0 {
            let _ = tokio::time::timeout(Duration::from_millis(50), self.idle.notified()).await;
        }
    }

    /// What the worker's cache holds: (worker, tier, block).
    pub fn truth(&self) -> BTreeSet<(WorkerId, Tier, SeqHash)> {
        let bm = self.blocks.lock();
        [Tier::Device, Tier::Host]
            .into_iter()
            .flat_map(|t| {
                bm.resident(t)
                    .into_iter()
                    .map(move |(_, b)| (self.id, t, b.seq))
            })
            .collect()
    }

    /// Stops the worker: with `goodbye` it deregisters, without it vanishes like a crash.
    pub async fn stop(self, goodbye: bool) {
        let (done, wait) = oneshot::channel();
        if self
            .control
            .send(Control::Stop { goodbye, done })
            .await
            .is_ok()
        {
            let _ = wait.await;
        }
        self.task.abort();
        self.snapshot_task.abort();
    }
}

#[allow(clippy::too_many_arguments)]
async fn run(
    mut engine: Engine,
    plane: WorkerPlane,
    registration: Registration,
    mut control: mpsc::Receiver<Control>,
    mut snapshots: mpsc::Receiver<SnapshotRequest>,
    faults: Faults,
    idle: Arc<tokio::sync::Notify>,
    pending: Arc<AtomicU64>,
) {
    let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ engine.config().g1_blocks as u64 ^ new_epoch();
    let mut roll = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut now = 0u64;
    let mut out = Vec::new();
    let mut batches = Vec::new();
    let mut held: Option<EventBatch> = None;
    loop {
        // Work first; between steps, let control messages and snapshot requests in.
        let busy = engine.next_wakeup_us().is_some();
        tokio::select! {
            biased;
            c = control.recv() => match c {
                Some(Control::Submit(requests)) => {
                    for r in requests {
                        engine.submit(now, r, &mut out);
                    }
                }
                Some(Control::Stop { goodbye, done }) => {
                    if goodbye { registration.goodbye().await } else { registration.abandon() }
                    let _ = done.send(());
                    return;
                }
                None => return,
            },
            r = snapshots.recv() => {
                if let Some(r) = r {
                    let snapshot = engine.snapshot();
                    let _ = r.reply.send(snapshot);
                }
            },
            _ = tokio::time::sleep(Duration::from_millis(if busy { 0 } else { 20 })) => {
                if let Some(t) = engine.next_wakeup_us() {
                    now = now.max(t);
                }
            },
        }
        if engine.advance(now, &mut out).is_err() {
            return;
        }
        let finished = out
            .iter()
            .filter(|o| {
                matches!(
                    o.kind,
                    kvroute_worker::engine::OutputKind::Finished
                        | kvroute_worker::engine::OutputKind::Rejected(_)
                )
            })
            .count();
        out.clear();
        engine.drain_batches(&mut batches);
        for batch in batches.drain(..) {
            let r = roll();
            if r < faults.drop {
                plane.note_sent(&batch);
                continue;
            }
            if r < faults.drop + faults.reorder && held.is_none() {
                plane.note_sent(&batch);
                held = Some(batch);
                continue;
            }
            let _ = plane.publish(&batch).await;
            if r < faults.drop + faults.reorder + faults.duplicate {
                let _ = plane.publish(&batch).await;
            }
            if let Some(h) = held.take() {
                let _ = plane.publish(&h).await;
            }
        }
        if finished > 0 && pending.fetch_sub(finished as u64, Ordering::SeqCst) == finished as u64 {
            idle.notify_waiters();
        }
    }
}

/// `n` requests over a few prompt families (shared prefixes), short outputs.
pub fn workload(seed: u32, n: u32) -> Vec<Request> {
    (0..n)
        .map(|i| Request {
            id: RequestId(u64::from(seed) << 32 | u64::from(i)),
            prompt: prompt(seed % 3 + i % 4, i % 7, 40 + (i as usize * 37) % 200).into(),
            max_tokens: 2 + i % 20,
            salt: Salt::NONE,
        })
        .collect()
}

/// What the router's index holds, as (worker, tier, block).
pub fn indexed(indexer: &Indexer) -> BTreeSet<(WorkerId, Tier, SeqHash)> {
    indexer
        .dump(None)
        .into_iter()
        .flat_map(|h| h.blocks.into_iter().map(move |(t, s)| (h.worker, t, s)))
        .collect()
}

/// Polls until `check` holds or `timeout` passes; returns whether it held.
pub async fn eventually(timeout: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if check() {
            return true;
        }
        if tokio::time::Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
