use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use proptest::prelude::*;

use super::*;

fn chain(locals: &[u64]) -> Vec<StoredBlock> {
    let mut parent = None;
    locals
        .iter()
        .map(|l| {
            let local = LocalHash(*l);
            let seq = seq_hash(parent, local, Salt::NONE);
            parent = Some(seq);
            StoredBlock { seq, local }
        })
        .collect()
}

fn locals(ls: &[u64]) -> Vec<LocalHash> {
    ls.iter().map(|l| LocalHash(*l)).collect()
}

fn batch(worker: u64, events: Vec<(Tier, KvEventData)>) -> EventBatch {
    EventBatch {
        worker: WorkerId(worker),
        dp_rank: DpRank(0),
        epoch: 1,
        sent_unix_us: 0,
        events: events
            .into_iter()
            .enumerate()
            .map(|(i, (tier, data))| KvEvent {
                id: i as u64 + 1,
                tier,
                data,
            })
            .collect(),
    }
}

fn stored(parent: Option<SeqHash>, blocks: &[StoredBlock]) -> KvEventData {
    KvEventData::Stored {
        parent,
        blocks: blocks.to_vec(),
    }
}

fn removed(blocks: &[StoredBlock]) -> KvEventData {
    KvEventData::Removed {
        blocks: blocks.iter().map(|b| b.seq).collect(),
    }
}

fn index() -> Indexer {
    Indexer::new(Config::default()).unwrap()
}

fn overlap(ix: &Indexer, worker: u64, query: &[u64]) -> (u32, u32, u32) {
    let o = ix
        .find_matches(&locals(query))
        .get(WorkerId(worker), DpRank(0));
    (o.device, o.host, o.disk)
}

#[test]
fn device_prefix_per_worker() {
    let ix = index();
    let c = chain(&[1, 2, 3, 4]);
    ix.apply(&batch(1, vec![(Tier::Device, stored(None, &c))]));
    ix.apply(&batch(2, vec![(Tier::Device, stored(None, &c[..2]))]));
    assert_eq!(overlap(&ix, 1, &[1, 2, 3, 4, 5]), (4, 0, 0));
    assert_eq!(overlap(&ix, 2, &[1, 2, 3, 4, 5]), (2, 0, 0));
    assert_eq!(overlap(&ix, 1, &[1, 9]), (1, 0, 0));
    assert_eq!(overlap(&ix, 1, &[9]), (0, 0, 0));
    assert!(ix.find_matches(&locals(&[9])).workers.is_empty());
    assert_eq!(
        ix.sizes(),
        Sizes {
            blocks: 4,
            entries: 6,
            workers: 2
        }
    );
}

#[test]
fn stored_with_unknown_parent_is_rejected_whole() {
    let ix = index();
    let c = chain(&[1, 2, 3]);
    let out = ix.apply(&batch(
        1,
        vec![(Tier::Device, stored(Some(c[0].seq), &c[1..]))],
    ));
    assert_eq!(out.rejected_blocks, 2);
    assert_eq!(ix.counters().rejected_parent, 1);
    assert_eq!(ix.sizes().blocks, 0);
    // Another worker holding the parent does not make it known for this one.
    ix.apply(&batch(2, vec![(Tier::Device, stored(None, &c[..1]))]));
    ix.apply(&batch(
        1,
        vec![(Tier::Device, stored(Some(c[0].seq), &c[1..]))],
    ));
    assert_eq!(overlap(&ix, 1, &[1, 2, 3]), (0, 0, 0));
}

#[test]
fn removal_applies_known_and_counts_unknown() {
    let ix = index();
    let c = chain(&[1, 2, 3]);
    let other = chain(&[7, 8]);
    ix.apply(&batch(1, vec![(Tier::Device, stored(None, &c))]));
    let mut mixed = vec![other[0], c[2], other[1], c[1]];
    mixed.reverse();
    let out = ix.apply(&batch(1, vec![(Tier::Device, removed(&mixed))]));
    assert_eq!((out.removed, out.unknown_removed), (2, 2));
    assert_eq!(overlap(&ix, 1, &[1, 2, 3]), (1, 0, 0));
    // Duplicate removal: unknown now, nothing breaks.
    let out = ix.apply(&batch(1, vec![(Tier::Device, removed(&c[1..2]))]));
    assert_eq!(out.unknown_removed, 1);
}

#[test]
fn duplicate_stores_are_idempotent() {
    let ix = index();
    let c = chain(&[1, 2]);
    ix.apply(&batch(1, vec![(Tier::Device, stored(None, &c))]));
    ix.apply(&batch(1, vec![(Tier::Device, stored(None, &c))]));
    assert_eq!(ix.counters().duplicate_stored, 2);
    ix.apply(&batch(1, vec![(Tier::Device, removed(&c))]));
    assert_eq!(
        ix.sizes(),
        Sizes {
            blocks: 0,
            entries: 0,
            workers: 1
        }
    );
}

