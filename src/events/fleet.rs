//! The fleet as one state machine with no I/O: the only place that decides which workers
//! exist, and so which event streams, index lanes and scheduler entries the router keeps.
//! Inputs are registrations, goodbyes, batches (by sender) and clock ticks, each with
//! `now_ms`; outputs are [`FleetCommand`]s the event plane carries out. A worker that left
//! leaves a tombstone for a while, so its late batches are dropped instead of bringing its
//! stream back to life; batches from workers never registered are dropped too, and both are
//! counted.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::discovery::WorkerInfo;
use crate::protocol::{DpRank, WorkerId};

/// One (worker, dp rank): what an event stream, an index lane and a scheduler entry are of.
pub type StreamKey = (WorkerId, DpRank);

/// Timing of the fleet.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FleetConfig {
    /// A registration not refreshed for this long has expired, ms (`None`: registrations
    /// never expire, as with a static list).
    pub lease_ttl_ms: Option<u64>,
    /// How long a worker that left is remembered, so that its stragglers are dropped, ms.
    pub tombstone_ttl_ms: u64,
}

impl Default for FleetConfig {
    fn default() -> Self {
        FleetConfig {
            lease_ttl_ms: Some(5_000),
            tombstone_ttl_ms: 60_000,
        }
    }
}

/// Why a worker left.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Departure {
    /// It said goodbye.
    Left,
    /// Its lease lapsed.
    Expired,
    /// It re-registered in a shape the fleet refuses (see [`Refusal`]).
    Refused,
}

/// What the driver must do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FleetCommand {
    /// Start following this stream (its first watermark follows).
    OpenStream(StreamKey),
    /// The worker's heartbeat: it has published up to `last_id` in `epoch` on this stream.
    Watermark {
        /// The stream.
        key: StreamKey,
        /// The worker's incarnation.
        epoch: u64,
        /// Its last event id on this rank.
        last_id: u64,
    },
    /// Stop following this stream and forget what the index holds for it.
    CloseStream(StreamKey),
    /// The scheduler may route to this rank (or its registration changed: update it).
    Routable {
        /// The rank.
        key: StreamKey,
        /// The model it serves.
        model: String,
        /// LoRA adapters it serves on top of the model.
        adapters: Vec<String>,
        /// Its G1 capacity, blocks.
        capacity_blocks: usize,
    },
    /// The scheduler must stop routing to this rank. Its open bookings stay until their
    /// guards release them (requests still running there; a rank that comes back books them
    /// again).
    Unroutable(StreamKey),
    /// The worker came back as another incarnation (a new epoch, or a new URL) without
    /// leaving: the failures of the old one say nothing of it (an ejection ends).
    Reincarnated(WorkerId),
    /// The incarnation that said goodbye wrote its registration again: its key had been
    /// deleted under it ([`FleetStats::rejoined`]). Registered again; said to the operator.
    Rejoined(WorkerId),
    /// An older incarnation's registration was ignored: a later one of the same id is alive
    /// ([`FleetStats::id_conflicts`]). Said to the operator, with both URLs.
    IdConflict {
        /// The worker id both use.
        id: WorkerId,
        /// The ignored registration's URL.
        ignored_url: String,
        /// The live member's URL.
        kept_url: String,
    },
    /// A worker's heartbeat came late for the router's lease: more than three quarters of
    /// it after the one before (`gap_ms`), or after the lease had lapsed (`gap_ms` unknown),
    /// the router hearing all along. Its heartbeat period, or the registry's delay, does not
    /// fit the lease: it lapses, and each lapse drops what the index holds of it.
    LateHeartbeat {
        /// The worker.
        id: WorkerId,
        /// Since its heartbeat before, ms (`None`: its lease had lapsed).
        gap_ms: Option<u64>,
    },
    /// A worker left (for counters and logs; its streams and entries are closed by the
    /// commands before this one).
    Departed {
        /// The worker.
        id: WorkerId,
        /// Why.
        reason: Departure,
    },
}

