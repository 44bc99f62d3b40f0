//! An engine's side of the KV-event sockets, as vLLM's `ZmqEventPublisher` behaves: a PUB
//! that sends `(topic, seq as 8-byte big-endian, payload)` with seq counting from 0, and a
//! replay ROUTER that answers a DEALER's `("", start seq)` with every buffered batch from
//! there and an end marker; with an identity, as vLLM with a `snapshot_endpoint`, each data
//! message's seq frame is 24 bytes, the seq then the publisher's 16-byte identity (the end
//! marker stays 8). The test engine (`kvroute-worker --emulate`) publishes through
//! it; so do the tests of the ingest. It can lose batches on purpose.

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;

use super::zmtp::{PubSocket, RouterHandler, RouterSocket, ZmtpError};

/// How the replay socket answers (the two forms engines use).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayForm {
    /// vLLM ≥ 0.26: `("", topic, seq, payload)`, end `("", "", -1, "")`.
    WithTopic,
    /// SGLang and older vLLM: `("", seq, payload)`, end `("", -1, "")`.
    NoTopic,
}

#[derive(Debug, Default)]
struct Buffer {
    next_seq: u64,
    batches: VecDeque<(u64, Bytes)>,
    /// Live sends still to skip (a lossy network, on purpose).
    drop_live: u32,
    /// This publisher lifetime's identity, sent after each data message's seq.
    identity: Option<[u8; 16]>,
}

impl Buffer {
    /// The seq frame of data message `seq`.
    fn seq_frame(&self, seq: u64) -> Bytes {
        let mut frame = seq.to_be_bytes().to_vec();
        frame.extend_from_slice(self.identity.as_ref().map_or(&[][..], |id| &id[..]));
        Bytes::from(frame)
    }
}

/// A bound engine event publisher.
#[derive(Debug)]
pub struct EnginePublisher {
    pubs: PubSocket,
    replay: Option<RouterSocket>,
    topic: Bytes,
    buffer: Arc<Mutex<Buffer>>,
    capacity: usize,
}

impl EnginePublisher {
    /// Binds the PUB (and, with `replay`, the ROUTER) on `host`; ports 0 pick free ports.
    /// `buffer_steps` batches are kept for replay (vLLM's default: 10,000).
    pub async fn bind(
        host: &str,
        pub_port: u16,
        replay: Option<(u16, ReplayForm)>,
        topic: &str,
        buffer_steps: usize,
    ) -> Result<EnginePublisher, ZmtpError> {
        let pubs = PubSocket::bind(host, pub_port).await?;
        let buffer: Arc<Mutex<Buffer>> = Arc::default();
        let topic = Bytes::copy_from_slice(topic.as_bytes());
        let replay = match replay {
            None => None,
            Some((port, form)) => {
                let (buffer, topic) = (Arc::clone(&buffer), topic.clone());
                let handler: RouterHandler = Arc::new(move |request: Vec<Bytes>| {
                    answer(&buffer.lock(), &topic, form, &request)
                });
                Some(RouterSocket::bind(host, port, handler).await?)
            }
        };
        Ok(EnginePublisher {
            pubs,
            replay,
            topic,
            buffer,
            capacity: buffer_steps.max(1),
        })
    }

    /// The PUB port.
    pub fn pub_port(&self) -> u16 {
        self.pubs.port()
    }

    /// The replay port, if any.
    pub fn replay_port(&self) -> Option<u16> {
        self.replay.as_ref().map(RouterSocket::port)
    }

    /// Publishes one batch payload under the next seq; returns the seq.
    pub fn publish(&self, payload: Bytes) -> u64 {
        let mut b = self.buffer.lock();
        let seq = b.next_seq;
        b.next_seq += 1;
        b.batches.push_back((seq, payload.clone()));
        while b.batches.len() > self.capacity {
            b.batches.pop_front();
        }
        if b.drop_live > 0 {
            b.drop_live -= 1;
            return seq;
        }
        let seq_frame = b.seq_frame(seq);
        drop(b);
        self.pubs
            .publish(vec![self.topic.clone(), seq_frame, payload]);
        seq
    }

    /// Sends 24-byte seq frames with this identity from now on (vLLM's form with a snapshot
    /// endpoint); a new identity is what a restarted engine sends.
    pub fn set_identity(&self, identity: [u8; 16]) {
        self.buffer.lock().identity = Some(identity);
    }

    /// Plays a restarted engine on the same sockets: a new identity, nothing buffered, and
    /// numbers from `next_seq` on.
    pub fn restart_as(&self, identity: [u8; 16], next_seq: u64) {
        let mut b = self.buffer.lock();
        b.identity = Some(identity);
        b.batches.clear();
        b.next_seq = next_seq;
    }

    /// The next `n` batches are buffered for replay but not sent live.
    pub fn drop_next(&self, n: u32) {
        self.buffer.lock().drop_live += n;
    }

    /// The seq the next batch gets.
    pub fn next_seq(&self) -> u64 {
        self.buffer.lock().next_seq
    }
}

fn answer(b: &Buffer, topic: &Bytes, form: ReplayForm, request: &[Bytes]) -> Vec<Vec<Bytes>> {
    // A DEALER sends ("", seq); a REQ sends (seq).
    let seq = request
        .last()
        .and_then(|f| <[u8; 8]>::try_from(&f[..]).ok());
    let Some(start) = seq.map(u64::from_be_bytes) else {
        return Vec::new();
    };
    let empty = Bytes::new();
    let message = |seq: u64, payload: Bytes| {
        let seq = if seq == u64::MAX {
            Bytes::copy_from_slice(&seq.to_be_bytes())
        } else {
            b.seq_frame(seq)
        };
        match form {
            ReplayForm::WithTopic => vec![empty.clone(), topic.clone(), seq, payload],
            ReplayForm::NoTopic => vec![empty.clone(), seq, payload],
        }
    };
    let mut out: Vec<Vec<Bytes>> = b
        .batches
        .iter()
        .filter(|(s, _)| *s >= start)
        .map(|(s, p)| message(*s, p.clone()))
        .collect();
    let mut end = message(u64::MAX, empty.clone());
    if form == ReplayForm::WithTopic {
        end[1] = empty.clone();
    }
    out.push(end);
    out
}
