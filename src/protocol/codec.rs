//! Wire format of an `EventBatch`: a 4-byte header (magic `KVR` + format version) followed by
//! an rkyv 0.8 archive in little-endian, unaligned layout, so a payload can be validated and
//! read in place wherever it lands in a network buffer. Decoding never trusts the bytes:
//! bytecheck validates the archive, then lengths are capped and ids checked before anything is
//! allocated for the caller.

use rkyv::rancor;

use super::events::{ArchivedEventBatch, ArchivedKvEventData};
use super::{EventBatch, KvEventData};

/// First three header bytes of every payload.
pub const MAGIC: [u8; 3] = *b"KVR";
/// Archive layout version carried in the fourth header byte.
pub const FORMAT_VERSION: u8 = 1;
/// Header length in bytes.
pub const HEADER_LEN: usize = 4;

/// Upper bounds of the archive's size, used to cut batches before encoding. Checked against
/// real encodings in tests (`size_model_is_an_upper_bound`): the archive of a batch is a
/// 36-byte root, 27 bytes per event, 16 per stored and 8 per removed block, with no padding
/// in the unaligned layout. The margins absorb a change of layout without silent overflow.
const BATCH_OVERHEAD: usize = HEADER_LEN + 64;
const EVENT_OVERHEAD: usize = 48;
const STORED_BLOCK_BYTES: usize = 16;
const REMOVED_BLOCK_BYTES: usize = 8;

/// Caps applied to payloads from the network, and the size encoders split under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest payload accepted or produced, header included, in bytes. NATS' default
    /// `max_payload` is 1 MiB.
    pub max_payload_bytes: usize,
    /// Most events one batch may carry.
    pub max_events: usize,
    /// Most blocks all events of one batch may name together.
    pub max_blocks: usize,
}

impl Default for Limits {
    /// For NATS' default `max_payload` of 1 MiB: 65,536 events, 131,072 blocks.
    fn default() -> Self {
        Limits::for_payload(1 << 20)
    }
}

impl Limits {
    /// Caps for payloads of up to `max_payload_bytes`: the counts grow with the bytes (an
    /// event takes at least 16 of them, a block at least 8), so whatever an encoder fits in
    /// a payload of that size decodes, and what a payload may hold stays in proportion to
    /// its bytes. A server whose `max_payload` is above 1 MiB lets a worker send more
    /// blocks in one message (a snapshot's chunk is cut by bytes alone): fixed counts
    /// refused those chunks, and the resync asking for them never ended.
    pub fn for_payload(max_payload_bytes: usize) -> Limits {
        Limits {
            max_payload_bytes,
            max_events: max_payload_bytes / 16,
            max_blocks: max_payload_bytes / 8,
        }
    }
}

/// The smallest payload that holds one event of `blocks` stored blocks (by the encoder's
/// size model), what a NATS server's `max_payload` must allow for a worker that writes
/// events of up to that many blocks.
pub fn payload_for_event(blocks: usize) -> usize {
    BATCH_OVERHEAD + EVENT_OVERHEAD + blocks * STORED_BLOCK_BYTES
}

/// Why bytes from the network are not a usable `EventBatch`.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// Fewer bytes than the header.
    #[error("payload of {len} bytes is shorter than the {HEADER_LEN}-byte header")]
    Truncated {
        /// Payload length.
        len: usize,
    },
    /// The payload exceeds `Limits::max_payload_bytes`.
    #[error("payload of {len} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        /// Payload length.
        len: usize,
        /// The configured limit.
        limit: usize,
    },
    /// The first three bytes are not the magic of the expected payload kind (`KVR` for
    /// event batches, `KVS` for snapshot chunks).
    #[error("bad magic {found:02x?}")]
    BadMagic {
        /// The bytes found.
        found: [u8; 3],
    },
    /// A format version this build does not read.
    #[error("unsupported format version {found} (this build reads {FORMAT_VERSION})")]
    UnsupportedVersion {
        /// The version byte found.
        found: u8,
    },
    /// The archive failed validation (out-of-bounds pointer, invalid enum tag, …).
    #[error("malformed archive: {source}")]
    Malformed {
        /// What bytecheck found.
        #[source]
        source: rancor::Error,
    },
    /// More events than `Limits::max_events`.
    #[error("{count} events exceed the limit of {limit}")]
    TooManyEvents {
        /// Events in the batch.
        count: usize,
        /// The configured limit.
        limit: usize,
    },
    /// More blocks than `Limits::max_blocks`.
    #[error("{count} blocks exceed the limit of {limit}")]
    TooManyBlocks {
        /// Blocks named by the batch.
        count: usize,
        /// The configured limit.
        limit: usize,
    },
    /// A snapshot chunk's index is not below its count.
    #[error("snapshot chunk {index} of {count}")]
    BadChunk {
        /// The chunk's index.
        index: u32,
        /// Chunks announced.
        count: u32,
    },
    /// Event ids do not start at 1 or more and ascend by one.
    #[error("event id {found} where {expected} was expected")]
    BadEventId {
        /// The id found.
        found: u64,
        /// The id the sequence required.
        expected: u64,
    },
    /// An event id or a snapshot's watermark of `u64::MAX`: no id could follow it.
    #[error("event id or watermark {found} leaves no id after it")]
    LastId {
        /// The id or watermark.
        found: u64,
    },
}

