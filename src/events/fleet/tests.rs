use std::collections::BTreeSet;

use proptest::prelude::*;

use super::*;

fn info(id: u64, epoch: u64, dp_size: u32, model: &str, block_size: usize) -> WorkerInfo {
    WorkerInfo {
        id: WorkerId(id),
        url: format!("http://127.0.0.1:9/{id}"),
        block_size,
        g1_blocks: 100,
        g2_blocks: 0,
        model: model.into(),
        dp_size,
        epoch,
        last_event_ids: vec![0; dp_size as usize],
        api: crate::discovery::WorkerApi::Kvroute,
        adapters: Vec::new(),
        engine_load: None,
        event_faults: None,
        engine_rank_kv_usage: Vec::new(),
        learns_routes: false,
        left: false,
    }
}

/// A fleet in which worker `id` (one rank, model "m") registered at 0.
fn registered(id: u64) -> Fleet {
    let mut fleet = Fleet::new(config());
    fleet
        .on_registration(0, info(id, 7, 1, "m", 16), &mut Vec::new())
        .unwrap();
    fleet
}

fn config() -> FleetConfig {
    FleetConfig {
        lease_ttl_ms: Some(1_000),
        tombstone_ttl_ms: 5_000,
    }
}

/// What a driver holds after carrying out commands: the streams it runs, the scheduler's
/// entries, and the index lanes (which only delivered batches create).
#[derive(Debug, Default)]
struct Driver {
    streams: BTreeSet<StreamKey>,
    routable: BTreeSet<StreamKey>,
    lanes: BTreeSet<StreamKey>,
}

impl Driver {
    fn apply(&mut self, commands: &mut Vec<FleetCommand>) {
        for c in commands.drain(..) {
            match c {
                FleetCommand::OpenStream(k) => {
                    assert!(self.streams.insert(k), "opened twice: {k:?}")
                }
                FleetCommand::CloseStream(k) => {
                    assert!(
                        self.streams.remove(&k),
                        "closed a stream never opened: {k:?}"
                    );
                    // The stream task removes its lane as it ends.
                    self.lanes.remove(&k);
                }
                FleetCommand::Watermark { key, .. } => {
                    assert!(self.streams.contains(&key), "watermark for a closed stream")
                }
                FleetCommand::Routable { key, .. } => {
                    self.routable.insert(key);
                }
                FleetCommand::Unroutable(k) => {
                    self.routable.remove(&k);
                }
                FleetCommand::Departed { .. }
                | FleetCommand::Reincarnated(_)
                | FleetCommand::Rejoined(_)
                | FleetCommand::IdConflict { .. }
                | FleetCommand::LateHeartbeat { .. } => {}
            }
        }
    }

    /// A batch of incarnation 7 (the epoch `info` gives).
    fn batch(&mut self, fleet: &mut Fleet, now_ms: u64, key: StreamKey) {
        self.batch_of(fleet, now_ms, key, 7);
    }

    fn batch_of(&mut self, fleet: &mut Fleet, now_ms: u64, key: StreamKey, epoch: u64) {
        let mut out = Vec::new();
        let _ = fleet.wake(now_ms, key.0, epoch, &mut out);
        self.apply(&mut out);
        if fleet.on_batch(now_ms, key, epoch) == BatchVerdict::Deliver {
            assert!(
                self.streams.contains(&key),
                "delivered to a closed stream: {key:?}"
            );
            self.lanes.insert(key);
        }
    }
}

#[test]
fn a_registration_opens_every_rank_and_a_goodbye_closes_them() {
    let mut fleet = Fleet::new(config());
    let mut out = Vec::new();
    let mut d = Driver::default();
    fleet
        .on_registration(0, info(1, 7, 3, "m", 16), &mut out)
        .unwrap();
    d.apply(&mut out);
    assert_eq!(d.streams.len(), 3);
    assert_eq!(d.routable.len(), 3);
    fleet.on_goodbye(10, WorkerId(1), &mut out);
    assert!(out.contains(&FleetCommand::Departed {
        id: WorkerId(1),
        reason: Departure::Left
    }));
    d.apply(&mut out);
    assert!(d.streams.is_empty() && d.routable.is_empty());
    assert_eq!(fleet.stats().left, 1);
}

