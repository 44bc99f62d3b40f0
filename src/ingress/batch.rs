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

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream::FuturesUnordered;
use futures_util::{StreamExt, TryStreamExt};
use http_body_util::BodyExt;
use hyper::{HeaderMap, Response, StatusCode, header};
use serde::ser::{Serialize, SerializeMap, Serializer};
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::REQUEST_ID;
use super::openai::{self, ApiError, RawObject};
use super::proxy::error_events;
use super::{Router, complete};
use crate::http::budget::{GRAIN, Reservation};
use crate::http::{Body, BodyAborted};
use tokio::time::Instant;

/// Prompts of one batch in flight at once: a thousand prompts do not take a thousand of
/// the router's in-flight slots (`max_inflight`) together; the next starts as one ends.
const BATCH_CONCURRENCY: usize = 32;

/// Answers a completions request whose `body` lists several prompts.
pub(super) async fn complete_batch(
    router: &Arc<Router>,
    headers: &HeaderMap,
    api_key: Option<Arc<str>>,
    body: Bytes,
) -> Result<Response<Body>, ApiError> {
    let over = || ApiError::bodies_over_budget(router.bodies.bytes());
    // The body is held again while it is split (its first reservation went with the parse
    // that found it a batch), then the parts: each takes its share when it starts.
    let mut held = Reservation::default();
    if !router.bodies.cover(&mut held, body.len()) {
        return Err(over());
    }
    let limit = router.config.max_body_bytes;
    // Split, and the first part's settings read (up to a limit's worth of token ids), off
    // the runtime's threads.
    let Some((parts, first)) = router
        .off_runtime(move || {
            let Some(parts) = openai::split_batch(&body, limit)? else {
                return Ok(None);
            };
            let first: openai::CompletionRequest = serde_json::from_slice(&parts[0])
                .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))?;
            Ok::<_, ApiError>(Some((parts, first)))
        })
        .await??
    else {
        return Err(ApiError::bad_request("expected a prompt list"));
    };
    let total = parts.iter().map(Bytes::len).sum();
    if !router.bodies.cover(&mut held, total) {
        return Err(over());
    }
    let shares: Vec<Reservation> = parts
        .iter()
        .map(|part| {
            held.split_off(
                held.bytes()
                    .saturating_sub(part.len().next_multiple_of(GRAIN)),
            )
        })
        .collect();
    drop(held);
    let n = first.n.unwrap_or(1).max(1);
    let stream = first.stream.unwrap_or(false);
    let include_usage = openai::include_usage(first.stream_options);
    let count = parts.len();
    let (shared_router, shared_headers) = (Arc::clone(router), headers.clone());
    let part = move |(i, (part, held)): (usize, (Bytes, Reservation))| {
        let router = Arc::clone(&shared_router);
        let api_key = api_key.clone();
        let mut headers = shared_headers.clone();
        // Each prompt is a request of its own at the engine, under an id of its own (vLLM
        // refuses an id already running).
        if let Some(id) = headers.get(&REQUEST_ID).and_then(|v| v.to_str().ok())
            && let Ok(part_id) = header::HeaderValue::from_str(&format!("{id}-{i}"))
        {
            headers.insert(REQUEST_ID, part_id);
        }
        async move {
            (
                i,
                complete(&router, &headers, api_key, part, held, false).await,
            )
        }
    };
    let mut parts = parts.into_iter().zip(shares).enumerate().map(part);
    if !stream {
        let answers: Vec<Response<Body>> = futures_util::stream::iter(parts)
            .buffered(BATCH_CONCURRENCY)
            .map(|(_, answer)| answer)
            .try_collect()
            .await?;
        return merge_whole(router, answers, n).await;
    }
    let mut running: FuturesUnordered<_> = parts.by_ref().take(BATCH_CONCURRENCY).collect();
    // The answer starts with the first part that answers; one that fails before any has
    // fails the request with its status. Later failures are error events in the stream.
    let Some((i, answer)) = running.next().await else {
        return Err(ApiError::bad_request("expected a prompt list"));
    };
    let answer = answer?;
    let response = answer_headers(&answer);
    let mut merge = Merge::new(n, include_usage, count);
    let mut streams = futures_util::stream::SelectAll::new();
    streams.push(part_stream(i, answer));
    let idle = Duration::from_millis(router.config.relay_idle_timeout_ms);
    // A task merges (the parts' streams are not `Sync`, a response body must be). It keeps
    // starting parts and taking their answers while the client is sent what is merged, so
    // a slow client holds no part back; one that reads nothing for the idle timeout, or
    // leaves, ends it, which drops the parts and cancels them on their workers. Each part's
    // relay holds its own events' share of the bodies' budget.
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(1);
    // Set once the last words are queued: a merge that stops short (a client stalled past
    // the idle timeout) fails the body instead of ending it as if whole.
    let ending = crate::http::Ending::default();
    let merged_ending = ending.clone();
    tokio::spawn(async move {
        // Merged bytes waiting for the client, since when.
        let mut pending: Option<(Bytes, Instant)> = None;
        let last = loop {
            if pending.is_none() && running.is_empty() && streams.is_empty() {
                break merge.tail();
            }
            let stalled_at = pending.as_ref().map(|(_, since)| *since + idle);
            tokio::select! {
                biased;
                () = tx.closed() => return,
                permit = tx.reserve(), if pending.is_some() => {
                    let Ok(permit) = permit else { return };
                    if let Some((out, _)) = pending.take() {
                        permit.send(out);
                    }
                    if merge.failed {
                        // A prompt failed mid-stream (its error went out): the batch ends,
                        // as vLLM ends it, and the other prompts are dropped.
                        break Bytes::from_static(b"data: [DONE]\n\n");
                    }
                }
                () = tokio::time::sleep_until(stalled_at.unwrap_or_else(Instant::now)),
                    if stalled_at.is_some() => return,
                started = running.next(), if !running.is_empty() => match started {
                    Some((i, Ok(answer))) => streams.push(part_stream(i, answer)),
                    // Merged output still waiting for the client goes before the error.
                    Some((_, Err(e))) => match pending.take() {
                        Some((out, _)) => break [out, error_events(&e)].concat().into(),
                        None => break error_events(&e),
                    },
                    None => {}
                },
                // (A `None` from an emptied set goes round to the check above: a branch
                // whose pattern failed would not be polled again in this select.)
                next = streams.next(), if pending.is_none() && !streams.is_empty() => match next {
                    Some((i, Some(Ok(data)))) => {
                        let out = merge.rewrite(i, &data);
                        if !out.is_empty() {
                            pending = Some((out, Instant::now()));
                        }
                    }
                    // The part's relay could not end its stream as it should.
                    Some((i, Some(Err(_)))) => {
                        break error_events(&ApiError::unavailable(format!(
                            "prompt {i}'s stream was cut off"
                        )));
                    }
                    // Part `i` ended: without its `[DONE]` it was cut short; else the next
                    // waiting part starts.
                    Some((i, None)) if !merge.done[i] => {
                        break error_events(&ApiError::unavailable(format!(
                            "prompt {i}'s stream ended before its [DONE]"
                        )));
                    }
                    Some((_, None)) => running.extend(parts.next()),
                    None => {}
                },
            }
        };
        // The last words: the other parts go first, and the client has the idle timeout.
        drop((running, streams));
        if let Ok(Ok(())) = tokio::time::timeout(idle, tx.send(last)).await {
            ending.complete();
        }
    });
    Ok(response
        .body(crate::http::streamed(rx, merged_ending, |bytes| bytes))
        .expect("invariant: the part's headers were valid"))
}

