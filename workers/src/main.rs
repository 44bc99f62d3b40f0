//! `kvroute-worker`: a worker process serving generate requests from its engine and
//! publishing its KV events to the router over NATS.
#![forbid(unsafe_code)]

/// jemalloc, built with options that return freed pages to the OS within about a second
/// (`.cargo/config.toml`): glibc's heap stays resident after the index shrinks.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use std::net::{IpAddr, SocketAddr};

use std::time::Duration;

use anyhow::{Context, bail};
use clap::Parser;
use kvroute::auth::NatsAuth;
use kvroute::discovery::{LeaseConfig, Registry};
use kvroute::events::transport::Transport;
use kvroute::http::HttpConfig;
use kvroute::process::LogFormat;
use kvroute::protocol::WorkerId;
use kvroute_worker::engine::{MixedStep, TimingModel};
use kvroute_worker::server::{ServerConfig, Worker, host_name, new_epoch, stable_id, stable_id_of};
use kvroute_worker::{Device, EngineConfig};

/// NATS URLs as `--dry-run` prints them: credentials in them as `<redacted>`.
fn redacted_urls<S: serde::Serializer>(urls: &str, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&kvroute::auth::redact_credentials(urls))
}

/// A kvroute worker: continuous-batching engine (timing model, no model weights), HTTP
/// generate endpoint, KV events over NATS.
#[derive(Parser, Debug, serde::Serialize)]
#[command(name = "kvroute-worker", version, about)]
struct Args {
    /// NATS server URL; several servers of one cluster comma-separated.
    #[arg(
        long,
        env = "KVROUTE_NATS",
        default_value = "nats://127.0.0.1:4222",
        hide_env_values = true
    )]
    #[serde(serialize_with = "redacted_urls")]
    nats: String,
    #[command(flatten)]
    nats_auth: NatsAuth,
    /// Copies of the worker registry kept by a JetStream cluster (fewer if it has fewer
    /// servers).
    #[arg(long, env = "KVROUTE_REGISTRY_REPLICAS", default_value_t = 3)]
    registry_replicas: usize,
    /// HTTP port (0: any free port). A sidecar (`--engine`) serves its own `/metrics` and
    /// `/health` there; the engine's API stays on its own port.
    #[arg(long, env = "KVROUTE_PORT", default_value_t = 9000)]
    port: u16,
    /// Address to listen on.
    #[arg(long, env = "KVROUTE_HOST", default_value = "127.0.0.1")]
    host: IpAddr,
    /// Worker id (default: derived from the host name and the port, so it survives
    /// restarts; random if there is no host name or the port is 0).
    #[arg(long, env = "KVROUTE_WORKER_ID")]
    id: Option<u64>,
    /// URL the router reaches this worker at (default: http://HOST:PORT). A sidecar
    /// registers --engine-url instead (it was taken and ignored).
    #[arg(long, conflicts_with = "engine", env = "KVROUTE_URL")]
    url: Option<String>,
    /// Cluster name (NATS subjects and registry bucket).
    #[arg(long, env = "KVROUTE_CLUSTER", default_value = "default")]
    cluster: String,
    /// Model name served [default: kvroute-sim; a sidecar (`--engine`): the engine's, read
    /// from its /v1/models].
    #[arg(long, env = "KVROUTE_MODEL")]
    model: Option<String>,
    /// Where the KV cache lives: `cpu` (the timing model only, no KV bytes held) or
    /// `cuda[:N]` (G1 on GPU N, G2 in pinned host memory).
    #[arg(long, env = "KVROUTE_DEVICE", default_value = "cpu")]
    device: Device,
    /// Tokens per KV block.
    #[arg(long, env = "KVROUTE_BLOCK_SIZE", default_value_t = EngineConfig::default().block_size)]
    block_size: usize,
    /// G1 (GPU) blocks.
    #[arg(long, conflicts_with = "engine", env = "KVROUTE_G1_BLOCKS", default_value_t = EngineConfig::default().g1_blocks)]
    g1_blocks: usize,
    /// G2 (host) blocks; 0 disables offload.
    #[arg(long, conflicts_with = "engine", env = "KVROUTE_G2_BLOCKS", default_value_t = EngineConfig::default().g2_blocks)]
    g2_blocks: usize,
    /// Divides step times of the timing model.
    #[arg(long, conflicts_with = "engine", env = "KVROUTE_SPEEDUP", default_value_t = EngineConfig::default().speedup)]
    speedup: f64,
    /// Token budget per engine step.
    #[arg(long, conflicts_with = "engine", env = "KVROUTE_MAX_NUM_BATCHED_TOKENS", default_value_t = EngineConfig::default().max_num_batched_tokens)]
    max_num_batched_tokens: usize,
    /// Most sequences running at once.
    #[arg(long, conflicts_with = "engine", env = "KVROUTE_MAX_NUM_SEQS", default_value_t = EngineConfig::default().max_num_seqs)]
    max_num_seqs: usize,
    /// Price of a step holding prefill and decode: `marginal` (one forward pass) or
    /// `additive` (prefill plus a whole decode step, as Dynamo's mocker).
    #[arg(long, conflicts_with = "engine", env = "KVROUTE_MIXED_STEP", default_value = "marginal", value_parser = parse_mixed_step)]
    mixed_step: MixedStep,
    /// Hugging Face `tokenizer.json` for the text endpoints (chat template from the
    /// `tokenizer_config.json` beside it); without it, one token per UTF-8 byte, as the router.
    #[arg(long, conflicts_with = "engine", env = "KVROUTE_TOKENIZER")]
    tokenizer: Option<std::path::PathBuf>,
    /// Render the chat templates requests bring (vLLM's flag of the same name); without
    /// it such requests are refused (400), as vLLM refuses them.
    #[arg(
        long,
        conflicts_with = "engine",
        env = "KVROUTE_TRUST_REQUEST_CHAT_TEMPLATE"
    )]
    trust_request_chat_template: bool,
    /// Registration heartbeat, ms.
    #[arg(long, env = "KVROUTE_HEARTBEAT_MS", default_value_t = LeaseConfig::default().heartbeat_ms)]
    heartbeat_ms: u64,
    /// Registration TTL, ms: at least four heartbeat periods, at most 3600000 (an hour).
    #[arg(long, env = "KVROUTE_LEASE_TTL_MS", default_value_t = LeaseConfig::default().ttl_ms)]
    lease_ttl_ms: u64,
    /// Client connections served at once.
    #[arg(long, env = "KVROUTE_MAX_CONNECTIONS", default_value_t = HttpConfig::default().max_connections)]
    max_connections: usize,
    /// A client must send a request's headers within this long (also the keep-alive idle
    /// limit), ms.
    #[arg(long, env = "KVROUTE_HEADER_READ_TIMEOUT_MS", default_value_t = HttpConfig::default().header_read_timeout_ms)]
    header_read_timeout_ms: u64,
    /// A client must send a request's body within this long, ms.
    #[arg(long, env = "KVROUTE_BODY_READ_TIMEOUT_MS", default_value_t = HttpConfig::default().body_read_timeout_ms)]
    body_read_timeout_ms: u64,
    /// A connection whose client reads nothing of its answer for this long is closed, ms.
    #[arg(long, env = "KVROUTE_WRITE_STALL_TIMEOUT_MS", default_value_t = HttpConfig::default().write_stall_timeout_ms)]
    write_stall_timeout_ms: u64,
    /// On SIGTERM: deregister, stop accepting, and give requests in flight this long to
    /// finish, ms. (Not a sidecar's: its engine serves the requests, and drains them itself.)
    #[arg(
        long,
        env = "KVROUTE_DRAIN_TIMEOUT_MS",
        default_value_t = 30_000,
        conflicts_with = "engine"
    )]
    drain_timeout_ms: u64,
    /// After its engine fails, the worker (deregistered at once) keeps answering /metrics
    /// this long before it exits non-zero, so that a scrape records what failed (the
    /// counters of a failure were lost with the process, and their alerts never fired:
    /// two of the chart's 15 s scrapes by default); SIGTERM ends the wait, ms. (Not a
    /// sidecar's: it has no engine of its own to fail; an unhealthy engine is withdrawn.)
    #[arg(
        long,
        env = "KVROUTE_FAILURE_LINGER_MS",
        default_value_t = 30_000,
        conflicts_with = "engine"
    )]
    failure_linger_ms: u64,
    /// Log lines as `text` (colour only on a terminal) or `json`.
    #[arg(long, env = "KVROUTE_LOG_FORMAT", default_value = "text")]
    log_format: LogFormat,
    /// Serve `POST /admin/faults` (pause the publisher, stall after headers, fail the
    /// engine). For chaos tests only.
    #[arg(long, conflicts_with = "engine")]
    fault_injection: bool,
    /// Be the sidecar of a real engine instead of a simulated one: `vllm`, `sglang`, or
    /// `openai` (any OpenAI server, no KV events). Starts no engine: follows the engine's
    /// KV events (--kv-events), republishes them over NATS with epochs, ids and snapshots,
    /// and registers --engine-url while the engine's /health answers.
    #[arg(long, env = "KVROUTE_ENGINE")]
    engine: Option<kvroute_worker::bridge::EngineKind>,
    /// The engine's HTTP URL (OpenAI endpoints, /health, /metrics).
    #[arg(long, env = "KVROUTE_ENGINE_URL", requires = "engine")]
    engine_url: Option<String>,
    /// The engine's KV-event PUB socket, tcp://HOST:PORT (vLLM and SGLang: port 5557 unless
    /// configured).
    #[arg(long, env = "KVROUTE_KV_EVENTS", requires = "engine")]
    kv_events: Option<String>,
    /// The engine's replay ROUTER socket, tcp://HOST:PORT (lost batches are asked again).
    #[arg(long, env = "KVROUTE_KV_REPLAY", requires = "kv_events")]
    kv_replay: Option<String>,
    /// The topic the engine publishes under.
    #[arg(long, env = "KVROUTE_KV_TOPIC", default_value = "")]
    kv_topic: String,
    /// GPU blocks per chunk of the engine's CPU offload, when its events name a chunk by
    /// its last block's hash only (vLLM's `kv_connector_extra_config` `block_size` or
    /// `blocks_per_chunk` > 1 without `self_describing_kv_events`); 1 otherwise.
    #[arg(long, env = "KVROUTE_KV_OFFLOAD_CHUNK", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4096))]
    kv_offload_chunk: u32,
    /// Sidecar: the key sent as `Authorization: Bearer` to the engine (one started with
    /// `--api-key` refuses its `/v1/models` without it).
    #[arg(
        long,
        env = "KVROUTE_ENGINE_API_KEY",
        hide_env_values = true,
        requires = "engine"
    )]
    engine_api_key: Option<kvroute::auth::Secret>,
    /// Require `Authorization: Bearer KEY` on every endpoint of this worker but `/health` and
    /// `/metrics`: `/v1/*` as vLLM's `--api-key` does (the test engine, `--emulate`), and the
    /// `/internal/generate` a router sends to (routers need `--engine-api-key KEY`).
    #[arg(
        long,
        env = "KVROUTE_WORKER_API_KEY",
        hide_env_values = true,
        conflicts_with = "engine"
    )]
    api_key: Option<kvroute::auth::Secret>,
    /// Data-parallel ranks behind --engine-url, each publishing on the event ports offset by
    /// its rank (as vLLM and SGLang do).
    #[arg(long, env = "KVROUTE_ENGINE_DP_SIZE", default_value_t = 1)]
    engine_dp_size: u32,
    /// How often the engine's /health is asked, ms (two failures in a row withdraw the
    /// registration).
    #[arg(long, env = "KVROUTE_ENGINE_HEALTH_MS", default_value_t = 2_000)]
    engine_health_ms: u64,
    /// Sidecar: most blocks the mirror of each engine rank holds (about 100 B each); what
    /// the engine stores past it is not indexed (`kvroute_engine_blocks_not_indexed_total`
    /// reason `capped`) until it removes some. At most 16 Mi (2^24), what one snapshot
    /// carries: the mirror is what routers resync from.
    #[arg(long, env = "KVROUTE_ENGINE_MAX_BLOCKS", default_value_t = kvroute::engines::mirror::DEFAULT_MAX_BLOCKS as u64, value_parser = clap::value_parser!(u64).range(1..=(kvroute::protocol::MAX_SNAPSHOT_BLOCKS as u64)))]
    engine_max_blocks: u64,
    /// Be a test engine instead: the simulated engine, speaking `vllm`, `vllm-legacy` or
    /// `sglang` wire formats (KV events on ZMQ, no NATS, no registration).
    #[arg(long, env = "KVROUTE_EMULATE", conflicts_with = "engine")]
    emulate: Option<kvroute_worker::emulate::Flavor>,
    /// The test engine's KV-event PUB port (0: any free port).
    #[arg(long, default_value_t = 5557, requires = "emulate")]
    emulate_events_port: u16,
    /// The test engine's replay ROUTER port (none without it; 0: any free port).
    #[arg(long, requires = "emulate")]
    emulate_replay_port: Option<u16>,
    /// The test engine's event topic.
    #[arg(long, default_value = "", requires = "emulate")]
    emulate_topic: String,
    /// LoRA adapters the test engine serves on top of --model, comma-separated (its blocks
    /// for an adapter are salted with the adapter's name, as vLLM's are).
    #[arg(long, value_delimiter = ',', requires = "emulate")]
    emulate_adapters: Vec<String>,
    /// The test engine names blocks with 32-byte hashes (vLLM with
    /// VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) instead of ints.
    #[arg(long, requires = "emulate")]
    emulate_bytes_hashes: bool,
    /// The test engine's data-parallel ranks behind its one HTTP endpoint, each an engine of
    /// its own publishing on the event ports offset by its rank (as vLLM's do); a request
    /// goes to the rank its `X-data-parallel-rank` header names, else to the least loaded.
    #[arg(
        long,
        default_value_t = 1,
        requires = "emulate",
        value_parser = clap::value_parser!(u32).range(1..=64)
    )]
    emulate_dp_size: u32,
    /// Check the flags and variables, print the resolved settings as JSON, and exit.
    #[arg(long)]
    #[serde(skip)]
    dry_run: bool,
}

