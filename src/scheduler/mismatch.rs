//! The hash-mismatch alarm: a request routed to a worker leaves its prompt's blocks in that
//! worker's cache, so they show up in its KV events. When most recent requests' blocks
//! never do, the router and the worker hash prompts differently (tokenizer or chat template,
//! block size, salt) and every overlap the router computes for that worker is zero: the
//! most common silent failure of KV-aware routing. No I/O: time is an argument.
//!
//! A request is watched from its first token, while the engine still holds its blocks, and
//! its last full block counts as seen the first time a check finds it, not only when its
//! grace period ends: an engine under memory pressure evicts a finished request's blocks at
//! once, last block first (vLLM frees them in reverse order), so a look taken only after
//! the request ended read cache pressure as a mismatch (seen: every request of an
//! overloaded two-worker fleet "missing").

use std::collections::VecDeque;

use rustc_hash::FxHashMap;

use crate::protocol::{SeqHash, WorkerId};

/// How the alarm decides.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MismatchConfig {
    /// How long after a request's first token its last block must have been in the index,
    /// ms.
    pub grace_ms: u64,
    /// Outcomes remembered per worker.
    pub window: usize,
    /// Fewest outcomes before the alarm may go off.
    pub min_outcomes: usize,
    /// Share of misses in the window that raises the alarm.
    pub raise_at: f64,
    /// Share of misses below which a raised alarm clears.
    pub clear_below: f64,
    /// Expectations waiting per worker at most (older ones are dropped).
    pub max_pending: usize,
}

impl Default for MismatchConfig {
    fn default() -> Self {
        MismatchConfig {
            grace_ms: 2_000,
            window: 32,
            min_outcomes: 8,
            raise_at: 0.75,
            clear_below: 0.5,
            max_pending: 256,
        }
    }
}

#[derive(Debug, Default)]
struct Watch {
    /// (when to look, the block to look for), oldest first.
    pending: VecDeque<(u64, SeqHash)>,
    /// Recent outcomes: true when the block was there.
    outcomes: VecDeque<bool>,
    raised: bool,
    seen: u64,
    missing: u64,
}

/// What the alarm says of one worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MismatchStatus {
    /// The alarm is up.
    pub raised: bool,
    /// Routed prompts whose blocks showed up in the worker's events.
    pub seen: u64,
    /// Routed prompts whose blocks never did.
    pub missing: u64,
}

/// Per worker, whether routed prompts' blocks show up in its events.
#[derive(Debug, Default)]
pub struct MismatchAlarm {
    config: MismatchConfig,
    workers: FxHashMap<WorkerId, Watch>,
}

/// What one [`MismatchAlarm::check`] found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Checked {
    /// Workers whose alarm went up.
    pub raised: Vec<WorkerId>,
    /// Workers forgotten (no longer registered) with their alarm up.
    pub departed: Vec<WorkerId>,
}

impl MismatchAlarm {
    /// An alarm deciding by `config`.
    pub fn new(config: MismatchConfig) -> Self {
        MismatchAlarm {
            config,
            workers: FxHashMap::default(),
        }
    }

    /// A request whose prompt ends with full block `last` got its first token (or its whole
    /// answer) from `worker` at `now_ms`: that block should be in the worker's events before
    /// the grace period ends. With `max_pending` already waiting, the newest is not taken
    /// (dropping the oldest instead would leave a busy worker's expectations never judged,
    /// and the alarm blind).
    pub fn expect(&mut self, worker: WorkerId, last: SeqHash, now_ms: u64) {
        let w = self.workers.entry(worker).or_default();
        if w.pending.len() < self.config.max_pending {
            w.pending
                .push_back((now_ms.saturating_add(self.config.grace_ms), last));
        }
    }

    /// The router itself saw a routed prompt's last block in `worker`'s index while the
    /// request ran (a whole-answer request's prefill watch): an outcome, seen, at once.
    pub fn seen(&mut self, worker: WorkerId) {
        let window = self.config.window;
        let w = self.workers.entry(worker).or_default();
        w.seen += 1;
        w.outcomes.push_back(true);
        while w.outcomes.len() > window {
            w.outcomes.pop_front();
        }
    }

    /// What the index held of `worker` was dropped at once (a restart under the same id, a
    /// resync, a `Cleared` event: vLLM's `reset_prefix_cache`, routine in RL weight-update
    /// loops): the expectations waiting for it are dropped unjudged. Judged, each would be
    /// missing, and a busy worker's window would fill with misses that say nothing of how it
    /// hashes.
    pub fn forget(&mut self, worker: WorkerId) {
        if let Some(w) = self.workers.get_mut(&worker) {
            w.pending.clear();
        }
    }

