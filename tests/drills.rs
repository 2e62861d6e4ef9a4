//! Drills on a live cluster (real node and coordinator processes): the
//! failover drill crashes the leader under QUORUM load and must report a new
//! leader, zero lost and zero divergent replicas; the catch-up drill pauses a
//! follower and reports its catch-up; the corruption drill (through the
//! CLI) has a follower damage a stored record and reports its detection and
//! repair with nothing lost, and its node-side hook refuses bad input
//! changing nothing. The partition drill (through the CLI) cuts the leader
//! from its followers three times and must report a new leader each time,
//! within a bound derived from the replication timeout, nothing lost and no
//! `LOCAL` acknowledgement from the old leader past its lease; cutting one
//! follower moves no leadership; its endpoint and node-side hook
//! (`Control.Partition`) refuse bad input changing nothing. Drill endpoints
//! need the token.

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
    let body = r#"{"shard": 1, "volume_bytes": 4194304, "record_bytes": 4096}"#;
    let (code, started) = cluster.coord_post(1, "/v1/drills/catchup", body, Some(TOKEN)).await;
    assert_eq!(code, 202, "{started}");
    let id = started["id"].as_str().unwrap().to_string();
    // A drill is a task the coordinator runs: listed while it runs, not
    // cancellable (it runs to its end, which restores the cluster).
    let (code, task) = cluster.coord_get(1, &format!("/v1/tasks/{id}")).await;
    assert_eq!(code, 200, "{task}");
    assert_eq!((task["kind"].as_str(), task["shard"].as_u64()), (Some("drill-catchup"), Some(1)), "{task}");
    assert_eq!(task["node"], "coordinator c1", "{task}");
    if task["state"] == "running" {
        let (code, refused) = cluster.coord_post(1, &format!("/v1/tasks/{id}/cancel"), "{}", Some(TOKEN)).await;
        assert_eq!((code, refused["error"]["code"].as_str()), (409, Some("not_cancellable")), "{refused}");
    }
    // One drill per shard at a time (it measures for a second before it
    // even pauses the follower, so it is still running here).
    let (code, refused) = cluster.coord_post(1, "/v1/drills/failover", r#"{"shard": 1}"#, Some(TOKEN)).await;
    assert_eq!((code, refused["error"]["code"].as_str()), (409, Some("drill_in_progress")), "{refused}");
    assert!(refused["error"]["message"].as_str().unwrap().contains(&id), "names the running drill: {refused}");
    let mut report = serde_json::Value::Null;
    wait_until("the catch-up drill to finish", Duration::from_secs(90), || {
        let (_, r) = futures::executor::block_on(cluster.coord_get(1, &format!("/v1/drills/{id}")));
        let done = r["state"] != "running";
        report = r;
        async move { done }
    })
    .await;
    assert_eq!(report["state"], "done", "{report}");
    let mut task = serde_json::Value::Null;
    wait_until("the drill's task to finish", Duration::from_secs(10), || {
        let (_, t) = futures::executor::block_on(cluster.coord_get(1, &format!("/v1/tasks/{id}")));
        let done = t["state"] != "running";
        task = t;
        async move { done }
    })
    .await;
    assert_eq!(task["state"], "succeeded", "{task}");
    assert_eq!(task["summary"]["catchup"], report["catchup"], "the task's summary is the drill's report");
    assert!(task["bytes"].as_i64().unwrap() > 0, "the drill's bytes written are its progress: {task}");
    let (_, page) = cluster.coord_get(1, "/v1/tasks?kind=drill-catchup").await;
    assert_eq!(page["total"], 1, "{page}");
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

/// Appends `count` records of `size` bytes to shard 1 through `walship
/// append` (the operator's own records, as a drill finds them).
fn cli_append(grpc: &str, count: u32, size: u32) {
    let out = std::process::Command::new(common::walship_bin())
        .args(["append", "--server", grpc, "--shard", "1"])
        .args(["--count", &count.to_string(), "--size", &size.to_string()])
        .env("WALSHIP_LOG", "warn")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

async fn append_quorum(grpc: &str) -> Result<u64, tonic::Status> {
    let mut log = common::history::client(grpc).await.ok_or_else(|| tonic::Status::unavailable("no connection"))?;
    let mut request = tonic::Request::new(walship_proto::log::AppendRequest {
        shard_id: 1,
        records: vec![walship_proto::log::AppendRecord {
            key: Default::default(),
            payload: bytes::Bytes::from_static(b"after the drill"),
        }],
        durability: walship_proto::log::Durability::Quorum as i32,
        ..Default::default()
    });
    request.set_timeout(Duration::from_secs(2));
    log.append(request).await.map(|r| r.into_inner().last_seqno)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_catch_up_drill_that_leaves_no_quorum_gives_up_and_resumes_its_follower() {
    let mut cluster = Cluster::start_with(3, 1, 1, FAST, None);
    cluster.wait_node_leads(1, 1, Duration::from_secs(30)).await;
    // Node 2 dies: leader 1 and follower 3 still make a quorum, until the
    // drill pauses 3.
    cluster.node(2).kill9();
    let grpc = cluster.node(1).grpc.clone();
    wait_until("a QUORUM append with node 2 down", Duration::from_secs(30), || {
        let grpc = grpc.clone();
        async move { append_quorum(&grpc).await.is_ok() }
    })
    .await;
    let body = r#"{"shard": 1, "follower": 3, "volume_bytes": 1048576, "record_bytes": 1024}"#;
    let report = run_drill(&mut cluster, "/v1/drills/catchup", body).await;
    assert_eq!(report["state"], "failed", "{report}");
    let error = report["error"].as_str().unwrap();
    assert!(error.contains("no append was acknowledged") && error.contains("the follower was resumed"), "{error}");
    // Resumed: node 3 takes pushes again, so QUORUM appends are
    // acknowledged again.
    wait_until("a QUORUM append after the drill", Duration::from_secs(30), || {
        let grpc = grpc.clone();
        async move { append_quorum(&grpc).await.is_ok() }
    })
    .await;
    // Its appenders stopped with it: the log does not grow any more.
    let last = |s: serde_json::Value| s["shards"][0]["last_seqno"].as_u64().unwrap();
    let before = last(cluster.status(1).await.unwrap());
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(last(cluster.status(1).await.unwrap()), before, "the failed drill's load kept appending");
    // And the shard takes a drill again.
    let (code, started) = cluster
        .coord_post(
            1,
            "/v1/drills/catchup",
            r#"{"shard": 1, "follower": 3, "volume_bytes": 1024, "record_bytes": 1024}"#,
            Some(TOKEN),
        )
        .await;
    assert_eq!(code, 202, "{started}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drill_verifies_a_shard_whose_oldest_records_were_compacted() {
    // Retention keeps 4 MiB: 12 MiB appended leaves the log starting past
    // seqno 1 on every replica.
    let small = format!("{FAST}\nretain_bytes = 4194304\nmax_retain_bytes = 8388608\nretention_interval_ms = 100");
    let mut cluster = Cluster::start_with(3, 1, 1, &small, None);
    cluster.wait_node_leads(1, 1, Duration::from_secs(30)).await;
    let grpc = cluster.node(1).grpc.clone();
    cli_append(&grpc, 13, 1000000);
    let first = |s: serde_json::Value| s["shards"][0]["first_seqno"].as_u64().unwrap();
    for id in 1..=3 {
        wait_until(&format!("node {id} to compact its oldest records"), Duration::from_secs(30), || {
            let status = futures::executor::block_on(cluster.status(id));
            async move { status.is_some_and(|s| first(s) > 1) }
        })
        .await;
    }
    // Room for a drill now: the whole cluster restarts with 64 MiB.
    let config = std::fs::read_to_string(&cluster.config_path).unwrap();
    let roomy = config
        .replace("retain_bytes = 4194304", "retain_bytes = 67108864")
        .replace("max_retain_bytes = 8388608", "max_retain_bytes = 134217728");
    assert_ne!(roomy, config);
    std::fs::write(&cluster.config_path, roomy).unwrap();
    for id in 1..=3 {
        cluster.restart(id);
    }
    cluster.restart_coordinator(1);
    cluster.wait_leader(1, None, Duration::from_secs(60)).await;
    // The shard may be led again (the replicas keep their promises) before
    // the restarted coordinator holds its lease: a drill asked of it then is
    // refused `not_active`.
    wait_until("the restarted coordinator to hold its lease", Duration::from_secs(60), || {
        let (_, view) = futures::executor::block_on(cluster.coord_get(1, "/v1/cluster"));
        async move { view["coordinator"]["active"] == true }
    })
    .await;
    // The drill checks its own records (all past the compacted ones), not
    // the shard from seqno 1.
    let body = r#"{"shard": 1, "clients": 2, "phase_ms": 300}"#;
    let report = run_drill(&mut cluster, "/v1/drills/failover", body).await;
    assert_eq!(report["state"], "done", "{report}");
    let f = &report["failover"];
    assert!(f["acked"].as_u64().unwrap() > 0, "{f}");
    assert_eq!((f["lost"].as_u64(), f["divergent_replicas"].as_u64()), (Some(0), Some(0)), "{f}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_nobody_renews_ends_by_itself() {
    let replication = format!("{FAST}\npause_lease_ms = 5000");
    let mut cluster = Cluster::start_with(3, 1, 1, &replication, None);
    cluster.wait_node_leads(1, 1, Duration::from_secs(30)).await;
    let grpc = cluster.node(1).grpc.clone();
    append_quorum(&grpc).await.unwrap();
    // Paused as a drill pauses it, and the drill gone: nobody resumes it.
    common::pause_shard(&cluster.node(3).grpc, 1, true).await;
    let durable = |s: serde_json::Value| s["shards"][0]["durable_seqno"].as_u64().unwrap();
    let before = durable(cluster.status(3).await.unwrap());
    let last = append_quorum(&grpc).await.unwrap();
    // Paused: node 3 takes none of it (looked at well within the lease)...
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(durable(cluster.status(3).await.unwrap()), before, "a paused follower took a shipment");
    // ... until its lease runs out, and it catches up by itself.
    wait_until("node 3 to resume and catch up without a resume call", Duration::from_secs(30), || {
        let status = futures::executor::block_on(cluster.status(3));
        async move { status.is_some_and(|s| durable(s) >= last) }
    })
    .await;
}

/// Runs `walship drill corruption` with `args` against coordinator 1;
/// (exit success, stdout, stderr).
async fn cli_corruption_drill(cluster: &mut Cluster, args: &[&str]) -> (bool, String, String) {
    cli_drill(cluster, "corruption", args).await
}

/// Runs `walship drill <kind>` with `args` against coordinator 1; (exit
/// success, stdout, stderr).
async fn cli_drill(cluster: &mut Cluster, kind: &str, args: &[&str]) -> (bool, String, String) {
    let admin = format!("http://{}", cluster.coordinator(1).admin);
    let kind = kind.to_string();
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(common::walship_bin())
            .args(["drill", &kind, "--json", "--admin", &admin, "--token", TOKEN])
            .args(&args)
            .output()
            .expect("run walship drill")
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
                ..Default::default()
            };
            log.append(request).await.unwrap();
        }
    }
    async fn control(node: &common::NodeProcess) -> ControlClient<common::Member> {
        let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{}", node.grpc)).unwrap();
        ControlClient::new(common::as_member(endpoint.connect().await.unwrap()))
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

/// FAST's replication timeout: max(leader_timeout_ms 1000, 3 × keepalive_ms
/// 100). A leader cut from its majority stops acknowledging within it, and
/// the coordinator fails over once a majority has not heard the leader for
/// `leader_timeout_ms`.
const FAST_REPLICATION_TIMEOUT_MS: u64 = 1000;

/// Waits until the coordinator records node 1 as shard 1's leader.
async fn wait_coordinator_records_node_1(cluster: &mut Cluster) {
    cluster.wait_node_leads(1, 1, Duration::from_secs(30)).await;
    wait_until("the coordinator to record node 1 as leader", Duration::from_secs(30), || {
        let ok = futures::executor::block_on(cluster.leader_of(1, 1)).is_some_and(|(l, _)| l == 1);
        async move { ok }
    })
    .await;
}

/// Peers node `id`'s status page says a partition drill cuts it from.
async fn partitioned_from(cluster: &Cluster, id: u32) -> serde_json::Value {
    cluster.status(id).await.expect("node status")["drill_partitioned_from"].clone()
}

/// `walship drill partition --between leader,followers --seconds 2
/// --trials 3`: each trial cuts the then leader from both followers; a
/// follower must take over and acknowledge a QUORUM append within three
/// replication timeouts of the cut, nothing acknowledged may be lost, and
/// the old leader must acknowledge no `LOCAL` append sent a replication
/// timeout or more after it lost its majority. Afterwards no node is cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_drill_cut_leaders_are_replaced_and_nothing_is_lost() {
    let mut cluster = Cluster::start_with(3, 1, 1, FAST, None);
    wait_coordinator_records_node_1(&mut cluster).await;

    let args = ["--shard", "1", "--between", "leader,followers", "--seconds", "2", "--trials", "3", "--clients", "4"];
    let (ok, stdout, stderr) = cli_drill(&mut cluster, "partition", &args).await;
    assert!(ok, "the drill failed: {stdout}\n{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("a JSON report on stdout");
    assert_eq!((report["kind"].as_str(), report["state"].as_str()), (Some("partition"), Some("done")), "{report}");
    let p = &report["partition"];
    assert_eq!(p["replication_timeout_ms"], FAST_REPLICATION_TIMEOUT_MS, "{p}");
    let trials = p["trials"].as_array().expect("trials");
    assert_eq!(trials.len(), 3, "{p}");
    let bound = 3 * FAST_REPLICATION_TIMEOUT_MS;
    let mut times = Vec::new();
    for (i, t) in trials.iter().enumerate() {
        assert_eq!(t["trial"], i as u64 + 1, "{t}");
        assert_ne!(t["new_leader"], t["old_leader"], "trial {}: the cut leader still leads: {t}", i + 1);
        assert!(t["new_epoch"].as_u64().unwrap() > t["old_epoch"].as_u64().unwrap(), "{t}");
        if i > 0 {
            assert_eq!(t["old_leader"], trials[i - 1]["new_leader"], "each trial cuts the leader then: {p}");
        }
        let ms = t["time_to_new_leader_ms"].as_u64().unwrap_or_else(|| panic!("no new leader: {t}"));
        assert!(ms < bound, "trial {}: new leader after {ms} ms, bound {bound} ms: {t}", i + 1);
        times.push(ms);
        let failover = t["time_to_failover_ms"].as_u64().unwrap_or_else(|| panic!("no failover time: {t}"));
        assert!(failover <= ms, "the failover is recorded before the new leader acknowledges: {t}");
        assert!(t["failovers"].as_u64().unwrap() >= 1, "{t}");
        assert!(t["acked"].as_u64().unwrap() > 0, "{t}");
        assert_eq!(t["records_lost"], 0, "{t}");
        assert_eq!(t["old_leader_local_acks_after_timeout"], 0, "{t}");
        assert!(t["old_leader_local_acks_within_timeout"].is_u64(), "{t}");
    }
    assert_eq!(p["records_lost"], 0, "{p}");
    assert_eq!(p["old_leader_local_acks_after_timeout"], 0, "{p}");
    let summary = &p["time_to_new_leader"];
    assert_eq!(summary["count"], 3, "{p}");
    assert_eq!(summary["max_ms"].as_u64(), times.iter().max().copied(), "{p}");
    let sorted = {
        let mut t = times.clone();
        t.sort_unstable();
        t
    };
    assert_eq!((summary["p50_ms"].as_u64(), summary["p99_ms"].as_u64()), (Some(sorted[1]), Some(sorted[2])), "{p}");
    // Healed: no node treats a peer as unreachable any more.
    for id in 1..=3 {
        assert_eq!(partitioned_from(&cluster, id).await, serde_json::json!([]), "node {id}");
    }
    eprintln!("partition drill: times to new leader {times:?} ms; {p}");
}

/// Bad partition drill requests are refused (404 unknown shard, 400 for a
/// `between` other than the two shapes, naming them, and for trials 0 or
/// 21), starting nothing and moving no leadership; cutting one follower
/// from the leader (`follower,leader`) fails nothing over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_drill_refuses_bad_input_and_a_cut_follower_moves_no_leadership() {
    let mut cluster = Cluster::start_with(3, 1, 1, FAST, None);
    wait_coordinator_records_node_1(&mut cluster).await;
    let before = cluster.leader_of(1, 1).await;

    let path = "/v1/drills/partition";
    let (code, _) = cluster.coord_post(1, path, r#"{"shard": 1}"#, None).await;
    assert_eq!(code, 401);
    let (code, body) = cluster.coord_post(1, path, r#"{"shard": 99}"#, Some(TOKEN)).await;
    assert_eq!((code, body["error"]["code"].as_str()), (404, Some("unknown_shard")), "{body}");
    for between in ["leader,coordinator", "followers,leader", ""] {
        let request = format!(r#"{{"shard": 1, "between": "{between}"}}"#);
        let (code, body) = cluster.coord_post(1, path, &request, Some(TOKEN)).await;
        assert_eq!(code, 400, "{between:?}: {body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains("leader,followers") && message.contains("follower,leader"), "{message}");
    }
    for trials in [0, 21] {
        let request = format!(r#"{{"shard": 1, "trials": {trials}}}"#);
        let (code, body) = cluster.coord_post(1, path, &request, Some(TOKEN)).await;
        assert_eq!(code, 400, "trials {trials}: {body}");
        assert!(body["error"]["message"].as_str().unwrap().contains("trials"), "{body}");
    }
    let (ok, _, stderr) = cli_drill(&mut cluster, "partition", &["--shard", "1", "--between", "leader"]).await;
    assert!(!ok && stderr.contains("400") && stderr.contains("follower,leader"), "{stderr}");
    let (_, list) = cluster.coord_get(1, "/v1/drills").await;
    assert_eq!(list, serde_json::json!([]), "a refused drill started something");
    assert_eq!(cluster.leader_of(1, 1).await, before, "a refused drill moved leadership");

    let args = ["--shard", "1", "--between", "follower,leader", "--seconds", "2", "--clients", "4"];
    let (ok, stdout, stderr) = cli_drill(&mut cluster, "partition", &args).await;
    assert!(ok, "the drill failed: {stdout}\n{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("a JSON report on stdout");
    let p = &report["partition"];
    assert_eq!(p["failovers"], 0, "cutting one follower failed the shard over: {p}");
    let t = &p["trials"][0];
    assert_eq!((t["old_leader"].as_u64(), t["new_leader"].as_u64()), (Some(1), Some(1)), "{t}");
    assert_eq!(t["new_epoch"], t["old_epoch"], "{t}");
    assert_eq!(t["cut_follower"], 2, "the first follower is cut: {t}");
    assert!(t["time_to_new_leader_ms"].is_null() && t["time_to_failover_ms"].is_null(), "{t}");
    assert!(t["acked"].as_u64().unwrap() > 0, "the leader kept acknowledging with one follower: {t}");
    assert_eq!(p["records_lost"], 0, "{p}");
    assert_eq!(cluster.leader_of(1, 1).await, before, "leadership moved");
    for id in 1..=3 {
        assert_eq!(partitioned_from(&cluster, id).await, serde_json::json!([]), "node {id}");
    }
}

/// `Control.Partition` refuses, changing nothing: on a node without
/// `--allow-crash-drills` (PERMISSION_DENIED), and naming an unknown node,
/// the node itself, or lasting past the cap (INVALID_ARGUMENT), even when a
/// partition is in force. A valid one cuts only the named peer (its
/// catch-up requests are refused with UNAVAILABLE, another follower's are
/// not, and the leader still commits with the other follower), heals at
/// millis 0 and expires by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_rpc_refuses_bad_input_and_changes_nothing() {
    use walship_proto::log::control_client::ControlClient;
    use walship_proto::log::{AppendRecord, AppendRequest, Durability, PartitionRequest};
    use walship_proto::replication::StreamRequest;
    use walship_proto::replication::wal_shipping_client::WalShippingClient;

    async fn channel(grpc: &str) -> common::Member {
        common::as_member(
            tonic::transport::Endpoint::from_shared(format!("http://{grpc}")).unwrap().connect().await.unwrap(),
        )
    }
    let cut = |peers: &[u32], millis| PartitionRequest { peers: peers.to_vec(), millis };

    // Without --allow-crash-drills.
    let dir = tempfile::tempdir().unwrap();
    let node = common::NodeProcess::start(1, dir.path(), "1", &[]);
    let refused = ControlClient::new(channel(&node.grpc).await).partition(cut(&[2], 1000)).await;
    common::assert_refused(
        "partition without crash drills",
        refused,
        tonic::Code::PermissionDenied,
        &["allow-crash-drills"],
        &[],
    );
    let (code, body) = common::http_get(&format!("{}/v1/status", node.admin)).await;
    assert_eq!(code, 200);
    let status: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status["drill_partitioned_from"], serde_json::json!([]), "{status}");

    let mut cluster = Cluster::start_with(3, 1, 1, FAST, None);
    wait_coordinator_records_node_1(&mut cluster).await;
    let grpc = cluster.node(1).grpc.clone();
    let mut control = ControlClient::new(channel(&grpc).await);
    /// (peers, millis, words and numbers the refusal names).
    type Bad<'a> = (&'a [u32], u64, &'a [&'a str], &'a [u64]);
    let bad: [Bad; 4] = [
        (&[9], 1000, &["not a node"], &[9]),
        (&[1], 1000, &["itself"], &[1]),
        (&[2, 9], 1000, &["not a node"], &[9]),
        (&[2], 600_001, &["at most"], &[600_001, 600_000]),
    ];
    for (peers, millis, words, numbers) in bad {
        let refused = control.partition(cut(peers, millis)).await;
        common::assert_refused("a bad partition", refused, tonic::Code::InvalidArgument, words, numbers);
        assert_eq!(partitioned_from(&cluster, 1).await, serde_json::json!([]), "{peers:?} {millis}");
    }

    // A valid partition from node 2; bad input then leaves it as it is.
    control.partition(cut(&[2], 60_000)).await.expect("a partition from node 2");
    assert_eq!(partitioned_from(&cluster, 1).await, serde_json::json!([2]));
    let refused = control.partition(cut(&[9], 0)).await;
    common::assert_refused("a bad heal", refused, tonic::Code::InvalidArgument, &["not a node"], &[9]);
    assert_eq!(partitioned_from(&cluster, 1).await, serde_json::json!([2]), "a refused call changed the partition");
    // Node 2's catch-up requests are refused as partitioned; node 3's are not.
    let mut shipping = WalShippingClient::new(channel(&grpc).await);
    let stream = |follower| StreamRequest { shard_id: 1, from_seqno: 1, epoch: 0, follower_node_id: follower };
    let refused = shipping.stream_segments(stream(2)).await.map(|_| ());
    common::assert_refused(
        "a cut follower's catch-up",
        refused,
        tonic::Code::Unavailable,
        &["partitioned (drill)"],
        &[1, 2],
    );
    assert!(shipping.stream_segments(stream(3)).await.is_ok(), "node 3 is not cut");
    // The leader still commits with node 3.
    let mut log = cluster.node(1).client().await;
    let append = AppendRequest {
        shard_id: 1,
        records: vec![AppendRecord {
            key: bytes::Bytes::new(),
            payload: bytes::Bytes::from_static(b"while cut from 2"),
        }],
        durability: Durability::Quorum as i32,
        ..Default::default()
    };
    log.append(append).await.expect("a QUORUM append with one follower cut");

    control.partition(cut(&[], 0)).await.expect("heal");
    assert_eq!(partitioned_from(&cluster, 1).await, serde_json::json!([]));
    // A partition expires by itself.
    control.partition(cut(&[2, 3], 3_000)).await.expect("a short partition");
    assert_eq!(partitioned_from(&cluster, 1).await, serde_json::json!([2, 3]));
    wait_until("the partition to expire", Duration::from_secs(10), || {
        let healed = futures::executor::block_on(partitioned_from(&cluster, 1)) == serde_json::json!([]);
        async move { healed }
    })
    .await;
}

/// Drills write into the live shard but never make retention compact the
/// operator's records: with a 12 MiB retention and 2 MiB of the operator's
/// records in shard 1, a catch-up drill of 8 MiB is refused (409
/// `drill_would_evict`, nothing written), while a failover drill and a
/// 1 MiB catch-up drill run, report what they wrote within the headroom,
/// and every node still holds the operator's records from seqno 1 after
/// retention has run many times. The CLI warns first and prints a summary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drills_never_cost_the_operators_records_through_retention() {
    let replication =
        format!("{FAST}\nretain_bytes = {}\nmax_retain_bytes = {}\nretention_interval_ms = 100", 12 << 20, 24 << 20);
    let mut cluster = Cluster::start_with(3, 1, 1, &replication, None);
    wait_coordinator_records_node_1(&mut cluster).await;
    cluster.wait_node_leads(1, 1, Duration::from_secs(30)).await;
    let grpc = cluster.node(1).grpc.clone();
    cli_append(&grpc, 8, 262144);
    let operators = common::read_all(&grpc, 1, 8).await;
    assert_eq!(operators.len(), 8);
    let last_before = cluster.status(1).await.unwrap()["shards"][0]["last_seqno"].as_u64().unwrap();

    // Too big for the headroom: refused, nothing written.
    let (ok, stdout, stderr) = cli_drill(&mut cluster, "catchup", &["--shard", "1", "--volume-mib", "8"]).await;
    assert!(!ok, "an 8 MiB drill into a shard with ~10 MiB of headroom ran: {stdout}");
    assert!(stderr.contains("409") && stderr.contains("drill_would_evict"), "{stderr}");
    assert!(stderr.contains("retention"), "{stderr}");
    let last_after = cluster.status(1).await.unwrap()["shards"][0]["last_seqno"].as_u64().unwrap();
    assert_eq!(last_after, last_before, "the refused drill wrote records");

    // A failover drill, through the CLI without --json: a warning, then a summary.
    let admin = format!("http://{}", cluster.coordinator(1).admin);
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(common::walship_bin())
            .args(["drill", "failover", "--shard", "1", "--clients", "4", "--admin", &admin, "--token", TOKEN])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("appends records into the live shard 1"), "no warning: {stderr}");
    assert!(stdout.starts_with("failover drill failover-") && stdout.contains(": done"), "{stdout}");
    assert!(stdout.contains(" lost, 0 divergent replicas") && stdout.contains("0 lost"), "{stdout}");
    assert!(stdout.contains("wrote ") && stdout.contains("retention headroom"), "{stdout}");
    assert!(serde_json::from_str::<serde_json::Value>(&stdout).is_err(), "the summary is not JSON");

    let (code, list) = cluster.coord_get(1, "/v1/drills").await;
    assert_eq!(code, 200);
    let failover = list.as_array().unwrap().iter().find(|d| d["kind"] == "failover").expect("the failover drill");
    let (written, headroom) =
        (failover["bytes_written"].as_u64().unwrap(), failover["retention_headroom_bytes"].as_u64().unwrap());
    assert!(written > 0 && written <= headroom, "wrote {written} of {headroom}");
    assert!(headroom < 12 << 20, "the headroom counts the operator's records: {headroom}");

    // The crashed leader back, following, before the catch-up drill pauses a follower.
    cluster.restart(1);
    wait_until("every replica of shard 1 alive and assigned", Duration::from_secs(60), || {
        let (code, s) = futures::executor::block_on(cluster.coord_get(1, "/v1/shards/1"));
        let ok = code == 200
            && s["replicas"].as_array().is_some_and(|r| {
                r.iter().all(|r| r["alive"] == true && (r["role"] == "leader" || r["role"] == "follower"))
            });
        async move { ok }
    })
    .await;
    let report = run_drill(
        &mut cluster,
        "/v1/drills/catchup",
        r#"{"shard": 1, "volume_bytes": 1048576, "record_bytes": 4096, "clients": 2}"#,
    )
    .await;
    assert_eq!(report["state"], "done", "{report}");
    assert!(report["bytes_written"].as_u64().unwrap() <= report["retention_headroom_bytes"].as_u64().unwrap());

    // Retention runs every 100 ms; after many passes every live node still
    // serves the operator's records from seqno 1.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (_, shard) = cluster.coord_get(1, "/v1/shards/1").await;
    for replica in shard["replicas"].as_array().unwrap() {
        let node = replica["node_id"].as_u64().unwrap() as u32;
        let Some(status) = cluster.status(node).await else { continue };
        assert_eq!(status["shards"][0]["first_seqno"], 1, "node {node} compacted: {status}");
        let grpc = cluster.node(node).grpc.clone();
        let records = common::read_all(&grpc, 1, 8).await;
        assert_eq!(records, operators, "node {node}'s copy of the operator's records");
    }
}
