//! `kvroute-bench fuzz`: every decoder fed by the network or by files, on stable Rust (no
//! nightly here, so no libFuzzer): structure-aware inputs (valid encodings of random
//! values, then mutated: bit flips, interesting integers, truncation, duplication, splices)
//! and raw random bytes, from empty up to the 1 MiB payload limit. Each input runs under
//! `catch_unwind`; a decoder may refuse anything, it may never panic. Decoded values go on
//! through the code that consumes them (the index, a stream, the scheduler, the settings
//! resolver), so a value that decodes but breaks its consumer is caught too.

use std::num::NonZeroUsize;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::time::Instant;

use kvroute::discovery::WorkerInfo;
use kvroute::events::load::{LoadMessage, Peers, decode_load};
use kvroute::events::stream::{StreamConfig, WorkerStream};
use kvroute::indexer::{Config, Indexer};
use kvroute::ingress::decode_request;
use kvroute::ingress::tokenizer::Tokenizer;
use kvroute::protocol::{
    DpRank, EventBatch, KvEvent, KvEventData, Limits, Salt, SeqHash, Snapshot, SnapshotAssembler,
    SnapshotBlock, StoredBlock, Tier, WorkerId, decode, decode_snapshot_chunk, encode, hash_blocks,
};
use kvroute::scheduler::{self, BookingId, Rng, Scheduler, SharedBooking};
use serde::Serialize;

/// Flags of `kvroute-bench fuzz`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Inputs in all, shared evenly by the decoders.
    #[arg(long, default_value_t = 600_000)]
    pub inputs: u64,
    /// Seed of the input generator (a run is reproducible from it).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Only this decoder (event_batch, engine_batch, engine_metrics, backend_spec,
    /// snapshot_chunk, worker_info, load_message, routed_prompt, openai_body, generate_body,
    /// toml_config).
    #[arg(long)]
    pub target: Option<String>,
    /// Where to write inputs that panicked (one file each).
    #[arg(long)]
    pub crashes: Option<PathBuf>,
    /// Write the report here as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// What one decoder went through.
#[derive(Clone, Debug, Serialize)]
pub struct TargetReport {
    /// The decoder.
    pub target: &'static str,
    /// Inputs run.
    pub inputs: u64,
    /// Inputs the decoder accepted.
    pub accepted: u64,
    /// Inputs that panicked.
    pub panics: u64,
    /// Largest input, bytes.
    pub max_input_bytes: usize,
    /// Seconds spent.
    pub seconds: f64,
}

/// The run.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Generator seed.
    pub seed: u64,
    /// Per decoder.
    pub targets: Vec<TargetReport>,
    /// Inputs in all.
    pub inputs: u64,
    /// Panics in all (must be 0).
    pub panics: u64,
}

/// Largest input: the payload limit of NATS and of the decoders.
pub const MAX_INPUT: usize = 1 << 20;

/// The decoders, by name.
pub const TARGETS: [&str; 11] = [
    "event_batch",
    "engine_batch",
    "engine_metrics",
    "backend_spec",
    "snapshot_chunk",
    "worker_info",
    "load_message",
    "routed_prompt",
    "openai_body",
    "generate_body",
    "toml_config",
];

/// A decoder and what consumes its output, with its own state.
struct Harness {
    limits: Limits,
    indexer: Indexer,
    stream: WorkerStream,
    assembler: SnapshotAssembler,
    scheduler: Scheduler,
    peers: Peers,
    tokenizer: Tokenizer,
    mirror: kvroute::engines::EngineMirror,
    /// A sidecar's guess of an engine's cache, from routed-prompt reports.
    approx: kvroute::engines::approx::ApproxCache,
    changes: Vec<kvroute::protocol::BlockChange>,
    now: u64,
}

impl Harness {
    fn new() -> Harness {
        let mut scheduler = Scheduler::new(scheduler::Config::default()).expect("default config");
        for w in 0..4 {
            scheduler.add_worker((WorkerId(w), DpRank(0)), 1000, "m");
        }
        Harness {
            limits: Limits::default(),
            indexer: Indexer::new(Config {
                max_blocks: 1 << 16,
                ..Config::default()
            })
            .expect("index config"),
            stream: WorkerStream::new(StreamConfig::default()),
            assembler: SnapshotAssembler::default(),
            scheduler,
            peers: Peers::default(),
            tokenizer: Tokenizer::Bytes,
            mirror: kvroute::engines::EngineMirror::new(NonZeroUsize::new(4).expect("4")),
            approx: kvroute::engines::approx::ApproxCache::new(120_000, 1 << 16),
            changes: Vec::new(),
            now: 0,
        }
    }

