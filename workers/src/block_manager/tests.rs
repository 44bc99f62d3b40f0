use kvroute::protocol::LocalHash;

use super::*;
use crate::offload::KvLayout;

fn config(g1: usize, g2: usize) -> EngineConfig {
    EngineConfig {
        g1_blocks: g1,
        g2_blocks: g2,
        ..EngineConfig::default()
    }
}

fn chain(start: u64, n: usize) -> Vec<(Option<SeqHash>, StoredBlock)> {
    (0..n as u64)
        .map(|i| {
            let parent = (i > 0).then(|| SeqHash(start + i - 1));
            (
                parent,
                StoredBlock {
                    seq: SeqHash(start + i),
                    local: LocalHash(start + i + 1000),
                },
            )
        })
        .collect()
}

fn seqs(c: &[(Option<SeqHash>, StoredBlock)]) -> Vec<SeqHash> {
    c.iter().map(|(_, b)| b.seq).collect()
}

/// Allocates and registers a whole chain for one request, returning its lease.
fn compute(bm: &BlockManager, now: u64, c: &[(Option<SeqHash>, StoredBlock)]) -> Lease {
    let (mut lease, found) = bm.acquire_prefix(&seqs(c));
    bm.allocate(now, &mut lease, c.len() - found.device)
        .unwrap();
    bm.register(&mut lease, found.device, c[found.device..].iter().copied());
    bm.check_invariants().unwrap();
    lease
}

fn resident(bm: &BlockManager, tier: Tier) -> Vec<u64> {
    let mut v: Vec<u64> = bm
        .resident(tier)
        .into_iter()
        .map(|(_, b)| b.seq.0)
        .collect();
    v.sort();
    v
}

#[test]
fn lease_lifecycle_and_states() {
    let bm = BlockManager::new(&config(8, 0));
    let c = chain(0, 3);
    let lease = compute(&bm, 0, &c);
    let u = bm.usage(Tier::Device);
    assert_eq!((u.free, u.mutable, u.registered, u.inactive), (5, 0, 3, 0));
    drop(lease);
    let u = bm.usage(Tier::Device);
    assert_eq!((u.free, u.mutable, u.registered, u.inactive), (5, 0, 0, 3));
    assert_eq!(
        bm.match_prefix(&seqs(&chain(0, 5))),
        PrefixMatch { device: 3, host: 0 }
    );
    bm.check_invariants().unwrap();
}

#[test]
fn dropping_a_lease_frees_unregistered_blocks() {
    let bm = BlockManager::new(&config(4, 0));
    let mut lease = bm.lease();
    bm.allocate(0, &mut lease, 3).unwrap();
    assert_eq!(bm.usage(Tier::Device).mutable, 3);
    drop(lease);
    assert_eq!(bm.usage(Tier::Device).free, 4);
    bm.check_invariants().unwrap();
}

#[test]
fn allocation_is_all_or_nothing() {
    let bm = BlockManager::new(&config(4, 0));
    let held = compute(&bm, 0, &chain(0, 3));
    let mut lease = bm.lease();
    assert_eq!(bm.allocate(0, &mut lease, 2), Err(AllocError::Insufficient));
    assert!(lease.is_empty());
    assert_eq!(bm.usage(Tier::Device).free, 1);
    drop(held);
    bm.allocate(0, &mut lease, 4).unwrap();
    assert_eq!(lease.len(), 4);
    bm.check_invariants().unwrap();
}

#[test]
fn a_block_registered_meanwhile_by_another_request_is_shared() {
    let bm = BlockManager::new(&config(8, 0));
    let c = chain(0, 2);
    let a = compute(&bm, 0, &c);
    // A second request computing the same blocks concurrently (it allocated before A
    // registered) shares A's block and gives its own slot back; the hash is resident once.
    let mut b = bm.lease();
    bm.allocate(0, &mut b, 2).unwrap();
    let mine = b.blocks[0];
    bm.register(&mut b, 0, [c[0]]);
    assert_ne!(b.blocks[0], mine);
    assert_eq!(b.blocks[0], a.blocks[0]);
    let u = bm.usage(Tier::Device);
    assert_eq!((u.registered, u.mutable, u.free), (2, 1, 5));
    assert_eq!(bm.stats().shared_on_register, 1);
    let mut changes = Vec::new();
    bm.drain_changes(&mut changes);
    assert_eq!(
        changes.len(),
        2,
        "only A's blocks are announced: {changes:?}"
    );
    drop(a);
    // B still holds the block it shares: not cached-and-unused, not evictable.
    assert_eq!(bm.usage(Tier::Device).inactive, 1);
    drop(b);
    bm.check_invariants().unwrap();
    assert_eq!(bm.usage(Tier::Device).free, 6);
}

