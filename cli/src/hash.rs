//! `kvroute hash`: the block hashes of a token sequence, as workers and the router compute
//! them (debug "why is my overlap zero").

use std::io::Read;
use std::num::NonZeroUsize;

use anyhow::{Context, bail};
use kvroute::protocol::{Salt, hash_blocks};

/// Flags of `kvroute hash`.
#[derive(clap::Args)]
pub struct HashArgs {
    /// Token ids, comma-separated. Without it, a JSON array of token ids is read from stdin.
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub tokens: Option<Vec<String>>,
    /// Tokens per KV block; must match the workers' block size.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Cache namespace mixed into the root hash (LoRA adapter, tenant); 0 = none.
    #[arg(long, default_value_t = 0)]
    pub salt: u64,
}

/// Prints the report for `--tokens` or stdin.
pub fn run_hash(args: &HashArgs) -> anyhow::Result<()> {
    let stdin = match args.tokens {
        Some(_) => String::new(),
        None => {
            let mut input = String::new();
            std::io::stdin()
                .read_to_string(&mut input)
                .context("reading stdin")?;
            input
        }
    };
    println!("{}", hash_report(args, &stdin)?);
    Ok(())
}

/// The JSON array `kvroute hash` prints: one object per full block, hashes as decimal strings
/// (u64 does not survive JSON numbers in most tools).
fn hash_report(args: &HashArgs, stdin: &str) -> anyhow::Result<String> {
    let Some(block_size) = NonZeroUsize::new(args.block_size) else {
        bail!("--block-size must be at least 1");
    };
    let tokens = match &args.tokens {
        Some(list) => list
            .iter()
            .map(|t| {
                t.trim()
                    .parse::<u32>()
                    .with_context(|| format!("token {t:?} is not a u32"))
            })
            .collect::<anyhow::Result<Vec<u32>>>()?,
        None => serde_json::from_str::<Vec<u32>>(stdin)
            .context("stdin must be a JSON array of token ids (integers 0..=4294967295)")?,
    };
    let lines: Vec<String> = hash_blocks(&tokens, block_size, Salt(args.salt))
        .iter()
        .enumerate()
        .map(|(index, b)| {
            serde_json::json!({"index": index, "local": b.local.0.to_string(), "seq": b.seq.0.to_string()})
                .to_string()
        })
        .collect();
    Ok(if lines.is_empty() {
        "[]".to_owned()
    } else {
        format!("[\n{}\n]", lines.join(",\n"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(tokens: Option<&str>, block_size: usize, salt: u64) -> HashArgs {
        HashArgs {
            tokens: tokens.map(|t| t.split(',').map(str::to_owned).collect()),
            block_size,
            salt,
        }
    }

    #[test]
    fn hash_report_prints_one_object_per_full_block() {
        let out = hash_report(&args(Some("1,2,3,4,5"), 2, 0), "").unwrap();
        let parsed: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
        assert_eq!(parsed.len(), 2);
        let want = hash_blocks(&[1, 2, 3, 4], NonZeroUsize::new(2).unwrap(), Salt::NONE);
        assert_eq!(parsed[1]["index"], 1);
        assert_eq!(parsed[1]["local"], want[1].local.0.to_string());
        assert_eq!(parsed[1]["seq"], want[1].seq.0.to_string());
    }

    #[test]
    fn hash_report_reads_stdin_json_and_salt() {
        let from_flag = hash_report(&args(Some("7,8,9"), 1, 5), "").unwrap();
        let from_stdin = hash_report(&args(None, 1, 5), "[7, 8, 9]").unwrap();
        assert_eq!(from_flag, from_stdin);
        assert_eq!(hash_report(&args(None, 4, 0), "[1,2]").unwrap(), "[]");
    }

    #[test]
    fn hash_report_rejects_bad_input() {
        assert!(hash_report(&args(Some("1,x"), 2, 0), "").is_err());
        assert!(hash_report(&args(None, 2, 0), "[1, -3]").is_err());
        assert!(hash_report(&args(None, 2, 0), "[4294967296]").is_err());
        assert!(hash_report(&args(None, 2, 0), "not json").is_err());
        assert!(hash_report(&args(Some("1"), 0, 0), "").is_err());
    }
}
