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
//! All of it but `plane`, `server` and `bridge` is sans-I/O: the replay bench drives it on a virtual clock, the
//! worker server on wall time.
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
