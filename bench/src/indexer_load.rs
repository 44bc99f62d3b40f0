//! `kvroute-bench indexer`: the indexer under a real event stream. A Mooncake trace runs
//! through W worker engines on a virtual clock (requests stick to a worker by conversation,
//! so each worker builds real prefixes); their KV event batches and the requests' lookups
//! form a timeline, which is then replayed into a fresh index twice with one writer thread
//! and `--readers` reader threads (one by default) that take the lookups in due order, as a
//! router's request tasks would: paced at the trace's own rate (sped up), and at saturation.
//! Between
//! the two, every lookup runs again flat out against the full index the paced replay left,
//! with no writer (the walk's own cost, caches warm). The
//! paced index is then emptied by removing every worker, with the process's resident memory
//! read before, with the index full, and after. A synthetic churn phase (fill to N blocks,
//! evict everything, refill, ten times) checks that memory comes back.
//!
//! `--dynamo` reproduces the steady-state protocol of NVIDIA Dynamo's indexer bench
//! (`lib/bench/kv_router/mooncake_bench.rs`, documented in
//! `lib/kv-router/src/indexer/INDEXER_BENCH.md` of ai-dynamo/dynamo): 1,000 unique
//! workers, each request sent to one at random; engines with 16,384 blocks of 128 tokens
//! (one block per trace hash id, as that version of Dynamo's bench makes them: prompts are
//! `hash_ids × 128` tokens), steps sped up 10×, prefix caching, no host tier, each worker's
//! arrivals compressed from its first to its last to 10 s (its `scale_mooncake_trace` runs
//! per worker); every worker's requests and events then stretched so its first lands at 0
//! and its last at 30 s (Dynamo's issuers start every worker's first request at once), and
//! replayed 7 times under new worker ids with the same hashes (7,000 workers sharing nodes).
//! Only `find_matches` is timed, and its p99 is the figure.

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvroute::indexer::{Config, Indexer};
use kvroute::protocol::{EventBatch, KvEventData, LocalHash, Salt, SeqHash, WorkerId, hash_blocks};
use kvroute_worker::EngineConfig;
use kvroute_worker::engine::{Output, Request, RequestId};
use serde::Serialize;

use crate::fleet::{Fleet, FleetSink};
use crate::stats::{
    Summary, allocator_options, peak_rss_bytes, rss_anon_bytes, rss_bytes, sample_peak_rss,
    settled_rss_bytes,
};
use crate::trace::{self, mix};

