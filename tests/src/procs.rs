//! The real binaries as child processes, and a small HTTP client for talking to them.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// A binary of the workspace: beside the running executable (a binary such as
/// `kvroute-bench`) or one directory up (a test executable in `deps/`; `scripts/test`
/// builds the binaries first).
pub fn binary(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe.parent().context("executable location")?;
    let candidates = [Some(dir), dir.parent()];
    for d in candidates.into_iter().flatten() {
        let path = d.join(name);
        if path.exists() {
            return Ok(path);
        }
    }
    bail!(
        "{name} not built beside {}: run scripts/test (it builds the binaries first)",
        exe.display()
    )
}

/// A child process, killed on drop.
pub struct Proc {
    child: Child,
}

impl Proc {
    /// Starts `name` with `args`, output discarded.
    pub fn start(name: &str, args: &[String]) -> anyhow::Result<Proc> {
        Proc::start_env(name, args, &[])
    }

    /// Starts `name` with `args` and environment variables `env`, output discarded (or,
    /// with `KVROUTE_E2E_LOGS=DIR`, its logs appended to `DIR/NAME.log`, for debugging).
    pub fn start_env(
        name: &str,
        args: &[String],
        env: &[(String, String)],
    ) -> anyhow::Result<Proc> {
        let stderr = match std::env::var_os("KVROUTE_E2E_LOGS") {
            Some(dir) => Stdio::from(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(std::path::Path::new(&dir).join(format!("{name}.log")))?,
            ),
            None => Stdio::null(),
        };
        let child = Command::new(binary(name)?)
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()?;
        Ok(Proc { child })
    }

    /// Starts a command already set up (its arguments, environment, a shell around it).
    pub fn spawn(mut command: Command) -> anyhow::Result<Proc> {
        let child = command.spawn()?;
        Ok(Proc { child })
    }

    /// Starts `name` with `args`, its stderr (the logs) appended to `log`.
    pub fn start_logged(
        name: &str,
        args: &[String],
        log: &std::path::Path,
    ) -> anyhow::Result<Proc> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)?;
        let child = Command::new(binary(name)?)
            .args(args)
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()?;
        Ok(Proc { child })
    }

    /// The process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal by name (`STOP`, `CONT`, `TERM`, `KILL`).
    pub fn signal(&self, name: &str) -> anyhow::Result<()> {
        signal(self.child.id(), name)
    }

    /// Whether it has exited, and how.
    pub fn try_status(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Sends SIGTERM (what Kubernetes sends before killing a pod).
    pub fn terminate(&self) -> anyhow::Result<()> {
        signal(self.child.id(), "TERM")
    }

    /// Waits up to `timeout` for it to exit on its own.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = std::time::Instant::now() + timeout;
        while std::time::Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Kills it (no goodbye).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends process `pid` a signal by name (`STOP`, `CONT`, `TERM`, `KILL`).
pub fn signal(pid: u32, name: &str) -> anyhow::Result<()> {
    let status = Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()?;
    if !status.success() {
        bail!("kill -{name} {pid} failed");
    }
    Ok(())
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Ports this process handed out (see [`free_port`]).
static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

/// A free loopback port, never one this process handed out before: tests of one binary run
/// at once, and the kernel may give a port just released to the next `bind(0)`, so two
/// processes of two tests could otherwise be told the same port.
pub fn free_port() -> u16 {
    free_ports(1)
}

/// The first of `n` consecutive free loopback ports (an engine's data-parallel ranks
/// offset its ports by the rank), none handed out before.
pub fn free_ports(n: u16) -> u16 {
    for _ in 0..1000 {
        let first = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap_or(0);
        let Some(last) = first.checked_add(n.max(1) - 1).filter(|_| first != 0) else {
            continue;
        };
        let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
        let free = (first..=last).all(|p| {
            !given.contains(&p)
                && (p == first || std::net::TcpListener::bind(("127.0.0.1", p)).is_ok())
        });
        if free {
            given.extend(first..=last);
            return first;
        }
    }
    0
}

/// A response: status, headers, body.
#[derive(Debug)]
pub struct Reply {
    /// Status code.
    pub status: u16,
    /// Headers.
    pub headers: hyper::HeaderMap,
    /// Body text.
    pub body: String,
}

impl Reply {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// A keep-alive HTTP/1.1 client.
#[derive(Clone)]
pub struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Default for Http {
    fn default() -> Self {
        let mut c = HttpConnector::new();
        c.set_nodelay(true);
        Http {
            client: Client::builder(TokioExecutor::new()).build(c),
        }
    }
}

impl Http {
    /// `method url` with `body`.
    pub async fn call(
        &self,
        method: &str,
        url: &str,
        body: impl Into<Bytes>,
    ) -> anyhow::Result<Reply> {
        self.call_with(method, url, body, &[]).await
    }

    /// `method url` with `body` and extra `headers`.
    pub async fn call_with(
        &self,
        method: &str,
        url: &str,
        body: impl Into<Bytes>,
        headers: &[(&str, &str)],
    ) -> anyhow::Result<Reply> {
        let mut req = hyper::Request::builder()
            .method(method)
            .uri(url)
            .header("content-type", "application/json");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(Full::new(body.into()))?;
        let resp =
            tokio::time::timeout(Duration::from_secs(30), self.client.request(req)).await??;
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let body =
            String::from_utf8_lossy(&resp.into_body().collect().await?.to_bytes()).into_owned();
        Ok(Reply {
            status,
            headers,
            body,
        })
    }
}

/// Sends `POST /v1/completions` with `body` on a fresh raw connection to `base` and returns
/// the connection, nothing read yet (to hold a request open, or drop it mid-way).
pub async fn send_raw(base: &str, body: &str) -> anyhow::Result<tokio::net::TcpStream> {
    use tokio::io::AsyncWriteExt;
    let mut s = tokio::net::TcpStream::connect(base.trim_start_matches("http://")).await?;
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await?;
    Ok(s)
}
