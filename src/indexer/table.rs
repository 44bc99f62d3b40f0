//! The block map: `SeqHash` → owners, sharded, with lookups that never wait on a writer.
//!
//! # Layout
//!
//! Each shard is an open-addressing table (linear probing) of 16-byte slots, `key` and
//! `word`, both atomics. The word is the node:
//!
//! - `0`: empty (ends a probe);
//! - `PRESENT`: a tombstone (the key had owners once; it has none now);
//! - `PRESENT | e0 | e1 << 20 | e2 << 40`: up to three owners inline, each a 20-bit
//!   [`Entry`] (worker slot << 4 | tier bits), sorted, zero-padded;
//! - `PRESENT | SPILLED | len << 32 | offset`: more owners (or a slot index past 16 bits)
//!   out of line, `len` entries packed two to a word in the shard's arena.
//!
//! So a block costs its slot, 16 B, divided by the table's load. While the index grows the
//! load stays between 0.41 and 0.81 (the table doubles at 13/16 used): 20 to 39 B, 27 B at
//! the mean of a doubling. At steady churn (a full cache evicting as it stores, the usual
//! state) removed keys leave tombstones that count as used; at 13/16 used the table is
//! rebuilt without them, at the same size if the live keys fill at most 5/8 of it, else
//! doubled, so the live load stays between 5/16 and 5/8: 26 to 51 B a block, by where the
//! live count falls between two powers of two. It shrinks only at 1/8, so after most blocks
//! have left a block may cost up to 128 B until then. A block shared by four or more
//! workers (shared system prompts) keeps its whole owner set out of line, 4 B an owner, in
//! an arena with room for twice the live sets and at least an eighth of a word (1 B) a
//! slot, so that the rebuilds its changes cause are paid for. Nothing else is kept per
//! block: the key is the node's address, the block's parent and `LocalHash` are not needed
//! to answer a lookup, and what a worker holds is read off the nodes when it leaves (a
//! walk; rare).
//!
//! # Concurrency
//!
//! Writers of a shard take its mutex (lanes of different workers still apply in parallel
//! across shards). Readers take no lock. Two rules make that safe:
//!
//! 1. *A slot's key never changes while its table lives.* A slot goes empty → present and
//!    stays keyed; a removed node becomes a tombstone that only the same key may revive.
//!    A reader that matched the key therefore reads that key's owners, whatever the
//!    writer does meanwhile. Tombstones are purged by rebuilding the table.
//! 2. *Arena regions are written once.* A change to a spilled owner set writes a new region
//!    and then publishes it with one store of the word (Release; readers load it Acquire),
//!    so a reader sees a whole set, old or new, never a mix. Dead regions are reclaimed by
//!    rebuilding too.
//!
//! A rebuild (grow, shrink, purge tombstones, compact the arena) happens under the shard's
//! mutex: the writer copies the live nodes into a fresh table and swaps it in, in the readers'
//! [`View`] (an [`ArcCell`]) and in the shard's books, where writers find it without any atomic
//! operation; readers already inside the old one finish there (it is current up to the swap,
//! and freed when the last of them lets go). A lookup pins every shard's table at once, with
//! one load of the view; a third rule keeps that exact:
//!
//! 3. *A new table is in the view before anything is written to it* ([`Map`]).
//!
//! A walk reads its blocks through one view, so a fourth keeps its reads in order:
//!
//! 4. *A replaced table is marked before anything is written to its successor*, and a walk
//!    about to read a marked table pins the view again. Otherwise one view could read a
//!    shard as it is and the next block's shard as it was when its table was replaced,
//!    before writes that came before the ones already read (a worker credited with blocks
//!    it never held together: a store of block 1 seen, the removal of block 2 before it
//!    not).
//!
//! All four rules are model-checked by loom with negative controls (`loom_models.rs`).
//!
//! Probe positions come from the key mixed with a per-process random seed, so a publisher
//! cannot choose hashes that pile into one probe chain.

use super::sync::{Arc, ArcCell, AtomicBool, AtomicU64, Loaded, Mutex, MutexGuard, Ordering};

/// One owner of a block: `slot << 4 | tiers` (bit `t` set: held in `Tier` `t`).
pub(crate) type Entry = u32;

/// The entry of `slot` holding the block in `tiers`.
pub(crate) const fn entry(slot: u32, tiers: u8) -> Entry {
    slot << 4 | tiers as u32
}

/// The worker slot of an entry.
pub(crate) const fn slot_of(e: Entry) -> u32 {
    e >> 4
}

/// The tier bits of an entry.
pub(crate) const fn tiers_of(e: Entry) -> u8 {
    (e & 0xF) as u8
}

/// The tiers `slot` holds in a sorted entry list, 0 if none.
pub(crate) fn tiers_in(entries: &[Entry], slot: u32) -> u8 {
    entries
        .binary_search_by_key(&slot, |e| slot_of(*e))
        .map_or(0, |i| tiers_of(entries[i]))
}