/// Flags of `kvroute-bench indexer`.
#[derive(clap::Args, Clone, Debug)]
pub struct Args {
    /// Mooncake JSONL trace.
    #[arg(long, default_value = "bench/traces/conversation_trace.jsonl")]
    pub trace: PathBuf,
    /// Worker engines producing events.
    #[arg(long, default_value_t = 64)]
    pub workers: usize,
    /// Copies of each worker's stream, in disjoint hash spaces (multiplies the load).
    #[arg(long, default_value_t = 1)]
    pub duplicate: usize,
    /// First N requests only.
    #[arg(long)]
    pub requests: Option<usize>,
    /// Tokens per trace hash id.
    #[arg(long, default_value_t = 512)]
    pub trace_block_size: usize,
    /// Engine KV block size, tokens.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// The paced phase replays the trace this many times faster than recorded.
    #[arg(long, default_value_t = 100.0)]
    pub pace_speedup: f64,
    /// Blocks the index reserves room for at start (`indexer.initial_blocks`).
    #[arg(long, default_value_t = 0)]
    pub initial_blocks: usize,
    /// Reader threads: each takes the next lookup due, waits for its time and runs it, so
    /// lookups due together run side by side on up to this many threads (a router's request
    /// tasks on its runtime's threads) rather than one after another.
    #[arg(long, default_value_t = 1)]
    pub readers: usize,
    /// Shards of the block map (`indexer.shards`).
    #[arg(long, default_value_t = Config::default().shards)]
    pub shards: usize,
    /// Copies of each worker's stream under new worker ids with the *same* hashes (workers
    /// sharing nodes; Dynamo's `-d`).
    #[arg(long, default_value_t = 1)]
    pub replicas: usize,
    /// Send each request to a random worker instead of sticking to its conversation's.
    #[arg(long)]
    pub random_workers: bool,
    /// Engine G1 blocks per worker.
    #[arg(long, default_value_t = 16_384)]
    pub g1_blocks: usize,
    /// Engine G2 (host) blocks per worker; 0: no host tier.
    #[arg(long, default_value_t = 65_536)]
    pub g2_blocks: usize,
    /// Engines run each worker's arrivals compressed, from its first to its last, to span
    /// this many seconds (Dynamo's rescaling, per worker).
    #[arg(long)]
    pub compress_to_s: Option<f64>,
    /// The paced phase stretches each worker's requests and events so its first lands at 0
    /// and its last at this many seconds (instead of `--pace-speedup`).
    #[arg(long)]
    pub window_s: Option<f64>,
    /// Divides the engines' step times while the timeline is made.
    #[arg(long, default_value_t = 1.0)]
    pub engine_speedup: f64,
    /// NVIDIA Dynamo's steady-state protocol (see the module docs): sets the flags above.
    #[arg(long)]
    pub dynamo: bool,
    /// Skip the phase in which every worker leaves (all at once: one walk of the index).
    #[arg(long)]
    pub no_leave: bool,
    /// Churn phase: distinct blocks to fill to each round (0: skip the phase).
    #[arg(long, default_value_t = 4_000_000)]
    pub churn_blocks: usize,
    /// Churn phase: fill-evict rounds.
    #[arg(long, default_value_t = 10)]
    pub churn_rounds: usize,
    /// Milliseconds to wait before a reading of RSS taken after memory was freed (evictions,
    /// workers leaving), so that it shows what the allocator kept and not what it was about
    /// to return: the binaries' jemalloc purges freed pages over 1 s (`.cargo/config.toml`),
    /// and 1.5 s was seen to leave a few MiB not yet purged.
    #[arg(long, default_value_t = 3000)]
    pub settle_ms: u64,
    /// Write the figures here as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

enum Item {
    Batch(EventBatch),
    Lookup {
        locals: Vec<LocalHash>,
        seqs: Vec<SeqHash>,
        copy: u64,
        /// The worker the request went to (for per-worker time scaling).
        worker: u64,
    },
}

struct Timeline {
    items: Vec<(u64, Item)>,
    duplicate: u64,
    replicas: u64,
    workers: u64,
}

impl FleetSink for Timeline {
    fn outputs(&mut self, _: usize, _: &[Output]) {}
    fn batches(&mut self, _: usize, at_us: u64, batches: Vec<EventBatch>) {
        for batch in batches {
            for copy in 0..self.duplicate {
                let b = in_copy(&batch, copy, self.workers);
                for r in 1..self.replicas {
                    let mut replica = b.clone();
                    replica.worker = WorkerId(b.worker.0 + r * self.workers * self.duplicate);
                    self.items.push((at_us, Item::Batch(replica)));
                }
                self.items.push((at_us, Item::Batch(b)));
            }
        }
    }
}

impl Item {
    /// The (original) worker an item belongs to.
    fn worker(&self) -> u64 {
        match self {
            Item::Batch(b) => b.worker.0,
            Item::Lookup { worker, .. } => *worker,
        }
    }
}

/// Copy `k` of a batch: worker `w + k·W`, every hash moved into copy k's space (copy 0 is the
/// original).
fn in_copy(batch: &EventBatch, copy: u64, workers: u64) -> EventBatch {
    let mut b = batch.clone();
    if copy == 0 {
        return b;
    }
    b.worker = WorkerId(batch.worker.0 + copy * workers);
    let m = |s: SeqHash| SeqHash(s.0 ^ mix(copy));
    for e in &mut b.events {
        match &mut e.data {
            KvEventData::Stored { parent, blocks } => {
                *parent = parent.map(m);
                for blk in blocks {
                    blk.seq = m(blk.seq);
                }
            }
            KvEventData::Removed { blocks } => blocks.iter_mut().for_each(|s| *s = m(*s)),
            KvEventData::Cleared => {}
        }
    }
    b
}

/// Resident memory around the paced index's life, bytes.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Memory {
    /// Before the index was created (the timeline already in memory).
    pub rss_before_bytes: u64,
    /// With the index full, at the end of the trace.
    pub rss_full_bytes: u64,
    /// After every worker was removed (index empty); `None` with `--no-leave`.
    pub rss_after_leave_bytes: Option<u64>,
    /// The index's tables at the end of the trace (structure size).
    pub table_bytes: u64,
    /// The index's tables after every worker left; `None` with `--no-leave`.
    pub table_bytes_after_leave: Option<u64>,
    /// Seconds to remove every worker at once (`Indexer::remove_workers`, one walk).
    pub leave_seconds: Option<f64>,
    /// (rss_full − rss_before) / distinct blocks.
    pub rss_bytes_per_block: f64,
    /// The process's peak RSS during the paced replay (read every 10 ms), bytes: the index
    /// at its largest, old and grown tables together while a shard grows.
    pub rss_index_peak_bytes: Option<u64>,
    /// (rss_after_leave − rss_before) / (rss_full − rss_before): the index's share left
    /// resident after every worker left (the ± 10 % target is on this, not on the process,
    /// whose timeline dwarfs the index).
    pub left_share: Option<f64>,
}

/// The churn phase: fill to `blocks` distinct blocks, evict them all, `rounds` times.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Churn {
    /// Distinct blocks per fill.
    pub blocks: usize,
    /// Rounds.
    pub rounds: usize,
    /// RSS with the fresh index, before any block was stored, bytes: the code that stores
    /// and evicts is not faulted in yet.
    pub rss_cold_bytes: u64,
    /// RSS with the empty index after a warm-up (4,096 blocks stored and evicted, enough for
    /// every shard's table to grow and shrink once; `settle_ms` later), bytes: the baseline
    /// the rounds are held to, with the code every round runs resident, as in any router that
    /// has served.
    pub rss_empty_bytes: u64,
    /// RSS after each fill, bytes.
    pub rss_full_bytes: Vec<u64>,
    /// RSS after each eviction, `settle_ms` later, bytes.
    pub rss_evicted_bytes: Vec<u64>,
    /// RSS right after each eviction, before the allocator had time to return pages, bytes.
    pub rss_evicted_at_once_bytes: Vec<u64>,
    /// RSS after every worker left at the end, `settle_ms` later, bytes.
    pub rss_after_leave_bytes: u64,
    /// The anonymous part of the RSS (RssAnon: what the heap holds, without the binary's
    /// code pages) with the fresh index, after the warm-up, after each eviction and after
    /// every worker left, bytes.
    pub anon_cold_bytes: u64,
    /// See `anon_cold_bytes`.
    pub anon_empty_bytes: u64,
    /// See `anon_empty_bytes`.
    pub anon_evicted_bytes: Vec<u64>,
    /// See `anon_empty_bytes`.
    pub anon_after_leave_bytes: u64,
    /// Index tables when full (last round), bytes per block.
    pub table_bytes_per_block: f64,
    /// Stored + removed blocks per second over the phase.
    pub block_ops_per_s: f64,
    /// The allocator's options: built in, and from the environment.
    pub allocator: String,
    /// Milliseconds waited before each RSS reading after a free (`--settle-ms`).
    pub settle_ms: u64,
}

