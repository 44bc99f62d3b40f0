//! The process's metrics: the Prometheus exporter's recorder, except for series labelled
//! with a `worker`, which kvroute keeps itself so that they can go.
//!
//! The exporter never forgets a series (`metrics-rs/metrics#243`: there is no removal by
//! label, only an idle timeout that also drops a live series nobody touched lately and
//! orphans the handles callers keep). A router in front of a Deployment sees a new worker id
//! with every rescheduled pod, and each brought ~16 series (three 17-bucket histograms):
//! months of rollouts made every scrape carry thousands of dead workers. Here a worker's
//! series are dropped [`WORKER_SERIES_GRACE_MS`] after it leaves the fleet
//! ([`Metrics::sweep_workers`]); one that comes back within it keeps them.
//!
//! A metric name is either per worker (every series has a `worker` label) or not: the two
//! halves of `/metrics` each write their own `# TYPE` lines.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use metrics::{Counter, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, SharedString, Unit};
use metrics_exporter_prometheus::{PrometheusHandle, PrometheusRecorder};
use parking_lot::Mutex;

use crate::protocol::WorkerId;

/// How long a worker's series outlive its departure: longer than a scrape interval (its
/// last increments are scraped) and than a lease's brief lapse.
pub const WORKER_SERIES_GRACE_MS: u64 = 300_000;

/// The label that makes a series per worker.
const WORKER_LABEL: &str = "worker";

/// What `/metrics` renders: the exporter's series, then the per-worker ones.
#[derive(Clone)]
pub struct Metrics {
    handle: PrometheusHandle,
    workers: Arc<WorkerSeries>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics")
            .field("workers_with_series", &self.workers_with_series())
            .finish_non_exhaustive()
    }
}

impl Metrics {
    /// The recorder to install and what renders it. Histograms use `buckets` (seconds).
    pub fn new(buckets: &'static [f64]) -> Option<(Metrics, impl metrics::Recorder + 'static)> {
        let inner = metrics_exporter_prometheus::PrometheusBuilder::new()
            .set_buckets(buckets)
            .ok()?
            .build_recorder();
        let workers = Arc::new(WorkerSeries::new(buckets));
        let metrics = Metrics {
            handle: inner.handle(),
            workers: Arc::clone(&workers),
        };
        Some((metrics, Routed { inner, workers }))
    }

    /// The Prometheus text exposition of every series.
    pub fn render(&self) -> String {
        let mut text = self.handle.render();
        self.workers.render_into(&mut text);
        text
    }

    /// Drains histogram samples into their buckets (the exporter's half; call periodically).
    pub fn run_upkeep(&self) {
        self.handle.run_upkeep();
    }

    /// Drops the series of workers absent from `live` for [`WORKER_SERIES_GRACE_MS`].
    pub fn sweep_workers(&self, live: impl IntoIterator<Item = WorkerId>, now_ms: u64) {
        self.workers.sweep(live, now_ms);
    }

    /// Workers with series (present or in their grace period).
    pub fn workers_with_series(&self) -> usize {
        self.workers.state.lock().len()
    }
}

/// The installed recorder: per-worker keys to [`WorkerSeries`], the rest to the exporter.
struct Routed {
    inner: PrometheusRecorder,
    workers: Arc<WorkerSeries>,
}

fn worker_of(key: &Key) -> Option<&str> {
    key.labels()
        .find(|l| l.key() == WORKER_LABEL)
        .map(|l| l.value())
}

