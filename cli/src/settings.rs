//! The router's settings: flags, `KVROUTE_*` variables and a TOML file (`--config`), in that
//! order of precedence, over the defaults of the library's configs.
//!
//! One struct, [`ServeFlags`], is both the clap flag set and the file's schema, so a setting
//! cannot exist in one and not the other; [`resolve`] merges a command line over a file and
//! validates the result into [`Settings`], which `--dry-run` prints.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use kvroute::auth::{NatsAuth, Secret};
use kvroute::http::HttpConfig;
use kvroute::ingress::IngressConfig;
use kvroute::ingress::tokenizer::ContentFormatOption;
use kvroute::process::LogFormat;
use kvroute::scheduler::{self, PolicyKind};
use serde::{Deserialize, Serialize};

/// Flags of `kvroute serve`.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// TOML file with any of the settings below, keys spelled as the flags in snake_case
    /// (`max_inflight = 512`); flags and KVROUTE_* variables override it.
    #[arg(long, env = "KVROUTE_CONFIG")]
    pub config: Option<PathBuf>,
    /// Check flags, variables and --config, print the resolved settings as JSON (secrets
    /// redacted), and exit.
    #[arg(long)]
    pub dry_run: bool,
    /// Every setting.
    #[command(flatten)]
    pub flags: ServeFlags,
}

/// A JSON object given as a flag (JSON text) or in the config file (a table, or JSON text).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct JsonObject(pub serde_json::Map<String, serde_json::Value>);

impl std::str::FromStr for JsonObject {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match serde_json::from_str(s) {
            Ok(serde_json::Value::Object(map)) => Ok(JsonObject(map)),
            Ok(_) => Err(format!("{s:?} is not a JSON object")),
            Err(e) => Err(format!("{s:?} is not JSON: {e}")),
        }
    }
}

impl<'de> Deserialize<'de> for JsonObject {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Form {
            Text(String),
            Table(serde_json::Map<String, serde_json::Value>),
        }
        match Form::deserialize(d)? {
            Form::Text(text) => text.parse().map_err(serde::de::Error::custom),
            Form::Table(map) => Ok(JsonObject(map)),
        }
    }
}

