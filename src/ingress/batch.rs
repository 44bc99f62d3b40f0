//! Completions whose `prompt` lists several prompts (vLLM and OpenAI take a list of texts or
//! of token lists; evaluation harnesses send them). The router splits such a request into
//! one request per prompt ([`openai::split_batch`]), each tokenized, routed, booked, retried
//! and relayed on its own as any single request is, so a batch spreads over the fleet by
//! cache and load instead of landing whole on one worker. The answers are merged back into
//! the one answer vLLM gives a batch (`serving_completion.py`): prompt `i`'s `j`-th choice
//! has index `i·n + j`, the usage is summed, and a stream carries the prompts' chunks as
//! they come, one usage chunk (if asked for) and one `[DONE]` at its end. If a prompt
//! fails before its answer starts, the whole request fails with its error, as vLLM fails a
//! batch; the other prompts' requests are dropped, which cancels them on their workers.

use std::convert::Infallible;
use std::sync::Arc;

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper::{HeaderMap, Response, StatusCode, header};
use serde_json::{Map, Value};

use super::openai::{self, ApiError};
use super::{Router, complete};
use crate::http::Body;
use crate::http::budget::Reservation;

/// Answers a completions request whose `body` lists several prompts.
pub(super) async fn complete_batch(
    router: &Arc<Router>,
    headers: &HeaderMap,
    api_key: Option<usize>,
    body: &[u8],
) -> Result<Response<Body>, ApiError> {
    let Some(parts) = openai::split_batch(body)? else {
        return Err(ApiError::bad_request("expected a prompt list"));
    };
    let first: openai::CompletionRequest = serde_json::from_slice(&parts[0])
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))?;
    let n = first.n.unwrap_or(1).max(1);
    let stream = first.stream.unwrap_or(false);
    let include_usage = openai::include_usage(first.stream_options);
    let answers = futures_util::future::try_join_all(parts.into_iter().map(|part| async move {
        // Each part is a body the router holds, as the one it was split from was.
        let mut held = Reservation::default();
        if !router.bodies.cover(&mut held, part.len()) {
            return Err(ApiError::bodies_over_budget(router.bodies.bytes()));
        }
        complete(router, headers, api_key, part, held, false).await
    }))
    .await?;
    let mut response = Response::builder().status(StatusCode::OK);
    if let Some(first) = answers.first() {
        for (name, value) in first.headers() {
            if name != header::CONTENT_LENGTH {
                response = response.header(name, value);
            }
        }
    }
    let bodies: Vec<Body> = answers.into_iter().map(|a| a.into_body()).collect();
    let body = if stream {
        merge_streams(bodies, n, include_usage)
    } else {
        let mut values = Vec::with_capacity(bodies.len());
        for body in bodies {
            let bytes = body
                .collect()
                .await
                .unwrap_or_else(|never| match never {})
                .to_bytes();
            values.push(serde_json::from_slice::<Value>(&bytes).map_err(|e| {
                ApiError::bad_gateway(format!("a prompt's answer is not JSON: {e}"))
            })?);
        }
        Full::new(Bytes::from(merge_answers(values, n).to_string())).boxed()
    };
    Ok(response
        .body(body)
        .expect("invariant: the parts' headers were valid"))
}

/// The prompts' answers as one: the first's fields, every prompt's choices renumbered
/// (prompt `i`'s choice `j` is `i·n + j`), and the usage summed.
fn merge_answers(answers: Vec<Value>, n: u32) -> Value {
    let mut merged = Value::Null;
    let mut choices = Vec::new();
    let mut usage = Usage::default();
    for (i, mut answer) in answers.into_iter().enumerate() {
        usage.add(answer.get("usage"));
        if let Some(Value::Array(list)) = answer.get_mut("choices").map(Value::take) {
            choices.extend(list.into_iter().map(|c| renumbered(c, i, n)));
        }
        if merged.is_null() {
            merged = answer;
        }
    }
    if let Value::Object(fields) = &mut merged {
        fields.insert("choices".into(), Value::Array(choices));
        if fields.get("usage").is_some_and(|u| !u.is_null()) {
            fields.insert("usage".into(), usage.to_json());
        }
    }
    merged
}

