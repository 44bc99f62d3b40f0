//! Which workers exist: registration with a lease in the JetStream KV bucket
//! `kvroute-<cluster>-workers` (DESIGN §5), an in-process registry for `kvroute up` and tests,
//! or a static list for setups without JetStream. The router side enforces the lease TTL
//! itself: the server does not announce max-age expiry on older versions, and a worker killed
//! without goodbye must leave the index within TTL + 1 s.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, mpsc};
use tokio::time::Instant;

use crate::protocol::WorkerId;

/// What a worker registers, refreshed every heartbeat.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerInfo {
    /// The worker.
    pub id: WorkerId,
    /// Where its HTTP server listens.
    pub url: String,
    /// Tokens per KV block.
    pub block_size: usize,
    /// G1 blocks per rank.
    pub g1_blocks: usize,
    /// G2 blocks per rank.
    pub g2_blocks: usize,
    /// Model served.
    pub model: String,
    /// Data-parallel ranks.
    pub dp_size: u32,
    /// Incarnation (see `EventBatch::epoch`).
    pub epoch: u64,
    /// Per rank, the id of the last event published: lets the router notice a lost last
    /// batch, and a restart whose events it never saw.
    #[serde(default)]
    pub last_event_ids: Vec<u64>,
}

/// Lease timing.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LeaseConfig {
    /// A worker refreshes its registration this often, ms.
    pub heartbeat_ms: u64,
    /// A registration not refreshed for this long has expired, ms.
    pub ttl_ms: u64,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        LeaseConfig {
            heartbeat_ms: 1_000,
            ttl_ms: 5_000,
        }
    }
}

/// A change in the fleet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FleetEvent {
    /// A worker registered or refreshed its registration.
    Up(WorkerInfo),
    /// A worker left (goodbye) or its lease expired.
    Down {
        /// The worker.
        id: WorkerId,
        /// True if it expired rather than said goodbye.
        expired: bool,
    },
}

/// A registry failure.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// The KV bucket could not be created or opened.
    #[error("worker registry bucket {bucket}: {reason}")]
    Bucket {
        /// The bucket.
        bucket: String,
        /// What JetStream said.
        reason: String,
    },
    /// A registration could not be written.
    #[error("registering worker {id}: {reason}")]
    Register {
        /// The worker.
        id: WorkerId,
        /// What JetStream said.
        reason: String,
    },
}

/// Where registrations live.
#[derive(Clone, Debug)]
pub enum Registry {
    /// A JetStream KV bucket (boxed: the store handle is large).
    Nats(Box<async_nats::jetstream::kv::Store>),
    /// In process.
    Local(LocalRegistry),
    /// A fixed list: never changes, never expires.
    Static(Vec<WorkerInfo>),
}

/// The bucket name of a cluster's registry.
pub fn bucket_name(cluster: &str) -> String {
    format!("kvroute-{cluster}-workers")
}

impl Registry {
    /// Opens (creating if needed) the cluster's KV bucket.
    pub async fn nats(
        client: async_nats::Client,
        cluster: &str,
        lease: &LeaseConfig,
    ) -> Result<Registry, DiscoveryError> {
        let js = async_nats::jetstream::new(client);
        let bucket = bucket_name(cluster);
        let config = async_nats::jetstream::kv::Config {
            bucket: bucket.clone(),
            history: 1,
            max_age: Duration::from_millis(lease.ttl_ms.max(1000) * 2),
            ..Default::default()
        };
        let store = match js.get_key_value(&bucket).await {
            Ok(store) => store,
            Err(_) => js
                .create_key_value(config)
                .await
                .map_err(|e| DiscoveryError::Bucket {
                    bucket: bucket.clone(),
                    reason: e.to_string(),
                })?,
        };
        Ok(Registry::Nats(Box::new(store)))
    }

