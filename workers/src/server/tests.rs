use std::time::Duration;

use kvroute::discovery::{LocalRegistry, Registry};
use kvroute::events::transport::{LocalBus, Transport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;

async fn worker(bus: &LocalBus) -> Worker {
    let config = ServerConfig {
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
    };
    Worker::start(
        config,
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
    assert!(other.starts_with("HTTP/1.1 400"), "{other}");
    w.stop().await;
}
