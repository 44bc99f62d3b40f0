//! Driving the admission queue (DESIGN §13) from the HTTP front door: a request's class
//! (tenant, priority band, session) read from its headers and body. A request that finds
//! nothing waiting and a worker with room is routed at once, with the overlaps its handler
//! already read; any other is queued and waits its turn. One task pumps the queue, admitting
//! queued requests, whenever a request is queued or booked work is released (a first token,
//! a completion) and at every queue deadline; it reads each one's overlaps afresh, with the
//! queue unlocked. A ticket whose client goes away leaves with the handler's guard. Lock
//! order: queue, then scheduler.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, oneshot};

use super::Router;
use super::openai::ApiError;
use super::proxy::Booking;
use crate::indexer::OverlapScores;
use crate::protocol::{BlockHash, SeqHash};
use crate::scheduler::queue::{AdmissionQueue, Left, Ticket, TicketId};
use crate::scheduler::{Admission, Decision, RouteRequest, SessionRef, WorkerKey};

/// Names of the request headers that say who sends a request and how it is to be treated,
/// and of the one that asks for the decision's receipt.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClassHeaders {
    /// The tenant, for fairness within a band (else the API key's, else `default`).
    pub tenant: String,
    /// The priority band, an integer: higher is served first (else the body's `priority`,
    /// vLLM's, lower first, or `service_tier`: `priority` +1, `flex` −1; else 0).
    pub priority: String,
    /// The session: its turns stick to one worker.
    pub session: String,
    /// `hard`: the session's worker only, waiting for room there.
    pub affinity: String,
    /// Any value: the response carries `x-kvroute-receipt` (worker, cached, reachable,
    /// cost).
    pub receipt: String,
    /// Whether the tenant header counts on a request that carries an API key (a gateway in
    /// front sets it); if not, such a request's tenant is its key.
    pub trust_tenant: bool,
    /// Whether a request that carries an API key may ask for a band above 0 (its header,
    /// body `priority` or `service_tier`; a gateway in front decides them). If not, such a
    /// request may lower its band, not raise it: any key could otherwise jump every queue.
    pub trust_priority: bool,
}

impl Default for ClassHeaders {
    fn default() -> Self {
        ClassHeaders {
            tenant: "x-kvroute-tenant".into(),
            priority: "x-kvroute-priority".into(),
            session: "x-kvroute-session".into(),
            affinity: "x-kvroute-affinity".into(),
            receipt: "x-kvroute-receipt".into(),
            trust_tenant: false,
            trust_priority: false,
        }
    }
}

/// Longest tenant or session id accepted, bytes.
pub const MAX_ID_BYTES: usize = 256;

/// Who sent a request and how it is to be treated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Class {
    /// The tenant.
    pub tenant: Arc<str>,
    /// Its band as asked (clamped by the queue).
    pub band: i64,
    /// Its session, and whether affinity is hard.
    pub session: Option<(String, bool)>,
    /// Whether the client asked for the receipt.
    pub receipt: bool,
}

impl Class {
    /// The session's id within its tenant and `model`: two tenants' sessions named alike
    /// (`"1"`) would move each other's turns, and a session whose turns alternate between
    /// two models (served by different workers) would move at every turn, keeping
    /// affinity for neither.
    pub fn scope_session(&mut self, model: &str) {
        if let Some((id, _)) = &mut self.session {
            *id = format!("{}\u{1f}{model}\u{1f}{id}", self.tenant);
        }
    }

