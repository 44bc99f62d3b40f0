use std::collections::BTreeSet;

use proptest::prelude::*;

use super::*;
use crate::indexer::{Config, Indexer};
use crate::protocol::{
    DpRank, KvEvent, KvEventData, LocalHash, Salt, SeqHash, SnapshotBlock, StoredBlock, Tier,
    WorkerId, seq_hash,
};

fn block(i: u64) -> StoredBlock {
    StoredBlock {
        seq: SeqHash(i),
        local: LocalHash(i),
    }
}

/// A batch of `Stored` events with ids `ids` (one block each, named by the id).
fn batch(epoch: u64, ids: std::ops::RangeInclusive<u64>) -> EventBatch {
    EventBatch {
        worker: WorkerId(1),
        dp_rank: DpRank(0),
        epoch,
        sent_unix_us: 0,
        events: ids
            .map(|id| KvEvent {
                id,
                tier: Tier::Device,
                data: KvEventData::Stored {
                    parent: None,
                    blocks: vec![block(id)],
                },
            })
            .collect(),
    }
}

fn applied_ids(out: &[Command]) -> Vec<u64> {
    out.iter()
        .flat_map(|c| match c {
            Command::Apply(b) => b.events.iter().map(|e| e.id).collect(),
            Command::ApplySnapshot(s) => s.to_batch().events.iter().map(|e| e.id).collect(),
            _ => Vec::new(),
        })
        .collect()
}

fn stream() -> WorkerStream {
    WorkerStream::new(StreamConfig {
        reorder_window: 3,
        ..StreamConfig::default()
    })
}

fn snapshot(epoch: u64, watermark: u64) -> Snapshot {
    Snapshot {
        worker: WorkerId(1),
        dp_rank: DpRank(0),
        epoch,
        watermark,
        blocks: (1..=watermark)
            .map(|i| SnapshotBlock {
                tier: Tier::Device,
                parent: None,
                block: block(i),
            })
            .collect(),
    }
}

#[test]
fn in_order_batches_apply_and_duplicates_are_dropped() {
    let mut s = stream();
    let mut out = Vec::new();
    s.on_batch(0, batch(7, 1..=3), &mut out);
    assert_eq!(out[0], Command::Reset, "first contact forgets stale state");
    s.on_batch(0, batch(7, 4..=5), &mut out);
    s.on_batch(0, batch(7, 2..=3), &mut out); // duplicate
    s.on_batch(0, batch(7, 5..=6), &mut out); // overlaps: only 6 is new
    assert_eq!(applied_ids(&out), vec![1, 2, 3, 4, 5, 6]);
    assert_eq!(s.stats().duplicates, 1);
    assert_eq!(s.next_id(), Some(7));
}

#[test]
fn reordered_batches_within_the_window_are_put_back_in_order() {
    let mut s = stream();
    let mut out = Vec::new();
    s.on_batch(0, batch(7, 1..=1), &mut out);
    s.on_batch(1, batch(7, 4..=4), &mut out);
    s.on_batch(2, batch(7, 3..=3), &mut out);
    assert_eq!(applied_ids(&out), vec![1]);
    s.on_batch(3, batch(7, 2..=2), &mut out);
    assert_eq!(applied_ids(&out), vec![1, 2, 3, 4]);
    s.on_tick(10_000, &mut out);
    assert!(s.is_live());
    assert_eq!(s.stats().gaps, 0);
}

