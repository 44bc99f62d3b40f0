use std::time::Duration;

use super::*;
use crate::events::transport::LocalBus;
use crate::indexer::{Overlap, OverlapScores};
use crate::protocol::{DpRank, Salt, WorkerId, hash_blocks};
use crate::scheduler::{Config, RouteRequest};

fn scheduler(replica: u64) -> Scheduler {
    let mut s = Scheduler::new(Config {
        replica_id: replica,
        ..Config::default()
    })
    .unwrap();
    s.add_worker((WorkerId(1), DpRank(0)), 1000, "m");
    s
}

/// A 64-token request for model "m" (4 blocks of 16).
fn request<'a>(
    blocks: &'a [crate::protocol::BlockHash],
    overlaps: &'a OverlapScores,
) -> RouteRequest<'a> {
    RouteRequest {
        model: "m",
        blocks,
        prompt_tokens: 64,
        block_size: 16,
        overlaps,
        max_tokens: 16,
        n: 1,
        session: None,
    }
}

/// Load sharing as the tests run it: heartbeats every 100 ms, a replica gone after 1 s.
/// Replica `id` of cluster `t` on `bus`, sharing load with `fast_share_config`: its
/// scheduler, its load share, and the sender that stops it.
async fn replica(
    bus: &Transport,
    id: u64,
) -> (Arc<Mutex<Scheduler>>, LoadShare, watch::Sender<bool>) {
    let (stop, rx) = watch::channel(false);
    let s = Arc::new(Mutex::new(scheduler(id)));
    let share = LoadShare::start(bus.clone(), "t", Arc::clone(&s), fast_share_config(), rx)
        .await
        .unwrap();
    (s, share, stop)
}

fn fast_share_config() -> LoadShareConfig {
    LoadShareConfig {
        heartbeat_ms: 100,
        replica_ttl_ms: 1_000,
        flush_ms: 2,
        max_pending: 1024,
    }
}

/// The blocks of a 64-token prompt.
fn prompt_blocks() -> Vec<crate::protocol::BlockHash> {
    hash_blocks(
        &[1; 64],
        std::num::NonZeroUsize::new(16).unwrap(),
        Salt::NONE,
    )
}

fn shared(origin: u64, seq: u64, blocks: usize, prefill: f64) -> SharedBooking {
    SharedBooking {
        id: BookingId { origin, seq },
        worker: WorkerId(1),
        dp_rank: DpRank(0),
        prefill_blocks: prefill,
        blocks: (0..blocks as u64).map(crate::protocol::SeqHash).collect(),
        tail: false,
        prefill_tokens: 0.0,
        decode_tokens: 0,
        session: None,
    }
}

#[test]
fn the_outbox_sheds_bookings_before_completions() {
    let mut o = Outbox::new(3);
    assert!(o.push(LoadMessage::Book {
        booking: shared(1, 1, 1, 1.0)
    }));
    assert!(!o.push(LoadMessage::Complete {
        id: BookingId { origin: 1, seq: 9 }
    }));
    o.push(LoadMessage::FirstToken {
        id: BookingId { origin: 1, seq: 1 },
    });
    o.push(LoadMessage::Complete {
        id: BookingId { origin: 1, seq: 10 },
    });
    o.push(LoadMessage::Complete {
        id: BookingId { origin: 1, seq: 11 },
    });
    assert_eq!(o.len(), 3);
    assert_eq!(o.shed(), 2);
    let all: Vec<LoadMessage> = o
        .drain_payloads(1 << 20)
        .iter()
        .flat_map(|p| decode_load(p).unwrap())
        .collect();
    assert!(
        all.iter()
            .all(|m| matches!(m, LoadMessage::Complete { .. })),
        "{all:?}"
    );
    // With only completions left, the oldest completion goes.
    let mut o = Outbox::new(1);
    o.push(LoadMessage::Complete {
        id: BookingId { origin: 1, seq: 1 },
    });
    o.push(LoadMessage::Complete {
        id: BookingId { origin: 1, seq: 2 },
    });
    assert_eq!(o.len(), 1);
}

