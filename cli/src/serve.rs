//! `kvroute serve` and the router assembly it shares with `kvroute up`.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use kvroute::discovery::{LeaseConfig, Registry};
use kvroute::events::load::{LoadShare, LoadShareConfig};
use kvroute::events::plane::{EventPlane, PlaneConfig};
use kvroute::events::transport::Transport;
use kvroute::indexer::{self, Indexer};
use kvroute::ingress::tokenizer::Tokenizer;
use kvroute::ingress::{Router, serve};
use kvroute::scheduler::Scheduler;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::sync::watch;

use crate::settings::{self, ServeArgs, ServeFlags, Settings};

/// Runs `kvroute serve` to completion (SIGINT or SIGTERM, then a drain).
pub fn run_serve(args: ServeArgs) -> anyhow::Result<()> {
    let file = match &args.config {
        Some(path) => settings::read_file(path)?,
        None => ServeFlags::default(),
    };
    let settings = settings::resolve(args.flags, file)?;
    if args.dry_run {
        println!("{}", serde_json::to_string_pretty(&settings)?);
        return Ok(());
    }
    crate::init_logging();
    let tokenizer = load_tokenizer(settings.tokenizer.as_deref())?;
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async move {
        let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
            .install_recorder()
            .ok();
        let transport = Transport::connect_nats(&settings.nats, "kvroute-router").await?;
        let client = transport.nats_client().context("NATS transport")?.clone();
        let lease = LeaseConfig {
            ttl_ms: settings.lease_ttl_ms,
            ..LeaseConfig::default()
        };
        let registry = Registry::nats(client, &settings.cluster, &lease).await?;
        let (stop, stop_rx) = watch::channel(false);
        let router = start_router(
            &settings, transport, registry, true, metrics, tokenizer, stop_rx,
        )
        .await?;
        let listener = tokio::net::TcpListener::bind((settings.host, settings.port))
            .await
            .with_context(|| format!("listening on {}:{}", settings.host, settings.port))?;
        let addr = listener.local_addr()?;
        println!("kvroute serving on http://{addr}");
        tracing::info!(%addr, nats = %settings.nats, cluster = %settings.cluster, "router serving");
        serve_until_signal(
            router,
            listener,
            Duration::from_millis(settings.drain_timeout_ms),
        )
        .await;
        let _ = stop.send(true);
        Ok(())
    })
}

/// The tokenizer file, or bytes.
pub fn load_tokenizer(path: Option<&std::path::Path>) -> anyhow::Result<Tokenizer> {
    Ok(match path {
        Some(path) => Tokenizer::load(path)?,
        None => Tokenizer::Bytes,
    })
}

/// Indexer, event plane, scheduler and (with `share_load`) replica load sharing, assembled
/// into a router over `transport` and `registry`; they run until `stop` turns true.
pub async fn start_router(
    settings: &Settings,
    transport: Transport,
    registry: Registry,
    share_load: bool,
    metrics: Option<PrometheusHandle>,
    tokenizer: Tokenizer,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<Arc<Router>> {
    let lease = LeaseConfig {
        ttl_ms: settings.lease_ttl_ms,
        ..LeaseConfig::default()
    };
    let indexer = Arc::new(Indexer::new(indexer::Config::default())?);
    let plane_config = PlaneConfig {
        cluster: settings.cluster.clone(),
        ..PlaneConfig::default()
    };
    let plane = EventPlane::start(
        transport.clone(),
        indexer,
        registry.watch(lease),
        plane_config,
        stop.clone(),
    )
    .await?;
    let scheduler = Arc::new(parking_lot::Mutex::new(Scheduler::new(
        settings.scheduler.clone(),
    )?));
    let load = if share_load {
        Some(
            LoadShare::start(
                transport,
                &settings.cluster,
                Arc::clone(&scheduler),
                LoadShareConfig::default(),
                stop,
            )
            .await?,
        )
    } else {
        None
    };
    Ok(Router::new(
        scheduler,
        plane,
        load,
        settings.ingress.clone(),
        metrics,
        tokenizer,
    ))
}

/// Serves until SIGINT or SIGTERM, then drains: `/ready` fails, the listener closes, and
/// requests in flight get up to `drain` to finish.
pub async fn serve_until_signal(
    router: Arc<Router>,
    listener: tokio::net::TcpListener,
    drain: Duration,
) {
    let (stop_accepting, accepting) = watch::channel(false);
    let server = tokio::spawn(serve(Arc::clone(&router), listener, accepting));
    terminated().await;
    router.begin_drain();
    let _ = stop_accepting.send(true);
    let _ = server.await;
    tracing::info!(inflight = router.inflight(), "draining");
    let left = router.drained(drain).await;
    if left > 0 {
        tracing::warn!(left, "drain timeout: closing streams still in flight");
    } else {
        tracing::info!("drained");
    }
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM (what Kubernetes sends).
pub async fn terminated() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}
