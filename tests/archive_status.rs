//! The archive position where operators look: the coordinator's
//! `GET /v1/shards/{id}` carries each archived shard's `archived_seqno`
//! (from its leader's heartbeats) and `archive_lag_records`, reaching the
//! commit once the leader has archived everything; `walship status` prints
//! it on the leader's row. Without `[archive]` the fields are null and the
//! column shows `-`.

mod common;

use std::time::{Duration, Instant};

use common::{Cluster, ClusterSpec};
use walship_proto::log::{AppendRecord, AppendRequest, Durability};

const WAIT: Duration = Duration::from_secs(60);

const ARCHIVE: &str = "[archive]\nstore = \"dir\"\ndir = \"archive\"\nsegment_bytes = 8192\nsegment_age_ms = 100\n";

fn launch(cluster_toml: &str) -> Cluster {
    Cluster::launch(&ClusterSpec {
        nodes: 3,
        shards: 1,
        coordinators: 1,
        replication: "heartbeat_ms = 50\nleader_timeout_ms = 1000\nkeepalive_ms = 100",
        cluster_toml: cluster_toml.into(),
        ..ClusterSpec::default()
    })
}

/// The shard's leader once it leads; appends `n` records through it and
/// answers it with the last acknowledged seqno.
async fn append(cluster: &mut Cluster, n: usize) -> (u32, u64) {
    let leader = cluster.wait_leader(1, None, WAIT).await;
    let mut log = common::history::client(&cluster.nodes[leader as usize - 1].grpc).await.expect("leader reachable");
    let mut last = 0;
    for i in 0..n {
        let record =
            AppendRecord { key: Default::default(), payload: format!("st-{i}-").repeat(30).into_bytes().into() };
        let request = AppendRequest {
            shard_id: 1,
            records: vec![record],
            durability: Durability::Quorum as i32,
            ..Default::default()
        };
        last = log.append(request).await.unwrap().into_inner().first_seqno;
    }
    (leader, last)
}

