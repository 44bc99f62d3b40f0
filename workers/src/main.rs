//! `kvroute-worker`: a worker process serving generate requests from its engine and
//! publishing its KV events to the router over NATS.
#![forbid(unsafe_code)]

use std::net::{IpAddr, SocketAddr};

use anyhow::{Context, bail};
use clap::Parser;
use kvroute::discovery::{LeaseConfig, Registry};
use kvroute::events::transport::Transport;
use kvroute::protocol::WorkerId;
use kvroute_worker::server::{ServerConfig, Worker, new_epoch};
use kvroute_worker::{Device, EngineConfig};

/// A kvroute worker: continuous-batching engine (timing model, no model weights), HTTP
/// generate endpoint, KV events over NATS.
#[derive(Parser, Debug, serde::Serialize)]
#[command(name = "kvroute-worker", version, about)]
struct Args {
    /// NATS server URL.
    #[arg(long, env = "KVROUTE_NATS", default_value = "nats://127.0.0.1:4222")]
    nats: String,
    /// HTTP port (0: any free port).
    #[arg(long, env = "KVROUTE_PORT", default_value_t = 9000)]
    port: u16,
    /// Address to listen on.
    #[arg(long, env = "KVROUTE_HOST", default_value = "127.0.0.1")]
    host: IpAddr,
    /// Worker id (default: random).
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
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
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
    if args.dry_run {
        println!("{}", serde_json::to_string_pretty(&args)?);
        return Ok(());
    }
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
    let transport = Transport::connect_nats(&args.nats, "kvroute-worker").await?;
    let client = transport.nats_client().context("NATS transport")?.clone();
    let registry = Registry::nats(client, &args.cluster, &lease).await?;
    let id = WorkerId(args.id.unwrap_or_else(|| new_epoch() & 0xffff_ffff_ffff));
    let config = ServerConfig {
        id,
        listen: SocketAddr::new(args.host, args.port),
        url: args.url,
        cluster: args.cluster,
        model: args.model,
        engine,
        lease,
        epoch: new_epoch(),
        metrics: metrics_exporter_prometheus::PrometheusBuilder::new()
            .install_recorder()
            .ok(),
        tokenizer: std::sync::Arc::new(match &args.tokenizer {
            Some(path) => kvroute::ingress::tokenizer::Tokenizer::load(path)?,
            None => kvroute::ingress::tokenizer::Tokenizer::Bytes,
        }),
    };
    let worker = Worker::start(config, transport, registry).await?;
    tracing::info!(%id, addr = %worker.addr, "worker serving");
    println!("kvroute-worker {id} listening on http://{}", worker.addr);
    tokio::signal::ctrl_c().await?;
    worker.stop().await;
    Ok(())
}
