//! Byte mode: real KV bytes per block, in the layout of the GPU path. G1 is per layer a K and
//! a V tensor indexed by block slot (the paged layout inference engines use); G2 holds each
//! block contiguously, as the offload staging buffer does. Offload gathers a block's
//! `layers × 2` pieces into one G2 block; onboard scatters them back.

use std::task::Poll;

use kvroute::protocol::SeqHash;
use kvroute_kernels::cuda::{GpuKv, Transfer};
use kvroute_kernels::{plan, reference};
use rustc_hash::FxHashMap;

pub use kvroute_kernels::{Dtype, KvLayout};

/// Byte `i` of piece `piece` (= layer × 2 + {0: K, 1: V}) of the block `seq`
/// ([`kvroute_kernels::pattern_byte`]; the GPU `fill` kernel writes the same bytes).
pub fn pattern_byte(seq: SeqHash, piece: usize, i: usize) -> u8 {
    kvroute_kernels::pattern_byte(seq.0, piece, i)
}

/// The bytes of G1 and G2.
#[derive(Debug)]
pub struct KvStore {
    layout: KvLayout,
    g1_blocks: usize,
    g1: Vec<u8>,
    g2: Vec<u8>,
    /// Polls each transfer stays unfinished ([`KvBytes::lag_device`]).
    #[cfg(test)]
    lag: u32,
    /// Polls seen per transfer still lagging.
    #[cfg(test)]
    polls: FxHashMap<u64, u32>,
    /// Fills and offloads are refused ([`KvBytes::fail_device`]).
    #[cfg(test)]
    fail: bool,
}

impl KvStore {
    /// Zeroed storage for `g1_blocks` device and `g2_blocks` host slots.
    pub fn new(layout: KvLayout, g1_blocks: usize, g2_blocks: usize) -> Self {
        KvStore {
            layout,
            g1_blocks,
            g1: vec![0; g1_blocks * layout.block_bytes()],
            g2: vec![0; g2_blocks * layout.block_bytes()],
            #[cfg(test)]
            lag: 0,
            #[cfg(test)]
            polls: FxHashMap::default(),
            #[cfg(test)]
            fail: false,
        }
    }

    /// Whether the transfer keyed `key` (its id and direction) is to stay unfinished at this
    /// poll (test hook).
    #[cfg(test)]
    fn lagging(&mut self, key: u64) -> bool {
        let seen = self.polls.entry(key).or_insert(0);
        *seen += 1;
        if *seen <= self.lag {
            return true;
        }
        self.polls.remove(&key);
        false
    }

    #[cfg(not(test))]
    fn lagging(&mut self, _key: u64) -> bool {
        false
    }

    /// The geometry.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Writes the pattern of `seq` into G1 slot `slot` (stands in for prefill's KV writes).
    pub fn fill(&mut self, slot: usize, seq: SeqHash) {
        let pieces = plan::g1_blocks(&self.layout, self.g1_blocks, &[(slot, seq.0)]);
        reference::fill(&mut self.g1, &pieces).expect("invariant: slots come from the pools");
    }

    /// Gathers G1 slot `g1` into G2 slot `g2` (offload).
    pub fn gather(&mut self, g1: usize, g2: usize) {
        let pieces = plan::gather(&self.layout, self.g1_blocks, &[(g1, g2)]);
        reference::copy(&self.g1, &mut self.g2, &pieces)
            .expect("invariant: slots come from the pools");
    }

    /// Scatters G2 slot `g2` into G1 slot `g1` (onboard).
    pub fn scatter(&mut self, g2: usize, g1: usize) {
        let pieces = plan::scatter(&self.layout, self.g1_blocks, &[(g2, g1)]);
        reference::copy(&self.g2, &mut self.g1, &pieces)
            .expect("invariant: slots come from the pools");
    }

    /// Whether G1 slot `slot` holds exactly the pattern of `seq`.
    pub fn verify(&self, slot: usize, seq: SeqHash) -> bool {
        let pieces = plan::g1_blocks(&self.layout, self.g1_blocks, &[(slot, seq.0)]);
        reference::verify(&self.g1, &pieces, 1).is_ok_and(|bad| bad[0] == 0)
    }

    /// Flips one byte of G2 slot `slot` (tests of the corruption check).
    #[cfg(test)]
    pub fn corrupt_g2(&mut self, slot: usize) {
        self.g2[self.layout.packed_offset(slot, 0)] ^= 0xff;
    }
}

