//! The `kvroute` command line: the router and operator tools.
#![forbid(unsafe_code)]

use std::io::Read;
use std::num::NonZeroUsize;
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use kvroute::protocol::{Salt, hash_blocks};

/// KV-aware request router for LLM inference fleets.
#[derive(Parser)]
#[command(name = "kvroute", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the router: OpenAI API on --port, KV events and workers from NATS.
    Serve(ServeArgs),
    /// Print the block hashes of a token sequence, as workers and the router compute them
    /// (debug "why is my overlap zero").
    Hash(HashArgs),
}

#[derive(clap::Args)]
struct ServeArgs {
    /// NATS server URL.
    #[arg(long, env = "KVROUTE_NATS", default_value = "nats://127.0.0.1:4222")]
    nats: String,
    /// HTTP port.
    #[arg(long, env = "KVROUTE_PORT", default_value_t = 8080)]
    port: u16,
    /// Address to listen on.
    #[arg(long, env = "KVROUTE_HOST", default_value = "0.0.0.0")]
    host: std::net::IpAddr,
    /// Cluster name (NATS subjects and registry bucket).
    #[arg(long, env = "KVROUTE_CLUSTER", default_value = "default")]
    cluster: String,
    /// Routing policy: kv, round_robin, random, least_loaded, approx_prefix.
    #[arg(long, env = "KVROUTE_POLICY", default_value = "kv")]
    policy: String,
    /// Weight of uncached prefill (scheduler.prefill_scale).
    #[arg(long, env = "KVROUTE_PREFILL_SCALE")]
    prefill_scale: Option<f64>,
    /// Weight of held decode blocks (scheduler.decode_weight).
    #[arg(long, env = "KVROUTE_DECODE_WEIGHT")]
    decode_weight: Option<f64>,
    /// Softmax temperature over costs; 0 picks the cheapest.
    #[arg(long, env = "KVROUTE_TEMPERATURE")]
    temperature: Option<f64>,
    /// This replica's id when several routers share load (default: random).
    #[arg(long, env = "KVROUTE_REPLICA_ID")]
    replica_id: Option<u64>,
    /// Worker lease TTL, ms.
    #[arg(long, env = "KVROUTE_LEASE_TTL_MS", default_value_t = 5_000)]
    lease_ttl_ms: u64,
    /// Requests in flight beyond which new ones get 429.
    #[arg(long, env = "KVROUTE_MAX_INFLIGHT", default_value_t = 4096)]
    max_inflight: usize,
    /// Hugging Face `tokenizer.json` (its `tokenizer_config.json` beside it supplies the chat
    /// template). Without it, one token per UTF-8 byte.
    #[arg(long, env = "KVROUTE_TOKENIZER")]
    tokenizer: Option<std::path::PathBuf>,
}

#[derive(clap::Args)]
struct HashArgs {
    /// Token ids, comma-separated. Without it, a JSON array of token ids is read from stdin.
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    tokens: Option<Vec<String>>,
    /// Tokens per KV block; must match the workers' block size.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Cache namespace mixed into the root hash (LoRA adapter, tenant); 0 = none.
    #[arg(long, default_value_t = 0)]
    salt: u64,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Hash(args) => run_hash(&args),
        Command::Serve(args) => run_serve(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("kvroute: {err:#}");
            ExitCode::from(2)
        }
    }
}

fn run_serve(args: ServeArgs) -> anyhow::Result<()> {
    use std::sync::Arc;

    use kvroute::discovery::{LeaseConfig, Registry};
    use kvroute::events::load::{LoadShare, LoadShareConfig};
    use kvroute::events::plane::{EventPlane, PlaneConfig};
    use kvroute::events::transport::Transport;
    use kvroute::indexer::{self, Indexer};
    use kvroute::ingress::{IngressConfig, Router, serve};
    use kvroute::scheduler::{self, PolicyKind, Scheduler};

    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let policy = PolicyKind::parse(&args.policy)
        .with_context(|| format!("unknown --policy {:?}", args.policy))?;
    let defaults = scheduler::Config::default();
    let scheduler_config = scheduler::Config {
        policy,
        prefill_scale: args.prefill_scale.unwrap_or(defaults.prefill_scale),
        decode_weight: args.decode_weight.unwrap_or(defaults.decode_weight),
        temperature: args.temperature.unwrap_or(defaults.temperature),
        replica_id: args.replica_id.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos() as u64
        }),
        ..defaults
    };
    let tokenizer = match &args.tokenizer {
        Some(path) => kvroute::ingress::tokenizer::Tokenizer::load(path)?,
        None => kvroute::ingress::tokenizer::Tokenizer::Bytes,
    };
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async move {
        let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
            .install_recorder()
            .ok();
        let transport = Transport::connect_nats(&args.nats, "kvroute-router").await?;
        let client = transport.nats_client().context("NATS transport")?.clone();
        let lease = LeaseConfig {
            ttl_ms: args.lease_ttl_ms,
            ..LeaseConfig::default()
        };
        let registry = Registry::nats(client, &args.cluster, &lease).await?;
        let (shutdown, shutdown_rx) = tokio::sync::watch::channel(false);
        let indexer = Arc::new(Indexer::new(indexer::Config::default())?);
        let plane_config = PlaneConfig {
            cluster: args.cluster.clone(),
            ..PlaneConfig::default()
        };
        let plane = EventPlane::start(
            transport.clone(),
            indexer,
            registry.watch(lease),
            plane_config,
            shutdown_rx.clone(),
        )
        .await?;
        let scheduler = Arc::new(parking_lot::Mutex::new(Scheduler::new(scheduler_config)?));
        let load = LoadShare::start(
            transport,
            &args.cluster,
            Arc::clone(&scheduler),
            LoadShareConfig::default(),
            shutdown_rx.clone(),
        )
        .await?;
        let ingress = IngressConfig {
            max_inflight: args.max_inflight,
            ..IngressConfig::default()
        };
        let router = Router::new(scheduler, plane, Some(load), ingress, metrics, tokenizer);
        let listener = tokio::net::TcpListener::bind((args.host, args.port)).await?;
        let addr = listener.local_addr()?;
        println!("kvroute serving on http://{addr}");
        tracing::info!(%addr, nats = %args.nats, "router serving");
        tokio::select! {
            _ = serve(router, listener, shutdown_rx) => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        let _ = shutdown.send(true);
        Ok::<(), anyhow::Error>(())
    })
}

