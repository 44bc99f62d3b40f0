//! Criterion suites of kvroute, one entry for the workspace; names read as paths.
#![allow(missing_docs)]

use std::hint::black_box;
use std::num::NonZeroUsize;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kvroute::indexer::{Config as IndexerConfig, Indexer};
use kvroute::protocol::{
    DpRank, EventBatch, KvEvent, KvEventData, Limits, LocalHash, Salt, SeqHash, StoredBlock, Tier,
    WorkerId, decode, encode, hash_blocks, local_hash, seq_hash,
};
use kvroute_worker::EngineConfig;
use kvroute_worker::block_manager::BlockManager;
use kvroute_worker::engine::{Engine, OutputKind, Request, RequestId};

fn protocol(c: &mut Criterion) {
    let tokens: Vec<u32> = (0..32_768u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 128_000)
        .collect();
    let block_size = NonZeroUsize::new(16).expect("invariant: non-zero");
    let mut group = c.benchmark_group("protocol/hash");
    group.throughput(Throughput::Bytes((tokens.len() * 4) as u64));
    group.bench_function("32768_tokens/block_16", |b| {
        b.iter(|| hash_blocks(black_box(&tokens), block_size, Salt::NONE))
    });
    // One block at a time, as an engine's mirror and the worker's decode hash them.
    group.throughput(Throughput::Bytes(16 * 4));
    group.bench_function("local_hash/16_tokens", |b| {
        b.iter(|| local_hash(black_box(&tokens[..16])))
    });
    group.finish();

    let batch = EventBatch {
        worker: WorkerId(3),
        dp_rank: DpRank(0),
        epoch: 42,
        sent_unix_us: 1,
        events: vec![KvEvent {
            id: 1,
            tier: Tier::Device,
            data: KvEventData::Stored {
                parent: Some(SeqHash(9)),
                blocks: (0..1000u64)
                    .map(|i| StoredBlock {
                        seq: SeqHash(i * 31),
                        local: LocalHash(i * 17),
                    })
                    .collect(),
            },
        }],
    };
    let bytes = encode(&batch).expect("invariant: encodable");
    let limits = Limits::default();
    let mut group = c.benchmark_group("protocol/codec");
    group.throughput(Throughput::Elements(1000));
    group.bench_function("encode/stored_1000_blocks", |b| {
        b.iter(|| encode(black_box(&batch)))
    });
    group.bench_function("decode/stored_1000_blocks", |b| {
        b.iter(|| decode(black_box(&bytes), &limits))
    });
    group.finish();
}

fn chain(start: u64, n: u64) -> Vec<(Option<SeqHash>, StoredBlock)> {
    (0..n)
        .map(|i| {
            let parent = (i > 0).then(|| SeqHash(start + i - 1));
            (
                parent,
                StoredBlock {
                    seq: SeqHash(start + i),
                    local: LocalHash(start + i),
                },
            )
        })
        .collect()
}

fn block_manager(c: &mut Criterion) {
    let config = EngineConfig::default();
    let bm = BlockManager::new(&config);
    let prefix = chain(1, 128);
    let seqs: Vec<SeqHash> = prefix.iter().map(|(_, b)| b.seq).collect();
    let mut holder = bm.lease();
    bm.allocate(0, &mut holder, 128)
        .expect("invariant: empty cache");
    bm.register(&mut holder, 0, prefix.iter().copied());
    let mut group = c.benchmark_group("block_manager");
    group.throughput(Throughput::Elements(128));
    group.bench_function("allocate_release/128_blocks", |b| {
        b.iter(|| {
            let mut lease = bm.lease();
            bm.allocate(0, &mut lease, 128).expect("invariant: room");
            lease
        })
    });
    group.bench_function("match_prefix/128_blocks/active_hit", |b| {
        b.iter(|| bm.acquire_prefix(black_box(&seqs)))
    });
    drop(holder);
    group.bench_function("match_prefix/128_blocks/inactive_hit", |b| {
        b.iter(|| bm.acquire_prefix(black_box(&seqs)))
    });
    group.bench_function("release/128_blocks", |b| {
        b.iter_batched(|| bm.acquire_prefix(&seqs).0, drop, BatchSize::SmallInput)
    });
    group.finish();
}

