//! The leadership state's KV layout against real processes, on the file KV
//! and on a real NATS JetStream bucket:
//!
//! * a running cluster keeps one key per shard (`shard.<id>`), `lease` and
//!   `failovers`, and a failover of one shard rewrites that shard's record
//!   (and the history), not the others';
//! * a coordinator of this build started on the single-value layout of
//!   earlier builds (`cluster-state`, in `kv.json` for the file KV) takes
//!   it over as it was, a failover's epoch and leader and history intact,
//!   converts it, and overwrites the old key with a marker; a restart then
//!   reads the per-key layout.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use common::{Cluster, TOKEN, wait_until};
use walship_proto::log::{AppendRecord, AppendRequest, Durability};
use walship_shipping::control::state::{
    ClusterState, FAILOVERS_KEY, LEASE_KEY, LEGACY_MARKER, LEGACY_STATE_KEY, Stored, shard_key,
};
use walship_shipping::control::{FileKv, Kv, KvEntry, NatsKv};

#[path = "../shipping/tests/support/nats.rs"]
mod nats;

const WAIT: Duration = Duration::from_secs(30);
const REPLICATION: &str = "coordinator_lease_ms = 600\nleader_timeout_ms = 1000\nheartbeat_ms = 50";

/// The coordinators' KV, opened beside them.
async fn open_kv(cluster: &Cluster) -> Box<dyn Kv> {
    match &cluster.nats {
        Some(url) => Box::new(NatsKv::connect(url, "walship").await.unwrap()),
        None => Box::new(FileKv::open(&cluster.dir.path().join("coord/kv")).unwrap()),
    }
}

fn current(entries: &[KvEntry]) -> ClusterState {
    match Stored::decode(entries).unwrap() {
        Stored::Current(state) => state,
        other => panic!("expected the per-key layout, found {other:?}"),
    }
}

fn revisions(entries: &[KvEntry]) -> BTreeMap<String, u64> {
    entries.iter().map(|e| (e.key.clone(), e.revision)).collect()
}

async fn append_one(cluster: &mut Cluster, shard: u32, leader: u32) {
    let mut client = cluster.node(leader).client().await;
    let request = AppendRequest {
        shard_id: shard,
        records: vec![AppendRecord { key: Bytes::new(), payload: Bytes::from_static(b"after") }],
        durability: Durability::Quorum as i32,
        ..Default::default()
    };
    client.append(request).await.unwrap_or_else(|e| panic!("append to shard {shard} on node {leader}: {e}"));
}

/// Replaces the per-key layout by the single value of earlier builds,
/// holding `state` (its lease run out), as an earlier build left it.
async fn write_legacy(cluster: &Cluster, state: &ClusterState) {
    let value = serde_json::to_vec(state).unwrap();
    match &cluster.nats {
        Some(url) => {
            let client = async_nats::connect(url.as_str()).await.unwrap();
            let store = async_nats::jetstream::new(client).get_key_value("walship").await.unwrap();
            let snapshot = open_kv(cluster).await.scan().await.unwrap();
            for entry in &snapshot.entries {
                store.purge(&entry.key).await.unwrap();
            }
            store.create(LEGACY_STATE_KEY, Bytes::from(value)).await.unwrap();
        }
        None => {
            let dir = cluster.dir.path().join("coord/kv");
            std::fs::remove_file(dir.join("kv.log")).unwrap();
            let legacy = serde_json::json!({
                "revision": 41,
                "entries": {
                    LEGACY_STATE_KEY: {
                        "value_b64": base64::engine::general_purpose::STANDARD.encode(&value),
                        "revision": 41,
                    }
                }
            });
            std::fs::write(dir.join("kv.json"), serde_json::to_vec(&legacy).unwrap()).unwrap();
        }
    }
    let snapshot = open_kv(cluster).await.scan().await.unwrap();
    assert!(matches!(Stored::decode(&snapshot.entries).unwrap(), Stored::Legacy(_)), "{snapshot:?}");
}