/// What to do with a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchVerdict {
    /// Deliver it to its (open) stream.
    Deliver,
    /// Drop it: its worker is not registered (never was, or not yet).
    Unregistered,
    /// Drop it: its worker left (a straggler).
    Departed,
    /// Drop it: the worker is registered with fewer ranks.
    NoSuchRank,
}

/// Counters of the fleet.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FleetStats {
    /// Workers that joined (first registration of an incarnation-independent id).
    pub joined: u64,
    /// Workers that said goodbye.
    pub left: u64,
    /// Workers whose lease lapsed.
    pub expired: u64,
    /// Batches dropped because their worker was never registered.
    pub dropped_unregistered: u64,
    /// Batches dropped because their worker had left.
    pub dropped_departed: u64,
    /// Batches dropped for a rank the worker does not have.
    pub dropped_no_rank: u64,
    /// Registrations refused (block size conflicting with the model's other workers).
    pub refused: u64,
    /// Heartbeats of an incarnation that had said goodbye, registered again
    /// ([`FleetCommand::Rejoined`]).
    pub rejoined: u64,
    /// Registrations read back from the registry's history whose lease had already lapsed
    /// (their worker stopped without a goodbye, or cannot write the registry), kept aside
    /// until a batch of theirs shows the worker alive.
    pub stale_registrations: u64,
    /// Workers registered from such a registration by a batch of theirs.
    pub woken: u64,
    /// Such registrations forgotten because a batch of a later incarnation came instead.
    pub superseded: u64,
    /// Heartbeats late for the lease ([`FleetCommand::LateHeartbeat`]).
    pub late_heartbeats: u64,
    /// Registrations of an older incarnation ignored while a later one of the same id is
    /// alive ([`FleetCommand::IdConflict`]).
    pub id_conflicts: u64,
    /// Goodbyes of an incarnation that is not the registered one (a predecessor leaving
    /// under its replacement's id, or one never registered here): no member removed.
    pub goodbyes_of_others: u64,
}

/// What became of a registration or heartbeat the fleet was not refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Heard {
    /// Registered (or renewed; one read back from the registry's history has its lease
    /// aged).
    Registered,
    /// Read back from the history older than its lease: kept aside until a batch of the
    /// worker's arrives ([`Fleet::wake`]).
    KeptAside,
    /// An older incarnation's while a later one is alive ([`FleetCommand::IdConflict`]):
    /// nothing of it is taken, the engine load it reports included.
    Ignored,
}

/// Why a registration was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Its block size differs from that of the model's registered workers: the router hashes
    /// a model's prompts at one block size, so it could never match this worker's blocks.
    #[error(
        "worker {id} registers model {model:?} with block size {block_size}, but the model's other workers use {fleet_block_size}"
    )]
    BlockSize {
        /// The worker.
        id: WorkerId,
        /// Its model.
        model: String,
        /// Its block size.
        block_size: usize,
        /// The block size of the model's workers.
        fleet_block_size: usize,
    },
}

#[derive(Clone, Debug)]
struct Member {
    info: WorkerInfo,
    /// When the lease was last renewed, on the fleet's clock; before its zero for a
    /// registration that was already old when this fleet read it.
    renewed_ms: i64,
    /// Set while the lease runs from a registration read back from the registry's history:
    /// how old it was then. While the router is deaf such a lease keeps that age (its age
    /// is the registry's own measure), where a lease heard live runs afresh.
    replay_age_ms: Option<u64>,
    /// When its last live heartbeat came.
    heard_ms: Option<u64>,
}

/// A registration read back older than its lease: not a member (not routed to), until a
/// batch of the worker's arrives before `forget_ms`.
#[derive(Clone, Debug)]
struct Dormant {
    info: WorkerInfo,
    forget_ms: u64,
}

