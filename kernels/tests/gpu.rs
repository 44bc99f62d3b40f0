//! The kernels on a real device against the CPU reference. Needs a CUDA GPU, driver and
//! NVRTC: `cargo test -p kvroute-kernels --test gpu -- --ignored`.
#![allow(missing_docs, clippy::unwrap_used)]

use kvroute_kernels::cuda::{Gpu, GpuError, GpuKv};
use kvroute_kernels::plan::{self, PatternPiece, Piece, PieceError};
use kvroute_kernels::{Dtype, KvLayout, reference};

/// xorshift64: reproducible "random" without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut v: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            v.swap(i, self.below(i + 1));
        }
        v
    }
}

fn gpu() -> Gpu {
    Gpu::new(0).unwrap_or_else(|e| panic!("needs a CUDA device: {e}"))
}

#[test]
#[ignore = "needs a CUDA device"]
fn every_operation_equals_the_reference_for_every_dtype() {
    let gpu = gpu();
    let stream = gpu.stream().unwrap();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for dtype in Dtype::ALL {
        for _ in 0..8 {
            let layout = KvLayout {
                layers: 1 + rng.below(4),
                kv_heads: 1 + rng.below(8),
                head_dim: [3, 8, 64, 128][rng.below(4)],
                block_size: 1 + rng.below(16),
                dtype,
            };
            let g1_blocks = 32;
            let n = 1 + rng.below(16);
            let slots = rng.permutation(g1_blocks);
            let blocks: Vec<(usize, u64)> = slots[..n].iter().map(|&s| (s, rng.next())).collect();
            // fill
            let mut host_g1 = vec![0u8; g1_blocks * layout.block_bytes()];
            let pieces = plan::g1_blocks(&layout, g1_blocks, &blocks);
            reference::fill(&mut host_g1, &pieces).unwrap();
            let mut g1 = gpu.alloc(&stream, host_g1.len()).unwrap();
            gpu.fill(&stream, &mut g1, &pieces).unwrap();
            assert_eq!(stream.clone_dtoh(&g1).unwrap(), host_g1, "fill {layout:?}");
            // checksum and verify
            assert_eq!(
                gpu.checksum(&stream, &g1, &pieces, n).unwrap(),
                reference::checksum(&host_g1, &pieces, n).unwrap()
            );
            assert!(
                gpu.verify(&stream, &g1, &pieces, n)
                    .unwrap()
                    .iter()
                    .all(|&b| b == 0)
            );
            // gather into a permutation of packed slots
            let packed = rng.permutation(n);
            let pairs: Vec<(usize, usize)> = blocks
                .iter()
                .zip(&packed)
                .map(|(&(s, _), &p)| (s, p))
                .collect();
            let gather = plan::gather(&layout, g1_blocks, &pairs);
            let mut host_staging = vec![0u8; n * layout.block_bytes()];
            reference::copy(&host_g1, &mut host_staging, &gather).unwrap();
            let mut staging = gpu.alloc(&stream, host_staging.len()).unwrap();
            gpu.copy(&stream, &g1, &mut staging, &gather).unwrap();
            assert_eq!(
                stream.clone_dtoh(&staging).unwrap(),
                host_staging,
                "gather {layout:?}"
            );
            // scatter back into other slots
            let back: Vec<(usize, usize)> = packed
                .iter()
                .zip(&slots[n..])
                .map(|(&p, &t)| (p, t))
                .collect();
            let scatter = plan::scatter(&layout, g1_blocks, &back);
            let mut host_out = vec![0u8; host_g1.len()];
            reference::copy(&host_staging, &mut host_out, &scatter).unwrap();
            let mut out = gpu.alloc(&stream, host_out.len()).unwrap();
            gpu.copy(&stream, &staging, &mut out, &scatter).unwrap();
            assert_eq!(
                stream.clone_dtoh(&out).unwrap(),
                host_out,
                "scatter {layout:?}"
            );
            // move_blocks (the transfers' path, slots by value): the same bytes as the
            // reference over plan::gather / plan::scatter, packed in list order
            let sources: Vec<usize> = blocks.iter().map(|&(s, _)| s).collect();
            let in_order: Vec<(usize, usize)> = sources.iter().copied().zip(0..).collect();
            let mut host_packed = vec![0u8; n * layout.block_bytes()];
            let gather = plan::gather(&layout, g1_blocks, &in_order);
            reference::copy(&host_g1, &mut host_packed, &gather).unwrap();
            let mut packed = gpu.alloc(&stream, host_packed.len()).unwrap();
            gpu.gather(&stream, &layout, &g1, g1_blocks, &sources, &mut packed)
                .unwrap();
            assert_eq!(
                stream.clone_dtoh(&packed).unwrap(),
                host_packed,
                "move_blocks gather {layout:?}"
            );
            let targets = &slots[n..2 * n];
            let back: Vec<(usize, usize)> = (0..n).zip(targets.iter().copied()).collect();
            let mut host_out = host_g1.clone();
            let scatter = plan::scatter(&layout, g1_blocks, &back);
            reference::copy(&host_packed, &mut host_out, &scatter).unwrap();
            gpu.scatter(&stream, &layout, &packed, targets, &mut g1, g1_blocks)
                .unwrap();
            assert_eq!(
                stream.clone_dtoh(&g1).unwrap(),
                host_out,
                "move_blocks scatter {layout:?}"
            );
            // a slot outside G1, or more blocks than the packed buffer holds, is refused
            let mut bad = sources.clone();
            bad[0] = g1_blocks;
            assert!(
                gpu.gather(&stream, &layout, &g1, g1_blocks, &bad, &mut packed)
                    .is_err()
            );
            let more: Vec<usize> = (0..=n).collect();
            assert!(
                gpu.gather(&stream, &layout, &g1, g1_blocks, &more, &mut packed)
                    .is_err()
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn misaligned_pieces_take_the_byte_path_and_match() {
    let gpu = gpu();
    let stream = gpu.stream().unwrap();
    let mut rng = Rng(42);
    for _ in 0..50 {
        let mut at = 0u64;
        let mut copies = Vec::new();
        let mut patterns = Vec::new();
        for j in 0..1 + rng.below(20) {
            at += rng.below(40) as u64;
            let len = 1 + rng.below(300) as u32;
            copies.push(Piece {
                src: at,
                dst: at + rng.below(17) as u64,
                len,
            });
            patterns.push(PatternPiece {
                addr: at,
                seq: rng.next(),
                piece: rng.below(64) as u32,
                len,
                block: j as u32,
            });
            at += u64::from(len) + 17;
        }
        let size = at as usize + 32;
        let mut host = vec![0u8; size];
        reference::fill(&mut host, &patterns).unwrap();
        let mut buf = gpu.alloc(&stream, size).unwrap();
        gpu.fill(&stream, &mut buf, &patterns).unwrap();
        assert_eq!(stream.clone_dtoh(&buf).unwrap(), host);
        let blocks = patterns.len();
        assert_eq!(
            gpu.checksum(&stream, &buf, &patterns, blocks).unwrap(),
            reference::checksum(&host, &patterns, blocks).unwrap()
        );
        let mut host_dst = vec![0u8; size];
        reference::copy(&host, &mut host_dst, &copies).unwrap();
        let mut dst = gpu.alloc(&stream, size).unwrap();
        gpu.copy(&stream, &buf, &mut dst, &copies).unwrap();
        assert_eq!(stream.clone_dtoh(&dst).unwrap(), host_dst);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn slot_lists_write_and_verify_the_bytes_of_the_piece_lists() {
    // The worker's fills and verifications take slots by value (no upload), over lists longer
    // than one launch's SEQ_MAX_BLOCKS: their bytes must be the reference's over
    // plan::g1_blocks, and their counts those of the piece-list kernel.
    let gpu = gpu();
    let stream = gpu.stream().unwrap();
    let mut rng = Rng(0x005e_ed0f_5107);
    for dtype in Dtype::ALL {
        for _ in 0..3 {
            let layout = KvLayout {
                layers: 1 + rng.below(4),
                kv_heads: 1 + rng.below(4),
                head_dim: [3, 8, 64][rng.below(3)],
                block_size: 1 + rng.below(16),
                dtype,
            };
            let g1_blocks = 700;
            // Lists of one launch, of exactly one and two, and across a launch's end.
            let n = [1 + rng.below(650), 256, 512, 257][rng.below(4)];
            let slots = rng.permutation(g1_blocks);
            let blocks: Vec<(usize, u64)> = slots[..n].iter().map(|&s| (s, rng.next())).collect();
            let mut host_g1 = vec![0u8; g1_blocks * layout.block_bytes()];
            reference::fill(&mut host_g1, &plan::g1_blocks(&layout, g1_blocks, &blocks)).unwrap();
            let mut g1 = gpu.alloc(&stream, host_g1.len()).unwrap();
            gpu.fill_slots(&stream, &layout, &mut g1, g1_blocks, &blocks)
                .unwrap();
            assert_eq!(
                stream.clone_dtoh(&g1).unwrap(),
                host_g1,
                "{n} blocks {layout:?}"
            );

            let mut wrong = blocks.clone();
            let flipped: Vec<usize> = (0..4).map(|_| rng.below(n)).collect();
            for &j in &flipped {
                wrong[j].1 ^= 1 << rng.below(64);
            }
            let mut out = stream.alloc_zeros::<u32>(n).unwrap();
            gpu.queue_verify_slots(&stream, &layout, &g1, g1_blocks, &wrong, &mut out)
                .unwrap();
            let by_slots = stream.clone_dtoh(&out).unwrap();
            let pieces = plan::g1_blocks(&layout, g1_blocks, &wrong);
            assert_eq!(by_slots, gpu.verify(&stream, &g1, &pieces, n).unwrap());
            for (j, &bad) in by_slots.iter().enumerate() {
                assert_eq!(bad != 0, flipped.contains(&j), "block {j}: {bad}");
            }
        }
    }
    // A slot outside G1 anywhere in the list queues nothing; a short result buffer is refused.
    let layout = KvLayout {
        layers: 2,
        kv_heads: 1,
        head_dim: 8,
        block_size: 4,
        dtype: Dtype::Fp32,
    };
    let mut g1 = gpu.alloc(&stream, 300 * layout.block_bytes()).unwrap();
    let mut blocks: Vec<(usize, u64)> = (0..300).map(|s| (s, s as u64 + 1)).collect();
    blocks[299].0 = 300;
    let err = gpu
        .fill_slots(&stream, &layout, &mut g1, 300, &blocks)
        .unwrap_err();
    assert!(
        matches!(
            err,
            GpuError::Piece(PieceError {
                index: 299,
                buffer: "g1",
                ..
            })
        ),
        "{err}"
    );
    assert!(stream.clone_dtoh(&g1).unwrap().iter().all(|&b| b == 0));
    let mut short = stream.alloc_zeros::<u32>(10).unwrap();
    let err = gpu
        .queue_verify_slots(&stream, &layout, &g1, 300, &blocks[..11], &mut short)
        .unwrap_err();
    assert!(
        matches!(err, GpuError::Piece(PieceError { buffer: "out", .. })),
        "{err}"
    );
    // Empty lists queue nothing and are no error.
    gpu.fill_slots(&stream, &layout, &mut g1, 300, &[]).unwrap();
    gpu.queue_verify_slots(&stream, &layout, &g1, 300, &[], &mut short)
        .unwrap();
    assert!(stream.clone_dtoh(&short).unwrap().iter().all(|&b| b == 0));
}

#[test]
#[ignore = "needs a CUDA device"]
fn offload_then_onboard_roundtrips_10000_random_blocks() {
    let layout = KvLayout {
        layers: 4,
        kv_heads: 2,
        head_dim: 64,
        block_size: 16,
        dtype: Dtype::Bf16,
    };
    let (g1_blocks, g2_blocks) = (12_000, 10_000);
    let mut kv = GpuKv::new(0, layout, g1_blocks, g2_blocks, 256).unwrap();
    let mut rng = Rng(7);
    let sources = rng.permutation(g1_blocks);
    let blocks: Vec<(usize, u64)> = sources[..10_000].iter().map(|&s| (s, rng.next())).collect();
    kv.fill(&blocks).unwrap();
    let slots: Vec<usize> = blocks.iter().map(|&(s, _)| s).collect();
    let sums = kv.checksum_g1(&slots).unwrap();
    let g2 = rng.permutation(g2_blocks);
    let pairs: Vec<(usize, usize)> = slots.iter().zip(&g2).map(|(&s, &h)| (s, h)).collect();
    kv.offload(&pairs).unwrap().wait().unwrap();
    assert_eq!(kv.checksum_g2(&g2).unwrap(), sums, "G2 after offload");
    // Onboard into a different permutation of G1 slots (some reused, some fresh).
    let targets = rng.permutation(g1_blocks);
    let back: Vec<(usize, usize)> = g2.iter().zip(&targets).map(|(&h, &t)| (h, t)).collect();
    kv.onboard(&back).unwrap().wait().unwrap();
    assert_eq!(
        kv.checksum_g1(&targets[..10_000]).unwrap(),
        sums,
        "G1 after onboard"
    );
    let moved: Vec<(usize, u64)> = blocks
        .iter()
        .zip(&targets)
        .map(|(&(_, seq), &t)| (t, seq))
        .collect();
    assert!(kv.verify_g1(&moved).unwrap().iter().all(|&b| b == 0));

    // The engine's path: a checked onboard polled without waiting, its verification results
    // read from pinned memory once the event says done; one block given the wrong hash
    // must be reported, the others not.
    let again: Vec<(usize, usize)> = g2[..256]
        .iter()
        .zip(&targets)
        .map(|(&h, &t)| (h, t))
        .collect();
    let mut seqs: Vec<u64> = blocks[..256].iter().map(|&(_, seq)| seq).collect();
    seqs[17] ^= 1;
    let transfer = kv.onboard_checked(&again, &seqs).unwrap();
    let mut polls = 0u64;
    while !kv.is_done(&transfer).unwrap() {
        polls += 1;
        assert!(polls < 10_000_000, "the copy never completes");
        std::hint::spin_loop();
    }
    let bad = kv.finish(transfer).unwrap();
    assert_eq!(bad.len(), 256);
    for (i, &b) in bad.iter().enumerate() {
        assert_eq!(b != 0, i == 17, "block {i}: {b} mismatching words");
    }
    // The pooled result buffer is reused by the next checked onboard.
    seqs[17] ^= 1;
    let transfer = kv.onboard_checked(&again, &seqs).unwrap();
    assert!(kv.finish(transfer).unwrap().iter().all(|&b| b == 0));
}

#[test]
#[ignore = "needs a CUDA device"]
fn transfers_over_many_lanes_roundtrip_while_interleaved() {
    // Llama-8B blocks (2 MiB): 64 blocks of staging make 8 lanes of 8 blocks, so a
    // 300-block transfer wraps the lanes several times, and an offload and an onboard
    // queued back to back share them.
    let layout = KvLayout::llama_8b();
    let (g1_blocks, g2_blocks) = (640, 640);
    let mut kv = GpuKv::new(0, layout, g1_blocks, g2_blocks, 64).unwrap();
    let mut rng = Rng(11);
    let g1 = rng.permutation(g1_blocks);
    let g2 = rng.permutation(g2_blocks);
    let blocks: Vec<(usize, u64)> = g1[..300].iter().map(|&s| (s, rng.next())).collect();
    kv.fill(&blocks).unwrap();
    let sums = kv.checksum_g1(&g1[..300]).unwrap();
    let first: Vec<(usize, usize)> = g1[..300]
        .iter()
        .copied()
        .zip(g2[..300].iter().copied())
        .collect();
    kv.offload(&first).unwrap().wait().unwrap();
    assert_eq!(
        kv.checksum_g2(&g2[..300]).unwrap(),
        sums,
        "G2 after offload"
    );
    // Onboard the first 150 into fresh G1 slots while the other 150 are offloaded again to
    // fresh G2 slots: both queued before either is waited for.
    let back: Vec<(usize, usize)> = g2[..150]
        .iter()
        .copied()
        .zip(g1[300..450].iter().copied())
        .collect();
    let seqs: Vec<u64> = blocks[..150].iter().map(|&(_, seq)| seq).collect();
    let again: Vec<(usize, usize)> = g1[150..300]
        .iter()
        .copied()
        .zip(g2[300..450].iter().copied())
        .collect();
    let onboard = kv.onboard_checked(&back, &seqs).unwrap();
    let offload = kv.offload(&again).unwrap();
    let bad = kv.finish(onboard).unwrap();
    assert_eq!(bad.len(), 150);
    assert!(
        bad.iter().all(|&b| b == 0),
        "onboarded blocks differ: {bad:?}"
    );
    kv.finish(offload).unwrap();
    assert_eq!(
        kv.checksum_g1(&g1[300..450]).unwrap(),
        sums[..150],
        "G1 after onboard"
    );
    assert_eq!(
        kv.checksum_g2(&g2[300..450]).unwrap(),
        sums[150..],
        "G2 after the second offload"
    );
}
