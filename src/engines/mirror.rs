//! One engine's cache as its events describe it, in kvroute's terms: turns decoded engine
//! batches into [`BlockChange`]s with kvroute's own hashes (computed from the events' token
//! ids, as the router hashes prompts), and keeps the engine's hash → kvroute's map that
//! removals and token-less stores need. Also the seq check that finds lost and repeated
//! batches. No I/O.

use std::collections::VecDeque;
use std::num::NonZeroUsize;

use rustc_hash::{FxHashMap, FxHashSet};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::wire::{EngineBatch, EngineEvent, EngineHash, ExtraKey, MAX_GROUP, Stored};
use crate::protocol::{
    BlockChange, HASH_SEED, LocalHash, Salt, SeqHash, StoredBlock, Tier, local_hash, seq_hash,
};

/// Blocks whose every tier has gone are remembered this long (in blocks) so that a later
/// token-less store of the same block (an offload tier reporting its copy after the GPU
/// evicted it) still resolves.
const GHOSTS: usize = 1 << 16;

/// Most blocks one mirror holds by default ([`EngineMirror::with_max_blocks`]). A mirror
/// entry costs about 100 B with its map's share, so this is under 1 GiB per engine rank, and
/// above what engines hold: an H200's 140 GB in blocks of 16 tokens of a 0.5 B-parameter
/// model (12 KiB a token) is about 700 k blocks, and a CPU offload tier of 1 TiB about 5.6 M.
pub const DEFAULT_MAX_BLOCKS: usize = 8 << 20;

/// How SGLang tags a request's cache salt among an event's extra keys (the prefix is
/// NVIDIA Dynamo's, whose router strips it; SGLang's `CACHE_SALT_EXTRA_KEY_PREFIX`).
pub const TAGGED_SALT: &str = "dynamo-cache-salt:";

/// The salt of a sequence computed with a LoRA adapter and a cache salt: how the router
/// hashes a request for adapter `lora` with `cache_salt`, and how a mirror hashes an engine's
/// blocks carrying them. No adapter and no salt is [`Salt::NONE`].
pub fn engine_salt(lora: Option<&str>, cache_salt: Option<&str>) -> Salt {
    if lora.is_none() && cache_salt.is_none() {
        return Salt::NONE;
    }
    let mut bytes = Vec::new();
    for part in [lora, cache_salt] {
        let part = part.unwrap_or("");
        bytes.extend_from_slice(&(part.len() as u64).to_le_bytes());
        bytes.extend_from_slice(part.as_bytes());
    }
    // Never zero: zero means no salt.
    Salt(xxh3_64_with_seed(&bytes, HASH_SEED).max(1))
}

/// Whether a KV-cache group holds the whole prefix (full attention, in any of its forms):
/// only such groups may count as prefix residency. A sliding-window or linear-attention
/// group keeps a suffix, and a request cannot reuse a prefix from it alone.
fn full_prefix(kind: &str) -> bool {
    matches!(
        kind,
        "full_attention" | "mla_attention" | "sink_full_attention"
    )
}

/// What a mirror skipped or could not resolve, by cause.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MirrorStats {
    /// Batches applied.
    pub batches: u64,
    /// Blocks stored (in any tier).
    pub stored: u64,
    /// Blocks removed (from any tier).
    pub removed: u64,
    /// Stores whose `block_size` differs from the configured one: not indexed.
    pub block_size_mismatch: u64,
    /// Stores whose token count is not `block_size` per block: not indexed.
    pub malformed: u64,
    /// Blocks whose parent the mirror does not know (stored before it started, or lost):
    /// their kvroute hash cannot be computed, so they are not indexed.
    pub orphans: u64,
    /// Blocks not indexed because the engine names a block by its tokens alone, not its
    /// position (SGLang before its position-aware SHA-256 block hashes:
    /// `hash(tuple(page_tokens))`), so one hash is several blocks: seen when a known hash
    /// comes under another parent; that chain's blocks from there on, and every block
    /// stored after, until the engine restarts.
    pub ambiguous: u64,
    /// Token-less stores and removals of blocks the mirror does not know.
    pub unresolved: u64,
    /// Events of groups that do not hold the whole prefix (sliding window, Mamba).
    pub other_groups: u64,
    /// Blocks of a LoRA adapter named by number only (vLLM before `lora_name`): the router
    /// salts an adapter's blocks with its name, so they are not indexed (as base-model
    /// blocks they would be false hits).
    pub unnamed_lora: u64,
    /// Events of a kind kvroute does not know: skipped.
    pub unknown_events: u64,
    /// Events that did not decode. A store's is skipped; any other's drops every block the
    /// mirror held (what it removed cannot be told).
    pub malformed_events: u64,
    /// Blocks not held because the mirror was full ([`EngineMirror::with_max_blocks`]): an
    /// engine that stores without end, or whose removals are lost, is not followed past
    /// it. They are not indexed; their removals count as `unresolved`.
    pub capped: u64,
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    block: StoredBlock,
    parent: Option<SeqHash>,
    /// The engine's hash of the block before it (to find a chunk's blocks from its last).
    engine_parent: Option<EngineHash>,
    /// Stores minus removes per tier (an engine may store a block twice).
    refs: [u32; 4],
}