/// The fleet.
#[derive(Debug)]
pub struct Fleet {
    config: FleetConfig,
    members: BTreeMap<WorkerId, Member>,
    /// Workers that left: (the incarnation that left, when the tombstone goes, why it left).
    tombstones: BTreeMap<WorkerId, (u64, u64, Departure)>,
    /// Registrations read back older than their lease.
    dormant: BTreeMap<WorkerId, Dormant>,
    /// Since when the router has been out of earshot ([`Fleet::on_deaf_tick`]).
    deaf_since: Option<u64>,
    /// When it last was.
    deaf_at: Option<u64>,
    stats: FleetStats,
}

impl Fleet {
    /// An empty fleet.
    pub fn new(config: FleetConfig) -> Self {
        Fleet {
            config,
            members: BTreeMap::new(),
            tombstones: BTreeMap::new(),
            dormant: BTreeMap::new(),
            deaf_since: None,
            deaf_at: None,
            stats: FleetStats::default(),
        }
    }

    /// Counters.
    pub fn stats(&self) -> FleetStats {
        self.stats
    }

    /// The registered workers.
    pub fn workers(&self) -> impl Iterator<Item = &WorkerInfo> {
        self.members.values().map(|m| &m.info)
    }

    /// One registered worker.
    pub fn worker(&self, id: WorkerId) -> Option<&WorkerInfo> {
        self.members.get(&id).map(|m| &m.info)
    }

    /// Workers remembered as departed.
    pub fn tombstones(&self) -> usize {
        self.tombstones.len()
    }

    /// Registrations read back older than their lease, kept aside.
    pub fn dormant(&self) -> usize {
        self.dormant.len()
    }

    /// Every stream that should exist now: each rank of each registered worker.
    pub fn expected_streams(&self) -> BTreeSet<StreamKey> {
        self.members
            .values()
            .flat_map(|m| ranks(&m.info).map(move |r| (m.info.id, r)))
            .collect()
    }

    /// The block size of a model's registered workers, if any serve it.
    pub fn block_size(&self, model: &str) -> Option<usize> {
        self.members
            .values()
            .find(|m| m.info.model == model)
            .map(|m| m.info.block_size)
    }

    /// A registration or heartbeat (already validated, see [`WorkerInfo::validate`]).
    pub fn on_registration(
        &mut self,
        now_ms: u64,
        info: WorkerInfo,
        out: &mut Vec<FleetCommand>,
    ) -> Result<Heard, Refusal> {
        if self.conflicts(now_ms, &info, out) {
            return Ok(Heard::Ignored);
        }
        self.dormant.remove(&info.id);
        let id = info.id;
        let heard_before = |at: u64| self.deaf_at.is_none_or(|deaf| deaf < at);
        let late = match (self.members.get(&id), self.tombstones.get(&id)) {
            // A new incarnation's first heartbeat is not late: the gap is its restart.
            (Some(m), _) if m.info.epoch != info.epoch => None,
            (Some(m), _) => m
                .heard_ms
                .filter(|&at| heard_before(at))
                .map(|at| now_ms.saturating_sub(at))
                .filter(|&gap| {
                    self.config
                        .lease_ttl_ms
                        .is_some_and(|ttl| gap.saturating_mul(4) > ttl.saturating_mul(3))
                })
                .map(Some),
            (None, Some(&(epoch, _, Departure::Expired))) if epoch == info.epoch => Some(None),
            _ => None,
        };
        if let Some(gap_ms) = late {
            self.stats.late_heartbeats += 1;
            out.push(FleetCommand::LateHeartbeat { id, gap_ms });
        }
        let registered = self.register(now_ms, info, None, out);
        if let Some(member) = self.members.get_mut(&id) {
            member.heard_ms = Some(now_ms);
        }
        registered.map(|()| Heard::Registered)
    }

