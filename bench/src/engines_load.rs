//! `kvroute-bench engines`: kvroute in front of engines with real prefix caches (test
//! engines, `kvroute-worker --emulate`, on their timing model), in direct mode, driven by a
//! multi-turn chat workload: TTFT and the engines' own reuse figure
//! (`usage.prompt_tokens_details.cached_tokens` / prompt tokens) per routing policy; then the
//! latency the router adds in front of one engine against calling the engine directly.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvroute_e2e::engines::{EngineSpec, TestEngine, direct_router};
use kvroute_e2e::procs::Proc;
use parking_lot::Mutex;
use tokio::time::Instant;

use crate::stats::Summary;

/// Flags of `kvroute-bench engines`.
#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// Engines behind the router.
    #[arg(long, default_value_t = 4)]
    pub engines: usize,
    /// Conversations.
    #[arg(long, default_value_t = 48)]
    pub conversations: usize,
    /// Turns per conversation (each turn's prompt extends the previous one).
    #[arg(long, default_value_t = 5)]
    pub turns: usize,
    /// Distinct system prompts the conversations share.
    #[arg(long, default_value_t = 8)]
    pub families: usize,
    /// Length of each system prompt, in characters (one token each with the engines'
    /// byte-level tokenizer).
    #[arg(long, default_value_t = 6000)]
    pub system_chars: usize,
    /// Conversations in flight at once.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Routing policies compared.
    #[arg(long, default_value = "kv,round_robin")]
    pub policies: String,
    /// Wire format of the test engines: vllm, vllm-legacy, sglang.
    #[arg(long, default_value = "vllm")]
    pub flavor: String,
    /// Divides the engines' step times (1: the timing model's real-time pace).
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// G1 blocks per engine (16 tokens each): small enough that the engines' caches cannot
    /// all hold every system prompt, as in a real fleet.
    #[arg(long, default_value_t = 1024)]
    pub g1_blocks: usize,
    /// Requests for the added-latency measurement (each way).
    #[arg(long, default_value_t = 300)]
    pub overhead_requests: usize,
    /// Write the report here as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One policy's figures.
#[derive(Debug, serde::Serialize)]
pub struct PolicyFigures {
    /// The policy.
    pub policy: String,
    /// Requests answered.
    pub requests: usize,
    /// Requests that failed.
    pub failed: usize,
    /// Time to first token, ms.
    pub ttft_ms: Summary,
    /// Whole request, ms.
    pub e2e_ms: Summary,
    /// Engine-reported cached prompt tokens / prompt tokens.
    pub reuse: f64,
    /// Requests per engine.
    pub per_engine: Vec<u64>,
    /// Wall time of the workload, s.
    pub wall_s: f64,
}

/// The latency the router adds.
#[derive(Debug, serde::Serialize)]
pub struct Overhead {
    /// Requests each way.
    pub requests: usize,
    /// Straight to the engine, ms.
    pub direct_ms: Summary,
    /// Through the router, ms.
    pub routed_ms: Summary,
    /// Median routed minus median direct, ms.
    pub added_p50_ms: f64,
}

/// The report.
#[derive(Debug, serde::Serialize)]
pub struct Report {
    /// The machine.
    pub machine: String,
    /// The flags.
    pub args: String,
    /// Per policy.
    pub policies: Vec<PolicyFigures>,
    /// Added latency.
    pub overhead: Overhead,
}

const MODEL: &str = "bench-model";

fn start_engine(args: &Args, speedup: f64) -> anyhow::Result<TestEngine> {
    TestEngine::start(EngineSpec {
        flavor: args.flavor.clone(),
        model: MODEL.into(),
        g1_blocks: args.g1_blocks,
        g2_blocks: 0,
        speedup,
        adapters: Vec::new(),
    })
}

fn router(engines: &[TestEngine], policy: &str) -> anyhow::Result<(Proc, String)> {
    let backends: Vec<String> = engines.iter().map(TestEngine::backend).collect();
    let (proc, url, _admin) = direct_router(&backends, &["--policy".into(), policy.into()])?;
    Ok((proc, url))
}