/// What one replay of the timeline into a fresh index measured.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Phase {
    /// Wall time from first event to last (drain included), s.
    pub wall_s: f64,
    /// (stored + removed + walked lookup blocks) / wall.
    pub block_ops_per_s: f64,
    /// Stored + removed blocks / the writer's own time (first batch to the last one
    /// applied; `apply` returns once a batch is in the index, so the drain is included):
    /// the event figure, without the blocks lookups walked.
    pub event_blocks_per_s: f64,
    /// Paced: how late the writer applied each batch after its due time, µs (a writer
    /// that falls behind gives lookups a smaller, staler index). Flat out: empty.
    pub writer_late_us: Summary,
    /// `find_matches` latency, µs: the call alone (service time).
    pub lookup_us: Summary,
    /// Paced: from each lookup's due time to its answer, µs, the wait for a free reader
    /// thread included (lookups due together, as a request's copies or a trace's
    /// same-millisecond requests are, queue for the `--readers` threads). Flat out, the same
    /// as `lookup_us`.
    pub lookup_response_us: Summary,
    /// Paced: lookups whose due time had passed when a reader came to them (every reader was
    /// busy with earlier ones, or had woken late for them).
    pub lookups_behind: u64,
    /// Paced: how long those waited past their due time, µs.
    pub behind_us: Summary,
    /// Paced: how late the reader woke for the others (it slept until their due time; the
    /// OS's timer slack and scheduling, not the index), µs.
    pub woke_late_us: Summary,
    /// Blocks a lookup walked (matched + 1, at most the prompt), mean.
    pub walked_blocks_mean: f64,
    /// Lookup time per walked block, ns (total time / total blocks walked).
    pub ns_per_walked_block: f64,
}

impl Phase {
    /// The figures of a phase that took `wall_s`, whose writer applied `writer` and ran
    /// lookups with these `latencies` (µs) that walked `walked` blocks.
    fn new(wall_s: f64, mut writer: Written, mut lookups: Lookups) -> Phase {
        let event_blocks = writer.blocks;
        let walked = lookups.walked;
        let total_us: f64 = lookups.service_us.iter().sum();
        let count = lookups.service_us.len().max(1) as f64;
        Phase {
            wall_s,
            block_ops_per_s: (event_blocks + walked) as f64 / wall_s,
            event_blocks_per_s: event_blocks as f64 / writer.seconds.max(1e-9),
            writer_late_us: Summary::of(&mut writer.late_us),
            lookup_us: Summary::of(&mut lookups.service_us),
            lookup_response_us: Summary::of(&mut lookups.response_us),
            lookups_behind: lookups.behind_us.len() as u64,
            behind_us: Summary::of(&mut lookups.behind_us),
            woke_late_us: Summary::of(&mut lookups.woke_late_us),
            walked_blocks_mean: walked as f64 / count,
            ns_per_walked_block: total_us * 1e3 / walked.max(1) as f64,
        }
    }
}

/// The JSON `kvroute-bench indexer` writes.
#[derive(Debug, Default, Serialize)]
pub struct Report {
    /// Trace path.
    pub trace: String,
    /// Workers (× copies).
    pub workers: usize,
    /// Reader threads (`--readers`).
    pub readers: usize,
    /// Copies per worker.
    pub duplicate: usize,
    /// Event batches replayed.
    pub events: u64,
    /// Lookups replayed.
    pub lookups: u64,
    /// Stored + removed blocks in the events.
    pub event_blocks: u64,
    /// Blocks lookups walked.
    pub lookup_blocks: u64,
    /// Saturation block-ops/s, the blocks lookups walked included.
    pub block_ops_per_s: f64,
    /// Saturation: stored + removed blocks a second of the writer's own time (drain
    /// included), lookups' blocks not counted.
    pub event_blocks_per_s: f64,
    /// Lookup p50 at the trace's rate, µs.
    pub lookup_p50_us: f64,
    /// Lookup p99 at the trace's rate, µs (the call alone).
    pub lookup_p99_us: f64,
    /// Lookup p99 at the trace's rate from each lookup's due time, µs (its wait behind
    /// lookups due before it included: `paced.lookup_response_us`).
    pub lookup_response_p99_us: f64,
    /// Paced phase.
    pub paced: Phase,
    /// The lookups again, flat out, against the full index the paced phase left (no
    /// writer).
    pub full: Phase,
    /// Saturation phase.
    pub saturated: Phase,
    /// Peak RSS of the process (timeline included), bytes.
    pub peak_rss_bytes: u64,
    /// Index tables at the end of the trace / distinct blocks then.
    pub bytes_per_block: f64,
    /// Index tables at the end / (worker, tier, block) entries.
    pub bytes_per_entry: f64,
    /// Distinct blocks indexed at the end.
    pub final_blocks: usize,
    /// (worker, tier, block) entries at the end.
    pub final_entries: usize,
    /// Index tables at the end / distinct blocks (the structure's own cost).
    pub table_bytes_per_block: f64,
    /// Resident memory around the paced index.
    pub memory: Memory,
    /// The churn phase (absent with `--churn-blocks 0`).
    pub churn: Option<Churn>,
    /// The protocol: "kvroute" or "dynamo-steady-state".
    pub protocol: String,
    /// Unique engines simulated.
    pub unique_workers: usize,
    /// Replicas of each (same hashes).
    pub replicas: usize,
}

