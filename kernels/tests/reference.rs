//! The CPU reference of every operation: random layouts, random block permutations,
//! misaligned pieces.
#![allow(missing_docs, clippy::unwrap_used)]

use kvroute_kernels::plan::{self, PatternPiece, Piece};
use kvroute_kernels::{Dtype, KvLayout, pattern_byte, reference};
use proptest::prelude::*;

fn layout() -> impl Strategy<Value = KvLayout> {
    (1usize..4, 1usize..4, 1usize..12, 1usize..6, 0usize..3).prop_map(
        |(layers, kv_heads, head_dim, block_size, d)| KvLayout {
            layers,
            kv_heads,
            head_dim,
            block_size,
            dtype: Dtype::ALL[d],
        },
    )
}

/// A permutation of `0..n` from a seed (Fisher–Yates over a xorshift stream).
fn permutation(n: usize, mut seed: u64) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        v.swap(i, (seed % (i as u64 + 1)) as usize);
    }
    v
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Offload (gather into packed slots) then onboard (scatter into other G1 slots) moves
    /// every block intact: patterns verify, checksums follow the block, nothing else changes.
    #[test]
    fn gather_then_scatter_moves_blocks_intact(layout in layout(), n in 1usize..12, seed in 1u64..u64::MAX) {
        let g1_blocks = 2 * n;
        let mut g1 = vec![0u8; g1_blocks * layout.block_bytes()];
        let sources = permutation(g1_blocks, seed);
        let blocks: Vec<(usize, u64)> = sources[..n].iter().map(|&s| (s, seed ^ s as u64)).collect();
        reference::fill(&mut g1, &plan::g1_blocks(&layout, g1_blocks, &blocks)).unwrap();
        let before = reference::checksum(&g1, &plan::g1_blocks(&layout, g1_blocks, &blocks), n).unwrap();

        let packed_slots = permutation(n, seed.rotate_left(7));
        let mut g2 = vec![0u8; n * layout.block_bytes()];
        let pairs: Vec<(usize, usize)> = blocks.iter().zip(&packed_slots).map(|(&(s, _), &p)| (s, p)).collect();
        reference::copy(&g1, &mut g2, &plan::gather(&layout, g1_blocks, &pairs)).unwrap();
        let in_g2: Vec<(usize, u64)> = blocks.iter().zip(&packed_slots).map(|(&(_, seq), &p)| (p, seq)).collect();
        prop_assert!(reference::verify(&g2, &plan::packed_blocks(&layout, &in_g2), n).unwrap().iter().all(|&b| b == 0));
        prop_assert_eq!(&reference::checksum(&g2, &plan::packed_blocks(&layout, &in_g2), n).unwrap(), &before);

        // Back into the slots the first permutation left free.
        let targets = &sources[n..];
        let mut back = vec![0u8; g1.len()];
        let pairs: Vec<(usize, usize)> = packed_slots.iter().zip(targets).map(|(&p, &t)| (p, t)).collect();
        reference::copy(&g2, &mut back, &plan::scatter(&layout, g1_blocks, &pairs)).unwrap();
        let moved: Vec<(usize, u64)> = blocks.iter().zip(targets).map(|(&(_, seq), &t)| (t, seq)).collect();
        let pieces = plan::g1_blocks(&layout, g1_blocks, &moved);
        prop_assert!(reference::verify(&back, &pieces, n).unwrap().iter().all(|&b| b == 0));
        prop_assert_eq!(&reference::checksum(&back, &pieces, n).unwrap(), &before);
        // The sources' slots in `back` were never written.
        for &(slot, _) in &blocks {
            for p in 0..layout.pieces() {
                let at = layout.g1_offset(g1_blocks, slot, p);
                prop_assert!(back[at..at + layout.piece_bytes()].iter().all(|&b| b == 0));
            }
        }
    }

    /// Pieces at any offset and length: fill writes the pattern byte by byte, verify finds
    /// every corrupted word and only those, checksums depend on content, not address.
    #[test]
    fn misaligned_pieces_fill_verify_and_checksum(
        pieces in prop::collection::vec((0u64..64, 1u32..200, 0u32..8, any::<u64>()), 1..8),
        flip in any::<prop::sample::Index>(),
    ) {
        // Lay the pieces out one after another from their odd offsets.
        let mut at = 0u64;
        let list: Vec<PatternPiece> = pieces.iter().enumerate().map(|(j, &(gap, len, piece, seq))| {
            at += gap;
            let p = PatternPiece { addr: at, seq, piece, len, block: j as u32 };
            at += u64::from(len);
            p
        }).collect();
        let mut buf = vec![0u8; at as usize + 7];
        reference::fill(&mut buf, &list).unwrap();
        for p in &list {
            for i in 0..p.len as usize {
                prop_assert_eq!(buf[p.addr as usize + i], pattern_byte(p.seq, p.piece as usize, i));
            }
        }
        prop_assert!(reference::verify(&buf, &list, list.len()).unwrap().iter().all(|&b| b == 0));

        // The same content elsewhere (shifted by 3) has the same checksums.
        let shifted: Vec<PatternPiece> = list.iter().map(|p| PatternPiece { addr: p.addr + 3, ..*p }).collect();
        let mut other = vec![0u8; buf.len() + 3];
        let copies: Vec<Piece> = list.iter().map(|p| Piece { src: p.addr, dst: p.addr + 3, len: p.len }).collect();
        reference::copy(&buf, &mut other, &copies).unwrap();
        prop_assert_eq!(reference::checksum(&buf, &list, list.len()).unwrap(), reference::checksum(&other, &shifted, list.len()).unwrap());

        // One flipped byte: one bad word in its block, a different checksum.
        let victim = &list[flip.index(list.len())];
        let byte = victim.addr as usize + flip.index(victim.len as usize);
        let sums = reference::checksum(&buf, &list, list.len()).unwrap();
        buf[byte] ^= 0x5a;
        let bad = reference::verify(&buf, &list, list.len()).unwrap();
        for (j, &b) in bad.iter().enumerate() {
            prop_assert_eq!(b, u32::from(j == victim.block as usize));
        }
        prop_assert_ne!(reference::checksum(&buf, &list, list.len()).unwrap()[victim.block as usize], sums[victim.block as usize]);
    }
}

#[test]
fn pieces_outside_their_buffers_are_errors() {
    let mut dst = vec![0u8; 16];
    let err = reference::copy(
        &[0u8; 16],
        &mut dst,
        &[Piece {
            src: 8,
            dst: 0,
            len: 9,
        }],
    )
    .unwrap_err();
    assert_eq!(err.buffer, "src");
    assert!(
        reference::copy(
            &[0u8; 16],
            &mut dst,
            &[Piece {
                src: 0,
                dst: u64::MAX,
                len: 1
            }]
        )
        .is_err()
    );
    let p = PatternPiece {
        addr: 0,
        seq: 1,
        piece: 0,
        len: 8,
        block: 1,
    };
    assert_eq!(
        reference::checksum(&[0u8; 8], &[p], 1).unwrap_err().buffer,
        "result"
    );
}

#[test]
fn llama_8b_geometry() {
    let l = KvLayout::llama_8b();
    assert_eq!(l.piece_bytes(), 16 * 8 * 128 * 2);
    assert_eq!(l.block_bytes(), 2 << 20);
    assert_eq!(l.g1_offset(100, 3, 2), (2 * 100 + 3) * l.piece_bytes());
    assert_eq!(
        l.packed_offset(3, 2),
        3 * l.block_bytes() + 2 * l.piece_bytes()
    );
}