/// A request that computed a block another had registered meanwhile, then a block of its
/// own after it: the shared block, which A let go, must not count as room. It did while B
/// kept a private copy (the registered one unheld, inactive, but not evictable under
/// LineageLru while B's block extended it): an allocation counted it, evicted every
/// evictable block, and still failed.
#[test]
fn a_block_extended_by_a_running_request_is_not_counted_as_room() {
    let bm = BlockManager::new(&config(6, 0));
    let c = chain(0, 2);
    let mut a = bm.lease();
    bm.allocate(0, &mut a, 2).unwrap();
    let mut b = bm.lease();
    bm.allocate(0, &mut b, 2).unwrap();
    bm.register(&mut a, 0, c.iter().copied());
    // B's second block diverges from A's: its own hash, extending the shared first block.
    let own = StoredBlock {
        seq: SeqHash(900),
        local: LocalHash(1900),
    };
    bm.register(&mut b, 0, [c[0], (Some(c[0].1.seq), own)]);
    drop(a);
    // Free 3, and A's second block is inactive and a leaf: four blocks can be had.
    let mut lease = bm.lease();
    bm.allocate(0, &mut lease, 4).unwrap();
    assert_eq!(resident(&bm, Tier::Device), vec![0, 900]);
    drop(lease);
    drop(b);
    bm.check_invariants().unwrap();
}

#[test]
fn lineage_lru_evicts_leaves_first() {
    let bm = BlockManager::new(&config(6, 0));
    drop(compute(&bm, 0, &chain(0, 3))); // 0 ← 1 ← 2, released tail first
    drop(compute(&bm, 0, &chain(100, 3)));
    // Touch chain 0's root only: under plain LRU it would survive and its children go.
    drop(compute(&bm, 0, &chain(0, 1)));
    let mut lease = bm.lease();
    bm.allocate(0, &mut lease, 2).unwrap();
    // Chain 0's tail is least recent (released first); the root was touched since.
    assert_eq!(resident(&bm, Tier::Device), vec![0, 100, 101, 102]);
    bm.allocate(0, &mut lease, 3).unwrap();
    assert_eq!(resident(&bm, Tier::Device), vec![0]);
    bm.check_invariants().unwrap();
}

/// Once a parent left and its slot holds another block, its child leaving must uncount the
/// parent where it is now (an orphan), not in the slot the parent used to have.
#[test]
fn a_child_leaving_uncounts_its_parent_where_it_is_now() {
    let bm = BlockManager::new(&EngineConfig {
        eviction: EvictionKind::Lru,
        ..config(4, 0)
    });
    let c = chain(0, 2);
    drop(compute(&bm, 0, &c[..1])); // block 0 in slot 0
    drop(compute(&bm, 0, &c[1..])); // block 1 in slot 1, child of slot 0, more recent
    // Three slots: the two free ones and block 0's (least recent), which is handed out first.
    let mut lease = bm.lease();
    bm.allocate(0, &mut lease, 3).unwrap();
    bm.register(&mut lease, 0, chain(100, 3));
    assert_eq!(resident(&bm, Tier::Device), vec![1, 100, 101, 102]);
    // Block 1 goes next; its parent's old slot now holds block 100.
    let mut more = bm.lease();
    bm.allocate(0, &mut more, 1).unwrap();
    assert_eq!(resident(&bm, Tier::Device), vec![100, 101, 102]);
    bm.check_invariants().unwrap();
}

#[test]
fn plain_lru_evicts_by_recency_alone() {
    let bm = BlockManager::new(&EngineConfig {
        eviction: EvictionKind::Lru,
        ..config(6, 0)
    });
    drop(compute(&bm, 0, &chain(0, 3)));
    drop(compute(&bm, 0, &chain(100, 3)));
    drop(compute(&bm, 0, &chain(0, 1))); // root 0 is now the most recent
    let mut lease = bm.lease();
    bm.allocate(0, &mut lease, 3).unwrap();
    // Chain 0's tail (1, 2) was released first of all and goes first, then 102.
    assert_eq!(resident(&bm, Tier::Device), vec![0, 100, 101]);
    bm.check_invariants().unwrap();
}

