//! The worker's KV cache: fixed pools of G1 (device) and G2 (host) block slots, a prefix
//! cache over them, eviction, and the G1↔G2 copies between them (timed by
//! [`crate::offload::Link`]).
//!
//! A block slot moves free → mutable (being filled by one request) → registered (full,
//! shared, refcounted) → inactive (nobody uses it, still cached) → evicted/free. Requests
//! hold their blocks through a [`Lease`]; dropping it releases every block, in any state.
//!
//! G1 eviction is where G2 comes in: an inactive block worth keeping (hit before, or
//! extended by cached blocks) is copied to G2 first. It leaves G1's index at once (announced
//! as removed from the device tier), but its slot stays registered, held by the copy, until
//! the copy ends; the G2 slot is reserved before the copy starts. A prefix
//! hit in G2 is onboarded the other way: the request reserves G1 slots, waits for the copy,
//! and only then holds a G1 hit.
//!
//! A copy ends when the link model says so and its bytes have arrived. With bytes on a GPU
//! the second is an event query, never a wait: a copy the device has not finished when the
//! link model says it ends stays in flight, slots held, and is polled again
//! [`DEVICE_POLL_US`] later ([`BlockManager::next_wakeup_us`] says when;
//! [`CacheStats::late_copies`] counts them). Every onboarded block is checked against its
//! pattern before it counts, on the GPU by a kernel queued behind the copy, whose results
//! arrive with the copy's event. Nothing here waits on the device; what the GPU path may
//! still block on is listed in [`kvroute_kernels::cuda`].

mod eviction;
mod order;
mod pool;

use std::sync::Arc;
use std::task::Poll;

use kvroute::protocol::{SeqHash, StoredBlock, Tier};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;

pub use eviction::{EvictionKind, EvictionPolicy, LineageLru, Lru};
use pool::{Pool, State};

use crate::EngineConfig;
use crate::config::{ConfigError, Device};
use crate::offload::{DeviceError, KvBytes, KvLayout, KvStore, Link, TransferId};
use kvroute_kernels::cuda::GpuKv;

/// A block slot within one tier's pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BlockId(pub u32);

impl BlockId {
    fn index(self) -> usize {
        self.0 as usize
    }
}

/// A change to the resident set of a tier (the protocol's [`BlockChange`]).
pub use kvroute::protocol::BlockChange as Change;

/// How far a request's blocks are cached.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Leading blocks resident in G1 (active or inactive).
    pub device: usize,
    /// Blocks after those resident in G2 (to be onboarded).
    pub host: usize,
}

/// Slot counts of one tier by state; they always add up to `capacity`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierUsage {
    /// Slots in the pool.
    pub capacity: usize,
    /// Unused slots.
    pub free: usize,
    /// Slots being filled, owned by one request.
    pub mutable: usize,
    /// Full blocks in use.
    pub registered: usize,
    /// Full blocks nobody uses (cached, evictable).
    pub inactive: usize,
    /// Of `registered`, slots held only by an offload copy reading them (they come back
    /// when it ends): no request holds or fills them.
    pub offloading: usize,
}

/// Cumulative counters of the cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Blocks requests found in G1.
    pub device_hits: u64,
    /// Blocks onboarded from G2 for requests.
    pub onboarded: u64,
    /// Blocks copied G1 → G2 on eviction.
    pub offloaded: u64,
    /// Blocks dropped from G1 (copied or not).
    pub device_evictions: u64,
    /// Blocks dropped from G2.
    pub host_evictions: u64,
    /// Onboarded blocks whose bytes were checked and found intact.
    pub verified: u64,
    /// Onboarded blocks whose bytes were not their own (each fails the engine).
    pub verify_failures: u64,
    /// Copies the device had not finished when the link model said they end.
    pub late_copies: u64,
    /// Blocks a request computed that another had registered meanwhile: it shares theirs.
    pub shared_on_register: u64,
}

/// How often a copy the device has not finished is polled, µs of engine time.
pub const DEVICE_POLL_US: u64 = 100;

