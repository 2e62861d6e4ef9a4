//! Changing a shard's replica set under load (`walship replica
//! add|remove|replace`, `POST /v1/shards/{id}/replicas`) against real node
//! and coordinator processes: placement by region, a learner seeding from
//! peers and the object store, the leader replaced, a replica removed, the
//! refusals, and every acknowledged record on every final replica.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use common::history::{FAST, load};
use common::{Acked, Cluster, ClusterSpec, TOKEN, read_all, wait_until};
use walship_proto::log::AssignRequest;
use walship_proto::log::control_client::ControlClient;

const ARCHIVE: &str = "[archive]\nstore = \"dir\"\ndir = \"archive\"\nsegment_bytes = 65536\nsegment_age_ms = 100\n";

/// Five nodes: shard 1 on 1, 2, 3 (led by 1); shard 2 on 3, 4, 5, so that
/// every node reports to the coordinator. Node 4 shares node 1's region.
fn five_nodes() -> ClusterSpec<'static> {
    ClusterSpec {
        nodes: 5,
        shards: 2,
        coordinators: 1,
        replication: FAST,
        cluster_toml: ARCHIVE.into(),
        shard_replicas: vec![(1, vec![1, 2, 3]), (2, vec![3, 4, 5])],
        regions: vec![(4, 1)],
        ..ClusterSpec::default()
    }
}

/// `walship replica <args> --json`: (exit ok, stdout, stderr).
async fn cli(cluster: &mut Cluster, args: &[&str]) -> (bool, String, String) {
    let admin = format!("http://{}", cluster.coordinator(1).admin);
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(common::walship_bin())
            .arg("replica")
            .args(&args)
            .args(["--json", "--admin", &admin, "--token", TOKEN])
            .output()
            .expect("run walship replica")
    })
    .await
    .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (output.status.success(), text(&output.stdout), text(&output.stderr))
}