const PRESENT: u64 = 1 << 63;
const SPILLED: u64 = 1 << 62;
const ENTRY_BITS: u32 = 20;
const ENTRY_MASK: u64 = (1 << ENTRY_BITS) - 1;
const INLINE: usize = 3;
/// Largest owner count a spilled word can name, and so the most worker slots.
const MAX_SPILL: usize = (1 << 20) - 1;
/// Most worker slots an index may have.
pub(crate) const MAX_SLOTS: u32 = MAX_SPILL as u32;
/// Table slots in a 4 KiB page.
#[cfg(not(kvroute_loom))]
const SLOTS_PER_PAGE: usize = 4096 / std::mem::size_of::<Slot>();
/// Smallest table (small under loom, whose models walk whole tables).
const MIN_CAPACITY: usize = if cfg!(kvroute_loom) { 4 } else { 16 };

#[derive(Debug)]
struct Slot {
    key: AtomicU64,
    word: AtomicU64,
}

/// One generation of a shard's table. Immutable in shape; its slots and arena are atomics.
#[derive(Debug)]
pub(crate) struct Table {
    slots: Box<[Slot]>,
    arena: Box<[AtomicU64]>,
    /// Set once a successor is in the view, before anything is written to it (rule 4).
    replaced: AtomicBool,
}

impl Table {
    fn new(capacity: usize, arena: usize) -> Table {
        let table = Table {
            slots: (0..capacity)
                .map(|_| Slot {
                    key: AtomicU64::new(0),
                    word: AtomicU64::new(0),
                })
                .collect(),
            arena: (0..arena).map(|_| AtomicU64::new(0)).collect(),
            replaced: AtomicBool::new(false),
        };
        // The zeroed slots come from a zeroed allocation, whose fresh pages the kernel maps
        // on first touch. A rebuild's first touch of a page is a probe's read, which maps the
        // shared zero page; its write then faulted again, copied, and flushed the TLBs of the
        // reader threads (page faults were 44 % of the samples of `kvroute-bench indexer` at
        // 4,096 workers, the zero page's copy 19 %). One write per page first takes a single
        // fault instead.
        #[cfg(not(kvroute_loom))]
        for slot in table.slots.iter().step_by(SLOTS_PER_PAGE) {
            slot.word.store(0, Ordering::Relaxed);
        }
        table
    }

    /// The slot holding `key` (live or tombstone), or the empty slot that ends its probe.
    /// `None` only if the table is full of other keys (never: the load stays below 13/16).
    fn probe(&self, home: u64, key: u64) -> Option<Result<usize, usize>> {
        let mask = self.slots.len() - 1;
        let mut i = home as usize & mask;
        for _ in 0..self.slots.len() {
            let slot = &self.slots[i];
            if slot.word.load(Ordering::Acquire) == 0 {
                return Some(Err(i));
            }
            if slot.key.load(Ordering::Relaxed) == key {
                return Some(Ok(i));
            }
            i = (i + 1) & mask;
        }
        None
    }

    /// Decodes a word into `out` (sorted entries). False for a tombstone.
    fn decode(&self, word: u64, out: &mut Vec<Entry>) -> bool {
        out.clear();
        if word & SPILLED != 0 {
            let (offset, len) = spill_of(word);
            let region = &self.arena[offset..offset + len.div_ceil(2)];
            unpack(region.iter().map(|w| w.load(Ordering::Relaxed)), len, out);
        } else {
            for k in 0..INLINE {
                let e = (word >> (k as u32 * ENTRY_BITS)) & ENTRY_MASK;
                if e == 0 {
                    break;
                }
                out.push(e as u32);
            }
        }
        !out.is_empty()
    }

    /// Like [`Table::read`], for a walk that just read the owners `last` describes:
    /// `Some(false)` if `key`'s owners are those same owners (an equal inline word, or a
    /// spilled region with the same packed words; `out` is left as it was), else
    /// `Some(true)` with the owners decoded into `out` and `last` describing them; `None` if
    /// `key` has no owners.
    fn read_changed(
        &self,
        home: u64,
        key: u64,
        last: &mut LastRead,
        out: &mut Vec<Entry>,
    ) -> Option<bool> {
        let Some(Ok(i)) = self.probe(home, key) else {
            out.clear();
            return None;
        };
        let word = self.slots[i].word.load(Ordering::Acquire);
        if word & SPILLED == 0 {
            if word == last.word {
                return Some(false);
            }
            if !self.decode(word, out) {
                return None;
            }
            last.word = word;
            last.packed.clear();
            return Some(true);
        }
        // Equal sets in different blocks are different regions (of different shards'
        // arenas, as often as not) with the same contents: comparing the packed words costs
        // a memcmp where decoding and comparing the entries cost a pass over each.
        let (offset, len) = spill_of(word);
        let region = self.arena.get(offset..offset + len.div_ceil(2))?;
        if last.word == SPILLED_LAST
            && last.len == len
            && region
                .iter()
                .zip(&last.packed)
                .all(|(w, p)| w.load(Ordering::Relaxed) == *p)
        {
            return Some(false);
        }
        last.word = SPILLED_LAST;
        last.len = len;
        last.packed.clear();
        last.packed
            .extend(region.iter().map(|w| w.load(Ordering::Relaxed)));
        out.clear();
        unpack(last.packed.iter().copied(), len, out);
        (!out.is_empty()).then_some(true)
    }