/// Tokens per block, and per trace hash id, in Dynamo's protocol.
const DYNAMO_BLOCK: usize = 128;

/// Runs the bench.
pub fn run(args: &Args) -> anyhow::Result<Report> {
    let mut args = args.clone();
    if args.dynamo {
        args.workers = 1000;
        args.replicas = 7;
        args.duplicate = 1;
        args.random_workers = true;
        args.block_size = DYNAMO_BLOCK;
        // Dynamo's bench of that version makes one 128-token block of each hash id and
        // ignores input_length (see the records' rewrite below).
        args.trace_block_size = DYNAMO_BLOCK;
        args.engine_speedup = 10.0;
        args.g1_blocks = 16_384;
        args.g2_blocks = 0;
        args.compress_to_s = Some(10.0);
        args.window_s = Some(30.0);
    }
    anyhow::ensure!(args.readers > 0, "--readers must be at least 1");
    let args = &args;
    // Churn first, in a process that has not yet allocated the timeline, so its RSS is the
    // index's own.
    let churn = (args.churn_blocks > 0).then(|| {
        eprintln!(
            "indexer: churn, {} rounds of {} blocks …",
            args.churn_rounds, args.churn_blocks
        );
        churn(args.churn_blocks, args.churn_rounds, args.settle_ms)
    });
    let records = if args.dynamo {
        // The trace's own 512 tokens per id validate it; then each id becomes one block.
        let mut records = trace::load(&args.trace, args.requests, 512)?;
        for r in &mut records {
            r.input_length = r.hash_ids.len() * DYNAMO_BLOCK;
        }
        records
    } else {
        trace::load(&args.trace, args.requests, args.trace_block_size)?
    };
    let block_size = NonZeroUsize::new(args.block_size)
        .ok_or_else(|| anyhow::anyhow!("--block-size must be positive"))?;
    eprintln!(
        "indexer: simulating {} requests on {} engines …",
        records.len(),
        args.workers
    );
    let timeline = simulate(&records, args, block_size)?;
    let events = timeline
        .items
        .iter()
        .filter(|(_, i)| matches!(i, Item::Batch(_)))
        .count() as u64;
    let lookups = timeline.items.len() as u64 - events;
    let event_blocks: u64 = timeline
        .items
        .iter()
        .map(|(_, i)| match i {
            Item::Batch(b) => b.block_count() as u64,
            Item::Lookup { .. } => 0,
        })
        .sum();
    let timeline = Arc::new(timeline);
    eprintln!(
        "indexer: {events} event batches ({event_blocks} blocks), {lookups} lookups; paced replay …"
    );
    let config = Config {
        initial_blocks: args.initial_blocks,
        shards: args.shards,
        ..Config::default()
    };
    let pace = match args.window_s {
        Some(_) => Some(1.0),
        None => Some(args.pace_speedup),
    };
    let rss_before = settled_rss_bytes(args.settle_ms);
    let peak = sample_peak_rss();
    let paced = replay(&timeline, &config, pace, args.readers)?;
    let rss_index_peak = Some(peak.finish());
    let rss_full = settled_rss_bytes(args.settle_ms);
    let full = settled(&timeline, &paced.index);
    let table_full = paced.index.table_bytes();
    let (blocks, entries) = (paced.index.sizes().blocks, paced.index.sizes().entries);
    let left = (!args.no_leave).then(|| {
        eprintln!("indexer: every worker leaves …");
        let all: Vec<WorkerId> = (0..(args.workers * args.duplicate * args.replicas) as u64)
            .map(WorkerId)
            .collect();
        let start = Instant::now();
        paced.index.remove_workers(&all);
        let seconds = start.elapsed().as_secs_f64();
        (
            settled_rss_bytes(args.settle_ms),
            paced.index.table_bytes() as u64,
            seconds,
        )
    });
    let memory = Memory {
        rss_before_bytes: rss_before,
        rss_full_bytes: rss_full,
        rss_after_leave_bytes: left.map(|l| l.0),
        table_bytes: table_full as u64,
        table_bytes_after_leave: left.map(|l| l.1),
        leave_seconds: left.map(|l| l.2),
        rss_bytes_per_block: rss_full.saturating_sub(rss_before) as f64 / blocks.max(1) as f64,
        rss_index_peak_bytes: rss_index_peak,
        left_share: left.map(|l| {
            (l.0 as f64 - rss_before as f64) / (rss_full as f64 - rss_before as f64).max(1.0)
        }),
    };
    drop(paced.index);
    eprintln!("indexer: saturated replay …");
    let saturated = replay(&timeline, &config, None, args.readers)?;
    drop(saturated.index);
    Ok(Report {
        trace: args.trace.display().to_string(),
        workers: args.workers * args.duplicate * args.replicas,
        readers: args.readers,
        duplicate: args.duplicate,
        events,
        lookups,
        event_blocks,
        lookup_blocks: saturated.walked,
        block_ops_per_s: saturated.phase.block_ops_per_s,
        event_blocks_per_s: saturated.phase.event_blocks_per_s,
        lookup_p50_us: paced.phase.lookup_us.p50,
        lookup_p99_us: paced.phase.lookup_us.p99,
        lookup_response_p99_us: paced.phase.lookup_response_us.p99,
        paced: paced.phase,
        full,
        saturated: saturated.phase,
        peak_rss_bytes: peak_rss_bytes(),
        bytes_per_block: table_full as f64 / blocks.max(1) as f64,
        bytes_per_entry: table_full as f64 / entries.max(1) as f64,
        final_blocks: blocks,
        final_entries: entries,
        table_bytes_per_block: table_full as f64 / blocks.max(1) as f64,
        memory,
        churn,
        protocol: if args.dynamo {
            "dynamo-steady-state".into()
        } else {
            "kvroute".into()
        },
        unique_workers: args.workers,
        replicas: args.replicas,
    })
}