async fn layout_and_conversion(nats_url: Option<&str>) {
    let mut cluster = Cluster::start_with(3, 3, 1, REPLICATION, nats_url);
    for shard in 1..=3 {
        cluster.wait_leader(shard, None, WAIT).await;
    }

    // One key per shard, the lease and the history.
    let kv = open_kv(&cluster).await;
    let before = kv.scan().await.unwrap();
    let keys: Vec<&str> = before.entries.iter().map(|e| e.key.as_str()).collect();
    assert_eq!(keys, [FAILOVERS_KEY, LEASE_KEY, "shard.1", "shard.2", "shard.3"]);
    let state = current(&before.entries);
    assert_eq!(state.shards.len(), 3);

    // A failover of shard 1 writes shard 1's record and the history; the
    // other shards' records keep their revisions.
    let (leader, epoch) = cluster.leader_of(1, 1).await.unwrap();
    let target = leader % 3 + 1;
    let (code, body) =
        cluster.coord_post(1, "/v1/shards/1/failover", &format!("{{\"target\": {target}}}"), Some(TOKEN)).await;
    assert_eq!(code, 200, "{body}");
    let after = kv.scan().await.unwrap();
    let (was, now) = (revisions(&before.entries), revisions(&after.entries));
    for untouched in [shard_key(2), shard_key(3)] {
        assert_eq!(was[&untouched], now[&untouched], "{untouched} was rewritten by a failover of shard 1");
    }
    assert!(now[&shard_key(1)] > was[&shard_key(1)]);
    assert!(now[FAILOVERS_KEY] > was[FAILOVERS_KEY]);
    let moved = current(&after.entries);
    assert_eq!(moved.shards[&1].leader, Some(target));
    assert!(moved.shards[&1].epoch > epoch);
    assert_eq!(moved.failovers.back().map(|f| (f.shard, f.to)), Some((1, target)));

    // Stop the coordinator and leave the KV as an earlier build would
    // have: one value, the lease (of a coordinator no longer running) run
    // out.
    cluster.coordinator(1).kill9();
    let mut legacy = current(&kv.scan().await.unwrap().entries);
    legacy.lease.holder = "c0".into();
    legacy.lease.expires_unix_ms = 0;
    write_legacy(&cluster, &legacy).await;

    // This build takes it over as it was and converts it.
    cluster.restart_coordinator(1);
    let kv = open_kv(&cluster).await;
    wait_until("the coordinator converts and takes the lease", WAIT, || async {
        let snapshot = kv.scan().await.unwrap();
        matches!(Stored::decode(&snapshot.entries), Ok(Stored::Current(_)))
    })
    .await;
    let converted = open_kv(&cluster).await.scan().await.unwrap();
    let state = current(&converted.entries);
    assert_eq!(state.shards, legacy.shards, "the records came over as they were");
    assert_eq!(state.failovers, legacy.failovers, "the history came over");
    assert_eq!(state.lease.holder, "c1");
    assert!(state.lease.term > legacy.lease.term, "taken over with the next term");
    let marker = converted.entries.iter().find(|e| e.key == LEGACY_STATE_KEY).expect("the old key is kept");
    assert_eq!(marker.value, Bytes::from_static(LEGACY_MARKER.as_bytes()));
    assert!(serde_json::from_slice::<ClusterState>(&marker.value).is_err(), "an older build cannot act on it");
    if nats_url.is_none() {
        assert!(!cluster.dir.path().join("coord/kv/kv.json").exists(), "kv.json converted into kv.log");
    }
    assert_eq!(cluster.leader_of(1, 1).await.map(|(l, _)| l), Some(target));
    let (code, view) = cluster.coord_get(1, "/v1/cluster").await;
    assert_eq!(code, 200);
    assert_eq!(view["recent_failovers"][0]["shard"], 1, "{view}");
    append_one(&mut cluster, 1, target).await;

    // A restart reads the per-key layout; a failover still works.
    cluster.restart_coordinator(1);
    let admin = cluster.coordinator(1).admin.clone();
    wait_until("the restarted coordinator is active", WAIT, || async {
        let (code, body) = common::http_get(&format!("{admin}/v1/cluster")).await;
        code == 200 && serde_json::from_str::<serde_json::Value>(&body).unwrap()["coordinator"]["active"] == true
    })
    .await;
    let reread = current(&open_kv(&cluster).await.scan().await.unwrap().entries);
    assert_eq!(reread.shards, legacy.shards);
    let (leader, _) = cluster.leader_of(1, 2).await.unwrap();
    let target = leader % 3 + 1;
    let (code, body) =
        cluster.coord_post(1, "/v1/shards/2/failover", &format!("{{\"target\": {target}}}"), Some(TOKEN)).await;
    assert_eq!(code, 200, "{body}");
    cluster.wait_node_leads(target, 2, WAIT).await;
    append_one(&mut cluster, 2, target).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_kv_per_shard_records_and_conversion() {
    layout_and_conversion(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_kv_per_shard_records_and_conversion() {
    let server = nats::NatsServer::start();
    layout_and_conversion(Some(&server.url)).await;
}
