//! The router's knowledge of what every worker caches: which blocks each (worker, dp rank)
//! holds in which tier, and for a request, how long a prefix each worker can reuse. No I/O.
//!
//! # Design
//!
//! The device tier is a radix tree over block sequences whose nodes are *addressed by their
//! `SeqHash`*: the child of node `p` along edge `LocalHash l` is node `seq_hash(p, l)`. A
//! lookup that arrives as `LocalHash`es derives each node's address with one 16-byte xxh3
//! (≈4 ns) and reads it from a sharded hash map; a `Stored` event, which names blocks by
//! `SeqHash`, finds its parent in the same map. Because a node's address is its whole
//! prefix, there are no child maps to keep consistent, no edges to split or merge, and
//! nothing to leak when a removal arrives out of order: a node exists exactly while some
//! worker holds its block in some tier. Each node lists its owners per tier as 8-byte
//! [`slots::SlotRef`]s (dense, generation-tagged worker slots).
//!
//! The lower tiers (host, disk) live in the same nodes: a worker's host entry for block `i`
//! is the continuation keyed by (parent `SeqHash`, `LocalHash`), because that pair is what
//! the node's address hashes. A worker's walk leaves the device tier at its last device block
//! (its anchor) and continues through its lower-tier entries; a worker with no device blocks
//! enters at the root. A device `Removed` racing ahead of the host `Stored` of the same block
//! (offload) touches only the device entry, so the host entry is never lost; and a node whose
//! last owner leaves any tier is removed with it, so anchors cannot pile up.
//!
//! Each worker also has a lane ([`lanes`]): its reverse map (what it holds, for `Removed`
//! validation, `Cleared`, `remove_worker` and dumps) and the lock that orders its events.
//!
//! # Concurrency
//!
//! Lookups run in parallel with event application: the block map is a `DashMap` (sharded
//! reader-writer locks) and every write holds one shard for one block, so no reader waits
//! behind more than one block's update, and lanes of different workers apply in parallel.
//! The two protocols beyond the map, slot reuse and lane teardown, are model-checked with
//! loom (`RUSTFLAGS="--cfg kvroute_loom" cargo test --release -p kvroute loom`).
//!
//! Alternatives measured or weighed: a pointer-linked radix tree with per-node child maps
//! (Dynamo's shape) costs the same per-level map probe on lookup but needs parent/child
//! bookkeeping on every store and remove, and is where the field's leaks come from; a single
//! writer thread publishing immutable snapshots (arc-swap) gives readers zero contention but
//! copies on write, far below the 5 M block-ops/s target; per-worker private trees make a
//! lookup cost O(workers × depth) instead of O(depth). Figures: `kvroute-bench indexer`.

mod lanes;
mod owners;
mod slots;
mod sync;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use dashmap::DashMap;
use rustc_hash::FxBuildHasher;

use crate::protocol::{
    DpRank, EventBatch, KvEvent, KvEventData, LocalHash, Salt, SeqHash, StoredBlock, Tier,
    WorkerId, parents_first, seq_hash,
};
use lanes::{LaneState, Lanes, SlotsExhausted, TierMask};
use owners::Owners;
use slots::SlotRef;

/// Sizing of the index.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Most distinct blocks the index holds; `Stored` blocks beyond it are refused (counted
    /// in `capped`, logged once per episode). Default 64 Mi (a few GiB of router memory).
    pub max_blocks: usize,
    /// Most (worker, dp rank) pairs registered at once.
    pub max_workers: u32,
    /// Shards of the block map (rounded up to a power of two by the map).
    pub shards: usize,
    /// Blocks to reserve room for at start. A shard that outgrows its table rehashes under
    /// its write lock, stalling that shard's readers; reserving the expected size up front
    /// (≈ 90 B per block) keeps lookups clear of it.
    pub initial_blocks: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            max_blocks: 64 << 20,
            max_workers: 16_384,
            shards: 256,
            initial_blocks: 0,
        }
    }
}

