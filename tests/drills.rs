//! Drills on a live cluster (real node and coordinator processes): the
//! failover drill crashes the leader under QUORUM load and must report a new
//! leader, zero lost and zero divergent replicas; the catch-up drill pauses a
//! follower and reports its catch-up. Drill endpoints need the token.

mod common;

use std::time::Duration;

use common::{Cluster, TOKEN, wait_until};

/// Loss is detected after 1 s of silence: quick enough for the tests, slow
/// enough that a loaded CI machine delaying heartbeats does not fail over
/// a live leader in the middle of a test that expects it to stay.
const FAST: &str = "heartbeat_ms = 50\nleader_timeout_ms = 1000\nkeepalive_ms = 100\nship_timeout_ms = 1000";

async fn run_drill(cluster: &mut Cluster, path: &str, body: &str) -> serde_json::Value {
    let (code, started) = cluster.coord_post(1, path, body, Some(TOKEN)).await;
    assert_eq!(code, 202, "{started}");
    let report = started["report"].as_str().unwrap().to_string();
    let mut last = serde_json::Value::Null;
    wait_until(&format!("drill {report} to finish"), Duration::from_secs(90), || {
        let (code, r) = futures::executor::block_on(cluster.coord_get(1, &report));
        assert_eq!(code, 200);
        let done = r["state"] != "running";
        last = r;
        async move { done }
    })
    .await;
    last
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_drill_reports_a_new_leader_and_nothing_lost() {
    let mut cluster = Cluster::start_with(3, 2, 1, FAST, None);
    wait_until("shard 1 to have an acting leader", Duration::from_secs(30), || {
        let s = futures::executor::block_on(cluster.status(1));
        let ok = s.is_some_and(|s| {
            s["shards"].as_array().unwrap().iter().any(|e| e["shard_id"] == 1 && e["role"] == "leader")
        });
        async move { ok }
    })
    .await;
    // The drill endpoints are guarded like every mutation.
    let (code, _) = cluster.coord_post(1, "/v1/drills/failover", r#"{"shard": 1}"#, None).await;
    assert_eq!(code, 401);
    let (code, body) = cluster.coord_post(1, "/v1/drills/failover", r#"{"shard": 99}"#, Some(TOKEN)).await;
    assert_eq!((code, body["error"]["code"].as_str()), (404, Some("unknown_shard")));
    let (code, body) = cluster.coord_post(1, "/v1/drills/failover", r#"{"shard": "one"}"#, Some(TOKEN)).await;
    assert_eq!(code, 400, "{body}");
    let (code, _) = cluster.coord_get(1, "/v1/drills/nope").await;
    assert_eq!(code, 404);

    let report = run_drill(&mut cluster, "/v1/drills/failover", r#"{"shard": 1, "clients": 4, "phase_ms": 300}"#).await;
    assert_eq!(report["state"], "done", "{report}");
    let f = &report["failover"];
    assert_eq!(f["method"], "crash");
    assert_eq!(f["old_leader"], 1);
    assert_ne!(f["new_leader"], 1);
    assert!(f["new_epoch"].as_u64().unwrap() > f["old_epoch"].as_u64().unwrap());
    assert!(f["acked"].as_u64().unwrap() > 0, "{f}");
    assert_eq!(f["lost"], 0, "{f}");
    assert_eq!(f["divergent_replicas"], 0, "{f}");
    assert_eq!(f["checked_replicas"].as_array().unwrap().len(), 2, "the two live replicas were compared");
    let ms = f["time_to_new_leader_ms"].as_u64().unwrap();
    assert!(ms > 0, "{f}");
    eprintln!("time to new leader: {ms} ms, {} acknowledged", f["acked"]);
    let (_, list) = cluster.coord_get(1, "/v1/drills").await;
    assert!(list.as_array().unwrap().iter().any(|d| d["id"] == report["id"]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn catchup_drill_reports_rate_and_live_throughput() {
    let mut cluster = Cluster::start_with(3, 1, 1, FAST, None);
    cluster.wait_node_leads(1, 1, Duration::from_secs(30)).await;
    let report =
        run_drill(&mut cluster, "/v1/drills/catchup", r#"{"shard": 1, "volume_bytes": 4194304, "record_bytes": 4096}"#)
            .await;
    assert_eq!(report["state"], "done", "{report}");
    let c = &report["catchup"];
    assert!(c["records_behind"].as_u64().unwrap() >= 1000, "{c}");
    assert!(c["catchup_mib_per_s"].as_f64().unwrap() > 0.0);
    assert!(c["append_rate_before"].as_f64().unwrap() > 0.0);
    assert!(c["append_rate_during_catchup"].as_f64().is_some());
    eprintln!("catch-up: {c}");
    // The follower really is caught up, byte for byte positions.
    let follower = c["follower"].as_u64().unwrap() as u32;
    let leader_last = cluster.status(1).await.unwrap()["shards"][0]["last_seqno"].as_u64().unwrap();
    let follower_durable = cluster.status(follower).await.unwrap()["shards"][0]["durable_seqno"].as_u64().unwrap();
    assert!(follower_durable >= leader_last - 1000, "follower {follower_durable} vs leader {leader_last}");
}