    /// Writes (or refreshes) a registration.
    pub async fn put(&self, info: &WorkerInfo) -> Result<(), DiscoveryError> {
        let value =
            Bytes::from(serde_json::to_vec(info).expect("invariant: WorkerInfo serializes"));
        match self {
            Registry::Nats(store) => store
                .put(info.id.to_string(), value)
                .await
                .map(|_| ())
                .map_err(|e| DiscoveryError::Register {
                    id: info.id,
                    reason: e.to_string(),
                }),
            Registry::Local(local) => {
                local.put(info.clone());
                Ok(())
            }
            Registry::Static(_) => Ok(()),
        }
    }

    /// Removes a registration (goodbye).
    pub async fn delete(&self, id: WorkerId) -> Result<(), DiscoveryError> {
        match self {
            Registry::Nats(store) => {
                store
                    .delete(id.to_string())
                    .await
                    .map_err(|e| DiscoveryError::Register {
                        id,
                        reason: e.to_string(),
                    })
            }
            Registry::Local(local) => {
                local.delete(id);
                Ok(())
            }
            Registry::Static(_) => Ok(()),
        }
    }

    /// Watches the fleet: every current registration as `Up`, then changes, with expiry
    /// enforced here by `lease.ttl_ms`. Runs until the receiver is dropped.
    pub fn watch(&self, lease: LeaseConfig) -> mpsc::Receiver<FleetEvent> {
        let (tx, rx) = mpsc::channel(1024);
        let (raw_tx, raw_rx) = mpsc::channel(1024);
        match self.clone() {
            Registry::Nats(store) => {
                tokio::spawn(watch_bucket(*store, raw_tx));
            }
            Registry::Local(local) => {
                let mut changes = local.changes.subscribe();
                let current: Vec<WorkerInfo> = local.workers.lock().values().cloned().collect();
                tokio::spawn(async move {
                    for info in current {
                        if raw_tx.send(Raw::Put(info)).await.is_err() {
                            return;
                        }
                    }
                    while let Ok(change) = changes.recv().await {
                        if raw_tx.send(change).await.is_err() {
                            return;
                        }
                    }
                });
            }
            Registry::Static(list) => {
                tokio::spawn(async move {
                    for info in list {
                        let _ = tx.send(FleetEvent::Up(info)).await;
                    }
                    // Static workers never expire: keep the channel open until the router
                    // drops it.
                    tx.closed().await;
                });
                return rx;
            }
        }
        tokio::spawn(enforce_ttl(raw_rx, tx, lease));
        rx
    }
}

/// A registration change as the backend reports it.
#[derive(Clone, Debug)]
enum Raw {
    Put(WorkerInfo),
    Delete(WorkerId),
}

