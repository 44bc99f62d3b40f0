//! The OpenAI surface: request bodies, the byte-level tokenizer of the demo, and errors in
//! OpenAI's shape that also say whose fault they are and whether a retry can help.

use serde::Deserialize;

/// A prompt: text, or token ids used as they are. vLLM also takes a list of either; a list
/// of one is that prompt, a longer one is a batch, which the router splits into one request
/// per prompt ([`split_batch`]), each routed on its own.
#[derive(Debug)]
pub enum Prompt {
    /// Text, tokenized by the router.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
    /// A list of this many prompts (the body is split before it is parsed as one request).
    Batch(usize),
}

/// The forms `prompt` takes in OpenAI's and vLLM's completions API: a string, a list of
/// token ids, a list of strings, a list of token-id lists; `[]` reads as no tokens (refused
/// as an empty prompt). Read in one pass, each token straight into its list: an untagged
/// enum of the forms first copies the whole value into a tree of about 32 B a token (134 MB
/// for an 8 MiB body of token ids).
impl<'de> serde::Deserialize<'de> for Prompt {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Prompt, D::Error> {
        d.deserialize_any(PromptVisitor)
    }
}

struct PromptVisitor;

impl<'de> serde::de::Visitor<'de> for PromptVisitor {
    type Value = Prompt;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a prompt: a string, token ids, a list of strings or of token-id lists")
    }

    fn visit_str<E>(self, text: &str) -> Result<Prompt, E> {
        Ok(Prompt::Text(text.to_owned()))
    }

    fn visit_string<E>(self, text: String) -> Result<Prompt, E> {
        Ok(Prompt::Text(text))
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
        // The first element says which list this is; the rest must be alike.
        let prompts = |first, rest: usize| {
            if rest == 0 {
                first
            } else {
                Prompt::Batch(rest + 1)
            }
        };
        match seq.next_element::<Element>()? {
            None => Ok(Prompt::Tokens(Vec::new())),
            Some(Element::Token(first)) => {
                let mut tokens = vec![first];
                while let Some(t) = seq.next_element::<u32>()? {
                    tokens.push(t);
                }
                Ok(Prompt::Tokens(tokens))
            }
            Some(Element::Text(first)) => {
                let mut rest = 0;
                while seq.next_element::<TextOnly>()?.is_some() {
                    rest += 1;
                }
                Ok(prompts(Prompt::Text(first), rest))
            }
            Some(Element::Tokens(first)) => {
                let mut rest = 0;
                while seq.next_element::<TokensOnly>()?.is_some() {
                    rest += 1;
                }
                Ok(prompts(Prompt::Tokens(first), rest))
            }
        }
    }
}

/// The first element of a prompt list.
enum Element {
    Token(u32),
    Text(String),
    Tokens(Vec<u32>),
}

impl<'de> serde::Deserialize<'de> for Element {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Element, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Element;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a token id (0 to 4294967295), a string or a list of token ids")
            }
            fn visit_u64<E: serde::de::Error>(self, t: u64) -> Result<Element, E> {
                u32::try_from(t)
                    .map(Element::Token)
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Unsigned(t), &self))
            }
            fn visit_str<E>(self, text: &str) -> Result<Element, E> {
                Ok(Element::Text(text.to_owned()))
            }
            fn visit_string<E>(self, text: String) -> Result<Element, E> {
                Ok(Element::Text(text))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Element, A::Error> {
                let mut tokens = Vec::new();
                while let Some(t) = seq.next_element::<u32>()? {
                    tokens.push(t);
                }
                Ok(Element::Tokens(tokens))
            }
        }
        d.deserialize_any(V)
    }
}

/// A later prompt of a list of texts: checked to be one, not kept.
struct TextOnly;

impl<'de> serde::Deserialize<'de> for TextOnly {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<TextOnly, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = TextOnly;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string, as the list's first prompt")
            }
            fn visit_str<E>(self, _: &str) -> Result<TextOnly, E> {
                Ok(TextOnly)
            }
        }
        d.deserialize_str(V)
    }
}

/// A later prompt of a list of token-id lists (or any of a batch's): checked to be one, not
/// kept.
struct TokensOnly;

impl<'de> serde::Deserialize<'de> for TokensOnly {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<TokensOnly, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = TokensOnly;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a list of token ids, as the list's first prompt")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<TokensOnly, A::Error> {
                while seq.next_element::<u32>()?.is_some() {}
                Ok(TokensOnly)
            }
        }
        d.deserialize_seq(V)
    }
}

/// The code of [`ApiError::prompt_batch`]: the completions handler splits the body then.
pub const PROMPT_BATCH: &str = "prompt_batch";

/// Most prompts one completions request may list (each becomes a request of its own).
pub const MAX_BATCH: usize = 1024;

/// A completions body whose `prompt` lists several prompts, split into one body per prompt
/// (the same request with `prompt` set to that one), in order; `None` if its `prompt` is a
/// single one. The other fields are written once and repeated in every part: a batch whose
/// parts would take more than `limit` bytes beyond the body is refused (an 8 MiB body of
/// padding and a thousand prompts would otherwise be 8 GiB of parts). The caller merges
/// the answers (`ingress::batch`). Fields and prompts are kept as the body's own text, not
/// read into a tree of values (about 80 B a token: 330 MB for an 8 MiB body).
pub fn split_batch(body: &[u8], limit: usize) -> Result<Option<Vec<bytes::Bytes>>, ApiError> {
    use serde_json::value::RawValue;
    let invalid =
        |e: serde_json::Error| ApiError::bad_request(format!("invalid request body: {e}"));
    let request: BatchFields = serde_json::from_slice(body).map_err(invalid)?;
    // A list of texts or of token lists; a list of numbers is one prompt's tokens, and a
    // mixed or deeper list is left to the request's parse to refuse.
    let Some(prompt) = request.prompt.map(RawValue::get) else {
        return Ok(None);
    };
    let first = prompt
        .strip_prefix('[')
        .and_then(|rest| rest.trim_start().bytes().next());
    let texts = match first {
        Some(b'"') => true,
        Some(b'[') => false,
        _ => return Ok(None),
    };
    let PromptList { prompts, count } = serde_json::from_str(prompt).map_err(invalid)?;
    if count > MAX_BATCH {
        return Err(ApiError::bad_request(format!(
            "a prompt list of {count} prompts: at most {MAX_BATCH}"
        )));
    }
    let alike = prompts.iter().all(|p| {
        if texts {
            p.get().starts_with('"')
        } else {
            serde_json::from_str::<TokensOnly>(p.get()).is_ok()
        }
    });
    if count < 2 || !alike {
        return Ok(None);
    }
    let rest = request.rest;
    let repeated = rest.len().saturating_mul(count);
    if repeated > limit {
        return Err(ApiError::bad_request(format!(
            "a prompt list of {count} prompts with {} bytes of other fields: its {repeated} \
             bytes of parts pass the limit of {limit}",
            rest.len()
        )));
    }
    // `{"prompt":P,` then the other fields' object without its `{` (or `}` if none).
    let fields = &rest[1..];
    let parts = prompts
        .iter()
        .map(|prompt| {
            let prompt = prompt.get().as_bytes();
            let mut part = Vec::with_capacity(12 + prompt.len() + fields.len());
            part.extend_from_slice(b"{\"prompt\":");
            part.extend_from_slice(prompt);
            if fields != b"}" {
                part.push(b',');
            }
            part.extend_from_slice(fields);
            bytes::Bytes::from(part)
        })
        .collect();
    Ok(Some(parts))
}

