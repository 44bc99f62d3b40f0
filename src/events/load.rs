//! Router replicas share their bookings on `kvroute.<cluster>.load` (DESIGN §5), so each
//! replica's scheduler sees the whole fleet's load, not just what it routed itself.
//!
//! A replica's updates are coalesced: the first one after a quiet spell starts a `flush_ms`
//! window, and everything booked, started or completed in it goes out as JSON arrays of
//! operations, each message under the server's `max_payload`. The outbox is bounded: past
//! `max_pending` operations it sheds bookings and first tokens first and completions last
//! (counted). Every heartbeat names the replica's open bookings, so peers drop whatever it no
//! longer holds, however the completion was lost, and ask for whatever they lack (a replica
//! that started after the booking was announced, one that dropped them while the replica was
//! silent, a booking shed on the way): the replica announces those again, each at most once
//! per `replica_ttl_ms`. A replica silent for `replica_ttl_ms` loses all its bookings; and
//! every booking also has the scheduler's own TTL. Peers' bookings are validated before they
//! are booked.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::{Mutex, MutexGuard};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::time::Instant;

use super::transport::{Transport, TransportError};
use crate::scheduler::{BookingId, Scheduler, SharedBooking};

/// Subject replicas share load on.
pub fn load_subject(cluster: &str) -> String {
    format!("kvroute.{cluster}.load")
}

/// Timing and bounds of load sharing.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoadShareConfig {
    /// A replica announces itself (and its open bookings) this often, ms.
    pub heartbeat_ms: u64,
    /// A replica silent this long is gone: its bookings are dropped, ms.
    pub replica_ttl_ms: u64,
    /// Updates are gathered this long into one message, ms (0: one message per update).
    pub flush_ms: u64,
    /// Most operations waiting to be published; beyond, the oldest are shed (completions
    /// last: peers also learn of them from the next heartbeat).
    pub max_pending: usize,
}

impl Default for LoadShareConfig {
    fn default() -> Self {
        LoadShareConfig {
            heartbeat_ms: 1_000,
            replica_ttl_ms: 5_000,
            flush_ms: 2,
            max_pending: 16_384,
        }
    }
}

/// One operation; a message on the load subject is a JSON array of them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum LoadMessage {
    /// A booking a replica made.
    Book {
        /// The booking.
        booking: SharedBooking,
    },
    /// A booking's first token.
    FirstToken {
        /// The booking.
        id: BookingId,
    },
    /// A booking's completion.
    Complete {
        /// The booking.
        id: BookingId,
    },
    /// A replica is alive, and holds exactly these bookings among those numbered below `next`.
    Heartbeat {
        /// The replica.
        replica: u64,
        /// Its open bookings' numbers, as inclusive ranges (sorted).
        #[serde(default)]
        open: Vec<(u64, u64)>,
        /// Bookings numbered from here on are newer than this heartbeat.
        #[serde(default)]
        next: u64,
    },
    /// A replica lacks some bookings another one's heartbeat named open, and asks it to
    /// announce them again. Always sent in a message of its own: a replica of a version
    /// without it refuses the whole message it comes in.
    Want {
        /// The replica asking.
        replica: u64,
        /// The replica whose bookings they are.
        from: u64,
        /// Their numbers, as inclusive ranges (sorted).
        open: Vec<(u64, u64)>,
    },
}

impl LoadMessage {
    /// What applying it costs, in booked blocks (each operation at least one; a
    /// heartbeat one more per range of open bookings it names).
    fn work(&self) -> usize {
        1 + match self {
            LoadMessage::Book { booking } => booking.blocks.len(),
            LoadMessage::Heartbeat { open, .. } | LoadMessage::Want { open, .. } => open.len(),
            LoadMessage::FirstToken { .. } | LoadMessage::Complete { .. } => 0,
        }
    }

