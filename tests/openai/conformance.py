#!/usr/bin/env python3
"""OpenAI-API conformance check for kvroute's /v1/completions and /v1/chat/completions.

    python3 -m venv /tmp/oai-venv && /tmp/oai-venv/bin/pip install -r tests/openai/requirements.txt
    /tmp/oai-venv/bin/python tests/openai/conformance.py --base-url http://127.0.0.1:8080/v1 --model kvroute-sim

Drives the server with the official `openai` Python client (completions and chat completions,
stream and not, `--rounds` times each), records the raw bytes of every HTTP response through a
tee transport under the client, and validates every response body, every SSE chunk and every
error body against OpenAI's published schema, vendored in tests/openai/schema.json (from
github.com/openai/openai-openapi, openapi.yaml; the commit is in that file's "$comment").
It also checks: ids distinct across all calls, `chatcmpl-` / `cmpl-` prefixes, `created` a JSON
integer within --max-skew seconds of now (and the same in every chunk of a stream), the SSE framing
(`data: {...}` events, the last one `data: [DONE]`), that the client parses what came back, and
that an unknown model answers 404 (openai.NotFoundError) and an empty prompt / empty `messages`
400 (openai.BadRequestError), stream or not, with a body that matches ErrorResponse.
One line per check (PASS / FAIL / WARN); a FAIL prints the offending JSON; exit status 1 on any FAIL.

WHAT THE PUBLISHED SCHEMA REQUIRES (openapi.yaml at the commit named in schema.json).
"required" = the key must be present; "nullable" = null is allowed as its value. Keys not listed
are optional. No schema here sets additionalProperties: false, so extra keys are allowed.

  POST /v1/completions, not streamed: CreateCompletionResponse
    required: id (string), object (string, only "text_completion"), created (integer, Unix
              seconds), model (string), choices (array)
    optional: usage (CompletionUsage, NOT nullable: leave it out rather than send null),
              system_fingerprint (string, NOT nullable: leave it out rather than send null)
    choices[] required: index (integer), text (string),
              finish_reason ("stop" | "length" | "content_filter"; NOT nullable),
              logprobs (object or null: the KEY MUST BE PRESENT, send "logprobs": null)
  POST /v1/completions, streamed: every `data:` chunk is a CreateCompletionResponse too (the spec:
    "both the streamed and non-streamed response objects share the same shape"), so each chunk
    needs id, object "text_completion", created, model, choices, and each choice needs index,
    text, logprobs (null ok) and finish_reason. The schema does not let finish_reason be null,
    yet every real stream (OpenAI's own included) sends null until a choice's last chunk. This
    check therefore allows null there (local relaxation, "CompletionStreamChunk" below) and
    requires each choice's last chunk to carry a non-null finish_reason. Likewise `usage` is not
    nullable in the schema, but with stream_options.include_usage the spec's own text
    (ChatCompletionStreamOptions, also used by CreateCompletionRequest) says every chunk but the
    final usage chunk carries "usage": null; the relaxation allows that too. Omitting `usage`
    from those chunks satisfies both readings.
  POST /v1/chat/completions, not streamed: CreateChatCompletionResponse
    required: id, object (only "chat.completion"), created (integer), model, choices
    optional: usage, system_fingerprint (string, NOT nullable), service_tier (enum or null),
              metadata, moderation
    choices[] required: index, message,
              finish_reason ("stop" | "length" | "tool_calls" | "content_filter" |
              "function_call"; NOT nullable), logprobs (object or null: KEY MUST BE PRESENT)
    message (ChatCompletionResponseMessage) required: role (only "assistant"),
              content (string or null), refusal (string or null: KEY MUST BE PRESENT,
              send "refusal": null); optional: tool_calls, annotations, function_call, audio
  POST /v1/chat/completions, streamed: every chunk is a CreateChatCompletionStreamResponse
    required: id (same in every chunk), object (only "chat.completion.chunk"), created (integer,
              same in every chunk), model, choices (may be [] in a final usage-only chunk)
    optional: usage (CompletionUsage or null), system_fingerprint, service_tier, obfuscation
    choices[] required: index, delta, finish_reason (enum above or null: KEY MUST BE PRESENT,
              null until the choice's last chunk); optional: logprobs (object or null)
    delta (ChatCompletionStreamResponseDelta): nothing required, {} is valid; role is one of
              developer/system/user/assistant/tool; content and refusal are string or null
  usage, where sent (CompletionUsage): required prompt_tokens, completion_tokens, total_tokens
    (integers); optional prompt_tokens_details / completion_tokens_details (objects of integers)
  any error, any status: ErrorResponse = {"error": Error}; Error requires ALL FOUR keys:
    message (string), type (string), param (string or null), code (string or null)

Notes: JSON Schema's "integer" accepts 1700000000.0, so `created` is also checked to be a JSON
integer literal. A few stream-chunk fields in the spec use OpenAPI 3.0's `nullable: true`, which
JSON Schema 2020-12 ignores; they are rewritten to anyOf [..., {"type": "null"}] on load.
The client sends Accept-Encoding: identity so the tee sees the bytes as the server framed them.
"""
import argparse
import copy
import json
import os
import re
import sys
import time
import zlib

