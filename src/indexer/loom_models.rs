//! loom models of the indexer's two protocols, each with a negative control: the same model
//! against a deliberately broken variant must fail, or the model proves nothing.
//! Run: `RUSTFLAGS="--cfg kvroute_loom" cargo test --release -p kvroute loom`.

use std::panic::{AssertUnwindSafe, catch_unwind};

use loom::thread;

use super::lanes::Lanes;
use super::slots::SlotTable;
use super::sync::{Arc, Mutex};
use crate::protocol::{DpRank, SeqHash, WorkerId};

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
    let failed = catch_unwind(AssertUnwindSafe(|| slot_reuse_model(true))).is_err();
    assert!(failed, "loom did not catch the unchecked resolve");
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
                state.blocks.insert(SeqHash(1), 1);
                map.lock().push(slot);
            })
            .expect("slot");
        let applier = {
            let (lanes, map) = (Arc::clone(&lanes), Arc::clone(&map));
            thread::spawn(move || {
                lanes
                    .with_lane(WorkerId(1), DpRank(0), |slot, state| {
                        state.blocks.insert(SeqHash(2), 1);
                        map.lock().push(slot);
                    })
                    .expect("slot");
            })
        };
        lanes.remove(WorkerId(1), None, |slot, state| {
            state.blocks.clear();
            map.lock().retain(|s| *s != slot);
        });
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
    let failed = catch_unwind(AssertUnwindSafe(|| lane_teardown_model(true))).is_err();
    assert!(failed, "loom did not catch the missing dead-lane check");
}
