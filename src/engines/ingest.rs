//! The task that follows one engine's KV events (one data-parallel rank): subscribes to its
//! ZMQ PUB, catches up through its replay ROUTER (at start, after a reconnect, and on a
//! gap), notices restarts, and hands the mirror's block changes to its owner. Shared by the
//! sidecar (`kvroute-worker --engine`) and the router's direct mode (`--backend`).

use std::num::NonZeroUsize;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;

use super::mirror::{EngineMirror, MirrorStats, SeqCheck, SeqTracker};
use super::wire::{EngineEvent, WireError, decode_batch};
use super::zmtp::{Connection, ZmtpError};
use crate::protocol::BlockChange;

/// Where an engine (one rank) publishes its events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineEndpoint {
    /// The PUB socket, `tcp://HOST:PORT`.
    pub events: String,
    /// The replay ROUTER socket, if the engine has one.
    pub replay: Option<String>,
    /// The topic prefix to subscribe to (engines default to "").
    pub topic: String,
}

impl EngineEndpoint {
    /// The endpoints of data-parallel rank `rank` of an engine whose rank 0 publishes at
    /// `self`: vLLM and SGLang offset the TCP port by the rank
    /// (`ZmqEventPublisher.offset_endpoint_port` in vLLM's `kv_events.py`).
    pub fn for_rank(&self, rank: u32) -> Result<EngineEndpoint, ZmtpError> {
        let offset = |e: &str| -> Result<String, ZmtpError> {
            super::zmtp::tcp_address(e)?;
            let (head, port) = e.rsplit_once(':').expect("invariant: checked above");
            let port: u16 = port.parse().expect("invariant: checked above");
            let port = port
                .checked_add(u16::try_from(rank).unwrap_or(u16::MAX))
                .ok_or_else(|| ZmtpError::Endpoint(format!("{e} offset by rank {rank}")))?;
            Ok(format!("{head}:{port}"))
        };
        Ok(EngineEndpoint {
            events: offset(&self.events)?,
            replay: self.replay.as_deref().map(offset).transpose()?,
            topic: self.topic.clone(),
        })
    }
}

/// How long the ingest waits, and how much one replay may bring.
#[derive(Clone, Copy, Debug)]
pub struct IngestLimits {
    /// Connecting and the ZMTP handshake.
    pub connect: Duration,
    /// Each reply of a replay.
    pub replay: Duration,
    /// A whole replay: an engine that answers without end (never its end marker) holds
    /// neither the live stream nor its pending changes longer than this.
    pub replay_total: Duration,
    /// Most batches one replay applies (vLLM buffers 10,000 by default); the rest is left to
    /// the live stream, whose gap then clears and rebuilds the mirror.
    pub max_replay_batches: u64,
    /// Silence after which the subscription is re-established (an engine that died without
    /// closing its socket), catching up through replay; only with a replay socket (without
    /// one, TCP keepalive notices a dead host).
    pub idle: Duration,
    /// Longest wait between reconnection attempts.
    pub max_backoff: Duration,
    /// Changes a replay hands to the owner at a time: a replay's changes go as they come,
    /// not all at its end (a reconnect to a busy engine whose buffer holds 10,000 batches of
    /// long prefills made millions of them, held in one list until the replay ended).
    pub replay_flush_changes: usize,
    /// Most blocks the engine's mirror holds ([`EngineMirror::with_max_blocks`]): what an
    /// engine stores past it is not indexed (counted in `capped`), so that an engine that
    /// never removes cannot grow the process without end.
    pub max_blocks: NonZeroUsize,
}

impl Default for IngestLimits {
    fn default() -> Self {
        IngestLimits {
            connect: Duration::from_secs(5),
            replay: Duration::from_secs(5),
            replay_total: Duration::from_secs(60),
            max_replay_batches: 100_000,
            idle: Duration::from_secs(30),
            max_backoff: Duration::from_secs(5),
            replay_flush_changes: 1 << 16,
            max_blocks: NonZeroUsize::new(super::mirror::DEFAULT_MAX_BLOCKS)
                .expect("invariant: a positive constant"),
        }
    }
}

