//! Continuous batching in the manner of vLLM: waiting and running queues, a token budget per
//! step with chunked prefill, prefix-cache reuse (and G2 onboarding) at admission, and
//! preemption by recompute (newest first) when G1 runs out. Step times come from a
//! [`TimingModel`]; the clock is injected (`now_us` on every call), so the same engine runs
//! on a virtual clock in replay and on wall time in the server.
//!
//! The driver loop is: [`Engine::submit`] / [`Engine::cancel`] as requests come, and
//! [`Engine::advance`] at [`Engine::next_wakeup_us`]. The engine never needs a call between
//! wake-ups, never spins, and never runs a zero-length step.

mod timing;

use std::collections::VecDeque;
use std::num::NonZeroUsize;
use std::sync::Arc;

use kvroute::protocol::{
    BlockHash, DpRank, EventBatch, Salt, Snapshot, StoredBlock, Tier, WorkerId, extend_blocks,
    local_hash, seq_hash,
};
pub use timing::{MixedStep, TimingModel};

use crate::block_manager::{AllocError, BlockManager, Change, Lease, OffloadError, OnboardTicket};
use crate::config::{ConfigError, EngineConfig};
use crate::publisher::{MAX_EVENT_BLOCKS, Publisher};

/// Names a request within one worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId(pub u64);

/// A generation request: token ids in, `max_tokens` tokens out.
#[derive(Clone, Debug)]
pub struct Request {
    /// Caller-chosen id, unique among the engine's live requests.
    pub id: RequestId,
    /// The prompt.
    pub prompt: Prompt,
    /// Tokens to generate (at least 1).
    pub max_tokens: u32,
    /// Cache namespace of the prompt's block hashes.
    pub salt: Salt,
}

/// A request's prompt: its token ids, or only what the engine reads of them.
#[derive(Clone, Debug)]
pub enum Prompt {
    /// Token ids; the engine hashes their full blocks.
    Tokens(Arc<[u32]>),
    /// A prompt its sender hashed already, at this engine's block size and under the
    /// request's salt (the replay hashes each prompt once, for the router and every engine):
    /// its full blocks' hashes, trusted as given, and the tokens after them (fewer than a
    /// block), which decoding completes into a block. Its length is
    /// `blocks.len() × block_size + tail.len()`.
    Hashed {
        /// The full blocks' hashes, in order.
        blocks: Arc<[BlockHash]>,
        /// The tokens after the last full block.
        tail: Arc<[u32]>,
    },
}

impl From<Arc<[u32]>> for Prompt {
    fn from(tokens: Arc<[u32]>) -> Self {
        Prompt::Tokens(tokens)
    }
}

impl From<Vec<u32>> for Prompt {
    fn from(tokens: Vec<u32>) -> Self {
        Prompt::Tokens(tokens.into())
    }
}

/// What happened to a request, when.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Output {
    /// The request.
    pub request: RequestId,
    /// Engine clock, µs.
    pub at_us: u64,
    /// What happened.
    pub kind: OutputKind,
}

/// The kinds of [`Output`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputKind {
    /// Accepted into the waiting queue.
    Queued,
    /// Admitted for the first time, with the prompt tokens found cached in G1 and those
    /// onboarded from G2 (the request's prefix reuse).
    Admitted {
        /// Prompt tokens served from G1.
        device_tokens: usize,
        /// Prompt tokens onboarded from G2.
        host_tokens: usize,
    },
    /// An output token (index 0 is the first token).
    Token {
        /// Position among the outputs.
        index: u32,
        /// The token id.
        token: u32,
    },
    /// The request produced `max_tokens` tokens; its blocks are released.
    Finished,
    /// Preempted to free G1; it will be recomputed.
    Preempted,
    /// Refused.
    Rejected(RejectReason),
}

