//! Which cached block a tier gives up first.

use serde::{Deserialize, Serialize};

/// An eviction policy: an order over inactive blocks, and whether blocks that other cached
/// blocks extend may go first.
pub trait EvictionPolicy: Send + Sync + std::fmt::Debug {
    /// Name in configs and reports.
    fn name(&self) -> &'static str;
    /// True if a block may only be evicted once no block extending it is cached in the same
    /// tier (leaves first), so a tier never holds a block whose prefix it lost.
    fn leaf_only(&self) -> bool;
    /// Eviction priority of an inactive block: the lowest goes first. `last_used` is the
    /// tier's logical clock at the block's last release or hit.
    fn priority(&self, last_used: u64, hits: u32) -> u64;
}

/// Least recently used, over all inactive blocks.
#[derive(Debug, Clone, Copy, Default)]
pub struct Lru;

impl EvictionPolicy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }
    fn leaf_only(&self) -> bool {
        false
    }
    fn priority(&self, last_used: u64, _hits: u32) -> u64 {
        last_used
    }
}

/// Least recently used among leaves: never evicts a block whose descendant is still cached.
/// Keeps every cached block reachable by prefix matching (the router's indexer credits a
/// block only with its whole prefix), so no slot holds a block nobody can hit.
#[derive(Debug, Clone, Copy, Default)]
pub struct LineageLru;

impl EvictionPolicy for LineageLru {
    fn name(&self) -> &'static str {
        "lineage_lru"
    }
    fn leaf_only(&self) -> bool {
        true
    }
    fn priority(&self, last_used: u64, _hits: u32) -> u64 {
        last_used
    }
}

/// The policies a config can name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EvictionKind {
    /// [`Lru`].
    Lru,
    /// [`LineageLru`] (default).
    #[default]
    LineageLru,
}

impl EvictionKind {
    /// The policy object.
    pub fn policy(self) -> Box<dyn EvictionPolicy> {
        match self {
            EvictionKind::Lru => Box::new(Lru),
            EvictionKind::LineageLru => Box::new(LineageLru),
        }
    }
}