/// How long after the link model ended it a copy the device has not finished is a failure
/// of the device ([`OffloadError::Stuck`]), µs of engine time: a block's copy takes
/// microseconds, and one that never ends held its slots, and the requests behind them, for
/// good while the engine polled it ten thousand times a second.
pub const DEVICE_DEADLINE_US: u64 = 10_000_000;

/// A copy's direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Copy {
    Offload,
    Onboard,
}

/// Why an allocation did not happen. Nothing was taken either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    /// Enough slots are on their way back (G1→G2 copies finishing): try again at
    /// [`BlockManager::next_wakeup_us`].
    #[error("waiting for offload copies to free G1 slots")]
    Pending,
    /// Not enough slots can be freed now: running requests hold them.
    #[error("not enough free or evictable G1 slots")]
    Insufficient,
}

/// A loud failure of the copy engine.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum OffloadError {
    /// Bytes onboarded from G2 differ from the block's pattern.
    #[error("onboarded block {seq:?} does not hold its bytes: G2 data corrupted")]
    Corrupt {
        /// The block.
        seq: SeqHash,
    },
    /// The GPU failed a copy.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// The device has not finished a copy [`DEVICE_DEADLINE_US`] after it was due.
    #[error("the device has not finished a KV copy {late_ms} ms after it was due: it is hung")]
    Stuck {
        /// How late, ms.
        late_ms: u64,
    },
}

#[derive(Debug)]
struct Inner {
    g1: Pool,
    g2: Pool,
    tick: u64,
    changes: Vec<Change>,
    d2h: Link,
    h2d: Link,
    /// Copies G1 → G2 in flight on `d2h`: (G1 source, reserved G2 slot) pairs.
    offloads: FxHashMap<TransferId, Vec<(BlockId, BlockId)>>,
    /// Copies G2 → G1 in flight on `h2d`: (G2 source, reserved G1 slot) pairs.
    onboards: FxHashMap<TransferId, Vec<(BlockId, BlockId)>>,
    /// Copies the link model has ended and the device has not, in the order they ended.
    /// With each, when it was due.
    device_wait: Vec<(TransferId, Copy, u64)>,
    /// When `device_wait` is polled next.
    poll_at: Option<u64>,
    /// G1 slots held only by an offload copy: they come back when it ends.
    offloading: usize,
    block_bytes: u64,
    offload_min_hits: u32,
    offload_parents: bool,
    bytes: Option<KvBytes>,
    /// Scratch: the (slot, hash) pairs a registration fills, in one call.
    fills: Vec<(usize, u64)>,
    /// The first fill or offload the device refused to start: the next `advance` reports
    /// it, which stops the engine (as a failed onboard does). Left to run, the blocks it
    /// concerned were announced (in G1 with bytes never written, or in G2 with stale ones)
    /// and failed much later, as corrupted G2 data, when a request onboarded one.
    device_failed: Option<DeviceError>,
    stats: CacheStats,
}

/// The two tiers and their copy engine. Cheap to clone: clones share the cache.
#[derive(Clone, Debug)]
pub struct BlockManager {
    inner: Arc<Mutex<Inner>>,
}

/// A request's blocks: its G1 blocks in sequence order (shared prefix hits, then its own
/// mutable ones) and the G2 blocks pinned for an onboard. Dropping it releases them all.
#[derive(Debug)]
#[must_use = "dropping a lease releases its blocks"]
pub struct Lease {
    inner: Arc<Mutex<Inner>>,
    blocks: Vec<BlockId>,
    host_pins: Vec<BlockId>,
}

/// Names an onboard copy a request waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct OnboardTicket(pub u64);

impl BlockManager {
    /// Empty pools sized by `config`, with host byte mode when `config.kv_bytes` is set
    /// (whatever `config.device` says; [`BlockManager::on_device`] honours it).
    pub fn new(config: &EngineConfig) -> Self {
        let bytes = config
            .kv_bytes
            .map(|layout| KvBytes::Host(KvStore::new(layout, config.g1_blocks, config.g2_blocks)));
        Self::with_bytes(config, bytes)
    }