#[test]
fn host_continuation_after_device_anchor_and_from_root() {
    let ix = index();
    let c = chain(&[1, 2, 3, 4, 5]);
    ix.apply(&batch(
        1,
        vec![
            (Tier::Device, stored(None, &c[..2])),
            (Tier::Host, stored(Some(c[1].seq), &c[2..4])),
            (Tier::Disk, stored(Some(c[3].seq), &c[4..])),
        ],
    ));
    assert_eq!(overlap(&ix, 1, &[1, 2, 3, 4, 5]), (2, 2, 1));
    // Worker 2 holds the prefix only in host memory: enters at the root.
    ix.apply(&batch(2, vec![(Tier::Host, stored(None, &c[..3]))]));
    assert_eq!(overlap(&ix, 2, &[1, 2, 3, 4]), (0, 3, 0));
    // A gap in the continuation ends it.
    ix.apply(&batch(1, vec![(Tier::Host, removed(&c[2..3]))]));
    assert_eq!(overlap(&ix, 1, &[1, 2, 3, 4, 5]), (2, 0, 0));
}

#[test]
fn device_removed_before_host_stored_keeps_the_host_entry() {
    // Offload: the worker announces the G1 eviction before the G2 copy lands.
    let ix = index();
    let c = chain(&[1, 2, 3]);
    ix.apply(&batch(1, vec![(Tier::Device, stored(None, &c))]));
    ix.apply(&batch(1, vec![(Tier::Device, removed(&c[2..]))]));
    ix.apply(&batch(
        1,
        vec![(Tier::Host, stored(Some(c[1].seq), &c[2..]))],
    ));
    assert_eq!(overlap(&ix, 1, &[1, 2, 3]), (2, 1, 0));
    // And the anchor going away later does not take the host block with it.
    ix.apply(&batch(1, vec![(Tier::Device, removed(&c[1..2]))]));
    ix.apply(&batch(
        1,
        vec![(Tier::Host, stored(Some(c[0].seq), &c[1..2]))],
    ));
    assert_eq!(overlap(&ix, 1, &[1, 2, 3]), (1, 2, 0));
}

#[test]
fn cleared_and_remove_worker_return_to_empty() {
    let ix = index();
    let c = chain(&[1, 2, 3]);
    for w in 1..=3 {
        ix.apply(&batch(
            w,
            vec![
                (Tier::Device, stored(None, &c)),
                (Tier::Host, stored(None, &c)),
            ],
        ));
    }
    ix.apply(&batch(1, vec![(Tier::Device, KvEventData::Cleared)]));
    assert_eq!(overlap(&ix, 1, &[1, 2, 3]), (0, 3, 0));
    assert_eq!(ix.remove_worker(WorkerId(2)), 1);
    assert_eq!(overlap(&ix, 2, &[1, 2, 3]), (0, 0, 0));
    ix.remove_worker(WorkerId(1));
    ix.remove_worker(WorkerId(3));
    assert_eq!(ix.sizes(), Sizes::default());
    assert_eq!(ix.counters().workers_removed, 3);
}

/// A `Cleared` costs a walk of the map only for a tier its worker holds entries in, and a
/// batch walks once per tier however many it carries; the batch ends as its events applied
/// one by one leave the index.
#[test]
fn cleared_walks_only_what_it_must() {
    let (a, b, c) = (chain(&[1, 2]), chain(&[3, 4]), chain(&[5]));
    let events = |n: usize| {
        let mut events = Vec::new();
        for _ in 0..n {
            events.push((Tier::Device, stored(None, &a)));
            events.push((Tier::Host, stored(None, &b)));
            events.push((Tier::Device, KvEventData::Cleared));
        }
        events.push((Tier::Device, stored(None, &c)));
        events.push((Tier::Host, removed(&b[1..])));
        events
    };
    let one = index();
    // Nothing held yet: no walk.
    one.apply(&batch(1, vec![(Tier::Host, KvEventData::Cleared); 1000]));
    assert_eq!(one.counters().walks, 0);
    one.apply(&batch(1, events(1000)));
    assert_eq!(
        one.counters().walks,
        0,
        "the lane held nothing before the batch"
    );
    assert_eq!(one.counters().cleared, 2000);
    one.apply(&batch(1, events(3)));
    assert_eq!(one.counters().walks, 1);
    let each = index();
    for event in events(1000).into_iter().chain(events(3)) {
        each.apply(&batch(1, vec![event]));
    }
    assert_eq!(dumped(&one), dumped(&each));
    assert_eq!(one.sizes(), each.sizes());
    assert_eq!(overlap(&one, 1, &[5]), (1, 0, 0));
    assert_eq!(overlap(&one, 1, &[3, 4]), (0, 1, 0));
}

