//! The router's view of one (worker, dp rank) event stream, as a state machine with no I/O
//! (DESIGN §6): it orders batches by id, drops duplicates, holds early batches for a short
//! reorder window, and on a gap, a new epoch or a late join runs the resync: buffer live
//! batches, ask for a snapshot, apply it, replay the buffer past its watermark. Recovery
//! never loops: a snapshot always carries its watermark, so every resync ends live unless
//! the stream itself loses events again.
//!
//! The driver (the events task) feeds it batches, snapshots and clock ticks, and carries out
//! the [`Command`]s it returns against the indexer and the transport.

use std::collections::BTreeMap;

use crate::protocol::{EventBatch, KvEventData, Snapshot};

/// Limits of one stream.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StreamConfig {
    /// Early batches held while waiting for a missing one; past this a gap is declared.
    pub reorder_window: usize,
    /// How long an early batch may wait for the missing one before a gap is declared, ms.
    pub reorder_timeout_ms: u64,
    /// Blocks buffered during a resync (an event that names none counts as one); past this
    /// the buffer is dropped and the resync starts over (counted as an overflow). Counted in
    /// blocks, not events: one event may name 100 k blocks.
    pub max_buffered_blocks: usize,
    /// A snapshot request unanswered this long is sent again, ms; each retry of the same
    /// resync waits twice as long, up to [`MAX_SNAPSHOT_WAIT_MS`] (a worker slow to answer,
    /// or answering many replicas at once after a NATS outage, is not asked ever faster
    /// than it answers).
    pub snapshot_timeout_ms: u64,
}

/// Longest wait for a snapshot before it is asked again, ms.
pub const MAX_SNAPSHOT_WAIT_MS: u64 = 32_000;

impl Default for StreamConfig {
    fn default() -> Self {
        StreamConfig {
            reorder_window: 64,
            reorder_timeout_ms: 250,
            max_buffered_blocks: 1 << 18,
            snapshot_timeout_ms: 2_000,
        }
    }
}

/// What the driver must do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// Forget everything indexed for this (worker, rank).
    Reset,
    /// Apply this batch to the index.
    Apply(EventBatch),
    /// Apply this snapshot's blocks to the index ([`Snapshot::to_batch`]), after the
    /// `Reset` before it. Left to the driver to convert: a snapshot may hold millions of
    /// blocks, which a driver converts and applies off its runtime's threads.
    ApplySnapshot(Snapshot),
    /// Ask the worker for a snapshot of this epoch.
    RequestSnapshot {
        /// The epoch the stream is at (the worker answers with its current one).
        epoch: u64,
        /// The resync asking: its answer goes back with it ([`WorkerStream::on_snapshot`]).
        request: u64,
        /// How long the stream waits for this answer before asking again, ms: the fetch's
        /// deadline.
        wait_ms: u64,
    },
}

/// Why a stream is resyncing (for metrics and logs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResyncReason {
    /// First batch seen mid-stream (router started after the worker).
    Join,
    /// The worker restarted (new epoch) and its first batch is not id 1.
    NewEpoch,
    /// Events were lost.
    Gap,
    /// The resync buffer overflowed.
    Overflow,
    /// Asked by the driver (e.g. after a transport reconnect).
    Requested,
}

/// Counters of one stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamStats {
    /// Batches applied live.
    pub applied_batches: u64,
    /// Batches dropped as duplicates (all ids already applied).
    pub duplicates: u64,
    /// Batches of a retired epoch, dropped.
    pub stale_epoch: u64,
    /// Batches held from before a resync's request whose ids its snapshot's watermark does
    /// not reach (no batch the worker sent can be), dropped.
    pub dropped_future: u64,
    /// Gaps detected.
    pub gaps: u64,
    /// Resyncs started.
    pub resyncs: u64,
    /// Resync buffer overflows.
    pub overflows: u64,
    /// Snapshot requests sent again after a timeout.
    pub snapshot_retries: u64,
    /// Snapshots applied.
    pub snapshots: u64,
    /// Total time spent resyncing (request to applied snapshot), ms.
    pub resync_ms: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    /// Nothing received yet.
    New,
    /// Applying batches in order; `next_id` is the next id expected.
    Live { next_id: u64 },
    /// Waiting for a snapshot; live batches are buffered.
    Resyncing {
        since_ms: u64,
        requested_ms: u64,
        /// How long after `requested_ms` the request is sent again.
        wait_ms: u64,
    },
}