    /// Empty pools sized by `config`, their bytes where `config.device` says: on `cuda:N`, G1
    /// in device memory and G2 in pinned host memory, in `kv_bytes`' geometry (default: a
    /// Llama-8B-like one with the engine's block size).
    pub fn on_device(config: &EngineConfig) -> Result<Self, ConfigError> {
        let Device::Cuda(ordinal) = config.device else {
            return Ok(Self::new(config));
        };
        let layout = config.kv_bytes.unwrap_or(KvLayout {
            block_size: config.block_size,
            ..KvLayout::llama_8b()
        });
        // Enough staging for a few hundred blocks per launch, at most 512 MiB of it.
        let staging = (512 << 20) / layout.block_bytes().max(1);
        let kv = GpuKv::new(
            ordinal,
            layout,
            config.g1_blocks,
            config.g2_blocks,
            staging.clamp(1, 256),
        )
        .map_err(|e| ConfigError::Device {
            device: config.device.to_string(),
            message: e.to_string(),
        })?;
        Ok(Self::with_bytes(config, Some(KvBytes::cuda(kv))))
    }

    fn with_bytes(config: &EngineConfig, bytes: Option<KvBytes>) -> Self {
        BlockManager {
            inner: Arc::new(Mutex::new(Inner {
                g1: Pool::new(Tier::Device, config.g1_blocks, config.eviction.policy()),
                g2: Pool::new(Tier::Host, config.g2_blocks, config.eviction.policy()),
                tick: 0,
                changes: Vec::new(),
                d2h: Link::new(config.link_gbps),
                h2d: Link::new(config.link_gbps),
                offloads: FxHashMap::default(),
                onboards: FxHashMap::default(),
                device_wait: Vec::new(),
                poll_at: None,
                offloading: 0,
                block_bytes: config.block_bytes(),
                offload_min_hits: config.offload_min_hits,
                offload_parents: config.offload_parents,
                bytes,
                fills: Vec::new(),
                device_failed: None,
                stats: CacheStats::default(),
            })),
        }
    }

    /// How far `seqs` (a request's block hashes in order) is cached: the G1 prefix, then
    /// its continuation in G2. Changes nothing.
    pub fn match_prefix(&self, seqs: &[SeqHash]) -> PrefixMatch {
        self.inner.lock().match_prefix(seqs).0
    }

    /// Takes the cached prefix of `seqs` for a request: references on its G1 blocks, and
    /// pins on the G2 blocks after them so that they survive until onboarded.
    pub fn acquire_prefix(&self, seqs: &[SeqHash]) -> (Lease, PrefixMatch) {
        // No fresh block asked for: room is made at once, and the time is never read.
        self.admit(0, seqs, 0)
            .expect("invariant: no fresh block is asked for")
    }

    /// Admits a request under one lock: takes the cached prefix of `seqs` (references on its
    /// G1 blocks and pins on the G2 blocks after them, a hit each) and `blocks` fresh G1
    /// blocks after it, as [`BlockManager::allocate`] gives them. If the blocks cannot be
    /// had, the prefix is let go
    /// as it was: no hits counted, each block as recent as before (a request retried every
    /// step while copies finish would otherwise refresh its prefix and count its hits each
    /// time; vLLM's `allocate_slots` touches a request's hits only once it fits). Blocks
    /// evicted or sent to G2 to make room stay so: they are the room the retry needs.
    pub fn admit(
        &self,
        now_us: u64,
        seqs: &[SeqHash],
        blocks: usize,
    ) -> Result<(Lease, PrefixMatch), AllocError> {
        let mut inner = self.inner.lock();
        let (found, _) = inner.match_prefix(seqs);
        let inner = &mut *inner;
        let g1_ids = inner.g1.lookup_all(&seqs[..found.device]);
        let g2_ids = inner
            .g2
            .lookup_all(&seqs[found.device..found.device + found.host]);
        let recency = |pool: &Pool, ids: &[BlockId]| -> Vec<u64> {
            ids.iter().map(|id| pool.slot(*id).last_used).collect()
        };
        let (g1_before, g2_before) = (recency(&inner.g1, &g1_ids), recency(&inner.g2, &g2_ids));
        inner.tick += 1;
        let tick = inner.tick;
        for &id in &g1_ids {
            inner.g1.acquire(id, tick);
        }
        for &id in &g2_ids {
            inner.g2.acquire(id, tick);
        }
        if let Err(e) = inner.make_room(now_us, blocks) {
            for (id, last_used) in g1_ids.into_iter().zip(g1_before) {
                inner.g1.release(id, last_used);
            }
            for (id, last_used) in g2_ids.into_iter().zip(g2_before) {
                inner.g2.release(id, last_used);
            }
            return Err(e);
        }
        inner.g1.count_hits(&g1_ids);
        inner.g2.count_hits(&g2_ids);
        inner.stats.device_hits += found.device as u64;
        let mut lease = Lease {
            inner: Arc::clone(&self.inner),
            blocks: g1_ids,
            host_pins: g2_ids,
        };
        inner.take_room(blocks, &mut lease.blocks);
        Ok((lease, found))
    }