fn tier_index(t: Tier) -> usize {
    t as usize
}

const TIERS: [Tier; 4] = Tier::ALL;

/// One engine (one data-parallel rank) as its events describe it.
#[derive(Debug)]
pub struct EngineMirror {
    block_size: NonZeroUsize,
    blocks: FxHashMap<EngineHash, Entry>,
    /// Most entries in `blocks`, and most chunks in `chunks`.
    max_blocks: usize,
    /// Released entries, oldest first, kept for token-less stores (bounded by [`GHOSTS`]).
    ghosts: FxHashMap<EngineHash, Entry>,
    ghost_order: VecDeque<EngineHash>,
    /// Per group index, whether it holds the whole prefix (learned from stores' kinds).
    groups: [Option<bool>; MAX_GROUP as usize + 1],
    /// Bit g: a store of group g was counted (its removals count from then on).
    storing_groups: u64,
    stats: MirrorStats,
    /// The last block size an engine sent that differs from the configured one.
    wrong_block_size: Option<u32>,
    /// The engine was seen to name a block by its tokens alone (a known hash under another
    /// parent): nothing of it is indexed until it restarts ([`EngineMirror::engine_restarted`]).
    ambiguous_hashing: bool,
    /// GPU blocks per chunk of the engine's host tier ([`EngineMirror::with_offload_chunk`]).
    offload_chunk: usize,
    /// Per host-tier chunk held (keyed by the hash that names it): its blocks, and how
    /// many stores of it are held.
    chunks: FxHashMap<EngineHash, (Vec<EngineHash>, u32)>,
    /// While the mirror is rebuilt from the engine's whole history
    /// ([`EngineMirror::begin_rebuild`]): what it held before, by (block, tier), less what
    /// has been stored again since. Their owner still holds them.
    rebuilding: Option<FxHashSet<(SeqHash, Tier)>>,
}

impl EngineMirror {
    /// An empty mirror of an engine whose blocks hold `block_size` tokens.
    pub fn new(block_size: NonZeroUsize) -> Self {
        EngineMirror {
            block_size,
            blocks: FxHashMap::default(),
            max_blocks: DEFAULT_MAX_BLOCKS,
            ghosts: FxHashMap::default(),
            ghost_order: VecDeque::new(),
            groups: [None; MAX_GROUP as usize + 1],
            storing_groups: 0,
            stats: MirrorStats::default(),
            wrong_block_size: None,
            ambiguous_hashing: false,
            offload_chunk: 1,
            chunks: FxHashMap::default(),
            rebuilding: None,
        }
    }

    /// An engine whose host tier (CPU offload) copies chunks of `blocks` GPU blocks and names
    /// each, in its token-less events, by the hash of the chunk's last block only (vLLM's CPU
    /// offload with `kv_connector_extra_config` `block_size` or `blocks_per_chunk`, without
    /// `self_describing_kv_events`: `_placeholder_stored` in vLLM 0.33.0's
    /// `distributed/kv_transfer/kv_connector/v1/offloading/events.py`). Such a store holds
    /// the named block and the `blocks - 1` before it in that tier, and its removal lets
    /// them all go. vLLM loads a chunk only for a request that reaches its last block, so
    /// a request that matches part of a chunk is credited up to `blocks - 1` blocks the
    /// engine would compute.
    pub fn with_offload_chunk(mut self, blocks: NonZeroUsize) -> Self {
        self.offload_chunk = blocks.get();
        self
    }

