//! Router replicas share their bookings on `kvroute.<cluster>.load` (DESIGN §5), so each
//! replica's scheduler sees the whole fleet's load, not just what it routed itself. Each
//! replica announces itself every heartbeat; the bookings of a replica that falls silent are
//! dropped after `replica_ttl_ms` (and every booking also has the scheduler's own TTL).
//!
//! A replica's updates are coalesced: the first one after a quiet spell starts a `flush_ms`
//! window, and everything booked, started or completed in it goes out as one message (a JSON
//! array of operations). Peers see load at most that much later, and a busy router publishes
//! (and receives its own echo) a few hundred times a second instead of twice per request.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::time::Instant;

use super::transport::{Transport, TransportError};
use crate::scheduler::{BookingId, Scheduler, SharedBooking};

/// Subject replicas share load on.
pub fn load_subject(cluster: &str) -> String {
    format!("kvroute.{cluster}.load")
}

/// Timing of load sharing.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoadShareConfig {
    /// A replica announces itself this often, ms.
    pub heartbeat_ms: u64,
    /// A replica silent this long is gone: its bookings are dropped, ms.
    pub replica_ttl_ms: u64,
    /// Updates are gathered this long into one message, ms (0: one message per update).
    pub flush_ms: u64,
}

impl Default for LoadShareConfig {
    fn default() -> Self {
        LoadShareConfig {
            heartbeat_ms: 1_000,
            replica_ttl_ms: 5_000,
            flush_ms: 2,
        }
    }
}

/// One operation; a message on the load subject is a JSON array of them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum LoadMessage {
    Book { booking: SharedBooking },
    FirstToken { id: BookingId },
    Complete { id: BookingId },
    Heartbeat { replica: u64 },
}

/// A replica's side of load sharing.
#[derive(Clone)]
pub struct LoadShare {
    transport: Transport,
    subject: String,
    scheduler: Arc<Mutex<Scheduler>>,
    /// Updates not yet published.
    pending: Arc<Mutex<Vec<LoadMessage>>>,
    /// Wakes the flusher when `pending` stops being empty.
    wake: Arc<tokio::sync::Notify>,
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
            pending: Arc::default(),
            wake: Arc::default(),
        };
        let flusher = share.clone();
        let mut stop = shutdown.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = flusher.wake.notified() => {}
                    _ = stop.changed() => return,
                }
                if config.flush_ms > 0 {
                    tokio::time::sleep(Duration::from_millis(config.flush_ms)).await;
                }
                flusher.flush().await;
            }
        });
        let s = share.clone();
        tokio::spawn(async move {
            let start = Instant::now();
            let mut seen: HashMap<u64, Instant> = HashMap::new();
            let mut beat =
                tokio::time::interval(Duration::from_millis(config.heartbeat_ms.max(10)));
            loop {
                tokio::select! {
                    message = subscription.next() => {
                        let Some(message) = message else { return };
                        let Ok(ops) = serde_json::from_slice::<Vec<LoadMessage>>(&message.payload) else {
                            tracing::warn!("ignoring malformed load message");
                            continue;
                        };
                        let now_ms = start.elapsed().as_millis() as u64;
                        let mut scheduler = s.scheduler.lock();
                        for m in ops {
                            let origin = match &m {
                                LoadMessage::Book { booking } => booking.id.origin,
                                LoadMessage::FirstToken { id } | LoadMessage::Complete { id } => id.origin,
                                LoadMessage::Heartbeat { replica } => *replica,
                            };
                            if origin == me {
                                continue;
                            }
                            seen.insert(origin, Instant::now());
                            match m {
                                LoadMessage::Book { booking } => scheduler.book_shared(now_ms, booking),
                                LoadMessage::FirstToken { id } => scheduler.first_token(id),
                                LoadMessage::Complete { id } => scheduler.complete(id),
                                LoadMessage::Heartbeat { .. } => {}
                            }
                        }
                    }
                    _ = beat.tick() => {
                        s.send(LoadMessage::Heartbeat { replica: me });
                        let ttl = Duration::from_millis(config.replica_ttl_ms);
                        let gone: Vec<u64> = seen.iter().filter(|(_, at)| at.elapsed() > ttl).map(|(r, _)| *r).collect();
                        for replica in gone {
                            seen.remove(&replica);
                            let dropped = s.scheduler.lock().drop_origin(replica);
                            tracing::warn!(replica, dropped, "router replica went silent; its bookings are dropped");
                        }
                    }
                    _ = shutdown.changed() => return,
                }
            }
        });
        Ok(share)
    }

    /// Queues an update for the next flush.
    fn send(&self, message: LoadMessage) {
        let mut pending = self.pending.lock();
        pending.push(message);
        if pending.len() == 1 {
            self.wake.notify_one();
        }
    }

    /// Publishes what is pending as one message.
    async fn flush(&self) {
        let ops = std::mem::take(&mut *self.pending.lock());
        if ops.is_empty() {
            return;
        }
        let payload =
            Bytes::from(serde_json::to_vec(&ops).expect("invariant: load messages serialize"));
        if let Err(e) = self.transport.publish(&self.subject, None, payload).await {
            tracing::warn!(error = %e, ops = ops.len(), "cannot share load");
        }
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
