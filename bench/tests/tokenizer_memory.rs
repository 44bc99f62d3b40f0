//! Parsing a request costs memory in proportion to what the router reads. A prompt cut by
//! `truncate_prompt_tokens` costs what tokenizing it whole costs, however
//! few tokens it keeps: the cut must not go through `Encoding::truncate`, which makes one
//! encoding of every window it drops (millions for a long text kept to its last few
//! tokens). The test owns the process's allocator (a counting one), which is why it lives
//! in a crate of its own test binaries.
#![allow(missing_docs, clippy::unwrap_used)]

use std::alloc::System;

use kvroute::ingress::tokenizer::Tokenizer;
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// The counts are the whole process's: one test at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A word-level tokenizer in the Hugging Face format whose post-processor adds a BOS, as
/// Llama's does.
fn tokenizer() -> Tokenizer {
    let dir = std::env::temp_dir().join(format!("kvroute-tok-mem-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "decoder": null,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "BOS", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "BOS", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"BOS": {"id": "BOS", "ids": [3], "tokens": ["BOS"]}}
        },
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1, "world": 2, "BOS": 3}, "unk_token": "[UNK]"}
    });
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, json.to_string()).unwrap();
    let t = Tokenizer::load(&path).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    t
}

/// Bytes allocated (not net: every allocation counts) while `f` runs.
fn allocated<T>(f: impl FnOnce() -> T) -> (u64, T) {
    let region = Region::new(GLOBAL);
    let out = f();
    (region.change().bytes_allocated as u64, out)
}

#[test]
fn a_long_prompt_cut_to_a_few_tokens_costs_no_more_than_encoding_it() {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let t = tokenizer();
    let text = "hello world ".repeat(100_000);
    let (whole, ids) = allocated(|| t.encode(&text, true).unwrap());
    assert_eq!(ids.len(), 200_001);
    let (cut, ids) = allocated(|| t.encode_within(&text, true, Some(2)).unwrap());
    assert_eq!(ids, [3, 2]);
    // Through `Encoding::truncate` the cut allocated 2.6 times what the whole encoding did
    // (607 against 233 MB in all for this 1.2 MB text), 100,000 overflowing pieces held
    // at once; now about as much.
    assert!(
        cut <= whole + whole / 4,
        "cutting allocated {cut} bytes, encoding whole {whole}"
    );
}

/// Fields the router does not read cost nothing to skip: a `stream_options` key it does
/// not know, holding a million small values (2 MB), was buffered as JSON values (109 MB
/// allocated on the parent commit), as was a `vllm_xargs.kv_cache_report_mode` of them;
/// and a chat body of that many values is refused before it is read.
#[test]
fn values_the_router_does_not_read_are_not_kept() {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let zeros = vec!["0"; 1_000_000].join(",");
    let completion = format!(
        r#"{{"model":"m","prompt":"hi","stream":true,"stream_options":{{"include_usage":true,"x":[{zeros}]}}}}"#
    );
    let t = Tokenizer::Bytes;
    let (bytes, tokens) =
        allocated(|| kvroute::ingress::decode_request(&t, completion.as_bytes(), false).unwrap());
    assert_eq!(tokens, 2);
    assert!(bytes < 1 << 20, "{bytes} bytes to skip a 2 MB field");
    // The one value of `vllm_xargs` the router reads was held as a JSON value whatever it
    // was (about 100 MB allocated for this array).
    let xargs = format!(
        r#"{{"model":"m","prompt":"hi","vllm_xargs":{{"kv_cache_report_mode":[{zeros}]}}}}"#
    );
    let (bytes, tokens) =
        allocated(|| kvroute::ingress::decode_request(&t, xargs.as_bytes(), false).unwrap());
    assert_eq!(tokens, 2);
    assert!(bytes < 1 << 20, "{bytes} bytes to skip a 2 MB report mode");
    let chat = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"tools":[{zeros}]}}"#
    );
    let (bytes, refused) =
        allocated(|| kvroute::ingress::decode_request(&t, chat.as_bytes(), true).unwrap_err());
    assert_eq!(refused.status, 413);
    assert!(bytes < 1 << 20, "{bytes} bytes to refuse a 2 MB chat");
}