/// Every router setting, optional: as flags (and variables) and as the `--config` file.
#[derive(clap::Args, Debug, Default, Deserialize)]
pub struct ServeFlags {
    /// NATS server URL; several servers of one cluster comma-separated
    /// [default: nats://127.0.0.1:4222].
    #[arg(long, env = "KVROUTE_NATS", hide_env_values = true)]
    pub nats: Option<String>,
    /// NATS credentials and TLS.
    #[command(flatten)]
    #[serde(flatten)]
    pub nats_auth: NatsAuth,
    /// Copies of the worker registry kept by a JetStream cluster (fewer if it has fewer
    /// servers) [default: 3].
    #[arg(long, env = "KVROUTE_REGISTRY_REPLICAS")]
    pub registry_replicas: Option<usize>,
    /// HTTP port of the OpenAI API, health and metrics [default: 8080].
    #[arg(long, env = "KVROUTE_PORT")]
    pub port: Option<u16>,
    /// Address to listen on [default: 0.0.0.0].
    #[arg(long, env = "KVROUTE_HOST")]
    pub host: Option<IpAddr>,
    /// Port of the admin listener (/admin/workers, /admin/explain, /admin/index; 0: any
    /// free port) [default: 8081].
    #[arg(long, env = "KVROUTE_ADMIN_PORT")]
    pub admin_port: Option<u16>,
    /// Address of the admin listener; keep it private, or set an admin token
    /// [default: 127.0.0.1].
    #[arg(long, env = "KVROUTE_ADMIN_HOST")]
    pub admin_host: Option<IpAddr>,
    /// Port of the status listener: `/health`, `/ready` and `/metrics`, open, on their own
    /// connection cap, so that probes and scrapes still get through when the API port's
    /// connections are all taken (0: any free port) [default: none, they are on the API
    /// port only].
    #[arg(long, env = "KVROUTE_STATUS_PORT")]
    pub status_port: Option<u16>,
    /// Address of the status listener [default: 0.0.0.0].
    #[arg(long, env = "KVROUTE_STATUS_HOST")]
    pub status_host: Option<IpAddr>,
    /// Bearer token the admin listener requires [default: none].
    #[arg(long, env = "KVROUTE_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<Secret>,
    /// API keys the OpenAI endpoints accept as `Authorization: Bearer KEY`, comma-separated
    /// [default: none, the endpoints are open].
    #[arg(
        long,
        env = "KVROUTE_API_KEYS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub api_keys: Option<Vec<Secret>>,
    /// Key sent as `Authorization: Bearer` to workers (vLLM, SGLang and kvroute workers
    /// started with `--api-key`) and used by direct mode's bridges.
    #[arg(long, env = "KVROUTE_ENGINE_API_KEY", hide_env_values = true)]
    pub engine_api_key: Option<Secret>,
    /// File of API keys, one per line (added to --api-keys), re-read every 2 s: a key revoked
    /// or added there takes effect without a restart.
    #[arg(long, env = "KVROUTE_API_KEYS_FILE")]
    pub api_keys_file: Option<PathBuf>,
    /// Cluster name in NATS subjects and the registry bucket [default: default].
    #[arg(long, env = "KVROUTE_CLUSTER")]
    pub cluster: Option<String>,
    /// Routing policy: kv, round_robin, round_robin_skip_busy, random, least_loaded, approx_prefix [default: kv].
    #[arg(long, env = "KVROUTE_POLICY")]
    pub policy: Option<String>,
    /// Weight of uncached prefill blocks against load, finite, >= 0 [default: 8].
    #[arg(long, env = "KVROUTE_PREFILL_SCALE")]
    pub prefill_scale: Option<f64>,
    /// Weight of blocks held by running decodes, finite, >= 0 [default: 0.1].
    #[arg(long, env = "KVROUTE_DECODE_WEIGHT")]
    pub decode_weight: Option<f64>,
    /// Softmax temperature over costs, scaled to 0..1 over their spread (as Dynamo's); 0
    /// picks the cheapest [default: 0].
    #[arg(long, env = "KVROUTE_TEMPERATURE")]
    pub temperature: Option<f64>,
    /// This replica's id when several routers share load [default: random].
    #[arg(long, env = "KVROUTE_REPLICA_ID")]
    pub replica_id: Option<u64>,
    /// A worker silent for this long is dropped, ms, 1000..=3600000 [default: 5000].
    #[arg(long, env = "KVROUTE_LEASE_TTL_MS")]
    pub lease_ttl_ms: Option<u64>,
    /// Requests accepted at once, queued or in flight; beyond it new ones get 429
    /// [default: 4096].
    #[arg(long, env = "KVROUTE_MAX_INFLIGHT")]
    pub max_inflight: Option<usize>,
    /// Booked work one worker may hold (uncached prefill plus expected decode), tokens;
    /// requests that fit no worker wait in the queue; 0: no budget [default: 262144].
    #[arg(long, env = "KVROUTE_WORKER_BUDGET_TOKENS")]
    pub worker_budget_tokens: Option<u64>,
    /// Booked work the whole fleet may hold, tokens; 0: only the workers' budgets
    /// [default: 0].
    #[arg(long, env = "KVROUTE_FLEET_BUDGET_TOKENS")]
    pub fleet_budget_tokens: Option<u64>,
    /// A request's expected decode is its max_tokens, at most this [default: 1024].
    #[arg(long, env = "KVROUTE_DECODE_CAP_TOKENS")]
    pub decode_cap_tokens: Option<u32>,
    /// Requests one priority band may hold waiting (429 beyond) [default: 5000].
    #[arg(long, env = "KVROUTE_QUEUE_MAX")]
    pub queue_max: Option<usize>,
    /// Longest a request waits for room before 429 + Retry-After, ms [default: 60000].
    #[arg(long, env = "KVROUTE_QUEUE_TTL_MS")]
    pub queue_ttl_ms: Option<u64>,
    /// Limits of single bands, `BAND=MAX_QUEUED:TTL_MS[:BUDGET_SHARE]`, semicolon-separated
    /// (`1=200:5000;-1=20000:300000:0.5`: band −1 may fill half of each worker's budget)
    /// [default: none, every band as --queue-max/--queue-ttl-ms, the whole budget].
    /// (A value may start with `-`: the best-effort bands are negative.)
    #[arg(
        long,
        env = "KVROUTE_BAND_LIMITS",
        value_delimiter = ';',
        allow_hyphen_values = true
    )]
    pub band_limits: Option<Vec<String>>,
    /// A session with no turn for this long is forgotten, ms [default: 1800000].
    #[arg(long, env = "KVROUTE_SESSION_TTL_MS")]
    pub session_ttl_ms: Option<u64>,
    /// A new session's cost per live session its worker would hold beyond the least-held
    /// worker, blocks [default: 64].
    #[arg(long, env = "KVROUTE_SESSION_SPREAD")]
    pub session_spread: Option<f64>,
    /// A worker that fails this many requests in a row (no connection, no headers in time,
    /// an error status of its own) sits out; 0 never [default: 3].
    #[arg(long, env = "KVROUTE_EJECT_AFTER_FAILURES")]
    pub eject_after_failures: Option<u32>,
    /// How long an unreachable worker first sits out, ms; doubling at each further
    /// failure [default: 5000].
    #[arg(long, env = "KVROUTE_EJECT_MS")]
    pub eject_ms: Option<u64>,
    /// The longest an unreachable worker sits out, ms [default: 60000].
    #[arg(long, env = "KVROUTE_EJECT_MAX_MS")]
    pub eject_max_ms: Option<u64>,
    /// Most of a model's workers that sit out at once, percent (at least one may): a load
    /// spike's timeouts do not eject them one after another [default: 50].
    #[arg(long, env = "KVROUTE_EJECT_MAX_PERCENT")]
    pub eject_max_percent: Option<u32>,
    /// Answer with the routing headers (x-kvroute-worker, -overlap, -cached-blocks,
    /// -reachable-blocks, receipts): they tell clients what the fleet caches, so leave them off
    /// where tenants share it [default: false; `kvroute up`: true].
    #[arg(long, env = "KVROUTE_ROUTE_HEADERS", num_args = 0..=1, default_missing_value = "true")]
    pub route_headers: Option<bool>,
    /// Request header naming the tenant (else the API key's) [default: x-kvroute-tenant].
    #[arg(long, env = "KVROUTE_TENANT_HEADER")]
    pub tenant_header: Option<String>,
    /// Honour the tenant header on requests that carry an API key (behind a gateway that
    /// sets it). Otherwise a key's requests are its tenant (`key-` and 12 hex digits of
    /// the key's SHA-256), whatever they claim:
    /// a client naming a new tenant per request would take the others' fair share
    /// [default: false].
    #[arg(long, env = "KVROUTE_TRUST_TENANT_HEADER", num_args = 0..=1, default_missing_value = "true")]
    pub trust_tenant_header: Option<bool>,
    /// Honour bands above 0 asked for by requests that carry an API key (the priority
    /// header, the body's `priority` or `service_tier`; behind a gateway that sets them).
    /// Otherwise such a request may lower its band, not raise it above 0 [default: false].
    #[arg(long, env = "KVROUTE_TRUST_PRIORITY", num_args = 0..=1, default_missing_value = "true")]
    pub trust_priority: Option<bool>,
    /// Request header naming the priority band, an integer, higher first
    /// [default: x-kvroute-priority].
    #[arg(long, env = "KVROUTE_PRIORITY_HEADER")]
    pub priority_header: Option<String>,
    /// Request header naming the session [default: x-kvroute-session].
    #[arg(long, env = "KVROUTE_SESSION_HEADER")]
    pub session_header: Option<String>,
    /// Request header asking for hard affinity (`hard`) [default: x-kvroute-affinity].
    #[arg(long, env = "KVROUTE_AFFINITY_HEADER")]
    pub affinity_header: Option<String>,
    /// Request header asking for the decision's receipt [default: x-kvroute-receipt].
    #[arg(long, env = "KVROUTE_RECEIPT_HEADER")]
    pub receipt_header: Option<String>,
    /// Largest request body, bytes (413 beyond) [default: 8388608].
    #[arg(long, env = "KVROUTE_MAX_BODY_BYTES")]
    pub max_body_bytes: Option<usize>,
    /// Bytes of request bodies (and non-streamed answers, and a kvroute worker's generate
    /// bodies) held at once, all requests together; one that would pass it gets 429 (the
    /// parsed prompt takes about twice as much again; at least --max-body-bytes and
    /// --max-upstream-body-bytes) [default: 268435456].
    #[arg(long, env = "KVROUTE_BODY_MEMORY_BYTES")]
    pub body_memory_bytes: Option<usize>,
    /// Other workers tried when one fails before the client is answered (a stream: before
    /// its first token, within --worker-timeout-ms of its headers) [default: 2].
    #[arg(long, env = "KVROUTE_RETRIES")]
    pub retries: Option<usize>,
    /// Retries, all requests together, as a percentage of requests (a token bucket; when
    /// much of the fleet fails at once, retries stay a fraction of the load) [default: 20].
    #[arg(long, env = "KVROUTE_RETRY_BUDGET_PERCENT")]
    pub retry_budget_percent: Option<u32>,
    /// Retries allowed a second beyond --retry-budget-percent, and at most held up at once
    /// [default: 10].
    #[arg(long, env = "KVROUTE_RETRY_BUDGET_PER_S")]
    pub retry_budget_per_s: Option<u32>,
    /// How long connecting to a worker, and a stream's response headers, may take, ms
    /// [default: 10000]; also how long after them the client's headers wait for the first
    /// token (a worker failing meanwhile is retried elsewhere). A non-streamed answer has
    /// `--upstream-body-timeout-ms`.
    #[arg(long, env = "KVROUTE_WORKER_TIMEOUT_MS")]
    pub worker_timeout_ms: Option<u64>,
    /// Longest silence mid-stream between two tokens (keep-alive comments do not count),
    /// from the worker or towards the client, ms [default: 30000].
    #[arg(long, env = "KVROUTE_RELAY_IDLE_TIMEOUT_MS")]
    pub relay_idle_timeout_ms: Option<u64>,
    /// How long an idle connection to a worker is kept for the next request, ms: under the
    /// engines' keep-alive (vLLM's and SGLang's: 5 s) [default: 4000].
    #[arg(long, env = "KVROUTE_WORKER_POOL_IDLE_MS")]
    pub worker_pool_idle_ms: Option<u64>,
    /// Deadline for a whole non-streamed worker answer, headers included, ms [default:
    /// 600000].
    #[arg(long, env = "KVROUTE_UPSTREAM_BODY_TIMEOUT_MS")]
    pub upstream_body_timeout_ms: Option<u64>,
    /// Deadline for a stream's first chunk after its headers (prefill and the engine's
    /// queue), ms [default: 60000].
    #[arg(long, env = "KVROUTE_FIRST_TOKEN_TIMEOUT_MS")]
    pub first_token_timeout_ms: Option<u64>,
    /// Largest non-streamed worker answer, bytes [default: 67108864].
    #[arg(long, env = "KVROUTE_MAX_UPSTREAM_BODY_BYTES")]
    pub max_upstream_body_bytes: Option<usize>,
    /// Longest prompt text the router tokenizes, bytes (tokenizing peaks at up to 350
    /// times it); a longer prompt is routed on load alone [default: 1048576].
    #[arg(long, env = "KVROUTE_MAX_TOKENIZE_BYTES")]
    pub max_tokenize_bytes: Option<usize>,
    /// Client connections served at once [default: 10000].
    #[arg(long, env = "KVROUTE_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// A client must send a request's headers within this long (also the keep-alive idle
    /// limit), ms [default: 30000].
    #[arg(long, env = "KVROUTE_HEADER_READ_TIMEOUT_MS")]
    pub header_read_timeout_ms: Option<u64>,
    /// A client must send a request's body within this long, ms [default: 30000].
    #[arg(long, env = "KVROUTE_BODY_READ_TIMEOUT_MS")]
    pub body_read_timeout_ms: Option<u64>,
    /// A connection whose client reads nothing of its answer for this long is closed, ms
    /// [default: 30000].
    #[arg(long, env = "KVROUTE_WRITE_STALL_TIMEOUT_MS")]
    pub write_stall_timeout_ms: Option<u64>,
    /// Threads that parse and tokenize request bodies (0: one per core) [default: 0].
    #[arg(long, env = "KVROUTE_TOKENIZER_THREADS")]
    pub tokenizer_threads: Option<usize>,
    /// On SIGTERM: /ready fails, no new connections, and requests in flight get this long
    /// to finish, ms [default: 30000].
    #[arg(long, env = "KVROUTE_DRAIN_TIMEOUT_MS")]
    pub drain_timeout_ms: Option<u64>,
    /// Hugging Face `tokenizer.json` (its `tokenizer_config.json` beside it supplies the chat
    /// template) [default: one token per UTF-8 byte].
    #[arg(long, env = "KVROUTE_TOKENIZER")]
    pub tokenizer: Option<PathBuf>,
    /// A chat template file used instead of the model's: set it when the engines run with
    /// `--chat-template FILE` (vLLM, SGLang), or chats render differently here and their
    /// prefixes are never found [default: the model's, from --tokenizer's directory].
    #[arg(long, env = "KVROUTE_CHAT_TEMPLATE")]
    pub chat_template: Option<PathBuf>,
    /// How message content reaches the chat template: `auto` (as vLLM detects it: a list
    /// of parts for templates that loop over content, else a string), `string` or `openai`;
    /// set it when the engines run with `--chat-template-content-format` [default: auto].
    #[arg(long, env = "KVROUTE_CHAT_TEMPLATE_CONTENT_FORMAT")]
    pub chat_template_content_format: Option<ContentFormatOption>,
    /// Chat template variables every chat gets unless it sets them, a JSON object (in the
    /// config file a table or that JSON as a string): the engines' own
    /// `--default-chat-template-kwargs` (e.g. `{"enable_thinking": false}`), or chats render
    /// differently here [default: none].
    #[arg(long, env = "KVROUTE_DEFAULT_CHAT_TEMPLATE_KWARGS")]
    pub default_chat_template_kwargs: Option<JsonObject>,
    /// Render the chat templates requests bring (`chat_template`, or one in
    /// `chat_template_kwargs`), as vLLM does with the flag of the same name; set it with the
    /// engines'. Without it such requests are refused (400), as vLLM refuses them: a
    /// template is a program, run here on the tokenizer threads: its steps are bounded per
    /// render, its memory is not (a few string doublings take gigabytes), so trust only
    /// clients you would let run code on the router [default: false].
    #[arg(long, env = "KVROUTE_TRUST_REQUEST_CHAT_TEMPLATE", num_args = 0..=1, default_missing_value = "true")]
    pub trust_request_chat_template: Option<bool>,
    /// Render no `tools` for a chat whose `tool_choice` is `none`, as vLLM does with the flag
    /// of the same name; set it with the engines' (the tools sit in the prompt's first
    /// blocks of most templates) [default: false].
    #[arg(long, env = "KVROUTE_EXCLUDE_TOOLS_WHEN_TOOL_CHOICE_NONE", num_args = 0..=1, default_missing_value = "true")]
    pub exclude_tools_when_tool_choice_none: Option<bool>,
    /// Log lines as `text` (colour only on a terminal) or `json` [default: text].
    #[arg(long, env = "KVROUTE_LOG_FORMAT")]
    pub log_format: Option<LogFormat>,
    /// Direct mode, no NATS: route to this engine (vLLM, SGLang, any OpenAI server).
    /// `URL[,events=ZMQ_ENDPOINT[,replay=ZMQ_ENDPOINT][,topic=T][,offload_chunk=K][,max_blocks=N]][,model=M][,block_size=B][,dp=N]`;
    /// repeat for each engine. With `events` the router follows the engine's KV events
    /// itself; without, it routes on load and its own in-flight requests.
    #[arg(long = "backend", env = "KVROUTE_BACKENDS", value_delimiter = ';')]
    pub backends: Option<Vec<String>>,
}

