//! `kvroute-bench online --url URL`: a trace's requests sent at their timestamps (divided by
//! `--speedup`) to any OpenAI-compatible endpoint, streamed, and measured at the client:
//! TTFT, ITL, E2E, throughput and failures. Reuse, load spread and decision quality are
//! reported only when the endpoint says them (kvroute's `x-kvroute-worker`,
//! `x-kvroute-overlap`, `x-kvroute-cached-blocks` and `x-kvroute-reachable-blocks`
//! headers); nothing is reported that was not measured.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use parking_lot::Mutex;
use serde::Serialize;
use tokio::time::Instant;

use crate::report::{DecisionReport, LoadSpread, Summary};
use crate::trace;

/// Flags of `kvroute-bench online`.
#[derive(clap::Args, Debug, Clone)]
pub struct Args {
    /// OpenAI-compatible base URL (e.g. http://127.0.0.1:8080).
    #[arg(long)]
    pub url: String,
    /// Model name sent with each request.
    #[arg(long, default_value = "kvroute-sim")]
    pub model: String,
    /// The trace.
    #[command(flatten)]
    pub source: trace::TraceArgs,
    /// Divides arrival times (2 = twice the request rate).
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// The endpoint's KV block size, tokens (to read kvroute's block counts as tokens).
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Send prompts as text (one word per token) instead of token ids.
    #[arg(long)]
    pub text: bool,
    /// Seed of synthesised prefixes.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the report here as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Longest a request may take, connect to `[DONE]`, s: one past it is a failure
    /// (`timeout`), so an endpoint that stalls cannot hold the run forever.
    #[arg(long, default_value_t = 600.0)]
    pub timeout_s: f64,
}

/// What kvroute's response headers said (absent for other endpoints).
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct RouterView {
    /// Requests whose response named a worker.
    pub routed: u64,
    /// Prompt tokens the chosen worker had cached (device + host) / prompt tokens.
    pub reuse_ratio: f64,
    /// Requests per worker.
    pub worker_load_spread: LoadSpread,
    /// Decision quality, from the cached and reachable block counts.
    pub decisions: DecisionReport,
}

/// What `kvroute-bench online` measured.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct OnlineReport {
    /// The endpoint.
    pub url: String,
    /// Model name sent.
    pub model: String,
    /// The trace's format.
    pub trace_format: String,
    /// Arrival speedup.
    pub speedup: f64,
    /// Requests sent.
    pub requests: u64,
    /// Requests that failed: no connection, a non-2xx status, an error event or a broken
    /// body mid-stream, a stream that ended without `[DONE]`, or the timeout. Only the others
    /// are in the latencies and the throughput.
    pub failed: u64,
    /// Failed requests by cause: `status 429`, `connect`, …
    pub failures: std::collections::BTreeMap<String, u64>,
    /// From the start of the schedule to the last answer's end, s.
    pub span_s: f64,
    /// The request's due time (its arrival in the schedule) to the first server-sent event
    /// that carries a token, ms: a client that sends late (its timer, building the body, a
    /// busy machine) counts against it, as a user who sent on time would see it.
    pub ttft_ms: Summary,
    /// Gaps between events that carry tokens, ms.
    pub itl_ms: Summary,
    /// The due time to `[DONE]`, ms.
    pub e2e_ms: Summary,
    /// How late each request was sent after its due time, ms (the client's own lag, which
    /// TTFT and E2E include: they were timed from the send and left it out).
    pub send_lag_ms: Summary,
    /// Tokens the successful streams carried, per second over the span.
    pub throughput_tok_s: f64,
    /// What the router's headers said; `None` when no response carried them.
    pub router: Option<RouterView>,
    /// Every TTFT, sorted, ms.
    pub ttft_sorted_ms: Vec<f64>,
}

/// One request as the trace gives it.
pub struct OnlineRequest {
    /// Arrival, µs after the start.
    pub arrival_us: u64,
    /// Prompt token ids.
    pub tokens: Arc<[u32]>,
    /// Tokens to generate.
    pub output: u32,
}

