//! The engine on its own OS thread, on wall time: it takes jobs and snapshot requests from
//! a bounded channel, advances at each wake-up, hands each request its outputs and the
//! publisher its KV event batches. Nothing it sends to can make it wait: outputs and
//! batches go through `try_send`, and what does not fit is dealt with and counted.

use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, sync_channel};
use std::time::{Duration, Instant};

use std::sync::Arc;

use kvroute::protocol::EventBatch;
use tokio::sync::{mpsc, watch};

use crate::emulate::Emulation;
use crate::engine::{Engine, Output, OutputKind, RequestId};
use crate::plane::{SnapshotRequest, WorkerPlane};

/// Jobs and snapshot requests queued for the engine; beyond, generate answers 503.
pub(crate) const INPUT_QUEUE: usize = 4096;

/// A job for the engine thread.
pub(crate) struct Job {
    pub request: crate::engine::Request,
    /// Outputs of the request; dropping the receiver cancels it, and a sender dropped
    /// before `Finished` means the request was cut off (its client fell too far behind).
    pub outputs: mpsc::Sender<Output>,
}

/// What the engine thread takes.
pub(crate) enum EngineInput {
    /// A request to run.
    Job(Job),
    /// A snapshot of the cache, for a router's resync.
    Snapshot(SnapshotRequest),
    /// Fail as a broken engine would (fault injection).
    Fail,
    /// Panic (tests: a bug on the engine thread).
    #[cfg(test)]
    Panic,
    /// Stop.
    Stop,
}

/// A panic's message, if it has one (`panic!` with a literal or a formatted string).
fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("no message")
}

/// The handle on the engine thread.
pub(crate) struct EngineHandle {
    inputs: SyncSender<EngineInput>,
    failed: watch::Receiver<Option<String>>,
}

impl EngineHandle {
    /// Starts the thread. Batches go to `events` (full: dropped, the heartbeat announces
    /// their ids through `plane`, and the router resyncs); an emulated engine's load goes to
    /// its rank's [`crate::emulate::LoadCell`] too.
    pub fn spawn(
        engine: Engine,
        events: mpsc::Sender<EventBatch>,
        plane: WorkerPlane,
        emulation: Option<(Arc<Emulation>, usize)>,
    ) -> std::io::Result<EngineHandle> {
        let (inputs, rx) = sync_channel(INPUT_QUEUE);
        let (failure, failed) = watch::channel(None);
        std::thread::Builder::new()
            .name("kvroute-engine".into())
            .spawn(move || {
                // A panic is a failure too, with its reason: the thread's end alone closed
                // the channel, which one rank's relay took for a failure with no reason, and
                // beside other ranks' was not seen at all (the dead rank stayed chosen).
                let mut engine = engine;
                let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    run(&mut engine, rx, events, plane, emulation)
                }));
                let fail = |reason: String| {
                    tracing::error!(%reason, "engine failed");
                    failure.send_if_modified(|failed| {
                        let first = failed.is_none();
                        if first {
                            *failed = Some(reason);
                        }
                        first
                    });
                };
                match ran {
                    Ok(Ok(())) => {}
                    Ok(Err(reason)) => fail(reason),
                    Err(panic) => fail(format!("engine panicked: {}", panic_message(&*panic))),
                }
                // Dropped only once a failure is out: the drop of a GPU's KV memory waits
                // for its streams, for good if a device copy is stuck (the failure it
                // stopped for), and the worker never heard it had failed.
                let dropped =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(engine)));
                if let Err(panic) = dropped {
                    fail(format!("engine panicked: {}", panic_message(&*panic)));
                }
            })?;
        Ok(EngineHandle { inputs, failed })
    }

    /// Where to send jobs and snapshot requests.
    pub fn inputs(&self) -> SyncSender<EngineInput> {
        self.inputs.clone()
    }

    /// Changes to `Some(reason)` if the engine fails.
    pub fn failed(&self) -> watch::Receiver<Option<String>> {
        self.failed.clone()
    }

    /// Asks the thread to stop (it finishes its current step first).
    pub fn stop(&self) {
        // A full queue still stops it: every sender gone ends the thread too, and a
        // blocking send from async code is not an option.
        let _ = self.inputs.try_send(EngineInput::Stop);
    }
}