#[test]
fn a_gap_resyncs_from_a_snapshot_and_replays_only_past_its_watermark() {
    let mut s = stream();
    let mut out = Vec::new();
    s.on_batch(0, batch(7, 1..=2), &mut out);
    // 3 is lost; 4..=7 arrive: the window (3) overflows.
    for id in 4..=7 {
        s.on_batch(1, batch(7, id..=id), &mut out);
    }
    assert!(out.contains(&Command::RequestSnapshot {
        epoch: 7,
        request: 1,
        wait_ms: 2_000
    }));
    assert!(!s.is_live());
    out.clear();
    s.on_batch(2, batch(7, 8..=9), &mut out); // buffered during the resync
    // Cut after the request: it covers 7, which the worker had sent before.
    s.on_snapshot(3, s.snapshot_request(), snapshot(7, 7), &mut out);
    assert_eq!(out[0], Command::Reset);
    let Command::ApplySnapshot(snap) = &out[1] else {
        panic!("{out:?}")
    };
    assert_eq!(snap.blocks.len(), 7);
    // Buffered 8..=9 follow it; 4..=7, in the snapshot, are duplicates.
    assert_eq!(applied_ids(&out[2..]), vec![8, 9]);
    assert_eq!(s.next_id(), Some(10));
    assert_eq!(s.stats().gaps, 1);
}

/// A batch held from before a resync's request with ids past its snapshot's watermark is
/// no batch the worker sent (the snapshot was cut after it had sent everything the router
/// had heard), and neither is a heartbeat's claim from then: kept, they would start the
/// resync over after every snapshot.
#[test]
fn evidence_from_before_a_request_past_its_snapshot_is_dropped() {
    let mut s = stream();
    let mut out = Vec::new();
    s.on_batch(0, batch(7, 1..=1), &mut out);
    s.on_batch(1, batch(7, 1_000_000..=1_000_000), &mut out);
    s.on_watermark(2, 7, 2_000_000, &mut out);
    s.on_tick(300, &mut out);
    assert!(!s.is_live(), "a gap: resyncing");
    out.clear();
    s.on_snapshot(400, s.snapshot_request(), snapshot(7, 1), &mut out);
    assert!(s.is_live());
    assert_eq!(s.stats().dropped_future, 1);
    out.clear();
    for now in [700, 1_200, 5_000] {
        s.on_tick(now, &mut out);
    }
    assert!(s.is_live(), "resyncing again: {out:?}");
    assert_eq!(s.stats().resyncs, 1);
}

#[test]
fn a_missing_batch_that_never_comes_is_a_gap_after_the_timeout() {
    let mut s = stream();
    let mut out = Vec::new();
    s.on_batch(0, batch(7, 1..=1), &mut out);
    s.on_batch(10, batch(7, 3..=3), &mut out);
    s.on_tick(100, &mut out);
    assert!(s.is_live());
    s.on_tick(10 + 250, &mut out);
    assert!(!s.is_live());
    assert_eq!(s.last_resync_reason(), Some(ResyncReason::Gap));
}

#[test]
fn a_lost_last_batch_is_caught_by_the_heartbeat_watermark() {
    let mut s = stream();
    let mut out = Vec::new();
    s.on_batch(0, batch(7, 1..=2), &mut out);
    // Batch 3..=4 lost; the worker's heartbeat says it sent up to 4.
    s.on_watermark(100, 7, 4, &mut out);
    assert!(s.is_live());
    s.on_watermark(400, 7, 4, &mut out);
    assert!(!s.is_live());
    // A heartbeat that matches what was applied is no alarm.
    let mut t = stream();
    t.on_batch(0, batch(7, 1..=2), &mut out);
    t.on_watermark(100, 7, 2, &mut out);
    t.on_tick(10_000, &mut out);
    assert!(t.is_live());
}

#[test]
fn stragglers_of_an_incarnation_never_seen_do_not_undo_the_restart() {
    // The router met the worker after its restart; a late batch of the old incarnation
    // (smaller epoch) arrives afterwards.
    let mut s = stream();
    let mut out = Vec::new();
    s.on_batch(0, batch(8, 1..=1), &mut out);
    out.clear();
    s.on_batch(1, batch(7, 3..=3), &mut out);
    assert!(out.is_empty());
    assert!(s.is_live());
    assert_eq!(s.stats().stale_epoch, 1);
    // The registry's heartbeat is authoritative about the current epoch, even a smaller one
    // (a clock stepped back across the restart).
    s.on_watermark(2, 5, 0, &mut out);
    assert_eq!(s.epoch(), Some(5));
    assert_eq!(out, vec![Command::Reset]);
}

