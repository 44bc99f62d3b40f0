//! `kvroute-bench soak`: a chaos soak over real processes. A nats-server, two router
//! replicas and eight workers take steady traffic while, every 10–30 s, a random fault
//! strikes: a worker killed (-9) or terminated, a worker restarted in place, a router
//! killed, the NATS server restarted, a worker's publisher paused, a worker stalled after
//! its headers, clients disconnecting mid-stream. After each fault settles, a quiet
//! checkpoint checks what must hold: each router's index equals every worker's cache
//! exactly, no booking is open, the (never killed) first router's memory is flat after
//! warm-up, and no request that started after the fault settled failed.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kvroute::scheduler::Rng;
use kvroute_e2e::fleet::{Fleet, FleetSpec, WorkerSpec, completion};
use kvroute_e2e::procs::Http;
use parking_lot::Mutex;
use serde::Serialize;

/// Flags of `kvroute-bench soak`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// How long to run after the warm-up (traffic, then every kind of fault once), minutes.
    #[arg(long, default_value_t = 2.0)]
    pub minutes: f64,
    /// Seed of the fault schedule.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Concurrent clients.
    #[arg(long, default_value_t = 4)]
    pub clients: usize,
    /// Draw the timed faults only from these (comma-separated names as printed, e.g.
    /// `--faults "restart nats-server,kill worker"`); the warm-up still meets every kind.
    #[arg(long, value_delimiter = ',')]
    pub faults: Vec<String>,
    /// Write the report here as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One quiet checkpoint.
#[derive(Clone, Debug, Serialize)]
pub struct Checkpoint {
    /// Seconds since the start.
    pub at_s: f64,
    /// The fault just recovered from.
    pub after: String,
    /// Every router's index equals every worker's cache (per rank and tier, block count and
    /// digest).
    pub index_exact: bool,
    /// Differences found, if any (router, worker, tier: router's vs worker's).
    pub mismatches: Vec<String>,
    /// Open bookings per router.
    pub open_bookings: Vec<u64>,
    /// Resident memory of the first router, KiB.
    pub router_rss_kib: u64,
    /// Blocks in the first router's index.
    pub index_blocks: u64,
    /// Seconds the fleet took to settle after the fault.
    pub settle_s: f64,
}

/// The soak's report.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Wall time, s.
    pub seconds: f64,
    /// Faults injected, in order.
    pub faults: Vec<String>,
    /// The quiet checkpoints.
    pub checkpoints: Vec<Checkpoint>,
    /// Requests sent.
    pub requests: u64,
    /// Requests that failed (any time).
    pub failed: u64,
    /// Requests that failed though they started after the last fault had settled.
    pub failed_after_settle: u64,
    /// Examples of those.
    pub failures_after_settle: Vec<String>,
    /// First router's RSS after warm-up (every kind of fault once), KiB.
    pub rss_baseline_kib: u64,
    /// Largest deviation of a later checkpoint's RSS from the baseline, %.
    pub rss_max_deviation_pct: f64,
    /// The first router's RSS every 5 s: (seconds, KiB).
    pub rss_samples: Vec<(f64, u64)>,
    /// Whether every check held.
    pub passed: bool,
}

#[derive(Default)]
struct Traffic {
    sent: AtomicU64,
    failed: AtomicU64,
    /// Failures with their start time (s since the soak began) and what went wrong.
    failures: Mutex<Vec<(f64, String)>>,
}

const MODEL: &str = "kvroute-sim";
const FAULTS: [&str; 8] = [
    "kill worker",
    "terminate worker",
    "restart worker in place",
    "kill router",
    "restart nats-server",
    "pause publisher",
    "stall after headers",
    "disconnect clients",
];

/// One request of the steady traffic: a conversation family's shared prefix, then a turn.
fn body(rng: &mut Rng) -> (String, bool) {
    let family = rng.below(24);
    let turn = rng.below(6);
    let stream = rng.below(2) == 0;
    let prompt = format!(
        "Family {family}: {} Turn {turn}: {}",
        "a shared instruction block for this conversation family. ".repeat(8),
        "and a question about it. ".repeat(1 + turn)
    );
    (
        completion(MODEL, &prompt, 1 + rng.below(12) as u32, stream),
        stream,
    )
}

