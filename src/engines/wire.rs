//! The engines' KV-event payloads (msgpack), decoded as they are, in every shape vLLM and
//! SGLang have published, and encoded in those shapes for the test engine. No I/O.
//!
//! Sources (read, not copied): vLLM `vllm/distributed/kv_events.py` and
//! `tests/v1/core/test_kv_events_contract.py`; SGLang `python/sglang/srt/disaggregation/
//! kv_events.py`. The batch is a positional array `[ts, events, data_parallel_rank?, …]`
//! (`msgspec.Struct(array_like=True, omit_defaults=True)`). An event is either a tagged map
//! (`{"type": "BlockStored", …}`: vLLM since PR #42892, SGLang since PR #37482) or a
//! positional array with the tag first (older releases), where `omit_defaults` drops trailing
//! fields equal to their default:
//! - `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
//!   medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, sliding_window]` (vLLM);
//!   SGLang ends at `medium` or puts a `{cache_salt}` map at position 7;
//! - `["BlockRemoved", block_hashes, medium, group_idx]`;
//! - `["AllBlocksCleared"]`.
//!
//! Hashes are msgpack ints (vLLM: the digest's last 8 bytes as an unsigned 64-bit value, so
//! values above `i64::MAX` occur; SGLang: signed) or bytes (vLLM with
//! `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`: the 32-byte digest). Either becomes an
//! [`EngineHash`]: the engine's name for a block, used only to resolve removals.

use rmpv::ValueRef;

use crate::protocol::Tier;

/// Largest payload accepted (a batch is one engine step's events; a 128 k-token prefill at
/// 16 tokens a block is about 0.5 MiB).
pub const MAX_PAYLOAD_BYTES: usize = 16 << 20;
/// Deepest nesting accepted (events nest four levels; extra keys a few more).
const MAX_DEPTH: usize = 16;
/// Most msgpack values a payload may hold. Each becomes a 32-byte node of the decoded tree,
/// from as little as one byte (a nil, a small int), so this bounds the tree (64 MiB) where
/// the payload limit alone allowed 512 MiB. A 128 k-token prefill is about 140 k values.
pub const MAX_VALUES: usize = 1 << 21;
/// Most events one batch may hold (a batch is one engine step's: a few per request in
/// it). With [`MAX_VALUES`] alone, 2 M nils (2 MB) decoded into 2 M events of 200 B and an
/// error message each, 0.5 GB; a batch is now refused past this, and an event costs 64 B
/// (a store is boxed).
pub const MAX_EVENTS: usize = 1 << 16;
/// Highest `group_idx` accepted (a hybrid model has a handful of KV-cache groups).
pub const MAX_GROUP: u32 = 63;

/// An engine's name for a block: its int hash, or a 64-bit digest of its bytes hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineHash(pub u64);

/// Which memory an engine says a block is in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Medium {
    /// GPU memory (`GPU`, `DEVICE`, or no medium: engines before the field existed).
    Gpu,
    /// Host memory (vLLM `CPU`, SGLang `CPU_PINNED`, `CPU_TIER1`, Mooncake `cpu`).
    Cpu,
    /// Anything else (vLLM `STORAGE`, SGLang `DISK`, `CPU_TIER2`, `EXTERNAL`, connectors'
    /// own names).
    Other(String),
}

impl Medium {
    /// By exact name, any case: a prefix rule once took `CPU_TIER2`, which names storage
    /// below host memory, for host memory.
    pub(crate) fn parse(name: Option<&str>) -> Medium {
        let Some(name) = name else {
            return Medium::Gpu;
        };
        let is = |n: &str| name.eq_ignore_ascii_case(n);
        if is("GPU") || is("DEVICE") {
            Medium::Gpu
        } else if is("CPU") || is("CPU_PINNED") || is("CPU_TIER1") {
            Medium::Cpu
        } else {
            Medium::Other(name.to_owned())
        }
    }

