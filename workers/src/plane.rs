//! The worker's side of the event plane (I/O): publishes its engine's KV event batches on
//! its subject (split under the transport's payload limit), answers snapshot requests in
//! chunks with their watermark, and keeps `last_event_ids` in its registration current so
//! the router can tell a lost last batch.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use futures_util::FutureExt;
use kvroute::discovery::WorkerInfo;
use kvroute::events::plane::{events_subject, snapshot_subject};
use kvroute::events::transport::{Transport, TransportError};
use kvroute::protocol::{DpRank, EventBatch, Snapshot, WorkerId, encode_split, payload_for_event};
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot};

/// A snapshot request for one rank, answered by whoever owns that rank's engine.
#[derive(Debug)]
pub struct SnapshotRequest {
    /// The rank asked about.
    pub dp_rank: DpRank,
    /// Where to send the snapshot.
    pub reply: oneshot::Sender<Snapshot>,
}

/// Longest wait for the NATS client to take one message of a batch.
pub const PUBLISH_DEADLINE: std::time::Duration = std::time::Duration::from_secs(1);

/// After a message was not taken within [`PUBLISH_DEADLINE`], publishes fail at once for
/// this long before one waits again.
pub const STALL_BACKOFF: std::time::Duration = std::time::Duration::from_secs(5);

/// Publishes one worker's events.
#[derive(Clone, Debug)]
pub struct WorkerPlane {
    transport: Transport,
    subject: String,
    info: Arc<Mutex<WorkerInfo>>,
    /// Until when publishes fail at once: the client took no message within the deadline
    /// (a connection that stays up but does not move, which the client reports as
    /// connected until its pings time out, minutes later).
    stalled_until: Arc<Mutex<Option<tokio::time::Instant>>>,
}

impl WorkerPlane {
    /// A publisher for the worker `info` describes, in `cluster`.
    pub fn new(transport: Transport, cluster: &str, info: Arc<Mutex<WorkerInfo>>) -> Self {
        let subject = events_subject(cluster, info.lock().id);
        let needed = payload_for_event(crate::publisher::MAX_EVENT_BLOCKS);
        if transport.max_payload() < needed {
            tracing::error!(
                max_payload = transport.max_payload(),
                needed,
                "the NATS server's max_payload is below one event of the most blocks this worker writes: such events cannot be published, and routers resync from a snapshot after each"
            );
        }
        WorkerPlane {
            transport,
            subject,
            info,
            stalled_until: Arc::default(),
        }
    }

    /// Publishes a batch (split to fit a message), then records its last id for the
    /// registration heartbeat. Fails at once while NATS is unreachable, and after
    /// [`PUBLISH_DEADLINE`] if the client takes no message: its buffer is full during a
    /// reconnect, and waiting would stall whoever publishes (a sidecar's one loop also
    /// answers snapshots, checks health and hears SIGTERM). After such a wait, publishes
    /// fail at once for [`STALL_BACKOFF`]: waiting a second on each batch of a connection
    /// that does not move held a sidecar to a batch a second, so it stopped reading its
    /// engine's events and the engine's socket dropped them. The caller notes the batch as
    /// sent (lost), so routers see the gap and resync.
    pub async fn publish(&self, batch: &EventBatch) -> Result<(), TransportError> {
        let failed = |reason: String| TransportError::Publish {
            subject: self.subject.clone(),
            reason,
        };
        if !self.transport.is_connected() {
            return Err(failed("not connected to NATS".into()));
        }
        let now = tokio::time::Instant::now();
        if let Some(until) = *self.stalled_until.lock()
            && now < until
        {
            return Err(failed(format!(
                "NATS took no message within {PUBLISH_DEADLINE:?}; not waiting on it again for {:?}",
                until - now
            )));
        }
        let max = self.transport.max_payload();
        let payloads = encode_split(batch, max).map_err(|e| failed(e.to_string()))?;
        for payload in payloads {
            tokio::time::timeout(
                PUBLISH_DEADLINE,
                self.transport.publish(&self.subject, None, payload.into()),
            )
            .await
            .map_err(|_| {
                *self.stalled_until.lock() = Some(tokio::time::Instant::now() + STALL_BACKOFF);
                failed(format!("not taken within {PUBLISH_DEADLINE:?}"))
            })??;
        }
        self.note_sent(batch);
        Ok(())
    }