/// Most top-level fields of a batch's body besides `prompt` (OpenAI's and vLLM's requests
/// have a few dozen).
pub const MAX_BATCH_FIELDS: usize = 1024;

/// A completions body read for its split: its `prompt` as its own text, and its other
/// fields written out as an object in the body's order, as they come (a map of them held
/// about 100 B a field outside the body's memory budget: 70 MB for an 8 MiB body of empty
/// fields, on every tokenizer thread at once).
struct BatchFields<'a> {
    prompt: Option<&'a serde_json::value::RawValue>,
    /// `{…}`: the other fields.
    rest: Vec<u8>,
}

impl<'de: 'a, 'a> serde::Deserialize<'de> for BatchFields<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<BatchFields<'a>, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for V<'a> {
            type Value = BatchFields<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a request object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<BatchFields<'a>, A::Error> {
                use serde::de::Error;
                let mut out = BatchFields {
                    prompt: None,
                    rest: vec![b'{'],
                };
                let mut fields = 0;
                while let Some(key) = map.next_key::<String>()? {
                    let value: &'a serde_json::value::RawValue = map.next_value()?;
                    if key == "prompt" {
                        out.prompt = Some(value);
                        continue;
                    }
                    fields += 1;
                    if fields > MAX_BATCH_FIELDS {
                        return Err(A::Error::custom(format!(
                            "more than {MAX_BATCH_FIELDS} fields"
                        )));
                    }
                    if out.rest.len() > 1 {
                        out.rest.push(b',');
                    }
                    serde_json::to_writer(&mut out.rest, &key).map_err(A::Error::custom)?;
                    out.rest.push(b':');
                    out.rest.extend_from_slice(value.get().as_bytes());
                }
                out.rest.push(b'}');
                Ok(out)
            }
        }
        d.deserialize_map(V(std::marker::PhantomData))
    }
}

/// A `prompt` list's elements as their own text, up to [`MAX_BATCH`] of them, and how
/// many it has.
struct PromptList<'a> {
    prompts: Vec<&'a serde_json::value::RawValue>,
    count: usize,
}

impl<'de: 'a, 'a> serde::Deserialize<'de> for PromptList<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<PromptList<'a>, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for V<'a> {
            type Value = PromptList<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a list of prompts")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<PromptList<'a>, A::Error> {
                let mut list = PromptList {
                    prompts: Vec::new(),
                    count: 0,
                };
                while list.count < MAX_BATCH {
                    let Some(p) = seq.next_element()? else {
                        return Ok(list);
                    };
                    list.prompts.push(p);
                    list.count += 1;
                }
                // Past the limit: counted for the refusal, not kept.
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {
                    list.count += 1;
                }
                Ok(list)
            }
        }
        d.deserialize_seq(V(std::marker::PhantomData))
    }
}

/// Of a request's `vllm_xargs` (vLLM's per-request `SamplingParams.extra_args`), the one
/// key the router acts on.
///
/// `kv_cache_report_mode: "full"` makes vLLM announce the cached blocks the request reuses
/// as `BlockStored` events again (`KVCacheManager.get_computed_blocks` in
/// `vllm/v1/core/kv_cache_manager.py`; its `docs/features/kv_events.md` says event reference
/// counts cannot tell them from new copies). An engine's mirror counts each `BlockStored` of
/// a hash as a copy, which one `BlockRemoved` each takes back: the re-announced ones are
/// never removed, and the blocks would stay in the index after the engine evicted them (an
/// overcount). The router takes the key out of the body it sends an engine
/// ([`without_report_mode`]).
#[derive(Debug, Default, Deserialize)]
pub struct VllmXargs {
    /// `"full"` or `"incremental"` (vLLM's default).
    #[serde(default)]
    pub kv_cache_report_mode: ReportMode,
}

impl VllmXargs {
    /// Whether `xargs` ask for vLLM's full reporting.
    pub fn reports_full(xargs: Option<&VllmXargs>) -> bool {
        xargs.is_some_and(|x| x.kv_cache_report_mode.full)
    }
}

/// Whether a `kv_cache_report_mode` value is the string `"full"`. Any other value is read
/// past without being kept: held as a JSON value, an 8 MiB array there took hundreds of MB
/// (a completion's body has no count of its values, as a chat's has).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReportMode {
    /// The value was `"full"`.
    pub full: bool,
}

impl<'de> Deserialize<'de> for ReportMode {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = ReportMode;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a report mode")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ReportMode, E> {
                Ok(ReportMode { full: v == "full" })
            }
            fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<ReportMode, E> {
                Ok(ReportMode::default())
            }
            fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<ReportMode, E> {
                Ok(ReportMode::default())
            }
            fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<ReportMode, E> {
                Ok(ReportMode::default())
            }
            fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<ReportMode, E> {
                Ok(ReportMode::default())
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<ReportMode, E> {
                Ok(ReportMode::default())
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<ReportMode, A::Error> {
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(ReportMode::default())
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<ReportMode, A::Error> {
                while map
                    .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
                    .is_some()
                {}
                Ok(ReportMode::default())
            }
        }
        d.deserialize_any(Visitor)
    }
}

/// `body` without `vllm_xargs.kv_cache_report_mode` (and without `vllm_xargs` if nothing
/// else was in it); the other fields written as they came, in their order. `None` if the
/// body has no such key.
pub fn without_report_mode(body: &[u8]) -> Result<Option<bytes::Bytes>, serde_json::Error> {
    let mut request: RawObject = serde_json::from_slice(body)?;
    let Some(raw) = request.get("vllm_xargs") else {
        return Ok(None);
    };
    // Its other keys as they came too (a number past 64 bits read into a value would be
    // written back as a float).
    let mut xargs: RawObject = serde_json::from_str(raw.get())?;
    let before = xargs.0.len();
    xargs.0.retain(|(k, _)| k != "kv_cache_report_mode");
    if xargs.0.len() == before {
        return Ok(None);
    }
    if xargs.0.is_empty() {
        request.0.retain(|(k, _)| k != "vllm_xargs");
    } else if let Some(raw) = request.get_mut("vllm_xargs") {
        *raw = serde_json::value::to_raw_value(&xargs)?;
    }
    serde_json::to_vec(&request).map(|v| Some(v.into()))
}

