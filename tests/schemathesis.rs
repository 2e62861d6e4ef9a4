//! Property-based API testing with schemathesis (PyPI) against the OpenAPI
//! documents the live coordinator and node serve: every generated request,
//! valid or not, must get a documented status and a body matching the
//! schema, and no server error. First a negative-only pass over every
//! endpoint (drills and failover included): every request is invalid, so
//! every one must be refused and the cluster's leadership must not change.
//! Then a full pass over everything but the drill-starting POSTs (a valid
//! one crashes a node for seconds; tests/drills.rs covers those).

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::{Cluster, TOKEN, wait_until};

fn schemathesis() -> PathBuf {
    match std::env::var_os("WALSHIP_SCHEMATHESIS") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".walship/tools/venv/bin/schemathesis"),
    }
}

fn run(url: &str, extra: &[&str], min_cases: u64) {
    let bin = schemathesis();
    assert!(bin.is_file(), "schemathesis not found at {}: run ops/test.sh (it installs it)", bin.display());
    let output = std::process::Command::new(&bin)
        .args(["run", url, "--checks", "all", "--max-examples", "25", "--seed", "1", "--no-color"])
        .args(extra)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "schemathesis found failures against {url}:\n{text}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // Not vacuous: it generated and ran cases.
    let generated: u64 = text
        .lines()
        .find_map(|l| l.trim().split_once(" generated").and_then(|(n, _)| n.trim().parse().ok()))
        .unwrap_or_else(|| panic!("no test-case summary in:\n{text}"));
    assert!(generated >= min_cases, "only {generated} cases generated against {url}");
    eprintln!("schemathesis against {url}: {generated} cases, all passed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generated_requests_get_documented_answers() {
    let mut cluster = Cluster::start_with(3, 2, 1, "leader_timeout_ms = 2000", None);
    let node = cluster.node(1).admin.clone();
    wait_until("node 1 ready", Duration::from_secs(30), || {
        let url = format!("{node}/readyz");
        async move { common::http_get(&url).await.0 == 200 }
    })
    .await;
    let coord = format!("http://{}", cluster.coordinator(1).admin);
    let header = format!("Authorization: Bearer {TOKEN}");
    let leadership = |shards: serde_json::Value| -> Vec<(serde_json::Value, serde_json::Value)> {
        shards.as_array().unwrap().iter().map(|s| (s["leader"].clone(), s["epoch"].clone())).collect()
    };
    let before = leadership(cluster.coord_get(1, "/v1/shards").await.1);
    {
        let (coord, header) = (coord.clone(), header.clone());
        tokio::task::spawn_blocking(move || {
            run(&format!("{coord}/openapi.json"), &["--header", &header, "--mode", "negative"], 50)
        })
        .await
        .unwrap();
    }
    let after = leadership(cluster.coord_get(1, "/v1/shards").await.1);
    assert_eq!(before, after, "invalid requests changed leadership");
    tokio::task::spawn_blocking(move || {
        run(
            &format!("{coord}/openapi.json"),
            // Valid drills run for seconds each, and the corruption drill
            // damages WAL records on purpose: a node then answers /readyz
            // with 503 `corruption` until it repaired itself, as it should;
            // the partition drill cuts leaders off on purpose.
            &["--header", &header, "--exclude-path-regex", "^/v1/drills/(failover|catchup|corruption|partition)$"],
            100,
        );
        run(&format!("http://{node}/openapi.json"), &[], 5);
    })
    .await
    .unwrap();
    // The cluster still answers after the barrage.
    let (code, _) = cluster.coord_get(1, "/v1/cluster").await;
    assert_eq!(code, 200);
}