    /// Reads the class from the headers (names in `names`), falling back to the body's
    /// `priority` and `service_tier` and, for the tenant, to the API key's
    /// ([`crate::auth::Secret::tenant`]; `key_tenant` is `Some` when the request came with
    /// a key).
    pub fn read(
        names: &ClassHeaders,
        headers: &hyper::HeaderMap,
        key_tenant: Option<&str>,
        body_priority: Option<i64>,
        service_tier: Option<&str>,
    ) -> Result<Class, ApiError> {
        let text = |name: &str| -> Result<Option<&str>, ApiError> {
            let Some(v) = headers.get(name) else {
                return Ok(None);
            };
            let v = v
                .to_str()
                .ok()
                .filter(|v| !v.is_empty() && v.len() <= MAX_ID_BYTES)
                .ok_or_else(|| {
                    ApiError::bad_request(format!(
                        "header {name} must be 1 to {MAX_ID_BYTES} visible ASCII characters"
                    ))
                })?;
            Ok(Some(v))
        };
        let tenant: Arc<str> = match (text(&names.tenant)?, key_tenant) {
            (Some(t), None) => Arc::from(t),
            (Some(t), Some(_)) if names.trust_tenant => Arc::from(t),
            (_, Some(key)) => Arc::from(key),
            (None, None) => Arc::from("default"),
        };
        let band = match text(&names.priority)? {
            Some(v) => v.trim().parse::<i64>().map_err(|_| {
                ApiError::bad_request(format!(
                    "header {} must be an integer band (higher is served first), not {v:?}",
                    names.priority
                ))
            })?,
            None => match (body_priority, service_tier) {
                (Some(p), _) => p.saturating_neg(),
                (None, Some("priority")) => 1,
                (None, Some("flex")) => -1,
                _ => 0,
            },
        };
        let band = match key_tenant {
            Some(_) if !names.trust_priority => band.min(0),
            _ => band,
        };
        let session = text(&names.session)?.map(|s| {
            let hard = headers
                .get(&names.affinity)
                .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"hard"));
            (s.to_owned(), hard)
        });
        Ok(Class {
            tenant,
            band,
            session,
            receipt: headers.contains_key(&names.receipt),
        })
    }
}

/// What the pump needs to route a queued request.
#[derive(Debug)]
pub(super) struct Routable {
    pub model: String,
    pub blocks: Vec<BlockHash>,
    pub prompt_tokens: usize,
    pub block_size: usize,
    pub max_tokens: u32,
    pub n: u32,
    pub session: Option<(String, bool)>,
}

impl Routable {
    pub fn request<'a>(&'a self, overlaps: &'a OverlapScores) -> RouteRequest<'a> {
        RouteRequest {
            model: &self.model,
            blocks: &self.blocks,
            prompt_tokens: self.prompt_tokens,
            block_size: self.block_size,
            overlaps,
            max_tokens: self.max_tokens,
            n: self.n,
            session: self
                .session
                .as_ref()
                .map(|(id, hard)| SessionRef { id, hard: *hard }),
        }
    }
}

/// Why a queued request was not admitted.
#[derive(Debug)]
pub(super) enum Refusal {
    /// Its deadline passed.
    Expired { band: i32, waited_ms: u64 },
    /// Every worker of its model left while it waited.
    NoWorkers,
    /// The router began shutting down: another replica may serve it now.
    ShuttingDown,
    /// It gave its place (and its slot among the requests the router takes at once) to a
    /// request of a higher band that found every slot taken.
    Displaced { band: i32, by: i32 },
}

/// The answer a queued request's handler waits for.
pub(super) type Outcome = Result<(Decision, Booking), Refusal>;

/// A queued request: what to route, and where to send the outcome.
pub(super) struct Waiter {
    pub request: Arc<Routable>,
    pub tx: oneshot::Sender<Outcome>,
    /// The workers it competes for: its model's pool ([`Scheduler::pool_of`]: a LoRA
    /// adapter's requests compete with its base model's).
    pub pool: Arc<str>,
    /// Counts it against its pool while it is queued (until the queue lets it go).
    pub _waiting: ModelWaiting,
}

/// Requests queued, by pool (a model and the adapters served on its workers): a request
/// of a pool none of whose requests waits goes straight to routing, whatever other pools
/// have queued. Entries go with their last request (model names come from clients).
pub(super) type WaitingModels = Arc<parking_lot::Mutex<HashMap<String, usize>>>;

/// One queued request counted against its model; dropping it (the queue lets the request
/// go, however) takes the count back. A leaf lock: taken under the queue's.
pub(super) struct ModelWaiting {
    models: WaitingModels,
    model: String,
}

impl ModelWaiting {
    fn new(models: &WaitingModels, model: &str) -> ModelWaiting {
        *models.lock().entry(model.to_owned()).or_default() += 1;
        ModelWaiting {
            models: Arc::clone(models),
            model: model.to_owned(),
        }
    }
}

impl Drop for ModelWaiting {
    fn drop(&mut self) {
        let mut models = self.models.lock();
        if let Some(n) = models.get_mut(&self.model) {
            *n -= 1;
            if *n == 0 {
                models.remove(&self.model);
            }
        }
    }
}

