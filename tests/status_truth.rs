//! The coordinator's status tells the truth (real `walship node` and
//! `walship coord` processes):
//!
//! * a follower killed before a failover shows the lag from its last known
//!   position, marked stale, with an age that grows, not the whole log;
//! * its lag in seconds is the age of the oldest record it lacks (when the
//!   leader accepted it), under light load, and it grows;
//! * under load, every position says how old it is, and a follower shown
//!   ahead of its leader is always the younger report;
//! * the coordinator keeps a lag history per follower, served with readable
//!   names, and refuses bad queries; `/v1/cluster` carries the per-node
//!   panel (uptime, WAL bytes, heartbeat age, disk and corruption state);
//! * `walship status` prints the same.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use common::history::{FAST, WAIT, client, load, wait_leading};
use common::{Acked, Cluster, TOKEN, wait_until};
use walship_proto::log::{AppendRecord, AppendRequest, Durability, ReadRequest};

fn unix_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_micros() as u64
}

fn replica(shard: &serde_json::Value, node: u64) -> serde_json::Value {
    shard["replicas"].as_array().unwrap().iter().find(|r| r["node_id"] == node).cloned().unwrap()
}

async fn append_one(grpc: &str, i: u64) {
    let mut log = client(grpc).await.expect("leader reachable");
    let request = AppendRequest {
        shard_id: 1,
        records: vec![AppendRecord { key: Bytes::new(), payload: Bytes::from(format!("r{i}")) }],
        durability: Durability::Quorum as i32,
        ..Default::default()
    };
    log.append(request).await.unwrap();
}

