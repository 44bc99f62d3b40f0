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

/// A binary of the workspace, next to the test executable's directory (`scripts/test`
/// builds them first).
pub fn binary(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe
        .parent()
        .and_then(|d| d.parent())
        .context("test binary location")?;
    let path = dir.join(name);
    if !path.exists() {
        bail!(
            "{} not built: run scripts/test (it builds the binaries first)",
            path.display()
        );
    }
    Ok(path)
}

/// A child process, killed on drop.
pub struct Proc {
    child: Child,
}

impl Proc {
    /// Starts `name` with `args`, output discarded.
    pub fn start(name: &str, args: &[String]) -> anyhow::Result<Proc> {
        let child = Command::new(binary(name)?)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        Ok(Proc { child })
    }

    /// Sends SIGTERM (what Kubernetes sends before killing a pod).
    pub fn terminate(&self) -> anyhow::Result<()> {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()?;
        if !status.success() {
            bail!("kill -TERM {} failed", self.child.id());
        }
        Ok(())
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

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A free loopback port.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(0)
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
        let req = hyper::Request::builder()
            .method(method)
            .uri(url)
            .header("content-type", "application/json")
            .body(Full::new(body.into()))?;
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
