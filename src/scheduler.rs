//! Picks the worker for each request and keeps the router's view of every worker's load.
//! No I/O: the ingress and the replay bench drive it with an injected clock (`now_ms`).
//!
//! cost(worker) = prefill_scale · max(prompt_blocks − (device_weight·device +
//! host_weight·host + disk_weight·disk), 0) + active_prefill_blocks +
//! decode_weight · active_decode_blocks + recent_weight · recent_blocks (DESIGN §8, with the
//! decode term weighted and the prompt blocks of recently routed requests decayed in). Load is booked at routing,
//! prefill released at the first token, the rest at completion; bookings other replicas
//! shared and never released expire after `booking_ttl_ms`.
//!
//! Admission (DESIGN §13, [`Scheduler::admit`]): each booking also carries its work in
//! tokens (uncached prefill, expected decode). A request is routed only among the workers
//! whose booked work leaves room for it under `admission.worker_budget_tokens` (and the
//! fleet's under `fleet_budget_tokens`); when none has room it waits in the ingress's
//! [`queue::AdmissionQueue`]. Sessions ([`SessionRef`]) stick to their worker: while it has
//! room and is not busy (soft, sticky until saturated), or only that worker, waiting for
//! room there (hard); a new session's first turn weighs the live sessions each worker
//! already holds; a session whose worker left moves once, to wherever the cost sends it. Every decision carries a [`Receipt`]: the cache it
//! got against the most any worker of the model had.

mod load;
pub mod mismatch;
mod policy;
pub mod queue;
mod rng;
mod sessions;

use std::collections::{BTreeMap, VecDeque};

use rustc_hash::{FxHashMap, FxHashSet};
use serde::{Deserialize, Serialize};

pub use load::{ActiveLoad, Work};
pub use policy::{ApproxConfig, Policy, PolicyKind};
pub use rng::Rng;
pub use sessions::{SessionConfig, SessionStats};

use crate::indexer::{Overlap, OverlapScores};
use crate::protocol::{BlockHash, DpRank, SeqHash, WorkerId};

/// A routable unit: one rank of one worker.
pub type WorkerKey = (WorkerId, DpRank);

/// Weights and thresholds of the scheduler.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Which policy routes.
    pub policy: PolicyKind,
    /// Weight of the uncached prefill against booked load (blocks per block). Above 1
    /// because recomputing a prefix costs the whole worker GPU time, not just this request
    /// its first token; 8 measured best on the Mooncake conversation trace at 1× and 6×
    /// load (README, "Routing").
    pub prefill_scale: f64,
    /// Weight of the blocks booked requests hold (decode load) against prefill work. Held
    /// blocks slow a worker's steps only a little (a decode token rides along a prefill step;
    /// the decode fit adds ≈ 54 ms · held/capacity per step), while queued prefill delays a
    /// new request's first token block for block; at weight 1 the router gives up a cached
    /// 150-block prefix to avoid a worker holding two running requests. The default comes
    /// from the replay bench (README, "Routing").
    pub decode_weight: f64,
    /// Credit for a block cached in GPU memory, 0..=1.
    pub device_weight: f64,
    /// Credit for a block cached in host memory (needs a copy back), 0..=1.
    pub host_weight: f64,
    /// Credit for a block on disk or remote storage, 0..=1.
    pub disk_weight: f64,
    /// 0: always the lowest cost (ties at random). Above 0: sample from a softmax over
    /// costs scaled to 0..1 over their spread (lowest to highest), at this temperature.
    pub temperature: f64,
    /// A worker whose booked blocks exceed this share of its G1 capacity is busy.
    pub busy_decode_fraction: f64,
    /// A worker with more uncached prefill booked than this many blocks is busy (0 = off).
    pub busy_prefill_blocks: f64,
    /// Bookings shared by other replicas and not completed within this time are dropped
    /// (a replica that died without freeing them), ms. This router's own bookings do not
    /// expire: their guards release them however their request ends, and a stream may run
    /// longer than any fixed time. At least [`MIN_BOOKING_TTL_MS`]: peers refresh the
    /// bookings they still hold with every heartbeat (1 s), and a TTL near that would drop
    /// them between two.
    pub booking_ttl_ms: u64,
    /// Seed of the tie-break and sampling generator.
    pub seed: u64,
    /// This router replica's id in shared bookings (unique per replica; 0 is fine alone).
    pub replica_id: u64,
    /// Settings of the `approx_prefix` policy.
    pub approx: ApproxConfig,
    /// Admission by work: the budgets past which requests wait in the queue.
    pub admission: AdmissionConfig,
    /// The queue requests wait in: priority bands' limits and deadlines.
    pub queue: queue::QueueConfig,
    /// Session affinity.
    pub sessions: SessionConfig,
    /// Weight of recently routed requests in a worker's cost, per prompt block they hold
    /// (decayed with `recent_half_life_ms`: a worker's KV footprint and GPU time follow the
    /// conversations it serves, not only the requests in flight this instant). Booked load
    /// vanishes between paced requests (one turn in flight per conversation): without a
    /// memory of recent work, every new conversation goes to the worker holding the shared
    /// system prompt while the others idle (AMD-AGI/Infera #103: 448 requests to 0).
    pub recent_weight: f64,
    /// Half-life of recently routed requests' weight, ms.
    pub recent_half_life_ms: u64,
    /// Workers that cannot be reached sit out for a while (passive outlier ejection).
    pub ejection: EjectionConfig,
}

/// Passive ejection: a worker whose HTTP endpoint fails this many requests in a row
/// (connection refused or timed out, no response headers in time, an error status of its
/// own: 5xx, 429, 401/403, a redirect) sits out for `base_ms`,
/// doubling at each further failure up to `max_ms`; one answer ends it. Its load reads as
/// light (its bookings are released at once), so without it a worker that still heartbeats
/// over NATS but cannot be reached over HTTP (a partition, a wrong URL) would win request
/// after request, each paying the connection timeout before its retry. Ejected workers still
/// serve when every worker of the model is ejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EjectionConfig {
    /// Consecutive failures that eject a worker (0: never).
    pub after_failures: u32,
    /// The first ejection, ms.
    pub base_ms: u64,
    /// The longest ejection, ms.
    pub max_ms: u64,
    /// Most of a model's workers that sit out at once, percent (at least one may): when a
    /// load spike slows every worker of a model, their timeouts would otherwise eject them
    /// one after another and pile the load on those left. Past it, failures are counted
    /// but eject no one more.
    pub max_ejected_percent: u32,
}

impl Default for EjectionConfig {
    fn default() -> Self {
        EjectionConfig {
            after_failures: 3,
            base_ms: 5_000,
            max_ms: 60_000,
            max_ejected_percent: 50,
        }
    }
}

impl EjectionConfig {
    /// How long a worker with `failures` consecutive failures sits out, ms (0: not ejected).
    fn ejection_ms(&self, failures: u32) -> u64 {
        if self.after_failures == 0 || failures < self.after_failures {
            return 0;
        }
        let doublings = (failures - self.after_failures).min(16);
        self.base_ms
            .saturating_mul(1 << doublings)
            .min(self.max_ms.max(self.base_ms))
    }
}

