//! One tier's fixed pool of block slots: states, the hash index, child counts and the
//! eviction order.
//!
//! A block's child count (how many registered blocks of this tier extend it) lives in its
//! slot while it is indexed, so registering or dropping a block touches its parent's slot,
//! which the hash index finds anyway, and no second map. Blocks of this tier whose parent is
//! not in it (G2 holds a block whose parent is still in G1) are counted in `orphans`, keyed
//! by the parent's hash, until the parent arrives.

use std::hash::BuildHasher;

use hashbrown::HashTable;
use hashbrown::hash_table::Entry;
use kvroute::protocol::{LocalHash, SeqHash, StoredBlock, Tier};
use rustc_hash::{FxBuildHasher, FxHashMap};

use super::order::Order;
use super::{BlockId, Change, EvictionPolicy, TierUsage};

/// Lifecycle of a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum State {
    /// Unused.
    Free,
    /// Owned by one request: being filled.
    Mutable,
    /// Full, in the hash index, used by `refs` requests or transfers.
    Registered,
    /// Full, in the hash index, used by nobody: cached and evictable.
    Inactive,
}

/// [`Slot::parent_slot`] of a block registered without an indexed parent.
const NO_SLOT: u32 = u32::MAX;

// A slot is one cache line, aligned to one: a field more would make each take two.
const _: () = assert!(std::mem::size_of::<Slot>() == 64);

#[derive(Clone, Debug)]
#[repr(align(64))]
pub(super) struct Slot {
    pub state: State,
    pub refs: u32,
    pub seq: SeqHash,
    pub local: LocalHash,
    pub parent: Option<SeqHash>,
    /// The slot `parent` was indexed in when this block was registered: where to look for
    /// it first (checked before use; it may have moved since); [`NO_SLOT`] if none.
    parent_slot: u32,
    /// The `by_hash` bucket this block was indexed in: where its entry is taken out from
    /// when it leaves the index (checked before use; a rehash may have moved it).
    bucket: u32,
    pub last_used: u64,
    pub hits: u32,
    /// Registered blocks of this tier whose parent this is (while it is indexed).
    children: u32,
    /// A mutable slot an onboard copy is writing.
    pub in_transfer: bool,
    /// Its lease was dropped during the copy: free it when the copy ends.
    pub abandoned: bool,
    /// Evicted from the index and held (registered, one ref) by the copy to G2 that reads
    /// it; freed when the copy ends.
    pub detached: bool,
}

impl Slot {
    fn empty() -> Self {
        Slot {
            state: State::Free,
            refs: 0,
            seq: SeqHash(0),
            local: LocalHash(0),
            parent: None,
            parent_slot: NO_SLOT,
            bucket: 0,
            last_used: 0,
            hits: 0,
            children: 0,
            in_transfer: false,
            abandoned: false,
            detached: false,
        }
    }
}

#[derive(Debug)]
pub(super) struct Pool {
    tier: Tier,
    pub slots: Vec<Slot>,
    free: Vec<BlockId>,
    /// The slot of every indexed block, found by its hash, which the slot holds: 4 bytes
    /// an entry where a map from hash to slot takes 16, so more of it stays in cache.
    by_hash: HashTable<u32>,
    /// Parent `SeqHash` not indexed in this tier → how many registered blocks of this tier
    /// extend it (indexed parents keep the count in their slot).
    orphans: FxHashMap<SeqHash, u32>,
    /// Inactive blocks the policy may evict, in its order.
    evictable: Order,
    policy: Box<dyn EvictionPolicy>,
    mutable: usize,
    registered: usize,
    inactive: usize,
    detached: usize,
}

