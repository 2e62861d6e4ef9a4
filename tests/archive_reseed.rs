//! The re-seed drill (real node and coordinator processes, the directory
//! object store): a follower's copy of an archiving shard is wiped under
//! QUORUM load and rebuilds from the object store, then the leader; the
//! report counts bytes by source and finds every replica byte-identical
//! with nothing acknowledged lost. Its endpoint and its node-side hook
//! (`Control.Wipe`) refuse bad input, changing nothing.

mod common;

use std::time::Duration;

use common::{Cluster, ClusterSpec, TOKEN, wait_until};
use walship_proto::log::WipeRequest;
use walship_proto::log::control_client::ControlClient;

const FAST: &str = "heartbeat_ms = 50\nleader_timeout_ms = 1000\nkeepalive_ms = 100\nship_timeout_ms = 1000";

/// Segments of 256 KiB sealed within 100 ms: a 4 MiB volume makes a dozen.
const ARCHIVE: &str = "[archive]\nstore = \"dir\"\ndir = \"archive\"\nsegment_bytes = 262144\nsegment_age_ms = 100\n";

async fn control(grpc: &str) -> ControlClient<common::Member> {
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{grpc}")).unwrap();
    ControlClient::new(common::as_member(endpoint.connect().await.unwrap()))
}

/// Whether the node serves records 1..=10 of shard 1, all of them.
async fn serves_ten(grpc: &str) -> bool {
    let Some(mut log) = common::history::client(grpc).await else { return false };
    let request = walship_proto::log::ReadRequest { shard_id: 1, from_seqno: 1, to_seqno: 10, ..Default::default() };
    log.read(request).await.is_ok_and(|r| r.into_inner().records.len() == 10)
}

/// `walship drill reseed ... --json` against the coordinator.
async fn cli_reseed(cluster: &mut Cluster, args: &[&str]) -> (bool, String, String) {
    let admin = format!("http://{}", cluster.coordinator(1).admin);
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(common::walship_bin())
            .args(["drill", "reseed", "--json", "--admin", &admin, "--token", TOKEN])
            .args(&args)
            .output()
            .expect("run walship drill reseed")
    })
    .await
    .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (output.status.success(), text(&output.stdout), text(&output.stderr))
}