try:  # openai >= 3 is built on httpx2, older releases on httpx; the transport API is the same
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

import jsonschema
import openai
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEMA_URI = "urn:kvroute:openai-schema"
PROMPT = "Say hello"
MESSAGES = [{"role": "user", "content": "Say hello"}]
MAX_TOKENS = 4

# ---------------------------------------------------------------------------------------------
# schema


def _denullable(node):
    """OpenAPI 3.0 `nullable: true` -> JSON Schema anyOf [node, null] (2020-12 ignores it)."""
    if isinstance(node, list):
        return [_denullable(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _denullable(v) for k, v in node.items()}
    if isinstance(node.get("nullable"), bool):
        nullable = node.pop("nullable")
        if nullable:
            desc = node.pop("description", None)
            node = {"anyOf": [node, {"type": "null"}]}
            if desc is not None:
                node["description"] = desc
    return node


def load_validators(path):
    with open(path) as f:
        doc = json.load(f)
    doc = _denullable(doc)
    schemas = doc["components"]["schemas"]
    # The local relaxation: a streamed completions chunk may carry finish_reason: null...
    chunk = copy.deepcopy(schemas["CreateCompletionResponse"])
    fr = chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]
    chunk["properties"]["choices"]["items"]["properties"]["finish_reason"] = {
        "anyOf": [fr, {"type": "null"}]
    }
    # ...and, with stream_options.include_usage, "usage": null on every chunk but the usage one
    # (ChatCompletionStreamOptions, which CreateCompletionRequest.stream_options uses, says so).
    chunk["properties"]["usage"] = {"anyOf": [chunk["properties"]["usage"], {"type": "null"}]}
    chunk["$comment"] = "LOCAL: CreateCompletionResponse with choices[].finish_reason and usage nullable"
    schemas["CompletionStreamChunk"] = chunk

    registry = Registry().with_resource(SCHEMA_URI, Resource.from_contents(doc, default_specification=DRAFT202012))
    out = {}
    for name in (
        "CreateCompletionResponse",
        "CompletionStreamChunk",
        "CreateChatCompletionResponse",
        "CreateChatCompletionStreamResponse",
        "ErrorResponse",
    ):
        jsonschema.Draft202012Validator.check_schema(schemas[name])
        out[name] = jsonschema.Draft202012Validator(
            {"$ref": f"{SCHEMA_URI}#/components/schemas/{name}"}, registry=registry
        )
    return out, doc.get("$comment", "")


# ---------------------------------------------------------------------------------------------
# raw capture: a transport that records every response's bytes as the client reads them