/// Blocks stored before the block cap refuses the rest of their chain count as the
/// worker's: a `Cleared` takes them away (and frees the cap).
#[test]
fn cleared_takes_what_a_capped_store_kept() {
    let ix = Indexer::new(Config {
        max_blocks: 2,
        ..Config::default()
    })
    .unwrap();
    let c = chain(&[1, 2, 3, 4]);
    ix.apply(&batch(1, vec![(Tier::Device, stored(None, &c))]));
    assert_eq!(ix.sizes().blocks, 2);
    assert_eq!(
        ix.counters().capped,
        2,
        "the refused block and the rest of its chain"
    );
    ix.apply(&batch(1, vec![(Tier::Device, KvEventData::Cleared)]));
    assert_eq!(
        ix.sizes().blocks,
        0,
        "a Cleared left what a capped store kept"
    );
    assert_eq!(overlap(&ix, 1, &[1, 2, 3, 4]), (0, 0, 0));
}

/// A retired rank is out of every lookup at once, though its entries wait for the reaper;
/// removals reaped together take one walk; the slots come back for new workers after it.
#[test]
fn retired_ranks_are_forgotten_at_once_and_reaped_together() {
    let ix = Indexer::new(Config {
        max_workers: 3,
        ..Config::default()
    })
    .unwrap();
    let shared = chain(&[1, 2, 3]);
    for w in 1..=3 {
        let own = chain(&[1, 2, 3, 100 + w]);
        ix.apply(&batch(
            w,
            vec![
                (Tier::Device, stored(None, &shared)),
                (Tier::Host, stored(Some(shared[2].seq), &own[3..])),
            ],
        ));
    }
    let full = ix.sizes();
    assert_eq!(ix.retire_rank(WorkerId(1), DpRank(0)), 1);
    assert_eq!(ix.retire_rank(WorkerId(2), DpRank(0)), 1);
    assert_eq!(overlap(&ix, 1, &[1, 2, 3, 101]), (0, 0, 0));
    assert_eq!(overlap(&ix, 2, &[1, 2, 3, 102]), (0, 0, 0));
    assert_eq!(overlap(&ix, 3, &[1, 2, 3, 103]), (3, 1, 0));
    assert!(ix.dump(None).iter().map(|h| h.worker).eq([WorkerId(3)]));
    let retired = ix.sizes();
    assert_eq!(
        (retired.blocks, retired.entries, retired.workers),
        (full.blocks, full.entries, 3),
        "entries and slots stay until reaped"
    );
    // Both slots are taken until then: a fourth worker finds none.
    ix.apply(&batch(4, vec![(Tier::Device, stored(None, &shared))]));
    assert_eq!(ix.counters().slots_exhausted, 1);
    // 2 × (3 device + 1 host) entries, in one walk.
    assert_eq!(ix.reap(), 8);
    assert_eq!(ix.reap(), 0, "nothing left to reap");
    let sizes = ix.sizes();
    assert_eq!((sizes.blocks, sizes.entries), (4, 4));
    ix.apply(&batch(4, vec![(Tier::Device, stored(None, &shared))]));
    ix.apply(&batch(5, vec![(Tier::Device, stored(None, &shared[..1]))]));
    assert_eq!(overlap(&ix, 4, &[1, 2, 3]), (3, 0, 0));
    assert_eq!(overlap(&ix, 5, &[1, 2, 3]), (1, 0, 0));
    assert_eq!(
        ix.remove_workers(&[WorkerId(3), WorkerId(4), WorkerId(5)]),
        3
    );
    assert_eq!(ix.sizes(), Sizes::default());
    assert_eq!(ix.counters().workers_removed, 5);
}

#[test]
fn a_readded_worker_starts_clean_and_slots_are_reused() {
    let ix = Indexer::new(Config {
        max_workers: 1,
        ..Config::default()
    })
    .unwrap();
    let c = chain(&[1, 2]);
    ix.apply(&batch(1, vec![(Tier::Device, stored(None, &c))]));
    // No slot for a second worker: counted, nothing applied.
    ix.apply(&batch(2, vec![(Tier::Device, stored(None, &c))]));
    assert_eq!(ix.counters().slots_exhausted, 1);
    ix.remove_worker(WorkerId(1));
    ix.apply(&batch(2, vec![(Tier::Device, stored(None, &c[..1]))]));
    assert_eq!(overlap(&ix, 2, &[1, 2]), (1, 0, 0));
    assert_eq!(overlap(&ix, 1, &[1, 2]), (0, 0, 0));
}

