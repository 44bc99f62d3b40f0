//! `kvroute-bench replay` (offline): a Mooncake trace through W worker engines and the
//! router's own indexer, scheduler and admission queue, in one process on a virtual clock.
//! KV events reach the indexer `--event-delay-ms` after the engine publishes them, so routing
//! races event arrival as it does over NATS. Deterministic for a seed.
//!
//! Requests carry a tenant and a priority band (the trace's `tenant`/`priority` fields, or
//! drawn from the seed with `--assign-classes`) and wait in the router's queue when
//! `--worker-budget-tokens` leaves no room, as in the live router. A trace with
//! `session_id`s is replayed closed-loop: each turn is sent `think_ms` after the previous
//! turn of its session finished, with its session id for affinity (`--no-sessions` drops the
//! ids, keeping the pacing). Every decision's receipt (cached against reachable blocks) is
//! summed as the live router's `kvroute_route_*` counters are.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use kvroute::indexer::{self, Indexer, OverlapScores};
use kvroute::protocol::{BlockHash, DpRank, EventBatch, Salt, SeqHash, WorkerId};
use kvroute::scheduler::queue::{AdmissionQueue, BandConfig, QueueConfig, Ticket};
use kvroute::scheduler::{
    self, Admission, BookingId, PolicyKind, RouteRequest, Scheduler, SessionRef, SessionStats,
};
use kvroute_worker::EngineConfig;
use kvroute_worker::block_manager::EvictionKind;
use kvroute_worker::engine::{
    MixedStep, Output, OutputKind, Prompt as EnginePrompt, Request, RequestId, TimingModel,
};
use rustc_hash::FxHashMap;
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::fleet::{Fleet, FleetSink};
pub use crate::report::{DecisionReport, LoadSpread};
use crate::stats::Summary;
use crate::trace::{self, TraceRecord};

/// The one model every replayed worker serves.
const REPLAY_MODEL: &str = "replay";

/// Flags of `kvroute-bench replay`.
#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// The trace.
    #[command(flatten)]
    pub source: trace::TraceArgs,
    /// Worker engines.
    #[arg(long, default_value_t = 8)]
    pub workers: usize,
    /// Policies to compare, run one after the other on the same engine config.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "kv,round_robin,random,least_loaded,approx_prefix"
    )]
    pub policy: Vec<String>,
    /// Divides arrival times (2 = twice the request rate).
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// Engine KV block size, tokens.
    #[arg(long, default_value_t = 64)]
    pub block_size: usize,
    /// G1 (GPU) blocks per worker.
    #[arg(long, default_value_t = 16_384)]
    pub g1_blocks: usize,
    /// G2 (host) blocks per worker; 0 disables offload.
    #[arg(long, default_value_t = 65_536)]
    pub g2_blocks: usize,
    /// Divides engine step times.
    #[arg(long, default_value_t = 1.0)]
    pub engine_speedup: f64,
    /// Engine eviction policy (lru, lineage_lru).
    #[arg(long, default_value = "lineage_lru")]
    pub eviction: String,
    /// Price of an engine step holding prefill and decode: `marginal` (one forward pass) or
    /// `additive` (prefill plus a whole decode step: Dynamo's mocker, for like-for-like).
    #[arg(long, default_value = "marginal")]
    pub mixed_step: String,
    /// Delay between an engine publishing events and the indexer applying them, ms.
    #[arg(long, default_value_t = 5.0)]
    pub event_delay_ms: f64,
    /// Keep the router's index for round_robin and random, which do not read it, for their
    /// decision figures (regret) in the JSON. By default they run without one, as a router
    /// running them would, unless the queue reads it: several classes of requests, or a
    /// work budget (`--worker-budget-tokens`).
    #[arg(long)]
    pub baseline_index: bool,
    /// Scheduler weight of uncached prefill (`scheduler.prefill_scale`).
    #[arg(long)]
    pub prefill_scale: Option<f64>,
    /// Scheduler weight of held decode blocks (`scheduler.decode_weight`).
    #[arg(long)]
    pub decode_weight: Option<f64>,
    /// Seed of the scheduler's tie-breaks.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the results here as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw TTFT CDFs and reuse per policy here (SVG).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Policies replayed at once, each on its own thread (0: one per core). Results do not
    /// depend on it.
    #[arg(long, default_value_t = 0)]
    pub jobs: usize,
    /// Booked work a worker may hold before requests queue in the router, tokens
    /// (`scheduler.admission.worker_budget_tokens`); 0: no budget, every request is routed at
    /// once (the replay tables above were measured so).
    #[arg(long, default_value_t = 0)]
    pub worker_budget_tokens: u64,
    /// Longest a request waits in the router's queue before it is refused (429), ms.
    #[arg(long, default_value_t = 60_000)]
    pub queue_ttl_ms: u64,
    /// Give requests tenants and bands drawn from the seed: `NAME:BAND:WEIGHT,…`
    /// (`premium:1:1,batch:0:3`: a quarter premium in band 1). A record's own `tenant` and
    /// `priority` win.
    #[arg(long)]
    pub assign_classes: Option<String>,
    /// Share of each worker's budget the lowest band may fill (the rest is headroom for
    /// higher bands; `scheduler.queue.bands.<b>.budget_share`).
    #[arg(long, default_value_t = 1.0)]
    pub low_band_share: f64,
    /// Replay only this tenant's requests (its solo figures).
    #[arg(long)]
    pub only_tenant: Option<String>,
    /// Treat every request as band 0 of one tenant (the router without classes).
    #[arg(long)]
    pub ignore_classes: bool,
    /// Drop session ids (turns are still paced closed-loop).
    #[arg(long)]
    pub no_sessions: bool,
    /// Weight of recently routed prompt blocks in the cost (`scheduler.recent_weight`).
    #[arg(long)]
    pub recent_weight: Option<f64>,
    /// Half-life of that weight, ms (`scheduler.recent_half_life_ms`).
    #[arg(long)]
    pub recent_half_life_ms: Option<u64>,
    /// New sessions' cost per live session above the least-held worker
    /// (`scheduler.sessions.spread_weight`).
    #[arg(long)]
    pub session_spread: Option<f64>,
}

