use super::*;
use crate::protocol::{LocalHash, Salt, hash_blocks};

fn key(w: u64) -> WorkerKey {
    (WorkerId(w), DpRank(0))
}

/// Unit weights, so that expected costs read straight off the formula.
fn unit_weights() -> Config {
    Config {
        prefill_scale: 1.0,
        decode_weight: 1.0,
        recent_weight: 0.0,
        ..Config::default()
    }
}

fn scheduler(policy: PolicyKind, workers: u64) -> Scheduler {
    let mut s = Scheduler::new(Config {
        policy,
        ..unit_weights()
    })
    .unwrap();
    for w in 0..workers {
        s.add_worker(key(w), 1000, "m");
    }
    s
}

fn blocks(n: u32, start: u32) -> Vec<BlockHash> {
    let tokens: Vec<u32> = (start..start + n * 16).collect();
    hash_blocks(
        &tokens,
        std::num::NonZeroUsize::new(16).unwrap(),
        Salt::NONE,
    )
}

fn scores(entries: &[(u64, u32, u32, u32)]) -> OverlapScores {
    OverlapScores {
        workers: entries
            .iter()
            .map(|&(w, device, host, disk)| Overlap {
                worker: WorkerId(w),
                dp_rank: DpRank(0),
                device,
                host,
                disk,
            })
            .collect(),
    }
}

fn request<'a>(b: &'a [BlockHash], tokens: usize, overlaps: &'a OverlapScores) -> RouteRequest<'a> {
    RouteRequest {
        model: "m",
        blocks: b,
        prompt_tokens: tokens,
        block_size: 16,
        overlaps,
        max_tokens: 16,
        n: 1,
        session: None,
    }
}

#[test]
fn weights_scale_their_terms() {
    let config = Config {
        prefill_scale: 8.0,
        decode_weight: 0.1,
        recent_weight: 0.0,
        ..Config::default()
    };
    let mut s = Scheduler::new(config).unwrap();
    s.add_worker(key(0), 1000, "m");
    let b = blocks(10, 0);
    let none = scores(&[]);
    let d = s.route(0, &request(&b, 160, &none)).unwrap();
    assert!((d.chosen.cost - 80.0).abs() < 1e-9);
    s.first_token(d.booking);
    // 10 held blocks at 0.1, and 8 × 10 uncached.
    let c = s.candidates(0, &request(&blocks(10, 900), 160, &none));
    assert!((c[0].cost - 81.0).abs() < 1e-9, "{}", c[0].cost);
}

#[test]
fn blocks_booked_but_not_yet_announced_count_as_cached() {
    let mut s = Scheduler::new(Config::default()).unwrap();
    s.add_worker(key(0), 1000, "m");
    s.add_worker(key(1), 1000, "m");
    let b = blocks(10, 0);
    let none = scores(&[]);
    let first = s.route(0, &request(&b, 160, &none)).unwrap();
    // Same prompt before any KV event: the worker computing it is the cheap one.
    let c = s.candidates(0, &request(&b, 160, &none));
    let on_first = c.iter().find(|c| c.key == first.chosen.key).unwrap();
    assert_eq!(on_first.booked_prefix, 10);
    let second = s.route(0, &request(&b, 160, &none)).unwrap();
    assert_eq!(second.chosen.key, first.chosen.key);
}

#[test]
fn cost_follows_the_formula() {
    let s = scheduler(PolicyKind::Kv, 2);
    let b = blocks(10, 0);
    let o = scores(&[(0, 4, 2, 2)]);
    let c = s.candidates(0, &request(&b, 160, &o));
    // 10 − (4 + 0.75·2 + 0.25·2) = 4 blocks of prefill, no load.
    assert!((c[0].cost - 4.0).abs() < 1e-9);
    assert!((c[1].cost - 10.0).abs() < 1e-9);
}

#[test]
fn kv_prefers_the_cached_worker_until_load_outweighs_it() {
    let mut s = scheduler(PolicyKind::Kv, 2);
    let b = blocks(10, 0);
    let o = scores(&[(1, 10, 0, 0)]);
    let d = s.route(0, &request(&b, 160, &o)).unwrap();
    assert_eq!(d.chosen.key, key(1));
    // Worker 1 now holds 10 booked blocks: for a request it does not cache, worker 0 wins.
    let other = blocks(10, 5000);
    let none = scores(&[]);
    assert_eq!(
        s.route(0, &request(&other, 160, &none)).unwrap().chosen.key,
        key(0)
    );
}

#[test]
fn load_is_booked_released_at_first_token_and_completion() {
    let mut s = scheduler(PolicyKind::Kv, 1);
    let b = blocks(10, 0);
    let o = scores(&[(0, 4, 0, 0)]);
    let d = s.route(0, &request(&b, 165, &o)).unwrap();
    let load = s.load(key(0)).unwrap();
    // 165 tokens = 10.3125 blocks, 4 cached: 6.3125 to prefill; 10 full blocks + a tail.
    assert!((load.prefill_blocks - 6.3125).abs() < 1e-9);
    assert_eq!(load.decode_blocks(), 11);
    s.first_token(d.booking);
    assert_eq!(s.load(key(0)).unwrap().prefill_blocks, 0.0);
    assert_eq!(s.load(key(0)).unwrap().decode_blocks(), 11);
    s.complete(d.booking);
    assert_eq!(s.load(key(0)).unwrap().decode_blocks(), 0);
    assert_eq!(s.open_bookings(), 0);
}

#[test]
fn shared_blocks_count_once_per_worker() {
    let mut s = scheduler(PolicyKind::RoundRobin, 1);
    let b = blocks(8, 0);
    let none = scores(&[]);
    let d1 = s.route(0, &request(&b, 128, &none)).unwrap();
    let d2 = s.route(0, &request(&b, 128, &none)).unwrap();
    assert_eq!(s.load(key(0)).unwrap().decode_blocks(), 8);
    s.complete(d1.booking);
    assert_eq!(s.load(key(0)).unwrap().decode_blocks(), 8);
    s.complete(d2.booking);
    assert_eq!(s.load(key(0)).unwrap().decode_blocks(), 0);
}

/// A peer's booking never freed (the peer died) expires after the TTL; this router's own
/// do not (their guards release them, and a stream may outlast any fixed time).
#[test]
fn unreleased_peer_bookings_expire_and_own_ones_do_not() {
    let mut s = Scheduler::new(Config {
        booking_ttl_ms: 10_000,
        ..unit_weights()
    })
    .unwrap();
    s.add_worker(key(0), 100, "m");
    let b = blocks(4, 0);
    let none = scores(&[]);
    let own = s.route(0, &request(&b, 64, &none)).unwrap();
    let peer = blocks(2, 500);
    s.book_shared(
        0,
        SharedBooking {
            id: BookingId { origin: 9, seq: 1 },
            worker: WorkerId(0),
            dp_rank: DpRank(0),
            prefill_blocks: 2.0,
            blocks: peer.iter().map(|x| x.seq).collect(),
            tail: false,
            prefill_tokens: 32.0,
            decode_tokens: 16,
            session: None,
        },
    )
    .unwrap();
    s.expire(10_000);
    assert_eq!(s.open_bookings(), 2);
    s.expire(10_001);
    assert_eq!(s.open_bookings(), 1);
    assert_eq!(s.expired_bookings(), 1);
    assert_eq!(s.load(key(0)).unwrap().decode_blocks(), 4);
    s.expire(10_000_000);
    assert_eq!(s.open_bookings(), 1, "an own booking expired");
    s.complete(own.booking);
    assert_eq!(s.load(key(0)).unwrap().decode_blocks(), 0);
}