    /// The owners of `key`, into `out`. False if it has none.
    fn read(&self, home: u64, key: u64, out: &mut Vec<Entry>) -> bool {
        match self.probe(home, key) {
            Some(Ok(i)) => self.decode(self.slots[i].word.load(Ordering::Acquire), out),
            _ => {
                out.clear();
                false
            }
        }
    }
}

/// What a walk read last: the owners it holds as the previous level's, described so that a
/// block with the same owners is recognised without decoding them.
#[derive(Debug, Default)]
pub(crate) struct LastRead {
    /// The inline word read last, [`SPILLED_LAST`] after a spilled set, 0 before any read
    /// (a keyed slot's word is never 0).
    word: u64,
    /// After a spilled set: its entry count and packed arena words.
    len: usize,
    packed: Vec<u64>,
}

/// [`LastRead::word`] after a spilled set (no inline word has `SPILLED` set).
const SPILLED_LAST: u64 = SPILLED;

/// Where a spilled word's owners are: (arena offset, entry count).
fn spill_of(word: u64) -> (usize, usize) {
    (
        (word & 0xFFFF_FFFF) as usize,
        ((word >> 32) & ENTRY_MASK) as usize,
    )
}

/// Appends to `out` the `len` entries packed two to a word in `pairs`, low half first
/// (as [`write_region`] packs them).
fn unpack(pairs: impl IntoIterator<Item = u64>, len: usize, out: &mut Vec<Entry>) {
    out.reserve(len);
    for (k, pair) in pairs.into_iter().enumerate() {
        out.push(pair as u32);
        if 2 * k + 1 < len {
            out.push((pair >> 32) as u32);
        }
    }
}

/// A shard's writer side, under its mutex: its current table and the bookkeeping.
#[derive(Debug)]
struct Books {
    /// The current table. Only the mutex's holder replaces it, so a writer uses it
    /// without touching its reference count or an `arc-swap` slot (readers pin the
    /// [`View`] instead).
    table: Arc<Table>,
    /// Keys with owners.
    live: usize,
    /// Keyed slots, live or tombstone.
    used: usize,
    /// Next free arena word.
    arena_top: usize,
    /// Arena words of regions still referenced.
    arena_live: usize,
    /// Rebuilds since creation (for tests and the bench).
    rebuilds: u64,
    /// The smallest table: the size asked for at start (`initial_blocks`). Shrinking below
    /// it threw the presizing away at the first removal, and the tables grew through every
    /// doubling again.
    floor: usize,
    /// Under `cfg(test)`, revive tombstones for any key (the loom negative control of rule 1).
    #[cfg(all(test, kvroute_loom))]
    broken_reuse: bool,
    /// Under `cfg(test)`, write every region at the arena's start, over the one readers may
    /// be reading (the loom negative control of rule 2).
    #[cfg(all(test, kvroute_loom))]
    broken_regions: bool,
}

impl Books {
    /// An empty shard's, with room for `expected` keys.
    fn new(expected: usize) -> Books {
        let floor = capacity_for(expected);
        Books {
            table: Arc::new(Table::new(floor, 0)),
            live: 0,
            used: 0,
            arena_top: 0,
            arena_live: 0,
            rebuilds: 0,
            floor,
            #[cfg(all(test, kvroute_loom))]
            broken_reuse: false,
            #[cfg(all(test, kvroute_loom))]
            broken_regions: false,
        }
    }
}

/// Every shard's current table at one moment: what a lookup pins, once, to read any shard.
///
/// Pinning is an atomic read-modify-write (an `arc-swap` debt slot, and another to pay it
/// back), and on x86 each waits for every load before it; a pin per block read would make a
/// walk take its cache misses one at a time. A view is replaced whole when any shard's
/// table is (rare: growth, shrinking, compaction).
#[derive(Debug)]
pub(crate) struct View(Box<[Arc<Table>]>);

impl View {
    /// Lock-free read of `key`'s owners into `out`. False if it has none.
    pub(crate) fn read(&self, shard: usize, home: u64, key: u64, out: &mut Vec<Entry>) -> bool {
        self.0[shard].read(home, key, out)
    }

