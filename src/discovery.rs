//! Which workers exist: registration with a lease in the JetStream KV bucket
//! `kvroute-<cluster>-workers` (DESIGN §5), an in-process registry for `kvroute up` and tests,
//! or a static list for setups without JetStream. This module reports what the registry says
//! (validated registrations and goodbyes); the router's fleet state machine
//! ([`crate::events::fleet`]) owns the leases and decides when a silent worker has expired.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv;
use bytes::Bytes;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, mpsc, watch};

use crate::protocol::WorkerId;

/// Most data-parallel ranks one registration may declare (each becomes an event stream and a
/// scheduler entry; the largest wide-EP deployments run a few hundred).
pub const MAX_DP_SIZE: u32 = 1024;
/// Largest registration accepted, bytes of JSON.
pub const MAX_INFO_BYTES: usize = 64 << 10;
/// Longest URL accepted, bytes.
const MAX_URL_BYTES: usize = 2048;
/// Longest model or adapter name accepted, bytes.
pub const MAX_MODEL_BYTES: usize = 256;
/// Most LoRA adapters one registration names.
pub const MAX_ADAPTERS: usize = 256;
/// Largest block size accepted, tokens.
const MAX_BLOCK_SIZE: usize = 1 << 16;
/// Largest pool accepted, blocks (2⁴⁰: far beyond any GPU or host memory).
pub(crate) const MAX_POOL_BLOCKS: usize = 1 << 40;

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
    /// What the router sends it (absent in registrations of older workers: kvroute's).
    #[serde(default)]
    pub api: WorkerApi,
    /// LoRA adapters it serves on top of `model` (requests name them as their model).
    #[serde(default)]
    pub adapters: Vec<String>,
    /// A real engine's load as its `/metrics` last showed it (sidecars report it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_load: Option<crate::engines::metrics::EngineLoad>,
    /// A real engine's event-stream faults (sidecars report them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_faults: Option<crate::engines::metrics::EventFaults>,
    /// A real engine's KV usage per data-parallel rank, per mille, where its `/metrics`
    /// shows each rank's (vLLM's `engine` label); `engine_load` has their mean.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub engine_rank_kv_usage: Vec<u16>,
    /// Its engine publishes no KV events: its sidecar guesses the engine's cache from the
    /// prompts routers send it, which they report on `kvroute.<c>.routed.<worker>`
    /// ([`crate::events::routed`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub learns_routes: bool,
    /// This incarnation has said goodbye (its last write: [`Registration::goodbye`]). A
    /// router removes the member only if it is this incarnation: a bare delete names no
    /// incarnation, and a predecessor leaving under the same id removed its replacement.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub left: bool,
}

/// How the router talks to a worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkerApi {
    /// `kvroute-worker`'s internal generate endpoint, with the router's token ids.
    #[default]
    Kvroute,
    /// An engine's own OpenAI endpoints (vLLM, SGLang, any OpenAI server): the client's body
    /// as it came, to `/v1/completions` or `/v1/chat/completions`.
    Openai,
}

/// Why a registration was refused at decode.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum InfoError {
    /// Not JSON of a `WorkerInfo`.
    #[error("registration is not a WorkerInfo: {0}")]
    Json(String),
    /// Over [`MAX_INFO_BYTES`].
    #[error("registration of {bytes} bytes is over the {MAX_INFO_BYTES}-byte limit")]
    TooLarge {
        /// Its size.
        bytes: usize,
    },
    /// A field outside its range.
    #[error("registration of worker {id}: {field} {problem}")]
    Field {
        /// The worker.
        id: WorkerId,
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        problem: String,
    },
}

impl WorkerInfo {
    /// Decodes and validates a registration as it arrives from the registry.
    pub fn decode(bytes: &[u8]) -> Result<WorkerInfo, InfoError> {
        if bytes.len() > MAX_INFO_BYTES {
            return Err(InfoError::TooLarge { bytes: bytes.len() });
        }
        let info: WorkerInfo =
            serde_json::from_slice(bytes).map_err(|e| InfoError::Json(e.to_string()))?;
        info.validate()?;
        Ok(info)
    }

    /// Checks every field against what a real worker can register: a registration decides
    /// how many streams and scheduler entries the router keeps, so it is bounded before use.
    pub fn validate(&self) -> Result<(), InfoError> {
        let bad = |field: &'static str, problem: String| {
            Err(InfoError::Field {
                id: self.id,
                field,
                problem,
            })
        };
        if !(1..=MAX_DP_SIZE).contains(&self.dp_size) {
            return bad(
                "dp_size",
                format!("{} is outside 1..={MAX_DP_SIZE}", self.dp_size),
            );
        }
        if self.last_event_ids.len() > self.dp_size as usize {
            return bad(
                "last_event_ids",
                format!(
                    "has {} entries for {} ranks",
                    self.last_event_ids.len(),
                    self.dp_size
                ),
            );
        }
        if !(1..=MAX_BLOCK_SIZE).contains(&self.block_size) {
            return bad(
                "block_size",
                format!("{} is outside 1..={MAX_BLOCK_SIZE}", self.block_size),
            );
        }
        if self.g1_blocks == 0 || self.g1_blocks > MAX_POOL_BLOCKS {
            return bad(
                "g1_blocks",
                format!("{} is outside 1..=2^40", self.g1_blocks),
            );
        }
        if self.g2_blocks > MAX_POOL_BLOCKS {
            return bad("g2_blocks", format!("{} is over 2^40", self.g2_blocks));
        }
        let printable = |s: &str| !s.chars().any(|c| c.is_control() || c.is_whitespace());
        if !model_name_ok(&self.model) {
            return bad(
                "model",
                format!("must be 1..={MAX_MODEL_BYTES} bytes without spaces or control characters"),
            );
        }
        if self.adapters.len() > MAX_ADAPTERS
            || self
                .adapters
                .iter()
                .any(|a| !model_name_ok(a) || *a == self.model)
        {
            return bad(
                "adapters",
                format!(
                    "at most {MAX_ADAPTERS} names of 1..={MAX_MODEL_BYTES} bytes without spaces, none the base model"
                ),
            );
        }
        if self.engine_load.is_some_and(|l| !l.is_valid()) {
            return bad(
                "engine_load",
                "counts must be finite and non-negative, KV usage within 0..=1".into(),
            );
        }
        if self.engine_rank_kv_usage.len() > self.dp_size as usize
            || self.engine_rank_kv_usage.iter().any(|u| *u > 1000)
        {
            return bad(
                "engine_rank_kv_usage",
                "one per-mille figure (0..=1000) per rank at most".into(),
            );
        }
        // Plain HTTP only: the router's client has no TLS, and an https worker could never
        // be reached (put TLS in front of the router, or a mesh between it and workers).
        let scheme_ok = self.url.starts_with("http://");
        // The router builds `{url}/internal/generate` from it: it must parse as a URI.
        let parses = || {
            format!("{}/internal/generate", self.url.trim_end_matches('/'))
                .parse::<hyper::Uri>()
                .is_ok_and(|u| u.authority().is_some())
        };
        if !scheme_ok || self.url.len() > MAX_URL_BYTES || !printable(&self.url) || !parses() {
            return bad(
                "url",
                format!("must be an http:// URL (no TLS) of at most {MAX_URL_BYTES} bytes"),
            );
        }
        Ok(())
    }
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