impl Pool {
    pub fn new(tier: Tier, capacity: usize, policy: Box<dyn EvictionPolicy>) -> Self {
        Pool {
            tier,
            slots: vec![Slot::empty(); capacity],
            // Popped from the back: hand out low slot numbers first.
            free: (0..capacity as u32).rev().map(BlockId).collect(),
            by_hash: HashTable::new(),
            orphans: FxHashMap::default(),
            evictable: Order::new(capacity),
            policy,
            mutable: 0,
            registered: 0,
            inactive: 0,
            detached: 0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    pub fn inactive_count(&self) -> usize {
        self.inactive
    }

    pub fn usage(&self) -> TierUsage {
        TierUsage {
            capacity: self.slots.len(),
            free: self.free.len(),
            mutable: self.mutable,
            registered: self.registered,
            inactive: self.inactive,
            offloading: self.detached,
        }
    }

    pub fn lookup(&self, seq: SeqHash) -> Option<BlockId> {
        let slots = &self.slots;
        self.by_hash
            .find(hash(seq), |&i| slots[i as usize].seq == seq)
            .map(|&i| BlockId(i))
    }

    pub fn has_children(&self, seq: SeqHash) -> bool {
        match self.lookup(seq) {
            Some(id) => self.slots[id.index()].children > 0,
            None => self.orphans.contains_key(&seq),
        }
    }

    /// Indexes slot `id` (not indexed yet) under the hash it holds, unless another slot
    /// is indexed under it (false): one probe for the check and the insertion.
    fn index_slot(&mut self, id: BlockId) -> bool {
        let slots = &self.slots;
        let seq = slots[id.index()].seq;
        let bucket = match self.by_hash.entry(
            hash(seq),
            |&i| slots[i as usize].seq == seq,
            |&i| hash(slots[i as usize].seq),
        ) {
            Entry::Occupied(_) => return false,
            Entry::Vacant(v) => v.insert(id.0).bucket_index(),
        };
        self.slots[id.index()].bucket = bucket as u32;
        true
    }

    /// Takes slot `id` (indexed) out of the index: at the bucket it was put in, where its
    /// control byte and its entry load together, instead of a probe whose entry load waits
    /// for the control bytes' (two cache misses in a row: most of an eviction's time); by
    /// a probe if a rehash has moved it.
    fn unindex_slot(&mut self, id: BlockId) {
        let slot = &self.slots[id.index()];
        let (seq, bucket) = (slot.seq, slot.bucket as usize);
        if let Ok(entry) = self.by_hash.get_bucket_entry(bucket)
            && *entry.get() == id.0
        {
            entry.remove();
        } else if let Ok(entry) = self.by_hash.find_entry(hash(seq), |&i| i == id.0) {
            entry.remove();
        } else {
            debug_assert!(false, "invariant: {id:?} is indexed");
        }
    }

    /// The indexed slots.
    fn indexed(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.by_hash.iter().map(|&i| BlockId(i))
    }

    pub fn slot(&self, id: BlockId) -> &Slot {
        &self.slots[id.index()]
    }

    pub fn slot_mut(&mut self, id: BlockId) -> &mut Slot {
        &mut self.slots[id.index()]
    }

    pub fn resident(&self) -> impl Iterator<Item = (SeqHash, &Slot)> {
        self.indexed().map(|id| {
            let slot = &self.slots[id.index()];
            (slot.seq, slot)
        })
    }

    /// Free → Mutable.
    pub fn take_free(&mut self) -> Option<BlockId> {
        let id = self.free.pop()?;
        let slot = &mut self.slots[id.index()];
        debug_assert_eq!(slot.state, State::Free);
        *slot = Slot {
            state: State::Mutable,
            ..Slot::empty()
        };
        self.mutable += 1;
        Some(id)
    }

    /// Mutable → Free.
    pub fn free_mutable(&mut self, id: BlockId) {
        let slot = &mut self.slots[id.index()];
        debug_assert_eq!(slot.state, State::Mutable);
        *slot = Slot::empty();
        self.mutable -= 1;
        self.free.push(id);
    }

    /// A request or transfer starts using a registered or inactive block.
    pub fn acquire(&mut self, id: BlockId, tick: u64) {
        self.set_evictable(id, false);
        let slot = &mut self.slots[id.index()];
        debug_assert!(matches!(slot.state, State::Registered | State::Inactive));
        if slot.state == State::Inactive {
            slot.state = State::Registered;
            self.inactive -= 1;
            self.registered += 1;
        }
        slot.refs += 1;
        slot.last_used = tick;
    }

    /// The slots of the resident blocks `seqs` (a prefix just matched).
    pub fn lookup_all(&self, seqs: &[SeqHash]) -> Vec<BlockId> {
        seqs.iter()
            .map(|seq| {
                self.lookup(*seq)
                    .expect("invariant: matched block is indexed")
            })
            .collect()
    }

    /// One hit for each of the (acquired) blocks `ids`.
    pub fn count_hits(&mut self, ids: &[BlockId]) {
        for id in ids {
            let hits = &mut self.slots[id.index()].hits;
            *hits = hits.saturating_add(1);
        }
    }

    /// A request or transfer stops using a registered block, last used at `tick` (an
    /// acquire undone passes the block's recency from before it, so that it keeps its place
    /// in the eviction order).
    pub fn release(&mut self, id: BlockId, tick: u64) {
        let slot = &mut self.slots[id.index()];
        debug_assert_eq!(slot.state, State::Registered);
        slot.refs -= 1;
        slot.last_used = tick;
        if slot.refs == 0 {
            slot.state = State::Inactive;
            self.registered -= 1;
            self.inactive += 1;
            self.refresh(id);
        }
    }

    /// Mutable → full. Registers the block under its hash and announces it, unless the
    /// tier already holds that hash: then nothing changes and it returns false (the caller
    /// shares the registered block and frees this slot). `near` is where the parent probably is (the
    /// slot before it in the same lease), checked before use.
    pub fn register(
        &mut self,
        id: BlockId,
        parent: Option<SeqHash>,
        near: Option<BlockId>,
        block: StoredBlock,
        tick: u64,
        changes: &mut Vec<Change>,
    ) -> bool {
        let slot = &mut self.slots[id.index()];
        debug_assert_eq!(slot.state, State::Mutable);
        slot.seq = block.seq;
        slot.local = block.local;
        slot.parent = parent;
        slot.last_used = tick;
        if !self.index_slot(id) {
            return false;
        }
        let slot = &mut self.slots[id.index()];
        slot.state = State::Registered;
        slot.refs = 1;
        if !self.orphans.is_empty() {
            slot.children = self.orphans.remove(&block.seq).unwrap_or(0);
        }
        self.mutable -= 1;
        self.registered += 1;
        if let Some(parent) = parent {
            let found = self.add_child(parent, near);
            self.slots[id.index()].parent_slot = found.map_or(NO_SLOT, |p| p.0);
        }
        changes.push(Change::Stored {
            tier: self.tier,
            parent,
            block,
        });
        true
    }

    /// The next block the policy gives up, taken out of the eviction order.
    pub fn pop_victim(&mut self) -> Option<BlockId> {
        self.evictable.pop_first()
    }

    /// Inactive → Free: drops the block from the tier and announces it.
    pub fn evict(&mut self, id: BlockId, changes: &mut Vec<Change>) {
        self.unindex(id, changes);
        self.slots[id.index()] = Slot::empty();
        self.inactive -= 1;
        self.free.push(id);
    }

    /// Inactive → registered by a copy that reads it: the block leaves the tier (index,
    /// lineage, announced as removed) but its slot stays held until
    /// [`Pool::release_detached`].
    pub fn detach(&mut self, id: BlockId, changes: &mut Vec<Change>) {
        self.unindex(id, changes);
        let slot = &mut self.slots[id.index()];
        slot.state = State::Registered;
        slot.refs = 1;
        slot.detached = true;
        self.inactive -= 1;
        self.registered += 1;
        self.detached += 1;
    }

    /// The copy reading a detached slot ended: Registered → Free.
    pub fn release_detached(&mut self, id: BlockId) {
        debug_assert!(self.slots[id.index()].detached);
        self.slots[id.index()] = Slot::empty();
        self.registered -= 1;
        self.detached -= 1;
        self.free.push(id);
    }

    /// Takes an inactive block out of the index and the lineage, and announces its removal.
    fn unindex(&mut self, id: BlockId, changes: &mut Vec<Change>) {
        self.set_evictable(id, false);
        let slot = &mut self.slots[id.index()];
        debug_assert_eq!(slot.state, State::Inactive);
        let near = (slot.parent_slot != NO_SLOT).then_some(BlockId(slot.parent_slot));
        let (seq, parent) = (slot.seq, slot.parent);
        let children = std::mem::take(&mut slot.children);
        self.unindex_slot(id);
        if children > 0 {
            // Its children stay (a policy that is not leaf-only, or a detach): orphans now.
            self.orphans.insert(seq, children);
        }
        if let Some(parent) = parent {
            self.remove_child(parent, near);
        }
        changes.push(Change::Removed {
            tier: self.tier,
            seq,
        });
    }

    /// The children of an indexed block.
    pub fn children(&self, id: BlockId) -> u32 {
        self.slots[id.index()].children
    }

    /// The slot `seq` is indexed in, looked up in the hash index unless `near` is it.
    /// Following a chain by its slots saves the hash index's cache misses: a parent was
    /// usually registered long before its child, and is evicted in another step.
    fn find(&self, seq: SeqHash, near: Option<BlockId>) -> Option<BlockId> {
        near.filter(|id| {
            // Indexed exactly when registered or inactive, and not detached.
            let slot = &self.slots[id.index()];
            slot.seq == seq
                && matches!(slot.state, State::Registered | State::Inactive)
                && !slot.detached
        })
        .or_else(|| self.lookup(seq))
    }

    /// Counts a new child of `parent` (looked for at `near` first), and returns the slot
    /// it is indexed in; its first child can make an indexed parent ineligible for eviction.
    fn add_child(&mut self, parent: SeqHash, near: Option<BlockId>) -> Option<BlockId> {
        let found = self.find(parent, near);
        match found {
            Some(p) => {
                let slot = &mut self.slots[p.index()];
                slot.children += 1;
                if slot.children == 1 {
                    self.refresh(p);
                }
            }
            None => *self.orphans.entry(parent).or_insert(0) += 1,
        }
        found
    }

    /// Uncounts a child of `parent` (looked for at `near` first); its last child can make
    /// an indexed parent eligible.
    fn remove_child(&mut self, parent: SeqHash, near: Option<BlockId>) {
        match self.find(parent, near) {
            Some(p) => {
                let slot = &mut self.slots[p.index()];
                debug_assert!(slot.children > 0, "a child uncounted twice");
                slot.children = slot.children.saturating_sub(1);
                if slot.children == 0 {
                    self.refresh(p);
                }
            }
            None => {
                if let Some(count) = self.orphans.get_mut(&parent) {
                    *count -= 1;
                    if *count == 0 {
                        self.orphans.remove(&parent);
                    }
                }
            }
        }
    }

    /// Puts a slot into, or takes it out of, the eviction order according to its state.
    fn refresh(&mut self, id: BlockId) {
        let slot = &self.slots[id.index()];
        let eligible =
            slot.state == State::Inactive && !(self.policy.leaf_only() && slot.children > 0);
        self.set_evictable(id, eligible);
    }

    fn set_evictable(&mut self, id: BlockId, on: bool) {
        if !on {
            self.evictable.remove(id);
        } else if self.evictable.key(id).is_none() {
            let slot = &self.slots[id.index()];
            let key = self.policy.priority(slot.last_used, slot.hits);
            self.evictable.insert(id, key);
        }
    }

    /// Every structural invariant of the pool, or the first one broken.
    pub fn check(&self) -> Result<(), String> {
        let tier = self.tier;
        let mut by_state = [0usize; 4];
        for slot in &self.slots {
            by_state[slot.state as usize] += 1;
        }
        let u = self.usage();
        if by_state != [u.free, u.mutable, u.registered, u.inactive] {
            return Err(format!(
                "{tier}: counters {u:?} disagree with slot states {by_state:?}"
            ));
        }
        if u.free + u.mutable + u.registered + u.inactive != u.capacity {
            return Err(format!("{tier}: states do not add up to capacity: {u:?}"));
        }
        if self.by_hash.len() + self.detached != u.registered + u.inactive {
            return Err(format!(
                "{tier}: {} hashes indexed, {u:?}",
                self.by_hash.len()
            ));
        }
        let mut children: FxHashMap<SeqHash, u32> = FxHashMap::default();
        for id in self.indexed() {
            let slot = &self.slots[id.index()];
            let seq = &slot.seq;
            if !matches!(slot.state, State::Registered | State::Inactive) || slot.detached {
                return Err(format!("{tier}: index entry {id:?} is {slot:?}"));
            }
            if self.lookup(*seq) != Some(id) {
                return Err(format!("{tier}: {id:?} indexed, but {seq:?} finds another"));
            }
            if (slot.state == State::Registered) != (slot.refs > 0) {
                return Err(format!(
                    "{tier}: {seq:?} state {:?} with {} refs",
                    slot.state, slot.refs
                ));
            }
            if let Some(parent) = slot.parent {
                *children.entry(parent).or_insert(0) += 1;
            }
            let eligible =
                slot.state == State::Inactive && !(self.policy.leaf_only() && slot.children > 0);
            if eligible != self.evictable.key(id).is_some() {
                return Err(format!(
                    "{tier}: {seq:?} evictable={eligible} but key {:?}",
                    self.evictable.key(id)
                ));
            }
        }
        let mut counted = self.orphans.clone();
        for id in self.indexed() {
            let seq = &self.slots[id.index()].seq;
            if counted.contains_key(seq) {
                return Err(format!(
                    "{tier}: {seq:?} is indexed and counted as an orphan"
                ));
            }
            let n = self.slots[id.index()].children;
            if n > 0 {
                counted.insert(*seq, n);
            }
        }
        if children != counted {
            return Err(format!("{tier}: child counts drifted"));
        }
        self.evictable
            .check()
            .map_err(|e| format!("{tier}: eviction order: {e}"))?;
        let eligible = self
            .indexed()
            .filter(|id| self.evictable.key(*id).is_some())
            .count();
        if eligible != self.evictable.len() {
            return Err(format!(
                "{tier}: {eligible} indexed slots in the order, {} in all",
                self.evictable.len()
            ));
        }
        Ok(())
    }
}

/// Where `seq` is looked for in the index: its Fx hash, as the pools' other maps use.
fn hash(seq: SeqHash) -> u64 {
    FxBuildHasher.hash_one(seq)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block_manager::Lru;

    fn block(n: u64) -> StoredBlock {
        StoredBlock {
            seq: SeqHash(n),
            local: LocalHash(n),
        }
    }

    /// A block's hit count stops at its largest value (a hot prefix's did overflow: a panic
    /// in a debug build, and in a release build a wrap to 0 that made it look cold to the
    /// offload rule).
    #[test]
    fn a_hot_block_s_hits_stop_at_the_largest_count() {
        let mut pool = Pool::new(Tier::Device, 1, Box::new(Lru));
        let id = pool.take_free().unwrap();
        pool.slots[id.index()].hits = u32::MAX - 1;
        pool.count_hits(&[id, id]);
        assert_eq!(pool.slots[id.index()].hits, u32::MAX);
    }

    /// A child's remembered parent slot is checked before it is used. The parent A is
    /// evicted, its slot goes to an unrelated block C, and A is registered again in another
    /// slot; evicting the child B then uncounts A where it is now, not C.
    #[test]
    fn a_stale_parent_slot_is_looked_up_again() {
        let (a_seq, b_seq, c_seq) = (1, 2, 3);
        let mut pool = Pool::new(Tier::Device, 4, Box::new(Lru));
        let mut changes = Vec::new();
        let a = pool.take_free().unwrap();
        assert!(pool.register(a, None, None, block(a_seq), 1, &mut changes));
        pool.release(a, 1);
        let b = pool.take_free().unwrap();
        assert!(pool.register(
            b,
            Some(SeqHash(a_seq)),
            Some(a),
            block(b_seq),
            2,
            &mut changes
        ));
        pool.release(b, 2);
        assert_eq!(pool.children(a), 1);

        assert_eq!(pool.pop_victim(), Some(a));
        pool.evict(a, &mut changes);
        let c = pool.take_free().unwrap();
        assert_eq!(c, a, "the freed slot is handed out next");
        assert!(pool.register(c, None, None, block(c_seq), 3, &mut changes));
        let a_again = pool.take_free().unwrap();
        assert!(pool.register(a_again, None, None, block(a_seq), 4, &mut changes));
        assert_eq!(
            pool.children(a_again),
            1,
            "B is counted again once A is back"
        );
        pool.check().unwrap();

        assert_eq!(pool.pop_victim(), Some(b));
        pool.evict(b, &mut changes);
        assert_eq!(pool.children(a_again), 0);
        assert_eq!(pool.children(c), 0);
        pool.check().unwrap();
    }

    /// An evicted block's entry is taken out where it is, though the index grew (moving
    /// every entry) after most blocks remembered their buckets.
    #[test]
    fn entries_moved_by_a_rehash_are_still_taken_out() {
        let n = 1000;
        let mut pool = Pool::new(Tier::Device, n, Box::new(Lru));
        let mut changes = Vec::new();
        for i in 0..n as u64 {
            let id = pool.take_free().unwrap();
            assert!(pool.register(id, None, None, block(i + 1), i, &mut changes));
            pool.release(id, i);
        }
        let moved = (0..n as u32)
            .filter(|&i| {
                pool.by_hash
                    .get_bucket(pool.slots[i as usize].bucket as usize)
                    != Some(&i)
            })
            .count();
        assert!(moved > 0, "the index never grew");
        while let Some(victim) = pool.pop_victim() {
            let seq = pool.slot(victim).seq;
            assert_eq!(pool.lookup(seq), Some(victim));
            pool.evict(victim, &mut changes);
            assert_eq!(pool.lookup(seq), None);
        }
        assert_eq!(pool.by_hash.len(), 0);
        pool.check().unwrap();
    }
}
