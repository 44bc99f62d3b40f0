//! The event subscription's way to the fleet owner, and the barrier that keeps a heartbeat's
//! watermark behind the events it counts.
//!
//! A worker publishes its batches on its events subject and reports the last id it sent in
//! its registration's heartbeat, a key-value put, over the same NATS connection. The server
//! takes that connection's messages in order, so a batch is on its way to the router (over
//! the router's one connection, in the same order) before the heartbeat that counts it. In
//! the router the two part ways: batches queue for the fleet owner through [`Intake`], the
//! heartbeat comes through the registry watch's task. A watermark handed on as it arrived
//! could reach its stream while the batches it counts still queued; with the queue more than
//! the reorder timeout behind (a burst, two cores shared with nats-server) the stream took
//! them for lost and resynced, every stream at once. So watermarks wait in
//! [`WatermarkGate`] for a [`Delivery::Barrier`]: the intake task sends one when asked,
//! once it has taken everything its subscription had ready, which includes every batch the
//! client had queued before the heartbeat reached the watch. (With the router's registry on
//! another connection the order is not the server's, but a backlog in the router is still
//! read first.) The wait is bounded: the client queues at most [`SUBSCRIPTION_QUEUE`]
//! messages per subscription, so once that many have been taken since the ask, everything
//! queued then has been read, and the barrier goes out even if more keep coming.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::{Notify, mpsc};

use super::super::fleet::StreamKey;
use super::super::transport::{Message, SUBSCRIPTION_QUEUE, Subscription};

/// What the intake hands the fleet owner.
#[derive(Debug)]
pub(super) enum Delivery {
    /// An event message, in the subscription's order.
    Message(Message),
    /// Every message the subscription had ready when the barrier was asked for came before.
    Barrier,
}

/// The event subscription's messages on their way to the fleet owner, bounded in bytes
/// ([`super::PlaneConfig::intake_bytes`]): a task takes each from the NATS client as it comes
/// (so the client's own queue stays short) and drops what would pass the bound.
pub(super) struct Intake {
    rx: mpsc::UnboundedReceiver<Delivery>,
    queued: Arc<AtomicUsize>,
    barrier: Arc<Notify>,
}

impl Intake {
    /// Starts the task reading `subscription`; `dropped` is called for each message dropped
    /// because `limit` bytes were already queued.
    pub(super) fn start(
        mut subscription: Subscription,
        limit: usize,
        dropped: impl Fn() + Send + 'static,
    ) -> Intake {
        let (tx, rx) = mpsc::unbounded_channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let held = Arc::clone(&queued);
        let barrier = Arc::new(Notify::new());
        let asked = Arc::clone(&barrier);
        tokio::spawn(async move {
            // Messages taken since the barrier was asked for, if it was.
            let mut barrier_due: Option<usize> = None;
            loop {
                // In this order: an ask is taken at once (between barriers), and a barrier
                // goes out once the subscription has given all it can have held when asked,
                // or has nothing ready (polled before the barrier's own branch).
                let message = tokio::select! {
                    biased;
                    () = std::future::ready(()), if barrier_due.is_some_and(|n| n >= SUBSCRIPTION_QUEUE) => None,
                    () = asked.notified(), if barrier_due.is_none() => {
                        barrier_due = Some(0);
                        continue;
                    }
                    message = subscription.next() => Some(message),
                    () = std::future::ready(()), if barrier_due.is_some() => None,
                    () = tx.closed() => return,
                };
                let Some(message) = message else {
                    barrier_due = None;
                    if tx.send(Delivery::Barrier).is_err() {
                        return;
                    }
                    continue;
                };
                if let Some(taken) = &mut barrier_due {
                    *taken += 1;
                }
                // The subscription's end ends the owner's reads (the sender goes).
                let Some(message) = message else { return };
                let charge = charge(&message);
                if held.load(Ordering::Relaxed) + charge > limit {
                    dropped();
                    continue;
                }
                held.fetch_add(charge, Ordering::Relaxed);
                if tx.send(Delivery::Message(message)).is_err() {
                    return;
                }
            }
        });
        Intake {
            rx,
            queued,
            barrier,
        }
    }

    /// The next delivery, or `None` once the subscription has ended.
    pub(super) async fn next(&mut self) -> Option<Delivery> {
        let delivery = self.rx.recv().await?;
        if let Delivery::Message(message) = &delivery {
            self.queued.fetch_sub(charge(message), Ordering::Relaxed);
        }
        Some(delivery)
    }

    /// Asks for a [`Delivery::Barrier`]. One ask, one barrier, if the next ask waits for it
    /// (the fleet owner's does: [`WatermarkGate`] has at most one outstanding).
    pub(super) fn ask_barrier(&self) {
        self.barrier.notify_one();
    }
}

/// What a message holds while queued: its payload, subject and reply subject (a publisher
/// may set one of up to a few KiB on an empty payload), and the message's own fields.
fn charge(message: &Message) -> usize {
    message.payload.len()
        + message.subject.len()
        + message.reply.as_ref().map_or(0, String::len)
        + 64
}

/// Heartbeats' watermarks waiting for the barrier that lets them follow their events: one
/// per stream at most in each of two generations (those a barrier asked for now covers, and
/// those that came after it was asked), so it holds no more than two per stream whatever
/// the heartbeat rate. Sans-I/O.
#[derive(Debug, Default)]
pub(super) struct WatermarkGate {
    /// Covered by the barrier asked for (if `asked`).
    waiting: HashMap<StreamKey, Watermark>,
    /// Came after it was asked: they wait for the next.
    next: HashMap<StreamKey, Watermark>,
    asked: bool,
}

/// A heartbeat's word: its worker has sent events up to `last_id` in `epoch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Watermark {
    pub epoch: u64,
    pub last_id: u64,
}