/// The router's resolved settings.
#[derive(Clone, Debug, Serialize)]
pub struct Settings {
    /// NATS server URL(s) (credentials in them print as `<redacted>`).
    #[serde(serialize_with = "redacted_urls")]
    pub nats: String,
    /// NATS credentials and TLS.
    pub nats_auth: NatsAuth,
    /// Copies of the registry bucket wanted.
    pub registry_replicas: usize,
    /// HTTP port.
    pub port: u16,
    /// Listen address.
    pub host: IpAddr,
    /// Admin listener port.
    pub admin_port: u16,
    /// Admin listener address.
    pub admin_host: IpAddr,
    /// Status listener port (`/health`, `/ready`, `/metrics`); `None`: no status listener.
    pub status_port: Option<u16>,
    /// Status listener address.
    pub status_host: IpAddr,
    /// Cluster name.
    pub cluster: String,
    /// Scheduler: policy, weights, replica id.
    pub scheduler: scheduler::Config,
    /// Worker lease TTL, ms.
    pub lease_ttl_ms: u64,
    /// HTTP front door limits and keys.
    pub ingress: IngressConfig,
    /// Drain budget on SIGTERM, ms.
    pub drain_timeout_ms: u64,
    /// Tokenizer file; `None`: bytes.
    pub tokenizer: Option<PathBuf>,
    /// Chat template file in place of the model's.
    pub chat_template: Option<PathBuf>,
    /// How message content reaches the chat template.
    pub chat_template_content_format: ContentFormatOption,
    /// Chat template variables every chat gets unless it sets them.
    pub default_chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// Render requests' own chat templates (else refuse them).
    pub trust_request_chat_template: bool,
    /// Render no tools for a chat with `tool_choice: none`.
    pub exclude_tools_when_tool_choice_none: bool,
    /// Log format.
    pub log_format: LogFormat,
    /// Direct mode's engines (empty: workers register over NATS).
    pub backends: Vec<Backend>,
}

