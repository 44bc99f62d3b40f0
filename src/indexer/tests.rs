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
    assert_eq!((out.stored, out.capped), (2, 1));
    // Existing blocks still take new owners at the cap.
    ix.apply(&batch(2, vec![(Tier::Device, stored(None, &c[..2]))]));
    assert_eq!(overlap(&ix, 2, &[1, 2]), (2, 0, 0));
    ix.remove_worker(WorkerId(1));
    ix.remove_worker(WorkerId(2));
    let out = ix.apply(&batch(1, vec![(Tier::Device, stored(None, &c[..2]))]));
    assert_eq!(out.stored, 2);
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
fn dump_lists_blocks_parents_first() {
    let ix = index();
    let c = chain(&[1, 2, 3]);
    let d = chain(&[1, 5]);
    ix.apply(&batch(
        4,
        vec![
            (Tier::Device, stored(None, &c)),
            (Tier::Device, stored(Some(c[0].seq), &d[1..])),
        ],
    ));
    let dump = ix.dump(Some(WorkerId(4)));
    assert_eq!(dump.len(), 1);
    let replay = index();
    replay.apply(&dump[0]);
    assert_eq!(replay.counters().rejected_parent, 0);
    assert_eq!(replay.dump(None), dump);
}

// ---- differential test against a plain model -------------------------------------------

/// The obvious implementation: per worker, per block, the set of tiers.
#[derive(Default, Clone)]
struct Model {
    held: BTreeMap<u64, BTreeMap<SeqHash, BTreeSet<Tier>>>,
}

impl Model {
    fn apply(&mut self, b: &EventBatch) {
        let held = self.held.entry(b.worker.0).or_default();
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

fn found(ix: &Indexer, query: &[StoredBlock]) -> Found {
    let locals: Vec<LocalHash> = query.iter().map(|b| b.local).collect();
    ix.find_matches(&locals)
        .workers
        .iter()
        .map(|o| (o.worker.0, o.device, o.host, o.disk))
        .collect()
}

fn dumped(ix: &Indexer) -> BTreeSet<(u64, Tier, SeqHash)> {
    ix.dump(None)
        .iter()
        .flat_map(|b| {
            b.events.iter().flat_map(move |e| match &e.data {
                KvEventData::Stored { blocks, .. } => blocks
                    .iter()
                    .map(|x| (b.worker.0, e.tier, x.seq))
                    .collect::<Vec<_>>(),
                _ => Vec::new(),
            })
        })
        .collect()
}

#[derive(Clone, Debug)]
enum Op {
    /// Store `path[from..]` (parent `path[from-1]`) for a worker in a tier.
    Store {
        worker: u64,
        tier: Tier,
        path: usize,
        from: usize,
    },
    /// Remove some blocks of some paths, shuffled, including ones never stored.
    Remove {
        worker: u64,
        tier: Tier,
        picks: Vec<(usize, usize)>,
    },
    Clear {
        worker: u64,
        tier: Tier,
    },
    RemoveWorker {
        worker: u64,
    },
}

fn arb_tier() -> impl Strategy<Value = Tier> {
    prop_oneof![6 => Just(Tier::Device), 3 => Just(Tier::Host), 1 => Just(Tier::Disk)]
}

#[derive(Clone, Debug)]
struct Case {
    workers: u64,
    /// Paths over a 3-letter alphabet, so prefixes are shared a lot.
    paths: Vec<Vec<u64>>,
    ops: Vec<Op>,
    queries: Vec<usize>,
}

fn arb_case() -> impl Strategy<Value = Case> {
    (2u64..=16, proptest::collection::vec(proptest::collection::vec(1u64..4, 1..10), 4..12))
        .prop_flat_map(|(workers, paths)| {
            let n = paths.len();
            let op = prop_oneof![
                8 => (0..workers, arb_tier(), 0..n, 0usize..10).prop_map(|(worker, tier, path, from)| Op::Store { worker, tier, path, from }),
                4 => (0..workers, arb_tier(), proptest::collection::vec((0..n, 0usize..10), 1..8))
                    .prop_map(|(worker, tier, picks)| Op::Remove { worker, tier, picks }),
                1 => (0..workers, arb_tier()).prop_map(|(worker, tier)| Op::Clear { worker, tier }),
                1 => (0..workers).prop_map(|worker| Op::RemoveWorker { worker }),
            ];
            (
                Just(workers),
                Just(paths),
                proptest::collection::vec(op, 1..60),
                proptest::collection::vec(0..n, 1..8),
            )
        })
        .prop_map(|(workers, paths, ops, queries)| Case { workers, paths, ops, queries })
}

fn to_batch(case: &Case, chains: &[Vec<StoredBlock>], op: &Op) -> Option<EventBatch> {
    Some(match op {
        Op::Store {
            worker,
            tier,
            path,
            from,
        } => {
            let c = &chains[*path];
            let from = (*from).min(c.len() - 1);
            let parent = from.checked_sub(1).map(|i| c[i].seq);
            batch(*worker, vec![(*tier, stored(parent, &c[from..]))])
        }
        Op::Remove {
            worker,
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
            batch(*worker, vec![(*tier, removed(&blocks))])
        }
        Op::Clear { worker, tier } => batch(*worker, vec![(*tier, KvEventData::Cleared)]),
        Op::RemoveWorker { .. } => {
            let _ = case;
            return None;
        }
    })
}

fn run_case(case: &Case, readers: usize) -> Result<(), TestCaseError> {
    let chains: Vec<Vec<StoredBlock>> = case.paths.iter().map(|p| chain(p)).collect();
    let ix = Arc::new(index());
    let mut model = Model::default();
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
            let queries: Vec<Vec<StoredBlock>> =
                case.queries.iter().map(|q| chains[*q].clone()).collect();
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
        match to_batch(case, &chains, op) {
            Some(b) => {
                ix.apply(&b);
                model.apply(&b);
            }
            None => {
                let Op::RemoveWorker { worker } = op else {
                    unreachable!()
                };
                ix.remove_worker(WorkerId(*worker));
                model.held.remove(worker);
            }
        }
        history.push(model.clone());
        if readers == 0 {
            for q in &case.queries {
                prop_assert_eq!(found(&ix, &chains[*q]), model.find(&chains[*q]));
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.join().unwrap();
    }
    let queries: Vec<&[StoredBlock]> = case.queries.iter().map(|q| &chains[*q][..]).collect();
    for (q, got) in results.lock().iter() {
        for seen in got {
            prop_assert!(
                explained(&history, queries[*q], *seen),
                "reader saw {seen:?} (worker, device, host, disk), which no ordered walk through \
                 the states the index passed through can give"
            );
        }
    }
    // Quiescent: exact.
    for q in &case.queries {
        prop_assert_eq!(found(&ix, &chains[*q]), model.find(&chains[*q]));
    }
    prop_assert_eq!(dumped(&ix), model.blocks());
    let _ = case.workers;
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