class Capture:
    def __init__(self, request, status, headers):
        self.method = request.method
        self.url = str(request.url)
        self.status = status
        self.headers = headers
        self.raw = bytearray()

    def body(self):
        enc = self.headers.get("content-encoding", "identity").strip().lower()
        raw = bytes(self.raw)
        if enc in ("", "identity"):
            return raw
        if enc == "gzip":
            return zlib.decompress(raw, 47)
        if enc == "deflate":
            try:
                return zlib.decompress(raw)
            except zlib.error:
                return zlib.decompress(raw, -15)
        raise ValueError(f"cannot decode Content-Encoding {enc!r}")


class TeeStream(httpx.SyncByteStream):
    def __init__(self, inner, capture):
        self.inner = inner
        self.capture = capture

    def __iter__(self):
        for chunk in self.inner:
            self.capture.raw += chunk
            yield chunk

    def close(self):
        self.inner.close()


class TeeTransport(httpx.BaseTransport):
    def __init__(self):
        self.inner = httpx.HTTPTransport()
        self.log = []

    def handle_request(self, request):
        resp = self.inner.handle_request(request)
        cap = Capture(request, resp.status_code, resp.headers)
        self.log.append(cap)
        return httpx.Response(
            status_code=resp.status_code,
            headers=resp.headers,
            stream=TeeStream(resp.stream, cap),
            extensions=resp.extensions,
            request=request,
        )

    def close(self):
        self.inner.close()


# ---------------------------------------------------------------------------------------------
# reporting


def _dump(obj, limit=6000):
    if isinstance(obj, (bytes, bytearray)):
        text = bytes(obj).decode("utf-8", "replace")
    elif isinstance(obj, str):
        text = obj
    else:
        text = json.dumps(obj, indent=2, ensure_ascii=False)
    if len(text) > limit:
        text = text[:limit] + f"\n... ({len(text) - limit} more characters)"
    return "\n".join("      | " + line for line in text.splitlines() or [""])


class Report:
    def __init__(self):
        self.passed = self.failed = self.warned = 0

    def ok(self, name):
        self.passed += 1
        print(f"PASS  {name}", flush=True)

    def fail(self, name, why=None, obj=None):
        self.failed += 1
        print(f"FAIL  {name}" + (f": {why}" if why else ""), flush=True)
        if obj is not None:
            print(_dump(obj), flush=True)

    def warn(self, name, why=None):
        self.warned += 1
        print(f"WARN  {name}" + (f": {why}" if why else ""), flush=True)

    def check(self, cond, name, why=None, obj=None):
        if cond:
            self.ok(name)
        else:
            self.fail(name, why, obj)
        return bool(cond)


def _short(msg, limit=300):
    return msg if len(msg) <= limit else msg[:limit] + "..."


def validate(rep, validators, label, schema_name, obj):
    errs = sorted(validators[schema_name].iter_errors(obj), key=lambda e: list(e.absolute_path))
    if not errs:
        rep.ok(f"{label}: matches {schema_name}")
        return True
    lines = []
    for e in errs:
        lines.append(f"{e.json_path}: {_short(e.message)}")
        for sub in sorted(e.context or [], key=lambda s: list(s.absolute_path)):
            lines.append(f"    (alternative) {sub.json_path}: {_short(sub.message)}")
    rep.fail(f"{label}: does not match {schema_name}", "\n        " + "\n        ".join(lines), obj)
    return False


# ---------------------------------------------------------------------------------------------
# checks shared by every successful answer


def is_json_int(v):
    return type(v) is int  # json.loads gives float for 1.0 and bool for true: both rejected


class Ctx:
    def __init__(self, args, rep, validators, tee, strict_client, lax_client):
        self.args = args
        self.rep = rep
        self.validators = validators
        self.tee = tee
        self.strict = strict_client
        self.lax = lax_client
        self.ids = []  # (label, id)


