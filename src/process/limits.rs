//! The process's open-files limit. A container's soft `RLIMIT_NOFILE` is often 1024 while
//! the HTTP server admits 10,000 connections and each proxied request holds a second socket
//! to its worker: past the soft limit every `accept` and every connection to a worker fails
//! with EMFILE. The soft limit may be raised to the hard one without privileges, as Go's
//! runtime does at start (since Go 1.19) and nginx's `worker_rlimit_nofile` does.

/// Descriptors a process needs to serve `connections` client connections: one socket each,
/// another to the worker a request is proxied to, and a reserve for everything else
/// (listeners, NATS, engine event sockets, files).
pub fn descriptors_for(connections: usize) -> u64 {
    (connections as u64).saturating_mul(2).saturating_add(1024)
}

/// Raises the soft open-files limit to the hard one and logs it; warns, naming what to
/// change, when the limit is still below what serving `connections` client connections
/// needs ([`descriptors_for`]). Does nothing where the limit cannot be read (not on Unix).
pub fn raise_open_files_limit(connections: usize) {
    let needed = descriptors_for(connections);
    let Some((was, hard)) = sys::get() else {
        return;
    };
    let now = if was < hard {
        match sys::raise_soft(hard) {
            Ok(now) => now,
            Err(e) => {
                tracing::warn!(error = %e, soft = was, hard, "could not raise the open-files limit");
                was
            }
        }
    } else {
        was
    };
    if now != was {
        tracing::info!(was, now, hard, "open-files limit raised");
    }
    if now < needed {
        tracing::warn!(
            limit = now,
            needed,
            "the open-files limit is below what the connection cap needs: connections past it \
             fail with EMFILE; raise the hard limit (ulimit -Hn, the container runtime's nofile) \
             or lower --max-connections"
        );
    }
}

/// The system calls, through the `rlimit` crate (this crate forbids `unsafe`).
mod sys {
    use rlimit::Resource;

    /// The soft and hard `RLIMIT_NOFILE` (infinity reads as `u64::MAX`); `None` where the
    /// platform has none.
    pub fn get() -> Option<(u64, u64)> {
        if !Resource::NOFILE.is_supported() {
            return None;
        }
        Resource::NOFILE.get().ok()
    }

    /// Raises the soft `RLIMIT_NOFILE` towards `soft`, keeping the hard one; returns what it
    /// is now. Where the hard limit is unlimited (macOS) the kernel refuses an unlimited
    /// soft one: the rlimit crate caps it at what the kernel allows a process
    /// (`kern.maxfilesperproc`), where setting it whole failed and left the soft limit at
    /// 256.
    pub fn raise_soft(soft: u64) -> std::io::Result<u64> {
        rlimit::increase_nofile_limit(soft)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserve_covers_two_sockets_a_connection() {
        assert_eq!(descriptors_for(10_000), 21_024);
        assert_eq!(descriptors_for(usize::MAX), u64::MAX);
    }
}
