//! The CPU implementation of every kernel: what the GPU must equal bit for bit, and the
//! worker's byte mode.

use crate::layout::{pattern_word, splitmix64};
use crate::plan::{PatternPiece, Piece, PieceError, check_copy, check_pattern};

/// Copies every piece from `src` to `dst`.
pub fn copy(src: &[u8], dst: &mut [u8], pieces: &[Piece]) -> Result<(), PieceError> {
    check_copy(pieces, src.len(), dst.len())?;
    for p in pieces {
        let (s, d, n) = (p.src as usize, p.dst as usize, p.len as usize);
        dst[d..d + n].copy_from_slice(&src[s..s + n]);
    }
    Ok(())
}

/// Writes each piece's pattern.
pub fn fill(buf: &mut [u8], pieces: &[PatternPiece]) -> Result<(), PieceError> {
    check_pattern(pieces, buf.len(), usize::MAX)?;
    for p in pieces {
        let start = p.addr as usize;
        for (w, chunk) in buf[start..start + p.len as usize].chunks_mut(8).enumerate() {
            let word = pattern_word(p.seq, p.piece as usize, w as u64).to_le_bytes();
            chunk.copy_from_slice(&word[..chunk.len()]);
        }
    }
    Ok(())
}

/// Little-endian words of a piece, the last one zero-padded.
fn words(bytes: &[u8]) -> impl Iterator<Item = u64> + '_ {
    bytes.chunks(8).map(|chunk| {
        let mut word = [0u8; 8];
        word[..chunk.len()].copy_from_slice(chunk);
        u64::from_le_bytes(word)
    })
}

/// Per result `0..blocks`: the wrapping sum over its pieces' words of
/// `splitmix64(word ^ piece << 48 ^ w)`.
pub fn checksum(
    buf: &[u8],
    pieces: &[PatternPiece],
    blocks: usize,
) -> Result<Vec<u64>, PieceError> {
    check_pattern(pieces, buf.len(), blocks)?;
    let mut out = vec![0u64; blocks];
    for p in pieces {
        let start = p.addr as usize;
        let sum =
            words(&buf[start..start + p.len as usize])
                .enumerate()
                .fold(0u64, |acc, (w, word)| {
                    acc.wrapping_add(splitmix64(word ^ (u64::from(p.piece) << 48) ^ w as u64))
                });
        out[p.block as usize] = out[p.block as usize].wrapping_add(sum);
    }
    Ok(out)
}

/// Per result `0..blocks`: how many words of its pieces differ from their pattern.
pub fn verify(buf: &[u8], pieces: &[PatternPiece], blocks: usize) -> Result<Vec<u32>, PieceError> {
    check_pattern(pieces, buf.len(), blocks)?;
    let mut out = vec![0u32; blocks];
    for p in pieces {
        let start = p.addr as usize;
        let len = p.len as usize;
        let bad = words(&buf[start..start + len])
            .enumerate()
            .filter(|&(w, word)| {
                let mut want = pattern_word(p.seq, p.piece as usize, w as u64);
                let tail = (len - w * 8).min(8);
                if tail < 8 {
                    want &= (1u64 << (8 * tail)) - 1;
                }
                word != want
            })
            .count();
        out[p.block as usize] += bad as u32;
    }
    Ok(out)
}
