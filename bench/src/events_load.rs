//! `kvroute-bench events`: how many KV events one router's event plane applies from W
//! publishing workers over loopback NATS (a `nats-server -js` of its own), and the
//! publish → apply lag at half that rate, with its share before the router had each batch
//! and the router's own. Publishers and router share this process, its tokio runtime and its
//! cores, as they would not in production (publishers on a runtime of their own, tried,
//! lengthened the tail on two cores: more threads to schedule).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvroute::auth::NatsAuth;
use kvroute::discovery::{Registry, WorkerInfo};
use kvroute::events::plane::{EventPlane, PlaneConfig, events_subject};
use kvroute::events::transport::Transport;
use kvroute::indexer::{Config, Indexer};
use kvroute::protocol::{
    DpRank, EventBatch, KvEvent, KvEventData, LocalHash, Salt, SeqHash, StoredBlock, Tier,
    WorkerId, encode, seq_hash,
};
use kvroute_e2e::nats::NatsServer;
use serde::Serialize;
use tokio::sync::watch;

use crate::stats::Summary;

/// Flags of `kvroute-bench events`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Publishing workers (one NATS connection each).
    #[arg(long, default_value_t = 32)]
    pub workers: u64,
    /// Batches each worker publishes in the saturation phase.
    #[arg(long, default_value_t = 2_000)]
    pub batches: u64,
    /// Events per batch (each stores or removes a 16-block chain).
    #[arg(long, default_value_t = 4)]
    pub events_per_batch: u64,
    /// Length of the paced phase, s.
    #[arg(long, default_value_t = 5.0)]
    pub paced_seconds: f64,
    /// Rate of the paced phase, events/s (default: half the saturated rate just measured).
    #[arg(long)]
    pub paced_events_per_s: Option<f64>,
    /// Write the figures here as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// The JSON `kvroute-bench events` writes.
#[derive(Debug, Default, Serialize)]
pub struct Report {
    /// Publishing workers.
    pub workers: u64,
    /// Events applied in the saturation phase.
    pub events: u64,
    /// Saturation phase, first publish to last apply, s.
    pub wall_s: f64,
    /// Events applied per second at saturation.
    pub events_per_s: f64,
    /// Blocks per event.
    pub blocks_per_event: u64,
    /// Paced rate (half the saturated one), events/s.
    pub paced_events_per_s: f64,
    /// The rate the publishers offered in the paced phase: its events over the time from
    /// its first send to its last, events/s.
    pub paced_achieved_events_per_s: f64,
    /// Publish → apply lag at the paced rate, ms.
    pub lag_ms: Summary,
    /// Of that, publish → received by the router (publisher task, NATS, loopback), ms.
    pub transit_ms: Summary,
    /// Received → applied, for batches applied on arrival: the router's own share, ms.
    pub router_ms: Summary,
}

fn unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// Batch `n` of a worker: events alternately store a fresh 16-block chain and remove it,
/// so the index stays small and every event does real work.
fn batch(worker: u64, n: u64, events_per_batch: u64) -> EventBatch {
    let events = (0..events_per_batch)
        .map(|k| {
            let id = n * events_per_batch + k + 1;
            let chain_no = (id - 1) / 2;
            let mut parent = None;
            let chain: Vec<StoredBlock> = (0..16u64)
                .map(|i| {
                    let local = LocalHash(worker << 40 ^ chain_no << 8 ^ i);
                    let seq = seq_hash(parent, local, Salt::NONE);
                    parent = Some(seq);
                    StoredBlock { seq, local }
                })
                .collect();
            let data = if id % 2 == 1 {
                KvEventData::Stored {
                    parent: None,
                    blocks: chain,
                }
            } else {
                KvEventData::Removed {
                    blocks: chain.iter().rev().map(|b| b.seq).collect::<Vec<SeqHash>>(),
                }
            };
            KvEvent {
                id,
                tier: Tier::Device,
                data,
            }
        })
        .collect();
    EventBatch {
        worker: WorkerId(worker),
        dp_rank: DpRank(0),
        epoch: 1,
        sent_unix_us: 0,
        events,
    }
}

