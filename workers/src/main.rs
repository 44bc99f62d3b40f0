//! `kvroute-worker`: a worker process serving generate requests from its engine and
//! publishing its KV events to the router over NATS.
#![forbid(unsafe_code)]

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
use kvroute_worker::server::{ServerConfig, Worker, host_name, new_epoch, stable_id};
use kvroute_worker::{Device, EngineConfig};

/// A kvroute worker: continuous-batching engine (timing model, no model weights), HTTP
/// generate endpoint, KV events over NATS.
#[derive(Parser, Debug, serde::Serialize)]
#[command(name = "kvroute-worker", version, about)]
struct Args {
    /// NATS server URL; several servers of one cluster comma-separated.
    #[arg(long, env = "KVROUTE_NATS", default_value = "nats://127.0.0.1:4222")]
    nats: String,
    #[command(flatten)]
    nats_auth: NatsAuth,
    /// Copies of the worker registry kept by a JetStream cluster (fewer if it has fewer
    /// servers).
    #[arg(long, env = "KVROUTE_REGISTRY_REPLICAS", default_value_t = 3)]
    registry_replicas: usize,
    /// HTTP port (0: any free port).
    #[arg(long, env = "KVROUTE_PORT", default_value_t = 9000)]
    port: u16,
    /// Address to listen on.
    #[arg(long, env = "KVROUTE_HOST", default_value = "127.0.0.1")]
    host: IpAddr,
    /// Worker id (default: derived from the host name and the port, so it survives
    /// restarts; random if there is no host name or the port is 0).
    #[arg(long, env = "KVROUTE_WORKER_ID")]
    id: Option<u64>,
    /// URL the router reaches this worker at (default: http://HOST:PORT).
    #[arg(long, env = "KVROUTE_URL")]
    url: Option<String>,
    /// Cluster name (NATS subjects and registry bucket).
    #[arg(long, env = "KVROUTE_CLUSTER", default_value = "default")]
    cluster: String,
    /// Model name served.
    #[arg(long, env = "KVROUTE_MODEL", default_value = "kvroute-sim")]
    model: String,
    /// Where the KV cache lives: `cpu` (host memory, byte mode) or `cuda[:N]` (G1 on GPU N,
    /// G2 in pinned host memory).
    #[arg(long, env = "KVROUTE_DEVICE", default_value = "cpu")]
    device: Device,
    /// Tokens per KV block.
    #[arg(long, env = "KVROUTE_BLOCK_SIZE", default_value_t = EngineConfig::default().block_size)]
    block_size: usize,
    /// G1 (GPU) blocks.
    #[arg(long, env = "KVROUTE_G1_BLOCKS", default_value_t = EngineConfig::default().g1_blocks)]
    g1_blocks: usize,
    /// G2 (host) blocks; 0 disables offload.
    #[arg(long, env = "KVROUTE_G2_BLOCKS", default_value_t = EngineConfig::default().g2_blocks)]
    g2_blocks: usize,
    /// Divides step times of the timing model.
    #[arg(long, env = "KVROUTE_SPEEDUP", default_value_t = EngineConfig::default().speedup)]
    speedup: f64,
    /// Token budget per engine step.
    #[arg(long, env = "KVROUTE_MAX_NUM_BATCHED_TOKENS", default_value_t = EngineConfig::default().max_num_batched_tokens)]
    max_num_batched_tokens: usize,
    /// Most sequences running at once.
    #[arg(long, env = "KVROUTE_MAX_NUM_SEQS", default_value_t = EngineConfig::default().max_num_seqs)]
    max_num_seqs: usize,
    /// Hugging Face `tokenizer.json` for the text endpoints (chat template from the
    /// `tokenizer_config.json` beside it); without it, one token per UTF-8 byte, as the router.
    #[arg(long, env = "KVROUTE_TOKENIZER")]
    tokenizer: Option<std::path::PathBuf>,
    /// Registration heartbeat, ms.
    #[arg(long, env = "KVROUTE_HEARTBEAT_MS", default_value_t = LeaseConfig::default().heartbeat_ms)]
    heartbeat_ms: u64,
    /// Registration TTL, ms.
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
    /// On SIGTERM: deregister, stop accepting, and give requests in flight this long to
    /// finish, ms.
    #[arg(long, env = "KVROUTE_DRAIN_TIMEOUT_MS", default_value_t = 30_000)]
    drain_timeout_ms: u64,
    /// Log lines as `text` (colour only on a terminal) or `json`.
    #[arg(long, env = "KVROUTE_LOG_FORMAT", default_value = "text")]
    log_format: LogFormat,
    /// Serve `POST /admin/faults` (pause the publisher, stall after headers, fail the
    /// engine). For chaos tests only.
    #[arg(long)]
    fault_injection: bool,
    /// Check the flags and variables, print the resolved settings as JSON, and exit.
    #[arg(long)]
    #[serde(skip)]
    dry_run: bool,
}