    fn origin(&self) -> u64 {
        match self {
            LoadMessage::Book { booking } => booking.id.origin,
            LoadMessage::FirstToken { id } | LoadMessage::Complete { id } => id.origin,
            LoadMessage::Heartbeat { replica, .. } | LoadMessage::Want { replica, .. } => *replica,
        }
    }
}

/// Most ranges of missing bookings one [`LoadMessage::Want`] asks for (about 40 KiB).
pub const MAX_WANT_RANGES: usize = 1024;

/// Longest a flush waits for the NATS client to take one message (it stops taking them
/// while it reconnects).
const PUBLISH_WAIT: Duration = Duration::from_secs(1);

/// Largest load message accepted, bytes (a flush never exceeds the server's max_payload).
pub const MAX_LOAD_MESSAGE_BYTES: usize = 8 << 20;

/// Decodes one load message (a JSON array of operations).
pub fn decode_load(payload: &[u8]) -> Result<Vec<LoadMessage>, serde_json::Error> {
    if payload.len() > MAX_LOAD_MESSAGE_BYTES {
        return Err(serde::de::Error::custom(format!(
            "load message of {} bytes is over {MAX_LOAD_MESSAGE_BYTES}",
            payload.len()
        )));
    }
    serde_json::from_slice(payload)
}

/// Operations waiting to be published: bounded, shedding the least harmful first. Queuing
/// and shedding cost O(1) however full it is (it is fed on every request's path).
#[derive(Debug)]
pub struct Outbox {
    /// Bookings and first tokens: shed first, oldest first. Each with its place in the
    /// order operations were queued (a peer must see a booking before its completion).
    sheddable: VecDeque<(u64, LoadMessage)>,
    /// Completions and heartbeats: shed only when nothing else is pending.
    kept: VecDeque<(u64, LoadMessage)>,
    next: u64,
    max: usize,
    shed: u64,
}

impl Outbox {
    /// An empty outbox for at most `max` operations.
    pub fn new(max: usize) -> Self {
        Outbox {
            sheddable: VecDeque::new(),
            kept: VecDeque::new(),
            next: 0,
            max: max.max(1),
            shed: 0,
        }
    }

    /// Queues an operation. At the bound, the oldest booking or first token goes (a peer
    /// that misses it under-counts one request for a while); only if there is none does the
    /// oldest completion go (the next heartbeat carries it anyway). Returns whether it was
    /// the first one pending (the flusher must be woken).
    pub fn push(&mut self, op: LoadMessage) -> bool {
        if self.len() >= self.max {
            if self.sheddable.pop_front().is_none() {
                self.kept.pop_front();
            }
            self.shed += 1;
            metrics::counter!("kvroute_load_shed_total").increment(1);
        }
        let place = self.next;
        self.next += 1;
        match op {
            LoadMessage::Complete { .. } | LoadMessage::Heartbeat { .. } => {
                self.kept.push_back((place, op));
            }
            LoadMessage::Book { .. }
            | LoadMessage::FirstToken { .. }
            | LoadMessage::Want { .. } => {
                self.sheddable.push_back((place, op));
            }
        }
        self.len() == 1
    }

    /// Operations shed so far.
    pub fn shed(&self) -> u64 {
        self.shed
    }

    /// Operations pending.
    pub fn len(&self) -> usize {
        self.sheddable.len() + self.kept.len()
    }

    /// Whether nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Everything pending, in the order it was queued.
    fn drain(&mut self) -> Vec<LoadMessage> {
        let mut out = Vec::with_capacity(self.len());
        let (mut a, mut b) = (
            self.sheddable.drain(..).peekable(),
            self.kept.drain(..).peekable(),
        );
        loop {
            let next = match (a.peek(), b.peek()) {
                (Some((x, _)), Some((y, _))) => {
                    if x < y {
                        a.next()
                    } else {
                        b.next()
                    }
                }
                (Some(_), None) => a.next(),
                (None, _) => b.next(),
            };
            match next {
                Some((_, op)) => out.push(op),
                None => return out,
            }
        }
    }