/// One policy's results.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct PolicyResult {
    /// Policy name.
    pub policy: String,
    /// Requests replayed.
    pub requests: u64,
    /// Wall time of the replay, s.
    pub wall_s: f64,
    /// Virtual time from first arrival to last completion, s.
    pub virtual_s: f64,
    /// Time to first token, ms.
    pub ttft_ms: Summary,
    /// Inter-token latency, ms.
    pub itl_ms: Summary,
    /// Arrival to last token, ms.
    pub e2e_ms: Summary,
    /// Output tokens per virtual second.
    pub throughput_tok_s: f64,
    /// Prompt tokens served from cache (G1 or onboarded G2) / prompt tokens of the requests
    /// routed (a request that expired in the queue has no reuse to count).
    pub reuse_ratio: f64,
    /// Prompt tokens onboarded from G2 / prompt tokens of the requests routed.
    pub g2_reuse_ratio: f64,
    /// Requests routed to each worker, against their mean.
    pub worker_load_spread: LoadSpread,
    /// Reuse the same assignment of requests to workers would get from infinite caches
    /// filled at once: what routing alone decided (the rest is timing and eviction); over
    /// the requests routed.
    pub assignment_reuse_ratio: f64,
    /// Requests the engines refused.
    pub rejected: u64,
    /// Requests the router's queue refused (deadline passed).
    pub queue_expired: u64,
    /// Time requests waited in the router's queue, ms.
    pub queue_wait_ms: Summary,
    /// Decision quality, summed as `kvroute_route_*` (cached vs reachable blocks); `None`
    /// for a policy run without the router's index (`--baseline-index` keeps one).
    pub decisions: Option<DecisionReport>,
    /// Session affinity.
    pub sessions: SessionStats,
    /// Per tenant, when the trace has more than one.
    pub tenants: Vec<TenantResult>,
    /// Every TTFT, ms, sorted (for the plot; not in the JSON).
    #[serde(skip)]
    pub ttft_sorted_ms: Vec<f64>,
}

/// One tenant's figures.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct TenantResult {
    /// The tenant.
    pub tenant: String,
    /// Its band.
    pub band: i32,
    /// Requests it sent.
    pub requests: u64,
    /// Its time to first token (queue wait included), ms.
    pub ttft_ms: Summary,
}

/// The JSON `kvroute-bench replay` writes.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Report {
    /// SHA-256 of the trace file.
    pub trace_sha256: String,
    /// The format it was read as.
    pub trace_format: String,
    /// What the replay synthesised for it, if anything (e.g. the Azure trace's prefixes).
    pub trace_note: String,
    /// Reuse ratio of one infinite cache over the replayed requests (all of them: a policy
    /// whose requests expired in the queue is measured over those it routed, and may pass
    /// it).
    pub bound_reuse_ratio: f64,
    /// Workers.
    pub workers: usize,
    /// Arrival speedup.
    pub speedup: f64,
    /// Engine block size.
    pub block_size: usize,
    /// G1 blocks per worker.
    pub g1_blocks: usize,
    /// G2 blocks per worker.
    pub g2_blocks: usize,
    /// Seed.
    pub seed: u64,
    /// One entry per policy, in the order asked for.
    pub policies: Vec<PolicyResult>,
    /// Wall time of the whole run (loading included), s.
    pub wall_s: f64,
    /// Wall time of loading: reading the trace, synthesising and hashing its prompts and
    /// the one-cache bound, before the first policy starts, s.
    pub load_s: f64,
    /// CPU time of the whole process so far, user plus system, s.
    pub cpu_s: f64,
}

struct Prompt {
    arrival_us: u64,
    /// Its length, tokens.
    len: usize,
    /// Its full blocks' hashes: the router's, and the engines' (sent hashed).
    blocks: Arc<[BlockHash]>,
    /// The tokens after its last full block.
    tail: Arc<[u32]>,
    /// Its blocks' numbers among the replay's distinct blocks ([`Numbering`]).
    block_numbers: Box<[u32]>,
    output: u32,
    tenant: Arc<str>,
    band: i32,
    /// Its session, if the trace names one.
    session: Option<Arc<str>>,
    /// The next turn of its session (sent `think_us` after this one finishes).
    next_turn: Option<usize>,
    /// Whether an earlier turn sends it (else it arrives at `arrival_us`).
    follows: bool,
    think_us: u64,
}

impl Prompt {
    /// What the scheduler is told of it, with every worker's cached prefix `overlaps`.
    fn request<'a>(&'a self, overlaps: &'a OverlapScores, block_size: usize) -> RouteRequest<'a> {
        RouteRequest {
            model: REPLAY_MODEL,
            blocks: &self.blocks,
            prompt_tokens: self.len,
            block_size,
            overlaps,
            max_tokens: self.output,
            n: 1,
            session: self
                .session
                .as_deref()
                .map(|id| SessionRef { id, hard: false }),
        }
    }
}

#[derive(Default, Clone, Copy)]
struct Tracked {
    booking: Option<BookingId>,
    arrival_us: u64,
    last_token_us: Option<u64>,
    admitted: bool,
}

/// The router side of the replay, fed by the fleet.
struct Router {
    /// `None` for a policy that does not read it (the engines' events are dropped).
    indexer: Option<Indexer>,
    scheduler: Scheduler,
    delay_us: u64,
    pending: VecDeque<(u64, EventBatch)>,
    tracked: Vec<Tracked>,
    ttft: Vec<f64>,
    itl: Vec<f64>,
    e2e: Vec<f64>,
    output_tokens: u64,
    reused_tokens: u64,
    host_tokens: u64,
    rejected: u64,
    last_finish_us: u64,
    /// Next turns of sessions, by arrival.
    arrivals: BinaryHeap<Reverse<(u64, usize)>>,
    /// Each request's next turn and think time.
    next_turn: Vec<Option<(usize, u64)>>,
    /// TTFT per request, ms (for per-tenant figures).
    ttft_of: Vec<f64>,
}