    /// [`Table::read_changed`] through the view.
    pub(crate) fn read_changed(
        &self,
        shard: usize,
        home: u64,
        key: u64,
        last: &mut LastRead,
        out: &mut Vec<Entry>,
    ) -> Option<bool> {
        self.0[shard].read_changed(home, key, last, out)
    }

    /// Whether shard `shard`'s table here was replaced, and may be behind writes a walk
    /// read elsewhere since it pinned this view (rule 4: pin again).
    pub(crate) fn replaced(&self, shard: usize) -> bool {
        self.0[shard].replaced.load(Ordering::Acquire)
    }

    /// Loads every shard's table header (where its slots are), so that a long walk does not
    /// wait on them one by one while its caches are cold. Returns a value to `black_box`.
    pub(crate) fn warm(&self) -> usize {
        self.0.iter().fold(0, |acc, t| acc ^ t.slots.len())
    }

    /// Starts the cache miss of the first slot `home` probes, so that it is under way
    /// before the read: a prefetch on x86-64, which retires at once (a load held up the
    /// instructions behind it until its line came, so a group of them overlapped only with
    /// each other); a load elsewhere and under loom.
    pub(crate) fn touch(&self, shard: usize, home: u64) {
        let slots = &self.0[shard].slots;
        let slot = &slots[home as usize & (slots.len() - 1)];
        #[cfg(all(target_arch = "x86_64", not(kvroute_loom)))]
        safe_arch::prefetch_t0(slot);
        #[cfg(not(all(target_arch = "x86_64", not(kvroute_loom))))]
        std::hint::black_box(slot.word.load(Ordering::Relaxed));
    }
}

/// The block map: shards, and the [`View`] of their tables that readers pin.
///
/// The view rule: a shard's new table is in the published view before any write lands in
/// it (the rebuild publishes under the shard's mutex). A reader's pinned view therefore
/// holds tables that were current when it was pinned, each frozen at the moment it was
/// replaced, if it was: every block a lookup reads is as some moment after its pin saw it.
/// Without the rule, a reader could pin a table that was already replaced and miss writes
/// that happened before it started. Model-checked by loom with a negative control.
#[derive(Debug)]
pub(crate) struct Map {
    shards: Box<[Mutex<Books>]>,
    view: ArcCell<View>,
    /// Serialises publishing views (taken under a shard's mutex, and nothing takes a shard's
    /// mutex under it). Holds the view last replaced, brought up to date, when no reader
    /// still had it: the next publish reuses it, so publishing costs O(1) rather than a
    /// reference count taken and dropped per shard (those were 18 % of the event plane's
    /// samples while its tables grew).
    publishing: Mutex<Option<View>>,
    /// A key's shard is the top bits of its mixed hash.
    shift: u32,
    /// Under `cfg(test)`, a rebuild publishes its view only when its writer lets go of the
    /// shard (the loom negative control of the view rule).
    #[cfg(all(test, kvroute_loom))]
    broken_publish: std::sync::atomic::AtomicBool,
}

impl Map {
    /// `shards` (a power of two, at least 2) empty shards, each with room for `expected` keys.
    pub(crate) fn new(shards: usize, expected: usize) -> Map {
        debug_assert!(shards.is_power_of_two() && shards >= 2);
        let shards: Box<[Mutex<Books>]> = (0..shards)
            .map(|_| Mutex::new(Books::new(expected)))
            .collect();
        let view = View(shards.iter().map(|s| Arc::clone(&s.lock().table)).collect());
        Map {
            shift: 64 - shards.len().trailing_zeros(),
            shards,
            view: ArcCell::new(Arc::new(view)),
            publishing: Mutex::new(None),
            #[cfg(all(test, kvroute_loom))]
            broken_publish: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The shard a probe home falls in (its top bits).
    pub(crate) fn shard_of(&self, home: u64) -> usize {
        (home >> self.shift) as usize
    }

    /// The tables now, for a lookup.
    pub(crate) fn view(&self) -> Loaded<View> {
        self.view.load()
    }

    /// Lock-free read of `key`'s owners into `out` (pins a view for this one read). False
    /// if it has none.
    pub(crate) fn read(&self, home: u64, key: u64, out: &mut Vec<Entry>) -> bool {
        self.view().read(self.shard_of(home), home, key, out)
    }

    /// Takes the writer lock of the shard `home` falls in.
    pub(crate) fn write(&self, home: u64) -> ShardWriter<'_> {
        self.write_shard(self.shard_of(home))
    }

    /// Takes shard `index`'s writer lock.
    pub(crate) fn write_shard(&self, index: usize) -> ShardWriter<'_> {
        ShardWriter {
            books: self.shards[index].lock(),
            map: self,
            index,
            deferred: false,
            #[cfg(all(test, kvroute_loom))]
            late_view: None,
        }
    }