/// Counters of one engine stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IngestStats {
    /// The mirror's counters.
    pub mirror: MirrorStats,
    /// Whether the subscription is up.
    pub connected: bool,
    /// Sequence gaps seen.
    pub gaps: u64,
    /// Batches recovered through replay.
    pub replayed: u64,
    /// Gaps replay could not fill (the engine's buffer no longer reached back): the mirror
    /// was cleared and rebuilt from what followed.
    pub unrepaired: u64,
    /// Engine restarts seen (seq went back).
    pub restarts: u64,
    /// Replays not asked for while the replay socket rested after leaving requests
    /// unanswered.
    pub replays_skipped: u64,
    /// Payloads that did not decode (the mirror was cleared: it could no longer be exact).
    pub decode_errors: u64,
    /// The block size the engine used where it differed from the configured one.
    pub wrong_block_size: Option<u32>,
    /// The data-parallel rank the engine's last batch named, if it names one (vLLM's
    /// `data_parallel_rank`): its owner compares it with the rank it follows.
    pub engine_rank: Option<u32>,
}

/// What the ingest hands its owner after each batch (or change of connection).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Update {
    /// The engine's cache changes, in order.
    pub changes: Vec<BlockChange>,
    /// Counters so far.
    pub stats: IngestStats,
}

/// Follows one engine rank until `tx` closes. `offload_chunk`: GPU blocks per chunk of the
/// engine's offload tier, as its token-less events name them
/// ([`EngineMirror::with_offload_chunk`]; 1 for engines that name every block).
pub async fn run(
    endpoint: EngineEndpoint,
    block_size: NonZeroUsize,
    offload_chunk: NonZeroUsize,
    limits: IngestLimits,
    tx: mpsc::Sender<Update>,
) {
    let mut ingest = Ingest {
        resting: Resting::default(),
        mirror: EngineMirror::new(block_size)
            .with_offload_chunk(offload_chunk)
            .with_max_blocks(limits.max_blocks),
        seq: SeqTracker::default(),
        replayed_from: None,
        rebuilt: false,
        publisher: None,
        stats: IngestStats::default(),
        changes: Vec::new(),
        endpoint,
        limits,
        owner: tx.clone(),
    };
    let mut backoff = Duration::from_millis(100);
    let mut warned = false;
    let mut failed = false;
    while !tx.is_closed() {
        let sub = match ingest.subscribe(failed).await {
            Ok(sub) => sub,
            Err(e) => {
                if !warned {
                    tracing::warn!(endpoint = %ingest.endpoint.events, error = %e, "cannot follow the engine's KV events; retrying");
                    warned = true;
                }
                failed = true;
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(limits.max_backoff);
                continue;
            }
        };
        warned = false;
        tracing::info!(endpoint = %ingest.endpoint.events, "following the engine's KV events");
        ingest.stats.connected = true;
        let followed = tokio::time::Instant::now();
        match ingest.follow(sub, &tx).await {
            Ok(f) => failed = f,
            Err(Closed) => return,
        }
        ingest.stats.connected = false;
        if ingest.flush(&tx).await.is_err() {
            return;
        }
        if failed && followed.elapsed() < limits.idle {
            // A peer that closes as soon as it is followed is not reconnected to at once.
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(limits.max_backoff);
        } else {
            backoff = Duration::from_millis(100);
        }
    }
}

/// Says that `engine`'s KV events are followed without its replay socket: one lost batch
/// (a reconnect, the PUB socket's high-water mark) then empties what the router knows of
/// it, and the prefixes it keeps cached are not announced again (an engine announces a
/// block once, when it is first cached).
pub fn warn_without_replay(engine: &str) {
    tracing::warn!(
        engine,
        "following KV events without the engine's replay socket: a lost batch forgets its \
         cached prefixes until they are evicted and cached again (vLLM: set \
         kv_events_config.replay_endpoint, and give it to kvroute as the replay endpoint)"
    );
}