/// An index configuration that cannot work.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// A size that must be positive is not.
    #[error("indexer.{field} must be positive")]
    NotPositive {
        /// The field.
        field: &'static str,
    },
}

impl Config {
    /// Checks the sizes.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (field, ok) in [
            ("max_blocks", self.max_blocks > 0),
            ("max_workers", self.max_workers > 0),
            ("shards", self.shards > 0),
        ] {
            if !ok {
                return Err(ConfigError::NotPositive { field });
            }
        }
        Ok(())
    }
}

/// How much of a request one worker (rank) can reuse.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Overlap {
    /// The worker.
    pub worker: WorkerId,
    /// Its rank.
    pub dp_rank: DpRank,
    /// Leading blocks it holds in GPU memory.
    pub device: u32,
    /// Blocks after those it holds in host memory (a continuation may mix tiers).
    pub host: u32,
    /// Blocks after those it holds on disk or remote storage.
    pub disk: u32,
}

/// [`Indexer::find_matches`]'s answer: every worker with a non-empty overlap.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OverlapScores {
    /// One entry per (worker, rank) with any cached prefix, in no particular order.
    pub workers: Vec<Overlap>,
}

impl OverlapScores {
    /// The overlap of one (worker, rank), zero if absent.
    pub fn get(&self, worker: WorkerId, dp_rank: DpRank) -> Overlap {
        self.workers
            .iter()
            .find(|o| o.worker == worker && o.dp_rank == dp_rank)
            .copied()
            .unwrap_or(Overlap {
                worker,
                dp_rank,
                device: 0,
                host: 0,
                disk: 0,
            })
    }
}

/// Counters of every operation and outcome since creation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Blocks newly stored (per worker and tier).
    pub stored: u64,
    /// Stored blocks the worker already held there (idempotent).
    pub duplicate_stored: u64,
    /// Blocks removed.
    pub removed: u64,
    /// Removals of blocks the worker did not hold there (tolerated).
    pub unknown_removed: u64,
    /// Device `Stored` events refused because the worker did not hold the parent.
    pub rejected_parent: u64,
    /// Blocks of those events.
    pub rejected_blocks: u64,
    /// `Cleared` events applied.
    pub cleared: u64,
    /// Blocks refused at the block cap.
    pub capped: u64,
    /// Stored blocks whose `SeqHash` is not `seq_hash(parent, local)`: the publisher hashes
    /// differently and lookups will miss them (the usual cause of "overlap is always zero").
    pub hash_mismatch: u64,
    /// Batches refused because no worker slot was free.
    pub slots_exhausted: u64,
    /// Lookups served.
    pub lookups: u64,
    /// Workers removed.
    pub workers_removed: u64,
}

/// Sizes of the live state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sizes {
    /// Distinct blocks (nodes).
    pub blocks: usize,
    /// (worker, tier, block) entries.
    pub entries: usize,
    /// Registered (worker, rank) pairs.
    pub workers: usize,
}

#[derive(Debug)]
struct Node {
    local: LocalHash,
    parent: Option<SeqHash>,
    /// (slot, tier) of every owner, sorted.
    owners: Owners,
}

#[derive(Debug, Default)]
struct AtomicCounters {
    stored: AtomicU64,
    duplicate_stored: AtomicU64,
    removed: AtomicU64,
    unknown_removed: AtomicU64,
    rejected_parent: AtomicU64,
    rejected_blocks: AtomicU64,
    cleared: AtomicU64,
    capped: AtomicU64,
    hash_mismatch: AtomicU64,
    slots_exhausted: AtomicU64,
    lookups: AtomicU64,
    workers_removed: AtomicU64,
}

fn bump(counter: &AtomicU64, by: u64) {
    if by > 0 {
        counter.fetch_add(by, Ordering::Relaxed);
    }
}

