use std::num::NonZeroUsize;

use proptest::prelude::*;

use super::*;

fn bs(n: usize) -> NonZeroUsize {
    NonZeroUsize::new(n).unwrap()
}

#[derive(serde::Deserialize)]
struct Golden {
    seed: u64,
    cases: Vec<GoldenCase>,
}

#[derive(serde::Deserialize)]
struct GoldenCase {
    name: String,
    block_size: usize,
    salt: String,
    tokens: Vec<u32>,
    blocks: Vec<GoldenBlock>,
}

#[derive(serde::Deserialize)]
struct GoldenBlock {
    local: String,
    seq: String,
}

#[test]
fn hashing_matches_independent_golden_vectors() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/hashes.json");
    let golden: Golden = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(golden.seed, HASH_SEED);
    assert!(
        golden.cases.len() >= 40,
        "only {} golden cases",
        golden.cases.len()
    );
    for case in &golden.cases {
        let salt = Salt(case.salt.parse().unwrap());
        let got = hash_blocks(&case.tokens, bs(case.block_size), salt);
        let want: Vec<BlockHash> = case
            .blocks
            .iter()
            .map(|b| BlockHash {
                local: LocalHash(b.local.parse().unwrap()),
                seq: SeqHash(b.seq.parse().unwrap()),
            })
            .collect();
        assert_eq!(got, want, "golden case {}", case.name);
    }
}

#[test]
fn unsalted_root_seq_equals_local() {
    let tokens: Vec<u32> = (0..64).collect();
    let blocks = hash_blocks(&tokens, bs(16), Salt::NONE);
    assert_eq!(blocks.len(), 4);
    assert_eq!(blocks[0].seq.0, blocks[0].local.0);
    assert_ne!(blocks[1].seq.0, blocks[1].local.0);
}

#[test]
fn salt_changes_every_seq_but_no_local() {
    let tokens: Vec<u32> = (0..64).collect();
    let plain = hash_blocks(&tokens, bs(16), Salt::NONE);
    let salted = hash_blocks(&tokens, bs(16), Salt(9));
    for (p, s) in plain.iter().zip(&salted) {
        assert_eq!(p.local, s.local);
        assert_ne!(p.seq, s.seq);
    }
}

#[test]
fn partial_tail_is_not_hashed() {
    let tokens: Vec<u32> = (0..40).collect();
    assert_eq!(hash_blocks(&tokens, bs(16), Salt::NONE).len(), 2);
    assert!(hash_blocks(&tokens[..15], bs(16), Salt::NONE).is_empty());
    assert!(hash_blocks(&[], bs(16), Salt::NONE).is_empty());
}

#[test]
fn extending_from_a_parent_equals_hashing_the_whole() {
    let tokens: Vec<u32> = (1000..1160).collect();
    let whole = hash_blocks(&tokens, bs(16), Salt(5));
    let mut split = hash_blocks(&tokens[..64], bs(16), Salt(5));
    let parent = split.last().map(|b| b.seq);
    extend_blocks(parent, &tokens[64..], bs(16), Salt(5), &mut split);
    assert_eq!(whole, split);
}

#[test]
fn every_scratch_size_hashes_the_tokens_bytes() {
    // One block is hashed from a small scratch, a long one from the large one, and one
    // above that streams through Xxh3; every path must be xxh3 of the little-endian bytes,
    // and `extend_blocks` (its own scratch) must agree with `local_hash`.
    let tokens: Vec<u32> = (0..5000).map(|i| i * 7919).collect();
    for len in [0, 1, 16, 63, 64, 65, 1023, 1024, 1025, 2048, 5000] {
        let bytes: Vec<u8> = tokens[..len].iter().flat_map(|t| t.to_le_bytes()).collect();
        let want = LocalHash(xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, HASH_SEED));
        assert_eq!(local_hash(&tokens[..len]), want, "{len} tokens");
        if len > 0 {
            let blocks = hash_blocks(&tokens[..len], bs(len), Salt::NONE);
            assert_eq!(blocks[0].local, want, "{len} tokens through extend_blocks");
        }
    }
}

