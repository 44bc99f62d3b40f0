use rmpv::Value;

use super::*;

fn encode(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

fn s(x: &str) -> Value {
    Value::from(x)
}

fn map(entries: Vec<(&str, Value)>) -> Value {
    Value::Map(entries.into_iter().map(|(k, v)| (s(k), v)).collect())
}

fn ints(xs: &[u64]) -> Value {
    Value::Array(xs.iter().map(|x| Value::from(*x)).collect())
}

#[test]
fn every_encoding_round_trips() {
    let events = vec![
        RawEvent::Stored {
            hashes: vec![u64::MAX - 3, 7],
            parent: Some(1 << 63),
            token_ids: (0..8).collect(),
            block_size: 4,
            medium: "GPU".into(),
            lora_name: Some("adapter-a".into()),
            extra_keys: vec![vec!["adapter-a".into(), "salt-1".into()], Vec::new()],
        },
        RawEvent::Stored {
            hashes: vec![7],
            parent: None,
            token_ids: vec![],
            block_size: 0,
            medium: "CPU".into(),
            lora_name: None,
            extra_keys: Vec::new(),
        },
        RawEvent::Removed {
            hashes: vec![u64::MAX - 3],
            medium: "STORAGE".into(),
        },
        RawEvent::Cleared,
    ];
    for tagged_maps in [false, true] {
        for (bytes_hashes, signed_hashes) in [(false, false), (true, false), (false, true)] {
            let enc = Encoding {
                tagged_maps,
                bytes_hashes,
                signed_hashes,
            };
            let b = decode_batch(&encode_batch(12.5, &events, 3, enc)).unwrap();
            assert_eq!(
                (b.ts, b.dp_rank, b.events.len()),
                (12.5, Some(3), 4),
                "{enc:?}"
            );
            // Every form decodes to the engine's 64-bit value.
            let h = EngineHash;
            let EngineEvent::Stored(st) = &b.events[0] else {
                panic!("{enc:?}: {:?}", b.events[0])
            };
            assert_eq!(st.hashes, vec![h(u64::MAX - 3), h(7)]);
            assert_eq!(st.parent, Some(h(1 << 63)));
            assert_eq!((st.token_ids.len(), st.block_size), (8, 4));
            assert_eq!(st.lora_name.as_deref(), Some("adapter-a"));
            assert_eq!(
                st.extra_keys,
                vec![
                    vec![
                        ExtraKey::Str("adapter-a".into()),
                        ExtraKey::Str("salt-1".into())
                    ],
                    Vec::new()
                ]
            );
            assert_eq!(st.medium.tier(), Tier::Device);
            let EngineEvent::Stored(cpu) = &b.events[1] else {
                panic!()
            };
            assert_eq!((cpu.token_ids.len(), cpu.medium.tier()), (0, Tier::Host));
            assert_eq!(
                b.events[2],
                EngineEvent::Removed {
                    hashes: vec![h(u64::MAX - 3)],
                    medium: Medium::Other("STORAGE".into()),
                    group: None
                }
            );
            assert_eq!(b.events[3], EngineEvent::Cleared);
        }
    }
}

/// The shape of a vLLM 0.26 batch as captured off the wire (kthena issue #1535): tagged
/// maps, an unsigned hash above `i64::MAX`, the hybrid-model fields, a positional batch.
#[test]
fn a_vllm_tagged_map_batch_with_hybrid_fields() {
    let stored = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", ints(&[15760518052499183552])),
        ("parent_block_hash", Value::Nil),
        ("token_ids", ints(&(0..16).collect::<Vec<_>>())),
        ("block_size", Value::from(16)),
        ("lora_id", Value::Nil),
        ("medium", s("GPU")),
        ("lora_name", Value::Nil),
        ("extra_keys", Value::Array(vec![Value::Nil])),
        ("group_idx", Value::from(1)),
        ("kv_cache_spec_kind", s("sliding_window")),
        ("kv_cache_spec_sliding_window", Value::from(128)),
        ("locality", s("LOCAL")),
    ]);
    let batch = Value::Array(vec![
        Value::F64(1789095808.83),
        Value::Array(vec![stored]),
        Value::from(0),
    ]);
    let b = decode_batch(&encode(&batch)).unwrap();
    let EngineEvent::Stored(st) = &b.events[0] else {
        panic!()
    };
    assert_eq!(st.hashes, vec![EngineHash(15760518052499183552)]);
    assert_eq!(
        (st.group, st.spec_kind.as_deref()),
        (Some(1), Some("sliding_window"))
    );
    assert_eq!(st.extra_keys, vec![Vec::<ExtraKey>::new()]);
    assert_eq!(b.dp_rank, Some(0));
}

