//! The router end to end: nats-server, `kvroute serve` and `kvroute-worker` processes, real
//! HTTP over loopback.
#![allow(missing_docs, clippy::unwrap_used)]

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use kvroute_e2e::fleet::{Fleet, FleetSpec, WorkerSpec, completion};
use kvroute_e2e::procs::{Http, send_raw};

const MODEL: &str = "kvroute-sim";

fn spec(workers: usize, speedup: f64) -> FleetSpec {
    FleetSpec {
        workers: vec![WorkerSpec::model(MODEL); workers],
        speedup,
        ..FleetSpec::default()
    }
}

/// Two workers that take injected faults (`--fault-injection`), behind one router with
/// `router_args`.
fn injectable_pair(router_args: &[&str]) -> FleetSpec {
    let injectable = WorkerSpec {
        model: MODEL.into(),
        args: vec!["--fault-injection".into()],
    };
    FleetSpec {
        router_args: router_args.iter().map(|a| (*a).to_owned()).collect(),
        workers: vec![injectable.clone(), injectable],
        ..FleetSpec::default()
    }
}

fn prompt(group: usize) -> String {
    format!(
        "Group {group:03}: {}",
        "a shared system prompt for this group of requests. ".repeat(12)
    )
}

fn request(group: usize, i: usize, stream: bool) -> String {
    completion(
        MODEL,
        &format!("{} Question {i}.", prompt(group)),
        4,
        stream,
    )
}

/// A router with `router_args` in front of one worker injecting `faults`.
async fn faulty_worker(router_args: &[&str], faults: serde_json::Value) -> Fleet {
    let f = Fleet::start(FleetSpec {
        router_args: router_args.iter().map(|a| a.to_string()).collect(),
        workers: vec![WorkerSpec {
            model: MODEL.into(),
            args: vec!["--fault-injection".into()],
        }],
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    f.faults(0, faults).await.unwrap();
    f
}

/// Starts a streaming request and returns the connection after the response head.
async fn open_stream(f: &Fleet, max_tokens: u32) -> TcpStream {
    let body = completion(MODEL, &prompt(7), max_tokens, true);
    let mut s = send_raw(&f.url(), &body).await.unwrap();
    let mut buf = [0u8; 256];
    let n = s.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    s
}

/// Bodies of 600 KiB at most, 1 MiB of them held at once: two uploads of 512 KiB fill it.
const ONE_MIB_OF_BODIES: &[&str] = &[
    "--max-body-bytes",
    "614400",
    "--max-upstream-body-bytes",
    "1048576",
    "--body-memory-bytes",
    "1048576",
];

/// A raw response read whole: a 200 whose stream reached `[DONE]` without an error event.
fn assert_answered(rest: &str) {
    assert!(rest.starts_with("HTTP/1.1 200"), "{rest}");
    assert!(rest.contains("data: [DONE]"), "{rest}");
    assert!(!rest.contains("error"), "{rest}");
}

/// Reads until `[DONE]`, EOF, or `limit`.
async fn read_rest(s: &mut TcpStream, limit: Duration) -> String {
    let mut rest = String::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => break,
            Ok(Ok(n)) => {
                rest.push_str(&String::from_utf8_lossy(&buf[..n]));
                if rest.contains("data: [DONE]") {
                    break;
                }
            }
        }
    }
    rest
}

async fn all_bookings_closed(f: &Fleet) -> bool {
    for i in 0..f.routers.len() {
        if f.open_bookings(i).await.unwrap_or(u64::MAX) != 0 {
            return false;
        }
    }
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_of_a_group_follow_their_cached_prefix() {
    let f = Fleet::start(spec(4, 50.0)).await.unwrap();
    let mut by_group: Vec<Vec<String>> = vec![Vec::new(); 20];
    for round in 0..10 {
        for (g, seen) in by_group.iter_mut().enumerate() {
            let stream = (g + round) % 2 == 0;
            let r = f
                .http
                .call(
                    "POST",
                    &format!("{}/v1/completions", f.url()),
                    request(g, round, stream),
                )
                .await
                .unwrap();
            assert_eq!(r.status, 200, "{}", r.body);
            if stream {
                assert!(r.body.contains("data: [DONE]"), "{}", r.body);
            } else {
                assert!(r.body.contains("\"completion_tokens\":4"), "{}", r.body);
            }
            let worker = r.header("x-kvroute-worker").unwrap().to_owned();
            let overlap = r.header("x-kvroute-overlap").unwrap().to_owned();
            if round > 0 {
                assert!(
                    !overlap.starts_with("device=0;"),
                    "group {g} round {round} saw no overlap: {overlap}"
                );
            }
            seen.push(worker);
        }
    }
    for (g, workers) in by_group.iter().enumerate() {
        let first = &workers[1];
        let same = workers[1..].iter().filter(|w| *w == first).count();
        assert!(same >= 8, "group {g} scattered over workers: {workers:?}");
    }
    assert!(all_bookings_closed(&f).await, "every booking was freed");
    // Per-worker series (kept by the router itself, so that they can be dropped) sit
    // beside the rest, one `# TYPE` line per metric name.
    let scrape = f.scrape().await.unwrap();
    for series in [
        "kvroute_ttft_seconds_bucket{worker=\"",
        "kvroute_itl_seconds_count{worker=\"",
        "kvroute_e2e_seconds_sum{worker=\"",
        "kvroute_event_blocks_stored_total{worker=\"",
        "kvroute_requests_inflight ",
    ] {
        assert!(scrape.contains(series), "no {series} in\n{scrape}");
    }
    let mut typed = std::collections::BTreeSet::new();
    for name in scrape.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
        assert!(typed.insert(name.to_owned()), "{name} typed twice");
    }
}

