//! One lane per (worker, dp rank): the registration (its worker slot) and the lock that keeps
//! one worker's events in order. Lanes of different workers apply in parallel. What a worker
//! holds is not kept here: the block map's nodes say it.
//!
//! Lock order: registry, released before taking a lane; lane, then block-map shards. The one
//! race that matters is `apply` fetching a lane that `remove` is tearing down: `apply` would
//! add blocks for a slot nobody will clean up (the leak peers report). `remove` marks the
//! lane dead under its lock; `apply` re-checks after locking and starts over with a fresh
//! registration.

use crate::protocol::{DpRank, WorkerId};
use rustc_hash::FxHashMap;

use super::slots::{SlotRef, SlotTable};
use super::sync::{Arc, Mutex};

/// Tiers a worker holds a block in, as a bit set indexed by `Tier as u8`.
pub(crate) type TierMask = u8;

/// What one lane knows, guarded by its lock.
#[derive(Debug, Default)]
pub(crate) struct LaneState {
    /// Torn down: an `apply` that finds it so starts over with a fresh registration.
    pub dead: bool,
    /// The lane's scratch owner list (no allocation per event).
    pub scratch: Vec<super::table::Entry>,
    /// Entries the lane's slot holds, per tier (only this lane's lock writes them): a
    /// `Cleared` of a tier it holds nothing in walks nothing.
    pub held: [u64; crate::protocol::Tier::ALL.len()],
}

#[derive(Debug)]
pub(crate) struct Lane {
    pub slot: SlotRef,
    state: Mutex<LaneState>,
}

/// No slot is left for a new worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SlotsExhausted;

#[derive(Debug)]
pub(crate) struct Lanes {
    registry: Mutex<FxHashMap<(WorkerId, DpRank), Arc<Lane>>>,
    pub slots: SlotTable,
    /// Under `cfg(test)`, skip the dead-lane re-check (the loom negative control).
    #[cfg(all(test, kvroute_loom))]
    pub broken_apply: bool,
}

impl Lanes {
    pub(crate) fn new(max_workers: u32) -> Self {
        Lanes {
            registry: Mutex::new(FxHashMap::default()),
            slots: SlotTable::new(max_workers),
            #[cfg(all(test, kvroute_loom))]
            broken_apply: false,
        }
    }

    /// Runs `f` on the live lane of `(worker, rank)`, registering it first if needed.
    pub(crate) fn with_lane<R>(
        &self,
        worker: WorkerId,
        rank: DpRank,
        f: impl FnOnce(SlotRef, &mut LaneState) -> R,
    ) -> Result<R, SlotsExhausted> {
        loop {
            let lane = {
                let mut registry = self.registry.lock();
                match registry.get(&(worker, rank)) {
                    Some(lane) => Arc::clone(lane),
                    None => {
                        let slot = self.slots.occupy(worker, rank).ok_or(SlotsExhausted)?;
                        let lane = Arc::new(Lane {
                            slot,
                            state: Mutex::new(LaneState::default()),
                        });
                        registry.insert((worker, rank), Arc::clone(&lane));
                        lane
                    }
                }
            };
            let mut state = lane.state.lock();
            #[cfg(all(test, kvroute_loom))]
            let dead = state.dead && !self.broken_apply;
            #[cfg(not(all(test, kvroute_loom)))]
            let dead = state.dead;
            if dead {
                continue;
            }
            return Ok(f(lane.slot, &mut state));
        }
    }

    /// Unregisters every rank of `worker` (or one rank): each lane is marked dead under its
    /// lock and its slot retired (lookups stop crediting it at once). Returns the retired
    /// slots, whose entries the caller must strip from the block map before releasing them.
    pub(crate) fn remove(&self, worker: WorkerId, rank: Option<DpRank>) -> Vec<SlotRef> {
        let lanes: Vec<Arc<Lane>> = {
            let mut registry = self.registry.lock();
            match rank {
                // One rank: no scan of every lane under the lock each `apply` takes.
                Some(rank) => registry.remove(&(worker, rank)).into_iter().collect(),
                None => {
                    let keys: Vec<(WorkerId, DpRank)> = registry
                        .keys()
                        .filter(|(w, _)| *w == worker)
                        .copied()
                        .collect();
                    keys.iter().filter_map(|k| registry.remove(k)).collect()
                }
            }
        };
        lanes
            .iter()
            .map(|lane| {
                let mut state = lane.state.lock();
                state.dead = true;
                self.slots.retire(lane.slot);
                lane.slot
            })
            .collect()
    }

    /// Every registered lane.
    pub(crate) fn all(&self) -> Vec<((WorkerId, DpRank), Arc<Lane>)> {
        self.registry
            .lock()
            .iter()
            .map(|(k, v)| (*k, Arc::clone(v)))
            .collect()
    }
}