    /// The number of shards.
    pub(crate) fn shards(&self) -> usize {
        self.shards.len()
    }

    /// Heap bytes of the current tables (slots and arenas).
    pub(crate) fn table_bytes(&self) -> usize {
        self.view()
            .0
            .iter()
            .map(|t| t.slots.len() * std::mem::size_of::<Slot>() + t.arena.len() * 8)
            .sum()
    }

    /// Puts `table` in the view as shard `index`'s. Called by that shard's writer.
    fn publish(&self, index: usize, table: &Arc<Table>) {
        let mut spare = self.publishing.lock();
        let mut next = spare
            .take()
            .unwrap_or_else(|| View(self.view.load().0.clone()));
        next.0[index] = Arc::clone(table);
        let replaced = self.view.swap(Arc::new(next));
        // The replaced view differs from the new one in this shard only.
        if let Ok(mut old) = Arc::try_unwrap(replaced) {
            old.0[index] = Arc::clone(table);
            *spare = Some(old);
        }
    }

    #[cfg(all(test, kvroute_loom))]
    pub(crate) fn break_reuse(&self) {
        for shard in self.shards.iter() {
            shard.lock().broken_reuse = true;
        }
    }

    #[cfg(all(test, kvroute_loom))]
    pub(crate) fn break_regions(&self) {
        for shard in self.shards.iter() {
            shard.lock().broken_regions = true;
        }
    }

    #[cfg(all(test, kvroute_loom))]
    pub(crate) fn break_publish(&self) {
        self.broken_publish
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// What a [`ShardWriter::set`] did to the node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Change {
    /// The key had no owners and has some now.
    Created,
    /// The key had owners and has none now.
    Emptied,
    /// Neither.
    Updated,
}

/// A shard's writer: holds its mutex.
pub(crate) struct ShardWriter<'a> {
    map: &'a Map,
    index: usize,
    books: MutexGuard<'a, Books>,
    /// Set by [`ShardWriter::defer_shrinking`].
    deferred: bool,
    /// Under `cfg(test)`, a table the broken rebuild publishes only when the writer lets go.
    #[cfg(all(test, kvroute_loom))]
    late_view: Option<Arc<Table>>,
}

#[cfg(all(test, kvroute_loom))]
impl Drop for ShardWriter<'_> {
    fn drop(&mut self) {
        if let Some(table) = self.late_view.take() {
            self.map.publish(self.index, &table);
        }
    }
}