    /// The kvroute tier: GPU → device, CPU → host, a shared or remote pool → remote
    /// (SGLang's `EXTERNAL`, "L4: shared / remote pool (e.g. Mooncake)" in its
    /// `StorageMedium`, python/sglang/srt/disaggregation/kv_events.py; `REMOTE`, `NETWORK`,
    /// `SHARED`), anything else (vLLM's `STORAGE`, SGLang's `DISK`, `CPU_TIER2`, `NVME`:
    /// L3) → disk. `CPU_TIER2` is the tier below host memory: SGLang's L3 ("remote
    /// storage") and the disk tier of NVIDIA Dynamo's block manager, which its router reads
    /// as disk (`StorageTier::from_kv_medium` in ai-dynamo/dynamo's kv-router). Apart, an L3
    /// eviction does not take the router's knowledge of an L4 copy with it.
    pub fn tier(&self) -> Tier {
        match self {
            Medium::Gpu => Tier::Device,
            Medium::Cpu => Tier::Host,
            Medium::Other(name)
                if ["EXTERNAL", "REMOTE", "NETWORK", "SHARED"]
                    .iter()
                    .any(|n| name.eq_ignore_ascii_case(n)) =>
            {
                Tier::Remote
            }
            Medium::Other(_) => Tier::Disk,
        }
    }
}

/// One of a block's extra hash keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExtraKey {
    /// A string (vLLM: the LoRA name, or the request's cache salt on a sequence's first block).
    Str(String),
    /// Anything else (a multimodal `[identifier, offset]`, a prompt-embeds digest), by a
    /// 64-bit digest of its msgpack encoding, so that equal keys are equal (a key of its own
    /// would cost an allocation per value, however small).
    Other(u64),
}

impl ExtraKey {
    fn decode(v: &ValueRef<'_>) -> ExtraKey {
        match as_str(v) {
            Some(s) => ExtraKey::Str(s.to_owned()),
            None => {
                let mut bytes = Vec::new();
                rmpv::encode::write_value_ref(&mut bytes, v)
                    .expect("invariant: writing msgpack to a Vec cannot fail");
                ExtraKey::Other(xxhash_rust::xxh3::xxh3_64(&bytes))
            }
        }
    }
}

/// A `BlockStored` event.
#[derive(Clone, Debug, PartialEq)]
pub struct Stored {
    /// The engine's hashes of the stored blocks, in sequence order.
    pub hashes: Vec<EngineHash>,
    /// The engine's hash of the block before the first one; `None` at a sequence's root.
    pub parent: Option<EngineHash>,
    /// The blocks' tokens, `block_size` each; empty when an offload tier reports a copy.
    pub token_ids: Vec<u32>,
    /// Tokens per block as the engine says (0 with empty `token_ids`).
    pub block_size: u32,
    /// Where the blocks are.
    pub medium: Medium,
    /// LoRA adapter the blocks were computed with.
    pub lora_name: Option<String>,
    /// The adapter's number, which vLLM releases before `lora_name` send alone.
    pub lora_id: Option<i64>,
    /// Per block, the engine's extra hash keys (LoRA name, cache salt, multimodal ids);
    /// empty when the event has none.
    pub extra_keys: Vec<Vec<ExtraKey>>,
    /// SGLang's per-request cache salt.
    pub cache_salt: Option<String>,
    /// KV-cache group of a hybrid model.
    pub group: Option<u32>,
    /// The group's attention kind (`full_attention`, `sliding_window`, `mamba`, …).
    pub spec_kind: Option<String>,
}

/// One engine KV event.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineEvent {
    /// Blocks became resident (boxed: the other events are a quarter of its size).
    Stored(Box<Stored>),
    /// Blocks left a medium.
    Removed {
        /// The engine's hashes.
        hashes: Vec<EngineHash>,
        /// Where they were.
        medium: Medium,
        /// KV-cache group of a hybrid model.
        group: Option<u32>,
    },
    /// The engine's whole cache is gone.
    Cleared,
    /// An event kind kvroute does not know (a fork's, or a newer engine's), by its tag:
    /// skipped, and counted, so that the rest of its batch still applies.
    Other(String),
    /// An event that did not decode (a field of the wrong type, a group past 63), with the
    /// tag it carried, if it had one: the rest of its batch still applies.
    Malformed {
        /// `BlockStored`, `BlockRemoved`…; `None` when the event had no readable tag.
        tag: Option<String>,
        /// Why, for the log.
        error: String,
    },
}

/// One engine step's events.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineBatch {
    /// The engine's clock, seconds.
    pub ts: f64,
    /// The events, in order.
    pub events: Vec<EngineEvent>,
    /// The data-parallel rank that published them.
    pub dp_rank: Option<u32>,
}

