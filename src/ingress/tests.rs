use hyper::StatusCode;

use super::openai::Fault;
use super::proxy::ProxyError;
use super::*;
use crate::protocol::WorkerId;

fn status(code: u16) -> ProxyError {
    ProxyError::Status {
        worker: WorkerId(1),
        status: StatusCode::from_u16(code).unwrap(),
        message: "m".into(),
    }
}

#[test]
fn the_error_decides_retry_fault_and_status() {
    // Overloaded, misdirected or broken workers: another worker is tried.
    for code in [429, 421, 408, 500, 502, 503] {
        let e = status(code);
        assert!(e.retry_elsewhere(), "{code}");
        assert_eq!(e.fault(), Fault::Worker, "{code}");
        assert_eq!(e.to_api().status, 503, "{code}");
    }
    // A request the worker refuses on its merits goes back to the client as it is.
    for code in [400, 404, 413, 422] {
        let e = status(code);
        assert!(!e.retry_elsewhere(), "{code}");
        assert_eq!(e.fault(), Fault::Client);
        assert_eq!(e.to_api().status, code);
        assert_eq!(e.label(), "refused");
    }
    let timeout = ProxyError::HeadersTimeout {
        worker: WorkerId(1),
        ms: 10,
    };
    assert!(timeout.retry_elsewhere());
    assert_eq!(timeout.to_api().status, 504);
    assert_eq!(timeout.label(), "headers_timeout");
    // A non-streamed answer that took its whole deadline may still be generating: running
    // it again elsewhere would double the work after the client has waited it all.
    let answer = ProxyError::AnswerTimeout {
        worker: WorkerId(1),
        ms: 10,
    };
    assert!(!answer.retry_elsewhere());
    assert_eq!(answer.fault(), Fault::Worker);
    assert_eq!(answer.to_api().status, 504);
    assert_eq!(answer.label(), "answer_timeout");
    // "No worker registered" is the router's state, not a worker's fault.
    let none = ApiError::no_workers();
    assert_eq!((none.status, none.fault), (503, Fault::Router));
}