#[test]
fn a_batch_after_goodbye_is_dropped_and_does_not_resurrect_the_worker() {
    let mut fleet = Fleet::new(config());
    let mut out = Vec::new();
    let mut d = Driver::default();
    fleet
        .on_registration(0, info(1, 7, 1, "m", 16), &mut out)
        .unwrap();
    d.apply(&mut out);
    d.batch(&mut fleet, 0, (WorkerId(1), DpRank(0)));
    fleet.on_goodbye(10, WorkerId(1), &mut out);
    d.apply(&mut out);
    // A straggler of the departed worker, and one of a worker never seen.
    assert_eq!(
        fleet.on_batch(0, (WorkerId(1), DpRank(0)), 7),
        BatchVerdict::Departed
    );
    assert_eq!(
        fleet.on_batch(0, (WorkerId(2), DpRank(0)), 7),
        BatchVerdict::Unregistered
    );
    assert!(d.streams.is_empty() && d.lanes.is_empty());
    assert_eq!(fleet.stats().dropped_departed, 1);
    assert_eq!(fleet.stats().dropped_unregistered, 1);
    // A new incarnation's registration brings it back.
    fleet
        .on_registration(30, info(1, 8, 1, "m", 16), &mut out)
        .unwrap();
    d.apply(&mut out);
    assert_eq!(d.streams.len(), 1);
    assert_eq!(fleet.stats().rejoined, 0);
    // The tombstone is gone once its time is up.
    fleet.on_goodbye(40, WorkerId(1), &mut out);
    d.apply(&mut out);
    fleet.on_tick(40 + 5_001, &mut out);
    assert_eq!(fleet.tombstones(), 0);
}

#[test]
fn a_lapsed_lease_expires_a_renewed_one_does_not_and_a_lapsed_worker_can_return() {
    let mut fleet = Fleet::new(config());
    let mut out = Vec::new();
    let mut d = Driver::default();
    fleet
        .on_registration(0, info(1, 7, 1, "m", 16), &mut out)
        .unwrap();
    fleet
        .on_registration(0, info(2, 7, 1, "m", 16), &mut out)
        .unwrap();
    d.apply(&mut out);
    fleet
        .on_registration(900, info(2, 7, 1, "m", 16), &mut out)
        .unwrap();
    d.apply(&mut out);
    fleet.on_tick(1_001, &mut out);
    assert!(out.contains(&FleetCommand::Departed {
        id: WorkerId(1),
        reason: Departure::Expired
    }));
    d.apply(&mut out);
    assert_eq!(d.streams, BTreeSet::from([(WorkerId(2), DpRank(0))]));
    // An incarnation that was only out of earshot comes back with its next heartbeat.
    fleet
        .on_registration(1_500, info(1, 7, 1, "m", 16), &mut out)
        .unwrap();
    d.apply(&mut out);
    assert_eq!(d.streams.len(), 2);
    assert_eq!(fleet.stats().rejoined, 0);
    // After the router's own outage every lease runs from its reconnection.
    fleet.renew_all(2_400);
    fleet.on_tick(3_000, &mut out);
    assert!(out.is_empty());
    fleet.on_tick(3_401, &mut out);
    d.apply(&mut out);
    assert!(d.streams.is_empty());
    // Static fleets never expire.
    let mut fixed = Fleet::new(FleetConfig {
        lease_ttl_ms: None,
        ..config()
    });
    fixed
        .on_registration(0, info(1, 7, 1, "m", 16), &mut out)
        .unwrap();
    out.clear();
    fixed.on_tick(u64::MAX / 2, &mut out);
    assert!(out.is_empty());
}