/// Why a batch could not be encoded.
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    /// The payload limit cannot hold even one block.
    #[error("payload limit of {limit} bytes is below the minimum of {minimum}")]
    LimitTooSmall {
        /// The requested limit.
        limit: usize,
        /// The smallest workable limit.
        minimum: usize,
    },
    /// One event is larger than a payload may be: events are never cut, since a piece
    /// would need an id of its own and every later id would move under its writer.
    #[error(
        "event {id} takes {bytes} bytes, more than the payload limit of {limit} (raise the NATS server's max_payload)"
    )]
    EventTooLarge {
        /// The event's id.
        id: u64,
        /// Its size by the encoder's model, with a batch's overhead.
        bytes: usize,
        /// The limit.
        limit: usize,
    },
    /// A split batch still encoded larger than the limit (a bug in the size model).
    #[error("encoded batch of {len} bytes exceeds the limit of {limit}")]
    Oversized {
        /// Encoded length.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// rkyv failed to serialize.
    #[error("serialization failed: {source}")]
    Serialize {
        /// The serializer's error.
        #[source]
        source: rancor::Error,
    },
}

/// Encodes one batch as it is, header included, whatever its size.
pub fn encode(batch: &EventBatch) -> Result<Vec<u8>, EncodeError> {
    let mut out = Vec::with_capacity(encoded_len_bound(batch));
    out.extend_from_slice(&MAGIC);
    out.push(FORMAT_VERSION);
    rkyv::api::high::to_bytes_in::<_, rancor::Error>(batch, out)
        .map_err(|source| EncodeError::Serialize { source })
}

/// Splits `batch` into batches that each encode within `max_payload_bytes` and encodes them
/// (see [`split_batch`]).
pub fn encode_split(
    batch: &EventBatch,
    max_payload_bytes: usize,
) -> Result<Vec<Vec<u8>>, EncodeError> {
    split_batch(batch, max_payload_bytes)?
        .iter()
        .map(|part| {
            let bytes = encode(part)?;
            if bytes.len() > max_payload_bytes {
                return Err(EncodeError::Oversized {
                    len: bytes.len(),
                    limit: max_payload_bytes,
                });
            }
            Ok(bytes)
        })
        .collect()
}

/// Cuts `batch` into consecutive batches that each encode within `max_payload_bytes`,
/// events whole and in order, with their ids. An empty batch comes back as one empty batch.
/// An event too large for one payload is an error ([`EncodeError::EventTooLarge`]): cutting
/// it would take ids its writer has already given to the events after it (those would then
/// be read as duplicates and dropped, with no gap to show it). Writers cap their events'
/// blocks ([`payload_for_event`] says what payload that needs).
pub fn split_batch(
    batch: &EventBatch,
    max_payload_bytes: usize,
) -> Result<Vec<EventBatch>, EncodeError> {
    let minimum = payload_for_event(1);
    if max_payload_bytes < minimum {
        return Err(EncodeError::LimitTooSmall {
            limit: max_payload_bytes,
            minimum,
        });
    }
    let budget = max_payload_bytes - BATCH_OVERHEAD;
    let shell = || EventBatch {
        events: Vec::new(),
        ..batch.clone_header()
    };
    let mut out = Vec::new();
    let mut current = shell();
    let mut used = 0;
    for event in &batch.events {
        let cost = EVENT_OVERHEAD + data_bytes(&event.data);
        if cost > budget {
            return Err(EncodeError::EventTooLarge {
                id: event.id,
                bytes: BATCH_OVERHEAD + cost,
                limit: max_payload_bytes,
            });
        }
        if used + cost > budget && !current.events.is_empty() {
            out.push(std::mem::replace(&mut current, shell()));
            used = 0;
        }
        current.events.push(event.clone());
        used += cost;
    }
    if !current.events.is_empty() || out.is_empty() {
        out.push(current);
    }
    Ok(out)
}

