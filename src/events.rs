//! The event plane, router side: the fleet of registered workers ([`fleet`], no I/O) and its
//! per-worker streams that turn KV event batches from the wire into exact index updates,
//! recovering from loss, duplication, reordering and restarts ([`stream`], no I/O), both
//! driven by the [`plane`] over a [`transport`] (NATS or in-process); and router replicas
//! sharing their bookings ([`load`]).

pub mod fleet;
pub mod load;
pub mod plane;
pub mod routed;
pub mod stream;
pub mod transport;
