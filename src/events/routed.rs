//! Routers tell an engine's sidecar which prompts they sent it, on
//! `kvroute.<cluster>.routed.<worker>`, when the engine publishes no KV events of its own
//! (`kvroute-worker --engine openai`): the sidecar guesses the engine's cache from them
//! ([`crate::engines::approx::ApproxCache`]) and publishes the guess as the worker's event
//! stream, so that every router replica mirrors one guess made from all replicas' decisions.
//!
//! A message is JSON: `{"rank": R, "blocks": [[seq, local], …]}`, the prompt's full blocks in
//! order. It is input from the network like any other: [`decode`] bounds and checks it.

use serde::{Deserialize, Serialize};

use crate::protocol::{BlockHash, DpRank, LocalHash, SeqHash, WorkerId};

/// Subject a worker's routed prompts are published on.
pub fn routed_subject(cluster: &str, worker: WorkerId) -> String {
    format!("kvroute.{cluster}.routed.{worker}")
}

/// Most blocks one message may name (a 1 M-token prompt at block size 16).
pub const MAX_ROUTED_BLOCKS: usize = 1 << 16;

/// A prompt a router sent to one rank of a worker.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Routed {
    /// The data-parallel rank it went to.
    pub rank: u32,
    /// Its full blocks, `[seq, local]` each, in order.
    pub blocks: Vec<(u64, u64)>,
}

/// Why a routed-prompt message was refused.
#[derive(Debug, thiserror::Error)]
pub enum RoutedError {
    /// Not the JSON shape above.
    #[error("not a routed prompt")]
    Shape {
        /// What the JSON reader found.
        #[source]
        source: serde_json::Error,
    },
    /// More blocks than [`MAX_ROUTED_BLOCKS`].
    #[error("a routed prompt of {blocks} blocks (at most {MAX_ROUTED_BLOCKS})")]
    TooLong {
        /// Blocks it named.
        blocks: usize,
    },
    /// A payload longer than [`MAX_ROUTED_BLOCKS`] blocks could take.
    #[error("a routed-prompt message of {bytes} bytes")]
    Oversized {
        /// Its length.
        bytes: usize,
    },
    /// A rank the worker does not have.
    #[error("a routed prompt for rank {rank} of a worker with {ranks}")]
    NoSuchRank {
        /// The rank named.
        rank: u32,
        /// The worker's ranks.
        ranks: u32,
    },
}

impl Routed {
    /// The message for a prompt of `blocks` sent to `rank`.
    pub fn new(rank: DpRank, blocks: &[BlockHash]) -> Routed {
        Routed {
            rank: rank.0,
            blocks: blocks.iter().map(|b| (b.seq.0, b.local.0)).collect(),
        }
    }

    /// Its blocks.
    pub fn block_hashes(&self) -> Vec<BlockHash> {
        self.blocks
            .iter()
            .map(|&(seq, local)| BlockHash {
                seq: SeqHash(seq),
                local: LocalHash(local),
            })
            .collect()
    }

    /// The payload, or `None` for a prompt too long to send (the sidecar would refuse it).
    pub fn encode(&self) -> Option<Vec<u8>> {
        if self.blocks.len() > MAX_ROUTED_BLOCKS {
            return None;
        }
        serde_json::to_vec(self).ok()
    }
}

/// Reads a message for a worker of `ranks` data-parallel ranks.
pub fn decode(payload: &[u8], ranks: u32) -> Result<Routed, RoutedError> {
    // A block takes at most 44 bytes (`[u64::MAX,u64::MAX],`), and the rest of the message
    // at most 32 (`{"rank":4294967295,"blocks":[]}`): a longer payload names more blocks
    // than allowed, and is refused before it is parsed.
    if payload.len() > 32 + 44 * MAX_ROUTED_BLOCKS {
        return Err(RoutedError::Oversized {
            bytes: payload.len(),
        });
    }
    let routed: Routed =
        serde_json::from_slice(payload).map_err(|source| RoutedError::Shape { source })?;
    if routed.blocks.len() > MAX_ROUTED_BLOCKS {
        return Err(RoutedError::TooLong {
            blocks: routed.blocks.len(),
        });
    }
    if routed.rank >= ranks {
        return Err(RoutedError::NoSuchRank {
            rank: routed.rank,
            ranks,
        });
    }
    Ok(routed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompt_reads_back_and_bad_messages_are_refused() {
        let blocks = [
            BlockHash {
                seq: SeqHash(u64::MAX),
                local: LocalHash(7),
            },
            BlockHash {
                seq: SeqHash(3),
                local: LocalHash(9),
            },
        ];
        let message = Routed::new(DpRank(1), &blocks);
        let payload = message.encode().unwrap();
        let back = decode(&payload, 2).unwrap();
        assert_eq!(back, message);
        assert_eq!(back.block_hashes(), blocks);
        assert!(matches!(
            decode(&payload, 1),
            Err(RoutedError::NoSuchRank { rank: 1, ranks: 1 })
        ));
        for bad in [
            &b"{"[..],
            br#"{"rank": -1, "blocks": []}"#,
            br#"{"rank": 0, "blocks": [[1]]}"#,
            br#"{"rank": 0, "blocks": [], "extra": 1}"#,
        ] {
            assert!(
                matches!(decode(bad, 4), Err(RoutedError::Shape { .. })),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        let long = Routed {
            rank: 0,
            blocks: vec![(0, 0); MAX_ROUTED_BLOCKS + 1],
        };
        assert_eq!(long.encode(), None);
        let payload = serde_json::to_vec(&long).unwrap();
        assert!(matches!(
            decode(&payload, 1),
            Err(RoutedError::TooLong { blocks }) if blocks == MAX_ROUTED_BLOCKS + 1
        ));
        let padded = [b" ".repeat(32 + 44 * MAX_ROUTED_BLOCKS), payload].concat();
        assert!(matches!(
            decode(&padded, 1),
            Err(RoutedError::Oversized { .. })
        ));
    }
}
