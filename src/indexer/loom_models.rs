//! loom models of the indexer's protocols, each with a negative control: the same model
//! against a deliberately broken variant must fail, or the model proves nothing.
//! Run: `RUSTFLAGS="--cfg kvroute_loom" cargo test --release -p kvroute loom`.

use std::panic::{AssertUnwindSafe, catch_unwind};

use loom::thread;

use super::lanes::Lanes;
use super::slots::SlotTable;
use super::sync::{Arc, AtomicU64, Mutex, Ordering};
use super::table::{Map, entry};
use super::{Config, Indexer};
use crate::protocol::{
    DpRank, EventBatch, KvEvent, KvEventData, LocalHash, SeqHash, StoredBlock, Tier, WorkerId,
};

/// Runs `model`'s deliberately broken variant, which must fail: a model whose negative
/// control passes proves nothing.
fn assert_caught(model: fn(bool), what: &str) {
    let failed = catch_unwind(AssertUnwindSafe(|| model(true))).is_err();
    assert!(failed, "loom did not catch {what}");
}

/// A reader resolving a ref while its slot is vacated and re-occupied by another worker
/// must get the old identity or nothing, never the new worker's.
fn slot_reuse_model(broken: bool) {
    loom::model(move || {
        #[allow(unused_mut)]
        let mut table = SlotTable::new(1);
        table.broken_resolve = broken;
        let table = Arc::new(table);
        let old = table.occupy(WorkerId(1), DpRank(0)).expect("a free slot");
        let reader = {
            let table = Arc::clone(&table);
            thread::spawn(move || table.resolve(old))
        };
        table.vacate(old);
        let new = table
            .occupy(WorkerId(2), DpRank(0))
            .expect("the slot again");
        assert_ne!(new, old);
        let seen = reader.join().expect("reader thread");
        assert!(
            seen.is_none() || seen == Some((WorkerId(1), DpRank(0))),
            "stale ref resolved to {seen:?}"
        );
    });
}

#[test]
fn loom_slot_reuse_never_credits_the_next_occupant() {
    slot_reuse_model(false);
}

#[test]
fn loom_slot_reuse_negative_control() {
    assert_caught(slot_reuse_model, "the unchecked resolve");
}

/// An `apply` racing `remove_worker` must not leave entries behind for a slot that was
/// torn down: every entry in the (stand-in) block map belongs to a registered lane.
fn lane_teardown_model(broken: bool) {
    loom::model(move || {
        #[allow(unused_mut)]
        let mut lanes = Lanes::new(2);
        lanes.broken_apply = broken;
        let lanes = Arc::new(lanes);
        let map: Arc<Mutex<Vec<super::slots::SlotRef>>> = Arc::new(Mutex::new(Vec::new()));
        // The worker exists before the race.
        lanes
            .with_lane(WorkerId(1), DpRank(0), |slot, state| {
                state.scratch.push(1);
                map.lock().push(slot);
            })
            .expect("slot");
        let applier = {
            let (lanes, map) = (Arc::clone(&lanes), Arc::clone(&map));
            thread::spawn(move || {
                lanes
                    .with_lane(WorkerId(1), DpRank(0), |slot, state| {
                        state.scratch.push(2);
                        map.lock().push(slot);
                    })
                    .expect("slot");
            })
        };
        for slot in lanes.remove(WorkerId(1), None) {
            // The block map is stripped after the lane is dead, before the slot is released.
            map.lock().retain(|s| *s != slot);
            lanes.slots.release(slot.index);
        }
        applier.join().expect("applier thread");
        let live: Vec<_> = lanes.all().into_iter().map(|(_, lane)| lane.slot).collect();
        for slot in map.lock().iter() {
            assert!(
                live.contains(slot),
                "entry left behind for dead slot {slot:?}"
            );
        }
    });
}

#[test]
fn loom_lane_teardown_leaks_nothing() {
    lane_teardown_model(false);
}

#[test]
fn loom_lane_teardown_negative_control() {
    assert_caught(lane_teardown_model, "the missing dead-lane check");
}

/// Table rule 1: a reader that matched a key reads that key's owners. Key `K` dies (its slot
/// becomes a tombstone) and key `J`, probing from the same position, is stored while a
/// reader looks `K` up: the reader must see `K`'s owners or nothing, never `J`'s. The broken
/// variant lets `J` take `K`'s tombstone.
fn tombstone_model(broken: bool) {
    const K: u64 = 11;
    const J: u64 = 22;
    loom::model(move || {
        let map = Arc::new(Map::new(2, 0));
        if broken {
            map.break_reuse();
        }
        map.write_shard(0).set(0, K, &[entry(1, 1)]);
        let reader = {
            let map = Arc::clone(&map);
            thread::spawn(move || {
                let mut buf = Vec::new();
                map.view().read(0, 0, K, &mut buf).then_some(buf)
            })
        };
        {
            let mut w = map.write_shard(0);
            w.set(0, K, &[]);
            w.set(0, J, &[entry(2, 1)]);
        }
        let seen = reader.join().expect("reader thread");
        assert!(
            seen.is_none() || seen == Some(vec![entry(1, 1)]),
            "a lookup of K read {seen:?}"
        );
    });
}