/// The fewest heartbeat periods a lease may span. A router whose own writes to the registry
/// fail counts workers' heartbeats that arrive within half a lease of each other as the
/// registry taking writes (discovery's watch): half a lease must span two periods, so that
/// one late heartbeat does not turn the router deaf, and it keeps crashed workers lapsing.
pub const MIN_LEASE_HEARTBEATS: u64 = 4;

/// The longest lease, ms (an hour): the registry bucket keeps a registration for two, and a
/// lease meant as "never" (`u64::MAX`) overflowed that age (a debug build panicked; a release
/// one wrapped it to an age of 0, which JetStream reads as keeping it for ever).
pub const MAX_LEASE_TTL_MS: u64 = 3_600_000;

/// Why lease timing cannot work.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LeaseError {
    /// A heartbeat period of zero.
    #[error("the heartbeat period must be at least 1 ms")]
    NoHeartbeat,
    /// A lease shorter than `MIN_LEASE_HEARTBEATS` heartbeat periods.
    #[error(
        "a lease of {ttl_ms} ms is under {MIN_LEASE_HEARTBEATS} heartbeat periods of {heartbeat_ms} ms: \
         a router that cannot write the registry counts heartbeats within half a lease of each \
         other as the registry taking writes, and would take one late heartbeat for an outage \
         (and stop lapsing crashed workers)"
    )]
    TooShort {
        /// The lease, ms.
        ttl_ms: u64,
        /// The heartbeat period, ms.
        heartbeat_ms: u64,
    },
    /// A lease over [`MAX_LEASE_TTL_MS`].
    #[error("a lease of {ttl_ms} ms is over the most, {MAX_LEASE_TTL_MS} ms (an hour)")]
    TooLong {
        /// The lease, ms.
        ttl_ms: u64,
    },
}

impl LeaseConfig {
    /// Checks that the lease spans at least [`MIN_LEASE_HEARTBEATS`] heartbeat periods, and
    /// at most [`MAX_LEASE_TTL_MS`].
    pub fn validate(&self) -> Result<(), LeaseError> {
        if self.heartbeat_ms == 0 {
            return Err(LeaseError::NoHeartbeat);
        }
        if self.ttl_ms > MAX_LEASE_TTL_MS {
            return Err(LeaseError::TooLong {
                ttl_ms: self.ttl_ms,
            });
        }
        if self.ttl_ms < MIN_LEASE_HEARTBEATS.saturating_mul(self.heartbeat_ms) {
            return Err(LeaseError::TooShort {
                ttl_ms: self.ttl_ms,
                heartbeat_ms: self.heartbeat_ms,
            });
        }
        Ok(())
    }
}

impl Default for LeaseConfig {
    fn default() -> Self {
        LeaseConfig {
            heartbeat_ms: 1_000,
            ttl_ms: 5_000,
        }
    }
}

/// What the registry reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RegistryEvent {
    /// A worker registered or refreshed its registration (validated).
    Put(WorkerInfo),
    /// A registration read back from the registry's history as a watch starts, written
    /// `age_ms` before the registry's newest entry (both the registry's timestamps, so the
    /// router's clock does not enter). A worker that stopped without a goodbye left one.
    Replayed {
        /// The registration.
        info: WorkerInfo,
        /// How much older it is than the registry's newest entry, ms.
        age_ms: u64,
    },
    /// A worker said goodbye.
    Delete(WorkerId),
}

/// The registry's reports, and whether its registrations lapse.
#[derive(Debug)]
pub struct Watch {
    /// Registrations and goodbyes, in order; every current registration comes first.
    pub events: mpsc::Receiver<RegistryEvent>,
    /// A registration not refreshed for this long has expired, ms (`None`: a static list).
    pub lease_ttl_ms: Option<u64>,
    /// Whether the registry takes writes now (this router's, or the workers' heartbeats)
    /// and this watch hears them. While it does not (a JetStream cluster electing the
    /// bucket's leader or short of a quorum, or a watch being re-created), silence says
    /// nothing of the workers and no lease may lapse.
    pub healthy: watch::Receiver<bool>,
}