/// Operations kept apart for shedding still go out in the order they were queued: a peer
/// sees a booking before its first token and completion.
#[test]
fn a_full_outbox_sheds_in_constant_time_and_drains_in_order() {
    let id = |seq| BookingId { origin: 1, seq };
    let mut o = Outbox::new(4);
    o.push(LoadMessage::Complete { id: id(1) });
    o.push(LoadMessage::Book {
        booking: shared(1, 2, 1, 1.0),
    });
    o.push(LoadMessage::FirstToken { id: id(2) });
    o.push(LoadMessage::Complete { id: id(2) });
    // Full: the oldest booking goes for the heartbeat.
    o.push(LoadMessage::Heartbeat {
        replica: 1,
        open: Vec::new(),
        next: 3,
    });
    assert_eq!((o.len(), o.shed()), (4, 1));
    let kinds: Vec<String> = o
        .drain_payloads(1 << 20)
        .iter()
        .flat_map(|p| decode_load(p).unwrap())
        .map(|m| match m {
            LoadMessage::Book { booking } => format!("book {}", booking.id.seq),
            LoadMessage::FirstToken { id } => format!("first {}", id.seq),
            LoadMessage::Complete { id } => format!("complete {}", id.seq),
            LoadMessage::Heartbeat { .. } => "heartbeat".into(),
            LoadMessage::Want { .. } => "want".into(),
        })
        .collect();
    assert_eq!(kinds, ["complete 1", "first 2", "complete 2", "heartbeat"]);
    assert!(o.is_empty());
}