/// The counter `walship_catchup_bytes_total{source}` of a node.
async fn applied_bytes(cluster: &Cluster, node: u32, source: &str) -> u64 {
    let text = common::http_get(&format!("{}/metrics", cluster.nodes[node as usize - 1].admin)).await.1;
    let line = format!("walship_catchup_bytes_total{{source=\"{source}\"}} ");
    text.lines().find_map(|l| l.strip_prefix(&line)).map_or(0, |v| v.trim().parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wiped_follower_rebuilds_from_peers_and_the_archive_under_load_with_nothing_lost() {
    let mut cluster = Cluster::launch(&ClusterSpec {
        nodes: 3,
        shards: 1,
        coordinators: 1,
        replication: FAST,
        cluster_toml: ARCHIVE.into(),
        ..ClusterSpec::default()
    });
    let leader = cluster.wait_leader(1, None, Duration::from_secs(60)).await;
    wait_until("the leader to report that it archives", Duration::from_secs(30), || {
        let (_, shard) = futures::executor::block_on(cluster.coord_get(1, "/v1/shards/1"));
        async move { shard["archived_seqno"].is_u64() }
    })
    .await;

    // Refusals change nothing: the leader as the one to wipe, a node that
    // holds no replica, an empty volume, no token.
    let body = format!(r#"{{"shard": 1, "follower": {leader}}}"#);
    let (code, refused) = cluster.coord_post(1, "/v1/drills/reseed", &body, Some(TOKEN)).await;
    assert_eq!((code, refused["error"]["code"].as_str()), (409, Some("is_leader")), "{refused}");
    assert!(refused["error"]["message"].as_str().unwrap().contains("wipes a follower"), "{refused}");
    let (code, refused) =
        cluster.coord_post(1, "/v1/drills/reseed", r#"{"shard": 1, "follower": 9}"#, Some(TOKEN)).await;
    assert!(code == 400 || code == 404, "{code} {refused}");
    let (code, refused) =
        cluster.coord_post(1, "/v1/drills/reseed", r#"{"shard": 1, "volume_bytes": 0}"#, Some(TOKEN)).await;
    assert_eq!(code, 400, "{refused}");
    let (code, _) = cluster.coord_post(1, "/v1/drills/reseed", r#"{"shard": 1}"#, None).await;
    assert_eq!(code, 401);
    let (_, drills) = cluster.coord_get(1, "/v1/drills").await;
    assert_eq!(drills.as_array().map(Vec::len), Some(0), "a refused drill started nothing: {drills}");

    let (ok, stdout, stderr) =
        cli_reseed(&mut cluster, &["--shard", "1", "--volume-mib", "4", "--record-bytes", "4096", "--clients", "4"])
            .await;
    assert!(ok, "{stdout}\n{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["state"], "done", "{report}");
    let r = &report["reseed"];
    eprintln!("re-seed: {r}");
    let follower = r["follower"].as_u64().unwrap() as u32;
    assert_ne!(follower, leader);
    assert_eq!(r["leader"], leader);
    assert!(r["records_wiped"].as_u64().unwrap() >= 1024, "it held the volume before the wipe: {r}");
    assert!(r["records"].as_u64().unwrap() >= 1024, "{r}");
    // The archive held the volume at the wipe, so most bytes were sealed
    // segments: fetched from the other follower (PeerExchange), which holds
    // them all, before the object store.
    let (archive, peer, stream, push) = (
        r["bytes_archive"].as_u64().unwrap(),
        r["bytes_peer"].as_u64().unwrap(),
        r["bytes_stream"].as_u64().unwrap(),
        r["bytes_push"].as_u64().unwrap(),
    );
    assert!(archive + peer >= 4 << 20, "at least the volume as sealed segments: {r}");
    assert!(peer > 0, "the peer tier served nothing: {r}");
    assert!(archive + peer > stream + push, "{r}");
    assert!(r["archive_mib_per_s"].as_f64().unwrap() > 0.0 && r["total_mib_per_s"].as_f64().unwrap() > 0.0, "{r}");
    assert!(r["append_rate_before"].as_f64().unwrap() > 0.0, "{r}");
    assert!(r["append_rate_during"].as_f64().is_some(), "{r}");
    assert!(r["acked"].as_u64().unwrap() >= 1024, "{r}");
    assert_eq!((r["lost"].as_u64(), r["divergent_replicas"].as_u64()), (Some(0), Some(0)), "{r}");
    assert!(applied_bytes(&cluster, follower, "archive").await >= archive, "the metric counts the archive's bytes");
    assert!(applied_bytes(&cluster, follower, "peer").await >= peer, "the metric counts the peers' bytes");

    // Byte-identical: the follower serves what the leader serves.
    let last = cluster.status(leader).await.unwrap()["shards"][0]["commit_seqno"].as_u64().unwrap();
    wait_until("the follower to hold the leader's commit", Duration::from_secs(30), || async {
        cluster.status(follower).await.is_some_and(|s| s["shards"][0]["durable_seqno"].as_u64() >= Some(last))
    })
    .await;
    let theirs = common::read_all(&cluster.nodes[leader as usize - 1].grpc, 1, last).await;
    let ours = common::read_all(&cluster.nodes[follower as usize - 1].grpc, 1, last).await;
    assert_eq!(theirs.len() as u64, last);
    assert!(theirs == ours, "the rebuilt follower's records differ from the leader's");

    // One tier at a time: the object store only, then the leader only.
    let (code, refused) =
        cluster.coord_post(1, "/v1/drills/reseed", r#"{"shard": 1, "source": "tape"}"#, Some(TOKEN)).await;
    assert_eq!(code, 400, "{refused}");
    for (source, sealed) in [("archive", true), ("stream", false)] {
        let (ok, stdout, stderr) =
            cli_reseed(&mut cluster, &["--shard", "1", "--volume-mib", "2", "--source", source]).await;
        assert!(ok, "{stdout}\n{stderr}");
        let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        let r = &report["reseed"];
        eprintln!("re-seed from {source}: {r}");
        assert_eq!(r["source"], source, "{r}");
        assert_eq!(r["bytes_peer"], 0, "{source}: no peer was asked: {r}");
        match sealed {
            true => assert!(r["bytes_archive"].as_u64().unwrap() >= 2 << 20, "{r}"),
            false => {
                assert_eq!(r["bytes_archive"], 0, "{r}");
                assert!(r["bytes_stream"].as_u64().unwrap() + r["bytes_push"].as_u64().unwrap() >= 2 << 20, "{r}");
            }
        }
        assert_eq!((r["lost"].as_u64(), r["divergent_replicas"].as_u64()), (Some(0), Some(0)), "{r}");
    }
}

/// `Control.Wipe` refuses, changing nothing: on a node without
/// `--allow-crash-drills` (PERMISSION_DENIED), on the shard's leader
/// (FAILED_PRECONDITION), for a shard not hosted (NOT_FOUND); and the drill
/// is refused on a shard whose leader does not archive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wipe_refuses_bad_input_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let node = common::NodeProcess::start(1, dir.path(), "1", &[]);
    let mut log = node.client().await;
    for i in 0..10 {
        let record = walship_proto::log::AppendRecord {
            key: bytes::Bytes::new(),
            payload: bytes::Bytes::from(format!("wipe-{i}")),
        };
        let request = walship_proto::log::AppendRequest {
            shard_id: 1,
            records: vec![record],
            durability: walship_proto::log::Durability::Local as i32,
            ..Default::default()
        };
        log.append(request).await.unwrap();
    }
    let refused = control(&node.grpc).await.wipe(WipeRequest { shard_id: 1, ..Default::default() }).await;
    common::assert_refused(
        "wipe without crash drills",
        refused,
        tonic::Code::PermissionDenied,
        &["allow-crash-drills"],
        &[],
    );
    assert!(serves_ten(&node.grpc).await, "a refused wipe dropped records");
    drop(node);

    let mut cluster = Cluster::start_with(3, 1, 1, FAST, None);
    cluster.wait_node_leads(1, 1, Duration::from_secs(30)).await;
    let mut log = cluster.nodes[0].client().await;
    for i in 0..10 {
        let record = walship_proto::log::AppendRecord {
            key: bytes::Bytes::new(),
            payload: bytes::Bytes::from(format!("wipe-{i}")),
        };
        let request = walship_proto::log::AppendRequest {
            shard_id: 1,
            records: vec![record],
            durability: walship_proto::log::Durability::All as i32,
            ..Default::default()
        };
        log.append(request).await.unwrap();
    }
    let refused = control(&cluster.nodes[0].grpc).await.wipe(WipeRequest { shard_id: 1, ..Default::default() }).await;
    common::assert_refused("wipe of the leader", refused, tonic::Code::FailedPrecondition, &["leader"], &[]);
    let refused = control(&cluster.nodes[1].grpc).await.wipe(WipeRequest { shard_id: 7, ..Default::default() }).await;
    common::assert_refused("wipe of a shard not hosted", refused, tonic::Code::NotFound, &["shard 7"], &[]);
    let tape = WipeRequest { shard_id: 1, source: "tape".into() };
    let refused = control(&cluster.nodes[1].grpc).await.wipe(tape).await;
    common::assert_refused("wipe with an unknown source", refused, tonic::Code::InvalidArgument, &["tape"], &[]);
    for node in &cluster.nodes {
        // A follower serves what it knows is committed: the leader's next
        // message tells it the last record is.
        wait_until(&format!("{} to serve the 10 records", node.grpc), Duration::from_secs(10), || async {
            serves_ten(&node.grpc).await
        })
        .await;
    }
    // No [archive]: the drill has nothing to rebuild from.
    wait_until("the coordinator to record a leader", Duration::from_secs(30), || {
        let ok = futures::executor::block_on(cluster.leader_of(1, 1)).is_some();
        async move { ok }
    })
    .await;
    let (code, refused) = cluster.coord_post(1, "/v1/drills/reseed", r#"{"shard": 1}"#, Some(TOKEN)).await;
    assert_eq!((code, refused["error"]["code"].as_str()), (409, Some("not_archiving")), "{refused}");
    assert!(refused["error"]["message"].as_str().unwrap().contains("does not archive"), "{refused}");
}

/// The replica serving a rebuilding follower's segments dies mid-fetch:
/// the follower takes the rest from the object store and ends
/// byte-identical to the leader, nothing acknowledged lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_serving_peer_dies_mid_rebuild_and_the_object_store_serves_the_rest() {
    // Node 3 serves peers at 1 MiB/s, so a 4 MiB rebuild from it takes
    // seconds: long enough to kill it halfway.
    let slow = vec!["--peer-serve-mib-per-s".to_string(), "1".to_string()];
    let mut cluster = Cluster::launch(&ClusterSpec {
        nodes: 3,
        shards: 1,
        coordinators: 1,
        replication: FAST,
        cluster_toml: ARCHIVE.into(),
        node_args: vec![(3, slow)],
        ..ClusterSpec::default()
    });
    cluster.wait_node_leads(1, 1, Duration::from_secs(60)).await;
    wait_until("the coordinator to record node 1 as leader and it to archive", Duration::from_secs(30), || {
        let (_, shard) = futures::executor::block_on(cluster.coord_get(1, "/v1/shards/1"));
        async move { shard["leader"] == 1 && shard["archived_seqno"].is_u64() }
    })
    .await;
    let body = r#"{"shard": 1, "follower": 2, "volume_bytes": 4194304, "record_bytes": 4096, "clients": 2}"#;
    let (code, started) = cluster.coord_post(1, "/v1/drills/reseed", body, Some(TOKEN)).await;
    assert_eq!(code, 202, "{started}");
    let report = started["report"].as_str().unwrap().to_string();
    wait_until("follower 2 to take segments from node 3", Duration::from_secs(90), || async {
        applied_bytes(&cluster, 2, "peer").await > 0
    })
    .await;
    cluster.node(3).kill9();
    let mut last = serde_json::Value::Null;
    wait_until("the drill to finish", Duration::from_secs(120), || {
        let (_, r) = futures::executor::block_on(cluster.coord_get(1, &report));
        let done = r["state"] != "running";
        last = r;
        async move { done }
    })
    .await;
    assert_eq!(last["state"], "done", "{last}");
    let r = &last["reseed"];
    eprintln!("re-seed with its peer killed: {r}");
    assert!(r["bytes_peer"].as_u64().unwrap() > 0, "{r}");
    assert!(r["bytes_archive"].as_u64().unwrap() > 0, "the object store served nothing after the peer died: {r}");
    assert!(r["bytes_peer"].as_u64().unwrap() < 4 << 20, "the peer served it all before it died: {r}");
    assert_eq!((r["lost"].as_u64(), r["divergent_replicas"].as_u64()), (Some(0), Some(0)), "{r}");
}
