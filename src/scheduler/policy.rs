//! Routing policies: ours (`kv`) and the ones users would otherwise pick, behind one trait so
//! the replay bench compares them on equal terms.

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use super::{Candidate, RouteRequest, WorkerKey, rng::Rng};
use crate::protocol::SeqHash;

/// A routing policy: picks one of the candidates (never empty; busy workers are already left
/// out unless all are busy).
pub trait Policy: Send + std::fmt::Debug {
    /// Name in configs and reports.
    fn name(&self) -> &'static str;
    /// Index into `candidates` of the worker to use.
    fn pick(
        &mut self,
        request: &RouteRequest<'_>,
        candidates: &[Candidate],
        rng: &mut Rng,
        now_ms: u64,
    ) -> usize;
    /// Whether busy workers sit out (unless every worker is busy) before this policy picks.
    /// The plain baselines (`round_robin`, `random`) see every worker, as their namesakes
    /// do: a busy filter would make them load-aware and understate what routing buys.
    fn skips_busy(&self) -> bool {
        true
    }
}

/// The policies a config or the bench can name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    /// Lowest KV-aware cost (DESIGN §8), random tie-break, optional softmax.
    #[default]
    Kv,
    /// Each worker in turn, busy or not.
    RoundRobin,
    /// Each worker in turn among those not busy (all of them when every one is).
    RoundRobinSkipBusy,
    /// Uniformly at random, busy or not.
    Random,
    /// Fewest booked blocks.
    LeastLoaded,
    /// Prefix affinity learned only from its own routing decisions (text-tree routers).
    ApproxPrefix,
}

impl PolicyKind {
    /// Every policy, ours first.
    pub const ALL: [PolicyKind; 6] = [
        PolicyKind::Kv,
        PolicyKind::RoundRobin,
        PolicyKind::RoundRobinSkipBusy,
        PolicyKind::Random,
        PolicyKind::LeastLoaded,
        PolicyKind::ApproxPrefix,
    ];

    /// Parses a policy name as written in reports.
    pub fn parse(name: &str) -> Option<PolicyKind> {
        PolicyKind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// The name.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Kv => "kv",
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::RoundRobinSkipBusy => "round_robin_skip_busy",
            PolicyKind::Random => "random",
            PolicyKind::LeastLoaded => "least_loaded",
            PolicyKind::ApproxPrefix => "approx_prefix",
        }
    }

    /// A fresh policy object. `temperature` applies to `kv`; `approx` to `approx_prefix`.
    pub fn build(self, temperature: f64, approx: ApproxConfig) -> Box<dyn Policy> {
        match self {
            PolicyKind::Kv => Box::new(KvPolicy { temperature }),
            PolicyKind::RoundRobin => Box::new(RoundRobin {
                next: FxHashMap::default(),
                skip_busy: false,
            }),
            PolicyKind::RoundRobinSkipBusy => Box::new(RoundRobin {
                next: FxHashMap::default(),
                skip_busy: true,
            }),
            PolicyKind::Random => Box::new(RandomPolicy),
            PolicyKind::LeastLoaded => Box::new(LeastLoaded),
            PolicyKind::ApproxPrefix => Box::new(ApproxPrefix::new(approx)),
        }
    }
}

/// Index of the minimum of `key` over `candidates`, ties broken uniformly at random.
fn argmin_random(
    candidates: &[Candidate],
    rng: &mut Rng,
    key: impl Fn(&Candidate) -> f64,
) -> usize {
    let best = candidates.iter().map(&key).fold(f64::INFINITY, f64::min);
    let ties: Vec<usize> = (0..candidates.len())
        .filter(|i| key(&candidates[*i]) <= best + 1e-9)
        .collect();
    ties[rng.below(ties.len())]
}

/// Ours: the lowest cost, or with `temperature > 0` a sample from a softmax over costs
/// normalised by the largest.
#[derive(Debug)]
struct KvPolicy {
    temperature: f64,
}

impl Policy for KvPolicy {
    fn name(&self) -> &'static str {
        "kv"
    }

    fn pick(
        &mut self,
        _: &RouteRequest<'_>,
        candidates: &[Candidate],
        rng: &mut Rng,
        _: u64,
    ) -> usize {
        if self.temperature <= 0.0 {
            return argmin_random(candidates, rng, |c| c.cost);
        }
        // Costs scaled to 0..1 over their spread (as Dynamo's `softmax_sample` does), so a
        // temperature means the same idle and loaded: scaled by the largest cost instead,
        // the same cache hit that decides an idle fleet (0 against 800) was a coin toss
        // under load (10,000 against 10,800), when reuse matters most.
        let (min, max) = candidates
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), c| {
                (lo.min(c.cost), hi.max(c.cost))
            });
        let spread = max - min;
        if spread.is_nan() || spread <= 1e-12 {
            return argmin_random(candidates, rng, |c| c.cost);
        }
        let weights: Vec<f64> = candidates
            .iter()
            .map(|c| (-((c.cost - min) / spread) / self.temperature).exp())
            .collect();
        let mut x = rng.unit() * weights.iter().sum::<f64>();
        for (i, w) in weights.iter().enumerate() {
            x -= w;
            if x <= 0.0 {
                return i;
            }
        }
        candidates.len() - 1
    }
}

