//! Test engines (`kvroute-worker --emulate`): the simulated engine speaking vLLM's or SGLang's
//! wire formats, on free loopback ports, for the engine tests and the engines bench.

use crate::procs::{Proc, free_port, free_ports};

/// How a test engine is started.
#[derive(Clone, Debug)]
pub struct EngineSpec {
    /// `vllm`, `vllm-legacy` or `sglang`.
    pub flavor: String,
    /// The model it serves.
    pub model: String,
    /// G1 blocks (16 tokens each).
    pub g1_blocks: usize,
    /// G2 blocks.
    pub g2_blocks: usize,
    /// Divides its step times.
    pub speedup: f64,
    /// LoRA adapters it serves on top of `model`.
    pub adapters: Vec<String>,
}

/// A test engine process and its ports.
pub struct TestEngine {
    proc: Proc,
    args: Vec<String>,
    /// Its spec.
    pub spec: EngineSpec,
    /// HTTP port.
    pub port: u16,
    /// KV-event PUB port.
    pub events: u16,
    /// Replay ROUTER port.
    pub replay: u16,
    /// Data-parallel ranks, each with the event ports offset by its rank.
    pub ranks: u16,
}

impl TestEngine {
    /// Starts one (block size 16).
    pub fn start(spec: EngineSpec) -> anyhow::Result<TestEngine> {
        TestEngine::start_with(spec, &[])
    }

    /// Starts one (block size 16) with `extra` flags of `kvroute-worker`.
    pub fn start_with(spec: EngineSpec, extra: &[&str]) -> anyhow::Result<TestEngine> {
        TestEngine::start_ranks(spec, 1, extra)
    }

    /// Starts one with `ranks` data-parallel ranks behind its one HTTP port (block size 16)
    /// and `extra` flags of `kvroute-worker`.
    pub fn start_ranks(spec: EngineSpec, ranks: u16, extra: &[&str]) -> anyhow::Result<TestEngine> {
        let (port, events, replay) = (free_port(), free_ports(ranks), free_ports(ranks));
        let args: Vec<String> = [
            "--emulate",
            &spec.flavor,
            "--port",
            &port.to_string(),
            "--emulate-events-port",
            &events.to_string(),
            "--emulate-replay-port",
            &replay.to_string(),
            "--model",
            &spec.model,
            "--block-size",
            "16",
            "--g1-blocks",
            &spec.g1_blocks.to_string(),
            "--g2-blocks",
            &spec.g2_blocks.to_string(),
            "--speedup",
            &spec.speedup.to_string(),
            "--emulate-dp-size",
            &ranks.to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .chain(
            (!spec.adapters.is_empty())
                .then(|| ["--emulate-adapters".to_string(), spec.adapters.join(",")])
                .into_iter()
                .flatten(),
        )
        .chain(extra.iter().map(|s| s.to_string()))
        .collect();
        Ok(TestEngine {
            proc: Proc::start("kvroute-worker", &args)?,
            args,
            spec,
            port,
            events,
            replay,
            ranks,
        })
    }

    /// Its HTTP URL.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Its `kvroute serve --backend` value.
    pub fn backend(&self) -> String {
        format!(
            "{},events=tcp://127.0.0.1:{},replay=tcp://127.0.0.1:{},model={},block_size=16,dp={}",
            self.url(),
            self.events,
            self.replay,
            self.spec.model,
            self.ranks
        )
    }

    /// Kills it (it answers nothing until [`TestEngine::restart`]).
    pub fn kill(&mut self) {
        self.proc.kill();
    }

    /// Kills it and starts it again on the same ports (its publisher counts from 0 again).
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.proc.kill();
        self.proc = Proc::start("kvroute-worker", &self.args)?;
        Ok(())
    }
}

/// A router in direct mode in front of `backends`, with `extra` flags: the process, its API
/// URL and its admin URL.
pub fn direct_router(
    backends: &[String],
    extra: &[String],
) -> anyhow::Result<(Proc, String, String)> {
    let (port, admin) = (free_port(), free_port());
    let mut args: Vec<String> = [
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        &port.to_string(),
        "--admin-port",
        &admin.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for b in backends {
        args.push("--backend".into());
        args.push(b.clone());
    }
    // The tests read where requests went.
    args.push("--route-headers".into());
    args.extend(extra.iter().cloned());
    Ok((
        Proc::start("kvroute", &args)?,
        format!("http://127.0.0.1:{port}"),
        format!("http://127.0.0.1:{admin}"),
    ))
}