/// A peer's booking is input from the network: one that lacks its prompt's first block (a
/// faulty peer) credits no booked prefix to a prompt that starts with that block. The
/// bisection over held blocks took it for a prefix and credited all four, and in a debug
/// build a check of that rule panicked under the scheduler's lock.
#[test]
fn a_peer_booking_without_its_first_block_credits_no_prefix() {
    let mut s = scheduler(PolicyKind::Kv, 1);
    let b = blocks(4, 0);
    s.book_shared(
        0,
        SharedBooking {
            id: BookingId { origin: 9, seq: 1 },
            worker: WorkerId(0),
            dp_rank: DpRank(0),
            prefill_blocks: 3.0,
            blocks: b[1..].iter().map(|x| x.seq).collect(),
            tail: false,
            prefill_tokens: 48.0,
            decode_tokens: 16,
            session: None,
        },
    )
    .unwrap();
    let routed = s.route(0, &request(&b, 64, &scores(&[]))).unwrap();
    assert_eq!(routed.receipt.cached_blocks, 0);
}

#[test]
fn ties_break_at_random_and_deterministically() {
    let picks = |seed| {
        let mut s = Scheduler::new(Config {
            seed,
            ..unit_weights()
        })
        .unwrap();
        for w in 0..4 {
            s.add_worker(key(w), 1_000_000, "m");
        }
        let none = scores(&[]);
        (0..40u32)
            .map(|i| {
                let b = blocks(1, i * 100);
                let d = s.route(0, &request(&b, 16, &none)).unwrap();
                s.complete(d.booking);
                d.chosen.key.0.0
            })
            .collect::<Vec<_>>()
    };
    let a = picks(1);
    assert_eq!(a, picks(1));
    let distinct: std::collections::BTreeSet<_> = a.iter().collect();
    assert_eq!(distinct.len(), 4, "ties must spread: {a:?}");
}

#[test]
fn busy_workers_sit_out_unless_all_are_busy() {
    let mut s = Scheduler::new(unit_weights()).unwrap();
    s.add_worker(key(0), 10, "m");
    s.add_worker(key(1), 1000, "m");
    let b = blocks(10, 0);
    let cached_on_0 = scores(&[(0, 10, 0, 0)]);
    let d = s.route(0, &request(&b, 160, &cached_on_0)).unwrap();
    assert_eq!(d.chosen.key, key(0));
    // Worker 0 now holds 10 blocks of its 10: busy, even for a request it caches.
    assert_eq!(
        s.route(0, &request(&b, 160, &cached_on_0))
            .unwrap()
            .chosen
            .key,
        key(1)
    );
}

