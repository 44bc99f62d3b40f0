//! Active load of one worker: what the router has sent it and not yet seen finish.

use std::collections::hash_map::Entry;

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
    /// Booked work, tokens: uncached prefill not yet computed plus the expected decode of
    /// every booked request (what admission weighs against the worker's budget).
    pub work_tokens: f64,
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

    /// Books a request: its uncached prefill, the blocks it will hold and its work.
    pub fn book(&mut self, prefill_blocks: f64, blocks: &[SeqHash], tail: bool, work: Work) {
        self.prefill_blocks += prefill_blocks;
        self.work_tokens += work.prefill_tokens + work.decode_tokens as f64;
        self.requests += 1;
        for b in blocks {
            *self.shared.entry(*b).or_insert(0) += 1;
        }
        self.private_blocks += usize::from(tail);
    }

    /// The request produced its first token: its prefill is done.
    pub fn prefill_done(&mut self, prefill_blocks: f64, work: Work) {
        self.prefill_blocks = (self.prefill_blocks - prefill_blocks).max(0.0);
        self.work_tokens = (self.work_tokens - work.prefill_tokens).max(0.0);
        if self.requests == 0 || self.prefill_blocks < 1e-9 {
            self.prefill_blocks = 0.0;
        }
    }

    /// The request finished: its blocks and its expected decode are released.
    pub fn release(&mut self, blocks: &[SeqHash], tail: bool, work: Work) {
        self.requests = self.requests.saturating_sub(1);
        self.work_tokens = (self.work_tokens - work.decode_tokens as f64).max(0.0);
        for b in blocks {
            // One probe per block: the entry both decrements and removes.
            if let Entry::Occupied(mut n) = self.shared.entry(*b) {
                *n.get_mut() -= 1;
                if *n.get() == 0 {
                    n.remove();
                }
            }
        }
        self.private_blocks = self.private_blocks.saturating_sub(usize::from(tail));
        if self.requests == 0 {
            self.prefill_blocks = 0.0;
            self.work_tokens = 0.0;
        }
    }
}

/// The work one request brings a worker, tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Work {
    /// Prompt tokens the worker must compute (not cached there).
    pub prefill_tokens: f64,
    /// Tokens it is expected to generate (its `max_tokens`, capped by
    /// `admission.decode_cap_tokens`).
    pub decode_tokens: u64,
}

impl Work {
    /// Both parts, tokens.
    pub fn total(self) -> f64 {
        self.prefill_tokens + self.decode_tokens as f64
    }
}