/// Why a payload was refused. Nothing of a refused batch is applied.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    /// Over [`MAX_PAYLOAD_BYTES`].
    #[error("payload of {0} bytes is over the {MAX_PAYLOAD_BYTES}-byte limit")]
    TooLarge(usize),
    /// More than [`MAX_VALUES`] msgpack values.
    #[error("payload holds more than {MAX_VALUES} msgpack values")]
    TooManyValues,
    /// Not msgpack, nested too deeply, or bytes left after the value.
    #[error("not a msgpack value: {0}")]
    Msgpack(String),
    /// Msgpack, but not the shape of an engine batch.
    #[error("{0}")]
    Shape(String),
}

fn shape<T>(what: impl Into<String>) -> Result<T, WireError> {
    Err(WireError::Shape(what.into()))
}

/// Decodes one batch payload (the last frame of a ZMQ message).
pub fn decode_batch(payload: &[u8]) -> Result<EngineBatch, WireError> {
    if payload.len() > MAX_PAYLOAD_BYTES {
        return Err(WireError::TooLarge(payload.len()));
    }
    count_values(payload, MAX_VALUES)?;
    let mut rest = payload;
    let value = rmpv::decode::read_value_ref_with_max_depth(&mut rest, MAX_DEPTH)
        .map_err(|e| WireError::Msgpack(e.to_string()))?;
    if !rest.is_empty() {
        return Err(WireError::Msgpack(format!(
            "{} bytes after the batch",
            rest.len()
        )));
    }
    let (ts, events, rank) = match &value {
        ValueRef::Array(fields) => (fields.first(), fields.get(1), fields.get(2)),
        ValueRef::Map(_) => (
            field(&value, "ts"),
            field(&value, "events"),
            field(&value, "data_parallel_rank").or_else(|| field(&value, "attn_dp_rank")),
        ),
        _ => return shape("a batch is an array [ts, events, dp_rank?]"),
    };
    let ts = match ts {
        Some(ValueRef::F64(t)) => *t,
        Some(ValueRef::F32(t)) => f64::from(*t),
        Some(v) => match as_u64(v) {
            Some(t) => t as f64,
            None => return shape("batch ts is not a number"),
        },
        None => return shape("batch has no ts"),
    };
    let Some(ValueRef::Array(list)) = events else {
        return shape("batch events are not an array");
    };
    if list.len() > MAX_EVENTS {
        return shape(format!(
            "batch holds {} events, more than {MAX_EVENTS}",
            list.len()
        ));
    }
    let dp_rank = match rank {
        None | Some(ValueRef::Nil) => None,
        Some(v) => match as_u64(v).and_then(|r| u32::try_from(r).ok()) {
            Some(r) => Some(r),
            None => return shape("batch data_parallel_rank is not a small unsigned int"),
        },
    };
    // One event that does not decode costs only itself: the mirror decides by its kind
    // what losing it means.
    let events = list
        .iter()
        .enumerate()
        .map(|(i, e)| {
            decode_event(e).unwrap_or_else(|error| EngineEvent::Malformed {
                tag: event_tag(e).map(|t| t.chars().take(MAX_TAG_CHARS).collect()),
                error: format!("event {i}: {error}"),
            })
        })
        .collect();
    Ok(EngineBatch {
        ts,
        events,
        dp_rank,
    })
}