/// Where a worker's KV bytes live: host memory (byte mode, the CPU reference) or a GPU (G1 in
/// device memory, G2 pinned).
///
/// A transfer starts when the copy engine starts it and ends when the link model says so
/// *and* the bytes have arrived: on a GPU the copy (and an onboard's verification) is queued
/// on the copy stream at the start, and [`KvBytes::poll_offload`] / [`KvBytes::poll_onboard`]
/// query its event without waiting, so the slots stay held until the device is done. In host
/// memory the bytes move when the transfer is polled.
#[derive(Debug)]
pub enum KvBytes {
    /// Host memory.
    Host(KvStore),
    /// A CUDA device, with the copies in flight by transfer id (each direction numbers its
    /// own transfers).
    Cuda {
        /// Device buffers and streams (first: dropping it waits for the queued copies).
        kv: Box<GpuKv>,
        /// Offloads queued and not yet finished.
        offloads: FxHashMap<u64, Transfer>,
        /// Onboards queued, with their verification, and not yet finished.
        onboards: FxHashMap<u64, Transfer>,
    },
}

/// A device operation failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("KV {op} on the GPU: {message}")]
pub struct DeviceError {
    /// What was being done.
    pub op: &'static str,
    /// The driver's words.
    pub message: String,
}

/// The failure a test's [`KvBytes::fail_device`] injects.
#[cfg(test)]
fn injected(op: &'static str) -> DeviceError {
    DeviceError {
        op,
        message: "injected".into(),
    }
}

fn device(op: &'static str) -> impl Fn(kvroute_kernels::cuda::GpuError) -> DeviceError {
    move |e| DeviceError {
        op,
        message: e.to_string(),
    }
}

impl KvBytes {
    /// The GPU path's bytes, no copy in flight.
    pub fn cuda(kv: GpuKv) -> Self {
        KvBytes::Cuda {
            kv: Box::new(kv),
            offloads: FxHashMap::default(),
            onboards: FxHashMap::default(),
        }
    }

    /// Writes into each G1 slot the pattern of its block's hash (`SeqHash.0`).
    pub fn fill(&mut self, blocks: &[(usize, u64)]) -> Result<(), DeviceError> {
        match self {
            #[cfg(test)]
            KvBytes::Host(store) if store.fail => Err(injected("fill")),
            KvBytes::Host(store) => {
                for &(slot, seq) in blocks {
                    store.fill(slot, SeqHash(seq));
                }
                Ok(())
            }
            KvBytes::Cuda { kv, .. } => kv.fill(blocks).map_err(device("fill")),
        }
    }

    /// Starts copying `(g1, g2)` pairs to G2 (offload `id`).
    pub fn start_offload(&mut self, id: u64, pairs: &[(usize, usize)]) -> Result<(), DeviceError> {
        #[cfg(test)]
        if let KvBytes::Host(store) = self
            && store.fail
        {
            return Err(injected("offload"));
        }
        if let KvBytes::Cuda { kv, offloads, .. } = self {
            offloads.insert(id, kv.offload(pairs).map_err(device("offload"))?);
        }
        Ok(())
    }

    /// Starts copying `(g2, g1)` pairs to G1 (onboard `id`), and on a GPU queues behind it
    /// the check of each block against the pattern of its `seqs[i]`. The G1 slots are
    /// overwritten first with a pattern the check refuses: a slot freed by the same block's
    /// eviction still holds its bytes (the free list hands slots back last in, first out),
    /// and a copy lost on the way passed the check.
    pub fn start_onboard(
        &mut self,
        id: u64,
        pairs: &[(usize, usize)],
        seqs: &[SeqHash],
    ) -> Result<(), DeviceError> {
        match self {
            KvBytes::Host(store) => {
                for (&(_, g1), seq) in pairs.iter().zip(seqs) {
                    store.fill(g1, SeqHash(!seq.0));
                }
            }
            KvBytes::Cuda { kv, onboards, .. } => {
                let seqs: Vec<u64> = seqs.iter().map(|s| s.0).collect();
                let transfer = kv.onboard_checked(pairs, &seqs);
                onboards.insert(id, transfer.map_err(device("onboard"))?);
            }
        }
        Ok(())
    }

