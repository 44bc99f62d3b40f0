//! Snapshots: a worker's whole resident set per tier, with the id of the last event it
//! covers (the watermark), sent in chunks that each fit a NATS message. A router resyncing
//! a worker applies the snapshot, then only live events after the watermark (DESIGN §6).

use std::collections::BTreeMap;

use rkyv::rancor;

use super::codec::body;
use super::{
    DecodeError, DpRank, EncodeError, EventBatch, FORMAT_VERSION, HEADER_LEN, KvEvent, KvEventData,
    Limits, SeqHash, StoredBlock, Tier, WorkerId,
};

/// Magic of snapshot chunk payloads.
pub const SNAPSHOT_MAGIC: [u8; 3] = *b"KVS";

/// One resident block of a snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct SnapshotBlock {
    /// Its tier.
    pub tier: Tier,
    /// The block it extends.
    pub parent: Option<SeqHash>,
    /// The block.
    pub block: StoredBlock,
}

/// A worker's resident set at a watermark.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// The worker.
    pub worker: WorkerId,
    /// Its rank.
    pub dp_rank: DpRank,
    /// Its incarnation.
    pub epoch: u64,
    /// Id of the last event the snapshot includes (0: none).
    pub watermark: u64,
    /// Every resident block, parents before children within a tier.
    pub blocks: Vec<SnapshotBlock>,
}

/// One message of a snapshot reply.
#[derive(Clone, Debug, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct SnapshotChunk {
    /// The worker.
    pub worker: WorkerId,
    /// Its rank.
    pub dp_rank: DpRank,
    /// Its incarnation.
    pub epoch: u64,
    /// Id of the last event the whole snapshot includes.
    pub watermark: u64,
    /// Position of this chunk, from 0.
    pub index: u32,
    /// Chunks in the snapshot.
    pub count: u32,
    /// This chunk's blocks.
    pub blocks: Vec<SnapshotBlock>,
}

/// Bytes per block in a chunk, with margin (tier 1, option 9, block 16 in the unaligned
/// layout), and per chunk for its fixed fields.
const BLOCK_BYTES: usize = 32;
const CHUNK_OVERHEAD: usize = HEADER_LEN + 96;

impl Snapshot {
    /// The snapshot as one batch of `Stored` events (one per block, ids from 1), for an
    /// index that applies events. A device block whose parent is not on the device (evicted
    /// before it, as an LRU that is not leaf-first does) is stored as a root: a router
    /// following the stream live holds it, and the index refuses a device block whose
    /// named parent it does not hold, so a replica that resynced would have lacked it.
    pub fn to_batch(&self) -> EventBatch {
        let on_device: std::collections::HashSet<SeqHash> = self
            .blocks
            .iter()
            .filter(|b| b.tier == Tier::Device)
            .map(|b| b.block.seq)
            .collect();
        EventBatch {
            worker: self.worker,
            dp_rank: self.dp_rank,
            epoch: self.epoch,
            sent_unix_us: 0,
            events: self
                .blocks
                .iter()
                .zip(1..)
                .map(|(b, id)| KvEvent {
                    id,
                    tier: b.tier,
                    data: KvEventData::Stored {
                        parent: b
                            .parent
                            .filter(|p| b.tier != Tier::Device || on_device.contains(p)),
                        blocks: vec![b.block],
                    },
                })
                .collect(),
        }
    }

    /// Encodes the snapshot as chunks of at most `max_payload_bytes` each (at least one).
    pub fn encode(&self, max_payload_bytes: usize) -> Result<Vec<Vec<u8>>, EncodeError> {
        let minimum = CHUNK_OVERHEAD + BLOCK_BYTES;
        if max_payload_bytes < minimum {
            return Err(EncodeError::LimitTooSmall {
                limit: max_payload_bytes,
                minimum,
            });
        }
        let per_chunk = (max_payload_bytes - CHUNK_OVERHEAD) / BLOCK_BYTES;
        let pieces: Vec<&[SnapshotBlock]> = if self.blocks.is_empty() {
            vec![&[]]
        } else {
            self.blocks.chunks(per_chunk).collect()
        };
        let count = pieces.len() as u32;
        pieces
            .into_iter()
            .zip(0..)
            .map(|(blocks, index)| {
                let chunk = SnapshotChunk {
                    worker: self.worker,
                    dp_rank: self.dp_rank,
                    epoch: self.epoch,
                    watermark: self.watermark,
                    index,
                    count,
                    blocks: blocks.to_vec(),
                };
                let mut out = Vec::with_capacity(CHUNK_OVERHEAD + blocks.len() * BLOCK_BYTES);
                out.extend_from_slice(&SNAPSHOT_MAGIC);
                out.push(FORMAT_VERSION);
                let out = rkyv::api::high::to_bytes_in::<_, rancor::Error>(&chunk, out)
                    .map_err(|source| EncodeError::Serialize { source })?;
                if out.len() > max_payload_bytes {
                    return Err(EncodeError::Oversized {
                        len: out.len(),
                        limit: max_payload_bytes,
                    });
                }
                Ok(out)
            })
            .collect()
    }
}

