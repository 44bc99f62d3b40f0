//! The event plane end to end: real nats-server, simulated workers publishing real engine
//! events, the router's plane keeping its index an exact mirror through faults.
#![allow(missing_docs, clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use kvroute::discovery::{LeaseConfig, LocalRegistry, Registry};
use kvroute::events::plane::{EventPlane, PlaneConfig, events_subject};
use kvroute::events::transport::{LocalBus, Transport};
use kvroute::indexer::{Config, Indexer};
use kvroute::protocol::{SeqHash, Tier, WorkerId};
use kvroute_e2e::nats::NatsServer;
use kvroute_e2e::sim::{Faults, SimWorker, eventually, indexed, small_engine, workload};
use tokio::sync::watch;

const CLUSTER: &str = "test";

fn lease() -> LeaseConfig {
    LeaseConfig {
        heartbeat_ms: 200,
        ttl_ms: 1_000,
    }
}

struct Router {
    plane: EventPlane,
    scheduler: Arc<parking_lot::Mutex<kvroute::scheduler::Scheduler>>,
    _shutdown: watch::Sender<bool>,
}

async fn router(transport: Transport, registry: &Registry) -> Router {
    let indexer = Arc::new(Indexer::new(Config::default()).unwrap());
    let (shutdown, rx) = watch::channel(false);
    let config = PlaneConfig {
        cluster: CLUSTER.into(),
        ..PlaneConfig::default()
    };
    let scheduler = Arc::new(parking_lot::Mutex::new(
        kvroute::scheduler::Scheduler::new(Default::default()).unwrap(),
    ));
    let plane = EventPlane::start(
        transport,
        indexer,
        registry.watch(lease()),
        config,
        Some(Arc::clone(&scheduler)),
        rx,
    )
    .await
    .unwrap();
    Router {
        plane,
        scheduler,
        _shutdown: shutdown,
    }
}

async fn nats(server: &NatsServer, name: &str) -> (Transport, Registry) {
    nats_as(server, name, &Default::default()).await
}

async fn nats_as(
    server: &NatsServer,
    name: &str,
    auth: &kvroute::auth::NatsAuth,
) -> (Transport, Registry) {
    nats_with(server, name, auth, &lease()).await
}

/// A plain connection to `server` (no credentials), named `name`.
async fn connect(server: &NatsServer, name: &str) -> Transport {
    Transport::connect_nats(&server.url(), name, &Default::default())
        .await
        .unwrap()
}

/// A connection and the registry; the bucket, if this creates it, keeps entries for two of
/// `bucket_lease`'s leases.
async fn nats_with(
    server: &NatsServer,
    name: &str,
    auth: &kvroute::auth::NatsAuth,
    bucket_lease: &LeaseConfig,
) -> (Transport, Registry) {
    let transport = Transport::connect_nats(&server.url(), name, auth)
        .await
        .unwrap();
    let client = transport.nats_client().unwrap().clone();
    let registry = Registry::nats(client, CLUSTER, bucket_lease, 1)
        .await
        .unwrap();
    (transport, registry)
}

async fn workers(
    transport: &Transport,
    registry: &Registry,
    ids: std::ops::Range<u64>,
    faults: Faults,
) -> Vec<SimWorker> {
    let mut out = Vec::new();
    for id in ids {
        out.push(
            SimWorker::start(
                transport.clone(),
                registry.clone(),
                CLUSTER,
                WorkerId(id),
                small_engine(),
                faults,
            )
            .await
            .unwrap(),
        );
    }
    out
}

async fn run_workload(sims: &[SimWorker], seed: u32, n: u32) {
    for (i, s) in sims.iter().enumerate() {
        s.submit(workload(seed + i as u32, n)).await;
    }
    for s in sims {
        tokio::time::timeout(Duration::from_secs(60), s.wait_idle())
            .await
            .expect("workload finishes");
    }
}

fn truth(sims: &[SimWorker]) -> BTreeSet<(WorkerId, Tier, SeqHash)> {
    sims.iter().flat_map(|s| s.truth()).collect()
}

