//! What an engine without KV events probably caches, learnt from the router's own decisions:
//! a prompt sent there leaves its blocks in the engine's prefix cache, for a while. Each
//! routed prompt's blocks are taken as stored on the device until `ttl_ms` after they were
//! last routed, and at most `capacity` blocks are kept (the oldest go first). The approximate
//! mode other routers use for engines that publish nothing. No I/O: time is an argument.

use std::cmp::Reverse;
use std::collections::BTreeSet;

use rustc_hash::FxHashMap;

use crate::protocol::{BlockChange, BlockHash, SeqHash, StoredBlock, Tier};

/// An engine's likely cache.
#[derive(Debug)]
pub struct ApproxCache {
    ttl_ms: u64,
    capacity: usize,
    /// Block → when it lapses, and its depth in its prompt.
    blocks: FxHashMap<SeqHash, (u64, u32)>,
    /// (when it lapses, depth, block), soonest first, and of those lapsing together the
    /// deepest first: a block routed is routed with its parent, so a parent never lapses
    /// before its children, and the cache stays a set of prefixes (a root gone first left
    /// its descendants held, matching nothing).
    by_expiry: BTreeSet<(u64, Reverse<u32>, SeqHash)>,
}

impl ApproxCache {
    /// Blocks lapse `ttl_ms` after they were last routed; at most `capacity` are kept.
    pub fn new(ttl_ms: u64, capacity: usize) -> Self {
        ApproxCache {
            ttl_ms,
            capacity: capacity.max(1),
            blocks: FxHashMap::default(),
            by_expiry: BTreeSet::new(),
        }
    }

    /// The engine's cache holds `capacity` blocks (learnt late, or changed): the oldest
    /// past it go at the next [`ApproxCache::learn`].
    pub fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity.max(1);
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// A prompt with these blocks (a chain from the root) was routed to the engine at
    /// `now_ms`; appends what is newly held and what had to go.
    pub fn learn(&mut self, now_ms: u64, prompt: &[BlockHash], out: &mut Vec<BlockChange>) {
        self.expire(now_ms, out);
        let until = now_ms.saturating_add(self.ttl_ms);
        let mut parent = None;
        for (depth, b) in prompt.iter().enumerate() {
            let depth = u32::try_from(depth).unwrap_or(u32::MAX);
            match self.blocks.insert(b.seq, (until, depth)) {
                Some((old, old_depth)) => {
                    self.by_expiry.remove(&(old, Reverse(old_depth), b.seq));
                }
                None => out.push(BlockChange::Stored {
                    tier: Tier::Device,
                    parent,
                    block: StoredBlock {
                        seq: b.seq,
                        local: b.local,
                    },
                }),
            }
            self.by_expiry.insert((until, Reverse(depth), b.seq));
            parent = Some(b.seq);
        }
        while self.blocks.len() > self.capacity {
            self.pop_soonest(out);
        }
    }

    /// Lets go of every block whose time is up at `now_ms`.
    pub fn expire(&mut self, now_ms: u64, out: &mut Vec<BlockChange>) {
        while self
            .by_expiry
            .first()
            .is_some_and(|(until, ..)| *until <= now_ms)
        {
            self.pop_soonest(out);
        }
    }

    fn pop_soonest(&mut self, out: &mut Vec<BlockChange>) {
        if let Some((.., seq)) = self.by_expiry.pop_first() {
            self.blocks.remove(&seq);
            out.push(BlockChange::Removed {
                tier: Tier::Device,
                seq,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroUsize;

    use super::*;
    use crate::protocol::{Salt, hash_blocks};

    fn prompt(n: u32, start: u32) -> Vec<BlockHash> {
        let tokens: Vec<u32> = (start..start + n * 4).collect();
        hash_blocks(&tokens, NonZeroUsize::new(4).unwrap(), Salt::NONE)
    }

    fn stored(out: &[BlockChange]) -> usize {
        out.iter()
            .filter(|c| matches!(c, BlockChange::Stored { .. }))
            .count()
    }

    #[test]
    fn routed_blocks_are_held_until_their_ttl_and_refreshed_by_reuse() {
        let mut c = ApproxCache::new(1_000, 100);
        let p = prompt(3, 0);
        let mut out = Vec::new();
        c.learn(0, &p, &mut out);
        assert_eq!(stored(&out), 3);
        assert!(matches!(out[1], BlockChange::Stored { parent: Some(s), .. } if s == p[0].seq));
        out.clear();
        // Routed again at 800: nothing new, and it lasts until 1,800.
        c.learn(800, &p[..2], &mut out);
        assert!(out.is_empty());
        c.expire(1_000, &mut out);
        assert_eq!(
            out,
            vec![BlockChange::Removed {
                tier: Tier::Device,
                seq: p[2].seq
            }]
        );
        out.clear();
        c.expire(1_800, &mut out);
        assert_eq!(out.len(), 2);
        assert!(c.is_empty());
    }

    #[test]
    fn capacity_lets_the_oldest_go() {
        let mut c = ApproxCache::new(u64::MAX / 2, 4);
        let mut out = Vec::new();
        c.learn(0, &prompt(3, 0), &mut out);
        c.learn(1, &prompt(3, 1_000), &mut out);
        assert_eq!(c.len(), 4);
        let removed = out
            .iter()
            .filter(|c| matches!(c, BlockChange::Removed { .. }))
            .count();
        assert_eq!((stored(&out), removed), (6, 2));
        // The engine turns out smaller (its G1 scraped after the first prompts): the
        // oldest past it go with the next prompt.
        c.set_capacity(2);
        c.learn(2, &prompt(1, 2_000), &mut out);
        assert_eq!(c.len(), 2);
    }

    /// Blocks routed together go deepest first, so every block held has its parent held:
    /// popped by hash, a prompt's root could go while its descendants stayed, matching
    /// nothing and taking room. Control: with room for everything, nothing goes.
    #[test]
    fn the_cache_stays_a_set_of_prefixes() {
        for capacity in [4, 5, 7, 1_000] {
            let mut c = ApproxCache::new(u64::MAX / 2, capacity);
            let mut parents = FxHashMap::default();
            let mut out = Vec::new();
            for i in 0..20u32 {
                let p = prompt(3 + i % 3, 1_000 * (i % 4));
                for (j, b) in p.iter().enumerate() {
                    parents.insert(b.seq, j.checked_sub(1).map(|k| p[k].seq));
                }
                c.learn(u64::from(i / 2), &p, &mut out);
                for seq in c.blocks.keys() {
                    if let Some(parent) = parents[seq] {
                        assert!(
                            c.blocks.contains_key(&parent),
                            "capacity {capacity}: orphan"
                        );
                    }
                }
            }
            let removed = out.iter().any(|c| matches!(c, BlockChange::Removed { .. }));
            assert_eq!(removed, capacity < 20, "capacity {capacity}");
        }
    }
}