/// Table rule 2: a reader of a spilled owner set sees the whole set, old or new, never a
/// mix, while a writer replaces it (a new region, published by one store of the word). The
/// broken variant writes the new set over the old region, which the reader may be reading.
fn region_model(broken: bool) {
    const K: u64 = 11;
    let old: Vec<_> = (1..=4).map(|s| entry(s, 1)).collect();
    let new: Vec<_> = (5..=8).map(|s| entry(s, 1)).collect();
    loom::model(move || {
        let home = super::table::home_of_key(K);
        let map = Arc::new(Map::new(2, 0));
        if broken {
            map.break_regions();
        }
        map.write_shard(0).set(home, K, &old);
        let reader = {
            let map = Arc::clone(&map);
            thread::spawn(move || {
                let mut buf = Vec::new();
                map.view().read(0, home, K, &mut buf).then_some(buf)
            })
        };
        map.write_shard(0).set(home, K, &new);
        let seen = reader.join().expect("reader thread");
        assert!(
            seen.as_ref() == Some(&old) || seen.as_ref() == Some(&new),
            "a lookup of K read {seen:?}"
        );
    });
}

#[test]
fn loom_a_reader_sees_a_whole_spilled_set() {
    region_model(false);
}

#[test]
fn loom_region_negative_control() {
    assert_caught(region_model, "a region written over while readers read it");
}

#[test]
fn loom_a_reader_never_reads_another_keys_owners() {
    tombstone_model(false);
}

#[test]
fn loom_tombstone_reuse_negative_control() {
    assert_caught(tombstone_model, "a tombstone taken by another key");
}

/// The view rule: a rebuilt table is in the readers' view before anything is written to
/// it. A writer rebuilds shard 0 (compaction), empties key `K` in the new table and raises a
/// flag, all under the shard's lock; a reader that sees the flag must not read `K`'s old
/// owners. The broken rebuild publishes the view only when its writer lets go of the shard,
/// so the reader can pin the replaced table.
fn view_model(broken: bool) {
    const K: u64 = 11;
    loom::model(move || {
        // K's probe home, where the rebuild places it too (home 0 missed it in the rebuilt
        // table for most process seeds, and the model emptied nothing there).
        let home = super::table::home_of_key(K);
        let map = Arc::new(Map::new(2, 0));
        if broken {
            map.break_publish();
        }
        map.write_shard(0).set(home, K, &[entry(1, 1)]);
        let flag = Arc::new(AtomicU64::new(0));
        let reader = {
            let map = Arc::clone(&map);
            let flag = Arc::clone(&flag);
            thread::spawn(move || {
                if flag.load(Ordering::Acquire) == 0 {
                    return None;
                }
                let mut buf = Vec::new();
                map.view().read(0, home, K, &mut buf).then_some(buf)
            })
        };
        {
            let mut w = map.write_shard(0);
            w.compact();
            w.set(home, K, &[]);
            flag.store(1, Ordering::Release);
        }
        let seen = reader.join().expect("reader thread");
        assert_eq!(seen, None, "a lookup after the removal read K's old owners");
    });
}

#[test]
fn loom_a_lookup_pins_tables_that_were_current() {
    view_model(false);
}

#[test]
fn loom_view_negative_control() {
    assert_caught(view_model, "a view published after writes to its table");
}

fn stored(worker: u64, tier: Tier, seq: u64) -> EventBatch {
    EventBatch {
        worker: WorkerId(worker),
        dp_rank: DpRank(0),
        epoch: 1,
        sent_unix_us: 0,
        events: vec![KvEvent {
            id: 1,
            tier,
            data: KvEventData::Stored {
                parent: None,
                blocks: vec![StoredBlock {
                    seq: SeqHash(seq),
                    local: LocalHash(seq),
                }],
            },
        }],
    }
}

/// Removals that overlap share the reaper: two workers leave at once, each retiring its
/// slot and reaping; whichever finds the other reaping leaves its slot to it. Once both have
/// returned, neither worker's entries may be left in the map, and both slots must be free.
/// The broken reaper does not look again after letting go, so a slot retired during its
/// pass is never reaped.
fn reap_model(broken: bool) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(2);
    builder.check(move || {
        #[allow(unused_mut)]
        let mut ix = Indexer::new(Config {
            max_workers: 2,
            shards: 1,
            ..Config::default()
        })
        .expect("config");
        ix.broken_reap = broken;
        let ix = Arc::new(ix);
        ix.apply(&stored(1, Tier::Device, 100));
        ix.apply(&stored(2, Tier::Device, 200));
        let other = {
            let ix = Arc::clone(&ix);
            thread::spawn(move || ix.remove_worker(WorkerId(2)))
        };
        ix.remove_worker(WorkerId(1));
        other.join().expect("remover thread");
        let sizes = ix.sizes();
        assert_eq!(
            (sizes.blocks, sizes.entries, sizes.workers),
            (0, 0, 0),
            "a removed worker's entries or slot were left behind"
        );
    });
}