/// A choice of prompt `prompt` with its index moved past the earlier prompts' `n` each.
fn renumbered(mut choice: Value, prompt: usize, n: u32) -> Value {
    if let Some(index) = choice.get_mut("index") {
        let own = index.as_u64().unwrap_or(0);
        *index = Value::from(prompt as u64 * u64::from(n) + own);
    }
    choice
}

/// Token counts summed over the prompts.
#[derive(Debug, Default)]
struct Usage {
    prompt_tokens: u64,
    completion_tokens: u64,
    cached_tokens: Option<u64>,
}

impl Usage {
    fn add(&mut self, usage: Option<&Value>) {
        let Some(usage) = usage.filter(|u| u.is_object()) else {
            return;
        };
        let count = |v: Option<&Value>| v.and_then(Value::as_u64).unwrap_or(0);
        self.prompt_tokens += count(usage.get("prompt_tokens"));
        self.completion_tokens += count(usage.get("completion_tokens"));
        if let Some(cached) = usage
            .get("prompt_tokens_details")
            .and_then(|d| d.get("cached_tokens"))
            .and_then(Value::as_u64)
        {
            *self.cached_tokens.get_or_insert(0) += cached;
        }
    }

    fn to_json(&self) -> Value {
        let mut usage = Map::new();
        usage.insert("prompt_tokens".into(), self.prompt_tokens.into());
        usage.insert(
            "total_tokens".into(),
            (self.prompt_tokens + self.completion_tokens).into(),
        );
        usage.insert("completion_tokens".into(), self.completion_tokens.into());
        if let Some(cached) = self.cached_tokens {
            usage.insert(
                "prompt_tokens_details".into(),
                serde_json::json!({ "cached_tokens": cached }),
            );
        }
        Value::Object(usage)
    }
}

/// The prompts' streams as one: their events as they come, choices renumbered; their
/// `[DONE]`s and usage chunks held back, and at the end one usage chunk with the sums (if
/// asked for) and one `[DONE]`.
fn merge_streams(parts: Vec<Body>, n: u32, include_usage: bool) -> Body {
    let streams = parts
        .into_iter()
        .enumerate()
        .map(|(i, body)| body.into_data_stream().map(move |data| (i, data)).boxed());
    let merge = Merge {
        n,
        include_usage,
        usage: Usage::default(),
        usage_chunk: None,
    };
    let mut all = futures_util::stream::select_all(streams);
    // A task merges (the parts' streams are not `Sync`, a response body must be); the
    // client leaving ends it, which drops the parts and cancels them on their workers.
    // Each part's relay already holds its events' share of the bodies' budget.
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(1);
    tokio::spawn(async move {
        let mut merge = merge;
        loop {
            let next = tokio::select! {
                biased;
                () = tx.closed() => return,
                next = all.next() => next,
            };
            let out = match next {
                Some((i, Ok(data))) => merge.rewrite(i, &data),
                Some((_, Err(never))) => match never {},
                None => {
                    let _ = tx.send(merge.tail()).await;
                    return;
                }
            };
            if !out.is_empty() && tx.send(out).await.is_err() {
                return;
            }
        }
    });
    let body = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|bytes| (Ok::<_, Infallible>(Frame::data(bytes)), rx))
    });
    BodyExt::boxed(StreamBody::new(body))
}

/// What merging the prompts' streams keeps.
struct Merge {
    n: u32,
    include_usage: bool,
    usage: Usage,
    /// The first usage chunk seen, the sums' template.
    usage_chunk: Option<Map<String, Value>>,
}

