//! Byte mode: real KV bytes per block, in the layout of the GPU path. G1 is per layer a K and
//! a V tensor indexed by block slot (the paged layout inference engines use); G2 holds each
//! block contiguously, as the offload staging buffer does. Offload gathers a block's
//! `layers × 2` pieces into one G2 block; onboard scatters them back.

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
}

impl KvStore {
    /// Zeroed storage for `g1_blocks` device and `g2_blocks` host slots.
    pub fn new(layout: KvLayout, g1_blocks: usize, g2_blocks: usize) -> Self {
        KvStore {
            layout,
            g1_blocks,
            g1: vec![0; g1_blocks * layout.block_bytes()],
            g2: vec![0; g2_blocks * layout.block_bytes()],
        }
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
/// device memory, G2 pinned). Transfers start when the copy engine starts them and finish
/// when the link model says they end; on a GPU the copy is queued at the start on the copy
/// stream and its event is waited for at the end, so the slots stay held until it is done.
#[derive(Debug)]
pub enum KvBytes {
    /// Host memory.
    Host(KvStore),
    /// A CUDA device, with the copies in flight by transfer id.
    Cuda {
        /// Device buffers and streams.
        kv: Box<GpuKv>,
        /// Copies queued and not yet waited for.
        in_flight: FxHashMap<u64, Transfer>,
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

fn device(op: &'static str) -> impl Fn(kvroute_kernels::cuda::GpuError) -> DeviceError {
    move |e| DeviceError {
        op,
        message: e.to_string(),
    }
}

impl KvBytes {
    /// Writes the pattern of `seq` into G1 slot `slot`.
    pub fn fill(&mut self, slot: usize, seq: SeqHash) -> Result<(), DeviceError> {
        match self {
            KvBytes::Host(store) => {
                store.fill(slot, seq);
                Ok(())
            }
            KvBytes::Cuda { kv, .. } => kv.fill(&[(slot, seq.0)]).map_err(device("fill")),
        }
    }

    /// Starts copying `(g1, g2)` pairs to G2 (transfer `id`).
    pub fn start_offload(&mut self, id: u64, pairs: &[(usize, usize)]) -> Result<(), DeviceError> {
        if let KvBytes::Cuda { kv, in_flight } = self {
            in_flight.insert(id, kv.offload(pairs).map_err(device("offload"))?);
        }
        Ok(())
    }

    /// Starts copying `(g2, g1)` pairs to G1 (transfer `id`).
    pub fn start_onboard(&mut self, id: u64, pairs: &[(usize, usize)]) -> Result<(), DeviceError> {
        if let KvBytes::Cuda { kv, in_flight } = self {
            in_flight.insert(id, kv.onboard(pairs).map_err(device("onboard"))?);
        }
        Ok(())
    }

    /// Ends offload `id` of `(g1, g2)` pairs: the bytes are in G2 when this returns.
    pub fn finish_offload(&mut self, id: u64, pairs: &[(usize, usize)]) -> Result<(), DeviceError> {
        match self {
            KvBytes::Host(store) => {
                for &(g1, g2) in pairs {
                    store.gather(g1, g2);
                }
                Ok(())
            }
            KvBytes::Cuda { in_flight, .. } => match in_flight.remove(&id) {
                Some(t) => t.wait().map_err(device("offload")),
                None => Ok(()),
            },
        }
    }

    /// Ends onboard `id` of `(g2, g1)` pairs: the bytes are in G1 when this returns.
    pub fn finish_onboard(&mut self, id: u64, pairs: &[(usize, usize)]) -> Result<(), DeviceError> {
        match self {
            KvBytes::Host(store) => {
                for &(g2, g1) in pairs {
                    store.scatter(g2, g1);
                }
                Ok(())
            }
            KvBytes::Cuda { in_flight, .. } => match in_flight.remove(&id) {
                Some(t) => t.wait().map_err(device("onboard")),
                None => Ok(()),
            },
        }
    }

    /// Whether G1 slot `slot` holds exactly the pattern of `seq`.
    pub fn verify(&self, slot: usize, seq: SeqHash) -> bool {
        match self {
            KvBytes::Host(store) => store.verify(slot, seq),
            KvBytes::Cuda { kv, .. } => kv.verify_g1(&[(slot, seq.0)]).is_ok_and(|bad| bad[0] == 0),
        }
    }
}
