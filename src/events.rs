//! The event plane, router side: per-worker streams that turn KV event batches from the wire
//! into exact index updates, recovering from loss, duplication, reordering and restarts
//! ([`stream`], no I/O), driven by the [`plane`] over a [`transport`] (NATS or in-process);
//! and router replicas sharing their bookings ([`load`]).

pub mod load;
pub mod plane;
pub mod stream;
pub mod transport;