fn stored(id: u64, parent: Option<u64>, seqs: std::ops::Range<u64>) -> KvEvent {
    KvEvent {
        id,
        tier: Tier::Device,
        data: KvEventData::Stored {
            parent: parent.map(SeqHash),
            blocks: seqs
                .map(|s| StoredBlock {
                    seq: SeqHash(s),
                    local: LocalHash(s ^ 0xff),
                })
                .collect(),
        },
    }
}

fn batch(events: Vec<KvEvent>) -> EventBatch {
    EventBatch {
        worker: WorkerId(7),
        dp_rank: DpRank(1),
        epoch: 99,
        sent_unix_us: 123,
        events,
    }
}

#[test]
fn codec_roundtrip_and_header() {
    let b = batch(vec![
        stored(1, None, 0..3),
        KvEvent {
            id: 2,
            tier: Tier::Host,
            data: KvEventData::Removed {
                blocks: vec![SeqHash(1)],
            },
        },
        KvEvent {
            id: 3,
            tier: Tier::Disk,
            data: KvEventData::Cleared,
        },
    ]);
    let bytes = encode(&b).unwrap();
    assert_eq!(&bytes[..3], b"KVR");
    assert_eq!(bytes[3], FORMAT_VERSION);
    assert_eq!(decode(&bytes, &Limits::default()).unwrap(), b);
}

#[test]
fn decode_rejects_bad_headers_and_limits() {
    let limits = Limits::default();
    let good = encode(&batch(vec![stored(1, None, 0..4)])).unwrap();
    assert!(matches!(
        decode(&good[..2], &limits),
        Err(DecodeError::Truncated { len: 2 })
    ));
    let mut bad = good.clone();
    bad[0] = b'X';
    assert!(matches!(
        decode(&bad, &limits),
        Err(DecodeError::BadMagic { .. })
    ));
    let mut bad = good.clone();
    bad[3] = 200;
    assert!(matches!(
        decode(&bad, &limits),
        Err(DecodeError::UnsupportedVersion { found: 200 })
    ));
    assert!(matches!(
        decode(&good[..good.len() - 1], &limits),
        Err(DecodeError::Malformed { .. })
    ));
    let tight = Limits {
        max_payload_bytes: good.len() - 1,
        ..limits
    };
    assert!(matches!(
        decode(&good, &tight),
        Err(DecodeError::TooLarge { .. })
    ));
    let few_blocks = Limits {
        max_blocks: 3,
        ..limits
    };
    assert!(matches!(
        decode(&good, &few_blocks),
        Err(DecodeError::TooManyBlocks { count: 4, .. })
    ));
    let two = encode(&batch(vec![
        stored(1, None, 0..1),
        stored(2, Some(0), 1..2),
    ]))
    .unwrap();
    let one_event = Limits {
        max_events: 1,
        ..limits
    };
    assert!(matches!(
        decode(&two, &one_event),
        Err(DecodeError::TooManyEvents { count: 2, .. })
    ));
}

#[test]
fn decode_rejects_id_gaps_and_zero() {
    let limits = Limits::default();
    let gap = encode(&batch(vec![
        stored(4, None, 0..1),
        stored(6, Some(0), 1..2),
    ]))
    .unwrap();
    assert!(matches!(
        decode(&gap, &limits),
        Err(DecodeError::BadEventId {
            found: 6,
            expected: 5
        })
    ));
    let zero = encode(&batch(vec![stored(0, None, 0..1)])).unwrap();
    assert!(matches!(
        decode(&zero, &limits),
        Err(DecodeError::BadEventId { found: 0, .. })
    ));
    let wrap = encode(&batch(vec![
        stored(u64::MAX, None, 0..1),
        stored(0, Some(0), 1..2),
    ]))
    .unwrap();
    assert!(decode(&wrap, &limits).is_err());
    // A stream's next id is its last plus one: the last id cannot be u64::MAX.
    let last = encode(&batch(vec![stored(u64::MAX, None, 0..1)])).unwrap();
    assert!(matches!(
        decode(&last, &limits),
        Err(DecodeError::LastId { found: u64::MAX })
    ));
}

