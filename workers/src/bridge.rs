//! A real engine (vLLM, SGLang, any OpenAI server) as a kvroute worker: follows the engine's
//! ZMQ KV events per data-parallel rank, publishes them as kvroute `EventBatch`es (epochs,
//! gap-free ids, snapshots from the mirror, so a router that starts later gets the whole
//! cache), registers the engine's URL while its `/health` answers, and reports the load its
//! `/metrics` shows. The sidecar (`kvroute-worker --engine`) runs it over NATS; the router's
//! direct mode (`kvroute serve --backend`) runs one per backend on the in-process plane.

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http_body_util::Empty;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvroute::discovery::{LeaseConfig, Registration, Registry, WorkerApi, WorkerInfo};
use kvroute::engines::approx::ApproxCache;
use kvroute::engines::ingest::{self, EngineEndpoint, IngestLimits, IngestStats, Update};
use kvroute::engines::metrics;
use kvroute::events::transport::Transport;
use kvroute::ingress::RoutedPrompt;
use kvroute::protocol::{DpRank, WorkerId};
use parking_lot::Mutex;
use tokio::sync::{mpsc, watch};

mod telemetry;

use crate::plane::{SnapshotRequest, WorkerPlane};
use crate::publisher::{Announced, Publisher};
use crate::server::new_epoch;

/// Which engine a sidecar fronts (`kvroute-worker --engine`): vLLM and SGLang need their
/// KV-event endpoint; any other OpenAI server has none. Both engines' event formats and
/// metric names are read alike, so the bridge itself does not need to know.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// vLLM.
    Vllm,
    /// SGLang.
    Sglang,
    /// Any other OpenAI-compatible server (no KV events of its own).
    Openai,
}

/// One engine behind a bridge.
#[derive(Clone, Debug)]
pub struct BridgeConfig {
    /// The worker id it registers as.
    pub id: WorkerId,
    /// Where the engine serves HTTP (its OpenAI endpoints, `/health`, `/metrics`).
    pub engine_url: String,
    /// Rank 0's event sockets; `None`: no events (routing on load alone).
    pub events: Option<EngineEndpoint>,
    /// Data-parallel ranks behind the endpoint (each publishing on its own ports).
    pub dp_size: u32,
    /// The model the engine serves.
    pub model: String,
    /// Tokens per KV block (the engine's).
    pub block_size: NonZeroUsize,
    /// GPU blocks per chunk of the engine's offload tier, as its token-less events name
    /// them (vLLM's CPU offload with `blocks_per_chunk` > 1: [`kvroute::engines::EngineMirror::with_offload_chunk`]).
    pub offload_chunk: NonZeroUsize,
    /// Cluster name (NATS subjects).
    pub cluster: String,
    /// Registration lease.
    pub lease: LeaseConfig,
    /// How often `/health` is asked, and how long an answer may take.
    pub health_every: Duration,
    /// Consecutive failed health checks before the registration is withdrawn; and healthy
    /// ones before a withdrawn engine registers again.
    pub health_failures: u32,
    /// Deadlines and bounds of the event sockets.
    pub limits: IngestLimits,
    /// Sent as `Authorization: Bearer` to the engine (vLLM or SGLang started with
    /// `--api-key` refuse `/v1/models` without it).
    pub engine_api_key: Option<kvroute::auth::Secret>,
}

/// The engine's HTTP client, with the key its API wants, if any.
struct EngineClient {
    http: Client<HttpConnector, Empty<Bytes>>,
    api_key: Option<kvroute::auth::Secret>,
}

/// G1 capacity reported when the engine's metrics do not say (scheduler load is relative
/// to it).
const DEFAULT_G1_BLOCKS: usize = 1 << 16;

