use std::num::NonZeroUsize;

use super::*;
use crate::engines::wire::{Medium, Stored};
use crate::protocol::hash_blocks;

const BS: usize = 4;

fn bs() -> NonZeroUsize {
    NonZeroUsize::new(BS).unwrap()
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], medium: Medium) -> EngineEvent {
    EngineEvent::Stored(Box::new(Stored {
        hashes: hashes.iter().map(|h| EngineHash(*h)).collect(),
        parent: parent.map(EngineHash),
        token_ids: tokens.to_vec(),
        block_size: if tokens.is_empty() { 0 } else { BS as u32 },
        medium,
        lora_name: None,
        lora_id: None,
        extra_keys: Vec::new(),
        cache_salt: None,
        group: None,
        spec_kind: None,
    }))
}

fn removed(hashes: &[u64], medium: Medium) -> EngineEvent {
    EngineEvent::Removed {
        hashes: hashes.iter().map(|h| EngineHash(*h)).collect(),
        medium,
        group: None,
    }
}

fn apply(m: &mut EngineMirror, events: Vec<EngineEvent>) -> Vec<BlockChange> {
    let mut out = Vec::new();
    m.apply(
        &EngineBatch {
            ts: 0.0,
            events,
            dp_rank: None,
        },
        &mut out,
    );
    out
}

/// The host tier's stores and removals among `out`, in order.
fn host_changes(out: &[BlockChange]) -> (Vec<SeqHash>, Vec<SeqHash>) {
    let (mut stored, mut removed) = (Vec::new(), Vec::new());
    for c in out {
        match c {
            BlockChange::Stored {
                tier: Tier::Host,
                block,
                ..
            } => stored.push(block.seq),
            BlockChange::Removed {
                tier: Tier::Host,
                seq,
            } => removed.push(*seq),
            _ => {}
        }
    }
    (stored, removed)
}

fn tokens(n: usize) -> Vec<u32> {
    (0..n as u32).map(|t| t * 7 + 1).collect()
}

#[test]
fn stores_get_the_hashes_the_router_computes_for_the_prompt() {
    let toks = tokens(3 * BS);
    let want = hash_blocks(&toks, bs(), Salt::NONE);
    let mut m = EngineMirror::new(bs());
    // Two events: the engine names blocks its own way; the second continues the first.
    let mut out = apply(
        &mut m,
        vec![stored(&[100, 101], None, &toks[..2 * BS], Medium::Gpu)],
    );
    out.extend(apply(
        &mut m,
        vec![stored(&[102], Some(101), &toks[2 * BS..], Medium::Gpu)],
    ));
    let got: Vec<(Option<SeqHash>, SeqHash, LocalHash)> = out
        .iter()
        .map(|c| match c {
            BlockChange::Stored {
                tier: Tier::Device,
                parent,
                block,
            } => (*parent, block.seq, block.local),
            other => panic!("{other:?}"),
        })
        .collect();
    let expect: Vec<_> = want
        .iter()
        .enumerate()
        .map(|(i, b)| (i.checked_sub(1).map(|p| want[p].seq), b.seq, b.local))
        .collect();
    assert_eq!(got, expect);
    // Removal by the engine's name.
    assert_eq!(
        apply(&mut m, vec![removed(&[101], Medium::Gpu)]),
        vec![BlockChange::Removed {
            tier: Tier::Device,
            seq: want[1].seq
        }]
    );
    assert_eq!(m.len(), 2);
}