/// One (worker, dp rank) stream.
#[derive(Debug)]
pub struct WorkerStream {
    config: StreamConfig,
    state: State,
    epoch: Option<u64>,
    /// Epochs this stream has moved on from: their stragglers are dropped, not mistaken for
    /// yet another restart.
    retired: Vec<u64>,
    /// Batches ahead of the next id (live) or received during a resync, by first id, with
    /// the number of the resync they arrived under (`resyncs` then).
    held: BTreeMap<u64, (u64, EventBatch)>,
    held_blocks: usize,
    /// When the stream first fell behind what it should have (an early batch arrived, or the
    /// worker announced ids not seen yet); live only.
    held_since_ms: Option<u64>,
    /// Highest id the worker said it has sent (heartbeats), to catch a lost tail batch.
    announced_last: u64,
    last_reason: Option<ResyncReason>,
    /// Resyncs started so far: the number a snapshot request carries, so that an answer to
    /// a request made before the buffer was last cleared is told from a current one.
    resyncs: u64,
    /// Events may have been lost while a resync was under way: its snapshot may have been
    /// cut before the loss, so another resync follows it.
    lost_while_resyncing: bool,
    stats: StreamStats,
}

const RETIRED_EPOCHS: usize = 4;

impl WorkerStream {
    /// A stream that has seen nothing yet.
    pub fn new(config: StreamConfig) -> Self {
        WorkerStream {
            config,
            state: State::New,
            epoch: None,
            retired: Vec::new(),
            held: BTreeMap::new(),
            held_blocks: 0,
            held_since_ms: None,
            announced_last: 0,
            last_reason: None,
            resyncs: 0,
            lost_while_resyncing: false,
            stats: StreamStats::default(),
        }
    }

    /// Counters.
    pub fn stats(&self) -> StreamStats {
        self.stats
    }

    /// The epoch followed, if any.
    pub fn epoch(&self) -> Option<u64> {
        self.epoch
    }

    /// Whether the stream is applying live events (its index entries are exact up to the
    /// last applied id).
    pub fn is_live(&self) -> bool {
        matches!(self.state, State::Live { .. })
    }

    /// Why the last resync started.
    pub fn last_resync_reason(&self) -> Option<ResyncReason> {
        self.last_reason
    }

    /// The next event id expected while live.
    pub fn next_id(&self) -> Option<u64> {
        match self.state {
            State::Live { next_id } => Some(next_id),
            _ => None,
        }
    }

    /// Handles a batch from the wire.
    pub fn on_batch(&mut self, now_ms: u64, batch: EventBatch, out: &mut Vec<Command>) {
        let (Some(first), Some(_)) = (batch.first_id(), batch.last_id()) else {
            return;
        };
        // Later incarnations have larger epochs (start time in the high bits), so a batch of
        // a smaller one is a straggler from before a restart, not yet another restart.
        if self.retired.contains(&batch.epoch) || self.epoch.is_some_and(|e| batch.epoch < e) {
            self.stats.stale_epoch += 1;
            return;
        }
        if self.epoch != Some(batch.epoch) {
            // First contact, or the worker restarted. From id 1 we see the new stream from
            // its start: nothing to fetch.
            self.switch_epoch(now_ms, batch.epoch, first == 1, out);
            if self.is_live() {
                self.accept_live(now_ms, batch, out);
            } else {
                self.hold(batch);
            }
            return;
        }
        match self.state {
            State::Live { .. } => self.accept_live(now_ms, batch, out),
            State::Resyncing { .. } => {
                self.hold(batch);
                if self.held_blocks > self.config.max_buffered_blocks {
                    self.overflow(now_ms, out);
                }
            }
            State::New => unreachable!("invariant: an adopted epoch leaves State::New"),
        }
    }

