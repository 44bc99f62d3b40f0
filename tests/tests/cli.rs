//! The `kvroute` command beyond `serve`'s routing: the embedded fleet (`kvroute up`), the
//! drain on SIGTERM, and settings from `--config` checked by `--dry-run`.
#![allow(missing_docs, clippy::unwrap_used)]

use std::process::Command;
use std::time::Duration;

use kvroute_e2e::procs::{Http, Proc, binary, free_port};

/// `kvroute up` on free ports, once `/ready` answers 200: the process, the API URL, the
/// admin URL.
async fn up(args: &[&str]) -> (Proc, String, String, Http) {
    let (port, admin_port) = (free_port(), free_port());
    let mut all = vec![
        "up".to_string(),
        "--port".into(),
        port.to_string(),
        "--admin-port".into(),
        admin_port.to_string(),
    ];
    all.extend(args.iter().map(|s| s.to_string()));
    let proc = Proc::start("kvroute", &all).unwrap();
    let url = format!("http://127.0.0.1:{port}");
    let admin = format!("http://127.0.0.1:{admin_port}");
    let http = Http::default();
    for _ in 0..200 {
        if let Ok(r) = http.call("GET", &format!("{url}/ready"), "").await
            && r.status == 200
        {
            return (proc, url, admin, http);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("kvroute up not ready");
}

/// The soft and hard "Max open files" of process `pid`, from `/proc` (Linux).
fn open_files_limits(pid: u32) -> Option<(u64, u64)> {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    let mut numbers = line["Max open files".len()..].split_whitespace();
    let mut next = || match numbers.next()? {
        "unlimited" => Some(u64::MAX),
        n => n.parse().ok(),
    };
    Some((next()?, next()?))
}

#[tokio::test]
async fn a_low_soft_open_files_limit_is_raised_to_the_hard_one() {
    let Some((_, hard)) = open_files_limits(std::process::id()) else {
        eprintln!("skipped: no /proc/self/limits");
        return;
    };
    if hard <= 256 {
        eprintln!("skipped: the hard limit ({hard}) leaves nothing to raise");
        return;
    }
    let (port, admin_port) = (free_port(), free_port());
    // A container's usual soft limit is 1024; 256 here, below what the router needs.
    let mut command = Command::new("sh");
    command
        .arg("-c")
        .arg(r#"ulimit -Sn 256 && exec "$0" "$@""#)
        .arg(binary("kvroute").unwrap())
        .args(["up", "--workers", "1", "--port", &port.to_string()])
        .args(["--admin-port", &admin_port.to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let proc = Proc::spawn(command).unwrap();
    let http = Http::default();
    let url = format!("http://127.0.0.1:{port}/ready");
    let mut ready = false;
    for _ in 0..200 {
        if let Ok(r) = http.call("GET", &url, "").await
            && r.status == 200
        {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ready, "kvroute up not ready");
    let (soft, hard_now) = open_files_limits(proc.id()).unwrap();
    assert_eq!(hard_now, hard);
    assert_eq!(soft, hard, "the soft limit stayed at {soft}");
}

/// An in-process worker whose engine fails leaves the fleet and the other serves on: it
/// stayed registered, heartbeating, and every request sent to it failed.
#[tokio::test]
async fn up_drops_a_worker_whose_engine_failed() {
    let (_up, url, admin, http) =
        up(&["--workers", "2", "--speedup", "20", "--fault-injection"]).await;
    let listed = |body: &str| -> Vec<String> {
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        v["workers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w["url"].as_str().unwrap().to_owned())
            .collect()
    };
    let workers = http
        .call("GET", &format!("{admin}/admin/workers"), "")
        .await
        .unwrap();
    let urls = listed(&workers.body);
    assert_eq!(urls.len(), 2, "{}", workers.body);
    let r = http
        .call(
            "POST",
            &format!("{}/admin/faults", urls[0]),
            r#"{"fail_engine":true}"#,
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let mut left = false;
    for _ in 0..600 {
        let workers = http
            .call("GET", &format!("{admin}/admin/workers"), "")
            .await
            .unwrap();
        if listed(&workers.body) == urls[1..] {
            left = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(left, "the failed worker is still in the fleet");
    for _ in 0..4 {
        let r = http
            .call(
                "POST",
                &format!("{url}/v1/completions"),
                r#"{"model":"kvroute-sim","prompt":"Hello there","max_tokens":2}"#,
            )
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
    }
}

#[tokio::test]
async fn up_serves_openai_requests_without_nats() {
    let (_up, url, admin, http) = up(&["--workers", "2", "--speedup", "20"]).await;
    let workers = http
        .call("GET", &format!("{admin}/admin/workers"), "")
        .await
        .unwrap();
    assert_eq!(
        workers.body.matches("\"synced\":true").count(),
        2,
        "{}",
        workers.body
    );
    let chat = r#"{"model":"kvroute-sim","messages":[{"role":"user","content":"Hello there"}],"max_tokens":8,"stream":true}"#;
    let streamed = http
        .call("POST", &format!("{url}/v1/chat/completions"), chat)
        .await
        .unwrap();
    assert_eq!(streamed.status, 200, "{}", streamed.body);
    assert!(streamed.header("x-kvroute-worker").is_some());
    assert_eq!(
        streamed.body.matches("chat.completion.chunk").count(),
        9,
        "{}",
        streamed.body
    );
    assert!(
        streamed.body.ends_with("data: [DONE]\n\n"),
        "{}",
        streamed.body
    );
    let plain = http
        .call(
            "POST",
            &format!("{url}/v1/completions"),
            r#"{"model":"kvroute-sim","prompt":"Hello there","max_tokens":4}"#,
        )
        .await
        .unwrap();
    assert_eq!(plain.status, 200, "{}", plain.body);
    let v: serde_json::Value = serde_json::from_str(&plain.body).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 4);
}

/// Sends a streamed completion of `max_tokens` and returns once the router shows it booked.
async fn stream_in_flight(
    http: &Http,
    url: &str,
    admin: &str,
    max_tokens: u32,
) -> tokio::task::JoinHandle<anyhow::Result<kvroute_e2e::procs::Reply>> {
    let body = format!(
        r#"{{"model":"kvroute-sim","prompt":"a long answer please","max_tokens":{max_tokens},"stream":true}}"#
    );
    let request = {
        let (http, url) = (http.clone(), url.to_owned());
        tokio::spawn(async move {
            http.call("POST", &format!("{url}/v1/completions"), body)
                .await
        })
    };
    in_flight(http, admin).await;
    request
}

/// Waits until the router shows one request booked (in flight).
async fn in_flight(http: &Http, admin: &str) {
    for _ in 0..200 {
        let w = http
            .call("GET", &format!("{admin}/admin/workers"), "")
            .await
            .unwrap();
        if w.body.contains("\"booked_requests\":1") {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the request never showed in /admin/workers");
}

/// A second SIGTERM (Ctrl-C twice) exits at once instead of waiting out the drain.
#[tokio::test]
async fn a_second_signal_exits_without_waiting_for_the_drain() {
    let (mut up, url, admin, http) = up(&["--workers", "1"]).await;
    // At speed 1, 5,000 tokens take minutes: the drain (30 s) would wait for them.
    let _request = stream_in_flight(&http, &url, &admin, 5000).await;
    up.terminate().unwrap();
    // The first signal is heard once the router stops being ready (it drains).
    let mut draining = false;
    for _ in 0..400 {
        match http.call("GET", &format!("{url}/ready"), "").await {
            Ok(r) if r.status == 200 => tokio::time::sleep(Duration::from_millis(5)).await,
            _ => {
                draining = true;
                break;
            }
        }
    }
    assert!(draining, "the router never began to drain");
    up.terminate().unwrap();
    let status = up
        .wait_timeout(Duration::from_secs(10))
        .expect("still draining after a second SIGTERM");
    assert_eq!(status.code(), Some(130), "{status:?}");
}

#[tokio::test]
async fn sigterm_lets_streams_in_flight_finish_then_exits() {
    // Speed 1: 200 decode steps take the timing model's real time (hundreds of ms).
    let (mut up, url, admin, http) = up(&["--workers", "1"]).await;
    let request = stream_in_flight(&http, &url, &admin, 200).await;
    up.terminate().unwrap();
    let reply = request.await.unwrap().unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.body.matches("text_completion").count(),
        201,
        "{}",
        reply.body
    );
    assert!(reply.body.ends_with("data: [DONE]\n\n"));
    let status = up
        .wait_timeout(Duration::from_secs(10))
        .expect("exits after the drain");
    assert!(status.success(), "{status:?}");
    assert!(
        Http::default()
            .call("GET", &format!("{url}/health"), "")
            .await
            .is_err()
    );
}

#[test]
fn serve_dry_run_merges_flags_over_the_config_file_and_names_bad_keys() {
    let dir = std::env::temp_dir().join(format!("kvroute-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("router.toml");
    std::fs::write(
        &good,
        "port = 9100\npolicy = \"least_loaded\"\nmax_inflight = 7\n",
    )
    .unwrap();
    let out = Command::new(binary("kvroute").unwrap())
        .args([
            "serve",
            "--config",
            good.to_str().unwrap(),
            "--port",
            "9200",
            "--dry-run",
        ])
        .env_remove("KVROUTE_PORT")
        .env("KVROUTE_RETRIES", "5")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["port"], 9200);
    assert_eq!(v["scheduler"]["policy"], "least_loaded");
    assert_eq!(v["ingress"]["max_inflight"], 7);
    assert_eq!(v["ingress"]["retries"], 5);
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "port = 9100\nmax_in_flight = 7\n").unwrap();
    let out = Command::new(binary("kvroute").unwrap())
        .args(["serve", "--config", bad.to_str().unwrap(), "--dry-run"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("line 2") && err.contains("max_in_flight"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every float setting must be a finite number in range: `--decode-weight NaN` once passed
/// `--dry-run` and then panicked on every request.
#[test]
fn dry_run_refuses_non_finite_weights() {
    for (flag, value) in [
        ("--decode-weight", "NaN"),
        ("--prefill-scale", "inf"),
        ("--temperature=-1", ""),
    ] {
        let mut args = vec!["serve", flag];
        if !value.is_empty() {
            args.push(value);
        }
        args.push("--dry-run");
        let out = Command::new(binary("kvroute").unwrap())
            .args(&args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{flag} {value} accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("finite"), "{flag} {value}: {err}");
    }
    let out = Command::new(binary("kvroute-worker").unwrap())
        .args(["--speedup", "NaN", "--dry-run"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    // A worker checks its cluster name as routers do: a `.` names other subjects, and NATS
    // refuses it as a bucket name after a minute of retries.
    let out = Command::new(binary("kvroute-worker").unwrap())
        .args(["--cluster", "prod.eu", "--dry-run"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cluster"));
    // A tokenizer that cannot be opened fails the check, not the worker's start.
    let out = Command::new(binary("kvroute-worker").unwrap())
        .args(["--tokenizer", "/nonexistent/tokenizer.json", "--dry-run"])
        .output()
        .unwrap();
    assert!(
        !out.status.success(),
        "a missing tokenizer passed --dry-run"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("--tokenizer"));
}

/// Secrets given in the environment never show in `--dry-run`.
#[test]
fn dry_run_redacts_secrets() {
    let out = Command::new(binary("kvroute").unwrap())
        .args(["serve", "--dry-run"])
        .env("KVROUTE_NATS_TOKEN", "tok-123")
        .env("KVROUTE_API_KEYS", "key-a,key-b")
        .env("KVROUTE_ADMIN_TOKEN", "adm-456")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    for secret in ["tok-123", "key-a", "key-b", "adm-456"] {
        assert!(!text.contains(secret), "{secret} printed: {text}");
    }
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["ingress"]["api_keys"].as_array().unwrap().len(), 2);
}

/// The worker prints its NATS URL without the credentials in it.
#[test]
fn worker_dry_run_redacts_the_nats_url_s_credentials() {
    let out = Command::new(binary("kvroute-worker").unwrap())
        .arg("--dry-run")
        .env("KVROUTE_NATS", "nats://u:hunter2@n1:4222")
        .env("KVROUTE_NATS_TOKEN", "tok-123")
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        !text.contains("hunter2") && !text.contains("tok-123"),
        "{text}"
    );
    assert!(text.contains("n1:4222"), "{text}");
}

/// A worker listening on every address must be told the URL it registers (it registered
/// `http://0.0.0.0:PORT`). Control: with `--url`.
#[test]
fn a_worker_on_every_address_needs_its_url() {
    let run = |extra: &[&str]| {
        Command::new(binary("kvroute-worker").unwrap())
            .args(["--host", "0.0.0.0", "--dry-run"])
            .args(extra)
            .output()
            .unwrap()
    };
    let out = run(&[]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--url"));
    assert!(run(&["--url", "http://worker-0:9000"]).status.success());
}

/// A sidecar's settings are checked before it starts, and by `--dry-run`: each of these
/// left a process that never registered its engine and never exited, or (the simulated
/// engine's flags) was ignored without a word. Control: the same command with good values
/// passes.
#[test]
fn sidecar_settings_are_checked_at_start() {
    let good = [
        "--engine",
        "vllm",
        "--engine-url",
        "http://127.0.0.1:8000",
        "--kv-events",
        "tcp://127.0.0.1:5557",
        "--dry-run",
    ];
    let run = |extra: &[&str]| {
        Command::new(binary("kvroute-worker").unwrap())
            .args(good)
            .args(extra)
            .output()
            .unwrap()
    };
    let ok = run(&[]);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    for bad in [
        &["--engine-dp-size", "0"][..],
        &["--engine-dp-size", "5000"],
        &["--block-size", "100000"],
        &["--model", "my model"],
        &["--device", "cuda:0"],
        &["--kv-replay", "udp://x"],
        &[
            "--kv-events",
            "tcp://127.0.0.1:65535",
            "--engine-dp-size",
            "2",
        ],
        &["--engine-url", "https://engine:8000"],
        // The simulated engine's settings: a sidecar has no engine of its own to apply them
        // to (they were ignored without a word).
        &["--g1-blocks", "1000"],
        &["--speedup", "10"],
        &["--tokenizer", "/models/tokenizer.json"],
        &["--fault-injection"],
        &["--api-key", "k"],
        // Routers reach a sidecar's engine at --engine-url, which it registers.
        &["--url", "http://10.0.0.5:8000"],
        // A mirror larger than one snapshot carries: routers could never resync from it.
        &["--engine-max-blocks", "20000000"],
        // The simulated worker's drain and linger: the engine drains its own requests.
        &["--drain-timeout-ms", "60000"],
        &["--failure-linger-ms", "1000"],
    ] {
        let out = run(bad);
        assert!(!out.status.success(), "{bad:?} accepted");
        assert!(!out.stderr.is_empty(), "{bad:?}: no reason given");
    }
}

/// A router or worker still waiting for NATS at start (it retries without end) stops on
/// SIGTERM, with status 0: in a container it is PID 1, which ignores SIGTERM unless a handler
/// is installed, so before the fix the kubelet had to wait for its SIGKILL.
#[tokio::test]
async fn sigterm_stops_a_start_up_waiting_for_nats() {
    let dir = std::env::temp_dir().join(format!("kvroute-e2e-startup-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // Nothing listens on this port: the NATS connect is retried.
    let nats = format!("nats://127.0.0.1:{}", free_port());
    let cases = [
        (
            "kvroute",
            vec![
                "serve".to_string(),
                "--nats".into(),
                nats.clone(),
                "--port".into(),
                free_port().to_string(),
                "--admin-port".into(),
                free_port().to_string(),
            ],
        ),
        (
            "kvroute-worker",
            vec!["--nats".into(), nats.clone(), "--port".into(), "0".into()],
        ),
    ];
    for (name, args) in cases {
        let log = dir.join(format!("{name}.log"));
        let mut proc = kvroute_e2e::procs::Proc::start_logged(name, &args, &log).unwrap();
        // Until it says it is waiting for NATS (its signal handlers are installed before).
        let mut waiting = false;
        for _ in 0..400 {
            if std::fs::read_to_string(&log).is_ok_and(|l| l.contains("cannot reach NATS yet")) {
                waiting = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        assert!(
            waiting,
            "{name} never tried NATS: {:?}",
            std::fs::read_to_string(&log)
        );
        proc.terminate().unwrap();
        let status = proc
            .wait_timeout(Duration::from_secs(20))
            .unwrap_or_else(|| panic!("{name} ignored SIGTERM while waiting for NATS"));
        assert!(status.success(), "{name}: {status:?}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A router whose port is taken fails at once, naming it, even while NATS does not answer
/// (it bound its ports only once NATS had answered, and waited for NATS without end).
#[tokio::test]
async fn a_taken_port_fails_the_start_before_nats_answers() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let dir = std::env::temp_dir().join(format!("kvroute-e2e-taken-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("kvroute.log");
    let args = [
        "serve".to_string(),
        "--nats".into(),
        format!("nats://127.0.0.1:{}", free_port()),
        "--port".into(),
        port.to_string(),
        "--admin-port".into(),
        free_port().to_string(),
    ];
    let mut proc = kvroute_e2e::procs::Proc::start_logged("kvroute", &args, &log).unwrap();
    let status = proc
        .wait_timeout(Duration::from_secs(60))
        .unwrap_or_else(|| panic!("still waiting: {:?}", std::fs::read_to_string(&log)));
    assert!(!status.success());
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains(&port.to_string()), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}

/// With every API connection taken (`--max-connections`), the kubelet's probes and
/// Prometheus's scrapes still get answers on the status listener, which has its own cap;
/// on the API port they would wait in the accept queue and fail liveness.
#[tokio::test]
async fn the_status_listener_answers_when_the_api_s_connections_are_all_taken() {
    use tokio::io::AsyncWriteExt;
    let (_router, url, status_port) = router_with_status(&["--max-connections", "2"]).await;
    let status = format!("http://127.0.0.1:{status_port}");
    // Two clients that never finish their request heads hold both API connections.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = tokio::net::TcpStream::connect(url.trim_start_matches("http://"))
            .await
            .unwrap();
        s.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n")
            .await
            .unwrap();
        held.push(s);
    }
    // The API port is full once it holds its cap of 2 connections (a probe on it would
    // wait in the accept queue from then on); the status listener's own scrape is counted
    // apart.
    let probe = Http::default();
    let mut full = false;
    for _ in 0..200 {
        let m = probe
            .call("GET", &format!("{status}/metrics"), "")
            .await
            .unwrap();
        let open = |listener: &str| {
            let series = format!("kvroute_http_connections_open{{listener=\"{listener}\"}} ");
            m.body
                .lines()
                .find_map(|l| l.strip_prefix(&series)?.trim().parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        if open("api") >= 2.0 && open("status") >= 1.0 {
            full = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(full, "the API port's connections were never all taken");
    // The status listener answers all three (readiness: whether a worker is synced), and
    // nothing else.
    for (path, answered) in [
        ("/health", &[200][..]),
        ("/ready", &[200, 503]),
        ("/metrics", &[200]),
        ("/v1/models", &[404]),
    ] {
        let r = probe
            .call("GET", &format!("{status}{path}"), "")
            .await
            .unwrap();
        assert!(
            answered.contains(&r.status),
            "{path}: {} {}",
            r.status,
            r.body
        );
        if path == "/ready" {
            assert!(r.body.contains("\"draining\":false"), "{}", r.body);
        }
    }
    drop(held);
}

/// Connections to the status listener that send nothing are closed within a second, under
/// the kubelet's probe timeout: 300 of them (more than its cap) do not keep a probe from
/// its answer. With the API's 30 s header timeout, 64 such connections held every slot and
/// probes waited in the accept queue past their timeout, restarting the router.
#[tokio::test]
async fn silent_connections_do_not_starve_the_status_listener() {
    let (_router, _url, status_port) = router_with_status(&[]).await;
    let mut silent = Vec::new();
    for _ in 0..300 {
        silent.push(
            tokio::net::TcpStream::connect(("127.0.0.1", status_port))
                .await
                .unwrap(),
        );
    }
    let probe = tokio::time::timeout(
        Duration::from_secs(10),
        Http::default().call("GET", &format!("http://127.0.0.1:{status_port}/health"), ""),
    )
    .await;
    assert!(
        probe
            .as_ref()
            .is_ok_and(|r| r.as_ref().is_ok_and(|r| r.status == 200)),
        "the probe got no answer while silent connections were open: {probe:?}"
    );
    drop(silent);
}

/// A router in direct mode before a backend that does not answer, with its status listener
/// on a port of its own on 127.0.0.1, once its API answers /health: the process, the API's
/// URL and the status port.
async fn router_with_status(extra: &[&str]) -> (kvroute_e2e::procs::Proc, String, u16) {
    let status_port = free_port();
    let engine = format!("http://127.0.0.1:{}", free_port());
    let mut args: Vec<String> = extra.iter().map(|a| (*a).to_owned()).collect();
    args.extend([
        "--status-port".into(),
        status_port.to_string(),
        "--status-host".into(),
        "127.0.0.1".into(),
    ]);
    let (router, url, _admin) = kvroute_e2e::engines::direct_router(&[engine], &args).unwrap();
    let http = Http::default();
    let mut up = false;
    for _ in 0..200 {
        if http
            .call("GET", &format!("{url}/health"), "")
            .await
            .is_ok_and(|r| r.status == 200)
        {
            up = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(up, "the router never answered /health");
    (router, url, status_port)
}