#[derive(Default)]
struct Measured {
    ttft_ms: Vec<f64>,
    itl_ms: Vec<f64>,
    e2e_ms: Vec<f64>,
    send_lag_ms: Vec<f64>,
    tokens: u64,
    reused_tokens: u64,
    prompt_tokens: u64,
    failed: u64,
    failures: std::collections::BTreeMap<String, u64>,
    per_worker: std::collections::BTreeMap<String, u64>,
    last_end: Option<Instant>,
    decisions: kvroute::scheduler::DecisionStats,
}

/// Text for routers that want text: one short word per token, deterministic.
fn text_of(tokens: &[u32]) -> String {
    tokens.iter().map(|t| format!("w{} ", t % 5000)).collect()
}

/// Parses `device=A;host=B;disk=C`.
fn cached_blocks(overlap: &str) -> u64 {
    overlap
        .split(';')
        .filter(|kv| kv.starts_with("device=") || kv.starts_with("host="))
        .filter_map(|kv| kv.split('=').nth(1)?.parse::<u64>().ok())
        .sum()
}

/// One streamed answer as it arrives: server-sent events cut at blank lines (an event may
/// span TCP reads, or several share one), the events that carry tokens timed, `[DONE]` and
/// error events noted. No I/O: time is an argument.
#[derive(Debug, Default)]
struct StreamMeter {
    partial: Vec<u8>,
    first: Option<Instant>,
    last_token: Option<Instant>,
    gaps_ms: Vec<f64>,
    tokens: u64,
    done: Option<Instant>,
    error: Option<&'static str>,
}

impl StreamMeter {
    /// Takes bytes that arrived at `now`: the events they complete are read (cut as the
    /// router's relay cuts them), the rest waits for its end.
    fn push(&mut self, data: &[u8], now: Instant) {
        self.partial.extend_from_slice(data);
        if let Some(end) = kvroute::ingress::proxy::event_end(&self.partial) {
            let events: Vec<u8> = self.partial.drain(..end).collect();
            self.events(&events, now);
        }
    }

    /// Reads whole events, all of which arrived at `now`.
    fn events(&mut self, events: &[u8], now: Instant) {
        for line in events.split(|b| *b == b'\n') {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let Some(data) = line.strip_prefix(b"data:") else {
                continue; // comments (keep-alives), other fields
            };
            let data = data.trim_ascii();
            if data == b"[DONE]" {
                self.done = Some(now);
                continue;
            }
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) else {
                self.error.get_or_insert("bad event");
                continue;
            };
            if v.get("error").is_some() {
                self.error.get_or_insert("error event");
                continue;
            }
            let tokens = tokens_of(&v);
            if tokens == 0 {
                continue; // the role chunk, the usage chunk, an empty delta
            }
            match self.last_token {
                None => self.first = Some(now),
                Some(last) => self
                    .gaps_ms
                    .push(now.duration_since(last).as_secs_f64() * 1e3),
            }
            self.last_token = Some(now);
            self.tokens += tokens;
        }
    }

    /// Whether the answer is whole: `[DONE]`, and no error event.
    fn outcome(&self) -> Result<Instant, &'static str> {
        if let Some(e) = self.error {
            return Err(e);
        }
        self.done.ok_or("no [DONE]")
    }
}

/// Tokens a streamed chunk carries: its choices' `token_ids` where the server sends them
/// (vLLM with `return_token_ids`, kvroute's workers), else one per choice with text.
fn tokens_of(chunk: &serde_json::Value) -> u64 {
    let Some(choices) = chunk["choices"].as_array() else {
        return 0;
    };
    choices
        .iter()
        .map(|c| {
            if let Some(ids) = c["token_ids"].as_array() {
                return ids.len() as u64;
            }
            let text = c["text"]
                .as_str()
                .or_else(|| c["delta"]["content"].as_str());
            u64::from(text.is_some_and(|t| !t.is_empty()))
        })
        .sum()
}

