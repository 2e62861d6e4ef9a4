//! The DataPlane against real processes: nodes connect to the active
//! coordinator as workers, tasks are dispatched by capacity, redispatched
//! after a worker dies, stalled and expired tasks are caught, cancellation
//! and dead letters work through the admin API; and the stream's rules
//! (Hello first, no duplicate worker, cluster secret, standby refusal)
//! hold for a hand-rolled worker.

mod common;

use std::time::Duration;

use common::{Cluster, TOKEN, wait_until};
use serde_json::{Value, json};
use tokio_stream::StreamExt;
use tonic::Code;
use walship_proto::dataplane::data_plane_client::DataPlaneClient;
use walship_proto::dataplane::worker_envelope::Msg as Up;
use walship_proto::dataplane::{Hello, ResultBatch, TaskProgress, WorkerEnvelope};

const WAIT: Duration = Duration::from_secs(60);

async fn workers(cluster: &mut Cluster) -> Vec<String> {
    let (_, view) = cluster.coord_get(1, "/v1/cluster").await;
    view["workers"]
        .as_array()
        .map_or(Vec::new(), |w| w.iter().map(|w| w["worker_id"].as_str().unwrap_or_default().to_string()).collect())
}

async fn wait_workers(cluster: &mut Cluster, n: usize) {
    wait_until("workers connected", WAIT, || {
        let got = futures::executor::block_on(workers(cluster)).len();
        async move { got == n }
    })
    .await;
}

async fn start(cluster: &mut Cluster, body: Value) -> String {
    let (code, answer) = cluster.coord_post(1, "/v1/tasks", &body.to_string(), Some(TOKEN)).await;
    assert_eq!(code, 202, "{answer}");
    answer["task_ids"][0].as_str().unwrap().to_string()
}

async fn task(cluster: &mut Cluster, id: &str) -> Value {
    let (code, view) = cluster.coord_get(1, &format!("/v1/tasks/{id}")).await;
    assert_eq!(code, 200, "{view}");
    view
}