/// Unanswered replays in a row after which the replay socket is not asked for a while: each
/// one holds the live stream for the reply deadline, and under a burst that makes more gaps
/// (the PUB socket's high-water mark), each asking again.
const REPLAYS_UNANSWERED_TO_REST: u32 = 2;
/// The first rest of an unanswering replay socket; each further one doubles, up to
/// [`REPLAY_REST_MAX`]; one answered replay ends it.
const REPLAY_REST_FIRST: Duration = Duration::from_secs(30);
/// The longest rest.
const REPLAY_REST_MAX: Duration = Duration::from_secs(300);

/// Whether the replay socket rests ([`REPLAYS_UNANSWERED_TO_REST`]).
#[derive(Debug)]
struct Resting {
    unanswered: u32,
    until: Option<tokio::time::Instant>,
    next: Duration,
}

impl Default for Resting {
    fn default() -> Self {
        Resting {
            unanswered: 0,
            until: None,
            next: REPLAY_REST_FIRST,
        }
    }
}

struct Ingest {
    resting: Resting,
    mirror: EngineMirror,
    seq: SeqTracker,
    /// Where the last replay started: live batches from there up to the expected seq were
    /// covered by it and are skipped, not taken for a restart.
    replayed_from: Option<u64>,
    /// The last replay rebuilt the mirror from the engine's whole buffer (it began at seq
    /// 0): the mirror is the engine's, whatever it held before.
    rebuilt: bool,
    /// The publisher's identity, when its sequence frames carry one (vLLM with a snapshot
    /// endpoint): a new identity is a restarted engine, whatever its numbering says.
    publisher: Option<Publisher>,
    stats: IngestStats,
    changes: Vec<BlockChange>,
    endpoint: EngineEndpoint,
    limits: IngestLimits,
    /// The owner, for what a replay brings while it goes on ([`Ingest::flush`] otherwise).
    owner: mpsc::Sender<Update>,
}

/// The owner went away.
struct Closed;

impl Ingest {
    /// Subscribes, then catches up with what was published before: the engine's whole
    /// buffer at first, what was missed after an idle re-subscription. After the connection
    /// failed the engine may have restarted, which its numbering alone does not always show
    /// (a restarted engine may already count past where the old one stopped), so the whole
    /// buffer is asked for: one that starts at seq 0 holds the engine's whole life and
    /// rebuilds the mirror exactly; one that ends before the expected seq proves a restart.
    async fn subscribe(&mut self, after_failure: bool) -> Result<Connection, ZmtpError> {
        let mut sub =
            Connection::connect(&self.endpoint.events, "SUB", self.limits.connect).await?;
        sub.subscribe(self.endpoint.topic.as_bytes()).await?;
        // What an earlier connection's replay covered says nothing of this one: after a
        // failed replay, a batch numbered below the expected seq is a restarted engine, not
        // a duplicate.
        self.replayed_from = None;
        if self.endpoint.replay.is_some() {
            let caught_up = match (after_failure, self.seq.expected()) {
                (true, Some(expected)) => self.resync(expected).await,
                (_, expected) => self.replay(expected.unwrap_or(0), false).await.map(|_| ()),
            };
            if let Err(e) = caught_up {
                self.replay_failed(&e);
            }
        }
        Ok(sub)
    }

    /// Says a replay failed and the live stream goes on without it; not for one not asked
    /// (the socket rests: said once, when it began to).
    fn replay_failed(&self, e: &ZmtpError) {
        if !matches!(e, ZmtpError::Resting(_)) {
            tracing::warn!(endpoint = ?self.endpoint.replay, error = %e, "replay failed; going on with live events");
        }
    }