fn byte_config(g1: usize, g2: usize) -> EngineConfig {
    EngineConfig {
        kv_bytes: Some(KvLayout::default()),
        ..config(g1, g2)
    }
}

/// Fills G1 with `c`, then evicts it to G2 by computing another chain of the same length.
fn offload_chain(bm: &BlockManager, c: &[(Option<SeqHash>, StoredBlock)]) -> u64 {
    let a = compute(bm, 0, c);
    drop(a);
    // A hit makes the blocks worth keeping.
    drop(bm.acquire_prefix(&seqs(c)).0);
    let mut other = bm.lease();
    assert_eq!(
        bm.allocate(10, &mut other, c.len()),
        Err(AllocError::Pending)
    );
    let done = bm.next_wakeup_us().expect("offload copy in flight");
    assert!(done > 10);
    bm.advance(done, &mut Vec::new()).unwrap();
    bm.check_invariants().unwrap();
    bm.allocate(done, &mut other, c.len()).unwrap();
    drop(other);
    done
}

#[test]
fn offload_then_onboard_roundtrips_bytes() {
    let bm = BlockManager::new(&byte_config(4, 8));
    let c = chain(0, 4);
    let t = offload_chain(&bm, &c);
    assert_eq!(resident(&bm, Tier::Host), vec![0, 1, 2, 3]);
    assert_eq!(
        bm.match_prefix(&seqs(&c)),
        PrefixMatch { device: 0, host: 4 }
    );
    let (mut lease, found) = bm.acquire_prefix(&seqs(&c));
    assert_eq!(found, PrefixMatch { device: 0, host: 4 });
    bm.allocate(t, &mut lease, 4).unwrap();
    let ticket = bm.start_onboard(t, &mut lease, 0);
    // The slots the chain left when it was evicted come back to it with its bytes still in
    // them: until the copy lands they hold a pattern the check refuses, so that the check
    // after it proves the copy, not the slot's past.
    for (i, (_, block)) in c.iter().enumerate() {
        assert_eq!(bm.verify_bytes(lease.blocks()[i], block.seq), Some(false));
    }
    let done = bm.next_wakeup_us().unwrap();
    // 4 blocks × 2 KiB at 25 GB/s: well under a µs, rounded up.
    assert_eq!(done, t + 1);
    let mut ready = Vec::new();
    bm.advance(done, &mut ready).unwrap();
    assert_eq!(ready, vec![ticket]);
    assert_eq!(bm.match_prefix(&seqs(&c)).device, 4);
    for (i, (_, block)) in c.iter().enumerate() {
        assert_eq!(bm.verify_bytes(lease.blocks()[i], block.seq), Some(true));
    }
    assert_eq!(bm.stats().onboarded, 4);
    bm.check_invariants().unwrap();
}

#[test]
fn corrupted_host_bytes_fail_loudly_on_onboard() {
    let bm = BlockManager::new(&byte_config(2, 4));
    let c = chain(0, 2);
    let t = offload_chain(&bm, &c);
    bm.corrupt_host_block(SeqHash(1));
    let (mut lease, _) = bm.acquire_prefix(&seqs(&c));
    bm.allocate(t, &mut lease, 2).unwrap();
    bm.start_onboard(t, &mut lease, 0);
    let err = bm.advance(t + 10, &mut Vec::new()).unwrap_err();
    assert_eq!(err, OffloadError::Corrupt { seq: SeqHash(1) });
    assert_eq!((bm.stats().verified, bm.stats().verify_failures), (1, 1));
}