/// A stale heartbeat of an older incarnation takes a stream back to that epoch (the
/// registry is trusted about the epoch): the snapshot it then asks for answers with the
/// worker's present epoch, which is adopted though retired, and the stream goes live there.
/// Refused as a past incarnation's, every answer was dropped and the resync never ended.
#[test]
fn a_snapshot_of_a_retired_epoch_answering_the_present_request_is_adopted() {
    let mut s = stream();
    let mut out = Vec::new();
    s.on_batch(0, batch(8, 5..=6), &mut out);
    s.on_watermark(1, 7, 40, &mut out);
    assert_eq!(s.epoch(), Some(7));
    out.clear();
    s.on_snapshot(2, s.snapshot_request(), snapshot(8, 10), &mut out);
    assert_eq!(s.epoch(), Some(8));
    assert!(s.is_live());
    s.on_batch(3, batch(8, 11..=11), &mut out);
    s.on_watermark(4, 8, 11, &mut out);
    assert_eq!((s.epoch(), s.next_id()), (Some(8), Some(12)));
    assert_eq!(applied_ids(&out).last(), Some(&11));
    // The epoch it left is retired in its turn: its stragglers are dropped, and an answer
    // from it (an old process still draining under the same id) is not taken back.
    out.clear();
    s.on_batch(5, batch(7, 41..=41), &mut out);
    assert!(out.is_empty());
    s.resync(6, &mut out);
    out.clear();
    s.on_snapshot(7, s.snapshot_request(), snapshot(7, 40), &mut out);
    assert_eq!(s.epoch(), Some(8));
    assert!(out.is_empty(), "{out:?}");
}

/// A device block outliving its parent (an LRU that is not leaf-first evicted the parent):
/// a replica that resyncs from the snapshot holds it as one that followed live does.
/// Replayed with its named parent, the index refused it, and once the worker stored the
/// parent again the live replica matched two blocks and the resynced one one.
#[test]
fn a_resync_keeps_a_device_block_whose_parent_was_evicted() {
    let stored = |id, parent: Option<u64>, b| EventBatch {
        events: vec![KvEvent {
            id,
            tier: Tier::Device,
            data: KvEventData::Stored {
                parent: parent.map(SeqHash),
                blocks: vec![block(b)],
            },
        }],
        ..batch(7, 1..=1)
    };
    let live = Indexer::new(Config::default()).unwrap();
    live.apply(&stored(1, None, 1));
    live.apply(&stored(2, Some(1), 2));
    live.apply(&EventBatch {
        events: vec![KvEvent {
            id: 3,
            tier: Tier::Device,
            data: KvEventData::Removed {
                blocks: vec![SeqHash(1)],
            },
        }],
        ..batch(7, 1..=1)
    });
    // The worker's snapshot now: block 2 alone, naming block 1 as its parent.
    let resynced = Indexer::new(Config::default()).unwrap();
    let snap = Snapshot {
        blocks: vec![SnapshotBlock {
            tier: Tier::Device,
            parent: Some(SeqHash(1)),
            block: block(2),
        }],
        ..snapshot(7, 3)
    };
    resynced.apply(&snap.to_batch());
    for ix in [&live, &resynced] {
        ix.apply(&stored(4, None, 1));
    }
    let matched = |ix: &Indexer| {
        ix.find_matches_seq(&[SeqHash(1), SeqHash(2)])
            .get(WorkerId(1), DpRank(0))
            .device
    };
    assert_eq!((matched(&live), matched(&resynced)), (2, 2));
    assert_eq!(resynced.dump(None).len(), live.dump(None).len());
}

