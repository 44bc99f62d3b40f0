//! The copy engine between G1 (device) and G2 (host): when a copy finishes ([`Link`]) and,
//! in byte mode, what it moves ([`KvStore`], in the per-layer paged layout of the GPU path).

mod layout;
mod link;

pub use layout::{DeviceError, Dtype, KvBytes, KvLayout, KvStore, pattern_byte};
pub use link::{Link, TransferId};
