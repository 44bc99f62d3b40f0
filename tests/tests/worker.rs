//! The worker process's life: SIGTERM (deregister, drain, exit 0), an engine failure
//! (deregister, exit non-zero), a stable id, and logs a collector can read.
#![allow(missing_docs, clippy::unwrap_used)]

use std::time::Duration;

use kvroute_e2e::fleet::{Fleet, FleetSpec, WorkerSpec, completion};
use kvroute_e2e::procs::Proc;

fn injectable(n: usize) -> Vec<WorkerSpec> {
    vec![
        WorkerSpec {
            model: "kvroute-sim".into(),
            args: vec!["--fault-injection".into()],
        };
        n
    ]
}

async fn registered(f: &Fleet, port: u16) -> bool {
    let v = f.admin_workers(0).await.unwrap();
    v["workers"]
        .as_array()
        .unwrap()
        .iter()
        .any(|w| w["id"] == port)
}

/// Sends worker `i` SIGTERM and waits (up to 10 s) until the router no longer lists it: its
/// goodbye, not its lease (the tests' is 60 s).
async fn terminate_until_gone(f: &Fleet, i: usize) {
    let port = f.workers[i].port;
    f.workers[i].proc.terminate().unwrap();
    let gone = f
        .until(Duration::from_secs(10), || async {
            !registered(f, port).await
        })
        .await;
    assert!(
        gone,
        "a terminated worker stays registered until its 60 s lease lapses"
    );
}

/// SIGTERM: the worker leaves the fleet at once (no waiting for its lease), finishes the
/// stream it is serving, and exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_deregisters_drains_and_exits_zero() {
    let mut f = Fleet::start(FleetSpec {
        workers: vec![WorkerSpec::model("kvroute-sim"); 2],
        speedup: 1.0,
        // A lease long enough that only a goodbye can explain a quick removal.
        lease_ttl_ms: 60_000,
        heartbeat_ms: 1_000,
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    // A stream in flight on worker 0 (sent to it directly: the router would pick either),
    // its first event read before the SIGTERM.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let body = serde_json::json!({"token_ids": (0..64).collect::<Vec<u32>>(), "max_tokens": 40, "stream": true})
        .to_string();
    let mut stream =
        tokio::net::TcpStream::connect(f.workers[0].url().trim_start_matches("http://"))
            .await
            .unwrap();
    stream
        .write_all(
            format!(
                "POST /internal/generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let mut reply = Vec::new();
    let first_event = async {
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&reply).contains("data:") {
            let n = stream.read(&mut buf).await.unwrap();
            assert!(n > 0, "the stream ended before its first event");
            reply.extend_from_slice(&buf[..n]);
        }
    };
    tokio::time::timeout(Duration::from_secs(30), first_event)
        .await
        .expect("no first event within 30 s");
    terminate_until_gone(&f, 0).await;
    let status = f.workers[0]
        .proc
        .wait_timeout(Duration::from_secs(30))
        .expect("the worker did not exit after SIGTERM");
    assert!(status.success(), "{status:?}");
    tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut reply))
        .await
        .expect("the stream did not end")
        .unwrap();
    let reply = String::from_utf8_lossy(&reply);
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(
        reply.contains("data: [DONE]"),
        "the stream in flight was cut"
    );
    assert!(!reply.contains("cut off"), "{reply}");
    // Requests keep working on the other worker.
    for i in 0..5 {
        let r = f
            .http
            .call(
                "POST",
                &format!("{}/v1/completions", f.url()),
                completion("kvroute-sim", &format!("after {i}"), 2, false),
            )
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
    }
}

/// SIGTERM while a request's body is still arriving (not yet a request being served): the
/// worker waits for its connection within the drain deadline, answers it, then exits 0.
/// (It waited only for requests being served, and exited under the upload.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_answers_a_request_still_uploading() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut f = Fleet::start(FleetSpec {
        workers: vec![WorkerSpec::model("kvroute-sim")],
        lease_ttl_ms: 60_000,
        heartbeat_ms: 1_000,
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    let body = serde_json::json!({"token_ids": (0..64).collect::<Vec<u32>>(), "max_tokens": 4})
        .to_string();
    let (first, rest) = body.as_bytes().split_at(body.len() / 2);
    let url = f.workers[0].url();
    let mut s = tokio::net::TcpStream::connect(url.trim_start_matches("http://"))
        .await
        .unwrap();
    let head = format!(
        "POST /internal/generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(first).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    terminate_until_gone(&f, 0).await;
    s.write_all(rest).await.unwrap();
    let mut answer = String::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), s.read_to_string(&mut answer)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer:?}");
    let status = f.workers[0]
        .proc
        .wait_timeout(Duration::from_secs(30))
        .expect("the worker did not exit after SIGTERM");
    assert!(status.success(), "{status:?}");
}