/// A worker whose heartbeats stop but whose events keep coming is alive: its lease runs
/// from its last batch; once both stop, it lapses a lease later.
#[test]
fn event_batches_renew_a_lease() {
    let mut fleet = registered(1);
    let mut out = Vec::new();
    for at in [600, 1_200, 1_800] {
        assert_eq!(
            fleet.on_batch(at, (WorkerId(1), DpRank(0)), 7),
            BatchVerdict::Deliver
        );
        fleet.on_tick(at + 500, &mut out);
        assert!(out.is_empty(), "expired at {at} + 500 with batches flowing");
    }
    fleet.on_tick(2_800, &mut out);
    assert!(out.is_empty());
    fleet.on_tick(2_801, &mut out);
    assert!(out.contains(&FleetCommand::Departed {
        id: WorkerId(1),
        reason: Departure::Expired
    }));
    // A batch for a rank the worker does not have renews nothing.
    let mut fleet = registered(2);
    out.clear();
    fleet.on_batch(900, (WorkerId(2), DpRank(5)), 7);
    fleet.on_tick(1_001, &mut out);
    assert!(!out.is_empty(), "an absent rank's batch renewed the lease");
}

/// While the router is deaf no lease lapses; a short deafness (a late acknowledgement of
/// its probe) pauses the leases, so a crashed worker's lapse moves by that much only, where
/// a longer one gives every lease a fresh start.
#[test]
fn a_short_deafness_pauses_leases_and_a_long_one_renews_them() {
    // Lease 1,000 ms: the grace is a probe period, 200 ms.
    let mut fleet = registered(1);
    let mut out = Vec::new();
    for at in [500, 550, 600] {
        fleet.on_deaf_tick(at);
    }
    fleet.on_tick(650, &mut out);
    fleet.on_tick(1_150, &mut out);
    assert!(out.is_empty(), "lapsed though 150 ms were deaf: {out:?}");
    fleet.on_tick(1_151, &mut out);
    assert!(
        !out.is_empty(),
        "a blip gave the lease more than its length"
    );
    // Deaf for longer than the grace, past the lease's end: renewed from the deafness's end.
    let mut fleet = registered(2);
    out.clear();
    for at in (500..=1_500).step_by(50) {
        fleet.on_deaf_tick(at);
    }
    fleet.on_tick(2_500, &mut out);
    assert!(out.is_empty(), "{out:?}");
    fleet.on_tick(2_501, &mut out);
    assert!(!out.is_empty());
}

/// A reconnect is a deafness like any other: after a blip (shorter than the grace) a
/// crashed worker's lease ends where it would have, moved only by the blip, not renewed
/// from the reconnect; after a long outage leases run afresh.
#[test]
fn a_reconnect_after_a_blip_does_not_renew_leases() {
    // Lease 1,000 ms, grace 200 ms. Deaf from 700, reconnected at 800.
    let mut fleet = registered(1);
    let mut out = Vec::new();
    fleet.on_deaf_tick(700);
    fleet.on_reconnected(800);
    fleet.on_tick(850, &mut out);
    fleet.on_tick(1_150, &mut out);
    assert!(out.is_empty(), "lapsed though 150 ms were deaf: {out:?}");
    fleet.on_tick(1_151, &mut out);
    assert!(
        !out.is_empty(),
        "a reconnect after a blip gave the lease a fresh start"
    );
    // A reconnect no tick saw coming: the same.
    let mut fleet = registered(2);
    out.clear();
    fleet.on_reconnected(900);
    fleet.on_tick(950, &mut out);
    fleet.on_tick(1_051, &mut out);
    assert!(
        !out.is_empty(),
        "a reconnect between ticks renewed the lease"
    );
    // Deaf past the grace: renewed from the reconnect.
    let mut fleet = registered(3);
    out.clear();
    fleet.on_deaf_tick(700);
    fleet.on_reconnected(1_000);
    fleet.on_tick(2_000, &mut out);
    assert!(out.is_empty(), "{out:?}");
    fleet.on_tick(2_001, &mut out);
    assert!(!out.is_empty());
}