/// Walks the first msgpack value of `payload` without building it, refusing it past `limit`
/// values (containers and their elements each count). Linear in the bytes walked; what it
/// lets through, [`rmpv`] reads again and checks fully.
fn count_values(payload: &[u8], limit: usize) -> Result<(), WireError> {
    use rmp::Marker;
    let truncated = || WireError::Msgpack("truncated payload".into());
    let mut rest = payload;
    // Values still to walk (an array of n adds n, a map of n adds 2n).
    let mut pending: u64 = 1;
    let mut seen = 0usize;
    // A length of `n` bytes after the marker, big-endian.
    let length = |rest: &mut &[u8], n: usize| -> Result<u64, WireError> {
        let (bytes, tail) = rest.split_at_checked(n).ok_or_else(truncated)?;
        *rest = tail;
        Ok(bytes.iter().fold(0u64, |l, b| l << 8 | u64::from(*b)))
    };
    while pending > 0 {
        pending -= 1;
        seen += 1;
        if seen > limit {
            return Err(WireError::TooManyValues);
        }
        let (&first, tail) = rest.split_first().ok_or_else(truncated)?;
        rest = tail;
        let skip = match Marker::from_u8(first) {
            Marker::FixPos(_) | Marker::FixNeg(_) | Marker::Null | Marker::True => 0,
            Marker::False => 0,
            Marker::U8 | Marker::I8 => 1,
            Marker::U16 | Marker::I16 => 2,
            Marker::U32 | Marker::I32 | Marker::F32 => 4,
            Marker::U64 | Marker::I64 | Marker::F64 => 8,
            Marker::FixStr(n) => u64::from(n),
            Marker::Str8 | Marker::Bin8 => length(&mut rest, 1)?,
            Marker::Str16 | Marker::Bin16 => length(&mut rest, 2)?,
            Marker::Str32 | Marker::Bin32 => length(&mut rest, 4)?,
            Marker::FixExt1 => 2,
            Marker::FixExt2 => 3,
            Marker::FixExt4 => 5,
            Marker::FixExt8 => 9,
            Marker::FixExt16 => 17,
            Marker::Ext8 => length(&mut rest, 1)? + 1,
            Marker::Ext16 => length(&mut rest, 2)? + 1,
            Marker::Ext32 => length(&mut rest, 4)? + 1,
            Marker::FixArray(n) => {
                pending += u64::from(n);
                0
            }
            Marker::Array16 => {
                pending += length(&mut rest, 2)?;
                0
            }
            Marker::Array32 => {
                pending += length(&mut rest, 4)?;
                0
            }
            Marker::FixMap(n) => {
                pending += 2 * u64::from(n);
                0
            }
            Marker::Map16 => {
                pending += 2 * length(&mut rest, 2)?;
                0
            }
            Marker::Map32 => {
                pending += 2 * length(&mut rest, 4)?;
                0
            }
            Marker::Reserved => {
                return Err(WireError::Msgpack("reserved msgpack marker 0xc1".into()));
            }
        };
        let skip = usize::try_from(skip).map_err(|_| truncated())?;
        rest = rest.get(skip..).ok_or_else(truncated)?;
    }
    Ok(())
}

/// An event's fields by name, whichever shape it came in.
struct Fields<'v, 'a> {
    value: &'v ValueRef<'a>,
    /// Positional names after the tag, for the array shape.
    positions: &'static [&'static str],
}

impl<'v, 'a> Fields<'v, 'a> {
    fn get(&self, name: &str) -> Option<&'v ValueRef<'a>> {
        match self.value {
            ValueRef::Array(items) => {
                let at = self.positions.iter().position(|p| *p == name)?;
                items.get(at + 1).filter(|v| !matches!(v, ValueRef::Nil))
            }
            _ => field(self.value, name).filter(|v| !matches!(v, ValueRef::Nil)),
        }
    }
}

const STORED_POSITIONS: &[&str] = &[
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
];
const REMOVED_POSITIONS: &[&str] = &["block_hashes", "medium", "group_idx"];

/// The longest tag kept of an unknown event (for the log).
const MAX_TAG_CHARS: usize = 64;

/// An event's kind: the first element of an array, or a map's `type`.
fn event_tag<'a>(value: &'a ValueRef<'_>) -> Option<&'a str> {
    match value {
        ValueRef::Array(items) => items.first().and_then(as_str),
        ValueRef::Map(_) => field(value, "type").and_then(as_str),
        _ => None,
    }
}

fn decode_event(value: &ValueRef<'_>) -> Result<EngineEvent, String> {
    let tag = event_tag(value).ok_or("an event is a tagged map or an array with its tag first")?;
    match tag {
        "BlockStored" => decode_stored(value).map(|s| EngineEvent::Stored(Box::new(s))),
        "BlockRemoved" => {
            let f = Fields {
                value,
                positions: REMOVED_POSITIONS,
            };
            Ok(EngineEvent::Removed {
                hashes: hashes(f.get("block_hashes"))?,
                medium: Medium::parse(opt_str(f.get("medium"), "medium")?),
                group: group(f.get("group_idx"))?,
            })
        }
        "AllBlocksCleared" => Ok(EngineEvent::Cleared),
        // vLLM's contract (tests/v1/core/test_kv_events_contract.py) promises decoders
        // tolerance of new fields, not of new kinds; forks publish kinds of their own in
        // the same batches. Refusing the batch would drop the engine's whole mirror for
        // each one.
        other => Ok(EngineEvent::Other(
            other.chars().take(MAX_TAG_CHARS).collect(),
        )),
    }
}