/// One connection per publishing worker, made before any phase's clock starts: 32
/// connections made one after another inside the saturated phase's clock counted as
/// time the router took to apply.
async fn connect_publishers(server: &NatsServer, args: &Args) -> anyhow::Result<Vec<Transport>> {
    let mut out = Vec::new();
    for w in 0..args.workers {
        out.push(
            Transport::connect_nats(&server.url(), &format!("pub-{w}"), &NatsAuth::default())
                .await?,
        );
    }
    Ok(out)
}

/// When a phase's publishers sent their first and last batches.
#[derive(Clone, Copy, Debug)]
struct Sent {
    first: Instant,
    last: Instant,
}

/// Publishes batches `from..to` of every worker, each on its connection.
async fn publishers(
    transports: &[Transport],
    args: &Args,
    from: u64,
    to: u64,
    rate: Option<f64>,
) -> anyhow::Result<Sent> {
    let mut tasks = Vec::new();
    for (w, transport) in (0..args.workers).zip(transports) {
        let transport = transport.clone();
        let subject = events_subject("bench", WorkerId(w));
        let epb = args.events_per_batch;
        let workers = args.workers;
        // Per worker, batches per second at the paced rate.
        let period = rate.map(|r| Duration::from_secs_f64(args.workers as f64 * epb as f64 / r));
        tasks.push(tokio::spawn(async move {
            // Workers' schedules start spread over one period (tokio's timer fires at 1 ms
            // ticks: below that, arrivals bunch on the same tick).
            let start = tokio::time::Instant::now()
                + period.map_or(Duration::ZERO, |p| p.mul_f64(w as f64 / workers as f64));
            let mut sent: Option<Sent> = None;
            for n in from..to {
                if let Some(p) = period {
                    tokio::time::sleep_until(start + p * (n - from) as u32).await;
                }
                let mut b = batch(w, n, epb);
                b.sent_unix_us = unix_us();
                let now = Instant::now();
                sent = Some(Sent {
                    first: sent.map_or(now, |s| s.first),
                    last: now,
                });
                let payload = encode(&b).expect("invariant: bench batches encode");
                if transport
                    .publish(&subject, None, payload.into())
                    .await
                    .is_err()
                {
                    break;
                }
            }
            transport.flush().await;
            sent
        }));
    }
    let mut all: Option<Sent> = None;
    for t in tasks {
        if let Some(s) = t.await? {
            all = Some(match all {
                None => s,
                Some(a) => Sent {
                    first: a.first.min(s.first),
                    last: a.last.max(s.last),
                },
            });
        }
    }
    all.ok_or_else(|| anyhow::anyhow!("no publisher sent anything"))
}

fn applied(plane: &EventPlane) -> u64 {
    plane.streams().iter().map(|(_, s)| s.applied).sum()
}