#[test]
fn token_less_offload_stores_resolve_through_the_engine_hash() {
    let toks = tokens(BS);
    let seq = hash_blocks(&toks, bs(), Salt::NONE)[0].seq;
    let mut m = EngineMirror::new(bs());
    apply(&mut m, vec![stored(&[9], None, &toks, Medium::Gpu)]);
    let out = apply(
        &mut m,
        vec![
            stored(&[9], None, &[], Medium::Cpu),
            removed(&[9], Medium::Gpu),
            stored(&[77], None, &[], Medium::Cpu),
        ],
    );
    assert!(
        matches!(out[0], BlockChange::Stored { tier: Tier::Host, block, .. } if block.seq == seq)
    );
    assert_eq!(
        out[1],
        BlockChange::Removed {
            tier: Tier::Device,
            seq
        }
    );
    assert_eq!(out.len(), 2, "the unknown 77 resolves to nothing");
    assert_eq!(m.stats().unresolved, 1);
    // Gone from every tier, then offloaded again: still resolved (remembered).
    apply(&mut m, vec![removed(&[9], Medium::Cpu)]);
    assert!(m.is_empty());
    let out = apply(
        &mut m,
        vec![stored(&[9], None, &[], Medium::Other("STORAGE".into()))],
    );
    assert!(
        matches!(out[0], BlockChange::Stored { tier: Tier::Disk, block, .. } if block.seq == seq)
    );
}

/// An event of an unknown kind between two known ones is counted and skipped: the others
/// apply, and nothing already mirrored is dropped.
#[test]
fn unknown_events_are_counted_and_the_rest_applies() {
    let toks = tokens(2 * BS);
    let mut m = EngineMirror::new(bs());
    let out = apply(
        &mut m,
        vec![
            stored(&[1], None, &toks[..BS], Medium::Gpu),
            EngineEvent::Other("TransferInitiated".into()),
            stored(&[2], Some(1), &toks[BS..], Medium::Gpu),
        ],
    );
    assert_eq!(out.len(), 2);
    assert_eq!(m.stats().unknown_events, 1);
    assert_eq!(m.stats().stored, 2);
}

/// An event that did not decode costs only itself when it was a store: the blocks already
/// mirrored and the events after it stay. Any other (a removal, or an event with no tag)
/// might have removed blocks: the mirror drops everything it held.
#[test]
fn a_malformed_store_is_skipped_and_a_malformed_removal_drops_everything() {
    let toks = tokens(3 * BS);
    let malformed = |tag: Option<&str>| EngineEvent::Malformed {
        tag: tag.map(Into::into),
        error: "event 1: group_idx".into(),
    };
    for (tag, kept) in [
        (Some("BlockStored"), true),
        (Some("BlockRemoved"), false),
        (None, false),
    ] {
        let mut m = EngineMirror::new(bs());
        apply(&mut m, vec![stored(&[1], None, &toks[..BS], Medium::Gpu)]);
        let out = apply(
            &mut m,
            vec![
                stored(&[2], Some(1), &toks[BS..2 * BS], Medium::Gpu),
                malformed(tag),
                stored(&[3], Some(2), &toks[2 * BS..], Medium::Gpu),
            ],
        );
        assert_eq!(m.stats().malformed_events, 1);
        let removed = out
            .iter()
            .filter(|c| matches!(c, BlockChange::Removed { .. }))
            .count();
        assert_eq!(removed, if kept { 0 } else { 2 }, "{tag:?}: {out:?}");
        // Block 3 follows either way; after a drop its parent is unknown (an orphan).
        assert_eq!(m.len(), if kept { 3 } else { 0 }, "{tag:?}");
    }
}

