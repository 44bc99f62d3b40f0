//! `kvroute-bench replay` (offline): a Mooncake trace through W worker engines and the
//! router's own indexer and scheduler, in one process on a virtual clock. KV events reach the
//! indexer `--event-delay-ms` after the engine publishes them, so routing races event arrival
//! as it does over NATS. Deterministic for a seed.

use std::collections::{BTreeSet, VecDeque};
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use kvroute::indexer::{self, Indexer};
use kvroute::protocol::{BlockHash, DpRank, EventBatch, Salt, SeqHash, WorkerId, hash_blocks};
use kvroute::scheduler::{self, BookingId, PolicyKind, RouteRequest, Scheduler};
use kvroute_worker::EngineConfig;
use kvroute_worker::block_manager::EvictionKind;
use kvroute_worker::engine::{Output, OutputKind, Request, RequestId};
use rustc_hash::FxHashMap;
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::fleet::{Fleet, FleetSink};
use crate::stats::Summary;
use crate::trace::{self, TraceRecord};

/// The one model every replayed worker serves.
const REPLAY_MODEL: &str = "replay";

/// Flags of `kvroute-bench replay`.
#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Mooncake JSONL trace.
    #[arg(long, default_value = "../shared/traces/conversation_trace.jsonl")]
    pub trace: PathBuf,
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
    /// First N requests only.
    #[arg(long)]
    pub requests: Option<usize>,
    /// Tokens per trace hash id.
    #[arg(long, default_value_t = 512)]
    pub trace_block_size: usize,
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
    /// Delay between an engine publishing events and the indexer applying them, ms.
    #[arg(long, default_value_t = 5.0)]
    pub event_delay_ms: f64,
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
    /// Send the trace to a running endpoint over HTTP instead of simulating (needs --url).
    #[arg(long, requires = "url")]
    pub online: bool,
    /// OpenAI-compatible base URL for --online (e.g. http://127.0.0.1:8080).
    #[arg(long)]
    pub url: Option<String>,
    /// Model name sent with --online.
    #[arg(long, default_value = "kvroute-sim")]
    pub model: String,
    /// With --online, send prompts as text (one word per token) instead of token ids.
    #[arg(long)]
    pub text: bool,
}

/// Requests each worker received, relative to the mean.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct LoadSpread {
    /// Fewest requests on one worker / mean.
    pub min_over_mean: f64,
    /// Most requests on one worker / mean.
    pub max_over_mean: f64,
    /// Requests per worker.
    pub requests: Vec<u64>,
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
    /// Prompt tokens served from cache (G1 or onboarded G2) / prompt tokens.
    pub reuse_ratio: f64,
    /// Prompt tokens onboarded from G2 / prompt tokens.
    pub g2_reuse_ratio: f64,
    /// Requests per worker.
    pub worker_load_spread: LoadSpread,
    /// Reuse the same assignment of requests to workers would get from infinite caches
    /// filled at once: what routing alone decided (the rest is timing and eviction).
    pub assignment_reuse_ratio: f64,
    /// Requests the engines refused.
    pub rejected: u64,
    /// Every TTFT, ms, sorted (for the plot; not in the JSON).
    #[serde(skip)]
    pub ttft_sorted_ms: Vec<f64>,
}

/// The JSON `kvroute-bench replay` writes.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Report {
    /// SHA-256 of the trace file.
    pub trace_sha256: String,
    /// Reuse ratio of one infinite cache over the replayed requests.
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
    /// One entry per policy, in the order run.
    pub policies: Vec<PolicyResult>,
}

