//! `PeerExchange.FetchShuffle` against real node processes: a node streams
//! an archived segment from its WAL, byte-identical to the object store's
//! copy, in checked chunks of at most 256 KiB, and resumes from an offset;
//! the rejection table (tokens: empty, garbage, another cluster's, expired,
//! another task's, another shard's; keys: traversals, absolute, escaped,
//! too long, not canonical, not held; an offset past the end; the serving
//! cap held past its bound), each refusal clear and changing nothing.

mod common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::{Cluster, ClusterSpec, SECRET, wait_until};
use walship_objstore::{LocalDirStore, ObjectKey, ObjectStore};
use walship_peer::token::{Grant, Token, TokenKey};
use walship_proto::dataplane::FetchShuffleRequest;
use walship_proto::dataplane::peer_exchange_client::PeerExchangeClient;
use walship_proto::log::{AppendRecord, AppendRequest, Durability};

/// Segments of up to 1 MiB, sealed by size (the age bound is long).
const ARCHIVE: &str =
    "[archive]\nstore = \"dir\"\ndir = \"archive\"\nsegment_bytes = 1048576\nsegment_age_ms = 600000\n";

const TASK: &str = "rebuild-test";

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

fn token(key: &TokenKey, task: &str, shard: u32, expires_unix_ms: u64) -> Token {
    key.mint(&Grant { task: task.into(), shard, expires_unix_ms })
}

async fn client(grpc: &str) -> PeerExchangeClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc}")).unwrap().connect().await.unwrap();
    PeerExchangeClient::new(channel)
}

