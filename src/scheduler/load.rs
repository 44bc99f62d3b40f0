//! Active load of one worker: what the router has sent it and not yet seen finish.

use crate::protocol::SeqHash;

/// Prefill still to compute and blocks held, by the router's bookkeeping.
#[derive(Debug, Default, Clone)]
pub struct ActiveLoad {
    /// Uncached prompt blocks of requests that have not produced a first token.
    pub prefill_blocks: f64,
    /// Requests booked and not completed.
    pub requests: usize,
    /// Of those, requests whose prefill is not known to be done: the engine queues them or
    /// computes their prompts.
    pub prefill_requests: usize,
    /// Full prompt blocks held by booked requests, refcounted: blocks shared by requests on
    /// the same worker count once.
    shared: BlockCounts,
    /// Partial tail blocks, one per request that has one (never shared).
    private_blocks: usize,
    /// Booked work, tokens: uncached prefill not yet computed plus the expected decode of
    /// every booked request (what admission weighs against the worker's budget).
    pub work_tokens: f64,
}

impl ActiveLoad {
    /// Blocks the worker's running requests hold (distinct full blocks plus tails).
    pub fn decode_blocks(&self) -> usize {
        self.shared.len + self.private_blocks
    }

    /// Whether a booked request holds (or is computing) this block.
    pub fn holds(&self, block: SeqHash) -> bool {
        self.shared.contains(block)
    }

    /// Books a request: its uncached prefill, the blocks it will hold and its work;
    /// `prefill_open` unless its first token was seen already (a worker added back).
    pub fn book(
        &mut self,
        prefill_blocks: f64,
        blocks: &[SeqHash],
        tail: bool,
        work: Work,
        prefill_open: bool,
    ) {
        self.prefill_blocks += prefill_blocks;
        self.work_tokens += work.prefill_tokens + work.decode_tokens as f64;
        self.requests += 1;
        self.prefill_requests += usize::from(prefill_open);
        self.shared.add(blocks);
        self.private_blocks += usize::from(tail);
    }

    /// The request produced its first token: its prefill is done.
    pub fn prefill_done(&mut self, prefill_blocks: f64, work: Work) {
        self.prefill_blocks = (self.prefill_blocks - prefill_blocks).max(0.0);
        self.work_tokens = (self.work_tokens - work.prefill_tokens).max(0.0);
        self.prefill_requests = self.prefill_requests.saturating_sub(1);
        if self.requests == 0 || self.prefill_blocks < 1e-9 {
            self.prefill_blocks = 0.0;
        }
    }

    /// The request finished: its blocks and its expected decode are released.
    pub fn release(&mut self, blocks: &[SeqHash], tail: bool, work: Work) {
        self.requests = self.requests.saturating_sub(1);
        self.work_tokens = (self.work_tokens - work.decode_tokens as f64).max(0.0);
        self.shared.remove(blocks);
        self.private_blocks = self.private_blocks.saturating_sub(usize::from(tail));
        if self.requests == 0 {
            self.prefill_blocks = 0.0;
            self.prefill_requests = 0;
            self.work_tokens = 0.0;
        }
    }
}

/// The work one request brings a worker, tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Work {
    /// Prompt tokens the worker must compute (not cached there).
    pub prefill_tokens: f64,
    /// Tokens it is expected to generate (its `max_tokens`, capped by
    /// `admission.decode_cap_tokens`).
    pub decode_tokens: u64,
}

impl Work {
    /// Both parts, tokens.
    pub fn total(self) -> f64 {
        self.prefill_tokens + self.decode_tokens as f64
    }
}

/// Blocks, each with how many booked requests hold it: an open-addressing table (linear
/// probing, deletion by backward shift, at most half full).
///
/// Booking and releasing a request touch every one of its blocks, each at a random slot, and
/// a `HashMap` paid one whole cache miss per block in turn (in a profile of the replay's kv
/// policy, 90 % of `release`'s samples sat on the key compare after the probe's load). Here
/// each group of [`GROUP`] blocks first loads its home slots back to back, so that their
/// misses are under way together, then updates them. A slot is 16 bytes, as a `HashMap`
/// entry was, and the table shrinks when the load falls (see [`BlockCounts::resize_for`]).
#[derive(Clone, Default)]
struct BlockCounts {
    /// A power of two of slots, or none before the first booking.
    slots: Box<[Slot]>,
    /// Slots in use (distinct blocks).
    len: usize,
}

