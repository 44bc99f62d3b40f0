//! kvroute: the KV-aware ingress of an LLM inference fleet.
//!
//! Map of the router, following a request and a KV event through it (DESIGN §3):
//!
//! - [`protocol`]: the contract shared with workers. Ids, block hashing (xxh3, chained
//!   sequence hashes), the `EventBatch` KV-event model and its validated rkyv wire codec.
//!   No I/O.
//! - [`discovery`]: worker registrations (NATS KV, in-process, or a static list), validated
//!   as they arrive.
//! - [`events`]: the fleet state machine (which workers exist, leases, tombstones) and the
//!   per-worker event streams: ordering, gaps, epochs and the snapshot resync that keep the
//!   index an exact mirror of every worker's cache; replicas sharing their load.
//! - [`engines`]: vLLM's and SGLang's KV events (ZMQ, msgpack) turned into kvroute's, for the
//!   sidecar beside an engine and the router's direct mode.
//! - [`ingress`]: the HTTP front door: OpenAI API, routing, proxying with streamed relay,
//!   admin views and metrics; [`http`] is the server it runs on (shared with workers).
//! - [`auth`]: API keys, the admin token, NATS credentials and TLS.
//! - [`process`]: what both binaries do as processes: logs (text or JSON), signals.
//! - [`indexer`]: which blocks every worker holds in which tier (a hash-addressed radix tree
//!   with lower-tier continuations), and per request, each worker's reusable prefix. No I/O.
//! - [`scheduler`]: the cost of each worker for a request (prefix reuse against booked
//!   load), the routing policies, and the load bookings. No I/O.
//!
//! Request path: ingress → `protocol` hashing → indexer → scheduler → worker.
//! Event path: worker publisher → `protocol` codec → events task → indexer.
#![forbid(unsafe_code)]

pub mod auth;
pub mod discovery;
pub mod engines;
pub mod events;
pub mod http;
pub mod indexer;
pub mod ingress;
pub mod process;
pub mod protocol;
pub mod scheduler;
