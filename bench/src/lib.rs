//! kvroute's benchmarks. The criterion suites live in `benches/kvroute.rs` (one entry, names
//! read as paths: `protocol/hash/...`); system benches that replay traces are added as
//! binaries beside them.
#![forbid(unsafe_code)]
