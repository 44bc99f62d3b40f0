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
        body: None,
    }
}

/// The body a bundled worker is sent for chat request `p`, read back.
fn generate_json(p: &Parsed, salt: crate::protocol::Salt) -> serde_json::Value {
    serde_json::from_slice(&generate_body(p, salt, true)).unwrap()
}

#[test]
fn the_error_decides_retry_fault_and_status() {
    // Overloaded, misdirected, broken or redirecting workers: another worker is tried.
    for code in [429, 421, 408, 500, 502, 503, 307, 308] {
        let e = status(code);
        assert!(e.retry_elsewhere(), "{code}");
        assert_eq!(e.fault(), Fault::Worker, "{code}");
        assert_eq!(e.to_api().status, 503, "{code}");
    }
    // A request the worker refuses on its merits goes back to the client as it is.
    for code in [400, 413, 422] {
        let e = status(code);
        assert!(!e.retry_elsewhere(), "{code}");
        assert_eq!(e.fault(), Fault::Client);
        assert_eq!(e.to_api().status, code);
        assert_eq!(e.label(), "refused");
    }
    // A 404 (the model or adapter not there after all: a registration out of date) is
    // tried elsewhere, and goes back to the client as it is if every worker says so; it
    // counts nothing towards the worker's ejection.
    let e = status(404);
    assert!(e.retry_elsewhere());
    assert_eq!(e.fault(), Fault::Client);
    assert_eq!(e.to_api().status, 404);
    assert_eq!(proxy::answered(Err(&e), false), Some(true));
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
    // A non-streamed answer that broke off, or was too large, after its success status was
    // generated: another worker would generate it again (and fail alike).
    for (source, label, code) in [
        (
            crate::http::BodyError::TooLarge { limit: 10 },
            "answer_too_large",
            502,
        ),
        (
            crate::http::BodyError::Io("reset".into()),
            "answer_failed",
            502,
        ),
        (
            crate::http::BodyError::OverBudget { budget: 10 },
            "answer_over_budget",
            429,
        ),
    ] {
        let e = ProxyError::Answer {
            worker: WorkerId(1),
            source,
        };
        assert!(!e.retry_elsewhere(), "{label}");
        assert_eq!((e.label(), e.to_api().status), (label, code));
    }
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
    // Integers sent as floats with no fraction are integers, as vLLM's pydantic models
    // take them (Python clients compute budgets in floats); a fraction is refused.
    let floats = parse(
        &t,
        br#"{"model":"m","prompt":"hi","max_tokens":256.0,"n":2.0,"priority":-1.0}"#,
        false,
    )
    .unwrap();
    assert_eq!(
        (floats.max_tokens, floats.n, floats.priority),
        (Some(256), 2, Some(-1))
    );
    let chat_floats = parse(
        &t,
        br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":7.0}"#,
        true,
    )
    .unwrap();
    assert_eq!(chat_floats.max_tokens, Some(7));
    // So are integers sent as strings, as pydantic's lax mode reads them (they were 400s
    // here, which vLLM answers).
    let texts = parse(
        &t,
        br#"{"model":"m","prompt":"hi","max_tokens":" 1_024 ","n":"2.00","priority":"-3"}"#,
        false,
    )
    .unwrap();
    assert_eq!(
        (texts.max_tokens, texts.n, texts.priority),
        (Some(1024), 2, Some(-3))
    );
    for bad in [
        &br#"{"model":"m","prompt":"hi","max_tokens":2.5}"#[..],
        br#"{"model":"m","prompt":"hi","n":-1}"#,
        br#"{"model":"m","prompt":"hi","max_tokens":"16.5"}"#,
        br#"{"model":"m","prompt":"hi","max_tokens":"16."}"#,
        br#"{"model":"m","prompt":"hi","max_tokens":"1__6"}"#,
        br#"{"model":"m","prompt":"hi","max_tokens":"_16"}"#,
        br#"{"model":"m","prompt":"hi","max_tokens":"sixteen"}"#,
        br#"{"model":"m","prompt":"hi","max_tokens":""}"#,
        br#"{"model":"m","prompt":"hi","max_tokens":"-1"}"#,
        br#"{"model":"m","prompt":"hi","max_tokens":[16]}"#,
    ] {
        assert_eq!(parse(&t, bad, false).unwrap_err().status, 400);
    }
    // A completion's max_tokens sent as null is unlimited, as vLLM reads it (its default
    // of 16 is for an absent field only).
    let unlimited = parse(
        &t,
        br#"{"model":"m","prompt":"hi","max_tokens":null}"#,
        false,
    )
    .unwrap();
    assert_eq!(
        (unlimited.max_tokens, unlimited.booked_max_tokens()),
        (None, u32::MAX)
    );
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
    // continue_final_message with add_generation_prompt true, or left at its default of
    // true, is refused as vLLM and transformers refuse it; with it false, accepted.
    for (generation, ok) in [
        ("", false),
        (r#","add_generation_prompt":true"#, false),
        (r#","add_generation_prompt":false"#, true),
    ] {
        let body = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}},{{"role":"assistant","content":"hi"}}],"continue_final_message":true{generation}}}"#
        );
        match parse(&t, body.as_bytes(), true) {
            Ok(_) => assert!(ok, "{generation} accepted"),
            Err(e) => assert!(!ok && e.status == 400, "{generation}: {e:?}"),
        }
    }
    // A prompt's text past max_tokenize_bytes is not tokenized: routed on load alone.
    // Control: at the limit, it is.
    for (limit, untokenized) in [(4, true), (5, false)] {
        let p = parse_within(&t, br#"{"model":"m","prompt":"hello"}"#, false, limit).unwrap();
        assert_eq!(
            (p.untokenized.is_some(), p.tokens.is_empty()),
            (untokenized, untokenized)
        );
        let chat = parse_within(
            &t,
            br#"{"model":"m","messages":[{"role":"user","content":"hello"}]}"#,
            true,
            if untokenized { 20 } else { 1 << 20 },
        )
        .unwrap();
        assert_eq!(chat.untokenized.is_some(), untokenized);
    }
    // It is booked at an estimate from its text's length (4 bytes a token), not as a prompt
    // of no tokens: a zero booked its prefill as free.
    let long = format!(r#"{{"model":"m","prompt":"{}"}}"#, "x".repeat(4000));
    let p = parse_within(&t, long.as_bytes(), false, 64).unwrap();
    assert!(p.untokenized.is_some() && p.tokens.is_empty());
    assert_eq!(p.prompt_tokens(), 1000);
    // At most what the engine keeps of it.
    let kept = format!(
        r#"{{"model":"m","prompt":"{}","truncate_prompt_tokens":100}}"#,
        "x".repeat(4000)
    );
    assert_eq!(
        parse_within(&t, kept.as_bytes(), false, 64)
            .unwrap()
            .prompt_tokens(),
        100
    );
    let p = parse_within(&t, long.as_bytes(), false, 1 << 20).unwrap();
    assert_eq!(p.prompt_tokens(), p.tokens.len());
    let long_chat = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(4000)
    );
    // A chat's rendering stops at the limit: at least that much.
    let p = parse_within(&t, long_chat.as_bytes(), true, 64).unwrap();
    assert!(
        p.untokenized.is_some() && p.prompt_tokens() >= 64 / 4,
        "{}",
        p.prompt_tokens()
    );
    // A chat body of a few hundred thousand small values is refused before it is read
    // (each became a JSON value of 80 B or more), as is a stream_options key's; a body
    // at the limit is read.
    let values = |n: usize| vec!["0"; n].join(",");
    let many = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"hi, [\"]:"}}],"tools":[{}]}}"#,
        values(openai::MAX_CHAT_VALUES)
    );
    assert_eq!(parse(&t, many.as_bytes(), true).unwrap_err().status, 413);
    let fits = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"hi, [\"]:"}}],"documents":[{}]}}"#,
        values(openai::MAX_CHAT_VALUES - 16)
    );
    assert!(parse(&t, fits.as_bytes(), true).is_ok());
    // An include_usage sent as null is vLLM's None: no usage chunk.
    for (options, usage) in [
        (r#"{"include_usage":null}"#, false),
        (r#"{"include_usage":false}"#, false),
        (r#"{"include_usage":true}"#, true),
        ("null", false),
    ] {
        let body =
            format!(r#"{{"model":"m","prompt":"hi","stream":true,"stream_options":{options}}}"#);
        let p = parse(&t, body.as_bytes(), false).unwrap();
        assert_eq!(p.include_usage, usage, "{options}");
    }
    let body = generate_json(&nulls, crate::protocol::Salt(9));
    assert_eq!(
        (
            body["max_tokens"].as_u64(),
            body["n"].as_u64(),
            body["salt"].as_u64()
        ),
        (Some(7), Some(3), Some(9))
    );
    assert!(
        generate_json(&chat, crate::protocol::Salt::NONE)
            .get("max_tokens")
            .is_none()
    );
    // A list of one prompt is that prompt, text or tokens; a longer one is a batch, which
    // the completions handler splits before (`batch`): parsed as one request, it says so.
    for one in [
        &br#"{"model":"m","prompt":["hi"]}"#[..],
        br#"{"model":"m","prompt":[[104,105]]}"#,
    ] {
        assert_eq!(parse(&t, one, false).unwrap().tokens, vec![104, 105]);
    }
    let batch = parse(&t, br#"{"model":"m","prompt":["a","b"]}"#, false).unwrap_err();
    assert_eq!(
        (batch.status, batch.code),
        (400, Some(openai::PROMPT_BATCH))
    );
    let empty = parse(&t, br#"{"model":"m","prompt":[]}"#, false).unwrap_err();
    assert!(
        empty.message.contains("must not be empty"),
        "{}",
        empty.message
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
    // The other part forms vLLM reads as text: bare strings, `input_text`, `output_text`,
    // `refusal`, untyped parts; a null text adds nothing. None of them is media.
    let forms = parse(
        &t,
        br#"{"model":"m","messages":[{"role":"assistant","content":[{"type":"output_text","text":null}]},{"role":"user","content":["a",{"type":"input_text","text":"b"}]}]}"#,
        true,
    )
    .unwrap();
    assert_eq!((forms.media, &forms.tokens), (false, &joined.tokens));
    let refusal = parse(
        &t,
        br#"{"model":"m","messages":[{"role":"assistant","content":[{"type":"refusal","refusal":"no"}]},{"role":"user","content":[{"text":"a\nb"}]}]}"#,
        true,
    )
    .unwrap();
    let said = parse(
        &t,
        br#"{"model":"m","messages":[{"role":"assistant","content":"no"},{"role":"user","content":"a\nb"}]}"#,
        true,
    )
    .unwrap();
    assert_eq!((refusal.media, &refusal.tokens), (false, &said.tokens));
    // An untyped part that is not text (vLLM names it by its field) is media.
    let untyped = parse(
        &t,
        br#"{"model":"m","messages":[{"role":"user","content":[{"image_url":{"url":"x"}}]}]}"#,
        true,
    )
    .unwrap();
    assert!(untyped.media && untyped.tokens.is_empty());
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
        generate_json(&image, crate::protocol::Salt::NONE)["media"],
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
        generate_json(&chat, crate::protocol::Salt::NONE)
            .get("media")
            .is_none()
    );
    for (body, chat) in [
        (&b"{not json"[..], false),
        (br#"{"model":"m","prompt":""}"#, false),
        (br#"{"model":"m","messages":[]}"#, true),
        (br#"{"model":"m","prompt":"x","n":0}"#, false),
        (br#"{"model":"m","prompt":"x","n":1025}"#, false),
        (br#"{"model":"m","prompt":"x","n":1000000}"#, false),
        (br#"{"model":"m","prompt":"x","cache_salt":""}"#, false),
    ] {
        let e = parse(&t, body, chat).unwrap_err();
        assert_eq!(e.status, 400, "{}", String::from_utf8_lossy(body));
    }
    let most = parse(&t, br#"{"model":"m","prompt":"x","n":1024}"#, false).unwrap();
    assert_eq!(most.n, MAX_N);
    // No model named parses, as vLLM takes it: which model is the fleet's to say (its only
    // one, or a 400 naming them; tests/tests/engines.rs).
    let unnamed = parse(&t, br#"{"prompt":"x"}"#, false).unwrap();
    assert_eq!(unnamed.model, "");
}

/// `stream_options` naming any option is refused without `stream: true`, as vLLM refuses it
/// (400, its message), on chat and completions alike; null and `{}` pass, as in vLLM.
#[test]
fn stream_options_without_stream_are_refused_as_vllm_refuses_them() {
    let t = Tokenizer::Bytes;
    for (stream, options, refused) in [
        ("", r#"{"include_usage":true}"#, true),
        (
            r#""stream":false,"#,
            r#"{"continuous_usage_stats":true}"#,
            true,
        ),
        (r#""stream":null,"#, r#"{"include_usage":null}"#, true),
        ("", "{}", false),
        ("", "null", false),
        (
            r#""stream":true,"#,
            r#"{"include_usage":true,"continuous_usage_stats":false}"#,
            false,
        ),
    ] {
        for chat in [false, true] {
            let prompt = if chat {
                r#""messages":[{"role":"user","content":"hi"}]"#
            } else {
                r#""prompt":"hi""#
            };
            let body = format!(r#"{{"model":"m",{prompt},{stream}"stream_options":{options}}}"#);
            match parse(&t, body.as_bytes(), chat) {
                Ok(_) => assert!(!refused, "{body} passed"),
                Err(e) => {
                    assert!(refused, "{body}: {}", e.message);
                    assert_eq!(
                        (e.status, e.message.as_str()),
                        (
                            400,
                            "Stream options can only be defined when `stream=True`."
                        )
                    );
                }
            }
        }
    }
}

/// `truncate_prompt_tokens` cuts the prompt to its last tokens before it is hashed, as vLLM
/// cuts it before computing it (text and token prompts, completions and chats); -1 leaves
/// it whole (the engine's context length is not known here); 0 and below -1 are refused.
#[test]
fn truncated_prompts_are_hashed_as_the_engine_keeps_them() {
    let t = Tokenizer::Bytes;
    let tokens = |body: &str, chat: bool| parse(&t, body.as_bytes(), chat).map(|p| p.tokens);
    let whole = tokens(r#"{"model":"m","prompt":"abcdef"}"#, false).unwrap();
    assert_eq!(whole.len(), 6);
    let cut = tokens(
        r#"{"model":"m","prompt":"abcdef","truncate_prompt_tokens":4}"#,
        false,
    );
    assert_eq!(cut.unwrap(), whole[2..]);
    let ids = tokens(
        r#"{"model":"m","prompt":[1,2,3,4,5],"truncate_prompt_tokens":2}"#,
        false,
    );
    assert_eq!(ids.unwrap(), [4, 5]);
    for keep in ["-1", "6", "100", "null"] {
        let body = format!(r#"{{"model":"m","prompt":"abcdef","truncate_prompt_tokens":{keep}}}"#);
        assert_eq!(tokens(&body, false).unwrap(), whole, "{keep}");
    }
    let chat = |keep: &str| {
        let body = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"hello"}}],"truncate_prompt_tokens":{keep}}}"#
        );
        tokens(&body, true)
    };
    let rendered = chat("null").unwrap();
    assert_eq!(chat("3").unwrap(), rendered[rendered.len() - 3..]);
    for bad in ["-2", "0"] {
        let body = format!(r#"{{"model":"m","prompt":"abc","truncate_prompt_tokens":{bad}}}"#);
        let e = tokens(&body, false).unwrap_err();
        assert_eq!(e.status, 400, "{}", e.message);
        assert!(
            e.message.contains("truncate_prompt_tokens"),
            "{}",
            e.message
        );
    }
}

/// A template that refuses the conversation cut before its first image (Llama 3.x's "no
/// first user message" with a lone system turn) does not get the request refused: the
/// engine renders the whole conversation, which the template takes; the router routes it
/// without a prefix.
#[test]
fn a_template_refusing_the_text_before_an_image_does_not_refuse_the_request() {
    let dir = std::env::temp_dir().join(format!("kvroute-media-tpl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "user": 1}, "unk_token": "[UNK]"}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let template = "{% if messages | length == 1 and messages[0].role == 'system' %}{{ raise_exception('no first user message') }}{% endif %}{% for m in messages %}{{ m.role }} {% endfor %}";
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::json!({"chat_template": template}).to_string(),
    )
    .unwrap();
    let t = Tokenizer::load(&dir.join("tokenizer.json")).unwrap();
    let image = parse(
        &t,
        br#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}"#,
        true,
    )
    .unwrap();
    assert!(image.media && image.tokens.is_empty());
    std::fs::remove_dir_all(&dir).ok();
}

/// A chat whose `tool_choice` is `none` renders no tools where the engines run with vLLM's
/// `--exclude-tools-when-tool-choice-none` (the router's flag of the same name); otherwise,
/// and for any other choice, its tools are rendered.
#[test]
fn tool_choice_none_leaves_the_tools_out_only_where_the_engines_do() {
    let dir = std::env::temp_dir().join(format!("kvroute-tool-choice-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "tools": 1, "hello": 2}, "unk_token": "[UNK]"}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let template =
        "{% if tools %}tools {% endif %}{% for m in messages %}{{ m.content }} {% endfor %}";
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::json!({"chat_template": template}).to_string(),
    )
    .unwrap();
    let mut t = Tokenizer::load(&dir.join("tokenizer.json")).unwrap();
    let body = |choice: &str| {
        format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"hello"}}],"tools":[{{"type":"function","function":{{"name":"f"}}}}],"tool_choice":"{choice}"}}"#
        )
    };
    let tokens =
        |t: &Tokenizer, choice: &str| parse(t, body(choice).as_bytes(), true).unwrap().tokens;
    assert_eq!(tokens(&t, "none"), [1, 2]);
    t.exclude_tools_when_tool_choice_none();
    assert_eq!(tokens(&t, "none"), [2]);
    assert_eq!(tokens(&t, "auto"), [1, 2]);
    std::fs::remove_dir_all(&dir).ok();
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
    // The largest body and the largest non-streamed answer must fit in the bodies' budget.
    let small = IngressConfig {
        body_memory_bytes: (64 << 20) - 1,
        ..IngressConfig::default()
    };
    assert_eq!(
        small.validate(),
        Err(IngressConfigError::TooSmall {
            field: "body_memory_bytes",
            min: 64 << 20
        })
    );
    // "Never" written as the largest number is refused, not a panic on every request.
    let never = IngressConfig {
        upstream_body_timeout_ms: u64::MAX,
        ..IngressConfig::default()
    };
    assert_eq!(
        never.validate(),
        Err(IngressConfigError::TooLarge {
            field: "upstream_body_timeout_ms",
            max: MAX_TIMEOUT_MS
        })
    );
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
    let tenant = |names: &ClassHeaders, key: Option<&str>| {
        Class::read(names, &headers, key, None, None)
            .unwrap()
            .tenant
            .to_string()
    };
    let untrusted = ClassHeaders::default();
    assert_eq!(tenant(&untrusted, Some("key-3")), "key-3");
    assert_eq!(tenant(&untrusted, None), "someone-else");
    let trusted = ClassHeaders {
        trust_tenant: true,
        ..ClassHeaders::default()
    };
    assert_eq!(tenant(&trusted, Some("key-3")), "someone-else");
    let none = hyper::HeaderMap::new();
    assert_eq!(
        Class::read(&untrusted, &none, None, None, None)
            .unwrap()
            .tenant
            .as_ref(),
        "default"
    );
}

/// With an API key, a request may lower its band but not raise it above 0 unless the
/// router trusts the priority it is given (a gateway sets it): otherwise any key could jump
/// every queue. Without keys, the band is as asked.
#[test]
fn a_key_s_requests_cannot_raise_their_band_unless_trusted() {
    use super::admission::{Class, ClassHeaders};
    let band = |names: &ClassHeaders,
                header: Option<&str>,
                key: Option<&str>,
                body: Option<i64>,
                tier: Option<&str>| {
        let mut headers = hyper::HeaderMap::new();
        if let Some(h) = header {
            headers.insert("x-kvroute-priority", h.parse().unwrap());
        }
        Class::read(names, &headers, key, body, tier).unwrap().band
    };
    let untrusted = ClassHeaders::default();
    let trusted = ClassHeaders {
        trust_priority: true,
        ..ClassHeaders::default()
    };
    // Raised by the header, vLLM's body priority (lower first) or the service tier.
    assert_eq!(band(&untrusted, Some("10"), Some("key-0"), None, None), 0);
    assert_eq!(band(&untrusted, None, Some("key-0"), Some(-5), None), 0);
    assert_eq!(
        band(&untrusted, None, Some("key-0"), None, Some("priority")),
        0
    );
    assert_eq!(band(&trusted, Some("10"), Some("key-0"), None, None), 10);
    assert_eq!(band(&trusted, None, Some("key-0"), Some(-5), None), 5);
    assert_eq!(band(&untrusted, Some("10"), None, None, None), 10);
    // Lowered: batch work may step aside.
    assert_eq!(band(&untrusted, Some("-3"), Some("key-0"), None, None), -3);
    assert_eq!(
        band(&untrusted, None, Some("key-0"), None, Some("flex")),
        -1
    );
}

/// Sessions are the tenant's and the model's: alike-named sessions of two tenants, or one
/// session's turns for two models, are kept apart.
#[test]
fn sessions_are_scoped_by_tenant_and_model() {
    use super::admission::{Class, ClassHeaders};
    let class = |tenant: &str, model: &str| {
        let mut headers = hyper::HeaderMap::new();
        headers.insert("x-kvroute-tenant", tenant.parse().unwrap());
        headers.insert("x-kvroute-session", "1".parse().unwrap());
        let mut c = Class::read(&ClassHeaders::default(), &headers, None, None, None).unwrap();
        c.scope_session(model);
        c.session.unwrap().0
    };
    assert_eq!(class("a", "m"), class("a", "m"));
    assert_ne!(class("a", "m"), class("b", "m"));
    assert_ne!(class("a", "m"), class("a", "n"));
}

mod queue {
    //! The queue's driver on a router over an in-process plane: workers are registrations
    //! only, and requests are admitted or queued (nothing is sent anywhere).

    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    use std::time::Duration;

    use super::super::admission::{Class, Entered, Outcome, Pumped, Queued, Routable};
    use super::super::{IngressConfig, Router, Tokenizer};
    use crate::discovery::LeaseConfig;
    use crate::events::plane::PlaneConfig;
    use crate::events::plane::tests::{Setup, info, settle};
    use crate::indexer::OverlapScores;
    use crate::scheduler::{self, RouteRequest, Scheduler, SessionRef};

    /// A router over two workers serving `models`, each with `budget` tokens of booked work
    /// (an idle worker always takes one request).
    async fn router(budget: u64, models: [&str; 2]) -> (Arc<Router>, Setup) {
        router_with(
            scheduler::AdmissionConfig {
                worker_budget_tokens: budget,
                ..Default::default()
            },
            models,
        )
        .await
    }

    async fn router_with(
        admission: scheduler::AdmissionConfig,
        models: [&str; 2],
    ) -> (Arc<Router>, Setup) {
        router_configured(admission, models, IngressConfig::default()).await
    }

    /// [`router_with`], the router configured as `config` says.
    async fn router_configured(
        admission: scheduler::AdmissionConfig,
        models: [&str; 2],
        config: IngressConfig,
    ) -> (Arc<Router>, Setup) {
        let scheduler = Scheduler::new(scheduler::Config {
            admission,
            ..Default::default()
        })
        .unwrap();
        let s = Setup::start(
            LeaseConfig::default(),
            crate::indexer::Config::default(),
            PlaneConfig::default(),
            scheduler,
        )
        .await;
        for (id, model) in [(1, models[0]), (2, models[1])] {
            s.local.put(crate::discovery::WorkerInfo {
                model: model.into(),
                ..info(id, 1)
            });
        }
        assert!(settle(|| s.scheduler.lock().workers().count() == 2).await);
        let router = Router::new(
            Arc::clone(&s.scheduler),
            s.plane.clone(),
            None,
            config,
            None,
            Tokenizer::Bytes,
        );
        (router, s)
    }

    fn enter<'a>(router: &'a Router, model: &str) -> Entered<'a> {
        enter_with(router, model, 16, None)
    }

    /// A request of `prompt_tokens` uncached tokens and 4 to generate, in hard `session`.
    fn enter_with<'a>(
        router: &'a Router,
        model: &str,
        prompt_tokens: usize,
        session: Option<&str>,
    ) -> Entered<'a> {
        try_enter_with(router, model, prompt_tokens, session)
            .unwrap_or_else(|e| panic!("{model}: {e:?}"))
    }

    /// [`enter_with`], refusals returned.
    fn try_enter_with<'a>(
        router: &'a Router,
        model: &str,
        prompt_tokens: usize,
        session: Option<&str>,
    ) -> Result<Entered<'a>, crate::ingress::openai::ApiError> {
        try_enter_in_band(router, model, prompt_tokens, session, 0)
    }

    /// [`try_enter_with`] in `band`.
    fn try_enter_in_band<'a>(
        router: &'a Router,
        model: &str,
        prompt_tokens: usize,
        session: Option<&str>,
        band: i64,
    ) -> Result<Entered<'a>, crate::ingress::openai::ApiError> {
        let class = Class {
            tenant: Arc::from("default"),
            band,
            session: session.map(|s| (s.to_owned(), true)),
            receipt: false,
        };
        let none = OverlapScores::default();
        let request = RouteRequest {
            model,
            blocks: &[],
            prompt_tokens,
            block_size: 4,
            overlaps: &none,
            max_tokens: 4,
            n: 1,
            session: session.map(|id| SessionRef { id, hard: true }),
        };
        let routable = || Routable {
            model: model.to_owned(),
            blocks: Vec::new(),
            prompt_tokens,
            block_size: 4,
            max_tokens: 4,
            n: 1,
            session: class.session.clone(),
        };
        router.enter(&class, &request, routable)
    }

    /// A drain answers the queued requests 503 with `Retry-After` at once, and refuses those
    /// that would queue after it: they waited out the drain and were cut off with no answer
    /// when the process ended, where another replica could have served them.
    #[tokio::test(start_paused = true)]
    async fn a_drain_sends_queued_requests_to_another_replica() {
        let (router, _plane) = router(100, ["a", "a"]).await;
        let mut admitted = Vec::new();
        for _ in 0..2 {
            let Entered::Admitted(a) = enter_with(&router, "a", 90, None) else {
                panic!("an idle worker admits");
            };
            admitted.push(a);
        }
        let Entered::Queued {
            guard: _q,
            rx: mut queued,
            ..
        } = enter_with(&router, "a", 90, None)
        else {
            panic!("both workers are full");
        };
        router.begin_drain();
        assert!(matches!(
            queued.try_recv(),
            Ok(Err(super::super::admission::Refusal::ShuttingDown))
        ));
        let Err(e) = try_enter_with(&router, "a", 90, None) else {
            panic!("a request queued during the drain");
        };
        assert_eq!(
            (e.status, e.retryable, e.retry_after_s),
            (503, true, 1),
            "{e:?}"
        );
        // Room during the drain still admits: requests on open connections are served.
        drop(admitted);
        assert!(matches!(
            enter_with(&router, "a", 90, None),
            Entered::Admitted(_)
        ));
    }

    /// With every slot of `max_inflight` taken by requests queued in a low band, a request of
    /// a higher band, read on a provisional slot, takes the newest one's place (it is
    /// answered 429, and its slot is the newcomer's); one of the same band or lower is
    /// refused once read, as is a higher one once no lower band waits, and with nothing
    /// queued a request is refused before it is read. Before, queued requests held every
    /// slot and each higher band's request was refused before it could be queued ahead.
    #[tokio::test(start_paused = true)]
    async fn a_higher_band_takes_a_lower_band_s_place_when_every_slot_is_taken() {
        use super::super::InFlight;
        use super::super::admission::Refusal;
        let (router, _plane) = router_configured(
            scheduler::AdmissionConfig {
                worker_budget_tokens: 100,
                ..Default::default()
            },
            ["a", "a"],
            IngressConfig {
                max_inflight: 2,
                ..IngressConfig::default()
            },
        )
        .await;
        let mut admitted = Vec::new();
        for _ in 0..2 {
            let Entered::Admitted(a) = enter_with(&router, "a", 90, None) else {
                panic!("an idle worker admits");
            };
            admitted.push(a);
        }
        let mut low = Vec::new();
        for _ in 0..2 {
            let slot = InFlight::take(&router).expect("a free slot");
            let Ok(Entered::Queued { guard, rx, .. }) =
                try_enter_in_band(&router, "a", 90, None, -1)
            else {
                panic!("both workers are full");
            };
            low.push((slot, guard, rx));
        }
        // Read on a provisional slot, then refused for its band.
        let refused = |band: i64| {
            let mut slot = InFlight::take(&router).expect("a provisional slot");
            let e = slot.confirm(band).unwrap_err();
            assert_eq!(e.status, 429, "{e:?}");
        };
        refused(-1);
        refused(-3);
        let mut high = InFlight::take(&router).expect("a provisional slot");
        high.confirm(5).expect("the newest low request's place");
        let (newest_slot, _guard, mut newest) = low.pop().unwrap();
        assert!(matches!(
            newest.try_recv(),
            Ok(Err(Refusal::Displaced { band: -1, by: 5 }))
        ));
        drop(newest_slot);
        assert!(low[0].2.try_recv().is_err(), "the older one still waits");
        let mut also_high = InFlight::take(&router).expect("a provisional slot");
        also_high.confirm(1).expect("the older one's place");
        assert!(matches!(
            low[0].2.try_recv(),
            Ok(Err(Refusal::Displaced { band: -1, by: 1 }))
        ));
        low.clear();
        // Something of a lower band must wait for a request to be read over the limit.
        let Err(e) = InFlight::take(&router) else {
            panic!("a provisional slot with nothing queued");
        };
        assert_eq!(e.status, 429, "{e:?}");
        assert_eq!(router.inflight.load(Ordering::Relaxed), 2);
        assert_eq!(router.provisional.load(Ordering::Relaxed), 0);
        drop((high, also_high));
    }

    /// How [`a_later_request_waits_behind`] fills its two workers (a budget of 100 tokens each;
    /// a request's work is its tokens and 4 to generate).
    struct Scene<'a> {
        /// The first request's tokens and hard session: it goes to the first worker.
        first: (usize, Option<&'a str>),
        /// The second request's tokens: it goes to the other worker.
        other: usize,
        /// Eject the first worker (three failures) before the queued request comes.
        eject_first: bool,
        /// The queued hard-session request's tokens and session.
        queued: (usize, &'a str),
    }

    /// Fills two workers as `scene` says, then queues its hard-session request and a later
    /// 10-token one of the same model, which would fit in the room the first waits for: the
    /// later one must not take that room first, and the first gets a worker once one frees
    /// up (the first worker, or the other if the first was ejected). The first worker, and
    /// where the queued request went.
    async fn a_later_request_waits_behind(
        scene: Scene<'_>,
    ) -> (crate::scheduler::WorkerKey, crate::scheduler::WorkerKey) {
        let (router, _plane) = router(100, ["a", "a"]).await;
        let Entered::Admitted(first) = enter_with(&router, "a", scene.first.0, scene.first.1)
        else {
            panic!("an idle fleet admits");
        };
        let filled = first.0.chosen.key;
        let Entered::Admitted(other) = enter_with(&router, "a", scene.other, None) else {
            panic!("the other worker is idle");
        };
        assert_ne!(other.0.chosen.key, filled);
        if scene.eject_first {
            let now = router.now_ms();
            let mut scheduler = router.scheduler.lock();
            for _ in 0..3 {
                scheduler.worker_unreachable(filled.0, now);
            }
            assert!(scheduler.ejected(filled, now));
        }
        let (tokens, session) = scene.queued;
        let Entered::Queued {
            guard: _h,
            rx: mut turn,
            ..
        } = enter_with(&router, "a", tokens, Some(session))
        else {
            panic!("the request fits nowhere it may go");
        };
        let Entered::Queued {
            guard: _p,
            rx: mut small,
            ..
        } = enter_with(&router, "a", 10, None)
        else {
            panic!("its model has a request waiting");
        };
        router.pump();
        assert!(
            small.try_recv().is_err(),
            "a later request took the room the first waits for"
        );
        let (freed, kept) = if scene.eject_first {
            (other, first)
        } else {
            (first, other)
        };
        drop(freed);
        router.pump();
        let Ok(Ok((d, _))) = turn.try_recv() else {
            panic!("the waiting request was not admitted");
        };
        drop(kept);
        (filled, d.chosen.key)
    }

    /// A request waiting for its hard session's worker keeps that worker's room: a later,
    /// smaller request does not take it (which would keep the first waiting, perhaps to its
    /// deadline), and the first gets the worker once it frees up. 64 tokens do not fit the
    /// session's worker (over half its budget, counted as 50: 110 > 100); 14 would.
    #[tokio::test(start_paused = true)]
    async fn a_hard_session_s_worker_is_kept_for_it() {
        let (pinned, went) = a_later_request_waits_behind(Scene {
            first: (56, Some("s")),
            other: 96,
            eject_first: false,
            queued: (60, "s"),
        })
        .await;
        assert_eq!(went, pinned);
    }

    /// A hard-session request whose session has no worker yet waits like any request: a
    /// later, smaller one of its model does not take the room it waits for first (44 tokens
    /// fit nowhere: 60 + 44 > 100; 14 would fit beside the 60).
    #[tokio::test(start_paused = true)]
    async fn a_new_hard_session_is_not_overtaken() {
        a_later_request_waits_behind(Scene {
            first: (56, None),
            other: 96,
            eject_first: false,
            queued: (40, "new"),
        })
        .await;
    }

    /// A hard-session request whose session's worker sits out an ejection is held to no
    /// worker: it waits for room anywhere (44 tokens do not fit beside the other worker's
    /// 60), and a later, smaller request of its model does not take that room first. (Held
    /// to the ejected worker, it kept that worker's room, which nothing could use, and
    /// blocked only its own session, so the smaller one took the room it waited for, and
    /// every later one could, up to its deadline.)
    #[tokio::test(start_paused = true)]
    async fn a_hard_session_whose_worker_sits_out_is_not_overtaken() {
        let (stuck, went) = a_later_request_waits_behind(Scene {
            first: (16, Some("s")),
            other: 56,
            eject_first: true,
            queued: (44, "s"),
        })
        .await;
        assert_ne!(went, stuck, "an ejected worker sits out");
    }

    /// A request waiting for the fleet's budget holds back every later one, of any model:
    /// any admission would take the room it waits for. Once it is admitted, the door
    /// opens again.
    #[tokio::test(start_paused = true)]
    async fn a_request_waiting_for_the_fleet_budget_holds_back_every_model() {
        let (router, _plane) = router_with(
            scheduler::AdmissionConfig {
                worker_budget_tokens: 1_000,
                fleet_budget_tokens: 100,
                ..Default::default()
            },
            ["a", "b"],
        )
        .await;
        let Entered::Admitted(first) = enter_with(&router, "a", 56, None) else {
            panic!("an idle fleet admits");
        };
        // 60 + 44 > 100: waits for the fleet.
        let Entered::Queued {
            guard: _waiting,
            mut rx,
            ..
        } = enter_with(&router, "a", 40, None)
        else {
            panic!("the fleet's budget had room");
        };
        // 60 + 14 fits, but the room is the waiting request's.
        let Entered::Queued {
            guard: _b,
            rx: mut b,
            ..
        } = enter_with(&router, "b", 10, None)
        else {
            panic!("another model's request took the room the fleet's waiting request needs");
        };
        router.pump();
        assert!(rx.try_recv().is_err() && b.try_recv().is_err());
        drop(first);
        router.pump();
        assert!(
            matches!(rx.try_recv(), Ok(Ok(_))),
            "the waiting request was not admitted"
        );
        assert!(
            matches!(b.try_recv(), Ok(Ok(_))),
            "the later request was not admitted after it"
        );
        assert!(matches!(
            enter_with(&router, "b", 4, None),
            Entered::Admitted(_)
        ));
    }

    /// A LoRA adapter's requests compete for its base model's workers: one does not take
    /// the room a base-model request waits for (nor the other way round), while another
    /// model's request still goes past.
    #[tokio::test(start_paused = true)]
    async fn an_adapter_waits_behind_its_base_model() {
        use crate::protocol::{DpRank, WorkerId};
        let (router, _plane) = router(100, ["a", "b"]).await;
        router
            .scheduler
            .lock()
            .set_adapters((WorkerId(1), DpRank(0)), vec!["a-lora".into()]);
        let Entered::Admitted(_first) = enter_with(&router, "a", 56, None) else {
            panic!("an idle worker admits");
        };
        // 60 + 44 > 100: waits.
        let Entered::Queued {
            guard: _waiting, ..
        } = enter_with(&router, "a", 40, None)
        else {
            panic!("the base model's request found room");
        };
        // 60 + 14 fits, but the room is the waiting request's.
        assert!(
            matches!(
                enter_with(&router, "a-lora", 10, None),
                Entered::Queued { .. }
            ),
            "the adapter's request took the room its base model's waits for"
        );
        assert!(matches!(
            enter_with(&router, "b", 10, None),
            Entered::Admitted(_)
        ));
    }

    /// A pump reads overlaps a few tickets at a time with the queue unlocked: when room frees
    /// up for many queued requests at once, one pump still admits every one of them.
    #[tokio::test(start_paused = true)]
    async fn one_pump_admits_more_than_it_reads_at_a_time() {
        // Room for 40 requests of 20 tokens' work (16 of prompt, 4 to generate).
        let (router, _plane) = router(800, ["a", "b"]).await;
        let running: Vec<_> = (0..40)
            .map(|i| match enter(&router, "a") {
                admitted @ Entered::Admitted(_) => admitted,
                Entered::Queued { .. } => panic!("request {i} found no room"),
            })
            .collect();
        let mut queued = Vec::new();
        const { assert!(2 * super::super::admission::READ_AHEAD < 40) };
        for i in 0..40 {
            let Entered::Queued { guard, rx, .. } = enter(&router, "a") else {
                panic!("request {i} found room in a full fleet");
            };
            queued.push((guard, rx));
        }
        router.pump();
        assert!(queued.iter_mut().all(|(_, rx)| rx.try_recv().is_err()));
        drop(running);
        router.pump();
        for (i, (_, rx)) in queued.iter_mut().enumerate() {
            assert!(
                matches!(rx.try_recv(), Ok(Ok(_))),
                "queued request {i} was not admitted"
            );
        }
    }

    /// A non-streamed request's prefill is released once its prompt's last block shows in
    /// its worker's index; not for a worker whose index entries are guesses made when the
    /// request was routed (an engine without KV events), where it shows at once.
    #[tokio::test(start_paused = true)]
    async fn prefill_is_released_by_the_index_only_where_it_is_not_guessed() {
        use crate::events::plane::tests::batch;
        use crate::protocol::{Salt, WorkerId, hash_blocks};
        use std::num::NonZeroUsize;
        let (router, plane) = router(1, ["a", "b"]).await;
        // Worker 1 announces the 16-token prompt's 4 blocks (block size 4).
        plane.publish(1, batch(1, 1, 16)).await;
        assert!(settle(|| plane.plane.indexer().sizes().blocks == 4).await);
        let tokens: Vec<u32> = (0..16).collect();
        let last = hash_blocks(&tokens, NonZeroUsize::new(4).unwrap(), Salt::NONE)
            .last()
            .unwrap()
            .seq;
        for guessed in [false, true] {
            if guessed {
                let (tx, _rx) = tokio::sync::mpsc::channel(1);
                router.report_decisions(tx, [WorkerId(1)].into());
            }
            let Entered::Admitted(admitted) = enter(&router, "a") else {
                panic!("an idle worker admits");
            };
            let (decision, booking) = *admitted;
            let mut booking = booking.expecting(WorkerId(1), Some(last));
            let answer = tokio::time::sleep(std::time::Duration::from_millis(500));
            super::super::proxy::watch_prefill(&router, decision.chosen.key, &mut booking, answer)
                .await;
            assert_eq!(booking.prefill_open(), guessed, "guessed: {guessed}");
        }
    }

    /// Under overload a pump's work does not grow with the queue: once every pool with a
    /// request waiting is held back, what is behind could only be passed over, and the walk
    /// ends (it visited all 5,000 tickets, with the queue locked, at every pump: every
    /// request queued and every token of room released); and it reads the overlaps of
    /// about one ticket a pool, not a round of [`READ_AHEAD`](super::super::admission::READ_AHEAD)
    /// (16 lookups of which 14 went unused). A pool with room behind them is still reached
    /// ([`one_model_s_backlog_holds_back_no_other_model`]), and room for many is filled in
    /// one pump ([`one_pump_admits_more_than_it_reads_at_a_time`]).
    #[tokio::test(start_paused = true)]
    async fn a_pump_over_a_full_fleet_looks_at_a_few_tickets_whatever_the_depth() {
        let (router, _plane) = router(1, ["a", "b"]).await;
        let running = [enter(&router, "a"), enter(&router, "b")];
        assert!(running.iter().all(|e| matches!(e, Entered::Admitted(_))));
        let mut waiting = Vec::new();
        for i in 0..5_000 {
            let model = if i % 2 == 0 { "a" } else { "b" };
            let Entered::Queued { guard, rx, .. } = enter(&router, model) else {
                panic!("request {i} found room in a full fleet");
            };
            waiting.push((guard, rx));
        }
        let pumped = pump_full_then_free(&router, &mut waiting, running);
        // The first walk gathers the first ticket's overlaps to read (1 visited); the next
        // weighs it (it waits) and gathers the next two not held back (4); the third
        // weighs model b's first (it waits) and ends (2).
        assert!(
            pumped.visited <= 7 && pumped.read <= 3,
            "a pump over a full fleet looked at {} tickets and read {} overlaps",
            pumped.visited,
            pumped.read
        );
    }

    /// Pumps over a full fleet, where none of `waiting` may go, then again once `running`
    /// is dropped, when the first of them goes (the next in order): what the first pump
    /// cost.
    fn pump_full_then_free<R>(
        router: &Router,
        waiting: &mut [(Queued<'_>, tokio::sync::oneshot::Receiver<Outcome>)],
        running: R,
    ) -> Pumped {
        let pumped = router.pump();
        assert!(waiting.iter_mut().all(|(_, rx)| rx.try_recv().is_err()));
        drop(running);
        router.pump();
        assert!(matches!(waiting[0].1.try_recv(), Ok(Ok(_))));
        pumped
    }

    /// Turns of hard sessions whose worker's room is kept for an earlier turn wait without
    /// a lookup each: a pump over 40 such turns, both workers full, reads the overlaps of
    /// a few (it read every one, up to 1,024, at every pump), and the first turn gets its
    /// worker once room opens.
    #[tokio::test(start_paused = true)]
    async fn hard_session_turns_behind_a_kept_worker_wait_without_lookups() {
        let (router, _plane) = router(100, ["a", "a"]).await;
        // Forty sessions, each stuck to the worker its first turn went to.
        for i in 0..40 {
            let Entered::Admitted(first) = enter_with(&router, "a", 16, Some(&format!("s{i}")))
            else {
                panic!("an idle fleet admits session {i}");
            };
            drop(first);
        }
        // 60 tokens of work on each worker (a request's work is its tokens and 4): a turn
        // of 80 fits on neither.
        let running: Vec<_> = (0..2)
            .map(|_| match enter_with(&router, "a", 56, None) {
                admitted @ Entered::Admitted(_) => admitted,
                Entered::Queued { .. } => panic!("an idle worker admits"),
            })
            .collect();
        let big = |i: usize| {
            let Entered::Queued { guard, rx, .. } =
                enter_with(&router, "a", 76, Some(&format!("s{i}")))
            else {
                panic!("turn {i} found room in a full fleet");
            };
            (guard, rx)
        };
        let mut turns: Vec<_> = (0..40).map(big).collect();
        let pumped = pump_full_then_free(&router, &mut turns, running);
        assert!(
            pumped.read <= 4,
            "a pump over 40 kept turns read {} overlaps",
            pumped.read
        );
    }

    /// Queues a request behind a running one on a one-worker model, arms `break_pump` (a
    /// test hook that makes a pump panic) and lets room open: the queued request must still
    /// be admitted, by a later pump, and the hook must have fired. The router, for more
    /// checks.
    async fn admitted_after_a_pump_panicked(
        break_pump: fn(&Router) -> &std::sync::atomic::AtomicBool,
    ) -> (Arc<Router>, Setup) {
        let (router, plane) = router(1, ["a", "b"]).await;
        let running = enter(&router, "a");
        assert!(matches!(running, Entered::Admitted(_)));
        let Entered::Queued {
            guard: waiting,
            rx,
            ttl_ms,
        } = enter(&router, "a")
        else {
            panic!("the worker is busy: queued");
        };
        break_pump(&router).store(true, Ordering::Relaxed);
        // Room opens: the queue's task pumps, and that pump panics.
        drop(running);
        let outcome = tokio::time::timeout(Duration::from_millis(ttl_ms / 2), rx)
            .await
            .expect("no pump admitted the request after one panicked");
        assert!(matches!(outcome, Ok(Ok(_))));
        assert!(
            !break_pump(&router).load(Ordering::Relaxed),
            "no pump panicked"
        );
        drop((waiting, outcome));
        (router, plane)
    }

    /// A pump that panics (a broken invariant, with the queue locked) is logged and the next
    /// one goes on: the queued request is admitted once room opens, instead of waiting out
    /// its deadline behind a dead pump.
    #[tokio::test(start_paused = true)]
    async fn the_pump_after_one_that_panicked_admits_the_queue() {
        admitted_after_a_pump_panicked(|r| &r.break_next_walk).await;
    }

    /// A pump that panics after routing a ticket, before the ticket's handler has its booking,
    /// leaves no booking behind: the next pump routes the ticket again, and one booking is
    /// open, not two (the first had no guard yet, and nothing would ever release it). The
    /// admitted request's booking went with its outcome.
    #[tokio::test(start_paused = true)]
    async fn a_pump_that_panics_after_routing_leaves_no_booking_behind() {
        let (router, _plane) = admitted_after_a_pump_panicked(|r| &r.break_after_routing).await;
        assert_eq!(router.scheduler.lock().open_bookings(), 0);
    }

    /// A request of a model with nothing waiting is routed at once, whatever another model
    /// has queued; and one queued behind more than a pump weighs of another model's is still
    /// admitted once its worker has room.
    #[tokio::test(start_paused = true)]
    async fn one_model_s_backlog_holds_back_no_other_model() {
        let (router, _plane) = router(1, ["a", "b"]).await;
        let a0 = enter(&router, "a");
        assert!(matches!(a0, Entered::Admitted(_)));
        let a1 = enter(&router, "a");
        assert!(matches!(a1, Entered::Queued { .. }));
        let b0 = enter(&router, "b");
        assert!(
            matches!(b0, Entered::Admitted(_)),
            "model b's request waited behind model a's"
        );
        let mut a_waiting = Vec::new();
        for _ in 0..1100 {
            a_waiting.push(enter(&router, "a"));
        }
        let Entered::Queued {
            guard: _b1, mut rx, ..
        } = enter(&router, "b")
        else {
            panic!("b's worker is busy: queued");
        };
        drop(b0);
        router.pump();
        assert!(
            matches!(rx.try_recv(), Ok(Ok(_))),
            "b's request behind 1,101 of a's was not admitted"
        );
        drop((a0, a1, a_waiting));
        assert!(
            router.waiting_models.lock().is_empty(),
            "a model's count outlived its requests"
        );
    }
}

/// A socket the router itself could not open (out of file descriptors) is found however
/// deep the connect error wraps it, and nothing else is taken for it.
#[test]
fn local_exhaustion_is_found_in_an_error_chain() {
    use super::proxy::local_exhaustion;
    #[derive(Debug)]
    struct Wrap(std::io::Error);
    impl std::fmt::Display for Wrap {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("connect failed")
        }
    }
    impl std::error::Error for Wrap {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }
    for errno in [24, 23] {
        assert!(local_exhaustion(&Wrap(std::io::Error::from_raw_os_error(
            errno
        ))));
    }
    // Connection refused (111) is the worker's.
    assert!(!local_exhaustion(&Wrap(std::io::Error::from_raw_os_error(
        111
    ))));
    assert!(!local_exhaustion(&std::fmt::Error));
}

/// Percent escapes decode; a malformed one, or bytes that are not UTF-8, leave the text as
/// it came.
#[test]
fn path_parameters_are_percent_decoded() {
    assert_eq!(percent_decoded("Qwen%2FQwen3-8B"), "Qwen/Qwen3-8B");
    assert_eq!(percent_decoded("plain"), "plain");
    assert_eq!(percent_decoded("caf%C3%A9"), "café");
    for raw in ["bad%2", "bad%zz", "bad%FF", "bad%+F"] {
        assert_eq!(percent_decoded(raw), raw);
    }
}

/// Retries stay a fraction of the requests when everything fails: the bucket's `per_s`
/// first, then `percent` of the requests, and `per_s` more a second; none with both zero.
#[test]
fn the_retry_budget_is_a_fraction_of_requests_and_a_few_a_second() {
    let mut budget = RetryBudget::new(20, 10);
    let retries_at = |budget: &mut RetryBudget, now_ms: u64, requests: usize| {
        (0..requests)
            .filter(|_| {
                budget.on_request(now_ms);
                let retry = budget.has_retry(now_ms);
                if retry {
                    budget.spend();
                }
                retry
            })
            .count()
    };
    // 1,000 requests at once, every one failing: the 10 held, then one in five.
    let burst = retries_at(&mut budget, 0, 1_000);
    assert!((205..=215).contains(&burst), "{burst}");
    // A second later, the bucket is full again: its 10 (no more are held at once).
    let later = retries_at(&mut budget, 1_000, 20);
    assert!((12..=13).contains(&later), "{later}");
    // A quiet fleet: no share, a few a second.
    let mut quiet = RetryBudget::new(0, 10);
    assert_eq!(retries_at(&mut quiet, 0, 100), 10);
    assert_eq!(retries_at(&mut quiet, 500, 100), 5);
    let mut none = RetryBudget::new(0, 0);
    assert_eq!(retries_at(&mut none, 60_000, 100), 0);
}

/// A client's request id is kept if it is one (1 to 128 visible ASCII characters); else
/// the request gets a new one.
#[test]
fn a_request_id_is_the_client_s_or_a_new_one() {
    let with = |v: &str| {
        let mut h = hyper::HeaderMap::new();
        h.insert("x-request-id", header::HeaderValue::from_str(v).unwrap());
        request_id(&h)
    };
    assert_eq!(with("abc-123"), "abc-123");
    let made = |v: header::HeaderValue| {
        let v = v.to_str().unwrap().to_owned();
        v.starts_with("req-") && v.len() == 4 + 24
    };
    assert!(made(request_id(&hyper::HeaderMap::new())));
    assert!(made(with("two words")));
    assert!(made(with(&"x".repeat(129))));
    assert_eq!(with(&"x".repeat(128)), "x".repeat(128).as_str());
    assert_ne!(
        request_id(&hyper::HeaderMap::new()),
        request_id(&hyper::HeaderMap::new())
    );
}

/// Connections to workers keep TCP alive: a worker whose host died (no FIN, no RST) while a
/// request waited for its non-streamed answer is noticed in about 25 s and the request
/// retried, where it waited the whole answer deadline.
#[tokio::test]
async fn connections_to_workers_keep_tcp_alive() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let uri: hyper::Uri = format!("http://{}", listener.local_addr().unwrap())
        .parse()
        .unwrap();
    let mut connector = worker_connector(&IngressConfig::default());
    let (io, accepted) = tokio::join!(
        tower_service::Service::call(&mut connector, uri),
        listener.accept()
    );
    let (io, _accepted) = (io.unwrap(), accepted.unwrap());
    let socket = socket2::SockRef::from(io.inner());
    assert!(socket.keepalive().unwrap());
    assert_eq!(
        socket.tcp_keepalive_time().unwrap(),
        Duration::from_secs(10)
    );
    assert!(socket.tcp_nodelay().unwrap());
}

/// vLLM's full KV event reporting is taken out of what an engine is sent (the mirror would
/// take its re-announced blocks for copies never removed); the rest of the body is written
/// as it came, in order, and a body without it is left alone.
#[test]
fn full_kv_event_reporting_is_taken_out_of_the_engine_s_body() {
    let t = Tokenizer::Bytes;
    let full = br#"{"model":"m","prompt":"hi","vllm_xargs":{"kv_cache_report_mode":"full","x":1},"z":[1, 2]}"#;
    assert!(parse(&t, full, false).unwrap().reports_full);
    let out = openai::without_report_mode(full).unwrap().unwrap();
    assert_eq!(
        std::str::from_utf8(&out).unwrap(),
        r#"{"model":"m","prompt":"hi","vllm_xargs":{"x":1},"z":[1, 2]}"#
    );
    let only = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"vllm_xargs":{"kv_cache_report_mode":"full"}}"#;
    assert!(parse(&t, only, true).unwrap().reports_full);
    let out = openai::without_report_mode(only).unwrap().unwrap();
    assert_eq!(
        std::str::from_utf8(&out).unwrap(),
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#
    );
    let escaped =
        br#"{"model":"m","prompt":"hi","vllm_xargs":{"kv_cache_report_mode":"\u0066ull"}}"#;
    assert!(parse(&t, escaped, false).unwrap().reports_full);
    for kept in [
        &br#"{"model":"m","prompt":"hi","vllm_xargs":{"kv_cache_report_mode":"incremental"}}"#[..],
        br#"{"model":"m","prompt":"kv_cache_report_mode"}"#,
        br#"{"model":"m","prompt":"hi","vllm_xargs":{"kv_cache_report_mode":null}}"#,
        br#"{"model":"m","prompt":"hi","vllm_xargs":{"kv_cache_report_mode":["full"]}}"#,
        br#"{"model":"m","prompt":"hi","vllm_xargs":{"kv_cache_report_mode":{"full":1.5}}}"#,
        br#"{"model":"m","prompt":"hi","vllm_xargs":{"kv_cache_report_mode":true}}"#,
    ] {
        assert!(!parse(&t, kept, false).unwrap().reports_full);
    }
    assert_eq!(
        openai::without_report_mode(br#"{"model":"m","prompt":"hi"}"#).unwrap(),
        None
    );
}