fn main() -> std::process::ExitCode {
    let result = tokio::runtime::Runtime::new()
        .map_err(anyhow::Error::from)
        .and_then(|runtime| runtime.block_on(run()));
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            // One line: what failed and why (e.g. which CUDA library is missing).
            eprintln!("kvroute-worker: {err:#}");
            std::process::ExitCode::from(2)
        }
    }
}

async fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    let engine = EngineConfig {
        block_size: args.block_size,
        g1_blocks: args.g1_blocks,
        g2_blocks: args.g2_blocks,
        speedup: args.speedup,
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_num_seqs: args.max_num_seqs,
        device: args.device,
        ..EngineConfig::default()
    };
    engine.validate().context("engine configuration")?;
    if args.heartbeat_ms == 0 || args.lease_ttl_ms < 2 * args.heartbeat_ms {
        bail!(
            "--lease-ttl-ms must be at least twice --heartbeat-ms (a lease survives one lost heartbeat)"
        );
    }
    let http = HttpConfig {
        max_connections: args.max_connections,
        header_read_timeout_ms: args.header_read_timeout_ms,
        body_read_timeout_ms: args.body_read_timeout_ms,
    };
    http.validate()?;
    args.nats_auth.validate()?;
    if !(1..=5).contains(&args.registry_replicas) {
        bail!("--registry-replicas must be 1..=5 (JetStream's limit)");
    }
    if args.dry_run {
        println!("{}", serde_json::to_string_pretty(&args)?);
        return Ok(());
    }
    kvroute::process::init_logging(args.log_format);
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
    let transport = Transport::connect_nats(&args.nats, "kvroute-worker", &args.nats_auth).await?;
    let client = transport.nats_client().context("NATS transport")?.clone();
    let registry = Registry::nats(client, &args.cluster, &lease, args.registry_replicas).await?;
    let id = match (args.id, host_name()) {
        (Some(id), _) => WorkerId(id),
        (None, Some(host)) if args.port != 0 => stable_id(&host, args.port),
        _ => WorkerId(new_epoch() & 0xffff_ffff_ffff),
    };
    let config = ServerConfig {
        id,
        listen: SocketAddr::new(args.host, args.port),
        url: args.url,
        cluster: args.cluster,
        model: args.model,
        engine,
        lease,
        epoch: new_epoch(),
        metrics: kvroute::process::install_metrics(),
        tokenizer: std::sync::Arc::new(match &args.tokenizer {
            Some(path) => kvroute::ingress::tokenizer::Tokenizer::load(path)?,
            None => kvroute::ingress::tokenizer::Tokenizer::Bytes,
        }),
        http,
        fault_injection: args.fault_injection,
    };
    let worker = Worker::start(config, transport, registry).await?;
    tracing::info!(%id, addr = %worker.addr, "worker serving");
    println!("kvroute-worker {id} listening on http://{}", worker.addr);
    let mut failed = worker.failed();
    tokio::select! {
        _ = kvroute::process::terminated() => {
            tracing::info!(active = worker.active(), "terminating: deregistered, draining");
            let left = worker.shutdown(Duration::from_millis(args.drain_timeout_ms)).await;
            if left > 0 {
                tracing::warn!(left, "drain timeout: requests still running are cut off");
            }
            Ok(())
        }
        reason = failed.wait_for(Option::is_some) => {
            let reason = reason.ok().and_then(|r| r.clone()).unwrap_or_default();
            // Never a registered zombie: leave the fleet, then fail loudly.
            worker.stop().await;
            bail!("engine failed: {reason}")
        }
    }
}
