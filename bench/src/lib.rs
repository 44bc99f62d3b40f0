//! kvroute's benchmarks. The criterion suites live in `benches/kvroute.rs` (one entry, names
//! read as paths: `protocol/hash/...`); the system benches are subcommands of the
//! `kvroute-bench` binary, built from these modules:
//!
//! - [`trace`]: Mooncake traces and their synthesised prompts.
//! - [`fleet`]: W worker engines on one virtual clock.
//! - [`events_load`]: `kvroute-bench events`, the event plane over loopback NATS.
//! - [`indexer_load`]: `kvroute-bench indexer`, the index under a real event stream.
//! - [`replay`]: `kvroute-bench replay`, routing policies compared on a trace.
//! - [`online`]: `kvroute-bench online`, a trace against a live endpoint.
//! - [`report`]: report types the replay and the online run share.
//! - [`fuzz`]: `kvroute-bench fuzz`, every decoder of network and file input.
//! - [`plot`]: the SVG of a replay report.
//! - [`soak`]: `kvroute-bench soak`, a chaos soak over real processes.
//! - [`stats`]: percentiles and process facts.
#![forbid(unsafe_code)]

pub mod engines_load;
pub mod events_load;
pub mod fleet;
pub mod fuzz;
pub mod indexer_load;
pub mod kernels_load;
pub mod online;
pub mod plot;
pub mod replay;
pub mod report;
pub mod soak;
pub mod stats;
pub mod trace;