    /// Runs one input through `target`; whether the decoder accepted it.
    fn run(&mut self, target: &str, input: &[u8]) -> bool {
        self.now += 1;
        let mut commands = Vec::new();
        match target {
            "event_batch" => match decode(input, &self.limits) {
                Ok(batch) => {
                    self.indexer.apply(&batch);
                    self.stream.on_batch(self.now, batch, &mut commands);
                    self.stream.on_tick(self.now + 1_000, &mut commands);
                    true
                }
                Err(_) => false,
            },
            "snapshot_chunk" => match decode_snapshot_chunk(input, &self.limits) {
                Ok(chunk) => {
                    if let Ok(Some(snapshot)) = self.assembler.add(chunk) {
                        self.indexer.apply(&snapshot.to_batch());
                        self.assembler = SnapshotAssembler::default();
                    }
                    true
                }
                Err(_) => false,
            },
            // vLLM's and SGLang's msgpack batches, applied to a mirror as the ingest does.
            "engine_batch" => match kvroute::engines::decode_batch(input) {
                Ok(batch) => {
                    let mut changes = Vec::new();
                    self.mirror.apply(&batch, &mut changes);
                    true
                }
                Err(_) => false,
            },
            "engine_metrics" => kvroute::engines::metrics::scrape(&String::from_utf8_lossy(input))
                .load
                .is_some(),
            "backend_spec" => match std::str::from_utf8(input) {
                Ok(spec) => kvroute_cli::settings::parse_backend(spec).is_ok(),
                Err(_) => false,
            },
            "worker_info" => WorkerInfo::decode(input).is_ok(),
            "load_message" => match decode_load(input) {
                Ok(ops) => {
                    self.peers.on_message(self.now, 0, ops, &mut self.scheduler);
                    // What a replica would publish (asks, bookings again): bounded by the
                    // message, dropped here.
                    let _ = self.peers.take_outgoing();
                    self.peers.on_tick(self.now, 5_000, &mut self.scheduler);
                    self.scheduler.expire(self.now);
                    true
                }
                Err(_) => false,
            },
            // What a sidecar does with a report: decode it for a worker of four ranks and
            // learn its blocks.
            "routed_prompt" => match kvroute::events::routed::decode(input, 4) {
                Ok(prompt) => {
                    self.approx
                        .learn(self.now, &prompt.block_hashes(), &mut self.changes);
                    self.approx.expire(self.now, &mut self.changes);
                    self.changes.clear();
                    true
                }
                Err(_) => false,
            },
            "openai_body" => {
                let chat = self.now.is_multiple_of(2);
                decode_request(&self.tokenizer, input, chat).is_ok()
            }
            "generate_body" => kvroute_worker::server::decode_generate(input).is_ok(),
            "toml_config" => match std::str::from_utf8(input) {
                Ok(text) => match kvroute_cli::settings::parse_file(text) {
                    Ok(flags) => {
                        let _ = kvroute_cli::settings::resolve(
                            kvroute_cli::settings::ServeFlags::default(),
                            flags,
                        );
                        true
                    }
                    Err(_) => false,
                },
                Err(_) => false,
            },
            other => unreachable!("unknown target {other}"),
        }
    }

    /// Keeps state bounded over millions of inputs.
    fn reset_now_and_then(&mut self, i: u64) {
        if i.is_multiple_of(4096) {
            *self = Harness::new();
        }
    }
}

/// Interesting integers for length and count fields.
const INTERESTING: [u64; 12] = [
    0,
    1,
    2,
    0x7f,
    0x80,
    0xff,
    0xffff,
    0x7fff_ffff,
    0xffff_ffff,
    1 << 20,
    u64::MAX / 2,
    u64::MAX,
];

/// A size for a raw input: mostly small, sometimes up to the payload limit.
fn size(rng: &mut Rng) -> usize {
    match rng.below(1000) {
        0 => MAX_INPUT - rng.below(64),
        1..=9 => rng.below(MAX_INPUT),
        10..=99 => rng.below(64 << 10),
        _ => rng.below(512),
    }
}

