//! `kvroute-bench`: system benches that print a table and write JSON.
#![forbid(unsafe_code)]

/// jemalloc, built with options that return freed pages to the OS within about a second
/// (`.cargo/config.toml`): glibc's heap stays resident after the index shrinks.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use clap::{Parser, Subcommand};
use kvroute_bench::{
    engines_load, events_load, fuzz, indexer_load, kernels_load, online, plot, replay, soak, trace,
};

/// kvroute's system benchmarks.
#[derive(Parser)]
#[command(name = "kvroute-bench", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The indexer under a trace's real event stream: block-ops/s and lookup latency.
    Indexer(indexer_load::Args),
    /// Events/s one router applies from many publishing workers over loopback NATS.
    Events(events_load::Args),
    /// kvroute in front of engines with real prefix caches (test engines, direct mode): a
    /// multi-turn workload's TTFT and engine-reported reuse per policy, and the latency the
    /// router adds.
    Engines(engines_load::Args),
    /// Offline replay of a trace: routing policies compared on TTFT, reuse and load.
    Replay(Box<replay::Args>),
    /// A trace sent to a running OpenAI-compatible endpoint, measured at the client.
    Online(Box<online::Args>),
    /// Writes a paced agent-style trace: sessions of many turns sharing a system prompt,
    /// each turn sent a think time after the previous one finished.
    AgentTrace(trace::AgentArgs),
    /// GPU KV block copies: gather+D2H and H2D+scatter GB/s against one contiguous copy.
    Kernels(kernels_load::Args),
    /// Every decoder of network and file input, fed structure-aware and raw inputs: zero
    /// panics or a non-zero exit.
    Fuzz(fuzz::Args),
    /// A chaos soak: NATS, 2 routers, 8 workers, steady traffic and a random fault every
    /// 10–30 s; quiet checkpoints check the index, the bookings, memory and failures.
    Soak(soak::Args),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    match Cli::parse().command {
        Command::Indexer(args) => {
            let report = indexer_load::run(&args)?;
            indexer_load::print(&report);
            if let Some(path) = &args.json {
                std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
            }
        }
        Command::Events(args) => {
            let runtime = tokio::runtime::Runtime::new()?;
            let report = runtime.block_on(events_load::run(&args))?;
            events_load::print(&report);
            if let Some(path) = &args.json {
                std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
            }
        }
        Command::Engines(args) => {
            let runtime = tokio::runtime::Runtime::new()?;
            let report = runtime.block_on(engines_load::run(&args))?;
            engines_load::print(&report);
            if let Some(path) = &args.json {
                std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
            }
        }
        Command::Kernels(args) => {
            let report = kernels_load::run(&args)?;
            kernels_load::print(&report);
            if let Some(path) = &args.json {
                std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
            }
        }
        Command::Fuzz(args) => {
            let report = fuzz::run(&args)?;
            fuzz::print(&report);
            if let Some(path) = &args.json {
                std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
            }
            if report.panics > 0 {
                anyhow::bail!("{} inputs panicked", report.panics);
            }
        }
        Command::Soak(args) => {
            let runtime = tokio::runtime::Runtime::new()?;
            let report = runtime.block_on(soak::run(&args))?;
            soak::print(&report);
            if let Some(path) = &args.json {
                std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
            }
            if !report.passed {
                anyhow::bail!("the soak failed its checks");
            }
        }
        Command::Online(args) => {
            let report = online::run_trace(&args)?;
            online::print(&report);
            if let Some(path) = &args.json {
                std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
            }
            if report.requests > 0 && report.failed >= report.requests {
                anyhow::bail!("no request succeeded");
            }
        }
        Command::AgentTrace(args) => {
            let records = trace::agent_sessions(&args);
            let mut out = String::new();
            for r in &records {
                out.push_str(&serde_json::to_string(r)?);
                out.push('\n');
            }
            std::fs::write(&args.out, out)?;
            println!(
                "{} requests in {} sessions written to {}",
                records.len(),
                args.sessions,
                args.out.display()
            );
        }
        Command::Replay(args) => {
            let report = replay::run(&args)?;
            replay::print(&report);
            if let Some(path) = &args.json {
                std::fs::write(path, serde_json::to_string_pretty(&report)?)?;
            }
            if let Some(path) = &args.plot {
                std::fs::write(path, plot::svg(&report))?;
            }
        }
    }
    Ok(())
}
