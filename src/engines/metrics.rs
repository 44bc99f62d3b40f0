//! An engine's load as its Prometheus `/metrics` text shows it: running and waiting requests
//! and the share of its KV cache in use (vLLM `vllm:num_requests_running`,
//! `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, and its G1 size in
//! `vllm:cache_config_info{num_gpu_blocks=…}`; SGLang `sglang:num_running_reqs`,
//! `sglang:num_queue_reqs`, `sglang:token_usage`). No I/O.

use serde::{Deserialize, Serialize};

/// What a sidecar reports of its engine's load in the registration heartbeat.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineLoad {
    /// Requests running (summed over the engine's label sets: DP ranks, engines).
    pub running: u32,
    /// Requests waiting in the engine's queue.
    pub waiting: u32,
    /// Share of the KV cache in use, per mille (the mean over label sets).
    pub kv_usage_permille: u16,
}

/// Most requests a count may claim.
const MAX_REQUESTS: u32 = 10_000_000;

impl EngineLoad {
    /// Whether every figure is in range (a registration is refused otherwise).
    pub fn is_valid(&self) -> bool {
        self.running <= MAX_REQUESTS
            && self.waiting <= MAX_REQUESTS
            && self.kv_usage_permille <= 1000
    }

    /// Share of the KV cache in use, 0–1.
    pub fn kv_usage(&self) -> f64 {
        f64::from(self.kv_usage_permille) / 1000.0
    }
}

/// The rare faults of an engine's event stream, summed over its ranks: what an operator must
/// see in `/admin/workers` (the sidecar carries them in its heartbeat).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventFaults {
    /// The block size the engine's events use where it is not the configured one: nothing
    /// of those events is indexed.
    pub wrong_block_size: Option<u32>,
    /// Blocks not indexed for their block size.
    pub block_size_mismatch: u64,
    /// Payloads that did not decode.
    pub decode_errors: u64,
    /// Gaps the replay socket could not fill (the engine's blocks were dropped and rebuilt).
    pub unrepaired_gaps: u64,
    /// Engine restarts seen.
    pub restarts: u64,
    /// Blocks of LoRA adapters the engine named by number only (vLLM before `lora_name`):
    /// not indexed, since the router salts an adapter's blocks by its name.
    #[serde(default)]
    pub unnamed_lora_blocks: u64,
    /// Events of a kind kvroute does not know (skipped; the rest of their batch applies).
    #[serde(default)]
    pub unknown_events: u64,
    /// Events that did not decode (the rest of their batch applies; an undecodable removal
    /// drops the engine's blocks until they are stored again).
    #[serde(default)]
    pub malformed_events: u64,
    /// Blocks not indexed because the mirror of a rank was full (its `max_blocks`).
    #[serde(default)]
    pub capped_blocks: u64,
}

/// What one scrape found.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Scraped {
    /// The load, if the text has any of its metrics.
    pub load: Option<EngineLoad>,
    /// G1 blocks (vLLM's `num_gpu_blocks`).
    pub g1_blocks: Option<usize>,
    /// The KV pool's size in tokens, a rank's (SGLang's `sglang:max_total_num_tokens`, the
    /// largest of its ranks'): G1 blocks once divided by the engine's page size.
    pub kv_capacity_tokens: Option<u64>,
    /// KV usage per data-parallel rank, per mille, indexed by rank: vLLM labels each engine
    /// core's figures `engine="<rank>"`. Empty unless every usage sample names a rank below
    /// [`MAX_RANKS`] and no rank is missing below the highest.
    pub rank_kv_usage_permille: Vec<u16>,
}

/// Highest count of ranks read from an engine's labels.
pub const MAX_RANKS: usize = 1024;