/// A prompt longer than the router tokenizes (`--max-tokenize-bytes`) is not tokenized; a
/// kvroute worker, which generates from the router's tokens, cannot take it: 413, counted.
/// Control: a prompt within the limit is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_past_the_tokenize_limit_is_refused_by_a_kvroute_worker() {
    let f = Fleet::start(FleetSpec {
        router_args: vec!["--max-tokenize-bytes".into(), "2048".into()],
        ..spec(1, 50.0)
    })
    .await
    .unwrap();
    let url = format!("{}/v1/completions", f.url());
    let body = |len: usize| {
        serde_json::json!({"model": MODEL, "prompt": "a".repeat(len), "max_tokens": 2}).to_string()
    };
    let long = f.http.call("POST", &url, body(3_000)).await.unwrap();
    assert_eq!(long.status, 413, "{}", long.body);
    assert!(long.body.contains("max_tokenize_bytes"), "{}", long.body);
    let short = f.http.call("POST", &url, body(1_000)).await.unwrap();
    assert_eq!(short.status, 200, "{}", short.body);
    let metrics = f
        .http
        .call("GET", &format!("{}/metrics", f.url()), "")
        .await
        .unwrap();
    assert!(
        metrics.body.contains("kvroute_prompts_untokenized_total 1"),
        "{}",
        metrics.body
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_get_their_status_codes() {
    let f = Fleet::start(spec(1, 50.0)).await.unwrap();
    let url = format!("{}/v1/completions", f.url());
    let bad_json = f.http.call("POST", &url, "{not json").await.unwrap();
    assert_eq!(bad_json.status, 400);
    assert!(bad_json.body.contains("\"type\":\"invalid_request_error\""));
    let missing = f
        .http
        .call("POST", &url, r#"{"model":"kvroute-sim"}"#)
        .await
        .unwrap();
    assert_eq!(missing.status, 400);
    let unknown = f
        .http
        .call("POST", &url, r#"{"model":"other","prompt":"hi"}"#)
        .await
        .unwrap();
    assert_eq!(unknown.status, 404, "{}", unknown.body);
    assert!(unknown.body.contains("model_not_found"), "{}", unknown.body);
    // A known endpoint asked with the wrong method: 405 naming the right one (vLLM's
    // FastAPI answers so); an unknown path: 404.
    let get = f.http.call("GET", &url, "").await.unwrap();
    assert_eq!(get.status, 405, "{}", get.body);
    assert_eq!(get.header("allow"), Some("POST"), "{}", get.body);
    let post = f
        .http
        .call("POST", &format!("{}/v1/models", f.url()), "")
        .await
        .unwrap();
    assert_eq!((post.status, post.header("allow")), (405, Some("GET")));
    let nowhere = f
        .http
        .call("GET", &format!("{}/v1/nowhere", f.url()), "")
        .await
        .unwrap();
    assert_eq!(nowhere.status, 404, "{}", nowhere.body);
    // stream_options without stream: refused by the router, and by the worker's own
    // endpoint, as vLLM refuses it.
    let options =
        r#"{"model":"kvroute-sim","prompt":"hi","stream_options":{"include_usage":true}}"#;
    for base in [f.url(), f.workers[0].url()] {
        let r = f
            .http
            .call("POST", &format!("{base}/v1/completions"), options)
            .await
            .unwrap();
        assert_eq!(r.status, 400, "{base}: {}", r.body);
        assert!(r.body.contains("stream=True"), "{base}: {}", r.body);
    }
    let huge = format!(
        r#"{{"model":"kvroute-sim","prompt":"{}"}}"#,
        "x".repeat(9 << 20)
    );
    let too_large = f.http.call("POST", &url, huge).await.unwrap();
    assert_eq!(too_large.status, 413);
    // The router closes a connection whose body it refused to read; go on with a fresh one.
    let http = Http::default();
    let chat = http
        .call(
            "POST",
            &format!("{}/v1/chat/completions", f.url()),
            r#"{"model":"kvroute-sim","messages":[{"role":"user","content":"hello"}]}"#,
        )
        .await
        .unwrap();
    assert_eq!(chat.status, 200, "{}", chat.body);
    let answer: serde_json::Value = serde_json::from_str(&chat.body).unwrap();
    assert_eq!(answer["object"], "chat.completion", "{}", chat.body);
    assert_eq!(answer["choices"][0]["message"]["role"], "assistant");
    // A chat with an image is routed on the text before it and forwarded; a simulated worker
    // has no vision and says so (an engine would answer it), with or without text before.
    for messages in [
        r#"[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:x"}}]}]"#,
        r#"[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:x"}}]}]"#,
    ] {
        let r = http
            .call(
                "POST",
                &format!("{}/v1/chat/completions", f.url()),
                format!(r#"{{"model":"kvroute-sim","messages":{messages}}}"#),
            )
            .await
            .unwrap();
        assert_eq!(r.status, 400, "{}", r.body);
        assert!(
            r.body.contains("not supported by this engine"),
            "{}",
            r.body
        );
    }
    for (path, status) in [
        ("/health", 200),
        ("/ready", 200),
        ("/nope", 404),
        ("/admin/workers", 404),
    ] {
        let r = http
            .call("GET", &format!("{}{path}", f.url()), "")
            .await
            .unwrap();
        assert_eq!(
            r.status, status,
            "{path}: the admin views live on their own listener"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_loses_no_request_that_had_not_started() {
    let mut f = Fleet::start(spec(3, 50.0)).await.unwrap();
    let url = format!("{}/v1/completions", f.url());
    for g in 0..6 {
        let r = f
            .http
            .call("POST", &url, request(g, 0, false))
            .await
            .unwrap();
        assert_eq!(r.status, 200);
    }
    // Kill one worker without goodbye; requests routed to it before its lease expires must
    // be retried on another worker.
    f.workers[0].proc.kill();
    for g in 0..6 {
        let r = f
            .http
            .call("POST", &url, request(g, 1, false))
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        assert_ne!(
            r.header("x-kvroute-worker"),
            Some(f.workers[0].port.to_string().as_str())
        );
    }
}

/// Clients that go away before the response headers, or during a non-streamed generation,
/// or mid-stream: every booking returns, on this replica and on its peer, without waiting
/// for the 600 s TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bookings_return_on_both_replicas_however_the_client_leaves() {
    let f = Fleet::start(FleetSpec {
        routers: 2,
        workers: vec![WorkerSpec {
            model: MODEL.into(),
            args: vec!["--fault-injection".into()],
        }],
        // Real time: a 5,000-token generation takes minutes.
        speedup: 1.0,
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    // Before the headers: the worker holds every request without answering.
    f.faults(0, serde_json::json!({"stall_before_headers": true}))
        .await
        .unwrap();
    let mut aborted = Vec::new();
    for i in 0..20 {
        aborted.push(
            send_raw(&f.url(), &request(i, 0, i % 2 == 0))
                .await
                .unwrap(),
        );
    }
    let booked = f
        .until(Duration::from_secs(10), || async {
            f.open_bookings(1).await.unwrap_or(0) == 20
        })
        .await;
    assert!(
        booked,
        "the peer replica saw {} of 20 bookings",
        f.open_bookings(1).await.unwrap()
    );
    assert_eq!(f.open_bookings(0).await.unwrap(), 20);
    drop(aborted);
    let freed = f
        .until(Duration::from_secs(10), || all_bookings_closed(&f))
        .await;
    assert!(
        freed,
        "bookings left after 20 clients left before their headers: {} and {}",
        f.open_bookings(0).await.unwrap(),
        f.open_bookings(1).await.unwrap()
    );
    // During a non-streamed generation (5,000 tokens at real time) and mid-stream.
    f.faults(0, serde_json::json!({})).await.unwrap();
    let long = completion(MODEL, &prompt(3), 5000, false);
    let waiting = send_raw(&f.url(), &long).await;
    let mut streaming = open_stream(&f, 5000).await;
    let mut buf = [0u8; 64];
    let _ = streaming.read(&mut buf).await;
    assert!(
        f.until(Duration::from_secs(10), || async {
            f.open_bookings(1).await.unwrap_or(0) == 2
        })
        .await
    );
    drop(waiting);
    drop(streaming);
    let freed = f
        .until(Duration::from_secs(10), || all_bookings_closed(&f))
        .await;
    assert!(freed, "bookings left after clients left mid-generation");
}

/// A worker that answers 429 is skipped for another; one that refuses the request (400)
/// sends the client its error, and the booking is released on the peer replica too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_errors_decide_retries_and_release_bookings_everywhere() {
    let injectable = WorkerSpec {
        model: MODEL.into(),
        args: vec!["--fault-injection".into()],
    };
    let f = Fleet::start(FleetSpec {
        routers: 2,
        workers: vec![injectable.clone(), injectable],
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    f.faults(0, serde_json::json!({"status": 429}))
        .await
        .unwrap();
    let url = format!("{}/v1/completions", f.url());
    for i in 0..10 {
        let r = f
            .http
            .call("POST", &url, request(i, 0, i % 2 == 0))
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(
            r.header("x-kvroute-worker"),
            Some(f.workers[1].port.to_string().as_str())
        );
        if i % 2 == 0 {
            // A stream, not to be buffered by a proxy in front.
            assert_eq!(r.header("content-type"), Some("text/event-stream"));
            assert_eq!(r.header("x-accel-buffering"), Some("no"));
        }
    }
    for w in 0..2 {
        f.faults(w, serde_json::json!({"status": 400}))
            .await
            .unwrap();
    }
    for i in 0..10 {
        let r = f
            .http
            .call("POST", &url, request(i, 1, false))
            .await
            .unwrap();
        assert_eq!(r.status, 400, "{}", r.body);
        // The worker's own error body, as it came (type, code and param kept).
        let body: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(body["error"]["type"], "server_error", "{}", r.body);
        assert_eq!(body["error"]["message"], "fault injected", "{}", r.body);
    }
    let freed = f
        .until(Duration::from_secs(10), || all_bookings_closed(&f))
        .await;
    assert!(
        freed,
        "bookings left on the peer after worker errors: {}",
        f.open_bookings(1).await.unwrap()
    );
}

/// A completions prompt list is split into one request per prompt, routed on its own (the
/// fleet's workers share the batch), and answered as vLLM answers a batch: prompt i's
/// choice at index i, the usage summed; streamed, every prompt's chunks, one usage chunk
/// and one `[DONE]`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_list_is_routed_prompt_by_prompt_and_answered_as_one() {
    let f = Fleet::start(spec(2, 50.0)).await.unwrap();
    let url = format!("{}/v1/completions", f.url());
    let prompts: Vec<String> = (0..4)
        .map(|g| format!("{} Question {g}.", prompt(g)))
        .collect();
    let body = |stream: bool| {
        serde_json::json!({"model": MODEL, "prompt": prompts, "max_tokens": 3, "stream": stream,
                           "stream_options": if stream { serde_json::json!({"include_usage": true}) } else { serde_json::Value::Null }})
        .to_string()
    };
    let r = f.http.call("POST", &url, body(false)).await.unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let answer: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    let indices: Vec<u64> = answer["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["index"].as_u64().unwrap())
        .collect();
    assert_eq!(indices, [0, 1, 2, 3], "{}", r.body);
    assert_eq!(answer["usage"]["completion_tokens"], 12, "{}", r.body);
    let r = f.http.call("POST", &url, body(true)).await.unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let mut seen = std::collections::BTreeSet::new();
    let mut usage = Vec::new();
    for data in r.body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            continue;
        }
        let chunk: serde_json::Value = serde_json::from_str(data).unwrap();
        for c in chunk["choices"].as_array().unwrap() {
            seen.insert(c["index"].as_u64().unwrap());
        }
        if chunk["choices"].as_array().unwrap().is_empty() {
            usage.push(chunk["usage"].clone());
        }
    }
    assert_eq!(
        seen.into_iter().collect::<Vec<_>>(),
        [0, 1, 2, 3],
        "{}",
        r.body
    );
    assert_eq!(r.body.matches("[DONE]").count(), 1, "{}", r.body);
    assert!(r.body.trim_end().ends_with("data: [DONE]"), "{}", r.body);
    assert_eq!(usage.len(), 1, "{}", r.body);
    assert_eq!(usage[0]["completion_tokens"], 12, "{}", r.body);
    let freed = f
        .until(Duration::from_secs(10), || all_bookings_closed(&f))
        .await;
    assert!(freed, "bookings left after a batch");
}

/// A prompt of a streamed batch whose worker stalls mid-stream ends the batch: the client
/// gets the error event and one `[DONE]`, the other prompts are dropped, and every booking
/// is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_failing_mid_stream_ends_its_batch() {
    let f = Fleet::start(injectable_pair(&["--relay-idle-timeout-ms", "1000"]))
        .await
        .unwrap();
    for w in 0..2 {
        f.faults(w, serde_json::json!({"stall_after_first_chunk": true}))
            .await
            .unwrap();
    }
    let prompts: Vec<String> = (0..4)
        .map(|g| format!("{} Question {g}.", prompt(g)))
        .collect();
    let body =
        serde_json::json!({"model": MODEL, "prompt": prompts, "max_tokens": 8, "stream": true});
    let url = format!("{}/v1/completions", f.url());
    let r = f.http.call("POST", &url, body.to_string()).await.unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body.contains("sent no token"), "{}", r.body);
    assert_eq!(r.body.matches("[DONE]").count(), 1, "{}", r.body);
    assert!(r.body.trim_end().ends_with("data: [DONE]"), "{}", r.body);
    let freed = f
        .until(Duration::from_secs(10), || all_bookings_closed(&f))
        .await;
    assert!(freed, "bookings left after a failed batch");
}

/// A non-streamed request has one answer deadline however many workers it is tried on:
/// every worker answers 503 only after 2.5 s of the 4 s, so the retry gets the 1.5 s left
/// and the client is told its answer did not come in time (504), where each retry got a
/// whole deadline and the client the last worker's 503 after 5 s; with less than the retry
/// floor left, the first worker's 503 is the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_share_the_answer_deadline() {
    let f = Fleet::start(injectable_pair(&["--upstream-body-timeout-ms", "4000"]))
        .await
        .unwrap();
    let fail_after = |ms: u64| serde_json::json!({"status": 503, "status_delay_ms": ms});
    for w in 0..2 {
        f.faults(w, fail_after(2500)).await.unwrap();
    }
    let url = format!("{}/v1/completions", f.url());
    let r = f
        .http
        .call("POST", &url, request(0, 0, false))
        .await
        .unwrap();
    assert_eq!(r.status, 504, "{}", r.body);
    assert!(
        r.body.contains("no whole answer within") && r.body.contains("(the request's deadline)"),
        "{}",
        r.body
    );
    // With half a second left, under the retry floor (1 s), nothing is retried: the client
    // gets the worker's 503, not a 504 blaming a worker that had no chance.
    for w in 0..2 {
        f.faults(w, fail_after(3500)).await.unwrap();
    }
    let r = f
        .http
        .call("POST", &url, request(0, 1, false))
        .await
        .unwrap();
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(r.body.contains("fault injected"), "{}", r.body);
    let freed = f
        .until(Duration::from_secs(10), || all_bookings_closed(&f))
        .await;
    assert!(freed, "bookings left after the deadline passed");
}

/// A worker that sends its headers and then nothing must not hold the client's stream or
/// the router's in-flight slot: the relay gives up after its idle timeout. The client has
/// its headers after `--worker-timeout-ms` without a token, and the error event after that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_stalled_after_its_headers_does_not_hold_the_stream() {
    // The first chunk has its own deadline (prefill, the engine's queue).
    let f = faulty_worker(
        &[
            "--relay-idle-timeout-ms",
            "300",
            "--worker-timeout-ms",
            "300",
            "--first-token-timeout-ms",
            "1000",
        ],
        serde_json::json!({"stall_after_headers": true}),
    )
    .await;
    let mut s = open_stream(&f, 8).await;
    let rest = read_rest(&mut s, Duration::from_secs(30)).await;
    assert!(rest.contains("sent no token within"), "{rest}");
    assert!(rest.contains("data: [DONE]"));
    assert!(
        f.until(Duration::from_secs(5), || all_bookings_closed(&f))
            .await
    );
}

/// A stream whose worker fails before its first token has shown its client nothing yet (its
/// headers wait for that token): it is tried on another worker, as a worker failing before
/// its headers is, and the client gets a whole answer; with no worker left, a status (503,
/// or 504 for no token in time), not a 200 with an error inside. A client that leaves while
/// its headers are held frees its booking at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_breaks_before_its_first_token_is_retried_elsewhere() {
    // Round robin: every other request goes to worker 0 first.
    let f = Fleet::start(injectable_pair(&[
        "--policy",
        "round_robin",
        "--first-token-timeout-ms",
        "2000",
    ]))
    .await
    .unwrap();
    let broken = serde_json::json!({"end_after_headers": true});
    for w in 0..2 {
        f.faults(w, broken.clone()).await.unwrap();
    }
    let url = format!("{}/v1/completions", f.url());
    let r = f
        .http
        .call("POST", &url, request(0, 0, true))
        .await
        .unwrap();
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(
        r.body
            .contains("broke off its stream before the first token"),
        "{}",
        r.body
    );
    let failed = |scrape: &str| {
        counter_sum(
            scrape,
            "kvroute_proxy_errors_total",
            "kind=\"stream_failed\"",
        )
    };
    assert_eq!(failed(&f.scrape().await.unwrap()), 2.0);
    // Both hung: no token within the first-token deadline, on either.
    for w in 0..2 {
        f.faults(w, serde_json::json!({"first_chunk_delay_ms": 600000}))
            .await
            .unwrap();
    }
    let r = f
        .http
        .call("POST", &url, request(0, 10, true))
        .await
        .unwrap();
    assert_eq!(r.status, 504, "{}", r.body);
    assert!(
        r.body.contains("sent no token within 2000 ms"),
        "{}",
        r.body
    );
    assert_eq!(failed(&f.scrape().await.unwrap()), 4.0);
    // Worker 0 breaks its streams, worker 1 heals: worker 0's are retried there.
    f.faults(0, broken).await.unwrap();
    f.faults(1, serde_json::json!({})).await.unwrap();
    for i in 1..5 {
        let r = f
            .http
            .call("POST", &url, request(0, i, true))
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(!r.body.contains("error"), "{}", r.body);
        assert!(r.body.contains("data: [DONE]"), "{}", r.body);
    }
    assert!(failed(&f.scrape().await.unwrap()) >= 5.0);
    // Four answers: the attempts handed to another worker are none (the 503 and 504 above
    // had four, the retries here at least one).
    let answers =
        || async { counter_sum(&f.scrape().await.unwrap(), "kvroute_e2e_seconds_count", "") };
    assert!(
        f.until(Duration::from_secs(5), || async { answers().await >= 4.0 })
            .await
    );
    assert_eq!(answers().await, 4.0);
    // Both stall after their headers: the client waits for a token (10 s by default) and
    // leaves before; its booking goes with it.
    for w in 0..2 {
        f.faults(w, serde_json::json!({"stall_after_headers": true}))
            .await
            .unwrap();
    }
    let before = failed(&f.scrape().await.unwrap());
    let waiting = send_raw(&f.url(), &request(0, 9, true)).await.unwrap();
    assert!(one_booking_open(&f).await);
    drop(waiting);
    assert!(
        f.until(Duration::from_secs(5), || all_bookings_closed(&f))
            .await,
        "the booking outlived its client"
    );
    assert_eq!(failed(&f.scrape().await.unwrap()), before);
}

/// A server-sent event over the router's 8 MiB limit (`echo` and logprobs of a long prompt
/// make one) is the router's limit, not the worker failing: the client gets a 502 from the
/// first worker, which is neither tried again elsewhere (where the prefill would run again
/// and fail the same way) nor counted towards its ejection. It was a worker failure,
/// retried on every worker and counted against each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_over_the_router_s_limit_is_not_the_worker_s_failure() {
    let f = Fleet::start(injectable_pair(&["--policy", "round_robin"]))
        .await
        .unwrap();
    let oversized = serde_json::json!({"event_bytes_without_end": (8u64 << 20) + 4096});
    for w in 0..2 {
        f.faults(w, oversized.clone()).await.unwrap();
    }
    let url = format!("{}/v1/completions", f.url());
    let r = f
        .http
        .call("POST", &url, request(0, 0, true))
        .await
        .unwrap();
    assert_eq!(r.status, 502, "{}", r.body);
    let scrape = f.scrape().await.unwrap();
    let ended = |how: &str| {
        counter_sum(
            &scrape,
            "kvroute_relay_ended_total",
            &format!("how=\"{how}\""),
        )
    };
    assert_eq!(ended("event_too_large"), 1.0, "tried once");
    assert_eq!(ended("worker_failed"), 0.0);
    assert_eq!(
        counter_sum(
            &scrape,
            "kvroute_proxy_errors_total",
            "kind=\"stream_failed\""
        ),
        0.0
    );
}

/// A client that leaves before its first token frees its booking at once (not at the
/// first-token deadline, a minute by default), and a prompt the worker never computed is
/// no evidence of a hash mismatch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_before_its_first_token_frees_everything_at_once() {
    // Headers after half a second without a token.
    let f = faulty_worker(
        &["--worker-timeout-ms", "500"],
        serde_json::json!({"stall_after_headers": true}),
    )
    .await;
    let abandoned = open_stream(&f, 8).await;
    assert_eq!(f.open_bookings(0).await.unwrap(), 1);
    drop(abandoned);
    assert!(
        f.until(Duration::from_secs(10), || all_bookings_closed(&f))
            .await,
        "the booking outlived its client"
    );
    // A request the worker answers, on another prompt: once it is judged, so is the
    // abandoned one before it (the alarm judges in order).
    f.faults(0, serde_json::json!({})).await.unwrap();
    let mut s = send_raw(&f.url(), &request(9, 0, true)).await.unwrap();
    let rest = read_rest(&mut s, Duration::from_secs(30)).await;
    assert!(rest.contains("data: [DONE]"), "{rest}");
    let worker = || async { f.admin_workers(0).await.unwrap()["workers"][0].clone() };
    assert!(
        f.until(Duration::from_secs(20), || async {
            worker().await["routed_blocks_seen"].as_u64().unwrap_or(0) >= 1
        })
        .await,
        "never judged: {}",
        worker().await
    );
    let w = worker().await;
    assert_eq!(w["routed_blocks_missing"], 0, "{w}");
}

