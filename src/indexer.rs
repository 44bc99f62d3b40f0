//! The router's knowledge of what every worker caches: which blocks each (worker, dp rank)
//! holds in which tier, and for a request, how long a prefix each worker can reuse. No I/O.
//!
//! # Design
//!
//! The device tier is a radix tree over block sequences whose nodes are *addressed by their
//! `SeqHash`*: the child of node `p` along edge `LocalHash l` is node `seq_hash(p, l)`. A
//! lookup that arrives as `LocalHash`es derives each node's address with one 16-byte xxh3
//! (≈4 ns) and probes one table; a `Stored` event, which names blocks by `SeqHash`, finds its
//! parent the same way. Because a node's address is its whole prefix, there are no child
//! maps to keep consistent, no edges to split or merge, and nothing to leak when a removal
//! arrives out of order: a node exists exactly while some worker holds its block in some
//! tier.
//!
//! The lower tiers (host, disk) live in the same nodes: a worker's host entry for block `i`
//! is the continuation keyed by (parent `SeqHash`, `LocalHash`), because that pair is what
//! the node's address hashes. A worker's walk leaves the device tier at its last device block
//! (its anchor) and continues through its lower-tier entries; a worker with no device blocks
//! enters at the root. A device `Removed` racing ahead of the host `Stored` of the same block
//! (offload) touches only the device entry, so the host entry is never lost.
//!
//! # What a block costs
//!
//! A node is one 16-byte slot of an open-addressing table ([`table`]): the `SeqHash` (the
//! key *is* the node's address) and one word holding up to three owners inline, each a
//! worker slot and its tier bits in 20 bits; more owners spill to an arena at 4 B each.
//! Tables stay between 41 % and 81 % full while the index grows, so a distinct block costs
//! 20–39 B (27 B at the mean of a doubling); at steady churn, tombstones purged at 13/16
//! used, the live keys fill 31–62 % (26–51 B a block); a block shared by four or more
//! workers adds 4 B per owner out of line, in an arena with room for twice the live sets
//! (the [`table`] module's docs give the details, and what a shrinking index costs). There
//! is no per-worker reverse map: what a worker holds is in the nodes, and `Cleared`, worker
//! removal and `dump` walk the map (rare). A removal is two halves: retiring the worker's
//! slot (constant time: lookups stop crediting it and its next events register afresh) and
//! reaping (the walk that strips its entries and frees the slot). Removals that come
//! together share one walk ([`Indexer::remove_workers`], or concurrent callers of
//! [`Indexer::reap`], which combine), so a thousand workers leaving cost one walk, not a
//! thousand. A block's parent and `LocalHash` are not kept: no lookup needs them.
//! Worker slots ([`slots`]) and lanes ([`lanes`]) cost per worker, not per block.
//!
//! # Concurrency
//!
//! Lookups never wait on a writer: they take no lock. Writers take one shard's mutex per
//! block (lanes of different workers apply in parallel); a lane's lock orders its worker's
//! events. The protocols that make lock-free reads exact are: a table slot's key never
//! changes while its table lives, owner sets are published with one store, tables are
//! swapped whole when they grow or shrink, and a lookup pins all of them at once through a
//! view that holds a new table before anything is written to it, pinning again before it
//! reads a table replaced since, so that it reads its blocks in order ([`table`]); and a worker
//! slot handed to a new worker during a walk is never credited with the old one's blocks
//! (generations, checked around block 0 and at the end of the walk: [`Indexer::walk`]); a
//! slot is reused only after the reaper has stripped it, and a removal that finds another
//! thread reaping is stripped by that thread, which looks again after letting go. Each is
//! model-checked with loom, with a negative control that must fail
//! (`RUSTFLAGS="--cfg kvroute_loom" cargo test --release -p kvroute loom`).
//!
//! Alternatives measured or weighed: the previous design, a `DashMap` of nodes with owner
//! lists plus a per-worker reverse map, cost 201 B a block and let a reader wait behind a
//! shard's writer (p99 406 µs paced); `papaya` boxes every entry and copies it on each owner
//! change (> 40 B a block before the allocator's share); `scc::HashIndex` also copies values
//! on update and reclaims removed entries only on rebuild; a pointer-linked radix tree with
//! per-node child maps (Dynamo's shape) needs parent/child bookkeeping on every store and
//! remove and is where the field's leaks come from; per-worker private trees make a lookup
//! cost O(workers × depth). Figures: `kvroute-bench indexer`.