fn simulate(
    records: &[trace::TraceRecord],
    args: &Args,
    block_size: NonZeroUsize,
) -> anyhow::Result<Timeline> {
    let config = EngineConfig {
        block_size: args.block_size,
        g1_blocks: args.g1_blocks,
        g2_blocks: args.g2_blocks,
        speedup: args.engine_speedup,
        ..EngineConfig::default()
    };
    let mut fleet = Fleet::new(&config, args.workers)?;
    let mut timeline = Timeline {
        items: Vec::new(),
        duplicate: args.duplicate as u64,
        replicas: args.replicas as u64,
        workers: args.workers as u64,
    };
    let worker_of = |i: usize, record: &trace::TraceRecord| {
        if args.random_workers {
            (mix(i as u64 ^ 0x2a) % args.workers as u64) as usize
        } else {
            // Sticky by conversation: the first id after the shared system prompt.
            let key = record
                .hash_ids
                .get(1)
                .or(record.hash_ids.first())
                .copied()
                .unwrap_or(0);
            (mix(key) % args.workers as u64) as usize
        }
    };
    let workers: Vec<usize> = records
        .iter()
        .enumerate()
        .map(|(i, r)| worker_of(i, r))
        .collect();
    // Each request's arrival, µs. Compressed, as Dynamo's bench rescales its trace: each
    // worker's own requests, from its first (at 0) to its last (at the given span), so
    // every worker starts at once (`scale_mooncake_trace` per worker, and its issuers
    // start every worker's first request at once, ai-dynamo/dynamo lib/bench/kv_router).
    let arrivals: Vec<u64> = match args.compress_to_s {
        None => records.iter().map(|r| r.timestamp * 1000).collect(),
        Some(span_s) => {
            let mut spans: rustc_hash::FxHashMap<usize, (u64, u64)> = Default::default();
            for (r, &w) in records.iter().zip(&workers) {
                let s = spans.entry(w).or_insert((r.timestamp, r.timestamp));
                *s = (s.0.min(r.timestamp), s.1.max(r.timestamp));
            }
            records
                .iter()
                .zip(&workers)
                .map(|(r, w)| {
                    let (first, last) = spans[w];
                    let from_first = (r.timestamp - first) as f64;
                    (from_first * span_s * 1e6 / (last - first).max(1) as f64) as u64
                })
                .collect()
        }
    };
    let mut order: Vec<usize> = (0..records.len()).collect();
    order.sort_by_key(|&i| arrivals[i]);
    for i in order {
        let (record, worker, at) = (&records[i], workers[i], arrivals[i]);
        fleet.run_until(at, &mut timeline)?;
        let prompt = trace::prompt_tokens(record, args.trace_block_size);
        let hashes = hash_blocks(&prompt, block_size, Salt::NONE);
        let copy = i as u64 % args.duplicate as u64;
        let locals: Vec<LocalHash> = hashes.iter().map(|h| h.local).collect();
        let seqs: Vec<SeqHash> = hashes
            .iter()
            .map(|h| SeqHash(h.seq.0 ^ if copy == 0 { 0 } else { mix(copy) }))
            .collect();
        for r in 0..args.replicas as u64 {
            timeline.items.push((
                at,
                Item::Lookup {
                    locals: locals.clone(),
                    seqs: seqs.clone(),
                    copy,
                    worker: worker as u64 + r * (args.workers * args.duplicate) as u64,
                },
            ));
        }
        let request = Request {
            id: RequestId(i as u64),
            prompt: prompt.into(),
            max_tokens: record.output_length.max(1) as u32,
            salt: Salt::NONE,
        };
        fleet.submit(worker, at, request, &mut timeline)?;
    }
    fleet.run_until(u64::MAX, &mut timeline)?;
    if let Some(window) = args.window_s {
        // Each worker's first request or event lands at 0 and its last at the window's
        // end.
        let mut spans: rustc_hash::FxHashMap<u64, (u64, u64)> = Default::default();
        for (t, item) in &timeline.items {
            let s = spans.entry(item.worker()).or_insert((*t, *t));
            *s = (s.0.min(*t), s.1.max(*t));
        }
        let window_us = window * 1e6;
        for (t, item) in &mut timeline.items {
            let (first, last) = spans[&item.worker()];
            *t = ((*t - first) as f64 * window_us / (last - first).max(1) as f64) as u64;
        }
    }
    timeline.items.sort_by_key(|(t, _)| *t);
    Ok(timeline)
}

/// What a replay's writer thread did.
#[derive(Default)]
struct Written {
    /// Stored + removed blocks applied.
    blocks: u64,
    /// From the replay's start to its last batch applied, s.
    seconds: f64,
    /// Paced: per batch, how late it was applied after its due time, µs.
    late_us: Vec<f64>,
}

