//! Session affinity: which worker each conversation's last turn went to, so the next turn
//! goes there too while that worker has room. Sessions are forgotten `ttl_ms` after their
//! last turn, and the least recently seen first when more than `max_sessions` are known, so
//! the table follows the live conversations whatever clients send. Router replicas learn
//! each other's turns from their shared bookings ([`super::SharedBooking::session`]), so a
//! session's next turn sticks to its worker whichever replica takes it.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, VecDeque};

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use super::WorkerKey;

/// Settings of session affinity.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SessionConfig {
    /// A session with no turn for this long is forgotten, ms.
    pub ttl_ms: u64,
    /// Most sessions remembered; beyond it the least recently seen is forgotten.
    pub max_sessions: usize,
    /// A new session's first turn: cost added per live session a worker holds beyond the
    /// fewest any candidate holds. Sessions are future load (their next turns come back),
    /// so new ones spread over the workers unless a cached prefix is worth more.
    pub spread_weight: f64,
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            ttl_ms: 1_800_000,
            max_sessions: 1_000_000,
            spread_weight: 64.0,
        }
    }
}

/// What affinity did, since start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SessionStats {
    /// Sessions remembered now.
    pub live: usize,
    /// First turns of a session (or of one forgotten).
    pub started: u64,
    /// Turns that went to their session's worker.
    pub stuck: u64,
    /// Turns whose session's worker had left: the session moved.
    pub moved: u64,
    /// Turns sent elsewhere because the session's worker was saturated (soft affinity).
    pub yielded: u64,
    /// Turns other router replicas routed, learnt from their bookings.
    pub learned: u64,
}

#[derive(Debug)]
struct Entry {
    worker: WorkerKey,
    last_ms: u64,
}

/// A session's id as the table keeps it: 128 bits of a hash, the same on every router
/// replica (they share them in their bookings). Ids come from clients' headers, scoped by
/// tenant and model (up to about 530 bytes): kept whole, a full table of a million sessions
/// took over half a GB. Two ids with one key would share a worker, nothing more; the table
/// hashes keys with a per-process random SipHash key, so ids chosen to crowd its buckets
/// cannot be computed from the (public) key function.
pub type SessionKey = u128;

/// Seed of [`session_key`]: fixed, so that replicas agree.
const SESSION_KEY_SEED: u64 = 0x6b76_726f_7574_6573;

/// The key of session `id`.
pub fn session_key(id: &str) -> SessionKey {
    xxhash_rust::xxh3::xxh3_128_with_seed(id.as_bytes(), SESSION_KEY_SEED)
}

/// The session table.
#[derive(Debug)]
pub(super) struct Sessions {
    config: SessionConfig,
    map: HashMap<SessionKey, Entry, RandomState>,
    /// (last turn, session) by age; entries whose session had a later turn are stale and
    /// skipped.
    by_age: VecDeque<(u64, SessionKey)>,
    /// Live sessions per worker (entries removed at zero).
    per_worker: FxHashMap<WorkerKey, u32>,
    stats: SessionStats,
}

impl Sessions {
    pub(super) fn new(config: SessionConfig) -> Self {
        Sessions {
            config,
            map: HashMap::default(),
            by_age: VecDeque::new(),
            per_worker: FxHashMap::default(),
            stats: SessionStats::default(),
        }
    }

    /// Live sessions sticking to `worker`.
    pub(super) fn on_worker(&self, worker: WorkerKey) -> u32 {
        self.per_worker.get(&worker).copied().unwrap_or(0)
    }

    fn attach(&mut self, worker: WorkerKey) {
        *self.per_worker.entry(worker).or_default() += 1;
    }

    fn detach(&mut self, worker: WorkerKey) {
        if let Some(n) = self.per_worker.get_mut(&worker) {
            *n -= 1;
            if *n == 0 {
                self.per_worker.remove(&worker);
            }
        }
    }

    /// The worker `id` sticks to at `now_ms` (forgetting expired sessions first).
    pub(super) fn worker(&mut self, now_ms: u64, id: &str) -> Option<WorkerKey> {
        self.forget(now_ms);
        self.map.get(&session_key(id)).map(|e| e.worker)
    }

    /// Like [`Sessions::worker`], without forgetting anything.
    pub(super) fn peek(&self, now_ms: u64, id: &str) -> Option<WorkerKey> {
        self.map
            .get(&session_key(id))
            .filter(|e| now_ms.saturating_sub(e.last_ms) < self.config.ttl_ms)
            .map(|e| e.worker)
    }

    /// A turn of `id` went to `chosen`; `was` is where the session stuck before, and
    /// `registered` whether that worker was still a candidate.
    pub(super) fn routed(
        &mut self,
        now_ms: u64,
        id: &str,
        was: Option<WorkerKey>,
        chosen: WorkerKey,
        registered: bool,
    ) {
        match was {
            None => self.stats.started += 1,
            Some(w) if w == chosen => self.stats.stuck += 1,
            Some(_) if !registered => self.stats.moved += 1,
            Some(_) => self.stats.yielded += 1,
        }
        self.stick(now_ms, session_key(id), chosen);
    }

    /// A peer replica routed a turn of session `key` to `worker` (its booking said so).
    pub(super) fn learned(&mut self, now_ms: u64, key: SessionKey, worker: WorkerKey) {
        self.stats.learned += 1;
        self.stick(now_ms, key, worker);
    }

    /// Session `key`'s last turn went to `chosen` at `now_ms`.
    fn stick(&mut self, now_ms: u64, key: SessionKey, chosen: WorkerKey) {
        let previous = self.map.insert(
            key,
            Entry {
                worker: chosen,
                last_ms: now_ms,
            },
        );
        if let Some(p) = previous {
            self.detach(p.worker);
        }
        self.attach(chosen);
        self.by_age.push_back((now_ms, key));
        self.forget(now_ms);
    }

    pub(super) fn stats(&self) -> SessionStats {
        SessionStats {
            live: self.map.len(),
            ..self.stats
        }
    }

    /// Drops sessions past their TTL, then the oldest while over the cap; keeps `by_age`
    /// bounded by the live sessions.
    pub(super) fn forget(&mut self, now_ms: u64) {
        while let Some((at, id)) = self.by_age.front() {
            let expired = now_ms.saturating_sub(*at) >= self.config.ttl_ms;
            let over = self.map.len() > self.config.max_sessions;
            let current = self.map.get(id).is_some_and(|e| e.last_ms == *at);
            if current && !expired && !over {
                break;
            }
            if current && let Some(e) = self.map.remove(id) {
                self.detach(e.worker);
            }
            self.by_age.pop_front();
        }
        if self.by_age.len() > 2 * self.map.len() + 64 {
            let map = &self.map;
            self.by_age
                .retain(|(at, id)| map.get(id).is_some_and(|e| e.last_ms == *at));
        }
    }
}
