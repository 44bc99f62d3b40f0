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
use kvroute::ingress::{Router, serve, serve_admin, serve_status};
use kvroute::process::Metrics;
use kvroute::scheduler::Scheduler;
use tokio::sync::watch;

use kvroute_cli::settings::{self, ServeArgs, ServeFlags, Settings};

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
    kvroute::process::init_logging(settings.log_format);
    kvroute::process::raise_open_files_limit(settings.ingress.http.max_connections);
    // SIGTERM is heard from here on, before the slow part of starting (a tokenizer of
    // megabytes and its chat template): the router is PID 1 in its image, which ignores
    // SIGTERM until a handler exists.
    let runtime = tokio::runtime::Runtime::new()?;
    let signals = runtime.block_on(async { kvroute::process::signals() });
    let mut tokenizer = load_tokenizer(
        settings.tokenizer.as_deref(),
        settings.chat_template.as_deref(),
    )?;
    tokenizer.set_content_format(settings.chat_template_content_format);
    tokenizer.set_default_chat_kwargs(settings.default_chat_template_kwargs.clone());
    if settings.trust_request_chat_template {
        tokenizer.trust_request_chat_templates();
    }
    if settings.exclude_tools_when_tool_choice_none {
        tokenizer.exclude_tools_when_tool_choice_none();
    }
    runtime.block_on(async move {
        let metrics = kvroute::process::install_metrics();
        if !settings.backends.is_empty() {
            return serve_direct(settings, metrics, tokenizer, &signals).await;
        }
        let (stop, stop_rx) = watch::channel(false);
        // NATS may still be starting (it is retried without end): SIGTERM stops the wait.
        let startup = async {
            // Bound first: a port taken fails the start at once, not after NATS answers
            // (which may be never).
            let listeners = Listeners::bind(&settings).await?;
            let transport =
                Transport::connect_nats(&settings.nats, "kvroute-router", &settings.nats_auth)
                    .await?;
            let client = transport.nats_client().context("NATS transport")?.clone();
            let lease = LeaseConfig {
                ttl_ms: settings.lease_ttl_ms,
                ..LeaseConfig::default()
            };
            let registry =
                Registry::nats(client, &settings.cluster, &lease, settings.registry_replicas)
                    .await?;
            let router = start_router(
                &settings,
                transport.clone(),
                registry,
                true,
                metrics,
                tokenizer,
                stop_rx,
            )
            .await?;
            // Engines without KV events learn from the prompts routed to them: their
            // sidecars hear of each one.
            router.publish_decisions(transport, settings.cluster.clone());
            anyhow::Ok((router, listeners))
        };
        let Some(started) = kvroute::process::unless_signalled(&signals, startup).await else {
            let _ = stop.send(true);
            return Ok(());
        };
        let (router, listeners) = started?;
        println!("kvroute serving on http://{}", listeners.api_addr);
        listeners.announce();
        tracing::info!(addr = %listeners.api_addr, admin = %listeners.admin_addr, status = ?listeners.status_addr, nats = %kvroute::auth::redact_credentials(&settings.nats), cluster = %settings.cluster, "router serving");
        let outcome = serve_until_signal(
            router,
            listeners,
            Duration::from_millis(settings.drain_timeout_ms),
            &signals,
        )
        .await;
        let _ = stop.send(true);
        outcome
    })
}