    /// The number of the resync under way (or last made): what its snapshot requests carry.
    pub fn snapshot_request(&self) -> u64 {
        self.resyncs
    }

    /// The fetch for `request` has just been sent to the worker (it may have waited for its
    /// turn among every stream's fetches): the wait for its answer runs from now, so that a
    /// fetch is not asked again, and stopped, before it had its whole wait.
    pub fn on_fetch_started(&mut self, now_ms: u64, request: u64) {
        if let State::Resyncing { requested_ms, .. } = &mut self.state
            && request == self.resyncs
        {
            *requested_ms = now_ms;
        }
    }

    /// Handles a complete snapshot from the worker, the answer to `request`.
    pub fn on_snapshot(
        &mut self,
        now_ms: u64,
        request: u64,
        snapshot: Snapshot,
        out: &mut Vec<Command>,
    ) {
        let State::Resyncing { since_ms, .. } = self.state else {
            // Late answer to a request already served.
            return;
        };
        if request != self.resyncs {
            // Asked before the resync started again (the buffer overflowed and was cleared):
            // its watermark may lie before batches since dropped.
            return;
        }
        // An answer to the request made now in an epoch later than the one followed, even
        // one this stream retired, is the worker's present (the registry moved the stream
        // back to an older epoch, and the later incarnation answers): adopted, else every
        // answer is refused and the resync never ends. (The fleet passes on an older epoch
        // only once the later one has been silent for a lease, its heartbeats and its own
        // batches alike, so the two do not take turns.) An answer of an older epoch,
        // retired or never seen, is a past incarnation's (one still draining under the same
        // id, answering the same subject): adopted, it retired the present one, whose
        // batches and heartbeats were then dropped for good. The registry's heartbeat moves
        // a stream to an older epoch, not an answer.
        if self.epoch.is_some_and(|e| snapshot.epoch < e) {
            return;
        }
        self.stats.resync_ms += now_ms.saturating_sub(since_ms);
        if self.epoch != Some(snapshot.epoch) {
            // The worker restarted since we asked: the snapshot is of its new incarnation.
            self.adopt_epoch(snapshot.epoch, out);
        } else {
            out.push(Command::Reset);
        }
        self.stats.snapshots += 1;
        let (watermark, epoch) = (snapshot.watermark, snapshot.epoch);
        out.push(Command::ApplySnapshot(snapshot));
        self.state = State::Live {
            next_id: watermark + 1,
        };
        let held = std::mem::take(&mut self.held);
        self.held_blocks = 0;
        for (_, (under, batch)) in held {
            if batch.epoch != epoch {
                continue;
            }
            if under < request && batch.first_id().is_some_and(|first| first > watermark) {
                // Held before this resync asked: the worker had sent it before it cut the
                // snapshot, so the watermark covers it. Past the watermark it is no batch
                // this worker sent (a publisher's bug); kept, it would start the resync
                // over and over.
                self.stats.dropped_future += 1;
                continue;
            }
            self.accept_live(now_ms, batch, out);
        }
        // Likewise a heartbeat heard before the request announced nothing past the
        // watermark; a later one announces again what is still missing.
        self.announced_last = self.announced_last.min(watermark);
        if self.lost_while_resyncing && self.is_live() {
            self.start_resync(now_ms, ResyncReason::Requested, out);
        }
    }

