//! Mooncake-format request traces (DESIGN §10) and the token ids synthesised for them.

use std::io::BufRead;
use std::num::NonZeroUsize;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, bail};
use kvroute::protocol::{BlockHash, LocalHash, Salt, SeqHash, extend_blocks, seq_hash};
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

mod formats;

pub use formats::{Loaded, TraceArgs, TraceFormat, load_any};

/// One request of a Mooncake JSONL trace.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
pub struct TraceRecord {
    /// Arrival, ms since the trace start.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: usize,
    /// Output tokens.
    pub output_length: usize,
    /// One id per trace block of the prompt; equal ids at a position mean equal prefixes.
    pub hash_ids: Vec<u64>,
    /// kvroute's extensions, all optional. The tenant that sends the request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Its priority band (higher first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    /// The conversation it is a turn of: a session's turns are replayed closed-loop, each
    /// sent `think_ms` after the previous one finished (`timestamp` is then the first
    /// turn's arrival only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    /// Think time before this turn, after the previous turn of its session finished, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub think_ms: Option<u64>,
    /// The prompt's own tokens, for traces that carry text (OpenAI requests); `hash_ids` is
    /// then empty.
    #[serde(skip)]
    pub tokens: Option<std::sync::Arc<[u32]>>,
}

/// `path` as given, or, when it is relative and not there, relative to the repository this
/// binary was built from (the default `bench/traces/…` then works from any directory).
pub fn locate(path: &Path) -> std::path::PathBuf {
    if path.is_relative() && !path.exists() {
        let beside = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path);
        if beside.exists() {
            return beside;
        }
    }
    path.to_path_buf()
}