    /// [`BlockManager::match_prefix`], with how many of the G1 hits are inactive (cached,
    /// evictable until acquired): what an admission checks before acquiring anything, so that
    /// one that fails changes nothing, as vLLM's `allocate_slots` touches the hit blocks only
    /// once it knows the request fits.
    pub fn peek_prefix(&self, seqs: &[SeqHash]) -> (PrefixMatch, usize) {
        self.inner.lock().match_prefix(seqs)
    }

    /// An empty lease (a request with no cached prefix).
    pub fn lease(&self) -> Lease {
        Lease {
            inner: Arc::clone(&self.inner),
            blocks: Vec::new(),
            host_pins: Vec::new(),
        }
    }

    /// Appends `n` fresh mutable G1 blocks to `lease`, all or none, evicting inactive
    /// blocks as the policy orders (and copying those worth keeping to G2).
    pub fn allocate(&self, now_us: u64, lease: &mut Lease, n: usize) -> Result<(), AllocError> {
        debug_assert!(Arc::ptr_eq(&self.inner, &lease.inner));
        let mut inner = self.inner.lock();
        inner.make_room(now_us, n)?;
        inner.take_room(n, &mut lease.blocks);
        Ok(())
    }

    /// Starts copying the lease's pinned G2 blocks into its G1 blocks from index `first`
    /// on (slots from [`BlockManager::allocate`]). They become G1 hits when the copy ends.
    pub fn start_onboard(&self, now_us: u64, lease: &mut Lease, first: usize) -> OnboardTicket {
        let mut inner = self.inner.lock();
        let inner = &mut *inner;
        let pins = std::mem::take(&mut lease.host_pins);
        let mut pairs = Vec::with_capacity(pins.len());
        for (i, g2) in pins.into_iter().enumerate() {
            let g1 = lease.blocks[first + i];
            inner.g1.slot_mut(g1).in_transfer = true;
            pairs.push((g2, g1));
        }
        let id = inner
            .h2d
            .start(now_us, inner.block_bytes * pairs.len() as u64);
        inner.stats.onboarded += pairs.len() as u64;
        if let Some(bytes) = &mut inner.bytes {
            let slots: Vec<(usize, usize)> = pairs
                .iter()
                .map(|(g2, g1)| (g2.index(), g1.index()))
                .collect();
            let seqs: Vec<SeqHash> = pairs.iter().map(|(g2, _)| inner.g2.slot(*g2).seq).collect();
            if let Err(e) = bytes.start_onboard(id.0, &slots, &seqs) {
                // Polling it reports the failure, which stops the engine.
                tracing::error!(error = %e, "onboard copy not started");
            }
        }
        inner.onboards.insert(id, pairs);
        OnboardTicket(id.0)
    }

