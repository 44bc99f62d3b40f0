use std::time::Duration;

use kvroute::discovery::{LocalRegistry, Registry};
use kvroute::events::transport::{LocalBus, Transport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;

fn config() -> ServerConfig {
    ServerConfig {
        id: WorkerId(7),
        listen: "127.0.0.1:0".parse().unwrap(),
        url: None,
        cluster: "t".into(),
        model: "sim".into(),
        engine: EngineConfig {
            speedup: 100.0,
            ..EngineConfig::default()
        },
        lease: LeaseConfig::default(),
        epoch: 1 << 20,
        metrics: None,
        tokenizer: std::sync::Arc::new(kvroute::ingress::tokenizer::Tokenizer::Bytes),
        http: HttpConfig::default(),
        fault_injection: true,
        api_key: None,
        emulate: None,
    }
}

async fn worker(bus: &LocalBus) -> Worker {
    Worker::start(
        config(),
        Transport::Local(bus.clone()),
        Registry::Local(LocalRegistry::default()),
    )
    .await
    .unwrap()
}

/// One HTTP/1.1 request on a fresh connection; the whole response as text.
async fn post(addr: SocketAddr, path: &str, body: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut out))
        .await
        .unwrap()
        .unwrap();
    out
}

/// A token list longer than the engine's G1 could ever hold is refused before it is parsed
/// (at 4 B a token, where its JSON costs as little as 2: the engine refused it only once
/// it had been parsed and copied, 4 times the body's bytes). Control: one that fits runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_list_longer_than_g1_is_refused_before_it_is_parsed() {
    let bus = LocalBus::new();
    let mut small = config();
    small.engine.g1_blocks = 64;
    let w = Worker::start(
        small,
        Transport::Local(bus.clone()),
        Registry::Local(LocalRegistry::default()),
    )
    .await
    .unwrap();
    let body = |n: u32| {
        serde_json::json!({"token_ids": (0..n).collect::<Vec<u32>>(), "max_tokens": 2}).to_string()
    };
    let long = post(w.addr, "/internal/generate", &body(20_000)).await;
    assert!(
        long.starts_with("HTTP/1.1 413"),
        "{}",
        &long[..200.min(long.len())]
    );
    let completion =
        serde_json::json!({"model": "sim", "prompt": (0..20_000).collect::<Vec<u32>>()});
    let long = post(w.addr, "/v1/completions", &completion.to_string()).await;
    assert!(
        long.starts_with("HTTP/1.1 413"),
        "{}",
        &long[..200.min(long.len())]
    );
    let fits = post(w.addr, "/internal/generate", &body(100)).await;
    assert!(
        fits.starts_with("HTTP/1.1 200"),
        "{}",
        &fits[..200.min(fits.len())]
    );
}

