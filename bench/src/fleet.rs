//! W worker engines on one virtual clock: the driver both system benches share.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use kvroute::protocol::{DpRank, EventBatch, WorkerId};
use kvroute_worker::EngineConfig;
use kvroute_worker::engine::{Engine, Output, Request};

/// Where a fleet delivers what its engines produce.
pub trait FleetSink {
    /// Request outputs of worker `worker`.
    fn outputs(&mut self, worker: usize, outputs: &[Output]);
    /// KV event batches worker `worker` published at `at_us`.
    fn batches(&mut self, worker: usize, at_us: u64, batches: Vec<EventBatch>);
}

/// The engines and a heap of their wake-ups.
pub struct Fleet {
    engines: Vec<Engine>,
    wakeups: BinaryHeap<Reverse<(u64, usize)>>,
    outputs: Vec<Output>,
    batches: Vec<EventBatch>,
}

impl Fleet {
    /// `workers` idle engines with worker ids 0..workers.
    pub fn new(config: &EngineConfig, workers: usize) -> anyhow::Result<Self> {
        let engines = (0..workers)
            .map(|w| Engine::new(config.clone(), WorkerId(w as u64), DpRank(0), 1 + w as u64))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Fleet {
            engines,
            wakeups: BinaryHeap::new(),
            outputs: Vec::new(),
            batches: Vec::new(),
        })
    }

    /// The engines.
    pub fn engines(&self) -> &[Engine] {
        &self.engines
    }

    /// Time of the earliest pending wake-up.
    pub fn next_wakeup_us(&mut self) -> Option<u64> {
        while let Some(&Reverse((at, w))) = self.wakeups.peek() {
            if self.engines[w].next_wakeup_us() == Some(at) {
                return Some(at);
            }
            self.wakeups.pop();
        }
        None
    }

    /// Runs every engine wake-up due by `until_us`, in time order.
    pub fn run_until(&mut self, until_us: u64, sink: &mut impl FleetSink) -> anyhow::Result<()> {
        while let Some(at) = self.next_wakeup_us().filter(|at| *at <= until_us) {
            let Reverse((_, w)) = self.wakeups.pop().expect("invariant: peeked");
            self.engines[w].advance(at, &mut self.outputs)?;
            self.deliver(w, at, sink);
        }
        Ok(())
    }

    /// Hands `request` to worker `worker` at `at_us` (after [`Fleet::run_until`] of that
    /// time).
    pub fn submit(
        &mut self,
        worker: usize,
        at_us: u64,
        request: Request,
        sink: &mut impl FleetSink,
    ) -> anyhow::Result<()> {
        self.engines[worker].submit(at_us, request, &mut self.outputs);
        self.engines[worker].advance(at_us, &mut self.outputs)?;
        self.deliver(worker, at_us, sink);
        Ok(())
    }

    fn deliver(&mut self, w: usize, at: u64, sink: &mut impl FleetSink) {
        if !self.outputs.is_empty() {
            sink.outputs(w, &self.outputs);
            self.outputs.clear();
        }
        self.engines[w].drain_batches(&mut self.batches);
        if !self.batches.is_empty() {
            sink.batches(w, at, std::mem::take(&mut self.batches));
        }
        if let Some(next) = self.engines[w].next_wakeup_us() {
            self.wakeups.push(Reverse((next, w)));
        }
    }
}