/// A rebuild from the engine's whole history hands out only what changed while the mirror
/// was away: a block held before and stored again goes unsaid, one stored anew or in
/// another tier is stored, one not stored again is removed at the end; the mirror then
/// holds what the history says, and a clear during a rebuild removes both what was set
/// aside and what was stored again.
#[test]
fn a_rebuild_hands_out_only_what_changed() {
    let toks = tokens(4 * BS);
    let want = hash_blocks(&toks, bs(), Salt::NONE);
    let chain = |m: &mut EngineMirror, hashes: &[u64]| {
        let events = hashes
            .iter()
            .enumerate()
            .map(|(i, h)| {
                let parent = i.checked_sub(1).map(|p| hashes[p]);
                stored(&[*h], parent, &toks[i * BS..(i + 1) * BS], Medium::Gpu)
            })
            .collect();
        apply(m, events)
    };
    let mut m = EngineMirror::new(bs());
    assert_eq!(chain(&mut m, &[1, 2, 3]).len(), 3);
    m.begin_rebuild();
    // The history: 1, 2 and a fourth block in the GPU, and block 1 offloaded; not 3.
    let mut out = chain(&mut m, &[1, 2, 3, 4]);
    out.extend(apply(&mut m, vec![removed(&[3], Medium::Gpu)]));
    out.extend(apply(&mut m, vec![stored(&[1], None, &[], Medium::Cpu)]));
    m.end_rebuild(&mut out);
    let device = |seq| BlockChange::Removed {
        tier: Tier::Device,
        seq,
    };
    // Blocks 1 to 3 were held before: stored again, unsaid. Block 3's removal after is
    // handed out (its owner held it throughout), so nothing is left to remove at the end.
    assert!(
        matches!(&out[..], [
            BlockChange::Stored { tier: Tier::Device, block: b4, .. },
            removed_3,
            BlockChange::Stored { tier: Tier::Host, block: b1, .. },
        ] if b4.seq == want[3].seq && *removed_3 == device(want[2].seq)
            && b1.seq == want[0].seq),
        "{out:?}"
    );
    assert_eq!(m.len(), 3);
    // Set aside, then cleared before being stored again: removed once, like the rest.
    m.begin_rebuild();
    chain(&mut m, &[1]);
    let mut cleared = Vec::new();
    m.clear(&mut cleared);
    let mut gone: Vec<_> = cleared
        .iter()
        .map(|c| match c {
            BlockChange::Removed { tier, seq } => (*tier, *seq),
            other => panic!("{other:?}"),
        })
        .collect();
    gone.sort();
    let mut expect = vec![
        (Tier::Device, want[0].seq),
        (Tier::Device, want[1].seq),
        (Tier::Device, want[3].seq),
        (Tier::Host, want[0].seq),
    ];
    expect.sort();
    assert_eq!(gone, expect);
    let mut none = Vec::new();
    m.end_rebuild(&mut none);
    assert!(none.is_empty());
}

#[test]
fn a_block_stored_twice_stays_until_removed_twice() {
    let toks = tokens(BS);
    let mut m = EngineMirror::new(bs());
    let once = apply(&mut m, vec![stored(&[1], None, &toks, Medium::Gpu)]);
    assert_eq!(once.len(), 1);
    assert!(apply(&mut m, vec![stored(&[1], None, &toks, Medium::Gpu)]).is_empty());
    assert!(apply(&mut m, vec![removed(&[1], Medium::Gpu)]).is_empty());
    assert_eq!(apply(&mut m, vec![removed(&[1], Medium::Gpu)]).len(), 1);
    assert!(apply(&mut m, vec![removed(&[1], Medium::Gpu)]).is_empty());
    assert_eq!(m.stats().unresolved, 1);
}

#[test]
fn a_wrong_block_size_or_token_count_or_unknown_parent_is_counted_not_indexed() {
    let mut m = EngineMirror::new(bs());
    let mut e = stored(&[1], None, &tokens(8), Medium::Gpu);
    if let EngineEvent::Stored(s) = &mut e {
        s.block_size = 8;
    }
    assert!(apply(&mut m, vec![e]).is_empty());
    assert_eq!(
        (m.stats().block_size_mismatch, m.wrong_block_size()),
        (1, Some(8))
    );
    assert!(
        apply(
            &mut m,
            vec![stored(&[1, 2], None, &tokens(BS), Medium::Gpu)]
        )
        .is_empty()
    );
    assert_eq!(m.stats().malformed, 2);
    assert!(
        apply(
            &mut m,
            vec![stored(&[3], Some(404), &tokens(BS), Medium::Gpu)]
        )
        .is_empty()
    );
    assert_eq!(m.stats().orphans, 1);
}