/// Older vLLM: positional events whose trailing defaults were omitted, and a batch with no
/// rank; SGLang: signed hashes, `CPU_PINNED`, and a metadata map at position 7.
#[test]
fn positional_events_old_vllm_and_sglang() {
    let old = Value::Array(vec![
        s("BlockStored"),
        ints(&[5]),
        Value::Nil,
        ints(&[1, 2]),
        Value::from(2),
        Value::Nil,
    ]);
    let removed = Value::Array(vec![s("BlockRemoved"), ints(&[5])]);
    let sglang = Value::Array(vec![
        s("BlockStored"),
        Value::Array(vec![Value::from(-42i64)]),
        Value::from(-7i64),
        ints(&[3, 4]),
        Value::from(2),
        Value::Nil,
        s("CPU_PINNED"),
        map(vec![("cache_salt", s("tenant-9"))]),
    ]);
    let batch = Value::Array(vec![
        Value::F64(1.0),
        Value::Array(vec![
            old,
            removed,
            sglang,
            Value::Array(vec![s("AllBlocksCleared")]),
        ]),
    ]);
    let b = decode_batch(&encode(&batch)).unwrap();
    assert_eq!(b.dp_rank, None);
    let EngineEvent::Stored(old) = &b.events[0] else {
        panic!()
    };
    assert_eq!(
        (old.medium.clone(), old.lora_name.clone()),
        (Medium::Gpu, None)
    );
    assert!(matches!(
        &b.events[1],
        EngineEvent::Removed {
            medium: Medium::Gpu,
            ..
        }
    ));
    let EngineEvent::Stored(sg) = &b.events[2] else {
        panic!()
    };
    assert_eq!(sg.hashes, vec![EngineHash(-42i64 as u64)]);
    assert_eq!(sg.parent, Some(EngineHash(-7i64 as u64)));
    assert_eq!(sg.medium.tier(), Tier::Host);
    assert_eq!(sg.cache_salt.as_deref(), Some("tenant-9"));
    assert_eq!(b.events[3], EngineEvent::Cleared);
}

/// SGLang's layout since it moved the salt out of the `lora_name` slot: every vLLM field
/// by position, then `locality`, `ownership` and (salted) a metadata map at 14; the salt
/// rides tagged in `extra_keys` (SGLang's unit tests of `sglang.srt.disaggregation.kv_events`,
/// `TestBlockStoredWireFormat`). Removals carry the same trailing slots.
#[test]
fn sglang_s_layout_with_its_salt_in_extra_keys_decodes() {
    let stored = Value::Array(vec![
        s("BlockStored"),
        ints(&[123]),
        Value::Nil,
        ints(&[1, 2]),
        Value::from(2),
        Value::Nil,
        s("GPU"),
        Value::Nil,
        Value::Array(vec![Value::Array(vec![s("dynamo-cache-salt:tenant-a")])]),
        Value::Nil,
        Value::Nil,
        Value::Nil,
        Value::Nil,
        Value::Nil,
        map(vec![("cache_salt", s("tenant-a"))]),
    ]);
    let mut removed = vec![s("BlockRemoved"), ints(&[123])];
    removed.extend(std::iter::repeat_n(Value::Nil, 6));
    let batch = Value::Array(vec![
        Value::F64(1.0),
        Value::Array(vec![stored, Value::Array(removed)]),
    ]);
    let b = decode_batch(&encode(&batch)).unwrap();
    let EngineEvent::Stored(st) = &b.events[0] else {
        panic!("{:?}", b.events)
    };
    assert_eq!(st.hashes, vec![EngineHash(123)]);
    assert_eq!(
        (st.lora_name.as_deref(), st.medium.tier()),
        (None, Tier::Device)
    );
    assert_eq!(
        st.extra_keys,
        vec![vec![ExtraKey::Str("dynamo-cache-salt:tenant-a".into())]]
    );
    assert!(
        matches!(&b.events[1], EngineEvent::Removed { hashes, .. } if hashes == &vec![EngineHash(123)])
    );
}