type Http = Client<HttpConnector, Full<Bytes>>;

/// What one streamed request measured.
struct Answer {
    ttft_ms: f64,
    e2e_ms: f64,
    prompt: u64,
    cached: u64,
    text: String,
    worker: Option<String>,
}

async fn stream(http: &Http, url: &str, prompt: &str, max_tokens: u32) -> anyhow::Result<Answer> {
    let body = serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
        "stream": true, "stream_options": {"include_usage": true}});
    let req = hyper::Request::post(format!("{url}/v1/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))?;
    let started = Instant::now();
    let resp = tokio::time::timeout(Duration::from_secs(120), http.request(req)).await??;
    if !resp.status().is_success() {
        bail!("status {}", resp.status());
    }
    let worker = resp
        .headers()
        .get("x-kvroute-worker")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let mut body = resp.into_body();
    let (mut ttft, mut buf, mut text) = (None, String::new(), String::new());
    let (mut prompt_tokens, mut cached) = (0, 0);
    while let Some(frame) = tokio::time::timeout(Duration::from_secs(120), body.frame()).await? {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        buf.push_str(&String::from_utf8_lossy(&data));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let Some(json) = event.trim().strip_prefix("data: ") else {
                continue;
            };
            let Ok(v) = serde_json::from_str::<serde_json::Value>(json) else {
                continue;
            };
            if let Some(t) = v["choices"][0]["text"].as_str() {
                if ttft.is_none() && !t.is_empty() {
                    ttft = Some(started.elapsed().as_secs_f64() * 1e3);
                }
                text.push_str(t);
            }
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0);
                cached = u["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap_or(0);
            }
        }
    }
    Ok(Answer {
        ttft_ms: ttft.context("no token in the stream")?,
        e2e_ms: started.elapsed().as_secs_f64() * 1e3,
        prompt: prompt_tokens,
        cached,
        text,
        worker,
    })
}

async fn wait_routable(http: &Http, url: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if stream(http, url, "warm", 1).await.is_ok() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("{url} never answered")
}

/// The system prompt of a family of conversations, `chars` characters.
fn system_prompt(family: usize, chars: usize) -> String {
    let rule = format!("Rule {family}: answer briefly, cite sources, stay polite. ");
    let mut s = format!("System {family}: you are assistant number {family}. ");
    while s.len() < chars {
        s.push_str(&rule);
    }
    s.truncate(chars);
    s
}

async fn run_policy(args: &Args, http: &Http, policy: &str) -> anyhow::Result<PolicyFigures> {
    let engines: Vec<TestEngine> = (0..args.engines)
        .map(|_| start_engine(args, args.speedup))
        .collect::<anyhow::Result<_>>()?;
    let (_router, url) = router(&engines, policy)?;
    wait_routable(http, &url).await?;
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let results: Arc<Mutex<Vec<Answer>>> = Arc::default();
    let failed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let clients: Vec<_> = (0..args.concurrency)
        .map(|_| {
            let (next, results, failed, http, url) = (
                Arc::clone(&next),
                Arc::clone(&results),
                Arc::clone(&failed),
                http.clone(),
                url.clone(),
            );
            let (conversations, turns, families, chars) = (
                args.conversations,
                args.turns,
                args.families.max(1),
                args.system_chars,
            );
            tokio::spawn(async move {
                loop {
                    let c = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if c >= conversations {
                        return;
                    }
                    let mut history = system_prompt(c % families, chars);
                    for t in 0..turns {
                        history.push_str(&format!(
                            "\nUser {c}: question {t}: what about item {} of topic {}?\nAssistant:",
                            c * 7 + t,
                            c % 13
                        ));
                        match stream(&http, &url, &history, 24).await {
                            Ok(a) => {
                                history.push_str(&a.text);
                                results.lock().push(a);
                            }
                            Err(_) => {
                                failed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            }
                        }
                    }
                }
            })
        })
        .collect();
    for c in clients {
        c.await?;
    }
    let wall_s = started.elapsed().as_secs_f64();
    let results = std::mem::take(&mut *results.lock());
    let mut ttft: Vec<f64> = results.iter().map(|a| a.ttft_ms).collect();
    let mut e2e: Vec<f64> = results.iter().map(|a| a.e2e_ms).collect();
    let prompt: u64 = results.iter().map(|a| a.prompt).sum();
    let cached: u64 = results.iter().map(|a| a.cached).sum();
    let mut per_worker: std::collections::BTreeMap<String, u64> = Default::default();
    for a in &results {
        *per_worker
            .entry(a.worker.clone().unwrap_or_default())
            .or_default() += 1;
    }
    Ok(PolicyFigures {
        policy: policy.to_owned(),
        requests: results.len(),
        failed: failed.load(std::sync::atomic::Ordering::Relaxed),
        ttft_ms: Summary::of(&mut ttft),
        e2e_ms: Summary::of(&mut e2e),
        reuse: cached as f64 / prompt.max(1) as f64,
        per_engine: per_worker.into_values().collect(),
        wall_s,
    })
}

