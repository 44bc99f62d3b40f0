use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;

fn ticket(band: i32, tenant: &str, work: u64) -> Ticket {
    Ticket {
        band,
        tenant: Arc::from(tenant),
        work_tokens: work,
    }
}

fn drain(q: &mut AdmissionQueue<u32>, now: u64) -> Vec<u32> {
    let mut out = Vec::new();
    while let Some((id, _, _)) = q.peek() {
        out.push(q.admit(now, id).expect("peeked").payload);
    }
    out
}

#[test]
fn a_higher_band_always_goes_first() {
    let mut q = AdmissionQueue::new(QueueConfig::default());
    q.push(0, ticket(0, "a", 10), 1).unwrap();
    q.push(0, ticket(-1, "a", 10), 2).unwrap();
    q.push(0, ticket(3, "b", 10), 3).unwrap();
    q.push(0, ticket(0, "b", 10), 4).unwrap();
    assert_eq!(drain(&mut q, 1), vec![3, 1, 4, 2]);
}

#[test]
fn tenants_share_a_band_by_tokens_not_requests() {
    let mut q = AdmissionQueue::new(QueueConfig::default());
    // "big" sends 8k-token requests, "small" 1k-token ones, both backlogged from the start.
    for i in 0..10 {
        q.push(0, ticket(0, "big", 8_000), 100 + i).unwrap();
    }
    for i in 0..80 {
        q.push(0, ticket(0, "small", 1_000), i).unwrap();
    }
    let order = drain(&mut q, 1);
    // In the first 18 admissions, each gets about the same tokens: 2 big (16k) and 16 small.
    let big = order[..18].iter().filter(|p| **p >= 100).count();
    assert_eq!(big, 2, "{order:?}");
}

#[test]
fn an_idle_tenant_banks_no_credit() {
    let mut q = AdmissionQueue::new(QueueConfig::default());
    for i in 0..20 {
        q.push(0, ticket(0, "steady", 1_000), i).unwrap();
    }
    for _ in 0..10 {
        let (id, _, _) = q.peek().unwrap();
        q.admit(0, id).unwrap();
    }
    // A tenant that was idle while "steady" got 10k tokens arrives: it alternates with
    // "steady" from here, it does not get 10 turns in a row.
    for i in 0..5 {
        q.push(0, ticket(0, "late", 1_000), 100 + i).unwrap();
    }
    let order = drain(&mut q, 1);
    let late_in_first_four = order[..4].iter().filter(|p| **p >= 100).count();
    assert_eq!(late_in_first_four, 2, "{order:?}");
}

#[test]
fn deadlines_expire_and_full_bands_refuse() {
    let config = QueueConfig {
        bands: BTreeMap::from([(
            1,
            BandConfig {
                max_queued: 2,
                ttl_ms: 100,
                ..BandConfig::default()
            },
        )]),
        ..QueueConfig::default()
    };
    let mut q = AdmissionQueue::new(config);
    q.push(0, ticket(1, "a", 1), 1).unwrap();
    q.push(50, ticket(1, "a", 1), 2).unwrap();
    assert_eq!(
        q.push(60, ticket(1, "b", 1), 3),
        Err(Refused::Full { band: 1, limit: 2 })
    );
    q.push(60, ticket(0, "b", 1), 4).unwrap();
    assert!(q.expire(99).is_empty());
    let gone = q.expire(100);
    assert_eq!(gone.len(), 1);
    assert_eq!((gone[0].payload, gone[0].waited_ms), (1, 100));
    assert_eq!(q.next_deadline_ms(), Some(150));
    let c = q.counters(1);
    assert_eq!((c.queued, c.expired, c.refused_full), (2, 1, 1));
}

#[test]
fn bands_are_clamped_to_the_configured_range() {
    let mut q: AdmissionQueue<u32> = AdmissionQueue::new(QueueConfig::default());
    q.push(0, ticket(i32::MAX, "a", 1), 1).unwrap();
    q.push(0, ticket(i32::MIN, "a", 1), 2).unwrap();
    assert_eq!((q.depth(10), q.depth(-10)), (1, 1));
}

#[test]
fn only_the_offered_ticket_can_be_admitted() {
    let mut q = AdmissionQueue::new(QueueConfig::default());
    let first = q.push(0, ticket(0, "a", 1), 1).unwrap();
    let second = q.push(0, ticket(0, "a", 1), 2).unwrap();
    assert!(q.admit(0, second).is_none());
    assert_eq!(q.admit(0, first).map(|l| l.payload), Some(1));
    assert_eq!(q.cancel(0, second).map(|l| l.payload), Some(2));
    assert!(q.cancel(0, second).is_none());
    assert!(q.is_empty());
    assert!(q.bands.is_empty(), "no band state outlives its tickets");
}

