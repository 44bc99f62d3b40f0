//! The bridge's series: what an operator watching a sidecar's `/metrics` (or a router's, in
//! direct mode, where the bridge runs in the router) needs to tell that the engine is in the
//! fleet and that its events arrive whole. Every series carries the `worker` label, and the
//! per-stream ones the data-parallel `rank`: a router drops a departed worker's series with
//! the rest of its per-worker ones.
//!
//! The stream counters mirror [`IngestStats`], which counts from the bridge's start: they are
//! set to its totals (`absolute`), never incremented twice for one event. A figure is written
//! when it changes (an engine's batch usually moves two or three of them, and each write looks
//! its series up), and all of them again when the engine registers ([`Telemetry::rewrite`]):
//! in direct mode a router drops a withdrawn worker's series after a while, and a registered
//! worker's reappear whole.

use kvroute::engines::ingest::IngestStats;
use kvroute::protocol::{Tier, WorkerId};
use metrics::{counter, gauge};

use crate::publisher::Announced;

/// A series (or a reason) and how to read its total from the stream's counters.
type Figure = (&'static str, fn(&IngestStats) -> u64);

/// What was last written of one rank's stream (`None`: nothing yet, or forgotten).
#[derive(Default)]
struct Written {
    stats: Option<IngestStats>,
    resident: Option<[u64; Tier::ALL.len()]>,
}

/// The series of one bridged engine.
pub(super) struct Telemetry {
    worker: String,
    ranks: Vec<Written>,
}

impl Telemetry {
    /// The series of worker `id`'s `ranks` ranks. With `events`, each rank's stream series
    /// exist from the start (disconnected, all zero), so a sidecar that never reaches its
    /// engine's event socket shows it.
    pub(super) fn new(id: WorkerId, ranks: u32, events: bool) -> Self {
        let mut t = Telemetry {
            worker: id.to_string(),
            ranks: (0..ranks).map(|_| Written::default()).collect(),
        };
        t.registered(false);
        t.health(false);
        counter!("kvroute_engine_publish_failures_total", "worker" => t.worker.clone()).absolute(0);
        for rank in 0..ranks {
            if events {
                t.ingest(rank, &IngestStats::default());
            }
            t.write_resident(rank, [0; Tier::ALL.len()]);
        }
        t
    }

    /// The worker label.
    pub(super) fn worker(&self) -> &str {
        &self.worker
    }

    /// `kvroute_engine_healthy`: the last `/health` check answered 2xx.
    pub(super) fn health(&self, healthy: bool) {
        gauge!("kvroute_engine_healthy", "worker" => self.worker.clone())
            .set(f64::from(u8::from(healthy)));
    }

    /// `kvroute_engine_registered`: the engine is in the registry (routers may pick it).
    pub(super) fn registered(&self, registered: bool) {
        gauge!("kvroute_engine_registered", "worker" => self.worker.clone())
            .set(f64::from(u8::from(registered)));
    }

    /// Writes every series again, as last known (the publish failures' too: a router's sweep
    /// may have dropped it, and what it counted since is lost, so it restarts from 0 there).
    pub(super) fn rewrite(&mut self) {
        counter!("kvroute_engine_publish_failures_total", "worker" => self.worker.clone())
            .increment(0);
        for rank in 0..self.ranks.len() {
            let written = std::mem::take(&mut self.ranks[rank]);
            if let Some(stats) = written.stats {
                self.ingest(rank as u32, &stats);
            }
            if let Some(resident) = written.resident {
                self.write_resident(rank as u32, resident);
            }
        }
    }

    /// A batch the event plane did not take: routers see the gap and resync.
    pub(super) fn publish_failed(&self) {
        counter!("kvroute_engine_publish_failures_total", "worker" => self.worker.clone())
            .increment(1);
    }

    /// Rank `rank`'s event stream as its ingest counts it.
    pub(super) fn ingest(&mut self, rank: u32, s: &IngestStats) {
        let Some(written) = self.ranks.get_mut(rank as usize) else {
            return;
        };
        let before = written.stats.replace(*s);
        let (worker, label) = (&self.worker, rank.to_string());
        let changed = |f: fn(&IngestStats) -> u64| before.as_ref().is_none_or(|b| f(b) != f(s));
        if before.as_ref().is_none_or(|b| b.connected != s.connected) {
            gauge!("kvroute_engine_events_connected", "worker" => worker.clone(), "rank" => label.clone())
                .set(f64::from(u8::from(s.connected)));
        }
        let totals: [Figure; 9] = [
            ("kvroute_engine_event_batches_total", |s| s.mirror.batches),
            ("kvroute_engine_event_gaps_total", |s| s.gaps),
            ("kvroute_engine_event_batches_replayed_total", |s| {
                s.replayed
            }),
            ("kvroute_engine_event_gaps_unrepaired_total", |s| {
                s.unrepaired
            }),
            ("kvroute_engine_restarts_total", |s| s.restarts),
            ("kvroute_engine_replays_skipped_total", |s| {
                s.replays_skipped
            }),
            ("kvroute_engine_event_decode_errors_total", |s| {
                s.decode_errors
            }),
            ("kvroute_engine_blocks_stored_total", |s| s.mirror.stored),
            ("kvroute_engine_blocks_removed_total", |s| s.mirror.removed),
        ];
        for (name, total) in totals {
            if changed(total) {
                counter!(name, "worker" => worker.clone(), "rank" => label.clone())
                    .absolute(total(s));
            }
        }
        const NOT_INDEXED: &str = "kvroute_engine_blocks_not_indexed_total";
        const SKIPPED: &str = "kvroute_engine_events_skipped_total";
        let by_reason: [(&'static str, Figure); 10] = [
            (
                NOT_INDEXED,
                ("block_size", |s| s.mirror.block_size_mismatch),
            ),
            (NOT_INDEXED, ("malformed", |s| s.mirror.malformed)),
            (NOT_INDEXED, ("orphan", |s| s.mirror.orphans)),
            (NOT_INDEXED, ("ambiguous", |s| s.mirror.ambiguous)),
            (NOT_INDEXED, ("unresolved", |s| s.mirror.unresolved)),
            (NOT_INDEXED, ("other_group", |s| s.mirror.other_groups)),
            (NOT_INDEXED, ("unnamed_lora", |s| s.mirror.unnamed_lora)),
            (NOT_INDEXED, ("capped", |s| s.mirror.capped)),
            (SKIPPED, ("unknown_kind", |s| s.mirror.unknown_events)),
            (SKIPPED, ("malformed", |s| s.mirror.malformed_events)),
        ];
        for (name, (reason, total)) in by_reason {
            if changed(total) {
                counter!(name, "worker" => worker.clone(), "rank" => label.clone(), "reason" => reason)
                    .absolute(total(s));
            }
        }
    }

    /// `kvroute_engine_blocks`: the blocks rank `rank` announces per tier (what routers index).
    pub(super) fn resident(&mut self, rank: u32, announced: &Announced) {
        self.write_resident(rank, Tier::ALL.map(|t| announced.resident(t)));
    }

    fn write_resident(&mut self, rank: u32, now: [u64; Tier::ALL.len()]) {
        let Some(written) = self.ranks.get_mut(rank as usize) else {
            return;
        };
        let before = written.resident.replace(now);
        for (i, tier) in Tier::ALL.into_iter().enumerate() {
            if before.is_none_or(|b| b[i] != now[i]) {
                gauge!("kvroute_engine_blocks", "worker" => self.worker.clone(), "rank" => rank.to_string(), "tier" => tier.to_string())
                    .set(now[i] as f64);
            }
        }
    }
}