    /// A registration read back from the registry's history as a watch starts (a router
    /// starting, or watching again), last written `age_ms` before the registry's newest
    /// entry. Its lease runs from then, not from now: a worker that stopped without a
    /// goodbye (killed, its node lost) left a registration that lives on in the bucket, and
    /// read as new it would be routed to for a whole lease. One already older than the lease
    /// is kept aside, not routed to (counted in [`FleetStats::stale_registrations`]): the
    /// worker's next heartbeat, or a batch of its events (a worker alive whose heartbeats
    /// cannot reach the registry), registers it.
    pub fn on_replayed_registration(
        &mut self,
        now_ms: u64,
        info: WorkerInfo,
        age_ms: u64,
        out: &mut Vec<FleetCommand>,
    ) -> Result<Heard, Refusal> {
        if self.conflicts(now_ms, &info, out) {
            return Ok(Heard::Ignored);
        }
        let lapsed = self.config.lease_ttl_ms.is_some_and(|ttl| age_ms > ttl);
        if lapsed && !self.members.contains_key(&info.id) {
            self.stats.stale_registrations += 1;
            let forget_ms = now_ms.saturating_add(self.config.tombstone_ttl_ms);
            self.dormant.insert(info.id, Dormant { info, forget_ms });
            return Ok(Heard::KeptAside);
        }
        self.dormant.remove(&info.id);
        self.register(now_ms, info, Some(age_ms), out)
            .map(|()| Heard::Registered)
    }

    /// A batch of worker `id`, incarnation `epoch`, arrived while it is not a member: if its
    /// registration was kept aside ([`Heard::KeptAside`]), the worker is alive (its
    /// heartbeats do not reach the registry) and is registered now, its commands in `out`
    /// to be carried out before the batch is delivered. `None` if nothing was kept aside
    /// for it, or if what was is an older incarnation's (forgotten then: the batch proves a
    /// restart since, and that registration's heartbeat would take the stream back to the
    /// old epoch, where the new one's batches and snapshots are refused as past).
    pub fn wake(
        &mut self,
        now_ms: u64,
        id: WorkerId,
        epoch: u64,
        out: &mut Vec<FleetCommand>,
    ) -> Option<Result<(), Refusal>> {
        if self.members.contains_key(&id) {
            return None;
        }
        let dormant = self.dormant.remove(&id)?;
        if dormant.info.epoch < epoch {
            self.stats.superseded += 1;
            return None;
        }
        let registered = self.register(now_ms, dormant.info, None, out);
        if registered.is_ok() {
            self.stats.woken += 1;
        }
        Some(registered)
    }

    /// Whether `info` is an older incarnation's registration while a later one of the same
    /// id is alive (its lease, renewed by its heartbeats and its own batches, runs): two
    /// processes under one id (a replaced pod whose predecessor still runs, or an id pinned
    /// twice). Counted, said ([`FleetCommand::IdConflict`]) and ignored: taken, the worker's
    /// URL and epoch went back and forth with every heartbeat, and half its requests went to
    /// the process whose cache the index does not follow (its stream follows whichever
    /// epoch is registered, so a later one still publishing while its registry writes
    /// failed made it wipe and resync at every turn). Once the later one has been silent
    /// for a lease, the older registers (a clock stepped back across a restart gives a
    /// smaller epoch).
    fn conflicts(&mut self, now_ms: u64, info: &WorkerInfo, out: &mut Vec<FleetCommand>) -> bool {
        let (Some(ttl), Some(member)) = (self.config.lease_ttl_ms, self.members.get(&info.id))
        else {
            return false;
        };
        // A heartbeat renews the lease too, so this covers one heard within it.
        let alive = clock(now_ms).saturating_sub(member.renewed_ms) < clock(ttl);
        if info.epoch >= member.info.epoch || !alive {
            return false;
        }
        self.stats.id_conflicts += 1;
        out.push(FleetCommand::IdConflict {
            id: info.id,
            ignored_url: info.url.clone(),
            kept_url: member.info.url.clone(),
        });
        true
    }

    /// Whether `info` is a heartbeat of the incarnation that said goodbye.
    fn said_goodbye(&self, info: &WorkerInfo) -> bool {
        self.tombstones
            .get(&info.id)
            .is_some_and(|&(epoch, _, reason)| epoch == info.epoch && reason == Departure::Left)
    }