/// The plain baselines see every worker, busy or not (their namesakes do); only the variant
/// named for it skips busy workers.
#[test]
fn baselines_ignore_busy_workers_unless_named_for_it() {
    let order = |policy| {
        let mut s = Scheduler::new(Config {
            policy,
            ..unit_weights()
        })
        .unwrap();
        s.add_worker(key(0), 10, "m");
        s.add_worker(key(1), 1000, "m");
        // Worker 0 holds 10 blocks of its 10 (busy) for the rest of the test.
        let b = blocks(10, 0);
        let none = scores(&[]);
        s.route_excluding(0, &request(&b, 160, &none), &[key(1)])
            .unwrap();
        (1..=6u32)
            .map(|i| {
                let b = blocks(1, i * 100);
                let d = s.route(0, &request(&b, 16, &none)).unwrap();
                s.complete(d.booking);
                d.chosen.key.0.0
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(order(PolicyKind::RoundRobin), [1, 0, 1, 0, 1, 0]);
    assert_eq!(order(PolicyKind::RoundRobinSkipBusy), [1; 6]);
    let random = order(PolicyKind::Random);
    assert!(
        random.contains(&0),
        "random never picked the busy worker: {random:?}"
    );
}

#[test]
fn temperature_samples_mostly_the_cheapest() {
    let mut s = sampling_pair();
    let hits = cached_picks(&mut s);
    assert!(hits > 180, "{hits}/200");
}

/// Two workers and a softmax temperature of 0.05.
fn sampling_pair() -> Scheduler {
    let mut s = Scheduler::new(Config {
        temperature: 0.05,
        ..unit_weights()
    })
    .unwrap();
    s.add_worker(key(0), 1_000_000, "m");
    s.add_worker(key(1), 1_000_000, "m");
    s
}

/// Of 200 requests whose 10 blocks worker 1 caches, how many `s` sends there.
fn cached_picks(s: &mut Scheduler) -> usize {
    let b = blocks(10, 0);
    let o = scores(&[(1, 10, 0, 0)]);
    let mut hits = 0;
    for _ in 0..200 {
        let d = s.route(0, &request(&b, 160, &o)).unwrap();
        hits += usize::from(d.chosen.key == key(1));
        s.complete(d.booking);
    }
    hits
}

/// A temperature means the same on a loaded fleet as on an idle one: the costs are scaled
/// over their spread, not by the largest cost, which under load made the same cache hit a
/// coin toss.
#[test]
fn temperature_means_the_same_under_load() {
    let mut s = sampling_pair();
    // Both engines 90 % full: a large cost on each, the same on both.
    for w in 0..2 {
        s.set_engine_load(
            WorkerId(w),
            Some(crate::engines::metrics::EngineLoad {
                running: 50,
                waiting: 0,
                kv_usage_permille: 900,
            }),
            &[],
        );
    }
    let hits = cached_picks(&mut s);
    assert!(hits > 180, "{hits}/200");
}

#[test]
fn baselines_behave_as_named() {
    let none = scores(&[]);
    let b = blocks(2, 0);
    let mut rr = scheduler(PolicyKind::RoundRobin, 3);
    let seq: Vec<u64> = (0..6)
        .map(|_| rr.route(0, &request(&b, 32, &none)).unwrap().chosen.key.0.0)
        .collect();
    assert_eq!(seq, vec![0, 1, 2, 0, 1, 2]);

    let mut ll = scheduler(PolicyKind::LeastLoaded, 2);
    let first = ll.route(0, &request(&b, 32, &none)).unwrap().chosen.key;
    let other = blocks(2, 999);
    assert_ne!(
        ll.route(0, &request(&other, 32, &none)).unwrap().chosen.key,
        first
    );

    let mut rnd = scheduler(PolicyKind::Random, 4);
    let picked: std::collections::BTreeSet<u64> = (0..64)
        .map(|_| {
            rnd.route(0, &request(&b, 32, &none))
                .unwrap()
                .chosen
                .key
                .0
                .0
        })
        .collect();
    assert_eq!(picked.len(), 4);
}

#[test]
fn approx_prefix_follows_its_own_decisions_until_they_expire() {
    let mut s = scheduler(PolicyKind::ApproxPrefix, 4);
    let none = scores(&[]);
    let b = blocks(10, 0);
    let first = s.route(0, &request(&b, 160, &none)).unwrap();
    s.complete(first.booking);
    // Same prompt, load equal again: it follows its memory, not the (empty) indexer.
    for _ in 0..5 {
        let d = s.route(1000, &request(&b, 160, &none)).unwrap();
        assert_eq!(d.chosen.key, first.chosen.key);
        s.complete(d.booking);
    }
    // After the TTL it no longer remembers, and picks the least loaded (any, at random).
    let later: std::collections::BTreeSet<u64> = (0..40)
        .map(|i| {
            let d = s
                .route(200_000 + i * 200_000, &request(&b, 160, &none))
                .unwrap();
            s.complete(d.booking);
            d.chosen.key.0.0
        })
        .collect();
    assert!(later.len() > 1);
    let _ = LocalHash(0);
}

#[test]
fn config_validation_names_the_field() {
    let bad = Config {
        host_weight: 1.5,
        ..unit_weights()
    };
    assert!(matches!(
        bad.validate(),
        Err(ConfigError::OutOfRange {
            field: "host_weight",
            ..
        })
    ));
    assert_eq!(
        PolicyKind::parse("least_loaded"),
        Some(PolicyKind::LeastLoaded)
    );
    assert_eq!(PolicyKind::parse("nope"), None);
    // A booking TTL near the heartbeat would drop peers' live bookings between two.
    let short = Config {
        booking_ttl_ms: 2_000,
        ..unit_weights()
    };
    assert!(matches!(
        short.validate(),
        Err(ConfigError::OutOfRange {
            field: "booking_ttl_ms",
            ..
        })
    ));
}

#[test]
fn every_float_setting_must_be_finite() {
    // `--decode-weight NaN` once passed validation and made every cost NaN.
    type Set = fn(&mut Config, f64);
    let setters: [(&str, Set); 9] = [
        ("prefill_scale", |c, v| c.prefill_scale = v),
        ("decode_weight", |c, v| c.decode_weight = v),
        ("device_weight", |c, v| c.device_weight = v),
        ("host_weight", |c, v| c.host_weight = v),
        ("disk_weight", |c, v| c.disk_weight = v),
        ("temperature", |c, v| c.temperature = v),
        ("busy_decode_fraction", |c, v| c.busy_decode_fraction = v),
        ("busy_prefill_blocks", |c, v| c.busy_prefill_blocks = v),
        ("approx.match_threshold", |c, v| {
            c.approx.match_threshold = v
        }),
    ];
    for (name, set) in setters {
        for value in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -1.0] {
            let mut c = Config::default();
            set(&mut c, value);
            match c.validate() {
                Err(ConfigError::OutOfRange { field, .. }) => assert_eq!(field, name),
                other => panic!("{name} = {value} accepted: {other:?}"),
            }
        }
    }
    assert_eq!(Config::default().validate(), Ok(()));
}

#[test]
fn two_models_never_cross() {
    let mut s = Scheduler::new(Config::default()).unwrap();
    s.add_worker(key(0), 1000, "llama");
    s.add_worker(key(1), 1000, "qwen");
    let b = blocks(4, 0);
    // The index says worker 1 holds the whole prompt: it still serves only qwen.
    let overlaps = scores(&[(1, 4, 0, 0)]);
    for _ in 0..20 {
        let r = RouteRequest {
            model: "llama",
            ..request(&b, 64, &overlaps)
        };
        let d = s.route(0, &r).unwrap();
        assert_eq!(d.chosen.key, key(0));
        s.complete(d.booking);
    }
    let none = RouteRequest {
        model: "mistral",
        ..request(&b, 64, &overlaps)
    };
    assert!(s.route(0, &none).is_none());
    assert!(s.candidates(0, &none).is_empty());
}

mod ledger {
    //! The booking ledger against a model: any sequence of bookings, first tokens,
    //! completions, expiries, peers' bookings, dropped origins and removed workers leaves
    //! the open bookings and every worker's load equal to the model's.

    use std::collections::{BTreeMap, BTreeSet};

    use proptest::prelude::*;

    use super::*;

    #[derive(Clone, Debug)]
    enum Op {
        Route {
            prompt: u32,
            len: u32,
        },
        FirstToken(usize),
        Complete(usize),
        Advance(u64),
        Peer {
            origin: u64,
            seq: u64,
            worker: u64,
            prompt: u32,
            len: u32,
        },
        DropOrigin(u64),
        RemoveWorker(u64),
        AddWorker(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u32..4, 1u32..6).prop_map(|(prompt, len)| Op::Route { prompt, len }),
            2 => (0usize..64).prop_map(Op::FirstToken),
            3 => (0usize..64).prop_map(Op::Complete),
            1 => (1u64..4_000).prop_map(Op::Advance),
            2 => (1u64..3, 0u64..8, 0u64..4, 0u32..4, 1u32..6)
                .prop_map(|(origin, seq, worker, prompt, len)| Op::Peer { origin, seq, worker, prompt, len }),
            1 => (1u64..3).prop_map(Op::DropOrigin),
            1 => (0u64..3).prop_map(Op::RemoveWorker),
            1 => (0u64..3).prop_map(Op::AddWorker),
        ]
    }

    #[derive(Clone, Debug)]
    struct Entry {
        worker: WorkerKey,
        prefill: f64,
        blocks: Vec<SeqHash>,
        prefill_open: bool,
        at: u64,
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(
            std::env::var("KVROUTE_PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)
        ))]

        #[test]
        fn open_bookings_and_loads_match_the_model(ops in proptest::collection::vec(op(), 1..150)) {
            const TTL: u64 = 10_000;
            let mut s = Scheduler::new(Config { booking_ttl_ms: TTL, ..Config::default() }).unwrap();
            let mut workers: BTreeSet<WorkerKey> = BTreeSet::new();
            for w in 0..3 {
                s.add_worker(key(w), 1000, "m");
                workers.insert(key(w));
            }
            let mut model: BTreeMap<BookingId, Entry> = BTreeMap::new();
            let mut mine: Vec<BookingId> = Vec::new();
            let mut now = 0u64;
            for op in ops {
                match op {
                    Op::Route { prompt, len } => {
                        let b = blocks(len, prompt * 1000);
                        let o = OverlapScores { workers: Vec::new() };
                        if let Some(d) = s.route(now, &request(&b, (len * 16) as usize, &o)) {
                            let shared = s.shared(d.booking).expect("just booked");
                            model.insert(d.booking, Entry {
                                worker: d.chosen.key,
                                prefill: shared.prefill_blocks,
                                blocks: shared.blocks,
                                prefill_open: true,
                                at: now,
                            });
                            mine.push(d.booking);
                        } else {
                            prop_assert!(workers.is_empty());
                        }
                    }
                    Op::FirstToken(i) => {
                        if let Some(id) = mine.get(i).copied() {
                            s.first_token(id);
                            if let Some(e) = model.get_mut(&id) {
                                e.prefill_open = false;
                            }
                        }
                    }
                    Op::Complete(i) => {
                        if let Some(id) = mine.get(i).copied() {
                            s.complete(id);
                            model.remove(&id);
                        }
                    }
                    Op::Advance(ms) => {
                        now += ms;
                        s.expire(now);
                        // Peers' bookings expire; this router's own (origin 0) do not.
                        model.retain(|id, e| id.origin == 0 || now - e.at <= TTL);
                    }
                    Op::Peer { origin, seq, worker, prompt, len } => {
                        let b = blocks(len, prompt * 1000);
                        let booking = SharedBooking {
                            id: BookingId { origin, seq },
                            worker: WorkerId(worker),
                            dp_rank: DpRank(0),
                            prefill_blocks: f64::from(len),
                            blocks: b.iter().map(|x| x.seq).collect(),
                            tail: false,
                            prefill_tokens: 0.0,
                            decode_tokens: 0,
                            session: None,
                        };
                        let known = workers.contains(&key(worker));
                        let result = s.book_shared(now, booking.clone());
                        prop_assert_eq!(result.is_ok(), known);
                        if known {
                            model.entry(booking.id).or_insert(Entry {
                                worker: key(worker),
                                prefill: booking.prefill_blocks,
                                blocks: booking.blocks,
                                prefill_open: true,
                                at: now,
                            });
                        }
                    }
                    Op::DropOrigin(origin) => {
                        s.drop_origin(origin);
                        model.retain(|id, _| id.origin != origin);
                    }
                    Op::RemoveWorker(w) => {
                        // Its bookings stay open (their requests may run on), to be booked
                        // again if it comes back.
                        s.remove_worker(key(w));
                        workers.remove(&key(w));
                    }
                    Op::AddWorker(w) => {
                        s.add_worker(key(w), 1000, "m");
                        workers.insert(key(w));
                    }
                }
                prop_assert_eq!(s.open_bookings(), model.len());
                for w in &workers {
                    let load = s.load(*w).expect("known worker");
                    let entries: Vec<&Entry> = model.values().filter(|e| e.worker == *w).collect();
                    prop_assert_eq!(load.requests, entries.len(), "requests of {:?}", w);
                    let distinct: BTreeSet<SeqHash> =
                        entries.iter().flat_map(|e| e.blocks.iter().copied()).collect();
                    prop_assert_eq!(load.decode_blocks(), distinct.len(), "held blocks of {:?}", w);
                    let open = entries.iter().filter(|e| e.prefill_open).count();
                    prop_assert_eq!(load.prefill_requests, open, "open prefills of {:?}", w);
                    let prefill: f64 = entries.iter().filter(|e| e.prefill_open).map(|e| e.prefill).sum();
                    prop_assert!((load.prefill_blocks - prefill).abs() < 1e-6,
                        "prefill of {:?}: {} vs model {}", w, load.prefill_blocks, prefill);
                }
            }
        }
    }
}