/// An engine that fails takes its worker out of the fleet and the process exits non-zero:
/// never a registered zombie.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_failure_deregisters_and_exits_non_zero() {
    let mut workers = injectable(1);
    // Long enough to look at it deregistered, short for the test.
    workers[0]
        .args
        .extend(["--failure-linger-ms".into(), "8000".into()]);
    let mut f = Fleet::start(FleetSpec {
        workers,
        lease_ttl_ms: 60_000,
        heartbeat_ms: 1_000,
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    let port = f.workers[0].port;
    f.faults(0, serde_json::json!({"fail_engine": true}))
        .await
        .unwrap();
    assert!(
        f.until(Duration::from_secs(10), || async {
            !registered(&f, port).await
        })
        .await,
        "the failed worker is still registered"
    );
    // Deregistered, and its metrics still answer for a scrape to record the failure.
    let metrics = f
        .http
        .call("GET", &format!("{}/metrics", f.workers[0].url()), "")
        .await
        .unwrap();
    assert_eq!(metrics.status, 200);
    let status = f.workers[0]
        .proc
        .wait_timeout(Duration::from_secs(30))
        .expect("the worker kept running with a failed engine");
    assert!(!status.success(), "{status:?}");
}

/// Without `--id`, a worker's id comes from its host name and port: a restart keeps it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_id_survives_a_restart() {
    let f = Fleet::start(FleetSpec {
        workers: Vec::new(),
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    let port = kvroute_e2e::procs::free_port();
    let args: Vec<String> = [
        "--nats",
        &f.nats_url(),
        "--port",
        &port.to_string(),
        "--registry-replicas",
        "1",
        "--heartbeat-ms",
        "300",
        "--lease-ttl-ms",
        "1500",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut ids = Vec::new();
    for _ in 0..2 {
        let mut w = Proc::start("kvroute-worker", &args).unwrap();
        let found = f
            .until(Duration::from_secs(10), || async {
                f.admin_workers(0).await.unwrap()["workers"]
                    .as_array()
                    .is_some_and(|a| a.len() == 1)
            })
            .await;
        assert!(found);
        let v = f.admin_workers(0).await.unwrap();
        ids.push(v["workers"][0]["id"].as_u64().unwrap());
        w.terminate().unwrap();
        assert!(w.wait_timeout(Duration::from_secs(30)).is_some());
        assert!(
            f.until(Duration::from_secs(10), || async {
                f.admin_workers(0).await.unwrap()["workers"]
                    .as_array()
                    .is_some_and(|a| a.is_empty())
            })
            .await
        );
    }
    assert_eq!(ids[0], ids[1], "the id changed across a restart");
}

/// Logs written to a file carry no terminal colour codes; `--log-format json` writes one
/// JSON object a line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_are_plain_text_or_json_off_a_terminal() {
    let dir = std::env::temp_dir().join(format!("kvroute-logs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = Fleet::start(FleetSpec {
        workers: Vec::new(),
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    for format in ["text", "json"] {
        let log = dir.join(format!("worker-{format}.log"));
        let port = kvroute_e2e::procs::free_port();
        let args: Vec<String> = [
            "--nats",
            &f.nats_url(),
            "--port",
            &port.to_string(),
            "--registry-replicas",
            "1",
            "--log-format",
            format,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let mut w = Proc::start_logged("kvroute-worker", &args, &log).unwrap();
        assert!(
            f.until(Duration::from_secs(10), || async {
                std::fs::read_to_string(&log).is_ok_and(|t| t.contains("worker serving"))
            })
            .await,
            "no log line"
        );
        w.terminate().unwrap();
        w.wait_timeout(Duration::from_secs(30));
        let text = std::fs::read_to_string(&log).unwrap();
        assert!(
            !text.contains('\u{1b}'),
            "escape codes in a {format} log file: {text:?}"
        );
        if format == "json" {
            for line in text.lines().filter(|l| !l.trim().is_empty()) {
                let v: serde_json::Value =
                    serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
                assert!(v["level"].is_string() && v["fields"].is_object(), "{line}");
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A worker started with `--api-key` refuses everything but its probes without the key,
/// `/internal/generate` (the router's path to it) and `/admin/cache` included: vLLM's
/// `--api-key` guards `/v1/*` only, which left this worker generating for anyone. A router
/// given the key (`--engine-api-key`) is served; one without it answers 503 naming the
/// worker's 401.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_an_api_key_serves_only_a_router_that_has_it() {
    let mut f = Fleet::start(FleetSpec {
        router_args: vec!["--engine-api-key".into(), "worker-secret".into()],
        workers: vec![WorkerSpec {
            model: "kvroute-sim".into(),
            args: vec!["--api-key".into(), "worker-secret".into()],
        }],
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    f.add_router(&[]).unwrap();
    f.wait_synced(Duration::from_secs(30)).await.unwrap();
    let worker = f.workers[0].url();
    let generate = serde_json::json!({"token_ids": [1, 2, 3, 4], "max_tokens": 2}).to_string();
    let keyed = [("authorization", "Bearer worker-secret")];
    let open = f
        .http
        .call(
            "POST",
            &format!("{worker}/internal/generate"),
            generate.clone(),
        )
        .await
        .unwrap();
    assert_eq!(open.status, 401, "{}", open.body);
    let wrong = f
        .http
        .call_with(
            "POST",
            &format!("{worker}/internal/generate"),
            generate.clone(),
            &[("authorization", "Bearer another")],
        )
        .await
        .unwrap();
    assert_eq!(wrong.status, 401, "{}", wrong.body);
    let served = f
        .http
        .call_with(
            "POST",
            &format!("{worker}/internal/generate"),
            generate,
            &keyed,
        )
        .await
        .unwrap();
    assert_eq!(served.status, 200, "{}", served.body);
    for path in ["/admin/cache", "/v1/models"] {
        let reply = f
            .http
            .call("GET", &format!("{worker}{path}"), "")
            .await
            .unwrap();
        assert_eq!(reply.status, 401, "{path}: {}", reply.body);
    }
    let cache = f
        .http
        .call_with("GET", &format!("{worker}/admin/cache"), "", &keyed)
        .await
        .unwrap();
    assert_eq!(cache.status, 200, "{}", cache.body);
    for path in ["/health", "/metrics"] {
        let reply = f
            .http
            .call("GET", &format!("{worker}{path}"), "")
            .await
            .unwrap();
        assert_eq!(reply.status, 200, "{path}: {}", reply.body);
    }
    let body = completion("kvroute-sim", "a prompt for a keyed worker", 2, false);
    let with_key = f
        .http
        .call(
            "POST",
            &format!("{}/v1/completions", f.routers[0].url()),
            body.clone(),
        )
        .await
        .unwrap();
    assert_eq!(with_key.status, 200, "{}", with_key.body);
    let without_key = f
        .http
        .call(
            "POST",
            &format!("{}/v1/completions", f.routers[1].url()),
            body,
        )
        .await
        .unwrap();
    assert_eq!(without_key.status, 503, "{}", without_key.body);
    assert!(without_key.body.contains("401"), "{}", without_key.body);
}

/// The series the chart's alerts select exist at 0 from the start: a counter born at 1 is
/// not an `increase()` to Prometheus (the first stream ended for want of the body budget,
/// the first batches a worker dropped and a worker's first ejection raised no alert), and a
/// router no worker ever registered with had no `kvroute_workers_registered` for
/// `KvrouteNoWorkers` to see.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alerted_series_exist_at_zero_from_the_start() {
    let mut f = Fleet::start(FleetSpec {
        workers: Vec::new(),
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    let router = f.scrape().await.unwrap();
    for series in [
        "kvroute_workers_registered 0",
        "kvroute_relay_ended_total{how=\"over_budget\"} 0",
        "kvroute_relay_ended_total{how=\"done\"} 0",
    ] {
        assert!(router.lines().any(|l| l == series), "{series}:\n{router}");
    }
    f.add_worker(&WorkerSpec::model("kvroute-sim")).unwrap();
    f.wait_synced(Duration::from_secs(30)).await.unwrap();
    let id = f.workers[0].port;
    let router = f.scrape().await.unwrap();
    let ejections = format!("kvroute_worker_ejections_total{{worker=\"{id}\"}} 0");
    assert!(
        router.lines().any(|l| l == ejections),
        "{ejections}:\n{router}"
    );
    let worker = f
        .http
        .call("GET", &format!("{}/metrics", f.workers[0].url()), "")
        .await
        .unwrap()
        .body;
    assert!(
        worker
            .lines()
            .any(|l| l == "kvroute_worker_event_batches_dropped_total 0"),
        "{worker}"
    );
}
