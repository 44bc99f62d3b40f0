//! kvroute's worker core: everything a worker does except the network and the GPU.
//!
//! - [`block_manager`]: G1 (device) and G2 (host) block pools, prefix cache, eviction
//!   policies, RAII leases, and the G1↔G2 transfers of [`offload`].
//! - [`offload`]: the copy engine between tiers: a processor-sharing link model for timing
//!   and, in byte mode, real block bytes in the paged layout the GPU path uses.
//! - [`engine`]: continuous batching (chunked prefill, preemption, prefix reuse) with step
//!   times from a timing model, on an injected clock.
//! - [`publisher`]: turns block-manager changes into gap-free KV event batches and answers
//!   snapshot requests.
//! - [`plane`] (I/O): publishes the batches over the event plane's transport and serves
//!   snapshot requests.
//!
//! - [`server`] (I/O): the worker process: engine on wall time, HTTP generate endpoint,
//!   event plane.
//! - [`bridge`] (I/O): a real engine (vLLM, SGLang) as a worker: its ZMQ KV events
//!   republished with epochs, ids and snapshots, its registration tied to its health.
//! - [`emulate`] (I/O): the test engine: the simulated engine speaking vLLM's or SGLang's
//!   wire formats.
//!
//! All of it but `plane`, `server` and `bridge` is sans-I/O: the replay bench drives it on a
//! virtual clock, the worker server on wall time.
//!
//! # What blocks the engine's thread
//! The engine runs on its own OS thread ([`server`]); it sleeps only until its next wake-up
//! or input. With `--device cuda:N` it never waits for a copy: offload and onboard are
//! queued on a copy stream, their completion (and each onboarded block's verification,
//! a kernel queued behind the copy) is an event query at the time the link model says they
//! end, re-polled every [`block_manager::DEVICE_POLL_US`] while the device is behind
//! (`kvroute_worker_copies_late_total`). Nothing it queues uploads descriptors: fills,
//! gathers, scatters and verifications take their slots as kernel parameters. It may still
//! block briefly in the driver: a launch or a copy queued is a driver call (a one-block fill
//! takes a median 5 µs of the thread on an H100, p99 14–45 µs; queuing a one-block transfer
//! 9–16 µs over the runs so far: `kvroute-bench kernels`), and the first checked onboard larger than any
//! before it page-locks a result buffer. Opening the device (NVRTC compile, allocations) and
//! dropping it (synchronising its streams) block, at start and at exit only. With bytes in
//! host memory (`--device cpu`, byte mode), copies and checks are `memcpy`s and comparisons on the
//! engine's thread, timed by the link model, not by how long they take.
#![forbid(unsafe_code)]

pub mod block_manager;
pub mod bridge;
pub mod config;
pub mod emulate;
pub mod engine;
pub mod offload;
pub mod plane;
pub mod publisher;
pub mod server;

pub use config::{Device, EngineConfig};