fn decode_stored(value: &ValueRef<'_>) -> Result<Stored, String> {
    let f = Fields {
        value,
        positions: STORED_POSITIONS,
    };
    // A token is a u32; SGLang with EAGLE speculative decoding keys its radix tree by
    // bigrams and publishes each position as the pair (token, next token)
    // (`convert_to_bigram_key`, and `record_store` in python/sglang/srt/mem_cache/events.py):
    // the page's own tokens are the pairs' first elements.
    let token = |t: &ValueRef<'_>| match t {
        ValueRef::Array(pair) if pair.len() == 2 => pair.first().and_then(as_u64),
        t => as_u64(t),
    };
    let token_ids = match f.get("token_ids") {
        None => Vec::new(),
        Some(ValueRef::Array(ts)) => ts
            .iter()
            .map(|t| token(t).and_then(|t| u32::try_from(t).ok()))
            .collect::<Option<Vec<u32>>>()
            .ok_or("token_ids holds a value that is not a u32 (or a bigram of them)")?,
        Some(_) => return Err("token_ids is not an array".into()),
    };
    let lora_id = match f.get("lora_id") {
        None => None,
        Some(ValueRef::Integer(i)) => i.as_i64(),
        Some(_) => return Err("lora_id is not an integer".into()),
    };
    let block_size = match f.get("block_size") {
        None => 0,
        Some(v) => as_u64(v)
            .and_then(|b| u32::try_from(b).ok())
            .ok_or("block_size is not a u32")?,
    };
    // SGLang (0.5.18 to PR #37482) put a metadata map where vLLM has lora_name.
    let (lora_name, mut cache_salt) = match f.get("lora_name") {
        Some(meta @ ValueRef::Map(_)) => (None, field(meta, "cache_salt").and_then(as_str)),
        v => (opt_str(v, "lora_name")?, None),
    };
    if let Some(salt) = field(value, "cache_salt").and_then(as_str) {
        cache_salt = Some(salt);
    }
    let extra_keys = match f.get("extra_keys") {
        None => Vec::new(),
        Some(ValueRef::Array(keys)) => keys
            .iter()
            .map(|k| match k {
                ValueRef::Nil => Vec::new(),
                ValueRef::Array(items) => items.iter().map(ExtraKey::decode).collect(),
                one => vec![ExtraKey::decode(one)],
            })
            .collect(),
        Some(_) => return Err("extra_keys is not an array".into()),
    };
    Ok(Stored {
        hashes: hashes(f.get("block_hashes"))?,
        parent: f.get("parent_block_hash").map(hash).transpose()?,
        token_ids,
        block_size,
        medium: Medium::parse(opt_str(f.get("medium"), "medium")?),
        lora_name: lora_name.map(str::to_owned),
        lora_id,
        extra_keys,
        cache_salt: cache_salt.map(str::to_owned),
        group: group(f.get("group_idx"))?,
        spec_kind: opt_str(f.get("kv_cache_spec_kind"), "kv_cache_spec_kind")?.map(str::to_owned),
    })
}

fn field<'v, 'a>(map: &'v ValueRef<'a>, name: &str) -> Option<&'v ValueRef<'a>> {
    let ValueRef::Map(entries) = map else {
        return None;
    };
    entries
        .iter()
        .find(|(k, _)| as_str(k) == Some(name))
        .map(|(_, v)| v)
}

fn as_str<'a>(v: &ValueRef<'a>) -> Option<&'a str> {
    match v {
        ValueRef::String(s) => s.into_str(),
        _ => None,
    }
}

fn opt_str<'a>(v: Option<&ValueRef<'a>>, what: &str) -> Result<Option<&'a str>, String> {
    match v {
        None => Ok(None),
        Some(v) => as_str(v)
            .map(Some)
            .ok_or_else(|| format!("{what} is not a string")),
    }
}