#[test]
fn a_restart_from_id_1_needs_no_snapshot_and_old_stragglers_are_dropped() {
    let mut s = stream();
    let mut out = Vec::new();
    s.on_batch(0, batch(7, 1..=5), &mut out);
    out.clear();
    s.on_batch(1, batch(8, 1..=2), &mut out);
    assert_eq!(out[0], Command::Reset);
    assert_eq!(applied_ids(&out), vec![1, 2]);
    assert!(
        !out.iter()
            .any(|c| matches!(c, Command::RequestSnapshot { .. }))
    );
    out.clear();
    s.on_batch(2, batch(7, 6..=6), &mut out);
    assert!(out.is_empty());
    assert_eq!(s.stats().stale_epoch, 1);
}

/// A fetch that waited for its turn (the plane bounds fetches across streams) gets its
/// whole wait from when it was sent; one for another request changes nothing.
#[test]
fn a_snapshot_wait_runs_from_when_its_fetch_started() {
    let mut s = stream();
    let mut out = Vec::new();
    s.on_batch(0, batch(7, 5..=6), &mut out);
    out.clear();
    s.on_fetch_started(1_500, 0);
    s.on_fetch_started(1_500, 1);
    s.on_tick(2_000, &mut out);
    s.on_tick(3_499, &mut out);
    assert!(out.is_empty(), "{out:?}");
    s.on_tick(3_500, &mut out);
    assert_eq!(
        out,
        vec![Command::RequestSnapshot {
            epoch: 7,
            request: 1,
            wait_ms: 4_000
        }]
    );
}

#[test]
fn joining_mid_stream_resyncs_and_retries_an_unanswered_request() {
    let mut s = stream();
    let mut out = Vec::new();
    s.on_batch(0, batch(7, 5..=6), &mut out);
    assert_eq!(
        out,
        vec![
            Command::Reset,
            Command::RequestSnapshot {
                epoch: 7,
                request: 1,
                wait_ms: 2_000
            }
        ]
    );
    assert_eq!(s.last_resync_reason(), Some(ResyncReason::Join));
    out.clear();
    s.on_tick(2_000, &mut out);
    assert_eq!(
        out,
        vec![Command::RequestSnapshot {
            epoch: 7,
            request: 1,
            wait_ms: 4_000
        }]
    );
    assert_eq!(s.stats().snapshot_retries, 1);
    // Each retry waits twice as long as the one before, up to a cap: a worker slow to
    // answer (many replicas resyncing at once) is not asked ever faster than it answers.
    out.clear();
    s.on_tick(5_999, &mut out);
    assert!(out.is_empty());
    let mut asked = Vec::new();
    for now in (6_000..=200_000).step_by(1_000) {
        s.on_tick(now, &mut out);
        for c in out.drain(..) {
            if let Command::RequestSnapshot { wait_ms, .. } = c {
                asked.push((now, wait_ms));
            }
        }
    }
    assert_eq!(
        asked,
        vec![
            (6_000, 8_000),
            (14_000, 16_000),
            (30_000, 32_000),
            (62_000, 32_000),
            (94_000, 32_000),
            (126_000, 32_000),
            (158_000, 32_000),
            (190_000, 32_000)
        ]
    );
    out.clear();
    s.on_snapshot(200_100, s.snapshot_request(), snapshot(7, 5), &mut out);
    assert_eq!(applied_ids(&out[2..]), vec![6]);
    // A second answer to the retried request changes nothing.
    out.clear();
    s.on_snapshot(200_200, s.snapshot_request(), snapshot(7, 5), &mut out);
    assert!(out.is_empty());
}

#[test]
fn buffer_overflow_during_a_resync_starts_over() {
    let mut s = WorkerStream::new(StreamConfig {
        max_buffered_blocks: 4,
        ..StreamConfig::default()
    });
    let mut out = Vec::new();
    s.on_batch(0, batch(7, 5..=5), &mut out);
    s.on_batch(1, batch(7, 6..=10), &mut out);
    assert_eq!(s.stats().overflows, 1);
    assert_eq!(s.stats().resyncs, 2);
}

