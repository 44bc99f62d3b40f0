//! Picks the worker for each request and keeps the router's view of every worker's load.
//! No I/O: the ingress and the replay bench drive it with an injected clock (`now_ms`).
//!
//! cost(worker) = prefill_scale · max(prompt_blocks − (device_weight·device +
//! host_weight·host + disk_weight·disk), 0) + active_prefill_blocks +
//! decode_weight · active_decode_blocks (DESIGN §8, with the decode term weighted). Load is booked at routing, prefill released at the first token, the rest at
//! completion; bookings never released expire after `booking_ttl_ms`.

mod load;
pub mod mismatch;
mod policy;
mod rng;

use std::collections::{BTreeMap, VecDeque};

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

pub use load::ActiveLoad;
pub use policy::{ApproxConfig, Policy, PolicyKind};
pub use rng::Rng;

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
    /// costs normalised by the largest, at this temperature.
    pub temperature: f64,
    /// A worker whose booked blocks exceed this share of its G1 capacity is busy.
    pub busy_decode_fraction: f64,
    /// A worker with more uncached prefill booked than this many blocks is busy (0 = off).
    pub busy_prefill_blocks: f64,
    /// Bookings not completed within this time are dropped, ms.
    pub booking_ttl_ms: u64,
    /// Seed of the tie-break and sampling generator.
    pub seed: u64,
    /// This router replica's id in shared bookings (unique per replica; 0 is fine alone).
    pub replica_id: u64,
    /// Settings of the `approx_prefix` policy.
    pub approx: ApproxConfig,
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
}

impl Config {
    /// Checks every weight's range: each float finite (NaN and infinities are rejected, a
    /// NaN weight would make every cost NaN) and inside its documented range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let unit = |v: f64| (0.0..=1.0).contains(&v);
        let non_negative = |v: f64| v >= 0.0;
        type Check = (&'static str, f64, fn(f64) -> bool, &'static str);
        let checks: [Check; 9] = [
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
        ];
        match checks
            .into_iter()
            .find(|(_, v, ok, _)| !v.is_finite() || !ok(*v))
        {
            Some((field, value, _, range)) => Err(ConfigError::OutOfRange {
                field,
                value,
                range,
            }),
            None => Ok(()),
        }
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
    /// Uncached prefill booked on it, blocks.
    pub prefill_blocks: f64,
    /// Blocks its booked requests hold.
    pub decode_blocks: f64,
    /// Over a busy threshold.
    pub busy: bool,
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
}

/// Most blocks a peer's booking may hold (a 16 M-token prompt at block size 16).
pub const MAX_SHARED_BLOCKS: usize = 1 << 20;

/// Why a peer's booking was refused.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SharedBookingError {
    /// More blocks than any prompt has.
    #[error("booking holds {blocks} blocks, over {MAX_SHARED_BLOCKS}")]
    TooLarge {
        /// Its block count.
        blocks: usize,
    },
    /// Prefill that is not a finite number between 0 and its block count.
    #[error("booking's prefill {prefill_blocks} is not in 0..=blocks+1")]
    Prefill {
        /// The value sent.
        prefill_blocks: f64,
    },
    /// A worker this router does not know (not registered, or not yet).
    #[error("booking for unknown worker {worker}")]
    UnknownWorker {
        /// The worker.
        worker: WorkerId,
    },
}

/// The scheduler's answer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Decision {
    /// Where the request goes, and why.
    pub chosen: Candidate,
    /// Its booking: call [`Scheduler::first_token`] and [`Scheduler::complete`] with it.
    pub booking: BookingId,
}

#[derive(Debug)]
struct Booking {
    worker: WorkerKey,
    prefill_blocks: f64,
    blocks: Vec<SeqHash>,
    tail: bool,
    booked_ms: u64,
    prefill_open: bool,
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
}

impl WorkerState {
    fn serves(&self, model: &str) -> bool {
        self.model == model || self.adapters.iter().any(|a| a == model)
    }
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
    next_booking: u64,
    expired: u64,
}