/// A JSON object's fields in order, each value as it was written (a `serde_json::Value`
/// tree of a body of token ids is tens of times its size).
#[derive(Debug, Default)]
pub(super) struct RawObject(pub(super) Vec<(String, Box<serde_json::value::RawValue>)>);

impl RawObject {
    pub(super) fn get(&self, key: &str) -> Option<&serde_json::value::RawValue> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| &**v)
    }

    pub(super) fn get_mut(&mut self, key: &str) -> Option<&mut Box<serde_json::value::RawValue>> {
        self.0.iter_mut().find(|(k, _)| k == key).map(|(_, v)| v)
    }
}

impl<'de> Deserialize<'de> for RawObject {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> serde::de::Visitor<'de> for Fields {
            type Value = RawObject;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<RawObject, A::Error> {
                let mut fields = Vec::new();
                while let Some(field) =
                    map.next_entry::<String, Box<serde_json::value::RawValue>>()?
                {
                    fields.push(field);
                }
                Ok(RawObject(fields))
            }
        }
        d.deserialize_map(Fields)
    }
}

impl serde::Serialize for RawObject {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

/// `POST /v1/completions`. Fields clients may send as `null` read as absent, as vLLM's
/// request models (pydantic, `Optional`) take them; but `max_tokens`, whose default is 16
/// only when absent.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    /// Model name; must be one the fleet serves. Absent: the fleet's only base model (vLLM
    /// serves its first then: `_is_model_supported`).
    #[serde(default)]
    pub model: Option<String>,
    /// The prompt.
    pub prompt: Prompt,
    /// Tokens to generate per sequence: 16 when absent (vLLM's and OpenAI's default),
    /// unlimited when `null` (vLLM's `max_tokens: int | None = 16`, in
    /// vllm/entrypoints/openai/completion/protocol.py: the engine then generates up to the
    /// context length).
    #[serde(default = "default_max_tokens", deserialize_with = "lax_u32")]
    pub max_tokens: Option<u32>,
    /// Sequences to generate.
    #[serde(default, deserialize_with = "lax_u32")]
    pub n: Option<u32>,
    /// vLLM's scheduling priority: lower is handled earlier (vLLM's `protocol.py`: "The
    /// priority of the request (lower means earlier handling; default: 0)").
    #[serde(default, deserialize_with = "lax_i64")]
    pub priority: Option<i64>,
    /// OpenAI's processing tier (`auto`, `default`, `flex`, `priority`, `scale`).
    #[serde(default)]
    pub service_tier: Option<String>,
    /// Stream SSE chunks as they are generated.
    #[serde(default)]
    pub stream: Option<bool>,
    /// `include_usage`: a last chunk carries the usage (as OpenAI and vLLM send it).
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Add the tokenizer's special tokens (BOS) to the prompt; vLLM's default for
    /// completions: true.
    #[serde(default)]
    pub add_special_tokens: Option<bool>,
    /// vLLM's `cache_salt`: the prompt's blocks are salted with it, so only requests with
    /// the same salt share them.
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// vLLM's extra sampling arguments; only `kv_cache_report_mode` is read
    /// ([`VllmXargs`]).
    #[serde(default)]
    pub vllm_xargs: Option<VllmXargs>,
    /// vLLM's `truncate_prompt_tokens`: keep only the prompt's last this many tokens
    /// ([`prompt_keep`]).
    #[serde(default, deserialize_with = "lax_i64")]
    pub truncate_prompt_tokens: Option<i64>,
}

/// An integer field as vLLM's request models (pydantic, in its lax mode) take it: an
/// integer, or a number with no fractional part (`256.0`: Python clients that compute token
/// budgets send floats, which vLLM answers and serde refused with a 400), or a string of
/// one ([`integral_text`]); `2.5` is refused.
fn integral(n: &serde_json::Number) -> Option<i128> {
    if let Some(u) = n.as_u64() {
        return Some(i128::from(u));
    }
    if let Some(i) = n.as_i64() {
        return Some(i128::from(i));
    }
    let f = n.as_f64()?;
    (f.fract() == 0.0 && f.abs() < 9.2e18).then_some(f as i128)
}

/// An integer written as a string, as pydantic's lax mode reads one (`str_as_int` in
/// pydantic-core): surrounding whitespace ignored, a sign, digits with single underscores
/// between them, and a fraction of one or more zeros (`" 16 "`, `"+16"`, `"1_024"`,
/// `"16.00"`; not `"16."`, which pydantic refuses since 2.18). Not matched: pydantic also
/// reads `true`/`false` as 1/0 and strips leading zeros before it checks underscores.
fn integral_text(text: &str) -> Option<i128> {
    let text = text.trim();
    let whole = match text.find('.') {
        Some(dot) if dot + 1 < text.len() && text[dot + 1..].bytes().all(|b| b == b'0') => {
            &text[..dot]
        }
        Some(_) => return None,
        None => text,
    };
    let digits = whole.strip_prefix(['+', '-']).unwrap_or(whole);
    let well_formed = !digits.is_empty()
        && digits
            .split('_')
            .all(|run| !run.is_empty() && run.bytes().all(|b| b.is_ascii_digit()));
    if !well_formed {
        return None;
    }
    whole.replace('_', "").parse().ok()
}

/// A lax integer field's value as sent: a number or a string (anything else is refused).
enum LaxInt {
    Number(serde_json::Number),
    Text(String),
}

impl<'de> Deserialize<'de> for LaxInt {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = LaxInt;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an integer (a number, or a string of one)")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<LaxInt, E> {
                Ok(LaxInt::Number(v.into()))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<LaxInt, E> {
                Ok(LaxInt::Number(v.into()))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<LaxInt, E> {
                serde_json::Number::from_f64(v)
                    .map(LaxInt::Number)
                    .ok_or_else(|| E::custom(format!("{v} is not an integer")))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<LaxInt, E> {
                Ok(LaxInt::Text(v.to_owned()))
            }
        }
        d.deserialize_any(Visitor)
    }
}

impl LaxInt {
    fn integral(&self) -> Option<i128> {
        match self {
            LaxInt::Number(n) => integral(n),
            LaxInt::Text(t) => integral_text(t),
        }
    }
}

impl std::fmt::Display for LaxInt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LaxInt::Number(n) => write!(f, "{n}"),
            // A refused string is echoed in the 400: its first characters only.
            LaxInt::Text(t) if t.chars().nth(32).is_some() => {
                let head: String = t.chars().take(32).collect();
                write!(f, "{head:?}…")
            }
            LaxInt::Text(t) => write!(f, "{t:?}"),
        }
    }
}

