//! Criterion suites of kvroute, one entry for the workspace; names read as paths.
#![allow(missing_docs)]

use std::hint::black_box;
use std::num::NonZeroUsize;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvroute::protocol::{
    DpRank, EventBatch, KvEvent, KvEventData, Limits, LocalHash, Salt, SeqHash, StoredBlock, Tier,
    WorkerId, decode, encode, hash_blocks,
};

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

criterion_group!(benches, protocol);
criterion_main!(benches);