impl FleetSink for Router {
    fn outputs(&mut self, _: usize, outputs: &[Output]) {
        for o in outputs {
            let t = &mut self.tracked[o.request.0 as usize];
            match o.kind {
                OutputKind::Admitted {
                    device_tokens,
                    host_tokens,
                } if !t.admitted => {
                    t.admitted = true;
                    self.reused_tokens += (device_tokens + host_tokens) as u64;
                    self.host_tokens += host_tokens as u64;
                }
                OutputKind::Token { index, .. } => {
                    self.output_tokens += 1;
                    if index == 0 {
                        let ttft = (o.at_us - t.arrival_us) as f64 / 1e3;
                        self.ttft.push(ttft);
                        self.ttft_of[o.request.0 as usize] = ttft;
                        if let Some(b) = t.booking {
                            self.scheduler.first_token(b);
                        }
                    } else if let Some(prev) = t.last_token_us {
                        self.itl.push((o.at_us - prev) as f64 / 1e3);
                    }
                    t.last_token_us = Some(o.at_us);
                }
                OutputKind::Finished => {
                    self.e2e.push((o.at_us - t.arrival_us) as f64 / 1e3);
                    self.last_finish_us = self.last_finish_us.max(o.at_us);
                    if let Some(b) = t.booking.take() {
                        self.scheduler.complete(b);
                    }
                    self.send_next_turn(o.request.0 as usize, o.at_us);
                }
                OutputKind::Rejected(_) => {
                    self.rejected += 1;
                    if let Some(b) = t.booking.take() {
                        self.scheduler.complete(b);
                    }
                    self.send_next_turn(o.request.0 as usize, o.at_us);
                }
                _ => {}
            }
        }
    }

    fn batches(&mut self, _: usize, at_us: u64, batches: Vec<EventBatch>) {
        if self.indexer.is_none() {
            return;
        }
        for b in batches {
            self.pending.push_back((at_us + self.delay_us, b));
        }
    }
}

impl Router {
    /// Request `i` ended at `at_us`: its session's next turn comes after the think time.
    fn send_next_turn(&mut self, i: usize, at_us: u64) {
        if let Some((next, think_us)) = self.next_turn[i].take() {
            self.arrivals.push(Reverse((at_us + think_us, next)));
        }
    }

    fn deliver_events(&mut self, now_us: u64) {
        let Some(indexer) = &self.indexer else {
            return;
        };
        while self.pending.front().is_some_and(|(at, _)| *at <= now_us) {
            let (_, batch) = self.pending.pop_front().expect("invariant: peeked");
            indexer.apply(&batch);
        }
    }

    /// Each worker's cached prefix of `seqs`, as the router's index has it (none without
    /// one).
    fn overlaps(&self, seqs: &[SeqHash]) -> OverlapScores {
        self.indexer
            .as_ref()
            .map_or_else(OverlapScores::default, |i| i.find_matches_seq(seqs))
    }
}

/// Engine configuration from the flags.
pub fn engine_config(args: &Args) -> anyhow::Result<EngineConfig> {
    let eviction = match args.eviction.as_str() {
        "lru" => EvictionKind::Lru,
        "lineage_lru" => EvictionKind::LineageLru,
        other => bail!("unknown --eviction {other:?} (lru, lineage_lru)"),
    };
    let mixed_step = MixedStep::parse(&args.mixed_step).with_context(|| {
        format!(
            "--mixed-step {:?}: expected marginal or additive",
            args.mixed_step
        )
    })?;
    let config = EngineConfig {
        block_size: args.block_size,
        g1_blocks: args.g1_blocks,
        g2_blocks: args.g2_blocks,
        speedup: args.engine_speedup,
        eviction,
        timing: TimingModel {
            mixed_step,
            ..TimingModel::default()
        },
        ..EngineConfig::default()
    };
    config.validate()?;
    Ok(config)
}

/// Runs every requested policy and reports.
pub fn run(args: &Args) -> anyhow::Result<Report> {
    let started = Instant::now();
    let policies = args
        .policy
        .iter()
        .map(|p| PolicyKind::parse(p.trim()).with_context(|| format!("unknown policy {p:?}")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    if args.speedup.is_nan() || args.speedup <= 0.0 {
        bail!("--speedup must be positive");
    }
    let config = engine_config(args)?;
    let path = trace::locate(&args.source.trace);
    let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    let trace_sha256 = Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let loaded = trace::load_any(&args.source, args.seed)?;
    let records = loaded.records;
    let block_size = NonZeroUsize::new(args.block_size).context("--block-size must be positive")?;
    let prompts = prompts(&records, args, block_size)?;
    if prompts.is_empty() {
        bail!("no request to replay (--only-tenant matches none?)");
    }
    let bound_reuse_ratio = infinite_cache_reuse(&prompts, args.block_size, |_| Some(0));
    let mut report = Report {
        trace_sha256,
        trace_format: format!("{:?}", loaded.format).to_lowercase(),
        trace_note: loaded.note,
        bound_reuse_ratio,
        workers: args.workers,
        speedup: args.speedup,
        block_size: args.block_size,
        g1_blocks: args.g1_blocks,
        g2_blocks: args.g2_blocks,
        seed: args.seed,
        policies: Vec::new(),
        wall_s: 0.0,
        load_s: started.elapsed().as_secs_f64(),
        cpu_s: 0.0,
    };
    report.policies = run_policies(&policies, &prompts, &config, args)?;
    report.wall_s = started.elapsed().as_secs_f64();
    report.cpu_s = crate::stats::cpu_seconds();
    Ok(report)
}

/// Replays each policy on its own fleet, `--jobs` at a time (they share nothing but the
/// prompts), and returns their results in the order asked for.
fn run_policies(
    policies: &[PolicyKind],
    prompts: &[Prompt],
    config: &EngineConfig,
    args: &Args,
) -> anyhow::Result<Vec<PolicyResult>> {
    let jobs = jobs(args).min(policies.len().max(1));
    let bars = (!args.quiet).then(indicatif::MultiProgress::new);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<parking_lot::Mutex<Option<anyhow::Result<PolicyResult>>>> = policies
        .iter()
        .map(|_| parking_lot::Mutex::new(None))
        .collect();
    std::thread::scope(|scope| {
        for _ in 0..jobs {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(&policy) = policies.get(i) else {
                        return;
                    };
                    let result = run_policy(policy, prompts, config, args, bars.as_ref());
                    *results[i].lock() = Some(result);
                }
            });
        }
    });
    results
        .into_iter()
        .map(|r| r.into_inner().expect("invariant: every policy was run"))
        .collect()
}