/// Direct mode: no NATS; each `--backend` engine is followed by a bridge in this process,
/// on the in-process event plane, as a sidecar would over NATS.
async fn serve_direct(
    settings: Settings,
    metrics: Option<Metrics>,
    tokenizer: Tokenizer,
    signals: &watch::Receiver<bool>,
) -> anyhow::Result<()> {
    use kvroute::discovery::LocalRegistry;
    use kvroute::engines::ingest::EngineEndpoint;
    use kvroute::events::transport::LocalBus;
    use kvroute_worker::bridge::{self, BridgeConfig};
    let transport = Transport::Local(LocalBus::new());
    let registry = Registry::Local(LocalRegistry::default());
    let (stop, stop_rx) = watch::channel(false);
    let mut bridges = Vec::new();
    // Engines without KV events learn their likely cache from the prompts routed to them.
    let mut learners = std::collections::HashMap::new();
    for b in &settings.backends {
        if b.events.is_some() && b.replay.is_none() {
            kvroute::engines::ingest::warn_without_replay(&b.url);
        }
        let id = kvroute::protocol::WorkerId(
            (xxhash_rust::xxh3::xxh3_64(b.url.as_bytes()) & 0xffff_ffff_ffff).max(1),
        );
        let config = BridgeConfig {
            id,
            engine_url: b.url.clone(),
            events: b.events.clone().map(|events| EngineEndpoint {
                events,
                replay: b.replay.clone(),
                topic: b.topic.clone(),
            }),
            dp_size: b.dp,
            model: b.model.clone().unwrap_or_default(),
            block_size: std::num::NonZeroUsize::new(b.block_size)
                .context("backend block_size 0")?,
            offload_chunk: std::num::NonZeroUsize::new(b.offload_chunk)
                .context("backend offload_chunk 0")?,
            cluster: settings.cluster.clone(),
            // The router lapses its engines by its own lease: they heartbeat four times in
            // it (at the default one second, a lease of 1000 ms would lapse each engine at
            // every beat, and resync it from a snapshot).
            lease: LeaseConfig {
                ttl_ms: settings.lease_ttl_ms,
                heartbeat_ms: (settings.lease_ttl_ms / kvroute::discovery::MIN_LEASE_HEARTBEATS)
                    .max(1),
            },
            health_every: Duration::from_secs(2),
            health_failures: 2,
            limits: kvroute::engines::ingest::IngestLimits {
                max_blocks: std::num::NonZeroUsize::new(b.max_blocks)
                    .context("backend max_blocks 0")?,
                ..Default::default()
            },
            engine_api_key: settings.ingress.engine_api_key.clone(),
        };
        let learned = match config.events {
            Some(_) => None,
            None => {
                let (tx, rx) = tokio::sync::mpsc::channel(1024);
                learners.insert(id, tx);
                Some(rx)
            }
        };
        let bridge = bridge::run(
            config,
            transport.clone(),
            registry.clone(),
            stop_rx.clone(),
            learned,
        );
        let url = b.url.clone();
        bridges.push(tokio::spawn(async move {
            // Said when it happens: the router keeps serving the other engines.
            if let Err(e) = bridge.await {
                tracing::error!(backend = %url, error = %e, "the bridge to this engine stopped; the router no longer routes to it");
            }
        }));
    }
    let router = start_router(
        &settings, transport, registry, false, metrics, tokenizer, stop_rx,
    )
    .await?;
    if !learners.is_empty() {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<kvroute::ingress::RoutedPrompt>(1024);
        router.report_decisions(tx, learners.keys().copied().collect());
        tokio::spawn(async move {
            while let Some(routed) = rx.recv().await {
                if let Some(learner) = learners.get(&routed.key.0) {
                    let _ = learner.try_send(routed);
                }
            }
        });
    }
    let listeners = Listeners::bind(&settings).await?;
    println!(
        "kvroute serving on http://{} in front of {} engine(s), no NATS",
        listeners.api_addr,
        settings.backends.len()
    );
    listeners.announce();
    let outcome = serve_until_signal(
        router,
        listeners,
        Duration::from_millis(settings.drain_timeout_ms),
        signals,
    )
    .await;
    let _ = stop.send(true);
    for b in bridges {
        let _ = b.await;
    }
    outcome
}

/// The router's listeners: the API (OpenAI endpoints, health, metrics), the admin views,
/// and, if a port is set, the status listener (health, readiness, metrics).
pub struct Listeners {
    api: tokio::net::TcpListener,
    admin: tokio::net::TcpListener,
    status: Option<tokio::net::TcpListener>,
    /// Where the API listens.
    pub api_addr: std::net::SocketAddr,
    /// Where the admin views listen.
    pub admin_addr: std::net::SocketAddr,
    /// Where the status listener listens.
    pub status_addr: Option<std::net::SocketAddr>,
}

impl Listeners {
    /// Binds them, as the settings say.
    pub async fn bind(settings: &Settings) -> anyhow::Result<Listeners> {
        let api = tokio::net::TcpListener::bind((settings.host, settings.port))
            .await
            .with_context(|| format!("listening on {}:{}", settings.host, settings.port))?;
        let admin = tokio::net::TcpListener::bind((settings.admin_host, settings.admin_port))
            .await
            .with_context(|| {
                format!(
                    "admin listener on {}:{}",
                    settings.admin_host, settings.admin_port
                )
            })?;
        let status = match settings.status_port {
            Some(port) => Some(
                tokio::net::TcpListener::bind((settings.status_host, port))
                    .await
                    .with_context(|| {
                        format!("status listener on {}:{port}", settings.status_host)
                    })?,
            ),
            None => None,
        };
        let shown = |a: std::net::SocketAddr| {
            if a.ip().is_unspecified() {
                std::net::SocketAddr::from(([127, 0, 0, 1], a.port()))
            } else {
                a
            }
        };
        Ok(Listeners {
            api_addr: shown(api.local_addr()?),
            admin_addr: shown(admin.local_addr()?),
            status_addr: status
                .as_ref()
                .map(|l| l.local_addr().map(shown))
                .transpose()?,
            api,
            admin,
            status,
        })
    }

