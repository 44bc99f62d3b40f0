//! Mooncake-format request traces (DESIGN §10) and the token ids synthesised for them.

use std::io::BufRead;
use std::path::Path;

use anyhow::{Context, bail};
use serde::Deserialize;

/// One request of a Mooncake JSONL trace.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct TraceRecord {
    /// Arrival, ms since the trace start.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: usize,
    /// Output tokens.
    pub output_length: usize,
    /// One id per trace block of the prompt; equal ids at a position mean equal prefixes.
    pub hash_ids: Vec<u64>,
}

/// Reads a trace, the first `limit` requests if given, checking that each record's hash ids
/// cover its prompt at `block_size` tokens per id.
pub fn load(
    path: &Path,
    limit: Option<usize>,
    block_size: usize,
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
        let record: TraceRecord = serde_json::from_str(&line).with_context(|| {
            format!("{}:{}: not a Mooncake trace record", path.display(), n + 1)
        })?;
        if record.input_length > record.hash_ids.len() * block_size {
            bail!(
                "{}:{}: {} hash ids of {block_size} tokens cannot cover {} input tokens",
                path.display(),
                n + 1,
                record.hash_ids.len(),
                record.input_length
            );
        }
        records.push(record);
    }
    Ok(records)
}

/// Vocabulary the synthetic token ids are drawn from (a Llama-3-sized one).
pub const VOCAB: u64 = 128_000;

/// The prompt of a record: `block_size` tokens per hash id, each a deterministic function of
/// (id, position in the block), so equal ids give equal tokens at any engine block size; the
/// last block is cut to `input_length`.
pub fn prompt_tokens(record: &TraceRecord, block_size: usize) -> Vec<u32> {
    let mut tokens = Vec::with_capacity(record.input_length);
    'ids: for id in &record.hash_ids {
        for j in 0..block_size as u64 {
            if tokens.len() == record.input_length {
                break 'ids;
            }
            tokens.push((mix(id.wrapping_mul(0x1_0000_0001) ^ j) % VOCAB) as u32);
        }
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

    #[test]
    fn equal_ids_give_equal_tokens_and_the_tail_is_cut() {
        let a = TraceRecord {
            timestamp: 0,
            input_length: 1000,
            output_length: 1,
            hash_ids: vec![0, 1],
        };
        let b = TraceRecord {
            timestamp: 0,
            input_length: 600,
            output_length: 1,
            hash_ids: vec![0, 2],
        };
        let (ta, tb) = (prompt_tokens(&a, 512), prompt_tokens(&b, 512));
        assert_eq!((ta.len(), tb.len()), (1000, 600));
        assert_eq!(ta[..512], tb[..512]);
        assert_ne!(ta[512..600], tb[512..600]);
    }
}