/// Runs a bridge until `stop` turns true; then says goodbye.
///
/// An engine without KV events (`config.events` none) may be given `learned`: the prompts a
/// router in this process sent it, from which an [`ApproxCache`] guesses its cache.
pub async fn run(
    config: BridgeConfig,
    transport: Transport,
    registry: Registry,
    mut stop: watch::Receiver<bool>,
    mut learned: Option<mpsc::Receiver<RoutedPrompt>>,
) -> anyhow::Result<()> {
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(config.health_every));
    let client = EngineClient {
        // Its health checks and metrics scrapes reuse connections the engine closes at 5 s.
        http: Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_millis(kvroute::http::ENGINE_POOL_IDLE_MS))
            .pool_timer(hyper_util::rt::TokioTimer::new())
            .build(connector),
        api_key: config.engine_api_key.clone(),
    };
    let epoch = new_epoch();
    let info = Arc::new(Mutex::new(WorkerInfo {
        id: config.id,
        url: config.engine_url.clone(),
        block_size: config.block_size.get(),
        g1_blocks: DEFAULT_G1_BLOCKS,
        g2_blocks: 0,
        model: config.model.clone(),
        dp_size: config.dp_size,
        epoch,
        last_event_ids: vec![0; config.dp_size as usize],
        api: WorkerApi::Openai,
        adapters: Vec::new(),
        engine_load: None,
        event_faults: None,
        engine_rank_kv_usage: Vec::new(),
        // Routers report what they send an engine without events to its sidecar.
        learns_routes: learned.is_some(),
        left: false,
    }));
    if !config.model.is_empty() {
        info.lock().validate()?;
    }
    let plane = WorkerPlane::new(transport.clone(), &config.cluster, Arc::clone(&info));
    let (snap_tx, mut snapshots) = mpsc::channel::<SnapshotRequest>(16);
    let snapshot_task =
        WorkerPlane::serve_snapshots(transport.clone(), &config.cluster, config.id, snap_tx)
            .await?;
    let mut telemetry =
        telemetry::Telemetry::new(config.id, config.dp_size, config.events.is_some());
    let mut streams: Vec<RankStream> = (0..config.dp_size)
        .map(|r| RankStream::new(Publisher::new(config.id, DpRank(r), epoch)))
        .collect();
    let (updates_tx, mut updates) = mpsc::channel::<(u32, Update)>(64);
    let mut ingests = Vec::new();
    if let Some(endpoint) = &config.events {
        for rank in 0..config.dp_size {
            let endpoint = endpoint.for_rank(rank)?;
            let (tx, mut rx) = mpsc::channel(16);
            ingests.push(tokio::spawn(ingest::run(
                endpoint,
                config.block_size,
                config.offload_chunk,
                config.limits,
                tx,
            )));
            let out = updates_tx.clone();
            ingests.push(tokio::spawn(async move {
                while let Some(u) = rx.recv().await {
                    if out.send((rank, u)).await.is_err() {
                        return;
                    }
                }
            }));
        }
    }
    drop(updates_tx);
    // Per rank: the event stream's counters (their faults go into the heartbeat).
    let mut ranks = vec![IngestStats::default(); config.dp_size as usize];
    let mut registration: Option<Registration> = None;
    let mut failures = 0u32;
    // Consecutive healthy checks, and whether the engine was withdrawn once: a withdrawn
    // engine comes back after `health_failures` healthy checks in a row, not the first (an
    // engine whose API stalls now and then would otherwise bounce, and each bounce is a new
    // epoch every router resyncs from a snapshot).
    let (mut successes, mut withdrawn) = (0u32, false);
    // Adapter names left out of the registration, as last warned about.
    let mut refused_adapters: Vec<String> = Vec::new();
    // One per rank, sized to the engine's G1 when first needed.
    let mut approx: Vec<Option<ApproxCache>> = (0..config.dp_size).map(|_| None).collect();
    let clock = tokio::time::Instant::now();
    let mut expiry = tokio::time::interval(Duration::from_secs(1));
    let mut approx_changes = Vec::new();
    let mut probes = probe_engine(
        client,
        config.engine_url.clone(),
        config.model.clone(),
        config.health_every,
    );
    let mut registering: Option<
        tokio::task::JoinHandle<Result<Registration, kvroute::discovery::DiscoveryError>>,
    > = None;
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            Some((rank, update)) = updates.recv() => {
                let mut changes = update.changes;
                telemetry.ingest(rank, &update.stats);
                publish_changes(&mut streams[rank as usize], rank, &mut changes, &plane, registration.is_some(), &mut telemetry).await;
                let named = update.stats.engine_rank;
                if named.is_some_and(|n| n != rank) && ranks[rank as usize].engine_rank != named {
                    // Engines offset the port by the rank they stamp on their batches; a node
                    // of a multi-node deployment numbers its ranks globally, which is right
                    // when the base port given here was offset to its first rank, and a wrong
                    // base port otherwise.
                    tracing::info!(worker = %config.id, rank, engine_rank = ?named,
                        "the engine's events at this rank's port name another data-parallel rank: right for a node of a multi-node deployment whose --kv-events port was offset to its first rank; otherwise check --kv-events and --dp-size");
                }
                ranks[rank as usize] = update.stats;
                let faults = event_faults(&ranks);
                let mut i = info.lock();
                if faults != i.event_faults.unwrap_or_default() {
                    if faults.wrong_block_size.is_some() && i.event_faults.is_none_or(|f| f.wrong_block_size.is_none()) {
                        tracing::error!(worker = %config.id, engine_block_size = ?faults.wrong_block_size, configured = config.block_size.get(),
                            "the engine's events use another block size than configured: its blocks are not indexed");
                    }
                    i.event_faults = Some(faults);
                }
            }
            Some(routed) = next_learned(&mut learned) => {
                let now_ms = clock.elapsed().as_millis() as u64;
                let rank = (routed.key.1.0 as usize).min(streams.len() - 1);
                // The engine's G1 as last scraped: before the first scrape it is a default,
                // and an engine's can change across restarts.
                let capacity = info.lock().g1_blocks;
                let cache = approx[rank]
                    .get_or_insert_with(|| ApproxCache::new(APPROX_TTL_MS, capacity));
                cache.set_capacity(capacity);
                cache.learn(now_ms, &routed.blocks, &mut approx_changes);
                publish_changes(&mut streams[rank], rank as u32, &mut approx_changes, &plane, registration.is_some(), &mut telemetry).await;
            }
            _ = expiry.tick(), if learned.is_some() => {
                let now_ms = clock.elapsed().as_millis() as u64;
                for (rank, cache) in approx.iter_mut().enumerate() {
                    if let Some(cache) = cache {
                        cache.expire(now_ms, &mut approx_changes);
                        if !approx_changes.is_empty() {
                            publish_changes(&mut streams[rank], rank as u32, &mut approx_changes, &plane, registration.is_some(), &mut telemetry).await;
                        }
                    }
                }
            }
            Some(request) = snapshots.recv() => {
                if let Some(s) = streams.get(request.dp_rank.0 as usize) {
                    let _ = request.reply.send(s.publisher.snapshot(s.announced.blocks()));
                }
            }
            Some(probe) = probes.recv() => {
                let healthy = probe.healthy;
                telemetry.health(healthy);
                // Every check, so that a router that dropped the series (a withdrawn worker's,
                // in direct mode, swept before it saw the worker back) has them again.
                telemetry.registered(registration.is_some());
                if registration.is_some() {
                    telemetry.rewrite();
                }
                failures = if healthy { 0 } else { failures + 1 };
                successes = if healthy { successes.saturating_add(1) } else { 0 };
                if healthy {
                    // The engine's load for the next heartbeat: the routers weigh its KV
                    // usage beside their own bookings.
                    let scraped = probe.scraped;
                    let mut i = info.lock();
                    i.engine_load = scraped.load;
                    // One figure per registered rank, or none (an engine showing other ranks
                    // than it registers: the mean stands for all of them).
                    i.engine_rank_kv_usage = if scraped.rank_kv_usage_permille.len() == i.dp_size as usize {
                        scraped.rank_kv_usage_permille
                    } else {
                        Vec::new()
                    };
                    // Every scrape that has it: one that failed when the engine registered
                    // left the default, and routers take a changed size from a heartbeat.
                    // vLLM names its blocks; SGLang its pool's tokens, in pages of the
                    // block size.
                    let blocks = scraped.g1_blocks.or_else(|| {
                        scraped
                            .kv_capacity_tokens
                            .map(|t| (t / config.block_size.get() as u64) as usize)
                            .filter(|b| *b > 0)
                    });
                    if let Some(blocks) = blocks {
                        i.g1_blocks = blocks;
                    }
                    if let Some(model) = probe.model
                        && i.model.is_empty()
                    {
                        i.model = model;
                    }
                }
                // LoRA adapters come and go (vLLM's /v1/load_lora_adapter): the next
                // heartbeat carries the current list.
                if let Some(Adapters { served, refused }) = probe.adapters {
                    if refused != refused_adapters {
                        if !refused.is_empty() {
                            tracing::warn!(worker = %config.id, ?refused, "LoRA adapters not announced: routers refuse names with spaces or control characters, over 256 bytes, or past the 256th");
                        }
                        refused_adapters = refused;
                    }
                    let mut i = info.lock();
                    if i.adapters != served {
                        tracing::info!(worker = %config.id, adapters = ?served, "engine's LoRA adapters");
                        i.adapters = served;
                    }
                }
                match (&registration, healthy) {
                    (None, true) if withdrawn && successes < config.health_failures => {}
                    (None, true) if registering.is_none() => {
                        if info.lock().model.is_empty() {
                            continue; // not known yet: its /v1/models did not answer
                        }
                        if let Err(e) = info.lock().validate() {
                            tracing::warn!(worker = %config.id, error = %e, "cannot register the engine");
                            continue;
                        }
                        // Registering retries while the registry has no quorum: in a task of
                        // its own, so events, snapshots and SIGTERM are served meanwhile.
                        let (registry, info, lease) = (registry.clone(), Arc::clone(&info), config.lease.clone());
                        registering = Some(tokio::spawn(async move {
                            Registration::start(registry, info, &lease).await
                        }));
                    }
                    (Some(_), false) if failures >= config.health_failures => {
                        tracing::warn!(worker = %config.id, url = %config.engine_url, "engine unhealthy: registration withdrawn");
                        withdrawn = true;
                        telemetry.registered(false);
                        if let Some(r) = registration.take() {
                            r.goodbye().await;
                        }
                        // Back as a new incarnation, with what the engine held then.
                        let epoch = new_epoch();
                        for s in &mut streams {
                            let carry = s.announced.blocks().next().is_some();
                            s.publisher = s.publisher.renumbered(epoch, carry);
                        }
                        let mut i = info.lock();
                        i.epoch = epoch;
                        i.last_event_ids =
                            streams.iter().map(|s| s.publisher.last_event_id()).collect();
                    }
                    _ => {}
                }
            }
            started = async { registering.as_mut().expect("guarded by the branch's condition").await }, if registering.is_some() => {
                registering = None;
                match started {
                    Ok(Ok(r)) => {
                        let model = info.lock().model.clone();
                        tracing::info!(worker = %config.id, url = %config.engine_url, %model, "engine healthy: registered");
                        registration = Some(r);
                        telemetry.registered(true);
                        telemetry.rewrite();
                    }
                    Ok(Err(e)) => tracing::warn!(worker = %config.id, error = %e, "cannot register the engine"),
                    Err(e) => tracing::warn!(worker = %config.id, error = %e, "registering the engine failed"),
                }
            }
        }
    }
    if let Some(r) = registering.take() {
        // SIGTERM while registering: an entry it may have written lapses with its lease.
        r.abort();
    }
    telemetry.registered(false);
    if let Some(r) = registration.take() {
        r.goodbye().await;
    }
    snapshot_task.abort();
    for t in ingests {
        t.abort();
    }
    Ok(())
}