/// Reads the engine's metrics from Prometheus text (unknown lines are skipped).
pub fn scrape(text: &str) -> Scraped {
    let (mut running, mut waiting) = (None::<f64>, None::<f64>);
    let (mut usage_sum, mut usage_n) = (0.0, 0u32);
    // Per rank (vLLM's `engine` label); `None` once a sample has no usable rank.
    let mut by_rank: Option<Vec<Option<f64>>> = Some(Vec::new());
    let mut g1_blocks = None;
    let mut kv_capacity_tokens: Option<u64> = None;
    // SGLang's counts by (name, dp_rank), the largest sample of each: started with
    // `--enable-metrics-for-all-schedulers`, every scheduler of a rank's tensor-parallel group
    // reports the same queue under its own `tp_rank` (its metrics collector reports from
    // `attn_tp_rank == 0` only otherwise), and added up they were that many times the load.
    // Ranks are numbers below [`MAX_RANKS`] (or no label): a body of 100,000 ranks searched
    // a list of them per line (seconds of a runtime thread per scrape).
    let mut sglang_counts: rustc_hash::FxHashMap<(&str, Option<usize>), f64> = Default::default();
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some((name, labels, value)) = sample(line) else {
            continue;
        };
        // SGLang with priority scheduling sets a queue count's total under `priority=""` and
        // each priority's share under `priority="<n>"` (`_log_gauge_queue_count` in its
        // metrics collector): the shares are already in the total.
        if label(labels, "priority").is_some_and(|p| !p.is_empty()) {
            continue;
        }
        match name {
            "vllm:num_requests_running" => *running.get_or_insert(0.0) += value,
            "vllm:num_requests_waiting" => *waiting.get_or_insert(0.0) += value,
            "sglang:num_running_reqs" | "sglang:num_queue_reqs" => {
                // By the rank's number ("0" and "00" are one rank).
                let rank = match label(labels, "dp_rank").filter(|r| !r.is_empty()) {
                    None => Some(None),
                    Some(r) => r.parse::<usize>().ok().filter(|r| *r < MAX_RANKS).map(Some),
                };
                if let Some(rank) = rank {
                    let most = sglang_counts.entry((name, rank)).or_insert(value);
                    *most = most.max(value);
                }
            }
            // (At most a registration's largest pool, in tokens of one.)
            "sglang:max_total_num_tokens"
                if value >= 1.0 && value <= crate::discovery::MAX_POOL_BLOCKS as f64 =>
            {
                let tokens = value as u64;
                kv_capacity_tokens = Some(kv_capacity_tokens.map_or(tokens, |t| t.max(tokens)));
            }
            // vLLM before 0.9.2 names it gpu_cache_usage_perc ("Deprecated in 0.9.2 -
            // Renamed as vllm:kv_cache_usage_perc", vllm/v1/metrics/loggers.py).
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" | "sglang:token_usage" => {
                usage_sum += value;
                usage_n += 1;
                // vLLM labels an engine core `engine`, SGLang a data-parallel rank `dp_rank`.
                let rank = label(labels, "engine")
                    .or_else(|| label(labels, "dp_rank"))
                    .and_then(|r| r.parse::<usize>().ok())
                    .filter(|r| *r < MAX_RANKS);
                by_rank = match (by_rank, rank) {
                    (Some(mut ranks), Some(r)) if (0.0..=1.0).contains(&value) => {
                        if ranks.len() <= r {
                            ranks.resize(r + 1, None);
                        }
                        ranks[r] = Some(value);
                        Some(ranks)
                    }
                    _ => None,
                };
            }
            "vllm:cache_config_info" => {
                g1_blocks = label(labels, "num_gpu_blocks").and_then(|v| v.parse().ok());
            }
            _ => {}
        }
    }
    for ((name, _), value) in sglang_counts {
        let count = if name == "sglang:num_running_reqs" {
            &mut running
        } else {
            &mut waiting
        };
        *count.get_or_insert(0.0) += value;
    }
    let any = running.is_some() || waiting.is_some() || usage_n > 0;
    let count = |x: Option<f64>| -> Option<u32> {
        let x = x.unwrap_or(0.0);
        (0.0..=f64::from(MAX_REQUESTS))
            .contains(&x)
            .then(|| x.round() as u32)
    };
    let usage = if usage_n > 0 {
        usage_sum / f64::from(usage_n)
    } else {
        0.0
    };
    let load = match (count(running), count(waiting), (0.0..=1.0).contains(&usage)) {
        (Some(running), Some(waiting), true) => Some(EngineLoad {
            running,
            waiting,
            kv_usage_permille: (usage * 1000.0).round() as u16,
        }),
        _ => None,
    };
    let rank_kv_usage_permille = by_rank
        .and_then(|ranks| {
            ranks
                .into_iter()
                .map(|u| u.map(|u| (u * 1000.0).round() as u16))
                .collect::<Option<Vec<u16>>>()
        })
        .unwrap_or_default();
    Scraped {
        load: load.filter(|_| any),
        g1_blocks: g1_blocks.filter(|n| (1..=crate::discovery::MAX_POOL_BLOCKS).contains(n)),
        kv_capacity_tokens,
        rank_kv_usage_permille,
    }
}

