//! `kvroute-bench online` against a live fleet: nats-server, `kvroute serve`, two
//! `kvroute-worker` processes.
#![allow(missing_docs, clippy::unwrap_used)]

use std::sync::Arc;

use kvroute_bench::online::{OnlineRequest, run};
use kvroute_e2e::fleet::{Fleet, FleetSpec, WorkerSpec};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn online_replay_measures_a_live_router() {
    let f = Fleet::start(FleetSpec {
        workers: vec![WorkerSpec::model("kvroute-sim"); 2],
        speedup: 100.0,
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    let url = f.url();
    // Ten conversations of three turns, each turn extending the last.
    let requests: Vec<OnlineRequest> = (0..30u64)
        .map(|i| {
            let (conversation, turn) = (i % 10, i / 10);
            let tokens: Arc<[u32]> = (0..(64 * (turn + 1)) as u32)
                .map(|t| conversation as u32 * 10_000 + t)
                .collect();
            OnlineRequest {
                arrival_us: i * 20_000,
                tokens,
                output: 4,
            }
        })
        .collect();
    let timeout = std::time::Duration::from_secs(60);
    let result = run(&url, "kvroute-sim", false, 16, timeout, requests)
        .await
        .unwrap();
    assert_eq!((result.requests, result.failed), (30, 0));
    assert!(result.ttft_ms.p50 > 0.0 && result.e2e_ms.p50 >= result.ttft_ms.p50);
    // Four tokens per answer, counted from the stream's token events.
    assert!(result.throughput_tok_s > 0.0);
    let router = result.router.expect("kvroute's headers were read");
    assert_eq!(router.routed, 30);
    // Later turns are served from the cache the earlier ones left.
    assert!(router.reuse_ratio > 0.3, "reuse {}", router.reuse_ratio);
    assert_eq!(router.worker_load_spread.requests.iter().sum::<u64>(), 30);
    assert_eq!(router.decisions.stats.decisions, 30);
}

/// A worker that fails after its 200 (here: headers, which the router passes on after
/// `--worker-timeout-ms` without a token, then nothing until its first-token deadline sends
/// an error event) is a failure, not a fast TTFT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_that_fail_after_their_headers_are_failures() {
    let f = Fleet::start(FleetSpec {
        router_args: vec![
            "--first-token-timeout-ms".into(),
            "1500".into(),
            "--worker-timeout-ms".into(),
            "300".into(),
        ],
        workers: vec![WorkerSpec {
            model: "kvroute-sim".into(),
            args: vec!["--fault-injection".into()],
        }],
        speedup: 100.0,
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    f.faults(0, serde_json::json!({"stall_after_headers": true}))
        .await
        .unwrap();
    let requests = (0..3u64)
        .map(|i| OnlineRequest {
            arrival_us: i * 1_000,
            tokens: (0..64u32).collect(),
            output: 4,
        })
        .collect();
    let timeout = std::time::Duration::from_secs(60);
    let result = run(&f.url(), "kvroute-sim", false, 16, timeout, requests)
        .await
        .unwrap();
    assert_eq!(
        (result.requests, result.failed),
        (3, 3),
        "{:?}",
        result.failures
    );
    assert_eq!(result.failures.get("error event"), Some(&3));
    assert!(result.ttft_sorted_ms.is_empty());
}
