//! The synchronisation primitives of the indexer's protocols: std/parking_lot normally, loom's
//! under `--cfg kvroute_loom` so the model checker explores every interleaving of the same
//! code.

#[cfg(kvroute_loom)]
pub(crate) use loom::sync::Arc;
#[cfg(kvroute_loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering};
#[cfg(not(kvroute_loom))]
pub(crate) use std::sync::Arc;
#[cfg(not(kvroute_loom))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// A mutex whose `lock` cannot fail (poisoning is not a state the indexer recovers from).
#[derive(Debug, Default)]
pub(crate) struct Mutex<T> {
    #[cfg(kvroute_loom)]
    inner: loom::sync::Mutex<T>,
    #[cfg(not(kvroute_loom))]
    inner: parking_lot::Mutex<T>,
}

#[cfg(kvroute_loom)]
pub(crate) type MutexGuard<'a, T> = loom::sync::MutexGuard<'a, T>;
#[cfg(not(kvroute_loom))]
pub(crate) type MutexGuard<'a, T> = parking_lot::MutexGuard<'a, T>;

impl<T> Mutex<T> {
    pub(crate) fn new(value: T) -> Self {
        #[cfg(kvroute_loom)]
        return Mutex {
            inner: loom::sync::Mutex::new(value),
        };
        #[cfg(not(kvroute_loom))]
        return Mutex {
            inner: parking_lot::Mutex::new(value),
        };
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        #[cfg(kvroute_loom)]
        return self
            .inner
            .lock()
            .expect("invariant: no thread panics holding an indexer lock");
        #[cfg(not(kvroute_loom))]
        return self.inner.lock();
    }
}