/// Admission by work (DESIGN §13): a request is routed while some worker serving its model
/// can take its work under the budget, and queued otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionConfig {
    /// Booked work one worker may hold, tokens: uncached prefill not yet computed plus the
    /// expected decode of every request routed there and not finished. A worker with nothing
    /// booked always takes one request, however large. 0: no per-worker budget. The default
    /// is about 256 running requests of 1k tokens each.
    pub worker_budget_tokens: u64,
    /// Booked work the whole fleet may hold, tokens. 0: only the per-worker budgets.
    pub fleet_budget_tokens: u64,
    /// A request's expected decode is its `max_tokens`, at most this many tokens (clients
    /// often ask for far more than they get).
    pub decode_cap_tokens: u32,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            worker_budget_tokens: 262_144,
            fleet_budget_tokens: 0,
            decode_cap_tokens: 1024,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            policy: PolicyKind::Kv,
            prefill_scale: 8.0,
            decode_weight: 0.1,
            device_weight: 1.0,
            host_weight: 0.75,
            disk_weight: 0.25,
            temperature: 0.0,
            busy_decode_fraction: 0.95,
            busy_prefill_blocks: 0.0,
            booking_ttl_ms: 600_000,
            seed: 0,
            replica_id: 0,
            approx: ApproxConfig::default(),
            admission: AdmissionConfig::default(),
            queue: queue::QueueConfig::default(),
            sessions: SessionConfig::default(),
            recent_weight: 1.0,
            recent_half_life_ms: 1_000,
            ejection: EjectionConfig::default(),
        }
    }
}

/// A scheduler configuration that cannot work.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    /// A weight outside its range, or not a finite number.
    #[error("scheduler.{field} = {value} is not a finite number in {range}")]
    OutOfRange {
        /// The field.
        field: &'static str,
        /// Its value.
        value: f64,
        /// The allowed range.
        range: &'static str,
    },
    /// The queue's bands.
    #[error(transparent)]
    Queue(#[from] queue::QueueConfigError),
    /// A limit that must be at least 1.
    #[error("scheduler.{field} must be at least 1")]
    Zero {
        /// The field.
        field: &'static str,
    },
}

impl Config {
    /// Checks every weight's range: each float finite (NaN and infinities are rejected, a
    /// NaN weight would make every cost NaN) and inside its documented range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let unit = |v: f64| (0.0..=1.0).contains(&v);
        let non_negative = |v: f64| v >= 0.0;
        type Check = (&'static str, f64, fn(f64) -> bool, &'static str);
        let checks: [Check; 11] = [
            ("prefill_scale", self.prefill_scale, non_negative, ">= 0"),
            ("decode_weight", self.decode_weight, non_negative, ">= 0"),
            ("device_weight", self.device_weight, unit, "0..=1"),
            ("host_weight", self.host_weight, unit, "0..=1"),
            ("disk_weight", self.disk_weight, unit, "0..=1"),
            ("temperature", self.temperature, non_negative, ">= 0"),
            (
                "busy_decode_fraction",
                self.busy_decode_fraction,
                |v| v > 0.0,
                "> 0",
            ),
            (
                "busy_prefill_blocks",
                self.busy_prefill_blocks,
                non_negative,
                ">= 0",
            ),
            (
                "approx.match_threshold",
                self.approx.match_threshold,
                unit,
                "0..=1",
            ),
            ("recent_weight", self.recent_weight, non_negative, ">= 0"),
            (
                "sessions.spread_weight",
                self.sessions.spread_weight,
                non_negative,
                ">= 0",
            ),
        ];
        if let Some((field, value, _, range)) = checks
            .into_iter()
            .find(|(_, v, ok, _)| !v.is_finite() || !ok(*v))
        {
            return Err(ConfigError::OutOfRange {
                field,
                value,
                range,
            });
        }
        let positive = [
            ("recent_half_life_ms", self.recent_half_life_ms),
            ("sessions.ttl_ms", self.sessions.ttl_ms),
            ("sessions.max_sessions", self.sessions.max_sessions as u64),
            ("ejection.base_ms", self.ejection.base_ms),
        ];
        if let Some((field, _)) = positive.into_iter().find(|(_, v)| *v == 0) {
            return Err(ConfigError::Zero { field });
        }
        if self.booking_ttl_ms < MIN_BOOKING_TTL_MS {
            return Err(ConfigError::OutOfRange {
                field: "booking_ttl_ms",
                value: self.booking_ttl_ms as f64,
                range: ">= 10000",
            });
        }
        self.queue.validate()?;
        Ok(())
    }
}

/// What the scheduler needs to know of a request.
#[derive(Clone, Copy, Debug)]
pub struct RouteRequest<'a> {
    /// The model asked for: only workers serving it are candidates.
    pub model: &'a str,
    /// Hashes of the prompt's full blocks.
    pub blocks: &'a [BlockHash],
    /// Prompt length, tokens.
    pub prompt_tokens: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Each worker's cached prefix of the request (from the indexer).
    pub overlaps: &'a OverlapScores,
    /// Tokens each sequence may generate (`max_tokens`); its expected decode is this,
    /// capped, for each of its `n` sequences.
    pub max_tokens: u32,
    /// Sequences it generates (OpenAI's `n`; 0 counts as 1).
    pub n: u32,
    /// The conversation it belongs to, if the client named one.
    pub session: Option<SessionRef<'a>>,
}

impl RouteRequest<'_> {
    /// The tokens it is expected to generate: each sequence's `max_tokens`, at most `cap`
    /// (clients often ask for far more than they get), times its sequences.
    pub fn expected_decode(&self, cap: u32) -> u64 {
        u64::from(self.max_tokens.min(cap)) * u64::from(self.n.max(1))
    }
}

/// A request's session, as the client named it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionRef<'a> {
    /// The session id.
    pub id: &'a str,
    /// Hard affinity: only the session's worker, waiting for it when it is saturated. Soft
    /// (the default): that worker unless it is saturated (no room, or busy).
    pub hard: bool,
}

/// One worker as a policy sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    /// The worker.
    pub key: WorkerKey,
    /// Its cached prefix of the request, as the indexer knows it.
    pub overlap: Overlap,
    /// Leading blocks of the request that requests already routed to it hold or are
    /// computing (what its KV events have not announced yet).
    pub booked_prefix: u32,
    /// Its cost for the request.
    pub cost: f64,
    /// Uncached prefill booked on it, plus the engine's queue beyond its bookings, blocks.
    pub prefill_blocks: f64,
    /// Blocks its booked requests hold (or the engine's own usage, where larger).
    pub decode_blocks: f64,
    /// Over a busy threshold.
    pub busy: bool,
    /// The work the request would bring it, tokens.
    pub work: Work,
    /// Work already booked on it, tokens.
    pub booked_work_tokens: f64,
    /// Whether the request's work fits its budget (always, when nothing is booked there).
    pub room: bool,
}

impl Candidate {
    /// Leading blocks of the request it would not have to compute: indexed, or being
    /// computed for a request routed there.
    pub fn cached_blocks(&self) -> u32 {
        let o = self.overlap;
        (o.device + o.host + o.disk).max(self.booked_prefix)
    }
}

/// Names a booking, to release it later: the router replica that made it, and its number
/// there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BookingId {
    /// The replica (`Config::replica_id`) that booked it.
    pub origin: u64,
    /// Its number within that replica.
    pub seq: u64,
}