/// A digest sent as bytes names the block vLLM's int form of it names (the digest as a
/// big-endian int, masked to 64 bits): a GPU store sent with int hashes and the token-less
/// CPU store of the same block sent with bytes (vLLM's offloading connector before it
/// converted its hashes) meet in one mirror.
#[test]
fn a_bytes_hash_decodes_to_vllm_s_int_form_of_it() {
    // A 32-byte digest (sha256-sized); vLLM's int form: its last 8 bytes, big-endian.
    let digest: Vec<u8> = (0u8..32)
        .map(|i| i.wrapping_mul(37).wrapping_add(200))
        .collect();
    let int_form = u64::from_be_bytes(digest[24..].try_into().unwrap());
    let gpu = Value::Array(vec![
        s("BlockStored"),
        Value::Array(vec![Value::from(int_form)]),
        Value::Nil,
        ints(&[1, 2]),
        Value::from(2),
        Value::Nil,
    ]);
    let cpu = Value::Array(vec![
        s("BlockStored"),
        Value::Array(vec![Value::Binary(digest.clone())]),
        Value::Nil,
        Value::Array(Vec::new()),
        Value::from(0),
        Value::Nil,
        s("CPU"),
    ]);
    // A short one is an int too (msgpack would never carry it, but it decodes alike).
    let short = Value::Array(vec![
        s("BlockRemoved"),
        Value::Array(vec![Value::Binary(vec![1, 2])]),
    ]);
    let batch = Value::Array(vec![Value::F64(1.0), Value::Array(vec![gpu, cpu, short])]);
    let b = decode_batch(&encode(&batch)).unwrap();
    let (EngineEvent::Stored(gpu), EngineEvent::Stored(cpu)) = (&b.events[0], &b.events[1]) else {
        panic!("{:?}", b.events)
    };
    assert_eq!(gpu.hashes, vec![EngineHash(int_form)]);
    assert_eq!(cpu.hashes, gpu.hashes);
    assert_eq!(cpu.medium.tier(), Tier::Host);
    let EngineEvent::Removed { hashes, .. } = &b.events[2] else {
        panic!()
    };
    assert_eq!(hashes, &vec![EngineHash(0x0102)]);
}

/// SGLang with EAGLE keys its radix tree by bigrams and publishes each position as
/// (token, next token): the page's tokens are the first elements. vLLM before `lora_name`
/// sends `lora_id` alone.
#[test]
fn bigram_tokens_and_a_bare_lora_id_decode() {
    let pair = |a: u64, b: u64| Value::Array(vec![Value::from(a), Value::from(b)]);
    let eagle = Value::Array(vec![
        s("BlockStored"),
        ints(&[5]),
        Value::Nil,
        Value::Array(vec![pair(10, 11), pair(11, 12)]),
        Value::from(2),
        Value::Nil,
        s("GPU"),
    ]);
    let lora = Value::Array(vec![
        s("BlockStored"),
        ints(&[6]),
        Value::Nil,
        ints(&[1, 2]),
        Value::from(2),
        Value::from(4),
        s("GPU"),
    ]);
    let batch = Value::Array(vec![Value::F64(1.0), Value::Array(vec![eagle, lora])]);
    let b = decode_batch(&encode(&batch)).unwrap();
    let EngineEvent::Stored(eagle) = &b.events[0] else {
        panic!()
    };
    assert_eq!(eagle.token_ids, vec![10, 11]);
    assert_eq!(eagle.lora_id, None);
    let EngineEvent::Stored(lora) = &b.events[1] else {
        panic!()
    };
    assert_eq!((lora.lora_id, lora.lora_name.as_deref()), (Some(4), None));
    // A triple is not a token.
    let bad = Value::Array(vec![
        Value::F64(1.0),
        Value::Array(vec![Value::Array(vec![
            s("BlockStored"),
            ints(&[5]),
            Value::Nil,
            Value::Array(vec![Value::Array(vec![
                Value::from(1),
                Value::from(2),
                Value::from(3),
            ])]),
            Value::from(1),
        ])]),
    ]);
    assert!(matches!(
        &decode_batch(&encode(&bad)).unwrap().events[0],
        EngineEvent::Malformed { tag: Some(t), .. } if t == "BlockStored"
    ));
}

#[test]
fn extra_keys_keep_strings_apart_from_other_keys() {
    let stored = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", ints(&[1, 2])),
        ("parent_block_hash", Value::Nil),
        ("token_ids", ints(&[1, 2, 3, 4])),
        ("block_size", Value::from(2)),
        ("lora_id", Value::Nil),
        ("medium", s("GPU")),
        ("lora_name", s("a")),
        (
            "extra_keys",
            Value::Array(vec![
                Value::Array(vec![s("a"), s("salt")]),
                Value::Array(vec![Value::Array(vec![s("img"), Value::from(0)])]),
            ]),
        ),
    ]);
    let batch = Value::Array(vec![Value::F64(0.0), Value::Array(vec![stored])]);
    let b = decode_batch(&encode(&batch)).unwrap();
    let EngineEvent::Stored(st) = &b.events[0] else {
        panic!()
    };
    assert_eq!(
        st.extra_keys[0],
        vec![ExtraKey::Str("a".into()), ExtraKey::Str("salt".into())]
    );
    assert!(matches!(st.extra_keys[1].as_slice(), [ExtraKey::Other(_)]));
}