/// A part's stream of data, tagged with its prompt, ending with `None` (its end).
fn part_stream(
    prompt: usize,
    answer: Response<Body>,
) -> futures_util::stream::BoxStream<'static, (usize, Option<Result<Bytes, BodyAborted>>)> {
    answer
        .into_body()
        .into_data_stream()
        .map(Some)
        .chain(futures_util::stream::once(async { None }))
        .map(move |data| (prompt, data))
        .boxed()
}

/// The batch's response headers: a part's, less its length and the routing headers, which
/// describe that part's worker alone.
fn answer_headers(answer: &Response<Body>) -> hyper::http::response::Builder {
    let mut response = Response::builder().status(StatusCode::OK);
    for (name, value) in answer.headers() {
        if name != header::CONTENT_LENGTH && !name.as_str().starts_with("x-kvroute-") {
            response = response.header(name, value);
        }
    }
    response
}

/// The whole answers of a non-streamed batch merged, held against the bodies' budget while
/// the client is sent it. The merge runs off the runtime's threads (answers may total the
/// budget's size).
async fn merge_whole(
    router: &Router,
    answers: Vec<Response<Body>>,
    n: u32,
) -> Result<Response<Body>, ApiError> {
    let over = || ApiError::bodies_over_budget(router.bodies.bytes());
    let response = answers.first().map(answer_headers);
    let mut held = Reservation::default();
    let mut bodies = Vec::with_capacity(answers.len());
    let mut bytes_held = 0usize;
    for answer in answers {
        let bytes = answer
            .into_body()
            .collect()
            .await
            .map_err(|_| ApiError::unavailable("a prompt's answer was cut off"))?
            .to_bytes();
        // Held, and read as raw fields (about as much again: only the choices' indexes and
        // the usage are parsed).
        bytes_held = bytes_held.saturating_add(bytes.len().saturating_mul(2));
        if !router.bodies.cover(&mut held, bytes_held) {
            return Err(over());
        }
        bodies.push(bytes);
    }
    // On a blocking thread of its own, not a tokenizer permit: the answers are generated,
    // and a burst of prompts keeping every permit busy would have thrown them away with a
    // 429. The bodies' budget bounds what merges at once.
    let merged = tokio::task::spawn_blocking(move || merge_answers(&bodies, n))
        .await
        .map_err(|_| ApiError::unavailable("merging the prompts' answers failed"))?
        .map_err(|e| {
            ApiError::bad_gateway(format!("a prompt's answer is not a completion: {e}"))
        })?;
    let mut held_merged = Reservation::default();
    if !router.bodies.cover(&mut held_merged, merged.len()) {
        return Err(over());
    }
    drop(held);
    let body =
        crate::http::budget::HeldBody::new(merged, held_merged).map_err(|never| match never {});
    Ok(response
        .unwrap_or_else(|| Response::builder().status(StatusCode::OK))
        .body(BodyExt::boxed(body))
        .expect("invariant: the parts' headers were valid"))
}

