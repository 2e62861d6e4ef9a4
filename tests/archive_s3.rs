//! Archiving to a real S3-compatible server (`s3s-fs`, which checks
//! signatures): a wrong secret is refused and shown while appends go on,
//! and uploads resume with nothing lost once the nodes have the right one;
//! a store that stops answering for 30 s lets appends continue, the archive
//! lag grow and then recover, and the leader compacts nothing the archive
//! lacks meanwhile.

mod common;

use std::time::{Duration, Instant};

use common::{Cluster, ClusterSpec};
use walship_proto::log::{AppendRecord, AppendRequest, Durability};

#[path = "../objstore/tests/support/s3.rs"]
mod s3;

const WAIT: Duration = Duration::from_secs(90);

fn archive_toml(endpoint: &str) -> String {
    format!(
        "[archive]\nstore = \"s3\"\nbucket = \"walship-test\"\nprefix = \"it/archive\"\nendpoint = \"{endpoint}\"\n\
         path_style = true\nsegment_bytes = 16384\nsegment_age_ms = 200\n"
    )
}

async fn leader(cluster: &mut Cluster) -> u32 {
    cluster.wait_leader(1, None, WAIT).await
}

async fn shard_status(cluster: &Cluster, id: u32) -> serde_json::Value {
    cluster.status(id).await.map(|s| s["shards"][0].clone()).unwrap_or_default()
}

/// Appends `n` records through the current leader; answers the last
/// acknowledged seqno (0: none).
async fn append(cluster: &mut Cluster, n: usize) -> u64 {
    let id = leader(cluster).await;
    let Some(mut log) = common::history::client(&cluster.nodes[id as usize - 1].grpc).await else { return 0 };
    let mut last = 0;
    for i in 0..n {
        let record =
            AppendRecord { key: Default::default(), payload: format!("s3-{i}-").repeat(40).into_bytes().into() };
        let request = AppendRequest {
            shard_id: 1,
            records: vec![record],
            durability: Durability::Quorum as i32,
            ..Default::default()
        };
        if let Ok(r) = log.append(request).await {
            last = r.into_inner().first_seqno;
        }
    }
    last
}