/// A snapshot asked for before the resync started over (its buffer overflowed and was
/// dropped) may be cut before the batches dropped with it: it is ignored, and the answer to
/// the new request resyncs the stream.
#[test]
fn an_answer_to_a_request_made_before_an_overflow_is_ignored() {
    let mut s = WorkerStream::new(StreamConfig {
        max_buffered_blocks: 4,
        ..StreamConfig::default()
    });
    let mut out = Vec::new();
    s.on_batch(0, batch(7, 5..=5), &mut out);
    let first = s.snapshot_request();
    // 6..=10 overflow the buffer: dropped, and a new request goes out.
    s.on_batch(1, batch(7, 6..=10), &mut out);
    let second = s.snapshot_request();
    assert!(second > first);
    assert!(out.contains(&Command::RequestSnapshot {
        epoch: 7,
        request: second,
        wait_ms: 2_000
    }));
    out.clear();
    // The first request's answer, cut at 5: taking it would go live at 6 with 6..=10 lost.
    s.on_snapshot(2, first, snapshot(7, 5), &mut out);
    assert!(out.is_empty(), "{out:?}");
    assert!(!s.is_live());
    s.on_snapshot(3, second, snapshot(7, 10), &mut out);
    assert!(s.is_live());
    assert_eq!(s.next_id(), Some(11));
}

/// The resync buffer is bounded by blocks: a single event naming many blocks overflows it
/// as surely as many events do (a cap of events let one stream hold gigabytes).
#[test]
fn one_event_of_many_blocks_overflows_the_resync_buffer() {
    let mut s = WorkerStream::new(StreamConfig {
        max_buffered_blocks: 4,
        ..StreamConfig::default()
    });
    let mut out = Vec::new();
    s.on_batch(0, batch(7, 5..=5), &mut out);
    let mut big = batch(7, 6..=6);
    big.events[0].data = KvEventData::Stored {
        parent: None,
        blocks: (0..10).map(block).collect(),
    };
    s.on_batch(1, big, &mut out);
    assert_eq!(s.stats().overflows, 1);
    assert_eq!(s.stats().resyncs, 2);
}

/// While live, batches held behind a gap count against the same bound in blocks: past it,
/// they are dropped and one resync starts at once. Kept into the resync a gap starts, they
/// overflowed its buffer at its first batch, which asked for a second snapshot and threw
/// away the first.
#[test]
fn blocks_held_behind_a_gap_while_live_are_bounded_too() {
    let mut s = WorkerStream::new(StreamConfig {
        max_buffered_blocks: 4,
        reorder_window: 3,
        ..StreamConfig::default()
    });
    let mut out = Vec::new();
    s.on_batch(0, batch(7, 1..=1), &mut out);
    assert!(s.is_live());
    let mut big = batch(7, 3..=3);
    big.events[0].data = KvEventData::Stored {
        parent: None,
        blocks: (0..10).map(block).collect(),
    };
    s.on_batch(1, big, &mut out);
    assert_eq!((s.stats().overflows, s.stats().resyncs), (1, 1));
    let request = s.snapshot_request();
    // What follows while the snapshot is on its way is held (within the bound) and kept.
    s.on_batch(2, batch(7, 4..=4), &mut out);
    s.on_batch(3, batch(7, 5..=5), &mut out);
    assert_eq!((s.stats().overflows, s.stats().resyncs), (1, 1));
    assert_eq!(s.snapshot_request(), request);
    out.clear();
    s.on_snapshot(4, request, snapshot(7, 3), &mut out);
    assert!(s.is_live());
    // The snapshot up to 3, then the batches held during the resync.
    assert_eq!(applied_ids(&out), vec![1, 2, 3, 4, 5]);
    assert_eq!(s.next_id(), Some(6));
}

#[test]
fn a_snapshot_of_a_newer_incarnation_is_adopted() {
    let mut s = stream();
    let mut out = Vec::new();
    s.on_batch(0, batch(7, 5..=5), &mut out);
    out.clear();
    s.on_snapshot(1, s.snapshot_request(), snapshot(9, 3), &mut out);
    assert_eq!(s.epoch(), Some(9));
    assert!(s.is_live());
    assert_eq!(s.next_id(), Some(4));
}