/// One engine of direct mode (`--backend`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Backend {
    /// Its HTTP URL.
    pub url: String,
    /// Its KV-event PUB socket.
    pub events: Option<String>,
    /// Its replay ROUTER socket.
    pub replay: Option<String>,
    /// Its event topic.
    pub topic: String,
    /// The model it serves (`None`: the first of its `/v1/models`).
    pub model: Option<String>,
    /// Tokens per KV block (vLLM's default: 16).
    pub block_size: usize,
    /// Data-parallel ranks behind the URL.
    pub dp: u32,
    /// GPU blocks per chunk of its CPU offload, when its events name a chunk by its last
    /// block only (vLLM's `blocks_per_chunk` without `self_describing_kv_events`).
    pub offload_chunk: usize,
    /// Most blocks the router's mirror of each of its ranks holds (past it, what the
    /// engine stores is not indexed).
    pub max_blocks: usize,
}

/// An engine's URL in one spelling: its host in lower case, no default port (80), no `/` at
/// the end of its path. The worker's id is a hash of it, and two spellings of one engine
/// (`http://E:8000/` and `http://e:8000`) passed the check for an engine given twice: two
/// workers behind one engine, each booked half its load, and two bridges on its one event
/// stream.
fn canonical_url(uri: &hyper::Uri) -> Option<String> {
    let authority = uri.authority()?;
    let user = match authority.as_str().rsplit_once('@') {
        Some((user, _)) => format!("{user}@"),
        None => String::new(),
    };
    let host = authority.host().to_ascii_lowercase();
    let port = match authority.port_u16() {
        Some(80) | None => String::new(),
        Some(port) => format!(":{port}"),
    };
    let path = uri.path().trim_end_matches('/');
    let query = uri.query().map(|q| format!("?{q}")).unwrap_or_default();
    Some(format!("http://{user}{host}{port}{path}{query}"))
}

/// Parses one `--backend` value.
pub fn parse_backend(spec: &str) -> anyhow::Result<Backend> {
    let mut parts = spec.split(',');
    let url = parts.next().unwrap_or("").trim().to_owned();
    if url.starts_with("https://") {
        bail!(
            "--backend {spec:?}: https is not supported (the router speaks plain HTTP to engines)"
        );
    }
    let parsed = url
        .starts_with("http://")
        .then(|| url.parse::<hyper::Uri>().ok());
    let Some(url) = parsed.flatten().and_then(|uri| canonical_url(&uri)) else {
        bail!("--backend {spec:?}: starts with the engine's http:// URL");
    };
    let mut b = Backend {
        url,
        events: None,
        replay: None,
        topic: String::new(),
        model: None,
        block_size: 16,
        dp: 1,
        offload_chunk: 1,
        max_blocks: kvroute::engines::mirror::DEFAULT_MAX_BLOCKS,
    };
    let engine_host = b
        .url
        .parse::<hyper::Uri>()
        .ok()
        .and_then(|u| u.host().map(str::to_owned));
    for part in parts {
        let (key, value) = part
            .split_once('=')
            .with_context(|| format!("--backend {spec:?}: {part:?} is not key=value"))?;
        // A count from 1 to `most`.
        let count = |key: &str, v: &str, most: usize| -> anyhow::Result<usize> {
            v.parse()
                .ok()
                .filter(|n| (1..=most).contains(n))
                .with_context(|| format!("--backend {spec:?}: {key} is 1..={most}"))
        };
        // The engine's own setting, `tcp://*:PORT` (where it binds), names the engine's
        // host: copied here it once meant this host, and a co-located engine's events were
        // credited to this one.
        let zmq = |v: &str| -> anyhow::Result<String> {
            kvroute::engines::zmtp::tcp_address(v)
                .with_context(|| format!("--backend {spec:?}"))?;
            Ok(match (v.strip_prefix("tcp://*:"), engine_host.as_deref()) {
                (Some(port), Some(host)) => format!("tcp://{host}:{port}"),
                _ => v.to_owned(),
            })
        };
        let key = key.trim();
        match key {
            "events" => b.events = Some(zmq(value)?),
            "replay" => b.replay = Some(zmq(value)?),
            "topic" => b.topic = value.to_owned(),
            "model" if !value.is_empty() => b.model = Some(value.to_owned()),
            "block_size" => b.block_size = count(key, value, 4096)?,
            "dp" => b.dp = count(key, value, 1024)? as u32,
            "offload_chunk" => b.offload_chunk = count(key, value, 4096)?,
            "max_blocks" => b.max_blocks = count(key, value, 1 << 32)?,
            other => bail!(
                "--backend {spec:?}: unknown key {other:?} (events, replay, topic, model, block_size, dp, offload_chunk, max_blocks)"
            ),
        }
    }
    if b.replay.is_some() && b.events.is_none() {
        bail!("--backend {spec:?}: replay= needs events=");
    }
    if b.offload_chunk > 1 && b.events.is_none() {
        bail!("--backend {spec:?}: offload_chunk= needs events=");
    }
    if b.max_blocks != kvroute::engines::mirror::DEFAULT_MAX_BLOCKS && b.events.is_none() {
        bail!("--backend {spec:?}: max_blocks= needs events=");
    }
    if let Some(model) = &b.model
        && !kvroute::discovery::model_name_ok(model)
    {
        bail!("--backend {spec:?}: model is 1..=256 bytes without spaces or control characters");
    }
    // Rank r of a data-parallel engine publishes on port + r (as vLLM and SGLang do).
    for endpoint in [&b.events, &b.replay].into_iter().flatten() {
        let port = endpoint
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse::<u32>().ok());
        if port.is_none_or(|p| p + b.dp - 1 > u32::from(u16::MAX)) {
            bail!(
                "--backend {spec:?}: {endpoint} offset by {} ranks is no port",
                b.dp - 1
            );
        }
    }
    Ok(b)
}

