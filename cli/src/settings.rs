//! The router's settings: flags, `KVROUTE_*` variables and a TOML file (`--config`), in that
//! order of precedence, over the defaults of the library's configs.
//!
//! One struct, [`ServeFlags`], is both the clap flag set and the file's schema, so a setting
//! cannot exist in one and not the other; [`resolve`] merges a command line over a file and
//! validates the result into [`Settings`], which `--dry-run` prints.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use kvroute::ingress::IngressConfig;
use kvroute::scheduler::{self, PolicyKind};
use serde::{Deserialize, Serialize};

/// Flags of `kvroute serve`.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// TOML file with any of the settings below, keys spelled as the flags in snake_case
    /// (`max_inflight = 512`); flags and KVROUTE_* variables override it.
    #[arg(long, env = "KVROUTE_CONFIG")]
    pub config: Option<PathBuf>,
    /// Check flags, variables and --config, print the resolved settings as JSON, and exit.
    #[arg(long)]
    pub dry_run: bool,
    #[command(flatten)]
    pub flags: ServeFlags,
}

/// Every router setting, optional: as flags (and variables) and as the `--config` file.
#[derive(clap::Args, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeFlags {
    /// NATS server URL [default: nats://127.0.0.1:4222].
    #[arg(long, env = "KVROUTE_NATS")]
    pub nats: Option<String>,
    /// HTTP port [default: 8080].
    #[arg(long, env = "KVROUTE_PORT")]
    pub port: Option<u16>,
    /// Address to listen on [default: 0.0.0.0].
    #[arg(long, env = "KVROUTE_HOST")]
    pub host: Option<IpAddr>,
    /// Cluster name in NATS subjects and the registry bucket [default: default].
    #[arg(long, env = "KVROUTE_CLUSTER")]
    pub cluster: Option<String>,
    /// Routing policy: kv, round_robin, random, least_loaded, approx_prefix [default: kv].
    #[arg(long, env = "KVROUTE_POLICY")]
    pub policy: Option<String>,
    /// Weight of uncached prefill blocks against load [default: 8].
    #[arg(long, env = "KVROUTE_PREFILL_SCALE")]
    pub prefill_scale: Option<f64>,
    /// Weight of blocks held by running decodes [default: 0.1].
    #[arg(long, env = "KVROUTE_DECODE_WEIGHT")]
    pub decode_weight: Option<f64>,
    /// Softmax temperature over costs; 0 picks the cheapest [default: 0].
    #[arg(long, env = "KVROUTE_TEMPERATURE")]
    pub temperature: Option<f64>,
    /// This replica's id when several routers share load [default: random].
    #[arg(long, env = "KVROUTE_REPLICA_ID")]
    pub replica_id: Option<u64>,
    /// A worker silent for this long is dropped, ms [default: 5000].
    #[arg(long, env = "KVROUTE_LEASE_TTL_MS")]
    pub lease_ttl_ms: Option<u64>,
    /// Requests in flight beyond which new ones get 429 [default: 4096].
    #[arg(long, env = "KVROUTE_MAX_INFLIGHT")]
    pub max_inflight: Option<usize>,
    /// Largest request body, bytes (413 beyond) [default: 8388608].
    #[arg(long, env = "KVROUTE_MAX_BODY_BYTES")]
    pub max_body_bytes: Option<usize>,
    /// Other workers tried when one fails before its first byte [default: 2].
    #[arg(long, env = "KVROUTE_RETRIES")]
    pub retries: Option<usize>,
    /// How long a worker may take to answer with headers, ms [default: 10000].
    #[arg(long, env = "KVROUTE_WORKER_TIMEOUT_MS")]
    pub worker_timeout_ms: Option<u64>,
    /// On SIGTERM: /ready fails, no new connections, and requests in flight get this long
    /// to finish, ms [default: 30000].
    #[arg(long, env = "KVROUTE_DRAIN_TIMEOUT_MS")]
    pub drain_timeout_ms: Option<u64>,
    /// Hugging Face `tokenizer.json` (its `tokenizer_config.json` beside it supplies the chat
    /// template) [default: one token per UTF-8 byte].
    #[arg(long, env = "KVROUTE_TOKENIZER")]
    pub tokenizer: Option<PathBuf>,
}

/// The router's resolved settings.
#[derive(Clone, Debug, Serialize)]
pub struct Settings {
    /// NATS server URL.
    pub nats: String,
    /// HTTP port.
    pub port: u16,
    /// Listen address.
    pub host: IpAddr,
    /// Cluster name.
    pub cluster: String,
    /// Scheduler: policy, weights, replica id.
    pub scheduler: scheduler::Config,
    /// Worker lease TTL, ms.
    pub lease_ttl_ms: u64,
    /// HTTP front door limits.
    pub ingress: IngressConfig,
    /// Drain budget on SIGTERM, ms.
    pub drain_timeout_ms: u64,
    /// Tokenizer file; `None`: bytes.
    pub tokenizer: Option<PathBuf>,
}

/// Reads a `--config` file.
pub fn read_file(path: &Path) -> anyhow::Result<ServeFlags> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--config {}: cannot read", path.display()))?;
    parse_file(&text).with_context(|| format!("--config {}", path.display()))
}

