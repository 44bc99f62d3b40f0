//! `kvroute up`: a router and its workers in one process on the in-process event plane — the
//! demo that needs neither NATS nor a GPU.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use kvroute::discovery::{LeaseConfig, LocalRegistry, Registry};
use kvroute::events::transport::{LocalBus, Transport};
use kvroute::protocol::WorkerId;
use kvroute_worker::EngineConfig;
use kvroute_worker::server::{ServerConfig, Worker};
use tokio::sync::watch;

use crate::serve::{Listeners, load_tokenizer, serve_until_signal, start_router};
use kvroute_cli::settings::{self, ServeFlags};

/// Flags of `kvroute up`.
#[derive(clap::Args, Debug)]
pub struct UpArgs {
    /// Router HTTP port.
    #[arg(long, env = "KVROUTE_PORT", default_value_t = 8080)]
    pub port: u16,
    /// Address the router listens on (workers listen on 127.0.0.1, any free port).
    #[arg(long, env = "KVROUTE_HOST", default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port of the admin views (/admin/workers, /admin/explain) on 127.0.0.1 (0: any free
    /// port).
    #[arg(long, env = "KVROUTE_ADMIN_PORT", default_value_t = 8081)]
    pub admin_port: u16,
    /// Workers to run in this process (1–64).
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Routing policy: kv, round_robin, round_robin_skip_busy, random, least_loaded, approx_prefix.
    #[arg(long, default_value = "kv")]
    pub policy: String,
    /// Model name the workers serve.
    #[arg(long, default_value = "kvroute-sim")]
    pub model: String,
    /// Divides the workers' step times (timing model).
    #[arg(long, default_value_t = EngineConfig::default().speedup)]
    pub speedup: f64,
    /// G1 blocks per worker.
    #[arg(long, default_value_t = EngineConfig::default().g1_blocks)]
    pub g1_blocks: usize,
    /// G2 blocks per worker; 0 disables offload.
    #[arg(long, default_value_t = EngineConfig::default().g2_blocks)]
    pub g2_blocks: usize,
    /// Hugging Face `tokenizer.json` for router and workers [default: one token per byte].
    #[arg(long, env = "KVROUTE_TOKENIZER")]
    pub tokenizer: Option<PathBuf>,
    /// The workers take `POST /admin/faults` (tests).
    #[arg(long, hide = true)]
    pub fault_injection: bool,
}

/// Runs the embedded fleet until SIGINT or SIGTERM.
pub fn run_up(args: UpArgs) -> anyhow::Result<()> {
    if !(1..=64).contains(&args.workers) {
        bail!("--workers {}: between 1 and 64", args.workers);
    }
    let engine = EngineConfig {
        speedup: args.speedup,
        g1_blocks: args.g1_blocks,
        g2_blocks: args.g2_blocks,
        ..EngineConfig::default()
    };
    engine.validate().context("worker engine")?;
    let settings = settings::resolve(
        ServeFlags {
            port: Some(args.port),
            host: Some(args.host),
            policy: Some(args.policy.clone()),
            cluster: Some("up".into()),
            drain_timeout_ms: Some(5_000),
            admin_port: Some(args.admin_port),
            // A demo on loopback: show where each request went and what it reused.
            route_headers: Some(true),
            ..ServeFlags::default()
        },
        ServeFlags::default(),
    )?;
    kvroute::process::init_logging(settings.log_format);
    kvroute::process::raise_open_files_limit(settings.ingress.http.max_connections);
    // SIGTERM is heard before the tokenizers load (as `serve` does).
    let runtime = tokio::runtime::Runtime::new()?;
    let signals = runtime.block_on(async { kvroute::process::signals() });
    let tokenizer = load_tokenizer(args.tokenizer.as_deref(), None)?;
    let worker_tokenizer = Arc::new(load_tokenizer(args.tokenizer.as_deref(), None)?);
    runtime.block_on(async move {
        let metrics = kvroute::process::install_metrics();
        let bus = Transport::Local(LocalBus::new());
        let registry = Registry::Local(LocalRegistry::default());
        let mut workers = Vec::with_capacity(args.workers);
        for i in 0..args.workers {
            let config = ServerConfig {
                id: WorkerId(i as u64 + 1),
                listen: SocketAddr::from(([127, 0, 0, 1], 0)),
                url: None,
                cluster: settings.cluster.clone(),
                model: args.model.clone(),
                engine: engine.clone(),
                lease: LeaseConfig::default(),
                epoch: kvroute_worker::server::new_epoch(),
                metrics: None,
                tokenizer: Arc::clone(&worker_tokenizer),
                http: settings.ingress.http.clone(),
                fault_injection: args.fault_injection,
                api_key: None,
                emulate: None,
            };
            workers.push(Worker::start(config, bus.clone(), registry.clone()).await?);
        }
        // A worker whose engine fails leaves the fleet (as `kvroute-worker` does), and the
        // others go on serving: registered, it kept heartbeating and every request sent to
        // it failed.
        let (stop_workers, stopping) = watch::channel(false);
        let workers: Vec<_> = workers
            .into_iter()
            .enumerate()
            .map(|(i, worker)| tokio::spawn(follow_worker(i + 1, worker, stopping.clone())))
            .collect();
        let (stop, stop_rx) = watch::channel(false);
        let router =
            start_router(&settings, bus, registry, false, metrics, tokenizer, stop_rx).await?;
        let listeners = Listeners::bind(&settings).await?;
        // Ready when the router follows every worker's event stream.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let live = || {
            let streams = router.plane.streams();
            streams.iter().filter(|(_, s)| s.live).count().min(args.workers)
        };
        while tokio::time::Instant::now() < deadline
            && (router.plane.workers().len() < args.workers || live() < args.workers)
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let followed = live();
        if followed < args.workers {
            // Requests route over the workers that are followed; the others join when
            // their streams go live.
            println!(
                "kvroute up: only {followed} of {} workers' event streams are live after 10 s",
                args.workers
            );
        }
        let shown = listeners.api_addr;
        let admin = listeners.admin_addr;
        println!(
            "kvroute up: router on http://{shown} with {} in-process workers (no NATS); Ctrl-C stops",
            args.workers
        );
        println!(
            "try:\n  curl -sN http://{shown}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"model\":\"{}\",\"messages\":[{{\"role\":\"user\",\"content\":\"Hello there\"}}],\"max_tokens\":16,\"stream\":true}}'",
            args.model
        );
        println!("  curl -s http://{admin}/admin/workers");
        let outcome = serve_until_signal(
            router,
            listeners,
            Duration::from_millis(settings.drain_timeout_ms),
            &signals,
        )
        .await;
        let _ = stop_workers.send(true);
        for worker in workers {
            let _ = worker.await;
        }
        let _ = stop.send(true);
        outcome
    })
}

/// Runs in-process worker `n` until `stopping`: if its engine fails first, it leaves the
/// fleet and says why.
async fn follow_worker(n: usize, mut worker: Worker, mut stopping: watch::Receiver<bool>) {
    let mut failed = worker.failed();
    let failure = tokio::select! {
        _ = stopping.wait_for(|stop| *stop) => None,
        reason = failed.wait_for(Option::is_some) => Some(
            reason
                .ok()
                .and_then(|r| r.clone())
                .unwrap_or_else(|| "its engine ended".into()),
        ),
    };
    if let Some(reason) = failure {
        worker.leave().await;
        tracing::error!(worker = n, %reason, "an in-process worker's engine failed: it left the fleet; the others serve on");
        let _ = stopping.wait_for(|stop| *stop).await;
    }
    worker.stop().await;
}