#[test]
fn block_cap_refuses_new_blocks_and_recovers() {
    let ix = Indexer::new(Config {
        max_blocks: 2,
        ..Config::default()
    })
    .unwrap();
    let c = chain(&[1, 2, 3, 4]);
    let out = ix.apply(&batch(1, vec![(Tier::Device, stored(None, &c))]));
    // The block the cap refused and the rest of its chain: 2 blocks.
    assert_eq!((out.stored, out.capped), (2, 2));
    // Existing blocks still take new owners at the cap.
    ix.apply(&batch(2, vec![(Tier::Device, stored(None, &c[..2]))]));
    assert_eq!(overlap(&ix, 2, &[1, 2]), (2, 0, 0));
    ix.remove_worker(WorkerId(1));
    ix.remove_worker(WorkerId(2));
    let out = ix.apply(&batch(1, vec![(Tier::Device, stored(None, &c[..2]))]));
    assert_eq!(out.stored, 2);
}

/// Table rule 4 in the walk: a table replaced after the walk pinned its view is read as it
/// is now. Worker 1 holds Z on the device and B on the host; after the pin B's shard is
/// rebuilt, B removed and A stored on the host (A in the other shard). A walk of [Z, A, B]
/// that read B through its pinned view credited both A and B, which no moment held.
#[test]
#[cfg(not(kvroute_loom))]
fn a_walk_reads_a_table_replaced_after_its_pin_as_it_is_now() {
    let ix = Indexer::new(Config {
        shards: 2,
        ..Config::default()
    })
    .unwrap();
    let shard = |seq: u64| ix.map.shard_of(super::home(SeqHash(seq)));
    let block = |seq: u64| StoredBlock {
        seq: SeqHash(seq),
        local: LocalHash(seq),
    };
    let (z, b) = (100, 300);
    let a = (200..).find(|&a| shard(a) != shard(b)).unwrap();
    ix.apply(&batch(1, vec![(Tier::Device, stored(None, &[block(z)]))]));
    ix.apply(&batch(1, vec![(Tier::Host, stored(None, &[block(b)]))]));
    let b_shard = shard(b);
    *ix.after_pin.0.lock().unwrap() = Some(Box::new(move |ix: &Indexer| {
        ix.map.write_shard(b_shard).compact();
        ix.apply(&batch(1, vec![(Tier::Host, removed(&[block(b)]))]));
        ix.apply(&batch(1, vec![(Tier::Host, stored(None, &[block(a)]))]));
    }));
    let seen = ix.find_matches_seq(&[SeqHash(z), SeqHash(a), SeqHash(b)]);
    let one = seen.get(WorkerId(1), DpRank(0));
    assert_eq!((one.device, one.host), (1, 1), "{one:?}");
}

/// Tables sized at start (`initial_blocks`) keep that size as blocks come and go and a
/// worker leaves: shrinking threw the presizing away at the first removal.
#[test]
fn presized_tables_keep_their_size() {
    let ix = Indexer::new(Config {
        initial_blocks: 1 << 16,
        shards: 4,
        ..Config::default()
    })
    .unwrap();
    let presized = ix.table_bytes();
    let c = chain(&[1, 2, 3]);
    ix.apply(&batch(1, vec![(Tier::Device, stored(None, &c))]));
    ix.apply(&batch(1, vec![(Tier::Device, removed(&c[2..]))]));
    ix.remove_worker(WorkerId(1));
    ix.shrink_to_fit();
    assert_eq!(ix.sizes().blocks, 0);
    assert_eq!(ix.table_bytes(), presized);
}

#[test]
fn foreign_hashing_is_counted() {
    let ix = index();
    let blocks = [
        StoredBlock {
            seq: SeqHash(10),
            local: LocalHash(1),
        },
        StoredBlock {
            seq: SeqHash(11),
            local: LocalHash(2),
        },
    ];
    ix.apply(&batch(1, vec![(Tier::Device, stored(None, &blocks))]));
    assert_eq!(ix.counters().hash_mismatch, 1);
}