struct Prompt {
    arrival_us: u64,
    tokens: std::sync::Arc<[u32]>,
    blocks: Vec<BlockHash>,
    output: u32,
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
    indexer: Indexer,
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
                        self.ttft.push((o.at_us - t.arrival_us) as f64 / 1e3);
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
                }
                OutputKind::Rejected(_) => {
                    self.rejected += 1;
                    if let Some(b) = t.booking.take() {
                        self.scheduler.complete(b);
                    }
                }
                _ => {}
            }
        }
    }

    fn batches(&mut self, _: usize, at_us: u64, batches: Vec<EventBatch>) {
        for b in batches {
            self.pending.push_back((at_us + self.delay_us, b));
        }
    }
}

impl Router {
    fn deliver_events(&mut self, now_us: u64) {
        while self.pending.front().is_some_and(|(at, _)| *at <= now_us) {
            let (_, batch) = self.pending.pop_front().expect("invariant: peeked");
            self.indexer.apply(&batch);
        }
    }
}

/// Engine configuration from the flags.
pub fn engine_config(args: &Args) -> anyhow::Result<EngineConfig> {
    let eviction = match args.eviction.as_str() {
        "lru" => EvictionKind::Lru,
        "lineage_lru" => EvictionKind::LineageLru,
        other => bail!("unknown --eviction {other:?} (lru, lineage_lru)"),
    };
    let config = EngineConfig {
        block_size: args.block_size,
        g1_blocks: args.g1_blocks,
        g2_blocks: args.g2_blocks,
        speedup: args.engine_speedup,
        eviction,
        ..EngineConfig::default()
    };
    config.validate()?;
    Ok(config)
}