/// A booking as replicas share it (`kvroute.<c>.load`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SharedBooking {
    /// The booking.
    pub id: BookingId,
    /// The worker it loads.
    pub worker: WorkerId,
    /// The worker's rank.
    pub dp_rank: DpRank,
    /// Uncached prefill, blocks.
    pub prefill_blocks: f64,
    /// Full prompt blocks held.
    pub blocks: Vec<SeqHash>,
    /// Whether a partial tail block is held too.
    pub tail: bool,
    /// Its work, tokens (absent from replicas older than admission by work: 0).
    #[serde(default)]
    pub prefill_tokens: f64,
    /// Its expected decode, tokens.
    #[serde(default)]
    pub decode_tokens: u64,
    /// The session whose turn it is ([`sessions::session_key`]), as 32 hex digits: peers
    /// stick the session to the same worker. Absent for a request without one, and from
    /// replicas older than shared sessions.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "hex_key")]
    pub session: Option<sessions::SessionKey>,
}

/// A session key as 32 hex digits (JSON numbers past 2^53 lose digits in many parsers).
mod hex_key {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(key: &Option<u128>, s: S) -> Result<S::Ok, S::Error> {
        match key {
            Some(k) => s.serialize_str(&format!("{k:032x}")),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u128>, D::Error> {
        let Some(text) = Option::<std::borrow::Cow<'de, str>>::deserialize(d)? else {
            return Ok(None);
        };
        if text.len() != 32 {
            return Err(serde::de::Error::custom("a session key is 32 hex digits"));
        }
        u128::from_str_radix(&text, 16)
            .map(Some)
            .map_err(|_| serde::de::Error::custom("a session key is 32 hex digits"))
    }
}

/// Whether `seq` is in `ranges` (inclusive, sorted and apart: [`normalized_ranges`]), by
/// bisection.
pub(crate) fn in_ranges(ranges: &[(u64, u64)], seq: u64) -> bool {
    let at = ranges.partition_point(|(a, _)| *a <= seq);
    at > 0 && seq <= ranges[at - 1].1
}

/// Inclusive ranges of booking numbers sorted and apart, as a heartbeat sends them (made so
/// if a peer sent them otherwise), so that a number is found in them by bisection.
pub(crate) fn normalized_ranges(ranges: &[(u64, u64)]) -> std::borrow::Cow<'_, [(u64, u64)]> {
    if ranges.windows(2).all(|w| w[0].1 < w[1].0) && ranges.iter().all(|(a, b)| a <= b) {
        return std::borrow::Cow::Borrowed(ranges);
    }
    let mut v: Vec<(u64, u64)> = ranges.iter().filter(|(a, b)| a <= b).copied().collect();
    v.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(v.len());
    for (a, b) in v {
        match merged.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => merged.push((a, b)),
        }
    }
    std::borrow::Cow::Owned(merged)
}

/// Shortest `booking_ttl_ms` (ten of the load share's heartbeats).
pub const MIN_BOOKING_TTL_MS: u64 = 10_000;

/// Most blocks a peer's booking may hold (a 16 M-token prompt at block size 16).
pub const MAX_SHARED_BLOCKS: usize = 1 << 20;

/// Most bookings one peer replica may hold open here: a router's requests in flight are
/// bounded by its connections (10,000 by default); past this, a peer is faulty or forged.
pub const MAX_PEER_BOOKINGS: usize = 1 << 16;

/// Most blocks one peer replica's open bookings may hold here, in all (128 MiB of hashes).
pub const MAX_PEER_BLOCKS: usize = 1 << 24;

/// Why a peer's booking was refused.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SharedBookingError {
    /// More blocks than any prompt has.
    #[error("booking holds {blocks} blocks, over {MAX_SHARED_BLOCKS}")]
    TooLarge {
        /// Its block count.
        blocks: usize,
    },
    /// Prefill that is not a finite number of blocks a prompt could have.
    #[error("booking's prefill {prefill_blocks} is not in 0..={MAX_SHARED_BLOCKS}+1")]
    Prefill {
        /// The value sent.
        prefill_blocks: f64,
    },
    /// Work that is not a finite number of tokens below 2^40.
    #[error(
        "booking's work ({prefill_tokens} prefill, {decode_tokens} decode tokens) is out of range"
    )]
    Work {
        /// Prefill sent.
        prefill_tokens: f64,
        /// Decode sent.
        decode_tokens: u64,
    },
    /// A worker this router does not know (not registered, or not yet).
    #[error("booking for unknown worker {worker}")]
    UnknownWorker {
        /// The worker.
        worker: WorkerId,
    },
    /// The peer holds [`MAX_PEER_BOOKINGS`] bookings, or [`MAX_PEER_BLOCKS`] blocks, here
    /// already.
    #[error(
        "replica {origin} holds {bookings} bookings of {blocks} blocks here, at the limit \
         ({MAX_PEER_BOOKINGS} bookings, {MAX_PEER_BLOCKS} blocks)"
    )]
    PeerFull {
        /// The peer.
        origin: u64,
        /// Its open bookings.
        bookings: usize,
        /// Their blocks.
        blocks: usize,
    },
}

/// The scheduler's answer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Decision {
    /// Where the request goes, and why.
    pub chosen: Candidate,
    /// Its booking: call [`Scheduler::first_token`] and [`Scheduler::complete`] with it.
    pub booking: BookingId,
    /// How good the decision was.
    pub receipt: Receipt,
}

/// How good one routing decision was: the cache the request got against the most any
/// registered worker of its model could have given it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Receipt {
    /// Full blocks of the prompt.
    pub prompt_blocks: u32,
    /// Leading blocks cached (or being computed) on the chosen worker.
    pub cached_blocks: u32,
    /// The most leading blocks any worker serving the model had, busy or not.
    pub reachable_blocks: u32,
    /// The chosen worker's cost.
    pub cost: f64,
}

/// Admission's answer for a request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Admission {
    /// Routed and booked.
    Routed(Decision),
    /// No worker of its model has room for its work: it waits.
    Wait,
    /// The fleet's budget has no room for its work: it waits, and so must every request
    /// queued after it (any other's admission would take that room).
    FleetFull,
    /// No registered worker serves its model.
    NoWorkers,
}

/// Totals over every decision since start: how much cache routing found and lost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DecisionStats {
    /// Requests routed.
    pub decisions: u64,
    /// Decisions that took the most cache any worker had.
    pub optimal: u64,
    /// Blocks cached on the chosen workers.
    pub cached_blocks: u64,
    /// Blocks the best workers had.
    pub reachable_blocks: u64,
    /// Prompt blocks no worker had.
    pub novel_blocks: u64,
}

impl DecisionStats {
    /// Adds one decision.
    pub fn record(&mut self, r: &Receipt) {
        self.decisions += 1;
        self.optimal += u64::from(r.cached_blocks >= r.reachable_blocks);
        self.cached_blocks += u64::from(r.cached_blocks);
        self.reachable_blocks += u64::from(r.reachable_blocks);
        self.novel_blocks += u64::from(r.prompt_blocks.saturating_sub(r.reachable_blocks));
    }

    /// Blocks some worker had that the chosen one did not (given up for load).
    pub fn lost_blocks(&self) -> u64 {
        self.reachable_blocks.saturating_sub(self.cached_blocks)
    }

    /// lost / (novel + lost): the share of recomputed blocks another worker had cached.
    pub fn regret(&self) -> f64 {
        let lost = self.lost_blocks();
        lost as f64 / (self.novel_blocks + lost).max(1) as f64
    }
}

#[derive(Debug)]
struct Booking {
    worker: WorkerKey,
    work: Work,
    prefill_blocks: f64,
    blocks: Vec<SeqHash>,
    tail: bool,
    booked_ms: u64,
    prefill_open: bool,
    /// The session whose turn it is, shared with peers.
    session: Option<sessions::SessionKey>,
}