    /// Takes everything pending as payloads of at most `max_payload` bytes each, in order,
    /// asks for bookings ([`LoadMessage::Want`]) in payloads of their own after the rest.
    /// An operation too large for any message alone (a booking of a huge prompt) is shed.
    pub fn drain_payloads(&mut self, max_payload: usize) -> Vec<Bytes> {
        let (wants, rest): (Vec<LoadMessage>, Vec<LoadMessage>) = self
            .drain()
            .into_iter()
            .partition(|op| matches!(op, LoadMessage::Want { .. }));
        let mut payloads = self.pack(rest, max_payload);
        payloads.extend(self.pack(wants, max_payload));
        payloads
    }

    /// `ops` as JSON arrays of at most `max_payload` bytes each, in order.
    fn pack(&mut self, ops: Vec<LoadMessage>, max_payload: usize) -> Vec<Bytes> {
        let mut payloads = Vec::new();
        let mut current: Vec<u8> = Vec::new();
        for op in ops {
            // `[` + op + `]` must fit alone.
            let Some(encoded) = encode_within(op, max_payload.saturating_sub(2)) else {
                self.shed += 1;
                metrics::counter!("kvroute_load_shed_total").increment(1);
                continue;
            };
            if !current.is_empty() && current.len() + 1 + encoded.len() + 1 > max_payload {
                current.push(b']');
                payloads.push(Bytes::from(std::mem::take(&mut current)));
            }
            current.push(if current.is_empty() { b'[' } else { b',' });
            current.extend_from_slice(&encoded);
        }
        if !current.is_empty() {
            current.push(b']');
            payloads.push(Bytes::from(current));
        }
        payloads
    }
}

/// An operation as JSON of at most `max` bytes. A booking over it (a long prompt at a small
/// block size: a block is up to 21 bytes, so 1 MiB holds about 50,000) goes with as many of
/// its first blocks as fit: its load and work whole, only the prefix credit of its later
/// blocks lost; shedding it hid the heaviest requests from every peer. `None` if nothing
/// fits.
fn encode_within(op: LoadMessage, max: usize) -> Option<Vec<u8>> {
    let encoded = serde_json::to_vec(&op).expect("invariant: load messages serialize");
    if encoded.len() <= max {
        return Some(encoded);
    }
    let LoadMessage::Book { mut booking } = op else {
        return None;
    };
    // Everything but the blocks, plus at most 21 bytes a block kept
    // ("18446744073709551615,").
    let blocks = std::mem::take(&mut booking.blocks);
    booking.tail = false;
    let rest = serde_json::to_vec(&LoadMessage::Book {
        booking: booking.clone(),
    })
    .expect("invariant: load messages serialize")
    .len();
    let keep = max.checked_sub(rest)? / 21;
    booking.blocks = blocks;
    booking.blocks.truncate(keep);
    metrics::counter!("kvroute_load_truncated_total").increment(1);
    let encoded = serde_json::to_vec(&LoadMessage::Book { booking })
        .expect("invariant: load messages serialize");
    (encoded.len() <= max).then_some(encoded)
}

/// The operations of a peer's message still to apply ([`Peers::take`]).
#[derive(Debug, Default)]
pub struct Incoming {
    /// The replica applying them.
    me: u64,
    ops: VecDeque<LoadMessage>,
}

impl Incoming {
    /// Operations left.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether none is left.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Whether applying them may free room on a worker.
    pub fn frees(&self) -> bool {
        self.ops.iter().any(|op| {
            matches!(
                op,
                LoadMessage::FirstToken { .. }
                    | LoadMessage::Complete { .. }
                    | LoadMessage::Heartbeat { .. }
            )
        })
    }
}

/// Work the replica's reader does for its peers' messages per hold of the scheduler's lock
/// ([`Peers::apply`]): about 120 µs of bookings (a booked block costs ~60 ns; measured on a
/// 2-core EPYC VM, release build).
pub const APPLY_BUDGET: usize = 2_048;