// ---- exactness under faults -------------------------------------------------------------

/// A worker that stores and removes chains of blocks, knows its resident set, and answers
/// snapshots at its current watermark.
struct Worker {
    epoch: u64,
    next_id: u64,
    resident: BTreeSet<(Tier, SeqHash)>,
    chains: Vec<Vec<StoredBlock>>,
}

impl Worker {
    fn new(epoch: u64) -> Self {
        Worker {
            epoch,
            next_id: 1,
            resident: BTreeSet::new(),
            chains: Vec::new(),
        }
    }

    fn emit(&mut self, op: u8, arg: u64) -> EventBatch {
        let mut events = Vec::new();
        let mut push = |tier, data| {
            events.push(KvEvent {
                id: self.next_id,
                tier,
                data,
            });
            self.next_id += 1;
        };
        match op % 3 {
            0 | 1 => {
                let tier = if op.is_multiple_of(3) {
                    Tier::Device
                } else {
                    Tier::Host
                };
                let mut parent = None;
                let chain: Vec<StoredBlock> = (0..1 + arg % 4)
                    .map(|i| {
                        let local = LocalHash((arg % 50).wrapping_mul(31) + i);
                        let seq = seq_hash(parent, local, Salt::NONE);
                        parent = Some(seq);
                        StoredBlock { seq, local }
                    })
                    .collect();
                for b in &chain {
                    self.resident.insert((tier, b.seq));
                }
                push(
                    tier,
                    KvEventData::Stored {
                        parent: None,
                        blocks: chain.clone(),
                    },
                );
                self.chains.push(chain);
            }
            _ => {
                if !self.chains.is_empty() {
                    let chain = self.chains.swap_remove(arg as usize % self.chains.len());
                    for tier in [Tier::Device, Tier::Host] {
                        for b in chain.iter().rev() {
                            self.resident.remove(&(tier, b.seq));
                        }
                        push(
                            tier,
                            KvEventData::Removed {
                                blocks: chain.iter().rev().map(|b| b.seq).collect(),
                            },
                        );
                    }
                }
            }
        }
        EventBatch {
            worker: WorkerId(1),
            dp_rank: DpRank(0),
            epoch: self.epoch,
            sent_unix_us: 0,
            events,
        }
    }

    fn snapshot(&self) -> Snapshot {
        // The test's chains are roots (parent None), so any order is parents-first.
        let blocks = self
            .resident
            .iter()
            .map(|(tier, seq)| SnapshotBlock {
                tier: *tier,
                parent: None,
                block: StoredBlock {
                    seq: *seq,
                    local: LocalHash(0),
                },
            })
            .collect();
        Snapshot {
            worker: WorkerId(1),
            dp_rank: DpRank(0),
            epoch: self.epoch,
            watermark: self.next_id - 1,
            blocks,
        }
    }
}

