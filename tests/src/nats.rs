//! A `nats-server -js` of the test's own, on a free loopback port, with its own store.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// A running server; killed on drop.
pub struct NatsServer {
    port: u16,
    store: PathBuf,
    child: Option<Child>,
}

/// The `nats-server` binary: `$NATS_SERVER`, else `nats-server` from `PATH`, else the one
/// `scripts/test` installs into `.venv`.
fn binary() -> PathBuf {
    if let Some(path) = std::env::var_os("NATS_SERVER") {
        return PathBuf::from(path);
    }
    let venv = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../.venv/bin/nats-server"
    ));
    if venv.exists() {
        return venv;
    }
    PathBuf::from("nats-server")
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl NatsServer {
    /// Starts a server with JetStream.
    pub fn start() -> anyhow::Result<NatsServer> {
        let store = std::env::temp_dir().join(format!(
            "kvroute-nats-{}-{}",
            std::process::id(),
            free_port()?
        ));
        let mut server = NatsServer {
            port: free_port()?,
            store,
            child: None,
        };
        server.spawn()?;
        Ok(server)
    }

    fn spawn(&mut self) -> anyhow::Result<()> {
        let child = Command::new(binary())
            .args([
                "-js",
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-sd",
            ])
            .arg(&self.store)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| {
                format!(
                    "starting {} (run scripts/test, which installs it)",
                    binary().display()
                )
            })?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if Instant::now() > deadline {
                bail!(
                    "nats-server did not listen on port {} within 10 s",
                    self.port
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// The client URL.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Kills the server (as a crash would).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port and store.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        self.spawn()
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.store);
    }
}