/// What one check of the engine found ([`probe_engine`]).
struct Probe {
    /// `/health` answered 2xx in time.
    healthy: bool,
    /// Its `/metrics`, read (empty unless healthy and they answered).
    scraped: metrics::Scraped,
    /// The model it serves, once known: as configured, else the first of its `/v1/models`.
    model: Option<String>,
    /// Its LoRA adapters, when the model is known and `/v1/models` answered.
    adapters: Option<Adapters>,
}

/// Checks the engine every `every` (`/health`; if healthy, `/metrics` and `/v1/models`, each
/// within `every`) and sends what it found. In a task of its own: a slow engine holds no
/// part of the bridge's loop, which forwards the engine's events, answers the routers'
/// snapshot requests and hears SIGTERM. Ends when the receiver is dropped.
fn probe_engine(
    client: EngineClient,
    base: String,
    mut model: String,
    every: Duration,
) -> mpsc::Receiver<Probe> {
    let (tx, rx) = mpsc::channel(1);
    tokio::spawn(async move {
        // Why `/v1/models` could not be read last, said once while it stays so.
        let mut models_error: Option<String> = None;
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = tx.closed() => return,
            }
            let healthy = get(&client, &base, "/health", every).await.is_ok();
            let mut probe = Probe {
                healthy,
                scraped: metrics::Scraped::default(),
                model: None,
                adapters: None,
            };
            if healthy {
                let text = get(&client, &base, "/metrics", every).await;
                probe.scraped = text
                    .map(|t| metrics::scrape(&String::from_utf8_lossy(&t)))
                    .unwrap_or_default();
                // One read of `/v1/models` names the model (if not configured) and its adapters.
                let read = async {
                    let v = models(&client, &base, every).await?;
                    if model.is_empty() {
                        model = served_model(&v)?;
                    }
                    probe.adapters = Some(served_adapters(&v, &model)?);
                    anyhow::Ok(())
                }
                .await;
                match read {
                    Ok(()) => {
                        if models_error.take().is_some() {
                            tracing::info!(engine = %base, "the engine's /v1/models reads again");
                        }
                    }
                    Err(e) => {
                        let e = e.to_string();
                        if models_error.as_ref() != Some(&e) {
                            tracing::warn!(engine = %base, error = %e, known_model = !model.is_empty(), "cannot read the engine's /v1/models: an engine whose model is not known is not registered (set --model), and its LoRA adapters are not announced (an engine started with --api-key needs --engine-api-key)");
                            models_error = Some(e);
                        }
                    }
                }
                if !model.is_empty() {
                    probe.model = Some(model.clone());
                }
            }
            if tx.send(probe).await.is_err() {
                return;
            }
        }
    });
    rx
}