/// One replay's figures, and its index (full).
struct Replayed {
    phase: Phase,
    walked: u64,
    index: Arc<Indexer>,
}

/// Replays the timeline into a fresh index: a writer thread applies the batches, `readers`
/// threads run the lookups, all paced at `speedup` × the recorded rate or flat out.
fn replay(
    timeline: &Arc<Timeline>,
    config: &Config,
    speedup: Option<f64>,
    readers: usize,
) -> anyhow::Result<Replayed> {
    let index = Arc::new(Indexer::new(config.clone())?);
    let start = Instant::now();
    let due = move |t: u64| speedup.map(|s| Duration::from_secs_f64(t as f64 / 1e6 / s));
    let writer = {
        let (timeline, index) = (Arc::clone(timeline), Arc::clone(&index));
        std::thread::spawn(move || {
            let mut written = Written::default();
            for (t, item) in &timeline.items {
                if let Item::Batch(b) = item {
                    if let Some(d) = due(*t) {
                        let at = start + d;
                        sleep_until(at);
                        let late = Instant::now().saturating_duration_since(at);
                        written.late_us.push(late.as_secs_f64() * 1e6);
                    }
                    index.apply(b);
                    written.blocks += b.block_count() as u64;
                }
            }
            written.seconds = start.elapsed().as_secs_f64();
            written
        })
    };
    let next = Arc::new(AtomicUsize::new(0));
    let readers: Vec<_> = (0..readers)
        .map(|_| {
            let (timeline, index, next) =
                (Arc::clone(timeline), Arc::clone(&index), Arc::clone(&next));
            std::thread::spawn(move || {
                lookups(&timeline, &next, &index, |t| due(t).map(|d| start + d))
            })
        })
        .collect();
    let written = writer
        .join()
        .map_err(|_| anyhow::anyhow!("writer thread panicked"))?;
    let mut lookups = Lookups::default();
    for reader in readers {
        let one = reader
            .join()
            .map_err(|_| anyhow::anyhow!("reader thread panicked"))?;
        lookups.merge(one);
    }
    let walked = lookups.walked;
    let phase = Phase::new(start.elapsed().as_secs_f64(), written, lookups);
    Ok(Replayed {
        phase,
        walked,
        index,
    })
}

/// What a run of lookups measured.
#[derive(Default)]
struct Lookups {
    /// Each call alone, µs.
    service_us: Vec<f64>,
    /// From each one's due time (its start, flat out) to its answer, µs.
    response_us: Vec<f64>,
    /// Of those the reader came to late, being busy: how late, µs.
    behind_us: Vec<f64>,
    /// Of those it slept for: how late it woke, µs.
    woke_late_us: Vec<f64>,
    /// Blocks walked, all lookups together.
    walked: u64,
}

impl Lookups {
    /// Adds another reader thread's figures.
    fn merge(&mut self, other: Lookups) {
        self.service_us.extend(other.service_us);
        self.response_us.extend(other.response_us);
        self.behind_us.extend(other.behind_us);
        self.woke_late_us.extend(other.woke_late_us);
        self.walked += other.walked;
    }
}

/// Runs the timeline's lookups against `index`, each once `due` (if it names a time) has
/// come, taking the next item not yet taken from `next` (shared by the reader threads, so
/// each lookup runs once, and in due order of starting).
fn lookups(
    timeline: &Timeline,
    next: &AtomicUsize,
    index: &Indexer,
    due: impl Fn(u64) -> Option<Instant>,
) -> Lookups {
    let mut out = Lookups::default();
    while let Some((t, item)) = timeline.items.get(next.fetch_add(1, Ordering::Relaxed)) {
        if let Item::Lookup {
            locals, seqs, copy, ..
        } = item
        {
            let when = due(*t);
            let slept = when.is_some_and(|when| when > Instant::now());
            if let Some(when) = when {
                sleep_until(when);
            }
            let began = Instant::now();
            if let Some(when) = when {
                let late = began.saturating_duration_since(when).as_secs_f64() * 1e6;
                if slept {
                    out.woke_late_us.push(late);
                } else {
                    out.behind_us.push(late);
                }
            }
            let scores = if *copy == 0 {
                index.find_matches(locals)
            } else {
                // The hashing `find_matches` does, moved into the copy's space: every copy's
                // lookup is timed with it (copies looked up pre-hashed ran about 4 ns a block
                // faster than copy 0).
                let mask = mix(*copy);
                let mut parent = None;
                let moved: Vec<SeqHash> = locals
                    .iter()
                    .map(|local| {
                        let seq = kvroute::protocol::seq_hash(parent, *local, Salt::NONE);
                        parent = Some(seq);
                        SeqHash(seq.0 ^ mask)
                    })
                    .collect();
                debug_assert_eq!(&moved, seqs);
                index.find_matches_seq(&moved)
            };
            let ended = Instant::now();
            out.service_us
                .push(ended.duration_since(began).as_secs_f64() * 1e6);
            out.response_us.push(
                ended
                    .duration_since(when.unwrap_or(began).min(began))
                    .as_secs_f64()
                    * 1e6,
            );
            let deepest = scores
                .workers
                .iter()
                .map(|o| (o.device + o.host + o.disk) as u64)
                .max()
                .unwrap_or(0);
            out.walked += (deepest + 1).min(locals.len() as u64);
        }
    }
    out
}