/// A non-streamed request's prefill is released once its prompt shows up in the worker's
/// KV events, not when the whole answer comes back: a long generation would otherwise keep
/// its worker looking loaded with prefill it finished long before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_streamed_request_s_prefill_is_released_once_computed() {
    let f = Fleet::start(FleetSpec {
        workers: vec![WorkerSpec::model(MODEL)],
        // Real time: a 5,000-token generation takes minutes.
        speedup: 1.0,
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    let long = completion(MODEL, &prompt(4), 5000, false);
    let waiting = send_raw(&f.url(), &long).await.unwrap();
    let worker = || async { f.admin_workers(0).await.unwrap()["workers"][0].clone() };
    let released = f
        .until(Duration::from_secs(20), || async {
            let w = worker().await;
            w["booked_requests"] == 1 && w["booked_prefill_blocks"].as_f64() == Some(0.0)
        })
        .await;
    assert!(released, "prefill still booked: {}", worker().await);
    drop(waiting);
    assert!(
        f.until(Duration::from_secs(10), || all_bookings_closed(&f))
            .await
    );
}

/// A stream's first chunk may come later than the idle timeout between chunks: vLLM sends
/// its headers at once and its first chunk after the prefill and its own queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_token_later_than_the_idle_timeout_is_waited_for() {
    let f = faulty_worker(
        &["--relay-idle-timeout-ms", "300"],
        serde_json::json!({"first_chunk_delay_ms": 1200}),
    )
    .await;
    let mut s = open_stream(&f, 8).await;
    let rest = read_rest(&mut s, Duration::from_secs(30)).await;
    assert!(!rest.contains("error"), "{rest}");
    assert!(rest.contains("\"finish_reason\":\"length\""), "{rest}");
    assert!(rest.contains("data: [DONE]"), "{rest}");
}