/// What one [`Indexer::apply`] did (also added to the [`Counters`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ApplyOutcome {
    /// Blocks newly stored.
    pub stored: u64,
    /// Blocks removed.
    pub removed: u64,
    /// Removals of blocks not held.
    pub unknown_removed: u64,
    /// Blocks of `Stored` events refused for an unknown parent.
    pub rejected_blocks: u64,
    /// Blocks refused at the cap.
    pub capped: u64,
    /// Stored blocks already held.
    pub duplicate_stored: u64,
    /// Stored blocks with foreign hashing.
    pub hash_mismatch: u64,
    /// Device `Stored` events refused for an unknown parent.
    pub rejected_parent: u64,
    /// `Cleared` events.
    pub cleared: u64,
}

impl ApplyOutcome {
    /// Adds this outcome to the shared counters: once per batch, not per block.
    fn count(&self, counters: &AtomicCounters) {
        bump(&counters.stored, self.stored);
        bump(&counters.removed, self.removed);
        bump(&counters.unknown_removed, self.unknown_removed);
        bump(&counters.rejected_blocks, self.rejected_blocks);
        bump(&counters.capped, self.capped);
        bump(&counters.duplicate_stored, self.duplicate_stored);
        bump(&counters.hash_mismatch, self.hash_mismatch);
        bump(&counters.rejected_parent, self.rejected_parent);
        bump(&counters.cleared, self.cleared);
    }
}

/// The index. Share it behind an `Arc`; every method takes `&self`.
#[derive(Debug)]
pub struct Indexer {
    config: Config,
    blocks: DashMap<SeqHash, Node, FxBuildHasher>,
    block_count: AtomicUsize,
    entry_count: AtomicUsize,
    lanes: Lanes,
    counters: AtomicCounters,
    at_cap: AtomicBool,
}

const fn bit(tier: Tier) -> TierMask {
    1 << tier as u8
}

