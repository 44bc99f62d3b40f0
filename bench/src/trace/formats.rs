//! Trace formats besides Mooncake's JSONL: the Azure LLM inference CSV (arrival times and
//! lengths, no prefixes: those are synthesised and labelled so) and a JSONL of OpenAI
//! requests (text prompts or chats, tokenized as the router would).

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use kvroute::ingress::openai::ChatMessage;
use kvroute::ingress::tokenizer::Tokenizer;
use serde::Deserialize;

use super::{TraceRecord, load, locate, mix, read_records};

/// How a trace file is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TraceFormat {
    /// By the file: `.csv` is Azure; a JSONL whose first record has `hash_ids` is Mooncake,
    /// else OpenAI requests.
    Auto,
    /// Mooncake JSONL: `timestamp` (ms), `input_length`, `output_length`, `hash_ids`.
    Mooncake,
    /// Azure LLM inference CSV: `TIMESTAMP,ContextTokens,GeneratedTokens`.
    Azure,
    /// One OpenAI request per line: `prompt` or `messages`, `max_tokens`, optional
    /// `timestamp` (ms).
    Openai,
}

/// Which trace to read and how: the flags `replay` and `online` share.
#[derive(clap::Args, Clone, Debug)]
pub struct TraceArgs {
    /// Trace: Mooncake JSONL, Azure LLM inference CSV or a JSONL of OpenAI requests.
    #[arg(long, default_value = "bench/traces/conversation_trace.jsonl")]
    pub trace: PathBuf,
    /// The trace's format (auto: `.csv` is Azure; JSONL with `hash_ids` is Mooncake, else
    /// OpenAI requests).
    #[arg(long, value_enum, default_value = "auto")]
    pub trace_format: TraceFormat,
    /// First N requests only.
    #[arg(long)]
    pub requests: Option<usize>,
    /// Tokens per trace hash id (Mooncake, and the synthetic Azure prefixes).
    #[arg(long, default_value_t = 512)]
    pub trace_block_size: usize,
    /// Azure traces: shared system prompts the requests open with (synthetic: the CSV has no
    /// prefixes).
    #[arg(long, default_value_t = 16)]
    pub synthetic_prefixes: u64,
    /// Azure traces: length of each synthetic system prompt, trace blocks of
    /// `--trace-block-size` tokens.
    #[arg(long, default_value_t = 1)]
    pub synthetic_prefix_blocks: usize,
    /// OpenAI-request traces: Hugging Face `tokenizer.json` (else one token per UTF-8 byte,
    /// as the router without a tokenizer).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
}

/// What was loaded, with a line saying what in it is synthetic, if anything.
#[derive(Debug)]
pub struct Loaded {
    /// The requests, by arrival.
    pub records: Vec<TraceRecord>,
    /// The format read.
    pub format: TraceFormat,
    /// What the replay adds to the file (printed and kept in the report).
    pub note: String,
}

/// Reads the trace `args` name, in any supported format; `seed` draws the synthetic
/// prefixes.
pub fn load_any(args: &TraceArgs, seed: u64) -> anyhow::Result<Loaded> {
    let path = locate(&args.trace);
    let format = match args.trace_format {
        TraceFormat::Auto => sniff(&path)?,
        f => f,
    };
    let (records, note) = match format {
        TraceFormat::Mooncake | TraceFormat::Auto => (
            load(&path, args.requests, args.trace_block_size)?,
            String::new(),
        ),
        TraceFormat::Azure => {
            let records = azure(&path, args, seed)?;
            let note = format!(
                "Azure trace: arrivals and lengths from the file; prefixes synthetic: each \
                 request opens with one of {} shared system prompts of {} tokens (seed {}), \
                 the rest of its prompt unique",
                args.synthetic_prefixes,
                args.synthetic_prefix_blocks * args.trace_block_size,
                seed
            );
            (records, note)
        }
        TraceFormat::Openai => {
            let tokenizer = match &args.tokenizer {
                Some(p) => Tokenizer::load(p)
                    .with_context(|| format!("loading tokenizer {}", p.display()))?,
                None => Tokenizer::Bytes,
            };
            let records = openai(&path, args.requests, &tokenizer)?;
            let note = match &args.tokenizer {
                Some(p) => format!("OpenAI requests tokenized with {}", p.display()),
                None => {
                    "OpenAI requests tokenized one token per UTF-8 byte (no --tokenizer)".into()
                }
            };
            (records, note)
        }
    };
    Ok(Loaded {
        records,
        format,
        note,
    })
}