fn as_u64(v: &ValueRef<'_>) -> Option<u64> {
    match v {
        ValueRef::Integer(i) => i.as_u64(),
        _ => None,
    }
}

fn group(v: Option<&ValueRef<'_>>) -> Result<Option<u32>, String> {
    match v {
        None => Ok(None),
        Some(v) => match as_u64(v).and_then(|g| u32::try_from(g).ok()) {
            Some(g) if g <= MAX_GROUP => Ok(Some(g)),
            _ => Err(format!("group_idx is not an int in 0..={MAX_GROUP}")),
        },
    }
}

fn hash(v: &ValueRef<'_>) -> Result<EngineHash, String> {
    match v {
        // Signed (SGLang) and unsigned (vLLM) 64-bit ints, as their bit pattern.
        ValueRef::Integer(i) => i
            .as_u64()
            .or_else(|| i.as_i64().map(|i| i as u64))
            .map(EngineHash)
            .ok_or_else(|| "a block hash is out of 64-bit range".into()),
        // A digest sent as bytes: the int vLLM sends for it otherwise, the digest as a
        // big-endian int masked to 64 bits (`maybe_convert_block_hash`,
        // vllm/v1/core/kv_cache_utils.py), so that the two forms name a block alike. A
        // stream can mix them: vLLM's offloading connector sent its CPU stores' hashes as
        // bytes (before it converted them too) while the GPU's went as ints, and its
        // token-less CPU stores resolve only through the GPU's names.
        ValueRef::Binary(b) if !b.is_empty() => Ok(EngineHash(
            b.iter().fold(0u64, |acc, &byte| acc << 8 | u64::from(byte)),
        )),
        _ => Err("a block hash is neither an int nor bytes".into()),
    }
}

fn hashes(v: Option<&ValueRef<'_>>) -> Result<Vec<EngineHash>, String> {
    match v {
        Some(ValueRef::Array(hs)) => hs.iter().map(hash).collect(),
        _ => Err("block_hashes is not an array".into()),
    }
}

// ---- encoding (the test engine, and tests) ------------------------------------------------

/// How an encoder writes events and hashes: the variations engines in the field use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Encoding {
    /// Tagged maps (vLLM ≥ 0.26) rather than positional arrays.
    pub tagged_maps: bool,
    /// Hashes as 32-byte strings rather than ints.
    pub bytes_hashes: bool,
    /// Int hashes as signed 64-bit (SGLang) rather than unsigned (vLLM).
    pub signed_hashes: bool,
}

/// A hash in an engine's form: `raw` is the engine's 64-bit value (unsigned ints above
/// `i64::MAX` are written as msgpack uint64, as vLLM does); a bytes hash is a 32-byte
/// digest whose last 8 bytes are `raw`, big-endian, as vLLM's int form of a digest is.
fn write_hash(out: &mut Vec<u8>, raw: u64, encoding: Encoding) {
    if encoding.bytes_hashes {
        rmp::encode::write_bin(out, &hash_bytes(raw))
    } else if encoding.signed_hashes {
        rmp::encode::write_sint(out, raw as i64).map(|_| ())
    } else {
        rmp_write_u64(out, raw)
    }
    .expect("invariant: writing msgpack to a Vec cannot fail");
}

fn hash_bytes(raw: u64) -> [u8; 32] {
    let mut b = [0u8; 32];
    for (i, chunk) in b[..24].chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&raw.rotate_left(i as u32 * 16 + 16).to_be_bytes());
    }
    b[24..].copy_from_slice(&raw.to_be_bytes());
    b
}

/// Writes `v` in msgpack's smallest int form, as msgspec does (uint64 above `i64::MAX`).
fn rmp_write_u64(out: &mut Vec<u8>, v: u64) -> Result<(), rmp::encode::ValueWriteError> {
    rmp::encode::write_uint(out, v).map(|_| ())
}

fn ok<T, E: std::fmt::Debug>(r: Result<T, E>) {
    r.expect("invariant: writing msgpack to a Vec cannot fail");
}