fn lax_u32<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    use serde::de::Error;
    let Some(n) = Option::<LaxInt>::deserialize(d)? else {
        return Ok(None);
    };
    n.integral()
        .and_then(|v| u32::try_from(v).ok())
        .map(Some)
        .ok_or_else(|| D::Error::custom(format!("{n} is not an integer from 0 to {}", u32::MAX)))
}

fn lax_i64<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
    use serde::de::Error;
    let Some(n) = Option::<LaxInt>::deserialize(d)? else {
        return Ok(None);
    };
    n.integral()
        .and_then(|v| i64::try_from(v).ok())
        .map(Some)
        .ok_or_else(|| D::Error::custom(format!("{n} is not a 64-bit integer")))
}

fn default_max_tokens() -> Option<u32> {
    Some(DEFAULT_MAX_TOKENS)
}

/// How many of a prompt's tokens vLLM keeps for a request's `truncate_prompt_tokens`, so
/// that the router hashes, books and routes what the engine caches: the last `k` (its
/// renderer's `TokenizeParams`, text and token prompts alike; a generating model's tokenizer
/// truncates on the left, vLLM loads it with `truncation_side="left"`; see
/// [`Tokenizer::encode_within`](super::tokenizer::Tokenizer::encode_within) for the special
/// tokens). `None` keeps them all: absent, or -1, which means the engine's context length
/// less `max_tokens`, which the router does not know (only a prompt longer than that is then
/// routed on blocks the engine will not keep). Below -1 is refused, as vLLM's request model
/// (`ge=-1`) refuses it, and 0, which leaves no prompt.
pub fn prompt_keep(truncate_prompt_tokens: Option<i64>) -> Result<Option<usize>, ApiError> {
    match truncate_prompt_tokens {
        None | Some(-1) => Ok(None),
        Some(k) if k < 1 => Err(ApiError::bad_request(format!(
            "truncate_prompt_tokens must be -1 or at least 1, not {k}"
        ))),
        Some(k) => Ok(Some(usize::try_from(k).unwrap_or(usize::MAX))),
    }
}

/// Options of a streamed answer.
#[derive(Clone, Copy, Debug, Default)]
pub struct StreamOptions {
    /// Send the usage in a last chunk (with no choices) before `[DONE]`: absent, vLLM's
    /// default once `stream_options` is sent, true; sent as null, vLLM's `None`, which it
    /// reads as false (`Some(None)` here).
    pub include_usage: Option<Option<bool>>,
    /// The object named any option (null or not): what vLLM refuses without `stream`.
    pub any: bool,
}

/// Read key by key, the others (vLLM's `continuous_usage_stats`, whatever else was sent)
/// skipped unread: a flattened map of them buffered every value first, so an 8 MiB array
/// under an unknown key took 300 MB.
impl<'de> Deserialize<'de> for StreamOptions {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = StreamOptions;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object of stream options")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<StreamOptions, A::Error> {
                let mut options = StreamOptions::default();
                while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    options.any = true;
                    if key == "include_usage" {
                        options.include_usage = Some(map.next_value::<Option<bool>>()?);
                    } else {
                        map.next_value::<serde::de::IgnoredAny>()?;
                    }
                }
                Ok(options)
            }
        }
        d.deserialize_map(Visitor)
    }
}

/// vLLM's rule for `stream_options` (`validate_stream_options` in its `protocol.py`, on
/// chat and completion requests alike): an object naming any option is refused unless
/// `stream` is true; null or `{}` pass (Python reads them as false).
pub fn check_stream_options(
    stream: Option<bool>,
    options: Option<StreamOptions>,
) -> Result<(), ApiError> {
    if options.is_some_and(|o| o.any) && stream != Some(true) {
        return Err(ApiError::bad_request(
            "Stream options can only be defined when `stream=True`.",
        ));
    }
    Ok(())
}

/// Most JSON values a chat body may hold. A chat is read into JSON values whole (messages'
/// extra fields, tools, documents and template kwargs go to the template as they came), at
/// 80 B or more a value, from as little as two bytes (`0,`): an 8 MiB body of small values
/// took 340 MB. A conversation of 1,000 messages with 500 tools' schemas holds some tens
/// of thousands.
pub const MAX_CHAT_VALUES: usize = 1 << 18;

/// Whether the JSON text `body` holds more than `limit` values (a fast upper estimate: each
/// comma, colon and opening bracket outside strings counts one, so a key counts with its
/// value). Linear, and reads nothing into memory.
pub fn json_values_over(body: &[u8], limit: usize) -> bool {
    let (mut values, mut in_string, mut escaped) = (1usize, false, false);
    for &b in body {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b',' | b':' | b'[' | b'{' => {
                values += 1;
                if values > limit {
                    return true;
                }
            }
            _ => {}
        }
    }
    false
}

/// Whether a request's `stream_options` ask for the usage chunk.
pub fn include_usage(options: Option<StreamOptions>) -> bool {
    options.is_some_and(|o| o.include_usage.unwrap_or(Some(true)).unwrap_or(false))
}

/// One chat message.
#[derive(Debug, Deserialize, serde::Serialize)]
#[serde(try_from = "RawChatMessage")]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, …
    pub role: String,
    /// Its text as a template that takes content as a string gets it: a string, the
    /// non-empty text parts of an array joined with newlines, or null / absent (an
    /// assistant turn of tool calls) for none, as vLLM reads it (`_parse_chat_message_content`
    /// in vllm/entrypoints/chat_utils.py).
    pub content: String,
    /// Its content as a template that loops over content parts gets it (vLLM's "openai"
    /// format): one `{"type": "text", "text": …}` for each text part (a string content is
    /// one), none for null.
    #[serde(skip)]
    pub parts: Vec<serde_json::Value>,
    /// It has parts other than text (images, audio): the router cannot tell the tokens an
    /// engine gives them, so it hashes only the conversation before such a message.
    #[serde(skip)]
    pub media: bool,
    /// Its other fields (`name`, `tool_calls`, `tool_call_id`, `reasoning_content`, …),
    /// handed to the chat template as they came: templates render tool calls and results.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl ChatMessage {
    /// A message of text alone.
    pub fn text(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.to_owned(),
            content: content.to_owned(),
            parts: vec![text_part(Some(content))],
            media: false,
            extra: serde_json::Map::new(),
        }
    }
}

/// A chat message as it comes.
#[derive(Deserialize)]
struct RawChatMessage {
    role: String,
    #[serde(default)]
    content: Option<RawContent>,
    #[serde(flatten)]
    extra: serde_json::Map<String, serde_json::Value>,
}

