//! Active load of one worker: what the router has sent it and not yet seen finish.

use rustc_hash::FxHashMap;

use crate::protocol::SeqHash;

/// Prefill still to compute and blocks held, by the router's bookkeeping.
#[derive(Debug, Default, Clone)]
pub struct ActiveLoad {
    /// Uncached prompt blocks of requests that have not produced a first token.
    pub prefill_blocks: f64,
    /// Requests booked and not completed.
    pub requests: usize,
    /// Full prompt blocks held by booked requests, refcounted: blocks shared by requests on
    /// the same worker count once.
    shared: FxHashMap<SeqHash, u32>,
    /// Partial tail blocks, one per request that has one (never shared).
    private_blocks: usize,
}

impl ActiveLoad {
    /// Blocks the worker's running requests hold (distinct full blocks plus tails).
    pub fn decode_blocks(&self) -> usize {
        self.shared.len() + self.private_blocks
    }

    /// Whether a booked request holds (or is computing) this block.
    pub fn holds(&self, block: SeqHash) -> bool {
        self.shared.contains_key(&block)
    }

    /// Books a request: its uncached prefill and the blocks it will hold.
    pub fn book(&mut self, prefill_blocks: f64, blocks: &[SeqHash], tail: bool) {
        self.prefill_blocks += prefill_blocks;
        self.requests += 1;
        for b in blocks {
            *self.shared.entry(*b).or_insert(0) += 1;
        }
        self.private_blocks += usize::from(tail);
    }

    /// The request produced its first token: its prefill is done.
    pub fn prefill_done(&mut self, prefill_blocks: f64) {
        self.prefill_blocks = (self.prefill_blocks - prefill_blocks).max(0.0);
        if self.requests == 0 || self.prefill_blocks < 1e-9 {
            self.prefill_blocks = 0.0;
        }
    }

    /// The request finished: its blocks are released.
    pub fn release(&mut self, blocks: &[SeqHash], tail: bool) {
        self.requests = self.requests.saturating_sub(1);
        for b in blocks {
            if let Some(n) = self.shared.get_mut(b) {
                *n -= 1;
                if *n == 0 {
                    self.shared.remove(b);
                }
            }
        }
        self.private_blocks = self.private_blocks.saturating_sub(usize::from(tail));
        if self.requests == 0 {
            self.prefill_blocks = 0.0;
        }
    }
}