/// A proxy in front of an engine that keeps sending comments (`: keep-alive`) after
/// `[DONE]` does not hold the stream: it ends a grace period after `[DONE]`, and its booking
/// and in-flight slot go with it. (The grace restarted at each comment: never.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn comments_after_done_do_not_hold_the_stream() {
    let f = faulty_worker(
        &["--relay-idle-timeout-ms", "300"],
        serde_json::json!({"pings_ms": 50}),
    )
    .await;
    let mut s = open_stream(&f, 8).await;
    let rest = read_rest(&mut s, Duration::from_secs(30)).await;
    assert!(rest.contains("data: [DONE]"), "{rest}");
    assert!(!rest.contains("error"), "{rest}");
    let closed = tokio::time::timeout(Duration::from_secs(30), async {
        while !all_bookings_closed(&f).await {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(
        closed.is_ok(),
        "the stream's booking stayed open after [DONE]"
    );
}

/// A worker hung mid-stream behind a proxy that keeps sending comments is still seen
/// stalled: comments are no token, and the idle timeout runs from the last one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn comments_do_not_keep_a_stalled_stream_alive() {
    let f = faulty_worker(
        &["--relay-idle-timeout-ms", "500"],
        serde_json::json!({"pings_ms": 50, "stall_after_first_chunk": true}),
    )
    .await;
    let mut s = open_stream(&f, 8).await;
    let rest = read_rest(&mut s, Duration::from_secs(15)).await;
    assert!(
        rest.contains("sent no token for 500 ms mid-stream"),
        "{rest}"
    );
}

/// The first token is due `--first-token-timeout-ms` after the headers, not after the
/// request: an engine that took most of its header wait (fetching a prompt's media, say)
/// still has the whole first-token wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_token_is_timed_from_the_headers() {
    let f = faulty_worker(
        &[
            "--worker-timeout-ms",
            "5000",
            "--first-token-timeout-ms",
            "3000",
        ],
        serde_json::json!({"headers_delay_ms": 2000, "first_chunk_delay_ms": 2000}),
    )
    .await;
    let body = completion(MODEL, &prompt(7), 8, true);
    let mut s = send_raw(&f.url(), &body).await.unwrap();
    assert_answered(&read_rest(&mut s, Duration::from_secs(30)).await);
}