#[test]
fn size_model_is_an_upper_bound() {
    for events in [
        vec![],
        vec![stored(1, None, 0..1)],
        vec![stored(1, Some(3), 0..1000)],
        vec![KvEvent {
            id: 1,
            tier: Tier::Host,
            data: KvEventData::Removed {
                blocks: vec![SeqHash(1); 999],
            },
        }],
        (1..=100)
            .map(|id| KvEvent {
                id,
                tier: Tier::Remote,
                data: KvEventData::Cleared,
            })
            .collect(),
    ] {
        let b = batch(events);
        assert!(encode(&b).unwrap().len() <= codec_bound(&b));
    }
}

fn codec_bound(b: &EventBatch) -> usize {
    // Mirrors the constants of codec.rs; if the layout grows this test fails first.
    68 + b
        .events
        .iter()
        .map(|e| {
            48 + match &e.data {
                KvEventData::Stored { blocks, .. } => 16 * blocks.len(),
                KvEventData::Removed { blocks } => 8 * blocks.len(),
                KvEventData::Cleared => 0,
            }
        })
        .sum::<usize>()
}

#[test]
fn split_rejects_a_limit_that_holds_nothing() {
    assert!(matches!(
        split_batch(&batch(vec![stored(1, None, 0..1)]), 10),
        Err(EncodeError::LimitTooSmall { .. })
    ));
}

/// An event larger than a payload is refused, not cut: its pieces would need ids the writer
/// has given to the events after it (a 4,096-block store cut in two at a 64 KiB limit made
/// the next batch's first event read as a duplicate, dropped with no gap to show it).
#[test]
fn split_refuses_an_event_larger_than_a_payload_and_keeps_every_id() {
    let b = batch(vec![
        stored(10, Some(77), 0..4_096),
        stored(11, Some(4_095), 4_096..4_097),
    ]);
    assert!(matches!(
        split_batch(&b, 64 << 10),
        Err(EncodeError::EventTooLarge { id: 10, limit, .. }) if limit == 64 << 10
    ));
    assert!(encode_split(&b, 64 << 10).is_err());
    // At the payload the writer's largest event needs, it goes whole, ids kept.
    let limit = payload_for_event(4_096);
    let parts = split_batch(&b, limit).unwrap();
    for bytes in encode_split(&b, limit).unwrap() {
        assert!(bytes.len() <= limit);
    }
    let events: Vec<KvEvent> = parts.into_iter().flat_map(|p| p.events).collect();
    assert_eq!(events, b.events);
}

/// Whatever an encoder fits in a payload decodes at that payload's limits: a server's
/// max_payload of 8 MiB gives snapshot chunks of 262,140 blocks and batches of more than
/// 131,072 removed blocks, which the fixed counts of 1 MiB refused (the resync asking for
/// them never ended).
#[test]
fn what_fits_a_large_payload_decodes_at_its_limits() {
    let max = 8 << 20;
    let limits = Limits::for_payload(max);
    let s = snapshot(200_000);
    let chunks = s.encode(max).unwrap();
    let mut assembler = SnapshotAssembler::default();
    let mut whole = None;
    for c in &chunks {
        whole = assembler
            .add(decode_snapshot_chunk(c, &limits).unwrap())
            .unwrap();
    }
    assert_eq!(whole.unwrap().blocks.len(), 200_000);
    let removed: Vec<KvEvent> = (0..49u64)
        .map(|i| KvEvent {
            id: i + 1,
            tier: Tier::Device,
            data: KvEventData::Removed {
                blocks: (i * 4_096..(i + 1) * 4_096).map(SeqHash).collect(),
            },
        })
        .collect();
    for bytes in encode_split(&batch(removed), max).unwrap() {
        decode(&bytes, &limits).unwrap();
    }
    assert_eq!(Limits::for_payload(1 << 20), Limits::default());
}