fn random_bytes(rng: &mut Rng, n: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(n);
    while v.len() < n {
        v.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    v.truncate(n);
    v
}

/// Mutates `input` in place, one to eight times.
fn mutate(rng: &mut Rng, input: &mut Vec<u8>, other: &[u8]) {
    for _ in 0..=rng.below(8) {
        let len = input.len();
        match rng.below(9) {
            0 if len > 0 => {
                let i = rng.below(len);
                input[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                let i = rng.below(len);
                input[i] = [0u8, 0xff, 0x7f, 0x80, b'"', b'{', b'[', b'\\'][rng.below(8)];
            }
            2 if len >= 8 => {
                let i = rng.below(len - 7);
                let v = INTERESTING[rng.below(INTERESTING.len())];
                let width = [1, 2, 4, 8][rng.below(4)];
                input[i..i + width].copy_from_slice(&v.to_le_bytes()[..width]);
            }
            3 if len > 0 => input.truncate(rng.below(len)),
            4 if len > 0 => {
                let (a, b) = (rng.below(len), rng.below(len));
                let (lo, hi) = (a.min(b), a.max(b));
                let chunk = input[lo..hi].to_vec();
                let at = rng.below(len);
                input.splice(at..at, chunk);
            }
            5 if len > 0 => {
                let i = rng.below(len);
                let n = rng.below((len - i).min(64) + 1);
                input.drain(i..i + n);
            }
            6 if !other.is_empty() => {
                let at = rng.below(len + 1);
                let from = rng.below(other.len());
                let n = rng.below(other.len() - from + 1).min(4096);
                input.splice(at..at, other[from..from + n].iter().copied());
            }
            7 => {
                let at = rng.below(len + 1);
                let n = rng.below(32);
                input.splice(at..at, random_bytes(rng, n));
            }
            _ => {
                // A number where the format has one: a huge, negative or non-finite value.
                let token: &[u8] = [
                    &b"1e999"[..],
                    b"-1",
                    b"NaN",
                    b"inf",
                    b"18446744073709551616",
                    b"-0",
                    b"nan",
                ][rng.below(7)];
                let at = rng.below(len + 1);
                input.splice(at..at, token.iter().copied());
            }
        }
        if input.len() > MAX_INPUT {
            input.truncate(MAX_INPUT);
        }
    }
}

fn seq(rng: &mut Rng) -> SeqHash {
    SeqHash(match rng.below(4) {
        0 => rng.below(16) as u64,
        _ => rng.next_u64(),
    })
}

fn event_batch(rng: &mut Rng) -> EventBatch {
    let events = (0..rng.below(6))
        .map(|i| {
            let data = match rng.below(4) {
                0 | 1 => {
                    let tokens: Vec<u32> = (0..rng.below(200) as u32).map(|t| t % 97).collect();
                    let blocks = hash_blocks(&tokens, NonZeroUsize::new(4).expect("4"), Salt::NONE)
                        .iter()
                        .map(|b| StoredBlock {
                            seq: if rng.below(8) == 0 { seq(rng) } else { b.seq },
                            local: b.local,
                        })
                        .collect();
                    KvEventData::Stored {
                        parent: (rng.below(3) == 0).then(|| seq(rng)),
                        blocks,
                    }
                }
                2 => KvEventData::Removed {
                    blocks: (0..rng.below(20)).map(|_| seq(rng)).collect(),
                },
                _ => KvEventData::Cleared,
            };
            KvEvent {
                id: 1 + i as u64 + rng.below(3) as u64,
                tier: [Tier::Device, Tier::Host, Tier::Disk, Tier::Remote][rng.below(4)],
                data,
            }
        })
        .collect();
    EventBatch {
        worker: WorkerId(rng.below(4) as u64),
        dp_rank: DpRank(rng.below(2) as u32),
        epoch: rng.below(3) as u64,
        sent_unix_us: rng.next_u64(),
        events,
    }
}

fn snapshot(rng: &mut Rng) -> Snapshot {
    let tokens: Vec<u32> = (0..rng.below(400) as u32).collect();
    let blocks = hash_blocks(&tokens, NonZeroUsize::new(4).expect("4"), Salt::NONE);
    let mut parent = None;
    Snapshot {
        worker: WorkerId(rng.below(4) as u64),
        dp_rank: DpRank(0),
        epoch: rng.below(3) as u64,
        watermark: rng.next_u64() % 1000,
        blocks: blocks
            .iter()
            .map(|b| {
                let block = SnapshotBlock {
                    tier: [Tier::Device, Tier::Host][rng.below(2)],
                    parent,
                    block: StoredBlock {
                        seq: b.seq,
                        local: b.local,
                    },
                };
                parent = Some(b.seq);
                block
            })
            .collect(),
    }
}

fn worker_info(rng: &mut Rng) -> Vec<u8> {
    let pick = |rng: &mut Rng| INTERESTING[rng.below(INTERESTING.len())];
    let dp = [1u64, 2, 8, 1024, 1025, 0, pick(rng)][rng.below(7)];
    // A registration with 100,000 last ids (≈ 200 KB) once in a while: the size cap.
    let ids_len = if rng.below(64) == 0 {
        100_000
    } else {
        [0usize, 1, dp as usize % 2048][rng.below(3)]
    };
    let url = ["http://127.0.0.1:9000", "ftp://x", "", "http://a b"][rng.below(4)];
    let model = ["m", "", "a b", "x"][rng.below(4)];
    serde_json::json!({
        "id": pick(rng), "url": url,
        "block_size": pick(rng), "g1_blocks": pick(rng), "g2_blocks": pick(rng),
        "model": model, "dp_size": dp, "epoch": pick(rng),
        "last_event_ids": vec![1u64; ids_len],
    })
    .to_string()
    .into_bytes()
}

fn load_message(rng: &mut Rng) -> Vec<u8> {
    let ops: Vec<LoadMessage> = (0..rng.below(20))
        .map(|_| {
            let id = BookingId {
                origin: rng.below(4) as u64,
                seq: rng.below(50) as u64,
            };
            match rng.below(4) {
                0 => LoadMessage::Book {
                    booking: SharedBooking {
                        id,
                        worker: WorkerId(rng.below(6) as u64),
                        dp_rank: DpRank(rng.below(2) as u32),
                        prefill_blocks: [0.0, 1.5, -1.0, 1e300, 3.0][rng.below(5)],
                        blocks: (0..rng.below(40)).map(|_| seq(rng)).collect(),
                        tail: rng.below(2) == 0,
                        prefill_tokens: 0.0,
                        decode_tokens: 0,
                        session: (rng.below(2) == 0).then(|| rng.below(8) as u128),
                    },
                },
                1 => LoadMessage::FirstToken { id },
                2 => LoadMessage::Complete { id },
                3 if rng.below(2) == 0 => LoadMessage::Want {
                    replica: id.origin,
                    from: rng.below(4) as u64,
                    open: (0..rng.below(5))
                        .map(|_| (rng.below(60) as u64, rng.below(60) as u64))
                        .collect(),
                },
                _ => LoadMessage::Heartbeat {
                    replica: id.origin,
                    open: (0..rng.below(5))
                        .map(|_| (rng.below(60) as u64, rng.below(60) as u64))
                        .collect(),
                    next: rng.below(60) as u64,
                },
            }
        })
        .collect();
    serde_json::to_vec(&ops).expect("load messages serialize")
}

fn routed_prompt(rng: &mut Rng) -> Vec<u8> {
    let tokens: Vec<u32> = (0..rng.below(200) as u32).collect();
    let blocks = hash_blocks(
        &tokens,
        std::num::NonZeroUsize::new(16).expect("16"),
        Salt::NONE,
    );
    kvroute::events::routed::Routed::new(DpRank(rng.below(6) as u32), &blocks)
        .encode()
        .unwrap_or_default()
}

fn openai_body(rng: &mut Rng) -> Vec<u8> {
    let prompt = match rng.below(4) {
        0 => serde_json::json!("Hello there"),
        1 => serde_json::json!([1, 2, 3, 4294967295u64]),
        2 => serde_json::json!(""),
        _ => serde_json::json!("é😀\u{0}"),
    };
    let mut body = serde_json::json!({
        "model": "m", "prompt": prompt, "max_tokens": INTERESTING[rng.below(12)], "stream": rng.below(2) == 0,
        "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": ""}],
    });
    if rng.below(4) == 0 {
        body["messages"] = serde_json::json!([]);
    }
    body.to_string().into_bytes()
}