fn indexed(ix: &Indexer) -> BTreeSet<(Tier, SeqHash)> {
    ix.dump(None).into_iter().flat_map(|h| h.blocks).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("KVROUTE_PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(128)
    ))]

    /// Batches dropped, duplicated and reordered on the wire, snapshots answered late, the
    /// worker restarting: once the wire is quiet, the index equals the worker's resident set.
    #[test]
    fn prop_index_converges_to_the_worker_under_faults(
        ops in proptest::collection::vec((any::<u8>(), any::<u64>(), 0u8..100), 1..120),
        restart_at in proptest::option::of(0usize..120),
    ) {
        let ix = Indexer::new(Config::default()).unwrap();
        let mut worker = Worker::new(1);
        let mut stream = WorkerStream::new(StreamConfig::default());
        let mut wire: Vec<EventBatch> = Vec::new();
        let mut now = 0u64;
        let mut snapshot_wanted = false;
        let run = |commands: Vec<Command>, ix: &Indexer, snapshot_wanted: &mut bool| {
            for c in commands {
                match c {
                    Command::Reset => { ix.remove_rank(WorkerId(1), DpRank(0)); }
                    Command::Apply(b) => { ix.apply(&b); }
                    Command::ApplySnapshot(s) => { ix.apply(&s.to_batch()); }
                    Command::RequestSnapshot { .. } => *snapshot_wanted = true,
                }
            }
        };
        for (i, (op, arg, fault)) in ops.into_iter().enumerate() {
            now += 7;
            if restart_at == Some(i) {
                worker = Worker::new(worker.epoch + 1);
            }
            let batch = worker.emit(op, arg);
            if batch.events.is_empty() {
                continue;
            }
            match fault {
                0 => {}                                           // lost
                1..=3 => { wire.push(batch.clone()); wire.push(batch); } // duplicated
                4..=9 => wire.insert(wire.len().saturating_sub(2), batch), // reordered
                _ => wire.push(batch),
            }
            // Deliver most of what is on the wire, keeping a little in flight.
            while wire.len() > 2 {
                let mut out = Vec::new();
                stream.on_batch(now, wire.remove(0), &mut out);
                run(out, &ix, &mut snapshot_wanted);
            }
            if snapshot_wanted && fault % 3 == 0 {
                snapshot_wanted = false;
                let mut out = Vec::new();
                stream.on_snapshot(now, stream.snapshot_request(), worker.snapshot(), &mut out);
                run(out, &ix, &mut snapshot_wanted);
            }
        }
        // Quiet: deliver the rest, let heartbeats and timeouts do their work, answer
        // snapshots, until nothing moves.
        for b in wire.drain(..) {
            let mut out = Vec::new();
            stream.on_batch(now, b, &mut out);
            run(out, &ix, &mut snapshot_wanted);
        }
        for _ in 0..10 {
            now += 3_000;
            let mut out = Vec::new();
            stream.on_watermark(now, worker.epoch, worker.next_id - 1, &mut out);
            stream.on_tick(now + 1_000, &mut out);
            run(out, &ix, &mut snapshot_wanted);
            if snapshot_wanted {
                snapshot_wanted = false;
                let mut out = Vec::new();
                stream.on_snapshot(now, stream.snapshot_request(), worker.snapshot(), &mut out);
                run(out, &ix, &mut snapshot_wanted);
            }
        }
        prop_assert!(stream.is_live());
        prop_assert_eq!(indexed(&ix), worker.resident.clone());
    }
}

/// A past incarnation still draining under the same id answers the snapshot subject too: an
/// answer of an older epoch than the one followed is refused, even one never seen. Adopted,
/// it retired the present epoch, whose batches and heartbeats were then dropped for good.
#[test]
fn an_older_incarnation_s_answer_never_takes_the_stream() {
    let mut s = stream();
    let mut out = Vec::new();
    s.on_batch(0, batch(8, 5..=6), &mut out);
    assert!(!s.is_live());
    out.clear();
    s.on_snapshot(1, s.snapshot_request(), snapshot(7, 40), &mut out);
    assert_eq!(s.epoch(), Some(8));
    assert!(!s.is_live());
    assert!(out.is_empty(), "{out:?}");
    s.on_snapshot(2, s.snapshot_request(), snapshot(8, 4), &mut out);
    assert_eq!((s.epoch(), s.next_id()), (Some(8), Some(7)));
    assert_eq!(applied_ids(&out), vec![1, 2, 3, 4, 5, 6]);
}