    /// Holds at most `blocks` blocks (default [`DEFAULT_MAX_BLOCKS`]): a store of a block
    /// the mirror does not hold, while it holds that many, is refused and counted in
    /// [`MirrorStats::capped`], and so is a host chunk past as many chunks. What the
    /// mirror hands out stays exact for what it holds (a refused block is never announced,
    /// its children are orphans), and its memory stays bounded whatever the engine sends.
    pub fn with_max_blocks(mut self, blocks: NonZeroUsize) -> Self {
        self.max_blocks = blocks.get();
        self
    }

    /// Counters so far.
    pub fn stats(&self) -> MirrorStats {
        self.stats
    }

    /// The block size the engine used where it differed from the configured one.
    pub fn wrong_block_size(&self) -> Option<u32> {
        self.wrong_block_size
    }

    /// Blocks held in at least one tier.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether no block is held.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Applies one batch, appending what changed.
    pub fn apply(&mut self, batch: &EngineBatch, out: &mut Vec<BlockChange>) {
        self.stats.batches += 1;
        for event in &batch.events {
            match event {
                EngineEvent::Stored(s) => self.stored(s, out),
                EngineEvent::Removed {
                    hashes,
                    medium,
                    group,
                } => {
                    // A group the mirror has seen store nothing holds none of its blocks:
                    // vLLM names a block by the same hash in each group (a sliding-window
                    // group's removal, met before any of its stores, is not the
                    // full-attention group's).
                    if group.is_some_and(|g| {
                        self.groups[g as usize] == Some(false)
                            || self.storing_groups & (1 << g) == 0
                    }) {
                        self.stats.other_groups += hashes.len() as u64;
                        continue;
                    }
                    for h in hashes {
                        self.release_named(*h, medium.tier(), out);
                    }
                }
                // Every tier, not only the GPU's. SGLang's `HiRadixCache.reset` empties its
                // host pool too before the one `AllBlocksCleared` (python/sglang/srt/
                // mem_cache/hiradix_cache.py); vLLM emits it from the GPU pool's
                // `reset_prefix_cache` (vllm/v1/core/block_pool.py), and with
                // `reset_connector` clears its CPU tier as well without an event of its
                // own. The event cannot say which: forgetting host blocks that survived
                // costs some reuse until they are stored again, routing to blocks that are
                // gone costs every request that trusts them.
                EngineEvent::Cleared => self.clear(out),
                EngineEvent::Other(_) => self.stats.unknown_events += 1,
                EngineEvent::Malformed { tag, .. } => {
                    self.stats.malformed_events += 1;
                    // A store lost costs the reuse of its blocks (and of their children,
                    // orphans until stored again). Any other event might have removed
                    // blocks, which the index must not go on offering: everything goes.
                    if tag.as_deref() != Some("BlockStored") {
                        self.clear(out);
                    }
                }
            }
        }
    }

    /// Everything held is gone (the engine cleared its cache, restarted, or events were lost
    /// with no way to replay them).
    pub fn clear(&mut self, out: &mut Vec<BlockChange>) {
        self.end_rebuild(out);
        for (_, e) in self.blocks.drain() {
            for (i, tier) in TIERS.iter().enumerate() {
                if e.refs[i] > 0 {
                    self.stats.removed += 1;
                    out.push(BlockChange::Removed {
                        tier: *tier,
                        seq: e.block.seq,
                    });
                }
            }
        }
        self.ghosts.clear();
        self.ghost_order.clear();
        self.chunks.clear();
        // An engine that held millions of blocks left as many slots of empty capacity
        // (hundreds of MB a rank at the cap): given back, grown again as blocks come.
        self.blocks.shrink_to(0);
        self.ghosts.shrink_to(0);
        self.ghost_order.shrink_to(0);
        self.chunks.shrink_to(0);
    }

    /// The engine process restarted (it may have been upgraded): its hashes are judged
    /// afresh. The caller clears the mirror too.
    pub fn engine_restarted(&mut self) {
        self.ambiguous_hashing = false;
    }