/// A message's `content`: text, or an array of parts (typed objects, or bare strings, which
/// vLLM takes as text).
#[derive(Deserialize)]
#[serde(untagged)]
enum RawContent {
    Text(String),
    Parts(Vec<RawPart>),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawPart {
    Text(String),
    Typed(ContentPart),
}

#[derive(Deserialize)]
struct ContentPart {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    refusal: Option<String>,
    #[serde(default)]
    thinking: Option<String>,
    /// Its other fields: an untyped part is named by them (`image_url`, `input_audio`, …).
    #[serde(flatten)]
    rest: serde_json::Map<String, serde_json::Value>,
}

impl TryFrom<RawChatMessage> for ChatMessage {
    type Error = String;

    fn try_from(raw: RawChatMessage) -> Result<ChatMessage, String> {
        let mut media = false;
        // Each text part's text; `None` for a part vLLM keeps with a null text.
        let mut texts: Vec<Option<String>> = Vec::new();
        match raw.content {
            None => {}
            Some(RawContent::Text(text)) => texts.push(Some(text)),
            Some(RawContent::Parts(parts)) => {
                // vLLM's `MM_PARSER_MAP` and `_parse_chat_message_content_part`
                // (vllm/entrypoints/chat_utils.py): `text`, `input_text`, `output_text` give
                // their `text`, `thinking` its `thinking`, `refusal` its `refusal`, a bare
                // string or a part without `type` is text. A `text` or `refusal` part whose
                // text is null is skipped; the others keep their null. Any other part
                // (images, audio, video) gets tokens or a place the router does not know.
                for p in parts {
                    let p = match p {
                        RawPart::Text(text) => {
                            texts.push(Some(text));
                            continue;
                        }
                        RawPart::Typed(p) => p,
                    };
                    match p.kind.as_deref() {
                        // vLLM names an untyped part by its fields: anything but text is
                        // media (or unknown) to the router.
                        None if p.text.is_none() && !p.rest.is_empty() => media = true,
                        None | Some("text") => texts.extend(p.text.map(Some)),
                        Some("refusal") => texts.extend(p.refusal.map(Some)),
                        Some("input_text" | "output_text") => texts.push(p.text),
                        Some("thinking") => texts.push(p.thinking),
                        Some(_) => media = true,
                    }
                }
            }
        }
        // The string format drops empty and null texts (vLLM keeps a part only if it is
        // truthy) and joins the rest with newlines; the parts format keeps every part.
        let content = texts
            .iter()
            .flatten()
            .filter(|t| !t.is_empty())
            .map(String::as_str)
            .collect::<Vec<_>>()
            .join("\n");
        let parts = texts.iter().map(|t| text_part(t.as_deref())).collect();
        // What vLLM's message for the template keeps besides role and content
        // (`_parse_chat_message_content`): a template that asks whether some other field
        // is defined would otherwise render differently here.
        let kept: &[&str] = match raw.role.as_str() {
            "assistant" => &["name", "tool_calls", "reasoning", "reasoning_content"],
            "tool" => &["name", "tool_call_id"],
            "developer" => &["name", "tools"],
            _ => &["name"],
        };
        let mut extra = raw.extra;
        extra.retain(|k, v| {
            kept.contains(&k.as_str())
                && !(v.is_null() && k != "tools")
                && (k != "name" || v.is_string())
        });
        if raw.role == "assistant" {
            assistant_fields(&mut extra);
        }
        Ok(ChatMessage {
            role: raw.role,
            content,
            parts,
            media,
            extra,
        })
    }
}

/// A text part as vLLM hands it to a template that loops over content parts.
fn text_part(text: Option<&str>) -> serde_json::Value {
    serde_json::json!({"type": "text", "text": text})
}

/// An assistant message's fields as vLLM hands them to the template
/// (`_postprocess_messages` and `_parse_chat_message_content` in vllm/entrypoints/
/// chat_utils.py): an empty `tool_calls` is dropped (templates take the plain path); each
/// call's `arguments`, a JSON string as OpenAI sends it, is parsed into its object (`{}`
/// when null, empty or not JSON, as a generation cut off by its `max_tokens` leaves it),
/// since templates render it as one (`arguments | tojson`, or iterate it); `reasoning` and
/// `reasoning_content` are both set from whichever came.
fn assistant_fields(extra: &mut serde_json::Map<String, serde_json::Value>) {
    use serde_json::Value;
    if let Some(Value::Array(calls)) = extra.get_mut("tool_calls") {
        if calls.is_empty() {
            extra.shift_remove("tool_calls");
        } else {
            for call in calls.iter_mut() {
                let Some(Value::Object(function)) = call.get_mut("function") else {
                    continue;
                };
                let parsed = match function.get("arguments") {
                    Some(Value::String(s)) if !s.is_empty() => serde_json::from_str(s)
                        .unwrap_or_else(|_| Value::Object(serde_json::Map::new())),
                    Some(Value::Object(_) | Value::Array(_)) => continue,
                    _ => Value::Object(serde_json::Map::new()),
                };
                function.insert("arguments".into(), parsed);
            }
        }
    }
    let reasoning = extra
        .get("reasoning")
        .filter(|r| !r.is_null())
        .or_else(|| extra.get("reasoning_content").filter(|r| !r.is_null()))
        .cloned();
    if let Some(r) = reasoning {
        extra.insert("reasoning".into(), r.clone());
        extra.insert("reasoning_content".into(), r);
    }
}

/// `POST /v1/chat/completions`. Fields clients may send as `null` read as absent.
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    /// Model name. Absent: the fleet's only base model (vLLM serves its first then).
    #[serde(default)]
    pub model: Option<String>,
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    /// Tokens to generate per sequence (none: up to the context, vLLM's default).
    #[serde(default, deserialize_with = "lax_u32")]
    pub max_tokens: Option<u32>,
    /// OpenAI's newer name for `max_tokens`; wins when both are sent (as in vLLM).
    #[serde(default, deserialize_with = "lax_u32")]
    pub max_completion_tokens: Option<u32>,
    /// Sequences to generate.
    #[serde(default, deserialize_with = "lax_u32")]
    pub n: Option<u32>,
    /// vLLM's scheduling priority: lower is handled earlier (vLLM's `protocol.py`: "The
    /// priority of the request (lower means earlier handling; default: 0)").
    #[serde(default, deserialize_with = "lax_i64")]
    pub priority: Option<i64>,
    /// OpenAI's processing tier (`auto`, `default`, `flex`, `priority`, `scale`).
    #[serde(default)]
    pub service_tier: Option<String>,
    /// Stream SSE chunks.
    #[serde(default)]
    pub stream: Option<bool>,
    /// `include_usage`: a last chunk carries the usage (as OpenAI and vLLM send it).
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Tools the template renders (into the system turn, for most templates).
    #[serde(default)]
    pub tools: Option<serde_json::Value>,
    /// Which tool the model may call: `none` leaves the tools out of the prompt where the
    /// engines run with `--exclude-tools-when-tool-choice-none`
    /// ([`super::tokenizer::Tokenizer::renders_tools`]).
    #[serde(default)]
    pub tool_choice: Option<serde_json::Value>,
    /// Documents for retrieval-augmented templates.
    #[serde(default)]
    pub documents: Option<serde_json::Value>,
    /// End the prompt with the assistant's turn opened (default true).
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    /// Leave the last message open: the model continues it (Hugging Face's
    /// `continue_final_message`).
    #[serde(default)]
    pub continue_final_message: Option<bool>,
    /// Add the tokenizer's special tokens on top of the template's (default false: the
    /// template writes them; vLLM's `ChatCompletionRequest.add_special_tokens`).
    #[serde(default)]
    pub add_special_tokens: Option<bool>,
    /// Extra variables for the template (`enable_thinking`, …); a `chat_template` among
    /// them is the template itself ([`ChatRequest::take_template`]).
    #[serde(default)]
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// OpenAI's reasoning effort (`none`, `low`, `medium`, `high`…): vLLM hands it to the
    /// template as `reasoning_effort`, and sets `enable_thinking` from it (true unless
    /// `none`) where the request's `chat_template_kwargs` do not
    /// (`ChatCompletionRequest.build_chat_params`).
    #[serde(default)]
    pub reasoning_effort: Option<serde_json::Value>,
    /// vLLM's `chat_template`: the request's own template, rendered only if the router
    /// trusts request templates ([`super::tokenizer::Tokenizer::request_template`]).
    #[serde(default)]
    pub chat_template: Option<String>,
    /// vLLM's `cache_salt`: the prompt's blocks are salted with it.
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// vLLM's extra sampling arguments ([`VllmXargs`]).
    #[serde(default)]
    pub vllm_xargs: Option<VllmXargs>,
    /// vLLM's `truncate_prompt_tokens` ([`prompt_keep`]).
    #[serde(default, deserialize_with = "lax_i64")]
    pub truncate_prompt_tokens: Option<i64>,
}