mod lanes;
mod slots;
mod sync;
mod table;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use crate::protocol::{
    DpRank, EventBatch, KvEvent, KvEventData, LocalHash, Salt, SeqHash, StoredBlock, Tier,
    WorkerId, seq_hash,
};
use lanes::{LaneState, Lanes, SlotsExhausted, TierMask};
use slots::SlotRef;
use sync::Mutex;
pub(crate) use table::home_of_key;
use table::{Change, Entry, Map, ShardWriter, View};

/// Sizing of the index.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Most distinct blocks the index holds; `Stored` blocks beyond it are refused (counted
    /// in `capped`, logged once per episode). Default 64 Mi (a few GiB of router memory).
    pub max_blocks: usize,
    /// Most (worker, dp rank) pairs registered at once (at most 2^20).
    pub max_workers: u32,
    /// Shards of the block map (rounded up to a power of two). Writers of different shards
    /// never contend; readers take no lock at all.
    pub shards: usize,
    /// Blocks to size the tables for at start (saves the early rebuilds; readers never
    /// wait on a rebuild either way). The tables never shrink below that size.
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
    /// More worker slots than an owner entry can name.
    #[error("indexer.max_workers must be at most {max}")]
    TooManyWorkers {
        /// The limit.
        max: u32,
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
        if self.max_workers > table::MAX_SLOTS {
            return Err(ConfigError::TooManyWorkers {
                max: table::MAX_SLOTS,
            });
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
    /// Walks of the whole map: a `Cleared` of a tier a worker holds entries in, or a reap.
    pub walks: u64,
}

/// Sizes of the live state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sizes {
    /// Distinct blocks (nodes).
    pub blocks: usize,
    /// (worker, tier, block) entries.
    pub entries: usize,
    /// Worker slots taken: registered (worker, rank) pairs, and removed ones whose entries
    /// are not reaped yet.
    pub workers: usize,
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
    walks: AtomicU64,
}

fn bump(counter: &AtomicU64, by: u64) {
    if by > 0 {
        counter.fetch_add(by, Ordering::Relaxed);
    }
}

/// Owners a lane's scratch list keeps room for between batches (4 KiB); a larger one, left
/// by a block shared by more ranks, is freed after its batch.
const SCRATCH_KEPT: usize = 1024;

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
    /// The batch was dropped whole: no worker slot was free for its (worker, rank). The
    /// caller must apply it again later (the events layer resyncs the stream).
    pub no_slot: bool,
    /// Changes to the live sizes, added to the shared counts when the batch is done.
    sizes: Tally,
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

/// What one (worker, rank) holds, as [`Indexer::dump`] lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holding {
    /// The worker.
    pub worker: WorkerId,
    /// Its rank.
    pub dp_rank: DpRank,
    /// Every (tier, block) it holds, sorted.
    pub blocks: Vec<(Tier, SeqHash)>,
}

/// What one (worker, rank) holds in one tier, as [`Indexer::digest`] sums it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Digest {
    /// The worker.
    pub worker: WorkerId,
    /// Its rank.
    pub dp_rank: DpRank,
    /// The tier.
    pub tier: Tier,
    /// Blocks held there.
    pub blocks: u64,
    /// The XOR of their hashes.
    pub xor: u64,
}

/// The index. Share it behind an `Arc`; every method takes `&self`.
#[derive(Debug)]
pub struct Indexer {
    config: Config,
    map: Map,
    block_count: AtomicUsize,
    entry_count: AtomicUsize,
    lanes: Lanes,
    counters: AtomicCounters,
    at_cap: AtomicBool,
    /// Slots of removed workers whose entries are still in the map ([`Indexer::reap`]).
    retired: Mutex<Vec<u32>>,
    /// Held by the one thread stripping retired slots.
    reaping: Mutex<()>,
    /// Under `cfg(test)`, the reaper does not look again after letting go (loom's
    /// negative control: a removal during a pass is then never stripped).
    #[cfg(all(test, kvroute_loom))]
    broken_reap: bool,
    /// Under `cfg(test)`, run once by the next walk right after it pins its view (writes a
    /// test makes there land after the pin).
    #[cfg(all(test, not(kvroute_loom)))]
    after_pin: AfterPin,
}

/// A test's writes to run once right after a walk pins its view.
#[cfg(all(test, not(kvroute_loom)))]
#[derive(Default)]
struct AfterPin(std::sync::Mutex<Option<TestWrites>>);

