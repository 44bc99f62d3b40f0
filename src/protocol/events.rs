//! KV events: what a worker tells the router about the blocks it caches (DESIGN §4).

use super::{DpRank, LocalHash, SeqHash, Tier, WorkerId};

/// One message of a worker's event stream: consecutive events of one (worker, dp rank,
/// epoch), with ids that continue the previous batch's without a gap.
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct EventBatch {
    /// The publishing worker.
    pub worker: WorkerId,
    /// Its data-parallel rank; each rank has its own cache and its own id sequence.
    pub dp_rank: DpRank,
    /// The worker process incarnation. A new epoch means a restart; a later incarnation has
    /// a larger epoch (workers put their start time, ms since the Unix epoch, in the high
    /// bits and random bits below), so stragglers of an old one are recognised as such.
    pub epoch: u64,
    /// When the worker sent the batch, µs since the Unix epoch (0 = unknown); the router
    /// derives event lag from it.
    pub sent_unix_us: u64,
    /// The events, ids ascending by one.
    pub events: Vec<KvEvent>,
}

/// One change to a worker's cache.
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct KvEvent {
    /// Position in the (worker, dp rank, epoch) stream: starts at 1, no gaps.
    pub id: u64,
    /// The memory tier the change happened in.
    pub tier: Tier,
    /// What changed.
    pub data: KvEventData,
}

/// The three things that can happen to a cache.
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum KvEventData {
    /// Blocks became resident: a chain continuing `parent` (or starting a sequence).
    Stored {
        /// `SeqHash` of the block just before `blocks[0]`; `None` at a sequence's root.
        parent: Option<SeqHash>,
        /// The stored blocks, in sequence order.
        blocks: Vec<StoredBlock>,
    },
    /// Blocks left the tier. Order is irrelevant and unknown hashes are tolerated.
    Removed {
        /// The removed blocks.
        blocks: Vec<SeqHash>,
    },
    /// Everything in the tier is gone.
    Cleared,
}

/// A stored block, named both ways: by prefix (`seq`, for events) and by content (`local`,
/// for lookups).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize,
)]
pub struct StoredBlock {
    /// Hash of the prefix ending at this block.
    pub seq: SeqHash,
    /// Hash of this block's tokens.
    pub local: LocalHash,
}

impl KvEventData {
    /// How many blocks the event names (0 for `Cleared`).
    pub fn block_count(&self) -> usize {
        match self {
            KvEventData::Stored { blocks, .. } => blocks.len(),
            KvEventData::Removed { blocks } => blocks.len(),
            KvEventData::Cleared => 0,
        }
    }
}

impl EventBatch {
    /// Id of the first event, if any.
    pub fn first_id(&self) -> Option<u64> {
        self.events.first().map(|e| e.id)
    }

    /// Id of the last event, if any.
    pub fn last_id(&self) -> Option<u64> {
        self.events.last().map(|e| e.id)
    }

    /// Total blocks named by all events.
    pub fn block_count(&self) -> usize {
        self.events.iter().map(|e| e.data.block_count()).sum()
    }
}

/// Orders resident blocks so that, within each tier, every block comes after its parent when
/// the parent is among them (depth-first from the blocks whose parent is absent). Snapshots
/// and dumps use it so that replaying them as `Stored` events never names an unknown parent.
pub fn parents_first(
    blocks: impl IntoIterator<Item = (Tier, Option<SeqHash>, StoredBlock)>,
) -> Vec<(Tier, Option<SeqHash>, StoredBlock)> {
    use std::collections::{HashMap, HashSet};
    let mut children: HashMap<(Tier, Option<SeqHash>), Vec<StoredBlock>> = HashMap::new();
    let mut present: HashSet<(Tier, SeqHash)> = HashSet::new();
    let mut count = 0;
    for (tier, parent, block) in blocks {
        present.insert((tier, block.seq));
        children.entry((tier, parent)).or_default().push(block);
        count += 1;
    }
    let mut roots: Vec<(Tier, Option<SeqHash>)> = children
        .keys()
        .filter(|(tier, parent)| parent.is_none_or(|p| !present.contains(&(*tier, p))))
        .copied()
        .collect();
    // Deterministic output for equal input sets.
    roots.sort_by_key(|(tier, parent)| (*tier, parent.map(|p| p.0)));
    let mut out = Vec::with_capacity(count);
    let mut stack: Vec<(Tier, Option<SeqHash>, StoredBlock)> = Vec::new();
    for (tier, parent) in roots {
        stack.extend(children[&(tier, parent)].iter().map(|b| (tier, parent, *b)));
        while let Some((tier, parent, block)) = stack.pop() {
            out.push((tier, parent, block));
            if let Some(kids) = children.get(&(tier, Some(block.seq))) {
                stack.extend(kids.iter().map(|k| (tier, Some(block.seq), *k)));
            }
        }
    }
    out
}

/// A change to the resident set of a tier, in the order it happened; a publisher turns
/// these into KV events (the worker's block manager and an engine mirror both produce them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BlockChange {
    /// A block became resident in `tier`.
    Stored {
        /// The tier.
        tier: Tier,
        /// `SeqHash` of the block it extends.
        parent: Option<SeqHash>,
        /// The block.
        block: StoredBlock,
    },
    /// A block left `tier`.
    Removed {
        /// The tier.
        tier: Tier,
        /// The block.
        seq: SeqHash,
    },
}