impl ChatRequest {
    /// Tokens to generate per sequence, if limited.
    pub fn max_tokens(&self) -> Option<u32> {
        self.max_completion_tokens.or(self.max_tokens)
    }

    /// The chat templates the request brings, taken out of it: its `chat_template` field and
    /// a `chat_template` in its `chat_template_kwargs` (null: none; not a template variable
    /// either way). Which one renders is [`RequestedTemplates::pick`]'s to say.
    pub fn take_templates(&mut self) -> Result<RequestedTemplates, ApiError> {
        let field = self.chat_template.take();
        let kwarg = match self
            .chat_template_kwargs
            .as_mut()
            .and_then(|kwargs| kwargs.shift_remove("chat_template"))
        {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(source)) => Some(source),
            Some(_) => {
                return Err(ApiError::bad_request(
                    "chat_template_kwargs.chat_template must be a string",
                ));
            }
        };
        Ok(RequestedTemplates { field, kwarg })
    }

    /// How the conversation is rendered and tokenized; takes the template fields.
    pub fn take_options(&mut self) -> ChatOptions {
        let mut kwargs = self.chat_template_kwargs.take().unwrap_or_default();
        if let Some(effort) = self.reasoning_effort.take().filter(|e| !e.is_null()) {
            if !kwargs.contains_key("enable_thinking") {
                let thinking = effort.as_str() != Some("none");
                kwargs.insert("enable_thinking".into(), thinking.into());
            }
            if !kwargs.contains_key("reasoning_effort") {
                kwargs.insert("reasoning_effort".into(), effort);
            }
        }
        ChatOptions {
            add_generation_prompt: self.add_generation_prompt.unwrap_or(true),
            continue_final_message: self.continue_final_message.unwrap_or(false),
            add_special_tokens: self.add_special_tokens.unwrap_or(false),
            tools: self.tools.take().map(vllm_tools),
            documents: self.documents.take(),
            kwargs,
            template: None,
        }
    }
}

/// The chat templates a request brought ([`ChatRequest::take_templates`]).
#[derive(Debug, Default)]
pub struct RequestedTemplates {
    /// Its `chat_template` field.
    pub field: Option<String>,
    /// A `chat_template` in its `chat_template_kwargs`.
    pub kwarg: Option<String>,
}

impl RequestedTemplates {
    /// Whether the request brought any (vLLM refuses it then unless it trusts request
    /// templates, whichever would render).
    pub fn any(&self) -> bool {
        self.field.is_some() || self.kwarg.is_some()
    }

    /// The one that renders, as vLLM main picks it (`build_chat_params`, then
    /// `ChatParams.get_apply_chat_template_kwargs` merging the template over the kwargs): the
    /// field; else, unless the server has a template of its own (`--chat-template`, which
    /// takes the field's place), the kwargs' one. (vLLM's older `_preprocess_chat` let the
    /// kwargs' win over both.)
    pub fn pick(self, server_template: bool) -> Option<String> {
        self.field.or(self.kwarg.filter(|_| !server_template))
    }
}

/// `tools` as vLLM hands them to the template: each tool through its pydantic models'
/// `model_dump()` (vllm/entrypoints/openai/chat_completion/protocol.py,
/// `ChatCompletionToolsParam`, `FunctionDefinition`), so `{"type", "function": {"name",
/// "description", "parameters", …}, …}` in that order, `description` and `parameters`
/// null when absent, any other fields after them in the order sent. Templates render it
/// with `tojson`: a different key order is different tokens. Anything not shaped like a
/// tool goes as it came.
fn vllm_tools(tools: serde_json::Value) -> serde_json::Value {
    use serde_json::{Map, Value};
    let serde_json::Value::Array(list) = tools else {
        return tools;
    };
    let tool = |t: Value| -> Value {
        let Value::Object(mut t) = t else {
            return t;
        };
        let Some(Value::Object(mut f)) = t.shift_remove("function") else {
            return Value::Object(t);
        };
        let mut function = Map::new();
        for key in ["name", "description", "parameters"] {
            function.insert(key.into(), f.shift_remove(key).unwrap_or(Value::Null));
        }
        function.extend(f);
        let mut out = Map::new();
        out.insert(
            "type".into(),
            t.shift_remove("type")
                .unwrap_or_else(|| Value::from("function")),
        );
        out.insert("function".into(), Value::Object(function));
        out.extend(t);
        Value::Object(out)
    };
    Value::Array(list.into_iter().map(tool).collect())
}

