//! KV-block data movement for kvroute workers: the per-layer paged G1 layout inference
//! engines use, the contiguous G2 / staging layout, and four operations over lists of
//! (block, layer, K or V) *pieces*:
//!
//! - `copy` — `gather` (G1 blocks → contiguous staging, for offload) and `scatter` (staging →
//!   G1 blocks, for onboard) are the same kernel over different piece lists;
//! - `fill` — writes a block's deterministic pattern from its `SeqHash` (stands in for the KV
//!   a prefill writes);
//! - `checksum` — per block, to verify roundtrips;
//! - `verify` — per block, the number of words that differ from its pattern.
//!
//! [`reference`] is the CPU implementation of every operation, and the worker's byte mode;
//! [`cuda`] runs the same operations as CUDA kernels (`kernels.cu`) compiled at run time with
//! NVRTC. cudarc loads the driver and NVRTC dynamically, so this crate builds and its CPU
//! tests pass on machines with no CUDA toolkit or driver; [`cuda::Gpu::new`] says what is
//! missing when there is none.

pub mod cuda;
pub mod layout;
pub mod plan;
pub mod reference;

pub use layout::{Dtype, KvLayout, LayoutError, pattern_byte, pattern_word};
pub use plan::{PatternPiece, Piece};