/// What [`Router::enter`] did with a request.
pub(super) enum Entered<'a> {
    /// Nothing waited ahead and a worker had room: routed and booked.
    Admitted(Box<(Decision, Booking)>),
    /// Queued: the pump answers on `rx` by the band's deadline (`ttl_ms`); dropping `guard`
    /// takes the ticket out of the queue.
    Queued {
        guard: Queued<'a>,
        rx: oneshot::Receiver<Outcome>,
        ttl_ms: u64,
    },
}

/// Removes its ticket from the queue when dropped: the handler's future was dropped (the
/// client went away) or it gave up waiting.
pub(super) struct Queued<'a> {
    pub router: &'a Router,
    pub id: TicketId,
    pub band: i32,
    /// What a removal here means, for the rejection metric.
    pub reason: &'static str,
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        let now = self.router.now_ms();
        if self.router.queue.lock().cancel(now, self.id).is_some() {
            rejected(self.band, self.reason);
        }
    }
}

fn rejected(band: i32, reason: &'static str) {
    metrics::counter!("kvroute_queue_rejected_total", "band" => band.to_string(), "reason" => reason)
        .increment(1);
}

fn waited(band: i32, waited_ms: u64) {
    metrics::histogram!("kvroute_queue_wait_seconds", "band" => band.to_string())
        .record(waited_ms as f64 / 1e3);
}

/// Counts one routing decision in the decision-quality metrics.
pub(super) fn record_decision(d: &Decision) {
    let r = d.receipt;
    metrics::counter!("kvroute_route_decisions_total").increment(1);
    if r.cached_blocks >= r.reachable_blocks {
        metrics::counter!("kvroute_route_optimal_total").increment(1);
    }
    metrics::counter!("kvroute_route_cached_blocks_total").increment(u64::from(r.cached_blocks));
    metrics::counter!("kvroute_route_reachable_blocks_total")
        .increment(u64::from(r.reachable_blocks));
    metrics::counter!("kvroute_route_novel_blocks_total").increment(u64::from(
        r.prompt_blocks.saturating_sub(r.reachable_blocks),
    ));
}

/// Index lookups one pump makes at most (each for a ticket to weigh; a few of those read
/// ahead may turn out held back and go unweighed): bounds its work when the queue is deep.
/// Tickets held back by one that must wait are passed over without a lookup.
const MAX_LOOKAHEAD: usize = 1024;

/// Most overlaps read per round with the queue unlocked: the next tickets in order that
/// nothing holds back yet (some may turn out held back once those before them are
/// weighed). A pump reads one in its first round and twice as many in each next one, up to
/// this: most pumps find the fleet still full (one is run for every request queued) and
/// need one lookup a pool, which can take a few hundred µs for a long prompt; one that
/// finds room for many admits them in a few rounds.
pub(super) const READ_AHEAD: usize = 16;

/// What one pump has learned so far: which tickets are held back, and the overlaps read for
/// tickets not yet weighed.
#[derive(Default)]
struct PumpWalk {
    /// A ticket that must wait holds back the tickets after it that would compete for the
    /// same workers: its pool's (or, with hard affinity, its session's). Tickets of other
    /// pools go past it: their workers may have room.
    blocked_pools: HashSet<Arc<str>>,
    blocked_sessions: HashSet<String>,
    /// Workers whose room goes to a hard-session request waiting for them: a later, smaller
    /// request taking it would keep that one waiting to its deadline.
    reserved: Vec<WorkerKey>,
    /// Overlaps read (outside the queue's lock) for tickets not weighed yet.
    overlaps: HashMap<TicketId, OverlapScores>,
    /// Index lookups done.
    read: usize,
    /// A ticket waits for the fleet's budget: the tickets after it wait too.
    fleet_full: bool,
    /// Tickets looked at, over every walk of the pump.
    visited: usize,
    /// Overlaps to read in the next round.
    ahead: usize,
}

/// What one pump cost.
#[derive(Clone, Copy, Debug)]
pub(super) struct Pumped {
    /// Queued tickets looked at, over all its walks.
    pub visited: usize,
    /// Index lookups made.
    pub read: usize,
}

impl PumpWalk {
    fn holds_back(&self, w: &Waiter) -> bool {
        let r = &w.request;
        self.blocked_pools.contains(&w.pool)
            || r.session
                .as_ref()
                .is_some_and(|(s, hard)| *hard && self.blocked_sessions.contains(s))
    }
}