#[test]
fn dump_lists_every_held_block_per_tier() {
    let ix = index();
    let c = chain(&[1, 2, 3]);
    let d = chain(&[1, 5]);
    ix.apply(&batch(
        4,
        vec![
            (Tier::Device, stored(None, &c)),
            (Tier::Device, stored(Some(c[0].seq), &d[1..])),
            (Tier::Host, stored(None, &c[..1])),
        ],
    ));
    ix.apply(&batch(5, vec![(Tier::Device, stored(None, &d))]));
    let dump = ix.dump(Some(WorkerId(4)));
    let mut want = vec![
        (Tier::Device, c[0].seq),
        (Tier::Device, c[1].seq),
        (Tier::Device, c[2].seq),
        (Tier::Device, d[1].seq),
        (Tier::Host, c[0].seq),
    ];
    want.sort();
    assert_eq!(
        dump,
        vec![Holding {
            worker: WorkerId(4),
            dp_rank: DpRank(0),
            blocks: want
        }]
    );
    assert_eq!(ix.dump(None).len(), 2);
    // The digest counts and XORs what the dump lists, row by row, without the list.
    let from_dump: Vec<Digest> = ix
        .dump(None)
        .into_iter()
        .flat_map(|h| {
            let mut rows: std::collections::BTreeMap<Tier, (u64, u64)> = Default::default();
            for (tier, seq) in &h.blocks {
                let row = rows.entry(*tier).or_default();
                row.0 += 1;
                row.1 ^= seq.0;
            }
            rows.into_iter().map(move |(tier, (blocks, xor))| Digest {
                worker: h.worker,
                dp_rank: h.dp_rank,
                tier,
                blocks,
                xor,
            })
        })
        .collect();
    assert_eq!(ix.digest(), from_dump);
    assert_eq!(ix.digest().len(), 3);
}

#[test]
fn a_block_shared_by_many_workers_spills_and_shrinks_back() {
    let ix = index();
    let c = chain(&[1, 2]);
    for w in 0..40 {
        ix.apply(&batch(w, vec![(Tier::Device, stored(None, &c))]));
    }
    ix.apply(&batch(7, vec![(Tier::Host, stored(None, &c))]));
    for w in 0..40 {
        assert_eq!(overlap(&ix, w, &[1, 2, 9]), (2, 0, 0));
    }
    for w in (0..40).filter(|w| *w != 7) {
        ix.apply(&batch(w, vec![(Tier::Device, removed(&c))]));
    }
    ix.apply(&batch(7, vec![(Tier::Device, removed(&c[1..]))]));
    assert_eq!(overlap(&ix, 7, &[1, 2]), (1, 1, 0));
    assert_eq!(overlap(&ix, 8, &[1, 2]), (0, 0, 0));
    assert_eq!(ix.sizes().entries, 3);
}

#[test]
fn memory_returns_after_every_worker_leaves() {
    let ix = index();
    let empty = ix.table_bytes();
    for w in 0..8u64 {
        for i in 0..2_000u64 {
            let c = chain(&[w * 10_000 + i, 1, 2, 3]);
            ix.apply(&batch(w, vec![(Tier::Device, stored(None, &c))]));
        }
    }
    assert!(ix.table_bytes() > 8 * empty);
    for w in 0..8u64 {
        ix.remove_worker(WorkerId(w));
    }
    assert_eq!(ix.sizes(), Sizes::default());
    assert_eq!(ix.table_bytes(), empty);
}

// ---- differential test against a plain model -------------------------------------------

/// The obvious implementation: per worker, per block, the set of tiers.
/// A (worker, rank) as one number in the model: `worker * 8 + rank`.
fn key(worker: WorkerId, rank: DpRank) -> u64 {
    worker.0 * 8 + u64::from(rank.0)
}

#[derive(Default, Clone)]
struct Model {
    /// Registered (worker, rank) keys and what each holds.
    held: BTreeMap<u64, BTreeMap<SeqHash, BTreeSet<Tier>>>,
    /// Most keys registered at once (the index's `max_workers`).
    max: usize,
}

impl Model {
    fn apply(&mut self, b: &EventBatch) {
        let k = key(b.worker, b.dp_rank);
        if !self.held.contains_key(&k) && self.held.len() >= self.max {
            return; // no free slot: the batch is dropped
        }
        let held = self.held.entry(k).or_default();
        for e in &b.events {
            match &e.data {
                KvEventData::Stored { parent, blocks } => {
                    if e.tier == Tier::Device
                        && parent.is_some_and(|p| {
                            !held.get(&p).is_some_and(|t| t.contains(&Tier::Device))
                        })
                    {
                        continue;
                    }
                    for blk in blocks {
                        held.entry(blk.seq).or_default().insert(e.tier);
                    }
                }
                KvEventData::Removed { blocks } => {
                    for s in blocks {
                        if let Some(t) = held.get_mut(s) {
                            t.remove(&e.tier);
                            if t.is_empty() {
                                held.remove(s);
                            }
                        }
                    }
                }
                KvEventData::Cleared => {
                    held.retain(|_, t| {
                        t.remove(&e.tier);
                        !t.is_empty()
                    });
                }
            }
        }
    }