/// The endpoint's completions URL, refusing what the HTTP client cannot reach.
fn endpoint(url: &str) -> anyhow::Result<hyper::Uri> {
    let endpoint = format!("{}/v1/completions", url.trim_end_matches('/'));
    let uri: hyper::Uri = endpoint
        .parse()
        .with_context(|| format!("--url {url:?} is not a URL"))?;
    anyhow::ensure!(
        uri.scheme_str() == Some("http") && uri.host().is_some(),
        "--url {url:?}: give http://HOST:PORT (no TLS client here)"
    );
    Ok(uri)
}

/// Sends every request at its time and measures the answers; a request taking longer than
/// `timeout` fails.
pub async fn run(
    url: &str,
    model: &str,
    text: bool,
    block_size: usize,
    timeout: Duration,
    requests: Vec<OnlineRequest>,
) -> anyhow::Result<OnlineReport> {
    let endpoint = endpoint(url)?;
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(timeout.min(Duration::from_secs(10))));
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(connector);
    let measured = Arc::new(Mutex::new(Measured::default()));
    let start = Instant::now();
    let n = requests.len() as u64;
    let mut tasks = Vec::with_capacity(requests.len());
    for r in requests {
        let (client, endpoint, measured) =
            (client.clone(), endpoint.clone(), Arc::clone(&measured));
        let model = model.to_owned();
        tasks.push(tokio::spawn(async move {
            let due = start + Duration::from_micros(r.arrival_us);
            tokio::time::sleep_until(due).await;
            // Built after the sleep: a trace's bodies are not all held at once.
            let prompt = if text {
                serde_json::Value::from(text_of(&r.tokens))
            } else {
                serde_json::json!(&*r.tokens)
            };
            let body = serde_json::json!({"model": model, "prompt": prompt, "max_tokens": r.output, "stream": true}).to_string();
            let prompt_len = r.tokens.len() as u64;
            drop(r);
            let sent = Instant::now();
            let failed = |cause: String| {
                let mut m = measured.lock();
                m.failed += 1;
                *m.failures.entry(cause).or_default() += 1;
            };
            let request = hyper::Request::post(endpoint)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body)));
            let Ok(request) = request else {
                return failed("request".into());
            };
            let answer = async {
                let response = match client.request(request).await {
                    Ok(response) => response,
                    Err(e) if e.is_connect() => return Err("connect".to_string()),
                    Err(_) => return Err("request".to_string()),
                };
                if !response.status().is_success() {
                    return Err(format!("status {}", response.status().as_u16()));
                }
                let header = |name: &str| {
                    response
                        .headers()
                        .get(name)
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned)
                };
                let (worker, overlap) =
                    (header("x-kvroute-worker"), header("x-kvroute-overlap"));
                let count = |name| header(name).and_then(|v| v.parse::<u32>().ok());
                let receipt = count("x-kvroute-cached-blocks")
                    .zip(count("x-kvroute-reachable-blocks"))
                    .map(
                        |(cached_blocks, reachable_blocks)| kvroute::scheduler::Receipt {
                            prompt_blocks: (prompt_len / block_size.max(1) as u64) as u32,
                            cached_blocks,
                            reachable_blocks,
                            cost: 0.0,
                        },
                    );
                let mut body = response.into_body();
                let mut meter = StreamMeter::default();
                while let Some(frame) = body.frame().await {
                    let Ok(frame) = frame else {
                        return Err("broken stream".to_string());
                    };
                    if let Some(data) = frame.data_ref() {
                        meter.push(data, Instant::now());
                    }
                }
                Ok((meter, worker, overlap, receipt))
            };
            let (meter, worker, overlap, receipt) =
                match tokio::time::timeout(timeout, answer).await {
                    Err(_) => return failed("timeout".into()),
                    Ok(Err(cause)) => return failed(cause),
                    Ok(Ok(answer)) => answer,
                };
            let done = match meter.outcome() {
                Ok(done) => done,
                Err(cause) => return failed(cause.into()),
            };
            let mut m = measured.lock();
            if let Some(f) = meter.first {
                m.ttft_ms.push(f.duration_since(due).as_secs_f64() * 1e3);
            }
            m.itl_ms.extend(meter.gaps_ms);
            m.e2e_ms.push(done.duration_since(due).as_secs_f64() * 1e3);
            m.send_lag_ms.push(sent.duration_since(due).as_secs_f64() * 1e3);
            m.tokens += meter.tokens;
            m.prompt_tokens += prompt_len;
            if let Some(o) = overlap {
                m.reused_tokens += (cached_blocks(&o) * block_size as u64).min(prompt_len);
            }
            if let Some(w) = worker {
                *m.per_worker.entry(w).or_default() += 1;
            }
            if let Some(r) = receipt {
                m.decisions.record(&r);
            }
            m.last_end = Some(m.last_end.map_or(done, |e| e.max(done)));
        }));
    }
    for t in tasks {
        t.await.context("request task")?;
    }
    let mut m = std::mem::take(&mut *measured.lock());
    let span_s = m
        .last_end
        .map_or(0.0, |e| e.duration_since(start).as_secs_f64());
    let routed: u64 = m.per_worker.values().sum();
    let router = (routed > 0).then(|| RouterView {
        routed,
        reuse_ratio: m.reused_tokens as f64 / m.prompt_tokens.max(1) as f64,
        worker_load_spread: LoadSpread::of(m.per_worker.values().copied().collect()),
        decisions: m.decisions.into(),
    });
    let ttft = Summary::of(&mut m.ttft_ms);
    Ok(OnlineReport {
        url: url.to_owned(),
        model: model.to_owned(),
        trace_format: String::new(),
        speedup: 1.0,
        requests: n,
        failed: m.failed,
        failures: m.failures,
        span_s,
        ttft_ms: ttft,
        itl_ms: Summary::of(&mut m.itl_ms),
        e2e_ms: Summary::of(&mut m.e2e_ms),
        send_lag_ms: Summary::of(&mut m.send_lag_ms),
        throughput_tok_s: m.tokens as f64 / span_s.max(1e-9),
        router,
        ttft_sorted_ms: m.ttft_ms,
    })
}