/// Comments before the first token are no token: the first-token deadline still runs from
/// the headers, and the stream ends with an error event when it passes (the client has its
/// headers after `--worker-timeout-ms`, and the comments from then on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn comments_before_the_first_token_do_not_extend_its_deadline() {
    let f = faulty_worker(
        &[
            "--first-token-timeout-ms",
            "1000",
            "--worker-timeout-ms",
            "300",
        ],
        serde_json::json!({"pings_ms": 50, "first_chunk_delay_ms": 20000}),
    )
    .await;
    let mut s = open_stream(&f, 8).await;
    let rest = read_rest(&mut s, Duration::from_secs(15)).await;
    assert!(rest.contains("sent no token within 1000 ms"), "{rest}");
    assert!(rest.contains("data: [DONE]"), "{rest}");
}

/// Keep-alive comments while a stream's headers are held (before its first token) are
/// dropped without waiting for room in `--body-memory-bytes`: a budget that stays full for
/// longer than the idle timeout (uploads holding it) does not end the stream with a 429,
/// and its token, once the budget has room again, reaches the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn comments_before_the_first_token_wait_for_no_budget() {
    let args = [
        ONE_MIB_OF_BODIES,
        &[
            "--relay-idle-timeout-ms",
            "1000",
            "--worker-timeout-ms",
            "30000",
        ],
    ]
    .concat();
    let f = faulty_worker(
        &args,
        serde_json::json!({"pings_ms": 50, "first_chunk_delay_ms": 8000}),
    )
    .await;
    let mut s = send_raw(&f.url(), &completion(MODEL, &prompt(7), 8, true))
        .await
        .unwrap();
    assert!(one_booking_open(&f).await);
    // Two uploads take the rest of the budget, to the last grain: the stream's own body is
    // held until its first token (it may be tried on another worker before). Each sends
    // all but the last byte of what it announces (its buffer grows to that length).
    let stream_body = body_bytes_held(&f).await as usize;
    let mut held = Vec::new();
    for length in [512 << 10, (512 << 10) - stream_body] {
        held.push(start_upload(&f, length, &vec![b' '; length - 1]).await);
    }
    assert!(
        bodies_held(&f, |bytes| bytes >= f64::from(1u32 << 20)).await,
        "the uploads never filled the budget: {}",
        body_bytes_held(&f).await
    );
    // Full for more than the idle timeout, with comments arriving all along.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    drop(held);
    assert_answered(&read_rest(&mut s, Duration::from_secs(30)).await);
}

/// A hung engine still answers with headers, then sends nothing: its streams fail at the
/// first-token deadline (within `--worker-timeout-ms`, before the client has its headers,
/// so they are retried on the other worker and every client gets its answer), and after
/// three in a row it sits out like an unreachable worker (it looked healthy and idle
/// before, and kept drawing streams).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_streams_bring_no_token_sits_out() {
    let f = Fleet::start(FleetSpec {
        lease_ttl_ms: 120_000,
        router_args: vec![
            "--eject-ms".into(),
            "600000".into(),
            "--first-token-timeout-ms".into(),
            "1000".into(),
        ],
        workers: vec![
            WorkerSpec {
                model: MODEL.into(),
                args: vec!["--fault-injection".into()],
            },
            WorkerSpec::model(MODEL),
        ],
        ..spec(2, 50.0)
    })
    .await
    .unwrap();
    f.faults(0, serde_json::json!({"first_chunk_delay_ms": 600000}))
        .await
        .unwrap();
    let url = format!("{}/v1/completions", f.url());
    for i in 0..30 {
        let r = f
            .http
            .call("POST", &url, request(i, 8, true))
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(!r.body.contains("error"), "{}", r.body);
        assert!(r.body.contains("data: [DONE]"), "{}", r.body);
    }
    let scrape = f.scrape().await.unwrap();
    let silent = counter_sum(
        &scrape,
        "kvroute_proxy_errors_total",
        "kind=\"stream_failed\"",
    );
    assert!(
        (1.0..=3.0).contains(&silent),
        "{silent} streams went to the hung worker\n{scrape}"
    );
    assert_eq!(
        counter_sum(&scrape, "kvroute_worker_ejections_total", "worker="),
        1.0,
        "{scrape}"
    );
}

/// A worker whose server answers every request with an error status of its own (an engine
/// broken behind a live API server) sits out like an unreachable one: its bookings are
/// released at once, so it reads as idle, and with its cached prefixes it would keep
/// drawing requests, each paying a failed round trip.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_answering_its_own_errors_sits_out() {
    let f = faulty_worker(
        &["--eject-ms", "600000"],
        serde_json::json!({"status": 503}),
    )
    .await;
    expect_status(&f, 4, |i| i % 2 == 0, 503).await;
    assert_ejected(&f).await;
}

/// A hung engine that takes non-streamed requests and never answers (no headers: they come
/// with the last token) sits out once three prompts were not computed by the first-token
/// deadline, though each request waits on for its own answer's deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_computes_no_non_streamed_prompt_sits_out() {
    let f = hung_engine().await;
    three_unanswered(&f).await;
    assert_ejected(&f).await;
}

/// A worker that takes requests and never answers (not even headers), behind a router
/// whose first-token deadline is 0.5 s and answer deadline 3 s.
async fn hung_engine() -> Fleet {
    faulty_worker(
        &[
            "--eject-ms",
            "600000",
            "--first-token-timeout-ms",
            "500",
            "--upstream-body-timeout-ms",
            "3000",
        ],
        serde_json::json!({"stall_before_headers": true}),
    )
    .await
}

/// Three non-streamed requests at once, each waiting out its answer's deadline (504).
/// Prompts of several blocks: their last block is what the router watches for.
async fn three_unanswered(f: &Fleet) {
    let url = format!("{}/v1/completions", f.url());
    let call = |i| f.http.call("POST", &url, request(i, 0, false));
    let (a, b, c) = tokio::join!(call(0), call(1), call(2));
    for r in [a, b, c] {
        let r = r.unwrap();
        assert_eq!(r.status, 504, "{}", r.body);
    }
}

/// While the router cannot hear the worker's events (its NATS link is down), a prompt
/// missing from its index says nothing of the worker: the same three requests that eject
/// a hung engine above eject nobody then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_missing_while_the_router_hears_no_events_blames_no_worker() {
    let mut f = hung_engine().await;
    f.nats[0].kill();
    assert!(
        f.until(Duration::from_secs(20), || async {
            f.scrape()
                .await
                .is_ok_and(|m| gauge(&m, "kvroute_nats_connected") == 0.0)
        })
        .await,
        "the router never saw its NATS link go down"
    );
    three_unanswered(&f).await;
    let scrape = f.scrape().await.unwrap();
    assert_eq!(
        counter_sum(&scrape, "kvroute_worker_ejections_total", "worker="),
        0.0,
        "{scrape}"
    );
}

/// Retries come out of a budget shared by every request: with none (no share of the
/// requests, none a second), a request whose worker fails gets that worker's error, and
/// the other worker, failing too, is not asked as well (a brownout's load not doubled).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_come_out_of_a_budget() {
    let f = Fleet::start(injectable_pair(&[
        "--retry-budget-percent",
        "0",
        "--retry-budget-per-s",
        "0",
    ]))
    .await
    .unwrap();
    for w in 0..2 {
        f.faults(w, serde_json::json!({"status": 503}))
            .await
            .unwrap();
    }
    expect_status(&f, 4, |_| false, 503).await;
    let scrape = f.scrape().await.unwrap();
    assert_eq!(
        counter_sum(
            &scrape,
            "kvroute_proxy_errors_total",
            "kind=\"worker_status\""
        ),
        4.0,
        "one worker asked a request\n{scrape}"
    );
    let refused: f64 = scrape
        .lines()
        .filter_map(|l| l.strip_prefix("kvroute_retries_refused_total "))
        .filter_map(|v| v.trim().parse::<f64>().ok())
        .sum();
    assert_eq!(refused, 4.0, "{scrape}");
}