/// An engine with 256 sequences in steady decode, G1 sized so that `steps` more decode
/// steps run without eviction or preemption.
fn decoding_engine(steps: u64) -> (Engine, u64) {
    let g1_blocks = 256 * (512 + steps as usize + 32).div_ceil(16);
    let config = EngineConfig {
        g1_blocks,
        g2_blocks: 0,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(config, WorkerId(1), DpRank(0), 1).expect("invariant: valid");
    let mut out = Vec::new();
    for i in 0..256u32 {
        let prompt: Vec<u32> = (0..512).map(|t| i * 1000 + t).collect();
        let id = RequestId(u64::from(i));
        let max_tokens = steps as u32 + 16;
        engine.submit(
            0,
            Request {
                id,
                prompt: prompt.into(),
                max_tokens,
                salt: Salt::NONE,
            },
            &mut out,
        );
    }
    let mut now = 0;
    let mut first_tokens = 0;
    while first_tokens < 256 {
        engine
            .advance(now, &mut out)
            .expect("invariant: no byte mode");
        first_tokens += out
            .iter()
            .filter(|o| matches!(o.kind, OutputKind::Token { .. }))
            .count();
        out.clear();
        now = engine.next_wakeup_us().expect("invariant: busy");
    }
    (engine, now)
}

fn engine(c: &mut Criterion) {
    let mut group = c.benchmark_group("engine");
    group.throughput(Throughput::Elements(256));
    group.bench_function("step/256_running", |b| {
        b.iter_custom(|steps| {
            let (mut engine, _) = decoding_engine(steps);
            let (mut out, mut batches) = (Vec::new(), Vec::new());
            let start = std::time::Instant::now();
            for _ in 0..steps {
                let now = engine.next_wakeup_us().expect("invariant: busy");
                engine
                    .advance(now, &mut out)
                    .expect("invariant: no byte mode");
                engine.drain_batches(&mut batches);
                out.clear();
                batches.clear();
            }
            start.elapsed()
        })
    });
    group.finish();
}

/// `workers` workers whose chains of `depth` blocks share the first half and differ after.
fn populated_index(workers: u64, depth: u64) -> (Indexer, Vec<LocalHash>) {
    let ix = Indexer::new(IndexerConfig::default()).expect("invariant: valid config");
    let mut query = Vec::new();
    for w in 0..workers {
        let locals: Vec<LocalHash> = (0..depth)
            .map(|i| LocalHash(if i < depth / 2 { i } else { w << 32 | i }))
            .collect();
        let mut parent = None;
        let blocks = locals
            .iter()
            .map(|l| {
                let seq = seq_hash(parent, *l, Salt::NONE);
                parent = Some(seq);
                StoredBlock { seq, local: *l }
            })
            .collect();
        let event = KvEvent {
            id: 1,
            tier: Tier::Device,
            data: KvEventData::Stored {
                parent: None,
                blocks,
            },
        };
        ix.apply(&EventBatch {
            worker: WorkerId(w),
            dp_rank: DpRank(0),
            epoch: 1,
            sent_unix_us: 0,
            events: vec![event],
        });
        if w == 0 {
            query = locals;
        }
    }
    (ix, query)
}

fn indexer(c: &mut Criterion) {
    let mut group = c.benchmark_group("indexer/find_matches");
    for depth in [16u64, 128, 1024] {
        for workers in [8u64, 64, 512] {
            let (ix, query) = populated_index(workers, depth);
            group.throughput(Throughput::Elements(depth));
            group.bench_function(format!("depth_{depth}/{workers}_workers"), |b| {
                b.iter(|| ix.find_matches(black_box(&query)))
            });
        }
    }
    group.finish();
}

/// Scoring every worker for a request whose whole prompt (512 blocks) every worker already
/// holds through a booking: the booked-prefix check per worker is the cost that grows with
/// fleet and prompt.
fn scheduler(c: &mut Criterion) {
    use kvroute::indexer::{Overlap, OverlapScores};
    use kvroute::scheduler::{BookingId, Config, RouteRequest, Scheduler, SharedBooking};
    let mut group = c.benchmark_group("scheduler/candidates");
    let blocks = hash_blocks(
        &(0..512 * 16).collect::<Vec<u32>>(),
        NonZeroUsize::new(16).expect("16 > 0"),
        Salt::NONE,
    );
    for workers in [8u64, 256, 1024] {
        let mut s = Scheduler::new(Config::default()).expect("the default config is valid");
        for w in 0..workers {
            s.add_worker((WorkerId(w), DpRank(0)), 1 << 20, "m");
            s.book_shared(
                0,
                SharedBooking {
                    id: BookingId { origin: 1, seq: w },
                    worker: WorkerId(w),
                    dp_rank: DpRank(0),
                    prefill_blocks: 0.0,
                    blocks: blocks.iter().map(|b| b.seq).collect(),
                    tail: false,
                    prefill_tokens: 0.0,
                    decode_tokens: 0,
                    session: None,
                },
            )
            .expect("a known worker");
        }
        // None cached, or a shared system prompt (64 blocks) cached on every worker.
        let cached = OverlapScores {
            workers: (0..workers)
                .map(|w| Overlap {
                    worker: WorkerId(w),
                    dp_rank: DpRank(0),
                    device: 64,
                    host: 0,
                    disk: 0,
                })
                .collect(),
        };
        for (name, overlaps) in [
            ("none_cached", OverlapScores::default()),
            ("all_cached", cached),
        ] {
            let request = RouteRequest {
                model: "m",
                blocks: &blocks,
                prompt_tokens: blocks.len() * 16,
                block_size: 16,
                overlaps: &overlaps,
                max_tokens: 16,
                n: 1,
                session: None,
            };
            group.bench_function(format!("512_booked_blocks/{name}/{workers}_workers"), |b| {
                b.iter(|| s.candidates(0, black_box(&request)))
            });
        }
    }
    group.finish();
}

criterion_group!(benches, protocol, block_manager, engine, indexer, scheduler);
criterion_main!(benches);
