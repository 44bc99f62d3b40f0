//! Admission by work, the queue, and sessions, end to end: nats-server, `kvroute serve` and
//! `kvroute-worker` processes, real HTTP over loopback.
#![allow(missing_docs, clippy::unwrap_used)]

use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

use kvroute_e2e::fleet::{Fleet, FleetSpec, WorkerSpec, completion};
use kvroute_e2e::procs::{Reply, send_raw};

const MODEL: &str = "kvroute-sim";

/// One worker at real-time pace behind a router whose budget admits one request at a time
/// (an idle worker always takes one), with `extra` router flags.
async fn one_at_a_time(extra: &[&str]) -> Fleet {
    let mut router_args: Vec<String> = vec!["--worker-budget-tokens".into(), "1".into()];
    router_args.extend(extra.iter().map(|s| s.to_string()));
    Fleet::start(FleetSpec {
        router_args,
        speedup: 1.0,
        ..FleetSpec::default()
    })
    .await
    .unwrap()
}

/// A long streamed request that holds the worker's budget until its connection is dropped.
async fn hold_the_budget(f: &Fleet) -> TcpStream {
    let body = completion(MODEL, "hold the worker for a while", 5000, true);
    let mut s = send_raw(&f.url(), &body).await.unwrap();
    let mut buf = [0u8; 256];
    let n = s.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    s
}

/// `POST /v1/completions` with `body` and `headers` through the first router.
async fn post(f: &Fleet, body: String, headers: &[(&str, &str)]) -> Reply {
    let url = format!("{}/v1/completions", f.url());
    f.http.call_with("POST", &url, body, headers).await.unwrap()
}

async fn queues(f: &Fleet) -> serde_json::Value {
    let r = f
        .http
        .call("GET", &format!("{}/admin/queues", f.routers[0].admin()), "")
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    serde_json::from_str(&r.body).unwrap()
}

/// Band 0's entry in `/admin/queues`.
async fn band0(f: &Fleet) -> serde_json::Value {
    let q = queues(f).await;
    q["bands"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["band"] == 0)
        .cloned()
        .unwrap_or_default()
}