    /// `replay_age_ms`: `Some` for a registration read back from the registry's history.
    fn register(
        &mut self,
        now_ms: u64,
        info: WorkerInfo,
        replay_age_ms: Option<u64>,
        out: &mut Vec<FleetCommand>,
    ) -> Result<(), Refusal> {
        let id = info.id;
        if self.said_goodbye(&info) {
            // Written after its own departure in the registry's order, which a worker never
            // does (its heartbeats stop, acknowledged, before it says goodbye): its key was
            // deleted under it, by an operator or by a worker of an earlier version leaving
            // under the same id (a bare delete names no incarnation). It is alive:
            // registered again (it was once ignored for the tombstone's whole minute, its
            // batches dropped and its index wiped).
            self.stats.rejoined += 1;
            out.push(FleetCommand::Rejoined(id));
        }
        if let Some(fleet_block_size) = self
            .members
            .values()
            .find(|m| m.info.model == info.model && m.info.id != id)
            .map(|m| m.info.block_size)
            .filter(|bs| *bs != info.block_size)
        {
            self.stats.refused += 1;
            let refusal = Refusal::BlockSize {
                id,
                model: info.model.clone(),
                block_size: info.block_size,
                fleet_block_size,
            };
            // A member that re-registers with a conflicting shape stops being routable.
            if self.members.contains_key(&id) {
                self.remove(now_ms, id, Departure::Refused, out);
            }
            return Err(refusal);
        }
        // A new incarnation, or one that was only out of earshot (its lease lapsed, as in a
        // NATS outage): it is back, and its stream starts from a snapshot. (One refused
        // keeps its tombstone: its batches are a departed worker's.)
        self.tombstones.remove(&id);
        // A lease runs from the latest of its renewals: an old registration read back does
        // not shorten what a heartbeat or a batch renewed since.
        let written_ms = clock(now_ms).saturating_sub(clock(replay_age_ms.unwrap_or(0)));
        let (renewed_ms, replay_age_ms) = match self.members.get(&id) {
            Some(m) if m.renewed_ms >= written_ms => (m.renewed_ms, m.replay_age_ms),
            _ => (written_ms, replay_age_ms),
        };
        let heard_ms = self.members.get(&id).and_then(|m| m.heard_ms);
        let previous = self.members.insert(
            id,
            Member {
                info: info.clone(),
                renewed_ms,
                replay_age_ms,
                heard_ms,
            },
        );
        let old: BTreeSet<DpRank> = previous
            .as_ref()
            .map_or_else(BTreeSet::new, |p| ranks(&p.info).collect());
        let new: BTreeSet<DpRank> = ranks(&info).collect();
        if previous.is_none() {
            self.stats.joined += 1;
        }
        if previous
            .as_ref()
            .is_some_and(|p| p.info.epoch != info.epoch || p.info.url != info.url)
        {
            out.push(FleetCommand::Reincarnated(id));
        }
        for &rank in old.difference(&new) {
            out.push(FleetCommand::Unroutable((id, rank)));
            out.push(FleetCommand::CloseStream((id, rank)));
        }
        let reshaped = previous.as_ref().is_none_or(|p| {
            p.info.model != info.model
                || p.info.adapters != info.adapters
                || p.info.g1_blocks != info.g1_blocks
                || p.info.block_size != info.block_size
        });
        for &rank in &new {
            let key = (id, rank);
            if !old.contains(&rank) {
                out.push(FleetCommand::OpenStream(key));
            }
            if reshaped || !old.contains(&rank) {
                out.push(FleetCommand::Routable {
                    key,
                    model: info.model.clone(),
                    adapters: info.adapters.clone(),
                    capacity_blocks: info.g1_blocks,
                });
            }
            out.push(FleetCommand::Watermark {
                key,
                epoch: info.epoch,
                last_id: info
                    .last_event_ids
                    .get(rank.0 as usize)
                    .copied()
                    .unwrap_or(0),
            });
        }
        Ok(())
    }

