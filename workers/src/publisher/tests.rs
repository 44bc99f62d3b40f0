use kvroute::protocol::LocalHash;

use super::*;

fn stored(tier: Tier, parent: Option<u64>, seq: u64) -> Change {
    Change::Stored {
        tier,
        parent: parent.map(SeqHash),
        block: StoredBlock {
            seq: SeqHash(seq),
            local: LocalHash(seq + 1000),
        },
    }
}

fn removed(tier: Tier, seq: u64) -> Change {
    Change::Removed {
        tier,
        seq: SeqHash(seq),
    }
}

#[test]
fn coalesces_chains_and_numbers_without_gaps() {
    let mut p = Publisher::new(WorkerId(1), DpRank(0), 77);
    p.record(&[
        stored(Tier::Device, None, 1),
        stored(Tier::Device, Some(1), 2),
        stored(Tier::Device, Some(2), 3),
        stored(Tier::Device, Some(1), 4), // a branch: new event
        removed(Tier::Device, 3),
        removed(Tier::Device, 2),
        stored(Tier::Host, Some(1), 2),
    ]);
    let batch = p.flush(5).unwrap();
    assert_eq!(batch.epoch, 77);
    let ids: Vec<u64> = batch.events.iter().map(|e| e.id).collect();
    assert_eq!(ids, vec![1, 2, 3, 4]);
    assert_eq!(batch.events[0].data.block_count(), 3);
    assert_eq!(
        batch.events[2].data,
        KvEventData::Removed {
            blocks: vec![SeqHash(3), SeqHash(2)]
        }
    );
    assert_eq!(batch.events[3].tier, Tier::Host);
    assert!(p.flush(6).is_none());
    p.record(&[removed(Tier::Host, 2)]);
    assert_eq!(p.flush(7).unwrap().first_id(), Some(5));
    assert_eq!(p.last_event_id(), 5);
}

#[test]
fn announced_keeps_only_what_alters_the_set() {
    let mut a = Announced::default();
    let mut out = Vec::new();
    a.filter(&[removed(Tier::Device, 9)], &mut out);
    assert!(out.is_empty());
    assert_eq!(a.unannounced_removals(), 1);
    // Announced twice, removed once per announcement: one change each way.
    a.filter(
        &[stored(Tier::Device, None, 1), stored(Tier::Device, None, 1)],
        &mut out,
    );
    assert_eq!(out, vec![stored(Tier::Device, None, 1)]);
    out.clear();
    a.filter(&[removed(Tier::Device, 1)], &mut out);
    assert!(out.is_empty());
    assert_eq!(a.blocks().count(), 1);
    assert_eq!(a.resident(Tier::Device), 1);
    a.filter(&[removed(Tier::Device, 1)], &mut out);
    assert_eq!(out, vec![removed(Tier::Device, 1)]);
    assert_eq!(a.blocks().count(), 0);
    assert_eq!(a.resident(Tier::Device), 0);
    // The same hash in another tier is another block.
    out.clear();
    a.filter(
        &[stored(Tier::Device, None, 2), stored(Tier::Host, None, 2)],
        &mut out,
    );
    assert_eq!(out.len(), 2);
    assert_eq!(
        Tier::ALL.map(|t| a.resident(t)),
        [1, 1, 0, 0],
        "the count per tier is the announced set's"
    );
    a.filter(&[removed(Tier::Host, 2), removed(Tier::Disk, 2)], &mut out);
    assert_eq!(Tier::ALL.map(|t| a.resident(t)), [1, 0, 0, 0]);
}