#[derive(Debug)]
struct WorkerState {
    capacity_blocks: usize,
    model: String,
    /// LoRA adapters served on top of `model`.
    adapters: Vec<String>,
    load: ActiveLoad,
    /// G1 blocks in use as the engine itself last reported (a real engine's sidecar): load
    /// this router did not book (other routers, clients that bypass it).
    engine_used_blocks: f64,
    /// This rank's share of the requests the engine last reported waiting beyond those
    /// booked on the worker and not started when the report came.
    engine_unbooked_waiting: f64,
    /// The engine's last report, whole (`/admin/workers`).
    engine_load: Option<crate::engines::metrics::EngineLoad>,
    /// KV footprint (prompt blocks) of the requests routed here recently, decayed to
    /// `recent_at_ms`.
    recent_blocks: f64,
    recent_at_ms: u64,
    /// Requests in a row that could not reach it ([`EjectionConfig`]).
    failures: u32,
    /// It sits out until then (0: never ejected), ms.
    ejected_until_ms: u64,
}

impl WorkerState {
    fn serves(&self, model: &str) -> bool {
        self.model == model || self.adapters.iter().any(|a| a == model)
    }

    fn ejected(&self, now_ms: u64) -> bool {
        now_ms < self.ejected_until_ms
    }
}

/// The keys of every rank of `worker`: adjacent in a map ordered by (worker, rank), so a
/// range finds them without a scan of the fleet (answers are noted on every request).
fn ranks_of(worker: WorkerId) -> std::ops::RangeInclusive<WorkerKey> {
    (worker, DpRank(0))..=(worker, DpRank(u32::MAX))
}

/// The scheduler of one router.
#[derive(Debug)]
pub struct Scheduler {
    config: Config,
    policy: Box<dyn Policy>,
    rng: Rng,
    workers: BTreeMap<WorkerKey, WorkerState>,
    bookings: FxHashMap<BookingId, Booking>,
    /// Bookings by age, for expiry; completed ones are skipped lazily.
    by_age: VecDeque<(u64, BookingId)>,
    /// Per peer replica, its open bookings here and their blocks (entries go with the last).
    peers: FxHashMap<u64, (usize, usize)>,
    next_booking: u64,
    expired: u64,
    sessions: sessions::Sessions,
    stats: DecisionStats,
    /// Uncached prompt tokens of the requests this router books, a moving mean (`None`
    /// before the first): the size assumed for requests an engine queues that no router
    /// booked, whose prompts it does not report. In tokens, so that models of different
    /// block sizes share it (each candidate's cost divides it by its model's block size).
    mean_prefill_tokens: Option<f64>,
}

/// Bits of a booking's number below its replica's start time ([`Scheduler::number_bookings_from`]).
const BOOKING_SEQ_BITS: u32 = 22;

/// Weight of each new booking in [`Scheduler::mean_prefill_tokens`] (a mean over about the
/// last 64 requests).
const PREFILL_MEAN_WEIGHT: f64 = 1.0 / 64.0;