/// Runs every requested policy and reports.
pub fn run(args: &Args) -> anyhow::Result<Report> {
    let policies = args
        .policy
        .iter()
        .map(|p| PolicyKind::parse(p.trim()).with_context(|| format!("unknown policy {p:?}")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    if args.speedup.is_nan() || args.speedup <= 0.0 {
        bail!("--speedup must be positive");
    }
    let config = engine_config(args)?;
    let bytes =
        std::fs::read(&args.trace).with_context(|| format!("reading {}", args.trace.display()))?;
    let trace_sha256 = Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let records = trace::load(&args.trace, args.requests, args.trace_block_size)?;
    let block_size = NonZeroUsize::new(args.block_size).context("--block-size must be positive")?;
    let prompts: Vec<Prompt> = records
        .iter()
        .map(|r| prompt(r, args, block_size))
        .collect();
    let bound_reuse_ratio = infinite_cache_reuse(&prompts, args.block_size, |_| 0);
    let online = args.online.then_some(args.url.as_deref()).flatten();
    let mut report = Report {
        trace_sha256,
        bound_reuse_ratio,
        workers: args.workers,
        speedup: args.speedup,
        block_size: args.block_size,
        g1_blocks: args.g1_blocks,
        g2_blocks: args.g2_blocks,
        seed: args.seed,
        policies: Vec::new(),
    };
    if let Some(url) = online {
        let requests = prompts
            .iter()
            .map(|p| crate::online::OnlineRequest {
                arrival_us: p.arrival_us,
                tokens: p.tokens.clone(),
                output: p.output,
            })
            .collect();
        let runtime = tokio::runtime::Runtime::new()?;
        let result = runtime.block_on(crate::online::run(
            url,
            &args.model,
            args.text,
            args.block_size,
            requests,
        ))?;
        report.policies.push(result);
        return Ok(report);
    }
    for policy in policies {
        report
            .policies
            .push(run_policy(policy, &prompts, &config, args)?);
    }
    Ok(report)
}

fn prompt(record: &TraceRecord, args: &Args, block_size: NonZeroUsize) -> Prompt {
    let tokens = trace::prompt_tokens(record, args.trace_block_size);
    let blocks = hash_blocks(&tokens, block_size, Salt::NONE);
    Prompt {
        arrival_us: (record.timestamp as f64 * 1000.0 / args.speedup).round() as u64,
        tokens: tokens.into(),
        blocks,
        output: record.output_length.max(1) as u32,
    }
}

/// Prompt tokens served from cache / prompt tokens, if request `i` went to cache
/// `assign(i)` and every cache were infinite and filled at once: the bound routing is
/// judged against (one cache), or what a routing would reuse with no eviction.
pub fn infinite_cache_reuse(
    prompts: &[impl PromptBlocks],
    block_size: usize,
    assign: impl Fn(usize) -> usize,
) -> f64 {
    let mut caches: FxHashMap<usize, BTreeSet<SeqHash>> = FxHashMap::default();
    let (mut hit, mut total) = (0u64, 0u64);
    for (i, p) in prompts.iter().enumerate() {
        let cache = caches.entry(assign(i)).or_default();
        let matched = p.block_seqs().take_while(|s| cache.contains(s)).count();
        hit += ((matched * block_size).min(p.prompt_len())) as u64;
        total += p.prompt_len() as u64;
        cache.extend(p.block_seqs());
    }
    hit as f64 / total.max(1) as f64
}

/// What [`infinite_cache_reuse`] needs of a prompt.
pub trait PromptBlocks {
    /// Its full blocks' sequence hashes.
    fn block_seqs(&self) -> impl Iterator<Item = SeqHash>;
    /// Its length in tokens.
    fn prompt_len(&self) -> usize;
}

impl PromptBlocks for Prompt {
    fn block_seqs(&self) -> impl Iterator<Item = SeqHash> {
        self.blocks.iter().map(|b| b.seq)
    }
    fn prompt_len(&self) -> usize {
        self.tokens.len()
    }
}

fn run_policy(
    policy: PolicyKind,
    prompts: &[Prompt],
    config: &EngineConfig,
    args: &Args,
) -> anyhow::Result<PolicyResult> {
    let started = Instant::now();
    let mut fleet = Fleet::new(config, args.workers)?;
    let defaults = scheduler::Config::default();
    let mut scheduler = Scheduler::new(scheduler::Config {
        policy,
        seed: args.seed,
        prefill_scale: args.prefill_scale.unwrap_or(defaults.prefill_scale),
        decode_weight: args.decode_weight.unwrap_or(defaults.decode_weight),
        ..defaults
    })?;
    for w in 0..args.workers {
        scheduler.add_worker(
            (WorkerId(w as u64), DpRank(0)),
            config.g1_blocks,
            REPLAY_MODEL,
        );
    }
    let mut router = Router {
        indexer: Indexer::new(indexer::Config::default())?,
        scheduler,
        delay_us: (args.event_delay_ms * 1000.0).round() as u64,
        pending: VecDeque::new(),
        tracked: vec![Tracked::default(); prompts.len()],
        ttft: Vec::with_capacity(prompts.len()),
        itl: Vec::new(),
        e2e: Vec::with_capacity(prompts.len()),
        output_tokens: 0,
        reused_tokens: 0,
        host_tokens: 0,
        rejected: 0,
        last_finish_us: 0,
    };
    let bar = progress(prompts.len() as u64, policy.name(), args.quiet);
    let mut per_worker = vec![0u64; args.workers];
    let mut assignment = Vec::with_capacity(prompts.len());
    let mut seqs: Vec<SeqHash> = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        fleet.run_until(p.arrival_us, &mut router)?;
        router.deliver_events(p.arrival_us);
        seqs.clear();
        seqs.extend(p.blocks.iter().map(|b| b.seq));
        let overlaps = router.indexer.find_matches_seq(&seqs);
        let request = RouteRequest {
            model: REPLAY_MODEL,
            blocks: &p.blocks,
            prompt_tokens: p.tokens.len(),
            block_size: args.block_size,
            overlaps: &overlaps,
        };
        let decision = router
            .scheduler
            .route(p.arrival_us / 1000, &request)
            .context("no worker to route to")?;
        let worker = decision.chosen.key.0.0 as usize;
        per_worker[worker] += 1;
        assignment.push(worker);
        router.tracked[i] = Tracked {
            booking: Some(decision.booking),
            arrival_us: p.arrival_us,
            ..Tracked::default()
        };
        let request = Request {
            id: RequestId(i as u64),
            prompt: p.tokens.clone(),
            max_tokens: p.output,
            salt: Salt::NONE,
        };
        fleet.submit(worker, p.arrival_us, request, &mut router)?;
        if let Some(bar) = &bar {
            bar.inc(1);
        }
    }
    fleet.run_until(u64::MAX, &mut router)?;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let prompt_tokens: u64 = prompts.iter().map(|p| p.tokens.len() as u64).sum();
    let first_arrival = prompts.first().map_or(0, |p| p.arrival_us);
    let virtual_s = router.last_finish_us.saturating_sub(first_arrival) as f64 / 1e6;
    let mean = prompts.len() as f64 / args.workers as f64;
    let ttft_ms = Summary::of(&mut router.ttft);
    Ok(PolicyResult {
        policy: policy.name().to_owned(),
        requests: prompts.len() as u64,
        wall_s: started.elapsed().as_secs_f64(),
        virtual_s,
        ttft_ms,
        itl_ms: Summary::of(&mut router.itl),
        e2e_ms: Summary::of(&mut router.e2e),
        throughput_tok_s: router.output_tokens as f64 / virtual_s.max(1e-9),
        reuse_ratio: router.reused_tokens as f64 / prompt_tokens.max(1) as f64,
        g2_reuse_ratio: router.host_tokens as f64 / prompt_tokens.max(1) as f64,
        worker_load_spread: LoadSpread {
            min_over_mean: per_worker.iter().copied().min().unwrap_or(0) as f64 / mean.max(1e-9),
            max_over_mean: per_worker.iter().copied().max().unwrap_or(0) as f64 / mean.max(1e-9),
            requests: per_worker,
        },
        assignment_reuse_ratio: infinite_cache_reuse(prompts, args.block_size, |i| assignment[i]),
        rejected: router.rejected,
        ttft_sorted_ms: router.ttft,
    })
}

fn progress(len: u64, policy: &str, quiet: bool) -> Option<indicatif::ProgressBar> {
    if quiet {
        return None;
    }
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(len),
        indicatif::ProgressDrawTarget::stderr(),
    );
    bar.set_message(policy.to_owned());
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("{msg:>14} [{bar:40}] {pos}/{len} {elapsed}")
    {
        bar.set_style(style);
    }
    Some(bar)
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
}

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

    fn args(trace: PathBuf, policy: &str) -> Args {
        Args {
            trace,
            workers: 4,
            policy: vec![policy.to_owned()],
            speedup: 1.0,
            requests: None,
            trace_block_size: 512,
            block_size: 64,
            g1_blocks: 100_000,
            g2_blocks: 0,
            engine_speedup: 1.0,
            eviction: "lineage_lru".into(),
            event_delay_ms: 5.0,
            prefill_scale: None,
            decode_weight: None,
            seed: 7,
            online: false,
            url: None,
            model: "kvroute-sim".into(),
            text: false,
            json: None,
            plot: None,
            quiet: true,
        }
    }

    #[test]
    fn round_robin_with_infinite_caches_reuses_exactly_the_analytical_share() {
        let trace = synthetic_trace(60, 60_000);
        let a = args(trace.clone(), "round_robin");
        let report = run(&a).unwrap();
        let records = trace::load(&trace, None, 512).unwrap();
        let bs = NonZeroUsize::new(64).unwrap();
        let prompts: Vec<Prompt> = records.iter().map(|r| prompt(r, &a, bs)).collect();
        let analytical = infinite_cache_reuse(&prompts, 64, |i| i % 4);
        assert!(
            analytical > 0.1,
            "the trace must reuse something: {analytical}"
        );
        assert_eq!(report.policies[0].reuse_ratio, analytical);
        assert_eq!(
            report.bound_reuse_ratio,
            infinite_cache_reuse(&prompts, 64, |_| 0)
        );
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
}
