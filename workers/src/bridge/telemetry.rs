//! The bridge's series: what an operator watching a sidecar's `/metrics` (or a router's, in
//! direct mode, where the bridge runs in the router) needs to tell that the engine is in the
//! fleet and that its events arrive whole. Every series carries the `worker` label, and the
//! per-stream ones the data-parallel `rank`: a router drops a departed worker's series with
//! the rest of its per-worker ones.
//!
//! The stream counters mirror [`IngestStats`], which counts from the bridge's start: they are
//! set to its totals (`absolute`), never incremented twice for one event.

use kvroute::engines::ingest::IngestStats;
use kvroute::protocol::{Tier, WorkerId};
use metrics::{counter, gauge};

use crate::publisher::Announced;

/// The series of one bridged engine.
pub(super) struct Telemetry {
    worker: String,
}

impl Telemetry {
    pub(super) fn new(id: WorkerId) -> Self {
        Telemetry {
            worker: id.to_string(),
        }
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

    /// A publish NATS did not take: routers see the gap and resync.
    pub(super) fn publish_failed(&self) {
        counter!("kvroute_engine_publish_failures_total", "worker" => self.worker.clone())
            .increment(1);
    }

    /// Rank `rank`'s event stream as its ingest counts it.
    pub(super) fn ingest(&self, rank: u32, s: &IngestStats) {
        let (worker, rank) = (self.worker.clone(), rank.to_string());
        gauge!("kvroute_engine_events_connected", "worker" => worker.clone(), "rank" => rank.clone())
            .set(f64::from(u8::from(s.connected)));
        let m = &s.mirror;
        for (name, total) in [
            ("kvroute_engine_event_batches_total", m.batches),
            ("kvroute_engine_event_gaps_total", s.gaps),
            ("kvroute_engine_event_batches_replayed_total", s.replayed),
            ("kvroute_engine_event_gaps_unrepaired_total", s.unrepaired),
            ("kvroute_engine_restarts_total", s.restarts),
            ("kvroute_engine_event_decode_errors_total", s.decode_errors),
            ("kvroute_engine_blocks_stored_total", m.stored),
            ("kvroute_engine_blocks_removed_total", m.removed),
        ] {
            counter!(name, "worker" => worker.clone(), "rank" => rank.clone()).absolute(total);
        }
        for (reason, total) in [
            ("block_size", m.block_size_mismatch),
            ("malformed", m.malformed),
            ("orphan", m.orphans),
            ("unresolved", m.unresolved),
            ("other_group", m.other_groups),
            ("unnamed_lora", m.unnamed_lora),
        ] {
            counter!("kvroute_engine_blocks_not_indexed_total", "worker" => worker.clone(), "rank" => rank.clone(), "reason" => reason)
                .absolute(total);
        }
        for (reason, total) in [
            ("unknown_kind", m.unknown_events),
            ("malformed", m.malformed_events),
        ] {
            counter!("kvroute_engine_events_skipped_total", "worker" => worker.clone(), "rank" => rank.clone(), "reason" => reason)
                .absolute(total);
        }
    }

    /// `kvroute_engine_blocks`: the blocks rank `rank` announces per tier (what routers index).
    pub(super) fn resident(&self, rank: u32, announced: &Announced) {
        let rank = rank.to_string();
        for tier in Tier::ALL {
            gauge!("kvroute_engine_blocks", "worker" => self.worker.clone(), "rank" => rank.clone(), "tier" => tier.to_string())
                .set(announced.resident(tier) as f64);
        }
    }
}