    /// Marks the lease's blocks `first..` full, each with its hash and the hash it extends,
    /// fills their bytes in byte mode, and registers them in G1 (announcing them). A hash G1
    /// already holds (another request computed the same block at the same time) is shared
    /// instead: the lease takes a reference on the registered block and its own slot goes
    /// back to the pool, so that the blocks after it hang off a block the lease holds (a
    /// private copy would leave the registered one unheld, counted as evictable while
    /// this lease's blocks extend it). One lock for the run: a step registers a sequence's
    /// new blocks together, and their bytes are written in one call (on a GPU, a launch per
    /// 256 blocks instead of one per block). A shared block's own slot is not written: it
    /// went back to the pool.
    pub fn register(
        &self,
        lease: &mut Lease,
        first: usize,
        blocks: impl IntoIterator<Item = (Option<SeqHash>, StoredBlock)>,
    ) {
        let mut inner = self.inner.lock();
        let inner = &mut *inner;
        inner.fills.clear();
        for (index, (parent, block)) in (first..).zip(blocks) {
            let id = lease.blocks[index];
            // The block before it in the lease holds its parent.
            let near = index.checked_sub(1).map(|i| lease.blocks[i]);
            inner.tick += 1;
            if inner
                .g1
                .register(id, parent, near, block, inner.tick, &mut inner.changes)
            {
                if inner.bytes.is_some() {
                    inner.fills.push((id.index(), block.seq.0));
                }
            } else {
                inner.share(&mut lease.blocks[index]);
            }
        }
        // Before the lock goes: an offload of these blocks is queued after their bytes.
        if let Some(bytes) = &mut inner.bytes
            && !inner.fills.is_empty()
            && let Err(e) = bytes.fill(&inner.fills)
        {
            tracing::error!(error = %e, blocks = inner.fills.len(), "block bytes not written");
            inner.device_failed.get_or_insert(e);
        }
    }

    /// The lease's onboarded blocks `range` (its ticket came back ready) share the
    /// registered block wherever their own registration was refused, as
    /// [`BlockManager::register`] does for computed blocks: two requests onboarding the
    /// same G2 blocks at once each copy them, and the second copy to land finds the hash
    /// registered by the first.
    pub fn share_onboarded(&self, lease: &mut Lease, range: std::ops::Range<usize>) {
        let mut inner = self.inner.lock();
        for id in &mut lease.blocks[range] {
            if inner.g1.slot(*id).state == State::Mutable {
                inner.share(id);
            }
        }
    }

    /// Completes every copy finished by `now_us`: offloaded blocks become G2 blocks and
    /// free their G1 slots; onboarded blocks become G1 blocks, and their tickets are
    /// appended to `ready`.
    pub fn advance(&self, now_us: u64, ready: &mut Vec<OnboardTicket>) -> Result<(), OffloadError> {
        let mut inner = self.inner.lock();
        inner.advance(now_us, ready)
    }

    /// A fill or offload the device refused to start since the last look, if any: the
    /// engine stops on it at its next `advance`, whether or not a copy is due then.
    pub fn take_device_failure(&self) -> Option<OffloadError> {
        self.inner
            .lock()
            .device_failed
            .take()
            .map(OffloadError::from)
    }