/// Each record's send time, µs after the first record's, at `speedup`: a trace stamped in
/// Unix milliseconds would otherwise wait decades for its first request.
fn arrivals_us(records: &[trace::TraceRecord], speedup: f64) -> Vec<u64> {
    let first = records.iter().map(|r| r.timestamp).min().unwrap_or(0);
    records
        .iter()
        .map(|r| ((r.timestamp - first) as f64 * 1000.0 / speedup).round() as u64)
        .collect()
}

/// Loads the trace named by `args` and sends it to the endpoint.
pub fn run_trace(args: &Args) -> anyhow::Result<OnlineReport> {
    if args.speedup.is_nan() || args.speedup <= 0.0 {
        anyhow::bail!("--speedup must be positive");
    }
    let loaded = trace::load_any(&args.source, args.seed)?;
    if !loaded.note.is_empty() {
        eprintln!("{}", loaded.note);
    }
    let arrivals = arrivals_us(&loaded.records, args.speedup);
    let requests = loaded
        .records
        .iter()
        .zip(arrivals)
        .map(|(r, arrival_us)| OnlineRequest {
            arrival_us,
            tokens: trace::prompt_tokens(r, args.source.trace_block_size),
            output: r.output_length.max(1) as u32,
        })
        .collect();
    if loaded
        .records
        .iter()
        .any(|r| r.session_id.is_some() || r.think_ms.is_some())
    {
        eprintln!(
            "note: every request is sent at its timestamp; turns of a session are not held back \
             until the one before has finished (the offline replay does that)"
        );
    }
    anyhow::ensure!(
        args.timeout_s.is_finite() && args.timeout_s > 0.0,
        "--timeout-s must be positive"
    );
    let runtime = tokio::runtime::Runtime::new()?;
    let mut report = runtime.block_on(run(
        &args.url,
        &args.model,
        args.text,
        args.block_size,
        Duration::from_secs_f64(args.timeout_s),
        requests,
    ))?;
    report.trace_format = format!("{:?}", loaded.format).to_lowercase();
    report.speedup = args.speedup;
    Ok(report)
}