#[test]
fn an_engine_s_own_kv_usage_counts_where_it_exceeds_the_bookings() {
    use crate::engines::metrics::EngineLoad;
    let mut s = scheduler(PolicyKind::Kv, 2);
    let b = blocks(4, 0);
    let none = scores(&[]);
    let cost = |s: &Scheduler, w: u64| {
        s.candidates(0, &request(&b, 64, &none))
            .into_iter()
            .find(|c| c.key == key(w))
            .unwrap()
            .cost
    };
    assert_eq!(cost(&s, 0), cost(&s, 1));
    // Engine 1 reports 60 % of its 1,000 blocks in use (other routers' requests), and
    // nothing queued (its queue is the next test's).
    let busy = EngineLoad {
        running: 9,
        waiting: 0,
        kv_usage_permille: 600,
    };
    s.set_engine_load(WorkerId(1), Some(busy), &[]);
    assert_eq!(cost(&s, 1) - cost(&s, 0), 600.0);
    // The sidecar could not read the engine's metrics: the last report does not linger.
    s.set_engine_load(WorkerId(1), None, &[]);
    assert_eq!(cost(&s, 1), cost(&s, 0));
    s.set_engine_load(WorkerId(1), Some(busy), &[]);
    let d = s.route(0, &request(&b, 64, &none)).unwrap();
    assert_eq!(d.chosen.key, key(0), "the idle engine is cheaper");
    // Engine 1 idle again, engine 0 holding what this router booked there: 1 is cheaper.
    s.set_engine_load(WorkerId(1), Some(EngineLoad::default()), &[]);
    assert!(cost(&s, 1) < cost(&s, 0));
}

/// `key`'s candidate for a 4-block prompt no worker holds.
fn probe(s: &Scheduler, key: WorkerKey) -> Candidate {
    let b = blocks(4, 99);
    s.candidates(0, &request(&b, 64, &scores(&[])))
        .into_iter()
        .find(|c| c.key == key)
        .unwrap()
}

/// An engine's report of `waiting` requests in its queue, and nothing else.
fn engine_queue(waiting: u32) -> crate::engines::metrics::EngineLoad {
    crate::engines::metrics::EngineLoad {
        running: 0,
        waiting,
        kv_usage_permille: 0,
    }
}

/// Requests waiting in an engine's queue that no router booked there (clients that bypass
/// kvroute) count as prefill to compute, each the size of the prefills this router books;
/// those it booked and has not seen start are in the engine's queue already, and are not
/// counted twice.
#[test]
fn an_engine_s_queue_beyond_the_bookings_counts_as_prefill() {
    let mut s = scheduler(PolicyKind::Kv, 2);
    let none = scores(&[]);
    let prefill = |s: &Scheduler, w: u64| probe(s, key(w)).prefill_blocks;
    // Before this router books anything, a queued request counts as long as this prompt.
    s.set_engine_load(WorkerId(1), Some(engine_queue(3)), &[]);
    assert_eq!((prefill(&s, 0), prefill(&s, 1)), (0.0, 12.0));
    // This router books a 10-block prompt on worker 1 after that report: the mean is 10
    // blocks a request; the engine's three were someone else's and stay so until the next
    // report (the router's own is booked, not in that count).
    let b = blocks(10, 0);
    let own = s
        .route_excluding(0, &request(&b, 160, &none), &[key(0)])
        .expect("worker 1 serves the model")
        .booking;
    assert_eq!(prefill(&s, 1), 10.0 + 3.0 * 10.0);
    // The next report counts four waiting, one of them the router's own, not started: it is
    // counted once, as booked.
    s.set_engine_load(WorkerId(1), Some(engine_queue(4)), &[]);
    assert_eq!(prefill(&s, 1), 10.0 + 3.0 * 10.0);
    // Its first token: its prefill is done; the three stay until the engine says otherwise.
    s.first_token(own);
    assert_eq!(prefill(&s, 1), 3.0 * 10.0);
    // Worker 1's queue makes it the dearer, though neither holds the prompt.
    let b = blocks(4, 500);
    let d = s.route(0, &request(&b, 64, &none)).unwrap();
    assert_eq!(
        d.chosen.key,
        key(0),
        "the engine without a queue is cheaper"
    );
    // A report without its metrics forgets the queue.
    s.set_engine_load(WorkerId(1), None, &[]);
    assert_eq!(prefill(&s, 1), 0.0);
}

