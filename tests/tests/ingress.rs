//! The router end to end: nats-server, `kvroute serve` and `kvroute-worker` processes, real
//! HTTP over loopback.
#![allow(missing_docs, clippy::unwrap_used)]

use std::time::Duration;

use kvroute_e2e::nats::NatsServer;
use kvroute_e2e::procs::{Http, Proc, free_port};

struct Fleet {
    _nats: NatsServer,
    _router: Proc,
    workers: Vec<(u16, Proc)>,
    url: String,
    http: Http,
}

async fn fleet(workers: usize) -> Fleet {
    fleet_at(workers, 50).await
}

async fn fleet_at(workers: usize, speedup: u32) -> Fleet {
    fleet_with(workers, speedup, &[]).await
}

async fn fleet_with(workers: usize, speedup: u32, router_args: &[&str]) -> Fleet {
    let nats = NatsServer::start().unwrap();
    let port = free_port();
    let mut args: Vec<String> = ["serve", "--nats", &nats.url(), "--port", &port.to_string()]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend(["--host", "127.0.0.1", "--lease-ttl-ms", "1500"].map(String::from));
    args.extend(router_args.iter().map(|s| s.to_string()));
    let router = Proc::start("kvroute", &args).unwrap();
    let mut procs = Vec::new();
    for _ in 0..workers {
        let p = free_port();
        let args = [
            "--nats".into(),
            nats.url(),
            "--port".into(),
            p.to_string(),
            "--id".into(),
            p.to_string(),
            "--speedup".into(),
            speedup.to_string(),
            "--heartbeat-ms".into(),
            "300".into(),
            "--lease-ttl-ms".into(),
            "1500".into(),
        ];
        procs.push((p, Proc::start("kvroute-worker", &args).unwrap()));
    }
    let f = Fleet {
        _nats: nats,
        _router: router,
        workers: procs,
        url: format!("http://127.0.0.1:{port}"),
        http: Http::default(),
    };
    // Ready once every worker is registered and synced.
    for _ in 0..200 {
        if let Ok(r) = f
            .http
            .call("GET", &format!("{}/admin/workers", f.url), "")
            .await
            && r.body.matches("\"synced\":true").count() == workers
        {
            return f;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("fleet not ready");
}

fn prompt(group: usize) -> String {
    format!(
        "Group {group:03}: {}",
        "a shared system prompt for this group of requests. ".repeat(12)
    )
}

fn completion(group: usize, i: usize, stream: bool) -> String {
    serde_json::json!({"model": "kvroute-sim", "prompt": format!("{} Question {i}.", prompt(group)), "max_tokens": 4, "stream": stream}).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_of_a_group_follow_their_cached_prefix() {
    let f = fleet(4).await;
    let mut by_group: Vec<Vec<String>> = vec![Vec::new(); 20];
    for round in 0..10 {
        for (g, seen) in by_group.iter_mut().enumerate() {
            let stream = (g + round) % 2 == 0;
            let r = f
                .http
                .call(
                    "POST",
                    &format!("{}/v1/completions", f.url),
                    completion(g, round, stream),
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
    // Every booking was freed.
    let admin = f
        .http
        .call("GET", &format!("{}/admin/workers", f.url), "")
        .await
        .unwrap();
    assert_eq!(
        admin.body.matches("\"booked_requests\":0").count(),
        4,
        "{}",
        admin.body
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_get_their_status_codes() {
    let f = fleet(1).await;
    let url = format!("{}/v1/completions", f.url);
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
    assert_eq!(unknown.status, 400);
    let huge = format!(
        r#"{{"model":"kvroute-sim","prompt":"{}"}}"#,
        "x".repeat(9 << 20)
    );
    let too_large = f.http.call("POST", &url, huge).await.unwrap();
    assert_eq!(too_large.status, 413);
    // The router closes a connection whose body it refused to read; go on with a fresh one.
    let f = Fleet {
        http: Http::default(),
        ..f
    };
    let chat = f
        .http
        .call(
            "POST",
            &format!("{}/v1/chat/completions", f.url),
            r#"{"model":"kvroute-sim","messages":[{"role":"user","content":"hello"}]}"#,
        )
        .await
        .unwrap();
    assert_eq!(chat.status, 200, "{}", chat.body);
    let answer: serde_json::Value = serde_json::from_str(&chat.body).unwrap();
    assert_eq!(answer["object"], "chat.completion", "{}", chat.body);
    assert_eq!(answer["choices"][0]["message"]["role"], "assistant");
    assert_eq!(
        f.http
            .call("GET", &format!("{}/health", f.url), "")
            .await
            .unwrap()
            .status,
        200
    );
    assert_eq!(
        f.http
            .call("GET", &format!("{}/ready", f.url), "")
            .await
            .unwrap()
            .status,
        200
    );
    assert_eq!(
        f.http
            .call("GET", &format!("{}/nope", f.url), "")
            .await
            .unwrap()
            .status,
        404
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_loses_no_request_that_had_not_started() {
    let mut f = fleet(3).await;
    let url = format!("{}/v1/completions", f.url);
    for g in 0..6 {
        assert_eq!(
            f.http
                .call("POST", &url, completion(g, 0, false))
                .await
                .unwrap()
                .status,
            200
        );
    }
    // Kill one worker without goodbye; requests routed to it before its lease expires must
    // be retried on another worker.
    f.workers[0].1.kill();
    for g in 0..6 {
        let r = f
            .http
            .call("POST", &url, completion(g, 1, false))
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        assert_ne!(
            r.header("x-kvroute-worker"),
            Some(f.workers[0].0.to_string().as_str())
        );
    }
}

async fn booked_requests(f: &Fleet) -> usize {
    let admin = f
        .http
        .call("GET", &format!("{}/admin/workers", f.url), "")
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(&admin.body).unwrap();
    v["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["booked_requests"].as_u64().unwrap() as usize)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_frees_its_booking() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // Real-time engine: 5,000 tokens would take half a minute.
    let f = fleet_at(1, 1).await;
    let body = serde_json::json!({"model": "kvroute-sim", "prompt": prompt(0), "max_tokens": 5000, "stream": true}).to_string();
    let addr = f.url.trim_start_matches("http://").to_owned();
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = [0u8; 512];
    let n = s.read(&mut buf).await.unwrap();
    assert!(n > 0 && String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    assert_eq!(booked_requests(&f).await, 1);
    drop(s);
    let mut freed = false;
    for _ in 0..100 {
        if booked_requests(&f).await == 0 {
            freed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(freed, "the booking of a disconnected client must be freed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_first_bytes_are_not_delayed_on_a_reused_connection() {
    use http_body_util::{BodyExt, Full};
    use hyper_util::client::legacy::Client;
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::rt::TokioExecutor;
    // Engine 1000× faster than real time: the first byte is all router and worker overhead.
    let f = fleet_at(1, 1000).await;
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<_, Full<bytes::Bytes>> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1)
        .build(connector);
    let body = serde_json::json!({"model": "kvroute-sim", "prompt": prompt(1), "max_tokens": 8, "stream": true}).to_string();
    let mut first_bytes = Vec::new();
    for _ in 0..21 {
        let req = hyper::Request::post(format!("{}/v1/completions", f.url))
            .body(Full::new(bytes::Bytes::from(body.clone())))
            .unwrap();
        let started = std::time::Instant::now();
        let resp = client.request(req).await.unwrap();
        let mut body = resp.into_body();
        let _first = body.frame().await.unwrap().unwrap();
        first_bytes.push(started.elapsed());
        while body.frame().await.is_some() {}
    }
    first_bytes.sort();
    let median = first_bytes[first_bytes.len() / 2];
    // Nagle's algorithm with delayed ACKs stalls a small write on a reused connection by
    // ~40 ms; the median must stay well below that.
    assert!(
        median < Duration::from_millis(30),
        "median first byte {median:?} ({first_bytes:?})"
    );
}

/// Starts a streaming request on a raw connection and returns it after the response head.
async fn open_stream(f: &Fleet, max_tokens: u32) -> tokio::net::TcpStream {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let body = serde_json::json!({"model": "kvroute-sim", "prompt": prompt(7), "max_tokens": max_tokens, "stream": true}).to_string();
    let mut s = tokio::net::TcpStream::connect(f.url.trim_start_matches("http://"))
        .await
        .unwrap();
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = [0u8; 256];
    let n = s.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_over_the_in_flight_limit_get_429() {
    let f = fleet_with(1, 1, &["--max-inflight", "1"]).await;
    let _long = open_stream(&f, 5000).await;
    let r = f
        .http
        .call(
            "POST",
            &format!("{}/v1/completions", f.url),
            completion(1, 0, false),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 429, "{}", r.body);
    assert_eq!(r.header("retry-after"), Some("1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_dying_mid_stream_ends_the_stream_with_an_error_event() {
    use tokio::io::AsyncReadExt;
    let mut f = fleet_at(1, 1).await;
    let mut s = open_stream(&f, 5000).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    f.workers[0].1.kill();
    let mut rest = String::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
            .await
            .unwrap()
        {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                rest.push_str(&String::from_utf8_lossy(&buf[..n]));
                if rest.contains("data: [DONE]") {
                    break;
                }
            }
        }
    }
    assert!(
        rest.contains("worker failed mid-stream"),
        "stream ended without an error event: {}",
        &rest[rest.len().saturating_sub(400)..]
    );
    assert!(rest.contains("data: [DONE]"));
}