#[test]
fn bodies_parse_off_the_runtime_with_clear_errors() {
    let t = Tokenizer::Bytes;
    let ok = parse(
        &t,
        br#"{"model":"m","prompt":"hi","max_tokens":3,"stream":true}"#,
        false,
    )
    .unwrap();
    assert_eq!(
        (ok.model.as_str(), ok.tokens.len(), ok.max_tokens, ok.stream),
        ("m", 2, Some(3), true)
    );
    let chat = parse(
        &t,
        br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
        true,
    )
    .unwrap();
    assert!(chat.tokens.len() > 2);
    // A chat without a limit is booked as unlimited (the scheduler caps it), a completion
    // at vLLM's default of 16; `n` sequences book n times as much.
    assert_eq!(
        (chat.max_tokens, chat.booked_max_tokens()),
        (None, u32::MAX)
    );
    let defaults = parse(&t, br#"{"model":"m","prompt":"hi"}"#, false).unwrap();
    assert_eq!(defaults.booked_max_tokens(), 16);
    // Fields sent as null read as absent; max_completion_tokens wins over max_tokens;
    // stream_options alone asks for the usage chunk (vLLM's default).
    let nulls = parse(
        &t,
        br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":50,"max_completion_tokens":7,"n":3,"stream":null,"stream_options":{},"priority":null}"#,
        true,
    )
    .unwrap();
    assert_eq!(
        (
            nulls.max_tokens,
            nulls.n,
            nulls.booked_max_tokens(),
            nulls.stream,
            nulls.include_usage
        ),
        // Booked per sequence: the scheduler counts it `n` times.
        (Some(7), 3, 7, false, true)
    );
    let body = generate_body(&nulls, crate::protocol::Salt(9), true);
    assert_eq!(
        (
            body["max_tokens"].as_u64(),
            body["n"].as_u64(),
            body["salt"].as_u64()
        ),
        (Some(7), Some(3), Some(9))
    );
    assert!(
        generate_body(&chat, crate::protocol::Salt::NONE, true)
            .get("max_tokens")
            .is_none()
    );
    // A list of one prompt is that prompt, text or tokens; a batch is a clear 400.
    for one in [
        &br#"{"model":"m","prompt":["hi"]}"#[..],
        br#"{"model":"m","prompt":[[104,105]]}"#,
    ] {
        assert_eq!(parse(&t, one, false).unwrap().tokens, vec![104, 105]);
    }
    let batch = parse(&t, br#"{"model":"m","prompt":["a","b"]}"#, false).unwrap_err();
    assert!(
        batch.message.contains("one prompt per request"),
        "{}",
        batch.message
    );
    // vLLM's cache_salt is kept for hashing; an empty one is refused as vLLM refuses it.
    let salted = parse(
        &t,
        br#"{"model":"m","prompt":"hi","cache_salt":"s"}"#,
        false,
    )
    .unwrap();
    assert_eq!(salted.cache_salt.as_deref(), Some("s"));
    // Content as text parts (joined with newlines) or null, as vLLM reads it.
    let parts = parse(
        &t,
        br#"{"model":"m","messages":[{"role":"assistant","content":null},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#,
        true,
    )
    .unwrap();
    let joined = parse(
        &t,
        br#"{"model":"m","messages":[{"role":"assistant","content":""},{"role":"user","content":"a\nb"}]}"#,
        true,
    )
    .unwrap();
    assert_eq!(parts.tokens, joined.tokens);
    // Images get tokens only the engine knows: the conversation before the first message
    // with one is hashed (rendered without a generation prompt: a prefix of the whole), the
    // request goes on as it came, and a bundled worker is told to refuse it.
    let image = parse(
        &t,
        br#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"what is it?"},{"type":"image_url","image_url":{"url":"x"}}]}]}"#,
        true,
    )
    .unwrap();
    let system = [super::openai::ChatMessage::text("system", "be brief")];
    let prefix = super::openai::byte_tokens(&super::openai::render_chat(&system, false));
    assert_eq!((image.media, &image.tokens), (true, &prefix));
    assert_eq!(
        generate_body(&image, crate::protocol::Salt::NONE, true)["media"],
        true
    );
    let only = parse(
        &t,
        br#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}"#,
        true,
    )
    .unwrap();
    assert!(only.media && only.tokens.is_empty());
    assert!(
        generate_body(&chat, crate::protocol::Salt::NONE, true)
            .get("media")
            .is_none()
    );
    for (body, chat) in [
        (&b"{not json"[..], false),
        (br#"{"model":"m","prompt":""}"#, false),
        (br#"{"model":"m","messages":[]}"#, true),
        (br#"{"prompt":"x"}"#, false),
        (br#"{"model":"m","prompt":"x","n":0}"#, false),
        (br#"{"model":"m","prompt":"x","cache_salt":""}"#, false),
    ] {
        let e = parse(&t, body, chat).unwrap_err();
        assert_eq!(e.status, 400, "{}", String::from_utf8_lossy(body));
    }
}

#[test]
fn config_limits_are_checked() {
    assert_eq!(IngressConfig::default().validate(), Ok(()));
    let zero = IngressConfig {
        relay_idle_timeout_ms: 0,
        ..IngressConfig::default()
    };
    assert!(matches!(
        zero.validate(),
        Err(IngressConfigError::TooSmall {
            field: "relay_idle_timeout_ms",
            ..
        })
    ));
}

#[test]
fn response_ids_do_not_repeat() {
    let ids: std::collections::BTreeSet<String> =
        (0..10_000).map(|_| openai::response_id("cmpl-")).collect();
    assert_eq!(ids.len(), 10_000);
    assert!(
        ids.iter()
            .all(|i| i.starts_with("cmpl-") && i.len() == 5 + 24)
    );
}

/// With an API key, a request's tenant is its key unless the tenant header is trusted (a
/// gateway sets it): a client naming a new tenant per request would otherwise take the
/// others' fair share. Without keys, the header names the tenant.
#[test]
fn a_key_s_requests_are_its_tenant_unless_the_header_is_trusted() {
    use super::admission::{Class, ClassHeaders};
    let mut headers = hyper::HeaderMap::new();
    headers.insert("x-kvroute-tenant", "someone-else".parse().unwrap());
    let tenant = |names: &ClassHeaders, key: Option<usize>| {
        Class::read(names, &headers, key, None, None)
            .unwrap()
            .tenant
            .to_string()
    };
    let untrusted = ClassHeaders::default();
    assert_eq!(tenant(&untrusted, Some(3)), "key-3");
    assert_eq!(tenant(&untrusted, None), "someone-else");
    let trusted = ClassHeaders {
        trust_tenant: true,
        ..ClassHeaders::default()
    };
    assert_eq!(tenant(&trusted, Some(3)), "someone-else");
    let none = hyper::HeaderMap::new();
    assert_eq!(
        Class::read(&untrusted, &none, None, None, None)
            .unwrap()
            .tenant
            .as_ref(),
        "default"
    );
}