impl ShardWriter<'_> {
    /// The owners of `key` into `out`. False if none.
    pub(crate) fn read(&self, home: u64, key: u64, out: &mut Vec<Entry>) -> bool {
        self.books.table.read(home, key, out)
    }

    /// Sets `key`'s owners to `owners` (sorted by slot, no zero tier sets; empty removes).
    pub(crate) fn set(&mut self, home: u64, key: u64, owners: &[Entry]) -> Change {
        debug_assert!(owners.windows(2).all(|w| slot_of(w[0]) < slot_of(w[1])));
        debug_assert!(owners.iter().all(|e| tiers_of(*e) != 0));
        let found = self.probe_for_write(home, key);
        let (index, was_live, old) = match found {
            Ok(i) => {
                let old = self.books.table.slots[i].word.load(Ordering::Relaxed);
                (Some(i), old != PRESENT, old)
            }
            Err(_) if owners.is_empty() => return Change::Updated,
            Err(_) => (None, false, 0),
        };
        if owners.is_empty() {
            let i = index.expect("invariant: a live key was found");
            self.books.table.slots[i]
                .word
                .store(PRESENT, Ordering::Release);
            self.release_region(old);
            self.books.live -= usize::from(was_live);
            if !self.deferred && self.sparse() {
                self.rebuild(0, 0);
            }
            return if was_live {
                Change::Emptied
            } else {
                Change::Updated
            };
        }
        // Room first: growing or compacting moves the node, so place it afterwards.
        let spill_words = spill_words(owners);
        if self.books.arena_top + spill_words > self.books.table.arena.len() {
            self.rebuild(usize::from(index.is_none()), spill_words);
        } else if index.is_none() && (self.books.used + 1) * 16 > self.books.table.slots.len() * 13
        {
            // With room for this set's region: the grown arena is sized for the live sets,
            // which may be none.
            self.rebuild(1, spill_words);
        }
        let word = self.encode(owners);
        match self.probe_for_write(home, key) {
            Ok(i) => {
                let old = self.books.table.slots[i].word.load(Ordering::Relaxed);
                self.books.table.slots[i]
                    .word
                    .store(word, Ordering::Release);
                self.release_region(old);
                // A set that shrank may leave the arena mostly dead.
                if old & SPILLED != 0 && !self.deferred && self.sparse() {
                    self.rebuild(0, 0);
                }
            }
            Err(i) => {
                let slot = &self.books.table.slots[i];
                slot.key.store(key, Ordering::Relaxed);
                slot.word.store(word, Ordering::Release);
                self.books.used += 1;
            }
        }
        if was_live {
            Change::Updated
        } else {
            self.books.live += 1;
            Change::Created
        }
    }

    /// Whether the table should shrink: an eighth full, or empty with an arena, or its
    /// arena over twice what a rebuild would give it (and over a quarter word a slot, so
    /// that a set moving in and out of line does not rebuild the shard each time).
    fn sparse(&self) -> bool {
        let cap = self.books.table.slots.len();
        let arena = self.books.table.arena.len();
        (self.books.live < cap / 8 && cap > self.books.floor)
            || (self.books.live == 0 && arena > 0)
            || arena
                > (2 * arena_words(self.books.arena_live, cap))
                    .max(cap / 4)
                    .max(64)
    }

    /// Stops [`ShardWriter::set`] from shrinking the table until [`ShardWriter::settle`]: a
    /// walk that empties most keys rebuilds once, to the size it ends at, instead of at
    /// every eighth on the way down (fewer tables allocated and freed, less for the
    /// allocator to keep).
    pub(crate) fn defer_shrinking(&mut self) {
        self.deferred = true;
    }

    /// Shrinks the table if removals since [`ShardWriter::defer_shrinking`] left it sparse.
    pub(crate) fn settle(&mut self) {
        self.deferred = false;
        if self.sparse() {
            self.rebuild(0, 0);
        }
    }

    /// Calls `f(key, owners)` for every live node of the shard.
    pub(crate) fn for_each(&self, mut f: impl FnMut(u64, &[Entry])) {
        let mut buf = Vec::new();
        for slot in self.books.table.slots.iter() {
            let word = slot.word.load(Ordering::Relaxed);
            if word != 0 && self.books.table.decode(word, &mut buf) {
                f(slot.key.load(Ordering::Relaxed), &buf);
            }
        }
    }

    /// Rebuilds the table to its live size now (drops tombstones and dead regions).
    pub(crate) fn compact(&mut self) {
        self.rebuild(0, 0);
    }

    /// Rebuilds done since the shard was created.
    #[cfg(test)]
    pub(crate) fn rebuilds(&self) -> u64 {
        self.books.rebuilds
    }

    fn probe_for_write(&self, home: u64, key: u64) -> Result<usize, usize> {
        #[cfg(all(test, kvroute_loom))]
        if self.books.broken_reuse {
            // Broken on purpose: the first tombstone on the probe is taken as a free slot
            // by any key, which is rekeyed (its key, then its word, as a new key's slot is
            // written): wrong only for a reader that matched the old key in between.
            let mask = self.books.table.slots.len() - 1;
            let mut i = home as usize & mask;
            loop {
                let w = self.books.table.slots[i].word.load(Ordering::Relaxed);
                let k = self.books.table.slots[i].key.load(Ordering::Relaxed);
                if k == key && w != 0 {
                    return Ok(i);
                }
                if w == 0 || w == PRESENT {
                    return Err(i);
                }
                i = (i + 1) & mask;
            }
        }
        self.books
            .table
            .probe(home, key)
            .expect("invariant: the load factor stays below 13/16, so a probe ends")
    }

    /// The word for `owners`, writing a fresh arena region if they do not fit inline. The
    /// caller made room.
    fn encode(&mut self, owners: &[Entry]) -> u64 {
        if spill_words(owners) == 0 {
            let mut word = PRESENT;
            for (k, e) in owners.iter().enumerate() {
                word |= u64::from(*e) << (k as u32 * ENTRY_BITS);
            }
            return word;
        }
        #[cfg(all(test, kvroute_loom))]
        if self.books.broken_regions {
            self.books.arena_live += owners.len().div_ceil(2);
            return write_region(&self.books.table.arena, 0, owners);
        }
        let word = write_region(&self.books.table.arena, self.books.arena_top, owners);
        let words = owners.len().div_ceil(2);
        self.books.arena_top += words;
        self.books.arena_live += words;
        word
    }

    fn release_region(&mut self, old: u64) {
        if old & SPILLED != 0 {
            self.books.arena_live -= spill_of(old).1.div_ceil(2);
        }
    }

    /// Copies the live nodes into a fresh table sized for them plus `more` nodes and
    /// `more_arena` arena words, and swaps it in.
    fn rebuild(&mut self, more: usize, more_arena: usize) {
        let capacity = capacity_for(self.books.live + more).max(self.books.floor);
        let arena = arena_words(self.books.arena_live + more_arena, capacity);
        let next = Table::new(capacity, arena);
        let mask = capacity - 1;
        let mut buf = Vec::new();
        let mut arena_top = 0;
        for slot in self.books.table.slots.iter() {
            let word = slot.word.load(Ordering::Relaxed);
            if word == 0 || !self.books.table.decode(word, &mut buf) {
                continue;
            }
            let key = slot.key.load(Ordering::Relaxed);
            let word = if word & SPILLED != 0 {
                let word = write_region(&next.arena, arena_top, &buf);
                arena_top += buf.len().div_ceil(2);
                word
            } else {
                word
            };
            let mut i = home_of_key(key) as usize & mask;
            while next.slots[i].word.load(Ordering::Relaxed) != 0 {
                i = (i + 1) & mask;
            }
            next.slots[i].key.store(key, Ordering::Relaxed);
            next.slots[i].word.store(word, Ordering::Relaxed);
        }
        let next = Arc::new(next);
        // The view rule: readers can pin the new table before anything is written to it.
        // The stores publish every store above (they are releases).
        #[cfg(all(test, kvroute_loom))]
        if self
            .map
            .broken_publish
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            self.late_view = Some(Arc::clone(&next));
        } else {
            self.map.publish(self.index, &next);
        }
        #[cfg(not(all(test, kvroute_loom)))]
        self.map.publish(self.index, &next);
        // Rule 4: marked before the new table takes a write. A walk that then reads (an
        // acquire of) a word stored after one of those writes sees the mark: the mark comes
        // before the writes in this thread, and they before that store.
        self.books.table.replaced.store(true, Ordering::Release);
        self.books.table = next;
        self.books.used = self.books.live;
        self.books.arena_top = arena_top;
        self.books.arena_live = arena_top;
        self.books.rebuilds += 1;
    }
}

