//! Catch-up as a DataPlane task, against real nodes and a coordinator: a
//! follower that comes back far behind gets a `catchup` task the
//! coordinator starts by itself, run by its node, listed with progress and
//! ending with bytes by source; the refusals of starting one by hand.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{Acked, Cluster, ClusterSpec, TOKEN, wait_until};
use walship_proto::log::Durability;

/// Catch-up throttled to 1 MiB/s and started 256 KiB behind, so a few MiB
/// take seconds: long enough for the coordinator's once-a-second watch, in
/// chunks small enough (256 KiB) that the follower makes some durable (and
/// counts them) before the last arrives.
const SLOW_CATCHUP: &str = "heartbeat_ms = 50\nleader_timeout_ms = 1000\nkeepalive_ms = 100\n\
                            catchup_threshold_bytes = 262144\ncatchup_rate_bytes_per_s = 1048576\n\
                            ship_batch_bytes = 262144";

async fn tasks(cluster: &mut Cluster, query: &str) -> Vec<serde_json::Value> {
    let (_, page) = cluster.coord_get(1, &format!("/v1/tasks?{query}")).await;
    page["tasks"].as_array().cloned().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_far_behind_catches_up_as_a_task_with_bytes_by_source() {
    let mut cluster = Cluster::launch(&ClusterSpec {
        nodes: 3,
        shards: 1,
        coordinators: 1,
        replication: SLOW_CATCHUP,
        ..ClusterSpec::default()
    });
    let leader = cluster.wait_leader(1, None, Duration::from_secs(60)).await;
    let follower = if leader == 3 { 2 } else { 3 };
    wait_until("every node connected to the DataPlane", Duration::from_secs(30), || {
        let (_, cluster_view) = futures::executor::block_on(cluster.coord_get(1, "/v1/cluster"));
        async move { cluster_view["workers"].as_array().is_some_and(|w| w.len() == 3) }
    })
    .await;

    // Refusals by hand: the leader, a node that is not one, no such shard.
    for (body, status, code) in [
        (format!(r#"{{"kind": "catchup", "shard": 1, "node": "node-{leader}"}}"#), 409, "is_leader"),
        (r#"{"kind": "catchup", "shard": 1, "node": "node-9"}"#.to_string(), 404, "not_found"),
        (r#"{"kind": "catchup", "shard": 7, "node": "node-2"}"#.to_string(), 404, "not_found"),
        (r#"{"kind": "catchup", "shard": 1}"#.to_string(), 400, "bad_request"),
    ] {
        let (got, refused) = cluster.coord_post(1, "/v1/tasks", &body, Some(TOKEN)).await;
        assert_eq!(got, status, "{body}: {refused}");
        if status != 400 {
            assert_eq!(refused["error"]["code"], code, "{body}: {refused}");
        }
    }
    assert!(tasks(&mut cluster, "kind=catchup").await.is_empty(), "a refusal starts nothing");

    // The follower stops; 4 MiB are appended at QUORUM; it comes back.
    cluster.node(follower).kill9();
    let mut log = cluster.node(leader).client().await;
    let acked: Acked = Default::default();
    for batch in 0..64 {
        let payloads: Vec<Bytes> = (0..16).map(|i| Bytes::from(vec![(batch * 16 + i) as u8; 4096])).collect();
        common::append_and_record(&mut log, 1, payloads, Durability::Quorum, Duration::from_secs(10), &acked)
            .await
            .unwrap();
    }
    let last = *acked.lock().await[&1].keys().last().unwrap();
    cluster.restart(follower);

    // The coordinator starts a catch-up task on the follower's node.
    wait_until("a catch-up task of the follower", Duration::from_secs(30), || {
        let found = futures::executor::block_on(tasks(&mut cluster, "kind=catchup"));
        async move { !found.is_empty() }
    })
    .await;
    let task = tasks(&mut cluster, "kind=catchup").await.remove(0);
    assert_eq!(task["target"], format!("node-{follower}"), "{task}");
    assert_eq!(task["shard"], 1, "{task}");
    let id = task["task_id"].as_str().unwrap().to_string();
    let query = task["query_id"].as_str().unwrap().to_string();
    let path = format!("/v1/tasks/{id}");
    wait_until("the catch-up task to end", Duration::from_secs(60), || {
        let (_, t) = futures::executor::block_on(cluster.coord_get(1, &path));
        async move { t["state"] != "queued" && t["state"] != "running" }
    })
    .await;
    let (_, done) = cluster.coord_get(1, &path).await;
    assert_eq!(done["state"], "succeeded", "{done}");
    assert!(done["bytes"].as_i64().unwrap() > 0, "progress counted the bytes applied: {done}");
    let (code, job) = cluster.coord_get(1, &format!("/v1/jobs/{query}")).await;
    assert_eq!(code, 200, "{job}");
    let report = &job["report"];
    let by_source: u64 = ["bytes_peer", "bytes_archive", "bytes_stream", "bytes_push"]
        .iter()
        .map(|k| report[k].as_u64().unwrap_or_else(|| panic!("{k} in {report}")))
        .sum();
    assert!(by_source > 1 << 20, "{report}");
    assert!(report["durable_seqno"].as_u64().unwrap() >= report["until_seqno"].as_u64().unwrap(), "{report}");
    assert!(report["until_seqno"].as_u64().unwrap() <= last, "{report}");
    // The rate limit held: what the leader streamed came at most at
    // catchup_rate_bytes_per_s (1 MiB/s after a 100 ms burst; a chunk is
    // paid for after it is sent, so the last two chunks of 256 KiB may go
    // unpaid), so the task took at least that long (unthrottled, 4 MiB on
    // loopback take well under a second).
    let streamed = report["bytes_stream"].as_u64().unwrap() as f64;
    let took_s = done["took_us"].as_u64().unwrap_or_else(|| panic!("took_us in {done}")) as f64 / 1e6;
    let floor_s = (streamed - 2.0 * 262_144.0) / 1_048_576.0 - 0.1;
    assert!(streamed > 1_048_576.0, "most of it streamed from the leader: {report}");
    assert!(took_s >= floor_s * 0.95, "{streamed} bytes streamed in {took_s:.2} s, over the 1 MiB/s catch-up rate");
    eprintln!("catch-up task: {report}, took {took_s:.2} s");
}