/// A fast engine writes thousands of tokens in one turn of its thread (each turn runs every
/// step due, up to a millisecond ahead): what a request's channel has no room for waits, in
/// order, until the client reads it, instead of cutting a client that had no chance to
/// read (at this speed a 4,000-token answer was a 503 "client too slow").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fast_engine_s_tokens_wait_for_their_client() {
    let bus = LocalBus::new();
    let mut fast = config();
    fast.engine.speedup = 1e6;
    let w = Worker::start(
        fast,
        Transport::Local(bus.clone()),
        Registry::Local(LocalRegistry::default()),
    )
    .await
    .unwrap();
    for stream in [false, true] {
        let body =
            serde_json::json!({"token_ids": [1, 2, 3, 4], "max_tokens": 4000, "stream": stream});
        let answer = post(w.addr, "/internal/generate", &body.to_string()).await;
        assert!(
            answer.starts_with("HTTP/1.1 200"),
            "{}",
            &answer[..200.min(answer.len())]
        );
        if stream {
            // 4,000 tokens and the final chunk.
            assert_eq!(
                answer.matches("\"token_ids\":[").count(),
                4001,
                "{}",
                &answer[answer.len() - 300..]
            );
            assert!(answer.contains("\"finish_reason\":\"length\""));
            assert!(answer.contains("data: [DONE]"));
        } else {
            assert!(
                answer.contains("\"completion_tokens\":4000"),
                "{}",
                &answer[..300.min(answer.len())]
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_streams_every_token_then_done_and_publishes_events() {
    let bus = LocalBus::new();
    let mut events = Transport::Local(bus.clone())
        .subscribe("kvroute.t.events.7")
        .await
        .unwrap();
    let w = worker(&bus).await;
    let tokens: Vec<u32> = (0..64).collect();
    let body =
        serde_json::json!({"token_ids": tokens, "max_tokens": 5, "stream": true}).to_string();
    let response = post(w.addr, "/internal/generate", &body).await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.contains("text/event-stream"));
    assert_eq!(
        response.matches("\"token_ids\":[").count(),
        6,
        "5 tokens and the final chunk: {response}"
    );
    assert!(response.contains("\"finish_reason\":\"length\""));
    assert!(response.trim_end().ends_with("data: [DONE]") || response.contains("data: [DONE]"));
    // The prompt's 4 full blocks were announced.
    let batch = tokio::time::timeout(Duration::from_secs(5), events.next())
        .await
        .unwrap()
        .unwrap();
    let batch = kvroute::protocol::decode(&batch.payload, &Default::default()).unwrap();
    assert!(batch.block_count() >= 4);
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_without_stream_returns_one_body_and_bad_input_is_400() {
    let bus = LocalBus::new();
    let w = worker(&bus).await;
    let body = serde_json::json!({"token_ids": [1, 2, 3], "max_tokens": 3}).to_string();
    let response = post(w.addr, "/internal/generate", &body).await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.contains("\"completion_tokens\":3"), "{response}");
    let bad = post(w.addr, "/internal/generate", "{not json").await;
    assert!(bad.starts_with("HTTP/1.1 400"), "{bad}");
    assert!(bad.contains("invalid_request_error"));
    let empty = post(w.addr, "/internal/generate", r#"{"token_ids": []}"#).await;
    assert!(empty.starts_with("HTTP/1.1 400"), "{empty}");
    // The OpenAI endpoints take text.
    let text = post(
        w.addr,
        "/v1/completions",
        r#"{"model": "sim", "prompt": "hello", "max_tokens": 2}"#,
    )
    .await;
    assert!(text.contains("\"completion_tokens\":2"), "{text}");
    let chat = post(
        w.addr,
        "/v1/chat/completions",
        r#"{"model": "sim", "messages": [{"role": "user", "content": "hi"}]}"#,
    )
    .await;
    assert!(chat.starts_with("HTTP/1.1 200"), "{chat}");
    assert!(chat.contains("\"object\":\"chat.completion\""), "{chat}");
    assert!(chat.contains("\"role\":\"assistant\""), "{chat}");
    // Text past the router's max_tokenize_bytes, and a chat of more JSON values than the
    // router reads, are 413s, not gigabytes (a tokenizer peaks at up to 350 times its
    // text; every value of a chat is an 80-byte JSON value).
    let limit = super::http::max_text_bytes();
    let long = serde_json::json!({"model": "sim", "prompt": "a".repeat(limit + 1)});
    let refused = post(w.addr, "/v1/completions", &long.to_string()).await;
    assert!(refused.starts_with("HTTP/1.1 413"), "{}", &refused[..200]);
    let long_chat = serde_json::json!({"model": "sim", "messages": [{"role": "user", "content": "a".repeat(limit)}]});
    let refused = post(w.addr, "/v1/chat/completions", &long_chat.to_string()).await;
    assert!(refused.starts_with("HTTP/1.1 413"), "{}", &refused[..200]);
    let zeros = vec!["0"; kvroute::ingress::openai::MAX_CHAT_VALUES].join(",");
    let many = format!(
        r#"{{"model": "sim", "messages": [{{"role": "user", "content": "hi"}}], "tools": [{zeros}]}}"#
    );
    let refused = post(w.addr, "/v1/chat/completions", &many).await;
    assert!(refused.starts_with("HTTP/1.1 413"), "{}", &refused[..200]);
    let chunks = post(
        w.addr,
        "/v1/chat/completions",
        r#"{"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": true}"#,
    )
    .await;
    assert_eq!(
        chunks.matches("chat.completion.chunk").count(),
        3,
        "{chunks}"
    );
    assert_eq!(
        chunks.matches("\"role\":\"assistant\"").count(),
        1,
        "{chunks}"
    );
    assert_eq!(chunks.matches("\"content\":").count(), 2, "{chunks}");
    assert!(chunks.contains("\"finish_reason\":\"length\""), "{chunks}");
    let other = post(
        w.addr,
        "/v1/completions",
        r#"{"model": "x", "prompt": "hello"}"#,
    )
    .await;
    assert!(other.starts_with("HTTP/1.1 404"), "{other}");
    assert!(other.contains("model_not_found"), "{other}");
    w.stop().await;
}

/// Body of an HTTP response.
fn body(response: &str) -> &str {
    response.split("\r\n\r\n").nth(1).unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_for_another_model_is_misdirected() {
    let bus = LocalBus::new();
    let w = worker(&bus).await;
    let wrong = serde_json::json!({"token_ids": [1, 2, 3], "max_tokens": 2, "model": "other"});
    let r = post(w.addr, "/internal/generate", &wrong.to_string()).await;
    assert!(r.starts_with("HTTP/1.1 421"), "{r}");
    let right = serde_json::json!({"token_ids": [1, 2, 3], "max_tokens": 2, "model": "sim"});
    let r = post(w.addr, "/internal/generate", &right.to_string()).await;
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    w.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_carry_unique_ids_created_and_openai_fields() {
    let bus = LocalBus::new();
    let w = worker(&bus).await;
    let mut ids = std::collections::BTreeSet::new();
    for chat in [false, true] {
        for _ in 0..3 {
            let g = serde_json::json!({"token_ids": [1, 2, 3], "max_tokens": 2, "chat": chat});
            let r = post(w.addr, "/internal/generate", &g.to_string()).await;
            let v: serde_json::Value = serde_json::from_str(body(&r)).unwrap();
            let id = v["id"].as_str().unwrap().to_owned();
            assert!(
                id.starts_with(if chat { "chatcmpl-" } else { "cmpl-" }),
                "{id}"
            );
            assert!(ids.insert(id));
            assert!(v["created"].as_u64().unwrap() > 1_700_000_000);
            assert!(v["system_fingerprint"].is_string());
            assert!(v["choices"][0]["logprobs"].is_null());
            assert!(
                v["choices"][0]
                    .as_object()
                    .unwrap()
                    .contains_key("logprobs")
            );
            if chat {
                assert!(
                    v["choices"][0]["message"]
                        .as_object()
                        .unwrap()
                        .contains_key("refusal")
                );
            }
        }
    }
    let g =
        serde_json::json!({"token_ids": [1, 2, 3], "max_tokens": 3, "stream": true, "chat": true});
    let r = post(w.addr, "/internal/generate", &g.to_string()).await;
    let chunks: Vec<serde_json::Value> = body(&r)
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks.len(), 4, "{r}");
    let id = &chunks[0]["id"];
    for (i, c) in chunks.iter().enumerate() {
        assert_eq!(&c["id"], id);
        assert!(c["created"].is_u64());
        let finish = &c["choices"][0]["finish_reason"];
        assert_eq!(finish.is_null(), i + 1 < chunks.len(), "{c}");
    }
    w.stop().await;
}

/// A completion's `cache_salt` salts its blocks, as vLLM's does: the same prompt under
/// another salt, or none, finds nothing cached; under the same salt it does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_salt_keeps_a_prompt_s_blocks_apart() {
    let bus = LocalBus::new();
    let w = worker(&bus).await;
    let model = config().model;
    let prompt = "x".repeat(200);
    let cached = |salt: Option<&str>| {
        let mut body = serde_json::json!({"model": model, "prompt": prompt, "max_tokens": 1});
        if let Some(salt) = salt {
            body["cache_salt"] = salt.into();
        }
        let addr = w.addr;
        async move {
            let r = post(addr, "/v1/completions", &body.to_string()).await;
            assert!(r.starts_with("HTTP/1.1 200"), "{r}");
            let v: serde_json::Value = serde_json::from_str(super::tests::body(&r)).unwrap();
            v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
        }
    };
    assert_eq!(cached(Some("a")).await, 0);
    assert_eq!(
        cached(None).await,
        0,
        "an unsalted prompt reused a salted one's blocks"
    );
    assert_eq!(cached(Some("b")).await, 0, "another salt reused the blocks");
    assert!(cached(Some("a")).await > 0, "the same salt found nothing");
    let r = post(
        w.addr,
        "/v1/completions",
        &serde_json::json!({"model": model, "prompt": "hi", "cache_salt": ""}).to_string(),
    )
    .await;
    assert!(r.starts_with("HTTP/1.1 400"), "{r}");
    w.stop().await;
}

/// A client that reads nothing while the engine writes far more than its socket holds is
/// cut off, and the worker lets go of its request: here by the connection's write stall
/// (2 s), before the engine's own limit on a client that takes nothing (10 s). Tokens are
/// never dropped silently: the stream ends without `[DONE]`, or with an error event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_too_slow_for_its_stream_is_cut_off_with_an_error() {
    let bus = LocalBus::new();
    let config = ServerConfig {
        engine: EngineConfig {
            speedup: 1e6,
            ..EngineConfig::default()
        },
        http: HttpConfig {
            write_stall_timeout_ms: 2_000,
            ..HttpConfig::default()
        },
        ..config()
    };
    let w = Worker::start(
        config,
        Transport::Local(bus.clone()),
        Registry::Local(LocalRegistry::default()),
    )
    .await
    .unwrap();
    let max_tokens = 200_000;
    let g = serde_json::json!({"token_ids": [1, 2, 3], "max_tokens": max_tokens, "stream": true});
    let body_text = g.to_string();
    let mut s = tokio::net::TcpStream::connect(w.addr).await.unwrap();
    let req = format!(
        "POST /internal/generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body_text}",
        body_text.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    // Read no more than the answer's head (the request was taken: the stream has begun)
    // until the worker has given up on it. Watching `active()` rise instead was a race: at
    // this speed-up a fast machine starts and cuts off the stream between two looks.
    let mut head = Vec::new();
    let taken = async {
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            assert_eq!(
                s.read(&mut byte).await.unwrap(),
                1,
                "closed before its head"
            );
            head.push(byte[0]);
        }
    };
    tokio::time::timeout(Duration::from_secs(60), taken)
        .await
        .expect("the worker never answered");
    assert!(
        head.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    let gave_up = async {
        while w.active() > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(120), gave_up)
        .await
        .expect("the worker kept a stalled client's stream forever");
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(60), s.read_to_string(&mut out))
        .await
        .unwrap()
        .unwrap();
    let tokens = out.matches("\"token_ids\":[").count();
    assert!(tokens < max_tokens as usize, "all {tokens} tokens arrived");
    assert!(
        out.contains("cut off") || !out.contains("data: [DONE]"),
        "ended as if whole"
    );
    w.stop().await;
}

/// A worker started without fault injection has no one to change the faults: its
/// publisher must then wait for batches, not take the closed channel for a change (it
/// looped without waiting, a core spinning in every such worker).
#[tokio::test(start_paused = true)]
async fn the_publisher_waits_when_no_one_can_change_the_faults() {
    let (_events_tx, mut events) = mpsc::channel::<EventBatch>(4);
    let (faults_tx, mut faults) = watch::channel(Faults::default());
    drop(faults_tx);
    let (_shutdown_tx, mut shutdown) = watch::channel(false);
    let waited = tokio::time::timeout(
        Duration::from_secs(60),
        next_batch(&mut events, &mut faults, &mut shutdown),
    )
    .await;
    assert!(waited.is_err(), "it answered {waited:?} with nothing to do");

    // Paused by a sender now gone: it stays paused until the shutdown.
    let (faults_tx, mut faults) = watch::channel(Faults {
        pause_publisher: true,
        ..Faults::default()
    });
    drop(faults_tx);
    let waited = tokio::time::timeout(
        Duration::from_secs(60),
        next_batch(&mut events, &mut faults, &mut shutdown),
    )
    .await;
    assert!(waited.is_err(), "it answered {waited:?} while paused");
    drop(_shutdown_tx);
    let stopped = next_batch(&mut events, &mut faults, &mut shutdown).await;
    assert!(matches!(stopped, Next::Stop), "{stopped:?}");
}

/// A change of the faults and a batch are each answered at once, except that a paused
/// publisher takes no batch until the pause ends.
#[tokio::test(start_paused = true)]
async fn the_publisher_takes_batches_and_fault_changes() {
    let (events_tx, mut events) = mpsc::channel::<EventBatch>(4);
    let (faults_tx, mut faults) = watch::channel(Faults::default());
    let (_shutdown_tx, mut shutdown) = watch::channel(false);
    faults_tx.send_modify(|f| f.status = Some(503));
    let next = next_batch(&mut events, &mut faults, &mut shutdown).await;
    assert!(matches!(next, Next::Again), "{next:?}");
    faults_tx.send_modify(|f| f.pause_publisher = true);
    // Paused: it waits, batches or not, until the pause ends.
    events_tx
        .send(EventBatch {
            worker: WorkerId(7),
            dp_rank: DpRank(0),
            epoch: 1,
            sent_unix_us: 0,
            events: Vec::new(),
        })
        .await
        .unwrap();
    let waited = tokio::time::timeout(
        Duration::from_secs(60),
        next_batch(&mut events, &mut faults, &mut shutdown),
    )
    .await;
    assert!(waited.is_err(), "it answered {waited:?} while paused");
    // Unpaused: the batch comes, after at most one look at the faults (both are ready).
    faults_tx.send_modify(|f| f.pause_publisher = false);
    let mut next = next_batch(&mut events, &mut faults, &mut shutdown).await;
    if matches!(next, Next::Again) {
        next = next_batch(&mut events, &mut faults, &mut shutdown).await;
    }
    assert!(matches!(next, Next::Batch(_)), "{next:?}");
}

/// Sidecars on one host tell themselves apart by their engine's URL; a worker by its port;
/// either keeps its id across restarts.
#[test]
fn worker_ids_are_stable_and_apart_on_one_host() {
    use super::{stable_id, stable_id_of};
    let a = stable_id_of("node-1", "http://127.0.0.1:8000");
    assert_eq!(a, stable_id_of("node-1", "http://127.0.0.1:8000"));
    assert_ne!(a, stable_id_of("node-1", "http://127.0.0.1:8001"));
    assert_ne!(a, stable_id_of("node-2", "http://127.0.0.1:8000"));
    assert_eq!(stable_id("node-1", 9000), stable_id_of("node-1", "9000"));
}

/// Request bodies share one budget ([`http::BODY_BUDGET`], 1 MiB in tests): with two
/// uploads under way holding all of it, a request is refused with 429 (it may not park a
/// body beside them), and once they are gone requests pass again. The test waits on the
/// budget itself, full then empty, not on a window of time (a loaded machine reads the
/// uploads late).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_bodies_share_a_budget() {
    let bus = LocalBus::new();
    let w = worker(&bus).await;
    let mut uploads = Vec::new();
    for _ in 0..2 {
        let mut s = tokio::net::TcpStream::connect(w.addr).await.unwrap();
        // All but the last byte of a 512 KiB body: its buffer grows to the announced length.
        let head = format!(
            "POST /internal/generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            512 << 10
        );
        s.write_all(head.as_bytes()).await.unwrap();
        s.write_all(&vec![b' '; (512 << 10) - 1]).await.unwrap();
        uploads.push(s);
    }
    let budget_reaches = |full: bool| {
        let w = &w;
        async move {
            // Bounded only so that a broken budget fails the test rather than hanging it.
            for _ in 0..6_000 {
                let in_use = w.body_bytes_in_use();
                if (full && in_use >= http::BODY_BUDGET) || (!full && in_use == 0) {
                    return true;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            false
        }
    };
    assert!(
        budget_reaches(true).await,
        "the two uploads never filled the budget ({} B held)",
        w.body_bytes_in_use()
    );
    let small = r#"{"token_ids":[1,2,3],"max_tokens":1}"#;
    let refused = post(w.addr, "/internal/generate", small).await;
    assert!(refused.starts_with("HTTP/1.1 429"), "{refused}");
    drop(uploads);
    assert!(
        budget_reaches(false).await,
        "the uploads' bodies were never released ({} B held)",
        w.body_bytes_in_use()
    );
    let passed = post(w.addr, "/internal/generate", small).await;
    assert!(passed.starts_with("HTTP/1.1 200"), "{passed}");
    w.stop().await;
}