/// The table size for `live` keys: at most 5/8 full, so there is room before the next
/// rebuild at 13/16.
fn capacity_for(live: usize) -> usize {
    (live * 8 / 5 + 1).next_power_of_two().max(MIN_CAPACITY)
}

/// Writes `owners` into `arena` at `offset`, two to a word, and returns the spilled word
/// naming the region (published later by one store of it).
fn write_region(arena: &[AtomicU64], offset: usize, owners: &[Entry]) -> u64 {
    for (k, pair) in owners.chunks(2).enumerate() {
        let lo = u64::from(pair[0]);
        let hi = pair.get(1).map_or(0, |e| u64::from(*e));
        arena[offset + k].store(lo | hi << 32, Ordering::Relaxed);
    }
    PRESENT | SPILLED | (owners.len() as u64) << 32 | offset as u64
}

/// Arena words `owners` need (0: they fit inline).
/// Arena words a rebuild gives a shard of `capacity` slots whose live regions need `need`:
/// twice that, and at least an eighth of a word a slot. A change to a spilled set writes
/// the whole set anew, so a block shared by many workers fills the arena fast; with the
/// floor, the next rebuild (a copy of the whole shard) comes only after `capacity / 8` words
/// of new regions, which pay for it.
fn arena_words(need: usize, capacity: usize) -> usize {
    if need == 0 {
        0
    } else {
        (need * 2).max(32).max(capacity / 8)
    }
}

fn spill_words(owners: &[Entry]) -> usize {
    if owners.len() <= INLINE && owners.iter().all(|e| u64::from(*e) <= ENTRY_MASK) {
        0
    } else {
        assert!(
            owners.len() <= MAX_SPILL,
            "owner count is capped by max_workers"
        );
        owners.len().div_ceil(2)
    }
}

/// The probe seed: random per process so that publishers cannot aim at one probe chain.
pub(crate) fn seed() -> u64 {
    use std::sync::OnceLock;
    static SEED: OnceLock<u64> = OnceLock::new();
    *SEED.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(0x6b76_726f_7574_6521);
        h.finish()
    })
}

