//! Black-box upgrade: a `walship node` of this build started on the data
//! directory a node of the release before chunked storage left behind
//! (`tests/fixtures/legacy-node-1a8b0ea.tar.gz`, see its README) serves
//! every record it held, takes appends, and keeps all of it across a
//! kill -9 and restart. Its status shows the converted log's index.

mod common;

use std::path::Path;

use common::{NodeProcess, http_get, read_all};
use walship_proto::log::{AppendRecord, AppendRequest, Durability};

/// Extracts the fixture into a fresh directory (the node's data dir).
fn legacy_data_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let archive = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/legacy-node-1a8b0ea.tar.gz");
    let status = std::process::Command::new("tar")
        .arg("-xzf")
        .arg(&archive)
        .arg("-C")
        .arg(dir.path())
        .arg("--strip-components=1")
        .status()
        .unwrap();
    assert!(status.success(), "extracting {}", archive.display());
    assert!(dir.path().join("wal").is_dir());
    dir
}

async fn assert_records(node: &NodeProcess, shard: u32, last: u64, payload: impl Fn(u64) -> String) {
    let records = read_all(&node.grpc, shard, last).await;
    assert_eq!(records.len() as u64, last, "shard {shard}");
    for (i, record) in records.iter().enumerate() {
        let seqno = i as u64 + 1;
        assert_eq!(record.seqno, seqno, "shard {shard}");
        assert_eq!(String::from_utf8_lossy(&record.payload), payload(seqno), "shard {shard} seqno {seqno}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_serves_and_extends_the_wal_of_the_release_before_chunks() {
    let dir = legacy_data_dir();
    let mut node = NodeProcess::start(1, dir.path(), "1,2", &[]);
    let old = |seqno: u64| format!("line-{seqno}");
    assert_records(&node, 1, 1000, old).await;
    assert_records(&node, 2, 50, |seqno| format!("two-{seqno}")).await;

    let (code, body) = http_get(&format!("{}/v1/status", node.admin)).await;
    assert_eq!(code, 200, "{body}");
    let status: serde_json::Value = serde_json::from_str(&body).unwrap();
    let wal = &status["wal"];
    assert_eq!(wal["records"], 1050, "{wal}");
    let chunks = wal["index_chunks"].as_u64().unwrap();
    assert!((1..=20).contains(&chunks), "1,050 small records in a few chunks: {wal}");
    assert!(wal["index_bytes"].as_u64().unwrap() >= chunks * 100, "{wal}");
    let (_, metrics) = http_get(&format!("{}/metrics", node.admin)).await;
    assert!(metrics.contains(&format!("walship_wal_index_chunks {chunks}")), "{metrics}");

    let records = (1001..=1100).map(|n| AppendRecord { key: Default::default(), payload: format!("line-{n}").into() });
    let request = AppendRequest {
        shard_id: 1,
        records: records.collect(),
        durability: Durability::Local as i32,
        ..Default::default()
    };
    let appended = node.client().await.append(request).await.unwrap().into_inner();
    assert_eq!((appended.first_seqno, appended.last_seqno), (1001, 1100));

    node.restart();
    assert_records(&node, 1, 1100, old).await;
    assert_records(&node, 2, 50, |seqno| format!("two-{seqno}")).await;
}