/// The tickets in the order they would go (the first is `peek`'s); one further back can be
/// admitted past the others (a driver skipping a model whose workers are full), charged to
/// its tenant, and the rest keep their order.
#[test]
fn tickets_are_listed_in_order_and_one_can_go_past_the_others() {
    let mut q = AdmissionQueue::new(QueueConfig::default());
    let a1 = q.push(0, ticket(0, "a", 10), 1).unwrap();
    let b1 = q.push(0, ticket(0, "b", 10), 2).unwrap();
    let a2 = q.push(0, ticket(0, "a", 10), 3).unwrap();
    let high = q.push(0, ticket(2, "c", 10), 4).unwrap();
    let order: Vec<TicketId> = q.in_order().map(|(id, _, _)| id).collect();
    assert_eq!(order, vec![high, a1, a2, b1]);
    assert_eq!(q.peek().map(|(id, _, _)| id), Some(high));
    assert_eq!(q.admit_waiting(0, b1).map(|l| l.payload), Some(2));
    assert!(q.admit_waiting(0, b1).is_none());
    assert_eq!(drain(&mut q, 0), vec![4, 1, 3]);
    assert!(q.bands.is_empty());
}

#[derive(Clone, Debug)]
enum Op {
    Push { band: i32, tenant: u8, work: u64 },
    Admit,
    Cancel(usize),
    Advance(u64),
    Displace(i32),
}

/// A request of a higher band takes the place of the lowest band's newest ticket; one of
/// the lowest band waiting, or of a band below every waiting one, takes none.
#[test]
fn the_lowest_band_s_newest_ticket_gives_its_place_to_a_higher_band() {
    let mut q = AdmissionQueue::new(QueueConfig::default());
    let old_low = q.push(0, ticket(-1, "a", 10), 1).unwrap();
    let new_low = q.push(1, ticket(-1, "b", 10), 2).unwrap();
    let mid = q.push(2, ticket(0, "a", 10), 3).unwrap();
    assert!(q.displace(3, -1).is_none(), "not below its own band");
    assert!(q.displace(3, -5).is_none());
    let l = q.displace(3, 0).unwrap();
    assert_eq!((l.id, l.payload, l.waited_ms), (new_low, 2, 2));
    assert_eq!(q.displace(3, 5).unwrap().id, old_low);
    assert_eq!(q.displace(3, 5).unwrap().id, mid);
    assert!(q.displace(3, 5).is_none() && q.is_empty());
    assert_eq!(q.counters[&-1].displaced, 2);
}

/// A tenant that is never backlogged for long (one ticket at a time, sent again as soon as
/// it is admitted) keeps the charge of what it was served: against a backlogged tenant it
/// gets half the tokens, not all of them (its charge was forgotten each time its backlog
/// emptied).
/// Tickets served out of order (another model's, past ones that must wait) do not move the
/// band's virtual time past the tenants still waiting ahead: a tenant arriving then starts
/// level with them, not behind everything the out-of-order ones were charged.
#[test]
fn tickets_served_out_of_order_do_not_push_new_tenants_back() {
    let mut q = AdmissionQueue::new(QueueConfig::default());
    for i in 0..10 {
        q.push(0, ticket(0, "a", 1_000), i).unwrap();
    }
    for i in 0..10 {
        q.push(0, ticket(0, "b", 1_000), 100 + i).unwrap();
    }
    // "a" waits (its model's workers are full) while five of "b"'s go past it.
    for _ in 0..5 {
        let id = q
            .in_order()
            .find(|(_, _, p)| **p >= 100)
            .map(|(id, _, _)| id)
            .unwrap();
        q.admit_waiting(0, id).unwrap();
    }
    q.push(0, ticket(0, "c", 1_000), 200).unwrap();
    let order = drain(&mut q, 1);
    let c = order.iter().position(|p| *p == 200).unwrap();
    assert!(c <= 1, "the new tenant came {c}th: {order:?}");
}

/// A band's oldest wait (what a full band's Retry-After is made of) is its oldest ticket's,
/// across tenants, and moves on as tickets leave.
#[test]
fn the_oldest_wait_is_the_band_s_oldest_ticket_s() {
    let mut q = AdmissionQueue::new(QueueConfig::default());
    q.push(100, ticket(0, "a", 10), 1).unwrap();
    q.push(300, ticket(0, "b", 10), 2).unwrap();
    q.push(500, ticket(0, "a", 10), 3).unwrap();
    q.push(700, ticket(2, "a", 10), 4).unwrap();
    assert_eq!(q.oldest_wait_ms(0, 1_000), 900);
    assert_eq!(q.oldest_wait_ms(2, 1_000), 300);
    assert_eq!(q.oldest_wait_ms(5, 1_000), 0);
    let first = q.in_order().find(|(_, _, p)| **p == 1).unwrap().0;
    q.admit_waiting(1_000, first).unwrap();
    assert_eq!(q.oldest_wait_ms(0, 1_000), 700);
}