def check_common(ctx, label, obj, kind):
    rep, args = ctx.rep, ctx.args
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    oid = obj.get("id")
    rep.check(
        isinstance(oid, str) and oid.startswith(prefix) and len(oid) > len(prefix),
        f"{label}: id starts with {prefix!r}", f"id = {oid!r}", obj,
    )
    created = obj.get("created")
    now = time.time()
    rep.check(
        is_json_int(created) and abs(now - created) <= args.max_skew,
        f"{label}: created is an integer within {args.max_skew}s of now",
        f"created = {created!r}, now = {int(now)}", obj,
    )
    if args.allow_model_mismatch:
        rep.check(isinstance(obj.get("model"), str) and obj.get("model"), f"{label}: model is a non-empty string",
                  f"model = {obj.get('model')!r}", obj)
    else:
        rep.check(obj.get("model") == args.model, f"{label}: model echoes the requested {args.model!r}",
                  f"model = {obj.get('model')!r} (use --allow-model-mismatch if that is intended)", obj)


def check_usage(ctx, label, usage, obj):
    rep = ctx.rep
    if usage is None:
        rep.warn(f"{label}: no usage", "optional in the schema, but OpenAI always sends it on a non-streamed answer")
        return
    if not isinstance(usage, dict):
        return  # the schema check has already failed it
    p, c, t = usage.get("prompt_tokens"), usage.get("completion_tokens"), usage.get("total_tokens")
    if all(is_json_int(x) for x in (p, c, t)):
        rep.check(p + c == t, f"{label}: usage.total_tokens = prompt_tokens + completion_tokens",
                  f"{p} + {c} != {t}", obj)
        rep.check(0 <= c <= MAX_TOKENS, f"{label}: usage.completion_tokens <= max_tokens ({MAX_TOKENS})",
                  f"completion_tokens = {c}", obj)


def parse_json_body(ctx, label, cap):
    try:
        body = cap.body()
    except ValueError as e:
        ctx.rep.fail(f"{label}: body decodes", str(e))
        return None
    try:
        return json.loads(body)
    except ValueError as e:
        ctx.rep.fail(f"{label}: body is JSON", str(e), body)
        return None


def new_captures(ctx, n_before, label):
    caps = ctx.tee.log[n_before:]
    if not caps:
        ctx.rep.fail(f"{label}: an HTTP response came back", "nothing was captured (connection error?)")
        return None
    if len(caps) > 1:
        ctx.rep.warn(f"{label}: {len(caps)} HTTP exchanges for one call", "validating the last")
    return caps[-1]


# ---------------------------------------------------------------------------------------------
# the calls


def create(client, kind, model, stream, **extra):
    if kind == "chat":
        return client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                              stream=stream, **extra)
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, stream=stream, **extra)


def run_plain(ctx, kind, rnd):
    rep, args = ctx.rep, ctx.args
    label = f"{kind} non-stream #{rnd}"
    n = len(ctx.tee.log)
    try:
        # _strict_response_validation: the client validates the body against its pydantic model
        create(ctx.strict, kind, args.model, False)
        rep.ok(f"{label}: openai client call returned and its pydantic model accepted the body")
    except openai.APIResponseValidationError as e:
        cause = " ".join(str(e.__cause__ or "").split())
        rep.fail(f"{label}: openai client's pydantic model accepts the body", _short(f"{e} {cause}".strip()))
    except Exception as e:  # noqa: BLE001 - report anything the client raises
        rep.fail(f"{label}: openai client call succeeds", f"{type(e).__name__}: {e}")
    cap = new_captures(ctx, n, label)
    if cap is None:
        return
    rep.check(cap.status == 200, f"{label}: HTTP 200", f"status {cap.status}", bytes(cap.raw))
    ctype = cap.headers.get("content-type", "")
    rep.check(ctype.split(";")[0].strip().lower() == "application/json", f"{label}: Content-Type application/json",
              f"Content-Type {ctype!r}")
    obj = parse_json_body(ctx, label, cap)
    if obj is None:
        return
    schema = "CreateChatCompletionResponse" if kind == "chat" else "CreateCompletionResponse"
    validate(rep, ctx.validators, label, schema, obj)
    if not isinstance(obj, dict):
        return
    check_common(ctx, label, obj, kind)
    ctx.ids.append((label, obj.get("id")))
    choices = obj.get("choices")
    if isinstance(choices, list):
        rep.check(len(choices) == 1, f"{label}: exactly one choice (n=1)", f"{len(choices)} choices", obj)
        idx = [c.get("index") for c in choices if isinstance(c, dict)]
        rep.check(idx == list(range(len(choices))), f"{label}: choice indices are 0..n-1", f"indices {idx}", obj)
    check_usage(ctx, label, obj.get("usage"), obj)