fn arb_event_data() -> impl Strategy<Value = KvEventData> {
    prop_oneof![
        (
            proptest::option::of(any::<u64>()),
            proptest::collection::vec((any::<u64>(), any::<u64>()), 0..300)
        )
            .prop_map(|(parent, blocks)| KvEventData::Stored {
                parent: parent.map(SeqHash),
                blocks: blocks
                    .into_iter()
                    .map(|(s, l)| StoredBlock {
                        seq: SeqHash(s),
                        local: LocalHash(l)
                    })
                    .collect(),
            }),
        proptest::collection::vec(any::<u64>(), 0..300).prop_map(|b| KvEventData::Removed {
            blocks: b.into_iter().map(SeqHash).collect()
        }),
        Just(KvEventData::Cleared),
    ]
}

fn arb_tier() -> impl Strategy<Value = Tier> {
    prop_oneof![
        Just(Tier::Device),
        Just(Tier::Host),
        Just(Tier::Disk),
        Just(Tier::Remote)
    ]
}

fn arb_batch() -> impl Strategy<Value = EventBatch> {
    (
        any::<u64>(),
        any::<u32>(),
        any::<u64>(),
        any::<u64>(),
        1u64..1_000_000,
        proptest::collection::vec((arb_tier(), arb_event_data()), 0..20),
    )
        .prop_map(|(worker, rank, epoch, sent, first, events)| EventBatch {
            worker: WorkerId(worker),
            dp_rank: DpRank(rank),
            epoch,
            sent_unix_us: sent,
            events: events
                .into_iter()
                .enumerate()
                .map(|(i, (tier, data))| KvEvent {
                    id: first + i as u64,
                    tier,
                    data,
                })
                .collect(),
        })
}

proptest! {
    #[test]
    fn prop_encode_decode_roundtrip(b in arb_batch()) {
        let bytes = encode(&b).unwrap();
        prop_assert_eq!(decode(&bytes, &Limits::default()).unwrap(), b);
    }

    #[test]
    fn prop_decode_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode(&bytes, &Limits::default());
    }

    #[test]
    fn prop_decode_corrupted_payload_never_panics(
        b in arb_batch(),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
    ) {
        let mut bytes = encode(&b).unwrap();
        for (at, value) in flips {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        if let Ok(decoded) = decode(&bytes, &Limits::default()) {
            // Whatever validates must satisfy the semantic checks.
            for pair in decoded.events.windows(2) {
                prop_assert_eq!(pair[1].id, pair[0].id + 1);
            }
        }
    }

    #[test]
    fn prop_split_keeps_every_event_once_with_its_id(
        b in arb_batch(),
        // Every event of arb_batch fits (at most 300 blocks).
        limit in payload_for_event(300)..20_000,
    ) {
        let parts = split_batch(&b, limit).unwrap();
        let payloads = encode_split(&b, limit).unwrap();
        prop_assert_eq!(parts.len(), payloads.len());
        let mut expected_id = b.first_id().unwrap_or(1);
        let mut all = Vec::new();
        for (part, bytes) in parts.iter().zip(&payloads) {
            prop_assert!(bytes.len() <= limit);
            let decoded = decode(bytes, &Limits::default()).unwrap();
            prop_assert_eq!(&decoded, part);
            prop_assert_eq!((part.worker, part.dp_rank, part.epoch), (b.worker, b.dp_rank, b.epoch));
            for e in &part.events {
                prop_assert_eq!(e.id, expected_id);
                expected_id += 1;
            }
            all.extend(part.events.iter().cloned());
        }
        prop_assert_eq!(&all, &b.events);
    }
}

fn snapshot(n: u64) -> Snapshot {
    Snapshot {
        worker: WorkerId(3),
        dp_rank: DpRank(1),
        epoch: 9,
        watermark: 41,
        blocks: (0..n)
            .map(|i| SnapshotBlock {
                tier: if i % 3 == 0 { Tier::Host } else { Tier::Device },
                parent: i.checked_sub(1).map(SeqHash),
                block: StoredBlock {
                    seq: SeqHash(i),
                    local: LocalHash(i + 7),
                },
            })
            .collect(),
    }
}

