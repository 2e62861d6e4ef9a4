//! Drills on a live cluster (real node and coordinator processes): the
//! failover drill crashes the leader under QUORUM load and must report a new
//! leader, zero lost and zero divergent replicas; the catch-up drill pauses a
//! follower and reports its catch-up; the corruption drill (through the
//! CLI) has a follower damage a stored record and reports its detection and
//! repair with nothing lost, and its node-side hook refuses bad input
//! changing nothing. Drill endpoints need the token.

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

/// Runs `walship drill corruption` with `args` against coordinator 1;
/// (exit success, stdout, stderr).
async fn cli_corruption_drill(cluster: &mut Cluster, args: &[&str]) -> (bool, String, String) {
    let admin = format!("http://{}", cluster.coordinator(1).admin);
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(common::walship_bin())
            .args(["drill", "corruption", "--admin", &admin, "--token", TOKEN])
            .args(&args)
            .output()
            .expect("run walship drill corruption")
    })
    .await
    .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (output.status.success(), text(&output.stdout), text(&output.stderr))
}

/// The corruption drill through the CLI: a follower damages its copy of a
/// committed record; the report says it was detected and repaired, bytes
/// were refetched and no record was lost; refusals come back as errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corruption_drill_reports_detection_repair_and_nothing_lost() {
    let mut cluster = Cluster::start_with(3, 1, 1, FAST, None);
    cluster.wait_node_leads(1, 1, Duration::from_secs(30)).await;
    wait_until("the coordinator to record node 1 as leader", Duration::from_secs(30), || {
        let ok = futures::executor::block_on(cluster.leader_of(1, 1)).is_some_and(|(l, _)| l == 1);
        async move { ok }
    })
    .await;

    let (ok, _, stderr) = cli_corruption_drill(&mut cluster, &["--shard", "99"]).await;
    assert!(!ok && stderr.contains("404") && stderr.contains("unknown_shard"), "{stderr}");
    let (ok, _, stderr) = cli_corruption_drill(&mut cluster, &["--shard", "1", "--node", "1"]).await;
    assert!(!ok && stderr.contains("400") && stderr.contains("allow_leader"), "{stderr}");

    let (ok, stdout, stderr) = cli_corruption_drill(&mut cluster, &["--shard", "1"]).await;
    assert!(ok, "the drill failed: {stdout}\n{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("a JSON report on stdout");
    assert_eq!((report["kind"].as_str(), report["state"].as_str()), (Some("corruption"), Some("done")), "{report}");
    let c = &report["corruption"];
    assert_eq!((c["node"].as_u64(), c["leader_before"].as_u64()), (Some(2), Some(1)), "the first follower: {c}");
    assert_eq!(c["leader_after"], 1, "a damaged follower moves no leadership: {c}");
    assert_eq!((c["detected"].as_bool(), c["repaired"].as_bool()), (Some(true), Some(true)), "{c}");
    let seqno = c["seqno"].as_u64().unwrap();
    assert!(c["first_bad_seqno"].as_u64().unwrap() <= seqno && seqno <= c["last_bad_seqno"].as_u64().unwrap());
    assert!(c["file"].as_str().unwrap().ends_with(".raftlog"), "{c}");
    assert!(c["acked"].as_u64().unwrap() > 0, "{c}");
    assert!(c["bytes_refetched"].as_u64().unwrap() > 0, "{c}");
    assert_eq!(c["records_lost"], 0, "{c}");
    // The node's own view agrees: nothing known corrupt any more.
    let status = cluster.status(2).await.unwrap();
    let shard = status["shards"].as_array().unwrap().iter().find(|s| s["shard_id"] == 1).unwrap().clone();
    assert_eq!(shard["corruption"], serde_json::json!([]), "{shard}");
    eprintln!(
        "corruption drill: seqno {seqno}, detection {} ms, repair {} ms, {} bytes refetched, {} acked, {} lost",
        c["detection_ms"], c["repair_ms"], c["bytes_refetched"], c["acked"], c["records_lost"]
    );
}

/// The WAL files' bytes under a node's data dir, to show nothing changed.
fn wal_bytes(data_dir: &std::path::Path) -> Vec<(std::path::PathBuf, Vec<u8>)> {
    let mut files: Vec<_> = std::fs::read_dir(data_dir.join("wal"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "raftlog"))
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap();
            (p, bytes)
        })
        .collect();
    files.sort();
    files
}

/// `Control.DamageRecord` refuses, changing nothing: on a node without
/// `--allow-crash-drills` (PERMISSION_DENIED), for a seqno it does not hold
/// (OUT_OF_RANGE, naming it and what it holds) and an unknown shard
/// (NOT_FOUND).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damage_record_refuses_bad_input_and_changes_nothing() {
    use walship_proto::log::control_client::ControlClient;
    use walship_proto::log::{AppendRecord, AppendRequest, DamageRecordRequest, Durability};

    async fn fill(node: &common::NodeProcess) {
        let mut log = node.client().await;
        for i in 0..20 {
            let payload = bytes::Bytes::from(format!("damage-input-{i:04}-").repeat(8));
            let request = AppendRequest {
                shard_id: 1,
                records: vec![AppendRecord { key: bytes::Bytes::new(), payload }],
                durability: Durability::Local as i32,
            };
            log.append(request).await.unwrap();
        }
    }
    async fn control(node: &common::NodeProcess) -> ControlClient<tonic::transport::Channel> {
        let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{}", node.grpc)).unwrap();
        ControlClient::new(endpoint.connect().await.unwrap())
    }
    let damage = |shard_id, seqno| DamageRecordRequest { shard_id, seqno };

    // Without --allow-crash-drills.
    let dir = tempfile::tempdir().unwrap();
    let node = common::NodeProcess::start(1, dir.path(), "1", &[]);
    fill(&node).await;
    let before = wal_bytes(dir.path());
    let refused = control(&node).await.damage_record(damage(1, 10)).await;
    common::assert_refused(
        "damage without crash drills",
        refused,
        tonic::Code::PermissionDenied,
        &["allow-crash-drills"],
        &[],
    );
    assert!(before == wal_bytes(dir.path()), "a refused damage changed the WAL");
    let records = common::read_all(&node.grpc, 1, 20).await;
    assert_eq!(records.len(), 20);

    // With it: records it does not hold, and a shard it does not host.
    let mut cluster = Cluster::start_with(3, 1, 1, FAST, None);
    cluster.wait_node_leads(1, 1, Duration::from_secs(30)).await;
    fill(cluster.node(1)).await;
    let data = cluster.node(1).data_dir.clone();
    let before = wal_bytes(&data);
    let mut c = control(cluster.node(1)).await;
    for seqno in [0, 21, 1_000_000] {
        let refused = c.damage_record(damage(1, seqno)).await;
        common::assert_refused(
            "damage outside the log",
            refused,
            tonic::Code::OutOfRange,
            &["shard 1", "durable"],
            &[seqno, 20],
        );
    }
    common::assert_refused(
        "damage of an unknown shard",
        c.damage_record(damage(9, 1)).await,
        tonic::Code::NotFound,
        &["shard"],
        &[9],
    );
    assert!(before == wal_bytes(&data), "a refused damage changed the WAL");
    let status = cluster.status(1).await.unwrap();
    assert_eq!(status["shards"][0]["corruption"], serde_json::json!([]));
    assert_eq!(common::read_all(&cluster.node(1).grpc.clone(), 1, 20).await.len(), 20);
}