fn run(
    engine: &mut Engine,
    inputs: Receiver<EngineInput>,
    events: mpsc::Sender<EventBatch>,
    plane: WorkerPlane,
    emulation: Option<(Arc<Emulation>, usize)>,
) -> Result<(), String> {
    let start = Instant::now();
    let wall_us = || start.elapsed().as_micros() as u64;
    // The engine's clock: wall time, except that a step due within 1 ms is run at once and
    // the clock jumps to its end, so a fast engine (high speedup) is not held to the
    // thread's wake-up latency per step. It never runs more than 1 ms ahead.
    let mut clock = 0u64;
    let mut waiting: HashMap<RequestId, mpsc::Sender<Output>> = HashMap::new();
    // Outputs a request's channel had no room for, in order, until its client reads them.
    let mut backlog: HashMap<RequestId, Backlog> = HashMap::new();
    let mut out = Vec::new();
    let mut batches = Vec::new();
    // Its G1 size is in its `/metrics` before its first request.
    // An emulated engine's load is left where its `/metrics` reads it (its G1 size from
    // before its first request).
    let rank = emulation.as_ref().and_then(|(e, r)| e.ranks.get(*r));
    if let Some(r) = rank {
        r.load.set(&engine.load());
    }
    let series = Series::new(emulation.as_ref().map(|(e, r)| (*r, e.ranks.len())));
    loop {
        let wall = wall_us();
        clock = clock.max(wall);
        if let Some(due) = engine.next_wakeup_us().filter(|t| *t <= wall + 1_000) {
            clock = clock.max(due);
        }
        // With outputs held back, their clients are looked at again within a millisecond.
        let flush = (!backlog.is_empty()).then_some(BACKLOG_POLL);
        let input = match engine.next_wakeup_us() {
            Some(t) if t <= clock => inputs.try_recv().map_err(|e| match e {
                std::sync::mpsc::TryRecvError::Empty => RecvTimeoutError::Timeout,
                std::sync::mpsc::TryRecvError::Disconnected => RecvTimeoutError::Disconnected,
            }),
            Some(t) => {
                let wait = Duration::from_micros(t - clock);
                inputs.recv_timeout(flush.map_or(wait, |f| f.min(wait)))
            }
            None => match flush {
                Some(f) => inputs.recv_timeout(f),
                None => inputs.recv().map_err(|_| RecvTimeoutError::Disconnected),
            },
        };
        clock = clock.max(wall_us());
        match input {
            Ok(EngineInput::Job(job)) => {
                waiting.insert(job.request.id, job.outputs);
                engine.submit(clock, job.request, &mut out);
            }
            Ok(EngineInput::Snapshot(request)) => {
                let _ = request.reply.send(engine.snapshot());
            }
            Ok(EngineInput::Fail) => return Err("fault injected: engine failure".into()),
            #[cfg(test)]
            Ok(EngineInput::Panic) => panic!("a test's panic"),
            Ok(EngineInput::Stop) | Err(RecvTimeoutError::Disconnected) => return Ok(()),
            Err(RecvTimeoutError::Timeout) => {}
        }
        let advanced = engine.advance(clock, &mut out);
        let load = engine.load();
        series.waiting.set(load.waiting as f64);
        series.running.set(load.running as f64);
        series.g1_used.set(load.g1_used as f64);
        if let Some(r) = rank {
            r.load.set(&load);
        }
        let cache = engine.blocks().stats();
        series.offloaded.absolute(cache.offloaded);
        series.onboarded.absolute(cache.onboarded);
        series.verified.absolute(cache.verified);
        series.verify_failures.absolute(cache.verify_failures);
        series.late_copies.absolute(cache.late_copies);
        series.shared_on_register.absolute(cache.shared_on_register);
        // A failed copy or verification stops the engine, after it has been counted.
        advanced.map_err(|e| e.to_string())?;
        // What clients left unread before goes first, in order.
        let now = Instant::now();
        let (mut ended, mut stalled) = (Vec::new(), Vec::new());
        backlog.retain(|id, held| {
            let Some(tx) = waiting.get(id) else {
                return false;
            };
            match held.flush(tx, now) {
                Flushed::Empty { ended: true } => {
                    ended.push(*id);
                    false
                }
                Flushed::Empty { ended: false } => false,
                Flushed::Waiting => true,
                Flushed::Stalled | Flushed::Closed => {
                    stalled.push(*id);
                    false
                }
            }
        });
        for id in ended {
            waiting.remove(&id);
        }
        for id in stalled {
            end_unread(engine, &mut waiting, id);
        }
        for o in out.drain(..) {
            if matches!(o.kind, OutputKind::Token { .. }) {
                series.tokens.increment(1);
            }
            let id = o.request;
            let done = matches!(o.kind, OutputKind::Finished | OutputKind::Rejected(_));
            let Some(tx) = waiting.get(&id) else {
                continue;
            };
            if let Some(held) = backlog.get_mut(&id) {
                if !held.hold(o, now) {
                    backlog.remove(&id);
                    end_unread(engine, &mut waiting, id);
                }
                continue;
            }
            match tx.try_send(o) {
                Ok(()) if done => {
                    waiting.remove(&id);
                }
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    waiting.remove(&id);
                    if !done {
                        engine.cancel(id);
                    }
                }
                // The client has not read what it was sent yet: the rest waits here, in
                // order (a fast engine, or a thread that woke late, writes many tokens in
                // one turn).
                Err(mpsc::error::TrySendError::Full(o)) => {
                    backlog.insert(
                        id,
                        Backlog {
                            outputs: VecDeque::from([o]),
                            progress: now,
                        },
                    );
                }
            }
        }
        // Clients that went away between outputs: free their blocks now.
        let gone: Vec<RequestId> = waiting
            .iter()
            .filter(|(_, tx)| tx.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            waiting.remove(&id);
            engine.cancel(id);
        }
        engine.drain_batches(&mut batches);
        for batch in batches.drain(..) {
            match events.try_send(batch) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(batch))
                | Err(mpsc::error::TrySendError::Closed(batch)) => {
                    metrics::counter!("kvroute_worker_event_batches_dropped_total").increment(1);
                    plane.note_sent(&batch);
                }
            }
        }
    }
}

