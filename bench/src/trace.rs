//! Mooncake-format request traces (DESIGN §10) and the token ids synthesised for them.

use std::io::BufRead;
use std::path::Path;

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};

mod formats;

pub use formats::{Loaded, TraceArgs, TraceFormat, load_any};

/// One request of a Mooncake JSONL trace.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
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
/// (id, position in the block), so equal ids give equal tokens at any engine block size; the
/// last block is cut to `input_length`.
pub fn prompt_tokens(record: &TraceRecord, block_size: usize) -> Vec<u32> {
    if let Some(tokens) = &record.tokens {
        return tokens.to_vec();
    }
    let mut tokens = Vec::with_capacity(record.input_length);
    for id in &record.hash_ids {
        let n = block_size.min(record.input_length - tokens.len()) as u64;
        if n == 0 {
            break;
        }
        // One extend per id (a counted loop, no per-token length check): about twice as
        // fast as pushing, and synthesis is most of a replay's loading time.
        let base = id.wrapping_mul(0x1_0000_0001);
        tokens.extend((0..n).map(|j| (mix(base ^ j) % VOCAB) as u32));
    }
    tokens
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
        TraceRecord {
            timestamp: 0,
            input_length: 0,
            output_length: 0,
            hash_ids: Vec::new(),
            tenant: None,
            priority: None,
            session_id: None,
            think_ms: None,
            tokens: None,
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