/// The prompts' answers as one: the first's fields, every prompt's choices renumbered
/// (prompt `i`'s choice `j` is `i·n + j`), and the usage summed. Everything else stays as
/// the workers wrote it, unparsed (a `serde_json::Value` tree of logprobs is several times
/// their JSON's size).
fn merge_answers(answers: &[Bytes], n: u32) -> Result<Bytes, serde_json::Error> {
    let mut head: Option<RawObject> = None;
    let mut choices: Vec<RawObject> = Vec::new();
    let mut usage = Usage::default();
    for (i, bytes) in answers.iter().enumerate() {
        let mut answer: RawObject = serde_json::from_slice(bytes)?;
        if let Some(u) = answer.get("usage") {
            usage.add(Some(&serde_json::from_str::<Value>(u.get())?));
        }
        if let Some(list) = answer.get_mut("choices") {
            // Taken out (the head keeps a `null` in its place, where the merged list goes).
            let raw = std::mem::replace(list, null());
            let list: Option<Vec<RawObject>> = serde_json::from_str(raw.get())?;
            for mut choice in list.unwrap_or_default() {
                renumber(&mut choice, i, n)?;
                choices.push(choice);
            }
        }
        if head.is_none() {
            head = Some(answer);
        }
    }
    let merged = Merged {
        head: &head.unwrap_or_default(),
        choices: &choices,
        usage: &usage,
    };
    serde_json::to_vec(&merged).map(Bytes::from)
}