    fn find(&self, query: &[StoredBlock]) -> BTreeSet<(u64, u32, u32, u32)> {
        let mut out = BTreeSet::new();
        for (w, held) in &self.held {
            let tiers = |b: &StoredBlock| held.get(&b.seq);
            let device = query
                .iter()
                .take_while(|b| tiers(b).is_some_and(|t| t.contains(&Tier::Device)))
                .count();
            let (mut host, mut disk) = (0u32, 0u32);
            for b in &query[device..] {
                match tiers(b).and_then(|t| t.iter().find(|t| **t != Tier::Device)) {
                    Some(Tier::Host) => host += 1,
                    Some(_) => disk += 1,
                    None => break,
                }
            }
            if device as u32 + host + disk > 0 {
                out.insert((*w, device as u32, host, disk));
            }
        }
        out
    }

    fn blocks(&self) -> BTreeSet<(u64, Tier, SeqHash)> {
        self.held
            .iter()
            .flat_map(|(w, h)| {
                h.iter()
                    .flat_map(move |(s, ts)| ts.iter().map(move |t| (*w, *t, *s)))
            })
            .collect()
    }
}

/// (worker, device, host, disk) of every worker with an overlap.
type Found = BTreeSet<(u64, u32, u32, u32)>;

/// A query through `find_matches` (unsalted, hashed by the index) or `find_matches_seq`.
fn found(ix: &Indexer, query: &[StoredBlock]) -> Found {
    let locals: Vec<LocalHash> = query.iter().map(|b| b.local).collect();
    let seqs: Vec<SeqHash> = query.iter().map(|b| b.seq).collect();
    let scores = if chain(&locals.iter().map(|l| l.0).collect::<Vec<_>>()) == query {
        ix.find_matches(&locals)
    } else {
        ix.find_matches_seq(&seqs)
    };
    scores
        .workers
        .iter()
        .map(|o| (key(o.worker, o.dp_rank), o.device, o.host, o.disk))
        .collect()
}

fn dumped(ix: &Indexer) -> BTreeSet<(u64, Tier, SeqHash)> {
    ix.dump(None)
        .into_iter()
        .flat_map(|h| {
            let k = key(h.worker, h.dp_rank);
            h.blocks.into_iter().map(move |(t, s)| (k, t, s))
        })
        .collect()
}

#[derive(Clone, Debug)]
enum Op {
    /// Store `path[from..]` (parent `path[from-1]`) for a worker in a tier.
    Store {
        worker: u64,
        rank: u32,
        tier: Tier,
        path: usize,
        from: usize,
    },
    /// Remove some blocks of some paths, shuffled, including ones never stored.
    Remove {
        worker: u64,
        rank: u32,
        tier: Tier,
        picks: Vec<(usize, usize)>,
    },
    Clear {
        worker: u64,
        rank: u32,
        tier: Tier,
    },
    RemoveWorker {
        worker: u64,
    },
}

fn arb_tier() -> impl Strategy<Value = Tier> {
    prop_oneof![6 => Just(Tier::Device), 3 => Just(Tier::Host), 1 => Just(Tier::Disk)]
}

/// A query: the first `cut` blocks of a path, then `tail` blocks no path shares (it diverges).
#[derive(Clone, Debug)]
struct Query {
    path: usize,
    cut: usize,
    tail: usize,
}

#[derive(Clone, Debug)]
struct Case {
    /// Most (worker, rank) pairs the index registers: below workers × ranks, batches of new
    /// pairs are dropped until a worker leaves.
    max_workers: u32,
    /// Paths over a 3-letter alphabet, so prefixes are shared a lot; some salted.
    paths: Vec<(Vec<u64>, bool)>,
    ops: Vec<Op>,
    queries: Vec<Query>,
}

fn arb_case() -> impl Strategy<Value = Case> {
    (
        2u64..=12,
        1u32..=3,
        2u32..=40,
        proptest::collection::vec(
            (proptest::collection::vec(1u64..4, 1..10), proptest::bool::weighted(0.25)),
            4..12,
        ),
    )
        .prop_flat_map(|(workers, ranks, max_workers, paths)| {
            let n = paths.len();
            let op = prop_oneof![
                8 => (0..workers, 0..ranks, arb_tier(), 0..n, 0usize..10).prop_map(|(worker, rank, tier, path, from)| Op::Store { worker, rank, tier, path, from }),
                4 => (0..workers, 0..ranks, arb_tier(), proptest::collection::vec((0..n, 0usize..10), 1..8))
                    .prop_map(|(worker, rank, tier, picks)| Op::Remove { worker, rank, tier, picks }),
                1 => (0..workers, 0..ranks, arb_tier()).prop_map(|(worker, rank, tier)| Op::Clear { worker, rank, tier }),
                1 => (0..workers).prop_map(|worker| Op::RemoveWorker { worker }),
            ];
            let query = (0..n, 1usize..10, prop_oneof![3 => Just(0usize), 1 => 1usize..3])
                .prop_map(|(path, cut, tail)| Query { path, cut, tail });
            (
                Just(max_workers),
                Just(paths),
                proptest::collection::vec(op, 1..60),
                proptest::collection::vec(query, 1..8),
            )
        })
        .prop_map(|(max_workers, paths, ops, queries)| Case { max_workers, paths, ops, queries })
}

