//! CI's share of the fuzzing: 10⁵ structure-aware and raw inputs per decoder, zero panics
//! (`kvroute-bench fuzz --inputs N` runs more).
#![allow(missing_docs, clippy::unwrap_used)]

use kvroute_bench::fuzz::{TARGETS, fuzz_target};

#[test]
fn no_decoder_panics_on_100k_inputs() {
    let inputs = std::env::var("KVROUTE_FUZZ_INPUTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let dir = std::env::temp_dir().join("kvroute-fuzz-crashes");
    let reports: Vec<_> = TARGETS
        .iter()
        .map(|t| fuzz_target(t, inputs, 7, Some(&dir)))
        .collect();
    for r in &reports {
        println!(
            "{}: {} inputs, {} accepted, {} panics, largest {} B, {:.1} s",
            r.target, r.inputs, r.accepted, r.panics, r.max_input_bytes, r.seconds
        );
        assert!(r.accepted > 0, "{}: no input was ever valid", r.target);
    }
    let panics: u64 = reports.iter().map(|r| r.panics).sum();
    assert_eq!(panics, 0, "panicking inputs are in {}", dir.display());
}