/// The faults of every rank's stream, summed.
fn event_faults(ranks: &[IngestStats]) -> metrics::EventFaults {
    let mut f = metrics::EventFaults::default();
    for r in ranks {
        f.wrong_block_size = f.wrong_block_size.or(r.wrong_block_size);
        f.block_size_mismatch += r.mirror.block_size_mismatch;
        f.decode_errors += r.decode_errors;
        f.unrepaired_gaps += r.unrepaired;
        f.restarts += r.restarts;
        f.unnamed_lora_blocks += r.mirror.unnamed_lora;
        f.unknown_events += r.mirror.unknown_events;
        f.malformed_events += r.mirror.malformed_events;
        f.capped_blocks += r.mirror.capped;
    }
    f
}

/// How long a block routed to an engine without events is taken as cached: engines keep
/// prefixes for minutes when not under pressure; Dynamo's approximate indexer assumes 120 s.
const APPROX_TTL_MS: u64 = 120_000;

/// The prompts routers send the engine of worker `id` (`dp_size` ranks), as they report them
/// on its routed subject ([`kvroute::events::routed`]): the `learned` input of [`run`] for a
/// sidecar of an engine without KV events. A message that does not read is counted and
/// dropped; one that does not fit the queue is dropped (the cache it feeds is a guess).
pub async fn learn_from_routes(
    transport: &Transport,
    cluster: &str,
    id: WorkerId,
    dp_size: u32,
) -> anyhow::Result<mpsc::Receiver<RoutedPrompt>> {
    use kvroute::events::routed;
    let mut subscription = transport
        .subscribe(&routed::routed_subject(cluster, id))
        .await?;
    let (tx, rx) = mpsc::channel(LEARNED_QUEUE);
    let dropped = |reason: &'static str| {
        ::metrics::counter!("kvroute_worker_routed_reports_dropped_total", "reason" => reason)
            .increment(1);
    };
    tokio::spawn(async move {
        loop {
            // Ends with the bridge (the receiver gone) or with the subscription.
            let message = tokio::select! {
                () = tx.closed() => return,
                m = subscription.next() => m,
            };
            let Some(message) = message else {
                tracing::warn!(worker = %id, "the routed-prompt subscription ended: the engine's guessed cache is no longer fed");
                return;
            };
            match routed::decode(&message.payload, dp_size) {
                Ok(prompt) => {
                    let prompt = RoutedPrompt {
                        key: (id, DpRank(prompt.rank)),
                        blocks: prompt.block_hashes(),
                    };
                    if tx.try_send(prompt).is_err() {
                        dropped("queue_full");
                    }
                }
                Err(e) => {
                    dropped("unreadable");
                    tracing::debug!(worker = %id, error = %e, "a routed-prompt report refused");
                }
            }
        }
    });
    Ok(rx)
}

