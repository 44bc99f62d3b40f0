//! Real engines behind kvroute (DESIGN §12): vLLM's and SGLang's KV events as they come off
//! their ZMQ sockets, decoded ([`wire`]), turned into kvroute block changes ([`mirror`]) and
//! read from the engine over ZMTP ([`zmtp`]) by the ingest task ([`ingest`]) that the sidecar
//! and the router's direct mode share.

pub mod approx;
pub mod ingest;
pub mod metrics;
pub mod mirror;
pub mod publisher;
pub mod wire;
pub mod zmtp;

pub use mirror::{EngineMirror, MirrorStats, SeqCheck, SeqTracker, engine_salt};
pub use wire::{EngineBatch, EngineEvent, EngineHash, Medium, WireError, decode_batch};
