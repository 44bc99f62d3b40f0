//! Byte mode: real KV bytes per block, in the layout of the GPU path. G1 is per layer a K and
//! a V tensor indexed by block slot (the paged layout inference engines use); G2 holds each
//! block contiguously, as the offload staging buffer does. Offload gathers a block's
//! `layers × 2` pieces into one G2 block; onboard scatters them back.

use serde::{Deserialize, Serialize};

use crate::config::ConfigError;
use kvroute::protocol::SeqHash;

/// Element type of the KV tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// bfloat16.
    Bf16,
    /// IEEE half.
    Fp16,
    /// IEEE single.
    Fp32,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::Bf16 | Dtype::Fp16 => 2,
            Dtype::Fp32 => 4,
        }
    }
}

/// Geometry of one worker's KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvLayout {
    /// Transformer layers.
    pub layers: usize,
    /// KV heads per layer.
    pub kv_heads: usize,
    /// Dimensions per head.
    pub head_dim: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Element type.
    pub dtype: Dtype,
}

impl Default for KvLayout {
    /// A small synthetic geometry for byte mode on a CPU: 2 KiB per 16-token block.
    fn default() -> Self {
        KvLayout {
            layers: 2,
            kv_heads: 2,
            head_dim: 8,
            block_size: 16,
            dtype: Dtype::Fp16,
        }
    }
}

impl KvLayout {
    /// Bytes of one (block, layer, K or V) piece.
    pub fn piece_bytes(&self) -> usize {
        self.block_size * self.kv_heads * self.head_dim * self.dtype.size()
    }

    /// Pieces per block: a K and a V per layer.
    pub fn pieces(&self) -> usize {
        self.layers * 2
    }

    /// Bytes of one whole block.
    pub fn block_bytes(&self) -> usize {
        self.pieces() * self.piece_bytes()
    }

    /// Checks that every dimension is positive.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (field, value) in [
            ("kv_bytes.layers", self.layers),
            ("kv_bytes.kv_heads", self.kv_heads),
            ("kv_bytes.head_dim", self.head_dim),
            ("kv_bytes.block_size", self.block_size),
        ] {
            if value == 0 {
                return Err(ConfigError::NotPositive { field });
            }
        }
        Ok(())
    }
}

/// Byte `i` of piece `piece` (= layer × 2 + {0: K, 1: V}) of the block `seq`: the piece is
/// a stream of little-endian u64 words `splitmix64(seq ^ piece << 40 ^ word)`. The GPU
/// `fill` kernel writes the same bytes.
pub fn pattern_byte(seq: SeqHash, piece: usize, i: usize) -> u8 {
    let word = splitmix64(seq.0 ^ ((piece as u64) << 40) ^ (i / 8) as u64);
    (word >> ((i % 8) * 8)) as u8
}

fn splitmix64(x: u64) -> u64 {
    // Steele, Lea, Flood: "Fast splittable pseudorandom number generators", OOPSLA 2014.
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
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

    fn g1_piece(&self, slot: usize, piece: usize) -> std::ops::Range<usize> {
        let bytes = self.layout.piece_bytes();
        let start = (piece * self.g1_blocks + slot) * bytes;
        start..start + bytes
    }

    fn g2_piece(&self, slot: usize, piece: usize) -> std::ops::Range<usize> {
        let bytes = self.layout.piece_bytes();
        let start = slot * self.layout.block_bytes() + piece * bytes;
        start..start + bytes
    }

    /// Writes the pattern of `seq` into G1 slot `slot` (stands in for prefill's KV writes).
    pub fn fill(&mut self, slot: usize, seq: SeqHash) {
        for piece in 0..self.layout.pieces() {
            let range = self.g1_piece(slot, piece);
            for (i, byte) in self.g1[range].iter_mut().enumerate() {
                *byte = pattern_byte(seq, piece, i);
            }
        }
    }

    /// Gathers G1 slot `g1` into G2 slot `g2` (offload).
    pub fn gather(&mut self, g1: usize, g2: usize) {
        for piece in 0..self.layout.pieces() {
            let src = self.g1_piece(g1, piece);
            let dst = self.g2_piece(g2, piece);
            self.g2[dst].copy_from_slice(&self.g1[src]);
        }
    }

    /// Scatters G2 slot `g2` into G1 slot `g1` (onboard).
    pub fn scatter(&mut self, g2: usize, g1: usize) {
        for piece in 0..self.layout.pieces() {
            let src = self.g2_piece(g2, piece);
            let dst = self.g1_piece(g1, piece);
            self.g1[dst].copy_from_slice(&self.g2[src]);
        }
    }

    /// Whether G1 slot `slot` holds exactly the pattern of `seq`.
    pub fn verify(&self, slot: usize, seq: SeqHash) -> bool {
        (0..self.layout.pieces()).all(|piece| {
            self.g1[self.g1_piece(slot, piece)]
                .iter()
                .enumerate()
                .all(|(i, &b)| b == pattern_byte(seq, piece, i))
        })
    }

    /// Flips one byte of G2 slot `slot` (tests of the corruption check).
    #[cfg(test)]
    pub fn corrupt_g2(&mut self, slot: usize) {
        let range = self.g2_piece(slot, 0);
        self.g2[range.start] ^= 0xff;
    }
}