/// How often outputs held back are offered to their clients again.
const BACKLOG_POLL: Duration = Duration::from_millis(1);

/// A client that reads none of its outputs for this long is cut off: its request is
/// cancelled and its stream ends with an error (the router's idle timeout between tokens
/// is 30 s; a worker's clients are its routers).
const CLIENT_STALL: Duration = Duration::from_secs(10);

/// Outputs a request's backlog holds before its client must keep up: past them, a client
/// that took none for [`BACKLOG_PATIENCE`] is cut off as one that stalled. A finished
/// request's blocks go back to the pool while its backlog waits for the client, so without
/// this a client reading one chunk every few seconds held its whole answer here (about 40 B
/// an output, 10 MB for a G1's worth of tokens), however many such clients came; a client
/// that reads as fast as it can keeps a fast engine's whole answer coming.
const BACKLOG_MAX: usize = 8 * 1024;

/// How recently a client with a full backlog must have taken an output.
const BACKLOG_PATIENCE: Duration = Duration::from_secs(1);

/// A request's outputs its channel had no room for ([`BACKLOG_MAX`]).
struct Backlog {
    outputs: VecDeque<Output>,
    /// When its client last took one.
    progress: Instant,
}

/// What offering a backlog to its client came to.
enum Flushed {
    /// All taken; `ended`: the last was the request's end.
    Empty { ended: bool },
    /// Some left; the client is reading.
    Waiting,
    /// Some left, and the client has taken none for [`CLIENT_STALL`].
    Stalled,
    /// The client is gone.
    Closed,
}

impl Backlog {
    /// Holds `o` after the others; false if the backlog is full and its client took
    /// nothing for [`BACKLOG_PATIENCE`] up to `now` (it is too slow).
    fn hold(&mut self, o: Output, now: Instant) -> bool {
        if self.outputs.len() >= BACKLOG_MAX
            && now.duration_since(self.progress) >= BACKLOG_PATIENCE
        {
            return false;
        }
        self.outputs.push_back(o);
        true
    }

    fn flush(&mut self, tx: &mpsc::Sender<Output>, now: Instant) -> Flushed {
        let mut ended = false;
        while let Some(o) = self.outputs.pop_front() {
            let end = matches!(o.kind, OutputKind::Finished | OutputKind::Rejected(_));
            match tx.try_send(o) {
                Ok(()) => {
                    self.progress = now;
                    ended = end;
                }
                Err(mpsc::error::TrySendError::Full(o)) => {
                    self.outputs.push_front(o);
                    return if now.duration_since(self.progress) >= CLIENT_STALL {
                        Flushed::Stalled
                    } else {
                        Flushed::Waiting
                    };
                }
                Err(mpsc::error::TrySendError::Closed(_)) => return Flushed::Closed,
            }
        }
        Flushed::Empty { ended }
    }
}

/// Ends request `id`, whose client stopped reading or left: cancelled (if it was still
/// running), its channel dropped (its stream ends with an error).
fn end_unread(
    engine: &mut Engine,
    waiting: &mut HashMap<RequestId, mpsc::Sender<Output>>,
    id: RequestId,
) {
    if waiting.remove(&id).is_some_and(|tx| !tx.is_closed()) {
        metrics::counter!("kvroute_worker_slow_client_total").increment(1);
        tracing::warn!(
            request = id.0,
            "client read nothing for {CLIENT_STALL:?}, or left {BACKLOG_MAX} outputs unread; its stream is cut off"
        );
    }
    engine.cancel(id);
}

