//! `kvroute-bench replay --online --url URL`: the trace's requests sent at their timestamps
//! (divided by `--speedup`) to any OpenAI-compatible endpoint, streamed, and measured at the
//! client: TTFT, ITL, E2E, throughput, and (from kvroute's `x-kvroute-worker` /
//! `x-kvroute-overlap` headers, when present) reuse and load spread, and (from
//! `x-kvroute-cached-blocks` / `x-kvroute-reachable-blocks`) the decision-quality totals the
//! offline replay reports.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use parking_lot::Mutex;
use tokio::time::Instant;

use crate::replay::{LoadSpread, PolicyResult};
use crate::stats::Summary;

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
    chunks: u64,
    reused_tokens: u64,
    prompt_tokens: u64,
    failed: u64,
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

/// Sends every request at its time and measures the answers.
pub async fn run(
    url: &str,
    model: &str,
    text: bool,
    block_size: usize,
    requests: Vec<OnlineRequest>,
) -> anyhow::Result<PolicyResult> {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(connector);
    let endpoint = format!("{}/v1/completions", url.trim_end_matches('/'));
    let measured = Arc::new(Mutex::new(Measured::default()));
    let wall = std::time::Instant::now();
    let start = Instant::now();
    let n = requests.len() as u64;
    let mut tasks = Vec::with_capacity(requests.len());
    for r in requests {
        let prompt = if text {
            serde_json::Value::from(text_of(&r.tokens))
        } else {
            serde_json::json!(&*r.tokens)
        };
        let body = serde_json::json!({"model": model, "prompt": prompt, "max_tokens": r.output, "stream": true}).to_string();
        let (client, endpoint, measured) =
            (client.clone(), endpoint.clone(), Arc::clone(&measured));
        let prompt_len = r.tokens.len() as u64;
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(start + Duration::from_micros(r.arrival_us)).await;
            let sent = Instant::now();
            let request = hyper::Request::post(&endpoint)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body)))
                .expect("invariant: static request parts are valid");
            let Ok(response) = client.request(request).await else {
                measured.lock().failed += 1;
                return;
            };
            if !response.status().is_success() {
                measured.lock().failed += 1;
                return;
            }
            let header = |name: &str| {
                response
                    .headers()
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned)
            };
            let (worker, overlap) = (header("x-kvroute-worker"), header("x-kvroute-overlap"));
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
            let (mut first, mut last, mut gaps, mut chunks) = (None, sent, Vec::new(), 0u64);
            while let Some(frame) = body.frame().await {
                let Ok(frame) = frame else { break };
                if frame.data_ref().is_none_or(|d| d.is_empty()) {
                    continue;
                }
                let now = Instant::now();
                if first.is_none() {
                    first = Some(now);
                } else {
                    gaps.push(now.duration_since(last).as_secs_f64() * 1e3);
                }
                last = now;
                chunks += 1;
            }
            let mut m = measured.lock();
            if let Some(f) = first {
                m.ttft_ms.push(f.duration_since(sent).as_secs_f64() * 1e3);
            }
            m.itl_ms.extend(gaps);
            m.e2e_ms.push(last.duration_since(sent).as_secs_f64() * 1e3);
            m.chunks += chunks;
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
            m.last_end = Some(m.last_end.map_or(last, |e| e.max(last)));
        }));
    }
    for t in tasks {
        t.await.context("request task")?;
    }
    let mut m = std::mem::take(&mut *measured.lock());
    let virtual_s = m
        .last_end
        .map_or(0.0, |e| e.duration_since(start).as_secs_f64());
    let requests: Vec<u64> = m.per_worker.values().copied().collect();
    let mean = requests.iter().sum::<u64>() as f64 / requests.len().max(1) as f64;
    let ttft = Summary::of(&mut m.ttft_ms);
    Ok(PolicyResult {
        policy: format!("online:{url}"),
        requests: n,
        wall_s: wall.elapsed().as_secs_f64(),
        virtual_s,
        ttft_ms: ttft,
        itl_ms: Summary::of(&mut m.itl_ms),
        e2e_ms: Summary::of(&mut m.e2e_ms),
        // Every streamed chunk but the final one carries a token.
        throughput_tok_s: m.chunks.saturating_sub(n) as f64 / virtual_s.max(1e-9),
        reuse_ratio: m.reused_tokens as f64 / m.prompt_tokens.max(1) as f64,
        g2_reuse_ratio: 0.0,
        assignment_reuse_ratio: 0.0,
        worker_load_spread: LoadSpread {
            min_over_mean: requests.iter().copied().min().unwrap_or(0) as f64 / mean.max(1e-9),
            max_over_mean: requests.iter().copied().max().unwrap_or(0) as f64 / mean.max(1e-9),
            requests,
        },
        rejected: m.failed,
        decisions: m.decisions.into(),
        ttft_sorted_ms: m.ttft_ms,
        ..PolicyResult::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_header_and_text_prompts() {
        assert_eq!(cached_blocks("device=3;host=2;disk=7"), 5);
        assert_eq!(cached_blocks("garbage"), 0);
        assert_eq!(text_of(&[1, 5001]), "w1 w1 ");
    }
}