/// How a walk over the queue ended.
enum Walked {
    /// Nothing more to weigh in this pump.
    Done,
    /// An admission (which charges its tenant and may reorder the rest): walk again.
    Admitted,
    /// These tickets' overlaps are needed before the walk can go on.
    Read(Vec<(TicketId, Arc<Routable>)>),
}

impl Router {
    /// Takes a request in. When nothing waits and a worker has room, it is routed at once
    /// with the overlaps already read; otherwise it is queued (`Err` when its band is full,
    /// or when no worker serves its model). `routable` builds what the pump needs later.
    pub(super) fn enter<'a>(
        &'a self,
        class: &Class,
        request: &RouteRequest<'_>,
        routable: impl FnOnce() -> Routable,
    ) -> Result<Entered<'a>, ApiError> {
        let now = self.now_ms();
        let mut queue = self.queue.lock();
        let pool: Arc<str>;
        let band = queue.config().clamp(class.band);
        let limits = queue.config().band(band);
        let work_tokens = {
            let mut scheduler = self.scheduler.lock();
            pool = Arc::from(scheduler.pool_of(request.model));
            // Behind requests of its own pool only: another model's backlog says nothing
            // of room on this model's workers, but its adapters' (or base model's) does;
            // and behind everything while a request waits for the fleet's budget.
            if !self.fleet_full.load(Ordering::Relaxed)
                && !self.waiting_models.lock().contains_key(&*pool)
            {
                match scheduler.admit_within(now, request, limits.budget_share) {
                    Admission::Routed(decision) => {
                        drop(scheduler);
                        queue.passed(band);
                        record_decision(&decision);
                        waited(band, 0);
                        let booking = Booking::new(self, decision.booking);
                        return Ok(Entered::Admitted(Box::new((decision, booking))));
                    }
                    Admission::NoWorkers => {
                        rejected(band, "no_workers");
                        return Err(ApiError::no_workers());
                    }
                    Admission::Wait => {}
                    // Queued, it holds back every request, as the pump will find.
                    Admission::FleetFull => self.fleet_full.store(true, Ordering::Relaxed),
                }
            }
            scheduler.queue_work(request)
        };
        let ticket = Ticket {
            band,
            tenant: Arc::clone(&class.tenant),
            work_tokens,
        };
        let (tx, rx) = oneshot::channel();
        let waiter = Waiter {
            request: Arc::new(routable()),
            tx,
            _waiting: ModelWaiting::new(&self.waiting_models, &pool),
            pool,
        };
        // Checked under the queue's lock, which the drain's sweep takes after saying so: a
        // request is either swept or refused here, never left to wait out the drain.
        if self.draining.load(Ordering::SeqCst) {
            rejected(band, "shutting_down");
            return Err(ApiError::shutting_down());
        }
        match queue.push(now, ticket, waiter) {
            Ok(id) => Ok(Entered::Queued {
                guard: Queued {
                    router: self,
                    id,
                    band,
                    reason: "cancelled",
                },
                rx,
                ttl_ms: limits.ttl_ms,
            }),
            Err(crate::scheduler::queue::Refused::Full { band, limit }) => {
                rejected(band, "full");
                // A request queued now would wait about as long as the oldest has.
                let retry_after_s = (queue.oldest_wait_ms(band, now) / 1000).clamp(1, 60);
                Err(ApiError::queue_full(band, limit, retry_after_s))
            }
        }
    }

    /// Makes room among the requests the router takes at once for one of `band` that found
    /// every slot taken: the newest request of the lowest band below it leaves the queue
    /// (answered 429), its slot to be this one's. False if none waits below `band`. Queued
    /// requests hold their slots (the limit bounds what the router keeps in memory, prompts'
    /// tokens included); without this, a flood of low-band requests queued up to the limit
    /// turned every higher band's request away before it could be queued ahead of them.
    pub(super) fn displace_for(&self, band: i64) -> bool {
        let now = self.now_ms();
        let mut queue = self.queue.lock();
        let by = queue.config().clamp(band);
        let Some(left) = queue.displace(now, by) else {
            return false;
        };
        drop(queue);
        rejected(left.ticket.band, "displaced");
        let _ = left.payload.tx.send(Err(Refusal::Displaced {
            band: left.ticket.band,
            by,
        }));
        true
    }

    /// Answers every queued request 503 with `Retry-After` (the router is shutting down):
    /// queued, they waited out the drain and their connections closed with no answer when
    /// the process ended, where another replica could have served them at once.
    pub(super) fn refuse_queued(&self) {
        let now = self.now_ms();
        let mut queue = self.queue.lock();
        let ids: Vec<_> = queue.in_order().map(|(id, _, _)| id).collect();
        for id in ids {
            if let Some(left) = queue.cancel(now, id) {
                rejected(left.ticket.band, "shutting_down");
                let _ = left.payload.tx.send(Err(Refusal::ShuttingDown));
            }
        }
    }

    /// Expires what is due, then admits queued requests in order while the fleet has room.
    /// Index lookups, the slow part, run with the queue unlocked, so that requests arriving
    /// meanwhile are not held up; decisions are made with it locked, in queue order.
    pub(super) fn pump(&self) -> Pumped {
        {
            let now = self.now_ms();
            let expired = self.queue.lock().expire(now);
            for Left {
                ticket,
                payload,
                waited_ms,
                ..
            } in expired
            {
                rejected(ticket.band, "deadline");
                let _ = payload.tx.send(Err(Refusal::Expired {
                    band: ticket.band,
                    waited_ms,
                }));
            }
        }
        let mut walk = PumpWalk {
            ahead: 1,
            ..PumpWalk::default()
        };
        let mut seqs: Vec<SeqHash> = Vec::new();
        loop {
            match self.walk_queue(&mut walk) {
                Walked::Done => {
                    return Pumped {
                        visited: walk.visited,
                        read: walk.read,
                    };
                }
                Walked::Admitted => {}
                Walked::Read(tickets) => {
                    walk.ahead = (2 * walk.ahead).min(READ_AHEAD);
                    for (id, routable) in tickets {
                        seqs.clear();
                        seqs.extend(routable.blocks.iter().map(|b| b.seq));
                        let overlaps = self.plane.indexer().find_matches_seq(&seqs);
                        walk.overlaps.insert(id, overlaps);
                        walk.read += 1;
                    }
                }
            }
        }
    }

    /// One walk over the queue in order, locked: weighs each ticket nothing holds back whose
    /// overlaps have been read, up to the first that has none; from there on, only gathers
    /// the tickets whose overlaps to read next. It ends early once every pool with a
    /// ticket waiting is held back: what is left could only be passed over, and under
    /// overload (the queue thousands deep, every worker full) each pump would otherwise
    /// visit all of it with the queue locked.
    fn walk_queue(&self, walk: &mut PumpWalk) -> Walked {
        let now = self.now_ms();
        let mut queue = self.queue.lock();
        #[cfg(test)]
        if self.break_next_walk.swap(false, Ordering::Relaxed) {
            panic!("a broken invariant, with the queue locked (test)");
        }
        let mut to_read: Vec<(TicketId, Arc<Routable>)> = Vec::new();
        // Tickets to take out once the walk lets go of the queue's order: handlers gone,
        // models with no worker left.
        let mut closed: Vec<TicketId> = Vec::new();
        let mut orphaned: Vec<TicketId> = Vec::new();
        // How the walk ended, if not by running out of tickets to weigh.
        enum End {
            FleetFull,
            Admit(TicketId, Box<(Decision, Booking)>),
        }
        let mut ended = None;
        for (id, ticket, waiter) in queue.in_order() {
            walk.visited += 1;
            if walk.holds_back(waiter) {
                continue;
            }
            if waiter.tx.is_closed() {
                // The handler is going; its guard would remove the ticket a moment later.
                closed.push(id);
                continue;
            }
            let overlaps = match walk.overlaps.get(&id) {
                Some(overlaps) if to_read.is_empty() => overlaps,
                Some(_) => continue,
                None => {
                    // A hard session whose worker's room is kept for an earlier request
                    // waits: no worker but its own may take it, and that one takes none
                    // but the earlier. Held back without a lookup (a queue of such turns,
                    // an agent fleet at capacity, cost one lookup each at every pump).
                    if let Some((session, true)) = &waiter.request.session
                        && let Some(worker) = self.scheduler.lock().session_worker(now, session)
                        && walk.reserved.contains(&worker)
                    {
                        walk.blocked_sessions.insert(session.clone());
                        continue;
                    }
                    // Past the lookahead, the walk ends at the first ticket not read.
                    if walk.read + to_read.len() == MAX_LOOKAHEAD {
                        break;
                    }
                    to_read.push((id, Arc::clone(&waiter.request)));
                    if to_read.len() == walk.ahead {
                        break;
                    }
                    continue;
                }
            };
            let share = queue.config().band(ticket.band).budget_share;
            let routable = &waiter.request;
            let request = routable.request(overlaps);
            let mut scheduler = self.scheduler.lock();
            let admission = scheduler.admit_reserving(now, &request, share, &walk.reserved);
            // Held to its session's worker only while that worker may take it, as the
            // decision holds it (one that left, or sits out an ejection, holds nothing).
            let pinned = match &admission {
                Admission::Wait => scheduler.pinned_worker(now, &request),
                _ => None,
            };
            drop(scheduler);
            walk.overlaps.remove(&id);
            match admission {
                // A hard session waiting for its own worker holds back only its later turns,
                // and keeps that worker's room. One whose session has no worker yet (new, or
                // its worker left) waits like any request: for room anywhere, which later
                // requests of its model must not take first.
                Admission::Wait => match (&routable.session, pinned) {
                    (Some((session, true)), Some(worker)) => {
                        walk.blocked_sessions.insert(session.clone());
                        // Once each: the scheduler checks every candidate against the list.
                        if !walk.reserved.contains(&worker) {
                            walk.reserved.push(worker);
                        }
                    }
                    _ => {
                        if walk.blocked_pools.insert(Arc::clone(&waiter.pool))
                            && self.every_waiting_pool_in(&walk.blocked_pools)
                        {
                            break;
                        }
                    }
                },
                Admission::FleetFull => {
                    walk.fleet_full = true;
                    ended = Some(End::FleetFull);
                    break;
                }
                Admission::NoWorkers => orphaned.push(id),
                // Its guard at once: the work below (the other tickets' cancels) runs before
                // the booking reaches its handler, and a panic there (the pump survives one)
                // left a booking nothing would ever release.
                Admission::Routed(decision) => {
                    let booking = Booking::new(self, decision.booking);
                    ended = Some(End::Admit(id, Box::new((decision, booking))));
                    break;
                }
            }
        }
        #[cfg(test)]
        if matches!(ended, Some(End::Admit(..)))
            && self.break_after_routing.swap(false, Ordering::Relaxed)
        {
            panic!("a broken invariant, after routing a ticket (test)");
        }
        for id in closed {
            walk.overlaps.remove(&id);
            if let Some(left) = queue.cancel(now, id) {
                rejected(left.ticket.band, "cancelled");
            }
        }
        for id in orphaned {
            if let Some(left) = queue.cancel(now, id) {
                rejected(left.ticket.band, "no_workers");
                let _ = left.payload.tx.send(Err(Refusal::NoWorkers));
            }
        }
        match ended {
            Some(End::Admit(id, admitted)) => {
                record_decision(&admitted.0);
                let left = queue
                    .admit_waiting(now, id)
                    .expect("invariant: the ticket waits while the queue is locked");
                waited(left.ticket.band, left.waited_ms);
                // A handler gone since the check drops the booking with the message.
                let _ = left.payload.tx.send(Ok(*admitted));
                Walked::Admitted
            }
            // The flag is set with the queue locked, as `enter` sets it: stored after the
            // lock was let go, a pump's `false` could overwrite the `true` of a request
            // queued in between, and smaller requests of other pools would pass it.
            Some(End::FleetFull) => {
                self.fleet_full.store(true, Ordering::Relaxed);
                Walked::Done
            }
            None if to_read.is_empty() => {
                self.fleet_full.store(walk.fleet_full, Ordering::Relaxed);
                Walked::Done
            }
            None => Walked::Read(to_read),
        }
    }

    /// Whether every pool with a request queued is in `blocked` (a leaf lock, under the
    /// queue's).
    fn every_waiting_pool_in(&self, blocked: &HashSet<Arc<str>>) -> bool {
        self.waiting_models
            .lock()
            .keys()
            .all(|pool| blocked.contains(pool.as_str()))
    }

    /// `GET /admin/queues`: every band's depth, limits and counters; the budgets and the
    /// work booked against them; sessions; decision quality.
    pub(super) fn queues_view(&self) -> serde_json::Value {
        let now = self.now_ms();
        let bands = self.queue.lock().view(now);
        let s = self.scheduler.lock();
        let a = s.config().admission;
        let workers: Vec<_> = s
            .workers()
            .map(|(k, l)| serde_json::json!({"worker": k.0, "dp_rank": k.1.0, "booked_work_tokens": l.work_tokens, "requests": l.requests}))
            .collect();
        let d = s.decision_stats();
        serde_json::json!({
            "bands": bands,
            "admission": {
                "worker_budget_tokens": a.worker_budget_tokens,
                "fleet_budget_tokens": a.fleet_budget_tokens,
                "decode_cap_tokens": a.decode_cap_tokens,
                "booked_work_tokens": s.booked_work_tokens(),
                "workers": workers,
            },
            "sessions": s.session_stats(),
            "decisions": {
                "total": d.decisions, "optimal": d.optimal, "cached_blocks": d.cached_blocks,
                "reachable_blocks": d.reachable_blocks, "lost_blocks": d.lost_blocks(),
                "novel_blocks": d.novel_blocks, "regret": d.regret(),
            },
        })
    }

    /// Sets the queue and admission gauges (at scrape time).
    pub(super) fn queue_gauges(&self) {
        let now = self.now_ms();
        let depths = self.queue.lock().depths();
        for (band, depth, max_queued, ttl_ms) in depths {
            let band = band.to_string();
            metrics::gauge!("kvroute_queue_depth", "band" => band.clone()).set(depth as f64);
            metrics::gauge!("kvroute_queue_limit", "band" => band.clone()).set(max_queued as f64);
            metrics::gauge!("kvroute_queue_ttl_seconds", "band" => band).set(ttl_ms as f64 / 1e3);
        }
        let mut s = self.scheduler.lock();
        s.forget_sessions(now);
        let a = s.config().admission;
        metrics::gauge!("kvroute_admission_budget_tokens", "scope" => "worker")
            .set(a.worker_budget_tokens as f64);
        metrics::gauge!("kvroute_admission_budget_tokens", "scope" => "fleet")
            .set(a.fleet_budget_tokens as f64);
        metrics::gauge!("kvroute_admission_booked_tokens").set(s.booked_work_tokens());
        let st = s.session_stats();
        metrics::gauge!("kvroute_sessions").set(st.live as f64);
        metrics::counter!("kvroute_session_turns_total", "outcome" => "started")
            .absolute(st.started);
        metrics::counter!("kvroute_session_turns_total", "outcome" => "stuck").absolute(st.stuck);
        metrics::counter!("kvroute_session_turns_total", "outcome" => "moved").absolute(st.moved);
        metrics::counter!("kvroute_session_turns_total", "outcome" => "yielded")
            .absolute(st.yielded);
        metrics::counter!("kvroute_session_turns_total", "outcome" => "learned")
            .absolute(st.learned);
    }
}

