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

use super::{TraceRecord, load, locate, mix};

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

/// What loading a trace needs besides its path.
#[derive(Clone, Debug)]
pub struct TraceOptions {
    /// The format (or `Auto`).
    pub format: TraceFormat,
    /// First N requests only.
    pub limit: Option<usize>,
    /// Tokens per hash id (Mooncake and the synthesised Azure prefixes).
    pub block_size: usize,
    /// Azure: shared system prompts the requests draw from.
    pub synthetic_prefixes: u64,
    /// Azure: trace blocks (of `block_size` tokens) of each shared system prompt.
    pub synthetic_prefix_blocks: usize,
    /// OpenAI: the Hugging Face `tokenizer.json` (else one token per UTF-8 byte).
    pub tokenizer: Option<PathBuf>,
    /// Seed of the synthesised prefixes.
    pub seed: u64,
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

/// Reads a trace in any supported format.
pub fn load_any(path: &Path, options: &TraceOptions) -> anyhow::Result<Loaded> {
    let path = locate(path);
    let format = match options.format {
        TraceFormat::Auto => sniff(&path)?,
        f => f,
    };
    let (records, note) = match format {
        TraceFormat::Mooncake | TraceFormat::Auto => (
            load(&path, options.limit, options.block_size)?,
            String::new(),
        ),
        TraceFormat::Azure => {
            let records = azure(&path, options)?;
            let note = format!(
                "Azure trace: arrivals and lengths from the file; prefixes synthetic: each \
                 request opens with one of {} shared system prompts of {} tokens (seed {}), \
                 the rest of its prompt unique",
                options.synthetic_prefixes,
                options.synthetic_prefix_blocks * options.block_size,
                options.seed
            );
            (records, note)
        }
        TraceFormat::Openai => {
            let tokenizer = match &options.tokenizer {
                Some(p) => Tokenizer::load(p)
                    .with_context(|| format!("loading tokenizer {}", p.display()))?,
                None => Tokenizer::Bytes,
            };
            let records = openai(&path, options.limit, &tokenizer)?;
            let note = match &options.tokenizer {
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
fn azure(path: &Path, options: &TraceOptions) -> anyhow::Result<Vec<TraceRecord>> {
    let file =
        std::fs::File::open(path).with_context(|| format!("opening trace {}", path.display()))?;
    let prefixes = options.synthetic_prefixes.max(1);
    let prefix_blocks = options.synthetic_prefix_blocks;
    let bs = options.block_size.max(1);
    // Ids of the system prompts' blocks come first; requests' own blocks after them.
    let mut fresh = prefixes * prefix_blocks as u64;
    let mut first_ms = None;
    let mut records = Vec::new();
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        if options.limit.is_some_and(|l| records.len() >= l) {
            break;
        }
        let line = line.with_context(|| format!("reading {}", path.display()))?;
        let where_ = || format!("{}:{}", path.display(), n + 1);
        if line.trim().is_empty() || (n == 0 && line.starts_with("TIMESTAMP")) {
            continue;
        }
        let mut fields = line.split(',');
        let (Some(ts), Some(context), Some(generated), None) =
            (fields.next(), fields.next(), fields.next(), fields.next())
        else {
            bail!(
                "{}: expected TIMESTAMP,ContextTokens,GeneratedTokens",
                where_()
            );
        };
        let at = azure_ms(ts).with_context(|| format!("{}: bad timestamp {ts:?}", where_()))?;
        let input_length: usize = context
            .trim()
            .parse()
            .with_context(|| format!("{}: bad ContextTokens {context:?}", where_()))?;
        let output_length: usize = generated
            .trim()
            .parse()
            .with_context(|| format!("{}: bad GeneratedTokens {generated:?}", where_()))?;
        if input_length == 0 {
            bail!("{}: a request with no context tokens", where_());
        }
        let first = *first_ms.get_or_insert(at);
        if at < first {
            bail!("{}: arrivals are not sorted", where_());
        }
        let prefix = mix(options.seed ^ records.len() as u64) % prefixes;
        let blocks = input_length.div_ceil(bs);
        let shared = blocks.min(prefix_blocks);
        let mut hash_ids: Vec<u64> = (0..shared as u64)
            .map(|j| prefix * prefix_blocks as u64 + j)
            .collect();
        for _ in shared..blocks {
            hash_ids.push(fresh);
            fresh += 1;
        }
        records.push(TraceRecord {
            timestamp: at - first,
            input_length,
            output_length,
            hash_ids,
            tenant: None,
            priority: None,
            session_id: None,
            think_ms: None,
            tokens: None,
        });
    }
    Ok(records)
}

/// One line of an OpenAI-requests trace.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
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
    #[serde(default = "default_max_tokens")]
    max_tokens: usize,
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
    let file =
        std::fs::File::open(path).with_context(|| format!("opening trace {}", path.display()))?;
    let mut records: Vec<TraceRecord> = Vec::new();
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        if limit.is_some_and(|l| records.len() >= l) {
            break;
        }
        let line = line.with_context(|| format!("reading {}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let where_ = || format!("{}:{}", path.display(), n + 1);
        let r: OpenAiLine = serde_json::from_str(&line)
            .with_context(|| format!("{}: not an OpenAI request", where_()))?;
        let tokens = match (r.prompt, r.messages) {
            (Some(p), None) => tokenizer.encode(&p),
            (None, Some(m)) => tokenizer.encode_chat(&m),
            _ => bail!("{}: give either prompt or messages", where_()),
        }
        .with_context(|| format!("{}: tokenizing", where_()))?;
        if tokens.is_empty() {
            bail!("{}: an empty prompt", where_());
        }
        if records.last().is_some_and(|p| p.timestamp > r.timestamp) {
            bail!("{}: arrivals are not sorted", where_());
        }
        records.push(TraceRecord {
            timestamp: r.timestamp,
            input_length: tokens.len(),
            output_length: r.max_tokens.max(1),
            hash_ids: Vec::new(),
            tenant: r.tenant,
            priority: r.priority,
            session_id: r.session_id,
            think_ms: None,
            tokens: Some(Arc::from(tokens)),
        });
    }
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(format: TraceFormat) -> TraceOptions {
        TraceOptions {
            format,
            limit: None,
            block_size: 512,
            synthetic_prefixes: 4,
            synthetic_prefix_blocks: 2,
            tokenizer: None,
            seed: 0,
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
        let loaded = load_any(&path, &options(TraceFormat::Auto)).unwrap();
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
             {\"timestamp\": 5, \"model\": \"m\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n",
        );
        let loaded = load_any(&path, &options(TraceFormat::Auto)).unwrap();
        assert_eq!(loaded.format, TraceFormat::Openai);
        let r = &loaded.records;
        assert_eq!(r[0].tokens.as_deref(), Some(&b"hello".map(u32::from)[..]));
        assert_eq!((r[0].input_length, r[0].output_length), (5, 3));
        assert_eq!((r[1].timestamp, r[1].output_length), (5, 256));
        assert!(r[1].input_length > 2, "the chat template wraps the message");
        assert_eq!(
            super::super::prompt_tokens(&r[0], 512),
            b"hello".map(u32::from).to_vec()
        );
        let bad = temp("bad.jsonl", "{\"prompt\": \"a\", \"messages\": []}\n");
        let e = load_any(&bad, &options(TraceFormat::Openai)).unwrap_err();
        assert!(
            format!("{e:#}").contains("either prompt or messages"),
            "{e:#}"
        );
        let unsorted = temp(
            "unsorted.jsonl",
            "{\"timestamp\": 9, \"prompt\": \"a\"}\n{\"timestamp\": 1, \"prompt\": \"b\"}\n",
        );
        let e = load_any(&unsorted, &options(TraceFormat::Openai)).unwrap_err();
        assert!(format!("{e:#}").contains("not sorted"), "{e:#}");
        for p in [path, bad, unsorted] {
            std::fs::remove_file(p).ok();
        }
    }
}
