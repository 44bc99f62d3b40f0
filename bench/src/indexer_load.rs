//! `kvroute-bench indexer`: the indexer under a real event stream. A Mooncake trace runs
//! through W worker engines on a virtual clock (requests stick to a worker by conversation,
//! so each worker builds real prefixes); their KV event batches and the requests' lookups
//! form a timeline, which is then replayed into a fresh index twice with one writer thread
//! and one reader thread: paced at the trace's own rate (sped up), and at saturation.

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute::indexer::{Config, Indexer};
use kvroute::protocol::{EventBatch, KvEventData, LocalHash, Salt, SeqHash, WorkerId, hash_blocks};
use kvroute_worker::EngineConfig;
use kvroute_worker::engine::{Output, Request, RequestId};
use serde::Serialize;
use stats_alloc::{Region, StatsAlloc};

use crate::fleet::{Fleet, FleetSink};
use crate::stats::{Summary, peak_rss_bytes};
use crate::trace::{self, mix};

/// Flags of `kvroute-bench indexer`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Mooncake JSONL trace.
    #[arg(long, default_value = "../shared/traces/conversation_trace.jsonl")]
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
    },
}

struct Timeline {
    items: Vec<(u64, Item)>,
    duplicate: u64,
    workers: u64,
}

impl FleetSink for Timeline {
    fn outputs(&mut self, _: usize, _: &[Output]) {}
    fn batches(&mut self, _: usize, at_us: u64, batches: Vec<EventBatch>) {
        for batch in batches {
            for copy in 0..self.duplicate {
                self.items
                    .push((at_us, Item::Batch(in_copy(&batch, copy, self.workers))));
            }
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

/// What one replay of the timeline into a fresh index measured.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Phase {
    /// Wall time from first event to last (drain included), s.
    pub wall_s: f64,
    /// (stored + removed + walked lookup blocks) / wall.
    pub block_ops_per_s: f64,
    /// `find_matches` latency, µs.
    pub lookup_us: Summary,
}

/// The JSON `kvroute-bench indexer` writes.
#[derive(Debug, Default, Serialize)]
pub struct Report {
    /// Trace path.
    pub trace: String,
    /// Workers (× copies).
    pub workers: usize,
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
    /// Saturation block-ops/s.
    pub block_ops_per_s: f64,
    /// Lookup p50 at the trace's rate, µs.
    pub lookup_p50_us: f64,
    /// Lookup p99 at the trace's rate, µs.
    pub lookup_p99_us: f64,
    /// Paced phase.
    pub paced: Phase,
    /// Saturation phase.
    pub saturated: Phase,
    /// Peak RSS of the process (timeline included), bytes.
    pub peak_rss_bytes: u64,
    /// Index heap at the end of the trace / distinct blocks then.
    pub bytes_per_block: f64,
    /// Index heap at the end / (worker, tier, block) entries.
    pub bytes_per_entry: f64,
    /// Distinct blocks indexed at the end.
    pub final_blocks: usize,
}

/// Runs the bench.
pub fn run(
    args: &Args,
    allocator: &'static StatsAlloc<std::alloc::System>,
) -> anyhow::Result<Report> {
    let records = trace::load(&args.trace, args.requests, args.trace_block_size)?;
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
        ..Config::default()
    };
    let (paced, _, _) = replay(&timeline, &config, Some(args.pace_speedup), allocator)?;
    eprintln!("indexer: saturated replay …");
    let (saturated, lookup_blocks, (heap, sizes)) = replay(&timeline, &config, None, allocator)?;
    Ok(Report {
        trace: args.trace.display().to_string(),
        workers: args.workers * args.duplicate,
        duplicate: args.duplicate,
        events,
        lookups,
        event_blocks,
        lookup_blocks,
        block_ops_per_s: saturated.block_ops_per_s,
        lookup_p50_us: paced.lookup_us.p50,
        lookup_p99_us: paced.lookup_us.p99,
        paced,
        saturated,
        peak_rss_bytes: peak_rss_bytes(),
        bytes_per_block: heap as f64 / sizes.blocks.max(1) as f64,
        bytes_per_entry: heap as f64 / sizes.entries.max(1) as f64,
        final_blocks: sizes.blocks,
    })
}

fn simulate(
    records: &[trace::TraceRecord],
    args: &Args,
    block_size: NonZeroUsize,
) -> anyhow::Result<Timeline> {
    let config = EngineConfig {
        block_size: args.block_size,
        ..EngineConfig::default()
    };
    let mut fleet = Fleet::new(&config, args.workers)?;
    let mut timeline = Timeline {
        items: Vec::new(),
        duplicate: args.duplicate as u64,
        workers: args.workers as u64,
    };
    for (i, record) in records.iter().enumerate() {
        let at = record.timestamp * 1000;
        fleet.run_until(at, &mut timeline)?;
        let prompt = trace::prompt_tokens(record, args.trace_block_size);
        let hashes = hash_blocks(&prompt, block_size, Salt::NONE);
        let copy = i as u64 % args.duplicate as u64;
        timeline.items.push((
            at,
            Item::Lookup {
                locals: hashes.iter().map(|h| h.local).collect(),
                seqs: hashes
                    .iter()
                    .map(|h| SeqHash(h.seq.0 ^ if copy == 0 { 0 } else { mix(copy) }))
                    .collect(),
                copy,
            },
        ));
        // Sticky by conversation: the first id after the shared system prompt.
        let key = record
            .hash_ids
            .get(1)
            .or(record.hash_ids.first())
            .copied()
            .unwrap_or(0);
        let worker = (mix(key) % args.workers as u64) as usize;
        let request = Request {
            id: RequestId(i as u64),
            prompt: prompt.into(),
            max_tokens: record.output_length.max(1) as u32,
            salt: Salt::NONE,
        };
        fleet.submit(worker, at, request, &mut timeline)?;
    }
    fleet.run_until(u64::MAX, &mut timeline)?;
    timeline.items.sort_by_key(|(t, _)| *t);
    Ok(timeline)
}

/// Replays the timeline into a fresh index: a writer thread applies the batches, a reader
/// thread runs the lookups, both paced at `speedup` × the recorded rate or flat out.
/// Returns the phase figures, blocks walked by lookups, and the index's final heap and sizes.
fn replay(
    timeline: &Arc<Timeline>,
    config: &Config,
    speedup: Option<f64>,
    allocator: &'static StatsAlloc<std::alloc::System>,
) -> anyhow::Result<(Phase, u64, (i64, kvroute::indexer::Sizes))> {
    let region = Region::new(allocator);
    let index = Arc::new(Indexer::new(config.clone())?);
    let start = Instant::now();
    let due = move |t: u64| speedup.map(|s| Duration::from_secs_f64(t as f64 / 1e6 / s));
    let writer = {
        let (timeline, index) = (Arc::clone(timeline), Arc::clone(&index));
        std::thread::spawn(move || {
            let mut blocks = 0u64;
            for (t, item) in &timeline.items {
                if let Item::Batch(b) = item {
                    if let Some(d) = due(*t) {
                        sleep_until(start + d);
                    }
                    index.apply(b);
                    blocks += b.block_count() as u64;
                }
            }
            blocks
        })
    };
    let reader = {
        let (timeline, index) = (Arc::clone(timeline), Arc::clone(&index));
        std::thread::spawn(move || {
            let mut latencies = Vec::new();
            let mut walked = 0u64;
            for (t, item) in &timeline.items {
                if let Item::Lookup { locals, seqs, copy } = item {
                    if let Some(d) = due(*t) {
                        sleep_until(start + d);
                    }
                    let began = Instant::now();
                    let scores = if *copy == 0 {
                        index.find_matches(locals)
                    } else {
                        index.find_matches_seq(seqs)
                    };
                    latencies.push(began.elapsed().as_secs_f64() * 1e6);
                    let deepest = scores
                        .workers
                        .iter()
                        .map(|o| (o.device + o.host + o.disk) as u64)
                        .max()
                        .unwrap_or(0);
                    walked += (deepest + 1).min(locals.len() as u64);
                }
            }
            (latencies, walked)
        })
    };
    let event_blocks = writer
        .join()
        .map_err(|_| anyhow::anyhow!("writer thread panicked"))?;
    let (mut latencies, walked) = reader
        .join()
        .map_err(|_| anyhow::anyhow!("reader thread panicked"))?;
    let wall = start.elapsed().as_secs_f64();
    let change = region.change();
    let heap = change.bytes_allocated as i64 - change.bytes_deallocated as i64
        + change.bytes_reallocated as i64;
    let sizes = index.sizes();
    let phase = Phase {
        wall_s: wall,
        block_ops_per_s: (event_blocks + walked) as f64 / wall,
        lookup_us: Summary::of(&mut latencies),
    };
    Ok((phase, walked, (heap, sizes)))
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
        "indexer on {} ({} workers, {} events, {} lookups)",
        report.trace, report.workers, report.events, report.lookups
    );
    println!(
        "| phase | wall s | block-ops/s | lookup p50 µs | lookup p90 µs | lookup p99 µs | mean µs |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (name, p) in [
        ("paced (trace rate)", &report.paced),
        ("saturated", &report.saturated),
    ] {
        println!(
            "| {name} | {:.2} | {:.0} | {:.2} | {:.2} | {:.2} | {:.2} |",
            p.wall_s,
            p.block_ops_per_s,
            p.lookup_us.p50,
            p.lookup_us.p90,
            p.lookup_us.p99,
            p.lookup_us.mean
        );
    }
    println!(
        "index at end: {} blocks, {:.0} B/block, {:.0} B/entry; peak RSS {:.0} MiB",
        report.final_blocks,
        report.bytes_per_block,
        report.bytes_per_entry,
        report.peak_rss_bytes as f64 / (1 << 20) as f64
    );
}