/// Pumps the queue whenever `room` is signalled (a request queued, booked work released)
/// and at least at every queue deadline (and every 100 ms, for workers that join). Ends
/// with the router. The only pump of the router's queue: a pump that panics (a broken
/// invariant) is logged and the next one goes on, rather than leaving every queued
/// request to wait out its deadline (the locks it takes do not poison).
pub(super) async fn drive_queue(router: Weak<Router>, room: Arc<Notify>) {
    loop {
        let wait_ms = {
            let Some(router) = router.upgrade() else {
                return;
            };
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| router.pump())) {
                Ok(Pumped { visited, read }) => {
                    metrics::counter!("kvroute_queue_pump_tickets_visited_total")
                        .increment(visited as u64);
                    metrics::counter!("kvroute_queue_pump_lookups_total").increment(read as u64);
                }
                Err(_) => {
                    metrics::counter!("kvroute_queue_pump_panics_total").increment(1);
                    tracing::error!("the admission queue's pump panicked; pumping again");
                }
            }
            let next = router.queue.lock().next_deadline_ms();
            next.map_or(100, |d| d.saturating_sub(router.now_ms()).clamp(1, 100))
        };
        tokio::select! {
            _ = room.notified() => {}
            _ = tokio::time::sleep(Duration::from_millis(wait_ms)) => {}
        }
    }
}

/// The queue the router holds.
pub(super) type Queue = AdmissionQueue<Waiter>;
