use std::collections::BTreeSet;
use std::num::NonZeroUsize;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;

use super::*;
use crate::engines::publisher::{EnginePublisher, ReplayForm};
use crate::engines::wire::{Encoding, RawEvent, encode_batch};
use crate::engines::zmtp::{PubSocket, RouterHandler, RouterSocket};
use crate::protocol::{SeqHash, Tier};

const BS: usize = 2;

/// What the owner of an ingest sees: the device blocks held, by kvroute hash.
struct Owner {
    rx: mpsc::Receiver<Update>,
    held: BTreeSet<SeqHash>,
    /// Every device removal seen, in order.
    removed: Vec<SeqHash>,
    stats: IngestStats,
}

impl Owner {
    /// Applies updates until `done` holds (or fails after a generous wait).
    async fn until(&mut self, what: &str, done: impl Fn(&Owner) -> bool) {
        let wait = async {
            while !done(self) {
                let u = self.rx.recv().await.expect("ingest alive");
                for c in u.changes {
                    match c {
                        BlockChange::Stored {
                            tier: Tier::Device,
                            block,
                            ..
                        } => {
                            assert!(self.held.insert(block.seq), "stored twice: {block:?}");
                        }
                        BlockChange::Removed {
                            tier: Tier::Device,
                            seq,
                        } => {
                            assert!(self.held.remove(&seq), "removed unknown {seq:?}");
                            self.removed.push(seq);
                        }
                        _ => {}
                    }
                }
                self.stats = u.stats;
            }
        };
        if tokio::time::timeout(Duration::from_secs(30), wait)
            .await
            .is_err()
        {
            panic!(
                "timed out waiting until {what}; held {}, stats {:?}",
                self.held.len(),
                self.stats
            );
        }
    }
}

fn store(hash: u64, parent: Option<u64>) -> Bytes {
    let e = RawEvent::Stored {
        hashes: vec![hash],
        parent,
        token_ids: vec![hash as u32, parent.unwrap_or(0) as u32],
        block_size: BS as u32,
        medium: "GPU".into(),
        lora_name: None,
        extra_keys: Vec::new(),
    };
    let enc = Encoding {
        tagged_maps: hash.is_multiple_of(2),
        bytes_hashes: false,
        signed_hashes: false,
    };
    Bytes::from(encode_batch(0.0, &[e], 0, enc))
}

fn remove(hash: u64) -> Bytes {
    let e = RawEvent::Removed {
        hashes: vec![hash],
        medium: "GPU".into(),
    };
    Bytes::from(encode_batch(
        0.0,
        &[e],
        0,
        Encoding {
            tagged_maps: true,
            bytes_hashes: false,
            signed_hashes: false,
        },
    ))
}

async fn start(engine: &EnginePublisher, replay: bool) -> Owner {
    let endpoint = EngineEndpoint {
        events: format!("tcp://127.0.0.1:{}", engine.pub_port()),
        replay: replay.then(|| format!("tcp://127.0.0.1:{}", engine.replay_port().unwrap())),
        topic: String::new(),
    };
    let limits = IngestLimits {
        idle: Duration::from_millis(300),
        ..IngestLimits::default()
    };
    follow(endpoint, limits).await
}

/// Runs an ingest of `endpoint` (blocks of `BS` tokens, offload chunks of one block).
fn spawn_ingest(endpoint: EngineEndpoint, limits: IngestLimits, tx: mpsc::Sender<Update>) {
    tokio::spawn(run(
        endpoint,
        NonZeroUsize::new(BS).unwrap(),
        NonZeroUsize::MIN,
        limits,
        tx,
    ));
}

/// Runs an ingest of `endpoint` and returns its owner once it follows the live stream.
async fn follow(endpoint: EngineEndpoint, limits: IngestLimits) -> Owner {
    let (tx, rx) = mpsc::channel(16);
    spawn_ingest(endpoint, limits, tx);
    let mut owner = Owner {
        rx,
        held: BTreeSet::new(),
        removed: Vec::new(),
        stats: IngestStats::default(),
    };
    owner.until("connected", |o| o.stats.connected).await;
    owner
}

/// Publishes block `hash` stored then removed (leaving nothing behind) until `done` holds.
async fn churn_until(
    engine: &EnginePublisher,
    owner: &mut Owner,
    hash: u64,
    what: &str,
    done: impl Fn(&Owner) -> bool,
) {
    let churn = |_| {
        engine.publish(store(hash, None));
        engine.publish(remove(hash));
    };
    publish_until(owner, what, churn, done).await;
}

/// Calls `publish` with attempts 0, 1, … until `done` holds: until the follower's
/// subscription reaches the publisher, what it publishes goes nowhere.
async fn publish_until(
    owner: &mut Owner,
    what: &str,
    mut publish: impl FnMut(u64),
    done: impl Fn(&Owner) -> bool,
) {
    for attempt in 0..200 {
        publish(attempt);
        let wait = owner.until(what, &done);
        if tokio::time::timeout(Duration::from_millis(20), wait)
            .await
            .is_ok()
        {
            return;
        }
    }
    panic!("never {what}: {:?}", owner.stats);
}

fn hashes_of(chain: &[(u64, Option<u64>)]) -> BTreeSet<SeqHash> {
    // The kvroute hash of each stored block, as the mirror computes it.
    let mut mirror = crate::engines::EngineMirror::new(NonZeroUsize::new(BS).unwrap());
    let mut out = Vec::new();
    for (h, p) in chain {
        mirror.apply(
            &crate::engines::decode_batch(&store(*h, *p)).unwrap(),
            &mut out,
        );
    }
    out.iter()
        .map(|c| match c {
            BlockChange::Stored { block, .. } => block.seq,
            BlockChange::Removed { seq, .. } => *seq,
        })
        .collect()
}