/// A fill or an offload the device refuses to start stops the engine at the next advance
/// (as a failed onboard does), before its blocks reach G2: left to run, they were announced
/// on the host with stale bytes and failed much later as corrupted G2 data.
#[test]
fn a_fill_or_offload_the_device_refuses_is_reported() {
    let bm = BlockManager::new(&byte_config(2, 4));
    bm.fail_device();
    drop(compute(&bm, 0, &chain(0, 2)));
    assert!(matches!(
        bm.advance(1, &mut Vec::new()),
        Err(OffloadError::Device(DeviceError { op: "fill", .. }))
    ));
    bm.advance(2, &mut Vec::new()).unwrap();

    let bm = BlockManager::new(&byte_config(2, 4));
    let c = chain(0, 2);
    drop(compute(&bm, 0, &c));
    drop(bm.acquire_prefix(&seqs(&c)).0);
    bm.fail_device();
    let mut other = bm.lease();
    assert_eq!(bm.allocate(10, &mut other, 2), Err(AllocError::Pending));
    let done = bm.next_wakeup_us().unwrap();
    assert!(matches!(
        bm.advance(done, &mut Vec::new()),
        Err(OffloadError::Device(DeviceError { op: "offload", .. }))
    ));
    assert!(resident(&bm, Tier::Host).is_empty());
}

/// A copy the device has not finished when the link model says it ends is polled, not
/// waited for: the request's ticket and its G1 blocks wait, the slots stay held, and the
/// block manager asks to be woken a poll period later.
#[test]
fn an_onboard_the_device_is_late_with_is_polled_not_waited_for() {
    let bm = BlockManager::new(&byte_config(4, 8));
    let c = chain(0, 4);
    let t = offload_chain(&bm, &c);
    bm.lag_device(2);
    let (mut lease, _) = bm.acquire_prefix(&seqs(&c));
    bm.allocate(t, &mut lease, 4).unwrap();
    let ticket = bm.start_onboard(t, &mut lease, 0);
    let done = bm.next_wakeup_us().unwrap();
    let mut ready = Vec::new();
    for poll in 0..2 {
        let now = done + poll * DEVICE_POLL_US;
        bm.advance(now, &mut ready).unwrap();
        assert!(ready.is_empty(), "poll {poll}: the device is not done");
        assert_eq!(bm.match_prefix(&seqs(&c)).device, 0);
        assert_eq!(
            bm.usage(Tier::Device).mutable,
            4,
            "the copy still writes them"
        );
        assert_eq!(bm.next_wakeup_us(), Some(now + DEVICE_POLL_US));
        bm.check_invariants().unwrap();
    }
    bm.advance(done + 2 * DEVICE_POLL_US, &mut ready).unwrap();
    assert_eq!(ready, vec![ticket]);
    assert_eq!(bm.next_wakeup_us(), None);
    assert_eq!(bm.match_prefix(&seqs(&c)).device, 4);
    let stats = bm.stats();
    assert_eq!(
        (stats.late_copies, stats.verified, stats.verify_failures),
        (1, 4, 0)
    );
    bm.check_invariants().unwrap();
}

/// A copy the device never finishes is a failure of the device once it is
/// [`DEVICE_DEADLINE_US`] late (the engine stops, and its worker leaves the fleet): it was
/// polled forever, its slots and the request behind them held for good.
#[test]
fn a_copy_the_device_never_finishes_fails_at_its_deadline() {
    let bm = BlockManager::new(&byte_config(4, 8));
    let c = chain(0, 4);
    let t = offload_chain(&bm, &c);
    bm.lag_device(u32::MAX);
    let (mut lease, _) = bm.acquire_prefix(&seqs(&c));
    bm.allocate(t, &mut lease, 4).unwrap();
    bm.start_onboard(t, &mut lease, 0);
    let done = bm.next_wakeup_us().unwrap();
    let mut ready = Vec::new();
    bm.advance(done, &mut ready).unwrap();
    bm.advance(done + DEVICE_DEADLINE_US - DEVICE_POLL_US, &mut ready)
        .unwrap();
    assert!(ready.is_empty());
    assert_eq!(
        bm.advance(done + DEVICE_DEADLINE_US, &mut ready),
        Err(OffloadError::Stuck {
            late_ms: DEVICE_DEADLINE_US / 1_000
        })
    );
}