/// Prints the report.
pub fn print(r: &OnlineReport) {
    println!(
        "online: {} requests to {} ({}), speedup {}, {} failed{}, {:.1} s",
        r.requests,
        r.url,
        r.model,
        r.speedup,
        r.failed,
        if r.failures.is_empty() {
            String::new()
        } else {
            let causes: Vec<String> = r
                .failures
                .iter()
                .map(|(c, n)| format!("{c}: {n}"))
                .collect();
            format!(" ({})", causes.join(", "))
        },
        r.span_s
    );
    println!("| TTFT p50 ms | TTFT p99 ms | TTFT mean ms | ITL p50 ms | E2E p50 ms | tok/s |");
    println!("|---|---|---|---|---|---|");
    if r.failed >= r.requests {
        println!("| n/a | n/a | n/a | n/a | n/a | n/a |  (no request succeeded)");
    } else {
        println!(
            "| {:.1} | {:.1} | {:.1} | {:.1} | {:.0} | {:.0} |",
            r.ttft_ms.p50,
            r.ttft_ms.p99,
            r.ttft_ms.mean,
            r.itl_ms.p50,
            r.e2e_ms.p50,
            r.throughput_tok_s
        );
    }
    if r.failed < r.requests {
        println!(
            "TTFT and E2E from each request's due time; sent late p50 / p99 {:.1} / {:.1} ms",
            r.send_lag_ms.p50, r.send_lag_ms.p99
        );
    }
    match &r.router {
        Some(v) => println!(
            "router headers on {} responses: reuse {:.3}, min/mean requests per worker {:.2}, regret {:.3}",
            v.routed, v.reuse_ratio, v.worker_load_spread.min_over_mean, v.decisions.regret
        ),
        None => println!("no kvroute headers: reuse, load spread and decisions not measured"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Events split across reads or sharing one are cut whole; only events with tokens are
    /// timed (not the role, usage or keep-alive ones); `[DONE]` makes the answer whole and an
    /// error event (as a router sends after a stalled worker) makes it a failure.
    #[test]
    fn streams_are_measured_by_their_token_events() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut m = StreamMeter::default();
        m.push(
            b": keep-alive\n\ndata: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n",
            at(5),
        );
        m.push(b"data: {\"choices\":[{\"text\":\"a\"", at(10));
        m.push(b"}]}\n\ndata: {\"choices\":[{\"text\":\"b\"}]}\n\n", at(30));
        m.push(
            b"data: {\"choices\":[{\"text\":\"cd\",\"token_ids\":[7,8]}]}\r\n\r\n",
            at(50),
        );
        m.push(
            b"data: {\"choices\":[],\"usage\":{\"completion_tokens\":4}}\n\ndata: [DONE]\n\n",
            at(70),
        );
        assert_eq!(
            m.first,
            Some(at(30)),
            "the first token's event completed at 30 ms"
        );
        assert_eq!(m.tokens, 4);
        assert_eq!(m.gaps_ms.len(), 2);
        assert_eq!(m.outcome(), Ok(at(70)));
        let mut cut = StreamMeter::default();
        cut.push(b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n", at(1));
        assert_eq!(cut.outcome(), Err("no [DONE]"));
        cut.push(
            b"data: {\"error\":{\"message\":\"worker stalled\"}}\n\ndata: [DONE]\n\n",
            at(2),
        );
        assert_eq!(cut.outcome(), Err("error event"));
    }

    #[test]
    fn arrivals_count_from_the_first_record() {
        let at = |timestamp: u64| trace::TraceRecord {
            timestamp,
            ..Default::default()
        };
        let records = [at(1_700_000_000_000), at(1_700_000_000_500)];
        assert_eq!(arrivals_us(&records, 2.0), vec![0, 250_000]);
    }

    #[test]
    fn only_http_urls_are_taken() {
        assert!(endpoint("http://127.0.0.1:8080/").is_ok());
        for bad in ["127.0.0.1:8080", "localhost", "https://example.com", ""] {
            assert!(endpoint(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn overlap_header_and_text_prompts() {
        assert_eq!(cached_blocks("device=3;host=2;disk=7"), 5);
        assert_eq!(cached_blocks("garbage"), 0);
        assert_eq!(text_of(&[1, 5001]), "w1 w1 ");
    }
}