impl Scheduler {
    /// A scheduler with no workers.
    pub fn new(config: Config) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(Scheduler {
            policy: config.policy.build(config.temperature, config.approx),
            rng: Rng::new(config.seed),
            config,
            workers: BTreeMap::new(),
            bookings: FxHashMap::default(),
            by_age: VecDeque::new(),
            next_booking: 0,
            expired: 0,
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

    /// Adds a worker serving `model`, or updates its capacity and model.
    pub fn add_worker(&mut self, key: WorkerKey, capacity_blocks: usize, model: &str) {
        let state = self.workers.entry(key).or_insert_with(|| WorkerState {
            capacity_blocks,
            model: model.to_owned(),
            adapters: Vec::new(),
            load: ActiveLoad::default(),
            engine_used_blocks: 0.0,
        });
        state.capacity_blocks = capacity_blocks;
        if state.model != model {
            state.model = model.to_owned();
        }
    }

    /// The LoRA adapters a worker serves on top of its model (requests for one of them may
    /// go there).
    pub fn set_adapters(&mut self, key: WorkerKey, adapters: Vec<String>) {
        if let Some(state) = self.workers.get_mut(&key) {
            state.adapters = adapters;
        }
    }

    /// A real engine's own report of its load (every rank of `worker`): its KV usage counts
    /// as held decode blocks where it exceeds what this router booked there.
    pub fn set_engine_load(&mut self, worker: WorkerId, load: crate::engines::metrics::EngineLoad) {
        for (key, state) in self.workers.iter_mut() {
            if key.0 == worker {
                state.engine_used_blocks = load.kv_usage() * state.capacity_blocks as f64;
            }
        }
    }

    /// Removes a worker and drops its bookings.
    pub fn remove_worker(&mut self, key: WorkerKey) {
        self.workers.remove(&key);
        self.bookings.retain(|_, b| b.worker != key);
    }

    /// Workers known.
    pub fn workers(&self) -> impl Iterator<Item = (WorkerKey, &ActiveLoad)> {
        self.workers.iter().map(|(k, w)| (*k, &w.load))
    }

    /// Bookings dropped by the TTL so far.
    pub fn expired_bookings(&self) -> u64 {
        self.expired
    }

    /// The cost for `request` of every worker serving its model, without booking anything
    /// (`/admin/explain`).
    pub fn candidates(&self, request: &RouteRequest<'_>) -> Vec<Candidate> {
        let c = &self.config;
        let prompt_blocks = request.prompt_tokens as f64 / request.block_size.max(1) as f64;
        self.workers
            .iter()
            .filter(|(_, state)| state.serves(request.model))
            .map(|(key, state)| {
                let overlap = request.overlaps.get(key.0, key.1);
                // Blocks of requests this router sent there are being computed or held: by
                // the time this request is admitted they are G1 hits, though no event has
                // announced them yet (a burst of requests sharing a prefix, or event lag).
                let booked_prefix = request
                    .blocks
                    .iter()
                    .take_while(|b| state.load.holds(b.seq))
                    .count() as u32;
                let indexed = c.device_weight * f64::from(overlap.device)
                    + c.host_weight * f64::from(overlap.host)
                    + c.disk_weight * f64::from(overlap.disk);
                let credit = indexed.max(c.device_weight * f64::from(booked_prefix));
                let prefill_blocks = state.load.prefill_blocks;
                let decode_blocks =
                    (state.load.decode_blocks() as f64).max(state.engine_used_blocks);
                let cost = c.prefill_scale * (prompt_blocks - credit).max(0.0)
                    + prefill_blocks
                    + c.decode_weight * decode_blocks;
                let busy = decode_blocks > c.busy_decode_fraction * state.capacity_blocks as f64
                    || (c.busy_prefill_blocks > 0.0 && prefill_blocks > c.busy_prefill_blocks);
                Candidate {
                    key: *key,
                    overlap,
                    booked_prefix,
                    cost,
                    prefill_blocks,
                    decode_blocks,
                    busy,
                }
            })
            .collect()
    }

    /// Picks a worker for `request` and books its load; `None` when no worker is known.
    pub fn route(&mut self, now_ms: u64, request: &RouteRequest<'_>) -> Option<Decision> {
        self.route_excluding(now_ms, request, &[])
    }

    /// Like [`Scheduler::route`], leaving out workers that already failed this request.
    pub fn route_excluding(
        &mut self,
        now_ms: u64,
        request: &RouteRequest<'_>,
        exclude: &[WorkerKey],
    ) -> Option<Decision> {
        self.expire(now_ms);
        let mut all = self.candidates(request);
        all.retain(|c| !exclude.contains(&c.key));
        if all.is_empty() {
            return None;
        }
        // Busy workers sit out unless everyone is busy.
        let idle: Vec<Candidate> = all.iter().filter(|c| !c.busy).copied().collect();
        let pool = if idle.is_empty() { all } else { idle };
        let chosen = pool[self.policy.pick(request, &pool, &mut self.rng, now_ms)];
        let booking = self.book(now_ms, chosen, request);
        Some(Decision { chosen, booking })
    }

    fn book(&mut self, now_ms: u64, chosen: Candidate, request: &RouteRequest<'_>) -> BookingId {
        let bs = request.block_size.max(1);
        let o = chosen.overlap;
        let cached = ((o.device + o.host + o.disk).max(chosen.booked_prefix)) as usize;
        let prefill_blocks = (request.prompt_tokens as f64 / bs as f64 - cached as f64).max(0.0);
        let blocks: Vec<SeqHash> = request.blocks.iter().map(|b| b.seq).collect();
        let tail = !request.prompt_tokens.is_multiple_of(bs);
        let state = self
            .workers
            .get_mut(&chosen.key)
            .expect("invariant: candidates are known workers");
        state.load.book(prefill_blocks, &blocks, tail);
        self.next_booking += 1;
        let id = BookingId {
            origin: self.config.replica_id,
            seq: self.next_booking,
        };
        self.bookings.insert(
            id,
            Booking {
                worker: chosen.key,
                prefill_blocks,
                blocks,
                tail,
                booked_ms: now_ms,
                prefill_open: true,
            },
        );
        self.by_age.push_back((now_ms, id));
        id
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
        })
    }

