//! Turns block-manager changes into KV events: coalesced into `Stored` chains and `Removed`
//! lists per tier, numbered without gaps within the worker's epoch, flushed as one
//! `EventBatch` per engine step (or when a batch grows large), and answers snapshot requests
//! with the resident set the published events describe and the last id they cover.

use kvroute::protocol::{
    DpRank, EventBatch, KvEvent, KvEventData, LocalHash, SeqHash, Snapshot, SnapshotBlock,
    StoredBlock, Tier, WorkerId, parents_first,
};
use rustc_hash::FxHashMap;

use crate::block_manager::Change;

/// Blocks per event at most, so that an encoded event always fits a NATS message (16 bytes
/// per stored block: 64 KiB) and the transport never has to cut (and renumber) an event.
pub const MAX_EVENT_BLOCKS: usize = 4096;

/// What the publisher has announced about one (tier, block).
#[derive(Clone, Copy, Debug)]
struct Announced {
    parent: Option<SeqHash>,
    local: LocalHash,
    /// Stores minus removes seen; the block is announced while this is positive.
    refs: u32,
}

/// Counters of what the publisher dropped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PublisherStats {
    /// Events published.
    pub events: u64,
    /// Removals of blocks never announced, not published.
    pub unannounced_removals: u64,
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
    announced: FxHashMap<(Tier, SeqHash), Announced>,
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
            announced: FxHashMap::default(),
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

    /// Records changes, in order, as pending events.
    pub fn record(&mut self, changes: &[Change]) {
        for change in changes {
            match *change {
                Change::Stored {
                    tier,
                    parent,
                    block,
                } => {
                    let entry = self
                        .announced
                        .entry((tier, block.seq))
                        .or_insert(Announced {
                            parent,
                            local: block.local,
                            refs: 0,
                        });
                    entry.refs += 1;
                    if entry.refs == 1 {
                        self.push_stored(tier, parent, block);
                    }
                }
                Change::Removed { tier, seq } => match self.announced.get_mut(&(tier, seq)) {
                    Some(entry) if entry.refs > 1 => entry.refs -= 1,
                    Some(_) => {
                        self.announced.remove(&(tier, seq));
                        self.push_removed(tier, seq);
                    }
                    None => self.stats.unannounced_removals += 1,
                },
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

    /// A stream for the next incarnation `epoch` of the same worker that has announced what
    /// this one had (its snapshot is the same set), ids from 1 again: how a worker that
    /// left the fleet comes back without losing its cache. Pending events must be flushed.
    pub fn renumbered(&self, epoch: u64) -> Publisher {
        debug_assert!(self.pending.is_empty(), "flush before renumbering");
        Publisher {
            worker: self.worker,
            dp_rank: self.dp_rank,
            epoch,
            next_id: 1,
            pending: Vec::new(),
            pending_blocks: 0,
            announced: self.announced.clone(),
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

    /// The resident set the flushed events describe, with their watermark. Pending events
    /// must be flushed first (the snapshot would otherwise include blocks whose events the
    /// router has not been sent); call [`Publisher::flush`] before.
    pub fn snapshot(&self) -> Snapshot {
        debug_assert!(self.pending.is_empty(), "flush before taking a snapshot");
        let blocks = parents_first(self.announced.iter().map(|(&(tier, seq), a)| {
            (
                tier,
                a.parent,
                StoredBlock {
                    seq,
                    local: a.local,
                },
            )
        }));
        Snapshot {
            worker: self.worker,
            dp_rank: self.dp_rank,
            epoch: self.epoch,
            watermark: self.last_event_id(),
            blocks: blocks
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