/// An event that does not decode costs only itself: it is kept as malformed, with its tag
/// and the reason, and the events around it decode.
#[test]
fn a_bad_event_is_malformed_and_the_rest_of_its_batch_decodes() {
    let good = Value::Array(vec![s("AllBlocksCleared")]);
    let cases: Vec<(Value, Option<&str>, &str)> = vec![
        (
            Value::Array(vec![
                s("BlockStored"),
                ints(&[1]),
                Value::Nil,
                ints(&[1 << 40]),
                Value::from(1),
            ]),
            Some("BlockStored"),
            "token_ids",
        ),
        (
            Value::Array(vec![s("BlockRemoved"), Value::Array(vec![Value::F64(1.0)])]),
            Some("BlockRemoved"),
            "neither an int nor bytes",
        ),
        (
            map(vec![
                ("type", s("BlockRemoved")),
                ("block_hashes", ints(&[1])),
                ("group_idx", Value::from(1000)),
            ]),
            Some("BlockRemoved"),
            "group_idx",
        ),
        (Value::from(7), None, "tagged"),
    ];
    for (event, tag, why) in cases {
        let batch = Value::Array(vec![
            Value::F64(0.0),
            Value::Array(vec![good.clone(), event, good.clone()]),
        ]);
        let b = decode_batch(&encode(&batch)).unwrap();
        assert_eq!(b.events.len(), 3);
        assert_eq!(b.events[0], EngineEvent::Cleared);
        assert_eq!(b.events[2], EngineEvent::Cleared);
        let EngineEvent::Malformed { tag: got, error } = &b.events[1] else {
            panic!("{why}: {:?}", b.events[1]);
        };
        assert_eq!(got.as_deref(), tag);
        assert!(
            error.contains(why) && error.starts_with("event 1:"),
            "{error:?} should say {why:?}"
        );
    }
}

#[test]
fn bad_payloads_are_refused_with_a_reason() {
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (vec![0x92, 0xcb], "msgpack"),
        (encode(&Value::from(1)), "batch is an array"),
        (
            [
                encode(&Value::Array(vec![Value::F64(0.0), Value::Array(vec![])])),
                vec![0],
            ]
            .concat(),
            "after the batch",
        ),
    ];
    for (payload, why) in cases {
        let err = decode_batch(&payload).unwrap_err().to_string();
        assert!(err.contains(why), "{err:?} should say {why:?}");
    }
    assert_eq!(
        decode_batch(&vec![0; MAX_PAYLOAD_BYTES + 1]),
        Err(WireError::TooLarge(MAX_PAYLOAD_BYTES + 1))
    );
    // Nesting deeper than any engine writes.
    let mut deep = Value::Nil;
    for _ in 0..100 {
        deep = Value::Array(vec![deep]);
    }
    assert!(matches!(
        decode_batch(&encode(&deep)),
        Err(WireError::Msgpack(_))
    ));
}

/// A payload of one-byte values is refused before it is decoded into a tree 32 times its
/// size; the walk counts every container and element of every encoding as rmpv reads them.
#[test]
fn a_payload_of_too_many_values_is_refused_before_decoding() {
    // [0.0, [nil × MAX_VALUES]]: 2 MiB of bytes, a 64 MiB tree.
    let mut payload = vec![0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd];
    payload.extend((MAX_VALUES as u32).to_be_bytes());
    payload.resize(payload.len() + MAX_VALUES, 0xc0);
    assert_eq!(decode_batch(&payload), Err(WireError::TooManyValues));
    // The count is exact: every value of every kind counts once.
    let every_kind = Value::Array(vec![
        Value::Nil,
        Value::Boolean(true),
        Value::from(7),
        Value::from(-3),
        Value::from(300),
        Value::from(70_000),
        Value::from(1u64 << 40),
        Value::from(-(1i64 << 40)),
        Value::F32(1.5),
        Value::F64(2.5),
        s("short"),
        s(&"x".repeat(300)),
        s(&"y".repeat(70_000)),
        Value::Binary(vec![1; 40]),
        Value::Binary(vec![1; 300]),
        Value::Binary(vec![1; 70_000]),
        Value::Ext(1, vec![0; 1]),
        Value::Ext(1, vec![0; 16]),
        Value::Ext(1, vec![0; 3]),
        Value::Ext(1, vec![0; 300]),
        Value::Ext(1, vec![0; 70_000]),
        ints(&[1, 2, 3]),
        Value::Array(vec![Value::Nil; 20]),
        Value::Array(vec![Value::Nil; 70_000]),
        map(vec![("a", Value::Nil), ("b", Value::from(1))]),
        Value::Map(vec![(Value::Nil, Value::Nil); 20]),
        Value::Map(vec![(Value::Nil, Value::Nil); 70_000]),
    ]);
    let bytes = encode(&every_kind);
    let values = 1 + 21 + (1 + 3) + (1 + 20) + (1 + 70_000) + (1 + 4) + (1 + 40) + (1 + 140_000);
    assert_eq!(count_values(&bytes, values), Ok(()));
    assert_eq!(
        count_values(&bytes, values - 1),
        Err(WireError::TooManyValues)
    );
    // A cut-off payload is refused, not read past its end.
    for cut in [1, 5, bytes.len() / 2, bytes.len() - 1] {
        assert!(matches!(
            count_values(&bytes[..cut], usize::MAX),
            Err(WireError::Msgpack(_))
        ));
    }
}