/// Most other replicas one replica follows at once; operations from further ones are
/// refused (counted in `kvroute_load_rejected_total`).
pub const MAX_PEERS: usize = 1024;

/// The other replicas, as one replica sees them (no I/O: `now_ms` is given).
#[derive(Debug)]
pub struct Peers {
    seen: HashMap<u64, u64>,
    /// This replica's bookings announced again on a peer's ask, by number: when (each goes
    /// again at most once per `resend_ms`; forgotten after that).
    resent: HashMap<u64, u64>,
    resend_ms: u64,
    /// Operations to publish: asks for missing bookings, bookings announced again.
    outgoing: Vec<LoadMessage>,
}

impl Default for Peers {
    fn default() -> Self {
        Peers::new(LoadShareConfig::default().replica_ttl_ms)
    }
}

impl Peers {
    /// No peer known yet; a booking asked for is announced again at most once per
    /// `resend_ms` (a peer that keeps refusing it, say for a worker it does not know, keeps
    /// asking on every heartbeat).
    pub fn new(resend_ms: u64) -> Peers {
        Peers {
            seen: HashMap::new(),
            resent: HashMap::new(),
            resend_ms,
            outgoing: Vec::new(),
        }
    }

    /// What applying peers' messages gave this replica to publish, taken.
    pub fn take_outgoing(&mut self) -> Vec<LoadMessage> {
        std::mem::take(&mut self.outgoing)
    }

    /// Applies one message's operations from peers (this replica's own echoes are skipped)
    /// in one go. The replica's reader applies a message in parts instead
    /// ([`Peers::take`], [`Peers::apply`]), letting routing in between.
    pub fn on_message(
        &mut self,
        now_ms: u64,
        me: u64,
        ops: Vec<LoadMessage>,
        scheduler: &mut Scheduler,
    ) {
        let mut incoming = Peers::take(me, ops);
        while self.apply(now_ms, &mut incoming, scheduler, usize::MAX) {}
    }

    /// A message's operations still to apply: this replica's own echoes left out, and of
    /// each replica's heartbeats only its last (the freshest). A heartbeat costs a scan of
    /// the scheduler's bookings under its lock, and a 1 MiB message holds ~35,000 of them.
    pub fn take(me: u64, ops: Vec<LoadMessage>) -> Incoming {
        let mut last_beat: HashMap<u64, usize> = HashMap::new();
        for (at, op) in ops.iter().enumerate() {
            if let LoadMessage::Heartbeat { replica, .. } = op {
                last_beat.insert(*replica, at);
            }
        }
        let ops: VecDeque<LoadMessage> = ops
            .into_iter()
            .enumerate()
            .filter(|(at, op)| {
                let origin = op.origin();
                origin != me
                    && (!matches!(op, LoadMessage::Heartbeat { .. })
                        || last_beat.get(&origin) == Some(at))
            })
            .map(|(_, op)| op)
            .collect();
        Incoming { me, ops }
    }