/// Parses one `--band-limits` entry, `BAND=MAX_QUEUED:TTL_MS[:BUDGET_SHARE]`.
fn parse_band_limit(spec: &str) -> anyhow::Result<(i32, scheduler::queue::BandConfig)> {
    let parsed = (|| {
        let (band, rest) = spec.split_once('=')?;
        let mut parts = rest.split(':');
        let max_queued = parts.next()?.trim().parse().ok()?;
        let ttl_ms = parts.next()?.trim().parse().ok()?;
        let budget_share = match parts.next() {
            Some(s) => s.trim().parse().ok()?,
            None => 1.0,
        };
        parts.next().is_none().then_some(())?;
        Some((
            band.trim().parse().ok()?,
            scheduler::queue::BandConfig {
                max_queued,
                ttl_ms,
                budget_share,
            },
        ))
    })();
    parsed.with_context(|| {
        format!("band limit {spec:?} is not BAND=MAX_QUEUED:TTL_MS[:BUDGET_SHARE]")
    })
}

/// The `--band-limits` entries by band; a band given twice is refused (the last would win
/// silently).
fn band_limits(
    specs: &[String],
) -> anyhow::Result<std::collections::BTreeMap<i32, scheduler::queue::BandConfig>> {
    let mut bands = std::collections::BTreeMap::new();
    for spec in specs {
        let (band, limits) = parse_band_limit(spec)?;
        if bands.insert(band, limits).is_some() {
            bail!("band_limits: band {band} is given twice");
        }
    }
    Ok(bands)
}

/// Reads a `--config` file.
pub fn read_file(path: &Path) -> anyhow::Result<ServeFlags> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--config {}: cannot read", path.display()))?;
    parse_file(&text).with_context(|| format!("--config {}", path.display()))
}