    /// The worker says it has sent events up to `last_id` in `epoch` (its heartbeat). A lost
    /// last batch is otherwise invisible until the next one: if nothing fills the difference
    /// within the reorder timeout, it is a gap. A heartbeat of another epoch means the worker
    /// restarted (or, older, that the incarnation the fleet followed is gone and an older
    /// one under the same id is registered again): the old incarnation's entries go at once.
    pub fn on_watermark(&mut self, now_ms: u64, epoch: u64, last_id: u64, out: &mut Vec<Command>) {
        // The registry's word on the epoch is followed whatever it is, retired or older:
        // the fleet passes on only the incarnation it registered (an older one's heartbeat
        // while a later one is alive is an id conflict, ignored there), and requests go to
        // that incarnation's URL. An older retired epoch comes back when the later
        // incarnation died and the older one still runs under the same id; ignored here, the
        // stream stayed on the dead epoch for good, every snapshot of the live one refused,
        // a routable worker indexed as holding nothing.
        if self.epoch != Some(epoch) {
            // The worker restarted (or is new) and none of its new events reached us: what
            // the index holds for the old incarnation is stale either way.
            self.switch_epoch(now_ms, epoch, last_id == 0, out);
            return;
        }
        if let State::Live { next_id } = self.state
            && last_id >= next_id
        {
            self.announced_last = self.announced_last.max(last_id);
            self.held_since_ms.get_or_insert(now_ms);
            self.on_tick(now_ms, out);
        }
    }

    /// Time passes: a missing batch that never came is a gap; an unanswered snapshot
    /// request is sent again.
    pub fn on_tick(&mut self, now_ms: u64, out: &mut Vec<Command>) {
        match self.state {
            State::Live { next_id } => {
                let behind = !self.held.is_empty() || self.announced_last >= next_id;
                if !behind {
                    self.held_since_ms = None;
                } else if self
                    .held_since_ms
                    .is_some_and(|t| now_ms.saturating_sub(t) >= self.config.reorder_timeout_ms)
                {
                    self.gap(now_ms, out);
                }
            }
            State::Resyncing {
                since_ms,
                requested_ms,
                wait_ms,
            } => {
                if now_ms.saturating_sub(requested_ms) >= wait_ms {
                    self.stats.snapshot_retries += 1;
                    let wait_ms = (wait_ms * 2).min(MAX_SNAPSHOT_WAIT_MS).max(wait_ms);
                    self.state = State::Resyncing {
                        since_ms,
                        requested_ms: now_ms,
                        wait_ms,
                    };
                    if let Some(epoch) = self.epoch {
                        out.push(Command::RequestSnapshot {
                            epoch,
                            request: self.resyncs,
                            wait_ms,
                        });
                    }
                }
            }
            State::New => {}
        }
    }

    /// Forces a resync (after a transport outage, when events may have been lost unseen).
    /// One under way is not started over (under a sustained loss, every fetch would be
    /// stopped before its answer came): another follows once its snapshot is applied, which
    /// may have been cut before the loss (cleared, the stream went live past events it
    /// never saw, found only by a later batch or heartbeat).
    pub fn resync(&mut self, now_ms: u64, out: &mut Vec<Command>) {
        if matches!(self.state, State::Resyncing { .. }) {
            self.lost_while_resyncing = true;
        } else if self.epoch.is_some() {
            self.start_resync(now_ms, ResyncReason::Requested, out);
        }
    }

    /// Follows a new incarnation (or the first one seen): drops the old one's entries, then
    /// goes live at id 1 if the stream is seen `from_start`, or resyncs.
    fn switch_epoch(&mut self, now_ms: u64, epoch: u64, from_start: bool, out: &mut Vec<Command>) {
        let joining = self.epoch.is_none();
        self.adopt_epoch(epoch, out);
        if from_start {
            self.state = State::Live { next_id: 1 };
        } else {
            let reason = if joining {
                ResyncReason::Join
            } else {
                ResyncReason::NewEpoch
            };
            self.start_resync(now_ms, reason, out);
        }
    }

    fn adopt_epoch(&mut self, epoch: u64, out: &mut Vec<Command>) {
        self.retired.retain(|&e| e != epoch);
        if let Some(old) = self.epoch.replace(epoch) {
            self.retired.push(old);
            if self.retired.len() > RETIRED_EPOCHS {
                self.retired.remove(0);
            }
        }
        self.clear_held();
        out.push(Command::Reset);
    }