    /// Applies operations from the front of `incoming` until their work passes `budget`
    /// (blocks booked, plus one an operation; at least one operation is applied). Returns
    /// whether any are left. A peer's message of 8 MiB (the most accepted) took 54 ms of
    /// the scheduler's lock in one go, every route waiting behind it.
    pub fn apply(
        &mut self,
        now_ms: u64,
        incoming: &mut Incoming,
        scheduler: &mut Scheduler,
        budget: usize,
    ) -> bool {
        let mut spent = 0usize;
        while spent < budget {
            let Some(op) = incoming.ops.pop_front() else {
                return false;
            };
            spent = spent.saturating_add(op.work());
            let origin = op.origin();
            if !self.seen.contains_key(&origin) && self.seen.len() >= MAX_PEERS {
                // Replica ids beyond any real deployment: a fault or a forgery, whose every
                // id would otherwise be kept, then dropped with a warning each, a TTL later.
                metrics::counter!("kvroute_load_rejected_total").increment(1);
                continue;
            }
            self.seen.insert(origin, now_ms);
            match op {
                LoadMessage::Book { booking } => {
                    if let Err(e) = scheduler.book_shared(now_ms, booking) {
                        metrics::counter!("kvroute_load_rejected_total").increment(1);
                        tracing::debug!(replica = origin, error = %e, "refusing a peer's booking");
                    }
                }
                LoadMessage::FirstToken { id } => scheduler.first_token(id),
                LoadMessage::Complete { id } => scheduler.complete(id),
                LoadMessage::Heartbeat { open, next, .. } => {
                    let dropped = scheduler.reconcile_origin(origin, &open, next, now_ms);
                    if dropped > 0 {
                        metrics::counter!("kvroute_load_reconciled_total")
                            .increment(dropped as u64);
                        tracing::debug!(
                            replica = origin,
                            dropped,
                            "dropped peer bookings it no longer holds"
                        );
                    }
                    let missing = scheduler.missing_from(origin, &open, next, MAX_WANT_RANGES);
                    if !missing.is_empty() {
                        self.outgoing.push(LoadMessage::Want {
                            replica: incoming.me,
                            from: origin,
                            open: missing,
                        });
                    }
                }
                LoadMessage::Want { from, open, .. } => {
                    if from == incoming.me {
                        self.resend(now_ms, incoming.me, &open, scheduler);
                    }
                }
            }
        }
        !incoming.ops.is_empty()
    }

    /// Announces again this replica's open bookings among `wanted` (number ranges a peer
    /// lacks), each at most once per `resend_ms`; one past its first token with its first
    /// token after it, as it was announced the first time.
    fn resend(&mut self, now_ms: u64, me: u64, wanted: &[(u64, u64)], scheduler: &Scheduler) {
        let wanted = crate::scheduler::normalized_ranges(wanted);
        for seq in scheduler.open_seqs(me) {
            if !crate::scheduler::in_ranges(&wanted, seq) {
                continue;
            }
            if self
                .resent
                .get(&seq)
                .is_some_and(|sent| now_ms.saturating_sub(*sent) < self.resend_ms)
            {
                continue;
            }
            let id = BookingId { origin: me, seq };
            if let Some(booking) = scheduler.shared(id) {
                self.resent.insert(seq, now_ms);
                self.outgoing.push(LoadMessage::Book { booking });
                if scheduler.started(id) {
                    self.outgoing.push(LoadMessage::FirstToken { id });
                }
                metrics::counter!("kvroute_load_resent_total").increment(1);
            }
        }
    }

    /// This replica cannot hear its peers (its own NATS connection is down): their silence
    /// says nothing, and each gets a whole TTL from now once it can be heard again.
    pub fn renew_all(&mut self, now_ms: u64) {
        for at in self.seen.values_mut() {
            *at = (*at).max(now_ms);
        }
    }

    /// Replicas silent for longer than `ttl_ms` are forgotten with their bookings; peers'
    /// bookings past the booking TTL expire (a replica that routes nothing expires them
    /// nowhere else, and their age queue would grow with every booking its peers make).
    pub fn on_tick(&mut self, now_ms: u64, ttl_ms: u64, scheduler: &mut Scheduler) {
        scheduler.expire(now_ms);
        let resend_ms = self.resend_ms;
        self.resent
            .retain(|_, sent| now_ms.saturating_sub(*sent) < resend_ms);
        let gone: Vec<u64> = self
            .seen
            .iter()
            .filter(|(_, at)| now_ms.saturating_sub(**at) > ttl_ms)
            .map(|(r, _)| *r)
            .collect();
        for replica in gone {
            self.seen.remove(&replica);
            let dropped = scheduler.drop_origin(replica);
            tracing::warn!(
                replica,
                dropped,
                "router replica went silent; its bookings are dropped"
            );
        }
    }

    /// Replicas heard from recently.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    /// Whether no peer is known.
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}

/// Open booking numbers as inclusive ranges.
fn ranges(seqs: &[u64]) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &s in seqs {
        match out.last_mut() {
            Some((_, end)) if *end + 1 == s => *end = s,
            _ => out.push((s, s)),
        }
    }
    out
}

