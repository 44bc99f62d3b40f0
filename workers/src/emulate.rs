//! The test engine (`kvroute-worker --emulate vllm|sglang`): the simulated engine speaking a
//! real engine's wire formats instead of kvroute's, so that the sidecar and the router's
//! direct mode can be tested end to end without a GPU. Its KV events leave on a ZMQ PUB (and
//! a replay ROUTER) in vLLM's or SGLang's msgpack shape, named by the engine's own hashes
//! (not kvroute's: the consumer must recompute them from the token ids); its G2 stores come
//! as vLLM's CPU tier reports them (no tokens, block size 0) or as SGLang's (`CPU_PINNED`,
//! with tokens and a parent); its OpenAI answers carry `usage.prompt_tokens_details`; its
//! `/metrics` adds the flavour's load series (running and waiting requests, KV usage, and
//! vLLM's `cache_config_info`), which a sidecar reads.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use kvroute::engines::publisher::{EnginePublisher, ReplayForm};
use kvroute::engines::wire::{Encoding, RawEvent, encode_batch};
use kvroute::protocol::{EventBatch, KvEventData, Salt, SeqHash, Tier, hash_blocks};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use tokio::sync::{mpsc, watch};

/// Which engine to look like.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Flavor {
    /// vLLM ≥ 0.26: tagged-map events, unsigned int hashes, `CPU` stores without tokens,
    /// replay replies with the topic.
    Vllm,
    /// vLLM before 0.26: positional events, otherwise as [`Flavor::Vllm`], replay without
    /// the topic.
    VllmLegacy,
    /// SGLang: positional events, signed int hashes, `CPU_PINNED` stores with tokens,
    /// replay replies without the topic.
    Sglang,
}

impl Flavor {
    fn encoding(self, bytes_hashes: bool) -> Encoding {
        Encoding {
            tagged_maps: self == Flavor::Vllm,
            bytes_hashes,
            signed_hashes: self == Flavor::Sglang,
        }
    }

    /// How its replay socket answers.
    pub fn replay_form(self) -> ReplayForm {
        match self {
            Flavor::Vllm => ReplayForm::WithTopic,
            Flavor::VllmLegacy | Flavor::Sglang => ReplayForm::NoTopic,
        }
    }

    fn host_medium(self) -> &'static str {
        match self {
            Flavor::Sglang => "CPU_PINNED",
            _ => "CPU",
        }
    }
}

/// Blocks' tokens, learnt from the requests the engine was given (events carry tokens; the
/// block manager knows blocks only by hash). Bounded: past `capacity` blocks the oldest
/// learnt are forgotten (a block still cached by then is described without tokens, and the
/// consumer counts it unresolved). Kept after a block leaves the cache, since an offload
/// tier may report its copy later.
#[derive(Debug)]
pub struct TokenBook {
    block_size: NonZeroUsize,
    capacity: usize,
    blocks: Mutex<Learnt>,
}

/// One learnt block: its tokens, and the LoRA adapter and cache salt it was computed with.
#[derive(Clone, Debug)]
struct Learnt1 {
    tokens: Arc<[u32]>,
    lora: Option<Arc<str>>,
    cache_salt: Option<Arc<str>>,
}

/// Blocks by hash with the number of their last learning, and the hashes in the order they
/// were learnt (each with that number: an entry whose block was learnt again since is
/// stale, and skipped).
type Learnt = (
    FxHashMap<SeqHash, (Learnt1, u64)>,
    VecDeque<(SeqHash, u64)>,
    u64,
);

impl TokenBook {
    /// A book for blocks of `block_size` tokens, holding at most `capacity` blocks.
    pub fn new(block_size: NonZeroUsize, capacity: usize) -> Self {
        TokenBook {
            block_size,
            capacity: capacity.max(1),
            blocks: Mutex::default(),
        }
    }

