//! The contract between router and workers: identifiers, block hashing, KV events and their
//! wire codec (DESIGN §4). Pure data and functions, no I/O: both sides link this module.

mod codec;
mod events;
mod hashing;
mod ids;
mod snapshot;

pub use codec::{
    DecodeError, EncodeError, FORMAT_VERSION, HEADER_LEN, Limits, MAGIC, decode, encode,
    encode_split, payload_for_event, split_batch,
};
pub use events::{BlockChange, EventBatch, KvEvent, KvEventData, StoredBlock, parents_first};
pub use hashing::{BlockHash, HASH_SEED, Salt, extend_blocks, hash_blocks, local_hash, seq_hash};
pub use ids::{DpRank, LocalHash, SeqHash, Tier, WorkerId};
pub use snapshot::{
    AssembleError, MAX_SNAPSHOT_BLOCKS, SNAPSHOT_MAGIC, Snapshot, SnapshotAssembler, SnapshotBlock,
    SnapshotChunk, decode_snapshot_chunk,
};

#[cfg(test)]
mod tests;
