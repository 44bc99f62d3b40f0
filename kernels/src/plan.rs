//! Piece lists: what each operation touches, as byte offsets into its buffers. The CPU
//! reference takes them as they are; the GPU path adds its buffers' base addresses.

use crate::layout::KvLayout;

/// One contiguous copy: `len` bytes from `src` to `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Source offset.
    pub src: u64,
    /// Destination offset.
    pub dst: u64,
    /// Bytes.
    pub len: u32,
}

/// One piece of a block whose pattern is written, summed or verified.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PatternPiece {
    /// Offset of the piece.
    pub addr: u64,
    /// `SeqHash` of the block.
    pub seq: u64,
    /// Piece number within the block (layer × 2 + {0: K, 1: V}).
    pub piece: u32,
    /// Bytes.
    pub len: u32,
    /// Which result (checksum, mismatch count) the piece adds to.
    pub block: u32,
}

/// A piece outside its buffer.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("piece {index} ({start}..{end}) is outside its {buffer} buffer of {len} bytes")]
pub struct PieceError {
    /// Position in the list.
    pub index: usize,
    /// `src`, `dst` or `pattern`.
    pub buffer: &'static str,
    /// First byte.
    pub start: u64,
    /// One past the last byte.
    pub end: u64,
    /// Buffer size.
    pub len: usize,
}

fn check(
    index: usize,
    buffer: &'static str,
    start: u64,
    len: u32,
    size: usize,
) -> Result<(), PieceError> {
    let end = start.saturating_add(u64::from(len));
    if end > size as u64 {
        return Err(PieceError {
            index,
            buffer,
            start,
            end,
            len: size,
        });
    }
    Ok(())
}

/// Checks every copy stays inside a `src_len`-byte source and a `dst_len`-byte destination.
pub fn check_copy(pieces: &[Piece], src_len: usize, dst_len: usize) -> Result<(), PieceError> {
    for (i, p) in pieces.iter().enumerate() {
        check(i, "src", p.src, p.len, src_len)?;
        check(i, "dst", p.dst, p.len, dst_len)?;
    }
    Ok(())
}

/// Checks every pattern piece stays inside a `size`-byte buffer and names a result below
/// `blocks`.
pub fn check_pattern(
    pieces: &[PatternPiece],
    size: usize,
    blocks: usize,
) -> Result<(), PieceError> {
    for (i, p) in pieces.iter().enumerate() {
        check(i, "pattern", p.addr, p.len, size)?;
        if p.block as usize >= blocks {
            return Err(PieceError {
                index: i,
                buffer: "result",
                start: u64::from(p.block),
                end: u64::from(p.block) + 1,
                len: blocks,
            });
        }
    }
    Ok(())
}

/// Gather: G1 slot `pairs[j].0` → packed slot `pairs[j].1`, every piece.
pub fn gather(layout: &KvLayout, g1_blocks: usize, pairs: &[(usize, usize)]) -> Vec<Piece> {
    let len = layout.piece_bytes() as u32;
    let mut pieces = Vec::with_capacity(pairs.len() * layout.pieces());
    for &(g1, packed) in pairs {
        for p in 0..layout.pieces() {
            pieces.push(Piece {
                src: layout.g1_offset(g1_blocks, g1, p) as u64,
                dst: layout.packed_offset(packed, p) as u64,
                len,
            });
        }
    }
    pieces
}

/// Scatter: packed slot `pairs[j].0` → G1 slot `pairs[j].1`, every piece.
pub fn scatter(layout: &KvLayout, g1_blocks: usize, pairs: &[(usize, usize)]) -> Vec<Piece> {
    let len = layout.piece_bytes() as u32;
    let mut pieces = Vec::with_capacity(pairs.len() * layout.pieces());
    for &(packed, g1) in pairs {
        for p in 0..layout.pieces() {
            pieces.push(Piece {
                src: layout.packed_offset(packed, p) as u64,
                dst: layout.g1_offset(g1_blocks, g1, p) as u64,
                len,
            });
        }
    }
    pieces
}

/// Every piece of G1 slots `blocks[j] = (slot, seq)`, result `j`.
pub fn g1_blocks(
    layout: &KvLayout,
    g1_blocks: usize,
    blocks: &[(usize, u64)],
) -> Vec<PatternPiece> {
    pattern(layout, blocks, |slot, p| {
        layout.g1_offset(g1_blocks, slot, p)
    })
}

/// Every piece of packed (G2, staging) slots `blocks[j] = (slot, seq)`, result `j`.
pub fn packed_blocks(layout: &KvLayout, blocks: &[(usize, u64)]) -> Vec<PatternPiece> {
    pattern(layout, blocks, |slot, p| layout.packed_offset(slot, p))
}

fn pattern(
    layout: &KvLayout,
    blocks: &[(usize, u64)],
    offset: impl Fn(usize, usize) -> usize,
) -> Vec<PatternPiece> {
    let len = layout.piece_bytes() as u32;
    let mut pieces = Vec::with_capacity(blocks.len() * layout.pieces());
    for (j, &(slot, seq)) in blocks.iter().enumerate() {
        for p in 0..layout.pieces() {
            pieces.push(PatternPiece {
                addr: offset(slot, p) as u64,
                seq,
                piece: p as u32,
                len,
                block: j as u32,
            });
        }
    }
    pieces
}