/// Why a request was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RejectReason {
    /// Prompt plus output would need more G1 blocks than exist.
    #[error("request needs {needed} KV blocks, G1 has {capacity}")]
    TooLong {
        /// Blocks needed.
        needed: usize,
        /// G1 capacity.
        capacity: usize,
    },
    /// `max_tokens` is 0 or the prompt is empty.
    #[error("empty prompt or max_tokens 0")]
    Empty,
    /// A live request already has this id.
    #[error("duplicate request id")]
    DuplicateId,
    /// A hashed prompt whose tail is a whole block or more.
    #[error("hashed prompt: tail of {tail} tokens, blocks are {block_size}")]
    TailTooLong {
        /// Tokens in the tail.
        tail: usize,
        /// The engine's block size.
        block_size: usize,
    },
}

/// One engine step, for monitoring and benches.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepStats {
    /// Start, µs.
    pub start_us: u64,
    /// Duration, µs.
    pub duration_us: u64,
    /// Sequences computed in the step.
    pub seqs: usize,
    /// Prefill tokens computed.
    pub prefill_tokens: usize,
    /// Decode tokens computed.
    pub decode_tokens: usize,
    /// G1 slots not free at the start.
    pub g1_used: usize,
    /// G2 slots not free at the start.
    pub g2_used: usize,
    /// Requests waiting for admission at the start.
    pub waiting: usize,
}

/// Queue sizes and KV use, for load reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineLoad {
    /// Requests waiting for admission.
    pub waiting: usize,
    /// Requests admitted.
    pub running: usize,
    /// G1 slots not free.
    pub g1_used: usize,
    /// Of those, the ones requests hold or fill (the rest are cached blocks nobody uses,
    /// which vLLM counts as free in its KV usage).
    pub g1_in_use: usize,
    /// G1 capacity.
    pub g1_capacity: usize,
}

/// A failure that stops the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The copy engine found corrupted bytes.
    #[error(transparent)]
    Offload(#[from] OffloadError),
}

#[derive(Debug)]
enum SeqState {
    Waiting,
    Onboarding {
        ticket: OnboardTicket,
        ready_tokens: usize,
    },
    Running,
}

#[derive(Debug)]
struct Seq {
    id: RequestId,
    /// When it was submitted: no step starting earlier takes it.
    arrived_us: u64,
    prompt_len: usize,
    /// The prompt's tokens from position `known_from` on: all of them, or a hashed prompt's
    /// tail (the only ones ever read again).
    known: Arc<[u32]>,
    known_from: usize,
    max_tokens: u32,
    salt: Salt,
    /// Hashes of every full block of the sequence known so far (prompt, then outputs).
    hashes: Vec<BlockHash>,
    lease: Option<Lease>,
    state: SeqState,
    /// Tokens whose KV is computed (or was found cached).
    kv_len: usize,
    /// Leading blocks of the lease that are full (hits, onboarded or registered).
    full_blocks: usize,
    generated: u32,
    /// Tokens scheduled in the step in flight.
    scheduled: usize,
    admitted: bool,
}

impl Seq {
    /// Tokens known: prompt and outputs.
    fn total(&self) -> usize {
        self.prompt_len + self.generated as usize
    }

    /// Token `pos` of a block being hashed: one after the prompt's full blocks.
    fn token_at(&self, pos: usize, vocab: u32) -> u32 {
        if pos < self.prompt_len {
            debug_assert!(pos >= self.known_from, "a hashed prompt's block read");
            self.known[pos - self.known_from]
        } else {
            output_token(self.id, (pos - self.prompt_len) as u32, vocab)
        }
    }
}

/// The token a request generates at output position `index`: synthetic, deterministic.
pub fn output_token(id: RequestId, index: u32, vocab: u32) -> u32 {
    let mut z = id.0.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(index);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    ((z ^ (z >> 31)) % u64::from(vocab)) as u32
}

/// Outcome of [`Engine::grow`] for the sequence that grows.
enum Growth {
    Grown,
    Preempted,
    /// Slots are on their way back from G1→G2 copies.
    Pending,
}