/// A registration read back from the registry's history as a watch starts is aged by when
/// it was written: one older than the lease (a worker that stopped without a goodbye) is
/// kept aside, not routed to, until a batch of the worker's shows it alive; a younger one
/// lapses when its lease would have, even through the router's deafness (which renews
/// leases heard live); an old copy read back does not shorten a lease renewed since.
/// A heartbeat more than three quarters of the lease after the one before, or one of an
/// incarnation whose lease lapsed, is late for the router's lease (a worker's heartbeat
/// period that does not fit it): said, and counted. Not after a deafness of the router's,
/// and not for heartbeats on time.
#[test]
fn heartbeats_late_for_the_lease_are_said() {
    let late = |out: &[FleetCommand]| {
        out.iter()
            .filter_map(|c| match c {
                FleetCommand::LateHeartbeat { id, gap_ms } => Some((*id, *gap_ms)),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let mut fleet = Fleet::new(config());
    let mut out = Vec::new();
    let beat = |fleet: &mut Fleet, now_ms: u64, out: &mut Vec<FleetCommand>| {
        out.clear();
        fleet
            .on_registration(now_ms, info(1, 7, 1, "m", 16), out)
            .unwrap();
    };
    beat(&mut fleet, 0, &mut out);
    beat(&mut fleet, 500, &mut out);
    assert_eq!(late(&out), vec![]);
    beat(&mut fleet, 1_300, &mut out);
    assert_eq!(late(&out), vec![(WorkerId(1), Some(800))]);
    // Lapsed (the lease is 1 s), then the same incarnation again.
    fleet.on_tick(2_400, &mut out);
    assert!(fleet.worker(WorkerId(1)).is_none());
    beat(&mut fleet, 2_600, &mut out);
    assert_eq!(late(&out), vec![(WorkerId(1), None)]);
    // Deaf in between: says nothing of the worker.
    fleet.on_deaf_tick(2_700);
    fleet.on_tick(2_750, &mut out);
    beat(&mut fleet, 3_500, &mut out);
    assert_eq!(late(&out), vec![]);
    assert_eq!(fleet.stats().late_heartbeats, 2);
}

#[test]
fn a_replayed_registration_keeps_its_age() {
    let mut fleet = Fleet::new(config());
    let mut out = Vec::new();
    let mut d = Driver::default();
    fleet
        .on_replayed_registration(0, info(1, 7, 1, "m", 16), 1_500, &mut out)
        .unwrap();
    assert!(out.is_empty(), "a lapsed registration opened {out:?}");
    assert!(fleet.worker(WorkerId(1)).is_none());
    assert_eq!(fleet.stats().stale_registrations, 1);
    assert_eq!((fleet.stats().joined, fleet.dormant()), (0, 1));
    // Written 600 ms before the newest entry: 400 ms of its lease are left once the
    // router hears the registry. Deaf until 300 (renew_all on every tick), it keeps its age
    // meanwhile instead of a fresh lease.
    fleet
        .on_replayed_registration(0, info(2, 7, 1, "m", 16), 600, &mut out)
        .unwrap();
    d.apply(&mut out);
    assert_eq!(d.routable.len(), 1);
    fleet.renew_all(300);
    fleet.on_tick(700, &mut out);
    assert!(out.is_empty());
    fleet.on_tick(701, &mut out);
    assert!(out.contains(&FleetCommand::Departed {
        id: WorkerId(2),
        reason: Departure::Expired
    }));
    d.apply(&mut out);
    assert!(d.routable.is_empty());
    // A batch of the worker kept aside registers it (alive, though its heartbeats do not
    // reach the registry); it is then renewed like any other.
    d.batch(&mut fleet, 500, (WorkerId(1), DpRank(0)));
    assert!(fleet.worker(WorkerId(1)).is_some());
    assert!(d.lanes.contains(&(WorkerId(1), DpRank(0))));
    assert_eq!((fleet.stats().woken, fleet.dormant()), (1, 0));
    fleet.renew_all(1_000);
    fleet.on_tick(1_400, &mut out);
    assert!(out.is_empty(), "{out:?}");
    // One kept aside is forgotten with the tombstones; a live heartbeat registers it.
    fleet
        .on_replayed_registration(1_500, info(5, 7, 1, "m", 16), 2_000, &mut out)
        .unwrap();
    fleet
        .on_replayed_registration(1_500, info(6, 7, 1, "m", 16), 2_000, &mut out)
        .unwrap();
    assert_eq!(fleet.dormant(), 2);
    fleet
        .on_registration(1_600, info(6, 7, 1, "m", 16), &mut out)
        .unwrap();
    d.apply(&mut out);
    assert!(fleet.worker(WorkerId(6)).is_some());
    fleet.on_tick(1_500 + 5_001, &mut out);
    d.apply(&mut out);
    assert_eq!(fleet.dormant(), 0);
    d.batch(&mut fleet, 6_600, (WorkerId(5), DpRank(0)));
    assert!(fleet.worker(WorkerId(5)).is_none());
    // A batch of a later incarnation than the one kept aside (the worker restarted while it
    // could not write the registry): not registered from the old registration, whose
    // heartbeat would take the stream back to the old epoch; forgotten instead.
    fleet
        .on_replayed_registration(6_700, info(8, 7, 1, "m", 16), 2_000, &mut out)
        .unwrap();
    d.batch_of(&mut fleet, 6_800, (WorkerId(8), DpRank(0)), 9);
    assert!(fleet.worker(WorkerId(8)).is_none());
    assert!(!d.lanes.contains(&(WorkerId(8), DpRank(0))));
    assert_eq!((fleet.stats().superseded, fleet.dormant()), (1, 0));
    // Its own registration, when it comes, registers it as any other.
    fleet
        .on_registration(6_900, info(8, 9, 1, "m", 16), &mut out)
        .unwrap();
    d.apply(&mut out);
    assert!(fleet.worker(WorkerId(8)).is_some());
    // A live member's lease is not shortened by an old copy read back (a watch re-created),
    // even one past the lease: it is still a member, so its shape is taken.
    let mut fleet = Fleet::new(config());
    fleet
        .on_registration(1_000, info(3, 7, 1, "m", 16), &mut out)
        .unwrap();
    fleet
        .on_replayed_registration(1_100, info(3, 7, 1, "m", 16), 5_000, &mut out)
        .unwrap();
    out.clear();
    fleet.on_tick(2_000, &mut out);
    assert!(out.is_empty(), "the old copy shortened the lease: {out:?}");
    assert!(fleet.worker(WorkerId(3)).is_some());
    // Without a lease (a static list) nothing is stale.
    let mut fleet = Fleet::new(FleetConfig {
        lease_ttl_ms: None,
        ..config()
    });
    fleet
        .on_replayed_registration(0, info(4, 7, 1, "m", 16), u64::MAX, &mut out)
        .unwrap();
    assert!(fleet.worker(WorkerId(4)).is_some());
}

/// A worker back under its id as another incarnation (a restart within its lease, or a
/// move to another URL) is announced, so its old failures stop ejecting it; a heartbeat of
/// the same incarnation is not.
#[test]
fn a_new_incarnation_under_the_same_id_is_announced() {
    let mut fleet = registered(1);
    let mut out = Vec::new();
    fleet
        .on_registration(10, info(1, 7, 1, "m", 16), &mut out)
        .unwrap();
    assert!(!out.contains(&FleetCommand::Reincarnated(WorkerId(1))));
    out.clear();
    fleet
        .on_registration(20, info(1, 8, 1, "m", 16), &mut out)
        .unwrap();
    assert!(out.contains(&FleetCommand::Reincarnated(WorkerId(1))));
    out.clear();
    let moved = WorkerInfo {
        url: "http://127.0.0.1:10/1".into(),
        ..info(1, 8, 1, "m", 16)
    };
    fleet.on_registration(30, moved, &mut out).unwrap();
    assert!(out.contains(&FleetCommand::Reincarnated(WorkerId(1))));
}

/// A fleet in which each `(id, model, block size)` registered (one rank, epoch 7) at 0.
fn with_workers(workers: &[(u64, &str, usize)]) -> Fleet {
    let mut fleet = Fleet::new(config());
    for &(id, model, block_size) in workers {
        fleet
            .on_registration(0, info(id, 7, 1, model, block_size), &mut Vec::new())
            .unwrap();
    }
    fleet
}

/// A departed worker whose next registration is refused keeps its tombstone: its batches
/// are still a departed worker's, not an unregistered one's.
#[test]
fn a_refused_registration_keeps_the_tombstone() {
    let mut fleet = with_workers(&[(1, "a", 16), (2, "a", 16)]);
    let mut out = Vec::new();
    fleet.on_goodbye(10, WorkerId(2), &mut out);
    let key = (WorkerId(2), DpRank(0));
    let departed = fleet.on_batch(20, key, 7);
    assert!(
        fleet
            .on_registration(30, info(2, 8, 1, "a", 32), &mut out)
            .is_err()
    );
    assert_eq!(fleet.on_batch(40, key, 7), departed);
    assert_ne!(departed, BatchVerdict::Unregistered);
}

#[test]
fn a_model_keeps_one_block_size() {
    let mut fleet = with_workers(&[(1, "a", 16), (2, "b", 32)]);
    let mut out = Vec::new();
    let refused = fleet.on_registration(0, info(3, 7, 1, "a", 32), &mut out);
    assert!(matches!(
        refused,
        Err(Refusal::BlockSize {
            fleet_block_size: 16,
            ..
        })
    ));
    assert_eq!(fleet.block_size("a"), Some(16));
    assert_eq!(fleet.block_size("b"), Some(32));
    assert_eq!(
        fleet.on_batch(0, (WorkerId(3), DpRank(0)), 7),
        BatchVerdict::Unregistered
    );
}

#[test]
fn fewer_ranks_close_the_extra_streams() {
    let mut fleet = Fleet::new(config());
    let mut out = Vec::new();
    let mut d = Driver::default();
    fleet
        .on_registration(0, info(1, 7, 4, "m", 16), &mut out)
        .unwrap();
    d.apply(&mut out);
    fleet
        .on_registration(1, info(1, 7, 2, "m", 16), &mut out)
        .unwrap();
    d.apply(&mut out);
    assert_eq!(d.streams.len(), 2);
    assert_eq!(
        fleet.on_batch(0, (WorkerId(1), DpRank(3)), 7),
        BatchVerdict::NoSuchRank
    );
    assert_eq!(
        fleet.orphans([(WorkerId(1), DpRank(3)), (WorkerId(1), DpRank(1))]),
        vec![(WorkerId(1), DpRank(3))]
    );
}

#[derive(Clone, Debug)]
enum Op {
    Register {
        id: u64,
        epoch: u64,
        dp: u32,
        big_block: bool,
    },
    Replayed {
        id: u64,
        epoch: u64,
        dp: u32,
        age_ms: u64,
    },
    Goodbye(u64),
    /// The router out of earshot (NATS down, or the registry taking no writes).
    Deaf,
    Batch {
        id: u64,
        rank: u32,
    },
    Tick(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u64..6, 0u64..3, 1u32..4, proptest::bool::weighted(0.1))
            .prop_map(|(id, epoch, dp, big_block)| Op::Register { id, epoch, dp, big_block }),
        2 => (0u64..6, 0u64..3, 1u32..4, 0u64..3_000)
            .prop_map(|(id, epoch, dp, age_ms)| Op::Replayed { id, epoch, dp, age_ms }),
        1 => (0u64..6).prop_map(Op::Goodbye),
        1 => Just(Op::Deaf),
        4 => (0u64..7, 0u32..4).prop_map(|(id, rank)| Op::Batch { id, rank }),
        2 => (1u64..800).prop_map(Op::Tick),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("KVROUTE_PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)
    ))]

    /// Over any interleaving of registrations, goodbyes, batches and time: the driver's
    /// streams and scheduler entries are exactly the registered workers' ranks at every
    /// step, lanes exist only for them, and after quiescence (every lease lapsed) nothing
    /// is left of any worker.
    #[test]
    fn no_state_outlives_its_worker(ops in proptest::collection::vec(op(), 1..120)) {
        let mut fleet = Fleet::new(config());
        let mut d = Driver::default();
        let mut out = Vec::new();
        let mut now = 0u64;
        for op in ops {
            match op {
                Op::Register { id, epoch, dp, big_block } => {
                    let bs = if big_block { 32 } else { 16 };
                    let _ = fleet.on_registration(now, info(id, epoch, dp, "m", bs), &mut out);
                }
                Op::Replayed { id, epoch, dp, age_ms } => {
                    let _ = fleet.on_replayed_registration(
                        now,
                        info(id, epoch, dp, "m", 16),
                        age_ms,
                        &mut out,
                    );
                }
                Op::Goodbye(id) => fleet.on_goodbye(now, WorkerId(id), &mut out),
                Op::Deaf => fleet.on_deaf_tick(now),
                Op::Batch { id, rank } => d.batch(&mut fleet, now, (WorkerId(id), DpRank(rank))),
                Op::Tick(ms) => {
                    now += ms;
                    fleet.on_tick(now, &mut out);
                }
            }
            d.apply(&mut out);
            let expected = fleet.expected_streams();
            prop_assert_eq!(&d.streams, &expected);
            prop_assert_eq!(&d.routable, &expected);
            prop_assert!(d.lanes.is_subset(&expected), "lanes {:?} ⊄ {:?}", d.lanes, expected);
        }
        // Quiescence: every lease lapses, then every tombstone.
        for _ in 0..2 {
            now += 10_000;
            fleet.on_tick(now, &mut out);
            d.apply(&mut out);
        }
        prop_assert!(d.streams.is_empty() && d.routable.is_empty() && d.lanes.is_empty());
        prop_assert_eq!(fleet.workers().count(), 0);
        prop_assert_eq!(fleet.tombstones(), 0);
        prop_assert_eq!(fleet.dormant(), 0);
    }
}

/// A registration written after its own incarnation's goodbye, in the registry's order,
/// is the worker alive with its key deleted under it (an operator's `nats kv del`, or
/// another process leaving under the same id: a replaced StatefulSet pod's predecessor):
/// it is registered again at once and said, not ignored for the tombstone's minute with
/// its batches dropped.
#[test]
fn a_heartbeat_after_its_own_goodbye_registers_the_worker_again() {
    let (mut fleet, mut out, mut d) = one_registered(7);
    fleet.on_goodbye(10, WorkerId(1), &mut out);
    d.apply(&mut out);
    assert!(d.routable.is_empty());
    fleet
        .on_registration(20, info(1, 7, 1, "m", 16), &mut out)
        .unwrap();
    assert!(out.contains(&FleetCommand::Rejoined(WorkerId(1))));
    d.apply(&mut out);
    assert_eq!(d.routable.len(), 1);
    assert_eq!(fleet.stats().rejoined, 1);
    d.batch(&mut fleet, 30, (WorkerId(1), DpRank(0)));
    assert_eq!(d.lanes.len(), 1, "its batches are delivered");
}

/// A new incarnation's first heartbeat comes as late as its restart took; that is not a
/// heartbeat period that does not fit the lease.
#[test]
fn a_restart_is_no_late_heartbeat() {
    let mut fleet = Fleet::new(config());
    let mut out = Vec::new();
    let ttl = config().lease_ttl_ms.unwrap();
    fleet
        .on_registration(0, info(1, 7, 1, "m", 16), &mut out)
        .unwrap();
    fleet
        .on_registration(ttl * 9 / 10, info(1, 8, 1, "m", 16), &mut out)
        .unwrap();
    assert_eq!(fleet.stats().late_heartbeats, 0);
    // The same incarnation that late is.
    fleet
        .on_registration(ttl * 18 / 10, info(1, 8, 1, "m", 16), &mut out)
        .unwrap();
    assert_eq!(fleet.stats().late_heartbeats, 1);
}

/// Two processes heartbeating under one id (a replaced pod whose predecessor still runs):
/// the later incarnation keeps the id while it is heard within its lease, the older one's
/// registrations are counted and ignored (taken, the worker's URL flipped at every
/// heartbeat); once the later one has been silent for a lease, the older registers (a clock
/// stepped back across a restart gives a smaller epoch).
#[test]
fn an_older_incarnation_does_not_take_the_id_from_a_live_later_one() {
    let mut fleet = Fleet::new(config());
    let mut out = Vec::new();
    let mut newer = info(1, 8, 1, "m", 16);
    newer.url = "http://b".into();
    let mut older = info(1, 7, 1, "m", 16);
    older.url = "http://a".into();
    fleet.on_registration(0, newer.clone(), &mut out).unwrap();
    fleet.on_registration(600, older.clone(), &mut out).unwrap();
    assert_eq!(fleet.worker(WorkerId(1)).map(|w| w.epoch), Some(8));
    assert_eq!(fleet.stats().id_conflicts, 1);
    assert!(out.contains(&FleetCommand::IdConflict {
        id: WorkerId(1),
        ignored_url: "http://a".into(),
        kept_url: "http://b".into(),
    }));
    fleet.on_registration(700, newer, &mut out).unwrap();
    fleet.on_registration(900, older.clone(), &mut out).unwrap();
    assert_eq!(
        fleet.worker(WorkerId(1)).map(|w| w.url.as_str()),
        Some("http://b")
    );
    // The later one silent for a lease: the older takes the id.
    fleet.on_registration(1_800, older, &mut out).unwrap();
    assert_eq!(fleet.worker(WorkerId(1)).map(|w| w.epoch), Some(7));
}

/// A later incarnation that still publishes while its heartbeats cannot reach the registry
/// is alive: its own batches renew its lease, and the older one's registrations stay
/// ignored (taken, the stream followed the older epoch and the later one's snapshot answer
/// took it back: a wipe and a resync at every heartbeat). The older one's batches renew
/// nothing: once the later one is silent for a lease, the older takes the id (renewed by
/// them, a dead incarnation stayed registered for as long as the older one published).
#[test]
fn a_later_incarnation_s_batches_keep_the_id_and_an_older_one_s_do_not() {
    let mut fleet = Fleet::new(config());
    let mut out = Vec::new();
    let older = info(1, 7, 1, "m", 16);
    let key = (WorkerId(1), DpRank(0));
    fleet
        .on_registration(0, info(1, 8, 1, "m", 16), &mut out)
        .unwrap();
    for at in (200..=3_000).step_by(200) {
        assert_eq!(fleet.on_batch(at, key, 8), BatchVerdict::Deliver);
        let heard = fleet.on_registration(at, older.clone(), &mut out);
        assert_eq!(heard, Ok(Heard::Ignored), "at {at} ms");
    }
    assert_eq!(fleet.worker(WorkerId(1)).map(|w| w.epoch), Some(8));
    // The later one has stopped; the older one publishes.
    for at in (3_200..=4_000).step_by(200) {
        fleet.on_batch(at, key, 7);
    }
    let heard = fleet.on_registration(4_200, older, &mut out);
    assert_eq!(heard, Ok(Heard::Registered));
    assert_eq!(fleet.worker(WorkerId(1)).map(|w| w.epoch), Some(7));
}

/// A goodbye names its incarnation (the registration marked as left): it removes the member
/// only if the member is that incarnation. A predecessor leaving under its replacement's id
/// leaves the replacement registered; the incarnation itself leaves, tombstoned as left.
#[test]
fn a_goodbye_removes_only_its_own_incarnation() {
    let (mut fleet, mut out, mut d) = one_registered(8);
    fleet.on_left(10, WorkerId(1), 7, &mut out);
    d.apply(&mut out);
    assert_eq!(d.routable.len(), 1, "the replacement stays");
    assert_eq!(fleet.stats().goodbyes_of_others, 1);
    assert_eq!(fleet.stats().left, 0);
    fleet.on_left(20, WorkerId(1), 8, &mut out);
    assert!(out.contains(&FleetCommand::Departed {
        id: WorkerId(1),
        reason: Departure::Left
    }));
    d.apply(&mut out);
    assert!(d.routable.is_empty() && d.streams.is_empty());
    assert_eq!(fleet.stats().left, 1);
    assert_eq!(
        fleet.on_batch(30, (WorkerId(1), DpRank(0)), 7),
        BatchVerdict::Departed
    );
}

/// A fleet with worker 1 (one rank of model "m", blocks of 16) registered at 0 as
/// incarnation `epoch`, and the driver that carried out its commands.
fn one_registered(epoch: u64) -> (Fleet, Vec<FleetCommand>, Driver) {
    let mut fleet = Fleet::new(config());
    let mut out = Vec::new();
    let mut d = Driver::default();
    fleet
        .on_registration(0, info(1, epoch, 1, "m", 16), &mut out)
        .unwrap();
    d.apply(&mut out);
    (fleet, out, d)
}
