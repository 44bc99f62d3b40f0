//! kvroute: the KV-aware ingress of an LLM inference fleet.
//!
//! Map of the router, following a request and a KV event through it (DESIGN §3):
//!
//! - [`protocol`]: the contract shared with workers. Ids, block hashing (xxh3, chained
//!   sequence hashes), the `EventBatch` KV-event model and its validated rkyv wire codec.
//!   No I/O.
//! - [`discovery`]: the fleet: worker registrations with a lease (NATS KV, in-process, or
//!   a static list).
//! - [`events`]: per-worker event streams: ordering, gaps, epochs and the snapshot resync
//!   that keep the index an exact mirror of every worker's cache.
//! - [`ingress`]: the HTTP front door: OpenAI API, routing, proxying with streamed relay,
//!   admin views and metrics.
//! - [`indexer`]: which blocks every worker holds in which tier (a hash-addressed radix tree
//!   with lower-tier continuations), and per request, each worker's reusable prefix. No I/O.
//! - [`scheduler`]: the cost of each worker for a request (prefix reuse against booked
//!   load), the routing policies, and the load bookings. No I/O.
//!
//! Request path: ingress → `protocol` hashing → indexer → scheduler → worker.
//! Event path: worker publisher → `protocol` codec → events task → indexer.
#![forbid(unsafe_code)]

pub mod discovery;
pub mod events;
pub mod indexer;
pub mod ingress;
pub mod protocol;
pub mod scheduler;