    async fn resync(&mut self, expected: u64) -> Result<(), ZmtpError> {
        let replayed = self.replay(0, true).await?;
        // Only a replay that reached its end marker gives the engine's newest batch: one
        // that fell silent may have lost its tail (a burst drops the last batches and the
        // marker first), and a live engine taken for a restarted one loses every block it
        // announced before its buffer's window. The live stream shows a restart later if
        // the new engine numbers below the old one.
        if replayed.ended
            && replayed
                .last
                .is_none_or(|last| last.saturating_add(1) < expected)
        {
            // The engine's newest batch is older than what was seen: it restarted. A buffer
            // that held its whole life has made the mirror the new engine's already, unless
            // the old engine's hashing kept the mirror from holding anything (the new one
            // may hash by position: its replay is applied again).
            if self.rebuilt && !self.mirror.ambiguous_hashing() {
                self.stats.restarts += 1;
                tracing::info!(endpoint = %self.endpoint.events, expected, "engine restarted: the mirror is rebuilt from its whole replay buffer");
            } else {
                self.restarted(0);
                self.replay(0, false).await?;
            }
        } else if self.rebuilt && self.mirror.ambiguous_hashing() {
            // The engine's whole life was replayed under the old engine's flag, with nothing
            // to say whether it restarted (the replay fell silent, or numbers went on): it is
            // replayed again with the flag lowered; hashes still ambiguous raise it again.
            self.mirror.engine_restarted();
            self.seq.reset();
            self.replay(0, false).await?;
        }
        Ok(())
    }

    /// Reads live batches until the connection fails (true) or goes idle (false).
    async fn follow(
        &mut self,
        mut sub: Connection,
        tx: &mpsc::Sender<Update>,
    ) -> Result<bool, Closed> {
        self.flush(tx).await?;
        // Without replay a batch published while the subscription is re-established is
        // lost, and the gap it leaves clears the mirror: an engine that is only quiet (vLLM
        // publishes nothing while idle) is then followed for as long as its socket stays
        // up, and a dead host is noticed by TCP keepalive ([`Connection::connect`]).
        let idle = match self.endpoint.replay {
            Some(_) => self.limits.idle,
            None => Duration::MAX,
        };
        loop {
            let message = tokio::select! {
                m = tokio::time::timeout(idle, sub.recv()) => m,
                _ = tx.closed() => return Err(Closed),
            };
            let frames = match message.map(Message::read) {
                Ok(Ok(message)) => message,
                Ok(Err(e)) => {
                    tracing::warn!(endpoint = %self.endpoint.events, error = %e, "engine event stream failed; reconnecting");
                    return Ok(true);
                }
                // Idle: re-subscribe and catch up (cheap when nothing was missed).
                Err(_) => return Ok(false),
            };
            let Some((seq, payload)) = live_message(&frames) else {
                self.stats.decode_errors += 1;
                if self.stats.decode_errors == 1 {
                    let shape: Vec<usize> = frames.frames().iter().map(|f| f.len()).collect();
                    tracing::warn!(endpoint = %self.endpoint.events, frame_bytes = ?shape, "an engine message not shaped (topic, 8- or 24-byte sequence, batch); dropped");
                }
                // Counted where the owner sees it (an engine sending nothing else showed no
                // decode error at all).
                self.flush(tx).await?;
                continue;
            };
            if self.adopt(seq.publisher) {
                // A new publisher, numbering from 0 again: whatever its numbers, not a late
                // or replayed batch of the old one.
                self.restart_at(seq.n, &payload).await;
            } else {
                self.live(seq.n, &payload).await;
            }
            self.flush(tx).await?;
        }
    }

    async fn live(&mut self, seq: u64, payload: &Payload) {
        match self.seq.check(seq) {
            SeqCheck::First | SeqCheck::Next => {
                // Live batches come in order: none older than this one can follow.
                self.replayed_from = None;
                self.apply(seq, payload);
            }
            SeqCheck::Gap { expected } => {
                self.stats.gaps += 1;
                if self.endpoint.replay.is_some()
                    && let Err(e) = self.replay(expected, false).await
                {
                    self.replay_failed(&e);
                }
                match self.seq.check(seq) {
                    SeqCheck::Next => self.apply(seq, payload),
                    SeqCheck::Gap { .. } => {
                        // Lost for good: rebuild from what follows.
                        self.stats.unrepaired += 1;
                        self.mirror.clear(&mut self.changes);
                        self.apply(seq, payload);
                    }
                    // Replay brought it already.
                    _ => {}
                }
            }
            SeqCheck::Restarted => {
                let expected = self.seq.expected().unwrap_or(0);
                if self.replayed_from.is_some_and(|f| f <= seq) && seq < expected {
                    // Sent live while a replay brought it too.
                    return;
                }
                self.restart_at(seq, payload).await;
            }
        }
    }