/// A block and its holders; `count == 0` is an empty slot. The count is 64 bits (the slot
/// is 16 bytes either way): peers' bookings may name a block any number of times, and a
/// 32-bit count could wrap to the empty mark.
#[derive(Clone, Copy, Default)]
struct Slot {
    seq: u64,
    count: u64,
}

/// Blocks whose home slots are loaded together before any is read.
const GROUP: usize = 16;

/// The smallest table, slots.
const MIN_SLOTS: usize = 64;

impl std::fmt::Debug for BlockCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockCounts")
            .field("len", &self.len)
            .field("slots", &self.slots.len())
            .finish()
    }
}

impl BlockCounts {
    /// Where `seq`'s probe starts: the top bits of its hash keyed per process (the index's,
    /// [`crate::indexer::home_of_key`]), so that any keys spread, and keys chosen to share a
    /// home (a peer's booking is input from the network: blocks `i * 0x9e37_79b9_7f4a_7c15^-1`
    /// all met at slot 0 of the unkeyed Fibonacci multiply this used, making each probe walk
    /// the whole run) cannot be made without the key.
    fn home(&self, seq: u64) -> usize {
        let bits = self.slots.len().trailing_zeros();
        (crate::indexer::home_of_key(seq) >> (64 - bits)) as usize
    }

    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    fn contains(&self, block: SeqHash) -> bool {
        self.find(block.0).is_some()
    }

    /// The slot holding `seq`.
    fn find(&self, seq: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mut i = self.home(seq);
        loop {
            let slot = self.slots[i];
            if slot.count == 0 {
                return None;
            }
            if slot.seq == seq {
                return Some(i);
            }
            i = (i + 1) & self.mask();
        }
    }

    /// Loads the home slots of a group of blocks, so that their cache misses overlap.
    fn touch(&self, group: &[SeqHash]) {
        let mut touched = 0u64;
        for b in group {
            touched ^= self.slots[self.home(b.0)].seq;
        }
        std::hint::black_box(touched);
    }

    /// One more holder for each of `blocks`.
    fn add(&mut self, blocks: &[SeqHash]) {
        self.resize_for(self.len + blocks.len());
        for group in blocks.chunks(GROUP) {
            self.touch(group);
            for b in group {
                self.increment(b.0);
            }
        }
    }

    fn increment(&mut self, seq: u64) {
        let mask = self.mask();
        let mut i = self.home(seq);
        loop {
            let slot = &mut self.slots[i];
            if slot.count == 0 {
                *slot = Slot { seq, count: 1 };
                self.len += 1;
                return;
            }
            if slot.seq == seq {
                slot.count += 1;
                return;
            }
            i = (i + 1) & mask;
        }
    }

    /// One holder fewer for each of `blocks` (a block not held is skipped); a block left
    /// with none is removed.
    fn remove(&mut self, blocks: &[SeqHash]) {
        if self.slots.is_empty() {
            return;
        }
        for group in blocks.chunks(GROUP) {
            self.touch(group);
            for b in group {
                if let Some(i) = self.find(b.0) {
                    self.slots[i].count -= 1;
                    if self.slots[i].count == 0 {
                        self.vacate(i);
                    }
                }
            }
        }
        self.resize_for(self.len);
    }