    /// When the next copy completes by the link model, or a copy the device has not
    /// finished is polled again; `None` if no copy is in flight.
    pub fn next_wakeup_us(&self) -> Option<u64> {
        let inner = self.inner.lock();
        [
            inner.d2h.next_completion_us(),
            inner.h2d.next_completion_us(),
            inner.poll_at,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Moves the changes recorded since the last call into `out`.
    pub fn drain_changes(&self, out: &mut Vec<Change>) {
        out.append(&mut self.inner.lock().changes);
    }

    /// Slot counts of a tier.
    pub fn usage(&self, tier: Tier) -> TierUsage {
        let inner = self.inner.lock();
        match tier {
            Tier::Device => inner.g1.usage(),
            _ => inner.g2.usage(),
        }
    }

    /// Counters since creation.
    pub fn stats(&self) -> CacheStats {
        self.inner.lock().stats
    }

    /// The blocks resident (registered or inactive) in a tier, with their parents.
    pub fn resident(&self, tier: Tier) -> Vec<(Option<SeqHash>, StoredBlock)> {
        let inner = self.inner.lock();
        let pool = if tier == Tier::Device {
            &inner.g1
        } else {
            &inner.g2
        };
        pool.resident()
            .map(|(seq, slot)| {
                (
                    slot.parent,
                    StoredBlock {
                        seq,
                        local: slot.local,
                    },
                )
            })
            .collect()
    }

    /// Checks every invariant: per tier, free + mutable + registered + inactive ==
    /// capacity, no hash resident twice, index, child counts and eviction order agree.
    pub fn check_invariants(&self) -> Result<(), String> {
        let inner = self.inner.lock();
        inner.g1.check()?;
        inner.g2.check()?;
        let held = inner.offloads.values().map(Vec::len).sum::<usize>();
        if held < inner.offloading {
            return Err(format!(
                "{} G1 slots counted offloading, {held} in copies",
                inner.offloading
            ));
        }
        Ok(())
    }

    /// Whether G1 slot `id` holds the byte pattern of `seq` (byte mode only).
    pub fn verify_bytes(&self, id: BlockId, seq: SeqHash) -> Option<bool> {
        let inner = self.inner.lock();
        inner.bytes.as_ref().map(|b| b.verify(id.index(), seq))
    }

    /// Makes the "device" refuse every fill and offload from now on (byte mode).
    #[cfg(test)]
    pub(crate) fn fail_device(&self) {
        if let Some(bytes) = &mut self.inner.lock().bytes {
            bytes.fail_device();
        }
    }

    /// Makes every copy finish on the "device" only at its `polls + 1`-th poll (byte mode).
    #[cfg(test)]
    pub(crate) fn lag_device(&self, polls: u32) {
        if let Some(bytes) = &mut self.inner.lock().bytes {
            bytes.lag_device(polls);
        }
    }

    #[cfg(test)]
    fn corrupt_host_block(&self, seq: SeqHash) {
        let mut inner = self.inner.lock();
        let id = inner.g2.lookup(seq).expect("block in G2");
        if let Some(KvBytes::Host(bytes)) = &mut inner.bytes {
            bytes.corrupt_g2(id.index());
        }
    }
}

impl Inner {
    /// How far `seqs` is cached (G1, then G2), and how many of the G1 hits are inactive.
    fn match_prefix(&self, seqs: &[SeqHash]) -> (PrefixMatch, usize) {
        let (mut device, mut inactive) = (0, 0);
        for seq in seqs {
            let Some(id) = self.g1.lookup(*seq) else {
                break;
            };
            device += 1;
            inactive += usize::from(self.g1.slot(id).state == State::Inactive);
        }
        let host = seqs[device..]
            .iter()
            .take_while(|s| self.g2.lookup(**s).is_some())
            .count();
        (PrefixMatch { device, host }, inactive)
    }

    /// `*id`, a full mutable G1 slot whose hash G1 registered from another slot, is
    /// given up for a reference on that block.
    fn share(&mut self, id: &mut BlockId) {
        let seq = self.g1.slot(*id).seq;
        let shared = self
            .g1
            .lookup(seq)
            .expect("invariant: a refused registration names an indexed hash");
        self.g1.acquire(shared, self.tick);
        self.g1.free_mutable(*id);
        *id = shared;
        self.stats.shared_on_register += 1;
    }

    /// Appends `n` free G1 slots to `blocks`, made free by [`Inner::make_room`].
    fn take_room(&mut self, n: usize, blocks: &mut Vec<BlockId>) {
        for _ in 0..n {
            let id = self.g1.take_free().expect("invariant: room was made");
            blocks.push(id);
        }
    }

    /// Gets `n` G1 slots free, evicting as needed; `Pending` if copies must finish first.
    fn make_room(&mut self, now_us: u64, n: usize) -> Result<(), AllocError> {
        if self.g1.free_count() >= n {
            return Ok(());
        }
        if self.g1.free_count() + self.offloading + self.g1.inactive_count() < n {
            return Err(AllocError::Insufficient);
        }
        let mut copies = Vec::new();
        while self.g1.free_count() + self.offloading < n {
            let Some(victim) = self.g1.pop_victim() else {
                break;
            };
            let slot = self.g1.slot(victim);
            let seq = slot.seq;
            let keep = slot.hits >= self.offload_min_hits
                || (self.offload_parents
                    && (self.g1.children(victim) > 0 || self.g2.has_children(seq)));
            if keep
                && self.g2.capacity() > 0
                && self.g2.lookup(seq).is_none()
                && let Some(g2) = self.reserve_g2()
            {
                self.g1.detach(victim, &mut self.changes);
                self.stats.device_evictions += 1;
                self.offloading += 1;
                copies.push((victim, g2));
                continue;
            }
            self.g1.evict(victim, &mut self.changes);
            self.stats.device_evictions += 1;
        }
        if !copies.is_empty() {
            let id = self
                .d2h
                .start(now_us, self.block_bytes * copies.len() as u64);
            if let Some(bytes) = &mut self.bytes {
                let slots: Vec<(usize, usize)> = copies
                    .iter()
                    .map(|(g1, g2)| (g1.index(), g2.index()))
                    .collect();
                if let Err(e) = bytes.start_offload(id.0, &slots) {
                    tracing::error!(error = %e, "offload copy not started");
                    self.device_failed.get_or_insert(e);
                }
            }
            self.offloads.insert(id, copies);
        }
        if self.g1.free_count() >= n {
            Ok(())
        } else if self.g1.free_count() + self.offloading >= n {
            Err(AllocError::Pending)
        } else {
            Err(AllocError::Insufficient)
        }
    }

    /// A G2 slot for an offload copy: a free one, or one evicted from G2.
    fn reserve_g2(&mut self) -> Option<BlockId> {
        if let Some(id) = self.g2.take_free() {
            return Some(id);
        }
        let victim = self.g2.pop_victim()?;
        self.g2.evict(victim, &mut self.changes);
        self.stats.host_evictions += 1;
        self.g2.take_free()
    }

    fn advance(&mut self, now_us: u64, ready: &mut Vec<OnboardTicket>) -> Result<(), OffloadError> {
        if let Some(e) = self.device_failed.take() {
            return Err(e.into());
        }
        // Copies the device was late with first, then those the link model ends now.
        let mut due = std::mem::take(&mut self.device_wait);
        let retries = due.len();
        let mut done = Vec::new();
        self.d2h.advance(now_us, &mut done);
        due.extend(done.drain(..).map(|(id, _)| (id, Copy::Offload, now_us)));
        self.h2d.advance(now_us, &mut done);
        due.extend(done.into_iter().map(|(id, _)| (id, Copy::Onboard, now_us)));
        let mut result = Ok(());
        for (i, (id, copy, since)) in due.into_iter().enumerate() {
            let polled = match copy {
                Copy::Offload => self.poll_offload(id),
                Copy::Onboard => self.poll_onboard(id, ready),
            };
            match polled {
                Poll::Pending => {
                    if i >= retries {
                        self.stats.late_copies += 1;
                    }
                    let late = now_us.saturating_sub(since);
                    if late >= DEVICE_DEADLINE_US {
                        result = Err(OffloadError::Stuck {
                            late_ms: late / 1_000,
                        });
                    }
                    self.device_wait.push((id, copy, since));
                }
                Poll::Ready(Err(e)) => result = Err(e),
                Poll::Ready(Ok(())) => {}
            }
        }
        self.poll_at = (!self.device_wait.is_empty()).then_some(now_us + DEVICE_POLL_US);
        result
    }

    /// Ends offload `id` if its bytes have arrived: the blocks become G2 blocks and their
    /// G1 slots (held, detached, until now) come back.
    fn poll_offload(&mut self, id: TransferId) -> Poll<Result<(), OffloadError>> {
        let Some(pairs) = self.offloads.get(&id) else {
            return Poll::Ready(Ok(()));
        };
        let mut result = Ok(());
        if let Some(bytes) = &mut self.bytes {
            let slots: Vec<(usize, usize)> = pairs
                .iter()
                .map(|(g1, g2)| (g1.index(), g2.index()))
                .collect();
            match bytes.poll_offload(id.0, &slots) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(r) => result = r.map_err(OffloadError::from),
            }
        }
        let pairs = self.offloads.remove(&id).expect("invariant: found above");
        self.tick += 1;
        let tick = self.tick;
        for (g1, g2) in pairs {
            let slot = self.g1.slot(g1);
            let block = StoredBlock {
                seq: slot.seq,
                local: slot.local,
            };
            let parent = slot.parent;
            if self
                .g2
                .register(g2, parent, None, block, tick, &mut self.changes)
            {
                self.g2.release(g2, tick);
            } else {
                self.g2.free_mutable(g2);
            }
            self.stats.offloaded += 1;
            self.offloading -= 1;
            self.g1.release_detached(g1);
        }
        Poll::Ready(result)
    }

    /// Ends onboard `id` if its bytes have arrived and been checked: the blocks become G1
    /// blocks and its ticket goes to `ready`. A block that is not its own fails the copy.
    fn poll_onboard(
        &mut self,
        id: TransferId,
        ready: &mut Vec<OnboardTicket>,
    ) -> Poll<Result<(), OffloadError>> {
        let Some(pairs) = self.onboards.get(&id) else {
            return Poll::Ready(Ok(()));
        };
        let mut result = Ok(());
        let mut intact = None;
        if let Some(bytes) = &mut self.bytes {
            let seqs: Vec<SeqHash> = pairs.iter().map(|(g2, _)| self.g2.slot(*g2).seq).collect();
            let slots: Vec<(usize, usize)> = pairs
                .iter()
                .map(|(g2, g1)| (g2.index(), g1.index()))
                .collect();
            match bytes.poll_onboard(id.0, &slots, &seqs) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(checked)) => intact = Some(checked),
                Poll::Ready(Err(e)) => result = Err(OffloadError::from(e)),
            }
        }
        let pairs = self.onboards.remove(&id).expect("invariant: found above");
        self.tick += 1;
        let tick = self.tick;
        // The copy's blocks are a run of one chain: each one's parent is in the slot before.
        let mut near = None;
        for (i, (g2, g1)) in pairs.into_iter().enumerate() {
            let source = self.g2.slot(g2);
            let block = StoredBlock {
                seq: source.seq,
                local: source.local,
            };
            let parent = source.parent;
            match intact.as_ref().map(|ok| ok[i]) {
                Some(true) => self.stats.verified += 1,
                Some(false) => {
                    self.stats.verify_failures += 1;
                    result = Err(OffloadError::Corrupt { seq: block.seq });
                }
                None => {}
            }
            self.g2.release(g2, tick);
            let slot = self.g1.slot_mut(g1);
            slot.in_transfer = false;
            if slot.abandoned {
                self.g1.free_mutable(g1);
            } else {
                self.g1
                    .register(g1, parent, near, block, tick, &mut self.changes);
            }
            near = Some(g1);
        }
        ready.push(OnboardTicket(id.0));
        Poll::Ready(result)
    }
}

impl Lease {
    /// G1 blocks held, in sequence order.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Number of G1 blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether the lease holds no G1 block.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut inner = self.inner.lock();
        let inner = &mut *inner;
        // Last block first, each a tick apart: a sequence's tail is less recent than its
        // head, so even plain LRU evicts a chain from its end.
        for &id in self.blocks.iter().rev() {
            inner.tick += 1;
            let tick = inner.tick;
            let slot = inner.g1.slot_mut(id);
            match slot.state {
                State::Mutable if slot.in_transfer => slot.abandoned = true,
                State::Mutable => inner.g1.free_mutable(id),
                State::Registered => inner.g1.release(id, tick),
                State::Free | State::Inactive => {
                    debug_assert!(false, "invariant: a leased block is mutable or registered");
                }
            }
        }
        for &id in &self.host_pins {
            inner.tick += 1;
            inner.g2.release(id, inner.tick);
        }
    }
}

#[cfg(test)]
mod tests;