/// Writes a test makes to an index.
#[cfg(all(test, not(kvroute_loom)))]
type TestWrites = Box<dyn FnOnce(&Indexer) + Send>;

#[cfg(all(test, not(kvroute_loom)))]
impl std::fmt::Debug for AfterPin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AfterPin")
    }
}

const fn bit(tier: Tier) -> TierMask {
    1 << tier as u8
}

const DEVICE: TierMask = bit(Tier::Device);
/// Blocks of an event a writer touches together before writing them.
const LOOKAHEAD: usize = 8;
/// Blocks a lookup touches together, a group before it reads them.
const AHEAD: usize = 16;
/// Lookups at least this long load every shard's table header first.
const WARM_AFTER: usize = 128;

impl Indexer {
    /// An empty index.
    pub fn new(config: Config) -> Result<Self, ConfigError> {
        config.validate()?;
        let shards = config.shards.next_power_of_two().max(2);
        Ok(Indexer {
            map: Map::new(shards, config.initial_blocks / shards),
            block_count: AtomicUsize::new(0),
            entry_count: AtomicUsize::new(0),
            lanes: Lanes::new(config.max_workers),
            counters: AtomicCounters::default(),
            at_cap: AtomicBool::new(false),
            retired: Mutex::new(Vec::new()),
            reaping: Mutex::new(()),
            #[cfg(all(test, kvroute_loom))]
            broken_reap: false,
            #[cfg(all(test, not(kvroute_loom)))]
            after_pin: AfterPin::default(),
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
                // A `Cleared` empties its tier of this lane's entries: what the batch does to
                // that tier before its last `Cleared` is undone by it, so is skipped. A batch
                // walks the map once per tier at most, however many it carries.
                let mut last_cleared = [None::<usize>; Tier::ALL.len()];
                for (i, event) in batch.events.iter().enumerate() {
                    if matches!(event.data, KvEventData::Cleared) {
                        last_cleared[event.tier as usize] = Some(i);
                    }
                }
                for (i, event) in batch.events.iter().enumerate() {
                    match last_cleared[event.tier as usize] {
                        Some(last) if i < last => {
                            if matches!(event.data, KvEventData::Cleared) {
                                outcome.cleared += 1;
                            }
                        }
                        _ => self.apply_event(slot.index, lane, event, &mut outcome),
                    }
                }
                // A block held by thousands of ranks left each lane's scratch as large as its
                // owner list for good: about 4 B × ranks² over the fleet (1 GiB at 16,384).
                if lane.scratch.capacity() > SCRATCH_KEPT {
                    lane.scratch = Vec::new();
                }
                outcome.count(&self.counters);
                self.add_sizes(outcome.sizes);
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
                ApplyOutcome {
                    no_slot: true,
                    ..ApplyOutcome::default()
                }
            }
        }
    }