/// Parses the TOML of a `--config` file (unknown keys and wrong types are errors).
pub fn parse_file(text: &str) -> anyhow::Result<ServeFlags> {
    // One line, naming the line and its text (so the key), then what is wrong.
    let located = |offset: usize, message: &str| {
        let line = text[..offset.min(text.len())].matches('\n').count();
        let source = text.lines().nth(line).unwrap_or("").trim();
        anyhow::anyhow!("line {} `{source}`: {message}", line + 1)
    };
    let table: toml::Table = toml::from_str(text).map_err(|e| match e.span() {
        Some(span) => located(span.start, e.message()),
        None => anyhow::anyhow!("{}", e.message()),
    })?;
    // The flags are the schema: a key that names no flag is a typo.
    let command = <ServeFlags as clap::Args>::augment_args(clap::Command::new("serve"));
    let known: Vec<&str> = command
        .get_arguments()
        .map(|a| a.get_id().as_str())
        .collect();
    if let Some(key) = table.keys().find(|k| !known.contains(&k.as_str())) {
        let offset = text
            .lines()
            .scan(0, |at, line| {
                let start = *at;
                *at += line.len() + 1;
                Some((start, line))
            })
            .find(|(_, line)| line.trim_start().starts_with(key.as_str()))
            .map_or(0, |(start, _)| start);
        return Err(located(offset, &format!("unknown setting `{key}`")));
    }
    toml::from_str(text).map_err(|e| match e.span() {
        Some(span) => located(span.start, e.message()),
        None => anyhow::anyhow!("{}", e.message()),
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
        admission: scheduler::AdmissionConfig {
            worker_budget_tokens: flags
                .worker_budget_tokens
                .or(file.worker_budget_tokens)
                .unwrap_or(defaults.admission.worker_budget_tokens),
            fleet_budget_tokens: flags
                .fleet_budget_tokens
                .or(file.fleet_budget_tokens)
                .unwrap_or(defaults.admission.fleet_budget_tokens),
            decode_cap_tokens: flags
                .decode_cap_tokens
                .or(file.decode_cap_tokens)
                .unwrap_or(defaults.admission.decode_cap_tokens),
        },
        queue: scheduler::queue::QueueConfig {
            default_band: scheduler::queue::BandConfig {
                max_queued: flags
                    .queue_max
                    .or(file.queue_max)
                    .unwrap_or(defaults.queue.default_band.max_queued),
                ttl_ms: flags
                    .queue_ttl_ms
                    .or(file.queue_ttl_ms)
                    .unwrap_or(defaults.queue.default_band.ttl_ms),
                budget_share: 1.0,
            },
            bands: band_limits(&flags.band_limits.or(file.band_limits).unwrap_or_default())?,
            ..defaults.queue.clone()
        },
        sessions: scheduler::SessionConfig {
            ttl_ms: flags
                .session_ttl_ms
                .or(file.session_ttl_ms)
                .unwrap_or(defaults.sessions.ttl_ms),
            spread_weight: flags
                .session_spread
                .or(file.session_spread)
                .unwrap_or(defaults.sessions.spread_weight),
            ..defaults.sessions
        },
        ejection: scheduler::EjectionConfig {
            after_failures: flags
                .eject_after_failures
                .or(file.eject_after_failures)
                .unwrap_or(defaults.ejection.after_failures),
            base_ms: flags
                .eject_ms
                .or(file.eject_ms)
                .unwrap_or(defaults.ejection.base_ms),
            max_ms: flags
                .eject_max_ms
                .or(file.eject_max_ms)
                .unwrap_or(defaults.ejection.max_ms),
            max_ejected_percent: flags
                .eject_max_percent
                .or(file.eject_max_percent)
                .unwrap_or(defaults.ejection.max_ejected_percent),
        },
        ..defaults.clone()
    };
    scheduler.validate()?;
    let api_keys: Vec<Secret> = flags.api_keys.or(file.api_keys).unwrap_or_default();
    let api_keys_file = flags.api_keys_file.or(file.api_keys_file);
    if let Some(path) = &api_keys_file {
        // Read here to fail at start on a wrong path or a line that is no key; the router
        // reads it again, and every few seconds after (revoking a key there needs no
        // restart).
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("api_keys_file {}", path.display()))?;
        if let Some((line, why)) = kvroute::ingress::read_api_keys(&text).bad_lines.first() {
            bail!("api_keys_file {} line {line}: a key {why}", path.display());
        }
    }
    for key in &api_keys {
        // A key with a space or a control character could never be sent in a Bearer
        // header: refused at start, not a client's 401 forever.
        kvroute::auth::check_bearer_token(key.expose())
            .map_err(|e| anyhow::anyhow!("api_keys: a key {e}"))?;
    }
    if let Some(key) = &flags
        .engine_api_key
        .as_ref()
        .or(file.engine_api_key.as_ref())
    {
        kvroute::auth::check_bearer_token(key.expose())
            .map_err(|e| anyhow::anyhow!("engine_api_key {e}"))?;
    }
    let d = IngressConfig::default();
    let h = HttpConfig::default();
    let ingress = IngressConfig {
        max_inflight: flags
            .max_inflight
            .or(file.max_inflight)
            .unwrap_or(d.max_inflight),
        max_body_bytes: flags
            .max_body_bytes
            .or(file.max_body_bytes)
            .unwrap_or(d.max_body_bytes),
        body_memory_bytes: flags
            .body_memory_bytes
            .or(file.body_memory_bytes)
            .unwrap_or(d.body_memory_bytes),
        retries: flags.retries.or(file.retries).unwrap_or(d.retries),
        retry_budget_percent: flags
            .retry_budget_percent
            .or(file.retry_budget_percent)
            .unwrap_or(d.retry_budget_percent),
        retry_budget_per_s: flags
            .retry_budget_per_s
            .or(file.retry_budget_per_s)
            .unwrap_or(d.retry_budget_per_s),
        worker_timeout_ms: flags
            .worker_timeout_ms
            .or(file.worker_timeout_ms)
            .unwrap_or(d.worker_timeout_ms),
        relay_idle_timeout_ms: flags
            .relay_idle_timeout_ms
            .or(file.relay_idle_timeout_ms)
            .unwrap_or(d.relay_idle_timeout_ms),
        worker_pool_idle_ms: flags
            .worker_pool_idle_ms
            .or(file.worker_pool_idle_ms)
            .unwrap_or(d.worker_pool_idle_ms),
        upstream_body_timeout_ms: flags
            .upstream_body_timeout_ms
            .or(file.upstream_body_timeout_ms)
            .unwrap_or(d.upstream_body_timeout_ms),
        first_token_timeout_ms: flags
            .first_token_timeout_ms
            .or(file.first_token_timeout_ms)
            .unwrap_or(d.first_token_timeout_ms),
        max_upstream_body_bytes: flags
            .max_upstream_body_bytes
            .or(file.max_upstream_body_bytes)
            .unwrap_or(d.max_upstream_body_bytes),
        max_tokenize_bytes: flags
            .max_tokenize_bytes
            .or(file.max_tokenize_bytes)
            .unwrap_or(d.max_tokenize_bytes),
        tokenizer_threads: flags
            .tokenizer_threads
            .or(file.tokenizer_threads)
            .unwrap_or(d.tokenizer_threads),
        http: HttpConfig {
            max_connections: flags
                .max_connections
                .or(file.max_connections)
                .unwrap_or(h.max_connections),
            header_read_timeout_ms: flags
                .header_read_timeout_ms
                .or(file.header_read_timeout_ms)
                .unwrap_or(h.header_read_timeout_ms),
            body_read_timeout_ms: flags
                .body_read_timeout_ms
                .or(file.body_read_timeout_ms)
                .unwrap_or(h.body_read_timeout_ms),
            write_stall_timeout_ms: flags
                .write_stall_timeout_ms
                .or(file.write_stall_timeout_ms)
                .unwrap_or(h.write_stall_timeout_ms),
        },
        api_keys,
        api_keys_file,
        admin_token: flags.admin_token.or(file.admin_token),
        engine_api_key: flags.engine_api_key.or(file.engine_api_key),
        route_headers: flags.route_headers.or(file.route_headers).unwrap_or(false),
        headers: {
            let h = kvroute::ingress::admission::ClassHeaders::default();
            let name = |flag: Option<String>, file: Option<String>, default: String| {
                let n = flag.or(file).unwrap_or(default).to_ascii_lowercase();
                hyper::header::HeaderName::from_bytes(n.as_bytes())
                    .map(|_| n.clone())
                    .with_context(|| format!("{n:?} is not a header name"))
            };
            kvroute::ingress::admission::ClassHeaders {
                tenant: name(flags.tenant_header, file.tenant_header, h.tenant)?,
                priority: name(flags.priority_header, file.priority_header, h.priority)?,
                session: name(flags.session_header, file.session_header, h.session)?,
                affinity: name(flags.affinity_header, file.affinity_header, h.affinity)?,
                receipt: name(flags.receipt_header, file.receipt_header, h.receipt)?,
                trust_tenant: flags
                    .trust_tenant_header
                    .or(file.trust_tenant_header)
                    .unwrap_or(false),
                trust_priority: flags
                    .trust_priority
                    .or(file.trust_priority)
                    .unwrap_or(false),
            }
        },
    };
    ingress.validate()?;
    if let Some(token) = &ingress.admin_token {
        kvroute::auth::check_bearer_token(token.expose())
            .map_err(|e| anyhow::anyhow!("admin_token {e}"))?;
    }
    let lease_ttl_ms = flags.lease_ttl_ms.or(file.lease_ttl_ms).unwrap_or(5_000);
    if !(1_000..=3_600_000).contains(&lease_ttl_ms) {
        bail!(
            "lease_ttl_ms must be 1000..=3600000 (workers heartbeat every second; a worker \
             gone is noticed only after it)"
        );
    }
    let admin_host = flags
        .admin_host
        .or(file.admin_host)
        .unwrap_or(IpAddr::from([127, 0, 0, 1]));
    if !admin_host.is_loopback() && ingress.admin_token.is_none() {
        bail!(
            "admin_host {admin_host} is reachable from other hosts: set admin_token \
             (KVROUTE_ADMIN_TOKEN), since /admin/* shows what each prompt finds cached and \
             every worker's state"
        );
    }
    let chat_template = flags.chat_template.or(file.chat_template);
    let tokenizer = flags.tokenizer.or(file.tokenizer);
    if chat_template.is_some() && tokenizer.is_none() {
        bail!("chat_template needs tokenizer (the template renders for its tokens)");
    }
    // Opened here so that --dry-run fails on a wrong path, not the router's start after it.
    for (what, path) in [("tokenizer", &tokenizer), ("chat_template", &chat_template)] {
        if let Some(path) = path {
            std::fs::File::open(path).with_context(|| format!("{what} {}", path.display()))?;
        }
    }
    let nats = flags
        .nats
        .or(file.nats)
        .unwrap_or_else(|| "nats://127.0.0.1:4222".into());
    if nats.trim().is_empty() || nats.contains(char::is_whitespace) {
        bail!("nats {nats:?} is not a URL (several servers: comma-separated, no spaces)");
    }
    let nats_auth = flags.nats_auth.or(file.nats_auth);
    nats_auth.validate()?;
    let registry_replicas = flags
        .registry_replicas
        .or(file.registry_replicas)
        .unwrap_or(3);
    if !(1..=5).contains(&registry_replicas) {
        bail!("registry_replicas must be 1..=5 (JetStream's limit)");
    }
    let cluster = flags
        .cluster
        .or(file.cluster)
        .unwrap_or_else(|| "default".into());
    kvroute::events::plane::check_cluster(&cluster).map_err(anyhow::Error::msg)?;
    Ok(Settings {
        nats,
        nats_auth,
        registry_replicas,
        port: flags.port.or(file.port).unwrap_or(8080),
        host: flags
            .host
            .or(file.host)
            .unwrap_or(IpAddr::from([0, 0, 0, 0])),
        admin_port: flags.admin_port.or(file.admin_port).unwrap_or(8081),
        admin_host,
        status_port: flags.status_port.or(file.status_port),
        status_host: flags
            .status_host
            .or(file.status_host)
            .unwrap_or(IpAddr::from([0, 0, 0, 0])),
        cluster,
        scheduler,
        lease_ttl_ms,
        ingress,
        drain_timeout_ms: flags
            .drain_timeout_ms
            .or(file.drain_timeout_ms)
            .unwrap_or(30_000),
        tokenizer,
        chat_template,
        chat_template_content_format: flags
            .chat_template_content_format
            .or(file.chat_template_content_format)
            .unwrap_or_default(),
        default_chat_template_kwargs: flags
            .default_chat_template_kwargs
            .or(file.default_chat_template_kwargs)
            .map(|o| o.0)
            .unwrap_or_default(),
        trust_request_chat_template: flags
            .trust_request_chat_template
            .or(file.trust_request_chat_template)
            .unwrap_or(false),
        exclude_tools_when_tool_choice_none: flags
            .exclude_tools_when_tool_choice_none
            .or(file.exclude_tools_when_tool_choice_none)
            .unwrap_or(false),
        log_format: flags.log_format.or(file.log_format).unwrap_or_default(),
        backends: unique_backends(
            flags
                .backends
                .or(file.backends)
                .unwrap_or_default()
                .iter()
                .map(|b| parse_backend(b))
                .collect::<anyhow::Result<_>>()?,
        )?,
    })
}

