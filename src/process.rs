//! What both binaries do as processes: log (text, with colour only on a terminal, or one
//! JSON object a line for collectors; filtered by `RUST_LOG`, default `info`) and hear the
//! signals that end them.

pub mod limits;
pub mod series;

use std::io::IsTerminal;

pub use limits::raise_open_files_limit;
pub use series::Metrics;

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    /// Human-readable lines; ANSI colours only when stderr is a terminal.
    #[default]
    Text,
    /// One JSON object per line (timestamp, level, target, fields), for collectors.
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            _ => Err(format!("log format {s:?} is not text or json")),
        }
    }
}

/// Installs the global subscriber, writing to stderr. A second call does nothing.
pub fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter);
    let _ = match format {
        // Escape codes only where a person reads them: files and collectors get plain text.
        LogFormat::Text => builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init(),
        LogFormat::Json => builder.json().with_ansi(false).try_init(),
    };
}

/// SIGINT or SIGTERM, heard from the moment this is called: a watch that turns true.
/// Call it first thing: a process that is PID 1 in its container (kvroute's images) ignores
/// SIGTERM until a handler is installed, so a start-up waiting for NATS could otherwise not
/// be stopped before the kubelet's SIGKILL. Call inside the runtime.
pub fn signals() -> tokio::sync::watch::Receiver<bool> {
    let (tx, rx) = tokio::sync::watch::channel(false);
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        // Registered here, not at the first poll of a spawned task.
        if let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            tokio::spawn(async move {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
                let _ = tx.send(true);
                // A second signal (Ctrl-C again) does not wait for the drain: the operator
                // has asked twice.
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
                tracing::warn!("second signal: exiting without waiting for the drain");
                std::process::exit(130);
            });
            return rx;
        }
    }
    tokio::spawn(async move {
        terminated().await;
        let _ = tx.send(true);
    });
    rx
}

/// Resolves once `signals` ([`signals`]) has heard SIGINT or SIGTERM.
pub async fn signalled(signals: &tokio::sync::watch::Receiver<bool>) {
    let mut rx = signals.clone();
    let _ = rx.wait_for(|heard| *heard).await;
}

/// `work` (a start-up), unless SIGINT or SIGTERM comes first: then `None`, and the
/// caller exits without serving.
pub async fn unless_signalled<T>(
    signals: &tokio::sync::watch::Receiver<bool>,
    work: impl std::future::Future<Output = T>,
) -> Option<T> {
    tokio::select! {
        done = work => Some(done),
        () = signalled(signals) => {
            tracing::info!("terminated while starting");
            None
        }
    }
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM (what Kubernetes sends), heard from its first
/// poll ([`signals`] hears them from its call).
pub async fn terminated() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

/// How often the metrics recorder drains its histogram samples into their summaries.
const METRICS_UPKEEP: std::time::Duration = std::time::Duration::from_secs(5);

/// Bucket bounds of every histogram, seconds (TTFT, ITL, end to end, event lag, resync):
/// 0.5 ms to 2 min. Fixed buckets rather than summaries: replicas' histograms add up in
/// Prometheus, and a bucket count costs a few bytes where a summary's sketches grow and
/// churn the allocator with every new range of values (measured with heaptrack in the soak).
const LATENCY_BUCKETS_S: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0,
];

/// Installs the process's Prometheus recorder (for `/metrics`; per-worker series kept apart
/// so that they can be dropped: [`series`]) and its upkeep: without a periodic drain,
/// histogram samples pile up between scrapes, without bound if nobody scrapes. Call inside
/// the runtime. `None` if a recorder is already installed.
pub fn install_metrics() -> Option<Metrics> {
    let (metrics, recorder) = Metrics::new(LATENCY_BUCKETS_S)?;
    metrics::set_global_recorder(recorder).ok()?;
    let upkeep = metrics.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(METRICS_UPKEEP);
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    Some(metrics)
}

/// A warning said at most once per period, all callers together.
pub struct LogEvery {
    period: std::time::Duration,
    last: parking_lot::Mutex<Option<std::time::Instant>>,
}

impl LogEvery {
    /// Says at most once per `period`.
    pub const fn new(period: std::time::Duration) -> LogEvery {
        LogEvery {
            period,
            last: parking_lot::Mutex::new(None),
        }
    }

    /// Whether to say it now (and, if so, it counts as said).
    pub fn due(&self) -> bool {
        let now = std::time::Instant::now();
        let mut last = self.last.lock();
        if last.is_some_and(|at| now.duration_since(at) < self.period) {
            return false;
        }
        *last = Some(now);
        true
    }
}

#[cfg(test)]
mod log_every_tests {
    use super::LogEvery;

    /// Said once, then not again within the period.
    #[test]
    fn said_at_most_once_a_period() {
        let every = LogEvery::new(std::time::Duration::from_secs(3600));
        assert!(every.due());
        assert!(!every.due());
        assert!(!every.due());
        let always = LogEvery::new(std::time::Duration::ZERO);
        assert!(always.due() && always.due());
    }
}