impl Scheduler {
    /// A scheduler with no workers.
    pub fn new(config: Config) -> Result<Self, ConfigError> {
        config.validate()?;
        let config_sessions = config.sessions;
        Ok(Scheduler {
            policy: config.policy.build(config.temperature, config.approx),
            rng: Rng::new(config.seed),
            config,
            workers: BTreeMap::new(),
            bookings: FxHashMap::default(),
            by_age: VecDeque::new(),
            peers: FxHashMap::default(),
            next_booking: 0,
            expired: 0,
            sessions: sessions::Sessions::new(config_sessions),
            stats: DecisionStats::default(),
            mean_prefill_tokens: None,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The routing policy's name.
    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    /// Adds a worker serving `model`, or updates its capacity and model. A worker added
    /// back (its lease lapsed, as in a NATS outage, while its requests ran on) carries the
    /// load of its bookings still open.
    pub fn add_worker(&mut self, key: WorkerKey, capacity_blocks: usize, model: &str) {
        let state = match self.workers.entry(key) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(e) => {
                let mut load = ActiveLoad::default();
                for b in self.bookings.values().filter(|b| b.worker == key) {
                    let (prefill_blocks, work) = match b.prefill_open {
                        true => (b.prefill_blocks, b.work),
                        // What `first_token` took off is not booked again.
                        false => (
                            0.0,
                            Work {
                                prefill_tokens: 0.0,
                                ..b.work
                            },
                        ),
                    };
                    load.book(prefill_blocks, &b.blocks, b.tail, work, b.prefill_open);
                }
                e.insert(WorkerState {
                    capacity_blocks,
                    model: model.to_owned(),
                    adapters: Vec::new(),
                    load,
                    engine_used_blocks: 0.0,
                    engine_unbooked_waiting: 0.0,
                    engine_load: None,
                    recent_blocks: 0.0,
                    recent_at_ms: 0,
                    failures: 0,
                    ejected_until_ms: 0,
                })
            }
        };
        state.capacity_blocks = capacity_blocks;
        if state.model != model {
            state.model = model.to_owned();
        }
    }

    /// The engine's own report of its load last carried by `key`'s registration (a sidecar's
    /// engine), if any.
    pub fn engine_load(&self, key: WorkerKey) -> Option<crate::engines::metrics::EngineLoad> {
        self.workers.get(&key).and_then(|s| s.engine_load)
    }

    /// The pool `model` is served from: the base model of the workers that serve it (as
    /// their model or as a LoRA adapter on it), else `model` itself. Requests of one pool
    /// compete for the same workers' room.
    pub fn pool_of<'a>(&'a self, model: &'a str) -> &'a str {
        self.workers
            .values()
            .find(|w| w.serves(model))
            .map_or(model, |w| w.model.as_str())
    }

    /// The LoRA adapters a worker serves on top of its model (requests for one of them may
    /// go there).
    pub fn set_adapters(&mut self, key: WorkerKey, adapters: Vec<String>) {
        if let Some(state) = self.workers.get_mut(&key) {
            state.adapters = adapters;
        }
    }

    /// A real engine's own report of its load (every rank of `worker`): its KV usage counts
    /// as held decode blocks where it exceeds what this router booked there, each rank's own
    /// where `rank_usage_permille` has one (a full rank is busy though its siblings are
    /// idle), else the mean; its waiting requests beyond the bookings of all its ranks not
    /// yet started count as prefill to compute, each rank an equal share. That excess is
    /// taken as the report comes and kept until the next: requests booked after it are not
    /// in the engine's count, and requests that start after it are still there. `None` (the
    /// sidecar's scrape failed) forgets the last report: a stale high usage would keep the
    /// worker looking busy for as long as its metrics stay unreadable.
    pub fn set_engine_load(
        &mut self,
        worker: WorkerId,
        load: Option<crate::engines::metrics::EngineLoad>,
        rank_usage_permille: &[u16],
    ) {
        let (ranks, open) = self
            .workers
            .range(ranks_of(worker))
            .fold((0usize, 0usize), |(n, open), (_, s)| {
                (n + 1, open + s.load.prefill_requests)
            });
        let unbooked = load.map_or(0.0, |l| {
            (f64::from(l.waiting) - open as f64).max(0.0) / ranks.max(1) as f64
        });
        for (key, state) in self.workers.range_mut(ranks_of(worker)) {
            state.engine_load = load;
            state.engine_unbooked_waiting = unbooked;
            let usage = load.map(|l| {
                rank_usage_permille
                    .get(key.1.0 as usize)
                    .map_or(l.kv_usage(), |u| f64::from(*u) / 1000.0)
            });
            state.engine_used_blocks = usage.map_or(0.0, |u| u * state.capacity_blocks as f64);
        }
    }

    /// A request could not reach `worker` (connection failed, no headers in time): returns
    /// how long it is now ejected for, ms, if this failure ejected it. Reachability is the
    /// endpoint's: every rank of the worker counts it. Failures while it is ejected (requests
    /// sent before) change nothing; the first after the ejection ends doubles it.
    pub fn worker_unreachable(&mut self, worker: WorkerId, now_ms: u64) -> Option<u64> {
        let ejection = self.config.ejection;
        let room = self.ejection_room(worker, now_ms);
        let mut ejected = None;
        for (_, state) in self.workers.range_mut(ranks_of(worker)) {
            if state.ejected(now_ms) {
                continue;
            }
            state.failures = state.failures.saturating_add(1);
            let ms = ejection.ejection_ms(state.failures);
            if ms > 0 && room {
                state.ejected_until_ms = now_ms.saturating_add(ms);
                ejected = Some(ms);
            }
        }
        ejected
    }

    /// Whether `worker` may be ejected now: the workers of its model ejected, itself
    /// included, stay within [`EjectionConfig::max_ejected_percent`] of the model's
    /// workers (at least one may be; a worker's ranks are one endpoint, ejected together).
    /// Walks the workers (a failure's ejection only).
    fn ejection_room(&self, worker: WorkerId, now_ms: u64) -> bool {
        let Some(model) = self
            .workers
            .range(ranks_of(worker))
            .next()
            .map(|(_, s)| s.model.as_str())
        else {
            return false;
        };
        // Ranks of one worker are adjacent (keys are ordered by worker first).
        let (mut workers, mut out, mut last) = (0u64, 0u64, None);
        for (key, state) in &self.workers {
            if state.model != model || last == Some(key.0) {
                continue;
            }
            last = Some(key.0);
            workers += 1;
            if key.0 == worker || state.ejected(now_ms) {
                out += 1;
            }
        }
        let most = (workers * u64::from(self.config.ejection.max_ejected_percent) / 100).max(1);
        out <= most
    }

    /// `worker` answered a request: it is reachable, and no longer ejected.
    pub fn worker_answered(&mut self, worker: WorkerId) {
        for (_, state) in self.workers.range_mut(ranks_of(worker)) {
            state.failures = 0;
            state.ejected_until_ms = 0;
        }
    }

    /// Whether `key` sits out at `now_ms` after failed requests ([`EjectionConfig`]).
    pub fn ejected(&self, key: WorkerKey, now_ms: u64) -> bool {
        self.workers.get(&key).is_some_and(|s| s.ejected(now_ms))
    }

    /// The ranks of `worker` known.
    pub fn ranks(&self, worker: WorkerId) -> impl Iterator<Item = WorkerKey> + '_ {
        self.workers.range(ranks_of(worker)).map(|(k, _)| *k)
    }

    /// Removes a worker (its sessions move on their next turn). Its bookings stay until
    /// their guards or the TTL release them: their requests may still be running (a lease
    /// that lapsed while the worker served on), and are booked again if it comes back.
    pub fn remove_worker(&mut self, key: WorkerKey) {
        self.workers.remove(&key);
    }

    /// Booked work over every worker, tokens.
    pub fn booked_work_tokens(&self) -> f64 {
        self.workers.values().map(|w| w.load.work_tokens).sum()
    }

    /// Workers known.
    pub fn workers(&self) -> impl Iterator<Item = (WorkerKey, &ActiveLoad)> {
        self.workers.iter().map(|(k, w)| (*k, &w.load))
    }

    /// Bookings dropped by the TTL so far.
    pub fn expired_bookings(&self) -> u64 {
        self.expired
    }

    /// The cost for `request` of every worker serving its model at `now_ms`, without booking
    /// anything (`/admin/explain`).
    pub fn candidates(&self, now_ms: u64, request: &RouteRequest<'_>) -> Vec<Candidate> {
        let c = &self.config;
        let bs = request.block_size.max(1) as f64;
        let prompt_blocks = request.prompt_tokens as f64 / bs;
        let decode_tokens = request.expected_decode(c.admission.decode_cap_tokens);
        let budget = c.admission.worker_budget_tokens as f64;
        // One lookup per candidate: `OverlapScores::get` searches its list, which made a
        // decision quadratic in the ranks where a shared prefix is cached on all of them
        // (512 ranks: 262,144 comparisons, under the scheduler's lock).
        let overlaps: FxHashMap<(WorkerId, DpRank), Overlap> = request
            .overlaps
            .workers
            .iter()
            .map(|o| ((o.worker, o.dp_rank), *o))
            .collect();
        self.workers
            .iter()
            .filter(|(_, state)| state.serves(request.model))
            .map(|(key, state)| {
                let overlap = overlaps.get(&(key.0, key.1)).copied().unwrap_or(Overlap {
                    worker: key.0,
                    dp_rank: key.1,
                    device: 0,
                    host: 0,
                    disk: 0,
                });
                // Blocks of requests this router sent there are being computed or held: by
                // the time this request is admitted they are G1 hits, though no event has
                // announced them yet (a burst of requests sharing a prefix, or event lag).
                // The blocks bookings hold are closed under prefixes (a booking holds all of
                // its prompt's full blocks, and a block's hash names its whole prefix), so
                // the held blocks of this prompt are a leading run: found by bisection, a few
                // lookups per worker instead of one per held block. A peer's booking is
                // input from the network, trusted to hold its prompt's leading blocks as
                // this router's own do (a message too small for a booking keeps its first
                // blocks). One that lacks the first block (a faulty peer) would have the
                // bisection credit blocks held nowhere, so a run that does not start at
                // block 0 credits nothing (a debug assertion here was tripped by such a
                // message); a hole further in is not looked for (a linear check per worker
                // would cost what the bisection saves): a faulty peer can misdirect load,
                // as one that books what it likes can, never the index.
                let booked_prefix = match request.blocks.first() {
                    Some(first) if state.load.holds(first.seq) => {
                        request.blocks.partition_point(|b| state.load.holds(b.seq)) as u32
                    }
                    _ => 0,
                };
                let indexed = c.device_weight * f64::from(overlap.device)
                    + c.host_weight * f64::from(overlap.host)
                    + c.disk_weight * f64::from(overlap.disk);
                let credit = indexed.max(c.device_weight * f64::from(booked_prefix));
                // Requests the engine said were waiting beyond those booked there: load from
                // clients that bypass kvroute, or routers of another fleet. The engine does
                // not say how long their prompts are; each counts as a prefill of the mean
                // this router books (or of this prompt, before it has booked any).
                let prefill_blocks = state.load.prefill_blocks
                    + state.engine_unbooked_waiting
                        * self.mean_prefill_tokens.map_or(prompt_blocks, |t| t / bs);
                let decode_blocks =
                    (state.load.decode_blocks() as f64).max(state.engine_used_blocks);
                let recent_blocks = self.recent(state, now_ms);
                let cost = c.prefill_scale * (prompt_blocks - credit).max(0.0)
                    + prefill_blocks
                    + c.decode_weight * decode_blocks
                    + c.recent_weight * recent_blocks;
                let busy = decode_blocks > c.busy_decode_fraction * state.capacity_blocks as f64
                    || (c.busy_prefill_blocks > 0.0 && prefill_blocks > c.busy_prefill_blocks);
                let cached = (overlap.device + overlap.host + overlap.disk).max(booked_prefix);
                let work = Work {
                    prefill_tokens: (request.prompt_tokens as f64 - f64::from(cached) * bs)
                        .max(0.0),
                    decode_tokens,
                };
                let booked_work_tokens = state.load.work_tokens;
                let room = fits(booked_work_tokens, work.total(), budget);
                Candidate {
                    key: *key,
                    overlap,
                    booked_prefix,
                    cost,
                    prefill_blocks,
                    decode_blocks,
                    busy,
                    work,
                    booked_work_tokens,
                    room,
                }
            })
            .collect()
    }

    /// The prompt blocks of the requests routed to a worker recently, decayed to `now_ms`.
    fn recent(&self, state: &WorkerState, now_ms: u64) -> f64 {
        let age = now_ms.saturating_sub(state.recent_at_ms) as f64;
        state.recent_blocks * (-age / self.config.recent_half_life_ms as f64).exp2()
    }

    /// Picks a worker for `request` and books its load, whatever the budgets; `None` when
    /// no worker serves its model.
    pub fn route(&mut self, now_ms: u64, request: &RouteRequest<'_>) -> Option<Decision> {
        self.route_excluding(now_ms, request, &[])
    }

    /// Like [`Scheduler::route`], leaving out workers that already failed this request (an
    /// admitted request being retried: the budgets do not apply again).
    pub fn route_excluding(
        &mut self,
        now_ms: u64,
        request: &RouteRequest<'_>,
        exclude: &[WorkerKey],
    ) -> Option<Decision> {
        match self.decide(now_ms, request, exclude, None, &[]) {
            Admission::Routed(d) => Some(d),
            Admission::Wait | Admission::FleetFull | Admission::NoWorkers => None,
        }
    }

    /// Admission by work: routes and books `request` if a worker of its model has room for
    /// it under the budgets (and, with hard session affinity, if its session's worker has),
    /// else says it must wait, or that no worker serves its model.
    pub fn admit(&mut self, now_ms: u64, request: &RouteRequest<'_>) -> Admission {
        self.admit_within(now_ms, request, 1.0)
    }

    /// Like [`Scheduler::admit`], for a request whose band may fill only `share` (0..=1) of
    /// the budgets.
    pub fn admit_within(
        &mut self,
        now_ms: u64,
        request: &RouteRequest<'_>,
        share: f64,
    ) -> Admission {
        self.admit_reserving(now_ms, request, share, &[])
    }

    /// Like [`Scheduler::admit_within`], with the room of `reserved` workers kept for
    /// requests waiting for them (hard session affinity): this request waits rather than
    /// take it.
    pub fn admit_reserving(
        &mut self,
        now_ms: u64,
        request: &RouteRequest<'_>,
        share: f64,
        reserved: &[WorkerKey],
    ) -> Admission {
        self.decide(now_ms, request, &[], Some(share.clamp(0.0, 1.0)), reserved)
    }

    /// The workers `request` may go to now, and the most cache any candidate has for it:
    /// its model's workers less `exclude`, and less ejected ones unless no other serves the
    /// model (one that failed this request still serves it: its retry does not go to an
    /// ejected worker).
    fn eligible(
        &self,
        now_ms: u64,
        request: &RouteRequest<'_>,
        exclude: &[WorkerKey],
    ) -> (Vec<Candidate>, u32) {
        let mut all = self.candidates(now_ms, request);
        let reachable = all.iter().map(Candidate::cached_blocks).max().unwrap_or(0);
        let out = self.sitting_out(now_ms, &all);
        all.retain(|c| !(exclude.contains(&c.key) || out.contains(&c.key)));
        (all, reachable)
    }

    /// Of `candidates`, those a decision at `now_ms` leaves out for an ejection: every one
    /// ejected, unless all are (an ejected worker still serves when no other can).
    pub fn sitting_out(&self, now_ms: u64, candidates: &[Candidate]) -> FxHashSet<WorkerKey> {
        let out: FxHashSet<WorkerKey> = candidates
            .iter()
            .filter(|c| self.workers.get(&c.key).is_some_and(|s| s.ejected(now_ms)))
            .map(|c| c.key)
            .collect();
        if out.len() == candidates.len() {
            return FxHashSet::default();
        }
        out
    }

    /// The worker a hard-session request is held to, as [`Scheduler::admit`] holds it: its
    /// session's worker while that worker may take it (registered for its model, not sitting
    /// out an ejection while another serves it). `None`: it may go anywhere (a new session,
    /// or one whose worker left or sits out), so it waits for room anywhere.
    pub fn pinned_worker(&self, now_ms: u64, request: &RouteRequest<'_>) -> Option<WorkerKey> {
        let session = request.session.filter(|s| s.hard)?;
        let worker = self.sessions.peek(now_ms, session.id)?;
        let (all, _) = self.eligible(now_ms, request, &[]);
        all.iter().any(|c| c.key == worker).then_some(worker)
    }

    fn decide(
        &mut self,
        now_ms: u64,
        request: &RouteRequest<'_>,
        exclude: &[WorkerKey],
        budget_share: Option<f64>,
        reserved: &[WorkerKey],
    ) -> Admission {
        self.expire(now_ms);
        let (mut all, reachable) = self.eligible(now_ms, request, exclude);
        if all.is_empty() {
            return Admission::NoWorkers;
        }
        let session = request
            .session
            .map(|s| (s, self.sessions.worker(now_ms, s.id)));
        // The session's worker, if it is still registered for this model.
        let pinned = session
            .and_then(|(_, w)| w)
            .filter(|w| all.iter().any(|c| c.key == *w));
        if let Some(w) = pinned
            && request.session.is_some_and(|s| s.hard)
        {
            all.retain(|c| c.key == w);
        }
        if let Some(share) = budget_share {
            let fleet = share * self.config.admission.fleet_budget_tokens as f64;
            let work = all.iter().map(|c| c.work.total()).fold(f64::MAX, f64::min);
            if !fits(self.booked_work_tokens(), work, fleet) {
                return Admission::FleetFull;
            }
            let budget = share * self.config.admission.worker_budget_tokens as f64;
            all.retain(|c| {
                fits(c.booked_work_tokens, c.work.total(), budget) && !reserved.contains(&c.key)
            });
            if all.is_empty() {
                return Admission::Wait;
            }
        }
        // Busy workers sit out unless everyone is busy (not for the plain baselines).
        let idle: Vec<Candidate> = if self.policy.skips_busy() {
            all.iter().filter(|c| !c.busy).copied().collect()
        } else {
            Vec::new()
        };
        let mut pool = if idle.is_empty() { all } else { idle };
        // A new session: workers holding more live sessions than the least-held one cost
        // more (their sessions' next turns will come back to them).
        if let Some((_, None)) = session {
            let spread = self.config.sessions.spread_weight;
            let counts: Vec<u32> = pool
                .iter()
                .map(|c| self.sessions.on_worker(c.key))
                .collect();
            let least = counts.iter().copied().min().unwrap_or(0);
            for (c, n) in pool.iter_mut().zip(counts) {
                c.cost += spread * f64::from(n - least);
            }
        }
        // Soft affinity, sticky until saturated: the session's worker while it is in the
        // pool (room under the budget, not busy); out of it, the session yields to the cost.
        let stuck = pinned.and_then(|w| pool.iter().position(|c| c.key == w));
        let chosen = match stuck {
            Some(i) => pool[i],
            None => pool[self.policy.pick(request, &pool, &mut self.rng, now_ms)],
        };
        if let Some((s, was)) = session {
            self.sessions
                .routed(now_ms, s.id, was, chosen.key, pinned.is_some());
        }
        let booking = self.book(now_ms, chosen, request);
        let receipt = Receipt {
            prompt_blocks: request.blocks.len() as u32,
            cached_blocks: chosen.cached_blocks(),
            reachable_blocks: reachable,
            cost: chosen.cost,
        };
        self.stats.record(&receipt);
        Admission::Routed(Decision {
            chosen,
            booking,
            receipt,
        })
    }

    /// A request's work as the queue weighs it for fairness, tokens: the prefill left after
    /// the longest prefix any worker has cached, plus its expected decode.
    pub fn queue_work(&self, request: &RouteRequest<'_>) -> u64 {
        let cached = request
            .overlaps
            .workers
            .iter()
            .map(|o| (o.device + o.host + o.disk) as usize)
            .max()
            .unwrap_or(0);
        request
            .prompt_tokens
            .saturating_sub(cached * request.block_size) as u64
            + request.expected_decode(self.config.admission.decode_cap_tokens)
    }

    /// Totals over every decision so far.
    pub fn decision_stats(&self) -> DecisionStats {
        self.stats
    }

    /// What session affinity did so far.
    pub fn session_stats(&self) -> SessionStats {
        self.sessions.stats()
    }

    /// Forgets the sessions past their TTL at `now_ms`. Sessions are otherwise forgotten
    /// only as session requests come: after a burst of them, up to `max_sessions` entries
    /// (and the live count, and each worker's share of new sessions) stayed as they were.
    pub fn forget_sessions(&mut self, now_ms: u64) {
        self.sessions.forget(now_ms);
    }

    /// The worker a session sticks to, if it is remembered at `now_ms`.
    pub fn session_worker(&self, now_ms: u64, id: &str) -> Option<WorkerKey> {
        self.sessions.peek(now_ms, id)
    }

    fn book(&mut self, now_ms: u64, chosen: Candidate, request: &RouteRequest<'_>) -> BookingId {
        let bs = request.block_size.max(1);
        let prefill_tokens =
            (request.prompt_tokens as f64 - f64::from(chosen.cached_blocks()) * bs as f64).max(0.0);
        let blocks: Vec<SeqHash> = request.blocks.iter().map(|b| b.seq).collect();
        let tail = !request.prompt_tokens.is_multiple_of(bs);
        self.mean_prefill_tokens = Some(self.mean_prefill_tokens.map_or(prefill_tokens, |mean| {
            mean + PREFILL_MEAN_WEIGHT * (prefill_tokens - mean)
        }));
        self.next_booking += 1;
        let id = BookingId {
            origin: self.config.replica_id,
            seq: self.next_booking,
        };
        self.insert_booking(
            now_ms,
            id,
            chosen.key,
            prefill_tokens / bs as f64,
            blocks,
            tail,
            chosen.work,
            request.session.map(|s| sessions::session_key(s.id)),
        );
        id
    }

    #[allow(clippy::too_many_arguments)]
    fn insert_booking(
        &mut self,
        now_ms: u64,
        id: BookingId,
        worker: WorkerKey,
        prefill_blocks: f64,
        blocks: Vec<SeqHash>,
        tail: bool,
        work: Work,
        session: Option<sessions::SessionKey>,
    ) {
        let recent = self
            .workers
            .get(&worker)
            .map(|state| self.recent(state, now_ms))
            .unwrap_or(0.0);
        let state = self
            .workers
            .get_mut(&worker)
            .expect("invariant: bookings are made on known workers");
        state.load.book(prefill_blocks, &blocks, tail, work, true);
        let blocks_len = blocks.len();
        state.recent_blocks = recent + (blocks.len() + usize::from(tail)) as f64;
        state.recent_at_ms = now_ms;
        self.bookings.insert(
            id,
            Booking {
                worker,
                work,
                prefill_blocks,
                blocks,
                tail,
                booked_ms: now_ms,
                prefill_open: true,
                session,
            },
        );
        // Only what peers shared expires: this router's own bookings have live guards.
        if id.origin != self.config.replica_id {
            self.by_age.push_back((now_ms, id));
            let peer = self.peers.entry(id.origin).or_default();
            peer.0 += 1;
            peer.1 += blocks_len;
        }
    }

    /// A booking in the form replicas share.
    pub fn shared(&self, id: BookingId) -> Option<SharedBooking> {
        self.bookings.get(&id).map(|b| SharedBooking {
            id,
            worker: b.worker.0,
            dp_rank: b.worker.1,
            prefill_blocks: if b.prefill_open {
                b.prefill_blocks
            } else {
                0.0
            },
            blocks: b.blocks.clone(),
            tail: b.tail,
            prefill_tokens: if b.prefill_open {
                b.work.prefill_tokens
            } else {
                0.0
            },
            decode_tokens: b.work.decode_tokens,
            session: b.session,
        })
    }

    /// Whether booking `id` is open and its first token was seen.
    pub fn started(&self, id: BookingId) -> bool {
        self.bookings.get(&id).is_some_and(|b| !b.prefill_open)
    }

    /// Books load another replica routed (idempotent), after checking it: a peer's message
    /// is input from the network like any other.
    pub fn book_shared(&mut self, now_ms: u64, b: SharedBooking) -> Result<(), SharedBookingError> {
        if b.blocks.len() > MAX_SHARED_BLOCKS {
            return Err(SharedBookingError::TooLarge {
                blocks: b.blocks.len(),
            });
        }
        // Not bounded by the blocks sent: a booking too large for one message goes with
        // its first blocks only ([`crate::events::load::Outbox`]), its prefill whole.
        let most = MAX_SHARED_BLOCKS as f64 + 1.0;
        if !b.prefill_blocks.is_finite() || !(0.0..=most).contains(&b.prefill_blocks) {
            return Err(SharedBookingError::Prefill {
                prefill_blocks: b.prefill_blocks,
            });
        }
        const MOST_TOKENS: f64 = (1u64 << 40) as f64;
        if !b.prefill_tokens.is_finite()
            || !(0.0..MOST_TOKENS).contains(&b.prefill_tokens)
            || b.decode_tokens as f64 >= MOST_TOKENS
        {
            return Err(SharedBookingError::Work {
                prefill_tokens: b.prefill_tokens,
                decode_tokens: b.decode_tokens,
            });
        }
        let key = (b.worker, b.dp_rank);
        if !self.workers.contains_key(&key) {
            return Err(SharedBookingError::UnknownWorker { worker: b.worker });
        }
        if self.bookings.contains_key(&b.id) {
            return Ok(());
        }
        let (bookings, blocks) = self.peers.get(&b.id.origin).copied().unwrap_or_default();
        if bookings >= MAX_PEER_BOOKINGS || blocks + b.blocks.len() > MAX_PEER_BLOCKS {
            return Err(SharedBookingError::PeerFull {
                origin: b.id.origin,
                bookings,
                blocks,
            });
        }
        let work = Work {
            prefill_tokens: b.prefill_tokens,
            decode_tokens: b.decode_tokens,
        };
        self.insert_booking(
            now_ms,
            b.id,
            key,
            b.prefill_blocks,
            b.blocks,
            b.tail,
            work,
            b.session,
        );
        if let Some(session) = b.session {
            self.sessions.learned(now_ms, session, key);
        }
        Ok(())
    }

    /// The numbers of the open bookings `origin` made, ascending.
    pub fn open_seqs(&self, origin: u64) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .bookings
            .keys()
            .filter(|id| id.origin == origin)
            .map(|id| id.seq)
            .collect();
        v.sort_unstable();
        v
    }