/// Every lookup of the timeline again, flat out on one thread, against the index as the
/// paced replay left it (full, no writer): the walk's own cost, caches warm from the
/// previous lookup rather than cold from a sleep.
fn settled(timeline: &Timeline, index: &Indexer) -> Phase {
    let start = Instant::now();
    let lookups = lookups(timeline, &AtomicUsize::new(0), index, |_| None);
    Phase::new(start.elapsed().as_secs_f64(), Written::default(), lookups)
}

/// Fills a fresh index with `blocks` distinct blocks (64 workers, 16-block chains, on the
/// device), evicts them all, and again, `rounds` times; then every worker leaves.
fn churn(blocks: usize, rounds: usize, settle_ms: u64) -> Churn {
    const WORKERS: u64 = 64;
    const CHAIN: usize = 16;
    let index = Indexer::new(Config::default()).expect("the default config is valid");
    let mut out = Churn {
        blocks,
        rounds,
        rss_cold_bytes: rss_bytes(),
        anon_cold_bytes: rss_anon_bytes(),
        allocator: allocator_options(),
        settle_ms,
        ..Churn::default()
    };
    let chain_of = |round: usize, c: usize| -> Vec<kvroute::protocol::StoredBlock> {
        let mut parent = None;
        (0..CHAIN)
            .map(|k| {
                let local = LocalHash(mix((round as u64) << 40 ^ (c as u64) << 8 ^ k as u64));
                let seq = kvroute::protocol::seq_hash(parent, local, Salt::NONE);
                parent = Some(seq);
                kvroute::protocol::StoredBlock { seq, local }
            })
            .collect()
    };
    let batch = |worker: u64, data: KvEventData| EventBatch {
        worker: WorkerId(worker),
        dp_rank: kvroute::protocol::DpRank(0),
        epoch: 1,
        sent_unix_us: 0,
        events: vec![kvroute::protocol::KvEvent {
            id: 0,
            tier: kvroute::protocol::Tier::Device,
            data,
        }],
    };
    let fill = |round: usize, chains: usize| {
        for c in 0..chains {
            let blocks = chain_of(round, c);
            index.apply(&batch(
                c as u64 % WORKERS,
                KvEventData::Stored {
                    parent: None,
                    blocks,
                },
            ));
        }
    };
    let evict = |round: usize, chains: usize| {
        for c in 0..chains {
            let seqs = chain_of(round, c).iter().rev().map(|b| b.seq).collect();
            index.apply(&batch(
                c as u64 % WORKERS,
                KvEventData::Removed { blocks: seqs },
            ));
        }
    };
    // The warm-up, in a hash space of its own (round `rounds`).
    const WARM_UP_CHAINS: usize = 256;
    fill(rounds, WARM_UP_CHAINS);
    evict(rounds, WARM_UP_CHAINS);
    out.rss_empty_bytes = settled_rss_bytes(settle_ms);
    out.anon_empty_bytes = rss_anon_bytes();
    let chains = blocks / CHAIN;
    let mut ops = 0u64;
    // Seconds spent filling and evicting, without the waits for RSS to settle.
    let mut busy = 0.0;
    for round in 0..rounds {
        let start = Instant::now();
        fill(round, chains);
        ops += (chains * CHAIN) as u64;
        out.rss_full_bytes.push(rss_bytes());
        out.table_bytes_per_block = index.table_bytes() as f64 / index.sizes().blocks.max(1) as f64;
        evict(round, chains);
        ops += (chains * CHAIN) as u64;
        busy += start.elapsed().as_secs_f64();
        out.rss_evicted_at_once_bytes.push(rss_bytes());
        out.rss_evicted_bytes.push(settled_rss_bytes(settle_ms));
        out.anon_evicted_bytes.push(rss_anon_bytes());
    }
    out.block_ops_per_s = ops as f64 / busy;
    let all: Vec<WorkerId> = (0..WORKERS).map(WorkerId).collect();
    index.remove_workers(&all);
    out.rss_after_leave_bytes = settled_rss_bytes(settle_ms);
    out.anon_after_leave_bytes = rss_anon_bytes();
    out
}

fn sleep_until(when: Instant) {
    let now = Instant::now();
    if when > now {
        std::thread::sleep(when - now);
    }
}