/// Fetches `key` from `grpc` whole: the bytes, or the refusal.
async fn fetch(grpc: &str, task: &str, key: &str, token: &str, offset: u64) -> Result<Vec<u8>, tonic::Status> {
    let request = FetchShuffleRequest { query_id: task.into(), key: key.into(), token: token.into(), offset };
    let mut stream = client(grpc).await.fetch_shuffle(request).await?.into_inner();
    let mut out = Vec::new();
    while let Some(chunk) = stream.message().await? {
        assert!(chunk.data.len() <= 256 << 10, "a chunk of {} bytes", chunk.data.len());
        assert_eq!(chunk.crc32c, Some(crc32c::crc32c(&chunk.data)), "a chunk's crc32c");
        out.extend_from_slice(&chunk.data);
        assert!(out.len() as u64 + offset <= chunk.total_bytes);
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_serves_archived_segments_from_its_wal_and_refuses_bad_fetches() {
    let slow = ["--peer-serve-concurrency", "1", "--peer-serve-wait-ms", "300", "--peer-serve-mib-per-s", "1"];
    let mut cluster = Cluster::launch(&ClusterSpec {
        nodes: 3,
        shards: 1,
        coordinators: 1,
        replication: "heartbeat_ms = 50\nleader_timeout_ms = 1000\nkeepalive_ms = 100",
        cluster_toml: ARCHIVE.into(),
        node_args: vec![(2, slow.iter().map(|s| s.to_string()).collect())],
        ..ClusterSpec::default()
    });
    let leader = cluster.wait_leader(1, None, Duration::from_secs(60)).await;
    let mut log = cluster.nodes[leader as usize - 1].client().await;
    for i in 0..400 {
        let payload = format!("peer-{i:05}-").repeat(400).into_bytes();
        let request = AppendRequest {
            shard_id: 1,
            records: vec![AppendRecord { key: Default::default(), payload: payload.into() }],
            durability: Durability::All as i32,
            ..Default::default()
        };
        log.append(request).await.unwrap();
    }
    let store = LocalDirStore::open(cluster.dir.path().join("archive")).unwrap();
    wait_until("the archive to hold a large segment", Duration::from_secs(60), || async {
        let listed = store.list("shards/1/segments/").await.unwrap_or_default();
        listed.iter().any(|o| o.size >= 512 << 10)
    })
    .await;
    let listed = store.list("shards/1/segments/").await.unwrap();
    let big = listed.iter().max_by_key(|o| o.size).unwrap();
    let key = big.key.as_str().to_string();
    let archived = store.get(&ObjectKey::new(key.clone()).unwrap()).await.unwrap().unwrap();
    let secret = TokenKey::derive(SECRET.as_bytes());
    let good = token(&secret, TASK, 1, now_ms() + 60_000);
    let node3 = cluster.nodes[2].grpc.clone();

    // Every replica holds it: the same bytes as the object store's copy,
    // from the leader and from a follower, and from an offset on.
    for grpc in [&node3, &cluster.nodes[leader as usize - 1].grpc] {
        let got = fetch(grpc, TASK, &key, good.as_str(), 0).await.unwrap();
        assert!(
            got == archived[..],
            "{grpc} served other bytes than the archive holds ({} vs {})",
            got.len(),
            archived.len()
        );
    }
    let half = archived.len() as u64 / 2;
    let tail = fetch(&node3, TASK, &key, good.as_str(), half).await.unwrap();
    assert!(tail == archived[half as usize..], "a resumed fetch");

    // Tokens.
    let other_cluster = token(&TokenKey::derive(b"another-cluster-secret"), TASK, 1, now_ms() + 60_000);
    let expired = token(&secret, TASK, 1, now_ms() - 1);
    let other_shard = token(&secret, TASK, 2, now_ms() + 60_000);
    for (what, task, tok, words) in [
        ("an empty token", TASK, "", &["no fetch token"][..]),
        ("a garbage token", TASK, "wpt1.garbage", &["not one walship minted"]),
        ("another cluster's token", TASK, other_cluster.as_str(), &["signature"]),
        ("an expired token", TASK, expired.as_str(), &["expired"]),
        ("another task's token", "other-task", good.as_str(), &["another task"]),
        ("another shard's token", TASK, other_shard.as_str(), &["shard 2", "shard 1"]),
    ] {
        let refused = fetch(&node3, task, &key, tok, 0).await;
        common::assert_refused(what, refused, tonic::Code::PermissionDenied, words, &[]);
    }
    // Keys.
    let long = "a/".repeat(1500) + "x.wseg";
    let unpadded = "shards/1/segments/1-2-e1.wseg";
    for bad in
        ["../x", "/etc/passwd", "%2e%2e/x", "shards/1/segments/../../x", "", long.as_str(), unpadded, "manifest.json"]
    {
        let refused = fetch(&node3, TASK, bad, good.as_str(), 0).await;
        let status =
            common::assert_refused(&format!("key {bad:.40}"), refused, tonic::Code::InvalidArgument, &["key"], &[]);
        assert!(status.message().len() < 400, "the refusal echoes a huge key: {} bytes", status.message().len());
    }
    let not_held = "shards/1/segments/00000000000000900000-00000000000000900010-e1.wseg";
    let refused = fetch(&node3, TASK, not_held, good.as_str(), 0).await;
    common::assert_refused("a segment not held", refused, tonic::Code::NotFound, &["does not hold"], &[]);
    let refused = fetch(&node3, TASK, &key, good.as_str(), archived.len() as u64 + 1).await;
    common::assert_refused("an offset past the end", refused, tonic::Code::OutOfRange, &["offset"], &[]);
    // A range of every record, held and committed but larger than any
    // segment the archiver seals (segment_bytes 1 MiB; 400 records of
    // 4.4 KB): not served, so no caller makes a node encode its whole log
    // in memory.
    let epoch = key.rsplit("-e").next().unwrap().strip_suffix(".wseg").unwrap();
    let whole = format!("shards/1/segments/{:020}-{:020}-e{epoch}.wseg", 1, 400);
    let refused = fetch(&node3, TASK, &whole, good.as_str(), 0).await;
    common::assert_refused("a range larger than a segment", refused, tonic::Code::NotFound, &["does not hold"], &[]);

    // The serving cap: node 2 serves one fetch at a time at 1 MiB/s; a
    // second fetch waits 300 ms for the slot, then is refused.
    let node2 = cluster.nodes[1].grpc.clone();
    let (k, t) = (key.clone(), good.as_str().to_string());
    let node2_admin = cluster.nodes[1].admin.clone();
    let served = || async {
        let (_, metrics) = common::http_get(&format!("{node2_admin}/metrics")).await;
        let line = "walship_peer_serves_total{result=\"ok\"} ";
        metrics.lines().find_map(|l| l.strip_prefix(line)).map_or(0, |v| v.trim().parse::<u64>().unwrap())
    };
    let before = served().await;
    let holder = tokio::spawn(async move { fetch(&node2, TASK, &k, &t, 0).await });
    wait_until("node 2 to take its one slot for the first fetch", Duration::from_secs(10), || async {
        served().await > before
    })
    .await;
    let refused = fetch(&cluster.nodes[1].grpc, TASK, &key, good.as_str(), 0).await;
    common::assert_refused("a fetch past the cap", refused, tonic::Code::ResourceExhausted, &["slot"], &[]);
    let held = holder.await.unwrap().unwrap();
    assert!(held == archived[..], "the fetch holding the slot completed intact");
    // The slot is free again.
    assert!(fetch(&cluster.nodes[1].grpc, TASK, &key, good.as_str(), 0).await.is_ok());

    // Refusals and fetches changed nothing: the shard still serves reads.
    let (_, metrics) = common::http_get(&format!("{}/metrics", cluster.nodes[2].admin)).await;
    assert!(metrics.contains("walship_peer_serves_total{result=\"denied\"}"), "no serve metric");
    let records = common::read_all(&cluster.nodes[2].grpc, 1, 400).await;
    assert_eq!(records.len(), 400);
}