    /// Follows `seen`, the identity a batch came with (if its seq frame has one); true if it
    /// is another publisher than the one followed so far: the engine restarted, whatever
    /// its numbers say.
    fn adopt(&mut self, seen: Option<Publisher>) -> bool {
        let Some(seen) = seen else { return false };
        self.publisher.replace(seen).is_some_and(|old| old != seen)
    }

    /// The engine restarted and sent `seq`: drops what the old one held, replays the new
    /// one's batches before `seq`, and applies `seq` unless the replay brought it.
    async fn restart_at(&mut self, seq: u64, payload: &Payload) {
        self.restarted(seq);
        if seq > 0
            && self.endpoint.replay.is_some()
            && let Err(e) = self.replay(0, false).await
        {
            // The new engine's batches before this one were missed.
            self.replay_failed(&e);
        }
        match self.seq.check(seq) {
            // Brought by the replay.
            SeqCheck::Restarted => {}
            // The replay stopped short of it: what it missed is lost for good (a removal
            // among it would leave a block held here that the engine dropped).
            SeqCheck::Gap { .. } => {
                self.stats.unrepaired += 1;
                self.mirror.clear(&mut self.changes);
                self.apply(seq, payload);
            }
            // Nothing replayed (it failed, or there is none): the first batch seen.
            SeqCheck::First | SeqCheck::Next => self.apply(seq, payload),
        }
    }

    /// The engine's seq went back to `seq`: it restarted, and what it held is gone.
    fn restarted(&mut self, seq: u64) {
        self.stats.restarts += 1;
        tracing::info!(endpoint = %self.endpoint.events, seq, expected = ?self.seq.expected(), "engine restarted: dropping what it held");
        self.mirror.clear(&mut self.changes);
        self.mirror.engine_restarted();
        self.seq.reset();
        self.replayed_from = None;
        self.rebuilt = false;
    }

    fn apply(&mut self, seq: u64, payload: &Payload) {
        self.seq.advance(seq);
        let decoded = match payload {
            Payload::Bytes(bytes) => decode_batch(bytes),
            Payload::Oversized(bytes) => Err(WireError::TooLarge(
                usize::try_from(*bytes).unwrap_or(usize::MAX),
            )),
        };
        match decoded {
            Ok(batch) => {
                let before = self.mirror.stats();
                self.mirror.apply(&batch, &mut self.changes);
                // Each said once, when the first one is met (no scan of the batches before).
                if before.malformed_events == 0
                    && let Some((tag, error)) = batch.events.iter().find_map(|e| match e {
                        EngineEvent::Malformed { tag, error } => Some((tag, error)),
                        _ => None,
                    })
                {
                    tracing::warn!(endpoint = %self.endpoint.events, seq, kind = tag.as_deref().unwrap_or("?"), %error, "an engine event that does not decode; skipped, the rest of its batch applied (a removal's drops the engine's blocks until they are stored again; counted in malformed_events)");
                }
                if before.unknown_events == 0
                    && self.mirror.stats().unknown_events > 0
                    && let Some(tag) = batch.events.iter().find_map(|e| match e {
                        EngineEvent::Other(tag) => Some(tag),
                        _ => None,
                    })
                {
                    tracing::warn!(endpoint = %self.endpoint.events, kind = %tag, "engine events of a kind kvroute does not know; skipped (counted in unknown_events)");
                }
                if before.ambiguous == 0 && self.mirror.stats().ambiguous > 0 {
                    tracing::error!(endpoint = %self.endpoint.events, "the engine names KV blocks by their tokens alone, not their place in the prompt (SGLang before its position-aware block hashes): one hash is several blocks, so its cache cannot be mirrored; nothing of it is indexed until it restarts (counted in ambiguous; upgrade the engine)");
                }
                if before.capped == 0 && self.mirror.stats().capped > 0 {
                    tracing::warn!(endpoint = %self.endpoint.events, blocks = self.mirror.len(), "the engine's mirror is full: blocks it stores from now on are not indexed until it removes some (counted in capped; raise the mirror's max_blocks if the engine really holds this many)");
                }
                self.stats.engine_rank = batch.dp_rank.or(self.stats.engine_rank);
            }
            Err(e) => {
                self.stats.decode_errors += 1;
                tracing::warn!(endpoint = %self.endpoint.events, seq, error = %e, "undecodable engine batch; dropping the engine's blocks until they are stored again");
                self.mirror.clear(&mut self.changes);
            }
        }
    }

