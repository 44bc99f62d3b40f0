//! The worker process (I/O): the engine on wall time in one task, an HTTP/1.1 server
//! (hyper) whose internal generate endpoint takes token ids and streams OpenAI-shaped SSE
//! chunks as the engine produces tokens, and the event plane (publishing, snapshots,
//! registration).

mod http;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvroute::discovery::{LeaseConfig, Registration, Registry, WorkerInfo};
use kvroute::events::transport::Transport;
use kvroute::protocol::{DpRank, WorkerId};
use parking_lot::Mutex;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::EngineConfig;
use crate::engine::{Engine, Output, OutputKind, Request, RequestId};
use crate::plane::{SnapshotRequest, WorkerPlane};

/// The epoch of an incarnation starting now: start time in ms in the high bits, so later
/// incarnations compare larger (`EventBatch` docs), and 16 low bits against ties.
pub fn new_epoch() -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    ((now.as_millis() as u64) << 16) | u64::from(now.subsec_nanos() & 0xffff)
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
    pub metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
    /// Tokenizes text prompts of the OpenAI endpoints.
    pub tokenizer: Arc<kvroute::ingress::tokenizer::Tokenizer>,
}

/// A job for the engine task.
pub(crate) struct Job {
    pub request: Request,
    /// Outputs of the request; dropping the receiver cancels it.
    pub outputs: mpsc::Sender<Output>,
}

/// A running worker.
pub struct Worker {
    /// Where its HTTP server listens.
    pub addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    registration: Option<Registration>,
}

impl Worker {
    /// Starts the engine task, the event plane and the HTTP server.
    pub async fn start(
        config: ServerConfig,
        transport: Transport,
        registry: Registry,
    ) -> anyhow::Result<Worker> {
        let engine = Engine::new(config.engine.clone(), config.id, DpRank(0), config.epoch)?;
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
        }));
        let plane = WorkerPlane::new(transport.clone(), &config.cluster, Arc::clone(&info));
        let (snapshots_tx, snapshots) = mpsc::channel(16);
        WorkerPlane::serve_snapshots(transport, &config.cluster, config.id, snapshots_tx).await?;
        let (jobs_tx, jobs) = mpsc::channel(4096);
        let (shutdown, shutdown_rx) = watch::channel(false);
        tokio::spawn(run_engine(
            engine,
            plane,
            jobs,
            snapshots,
            shutdown_rx.clone(),
        ));
        tokio::spawn(http::serve(
            listener,
            http::State {
                jobs: jobs_tx,
                metrics: config.metrics.clone(),
                tokenizer: Arc::clone(&config.tokenizer),
                model: config.model.clone(),
                next_id: Arc::default(),
            },
            shutdown_rx,
        ));
        let registration = Registration::start(registry, info, &config.lease).await?;
        Ok(Worker {
            addr,
            shutdown,
            registration: Some(registration),
        })
    }

    /// Stops serving and deregisters.
    pub async fn stop(mut self) {
        let _ = self.shutdown.send(true);
        if let Some(r) = self.registration.take() {
            r.goodbye().await;
        }
    }
}

/// The engine on wall time: submits jobs as they come, advances at each wake-up, routes
/// outputs to their requests, publishes KV events, answers snapshots.
async fn run_engine(
    mut engine: Engine,
    plane: WorkerPlane,
    mut jobs: mpsc::Receiver<Job>,
    mut snapshots: mpsc::Receiver<SnapshotRequest>,
    mut shutdown: watch::Receiver<bool>,
) {
    let start = Instant::now();
    // The engine's clock: wall time, except that a step due within the timer's resolution
    // (1 ms) is run at once and the clock jumps to its end, so a fast engine (high speedup)
    // is not held to one step per timer tick. It never runs more than 1 ms ahead.
    let mut clock = 0u64;
    let mut waiting: HashMap<RequestId, mpsc::Sender<Output>> = HashMap::new();
    let mut out = Vec::new();
    let mut batches = Vec::new();
    loop {
        let wall = start.elapsed().as_micros() as u64;
        clock = clock.max(wall);
        if let Some(due) = engine.next_wakeup_us().filter(|t| *t <= wall + 1_000) {
            clock = clock.max(due);
        }
        let now_us = || clock.max(start.elapsed().as_micros() as u64);
        let wake = engine
            .next_wakeup_us()
            .filter(|t| *t > clock)
            .map(|t| start + Duration::from_micros(t));
        let due_now = engine.next_wakeup_us().is_some_and(|t| t <= clock);
        tokio::select! {
            biased;
            _ = tokio::task::yield_now(), if due_now => {}
            job = jobs.recv() => {
                let Some(job) = job else { return };
                let id = job.request.id;
                waiting.insert(id, job.outputs);
                engine.submit(now_us(), job.request, &mut out);
            }
            r = snapshots.recv() => {
                if let Some(r) = r {
                    let _ = r.reply.send(engine.snapshot());
                }
            }
            _ = async { tokio::time::sleep_until(wake.unwrap_or_else(Instant::now)).await }, if wake.is_some() => {}
            _ = shutdown.changed() => return,
        }
        clock = now_us();
        if let Err(e) = engine.advance(clock, &mut out) {
            tracing::error!(error = %e, "engine failed");
            return;
        }
        let load = engine.load();
        metrics::gauge!("kvroute_worker_requests_waiting").set(load.waiting as f64);
        metrics::gauge!("kvroute_worker_requests_running").set(load.running as f64);
        metrics::gauge!("kvroute_worker_g1_blocks_used").set(load.g1_used as f64);
        for o in out.drain(..) {
            if matches!(o.kind, OutputKind::Token { .. }) {
                metrics::counter!("kvroute_worker_tokens_total").increment(1);
            }
            let done = matches!(o.kind, OutputKind::Finished | OutputKind::Rejected(_));
            let cancelled = match waiting.get(&o.request) {
                Some(tx) => tx.try_send(o).is_err() && tx.is_closed(),
                None => false,
            };
            if done || cancelled {
                waiting.remove(&o.request);
            }
            if cancelled && !done {
                engine.cancel(o.request);
            }
        }
        // Clients that went away between outputs: free their blocks now.
        let gone: Vec<RequestId> = waiting
            .iter()
            .filter(|(_, tx)| tx.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            waiting.remove(&id);
            engine.cancel(id);
        }
        engine.drain_batches(&mut batches);
        let sent = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        for mut batch in batches.drain(..) {
            // The engine's clock is process-relative; the router measures lag in Unix time.
            batch.sent_unix_us = sent;
            if let Err(e) = plane.publish(&batch).await {
                tracing::warn!(error = %e, "publishing KV events failed; the router will resync");
                plane.note_sent(&batch);
            }
        }
    }
}

#[cfg(test)]
mod tests;