/// `name{labels} value` (labels may be absent); `None` for a malformed or non-finite sample.
/// A label value may hold `}`, `,` and escaped quotes (the exposition format's `\"`).
fn sample(line: &str) -> Option<(&str, &str, f64)> {
    let (head, value) = match line.find('{') {
        Some(start) => {
            let end = start + 1 + labels_end(&line[start + 1..])?;
            (&line[..=end], line[end + 1..].trim())
        }
        None => line.split_once(' ')?,
    };
    let (name, labels) = match head.find('{') {
        Some(start) => (&head[..start], head.get(start + 1..)?.strip_suffix('}')?),
        None => (head.trim(), ""),
    };
    // A timestamp may follow the value.
    let value: f64 = value.split_whitespace().next()?.parse().ok()?;
    value.is_finite().then_some((name, labels, value))
}

/// Where the label set that `labels` starts (after its `{`) ends: its `}` outside quotes.
fn labels_end(labels: &str) -> Option<usize> {
    let (mut quoted, mut escaped) = (false, false);
    for (i, c) in labels.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '}' if !quoted => return Some(i),
            _ => {}
        }
    }
    None
}

/// The value of label `key` (as written, escapes kept), matched by its whole name: `engine`
/// is not `xengine`, nor a value that reads `engine="`.
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let mut rest = labels;
    loop {
        let (name, after) = rest.split_once('=')?;
        let after = after.strip_prefix('"')?;
        let (mut end, mut escaped) = (None, false);
        for (i, c) in after.char_indices() {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => {
                    end = Some(i);
                    break;
                }
                _ => {}
            }
        }
        let end = end?;
        if name.trim() == key {
            return Some(&after[..end]);
        }
        rest = after[end + 1..].trim_start().strip_prefix(',')?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Labels are read by their whole names, and values may hold `}`, `,` and escaped
    /// quotes; substring matching read `xengine` as `engine`, and a `}` in a value cut the
    /// sample short.
    #[test]
    fn labels_are_read_whole() {
        let line =
            r#"vllm:num_requests_running{model_name="a}b,engine=\"9\"",xengine="7",engine="0"} 3"#;
        let (name, labels, value) = sample(line).unwrap();
        assert_eq!((name, value), ("vllm:num_requests_running", 3.0));
        assert_eq!(label(labels, "engine"), Some("0"));
        assert_eq!(label(labels, "xengine"), Some("7"));
        assert_eq!(label(labels, "model_name"), Some(r#"a}b,engine=\"9\""#));
        assert_eq!(label(labels, "missing"), None);
        assert_eq!(label("", "engine"), None);
        assert!(sample(r#"m{a="unterminated} 3"#).is_none());
    }

    /// SGLang counts of ranks past [`MAX_RANKS`] are not read (100,000 of them made a
    /// scrape search a list of every rank seen per line).
    #[test]
    fn sglang_ranks_past_the_limit_are_not_read() {
        let text: String = (0..MAX_RANKS + 500)
            .map(|r| format!("sglang:num_running_reqs{{dp_rank=\"{r}\"}} 1\n"))
            .collect();
        let load = scrape(&text).load.unwrap();
        assert_eq!(load.running as usize, MAX_RANKS);
    }

    #[test]
    fn reads_vllm_and_sglang_load() {
        let vllm = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 3.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-8B"} 2.0
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-8B"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-8B"} 0.75
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="27000",num_cpu_blocks="None"} 1.0
vllm:prompt_tokens_total{model_name="Qwen/Qwen3-8B"} 123456.0
"#;
        let s = scrape(vllm);
        assert_eq!(
            s.load,
            Some(EngineLoad {
                running: 5,
                waiting: 1,
                kv_usage_permille: 500
            })
        );
        assert_eq!(s.g1_blocks, Some(27000));
        // Each engine core's (data-parallel rank's) usage, by its `engine` label.
        assert_eq!(s.rank_kv_usage_permille, vec![250, 750]);
        let sglang = "sglang:num_running_reqs{model_name=\"m\"} 7\nsglang:num_queue_reqs{model_name=\"m\"} 4 1700000000000\nsglang:token_usage{model_name=\"m\"} 0.9\n";
        let s = scrape(sglang);
        assert_eq!(
            s.load,
            Some(EngineLoad {
                running: 7,
                waiting: 4,
                kv_usage_permille: 900
            })
        );
        assert_eq!(s.g1_blocks, None);
        assert!(s.rank_kv_usage_permille.is_empty(), "no rank label");
        // SGLang with priority scheduling: the totals under priority="", each priority's
        // share besides (not added again); data-parallel ranks labelled dp_rank.
        let priorities = concat!(
            "sglang:num_running_reqs{dp_rank=\"0\",priority=\"\"} 6\n",
            "sglang:num_running_reqs{dp_rank=\"0\",priority=\"0\"} 2\n",
            "sglang:num_running_reqs{dp_rank=\"0\",priority=\"5\"} 4\n",
            "sglang:num_running_reqs{dp_rank=\"1\",priority=\"\"} 1\n",
            "sglang:num_queue_reqs{dp_rank=\"0\",priority=\"\"} 3\n",
            "sglang:num_queue_reqs{dp_rank=\"0\",priority=\"5\"} 3\n",
            "sglang:token_usage{dp_rank=\"0\"} 0.2\n",
            "sglang:token_usage{dp_rank=\"1\"} 0.6\n",
        );
        let s = scrape(priorities);
        assert_eq!(
            s.load,
            Some(EngineLoad {
                running: 7,
                waiting: 3,
                kv_usage_permille: 400
            })
        );
        assert_eq!(s.rank_kv_usage_permille, vec![200, 600]);
        // SGLang with --enable-metrics-for-all-schedulers: each tensor-parallel rank of a
        // data-parallel rank reports the same queue, counted once; its pool's size read.
        let all_schedulers = concat!(
            "sglang:num_running_reqs{dp_rank=\"0\",tp_rank=\"0\"} 5\n",
            "sglang:num_running_reqs{dp_rank=\"0\",tp_rank=\"1\"} 5\n",
            "sglang:num_running_reqs{dp_rank=\"1\",tp_rank=\"2\"} 3\n",
            "sglang:num_running_reqs{dp_rank=\"1\",tp_rank=\"3\"} 3\n",
            "sglang:num_queue_reqs{dp_rank=\"0\",tp_rank=\"0\"} 2\n",
            "sglang:num_queue_reqs{dp_rank=\"0\",tp_rank=\"1\"} 2\n",
            "sglang:token_usage{dp_rank=\"0\",tp_rank=\"0\"} 0.5\n",
            "sglang:max_total_num_tokens{dp_rank=\"0\",tp_rank=\"0\"} 500000\n",
            "sglang:max_total_num_tokens{dp_rank=\"1\",tp_rank=\"2\"} 500000\n",
        );
        let s = scrape(all_schedulers);
        assert_eq!(s.load.map(|l| (l.running, l.waiting)), Some((8, 2)));
        assert_eq!(s.kv_capacity_tokens, Some(500_000));
        // A rank missing below the highest, or a rank past the cap: no per-rank figures.
        for gap in [
            "vllm:kv_cache_usage_perc{engine=\"0\"} 0.1\nvllm:kv_cache_usage_perc{engine=\"2\"} 0.3\n",
            "vllm:kv_cache_usage_perc{engine=\"5000\"} 0.1\n",
        ] {
            assert!(scrape(gap).rank_kv_usage_permille.is_empty(), "{gap}");
        }
        // vLLM before 0.9.2 names the usage gpu_cache_usage_perc.
        let old = "vllm:num_requests_running 1\nvllm:gpu_cache_usage_perc 0.6\n";
        assert_eq!(scrape(old).load.map(|l| l.kv_usage_permille), Some(600));
    }

    #[test]
    fn garbage_and_other_servers_give_nothing() {
        assert_eq!(scrape("").load, None);
        assert_eq!(scrape("kvroute_requests_total 5\n").load, None);
        let bad = "vllm:num_requests_running NaN\nvllm:kv_cache_usage_perc{ 0.5\nvllm:num_requests_waiting{a=\"b\"} -3\n";
        assert_eq!(scrape(bad).load, None, "a negative count is refused");
    }
}