#[test]
fn a_tenant_that_keeps_emptying_its_backlog_keeps_its_charge() {
    let mut q = AdmissionQueue::new(QueueConfig {
        default_band: BandConfig {
            max_queued: 10_000,
            ..BandConfig::default()
        },
        ..QueueConfig::default()
    });
    for i in 0..1_000 {
        q.push(0, ticket(0, "steady", 1_000), i).unwrap();
    }
    q.push(0, ticket(0, "eager", 8_000), 100_000).unwrap();
    let mut served: BTreeMap<&str, u64> = BTreeMap::new();
    for _ in 0..400 {
        let (id, _, _) = q.peek().unwrap();
        let left = q.admit(0, id).unwrap();
        let eager = left.payload >= 100_000;
        *served
            .entry(if eager { "eager" } else { "steady" })
            .or_default() += left.ticket.work_tokens;
        if eager {
            q.push(0, ticket(0, "eager", 8_000), left.payload + 1)
                .unwrap();
        }
    }
    let (eager, steady) = (served["eager"], served["steady"]);
    assert!(
        eager.abs_diff(steady) <= 8_000,
        "eager {eager}, steady {steady}"
    );
}

/// The charges of tenants whose backlog emptied are bounded while the band's level stands
/// still: a tenant held back at the front (its model's workers full) keeps it there, and a
/// stream of tenants named by clients served past it would each be remembered until it
/// moved.
#[test]
fn idle_tenants_are_bounded_while_the_level_stands_still() {
    let mut q = AdmissionQueue::new(QueueConfig::default());
    q.push(0, ticket(0, "held", 1_000), 0).unwrap();
    for i in 1..=(MAX_IDLE_TENANTS as u32 + 5_000) {
        let id = q.push(0, ticket(0, &format!("client-{i}"), 10), i).unwrap();
        q.admit_waiting(0, id).unwrap();
    }
    let band = &q.bands[&std::cmp::Reverse(0)];
    assert_eq!(band.level, 0, "the held tenant keeps the level");
    assert_eq!(band.idle.len(), MAX_IDLE_TENANTS);
    assert_eq!(band.idle_tag.len(), MAX_IDLE_TENANTS);
    // The held tenant still goes first.
    assert_eq!(q.peek().map(|(_, _, p)| *p), Some(0));
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (-2i32..=2, 0u8..4, 1u64..5_000).prop_map(|(band, tenant, work)| Op::Push { band, tenant, work }),
        3 => Just(Op::Admit),
        1 => any::<usize>().prop_map(Op::Cancel),
        1 => (0u64..40).prop_map(Op::Advance),
        1 => (-2i32..=3).prop_map(Op::Displace),
    ]
}