    /// Empties slot `hole`, moving back each later slot of its run that can take it (its
    /// probe from home passes the hole), so that no probe stops short of its block.
    fn vacate(&mut self, mut hole: usize) {
        let mask = self.mask();
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let slot = self.slots[j];
            if slot.count == 0 {
                break;
            }
            let from_home = j.wrapping_sub(self.home(slot.seq)) & mask;
            if from_home >= (j.wrapping_sub(hole) & mask) {
                self.slots[hole] = slot;
                hole = j;
            }
        }
        self.slots[hole] = Slot::default();
        self.len -= 1;
    }

    /// Grows the table so that `len` blocks fill at most half of it, or shrinks it when
    /// they fill less than an eighth (to a quarter): memory follows the load both ways.
    fn resize_for(&mut self, len: usize) {
        let slots = self.slots.len();
        let grow = len * 2 > slots;
        let shrink = slots > MIN_SLOTS && len * 8 < slots;
        if !(grow || shrink) {
            return;
        }
        let size = (len * 4).next_power_of_two().max(MIN_SLOTS);
        let old = std::mem::replace(&mut self.slots, vec![Slot::default(); size].into());
        self.len = 0;
        for slot in old.iter().filter(|s| s.count > 0) {
            let mut i = self.home(slot.seq);
            while self.slots[i].count != 0 {
                i = (i + 1) & self.mask();
            }
            self.slots[i] = *slot;
            self.len += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    /// Keys a peer could choose so that every one starts its probe at the same slot of an
    /// unkeyed Fibonacci hash (`i` times the multiplier's inverse: the multiply gives `i`,
    /// whose top bits are 0) spread under the keyed one: no probe walks far from its home.
    #[test]
    fn keys_chosen_to_collide_still_spread() {
        const A: u64 = 0x9e37_79b9_7f4a_7c15;
        // Newton's iteration for the inverse mod 2^64 (each step doubles the bits).
        let mut inverse = A;
        for _ in 0..6 {
            inverse = inverse.wrapping_mul(2u64.wrapping_sub(A.wrapping_mul(inverse)));
        }
        assert_eq!(A.wrapping_mul(inverse), 1);
        let blocks: Vec<SeqHash> = (1..=4096u64)
            .map(|i| SeqHash(i.wrapping_mul(inverse)))
            .collect();
        let mut table = BlockCounts::default();
        table.add(&blocks);
        let mask = table.mask();
        let farthest = blocks
            .iter()
            .map(|b| {
                let at = table.find(b.0).expect("added");
                at.wrapping_sub(table.home(b.0)) & mask
            })
            .max()
            .unwrap();
        assert!(
            farthest < 64,
            "a probe walked {farthest} slots from its home"
        );
    }

    proptest! {
        /// The table agrees with a `HashMap` of counts through any bookings and releases,
        /// growing and shrinking: keys from a small range so that runs collide and
        /// deletions shift, or spread ones.
        #[test]
        fn counts_match_a_map(
            ops in prop::collection::vec(
                (any::<bool>(), prop::collection::vec(0u64..400, 0..80), any::<bool>()),
                1..200,
            ),
        ) {
            let mut table = BlockCounts::default();
            let mut model: HashMap<u64, u64> = HashMap::new();
            let mut booked: Vec<Vec<SeqHash>> = Vec::new();
            for (book, keys, spread) in ops {
                if book || booked.is_empty() {
                    let blocks: Vec<SeqHash> = keys
                        .iter()
                        .map(|&k| SeqHash(if spread { k.wrapping_mul(0x2545_f491_4f6c_dd1d) } else { k }))
                        .collect();
                    table.add(&blocks);
                    for b in &blocks {
                        *model.entry(b.0).or_default() += 1;
                    }
                    booked.push(blocks);
                } else {
                    let blocks = booked.swap_remove(keys.len() % booked.len());
                    table.remove(&blocks);
                    for b in &blocks {
                        let n = model.get_mut(&b.0).expect("booked");
                        *n -= 1;
                        if *n == 0 {
                            model.remove(&b.0);
                        }
                    }
                }
                prop_assert_eq!(table.len, model.len());
                prop_assert!(table.len * 2 <= table.slots.len().max(1));
                for k in 0..400u64 {
                    for key in [k, k.wrapping_mul(0x2545_f491_4f6c_dd1d)] {
                        let held = table.find(key).map(|i| table.slots[i].count);
                        prop_assert_eq!(held, model.get(&key).copied());
                    }
                }
            }
            for blocks in booked.drain(..) {
                table.remove(&blocks);
            }
            prop_assert_eq!(table.len, 0);
            prop_assert!(table.slots.len() <= MIN_SLOTS);
        }
    }
}