fn generate_body(rng: &mut Rng) -> Vec<u8> {
    let model = ["m", "", "other"][rng.below(3)];
    serde_json::json!({
        "token_ids": (0..rng.below(50)).map(|i| (i as u64).wrapping_mul(INTERESTING[rng.below(12)]) % 5_000_000_000).collect::<Vec<_>>(),
        "max_tokens": INTERESTING[rng.below(12)], "stream": rng.below(2) == 0, "salt": rng.next_u64(),
        "chat": rng.below(2) == 0, "model": model,
    })
    .to_string()
    .into_bytes()
}

fn toml_config(rng: &mut Rng) -> Vec<u8> {
    let lines = [
        "port = 8080",
        "port = 70000",
        "policy = \"kv\"",
        "policy = \"fastest\"",
        "decode_weight = nan",
        "prefill_scale = inf",
        "prefill_scale = -1.0",
        "max_inflight = 0",
        "max_connections = 18446744073709551615",
        "cluster = \"a.b\"",
        "api_keys = [\"k1\", \"\"]",
        "nats_user = \"u\"",
        "nats_password = \"p\"",
        "nats_tls_ca_file = \"/nonexistent\"",
        "registry_replicas = 9",
        "log_format = \"xml\"",
        "relay_idle_timeout_ms = 0",
        "[table]\nx = 1",
        "tokenizer_threads = -3",
        "host = \"::1\"",
    ];
    (0..rng.below(8))
        .map(|_| lines[rng.below(lines.len())])
        .collect::<Vec<_>>()
        .join("\n")
        .into_bytes()
}