    /// Records a batch as sent, or as lost (its last id goes into the next heartbeat, so
    /// the router can tell it never came). Never backwards within an epoch: the engine thread
    /// notes a batch it drops before the publisher has sent the older ones still queued, and
    /// a later note of those must not hide the loss (a new epoch resets the ids).
    pub fn note_sent(&self, batch: &EventBatch) {
        if let Some(last) = batch.last_id() {
            let mut info = self.info.lock();
            let rank = batch.dp_rank.0 as usize;
            if info.last_event_ids.len() <= rank {
                info.last_event_ids.resize(rank + 1, 0);
            }
            let noted = &mut info.last_event_ids[rank];
            *noted = (*noted).max(last);
        }
    }

    /// Serves snapshot requests until the transport closes: each request is handed to
    /// `engines` (the task owning the engines) and the snapshot it returns is sent back in
    /// chunks to the requester's inbox. Requests that queued up meanwhile (every router
    /// replica resyncing at once after a NATS outage) share one snapshot per rank: it is
    /// cut after each of them arrived, so it covers what each asked for, and the engine
    /// builds it once instead of once per request, each answer later than the one before.
    pub async fn serve_snapshots(
        transport: Transport,
        cluster: &str,
        worker: WorkerId,
        engines: mpsc::Sender<SnapshotRequest>,
    ) -> Result<tokio::task::JoinHandle<()>, TransportError> {
        let mut requests = transport
            .subscribe(&snapshot_subject(cluster, worker))
            .await?;
        Ok(tokio::spawn(async move {
            while let Some(first) = requests.next().await {
                let mut inboxes: BTreeMap<u32, Vec<String>> = BTreeMap::new();
                let mut next = Some(first);
                let mut taken = 0;
                while let Some(message) = next.take() {
                    if let Some(reply_to) = message.reply {
                        let rank = message
                            .payload
                            .get(..4)
                            .and_then(|b| b.try_into().ok())
                            .map_or(0, u32::from_le_bytes);
                        inboxes.entry(rank).or_default().push(reply_to);
                    }
                    taken += 1;
                    if taken < MAX_SHARED_REQUESTS {
                        // What else waits already, without waiting for more.
                        next = requests.next().now_or_never().flatten();
                    }
                }
                for (rank, inboxes) in inboxes {
                    let (tx, rx) = oneshot::channel();
                    let asked = SnapshotRequest {
                        dp_rank: DpRank(rank),
                        reply: tx,
                    };
                    if engines.send(asked).await.is_err() {
                        return;
                    }
                    let Ok(snapshot) = rx.await else { continue };
                    let chunks: Vec<Bytes> = match snapshot.encode(transport.max_payload()) {
                        Ok(chunks) => chunks.into_iter().map(Bytes::from).collect(),
                        Err(e) => {
                            tracing::error!(%worker, error = %e, "cannot encode snapshot");
                            continue;
                        }
                    };
                    // Each chunk within [`PUBLISH_DEADLINE`]: while the client's buffer is
                    // full (a reconnect), the round is dropped rather than left to answer,
                    // late, requesters that gave up (they ask again).
                    'round: for inbox in &inboxes {
                        for chunk in &chunks {
                            let sent = tokio::time::timeout(
                                PUBLISH_DEADLINE,
                                transport.publish(inbox, None, chunk.clone()),
                            )
                            .await;
                            match sent {
                                Ok(Ok(())) => {}
                                Ok(Err(e)) => {
                                    tracing::warn!(%worker, error = %e, "snapshot reply failed");
                                    break;
                                }
                                Err(_) => {
                                    tracing::warn!(%worker, "snapshot reply not taken within {PUBLISH_DEADLINE:?}; this round is dropped");
                                    break 'round;
                                }
                            }
                        }
                    }
                }
            }
        }))
    }
}