/// An offload the device is late with keeps its G1 slots until the device is done.
#[test]
fn an_offload_holds_its_g1_slots_until_the_device_is_done() {
    let bm = BlockManager::new(&byte_config(2, 4));
    bm.lag_device(1);
    let c = chain(0, 2);
    drop(compute(&bm, 0, &c));
    drop(bm.acquire_prefix(&seqs(&c)).0);
    let mut other = bm.lease();
    assert_eq!(bm.allocate(10, &mut other, 2), Err(AllocError::Pending));
    // Held by the copy alone: no request's.
    let copying = bm.usage(Tier::Device);
    assert_eq!((copying.registered, copying.offloading), (2, 2));
    let done = bm.next_wakeup_us().unwrap();
    bm.advance(done, &mut Vec::new()).unwrap();
    assert_eq!(
        bm.allocate(done, &mut other, 2),
        Err(AllocError::Pending),
        "the device still copies"
    );
    assert_eq!(bm.next_wakeup_us(), Some(done + DEVICE_POLL_US));
    bm.advance(done + DEVICE_POLL_US, &mut Vec::new()).unwrap();
    bm.allocate(done + DEVICE_POLL_US, &mut other, 2).unwrap();
    assert_eq!(resident(&bm, Tier::Host), vec![0, 1]);
    assert_eq!((bm.stats().late_copies, bm.stats().offloaded), (1, 2));
    drop(other);
    bm.check_invariants().unwrap();
}

#[test]
fn dropping_a_lease_during_onboard_frees_slots_when_the_copy_ends() {
    let bm = BlockManager::new(&config(2, 4));
    let c = chain(0, 2);
    let t = offload_chain(&bm, &c);
    let (mut lease, _) = bm.acquire_prefix(&seqs(&c));
    bm.allocate(t, &mut lease, 2).unwrap();
    bm.start_onboard(t, &mut lease, 0);
    drop(lease);
    assert_eq!(
        bm.usage(Tier::Device).mutable,
        2,
        "the copy still writes them"
    );
    bm.advance(t + 1_000, &mut Vec::new()).unwrap();
    assert_eq!(bm.usage(Tier::Device).free, 2);
    assert_eq!(bm.usage(Tier::Host).inactive, 2);
    bm.check_invariants().unwrap();
}

#[test]
fn an_offloading_block_leaves_g1_before_it_lands_in_g2() {
    let bm = BlockManager::new(&config(2, 4));
    let c = chain(0, 2);
    drop(compute(&bm, 0, &c));
    drop(bm.acquire_prefix(&seqs(&c)).0);
    let mut changes = Vec::new();
    bm.drain_changes(&mut changes);
    changes.clear();
    let mut other = bm.lease();
    assert_eq!(bm.allocate(0, &mut other, 2), Err(AllocError::Pending));
    // During the copy: gone from G1's index, slots still held.
    assert_eq!(bm.match_prefix(&seqs(&c)), PrefixMatch::default());
    assert_eq!(bm.usage(Tier::Device).registered, 2);
    bm.check_invariants().unwrap();
    bm.advance(1_000, &mut Vec::new()).unwrap();
    assert_eq!(
        bm.match_prefix(&seqs(&c)),
        PrefixMatch { device: 0, host: 2 }
    );
    assert_eq!(bm.usage(Tier::Device).free, 2);
    bm.drain_changes(&mut changes);
    let kinds: Vec<(Tier, bool)> = changes
        .iter()
        .map(|c| match c {
            Change::Stored { tier, .. } => (*tier, true),
            Change::Removed { tier, .. } => (*tier, false),
        })
        .collect();
    assert_eq!(
        kinds,
        vec![
            (Tier::Device, false),
            (Tier::Device, false),
            (Tier::Host, true),
            (Tier::Host, true)
        ]
    );
    bm.check_invariants().unwrap();
}

#[test]
fn blocks_not_worth_keeping_are_dropped_not_offloaded() {
    let bm = BlockManager::new(&config(2, 4));
    drop(compute(&bm, 0, &chain(0, 2))); // never hit
    let mut other = bm.lease();
    bm.allocate(0, &mut other, 2).unwrap();
    assert!(resident(&bm, Tier::Host).is_empty());
    assert_eq!(bm.stats().offloaded, 0);
}

#[test]
fn g2_evicts_when_full() {
    let bm = BlockManager::new(&config(2, 2));
    let t = offload_chain(&bm, &chain(0, 2));
    offload_chain_at(&bm, &chain(100, 2), t);
    assert_eq!(resident(&bm, Tier::Host), vec![100, 101]);
    assert_eq!(bm.stats().host_evictions, 2);
    bm.check_invariants().unwrap();
}