    /// Numbers this replica's bookings from its start time, `started_unix_ms`, shifted
    /// above [`BOOKING_SEQ_BITS`] bits. A replica restarted under the same pinned
    /// `replica_id` then numbers past every booking of its previous life (which would have
    /// had to book more than 4 M requests a millisecond to get there): its peers keep the
    /// booking they hold under a number, so a number used again would have left the new
    /// booking unseen and had its completion end the old one, and its first heartbeat
    /// ("open among those below next") now drops every booking of the previous life at
    /// once instead of leaving those numbered past the new count to their TTL. This trusts
    /// the clock: a restart whose clock reads earlier than its previous life's start (a
    /// node skewed by more than that life's uptime) numbers below it, and the old bookings
    /// numbered past the new count wait out their TTL as before (none collides unless the
    /// new life catches up with them). Start times up to the year 2109 fit; later ones
    /// count as that.
    pub fn number_bookings_from(&mut self, started_unix_ms: u64) {
        let base = started_unix_ms.min((1 << (64 - BOOKING_SEQ_BITS)) - 1) << BOOKING_SEQ_BITS;
        self.next_booking = self.next_booking.max(base);
    }

    /// The number this scheduler's next booking will get.
    pub fn next_seq(&self) -> u64 {
        self.next_booking + 1
    }