/// A non-streamed success whose body is not JSON (a proxy's HTML page in front of a
/// failed engine) is the worker's failure: the client gets a 502, not the page as a 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_success_whose_body_is_not_json_is_a_bad_gateway() {
    let f = faulty_worker(&[], serde_json::json!({"html_answer": true})).await;
    let url = format!("{}/v1/completions", f.url());
    let r = f
        .http
        .call("POST", &url, request(0, 0, false))
        .await
        .unwrap();
    assert_eq!(r.status, 502, "{}", r.body);
    assert!(r.body.contains("not JSON"), "{}", r.body);
    let scrape = f.scrape().await.unwrap();
    assert_eq!(
        counter_sum(
            &scrape,
            "kvroute_proxy_errors_total",
            "kind=\"answer_not_json\""
        ),
        1.0,
        "{scrape}"
    );
}

/// Every answer names its request (`x-request-id`): the client's id if it sent one, else a
/// new one; errors too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_name_their_request() {
    let f = Fleet::start(spec(1, 50.0)).await.unwrap();
    let url = format!("{}/v1/completions", f.url());
    let named = f
        .http
        .call_with(
            "POST",
            &url,
            request(0, 0, true),
            &[("x-request-id", "abc-123")],
        )
        .await
        .unwrap();
    assert_eq!(named.status, 200, "{}", named.body);
    assert_eq!(named.header("x-request-id"), Some("abc-123"));
    let unnamed = f
        .http
        .call("POST", &url, request(1, 0, false))
        .await
        .unwrap();
    assert_eq!(unnamed.status, 200, "{}", unnamed.body);
    assert!(
        unnamed
            .header("x-request-id")
            .is_some_and(|id| id.starts_with("req-")),
        "{:?}",
        unnamed.header("x-request-id")
    );
    let refused = f
        .http
        .call_with("POST", &url, "{".to_owned(), &[("x-request-id", "bad-1")])
        .await
        .unwrap();
    assert_eq!(refused.status, 400, "{}", refused.body);
    assert_eq!(refused.header("x-request-id"), Some("bad-1"));
    let wrong_method = f
        .http
        .call_with("GET", &url, "", &[("x-request-id", "get-1")])
        .await
        .unwrap();
    assert_eq!(wrong_method.status, 405, "{}", wrong_method.body);
    assert_eq!(wrong_method.header("x-request-id"), Some("get-1"));
}

/// Half-sent requests (slow-loris) are cut off at the header timeout instead of piling up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_sent_requests_are_cut_off() {
    let f = Fleet::start(FleetSpec {
        router_args: vec!["--header-read-timeout-ms".into(), "1000".into()],
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    let addr = f.url().trim_start_matches("http://").to_owned();
    let mut loris = Vec::new();
    for _ in 0..300 {
        let mut s = TcpStream::connect(&addr).await.unwrap();
        s.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
            .await
            .unwrap();
        loris.push(s);
    }
    let mut closed = 0;
    for s in &mut loris {
        let mut buf = Vec::new();
        // EOF, or the 408 hyper sends before closing.
        if tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut buf))
            .await
            .is_ok()
        {
            closed += 1;
        }
    }
    assert_eq!(closed, 300, "half-sent requests still open");
    let r = Http::default()
        .call(
            "POST",
            &format!("{}/v1/completions", f.url()),
            request(0, 0, false),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200);
}