    /// Whether the engine names blocks by their tokens alone, so that nothing of it is
    /// indexed (see [`MirrorStats::ambiguous`]).
    pub fn ambiguous_hashing(&self) -> bool {
        self.ambiguous_hashing
    }

    /// Starts over from the engine's whole history (its replay from the first batch it
    /// sent), without telling the owner: what is held now is set aside, a block stored
    /// again is not handed out a second time, and [`EngineMirror::end_rebuild`] hands out
    /// the removal of what was not. A reconnect's replay thus hands out only what changed
    /// while the mirror was away, not every block removed and then stored again (which left
    /// routers without the engine's blocks in between, for many updates on a large cache).
    pub fn begin_rebuild(&mut self) {
        let held = self.rebuilding.get_or_insert_with(FxHashSet::default);
        for (_, e) in self.blocks.drain() {
            for (i, tier) in TIERS.iter().enumerate() {
                if e.refs[i] > 0 {
                    held.insert((e.block.seq, *tier));
                }
            }
        }
        self.ghosts.clear();
        self.ghost_order.clear();
        self.chunks.clear();
    }

    /// Ends a rebuild: what was held before it and not stored again is gone.
    pub fn end_rebuild(&mut self, out: &mut Vec<BlockChange>) {
        for (seq, tier) in self.rebuilding.take().into_iter().flatten() {
            self.stats.removed += 1;
            out.push(BlockChange::Removed { tier, seq });
        }
    }

    fn stored(&mut self, s: &Stored, out: &mut Vec<BlockChange>) {
        let n = s.hashes.len() as u64;
        if let Some(kind) = &s.spec_kind {
            let full = full_prefix(kind);
            if let Some(g) = s.group {
                self.groups[g as usize] = Some(full);
            }
            if !full {
                self.stats.other_groups += n;
                return;
            }
        } else if s
            .group
            .is_some_and(|g| self.groups[g as usize] == Some(false))
        {
            self.stats.other_groups += n;
            return;
        }
        if let Some(g) = s.group {
            self.storing_groups |= 1 << g;
        }
        if s.lora_id.is_some() && s.lora_name.is_none() {
            self.stats.unnamed_lora += n;
            return;
        }
        if self.ambiguous_hashing {
            self.stats.ambiguous += n;
            return;
        }
        let tier = s.medium.tier();
        if s.token_ids.is_empty() {
            // An offload tier's copy of blocks the engine named before.
            for h in &s.hashes {
                if self.offload_chunk > 1 && tier == Tier::Host {
                    self.hold_chunk(*h, out);
                    continue;
                }
                match self.lookup(*h) {
                    Some(e) => {
                        self.hold(*h, e, tier, out);
                    }
                    None => self.stats.unresolved += 1,
                }
            }
            return;
        }
        let bs = self.block_size.get();
        if s.block_size as usize != bs {
            self.stats.block_size_mismatch += n;
            self.wrong_block_size = Some(s.block_size);
            return;
        }
        if s.token_ids.len() != s.hashes.len() * bs {
            self.stats.malformed += n;
            return;
        }
        // The parent's kvroute hash; unknown (stored before the mirror started, or lost) only
        // matters for a block the mirror does not know by its engine hash either.
        let mut parent: Option<Option<SeqHash>> = match s.parent {
            None => Some(None),
            Some(p) => self.lookup(p).map(|e| Some(e.block.seq)),
        };
        let lora = s.lora_name.as_deref();
        for (i, (h, tokens)) in s
            .hashes
            .iter()
            .zip(s.token_ids.chunks_exact(bs))
            .enumerate()
        {
            if let Some(known) = self.lookup(*h) {
                // A known hash (held or remembered) under another parent (both known)
                // names another block of the same tokens: the engine's hashes are no
                // positions, so none of them can be trusted, as a block's or as a parent's
                // (taken for the known one, it credited this chain's later blocks, and
                // later stores under it, under the known block's prefix: an overcount).
                // Nothing of the engine is indexed from here: an undercount, which routing
                // survives.
                if parent.is_some_and(|up| up != known.parent) {
                    self.stats.ambiguous += (s.hashes.len() - i) as u64;
                    self.clear(out);
                    self.ambiguous_hashing = true;
                    return;
                }
                // Named before (another tier, or stored twice): the same block.
                let held = self.hold(*h, known, tier, out);
                parent = held.then_some(Some(known.block.seq));
                continue;
            }
            let Some(up) = parent else {
                self.stats.orphans += 1;
                continue;
            };
            let keys = s.extra_keys.get(i).map(Vec::as_slice).unwrap_or(&[]);
            let mut local = local_hash(tokens);
            let mut cache_salt = s.cache_salt.as_deref();
            for key in keys {
                match key {
                    // The adapter's name is in the salt already.
                    ExtraKey::Str(k) if Some(k.as_str()) == lora => {}
                    // SGLang tags the request's cache salt (`dynamo-cache-salt:` + salt,
                    // `CACHE_SALT_EXTRA_KEY_PREFIX` in sglang/srt/disaggregation/kv_events.py)
                    // as the first key of every event of a salted request: it salts a chain
                    // at its root, and after that it is in the parent's hash already.
                    ExtraKey::Str(k) if k.starts_with(TAGGED_SALT) => {
                        let salt = &k[TAGGED_SALT.len()..];
                        if up.is_none() && cache_salt.is_none() && !salt.is_empty() {
                            cache_salt = Some(salt);
                        }
                    }
                    // vLLM puts the request's cache salt on the first block's keys.
                    ExtraKey::Str(k) if up.is_none() && cache_salt.is_none() => {
                        cache_salt = Some(k);
                    }
                    other => local = mix(local, other),
                }
            }
            let salt = engine_salt(lora, cache_salt);
            let seq = seq_hash(up, local, salt);
            let entry = Entry {
                block: StoredBlock { seq, local },
                parent: up,
                engine_parent: if i == 0 {
                    s.parent
                } else {
                    Some(s.hashes[i - 1])
                },
                refs: [0; 4],
            };
            // A block refused for room makes its children orphans: none is announced
            // without its parent.
            let held = self.hold(*h, entry, tier, out);
            parent = held.then_some(Some(seq));
        }
    }