/// `walship status` against the coordinator: stdout.
fn status(cluster: &mut Cluster) -> String {
    let admin = format!("http://{}", cluster.coordinator(1).admin);
    let out = std::process::Command::new(common::walship_bin()).args(["status", "--admin", &admin]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into()
}

/// The `archived` cell of node `node`'s row in a `walship status` table.
fn archived_cell(table: &str, node: u32) -> String {
    let header: Vec<&str> = table.lines().find(|l| l.contains("| shard")).unwrap().split('|').map(str::trim).collect();
    let column = header.iter().position(|h| *h == "archived").unwrap_or_else(|| panic!("no archived column:\n{table}"));
    let row = table
        .lines()
        .map(|l| l.split('|').map(str::trim).collect::<Vec<_>>())
        .find(|cells| cells.len() > 5 && cells[1] == "1" && cells[4] == node.to_string())
        .unwrap_or_else(|| panic!("no row for node {node}:\n{table}"));
    row[column].to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinator_and_walship_status_show_the_archived_seqno() {
    let mut cluster = launch(ARCHIVE);
    let (leader, last) = append(&mut cluster, 200).await;
    assert!(last >= 200);
    // The coordinator's view reaches the commit: everything archived.
    let deadline = Instant::now() + WAIT;
    let shard = loop {
        let (code, shard) = cluster.coord_get(1, "/v1/shards/1").await;
        assert_eq!(code, 200, "{shard}");
        let commit = shard["replicas"]
            .as_array()
            .and_then(|r| r.iter().find(|r| r["node_id"] == leader))
            .and_then(|r| r["commit_seqno"].as_u64());
        if shard["archived_seqno"].as_u64() >= Some(last) && shard["archived_seqno"].as_u64() == commit {
            break shard;
        }
        assert!(Instant::now() < deadline, "the coordinator never showed {last} archived: {shard}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(shard["leader"], leader, "{shard}");
    assert_eq!(shard["archive_lag_records"], 0, "{shard}");
    assert!(shard["archive_lag_seconds"].as_f64().is_some(), "{shard}");
    // The list carries the same fields.
    let (_, shards) = cluster.coord_get(1, "/v1/shards").await;
    assert!(shards[0]["archived_seqno"].as_u64() >= Some(last), "{shards}");

    // `walship status`: the leader's row shows it, the followers' do not.
    let table = status(&mut cluster);
    assert_eq!(archived_cell(&table, leader), format!("{last} (lag 0)"), "{table}");
    let follower = (1..=3).find(|&n| n != leader).unwrap();
    assert_eq!(archived_cell(&table, follower), "-", "{table}");

    // More appends, not yet archived, are counted as lag while they wait
    // (the leader seals after 100 ms, so poll until the lag shows or the
    // archive has already caught up; either way the numbers add up).
    let (_, more) = append(&mut cluster, 20).await;
    let (_, shard) = cluster.coord_get(1, "/v1/shards/1").await;
    let commit = shard["replicas"].as_array().unwrap().iter().find(|r| r["node_id"] == leader).unwrap()["commit_seqno"]
        .as_u64()
        .unwrap();
    let archived = shard["archived_seqno"].as_u64().unwrap();
    assert_eq!(shard["archive_lag_records"].as_u64(), Some(commit - archived), "{shard}");
    let deadline = Instant::now() + WAIT;
    while cluster.coord_get(1, "/v1/shards/1").await.1["archived_seqno"].as_u64() < Some(more) {
        assert!(Instant::now() < deadline, "the archive never reached {more}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_archive_the_fields_are_null() {
    let mut cluster = launch("");
    let (leader, last) = append(&mut cluster, 5).await;
    // Wait until the coordinator has the leader's heartbeat with the commit.
    let deadline = Instant::now() + WAIT;
    let shard = loop {
        let (_, shard) = cluster.coord_get(1, "/v1/shards/1").await;
        let commit = shard["replicas"]
            .as_array()
            .and_then(|r| r.iter().find(|r| r["node_id"] == leader && r["role"] == "leader"))
            .and_then(|r| r["commit_seqno"].as_u64());
        if commit >= Some(last) {
            break shard;
        }
        assert!(Instant::now() < deadline, "the coordinator never saw the commit: {shard}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    for field in ["archived_seqno", "archive_lag_records", "archive_lag_seconds"] {
        assert_eq!(shard[field], serde_json::Value::Null, "{field}: {shard}");
    }
    let table = status(&mut cluster);
    assert_eq!(archived_cell(&table, leader), "-", "{table}");
}

/// The shards node `id` says it leads, of `1..=shards`.
async fn led_by(cluster: &Cluster, id: u32, shards: u32) -> f64 {
    let mut led = 0.0;
    for shard in 1..=shards {
        if cluster.leads(id, shard).await {
            led += 1.0;
        }
    }
    led
}

/// Whether every node of `live` runs the archive loops of exactly the
/// shards it leads (`walship_archive_loops`).
async fn loops_match_leadership(cluster: &Cluster, live: &[u32], shards: u32) -> bool {
    for &id in live {
        let running = common::metric(&cluster.nodes[id as usize - 1].admin, "walship_archive_loops").await;
        if running != led_by(cluster, id, shards).await {
            return false;
        }
    }
    true
}

/// Only a shard's leader runs its archive loop: a replica that only
/// follows holds none (a node with thousands of shards pays for the ones
/// it leads). When the leader dies, the new one starts its loop and
/// archives what comes after, from where the store ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_leader_of_a_shard_runs_its_archive_loop() {
    const SHARDS: u32 = 4;
    let mut cluster = Cluster::launch(&ClusterSpec {
        nodes: 3,
        shards: SHARDS,
        coordinators: 1,
        replication: "heartbeat_ms = 50\nleader_timeout_ms = 1000\nkeepalive_ms = 100",
        cluster_toml: ARCHIVE.into(),
        ..ClusterSpec::default()
    });
    for shard in 1..=SHARDS {
        cluster.wait_leader(shard, None, WAIT).await;
    }
    common::wait_until("each node to run the archive loops of the shards it leads, and none other", WAIT, || {
        loops_match_leadership(&cluster, &[1, 2, 3], SHARDS)
    })
    .await;
    let total: f64 = futures::future::join_all(
        (1..=3).map(|id| common::metric(&cluster.nodes[id - 1].admin, "walship_archive_loops")),
    )
    .await
    .iter()
    .sum();
    assert_eq!(total, SHARDS as f64, "one loop per shard across the cluster");

    let (old, _) = append(&mut cluster, 20).await;
    cluster.node(old).kill9();
    let new = cluster.wait_leader(1, Some(old), WAIT).await;
    let live: Vec<u32> = (1..=3).filter(|&id| id != old).collect();
    common::wait_until("the new leader to run the loop of shard 1", WAIT, || {
        loops_match_leadership(&cluster, &live, SHARDS)
    })
    .await;
    let (leader, last) = append(&mut cluster, 20).await;
    assert_eq!(leader, new);
    common::wait_until("the new leader to archive what it acknowledged", WAIT, || async {
        let status = cluster.status(new).await.unwrap_or_default();
        let shard = status["shards"].as_array().and_then(|a| a.iter().find(|s| s["shard_id"] == 1).cloned());
        shard.and_then(|s| s["archive"]["archived_seqno"].as_u64()) >= Some(last)
    })
    .await;
}