    /// Learns the full blocks of a sequence, hashed as the engine hashes it (`salt`: that
    /// of a LoRA adapter named `lora` and of a request's `cache_salt`). The least recently
    /// learnt go first past the capacity: a block learnt long ago and used since (a shared
    /// system prompt) stays.
    pub fn learn(
        &self,
        sequence: &[u32],
        salt: Salt,
        lora: Option<&str>,
        cache_salt: Option<&str>,
    ) {
        let hashes = hash_blocks(sequence, self.block_size, salt);
        let lora: Option<Arc<str>> = lora.map(Arc::from);
        let cache_salt: Option<Arc<str>> = cache_salt.map(Arc::from);
        let mut guard = self.blocks.lock();
        let (blocks, order, learnt) = &mut *guard;
        for (h, tokens) in hashes
            .iter()
            .zip(sequence.chunks_exact(self.block_size.get()))
        {
            *learnt += 1;
            let block = Learnt1 {
                tokens: tokens.into(),
                lora: lora.clone(),
                cache_salt: cache_salt.clone(),
            };
            blocks.insert(h.seq, (block, *learnt));
            order.push_back((h.seq, *learnt));
        }
        while blocks.len() > self.capacity {
            let Some((old, at)) = order.pop_front() else {
                break;
            };
            if blocks.get(&old).is_some_and(|(_, last)| *last == at) {
                blocks.remove(&old);
            }
        }
        // Entries of blocks learnt again since: kept within twice the blocks.
        if order.len() > 2 * blocks.len() + 64 {
            order.retain(|(seq, at)| blocks.get(seq).is_some_and(|(_, last)| last == at));
        }
    }

    fn block(&self, seq: SeqHash) -> Option<Learnt1> {
        self.blocks.lock().0.get(&seq).map(|(b, _)| b.clone())
    }

    /// Blocks known.
    pub fn len(&self) -> usize {
        self.blocks.lock().0.len()
    }

    /// Whether no block is known.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The engine's own name for a block: not kvroute's hash (a consumer that used it as one
/// would match nothing), spread over all 64 bits so that values above `i64::MAX` occur.
pub fn engine_name(seq: SeqHash) -> u64 {
    seq.0.rotate_left(29) ^ 0x9e37_79b9_7f4a_7c15
}

/// A running emulation: where its events go and what it knows of its blocks.
#[derive(Debug)]
pub struct Emulation {
    /// The engine flavour.
    pub flavor: Flavor,
    /// Bytes hashes (vLLM with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`) instead of ints.
    pub bytes_hashes: bool,
    /// Blocks' tokens.
    pub book: TokenBook,
    /// Tokens per block.
    pub block_size: NonZeroUsize,
    /// Tokens its G1 holds: a longer request (prompt and output) is refused, never cached.
    pub capacity_tokens: usize,
    /// The engine's vocabulary (its decode tokens are drawn from it).
    pub vocab: u32,
    /// LoRA adapters it serves on top of its model (requests name them as their model).
    pub adapters: Vec<String>,
    /// Its data-parallel ranks, each an engine of its own behind the one HTTP endpoint.
    pub ranks: Vec<EmulatedRank>,
}

/// One data-parallel rank of the test engine.
#[derive(Debug)]
pub struct EmulatedRank {
    /// Its event sockets (vLLM offsets the ports by the rank).
    pub publisher: EnginePublisher,
    /// Its load as its engine thread last left it.
    pub load: LoadCell,
}

/// An engine's load as its `/metrics` reports it, set by the engine thread at each wake-up
/// and read by the HTTP server (each figure on its own: a scrape may mix two wake-ups, as a
/// real engine's may).
#[derive(Debug, Default)]
pub struct LoadCell {
    running: AtomicUsize,
    waiting: AtomicUsize,
    /// G1 blocks requests hold or fill (cached blocks nobody uses are free, as vLLM counts
    /// them).
    g1_in_use: AtomicUsize,
    g1_capacity: AtomicUsize,
}

impl LoadCell {
    /// Sets every figure from the engine's.
    pub fn set(&self, load: &crate::engine::EngineLoad) {
        self.running.store(load.running, Ordering::Relaxed);
        self.waiting.store(load.waiting, Ordering::Relaxed);
        self.g1_in_use.store(load.g1_in_use, Ordering::Relaxed);
        self.g1_capacity.store(load.g1_capacity, Ordering::Relaxed);
    }