/// Parses the TOML of a `--config` file (unknown keys and wrong types are errors).
pub fn parse_file(text: &str) -> anyhow::Result<ServeFlags> {
    toml::from_str(text).map_err(|e| {
        // One line, naming the line and its text (so the key), then what is wrong.
        let Some(span) = e.span() else {
            return anyhow::anyhow!("{}", e.message());
        };
        let line = text[..span.start.min(text.len())].matches('\n').count();
        let source = text.lines().nth(line).unwrap_or("").trim();
        anyhow::anyhow!("line {} `{source}`: {}", line + 1, e.message())
    })
}

/// `flags` over `file` over the defaults, validated.
pub fn resolve(flags: ServeFlags, file: ServeFlags) -> anyhow::Result<Settings> {
    let policy_name = flags.policy.or(file.policy).unwrap_or_else(|| "kv".into());
    let Some(policy) = PolicyKind::parse(&policy_name) else {
        let known: Vec<&str> = PolicyKind::ALL.iter().map(|k| k.name()).collect();
        bail!("policy {policy_name:?} is not one of {}", known.join(", "));
    };
    let defaults = scheduler::Config::default();
    let scheduler = scheduler::Config {
        policy,
        prefill_scale: flags
            .prefill_scale
            .or(file.prefill_scale)
            .unwrap_or(defaults.prefill_scale),
        decode_weight: flags
            .decode_weight
            .or(file.decode_weight)
            .unwrap_or(defaults.decode_weight),
        temperature: flags
            .temperature
            .or(file.temperature)
            .unwrap_or(defaults.temperature),
        replica_id: flags
            .replica_id
            .or(file.replica_id)
            .unwrap_or_else(random_replica_id),
        ..defaults
    };
    scheduler.validate()?;
    let d = IngressConfig::default();
    let ingress = IngressConfig {
        max_inflight: flags
            .max_inflight
            .or(file.max_inflight)
            .unwrap_or(d.max_inflight),
        max_body_bytes: flags
            .max_body_bytes
            .or(file.max_body_bytes)
            .unwrap_or(d.max_body_bytes),
        retries: flags.retries.or(file.retries).unwrap_or(d.retries),
        worker_timeout_ms: flags
            .worker_timeout_ms
            .or(file.worker_timeout_ms)
            .unwrap_or(d.worker_timeout_ms),
    };
    if ingress.max_inflight == 0 {
        bail!("max_inflight must be at least 1");
    }
    if ingress.max_body_bytes < 1024 {
        bail!("max_body_bytes must be at least 1024");
    }
    let lease_ttl_ms = flags.lease_ttl_ms.or(file.lease_ttl_ms).unwrap_or(5_000);
    if lease_ttl_ms < 1_000 {
        bail!("lease_ttl_ms must be at least 1000 (workers heartbeat every second)");
    }
    let nats = flags
        .nats
        .or(file.nats)
        .unwrap_or_else(|| "nats://127.0.0.1:4222".into());
    if !nats.contains("://") && nats.contains(char::is_whitespace) {
        bail!("nats {nats:?} is not a URL");
    }
    let cluster = flags
        .cluster
        .or(file.cluster)
        .unwrap_or_else(|| "default".into());
    if cluster.is_empty()
        || !cluster
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        bail!("cluster {cluster:?}: use letters, digits, '-' and '_' (it names NATS subjects)");
    }
    Ok(Settings {
        nats,
        port: flags.port.or(file.port).unwrap_or(8080),
        host: flags
            .host
            .or(file.host)
            .unwrap_or(IpAddr::from([0, 0, 0, 0])),
        cluster,
        scheduler,
        lease_ttl_ms,
        ingress,
        drain_timeout_ms: flags
            .drain_timeout_ms
            .or(file.drain_timeout_ms)
            .unwrap_or(30_000),
        tokenizer: flags.tokenizer.or(file.tokenizer),
    })
}

fn random_replica_id() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_override_the_file_which_overrides_defaults() {
        let file =
            parse_file("port = 9100\npolicy = \"least_loaded\"\nmax_inflight = 7\n").unwrap();
        let flags = ServeFlags {
            port: Some(9200),
            ..ServeFlags::default()
        };
        let s = resolve(flags, file).unwrap();
        assert_eq!(s.port, 9200);
        assert_eq!(s.scheduler.policy, PolicyKind::LeastLoaded);
        assert_eq!(s.ingress.max_inflight, 7);
        assert_eq!(s.ingress.retries, IngressConfig::default().retries);
        assert_eq!(s.cluster, "default");
    }

    #[test]
    fn file_errors_name_the_key() {
        let unknown = parse_file("max_in_flight = 3\n").unwrap_err().to_string();
        assert!(unknown.contains("max_in_flight"), "{unknown}");
        let wrong = parse_file("port = \"eighty\"\n").unwrap_err().to_string();
        assert!(wrong.contains("port"), "{wrong}");
        assert!(parse_file("port = 70000\n").is_err());
    }

    #[test]
    fn invalid_values_are_rejected() {
        let bad = |toml: &str| resolve(ServeFlags::default(), parse_file(toml).unwrap());
        assert!(
            bad("policy = \"fastest\"")
                .unwrap_err()
                .to_string()
                .contains("fastest")
        );
        assert!(bad("prefill_scale = -1.0").is_err());
        assert!(bad("max_inflight = 0").is_err());
        assert!(bad("cluster = \"a.b\"").is_err());
        assert!(bad("lease_ttl_ms = 10").is_err());
        assert!(bad("").is_ok());
    }
}