impl WatermarkGate {
    /// Holds a watermark (a later one of the same stream and generation replaces it). True
    /// if a barrier must be asked for now.
    #[must_use]
    pub(super) fn hold(&mut self, key: StreamKey, watermark: Watermark) -> bool {
        if self.asked {
            self.next.insert(key, watermark);
            false
        } else {
            self.waiting.insert(key, watermark);
            self.asked = true;
            true
        }
    }

    /// The barrier came: the watermarks it covers, to hand on. The gate's `bool` says
    /// whether another barrier must be asked for (watermarks came after this one was asked).
    pub(super) fn on_barrier(&mut self) -> (Vec<(StreamKey, Watermark)>, bool) {
        let released = std::mem::take(&mut self.waiting).into_iter().collect();
        self.waiting = std::mem::take(&mut self.next);
        self.asked = !self.waiting.is_empty();
        (released, self.asked)
    }

    /// The stream closed: its watermarks go (a stream opened again under the key starts
    /// afresh and must not hear its predecessor's).
    pub(super) fn forget(&mut self, key: StreamKey) {
        self.waiting.remove(&key);
        self.next.remove(&key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::transport::{LocalBus, Transport};
    use crate::protocol::{DpRank, WorkerId};

    fn key(id: u64) -> StreamKey {
        (WorkerId(id), DpRank(0))
    }

    fn mark(last_id: u64) -> Watermark {
        Watermark { epoch: 7, last_id }
    }

    /// A message is charged what it holds: an empty payload with a long reply subject
    /// (which the publisher chooses) costs the reply's bytes too.
    #[test]
    fn a_message_is_charged_its_reply_subject() {
        let message = |reply: Option<String>| Message {
            subject: "kvroute.c.events.1".into(),
            reply,
            payload: bytes::Bytes::new(),
        };
        let bare = charge(&message(None));
        assert_eq!(charge(&message(Some("r".repeat(4096)))), bare + 4096);
    }

    #[test]
    fn a_watermark_waits_for_the_barrier_asked_after_it() {
        let mut gate = WatermarkGate::default();
        assert!(gate.hold(key(1), mark(5)));
        // A barrier is out: later watermarks wait for the next one, and ask for nothing yet.
        assert!(!gate.hold(key(2), mark(3)));
        assert!(!gate.hold(key(1), mark(9)));
        let (released, again) = gate.on_barrier();
        assert_eq!(released, vec![(key(1), mark(5))]);
        assert!(again);
        let (mut released, again) = gate.on_barrier();
        released.sort_by_key(|(k, _)| *k);
        assert_eq!(released, vec![(key(1), mark(9)), (key(2), mark(3))]);
        assert!(!again);
        // Nothing outstanding: the next watermark asks again.
        assert!(gate.hold(key(1), mark(10)));
    }

    #[test]
    fn a_closed_stream_hears_none_of_its_watermarks() {
        let mut gate = WatermarkGate::default();
        assert!(gate.hold(key(1), mark(5)));
        assert!(!gate.hold(key(1), mark(6)));
        gate.forget(key(1));
        assert_eq!(gate.on_barrier(), (Vec::new(), false));
    }

    #[tokio::test(start_paused = true)]
    async fn the_barrier_comes_after_every_message_already_queued() {
        let transport = Transport::Local(LocalBus::new());
        let subscription = transport.subscribe("e.>").await.unwrap();
        let mut intake = Intake::start(subscription, 1 << 20, || {});
        // Queued in the subscription before the barrier is asked for, as the batches a
        // heartbeat counts are queued before the heartbeat reaches the registry watch (more
        // than a task's cooperative budget of 128 polls, which must not end the drain).
        for i in 0..1000u32 {
            transport
                .publish("e.1", None, i.to_le_bytes().to_vec().into())
                .await
                .unwrap();
        }
        intake.ask_barrier();
        let mut seen = Vec::new();
        while let Delivery::Message(m) = intake.next().await.unwrap() {
            seen.push(u32::from_le_bytes(m.payload[..4].try_into().unwrap()));
        }
        assert_eq!(seen, (0..1000).collect::<Vec<_>>());
        // Asked again with nothing queued, it comes at once.
        intake.ask_barrier();
        assert!(matches!(intake.next().await, Some(Delivery::Barrier)));
        transport
            .publish("e.1", None, vec![7].into())
            .await
            .unwrap();
        assert!(matches!(intake.next().await, Some(Delivery::Message(_))));
    }

    /// Under a flow that never pauses, the barrier still comes once the subscription has
    /// given all it could hold when asked.
    #[tokio::test(start_paused = true)]
    async fn the_barrier_comes_under_a_flow_that_never_pauses() {
        let transport = Transport::Local(LocalBus::new());
        let subscription = transport.subscribe("e.>").await.unwrap();
        let mut intake = Intake::start(subscription, usize::MAX, || {});
        let publisher = {
            let transport = transport.clone();
            // More a turn than the intake takes (its budget is 128 polls a turn): the
            // subscription is never empty again (the bus drops past its queue).
            tokio::spawn(async move {
                loop {
                    for _ in 0..512 {
                        let _ = transport.publish("e.1", None, vec![1].into()).await;
                    }
                    tokio::task::yield_now().await;
                }
            })
        };
        for _ in 0..16 {
            tokio::task::yield_now().await;
        }
        intake.ask_barrier();
        let mut taken = 0usize;
        while let Delivery::Message(_) = intake.next().await.unwrap() {
            taken += 1;
            assert!(
                taken <= 2 * SUBSCRIPTION_QUEUE,
                "no barrier after {taken} messages"
            );
        }
        assert!(taken > 0);
        publisher.abort();
    }
}
