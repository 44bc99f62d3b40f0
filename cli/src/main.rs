//! The `kvroute` command line: the router, the embedded demo fleet, and operator tools.
#![forbid(unsafe_code)]

/// jemalloc, built with options that return freed pages to the OS within about a second
/// (`.cargo/config.toml`): glibc's heap stays resident after the index shrinks.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

mod hash;
mod serve;
mod up;

use kvroute_cli::settings;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// KV-aware request router for LLM inference fleets.
#[derive(Parser)]
#[command(name = "kvroute", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the router: OpenAI API on --port, KV events and workers from NATS.
    Serve(Box<settings::ServeArgs>),
    /// Run a router and simulated workers in this process (no NATS, no GPU): the demo.
    Up(up::UpArgs),
    /// Print the block hashes of a token sequence, as workers and the router compute them
    /// (debug "why is my overlap zero").
    Hash(hash::HashArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Hash(args) => hash::run_hash(&args),
        Command::Serve(args) => serve::run_serve(*args),
        Command::Up(args) => up::run_up(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("kvroute: {err:#}");
            ExitCode::from(2)
        }
    }
}
