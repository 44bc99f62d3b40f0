//! Block hashing as DESIGN §4 fixes it, compatible with NVIDIA Dynamo's router: a block's
//! `LocalHash` is xxh3-64 (seed 1337) of its token ids as little-endian `u32`s, and its
//! `SeqHash` chains the parent's `SeqHash` with that `LocalHash`. Only full blocks are hashed.

use std::num::NonZeroUsize;

use xxhash_rust::xxh3::{Xxh3, xxh3_64_with_seed};

use super::{LocalHash, SeqHash};

/// The xxh3 seed of every hash in the protocol.
pub const HASH_SEED: u64 = 1337;

/// Blocks up to this many tokens are hashed from one stack buffer in a single xxh3 call;
/// longer ones stream through the incremental hasher (same result, no heap either way).
const STACK_TOKENS: usize = 1024;

/// A namespace mixed into the root of every sequence hash (LoRA adapter, tenant). Zero means
/// no salt, and then `SeqHash[0] == LocalHash[0]`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Salt(pub u64);

impl Salt {
    /// No namespace.
    pub const NONE: Salt = Salt(0);
}

/// Both hashes of one full block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockHash {
    /// Hash of the block's tokens alone.
    pub local: LocalHash,
    /// Hash of the prefix ending with this block.
    pub seq: SeqHash,
}

/// `LocalHash` of one block: xxh3-64, seed 1337, over the tokens as little-endian `u32`.
pub fn local_hash(tokens: &[u32]) -> LocalHash {
    // Called per block (engine mirrors, the worker's decode): a scratch sized for engines'
    // usual blocks, so that a 16-token block does not zero 4 KiB (28 of its 37 ns).
    if tokens.len() <= SMALL_TOKENS {
        TokenBytes::<{ SMALL_TOKENS * 4 }>::new().local_hash(tokens)
    } else {
        TokenBytes::<{ STACK_TOKENS * 4 }>::new().local_hash(tokens)
    }
}

/// Blocks up to this many tokens are hashed by [`local_hash`] from a 256-byte scratch.
const SMALL_TOKENS: usize = 64;

/// Scratch space of `BYTES` bytes turning token ids into their little-endian bytes. Created
/// once per hashing loop, not per block: zeroing 4 KiB per 64-byte block would cost more
/// than the hash.
struct TokenBytes<const BYTES: usize>([u8; BYTES]);

impl<const BYTES: usize> TokenBytes<BYTES> {
    fn new() -> Self {
        TokenBytes([0; BYTES])
    }

    fn fill(&mut self, tokens: &[u32]) -> &[u8] {
        let bytes = &mut self.0[..tokens.len() * 4];
        for (dst, token) in bytes.chunks_exact_mut(4).zip(tokens) {
            dst.copy_from_slice(&token.to_le_bytes());
        }
        bytes
    }

    fn local_hash(&mut self, tokens: &[u32]) -> LocalHash {
        if tokens.len() * 4 <= BYTES {
            return LocalHash(xxh3_64_with_seed(self.fill(tokens), HASH_SEED));
        }
        let mut hasher = Xxh3::with_seed(HASH_SEED);
        for chunk in tokens.chunks(BYTES / 4) {
            hasher.update(self.fill(chunk));
        }
        LocalHash(hasher.digest())
    }
}

/// `SeqHash` of a block from its parent's `SeqHash` (none for the first block) and its own
/// `LocalHash`. The salt only affects the root: a chain is salted once, at block 0.
pub fn seq_hash(parent: Option<SeqHash>, local: LocalHash, salt: Salt) -> SeqHash {
    let prefix = match (parent, salt) {
        (Some(parent), _) => parent.0,
        (None, Salt::NONE) => return SeqHash(local.0),
        (None, Salt(salt)) => salt,
    };
    let mut pair = [0u8; 16];
    pair[..8].copy_from_slice(&prefix.to_le_bytes());
    pair[8..].copy_from_slice(&local.0.to_le_bytes());
    SeqHash(xxh3_64_with_seed(&pair, HASH_SEED))
}

/// Hashes every full block of a prompt. The trailing partial block is ignored.
pub fn hash_blocks(tokens: &[u32], block_size: NonZeroUsize, salt: Salt) -> Vec<BlockHash> {
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    extend_blocks(None, tokens, block_size, salt, &mut out);
    out
}

/// Appends the hashes of every full block of `tokens` to `out`, chaining from `parent` (the
/// `SeqHash` of the block just before `tokens`, or `None` at the start of a sequence). This is
/// the one hashing loop: prompts, decode extensions and the CLI all go through it.
pub fn extend_blocks(
    parent: Option<SeqHash>,
    tokens: &[u32],
    block_size: NonZeroUsize,
    salt: Salt,
    out: &mut Vec<BlockHash>,
) {
    out.reserve(tokens.len() / block_size);
    let mut scratch = TokenBytes::<{ STACK_TOKENS * 4 }>::new();
    let mut parent = parent;
    for block in tokens.chunks_exact(block_size.get()) {
        let local = scratch.local_hash(block);
        let seq = seq_hash(parent, local, salt);
        out.push(BlockHash { local, seq });
        parent = Some(seq);
    }
}