def parse_sse(text):
    """Events per the SSE spec (WHATWG HTML, 9.2.6): returns (events, problems)."""
    events, problems = [], []
    data, event, pending = [], None, False
    *lines, rest = re.split(r"\r\n|\r|\n", text)  # rest: text after the last line break
    if rest:
        problems.append(f"the stream ends inside a line (no line break after {rest[-60:]!r})")
    for line in lines:
        if line == "":
            if data:
                events.append({"event": event, "data": "\n".join(data)})
            data, event, pending = [], None, False
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        pending = True
        if field == "data":
            data.append(value)
        elif field == "event":
            event = value
        elif field not in ("id", "retry"):
            problems.append(f"unknown SSE field {field!r}")
    if pending:
        problems.append("the stream ends inside an event (no blank line after the last one): clients drop it")
    return events, problems


def run_stream(ctx, kind, rnd):
    rep, args = ctx.rep, ctx.args
    label = f"{kind} stream #{rnd}"
    n = len(ctx.tee.log)
    parsed = []
    extra = {"stream_options": {"include_usage": True}} if args.stream_usage else {}
    try:
        # the lax client (the library's default): its pydantic Completion would refuse the
        # finish_reason: null every streamed completions chunk has until the last
        for chunk in create(ctx.lax, kind, args.model, True, **extra):
            parsed.append(chunk)
        rep.ok(f"{label}: openai client iterated the stream ({len(parsed)} chunks)")
    except Exception as e:  # noqa: BLE001
        rep.fail(f"{label}: openai client iterates the stream", f"{type(e).__name__}: {e}")
    cap = new_captures(ctx, n, label)
    if cap is None:
        return
    rep.check(cap.status == 200, f"{label}: HTTP 200", f"status {cap.status}", bytes(cap.raw))
    ctype = cap.headers.get("content-type", "")
    rep.check(ctype.split(";")[0].strip().lower() == "text/event-stream", f"{label}: Content-Type text/event-stream",
              f"Content-Type {ctype!r}")
    try:
        text = cap.body().decode("utf-8")
    except (ValueError, UnicodeDecodeError) as e:
        rep.fail(f"{label}: stream decodes as UTF-8", str(e), bytes(cap.raw))
        return
    events, problems = parse_sse(text)
    rep.check(not problems, f"{label}: SSE framing", "; ".join(problems), text)
    named = [e["event"] for e in events if e["event"] is not None]
    rep.check(not named, f"{label}: no named SSE events (OpenAI sends bare data: lines)", f"event names {named}", text)
    datas = [e["data"] for e in events]
    rep.check(bool(datas) and datas[-1] == "[DONE]", f"{label}: last event is data: [DONE]",
              f"last event {datas[-1]!r}" if datas else "no events", text)
    rep.check(datas.count("[DONE]") <= 1, f"{label}: one [DONE]", f"{datas.count('[DONE]')} of them", text)
    chunks = []
    for i, d in enumerate(x for x in datas if x != "[DONE]"):
        try:
            chunks.append(json.loads(d))
        except ValueError as e:
            rep.fail(f"{label}: chunk {i} is JSON", str(e), d)
    rep.check(len(chunks) > 0, f"{label}: at least one JSON chunk", None, text)
    if parsed or chunks:
        rep.check(len(parsed) == len(chunks), f"{label}: client yielded every chunk",
                  f"client {len(parsed)}, raw {len(chunks)}")
    schema = "CreateChatCompletionStreamResponse" if kind == "chat" else "CompletionStreamChunk"
    bad = [i for i, c in enumerate(chunks) if not validate_quiet(ctx, schema, c)]
    if bad:
        for i in bad:
            validate(rep, ctx.validators, f"{label}: chunk {i}", schema, chunks[i])
    else:
        rep.ok(f"{label}: all {len(chunks)} chunks match {schema}")
    dicts = [c for c in chunks if isinstance(c, dict)]
    if not dicts:
        return
    check_common(ctx, label, dicts[0], kind)
    ids = {c.get("id") for c in dicts}
    rep.check(len(ids) == 1, f"{label}: every chunk has the same id", f"ids {sorted(map(str, ids))}", text)
    created = {json.dumps(c.get("created")) for c in dicts}
    rep.check(len(created) == 1, f"{label}: every chunk has the same created", f"created values {sorted(created)}",
              text)
    models = {json.dumps(c.get("model")) for c in dicts}
    rep.check(len(models) == 1, f"{label}: every chunk has the same model", f"models {sorted(models)}", text)
    ctx.ids.append((label, dicts[0].get("id")))

    # per choice: finish_reason null until its last chunk, then non-null exactly once
    finished, problems, seen = {}, [], []
    for i, c in enumerate(dicts):
        for ch in c.get("choices") or []:
            if not isinstance(ch, dict):
                continue
            idx = ch.get("index")
            seen.append(idx)
            if idx in finished:
                problems.append(f"chunk {i}: choice {idx} continues after its finish_reason (chunk {finished[idx]})")
            if ch.get("finish_reason") is not None:
                finished.setdefault(idx, i)
    for idx in sorted({s for s in seen if s is not None}, key=str):
        if idx not in finished:
            problems.append(f"choice {idx} never gets a non-null finish_reason")
    rep.check(bool(seen) and not problems, f"{label}: each choice ends with one non-null finish_reason",
              "; ".join(problems) or "no choices in any chunk", text)
    rep.check(set(s for s in seen if s is not None) == {0}, f"{label}: choice index 0 only (n=1)",
              f"indices {sorted(set(map(str, seen)))}", text)

    if kind == "chat":
        first = next((ch for c in dicts for ch in (c.get("choices") or []) if isinstance(ch, dict)), None)
        role = (first or {}).get("delta", {}).get("role") if isinstance((first or {}).get("delta"), dict) else None
        if role != "assistant":
            rep.warn(f"{label}: first delta has role 'assistant'",
                     f"role = {role!r} (optional in the schema; OpenAI sends it)")
    usage_chunks = [c for c in dicts if c.get("usage") is not None]
    if args.stream_usage:
        last = dicts[-1]
        rep.check(last.get("usage") is not None and last.get("choices") == [],
                  f"{label}: with include_usage the last chunk has usage and choices []", None, last)
        if last.get("usage") is not None:
            check_usage(ctx, label, last.get("usage"), last)
    elif usage_chunks:
        rep.warn(f"{label}: usage sent without stream_options.include_usage", "allowed by the schema")


