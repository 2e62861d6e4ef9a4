//! `ops/METRICS.md` must list exactly the `walship_*` metric families a node
//! really exposes on `/metrics`, with the same type.

mod common;

use std::collections::BTreeMap;

use bytes::Bytes;
use common::{NodeProcess, http_get};
use walship_proto::log::{AppendRecord, AppendRequest};

fn catalogue() -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/ops/METRICS.md")).unwrap();
    text.lines()
        .filter_map(|line| {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let name = cells.get(1)?.strip_prefix('`')?.strip_suffix('`')?;
            name.starts_with("walship_").then(|| (name.to_string(), cells[2].to_string()))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn catalogue_matches_what_a_node_exposes() {
    let dir = tempfile::tempdir().unwrap();
    let node = NodeProcess::start(1, dir.path(), "1-2", &[]);
    let mut client = node.client().await;
    // Exercise the labelled families so they have series to show.
    let record = AppendRecord { key: Bytes::new(), payload: Bytes::from_static(b"x") };
    client.append(AppendRequest { shard_id: 1, records: vec![record], durability: 0 }).await.unwrap();
    client.append(AppendRequest { shard_id: 7, records: vec![], durability: 0 }).await.unwrap_err();

    let (status, body) = http_get(&format!("{}/metrics", node.admin)).await;
    assert_eq!(status, 200);
    let exposed: BTreeMap<String, String> = body
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.split_once(' '))
        .filter(|(name, _)| name.starts_with("walship_"))
        .map(|(name, kind)| (name.to_string(), kind.to_string()))
        .collect();
    assert!(!exposed.is_empty(), "no walship_ metrics in:\n{body}");
    assert_eq!(catalogue(), exposed, "ops/METRICS.md (left) vs /metrics (right)");
}
