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
        let info = Arc::new(Mutex::new(WorkerInfo {
            id: WorkerId(1),
            url: "http://127.0.0.1:9000".into(),
            block_size: 16,
            g1_blocks: 16,
            g2_blocks: 0,
            model: "m".into(),
            dp_size: 2,
            epoch: 1,
            last_event_ids: vec![0],
            api: Default::default(),
            adapters: Vec::new(),
            engine_load: None,
            event_faults: None,
        }));
        let plane = WorkerPlane::new(Transport::Local(LocalBus::new()), "c", Arc::clone(&info));
        plane.note_sent(&batch(0, 9));
        plane.note_sent(&batch(0, 5));
        plane.note_sent(&batch(1, 3));
        assert_eq!(info.lock().last_event_ids, vec![9, 3]);
    }
}