#[test]
fn lora_and_cache_salt_name_their_own_blocks() {
    let toks = tokens(2 * BS);
    let mut base = EngineMirror::new(bs());
    let mut adapter = EngineMirror::new(bs());
    let plain = apply(&mut base, vec![stored(&[1, 2], None, &toks, Medium::Gpu)]);
    let mut e = stored(&[1, 2], None, &toks, Medium::Gpu);
    if let EngineEvent::Stored(s) = &mut e {
        s.lora_name = Some("a".into());
        // vLLM: the adapter's name on every block, the cache salt on the first.
        s.extra_keys = vec![
            vec![ExtraKey::Str("a".into()), ExtraKey::Str("s1".into())],
            vec![ExtraKey::Str("a".into())],
        ];
    }
    let salted = apply(&mut adapter, vec![e]);
    let want = hash_blocks(&toks, bs(), engine_salt(Some("a"), Some("s1")));
    let seqs = |c: &[BlockChange]| {
        c.iter()
            .map(|c| match c {
                BlockChange::Stored { block, .. } => block.seq,
                BlockChange::Removed { seq, .. } => *seq,
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(
        seqs(&salted),
        want.iter().map(|b| b.seq).collect::<Vec<_>>()
    );
    assert_ne!(seqs(&salted), seqs(&plain));
    assert_ne!(engine_salt(Some("a"), None), engine_salt(None, Some("a")));
    assert_eq!(engine_salt(None, None), Salt::NONE);
}

/// SGLang tags a salted request's cache salt as the first key of each of its events:
/// `[["dynamo-cache-salt:tenant-a"]]`. It salts the chain at its root (as the request's
/// `cache_salt` salts the router's hashes) and is not mixed into a later event's block.
#[test]
fn sglang_s_tagged_cache_salt_salts_the_root_only() {
    let toks = tokens(3 * BS);
    let mut m = EngineMirror::new(bs());
    let tagged = |hashes: &[u64], parent: Option<u64>, toks: &[u32]| {
        let mut e = stored(hashes, parent, toks, Medium::Gpu);
        if let EngineEvent::Stored(s) = &mut e {
            s.extra_keys = vec![vec![ExtraKey::Str("dynamo-cache-salt:tenant-a".into())]];
        }
        e
    };
    let out = apply(
        &mut m,
        vec![
            tagged(&[1, 2], None, &toks[..2 * BS]),
            tagged(&[3], Some(2), &toks[2 * BS..]),
        ],
    );
    let got: Vec<SeqHash> = out
        .iter()
        .map(|c| match c {
            BlockChange::Stored { block, .. } => block.seq,
            BlockChange::Removed { seq, .. } => *seq,
        })
        .collect();
    let want: Vec<SeqHash> = hash_blocks(&toks, bs(), engine_salt(None, Some("tenant-a")))
        .iter()
        .map(|b| b.seq)
        .collect();
    assert_eq!(got, want);
}

#[test]
fn multimodal_keys_make_blocks_no_text_prompt_matches() {
    let toks = tokens(BS);
    let mut m = EngineMirror::new(bs());
    let mut e = stored(&[1], None, &toks, Medium::Gpu);
    if let EngineEvent::Stored(s) = &mut e {
        s.extra_keys = vec![vec![ExtraKey::Other(0x92a3)]];
    }
    let out = apply(&mut m, vec![e]);
    let BlockChange::Stored { block, .. } = out[0] else {
        panic!()
    };
    assert_ne!(block.seq, hash_blocks(&toks, bs(), Salt::NONE)[0].seq);
}

#[test]
fn only_groups_that_hold_the_whole_prefix_count() {
    let toks = tokens(BS);
    let mut m = EngineMirror::new(bs());
    let in_group = |e: EngineEvent, g: u32, kind: Option<&str>| match e {
        EngineEvent::Stored(mut s) => {
            s.group = Some(g);
            s.spec_kind = kind.map(str::to_owned);
            EngineEvent::Stored(s)
        }
        EngineEvent::Removed { hashes, medium, .. } => EngineEvent::Removed {
            hashes,
            medium,
            group: Some(g),
        },
        e => e,
    };
    let out = apply(
        &mut m,
        vec![
            in_group(
                stored(&[1], None, &toks, Medium::Gpu),
                0,
                Some("full_attention"),
            ),
            // A removal of a group not seen storing yet (its kind unknown): not group 0's.
            in_group(removed(&[1], Medium::Gpu), 2, None),
            in_group(
                stored(&[1], None, &toks, Medium::Gpu),
                1,
                Some("sliding_window"),
            ),
        ],
    );
    assert_eq!(out.len(), 1, "{out:?}");
    assert_eq!(m.stats().other_groups, 2);
    // The sliding-window group drops the block: the full-attention group still holds it.
    assert!(apply(&mut m, vec![in_group(removed(&[1], Medium::Gpu), 1, None)]).is_empty());
    assert_eq!(
        apply(&mut m, vec![in_group(removed(&[1], Medium::Gpu), 0, None)]).len(),
        1
    );
}

#[test]
fn cleared_removes_every_tier_of_every_block() {
    let toks = tokens(2 * BS);
    let mut m = EngineMirror::new(bs());
    apply(
        &mut m,
        vec![
            stored(&[1, 2], None, &toks, Medium::Gpu),
            stored(&[1], None, &[], Medium::Cpu),
        ],
    );
    let mut out = apply(&mut m, vec![EngineEvent::Cleared]);
    out.sort_by_key(|c| format!("{c:?}"));
    assert_eq!(out.len(), 3);
    assert!(m.is_empty());
    // Forgotten entirely: a later token-less store does not resolve.
    assert!(apply(&mut m, vec![stored(&[1], None, &[], Medium::Cpu)]).is_empty());
}

#[test]
fn seq_tracker_tells_next_gap_and_restart() {
    let mut t = SeqTracker::default();
    assert_eq!(t.check(5), SeqCheck::First);
    t.advance(5);
    assert_eq!(t.check(6), SeqCheck::Next);
    assert_eq!(t.check(9), SeqCheck::Gap { expected: 6 });
    assert_eq!(t.check(0), SeqCheck::Restarted);
    assert_eq!(t.check(5), SeqCheck::Restarted);
    t.reset();
    assert_eq!(t.check(0), SeqCheck::First);
}

#[test]
fn a_known_block_resolves_by_its_engine_hash_whatever_its_parent() {
    // SGLang's host stores carry tokens and a parent that may have left every tier.
    let toks = tokens(2 * BS);
    let want = hash_blocks(&toks, bs(), Salt::NONE);
    let mut m = EngineMirror::new(bs());
    apply(&mut m, vec![stored(&[1, 2], None, &toks, Medium::Gpu)]);
    apply(&mut m, vec![removed(&[1], Medium::Gpu)]);
    let mut lost_parent = stored(&[2], Some(999), &toks[BS..], Medium::Cpu);
    if let EngineEvent::Stored(s) = &mut lost_parent {
        s.medium = Medium::parse(Some("CPU_PINNED"));
    }
    let out = apply(&mut m, vec![lost_parent]);
    assert!(
        matches!(out[..], [BlockChange::Stored { tier: Tier::Host, block, .. }] if block.seq == want[1].seq),
        "{out:?}"
    );
    assert_eq!(m.stats().orphans, 0);
}

/// An engine that names a block by its tokens alone (SGLang before its position-aware
/// hashes: `hash(tuple(page_tokens))`) gives a page the same hash under two prefixes. Taken
/// for the block already known, the second chain's later blocks were credited under the
/// first chain's prefix (S1 D Q indexed, where the engine holds S1 D and S2 D Q), and so was
/// any later store under that hash as a parent: an overcount. Seen once, the engine's
/// hashes are no positions: nothing of it is indexed (what was is removed) until it
/// restarts.
#[test]
fn a_known_hash_under_another_parent_stops_indexing_the_engine() {
    let (s1, s2, d, q, x) = (
        tokens(BS),
        vec![500; BS],
        vec![600; BS],
        vec![700; BS],
        vec![800; BS],
    );
    let mut m = EngineMirror::new(bs());
    let first = apply(
        &mut m,
        vec![stored(
            &[10, 20],
            None,
            &[s1.clone(), d.clone()].concat(),
            Medium::Gpu,
        )],
    );
    assert_eq!(first.len(), 2);
    let second = [s2.clone(), d.clone(), q.clone()].concat();
    let out = apply(
        &mut m,
        vec![stored(&[30, 20, 40], None, &second, Medium::Gpu)],
    );
    let (mut stored_now, mut removed) = (Vec::new(), Vec::new());
    for c in &out {
        match c {
            BlockChange::Stored { block, .. } => stored_now.push(block.seq),
            BlockChange::Removed { seq, .. } => removed.push(*seq),
        }
    }
    let want = hash_blocks(&second, bs(), Salt::NONE);
    assert_eq!(
        stored_now,
        [want[0].seq],
        "S2 is stored before the ambiguity is seen"
    );
    removed.sort();
    let mut all: Vec<SeqHash> = first
        .iter()
        .chain(&out)
        .filter_map(|c| match c {
            BlockChange::Stored { block, .. } => Some(block.seq),
            BlockChange::Removed { .. } => None,
        })
        .collect();
    all.sort();
    assert_eq!(removed, all, "everything indexed is removed");
    assert!(m.ambiguous_hashing());
    assert_eq!(m.stats().ambiguous, 2);
    // A later store under D (as a parent) or under a parent the mirror never saw: nothing.
    assert!(apply(&mut m, vec![stored(&[50], Some(20), &x, Medium::Gpu)]).is_empty());
    assert!(apply(&mut m, vec![stored(&[60], Some(999), &x, Medium::Cpu)]).is_empty());
    assert_eq!(m.stats().ambiguous, 4);
    // A restarted engine is judged afresh.
    m.clear(&mut Vec::new());
    m.engine_restarted();
    assert_eq!(
        apply(&mut m, vec![stored(&[10], None, &s1, Medium::Gpu)]).len(),
        1
    );
}

/// A clear gives the maps' capacity back: an engine that held millions of blocks left as
/// many empty slots behind, for good.
#[test]
fn a_clear_gives_the_mirror_s_memory_back() {
    let mut m = EngineMirror::new(bs());
    let hashes: Vec<u64> = (1..=10_000).collect();
    let out = apply(
        &mut m,
        vec![stored(
            &hashes,
            None,
            &tokens(hashes.len() * BS),
            Medium::Gpu,
        )],
    );
    assert_eq!(out.len(), hashes.len());
    assert!(m.blocks.capacity() >= hashes.len());
    m.clear(&mut Vec::new());
    assert!(m.blocks.capacity() < 64, "{}", m.blocks.capacity());
}

/// vLLM releases before `lora_name` name an adapter by number only: its blocks are salted
/// with the adapter in the engine, and the router salts by name, so they are not indexed
/// (as base-model blocks they would be false hits), and counted.
#[test]
fn blocks_of_an_adapter_named_by_number_only_are_not_indexed() {
    let mut m = EngineMirror::new(bs());
    let EngineEvent::Stored(mut s) = stored(&[1, 2], None, &tokens(2 * BS), Medium::Gpu) else {
        unreachable!()
    };
    s.lora_id = Some(3);
    assert!(apply(&mut m, vec![EngineEvent::Stored(s.clone())]).is_empty());
    assert_eq!(m.stats().unnamed_lora, 2);
    // Named, they are indexed with the adapter's salt.
    s.lora_name = Some("adapter".into());
    assert_eq!(apply(&mut m, vec![EngineEvent::Stored(s)]).len(), 2);
}

/// vLLM's CPU offload with chunks of 2 GPU blocks, in its default (placeholder) events: a
/// chunk is named by its last block's hash alone. The chunk holds both blocks on the host,
/// and its removal lets both go; once the GPU has evicted them, the host still has the
/// whole prefix.
#[test]
fn an_offload_chunk_named_by_its_last_block_holds_all_its_blocks() {
    let toks = tokens(4 * BS);
    let want = hash_blocks(&toks, bs(), Salt::NONE);
    let mut m = EngineMirror::new(bs()).with_offload_chunk(NonZeroUsize::new(2).unwrap());
    apply(
        &mut m,
        vec![stored(&[10, 11, 12, 13], None, &toks, Medium::Gpu)],
    );
    // Chunks (10, 11) and (12, 13), named 11 and 13; then the GPU evicts everything.
    let out = apply(
        &mut m,
        vec![
            stored(&[11, 13], None, &[], Medium::Cpu),
            removed(&[13, 12, 11, 10], Medium::Gpu),
        ],
    );
    let (host, _) = host_changes(&out);
    assert_eq!(host, want.iter().map(|b| b.seq).collect::<Vec<_>>());
    assert_eq!(m.len(), 4, "all four are held on the host");
    // Removing chunk 11 from the host lets blocks 10 and 11 go, and only those.
    let out = apply(&mut m, vec![removed(&[11], Medium::Cpu)]);
    let (_, gone) = host_changes(&out);
    assert_eq!(gone.len(), 2);
    assert!(gone.contains(&want[0].seq) && gone.contains(&want[1].seq));
    assert_eq!(m.len(), 2);
    assert_eq!(m.stats().unresolved, 0);
}

/// Two requests diverging inside a chunk (chunks of 2: blocks 10, 11 then 12 or 22): the
/// chunks named 13 and 23 share nothing, but chunk 11 is stored by both; each store holds
/// it once, so the first removal leaves it held. A removal after a clear finds nothing.
#[test]
fn offload_chunks_stored_twice_need_two_removals_and_a_clear_forgets_them() {
    let toks = tokens(4 * BS);
    let mut other = toks.clone();
    other[2 * BS] += 1;
    let mut m = EngineMirror::new(bs()).with_offload_chunk(NonZeroUsize::new(2).unwrap());
    apply(
        &mut m,
        vec![
            stored(&[10, 11, 12, 13], None, &toks, Medium::Gpu),
            stored(&[22, 23], Some(11), &other[2 * BS..], Medium::Gpu),
        ],
    );
    let host = |out: &[BlockChange]| {
        let (stored, removed) = host_changes(out);
        stored.len() as isize - removed.len() as isize
    };
    let out = apply(
        &mut m,
        vec![
            stored(&[11, 13], None, &[], Medium::Cpu),
            stored(&[11, 23], None, &[], Medium::Cpu),
        ],
    );
    assert_eq!(host(&out), 6, "10, 11, 12, 13, 22, 23 on the host");
    assert_eq!(host(&apply(&mut m, vec![removed(&[11], Medium::Cpu)])), 0);
    assert_eq!(host(&apply(&mut m, vec![removed(&[11], Medium::Cpu)])), -2);
    let mut out = Vec::new();
    m.clear(&mut out);
    assert_eq!(m.len(), 0);
    let before = m.stats().unresolved;
    assert!(apply(&mut m, vec![removed(&[13], Medium::Cpu)]).is_empty());
    assert_eq!(m.stats().unresolved, before + 1);
}

/// An engine that stores without end (or whose removals are lost) fills a capped mirror to
/// its cap and no further: a new block past it is refused and counted, its children are
/// orphans (never announced without it), and a removal makes room again. Control: the same
/// events without the cap hold every block.
#[test]
fn a_full_mirror_refuses_new_blocks_and_stays_exact() {
    let toks = tokens(4 * BS);
    let want = hash_blocks(&toks, bs(), Salt::NONE);
    let capped = || EngineMirror::new(bs()).with_max_blocks(NonZeroUsize::new(2).unwrap());
    let events = || vec![stored(&[10, 11, 12, 13], None, &toks, Medium::Gpu)];

    let mut m = capped();
    let out = apply(&mut m, events());
    let seqs: Vec<SeqHash> = out
        .iter()
        .map(|c| match c {
            BlockChange::Stored { block, .. } => block.seq,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        seqs,
        [want[0].seq, want[1].seq],
        "a prefix, nothing past it"
    );
    assert_eq!(m.len(), 2);
    assert_eq!((m.stats().capped, m.stats().orphans), (1, 1));
    // Held blocks are still followed: a second tier of a held block needs no room.
    assert_eq!(
        apply(&mut m, vec![stored(&[11], None, &[], Medium::Cpu)]).len(),
        1
    );
    // Many more stores change nothing.
    for i in 0..1_000u64 {
        let other: Vec<u32> = (0..BS as u32).map(|t| t + 1_000 * (i as u32 + 1)).collect();
        assert!(apply(&mut m, vec![stored(&[100 + i], None, &other, Medium::Gpu)]).is_empty());
    }
    assert_eq!(m.len(), 2);
    assert_eq!(m.stats().capped, 1_001);
    // A removal makes room for the block refused before.
    apply(
        &mut m,
        vec![removed(&[11], Medium::Cpu), removed(&[11], Medium::Gpu)],
    );
    assert_eq!(m.len(), 1);
    let out = apply(
        &mut m,
        vec![stored(&[11], Some(10), &toks[BS..2 * BS], Medium::Gpu)],
    );
    assert_eq!(out.len(), 1);
    assert_eq!(m.len(), 2);

    let mut control = EngineMirror::new(bs());
    assert_eq!(apply(&mut control, events()).len(), 4);
    assert_eq!(control.stats().capped, 0);
}

/// Host chunks count against the cap too, and a chunk keeps only the blocks it could hold:
/// its removal lets go of those alone.
#[test]
fn a_full_mirror_refuses_new_offload_chunks() {
    let toks = tokens(2 * BS);
    let chunked = |max: usize| {
        EngineMirror::new(bs())
            .with_offload_chunk(NonZeroUsize::new(2).unwrap())
            .with_max_blocks(NonZeroUsize::new(max).unwrap())
    };
    // Block 10 is evicted from the GPU (remembered for token-less stores), then 20 fills
    // the mirror: chunk 10 cannot be held, and chunk 20 is held.
    let events = vec![
        stored(&[10], None, &toks[..BS], Medium::Gpu),
        removed(&[10], Medium::Gpu),
        stored(&[20], None, &toks[BS..], Medium::Gpu),
    ];
    let mut m = chunked(1);
    apply(&mut m, events.clone());
    let (host, _) = host_changes(&apply(
        &mut m,
        vec![stored(&[10, 20], None, &[], Medium::Cpu)],
    ));
    assert_eq!(host.len(), 1, "chunk 20 only");
    assert_eq!(m.stats().capped, 1);
    // Chunk 10 was not kept: a second store of it is refused again, its removal finds
    // nothing, and chunk 20's removal lets its block go.
    apply(&mut m, vec![stored(&[10], None, &[], Medium::Cpu)]);
    assert_eq!(m.stats().capped, 2);
    assert!(apply(&mut m, vec![removed(&[10], Medium::Cpu)]).is_empty());
    let (_, gone) = host_changes(&apply(&mut m, vec![removed(&[20], Medium::Cpu)]));
    assert_eq!(gone.len(), 1);
    // One chunk past as many chunks as blocks is refused whole.
    // (20 is remembered, 10 is held on the host by its chunk.)
    let mut m = chunked(1);
    apply(
        &mut m,
        vec![
            stored(&[20], None, &toks[BS..], Medium::Gpu),
            removed(&[20], Medium::Gpu),
            stored(&[10], None, &toks[..BS], Medium::Gpu),
            stored(&[10], None, &[], Medium::Cpu),
            removed(&[10], Medium::Gpu),
        ],
    );
    assert_eq!(m.stats().capped, 0);
    assert!(apply(&mut m, vec![stored(&[20], None, &[], Medium::Cpu)]).is_empty());
    assert_eq!(m.stats().capped, 1);
    // Control: without the cap both chunks are held.
    let mut control = chunked(1 << 20);
    apply(&mut control, events);
    let (host, _) = host_changes(&apply(
        &mut control,
        vec![stored(&[10, 20], None, &[], Medium::Cpu)],
    ));
    assert_eq!(host.len(), 2);
}