impl metrics::Recorder for Routed {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.inner.describe_counter(key, unit, description);
    }

    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.inner.describe_gauge(key, unit, description);
    }

    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, description: SharedString) {
        self.inner.describe_histogram(key, unit, description);
    }

    fn register_counter(&self, key: &Key, metadata: &Metadata<'_>) -> Counter {
        match worker_of(key) {
            Some(worker) => match self.workers.series(worker, key, Kind::Counter) {
                Series::Counter(c) => Counter::from_arc(c),
                _ => Counter::noop(),
            },
            None => self.inner.register_counter(key, metadata),
        }
    }

    fn register_gauge(&self, key: &Key, metadata: &Metadata<'_>) -> Gauge {
        match worker_of(key) {
            Some(worker) => match self.workers.series(worker, key, Kind::Gauge) {
                Series::Gauge(g) => Gauge::from_arc(g),
                _ => Gauge::noop(),
            },
            None => self.inner.register_gauge(key, metadata),
        }
    }

    fn register_histogram(&self, key: &Key, metadata: &Metadata<'_>) -> Histogram {
        match worker_of(key) {
            Some(worker) => match self.workers.series(worker, key, Kind::Histogram) {
                Series::Histogram(h) => Histogram::from_arc(h),
                _ => Histogram::noop(),
            },
            None => self.inner.register_histogram(key, metadata),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// One series' storage, shared with the handles callers hold.
#[derive(Clone)]
enum Series {
    Counter(Arc<AtomicU64>),
    /// The value's `f64` bits (the `metrics` crate's `GaugeFn` for `AtomicU64`).
    Gauge(Arc<AtomicU64>),
    Histogram(Arc<Buckets>),
}

impl Series {
    fn kind(&self) -> Kind {
        match self {
            Series::Counter(_) => Kind::Counter,
            Series::Gauge(_) => Kind::Gauge,
            Series::Histogram(_) => Kind::Histogram,
        }
    }
}

/// A worker's series, and since when it has been out of the fleet.
#[derive(Default)]
struct Worker {
    absent_since_ms: Option<u64>,
    series: BTreeMap<Key, Series>,
}

/// Every per-worker series, by worker label value.
struct WorkerSeries {
    buckets: &'static [f64],
    state: Mutex<BTreeMap<String, Worker>>,
}

impl WorkerSeries {
    fn new(buckets: &'static [f64]) -> Self {
        WorkerSeries {
            buckets,
            state: Mutex::new(BTreeMap::new()),
        }
    }

    /// The series of `key`, created if new. A key registered before as another kind gets a
    /// new storage of its kind in the caller's hands only (the first kind is rendered).
    fn series(&self, worker: &str, key: &Key, kind: Kind) -> Series {
        let mut state = self.state.lock();
        let w = match state.get_mut(worker) {
            Some(w) => w,
            None => state.entry(worker.to_owned()).or_default(),
        };
        if let Some(s) = w.series.get(key)
            && s.kind() == kind
        {
            return s.clone();
        }
        let made = match kind {
            Kind::Counter => Series::Counter(Arc::default()),
            Kind::Gauge => Series::Gauge(Arc::default()),
            Kind::Histogram => Series::Histogram(Arc::new(Buckets::new(self.buckets))),
        };
        w.series.entry(key.clone()).or_insert_with(|| made.clone());
        made
    }

    fn sweep(&self, live: impl IntoIterator<Item = WorkerId>, now_ms: u64) {
        let live: std::collections::BTreeSet<String> =
            live.into_iter().map(|w| w.to_string()).collect();
        self.state.lock().retain(|name, w| {
            if live.contains(name) {
                w.absent_since_ms = None;
                return true;
            }
            let since = *w.absent_since_ms.get_or_insert(now_ms);
            now_ms.saturating_sub(since) < WORKER_SERIES_GRACE_MS
        });
    }

    /// Appends the text exposition, each metric name's series together under one `# TYPE`.
    /// The series are copied out (handles: `Arc`s) and formatted with the lock let go:
    /// every request's latency metrics take it to find their series, and formatting a few
    /// hundred workers' histograms under it stalled them for the whole scrape.
    fn render_into(&self, out: &mut String) {
        let all: Vec<(Key, Series)> = {
            let state = self.state.lock();
            state
                .values()
                .flat_map(|w| w.series.iter().map(|(k, s)| (k.clone(), s.clone())))
                .collect()
        };
        let mut by_name: BTreeMap<&str, Vec<(&Key, &Series)>> = BTreeMap::new();
        for (key, series) in &all {
            by_name.entry(key.name()).or_default().push((key, series));
        }
        for (name, series) in by_name {
            let kind = match series[0].1.kind() {
                Kind::Counter => "counter",
                Kind::Gauge => "gauge",
                Kind::Histogram => "histogram",
            };
            let _ = writeln!(out, "# TYPE {name} {kind}");
            for (key, s) in series {
                let labels = labels(key);
                match s {
                    Series::Counter(c) => {
                        let _ = writeln!(out, "{name}{{{labels}}} {}", c.load(Ordering::Relaxed));
                    }
                    Series::Gauge(g) => {
                        let v = f64::from_bits(g.load(Ordering::Relaxed));
                        let _ = writeln!(out, "{name}{{{labels}}} {}", number(v));
                    }
                    Series::Histogram(h) => h.render(name, &labels, out),
                }
            }
        }
    }
}

/// A key's labels as `k="v",…`, values escaped as the text format asks.
fn labels(key: &Key) -> String {
    let mut out = String::new();
    for (i, l) in key.labels().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(l.key());
        out.push_str("=\"");
        for c in l.value().chars() {
            match c {
                '\\' => out.push_str("\\\\"),
                '"' => out.push_str("\\\""),
                '\n' => out.push_str("\\n"),
                c => out.push(c),
            }
        }
        out.push('"');
    }
    out
}

/// A sample value as the text format writes it.
fn number(v: f64) -> String {
    if v.is_nan() {
        "NaN".to_owned()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.to_owned()
    } else {
        v.to_string()
    }
}

/// A fixed-bucket histogram: a count per bucket (not cumulative; the last is above every
/// bound) and the sum of the samples. Lock-free.
struct Buckets {
    bounds: &'static [f64],
    counts: Box<[AtomicU64]>,
    sum_bits: AtomicU64,
}

impl Buckets {
    fn new(bounds: &'static [f64]) -> Self {
        Buckets {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_bits: AtomicU64::new(0f64.to_bits()),
        }
    }

    fn render(&self, name: &str, labels: &str, out: &mut String) {
        let sep = if labels.is_empty() { "" } else { "," };
        let mut total = 0u64;
        for (i, count) in self.counts.iter().enumerate() {
            total += count.load(Ordering::Relaxed);
            let le = self.bounds.get(i).map_or("+Inf".to_owned(), |b| number(*b));
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{le}\"}} {total}");
        }
        let sum = f64::from_bits(self.sum_bits.load(Ordering::Relaxed));
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", number(sum));
        // The count is the buckets' total, so that the two never disagree in one scrape.
        let _ = writeln!(out, "{name}_count{{{labels}}} {total}");
    }
}

