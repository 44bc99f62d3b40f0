//! The worker's side of the event plane (I/O): publishes its engine's KV event batches on
//! its subject (split under the transport's payload limit), answers snapshot requests in
//! chunks with their watermark, and keeps `last_event_ids` in its registration current so
//! the router can tell a lost last batch.

use std::sync::Arc;

use kvroute::discovery::WorkerInfo;
use kvroute::events::plane::{events_subject, snapshot_subject};
use kvroute::events::transport::{Transport, TransportError};
use kvroute::protocol::{DpRank, EventBatch, Snapshot, WorkerId, encode_split};
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

/// Publishes one worker's events.
#[derive(Clone, Debug)]
pub struct WorkerPlane {
    transport: Transport,
    subject: String,
    info: Arc<Mutex<WorkerInfo>>,
}

impl WorkerPlane {
    /// A publisher for the worker `info` describes, in `cluster`.
    pub fn new(transport: Transport, cluster: &str, info: Arc<Mutex<WorkerInfo>>) -> Self {
        let subject = events_subject(cluster, info.lock().id);
        WorkerPlane {
            transport,
            subject,
            info,
        }
    }

    /// Publishes a batch (split to fit a message), then records its last id for the
    /// registration heartbeat.
    pub async fn publish(&self, batch: &EventBatch) -> Result<(), TransportError> {
        let max = self.transport.max_payload();
        let payloads = encode_split(batch, max).map_err(|e| TransportError::Publish {
            subject: self.subject.clone(),
            reason: e.to_string(),
        })?;
        for payload in payloads {
            self.transport
                .publish(&self.subject, None, payload.into())
                .await?;
        }
        self.note_sent(batch);
        Ok(())
    }

    /// Records a batch as sent (its last id goes into the next heartbeat).
    pub fn note_sent(&self, batch: &EventBatch) {
        if let Some(last) = batch.last_id() {
            let mut info = self.info.lock();
            let rank = batch.dp_rank.0 as usize;
            if info.last_event_ids.len() <= rank {
                info.last_event_ids.resize(rank + 1, 0);
            }
            info.last_event_ids[rank] = last;
        }
    }

    /// Serves snapshot requests until the transport closes: each request is handed to
    /// `engines` (the task owning the engines) and the snapshot it returns is sent back in
    /// chunks to the requester's inbox.
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
            while let Some(message) = requests.next().await {
                let Some(reply_to) = message.reply else {
                    continue;
                };
                let rank = message
                    .payload
                    .get(..4)
                    .and_then(|b| b.try_into().ok())
                    .map_or(0, u32::from_le_bytes);
                let (tx, rx) = oneshot::channel();
                if engines
                    .send(SnapshotRequest {
                        dp_rank: DpRank(rank),
                        reply: tx,
                    })
                    .await
                    .is_err()
                {
                    return;
                }
                let Ok(snapshot) = rx.await else { continue };
                match snapshot.encode(transport.max_payload()) {
                    Ok(chunks) => {
                        for chunk in chunks {
                            if let Err(e) = transport.publish(&reply_to, None, chunk.into()).await {
                                tracing::warn!(%worker, error = %e, "snapshot reply failed");
                                break;
                            }
                        }
                    }
                    Err(e) => tracing::error!(%worker, error = %e, "cannot encode snapshot"),
                }
            }
        }))
    }
}