async fn wait_state(cluster: &mut Cluster, id: &str, states: &[&str]) -> Value {
    let mut last = Value::Null;
    let deadline = std::time::Instant::now() + WAIT;
    while std::time::Instant::now() < deadline {
        last = task(cluster, id).await;
        if states.iter().any(|s| last["state"] == *s) {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("task {id} never reached {states:?}: {last}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_spread_over_workers_and_survive_a_dying_one() {
    let mut cluster = Cluster::start_with(3, 1, 1, "", None);
    wait_workers(&mut cluster, 3).await;
    let (_, view) = cluster.coord_get(1, "/v1/cluster").await;
    for w in view["workers"].as_array().unwrap() {
        assert_eq!(w["build_matches"], true, "{w}");
        assert!(w["capacity"].as_u64().unwrap() >= 1, "{w}");
    }
    // Thirty short tasks: all succeed, and more than one worker ran some.
    let mut ids = Vec::new();
    for _ in 0..30 {
        ids.push(start(&mut cluster, json!({"kind": "noop", "sleep_ms": 200})).await);
    }
    let mut ran_on = std::collections::BTreeSet::new();
    for id in &ids {
        let done = wait_state(&mut cluster, id, &["succeeded", "failed"]).await;
        assert_eq!(done["state"], "succeeded", "{done}");
        assert_eq!(done["attempts"], 1, "{done}");
        assert_eq!(done["kind"], "noop");
        ran_on.insert(done["node"].as_str().unwrap().to_string());
    }
    assert!(ran_on.len() >= 2, "thirty tasks all went to {ran_on:?}");
    let (_, page) = cluster.coord_get(1, "/v1/tasks?kind=noop&limit=1000").await;
    assert_eq!(page["total"], 30, "{page}");
    assert!(page["tasks"].as_array().unwrap().iter().all(|t| t["took_us"].as_u64().is_some()), "{page}");

    // The dispatch benchmark's harness runs (figures live in its output,
    // not in assertions).
    let admin = format!("http://{}", cluster.coordinator(1).admin);
    let bench = std::process::Command::new(common::walship_bin())
        .args(["bench-tasks", "--tasks", "200", "--admin", &admin, "--token", TOKEN])
        .output()
        .unwrap();
    let printed = String::from_utf8_lossy(&bench.stdout);
    assert!(bench.status.success(), "{printed} {}", String::from_utf8_lossy(&bench.stderr));
    assert!(printed.contains("200 no-op tasks") && printed.contains("tasks/s") && printed.contains("p99"), "{printed}");
    let refused = std::process::Command::new(common::walship_bin())
        .args(["bench-tasks", "--tasks", "0", "--admin", &admin, "--token", TOKEN])
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2), "--tasks 0 is a usage error");

    // A long task on the node that dies: requeued, run elsewhere, finished once.
    let long = start(&mut cluster, json!({"kind": "noop", "sleep_ms": 3000})).await;
    let running = wait_state(&mut cluster, &long, &["running"]).await;
    let node: u32 = running["node"].as_str().unwrap().trim_start_matches("node-").parse().unwrap();
    cluster.node(node).kill9();
    let done = wait_state(&mut cluster, &long, &["succeeded", "failed"]).await;
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(done["attempts"], 2, "dispatched again after its worker died: {done}");
    let (_, view) = cluster.coord_get(1, "/v1/cluster").await;
    assert!(view["dataplane"]["redispatched"].as_u64().unwrap() >= 1, "{view}");
    cluster.restart(node);
    wait_workers(&mut cluster, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalls_deadlines_cancels_and_dead_letters() {
    let mut cluster = Cluster::start_with(2, 1, 0, "", None);
    // One coordinator with short stall and attempt limits.
    let config = cluster.config_path.clone();
    let dir = cluster.dir.path().to_path_buf();
    let grpc = format!("127.0.0.1:{}", common::free_port());
    let admin = format!("127.0.0.1:{}", common::free_port());
    let text = std::fs::read_to_string(&config).unwrap();
    let coordinator = format!("[[coordinators]]\nid = \"c1\"\ngrpc_addr = \"{grpc}\"\nadmin_addr = \"{admin}\"\n");
    std::fs::write(&config, text.replacen("[[nodes]]", &format!("{coordinator}[[nodes]]"), 1)).unwrap();
    // Nodes read the config at start: restart them to learn the coordinator.
    cluster.restart(1);
    cluster.restart(2);
    let (child, _) = common::spawn_listening(
        std::process::Command::new(common::walship_bin())
            .args([
                "coord",
                "--id",
                "c1",
                "--admin-token",
                TOKEN,
                "--task-stall-s",
                "2",
                "--task-attempts",
                "2",
                "--cluster",
            ])
            .arg(&config)
            .arg("--data-dir")
            .arg(dir.join("coord")),
        "coordinator",
    );
    cluster.coordinators.push(common::CoordProcess { child, admin: admin.clone(), grpc, id: 1 });
    wait_workers(&mut cluster, 2).await;

    // No progress: requeued once, then failed for good (a dead letter).
    let stuck = start(&mut cluster, json!({"kind": "noop", "sleep_ms": 60000, "advance": false})).await;
    let failed = wait_state(&mut cluster, &stuck, &["failed"]).await;
    assert_eq!(failed["attempts"], 2, "{failed}");
    assert_eq!(failed["dead_letter"], true, "{failed}");
    assert!(failed["error"].as_str().unwrap().contains("no progress"), "{failed}");
    let (_, dead) = cluster.coord_get(1, "/v1/dead-letters").await;
    assert!(dead.as_array().unwrap().iter().any(|t| t["task_id"] == *stuck), "{dead}");
    // Re-driven: queued and dispatched again.
    let (code, _) = cluster.coord_post(1, &format!("/v1/dead-letters/{stuck}/redrive"), "{}", Some(TOKEN)).await;
    assert_eq!(code, 200);
    let again = wait_state(&mut cluster, &stuck, &["running", "queued"]).await;
    assert_eq!(again["dead_letter"], false, "{again}");
    // A task that is not a dead letter cannot be re-driven; an unknown one is 404.
    let quick = start(&mut cluster, json!({"kind": "noop"})).await;
    wait_state(&mut cluster, &quick, &["succeeded"]).await;
    let (code, body) = cluster.coord_post(1, &format!("/v1/dead-letters/{quick}/redrive"), "{}", Some(TOKEN)).await;
    assert_eq!((code, body["error"]["code"].as_str()), (409, Some("not_dead_letter")), "{body}");
    let (code, _) = cluster.coord_post(1, "/v1/dead-letters/t-nope/redrive", "{}", Some(TOKEN)).await;
    assert_eq!(code, 404);

    // A dead letter whose cause is gone (its node died under both
    // attempts) finishes when re-driven. Before, no job listened to it any
    // more, its results were dropped before its state was looked at, and
    // it ran until the stall watchdog made it a dead letter again.
    let lost = start(&mut cluster, json!({"kind": "noop", "node": "node-2", "sleep_ms": 3000})).await;
    for attempt in 1..=2 {
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            let t = task(&mut cluster, &lost).await;
            if t["state"] == "running" && t["attempts"] == attempt {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "attempt {attempt} never ran: {t}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        cluster.restart(2);
    }
    let died = wait_state(&mut cluster, &lost, &["failed"]).await;
    assert_eq!(died["dead_letter"], true, "{died}");
    wait_workers(&mut cluster, 2).await;
    let (code, _) = cluster.coord_post(1, &format!("/v1/dead-letters/{lost}/redrive"), "{}", Some(TOKEN)).await;
    assert_eq!(code, 200);
    let done = wait_state(&mut cluster, &lost, &["succeeded", "failed"]).await;
    assert_eq!((done["state"].as_str(), done["attempts"].as_u64()), (Some("succeeded"), Some(3)), "{done}");

    // Past its deadline: failed, not retried.
    let late = start(&mut cluster, json!({"kind": "noop", "sleep_ms": 20000, "deadline_ms": 500})).await;
    let failed = wait_state(&mut cluster, &late, &["failed"]).await;
    assert!(failed["error"].as_str().unwrap().contains("deadline"), "{failed}");

    // Cancelled by an operator: stays cancelled.
    let long = start(&mut cluster, json!({"kind": "noop", "sleep_ms": 20000})).await;
    wait_state(&mut cluster, &long, &["running"]).await;
    let (code, _) = cluster.coord_post(1, &format!("/v1/tasks/{long}/cancel"), "{}", None).await;
    assert_eq!(code, 401, "cancel needs the token");
    let (code, view) = cluster.coord_post(1, &format!("/v1/tasks/{long}/cancel"), "{}", Some(TOKEN)).await;
    assert_eq!((code, view["state"].as_str()), (200, Some("cancelled")), "{view}");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(task(&mut cluster, &long).await["state"], "cancelled");

    // A failing task fails with its error; bad requests change nothing.
    let bad = start(&mut cluster, json!({"kind": "noop", "fail": "on purpose"})).await;
    let failed = wait_state(&mut cluster, &bad, &["failed"]).await;
    assert_eq!(failed["error"], "on purpose");
    let (_, before) = cluster.coord_get(1, "/v1/tasks?limit=1000").await;
    for body in [
        json!({"kind": "mystery"}),
        json!({"kind": ""}),
        json!({"kind": "noop", "node": "node-9"}),
        json!({"kind": "noop", "extra": 1}),
        json!([]),
    ] {
        let (code, answer) = cluster.coord_post(1, "/v1/tasks", &body.to_string(), Some(TOKEN)).await;
        assert!((400..500).contains(&code), "{body} -> {code} {answer}");
    }
    let (code, _) = cluster.coord_post(1, "/v1/tasks", &json!({"kind": "noop"}).to_string(), None).await;
    assert_eq!(code, 401);
    let (_, after) = cluster.coord_get(1, "/v1/tasks?limit=1000").await;
    assert_eq!(before["total"], after["total"], "refused requests added tasks");
    for query in ["state=sideways", "limit=0", "limit=5000", "shard=x"] {
        let (code, _) = cluster.coord_get(1, &format!("/v1/tasks?{query}")).await;
        assert_eq!(code, 400, "{query}");
    }
    let (code, _) = cluster.coord_get(1, "/v1/tasks/t-nope").await;
    assert_eq!(code, 404);
}

async fn channel(grpc: &str) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{grpc}")).unwrap().connect().await.unwrap()
}

/// A client as a member of the cluster (with its secret).
async fn member(grpc: &str) -> DataPlaneClient<common::Member> {
    DataPlaneClient::new(common::as_member(channel(grpc).await))
}

fn hello(id: &str) -> WorkerEnvelope {
    WorkerEnvelope {
        msg: Some(Up::Hello(Hello {
            worker_id: id.into(),
            build_sha: env!("CARGO_PKG_VERSION").into(),
            num_cpus: 1,
            gomemlimit: 0,
        })),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_starts_with_hello_and_refuses_what_breaks_its_rules() {
    let mut cluster = Cluster::start_with(3, 1, 2, "", None);
    wait_workers(&mut cluster, 3).await;
    let active = cluster.coordinator(1).grpc.clone();
    let standby = cluster.coordinator(2).grpc.clone();

    // Without the cluster secret.
    let refused =
        DataPlaneClient::new(channel(&active).await).connect(tokio_stream::iter(vec![hello("stranger")])).await;
    assert_eq!(refused.unwrap_err().code(), Code::Unauthenticated);
    // A standby names no workers and refuses.
    let refused = member(&standby).await.connect(tokio_stream::iter(vec![hello("w1")])).await;
    let status = refused.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(status.message().contains("standby"), "{status:?}");
    // The first message is not Hello.
    let progress = WorkerEnvelope { msg: Some(Up::TaskProgress(TaskProgress::default())) };
    let refused = member(&active).await.connect(tokio_stream::iter(vec![progress])).await;
    let status = refused.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("Hello"), "{status:?}");
    // A worker id that is already connected; an empty one.
    let refused = member(&active).await.connect(tokio_stream::iter(vec![hello("node-1")])).await;
    assert_eq!(refused.unwrap_err().code(), Code::AlreadyExists);
    let refused = member(&active).await.connect(tokio_stream::iter(vec![hello("")])).await;
    assert_eq!(refused.unwrap_err().code(), Code::InvalidArgument);
    assert_eq!(workers(&mut cluster).await.len(), 3, "refusals changed the workers");

    // A proper worker: Welcome; a result for an unknown job is dropped and
    // the stream stays up; a second Hello ends it.
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    tx.send(hello("probe")).await.unwrap();
    let mut inbound =
        member(&active).await.connect(tokio_stream::wrappers::ReceiverStream::new(rx)).await.unwrap().into_inner();
    let welcome = inbound.next().await.unwrap().unwrap();
    assert!(matches!(welcome.msg, Some(walship_proto::dataplane::coord_envelope::Msg::Welcome(_))), "{welcome:?}");
    wait_workers(&mut cluster, 4).await;
    let (_, before) = cluster.coord_get(1, "/v1/cluster").await;
    let stray =
        ResultBatch { query_id: "q-nobody".into(), worker_id: "probe".into(), terminal: true, ..Default::default() };
    tx.send(WorkerEnvelope { msg: Some(Up::ResultBatch(stray)) }).await.unwrap();
    wait_until("the stray result counted", WAIT, || {
        let (_, now) = futures::executor::block_on(cluster.coord_get(1, "/v1/cluster"));
        let more = now["dataplane"]["dropped_results"].as_u64() > before["dataplane"]["dropped_results"].as_u64();
        async move { more }
    })
    .await;
    assert!(workers(&mut cluster).await.contains(&"probe".to_string()), "the stream stayed up");
    tx.send(hello("probe")).await.unwrap();
    let ended = inbound.next().await;
    assert!(matches!(&ended, Some(Err(s)) if s.code() == Code::InvalidArgument), "{ended:?}");
    wait_workers(&mut cluster, 3).await;

    // The coordinator restarts: every node reconnects by itself.
    cluster.restart_coordinator(1);
    wait_workers(&mut cluster, 3).await;
    let id = start(&mut cluster, json!({"kind": "noop"})).await;
    assert_eq!(wait_state(&mut cluster, &id, &["succeeded", "failed"]).await["state"], "succeeded");
}

/// `verify` compares every replica of a shard: equal while they are, and
/// after one record of one follower is damaged on disk, the exact seqno and
/// the replica that differs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_finds_the_first_bad_seqno_of_a_damaged_replica() {
    use walship_proto::log::{AppendRecord, AppendRequest, Durability};
    // Test nodes honour crash drills (DamageRecord) already.
    let mut cluster = Cluster::start_with(3, 1, 1, "", None);
    wait_workers(&mut cluster, 3).await;
    let (leader, _) = cluster.leader_of(1, 1).await.expect("a leader");
    let mut log = cluster.node(leader).client().await;
    for i in 0..30 {
        let records = (0..10)
            .map(|j| AppendRecord {
                key: format!("k{i}").into_bytes().into(),
                payload: format!("verify-{i}-{j}").repeat(40).into_bytes().into(),
            })
            .collect();
        log.append(AppendRequest { shard_id: 1, records, durability: Durability::All as i32, ..Default::default() })
            .await
            .unwrap();
    }
    let run = async |cluster: &mut Cluster, body: Value| -> Value {
        let body = body.to_string();
        let (code, started) = cluster.coord_post(1, "/v1/tasks", &body, Some(TOKEN)).await;
        assert_eq!(code, 202, "{started}");
        let job = started["query_id"].as_str().unwrap().to_string();
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            let (code, view) = cluster.coord_get(1, &format!("/v1/jobs/{job}")).await;
            assert_eq!(code, 200, "{view}");
            if view["state"] == "done" {
                return view["report"].clone();
            }
            assert!(std::time::Instant::now() < deadline, "verify never finished: {view}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let report =
        run(&mut cluster, json!({"kind": "verify", "shard": 1, "from": 1, "to": 300, "chunk_records": 64})).await;
    assert_eq!(report["verdict"], "equal", "{report}");
    assert_eq!(report["equal_through"], 300, "{report}");

    // Node 2's record 37 silently diverges.
    forge_record(&mut cluster, 2, 1, 37, 300);
    cluster.restart(2);
    wait_workers(&mut cluster, 3).await;
    let report =
        run(&mut cluster, json!({"kind": "verify", "shard": 1, "from": 1, "to": 300, "chunk_records": 64})).await;
    assert_eq!(report["verdict"], "diverged", "{report}");
    assert_eq!(report["first_divergent_seqno"], 37, "{report}");
    assert_eq!(report["differing"], json!([2]), "{report}");
    assert_eq!(report["missing"], json!([]), "{report}");
    assert_eq!(report["majority"], json!([1, 3]), "{report}");
    // The same through the CLI: exit code 4 and the seqno named.
    let admin = format!("http://{}", cluster.coordinator(1).admin);
    let cli = |args: &[&str]| {
        std::process::Command::new(common::walship_bin())
            .args(args)
            .args(["--admin", &admin, "--token", TOKEN])
            .output()
            .unwrap()
    };
    let out = cli(&["verify", "--shard", "1", "--from", "1", "--to", "300", "--chunk-records", "64"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(4), "{stdout} {}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("differ from seqno 37") && stdout.contains("differing [2]"), "{stdout}");
    let out = cli(&["verify", "--shard", "1", "--from", "1", "--to", "36"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("holds the same records [1, 36]"));
    let out = cli(&["task", "list", "--kind", "verify", "--limit", "100"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("verify"), "{}", String::from_utf8_lossy(&out.stdout));
    // Its tasks carry the report, and ran once on every replica per pass.
    let (_, page) = cluster.coord_get(1, "/v1/tasks?kind=verify&shard=1&limit=1000").await;
    let tasks = page["tasks"].as_array().unwrap();
    assert_eq!(tasks.len(), 3 * 6, "1 + 2 + 2 + 1 passes, each on the three replicas: {page}");
    assert!(tasks.iter().all(|t| t["state"] == "succeeded"), "{page}");
    // Bad verify requests are refused and start nothing.
    for (body, code) in [
        (json!({"kind": "verify"}), 400),
        (json!({"kind": "verify", "shard": 9}), 404),
        (json!({"kind": "noop", "shard": 1}), 400),
        (json!({"kind": "verify", "shard": 1, "sleep_ms": 5}), 400),
        (json!({"kind": "verify", "shard": 1, "chunk_records": 0}), 400),
        (json!({"kind": "verify", "shard": 1, "node": "node-1"}), 400),
    ] {
        let (got, answer) = cluster.coord_post(1, "/v1/tasks", &body.to_string(), Some(TOKEN)).await;
        assert_eq!(got, code, "{body}: {answer}");
    }
    let (_, after) = cluster.coord_get(1, "/v1/tasks?kind=verify&limit=1000").await;
    assert_eq!(after["total"], 18, "refused verifies started tasks");
}

/// Silent divergence, which no checksum catches: node `node`'s record
/// `seqno` of `shard` is rewritten offline as a different, well-formed
/// record (same seqno, epoch, time and key; another payload; records up to
/// `last` kept). Its CRCs all hold, so neither reads nor the scrubber
/// notice; only comparing replicas does. Leaves the node stopped.
fn forge_record(cluster: &mut Cluster, node: u32, shard: u32, seqno: u64, last: u64) {
    use walship_wal::{EngineStore, EngineStoreConfig, Frame, LogStore, RecordFields, ShardAppend};
    cluster.node(node).kill9();
    let dir = cluster.node(node).data_dir.join("wal");
    let store = EngineStore::open(&dir, &EngineStoreConfig::default()).expect("open the node's WAL");
    let tail = store.read(shard, seqno, last, usize::MAX).expect("read the node's records");
    assert_eq!(tail.len() as u64, last - seqno + 1);
    let forged = Frame::encode(RecordFields {
        seqno,
        epoch: tail[0].epoch(),
        timestamp_us: tail[0].timestamp_us(),
        key: &tail[0].key(),
        payload: b"not what the leader wrote",
    });
    let frames: Vec<Frame> = std::iter::once(forged).chain(tail[1..].iter().cloned()).collect();
    store.truncate_suffix(shard, seqno - 1).unwrap();
    store.append(&[ShardAppend { shard, frames }], true).unwrap();
}

/// `walship coord --verify-every-s`: the coordinator verifies every shard
/// by itself and shows each one's last verdict; it finds a replica that
/// silently diverged without anyone asking.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduled_verify_finds_a_diverged_replica_by_itself() {
    use walship_proto::log::{AppendRecord, AppendRequest, Durability};
    let mut cluster = Cluster::launch(&common::ClusterSpec {
        nodes: 3,
        shards: 1,
        coordinators: 1,
        coord_args: vec!["--verify-every-s".into(), "1".into()],
        ..Default::default()
    });
    wait_workers(&mut cluster, 3).await;
    let (leader, _) = cluster.leader_of(1, 1).await.expect("a leader");
    let mut log = cluster.node(leader).client().await;
    let records = (0..100)
        .map(|i| AppendRecord { key: Default::default(), payload: format!("scrub-{i}").into_bytes().into() })
        .collect();
    log.append(AppendRequest { shard_id: 1, records, durability: Durability::All as i32, ..Default::default() })
        .await
        .unwrap();
    let last_verdict = async |cluster: &mut Cluster| -> Value {
        let (_, view) = cluster.coord_get(1, "/v1/cluster").await;
        assert_eq!(view["dataplane"]["verify_schedule"]["every_s"], 1, "{view}");
        view["dataplane"]["verify_schedule"]["last"][0].clone()
    };
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let last = last_verdict(&mut cluster).await;
        if last["verdict"] == "equal" && last["to"].as_u64() >= Some(100) {
            assert_eq!(last["shard"], 1, "{last}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "no equal scheduled verify: {last}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A follower silently diverges: the next scheduled round names it.
    let follower = if leader == 2 { 3 } else { 2 };
    forge_record(&mut cluster, follower, 1, 40, 100);
    cluster.restart(follower);
    wait_workers(&mut cluster, 3).await;
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let last = last_verdict(&mut cluster).await;
        if last["verdict"] == "diverged" {
            assert_eq!(last["first_divergent_seqno"], 40, "{last}");
            assert_eq!(last["differing"], json!([follower]), "{last}");
            let (code, job) = cluster.coord_get(1, &format!("/v1/jobs/{}", last["job_id"].as_str().unwrap())).await;
            assert_eq!((code, job["report"]["verdict"].as_str()), (200, Some("diverged")), "{job}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the scheduled verify never saw the divergence: {last}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `walship export` writes a range of a shard as an Arrow IPC file that
/// pyarrow reads back with every field equal to what the shard serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_round_trips_through_pyarrow() {
    use walship_proto::log::{AppendRecord, AppendRequest, Durability};
    let mut cluster = Cluster::start_with(3, 1, 1, "", None);
    wait_workers(&mut cluster, 3).await;
    let (leader, _) = cluster.leader_of(1, 1).await.expect("a leader");
    let grpc = cluster.node(leader).grpc.clone();
    let mut log = cluster.node(leader).client().await;
    for i in 0..25u32 {
        let records = (0..10u32)
            .map(|j| AppendRecord {
                // Every third record has no key (exported as null).
                key: if j % 3 == 0 { Vec::new().into() } else { format!("key-{i}-{j}").into_bytes().into() },
                payload: (0..=(i * 10 + j) as u8).collect::<Vec<u8>>().into(),
            })
            .collect();
        log.append(AppendRequest { shard_id: 1, records, durability: Durability::Quorum as i32, ..Default::default() })
            .await
            .unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("shard-1.arrow");
    let admin = format!("http://{}", cluster.coordinator(1).admin);
    let run = std::process::Command::new(common::walship_bin())
        .args(["export", "--shard", "1", "--from", "11", "--to", "240", "--out"])
        .arg(&out)
        .args(["--admin", &admin, "--token", TOKEN])
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    assert!(String::from_utf8_lossy(&run.stdout).contains("230 rows"), "{}", String::from_utf8_lossy(&run.stdout));

    let python = std::env::var_os("WALSHIP_PYTHON").map_or_else(
        || std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".walship/tools/venv/bin/python"),
        std::path::PathBuf::from,
    );
    let script = r#"
import json, sys
import pyarrow as pa
table = pa.ipc.open_file(sys.argv[1]).read_all()
rows = []
for r in table.to_pylist():
    rows.append([r["seqno"], r["epoch"], None if r["key"] is None else r["key"].hex(), r["payload"].hex()])
ts = table.column("timestamp_us").cast(pa.int64()).to_pylist()
print(json.dumps({"rows": rows, "ts": ts}))
"#;
    let read = std::process::Command::new(&python).args(["-c", script]).arg(&out).output().unwrap();
    assert!(read.status.success(), "pyarrow: {}", String::from_utf8_lossy(&read.stderr));
    let got: Value = serde_json::from_slice(&read.stdout).unwrap();
    let records = common::read_all(&grpc, 1, 250).await;
    let want: Vec<Value> = records[10..240]
        .iter()
        .map(|r| {
            let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
            json!([r.seqno, r.epoch, if r.key.is_empty() { Value::Null } else { hex(&r.key).into() }, hex(&r.payload)])
        })
        .collect();
    assert_eq!(got["rows"].as_array().unwrap().len(), 230);
    assert_eq!(got["rows"], Value::Array(want), "every field as the shard serves it");
    let ts: Vec<u64> = records[10..240].iter().map(|r| r.timestamp_us).collect();
    assert_eq!(got["ts"], json!(ts));

    // A replica that is not one of the shard's, or an unknown shard: refused.
    for (body, code) in
        [(json!({"kind": "export", "shard": 1, "node": "node-7"}), 404), (json!({"kind": "export", "shard": 8}), 404)]
    {
        let (got, answer) = cluster.coord_post(1, "/v1/tasks", &body.to_string(), Some(TOKEN)).await;
        assert_eq!(got, code, "{body}: {answer}");
    }
    let (code, _) = cluster.coord_get(1, "/v1/jobs/x-nothing/export").await;
    assert_eq!(code, 404);
}

/// An export asked past the commit point stops at it: records a leader has
/// made durable alone may still be truncated by a failover, and must not
/// end up in a file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_export_stops_at_the_commit_point() {
    use walship_proto::log::{AppendRecord, AppendRequest, Durability};
    let mut cluster = Cluster::start_with(3, 1, 1, "", None);
    wait_workers(&mut cluster, 3).await;
    let (leader, _) = cluster.leader_of(1, 1).await.expect("a leader");
    let mut log = cluster.node(leader).client().await;
    let append = |durability: Durability| AppendRequest {
        shard_id: 1,
        records: vec![AppendRecord { key: Default::default(), payload: b"x".to_vec().into() }; 5],
        durability: durability as i32,
        ..Default::default()
    };
    log.append(append(Durability::Quorum)).await.unwrap();
    let followers: Vec<u32> = (1..=3).filter(|&n| n != leader).collect();
    for &f in &followers {
        cluster.signal(f, libc::SIGSTOP);
    }
    // Durable on the leader alone: seqnos 6..=10, not committed.
    let local = log.append(append(Durability::Local)).await.unwrap().into_inner();
    assert_eq!(local.last_seqno, 10);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("shard-1.arrow");
    let admin = format!("http://{}", cluster.coordinator(1).admin);
    let node = format!("node-{leader}");
    let run = std::process::Command::new(common::walship_bin())
        .args(["export", "--shard", "1", "--from", "1", "--to", "10", "--node", &node, "--out"])
        .arg(&out)
        .args(["--admin", &admin, "--token", TOKEN])
        .output()
        .unwrap();
    for &f in &followers {
        cluster.signal(f, libc::SIGCONT);
    }
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{stdout}{}", String::from_utf8_lossy(&run.stderr));
    assert!(stdout.contains(" 5 rows"), "only the committed records 1..=5: {stdout}");
}

/// A coordinator that refuses other builds (`--build-policy refuse`), and a
/// worker that sends a result larger than the stream's limit: the stream
/// ends with a clear status and the coordinator carries on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_builds_and_oversized_results_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (grpc, admin, node) = (common::free_port(), common::free_port(), common::free_port());
    let config = dir.path().join("cluster.toml");
    std::fs::write(
        &config,
        format!(
            "secret = \"{}\"\n[[coordinators]]\nid = \"c1\"\ngrpc_addr = \"127.0.0.1:{grpc}\"\nadmin_addr = \"127.0.0.1:{admin}\"\n\
             [[nodes]]\nid = 1\ngrpc_addr = \"127.0.0.1:{node}\"\nadmin_addr = \"127.0.0.1:{}\"\n\
             [[shards]]\nid = 1\nreplicas = [1]\nleader = 1\n",
            common::SECRET,
            common::free_port()
        ),
    )
    .unwrap();
    let (mut coordinator, _) = common::spawn_listening(
        std::process::Command::new(common::walship_bin())
            .args(["coord", "--id", "c1", "--admin-token", TOKEN, "--cluster"])
            .arg(&config)
            .arg("--data-dir")
            .arg(dir.path().join("coord"))
            .env("WALSHIP_BUILD_POLICY", "refuse"),
        "coordinator",
    );
    let addr = format!("127.0.0.1:{grpc}");
    // Active once it holds the lease: then it takes workers.
    let mut welcome = None;
    for _ in 0..100 {
        let (tx, rx) = tokio::sync::mpsc::channel(8);
        tx.send(hello("same-build")).await.unwrap();
        match member(&addr).await.connect(tokio_stream::wrappers::ReceiverStream::new(rx)).await {
            Ok(stream) => {
                welcome = Some((tx, stream.into_inner()));
                break;
            }
            Err(status) if status.message().contains("standby") => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(status) => panic!("a worker of the same build was refused: {status:?}"),
        }
    }
    let (tx, mut inbound) = welcome.expect("the coordinator became active");
    assert!(inbound.next().await.unwrap().is_ok(), "Welcome");
    let other = WorkerEnvelope {
        msg: Some(Up::Hello(Hello {
            worker_id: "other-build".into(),
            build_sha: "0.0.0-elsewhere".into(),
            num_cpus: 1,
            gomemlimit: 0,
        })),
    };
    let status = member(&addr).await.connect(tokio_stream::iter(vec![other])).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(status.message().contains("build") && status.message().contains("0.0.0-elsewhere"), "{status:?}");

    // Over the 16 MiB message limit: the stream ends, naming the limit.
    let huge = ResultBatch {
        query_id: "q-huge".into(),
        worker_id: "same-build".into(),
        terminal: true,
        payload: vec![7u8; 17 << 20].into(),
        ..Default::default()
    };
    tx.send(WorkerEnvelope { msg: Some(Up::ResultBatch(huge)) }).await.unwrap();
    let ended = tokio::time::timeout(WAIT, inbound.next()).await.expect("the stream ends");
    let Some(Err(status)) = ended else { panic!("the stream ended without saying why: {ended:?}") };
    assert!(status.message().contains("too large") || status.message().contains("length"), "{status:?}");
    // The coordinator still takes a worker afterwards.
    let (tx2, rx2) = tokio::sync::mpsc::channel(8);
    tx2.send(hello("after-huge")).await.unwrap();
    let mut again =
        member(&addr).await.connect(tokio_stream::wrappers::ReceiverStream::new(rx2)).await.unwrap().into_inner();
    assert!(again.next().await.unwrap().is_ok());
    let _ = coordinator.kill();
    let _ = coordinator.wait();
}

/// The active coordinator dies: the standby takes the lease and every node
/// follows it, connecting to its DataPlane by itself, and tasks run there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_follow_a_coordinator_failover() {
    let mut cluster = Cluster::start_with(3, 1, 2, "", None);
    wait_workers(&mut cluster, 3).await;
    cluster.coordinator(1).kill9();
    wait_until("the standby's DataPlane to have every node", WAIT, || {
        let (_, view) = futures::executor::block_on(cluster.coord_get(2, "/v1/cluster"));
        let ok = view["coordinator"]["active"] == true && view["workers"].as_array().is_some_and(|w| w.len() == 3);
        async move { ok }
    })
    .await;
    let (code, started) =
        cluster.coord_post(2, "/v1/tasks", &json!({"kind": "noop", "count": 6}).to_string(), Some(TOKEN)).await;
    assert_eq!(code, 202, "{started}");
    for id in started["task_ids"].as_array().unwrap() {
        let id = id.as_str().unwrap();
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            let (_, t) = cluster.coord_get(2, &format!("/v1/tasks/{id}")).await;
            if t["state"] == "succeeded" {
                break;
            }
            assert!(std::time::Instant::now() < deadline && t["state"] != "failed", "{t}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
