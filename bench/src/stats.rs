//! Summaries of measured distributions, and facts about the process.

use serde::Serialize;

/// p50 / p90 / p99 / mean of a sample.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Summary {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Mean.
    pub mean: f64,
}

impl Summary {
    /// Summarises `values` (sorted in place); zeros for an empty sample.
    pub fn of(values: &mut [f64]) -> Summary {
        if values.is_empty() {
            return Summary::default();
        }
        // Unstable is as good as stable under a total order, and faster.
        values.sort_unstable_by(f64::total_cmp);
        // Nearest-rank percentile.
        let rank =
            |p: f64| values[((p * values.len() as f64).ceil() as usize).clamp(1, values.len()) - 1];
        Summary {
            p50: rank(0.50),
            p90: rank(0.90),
            p99: rank(0.99),
            mean: values.iter().sum::<f64>() / values.len() as f64,
        }
    }

    /// As [`Summary::of`], with the percentiles found by selection instead of a full sort
    /// (for millions of samples, such as a replay's inter-token gaps): the same nearest
    /// ranks; the mean is summed in the given order. Leaves `values` partly reordered.
    pub fn of_unsorted(values: &mut [f64]) -> Summary {
        let n = values.len();
        if n == 0 {
            return Summary::default();
        }
        let mean = values.iter().sum::<f64>() / n as f64;
        let rank = |p: f64| ((p * n as f64).ceil() as usize).clamp(1, n) - 1;
        // Each selection leaves everything above its rank to its right: the next, higher
        // rank is selected among those only.
        let mut from = 0;
        let mut select = |r: usize| {
            let (_, v, _) = values[from..].select_nth_unstable_by(r - from, f64::total_cmp);
            let v = *v;
            from = r;
            v
        };
        let (p50, p90, p99) = (select(rank(0.50)), select(rank(0.90)), select(rank(0.99)));
        Summary {
            p50,
            p90,
            p99,
            mean,
        }
    }
}

/// Peak resident set of this process (VmHWM), bytes; 0 where /proc is unavailable.
pub fn peak_rss_bytes() -> u64 {
    status_bytes("VmHWM:")
}

/// Samples this process's RSS every 10 ms on a thread of its own until the returned guard
/// is finished, and gives the largest reading. (Resetting the kernel's high-water mark
/// through /proc/self/clear_refs instead left the process's later work about 30 % slower on
/// this VM.)
pub fn sample_peak_rss() -> PeakRss {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let thread = {
        let stop = std::sync::Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut peak = rss_bytes();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(std::time::Duration::from_millis(10));
                peak = peak.max(rss_bytes());
            }
            peak
        })
    };
    PeakRss { stop, thread }
}

/// A running [`sample_peak_rss`].
pub struct PeakRss {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<u64>,
}

impl PeakRss {
    /// Stops sampling; the largest RSS read, bytes.
    pub fn finish(self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap_or(0)
    }
}

/// Resident set of this process now (VmRSS), bytes; 0 where /proc is unavailable.
pub fn rss_bytes() -> u64 {
    status_bytes("VmRSS:")
}

/// CPU time this process has used so far, user plus system, seconds (from /proc/self/stat,
/// at the kernel's usual 100 ticks a second); 0 where /proc is unavailable.
pub fn cpu_seconds() -> f64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            // Fields after the command name, which is in parentheses and may hold spaces:
            // utime and stime are the 12th and 13th of them.
            let rest = &s[s.rfind(')')? + 1..];
            let mut fields = rest.split_whitespace().skip(11);
            let user: u64 = fields.next()?.parse().ok()?;
            let system: u64 = fields.next()?.parse().ok()?;
            Some((user + system) as f64 / 100.0)
        })
        .unwrap_or(0.0)
}

/// Resident set of this process (VmRSS) after waiting `settle_ms` for the allocator to return
/// what was just freed, bytes.
pub fn settled_rss_bytes(settle_ms: u64) -> u64 {
    std::thread::sleep(std::time::Duration::from_millis(settle_ms));
    rss_bytes()
}

/// The binaries' allocator options, as reports record them: jemalloc's built-in options
/// (`.cargo/config.toml`), those from `_RJEM_MALLOC_CONF`, and `GLIBC_TUNABLES` (for the
/// C allocations that still go through glibc).
pub fn allocator_options() -> String {
    let var = |name: &str| std::env::var(name).unwrap_or_default();
    format!(
        "jemalloc built-in {:?}, _RJEM_MALLOC_CONF {:?}, GLIBC_TUNABLES {:?}",
        option_env!("JEMALLOC_SYS_WITH_MALLOC_CONF").unwrap_or(""),
        var("_RJEM_MALLOC_CONF"),
        var("GLIBC_TUNABLES")
    )
}

/// Anonymous resident memory of this process now (RssAnon: heap and other private memory,
/// not the binary's code pages), bytes; 0 where /proc is unavailable.
pub fn rss_anon_bytes() -> u64 {
    status_bytes("RssAnon:")
}

/// A kB field of /proc/self/status, in bytes.
fn status_bytes(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_binaries_allocator_is_built_to_return_memory() {
        // `.cargo/config.toml` builds these options into jemalloc; without them freed pages
        // stay resident for 10 s, or as MADV_FREE pages that still count in RSS.
        let conf = option_env!("JEMALLOC_SYS_WITH_MALLOC_CONF").unwrap_or("");
        for option in [
            "background_thread:true",
            "dirty_decay_ms:1000",
            "muzzy_decay_ms:0",
        ] {
            assert!(conf.contains(option), "{option} missing from {conf:?}");
        }
        assert!(allocator_options().contains(conf));
    }

    #[test]
    fn nearest_rank_percentiles() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        let s = Summary::of(&mut v);
        assert_eq!((s.p50, s.p90, s.p99, s.mean), (50.0, 90.0, 99.0, 50.5));
        assert_eq!(Summary::of(&mut []), Summary::default());
    }

    #[test]
    fn selection_finds_the_sorted_ranks() {
        let mut x = 7u64;
        for n in [1usize, 2, 3, 10, 99, 100, 101, 1000, 4097] {
            let mut v: Vec<f64> = (0..n)
                .map(|_| {
                    x = crate::trace::mix(x);
                    (x % 1000) as f64 / 7.0
                })
                .collect();
            let mut sorted = v.clone();
            let (a, b) = (Summary::of(&mut sorted), Summary::of_unsorted(&mut v));
            assert_eq!((a.p50, a.p90, a.p99), (b.p50, b.p90, b.p99), "n = {n}");
            assert!((a.mean - b.mean).abs() <= 1e-9 * a.mean.abs(), "n = {n}");
        }
        assert_eq!(Summary::of_unsorted(&mut []), Summary::default());
    }
}