async fn client(
    urls: Vec<String>,
    seed: u64,
    start: Instant,
    traffic: Arc<Traffic>,
    quiet: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
) {
    let mut rng = Rng::new(seed);
    let http = Http::default();
    while !stop.load(Ordering::Relaxed) {
        if quiet.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        let url = &urls[rng.below(urls.len())];
        let (body, stream) = body(&mut rng);
        let at = start.elapsed().as_secs_f64();
        traffic.sent.fetch_add(1, Ordering::Relaxed);
        let outcome = http
            .call("POST", &format!("{url}/v1/completions"), body)
            .await;
        let failure = match outcome {
            Err(e) => Some(format!("{e:#}")),
            Ok(r) if r.status != 200 => Some(format!("{} {}", r.status, r.body)),
            Ok(r)
                if stream && (!r.body.contains("data: [DONE]") || r.body.contains("\"error\"")) =>
            {
                Some(format!(
                    "stream: {}",
                    &r.body[r.body.len().saturating_sub(300)..]
                ))
            }
            Ok(_) => None,
        };
        if let Some(f) = failure {
            traffic.failed.fetch_add(1, Ordering::Relaxed);
            traffic.failures.lock().push((at, f));
        }
    }
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

/// (worker, rank, tier) → (blocks, digest) as a JSON row set reports them.
fn digests(rows: &serde_json::Value) -> BTreeMap<(u64, u64, String), (u64, String)> {
    rows["ranks"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|r| {
            (
                (
                    r["worker"].as_u64().unwrap_or(0),
                    r["dp_rank"].as_u64().unwrap_or(0),
                    r["tier"].as_str().unwrap_or("").to_owned(),
                ),
                (
                    r["blocks"].as_u64().unwrap_or(0),
                    r["digest"].as_str().unwrap_or("").to_owned(),
                ),
            )
        })
        .collect()
}

/// Compares every router's index with the workers' caches; the differences.
async fn compare(fleet: &Fleet) -> anyhow::Result<Vec<String>> {
    let mut truth = BTreeMap::new();
    for w in &fleet.workers {
        let r = fleet
            .http
            .call("GET", &format!("{}/admin/cache", w.url()), "")
            .await?;
        truth.extend(digests(&serde_json::from_str(&r.body)?));
    }
    let mut mismatches = Vec::new();
    for (i, router) in fleet.routers.iter().enumerate() {
        let r = fleet
            .http
            .call("GET", &format!("{}/admin/index", router.admin()), "")
            .await?;
        let index = digests(&serde_json::from_str(&r.body)?);
        for key in truth.keys().chain(index.keys()) {
            let (a, b) = (index.get(key), truth.get(key));
            if a != b {
                mismatches.push(format!("router {i} {key:?}: index {a:?}, worker {b:?}"));
            }
        }
    }
    mismatches.dedup();
    Ok(mismatches)
}

struct Soak {
    fleet: Fleet,
    rng: Rng,
    start: Instant,
    traffic: Arc<Traffic>,
    quiet: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
}

impl Soak {
    fn t(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Injects one fault and undoes it; returns when the fleet is whole again.
    async fn fault(&mut self, name: &str) -> anyhow::Result<()> {
        let w = self.rng.below(self.fleet.workers.len());
        match name {
            "kill worker" => {
                self.fleet.workers[w].proc.kill();
                tokio::time::sleep(Duration::from_secs(3)).await;
                self.fleet.restart_worker(w)?;
            }
            "terminate worker" => {
                self.fleet.workers[w].proc.terminate()?;
                self.fleet.workers[w]
                    .proc
                    .wait_timeout(Duration::from_secs(40))
                    .context("a terminated worker did not exit")?;
                self.fleet.restart_worker(w)?;
            }
            "restart worker in place" => self.fleet.restart_worker(w)?,
            "kill router" => {
                self.fleet.routers[1].proc.kill();
                tokio::time::sleep(Duration::from_secs(2)).await;
                self.fleet.restart_router(1)?;
            }
            "restart nats-server" => {
                self.fleet.nats[0].kill();
                tokio::time::sleep(Duration::from_secs(2)).await;
                self.fleet.nats[0].restart()?;
            }
            "pause publisher" => {
                self.fleet
                    .faults(w, serde_json::json!({"pause_publisher": true}))
                    .await?;
                tokio::time::sleep(Duration::from_secs(6)).await;
                self.fleet.faults(w, serde_json::json!({})).await?;
            }
            "stall after headers" => {
                self.fleet
                    .faults(w, serde_json::json!({"stall_after_headers": true}))
                    .await?;
                tokio::time::sleep(Duration::from_secs(6)).await;
                self.fleet.faults(w, serde_json::json!({})).await?;
            }
            "disconnect clients" => {
                let url = self.fleet.url();
                let mut tasks = Vec::new();
                for i in 0..20 {
                    let body = completion(MODEL, &format!("a long answer {i}"), 2000, i % 2 == 0);
                    let (http, url) = (Http::default(), url.clone());
                    tasks.push(tokio::spawn(async move {
                        let _ = http
                            .call("POST", &format!("{url}/v1/completions"), body)
                            .await;
                    }));
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
                for t in tasks {
                    t.abort();
                }
            }
            other => bail!("unknown fault {other}"),
        }
        if name.ends_with("worker") || name.ends_with("in place") {
            self.fleet
                .wait_incarnation(w, Duration::from_secs(60))
                .await?;
        }
        self.fleet.wait_synced(Duration::from_secs(60)).await
    }

    /// Quiet: traffic paused, in-flight done, events delivered; then the checks.
    async fn checkpoint(&mut self, after: &str, settle_s: f64) -> anyhow::Result<Checkpoint> {
        self.quiet.store(true, Ordering::Relaxed);
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut mismatches = Vec::new();
        let mut open = Vec::new();
        while Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(500)).await;
            open.clear();
            for i in 0..self.fleet.routers.len() {
                open.push(self.fleet.open_bookings(i).await.unwrap_or(u64::MAX));
            }
            mismatches = compare(&self.fleet)
                .await
                .unwrap_or_else(|e| vec![format!("{e:#}")]);
            if mismatches.is_empty() && open.iter().all(|o| *o == 0) {
                break;
            }
        }
        let admin = self.fleet.admin_workers(0).await?;
        let checkpoint = Checkpoint {
            at_s: self.t(),
            after: after.to_owned(),
            index_exact: mismatches.is_empty(),
            mismatches: mismatches.into_iter().take(10).collect(),
            open_bookings: open,
            router_rss_kib: rss_kib(self.fleet.routers[0].proc.id()),
            index_blocks: admin["index"]["blocks"].as_u64().unwrap_or(0),
            settle_s,
        };
        self.quiet.store(false, Ordering::Relaxed);
        Ok(checkpoint)
    }
}

/// Runs the soak.
pub async fn run(args: &Args) -> anyhow::Result<Report> {
    if let Some(unknown) = args.faults.iter().find(|f| !FAULTS.contains(&f.trim())) {
        bail!(
            "unknown fault {unknown:?}; the faults are: {}",
            FAULTS.join(", ")
        );
    }
    let injectable = WorkerSpec {
        model: MODEL.into(),
        args: [
            "--fault-injection",
            "--g1-blocks",
            "512",
            "--g2-blocks",
            "1024",
        ]
        .map(String::from)
        .to_vec(),
    };
    let fleet = Fleet::start(FleetSpec {
        routers: 2,
        router_args: [
            "--relay-idle-timeout-ms",
            "3000",
            "--first-token-timeout-ms",
            "3000",
            "--worker-timeout-ms",
            "5000",
        ]
        .map(String::from)
        .to_vec(),
        workers: vec![injectable; 8],
        speedup: 20.0,
        heartbeat_ms: 500,
        lease_ttl_ms: 3_000,
        ..FleetSpec::default()
    })
    .await?;
    let start = Instant::now();
    let mut soak = Soak {
        fleet,
        rng: Rng::new(args.seed),
        start,
        traffic: Arc::default(),
        quiet: Arc::default(),
        stop: Arc::default(),
    };
    drive(&mut soak, args).await
}

/// Longest a request of the steady traffic runs (a dozen tokens at speedup 20 take well
/// under a second): a request that started this close before a fault may fail with it.
const GRACE_S: f64 = 5.0;

async fn drive(soak: &mut Soak, args: &Args) -> anyhow::Result<Report> {
    let urls: Vec<String> = soak.fleet.routers.iter().map(|r| r.url()).collect();
    let clients: Vec<_> = (0..args.clients)
        .map(|c| {
            tokio::spawn(client(
                urls.clone(),
                args.seed.wrapping_mul(1000) + c as u64,
                soak.start,
                Arc::clone(&soak.traffic),
                Arc::clone(&soak.quiet),
                Arc::clone(&soak.stop),
            ))
        })
        .collect();
    let samples = Arc::new(Mutex::new(Vec::new()));
    let sampler = {
        let (samples, stop, start) = (Arc::clone(&samples), Arc::clone(&soak.stop), soak.start);
        let pid = soak.fleet.routers[0].proc.id();
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                samples
                    .lock()
                    .push((start.elapsed().as_secs_f64(), rss_kib(pid)));
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        })
    };
    let mut faults = Vec::new();
    let mut checkpoints = Vec::new();
    // Windows in which failures are expected: (fault start − grace, fault settled).
    let mut windows: Vec<(f64, f64)> = Vec::new();
    // Warm-up: traffic, then every kind of fault once, each checked like the rest. Memory
    // grows while caches, pools and the allocator meet each kind of burst for the first
    // time (and plateaus after: a thousand aborted streams in a row move RSS by < 3 %), so
    // the flatness baseline is taken once all have been met.
    tokio::time::sleep(Duration::from_secs(10)).await;
    for name in FAULTS {
        let began = soak.t();
        eprintln!("soak {began:>6.1} s: warm-up: {name}");
        soak.fault(name).await?;
        let settled = soak.t();
        windows.push((began - GRACE_S, settled));
        faults.push(format!(
            "{began:.1} s: {name} (warm-up; settled in {:.1} s)",
            settled - began
        ));
        checkpoints.push(soak.checkpoint(name, settled - began).await?);
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    let warm_until = soak.t();
    let drawn: Vec<&str> = FAULTS
        .into_iter()
        .filter(|f| args.faults.is_empty() || args.faults.iter().any(|a| a.trim() == *f))
        .collect();
    checkpoints.push(soak.checkpoint("warm-up", 0.0).await?);
    let total = warm_until + args.minutes * 60.0;
    loop {
        let wait = 10.0 + soak.rng.below(21) as f64;
        if soak.t() + wait >= total {
            break;
        }
        tokio::time::sleep(Duration::from_secs_f64(wait)).await;
        let name = drawn[soak.rng.below(drawn.len())];
        let began = soak.t();
        eprintln!("soak {began:>6.1} s: {name}");
        soak.fault(name).await?;
        let settled = soak.t();
        windows.push((began - GRACE_S, settled));
        faults.push(format!(
            "{began:.1} s: {name} (settled in {:.1} s)",
            settled - began
        ));
        let c = soak.checkpoint(name, settled - began).await?;
        eprintln!(
            "soak {:>6.1} s: checkpoint: index exact {}, open bookings {:?}, router RSS {} KiB",
            c.at_s, c.index_exact, c.open_bookings, c.router_rss_kib
        );
        checkpoints.push(c);
    }
    soak.stop.store(true, Ordering::Relaxed);
    sampler.abort();
    for c in clients {
        let _ = tokio::time::timeout(Duration::from_secs(40), c).await;
    }
    let failures = soak.traffic.failures.lock().clone();
    let after_settle: Vec<String> = failures
        .iter()
        .filter(|(at, _)| !windows.iter().any(|(a, b)| at >= a && at <= b))
        .map(|(at, f)| format!("{at:.1} s: {}", &f[..f.len().min(300)]))
        .collect();
    let warm = checkpoints
        .iter()
        .find(|c| c.at_s >= warm_until)
        .map_or(0, |c| c.router_rss_kib);
    let deviation = checkpoints
        .iter()
        .filter(|c| c.at_s >= warm_until)
        .map(|c| (c.router_rss_kib as f64 - warm as f64).abs() / warm.max(1) as f64 * 100.0)
        .fold(0.0, f64::max);
    let passed = checkpoints
        .iter()
        .all(|c| c.index_exact && c.open_bookings.iter().all(|o| *o == 0))
        && after_settle.is_empty()
        && deviation <= 10.0;
    Ok(Report {
        seconds: soak.t(),
        faults,
        checkpoints,
        requests: soak.traffic.sent.load(Ordering::Relaxed),
        failed: soak.traffic.failed.load(Ordering::Relaxed),
        failed_after_settle: after_settle.len() as u64,
        failures_after_settle: after_settle.into_iter().take(20).collect(),
        rss_baseline_kib: warm,
        rss_max_deviation_pct: deviation,
        rss_samples: samples.lock().clone(),
        passed,
    })
}

/// Prints the report.
pub fn print(report: &Report) {
    println!(
        "| at s | after | settle s | index exact | open bookings | router RSS KiB | index blocks |"
    );
    println!("|---|---|---|---|---|---|---|");
    for c in &report.checkpoints {
        println!(
            "| {:.1} | {} | {:.1} | {} | {:?} | {} | {} |",
            c.at_s,
            c.after,
            c.settle_s,
            c.index_exact,
            c.open_bookings,
            c.router_rss_kib,
            c.index_blocks
        );
        for m in &c.mismatches {
            println!("|   | mismatch: {m} | | | | | |");
        }
    }
    println!(
        "{:.0} s, {} faults, {} requests, {} failed ({} after a fault had settled), router RSS {} KiB after warm-up, max deviation {:.1} %: {}",
        report.seconds,
        report.faults.len(),
        report.requests,
        report.failed,
        report.failed_after_settle,
        report.rss_baseline_kib,
        report.rss_max_deviation_pct,
        if report.passed { "PASSED" } else { "FAILED" }
    );
    for f in &report.failures_after_settle {
        println!("  failed after settle: {f}");
    }
}
