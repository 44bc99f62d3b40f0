//! A fleet of real processes: a `nats-server -js`, router replicas (`kvroute serve`) and
//! workers (`kvroute-worker`), each on free loopback ports, killed on drop. The end-to-end
//! tests and the chaos soak build on it.

use std::time::Duration;

use anyhow::{Context, bail};

use crate::nats::{NatsServer, urls};
use crate::procs::{Http, Proc, free_port};

/// One worker to start.
#[derive(Clone, Debug)]
pub struct WorkerSpec {
    /// Model it serves (`--model`); empty: no `--model` flag.
    pub model: String,
    /// Extra flags.
    pub args: Vec<String>,
}

impl WorkerSpec {
    /// A worker of `model` with no extra flags.
    pub fn model(model: &str) -> WorkerSpec {
        WorkerSpec {
            model: model.into(),
            args: Vec::new(),
        }
    }
}

/// A router process and its URLs.
pub struct RouterProc {
    /// The process.
    pub proc: Proc,
    /// Its API port.
    pub port: u16,
    /// Its admin port.
    pub admin_port: u16,
    /// Its flags (to restart it alike).
    pub args: Vec<String>,
}

impl RouterProc {
    /// The API base URL.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The admin base URL.
    pub fn admin(&self) -> String {
        format!("http://127.0.0.1:{}", self.admin_port)
    }
}

/// A worker process.
pub struct WorkerProc {
    /// The process.
    pub proc: Proc,
    /// Its HTTP port (also its id).
    pub port: u16,
    /// Its flags (to restart it alike).
    pub args: Vec<String>,
}

impl WorkerProc {
    /// Its base URL.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

/// How to build a fleet.
#[derive(Clone, Debug)]
pub struct FleetSpec {
    /// Router replicas.
    pub routers: usize,
    /// Extra router flags.
    pub router_args: Vec<String>,
    /// Workers.
    pub workers: Vec<WorkerSpec>,
    /// Engine speedup of every worker.
    pub speedup: f64,
    /// Worker heartbeat and lease, ms.
    pub heartbeat_ms: u64,
    /// Lease TTL of workers (router and workers), ms.
    pub lease_ttl_ms: u64,
    /// NATS servers: 1, or a JetStream cluster of this many.
    pub nats_servers: usize,
    /// Configuration of a single NATS server (authentication, TLS).
    pub nats_config: String,
    /// Environment of every router and worker (credentials).
    pub env: Vec<(String, String)>,
    /// Replicas of the registry bucket (routers and workers).
    pub registry_replicas: usize,
    /// Routers answer with the routing headers (`--route-headers`; the tests read them).
    pub route_headers: bool,
}

impl Default for FleetSpec {
    fn default() -> Self {
        FleetSpec {
            routers: 1,
            router_args: Vec::new(),
            workers: vec![WorkerSpec::model("kvroute-sim")],
            speedup: 50.0,
            heartbeat_ms: 300,
            lease_ttl_ms: 1_500,
            nats_servers: 1,
            nats_config: String::new(),
            env: Vec::new(),
            registry_replicas: 1,
            route_headers: true,
        }
    }
}

/// A running fleet.
pub struct Fleet {
    /// The NATS server(s).
    pub nats: Vec<NatsServer>,
    /// Router replicas.
    pub routers: Vec<RouterProc>,
    /// Workers.
    pub workers: Vec<WorkerProc>,
    /// A keep-alive client.
    pub http: Http,
    spec: FleetSpec,
}

impl Fleet {
    /// Starts NATS, the routers and the workers, and waits until every router has every
    /// worker registered and synced.
    pub async fn start(spec: FleetSpec) -> anyhow::Result<Fleet> {
        let nats = if spec.nats_servers > 1 {
            NatsServer::cluster(spec.nats_servers)?
        } else {
            vec![NatsServer::start_with_config(&spec.nats_config)?]
        };
        let mut fleet = Fleet {
            nats,
            routers: Vec::new(),
            workers: Vec::new(),
            http: Http::default(),
            spec: spec.clone(),
        };
        for _ in 0..spec.routers {
            fleet.add_router(&spec.router_args)?;
        }
        for w in &spec.workers {
            fleet.add_worker(w)?;
        }
        fleet.wait_synced(Duration::from_secs(30)).await?;
        Ok(fleet)
    }

    /// The NATS URL(s), as `--nats` takes them.
    pub fn nats_url(&self) -> String {
        urls(&self.nats)
    }

