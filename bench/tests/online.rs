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
    let result = run(&url, "kvroute-sim", false, 16, requests).await.unwrap();
    assert_eq!((result.requests, result.failed), (30, 0));
    assert!(result.ttft_ms.p50 > 0.0 && result.e2e_ms.p50 >= result.ttft_ms.p50);
    let router = result.router.expect("kvroute's headers were read");
    assert_eq!(router.routed, 30);
    // Later turns are served from the cache the earlier ones left.
    assert!(router.reuse_ratio > 0.3, "reuse {}", router.reuse_ratio);
    assert_eq!(router.worker_load_spread.requests.iter().sum::<u64>(), 30);
    assert_eq!(router.decisions.stats.decisions, 30);
}