fn main() -> std::process::ExitCode {
    let result = tokio::runtime::Runtime::new()
        .map_err(anyhow::Error::from)
        .and_then(|runtime| {
            runtime.block_on(async {
                // Heard from here on: a start-up waiting for NATS can be stopped.
                let signals = kvroute::process::signals();
                run(&signals).await
            })
        });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            // One line: what failed and why (e.g. which CUDA library is missing).
            eprintln!("kvroute-worker: {err:#}");
            std::process::ExitCode::from(2)
        }
    }
}

fn parse_mixed_step(name: &str) -> Result<MixedStep, String> {
    MixedStep::parse(name).ok_or_else(|| format!("{name:?}: expected marginal or additive"))
}

async fn run(signals: &tokio::sync::watch::Receiver<bool>) -> anyhow::Result<()> {
    let args = Args::parse();
    let engine = EngineConfig {
        block_size: args.block_size,
        g1_blocks: args.g1_blocks,
        g2_blocks: args.g2_blocks,
        speedup: args.speedup,
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_num_seqs: args.max_num_seqs,
        device: args.device,
        timing: TimingModel {
            mixed_step: args.mixed_step,
            ..TimingModel::default()
        },
        ..EngineConfig::default()
    };
    engine.validate().context("engine configuration")?;
    LeaseConfig {
        heartbeat_ms: args.heartbeat_ms,
        ttl_ms: args.lease_ttl_ms,
    }
    .validate()
    .context("--lease-ttl-ms and --heartbeat-ms")?;
    let http = HttpConfig {
        max_connections: args.max_connections,
        header_read_timeout_ms: args.header_read_timeout_ms,
        body_read_timeout_ms: args.body_read_timeout_ms,
        write_stall_timeout_ms: args.write_stall_timeout_ms,
    };
    http.validate()?;
    kvroute::events::plane::check_cluster(&args.cluster).map_err(anyhow::Error::msg)?;
    args.nats_auth.validate()?;
    if !(1..=5).contains(&args.registry_replicas) {
        bail!("--registry-replicas must be 1..=5 (JetStream's limit)");
    }
    if args.engine.is_some() {
        check_sidecar(&args)?;
    } else if args.emulate.is_none() && args.url.is_none() && args.host.is_unspecified() {
        // It would register http://0.0.0.0:PORT, which a router on another host reads as
        // its own loopback.
        bail!(
            "--host {} needs --url (the URL routers reach this worker at)",
            args.host
        );
    }
    // Opened before `--dry-run` answers, as the router's is: a wrong path passed the check
    // and crash-looped the worker at start.
    if let Some(path) = &args.tokenizer {
        std::fs::File::open(path).with_context(|| format!("--tokenizer {}", path.display()))?;
    }
    if args.dry_run {
        println!("{}", serde_json::to_string_pretty(&args)?);
        return Ok(());
    }
    kvroute::process::init_logging(args.log_format);
    kvroute::process::raise_open_files_limit(args.max_connections);
    if let Device::Cuda(ordinal) = args.device {
        // Fail before touching NATS, naming what is missing (driver, NVRTC, device).
        let gpu = kvroute_kernels::cuda::Gpu::new(ordinal)
            .with_context(|| format!("--device {}", args.device))?;
        tracing::info!(device = %gpu.name, arch = ?gpu.arch, "KV cache on the GPU");
    }
    let lease = LeaseConfig {
        heartbeat_ms: args.heartbeat_ms,
        ttl_ms: args.lease_ttl_ms,
    };
    let id = match (args.id, host_name()) {
        (Some(id), _) => WorkerId(id),
        // A sidecar is named after its engine's URL, which tells it apart from the other
        // sidecars of its host (each also needs a --port of its own, for its /metrics) and
        // stays the same across its restarts.
        (None, Some(host)) if args.engine.is_some() => {
            stable_id_of(&host, args.engine_url.as_deref().unwrap_or_default())
        }
        (None, Some(host)) if args.port != 0 => stable_id(&host, args.port),
        _ => WorkerId(new_epoch() & 0xffff_ffff_ffff),
    };
    if let Some(kind) = args.engine {
        return sidecar(&args, kind, id, lease, http, signals).await;
    }
    let emulate = match args.emulate {
        Some(flavor) => Some(std::sync::Arc::new(
            emulation(&args, flavor, &engine).await?,
        )),
        None => None,
    };
    let (transport, registry) = if emulate.is_some() {
        // An engine talks to nobody's NATS: its events leave on ZMQ.
        let bus = kvroute::events::transport::LocalBus::new();
        (Transport::Local(bus), Registry::Local(Default::default()))
    } else {
        match connect_nats(&args, "kvroute-worker", &lease, signals).await? {
            Some(connected) => connected,
            None => return Ok(()),
        }
    };
    let config = ServerConfig {
        id,
        listen: SocketAddr::new(args.host, args.port),
        url: args.url,
        cluster: args.cluster,
        model: args.model.unwrap_or_else(|| "kvroute-sim".into()),
        engine,
        lease,
        epoch: new_epoch(),
        metrics: kvroute::process::install_metrics(),
        tokenizer: std::sync::Arc::new({
            let mut tokenizer = match &args.tokenizer {
                Some(path) => kvroute::ingress::tokenizer::Tokenizer::load(path)?,
                None => kvroute::ingress::tokenizer::Tokenizer::Bytes,
            };
            if args.trust_request_chat_template {
                tokenizer.trust_request_chat_templates();
            }
            tokenizer
        }),
        http,
        fault_injection: args.fault_injection,
        api_key: args.api_key.clone(),
        emulate: emulate.clone(),
    };
    let Some(worker) =
        kvroute::process::unless_signalled(signals, Worker::start(config, transport, registry))
            .await
    else {
        return Ok(());
    };
    let mut worker = worker?;
    tracing::info!(%id, addr = %worker.addr, "worker serving");
    println!("kvroute-worker {id} listening on http://{}", worker.addr);
    for (e, (rank, r)) in emulate
        .iter()
        .flat_map(|e| e.ranks.iter().enumerate().map(move |r| (e, r)))
    {
        let replay = r
            .publisher
            .replay_port()
            .map(|p| format!(", replay on tcp://{}:{p}", args.host))
            .unwrap_or_default();
        println!(
            "test engine ({:?}) rank {rank} publishing KV events on tcp://{}:{}{replay}",
            e.flavor,
            args.host,
            r.publisher.pub_port()
        );
    }
    let mut failed = worker.failed();
    tokio::select! {
        () = kvroute::process::signalled(signals) => {
            tracing::info!(active = worker.active(), "terminating: deregistered, draining");
            let left = worker.shutdown(Duration::from_millis(args.drain_timeout_ms)).await;
            if left > 0 {
                tracing::warn!(left, "drain timeout: requests still running are cut off");
            }
            Ok(())
        }
        reason = failed.wait_for(Option::is_some) => {
            let reason = reason.ok().and_then(|r| r.clone()).unwrap_or_default();
            // Never a registered zombie: leave the fleet, let a scrape see why, then fail
            // loudly.
            worker.leave().await;
            tracing::error!(
                reason = %reason,
                linger_ms = args.failure_linger_ms,
                "engine failed: deregistered; exiting once /metrics has been scraped"
            );
            tokio::select! {
                () = tokio::time::sleep(Duration::from_millis(args.failure_linger_ms)) => {}
                () = kvroute::process::signalled(signals) => {}
            }
            worker.stop().await;
            bail!("engine failed: {reason}")
        }
    }
}