async fn watch_bucket(store: async_nats::jetstream::kv::Store, tx: mpsc::Sender<Raw>) {
    use async_nats::jetstream::kv::Operation;
    use futures_util::StreamExt;
    loop {
        let mut watch = match store.watch_with_history(">").await {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch the worker registry; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        while let Some(entry) = watch.next().await {
            let raw = match entry {
                Ok(entry) => match entry.operation {
                    Operation::Put => match serde_json::from_slice::<WorkerInfo>(&entry.value) {
                        Ok(info) => Raw::Put(info),
                        Err(e) => {
                            tracing::warn!(key = %entry.key, error = %e, "ignoring malformed worker registration");
                            continue;
                        }
                    },
                    Operation::Delete | Operation::Purge => match entry.key.parse::<u64>() {
                        Ok(id) => Raw::Delete(WorkerId(id)),
                        Err(_) => continue,
                    },
                },
                Err(e) => {
                    tracing::warn!(error = %e, "worker registry watch error");
                    break;
                }
            };
            if tx.send(raw).await.is_err() {
                return;
            }
        }
        if tx.is_closed() {
            return;
        }
        // The watch ended (server restart): watch again; current entries come back as puts.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Forwards registrations, and declares a worker down once its lease lapses.
async fn enforce_ttl(
    mut raw: mpsc::Receiver<Raw>,
    tx: mpsc::Sender<FleetEvent>,
    lease: LeaseConfig,
) {
    let ttl = Duration::from_millis(lease.ttl_ms);
    let mut seen: HashMap<WorkerId, Instant> = HashMap::new();
    let mut check =
        tokio::time::interval(Duration::from_millis((lease.ttl_ms / 10).clamp(10, 250)));
    loop {
        tokio::select! {
            change = raw.recv() => {
                let event = match change {
                    Some(Raw::Put(info)) => {
                        seen.insert(info.id, Instant::now());
                        FleetEvent::Up(info)
                    }
                    Some(Raw::Delete(id)) => {
                        if seen.remove(&id).is_none() {
                            continue;
                        }
                        FleetEvent::Down { id, expired: false }
                    }
                    None => return,
                };
                if tx.send(event).await.is_err() {
                    return;
                }
            }
            _ = check.tick() => {
                let now = Instant::now();
                let expired: Vec<WorkerId> =
                    seen.iter().filter(|(_, at)| now.duration_since(**at) > ttl).map(|(id, _)| *id).collect();
                for id in expired {
                    seen.remove(&id);
                    tracing::warn!(worker = %id, ttl_ms = lease.ttl_ms, "worker lease expired");
                    if tx.send(FleetEvent::Down { id, expired: true }).await.is_err() {
                        return;
                    }
                }
            }
        }
    }
}

/// An in-process registry.
#[derive(Clone, Debug)]
pub struct LocalRegistry {
    workers: Arc<Mutex<HashMap<WorkerId, WorkerInfo>>>,
    changes: broadcast::Sender<Raw>,
}

impl Default for LocalRegistry {
    fn default() -> Self {
        LocalRegistry {
            workers: Arc::default(),
            changes: broadcast::channel(4096).0,
        }
    }
}

impl LocalRegistry {
    fn put(&self, info: WorkerInfo) {
        self.workers.lock().insert(info.id, info.clone());
        let _ = self.changes.send(Raw::Put(info));
    }

    fn delete(&self, id: WorkerId) {
        self.workers.lock().remove(&id);
        let _ = self.changes.send(Raw::Delete(id));
    }
}

/// A worker's registration: refreshed every heartbeat from `info` (which the worker keeps
/// current, e.g. its last event ids), removed on [`Registration::goodbye`].
#[derive(Debug)]
pub struct Registration {
    registry: Registry,
    info: Arc<Mutex<WorkerInfo>>,
    task: tokio::task::JoinHandle<()>,
}

impl Registration {
    /// Registers now and keeps the lease alive in the background.
    pub async fn start(
        registry: Registry,
        info: Arc<Mutex<WorkerInfo>>,
        lease: &LeaseConfig,
    ) -> Result<Registration, DiscoveryError> {
        let first = info.lock().clone();
        registry.put(&first).await?;
        let (r, i) = (registry.clone(), Arc::clone(&info));
        let period = Duration::from_millis(lease.heartbeat_ms.max(10));
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.tick().await;
            loop {
                tick.tick().await;
                let current = i.lock().clone();
                if let Err(e) = r.put(&current).await {
                    // NATS outages are expected; the client reconnects and the next beat
                    // lands, within the TTL if the outage is short.
                    tracing::warn!(worker = %current.id, error = %e, "heartbeat failed");
                }
            }
        });
        Ok(Registration {
            registry,
            info,
            task,
        })
    }

    /// Stops the heartbeat and removes the registration.
    pub async fn goodbye(self) {
        self.task.abort();
        let id = self.info.lock().id;
        if let Err(e) = self.registry.delete(id).await {
            tracing::warn!(worker = %id, error = %e, "goodbye failed; the lease will expire instead");
        }
    }

    /// Stops the heartbeat without saying goodbye (as a crashed worker would).
    pub fn abandon(self) {
        self.task.abort();
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.task.abort();
    }
}