/// Most queued snapshot requests answered by one round of snapshots.
const MAX_SHARED_REQUESTS: usize = 1024;

/// A worker's registration for tests: worker 1, model "m", `dp_size` ranks.
#[cfg(test)]
pub(crate) fn test_info(dp_size: u32) -> WorkerInfo {
    WorkerInfo {
        id: kvroute::protocol::WorkerId(1),
        url: "http://127.0.0.1:9000".into(),
        block_size: 16,
        g1_blocks: 16,
        g2_blocks: 0,
        model: "m".into(),
        dp_size,
        epoch: 1,
        last_event_ids: vec![0],
        api: Default::default(),
        adapters: Vec::new(),
        engine_load: None,
        event_faults: None,
        engine_rank_kv_usage: Vec::new(),
        learns_routes: false,
        left: false,
    }
}

#[cfg(test)]
mod tests {
    use kvroute::events::transport::LocalBus;
    use kvroute::protocol::{KvEvent, KvEventData};

    use super::*;

    fn batch(dp_rank: u32, last: u64) -> EventBatch {
        EventBatch {
            worker: WorkerId(1),
            dp_rank: DpRank(dp_rank),
            epoch: 1,
            sent_unix_us: 0,
            events: vec![KvEvent {
                id: last,
                tier: kvroute::protocol::Tier::Device,
                data: KvEventData::Cleared,
            }],
        }
    }

    /// A batch the engine thread dropped (id 9) is announced even after older queued ones
    /// (id 5) are sent: the heartbeat's last id never goes back.
    #[test]
    fn the_last_event_id_never_goes_back() {
        let info = Arc::new(Mutex::new(test_info(2)));
        let plane = WorkerPlane::new(Transport::Local(LocalBus::new()), "c", Arc::clone(&info));
        plane.note_sent(&batch(0, 9));
        plane.note_sent(&batch(0, 5));
        plane.note_sent(&batch(1, 3));
        assert_eq!(info.lock().last_event_ids, vec![9, 3]);
    }

    /// Snapshot requests that queued up while none was served (every replica resyncing at
    /// once) share one snapshot per rank: every requester gets it whole, and the engine
    /// builds it once per rank, not once per request.
    #[tokio::test]
    async fn queued_snapshot_requests_share_one_snapshot_per_rank() {
        let transport = Transport::Local(LocalBus::new());
        let (engines_tx, mut engines) = mpsc::channel(16);
        let mut inboxes = Vec::new();
        for i in 0..8 {
            inboxes.push(transport.subscribe(&format!("inbox.{i}")).await.unwrap());
        }
        WorkerPlane::serve_snapshots(transport.clone(), "c", WorkerId(1), engines_tx)
            .await
            .unwrap();
        // Eight requests (six for rank 0, two for rank 1) queue before the server runs.
        for i in 0..8u32 {
            let rank = u32::from(i >= 6);
            transport
                .publish(
                    &snapshot_subject("c", WorkerId(1)),
                    Some(&format!("inbox.{i}")),
                    Bytes::copy_from_slice(&rank.to_le_bytes()),
                )
                .await
                .unwrap();
        }
        let mut built = Vec::new();
        for _ in 0..2 {
            let request: SnapshotRequest = engines.recv().await.unwrap();
            built.push(request.dp_rank.0);
            let _ = request.reply.send(Snapshot {
                worker: WorkerId(1),
                dp_rank: request.dp_rank,
                epoch: 1,
                watermark: 4,
                blocks: Vec::new(),
            });
        }
        assert_eq!(built, vec![0, 1]);
        for (i, inbox) in inboxes.iter_mut().enumerate() {
            let m = inbox.next().await.unwrap();
            let chunk = kvroute::protocol::decode_snapshot_chunk(
                &m.payload,
                &kvroute::protocol::Limits::default(),
            )
            .unwrap();
            assert_eq!(chunk.dp_rank.0, u32::from(i >= 6), "inbox {i}");
        }
        tokio::task::yield_now().await;
        assert!(engines.try_recv().is_err(), "a snapshot built twice");
    }
}