/// An event of a kind kvroute does not know (a fork's) is kept as `Other` with its tag, and
/// the events around it decode: the batch is not refused for it.
#[test]
fn an_unknown_event_kind_does_not_refuse_its_batch() {
    let batch = Value::Array(vec![
        Value::F64(0.0),
        Value::Array(vec![
            Value::Array(vec![s("CacheStoreCommitted"), ints(&[1])]),
            Value::Map(vec![(s("type"), s("TransferInitiated"))]),
            Value::Array(vec![s("AllBlocksCleared")]),
        ]),
    ]);
    let b = decode_batch(&encode(&batch)).unwrap();
    assert_eq!(
        b.events,
        vec![
            EngineEvent::Other("CacheStoreCommitted".into()),
            EngineEvent::Other("TransferInitiated".into()),
            EngineEvent::Cleared,
        ]
    );
    // A tag is kept to 64 characters.
    let long = Value::Array(vec![
        Value::F64(0.0),
        Value::Array(vec![Value::Array(vec![s(&"x".repeat(1000))])]),
    ]);
    let b = decode_batch(&encode(&long)).unwrap();
    assert_eq!(b.events, vec![EngineEvent::Other("x".repeat(64))]);
}

/// A batch of more events than one engine step makes is refused before any is decoded
/// (2 M nils, 2 MB, decoded into 0.5 GB of malformed events), and an event costs at most
/// 64 B in the batch (a store is boxed). Control: `MAX_EVENTS` nils decode, each malformed.
#[test]
fn a_batch_of_too_many_events_is_refused() {
    assert!(std::mem::size_of::<EngineEvent>() <= 64);
    let nils = |n: usize| {
        let mut payload = vec![0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd];
        payload.extend((n as u32).to_be_bytes());
        payload.resize(payload.len() + n, 0xc0);
        payload
    };
    assert!(matches!(
        decode_batch(&nils(MAX_EVENTS + 1)),
        Err(WireError::Shape(reason)) if reason.contains("events, more than")
    ));
    let batch = decode_batch(&nils(MAX_EVENTS)).unwrap();
    assert_eq!(batch.events.len(), MAX_EVENTS);
    assert!(
        batch
            .events
            .iter()
            .all(|e| matches!(e, EngineEvent::Malformed { .. }))
    );
}

/// Media name tiers: SGLang's `EXTERNAL` (L4, a shared or remote pool such as Mooncake) is
/// the remote tier, apart from `DISK` and vLLM's `STORAGE` (L3), so an L3 eviction does not
/// take an L4 copy with it; `CPU_TIER2` (SGLang's L3, Dynamo's disk tier) is not host
/// memory.
#[test]
fn media_name_their_tiers() {
    for (name, tier) in [
        (None, Tier::Device),
        (Some("GPU"), Tier::Device),
        (Some("DEVICE"), Tier::Device),
        (Some("CPU"), Tier::Host),
        (Some("CPU_PINNED"), Tier::Host),
        (Some("CPU_TIER1"), Tier::Host),
        (Some("cpu"), Tier::Host),
        (Some("CPU_TIER2"), Tier::Disk),
        (Some("NVME"), Tier::Disk),
        (Some("DISK"), Tier::Disk),
        (Some("NETWORK"), Tier::Remote),
        (Some("STORAGE"), Tier::Disk),
        (Some("EXTERNAL"), Tier::Remote),
        (Some("REMOTE"), Tier::Remote),
    ] {
        assert_eq!(Medium::parse(name).tier(), tier, "{name:?}");
    }
}
