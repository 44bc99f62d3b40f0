//! kvroute in front of real engines' wire formats, end to end: test engines
//! (`kvroute-worker --emulate`, speaking vLLM's or SGLang's ZMQ events and OpenAI HTTP) behind
//! the router in direct mode (`kvroute serve --backend`) and in fleet mode (a sidecar,
//! `kvroute-worker --engine`, beside each engine, over a real nats-server).
#![allow(missing_docs, clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use kvroute_e2e::engines::{EngineSpec, TestEngine, direct_router};
use kvroute_e2e::fleet::{Fleet, FleetSpec, WorkerSpec, completion};
use kvroute_e2e::procs::{Http, free_port};

const MODEL: &str = "engine-model";
const WAIT: Duration = Duration::from_secs(60);

type Engine = TestEngine;

/// The suite's usual engine: `flavor`, serving [`MODEL`], small caches, 200 times real time.
fn spec(flavor: &str) -> EngineSpec {
    EngineSpec {
        flavor: flavor.into(),
        model: MODEL.into(),
        g1_blocks: 96,
        g2_blocks: 128,
        speedup: 200.0,
        adapters: Vec::new(),
    }
}

fn engine(flavor: &str) -> Engine {
    TestEngine::start(spec(flavor)).unwrap()
}

/// A sidecar (`kvroute-worker --engine KIND`) beside test engine `e`, following its KV events
/// unless `events` is false (an engine without them), asking its health every 200 ms.
fn sidecar(e: &Engine, kind: &str, events: bool) -> WorkerSpec {
    let mut args = vec![
        "--engine".into(),
        kind.into(),
        "--engine-url".into(),
        e.url(),
    ];
    if events {
        args.extend([
            "--kv-events".into(),
            format!("tcp://127.0.0.1:{}", e.events),
            "--kv-replay".into(),
            format!("tcp://127.0.0.1:{}", e.replay),
        ]);
    }
    args.extend(["--block-size", "16", "--engine-health-ms", "200"].map(String::from));
    WorkerSpec {
        model: MODEL.into(),
        args,
    }
}

/// The value of the one series of `name` in Prometheus `text` whose labels include every
/// one of `labels` (`key="value"`).
fn series(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(['{', ' ']))
        })
        .find(|l| labels.iter().all(|label| l.contains(label)))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// Per (data-parallel rank, tier): (blocks, xor of hashes).
type Tiers = BTreeMap<(u64, String), (u64, String)>;

/// The engine's own cache, per rank and tier.
async fn cache(http: &Http, e: &Engine) -> Option<Tiers> {
    let r = http
        .call("GET", &format!("{}/admin/cache", e.url()), "")
        .await
        .ok()?;
    let v: serde_json::Value = serde_json::from_str(&r.body).ok()?;
    Some(
        rows(&v["ranks"], None)
            .into_values()
            .next()
            .unwrap_or_default(),
    )
}

/// `worker → (rank, tier) → (blocks, digest)` of `/admin/index` or `/admin/cache` rows.
fn rows(v: &serde_json::Value, only: Option<u64>) -> BTreeMap<u64, Tiers> {
    let mut out: BTreeMap<u64, Tiers> = BTreeMap::new();
    for r in v.as_array().into_iter().flatten() {
        let w = r["worker"].as_u64().unwrap_or(0);
        if only.is_some_and(|o| o != w) {
            continue;
        }
        out.entry(w).or_default().insert(
            (
                r["dp_rank"].as_u64().unwrap_or(u64::MAX),
                r["tier"].as_str().unwrap_or("").to_owned(),
            ),
            (
                r["blocks"].as_u64().unwrap_or(0),
                r["digest"].as_str().unwrap_or("").to_owned(),
            ),
        );
    }
    out
}

/// What router `admin` holds of the worker registered with `url`, per rank and tier.
async fn router_view(http: &Http, admin: &str, url: &str) -> Option<Tiers> {
    let workers = http
        .call("GET", &format!("{admin}/admin/workers"), "")
        .await
        .ok()?;
    let workers: serde_json::Value = serde_json::from_str(&workers.body).ok()?;
    let id = workers["workers"]
        .as_array()?
        .iter()
        .find(|w| w["url"] == url && w["synced"] == true)?["id"]
        .as_u64()?;
    let index = http
        .call("GET", &format!("{admin}/admin/index"), "")
        .await
        .ok()?;
    let index: serde_json::Value = serde_json::from_str(&index.body).ok()?;
    Some(
        rows(&index["ranks"], Some(id))
            .remove(&id)
            .unwrap_or_default(),
    )
}