impl HistogramFn for Buckets {
    fn record(&self, value: f64) {
        if value.is_nan() {
            return;
        }
        // A sample lands in the first bucket whose bound is not below it (`le`).
        let i = self.bounds.partition_point(|b| *b < value);
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        let _ = self
            .sum_bits
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + value).to_bits())
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BUCKETS: &[f64] = &[0.1, 1.0];

    fn recorded(f: impl FnOnce()) -> Metrics {
        let (metrics, recorder) = Metrics::new(BUCKETS).expect("buckets are valid");
        metrics::with_local_recorder(&recorder, f);
        metrics
    }

    #[test]
    fn per_worker_series_render_beside_the_exporters() {
        let metrics = recorded(|| {
            metrics::counter!("kvroute_x_total", "worker" => "7").increment(3);
            metrics::counter!("kvroute_x_total", "worker" => "8").increment(1);
            metrics::gauge!("kvroute_y", "worker" => "7").set(0.5);
            let h = metrics::histogram!("kvroute_z_seconds", "worker" => "7");
            for v in [0.05, 0.1, 0.5, 3.0, f64::NAN] {
                h.record(v);
            }
            metrics::counter!("kvroute_plain_total").increment(2);
        });
        let text = metrics.render();
        for line in [
            "kvroute_plain_total 2",
            "# TYPE kvroute_x_total counter",
            "kvroute_x_total{worker=\"7\"} 3",
            "kvroute_x_total{worker=\"8\"} 1",
            "# TYPE kvroute_y gauge",
            "kvroute_y{worker=\"7\"} 0.5",
            "# TYPE kvroute_z_seconds histogram",
            "kvroute_z_seconds_bucket{worker=\"7\",le=\"0.1\"} 2",
            "kvroute_z_seconds_bucket{worker=\"7\",le=\"1\"} 3",
            "kvroute_z_seconds_bucket{worker=\"7\",le=\"+Inf\"} 4",
            "kvroute_z_seconds_sum{worker=\"7\"} 3.65",
            "kvroute_z_seconds_count{worker=\"7\"} 4",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
        // One TYPE line per name: both workers' counters sit under it.
        assert_eq!(text.matches("# TYPE kvroute_x_total").count(), 1);
    }

    #[test]
    fn a_departed_workers_series_go_after_the_grace_period() {
        let metrics = recorded(|| {
            metrics::counter!("kvroute_x_total", "worker" => "7").increment(1);
            metrics::counter!("kvroute_x_total", "worker" => "8").increment(1);
        });
        let live = [WorkerId(8)];
        metrics.sweep_workers(live, 1_000);
        metrics.sweep_workers(live, 1_000 + WORKER_SERIES_GRACE_MS - 1);
        assert!(
            metrics.render().contains("worker=\"7\""),
            "kept in its grace"
        );
        metrics.sweep_workers(live, 1_000 + WORKER_SERIES_GRACE_MS);
        let text = metrics.render();
        assert!(!text.contains("worker=\"7\""), "{text}");
        assert!(text.contains("kvroute_x_total{worker=\"8\"} 1"), "{text}");
        assert_eq!(metrics.workers_with_series(), 1);
    }

    #[test]
    fn a_worker_back_within_the_grace_period_keeps_its_series() {
        let metrics = recorded(|| {
            metrics::counter!("kvroute_x_total", "worker" => "7").increment(4);
        });
        metrics.sweep_workers([], 0);
        metrics.sweep_workers([WorkerId(7)], WORKER_SERIES_GRACE_MS - 1);
        // Gone again: the grace starts over.
        metrics.sweep_workers([], WORKER_SERIES_GRACE_MS);
        metrics.sweep_workers([], 2 * WORKER_SERIES_GRACE_MS - 1);
        assert!(metrics.render().contains("kvroute_x_total{worker=\"7\"} 4"));
    }

    #[test]
    fn handles_share_one_series_and_label_values_are_escaped() {
        let metrics = recorded(|| {
            let a = metrics::counter!("kvroute_x_total", "worker" => "a\"b\\c\nd");
            let b = metrics::counter!("kvroute_x_total", "worker" => "a\"b\\c\nd");
            a.increment(1);
            b.increment(1);
        });
        assert!(
            metrics
                .render()
                .contains("kvroute_x_total{worker=\"a\\\"b\\\\c\\nd\"} 2"),
            "{}",
            metrics.render()
        );
    }
}
