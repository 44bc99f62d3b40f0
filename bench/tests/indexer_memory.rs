//! The indexer's memory is bounded by live state: after a million events of store/remove
//! churn over 64 workers, with every block then removed, the index holds nothing and the
//! live heap is back within 5% of where it started. The test owns the process's allocator
//! (a counting one), which is why it lives in a crate of its own test binaries.
#![allow(missing_docs)]

use std::alloc::System;

use kvroute::indexer::{Config, Indexer, Sizes};
use kvroute::protocol::{
    DpRank, EventBatch, KvEvent, KvEventData, LocalHash, Salt, SeqHash, StoredBlock, Tier,
    WorkerId, seq_hash,
};
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// A small deterministic generator (xorshift64*), so the test needs no RNG crate.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn batch(worker: u64, id: &mut u64, tier: Tier, data: KvEventData) -> EventBatch {
    *id += 1;
    EventBatch {
        worker: WorkerId(worker),
        dp_rank: DpRank(0),
        epoch: 1,
        sent_unix_us: 0,
        events: vec![KvEvent {
            id: *id,
            tier,
            data,
        }],
    }
}

#[test]
fn a_million_events_of_churn_leave_nothing_behind() {
    const WORKERS: u64 = 64;
    const EVENTS: u64 = 1_000_000;
    let region = Region::new(GLOBAL);
    let ix = Indexer::new(Config::default()).expect("valid config");
    let start = region.change();
    let live_at_start = start.bytes_allocated as i64 - start.bytes_deallocated as i64;
    let tables_at_start = ix.table_bytes();

    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    // Each worker keeps the chains it announced, as a real one would.
    let mut held: Vec<Vec<Vec<StoredBlock>>> = vec![Vec::new(); WORKERS as usize];
    let mut ids = vec![0u64; WORKERS as usize];
    for _ in 0..EVENTS {
        let w = rng.below(WORKERS);
        let chains = &mut held[w as usize];
        let tier = if rng.below(4) == 0 {
            Tier::Host
        } else {
            Tier::Device
        };
        if chains.len() < 40 || rng.below(2) == 0 {
            // A prompt of 1-8 blocks drawn from a shared vocabulary of prefixes.
            let len = 1 + rng.below(8);
            let mut parent = None;
            let blocks: Vec<StoredBlock> = (0..len)
                .map(|_| {
                    let local = LocalHash(rng.below(16));
                    let seq = seq_hash(parent, local, Salt::NONE);
                    parent = Some(seq);
                    StoredBlock { seq, local }
                })
                .collect();
            let data = KvEventData::Stored {
                parent: None,
                blocks: blocks.clone(),
            };
            ix.apply(&batch(w, &mut ids[w as usize], tier, data));
            chains.push(blocks);
        } else {
            // Remove a chain in reverse (tail first), plus a hash nobody holds.
            let i = rng.below(chains.len() as u64) as usize;
            let chain = chains.swap_remove(i);
            let mut blocks: Vec<SeqHash> = chain.iter().rev().map(|b| b.seq).collect();
            blocks.push(SeqHash(rng.next()));
            for tier in [Tier::Device, Tier::Host] {
                let data = KvEventData::Removed {
                    blocks: blocks.clone(),
                };
                ix.apply(&batch(w, &mut ids[w as usize], tier, data));
            }
        }
    }
    let busy = ix.sizes();
    assert!(
        busy.blocks > 0 && busy.entries > 0,
        "the churn should leave live state: {busy:?}"
    );
    // Half the fleet removes its blocks by events, the other half is removed outright.
    for w in 0..WORKERS {
        if w % 2 == 0 {
            for chain in &held[w as usize] {
                for tier in [Tier::Device, Tier::Host] {
                    let blocks = chain.iter().rev().map(|b| b.seq).collect();
                    ix.apply(&batch(
                        w,
                        &mut ids[w as usize],
                        tier,
                        KvEventData::Removed { blocks },
                    ));
                }
            }
        }
        ix.remove_worker(WorkerId(w));
    }
    drop(held);
    // Before any forced compaction (a router never calls shrink_to_fit): the tables shrank
    // on their own as blocks left.
    let tables_emptied = ix.table_bytes();
    eprintln!("tables: {tables_at_start} B empty at start, {tables_emptied} B emptied");
    assert!(
        tables_emptied <= 2 * tables_at_start,
        "emptied tables hold {tables_emptied} B, the empty index's {tables_at_start} B"
    );
    ix.shrink_to_fit();
    assert_eq!(ix.sizes(), Sizes::default());
    let end = region.change();
    let live_at_end = end.bytes_allocated as i64 - end.bytes_deallocated as i64;
    let grown = live_at_end - live_at_start;
    let limit = (live_at_start as f64 * 0.05).max(4096.0) as i64;
    eprintln!("live heap: {live_at_start} B at start, {live_at_end} B at end ({grown:+} B)");
    assert!(
        grown <= limit,
        "live heap grew by {grown} B (limit {limit} B)"
    );
}