async fn engine_at(port: u16, replay: u16) -> EnginePublisher {
    {
        // A port a dropped publisher held is free once its accept task has ended.
        for _ in 0..100 {
            match EnginePublisher::bind(
                "127.0.0.1",
                port,
                Some((replay, ReplayForm::WithTopic)),
                "",
                100,
            )
            .await
            {
                Ok(e) => return e,
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        panic!("ports {port}, {replay} stay taken")
    }
}

#[tokio::test]
async fn a_late_follower_catches_up_through_replay_and_lost_batches_are_repaired() {
    let engine = engine_at(0, 0).await;
    for b in [
        store(1, None),
        store(2, Some(1)),
        store(3, Some(2)),
        remove(3),
    ] {
        engine.publish(b);
    }
    let mut owner = start(&engine, true).await;
    let want = hashes_of(&[(1, None), (2, Some(1))]);
    owner
        .until("the buffer is replayed", |o| o.held == want)
        .await;
    assert_eq!(owner.stats.replayed, 4);
    // Two batches lost on the way: the next one shows the gap and replay fills it. (A live
    // batch sent before the subscription took effect is lost the same way.)
    engine.drop_next(2);
    for b in [store(10, Some(2)), store(11, Some(10)), store(12, Some(11))] {
        engine.publish(b);
    }
    let want = hashes_of(&[
        (1, None),
        (2, Some(1)),
        (10, Some(2)),
        (11, Some(10)),
        (12, Some(11)),
    ]);
    owner.until("the gap is repaired", |o| o.held == want).await;
    assert!(owner.stats.replayed >= 6, "{:?}", owner.stats);
    assert_eq!((owner.stats.unrepaired, owner.stats.restarts), (0, 0));
}

#[tokio::test]
async fn a_restarted_engine_s_old_blocks_vanish() {
    let engine = engine_at(0, 0).await;
    let (pub_port, replay_port) = (engine.pub_port(), engine.replay_port().unwrap());
    for b in [store(1, None), store(2, Some(1)), store(3, Some(2))] {
        engine.publish(b);
    }
    let mut owner = start(&engine, true).await;
    owner.until("replayed", |o| o.held.len() == 3).await;
    drop(engine);
    // The same ports, a new process: seq counts from 0 again.
    let engine = engine_at(pub_port, replay_port).await;
    seen_restarted_once(&engine, &mut owner).await;
}

/// An engine restarted while the follower was cut off, its replay buffer holding its whole
/// new life (from seq 0): the reconnect's replay rebuilds the mirror to it, handing out only
/// what differs, and that is the restart handled. The mirror was then cleared and replayed
/// again, removing and storing anew every block the new engine holds.
#[tokio::test]
async fn a_restart_replayed_whole_is_rebuilt_once() {
    let engine = engine_at(0, 0).await;
    let (pub_port, replay_port) = (engine.pub_port(), engine.replay_port().unwrap());
    let chain: Vec<(u64, Option<u64>)> = (1..=10).map(|h| (h, (h > 1).then(|| h - 1))).collect();
    for &(h, p) in &chain {
        engine.publish(store(h, p));
    }
    let mut owner = start(&engine, true).await;
    owner.until("replayed", |o| o.held.len() == 10).await;
    drop(engine);
    let engine = engine_at(pub_port, replay_port).await;
    // Published before the follower can reconnect (this test's runtime runs one task at a
    // time, and this one has not yielded): only the replay brings them.
    for &(h, p) in &chain[..2] {
        engine.publish(store(h, p));
    }
    let kept = hashes_of(&chain[..2]);
    owner
        .until("only the new engine's blocks are left", |o| o.held == kept)
        .await;
    assert_eq!(owner.stats.restarts, 1);
    assert!(
        owner.removed.iter().all(|seq| !kept.contains(seq)),
        "a block the new engine holds was removed and stored again"
    );
}

/// The restarted `engine` stores a block: the follower drops the old engine's and holds
/// that one only, having counted one restart.
async fn seen_restarted_once(engine: &EnginePublisher, owner: &mut Owner) {
    engine.publish(store(7, None));
    let want = hashes_of(&[(7, None)]);
    owner
        .until("only the new engine's block is left", |o| o.held == want)
        .await;
    assert_eq!(owner.stats.restarts, 1);
}

/// An engine sending identity [1; 16] with three blocks stored, and a follower (with replay)
/// that holds them.
async fn an_identified_engine_followed() -> (EnginePublisher, Owner) {
    let engine = engine_at(0, 0).await;
    engine.set_identity([1; 16]);
    for b in [store(1, None), store(2, Some(1)), store(3, Some(2))] {
        engine.publish(b);
    }
    let mut owner = start(&engine, true).await;
    owner.until("replayed", |o| o.held.len() == 3).await;
    (engine, owner)
}

/// With identities on the seq frames (vLLM with a snapshot endpoint), a restarted engine
/// is handled once: the replay that rebuilds the mirror on reconnecting brings the new
/// identity, so the live batches that follow are not taken for another restart (which
/// cleared the mirror and replayed all over again).
#[tokio::test]
async fn a_reconnect_s_replay_brings_the_new_identity() {
    let (engine, mut owner) = an_identified_engine_followed().await;
    let (pub_port, replay_port) = (engine.pub_port(), engine.replay_port().unwrap());
    // The old engine's identity also arrives live.
    churn_until(&engine, &mut owner, 4, "live", |o| {
        o.stats.mirror.batches > 3
    })
    .await;
    drop(engine);
    let engine = engine_at(pub_port, replay_port).await;
    engine.set_identity([2; 16]);
    // Only in the new engine's replay buffer: the follower gets it by replay.
    engine.drop_next(1);
    engine.publish(store(7, None));
    let want = hashes_of(&[(7, None)]);
    owner
        .until("rebuilt from the new engine's replay", |o| o.held == want)
        .await;
    let (restarts, replayed) = (owner.stats.restarts, owner.stats.replayed);
    let batches = owner.stats.mirror.batches;
    churn_until(&engine, &mut owner, 4, "live", |o| {
        o.stats.mirror.batches > batches + 1
    })
    .await;
    owner.until("7 still held", |o| o.held == want).await;
    assert_eq!(
        (owner.stats.restarts, owner.stats.replayed),
        (restarts, replayed),
        "live batches of the new engine were taken for a restart"
    );
}

/// A restarted engine met on reconnecting, whose replay buffer does not start at 0 and
/// whose numbers continue the old engine's: only its identity tells, and the old engine's
/// blocks go.
#[tokio::test]
async fn a_new_identity_in_a_reconnect_s_replay_is_a_restart() {
    let (engine, mut owner) = an_identified_engine_followed().await;
    let (pub_port, replay_port) = (engine.pub_port(), engine.replay_port().unwrap());
    let next = engine.next_seq();
    drop(engine);
    let engine = engine_at(pub_port, replay_port).await;
    engine.restart_as([2; 16], next);
    // Only in the new engine's replay buffer: the follower gets it by replay.
    engine.drop_next(1);
    seen_restarted_once(&engine, &mut owner).await;
}

/// A restarted engine whose replay cannot be had (here it has none) is still seen restarted
/// on the live stream: what the replay of the old engine covered does not make the new
/// engine's first batches duplicates.
#[tokio::test]
async fn a_restart_is_seen_when_the_new_engine_s_replay_fails() {
    let engine = engine_at(0, 0).await;
    let pub_port = engine.pub_port();
    for b in [store(1, None), store(2, Some(1)), store(3, Some(2))] {
        engine.publish(b);
    }
    let mut owner = start(&engine, true).await;
    owner.until("replayed", |o| o.held.len() == 3).await;
    // Live batches take the old engine's count past what the new one will reach.
    for _ in 0..300 {
        engine.publish(store(10, None));
        engine.publish(remove(10));
    }
    owner
        .until("the old engine's batches applied", |o| {
            o.stats.mirror.batches >= 603
        })
        .await;
    drop(engine);
    let mut tries = 0;
    let engine = loop {
        match EnginePublisher::bind("127.0.0.1", pub_port, None, "", 100).await {
            Ok(e) => break e,
            Err(e) if tries == 100 => panic!("port {pub_port} stays taken: {e}"),
            Err(_) => tries += 1,
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    churn_until(&engine, &mut owner, 4, "restart seen", |o| {
        o.stats.restarts > 0
    })
    .await;
    engine.publish(store(7, None));
    let want = hashes_of(&[(7, None)]);
    owner
        .until("only the new engine's block is left", |o| o.held == want)
        .await;
}

#[tokio::test]
async fn without_replay_a_gap_clears_and_rebuilds_from_what_follows() {
    let engine = engine_at(0, 0).await;
    let mut owner = start(&engine, false).await;
    // Live only: publish until the subscription carries a batch.
    churn_until(&engine, &mut owner, 1, "live", |o| {
        o.stats.mirror.batches > 0
    })
    .await;
    owner
        .until("settled", |o| {
            o.held.is_empty() && o.stats.mirror.batches % 2 == 0
        })
        .await;
    engine.publish(store(5, None));
    owner.until("5 held", |o| o.held.len() == 1).await;
    engine.drop_next(1);
    engine.publish(store(6, Some(5)));
    engine.publish(store(8, None));
    let want = hashes_of(&[(8, None)]);
    owner
        .until("rebuilt from what followed the gap", |o| o.held == want)
        .await;
    assert_eq!((owner.stats.gaps, owner.stats.unrepaired), (1, 1));
}

/// Closes `pubs` (an engine's PUB socket going away, as in a restart) and binds its port
/// again, once the port is free.
async fn rebind(pubs: PubSocket) -> PubSocket {
    let port = pubs.port();
    drop(pubs);
    for _ in 0..100 {
        if let Ok(p) = PubSocket::bind("127.0.0.1", port).await {
            return p;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the PUB port {port} stays taken");
}

/// The endpoint of an engine played by `pubs` and a scripted replay socket.
fn scripted(pubs: &PubSocket, replay: &RouterSocket) -> EngineEndpoint {
    EngineEndpoint {
        events: format!("tcp://127.0.0.1:{}", pubs.port()),
        replay: Some(format!("tcp://127.0.0.1:{}", replay.port())),
        topic: String::new(),
    }
}

/// A replay socket's reply carrying batch `seq` (`u64::MAX`: the end marker), as vLLM sends
/// it: delimiter, topic, seq, payload.
fn replay_reply(seq: u64, payload: Bytes) -> Vec<Bytes> {
    vec![
        Bytes::new(),
        Bytes::new(),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        payload,
    ]
}

/// The seq a replay request asks from.
fn asked_from(request: &[Bytes]) -> u64 {
    request
        .last()
        .and_then(|f| <[u8; 8]>::try_from(&f[..]).ok())
        .map_or(0, u64::from_be_bytes)
}

/// An engine whose replay never sends its end marker (here: 200 batches and silence) is
/// cut at `max_replay_batches`; the ingest goes on with the live stream.
#[tokio::test]
async fn a_replay_without_end_is_cut_at_its_cap() {
    let pubs = PubSocket::bind("127.0.0.1", 0).await.unwrap();
    let handler: RouterHandler = std::sync::Arc::new(|request: Vec<Bytes>| {
        let from = asked_from(&request);
        (from..from + 200)
            .map(|seq| replay_reply(seq, store(seq + 1, (seq > 0).then_some(seq))))
            .collect()
    });
    let replay = RouterSocket::bind("127.0.0.1", 0, handler).await.unwrap();
    let endpoint = scripted(&pubs, &replay);
    let limits = IngestLimits {
        max_replay_batches: 50,
        ..IngestLimits::default()
    };
    let owner = follow(endpoint, limits).await;
    // Without the cap, all 200 are applied before the reply deadline ends the replay.
    assert_eq!(owner.stats.replayed, 50, "{:?}", owner.stats);
    assert_eq!(owner.held.len(), 50);
}

/// A batch missing between two replies of a replay was lost on the way (the engine
/// replays consecutive batches): it is asked for again once the reply stream ends, and the
/// mirror is repaired, not dropped.
#[tokio::test]
async fn a_batch_lost_inside_a_replay_is_asked_for_again() {
    lost_inside_a_replay(true).await;
}

/// Batch 5 lost in the first reply stream of a replay (and its end marker too, unless
/// `end_marker`): the chain is whole after one more request, and nothing is unrepaired.
async fn lost_inside_a_replay(end_marker: bool) {
    let pubs = PubSocket::bind("127.0.0.1", 0).await.unwrap();
    let asked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let asks = std::sync::Arc::clone(&asked);
    let handler: RouterHandler = std::sync::Arc::new(move |request: Vec<Bytes>| {
        let from = asked_from(&request);
        let first = asks.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0;
        let batches = (from..10)
            .filter(|&seq| !(first && seq == 5))
            .map(|seq| replay_reply(seq, store(seq + 1, (seq > 0).then_some(seq))));
        let end = (end_marker || !first).then(|| replay_reply(u64::MAX, Bytes::new()));
        batches.chain(end).collect()
    });
    let replay = RouterSocket::bind("127.0.0.1", 0, handler).await.unwrap();
    let limits = IngestLimits {
        replay: Duration::from_millis(200),
        ..IngestLimits::default()
    };
    let mut owner = follow(scripted(&pubs, &replay), limits).await;
    owner
        .until("the chain is whole", |o| o.held.len() == 10)
        .await;
    assert_eq!(owner.stats.unrepaired, 0, "{:?}", owner.stats);
    assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 2);
}

/// A gap longer than the engine's ROUTER socket queues for a peer comes back a queue at a
/// time: each request's reply stream loses a batch after its first two (the queue full)
/// and goes on. The replay asks again as long as each request brings it further, and the
/// mirror is repaired; it gave up after three requests and cleared the mirror, though the
/// engine held every batch.
#[tokio::test]
async fn a_long_gap_is_replayed_a_queue_at_a_time() {
    let pubs = PubSocket::bind("127.0.0.1", 0).await.unwrap();
    let handler: RouterHandler = std::sync::Arc::new(move |request: Vec<Bytes>| {
        let from = asked_from(&request);
        (from..40)
            .filter(|&seq| seq != from + 2)
            .map(|seq| replay_reply(seq, store(seq + 1, (seq > 0).then_some(seq))))
            .chain([replay_reply(u64::MAX, Bytes::new())])
            .collect()
    });
    let replay = RouterSocket::bind("127.0.0.1", 0, handler).await.unwrap();
    let mut owner = follow(scripted(&pubs, &replay), IngestLimits::default()).await;
    owner
        .until("the chain is whole", |o| o.held.len() == 40)
        .await;
    assert_eq!(owner.stats.unrepaired, 0, "{:?}", owner.stats);
}

/// A burst that makes the engine's ROUTER drop a batch drops its end marker too (sent right
/// after the last batch): a stream that falls silent after answering has ended, and what it
/// lost is asked for again. The replay waited for the marker, gave up, threw the batches
/// after the hole away and counted towards resting.
#[tokio::test]
async fn a_replay_whose_end_marker_was_dropped_is_asked_for_again() {
    lost_inside_a_replay(false).await;
}

/// Publishes every other batch (seq 0, 2, 4, 6, 8: four gaps) and waits until `owner` has
/// seen the four gaps.
async fn four_gaps(pubs: &PubSocket, owner: &mut Owner) {
    for seq in (0..10u64).step_by(2) {
        pubs.publish(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            store(seq + 1, None),
        ]);
    }
    owner.until("four gaps", |o| o.stats.gaps == 4).await;
}

/// A replay socket that refuses connections rests like one that leaves requests unanswered
/// (each gap cost a connection attempt and a warning).
#[tokio::test]
async fn a_refusing_replay_socket_rests() {
    let pubs = PubSocket::bind("127.0.0.1", 0).await.unwrap();
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let endpoint = EngineEndpoint {
        events: format!("tcp://127.0.0.1:{}", pubs.port()),
        replay: Some(format!("tcp://127.0.0.1:{port}")),
        topic: String::new(),
    };
    let mut owner = follow(endpoint, IngestLimits::default()).await;
    four_gaps(&pubs, &mut owner).await;
    assert!(owner.stats.replays_skipped > 0, "{:?}", owner.stats);
}

/// Without a replay socket a quiet engine is not resubscribed to (a batch published while
/// the subscription is re-established is lost, and its gap clears the mirror): one
/// subscription however long the silence. Control: with replay, silence resubscribes.
#[tokio::test]
async fn without_replay_a_quiet_engine_keeps_its_subscription() {
    let limits = IngestLimits {
        idle: Duration::from_millis(50),
        ..IngestLimits::default()
    };
    let pubs = PubSocket::bind("127.0.0.1", 0).await.unwrap();
    let endpoint = EngineEndpoint {
        events: format!("tcp://127.0.0.1:{}", pubs.port()),
        replay: None,
        topic: String::new(),
    };
    let _owner = follow(endpoint, limits).await;
    // The control resubscribes at least twice in this time.
    let handler: RouterHandler =
        std::sync::Arc::new(|_request: Vec<Bytes>| vec![replay_reply(u64::MAX, Bytes::new())]);
    let replay = RouterSocket::bind("127.0.0.1", 0, handler).await.unwrap();
    let control_pubs = PubSocket::bind("127.0.0.1", 0).await.unwrap();
    let _control = follow(scripted(&control_pubs, &replay), limits).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while control_pubs.accepted() < 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the control never resubscribed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(pubs.accepted(), 1);
}

/// After its connection failed, the ingest rebuilds the mirror from the engine's whole
/// replay buffer; its owner is handed only what changed meanwhile (block 3 removed, block 4
/// stored), not every block removed and stored again, which left the router without the
/// engine's blocks in between.
#[tokio::test]
async fn a_reconnect_s_rebuild_hands_over_only_what_changed() {
    let buffer: std::sync::Arc<std::sync::Mutex<Vec<Bytes>>> =
        std::sync::Arc::new(std::sync::Mutex::new(vec![
            store(1, None),
            store(2, Some(1)),
            store(3, Some(2)),
        ]));
    let batches = std::sync::Arc::clone(&buffer);
    let handler: RouterHandler = std::sync::Arc::new(move |request: Vec<Bytes>| {
        let from = asked_from(&request);
        let batches = batches.lock().unwrap();
        (from..batches.len() as u64)
            .map(|seq| replay_reply(seq, batches[seq as usize].clone()))
            .chain(std::iter::once(replay_reply(u64::MAX, Bytes::new())))
            .collect()
    });
    let replay = RouterSocket::bind("127.0.0.1", 0, handler).await.unwrap();
    let pubs = PubSocket::bind("127.0.0.1", 0).await.unwrap();
    let endpoint = scripted(&pubs, &replay);
    let mut owner = follow(endpoint, IngestLimits::default()).await;
    let before = hashes_of(&[(1, None), (2, Some(1)), (3, Some(2))]);
    owner.until("replayed", |o| o.held == before).await;
    // While the follower is away the engine removes block 3 and stores block 4.
    buffer
        .lock()
        .unwrap()
        .extend([remove(3), store(4, Some(2))]);
    let _pubs = rebind(pubs).await;
    let after = hashes_of(&[(1, None), (2, Some(1)), (4, Some(2))]);
    owner.until("rebuilt", |o| o.held == after).await;
    let three = *before.difference(&after).next().unwrap();
    assert_eq!(owner.removed, vec![three], "removed and stored again");
    assert_eq!(owner.stats.restarts, 0, "{:?}", owner.stats);
}

/// A restarted engine (numbering from 0 again) whose replay socket takes the request and
/// never answers: the failed replay brought nothing, so the new engine's live batches,
/// numbered below what the old one reached, are a restart, not duplicates of a replay.
#[tokio::test]
async fn a_restart_is_seen_when_the_replay_takes_the_request_and_never_answers() {
    // The old engine's life: block 1, then block 10 stored and removed 150 times.
    let mut old = vec![store(1, None)];
    for _ in 0..150 {
        old.extend([store(10, None), remove(10)]);
    }
    let reached = old.len();
    let silent = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mute = std::sync::Arc::clone(&silent);
    let handler: RouterHandler = std::sync::Arc::new(move |request: Vec<Bytes>| {
        if mute.load(std::sync::atomic::Ordering::SeqCst) {
            return Vec::new();
        }
        let from = asked_from(&request);
        (from..old.len() as u64)
            .map(|seq| replay_reply(seq, old[seq as usize].clone()))
            .chain(std::iter::once(replay_reply(u64::MAX, Bytes::new())))
            .collect()
    });
    let replay = RouterSocket::bind("127.0.0.1", 0, handler).await.unwrap();
    let pubs = PubSocket::bind("127.0.0.1", 0).await.unwrap();
    let endpoint = scripted(&pubs, &replay);
    let limits = IngestLimits {
        replay: Duration::from_millis(200),
        ..IngestLimits::default()
    };
    let mut owner = follow(endpoint, limits).await;
    owner
        .until("the old engine replayed", |o| {
            o.stats.replayed == reached as u64
        })
        .await;
    assert_eq!(owner.held, hashes_of(&[(1, None)]));
    // The engine restarts: its PUB goes away and comes back, its replay says nothing.
    silent.store(true, std::sync::atomic::Ordering::SeqCst);
    let pubs = rebind(pubs).await;
    // The new engine's batches, live from seq 0, one root block each, until the follower
    // has them (the first ones go nowhere until its subscription reaches the PUB).
    for seq in 0..100u64 {
        assert!(
            seq < reached as u64,
            "numbered below what the old engine reached"
        );
        pubs.publish(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            store(100 + seq, None),
        ]);
        let new_engine_s_only = |o: &Owner| {
            o.stats.restarts > 0
                && !o.held.is_empty()
                && o.held.is_disjoint(&hashes_of(&[(1, None)]))
        };
        let wait = owner.until("the new engine's blocks only", new_engine_s_only);
        if tokio::time::timeout(Duration::from_millis(50), wait)
            .await
            .is_ok()
        {
            return;
        }
    }
    panic!(
        "the new engine's batches were never applied: held {}, {:?}",
        owner.held.len(),
        owner.stats
    );
}

/// A replay server that does not start where it is asked (here: always from 0) shows a
/// restart once: the replies below what was asked for are the new numbering, in order, and
/// are applied, not each taken for one more restart that empties the mirror again.
#[tokio::test]
async fn replies_below_what_was_asked_for_are_one_restart() {
    let chain: Vec<Bytes> = (0..12u64)
        .map(|seq| store(seq + 1, (seq > 0).then_some(seq)))
        .collect();
    let buffer = std::sync::Arc::new(std::sync::Mutex::new(chain[..10].to_vec()));
    let batches = std::sync::Arc::clone(&buffer);
    let handler: RouterHandler = std::sync::Arc::new(move |_request: Vec<Bytes>| {
        let batches = batches.lock().unwrap();
        (0..batches.len() as u64)
            .map(|seq| replay_reply(seq, batches[seq as usize].clone()))
            .chain(std::iter::once(replay_reply(u64::MAX, Bytes::new())))
            .collect()
    });
    let replay = RouterSocket::bind("127.0.0.1", 0, handler).await.unwrap();
    let pubs = PubSocket::bind("127.0.0.1", 0).await.unwrap();
    let mut owner = follow(scripted(&pubs, &replay), IngestLimits::default()).await;
    owner.until("replayed", |o| o.held.len() == 10).await;
    // Batch 10 is lost on the way; 11 arrives live: a gap, replayed from 10, answered from 0.
    buffer.lock().unwrap().extend_from_slice(&chain[10..]);
    let whole: Vec<(u64, Option<u64>)> = (0..12u64)
        .map(|seq| (seq + 1, (seq > 0).then_some(seq)))
        .collect();
    let whole = hashes_of(&whole);
    for _ in 0..100 {
        pubs.publish(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&11u64.to_be_bytes()),
            chain[11].clone(),
        ]);
        let wait = owner.until("the whole chain", |o| o.held == whole);
        if tokio::time::timeout(Duration::from_millis(50), wait)
            .await
            .is_ok()
        {
            break;
        }
    }
    assert_eq!(owner.held, whole, "{:?}", owner.stats);
    assert_eq!(owner.stats.restarts, 1, "{:?}", owner.stats);
}

/// A replay socket that takes requests and never answers rests after two: each holds the
/// live stream for the reply deadline, and the gaps that come meanwhile (a burst past the
/// PUB socket's high-water mark) are handled as without replay instead of each asking and
/// waiting again.
#[tokio::test]
async fn an_unanswering_replay_socket_rests() {
    let asked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let asks = std::sync::Arc::clone(&asked);
    let handler: RouterHandler = std::sync::Arc::new(move |_request: Vec<Bytes>| {
        asks.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Vec::new()
    });
    let replay = RouterSocket::bind("127.0.0.1", 0, handler).await.unwrap();
    let pubs = PubSocket::bind("127.0.0.1", 0).await.unwrap();
    let limits = IngestLimits {
        replay: Duration::from_millis(100),
        ..IngestLimits::default()
    };
    // The replay at subscription is the first left unanswered.
    let mut owner = follow(scripted(&pubs, &replay), limits).await;
    four_gaps(&pubs, &mut owner).await;
    assert_eq!(
        asked.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "{:?}",
        owner.stats
    );
    assert_eq!(owner.stats.replays_skipped, 3, "{:?}", owner.stats);
    assert_eq!(owner.stats.unrepaired, 4, "{:?}", owner.stats);
}

#[test]
fn data_parallel_ranks_offset_the_port() {
    let e = EngineEndpoint {
        events: "tcp://10.1.2.3:5557".into(),
        replay: Some("tcp://10.1.2.3:5600".into()),
        topic: "kv".into(),
    };
    let r2 = e.for_rank(2).unwrap();
    assert_eq!(
        (r2.events.as_str(), r2.replay.as_deref()),
        ("tcp://10.1.2.3:5559", Some("tcp://10.1.2.3:5602"))
    );
    assert_eq!(e.for_rank(0).unwrap(), e);
    assert!(
        EngineEndpoint {
            events: "tcp://h:65535".into(),
            replay: None,
            topic: String::new()
        }
        .for_rank(1)
        .is_err()
    );
}

/// A sequence frame is 8 bytes, or 24 with the publisher's identity after the number (vLLM
/// with a snapshot endpoint); anything else is not a data message.
#[test]
fn sequence_frames_of_8_and_24_bytes_are_read() {
    let mut frame = 7u64.to_be_bytes().to_vec();
    assert_eq!(
        seq_of(&frame),
        Some(Seq {
            n: 7,
            publisher: None
        })
    );
    frame.extend_from_slice(&[9; 16]);
    assert_eq!(
        seq_of(&frame),
        Some(Seq {
            n: 7,
            publisher: Some([9; 16])
        })
    );
    for len in [0, 7, 9, 16, 23, 25] {
        assert_eq!(seq_of(&vec![0; len]), None, "{len} bytes");
    }
}

/// With identities on its seq frames, an engine is followed through replay as without, and
/// a new identity is a restart even where its numbers continue the old one's: the old
/// engine's blocks go.
#[tokio::test]
async fn a_new_publisher_identity_is_a_restart_whatever_its_numbers() {
    let engine = engine_at(0, 0).await;
    engine.set_identity([1; 16]);
    for b in [store(1, None), store(2, Some(1))] {
        engine.publish(b);
    }
    let mut owner = start(&engine, true).await;
    owner.until("replayed", |o| o.held.len() == 2).await;
    // Live batches of the same publisher apply as usual.
    churn_until(&engine, &mut owner, 4, "live", |o| {
        o.stats.mirror.batches > 2
    })
    .await;
    engine.publish(store(3, Some(2)));
    owner.until("3 held", |o| o.held.len() == 3).await;
    assert_eq!(owner.stats.restarts, 0);
    // A new lifetime whose next seq is the one expected: only its identity tells.
    engine.restart_as([2; 16], engine.next_seq());
    seen_restarted_once(&engine, &mut owner).await;
}

/// The rank an engine's batches name is reported to the ingest's owner, which knows the
/// rank it follows (a mismatch is a port offset gone wrong).
#[tokio::test]
async fn the_rank_the_engine_names_is_reported() {
    let engine = engine_at(0, 0).await;
    let stored = RawEvent::Stored {
        hashes: vec![1],
        parent: None,
        token_ids: vec![1, 0],
        block_size: BS as u32,
        medium: "GPU".into(),
        lora_name: None,
        extra_keys: Vec::new(),
    };
    let enc = Encoding {
        tagged_maps: true,
        bytes_hashes: false,
        signed_hashes: false,
    };
    engine.publish(Bytes::from(encode_batch(0.0, &[stored], 3, enc)));
    let mut owner = start(&engine, true).await;
    owner
        .until("the batch applied", |o| o.stats.mirror.batches == 1)
        .await;
    assert_eq!(owner.stats.engine_rank, Some(3));
}

/// A replay hands its changes to the owner as they come, a few at a time, not all in one
/// list at its end (a busy engine's buffer made millions of them).
#[tokio::test]
async fn a_replay_hands_its_changes_over_as_they_come() {
    let engine = engine_at(0, 0).await;
    let mut parent = None;
    for hash in 1..=10 {
        engine.publish(store(hash, parent));
        parent = Some(hash);
    }
    let endpoint = EngineEndpoint {
        events: format!("tcp://127.0.0.1:{}", engine.pub_port()),
        replay: Some(format!("tcp://127.0.0.1:{}", engine.replay_port().unwrap())),
        topic: String::new(),
    };
    let limits = IngestLimits {
        replay_flush_changes: 3,
        ..IngestLimits::default()
    };
    let (tx, mut rx) = mpsc::channel(64);
    spawn_ingest(endpoint, limits, tx);
    let (mut sizes, mut stored) = (Vec::new(), 0);
    let wait = async {
        loop {
            let u = rx.recv().await.expect("ingest alive");
            sizes.push(u.changes.len());
            stored += u
                .changes
                .iter()
                .filter(|c| matches!(c, BlockChange::Stored { .. }))
                .count();
            // The first update once following live carries the replay's remainder.
            if u.stats.connected {
                return;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(30), wait)
        .await
        .expect("the follower connects");
    // Each block is one change: ten in updates of three while the replay went on, the
    // last one after it.
    assert_eq!(stored, 10, "{sizes:?}");
    assert!(sizes.len() >= 4, "{sizes:?}");
    assert!(sizes.iter().all(|&n| n <= 3), "{sizes:?}");
}

/// A batch over the frame limit is read past and counted as undecodable (the mirror is
/// dropped until blocks are stored again, as for any batch that does not decode): the
/// subscription stays up and the batch's seq counts, so what follows applies with no gap and
/// no reconnect. It used to end the connection: a reconnect, a gap, and the batches
/// published meanwhile lost.
#[tokio::test]
async fn a_batch_over_the_frame_limit_is_read_past_on_the_same_connection() {
    let pubs = PubSocket::bind("127.0.0.1", 0).await.unwrap();
    let endpoint = EngineEndpoint {
        events: format!("tcp://127.0.0.1:{}", pubs.port()),
        replay: None,
        topic: String::new(),
    };
    let mut owner = follow(endpoint, IngestLimits::default()).await;
    let live = |seq: u64, payload: Bytes| {
        vec![
            Bytes::new(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload,
        ]
    };
    // Until the subscription reaches the socket, batches go nowhere: the first to arrive is
    // the first the ingest sees, whatever its seq.
    let mut seq = 0;
    loop {
        pubs.publish(live(seq, store(1000 + seq, None)));
        seq += 1;
        let wait = owner.until("a first block", |o| !o.held.is_empty());
        if tokio::time::timeout(Duration::from_millis(20), wait)
            .await
            .is_ok()
        {
            break;
        }
    }
    // Batches published meanwhile may still arrive: all of them before the ones below.
    let oversized = Bytes::from(vec![0u8; crate::engines::zmtp::MAX_FRAME + 1]);
    pubs.publish(live(seq, oversized));
    pubs.publish(live(seq + 1, store(7, None)));
    let want = hashes_of(&[(7, None)]);
    owner
        .until("the block after the oversized batch", |o| {
            o.stats.decode_errors == 1 && o.held == want
        })
        .await;
    assert_eq!(owner.stats.gaps, 0, "{:?}", owner.stats);
    assert_eq!(pubs.accepted(), 1, "the subscription was made again");
}

/// A replay socket answering from a shared buffer of batches: `(first seq, batches)`; a
/// request from `from` gets the batches from there on and the end marker, unless
/// `cut(from)` gives the seq its reply stream falls silent at (no marker).
fn buffered(
    buffer: &std::sync::Arc<std::sync::Mutex<(u64, Vec<Bytes>)>>,
    cut: impl Fn(u64) -> Option<u64> + Send + Sync + 'static,
) -> RouterHandler {
    let buffer = std::sync::Arc::clone(buffer);
    std::sync::Arc::new(move |request: Vec<Bytes>| {
        let (first, batches) = &*buffer.lock().unwrap();
        let from = asked_from(&request).max(*first);
        let end = first + batches.len() as u64;
        let cut = cut(asked_from(&request));
        let upto = cut.unwrap_or(end).min(end);
        let replies =
            (from..upto).map(|seq| replay_reply(seq, batches[(seq - first) as usize].clone()));
        let marker = cut.is_none().then(|| replay_reply(u64::MAX, Bytes::new()));
        replies.chain(marker).collect()
    })
}

/// An engine played by a PUB socket and the replay socket `handler` answers for, followed
/// with replies waited for 200 ms.
async fn follow_scripted(handler: RouterHandler) -> (RouterSocket, PubSocket, Owner) {
    let replay = RouterSocket::bind("127.0.0.1", 0, handler).await.unwrap();
    let pubs = PubSocket::bind("127.0.0.1", 0).await.unwrap();
    let limits = IngestLimits {
        replay: Duration::from_millis(200),
        ..IngestLimits::default()
    };
    let owner = follow(scripted(&pubs, &replay), limits).await;
    (replay, pubs, owner)
}

/// Waits until `owner` has lost its connection and followed the engine again (the
/// reconnect's replay done).
async fn reconnected(owner: &mut Owner) {
    owner.until("disconnected", |o| !o.stats.connected).await;
    owner.until("reconnected", |o| o.stats.connected).await;
}

/// A reconnect's replay from seq 0 that loses its last batch and end marker (a burst, which
/// drops the marker first) from a long-lived engine, whose buffer no longer reaches back to
/// seq 0: the engine did not restart. It was taken for restarted (the last batch that came
/// was older than the expected one), and block 1, stored before the buffer's window, was
/// dropped though the engine still held it.
#[tokio::test]
async fn a_reconnect_s_replay_that_loses_its_tail_is_no_restart() {
    // Seq 0 stores block 1; 1..=20 store and remove block 10.
    let mut life = vec![store(1, None)];
    for _ in 0..10 {
        life.extend([store(10, None), remove(10)]);
    }
    let buffer = std::sync::Arc::new(std::sync::Mutex::new((0u64, life)));
    let rolled = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let lossy = std::sync::Arc::clone(&rolled);
    // Once the buffer has rolled, a request from 0 falls silent before batch 20.
    let handler = buffered(&buffer, move |from| {
        (from == 0 && lossy.load(std::sync::atomic::Ordering::SeqCst)).then_some(20)
    });
    let (_replay, pubs, mut owner) = follow_scripted(handler).await;
    owner.until("replayed", |o| o.stats.replayed == 21).await;
    let one = hashes_of(&[(1, None)]);
    assert_eq!(owner.held, one);
    {
        let (first, batches) = &mut *buffer.lock().unwrap();
        *first = 10;
        batches.drain(..10);
    }
    rolled.store(true, std::sync::atomic::Ordering::SeqCst);
    let _pubs = rebind(pubs).await;
    reconnected(&mut owner).await;
    assert_eq!(owner.stats.restarts, 0, "{:?}", owner.stats);
    assert_eq!(owner.held, one);
}

/// A restarted engine seen at its live batch 3 whose replay brings 0 and 1 and then falls
/// silent: batch 2 (the removal of block 50) is lost for good, so the mirror is cleared and
/// rebuilt from what follows. Batch 3 was applied on top, and block 50 stayed held though
/// the engine had dropped it.
#[tokio::test]
async fn a_restart_whose_replay_stops_short_is_not_applied_on_top() {
    let old: Vec<Bytes> = (0..10).map(|h| store(100 + h, None)).collect();
    let buffer = std::sync::Arc::new(std::sync::Mutex::new((0u64, old)));
    let restarted = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let lossy = std::sync::Arc::clone(&restarted);
    // The new engine's replay falls silent at batch 2, asked from anywhere.
    let handler = buffered(&buffer, move |_| {
        lossy.load(std::sync::atomic::Ordering::SeqCst).then_some(2)
    });
    let (_replay, pubs, mut owner) = follow_scripted(handler).await;
    owner.until("replayed", |o| o.held.len() == 10).await;
    // Live batches of the old engine (each in the buffer too, so that one the subscription
    // missed is replayed), until one has come through the subscription.
    let live = |attempt: u64| {
        let seq = 10 + attempt;
        let batch = store(100 + seq, None);
        buffer.lock().unwrap().1.push(batch.clone());
        pubs.publish(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            batch,
        ]);
    };
    publish_until(&mut owner, "a live batch", live, |o| o.held.len() > 10).await;
    let unrepaired = owner.stats.unrepaired;
    // The engine restarts (its PUB stays bound): block 50 stored, 51 stored, 50 removed.
    *buffer.lock().unwrap() = (0, vec![store(50, None), store(51, None), remove(50)]);
    restarted.store(true, std::sync::atomic::Ordering::SeqCst);
    pubs.publish(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&3u64.to_be_bytes()),
        store(53, None),
    ]);
    let after = hashes_of(&[(53, None)]);
    owner
        .until("the new engine's batch 3", |o| {
            o.stats.restarts == 1 && o.held.contains(after.first().unwrap())
        })
        .await;
    assert_eq!(owner.held, after, "{:?}", owner.stats);
    assert_eq!(owner.stats.unrepaired, unrepaired + 1);
}

/// An engine whose hashes were found ambiguous (one hash under two parents: nothing of it
/// is indexed until it restarts) restarts, and the reconnect's replay holds its whole new
/// life: the restart is seen after that replay rebuilt the mirror, which it did while the
/// old engine's flag still dropped every store. The flag was never lowered on that path,
/// and the upgraded engine stayed unindexed until the sidecar restarted.
#[tokio::test]
async fn an_ambiguous_engine_restarted_and_replayed_whole_is_indexed_again() {
    ambiguous_engine_restarted(false).await;
}

/// The same, the reconnect's replay falling silent without its end marker: nothing proves
/// a restart, but the whole life was replayed under the old engine's flag, so it is
/// replayed again with the flag lowered.
#[tokio::test]
async fn an_ambiguous_engine_replayed_whole_without_end_is_indexed_again() {
    ambiguous_engine_restarted(true).await;
}

/// An ambiguous engine restarts with two position-aware batches, its replay `silent` after
/// them or ended.
async fn ambiguous_engine_restarted(silent: bool) {
    let old = vec![
        store(1, None),
        store(3, None),
        store(2, Some(1)),
        store(2, Some(3)),
    ];
    let buffer = std::sync::Arc::new(std::sync::Mutex::new((0u64, old)));
    let restarted = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mute = std::sync::Arc::clone(&restarted);
    let handler = buffered(&buffer, move |_| {
        (silent && mute.load(std::sync::atomic::Ordering::SeqCst)).then_some(u64::MAX)
    });
    let (_replay, pubs, mut owner) = follow_scripted(handler).await;
    owner
        .until("ambiguous", |o| o.stats.mirror.ambiguous > 0)
        .await;
    assert!(owner.held.is_empty());
    *buffer.lock().unwrap() = (0, vec![store(5, None), store(6, Some(5))]);
    restarted.store(true, std::sync::atomic::Ordering::SeqCst);
    let _pubs = rebind(pubs).await;
    let after = hashes_of(&[(5, None), (6, Some(5))]);
    owner.until("indexed again", |o| o.held == after).await;
    // Seen as a restart only where the replay ended.
    assert_eq!(
        owner.stats.restarts,
        u64::from(!silent),
        "{:?}",
        owner.stats
    );
}

/// Messages not shaped as an engine's (here two frames: no topic) are counted where the
/// owner sees them: an engine that sent nothing else showed no decode error at all.
#[tokio::test]
async fn misshaped_messages_are_reported() {
    let pubs = PubSocket::bind("127.0.0.1", 0).await.unwrap();
    let handler = buffered(
        &std::sync::Arc::new(std::sync::Mutex::new((0, Vec::new()))),
        |_| None,
    );
    let replay = RouterSocket::bind("127.0.0.1", 0, handler).await.unwrap();
    let mut owner = follow(scripted(&pubs, &replay), IngestLimits::default()).await;
    let misshaped = |_| {
        pubs.publish(vec![
            Bytes::copy_from_slice(&0u64.to_be_bytes()),
            store(1, None),
        ])
    };
    publish_until(&mut owner, "a decode error", misshaped, |o| {
        o.stats.decode_errors > 0
    })
    .await;
}