    /// Starts one more router replica.
    pub fn add_router(&mut self, extra: &[String]) -> anyhow::Result<usize> {
        let (port, admin_port) = (free_port(), free_port());
        let mut args: Vec<String> = [
            "serve",
            "--nats",
            &self.nats_url(),
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--admin-port",
            &admin_port.to_string(),
            "--lease-ttl-ms",
            &self.spec.lease_ttl_ms.to_string(),
            "--registry-replicas",
            &self.spec.registry_replicas.to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if self.spec.route_headers {
            args.push("--route-headers".into());
        }
        args.extend(extra.iter().cloned());
        let proc = Proc::start_env("kvroute", &args, &self.spec.env)?;
        self.routers.push(RouterProc {
            proc,
            port,
            admin_port,
            args,
        });
        Ok(self.routers.len() - 1)
    }

    /// Starts one more worker (its id is its port).
    pub fn add_worker(&mut self, w: &WorkerSpec) -> anyhow::Result<usize> {
        let port = free_port();
        let mut args: Vec<String> = [
            "--nats",
            &self.nats_url(),
            "--port",
            &port.to_string(),
            "--id",
            &port.to_string(),
            "--heartbeat-ms",
            &self.spec.heartbeat_ms.to_string(),
            "--lease-ttl-ms",
            &self.spec.lease_ttl_ms.to_string(),
            "--registry-replicas",
            &self.spec.registry_replicas.to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        // A sidecar runs no engine of its own: the simulated engine's flags are refused.
        if !w.args.iter().any(|a| a == "--engine") {
            args.extend(["--speedup".to_string(), self.spec.speedup.to_string()]);
        }
        // An empty model: none given (a sidecar then reads the engine's).
        if !w.model.is_empty() {
            args.extend(["--model".to_string(), w.model.clone()]);
        }
        args.extend(w.args.iter().cloned());
        let proc = Proc::start_env("kvroute-worker", &args, &self.spec.env)?;
        self.workers.push(WorkerProc { proc, port, args });
        Ok(self.workers.len() - 1)
    }

    /// Restarts worker `i` in place (same port, same id, new epoch).
    pub fn restart_worker(&mut self, i: usize) -> anyhow::Result<()> {
        let w = &mut self.workers[i];
        w.proc.kill();
        w.proc = Proc::start_env("kvroute-worker", &w.args, &self.spec.env)?;
        Ok(())
    }

    /// Restarts router `i` in place.
    pub fn restart_router(&mut self, i: usize) -> anyhow::Result<()> {
        let r = &mut self.routers[i];
        r.proc.kill();
        r.proc = Proc::start_env("kvroute", &r.args, &self.spec.env)?;
        Ok(())
    }

    /// The first router's API URL.
    pub fn url(&self) -> String {
        self.routers[0].url()
    }

    /// `GET /admin/workers` of router `i`.
    pub async fn admin_workers(&self, i: usize) -> anyhow::Result<serde_json::Value> {
        let token = self
            .spec
            .env
            .iter()
            .find(|(k, _)| k == "KVROUTE_ADMIN_TOKEN")
            .map(|(_, t)| format!("Bearer {t}"));
        let headers: Vec<(&str, &str)> = token
            .iter()
            .map(|t| ("authorization", t.as_str()))
            .collect();
        let r = self
            .http
            .call_with(
                "GET",
                &format!("{}/admin/workers", self.routers[i].admin()),
                "",
                &headers,
            )
            .await?;
        serde_json::from_str(&r.body).with_context(|| format!("admin body {}", r.body))
    }

    /// Open bookings on router `i`.
    pub async fn open_bookings(&self, i: usize) -> anyhow::Result<u64> {
        let v = self.admin_workers(i).await?;
        v["bookings"]["open"]
            .as_u64()
            .context("bookings.open missing")
    }

    /// Waits until every router lists every live worker, synced.
    pub async fn wait_synced(&self, limit: Duration) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + limit;
        let want = self.workers.len();
        let mut last = String::new();
        loop {
            let mut all = true;
            for i in 0..self.routers.len() {
                let ok = match self.admin_workers(i).await {
                    Ok(v) => {
                        let ws = v["workers"].as_array().cloned().unwrap_or_default();
                        last = v.to_string();
                        ws.len() == want && ws.iter().all(|w| w["synced"] == true)
                    }
                    Err(e) => {
                        last = format!("{e:#}");
                        false
                    }
                };
                all &= ok;
            }
            if all {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                bail!("fleet not synced within {limit:?}: {last}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until every router follows worker `i`'s current incarnation (after a restart,
    /// the old one may still be listed, synced, for a moment).
    pub async fn wait_incarnation(&self, i: usize, limit: Duration) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + limit;
        let w = &self.workers[i];
        loop {
            let epoch = match self
                .http
                .call("GET", &format!("{}/admin/cache", w.url()), "")
                .await
            {
                Ok(r) if r.status == 200 => serde_json::from_str::<serde_json::Value>(&r.body)
                    .ok()
                    .and_then(|v| v["epoch"].as_u64()),
                _ => None,
            };
            if let Some(epoch) = epoch {
                let mut all = true;
                for r in 0..self.routers.len() {
                    let v = self.admin_workers(r).await.unwrap_or_default();
                    all &= v["workers"].as_array().is_some_and(|ws| {
                        ws.iter().any(|x| {
                            x["id"] == w.port && x["epoch"] == epoch && x["synced"] == true
                        })
                    });
                }
                if all {
                    return Ok(());
                }
            }
            if tokio::time::Instant::now() > deadline {
                bail!(
                    "worker {} not followed in its new incarnation within {limit:?}",
                    w.port
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until `check` holds, polling every 50 ms, up to `limit`.
    pub async fn until<F, Fut>(&self, limit: Duration, mut check: F) -> bool
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if check().await {
                return true;
            }
            if tokio::time::Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The first router's Prometheus scrape (`/metrics`).
    pub async fn scrape(&self) -> anyhow::Result<String> {
        Ok(self
            .http
            .call("GET", &format!("{}/metrics", self.url()), "")
            .await?
            .body)
    }

    /// Sets worker `i`'s injected faults (it must run with `--fault-injection`).
    pub async fn faults(&self, i: usize, faults: serde_json::Value) -> anyhow::Result<()> {
        let r = self
            .http
            .call(
                "POST",
                &format!("{}/admin/faults", self.workers[i].url()),
                faults.to_string(),
            )
            .await?;
        if r.status != 200 {
            bail!("faults: {} {}", r.status, r.body);
        }
        Ok(())
    }
}

/// A completion request body.
pub fn completion(model: &str, prompt: &str, max_tokens: u32, stream: bool) -> String {
    serde_json::json!({"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream})
        .to_string()
}