    /// A peer says at `now_ms` which of its bookings numbered below `next` it still holds
    /// (`open`, inclusive ranges): the others are completed here. Those it holds run on,
    /// however long (a stream may outlast any fixed time): their TTL starts again once they
    /// are half way through it. Returns how many were completed.
    pub fn reconcile_origin(
        &mut self,
        origin: u64,
        open: &[(u64, u64)],
        next: u64,
        now_ms: u64,
    ) -> usize {
        // Each booking is found by bisection, not by a scan of thousands of ranges under
        // the scheduler's lock.
        let open = normalized_ranges(open);
        let held = |seq: u64| in_ranges(&open, seq);
        let refresh_after = self.config.booking_ttl_ms / 2;
        let mut stale = Vec::new();
        for (id, b) in &mut self.bookings {
            if id.origin != origin || id.seq >= next {
                continue;
            }
            if !held(id.seq) {
                stale.push(*id);
            } else if now_ms.saturating_sub(b.booked_ms) > refresh_after {
                // Its entry of the old age no longer expires it (`expire` matches ages).
                b.booked_ms = now_ms;
                self.by_age.push_back((now_ms, *id));
            }
        }
        for id in &stale {
            self.complete(*id);
        }
        stale.len()
    }

    /// The numbers below `next` in `open` (inclusive ranges a heartbeat of `origin` named
    /// open) of which no booking is held here, as at most `max` ranges, lowest first.
    pub fn missing_from(
        &self,
        origin: u64,
        open: &[(u64, u64)],
        next: u64,
        max: usize,
    ) -> Vec<(u64, u64)> {
        let open = normalized_ranges(open);
        let held = self.open_seqs(origin);
        let mut out = Vec::new();
        for &(a, b) in open.iter() {
            if a >= next {
                break;
            }
            let b = b.min(next - 1);
            // The held numbers inside [a, b] split it into the missing gaps between them.
            let mut from = a;
            let first = held.partition_point(|s| *s < a);
            for &s in held[first..].iter().take_while(|s| **s <= b) {
                if s > from {
                    out.push((from, s - 1));
                }
                from = s + 1;
            }
            if from <= b {
                out.push((from, b));
            }
            if out.len() >= max {
                out.truncate(max);
                break;
            }
        }
        out
    }