    /// Books load another replica routed (idempotent), after checking it: a peer's message
    /// is input from the network like any other.
    pub fn book_shared(&mut self, now_ms: u64, b: SharedBooking) -> Result<(), SharedBookingError> {
        if b.blocks.len() > MAX_SHARED_BLOCKS {
            return Err(SharedBookingError::TooLarge {
                blocks: b.blocks.len(),
            });
        }
        let most = b.blocks.len() as f64 + 1.0;
        if !b.prefill_blocks.is_finite() || !(0.0..=most).contains(&b.prefill_blocks) {
            return Err(SharedBookingError::Prefill {
                prefill_blocks: b.prefill_blocks,
            });
        }
        let key = (b.worker, b.dp_rank);
        let Some(state) = self.workers.get_mut(&key) else {
            return Err(SharedBookingError::UnknownWorker { worker: b.worker });
        };
        if self.bookings.contains_key(&b.id) {
            return Ok(());
        }
        state.load.book(b.prefill_blocks, &b.blocks, b.tail);
        self.bookings.insert(
            b.id,
            Booking {
                worker: key,
                prefill_blocks: b.prefill_blocks,
                blocks: b.blocks,
                tail: b.tail,
                booked_ms: now_ms,
                prefill_open: true,
            },
        );
        self.by_age.push_back((now_ms, b.id));
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

    /// The number this scheduler's next booking will get.
    pub fn next_seq(&self) -> u64 {
        self.next_booking + 1
    }

    /// A peer says which of its bookings numbered below `next` it still holds (`open`,
    /// inclusive ranges): the others are completed here. Returns how many.
    pub fn reconcile_origin(&mut self, origin: u64, open: &[(u64, u64)], next: u64) -> usize {
        let stale: Vec<BookingId> = self
            .bookings
            .keys()
            .filter(|id| {
                id.origin == origin
                    && id.seq < next
                    && !open.iter().any(|(a, b)| (*a..=*b).contains(&id.seq))
            })
            .copied()
            .collect();
        for id in &stale {
            self.complete(*id);
        }
        stale.len()
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
                w.load.prefill_done(b.prefill_blocks);
            }
        }
    }

    /// The request finished (or failed, or was cancelled): everything it booked is freed.
    pub fn complete(&mut self, id: BookingId) {
        if let Some(b) = self.bookings.remove(&id) {
            self.release(b);
        }
    }

    fn release(&mut self, b: Booking) {
        if let Some(w) = self.workers.get_mut(&b.worker) {
            if b.prefill_open {
                w.load.prefill_done(b.prefill_blocks);
            }
            w.load.release(&b.blocks, b.tail);
        }
    }

    /// Drops bookings older than the TTL.
    pub fn expire(&mut self, now_ms: u64) {
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
                self.release(b);
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
}

#[cfg(test)]
mod tests;