    /// The entry for `h`, live or remembered.
    fn lookup(&self, h: EngineHash) -> Option<Entry> {
        self.blocks.get(&h).or_else(|| self.ghosts.get(&h)).copied()
    }

    /// Holds `h` once more in `tier`; false if refused for room (counted in `capped`).
    fn hold(
        &mut self,
        h: EngineHash,
        entry: Entry,
        tier: Tier,
        out: &mut Vec<BlockChange>,
    ) -> bool {
        if self.blocks.len() >= self.max_blocks && !self.blocks.contains_key(&h) {
            self.stats.capped += 1;
            return false;
        }
        let e = self.blocks.entry(h).or_insert(entry);
        if e.block != entry.block {
            // The engine reused a hash for other content: the old block is gone.
            for (i, t) in TIERS.iter().enumerate() {
                if e.refs[i] > 0 {
                    out.push(BlockChange::Removed {
                        tier: *t,
                        seq: e.block.seq,
                    });
                }
            }
            *e = entry;
        }
        let seq = e.block.seq;
        let refs = &mut e.refs[tier_index(tier)];
        *refs = refs.saturating_add(1);
        // Held before a rebuild and stored again: its owner has it already.
        if *refs == 1
            && !self
                .rebuilding
                .as_mut()
                .is_some_and(|held| held.remove(&(seq, tier)))
        {
            self.stats.stored += 1;
            out.push(BlockChange::Stored {
                tier,
                parent: e.parent,
                block: e.block,
            });
        }
        true
    }

    /// Holds on the host the chunk named by `last` (its last block): that block and the
    /// `offload_chunk - 1` before it, as far as the mirror knows them.
    fn hold_chunk(&mut self, last: EngineHash, out: &mut Vec<BlockChange>) {
        if let Some((members, stores)) = self.chunks.get_mut(&last) {
            // Its blocks are held by its first store: holding them again needs no room.
            *stores = stores.saturating_add(1);
            for h in members.clone().into_iter().rev() {
                if let Some(e) = self.lookup(h) {
                    self.hold(h, e, Tier::Host, out);
                }
            }
            return;
        }
        let mut members = Vec::with_capacity(self.offload_chunk);
        let mut at = Some(last);
        while let Some(h) = at.filter(|_| members.len() < self.offload_chunk) {
            let Some(e) = self.lookup(h) else { break };
            members.push((h, e));
            at = e.engine_parent;
        }
        if members.is_empty() {
            self.stats.unresolved += 1;
            return;
        }
        if self.chunks.len() >= self.max_blocks {
            self.stats.capped += members.len() as u64;
            return;
        }
        // Root first, so that each block's parent is announced before it; none after one
        // refused for room. The chunk keeps the blocks it holds, and its removal lets go of
        // those only.
        let mut held = Vec::with_capacity(members.len());
        for (h, e) in members.into_iter().rev() {
            if !self.hold(h, e, Tier::Host, out) {
                break;
            }
            held.push(h);
        }
        if !held.is_empty() {
            self.chunks.insert(last, (held, 1));
        }
    }