async fn overhead(args: &Args, http: &Http) -> anyhow::Result<Overhead> {
    // A fast engine, so the figure is the router's, not the timing model's.
    let engine = start_engine(args, 1000.0)?;
    let (_router, routed) = router(std::slice::from_ref(&engine), "kv")?;
    wait_routable(http, &routed).await?;
    wait_routable(http, &engine.url()).await?;
    let prompt = "A short prompt for the latency measurement, the same every time.";
    let (mut direct, mut through) = (Vec::new(), Vec::new());
    // Interleaved, so that drift affects both the same.
    for _ in 0..args.overhead_requests {
        direct.push(stream(http, &engine.url(), prompt, 1).await?.e2e_ms);
        through.push(stream(http, &routed, prompt, 1).await?.e2e_ms);
    }
    let (direct_ms, routed_ms) = (Summary::of(&mut direct), Summary::of(&mut through));
    Ok(Overhead {
        requests: args.overhead_requests,
        added_p50_ms: routed_ms.p50 - direct_ms.p50,
        direct_ms,
        routed_ms,
    })
}

/// Runs the whole bench.
pub async fn run(args: &Args) -> anyhow::Result<Report> {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let http: Http = Client::builder(TokioExecutor::new()).build(connector);
    let mut policies = Vec::new();
    for policy in args
        .policies
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
    {
        eprintln!(
            "policy {policy}: {} engines, {} conversations × {} turns",
            args.engines, args.conversations, args.turns
        );
        policies.push(run_policy(args, &http, policy).await?);
    }
    eprintln!(
        "added latency: {} requests each way",
        args.overhead_requests
    );
    let overhead = overhead(args, &http).await?;
    Ok(Report {
        machine: machine(),
        args: format!("{args:?}"),
        policies,
        overhead,
    })
}

/// The CPU model and core count, from /proc/cpuinfo.
fn machine() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = info
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map_or("unknown CPU", str::trim)
        .to_owned();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{model}, {cores} cores")
}

/// Prints the report as tables.
pub fn print(r: &Report) {
    println!(
        "policy        requests  failed  TTFT p50   p90      p99      E2E p50   reuse   per engine"
    );
    for p in &r.policies {
        println!(
            "{:<13} {:>8} {:>7} {:>8.1} {:>8.1} {:>8.1} {:>9.1} {:>6.1}%   {:?}",
            p.policy,
            p.requests,
            p.failed,
            p.ttft_ms.p50,
            p.ttft_ms.p90,
            p.ttft_ms.p99,
            p.e2e_ms.p50,
            p.reuse * 100.0,
            p.per_engine
        );
    }
    let o = &r.overhead;
    println!(
        "added latency ({} requests each way, 1-token answers): direct p50 {:.2} ms p90 {:.2}; through the router p50 {:.2} ms p90 {:.2}; added p50 {:.2} ms",
        o.requests,
        o.direct_ms.p50,
        o.direct_ms.p90,
        o.routed_ms.p50,
        o.routed_ms.p90,
        o.added_p50_ms
    );
    println!("machine: {}", r.machine);
}