/// Prints the report as a table.
pub fn print(report: &Report) {
    println!(
        "indexer on {} ({} workers, {} events, {} lookups, {} reader thread(s))",
        report.trace, report.workers, report.events, report.lookups, report.readers
    );
    println!(
        "| phase | wall s | event blocks/s (writer) | block-ops/s (lookups' blocks too) | lookup p50 µs | lookup p90 µs | lookup p99 µs | mean µs | from due time p50 / p99 µs | blocks walked (mean) | ns per block |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for (name, p) in [
        ("paced (trace rate)", &report.paced),
        ("lookups only, full index", &report.full),
        ("saturated", &report.saturated),
    ] {
        println!(
            "| {name} | {:.2} | {:.0} | {:.0} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} / {:.2} | {:.1} | {:.1} |",
            p.wall_s,
            p.event_blocks_per_s,
            p.block_ops_per_s,
            p.lookup_us.p50,
            p.lookup_us.p90,
            p.lookup_us.p99,
            p.lookup_us.mean,
            p.lookup_response_us.p50,
            p.lookup_response_us.p99,
            p.walked_blocks_mean,
            p.ns_per_walked_block
        );
    }
    let p = &report.paced;
    println!(
        "paced, from each lookup's due time: {} of {} found no reader free (earlier lookups due with them, or its own late wake for them) and waited p50 / p99 {:.1} / {:.1} µs; for the others it slept and woke p50 / p99 {:.1} / {:.1} µs late (timer slack and scheduling)",
        p.lookups_behind,
        report.lookups,
        p.behind_us.p50,
        p.behind_us.p99,
        p.woke_late_us.p50,
        p.woke_late_us.p99
    );
    println!(
        "paced writer: batches applied p50 / p99 {:.1} / {:.1} µs after their due time",
        p.writer_late_us.p50, p.writer_late_us.p99
    );
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let m = &report.memory;
    println!(
        "index at end: {} blocks, {} entries; tables {:.1} B/block, {:.1} B/entry; RSS {:.1} B/block",
        report.final_blocks,
        report.final_entries,
        report.bytes_per_block,
        report.bytes_per_entry,
        m.rss_bytes_per_block
    );
    let after = match (
        m.rss_after_leave_bytes,
        m.table_bytes_after_leave,
        m.leave_seconds,
    ) {
        (Some(rss), Some(tables), Some(seconds)) => {
            format!(
                "{:.0} MiB after every worker left in {seconds:.2} s (tables {tables} B; {:.1} % of the index's RSS left)",
                mib(rss),
                m.left_share.unwrap_or(0.0) * 100.0
            )
        }
        _ => "leaving not measured (--no-leave)".to_owned(),
    };
    let index_peak = m.rss_index_peak_bytes.map_or_else(
        || "not measured".to_owned(),
        |b| format!("{:.0} MiB", mib(b)),
    );
    println!(
        "RSS: {:.0} MiB before the index, {:.0} MiB full, {after}; peak during the paced replay {index_peak}; process peak {:.0} MiB (timeline included)",
        mib(m.rss_before_bytes),
        mib(m.rss_full_bytes),
        mib(report.peak_rss_bytes)
    );
    if let Some(c) = &report.churn {
        let max = |v: &[u64]| v.iter().copied().max().unwrap_or(0);
        println!(
            "churn: {} rounds of {} blocks, {:.2} M block-ops/s; RSS fresh {:.1} MiB, empty after warm-up {:.1} MiB, full max {:.0} MiB, evicted max {:.1} MiB ({:.0} MiB at once), after leave {:.1} MiB; anonymous RSS fresh {:.1} MiB, empty {:.1} MiB, evicted max {:.1} MiB, after leave {:.1} MiB; tables {:.1} B/block full; allocator {}",
            c.rounds,
            c.blocks,
            c.block_ops_per_s / 1e6,
            mib(c.rss_cold_bytes),
            mib(c.rss_empty_bytes),
            mib(max(&c.rss_full_bytes)),
            mib(max(&c.rss_evicted_bytes)),
            mib(max(&c.rss_evicted_at_once_bytes)),
            mib(c.rss_after_leave_bytes),
            mib(c.anon_cold_bytes),
            mib(c.anon_empty_bytes),
            mib(max(&c.anon_evicted_bytes)),
            mib(c.anon_after_leave_bytes),
            c.table_bytes_per_block,
            c.allocator
        );
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// Worker `w` holds a 40-block chain; lookup `k` asks for the first `k` blocks of one.
    fn timeline() -> (Timeline, Indexer) {
        let locals: Vec<LocalHash> = (0..40).map(|k| LocalHash(mix(k))).collect();
        let hashes: Vec<SeqHash> = {
            let mut parent = None;
            locals
                .iter()
                .map(|l| {
                    let seq = kvroute::protocol::seq_hash(parent, *l, Salt::NONE);
                    parent = Some(seq);
                    seq
                })
                .collect()
        };
        let index = Indexer::new(Config::default()).unwrap();
        let mut items = Vec::new();
        for w in 0..4u64 {
            let batch = EventBatch {
                worker: WorkerId(w),
                dp_rank: kvroute::protocol::DpRank(0),
                epoch: 1,
                sent_unix_us: 0,
                events: vec![kvroute::protocol::KvEvent {
                    id: 1,
                    tier: kvroute::protocol::Tier::Device,
                    data: KvEventData::Stored {
                        parent: None,
                        blocks: locals
                            .iter()
                            .zip(&hashes)
                            .map(|(&local, &seq)| kvroute::protocol::StoredBlock { seq, local })
                            .collect(),
                    },
                }],
            };
            index.apply(&batch);
            items.push((0, Item::Batch(batch)));
        }
        for k in 1..=40 {
            items.push((
                k as u64,
                Item::Lookup {
                    locals: locals[..k].to_vec(),
                    seqs: hashes[..k].to_vec(),
                    copy: 0,
                    worker: 0,
                },
            ));
        }
        let timeline = Timeline {
            items,
            duplicate: 1,
            replicas: 1,
            workers: 4,
        };
        (timeline, index)
    }

    #[test]
    fn reader_threads_share_the_lookups_and_run_each_once() {
        let (timeline, index) = timeline();
        let one = lookups(&timeline, &AtomicUsize::new(0), &index, |_| None);
        assert_eq!(one.service_us.len(), 40);
        // Lookup k walks k blocks (each matched in full): 1 + 2 + … + 40.
        assert_eq!(one.walked, 820);
        let next = AtomicUsize::new(0);
        let mut shared = Lookups::default();
        std::thread::scope(|s| {
            let threads: Vec<_> = (0..3)
                .map(|_| s.spawn(|| lookups(&timeline, &next, &index, |_| None)))
                .collect();
            for t in threads {
                shared.merge(t.join().unwrap());
            }
        });
        assert_eq!(shared.service_us.len(), 40);
        assert_eq!(shared.response_us.len(), 40);
        assert_eq!(shared.walked, 820);
    }
}
