//! Turns block-manager changes into KV events: coalesced into `Stored` chains and `Removed`
//! lists per tier, numbered without gaps within the worker's epoch, flushed as one
//! `EventBatch` per engine step (or when a batch grows large), and answers snapshot requests
//! with a resident set and the last id the flushed events cover.
//!
//! A [`Publisher`] trusts its source to alternate: a block is stored in a tier, then removed,
//! then perhaps stored again, never stored twice in a row nor removed unannounced. The
//! simulated engine's block manager is such a source, and its pools are the resident set its
//! snapshots carry. A real engine's event stream is not (it repeats stores, removes what it
//! never announced, restarts); its bridge puts an [`Announced`] in front, which keeps only
//! the changes that alter the announced set and is the resident set of its snapshots.

use kvroute::protocol::{
    DpRank, EventBatch, KvEvent, KvEventData, LocalHash, MAX_SNAPSHOT_BLOCKS, SeqHash, Snapshot,
    SnapshotBlock, StoredBlock, Tier, WorkerId, parents_first,
};
use rustc_hash::FxHashMap;

use crate::block_manager::Change;

/// Blocks per event at most, so that an encoded event always fits a NATS message (16 bytes
/// per stored block: 64 KiB) and the transport never has to cut (and renumber) an event.
pub const MAX_EVENT_BLOCKS: usize = 4096;

/// One resident block of a resident set: its tier, its parent and the block.
pub type ResidentBlock = (Tier, Option<SeqHash>, StoredBlock);

/// What has been announced about one (tier, block).
#[derive(Clone, Copy, Debug)]
struct Announcement {
    parent: Option<SeqHash>,
    local: LocalHash,
    /// Stores minus removes seen; the block is announced while this is positive.
    refs: u32,
}

/// The resident set announced for a source that may repeat itself: a block is announced by
/// its first store and withdrawn by the removal that matches its last store.
///
/// It holds at most [`MAX_SNAPSHOT_BLOCKS`] (tier, block) pairs, what one snapshot carries:
/// the engine's mirror counts blocks, each of which may be in several tiers, and a resident
/// set past the limit made snapshots every router refuses (that worker could never be
/// resynced). Stores past it are not announced (counted in [`Announced::capped`]): the
/// router knows less than the engine holds, never more.
#[derive(Clone, Debug)]
pub struct Announced {
    blocks: FxHashMap<(Tier, SeqHash), Announcement>,
    /// Announced blocks per tier (`Tier as usize`).
    resident: [u64; Tier::ALL.len()],
    unannounced_removals: u64,
    capped: u64,
    max: usize,
}

impl Default for Announced {
    fn default() -> Self {
        Announced::with_max(MAX_SNAPSHOT_BLOCKS)
    }
}

/// Pairs below which the map is not shrunk.
const SHRINK_FROM: usize = 1024;

impl Announced {
    /// An empty set announcing at most `max` (tier, block) pairs.
    pub fn with_max(max: usize) -> Self {
        Announced {
            blocks: FxHashMap::default(),
            resident: [0; Tier::ALL.len()],
            unannounced_removals: 0,
            capped: 0,
            max,
        }
    }

    /// Appends to `out`, in order, the changes of `changes` that alter the announced set.
    pub fn filter(&mut self, changes: &[Change], out: &mut Vec<Change>) {
        for change in changes {
            match *change {
                Change::Stored {
                    tier,
                    parent,
                    block,
                } => {
                    if self.blocks.len() >= self.max
                        && !self.blocks.contains_key(&(tier, block.seq))
                    {
                        self.capped += 1;
                        continue;
                    }
                    let entry = self
                        .blocks
                        .entry((tier, block.seq))
                        .or_insert(Announcement {
                            parent,
                            local: block.local,
                            refs: 0,
                        });
                    entry.refs += 1;
                    if entry.refs == 1 {
                        self.resident[tier as usize] += 1;
                        out.push(change.clone());
                    }
                }
                Change::Removed { tier, seq } => match self.blocks.get_mut(&(tier, seq)) {
                    Some(entry) if entry.refs > 1 => entry.refs -= 1,
                    Some(_) => {
                        self.blocks.remove(&(tier, seq));
                        self.resident[tier as usize] -= 1;
                        out.push(change.clone());
                    }
                    None => self.unannounced_removals += 1,
                },
            }
        }
        // A restarted engine's clear removes every block: the map gives its room back
        // rather than keeping its peak for good (the mirror in front does the same).
        if self.blocks.capacity() > SHRINK_FROM && self.blocks.len() < self.blocks.capacity() / 4 {
            self.blocks.shrink_to(2 * self.blocks.len());
        }
    }

    /// The announced blocks, in no order.
    pub fn blocks(&self) -> impl Iterator<Item = ResidentBlock> + '_ {
        self.blocks.iter().map(|(&(tier, seq), a)| {
            (
                tier,
                a.parent,
                StoredBlock {
                    seq,
                    local: a.local,
                },
            )
        })
    }

    /// How many blocks of `tier` are announced.
    pub fn resident(&self, tier: Tier) -> u64 {
        self.resident[tier as usize]
    }

    /// Removals of blocks never announced (dropped; a block refused at the cap counts
    /// here when it goes).
    pub fn unannounced_removals(&self) -> u64 {
        self.unannounced_removals
    }

    /// Stores not announced because the set was full.
    pub fn capped(&self) -> u64 {
        self.capped
    }

    /// Pairs the map has room for without growing.
    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.blocks.capacity()
    }
}