    /// Incarnation `epoch` of worker `id` said goodbye (its registration marked as left):
    /// the member goes if it is that incarnation, and only then (a predecessor leaving
    /// under the same id leaves its replacement registered).
    pub fn on_left(&mut self, now_ms: u64, id: WorkerId, epoch: u64, out: &mut Vec<FleetCommand>) {
        if self.dormant.get(&id).is_some_and(|d| d.info.epoch == epoch) {
            self.dormant.remove(&id);
        }
        if self.members.get(&id).is_some_and(|m| m.info.epoch == epoch) {
            self.remove(now_ms, id, Departure::Left, out);
        } else {
            self.stats.goodbyes_of_others += 1;
        }
        self.sweep_tombstones(now_ms);
    }

    /// A worker's registration was deleted: a worker of an earlier version saying goodbye,
    /// or an operator's delete. It names no incarnation; whichever is registered goes.
    pub fn on_goodbye(&mut self, now_ms: u64, id: WorkerId, out: &mut Vec<FleetCommand>) {
        self.dormant.remove(&id);
        if self.members.contains_key(&id) {
            self.remove(now_ms, id, Departure::Left, out);
        }
        self.sweep_tombstones(now_ms);
    }

    /// A batch of incarnation `epoch` arrived from `key` at `now_ms`: deliver it or drop it
    /// (counted). A delivered batch of the registered incarnation renews its worker's lease
    /// as a heartbeat does: a worker that publishes events is alive, even while its
    /// heartbeats cannot reach the registry (a JetStream election, or a server its
    /// connection cannot write the bucket through). Another incarnation's batch proves
    /// nothing of the registered one (one that died would stay registered for as long as an
    /// older process under its id published). (A worker whose registration was kept aside
    /// is woken first: [`Fleet::wake`].)
    pub fn on_batch(&mut self, now_ms: u64, key: StreamKey, epoch: u64) -> BatchVerdict {
        let verdict = match self.members.get_mut(&key.0) {
            Some(m) if key.1.0 < m.info.dp_size => {
                if m.info.epoch == epoch && clock(now_ms) >= m.renewed_ms {
                    m.renewed_ms = clock(now_ms);
                    m.replay_age_ms = None;
                }
                BatchVerdict::Deliver
            }
            Some(_) => BatchVerdict::NoSuchRank,
            None if self.tombstones.contains_key(&key.0) => BatchVerdict::Departed,
            None => BatchVerdict::Unregistered,
        };
        match verdict {
            BatchVerdict::Deliver => {}
            BatchVerdict::Unregistered => self.stats.dropped_unregistered += 1,
            BatchVerdict::Departed => self.stats.dropped_departed += 1,
            BatchVerdict::NoSuchRank => self.stats.dropped_no_rank += 1,
        }
        verdict
    }

    /// The router was out of earshot (its NATS connection dropped, or the registry took no
    /// writes) until `now_ms`: silence in that time says nothing of the workers, so every
    /// lease runs afresh from now; one read back from the registry's history keeps the age
    /// the registry gave it.
    pub fn renew_all(&mut self, now_ms: u64) {
        for member in self.members.values_mut() {
            let from = clock(now_ms).saturating_sub(clock(member.replay_age_ms.unwrap_or(0)));
            member.renewed_ms = member.renewed_ms.max(from);
        }
    }

    /// The clock while the router is out of earshot (its NATS connection down, or the
    /// registry taking no writes): no lease lapses. A deafness shorter than a registry probe
    /// period (one late acknowledgement) pauses the leases, its time not counted; a longer
    /// one says nothing of the workers, whose heartbeats could not land, so every lease runs
    /// afresh ([`Fleet::renew_all`]) from its end. (Renewing at once on a blip gave a crashed
    /// worker a new lease with every late acknowledgement.)
    pub fn on_deaf_tick(&mut self, now_ms: u64) {
        self.deaf_at = Some(now_ms);
        let since = *self.deaf_since.get_or_insert(now_ms);
        if now_ms.saturating_sub(since) >= self.deaf_grace_ms() {
            self.renew_all(now_ms);
        }
        self.sweep_tombstones(now_ms);
    }