    fn accept_live(&mut self, now_ms: u64, batch: EventBatch, out: &mut Vec<Command>) {
        let State::Live { next_id } = self.state else {
            return;
        };
        let (first, last) = (batch.first_id().unwrap_or(0), batch.last_id().unwrap_or(0));
        if last < next_id {
            self.stats.duplicates += 1;
        } else if first > next_id {
            self.hold(batch);
            self.held_since_ms.get_or_insert(now_ms);
            if self.held_blocks > self.config.max_buffered_blocks {
                // Held while live, the blocks count as held in a resync do: kept into the
                // resync this gap starts, they overflowed its buffer at its first batch,
                // which started it over and threw away the snapshot already asked for.
                self.overflow(now_ms, out);
            } else if self.held.len() > self.config.reorder_window {
                self.gap(now_ms, out);
            }
            return;
        } else {
            out.push(Command::Apply(trim(batch, next_id)));
            self.stats.applied_batches += 1;
            self.state = State::Live { next_id: last + 1 };
        }
        self.drain_held(now_ms, out);
    }

    /// Applies held batches that have become next in line.
    fn drain_held(&mut self, now_ms: u64, out: &mut Vec<Command>) {
        while let Some(entry) = self.held.first_entry() {
            let State::Live { next_id } = self.state else {
                return;
            };
            if *entry.key() > next_id {
                break;
            }
            let (_, batch) = entry.remove();
            self.held_blocks -= weight(&batch);
            let last = batch.last_id().unwrap_or(0);
            if last >= next_id {
                out.push(Command::Apply(trim(batch, next_id)));
                self.stats.applied_batches += 1;
                self.state = State::Live { next_id: last + 1 };
            } else {
                self.stats.duplicates += 1;
            }
        }
        let State::Live { next_id } = self.state else {
            return;
        };
        let behind = !self.held.is_empty() || self.announced_last >= next_id;
        self.held_since_ms = behind.then_some(self.held_since_ms.unwrap_or(now_ms));
    }

    /// More blocks held than `max_buffered_blocks`: they are dropped and a resync starts.
    fn overflow(&mut self, now_ms: u64, out: &mut Vec<Command>) {
        self.stats.overflows += 1;
        self.clear_held();
        self.start_resync(now_ms, ResyncReason::Overflow, out);
    }

    fn gap(&mut self, now_ms: u64, out: &mut Vec<Command>) {
        self.stats.gaps += 1;
        self.start_resync(now_ms, ResyncReason::Gap, out);
    }

    fn start_resync(&mut self, now_ms: u64, reason: ResyncReason, out: &mut Vec<Command>) {
        // Whatever was lost before now, this resync's snapshot covers.
        self.lost_while_resyncing = false;
        self.stats.resyncs += 1;
        self.resyncs += 1;
        self.last_reason = Some(reason);
        self.held_since_ms = None;
        let wait_ms = self.config.snapshot_timeout_ms;
        self.state = State::Resyncing {
            since_ms: now_ms,
            requested_ms: now_ms,
            wait_ms,
        };
        if let Some(epoch) = self.epoch {
            out.push(Command::RequestSnapshot {
                epoch,
                request: self.resyncs,
                wait_ms,
            });
        }
    }

    fn hold(&mut self, batch: EventBatch) {
        let first = batch.first_id().unwrap_or(0);
        self.held_blocks += weight(&batch);
        if let Some((_, previous)) = self.held.insert(first, (self.resyncs, batch)) {
            self.held_blocks -= weight(&previous);
        }
    }

    fn clear_held(&mut self) {
        self.held.clear();
        self.held_blocks = 0;
        self.held_since_ms = None;
        self.announced_last = 0;
    }
}

/// The part of `batch` from id `from` on.
fn trim(mut batch: EventBatch, from: u64) -> EventBatch {
    batch.events.retain(|e| e.id >= from);
    batch
}

/// What a held batch counts against `max_buffered_blocks`: its events' blocks, an event
/// that names none (Cleared) as one.
fn weight(batch: &EventBatch) -> usize {
    batch
        .events
        .iter()
        .map(|e| match &e.data {
            KvEventData::Stored { blocks, .. } => blocks.len().max(1),
            KvEventData::Removed { blocks } => blocks.len().max(1),
            KvEventData::Cleared => 1,
        })
        .sum()
}

#[cfg(test)]
mod tests;