    /// Looks at every expectation with `held` (is this block in this worker's index, in any
    /// tier?): one held is seen, one not held by its due time (`now_ms` or earlier) is
    /// missing, the others wait for the next check. Forgets workers `registered` says are
    /// gone. Returns the workers whose alarm went up now, and those forgotten with their
    /// alarm up (their gauge must fall: no one would set it again).
    pub fn check(
        &mut self,
        now_ms: u64,
        held: impl Fn(WorkerId, SeqHash) -> bool,
        registered: impl Fn(WorkerId) -> bool,
    ) -> Checked {
        let mut departed = Vec::new();
        self.workers.retain(|w, state| {
            let keep = registered(*w);
            if !keep && state.raised {
                departed.push(*w);
            }
            keep
        });
        let c = self.config;
        let mut raised = Vec::new();
        for (id, w) in &mut self.workers {
            let Watch {
                pending,
                outcomes,
                seen,
                missing,
                ..
            } = w;
            pending.retain(|&(due, seq)| {
                let hit = held(*id, seq);
                if !hit && due > now_ms {
                    return true;
                }
                if hit {
                    *seen += 1;
                } else {
                    *missing += 1;
                }
                outcomes.push_back(hit);
                false
            });
            while outcomes.len() > c.window {
                outcomes.pop_front();
            }
            let n = w.outcomes.len();
            if n < c.min_outcomes {
                continue;
            }
            let misses = w.outcomes.iter().filter(|h| !**h).count() as f64 / n as f64;
            if !w.raised && misses >= c.raise_at {
                w.raised = true;
                raised.push(*id);
            } else if w.raised && misses < c.clear_below {
                w.raised = false;
            }
        }
        Checked { raised, departed }
    }

    /// Every block an expectation waits for, with its worker: what the next
    /// [`MismatchAlarm::check`] will ask `held` about (looked up without the alarm's lock).
    pub fn pending(&self) -> Vec<(WorkerId, SeqHash)> {
        self.workers
            .iter()
            .flat_map(|(&id, w)| w.pending.iter().map(move |&(_, seq)| (id, seq)))
            .collect()
    }

    /// The alarm's state for `worker`.
    pub fn status(&self, worker: WorkerId) -> MismatchStatus {
        self.workers
            .get(&worker)
            .map(|w| MismatchStatus {
                raised: w.raised,
                seen: w.seen,
                missing: w.missing,
            })
            .unwrap_or_default()
    }

    /// Workers watched.
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// Whether no worker is watched.
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(
        alarm: &mut MismatchAlarm,
        worker: u64,
        outcomes: &[bool],
        t: &mut u64,
    ) -> Vec<WorkerId> {
        let w = WorkerId(worker);
        let mut up = Vec::new();
        for hit in outcomes {
            let seq = SeqHash(if *hit { 1 } else { 2 });
            alarm.expect(w, seq, *t);
            *t += 2_001;
            up.extend(alarm.check(*t, |_, s| s == SeqHash(1), |_| true).raised);
        }
        up
    }

    #[test]
    fn most_routed_blocks_missing_raises_the_alarm_and_it_clears_when_they_show() {
        let mut a = MismatchAlarm::new(MismatchConfig::default());
        let mut t = 0;
        // A few misses among hits (evictions under pressure): no alarm.
        let mixed: Vec<bool> = (0..40).map(|i| i % 3 != 0).collect();
        assert!(run(&mut a, 1, &mixed, &mut t).is_empty());
        assert!(!a.status(WorkerId(1)).raised);
        // Nothing shows up any more: raised once.
        assert_eq!(run(&mut a, 1, &[false; 40], &mut t), vec![WorkerId(1)]);
        let s = a.status(WorkerId(1));
        assert!(s.raised && s.missing >= 40, "{s:?}");
        // Fixed: clears.
        run(&mut a, 1, &[true; 32], &mut t);
        assert!(!a.status(WorkerId(1)).raised);
    }