/// An event to encode, with raw 64-bit hashes.
#[derive(Clone, Debug, PartialEq)]
pub enum RawEvent {
    /// `BlockStored`.
    Stored {
        /// Raw hashes of the blocks.
        hashes: Vec<u64>,
        /// Raw hash of the parent.
        parent: Option<u64>,
        /// Tokens (empty for an offload-tier copy).
        token_ids: Vec<u32>,
        /// Tokens per block (0 with empty tokens).
        block_size: u32,
        /// `GPU`, `CPU`, `CPU_PINNED`, …
        medium: String,
        /// LoRA adapter.
        lora_name: Option<String>,
        /// Per block, its extra keys as strings (empty: none); empty for none at all.
        extra_keys: Vec<Vec<String>>,
    },
    /// `BlockRemoved`.
    Removed {
        /// Raw hashes.
        hashes: Vec<u64>,
        /// Where from.
        medium: String,
    },
    /// `AllBlocksCleared`.
    Cleared,
}

/// Encodes a batch as an engine would: `[ts, events, dp_rank]`, events in `encoding`'s
/// shape with every field present (positional events carry defaults too, as msgspec writes
/// them when a later field is set).
pub fn encode_batch(ts: f64, events: &[RawEvent], dp_rank: u32, encoding: Encoding) -> Vec<u8> {
    use rmp::encode as w;
    let mut out = Vec::new();
    ok(w::write_array_len(&mut out, 3));
    ok(w::write_f64(&mut out, ts));
    ok(w::write_array_len(&mut out, events.len() as u32));
    for e in events {
        let (tag, fields): (&str, usize) = match e {
            RawEvent::Stored { .. } => ("BlockStored", 8),
            RawEvent::Removed { .. } => ("BlockRemoved", 2),
            RawEvent::Cleared => ("AllBlocksCleared", 0),
        };
        let key = |out: &mut Vec<u8>, name: &str| {
            if encoding.tagged_maps {
                ok(w::write_str(out, name));
            }
        };
        if encoding.tagged_maps {
            ok(w::write_map_len(&mut out, fields as u32 + 1));
            ok(w::write_str(&mut out, "type"));
        } else {
            ok(w::write_array_len(&mut out, fields as u32 + 1));
        }
        ok(w::write_str(&mut out, tag));
        let hash_list = |out: &mut Vec<u8>, hs: &[u64]| {
            ok(w::write_array_len(out, hs.len() as u32));
            for h in hs {
                write_hash(out, *h, encoding);
            }
        };
        match e {
            RawEvent::Stored {
                hashes,
                parent,
                token_ids,
                block_size,
                medium,
                lora_name,
                extra_keys,
            } => {
                key(&mut out, "block_hashes");
                hash_list(&mut out, hashes);
                key(&mut out, "parent_block_hash");
                match parent {
                    Some(p) => write_hash(&mut out, *p, encoding),
                    None => ok(w::write_nil(&mut out)),
                }
                key(&mut out, "token_ids");
                ok(w::write_array_len(&mut out, token_ids.len() as u32));
                for t in token_ids {
                    ok(rmp_write_u64(&mut out, u64::from(*t)));
                }
                key(&mut out, "block_size");
                ok(rmp_write_u64(&mut out, u64::from(*block_size)));
                key(&mut out, "lora_id");
                ok(w::write_nil(&mut out));
                key(&mut out, "medium");
                ok(w::write_str(&mut out, medium));
                key(&mut out, "lora_name");
                match lora_name {
                    Some(n) => ok(w::write_str(&mut out, n)),
                    None => ok(w::write_nil(&mut out)),
                }
                key(&mut out, "extra_keys");
                if extra_keys.is_empty() {
                    ok(w::write_nil(&mut out));
                } else {
                    ok(w::write_array_len(&mut out, extra_keys.len() as u32));
                    for keys in extra_keys {
                        if keys.is_empty() {
                            ok(w::write_nil(&mut out));
                            continue;
                        }
                        ok(w::write_array_len(&mut out, keys.len() as u32));
                        for k in keys {
                            ok(w::write_str(&mut out, k));
                        }
                    }
                }
            }
            RawEvent::Removed { hashes, medium } => {
                key(&mut out, "block_hashes");
                hash_list(&mut out, hashes);
                key(&mut out, "medium");
                ok(w::write_str(&mut out, medium));
            }
            RawEvent::Cleared => {}
        }
    }
    ok(rmp_write_u64(&mut out, u64::from(dp_rank)));
    out
}

#[cfg(test)]
mod tests;