    /// Asks the replay socket for every batch from `from` on and applies those not seen;
    /// with `rebuild`, a buffer that starts at seq 0 replaces the mirror, handing out only
    /// what differs from what it held ([`EngineMirror::begin_rebuild`]), however the replay
    /// ends.
    async fn replay(&mut self, from: u64, rebuild: bool) -> Result<Replayed, ZmtpError> {
        let now = tokio::time::Instant::now();
        if let Some(until) = self.resting.until.filter(|until| now < *until) {
            self.stats.replays_skipped += 1;
            return Err(ZmtpError::Resting(until - now));
        }
        self.rebuilt = false;
        let replayed = self.replay_batches(from, rebuild).await;
        self.mirror.end_rebuild(&mut self.changes);
        // Any failure counts (a socket that refuses connections, or speaks something else,
        // cost a connection and a warning at every gap).
        match &replayed {
            Ok(_) => self.resting = Resting::default(),
            Err(error) => {
                self.resting.unanswered += 1;
                if self.resting.unanswered >= REPLAYS_UNANSWERED_TO_REST {
                    let rest = self.resting.next;
                    self.resting.until = Some(tokio::time::Instant::now() + rest);
                    self.resting.next = (rest * 2).min(REPLAY_REST_MAX);
                    tracing::warn!(endpoint = ?self.endpoint.replay, failed = self.resting.unanswered, ?rest, %error,
                        "the engine's replay socket fails requests: not asked for a while (a gap meanwhile clears what the router knows of the engine, as without replay)");
                }
            }
        }
        replayed
    }