#[test]
fn a_flush_splits_under_the_payload_limit_and_keeps_order() {
    let mut o = Outbox::new(10_000);
    for seq in 0..500 {
        o.push(LoadMessage::Book {
            booking: shared(1, seq, 20, 1.0),
        });
    }
    let limit = 16 << 10;
    let payloads = o.drain_payloads(limit);
    assert!(payloads.len() > 1, "{} payloads", payloads.len());
    assert!(payloads.iter().all(|p| p.len() <= limit));
    let seqs: Vec<u64> = payloads
        .iter()
        .flat_map(|p| decode_load(p).unwrap())
        .map(|m| match m {
            LoadMessage::Book { booking } => booking.id.seq,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(seqs, (0..500).collect::<Vec<_>>());
    // A booking too large for any message goes with the first blocks that fit, its load
    // and work whole (it was shed: peers never saw the heaviest requests), and a peer
    // books it.
    let big = SharedBooking {
        prefill_tokens: 150_000.0,
        decode_tokens: 64,
        ..shared(1, 1, 10_000, 9_000.0)
    };
    o.push(LoadMessage::Book {
        booking: big.clone(),
    });
    let payloads = o.drain_payloads(limit);
    assert_eq!(payloads.len(), 1);
    assert!(payloads[0].len() <= limit);
    let [LoadMessage::Book { booking }] = &decode_load(&payloads[0]).unwrap()[..] else {
        panic!("not one booking");
    };
    assert!(
        booking.blocks.len() > 500,
        "{} blocks",
        booking.blocks.len()
    );
    assert_eq!(booking.blocks[..], big.blocks[..booking.blocks.len()]);
    assert_eq!(
        (
            booking.prefill_blocks,
            booking.prefill_tokens,
            booking.decode_tokens
        ),
        (9_000.0, 150_000.0, 64)
    );
    let mut peer = scheduler(0);
    peer.book_shared(0, booking.clone()).unwrap();
    assert_eq!(
        peer.load((WorkerId(1), DpRank(0))).unwrap().prefill_blocks,
        9_000.0
    );
    assert_eq!(o.shed(), 0);
    // Under a limit nothing fits in, it is shed, not sent over the limit.
    o.push(LoadMessage::Book { booking: big });
    assert!(o.drain_payloads(64).is_empty());
    assert_eq!(o.shed(), 1);
}

#[test]
fn peers_bookings_are_validated() {
    let mut s = scheduler(0);
    let mut peers = Peers::default();
    let bad = [
        shared(7, 1, 4, f64::NAN),
        shared(7, 2, 4, -1.0),
        shared(7, 3, 4, 1e12),
        SharedBooking {
            worker: WorkerId(99),
            ..shared(7, 4, 4, 1.0)
        },
    ];
    let ops = bad
        .into_iter()
        .map(|booking| LoadMessage::Book { booking })
        .collect();
    peers.on_message(0, 0, ops, &mut s);
    assert_eq!(s.open_bookings(), 0);
    peers.on_message(
        0,
        0,
        vec![LoadMessage::Book {
            booking: shared(7, 5, 4, 2.0),
        }],
        &mut s,
    );
    assert_eq!(s.open_bookings(), 1);
}

/// One peer holds at most MAX_PEER_BOOKINGS bookings here (and MAX_PEER_BLOCKS blocks,
/// checked the same way; not exercised: 16 M blocks): past that its bookings are refused (a faulty or forged peer cannot grow the
/// scheduler without bound); what it completes makes room again; other peers are not
/// held back by it.
#[test]
fn a_peer_s_open_bookings_are_bounded() {
    use crate::scheduler::{MAX_PEER_BOOKINGS, SharedBookingError};
    let mut s = scheduler(0);
    for seq in 0..MAX_PEER_BOOKINGS as u64 {
        s.book_shared(0, shared(7, seq, 0, 0.0)).unwrap();
    }
    assert!(matches!(
        s.book_shared(0, shared(7, u64::MAX, 0, 0.0)),
        Err(SharedBookingError::PeerFull { origin: 7, .. })
    ));
    s.book_shared(0, shared(8, 0, 1, 1.0)).unwrap();
    s.complete(BookingId { origin: 7, seq: 0 });
    s.book_shared(0, shared(7, u64::MAX, 0, 0.0)).unwrap();
    for seq in 1..MAX_PEER_BOOKINGS as u64 {
        s.complete(BookingId { origin: 7, seq });
    }
    s.complete(BookingId {
        origin: 7,
        seq: u64::MAX,
    });
    assert_eq!(s.open_bookings(), 1, "peer 8's booking");
}

/// A replica that routes nothing still keeps its peers' bookings' age queue bounded by
/// what is open: its ticks expire them.
#[test]
fn an_idle_replica_s_age_queue_stays_bounded() {
    let mut s = scheduler(0);
    let mut peers = Peers::default();
    for seq in 0..100_000 {
        s.book_shared(0, shared(7, seq, 1, 1.0)).unwrap();
        s.complete(BookingId { origin: 7, seq });
        if seq % 1000 == 0 {
            peers.on_tick(0, 5_000, &mut s);
        }
    }
    peers.on_tick(0, 5_000, &mut s);
    assert!(s.age_queue_len() <= 64, "{} entries", s.age_queue_len());
}

#[test]
fn a_heartbeat_drops_what_its_replica_no_longer_holds() {
    let mut s = scheduler(0);
    let mut peers = Peers::default();
    let ops = (1..=5)
        .map(|seq| LoadMessage::Book {
            booking: shared(7, seq, 2, 1.0),
        })
        .collect();
    peers.on_message(0, 0, ops, &mut s);
    assert_eq!(s.open_bookings(), 5);
    // Replica 7 holds 2 and 4 of those below 6 (its completions of the others were lost).
    let beat = LoadMessage::Heartbeat {
        replica: 7,
        open: vec![(2, 2), (4, 4)],
        next: 6,
    };
    peers.on_message(1, 0, vec![beat], &mut s);
    assert_eq!(s.open_seqs(7), vec![2, 4]);
    // A booking newer than the heartbeat is not touched.
    peers.on_message(
        2,
        0,
        vec![LoadMessage::Book {
            booking: shared(7, 6, 2, 1.0),
        }],
        &mut s,
    );
    let beat = LoadMessage::Heartbeat {
        replica: 7,
        open: vec![(2, 2)],
        next: 6,
    };
    peers.on_message(3, 0, vec![beat], &mut s);
    assert_eq!(s.open_seqs(7), vec![2, 6]);
}

/// A message of many heartbeats costs one reconcile per replica, with its last (freshest)
/// heartbeat: an earlier one claiming nothing open drops nothing. Replica ids beyond
/// [`MAX_PEERS`] are refused, not kept to be dropped with a warning each.
#[test]
fn one_heartbeat_per_replica_counts_and_peers_are_bounded() {
    let mut s = scheduler(0);
    let mut peers = Peers::default();
    let ops = (1..=3)
        .map(|seq| LoadMessage::Book {
            booking: shared(7, seq, 2, 1.0),
        })
        .collect();
    peers.on_message(0, 0, ops, &mut s);
    let beat = |open: Vec<(u64, u64)>| LoadMessage::Heartbeat {
        replica: 7,
        open,
        next: 4,
    };
    let mut flood: Vec<LoadMessage> = (0..1000).map(|_| beat(Vec::new())).collect();
    flood.push(beat(vec![(1, 3)]));
    peers.on_message(1, 0, flood, &mut s);
    assert_eq!(s.open_seqs(7), vec![1, 2, 3]);
    let forged = (0..2 * MAX_PEERS as u64)
        .map(|replica| LoadMessage::Heartbeat {
            replica: 1000 + replica,
            open: Vec::new(),
            next: 0,
        })
        .collect();
    peers.on_message(2, 0, forged, &mut s);
    assert_eq!(peers.len(), MAX_PEERS);
    assert_eq!(s.open_seqs(7), vec![1, 2, 3], "a known replica is kept");
}

#[test]
fn ranges_and_coarsening_never_claim_fewer_open_bookings() {
    let r = ranges(&[1, 2, 3, 7, 9, 10]);
    assert_eq!(r, vec![(1, 3), (7, 7), (9, 10)]);
    let c = coarsen(r.clone(), 2);
    assert_eq!(c, vec![(1, 3), (7, 10)]);
    for seq in [1, 2, 3, 7, 9, 10] {
        assert!(c.iter().any(|(a, b)| (*a..=*b).contains(&seq)));
    }
    // The one-pass merge closes the smallest gaps, the earlier of equal ones first, as
    // merging the closest pair again and again would.
    let r = vec![(0, 0), (2, 2), (4, 4), (10, 10), (13, 13), (30, 30)];
    assert_eq!(coarsen(r.clone(), 3), vec![(0, 4), (10, 13), (30, 30)]);
    assert_eq!(
        coarsen(r.clone(), 5),
        vec![(0, 2), (4, 4), (10, 10), (13, 13), (30, 30)]
    );
    assert_eq!(coarsen(r.clone(), 1), vec![(0, 30)]);
    assert_eq!(coarsen(r.clone(), 10), r);
}

/// A peer's heartbeat ranges, sorted or not, overlapping or not: the bookings they do not
/// name are completed, those they name stay.
#[test]
fn reconciling_with_a_heartbeat_keeps_exactly_the_named_bookings() {
    for open in [
        vec![(2, 3), (6, 6)],
        vec![(6, 6), (2, 3)],
        vec![(2, 2), (2, 3), (6, 6), (3, 3)],
    ] {
        let mut s = scheduler(1);
        for seq in 1..=8 {
            s.book_shared(0, shared(7, seq, 2, 1.0)).unwrap();
        }
        s.reconcile_origin(7, &open, 8, 0);
        assert_eq!(s.open_seqs(7), vec![2, 3, 6, 8], "{open:?}");
    }
}

/// A peer's booking it keeps naming in its heartbeats runs on past the booking TTL (a long
/// stream on a live peer); one it stops naming is completed, and one whose peer says
/// nothing more expires with the TTL, the backstop.
#[test]
fn a_booking_a_live_peer_still_holds_outlives_the_ttl() {
    let mut s = scheduler(1);
    let ttl = 600_000;
    s.book_shared(0, shared(7, 1, 2, 1.0)).unwrap();
    s.book_shared(0, shared(8, 1, 2, 1.0)).unwrap();
    // Heartbeats every 100 s name peer 7's booking; peer 8 says nothing more.
    for t in (100_000..=2 * ttl).step_by(100_000) {
        s.reconcile_origin(7, &[(1, 1)], 2, t);
        s.expire(t);
    }
    assert_eq!(s.open_seqs(7), vec![1], "the live peer's booking expired");
    assert!(
        s.open_seqs(8).is_empty(),
        "the silent peer's booking outlived the TTL"
    );
    s.reconcile_origin(7, &[], 2, 2 * ttl);
    assert!(s.open_seqs(7).is_empty());
}

/// A replica that stops heartbeating loses its bookings on its peers after the replica
/// TTL (paused clock: no wall-clock wait), and a live one's survive.
#[tokio::test(start_paused = true)]
async fn a_silent_replica_loses_its_bookings_after_the_ttl() {
    let bus = Transport::Local(LocalBus::new());
    let (a, share_a, stop_a) = replica(&bus, 1).await;
    let (b, _share_b, _stop_b) = replica(&bus, 2).await;
    let blocks = prompt_blocks();
    let overlaps = OverlapScores {
        workers: vec![Overlap {
            worker: WorkerId(1),
            dp_rank: DpRank(0),
            device: 0,
            host: 0,
            disk: 0,
        }],
    };
    let request = request(&blocks, &overlaps);
    let decision = a.lock().route(0, &request).unwrap();
    share_a.booked(decision.booking);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(b.lock().open_bookings(), 1, "the booking reached the peer");
    // A keeps heartbeating: its booking stays on B well past the TTL.
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    assert_eq!(b.lock().open_bookings(), 1);
    // A goes silent: after the TTL its booking is gone from B.
    stop_a.send(true).unwrap();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(b.lock().open_bookings(), 0);
}

/// A replica sharing load on `bus` (cluster `t`, heartbeats an hour apart, flushes 5 ms
/// after an update), and a subscription to what it sends, past its first heartbeat.
async fn quiet_share(
    bus: &Transport,
) -> (
    LoadShare,
    crate::events::transport::Subscription,
    watch::Sender<bool>,
) {
    let mut watch_bus = bus.subscribe(&load_subject("t")).await.unwrap();
    let config = LoadShareConfig {
        heartbeat_ms: 3_600_000,
        flush_ms: 5,
        ..LoadShareConfig::default()
    };
    let (stop, rx) = watch::channel(false);
    let s = Arc::new(Mutex::new(scheduler(1)));
    let share = LoadShare::start(bus.clone(), "t", s, config, rx)
        .await
        .unwrap();
    // The first heartbeat goes out at start.
    let first = watch_bus.next().await.unwrap();
    assert!(matches!(
        decode_load(&first.payload).unwrap()[0],
        LoadMessage::Heartbeat { .. }
    ));
    (share, watch_bus, stop)
}

/// Updates made within one flush window leave as one message.
#[tokio::test(start_paused = true)]
async fn updates_within_a_flush_window_go_out_as_one_message() {
    let bus = Transport::Local(LocalBus::new());
    let (share, mut watch_bus, _stop) = quiet_share(&bus).await;
    for seq in 1..=10 {
        share.completed(BookingId { origin: 1, seq });
    }
    let message = watch_bus.next().await.unwrap();
    assert_eq!(decode_load(&message.payload).unwrap().len(), 10);
}

/// A server that takes no messages holds a flush for at most the publish wait: what that
/// flush held is dropped, not sent late, and the next update goes out once the server takes
/// messages again (paused clock).
#[tokio::test(start_paused = true)]
async fn a_server_that_takes_nothing_costs_a_flush_at_most_the_publish_wait() {
    let local = LocalBus::new();
    let (share, mut watch_bus, _stop) = quiet_share(&Transport::Local(local.clone())).await;
    local.held.set(true);
    share.completed(BookingId { origin: 1, seq: 1 });
    // The flush waits on the held server for PUBLISH_WAIT, then gives its message up.
    tokio::time::sleep(PUBLISH_WAIT + Duration::from_millis(100)).await;
    local.held.set(false);
    share.completed(BookingId { origin: 1, seq: 2 });
    let message = watch_bus.next().await.unwrap();
    assert_eq!(
        decode_load(&message.payload).unwrap(),
        vec![LoadMessage::Complete {
            id: BookingId { origin: 1, seq: 2 }
        }],
        "the held flush's update was sent late, or the next was lost"
    );
}

/// A replica restarted under its pinned id (a StatefulSet pod) numbers its bookings past
/// its previous life's: its first booking is not mistaken for an old one that peers still
/// hold, and its first heartbeat drops every old booking at once.
#[test]
fn a_replica_restarted_under_its_pinned_id_leaves_no_booking_of_its_previous_life() {
    let blocks = prompt_blocks();
    let overlaps = OverlapScores::default();
    let request = request(&blocks, &overlaps);
    let mut peer = scheduler(0);
    let mut peers = Peers::default();
    let mut book = |replica: &mut Scheduler, peer: &mut Scheduler, now_ms: u64| {
        let id = replica.route(now_ms, &request).unwrap().booking;
        let booking = replica.shared(id).unwrap();
        peers.on_message(now_ms, 0, vec![LoadMessage::Book { booking }], peer);
        id.seq
    };
    // Replica 7's first life, started at t = 1,000 s, books three requests; then it dies.
    let mut first = scheduler(7);
    first.number_bookings_from(1_000_000);
    for at in 0..3 {
        book(&mut first, &mut peer, at);
    }
    assert_eq!(peer.open_seqs(7).len(), 3);
    // Restarted 2 s later under the same id, it books one request and heartbeats.
    let mut second = scheduler(7);
    second.number_bookings_from(1_002_000);
    let seq = book(&mut second, &mut peer, 10);
    let beat = LoadMessage::Heartbeat {
        replica: 7,
        open: ranges(&second.open_seqs(7)),
        next: second.next_seq(),
    };
    peers.on_message(11, 0, vec![beat], &mut peer);
    assert_eq!(peer.open_seqs(7), vec![seq]);
}

/// A peer's large message is applied in parts of bounded work (the reader hands the
/// scheduler's lock to waiting routes in between), and the parts do what the whole does.
#[test]
fn a_large_message_is_applied_in_parts_of_bounded_work() {
    let ops = || {
        let mut ops: Vec<LoadMessage> = (0..40)
            .map(|seq| LoadMessage::Book {
                booking: shared(7, seq, 512, 1.0),
            })
            .collect();
        ops.extend((0..10).map(|seq| LoadMessage::Complete {
            id: BookingId { origin: 7, seq },
        }));
        ops.push(LoadMessage::Heartbeat {
            replica: 7,
            open: vec![(10, 19), (30, 39)],
            next: 40,
        });
        ops
    };
    let mut whole = scheduler(0);
    Peers::default().on_message(0, 0, ops(), &mut whole);
    assert_eq!(whole.open_bookings(), 20);

    let mut parted = scheduler(0);
    let mut peers = Peers::default();
    let mut incoming = Peers::take(0, ops());
    let mut parts = 0;
    loop {
        parts += 1;
        let work: Vec<usize> = incoming.ops.iter().map(LoadMessage::work).collect();
        let more = peers.apply(0, &mut incoming, &mut parted, APPLY_BUDGET);
        // A part stops at the first operation that reaches the budget.
        let applied = work.len() - incoming.len();
        assert!(applied >= 1);
        assert!(work[..applied - 1].iter().sum::<usize>() < APPLY_BUDGET);
        if !more {
            break;
        }
    }
    assert!(incoming.is_empty());
    assert!(parts >= 40 * 513 / APPLY_BUDGET, "{parts} parts");
    assert_eq!(parted.open_seqs(7), whole.open_seqs(7));
    assert_eq!(parted.open_bookings(), 20);

    // An operation over the whole budget still goes through, alone.
    let mut incoming = Peers::take(
        0,
        vec![
            LoadMessage::Book {
                booking: shared(8, 0, 4 * APPLY_BUDGET, 1.0),
            },
            LoadMessage::Complete {
                id: BookingId { origin: 8, seq: 0 },
            },
        ],
    );
    assert!(peers.apply(1, &mut incoming, &mut parted, APPLY_BUDGET));
    assert_eq!(parted.open_seqs(8), vec![0]);
    assert!(!peers.apply(1, &mut incoming, &mut parted, APPLY_BUDGET));
    assert_eq!(parted.open_seqs(8), Vec::<u64>::new());
}

/// The numbers a heartbeat names open that are not held here, as ranges: those below its
/// `next` only, and at most `max` ranges.
#[test]
fn what_a_heartbeat_names_and_is_not_held_is_missing() {
    let mut s = scheduler(0);
    for seq in [2, 4, 9] {
        s.book_shared(0, shared(7, seq, 1, 1.0)).unwrap();
    }
    assert_eq!(
        s.missing_from(7, &[(1, 5), (8, 10)], 11, 100),
        vec![(1, 1), (3, 3), (5, 5), (8, 8), (10, 10)]
    );
    assert_eq!(
        s.missing_from(7, &[(1, 5), (8, 10)], 4, 100),
        vec![(1, 1), (3, 3)]
    );
    assert_eq!(
        s.missing_from(7, &[(1, 5), (8, 10)], 11, 2),
        vec![(1, 1), (3, 3)]
    );
    assert_eq!(
        s.missing_from(7, &[(2, 2), (4, 4), (9, 9)], 11, 100),
        vec![]
    );
    // Unsorted, overlapping or reversed ranges from a peer are read as their union.
    assert_eq!(
        s.missing_from(7, &[(8, 10), (3, 4), (1, 3), (6, 5)], 11, 100),
        vec![(1, 1), (3, 3), (8, 8), (10, 10)]
    );
    assert_eq!(s.missing_from(8, &[(1, 2)], 0, 100), vec![]);
}

/// A replica that lacks bookings a peer's heartbeat names asks that peer for them; the peer
/// announces again those it still holds, each at most once per `resend_ms`, and answers
/// asks addressed to others with nothing.
#[test]
fn missing_bookings_are_asked_for_and_announced_again() {
    // Replica 7 holds three bookings of its own.
    let mut owner = scheduler(7);
    let blocks = prompt_blocks();
    let overlaps = OverlapScores {
        workers: Vec::new(),
    };
    let ids: Vec<BookingId> = (0..3)
        .map(|_| {
            owner
                .route(0, &request(&blocks, &overlaps))
                .unwrap()
                .booking
        })
        .collect();
    owner.first_token(ids[1]);
    let seqs = owner.open_seqs(7);
    let beat = LoadMessage::Heartbeat {
        replica: 7,
        open: ranges(&seqs),
        next: owner.next_seq(),
    };
    // Replica 0 heard none of them (it started later): it asks.
    let mut late = scheduler(0);
    let mut late_peers = Peers::default();
    late_peers.on_message(0, 0, vec![beat.clone()], &mut late);
    let asks = late_peers.take_outgoing();
    assert_eq!(
        asks,
        vec![LoadMessage::Want {
            replica: 0,
            from: 7,
            open: ranges(&seqs),
        }]
    );
    // Replica 7 announces them again, the started one followed by its first token.
    let mut owner_peers = Peers::new(5_000);
    owner_peers.on_message(10, 7, asks.clone(), &mut owner);
    let again = owner_peers.take_outgoing();
    let books = again
        .iter()
        .filter(|op| matches!(op, LoadMessage::Book { .. }))
        .count();
    assert_eq!(books, 3, "{again:?}");
    assert!(
        again.contains(&LoadMessage::FirstToken { id: ids[1] }),
        "{again:?}"
    );
    assert_eq!(again.len(), 4, "{again:?}");
    // Asked again within resend_ms: nothing; after it (and a tick), again.
    owner_peers.on_message(4_000, 7, asks.clone(), &mut owner);
    assert!(owner_peers.take_outgoing().is_empty());
    owner_peers.on_tick(6_000, 60_000, &mut owner);
    owner_peers.on_message(6_000, 7, asks.clone(), &mut owner);
    assert_eq!(owner_peers.take_outgoing().len(), 4);
    // An ask addressed to another replica is not this one's to answer.
    let mut other = scheduler(8);
    let mut other_peers = Peers::default();
    other_peers.on_message(0, 8, asks, &mut other);
    assert!(other_peers.take_outgoing().is_empty());
    // Once the late replica has them, the heartbeat asks for nothing, and the same load is
    // booked on both.
    late_peers.on_message(20, 0, again, &mut late);
    late_peers.on_message(30, 0, vec![beat], &mut late);
    assert!(late_peers.take_outgoing().is_empty());
    assert_eq!(late.open_seqs(7), seqs);
    let worker = (WorkerId(1), DpRank(0));
    assert_eq!(figures(&late, worker), figures(&owner, worker));
}

/// What a worker's booked load weighs in routing: prefill blocks, requests, requests in
/// prefill, blocks held, work tokens.
fn figures(s: &Scheduler, worker: crate::scheduler::WorkerKey) -> (f64, usize, usize, usize, f64) {
    let l = s.load(worker).unwrap();
    (
        l.prefill_blocks,
        l.requests,
        l.prefill_requests,
        l.decode_blocks(),
        l.work_tokens,
    )
}

/// An ask goes out in a message of its own: a replica of a version without it refuses the
/// whole message it comes in, and must not lose the bookings beside it.
#[test]
fn asks_leave_in_messages_of_their_own() {
    let mut o = Outbox::new(16);
    o.push(LoadMessage::Want {
        replica: 0,
        from: 7,
        open: vec![(1, 3)],
    });
    o.push(LoadMessage::Book {
        booking: shared(0, 1, 2, 1.0),
    });
    o.push(LoadMessage::Complete {
        id: BookingId { origin: 0, seq: 0 },
    });
    let payloads: Vec<Vec<LoadMessage>> = o
        .drain_payloads(1 << 20)
        .iter()
        .map(|p| decode_load(p).unwrap())
        .collect();
    assert_eq!(payloads.len(), 2, "{payloads:?}");
    assert_eq!(payloads[0].len(), 2);
    assert!(matches!(payloads[1][..], [LoadMessage::Want { .. }]));
}

/// A replica that starts after its peer booked learns the booking from the peer's next
/// heartbeat (it asks, the peer announces it again); before, it never did, and admitted a
/// whole budget more onto a worker the peer had full (paused clock).
#[tokio::test(start_paused = true)]
async fn a_replica_started_later_learns_the_load_already_booked() {
    let bus = Transport::Local(LocalBus::new());
    let (a, share_a, _stop_a) = replica(&bus, 1).await;
    let blocks = prompt_blocks();
    let overlaps = OverlapScores {
        workers: Vec::new(),
    };
    let decision = a.lock().route(0, &request(&blocks, &overlaps)).unwrap();
    share_a.booked(decision.booking);
    tokio::time::sleep(Duration::from_millis(50)).await;
    // B starts once the booking was announced: it heard none of it.
    let (b, _share_b, _stop_b) = replica(&bus, 2).await;
    assert_eq!(b.lock().open_bookings(), 0);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(b.lock().open_seqs(1), vec![decision.booking.seq]);
    let worker = (WorkerId(1), DpRank(0));
    assert_eq!(figures(&b.lock(), worker), figures(&a.lock(), worker));
}

/// A peer's completion wakes whoever waits on [`LoadShare::freed`] (the router's admission
/// queue), so a request queued for room the peer frees goes at once: before, the queue
/// noticed only at its next poll, up to 100 ms later (paused clock).
#[tokio::test(start_paused = true)]
async fn a_peer_s_completion_wakes_the_admission_queue() {
    let bus = Transport::Local(LocalBus::new());
    let config = LoadShareConfig {
        heartbeat_ms: 3_600_000,
        flush_ms: 0,
        ..LoadShareConfig::default()
    };
    let (_stop, rx) = watch::channel(false);
    let s = Arc::new(Mutex::new(scheduler(1)));
    let share = LoadShare::start(bus.clone(), "t", Arc::clone(&s), config, rx)
        .await
        .unwrap();
    let freed = share.freed();
    // A wake-up left from the start, if any, is taken first.
    tokio::time::sleep(Duration::from_millis(10)).await;
    let _ = tokio::time::timeout(Duration::from_millis(50), freed.notified()).await;
    let complete = serde_json::to_vec(&[LoadMessage::Complete {
        id: BookingId { origin: 7, seq: 1 },
    }])
    .unwrap();
    let woken = freed.notified();
    bus.publish(&load_subject("t"), None, complete.into())
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_millis(5), woken)
        .await
        .expect("a peer's completion woke the queue");
}