    /// Lets go of `h` in `tier`: the host chunk named by it, if the mirror holds one, or
    /// the block itself.
    fn release_named(&mut self, h: EngineHash, tier: Tier, out: &mut Vec<BlockChange>) {
        let chunk = match tier {
            Tier::Host => self.chunks.get_mut(&h),
            _ => None,
        };
        let Some((members, stores)) = chunk else {
            self.release(h, tier, out);
            return;
        };
        *stores -= 1;
        let members = if *stores == 0 {
            self.chunks.remove(&h).expect("invariant: just found").0
        } else {
            members.clone()
        };
        for m in members {
            self.release(m, tier, out);
        }
    }

    fn release(&mut self, h: EngineHash, tier: Tier, out: &mut Vec<BlockChange>) {
        let Some(e) = self.blocks.get_mut(&h) else {
            self.stats.unresolved += 1;
            return;
        };
        let refs = &mut e.refs[tier_index(tier)];
        if *refs == 0 {
            self.stats.unresolved += 1;
            return;
        }
        *refs -= 1;
        if *refs == 0 {
            self.stats.removed += 1;
            out.push(BlockChange::Removed {
                tier,
                seq: e.block.seq,
            });
        }
        if e.refs == [0; 4] {
            let e = self.blocks.remove(&h).expect("invariant: just found");
            self.remember(h, e);
        }
    }

    fn remember(&mut self, h: EngineHash, e: Entry) {
        if self.ghosts.insert(h, e).is_none() {
            self.ghost_order.push_back(h);
        }
        while self.ghost_order.len() > GHOSTS {
            if let Some(old) = self.ghost_order.pop_front() {
                self.ghosts.remove(&old);
            }
        }
    }
}

/// A block's local hash with one of its per-block extra keys mixed in (a multimodal input):
/// a request the router hashes from text alone never matches such a block, which is right,
/// since the engine would not reuse it for that request either.
fn mix(local: LocalHash, key: &ExtraKey) -> LocalHash {
    let mut bytes = local.0.to_le_bytes().to_vec();
    match key {
        ExtraKey::Str(s) => bytes.extend_from_slice(s.as_bytes()),
        ExtraKey::Other(digest) => bytes.extend_from_slice(&digest.to_le_bytes()),
    }
    LocalHash(xxh3_64_with_seed(&bytes, HASH_SEED))
}

/// What a batch's sequence number says about the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqCheck {
    /// The first batch seen: nothing older is known.
    First,
    /// The next one.
    Next,
    /// Batches `expected..seq` were lost.
    Gap {
        /// The first missing seq.
        expected: u64,
    },
    /// Seq went back: the engine restarted (its publisher counts from 0 again).
    Restarted,
}

/// The publisher's sequence as seen so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SeqTracker {
    next: Option<u64>,
}

impl SeqTracker {
    /// What `seq` means; does not advance.
    pub fn check(&self, seq: u64) -> SeqCheck {
        match self.next {
            None => SeqCheck::First,
            Some(n) if seq == n => SeqCheck::Next,
            Some(n) if seq > n => SeqCheck::Gap { expected: n },
            Some(_) => SeqCheck::Restarted,
        }
    }

    /// The seq expected next, if any batch was seen.
    pub fn expected(&self) -> Option<u64> {
        self.next
    }

    /// `seq` was applied.
    pub fn advance(&mut self, seq: u64) {
        self.next = Some(seq.saturating_add(1));
    }

    /// Forget the stream (a reconnect to a publisher that may have restarted).
    pub fn reset(&mut self) {
        self.next = None;
    }
}

#[cfg(test)]
mod tests;