def validate_quiet(ctx, schema, obj):
    return ctx.validators[schema].is_valid(obj)


def run_error(ctx, kind, stream, what, want_status, want_cls, **override):
    rep, args = ctx.rep, ctx.args
    label = f"{kind} {'stream' if stream else 'non-stream'} {what}"
    n = len(ctx.tee.log)
    model = override.get("model", args.model)
    exc = None
    try:
        if kind == "chat":
            r = ctx.lax.chat.completions.create(model=model, messages=override.get("messages", MESSAGES),
                                                max_tokens=MAX_TOKENS, stream=stream)
        else:
            r = ctx.lax.completions.create(model=model, prompt=override.get("prompt", PROMPT),
                                           max_tokens=MAX_TOKENS, stream=stream)
        if stream:
            for _ in r:
                pass
    except Exception as e:  # noqa: BLE001
        exc = e
    rep.check(isinstance(exc, want_cls), f"{label}: raises openai.{want_cls.__name__}",
              "no exception: the call succeeded" if exc is None else f"{type(exc).__name__}: {exc}")
    cap = new_captures(ctx, n, label)
    if cap is None:
        return
    rep.check(cap.status == want_status, f"{label}: HTTP {want_status}", f"status {cap.status}", bytes(cap.raw))
    if cap.status < 400:
        return
    ctype = cap.headers.get("content-type", "")
    rep.check(ctype.split(";")[0].strip().lower() == "application/json", f"{label}: Content-Type application/json",
              f"Content-Type {ctype!r}")
    obj = parse_json_body(ctx, label, cap)
    if obj is None:
        return
    validate(rep, ctx.validators, label, "ErrorResponse", obj)
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict) and not err.get("message"):
        rep.warn(f"{label}: error.message is empty")