/// The set holds at most what one snapshot carries, (tier, block) pairs: the same blocks
/// in two tiers past the limit made a snapshot every router refuses. Stores past it are
/// not announced, and the map gives its room back once the blocks go.
#[test]
fn announced_stops_at_the_snapshot_limit_and_shrinks() {
    let mut a = Announced::with_max(3);
    let mut out = Vec::new();
    a.filter(
        &[
            stored(Tier::Device, None, 1),
            stored(Tier::Device, Some(1), 2),
            stored(Tier::Host, None, 1),
            stored(Tier::Host, Some(1), 2),
            // Announced already: a repeat, not a new pair.
            stored(Tier::Device, None, 1),
        ],
        &mut out,
    );
    assert_eq!(out.len(), 3);
    assert_eq!(a.capped(), 1);
    assert_eq!(a.blocks().count(), 3);
    assert_eq!(a.resident(Tier::Host), 1);
    // Room again once one goes.
    out.clear();
    a.filter(
        &[removed(Tier::Device, 2), stored(Tier::Host, Some(1), 2)],
        &mut out,
    );
    assert_eq!(out.len(), 2);
    assert_eq!(a.capped(), 1);

    let mut a = Announced::default();
    let n = 100_000u64;
    let stores: Vec<Change> = (0..n).map(|i| stored(Tier::Device, None, i)).collect();
    a.filter(&stores, &mut out);
    let peak = a.capacity();
    assert!(peak >= n as usize);
    let removals: Vec<Change> = (0..n).map(|i| removed(Tier::Device, i)).collect();
    a.filter(&removals, &mut out);
    assert!(a.capacity() < peak / 16, "{} of {peak}", a.capacity());
}

#[test]
fn splits_events_at_the_block_cap() {
    let mut p = Publisher::new(WorkerId(1), DpRank(0), 1);
    let changes: Vec<Change> = (0..MAX_EVENT_BLOCKS as u64 + 10)
        .map(|i| stored(Tier::Device, i.checked_sub(1), i))
        .collect();
    p.record(&changes);
    let b = p.flush(0).unwrap();
    assert_eq!(b.events.len(), 2);
    let KvEventData::Stored { parent, .. } = &b.events[1].data else {
        panic!()
    };
    assert_eq!(*parent, Some(SeqHash(MAX_EVENT_BLOCKS as u64 - 1)));
}

#[test]
fn snapshot_orders_parents_first_with_watermark() {
    let mut p = Publisher::new(WorkerId(1), DpRank(0), 3);
    let mut a = Announced::default();
    let mut fresh = Vec::new();
    a.filter(
        &[
            stored(Tier::Device, None, 1),
            stored(Tier::Device, Some(1), 2),
            stored(Tier::Device, Some(2), 3),
            stored(Tier::Device, Some(1), 4),
            stored(Tier::Host, Some(50), 60), // continuation of a block G2 does not hold
            removed(Tier::Device, 3),
        ],
        &mut fresh,
    );
    p.record(&fresh);
    let batch = p.flush(0).unwrap();
    let snap = p.snapshot(a.blocks());
    assert_eq!(snap.epoch, 3);
    assert_eq!(snap.watermark, batch.last_id().unwrap());
    let mut seen = std::collections::HashSet::new();
    for b in &snap.blocks {
        let (tier, parent, block) = (&b.tier, &b.parent, &b.block);
        if let Some(parent) = parent
            && *tier == Tier::Device
        {
            assert!(seen.contains(parent), "{parent:?} after its child");
        }
        seen.insert(block.seq);
    }
    let mut seqs: Vec<u64> = snap.blocks.iter().map(|b| b.block.seq.0).collect();
    seqs.sort();
    assert_eq!(seqs, vec![1, 2, 4, 60]);
}

/// A worker back as a new incarnation with blocks it announced before starts its ids at 2:
/// a router that joins it sees id 1 missing and fetches the snapshot carrying them (from
/// id 1 it would go live with nothing). Without such blocks, ids start at 1.
#[test]
fn a_renumbered_stream_that_carries_blocks_skips_id_one() {
    let mut p = Publisher::new(WorkerId(1), DpRank(0), 3);
    p.record(&[stored(Tier::Device, None, 1)]);
    p.flush(0).unwrap();
    let mut carried = p.renumbered(4, true);
    assert_eq!((carried.epoch(), carried.last_event_id()), (4, 1));
    assert_eq!(carried.snapshot(std::iter::empty()).watermark, 1);
    carried.record(&[stored(Tier::Device, None, 2)]);
    assert_eq!(carried.flush(0).unwrap().first_id(), Some(2));
    let mut empty = p.renumbered(5, false);
    assert_eq!(empty.last_event_id(), 0);
    empty.record(&[stored(Tier::Device, None, 2)]);
    assert_eq!(empty.flush(0).unwrap().first_id(), Some(1));
}
