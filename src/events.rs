//! The event plane, router side: per-worker streams that turn KV event batches from the wire
//! into exact index updates, recovering from loss, duplication, reordering and restarts
//! ([`stream`], no I/O), driven by the [`plane`] over a [`transport`] (NATS or in-process).

pub mod plane;
pub mod stream;
pub mod transport;