/// Merges the closest ranges until at most `max` remain: the heartbeat then claims a few
/// closed bookings as open (peers keep them until their completion or TTL), never the
/// reverse. Merging two neighbours leaves the other gaps as they were, so this closes the
/// `len - max` smallest gaps (the earlier of equal ones first) in one pass.
fn coarsen(r: Vec<(u64, u64)>, max: usize) -> Vec<(u64, u64)> {
    let excess = r.len().saturating_sub(max.max(1));
    if excess == 0 {
        return r;
    }
    let mut gaps: Vec<(u64, usize)> = r
        .windows(2)
        .enumerate()
        .map(|(i, w)| (w[1].0 - w[0].1, i))
        .collect();
    gaps.select_nth_unstable(excess - 1);
    let mut close = vec![false; r.len()];
    for &(_, i) in &gaps[..excess] {
        close[i] = true;
    }
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(r.len() - excess);
    let mut merging = false;
    for (i, range) in r.into_iter().enumerate() {
        match out.last_mut() {
            Some(last) if merging => last.1 = range.1,
            _ => out.push(range),
        }
        merging = close[i];
    }
    out
}

/// A replica's side of load sharing.
#[derive(Clone)]
pub struct LoadShare {
    transport: Transport,
    subject: String,
    scheduler: Arc<Mutex<Scheduler>>,
    outbox: Arc<Mutex<Outbox>>,
    /// Wakes the flusher when the outbox stops being empty.
    wake: Arc<tokio::sync::Notify>,
    /// Notified when a peer's message may have freed room on a worker (a first token, a
    /// completion, a heartbeat dropping bookings): the router's admission queue waits on
    /// it, so requests queued for room a peer frees go at once, not at its next poll.
    freed: Arc<tokio::sync::Notify>,
}