/// Waits until every router's view of every engine equals the engine's cache (and, unless
/// `allow_empty`, the caches are not empty).
async fn wait_exact(http: &Http, admins: &[String], engines: &[&Engine], allow_empty: bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut last = String::new();
    loop {
        let mut all = true;
        for e in engines {
            let truth = cache(http, e).await;
            for admin in admins {
                let seen = router_view(http, admin, &e.url()).await;
                let ok =
                    truth.as_ref().is_some_and(|t| allow_empty || !t.is_empty()) && seen == truth;
                if !ok {
                    last = format!("engine {}: {truth:?}, router {admin}: {seen:?}", e.url());
                }
                all &= ok;
            }
        }
        if all {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never exact: {last}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What an engine's answer through the router said.
#[derive(Debug)]
struct Answer {
    /// The answer's `model`.
    model: String,
    /// `x-kvroute-worker`.
    worker: String,
    /// `x-kvroute-overlap`.
    overlap: String,
    prompt_tokens: u64,
    /// The engine's `usage.prompt_tokens_details.cached_tokens`.
    cached: u64,
}

/// A non-streamed completion of `prompt` for `model` through `router`; an error unless 200.
async fn complete(
    http: &Http,
    router: &str,
    model: &str,
    prompt: &str,
    max_tokens: u32,
) -> anyhow::Result<Answer> {
    let r = http
        .call(
            "POST",
            &format!("{router}/v1/completions"),
            completion(model, prompt, max_tokens, false),
        )
        .await?;
    anyhow::ensure!(r.status == 200, "{} {}", r.status, r.body);
    let v: serde_json::Value = serde_json::from_str(&r.body)?;
    let header = |name: &str| r.header(name).unwrap_or("").to_owned();
    Ok(Answer {
        model: v["model"].as_str().unwrap_or("").to_owned(),
        worker: header("x-kvroute-worker"),
        overlap: header("x-kvroute-overlap"),
        prompt_tokens: v["usage"]["prompt_tokens"].as_u64().unwrap_or(0),
        cached: v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
    })
}

/// A multi-turn workload through `router`: conversations whose turns extend the previous
/// prompt. Returns (prompt tokens, cached tokens) summed over the engines' answers.
async fn conversations(http: &Http, router: &str, n: usize, turns: usize) -> (u64, u64) {
    let (mut prompt, mut cached) = (0, 0);
    for c in 0..n {
        let mut text = format!(
            "Conversation {c}: {}",
            "the system prompt of this chat. ".repeat(8)
        );
        for t in 0..turns {
            text.push_str(&format!(" Turn {t}: a question about item {}.", c * 31 + t));
            let a = complete(http, router, MODEL, &text, 4).await.unwrap();
            prompt += a.prompt_tokens;
            cached += a.cached;
        }
    }
    (prompt, cached)
}

/// Waits until router `admin` lists `n` workers, each synced.
async fn wait_registered(http: &Http, admin: &str, n: usize) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let r = http
            .call("GET", &format!("{admin}/admin/workers"), "")
            .await;
        let v: serde_json::Value = r
            .ok()
            .and_then(|r| serde_json::from_str(&r.body).ok())
            .unwrap_or_default();
        let ws = v["workers"].as_array().cloned().unwrap_or_default();
        if ws.len() == n && ws.iter().all(|w| w["synced"] == true) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{n} workers never registered: {v}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn wait_routable(http: &Http, router: &str) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let r = http
            .call(
                "POST",
                &format!("{router}/v1/completions"),
                completion(MODEL, "warm up", 1, false),
            )
            .await;
        if r.is_ok_and(|r| r.status == 200) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "router never routed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Direct mode: the router follows each engine's events itself; its view equals each
/// engine's cache, both wire formats; the engines report cache reuse; a restarted engine's
/// old blocks vanish from the router.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_mode_mirrors_each_engine_exactly_and_forgets_a_restarted_one() {
    let http = Http::default();
    let mut vllm = engine("vllm");
    let sglang = engine("sglang");
    let (_router, url, admin) = direct_router(&[vllm.backend(), sglang.backend()], &[]).unwrap();
    wait_registered(&http, &admin, 2).await;
    wait_routable(&http, &url).await;
    // A request longer than the engine's G1 is refused, and costs the test engine nothing:
    // it learnt the tokens of every output before the engine looked (4 G tokens, 17 GB).
    let huge = http
        .call(
            "POST",
            &format!("{}/v1/completions", sglang.url()),
            serde_json::json!({"model": sglang.spec.model, "prompt": "hi", "max_tokens": u32::MAX})
                .to_string(),
        )
        .await
        .unwrap();
    assert_eq!(huge.status, 400, "{}", huge.body);
    let (prompt, cached) = conversations(&http, &url, 6, 4).await;
    eprintln!("engine-reported reuse: {cached} of {prompt} prompt tokens");
    assert!(
        cached * 4 > prompt,
        "reuse {cached}/{prompt}: multi-turn prompts should mostly hit"
    );
    wait_exact(
        &http,
        std::slice::from_ref(&admin),
        &[&vllm, &sglang],
        false,
    )
    .await;
    // In direct mode the bridges' series are the router's: per backend, the engine healthy and
    // registered, its stream up.
    let metrics = format!("{url}/metrics");
    let ones = |text: &str, name: &str| {
        text.lines()
            .filter(|l| l.starts_with(&format!("{name}{{")) && l.ends_with(" 1"))
            .count()
    };
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let text = http.call("GET", &metrics, "").await.unwrap().body;
        let per_backend = [
            "kvroute_engine_healthy",
            "kvroute_engine_registered",
            "kvroute_engine_events_connected",
        ]
        .map(|name| ones(&text, name));
        if per_backend == [2, 2, 2] {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "healthy, registered, connected: {per_backend:?}\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The vLLM engine restarts (seq from 0, an empty cache): what the router held of it goes.
    vllm.restart().unwrap();
    conversations(&http, &url, 2, 2).await;
    wait_exact(&http, std::slice::from_ref(&admin), &[&vllm, &sglang], true).await;
    let text = http.call("GET", &metrics, "").await.unwrap().body;
    assert_eq!(
        ones(&text, "kvroute_engine_restarts_total"),
        1,
        "one engine restarted once: {text}"
    );
}

/// Fleet mode: a sidecar beside each engine publishes over NATS; a router started after the
/// traffic gets each engine's whole cache from the sidecar's snapshot, which an engine's
/// own events (inserts only) could never give it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_mode_gives_a_late_router_the_whole_cache() {
    let http = Http::default();
    let mut engines = [engine("vllm"), engine("vllm-legacy")];
    // The second sidecar is not told the model: it registers the engine's own, from its
    // /v1/models (its default was the simulated worker's name, which no client asks for).
    let mut workers: Vec<WorkerSpec> = engines.iter().map(|e| sidecar(e, "vllm", true)).collect();
    workers[1].model.clear();
    let mut fleet = Fleet::start(FleetSpec {
        workers,
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    fleet.wait_synced(WAIT).await.unwrap();
    conversations(&http, &fleet.url(), 6, 3).await;
    let late = fleet.add_router(&[]).unwrap();
    let admins: Vec<String> = [0, late]
        .iter()
        .map(|i| fleet.routers[*i].admin())
        .collect();
    wait_exact(&http, &admins, &[&engines[0], &engines[1]], false).await;
    let listed = fleet.admin_workers(0).await.unwrap();
    let models: Vec<&str> = listed["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["model"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(models, [MODEL, MODEL], "{listed}");
    // Each sidecar's own /metrics: in the fleet, its engine healthy, its event stream up and
    // whole, and as many device blocks announced as the engine holds (read until they agree:
    // the gauges follow the events, which may still be on their way).
    for (i, e) in engines.iter().enumerate() {
        let sidecar = format!("http://127.0.0.1:{}/metrics", fleet.workers[i].port);
        let last = std::cell::RefCell::new(String::new());
        let agreed = fleet
            .until(WAIT, || async {
                let Ok(reply) = http.call("GET", &sidecar, "").await else {
                    return false;
                };
                let held = cache(&http, e).await.unwrap_or_default();
                let device = held.get(&(0, "Device".to_owned())).map_or(0, |b| b.0);
                let value = |name: &str, labels: &[&str]| series(&reply.body, name, labels);
                let whole = value("kvroute_engine_registered", &[]) == Some(1.0)
                    && value("kvroute_engine_healthy", &[]) == Some(1.0)
                    && value("kvroute_engine_events_connected", &[r#"rank="0""#]) == Some(1.0)
                    && value("kvroute_engine_event_batches_total", &[]).unwrap_or(0.0) > 0.0
                    && value("kvroute_engine_event_gaps_unrepaired_total", &[]) == Some(0.0)
                    && device > 0
                    && value("kvroute_engine_blocks", &[r#"tier="device""#]) == Some(device as f64);
                *last.borrow_mut() = format!("engine device blocks {device}\n{}", reply.body);
                whole
            })
            .await;
        assert!(agreed, "sidecar {i}: {}", last.borrow());
    }
    // An engine whose /health fails is withdrawn by its sidecar; back, it registers again
    // (after two healthy checks in a row).
    let count = |v: serde_json::Value| v["workers"].as_array().map_or(0, Vec::len);
    engines[0].kill();
    let gone = fleet
        .until(WAIT, || async {
            fleet.admin_workers(0).await.map(count).ok() == Some(1)
        })
        .await;
    assert!(gone, "the dead engine stays registered");
    let sidecar = format!("http://127.0.0.1:{}/metrics", fleet.workers[0].port);
    let text = http.call("GET", &sidecar, "").await.unwrap().body;
    assert_eq!(
        series(&text, "kvroute_engine_registered", &[]),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        series(&text, "kvroute_engine_healthy", &[]),
        Some(0.0),
        "{text}"
    );
    engines[0].restart().unwrap();
    let back = fleet
        .until(WAIT, || async {
            fleet.admin_workers(0).await.map(count).ok() == Some(2)
        })
        .await;
    assert!(back, "the engine did not come back");
    let registered = fleet
        .until(WAIT, || async {
            let text = http.call("GET", &sidecar, "").await.map(|r| r.body);
            text.is_ok_and(|t| series(&t, "kvroute_engine_registered", &[]) == Some(1.0))
        })
        .await;
    assert!(
        registered,
        "the sidecar's gauge did not follow the engine back"
    );
}

/// The ZMQ and msgpack side against the real libraries: a publisher built the way vLLM's
/// is (pyzmq's libzmq PUB and ROUTER, msgpack with uint64 hashes, tagged-map events), some
/// batches sent before anyone subscribed and one never sent live. The ingest gets every
/// block through replay and live batches, exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ingest_follows_a_libzmq_publisher_exactly() {
    use kvroute::engines::ingest::{self, EngineEndpoint, IngestLimits};
    use kvroute::protocol::{BlockChange, Salt, hash_blocks};
    use std::num::NonZeroUsize;
    const BATCHES: u32 = 40;
    let python =
        std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.venv/bin/python"));
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/engines/vllm_publisher.py");
    let (pub_port, replay_port) = (free_port(), free_port());
    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut child = Killed(
        std::process::Command::new(&python)
            .args([
                script,
                &pub_port.to_string(),
                &replay_port.to_string(),
                &BATCHES.to_string(),
            ])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect(
                "python with pyzmq and msgpack (run scripts/test, which installs them into .venv)",
            ),
    );
    // Read off the runtime, with a deadline: a publisher that never says it is ready fails
    // the test instead of hanging it.
    let stdout = child.0.stdout.take().unwrap();
    let line = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::task::spawn_blocking(move || {
            let mut line = String::new();
            std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut line)
                .map(|_| line)
        }),
    )
    .await
    .expect("the Python publisher said nothing within 60 s")
    .unwrap()
    .unwrap();
    assert_eq!(
        line.trim(),
        "ready",
        "the publisher did not start (pyzmq and msgpack installed?)"
    );
    let (tx, mut rx) = tokio::sync::mpsc::channel(16);
    let endpoint = EngineEndpoint {
        events: format!("tcp://127.0.0.1:{pub_port}"),
        replay: Some(format!("tcp://127.0.0.1:{replay_port}")),
        topic: String::new(),
    };
    let bs = NonZeroUsize::new(2).unwrap();
    tokio::spawn(ingest::run(
        endpoint,
        bs,
        NonZeroUsize::MIN,
        IngestLimits::default(),
        tx,
    ));
    // What the publisher holds at the end: the chain of blocks [i, i + 1], less every
    // block i - 2 removed at each i ≡ 3 (mod 4).
    let chain: Vec<u32> = (0..BATCHES).flat_map(|i| [i, i + 1]).collect();
    let hashes = hash_blocks(&chain, bs, Salt::NONE);
    let want: std::collections::BTreeSet<_> = (0..BATCHES)
        .filter(|i| !(0..BATCHES).any(|j| j % 4 == 3 && j - 2 == *i))
        .map(|i| hashes[i as usize].seq)
        .collect();
    let mut held = std::collections::BTreeSet::new();
    let mut stats = Default::default();
    let wait = async {
        while held != want {
            let u: ingest::Update = rx.recv().await.unwrap();
            for c in u.changes {
                match c {
                    BlockChange::Stored { block, .. } => assert!(held.insert(block.seq)),
                    BlockChange::Removed { seq, .. } => assert!(held.remove(&seq)),
                }
            }
            stats = u.stats;
        }
    };
    tokio::time::timeout(WAIT, wait)
        .await
        .unwrap_or_else(|_| panic!("held {} of {}: {stats:?}", held.len(), want.len()));
    assert_eq!(stats.decode_errors, 0);
    assert!(
        stats.replayed >= 1,
        "batch 5 comes only through replay: {stats:?}"
    );
}

/// The first worker of router `admin` once `ready` holds of it (polled until [`WAIT`]).
async fn first_worker_once(
    http: &Http,
    admin: &str,
    ready: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let r = http
            .call("GET", &format!("{admin}/admin/workers"), "")
            .await
            .unwrap();
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        let w = v["workers"][0].clone();
        if ready(&w) {
            return w;
        }
        assert!(tokio::time::Instant::now() < deadline, "never ready: {w}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The first worker of router `admin` once at least `blocks` routed blocks have been judged
/// (looked for in its events from each first token, for up to two seconds).
async fn judged(http: &Http, admin: &str, blocks: u64) -> serde_json::Value {
    first_worker_once(http, admin, |w| {
        w["routed_blocks_seen"].as_u64().unwrap_or(0)
            + w["routed_blocks_missing"].as_u64().unwrap_or(0)
            >= blocks
    })
    .await
}

/// The hash-mismatch alarm: a router whose tokenizer is not the engine's routes prompts
/// whose blocks never show up in the engine's events; `/admin/workers` says so. With the
/// engine's own tokenizer (bytes, as the test engine uses) it stays down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_tokenizer_unlike_the_engine_s_raises_the_hash_mismatch_alarm() {
    let http = Http::default();
    let dir = std::env::temp_dir().join(format!("kvroute-mismatch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tokenizer = dir.join("tokenizer.json");
    let words: serde_json::Map<String, serde_json::Value> = [
        "[UNK]", "the", "a", "question", "about", "item", "turn", "chat",
    ]
    .iter()
    .enumerate()
    .map(|(i, w)| (w.to_string(), serde_json::json!(i)))
    .collect();
    let spec = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": words, "unk_token": "[UNK]"}
    });
    std::fs::write(&tokenizer, spec.to_string()).unwrap();
    for wrong in [false, true] {
        let engine = engine("vllm");
        let extra = match wrong {
            true => vec!["--tokenizer".to_string(), tokenizer.display().to_string()],
            false => Vec::new(),
        };
        let (_router, url, admin) = direct_router(&[engine.backend()], &extra).unwrap();
        wait_routable(&http, &url).await;
        conversations(&http, &url, 4, 4).await;
        let status = judged(&http, &admin, 16).await;
        assert_eq!(
            status["hash_mismatch"], wrong,
            "wrong tokenizer: {wrong}: {status}"
        );
        let seen = status["routed_blocks_seen"].as_u64().unwrap();
        if wrong {
            assert_eq!(seen, 0, "{status}");
        } else {
            // An eviction may take a block before it is looked for; nearly all are there.
            assert!(seen >= 14, "{status}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A chat that brings its own template (vLLM's `chat_template`) is rendered with it by an
/// engine that trusts request templates (`--trust-request-chat-template`), so the router,
/// trusting them too, hashes that rendering: the blocks it routes on show up in the engine's
/// events, and the hash-mismatch alarm stays down (rendered with the model's template, whose
/// first tokens differ, none would). A router that does not trust them refuses the request
/// as vLLM does (400); an engine that does not refuses it too, and the router passes its 400
/// on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_with_its_own_template_is_hashed_as_the_engine_renders_it() {
    let http = Http::default();
    let dir = std::env::temp_dir().join(format!("kvroute-own-template-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tokenizer = dir.join("tokenizer.json");
    let vocab = [
        "[UNK]",
        "the",
        "a",
        "question",
        "about",
        "item",
        "turn",
        "chat",
        "user",
        "assistant",
        "own",
        "model",
        ":",
        "long",
        "short",
        "answer",
    ];
    let words: serde_json::Map<String, serde_json::Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, w)| (w.to_string(), serde_json::json!(i)))
        .collect();
    let spec_json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": words, "unk_token": "[UNK]"}
    });
    std::fs::write(&tokenizer, spec_json.to_string()).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::json!({"chat_template": "{% for m in messages %}model {{ m.role }} : {{ m.content }} {% endfor %}{% if add_generation_prompt %}assistant :{% endif %}"}).to_string(),
    )
    .unwrap();
    let own = "{% for m in messages %}own turn own {{ m.role }} {{ m.content }} {% endfor %}{% if add_generation_prompt %}own assistant{% endif %}";
    let path = tokenizer.display().to_string();
    let trusting = [
        "--tokenizer",
        path.as_str(),
        "--trust-request-chat-template",
    ];
    let engine = TestEngine::start_with(spec("vllm"), &trusting).unwrap();
    let strict = TestEngine::start_with(spec("vllm"), &["--tokenizer", path.as_str()]).unwrap();
    let trusting: Vec<String> = trusting.iter().map(|s| s.to_string()).collect();
    let (_router, url, admin) = direct_router(&[engine.backend()], &trusting).unwrap();
    let (_other, other_url, _) = direct_router(&[engine.backend()], &trusting[..2]).unwrap();
    let (_both, strict_url, _) = direct_router(&[strict.backend()], &trusting).unwrap();
    for router in [&url, &other_url, &strict_url] {
        wait_routable(&http, router).await;
    }
    let chat = |i: usize| {
        let content: Vec<&str> = (0..60).map(|j| vocab[1 + (i * 7 + j * 3) % 15]).collect();
        serde_json::json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": content.join(" ")}],
            "max_tokens": 2,
            "chat_template": own,
        })
        .to_string()
    };
    for i in 0..16 {
        let r = http
            .call("POST", &format!("{url}/v1/chat/completions"), chat(i))
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let status = judged(&http, &admin, 16).await;
    assert_eq!(status["hash_mismatch"], false, "{status}");
    assert!(
        status["routed_blocks_seen"].as_u64().unwrap() >= 14,
        "{status}"
    );
    for (router, who) in [(&other_url, "the router"), (&strict_url, "the engine")] {
        let r = http
            .call("POST", &format!("{router}/v1/chat/completions"), chat(0))
            .await
            .unwrap();
        assert_eq!(r.status, 400, "refused by {who}: {}", r.body);
        assert!(
            r.body.contains("--trust-request-chat-template"),
            "refused by {who}: {}",
            r.body
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A prompt cut by vLLM's `truncate_prompt_tokens` is hashed as the engine keeps it (its
/// last tokens): the blocks the router routed on show up in the engine's events (hashing
/// the whole prompt, none would, and the hash-mismatch alarm would ring), and the engine
/// counts the kept tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_prompt_is_routed_on_the_blocks_the_engine_keeps() {
    let http = Http::default();
    let engine = engine("vllm");
    let (_router, url, admin) = direct_router(&[engine.backend()], &[]).unwrap();
    wait_routable(&http, &url).await;
    for i in 0..16 {
        let body = serde_json::json!({
            "model": MODEL,
            "prompt": format!("{} question {i}", "a long shared preamble ".repeat(40)),
            "max_tokens": 2,
            "truncate_prompt_tokens": 100,
        });
        let r = http
            .call("POST", &format!("{url}/v1/completions"), body.to_string())
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(v["usage"]["prompt_tokens"], 100, "{v}");
    }
    let status = judged(&http, &admin, 16).await;
    assert_eq!(status["hash_mismatch"], false, "{status}");
    assert!(
        status["routed_blocks_seen"].as_u64().unwrap() >= 14,
        "{status}"
    );
}

/// An engine started with an API key (vLLM's `--api-key`) is reached by a router given it
/// (`--engine-api-key`: its requests and its bridge's `/v1/models` carry it); a router
/// without it answers 503 naming the engine's refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_with_an_api_key_is_reached_with_the_engine_key() {
    let http = Http::default();
    let engine = TestEngine::start_with(
        EngineSpec {
            flavor: "vllm".into(),
            model: "keyed".into(),
            g1_blocks: 64,
            g2_blocks: 0,
            speedup: 200.0,
            adapters: Vec::new(),
        },
        &["--api-key", "engine-secret"],
    )
    .unwrap();
    let keyed = ["--engine-api-key".to_string(), "engine-secret".to_string()];
    let (_with, with_url, _) = direct_router(&[engine.backend()], &keyed).unwrap();
    let (_without, without_url, _) = direct_router(&[engine.backend()], &[]).unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match complete(&http, &with_url, "keyed", "a prompt for a keyed engine", 2).await {
            Ok(answer) => {
                assert_eq!(answer.model, "keyed");
                break;
            }
            Err(e) => {
                assert!(tokio::time::Instant::now() < deadline, "{e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    // Once the router without the key has the engine registered (it may still be starting).
    let refused = post_once_registered(
        &http,
        &format!("{without_url}/v1/completions"),
        &completion("keyed", "a prompt for a keyed engine", 2, false),
    )
    .await;
    // The engine's 401 is the router's misconfiguration, not the client's key: a 503 that
    // says so, not a 401 the client would take for its own.
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert!(refused.body.contains("401"), "{}", refused.body);
}

/// Two models and a LoRA adapter in one fleet: each request goes to an engine serving what it
/// names; the adapter's blocks are salted with its name (as vLLM salts them), so a prompt the
/// base model cached gives the adapter's request no overlap, and its own repeat does; the
/// router's view of both engines stays exact, salted blocks included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_models_and_an_adapter_never_cross() {
    let http = Http::default();
    let spec = |flavor: &str, model: &str, adapters: &[&str]| EngineSpec {
        flavor: flavor.into(),
        model: model.into(),
        g1_blocks: 96,
        g2_blocks: 128,
        speedup: 200.0,
        adapters: adapters.iter().map(|a| a.to_string()).collect(),
    };
    let a = TestEngine::start(spec("vllm", "base-a", &["tuned-a"])).unwrap();
    let b = TestEngine::start(spec("sglang", "base-b", &[])).unwrap();
    let (_router, url, admin) = direct_router(&[a.backend(), b.backend()], &[]).unwrap();
    let prompt = format!(
        "A shared prompt for every model: {}",
        "the same words again. ".repeat(10)
    );
    let send = |model: &'static str| {
        let (http, url, prompt) = (http.clone(), url.clone(), prompt.clone());
        async move {
            let deadline = tokio::time::Instant::now() + WAIT;
            loop {
                let r = complete(&http, &url, model, &prompt, 2).await;
                if let Ok(a) = r.as_ref() {
                    assert_eq!(a.model, model, "{a:?}");
                    return (a.worker.clone(), a.overlap.clone(), a.cached);
                }
                // The adapter appears with the engine's registration, a moment after start.
                assert!(tokio::time::Instant::now() < deadline, "{model}: {r:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    let (wa, _, _) = send("base-a").await;
    let (wb, _, _) = send("base-b").await;
    assert_ne!(wa, wb);
    // The base model's prompt is in engine a's cache, then in the router's index.
    wait_exact(&http, std::slice::from_ref(&admin), &[&a, &b], false).await;
    let (w, overlap, cached) = send("tuned-a").await;
    assert_eq!(w, wa, "the adapter is served by engine a only");
    assert_eq!(
        (overlap.as_str(), cached),
        ("device=0;host=0;disk=0", 0),
        "the base model's blocks are not the adapter's"
    );
    wait_exact(&http, std::slice::from_ref(&admin), &[&a, &b], false).await;
    let (_, overlap, cached) = send("tuned-a").await;
    assert!(
        !overlap.starts_with("device=0;"),
        "the adapter's own blocks match: {overlap}"
    );
    assert!(cached > 0);
    for _ in 0..4 {
        assert_eq!(send("base-b").await.0, wb);
    }
    // Without a model name, a fleet of two base models cannot tell which: a 400 naming them
    // (vLLM serves its own model then; a router in front of one engine does the same).
    let unnamed = serde_json::json!({"prompt": prompt, "max_tokens": 2}).to_string();
    let r = http
        .call("POST", &format!("{url}/v1/completions"), unnamed.clone())
        .await
        .unwrap();
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("base-a, base-b"), "{}", r.body);
    let (_one, one_url, _) = direct_router(&[b.backend()], &[]).unwrap();
    let r = post_once_registered(&http, &format!("{one_url}/v1/completions"), &unnamed).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body.contains("\"model\":\"base-b\""), "{}", r.body);
}

/// Whether router `admin` credits worker `id` with cached blocks for the completion `body`
/// (`/admin/explain`); `false` also when the router cannot say (see [`credited_strictly`]).
async fn credited(http: &Http, admin: &str, body: &str, id: &str) -> bool {
    credited_strictly(http, admin, body, id)
        .await
        .unwrap_or(false)
}

/// Whether router `admin` credits worker `id` with cached blocks for `body`, or why the
/// router could not say (for a check that must not pass on a broken `/admin/explain`).
async fn credited_strictly(http: &Http, admin: &str, body: &str, id: &str) -> Result<bool, String> {
    let r = http
        .call("POST", &format!("{admin}/admin/explain"), body.to_owned())
        .await
        .map_err(|e| format!("/admin/explain: {e}"))?;
    let v: serde_json::Value =
        serde_json::from_str(&r.body).map_err(|e| format!("/admin/explain {}: {e}", r.body))?;
    let id: u64 = id.parse().map_err(|e| format!("worker id {id:?}: {e}"))?;
    let candidates = v["candidates"]
        .as_array()
        .ok_or_else(|| format!("/admin/explain has no candidates: {}", r.body))?;
    Ok(candidates
        .iter()
        .any(|c| c["worker"] == id && c["device_blocks"].as_u64().unwrap_or(0) > 0))
}

/// An engine without KV events (any OpenAI server): the router learns its likely cache from
/// the prompts it sent there, so a repeated prompt goes back to the same engine and is
/// credited with the blocks it left there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_events_the_router_learns_from_its_own_decisions() {
    let http = Http::default();
    let engines = [engine("vllm"), engine("vllm")];
    // URL and model only: no events.
    let backends: Vec<String> = engines
        .iter()
        .map(|e| format!("{},model={MODEL}", e.url()))
        .collect();
    let (_router, url, admin) = direct_router(&backends, &[]).unwrap();
    wait_registered(&http, &admin, 2).await;
    wait_routable(&http, &url).await;
    for family in 0..3 {
        let prompt = format!(
            "Family {family}: {}",
            "a long shared prefix of words. ".repeat(12)
        );
        let mut seen = Vec::new();
        for _ in 0..4 {
            let a = complete(&http, &url, MODEL, &prompt, 2).await.unwrap();
            let worker = a.worker.clone();
            seen.push((a.worker, a.overlap, a.cached));
            // The guess travels router → bridge → event plane → index; a client's next turn
            // comes later than that, a test's at once: wait for it.
            let deadline = tokio::time::Instant::now() + WAIT;
            let body = completion(MODEL, &prompt, 2, false);
            while !credited(&http, &admin, &body, &worker).await {
                assert!(tokio::time::Instant::now() < deadline, "never learnt");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        assert!(
            seen.iter().all(|s| s.0 == seen[0].0),
            "family {family} moved: {seen:?}"
        );
        assert!(
            seen[1..]
                .iter()
                .all(|s| !s.1.starts_with("device=0;") && s.2 > 0),
            "{seen:?}"
        );
    }
}

/// An engine whose events use another block size than the router was told: nothing of them
/// is indexed, and `/admin/workers` says which size the engine uses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_block_size_unlike_the_configured_one_is_shown() {
    let http = Http::default();
    let e = engine("vllm");
    let backend = e.backend().replace("block_size=16", "block_size=32");
    let (_router, url, admin) = direct_router(&[backend], &[]).unwrap();
    wait_routable(&http, &url).await;
    conversations(&http, &url, 1, 2).await;
    let w = first_worker_once(&http, &admin, |w| {
        w["engine_event_faults"]["wrong_block_size"] == 16
    })
    .await;
    let faults = &w["engine_event_faults"];
    assert!(
        faults["block_size_mismatch"].as_u64().unwrap() > 0,
        "{faults}"
    );
    let index = http
        .call("GET", &format!("{admin}/admin/index"), "")
        .await
        .unwrap();
    assert_eq!(index.body, r#"{"ranks":[]}"#);
}

/// A mirror capped at 4 blocks (`max_blocks=4`) indexes at most 4 of an engine's blocks in
/// each tier and says how many it refused, while the engine itself holds many more (the
/// control: the cap is what binds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capped_engine_mirror_indexes_no_more_than_its_cap() {
    let http = Http::default();
    let e = engine("vllm");
    let backend = format!("{},max_blocks=4", e.backend());
    let (_router, url, admin) = direct_router(&[backend], &[]).unwrap();
    wait_routable(&http, &url).await;
    conversations(&http, &url, 2, 2).await;
    let w = first_worker_once(&http, &admin, |w| {
        w["engine_event_faults"]["capped_blocks"]
            .as_u64()
            .unwrap_or(0)
            > 0
    })
    .await;
    let engine_blocks: u64 = cache(&http, &e)
        .await
        .unwrap()
        .iter()
        .filter(|((_, tier), _)| tier == "Device")
        .map(|(_, (blocks, _))| *blocks)
        .sum();
    assert!(engine_blocks > 4, "the engine holds {engine_blocks}");
    let index = http
        .call("GET", &format!("{admin}/admin/index"), "")
        .await
        .unwrap();
    let index: serde_json::Value = serde_json::from_str(&index.body).unwrap();
    let rows = rows(&index["ranks"], None);
    assert!(!rows.is_empty(), "{index}");
    for tiers in rows.values() {
        for ((_, tier), (blocks, _)) in tiers {
            assert!(*blocks <= 4, "{tier}: {blocks} indexed ({w})");
        }
    }
}

/// A prompt longer than the router tokenizes (`--max-tokenize-bytes`) still reaches an
/// engine, as it came: the engine tokenizes it itself, and the router routes it on load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_past_the_tokenize_limit_goes_to_an_engine_as_it_came() {
    let http = Http::default();
    let e = engine("vllm");
    let (_router, url, _admin) = direct_router(
        &[e.backend()],
        &["--max-tokenize-bytes".into(), "1024".into()],
    )
    .unwrap();
    wait_routable(&http, &url).await;
    // 1,360 bytes: past the limit, within the test engine's 96 blocks of 16.
    let long = "a question about a long document. ".repeat(40);
    let a = complete(&http, &url, MODEL, &long, 2).await.unwrap();
    let metrics = http
        .call("GET", &format!("{url}/metrics"), "")
        .await
        .unwrap();
    assert_eq!(
        series(&metrics.body, "kvroute_prompts_untokenized_total", &[]),
        Some(1.0)
    );
    assert!(
        a.prompt_tokens as usize >= long.len() / 8,
        "{}",
        a.prompt_tokens
    );
}

/// A response body of fixed frames, then its end or (`hang`) nothing more, ever.
struct Frames {
    frames: std::collections::VecDeque<bytes::Bytes>,
    hang: bool,
}

impl hyper::body::Body for Frames {
    type Data = bytes::Bytes;
    type Error = kvroute::http::BodyAborted;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, Self::Error>>> {
        match self.frames.pop_front() {
            Some(b) => std::task::Poll::Ready(Some(Ok(hyper::body::Frame::data(b)))),
            None if self.hang => std::task::Poll::Pending,
            None => std::task::Poll::Ready(None),
        }
    }
}

/// How [`scripted_engine`] answers completions.
#[derive(Clone, Copy, PartialEq)]
enum Script {
    /// One chunk and `[DONE]`, then the body stays open.
    Hang,
    /// One chunk, then the body ends without `[DONE]`.
    Cut,
    /// 500, an OpenAI-shaped error.
    Fail,
    /// 200 and a stream whose first event is a server error (vLLM's shape, code 500).
    ErrorEvent,
    /// 200 and a stream whose first event is the client's error (code 400).
    ClientErrorEvent,
    /// 200 and a whole completion whose text is the body the engine was sent.
    Echo,
}

/// An OpenAI-compatible engine in this process answering completions as `script` says: its
/// URL and how many completions it was sent.
async fn scripted_engine(
    script: Script,
) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use http_body_util::BodyExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = std::sync::Arc::clone(&sent);
    let (keep, stop) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        let _keep = keep;
        kvroute::http::serve_http(
            "engine",
            listener,
            kvroute::http::HttpConfig::default(),
            move |req: hyper::Request<hyper::body::Incoming>| {
                let counter = std::sync::Arc::clone(&counter);
                async move {
                    let text = |status: u16, s: &'static str| {
                        hyper::Response::builder()
                            .status(status)
                            .body(kvroute::http::full(s))
                            .unwrap()
                    };
                    match req.uri().path() {
                        "/v1/completions" if script == Script::Echo => {
                            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            let body = req.into_body().collect().await.unwrap().to_bytes();
                            let answer = serde_json::json!({
                                "id": "c", "object": "text_completion", "model": "scripted",
                                "choices": [{"index": 0, "text": String::from_utf8_lossy(&body), "finish_reason": "stop"}],
                            });
                            hyper::Response::builder()
                                .header("content-type", "application/json")
                                .body(kvroute::http::full(answer.to_string()))
                                .unwrap()
                        }
                        "/v1/completions" => {
                            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            if script == Script::Fail {
                                return text(
                                    500,
                                    r#"{"error":{"message":"scripted failure","type":"InternalServerError"}}"#,
                                );
                            }
                            let chunk = match script {
                                Script::ErrorEvent => {
                                    r#"data: {"error":{"message":"scripted engine died","type":"InternalServerError","param":null,"code":500}}"#
                                }
                                Script::ClientErrorEvent => {
                                    r#"data: {"error":{"message":"scripted bad request","type":"BadRequestError","param":null,"code":400}}"#
                                }
                                _ => {
                                    r#"data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":"hi","finish_reason":null}]}"#
                                }
                            };
                            let mut frames = vec![bytes::Bytes::from(format!("{chunk}\n\n"))];
                            if matches!(script, Script::ErrorEvent | Script::ClientErrorEvent) {
                                frames.push(bytes::Bytes::from_static(b"data: [DONE]\n\n"));
                            }
                            if script == Script::Hang {
                                frames.push(bytes::Bytes::from_static(b"data: [DONE]\n\n"));
                            }
                            let body = Frames {
                                frames: frames.into(),
                                hang: script == Script::Hang,
                            };
                            hyper::Response::builder()
                                .header("content-type", "text/event-stream")
                                .body(body.boxed())
                                .unwrap()
                        }
                        "/v1/models" => text(200, r#"{"object":"list","data":[{"id":"scripted"}]}"#),
                        _ => text(200, ""),
                    }
                }
            },
            stop,
        )
        .await;
    });
    (url, sent)
}

/// vLLM's per-request full KV event reporting is taken out of what an engine is sent (its
/// re-announced blocks would stay in the index after eviction), the rest of the body as it
/// came, and the request counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_kv_event_reporting_never_reaches_the_engine() {
    let (engine, _) = scripted_engine(Script::Echo).await;
    let (_router, url, _) = direct_router(&[format!("{engine},model=scripted")], &[]).unwrap();
    let http = Http::default();
    let body = r#"{"model":"scripted","prompt":"hello there","max_tokens":4,"vllm_xargs":{"kv_cache_report_mode":"full","x":1}}"#;
    let mut seen = None;
    for _ in 0..200 {
        match http
            .call("POST", &format!("{url}/v1/completions"), body.to_owned())
            .await
        {
            Ok(r) if r.status == 200 => {
                seen = Some(r.body);
                break;
            }
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    let answer: serde_json::Value =
        serde_json::from_str(&seen.expect("the router never served the scripted engine")).unwrap();
    let sent = answer["choices"][0]["text"].as_str().unwrap();
    assert_eq!(
        sent,
        r#"{"model":"scripted","prompt":"hello there","max_tokens":4,"vllm_xargs":{"x":1}}"#
    );
    let metrics = http
        .call("GET", &format!("{url}/metrics"), "")
        .await
        .unwrap()
        .body;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("kvroute_kv_report_mode_removed_total") && l.ends_with(" 1")),
        "{metrics}"
    );
}

/// Streams end as their worker says: after `[DONE]` the relay waits only briefly for the
/// body's end (an engine or proxy that keeps it open held the slot for the idle timeout,
/// then got an error event glued after `[DONE]`), and a body that ends without `[DONE]`
/// is a cut-off answer the client is told about.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_end_at_done_and_a_cut_off_stream_says_so() {
    for hang in [true, false] {
        let (engine, _) = scripted_engine(if hang { Script::Hang } else { Script::Cut }).await;
        let (_router, url, _) = direct_router(
            &[format!("{engine},model=scripted")],
            &["--relay-idle-timeout-ms".into(), "5000".into()],
        )
        .unwrap();
        let http = Http::default();
        let body = completion("scripted", "hello there", 4, true);
        let mut answer = None;
        for _ in 0..200 {
            match http
                .call("POST", &format!("{url}/v1/completions"), body.clone())
                .await
            {
                Ok(r) if r.status == 200 => {
                    answer = Some(r.body);
                    break;
                }
                _ => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        let answer = answer.expect("the router never served the scripted engine");
        assert!(answer.contains("\"text\":\"hi\""), "{answer}");
        assert_eq!(answer.matches("data: [DONE]").count(), 1, "{answer}");
        if hang {
            assert!(!answer.contains("error"), "an error after [DONE]: {answer}");
        } else {
            assert!(
                answer.contains("before [DONE]"),
                "a cut-off stream passed as whole: {answer}"
            );
        }
    }
}

/// A router in direct mode, round robin, in front of test engine `good` and scripted engine
/// `scripted` (both serving [`MODEL`]): the process, its URL and its admin URL.
fn round_robin_router(good: &Engine, scripted: &str) -> (kvroute_e2e::procs::Proc, String, String) {
    direct_router(
        &[
            format!("{},model={MODEL}", good.url()),
            format!("{scripted},model={MODEL}"),
        ],
        &["--policy".into(), "round_robin".into()],
    )
    .unwrap()
}

/// POSTs `body` to `url` until the router listens and has a worker for it (it answers
/// something other than "no worker registered"), up to [`WAIT`]: that answer.
async fn post_once_registered(http: &Http, url: &str, body: &str) -> kvroute_e2e::procs::Reply {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match http.call("POST", url, body.to_owned()).await {
            Ok(r) if !r.body.contains("no worker registered") => return r,
            r => assert!(tokio::time::Instant::now() < deadline, "{r:?}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A stream whose first event is the engine's own error (vLLM's generator catching an
/// exception, an engine that dropped the request) is tried on another worker, as a failed
/// connection is, rather than relayed as the answer and counted as its first token (which
/// also kept the failing engine looking healthy and idle). With no other worker the client
/// gets a status naming the engine's error. A client's error (code 400) is relayed as is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_before_the_first_token_is_tried_elsewhere() {
    let http = Http::default();
    let good = engine("vllm");
    let (bad, tried) = scripted_engine(Script::ErrorEvent).await;
    let (_router, url, admin) = round_robin_router(&good, &bad);
    let (_alone, alone_url, _) = direct_router(&[format!("{bad},model={MODEL}")], &[]).unwrap();
    let (client_error, _) = scripted_engine(Script::ClientErrorEvent).await;
    let (_strict, strict_url, _) =
        direct_router(&[format!("{client_error},model={MODEL}")], &[]).unwrap();
    // Once both engines are registered (a retry needs another worker), until round robin
    // has sent the failing one a few.
    wait_registered(&http, &admin, 2).await;
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut answers = Vec::new();
    while tried.load(std::sync::atomic::Ordering::Relaxed) < 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never tried the failing engine"
        );
        let body = completion(MODEL, "a question about an item", 2, true);
        if let Ok(r) = http
            .call("POST", &format!("{url}/v1/completions"), body)
            .await
            && !r.body.contains("no worker registered")
        {
            answers.push(r);
        } else {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    for r in &answers {
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(
            !r.body.contains("scripted engine died"),
            "the engine's error reached the client: {}",
            r.body
        );
        assert!(r.body.contains("\"text\""), "{}", r.body);
    }
    let body = completion(MODEL, "a question about an item", 2, true);
    let r = post_once_registered(&http, &format!("{alone_url}/v1/completions"), &body).await;
    assert!(r.status >= 500, "{} {}", r.status, r.body);
    assert!(r.body.contains("scripted engine died"), "{}", r.body);
    let r = post_once_registered(&http, &format!("{strict_url}/v1/completions"), &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body.contains("scripted bad request"), "{}", r.body);
}

/// Without KV events the router guesses an engine's cache from the prompts it sent there,
/// but only from those the engine took: a prompt it refused (here, every one, with a 500)
/// and that another engine served is credited to the one that served it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_a_worker_refused_is_not_guessed_to_be_in_its_cache() {
    let http = Http::default();
    let good = engine("vllm");
    let (bad, tried) = scripted_engine(Script::Fail).await;
    let (_router, url, admin) = round_robin_router(&good, &bad);
    let (bad_id, good_id) = worker_ids(&http, &admin, &bad, &good.url()).await;
    wait_registered(&http, &admin, 2).await;
    let prompts: Vec<String> = (0..6)
        .map(|i| {
            completion(
                MODEL,
                &format!("prompt {i}: {}", "some shared words ".repeat(20)),
                2,
                false,
            )
        })
        .collect();
    for body in &prompts {
        let r = http
            .call("POST", &format!("{url}/v1/completions"), body.clone())
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
    }
    assert!(
        tried.load(std::sync::atomic::Ordering::Relaxed) > 0,
        "round robin never tried the failing engine"
    );
    // Learning has reached the index (the last prompt is credited to the engine that served
    // it; the engine's 96 blocks hold the last four of these 23-block prompts) before the
    // refusing one is judged.
    let last = prompts.last().unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !credited(&http, &admin, last, &good_id).await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the last prompt is never credited to the engine that served it"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for body in &prompts {
        assert!(
            !credited_strictly(&http, &admin, body, &bad_id)
                .await
                .unwrap(),
            "a prompt the engine refused is credited to it"
        );
    }
}

/// The worker ids of the engines at `a` and `b` in router `admin`'s fleet, once both are
/// registered.
async fn worker_ids(http: &Http, admin: &str, a: &str, b: &str) -> (String, String) {
    for _ in 0..400 {
        if let Ok(r) = http
            .call("GET", &format!("{admin}/admin/workers"), "")
            .await
        {
            let v: serde_json::Value = serde_json::from_str(&r.body).unwrap_or_default();
            let workers = v["workers"].as_array().cloned().unwrap_or_default();
            if workers.len() == 2 {
                let id_of = |url: &str| {
                    workers
                        .iter()
                        .find(|w| w["url"].as_str() == Some(url))
                        .map(|w| w["id"].to_string())
                };
                if let (Some(a), Some(b)) = (id_of(a), id_of(b)) {
                    return (a, b);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the engines at {a} and {b} never both registered");
}

/// A stream that opens with the client's error (vLLM tags most exceptions its stream
/// generator catches as a 400) is relayed, and is no answer: its `[DONE]`, a separate event,
/// was counted as the first token (a TTFT sample, the worker marked as answering), and the
/// prompt was guessed to be in the refusing engine's cache, drawing the conversation's next
/// turns there for a cache hit that is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_refused_with_an_error_event_is_no_token_and_caches_nothing() {
    let http = Http::default();
    let good = engine("vllm");
    let (refusing, _) = scripted_engine(Script::ClientErrorEvent).await;
    let (_router, url, admin) = round_robin_router(&good, &refusing);
    let (refusing_id, good_id) = worker_ids(&http, &admin, &refusing, &good.url()).await;
    wait_registered(&http, &admin, 2).await;
    // Round robin: prompts until one was refused and a later one served.
    let mut refused = Vec::new();
    let mut served = None;
    for i in 0..20 {
        let body = completion(
            MODEL,
            &format!("prompt {i}: {}", "some shared words ".repeat(20)),
            2,
            true,
        );
        let r = http
            .call("POST", &format!("{url}/v1/completions"), body.clone())
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        if r.body.contains("scripted bad request") {
            refused.push(body);
        } else if !refused.is_empty() {
            assert!(r.body.contains("\"text\""), "{}", r.body);
            served = Some(body);
            break;
        }
    }
    let served = served.expect("round robin sent prompts to both engines");
    // Learning is in order: once the served prompt is credited, the refused ones were judged.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !credited(&http, &admin, &served, &good_id).await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the served prompt is never credited to the engine that served it"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for body in &refused {
        assert!(
            !credited_strictly(&http, &admin, body, &refusing_id)
                .await
                .unwrap(),
            "a prompt the engine refused is credited to it"
        );
    }
    let scrape = http
        .call("GET", &format!("{url}/metrics"), "")
        .await
        .unwrap()
        .body;
    let ttft_count = |id: &str| {
        let series = format!("kvroute_ttft_seconds_count{{worker=\"{id}\"}} ");
        scrape
            .lines()
            .find_map(|l| l.strip_prefix(&series))
            .map_or(0.0, |v| v.trim().parse::<f64>().unwrap())
    };
    assert!(ttft_count(&good_id) > 0.0, "no TTFT series in\n{scrape}");
    assert_eq!(ttft_count(&refusing_id), 0.0, "{scrape}");
}

/// Load that bypasses the router, as a sidecar reports it: clients send engine a six long
/// requests directly (it runs one at a time: five wait), and engine b one with a long prompt
/// (more KV in use than a's). The sidecars read each engine's `/metrics`, the router shows
/// the load in `/admin/workers`, and a's queue sends the router's requests to b, although
/// b has more of its cache in use (which alone would send them to a).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_s_queue_from_clients_that_bypass_the_router_steers_requests_away() {
    let http = Http::default();
    let spec = EngineSpec {
        flavor: "vllm".into(),
        model: MODEL.into(),
        g1_blocks: 1000,
        g2_blocks: 0,
        // Real time: a 3,000-token answer takes about 18 s.
        speedup: 1.0,
        adapters: Vec::new(),
    };
    let a = TestEngine::start_with(spec.clone(), &["--max-num-seqs", "1"]).unwrap();
    let b = TestEngine::start(spec).unwrap();
    let fleet = Fleet::start(FleetSpec {
        workers: vec![sidecar(&a, "vllm", true), sidecar(&b, "vllm", true)],
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    fleet.wait_synced(WAIT).await.unwrap();
    // Streamed, so that no client gives up waiting for headers while they run.
    let direct = |e: &Engine, prompt: String| {
        let (http, url) = (http.clone(), e.url());
        tokio::spawn(async move {
            let body = completion(MODEL, &prompt, 3000, true);
            let _ = http
                .call("POST", &format!("{url}/v1/completions"), body)
                .await;
        })
    };
    let mut bypass = vec![direct(&b, format!("A long prompt: {}", "b".repeat(1600)))];
    for i in 0..6 {
        bypass.push(direct(&a, format!("Direct request {i} to engine a.")));
    }
    // Both engines' load as the router has it from their sidecars.
    let id_of = |v: &serde_json::Value, e: &Engine| {
        v["workers"]
            .as_array()
            .and_then(|ws| ws.iter().find(|w| w["url"] == e.url().as_str()))
            .cloned()
            .unwrap_or_default()
    };
    let deadline = tokio::time::Instant::now() + WAIT;
    let seen = loop {
        let v = fleet.admin_workers(0).await.unwrap_or_default();
        let (wa, wb) = (id_of(&v, &a), id_of(&v, &b));
        if wa["engine_load"]["waiting"] == 5
            && wb["engine_load"]["kv_usage_permille"].as_u64() >= Some(100)
            && wb["engine_load"]["waiting"] == 0
        {
            break v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the engines' load never reached the router: {v}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let b_id = id_of(&seen, &b)["id"].to_string();
    let a_usage = id_of(&seen, &a)["engine_load"]["kv_usage_permille"].as_u64();
    assert!(
        a_usage < id_of(&seen, &b)["engine_load"]["kv_usage_permille"].as_u64(),
        "engine b has more KV in use: {seen}"
    );
    for i in 0..3 {
        let prompt = format!("Routed request {i}: {}", "r".repeat(300));
        let (h, url) = (http.clone(), fleet.url());
        let sent = tokio::spawn(async move { complete(&h, &url, MODEL, &prompt, 1).await });
        // Sent to engine a, it would wait there behind five requests of about 18 s each:
        // where the router booked it says where it went, without waiting for its answer.
        let deadline = tokio::time::Instant::now() + WAIT;
        while !sent.is_finished() {
            let v = fleet.admin_workers(0).await.unwrap_or_default();
            let booked = v["workers"]
                .as_array()
                .and_then(|ws| ws.iter().find(|w| w["booked_requests"].as_u64() > Some(0)));
            if let Some(w) = booked {
                assert_eq!(
                    w["id"].to_string(),
                    b_id,
                    "request {i} was booked on the engine with a queue: {seen}"
                );
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "request {i} was never booked: {v}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let answer = sent.await.unwrap().unwrap();
        assert_eq!(
            answer.worker.trim_matches('"'),
            b_id.trim_matches('"'),
            "request {i} went to the engine with a queue: {seen}"
        );
    }
    for t in bypass {
        t.abort();
    }
}

/// A data-parallel engine: one HTTP endpoint in front of two ranks, each an engine with
/// its own cache and its own event sockets (the ports offset by the rank, as vLLM's, and
/// SGLang's under `--enable-dp-attention`). The router mirrors each rank exactly, and pins
/// each request to the rank it chose (`X-data-parallel-rank`): every later turn of a
/// conversation, which the router sends to the rank it knows holds the prefix, finds the
/// prefix cached there (the engine's own balancing, left to itself, alternates ranks).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_parallel_engine_is_mirrored_and_pinned_rank_by_rank() {
    data_parallel_engine("vllm").await;
}

/// The same with SGLang's wire format (signed hashes, its batch's rank field, round-robin
/// balancing) and its reading of the header: a value that is not an integer is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_parallel_sglang_engine_is_mirrored_and_pinned_rank_by_rank() {
    data_parallel_engine("sglang").await;
}

async fn data_parallel_engine(flavor: &str) {
    let http = Http::default();
    let e = TestEngine::start_ranks(spec(flavor), 2, &[]).unwrap();
    let (_router, url, admin) = direct_router(&[e.backend()], &[]).unwrap();
    wait_routable(&http, &url).await;
    for c in 0..6 {
        let mut text = format!(
            "Conversation {c}: {}",
            "the system prompt of this chat. ".repeat(6)
        );
        for t in 0..3 {
            text.push_str(&format!(" Turn {t}: a question about item {}.", c * 31 + t));
            let a = complete(&http, &url, MODEL, &text, 4).await.unwrap();
            if t > 0 {
                assert!(
                    !a.overlap.starts_with("device=0;") && a.cached > 0,
                    "{flavor}: conversation {c} turn {t}: the prefix the router saw is not cached on the rank it pinned: {a:?}"
                );
            }
            // The engine's events reach the router before the next turn (a client's next
            // turn comes later than that, a test's at once).
            wait_exact(&http, std::slice::from_ref(&admin), &[&e], false).await;
        }
    }
    // Each rank's cache, as the engine has it and as the router mirrors it: both ranks hold
    // conversations.
    let ranks = cache(&http, &e).await.unwrap_or_default();
    assert!(
        [0, 1]
            .iter()
            .all(|r| ranks.contains_key(&(*r, "Device".to_owned()))),
        "{flavor}: {ranks:?}"
    );
    // Each rank's own series in the engine's /metrics (unlabelled, the ranks' threads would
    // overwrite one another's).
    let metrics = http
        .call("GET", &format!("{}/metrics", e.url()), String::new())
        .await
        .unwrap()
        .body;
    for r in 0..2 {
        let series = format!("kvroute_worker_tokens_total{{rank=\"{r}\"}}");
        assert!(
            metrics.contains(&series),
            "{flavor}: no {series} in {metrics}"
        );
    }
    // A rank the engine does not have is refused, as both engines refuse it; a value that is
    // not an integer names no rank for vLLM's front end (the engine balances the request
    // itself) and is refused by SGLang's.
    let status = |rank: &'static str| {
        let http = &http;
        let url = format!("{}/v1/completions", e.url());
        async move {
            http.call_with(
                "POST",
                &url,
                completion(MODEL, "hello", 1, false),
                &[("x-data-parallel-rank", rank)],
            )
            .await
            .unwrap()
        }
    };
    let r = status("2").await;
    assert_eq!(r.status, 400, "{flavor}: {}", r.body);
    let r = status("first").await;
    let refused = flavor == "sglang";
    assert_eq!(
        r.status == 400,
        refused,
        "{flavor}: {} {}",
        r.status,
        r.body
    );
}

/// An engine without KV events behind a sidecar (`--engine openai`, fleet mode): each
/// router replica reports the prompts it sends there, the sidecar guesses the engine's cache
/// from all of them and publishes the guess as the worker's stream, so a replica that never
/// routed a conversation credits the engine with its prefix, and sends it there; a replica
/// started afterwards gets the guess from the sidecar's snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_events_a_sidecar_learns_from_every_replica_s_decisions() {
    let http = Http::default();
    let engines = [engine("vllm"), engine("vllm")];
    let mut fleet = Fleet::start(FleetSpec {
        routers: 2,
        // The engine's URL only: no events.
        workers: engines
            .iter()
            .map(|e| sidecar(e, "openai", false))
            .collect(),
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    fleet.wait_synced(WAIT).await.unwrap();
    let mut learnt_by = Vec::new();
    for family in 0..3 {
        let prompt = format!(
            "Family {family}: {}",
            "a long shared prefix of words. ".repeat(12)
        );
        // Router 0 routes the prompt; router 1 never saw it.
        let first = complete(&http, &fleet.routers[0].url(), MODEL, &prompt, 2)
            .await
            .unwrap();
        let (body, admin) = (
            completion(MODEL, &prompt, 2, false),
            fleet.routers[1].admin(),
        );
        let learnt = fleet
            .until(WAIT, || credited(&http, &admin, &body, &first.worker))
            .await;
        assert!(
            learnt,
            "family {family}: router 1 never credited worker {} with router 0's prompt",
            first.worker
        );
        let again = complete(&http, &fleet.routers[1].url(), MODEL, &prompt, 2)
            .await
            .unwrap();
        assert_eq!(
            again.worker, first.worker,
            "family {family}: router 1 sent the prompt elsewhere"
        );
        assert!(
            !again.overlap.starts_with("device=0;") && again.cached > 0,
            "family {family}: {again:?}"
        );
        learnt_by.push((completion(MODEL, &prompt, 2, false), first.worker));
    }
    let late = fleet.add_router(&[]).unwrap();
    let admin = fleet.routers[late].admin();
    for (family, (body, worker)) in learnt_by.iter().enumerate() {
        let credited_late = fleet
            .until(WAIT, || credited(&http, &admin, body, worker))
            .await;
        assert!(
            credited_late,
            "family {family}: a router started afterwards never credited worker {worker}"
        );
    }
}