    /// Prints where each listener is (tests and scripts read these lines).
    fn announce(&self) {
        println!("kvroute admin on http://{}", self.admin_addr);
        if let Some(addr) = self.status_addr {
            println!("kvroute status on http://{addr}");
        }
    }
}

/// The tokenizer file (with a chat template file in place of the model's), or bytes.
pub fn load_tokenizer(
    path: Option<&std::path::Path>,
    chat_template: Option<&std::path::Path>,
) -> anyhow::Result<Tokenizer> {
    Ok(match path {
        Some(path) => Tokenizer::load_with(path, chat_template)?,
        None if chat_template.is_some() => anyhow::bail!("--chat-template needs --tokenizer"),
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
    metrics: Option<Metrics>,
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
    let mut scheduler = Scheduler::new(settings.scheduler.clone())?;
    // Bookings numbered from now: a restart under a pinned replica id reuses no number.
    let started_unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    scheduler.number_bookings_from(started_unix_ms);
    let scheduler = Arc::new(parking_lot::Mutex::new(scheduler));
    let plane = EventPlane::start(
        transport.clone(),
        indexer,
        registry.watch(lease),
        plane_config,
        Some(Arc::clone(&scheduler)),
        stop.clone(),
    )
    .await?;
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

/// Serves until SIGINT or SIGTERM (heard through `signals`), then drains: `/ready` fails, the listeners close, and
/// requests in flight get up to `drain` to finish. If the event plane fails for good (its
/// subscription or the registry watch ended), the router can no longer follow the fleet: it
/// drains the same way and returns the failure; so does a listener that stops on its own (a
/// panic), which otherwise left the process up and ready, refusing every connection.
pub async fn serve_until_signal(
    router: Arc<Router>,
    listeners: Listeners,
    drain: Duration,
    signals: &watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let (stop_accepting, accepting) = watch::channel(false);
    let (ended_tx, mut ended) = tokio::sync::mpsc::channel(2);
    let api = tokio::spawn({
        let ended = Ended("API", ended_tx.clone());
        let serving = serve(Arc::clone(&router), listeners.api, accepting.clone());
        async move {
            let _ended = ended;
            serving.await
        }
    });
    let admin = tokio::spawn({
        let ended = Ended("admin", ended_tx);
        let serving = serve_admin(Arc::clone(&router), listeners.admin, accepting);
        async move {
            let _ended = ended;
            serving.await
        }
    });
    // Probes and scrapes are answered through the drain (`/ready` says 503): the status
    // listener stops when this returns.
    let (_stop_status, status_stop) = watch::channel(false);
    if let Some(listener) = listeners.status {
        tokio::spawn(serve_status(Arc::clone(&router), listener, status_stop));
    }
    let mut failed = router.plane.failed();
    let failure = tokio::select! {
        () = kvroute::process::signalled(signals) => None,
        reason = failed.wait_for(Option::is_some) => reason
            .ok()
            .and_then(|r| r.clone())
            .map(|r| format!("the event plane failed: {r}")),
        Some(name) = ended.recv() => Some(format!("the {name} listener stopped")),
    };
    router.begin_drain();
    let _ = stop_accepting.send(true);
    tracing::info!(inflight = router.inflight(), "draining");
    // Every connection finishes what it serves (a stream to the last byte its client
    // reads) and closes; the deadline cuts whatever is left.
    let deadline = tokio::time::Instant::now() + drain;
    let _ = tokio::time::timeout_at(deadline, async {
        let _ = api.await;
        let _ = admin.await;
    })
    .await;
    let left = router
        .drained(deadline.saturating_duration_since(tokio::time::Instant::now()))
        .await;
    if left > 0 {
        tracing::warn!(left, "drain timeout: closing streams still in flight");
    } else {
        tracing::info!("drained");
    }
    match failure {
        Some(reason) => anyhow::bail!("{reason}"),
        None => Ok(()),
    }
}

/// Says its listener's name when dropped: when the task serving it ends, returned or
/// panicked.
struct Ended(&'static str, tokio::sync::mpsc::Sender<&'static str>);

impl Drop for Ended {
    fn drop(&mut self) {
        let _ = self.1.try_send(self.0);
    }
}