/// A path's blocks, salted when the path says so.
fn path_chain((locals, salted): &(Vec<u64>, bool)) -> Vec<StoredBlock> {
    let salt = if *salted { Salt(77) } else { Salt::NONE };
    let mut parent = None;
    locals
        .iter()
        .map(|l| {
            let local = LocalHash(*l);
            let seq = seq_hash(parent, local, salt);
            parent = Some(seq);
            StoredBlock { seq, local }
        })
        .collect()
}

/// A query's blocks: a prefix of its path, then blocks of locals no path uses.
fn query_blocks(chains: &[Vec<StoredBlock>], q: &Query) -> Vec<StoredBlock> {
    let c = &chains[q.path];
    let mut blocks = c[..q.cut.min(c.len())].to_vec();
    for i in 0..q.tail {
        let local = LocalHash(100 + i as u64);
        let seq = seq_hash(blocks.last().map(|b| b.seq), local, Salt::NONE);
        blocks.push(StoredBlock { seq, local });
    }
    blocks
}

fn ranked(worker: u64, rank: u32, tier: Tier, data: KvEventData) -> EventBatch {
    let mut b = batch(worker, vec![(tier, data)]);
    b.dp_rank = DpRank(rank);
    b
}

fn to_batch(chains: &[Vec<StoredBlock>], op: &Op) -> Option<EventBatch> {
    Some(match op {
        Op::Store {
            worker,
            rank,
            tier,
            path,
            from,
        } => {
            let c = &chains[*path];
            let from = (*from).min(c.len() - 1);
            let parent = from.checked_sub(1).map(|i| c[i].seq);
            ranked(*worker, *rank, *tier, stored(parent, &c[from..]))
        }
        Op::Remove {
            worker,
            rank,
            tier,
            picks,
        } => {
            let mut blocks: Vec<StoredBlock> = picks
                .iter()
                .map(|(p, i)| {
                    let c = &chains[*p];
                    // Indices past the end name a block nobody stores.
                    c.get(*i).copied().unwrap_or(StoredBlock {
                        seq: SeqHash(*i as u64),
                        local: LocalHash(0),
                    })
                })
                .collect();
            blocks.reverse();
            ranked(*worker, *rank, *tier, removed(&blocks))
        }
        Op::Clear { worker, rank, tier } => ranked(*worker, *rank, *tier, KvEventData::Cleared),
        Op::RemoveWorker { .. } => return None,
    })
}