    async fn replay_batches(
        &mut self,
        mut from: u64,
        rebuild: bool,
    ) -> Result<Replayed, ZmtpError> {
        let Some(endpoint) = self.endpoint.replay.clone() else {
            return Ok(Replayed {
                last: None,
                ended: false,
            });
        };
        let limits = self.limits;
        let mut dealer = Connection::connect(&endpoint, "DEALER", limits.connect).await?;
        dealer.send(&[b"", &from.to_be_bytes()]).await?;
        let mut last = None;
        let ends = tokio::time::Instant::now() + limits.replay_total;
        let mut replies = 0u64;
        // The engine replays consecutive batches: one missing between two replies was lost
        // on the way (a ROUTER socket drops what its peer's queue has no room for), and is
        // asked for again once this reply stream has ended: up to REPLAY_ASKS times in all,
        // and beyond while each request brings the replay further (a gap longer than the
        // engine's socket queue, 1,000 messages by default, comes back a queue at a time),
        // up to MAX_REPLAY_ASKS. A stream that falls silent without its end marker may have
        // lost its last batches (the marker, sent right after them, goes first in a burst):
        // what follows its last reply is asked for too, within REPLAY_ASKS.
        let mut lost: Option<u64> = None;
        let mut asks = 1;
        // Where the latest request asked from.
        let mut asked_from = from;
        let mut answered = false;
        loop {
            if replies == limits.max_replay_batches {
                return Err(ZmtpError::Protocol(format!(
                    "a replay of more than {} batches",
                    limits.max_replay_batches
                )));
            }
            replies += 1;
            let next = tokio::time::Instant::now() + limits.replay;
            let received = tokio::time::timeout_at(next.min(ends), dealer.recv()).await;
            let frames = match received.map(Message::read) {
                Ok(message) => message?,
                // The engine answered and then fell silent: its ROUTER socket drops what the
                // peer's queue has no room for, and the end marker, sent right after the last
                // batch, is what a burst drops most often. The stream has ended; what it lost
                // is asked for again.
                Err(_) if answered && next <= ends => match lost.take().or_else(|| {
                    (asks < REPLAY_ASKS).then(|| last.map_or(asked_from, |l: u64| l + 1))
                }) {
                    Some(from) => {
                        asks += 1;
                        asked_from = from;
                        // On a new connection: the read the deadline cut may have stopped
                        // inside a frame, and this one would read on from its middle.
                        dealer = Connection::connect(&endpoint, "DEALER", limits.connect).await?;
                        dealer.send(&[b"", &from.to_be_bytes()]).await?;
                        continue;
                    }
                    None => return Ok(Replayed { last, ended: false }),
                },
                Err(_) => {
                    return Err(ZmtpError::Timeout(if next <= ends {
                        limits.replay
                    } else {
                        limits.replay_total
                    }));
                }
            };
            answered = true;
            let Some((seq, payload)) = replay_message(&frames) else {
                return Err(ZmtpError::Protocol(format!(
                    "a replay reply of {} frames",
                    frames.frames().len()
                )));
            };
            if let Some(from) = lost {
                // Skipped (publisher included: a new one is met on the next request), and
                // asked for again once this stream ends.
                if seq.n == u64::MAX {
                    lost = None;
                    asks += 1;
                    asked_from = from;
                    dealer.send(&[b"", &from.to_be_bytes()]).await?;
                }
                continue;
            }
            // Adopted here too, so that the live batches that follow are not taken for a
            // second restart.
            let renamed = self.adopt(seq.publisher);
            let seq = seq.n;
            if seq == u64::MAX {
                return Ok(Replayed { last, ended: true });
            }
            if (last.is_none() && rebuild && seq == 0) || seq < from {
                // The engine's whole life is in the buffer, or it was asked for `from` on and
                // gave less (it numbers from 0 again): start over from what it sends.
                if seq < from {
                    self.restarted(seq);
                    // Once: the replies that follow are the new engine's, in order.
                    from = seq;
                } else {
                    self.mirror.begin_rebuild();
                    self.seq.reset();
                    self.rebuilt = true;
                }
                self.replayed_from = Some(seq);
            } else if renamed {
                self.restarted(seq);
                self.replayed_from = Some(seq);
            }
            let previous = last.replace(seq);
            match self.seq.check(seq) {
                SeqCheck::First | SeqCheck::Next => {}
                SeqCheck::Gap { expected }
                    if previous.is_some_and(|p| seq > p + 1)
                        && (asks < REPLAY_ASKS || expected > asked_from)
                        && asks < MAX_REPLAY_ASKS =>
                {
                    lost = Some(expected);
                    continue;
                }
                SeqCheck::Gap { .. } => {
                    // The engine's buffer does not reach back to what was lost.
                    self.stats.unrepaired += 1;
                    self.mirror.clear(&mut self.changes);
                }
                SeqCheck::Restarted => continue,
            }
            // Live batches from `from` on are duplicates only once the replay has brought
            // some: one that failed before bringing any (an engine whose replay takes the
            // request and never answers) covered nothing, and a batch numbered below the
            // expected seq is then a restarted engine's, not a duplicate.
            self.replayed_from.get_or_insert(from);
            self.stats.replayed += 1;
            self.apply(seq, &payload);
            if self.changes.len() >= limits.replay_flush_changes {
                let owner = self.owner.clone();
                self.flush(&owner).await.map_err(|Closed| {
                    ZmtpError::Protocol("the owner stopped following the engine".into())
                })?;
            }
        }
    }

    async fn flush(&mut self, tx: &mpsc::Sender<Update>) -> Result<(), Closed> {
        let mut stats = self.stats;
        stats.mirror = self.mirror.stats();
        stats.wrong_block_size = self.mirror.wrong_block_size();
        let update = Update {
            changes: std::mem::take(&mut self.changes),
            stats,
        };
        tx.send(update).await.map_err(|_| Closed)
    }
}