/// Choice `own` of prompt `prompt` in the batch's answer: past the earlier prompts' `n`
/// each (saturating: the numbers come from workers).
fn batch_index(own: u64, prompt: usize, n: u32) -> u64 {
    (prompt as u64)
        .saturating_mul(u64::from(n))
        .saturating_add(own)
}

/// A streamed choice of prompt `prompt` with its index moved ([`batch_index`]).
fn renumbered(mut choice: Value, prompt: usize, n: u32) -> Value {
    if let Some(index) = choice.get_mut("index") {
        *index = Value::from(batch_index(index.as_u64().unwrap_or(0), prompt, n));
    }
    choice
}

/// A whole answer's choice of prompt `prompt` with its index moved ([`batch_index`]).
fn renumber(choice: &mut RawObject, prompt: usize, n: u32) -> Result<(), serde_json::Error> {
    if let Some(index) = choice.get_mut("index") {
        let own = serde_json::from_str::<Value>(index.get())?
            .as_u64()
            .unwrap_or(0);
        *index = RawValue::from_string(batch_index(own, prompt, n).to_string())?;
    }
    Ok(())
}

/// JSON `null`, raw.
fn null() -> Box<RawValue> {
    RawValue::from_string("null".to_owned()).expect("invariant: null is JSON")
}

/// The merged answer as it is written: the first answer's fields in their order, the
/// merged choices in place of its own (or last, if it had none), the summed usage in place
/// of its usage unless that was `null`.
struct Merged<'a> {
    head: &'a RawObject,
    choices: &'a [RawObject],
    usage: &'a Usage,
}

impl Serialize for Merged<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(None)?;
        for (k, v) in &self.head.0 {
            match k.as_str() {
                "choices" => map.serialize_entry(k, self.choices)?,
                "usage" if v.get() != "null" => map.serialize_entry(k, &self.usage.to_json())?,
                _ => map.serialize_entry(k, v)?,
            }
        }
        if self.head.get("choices").is_none() {
            map.serialize_entry("choices", self.choices)?;
        }
        map.end()
    }
}