    fn apply_event(
        &self,
        slot: u32,
        lane: &mut LaneState,
        event: &KvEvent,
        out: &mut ApplyOutcome,
    ) {
        let scratch = &mut lane.scratch;
        let entries_before = out.sizes.entries;
        match &event.data {
            KvEventData::Stored { parent, blocks } => {
                if event.tier == Tier::Device
                    && let Some(parent) = parent
                    && self.tiers_held(*parent, slot, scratch) & DEVICE == 0
                {
                    out.rejected_parent += 1;
                    out.rejected_blocks += blocks.len() as u64;
                    return;
                }
                let mut parent = *parent;
                // The blocks stored before the cap refuses one stay, and count as held.
                'chain: for (g, group) in blocks.chunks(LOOKAHEAD).enumerate() {
                    self.touch(&self.map.view(), group.iter().map(|b| home(b.seq)));
                    for (k, block) in group.iter().enumerate() {
                        if !self.store(slot, event.tier, parent, *block, scratch, out) {
                            // The rest of the chain is refused with it (counted as blocks).
                            let after = blocks.len() - (g * LOOKAHEAD + k) - 1;
                            out.capped += after as u64;
                            break 'chain;
                        }
                        parent = Some(block.seq);
                    }
                }
            }
            KvEventData::Removed { blocks } => {
                let tier = bit(event.tier);
                for group in blocks.chunks(LOOKAHEAD) {
                    self.touch(&self.map.view(), group.iter().map(|seq| home(*seq)));
                    for seq in group {
                        let home = home(*seq);
                        let mut w = self.map.write(home);
                        let gone = self.drop_tiers(&mut w, home, seq.0, slot, tier, scratch);
                        if gone.entries == 0 {
                            out.unknown_removed += 1;
                        } else {
                            out.removed += 1;
                            out.sizes.blocks -= gone.blocks;
                            out.sizes.entries -= gone.entries;
                        }
                    }
                }
            }
            KvEventData::Cleared => {
                out.cleared += 1;
                // Only a tier the lane holds entries in is worth a walk of the map.
                if lane.held[event.tier as usize] > 0 {
                    let tier = bit(event.tier);
                    let mut gone = Tally::default();
                    out.removed += self.strip(
                        |e| if table::slot_of(e) == slot { tier } else { 0 },
                        |shard| gone.add(shard),
                    );
                    out.sizes.add(gone);
                }
                lane.held[event.tier as usize] = 0;
                return;
            }
        }
        // Every entry an event adds or takes is of its tier and this lane's slot.
        let held = &mut lane.held[event.tier as usize];
        *held = held.saturating_add_signed((out.sizes.entries - entries_before) as i64);
    }

    /// Starts the cache misses of the first table slot each block's probe reads, all before
    /// any is used, so that they overlap instead of costing one memory latency per block in
    /// turn (an event's blocks land in random shards and slots: one miss each), through
    /// `view` ([`View::touch`]). Writers call it per group of an event's blocks, with their
    /// probe homes; [`Indexer::walk`] per group it reads next, through the view it holds.
    fn touch(&self, view: &View, homes: impl Iterator<Item = u64>) {
        for home in homes {
            view.touch(self.map.shard_of(home), home);
        }
    }

    /// The tiers `slot` holds `seq` in (lock-free; exact for the lane's own writer).
    fn tiers_held(&self, seq: SeqHash, slot: u32, scratch: &mut Vec<Entry>) -> TierMask {
        if self.map.read(home(seq), seq.0, scratch) {
            table::tiers_in(scratch, slot)
        } else {
            0
        }
    }

    /// Adds `slot` as an owner of `block` in `tier`. False if the block cap refused it (the
    /// rest of the chain is refused too: it would hang off a missing block).
    fn store(
        &self,
        slot: u32,
        tier: Tier,
        parent: Option<SeqHash>,
        block: StoredBlock,
        scratch: &mut Vec<Entry>,
        out: &mut ApplyOutcome,
    ) -> bool {
        let home = home(block.seq);
        let mut w = self.map.write(home);
        let present = w.read(home, block.seq.0, scratch);
        let at = scratch.binary_search_by_key(&slot, |e| table::slot_of(*e));
        if at.is_ok_and(|i| table::tiers_of(scratch[i]) & bit(tier) != 0) {
            out.duplicate_stored += 1;
            return true;
        }
        if let Some(p) = parent
            && seq_hash(Some(p), block.local, Salt::NONE) != block.seq
        {
            out.hash_mismatch += 1;
        }
        if !present
            && self.block_count.load(Ordering::Relaxed) as isize + out.sizes.blocks
                >= self.config.max_blocks as isize
        {
            out.capped += 1;
            if !self.at_cap.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    max_blocks = self.config.max_blocks,
                    "indexer block cap reached: new blocks are refused until some are removed"
                );
            }
            return false;
        }
        match at {
            Ok(i) => scratch[i] |= u32::from(bit(tier)),
            Err(i) => scratch.insert(i, table::entry(slot, bit(tier))),
        }
        if w.set(home, block.seq.0, scratch) == Change::Created {
            out.sizes.blocks += 1;
        }
        out.sizes.entries += 1;
        out.stored += 1;
        true
    }

    /// Takes the tiers in `mask` of `slot`'s entry off `key`. Returns the entries that went
    /// (how many of those tiers it held) and the block if it has no owner left; the caller
    /// takes them off the live sizes.
    fn drop_tiers(
        &self,
        w: &mut ShardWriter<'_>,
        home: u64,
        key: u64,
        slot: u32,
        mask: TierMask,
        scratch: &mut Vec<Entry>,
    ) -> Tally {
        if !w.read(home, key, scratch) {
            return Tally::default();
        }
        let Ok(i) = scratch.binary_search_by_key(&slot, |e| table::slot_of(*e)) else {
            return Tally::default();
        };
        let gone = table::tiers_of(scratch[i]) & mask;
        if gone == 0 {
            return Tally::default();
        }
        scratch[i] &= !u32::from(gone);
        if table::tiers_of(scratch[i]) == 0 {
            scratch.remove(i);
        }
        let emptied = w.set(home, key, scratch) == Change::Emptied;
        if emptied {
            self.below_cap();
        }
        Tally {
            blocks: isize::from(emptied),
            entries: gone.count_ones() as isize,
        }
    }

    /// Adds a batch's changes to the live sizes (once per batch: a per-block atomic on
    /// their shared cache line was a fifth of `apply_event`'s samples in
    /// `kvroute-bench events`, whose two writer threads pulled it back and forth).
    fn add_sizes(&self, tally: Tally) {
        for (count, by) in [
            (&self.block_count, tally.blocks),
            (&self.entry_count, tally.entries),
        ] {
            if by > 0 {
                count.fetch_add(by.unsigned_abs(), Ordering::Relaxed);
            } else if by < 0 {
                count.fetch_sub(by.unsigned_abs(), Ordering::Relaxed);
            }
        }
    }

    /// A block left: new blocks are welcome again. Writes the flag only if it is set (it is
    /// on every writer's path; an unconditional store would pull its line to each in turn).
    fn below_cap(&self) {
        if self.at_cap.load(Ordering::Relaxed) {
            self.at_cap.store(false, Ordering::Relaxed);
        }
    }

    /// Takes the tiers `drop(entry)` names off every entry of every block: one walk of the
    /// whole map, one shard locked at a time (`Cleared` and reaping removed workers are
    /// rare). Hands each shard's changes to the live sizes to `settle`; returns the entries
    /// removed.
    fn strip(&self, drop: impl Fn(Entry) -> TierMask, mut settle: impl FnMut(Tally)) -> u64 {
        bump(&self.counters.walks, 1);
        let mut removed = 0u64;
        let mut keys = Vec::new();
        let mut owners = Vec::new();
        for index in 0..self.map.shards() {
            let mut w = self.map.write_shard(index);
            w.defer_shrinking();
            let mut gone_here = Tally::default();
            keys.clear();
            w.for_each(|key, owners| {
                if owners.iter().any(|&e| drop(e) != 0) {
                    keys.push(key);
                }
            });
            for &key in &keys {
                let home = table::home_of_key(key);
                if !w.read(home, key, &mut owners) {
                    continue;
                }
                let mut gone = 0;
                owners.retain_mut(|e| {
                    let tiers = drop(*e) & table::tiers_of(*e);
                    gone += tiers.count_ones();
                    *e &= !Entry::from(tiers);
                    table::tiers_of(*e) != 0
                });
                if w.set(home, key, &owners) == Change::Emptied {
                    gone_here.blocks -= 1;
                    self.below_cap();
                }
                gone_here.entries -= gone as isize;
                removed += u64::from(gone);
            }
            w.settle();
            settle(gone_here);
        }
        removed
    }

    /// Forgets every rank of `worker` at once. Returns how many ranks it had.
    pub fn remove_worker(&self, worker: WorkerId) -> usize {
        let removed = self.retire(worker, None);
        self.reap();
        removed
    }

    /// Forgets every rank of each of `workers`, with one walk of the map for all of them
    /// (a removal walks the whole map: one per worker would cost workers × blocks). Returns
    /// how many ranks they had.
    pub fn remove_workers(&self, workers: &[WorkerId]) -> usize {
        let removed = workers.iter().map(|&w| self.retire(w, None)).sum();
        self.reap();
        removed
    }

    /// Forgets one rank of a worker (a new epoch of that rank resyncs from scratch).
    pub fn remove_rank(&self, worker: WorkerId, dp_rank: DpRank) -> usize {
        let removed = self.retire_rank(worker, dp_rank);
        self.reap();
        removed
    }

    /// The constant-time half of [`Indexer::remove_rank`]: lookups stop crediting the rank
    /// and its events start a fresh registration at once; its entries stay in the map, and
    /// its worker slot taken, until [`Indexer::reap`] (call it off any latency-sensitive
    /// thread: it walks the map).
    pub fn retire_rank(&self, worker: WorkerId, dp_rank: DpRank) -> usize {
        self.retire(worker, Some(dp_rank))
    }

    fn retire(&self, worker: WorkerId, rank: Option<DpRank>) -> usize {
        let slots = self.lanes.remove(worker, rank);
        self.retired
            .lock()
            .extend(slots.iter().map(|slot| slot.index));
        bump(&self.counters.workers_removed, slots.len() as u64);
        slots.len()
    }

    /// Strips the entries of every retired worker slot from the map and releases the slots:
    /// one walk of the map for all the slots retired before it starts. Callers combine: a
    /// caller that finds another thread reaping leaves its slots to that thread, which looks
    /// again after letting go, so every retired slot is reaped once and none is left behind.
    /// Returns the entries this call removed.
    pub fn reap(&self) -> u64 {
        let mut removed = 0;
        loop {
            {
                let Some(_reaper) = self.reaping.try_lock() else {
                    return removed;
                };
                let batch = std::mem::take(&mut *self.retired.lock());
                if !batch.is_empty() {
                    let top = batch.iter().copied().max().unwrap_or(0) as usize;
                    let mut gone = vec![0u64; top / 64 + 1];
                    for &slot in &batch {
                        gone[slot as usize / 64] |= 1 << (slot % 64);
                    }
                    let stripped = self.strip(
                        |e| {
                            let slot = table::slot_of(e) as usize;
                            if gone
                                .get(slot / 64)
                                .is_some_and(|w| w & (1 << (slot % 64)) != 0)
                            {
                                table::tiers_of(e)
                            } else {
                                0
                            }
                        },
                        |shard| self.add_sizes(shard),
                    );
                    for &slot in &batch {
                        self.lanes.slots.release(slot);
                    }
                    ApplyOutcome {
                        removed: stripped,
                        ..ApplyOutcome::default()
                    }
                    .count(&self.counters);
                    removed += stripped;
                }
                #[cfg(all(test, kvroute_loom))]
                if self.broken_reap {
                    return removed;
                }
            }
            // Looked at only after letting go: a slot retired while this thread held the
            // reaper lock (its retirer's `try_lock` failed) is seen here.
            if self.retired.lock().is_empty() {
                return removed;
            }
        }
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

    /// The owners of block 0, each with the generation of its slot, read so that a slot
    /// handed to a new worker mid-walk is never credited with its previous occupant's
    /// blocks: owners, then generations (the refs returned), then owners again (left in
    /// `owners`); the walk keeps only owners seen both times. A bit still set after the
    /// generation was read belongs to that generation's occupant (an occupant's bits are all
    /// cleared before its slot is vacated), and the generation is checked again when the walk
    /// resolves slots to workers.
    fn root_owners(&self, seq: SeqHash, owners: &mut Vec<Entry>) -> Vec<SlotRef> {
        let home = home(seq);
        if !self.map.read(home, seq.0, owners) {
            return Vec::new();
        }
        let refs: Vec<SlotRef> = owners
            .iter()
            .filter_map(|e| self.lanes.slots.current(table::slot_of(*e)))
            .collect();
        #[cfg(all(test, kvroute_loom))]
        if self.lanes.slots.broken_walk {
            return refs;
        }
        if !self.map.read(home, seq.0, owners) {
            return Vec::new();
        }
        refs
    }

    fn walk(&self, mut seqs: impl Iterator<Item = SeqHash>) -> OverlapScores {
        bump(&self.counters.lookups, 1);
        let Some(first) = seqs.next() else {
            return OverlapScores::default();
        };
        let mut owners: Vec<Entry> = Vec::new();
        let refs = self.root_owners(first, &mut owners);
        // Owners still matching in the device tier (in slot order), owners continuing in
        // lower tiers, and finished ones: (owner, device, host, disk), where an owner is its
        // position in `refs` (so the end resolves it without a search; block 0 may have
        // thousands of owners, and each list is matched against the next by a merge).
        let slot_at = |owner: u32| refs[owner as usize].index;
        let mut device: Vec<u32> = Vec::new();
        let mut lower: Vec<(u32, u32, u32, u32)> = Vec::new();
        let mut done: Vec<(u32, u32, u32, u32)> = Vec::new();
        let mut at = 0;
        for &e in &owners {
            // Block 0's owners seen both times: both lists in slot order, a merge.
            let slot = table::slot_of(e);
            while refs.get(at).is_some_and(|r| r.index < slot) {
                at += 1;
            }
            if refs.get(at).is_none_or(|r| r.index != slot) {
                continue;
            }
            let owner = at as u32;
            let tiers = table::tiers_of(e);
            if tiers & DEVICE != 0 {
                device.push(owner);
            } else {
                lower.push(credit((owner, 0, 0, 0), tiers));
            }
        }
        // The previous level's owners. Along a shared prefix, consecutive blocks usually
        // have the same owners; then every decision repeats, and one memcmp replaces the
        // merge (O(1 + continuing) per level instead of O(owners)).
        let mut previous = std::mem::take(&mut owners);
        // What the last read found: a block with the same owners has `previous` as its
        // owners, without decoding them.
        let mut last = table::LastRead::default();
        let mut depth = 1u32;
        // One view of the tables for the rest of the walk, pinned after block 0's owners were
        // read twice (the generation protocol above needs fresh reads; every read through
        // this view is as some moment after them saw it, see [`table::Map`], and no earlier
        // than the reads before it: table rule 4 pins again past a replaced table). Blocks are
        // touched (prefetched) a group at a time, one group before they are read, so that
        // the group's cache misses overlap instead of costing one memory latency per block in
        // turn.
        let mut view = self.map.view();
        #[cfg(all(test, not(kvroute_loom)))]
        if let Some(hook) = self.after_pin.0.lock().ok().and_then(|mut h| h.take()) {
            hook(self);
        }
        if seqs.size_hint().0 >= WARM_AFTER {
            std::hint::black_box(view.warm());
        }
        let mut ahead: VecDeque<(SeqHash, u64)> = VecDeque::with_capacity(2 * AHEAD);
        loop {
            if device.is_empty() && lower.is_empty() {
                break;
            }
            if ahead.len() <= AHEAD {
                let from = ahead.len();
                ahead.extend(seqs.by_ref().take(AHEAD).map(|seq| (seq, home(seq))));
                self.touch(&view, ahead.range(from..).map(|&(_, home)| home));
            }
            let Some((seq, home)) = ahead.pop_front() else {
                break;
            };
            let shard = self.map.shard_of(home);
            // Table rule 4: a table replaced since the view was pinned may be behind what
            // the walk read in other shards; its successor is not.
            if view.replaced(shard) {
                view = self.map.view();
            }
            let changed = match view.read_changed(shard, home, seq.0, &mut last, &mut owners) {
                None => break,
                Some(changed) => changed,
            };
            if !changed || owners == previous {
                for entry in &mut lower {
                    *entry = credit(*entry, table::tiers_in(&previous, slot_at(entry.0)));
                }
            } else {
                lower.retain_mut(|entry| {
                    let tiers = table::tiers_in(&owners, slot_at(entry.0)) & !DEVICE;
                    if tiers != 0 {
                        *entry = credit(*entry, tiers);
                        true
                    } else {
                        done.push(*entry);
                        false
                    }
                });
                // `device` and `owners` are both in slot order: a merge.
                let mut at = 0;
                device.retain(|&owner| {
                    let slot = slot_at(owner);
                    while owners.get(at).is_some_and(|e| table::slot_of(*e) < slot) {
                        at += 1;
                    }
                    let tiers = owners
                        .get(at)
                        .filter(|e| table::slot_of(**e) == slot)
                        .map_or(0, |e| table::tiers_of(*e));
                    if tiers & DEVICE != 0 {
                        return true;
                    }
                    if tiers != 0 {
                        lower.push(credit((owner, depth, 0, 0), tiers));
                    } else {
                        done.push((owner, depth, 0, 0));
                    }
                    false
                });
                std::mem::swap(&mut owners, &mut previous);
            }
            depth += 1;
        }
        drop(view);
        done.extend(lower);
        done.extend(device.into_iter().map(|owner| (owner, depth, 0, 0)));
        let workers = done
            .into_iter()
            .filter_map(|(owner, device, host, disk)| {
                let (worker, dp_rank) = self.lanes.slots.resolve(refs[owner as usize])?;
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

    /// Everything the index holds for `worker` (all workers if `None`), per (worker, rank),
    /// sorted. Each shard is read under its writer lock, one at a time: a consistent view
    /// only while no events apply (tests, the admin digest).
    pub fn dump(&self, worker: Option<WorkerId>) -> Vec<Holding> {
        let mut out: Vec<Holding> = Vec::new();
        let mut at_slot: rustc_hash::FxHashMap<u32, usize> = Default::default();
        for ((w, rank), lane) in self.lanes.all() {
            if worker.is_none_or(|x| x == w) {
                at_slot.insert(lane.slot.index, out.len());
                out.push(Holding {
                    worker: w,
                    dp_rank: rank,
                    blocks: Vec::new(),
                });
            }
        }
        for index in 0..self.map.shards() {
            self.map.write_shard(index).for_each(|key, owners| {
                for &e in owners {
                    if let Some(&i) = at_slot.get(&table::slot_of(e)) {
                        for tier in Tier::ALL {
                            if table::tiers_of(e) & bit(tier) != 0 {
                                out[i].blocks.push((tier, SeqHash(key)));
                            }
                        }
                    }
                }
            });
        }
        for h in &mut out {
            h.blocks.sort_unstable();
        }
        out.sort_by_key(|h| (h.worker, h.dp_rank));
        out
    }

    /// For each (worker, rank, tier) the index holds blocks of: how many, and the XOR of
    /// their hashes (`/admin/index`, to compare replicas), in that order. Read as
    /// [`Indexer::dump`] reads, but without a list of the blocks: at millions of blocks that
    /// list was hundreds of MB, built and sorted for two numbers a row.
    pub fn digest(&self) -> Vec<Digest> {
        // Per lane: (count, XOR) for each tier of `Tier::ALL`.
        type Tiers = [(u64, u64); Tier::ALL.len()];
        let mut rows: Vec<(WorkerId, DpRank, Tiers)> = Vec::new();
        let mut at_slot: rustc_hash::FxHashMap<u32, usize> = Default::default();
        for ((w, rank), lane) in self.lanes.all() {
            at_slot.insert(lane.slot.index, rows.len());
            rows.push((w, rank, [(0, 0); Tier::ALL.len()]));
        }
        for index in 0..self.map.shards() {
            self.map.write_shard(index).for_each(|key, owners| {
                for &e in owners {
                    if let Some(&i) = at_slot.get(&table::slot_of(e)) {
                        for (t, tier) in Tier::ALL.into_iter().enumerate() {
                            if table::tiers_of(e) & bit(tier) != 0 {
                                let row = &mut rows[i].2[t];
                                row.0 += 1;
                                row.1 ^= key;
                            }
                        }
                    }
                }
            });
        }
        rows.sort_by_key(|(w, r, _)| (*w, *r));
        rows.into_iter()
            .flat_map(|(w, r, tiers)| {
                Tier::ALL
                    .into_iter()
                    .zip(tiers)
                    .filter(|(_, (n, _))| *n > 0)
                    .map(move |(tier, (blocks, xor))| Digest {
                        worker: w,
                        dp_rank: r,
                        tier,
                        blocks,
                        xor,
                    })
            })
            .collect()
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
            walks: get(&c.walks),
        }
    }

    /// Sizes of the live state. The counts are added a batch at a time, so two lanes'
    /// batches may briefly take one below zero (a block one lane created and another
    /// emptied, the emptying batch done first): read as zero then, not as 2⁶⁴ − 1.
    pub fn sizes(&self) -> Sizes {
        let read = |count: &AtomicUsize| (count.load(Ordering::Relaxed) as isize).max(0) as usize;
        Sizes {
            blocks: read(&self.block_count),
            entries: read(&self.entry_count),
            workers: self.lanes.slots.occupied(),
        }
    }

    /// Bytes of the block map's tables and arenas now (the per-block cost; lanes and slots
    /// are per worker).
    pub fn table_bytes(&self) -> usize {
        self.map.table_bytes()
    }

    /// Rebuilds every shard's table to its live size now (not below `initial_blocks`'s).
    /// Tables shrink on their own as blocks leave (at an eighth full); this also drops
    /// tombstones and dead arena regions.
    pub fn shrink_to_fit(&self) {
        for index in 0..self.map.shards() {
            self.map.write_shard(index).compact();
        }
    }
}

/// Changes to the live sizes (distinct blocks, entries) not yet added to the shared counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Tally {
    blocks: isize,
    entries: isize,
}

impl Tally {
    fn add(&mut self, other: Tally) {
        self.blocks += other.blocks;
        self.entries += other.entries;
    }
}

/// A block's probe home: its key mixed (the shard is its top bits).
fn home(seq: SeqHash) -> u64 {
    table::home_of_key(seq.0)
}

/// Adds one block held in lower `tiers` (device bit ignored) to a continuation's counts:
/// host if it is there, else disk or remote.
fn credit(
    (slot, device, host, disk): (u32, u32, u32, u32),
    tiers: TierMask,
) -> (u32, u32, u32, u32) {
    if tiers & bit(Tier::Host) != 0 {
        (slot, device, host + 1, disk)
    } else {
        (slot, device, host, disk + 1)
    }
}

#[cfg(all(test, kvroute_loom))]
mod loom_models;
#[cfg(test)]
mod tests;