/// Registry keys under this prefix are routers' write probes, not registrations.
const PROBE_PREFIX: &str = "_probe.";

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
    Nats(Box<NatsBucket>),
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
    /// Opens the cluster's KV bucket, creating it if needed with up to `replicas` copies
    /// (fewer if the JetStream cluster has fewer servers), and raising the replicas of an
    /// existing bucket that has fewer than the cluster allows.
    pub async fn nats(
        client: async_nats::Client,
        cluster: &str,
        lease: &LeaseConfig,
        replicas: usize,
    ) -> Result<Registry, DiscoveryError> {
        let js = async_nats::jetstream::new(client);
        let bucket = bucket_name(cluster);
        let wanted = replicas.clamp(1, 5);
        let store = match js.get_key_value(&bucket).await {
            Ok(store) => {
                raise_replicas(&js, &bucket, wanted).await;
                store
            }
            // Not there, or JetStream not ready yet: creating retries either way.
            Err(_) => create_bucket(&js, &bucket, lease, wanted).await?,
        };
        Ok(Registry::Nats(Box::new(NatsBucket {
            store,
            js,
            config: bucket_config(&bucket, lease, wanted),
        })))
    }

    /// Writes (or refreshes) a registration.
    pub async fn put(&self, info: &WorkerInfo) -> Result<(), DiscoveryError> {
        let value =
            Bytes::from(serde_json::to_vec(info).expect("invariant: WorkerInfo serializes"));
        match self {
            Registry::Nats(bucket) => bucket
                .put(&info.id.to_string(), value)
                .await
                .map(|_| ())
                .map_err(|e| DiscoveryError::Register {
                    id: info.id,
                    reason: e.to_string(),
                }),
            Registry::Local(local) => {
                #[cfg(test)]
                local.held.until_released().await;
                local.put(info.clone());
                Ok(())
            }
            Registry::Static(_) => Ok(()),
        }
    }

    /// Watches the registry until the receiver is dropped: every current registration
    /// (as `Replayed` from a NATS bucket, with its age; as `Put` otherwise), then changes.
    /// `lease` says how long a silent registration lives.
    pub fn watch(&self, lease: LeaseConfig) -> Watch {
        let (tx, events) = mpsc::channel(1024);
        // In-process and static registries always take writes.
        // In-process and static registries always take writes and are always heard.
        let (healthy_tx, healthy) = watch::channel(true);
        let lease_ttl_ms = match self.clone() {
            Registry::Nats(bucket) => {
                let period = probe_period(lease.ttl_ms);
                let (writable_tx, writable) = watch::channel(true);
                let (acked_tx, acked) = watch::channel(0);
                let store = bucket.store.clone();
                tokio::spawn(probe_bucket(*bucket, writable_tx, acked_tx, period));
                tokio::spawn(watch_bucket(
                    store,
                    tx,
                    writable,
                    acked,
                    healthy_tx,
                    3 * period,
                    Duration::from_millis(lease.ttl_ms),
                ));
                Some(lease.ttl_ms)
            }
            Registry::Local(local) => {
                tokio::spawn(watch_local(local, tx));
                Some(lease.ttl_ms)
            }
            Registry::Static(list) => {
                tokio::spawn(async move {
                    for info in list {
                        if tx.send(RegistryEvent::Put(info)).await.is_err() {
                            return;
                        }
                    }
                    // Static workers never expire: keep the channel open until the router
                    // drops it.
                    tx.closed().await;
                });
                None
            }
        };
        Watch {
            events,
            lease_ttl_ms,
            healthy,
        }
    }
}

/// How often a router checks that the bucket takes writes: a fifth of the lease, so that an
/// outage is noticed (one period, plus a probe's deadline of two) well before a lease that
/// was refreshed just before it could lapse. The watch hears each probe, so a watch silent
/// for three periods while the bucket takes writes has gone stale.
fn probe_period(ttl_ms: u64) -> Duration {
    Duration::from_millis(probe_period_ms(ttl_ms))
}

/// [`probe_period`] in ms.
pub fn probe_period_ms(ttl_ms: u64) -> u64 {
    (ttl_ms / 5).clamp(50, 1000)
}

/// Writes a key of this router's own into the bucket every `period` and reports whether
/// the write was acknowledged within two periods: the same path a worker's heartbeat takes,
/// so an election, a lost quorum or a stream without a leader all read as not writable.
/// (Asking the stream's info would not do: a lone server that has lost its quorum may still
/// call itself the leader.) The key ages out with the bucket's `max_age` once the router is
/// gone; watchers take it as a sign that they still hear the bucket, not as a registration.
async fn probe_bucket(
    bucket: NatsBucket,
    writable: watch::Sender<bool>,
    acked: watch::Sender<u64>,
    period: Duration,
) {
    use std::hash::{BuildHasher, Hasher};
    let nonce = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    let key = format!("{PROBE_PREFIX}{nonce:016x}");
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut beats = 0u64;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = writable.closed() => return,
        }
        beats += 1;
        let put = bucket.put(&key, Bytes::from(beats.to_string()));
        let error = match tokio::time::timeout(2 * period, put).await {
            Ok(Ok(_)) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(_) => Some(format!("no acknowledgement within {:?}", 2 * period)),
        };
        let now = error.is_none();
        if now {
            acked.send_modify(|n| *n += 1);
        }
        let mut was = now;
        // Receivers are woken by a change only (the watch times its silence from entries).
        writable.send_if_modified(|w| {
            was = std::mem::replace(w, now);
            was != now
        });
        metrics::gauge!("kvroute_registry_writable").set(if now { 1.0 } else { 0.0 });
        match (was, error) {
            (true, Some(error)) => tracing::warn!(
                %error,
                "the worker registry takes no writes from this router: no lease lapses while no worker's heartbeat arrives either"
            ),
            (false, None) => tracing::info!("the worker registry takes writes again"),
            _ => {}
        }
    }
}