fn run_hash(args: &HashArgs) -> anyhow::Result<()> {
    let stdin = match args.tokens {
        Some(_) => String::new(),
        None => {
            let mut input = String::new();
            std::io::stdin()
                .read_to_string(&mut input)
                .context("reading stdin")?;
            input
        }
    };
    println!("{}", hash_report(args, &stdin)?);
    Ok(())
}

/// The JSON array `kvroute hash` prints: one object per full block, hashes as decimal strings
/// (u64 does not survive JSON numbers in most tools).
fn hash_report(args: &HashArgs, stdin: &str) -> anyhow::Result<String> {
    let Some(block_size) = NonZeroUsize::new(args.block_size) else {
        bail!("--block-size must be at least 1");
    };
    let tokens = match &args.tokens {
        Some(list) => list
            .iter()
            .map(|t| {
                t.trim()
                    .parse::<u32>()
                    .with_context(|| format!("token {t:?} is not a u32"))
            })
            .collect::<anyhow::Result<Vec<u32>>>()?,
        None => serde_json::from_str::<Vec<u32>>(stdin)
            .context("stdin must be a JSON array of token ids (integers 0..=4294967295)")?,
    };
    let lines: Vec<String> = hash_blocks(&tokens, block_size, Salt(args.salt))
        .iter()
        .enumerate()
        .map(|(index, b)| {
            serde_json::json!({"index": index, "local": b.local.0.to_string(), "seq": b.seq.0.to_string()})
                .to_string()
        })
        .collect();
    Ok(if lines.is_empty() {
        "[]".to_owned()
    } else {
        format!("[\n{}\n]", lines.join(",\n"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(tokens: Option<&str>, block_size: usize, salt: u64) -> HashArgs {
        HashArgs {
            tokens: tokens.map(|t| t.split(',').map(str::to_owned).collect()),
            block_size,
            salt,
        }
    }

    #[test]
    fn hash_report_prints_one_object_per_full_block() {
        let out = hash_report(&args(Some("1,2,3,4,5"), 2, 0), "").unwrap();
        let parsed: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
        assert_eq!(parsed.len(), 2);
        let want = hash_blocks(&[1, 2, 3, 4], NonZeroUsize::new(2).unwrap(), Salt::NONE);
        assert_eq!(parsed[1]["index"], 1);
        assert_eq!(parsed[1]["local"], want[1].local.0.to_string());
        assert_eq!(parsed[1]["seq"], want[1].seq.0.to_string());
    }

    #[test]
    fn hash_report_reads_stdin_json_and_salt() {
        let from_flag = hash_report(&args(Some("7,8,9"), 1, 5), "").unwrap();
        let from_stdin = hash_report(&args(None, 1, 5), "[7, 8, 9]").unwrap();
        assert_eq!(from_flag, from_stdin);
        assert_eq!(hash_report(&args(None, 4, 0), "[1,2]").unwrap(), "[]");
    }

    #[test]
    fn hash_report_rejects_bad_input() {
        assert!(hash_report(&args(Some("1,x"), 2, 0), "").is_err());
        assert!(hash_report(&args(None, 2, 0), "[1, -3]").is_err());
        assert!(hash_report(&args(None, 2, 0), "[4294967296]").is_err());
        assert!(hash_report(&args(None, 2, 0), "not json").is_err());
        assert!(hash_report(&args(Some("1"), 0, 0), "").is_err());
    }
}