/// The size assumed for another client's queued request is a mean in tokens: a router that
/// booked 160-token prompts for a model of 16-token blocks counts a queued request of a
/// model with 64-token blocks as 2.5 of its blocks, not 10.
#[test]
fn the_queued_request_size_is_in_tokens_across_block_sizes() {
    let mut s = Scheduler::new(unit_weights()).unwrap();
    s.add_worker(key(0), 1000, "m");
    s.add_worker(key(1), 1000, "big-blocks");
    let none = scores(&[]);
    let b = blocks(10, 0);
    s.route(0, &request(&b, 160, &none)).unwrap();
    s.set_engine_load(WorkerId(1), Some(engine_queue(2)), &[]);
    let b = blocks(1, 900);
    let big = RouteRequest {
        model: "big-blocks",
        block_size: 64,
        ..request(&b, 64, &none)
    };
    let c = s
        .candidates(0, &big)
        .into_iter()
        .find(|c| c.key == key(1))
        .unwrap();
    assert_eq!(c.prefill_blocks, 2.0 * 160.0 / 64.0);
}

/// An engine with data-parallel ranks reports one queue: the router's own requests waiting
/// on any rank come off it before the rest is shared out, so the rank that holds them does
/// not make its idle sibling look queued.
#[test]
fn an_engine_s_queue_is_shared_by_its_ranks_after_the_bookings() {
    let mut s = Scheduler::new(unit_weights()).unwrap();
    for rank in 0..2 {
        s.add_worker((WorkerId(7), DpRank(rank)), 1000, "m");
    }
    let none = scores(&[]);
    let all_but_rank_0 = [(WorkerId(7), DpRank(1))];
    for i in 0..4 {
        let b = blocks(10, 1000 * i);
        s.route_excluding(0, &request(&b, 160, &none), &all_but_rank_0)
            .expect("rank 0 serves the model");
    }
    let queued = |s: &Scheduler, rank: u32| {
        let key = (WorkerId(7), DpRank(rank));
        probe(s, key).prefill_blocks - s.load(key).unwrap().prefill_blocks
    };
    // Four waiting, all four the router's own on rank 0: nobody else's.
    s.set_engine_load(WorkerId(7), Some(engine_queue(4)), &[]);
    assert_eq!((queued(&s, 0), queued(&s, 1)), (0.0, 0.0));
    // Six waiting: two of someone else's, one on each rank's account (10 blocks each).
    s.set_engine_load(WorkerId(7), Some(engine_queue(6)), &[]);
    assert_eq!((queued(&s, 0), queued(&s, 1)), (10.0, 10.0));
}

/// An engine with data-parallel ranks reports each rank's KV usage: a full rank costs more
/// than its idle siblings, which the mean over ranks would hide.
#[test]
fn each_rank_s_own_kv_usage_counts() {
    use crate::engines::metrics::EngineLoad;
    let mut s = Scheduler::new(unit_weights()).unwrap();
    for rank in 0..2 {
        s.add_worker((WorkerId(7), DpRank(rank)), 1000, "m");
    }
    let b = blocks(4, 0);
    let none = scores(&[]);
    let cost = |s: &Scheduler, rank: u32| {
        s.candidates(0, &request(&b, 64, &none))
            .into_iter()
            .find(|c| c.key == (WorkerId(7), DpRank(rank)))
            .unwrap()
            .cost
    };
    // Mean 450 ‰: rank 0 at 900, rank 1 idle.
    let load = EngineLoad {
        running: 9,
        waiting: 0,
        kv_usage_permille: 450,
    };
    s.set_engine_load(WorkerId(7), Some(load), &[900, 0]);
    assert_eq!(cost(&s, 0) - cost(&s, 1), 900.0);
    // Without per-rank figures, the mean stands for every rank.
    s.set_engine_load(WorkerId(7), Some(load), &[]);
    assert_eq!(cost(&s, 0), cost(&s, 1));
}

fn budgeted(worker_budget: u64, fleet_budget: u64, workers: u64) -> Scheduler {
    let mut s = Scheduler::new(Config {
        admission: AdmissionConfig {
            worker_budget_tokens: worker_budget,
            fleet_budget_tokens: fleet_budget,
            decode_cap_tokens: 100,
        },
        ..Config::default()
    })
    .unwrap();
    for w in 0..workers {
        s.add_worker(key(w), 1000, "m");
    }
    s
}

fn routed(a: Admission) -> Decision {
    match a {
        Admission::Routed(d) => d,
        other => panic!("expected a decision, got {other:?}"),
    }
}

#[test]
fn admission_books_work_and_waits_past_the_budget() {
    // Work of one request: 160 prompt tokens + min(16, 100) decode = 176 tokens.
    let mut s = budgeted(400, 0, 2);
    let none = scores(&[]);
    let r = |start| blocks(10, start);
    let (b0, b1, b2, b3, b4) = (r(0), r(1000), r(2000), r(3000), r(4000));
    let d: Vec<Decision> = [&b0, &b1, &b2, &b3]
        .iter()
        .map(|b| routed(s.admit(0, &request(b, 160, &none))))
        .collect();
    // Two fit on each worker (352 <= 400), a fifth fits nowhere.
    assert_eq!(s.admit(0, &request(&b4, 160, &none)), Admission::Wait);
    assert!((s.booked_work_tokens() - 4.0 * 176.0).abs() < 1e-9);
    // A first token releases the prefill part (160): room for one more there.
    s.first_token(d[0].booking);
    let e = routed(s.admit(0, &request(&b4, 160, &none)));
    assert_eq!(e.chosen.key, d[0].chosen.key);
    // Completions release the rest.
    for x in d.iter().chain([&e]) {
        s.complete(x.booking);
    }
    assert_eq!(s.booked_work_tokens(), 0.0);
    // Another model: nobody serves it.
    let other = RouteRequest {
        model: "other",
        ..request(&b0, 160, &none)
    };
    assert_eq!(s.admit(0, &other), Admission::NoWorkers);
}

#[test]
fn an_idle_worker_takes_a_request_larger_than_its_budget() {
    let mut s = budgeted(100, 0, 1);
    let b = blocks(10, 0);
    let none = scores(&[]);
    let d = routed(s.admit(0, &request(&b, 160, &none)));
    assert!(!s.candidates(0, &request(&b, 160, &none))[0].room);
    s.complete(d.booking);
    routed(s.admit(0, &request(&b, 160, &none)));
}