/// The engine's own series, registered once. An engine that is one rank of several (an
/// emulated data-parallel engine: one thread per rank in one process) labels them with its
/// `rank`: unlabelled, the ranks would overwrite one another's gauges and take turns at the
/// counters' values (a counter jumping between ranks reads as resets).
struct Series {
    waiting: metrics::Gauge,
    running: metrics::Gauge,
    g1_used: metrics::Gauge,
    offloaded: metrics::Counter,
    onboarded: metrics::Counter,
    verified: metrics::Counter,
    verify_failures: metrics::Counter,
    late_copies: metrics::Counter,
    shared_on_register: metrics::Counter,
    tokens: metrics::Counter,
}

impl Series {
    /// `rank`: this engine's rank and how many there are, if it is one of several.
    fn new(rank: Option<(usize, usize)>) -> Series {
        let labels: Vec<metrics::Label> = match rank {
            Some((r, ranks)) if ranks > 1 => vec![metrics::Label::new("rank", r.to_string())],
            _ => Vec::new(),
        };
        let gauge = |name: &'static str| metrics::gauge!(name, labels.clone());
        let counter = |name: &'static str| metrics::counter!(name, labels.clone());
        // At 0 from the start (it is counted where batches are dropped, without labels): a
        // series born at 1 is not an `increase()` to Prometheus, and its alert missed the
        // first overflow.
        metrics::counter!("kvroute_worker_event_batches_dropped_total").increment(0);
        Series {
            waiting: gauge("kvroute_worker_requests_waiting"),
            running: gauge("kvroute_worker_requests_running"),
            g1_used: gauge("kvroute_worker_g1_blocks_used"),
            offloaded: counter("kvroute_worker_offloaded_blocks_total"),
            onboarded: counter("kvroute_worker_onboarded_blocks_total"),
            verified: counter("kvroute_worker_onboard_verified_blocks_total"),
            verify_failures: counter("kvroute_worker_onboard_verify_failures_total"),
            late_copies: counter("kvroute_worker_copies_late_total"),
            shared_on_register: counter("kvroute_worker_blocks_shared_on_register_total"),
            tokens: counter("kvroute_worker_tokens_total"),
        }
    }
}

#[cfg(test)]
mod tests {
    use kvroute::events::transport::{LocalBus, Transport};
    use kvroute::protocol::{DpRank, WorkerId};

    use super::*;
    use crate::config::EngineConfig;

    /// A backlog past [`BACKLOG_MAX`] outputs holds more only for a client that keeps
    /// taking them: one that reads, but slower than the engine writes, is cut off once that
    /// far behind (its backlog grew with the whole answer, which the request's blocks no
    /// longer bounded once it finished); one that reads as fast as it can is not.
    #[test]
    fn a_backlog_is_bounded_for_a_slow_client() {
        let output = |at_us| Output {
            request: RequestId(1),
            at_us,
            kind: OutputKind::Finished,
        };
        let start = Instant::now();
        let mut held = Backlog {
            outputs: VecDeque::new(),
            progress: start,
        };
        for at in 0..BACKLOG_MAX as u64 {
            assert!(held.hold(output(at), start + BACKLOG_PATIENCE));
        }
        // Full, and its client took one just now: held.
        assert!(held.hold(output(0), start + BACKLOG_PATIENCE / 2));
        // Full, and nothing taken for the patience: cut off.
        assert!(!held.hold(output(0), start + BACKLOG_PATIENCE));
        assert_eq!(held.outputs.len(), BACKLOG_MAX + 1);
    }

    /// A panic on the engine thread fails the engine with its reason, as an error does: the
    /// thread's end alone was seen as a failure without a reason with one rank, and not at
    /// all beside other ranks.
    #[tokio::test]
    async fn a_panic_on_the_engine_thread_is_a_failure_with_its_reason() {
        let engine = Engine::new(EngineConfig::default(), WorkerId(1), DpRank(0), 42).unwrap();
        let info = Arc::new(parking_lot::Mutex::new(crate::plane::test_info(1)));
        let plane = WorkerPlane::new(Transport::Local(LocalBus::new()), "c", info);
        let (events, _kept) = mpsc::channel(4);
        let handle = EngineHandle::spawn(engine, events, plane, None).unwrap();
        handle.inputs().send(EngineInput::Panic).unwrap();
        let mut failed = handle.failed();
        let reason =
            tokio::time::timeout(Duration::from_secs(30), failed.wait_for(Option::is_some))
                .await
                .expect("the engine thread said nothing")
                .expect("the engine thread ended without a reason")
                .clone()
                .unwrap_or_default();
        assert!(reason.contains("a test's panic"), "{reason}");
    }
}