/// An engine batch in one of the engines' shapes, with hashes and parents drawn from a small
/// set so that chains, removals and token-less stores meet.
fn engine_batch(rng: &mut Rng) -> Vec<u8> {
    use kvroute::engines::wire::{Encoding, RawEvent, encode_batch};
    let mediums = ["GPU", "CPU", "CPU_PINNED", "STORAGE", "cpu"];
    let events: Vec<RawEvent> = (0..rng.below(6))
        .map(|_| {
            let hashes: Vec<u64> = (0..rng.below(4))
                .map(|_| INTERESTING[rng.below(12)] ^ rng.below(8) as u64)
                .collect();
            match rng.below(4) {
                0 | 1 => {
                    let tokenless = rng.below(3) == 0;
                    let block_size = [4u32, 4, 4, 0, 16][rng.below(5)];
                    RawEvent::Stored {
                        token_ids: if tokenless {
                            Vec::new()
                        } else {
                            (0..hashes.len() as u32 * block_size).collect()
                        },
                        hashes,
                        parent: (rng.below(2) == 0).then(|| INTERESTING[rng.below(12)]),
                        block_size,
                        medium: mediums[rng.below(mediums.len())].into(),
                        lora_name: (rng.below(4) == 0).then(|| "adapter".into()),
                        extra_keys: Vec::new(),
                    }
                }
                2 => RawEvent::Removed {
                    hashes,
                    medium: mediums[rng.below(mediums.len())].into(),
                },
                _ => RawEvent::Cleared,
            }
        })
        .collect();
    let encoding = Encoding {
        tagged_maps: rng.below(2) == 0,
        bytes_hashes: rng.below(3) == 0,
        signed_hashes: rng.below(2) == 0,
    };
    encode_batch(1.5, &events, rng.below(3) as u32, encoding)
}

fn engine_metrics(rng: &mut Rng) -> Vec<u8> {
    let lines = [
        "vllm:num_requests_running{engine=\"0\"} 3",
        "vllm:num_requests_waiting 1e9",
        "vllm:kv_cache_usage_perc{engine=\"0\"} 0.5",
        "vllm:kv_cache_usage_perc{ 2",
        "vllm:cache_config_info{num_gpu_blocks=\"27000\"} 1",
        "vllm:cache_config_info{num_gpu_blocks=\"} 1",
        "sglang:token_usage NaN",
        "sglang:num_queue_reqs -1",
        "# HELP x y",
        "}{ 1",
    ];
    (0..rng.below(8))
        .map(|_| lines[rng.below(lines.len())])
        .collect::<Vec<_>>()
        .join("\n")
        .into_bytes()
}

fn backend_spec(rng: &mut Rng) -> Vec<u8> {
    let parts = [
        "events=tcp://127.0.0.1:5557",
        "replay=tcp://h:99999",
        "topic=",
        "model=m",
        "block_size=0",
        "dp=1025",
        "dp=2",
        "x=y",
        "events",
        "=",
    ];
    let mut spec = ["http://127.0.0.1:8000", "ftp://x", "", "http://a b"][rng.below(4)].to_string();
    for _ in 0..rng.below(5) {
        spec.push(',');
        spec.push_str(parts[rng.below(parts.len())]);
    }
    spec.into_bytes()
}

