//! The router as the official `openai` Python client sees it: completions and chat
//! completions, streamed and not, every body and chunk validated against OpenAI's published
//! schema (`tests/openai/conformance.py`; `scripts/test` installs the client into `.venv`).
#![allow(missing_docs, clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::Command;

use kvroute_e2e::fleet::{Fleet, FleetSpec, WorkerSpec};

fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("KVROUTE_PYTHON") {
        return PathBuf::from(p);
    }
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.venv/bin/python"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_client_gets_schema_valid_answers() {
    let f = Fleet::start(FleetSpec {
        workers: vec![WorkerSpec::model("kvroute-sim"); 2],
        ..FleetSpec::default()
    })
    .await
    .unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/openai/conformance.py");
    let base = format!("{}/v1", f.url());
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python())
            .args([
                script,
                "--base-url",
                &base,
                "--model",
                "kvroute-sim",
                "--rounds",
                "3",
            ])
            .output()
    })
    .await
    .unwrap()
    .expect("python with the openai client (run scripts/test, which installs it into .venv)");
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "conformance failed:\n{text}\n{err}");
    assert!(text.contains(" 0 failed"), "{text}");
}