/// Two models in one cluster: each request goes to a worker serving its model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_models_never_cross() {
    let f = Fleet::start(FleetSpec {
        workers: vec![
            WorkerSpec::model("model-a"),
            WorkerSpec::model("model-b"),
            WorkerSpec::model("model-a"),
            WorkerSpec::model("model-b"),
        ],
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    let port = |i: usize| f.workers[i].port.to_string();
    let a = [port(0), port(2)];
    let b = [port(1), port(3)];
    let url = format!("{}/v1/completions", f.url());
    // The same prompts for both models: the index holds them on both, which must not matter.
    for i in 0..80 {
        let (model, allowed) = if i % 2 == 0 {
            ("model-a", &a)
        } else {
            ("model-b", &b)
        };
        let body = completion(
            model,
            &format!("{} Question {}.", prompt(i % 5), i / 2),
            4,
            i % 3 == 0,
        );
        let r = f.http.call("POST", &url, body).await.unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        let worker = r.header("x-kvroute-worker").unwrap().to_owned();
        assert!(allowed.contains(&worker), "{model} went to worker {worker}");
        if i % 3 != 0 {
            let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
            assert_eq!(v["model"], model);
        }
    }
    // Both are listed, and each can be retrieved by its id (OpenAI's `models.retrieve`).
    let list = f
        .http
        .call("GET", &format!("{}/v1/models", f.url()), "")
        .await
        .unwrap();
    let ids: Vec<String> = serde_json::from_str::<serde_json::Value>(&list.body).unwrap()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids, ["model-a", "model-b"]);
    // SDKs percent-encode the id (`Qwen%2FQwen3-8B`).
    for (id, status) in [
        ("model-a", 200),
        ("model-b", 200),
        ("model%2Db", 200),
        ("model-c", 404),
        ("model%2", 404),
    ] {
        let r = f
            .http
            .call("GET", &format!("{}/v1/models/{id}", f.url()), "")
            .await
            .unwrap();
        assert_eq!(r.status, status, "{id}: {}", r.body);
        if status == 200 {
            let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
            let named = id.replace("%2D", "-");
            assert_eq!(
                (v["id"].as_str(), v["object"].as_str()),
                (Some(named.as_str()), Some("model"))
            );
        } else {
            assert!(r.body.contains("model_not_found"), "{}", r.body);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_over_the_in_flight_limit_get_429() {
    let f = Fleet::start(FleetSpec {
        router_args: vec!["--max-inflight".into(), "1".into()],
        speedup: 1.0,
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    let _long = open_stream(&f, 5000).await;
    let r = f
        .http
        .call(
            "POST",
            &format!("{}/v1/completions", f.url()),
            request(1, 0, false),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.header("retry-after"), Some("1"));
}

/// A router with `router_args` in front of one fast worker.
async fn one_worker(router_args: &[&str]) -> Fleet {
    Fleet::start(FleetSpec {
        router_args: router_args.iter().map(|a| a.to_string()).collect(),
        ..spec(1, 20.0)
    })
    .await
    .unwrap()
}

/// A non-streamed completion of group 1 through the router.
async fn complete(f: &Fleet, i: usize) -> anyhow::Result<kvroute_e2e::procs::Reply> {
    f.http
        .call(
            "POST",
            &format!("{}/v1/completions", f.url()),
            request(1, i, false),
        )
        .await
}

/// The gauge `name`'s value in a scrape (0 if absent).
fn gauge(scrape: &str, name: &str) -> f64 {
    scrape
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// A connection to the router with a completion's head announcing `length` body bytes and
/// the `first` of them sent: an upload under way.
async fn start_upload(f: &Fleet, length: usize, first: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(f.url().trim_start_matches("http://"))
        .await
        .unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {length}\r\n\r\n"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(first).await.unwrap();
    s
}

/// Whether the router comes to hold exactly one booking (a request taken by the worker).
async fn one_booking_open(f: &Fleet) -> bool {
    f.until(Duration::from_secs(5), || async {
        f.open_bookings(0).await.unwrap_or(0) == 1
    })
    .await
}

/// The router's `kvroute_request_body_bytes_held` now.
async fn body_bytes_held(f: &Fleet) -> f64 {
    gauge(
        &f.scrape().await.unwrap(),
        "kvroute_request_body_bytes_held",
    )
}

/// Whether the router's `kvroute_request_body_bytes_held` comes to satisfy `check`.
async fn bodies_held(f: &Fleet, check: impl Fn(f64) -> bool) -> bool {
    f.until(Duration::from_secs(20), || async {
        f.scrape()
            .await
            .is_ok_and(|m| check(gauge(&m, "kvroute_request_body_bytes_held")))
    })
    .await
}

/// Request bodies held at once share `--body-memory-bytes`: with two large bodies on the
/// way holding all of it, a third request gets 429 at once, and requests pass again once
/// the two are gone. Without the budget, in-flight count × body cap bounds nothing useful.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_bodies_share_a_memory_budget() {
    let f = one_worker(ONE_MIB_OF_BODIES).await;
    // Two clients each send all but the last byte of a 512 KiB body and stop: the whole
    // budget (a body's buffer grows to its announced length).
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(start_upload(&f, 512 << 10, &vec![b' '; (512 << 10) - 1]).await);
    }
    assert!(
        bodies_held(&f, |bytes| bytes >= f64::from(1u32 << 20)).await,
        "the two bodies never held the budget"
    );
    let r = complete(&f, 0).await.unwrap();
    assert_eq!(r.status, 429, "{}", r.body);
    assert!(r.body.contains("budget of 1048576 bytes"), "{}", r.body);
    drop(held);
    assert!(
        f.until(Duration::from_secs(20), || async {
            complete(&f, 1).await.is_ok_and(|r| r.status == 200)
        })
        .await,
        "requests were still refused after the bodies were dropped"
    );
    let m = f.scrape().await.unwrap();
    assert_eq!(gauge(&m, "kvroute_request_body_bytes_held"), 0.0, "{m}");
}

/// A client still uploading its body holds no in-flight slot: with `--max-inflight 1` and
/// one slow upload under way, another request is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_upload_holds_no_in_flight_slot() {
    let f = one_worker(&["--max-inflight", "1"]).await;
    let slow = start_upload(&f, 1000, b"{\"model\":").await;
    // Its first bytes are read (they hold a share of the bodies' budget).
    assert!(
        bodies_held(&f, |bytes| bytes > 0.0).await,
        "the slow upload was never read"
    );
    let r = complete(&f, 0).await.unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    drop(slow);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_dying_mid_stream_ends_the_stream_with_an_error_event() {
    let mut f = Fleet::start(spec(1, 1.0)).await.unwrap();
    let mut s = open_stream(&f, 5000).await;
    let mut buf = [0u8; 64];
    let _ = s.read(&mut buf).await;
    f.workers[0].proc.kill();
    let rest = read_rest(&mut s, Duration::from_secs(30)).await;
    assert!(
        rest.contains("failed mid-stream"),
        "stream ended without an error event: {}",
        &rest[rest.len().saturating_sub(400)..]
    );
    assert!(rest.contains("data: [DONE]"));
}

/// With API keys set, the OpenAI endpoints want one; with an admin token, the admin
/// listener wants it; health and readiness stay open for probes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_and_the_admin_token_are_enforced() {
    let f = Fleet::start(FleetSpec {
        env: vec![
            ("KVROUTE_API_KEYS".into(), "key-one,key-two".into()),
            ("KVROUTE_ADMIN_TOKEN".into(), "admin-secret".into()),
        ],
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    let url = format!("{}/v1/completions", f.url());
    let open = f
        .http
        .call("POST", &url, request(0, 0, false))
        .await
        .unwrap();
    assert_eq!(open.status, 401, "{}", open.body);
    assert!(open.body.contains("invalid_api_key"));
    // A refused key's answer names its request too.
    let named = f
        .http
        .call_with(
            "POST",
            &url,
            request(0, 0, false),
            &[("x-request-id", "no-key-1")],
        )
        .await
        .unwrap();
    assert_eq!(named.status, 401, "{}", named.body);
    assert_eq!(named.header("x-request-id"), Some("no-key-1"));
    for (key, status) in [
        ("Bearer key-two", 200),
        ("Bearer key-three", 401),
        ("key-one", 401),
    ] {
        let r = f
            .http
            .call_with(
                "POST",
                &url,
                request(1, 1, false),
                &[("authorization", key)],
            )
            .await
            .unwrap();
        assert_eq!(r.status, status, "{key}: {}", r.body);
    }
    for path in ["/health", "/ready"] {
        let r = f
            .http
            .call("GET", &format!("{}{path}", f.url()), "")
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{path}");
    }
    let admin = format!("{}/admin/workers", f.routers[0].admin());
    assert_eq!(f.http.call("GET", &admin, "").await.unwrap().status, 401);
    let wrong = [("authorization", "Bearer nope")];
    assert_eq!(
        f.http
            .call_with("GET", &admin, "", &wrong)
            .await
            .unwrap()
            .status,
        401
    );
    let right = [("authorization", "Bearer admin-secret")];
    assert_eq!(
        f.http
            .call_with("GET", &admin, "", &right)
            .await
            .unwrap()
            .status,
        200
    );
}

/// A worker sends a non-streamed answer's headers only once it has generated every token:
/// the answer gets `--upstream-body-timeout-ms`, not the headers deadline of a stream
/// (`--worker-timeout-ms`), and is not sent to other workers meanwhile. At speedup 1 the
/// engine's timing model makes 200 tokens take at least 200 decode steps of 5.7 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_streamed_answer_may_take_longer_than_a_streams_headers() {
    let f = Fleet::start(FleetSpec {
        router_args: vec!["--worker-timeout-ms".into(), "300".into()],
        ..spec(2, 1.0)
    })
    .await
    .unwrap();
    let url = format!("{}/v1/completions", f.url());
    let body = completion(MODEL, &prompt(3), 200, false);
    let r = f.http.call("POST", &url, body).await.unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let answer: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(answer["usage"]["completion_tokens"], 200, "{}", r.body);
    let stats = f.scrape().await.unwrap();
    assert!(
        !stats.contains("headers_timeout"),
        "the answer was taken for a late stream: {stats}"
    );
}

/// A request's `cache_salt` (vLLM's) salts its blocks at the router as at the worker: the
/// same prompt reuses under the same salt, and not without it or under another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_salt_keeps_cached_prefixes_apart() {
    let f = Fleet::start(spec(1, 50.0)).await.unwrap();
    let url = format!("{}/v1/completions", f.url());
    let device = |salt: Option<&str>| {
        let mut body = serde_json::json!({"model": MODEL, "prompt": prompt(5), "max_tokens": 2});
        if let Some(salt) = salt {
            body["cache_salt"] = salt.into();
        }
        let (http, url) = (f.http.clone(), url.clone());
        async move {
            let r = http.call("POST", &url, body.to_string()).await.unwrap();
            assert_eq!(r.status, 200, "{}", r.body);
            let overlap = r.header("x-kvroute-overlap").unwrap().to_owned();
            overlap
                .trim_start_matches("device=")
                .split(';')
                .next()
                .unwrap()
                .parse::<u64>()
                .unwrap()
        }
    };
    // Until the worker's events of the salted prompt have reached the router.
    let reused = f
        .until(Duration::from_secs(30), || {
            let answer = device(Some("tenant-a"));
            async move { answer.await > 0 }
        })
        .await;
    assert!(reused, "the salted prompt's own blocks were never credited");
    assert_eq!(
        device(None).await,
        0,
        "unsalted, the salted blocks must not count"
    );
    assert_eq!(
        device(Some("tenant-b")).await,
        0,
        "another salt's blocks must not count"
    );
}

/// Without `--route-headers` an answer says nothing of where it went or what was cached:
/// those headers would let one tenant probe what another's prompts left in the fleet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_headers_are_off_unless_asked_for() {
    let f = Fleet::start(FleetSpec {
        route_headers: false,
        ..spec(2, 50.0)
    })
    .await
    .unwrap();
    for stream in [false, true] {
        let r = f
            .http
            .call_with(
                "POST",
                &format!("{}/v1/completions", f.url()),
                request(0, 1, stream),
                &[("x-kvroute-receipt", "1")],
            )
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        let leaked: Vec<_> = r
            .headers
            .keys()
            .filter(|name| name.as_str().starts_with("x-kvroute"))
            .collect();
        assert!(leaked.is_empty(), "{leaked:?}");
    }
}

/// Keys in `--api-keys-file` are re-read while the router runs: a key revoked there stops
/// working and a key added there starts, without a restart (a Kubernetes Secret's mount
/// updates in place); keys given on the command line stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_in_a_file_are_revoked_and_added_without_a_restart() {
    let dir = std::env::temp_dir().join(format!("kvroute-e2e-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("api-keys");
    std::fs::write(&file, "old-key\n").unwrap();
    let f = Fleet::start(FleetSpec {
        router_args: vec![
            "--api-keys-file".into(),
            file.display().to_string(),
            "--api-keys".into(),
            "fixed-key".into(),
        ],
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    let url = format!("{}/v1/completions", f.url());
    let status = |key: &'static str| {
        let (http, url) = (f.http.clone(), url.clone());
        async move {
            let bearer = format!("Bearer {key}");
            http.call_with(
                "POST",
                &url,
                request(0, 0, false),
                &[("authorization", &bearer)],
            )
            .await
            .unwrap()
            .status
        }
    };
    assert_eq!(status("old-key").await, 200);
    assert_eq!(status("new-key").await, 401);
    // Rotated in place, as a Secret's mount is updated.
    std::fs::write(dir.join("api-keys.tmp"), "\n  new-key  \n").unwrap();
    std::fs::rename(dir.join("api-keys.tmp"), &file).unwrap();
    let rotated = f
        .until(Duration::from_secs(30), || {
            let answer = status("new-key");
            async move { answer.await == 200 }
        })
        .await;
    assert!(rotated, "the key added to the file was never accepted");
    assert_eq!(status("old-key").await, 401, "the revoked key still works");
    assert_eq!(status("fixed-key").await, 200, "a command-line key stays");
    std::fs::remove_dir_all(&dir).ok();
}

/// Sum of a counter's series whose labels contain `label`, from a Prometheus scrape.
/// Sends `n` completions (group `i`, streamed where `stream(i)`), one after another, and
/// asserts each gets `status`.
async fn expect_status(f: &Fleet, n: usize, stream: impl Fn(usize) -> bool, status: u16) {
    let url = format!("{}/v1/completions", f.url());
    for i in 0..n {
        let r = f
            .http
            .call("POST", &url, request(i, 0, stream(i)))
            .await
            .unwrap();
        assert_eq!(r.status, status, "{}", r.body);
    }
}

/// Asserts that the router ejected a worker.
async fn assert_ejected(f: &Fleet) {
    let scrape = f.scrape().await.unwrap();
    assert!(
        counter_sum(&scrape, "kvroute_worker_ejections_total", "worker=") >= 1.0,
        "no worker ejected\n{scrape}"
    );
}

fn counter_sum(scrape: &str, name: &str, label: &str) -> f64 {
    scrape
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A worker that still holds its lease but cannot be reached (killed without goodbye:
/// connections refused) sits out after three failed requests in a row, instead of costing
/// every request a failed attempt until its lease expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_worker_sits_out_after_three_failures() {
    let mut f = Fleet::start(FleetSpec {
        lease_ttl_ms: 120_000,
        router_args: vec!["--eject-ms".into(), "600000".into()],
        ..spec(2, 50.0)
    })
    .await
    .unwrap();
    f.workers[0].proc.kill();
    let url = format!("{}/v1/completions", f.url());
    for i in 0..30 {
        let r = f
            .http
            .call("POST", &url, request(i, 0, false))
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let scrape = f.scrape().await.unwrap();
    let failed = counter_sum(&scrape, "kvroute_proxy_errors_total", "kind=\"connect\"");
    assert!(
        (1.0..=3.0).contains(&failed),
        "{failed} requests tried the dead worker"
    );
    assert_eq!(
        counter_sum(&scrape, "kvroute_worker_ejections_total", "worker="),
        1.0,
        "{scrape}"
    );
}

/// A kvroute worker's generate body (the prompt's token ids as JSON, several times the
/// client's body) counts in `--body-memory-bytes` while the request holds it; it was
/// written for every request, engines' too, and counted nowhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kvroute_worker_s_generate_body_counts_in_the_memory_budget() {
    let f = faulty_worker(&[], serde_json::json!({"first_chunk_delay_ms": 8000})).await;
    let body = completion(MODEL, &"w ".repeat(2_000), 8, true);
    let mut s = send_raw(&f.url(), &body).await.unwrap();
    assert!(one_booking_open(&f).await);
    // 4,000 tokens of "119,32," against a 4 KB body.
    let held = body_bytes_held(&f).await;
    assert!(
        held >= 2.5 * body.len() as f64,
        "{held} bytes held for a body of {}",
        body.len()
    );
    assert_answered(&read_rest(&mut s, Duration::from_secs(30)).await);
    assert!(bodies_held(&f, |bytes| bytes == 0.0).await);
}

/// `/admin/explain` names the worker a decision would take: not one sitting out an
/// ejection while another serves, though its cached prefix makes it the cheapest (it was
/// named, where no request would go).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_picks_no_worker_sitting_out() {
    let f = Fleet::start(injectable_pair(&["--eject-ms", "600000", "--retries", "0"]))
        .await
        .unwrap();
    let url = format!("{}/v1/completions", f.url());
    let r = f
        .http
        .call("POST", &url, request(5, 0, false))
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let home: u16 = r.header("x-kvroute-worker").unwrap().parse().unwrap();
    let i = f.workers.iter().position(|w| w.port == home).unwrap();
    f.faults(i, serde_json::json!({"status": 503}))
        .await
        .unwrap();
    // Its cached prefix draws the group's requests: each fails there (no retry) and counts.
    assert!(
        f.until(Duration::from_secs(30), || async {
            let _ = f.http.call("POST", &url, request(5, 1, false)).await;
            f.scrape()
                .await
                .is_ok_and(|m| counter_sum(&m, "kvroute_worker_ejections_total", "worker=") >= 1.0)
        })
        .await,
        "the failing worker was never ejected"
    );
    let admin = f.routers[0].admin();
    let r = f
        .http
        .call(
            "POST",
            &format!("{admin}/admin/explain"),
            request(5, 2, false),
        )
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    let rows = v["candidates"].as_array().unwrap();
    let row = |id: u16| rows.iter().find(|c| c["worker"] == id).unwrap();
    assert_eq!(row(home)["sitting_out"], true, "{}", r.body);
    assert!(
        row(home)["cached_blocks"].as_u64() > Some(0),
        "the test needs the prefix cached there: {}",
        r.body
    );
    let other = f.workers.iter().find(|w| w.port != home).unwrap().port;
    assert_eq!(
        v["would_pick"].as_u64(),
        Some(u64::from(other)),
        "{}",
        r.body
    );
}

/// A request's headers count in `--body-memory-bytes` with its body: they are kept with it
/// (through the queue too), up to 64 KiB a request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_s_headers_count_in_the_memory_budget() {
    let f = faulty_worker(&[], serde_json::json!({"first_chunk_delay_ms": 8000})).await;
    let body = completion(MODEL, "hi", 8, true);
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-padding: {}\r\ncontent-length: {}\r\n\r\n",
        "p".repeat(40_000),
        body.len()
    );
    let mut s = TcpStream::connect(f.url().trim_start_matches("http://"))
        .await
        .unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body.as_bytes()).await.unwrap();
    assert!(one_booking_open(&f).await);
    let held = body_bytes_held(&f).await;
    assert!(held >= 40_000.0, "{held} bytes held for 40 KB of headers");
    drop(s);
    assert!(bodies_held(&f, |bytes| bytes == 0.0).await);
}