async fn wait_archived(cluster: &mut Cluster, through: u64) {
    let deadline = Instant::now() + WAIT;
    loop {
        let id = leader(cluster).await;
        let archive = shard_status(cluster, id).await["archive"].clone();
        if archive["archived_seqno"].as_u64() >= Some(through) {
            return;
        }
        assert!(Instant::now() < deadline, "the archive never reached {through}: {archive}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn verify(cluster: &Cluster) -> serde_json::Value {
    let out = std::process::Command::new(common::walship_bin())
        .args(["archive", "verify", "--shard", "1", "--json", "--cluster"])
        .arg(&cluster.config_path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_secret_is_shown_and_fixing_it_loses_nothing() {
    let server = s3::S3sFs::start();
    // The right credentials are in this process's environment, which every
    // node inherits on a restart; their first start overrides the secret.
    // SAFETY: set before any thread of this test process reads the env.
    unsafe {
        std::env::set_var("AWS_ACCESS_KEY_ID", s3::ACCESS_KEY);
        std::env::set_var("AWS_SECRET_ACCESS_KEY", s3::SECRET_KEY);
    }
    let wrong = vec![("AWS_SECRET_ACCESS_KEY".to_string(), "not-the-secret".to_string())];
    let mut cluster = Cluster::launch(&ClusterSpec {
        nodes: 3,
        shards: 1,
        coordinators: 1,
        replication: "heartbeat_ms = 50\nleader_timeout_ms = 1000\nkeepalive_ms = 100",
        cluster_toml: archive_toml(&server.endpoint),
        node_env: (1..=3).map(|n| (n, wrong.clone())).collect(),
        ..ClusterSpec::default()
    });
    let last = append(&mut cluster, 200).await;
    assert!(last >= 200, "appends go on without the archive: {last}");
    let id = leader(&mut cluster).await;
    let deadline = Instant::now() + WAIT;
    let archive = loop {
        let archive = shard_status(&cluster, id).await["archive"].clone();
        if archive["error"].as_str().is_some_and(|e| e.contains("refused access"))
            && archive["lag_records"].as_u64() >= Some(200)
        {
            break archive;
        }
        assert!(Instant::now() < deadline, "the refusal never showed: {archive}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(archive["archived_seqno"], 0, "{archive}");
    let metrics = common::http_get(&format!("{}/metrics", cluster.nodes[id as usize - 1].admin)).await.1;
    assert!(metrics.contains("walship_archive_upload_failures_total{reason=\"denied\"}"), "no denied count");

    // Fixed: every node restarted with the right secret.
    for n in 1..=3 {
        cluster.restart(n);
    }
    let more = append(&mut cluster, 50).await;
    wait_archived(&mut cluster, more).await;
    let verified = verify(&cluster);
    assert_eq!(verified["first_seqno"], 1, "{verified}");
    assert!(verified["last_seqno"].as_u64() >= Some(more), "{verified}");
    assert!(verified["records"].as_u64() >= Some(more), "each record once: {verified}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_store_for_30_s_lets_appends_go_on_and_the_archive_recover() {
    let server = s3::S3sFs::start();
    // SAFETY: set before any thread of this test process reads the env.
    unsafe {
        std::env::set_var("AWS_ACCESS_KEY_ID", s3::ACCESS_KEY);
        std::env::set_var("AWS_SECRET_ACCESS_KEY", s3::SECRET_KEY);
    }
    let mut cluster = Cluster::launch(&ClusterSpec {
        nodes: 3,
        shards: 1,
        coordinators: 1,
        // Retention would keep only 64 KiB: the archive is what holds it back.
        replication: "heartbeat_ms = 50\nleader_timeout_ms = 1000\nkeepalive_ms = 100\nretain_bytes = 65536\n\
                      max_retain_bytes = 67108864\nretention_interval_ms = 100",
        cluster_toml: archive_toml(&server.endpoint),
        ..ClusterSpec::default()
    });
    let before = append(&mut cluster, 100).await;
    wait_archived(&mut cluster, before).await;

    server.signal(libc::SIGSTOP);
    let stopped = Instant::now();
    let mut last = before;
    let mut worst_lag = 0.0f64;
    while stopped.elapsed() < Duration::from_secs(30) {
        let got = append(&mut cluster, 20).await;
        assert!(got > last, "appends stopped while the object store was down (last {last})");
        last = got;
        let id = leader(&mut cluster).await;
        let shard = shard_status(&cluster, id).await;
        let archived = shard["archive"]["archived_seqno"].as_u64().unwrap_or(0);
        // No replica compacts what the archive lacks: a failover to any of
        // them must find it.
        for n in 1..=3 {
            let replica = shard_status(&cluster, n).await;
            assert!(
                replica["first_seqno"].as_u64().unwrap_or(1) <= archived + 1,
                "node {n} compacted records the archive lacks (archived {archived}): {replica}"
            );
        }
        worst_lag = worst_lag.max(shard["archive"]["lag_seconds"].as_f64().unwrap_or(0.0));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(worst_lag > 10.0, "the archive lag never grew while the store was stopped: {worst_lag} s");
    server.signal(libc::SIGCONT);
    let recovered = Instant::now();
    wait_archived(&mut cluster, last).await;
    eprintln!(
        "store stopped 30 s: lag peaked at {worst_lag:.1} s; caught up {:?} after it answered again",
        recovered.elapsed()
    );
    let verified = verify(&cluster);
    assert_eq!(verified["first_seqno"], 1, "{verified}");
    assert!(verified["last_seqno"].as_u64() >= Some(last), "{verified}");
    // And retention runs again once the archive holds the records, on
    // every replica.
    let deadline = Instant::now() + WAIT;
    loop {
        let mut compacted = 0;
        for n in 1..=3 {
            if shard_status(&cluster, n).await["first_seqno"].as_u64() > Some(1) {
                compacted += 1;
            }
        }
        if compacted == 3 {
            break;
        }
        assert!(Instant::now() < deadline, "not every replica compacted archived records");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
