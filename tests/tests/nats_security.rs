//! Who may talk to the fleet, and a registry that survives a NATS server: routers and
//! workers against real nats-servers that require a token, an nkey, or user/password over
//! mutual TLS (with negative controls), and a 3-server JetStream cluster losing the server
//! that leads the registry while workers register and requests are routed, or two of its
//! servers (no quorum: the registry takes no heartbeats, and no lease may lapse meanwhile).
#![allow(missing_docs, clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use kvroute_e2e::fleet::{Fleet, FleetSpec, WorkerSpec, completion};
use kvroute_e2e::procs::binary;

fn fixture(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/nats-tls")
        .join(name)
        .display()
        .to_string()
}

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

async fn serves(f: &Fleet) {
    let r = f
        .http
        .call(
            "POST",
            &format!("{}/v1/completions", f.url()),
            completion("kvroute-sim", "hello there", 2, false),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
}

/// `kvroute serve` with `env` against `nats`: it must fail within 30 s, naming why.
fn refused(nats: &str, env: &[(String, String)], why: &[&str]) {
    let mut child = Command::new(binary("kvroute").unwrap())
        .args([
            "serve",
            "--nats",
            nats,
            "--port",
            "0",
            "--admin-port",
            "0",
            "--registry-replicas",
            "1",
        ])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("a router with wrong credentials kept running");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    use std::io::Read;
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(!status.success());
    let lower = err.to_lowercase();
    assert!(why.iter().any(|w| lower.contains(w)), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_is_required_and_used() {
    let f = Fleet::start(FleetSpec {
        nats_config: "authorization { token: \"t0ken-for-tests\" }".into(),
        env: env(&[("KVROUTE_NATS_TOKEN", "t0ken-for-tests")]),
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    serves(&f).await;
    refused(&f.nats_url(), &[], &["authorization"]);
    refused(
        &f.nats_url(),
        &env(&[("KVROUTE_NATS_TOKEN", "wrong")]),
        &["authorization"],
    );
}

/// Credentials in the NATS URL authenticate (async-nats itself does not send them), and
/// wrong ones are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_in_the_url_authenticate() {
    let f = Fleet::start(FleetSpec {
        nats_config:
            "authorization { users: [ { user: \"kvroute\", password: \"pw-for-tests\" } ] }".into(),
        env: env(&[
            ("KVROUTE_NATS_USER", "kvroute"),
            ("KVROUTE_NATS_PASSWORD", "pw-for-tests"),
        ]),
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    let with = |userinfo: &str| {
        f.nats_url()
            .replace("nats://", &format!("nats://{userinfo}@"))
    };
    let connect = |url: String| async move {
        kvroute::events::transport::Transport::connect_nats(&url, "test", &Default::default()).await
    };
    connect(with("kvroute:pw-for-tests"))
        .await
        .expect("the URL's credentials were not used");
    assert!(connect(with("kvroute:nope")).await.is_err());
    assert!(connect(f.nats_url()).await.is_err());
}

/// A test-only nkey pair (generated for these tests; it guards nothing else).
const NKEY_SEED: &str = "SUAEWAKPHKSWMIVQVL6XG2BJQVPG3HWVLVS2HSS4NPVFJZDE5H2UB3XS3Y";
const NKEY_PUBLIC: &str = "UBNDUHKS4NP2VKEU4SIME3XDFZVWZXDV6CQYDMOUKXSZZF3SEJDY3LIR";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_nkey_seed_file_authenticates() {
    let seed = std::env::temp_dir().join(format!("kvroute-nkey-{}.nk", std::process::id()));
    std::fs::write(&seed, NKEY_SEED).unwrap();
    let f = Fleet::start(FleetSpec {
        nats_config: format!("authorization {{ users: [ {{ nkey: \"{NKEY_PUBLIC}\" }} ] }}"),
        env: env(&[("KVROUTE_NATS_NKEY_SEED_FILE", seed.to_str().unwrap())]),
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    serves(&f).await;
    refused(&f.nats_url(), &[], &["authorization"]);
    let _ = std::fs::remove_file(&seed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_and_password_over_mutual_tls() {
    let config = format!(
        "authorization {{ users: [ {{ user: \"kvroute\", password: \"pw-for-tests\" }} ] }}\n\
         tls {{ cert_file: \"{}\", key_file: \"{}\", ca_file: \"{}\", verify: true, timeout: 2 }}\n",
        fixture("server-cert.pem"),
        fixture("server-key.pem"),
        fixture("ca.pem"),
    );
    let credentials = [
        ("KVROUTE_NATS_USER", "kvroute".to_string()),
        ("KVROUTE_NATS_PASSWORD", "pw-for-tests".to_string()),
        ("KVROUTE_NATS_TLS_CA_FILE", fixture("ca.pem")),
    ];
    let mut full: Vec<(String, String)> = credentials
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    full.push((
        "KVROUTE_NATS_TLS_CERT_FILE".into(),
        fixture("client-cert.pem"),
    ));
    full.push((
        "KVROUTE_NATS_TLS_KEY_FILE".into(),
        fixture("client-key.pem"),
    ));
    let f = Fleet::start(FleetSpec {
        nats_config: config,
        env: full.clone(),
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    serves(&f).await;
    // No client certificate: the server refuses the TLS handshake.
    let no_cert: Vec<(String, String)> = full[..3].to_vec();
    refused(
        &f.nats_url(),
        &no_cert,
        &["tls", "certificate", "alert", "handshake"],
    );
    // Not the server's CA: the client refuses the server.
    let mut wrong_ca = full.clone();
    wrong_ca[2].1 = fixture("client-cert.pem");
    refused(
        &f.nats_url(),
        &wrong_ca,
        &["tls", "certificate", "issuer", "unknown"],
    );
    // Right TLS, wrong password.
    let mut wrong_pw = full.clone();
    wrong_pw[1].1 = "nope".into();
    refused(&f.nats_url(), &wrong_pw, &["authorization"]);
}

/// The registry bucket is replicated over a 3-server JetStream cluster: killing the server
/// that leads it interrupts neither routing nor registration for longer than an election.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registry_survives_the_loss_of_its_leader() {
    let mut f = Fleet::start(FleetSpec {
        nats_servers: 3,
        registry_replicas: 3,
        workers: vec![WorkerSpec::model("kvroute-sim"); 2],
        // Longer than a JetStream election (4–9 s): no lease may lapse meanwhile.
        heartbeat_ms: 500,
        lease_ttl_ms: 20_000,
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    let client = kvroute::events::transport::Transport::connect_nats(
        &f.nats_url(),
        "test",
        &Default::default(),
    )
    .await
    .unwrap();
    let client = client.nats_client().unwrap().clone();
    let info = |client: async_nats::Client| async move {
        let reply = client
            .request("$JS.API.STREAM.INFO.KV_kvroute-default-workers", "".into())
            .await
            .unwrap();
        serde_json::from_slice::<serde_json::Value>(&reply.payload).unwrap()
    };
    let v = info(client.clone()).await;
    assert_eq!(v["config"]["num_replicas"], 3, "{v}");
    let leader = v["cluster"]["leader"].as_str().unwrap().to_owned();
    let i = f.nats.iter().position(|s| s.name() == leader).unwrap();
    f.nats[i].kill();
    // Requests keep being routed throughout, and a new worker registers.
    let new = f.add_worker(&WorkerSpec::model("kvroute-sim")).unwrap();
    let port = f.workers[new].port;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(40);
    let mut registered = false;
    let mut sent = 0;
    while tokio::time::Instant::now() < deadline && !(registered && sent >= 50) {
        serves(&f).await;
        sent += 1;
        let v = f.admin_workers(0).await.unwrap();
        registered = v["workers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|w| w["id"] == port && w["synced"] == true);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        registered,
        "a worker started after the leader died never registered"
    );
    assert_eq!(
        f.admin_workers(0).await.unwrap()["workers"]
            .as_array()
            .unwrap()
            .len(),
        3
    );
    // The killed server rejoins: it holds a current copy of the bucket again (its replica,
    // or its leader).
    f.nats[i].restart().unwrap();
    let name = f.nats[i].name().to_owned();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let reply = client
            .request("$JS.API.STREAM.INFO.KV_kvroute-default-workers", "".into())
            .await;
        let v = reply
            .ok()
            .and_then(|r| serde_json::from_slice::<serde_json::Value>(&r.payload).ok())
            .unwrap_or_default();
        let cluster = &v["cluster"];
        let current = cluster["leader"] == name.as_str()
            || cluster["replicas"].as_array().is_some_and(|rs| {
                rs.iter()
                    .any(|r| r["name"] == name.as_str() && r["current"] == true)
            });
        if current {
            assert_eq!(v["config"]["num_replicas"], 3, "{v}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the restarted server never caught up with the bucket: {v}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A registry without a quorum takes no heartbeats: for several leases' time, every request
/// is routed and no worker is dropped, because a router that cannot write to the registry
/// either lets no lease lapse. Once the quorum is back, a new worker registers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_worker_is_dropped_while_the_registry_has_no_quorum() {
    let mut f = Fleet::start(FleetSpec {
        nats_servers: 3,
        registry_replicas: 3,
        workers: vec![WorkerSpec::model("kvroute-sim"); 2],
        heartbeat_ms: 300,
        lease_ttl_ms: 5_000,
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    f.nats[1].kill();
    f.nats[2].kill();
    // Three leases' time without a quorum.
    let until = tokio::time::Instant::now() + Duration::from_secs(15);
    while tokio::time::Instant::now() < until {
        serves(&f).await;
        let v = f.admin_workers(0).await.unwrap();
        assert_eq!(v["workers"].as_array().unwrap().len(), 2, "{v}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    f.nats[1].restart().unwrap();
    f.nats[2].restart().unwrap();
    let new = f.add_worker(&WorkerSpec::model("kvroute-sim")).unwrap();
    let port = f.workers[new].port;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let v = f.admin_workers(0).await.unwrap();
        let ws = v["workers"].as_array().unwrap();
        if ws.len() == 3 && ws.iter().any(|w| w["id"] == port && w["synced"] == true) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no worker registered after the quorum came back: {v}"
        );
        serves(&f).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