/// Routed prompts waiting for the bridge (each up to a prompt's blocks, 16 B a block).
const LEARNED_QUEUE: usize = 64;

async fn next_learned(learned: &mut Option<mpsc::Receiver<RoutedPrompt>>) -> Option<RoutedPrompt> {
    match learned {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// Changes the scratch of a [`RankStream`] keeps room for between batches.
const FRESH_KEPT: usize = 1 << 16;

/// One dp rank's event stream: what the engine has announced (its stream repeats stores
/// and removes what it never stored) and the publisher of the changes to that set.
struct RankStream {
    publisher: Publisher,
    announced: Announced,
    /// Scratch: the changes that alter `announced`.
    fresh: Vec<kvroute::protocol::BlockChange>,
}

impl RankStream {
    fn new(publisher: Publisher) -> Self {
        RankStream {
            publisher,
            announced: Announced::default(),
            fresh: Vec::new(),
        }
    }

    /// Records the engine's `changes`; those that alter the announced set become events.
    fn record(&mut self, changes: &[kvroute::protocol::BlockChange]) {
        let capped = self.announced.capped();
        self.announced.filter(changes, &mut self.fresh);
        if capped == 0 && self.announced.capped() > 0 {
            tracing::warn!(
                max = kvroute::protocol::MAX_SNAPSHOT_BLOCKS,
                "the engine holds more (tier, block) pairs than one snapshot carries: blocks it stores from now on are not announced until it removes some"
            );
        }
        self.publisher.record(&self.fresh);
        self.fresh.clear();
        // A restarted engine's clear is one removal per block: the scratch gives that room
        // back rather than keeping it for good.
        if self.fresh.capacity() > FRESH_KEPT {
            self.fresh = Vec::new();
        }
    }
}

/// Records `changes` (emptied) in `stream` and publishes the batch. Unregistered, nobody
/// follows the stream: the batch only advances the ids, and the next incarnation's snapshot
/// carries it. A failed publish shows the router a gap, and it asks for a snapshot.
async fn publish_changes(
    stream: &mut RankStream,
    rank: u32,
    changes: &mut Vec<kvroute::protocol::BlockChange>,
    plane: &WorkerPlane,
    registered: bool,
    telemetry: &mut telemetry::Telemetry,
) {
    stream.record(changes);
    changes.clear();
    // Before the batch leaves: whoever sees it in a router finds the gauge there already.
    telemetry.resident(rank, &stream.announced);
    if let Some(batch) = stream.publisher.flush(unix_us()) {
        if registered {
            if let Err(e) = plane.publish(&batch).await {
                telemetry.publish_failed();
                tracing::warn!(worker = %telemetry.worker(), error = %e, "publishing failed; the router will resync");
                // Announced in the heartbeat all the same: the router sees the gap.
                plane.note_sent(&batch);
            }
        } else {
            plane.note_sent(&batch);
        }
    }
}

fn unix_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// Largest body read from `/health` or `/metrics`.
const MAX_BODY: usize = 4 << 20;

/// GETs `path` of `base`, 2xx or an error, within `deadline` (body included).
async fn get(
    client: &EngineClient,
    base: &str,
    path: &str,
    deadline: Duration,
) -> anyhow::Result<Bytes> {
    let uri: hyper::Uri = format!("{}{path}", base.trim_end_matches('/')).parse()?;
    let mut request = hyper::Request::get(uri);
    if let Some(key) = &client.api_key {
        request = request.header(
            hyper::header::AUTHORIZATION,
            format!("Bearer {}", key.expose()),
        );
    }
    let request = request.body(Empty::new())?;
    let response = tokio::time::timeout(deadline, client.http.request(request))
        .await
        .map_err(|_| anyhow::anyhow!("{path}: no answer within {deadline:?}"))??;
    let status = response.status();
    let body = kvroute::http::collect_body(response.into_body(), MAX_BODY, deadline).await?;
    anyhow::ensure!(status.is_success(), "{path}: {status}");
    Ok(body)
}

/// The first model of the engine's `/v1/models`.
fn served_model(v: &serde_json::Value) -> anyhow::Result<String> {
    v["data"][0]["id"]
        .as_str()
        .map(str::to_owned)
        .context("/v1/models lists no model")
}

/// The engine's `/v1/models`, as JSON.
async fn models(
    client: &EngineClient,
    base: &str,
    deadline: Duration,
) -> anyhow::Result<serde_json::Value> {
    let body = get(client, base, "/v1/models", deadline).await?;
    serde_json::from_slice(&body).context("/v1/models is not JSON")
}

/// The LoRA adapters the engine serves on top of `model`: the `/v1/models` entries whose
/// `parent` is the base model (vLLM lists each loaded adapter so).
fn served_adapters(v: &serde_json::Value, model: &str) -> anyhow::Result<Adapters> {
    let names = v["data"]
        .as_array()
        .context("/v1/models has no data list")?
        .iter()
        .filter(|m| m["parent"].as_str() == Some(model))
        .filter_map(|m| m["id"].as_str());
    Ok(Adapters::of(model, names))
}

/// The adapter names a registration can carry, and those it cannot.
#[derive(Debug, Default, PartialEq, Eq)]
struct Adapters {
    /// Sorted, distinct, at most `discovery::MAX_ADAPTERS`.
    served: Vec<String>,
    /// Names routers would refuse (a space, a control character, too long): one such name
    /// in a registration would make every router ignore it and drop the engine.
    refused: Vec<String>,
}

impl Adapters {
    fn of<'a>(model: &str, names: impl Iterator<Item = &'a str>) -> Adapters {
        let (mut served, mut refused): (Vec<String>, Vec<String>) = names
            .filter(|id| *id != model)
            .map(str::to_owned)
            .partition(|id| kvroute::discovery::model_name_ok(id));
        served.sort();
        served.dedup();
        // At most MAX_ADAPTERS names, in half of a registration's bytes.
        let mut bytes = 0;
        let fit = served
            .iter()
            .take(kvroute::discovery::MAX_ADAPTERS)
            .take_while(|name| {
                bytes += name.len() + 3; // quotes and a comma
                bytes <= kvroute::discovery::MAX_INFO_BYTES / 2
            })
            .count();
        refused.extend(served.split_off(fit));
        refused.sort();
        refused.dedup();
        Adapters { served, refused }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Names a router would refuse are left out of the registration (one would make every
    /// router ignore it, and the engine would drop out of the fleet), as are names past the
    /// count and size a registration may carry.
    #[test]
    fn only_adapter_names_routers_accept_are_announced() {
        let names = [
            "base",
            "sql-lora",
            "my lora",
            "tab\tlora",
            "sql-lora",
            "b-lora",
        ];
        let long = "x".repeat(257);
        let a = Adapters::of("base", names.into_iter().chain([long.as_str()]));
        assert_eq!(a.served, ["b-lora", "sql-lora"]);
        assert_eq!(a.refused, ["my lora", "tab\tlora", long.as_str()]);
        let many: Vec<String> = (0..300).map(|i| format!("lora-{i:03}")).collect();
        let a = Adapters::of("base", many.iter().map(String::as_str));
        assert_eq!(a.served.len(), kvroute::discovery::MAX_ADAPTERS);
        assert_eq!(a.refused.len(), 300 - kvroute::discovery::MAX_ADAPTERS);
        let big: Vec<String> = (0..250)
            .map(|i| format!("{i:03}{}", "y".repeat(250)))
            .collect();
        let a = Adapters::of("base", big.iter().map(String::as_str));
        let bytes: usize = a.served.iter().map(|n| n.len() + 3).sum();
        assert!(bytes <= kvroute::discovery::MAX_INFO_BYTES / 2 && !a.refused.is_empty());
    }
}