/// How a chat is rendered and tokenized: what vLLM hands Hugging Face's
/// `apply_chat_template` and its tokenizer (`ChatCompletionRequest`'s fields of the same
/// names), so that the router's tokens are the engine's.
#[derive(Clone, Debug)]
pub struct ChatOptions {
    /// Open the assistant's turn at the end.
    pub add_generation_prompt: bool,
    /// Cut the rendered text after the last message's content (it is continued).
    pub continue_final_message: bool,
    /// Add the tokenizer's special tokens to the rendered text.
    pub add_special_tokens: bool,
    /// `tools` for the template.
    pub tools: Option<serde_json::Value>,
    /// `documents` for the template.
    pub documents: Option<serde_json::Value>,
    /// Further template variables.
    pub kwargs: serde_json::Map<String, serde_json::Value>,
    /// The request's own template, compiled; `None`: the model's.
    pub template: Option<std::sync::Arc<super::tokenizer::RequestTemplate>>,
}

impl Default for ChatOptions {
    fn default() -> Self {
        ChatOptions {
            add_generation_prompt: true,
            continue_final_message: false,
            add_special_tokens: false,
            tools: None,
            documents: None,
            kwargs: serde_json::Map::new(),
            template: None,
        }
    }
}

/// `max_tokens` when a completion request sets none (vLLM's and OpenAI's).
pub const DEFAULT_MAX_TOKENS: u32 = 16;

/// The demo tokenizer: one token per UTF-8 byte (ids 0–255). Deterministic and
/// dependency-free, so equal text prefixes give equal block hashes on router and workers.
pub fn byte_tokens(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// Renders a chat as one prompt (a ChatML-style default template): the same conversation
/// prefix always renders to the same text, so later turns reuse earlier turns' blocks.
pub fn render_chat(messages: &[ChatMessage], add_generation_prompt: bool) -> String {
    let mut out = String::new();
    for m in messages {
        out.push_str("<|im_start|>");
        out.push_str(&m.role);
        out.push('\n');
        out.push_str(&m.content);
        out.push_str("<|im_end|>\n");
    }
    if add_generation_prompt {
        out.push_str("<|im_start|>assistant\n");
    }
    out
}

/// Whose fault an error is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The client sent something wrong.
    Client,
    /// A worker failed.
    Worker,
    /// The router itself (overloaded, no workers).
    Router,
}

/// An error answered to a client.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    /// HTTP status.
    pub status: u16,
    /// OpenAI error type.
    pub kind: &'static str,
    /// OpenAI error code, where OpenAI has one (`model_not_found`, `invalid_api_key`).
    pub code: Option<&'static str>,
    /// Human-readable message.
    pub message: String,
    /// Whose fault.
    pub fault: Fault,
    /// Whether retrying the same request later can succeed.
    pub retryable: bool,
    /// For a retryable error, the `Retry-After` the client is sent, s.
    pub retry_after_s: u64,
    /// The worker's own error body (in OpenAI's shape), sent as it came instead of one of the
    /// router's: an engine's refusal keeps its type, code and param.
    pub worker_body: Option<bytes::Bytes>,
}