#[derive(Debug)]
struct RoundRobin {
    /// The next turn, per model: each model's workers take turns among themselves (one
    /// counter over every model would hand two models alternating on two workers each the
    /// same index every time, and idle half the fleet).
    next: FxHashMap<String, usize>,
    skip_busy: bool,
}

/// Models whose turns a round robin keeps; past this (model names churned) it starts over.
const MAX_ROUND_ROBIN_MODELS: usize = 4096;

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        if self.skip_busy {
            "round_robin_skip_busy"
        } else {
            "round_robin"
        }
    }
    fn skips_busy(&self) -> bool {
        self.skip_busy
    }
    fn pick(
        &mut self,
        request: &RouteRequest<'_>,
        candidates: &[Candidate],
        _: &mut Rng,
        _: u64,
    ) -> usize {
        if !self.next.contains_key(request.model) && self.next.len() >= MAX_ROUND_ROBIN_MODELS {
            self.next.clear();
        }
        let next = self.next.entry(request.model.to_owned()).or_default();
        let i = *next % candidates.len();
        *next = next.wrapping_add(1);
        i
    }
}

#[derive(Debug)]
struct RandomPolicy;

impl Policy for RandomPolicy {
    fn name(&self) -> &'static str {
        "random"
    }
    fn skips_busy(&self) -> bool {
        false
    }
    fn pick(
        &mut self,
        _: &RouteRequest<'_>,
        candidates: &[Candidate],
        rng: &mut Rng,
        _: u64,
    ) -> usize {
        rng.below(candidates.len())
    }
}

#[derive(Debug)]
struct LeastLoaded;

impl Policy for LeastLoaded {
    fn name(&self) -> &'static str {
        "least_loaded"
    }
    fn pick(
        &mut self,
        _: &RouteRequest<'_>,
        candidates: &[Candidate],
        rng: &mut Rng,
        _: u64,
    ) -> usize {
        argmin_random(candidates, rng, |c| c.prefill_blocks + c.decode_blocks)
    }
}

/// Settings of the `approx_prefix` baseline.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ApproxConfig {
    /// How long a routing decision is remembered, ms.
    pub ttl_ms: u64,
    /// Share of the prompt that must match a remembered decision to follow it; below it the
    /// least loaded worker is used (SGLang's router defaults to 0.5).
    pub match_threshold: f64,
    /// Most blocks remembered.
    pub capacity: usize,
}

impl Default for ApproxConfig {
    fn default() -> Self {
        ApproxConfig {
            ttl_ms: 120_000,
            match_threshold: 0.5,
            capacity: 4 << 20,
        }
    }
}

/// Remembers which worker it sent each block to, and follows the deepest remembered match;
/// knows nothing of evictions or of other routers.
#[derive(Debug)]
struct ApproxPrefix {
    config: ApproxConfig,
    seen: FxHashMap<SeqHash, (WorkerKey, u64)>,
    inserted_since_sweep: usize,
}

impl ApproxPrefix {
    fn new(config: ApproxConfig) -> Self {
        ApproxPrefix {
            config,
            seen: FxHashMap::default(),
            inserted_since_sweep: 0,
        }
    }

    fn sweep(&mut self, now_ms: u64) {
        let ttl = self.config.ttl_ms;
        self.seen
            .retain(|_, (_, at)| now_ms.saturating_sub(*at) <= ttl);
        if self.seen.len() > self.config.capacity {
            self.seen.clear();
        }
        self.seen.shrink_to(self.seen.len() * 2);
        self.inserted_since_sweep = 0;
    }
}

impl Policy for ApproxPrefix {
    fn name(&self) -> &'static str {
        "approx_prefix"
    }

    fn pick(
        &mut self,
        request: &RouteRequest<'_>,
        candidates: &[Candidate],
        rng: &mut Rng,
        now_ms: u64,
    ) -> usize {
        let mut best: Option<(usize, WorkerKey)> = None;
        for (i, block) in request.blocks.iter().enumerate() {
            match self.seen.get(&block.seq) {
                Some((worker, at)) if now_ms.saturating_sub(*at) <= self.config.ttl_ms => {
                    best = Some((i + 1, *worker))
                }
                _ => break,
            }
        }
        let followed = best.and_then(|(blocks, worker)| {
            let share = (blocks * request.block_size) as f64 / request.prompt_tokens.max(1) as f64;
            (share >= self.config.match_threshold)
                .then(|| candidates.iter().position(|c| c.key == worker))
                .flatten()
        });
        let choice = followed.unwrap_or_else(|| {
            argmin_random(candidates, rng, |c| c.prefill_blocks + c.decode_blocks)
        });
        let worker = candidates[choice].key;
        for block in request.blocks {
            self.seen.insert(block.seq, (worker, now_ms));
        }
        self.inserted_since_sweep += request.blocks.len();
        if self.inserted_since_sweep > self.config.capacity / 4 {
            self.sweep(now_ms);
        }
        choice
    }
}