impl Merge {
    /// Prompt `prompt`'s whole server-sent events (each relay sends whole events) with
    /// their choices renumbered, less `[DONE]` and usage chunks.
    fn rewrite(&mut self, prompt: usize, data: &[u8]) -> Bytes {
        let mut out = Vec::with_capacity(data.len() + 16);
        for event in events(data) {
            let payload = event_data(event);
            match payload.as_deref().map(str::trim) {
                Some("[DONE]") => continue,
                Some(json) => match serde_json::from_str::<Value>(json) {
                    Ok(Value::Object(mut chunk)) => {
                        let usage_only = chunk
                            .get("choices")
                            .is_some_and(|c| c.as_array().is_some_and(Vec::is_empty))
                            && chunk.get("usage").is_some_and(Value::is_object);
                        if usage_only {
                            self.usage.add(chunk.get("usage"));
                            self.usage_chunk.get_or_insert(chunk);
                            continue;
                        }
                        if let Some(Value::Array(choices)) = chunk.get_mut("choices") {
                            for choice in choices.iter_mut() {
                                *choice = renumbered(choice.take(), prompt, self.n);
                            }
                        }
                        out.extend_from_slice(b"data: ");
                        out.extend_from_slice(Value::Object(chunk).to_string().as_bytes());
                        out.extend_from_slice(b"\n\n");
                    }
                    // Not a chunk (an error's text, say): as it came.
                    _ => {
                        out.extend_from_slice(event);
                        out.extend_from_slice(b"\n\n");
                    }
                },
                // Comments and other fields: as they came.
                None => {
                    out.extend_from_slice(event);
                    out.extend_from_slice(b"\n\n");
                }
            }
        }
        Bytes::from(out)
    }