    /// Drops every booking a replica made (it stopped announcing itself). Returns how many.
    pub fn drop_origin(&mut self, origin: u64) -> usize {
        let ids: Vec<BookingId> = self
            .bookings
            .keys()
            .filter(|id| id.origin == origin)
            .copied()
            .collect();
        for id in &ids {
            self.complete(*id);
        }
        ids.len()
    }

    /// The request produced its first token: its prefill no longer loads the worker.
    pub fn first_token(&mut self, id: BookingId) {
        if let Some(b) = self.bookings.get_mut(&id)
            && b.prefill_open
        {
            b.prefill_open = false;
            if let Some(w) = self.workers.get_mut(&b.worker) {
                w.load.prefill_done(b.prefill_blocks, b.work);
            }
        }
    }

    /// The request finished (or failed, or was cancelled): everything it booked is freed.
    pub fn complete(&mut self, id: BookingId) {
        if let Some(b) = self.bookings.remove(&id) {
            self.release(id, b);
        }
    }

    fn release(&mut self, id: BookingId, b: Booking) {
        if id.origin != self.config.replica_id
            && let Some(peer) = self.peers.get_mut(&id.origin)
        {
            peer.0 -= 1;
            peer.1 -= b.blocks.len();
            if peer.0 == 0 {
                self.peers.remove(&id.origin);
            }
        }
        if let Some(w) = self.workers.get_mut(&b.worker) {
            if b.prefill_open {
                w.load.prefill_done(b.prefill_blocks, b.work);
            }
            w.load.release(&b.blocks, b.tail, b.work);
        }
    }

    /// Drops peers' bookings older than the TTL.
    pub fn expire(&mut self, now_ms: u64) {
        self.sessions.forget(now_ms);
        let ttl = self.config.booking_ttl_ms;
        while let Some(&(at, id)) = self.by_age.front() {
            if now_ms.saturating_sub(at) <= ttl {
                break;
            }
            self.by_age.pop_front();
            // The id may have been completed and booked again since (a peer's booking sent
            // twice): only the entry of this age expires.
            if self.bookings.get(&id).is_some_and(|b| b.booked_ms == at)
                && let Some(b) = self.bookings.remove(&id)
            {
                self.expired += 1;
                self.release(id, b);
            }
        }
        // Completed bookings leave their ids behind; keep the queue bounded by live ones.
        if self.by_age.len() > 2 * self.bookings.len() + 64 {
            let live = &self.bookings;
            self.by_age.retain(|(_, id)| live.contains_key(id));
        }
    }

    /// The booked load of one worker.
    pub fn load(&self, key: WorkerKey) -> Option<&ActiveLoad> {
        self.workers.get(&key).map(|w| &w.load)
    }

    /// Bookings not yet completed.
    pub fn open_bookings(&self) -> usize {
        self.bookings.len()
    }

    /// Entries of the peers' bookings' age queue (completed ones are dropped lazily).
    #[cfg(test)]
    pub(crate) fn age_queue_len(&self) -> usize {
        self.by_age.len()
    }
}

/// Whether `work` fits beside `booked` under `budget` (tokens): always when the budget is
/// off (0) or nothing is booked, so an idle worker takes a request however large. Work over
/// half the budget counts as half: such a request goes to a worker at most half booked,
/// where otherwise it would wait for one to drain completely (which, under steady load,
/// may not come before its deadline) and hold back its model's whole queue meanwhile.
fn fits(booked: f64, work: f64, budget: f64) -> bool {
    budget == 0.0 || booked <= 0.0 || booked + work.min(budget / 2.0) <= budget
}

#[cfg(test)]
mod tests;