/// A request larger than the budget (many sequences, a huge `max_tokens`) does not wait for
/// a worker to drain completely: it takes one at most half booked.
#[test]
fn a_request_larger_than_the_budget_takes_a_half_booked_worker() {
    // One request's work: 160 + min(16, 100) = 176 tokens; the large one's 160 + 100 × 64.
    let mut s = budgeted(400, 0, 1);
    let none = scores(&[]);
    let small = routed(s.admit(0, &request(&blocks(10, 0), 160, &none)));
    let big_blocks = blocks(10, 1000);
    let big = RouteRequest {
        max_tokens: 1000,
        n: 64,
        ..request(&big_blocks, 160, &none)
    };
    let d = routed(s.admit(0, &big));
    // Now over the budget: nothing else fits until it is done.
    assert_eq!(
        s.admit(0, &request(&blocks(10, 2000), 160, &none)),
        Admission::Wait
    );
    s.complete(d.booking);
    s.complete(small.booking);
    // Past half booked, the large one waits.
    let a = routed(s.admit(0, &request(&blocks(10, 3000), 160, &none)));
    let b = routed(s.admit(0, &request(&blocks(10, 4000), 160, &none)));
    assert_eq!(s.admit(0, &big), Admission::Wait);
    s.complete(a.booking);
    s.complete(b.booking);
}

#[test]
fn the_fleet_budget_caps_all_workers_together() {
    let mut s = budgeted(0, 400, 4);
    let none = scores(&[]);
    routed(s.admit(0, &request(&blocks(10, 0), 160, &none)));
    routed(s.admit(0, &request(&blocks(10, 1000), 160, &none)));
    assert_eq!(
        s.admit(0, &request(&blocks(10, 2000), 160, &none)),
        Admission::FleetFull
    );
    // Retries of an admitted request are not held to the budgets.
    assert!(
        s.route(0, &request(&blocks(10, 2000), 160, &none))
            .is_some()
    );
}

fn in_session<'a>(r: RouteRequest<'a>, id: &'a str, hard: bool) -> RouteRequest<'a> {
    RouteRequest {
        session: Some(SessionRef { id, hard }),
        ..r
    }
}

#[test]
fn a_session_sticks_to_its_worker_and_moves_once_when_it_leaves() {
    let mut s = scheduler(PolicyKind::Kv, 3);
    let none = scores(&[]);
    let first = s.route(
        0,
        &in_session(request(&blocks(4, 0), 64, &none), "conv", false),
    );
    let home = first.unwrap().chosen.key;
    // Unrelated prompts (no cache anywhere, equal load otherwise) follow the session.
    for turn in 1..20u32 {
        let b = blocks(4, 10_000 * turn);
        let d = s
            .route(
                u64::from(turn),
                &in_session(request(&b, 64, &none), "conv", false),
            )
            .unwrap();
        assert_eq!(d.chosen.key, home, "turn {turn}");
        s.complete(d.booking);
    }
    s.remove_worker(home);
    let moved = s
        .route(
            100,
            &in_session(request(&blocks(4, 7), 64, &none), "conv", false),
        )
        .unwrap()
        .chosen
        .key;
    assert_ne!(moved, home);
    for turn in 0..5u32 {
        let b = blocks(4, 500_000 + 1000 * turn);
        let d = s
            .route(200, &in_session(request(&b, 64, &none), "conv", false))
            .unwrap();
        assert_eq!(d.chosen.key, moved);
    }
    let st = s.session_stats();
    assert_eq!((st.started, st.stuck, st.moved, st.yielded), (1, 24, 1, 0));
}

#[test]
fn soft_affinity_yields_to_a_saturated_worker_and_hard_affinity_waits() {
    let mut s = budgeted(200, 0, 2);
    let none = scores(&[]);
    let home = routed(s.admit(
        0,
        &in_session(request(&blocks(10, 0), 160, &none), "c", false),
    ));
    // The session's worker holds 176 of 200 tokens: no room for another 176.
    let soft = routed(s.admit(
        1,
        &in_session(request(&blocks(10, 900), 160, &none), "c", false),
    ));
    assert_ne!(soft.chosen.key, home.chosen.key);
    assert_eq!(s.session_stats().yielded, 1);
    // The session now sticks where its last turn went; hard affinity waits for it.
    assert_eq!(
        s.admit(
            2,
            &in_session(request(&blocks(10, 1900), 160, &none), "c", true)
        ),
        Admission::Wait
    );
    s.complete(soft.booking);
    let hard = routed(s.admit(
        3,
        &in_session(request(&blocks(10, 1900), 160, &none), "c", true),
    ));
    assert_eq!(hard.chosen.key, soft.chosen.key);
}