impl ApiError {
    fn new(status: u16, kind: &'static str, fault: Fault, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind,
            code: None,
            message: message.into(),
            fault,
            retryable: matches!(status, 429 | 503 | 504),
            retry_after_s: 1,
            worker_body: None,
        }
    }

    /// 400: a completions `prompt` lists several prompts, where one request is parsed (the
    /// router splits such a body before: [`split_batch`]).
    pub fn prompt_batch(prompts: usize) -> Self {
        ApiError {
            code: Some(PROMPT_BATCH),
            ..ApiError::bad_request(format!(
                "a prompt list of {prompts} prompts, where one prompt was expected"
            ))
        }
    }

    /// 400: the request is malformed.
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError::new(400, "invalid_request_error", Fault::Client, message)
    }

    /// 401: no valid API key (or admin token).
    pub fn unauthorized() -> Self {
        ApiError {
            code: Some("invalid_api_key"),
            ..ApiError::new(
                401,
                "invalid_request_error",
                Fault::Client,
                "missing or incorrect API key: send it as 'Authorization: Bearer KEY'",
            )
        }
    }

    /// 404: no registered worker serves this model.
    pub fn model_not_found(model: &str) -> Self {
        ApiError {
            code: Some("model_not_found"),
            ..ApiError::new(
                404,
                "invalid_request_error",
                Fault::Client,
                format!("the model {model:?} does not exist or is not served here"),
            )
        }
    }

    /// 408: the request body did not arrive in time.
    pub fn body_timeout(ms: u64) -> Self {
        ApiError::new(
            408,
            "invalid_request_error",
            Fault::Client,
            format!("request body not received within {ms} ms"),
        )
    }

    /// 413: a prompt too long to tokenize, for a worker that needs its tokens.
    pub fn prompt_not_tokenized(limit: usize) -> Self {
        ApiError::new(
            413,
            "invalid_request_error",
            Fault::Client,
            format!(
                "the prompt's text is over the {limit} bytes the router tokenizes \
                 (max_tokenize_bytes), and the worker chosen needs its tokens"
            ),
        )
    }

    /// 413: a chat body of more JSON values than [`MAX_CHAT_VALUES`].
    pub fn too_many_values() -> Self {
        ApiError::new(
            413,
            "invalid_request_error",
            Fault::Client,
            format!("a chat body of more than {MAX_CHAT_VALUES} JSON values"),
        )
    }

    /// 413: the body is over the limit.
    pub fn too_large(limit: usize) -> Self {
        ApiError::new(
            413,
            "invalid_request_error",
            Fault::Client,
            format!("request body over {limit} bytes"),
        )
    }

    /// 429: too many requests in flight.
    pub fn overloaded(limit: usize) -> Self {
        ApiError::new(
            429,
            "rate_limit_error",
            Fault::Router,
            format!("{limit} requests in flight; retry shortly"),
        )
    }

    /// 429: a queued request gave its place to one of a higher band while the router was
    /// at its limit of requests at once.
    pub fn displaced(band: i32, by: i32) -> Self {
        ApiError::new(
            429,
            "rate_limit_error",
            Fault::Router,
            format!(
                "the router is at its limit of requests at once and a request of priority \
                 band {by} took this one's place in band {band}'s queue; retry later"
            ),
        )
        .retry_after(1)
    }

    /// 429: every tokenizer thread stayed busy for the router's wait.
    pub fn tokenizer_busy(wait: std::time::Duration) -> Self {
        ApiError::new(
            429,
            "rate_limit_error",
            Fault::Router,
            format!(
                "every tokenizer thread stayed busy for {} ms; retry shortly",
                wait.as_millis()
            ),
        )
    }

    /// 429: the request bodies the router holds would pass their memory budget.
    pub fn bodies_over_budget(budget: usize) -> Self {
        ApiError::new(
            429,
            "rate_limit_error",
            Fault::Router,
            format!(
                "request bodies held by the router would pass its budget of {budget} bytes; retry shortly"
            ),
        )
    }

    /// 429: the request's priority band already has its limit of requests waiting.
    /// `retry_after_s`: about how long the band's oldest request has waited.
    pub fn queue_full(band: i32, limit: usize, retry_after_s: u64) -> Self {
        ApiError::new(
            429,
            "rate_limit_error",
            Fault::Router,
            format!(
                "{limit} requests already wait in priority band {band}; retry in \
                 {retry_after_s} s"
            ),
        )
        .retry_after(retry_after_s)
    }

    /// 429: the request waited its band's deadline without a worker having room for it.
    pub fn queue_deadline(band: i32, waited_ms: u64, retry_after_s: u64) -> Self {
        ApiError::new(
            429,
            "rate_limit_error",
            Fault::Router,
            format!(
                "no worker had room for the request within priority band {band}'s deadline \
                 (waited {waited_ms} ms); retry later"
            ),
        )
        .retry_after(retry_after_s)
    }

    /// The same error, telling the client to retry after `seconds` (`Retry-After`).
    fn retry_after(self, seconds: u64) -> Self {
        ApiError {
            retry_after_s: seconds,
            ..self
        }
    }

    /// 503: the router has no worker to send anything to.
    pub fn no_workers() -> Self {
        ApiError::new(503, "server_error", Fault::Router, "no worker registered")
    }

    /// 503: the router is shutting down; another replica can take the request.
    pub fn shutting_down() -> Self {
        ApiError::new(
            503,
            "server_error",
            Fault::Router,
            "this router is shutting down: retry, another replica will take it",
        )
        .retry_after(1)
    }

    /// 502: the worker's answer broke off or was unusable after its success status (not
    /// retried: it was generated).
    pub fn bad_gateway(message: impl Into<String>) -> Self {
        ApiError::new(502, "server_error", Fault::Worker, message)
    }

    /// 503: no worker could take the request (after retries).
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError::new(503, "server_error", Fault::Worker, message)
    }

    /// 503: the router could not open a connection for want of its own resources (file
    /// descriptors): its fault, not the workers'.
    pub fn router_exhausted(message: impl Into<String>) -> Self {
        ApiError::new(503, "server_error", Fault::Router, message)
    }

    /// 504: a worker did not answer in time.
    pub fn worker_timeout(message: impl Into<String>) -> Self {
        ApiError::new(504, "server_error", Fault::Worker, message)
    }

    /// 405: a known endpoint asked with a method it does not answer (`allow`: those it
    /// does).
    pub fn method_not_allowed(method: &hyper::Method, allow: &str) -> Self {
        ApiError::new(
            405,
            "invalid_request_error",
            Fault::Client,
            format!("method {method} not allowed here; use {allow}"),
        )
    }

    /// 404: no such endpoint.
    pub fn not_found() -> Self {
        ApiError::new(
            404,
            "invalid_request_error",
            Fault::Client,
            "no such endpoint",
        )
    }

    /// A worker refused the request itself (a 4xx that another worker would refuse too):
    /// its status and message, the client's fault; its own error body, if it is in
    /// OpenAI's shape, goes to the client as it came.
    pub fn refused_by_worker(
        status: u16,
        message: impl Into<String>,
        body: Option<bytes::Bytes>,
    ) -> Self {
        ApiError {
            worker_body: body,
            ..ApiError::new(status, "invalid_request_error", Fault::Client, message)
        }
    }

    /// The JSON body: the worker's own, or one in OpenAI's shape.
    pub fn body(&self) -> String {
        if let Some(body) = &self.worker_body {
            return String::from_utf8_lossy(body).into_owned();
        }
        self.openai_body()
    }

    /// The body in OpenAI's shape (`{"error": {…}}`) whatever the worker sent, on one line:
    /// what an error event in a stream carries, since OpenAI's clients raise only for an
    /// event with an `error` (older vLLM's flat `{"object": "error", …}` was read as a
    /// malformed chunk, and a body with a line break would have split the event).
    pub fn openai_body(&self) -> String {
        serde_json::json!({"error": {"message": self.message, "type": self.kind, "param": null, "code": self.code}}).to_string()
    }

    /// Metric label of the fault.
    pub fn fault_label(&self) -> &'static str {
        match self.fault {
            Fault::Client => "client",
            Fault::Worker => "worker",
            Fault::Router => "router",
        }
    }
}

/// A fresh response id: `prefix` and 24 hex digits (96 random bits), so ids do not repeat
/// across requests, workers or restarts.
pub fn response_id(prefix: &str) -> String {
    use std::hash::{BuildHasher, Hasher};
    // RandomState is seeded per process from the OS; a counter makes ids within a process
    // distinct even if two hashers were seeded alike.
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(n);
    let high = h.finish();
    h.write_u64(high);
    let low = h.finish() as u32;
    format!("{prefix}{high:016x}{low:08x}")
}

/// Seconds since the Unix epoch (OpenAI's `created`).
pub fn unix_seconds() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::Prompt;

    fn read(json: &str) -> Result<Prompt, serde_json::Error> {
        serde_json::from_str(json)
    }

    /// Each form `prompt` takes reads as it did through an untagged enum of the forms; a
    /// list whose prompts are not alike, a token id past u32 or any other value is refused.
    #[test]
    fn prompts_are_read_in_every_form_and_nothing_else() {
        let forms = [
            (r#""hi""#, "Text(\"hi\")"),
            (r#""h\"i""#, "Text(\"h\\\"i\")"),
            ("[1,2,3]", "Tokens([1, 2, 3])"),
            ("[]", "Tokens([])"),
            (r#"["hi"]"#, "Text(\"hi\")"),
            (r#"["a","b","c"]"#, "Batch(3)"),
            ("[[1,2]]", "Tokens([1, 2])"),
            ("[[1,2],[],[3]]", "Batch(3)"),
            ("[[]]", "Tokens([])"),
            ("[4294967295]", "Tokens([4294967295])"),
        ];
        for (json, want) in forms {
            let got = read(json).unwrap_or_else(|e| panic!("{json}: {e}"));
            assert_eq!(format!("{got:?}"), want, "{json}");
        }
        for bad in [
            "[1,\"a\"]",
            "[\"a\",1]",
            "[[1],\"a\"]",
            "[\"a\",[1]]",
            "[[1],[\"a\"]]",
            "[1,[2]]",
            "[4294967296]",
            "[1,4294967296]",
            "[-1]",
            "[1.5]",
            "[[[1]]]",
            "1",
            "null",
            "{}",
            "[null]",
        ] {
            assert!(read(bad).is_err(), "{bad} was read");
        }
    }
}