fn offload_chain_at(bm: &BlockManager, c: &[(Option<SeqHash>, StoredBlock)], t: u64) {
    drop(compute(bm, t, c));
    drop(bm.acquire_prefix(&seqs(c)).0);
    let mut other = bm.lease();
    let _ = bm.allocate(t, &mut other, c.len());
    bm.advance(t + 1_000_000, &mut Vec::new()).unwrap();
}

/// An admission that must wait for copies leaves its prefix as it found it: retried every
/// step, it would otherwise count a hit and refresh the prefix's recency each time.
#[test]
fn an_admission_that_waits_for_copies_leaves_its_prefix_untouched() {
    let bm = BlockManager::new(&config(3, 4));
    let c = chain(0, 2);
    drop(compute(&bm, 0, &c));
    // Hit once: both are worth a copy to G2 when evicted.
    drop(compute(&bm, 0, &c));
    drop(compute(&bm, 0, &chain(100, 1)));
    let before = |bm: &BlockManager| {
        let inner = bm.inner.lock();
        let id = inner.g1.lookup(SeqHash(0)).unwrap();
        let slot = inner.g1.slot(id);
        (slot.hits, slot.last_used, inner.stats.device_hits)
    };
    let was = before(&bm);
    // Prefix [0], then two fresh blocks: block 1 goes to G2 (a copy in flight), block 100
    // is dropped; one slot free, one on its way.
    assert_eq!(bm.match_prefix(&[SeqHash(0), SeqHash(7)]).device, 1);
    let got = bm.admit(0, &[SeqHash(0), SeqHash(7)], 2);
    assert_eq!(got.err(), Some(AllocError::Pending));
    assert_eq!(before(&bm), was);
    assert_eq!(bm.usage(Tier::Device).inactive, 1, "block 0 is let go");
    bm.check_invariants().unwrap();
    // Once the copy is done, the same admission gets its blocks and counts its hit.
    let mut ready = Vec::new();
    bm.advance(u64::MAX / 2, &mut ready).unwrap();
    let (lease, found) = bm.admit(1, &[SeqHash(0), SeqHash(7)], 2).unwrap();
    assert_eq!((found.device, lease.len()), (1, 3));
    assert_eq!(before(&bm).0, was.0 + 1);
    assert_eq!(bm.stats().device_hits, was.2 + 1);
    drop(lease);
    bm.check_invariants().unwrap();
}

/// Two requests onboarding the same G2 blocks at once each copy them; the second copy to
/// land finds the hashes registered by the first, and its request shares those blocks
/// instead of keeping private copies the first request's blocks would be extended through.
#[test]
fn blocks_onboarded_twice_at_once_are_shared() {
    let bm = BlockManager::new(&config(4, 8));
    let c = chain(0, 2);
    drop(compute(&bm, 0, &c));
    drop(bm.acquire_prefix(&seqs(&c)).0);
    let mut other = bm.lease();
    assert_eq!(bm.allocate(1, &mut other, 4), Err(AllocError::Pending));
    let t = bm.next_wakeup_us().unwrap();
    bm.advance(t, &mut Vec::new()).unwrap();
    bm.allocate(t, &mut other, 4).unwrap();
    drop(other);
    assert_eq!(resident(&bm, Tier::Host), vec![0, 1]);
    let onboard = |bm: &BlockManager| {
        let (mut lease, found) = bm.admit(t, &seqs(&c), 2).unwrap();
        assert_eq!(found, PrefixMatch { device: 0, host: 2 });
        bm.start_onboard(t, &mut lease, 0);
        lease
    };
    let mut a = onboard(&bm);
    let mut b = onboard(&bm);
    let mut ready = Vec::new();
    bm.advance(bm.next_wakeup_us().unwrap(), &mut ready)
        .unwrap();
    assert_eq!(ready.len(), 2);
    bm.share_onboarded(&mut a, 0..2);
    bm.share_onboarded(&mut b, 0..2);
    assert_eq!(a.blocks(), b.blocks());
    let u = bm.usage(Tier::Device);
    assert_eq!((u.registered, u.mutable, u.free), (2, 0, 2));
    drop(a);
    assert_eq!(bm.usage(Tier::Device).inactive, 0, "B still holds them");
    drop(b);
    bm.check_invariants().unwrap();
}