/// What [`Engine::grow`] did: its outcome, and whether it preempted anyone on the way.
struct Grew {
    outcome: Growth,
    preempted: bool,
}

#[derive(Debug)]
struct Step {
    end_us: u64,
}

/// One worker's (one dp rank's) engine.
#[derive(Debug)]
pub struct Engine {
    config: EngineConfig,
    block_size: NonZeroUsize,
    blocks: BlockManager,
    publisher: Publisher,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    step: Option<Step>,
    now_us: u64,
    batches: Vec<EventBatch>,
    steps: Vec<StepStats>,
    changes: Vec<Change>,
    ready: Vec<OnboardTicket>,
    record_steps: bool,
}

impl Engine {
    /// An idle engine for incarnation `epoch` of worker `worker`.
    pub fn new(
        config: EngineConfig,
        worker: WorkerId,
        dp_rank: DpRank,
        epoch: u64,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        let block_size = NonZeroUsize::new(config.block_size).ok_or(ConfigError::NotPositive {
            field: "block_size",
        })?;
        Ok(Engine {
            blocks: BlockManager::on_device(&config)?,
            publisher: Publisher::new(worker, dp_rank, epoch),
            config,
            block_size,
            waiting: VecDeque::new(),
            running: Vec::new(),
            step: None,
            now_us: 0,
            batches: Vec::new(),
            steps: Vec::new(),
            changes: Vec::new(),
            ready: Vec::new(),
            record_steps: false,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The block manager (shared handle).
    pub fn blocks(&self) -> &BlockManager {
        &self.blocks
    }

    /// Keep a [`StepStats`] per step for [`Engine::drain_steps`].
    pub fn record_steps(&mut self, on: bool) {
        self.record_steps = on;
    }

    /// Queue sizes and G1 use.
    pub fn load(&self) -> EngineLoad {
        let g1 = self.blocks.usage(Tier::Device);
        EngineLoad {
            waiting: self.waiting.len(),
            running: self.running.len(),
            g1_used: g1.capacity - g1.free,
            // Requests' blocks: not those only an offload copy still reads (an offload
            // burst read as the cache filling, and the router's busy check skipped the
            // worker).
            g1_in_use: g1.mutable + g1.registered - g1.offloading,
            g1_capacity: g1.capacity,
        }
    }

    /// Whether no request is waiting or running.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Queues a request at `now_us` (call [`Engine::advance`] with the same time after).
    pub fn submit(&mut self, now_us: u64, request: Request, out: &mut Vec<Output>) {
        let reject = |reason| Output {
            request: request.id,
            at_us: now_us,
            kind: OutputKind::Rejected(reason),
        };
        let bs = self.config.block_size;
        let prompt_len = match &request.prompt {
            Prompt::Tokens(tokens) => tokens.len(),
            Prompt::Hashed { blocks, tail } => blocks.len() * bs + tail.len(),
        };
        if prompt_len == 0 || request.max_tokens == 0 {
            out.push(reject(RejectReason::Empty));
            return;
        }
        if let Prompt::Hashed { tail, .. } = &request.prompt
            && tail.len() >= bs
        {
            out.push(reject(RejectReason::TailTooLong {
                tail: tail.len(),
                block_size: bs,
            }));
            return;
        }
        // The last output token is sampled, never computed: its KV is never held.
        let needed = (prompt_len + request.max_tokens as usize - 1).div_ceil(bs);
        if needed > self.config.g1_blocks {
            out.push(reject(RejectReason::TooLong {
                needed,
                capacity: self.config.g1_blocks,
            }));
            return;
        }
        if self
            .waiting
            .iter()
            .chain(&self.running)
            .any(|s| s.id == request.id)
        {
            out.push(reject(RejectReason::DuplicateId));
            return;
        }
        let (hashes, known, known_from) = match request.prompt {
            Prompt::Tokens(tokens) => {
                let mut hashes = Vec::new();
                extend_blocks(None, &tokens, self.block_size, request.salt, &mut hashes);
                (hashes, tokens, 0)
            }
            Prompt::Hashed { blocks, tail } => {
                let from = prompt_len - tail.len();
                (blocks.to_vec(), tail, from)
            }
        };
        self.waiting.push_back(Seq {
            id: request.id,
            arrived_us: now_us,
            prompt_len,
            known,
            known_from,
            max_tokens: request.max_tokens,
            salt: request.salt,
            hashes,
            lease: None,
            state: SeqState::Waiting,
            kv_len: 0,
            full_blocks: 0,
            generated: 0,
            scheduled: 0,
            admitted: false,
        });
        out.push(Output {
            request: request.id,
            at_us: now_us,
            kind: OutputKind::Queued,
        });
    }

    /// Drops a request wherever it is; its blocks are released at once. Returns whether it
    /// was live.
    pub fn cancel(&mut self, id: RequestId) -> bool {
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(i);
        } else if let Some(i) = self.running.iter().position(|s| s.id == id) {
            self.running.remove(i);
        } else {
            return false;
        }
        self.collect_changes(self.step.is_none());
        true
    }

    /// When the engine next needs [`Engine::advance`]: the end of the step in flight or of
    /// a copy. `None` when idle (until the next submit).
    pub fn next_wakeup_us(&self) -> Option<u64> {
        let step = self.step.as_ref().map(|s| s.end_us);
        match (step, self.blocks.next_wakeup_us()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Runs everything due by `now_us`, in time order: copies that complete, the step in
    /// flight ending (tokens out, blocks registered, events flushed), and the next step
    /// starting the moment the previous one ends.
    pub fn advance(&mut self, now_us: u64, out: &mut Vec<Output>) -> Result<(), EngineError> {
        if let Some(e) = self.blocks.take_device_failure() {
            return Err(e.into());
        }
        let mut result = Ok(());
        while let Some(t) = self.next_wakeup_us().filter(|t| *t <= now_us) {
            self.now_us = self.now_us.max(t);
            if let Err(e) = self.blocks.advance(t, &mut self.ready) {
                result = Err(e.into());
            }
            self.mark_onboarded();
            if self.step.as_ref().is_some_and(|s| s.end_us <= t) {
                self.finish_step(t, out);
            }
            if self.step.is_none() {
                self.schedule(t, out);
            }
            // With no step in flight (copies that landed after the last one), nothing would
            // flush them before the next step, however far off: routers would miss the
            // blocks on the host meanwhile, and the heartbeat would show no gap.
            self.collect_changes(self.step.is_none());
        }
        self.now_us = self.now_us.max(now_us);
        if self.step.is_none() {
            self.schedule(self.now_us, out);
            self.collect_changes(self.step.is_none());
        }
        // A failure met on the way (a fill the device refused as a step ended) is reported
        // now: the engine may be idle after it, and its thread then waits for input with no
        // wake-up due, while the worker stays registered and routed to.
        if result.is_ok()
            && let Some(e) = self.blocks.take_device_failure()
        {
            result = Err(e.into());
        }
        result
    }

    /// Moves the flushed KV event batches into `out`.
    pub fn drain_batches(&mut self, out: &mut Vec<EventBatch>) {
        out.append(&mut self.batches);
    }

    /// Moves the recorded step stats into `out`.
    pub fn drain_steps(&mut self, out: &mut Vec<StepStats>) {
        out.append(&mut self.steps);
    }

    /// The resident set the published events describe: the block manager's pools, once its
    /// pending changes are flushed as events (into the batches to drain), so the watermark
    /// covers everything the snapshot holds.
    pub fn snapshot(&mut self) -> Snapshot {
        self.collect_changes(true);
        let blocks = [Tier::Device, Tier::Host].into_iter().flat_map(|tier| {
            self.blocks
                .resident(tier)
                .into_iter()
                .map(move |(parent, block)| (tier, parent, block))
        });
        self.publisher.snapshot(blocks)
    }

    fn collect_changes(&mut self, flush: bool) {
        self.blocks.drain_changes(&mut self.changes);
        self.publisher.record(&self.changes);
        self.changes.clear();
        if flush || self.publisher.pending_blocks() >= MAX_EVENT_BLOCKS {
            self.flush_events();
        }
    }

    fn flush_events(&mut self) {
        if let Some(batch) = self.publisher.flush(self.now_us) {
            self.batches.push(batch);
        }
    }

    fn mark_onboarded(&mut self) {
        for ticket in self.ready.drain(..) {
            if let Some(seq) = self
                .running
                .iter_mut()
                .find(|s| matches!(s.state, SeqState::Onboarding { ticket: t, .. } if t == ticket))
            {
                if let SeqState::Onboarding { ready_tokens, .. } = seq.state {
                    let onboarded = seq.full_blocks..ready_tokens / self.config.block_size;
                    let lease = seq
                        .lease
                        .as_mut()
                        .expect("invariant: onboarding sequences hold a lease");
                    self.blocks.share_onboarded(lease, onboarded.clone());
                    seq.kv_len = ready_tokens.min(seq.total() - 1);
                    seq.full_blocks = onboarded.end;
                }
                seq.state = SeqState::Running;
            }
        }
    }

    /// Picks the next step's batch at `now` and starts it, if there is anything to compute.
    /// As vLLM v1's scheduler: running sequences first, growing their blocks chunk by chunk
    /// (preempting the newest when G1 runs out); then, unless that preempted anyone, waiting
    /// requests in order, each admitted only if its whole remaining prompt fits in free plus
    /// evictable blocks, though it is given blocks for its first chunk only.
    fn schedule(&mut self, now: u64, out: &mut Vec<Output>) {
        let bs = self.config.block_size;
        let mut budget = self.config.max_num_batched_tokens;
        let mut prefill_tokens = 0;
        let mut decode_tokens = 0;
        // Tokens (prompt and output so far) of the sequences decoding in this step.
        let mut decode_kv_tokens = 0;
        let mut seqs = 0;
        let mut preempted = false;
        // A running sequence waits for copies to free G1 slots: the slots they free are its,
        // and a newcomer admitted meanwhile would take them.
        let mut waiting_for_copies = false;

        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let seq = &self.running[i];
            if !matches!(seq.state, SeqState::Running) {
                i += 1;
                continue;
            }
            let need = (seq.total() - seq.kv_len).min(budget);
            let held = seq.lease.as_ref().map_or(0, |l| l.len());
            let missing = (seq.kv_len + need).div_ceil(bs).saturating_sub(held);
            if missing > 0 {
                let growth = self.grow(now, i, missing, out);
                preempted |= growth.preempted;
                match growth.outcome {
                    Growth::Grown => {}
                    // `i` now names the sequence after it.
                    Growth::Preempted => continue,
                    Growth::Pending => {
                        waiting_for_copies = true;
                        i += 1;
                        continue;
                    }
                }
            }
            let seq = &mut self.running[i];
            seq.scheduled = need;
            if seq.generated > 0 && need == 1 && seq.kv_len + 1 == seq.total() {
                decode_tokens += 1;
                decode_kv_tokens += seq.total();
            } else {
                prefill_tokens += need;
            }
            budget -= need;
            seqs += 1;
            i += 1;
        }
        // Admission, first come first served; a request that does not fit blocks the ones
        // behind it (no starvation of long prompts). None in a step that preempted, or while
        // a running sequence waits for room.
        while !preempted
            && !waiting_for_copies
            && budget > 0
            && self.running.len() < self.config.max_num_seqs
        {
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            if seq.arrived_us > now {
                // Submitted by a caller that had not advanced to a step's start before (a
                // late engine thread): that step began before the request existed.
                self.waiting.push_front(seq);
                break;
            }
            let total = seq.total();
            // At least one token is computed (its logits give the next token): a prompt
            // cached whole reuses ⌊(len − 1) / bs⌋ blocks and recomputes the rest.
            let hashes = seq.hashes.len().min((total - 1) / bs);
            let keys: Vec<_> = seq.hashes[..hashes].iter().map(|h| h.seq).collect();
            // The whole prompt must fit in free blocks plus evictable ones, not counting its
            // own hits (acquired, they are no longer evictable). Checked before anything is
            // acquired, as vLLM touches a waiting request's hits only once it fits: a request
            // that waits for room neither refreshes its prefix every step nor pays for it.
            let (found, inactive_hits) = self.blocks.peek_prefix(&keys);
            let g1 = self.blocks.usage(Tier::Device);
            let whole = total.div_ceil(bs) - found.device;
            if whole > g1.free + g1.inactive - inactive_hits {
                self.waiting.push_front(seq);
                break;
            }
            let kv_len = found.device * bs;
            let need = (total - kv_len).min(budget);
            // Host hits are onboarded into blocks of their own; a computed chunk needs its.
            let first = if found.host > 0 {
                found.host
            } else {
                (kv_len + need).div_ceil(bs) - found.device
            };
            // Nothing else touches the pool in between (the engine owns its leases), so
            // this finds what the peek found. A request that does not get its blocks (copies
            // must finish first) leaves its prefix as it found it.
            let peeked = found;
            let Ok((mut lease, found)) = self.blocks.admit(now, &keys, first) else {
                self.waiting.push_front(seq);
                break;
            };
            debug_assert_eq!(found, peeked, "the prefix changed between peek and admit");
            if !seq.admitted {
                seq.admitted = true;
                let prompt = seq.prompt_len;
                let device_tokens = (found.device * bs).min(prompt);
                let host_tokens = ((found.device + found.host) * bs).min(prompt) - device_tokens;
                out.push(Output {
                    request: seq.id,
                    at_us: now,
                    kind: OutputKind::Admitted {
                        device_tokens,
                        host_tokens,
                    },
                });
            }
            seq.full_blocks = found.device;
            seq.kv_len = kv_len;
            if found.host > 0 {
                let ticket = self.blocks.start_onboard(now, &mut lease, found.device);
                seq.state = SeqState::Onboarding {
                    ticket,
                    ready_tokens: (found.device + found.host) * bs,
                };
                seq.lease = Some(lease);
                self.running.push(seq);
                continue;
            }
            seq.lease = Some(lease);
            seq.state = SeqState::Running;
            seq.scheduled = need;
            prefill_tokens += need;
            budget -= need;
            seqs += 1;
            self.running.push(seq);
        }
        if seqs == 0 {
            return;
        }
        let g1 = self.blocks.usage(Tier::Device);
        let decode_kv_fraction = decode_kv_tokens as f64 / (g1.capacity * bs) as f64;
        let duration_us = self.config.timing.step_us(
            prefill_tokens,
            decode_tokens,
            decode_kv_fraction,
            self.config.speedup,
        );
        if self.record_steps {
            let g2 = self.blocks.usage(Tier::Host);
            self.steps.push(StepStats {
                start_us: now,
                duration_us,
                seqs,
                prefill_tokens,
                decode_tokens,
                g1_used: g1.capacity - g1.free,
                g2_used: g2.capacity - g2.free,
                waiting: self.waiting.len(),
            });
        }
        self.step = Some(Step {
            end_us: now + duration_us,
        });
    }

    /// Gives running sequence `i` `missing` more G1 blocks, preempting the newest running
    /// sequences (possibly `i` itself) while G1 has too few.
    fn grow(&mut self, now: u64, i: usize, missing: usize, out: &mut Vec<Output>) -> Grew {
        let mut preempted = false;
        loop {
            let lease = self.running[i]
                .lease
                .as_mut()
                .expect("invariant: running sequences hold a lease");
            let outcome = match self.blocks.allocate(now, lease, missing) {
                Ok(()) => Growth::Grown,
                Err(AllocError::Pending) => Growth::Pending,
                Err(AllocError::Insufficient) => {
                    let running = self
                        .running
                        .iter()
                        .map(|s| matches!(s.state, SeqState::Running));
                    let victim = victim(running, i);
                    self.preempt(victim, now, out);
                    preempted = true;
                    if victim != i {
                        continue;
                    }
                    Growth::Preempted
                }
            };
            return Grew { outcome, preempted };
        }
    }

    fn preempt(&mut self, index: usize, now: u64, out: &mut Vec<Output>) {
        debug_assert!(
            !matches!(self.running[index].state, SeqState::Onboarding { .. }),
            "a sequence still onboarding is never preempted"
        );
        let mut seq = self.running.remove(index);
        seq.lease = None;
        seq.state = SeqState::Waiting;
        seq.kv_len = 0;
        seq.full_blocks = 0;
        seq.scheduled = 0;
        out.push(Output {
            request: seq.id,
            at_us: now,
            kind: OutputKind::Preempted,
        });
        self.waiting.push_front(seq);
    }

    /// Ends the step in flight at `now`: computed tokens get their KV, full blocks are
    /// registered, sequences that computed all their tokens emit one.
    fn finish_step(&mut self, now: u64, out: &mut Vec<Output>) {
        self.step = None;
        let bs = self.config.block_size;
        let vocab = self.config.vocab_size;
        let mut finished = Vec::new();
        for (index, seq) in self.running.iter_mut().enumerate() {
            if seq.scheduled == 0 {
                continue;
            }
            seq.kv_len += std::mem::take(&mut seq.scheduled);
            let (first, full) = (seq.full_blocks, seq.kv_len / bs);
            for k in seq.hashes.len()..full {
                // A block of generated tokens: hashed once it is full.
                let tokens: Vec<u32> = (k * bs..(k + 1) * bs)
                    .map(|p| seq.token_at(p, vocab))
                    .collect();
                let parent = seq.hashes.last().map(|h| h.seq);
                let local = local_hash(&tokens);
                seq.hashes.push(BlockHash {
                    local,
                    seq: seq_hash(parent, local, seq.salt),
                });
            }
            if first < full {
                let hashes = &seq.hashes;
                let lease = seq
                    .lease
                    .as_mut()
                    .expect("invariant: running sequences hold a lease");
                self.blocks.register(
                    lease,
                    first,
                    (first..full).map(|k| {
                        let parent = k.checked_sub(1).map(|p| hashes[p].seq);
                        let h = hashes[k];
                        (
                            parent,
                            StoredBlock {
                                seq: h.seq,
                                local: h.local,
                            },
                        )
                    }),
                );
                seq.full_blocks = full;
            }
            if seq.kv_len == seq.total() {
                let token = output_token(seq.id, seq.generated, vocab);
                out.push(Output {
                    request: seq.id,
                    at_us: now,
                    kind: OutputKind::Token {
                        index: seq.generated,
                        token,
                    },
                });
                seq.generated += 1;
                if seq.generated >= seq.max_tokens {
                    out.push(Output {
                        request: seq.id,
                        at_us: now,
                        kind: OutputKind::Finished,
                    });
                    finished.push(index);
                }
            }
        }
        for index in finished.into_iter().rev() {
            self.running.remove(index);
        }
        self.collect_changes(true);
    }
}

/// Which sequence sequence `i` preempts to grow: the newest running one after it, else
/// itself (vLLM v1 pops the newest of its running list). Sequences still onboarding their
/// prefix from G2 are passed over: in vLLM v1 a request whose KV is loading is not in the
/// running list, and preempting one would throw its copy away and redo it.
/// `running[k]`: whether sequence `k` is running (not onboarding).
fn victim(running: impl DoubleEndedIterator<Item = bool> + ExactSizeIterator, i: usize) -> usize {
    let len = running.len();
    running
        .rev()
        .take(len.saturating_sub(i + 1))
        .position(|r| r)
        .map_or(i, |from_end| len - 1 - from_end)
}

#[cfg(test)]
mod tests;
