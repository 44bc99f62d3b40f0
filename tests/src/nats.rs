//! `nats-server -js` processes of the test's own, on free loopback ports, each with its own
//! store: one server, one with extra configuration (authentication, TLS), or a cluster.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// A running server; killed on drop.
pub struct NatsServer {
    port: u16,
    store: PathBuf,
    /// Flags beyond port and store (configuration file, cluster).
    extra: Vec<String>,
    name: String,
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

/// A free loopback port none of this binary's tests was handed before
/// ([`crate::procs::free_port`]: a port just released could go to a router or worker of a
/// test running beside this one).
fn free_port() -> anyhow::Result<u16> {
    match crate::procs::free_port() {
        0 => bail!("no free loopback port"),
        port => Ok(port),
    }
}

impl NatsServer {
    /// Starts a server with JetStream.
    pub fn start() -> anyhow::Result<NatsServer> {
        NatsServer::start_with_config("")
    }

    /// Starts a server with JetStream and `config` (nats-server configuration syntax, e.g.
    /// an `authorization {}` or `tls {}` block).
    pub fn start_with_config(config: &str) -> anyhow::Result<NatsServer> {
        let mut server = NatsServer::new("solo")?;
        if !config.is_empty() {
            let path = server.store.with_extension("conf");
            std::fs::write(&path, config)?;
            server.extra = vec!["-c".into(), path.display().to_string()];
        }
        server.spawn()?;
        Ok(server)
    }

    /// Starts a JetStream cluster of `n` servers routed to each other (its meta leader is
    /// elected within a second; clients retry until then).
    pub fn cluster(n: usize) -> anyhow::Result<Vec<NatsServer>> {
        let routes: Vec<u16> = (0..n).map(|_| free_port()).collect::<anyhow::Result<_>>()?;
        let cluster = format!("kvroute-test-{}", routes[0]);
        let mut servers = Vec::new();
        for (i, route) in routes.iter().enumerate() {
            let mut s = NatsServer::new(&format!("n{i}-{}", routes[0]))?;
            let others: Vec<String> = routes
                .iter()
                .filter(|r| *r != route)
                .map(|r| format!("nats-route://127.0.0.1:{r}"))
                .collect();
            s.extra = vec![
                "-n".into(),
                s.name.clone(),
                "--cluster_name".into(),
                cluster.clone(),
                "--cluster".into(),
                format!("nats://127.0.0.1:{route}"),
                "--routes".into(),
                others.join(","),
            ];
            servers.push(s);
        }
        for s in &mut servers {
            s.spawn()?;
        }
        Ok(servers)
    }

    fn new(name: &str) -> anyhow::Result<NatsServer> {
        let port = free_port()?;
        let store =
            std::env::temp_dir().join(format!("kvroute-nats-{}-{port}-{name}", std::process::id()));
        Ok(NatsServer {
            port,
            store,
            extra: Vec::new(),
            name: name.to_owned(),
            child: None,
        })
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
            .args(&self.extra)
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

    /// Its server name (what JetStream calls its leaders by).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Kills the server (as a crash would).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops the server's process (SIGSTOP) without closing anything: its clients stay
    /// connected and nothing they send moves, as behind a half-open connection.
    pub fn pause(&self) {
        self.signal("STOP");
    }

    /// Lets a paused server go on (SIGCONT).
    pub fn resume(&self) {
        self.signal("CONT");
    }

    fn signal(&self, name: &str) {
        if let Some(child) = &self.child {
            crate::procs::signal(child.id(), name).expect("signal the server");
        }
    }

    /// Starts it again on the same port and store.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        self.spawn()
    }

    /// Starts it again on the same port with an empty store (a pod whose `emptyDir` went
    /// with it): every stream and bucket is gone.
    pub fn restart_empty(&mut self) -> anyhow::Result<()> {
        self.kill();
        if self.store.exists() {
            std::fs::remove_dir_all(&self.store)
                .with_context(|| format!("removing {}", self.store.display()))?;
        }
        self.spawn()
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.store);
        let _ = std::fs::remove_file(self.store.with_extension("conf"));
    }
}

/// The URLs of several servers, comma-separated (as `--nats` takes them).
pub fn urls(servers: &[NatsServer]) -> String {
    servers
        .iter()
        .map(NatsServer::url)
        .collect::<Vec<_>>()
        .join(",")
}