    /// The router's NATS connection came back: taken as a deaf tick now, so an outage the
    /// ticks saw pauses the leases if short and renews them if longer than the grace, as
    /// [`Fleet::on_deaf_tick`] says, and one they did not see (it dropped and came back
    /// between two ticks, at most the transport's one-second check) pauses them from now to
    /// the next tick only, its own time counted against them: less than a heartbeat period
    /// against leases of four or more. (Renewing on every reconnect gave a crashed worker a
    /// new lease each time the connection flapped: a server closing a slow consumer, a
    /// rolling restart of a NATS cluster.)
    pub fn on_reconnected(&mut self, now_ms: u64) {
        self.on_deaf_tick(now_ms);
    }

    /// The lease, ms (`None`: leases never lapse).
    pub fn lease_ttl_ms(&self) -> Option<u64> {
        self.config.lease_ttl_ms
    }

    /// How long a deafness pauses leases before they are renewed: a registry probe period.
    fn deaf_grace_ms(&self) -> u64 {
        self.config
            .lease_ttl_ms
            .map_or(1_000, crate::discovery::probe_period_ms)
    }

    /// The clock: expires lapsed leases and forgets old tombstones.
    pub fn on_tick(&mut self, now_ms: u64, out: &mut Vec<FleetCommand>) {
        if let Some(since) = self.deaf_since.take() {
            let deaf = now_ms.saturating_sub(since);
            if deaf < self.deaf_grace_ms() {
                // A short deafness: its time does not count against any lease.
                for member in self.members.values_mut() {
                    member.renewed_ms = member
                        .renewed_ms
                        .saturating_add(clock(deaf))
                        .min(member.renewed_ms.max(clock(now_ms)));
                }
            }
        }
        if let Some(ttl) = self.config.lease_ttl_ms {
            let lapsed: Vec<WorkerId> = self
                .members
                .values()
                .filter(|m| clock(now_ms).saturating_sub(m.renewed_ms) > clock(ttl))
                .map(|m| m.info.id)
                .collect();
            for id in lapsed {
                self.remove(now_ms, id, Departure::Expired, out);
            }
        }
        self.sweep_tombstones(now_ms);
    }

    /// The driver's actual streams (or lanes, or scheduler entries): those the fleet does not
    /// expect, which must go. Empty unless something went wrong; the driver closes them.
    pub fn orphans(&self, actual: impl IntoIterator<Item = StreamKey>) -> Vec<StreamKey> {
        let expected = self.expected_streams();
        actual
            .into_iter()
            .filter(|k| !expected.contains(k))
            .collect()
    }

    fn remove(
        &mut self,
        now_ms: u64,
        id: WorkerId,
        reason: Departure,
        out: &mut Vec<FleetCommand>,
    ) {
        let Some(member) = self.members.remove(&id) else {
            return;
        };
        for rank in ranks(&member.info) {
            out.push(FleetCommand::Unroutable((id, rank)));
            out.push(FleetCommand::CloseStream((id, rank)));
        }
        match reason {
            Departure::Left => self.stats.left += 1,
            Departure::Expired => self.stats.expired += 1,
            Departure::Refused => {}
        }
        let until = now_ms.saturating_add(self.config.tombstone_ttl_ms);
        self.tombstones
            .insert(id, (member.info.epoch, until, reason));
        out.push(FleetCommand::Departed { id, reason });
    }

    fn sweep_tombstones(&mut self, now_ms: u64) {
        self.tombstones.retain(|_, (_, until, _)| now_ms <= *until);
        self.dormant.retain(|_, d| now_ms <= d.forget_ms);
    }
}

/// A time or span in ms as the leases count it (signed: a lease read back from the
/// registry's history began before the fleet's clock started).
fn clock(ms: u64) -> i64 {
    i64::try_from(ms).unwrap_or(i64::MAX)
}

fn ranks(info: &WorkerInfo) -> impl Iterator<Item = DpRank> + use<> {
    (0..info.dp_size).map(DpRank)
}

#[cfg(test)]
mod tests;