fn sniff(path: &Path) -> anyhow::Result<TraceFormat> {
    if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("csv"))
    {
        return Ok(TraceFormat::Azure);
    }
    let file =
        std::fs::File::open(path).with_context(|| format!("opening trace {}", path.display()))?;
    for line in std::io::BufReader::new(file).lines() {
        let line = line.with_context(|| format!("reading {}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value = serde_json::from_str(&line)
            .with_context(|| format!("{}: the first line is not JSON", path.display()))?;
        return Ok(if value.get("hash_ids").is_some() {
            TraceFormat::Mooncake
        } else {
            TraceFormat::Openai
        });
    }
    bail!("{}: empty trace", path.display())
}

/// Milliseconds since 1970 of an Azure timestamp, `YYYY-MM-DD HH:MM:SS.fffffff` (UTC).
fn azure_ms(text: &str) -> Option<u64> {
    let (date, time) = text.trim().split_once(' ')?;
    let mut d = date.split('-').map(str::parse::<i64>);
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let mut t = time.split(':');
    let (h, min) = (
        t.next()?.parse::<u64>().ok()?,
        t.next()?.parse::<u64>().ok()?,
    );
    let seconds: f64 = t.next()?.parse().ok()?;
    if !(1..=12).contains(&m) || !(1..=31).contains(&day) || h > 23 || min > 59 {
        return None;
    }
    if !(0.0..61.0).contains(&seconds) {
        return None;
    }
    // Days from 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's
    // days_from_civil, from his "chrono-Compatible Low-Level Date Algorithms").
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = u64::try_from(era * 146_097 + doe - 719_468).ok()?;
    Some(days * 86_400_000 + h * 3_600_000 + min * 60_000 + (seconds * 1000.0).round() as u64)
}

/// Azure's CSV as Mooncake records: arrivals from the first request's time, and prompts
/// that open with one of the synthetic shared system prompts (drawn from the seed), then
/// unique blocks.
fn azure(path: &Path, args: &TraceArgs, seed: u64) -> anyhow::Result<Vec<TraceRecord>> {
    let prefixes = args.synthetic_prefixes.max(1);
    let prefix_blocks = args.synthetic_prefix_blocks;
    let bs = args.trace_block_size.max(1);
    // Ids of the system prompts' blocks come first; requests' own blocks after them.
    let mut fresh = prefixes * prefix_blocks as u64;
    let mut first_ms = None;
    read_records(path, args.requests, |at, line, records| {
        if records.is_empty() && line.starts_with("TIMESTAMP") {
            return Ok(None);
        }
        let mut fields = line.split(',');
        let (Some(ts), Some(context), Some(generated), None) =
            (fields.next(), fields.next(), fields.next(), fields.next())
        else {
            bail!("{at}: expected TIMESTAMP,ContextTokens,GeneratedTokens");
        };
        let ms = azure_ms(ts).with_context(|| format!("{at}: bad timestamp {ts:?}"))?;
        let input_length: usize = context
            .trim()
            .parse()
            .with_context(|| format!("{at}: bad ContextTokens {context:?}"))?;
        let output_length: usize = generated
            .trim()
            .parse()
            .with_context(|| format!("{at}: bad GeneratedTokens {generated:?}"))?;
        if input_length == 0 {
            bail!("{at}: a request with no context tokens");
        }
        let first = *first_ms.get_or_insert(ms);
        if ms < first || records.last().is_some_and(|r| r.timestamp > ms - first) {
            bail!("{at}: arrivals are not sorted");
        }
        let timestamp = ms - first;
        let prefix = mix(seed ^ records.len() as u64) % prefixes;
        let blocks = input_length.div_ceil(bs);
        let shared = blocks.min(prefix_blocks);
        let mut hash_ids: Vec<u64> = (0..shared as u64)
            .map(|j| prefix * prefix_blocks as u64 + j)
            .collect();
        for _ in shared..blocks {
            hash_ids.push(fresh);
            fresh += 1;
        }
        Ok(Some(TraceRecord {
            timestamp,
            input_length,
            output_length,
            hash_ids,
            tenant: None,
            priority: None,
            session_id: None,
            think_ms: None,
            tokens: None,
        }))
    })
}

/// One line of an OpenAI-requests trace: a request log's lines as they are (sampling
/// fields and the like are accepted and ignored).
#[derive(Deserialize)]
struct OpenAiLine {
    /// Arrival, ms since the trace start (default: all at once).
    #[serde(default)]
    timestamp: u64,
    #[serde(default)]
    #[allow(dead_code)]
    model: Option<String>,
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    messages: Option<Vec<ChatMessage>>,
    #[serde(default)]
    max_tokens: Option<usize>,
    /// OpenAI's newer name; wins over `max_tokens`.
    #[serde(default)]
    max_completion_tokens: Option<usize>,
    #[serde(default)]
    tenant: Option<String>,
    #[serde(default)]
    priority: Option<i32>,
    #[serde(default)]
    session_id: Option<String>,
}

fn default_max_tokens() -> usize {
    256
}

fn openai(
    path: &Path,
    limit: Option<usize>,
    tokenizer: &Tokenizer,
) -> anyhow::Result<Vec<TraceRecord>> {
    read_records(path, limit, |at, line, records| {
        let r: OpenAiLine =
            serde_json::from_str(line).with_context(|| format!("{at}: not an OpenAI request"))?;
        let tokens = match (r.prompt, r.messages) {
            // As the router tokenizes them (vLLM's defaults: BOS added to a completion's
            // prompt, a chat's written by its template).
            (Some(p), None) => tokenizer.encode(&p, true),
            (None, Some(m)) => tokenizer.encode_chat(&m, &Default::default()),
            _ => bail!("{at}: give either prompt or messages"),
        }
        .with_context(|| format!("{at}: tokenizing"))?;
        if tokens.is_empty() {
            bail!("{at}: an empty prompt");
        }
        if records.last().is_some_and(|p| p.timestamp > r.timestamp) {
            bail!("{at}: arrivals are not sorted");
        }
        Ok(Some(TraceRecord {
            timestamp: r.timestamp,
            input_length: tokens.len(),
            output_length: r
                .max_completion_tokens
                .or(r.max_tokens)
                .unwrap_or_else(default_max_tokens)
                .max(1),
            hash_ids: Vec::new(),
            tenant: r.tenant,
            priority: r.priority,
            session_id: r.session_id,
            think_ms: None,
            tokens: Some(Arc::from(tokens)),
        }))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(trace: &Path, trace_format: TraceFormat) -> TraceArgs {
        TraceArgs {
            trace: trace.to_path_buf(),
            trace_format,
            requests: None,
            trace_block_size: 512,
            synthetic_prefixes: 4,
            synthetic_prefix_blocks: 2,
            tokenizer: None,
        }
    }

    fn temp(name: &str, text: &str) -> PathBuf {
        let path = std::env::temp_dir().join(format!("kvroute-{}-{name}", std::process::id()));
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn azure_timestamps_are_milliseconds_since_the_epoch() {
        // 2023-11-16 is day 19,677 since 1970-01-01.
        assert_eq!(
            azure_ms("2023-11-16 18:15:46.6805900"),
            Some(19_677 * 86_400_000 + 18 * 3_600_000 + 15 * 60_000 + 46_681)
        );
        assert_eq!(azure_ms("1970-01-01 00:00:00.0"), Some(0));
        assert_eq!(azure_ms("2024-02-29 00:00:00.0"), Some(19_782 * 86_400_000));
        for bad in [
            "2023-13-01 00:00:00.0",
            "2023-11-16",
            "x y",
            "2023-11-16 25:00:00.0",
        ] {
            assert_eq!(azure_ms(bad), None, "{bad}");
        }
    }

    /// The shipped Azure CSV loads whole, in order, with its lengths, and prompts that share
    /// only a synthetic system prompt.
    #[test]
    fn the_azure_csv_loads_with_synthetic_prefixes() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("traces/AzureLLMInferenceTrace_conv.csv");
        let loaded = load_any(&source(&path, TraceFormat::Auto), 0).unwrap();
        assert_eq!(loaded.format, TraceFormat::Azure);
        assert!(loaded.note.contains("synthetic"));
        let r = &loaded.records;
        assert_eq!(r.len(), 19_366);
        assert_eq!(
            (r[0].timestamp, r[0].input_length, r[0].output_length),
            (0, 374, 44)
        );
        assert!(r.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
        // 18:15:46.6805900 .. 19:14:08.4025270, each rounded to the millisecond.
        assert_eq!(r.last().unwrap().timestamp, 3_501_722);
        for rec in r {
            assert_eq!(rec.hash_ids.len(), rec.input_length.div_ceil(512));
            assert!(rec.hash_ids[0] < 8, "opens with a system prompt block");
        }
        let prefixes: std::collections::BTreeSet<u64> = r.iter().map(|x| x.hash_ids[0]).collect();
        assert_eq!(prefixes, [0, 2, 4, 6].into());
        // Past the system prompt, no two requests share a block.
        let mut own = std::collections::HashSet::new();
        assert!(
            r.iter()
                .flat_map(|x| x.hash_ids.iter().skip(2))
                .all(|id| own.insert(*id))
        );
    }

    #[test]
    fn openai_requests_are_tokenized_in_order() {
        let path = temp(
            "openai.jsonl",
            "{\"timestamp\": 0, \"prompt\": \"hello\", \"max_tokens\": 3}\n\
             {\"timestamp\": 5, \"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n\
             {\"timestamp\": 6, \"prompt\": \"x\", \"temperature\": 0.7, \"stream\": true, \"max_tokens\": 9, \"max_completion_tokens\": 4}\n",
        );
        let loaded = load_any(&source(&path, TraceFormat::Auto), 0).unwrap();
        assert_eq!(loaded.format, TraceFormat::Openai);
        let r = &loaded.records;
        assert_eq!(r[0].tokens.as_deref(), Some(&b"hello".map(u32::from)[..]));
        assert_eq!((r[0].input_length, r[0].output_length), (5, 3));
        assert_eq!((r[1].timestamp, r[1].output_length), (5, 256));
        // A request log's other fields are ignored; max_completion_tokens wins.
        assert_eq!((r[2].timestamp, r[2].output_length), (6, 4));
        assert!(r[1].input_length > 2, "the chat template wraps the message");
        assert_eq!(
            &*super::super::prompt_tokens(&r[0], 512),
            &b"hello".map(u32::from)[..]
        );
        let bad = temp("bad.jsonl", "{\"prompt\": \"a\", \"messages\": []}\n");
        let e = load_any(&source(&bad, TraceFormat::Openai), 0).unwrap_err();
        assert!(
            format!("{e:#}").contains("either prompt or messages"),
            "{e:#}"
        );
        let unsorted = temp(
            "unsorted.jsonl",
            "{\"timestamp\": 9, \"prompt\": \"a\"}\n{\"timestamp\": 1, \"prompt\": \"b\"}\n",
        );
        let e = load_any(&source(&unsorted, TraceFormat::Openai), 0).unwrap_err();
        assert!(format!("{e:#}").contains("not sorted"), "{e:#}");
        for p in [path, bad, unsorted] {
            std::fs::remove_file(p).ok();
        }
    }
}