#[test]
fn loom_overlapping_removals_leave_nothing_behind() {
    reap_model(false);
}

#[test]
fn loom_reap_negative_control() {
    assert_caught(reap_model, "the reaper that does not look again");
}

/// Worker slots across a walk: worker 1 holds block 0 on the device; while a lookup of
/// blocks [0, 1] runs, worker 1 leaves and its slot goes to worker 2, which stores block 1 on
/// the host. Worker 2 never held block 0, so it may be credited with nothing. The broken
/// variant reads block 0's owners once, before the slots' generations (no re-read).
fn walk_model(broken: bool) {
    let mut builder = loom::model::Builder::new();
    // The writer side is long (a removal walks every shard); two preemptions cover the
    // interleavings that matter: one inside the reader's block-0 read, one in the writer.
    builder.preemption_bound = Some(2);
    builder.check(move || {
        let ix = Indexer::new(Config {
            max_workers: 1,
            shards: 2,
            ..Config::default()
        })
        .expect("config");
        #[allow(unused_mut)]
        let mut ix = ix;
        ix.lanes.slots.broken_walk = broken;
        let ix = Arc::new(ix);
        ix.apply(&stored(1, Tier::Device, 100));
        let reader = {
            let ix = Arc::clone(&ix);
            thread::spawn(move || ix.find_matches_seq(&[SeqHash(100), SeqHash(200)]))
        };
        ix.remove_worker(WorkerId(1));
        ix.apply(&stored(2, Tier::Host, 200));
        let seen = reader.join().expect("reader thread");
        let two = seen.get(WorkerId(2), DpRank(0));
        assert_eq!(
            (two.device, two.host, two.disk),
            (0, 0, 0),
            "worker 2 credited with worker 1's block"
        );
    });
}

#[test]
fn loom_a_reused_slot_is_never_credited_with_the_last_occupants_blocks() {
    walk_model(false);
}

#[test]
fn loom_walk_negative_control() {
    assert_caught(walk_model, "the walk without the block-0 re-read");
}

/// Table rule 4, reads in order: key B (shard 0) is held; a reader pins a view, then a
/// writer rebuilds B's shard, removes B and stores A (shard 1). The reader reads A until it
/// sees it, then B, as a walk reads its blocks through one pinned view: having seen A's
/// store it must see B's removal, which came first. The broken reader reads B through the
/// view it pinned, whose table for B's shard is the replaced one, without pinning again.
/// (The pin is made to come before the rebuild: loom's search did not reach that order
/// with the reader free to run at any point.)
fn order_model(broken: bool) {
    loom::model(move || {
        let map = Arc::new(Map::new(2, 0));
        let shard_of = |key: u64| map.shard_of(super::table::home_of_key(key));
        let a = (1..).find(|&k| shard_of(k) == 1).expect("a key in shard 1");
        let b = (1..).find(|&k| shard_of(k) == 0).expect("a key in shard 0");
        let home = super::table::home_of_key;
        map.write_shard(0).set(home(b), b, &[entry(1, 1)]);
        let pinned = Arc::new(AtomicU64::new(0));
        let reader = {
            let (map, pinned) = (Arc::clone(&map), Arc::clone(&pinned));
            thread::spawn(move || {
                let mut buf = Vec::new();
                let mut view = map.view();
                pinned.store(1, Ordering::Release);
                let mut read = |key: u64, shard: usize| {
                    if view.replaced(shard) && !broken {
                        view = map.view();
                    }
                    view.read(shard, home(key), key, &mut buf)
                };
                while !read(a, 1) {
                    thread::yield_now();
                }
                read(b, 0)
            })
        };
        while pinned.load(Ordering::Acquire) == 0 {
            thread::yield_now();
        }
        {
            let mut w = map.write_shard(0);
            w.compact();
            w.set(home(b), b, &[]);
        }
        map.write_shard(1).set(home(a), a, &[entry(1, 1)]);
        let seen_b = reader.join().expect("reader thread");
        assert!(
            !seen_b,
            "a reader that saw A's store saw B before its removal, which came first"
        );
    });
}

#[test]
fn loom_a_walk_reads_its_blocks_in_order() {
    order_model(false);
}

#[test]
fn loom_read_order_negative_control() {
    assert_caught(
        order_model,
        "a read through a replaced table after a later write",
    );
}