/// A stale heartbeat of an older incarnation takes the stream to its epoch; the present
/// incarnation's next heartbeat takes it back, though its epoch was retired on the way, and
/// a snapshot fills what was dropped meanwhile. Before, that heartbeat was ignored and the
/// stream followed the stale incarnation for good.
#[test]
fn a_later_incarnation_s_heartbeat_takes_back_a_stream_a_stale_one_took() {
    let mut s = stream();
    let mut out = Vec::new();
    s.on_batch(0, batch(8, 1..=3), &mut out);
    s.on_watermark(1, 7, 0, &mut out);
    assert_eq!(s.epoch(), Some(7));
    s.on_batch(2, batch(8, 4..=4), &mut out);
    out.clear();
    s.on_watermark(3, 8, 4, &mut out);
    assert_eq!(s.epoch(), Some(8));
    assert!(
        out.iter()
            .any(|c| matches!(c, Command::RequestSnapshot { epoch: 8, .. })),
        "{out:?}"
    );
    out.clear();
    s.on_snapshot(4, s.snapshot_request(), snapshot(8, 4), &mut out);
    assert_eq!((s.epoch(), s.next_id()), (Some(8), Some(5)));
    s.on_batch(5, batch(8, 5..=5), &mut out);
    assert_eq!(applied_ids(&out), vec![1, 2, 3, 4, 5]);
}

/// Two processes under one id, the later (epoch 20) registered over the older (10), which
/// still runs; the later one dies. Once it has been silent for a lease the fleet registers
/// the older one again and passes on its heartbeat: the stream follows it though it retired
/// that epoch, and goes live from its snapshot. Ignored as a past incarnation's, the stream
/// stayed on the dead epoch for good: the older one's batches dropped as stale, its snapshots
/// refused as older, and a routable worker indexed as holding nothing.
#[test]
fn an_older_incarnation_registered_again_is_followed_though_retired() {
    let mut s = stream();
    let mut out = Vec::new();
    s.on_batch(0, batch(10, 1..=3), &mut out);
    s.on_watermark(1, 20, 0, &mut out);
    assert_eq!((s.epoch(), s.next_id()), (Some(20), Some(1)));
    s.on_batch(2, batch(10, 4..=4), &mut out);
    assert_eq!(s.stats().stale_epoch, 1);
    out.clear();
    s.on_watermark(60_000, 10, 6, &mut out);
    assert_eq!(s.epoch(), Some(10));
    assert_eq!(out.first(), Some(&Command::Reset), "{out:?}");
    assert!(
        out.iter()
            .any(|c| matches!(c, Command::RequestSnapshot { epoch: 10, .. })),
        "{out:?}"
    );
    out.clear();
    s.on_snapshot(60_001, s.snapshot_request(), snapshot(10, 6), &mut out);
    s.on_batch(60_002, batch(10, 7..=7), &mut out);
    assert_eq!((s.epoch(), s.next_id()), (Some(10), Some(8)));
    assert_eq!(applied_ids(&out), (1..=7).collect::<Vec<_>>());
    // The dead one's stragglers are now a retired epoch's: dropped.
    out.clear();
    s.on_batch(60_003, batch(20, 1..=1), &mut out);
    assert!(out.is_empty(), "{out:?}");
}

/// Events lost while a resync is under way (the transport dropped messages while its
/// snapshot was on its way) may lie past that snapshot's watermark: another resync follows
/// it, not a restart of the one under way (under a sustained loss every fetch would be
/// stopped before its answer). Forgotten, the stream went live past events it never saw.
#[test]
fn a_loss_during_a_resync_resyncs_again_once_its_snapshot_is_applied() {
    let mut s = stream();
    let mut out = Vec::new();
    s.on_batch(0, batch(7, 5..=6), &mut out);
    assert!(!s.is_live());
    let request = s.snapshot_request();
    out.clear();
    s.resync(1, &mut out);
    assert!(
        out.is_empty(),
        "the resync under way was started over: {out:?}"
    );
    s.on_snapshot(2, request, snapshot(7, 6), &mut out);
    assert!(
        out.iter()
            .any(|c| matches!(c, Command::RequestSnapshot { epoch: 7, .. })),
        "{out:?}"
    );
    assert!(!s.is_live());
    assert_eq!(s.last_resync_reason(), Some(ResyncReason::Requested));
    out.clear();
    s.on_snapshot(3, s.snapshot_request(), snapshot(7, 9), &mut out);
    assert_eq!(s.next_id(), Some(10));
    assert!(
        !out.iter()
            .any(|c| matches!(c, Command::RequestSnapshot { .. })),
        "{out:?}"
    );
}