impl Indexer {
    /// An empty index.
    pub fn new(config: Config) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(Indexer {
            blocks: DashMap::with_capacity_and_hasher_and_shard_amount(
                config.initial_blocks,
                FxBuildHasher,
                config.shards.next_power_of_two().max(2),
            ),
            block_count: AtomicUsize::new(0),
            entry_count: AtomicUsize::new(0),
            lanes: Lanes::new(config.max_workers),
            counters: AtomicCounters::default(),
            at_cap: AtomicBool::new(false),
            config,
        })
    }

    /// Applies a batch's events in order for its (worker, rank). Events of one worker must
    /// be applied in id order (the events layer guarantees it); batches of different workers
    /// may be applied concurrently.
    pub fn apply(&self, batch: &EventBatch) -> ApplyOutcome {
        let result = self
            .lanes
            .with_lane(batch.worker, batch.dp_rank, |slot, lane| {
                let mut outcome = ApplyOutcome::default();
                for event in &batch.events {
                    self.apply_event(slot, lane, event, &mut outcome);
                }
                outcome.count(&self.counters);
                outcome
            });
        match result {
            Ok(outcome) => outcome,
            Err(SlotsExhausted) => {
                bump(&self.counters.slots_exhausted, 1);
                tracing::error!(
                    worker = %batch.worker,
                    max_workers = self.config.max_workers,
                    "indexer has no free worker slot; batch dropped"
                );
                ApplyOutcome::default()
            }
        }
    }

    fn apply_event(
        &self,
        slot: SlotRef,
        lane: &mut LaneState,
        event: &KvEvent,
        out: &mut ApplyOutcome,
    ) {
        match &event.data {
            KvEventData::Stored { parent, blocks } => {
                if event.tier == Tier::Device
                    && let Some(parent) = parent
                    && lane
                        .blocks
                        .get(parent)
                        .is_none_or(|m| m & bit(Tier::Device) == 0)
                {
                    out.rejected_parent += 1;
                    out.rejected_blocks += blocks.len() as u64;
                    return;
                }
                let mut parent = *parent;
                for block in blocks {
                    if !self.store(slot, lane, event.tier, parent, *block, out) {
                        break;
                    }
                    parent = Some(block.seq);
                }
            }
            KvEventData::Removed { blocks } => {
                for seq in blocks {
                    self.remove(slot, lane, event.tier, *seq, out);
                }
            }
            KvEventData::Cleared => {
                out.cleared += 1;
                let held: Vec<SeqHash> = lane
                    .blocks
                    .iter()
                    .filter(|(_, m)| *m & bit(event.tier) != 0)
                    .map(|(s, _)| *s)
                    .collect();
                for seq in held {
                    self.remove(slot, lane, event.tier, seq, out);
                }
            }
        }
    }

    /// Adds `slot` as an owner of `block` in `tier`. False if the block cap refused it (the
    /// rest of the chain is refused too: it would hang off a missing block).
    fn store(
        &self,
        slot: SlotRef,
        lane: &mut LaneState,
        tier: Tier,
        parent: Option<SeqHash>,
        block: StoredBlock,
        out: &mut ApplyOutcome,
    ) -> bool {
        let held = lane.blocks.get(&block.seq).copied().unwrap_or(0);
        if held & bit(tier) != 0 {
            out.duplicate_stored += 1;
            return true;
        }
        if let Some(p) = parent
            && seq_hash(Some(p), block.local, Salt::NONE) != block.seq
        {
            out.hash_mismatch += 1;
        }
        let mut node = match self.blocks.entry(block.seq) {
            dashmap::Entry::Occupied(e) => e.into_ref(),
            dashmap::Entry::Vacant(e) => {
                if self.block_count.load(Ordering::Relaxed) >= self.config.max_blocks {
                    out.capped += 1;
                    if !self.at_cap.swap(true, Ordering::Relaxed) {
                        tracing::warn!(
                            max_blocks = self.config.max_blocks,
                            "indexer block cap reached: new blocks are refused until some are removed"
                        );
                    }
                    return false;
                }
                self.block_count.fetch_add(1, Ordering::Relaxed);
                e.insert(Node {
                    local: block.local,
                    parent,
                    owners: Owners::default(),
                })
            }
        };
        node.owners.insert((slot, tier));
        drop(node);
        *lane.blocks.entry(block.seq).or_insert(0) |= bit(tier);
        self.entry_count.fetch_add(1, Ordering::Relaxed);
        out.stored += 1;
        true
    }

    fn remove(
        &self,
        slot: SlotRef,
        lane: &mut LaneState,
        tier: Tier,
        seq: SeqHash,
        out: &mut ApplyOutcome,
    ) {
        let Some(mask) = lane.blocks.get_mut(&seq).filter(|m| **m & bit(tier) != 0) else {
            out.unknown_removed += 1;
            return;
        };
        *mask &= !bit(tier);
        if *mask == 0 {
            lane.blocks.remove(&seq);
            // Give memory back as a worker's cache shrinks (hash maps never shrink alone).
            if lane.blocks.capacity() > 64 && lane.blocks.len() < lane.blocks.capacity() / 4 {
                lane.blocks.shrink_to(lane.blocks.len() * 2);
            }
        }
        let emptied = match self.blocks.get_mut(&seq) {
            Some(mut node) => {
                node.owners.remove((slot, tier));
                node.owners.is_empty()
            }
            None => {
                debug_assert!(false, "invariant: a block a lane holds has a node");
                false
            }
        };
        if emptied
            && self
                .blocks
                .remove_if(&seq, |_, n| n.owners.is_empty())
                .is_some()
        {
            self.block_count.fetch_sub(1, Ordering::Relaxed);
            self.at_cap.store(false, Ordering::Relaxed);
        }
        self.entry_count.fetch_sub(1, Ordering::Relaxed);
        out.removed += 1;
    }

    /// Forgets every rank of `worker` at once. Returns how many ranks it had.
    pub fn remove_worker(&self, worker: WorkerId) -> usize {
        self.remove_lanes(worker, None)
    }

    /// Forgets one rank of a worker (a new epoch of that rank resyncs from scratch).
    pub fn remove_rank(&self, worker: WorkerId, dp_rank: DpRank) -> usize {
        self.remove_lanes(worker, Some(dp_rank))
    }

    fn remove_lanes(&self, worker: WorkerId, rank: Option<DpRank>) -> usize {
        let removed = self.lanes.remove(worker, rank, |slot, lane| {
            let mut out = ApplyOutcome::default();
            let held: Vec<(SeqHash, TierMask)> =
                lane.blocks.iter().map(|(s, m)| (*s, *m)).collect();
            for (seq, mask) in held {
                for tier in Tier::ALL {
                    if mask & bit(tier) != 0 {
                        self.remove(slot, lane, tier, seq, &mut out);
                    }
                }
            }
            out.count(&self.counters);
        });
        bump(&self.counters.workers_removed, removed as u64);
        removed
    }

    /// Every (worker, rank) with a lane (for the fleet's sweep of orphans).
    pub fn ranks(&self) -> Vec<(WorkerId, DpRank)> {
        self.lanes.all().into_iter().map(|(k, _)| k).collect()
    }

    /// Per worker, how much of the request (its blocks' `LocalHash`es, unsalted) it holds.
    pub fn find_matches(&self, locals: &[LocalHash]) -> OverlapScores {
        let mut parent = None;
        self.walk(locals.iter().map(|local| {
            let seq = seq_hash(parent, *local, Salt::NONE);
            parent = Some(seq);
            seq
        }))
    }

    /// Like [`Indexer::find_matches`], for a request whose `SeqHash`es are already known
    /// (salted requests, or callers that hashed both ways).
    pub fn find_matches_seq(&self, seqs: &[SeqHash]) -> OverlapScores {
        self.walk(seqs.iter().copied())
    }

    fn walk(&self, seqs: impl Iterator<Item = SeqHash>) -> OverlapScores {
        bump(&self.counters.lookups, 1);
        // Owners still matching in the device tier (sorted), owners continuing in lower
        // tiers, and finished ones.
        let mut device: Vec<SlotRef> = Vec::new();
        let mut lower: Vec<(SlotRef, u32, u32, u32)> = Vec::new();
        let mut done: Vec<(SlotRef, u32, u32, u32)> = Vec::new();
        // The previous level's owners. Along a shared prefix, consecutive blocks usually
        // have the same owners; then every decision repeats, and one memcmp replaces a
        // membership test per worker (O(1 + continuing) per level instead of O(workers)).
        let mut previous: Vec<owners::Owner> = Vec::new();
        let mut depth = 0u32;
        for seq in seqs {
            let Some(node) = self.blocks.get(&seq) else {
                break;
            };
            let owners = &node.owners;
            if depth > 0 && owners.as_slice() == previous.as_slice() {
                for entry in &mut lower {
                    let tier = owners
                        .lower_tier(entry.0)
                        .expect("invariant: same owners as before");
                    *entry = credit(*entry, tier);
                }
            } else if depth == 0 {
                for &(slot, tier) in owners.as_slice() {
                    if tier == Tier::Device {
                        device.push(slot);
                    } else if device.last() != Some(&slot)
                        && lower.last().is_none_or(|l| l.0 != slot)
                    {
                        lower.push(credit((slot, 0, 0, 0), tier));
                    }
                }
            } else {
                lower.retain_mut(|entry| match owners.lower_tier(entry.0) {
                    Some(tier) => {
                        *entry = credit(*entry, tier);
                        true
                    }
                    None => {
                        done.push(*entry);
                        false
                    }
                });
                device.retain(|&slot| {
                    if owners.on_device(slot) {
                        return true;
                    }
                    match owners.lower_tier(slot) {
                        Some(tier) => lower.push(credit((slot, depth, 0, 0), tier)),
                        None => done.push((slot, depth, 0, 0)),
                    }
                    false
                });
            }
            if previous.as_slice() != owners.as_slice() {
                previous.clear();
                previous.extend_from_slice(owners.as_slice());
            }
            drop(node);
            depth += 1;
            if device.is_empty() && lower.is_empty() {
                break;
            }
        }
        done.extend(lower);
        done.extend(device.into_iter().map(|slot| (slot, depth, 0, 0)));
        let workers = done
            .into_iter()
            .filter_map(|(slot, device, host, disk)| {
                let (worker, dp_rank) = self.lanes.slots.resolve(slot)?;
                Some(Overlap {
                    worker,
                    dp_rank,
                    device,
                    host,
                    disk,
                })
            })
            .collect();
        OverlapScores { workers }
    }

    /// Everything the index holds for `worker` (all workers if `None`), as one batch of
    /// `Stored` events per (worker, rank), parents first within each tier. Ids start at 1;
    /// the epoch is 0 (the index does not track incarnations).
    pub fn dump(&self, worker: Option<WorkerId>) -> Vec<EventBatch> {
        let mut out = Vec::new();
        for ((w, rank), lane) in self.lanes.all() {
            if worker.is_some_and(|x| x != w) {
                continue;
            }
            let state = lane.lock();
            if state.dead {
                continue;
            }
            let mut blocks = Vec::with_capacity(state.blocks.len());
            for (&seq, &mask) in &state.blocks {
                let Some(node) = self.blocks.get(&seq) else {
                    continue;
                };
                for tier in Tier::ALL {
                    if mask & bit(tier) != 0 {
                        blocks.push((
                            tier,
                            node.parent,
                            StoredBlock {
                                seq,
                                local: node.local,
                            },
                        ));
                    }
                }
            }
            drop(state);
            let events = parents_first(blocks)
                .into_iter()
                .zip(1..)
                .map(|((tier, parent, block), id)| KvEvent {
                    id,
                    tier,
                    data: KvEventData::Stored {
                        parent,
                        blocks: vec![block],
                    },
                })
                .collect();
            out.push(EventBatch {
                worker: w,
                dp_rank: rank,
                epoch: 0,
                sent_unix_us: 0,
                events,
            });
        }
        out.sort_by_key(|b| (b.worker, b.dp_rank));
        out
    }

    /// Counters since creation.
    pub fn counters(&self) -> Counters {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Counters {
            stored: get(&c.stored),
            duplicate_stored: get(&c.duplicate_stored),
            removed: get(&c.removed),
            unknown_removed: get(&c.unknown_removed),
            rejected_parent: get(&c.rejected_parent),
            rejected_blocks: get(&c.rejected_blocks),
            cleared: get(&c.cleared),
            capped: get(&c.capped),
            hash_mismatch: get(&c.hash_mismatch),
            slots_exhausted: get(&c.slots_exhausted),
            lookups: get(&c.lookups),
            workers_removed: get(&c.workers_removed),
        }
    }

    /// Sizes of the live state.
    pub fn sizes(&self) -> Sizes {
        Sizes {
            blocks: self.block_count.load(Ordering::Relaxed),
            entries: self.entry_count.load(Ordering::Relaxed),
            workers: self.lanes.slots.occupied(),
        }
    }

    /// Shrinks the block map's shards to their live size (after a large removal).
    pub fn shrink_to_fit(&self) {
        self.blocks.shrink_to_fit();
    }
}

/// Adds one block in `tier` to a continuation's counts.
fn credit(
    (slot, device, host, disk): (SlotRef, u32, u32, u32),
    tier: Tier,
) -> (SlotRef, u32, u32, u32) {
    match tier {
        Tier::Host => (slot, device, host + 1, disk),
        _ => (slot, device, host, disk + 1),
    }
}

#[cfg(all(test, kvroute_loom))]
mod loom_models;
#[cfg(test)]
mod tests;
