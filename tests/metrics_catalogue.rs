//! `ops/METRICS.md` must list exactly the `walship_*` metric families a node
//! exposes on `/metrics`, with the same type: every exposed family is
//! catalogued, and every catalogued family is exposed once the cluster has
//! done the work that creates its first series.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use common::{Cluster, http_get, wait_until};
use walship_proto::log::{AppendRecord, AppendRequest};

/// name -> (type, has labels)
fn catalogue() -> BTreeMap<String, (String, bool)> {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/ops/METRICS.md")).unwrap();
    text.lines()
        .filter_map(|line| {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let name = cells.get(1)?.strip_prefix('`')?.strip_suffix('`')?;
            name.starts_with("walship_").then(|| (name.to_string(), (cells[2].to_string(), !cells[3].is_empty())))
        })
        .collect()
}

fn exposed(body: &str) -> BTreeMap<String, String> {
    body.lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.split_once(' '))
        .filter(|(name, _)| name.starts_with("walship_"))
        .map(|(name, kind)| (name.to_string(), kind.to_string()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn catalogue_matches_what_nodes_expose() {
    let mut cluster =
        Cluster::start_with(3, 1, 1, "keepalive_ms = 50\nheartbeat_ms = 100\nleader_timeout_ms = 2000", None);
    cluster.wait_node_leads(1, 1, Duration::from_secs(20)).await;
    let mut client = cluster.node(1).client().await;
    let record = AppendRecord { key: Bytes::new(), payload: Bytes::from_static(b"x") };
    client
        .append(AppendRequest { shard_id: 1, records: vec![record], durability: 0, ..Default::default() })
        .await
        .unwrap();
    client
        .append(AppendRequest { shard_id: 7, records: vec![], durability: 0, ..Default::default() })
        .await
        .unwrap_err();
    let catalogue = catalogue();
    // The labelled families this work creates appear within a few
    // heartbeat and keepalive intervals (on a loaded machine, later than
    // the first scrape).
    let mut admins: Vec<String> = (1..=3).map(|id| cluster.node(id).admin.clone()).collect();
    admins.push(cluster.coordinator(1).admin.clone());
    wait_until("every family the work creates to be exposed", Duration::from_secs(20), || {
        let admins = admins.clone();
        async move {
            let mut names = BTreeMap::new();
            for admin in &admins {
                names.extend(exposed(&http_get(&format!("{admin}/metrics")).await.1));
            }
            CREATED_BY_THE_WORK.iter().all(|name| names.contains_key(*name))
        }
    })
    .await;
    let mut union = BTreeMap::new();
    for id in 1..=3 {
        let admin = cluster.node(id).admin.clone();
        let (status, body) = http_get(&format!("{admin}/metrics")).await;
        assert_eq!(status, 200);
        let families = exposed(&body);
        assert!(!families.is_empty(), "node {id} exposes no walship_ metrics");
        for (name, kind) in &families {
            let documented =
                catalogue.get(name).unwrap_or_else(|| panic!("node {id} exposes {name}, missing from ops/METRICS.md"));
            assert_eq!(&documented.0, kind, "{name}: type in ops/METRICS.md");
        }
        union.extend(families);
    }
    let coord_admin = cluster.coordinator(1).admin.clone();
    let (status, body) = http_get(&format!("{coord_admin}/metrics")).await;
    assert_eq!(status, 200);
    for (name, kind) in exposed(&body) {
        let documented = catalogue
            .get(&name)
            .unwrap_or_else(|| panic!("the coordinator exposes {name}, missing from ops/METRICS.md"));
        assert_eq!(&documented.0, &kind, "{name}: type in ops/METRICS.md");
        union.insert(name, kind);
    }
    for (name, (_, labelled)) in &catalogue {
        assert!(union.contains_key(name) || *labelled, "{name} is catalogued, unlabelled, and exposed by no node");
    }
    // The labelled families this run exercised must be there too.
    for name in CREATED_BY_THE_WORK {
        assert!(union.contains_key(name), "{name} not exposed after the work that creates it");
    }
}

/// Labelled families (no series until something happens) that the test's
/// cluster start, append and refused append create.
const CREATED_BY_THE_WORK: [&str; 11] = [
    "walship_replica_lag_seconds",
    "walship_replica_lag_records",
    "walship_replica_lag_bytes",
    "walship_replica_ship_mode",
    "walship_catchup_bytes_total",
    "walship_requests_rejected_total",
    "walship_heartbeats_sent_total",
    "walship_heartbeat_round_seconds",
    "walship_coordinator_heartbeat_gap_seconds",
    "walship_shard_commit_seqno",
    "walship_assignments_total",
];
