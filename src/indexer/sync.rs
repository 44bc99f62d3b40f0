//! The synchronisation primitives of the indexer's protocols: std/parking_lot normally, loom's
//! under `--cfg kvroute_loom` so the model checker explores every interleaving of the same
//! code.

#[cfg(kvroute_loom)]
pub(crate) use loom::sync::Arc;
#[cfg(kvroute_loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
#[cfg(not(kvroute_loom))]
pub(crate) use std::sync::Arc;
#[cfg(not(kvroute_loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

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

    /// The lock if no one holds it.
    pub(crate) fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
        #[cfg(kvroute_loom)]
        return self.inner.try_lock().ok();
        #[cfg(not(kvroute_loom))]
        return self.inner.try_lock();
    }
}

/// What [`ArcCell::load`] lends: an `arc-swap` guard (its debt slot), or under loom an `Arc`.
#[cfg(not(kvroute_loom))]
pub(crate) type Loaded<T> = arc_swap::Guard<Arc<T>>;
/// What [`ArcCell::load`] lends: an `arc-swap` guard (its debt slot), or under loom an `Arc`.
#[cfg(kvroute_loom)]
pub(crate) type Loaded<T> = Arc<T>;

/// A shared pointer that writers replace and readers load without a lock: `arc-swap`
/// normally (readers borrow through its debt slots, no refcount traffic on the fast path;
/// the old value is freed when its last reader lets go). Under loom, a mutex around an `Arc`
/// stands in (loom cannot see inside arc-swap); the models check our protocol on top of it.
#[derive(Debug)]
pub(crate) struct ArcCell<T> {
    #[cfg(kvroute_loom)]
    inner: loom::sync::Mutex<Arc<T>>,
    #[cfg(not(kvroute_loom))]
    inner: arc_swap::ArcSwap<T>,
}

impl<T> ArcCell<T> {
    pub(crate) fn new(value: Arc<T>) -> Self {
        #[cfg(kvroute_loom)]
        return ArcCell {
            inner: loom::sync::Mutex::new(value),
        };
        #[cfg(not(kvroute_loom))]
        return ArcCell {
            inner: arc_swap::ArcSwap::new(value),
        };
    }

    /// A borrow of the current value, for a short read.
    #[cfg(not(kvroute_loom))]
    pub(crate) fn load(&self) -> Loaded<T> {
        self.inner.load()
    }

    /// A borrow of the current value, for a short read.
    #[cfg(kvroute_loom)]
    pub(crate) fn load(&self) -> Loaded<T> {
        Arc::clone(
            &self
                .inner
                .lock()
                .expect("invariant: no thread panics holding an indexer lock"),
        )
    }

    /// Replaces the value and returns the one it replaced (a release: stores before it are
    /// visible to later loads).
    pub(crate) fn swap(&self, value: Arc<T>) -> Arc<T> {
        #[cfg(kvroute_loom)]
        return std::mem::replace(
            &mut *self
                .inner
                .lock()
                .expect("invariant: no thread panics holding an indexer lock"),
            value,
        );
        #[cfg(not(kvroute_loom))]
        return self.inner.swap(value);
    }
}