/// Three nodes, shard 1 led by node 1; `before` records every replica holds,
/// then node 3 killed and `after` more appended one at a time (light load),
/// then failed over to node 2. Returns node 3's last reported durable seqno.
async fn dead_follower_then_failover(cluster: &mut Cluster, before: u64, after: u64) -> u64 {
    wait_leading(cluster, 1, 1).await;
    let leader = cluster.node(1).grpc.clone();
    for i in 1..=before {
        append_one(&leader, i).await;
    }
    wait_until("the coordinator to see node 3 hold every record", WAIT, || {
        let (_, shard) = futures::executor::block_on(cluster.coord_get(1, "/v1/shards/1"));
        let ok = shard["replicas"].is_array() && replica(&shard, 3)["durable_seqno"] == before;
        async move { ok }
    })
    .await;
    cluster.node(3).kill9();
    for i in before + 1..=before + after {
        append_one(&leader, i).await;
    }
    let (code, body) = cluster.coord_post(1, "/v1/shards/1/failover", r#"{"target": 2}"#, Some(TOKEN)).await;
    assert_eq!(code, 200, "{body}");
    wait_leading(cluster, 1, 2).await;
    before
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_follower_shows_its_last_known_position_and_a_growing_age_after_failover() {
    let mut cluster = Cluster::start_with(3, 1, 1, FAST, None);
    let last_known = dead_follower_then_failover(&mut cluster, 50, 150).await;
    let total = 200;
    // The new leader has never heard from node 3: its own count would be
    // the whole log. The coordinator counts from node 3's last report.
    let mut first_age = None;
    wait_until("node 3's stale lag from its last known position", WAIT, || {
        let (_, shard) = futures::executor::block_on(cluster.coord_get(1, "/v1/shards/1"));
        let r = if shard["replicas"].is_array() { replica(&shard, 3) } else { serde_json::Value::Null };
        let leader_durable =
            if shard["replicas"].is_array() { replica(&shard, 2)["durable_seqno"].as_u64() } else { None };
        let ok = shard["leader"] == 2
            && leader_durable == Some(total)
            && r["role"] == "down"
            && r["lag_stale"] == true
            && r["lag_from_seqno"] == last_known;
        if ok {
            assert_eq!(r["lag_records"], total - last_known, "counted from its last known position: {r}");
            assert_eq!(r["durable_seqno"], last_known, "{r}");
            assert!(r["lag_bytes"].is_null(), "bytes the new leader cannot know are not made up: {r}");
            first_age = r["position_age_ms"].as_u64();
            assert!(first_age.is_some(), "{r}");
            assert!(r["lag_position_age_ms"].as_u64().is_some(), "{r}");
        }
        async move { ok }
    })
    .await;
    let first_age = first_age.unwrap();
    wait_until("node 3's position age to grow", WAIT, || {
        let (_, shard) = futures::executor::block_on(cluster.coord_get(1, "/v1/shards/1"));
        let r = replica(&shard, 3);
        let grown = r["position_age_ms"].as_u64().is_some_and(|a| a > first_age + 500)
            && r["lag_records"] == total - last_known
            && r["lag_stale"] == true;
        async move { grown }
    })
    .await;
    // The new leader's own status says it does not know node 3's position
    // (its count from 0 is an upper bound), and knows node 1's.
    wait_until("node 2's status to know node 1's position and not node 3's", WAIT, || {
        let status = futures::executor::block_on(cluster.status(2));
        let known = |node: u64| {
            status.as_ref().and_then(|s| {
                s["shards"][0]["followers"]
                    .as_array()?
                    .iter()
                    .find(|f| f["node_id"] == node)
                    .map(|f| (f["position_known"].as_bool(), f["last_reply_ms_ago"].is_null()))
            })
        };
        let ok = known(1) == Some((Some(true), false)) && known(3) == Some((Some(false), true));
        async move { ok }
    })
    .await;
    // The live follower is not stale, and the leader shows no lag of its own.
    let (_, shard) = cluster.coord_get(1, "/v1/shards/1").await;
    assert_eq!(replica(&shard, 1)["lag_stale"], false, "{shard}");
    assert!(replica(&shard, 2)["lag_records"].is_null(), "{shard}");
    // `walship status` says the same.
    let admin = format!("http://{}", cluster.coordinator(1).admin);
    let out = std::process::Command::new(common::walship_bin()).args(["status", "--admin", &admin]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let row: Vec<&str> = text
        .lines()
        .map(|l| l.split('|').map(str::trim).collect::<Vec<_>>())
        .find(|cells| cells.get(4) == Some(&"3"))
        .unwrap_or_else(|| panic!("no row for node 3:\n{text}"));
    assert!(row.iter().any(|c| c.starts_with(&format!("STALE from {last_known}"))), "{text}");
    assert!(row.contains(&(total - last_known).to_string().as_str()), "{text}");
    assert!(text.contains("pos age") && text.contains("lag is"), "{text}");
    assert!(text.contains("STALE lag: the follower is down or its leader has not heard from it"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lag_seconds_is_the_age_of_the_oldest_record_the_follower_lacks_under_light_load() {
    let mut cluster = Cluster::start_with(3, 1, 1, FAST, None);
    let last_known = dead_follower_then_failover(&mut cluster, 20, 30).await;
    let new_leader = cluster.node(2).grpc.clone();
    // When the leader accepted the oldest record node 3 lacks.
    let mut log = client(&new_leader).await.unwrap();
    let oldest = log
        .read(ReadRequest { shard_id: 1, from_seqno: last_known + 1, to_seqno: last_known + 1, ..Default::default() })
        .await
        .unwrap()
        .into_inner()
        .records;
    assert_eq!(oldest[0].seqno, last_known + 1);
    let written_us = oldest[0].timestamp_us;
    // Light load on the new leader: one record at a time, a few.
    let mut i = 1_000;
    let mut previous: Option<f64> = None;
    let mut readings = 0;
    wait_until("node 3's lag in seconds to be the age of record 21 and grow", WAIT, || {
        i += 1;
        futures::executor::block_on(append_one(&new_leader, i));
        let asked_us = unix_us();
        let (_, shard) = futures::executor::block_on(cluster.coord_get(1, "/v1/shards/1"));
        let seconds = replica(&shard, 3)["lag_seconds"].as_f64();
        if let Some(s) = seconds {
            // At least as old as the record has been, as of the question
            // (the answer is computed after it was asked).
            let floor = asked_us.saturating_sub(written_us) as f64 / 1e6;
            assert!(s >= floor, "lag {s} s, but record {} was accepted {floor} s before the question", last_known + 1);
            assert!(s > 0.0);
            if let Some(p) = previous {
                assert!(s >= p, "lag in seconds went down while the follower stayed dead: {p} then {s}");
                if s > p {
                    readings += 1;
                }
            }
            previous = Some(s);
        }
        let done = readings >= 3;
        async move { done }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_load_a_follower_ahead_of_its_leader_is_the_younger_report() {
    let mut cluster = Cluster::start_with(3, 1, 1, FAST, None);
    wait_leading(&mut cluster, 1, 1).await;
    let nodes: Vec<String> = cluster.nodes.iter().map(|n| n.grpc.clone()).collect();
    let admin = cluster.coordinator(1).admin.clone();
    let acked: Acked = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> =
        (0..8).map(|_| load(nodes.clone(), admin.clone(), 1, acked.clone(), stop.clone(), count.clone())).collect();
    wait_until("load to run", WAIT, || {
        let n = count.load(Ordering::Relaxed);
        async move { n > 200 }
    })
    .await;
    let (mut samples, mut ahead) = (0, 0);
    wait_until("200 views of shard 1 under load", WAIT, || {
        let (code, shard) = futures::executor::block_on(cluster.coord_get(1, "/v1/shards/1"));
        if code == 200 {
            samples += 1;
            let leader = replica(&shard, 1);
            let leader_at = leader["position_unix_us"].as_u64().expect("every position says when it was read");
            assert!(leader["position_age_ms"].as_u64().is_some(), "{leader}");
            for node in [2, 3] {
                let f = replica(&shard, node);
                let at = f["position_unix_us"].as_u64().expect("every position says when it was read");
                assert!(f["position_age_ms"].as_u64().is_some(), "{f}");
                if f["last_seqno"].as_u64() > leader["last_seqno"].as_u64() {
                    ahead += 1;
                    assert!(
                        at > leader_at,
                        "follower {node} shown ahead of its leader without a younger report:\n{shard}"
                    );
                }
            }
        }
        let done = samples >= 200;
        async move { done }
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    eprintln!("{samples} views, {ahead} with a follower ahead of its leader's last seqno (each the younger report)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinator_keeps_a_named_lag_history_and_a_node_panel() {
    let mut cluster = Cluster::start_with(3, 1, 1, FAST, None);
    wait_leading(&mut cluster, 1, 1).await;
    let leader = cluster.node(1).grpc.clone();
    for i in 1..=20 {
        append_one(&leader, i).await;
    }
    // History from before anyone asked: several samples per follower.
    wait_until("five samples of each follower", WAIT, || {
        let (code, h) = futures::executor::block_on(cluster.coord_get(1, "/v1/shards/1/lag-history"));
        let ok = code == 200
            && h["series"].as_array().is_some_and(|s| {
                s.len() == 2 && s.iter().all(|s| s["samples"].as_array().is_some_and(|p| p.len() >= 5))
            });
        async move { ok }
    })
    .await;
    let (_, h) = cluster.coord_get(1, "/v1/shards/1/lag-history").await;
    assert_eq!(h["interval_ms"], 1000);
    let grpc3 = cluster.node(3).grpc.clone();
    let s3 = h["series"].as_array().unwrap().iter().find(|s| s["node_id"] == 3).unwrap().clone();
    assert_eq!(s3["name"], format!("node 3 ({grpc3})"));
    let times: Vec<u64> = s3["samples"].as_array().unwrap().iter().map(|p| p["at_unix_ms"].as_u64().unwrap()).collect();
    assert!(times.windows(2).all(|w| w[0] < w[1]), "oldest first: {times:?}");
    assert!(times.iter().all(|&t| t <= h["now_unix_ms"].as_u64().unwrap()));
    // `seconds` narrows it.
    let (code, narrow) = cluster.coord_get(1, "/v1/shards/1/lag-history?seconds=2").await;
    assert_eq!(code, 200);
    for s in narrow["series"].as_array().unwrap() {
        assert!(s["samples"].as_array().unwrap().len() <= 3, "{narrow}");
    }
    // The node panel: uptime, WAL bytes, heartbeat age, state.
    let (_, c) = cluster.coord_get(1, "/v1/cluster").await;
    let n1 = c["nodes"].as_array().unwrap().iter().find(|n| n["node_id"] == 1).unwrap().clone();
    assert!(n1["uptime_seconds"].as_u64().is_some(), "{n1}");
    assert!(n1["wal_disk_bytes"].as_u64().is_some_and(|b| b > 0), "{n1}");
    assert!(n1["disk_free_bytes"].as_u64().is_some_and(|b| b > 0), "{n1}");
    assert_eq!((n1["disk_full"].clone(), n1["corrupt_shards"].clone()), (false.into(), serde_json::json!([])));
    // Node 3 dies: its samples turn stale, its heartbeat age grows.
    cluster.node(3).kill9();
    append_one(&leader, 21).await;
    wait_until("node 3's newest sample stale and its heartbeat age past the timeout", WAIT, || {
        let (_, h) = futures::executor::block_on(cluster.coord_get(1, "/v1/shards/1/lag-history?seconds=5"));
        let (_, c) = futures::executor::block_on(cluster.coord_get(1, "/v1/cluster"));
        let stale = h["series"].as_array().and_then(|s| s.iter().find(|s| s["node_id"] == 3)).is_some_and(|s| {
            s["samples"].as_array().and_then(|p| p.last()).is_some_and(|p| p["stale"] == true && p["lag_records"] == 1)
        });
        let down = c["nodes"]
            .as_array()
            .and_then(|n| n.iter().find(|n| n["node_id"] == 3))
            .is_some_and(|n| n["alive"] == false && n["last_heartbeat_ms_ago"].as_u64().is_some_and(|ms| ms > 1_000));
        async move { stale && down }
    })
    .await;
    // Bad queries are refused with a clear error.
    for (path, code, error) in [
        ("/v1/shards/1/lag-history?seconds=0", 400, "bad_query"),
        ("/v1/shards/1/lag-history?seconds=901", 400, "bad_query"),
        ("/v1/shards/1/lag-history?seconds=x", 400, "bad_query"),
        ("/v1/shards/1/lag-history?since=1", 400, "bad_query"),
        ("/v1/shards/one/lag-history", 400, "bad_shard_id"),
        ("/v1/shards/9/lag-history", 404, "unknown_shard"),
    ] {
        let (got, body) = cluster.coord_get(1, path).await;
        assert_eq!((got, body["error"]["code"].as_str()), (code, Some(error)), "{path}: {body}");
    }
}