    /// The end of the merged stream: the summed usage chunk if asked for, then `[DONE]`.
    fn tail(&mut self) -> Bytes {
        let mut out = Vec::new();
        if self.include_usage {
            let mut chunk = self.usage_chunk.take().unwrap_or_default();
            chunk.insert("choices".into(), Value::Array(Vec::new()));
            chunk.insert("usage".into(), self.usage.to_json());
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(Value::Object(chunk).to_string().as_bytes());
            out.extend_from_slice(b"\n\n");
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
        Bytes::from(out)
    }
}

/// The server-sent events in `data`, each without the blank line that ends it (`\n\n` or
/// `\r\n\r\n`); empty ones skipped.
fn events(data: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = data;
    std::iter::from_fn(move || {
        loop {
            if rest.is_empty() {
                return None;
            }
            let (event, next) = match find_blank_line(rest) {
                Some((end, skip)) => (&rest[..end], &rest[end + skip..]),
                None => (rest, &rest[rest.len()..]),
            };
            rest = next;
            let event = event.trim_ascii();
            if !event.is_empty() {
                return Some(event);
            }
        }
    })
}

/// Where the first blank line in `b` starts, and its length.
fn find_blank_line(b: &[u8]) -> Option<(usize, usize)> {
    (0..b.len()).find_map(|i| {
        if b[i..].starts_with(b"\n\n") {
            Some((i, 2))
        } else if b[i..].starts_with(b"\r\n\r\n") {
            Some((i, 4))
        } else {
            None
        }
    })
}

/// An event's `data` field (its `data:` lines joined by newlines), if it has one.
fn event_data(event: &[u8]) -> Option<String> {
    let mut data: Option<String> = None;
    for line in event.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(value) = line.strip_prefix(b"data:") {
            let value = value.strip_prefix(b" ").unwrap_or(value);
            let value = String::from_utf8_lossy(value);
            match &mut data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(&value);
                }
                None => data = Some(value.into_owned()),
            }
        }
    }
    data
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A body listing texts or token lists is split into one body per prompt, the other
    /// fields kept; one prompt, a token list, a mixed list or too many prompts are not.
    #[test]
    fn batches_split_into_one_body_per_prompt() {
        let parts =
            openai::split_batch(br#"{"model":"m","prompt":["a","b","c"],"n":2,"max_tokens":5}"#)
                .unwrap()
                .unwrap();
        let parts: Vec<Value> = parts
            .iter()
            .map(|p| serde_json::from_slice(p).unwrap())
            .collect();
        assert_eq!(parts.len(), 3);
        for (part, prompt) in parts.iter().zip(["a", "b", "c"]) {
            assert_eq!(
                part,
                &json!({"model":"m","prompt":prompt,"n":2,"max_tokens":5})
            );
        }
        let tokens = openai::split_batch(br#"{"model":"m","prompt":[[1,2],[3]]}"#)
            .unwrap()
            .unwrap();
        assert_eq!(tokens.len(), 2);
        assert_eq!(
            serde_json::from_slice::<Value>(&tokens[1]).unwrap()["prompt"],
            json!([3])
        );
        for single in [
            &br#"{"model":"m","prompt":"a"}"#[..],
            br#"{"model":"m","prompt":["a"]}"#,
            br#"{"model":"m","prompt":[1,2,3]}"#,
            br#"{"model":"m","prompt":["a",[1]]}"#,
        ] {
            assert_eq!(openai::split_batch(single).unwrap(), None);
        }
        let many = format!(
            r#"{{"model":"m","prompt":[{}]}}"#,
            vec![r#""x""#; openai::MAX_BATCH + 1].join(",")
        );
        assert_eq!(
            openai::split_batch(many.as_bytes()).unwrap_err().status,
            400
        );
    }

    /// vLLM's batch answer: prompt i's choice j is i·n + j, the usage is the sum.
    #[test]
    fn answers_merge_with_choices_renumbered_and_usage_summed() {
        let answer = |text: &str, prompt: u64, cached: u64| {
            json!({
                "id": format!("cmpl-{text}"), "object": "text_completion", "model": "m",
                "choices": [
                    {"index": 0, "text": format!("{text}0"), "finish_reason": "length"},
                    {"index": 1, "text": format!("{text}1"), "finish_reason": "length"},
                ],
                "usage": {"prompt_tokens": prompt, "completion_tokens": 4, "total_tokens": prompt + 4,
                          "prompt_tokens_details": {"cached_tokens": cached}},
            })
        };
        let merged = merge_answers(vec![answer("a", 3, 1), answer("b", 5, 2)], 2);
        assert_eq!(merged["id"], "cmpl-a");
        let texts: Vec<(u64, &str)> = merged["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| (c["index"].as_u64().unwrap(), c["text"].as_str().unwrap()))
            .collect();
        assert_eq!(texts, [(0, "a0"), (1, "a1"), (2, "b0"), (3, "b1")]);
        assert_eq!(
            merged["usage"],
            json!({"prompt_tokens": 8, "completion_tokens": 8, "total_tokens": 16,
                   "prompt_tokens_details": {"cached_tokens": 3}})
        );
    }

    /// Streams merge as their chunks come, renumbered; the parts' `[DONE]`s and usage
    /// chunks go, and the end carries one usage chunk with the sums and one `[DONE]`;
    /// comments and errors pass as they came.
    #[test]
    fn streams_merge_with_one_usage_chunk_and_one_done() {
        let mut merge = Merge {
            n: 1,
            include_usage: true,
            usage: Usage::default(),
            usage_chunk: None,
        };
        let chunk = |i: u64, text: &str| {
            format!(
                "data: {}\n\n",
                json!({"id":"c","object":"text_completion","choices":[{"index":i,"text":text}]})
            )
        };
        let usage = |p: u64| {
            format!(
                "data: {}\n\n",
                json!({"id":"c","choices":[],"usage":{"prompt_tokens":p,"completion_tokens":2,"total_tokens":p+2}})
            )
        };
        let a = merge.rewrite(0, format!("{}: ping\r\n\r\n", chunk(0, "x")).as_bytes());
        let b = merge.rewrite(
            1,
            format!("{}{}data: [DONE]\n\n", chunk(0, "y"), usage(7)).as_bytes(),
        );
        let c = merge.rewrite(0, format!("{}data: [DONE]\n\n", usage(3)).as_bytes());
        let e = merge.rewrite(0, b"data: {\"error\": {\"message\": \"m\"}}\n\n");
        let tail = merge.tail();
        let text = |b: &Bytes| String::from_utf8(b.to_vec()).unwrap();
        assert!(text(&a).contains(r#""index":0"#) && text(&a).contains(": ping\n\n"));
        assert!(text(&b).contains(r#""index":1"#) && !text(&b).contains("[DONE]"));
        assert!(!text(&b).contains("usage"));
        assert!(c.is_empty());
        assert!(text(&e).contains("error"));
        let tail = text(&tail);
        assert!(tail.ends_with("data: [DONE]\n\n"), "{tail}");
        assert_eq!(tail.matches("[DONE]").count(), 1);
        let usage_line = tail.lines().next().unwrap().strip_prefix("data: ").unwrap();
        let usage: Value = serde_json::from_str(usage_line).unwrap();
        assert_eq!(usage["usage"]["prompt_tokens"], 10);
        assert_eq!(usage["usage"]["completion_tokens"], 4);
        assert_eq!(usage["choices"], json!([]));
    }
}
