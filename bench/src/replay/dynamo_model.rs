//! A step-level model of NVIDIA Dynamo's mocker engine under round-robin routing, written
//! apart from kvroute's engine, and the test that kvroute's replay with `--mixed-step
//! additive` and the strict `round_robin` agrees with it on a slice of the conversation trace.
//!
//! The rules are read from the mocker's simulator core (ai-dynamo/aisimulate, `crates/core`,
//! `core.rs` and `perf_model.rs`): each worker runs FCFS; a step schedules the running
//! requests first (a decoder takes one token of the 8,192-token budget, a prefill its next
//! chunk), then admits waiting requests; a prompt's cached prefix is capped at
//! ⌊(len − 1)/bs⌋ blocks; a step costs `prefill(new prompt tokens) + decode(p)`, where `p` is
//! the tokens (prompt and output so far) of the requests decoding in it over G1's tokens;
//! round robin sends request `i` to worker `i mod W`, busy or not. A token is out when its
//! step ends. Memory is not modelled: the test checks that the slice never fills G1, so that
//! neither engine evicts or preempts.

use std::collections::{HashSet, VecDeque};
use std::num::NonZeroUsize;

use kvroute::protocol::SeqHash;
use kvroute_worker::engine::{MixedStep, TimingModel};

use super::{Args, Prompt, prompts, run};
use crate::stats::Summary;
use crate::trace;

const BUDGET: usize = 8192;
const MAX_SEQS: usize = 256;

struct Running {
    request: usize,
    computed: usize,
    generated: u32,
    scheduled: usize,
}

/// TTFT of every request (ms) on `workers` workers of `g1_blocks` blocks of `bs` tokens, and
/// the most blocks any worker held at once (running requests' plus cached).
fn model(prompts: &[Prompt], workers: usize, bs: usize, g1_blocks: usize) -> (Vec<f64>, usize) {
    let timing = TimingModel {
        mixed_step: MixedStep::Additive,
        ..TimingModel::default()
    };
    let mut ttft = vec![f64::NAN; prompts.len()];
    let mut peak = 0;
    for w in 0..workers {
        let mut arrivals: VecDeque<usize> = (w..prompts.len()).step_by(workers).collect();
        let mut waiting: VecDeque<usize> = VecDeque::new();
        let mut running: Vec<Running> = Vec::new();
        let mut cached: HashSet<SeqHash> = HashSet::new();
        let mut now = 0u64;
        loop {
            if running.is_empty() && waiting.is_empty() {
                match arrivals.front() {
                    Some(&i) => now = now.max(prompts[i].arrival_us),
                    None => break,
                }
            }
            while arrivals
                .front()
                .is_some_and(|&i| prompts[i].arrival_us <= now)
            {
                waiting.extend(arrivals.pop_front());
            }
            let mut budget = BUDGET;
            let (mut prefill, mut decoders, mut decode_tokens) = (0, 0, 0);
            for r in &mut running {
                let total = prompts[r.request].len + r.generated as usize;
                let need = total - r.computed;
                if budget == 0 {
                    break;
                }
                if r.generated > 0 && need == 1 {
                    decoders += 1;
                    decode_tokens += total;
                    r.scheduled = 1;
                } else {
                    r.scheduled = need.min(budget);
                    prefill += r.scheduled;
                }
                budget -= r.scheduled;
            }
            while budget > 0 && running.len() < MAX_SEQS {
                let Some(i) = waiting.pop_front() else { break };
                let p = &prompts[i];
                let cap = (p.len - 1) / bs;
                let hits = p.blocks[..cap.min(p.blocks.len())]
                    .iter()
                    .take_while(|b| cached.contains(&b.seq))
                    .count();
                let computed = hits * bs;
                let scheduled = (p.len - computed).min(budget);
                prefill += scheduled;
                budget -= scheduled;
                running.push(Running {
                    request: i,
                    computed,
                    generated: 0,
                    scheduled,
                });
            }
            // Blocks in use beyond the cached ones: those being filled.
            let filling: usize = running
                .iter()
                .map(|r| {
                    let p = &prompts[r.request];
                    let total = (p.len + r.generated as usize).div_ceil(bs);
                    total - (r.computed / bs).min(p.blocks.len())
                })
                .sum();
            peak = peak.max(filling + cached.len());
            let p = decode_tokens as f64 / (g1_blocks * bs) as f64;
            now += timing.step_us(prefill, decoders, p, 1.0);
            running.retain_mut(|r| {
                let prompt = &prompts[r.request];
                r.computed += std::mem::take(&mut r.scheduled);
                let full = (r.computed / bs).min(prompt.blocks.len());
                cached.extend(prompt.blocks[..full].iter().map(|b| b.seq));
                if r.computed < prompt.len + r.generated as usize {
                    return true;
                }
                if r.generated == 0 {
                    ttft[r.request] = (now - prompt.arrival_us) as f64 / 1000.0;
                }
                r.generated += 1;
                r.generated < prompt.output
            });
        }
    }
    (ttft, peak)
}

/// The first 400 requests of the conversation trace at 6× on 8 workers (block 64, 16,384 G1
/// blocks, no G2): kvroute's replay, with Dynamo's step pricing and the plain round robin,
/// gives the model's TTFT median, mean and p99 within 1 %.
#[test]
fn additive_round_robin_matches_a_model_of_dynamos_mocker() {
    let trace =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("traces/conversation_trace.jsonl");
    let mut args = super::tests::args(trace.clone(), "round_robin");
    args.source.requests = Some(400);
    args = Args {
        workers: 8,
        speedup: 6.0,
        g1_blocks: 16_384,
        g2_blocks: 0,
        eviction: "lru".into(),
        mixed_step: "additive".into(),
        ..args
    };
    let report = run(&args).unwrap();
    let records = trace::load(&trace, args.source.requests, args.source.trace_block_size).unwrap();
    let bs = NonZeroUsize::new(args.block_size).unwrap();
    let prompts = prompts(&records, &args, bs).unwrap();
    let (mut ttft, peak) = model(&prompts, args.workers, args.block_size, args.g1_blocks);
    assert!(
        peak < args.g1_blocks,
        "the slice fills G1 ({peak} blocks): the model does not evict"
    );
    assert!(ttft.iter().all(|t| t.is_finite()));
    let want = Summary::of(&mut ttft);
    let got = &report.policies[0].ttft_ms;
    for (name, got, want) in [
        ("p50", got.p50, want.p50),
        ("mean", got.mean, want.mean),
        ("p99", got.p99, want.p99),
    ] {
        assert!(
            (got - want).abs() <= 0.01 * want,
            "TTFT {name}: kvroute {got:.1} ms, model {want:.1} ms"
        );
    }
}