/// Token counts summed over the prompts (saturating: the numbers come from workers).
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
        self.prompt_tokens = self
            .prompt_tokens
            .saturating_add(count(usage.get("prompt_tokens")));
        self.completion_tokens = self
            .completion_tokens
            .saturating_add(count(usage.get("completion_tokens")));
        if let Some(cached) = usage
            .get("prompt_tokens_details")
            .and_then(|d| d.get("cached_tokens"))
            .and_then(Value::as_u64)
        {
            let sum = self.cached_tokens.get_or_insert(0);
            *sum = sum.saturating_add(cached);
        }
    }

    fn to_json(&self) -> Value {
        let mut usage = Map::new();
        usage.insert("prompt_tokens".into(), self.prompt_tokens.into());
        usage.insert(
            "total_tokens".into(),
            self.prompt_tokens
                .saturating_add(self.completion_tokens)
                .into(),
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

/// What merging the prompts' streams keeps.
struct Merge {
    n: u32,
    include_usage: bool,
    usage: Usage,
    /// The first chunk's `id`, `object`, `created` and `model`: every chunk of the batch
    /// carries them (one answer, as vLLM's), and so does the usage chunk at the end.
    head: Option<Map<String, Value>>,
    /// Which prompts' streams sent their `[DONE]`.
    done: Vec<bool>,
    /// A prompt sent an error: the batch ends after it.
    failed: bool,
}

impl Merge {
    fn new(n: u32, include_usage: bool, prompts: usize) -> Merge {
        Merge {
            n,
            include_usage,
            usage: Usage::default(),
            head: None,
            done: vec![false; prompts],
            failed: false,
        }
    }

    /// Prompt `prompt`'s whole server-sent events (each relay sends whole events) with
    /// their choices renumbered and the batch's id, less `[DONE]` and usage chunks; an
    /// error passes as it came, and ends the batch.
    fn rewrite(&mut self, prompt: usize, data: &[u8]) -> Bytes {
        let mut out = Vec::with_capacity(data.len() + 16);
        for event in events(data) {
            let payload = event_data(event);
            match payload.as_deref().map(str::trim) {
                Some("[DONE]") => {
                    if let Some(done) = self.done.get_mut(prompt) {
                        *done = true;
                    }
                }
                Some(json) => match serde_json::from_str::<Value>(json) {
                    Ok(Value::Object(chunk)) if chunk.contains_key("error") => {
                        self.failed = true;
                        push_event(&mut out, event);
                        break;
                    }
                    // Older vLLM's flat error: in OpenAI's shape, which clients raise for
                    // (as a chunk it would also have had the batch's fields written over
                    // its `"object": "error"`).
                    Ok(Value::Object(chunk))
                        if chunk.get("object").and_then(Value::as_str) == Some("error") =>
                    {
                        self.failed = true;
                        let error: Map<String, Value> = ["message", "type", "param", "code"]
                            .into_iter()
                            .map(|k| (k.to_owned(), chunk.get(k).cloned().unwrap_or(Value::Null)))
                            .collect();
                        let error = serde_json::json!({ "error": error });
                        push_event(&mut out, format!("data: {error}").as_bytes());
                        break;
                    }
                    Ok(Value::Object(mut chunk)) => {
                        let head = self.head.get_or_insert_with(|| {
                            ["id", "object", "created", "model"]
                                .into_iter()
                                .filter_map(|k| Some((k.to_owned(), chunk.get(k)?.clone())))
                                .collect()
                        });
                        for (k, v) in head.iter() {
                            chunk.insert(k.clone(), v.clone());
                        }
                        let usage_only = chunk
                            .get("choices")
                            .is_some_and(|c| c.as_array().is_some_and(Vec::is_empty))
                            && chunk.get("usage").is_some_and(Value::is_object);
                        if usage_only {
                            self.usage.add(chunk.get("usage"));
                            continue;
                        }
                        if let Some(Value::Array(choices)) = chunk.get_mut("choices") {
                            for choice in choices.iter_mut() {
                                *choice = renumbered(choice.take(), prompt, self.n);
                            }
                        }
                        push_chunk(&mut out, chunk);
                    }
                    // Not a chunk: as it came.
                    _ => push_event(&mut out, event),
                },
                // Comments and other fields: as they came.
                None => push_event(&mut out, event),
            }
        }
        Bytes::from(out)
    }

    /// The end of the merged stream: the summed usage chunk if asked for, then `[DONE]`.
    fn tail(&mut self) -> Bytes {
        let mut out = Vec::new();
        if self.include_usage {
            let mut chunk = self.head.clone().unwrap_or_default();
            chunk.insert("choices".into(), Value::Array(Vec::new()));
            chunk.insert("usage".into(), self.usage.to_json());
            push_chunk(&mut out, chunk);
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
        Bytes::from(out)
    }
}

/// Appends a server-sent event (its lines, without the blank line that ends it).
fn push_event(out: &mut Vec<u8>, event: &[u8]) {
    out.extend_from_slice(event);
    out.extend_from_slice(b"\n\n");
}

/// Appends a chunk as the data of an event.
fn push_chunk(out: &mut Vec<u8>, chunk: Map<String, Value>) {
    push_event(out, format!("data: {}", Value::Object(chunk)).as_bytes());
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
        } else if b[i..].starts_with(b"\n\r\n") {
            Some((i, 3))
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

    const LIMIT: usize = 1 << 20;

    /// A body listing texts or token lists is split into one body per prompt, the other
    /// fields kept; one prompt, a token list, a mixed list, too many prompts or parts too
    /// large together are not.
    #[test]
    fn batches_split_into_one_body_per_prompt() {
        let split = |body: &[u8]| openai::split_batch(body, LIMIT);
        let parts = split(br#"{"model":"m","prompt":["a","b","c"],"n":2,"max_tokens":5}"#)
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
        let tokens = split(br#"{"prompt":[[1,2],[3]]}"#).unwrap().unwrap();
        assert_eq!(tokens.len(), 2);
        assert_eq!(
            serde_json::from_slice::<Value>(&tokens[1]).unwrap(),
            json!({"prompt": [3]})
        );
        for single in [
            &br#"{"model":"m","prompt":"a"}"#[..],
            br#"{"model":"m","prompt":["a"]}"#,
            br#"{"model":"m","prompt":[1,2,3]}"#,
            br#"{"model":"m","prompt":["a",[1]]}"#,
            br#"{"model":"m","prompt":[["a"],["b"]]}"#,
            br#"{"model":"m","prompt":[[[1]],[[2]]]}"#,
        ] {
            assert_eq!(split(single).unwrap(), None);
        }
        let many = format!(
            r#"{{"model":"m","prompt":[{}]}}"#,
            vec![r#""x""#; openai::MAX_BATCH + 1].join(",")
        );
        assert_eq!(split(many.as_bytes()).unwrap_err().status, 400);
        // 100 KiB of padding repeated in 16 parts passes a 1 MiB limit on what is repeated.
        let padded = format!(
            r#"{{"model":"m","pad":"{}","prompt":[{}]}}"#,
            "p".repeat(100 << 10),
            vec![r#""x""#; 16].join(",")
        );
        let refused = split(padded.as_bytes()).unwrap_err();
        assert!(
            refused.message.contains("pass the limit"),
            "{}",
            refused.message
        );
        // The other fields keep the body's order, written as they come; past
        // MAX_BATCH_FIELDS of them the body is refused before anything is held for them.
        let ordered = split(br#"{"z":1,"prompt":["a","b"],"a":{"k":[2]}}"#)
            .unwrap()
            .unwrap();
        assert_eq!(
            &ordered[0][..],
            &br#"{"prompt":"a","z":1,"a":{"k":[2]}}"#[..]
        );
        let fields: String = (0..=openai::MAX_BATCH_FIELDS)
            .map(|i| format!(r#""k{i}":0,"#))
            .collect();
        let wide = format!(r#"{{{fields}"prompt":["a","b"]}}"#);
        assert_eq!(split(wide.as_bytes()).unwrap_err().status, 400);
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
        let merge = |answers: Vec<Value>, n| {
            let bodies: Vec<Bytes> = answers.iter().map(|a| Bytes::from(a.to_string())).collect();
            serde_json::from_slice::<Value>(&merge_answers(&bodies, n).unwrap()).unwrap()
        };
        let merged = merge(vec![answer("a", 3, 1), answer("b", 5, 2)], 2);
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
        // Numbers from workers that would overflow saturate.
        let huge = json!({"choices": [{"index": u64::MAX}], "usage": {"prompt_tokens": u64::MAX}});
        let merged = merge(vec![huge.clone(), huge], 2);
        assert_eq!(merged["choices"][1]["index"], u64::MAX);
        assert_eq!(merged["usage"]["total_tokens"], u64::MAX);
        // The rest is written as the worker wrote it, in its order; a null usage stays.
        let raw = br#"{"id":"x","choices":[{"index":0,"logprobs":{"token_logprobs":[-0.50]}}],"usage":null,"z":1}"#;
        let both = [Bytes::from_static(raw), Bytes::from_static(raw)];
        assert_eq!(
            std::str::from_utf8(&merge_answers(&both, 1).unwrap()).unwrap(),
            r#"{"id":"x","choices":[{"index":0,"logprobs":{"token_logprobs":[-0.50]}},{"index":1,"logprobs":{"token_logprobs":[-0.50]}}],"usage":null,"z":1}"#
        );
        assert!(merge_answers(&[Bytes::from_static(b"[1]")], 1).is_err());
    }

    /// Streams merge as their chunks come, renumbered and with the batch's one id; the
    /// parts' `[DONE]`s (noted) and usage chunks go, and the end carries one usage chunk
    /// with the sums and one `[DONE]`; comments pass as they came; an error passes and
    /// ends the batch.
    #[test]
    fn streams_merge_with_one_id_one_usage_chunk_and_one_done() {
        let mut merge = Merge::new(1, true, 2);
        let chunk = |id: &str, text: &str| {
            format!(
                "data: {}\n\n",
                json!({"id":id,"object":"text_completion","model":"m","choices":[{"index":0,"text":text}]})
            )
        };
        let usage = |id: &str, p: u64| {
            format!(
                "data: {}\n\n",
                json!({"id":id,"choices":[],"usage":{"prompt_tokens":p,"completion_tokens":2,"total_tokens":p+2}})
            )
        };
        let text = |b: &Bytes| String::from_utf8(b.to_vec()).unwrap();
        let a = text(&merge.rewrite(0, format!("{}: ping\r\n\r\n", chunk("c0", "x")).as_bytes()));
        let b = text(&merge.rewrite(
            1,
            format!("{}{}data: [DONE]\n\n", chunk("c1", "y"), usage("c1", 7)).as_bytes(),
        ));
        assert!(
            a.contains(r#""index":0"#) && a.contains(": ping\n\n"),
            "{a}"
        );
        assert!(
            b.contains(r#""index":1"#) && b.contains(r#""id":"c0""#),
            "{b}"
        );
        assert!(!b.contains("[DONE]") && !b.contains("usage"), "{b}");
        assert_eq!(merge.done, [false, true]);
        let c = merge.rewrite(0, format!("{}data: [DONE]\n\n", usage("c0", 3)).as_bytes());
        assert!(c.is_empty());
        assert_eq!(merge.done, [true, true]);
        assert!(!merge.failed);
        let tail = text(&merge.tail());
        assert!(tail.ends_with("data: [DONE]\n\n"), "{tail}");
        assert_eq!(tail.matches("[DONE]").count(), 1);
        let usage_line = tail.lines().next().unwrap().strip_prefix("data: ").unwrap();
        let usage: Value = serde_json::from_str(usage_line).unwrap();
        assert_eq!(
            (
                &usage["id"],
                &usage["usage"]["prompt_tokens"],
                &usage["usage"]["completion_tokens"]
            ),
            (&json!("c0"), &json!(10), &json!(4))
        );
        assert_eq!(usage["choices"], json!([]));
        let e = text(&merge.rewrite(
            1,
            b"data: {\"error\": {\"message\": \"m\"}}\n\ndata: [DONE]\n\n",
        ));
        assert!(e.contains("error") && !e.contains("[DONE]"), "{e}");
        assert!(merge.failed);
    }

    /// A prompt's error mid-stream reaches the client in OpenAI's shape, whose clients raise
    /// only for an event with an `error`: older vLLM's flat error is rewritten (it passed as
    /// a chunk, its `"object": "error"` overwritten with the batch's), and the error of a
    /// prompt refused before it streamed is written from the refusal, not the worker's body.
    #[test]
    fn errors_in_a_merged_stream_are_in_openai_s_shape() {
        let mut merge = Merge::new(1, true, 2);
        let first = json!({"id":"c0","object":"text_completion","model":"m","choices":[{"index":0,"text":"x"}]});
        merge.rewrite(0, format!("data: {first}\n\n").as_bytes());
        let flat = json!({"object":"error","message":"too long","type":"BadRequestError","param":null,"code":400});
        let out = merge.rewrite(1, format!("data: {flat}\n\n").as_bytes());
        assert!(merge.failed);
        let event = String::from_utf8(out.to_vec()).unwrap();
        let data: Value =
            serde_json::from_str(event.trim_end().strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(
            data,
            json!({"error":{"message":"too long","type":"BadRequestError","param":null,"code":400}})
        );
        let refused = ApiError::refused_by_worker(
            400,
            "too long",
            Some(Bytes::from_static(
                b"{\"object\":\"error\",\n\"message\":\"too long\",\"code\":400}",
            )),
        );
        let events = String::from_utf8(error_events(&refused).to_vec()).unwrap();
        let mut lines = events.lines();
        let data: Value =
            serde_json::from_str(lines.next().unwrap().strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(data["error"]["message"], "too long");
        assert_eq!(data["error"]["type"], "invalid_request_error");
        assert_eq!(lines.collect::<Vec<_>>(), ["", "data: [DONE]", ""]);
    }
}