/// Router replicas learn each other's sessions from their bookings: a hard session's turn
/// on replica A sticks it to its worker on replica B too, which waits for that worker when
/// it is full (before, B knew nothing of the session and routed the next turn anywhere).
#[test]
fn replicas_learn_each_other_s_sessions_from_their_bookings() {
    let replica = |id: u64| {
        let mut s = Scheduler::new(Config {
            replica_id: id,
            admission: AdmissionConfig {
                worker_budget_tokens: 200,
                fleet_budget_tokens: 0,
                decode_cap_tokens: 100,
            },
            ..Config::default()
        })
        .unwrap();
        for w in 0..2 {
            s.add_worker(key(w), 1000, "m");
        }
        s
    };
    let (mut a, mut b) = (replica(1), replica(2));
    let none = scores(&[]);
    let first = routed(a.admit(
        0,
        &in_session(request(&blocks(10, 0), 160, &none), "c", true),
    ));
    // As peers read it, from JSON.
    let json = serde_json::to_string(&a.shared(first.booking).unwrap()).unwrap();
    assert!(json.contains(r#""session":""#), "{json}");
    b.book_shared(0, serde_json::from_str(&json).unwrap())
        .unwrap();
    assert_eq!(b.session_worker(1, "c"), Some(first.chosen.key));
    assert_eq!(b.session_stats().learned, 1);
    // The session's worker holds 176 of 200 tokens (A's turn, booked on B too): B waits.
    assert_eq!(
        b.admit(
            1,
            &in_session(request(&blocks(10, 900), 160, &none), "c", true)
        ),
        Admission::Wait
    );
    // A turn without a session shares none; a booking from an older replica (no session
    // field) is read; a malformed key is refused.
    let plain = routed(a.admit(2, &request(&blocks(4, 5000), 64, &none)));
    let plain = serde_json::to_string(&a.shared(plain.booking).unwrap()).unwrap();
    assert!(!plain.contains("session"), "{plain}");
    let old: SharedBooking = serde_json::from_str(&plain).unwrap();
    assert_eq!(old.session, None);
    let bad = json.replacen(r#""session":""#, r#""session":"zz"#, 1);
    assert!(serde_json::from_str::<SharedBooking>(&bad).is_err());
}

#[test]
fn sessions_are_forgotten_after_their_ttl_and_past_the_cap() {
    let mut s = Scheduler::new(Config {
        sessions: SessionConfig {
            ttl_ms: 1_000,
            max_sessions: 3,
            ..SessionConfig::default()
        },
        ..Config::default()
    })
    .unwrap();
    s.add_worker(key(0), 1000, "m");
    let none = scores(&[]);
    let b = blocks(2, 0);
    for (i, id) in ["a", "b", "c", "d"].iter().enumerate() {
        let d = s.route(i as u64, &in_session(request(&b, 32, &none), id, false));
        s.complete(d.unwrap().booking);
    }
    assert_eq!(s.session_stats().live, 3, "the oldest went past the cap");
    assert_eq!(s.session_worker(3, "a"), None);
    assert_eq!(s.session_worker(3, "d"), Some(key(0)));
    assert_eq!(s.session_worker(1_003, "d"), None, "past its TTL");
    let d = s.route(5_000, &in_session(request(&b, 32, &none), "e", false));
    s.complete(d.unwrap().booking);
    assert_eq!(s.session_stats().live, 1);
    // With no session request after them, sessions still go with time: a request without
    // one, or the clock alone (the scrape, the peers' tick), forgets them.
    let d = s.route(6_000, &request(&b, 32, &none));
    s.complete(d.unwrap().booking);
    assert_eq!(s.session_stats().live, 0);
    let d = s.route(7_000, &in_session(request(&b, 32, &none), "f", false));
    s.complete(d.unwrap().booking);
    s.forget_sessions(8_000);
    assert_eq!(s.session_stats().live, 0);
}

/// One paced request at a time (each done before the next), each a new conversation that
/// shares an 8-block system prompt; requests per worker.
fn paced_shares(recent_weight: f64) -> [u32; 4] {
    let mut s = Scheduler::new(Config {
        recent_weight,
        recent_half_life_ms: 10_000,
        ..Config::default()
    })
    .unwrap();
    for w in 0..4 {
        s.add_worker(key(w), 1000, "m");
    }
    let mut counts = [0u32; 4];
    for i in 0..200u32 {
        let mut b = blocks(8, 0);
        b.extend(blocks(24, 100_000 + 1000 * i));
        // Worker 0 held the system prompt first; the others once they served one.
        let holders: Vec<(u64, u32, u32, u32)> = (0..4)
            .map(|w| {
                (
                    w,
                    if w == 0 || counts[w as usize] > 0 {
                        8
                    } else {
                        0
                    },
                    0,
                    0,
                )
            })
            .collect();
        let o = scores(&holders);
        let d = s
            .route(u64::from(i) * 2_000, &request(&b, 512, &o))
            .unwrap();
        counts[d.chosen.key.0.0 as usize] += 1;
        s.first_token(d.booking);
        s.complete(d.booking);
    }
    counts
}

#[test]
fn paced_requests_do_not_all_follow_a_shared_prefix() {
    // AMD-AGI/Infera #103: booked load is zero at every decision, so without a memory of
    // recent work every request follows the system prompt to worker 0.
    assert_eq!(paced_shares(0.0), [200, 0, 0, 0]);
    // With it, a worker's recent requests outweigh the shared prefix's 8 blocks as they
    // accumulate, and the other workers take over in turn.
    let spread = paced_shares(1.0);
    assert!(spread[0] < 100, "{spread:?}");
    assert!(
        spread.iter().filter(|c| **c >= 50).count() >= 3,
        "{spread:?}"
    );
}

#[test]
fn receipts_count_the_cache_given_up_for_load() {
    let mut s = budgeted(100, 0, 2);
    // Worker 0 holds all of a first prompt: it goes there (16 tokens of decode booked).
    let filler = routed(s.admit(
        0,
        &request(&blocks(10, 5000), 160, &scores(&[(0, 10, 0, 0)])),
    ));
    assert_eq!(filler.chosen.key, key(0));
    assert_eq!(filler.receipt.cached_blocks, 10);
    // Worker 0 has 6 of the next prompt's 10 blocks: 64 + 16 tokens of work on top of its 16
    // fit the budget of 100 (96); after that, worker 0 has no room for another.
    let b = blocks(10, 0);
    let o = scores(&[(0, 6, 0, 0)]);
    let second = routed(s.admit(1, &request(&b, 160, &o)));
    assert_eq!(
        (second.chosen.key, second.receipt.cached_blocks),
        (key(0), 6)
    );
    let third = routed(s.admit(2, &request(&b, 160, &o)));
    let r = third.receipt;
    assert_eq!(
        (r.prompt_blocks, r.reachable_blocks),
        (10, 10),
        "the second is booked on 0"
    );
    assert_eq!((third.chosen.key, r.cached_blocks), (key(1), 0));
    let st = s.decision_stats();
    // Three decisions, two optimal; 10 blocks lost to load; 4 blocks nobody had.
    assert_eq!(
        (st.decisions, st.optimal, st.lost_blocks(), st.novel_blocks),
        (3, 2, 10, 4)
    );
    assert!((st.regret() - 10.0 / 14.0).abs() < 1e-9);
}

/// A worker that cannot be reached sits out after `after_failures` failures in a row, for
/// `base_ms` doubling per failure after an ejection ends, up to `max_ms`; failures while it
/// is ejected (requests sent before) change nothing; an answer ends it; and when every
/// worker is ejected the model is still served.
#[test]
fn unreachable_workers_sit_out_for_a_growing_while() {
    let mut s = scheduler(PolicyKind::Kv, 2);
    let b = blocks(4, 0);
    // Worker 0 holds the prompt: it wins while it can be reached.
    let cached = scores(&[(0, 4, 0, 0)]);
    let route = |s: &mut Scheduler, now_ms: u64| {
        let d = s.route(now_ms, &request(&b, 64, &cached)).unwrap();
        s.complete(d.booking);
        d.chosen.key
    };
    let w0 = WorkerId(0);
    assert_eq!(route(&mut s, 0), key(0));
    assert_eq!(s.worker_unreachable(w0, 0), None);
    assert_eq!(s.worker_unreachable(w0, 0), None);
    assert_eq!(route(&mut s, 0), key(0), "two failures do not eject");
    assert_eq!(s.worker_unreachable(w0, 1_000), Some(5_000));
    assert!(s.ejected(key(0), 1_000));
    // Requests sent before the ejection fail too: they do not stretch it.
    for _ in 0..10 {
        assert_eq!(s.worker_unreachable(w0, 2_000), None);
    }
    assert_eq!(route(&mut s, 1_000), key(1));
    assert_eq!(route(&mut s, 5_999), key(1));
    assert_eq!(route(&mut s, 6_000), key(0), "back after base_ms");
    // Still failing once back: each ejection doubles, up to max_ms.
    assert_eq!(s.worker_unreachable(w0, 6_000), Some(10_000));
    assert_eq!(s.worker_unreachable(w0, 16_000), Some(20_000));
    assert_eq!(s.worker_unreachable(w0, 36_000), Some(40_000));
    assert_eq!(s.worker_unreachable(w0, 76_000), Some(60_000));
    // Half the model's workers sit out at most: the other is not ejected.
    for _ in 0..3 {
        s.worker_unreachable(WorkerId(1), 80_000);
    }
    assert!(!s.ejected(key(1), 80_000));
    assert!(s.route(80_000, &request(&b, 64, &cached)).is_some());
    // One answer and it is back at once, its count of failures reset.
    s.worker_answered(w0);
    assert!(!s.ejected(key(0), 80_000));
    assert_eq!(s.worker_unreachable(w0, 80_000), None);
    // Off: never ejected.
    let mut off = Scheduler::new(Config {
        ejection: EjectionConfig {
            after_failures: 0,
            ..EjectionConfig::default()
        },
        ..unit_weights()
    })
    .unwrap();
    off.add_worker(key(0), 1000, "m");
    for _ in 0..10 {
        assert_eq!(off.worker_unreachable(w0, 0), None);
    }
}

/// At most `max_ejected_percent` of a model's workers sit out at once (at least one may):
/// when a load spike times every worker out, they are not ejected one after another onto
/// those left. With no bound (100 %), every worker may sit out, and they still serve.
#[test]
fn at_most_half_of_a_model_s_workers_sit_out() {
    let eject = |s: &mut Scheduler, w: u64| {
        for _ in 0..3 {
            s.worker_unreachable(WorkerId(w), 0);
        }
        s.ejected(key(w), 0)
    };
    let mut s = scheduler(PolicyKind::Kv, 4);
    s.add_worker(key(9), 1000, "other");
    assert!(eject(&mut s, 0) && eject(&mut s, 1));
    assert!(!eject(&mut s, 2), "a third of four would pass half");
    // Another model's workers are counted on their own.
    assert!(eject(&mut s, 9), "the one worker of its model may sit out");
    // Once one is back, another may go.
    s.worker_answered(WorkerId(0));
    assert!(eject(&mut s, 3));
    let mut all = Scheduler::new(Config {
        ejection: EjectionConfig {
            max_ejected_percent: 100,
            ..EjectionConfig::default()
        },
        ..unit_weights()
    })
    .unwrap();
    all.add_worker(key(0), 1000, "m");
    all.add_worker(key(1), 1000, "m");
    assert!(eject(&mut all, 0) && eject(&mut all, 1));
    let b = blocks(4, 0);
    assert!(
        all.route(0, &request(&b, 64, &scores(&[]))).is_some(),
        "every worker out, the model is still served"
    );
}

/// A retry leaves out the worker that failed it; it does not then go to an ejected one
/// while that failed worker is healthy (the client gets the healthy worker's error).
#[test]
fn a_retry_never_goes_to_an_ejected_worker_while_another_serves_the_model() {
    let mut s = scheduler(PolicyKind::Kv, 2);
    let b = blocks(4, 0);
    let none = scores(&[]);
    for _ in 0..3 {
        s.worker_unreachable(WorkerId(0), 0);
    }
    let first = s.route(0, &request(&b, 64, &none)).unwrap();
    assert_eq!(first.chosen.key, key(1));
    assert!(
        s.route_excluding(0, &request(&b, 64, &none), &[key(1)])
            .is_none()
    );
}

/// Reachability is the endpoint's: the ranks of a data-parallel worker behind one URL are
/// ejected together.
#[test]
fn the_ranks_of_a_worker_are_ejected_together() {
    let mut s = scheduler(PolicyKind::Kv, 1);
    let rank1 = (WorkerId(0), DpRank(1));
    s.add_worker(rank1, 1000, "m");
    s.add_worker(key(1), 1000, "m");
    assert_eq!(
        s.ranks(WorkerId(0)).collect::<Vec<_>>(),
        vec![key(0), rank1]
    );
    for _ in 0..3 {
        s.worker_unreachable(WorkerId(0), 0);
    }
    assert!(s.ejected(key(0), 0) && s.ejected(rank1, 0));
    assert!(!s.ejected(key(1), 0));
}

/// A worker whose lease lapsed (a NATS outage) while its requests ran on comes back with
/// their load: its bookings outlive its removal, and are booked again when it is re-added.
#[test]
fn a_worker_added_back_carries_the_load_of_its_open_bookings() {
    let mut s = scheduler(PolicyKind::Kv, 1);
    let none = scores(&[]);
    let (a, b) = (blocks(4, 0), blocks(6, 100));
    let first = s.route(0, &request(&a, 64, &none)).unwrap();
    let second = s.route(0, &request(&b, 100, &none)).unwrap();
    s.first_token(first.booking);
    let before = s.load(key(0)).unwrap().clone();
    s.remove_worker(key(0));
    assert!(s.load(key(0)).is_none());
    assert_eq!(s.open_bookings(), 2);
    s.add_worker(key(0), 1000, "m");
    let back = s.load(key(0)).unwrap();
    assert_eq!(back.requests, before.requests);
    assert_eq!(back.decode_blocks(), before.decode_blocks());
    assert!((back.prefill_blocks - before.prefill_blocks).abs() < 1e-9);
    assert!((back.work_tokens - before.work_tokens).abs() < 1e-9);
    // Released as they end, to nothing.
    s.complete(first.booking);
    s.complete(second.booking);
    let empty = s.load(key(0)).unwrap();
    assert_eq!((empty.requests, empty.decode_blocks()), (0, 0));
    assert!(empty.prefill_blocks.abs() < 1e-9 && empty.work_tokens.abs() < 1e-9);
}

/// Each of a request's `n` sequences is expected to generate up to its own `max_tokens`
/// (capped): `n = 8` books eight times one sequence's decode, not one capped total.
#[test]
fn every_sequence_of_a_request_books_its_decode() {
    let s = scheduler(PolicyKind::Kv, 1);
    let b = blocks(4, 0);
    let none = scores(&[]);
    let cap = Config::default().admission.decode_cap_tokens;
    let work = |max_tokens: u32, n: u32| {
        let r = RouteRequest {
            max_tokens,
            n,
            ..request(&b, 64, &none)
        };
        // The queue weighs the uncached prompt (64 tokens here) and the decode.
        (
            s.candidates(0, &r)[0].work.decode_tokens,
            s.queue_work(&r) - 64,
        )
    };
    assert_eq!(work(100, 1), (100, 100));
    assert_eq!(work(100, 8), (800, 800));
    assert_eq!(work(u32::MAX, 8).0, 8 * u64::from(cap));
    assert_eq!(work(100, 0), work(100, 1));
}

/// Round robin takes turns per model: two models alternating on two workers each spread
/// over all four (one counter over both would send each model to one worker only).
#[test]
fn round_robin_takes_turns_within_each_model() {
    let mut s = Scheduler::new(Config {
        policy: PolicyKind::RoundRobin,
        ..unit_weights()
    })
    .unwrap();
    for (w, model) in [(0, "a"), (1, "a"), (2, "b"), (3, "b")] {
        s.add_worker(key(w), 1000, model);
    }
    let b = blocks(4, 0);
    let none = scores(&[]);
    let mut per_worker = [0; 4];
    for i in 0..40 {
        let r = RouteRequest {
            model: if i % 2 == 0 { "a" } else { "b" },
            ..request(&b, 64, &none)
        };
        let d = s.route(i, &r).unwrap();
        per_worker[d.chosen.key.0.0 as usize] += 1;
        s.complete(d.booking);
    }
    assert_eq!(per_worker, [10; 4]);
}
