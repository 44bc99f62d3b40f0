use std::num::NonZeroUsize;

use super::*;
use crate::discovery::{LeaseConfig, LocalRegistry, Registration, Registry};
use crate::events::transport::LocalBus;
use crate::indexer::Config;
use crate::protocol::{
    DpRank, KvEvent, KvEventData, LocalHash, Salt, SeqHash, StoredBlock, Tier, encode, hash_blocks,
};

pub(crate) fn info(id: u64, dp_size: u32) -> WorkerInfo {
    WorkerInfo {
        id: WorkerId(id),
        url: format!("http://127.0.0.1:9/{id}"),
        block_size: 4,
        g1_blocks: 100,
        g2_blocks: 0,
        model: "m".into(),
        dp_size,
        epoch: 7,
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

/// A batch of `n` stored blocks of worker `id`, ids `first..`.
pub(crate) fn batch(id: u64, first: u64, tokens: u32) -> bytes::Bytes {
    let toks: Vec<u32> = (0..tokens).collect();
    let blocks: Vec<StoredBlock> = hash_blocks(&toks, NonZeroUsize::new(4).unwrap(), Salt::NONE)
        .iter()
        .map(|b| StoredBlock {
            seq: b.seq,
            local: b.local,
        })
        .collect();
    let b = EventBatch {
        worker: WorkerId(id),
        dp_rank: DpRank(0),
        epoch: 7,
        sent_unix_us: 0,
        events: vec![KvEvent {
            id: first,
            tier: Tier::Device,
            data: KvEventData::Stored {
                parent: None,
                blocks,
            },
        }],
    };
    encode(&b).unwrap().into()
}

/// A plane over an in-process bus and registry (cluster `t`), feeding `scheduler`.
pub(crate) struct Setup {
    pub bus: Transport,
    pub local: LocalRegistry,
    pub plane: EventPlane,
    pub scheduler: Arc<Mutex<Scheduler>>,
    _stop: watch::Sender<bool>,
}

impl Setup {
    pub async fn start(
        lease: LeaseConfig,
        index: Config,
        config: PlaneConfig,
        scheduler: Scheduler,
    ) -> Setup {
        let bus = Transport::Local(LocalBus::new());
        let local = LocalRegistry::default();
        let scheduler = Arc::new(Mutex::new(scheduler));
        let (stop, rx) = watch::channel(false);
        let plane = EventPlane::start(
            bus.clone(),
            Arc::new(Indexer::new(index).unwrap()),
            Registry::Local(local.clone()).watch(lease),
            PlaneConfig {
                cluster: "t".into(),
                ..config
            },
            Some(Arc::clone(&scheduler)),
            rx,
        )
        .await
        .unwrap();
        Setup {
            bus,
            local,
            plane,
            scheduler,
            _stop: stop,
        }
    }
}

impl Setup {
    /// Publishes `payload` on worker `worker`'s events subject.
    pub async fn publish(&self, worker: u64, payload: bytes::Bytes) {
        self.bus
            .publish(&format!("kvroute.t.events.{worker}"), None, payload)
            .await
            .unwrap();
    }

    /// Registers workers 1 and 2 (one rank each) and waits for their streams.
    async fn register_two(&self) {
        self.local.put(info(1, 1));
        self.local.put(info(2, 1));
        assert!(settle(|| self.plane.streams().len() == 2).await);
    }
}

/// A plane whose index has a slot for one rank only.
async fn one_slot() -> Setup {
    let index = Config {
        max_workers: 1,
        ..Config::default()
    };
    setup_with(LeaseConfig::default(), index).await
}

async fn setup(lease: LeaseConfig) -> Setup {
    setup_with(lease, Config::default()).await
}

async fn setup_with(lease: LeaseConfig, index: Config) -> Setup {
    let scheduler = Scheduler::new(Default::default()).unwrap();
    Setup::start(lease, index, PlaneConfig::default(), scheduler).await
}

/// Waits (virtual time) until `check` holds; false after a virtual minute.
pub(crate) async fn settle(mut check: impl FnMut() -> bool) -> bool {
    for _ in 0..1200 {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// A batch that arrives after its worker said goodbye neither brings its stream back nor
/// creates an index lane: it is dropped and counted.
#[tokio::test(start_paused = true)]
async fn a_batch_after_goodbye_is_dropped() {
    let s = setup(LeaseConfig::default()).await;
    s.local.put(info(1, 1));
    assert!(settle(|| s.plane.streams().len() == 1).await);
    s.publish(1, batch(1, 1, 16)).await;
    assert!(settle(|| s.plane.indexer().sizes().blocks == 4).await);
    s.local.delete(WorkerId(1));
    assert!(settle(|| s.plane.streams().is_empty() && s.plane.indexer().ranks().is_empty()).await);
    s.publish(1, batch(1, 2, 32)).await;
    s.publish(9, batch(9, 1, 16)).await;
    assert!(settle(|| s.plane.counters().batches_dropped.load(Ordering::Relaxed) == 2).await);
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(s.plane.streams().is_empty());
    assert!(
        s.plane.indexer().ranks().is_empty(),
        "a late batch re-created a lane"
    );
    assert_eq!(s.plane.indexer().sizes().blocks, 0);
    assert_eq!(s.scheduler.lock().workers().count(), 0);
}

/// A batch published on another worker's subject is dropped: a worker writes into its own
/// stream only.
#[tokio::test(start_paused = true)]
async fn a_batch_on_another_worker_s_subject_is_dropped() {
    let s = setup(LeaseConfig::default()).await;
    s.register_two().await;
    // Worker 2 publishes as worker 1.
    s.publish(2, batch(1, 1, 16)).await;
    assert!(settle(|| s.plane.counters().malformed.load(Ordering::Relaxed) == 1).await);
    assert_eq!(s.plane.indexer().sizes().blocks, 0);
    s.publish(1, batch(1, 1, 16)).await;
    assert!(settle(|| s.plane.indexer().sizes().blocks == 4).await);
    assert_eq!(s.plane.counters().malformed.load(Ordering::Relaxed), 1);
}

/// Registrations with absurd shapes are refused before they cost anything: no streams, no
/// scheduler entries, and the plane keeps serving the rest of the fleet.
#[tokio::test(start_paused = true)]
async fn absurd_registrations_are_refused() {
    let s = setup(LeaseConfig::default()).await;
    s.local.put(info(1, 1_000_000));
    let mut many = info(2, 1);
    many.last_event_ids = vec![1; 100_000];
    s.local.put(many);
    s.local.put(info(3, 2));
    assert!(settle(|| s.plane.streams().len() == 2).await);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(s.plane.workers().len(), 1);
    assert_eq!(s.scheduler.lock().workers().count(), 2);
}

/// A worker that stops heartbeating expires after the lease TTL (virtual time), with its
/// stream, lane and scheduler entry; one that keeps heartbeating stays.
#[tokio::test(start_paused = true)]
async fn a_silent_worker_expires_after_its_lease() {
    let lease = LeaseConfig {
        heartbeat_ms: 200,
        ttl_ms: 1_000,
    };
    let s = setup(lease.clone()).await;
    let registry = Registry::Local(s.local.clone());
    let live = Registration::start(registry.clone(), Arc::new(Mutex::new(info(1, 1))), &lease)
        .await
        .unwrap();
    let dying = Registration::start(registry, Arc::new(Mutex::new(info(2, 1))), &lease)
        .await
        .unwrap();
    assert!(settle(|| s.plane.streams().len() == 2).await);
    dying.abandon();
    // Not before its lease runs out (its last heartbeat was at most 200 ms ago), and
    // within a second of it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(s.plane.workers().len(), 2, "expired inside its lease");
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let mut waited = 0;
    while s.plane.workers().len() != 1 {
        assert!(
            waited < 1_000,
            "not expired within a second of its lease's end"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        waited += 50;
    }
    assert_eq!(s.plane.workers()[0].id, WorkerId(1));
    assert_eq!(
        s.plane.counters().workers_expired.load(Ordering::Relaxed),
        1
    );
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(s.plane.workers().len(), 1, "a heartbeating worker expired");
    drop(live);
}

/// While the registry takes no writes (JetStream electing the bucket's leader, or short of a
/// quorum), no worker can heartbeat, so no lease lapses however long that lasts; once it
/// takes writes again, a worker that stays silent expires a lease later (virtual time).
#[tokio::test(start_paused = true)]
async fn no_lease_lapses_while_the_registry_takes_no_writes() {
    let lease = LeaseConfig {
        heartbeat_ms: 200,
        ttl_ms: 1_000,
    };
    let bus = Transport::Local(LocalBus::new());
    let local = LocalRegistry::default();
    let (healthy, rx) = watch::channel(true);
    let mut registry = Registry::Local(local.clone()).watch(lease);
    registry.healthy = rx;
    let (_stop, stop) = watch::channel(false);
    let plane = EventPlane::start(
        bus,
        Arc::new(Indexer::new(Config::default()).unwrap()),
        registry,
        PlaneConfig::default(),
        None,
        stop,
    )
    .await
    .unwrap();
    local.put(info(1, 1));
    assert!(settle(|| plane.workers().len() == 1).await);
    healthy.send_replace(false);
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(
        plane.workers().len(),
        1,
        "a lease lapsed while no heartbeat could be written"
    );
    healthy.send_replace(true);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(plane.workers().len(), 1, "the lease did not run afresh");
    assert!(settle(|| plane.workers().is_empty()).await);
    assert_eq!(plane.counters().workers_expired.load(Ordering::Relaxed), 1);
}

/// A stream that must resync asks for a snapshot; with no worker answering, each fetch ends
/// at its deadline and is asked again (virtual time): nothing waits forever.
#[tokio::test(start_paused = true)]
async fn an_unanswered_snapshot_request_is_retried_after_its_deadline() {
    let s = setup(LeaseConfig::default()).await;
    let mut registered = info(1, 1);
    registered.last_event_ids = vec![10];
    let registry = Registry::Local(s.local.clone());
    let _beating = Registration::start(
        registry,
        Arc::new(Mutex::new(registered)),
        &LeaseConfig::default(),
    )
    .await
    .unwrap();
    assert!(settle(|| s.plane.streams().len() == 1).await);
    // Mid-stream (the heartbeat says 10 events were sent): the stream resyncs.
    tokio::time::sleep(Duration::from_secs(20)).await;
    let (_, status) = &s.plane.streams()[0];
    assert!(!status.live);
    assert!(status.stats.snapshot_retries >= 3, "{:?}", status.stats);
}

/// A worker that changes epoch at every batch, each starting mid-stream (a snapshot is
/// needed each time), has one snapshot fetch under way at a time: each request supersedes
/// the one before, whose fetch is stopped with its reply subscription (each waited out its
/// deadline, one per batch).
#[tokio::test(start_paused = true)]
async fn a_worker_flapping_epochs_has_one_snapshot_fetch_at_a_time() {
    let s = setup(LeaseConfig::default()).await;
    s.local.put(info(1, 1));
    assert!(settle(|| s.plane.streams().len() == 1).await);
    let Transport::Local(bus) = &s.bus else {
        panic!("a local bus");
    };
    for epoch in 10..30 {
        let b = EventBatch {
            worker: WorkerId(1),
            dp_rank: DpRank(0),
            epoch,
            sent_unix_us: 0,
            events: vec![KvEvent {
                id: 5,
                tier: Tier::Device,
                data: KvEventData::Removed {
                    blocks: vec![crate::protocol::SeqHash(epoch)],
                },
            }],
        };
        s.publish(1, encode(&b).unwrap().into()).await;
    }
    assert!(settle(|| s.plane.streams()[0].1.epoch == Some(29)).await);
    let fetching = bus.open_subscriptions("_INBOX");
    assert!(fetching <= 1, "{fetching} snapshot fetches under way");
}

/// A registry that stops reporting leaves the router blind: the plane says so, loudly.
#[tokio::test(start_paused = true)]
async fn a_closed_registry_watch_is_fatal() {
    let bus = Transport::Local(LocalBus::new());
    let (tx, events) = tokio::sync::mpsc::channel(1);
    let (_stop, rx) = watch::channel(false);
    let plane = EventPlane::start(
        bus,
        Arc::new(Indexer::new(Config::default()).unwrap()),
        Watch {
            events,
            lease_ttl_ms: Some(1_000),
            healthy: watch::channel(true).1,
        },
        PlaneConfig::default(),
        None,
        rx,
    )
    .await
    .unwrap();
    let mut failed = plane.failed();
    assert!(failed.borrow().is_none());
    drop(tx);
    let reason = failed.wait_for(Option::is_some).await.unwrap().clone();
    assert!(reason.unwrap().contains("registry"));
}

/// A worker routed to that has never published an event is flagged silent; one that has
/// published is not, however many of its requests store nothing new (full prefix hits).
#[tokio::test(start_paused = true)]
async fn only_a_worker_never_heard_from_is_flagged_silent() {
    let s = setup(LeaseConfig::default()).await;
    s.register_two().await;
    s.publish(2, batch(2, 1, 16)).await;
    assert!(settle(|| s.plane.indexer().sizes().blocks == 4).await);
    for _ in 0..2 * SILENT_AFTER_REQUESTS {
        s.plane.note_routed((WorkerId(1), DpRank(0)));
        s.plane.note_routed((WorkerId(2), DpRank(0)));
    }
    assert_eq!(s.plane.silent_workers(), vec![WorkerId(1)]);
    // Its first batch clears the flag.
    s.publish(1, batch(1, 1, 16)).await;
    assert!(settle(|| s.plane.silent_workers().is_empty()).await);
}

/// A batch the index drops for want of a worker slot (more ranks than `max_workers`) is not
/// taken as applied: its stream resyncs instead of going on live with an index that lacks
/// what it applied.
#[tokio::test(start_paused = true)]
async fn a_batch_without_an_index_slot_resyncs_its_stream() {
    let s = one_slot().await;
    s.register_two().await;
    for w in [1, 2] {
        s.publish(w, batch(w, 1, 16)).await;
    }
    assert!(settle(|| s.plane.indexer().sizes().blocks == 4).await);
    // (Read before the workers' leases lapse: these fake workers send no heartbeats.)
    let live = || {
        let streams = s.plane.streams();
        let live = |w: u64| {
            streams
                .iter()
                .find(|(k, _)| k.0 == WorkerId(w))
                .map(|(_, st)| st.live)
        };
        (live(1), live(2))
    };
    assert!(
        settle(|| matches!(live(), (Some(a), Some(b)) if a != b)).await,
        "both streams live, one of them without an index slot: {:?}",
        live()
    );
}

/// A rank without an index slot resyncs after waits that double, not as fast as its
/// worker answers snapshot requests (each would be refused again by the full index).
#[tokio::test(start_paused = true)]
async fn a_rank_without_an_index_slot_backs_off_between_resyncs() {
    let s = one_slot().await;
    // Worker 2 answers its snapshot requests at once with a block (50 at most, so that a
    // loop without waits ends and virtual time can pass).
    let mut requests = s
        .bus
        .subscribe(&snapshot_subject("t", WorkerId(2)))
        .await
        .unwrap();
    let answered = Arc::new(AtomicU64::new(0));
    let (bus, count) = (s.bus.clone(), Arc::clone(&answered));
    tokio::spawn(async move {
        while let Some(m) = requests.next().await {
            let Some(reply) = m.reply else { continue };
            if count.fetch_add(1, Ordering::Relaxed) >= 50 {
                continue;
            }
            let snapshot = Snapshot {
                worker: WorkerId(2),
                dp_rank: DpRank(0),
                epoch: 7,
                watermark: 1,
                blocks: vec![crate::protocol::SnapshotBlock {
                    tier: Tier::Device,
                    parent: None,
                    block: StoredBlock {
                        seq: crate::protocol::SeqHash(5),
                        local: crate::protocol::LocalHash(5),
                    },
                }],
            };
            for chunk in snapshot.encode(1 << 20).unwrap() {
                let _ = bus.publish(&reply, None, chunk.into()).await;
            }
        }
    });
    s.register_two().await;
    s.publish(1, batch(1, 1, 16)).await;
    assert!(settle(|| s.plane.indexer().sizes().blocks == 4).await);
    // Worker 2's batch finds no slot: its stream resyncs, and keeps being refused.
    s.publish(2, batch(2, 1, 16)).await;
    for _ in 0..40 {
        s.local.put(info(1, 1));
        s.local.put(info(2, 1));
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let n = answered.load(Ordering::Relaxed);
    // Waits of 1, 2, 4, 8 and 16 s fit in 40 s (each answered at once): 5 or so.
    assert!((1..=8).contains(&n), "{n} snapshots fetched in 40 s");
}

/// A worker flooding its subject faster than its stream applies is cut off by the blocks
/// its queued batches name, not only by their number: past `queue_blocks`, batches are
/// dropped and the stream resyncs.
#[tokio::test(start_paused = true)]
async fn a_stream_s_queue_is_bounded_by_blocks() {
    // 100 batches of 4 blocks each: far fewer than the queue's 4,096 batches, ten times its
    // 40 blocks.
    let s = flooded(PlaneConfig {
        queue_blocks: 40,
        ..PlaneConfig::default()
    })
    .await;
    assert!(settle(|| s.plane.counters().queue_overflows.load(Ordering::Relaxed) > 0).await);
}

/// A plane by `config` with worker 1 registered, and 100 of its batches (4 blocks each)
/// published before the plane's tasks run again.
async fn flooded(config: PlaneConfig) -> Setup {
    let s = Setup::start(
        LeaseConfig::default(),
        Config::default(),
        config,
        Scheduler::new(Default::default()).unwrap(),
    )
    .await;
    s.local.put(info(1, 1));
    assert!(settle(|| s.plane.streams().len() == 1).await);
    for id in 1..=100 {
        s.publish(1, batch(1, id, 16)).await;
    }
    s
}

/// A stream counts the times what the index held of it was dropped at once: each `Cleared`
/// event, and a reset once it has applied a batch (what the hash-mismatch alarm reads to
/// leave the requests watched then unjudged). Its first contact's reset, which drops nothing
/// the router had, is none.
#[tokio::test(start_paused = true)]
async fn a_stream_counts_its_wipes() {
    let s = setup(LeaseConfig::default()).await;
    s.local.put(info(1, 1));
    assert!(settle(|| s.plane.streams().len() == 1).await);
    s.publish(1, batch(1, 1, 16)).await;
    assert!(settle(|| s.plane.streams()[0].1.applied == 1).await);
    let first = s.plane.streams()[0].1.wipes;
    assert_eq!(first, 0, "first contact wipes nothing");
    let cleared = EventBatch {
        worker: WorkerId(1),
        dp_rank: DpRank(0),
        epoch: 7,
        sent_unix_us: 0,
        events: vec![KvEvent {
            id: 2,
            tier: Tier::Device,
            data: KvEventData::Cleared,
        }],
    };
    s.publish(1, encode(&cleared).unwrap().into()).await;
    assert!(settle(|| s.plane.streams()[0].1.wipes == first + 1).await);
    s.publish(1, batch(1, 3, 16)).await;
    assert!(settle(|| s.plane.streams()[0].1.applied == 3).await);
    assert_eq!(s.plane.streams()[0].1.wipes, first + 1);
}

/// Event messages the fleet owner has not taken yet are bounded in bytes
/// (`intake_bytes`): a burst past it is dropped on arrival and counted (the streams' gap
/// detection resyncs their workers), not parked in the NATS client's queue of 65,536
/// messages of up to max_payload each.
#[tokio::test(start_paused = true)]
async fn a_burst_past_the_intake_bound_is_dropped_and_counted() {
    // A few of the 100 batches fit the bound.
    let s = flooded(PlaneConfig {
        intake_bytes: 2_000,
        ..PlaneConfig::default()
    })
    .await;
    assert!(settle(|| s.plane.counters().intake_dropped.load(Ordering::Relaxed) > 0).await);
    let dropped = s.plane.counters().intake_dropped.load(Ordering::Relaxed);
    assert!(dropped < 100, "{dropped}: some fit");
}

/// Registrations arriving together (a router reading a large fleet's registry at start)
/// publish the fleet view once they have been read, not once each: every view is a copy
/// of every registration, so a view a registration cost O(n²) copies.
#[tokio::test(start_paused = true)]
async fn a_burst_of_registrations_publishes_few_views() {
    let s = setup(LeaseConfig::default()).await;
    let before = s.plane.counters().views_published.load(Ordering::Relaxed);
    for id in 1..=2_000 {
        s.local.put(info(id, 1));
    }
    assert!(settle(|| s.plane.view().workers.len() == 2_000).await);
    let views = s.plane.counters().views_published.load(Ordering::Relaxed) - before;
    assert!(views <= 100, "{views} views for 2,000 registrations");
    // A lone change is published at once.
    s.local.delete(WorkerId(1));
    assert!(settle(|| s.plane.view().workers.len() == 1_999).await);
}

/// A plane with `permits` snapshot fetches, whose leases outlast a test: its workers are
/// registered once and never heartbeat.
async fn with_snapshot_permits(permits: usize) -> Setup {
    let config = PlaneConfig {
        snapshot_fetches: permits,
        ..PlaneConfig::default()
    };
    let scheduler = Scheduler::new(Default::default()).unwrap();
    let lease = LeaseConfig {
        heartbeat_ms: 60_000,
        ttl_ms: 600_000,
    };
    Setup::start(lease, Config::default(), config, scheduler).await
}

/// Snapshot fetches are bounded across streams: after a reconnect (or a router start
/// amid a running fleet) every stream wants one, and each would hold a worker's snapshot
/// in the router's memory. With two permits and ten streams mid-stream whose workers never
/// answer, at most two fetches are under way at a time, and every worker is asked in turn.
#[tokio::test(start_paused = true)]
async fn snapshot_fetches_are_bounded_across_streams() {
    let s = with_snapshot_permits(2).await;
    let Transport::Local(bus) = &s.bus else {
        panic!("a local bus");
    };
    let mut asked = s.bus.subscribe("kvroute.t.snapshot.>").await.unwrap();
    for id in 1..=10 {
        // Mid-stream (10 events sent already): each stream starts from a snapshot.
        let mut registered = info(id, 1);
        registered.last_event_ids = vec![10];
        s.local.put(registered);
    }
    assert!(settle(|| s.plane.streams().len() == 10).await);
    let mut workers = std::collections::BTreeSet::new();
    let mut most = 0;
    let until = tokio::time::Instant::now() + Duration::from_secs(120);
    while workers.len() < 10 && tokio::time::Instant::now() < until {
        most = most.max(bus.open_subscriptions("_INBOX"));
        if let Ok(Some(request)) =
            tokio::time::timeout(Duration::from_millis(50), asked.next()).await
        {
            workers.insert(request.subject.clone());
        }
    }
    most = most.max(bus.open_subscriptions("_INBOX"));
    assert_eq!(workers.len(), 10, "workers asked: {workers:?}");
    assert!(most <= 2, "{most} snapshot fetches under way at once");
}

/// A snapshot holds its fetch's permit until its stream has applied it: one queued behind
/// the stream's batches, or being applied, is still in the router's memory. With one permit
/// and two workers to resync, the second is not asked while the first one's snapshot waits
/// to be applied (the permit went back once the snapshot was queued, and every stream's
/// snapshot could be in memory at once after a reconnect); once it is, the second is asked
/// and both streams go live.
#[tokio::test(start_paused = true)]
async fn a_snapshot_holds_its_permit_until_it_is_applied() {
    let s = with_snapshot_permits(1).await;
    s.plane.shared.hold_snapshot_applies.set(true);
    let asked: Arc<Mutex<Vec<u64>>> = Arc::default();
    for id in 1..=2u64 {
        let snapshot = Snapshot {
            worker: WorkerId(id),
            dp_rank: DpRank(0),
            epoch: 7,
            watermark: 10,
            blocks: (1..=2u64)
                .map(|i| crate::protocol::SnapshotBlock {
                    tier: Tier::Device,
                    parent: None,
                    block: StoredBlock {
                        seq: SeqHash(id * 1_000 + i),
                        local: LocalHash(i),
                    },
                })
                .collect(),
        };
        let mut requests = s
            .bus
            .subscribe(&snapshot_subject("t", WorkerId(id)))
            .await
            .unwrap();
        let (bus, asked) = (s.bus.clone(), Arc::clone(&asked));
        tokio::spawn(async move {
            while let Some(m) = requests.next().await {
                asked.lock().push(id);
                let Some(reply) = m.reply else { continue };
                for chunk in snapshot.encode(1 << 20).unwrap() {
                    let _ = bus.publish(&reply, None, chunk.into()).await;
                }
            }
        });
    }
    for id in 1..=2 {
        // Mid-stream: each stream starts from a snapshot.
        let mut registered = info(id, 1);
        registered.last_event_ids = vec![10];
        s.local.put(registered);
    }
    assert!(settle(|| !asked.lock().is_empty()).await);
    // Long past every snapshot wait and retry.
    tokio::time::sleep(Duration::from_secs(60)).await;
    let first = asked.lock()[0];
    assert!(
        asked.lock().iter().all(|&id| id == first),
        "workers asked while a snapshot waited to be applied: {:?}",
        asked.lock()
    );
    s.plane.shared.hold_snapshot_applies.set(false);
    assert!(
        settle(|| {
            let streams = s.plane.streams();
            streams.len() == 2 && streams.iter().all(|(_, st)| st.live)
        })
        .await
    );
    assert!(asked.lock().contains(&(3 - first)));
}

/// A snapshot too large to apply on a runtime thread (it would hold that thread, and the
/// requests behind it, for as long as it takes) is applied on the blocking pool, in its
/// place in the stream: the batch after it applies after it, and the stream is live.
#[tokio::test(start_paused = true)]
async fn a_large_snapshot_applies_off_the_runtime_in_order() {
    let s = setup(LeaseConfig::default()).await;
    let blocks = INLINE_APPLY_BLOCKS + 1_000;
    let tokens: Vec<u32> = (1_000_000..1_000_000 + 4 * blocks as u32).collect();
    let chain = hash_blocks(&tokens, NonZeroUsize::new(4).unwrap(), Salt::NONE);
    let snapshot = Snapshot {
        worker: WorkerId(1),
        dp_rank: DpRank(0),
        epoch: 7,
        watermark: 10,
        blocks: chain
            .iter()
            .scan(None, |parent, b| {
                let block = crate::protocol::SnapshotBlock {
                    tier: Tier::Device,
                    parent: *parent,
                    block: StoredBlock {
                        seq: b.seq,
                        local: b.local,
                    },
                };
                *parent = Some(b.seq);
                Some(block)
            })
            .collect(),
    };
    let mut requests = s
        .bus
        .subscribe(&snapshot_subject("t", WorkerId(1)))
        .await
        .unwrap();
    let bus = s.bus.clone();
    tokio::spawn(async move {
        while let Some(m) = requests.next().await {
            let Some(reply) = m.reply else { continue };
            for chunk in snapshot.encode(1 << 20).unwrap() {
                let _ = bus.publish(&reply, None, chunk.into()).await;
            }
        }
    });
    // Mid-stream (its registration says 10 events were sent): the stream asks for a
    // snapshot, and event 11 follows it.
    let mut registered = info(1, 1);
    registered.last_event_ids = vec![10];
    s.local.put(registered);
    assert!(
        settle(|| s
            .plane
            .streams()
            .first()
            .is_some_and(|(_, st)| st.stats.snapshots == 1))
        .await
    );
    s.publish(1, batch(1, 11, 16)).await;
    assert!(settle(|| s.plane.indexer().sizes().blocks == blocks + 4).await);
    let (_, status) = &s.plane.streams()[0];
    assert!(status.live, "{status:?}");
    assert_eq!(status.stats.gaps, 0, "{:?}", status.stats);
    let held = s
        .plane
        .indexer()
        .find_matches_seq(&chain.iter().map(|b| b.seq).collect::<Vec<_>>());
    assert_eq!(held.workers.len(), 1);
    assert_eq!(held.workers[0].device as usize, blocks);
}

/// What a payload may hold follows the server's `max_payload` as it is now: a NATS server
/// restarted with a larger one (as the workers' own errors advise) lets workers send larger
/// batches and snapshot chunks, which limits fixed when the router started refused for
/// good (each snapshot chunk refused as malformed: a resync that never ended).
#[tokio::test(start_paused = true)]
async fn a_larger_max_payload_after_start_is_taken() {
    let s = setup(LeaseConfig::default()).await;
    s.local.put(info(1, 1));
    assert!(settle(|| s.plane.streams().len() == 1).await);
    let Transport::Local(bus) = &s.bus else {
        panic!("a local bus");
    };
    bus.max_payload.store(8 << 20, Ordering::Relaxed);
    // 100,000 blocks: about 1.6 MB, over the 1 MiB the plane started with.
    let big = batch(1, 1, 400_000);
    assert!(big.len() > 1 << 20, "{} bytes", big.len());
    s.publish(1, big).await;
    assert!(settle(|| s.plane.indexer().sizes().blocks == 100_000).await);
    assert_eq!(s.plane.counters().malformed.load(Ordering::Relaxed), 0);
}

/// Two processes answer a worker's snapshot requests (the old incarnation still draining
/// under the same id, and the new one): the older one's answer, complete first, is not the
/// fetch's answer; the present incarnation's is, and the stream goes live. The fetch
/// returned the first whole snapshot, which the stream refused, and asked again with the
/// old one answering first every time.
#[tokio::test(start_paused = true)]
async fn an_older_incarnation_s_snapshot_does_not_answer_the_fetch() {
    let s = setup(LeaseConfig::default()).await;
    let answer = |epoch: u64, delay_ms: u64| {
        let bus = s.bus.clone();
        async move {
            let mut requests = bus
                .subscribe(&snapshot_subject("t", WorkerId(1)))
                .await
                .unwrap();
            tokio::spawn(async move {
                while let Some(m) = requests.next().await {
                    let Some(reply) = m.reply else { continue };
                    tokio::time::sleep(Duration::from_millis(delay_ms)).await;
                    let snapshot = Snapshot {
                        worker: WorkerId(1),
                        dp_rank: DpRank(0),
                        epoch,
                        watermark: 10,
                        blocks: Vec::new(),
                    };
                    for chunk in snapshot.encode(1 << 20).unwrap() {
                        let _ = bus.publish(&reply, None, chunk.into()).await;
                    }
                }
            });
        }
    };
    answer(6, 0).await;
    answer(7, 10).await;
    let mut registered = info(1, 1);
    registered.last_event_ids = vec![10];
    s.local.put(registered);
    assert!(settle(|| s.plane.streams().first().is_some_and(|(_, st)| st.live)).await);
    let (_, status) = &s.plane.streams()[0];
    assert_eq!(status.epoch, Some(7));
    assert_eq!(status.stats.snapshot_retries, 0, "{:?}", status.stats);
}

/// An older incarnation's heartbeat, ignored while the later one is alive (two processes
/// under one id), does not report its engine's load as the kept one's: the scheduler's
/// view of the worker's queue and KV usage stays the live incarnation's.
#[tokio::test(start_paused = true)]
async fn an_ignored_incarnation_s_engine_load_is_not_taken() {
    let lease = LeaseConfig {
        heartbeat_ms: 200,
        ttl_ms: 1_000,
    };
    let s = setup(lease).await;
    let load = |waiting| crate::engines::metrics::EngineLoad {
        running: 1,
        waiting,
        kv_usage_permille: 100,
    };
    let key = (WorkerId(1), DpRank(0));
    let mut later = info(1, 1);
    later.epoch = 9;
    later.engine_load = Some(load(0));
    s.local.put(later);
    assert!(settle(|| s.scheduler.lock().engine_load(key) == Some(load(0))).await);
    let mut older = info(1, 1);
    older.url = "http://127.0.0.1:9/other".into();
    older.engine_load = Some(load(50));
    s.local.put(older);
    // Registry events are taken in order: once worker 2 has its stream, the older
    // incarnation's heartbeat was heard.
    s.local.put(info(2, 1));
    assert!(settle(|| s.plane.streams().len() == 2).await);
    assert_eq!(s.scheduler.lock().engine_load(key), Some(load(0)));
}
