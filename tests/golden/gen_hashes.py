#!/usr/bin/env python3
"""Golden vectors for kvroute's block hashing (DESIGN §4), from an independent implementation.

Uses the reference xxHash bindings (PyPI `xxhash`), not the Rust code under test:

    pip install xxhash==3.6.0 && python3 tests/golden/gen_hashes.py > tests/golden/hashes.json

LocalHash = xxh3_64(seed=1337) of the block's tokens as little-endian u32.
SeqHash[0] = LocalHash[0], or xxh3_64(salt_le64 ++ local_le64) with a non-zero salt;
SeqHash[i] = xxh3_64(seq[i-1]_le64 ++ local[i]_le64).
"""
import json
import struct

import xxhash

SEED = 1337
U32_MAX = 2**32 - 1
# Long inputs: many blocks at small block sizes, several at the largest.
LONG = {1: 1031, 16: 4103, 32: 4103, 64: 4103, 512: 5127, 2048: 6151}


def lcg_tokens(n, start, modulus=2**32):
    """Deterministic pseudo-random token ids (Numerical Recipes LCG)."""
    x = start
    out = []
    for _ in range(n):
        x = (1664525 * x + 1013904223) % 2**32
        out.append(x % modulus)
    return out


def hash_blocks(tokens, block_size, salt):
    blocks = []
    parent = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start:start + block_size]
        local = xxhash.xxh3_64_intdigest(struct.pack(f"<{len(block)}I", *block), seed=SEED)
        if parent is None:
            seq = local if salt == 0 else xxhash.xxh3_64_intdigest(struct.pack("<QQ", salt, local), seed=SEED)
        else:
            seq = xxhash.xxh3_64_intdigest(struct.pack("<QQ", parent, local), seed=SEED)
        blocks.append({"local": str(local), "seq": str(seq)})
        parent = seq
    return blocks


def main():
    cases = []
    salts = [0, 42, 2**64 - 1]
    for block_size in [1, 16, 32, 64, 512, 2048]:
        lengths = {
            "empty": 0,
            "partial_only": max(block_size - 1, 0),
            "one_block": block_size,
            "exact_multiple": block_size * 4,
            "with_partial_tail": block_size * 3 + max(block_size // 2, 1) - (1 if block_size == 1 else 0),
            "long": LONG[block_size],
        }
        for shape, n in lengths.items():
            for salt in (salts if shape in ("exact_multiple", "one_block") else [0, 42] if shape == "long" else [0]):
                seed = len(cases) + 1
                tokens = lcg_tokens(n, seed, modulus=200_000)
                cases.append({
                    "name": f"bs{block_size}_{shape}_salt{salt}",
                    "block_size": block_size, "salt": str(salt), "tokens": tokens,
                    "blocks": hash_blocks(tokens, block_size, salt),
                })
        # Token ids at the top of the u32 range catch sign and width mistakes.
        tokens = [U32_MAX - (i % 7) for i in range(block_size * 2 + 1)]
        for salt in [0, 7]:
            cases.append({
                "name": f"bs{block_size}_near_u32_max_salt{salt}",
                "block_size": block_size, "salt": str(salt), "tokens": tokens,
                "blocks": hash_blocks(tokens, block_size, salt),
            })
    json.dump({"seed": SEED, "cases": cases}, indent=None, separators=(",", ":"), fp=__import__("sys").stdout)
    print()


if __name__ == "__main__":
    main()