/// A structure-aware input for `target` (a valid encoding of a random value).
fn structured(rng: &mut Rng, target: &str) -> Vec<u8> {
    match target {
        "event_batch" => encode(&event_batch(rng)).unwrap_or_default(),
        "snapshot_chunk" => {
            let chunks = snapshot(rng).encode(4096).unwrap_or_default();
            let n = chunks.len().max(1);
            chunks.into_iter().nth(rng.below(n)).unwrap_or_default()
        }
        "engine_batch" => engine_batch(rng),
        "engine_metrics" => engine_metrics(rng),
        "backend_spec" => backend_spec(rng),
        "worker_info" => worker_info(rng),
        "load_message" => load_message(rng),
        "routed_prompt" => routed_prompt(rng),
        "openai_body" => openai_body(rng),
        "generate_body" => generate_body(rng),
        "toml_config" => toml_config(rng),
        other => unreachable!("unknown target {other}"),
    }
}

/// Runs `inputs` inputs through `target` from `seed`; panicking inputs are written to
/// `crashes` if given.
pub fn fuzz_target(
    target: &'static str,
    inputs: u64,
    seed: u64,
    crashes: Option<&std::path::Path>,
) -> TargetReport {
    let mut rng = Rng::new(seed ^ xxhash(target));
    let mut harness = Harness::new();
    let started = Instant::now();
    let (mut accepted, mut panics, mut max_input) = (0u64, 0u64, 0usize);
    let mut previous: Vec<u8> = Vec::new();
    for i in 0..inputs {
        harness.reset_now_and_then(i);
        let input = match rng.below(10) {
            // Raw bytes; for the byte codecs, behind a valid header now and then.
            0..=2 => {
                let n = size(&mut rng);
                let mut raw = random_bytes(&mut rng, n);
                if rng.below(2) == 0
                    && raw.len() >= 4
                    && target.ends_with("chunk") | target.ends_with("batch")
                {
                    let valid = structured(&mut rng, target);
                    let n = valid.len().min(4).min(raw.len());
                    raw[..n].copy_from_slice(&valid[..n]);
                }
                raw
            }
            3 => structured(&mut rng, target),
            _ => {
                let mut s = structured(&mut rng, target);
                mutate(&mut rng, &mut s, &previous);
                s
            }
        };
        max_input = max_input.max(input.len());
        match catch_unwind(AssertUnwindSafe(|| harness.run(target, &input))) {
            Ok(true) => accepted += 1,
            Ok(false) => {}
            Err(_) => {
                panics += 1;
                harness = Harness::new();
                if let Some(dir) = crashes {
                    let _ = std::fs::create_dir_all(dir);
                    let _ = std::fs::write(dir.join(format!("{target}-{seed}-{i}.bin")), &input);
                }
            }
        }
        if input.len() <= 64 << 10 {
            previous = input;
        }
    }
    TargetReport {
        target,
        inputs,
        accepted,
        panics,
        max_input_bytes: max_input,
        seconds: started.elapsed().as_secs_f64(),
    }
}

fn xxhash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// Runs the fuzzer.
pub fn run(args: &Args) -> anyhow::Result<Report> {
    let targets: Vec<&'static str> = match &args.target {
        Some(t) => vec![*TARGETS.iter().find(|x| *x == t).ok_or_else(|| {
            anyhow::anyhow!("no fuzz target {t:?}; one of {}", TARGETS.join(", "))
        })?],
        None => TARGETS.to_vec(),
    };
    // Panics are expected to be caught; keep their messages off the terminal.
    std::panic::set_hook(Box::new(|_| {}));
    // Split `--inputs` exactly: the first `inputs % targets` decoders get one more.
    let n = targets.len() as u64;
    let reports: Vec<TargetReport> = targets
        .iter()
        .zip(0u64..)
        .map(|(t, i)| {
            let share = args.inputs / n + u64::from(i < args.inputs % n);
            fuzz_target(t, share, args.seed, args.crashes.as_deref())
        })
        .collect();
    let _ = std::panic::take_hook();
    Ok(Report {
        seed: args.seed,
        inputs: reports.iter().map(|r| r.inputs).sum(),
        panics: reports.iter().map(|r| r.panics).sum(),
        targets: reports,
    })
}

/// Prints the report as a table.
pub fn print(report: &Report) {
    println!("| decoder | inputs | accepted | panics | largest input | seconds |");
    println!("|---|---|---|---|---|---|");
    for t in &report.targets {
        println!(
            "| {} | {} | {} | {} | {} B | {:.1} |",
            t.target, t.inputs, t.accepted, t.panics, t.max_input_bytes, t.seconds
        );
    }
    println!(
        "{} inputs, {} panics (seed {})",
        report.inputs, report.panics, report.seed
    );
}