async fn wait_applied(plane: &EventPlane, batches: u64, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while applied(plane) < batches {
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    true
}

/// Runs the bench.
pub async fn run(args: &Args) -> anyhow::Result<Report> {
    let server = NatsServer::start()?;
    let transport = Transport::connect_nats(&server.url(), "router", &NatsAuth::default()).await?;
    let indexer = Arc::new(Indexer::new(Config::default())?);
    let (_shutdown, rx) = watch::channel(false);
    let config = PlaneConfig {
        cluster: "bench".into(),
        queue_batches: 1 << 20,
        // Every batch of both phases (1 M batches, 16 MiB of samples).
        lag_samples: 1 << 20,
        ..PlaneConfig::default()
    };
    let plane = EventPlane::start(
        transport,
        indexer,
        // The publishers, registered (the plane drops batches of unregistered workers).
        Registry::Static(
            (0..args.workers)
                .map(|w| WorkerInfo {
                    id: WorkerId(w),
                    url: format!("http://127.0.0.1:1/{w}"),
                    block_size: 16,
                    g1_blocks: 1 << 20,
                    g2_blocks: 0,
                    model: "bench".into(),
                    dp_size: 1,
                    epoch: 1,
                    last_event_ids: Vec::new(),
                    api: kvroute::discovery::WorkerApi::Kvroute,
                    adapters: Vec::new(),
                    engine_load: None,
                    event_faults: None,
                    engine_rank_kv_usage: Vec::new(),
                    learns_routes: false,
                    left: false,
                })
                .collect(),
        )
        .watch(Default::default()),
        config,
        None,
        rx,
    )
    .await?;

    let transports = connect_publishers(&server, args).await?;
    let total = args.workers * args.batches;
    let start = Instant::now();
    publishers(&transports, args, 0, args.batches, None).await?;
    if !wait_applied(&plane, total, Duration::from_secs(120)).await {
        anyhow::bail!(
            "the router applied {} of {total} batches: {:?}",
            applied(&plane),
            plane.counters()
        );
    }
    let wall_s = start.elapsed().as_secs_f64();
    let events = total * args.events_per_batch;
    let events_per_s = events as f64 / wall_s;

    let paced_rate = args.paced_events_per_s.unwrap_or(events_per_s / 2.0);
    let paced_batches = ((paced_rate * args.paced_seconds)
        / (args.workers * args.events_per_batch) as f64)
        .ceil() as u64;
    let before = (
        plane.lag_samples().len(),
        plane.transit_samples().len(),
        plane.router_samples().len(),
    );
    let sent = publishers(
        &transports,
        args,
        args.batches,
        args.batches + paced_batches,
        Some(paced_rate),
    )
    .await?;
    // The rate offered: a publisher that fell behind its schedule offered less than asked.
    let paced_events = (args.workers * paced_batches * args.events_per_batch) as f64;
    let paced_achieved =
        paced_events / sent.last.duration_since(sent.first).as_secs_f64().max(1e-9);
    // A router that fell behind would leave its slowest batches out of the lag figures:
    // no report then.
    let paced_total = total + args.workers * paced_batches;
    if !wait_applied(&plane, paced_total, Duration::from_secs(60)).await {
        anyhow::bail!(
            "the router applied {} of {paced_total} batches by the paced phase's end: its lag \
             figures would leave the slowest out",
            applied(&plane)
        );
    }
    let paced = |mut all: Vec<f64>, before: usize| all.split_off(before.min(all.len()));
    let mut lags = paced(plane.lag_samples(), before.0);
    let mut transit = paced(plane.transit_samples(), before.1);
    let mut router = paced(plane.router_samples(), before.2);
    Ok(Report {
        workers: args.workers,
        events,
        wall_s,
        events_per_s,
        blocks_per_event: 16,
        paced_events_per_s: paced_rate,
        paced_achieved_events_per_s: paced_achieved,
        lag_ms: Summary::of(&mut lags),
        transit_ms: Summary::of(&mut transit),
        router_ms: Summary::of(&mut router),
    })
}

/// Prints the report.
pub fn print(r: &Report) {
    println!(
        "events: {} workers, {} events of {} blocks in {:.2} s: {:.0} events/s ({:.0} blocks/s)",
        r.workers,
        r.events,
        r.blocks_per_event,
        r.wall_s,
        r.events_per_s,
        r.events_per_s * r.blocks_per_event as f64
    );
    println!(
        "lag at {:.0} events/s (offered: {:.0}): p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, mean {:.2} ms",
        r.paced_events_per_s,
        r.paced_achieved_events_per_s,
        r.lag_ms.p50,
        r.lag_ms.p90,
        r.lag_ms.p99,
        r.lag_ms.mean
    );
    println!(
        "  of which before the router had the batch (publisher, NATS): p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, mean {:.2} ms",
        r.transit_ms.p50, r.transit_ms.p90, r.transit_ms.p99, r.transit_ms.mean
    );
    println!(
        "  the router's own share (received → applied): p50 {:.3} ms, p90 {:.3} ms, p99 {:.3} ms, mean {:.3} ms",
        r.router_ms.p50, r.router_ms.p90, r.router_ms.p99, r.router_ms.mean
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute::protocol::{Limits, decode};

    #[test]
    fn bench_batches_are_valid_payloads() {
        for n in [0, 1, 2499, 2500, 9999] {
            let b = batch(31, n, 4);
            decode(&encode(&b).unwrap(), &Limits::default()).unwrap();
        }
    }
}