/// How a replay ended.
#[derive(Clone, Copy, Debug)]
struct Replayed {
    /// The last seq the engine sent.
    last: Option<u64>,
    /// Whether its end marker came: `last` is then the newest batch the engine holds, not
    /// only the last one that arrived.
    ended: bool,
}

/// A publisher lifetime's identity: the 16 bytes after the sequence number.
type Publisher = [u8; 16];

/// A data message's sequence frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Seq {
    /// The sequence number, big-endian unsigned.
    n: u64,
    /// Who numbered it, in the 24-byte form.
    publisher: Option<Publisher>,
}

/// An 8-byte sequence number, or (vLLM with `snapshot_endpoint` set, which "extends each live
/// and replay data message's sequence frame from 8 to 24 bytes": vLLM's
/// `docs/features/kv_events.md`) the number followed by the publisher's 16-byte identity.
fn seq_of(frame: &[u8]) -> Option<Seq> {
    let (n, publisher) = match frame.len() {
        8 => (frame, None),
        24 => (&frame[..8], Some(frame[8..].try_into().ok()?)),
        _ => return None,
    };
    Some(Seq {
        n: u64::from_be_bytes(n.try_into().ok()?),
        publisher,
    })
}

/// A message as read: whole, or with a frame over the size limit (which of them, empty
/// here, and its size).
enum Message {
    Whole(Vec<Bytes>),
    Oversized(Vec<Bytes>, usize, u64),
}

impl Message {
    /// What a `recv` gave: a message, whole or with a frame read past (its seq still
    /// counts, and the stream stays in step), or why the connection failed.
    fn read(received: Result<Vec<Bytes>, ZmtpError>) -> Result<Message, ZmtpError> {
        match received {
            Ok(frames) => Ok(Message::Whole(frames)),
            Err(ZmtpError::Oversized {
                frames,
                frame,
                bytes,
                ..
            }) => Ok(Message::Oversized(frames, frame, bytes)),
            Err(e) => Err(e),
        }
    }

    fn frames(&self) -> &[Bytes] {
        match self {
            Message::Whole(frames) | Message::Oversized(frames, ..) => frames,
        }
    }

    /// The payload, the last frame: its bytes, or its size if that frame was read past.
    /// `None` if another frame was (a topic or sequence frame cannot be megabytes long).
    fn payload(&self) -> Option<Payload> {
        match self {
            Message::Whole(frames) => frames.last().cloned().map(Payload::Bytes),
            Message::Oversized(frames, frame, bytes) => {
                (*frame + 1 == frames.len()).then_some(Payload::Oversized(*bytes))
            }
        }
    }
}

/// A batch's payload: its bytes, or only its size when it was over the frame limit (read
/// past, so the connection stays in step and its seq still counts: an undecodable batch).
enum Payload {
    Bytes(Bytes),
    Oversized(u64),
}

/// A live message: `(topic, seq, payload)`.
fn live_message(message: &Message) -> Option<(Seq, Payload)> {
    match message.frames() {
        [_topic, seq, _payload] => Some((seq_of(seq)?, message.payload()?)),
        _ => None,
    }
}

/// Requests one replay makes in any case: the first, and again from a batch lost on the way.
const REPLAY_ASKS: u32 = 3;

/// Requests one replay makes at most while each brings it further: vLLM's replay buffer
/// holds 10,000 batches and its ROUTER socket queues 1,000 messages a peer, so a long gap
/// comes back in about ten.
const MAX_REPLAY_ASKS: u32 = 64;

/// A replay reply after the empty delimiter: `(topic, seq, payload)` (vLLM ≥ 0.26) or
/// `(seq, payload)` (SGLang, older vLLM); the end is seq `0xFF…FF` (-1 as a signed int).
fn replay_message(message: &Message) -> Option<(Seq, Payload)> {
    let frames = message.frames();
    let frames = match frames.first() {
        Some(f) if f.is_empty() => &frames[1..],
        _ => frames,
    };
    match frames {
        [_, seq, _] | [seq, _] => Some((seq_of(seq)?, message.payload()?)),
        _ => None,
    }
}

#[cfg(test)]
mod tests;