/// Validates a snapshot chunk from the network.
pub fn decode_snapshot_chunk(bytes: &[u8], limits: &Limits) -> Result<SnapshotChunk, DecodeError> {
    let body = body(bytes, SNAPSHOT_MAGIC, limits)?;
    let archived = rkyv::access::<ArchivedSnapshotChunk, rancor::Error>(body)
        .map_err(|source| DecodeError::Malformed { source })?;
    if archived.blocks.len() > limits.max_blocks {
        return Err(DecodeError::TooManyBlocks {
            count: archived.blocks.len(),
            limit: limits.max_blocks,
        });
    }
    let chunk = rkyv::deserialize::<SnapshotChunk, rancor::Error>(archived)
        .map_err(|source| DecodeError::Malformed { source })?;
    if chunk.count == 0 || chunk.index >= chunk.count {
        return Err(DecodeError::BadChunk {
            index: chunk.index,
            count: chunk.count,
        });
    }
    if chunk.watermark == u64::MAX {
        return Err(DecodeError::LastId {
            found: chunk.watermark,
        });
    }
    Ok(chunk)
}

/// Most blocks one snapshot may hold: 2²⁴, far past any rank's G1 and G2 together.
pub const MAX_SNAPSHOT_BLOCKS: usize = 1 << 24;

/// Most chunks one snapshot may come in (a count past it is refused on the first chunk).
pub const MAX_SNAPSHOT_CHUNKS: u32 = 1 << 16;

/// Collects the chunks of one snapshot, in any order, duplicates ignored, up to
/// [`MAX_SNAPSHOT_BLOCKS`] blocks: chunks come from the network.
#[derive(Debug, Default)]
pub struct SnapshotAssembler {
    chunks: BTreeMap<u32, SnapshotChunk>,
    blocks: usize,
}

/// Why chunks do not form one snapshot.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AssembleError {
    /// A chunk disagrees with the first on worker, epoch, watermark or count (and is of no
    /// later epoch, which would start the assembly over).
    #[error("chunk {index} belongs to another snapshot")]
    Mismatch {
        /// The chunk's index.
        index: u32,
    },
    /// More chunks or blocks than a snapshot may have.
    #[error("a snapshot of more than {MAX_SNAPSHOT_CHUNKS} chunks or {MAX_SNAPSHOT_BLOCKS} blocks")]
    TooLarge,
    /// A chunk numbered outside its snapshot's count, or of a snapshot of no chunks.
    #[error("chunk {index} of {count}")]
    BadIndex {
        /// The chunk's index.
        index: u32,
        /// The chunks its snapshot says it has.
        count: u32,
    },
}

impl SnapshotAssembler {
    /// Adds a chunk; returns the whole snapshot once every chunk is in.
    pub fn add(&mut self, chunk: SnapshotChunk) -> Result<Option<Snapshot>, AssembleError> {
        if chunk.index >= chunk.count {
            // Counted towards a whole set, it completed a snapshot with chunks missing.
            return Err(AssembleError::BadIndex {
                index: chunk.index,
                count: chunk.count,
            });
        }
        if let Some(first) = self.chunks.values().next()
            && (first.worker, first.dp_rank) == (chunk.worker, chunk.dp_rank)
            && chunk.epoch > first.epoch
        {
            // A later incarnation's answer (two processes answer under one id while the old
            // one drains): the earlier one's chunks, first in, locked the assembly out of
            // it until the fetch timed out, and the new incarnation stayed unindexed.
            self.chunks.clear();
            self.blocks = 0;
        }
        if let Some(first) = self.chunks.values().next() {
            let same = (
                first.worker,
                first.dp_rank,
                first.epoch,
                first.watermark,
                first.count,
            ) == (
                chunk.worker,
                chunk.dp_rank,
                chunk.epoch,
                chunk.watermark,
                chunk.count,
            );
            if !same {
                return Err(AssembleError::Mismatch { index: chunk.index });
            }
        }
        if chunk.count > MAX_SNAPSHOT_CHUNKS {
            return Err(AssembleError::TooLarge);
        }
        let count = chunk.count as usize;
        if !self.chunks.contains_key(&chunk.index) {
            self.blocks += chunk.blocks.len();
            if self.blocks > MAX_SNAPSHOT_BLOCKS {
                self.chunks.clear();
                self.blocks = 0;
                return Err(AssembleError::TooLarge);
            }
            self.chunks.insert(chunk.index, chunk);
        }
        if self.chunks.len() < count {
            return Ok(None);
        }
        let chunks = std::mem::take(&mut self.chunks);
        self.blocks = 0;
        let first = chunks.values().next().expect("invariant: count > 0 chunks");
        let (worker, dp_rank, epoch, watermark) =
            (first.worker, first.dp_rank, first.epoch, first.watermark);
        let blocks = chunks.into_values().flat_map(|c| c.blocks).collect();
        Ok(Some(Snapshot {
            worker,
            dp_rank,
            epoch,
            watermark,
            blocks,
        }))
    }
}