/// Waits for the index to equal the workers' caches; panics with the difference if not.
async fn assert_exact(router: &Router, sims: &[SimWorker]) {
    let ok = eventually(Duration::from_secs(20), || {
        indexed(router.plane.indexer()) == truth(sims)
    })
    .await;
    if !ok {
        let (have, want) = (indexed(router.plane.indexer()), truth(sims));
        let extra: Vec<_> = have.difference(&want).take(5).collect();
        let missing: Vec<_> = want.difference(&have).take(5).collect();
        panic!(
            "index differs from the workers: {} extra {extra:?}, {} missing {missing:?}; streams {:?}",
            have.difference(&want).count(),
            want.difference(&have).count(),
            router.plane.streams()
        );
    }
    assert!(
        !truth(sims).is_empty(),
        "the workload should leave blocks cached"
    );
    assert!(
        truth(sims).iter().any(|(_, t, _)| *t == Tier::Host),
        "the workload should offload to G2"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_process_plane_mirrors_eight_workers_exactly() {
    let transport = Transport::Local(LocalBus::new());
    let registry = Registry::Local(LocalRegistry::default());
    let r = router(transport.clone(), &registry).await;
    let sims = workers(&transport, &registry, 0..8, Faults::default()).await;
    run_workload(&sims, 1, 60).await;
    assert_exact(&r, &sims).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_plane_mirrors_eight_workers_exactly() {
    let server = NatsServer::start().unwrap();
    let (transport, registry) = nats(&server, "workers").await;
    let (rt, rreg) = nats(&server, "router").await;
    let r = router(rt, &rreg).await;
    let sims = workers(&transport, &registry, 0..8, Faults::default()).await;
    // The router knows the fleet before it publishes: batches that reach it before the
    // registration its watch delivers later (a loaded machine delays the watch's start)
    // are a stranger's, dropped, and the stream joins mid-way with a resync, which is
    // the recovery and not what this test counts.
    let known = eventually(Duration::from_secs(30), || r.plane.streams().len() == 8).await;
    assert!(known, "{:?}", r.plane.streams());
    run_workload(&sims, 1, 60).await;
    assert_exact(&r, &sims).await;
    let streams = r.plane.streams();
    assert_eq!(streams.len(), 8);
    assert!(
        streams.iter().all(|(_, s)| s.live && s.stats.resyncs == 0),
        "{streams:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_duplicated_and_reordered_batches_converge() {
    let server = NatsServer::start().unwrap();
    let (transport, registry) = nats(&server, "workers").await;
    let (rt, rreg) = nats(&server, "router").await;
    let r = router(rt, &rreg).await;
    let faults = Faults {
        drop: 0.01,
        duplicate: 0.05,
        reorder: 0.05,
    };
    let sims = workers(&transport, &registry, 0..8, faults).await;
    run_workload(&sims, 2, 80).await;
    assert_exact(&r, &sims).await;
    let resyncs: u64 = r.plane.streams().iter().map(|(_, s)| s.stats.resyncs).sum();
    let duplicates: u64 = r
        .plane
        .streams()
        .iter()
        .map(|(_, s)| s.stats.duplicates)
        .sum();
    assert!(
        resyncs > 0 && duplicates > 0,
        "faults should have been seen: {:?}",
        r.plane.streams()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_started_late_recovers_from_snapshots() {
    let server = NatsServer::start().unwrap();
    let (transport, registry) = nats(&server, "workers").await;
    let sims = workers(&transport, &registry, 0..4, Faults::default()).await;
    run_workload(&sims, 3, 50).await;
    let (rt, rreg) = nats(&server, "router").await;
    let r = router(rt, &rreg).await;
    assert_exact(&r, &sims).await;
    // New events after the cold start apply live on top.
    run_workload(&sims, 4, 20).await;
    assert_exact(&r, &sims).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_in_place_and_a_crash_leave_no_stale_entries() {
    let server = NatsServer::start().unwrap();
    let (transport, registry) = nats(&server, "workers").await;
    let (rt, rreg) = nats(&server, "router").await;
    let r = router(rt, &rreg).await;
    let mut sims = workers(&transport, &registry, 0..3, Faults::default()).await;
    run_workload(&sims, 5, 40).await;
    assert_exact(&r, &sims).await;
    // Worker 0 restarts in place: same id, new epoch, empty cache.
    let old = sims.remove(0);
    old.stop(true).await;
    let restarted = SimWorker::start(
        transport.clone(),
        registry.clone(),
        CLUSTER,
        WorkerId(0),
        small_engine(),
        Faults::default(),
    )
    .await
    .unwrap();
    sims.insert(0, restarted);
    run_workload(&sims[..1], 6, 10).await;
    assert_exact(&r, &sims).await;
    // Worker 2 crashes without goodbye: its lease expires (TTL 1 s) and it is gone (the
    // timing itself is checked on the paused clock, in the plane's unit tests; here, on a
    // loaded machine, only that it goes).
    let removals = || {
        let counters = r.plane.counters();
        counters.workers_expired.load(Ordering::Relaxed)
            + counters.workers_left.load(Ordering::Relaxed)
    };
    // The restart's goodbye is counted if it was acknowledged within its deadline (a lease);
    // on a starved machine it may not be, and the new epoch alone replaces the old one.
    let before_crash = removals();
    assert!(before_crash <= 1, "one restart: {before_crash} removals");
    let crashed = sims.pop().unwrap();
    let started = tokio::time::Instant::now();
    crashed.stop(false).await;
    let gone = eventually(Duration::from_secs(30), || {
        !indexed(r.plane.indexer())
            .iter()
            .any(|(w, _, _)| *w == WorkerId(2))
    })
    .await;
    assert!(
        gone,
        "crashed worker still indexed after {:?}",
        started.elapsed()
    );
    // Normally the router's own TTL check expires it; on a starved machine the bucket's
    // max-age deletion may be seen first. Either way it is gone, and said so once.
    assert_eq!(
        removals(),
        before_crash + 1,
        "the crash is counted once (expired, or deleted by the bucket's max age)"
    );
    // The scheduler loses it from the same owner, in the same step.
    assert!(
        r.scheduler
            .lock()
            .workers()
            .all(|(k, _)| k.0 != WorkerId(2)),
        "the expired worker must leave the scheduler too"
    );
    assert!(r.plane.worker(WorkerId(2)).is_none());
    assert_exact(&r, &sims).await;
}

/// A worker replaced under the same id before the old process stopped (a StatefulSet pod
/// replaced while its node was cut off, the old one killed when the node comes back): the
/// old process's goodbye names its own incarnation, and no router drops the replacement (a
/// bare delete removed it from every router whenever the old one's beat was the last
/// written, about half the time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_predecessor_s_goodbye_leaves_its_replacement_registered() {
    let server = NatsServer::start().unwrap();
    let (old_t, old_reg) = nats(&server, "old").await;
    let (new_t, new_reg) = nats(&server, "new").await;
    let (rt, rreg) = nats(&server, "router").await;
    let r = router(rt.clone(), &rreg).await;
    let old = workers(&old_t, &old_reg, 0..1, Faults::default()).await;
    let first = eventually(Duration::from_secs(30), || {
        r.plane.worker(WorkerId(0)).is_some()
    })
    .await;
    assert!(first);
    let old_epoch = r.plane.worker(WorkerId(0)).unwrap().epoch;
    let new = workers(&new_t, &new_reg, 0..1, Faults::default()).await;
    let replaced = eventually(Duration::from_secs(30), || {
        r.plane
            .worker(WorkerId(0))
            .is_some_and(|w| w.epoch > old_epoch)
    })
    .await;
    assert!(replaced);
    let new_epoch = r.plane.worker(WorkerId(0)).unwrap().epoch;
    for w in old {
        w.stop(true).await;
    }
    // A registration written after the goodbye: once the router has it, it has read
    // everything the registry took before it, the goodbye included.
    let marker = workers(&rt, &rreg, 99..100, Faults::default()).await;
    let seen = eventually(Duration::from_secs(30), || {
        r.plane.worker(WorkerId(99)).is_some()
    })
    .await;
    assert!(seen);
    assert_eq!(r.plane.counters().workers_left.load(Ordering::Relaxed), 0);
    assert_eq!(
        r.plane.worker(WorkerId(0)).map(|w| w.epoch),
        Some(new_epoch)
    );
    for w in new.into_iter().chain(marker) {
        w.stop(true).await;
    }
}

/// A router starting after a worker crashed reads the crashed worker's registration back
/// from the bucket (it stays until the bucket's max age, two leases): older than the lease
/// by the bucket's own timestamps, it is never routed to, while the live worker is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_started_after_a_crash_does_not_route_to_the_crashed_worker() {
    let server = NatsServer::start().unwrap();
    // The bucket keeps entries 10 s (its creator's lease of 5 s, twice), the router's
    // lease is 1 s: the crashed worker's entry is still there, and stale, when it starts.
    let bucket_lease = LeaseConfig {
        ttl_ms: 5_000,
        ..lease()
    };
    let (transport, registry) =
        nats_with(&server, "workers", &Default::default(), &bucket_lease).await;
    let sims = workers(&transport, &registry, 0..2, Faults::default()).await;
    let mut sims = sims.into_iter();
    let (live, crashed) = (sims.next().unwrap(), sims.next().unwrap());
    crashed.stop(false).await;
    // The crashed worker's last heartbeat ages past the router's lease (1 s) while the live
    // one's go on; the bucket would drop it at 10 s. (JetStream stamps entries with the server's
    // clock, so the age is real time: no paused clock can stand in for it.)
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    let (rt, rreg) = nats(&server, "router").await;
    let r = router(rt, &rreg).await;
    let heard = eventually(Duration::from_secs(10), || {
        r.plane.worker(WorkerId(0)).is_some()
    })
    .await;
    assert!(heard, "the live worker never registered");
    // The bucket's history is delivered in one go, the crashed worker's entry (older)
    // first: by now it has been read, and ignored (kept aside, counted: a bucket that had
    // already dropped it would prove nothing).
    assert!(
        r.plane.worker(WorkerId(1)).is_none(),
        "the crashed worker's stale registration was taken as live"
    );
    assert_eq!(
        r.plane
            .counters()
            .stale_registrations
            .load(Ordering::Relaxed),
        1,
        "the crashed worker's registration was not read back (the bucket dropped it first?)"
    );
    assert!(
        r.scheduler
            .lock()
            .workers()
            .all(|(k, _)| k.0 == WorkerId(0)),
        "the crashed worker is routable"
    );
    live.stop(true).await;
}

/// A router whose own writes to the registry fail (its NATS account may not write the
/// bucket) while the workers' heartbeats arrive still lapses a crashed worker's lease: the
/// registry takes writes, so a silent worker is gone. (Only while nobody's writes land,
/// an election or a lost quorum, do leases wait.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_that_cannot_write_the_registry_still_lapses_a_crashed_worker() {
    let server = NatsServer::start_with_config(
        r#"authorization {
  users = [
    {user: "worker", password: "w"}
    {user: "router", password: "r", permissions: {publish: {allow: [">"], deny: ["$KV.kvroute-test-workers._probe.>"]}}}
  ]
}"#,
    )
    .unwrap();
    let user = |user: &str, password: &str| kvroute::auth::NatsAuth {
        nats_user: Some(user.into()),
        nats_password: Some(kvroute::auth::Secret::new(password)),
        ..Default::default()
    };
    let (transport, registry) = nats_as(&server, "worker", &user("worker", "w")).await;
    let sims = workers(&transport, &registry, 0..2, Faults::default()).await;
    let (rt, rreg) = nats_as(&server, "router", &user("router", "r")).await;
    let r = router(rt, &rreg).await;
    let both = eventually(Duration::from_secs(10), || {
        r.plane.worker(WorkerId(0)).is_some() && r.plane.worker(WorkerId(1)).is_some()
    })
    .await;
    assert!(both, "the workers never registered");
    let mut sims = sims.into_iter();
    let (live, crashed) = (sims.next().unwrap(), sims.next().unwrap());
    crashed.stop(false).await;
    let gone = eventually(Duration::from_secs(10), || {
        r.plane.worker(WorkerId(1)).is_none()
    })
    .await;
    assert!(gone, "the crashed worker's lease never lapsed");
    assert!(
        r.plane.worker(WorkerId(0)).is_some(),
        "the live worker lapsed"
    );
    live.stop(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_server_restart_mid_run() {
    let mut server = NatsServer::start().unwrap();
    let (transport, registry) = nats(&server, "workers").await;
    let (rt, rreg) = nats(&server, "router").await;
    let r = router(rt, &rreg).await;
    let sims = workers(&transport, &registry, 0..4, Faults::default()).await;
    run_workload(&sims, 7, 30).await;
    server.restart().unwrap();
    run_workload(&sims, 8, 30).await;
    assert_exact(&r, &sims).await;
    // The router resynced after reconnecting rather than assume nothing was lost.
    let streams = r.plane.streams();
    assert!(
        streams.iter().all(|(_, s)| s.stats.resyncs >= 1),
        "{streams:?}"
    );
}

/// A NATS outage longer than the lease is the router's deafness, not the workers' death:
/// every worker stays routable through it, and the index is exact after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_outage_longer_than_the_lease_keeps_every_worker_routable() {
    let mut server = NatsServer::start().unwrap();
    let (transport, registry) = nats(&server, "workers").await;
    let (rt, rreg) = nats(&server, "router").await;
    let r = router(rt, &rreg).await;
    let sims = workers(&transport, &registry, 0..4, Faults::default()).await;
    run_workload(&sims, 7, 20).await;
    let all = eventually(Duration::from_secs(10), || {
        r.scheduler.lock().workers().count() == 4
    })
    .await;
    assert!(all, "the workers never became routable");
    server.kill();
    // The outage lasts 2.5 leases (the fault's length, not a wait for a condition).
    let outage = std::time::Instant::now() + Duration::from_millis(2_500);
    while std::time::Instant::now() < outage {
        assert_eq!(
            r.scheduler.lock().workers().count(),
            4,
            "a worker was dropped while the router could not hear it"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    server.restart().unwrap();
    run_workload(&sims, 8, 20).await;
    assert_exact(&r, &sims).await;
    assert_eq!(r.scheduler.lock().workers().count(), 4);
    // And the router hears the registry again (a router deaf for good would pass the
    // checks above): a worker that crashes now lapses.
    let mut sims = sims;
    sims.pop().unwrap().stop(false).await;
    let gone = eventually(Duration::from_secs(20), || {
        r.plane.worker(WorkerId(3)).is_none()
    })
    .await;
    assert!(gone, "a worker that crashed after the outage never lapsed");
    assert_eq!(r.scheduler.lock().workers().count(), 3);
}

/// A NATS server that comes back without its store (the chart's NATS without persistence
/// keeps it in an `emptyDir`) has lost the registry bucket. The router's probe and the
/// workers' heartbeats create it again, so the router hears the registry again: a worker
/// that crashes afterwards lapses (a deaf router would keep it routable for good), the live
/// ones stay, and the index is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_bucket_lost_with_the_server_s_store_is_created_again() {
    let mut server = NatsServer::start().unwrap();
    let (transport, registry) = nats(&server, "workers").await;
    let (rt, rreg) = nats(&server, "router").await;
    let r = router(rt, &rreg).await;
    let sims = workers(&transport, &registry, 0..3, Faults::default()).await;
    run_workload(&sims, 7, 20).await;
    let all = eventually(Duration::from_secs(10), || {
        r.scheduler.lock().workers().count() == 3
    })
    .await;
    assert!(all, "the workers never became routable");
    server.restart_empty().unwrap();
    let mut sims = sims;
    let crashed = sims.pop().unwrap();
    crashed.stop(false).await;
    let gone = eventually(Duration::from_secs(20), || {
        r.plane.worker(WorkerId(2)).is_none()
    })
    .await;
    assert!(
        gone,
        "the crashed worker never lapsed: the router does not hear the registry"
    );
    run_workload(&sims, 8, 20).await;
    assert_exact(&r, &sims).await;
    assert_eq!(r.scheduler.lock().workers().count(), 2);
    let js = async_nats::jetstream::new(transport.nats_client().unwrap().clone());
    let store = js
        .get_key_value(kvroute::discovery::bucket_name(CLUSTER))
        .await
        .unwrap();
    assert!(
        store.get("0").await.unwrap().is_some(),
        "worker 0 registered again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_router_replicas_build_the_same_index() {
    let server = NatsServer::start().unwrap();
    let (transport, registry) = nats(&server, "workers").await;
    let (t1, reg1) = nats(&server, "router-1").await;
    let (t2, reg2) = nats(&server, "router-2").await;
    let (r1, r2) = (router(t1, &reg1).await, router(t2, &reg2).await);
    let sims = workers(&transport, &registry, 0..4, Faults::default()).await;
    run_workload(&sims, 9, 40).await;
    assert_exact(&r1, &sims).await;
    assert_exact(&r2, &sims).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_payload_is_counted_and_ignored() {
    let server = NatsServer::start().unwrap();
    let (transport, registry) = nats(&server, "workers").await;
    let (rt, rreg) = nats(&server, "router").await;
    let r = router(rt, &rreg).await;
    // Each garbage payload is counted and dropped. (Published until the first count shows,
    // so the test does not depend on when the router's subscription reaches the server.)
    let garbage: [&'static [u8]; 2] = [b"KVR\x01 not an archive", b"garbage"];
    let mut sent = 0u64;
    let publish_garbage = || async {
        for g in garbage {
            transport
                .publish(
                    &events_subject(CLUSTER, WorkerId(99)),
                    None,
                    bytes::Bytes::from_static(g),
                )
                .await
                .unwrap();
        }
        transport.flush().await;
    };
    while r.plane.counters().malformed.load(Ordering::Relaxed) == 0 && sent < 100 {
        publish_garbage().await;
        sent += 2;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The subscription is live now: one more of each must both be counted (the loop's last
    // pair may have straddled the subscription's start, one of it dropped by the server).
    let before = r.plane.counters().malformed.load(Ordering::Relaxed);
    publish_garbage().await;
    let counted = eventually(Duration::from_secs(5), || {
        r.plane.counters().malformed.load(Ordering::Relaxed) >= before + 2
    })
    .await;
    assert!(
        counted,
        "malformed counted: {}",
        r.plane.counters().malformed.load(Ordering::Relaxed)
    );
    assert!(
        r.plane.streams().is_empty(),
        "garbage must not create streams"
    );
    let sims = workers(&transport, &registry, 0..2, Faults::default()).await;
    run_workload(&sims, 10, 30).await;
    assert_exact(&r, &sims).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_serving_traffic_without_events_is_flagged_until_it_publishes() {
    let transport = Transport::Local(LocalBus::new());
    let registry = Registry::Local(LocalRegistry::default());
    let r = router(transport.clone(), &registry).await;
    let sims = workers(&transport, &registry, 0..1, Faults::default()).await;
    let open = eventually(Duration::from_secs(5), || !r.plane.streams().is_empty()).await;
    assert!(open, "the worker's registration never reached the plane");
    for _ in 0..8 {
        r.plane
            .note_routed((WorkerId(0), kvroute::protocol::DpRank(0)));
    }
    assert_eq!(r.plane.silent_workers(), vec![WorkerId(0)]);
    run_workload(&sims, 11, 5).await;
    let cleared = eventually(Duration::from_secs(5), || {
        r.plane.silent_workers().is_empty()
    })
    .await;
    assert!(cleared, "events from the worker should clear the flag");
    // Publish → apply, and its share before the router had the batch.
    assert!(!r.plane.lag_samples().is_empty());
    assert!(!r.plane.transit_samples().is_empty());
    assert!(!r.plane.router_samples().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_see_each_others_bookings_and_drop_a_dead_replicas() {
    use kvroute::events::load::{LoadShare, LoadShareConfig};
    use kvroute::indexer::OverlapScores;
    use kvroute::protocol::{BlockHash, DpRank, LocalHash};
    use kvroute::scheduler::{self, RouteRequest, Scheduler};

    let server = NatsServer::start().unwrap();
    let config = LoadShareConfig {
        heartbeat_ms: 200,
        replica_ttl_ms: 3_000,
        ..LoadShareConfig::default()
    };
    let mut replicas = Vec::new();
    let mut shutdowns = Vec::new();
    for id in [1u64, 2] {
        let mut s = Scheduler::new(scheduler::Config {
            replica_id: id,
            ..scheduler::Config::default()
        })
        .unwrap();
        for w in 0..2 {
            s.add_worker((WorkerId(w), DpRank(0)), 10_000, "m");
        }
        let s = Arc::new(parking_lot::Mutex::new(s));
        let transport = connect(&server, &format!("replica-{id}")).await;
        let (tx, rx) = watch::channel(false);
        let share = LoadShare::start(transport, CLUSTER, Arc::clone(&s), config.clone(), rx)
            .await
            .unwrap();
        replicas.push((s, share));
        shutdowns.push(tx);
    }
    let blocks: Vec<BlockHash> = (0..10)
        .map(|i| BlockHash {
            local: LocalHash(i),
            seq: SeqHash(i),
        })
        .collect();
    let none = OverlapScores::default();
    let request = RouteRequest {
        model: "m",
        blocks: &blocks,
        prompt_tokens: 160,
        block_size: 16,
        overlaps: &none,
        max_tokens: 16,
        n: 1,
        session: None,
    };
    let decision = replicas[0].0.lock().route(0, &request).unwrap();
    replicas[0].1.booked(decision.booking);
    let worker = decision.chosen.key;
    let b = Arc::clone(&replicas[1].0);
    let seen = eventually(Duration::from_secs(5), || {
        b.lock()
            .load(worker)
            .is_some_and(|l| l.decode_blocks() == 10)
    })
    .await;
    assert!(
        seen,
        "replica 2 should see replica 1's booking: load {:?}, open {}",
        b.lock()
            .load(worker)
            .map(|l| (l.decode_blocks(), l.requests)),
        b.lock().open_bookings()
    );
    // Replica 2 now prefers the other worker for an unrelated request.
    let other: Vec<BlockHash> = (100..110)
        .map(|i| BlockHash {
            local: LocalHash(i),
            seq: SeqHash(i),
        })
        .collect();
    let r2 = RouteRequest {
        blocks: &other,
        ..request
    };
    let d2 = b.lock().route(0, &r2).unwrap();
    assert_ne!(d2.chosen.key, worker);
    b.lock().complete(d2.booking);
    // Completion is shared too.
    replicas[0].0.lock().complete(decision.booking);
    replicas[0].1.completed(decision.booking);
    let freed = eventually(Duration::from_secs(5), || {
        b.lock()
            .load(worker)
            .is_some_and(|l| l.decode_blocks() == 0)
    })
    .await;
    assert!(freed);
    // A booking left open by a replica that dies expires with the replica.
    let decision = replicas[0].0.lock().route(0, &request).unwrap();
    replicas[0].1.booked(decision.booking);
    let worker = decision.chosen.key;
    assert!(
        eventually(Duration::from_secs(5), || b
            .lock()
            .load(worker)
            .is_some_and(|l| l.decode_blocks() == 10))
        .await
    );
    let _ = shutdowns[0].send(true);
    let dropped = eventually(Duration::from_secs(10), || {
        b.lock()
            .load(worker)
            .is_some_and(|l| l.decode_blocks() == 0)
    })
    .await;
    assert!(dropped, "a dead replica's bookings must expire");
}

/// While NATS is down, a worker's publish fails at once (the caller notes the batch as
/// lost, and routers resync from the gap) instead of waiting on the client's buffer: a
/// sidecar's one loop also answers snapshots, checks its engine and hears SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishing_without_nats_fails_at_once() {
    use kvroute::protocol::KvEventData;
    let mut nats = NatsServer::start().unwrap();
    let transport = connect(&nats, "w").await;
    let plane = worker_plane(&transport);
    let batch = |id| worker_5_batch(id, KvEventData::Cleared);
    plane.publish(&batch(1)).await.unwrap();
    nats.kill();
    assert!(
        eventually(Duration::from_secs(30), || !transport.is_connected()).await,
        "the client never noticed NATS was gone"
    );
    // Bounded only to report a hang as a failure, not to measure anything.
    let r = tokio::time::timeout(Duration::from_secs(60), plane.publish(&batch(2)))
        .await
        .expect("publish waited on a disconnected client");
    assert!(r.is_err(), "a batch was taken while NATS was down");
}

/// Worker 5's batch of one event, `id`, in its epoch 1 (rank 0).
fn worker_5_batch(id: u64, data: kvroute::protocol::KvEventData) -> kvroute::protocol::EventBatch {
    use kvroute::protocol::{DpRank, EventBatch, KvEvent};
    EventBatch {
        worker: WorkerId(5),
        dp_rank: DpRank(0),
        epoch: 1,
        sent_unix_us: 0,
        events: vec![KvEvent {
            id,
            tier: Tier::Device,
            data,
        }],
    }
}

/// The event publisher of worker 5 (rank 0, epoch 1) over `transport`.
fn worker_plane(transport: &Transport) -> kvroute_worker::plane::WorkerPlane {
    let info = Arc::new(parking_lot::Mutex::new(kvroute::discovery::WorkerInfo {
        id: WorkerId(5),
        url: "http://127.0.0.1:1/".into(),
        block_size: 16,
        g1_blocks: 8,
        g2_blocks: 0,
        model: "sim".into(),
        dp_size: 1,
        epoch: 1,
        last_event_ids: vec![0],
        api: kvroute::discovery::WorkerApi::Kvroute,
        adapters: Vec::new(),
        engine_load: None,
        event_faults: None,
        engine_rank_kv_usage: Vec::new(),
        learns_routes: false,
        left: false,
    }));
    kvroute_worker::plane::WorkerPlane::new(transport.clone(), CLUSTER, info)
}

/// A connection that stays up but takes nothing (the server stopped, as behind a half-open
/// connection: the client reports it connected until its pings time out, minutes later):
/// once a message was not taken within the publish deadline, publishes fail at once for a
/// while instead of each waiting out the deadline, which held a sidecar to a batch a second
/// while its engine's socket dropped the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_stuck_on_a_connection_that_does_not_move_stops_waiting() {
    use kvroute::protocol::{KvEventData, LocalHash, SeqHash, StoredBlock};
    let nats = NatsServer::start().unwrap();
    let transport = connect(&nats, "w").await;
    let plane = worker_plane(&transport);
    let blocks: Vec<StoredBlock> = (0..200u64)
        .map(|i| StoredBlock {
            seq: SeqHash(i + 1),
            local: LocalHash(i + 1),
        })
        .collect();
    let batch = |id| {
        let data = KvEventData::Stored {
            parent: None,
            blocks: blocks.clone(),
        };
        worker_5_batch(id, data)
    };
    nats.pause();
    // The client's buffers fill; then a message is not taken within the deadline.
    let mut first_error = None;
    for id in 1..=100_000 {
        if let Err(e) = plane.publish(&batch(id)).await {
            first_error = Some((id, e.to_string()));
            break;
        }
    }
    let (id, first) = first_error.expect("a paused server took every message");
    assert!(first.contains("not taken within"), "{first}");
    let next = plane.publish(&batch(id + 1)).await.unwrap_err().to_string();
    assert!(next.contains("not waiting on it again"), "{next}");
    nats.resume();
}

/// A subscription whose reader falls behind by its whole queue loses messages in the NATS
/// client (a slow consumer): the transport counts them (and `kvroute_nats_slow_consumer_total`
/// says so), where before only a debug line did and the plane's gaps were the only sign.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_a_full_subscription_queue_drops_are_counted() {
    use kvroute::events::transport::SUBSCRIPTION_QUEUE;
    let nats = NatsServer::start().unwrap();
    let reader = connect(&nats, "reader").await;
    let writer = connect(&nats, "writer").await;
    // Never read: every message past the queue's room is dropped.
    let _unread = reader.subscribe("slow.subject").await.unwrap();
    reader.flush().await;
    assert_eq!(reader.dropped(), 0);
    for _ in 0..SUBSCRIPTION_QUEUE + 1_000 {
        writer
            .publish("slow.subject", None, bytes::Bytes::from_static(b"x"))
            .await
            .unwrap();
    }
    writer.flush().await;
    let counted = eventually(Duration::from_secs(20), || reader.dropped() > 0).await;
    assert!(counted, "no dropped message counted");
}

/// The link's state is the client's own, not what its events said: async-nats drops the
/// connection events its queue of 128 has no room for, and a slow consumer fills it with one
/// event per message dropped. Here a burst of drops meets a NATS restart; the reader must
/// see the outage, come back connected and count the reconnection (taken from the events, a
/// lost `Connected` left it disconnected for good). Whether the events are lost depends on
/// timing, so without the fix this fails only sometimes; with it, it must always pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_link_follows_the_client_through_a_burst_of_drops_and_a_restart() {
    use kvroute::events::transport::SUBSCRIPTION_QUEUE;
    let mut nats = NatsServer::start().unwrap();
    let reader = connect(&nats, "reader").await;
    let writer = connect(&nats, "writer").await;
    let mut reconnects = reader.reconnects().unwrap();
    let _unread = reader.subscribe("slow.subject").await.unwrap();
    reader.flush().await;
    for _ in 0..SUBSCRIPTION_QUEUE + 10_000 {
        writer
            .publish("slow.subject", None, bytes::Bytes::from_static(b"x"))
            .await
            .unwrap();
    }
    writer.flush().await;
    nats.restart().unwrap();
    let back = tokio::time::timeout(Duration::from_secs(60), reconnects.changed()).await;
    assert!(
        matches!(back, Ok(Ok(()))),
        "the reconnection was never counted"
    );
    assert!(
        eventually(Duration::from_secs(30), || reader.is_connected()).await,
        "the reader never came back connected"
    );
}