fn run_case(case: &Case, readers: usize) -> Result<(), TestCaseError> {
    let chains: Vec<Vec<StoredBlock>> = case.paths.iter().map(path_chain).collect();
    let queries: Vec<Vec<StoredBlock>> = case
        .queries
        .iter()
        .map(|q| query_blocks(&chains, q))
        .collect();
    let ix = Arc::new(
        Indexer::new(Config {
            max_workers: case.max_workers,
            ..Config::default()
        })
        .unwrap(),
    );
    let mut model = Model {
        max: case.max_workers as usize,
        ..Model::default()
    };
    // Every state the model passed through, in order. A concurrent reader walks a query's
    // blocks in order while the writer moves on, so it may see block i in one state and block
    // i + 1 in a later one; it must never credit a block in a tier that no state at or after
    // the previous block's held.
    let mut history: Vec<Model> = vec![model.clone()];
    let stop = Arc::new(AtomicBool::new(false));
    let results: Arc<parking_lot::Mutex<Vec<(usize, Found)>>> = Arc::default();
    let handles: Vec<_> = (0..readers)
        .map(|r| {
            let (ix, stop, results) = (Arc::clone(&ix), Arc::clone(&stop), Arc::clone(&results));
            let queries = queries.clone();
            std::thread::spawn(move || {
                let mut i = r;
                while !stop.load(Ordering::Relaxed) {
                    let q = i % queries.len();
                    let got = found(&ix, &queries[q]);
                    results.lock().push((q, got));
                    i += 1;
                }
            })
        })
        .collect();
    for op in &case.ops {
        match to_batch(&chains, op) {
            Some(b) => {
                ix.apply(&b);
                model.apply(&b);
            }
            None => {
                let Op::RemoveWorker { worker } = op else {
                    unreachable!()
                };
                ix.remove_worker(WorkerId(*worker));
                model.held.retain(|k, _| k / 8 != *worker);
            }
        }
        history.push(model.clone());
        if readers == 0 {
            for q in &queries {
                prop_assert_eq!(found(&ix, q), model.find(q));
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.join().unwrap();
    }
    for (q, got) in results.lock().iter() {
        for seen in got {
            prop_assert!(
                explained(&history, &queries[*q], *seen),
                "reader saw {seen:?} (worker, device, host, disk), which no ordered walk through \
                 the states the index passed through can give"
            );
        }
    }
    // Quiescent: exact.
    for q in &queries {
        prop_assert_eq!(found(&ix, q), model.find(q));
    }
    prop_assert_eq!(dumped(&ix), model.blocks());
    prop_assert_eq!(ix.sizes().workers, model.held.len());
    Ok(())
}

/// Whether a reader's `(worker, device, host, disk)` for `query` can come from reading block
/// 0 in some state, block 1 in the same or a later one, and so on: the first `device` blocks
/// in the device tier, the rest in a lower tier.
fn explained(history: &[Model], query: &[StoredBlock], seen: (u64, u32, u32, u32)) -> bool {
    let (worker, device, host, disk) = seen;
    let mut state = 0;
    for (i, block) in query
        .iter()
        .take((device + host + disk) as usize)
        .enumerate()
    {
        let fits = |m: &Model| {
            let tiers = m.held.get(&worker).and_then(|h| h.get(&block.seq));
            tiers.is_some_and(|t| {
                if i < device as usize {
                    t.contains(&Tier::Device)
                } else {
                    t.iter().any(|t| *t != Tier::Device)
                }
            })
        };
        match history[state..].iter().position(fits) {
            Some(later) => state += later,
            None => return false,
        }
    }
    true
}

#[test]
fn an_ordered_walk_explains_a_mix_of_states_and_nothing_more() {
    let c = chain(&[1, 2]);
    let held = |blocks: &[(usize, Tier)]| {
        let mut m = Model::default();
        for (i, t) in blocks {
            m.held
                .entry(7)
                .or_default()
                .entry(c[*i].seq)
                .or_default()
                .insert(*t);
        }
        m
    };
    // Block 0 on the host, then only block 1 on disk: a walk may credit both.
    let forward = [
        held(&[]),
        held(&[(0, Tier::Host)]),
        held(&[(1, Tier::Disk)]),
    ];
    assert!(explained(&forward, &c, (7, 0, 1, 1)));
    // The other order: block 1 was gone before block 0 came, so no walk credits both.
    let backward = [held(&[(1, Tier::Disk)]), held(&[(0, Tier::Host)])];
    assert!(!explained(&backward, &c, (7, 0, 1, 1)));
    assert!(explained(&backward, &c, (7, 0, 1, 0)));
    // Never held on the device: a device credit is never explained.
    assert!(!explained(&forward, &c, (7, 1, 0, 0)));
}

fn cases() -> u32 {
    std::env::var("KVROUTE_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn prop_matches_the_model_single_threaded(case in arb_case()) {
        run_case(&case, 0)?;
    }

    #[test]
    fn prop_matches_the_model_with_concurrent_readers(case in arb_case()) {
        run_case(&case, 2)?;
    }
}

/// A walk compares a spilled owner set with the last one by its packed words: sets of the
/// same size with other owners are told apart, and equal ones are taken as they are. Blocks
/// 0 and 1 are held by workers 1–6 (six owners, spilled), blocks 2 and 3 by workers 1–5
/// and, in G2 only, worker 7 (six again, one owner other than block 1's).
#[test]
fn equal_sized_spilled_sets_with_other_owners_are_told_apart() {
    let ix = index();
    let c = chain(&[1, 2, 3, 4]);
    for w in 1..=5 {
        ix.apply(&batch(w, vec![(Tier::Device, stored(None, &c))]));
    }
    ix.apply(&batch(6, vec![(Tier::Device, stored(None, &c[..2]))]));
    ix.apply(&batch(
        7,
        vec![(Tier::Host, stored(Some(c[1].seq), &c[2..]))],
    ));
    for w in 1..=5 {
        assert_eq!(overlap(&ix, w, &[1, 2, 3, 4]), (4, 0, 0), "worker {w}");
    }
    assert_eq!(overlap(&ix, 6, &[1, 2, 3, 4]), (2, 0, 0));
    assert_eq!(overlap(&ix, 7, &[1, 2, 3, 4]), (0, 0, 0));
}