    /// A worker's cache wiped at once (a restart under its id, `Cleared`): the requests
    /// watched then are dropped unjudged, not counted missing (40 of them raised the alarm).
    #[test]
    fn expectations_of_a_wiped_worker_are_dropped_unjudged() {
        let mut a = MismatchAlarm::new(MismatchConfig::default());
        for i in 0..40 {
            a.expect(WorkerId(1), SeqHash(2), i);
        }
        a.forget(WorkerId(1));
        assert!(a.check(10_000, |_, _| false, |_| true).raised.is_empty());
        let s = a.status(WorkerId(1));
        assert_eq!((s.raised, s.seen, s.missing), (false, 0, 0));
        // Without the wipe, the same misses raise it.
        for i in 0..40 {
            a.expect(WorkerId(1), SeqHash(2), i);
        }
        assert_eq!(
            a.check(10_000, |_, _| false, |_| true).raised,
            vec![WorkerId(1)]
        );
    }

    #[test]
    fn nothing_is_judged_before_its_grace_period_or_on_too_few_requests() {
        let mut a = MismatchAlarm::new(MismatchConfig::default());
        for i in 0..100 {
            a.expect(WorkerId(1), SeqHash(2), i);
        }
        assert!(a.check(1_000, |_, _| false, |_| true).raised.is_empty());
        assert_eq!(a.status(WorkerId(1)).missing, 0);
        let mut fresh = MismatchAlarm::new(MismatchConfig::default());
        let mut t = 0;
        assert!(
            run(&mut fresh, 2, &[false; 7], &mut t).is_empty(),
            "7 < min_outcomes"
        );
        assert_eq!(run(&mut fresh, 2, &[false], &mut t), vec![WorkerId(2)]);
    }

    #[test]
    fn a_block_seen_before_its_due_time_counts_though_evicted_after() {
        // Cache pressure: each request's last block is in the index while the request runs
        // and gone soon after it ends. Seen once is seen: no alarm.
        let mut a = MismatchAlarm::new(MismatchConfig::default());
        for i in 0..40u64 {
            let t = i * 3_000;
            a.expect(WorkerId(1), SeqHash(i), t);
            assert!(
                a.check(t + 500, |_, s| s == SeqHash(i), |_| true)
                    .raised
                    .is_empty()
            );
            assert!(a.check(t + 2_500, |_, _| false, |_| true).raised.is_empty());
        }
        let s = a.status(WorkerId(1));
        assert_eq!((s.raised, s.seen, s.missing), (false, 40, 0));
        assert!(a.pending().is_empty(), "every expectation was judged");
        a.expect(WorkerId(1), SeqHash(77), 200_000);
        assert_eq!(a.pending(), vec![(WorkerId(1), SeqHash(77))]);
        // Control: judged only at the due time, the same evictions read as a mismatch.
        let mut late = MismatchAlarm::new(MismatchConfig::default());
        let mut up = Vec::new();
        for i in 0..40u64 {
            let t = i * 3_000;
            late.expect(WorkerId(1), SeqHash(i), t);
            up.extend(late.check(t + 2_500, |_, _| false, |_| true).raised);
        }
        assert_eq!(up, vec![WorkerId(1)]);
    }

    #[test]
    fn prompts_the_router_saw_cached_count_as_seen_at_once() {
        let mut a = MismatchAlarm::new(MismatchConfig::default());
        for _ in 0..10 {
            a.seen(WorkerId(3));
        }
        // Two misses among them keep the share under the alarm's.
        a.expect(WorkerId(3), SeqHash(9), 0);
        a.expect(WorkerId(3), SeqHash(9), 0);
        assert!(a.check(5_000, |_, _| false, |_| true).raised.is_empty());
        let s = a.status(WorkerId(3));
        assert_eq!((s.raised, s.seen, s.missing), (false, 10, 2));
    }

    #[test]
    fn departed_workers_are_forgotten_and_pending_is_bounded() {
        let mut a = MismatchAlarm::new(MismatchConfig::default());
        for i in 0..10_000 {
            a.expect(WorkerId(i % 3), SeqHash(i), 0);
        }
        assert!(a.workers.values().all(|w| w.pending.len() <= 256));
        // The oldest are kept (and judged in their time), the newest not taken.
        assert_eq!(
            a.workers[&WorkerId(0)].pending.front().unwrap().1,
            SeqHash(0)
        );
        a.check(0, |_, _| true, |w| w == WorkerId(1));
        assert_eq!(a.len(), 1);
        // A worker that leaves with its alarm up is reported once, to clear its gauge.
        let mut t = 0;
        assert_eq!(run(&mut a, 1, &[false; 40], &mut t), vec![WorkerId(1)]);
        let gone = a.check(t, |_, _| true, |_| false);
        assert_eq!(gone.departed, vec![WorkerId(1)]);
        assert!(a.is_empty());
        assert!(a.check(t, |_, _| true, |_| false).departed.is_empty());
    }
}