#[test]
fn snapshot_chunks_reassemble_in_any_order() {
    let snap = snapshot(1000);
    let mut chunks = snap.encode(4096).unwrap();
    assert!(chunks.len() > 5);
    assert!(chunks.iter().all(|c| c.len() <= 4096 && c[..3] == *b"KVS"));
    chunks.reverse();
    let mut assembler = SnapshotAssembler::default();
    let mut done = None;
    for (i, c) in chunks.iter().enumerate() {
        let chunk = decode_snapshot_chunk(c, &Limits::default()).unwrap();
        if i == 1 {
            // A duplicate of an earlier chunk is ignored.
            let first = decode_snapshot_chunk(&chunks[0], &Limits::default()).unwrap();
            assert!(assembler.add(first).unwrap().is_none());
        }
        if let Some(s) = assembler.add(chunk).unwrap() {
            assert_eq!(i, chunks.len() - 1);
            done = Some(s);
        }
    }
    assert_eq!(done.unwrap(), snap);
    // An empty snapshot is one chunk.
    let empty = snapshot(0).encode(4096).unwrap();
    assert_eq!(empty.len(), 1);
    let chunk = decode_snapshot_chunk(&empty[0], &Limits::default()).unwrap();
    assert_eq!(
        SnapshotAssembler::default().add(chunk).unwrap().unwrap(),
        snapshot(0)
    );
}

#[test]
fn snapshot_chunks_are_validated() {
    let bytes = snapshot(3).encode(4096).unwrap().remove(0);
    // An event batch is not a snapshot chunk, and vice versa.
    assert!(matches!(
        decode(&bytes, &Limits::default()),
        Err(DecodeError::BadMagic { .. })
    ));
    let batch_bytes = encode(&batch(vec![stored(1, None, 0..1)])).unwrap();
    assert!(decode_snapshot_chunk(&batch_bytes, &Limits::default()).is_err());
    let mut other = snapshot(3);
    other.epoch = 10;
    let mut assembler = SnapshotAssembler::default();
    let two = snapshot(300).encode(4096).unwrap();
    assembler
        .add(decode_snapshot_chunk(&two[0], &Limits::default()).unwrap())
        .unwrap();
    // An earlier incarnation's chunk does not join a later one's assembly.
    other.epoch = 8;
    let older = decode_snapshot_chunk(&other.encode(4096).unwrap()[0], &Limits::default()).unwrap();
    assert!(assembler.add(older).is_err());
    // A later incarnation's answer starts the assembly over, and completes.
    other.epoch = 10;
    let later = decode_snapshot_chunk(&other.encode(4096).unwrap()[0], &Limits::default()).unwrap();
    assert_eq!(assembler.add(later).unwrap(), Some(other.clone()));
    // A chunk numbered past its count never completes a set.
    let mut assembler = SnapshotAssembler::default();
    let first = decode_snapshot_chunk(&two[0], &Limits::default()).unwrap();
    let mut stray = first.clone();
    stray.index = 7;
    assembler.add(first).unwrap();
    let count = stray.count;
    assert_eq!(
        assembler.add(stray),
        Err(AssembleError::BadIndex { index: 7, count })
    );
    // A snapshot announcing more chunks than any can have is refused on its first.
    let mut huge = decode_snapshot_chunk(&bytes, &Limits::default()).unwrap();
    huge.count = crate::protocol::snapshot::MAX_SNAPSHOT_CHUNKS + 1;
    assert_eq!(
        SnapshotAssembler::default().add(huge),
        Err(AssembleError::TooLarge)
    );
    // Live ids resume after the watermark: it cannot be u64::MAX.
    let mut last = snapshot(3);
    last.watermark = u64::MAX;
    assert!(matches!(
        decode_snapshot_chunk(&last.encode(4096).unwrap()[0], &Limits::default()),
        Err(DecodeError::LastId { found: u64::MAX })
    ));
}

proptest! {
    #[test]
    fn prop_decode_snapshot_chunk_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_snapshot_chunk(&bytes, &Limits::default());
    }
}