    /// vLLM's load-balancing score of a rank: `waiting * 4 + running`.
    pub fn score(&self) -> usize {
        let get = |a: &AtomicUsize| a.load(Ordering::Relaxed);
        get(&self.waiting)
            .saturating_mul(4)
            .saturating_add(get(&self.running))
    }

    /// The load samples of rank `rank` of a `flavor` engine serving `model` (`block_size`),
    /// each with its family: vLLM's `vllm:num_requests_running`,
    /// `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (labelled `engine` and
    /// `model_name`) and `vllm:cache_config_info` (its G1 size in `num_gpu_blocks`);
    /// SGLang's `sglang:num_running_reqs`, `sglang:num_queue_reqs` and `sglang:token_usage`.
    fn samples(
        &self,
        flavor: Flavor,
        block_size: NonZeroUsize,
        model: &str,
        rank: usize,
    ) -> Vec<(&'static str, String)> {
        let get = |a: &AtomicUsize| a.load(Ordering::Relaxed);
        let l = self;
        let (running, waiting) = (get(&l.running), get(&l.waiting));
        let capacity = get(&l.g1_capacity);
        let usage = get(&l.g1_in_use) as f64 / capacity.max(1) as f64;
        // Prometheus label values escape `\`, `"` and newlines.
        let model = model
            .replace('\\', "\\\\")
            .replace('"', "\\\"")
            .replace('\n', "\\n");
        let (names, labels) = match flavor {
            Flavor::Sglang => (
                [
                    "sglang:num_running_reqs",
                    "sglang:num_queue_reqs",
                    "sglang:token_usage",
                ],
                // SGLang labels a data-parallel rank `dp_rank`.
                format!("dp_rank=\"{rank}\",model_name=\"{model}\",tp_rank=\"0\""),
            ),
            Flavor::Vllm | Flavor::VllmLegacy => (
                [
                    "vllm:num_requests_running",
                    "vllm:num_requests_waiting",
                    "vllm:kv_cache_usage_perc",
                ],
                // vLLM labels each engine core (data-parallel rank) `engine`.
                format!("engine=\"{rank}\",model_name=\"{model}\""),
            ),
        };
        let mut out: Vec<(&'static str, String)> = names
            .into_iter()
            .zip([running as f64, waiting as f64, usage])
            .map(|(name, value)| (name, format!("{name}{{{labels}}} {value:?}")))
            .collect();
        if flavor != Flavor::Sglang {
            out.push((
                "vllm:cache_config_info",
                format!(
                    "vllm:cache_config_info{{block_size=\"{block_size}\",engine=\"{rank}\",num_gpu_blocks=\"{capacity}\"}} 1.0"
                ),
            ));
        }
        out
    }
}

/// The exposition of `ranks`' load series (rank `i` is `ranks[i]`; [`LoadCell::samples`]):
/// each family once, its `# TYPE` line then every rank's sample, as the text format wants
/// (a strict parser, Prometheus' own `expfmt`, refuses a family given twice).
pub fn render(
    flavor: Flavor,
    block_size: NonZeroUsize,
    model: &str,
    ranks: &[&LoadCell],
) -> String {
    let per_rank: Vec<Vec<(&'static str, String)>> = ranks
        .iter()
        .enumerate()
        .map(|(rank, cell)| cell.samples(flavor, block_size, model, rank))
        .collect();
    let mut out = String::new();
    let families = per_rank.first().map_or(0, Vec::len);
    for family in 0..families {
        let name = per_rank[0][family].0;
        let _ = writeln!(out, "# TYPE {name} gauge");
        for samples in &per_rank {
            let _ = writeln!(out, "{}", samples[family].1);
        }
    }
    out
}

impl Emulation {
    /// The flavour's load series of every rank for its `/metrics` ([`LoadCell::render`]).
    pub fn metrics(&self, model: &str) -> String {
        let cells: Vec<&LoadCell> = self.ranks.iter().map(|rank| &rank.load).collect();
        render(self.flavor, self.block_size, model, &cells)
    }

    /// Turns one kvroute batch of the engine into the flavour's payload.
    fn encode(&self, batch: &EventBatch) -> Vec<u8> {
        let rank = batch.dp_rank.0;
        let mut out = Vec::new();
        for e in &batch.events {
            let medium = match e.tier {
                Tier::Device => "GPU",
                Tier::Host => self.flavor.host_medium(),
                _ => "STORAGE",
            };
            match &e.data {
                KvEventData::Stored { parent, blocks } => {
                    let tokenless = e.tier != Tier::Device && self.flavor != Flavor::Sglang;
                    let learnt: Vec<Option<Learnt1>> =
                        blocks.iter().map(|b| self.book.block(b.seq)).collect();
                    // A block whose tokens were never learnt cannot be described (a
                    // token-less store needs none): the chain is cut around it, and the
                    // runs of blocks that can be go out each as an event, naming the block
                    // before them as their parent.
                    let described = |i: usize| tokenless || learnt[i].is_some();
                    let mut parent = *parent;
                    let mut start = 0;
                    while start < blocks.len() {
                        if !described(start) {
                            parent = Some(blocks[start].seq);
                            start += 1;
                            continue;
                        }
                        let end = (start..blocks.len())
                            .find(|&i| !described(i))
                            .unwrap_or(blocks.len());
                        let run = &learnt[start..end];
                        let token_ids: Vec<u32> = match tokenless {
                            true => Vec::new(),
                            false => run
                                .iter()
                                .flatten()
                                .flat_map(|b| b.tokens.iter().copied())
                                .collect(),
                        };
                        let first = run.iter().flatten().next();
                        let lora_name = first.and_then(|b| b.lora.as_deref()).map(str::to_owned);
                        // A salted request's cache salt, as each engine sends it: vLLM among
                        // the extra keys of a chain's first block (with the adapter's name,
                        // which it puts on every block); SGLang tagged, as the first key of
                        // each of the request's events.
                        let salt = first.and_then(|b| b.cache_salt.as_deref());
                        let extra_keys = match (self.flavor, salt) {
                            (_, None) => Vec::new(),
                            (Flavor::Sglang, Some(salt)) => {
                                vec![vec![format!(
                                    "{}{salt}",
                                    kvroute::engines::mirror::TAGGED_SALT
                                )]]
                            }
                            (_, Some(salt)) if parent.is_none() => {
                                vec![lora_name.iter().cloned().chain([salt.to_owned()]).collect()]
                            }
                            _ => Vec::new(),
                        };
                        out.push(RawEvent::Stored {
                            hashes: blocks[start..end]
                                .iter()
                                .map(|b| engine_name(b.seq))
                                .collect(),
                            parent: parent.map(engine_name),
                            block_size: if token_ids.is_empty() {
                                0
                            } else {
                                self.block_size.get() as u32
                            },
                            token_ids,
                            medium: medium.into(),
                            lora_name,
                            extra_keys,
                        });
                        parent = Some(blocks[end - 1].seq);
                        start = end;
                    }
                }
                KvEventData::Removed { blocks } => {
                    out.push(RawEvent::Removed {
                        hashes: blocks.iter().map(|s| engine_name(*s)).collect(),
                        medium: medium.into(),
                    });
                }
                KvEventData::Cleared => out.push(RawEvent::Cleared),
            }
        }
        let ts = batch.sent_unix_us as f64 / 1e6;
        encode_batch(ts, &out, rank, self.flavor.encoding(self.bytes_hashes))
    }

    /// Publishes the engine's batches on the event sockets until `shutdown`.
    pub async fn publish(
        self: Arc<Self>,
        mut events: mpsc::Receiver<EventBatch>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        loop {
            let mut batch = tokio::select! {
                b = events.recv() => match b {
                    Some(b) => b,
                    None => return,
                },
                _ = shutdown.changed() => return,
            };
            batch.sent_unix_us = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_micros() as u64);
            let payload = self.encode(&batch);
            if let Some(rank) = self.ranks.get(batch.dp_rank.0 as usize) {
                rank.publisher.publish(Bytes::from(payload));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use kvroute::engines::metrics::{EngineLoad, scrape};

    use super::*;

    /// A `flavor` emulation of blocks of `bs` tokens, its book holding 16, no ranks.
    fn emulation(flavor: Flavor, bs: NonZeroUsize) -> Emulation {
        Emulation {
            flavor,
            bytes_hashes: false,
            book: TokenBook::new(bs, 16),
            block_size: bs,
            capacity_tokens: 16,
            vocab: 100,
            adapters: Vec::new(),
            ranks: Vec::new(),
        }
    }

    /// A stored chain with a block whose tokens the book does not know goes out as the runs
    /// around it (the known blocks were dropped with it), and a token-less host store needs
    /// no tokens at all.
    #[test]
    fn a_chain_with_an_unknown_block_is_cut_around_it() {
        use kvroute::engines::wire::{EngineEvent, decode_batch};
        use kvroute::protocol::{DpRank, EventBatch, KvEvent, StoredBlock, WorkerId};
        let bs = NonZeroUsize::new(1).unwrap();
        let emulation = emulation(Flavor::Vllm, bs);
        // Blocks 1, 2, 3 chained; the book knows the tokens of 1 and 3 only.
        let chain = hash_blocks(&[1, 2, 3], bs, Salt::NONE);
        emulation.book.learn(&[1, 2, 3], Salt::NONE, None, None);
        emulation.book.blocks.lock().0.remove(&chain[1].seq);
        let stored = |tier| EventBatch {
            worker: WorkerId(1),
            dp_rank: DpRank(0),
            epoch: 1,
            sent_unix_us: 0,
            events: vec![KvEvent {
                id: 1,
                tier,
                data: KvEventData::Stored {
                    parent: None,
                    blocks: chain
                        .iter()
                        .map(|b| StoredBlock {
                            seq: b.seq,
                            local: b.local,
                        })
                        .collect(),
                },
            }],
        };
        let runs = |tier| -> Vec<(usize, Option<u64>)> {
            decode_batch(&emulation.encode(&stored(tier)))
                .unwrap()
                .events
                .into_iter()
                .map(|e| match e {
                    EngineEvent::Stored(s) => (s.hashes.len(), s.parent.map(|p| p.0)),
                    other => panic!("{other:?}"),
                })
                .collect()
        };
        let name = |i: usize| engine_name(chain[i].seq);
        assert_eq!(runs(Tier::Device), vec![(1, None), (1, Some(name(1)))]);
        assert_eq!(runs(Tier::Host), vec![(3, None)]);
    }

    /// A salted request's blocks go out with its cache salt where each engine puts it (vLLM:
    /// the chain's first block's extra keys; SGLang: tagged, on every event), so that an
    /// engine mirror names them as the engine hashed them: without it, a salted prompt was
    /// indexed under the unsalted chain, and an unsalted request credited with its blocks.
    #[test]
    fn a_salted_request_s_events_carry_its_cache_salt() {
        use kvroute::engines::EngineMirror;
        use kvroute::engines::wire::decode_batch;
        use kvroute::protocol::{BlockChange, DpRank, EventBatch, KvEvent, StoredBlock, WorkerId};
        let bs = NonZeroUsize::new(2).unwrap();
        let tokens: Vec<u32> = (1..=6).collect();
        for (flavor, lora) in [
            (Flavor::Vllm, None),
            (Flavor::Vllm, Some("adapter")),
            (Flavor::Sglang, None),
        ] {
            let emulation = emulation(flavor, bs);
            let salt = kvroute::engines::engine_salt(lora, Some("tenant"));
            emulation.book.learn(&tokens, salt, lora, Some("tenant"));
            let chain = hash_blocks(&tokens, bs, salt);
            // Two events: the chain's first block, then the rest under it.
            let event =
                |id, parent: Option<SeqHash>, blocks: &[kvroute::protocol::BlockHash]| KvEvent {
                    id,
                    tier: Tier::Device,
                    data: KvEventData::Stored {
                        parent,
                        blocks: blocks
                            .iter()
                            .map(|b| StoredBlock {
                                seq: b.seq,
                                local: b.local,
                            })
                            .collect(),
                    },
                };
            let batch = EventBatch {
                worker: WorkerId(1),
                dp_rank: DpRank(0),
                epoch: 1,
                sent_unix_us: 0,
                events: vec![
                    event(1, None, &chain[..1]),
                    event(2, Some(chain[0].seq), &chain[1..]),
                ],
            };
            let mut mirror = EngineMirror::new(bs);
            let mut out = Vec::new();
            mirror.apply(&decode_batch(&emulation.encode(&batch)).unwrap(), &mut out);
            let named: Vec<SeqHash> = out
                .iter()
                .filter_map(|c| match c {
                    BlockChange::Stored { block, .. } => Some(block.seq),
                    _ => None,
                })
                .collect();
            let want: Vec<SeqHash> = chain.iter().map(|b| b.seq).collect();
            assert_eq!(named, want, "{flavor:?} {lora:?}");
        }
    }

    /// The book forgets the block learnt least recently, not the one learnt first: a block
    /// learnt early and in use since stayed only until newer blocks pushed it out, and its
    /// engine's events about it were then dropped whole.
    #[test]
    fn the_book_forgets_the_least_recently_learnt_block() {
        let book = TokenBook::new(NonZeroUsize::new(1).unwrap(), 2);
        let hash = |t: u32| hash_blocks(&[t], NonZeroUsize::new(1).unwrap(), Salt::NONE)[0].seq;
        for t in [1, 2, 1, 3] {
            book.learn(&[t], Salt::NONE, None, None);
        }
        assert!(book.block(hash(1)).is_some(), "learnt again, kept");
        assert!(book.block(hash(2)).is_none());
        assert!(book.block(hash(3)).is_some());
        assert_eq!(book.len(), 2);
        // Learning the same block over and over keeps the order bounded.
        for _ in 0..1_000 {
            book.learn(&[1], Salt::NONE, None, None);
        }
        assert!(book.blocks.lock().1.len() <= 2 * 2 + 64);
    }

    /// What the test engine's `/metrics` says is what the sidecar reads: each flavour's
    /// series, parsed by the sidecar's own scraper.
    #[test]
    fn the_load_series_read_back_as_set() {
        let cell = LoadCell::default();
        let engine = |running, waiting, g1_in_use| crate::engine::EngineLoad {
            running,
            waiting,
            g1_used: g1_in_use,
            g1_in_use,
            g1_capacity: 1000,
        };
        cell.set(&engine(3, 7, 250));
        let block = NonZeroUsize::new(16).unwrap();
        for flavor in [Flavor::Vllm, Flavor::VllmLegacy, Flavor::Sglang] {
            let s = scrape(&render(flavor, block, "org/model \"x\"", &[&cell]));
            assert_eq!(
                s.load,
                Some(EngineLoad {
                    running: 3,
                    waiting: 7,
                    kv_usage_permille: 250,
                }),
                "{flavor:?}"
            );
            let g1 = (flavor != Flavor::Sglang).then_some(1000);
            assert_eq!(s.g1_blocks, g1, "{flavor:?}: only vLLM says its G1 size");
        }
        // Two data-parallel ranks: the counts add up, and the sidecar reads each rank's
        // usage by its label (vLLM's `engine`, SGLang's `dp_rank`).
        let other = LoadCell::default();
        other.set(&engine(1, 0, 750));
        for flavor in [Flavor::Vllm, Flavor::Sglang] {
            let text = render(flavor, block, "m", &[&cell, &other]);
            // Each family once, its samples together (the text format's rule).
            let mut seen = Vec::new();
            for line in text.lines() {
                let family = line.strip_prefix("# TYPE ").map_or_else(
                    || line.split('{').next().unwrap(),
                    |t| t.split(' ').next().unwrap(),
                );
                if seen.last() != Some(&family) {
                    assert!(!seen.contains(&family), "{family} given twice:\n{text}");
                    seen.push(family);
                }
            }
            let s = scrape(&text);
            assert_eq!(
                s.load,
                Some(EngineLoad {
                    running: 4,
                    waiting: 7,
                    kv_usage_permille: 500,
                }),
                "{flavor:?}"
            );
            assert_eq!(s.rank_kv_usage_permille, vec![250, 750], "{flavor:?}");
        }
    }
}