    /// Whether offload `id` of `(g1, g2)` pairs has finished, without waiting: when ready,
    /// its bytes are in G2 (an offload that never started is ready, its G2 bytes stale).
    pub fn poll_offload(
        &mut self,
        id: u64,
        pairs: &[(usize, usize)],
    ) -> Poll<Result<(), DeviceError>> {
        match self {
            KvBytes::Host(store) => {
                if store.lagging(id << 1) {
                    return Poll::Pending;
                }
                for &(g1, g2) in pairs {
                    store.gather(g1, g2);
                }
                Poll::Ready(Ok(()))
            }
            KvBytes::Cuda { kv, offloads, .. } => {
                match finish_when_done(kv, offloads, id, "offload") {
                    Poll::Ready(r) => Poll::Ready(r.map(drop)),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    /// Whether onboard `id` of `(g2, g1)` pairs has finished, without waiting: when ready,
    /// per pair whether G1 now holds exactly the pattern of `seqs[i]`.
    pub fn poll_onboard(
        &mut self,
        id: u64,
        pairs: &[(usize, usize)],
        seqs: &[SeqHash],
    ) -> Poll<Result<Vec<bool>, DeviceError>> {
        match self {
            KvBytes::Host(store) => {
                if store.lagging((id << 1) | 1) {
                    return Poll::Pending;
                }
                let intact = pairs
                    .iter()
                    .zip(seqs)
                    .map(|(&(g2, g1), &seq)| {
                        store.scatter(g2, g1);
                        store.verify(g1, seq)
                    })
                    .collect();
                Poll::Ready(Ok(intact))
            }
            KvBytes::Cuda { kv, onboards, .. } => {
                if !onboards.contains_key(&id) {
                    return Poll::Ready(Err(DeviceError {
                        op: "onboard",
                        message: "the copy was never queued".into(),
                    }));
                }
                match finish_when_done(kv, onboards, id, "onboard") {
                    Poll::Ready(Ok(bad)) if bad.len() == pairs.len() => {
                        Poll::Ready(Ok(bad.iter().map(|&b| b == 0).collect()))
                    }
                    Poll::Ready(Ok(bad)) => Poll::Ready(Err(DeviceError {
                        op: "onboard",
                        message: format!(
                            "{} verification results for {} blocks",
                            bad.len(),
                            pairs.len()
                        ),
                    })),
                    Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    /// Whether G1 slot `slot` holds exactly the pattern of `seq`. On a GPU this waits for
    /// the check (tests and tools; the engine's onboards are checked by
    /// [`KvBytes::poll_onboard`]).
    pub fn verify(&self, slot: usize, seq: SeqHash) -> bool {
        match self {
            KvBytes::Host(store) => store.verify(slot, seq),
            KvBytes::Cuda { kv, .. } => kv.verify_g1(&[(slot, seq.0)]).is_ok_and(|bad| bad[0] == 0),
        }
    }

    /// Test hook: every fill and offload is refused from now on, as a failing device would
    /// (host memory only).
    #[cfg(test)]
    pub fn fail_device(&mut self) {
        if let KvBytes::Host(store) = self {
            store.fail = true;
        }
    }

    /// Test hook: every transfer stays unfinished for its first `polls` polls, as a device
    /// slower than the link model would leave it (host memory only).
    #[cfg(test)]
    pub fn lag_device(&mut self, polls: u32) {
        if let KvBytes::Host(store) = self {
            store.lag = polls;
        }
    }
}

/// Ends transfer `id` if the device is done with it (an event query, no wait); a transfer
/// not in `in_flight` never started and is done.
fn finish_when_done(
    kv: &mut GpuKv,
    in_flight: &mut FxHashMap<u64, Transfer>,
    id: u64,
    op: &'static str,
) -> Poll<Result<Vec<u32>, DeviceError>> {
    let Some(transfer) = in_flight.get(&id) else {
        return Poll::Ready(Ok(Vec::new()));
    };
    match kv.is_done(transfer) {
        Ok(false) => Poll::Pending,
        Ok(true) => {
            let transfer = in_flight.remove(&id).expect("invariant: found above");
            Poll::Ready(kv.finish(transfer).map_err(device(op)))
        }
        Err(e) => {
            // The device failed it: drop it (waiting out the queue if it was checked).
            in_flight.remove(&id);
            Poll::Ready(Err(device(op)(e)))
        }
    }
}