/// The records `parse` makes of `path`'s non-blank lines (given with their `file:line`
/// and the records so far; `None` skips a line), until there are `limit` of them.
fn read_records(
    path: &Path,
    limit: Option<usize>,
    mut parse: impl FnMut(&str, &str, &[TraceRecord]) -> anyhow::Result<Option<TraceRecord>>,
) -> anyhow::Result<Vec<TraceRecord>> {
    let file =
        std::fs::File::open(path).with_context(|| format!("opening trace {}", path.display()))?;
    let mut records = Vec::new();
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        if limit.is_some_and(|l| records.len() >= l) {
            break;
        }
        let line = line.with_context(|| format!("reading {}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let at = format!("{}:{}", path.display(), n + 1);
        if let Some(record) = parse(&at, &line, &records)? {
            records.push(record);
        }
    }
    Ok(records)
}

/// Reads a trace, the first `limit` requests if given, checking that each record's hash ids
/// cover its prompt at `block_size` tokens per id.
pub fn load(
    path: &Path,
    limit: Option<usize>,
    block_size: usize,
) -> anyhow::Result<Vec<TraceRecord>> {
    read_records(&locate(path), limit, |at, line, _| {
        let record: TraceRecord = serde_json::from_str(line)
            .with_context(|| format!("{at}: not a Mooncake trace record"))?;
        if record.input_length > record.hash_ids.len() * block_size {
            bail!(
                "{at}: {} hash ids of {block_size} tokens cannot cover {} input tokens",
                record.hash_ids.len(),
                record.input_length
            );
        }
        Ok(Some(record))
    })
}

/// Flags of `kvroute-bench agent-trace`.
#[derive(clap::Args, Debug, Clone)]
pub struct AgentArgs {
    /// Where to write the JSONL.
    #[arg(long)]
    pub out: std::path::PathBuf,
    /// Sessions (conversations).
    #[arg(long, default_value_t = 96)]
    pub sessions: usize,
    /// Fewest turns of a session.
    #[arg(long, default_value_t = 10)]
    pub min_turns: usize,
    /// Most turns of a session.
    #[arg(long, default_value_t = 40)]
    pub max_turns: usize,
    /// Sessions start uniformly over this window, ms.
    #[arg(long, default_value_t = 120_000)]
    pub start_window_ms: u64,
    /// Think time between a turn's answer and the next turn, uniform in MIN..=MAX ms.
    #[arg(long, default_value_t = 2_000)]
    pub min_think_ms: u64,
    /// See --min-think-ms.
    #[arg(long, default_value_t = 8_000)]
    pub max_think_ms: u64,
    /// Trace blocks (512 tokens) of the system prompt every session shares.
    #[arg(long, default_value_t = 8)]
    pub system_blocks: u64,
    /// Seed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// A paced agent-style trace (512 tokens per hash id): every session starts with the same
/// system prompt; each turn's prompt is the whole conversation so far (the previous
/// answer, one block, and the new message, one block, appended to the last prompt); each
/// turn waits for the previous one and a think time. Sessions interleave in the output by
/// their start, their turns in order.
pub fn agent_sessions(args: &AgentArgs) -> Vec<TraceRecord> {
    let mut state = args.seed;
    let mut next = move |n: u64| {
        state = mix(state);
        state % n.max(1)
    };
    let mut fresh_id = args.system_blocks;
    let mut sessions: Vec<(u64, Vec<TraceRecord>)> = Vec::with_capacity(args.sessions);
    for s in 0..args.sessions {
        let start = next(args.start_window_ms.max(1));
        let span = (args.max_turns.max(args.min_turns) - args.min_turns) as u64 + 1;
        let turns = args.min_turns + next(span) as usize;
        let mut ids: Vec<u64> = (0..args.system_blocks).collect();
        let mut records = Vec::with_capacity(turns);
        for turn in 0..turns {
            if turn > 0 {
                ids.push(fresh_id); // the previous answer
                fresh_id += 1;
            }
            ids.push(fresh_id); // the new message
            fresh_id += 1;
            let think =
                args.min_think_ms + next(args.max_think_ms.saturating_sub(args.min_think_ms) + 1);
            records.push(TraceRecord {
                timestamp: start,
                input_length: ids.len() * 512 - next(256) as usize,
                output_length: 100 + next(300) as usize,
                hash_ids: ids.clone(),
                tenant: None,
                priority: None,
                session_id: Some(format!("s{s}")),
                think_ms: (turn > 0).then_some(think),
                tokens: None,
            });
        }
        sessions.push((start, records));
    }
    sessions.sort_by_key(|(start, _)| *start);
    sessions.into_iter().flat_map(|(_, r)| r).collect()
}

/// Vocabulary the synthetic token ids are drawn from (a Llama-3-sized one).
pub const VOCAB: u64 = 128_000;

/// The prompt of a record: `block_size` tokens per hash id, each a deterministic function of
/// (id, position in the block) ([`synthetic_token`]), so equal ids give equal tokens at any
/// engine block size; the last block is cut to `input_length`.
///
/// Built straight into its shared slice: allocated once (zeroed, from an iterator of known
/// length), then filled a trace block at a time.
pub fn prompt_tokens(record: &TraceRecord, block_size: usize) -> Arc<[u32]> {
    if let Some(tokens) = &record.tokens {
        return Arc::clone(tokens);
    }
    let ids = &record.hash_ids;
    let len = record.input_length.min(ids.len() * block_size);
    let mut tokens: Arc<[u32]> = std::iter::repeat_n(0, len).collect();
    let slice = Arc::get_mut(&mut tokens).expect("invariant: a slice just made has one owner");
    for (id, block) in ids.iter().zip(slice.chunks_mut(block_size.max(1))) {
        block_tokens(*id, block);
    }
    tokens
}

/// Token `j` of the trace block named `id` ([`block_tokens`]).
pub fn synthetic_token(id: u64, j: usize) -> u32 {
    let seed = mix(id);
    token(seed as u32, (seed >> 32) as u32, j as u32)
}

/// The first `out.len()` tokens of the trace block named `id`. A token is a function of the
/// id's 64-bit seed and its position in 32-bit arithmetic only, so the loop runs in vector
/// lanes: making the conversation trace's 94 M tokens was most of a replay's loading time
/// with one splitmix64 per token.
pub fn block_tokens(id: u64, out: &mut [u32]) {
    let seed = mix(id);
    let (lo, hi) = (seed as u32, (seed >> 32) as u32);
    for (j, t) in out.iter_mut().enumerate() {
        *t = token(lo, hi, j as u32);
    }
}

/// Token `j` of the block seeded `(lo, hi)`: the position stepped by the golden ratio from
/// the low half, one xorshift-multiply-xorshift round (the first half of murmur3's 32-bit
/// finaliser: Appleby, MurmurHash3, public domain), the high half xored in, and the result
/// mapped onto `0..VOCAB` by Lemire's multiply-shift ("Fast random integer generation in an
/// interval", 2019). The round is a bijection, so blocks whose seeds differ in the low half
/// differ at every position before the mapping, and in the high half by a constant xor.
#[inline(always)]
fn token(lo: u32, hi: u32, j: u32) -> u32 {
    let mut x = lo.wrapping_add(j.wrapping_mul(0x9e37_79b9));
    x ^= x >> 16;
    x = x.wrapping_mul(0x85eb_ca6b);
    x ^= x >> 13;
    ((u64::from(x ^ hi) * VOCAB) >> 32) as u32
}

/// A prompt hashed at an engine's block size: what a router and an engine need of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HashedPrompt {
    /// Its length, tokens.
    pub len: usize,
    /// Its full blocks' hashes (no salt).
    pub blocks: Vec<BlockHash>,
    /// The tokens after the last full block.
    pub tail: Arc<[u32]>,
}

/// Local hashes of engine blocks within trace blocks, by hash id: one pass of token
/// synthesis and hashing per distinct id, not per use. Only used where every engine block
/// lies inside one trace block (the trace's block size a multiple of the engine's), so a
/// block's tokens depend on (id, offset) alone.
#[derive(Debug)]
pub struct LocalMemo {
    trace_block_size: usize,
    block_size: NonZeroUsize,
    /// Hash id → its engine blocks' local hashes, at `locals[at..at + per_id]`.
    at: FxHashMap<u64, usize>,
    locals: Vec<LocalHash>,
    tokens: Vec<u32>,
    scratch: Vec<BlockHash>,
}

impl LocalMemo {
    /// A memo for one trace block size and engine block size; `None` if engine blocks
    /// straddle trace blocks.
    pub fn new(trace_block_size: usize, block_size: NonZeroUsize) -> Option<LocalMemo> {
        (trace_block_size > 0 && trace_block_size.is_multiple_of(block_size.get())).then(|| {
            LocalMemo {
                trace_block_size,
                block_size,
                at: FxHashMap::default(),
                locals: Vec::new(),
                tokens: Vec::with_capacity(trace_block_size),
                scratch: Vec::new(),
            }
        })
    }

    /// The local hashes of the engine blocks of trace block `id`.
    fn of(&mut self, id: u64) -> &[LocalHash] {
        let per_id = self.trace_block_size / self.block_size.get();
        let at = match self.at.get(&id) {
            Some(&at) => at,
            None => {
                self.tokens.resize(self.trace_block_size, 0);
                block_tokens(id, &mut self.tokens);
                self.scratch.clear();
                extend_blocks(
                    None,
                    &self.tokens,
                    self.block_size,
                    Salt::NONE,
                    &mut self.scratch,
                );
                let at = self.locals.len();
                self.locals.extend(self.scratch.iter().map(|b| b.local));
                self.at.insert(id, at);
                at
            }
        };
        &self.locals[at..at + per_id]
    }
}

/// A record's prompt hashed at `block_size`, as [`prompt_tokens`] then hashing would give
/// it; through `memo` when there is one and the record has no tokens of its own, without
/// building the prompt.
pub fn hashed_prompt(
    record: &TraceRecord,
    trace_block_size: usize,
    block_size: NonZeroUsize,
    memo: Option<&mut LocalMemo>,
) -> HashedPrompt {
    let bs = block_size.get();
    let memo = memo.filter(|m| {
        record.tokens.is_none()
            && m.trace_block_size == trace_block_size
            && m.block_size == block_size
    });
    let Some(memo) = memo else {
        let tokens = prompt_tokens(record, trace_block_size);
        let mut blocks = Vec::new();
        extend_blocks(None, &tokens, block_size, Salt::NONE, &mut blocks);
        let full = blocks.len() * bs;
        return HashedPrompt {
            len: tokens.len(),
            blocks,
            tail: tokens[full..].into(),
        };
    };
    let ids = &record.hash_ids;
    let len = record.input_length.min(ids.len() * trace_block_size);
    let per_id = trace_block_size / bs;
    let mut blocks = Vec::with_capacity(len / bs);
    let mut parent: Option<SeqHash> = None;
    for (i, &id) in ids.iter().enumerate() {
        let room = (len / bs).saturating_sub(i * per_id).min(per_id);
        if room == 0 {
            break;
        }
        for &local in &memo.of(id)[..room] {
            let seq = seq_hash(parent, local, Salt::NONE);
            blocks.push(BlockHash { local, seq });
            parent = Some(seq);
        }
    }
    let full = blocks.len() * bs;
    HashedPrompt {
        len,
        blocks,
        tail: (full..len)
            .map(|p| synthetic_token(ids[p / trace_block_size], p % trace_block_size))
            .collect(),
    }
}

/// splitmix64's finaliser (Steele, Lea, Flood, OOPSLA 2014).
pub fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> TraceRecord {
        TraceRecord::default()
    }

    /// Through the memo or not, a hashed prompt is the prompt's tokens hashed: full blocks,
    /// then the tail; ids seen before are reused, and a record with its own tokens or an
    /// engine block size that does not divide the trace's goes the long way.
    #[test]
    fn hashed_prompts_equal_hashing_the_tokens() {
        let records = [
            TraceRecord {
                input_length: 1100,
                hash_ids: vec![1, 2, 3],
                ..record()
            },
            TraceRecord {
                input_length: 1024,
                hash_ids: vec![1, 2, 4],
                ..record()
            },
            TraceRecord {
                input_length: 30,
                hash_ids: vec![2],
                ..record()
            },
            TraceRecord {
                input_length: 5,
                tokens: Some(vec![9, 8, 7, 6, 5].into()),
                ..record()
            },
        ];
        for bs in [16, 64, 48, 512] {
            let block_size = NonZeroUsize::new(bs).unwrap();
            let mut memo = LocalMemo::new(512, block_size);
            assert_eq!(memo.is_some(), 512 % bs == 0);
            for r in &records {
                let tokens = prompt_tokens(r, 512);
                let mut blocks = Vec::new();
                extend_blocks(None, &tokens, block_size, Salt::NONE, &mut blocks);
                let want = HashedPrompt {
                    len: tokens.len(),
                    tail: tokens[blocks.len() * bs..].into(),
                    blocks,
                };
                assert_eq!(
                    hashed_prompt(r, 512, block_size, memo.as_mut()),
                    want,
                    "{bs}"
                );
            }
        }
    }

    /// Token `j` of id `id`'s block is, with `(lo, hi)` the halves of `mix(id)` and
    /// `x = lo + j · 0x9e3779b9`, `r(x) = ((x ⊕ x≫16) · 0x85ebca6b) ⊕ (… ≫ 13)`:
    /// `(r(x) ⊕ hi) · VOCAB ≫ 32`, at every block size, power of two or not, and the prompt
    /// stops at `input_length`.
    #[test]
    fn tokens_follow_their_definition_at_any_block_size() {
        let r = TraceRecord {
            input_length: 700,
            hash_ids: vec![7, 3, 9],
            ..record()
        };
        for bs in [256, 300, 512] {
            let want: Vec<u32> = r
                .hash_ids
                .iter()
                .flat_map(|&id| {
                    let (lo, hi) = (mix(id) as u32, (mix(id) >> 32) as u32);
                    (0..bs as u32).map(move |j| {
                        let x = lo.wrapping_add(j.wrapping_mul(0x9e37_79b9));
                        let x = (x ^ (x >> 16)).wrapping_mul(0x85eb_ca6b);
                        (((x ^ (x >> 13) ^ hi) as u64 * VOCAB) >> 32) as u32
                    })
                })
                .take(700)
                .collect();
            assert_eq!(*prompt_tokens(&r, bs), want[..], "block size {bs}");
        }
    }

    #[test]
    fn equal_ids_give_equal_tokens_and_the_tail_is_cut() {
        let a = TraceRecord {
            timestamp: 0,
            input_length: 1000,
            output_length: 1,
            hash_ids: vec![0, 1],
            ..record()
        };
        let b = TraceRecord {
            timestamp: 0,
            input_length: 600,
            output_length: 1,
            hash_ids: vec![0, 2],
            ..record()
        };
        let (ta, tb) = (prompt_tokens(&a, 512), prompt_tokens(&b, 512));
        assert_eq!((ta.len(), tb.len()), (1000, 600));
        assert_eq!(ta[..512], tb[..512]);
        assert_ne!(ta[512..600], tb[512..600]);
    }
}