/// How long to keep trying for the bucket while JetStream is still electing its leaders
/// (a cluster starting beside us), before giving up.
const BUCKET_PATIENCE: Duration = Duration::from_secs(60);
/// How long to insist on all `wanted` replicas before settling for fewer (a cluster whose
/// last server is still joining refuses them for a second or two).
const REPLICA_PATIENCE: Duration = Duration::from_secs(10);

/// Creates the bucket with as many replicas as the JetStream cluster allows, up to `wanted`:
/// a server without clustering refuses more than one at once; a cluster short of servers
/// gets `wanted` for a while, then fewer.
async fn create_bucket(
    js: &async_nats::jetstream::Context,
    bucket: &str,
    lease: &LeaseConfig,
    wanted: usize,
) -> Result<async_nats::jetstream::kv::Store, DiscoveryError> {
    let started = tokio::time::Instant::now();
    let mut replicas = wanted;
    let mut backoff = Duration::from_millis(100);
    loop {
        let config = bucket_config(bucket, lease, replicas);
        let error = match js.create_key_value(config).await {
            Ok(store) => {
                tracing::info!(bucket, replicas, "created the worker registry bucket");
                return Ok(store);
            }
            Err(e) => e.to_string(),
        };
        // Another process may have created it meanwhile.
        if let Ok(store) = js.get_key_value(bucket).await {
            return Ok(store);
        }
        if started.elapsed() > BUCKET_PATIENCE {
            return Err(DiscoveryError::Bucket {
                bucket: bucket.to_owned(),
                reason: error,
            });
        }
        // At once, but only once: a server that says so of one replica too must not be
        // asked again without a pause.
        if replicas > 1 && error.contains("non-clustered") {
            replicas = 1;
            continue;
        }
        if replicas > 1 && started.elapsed() > REPLICA_PATIENCE {
            replicas -= 1;
        }
        tracing::warn!(bucket, replicas, %error, "cannot create the registry bucket yet; retrying");
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// The registry bucket's configuration: one value a key, kept for two leases.
fn bucket_config(bucket: &str, lease: &LeaseConfig, replicas: usize) -> kv::Config {
    kv::Config {
        bucket: bucket.to_owned(),
        history: 1,
        max_age: Duration::from_millis(lease.ttl_ms.max(1000).saturating_mul(2)),
        num_replicas: replicas,
        ..Default::default()
    }
}

/// A registry bucket on JetStream, and what it takes to create it again.
#[derive(Clone, Debug)]
pub struct NatsBucket {
    store: kv::Store,
    js: async_nats::jetstream::Context,
    config: kv::Config,
}

impl NatsBucket {
    /// Writes `key`. A bucket that is gone (deleted, or lost with a server's store: the
    /// chart's NATS without persistence keeps it in an `emptyDir`) is created again and
    /// the write tried once more: without it every heartbeat and probe failed until some
    /// process restarted, and routers stayed deaf, keeping crashed workers routable.
    async fn put(&self, key: &str, value: Bytes) -> Result<u64, kv::PutError> {
        match self.store.put(key, value.clone()).await {
            Err(e) if stream_gone(&e) => {
                self.create_again().await;
                self.store.put(key, value).await
            }
            result => result,
        }
    }

    /// One try at creating the bucket again (the next failed write tries again), with one
    /// replica fewer after each refusal to place them, down to one: a cluster now short of
    /// servers refuses the replicas the bucket was first made with ("insufficient
    /// resources", "no suitable peers"; a single server, "non-clustered"), and only the last
    /// was stepped down from, so every probe and heartbeat failed until a server came back.
    /// (Any other error, a timeout while the cluster elects a leader, is not a reason to
    /// keep fewer copies for good.) Creating a bucket that exists with the same
    /// configuration succeeds and changes nothing; one with another (another process's
    /// lease) is refused, and nothing is lost either way.
    async fn create_again(&self) {
        let bucket = &self.config.bucket;
        let mut config = self.config.clone();
        let mut result = self.js.create_key_value(config.clone()).await;
        let unplaceable = |e: &async_nats::jetstream::context::CreateKeyValueError| {
            let e = e.to_string();
            [
                "non-clustered",
                "insufficient resources",
                "no suitable peers",
            ]
            .iter()
            .any(|m| e.contains(m))
        };
        while let Err(e) = &result
            && config.num_replicas > 1
            && unplaceable(e)
        {
            config.num_replicas -= 1;
            tracing::debug!(bucket, replicas = config.num_replicas, error = %e, "creating the registry bucket again with fewer replicas");
            result = self.js.create_key_value(config.clone()).await;
        }
        let replicas = config.num_replicas;
        match result {
            Ok(_) => {
                metrics::counter!("kvroute_registry_bucket_created_again_total").increment(1);
                tracing::warn!(
                    bucket,
                    replicas,
                    wanted = self.config.num_replicas,
                    "the worker registry bucket was gone; created it again (workers re-register with their next heartbeat; with fewer replicas than wanted, a router's restart raises them)"
                );
            }
            Err(e) => {
                tracing::warn!(bucket, error = %e, "the worker registry bucket is gone and cannot be created yet")
            }
        }
    }
}

/// Whether a write failed because no stream takes the bucket's subjects (JetStream answers
/// a publish to them with "no responders").
fn stream_gone(e: &kv::PutError) -> bool {
    use async_nats::jetstream::context::{PublishError, PublishErrorKind};
    std::error::Error::source(e)
        .and_then(|source| source.downcast_ref::<PublishError>())
        .is_some_and(|e| e.kind() == PublishErrorKind::StreamNotFound)
}

/// Raises an existing bucket's replicas towards `wanted`, as far as the cluster allows (a
/// bucket created on one server keeps one copy after the cluster grows).
async fn raise_replicas(js: &async_nats::jetstream::Context, bucket: &str, wanted: usize) {
    let name = format!("KV_{bucket}");
    let Ok(mut stream) = js.get_stream(&name).await else {
        return;
    };
    let Ok(info) = stream.info().await else {
        return;
    };
    let mut config = info.config.clone();
    let current = config.num_replicas.max(1);
    for replicas in ((current + 1)..=wanted).rev() {
        config.num_replicas = replicas;
        match js.update_stream(&config).await {
            Ok(_) => {
                tracing::info!(
                    bucket,
                    from = current,
                    to = replicas,
                    "raised the worker registry's replicas"
                );
                return;
            }
            Err(e) => {
                tracing::debug!(bucket, replicas, error = %e, "cannot raise the registry's replicas")
            }
        }
    }
}

/// Follows the bucket: its history as `Replayed` (aged), then changes. `healthy` says
/// whether the bucket takes writes and this watch hears them. The bucket takes writes while
/// this router's probe is acknowledged (`writable`), or, for a router whose own writes fail
/// (its NATS account may not write the bucket), while workers' heartbeats heard since then
/// arrive within half a `lease` of each other: a silent worker is then gone, not cut off.
/// (Half a lease: with the default lease of five heartbeat periods, longer than a
/// heartbeat period, and short enough that when every write stops, an election, the router
/// turns deaf before any worker's lease could lapse. Workers and the chart refuse a lease
/// under `MIN_LEASE_HEARTBEATS` periods: at fewer, one late heartbeat turns a router whose
/// writes fail deaf.) A watch that hears nothing for
/// `stale_after` while this router's probes land (a consumer left behind by a leader
/// change, which would otherwise go quiet for good), or for half a lease after heartbeats
/// were heard, is re-created and reads every registration again.
async fn watch_bucket(
    store: async_nats::jetstream::kv::Store,
    tx: mpsc::Sender<RegistryEvent>,
    mut writable: watch::Receiver<bool>,
    mut acked: watch::Receiver<u64>,
    healthy: watch::Sender<bool>,
    stale_after: Duration,
    lease: Duration,
) {
    use futures_util::StreamExt;
    use tokio::time::Instant;
    let mut backoff = Duration::from_millis(200);
    loop {
        // Deaf until the new watch has delivered the bucket's history.
        healthy.send_replace(false);
        // A probe acknowledged from now on is in the history the watch reads, so the
        // history's newest entry, which ages every registration, is about now (unless this
        // router cannot write; then the workers' newest heartbeat is).
        acked.borrow_and_update();
        if *writable.borrow() {
            let landed_or_failed = async {
                loop {
                    tokio::select! {
                        _ = acked.changed() => return,
                        changed = writable.changed() => {
                            if changed.is_err() || !*writable.borrow() {
                                return;
                            }
                        }
                    }
                }
            };
            tokio::select! {
                _ = tokio::time::timeout(stale_after, landed_or_failed) => {}
                _ = tx.closed() => return,
            }
        }
        // Bounded, and given up when the router goes: creating the watch's consumer is a
        // request the client sends only once connected.
        let started = tokio::select! {
            started = tokio::time::timeout(WATCH_START, store.watch_with_history(">")) => started,
            _ = tx.closed() => return,
        };
        let mut watch = match started {
            Ok(Ok(w)) => w,
            Err(_) => {
                tracing::warn!(
                    "the worker registry's watch did not start within {WATCH_START:?}; retrying"
                );
                continue;
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "cannot watch the worker registry; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = tx.closed() => return,
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        backoff = Duration::from_millis(200);
        let mut last_entry = Instant::now();
        // The history, held until the watch has caught up with the bucket, so that each
        // registration's age is counted from the newest entry; the watch is heard once it
        // is delivered.
        let mut history = Some(History::default());
        // When a worker's registration was last written, live, since this router's own
        // writes last failed.
        let mut heartbeat_at: Option<Instant> = None;
        let window = lease / 2;
        let takes_writes = |writable: bool, heartbeat_at: Option<Instant>| {
            writable || heartbeat_at.is_some_and(|at| at.elapsed() < window)
        };
        loop {
            let heartbeats_stop = heartbeat_at
                .filter(|_| !*writable.borrow())
                .map(|at| at + window);
            let entry = tokio::select! {
                entry = tokio::time::timeout_at(last_entry + stale_after, watch.next()) => entry,
                changed = writable.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    if !*writable.borrow() {
                        // Only heartbeats heard from now on show that others' writes land.
                        heartbeat_at = None;
                    }
                    healthy.send_replace(
                        history.is_none() && takes_writes(*writable.borrow(), heartbeat_at),
                    );
                    continue;
                }
                () = async {
                    match heartbeats_stop {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                } => {
                    // No heartbeat for half a lease, and this router cannot write: every
                    // write stopped (an election), every worker is gone, or this watch is
                    // stale. Deaf until heard again; read the bucket afresh.
                    tracing::warn!(
                        "no worker's heartbeat for half a lease while this router cannot write the registry; watching it again"
                    );
                    break;
                }
                _ = tx.closed() => return,
            };
            let entry = match entry {
                Ok(Some(Ok(entry))) => entry,
                Ok(Some(Err(e))) => {
                    tracing::warn!(error = %e, "worker registry watch error");
                    break;
                }
                Ok(None) => break,
                Err(_) => {
                    if !*writable.borrow()
                        && let Some(h) = history.take()
                    {
                        // Nothing is written, so nothing will say the history is over (its
                        // last entry removed before delivery): silence does.
                        if send_all(&tx, h.aged()).await.is_err() {
                            return;
                        }
                        healthy.send_replace(takes_writes(*writable.borrow(), heartbeat_at));
                    } else if *writable.borrow() {
                        metrics::counter!("kvroute_registry_watch_restarts_total").increment(1);
                        tracing::warn!(
                            silent = ?stale_after,
                            "the worker registry watch hears nothing while the registry takes writes; re-creating it"
                        );
                        break;
                    }
                    // Silence is expected while nothing can be written.
                    last_entry = Instant::now();
                    continue;
                }
            };
            last_entry = Instant::now();
            let caught_up = entry.seen_current;
            let created_ms = unix_ms(entry.created.unix_timestamp_nanos());
            let event = registry_event(&entry);
            let Some(h) = &mut history else {
                if matches!(event, Some(RegistryEvent::Put(_))) {
                    let was = takes_writes(*writable.borrow(), heartbeat_at);
                    heartbeat_at = Some(Instant::now());
                    if !was {
                        // (Also after a single late acknowledgement of this router's probe.)
                        tracing::info!(
                            "workers' heartbeats reach the worker registry while this router's writes do not (its NATS account may lack write access to the bucket): leases lapse again"
                        );
                        healthy.send_replace(true);
                    }
                }
                if let Some(event) = event
                    && tx.send(event).await.is_err()
                {
                    return;
                }
                continue;
            };
            h.newest_ms = h.newest_ms.max(created_ms);
            h.events.extend(event.map(|e| (e, created_ms)));
            if caught_up {
                let events = history.take().map_or_else(Vec::new, History::aged);
                if send_all(&tx, events).await.is_err() {
                    return;
                }
                healthy.send_replace(takes_writes(*writable.borrow(), heartbeat_at));
            }
        }
        // The watch ended (server restart, leader change) or went stale: watch again;
        // current entries come back, aged by when they were written, and goodbyes missed
        // meanwhile lapse with their leases.
        healthy.send_replace(false);
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            _ = tx.closed() => return,
        }
    }
}

/// What a registry entry reports, if anything (probes and invalid entries report nothing).
fn registry_event(entry: &async_nats::jetstream::kv::Entry) -> Option<RegistryEvent> {
    use async_nats::jetstream::kv::Operation;
    let put = match entry.operation {
        Operation::Put => Some(entry.value.as_ref()),
        Operation::Delete | Operation::Purge => None,
    };
    registry_change(&entry.key, put)
}

/// Invalid registrations are logged at most this often, all together (each is counted): a
/// misconfigured worker's every heartbeat is invalid again.
static INVALID_LOGGED: crate::process::LogEvery =
    crate::process::LogEvery::new(Duration::from_secs(10));

/// What a change to registry key `key` reports: a put of `value`, or a delete (`None`).
/// A registration lives under its worker's id, so that the worker's goodbye (a delete of
/// that key) ends it: one under another key is invalid.
fn registry_change(key: &str, put: Option<&[u8]>) -> Option<RegistryEvent> {
    if key.starts_with(PROBE_PREFIX) {
        return None;
    }
    let Some(value) = put else {
        // Only a worker's own key (its id as written: "013" is no worker's key) says its
        // goodbye.
        return key
            .parse::<u64>()
            .ok()
            .filter(|id| id.to_string() == key)
            .map(|id| RegistryEvent::Delete(WorkerId(id)));
    };
    let invalid = |error: String| {
        metrics::counter!("kvroute_registry_invalid_total").increment(1);
        if INVALID_LOGGED.due() {
            tracing::warn!(
                key,
                error,
                "ignoring invalid worker registration (each is counted in kvroute_registry_invalid_total; this is said at most every 10 s)"
            );
        }
        None
    };
    match WorkerInfo::decode(value) {
        Ok(info) if key == info.id.to_string() => Some(RegistryEvent::Put(info)),
        Ok(info) => invalid(format!(
            "registered under key {key:?} but names worker {}",
            info.id.0
        )),
        Err(e) => invalid(e.to_string()),
    }
}

/// Sends `events` in order; `Err` once the receiver is gone.
async fn send_all(
    tx: &mpsc::Sender<RegistryEvent>,
    events: Vec<RegistryEvent>,
) -> Result<(), mpsc::error::SendError<RegistryEvent>> {
    for event in events {
        tx.send(event).await?;
    }
    Ok(())
}

/// The entries a watch reads back before it has caught up with the bucket.
#[derive(Default)]
struct History {
    /// With each entry's write time, ms since the Unix epoch (the server's clock).
    events: Vec<(RegistryEvent, i64)>,
    /// The newest write time among them, probes included.
    newest_ms: i64,
}

impl History {
    /// The entries in order, registrations with their age against the newest entry.
    fn aged(self) -> Vec<RegistryEvent> {
        let newest = self.newest_ms;
        self.events
            .into_iter()
            .map(|(event, created_ms)| match event {
                RegistryEvent::Put(info) => RegistryEvent::Replayed {
                    info,
                    age_ms: u64::try_from(newest.saturating_sub(created_ms)).unwrap_or(0),
                },
                other => other,
            })
            .collect()
    }
}

/// A JetStream timestamp (ns since the Unix epoch) in ms.
fn unix_ms(unix_ns: i128) -> i64 {
    i64::try_from(unix_ns / 1_000_000).unwrap_or(0)
}

/// Forwards an in-process registry's changes. A subscriber that falls behind the broadcast
/// (`Lagged`) resyncs from the registry's current contents instead of stopping: goodbyes it
/// missed lapse with their leases.
async fn watch_local(local: LocalRegistry, tx: mpsc::Sender<RegistryEvent>) {
    use tokio::sync::broadcast::error::RecvError;
    loop {
        let mut changes = local.changes.subscribe();
        let current: Vec<WorkerInfo> = local.workers.lock().values().cloned().collect();
        for info in current {
            if tx.send(RegistryEvent::Put(info)).await.is_err() {
                return;
            }
        }
        loop {
            match changes.recv().await {
                Ok(event) => {
                    if tx.send(event).await.is_err() {
                        return;
                    }
                }
                Err(RecvError::Lagged(missed)) => {
                    tracing::warn!(
                        missed,
                        "registry watch fell behind; resyncing from the registry"
                    );
                    break;
                }
                Err(RecvError::Closed) => return,
            }
        }
    }
}

/// An in-process registry.
#[derive(Clone, Debug)]
pub struct LocalRegistry {
    workers: Arc<Mutex<HashMap<WorkerId, WorkerInfo>>>,
    changes: broadcast::Sender<RegistryEvent>,
    /// A fault for tests: writes wait while it is held (a registry that takes none).
    #[cfg(test)]
    pub(crate) held: crate::events::transport::Hold,
}

impl Default for LocalRegistry {
    fn default() -> Self {
        LocalRegistry {
            workers: Arc::default(),
            changes: broadcast::channel(4096).0,
            #[cfg(test)]
            held: Default::default(),
        }
    }
}

impl LocalRegistry {
    /// Writes a registration (as a worker's heartbeat does).
    pub fn put(&self, info: WorkerInfo) {
        self.workers.lock().insert(info.id, info.clone());
        let _ = self.changes.send(RegistryEvent::Put(info));
    }

    /// Removes a registration (an operator's delete).
    pub fn delete(&self, id: WorkerId) {
        self.workers.lock().remove(&id);
        let _ = self.changes.send(RegistryEvent::Delete(id));
    }
}

/// Longest wait for the registry's watch to start (its consumer created).
const WATCH_START: Duration = Duration::from_secs(10);

/// How long a worker keeps trying to write its first registration before giving up.
const REGISTER_PATIENCE: Duration = Duration::from_secs(30);

/// A worker's registration: refreshed every heartbeat from `info` (which the worker keeps
/// current, e.g. its last event ids), removed on [`Registration::goodbye`].
#[derive(Debug)]
pub struct Registration {
    registry: Registry,
    info: Arc<Mutex<WorkerInfo>>,
    task: tokio::task::JoinHandle<()>,
    /// The lease's TTL: a goodbye not done by then is given up (the lease has expired).
    ttl: Duration,
}

impl Registration {
    /// Registers now and keeps the lease alive in the background.
    pub async fn start(
        registry: Registry,
        info: Arc<Mutex<WorkerInfo>>,
        lease: &LeaseConfig,
    ) -> Result<Registration, DiscoveryError> {
        let first = info.lock().clone();
        // The registry may be briefly unavailable (a JetStream cluster electing the
        // bucket's leader, or a bucket just created elsewhere): keep trying for a while.
        let give_up = tokio::time::Instant::now() + REGISTER_PATIENCE;
        let mut backoff = Duration::from_millis(100);
        // Each try is bounded too: a put the server never answers (a client reconnecting
        // takes no requests) would otherwise hold start-up past the patience.
        let attempt = || async {
            match tokio::time::timeout_at(give_up, registry.put(&first)).await {
                Ok(result) => result,
                Err(_) => Err(DiscoveryError::Register {
                    id: first.id,
                    reason: format!("not acknowledged within {REGISTER_PATIENCE:?}"),
                }),
            }
        };
        while let Err(e) = attempt().await {
            if tokio::time::Instant::now() >= give_up {
                return Err(e);
            }
            tracing::warn!(error = %e, "cannot register yet; retrying");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
        let (r, i) = (registry.clone(), Arc::clone(&info));
        let period = Duration::from_millis(lease.heartbeat_ms.max(10));
        // A beat not acknowledged by then is given up and the next one sent: a put that
        // waits on a stream without quorum would otherwise hold the next beats back for the
        // client's whole request timeout, past the lease, after the quorum is back.
        let deadline = (2 * period)
            .min(Duration::from_millis(lease.ttl_ms / 3))
            .max(Duration::from_millis(50));
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let current = i.lock().clone();
                let error = match tokio::time::timeout(deadline, r.put(&current)).await {
                    Ok(Ok(())) => continue,
                    Ok(Err(e)) => e.to_string(),
                    Err(_) => format!("not acknowledged within {deadline:?}"),
                };
                // NATS outages are expected; the client reconnects and the next beat
                // lands, within the TTL if the outage is short.
                tracing::warn!(worker = %current.id, %error, "heartbeat failed");
            }
        });
        Ok(Registration {
            registry,
            info,
            task,
            ttl: Duration::from_millis(lease.ttl_ms),
        })
    }

    /// Stops the heartbeat and says goodbye (the registration marked as left), waiting at
    /// most the lease's TTL
    /// (a registry that cannot be reached, as in a NATS outage, must not hold a shutdown).
    pub async fn goodbye(mut self) {
        self.task.abort();
        // Until it has stopped: a beat being sent on another thread could otherwise land
        // after the goodbye and take it back.
        let _ = (&mut self.task).await;
        // The goodbye names its incarnation: the registration written once more, marked as
        // left, which routers take as this incarnation's departure only. A bare delete named
        // none: a predecessor leaving under the same id (a replaced pod whose node came
        // back) removed its replacement from every router whenever its own beat had been
        // the last written. The marker stays until the bucket's max age (two leases), or
        // until the id's next live registration overwrites it.
        let mut info = self.info.lock().clone();
        info.left = true;
        let id = info.id;
        let error = match tokio::time::timeout(self.ttl, self.registry.put(&info)).await {
            Ok(Ok(())) => return,
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("not acknowledged within {:?}", self.ttl),
        };
        tracing::warn!(worker = %id, %error, "goodbye failed; the lease will expire instead");
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

/// Whether `name` can be a registered model or adapter name: 1 to 256 bytes, no spaces or
/// control characters.
pub fn model_name_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_MODEL_BYTES
        && !name.chars().any(|c| c.is_control() || c.is_whitespace())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lease spans at least four heartbeat periods (the default spans five).
    #[test]
    fn a_lease_under_four_heartbeats_is_refused() {
        let lease = |heartbeat_ms, ttl_ms| LeaseConfig {
            heartbeat_ms,
            ttl_ms,
        };
        assert_eq!(LeaseConfig::default().validate(), Ok(()));
        assert_eq!(lease(1_000, 4_000).validate(), Ok(()));
        assert_eq!(
            lease(1_000, 3_999).validate(),
            Err(LeaseError::TooShort {
                ttl_ms: 3_999,
                heartbeat_ms: 1_000
            })
        );
        assert_eq!(lease(0, 5_000).validate(), Err(LeaseError::NoHeartbeat));
        // At most an hour: "never" overflowed the bucket's age of two leases.
        assert_eq!(lease(1_000, MAX_LEASE_TTL_MS).validate(), Ok(()));
        assert_eq!(
            lease(1_000, u64::MAX).validate(),
            Err(LeaseError::TooLong { ttl_ms: u64::MAX })
        );
        let age = bucket_config("b", &lease(1_000, u64::MAX), 1).max_age;
        assert_eq!(age, Duration::from_millis(u64::MAX));
    }

    /// A registration counts only under its own worker's key: one under another key would
    /// outlive its worker's goodbye (a delete of the worker's key), or take over the worker
    /// whose id it names.
    #[test]
    fn a_registration_under_another_worker_s_key_is_invalid() {
        let info = WorkerInfo {
            id: WorkerId(13),
            ..test_info()
        };
        let value = serde_json::to_vec(&info).unwrap();
        assert!(matches!(
            registry_change("13", Some(&value)),
            Some(RegistryEvent::Put(i)) if i.id == WorkerId(13)
        ));
        assert!(registry_change("12", Some(&value)).is_none());
        assert!(registry_change("013", Some(&value)).is_none());
        assert!(matches!(
            registry_change("12", None),
            Some(RegistryEvent::Delete(WorkerId(12)))
        ));
        assert!(registry_change("012", None).is_none(), "no worker's key");
        assert!(registry_change(&format!("{PROBE_PREFIX}x"), None).is_none());
    }

    fn test_info() -> WorkerInfo {
        WorkerInfo {
            id: WorkerId(1),
            url: "http://127.0.0.1:9000".into(),
            block_size: 16,
            g1_blocks: 100,
            g2_blocks: 0,
            model: "m".into(),
            dp_size: 1,
            epoch: 1,
            last_event_ids: vec![0],
            api: crate::discovery::WorkerApi::Kvroute,
            adapters: Vec::new(),
            engine_load: None,
            event_faults: None,
            engine_rank_kv_usage: Vec::new(),
            learns_routes: false,
            left: false,
        }
    }

    /// Worker 1 registered in a local registry under the default lease.
    async fn registered_locally() -> (LocalRegistry, Arc<Mutex<WorkerInfo>>, Registration) {
        let local = LocalRegistry::default();
        let info = Arc::new(Mutex::new(test_info()));
        let registry = Registry::Local(local.clone());
        let registration =
            Registration::start(registry, Arc::clone(&info), &LeaseConfig::default())
                .await
                .unwrap();
        (local, info, registration)
    }

    /// A goodbye to a registry that takes no writes (NATS out of reach) gives up after the
    /// lease's TTL, leaving the entry to lapse, instead of holding the worker's shutdown
    /// (paused clock).
    #[tokio::test(start_paused = true)]
    async fn a_goodbye_the_registry_never_takes_gives_up_after_the_ttl() {
        let (local, _, registration) = registered_locally().await;
        let lease = LeaseConfig::default();
        local.held.set(true);
        let ttl = Duration::from_millis(lease.ttl_ms);
        let asked = tokio::time::Instant::now();
        let said = tokio::time::timeout(ttl + Duration::from_secs(1), registration.goodbye()).await;
        assert!(said.is_ok(), "the goodbye held the shutdown past the lease");
        let waited = asked.elapsed();
        assert!(
            waited >= ttl && waited < ttl + Duration::from_millis(10),
            "the goodbye waited {waited:?} for the registry, not the lease's {ttl:?}"
        );
        assert!(
            local.workers.lock().contains_key(&WorkerId(1)),
            "the held delete landed"
        );
    }

    /// A heartbeat the registry does not take is given up after its deadline and the next
    /// one sent, so the lease is renewed as soon as the registry takes writes again, with
    /// the worker's current state (paused clock).
    #[tokio::test(start_paused = true)]
    async fn a_heartbeat_the_registry_holds_is_given_up_and_the_next_sent() {
        let (local, info, _registration) = registered_locally().await;
        let lease = LeaseConfig::default();
        local.held.set(true);
        info.lock().g1_blocks = 7;
        // Ten heartbeat periods held: with each beat given up after its deadline (2 periods,
        // at most a third of the TTL), several are tried; without, the first waits it out.
        let period = Duration::from_millis(lease.heartbeat_ms);
        tokio::time::sleep(10 * period).await;
        let tried = local.held.held_writes();
        assert!(tried >= 3, "{tried} heartbeats tried while held");
        local.held.set(false);
        tokio::time::sleep(2 * period).await;
        assert_eq!(
            local.workers.lock().get(&WorkerId(1)).map(|w| w.g1_blocks),
            Some(7),
            "the lease was not renewed with the current state"
        );
    }

    #[test]
    fn a_url_the_router_cannot_build_a_request_from_is_refused() {
        let mut info = test_info();
        assert!(info.validate().is_ok());
        // https too: the router has no TLS client, so it could never reach such a worker.
        for bad in [
            "http://",
            "http://host<x>",
            "http://a\\b",
            "ftp://host",
            "https://host:8000",
        ] {
            info.url = bad.into();
            assert!(info.validate().is_err(), "{bad:?} accepted");
        }
    }
}