fn prompt(
    record: &TraceRecord,
    args: &Args,
    block_size: NonZeroUsize,
    memo: Option<&mut trace::LocalMemo>,
) -> Prompt {
    let hashed = trace::hashed_prompt(record, args.source.trace_block_size, block_size, memo);
    let scale = |ms: u64| (ms as f64 * 1000.0 / args.speedup).round() as u64;
    Prompt {
        arrival_us: scale(record.timestamp),
        len: hashed.len,
        blocks: hashed.blocks.into(),
        tail: hashed.tail,
        block_numbers: Box::default(),
        output: record.output_length.max(1) as u32,
        tenant: Arc::from(record.tenant.as_deref().unwrap_or("default")),
        band: record.priority.unwrap_or(0),
        session: record.session_id.as_deref().map(Arc::from),
        next_turn: None,
        follows: false,
        think_us: scale(record.think_ms.unwrap_or(0)),
    }
}

/// Threads to use: `--jobs`, or one per core if 0.
fn jobs(args: &Args) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if args.jobs == 0 { cores } else { args.jobs }.max(1)
}

/// Every record's prompt, in order. Synthesising tokens and hashing them is most of the
/// loading time, so the records are cut into one chunk per core (`--jobs`), synthesised on
/// their own threads, each hashing a trace block's tokens once (its [`trace::LocalMemo`]);
/// the result does not depend on the split. No prompt's tokens are kept: the engines are
/// sent the hashes (the conversation trace's prompts are 145 M tokens, 580 MB).
fn synthesise(records: &[TraceRecord], args: &Args, block_size: NonZeroUsize) -> Vec<Prompt> {
    let chunk = records.len().div_ceil(jobs(args)).max(1);
    std::thread::scope(|scope| {
        let parts: Vec<_> = records
            .chunks(chunk)
            .map(|part| {
                scope.spawn(move || {
                    let mut memo = trace::LocalMemo::new(args.source.trace_block_size, block_size);
                    part.iter()
                        .map(|r| prompt(r, args, block_size, memo.as_mut()))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        parts
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    })
}

/// A class `--assign-classes` draws from.
#[derive(Clone, Debug, PartialEq)]
struct ClassSpec {
    tenant: Arc<str>,
    band: i32,
    weight: f64,
}

fn parse_classes(spec: &str) -> anyhow::Result<Vec<ClassSpec>> {
    let classes = spec
        .split(',')
        .map(|c| {
            let parts: Vec<&str> = c.split(':').collect();
            let parsed = match parts[..] {
                [name, band, weight] if !name.is_empty() => band
                    .parse()
                    .ok()
                    .zip(
                        weight
                            .parse::<f64>()
                            .ok()
                            .filter(|w| *w > 0.0 && w.is_finite()),
                    )
                    .map(|(band, weight)| ClassSpec {
                        tenant: Arc::from(name),
                        band,
                        weight,
                    }),
                _ => None,
            };
            parsed.with_context(|| format!("--assign-classes: {c:?} is not NAME:BAND:WEIGHT"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    if classes.is_empty() {
        bail!("--assign-classes names no class");
    }
    Ok(classes)
}

/// The trace's requests as the replay sends them: classes drawn or read, one tenant kept if
/// asked, and each session's turns linked in trace order.
fn prompts(
    records: &[TraceRecord],
    args: &Args,
    block_size: NonZeroUsize,
) -> anyhow::Result<Vec<Prompt>> {
    let classes = args
        .assign_classes
        .as_deref()
        .map(parse_classes)
        .transpose()?;
    let mut rng = scheduler::Rng::new(args.seed ^ 0x0c1a_55e5);
    let mut prompts = Vec::with_capacity(records.len());
    let mut numbering = Numbering::new(records, args, block_size);
    for (r, mut p) in records.iter().zip(synthesise(records, args, block_size)) {
        numbering.number(r, &mut p)?;
        if let Some(classes) = &classes {
            // Drawn for every record, so a tenant's requests are the same in every run.
            let total: f64 = classes.iter().map(|c| c.weight).sum();
            let mut x = rng.unit() * total;
            let class = classes
                .iter()
                .find(|c| {
                    x -= c.weight;
                    x < 0.0
                })
                .unwrap_or(&classes[classes.len() - 1]);
            if r.tenant.is_none() {
                p.tenant = Arc::clone(&class.tenant);
            }
            if r.priority.is_none() {
                p.band = class.band;
            }
        }
        if args.only_tenant.as_deref().is_none_or(|t| *t == *p.tenant) {
            prompts.push(p);
        }
    }
    let mut last_turn: FxHashMap<Arc<str>, usize> = FxHashMap::default();
    for i in 0..prompts.len() {
        if let Some(session) = prompts[i].session.clone()
            && let Some(prev) = last_turn.insert(session, i)
        {
            prompts[prev].next_turn = Some(i);
            prompts[i].follows = true;
        }
    }
    if args.no_sessions {
        prompts.iter_mut().for_each(|p| p.session = None);
    }
    Ok(prompts)
}

/// Prompt tokens served from cache / prompt tokens, if request `i` went to cache
/// `assign(i)` (`None`: it went nowhere, and counts for nothing) and every cache were
/// infinite and filled at once: the bound routing is judged against (one cache), or what a
/// routing would reuse with no eviction. A cache is a bitset over the prompts' block
/// numbers ([`Numbering`]).
fn infinite_cache_reuse(
    prompts: &[Prompt],
    block_size: usize,
    assign: impl Fn(usize) -> Option<usize>,
) -> f64 {
    let mut caches: FxHashMap<usize, Vec<u64>> = FxHashMap::default();
    let (mut hit, mut total) = (0u64, 0u64);
    for (i, p) in prompts.iter().enumerate() {
        // Not routed (expired in the queue): it filled no cache (counted on worker 0, it
        // filled that one's).
        let Some(worker) = assign(i) else {
            continue;
        };
        let cache = caches.entry(worker).or_default();
        let holds = |cache: &[u64], n: u32| {
            cache
                .get(n as usize / 64)
                .is_some_and(|w| w >> (n % 64) & 1 == 1)
        };
        let matched = p
            .block_numbers
            .iter()
            .take_while(|&&n| holds(cache, n))
            .count();
        hit += ((matched * block_size).min(p.len)) as u64;
        total += p.len as u64;
        for &n in &p.block_numbers[matched..] {
            let word = n as usize / 64;
            if word >= cache.len() {
                cache.resize(word + 1, 0);
            }
            cache[word] |= 1 << (n % 64);
        }
    }
    hit as f64 / total.max(1) as f64
}

/// Numbers the replay's distinct blocks, so that sets of blocks can be bitsets.
enum Numbering {
    /// Where every engine block lies inside one trace block and no record has tokens of its
    /// own, a block is named by its prompt's hash ids up to its trace block and its offset in
    /// it: the trie of id paths is numbered (a lookup per trace block, not per engine block),
    /// and block `k` is `node(k / per_id) × per_id + k mod per_id`.
    IdPaths {
        per_id: usize,
        nodes: FxHashMap<(u32, u64), u32>,
    },
    /// Otherwise by hash, in order of first use.
    Hashes(FxHashMap<SeqHash, u32>),
}

impl Numbering {
    fn new(records: &[TraceRecord], args: &Args, block_size: NonZeroUsize) -> Numbering {
        let trace_bs = args.source.trace_block_size;
        if trace::LocalMemo::new(trace_bs, block_size).is_some()
            && records.iter().all(|r| r.tokens.is_none())
        {
            Numbering::IdPaths {
                per_id: trace_bs / block_size.get(),
                nodes: FxHashMap::default(),
            }
        } else {
            Numbering::Hashes(FxHashMap::default())
        }
    }

    /// Numbers `prompt`'s blocks, `record` being the record it was made from.
    fn number(&mut self, record: &TraceRecord, prompt: &mut Prompt) -> anyhow::Result<()> {
        let too_many = || anyhow::anyhow!("more than 2^32 distinct blocks");
        prompt.block_numbers = match self {
            Numbering::IdPaths { per_id, nodes } => {
                let mut numbers = Vec::with_capacity(prompt.blocks.len());
                let mut node = u32::MAX;
                for (i, &id) in record.hash_ids.iter().enumerate() {
                    let first = i * *per_id;
                    if first >= prompt.blocks.len() {
                        break;
                    }
                    let next = u32::try_from(nodes.len()).map_err(|_| too_many())?;
                    node = *nodes.entry((node, id)).or_insert(next);
                    for k in first..(first + *per_id).min(prompt.blocks.len()) {
                        let n = node as usize * *per_id + k - first;
                        numbers.push(u32::try_from(n).map_err(|_| too_many())?);
                    }
                }
                numbers.into()
            }
            Numbering::Hashes(numbers) => prompt
                .blocks
                .iter()
                .map(|b| {
                    let next = u32::try_from(numbers.len()).map_err(|_| too_many())?;
                    Ok(*numbers.entry(b.seq).or_insert(next))
                })
                .collect::<anyhow::Result<_>>()?,
        };
        Ok(())
    }
}

fn run_policy(
    policy: PolicyKind,
    prompts: &[Prompt],
    config: &EngineConfig,
    args: &Args,
    bars: Option<&indicatif::MultiProgress>,
) -> anyhow::Result<PolicyResult> {
    let started = Instant::now();
    let mut fleet = Fleet::new(config, args.workers)?;
    let defaults = scheduler::Config::default();
    let mut scheduler = Scheduler::new(scheduler::Config {
        policy,
        seed: args.seed,
        prefill_scale: args.prefill_scale.unwrap_or(defaults.prefill_scale),
        decode_weight: args.decode_weight.unwrap_or(defaults.decode_weight),
        recent_weight: args.recent_weight.unwrap_or(defaults.recent_weight),
        recent_half_life_ms: args
            .recent_half_life_ms
            .unwrap_or(defaults.recent_half_life_ms),
        sessions: scheduler::SessionConfig {
            spread_weight: args
                .session_spread
                .unwrap_or(defaults.sessions.spread_weight),
            ..defaults.sessions
        },
        admission: scheduler::AdmissionConfig {
            worker_budget_tokens: args.worker_budget_tokens,
            ..defaults.admission
        },
        ..defaults.clone()
    })?;
    for w in 0..args.workers {
        scheduler.add_worker(
            (WorkerId(w as u64), DpRank(0)),
            config.g1_blocks,
            REPLAY_MODEL,
        );
    }
    let mut queue: AdmissionQueue<usize> = AdmissionQueue::new(QueueConfig {
        default_band: BandConfig {
            max_queued: usize::MAX,
            ttl_ms: args.queue_ttl_ms.max(1),
            budget_share: 1.0,
        },
        lowest_band: i32::MIN,
        highest_band: i32::MAX,
        ..QueueConfig::default()
    });
    // Only a router whose policy or queue reads the index keeps one: the round robin a
    // platform team would otherwise run keeps none (nor does Dynamo's replay for it).
    // least_loaded and approx_prefix weigh the prefill a cached prefix saves, and the
    // queue orders several classes by their work (cached prefixes off), so those keep it.
    let one_class = args.ignore_classes
        || prompts
            .windows(2)
            .all(|w| w[0].tenant == w[1].tenant && w[0].band == w[1].band);
    let reads_index = !matches!(policy, PolicyKind::RoundRobin | PolicyKind::Random)
        || !one_class
        || args.worker_budget_tokens > 0;
    let keeps_index = reads_index || args.baseline_index;
    let mut router = Router {
        indexer: keeps_index
            .then(|| Indexer::new(indexer::Config::default()))
            .transpose()?,
        scheduler,
        delay_us: (args.event_delay_ms * 1000.0).round() as u64,
        pending: VecDeque::new(),
        tracked: vec![Tracked::default(); prompts.len()],
        ttft: Vec::with_capacity(prompts.len()),
        // One gap per generated token after the first: sized up front, since growing a
        // vector of millions of samples by doubling copies and faults it in several times.
        itl: Vec::with_capacity(
            prompts
                .iter()
                .map(|p| p.output.saturating_sub(1) as usize)
                .sum(),
        ),
        e2e: Vec::with_capacity(prompts.len()),
        output_tokens: 0,
        reused_tokens: 0,
        host_tokens: 0,
        rejected: 0,
        last_finish_us: 0,
        arrivals: prompts
            .iter()
            .enumerate()
            .filter(|(_, p)| !p.follows)
            .map(|(i, p)| Reverse((p.arrival_us, i)))
            .collect(),
        next_turn: prompts
            .iter()
            .map(|p| p.next_turn.map(|n| (n, prompts[n].think_us)))
            .collect(),
        ttft_of: vec![f64::NAN; prompts.len()],
    };
    let bar = bars.map(|bars| progress(bars, prompts.len() as u64, policy.name()));
    let mut per_worker = vec![0u64; args.workers];
    // The worker each request was routed to; `None` for one that expired in the queue.
    let mut assignment: Vec<Option<usize>> = vec![None; prompts.len()];
    let mut waits: Vec<f64> = Vec::new();
    let mut expired = 0u64;
    let mut seqs: Vec<SeqHash> = Vec::new();
    // Turns sent as earlier ones finish: step the engines one wake-up at a time, so that a
    // next turn is sent when it is due; the same while requests wait for room.
    let closed_loop = prompts.iter().any(|p| p.follows);
    let lowest_band = if args.ignore_classes {
        i32::MIN
    } else {
        prompts.iter().map(|p| p.band).min().unwrap_or(0)
    };
    loop {
        let next_arrival = router.arrivals.peek().map(|Reverse((at, _))| *at);
        let next_deadline = queue.next_deadline_ms().map(|ms| ms * 1000);
        let next_wakeup = if closed_loop || !queue.is_empty() {
            fleet.next_wakeup_us()
        } else {
            None
        };
        let Some(now_us) = [next_arrival, next_deadline, next_wakeup]
            .into_iter()
            .flatten()
            .min()
        else {
            break;
        };
        fleet.run_until(now_us, &mut router)?;
        router.deliver_events(now_us);
        let now_ms = now_us / 1000;
        while let Some(&Reverse((at, i))) = router.arrivals.peek() {
            if at > now_us {
                break;
            }
            router.arrivals.pop();
            router.tracked[i].arrival_us = at;
            let p = &prompts[i];
            seqs.clear();
            seqs.extend(p.blocks.iter().map(|b| b.seq));
            let overlaps = router.overlaps(&seqs);
            let work = router
                .scheduler
                .queue_work(&p.request(&overlaps, args.block_size));
            let (tenant, band) = if args.ignore_classes {
                (Arc::from("default"), 0)
            } else {
                (Arc::clone(&p.tenant), p.band)
            };
            let ticket = Ticket {
                band,
                tenant,
                work_tokens: work,
            };
            queue
                .push(now_ms, ticket, i)
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        for left in queue.expire(now_ms) {
            expired += 1;
            router.send_next_turn(left.payload, now_us);
        }
        // Admit in the queue's order while a worker has room.
        while let Some((id, ticket, &i)) = queue.peek() {
            let share = if ticket.band <= lowest_band {
                args.low_band_share
            } else {
                1.0
            };
            let p = &prompts[i];
            seqs.clear();
            seqs.extend(p.blocks.iter().map(|b| b.seq));
            let overlaps = router.overlaps(&seqs);
            let request = RouteRequest {
                model: REPLAY_MODEL,
                blocks: &p.blocks,
                prompt_tokens: p.len,
                block_size: args.block_size,
                overlaps: &overlaps,
                max_tokens: p.output,
                n: 1,
                session: p
                    .session
                    .as_deref()
                    .map(|id| SessionRef { id, hard: false }),
            };
            let decision = match router.scheduler.admit_within(now_ms, &request, share) {
                Admission::Wait | Admission::FleetFull => break,
                Admission::NoWorkers => bail!("no worker to route to"),
                Admission::Routed(d) => d,
            };
            let left = queue
                .admit(now_ms, id)
                .expect("invariant: the peeked ticket is next");
            waits.push(now_us.saturating_sub(router.tracked[i].arrival_us) as f64 / 1e3);
            let worker = decision.chosen.key.0.0 as usize;
            per_worker[worker] += 1;
            assignment[left.payload] = Some(worker);
            router.tracked[i].booking = Some(decision.booking);
            let request = Request {
                id: RequestId(i as u64),
                prompt: EnginePrompt::Hashed {
                    blocks: Arc::clone(&p.blocks),
                    tail: Arc::clone(&p.tail),
                },
                max_tokens: p.output,
                salt: Salt::NONE,
            };
            fleet.submit(worker, now_us, request, &mut router)?;
            if let Some(bar) = &bar {
                bar.inc(1);
            }
        }
    }
    fleet.run_until(u64::MAX, &mut router)?;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    // Of the requests routed: those that expired in the queue counted as unreused prompts
    // (about 11 % too low a reuse in a run where 1,297 expired).
    let prompt_tokens: u64 = prompts
        .iter()
        .zip(&assignment)
        .filter(|(_, routed)| routed.is_some())
        .map(|(p, _)| p.len as u64)
        .sum();
    let first_arrival = prompts.iter().map(|p| p.arrival_us).min().unwrap_or(0);
    let virtual_s = router.last_finish_us.saturating_sub(first_arrival) as f64 / 1e6;
    let ttft_ms = Summary::of(&mut router.ttft);
    let mut by_tenant: BTreeMap<(Arc<str>, i32), Vec<f64>> = BTreeMap::new();
    for (p, ttft) in prompts.iter().zip(&router.ttft_of) {
        let v = by_tenant
            .entry((Arc::clone(&p.tenant), p.band))
            .or_default();
        if !ttft.is_nan() {
            v.push(*ttft);
        }
    }
    let tenants = if by_tenant.len() > 1 {
        by_tenant
            .into_iter()
            .map(|((tenant, band), mut v)| TenantResult {
                tenant: tenant.to_string(),
                band,
                requests: prompts
                    .iter()
                    .filter(|p| p.tenant == tenant && p.band == band)
                    .count() as u64,
                ttft_ms: Summary::of(&mut v),
            })
            .collect()
    } else {
        Vec::new()
    };
    Ok(PolicyResult {
        policy: policy.name().to_owned(),
        requests: prompts.len() as u64,
        wall_s: started.elapsed().as_secs_f64(),
        virtual_s,
        ttft_ms,
        itl_ms: Summary::of_unsorted(&mut router.itl),
        e2e_ms: Summary::of(&mut router.e2e),
        throughput_tok_s: router.output_tokens as f64 / virtual_s.max(1e-9),
        reuse_ratio: router.reused_tokens as f64 / prompt_tokens.max(1) as f64,
        g2_reuse_ratio: router.host_tokens as f64 / prompt_tokens.max(1) as f64,
        // Against the mean of what was routed: over every request, a run whose requests
        // expired read a most-loaded worker below the mean (0.97).
        worker_load_spread: LoadSpread::of(per_worker),
        assignment_reuse_ratio: infinite_cache_reuse(prompts, args.block_size, |i| assignment[i]),
        rejected: router.rejected,
        queue_expired: expired,
        queue_wait_ms: Summary::of(&mut waits),
        decisions: router
            .indexer
            .is_some()
            .then(|| router.scheduler.decision_stats().into()),
        sessions: router.scheduler.session_stats(),
        tenants,
        ttft_sorted_ms: router.ttft,
    })
}

fn progress(bars: &indicatif::MultiProgress, len: u64, policy: &str) -> indicatif::ProgressBar {
    let bar = bars.add(indicatif::ProgressBar::new(len));
    bar.set_message(policy.to_owned());
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("{msg:>22} [{bar:40}] {pos}/{len} {elapsed}")
    {
        bar.set_style(style);
    }
    bar
}

/// Prints the report as a table.
pub fn print(report: &Report) {
    println!(
        "replay: {} workers, speedup {}, block {} tokens, G1 {} / G2 {} blocks per worker; bound reuse {:.3}",
        report.workers,
        report.speedup,
        report.block_size,
        report.g1_blocks,
        report.g2_blocks,
        report.bound_reuse_ratio
    );
    if !report.trace_note.is_empty() {
        println!("{}", report.trace_note);
    }
    println!(
        "| policy | TTFT p50 ms | TTFT p99 ms | TTFT mean ms | ITL p50 ms | E2E p50 ms | tok/s | reuse | G2 reuse | routing-only reuse | min/mean req | wall s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for p in &report.policies {
        println!(
            "| {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} | {:.0} | {:.3} | {:.3} | {:.3} | {:.2} | {:.1} |",
            p.policy,
            p.ttft_ms.p50,
            p.ttft_ms.p99,
            p.ttft_ms.mean,
            p.itl_ms.p50,
            p.e2e_ms.p50,
            p.throughput_tok_s,
            p.reuse_ratio,
            p.g2_reuse_ratio,
            p.assignment_reuse_ratio,
            p.worker_load_spread.min_over_mean,
            p.wall_s
        );
    }
    println!(
        "whole run: {:.2} s wall ({:.2} s loading), {:.2} s CPU",
        report.wall_s, report.load_s, report.cpu_s
    );
}

#[cfg(test)]
mod dynamo_model;

#[cfg(test)]
mod tests {
    use super::*;

    /// A synthetic trace of `n` requests in conversations of up to 4 turns, each turn
    /// extending the previous one's prompt, `gap_ms` apart.
    fn synthetic_trace(n: u64, gap_ms: u64) -> PathBuf {
        let mut lines = String::new();
        let mut conversations: Vec<Vec<u64>> = vec![vec![0]; 6];
        for i in 0..n {
            let c = (i * 7 + i / 3) as usize % 6;
            let ids = &mut conversations[c];
            // Ids are unique per turn; id 0 is the prompt every conversation shares.
            ids.push(i + 1);
            let input = ids.len() * 512 - 100;
            lines.push_str(&format!(
                "{{\"timestamp\": {}, \"input_length\": {input}, \"output_length\": {}, \"hash_ids\": {:?}}}\n",
                i * gap_ms,
                5 + i % 7,
                ids
            ));
            if ids.len() > 4 {
                ids.truncate(1);
            }
        }
        let path = std::env::temp_dir().join(format!(
            "kvroute-replay-{}-{n}-{gap_ms}.jsonl",
            std::process::id()
        ));
        std::fs::write(&path, lines).unwrap();
        path
    }

    pub(super) fn args(trace: PathBuf, policy: &str) -> Args {
        Args {
            source: trace::TraceArgs {
                trace,
                trace_format: trace::TraceFormat::Auto,
                requests: None,
                trace_block_size: 512,
                synthetic_prefixes: 16,
                synthetic_prefix_blocks: 1,
                tokenizer: None,
            },
            workers: 4,
            policy: vec![policy.to_owned()],
            speedup: 1.0,
            block_size: 64,
            g1_blocks: 100_000,
            g2_blocks: 0,
            engine_speedup: 1.0,
            eviction: "lineage_lru".into(),
            mixed_step: "marginal".into(),
            event_delay_ms: 5.0,
            prefill_scale: None,
            decode_weight: None,
            seed: 7,
            json: None,
            plot: None,
            quiet: true,
            jobs: 0,
            worker_budget_tokens: 0,
            queue_ttl_ms: 60_000,
            low_band_share: 1.0,
            assign_classes: None,
            only_tenant: None,
            ignore_classes: false,
            no_sessions: false,
            recent_weight: None,
            recent_half_life_ms: None,
            session_spread: None,
            baseline_index: false,
        }
    }

    /// Numbering by id paths names blocks exactly as their hashes do: equal numbers for
    /// equal hashes and only for them (the first 300 records of the conversation trace, with
    /// tails cut inside trace blocks).
    #[test]
    fn id_path_numbers_name_blocks_as_their_hashes_do() {
        let trace = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("traces/conversation_trace.jsonl");
        let mut a = args(trace, "kv");
        a.source.requests = Some(300);
        let records = trace::load_any(&a.source, 0).unwrap().records;
        let bs = NonZeroUsize::new(64).unwrap();
        let mut prompts = prompts(&records, &a, bs).unwrap();
        assert!(matches!(
            Numbering::new(&records, &a, bs),
            Numbering::IdPaths { .. }
        ));
        let mut by_number: FxHashMap<u32, SeqHash> = FxHashMap::default();
        let mut by_hash: FxHashMap<SeqHash, u32> = FxHashMap::default();
        for p in &prompts {
            for (n, b) in p.block_numbers.iter().zip(p.blocks.iter()) {
                assert_eq!(*by_number.entry(*n).or_insert(b.seq), b.seq);
                assert_eq!(*by_hash.entry(b.seq).or_insert(*n), *n);
            }
        }
        let by_paths = infinite_cache_reuse(&prompts, 64, |i| Some(i % 3));
        let mut hashes = Numbering::Hashes(FxHashMap::default());
        for (r, p) in records.iter().zip(&mut prompts) {
            hashes.number(r, p).unwrap();
        }
        assert_eq!(
            infinite_cache_reuse(&prompts, 64, |i| Some(i % 3)),
            by_paths
        );
    }

    #[test]
    fn round_robin_with_infinite_caches_reuses_exactly_the_analytical_share() {
        let trace = synthetic_trace(60, 60_000);
        let a = args(trace.clone(), "round_robin");
        let report = run(&a).unwrap();
        let records = trace::load(&trace, None, 512).unwrap();
        let bs = NonZeroUsize::new(64).unwrap();
        let prompts = prompts(&records, &a, bs).unwrap();
        let analytical = infinite_cache_reuse(&prompts, 64, |i| Some(i % 4));
        assert!(
            analytical > 0.1,
            "the trace must reuse something: {analytical}"
        );
        assert_eq!(report.policies[0].reuse_ratio, analytical);
        assert_eq!(
            report.bound_reuse_ratio,
            infinite_cache_reuse(&prompts, 64, |_| Some(0))
        );
        std::fs::remove_file(trace).ok();
    }

    /// Requests that expire in the queue count in no reuse and no load figure: they were
    /// counted as routed to worker 0 (filling its infinite cache), in the reuse ratios'
    /// prompt tokens, and in the mean the load spread divides by (a most-loaded worker read
    /// below the mean).
    #[test]
    fn requests_that_expire_in_the_queue_count_in_no_reuse_or_load_figure() {
        // All at once, one at a time on each worker, waiting at most a millisecond.
        let trace = synthetic_trace(60, 0);
        let mut a = args(trace.clone(), "kv");
        a.worker_budget_tokens = 1;
        a.queue_ttl_ms = 1;
        let report = run(&a).unwrap();
        let p = &report.policies[0];
        let routed: u64 = p.worker_load_spread.requests.iter().sum();
        assert!(
            p.queue_expired > 0 && routed > 0,
            "{} expired",
            p.queue_expired
        );
        // Engine rejections were routed: in the spread already.
        assert_eq!(routed + p.queue_expired, p.requests);
        assert!(p.worker_load_spread.max_over_mean >= 1.0);
        assert!(p.worker_load_spread.min_over_mean <= 1.0);
        assert!(p.reuse_ratio <= 1.0 && p.assignment_reuse_ratio <= 1.0);
        std::fs::remove_file(trace).ok();
    }

    #[test]
    fn same_seed_same_report() {
        let trace = synthetic_trace(80, 300);
        let mut a = args(trace.clone(), "kv");
        a.policy = vec!["kv".into(), "random".into(), "approx_prefix".into()];
        a.g1_blocks = 300;
        a.g2_blocks = 600;
        let strip = |mut r: Report| {
            r.policies.iter_mut().for_each(|p| p.wall_s = 0.0);
            (r.wall_s, r.load_s, r.cpu_s) = (0.0, 0.0, 0.0);
            r
        };
        let first = strip(run(&a).unwrap());
        assert_eq!(first, strip(run(&a).unwrap()));
        assert!(
            first
                .policies
                .iter()
                .all(|p| p.requests == 80 && p.rejected == 0)
        );
        let svg = crate::plot::svg(&first);
        assert!(svg.contains("approx_prefix") && svg.ends_with("</svg>\n"));
        std::fs::remove_file(trace).ok();
    }

    /// round_robin and random run without the router's index and route exactly as with it;
    /// only their decision figures (which compare with what the index knows) are left out,
    /// unless `--baseline-index` keeps it. Every other policy, and any policy under a queue
    /// of several classes, keeps it.
    #[test]
    fn baselines_route_the_same_without_the_index() {
        let trace = synthetic_trace(80, 300);
        let mut a = args(trace.clone(), "kv");
        a.policy = PolicyKind::ALL
            .iter()
            .map(|p| p.name().to_owned())
            .collect();
        a.g1_blocks = 300;
        let strip = |mut r: Report| {
            r.policies.iter_mut().for_each(|p| {
                p.wall_s = 0.0;
                p.decisions = None;
            });
            (r.wall_s, r.load_s, r.cpu_s) = (0.0, 0.0, 0.0);
            r
        };
        let without = run(&a).unwrap();
        let kept: Vec<(&str, bool)> = without
            .policies
            .iter()
            .map(|p| (p.policy.as_str(), p.decisions.is_some()))
            .collect();
        assert_eq!(
            kept,
            [
                ("kv", true),
                ("round_robin", false),
                ("round_robin_skip_busy", true),
                ("random", false),
                ("least_loaded", true),
                ("approx_prefix", true)
            ]
        );
        a.baseline_index = true;
        let with = run(&a).unwrap();
        assert!(with.policies.iter().all(|p| p.decisions.is_some()));
        assert_eq!(strip(without), strip(with));
        // Two classes: the queue orders them by their work, cached prefixes off.
        a.baseline_index = false;
        a.assign_classes = Some("a:0:1,b:1:1".into());
        assert!(
            run(&a)
                .unwrap()
                .policies
                .iter()
                .all(|p| p.decisions.is_some())
        );
        std::fs::remove_file(trace).ok();
    }
}