/// Refuses an engine given twice: a worker's id is its URL's hash, so the two would
/// register as one worker in turn, each retiring the other's stream.
fn unique_backends(backends: Vec<Backend>) -> anyhow::Result<Vec<Backend>> {
    let mut seen = std::collections::HashSet::new();
    for b in &backends {
        if !seen.insert(b.url.as_str()) {
            bail!("--backend {}: given twice", b.url);
        }
    }
    Ok(backends)
}

fn redacted_urls<S: serde::Serializer>(urls: &str, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&kvroute::auth::redact_credentials(urls))
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

    /// `--band-limits -1=...` as two arguments: a value starting with `-` was taken for a
    /// flag ("unexpected argument '-1'"), though the negative bands are the best-effort ones
    /// the flag's own help shows.
    #[test]
    fn band_limits_take_a_negative_band_as_their_own_argument() {
        #[derive(clap::Parser)]
        struct Serve {
            #[command(flatten)]
            flags: ServeFlags,
        }
        let parsed = <Serve as clap::Parser>::try_parse_from([
            "serve",
            "--band-limits",
            "-1=20:300:0.5;2=10:100",
        ])
        .unwrap();
        let bands = band_limits(parsed.flags.band_limits.as_deref().unwrap()).unwrap();
        assert_eq!(bands.keys().copied().collect::<Vec<_>>(), vec![-1, 2]);
    }

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

    /// The engines' default chat template variables: a table or JSON text in the file, JSON
    /// text as a flag; anything but an object is refused.
    #[test]
    fn default_chat_template_kwargs_come_as_a_table_or_json() {
        let want: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(r#"{"enable_thinking": false}"#).unwrap();
        for text in [
            "default_chat_template_kwargs = { enable_thinking = false }\n",
            "default_chat_template_kwargs = '{\"enable_thinking\": false}'\n",
        ] {
            let s = resolve(ServeFlags::default(), parse_file(text).unwrap()).unwrap();
            assert_eq!(s.default_chat_template_kwargs, want, "{text}");
        }
        let flag: JsonObject = r#"{"enable_thinking": false}"#.parse().unwrap();
        assert_eq!(flag.0, want);
        assert!("[1]".parse::<JsonObject>().is_err());
        assert!(parse_file("default_chat_template_kwargs = 3\n").is_err());
        let none = resolve(ServeFlags::default(), ServeFlags::default()).unwrap();
        assert!(none.default_chat_template_kwargs.is_empty());
    }

    #[test]
    fn secrets_are_redacted_and_nats_auth_comes_from_the_file() {
        let file = parse_file(
            "nats_user = \"router\"\nnats_password = \"s3cret\"\napi_keys = [\"k1\"]\nadmin_token = \"t0k\"\n",
        )
        .unwrap();
        let s = resolve(ServeFlags::default(), file).unwrap();
        assert_eq!(s.nats_auth.nats_user.as_deref(), Some("router"));
        let printed = serde_json::to_string(&s).unwrap();
        assert!(
            !printed.contains("s3cret") && !printed.contains("k1") && !printed.contains("t0k"),
            "{printed}"
        );
        assert!(printed.contains("<redacted>"));
        // A password in the NATS URL itself is not printed either.
        let file = parse_file("nats = \"nats://router:hunter2@n1:4222\"\n").unwrap();
        let printed =
            serde_json::to_string(&resolve(ServeFlags::default(), file).unwrap()).unwrap();
        assert!(!printed.contains("hunter2"), "{printed}");
        assert!(printed.contains("nats://<redacted>@n1:4222"), "{printed}");
    }

    #[test]
    fn backends_the_bridge_could_not_follow_are_refused_at_start() {
        let ok = parse_backend("http://e:8000,events=tcp://e:5557,dp=2,model=org/m-7b").unwrap();
        assert_eq!((ok.dp, ok.model.as_deref()), (2, Some("org/m-7b")));
        assert_eq!(ok.offload_chunk, 1);
        let chunked = parse_backend("http://e:8000,events=tcp://e:5557,offload_chunk=4").unwrap();
        assert_eq!(chunked.offload_chunk, 4);
        assert_eq!(
            chunked.max_blocks,
            kvroute::engines::mirror::DEFAULT_MAX_BLOCKS
        );
        let capped = parse_backend("http://e:8000,events=tcp://e:5557,max_blocks=1000").unwrap();
        assert_eq!(capped.max_blocks, 1000);
        // The engine's bind-all setting copied as is names the engine's host, not this one.
        let copied =
            parse_backend("http://10.0.0.2:8000,events=tcp://*:5557,replay=tcp://*:5558").unwrap();
        assert_eq!(
            (copied.events.as_deref(), copied.replay.as_deref()),
            (Some("tcp://10.0.0.2:5557"), Some("tcp://10.0.0.2:5558"))
        );
        for bad in [
            "http://e:8000,offload_chunk=0",
            "http://e:8000,offload_chunk=4",
            "http://e:8000,max_blocks=1000",
            "http://e:8000,events=tcp://e:5557,max_blocks=0",
            "https://e:8000",
            "http://e:8000,model=my model",
            "http://e:8000,events=tcp://e:65535,dp=2",
            "http://e:8000,events=tcp://e:5557,replay=tcp://e:65535,dp=2",
        ] {
            assert!(parse_backend(bad).is_err(), "{bad:?} accepted");
        }
        assert!(parse_backend("http://e:8000,events=tcp://e:65535").is_ok());
        // The same engine twice (its worker id is its URL's hash) is refused; two are not.
        let flags = |backends: &[&str]| ServeFlags {
            backends: Some(backends.iter().map(|b| (*b).to_owned()).collect()),
            ..ServeFlags::default()
        };
        let twice = resolve(
            flags(&["http://e:8000", "http://e:8000,events=tcp://e:5557"]),
            ServeFlags::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(twice.contains("given twice"), "{twice}");
        // However it is spelt.
        let twice = resolve(
            flags(&["http://e:8000", "http://E:8000/"]),
            ServeFlags::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(twice.contains("given twice"), "{twice}");
        assert_eq!(
            parse_backend("http://Engine-1.NS:8000/v1/").unwrap().url,
            "http://engine-1.ns:8000/v1"
        );
        assert_eq!(parse_backend("http://e:80").unwrap().url, "http://e");
        assert_eq!(
            parse_backend("http://[::1]:8000").unwrap().url,
            "http://[::1]:8000"
        );
        let two = resolve(
            flags(&["http://e:8000", "http://f:8000"]),
            ServeFlags::default(),
        )
        .unwrap();
        assert_eq!(two.backends.len(), 2);
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
        // Keys and tokens a client could never send in a Bearer header.
        assert!(bad("api_keys = [\"k1\", \" k2\"]").is_err());
        assert!(bad("admin_token = \"t\\n\"").is_err());
        // Limits for a band no request can be in (bands are clamped to -10..=10).
        assert!(
            bad("band_limits = [\"20=5:1000\"]")
                .unwrap_err()
                .to_string()
                .contains("band 20")
        );
        // Every float must be finite: NaN once passed and then panicked on every request.
        assert!(bad("decode_weight = nan").is_err());
        assert!(bad("prefill_scale = inf").is_err());
        assert!(bad("relay_idle_timeout_ms = 0").is_err());
        assert!(bad("worker_pool_idle_ms = 0").is_err());
        assert!(bad("max_connections = 0").is_err());
        assert!(bad("max_connections = 1048577").is_err());
        assert!(bad("max_connections = 9223372036854775807").is_err());
        assert!(bad("nats_user = \"u\"").is_err());
        // A semaphore past tokio's maximum panicked at start; past the blocking pool, work
        // waited outside the deadline.
        assert!(bad("tokenizer_threads = 4611686018427387904").is_err());
        assert!(bad("tokenizer_threads = 513").is_err());
        assert!(bad("tokenizer_threads = 512").is_ok());
        assert!(bad("lease_ttl_ms = 9223372036854775807").is_err());
        assert!(bad("lease_ttl_ms = 3600000").is_ok());
        // /admin/* open to other hosts needs its token.
        assert!(bad("admin_host = \"0.0.0.0\"").is_err());
        assert!(bad("admin_host = \"0.0.0.0\"\nadmin_token = \"t0k\"").is_ok());
        assert!(bad("admin_host = \"::1\"").is_ok());
        // A template without its tokenizer passed --dry-run and failed at start.
        assert!(bad("chat_template = \"t.jinja\"").is_err());
        // So did a tokenizer or template that cannot be read.
        let e = bad("tokenizer = \"/nonexistent/tokenizer.json\"").unwrap_err();
        assert!(
            format!("{e:#}").contains("/nonexistent/tokenizer.json"),
            "{e:#}"
        );
        // A band given twice kept only its last limits, silently.
        let twice = bad("band_limits = [\"1=200:5000\", \"1=10:100\"]").unwrap_err();
        assert!(
            twice.to_string().contains("band 1 is given twice"),
            "{twice}"
        );
        assert!(bad("band_limits = [\"1=200:5000\", \"2=10:100\"]").is_ok());
        // An API keys file line that is no key was taken as a key nobody could send.
        let dir = std::env::temp_dir().join(format!("kvroute-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let keys = dir.join("keys");
        std::fs::write(&keys, "ok-key\n\nbad key\n").unwrap();
        let file = format!("api_keys_file = {:?}", keys.display().to_string());
        let e = bad(&file).unwrap_err().to_string();
        assert!(e.contains("line 3") && !e.contains("bad key"), "{e}");
        std::fs::write(&keys, "# team a\nok-key\n\n  other-key  \n").unwrap();
        assert!(bad(&file).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(bad("").is_ok());
    }
}