proptest! {
    /// Every ticket leaves exactly once (admitted, cancelled or expired) or is still there;
    /// an admitted ticket's band is never below one still waiting; state shrinks to nothing.
    #[test]
    fn prop_no_ticket_is_lost_or_served_twice(ops in proptest::collection::vec(op(), 1..300)) {
        let config = QueueConfig {
            default_band: BandConfig { max_queued: 20, ttl_ms: 100, ..BandConfig::default() },
            ..QueueConfig::default()
        };
        let mut q = AdmissionQueue::new(config);
        let mut now = 0u64;
        let mut waiting: BTreeMap<TicketId, i32> = BTreeMap::new();
        let mut left: BTreeMap<TicketId, &'static str> = BTreeMap::new();
        let mut seen = 0u64;
        for op in ops {
            match op {
                Op::Push { band, tenant, work } => {
                    seen += 1;
                    if let Ok(id) = q.push(now, ticket(band, &format!("t{tenant}"), work), seen) {
                        prop_assert!(waiting.insert(id, band).is_none());
                    }
                }
                Op::Admit => {
                    if let Some((id, t, _)) = q.peek() {
                        let band = t.band;
                        prop_assert!(waiting.values().all(|b| *b <= band), "a higher band waits");
                        let l = q.admit(now, id).expect("the offered ticket");
                        prop_assert!(left.insert(l.id, "admitted").is_none());
                        waiting.remove(&l.id);
                    } else {
                        prop_assert!(waiting.is_empty());
                    }
                }
                Op::Cancel(i) => {
                    if let Some(id) = waiting.keys().nth(i % waiting.len().max(1)).copied() {
                        let l = q.cancel(now, id).expect("a waiting ticket");
                        prop_assert!(left.insert(l.id, "cancelled").is_none());
                        waiting.remove(&id);
                    }
                }
                Op::Displace(band) => {
                    let lowest = waiting.iter().map(|(id, b)| (*b, std::cmp::Reverse(*id))).min();
                    match q.displace(now, band) {
                        Some(l) => {
                            // The newest ticket of the lowest band, which is below `band`.
                            let (b, std::cmp::Reverse(id)) = lowest.expect("a ticket waited");
                            prop_assert!(b < band && l.id == id, "displaced {:?}, not {id:?}", l.id);
                            prop_assert!(left.insert(l.id, "displaced").is_none());
                            waiting.remove(&l.id);
                        }
                        None => prop_assert!(lowest.is_none_or(|(b, _)| b >= band)),
                    }
                }
                Op::Advance(ms) => {
                    now += ms;
                    for l in q.expire(now) {
                        prop_assert!(l.waited_ms >= 100, "expired before its deadline");
                        prop_assert!(left.insert(l.id, "expired").is_none());
                        prop_assert!(waiting.remove(&l.id).is_some());
                    }
                }
            }
            prop_assert_eq!(q.len(), waiting.len());
        }
        for l in q.expire(u64::MAX) {
            prop_assert!(waiting.remove(&l.id).is_some());
        }
        prop_assert!(waiting.is_empty());
        prop_assert!(q.bands.is_empty() && q.deadlines.is_empty() && q.entries.is_empty());
    }

    /// Tenants backlogged from the same moment: at every admission, what any two have been
    /// served differs by at most the largest request's work.
    #[test]
    fn prop_a_band_shares_work_within_one_request(
        tenants in proptest::collection::vec(proptest::collection::vec(1u64..10_000, 5..40), 2..6),
        interleave in any::<u64>(),
    ) {
        let mut q = AdmissionQueue::new(QueueConfig::default());
        let max_work = tenants.iter().flatten().copied().max().unwrap_or(0);
        // Push in an interleaving drawn from the seed: arrival order must not matter.
        let mut cursors = vec![0usize; tenants.len()];
        let mut rng = crate::scheduler::Rng::new(interleave);
        let total: usize = tenants.iter().map(Vec::len).sum();
        for _ in 0..total {
            let open: Vec<usize> = (0..tenants.len()).filter(|t| cursors[*t] < tenants[*t].len()).collect();
            let t = open[rng.below(open.len())];
            q.push(0, ticket(0, &format!("t{t}"), tenants[t][cursors[t]]), t).unwrap();
            cursors[t] += 1;
        }
        let mut served = vec![0u64; tenants.len()];
        let mut remaining: Vec<usize> = tenants.iter().map(Vec::len).collect();
        while let Some((id, t, _)) = q.peek() {
            let work = t.work_tokens;
            let l = q.admit(1, id).unwrap();
            served[l.payload] += work;
            remaining[l.payload] -= 1;
            if remaining.iter().all(|r| *r > 0) {
                let (lo, hi) = (served.iter().min().unwrap(), served.iter().max().unwrap());
                prop_assert!(hi - lo <= max_work, "served {served:?}, largest request {max_work}");
            }
        }
    }

    /// Bands are strict whatever the arrival order: everything of band b leaves before
    /// anything of a lower band, when all are queued at once.
    #[test]
    fn prop_a_band_never_starves_a_higher_one(pushes in proptest::collection::vec((-3i32..=3, 0u8..3, 1u64..100), 1..100)) {
        let mut q = AdmissionQueue::new(QueueConfig::default());
        for (i, (band, tenant, work)) in pushes.iter().enumerate() {
            q.push(0, ticket(*band, &format!("t{tenant}"), *work), i as u32).unwrap();
        }
        let bands: Vec<i32> = drain(&mut q, 1).into_iter().map(|i| pushes[i as usize].0).collect();
        prop_assert!(bands.windows(2).all(|w| w[0] >= w[1]), "{bands:?}");
    }
}

/// The gauges' O(bands) depths agree with the whole view's.
#[test]
fn depths_agree_with_the_view() {
    let mut q = AdmissionQueue::new(QueueConfig::default());
    for i in 0..30 {
        q.push(
            0,
            ticket(i % 3 - 1, ["a", "b"][i as usize % 2], 10),
            i as u32,
        )
        .unwrap();
    }
    let (id, _, _) = q.peek().unwrap();
    q.admit(1, id).unwrap();
    let view: Vec<(i32, usize, usize, u64)> = q
        .view(2)
        .into_iter()
        .map(|b| (b.band, b.depth, b.max_queued, b.ttl_ms))
        .collect();
    assert_eq!(view.len(), 3);
    assert_eq!(q.depths(), view);
}