impl LoadShare {
    /// Subscribes to the other replicas' bookings and starts announcing this one. Runs until
    /// `shutdown` turns true.
    pub async fn start(
        transport: Transport,
        cluster: &str,
        scheduler: Arc<Mutex<Scheduler>>,
        config: LoadShareConfig,
        mut shutdown: watch::Receiver<bool>,
    ) -> Result<LoadShare, TransportError> {
        let subject = load_subject(cluster);
        let mut subscription = transport.subscribe(&subject).await?;
        transport.synced().await;
        let me = scheduler.lock().config().replica_id;
        let share = LoadShare {
            transport,
            subject,
            scheduler,
            outbox: Arc::new(Mutex::new(Outbox::new(config.max_pending))),
            wake: Arc::default(),
            freed: Arc::default(),
        };
        let flusher = share.clone();
        let mut stop = shutdown.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = flusher.wake.notified() => {}
                    _ = stop.changed() => return,
                }
                let flush = async {
                    if config.flush_ms > 0 {
                        tokio::time::sleep(Duration::from_millis(config.flush_ms)).await;
                    }
                    flusher.flush().await;
                };
                tokio::select! {
                    () = flush => {}
                    _ = stop.changed() => return,
                }
            }
        });
        let s = share.clone();
        tokio::spawn(async move {
            let start = Instant::now();
            let now_ms = || start.elapsed().as_millis() as u64;
            let mut peers = Peers::new(config.replica_ttl_ms);
            let mut beat =
                tokio::time::interval(Duration::from_millis(config.heartbeat_ms.max(10)));
            loop {
                tokio::select! {
                    message = subscription.next() => {
                        let Some(message) = message else {
                            tracing::error!("the load subscription ended: peers' load is no longer seen");
                            return;
                        };
                        let ops = match decode_load(&message.payload) {
                            Ok(ops) => ops,
                            Err(e) => {
                                metrics::counter!("kvroute_load_malformed_total").increment(1);
                                tracing::warn!(error = %e, "ignoring malformed load message");
                                continue;
                            }
                        };
                        // In parts, letting routes that wait for the scheduler in
                        // between (`bump` hands the lock to a waiting thread, if any).
                        let mut incoming = Peers::take(me, ops);
                        let frees = incoming.frees();
                        // What it answers (bookings announced again) is queued before the
                        // lock goes, at every hand-over too: a booking the ingress completes
                        // meanwhile queues its completion after it. Queued once the lock had
                        // gone, a `Book` could follow its own `Complete`, and peers held a
                        // booking that no longer runs until the next heartbeat.
                        {
                            let mut scheduler = s.scheduler.lock();
                            loop {
                                let now = now_ms();
                                let more =
                                    peers.apply(now, &mut incoming, &mut scheduler, APPLY_BUDGET);
                                for op in peers.take_outgoing() {
                                    s.send(op);
                                }
                                if !more {
                                    break;
                                }
                                MutexGuard::bump(&mut scheduler);
                            }
                        }
                        if frees {
                            s.freed.notify_one();
                        }
                    }
                    _ = beat.tick() => {
                        s.heartbeat(me);
                        if !s.transport.is_connected() {
                            // Deaf, not abandoned: peers' bookings (requests still running)
                            // are not dropped for a silence of our own making.
                            peers.renew_all(now_ms());
                        }
                        peers.on_tick(now_ms(), config.replica_ttl_ms, &mut s.scheduler.lock());
                    }
                    _ = shutdown.changed() => return,
                }
            }
        });
        Ok(share)
    }

    /// Queues this replica's heartbeat with its open bookings.
    fn heartbeat(&self, me: u64) {
        let (open, next) = {
            let s = self.scheduler.lock();
            (ranges(&s.open_seqs(me)), s.next_seq())
        };
        // Keep the heartbeat well inside one message (≈ 42 bytes a range: numbers are
        // about 2^62, see `Scheduler::number_bookings_from`).
        let max_ranges = (self.transport.max_payload() / 2 / 48).max(16);
        self.send(LoadMessage::Heartbeat {
            replica: me,
            open: coarsen(open, max_ranges),
            next,
        });
    }

    /// Queues an update for the next flush.
    fn send(&self, message: LoadMessage) {
        if self.outbox.lock().push(message) {
            self.wake.notify_one();
        }
    }

    /// Publishes what is pending, in messages under the server's payload limit and the
    /// size peers accept. While the server is unreachable, a publish waits at most
    /// [`PUBLISH_WAIT`]: the rest of this flush is dropped (and counted) rather than held,
    /// so the outbox keeps taking and shedding operations.
    async fn flush(&self) {
        let max = self.transport.max_payload().min(MAX_LOAD_MESSAGE_BYTES);
        let payloads = self.outbox.lock().drain_payloads(max);
        let count = payloads.len();
        for (i, payload) in payloads.into_iter().enumerate() {
            let publish = self.transport.publish(&self.subject, None, payload);
            match tokio::time::timeout(PUBLISH_WAIT, publish).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "cannot share load"),
                Err(_) => {
                    let dropped = (count - i) as u64;
                    metrics::counter!("kvroute_load_dropped_messages_total").increment(dropped);
                    tracing::warn!(dropped, "cannot share load: the server takes no messages");
                    return;
                }
            }
        }
    }

    /// What a peer's message freeing room notifies (the admission queue waits on it).
    pub fn freed(&self) -> Arc<tokio::sync::Notify> {
        Arc::clone(&self.freed)
    }

    /// Announces a booking this replica made.
    pub fn booked(&self, id: BookingId) {
        let booking = self.scheduler.lock().shared(id);
        if let Some(booking) = booking {
            self.send(LoadMessage::Book { booking });
        }
    }

    /// Announces a booking's first token.
    pub fn first_token(&self, id: BookingId) {
        self.send(LoadMessage::FirstToken { id });
    }

    /// Announces a booking's completion.
    pub fn completed(&self, id: BookingId) {
        self.send(LoadMessage::Complete { id });
    }
}

#[cfg(test)]
mod tests;