/// The shard's members as the coordinator shows them: (node, membership).
async fn members(cluster: &mut Cluster, shard: u32) -> Vec<(u64, String)> {
    let (_, view) = cluster.coord_get(1, &format!("/v1/shards/{shard}")).await;
    view["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["node_id"].as_u64().unwrap(), r["membership"].as_str().unwrap().to_string()))
        .collect()
}

fn voters(nodes: &[u64]) -> Vec<(u64, String)> {
    nodes.iter().map(|&n| (n, "voter".to_string())).collect()
}

/// Runs one change through the CLI; its report.
async fn change(cluster: &mut Cluster, args: &[&str]) -> serde_json::Value {
    let (ok, stdout, stderr) = cli(cluster, args).await;
    assert!(ok, "walship replica {args:?}: {stdout}\n{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["state"], "done", "{report}");
    eprintln!("replica {args:?}: {report}");
    report
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_are_added_replaced_and_removed_under_load_with_nothing_lost() {
    let mut cluster = Cluster::launch(&five_nodes());
    cluster.wait_leader(1, None, Duration::from_secs(60)).await;
    cluster.wait_leader(2, None, Duration::from_secs(60)).await;
    let grpc: Vec<String> = cluster.nodes.iter().map(|n| n.grpc.clone()).collect();
    let admin = cluster.coordinator(1).admin.clone();
    let acked: Acked = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let load = load(grpc.clone(), admin, 1, acked.clone(), stop.clone(), count.clone());
    wait_until("records acknowledged before the first change", Duration::from_secs(30), || {
        let n = count.load(Ordering::Relaxed);
        async move { n >= 300 }
    })
    .await;

    // A named node in a region the set covers, while another region is
    // free, is refused and changes nothing.
    let (code, refused) =
        cluster.coord_post(1, "/v1/shards/1/replicas", r#"{"action": "add", "node": 4}"#, Some(TOKEN)).await;
    assert_eq!((code, refused["error"]["code"].as_str()), (409, Some("same_region")), "{refused}");
    assert_eq!(members(&mut cluster, 1).await, voters(&[1, 2, 3]));

    // 1. Add, placed by the coordinator: node 5 (region 5 is uncovered;
    //    node 4's region 1 is node 1's).
    let before = count.load(Ordering::Relaxed);
    let report = change(&mut cluster, &["add", "--shard", "1"]).await;
    assert_eq!(report["adding"], 5, "{report}");
    assert_eq!(report["to_replicas"], serde_json::json!([1, 2, 3, 5]));
    let applied: u64 =
        ["bytes_peer", "bytes_archive", "bytes_stream", "bytes_push"].iter().map(|k| report[k].as_u64().unwrap()).sum();
    assert!(applied > 0, "the new replica applied its copy: {report}");
    assert_eq!(members(&mut cluster, 1).await, voters(&[1, 2, 3, 5]));
    assert!(count.load(Ordering::Relaxed) > before, "appends went on during the change");
    // The change is a row of the task table, finished.
    let id = report["id"].as_str().unwrap().to_string();
    let (code, task) = cluster.coord_get(1, &format!("/v1/tasks/{id}")).await;
    assert_eq!(code, 200, "{task}");
    assert_eq!(task["kind"], "replica-add", "{task}");
    wait_until("the task row to finish", Duration::from_secs(10), || {
        let (_, task) = futures::executor::block_on(cluster.coord_get(1, &format!("/v1/tasks/{id}")));
        async move { task["state"] == "succeeded" }
    })
    .await;

    // 2. Replace the leader (node 1) by node 4: leadership moves first.
    let before = count.load(Ordering::Relaxed);
    let report = change(&mut cluster, &["replace", "--shard", "1", "--node", "1", "--with", "4"]).await;
    assert_eq!((report["adding"].as_u64(), report["removing"].as_u64()), (Some(4), Some(1)), "{report}");
    assert!(report["leadership_moved_to"].is_u64(), "{report}");
    assert_eq!(members(&mut cluster, 1).await, voters(&[2, 3, 4, 5]));
    let leader = cluster.leader_of(1, 1).await.unwrap().0;
    assert!([2, 3, 4, 5].contains(&leader), "leader {leader}");
    assert!(count.load(Ordering::Relaxed) > before, "appends went on during the change");

    // 3. Remove node 5, then a removal below min_replicas is refused.
    let report = change(&mut cluster, &["remove", "--shard", "1", "--node", "5"]).await;
    assert_eq!(report["to_replicas"], serde_json::json!([2, 3, 4]));
    assert_eq!(members(&mut cluster, 1).await, voters(&[2, 3, 4]));
    let (ok, stdout, stderr) = cli(&mut cluster, &["remove", "--shard", "1", "--node", "2"]).await;
    assert!(!ok && stderr.contains("below_min_replicas"), "{stdout}\n{stderr}");
    assert_eq!(members(&mut cluster, 1).await, voters(&[2, 3, 4]));

    // Some more load on the final set, then stop and check the history:
    // every acknowledged record on every final replica, byte-identical.
    let before = count.load(Ordering::Relaxed);
    wait_until("appends on the final replica set", Duration::from_secs(30), || {
        let n = count.load(Ordering::Relaxed);
        async move { n >= before + 100 }
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();
    let checked = check_acked_on(&mut cluster, &[2, 3, 4], &acked).await;
    eprintln!("{checked} acknowledged records checked on nodes 2, 3, 4");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_replica_changes_are_refused_and_change_nothing() {
    let mut cluster = Cluster::launch(&five_nodes());
    cluster.wait_leader(1, None, Duration::from_secs(60)).await;
    let cases: &[(&str, u16, &str)] = &[
        (r#"{"action": "remove", "node": 4}"#, 409, "not_a_replica"),
        (r#"{"action": "add", "node": 2}"#, 409, "already_a_replica"),
        (r#"{"action": "add", "node": 9}"#, 409, "unknown_node"),
        (r#"{"action": "replace", "node": 1, "with": 3}"#, 409, "already_a_replica"),
        (r#"{"action": "remove", "node": 3}"#, 409, "below_min_replicas"),
        (r#"{"action": "remove"}"#, 400, "bad_request"),
        (r#"{"action": "add", "with": 4}"#, 400, "bad_request"),
        (r#"{"action": "add", "catch_up_timeout_s": 0}"#, 400, "bad_request"),
        (r#"{"action": "grow"}"#, 400, ""),
        (r#"{"action": "add", "nodes": 4}"#, 400, ""),
        (r#"[1, 2]"#, 400, ""),
    ];
    for &(body, status, code) in cases {
        let (got, refused) = cluster.coord_post(1, "/v1/shards/1/replicas", body, Some(TOKEN)).await;
        assert_eq!(got, status, "{body}: {refused}");
        if !code.is_empty() {
            assert_eq!(refused["error"]["code"], code, "{body}: {refused}");
        }
    }
    let (code, _) = cluster.coord_post(1, "/v1/shards/9/replicas", r#"{"action": "add"}"#, Some(TOKEN)).await;
    assert_eq!(code, 404);
    let (code, _) = cluster.coord_post(1, "/v1/shards/x/replicas", r#"{"action": "add"}"#, Some(TOKEN)).await;
    assert_eq!(code, 400);
    let (code, _) = cluster.coord_post(1, "/v1/shards/1/replicas", r#"{"action": "add"}"#, None).await;
    assert_eq!(code, 401);
    let (code, _) = cluster.coord_post(1, "/v1/shards/1/replicas", r#"{"action": "add"}"#, Some("wrong-token")).await;
    assert_eq!(code, 403);
    let (_, changes) = cluster.coord_get(1, "/v1/replica-changes").await;
    assert_eq!(changes, serde_json::json!([]), "a refused change started nothing");
    let (code, _) = cluster.coord_get(1, "/v1/replica-changes/replica-add-1").await;
    assert_eq!(code, 404);
    assert_eq!(members(&mut cluster, 1).await, voters(&[1, 2, 3]));

    // A node refuses an assignment whose replica set is malformed, and
    // changes nothing (it neither creates the shard nor changes its set).
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{}", cluster.node(4).grpc)).unwrap();
    let mut control = ControlClient::new(common::as_member(endpoint.connect().await.unwrap()));
    let (_, view) = cluster.coord_get(1, "/v1/shards/1").await;
    let epoch = view["epoch"].as_u64().unwrap();
    let assign = |replicas: Vec<u32>, learners: Vec<u32>, joint: Vec<u32>, leader: u32| AssignRequest {
        shard_id: 1,
        epoch,
        leader,
        replicas,
        learners,
        joint_replicas: joint,
        ..Default::default()
    };
    let bad = [
        (assign(vec![1, 2, 3], vec![4, 4], vec![], 1), "twice"),
        (assign(vec![1, 2, 3], vec![9], vec![], 1), "not in the cluster config"),
        (assign(vec![1, 2, 3], vec![3], vec![], 1), "also a voter"),
        (assign(vec![2, 3, 4], vec![], vec![], 1), "not a voter"),
        (assign(vec![1, 2, 4], vec![], vec![2, 3, 4], 1), "not a voter"),
        (assign(vec![], vec![4], vec![], 1), "without replicas"),
        (AssignRequest { fetch_token: "x".repeat(2000), ..assign(vec![1, 2, 3], vec![4], vec![], 1) }, "fetch_token"),
    ];
    for (request, says) in bad {
        let refused = control.assign(request.clone()).await.expect_err("refused");
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{request:?}: {refused}");
        assert!(refused.message().contains(says), "{request:?}: {refused}");
    }
    let status = cluster.status(4).await.unwrap();
    let hosted: Vec<u64> =
        status["shards"].as_array().unwrap().iter().map(|s| s["shard_id"].as_u64().unwrap()).collect();
    assert_eq!(hosted, vec![2], "node 4 hosts no shard 1 after refused assignments");
}

/// Every acknowledged record of shard 1 is on each of `nodes`, and they
/// hold byte-identical logs through the last acknowledged seqno.
async fn check_acked_on(cluster: &mut Cluster, nodes: &[u32], acked: &Acked) -> usize {
    let acked = acked.lock().await.get(&1).cloned().unwrap_or_default();
    let last = *acked.keys().last().unwrap();
    let mut reference = None;
    for &node in nodes {
        wait_until(&format!("node {node} to know {last} committed"), Duration::from_secs(30), || {
            let status = futures::executor::block_on(cluster.status(node)).unwrap_or_default();
            let commit = common::history::entry(&status, 1)["commit_seqno"].as_u64().unwrap_or(0);
            async move { commit >= last }
        })
        .await;
        let records = read_all(&cluster.node(node).grpc.clone(), 1, last).await;
        assert_eq!(records.len() as u64, last, "node {node}");
        for (seqno, payload) in &acked {
            assert_eq!(&records[*seqno as usize - 1].payload, payload, "node {node}: acknowledged {seqno} LOST");
        }
        match &reference {
            None => reference = Some(records),
            Some(r) => assert!(r == &records, "node {node} diverges"),
        }
    }
    acked.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failover_in_the_joint_step_goes_back_to_the_old_set_and_a_dead_node_is_replaced() {
    // The coordinator holds every joint step open for 3 s (failpoint).
    // SAFETY: set before any thread of this test process reads the environment.
    unsafe { std::env::set_var("FAILPOINTS", "replica_change::joint=return(3000)") };
    let mut cluster = Cluster::launch(&five_nodes());
    cluster.wait_leader(1, None, Duration::from_secs(60)).await;
    cluster.wait_leader(2, None, Duration::from_secs(60)).await;
    let grpc: Vec<String> = cluster.nodes.iter().map(|n| n.grpc.clone()).collect();
    let acked: Acked = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let load = load(grpc, cluster.coordinator(1).admin.clone(), 1, acked.clone(), stop.clone(), count.clone());
    wait_until("records acknowledged", Duration::from_secs(30), || {
        let n = count.load(Ordering::Relaxed);
        async move { n >= 200 }
    })
    .await;

    // Add node 4; once the record is joint ({1,2,3,4} with {1,2,3}), kill
    // the leader. The failover needs a majority of both sets and goes back
    // to the old one; the change reports the failure.
    let body = r#"{"action": "add", "node": 4, "allow_same_region": true}"#;
    let (code, started) = cluster.coord_post(1, "/v1/shards/1/replicas", body, Some(TOKEN)).await;
    assert_eq!(code, 202, "{started}");
    let id = started["id"].as_str().unwrap().to_string();
    wait_until("the change's joint step", Duration::from_secs(60), || {
        let (_, view) = futures::executor::block_on(cluster.coord_get(1, "/v1/shards/1"));
        async move { view["joint_replicas"] == serde_json::json!([1, 2, 3]) }
    })
    .await;
    assert!(members(&mut cluster, 1).await.contains(&(4, "joining".to_string())));
    let leader = cluster.leader_of(1, 1).await.unwrap().0;
    cluster.node(leader).kill9();
    let path = format!("/v1/replica-changes/{id}");
    wait_until("the change to end", Duration::from_secs(90), || {
        let (_, report) = futures::executor::block_on(cluster.coord_get(1, &path));
        async move { report["state"] != "running" }
    })
    .await;
    let (_, report) = cluster.coord_get(1, &path).await;
    assert_eq!(report["state"], "failed", "{report}");
    assert!(report["error"].as_str().unwrap().contains("failed over"), "{report}");
    let new_leader = cluster.wait_leader(1, Some(leader), Duration::from_secs(30)).await;
    assert!([1, 2, 3].contains(&new_leader) && new_leader != leader, "{new_leader}");
    let (_, view) = cluster.coord_get(1, "/v1/shards/1").await;
    assert_eq!(view["joint_replicas"], serde_json::json!([]), "{view}");
    assert_eq!(view["learners"], serde_json::json!([]), "{view}");
    let set: Vec<u64> = view["replicas"].as_array().unwrap().iter().map(|r| r["node_id"].as_u64().unwrap()).collect();
    assert_eq!(set, vec![1, 2, 3], "back to the set before the change: {view}");

    // The dead leader is replaced in one command; placement picks node 5
    // (node 4 still holds its copy from the failed change: more shards).
    let before = count.load(Ordering::Relaxed);
    // As the runbook runs it: no --shard, every shard the node held.
    let dead = leader.to_string();
    let (ok, stdout, stderr) = cli(&mut cluster, &["replace", "--node", &dead]).await;
    assert!(ok, "{stdout}\n{stderr}");
    let reports: Vec<serde_json::Value> =
        serde_json::Deserializer::from_str(&stdout).into_iter().collect::<Result<_, _>>().unwrap();
    assert!(reports.iter().all(|r| r["state"] == "done"), "{stdout}");
    let report = reports.iter().find(|r| r["shard"] == 1).expect("shard 1 replaced");
    assert_eq!(report["adding"], 5, "{report}");
    assert!(count.load(Ordering::Relaxed) > before, "appends went on during the change");
    let mut kept: Vec<u32> = [1u32, 2, 3].into_iter().filter(|&n| n != leader).collect();
    kept.push(5);
    let expect: Vec<u64> = kept.iter().map(|&n| n as u64).collect();
    assert_eq!(members(&mut cluster, 1).await, voters(&expect));
    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();
    let checked = check_acked_on(&mut cluster, &kept, &acked).await;
    eprintln!("{checked} acknowledged records checked on nodes {kept:?}");
}

/// The lines of the replica block in ops/README.md ("Changing a shard's
/// replicas"), comments dropped.
fn readme_replica_commands() -> Vec<Vec<String>> {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/ops/README.md")).unwrap();
    let section = &readme[readme.find("### Changing a shard's replicas").expect("the section")..];
    let block = &section[section.find("```sh\n").unwrap() + 6..];
    let block = &block[..block.find("```").unwrap()];
    block
        .lines()
        .map(|l| l.split('#').next().unwrap().split_whitespace().map(str::to_string).collect::<Vec<_>>())
        .filter(|words| !words.is_empty())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replica_commands_in_the_ops_readme_run_as_printed() {
    let commands = readme_replica_commands();
    assert_eq!(commands.len(), 5, "{commands:?}");
    let mut cluster = Cluster::launch(&five_nodes());
    cluster.wait_leader(1, None, Duration::from_secs(60)).await;
    cluster.wait_leader(2, None, Duration::from_secs(60)).await;
    let admin = format!("http://{}", cluster.coordinator(1).admin);
    for words in commands {
        assert_eq!(words[0], "walship", "{words:?}");
        let admin = admin.clone();
        let args = words[1..].to_vec();
        let output = tokio::task::spawn_blocking(move || {
            std::process::Command::new(common::walship_bin())
                .args(&args)
                .env("WALSHIP_ADMIN", admin)
                .env("WALSHIP_TOKEN", TOKEN)
                .output()
                .unwrap()
        })
        .await
        .unwrap();
        let (out, err) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
        assert!(output.status.success(), "{words:?}:\n{out}\n{err}");
        assert!(out.contains(" done in "), "{words:?}:\n{out}");
        eprintln!("{}\n{out}", words.join(" "));
    }
    // add 5, remove 2, add 2, 3 -> 4, then 1 -> 3 (placement: region 3 is free).
    assert_eq!(members(&mut cluster, 1).await, voters(&[2, 3, 4, 5]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_left_unfinished_by_a_dead_coordinator_is_undone_by_the_next() {
    // SAFETY: set before any thread of this test process reads the environment.
    unsafe { std::env::set_var("FAILPOINTS", "replica_change::joint=return(5000)") };
    let mut cluster = Cluster::launch(&five_nodes());
    cluster.wait_leader(1, None, Duration::from_secs(60)).await;
    let body = r#"{"action": "add", "node": 5}"#;
    let (code, started) = cluster.coord_post(1, "/v1/shards/1/replicas", body, Some(TOKEN)).await;
    assert_eq!(code, 202, "{started}");
    wait_until("the change's joint step", Duration::from_secs(60), || {
        let (_, view) = futures::executor::block_on(cluster.coord_get(1, "/v1/shards/1"));
        async move { view["joint_replicas"] == serde_json::json!([1, 2, 3]) }
    })
    .await;
    // The coordinator dies inside the joint step; the next one finds the
    // record mid-change with no change running and undoes it.
    cluster.restart_coordinator(1);
    wait_until("the record back to the set before the change", Duration::from_secs(30), || {
        let (_, view) = futures::executor::block_on(cluster.coord_get(1, "/v1/shards/1"));
        async move { view["joint_replicas"] == serde_json::json!([]) && view["learners"] == serde_json::json!([]) }
    })
    .await;
    assert_eq!(members(&mut cluster, 1).await, voters(&[1, 2, 3]));
    // And a new change can run once the undo has told the replicas (its
    // assignments go out after the record is back): the shard is no longer
    // changing, so the request reaches its own checks.
    wait_until("a new change to be taken", Duration::from_secs(30), || {
        let body = r#"{"action": "remove", "node": 9}"#;
        let (code, refused) =
            futures::executor::block_on(cluster.coord_post(1, "/v1/shards/1/replicas", body, Some(TOKEN)));
        async move { (code, refused["error"]["code"].as_str()) == (409, Some("unknown_node")) }
    })
    .await;
}