/// Counters of the publisher.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PublisherStats {
    /// Events published.
    pub events: u64,
}

/// One (worker, dp rank) event stream.
#[derive(Debug)]
pub struct Publisher {
    worker: WorkerId,
    dp_rank: DpRank,
    epoch: u64,
    next_id: u64,
    pending: Vec<KvEvent>,
    pending_blocks: usize,
    stats: PublisherStats,
}

impl Publisher {
    /// A stream for a new incarnation `epoch` of the worker; ids start at 1.
    pub fn new(worker: WorkerId, dp_rank: DpRank, epoch: u64) -> Self {
        Publisher {
            worker,
            dp_rank,
            epoch,
            next_id: 1,
            pending: Vec::new(),
            pending_blocks: 0,
            stats: PublisherStats::default(),
        }
    }

    /// The worker's incarnation.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Id of the last event handed out in a batch (0 before the first).
    pub fn last_event_id(&self) -> u64 {
        self.next_id - 1 - self.pending.len() as u64
    }

    /// Counters.
    pub fn stats(&self) -> PublisherStats {
        self.stats
    }

    /// Blocks waiting in unflushed events; flush when this grows past what one batch should
    /// carry.
    pub fn pending_blocks(&self) -> usize {
        self.pending_blocks
    }

    /// Records changes, in order, as pending events (the source alternates; see the module
    /// docs).
    pub fn record(&mut self, changes: &[Change]) {
        for change in changes {
            match *change {
                Change::Stored {
                    tier,
                    parent,
                    block,
                } => self.push_stored(tier, parent, block),
                Change::Removed { tier, seq } => self.push_removed(tier, seq),
            }
        }
    }

    fn push_stored(&mut self, tier: Tier, parent: Option<SeqHash>, block: StoredBlock) {
        self.pending_blocks += 1;
        if let Some(KvEvent {
            tier: t,
            data: KvEventData::Stored { blocks, .. },
            ..
        }) = self.pending.last_mut()
            && *t == tier
            && blocks.len() < MAX_EVENT_BLOCKS
            && blocks.last().map(|b| b.seq) == parent
        {
            blocks.push(block);
            return;
        }
        self.push(
            tier,
            KvEventData::Stored {
                parent,
                blocks: vec![block],
            },
        );
    }

    fn push_removed(&mut self, tier: Tier, seq: SeqHash) {
        self.pending_blocks += 1;
        if let Some(KvEvent {
            tier: t,
            data: KvEventData::Removed { blocks },
            ..
        }) = self.pending.last_mut()
            && *t == tier
            && blocks.len() < MAX_EVENT_BLOCKS
        {
            blocks.push(seq);
            return;
        }
        self.push(tier, KvEventData::Removed { blocks: vec![seq] });
    }

    fn push(&mut self, tier: Tier, data: KvEventData) {
        self.pending.push(KvEvent {
            id: self.next_id,
            tier,
            data,
        });
        self.next_id += 1;
        self.stats.events += 1;
    }

    /// A stream for the next incarnation `epoch` of the same worker: how a worker that left
    /// the fleet comes back without losing its cache. With blocks to `carry` (announced
    /// before and still held), id 1 stands for all of them and is never sent: a router
    /// that sees the incarnation start at 1 would go live empty, while one that misses id 1
    /// fetches the snapshot that carries them. Without, ids start at 1. Pending events must
    /// be flushed.
    pub fn renumbered(&self, epoch: u64, carry: bool) -> Publisher {
        debug_assert!(self.pending.is_empty(), "flush before renumbering");
        Publisher {
            worker: self.worker,
            dp_rank: self.dp_rank,
            epoch,
            next_id: if carry { 2 } else { 1 },
            pending: Vec::new(),
            pending_blocks: 0,
            stats: PublisherStats::default(),
        }
    }

    /// The pending events as one batch, if there are any.
    pub fn flush(&mut self, sent_unix_us: u64) -> Option<EventBatch> {
        if self.pending.is_empty() {
            return None;
        }
        self.pending_blocks = 0;
        Some(EventBatch {
            worker: self.worker,
            dp_rank: self.dp_rank,
            epoch: self.epoch,
            sent_unix_us,
            events: std::mem::take(&mut self.pending),
        })
    }

    /// A snapshot of `blocks`, the resident set the flushed events describe (the block
    /// manager's pools, or the bridge's [`Announced`]), with the last id those events cover.
    /// Pending events must be flushed first (the snapshot would otherwise include blocks
    /// whose events the router has not been sent); call [`Publisher::flush`] before.
    pub fn snapshot(&self, blocks: impl IntoIterator<Item = ResidentBlock>) -> Snapshot {
        debug_assert!(self.pending.is_empty(), "flush before taking a snapshot");
        Snapshot {
            worker: self.worker,
            dp_rank: self.dp_rank,
            epoch: self.epoch,
            watermark: self.last_event_id(),
            blocks: parents_first(blocks)
                .into_iter()
                .map(|(tier, parent, block)| SnapshotBlock {
                    tier,
                    parent,
                    block,
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests;