async fn depth_becomes(f: &Fleet, depth: u64) -> bool {
    f.until(Duration::from_secs(20), || async {
        band0(f).await["depth"].as_u64() == Some(depth)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_past_the_budget_waits_then_is_served() {
    let f = one_at_a_time(&[]).await;
    let hold = hold_the_budget(&f).await;
    let mut burst = Vec::new();
    for i in 0..3 {
        let http = f.http.clone();
        let url = format!("{}/v1/completions", f.url());
        let body = completion(MODEL, &format!("burst request {i}"), 4, false);
        burst.push(tokio::spawn(async move {
            http.call_with("POST", &url, body, &[("x-kvroute-receipt", "1")])
                .await
                .unwrap()
        }));
    }
    assert!(depth_becomes(&f, 3).await, "{}", queues(&f).await);
    assert!(
        burst.iter().all(|b| !b.is_finished()),
        "nothing is served past the budget"
    );
    drop(hold);
    for b in burst {
        let r = b.await.unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(r.header("x-kvroute-worker").is_some());
        assert!(r.header("x-kvroute-cached-blocks").is_some());
        assert!(r.header("x-kvroute-reachable-blocks").is_some());
        let receipt = r.header("x-kvroute-receipt").unwrap();
        assert!(
            receipt.contains("cached=") && receipt.contains("reachable="),
            "{receipt}"
        );
    }
    let b = band0(&f).await;
    assert_eq!(b["counters"]["admitted"], 4, "{b}");
    assert_eq!(b["depth"], 0, "{b}");
    let q = queues(&f).await;
    assert_eq!(q["decisions"]["total"], 4, "{q}");
    let metrics = f.scrape().await.unwrap();
    for name in [
        "kvroute_queue_depth",
        "kvroute_queue_wait_seconds",
        "kvroute_route_decisions_total",
        "kvroute_route_optimal_total",
        "kvroute_route_cached_blocks_total",
        "kvroute_route_reachable_blocks_total",
        "kvroute_admission_budget_tokens",
    ] {
        assert!(metrics.contains(name), "{name} missing from /metrics");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_request_whose_client_leaves_leaves_the_queue() {
    let f = one_at_a_time(&[]).await;
    let _hold = hold_the_budget(&f).await;
    let waiting = send_raw(&f.url(), &completion(MODEL, "will leave", 4, false))
        .await
        .unwrap();
    assert!(depth_becomes(&f, 1).await, "{}", queues(&f).await);
    drop(waiting);
    assert!(depth_becomes(&f, 0).await, "{}", queues(&f).await);
    assert_eq!(band0(&f).await["counters"]["cancelled"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_expires_with_429_and_retry_after() {
    let f = one_at_a_time(&["--queue-ttl-ms", "300"]).await;
    let _hold = hold_the_budget(&f).await;
    let r = post(&f, completion(MODEL, "too late", 4, false), &[]).await;
    assert_eq!(r.status, 429, "{}", r.body);
    assert!(r.header("retry-after").is_some());
    assert!(r.body.contains("deadline"), "{}", r.body);
    assert_eq!(band0(&f).await["counters"]["expired"], 1);
    // A band header that is not an integer is the client's error.
    let r = post(
        &f,
        completion(MODEL, "x", 4, false),
        &[("x-kvroute-priority", "high")],
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_fleet_answers_503_at_once() {
    let f = Fleet::start(FleetSpec {
        workers: Vec::new(),
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    let r = post(&f, completion(MODEL, "anyone?", 4, false), &[]).await;
    assert_eq!(r.status, 503, "{}", r.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_holds_for_20_turns_and_moves_once_when_its_worker_dies() {
    let mut f = Fleet::start(FleetSpec {
        workers: vec![WorkerSpec::model(MODEL); 3],
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    let session = [("x-kvroute-session", "conversation-1")];
    let mut conversation = String::from("You are a helpful assistant. ");
    let mut turn = async |f: &Fleet, i: usize| -> String {
        conversation.push_str(&format!("User turn {i}: tell me more about item {i}. "));
        let r = post(f, completion(MODEL, &conversation, 4, false), &session).await;
        assert_eq!(r.status, 200, "turn {i}: {}", r.body);
        r.header("x-kvroute-worker").unwrap().to_owned()
    };
    let mut first = Vec::new();
    for i in 0..20 {
        first.push(turn(&f, i).await);
    }
    assert!(first.iter().all(|w| *w == first[0]), "{first:?}");
    let home = f
        .workers
        .iter()
        .position(|w| w.port.to_string() == first[0])
        .unwrap();
    f.workers[home].proc.kill();
    // Wait until the router has dropped it (its lease expired).
    assert!(
        f.until(Duration::from_secs(20), || async {
            f.admin_workers(0).await.unwrap()["workers"]
                .as_array()
                .unwrap()
                .len()
                == 2
        })
        .await
    );
    let mut after = Vec::new();
    for i in 20..30 {
        after.push(turn(&f, i).await);
    }
    assert!(
        after.iter().all(|w| *w == after[0] && *w != first[0]),
        "{after:?}"
    );
    let s = &queues(&f).await["sessions"];
    assert_eq!(
        (s["started"].as_u64(), s["moved"].as_u64()),
        (Some(1), Some(1)),
        "{s}"
    );
    assert_eq!(s["stuck"].as_u64(), Some(28), "{s}");
}

/// The queue is shared by every model, but a request that must wait holds back only the
/// requests of its own model: another model's request, whose worker is idle, goes past it
/// (it waited behind it until the first model's worker freed up).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_request_holds_back_only_its_own_model() {
    let f = Fleet::start(FleetSpec {
        router_args: vec![
            "--worker-budget-tokens".into(),
            "1".into(),
            "--queue-ttl-ms".into(),
            "600000".into(),
        ],
        workers: vec![WorkerSpec::model(MODEL), WorkerSpec::model("other")],
        speedup: 1.0,
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    let hold = hold_the_budget(&f).await;
    let waiting = {
        let http = f.http.clone();
        let url = format!("{}/v1/completions", f.url());
        let body = completion(MODEL, "waits for the first worker", 4, false);
        tokio::spawn(async move { http.call("POST", &url, body).await.unwrap() })
    };
    assert!(depth_becomes(&f, 1).await, "{}", queues(&f).await);
    let other = tokio::time::timeout(
        Duration::from_secs(30),
        post(
            &f,
            completion("other", "for the idle worker", 4, false),
            &[],
        ),
    )
    .await
    .expect("the other model's request waited behind this model's");
    assert_eq!(other.status, 200, "{}", other.body);
    assert!(
        !waiting.is_finished(),
        "the held-back request went past the budget"
    );
    drop(hold);
    assert_eq!(waiting.await.unwrap().status, 200);
}