# ---------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8080/v1")
    ap.add_argument("--model", required=True, help="a model the server serves")
    ap.add_argument("--bad-model", default="kvroute-conformance-no-such-model", help="a model it does not serve")
    ap.add_argument("--rounds", type=int, default=2, help="times to repeat the four calls (ids must all differ)")
    ap.add_argument("--max-skew", type=int, default=60, help="seconds `created` may be off from now")
    ap.add_argument("--timeout", type=float, default=60.0, help="per-request timeout, seconds")
    ap.add_argument("--stream-usage", action="store_true",
                    help="send stream_options.include_usage and expect a final usage chunk")
    ap.add_argument("--allow-model-mismatch", action="store_true",
                    help="do not require `model` in answers to equal --model")
    ap.add_argument("--skip-errors", action="store_true", help="skip the 404 / 400 checks")
    ap.add_argument("--schema", default=os.path.join(HERE, "schema.json"))
    args = ap.parse_args()

    validators, comment = load_validators(args.schema)
    print(f"openai {openai.__version__}, jsonschema {_version('jsonschema')}; schema: {args.schema}")
    print(f"schema source: {comment.split('. Regenerate')[0]}")
    print(f"server: {args.base_url}, model {args.model!r}")

    tee = TeeTransport()

    def client(strict):
        kwargs = dict(
            base_url=args.base_url,
            api_key=os.environ.get("OPENAI_API_KEY", "none"),
            max_retries=0,  # one HTTP exchange per call, errors surface as they are
            timeout=args.timeout,
            default_headers={"Accept-Encoding": "identity"},
            http_client=openai.DefaultHttpxClient(transport=tee, timeout=args.timeout),
        )
        if strict:
            kwargs["_strict_response_validation"] = True
        return openai.OpenAI(**kwargs)

    rep = Report()
    ctx = Ctx(args, rep, validators, tee, client(True), client(False))

    for rnd in range(1, args.rounds + 1):
        for kind in ("completions", "chat"):
            run_plain(ctx, kind, rnd)
            run_stream(ctx, kind, rnd)

    ids = [i for _, i in ctx.ids if isinstance(i, str)]
    dups = {i: [lbl for lbl, j in ctx.ids if j == i] for i in ids if ids.count(i) > 1}
    rep.check(len(ctx.ids) == 4 * args.rounds and not dups,
              f"ids distinct across all {4 * args.rounds} calls ({args.rounds} rounds of 4)",
              f"duplicates {dups}" if dups else f"only {len(ctx.ids)} ids collected")

    if not args.skip_errors:
        for kind in ("completions", "chat"):
            for stream in (False, True):
                run_error(ctx, kind, stream, "unknown model", 404, openai.NotFoundError, model=args.bad_model)
                if kind == "chat":
                    run_error(ctx, kind, stream, "empty messages", 400, openai.BadRequestError, messages=[])
                else:
                    run_error(ctx, kind, stream, "empty prompt", 400, openai.BadRequestError, prompt="")

    print(f"\n{rep.passed} passed, {rep.failed} failed, {rep.warned} warnings")
    return 1 if rep.failed else 0


def _version(dist):
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # noqa: BLE001
        return "?"


if __name__ == "__main__":
    sys.exit(main())