/// Connects to NATS and opens the registry, as client `name`, unless SIGINT or SIGTERM
/// comes first (`None`): NATS may still be starting, and its connect is retried without end.
async fn connect_nats(
    args: &Args,
    name: &str,
    lease: &LeaseConfig,
    signals: &tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<Option<(Transport, Registry)>> {
    let connect = async {
        let transport = Transport::connect_nats(&args.nats, name, &args.nats_auth).await?;
        let client = transport.nats_client().context("NATS transport")?.clone();
        let registry = Registry::nats(client, &args.cluster, lease, args.registry_replicas).await?;
        anyhow::Ok((transport, registry))
    };
    kvroute::process::unless_signalled(signals, connect)
        .await
        .transpose()
}

/// The test engine's event sockets.
async fn emulation(
    args: &Args,
    flavor: kvroute_worker::emulate::Flavor,
    engine: &EngineConfig,
) -> anyhow::Result<kvroute_worker::emulate::Emulation> {
    use kvroute::engines::publisher::EnginePublisher;
    let host = args.host.to_string();
    let dp = args.emulate_dp_size;
    anyhow::ensure!(
        dp == 1 || (args.emulate_events_port != 0 && args.emulate_replay_port != Some(0)),
        "--emulate-dp-size {dp} offsets the event ports by the rank: give them (not 0)"
    );
    let mut ranks = Vec::new();
    for rank in 0..dp as u16 {
        let offset = |port: u16| {
            port.checked_add(rank)
                .context("an event port plus the rank is past 65535")
        };
        let replay = match args.emulate_replay_port {
            Some(p) => Some((offset(p)?, flavor.replay_form())),
            None => None,
        };
        let publisher = EnginePublisher::bind(
            &host,
            offset(args.emulate_events_port)?,
            replay,
            &args.emulate_topic,
            // vLLM's default `buffer_steps`.
            10_000,
        )
        .await
        .with_context(|| format!("binding the test engine's event sockets of rank {rank}"))?;
        ranks.push(kvroute_worker::emulate::EmulatedRank {
            publisher,
            load: kvroute_worker::emulate::LoadCell::default(),
        });
    }
    let block_size = std::num::NonZeroUsize::new(engine.block_size).context("--block-size 0")?;
    Ok(kvroute_worker::emulate::Emulation {
        flavor,
        bytes_hashes: args.emulate_bytes_hashes,
        // Every rank's blocks, and their outputs' (learnt before a request is placed).
        book: kvroute_worker::emulate::TokenBook::new(
            block_size,
            4 * (engine.g1_blocks + engine.g2_blocks) * dp as usize,
        ),
        block_size,
        capacity_tokens: engine.g1_blocks.saturating_mul(block_size.get()),
        vocab: engine.vocab_size,
        adapters: args.emulate_adapters.clone(),
        ranks,
    })
}

/// The sidecar's settings, checked before anything starts (and by `--dry-run`): a value the
/// bridge would refuse only once the engine answered left a process that never registered
/// and never exited, its `/health` green.
fn check_sidecar(args: &Args) -> anyhow::Result<()> {
    use kvroute_worker::bridge::EngineKind;
    let url = args
        .engine_url
        .as_deref()
        .context("--engine needs --engine-url")?;
    if !url.starts_with("http://") || url.parse::<hyper::Uri>().is_err() {
        bail!("--engine-url {url:?}: the engine's http:// URL");
    }
    if args.engine != Some(EngineKind::Openai) && args.kv_events.is_none() {
        bail!("--engine needs --kv-events (the engine's ZMQ KV-event endpoint)");
    }
    if !(1..=1024).contains(&args.engine_dp_size) {
        bail!("--engine-dp-size must be 1..=1024");
    }
    if !(1..=4096).contains(&args.block_size) {
        bail!("--block-size must be 1..=4096 (the engine's tokens per KV block)");
    }
    if let Some(model) = &args.model
        && !kvroute::discovery::model_name_ok(model)
    {
        bail!("--model must be 1..=256 bytes without spaces or control characters");
    }
    if args.device != Device::Cpu {
        bail!("--device is the simulated engine's: a sidecar keeps no KV cache of its own");
    }
    if let Some(events) = &args.kv_events {
        let endpoint = kvroute::engines::ingest::EngineEndpoint {
            events: events.clone(),
            replay: args.kv_replay.clone(),
            topic: args.kv_topic.clone(),
        };
        // Every rank's ports exist (each rank publishes on rank 0's ports plus its rank).
        endpoint
            .for_rank(args.engine_dp_size - 1)
            .context("--kv-events, --kv-replay and --engine-dp-size")?;
    } else if args.kv_replay.is_some() {
        bail!("--kv-replay needs --kv-events");
    }
    Ok(())
}

/// Runs as a real engine's sidecar until SIGINT or SIGTERM.
async fn sidecar(
    args: &Args,
    kind: kvroute_worker::bridge::EngineKind,
    id: WorkerId,
    lease: LeaseConfig,
    http: HttpConfig,
    signals: &tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<()> {
    use kvroute_worker::bridge::BridgeConfig;
    // Checked by `check_sidecar`.
    let engine_url = args.engine_url.clone().unwrap_or_default();
    let events = match &args.kv_events {
        Some(e) => {
            if args.kv_replay.is_none() {
                kvroute::engines::ingest::warn_without_replay(&engine_url);
            }
            Some(kvroute::engines::ingest::EngineEndpoint {
                events: e.clone(),
                replay: args.kv_replay.clone(),
                topic: args.kv_topic.clone(),
            })
        }
        None => None,
    };
    let config = BridgeConfig {
        id,
        engine_url,
        events,
        dp_size: args.engine_dp_size,
        // Empty: the bridge asks the engine's /v1/models (a simulated worker's name would
        // register the engine under a model it does not serve).
        model: args.model.clone().unwrap_or_default(),
        block_size: std::num::NonZeroUsize::new(args.block_size).context("--block-size 0")?,
        offload_chunk: std::num::NonZeroUsize::new(args.kv_offload_chunk as usize)
            .context("--kv-offload-chunk 0")?,
        cluster: args.cluster.clone(),
        lease: lease.clone(),
        health_every: Duration::from_millis(args.engine_health_ms.max(100)),
        health_failures: 2,
        limits: kvroute::engines::ingest::IngestLimits {
            max_blocks: std::num::NonZeroUsize::new(args.engine_max_blocks as usize)
                .context("--engine-max-blocks 0")?,
            ..Default::default()
        },
        engine_api_key: args.engine_api_key.clone(),
    };
    // Its own series and those of the bridge, on --host:--port (bound before NATS, so a
    // port taken fails the start at once).
    let listen = SocketAddr::new(args.host, args.port);
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| {
            format!("binding the sidecar's /metrics and /health to {listen} (--host, --port)")
        })?;
    let listening = listener.local_addr()?;
    let (http_stop, http_stop_rx) = tokio::sync::watch::channel(false);
    let server = tokio::spawn(kvroute::http::serve_http(
        "sidecar",
        listener,
        http,
        {
            let metrics = kvroute::process::install_metrics();
            move |req: hyper::Request<hyper::body::Incoming>| {
                std::future::ready(kvroute_worker::server::sidecar_response(
                    metrics.as_ref(),
                    &req,
                ))
            }
        },
        http_stop_rx,
    ));
    let Some((transport, registry)) =
        connect_nats(args, "kvroute-sidecar", &lease, signals).await?
    else {
        return Ok(());
    };
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    println!(
        "kvroute-worker {id}: sidecar of {kind:?} engine at {}, metrics on http://{listening}/metrics",
        config.engine_url
    );
    // An engine without KV events: its cache is guessed from the prompts routers send it.
    let learned = match config.events {
        Some(_) => None,
        None => Some(
            kvroute_worker::bridge::learn_from_routes(
                &transport,
                &config.cluster,
                config.id,
                config.dp_size,
            )
            .await?,
        ),
    };
    let mut bridge = tokio::spawn(kvroute_worker::bridge::run(
        config, transport, registry, stop_rx, learned,
    ));
    let outcome = tokio::select! {
        () = kvroute::process::signalled(signals) => {
            let _ = stop.send(true);
            bridge.await
        }
        outcome = &mut bridge => outcome,
    };
    let _ = http_stop.send(true);
    // A scrape in flight finishes; a client that holds its connection open is not waited for.
    let _ = tokio::time::timeout(Duration::from_secs(1), server).await;
    outcome?
}