/// The mixed hash of a key: the shard is its top bits, the probe start its low bits.
pub(crate) fn home_of_key(key: u64) -> u64 {
    // splitmix64's finalizer (Steele, Lea, Flood 2014) over the seeded key.
    let mut z = key ^ seed();
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owners(n: u32) -> Vec<Entry> {
        (0..n)
            .map(|s| entry(s * 7 + 1, 1 | ((s % 2) as u8 * 2)))
            .collect()
    }

    #[test]
    fn inline_spilled_tombstones_and_rebuilds() {
        let map = Map::new(2, 0);
        let mut buf = Vec::new();
        let mut w = map.write_shard(0);
        for key in 0..1000u64 {
            let o = owners((key % 7) as u32 + 1);
            assert_eq!(w.set(home_of_key(key), key, &o), Change::Created);
        }
        assert!(w.rebuilds() > 0, "1,000 keys outgrow 16 slots");
        for key in 0..1000u64 {
            assert!(w.read(home_of_key(key), key, &mut buf));
            assert_eq!(buf, owners((key % 7) as u32 + 1));
        }
        // Shrink a spilled set to inline and back, then empty every key.
        assert_eq!(w.set(home_of_key(6), 6, &owners(2)), Change::Updated);
        assert_eq!(w.set(home_of_key(6), 6, &owners(6)), Change::Updated);
        for key in 0..1000u64 {
            assert_eq!(w.set(home_of_key(key), key, &[]), Change::Emptied);
            assert_eq!(w.set(home_of_key(key), key, &[]), Change::Updated);
        }
        drop(w);
        for key in 0..1000u64 {
            assert!(!map.view().read(0, home_of_key(key), key, &mut buf));
        }
        assert_eq!(map.table_bytes(), 2 * MIN_CAPACITY * 16, "shrinks back");
    }

    #[test]
    fn deferred_shrinking_rebuilds_once_when_settled() {
        let map = Map::new(2, 0);
        let mut w = map.write_shard(0);
        for key in 0..1000u64 {
            w.set(home_of_key(key), key, &owners(1));
        }
        let before = w.rebuilds();
        w.defer_shrinking();
        for key in 0..1000u64 {
            w.set(home_of_key(key), key, &[]);
        }
        assert_eq!(w.rebuilds(), before, "no rebuild while deferred");
        w.settle();
        assert_eq!(w.rebuilds(), before + 1, "one rebuild to the final size");
        drop(w);
        assert_eq!(map.table_bytes(), 2 * MIN_CAPACITY * 16);
    }

    /// A spilled set inserted under a new key when the table must grow, while no spilled
    /// set is live (the arena emptied): the grown table has arena room for it. It was sized
    /// for the live sets alone, none, and writing the region panicked (a writer's panic
    /// mid-batch; reachable with slot indices past 16 bits, `max_workers` over 65,536).
    #[test]
    fn a_spilled_key_inserted_as_the_table_grows_has_arena_room() {
        let map = Map::new(2, 0);
        let mut buf = Vec::new();
        let mut w = map.write_shard(0);
        let big = [entry(70_000, 1)];
        assert_eq!(w.set(home_of_key(0), 0, &big), Change::Created);
        for key in 1..12u64 {
            w.set(home_of_key(key), key, &owners(1));
        }
        assert_eq!(w.set(home_of_key(0), 0, &[]), Change::Emptied);
        w.set(home_of_key(12), 12, &owners(1));
        assert_eq!(w.set(home_of_key(13), 13, &big), Change::Created);
        assert!(w.read(home_of_key(13), 13, &mut buf));
        assert_eq!(buf, big);
    }

    #[test]
    fn slot_indices_past_16_bits_spill() {
        let map = Map::new(2, 0);
        let mut buf = Vec::new();
        let big = [entry(70_000, 1)];
        map.write(home_of_key(5)).set(home_of_key(5), 5, &big);
        assert!(map.read(home_of_key(5), 5, &mut buf));
        assert_eq!(buf, big);
    }

    /// A block shared by many workers changes owners often: the shard is not copied again
    /// every few changes, and once the shared sets shrink, the arena shrinks with them.
    #[test]
    fn the_arena_pays_for_its_rebuilds_and_shrinks_back() {
        let map = Map::new(2, 0);
        let mut w = map.write_shard(0);
        for key in 0..10_000u64 {
            w.set(home_of_key(key), key, &owners(1));
        }
        let before = w.rebuilds();
        for i in 0..30 {
            w.set(home_of_key(0), 0, &owners(16 + i % 2));
        }
        assert!(
            w.rebuilds() - before <= 2,
            "{} rebuilds for 30 changes of one set",
            w.rebuilds() - before
        );
        // 400 sets of 40 owners (8,000 words), then of 2 (inline).
        for key in 0..400u64 {
            w.set(home_of_key(key), key, &owners(40));
        }
        for key in 0..400u64 {
            w.set(home_of_key(key), key, &owners(2));
        }
        let capacity = w.books.table.slots.len();
        drop(w);
        let fresh = Map::new(2, 0);
        let mut f = fresh.write_shard(0);
        for key in 0..10_000u64 {
            f.set(
                home_of_key(key),
                key,
                &owners(if key < 400 { 2 } else { 1 }),
            );
        }
        drop(f);
        // At most the quarter word a slot kept against rebuilding back and forth.
        let kept = map.table_bytes() - fresh.table_bytes();
        assert!(kept <= capacity / 4 * 8, "{kept} B of dead arena kept");
    }

    #[test]
    fn churn_keeps_the_table_small() {
        let map = Map::new(2, 0);
        let mut w = map.write_shard(0);
        for round in 0..50u64 {
            for key in 0..200u64 {
                let k = round << 32 | key;
                w.set(home_of_key(k), k, &owners(1 + (key % 5) as u32));
            }
            for key in 0..200u64 {
                let k = round << 32 | key;
                w.set(home_of_key(k), k, &[]);
            }
        }
        drop(w);
        assert_eq!(map.table_bytes(), 2 * MIN_CAPACITY * 16);
    }
}
