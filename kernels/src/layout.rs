//! Geometry of a worker's KV cache and the byte pattern blocks are filled with.
//!
//! G1 is, per layer, a K and a V tensor indexed by block slot: piece `p` (= layer × 2 +
//! {0: K, 1: V}) of slot `s` starts at `(p × g1_blocks + s) × piece_bytes`. G2 and staging
//! hold each block contiguously: piece `p` of slot `s` starts at `s × block_bytes + p ×
//! piece_bytes`.

use serde::{Deserialize, Serialize};

/// Element type of the KV tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
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
    /// Every dtype.
    pub const ALL: [Dtype; 3] = [Dtype::Bf16, Dtype::Fp16, Dtype::Fp32];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::Bf16 | Dtype::Fp16 => 2,
            Dtype::Fp32 => 4,
        }
    }
}

/// A geometry with a zero dimension.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{field} must be positive")]
pub struct LayoutError {
    /// The dimension.
    pub field: &'static str,
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
    /// Llama-3-8B-like: 32 layers, 8 KV heads of 128, 16-token blocks, bf16 (2 MiB a block).
    pub fn llama_8b() -> Self {
        KvLayout {
            layers: 32,
            kv_heads: 8,
            head_dim: 128,
            block_size: 16,
            dtype: Dtype::Bf16,
        }
    }

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

    /// Offset of piece `piece` of G1 slot `slot` in a G1 of `g1_blocks` slots.
    pub fn g1_offset(&self, g1_blocks: usize, slot: usize, piece: usize) -> usize {
        (piece * g1_blocks + slot) * self.piece_bytes()
    }

    /// Offset of piece `piece` of contiguous (G2 or staging) slot `slot`.
    pub fn packed_offset(&self, slot: usize, piece: usize) -> usize {
        slot * self.block_bytes() + piece * self.piece_bytes()
    }

    /// Checks that every dimension is positive.
    pub fn validate(&self) -> Result<(), LayoutError> {
        for (field, value) in [
            ("kv_bytes.layers", self.layers),
            ("kv_bytes.kv_heads", self.kv_heads),
            ("kv_bytes.head_dim", self.head_dim),
            ("kv_bytes.block_size", self.block_size),
        ] {
            if value == 0 {
                return Err(LayoutError { field });
            }
        }
        Ok(())
    }
}

/// Word `w` of the pattern of piece `piece` of the block whose `SeqHash` is `seq`: pieces are
/// streams of little-endian u64 words `splitmix64(seq ^ piece << 40 ^ w)`.
pub fn pattern_word(seq: u64, piece: usize, w: u64) -> u64 {
    splitmix64(seq ^ ((piece as u64) << 40) ^ w)
}

/// Byte `i` of piece `piece` of block `seq` (see [`pattern_word`]).
pub fn pattern_byte(seq: u64, piece: usize, i: usize) -> u8 {
    (pattern_word(seq, piece, (i / 8) as u64) >> ((i % 8) * 8)) as u8
}

/// Steele, Lea, Flood: "Fast splittable pseudorandom number generators", OOPSLA 2014.
pub(crate) fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
