//! Dense slots for (worker, dp rank) pairs, so the block map stores 8-byte [`SlotRef`]s
//! instead of full identities, and slots are reused after a worker leaves.
//!
//! Reuse is the hazard: a lookup may read a block's owner list, then the owner is removed and
//! its slot handed to a new worker before the lookup resolves the slot. Crediting the new
//! worker would be an overcount. Every occupation therefore has a generation (even = occupied,
//! odd = free), refs carry it, and [`SlotTable::resolve`] is a seqlock read: generation,
//! identity, generation again; a ref resolves only while its generation is current. Stale refs
//! still in the map until the removal cleans them up resolve to nothing.

use crate::protocol::{DpRank, WorkerId};

use super::sync::{AtomicU32, AtomicU64, Mutex, Ordering};

/// A (slot, generation) pair naming one incarnation of a worker's registration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct SlotRef {
    pub index: u32,
    pub generation: u32,
}

#[derive(Debug)]
struct Slot {
    generation: AtomicU32,
    worker: AtomicU64,
    rank: AtomicU32,
}

/// A fixed table of slots.
#[derive(Debug)]
pub(crate) struct SlotTable {
    slots: Box<[Slot]>,
    free: Mutex<Vec<u32>>,
    /// Under `cfg(test)`, a deliberately broken `resolve` for the loom negative control.
    #[cfg(all(test, kvroute_loom))]
    pub broken_resolve: bool,
    /// Under `cfg(test)`, walks skip the block-0 re-read (the loom negative control).
    #[cfg(all(test, kvroute_loom))]
    pub broken_walk: bool,
}

impl SlotTable {
    pub(crate) fn new(capacity: u32) -> Self {
        SlotTable {
            slots: (0..capacity)
                .map(|_| Slot {
                    generation: AtomicU32::new(1),
                    worker: AtomicU64::new(0),
                    rank: AtomicU32::new(0),
                })
                .collect(),
            free: Mutex::new((0..capacity).rev().collect()),
            #[cfg(all(test, kvroute_loom))]
            broken_resolve: false,
            #[cfg(all(test, kvroute_loom))]
            broken_walk: false,
        }
    }

    /// Takes a free slot for `(worker, rank)`; `None` when all are taken.
    pub(crate) fn occupy(&self, worker: WorkerId, rank: DpRank) -> Option<SlotRef> {
        let index = self.free.lock().pop()?;
        let slot = &self.slots[index as usize];
        // Identity first, then the generation that publishes it.
        slot.worker.store(worker.0, Ordering::SeqCst);
        slot.rank.store(rank.0, Ordering::SeqCst);
        let generation = slot.generation.load(Ordering::SeqCst).wrapping_add(1);
        slot.generation.store(generation, Ordering::SeqCst);
        Some(SlotRef { index, generation })
    }

    /// Ends an occupation and makes the slot reusable ([`SlotTable::retire`], then
    /// [`SlotTable::release`]; the loom model of slot reuse).
    #[cfg(all(test, kvroute_loom))]
    pub(crate) fn vacate(&self, r: SlotRef) {
        self.retire(r);
        self.release(r.index);
    }

    /// Ends an occupation: its refs stop resolving and lookups stop crediting it at once.
    /// The slot is not reusable until [`SlotTable::release`]d (after its entries are gone
    /// from the block map).
    pub(crate) fn retire(&self, r: SlotRef) {
        let slot = &self.slots[r.index as usize];
        debug_assert_eq!(slot.generation.load(Ordering::SeqCst), r.generation);
        slot.generation
            .store(r.generation.wrapping_add(1), Ordering::SeqCst);
    }

    /// Makes a retired slot reusable.
    pub(crate) fn release(&self, index: u32) {
        debug_assert!(self.slots[index as usize].generation.load(Ordering::SeqCst) % 2 == 1);
        self.free.lock().push(index);
    }

    /// The current occupation of slot `index`, if occupied.
    pub(crate) fn current(&self, index: u32) -> Option<SlotRef> {
        let generation = self
            .slots
            .get(index as usize)?
            .generation
            .load(Ordering::SeqCst);
        (generation % 2 == 0).then_some(SlotRef { index, generation })
    }

    /// The identity behind a ref, if its occupation is still current.
    pub(crate) fn resolve(&self, r: SlotRef) -> Option<(WorkerId, DpRank)> {
        let slot = self.slots.get(r.index as usize)?;
        if slot.generation.load(Ordering::SeqCst) != r.generation {
            return None;
        }
        let worker = WorkerId(slot.worker.load(Ordering::SeqCst));
        let rank = DpRank(slot.rank.load(Ordering::SeqCst));
        #[cfg(all(test, kvroute_loom))]
        if self.broken_resolve {
            return Some((worker, rank));
        }
        // Re-check: if the slot changed hands while we read, the identity may be the new
        // occupant's.
        (slot.generation.load(Ordering::SeqCst) == r.generation).then_some((worker, rank))
    }

    /// Slots in use.
    pub(crate) fn occupied(&self) -> usize {
        self.slots.len() - self.free.lock().len()
    }
}