fn data_bytes(data: &KvEventData) -> usize {
    match data {
        KvEventData::Stored { blocks, .. } => blocks.len() * STORED_BLOCK_BYTES,
        KvEventData::Removed { blocks } => blocks.len() * REMOVED_BLOCK_BYTES,
        KvEventData::Cleared => 0,
    }
}

/// An upper bound of `encode(batch).len()`.
fn encoded_len_bound(batch: &EventBatch) -> usize {
    BATCH_OVERHEAD
        + batch
            .events
            .iter()
            .map(|e| EVENT_OVERHEAD + data_bytes(&e.data))
            .sum::<usize>()
}

/// Validates a payload from the network and returns the batch it carries.
///
/// Checks, in order: size limit, header, archive validity (bytecheck), event and block
/// counts, and that ids start at 1 or more and ascend by one. Nothing is allocated for the
/// result until all checks pass, and the allocation is bounded by the payload's size.
pub fn decode(bytes: &[u8], limits: &Limits) -> Result<EventBatch, DecodeError> {
    let archived = access(bytes, limits)?;
    rkyv::deserialize::<EventBatch, rancor::Error>(archived)
        .map_err(|source| DecodeError::Malformed { source })
}

/// Checks size and header (`magic` + [`FORMAT_VERSION`]) and returns the archive after it.
pub(crate) fn body<'a>(
    bytes: &'a [u8],
    magic: [u8; 3],
    limits: &Limits,
) -> Result<&'a [u8], DecodeError> {
    if bytes.len() > limits.max_payload_bytes {
        return Err(DecodeError::TooLarge {
            len: bytes.len(),
            limit: limits.max_payload_bytes,
        });
    }
    let Some((header, body)) = bytes.split_first_chunk::<HEADER_LEN>() else {
        return Err(DecodeError::Truncated { len: bytes.len() });
    };
    let [m0, m1, m2, version] = *header;
    if [m0, m1, m2] != magic {
        return Err(DecodeError::BadMagic {
            found: [m0, m1, m2],
        });
    }
    if version != FORMAT_VERSION {
        return Err(DecodeError::UnsupportedVersion { found: version });
    }
    Ok(body)
}

fn access<'a>(bytes: &'a [u8], limits: &Limits) -> Result<&'a ArchivedEventBatch, DecodeError> {
    let body = body(bytes, MAGIC, limits)?;
    let archived = rkyv::access::<ArchivedEventBatch, rancor::Error>(body)
        .map_err(|source| DecodeError::Malformed { source })?;
    let events = &archived.events;
    if events.len() > limits.max_events {
        return Err(DecodeError::TooManyEvents {
            count: events.len(),
            limit: limits.max_events,
        });
    }
    let mut blocks = 0usize;
    let mut previous: Option<u64> = None;
    for event in events.iter() {
        let id = event.id.to_native();
        // The first id may be anything from 1 on; each later one must follow its predecessor.
        let expected = match previous {
            None => id.max(1),
            Some(previous) => previous.saturating_add(1),
        };
        if id != expected || previous == Some(u64::MAX) {
            return Err(DecodeError::BadEventId {
                found: id,
                expected,
            });
        }
        if id == u64::MAX {
            return Err(DecodeError::LastId { found: id });
        }
        previous = Some(id);
        blocks += match &event.data {
            ArchivedKvEventData::Stored { blocks, .. } => blocks.len(),
            ArchivedKvEventData::Removed { blocks } => blocks.len(),
            ArchivedKvEventData::Cleared => 0,
        };
    }
    if blocks > limits.max_blocks {
        return Err(DecodeError::TooManyBlocks {
            count: blocks,
            limit: limits.max_blocks,
        });
    }
    Ok(archived)
}

impl EventBatch {
    /// A copy of the batch's header (worker, rank, epoch, send time) with no events.
    fn clone_header(&self) -> EventBatch {
        EventBatch {
            worker: self.worker,
            dp_rank: self.dp_rank,
            epoch: self.epoch,
            sent_unix_us: self.sent_unix_us,
            events: Vec::new(),
        }
    }
}
