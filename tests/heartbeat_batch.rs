//! Nodes report to the coordinator in one `HeartbeatBatch` per tick (the
//! shards whose report changed, all of them every few seconds) instead of
//! one `Heartbeat` per shard. Against real processes: the coordinator sees
//! every replica of many shards alive with current positions, fails a
//! shard over when its leader dies, and refuses a bad batch whole; the
//! shard list filters (unhealthy, by node) and pages.

mod common;

use std::time::Duration;

use common::{Cluster, wait_until};
use tonic::Code;
use walship_proto::replication::wal_shipping_client::WalShippingClient;
use walship_proto::replication::{HeartbeatBatchRequest, HeartbeatRequest};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_heartbeats_keep_every_replica_current_and_a_bad_batch_changes_nothing() {
    let mut cluster = Cluster::start_with(3, 24, 1, "heartbeat_ms = 50\nleader_timeout_ms = 1000", None);
    for shard in 1..=24 {
        cluster.wait_leader(shard, None, Duration::from_secs(60)).await;
    }
    // Every replica of every shard is reported alive, with a fresh position,
    // and every follower heard by its leader (until a follower first answers
    // its new leader, its lag is counted from its own report, stale).
    wait_until("every replica alive, in its leader's epoch and heard", Duration::from_secs(30), || {
        let (_, shards) = futures::executor::block_on(cluster.coord_get(1, "/v1/shards"));
        let all = shards.as_array().is_some_and(|shards| {
            shards.len() == 24
                && shards.iter().all(|s| {
                    s["replicas"].as_array().is_some_and(|r| {
                        r.len() == 3
                            && r.iter().all(|r| {
                                r["alive"] == true
                                    && r["epoch"] == s["epoch"]
                                    && r["position_age_ms"].as_u64().is_some_and(|age| age < 1_000)
                                    && r["lag_stale"] == false
                            })
                    })
                })
        });
        async move { all }
    })
    .await;

    // Bad batches, each refused whole; the coordinator's view of node 2
    // stays as node 2 reports it.
    let coordinator = cluster.coordinator(1).grpc.clone();
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{coordinator}")).unwrap();
    let mut client = WalShippingClient::new(common::as_member(endpoint.connect().await.unwrap()));
    let forged =
        |node: u32| HeartbeatRequest { node_id: node, shard_id: 1, epoch: 999, is_leader: true, ..Default::default() };
    let bad = [
        (HeartbeatBatchRequest { node_id: 9, shards: vec![], full: false }, "unknown node"),
        (HeartbeatBatchRequest { node_id: 0, shards: vec![], full: false }, "unknown node"),
        (HeartbeatBatchRequest { node_id: 1, shards: vec![forged(1), forged(2)], full: true }, "a report of node 2"),
        (HeartbeatBatchRequest { node_id: 2, shards: vec![forged(2); 20_001], full: false }, "at most 20000"),
    ];
    for (batch, says) in bad {
        let refused = client.heartbeat_batch(batch).await.expect_err("refused");
        assert_eq!(refused.code(), Code::InvalidArgument, "{refused}");
        assert!(refused.message().contains(says), "{refused}");
    }
    let (_, shard) = cluster.coord_get(1, "/v1/shards/1").await;
    for r in shard["replicas"].as_array().unwrap() {
        assert_eq!(r["epoch"], shard["epoch"], "a refused batch changed nothing: {shard}");
    }
    // A node keeps reports of shards of the cluster only, and refuses a
    // batch holding another one whole.
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{}", cluster.node(2).grpc)).unwrap();
    let mut node2 = WalShippingClient::new(common::as_member(endpoint.connect().await.unwrap()));
    let unknown = HeartbeatRequest { shard_id: 99, ..forged(1) };
    let batch = HeartbeatBatchRequest { node_id: 1, shards: vec![forged(1), unknown], full: false };
    let refused = node2.heartbeat_batch(batch).await.expect_err("refused");
    assert_eq!(refused.code(), Code::NotFound, "{refused}");
    assert!(refused.message().contains("shard 99"), "{refused}");
    let kept = cluster.status(2).await.unwrap()["heartbeats_received"].clone();
    let kept = kept.as_array().unwrap();
    assert!(kept.iter().all(|h| h["epoch"] != 999 && h["shard_id"] != 99), "a refused batch changed nothing: {kept:?}");

    // The shard list filters and pages.
    let ids = |v: &serde_json::Value| -> Vec<u64> {
        v.as_array().map(|a| a.iter().map(|s| s["shard_id"].as_u64().unwrap()).collect()).unwrap_or_default()
    };
    let (code, page) = cluster.coord_get(1, "/v1/shards?limit=5&offset=20").await;
    assert_eq!((code, ids(&page)), (200, vec![21, 22, 23, 24]));
    let (_, on_node) = cluster.coord_get(1, "/v1/shards?node=2&limit=3").await;
    assert_eq!(ids(&on_node), vec![1, 2, 3]);
    // A node the cluster does not have is not found, naming the ones it has.
    let (code, unknown) = cluster.coord_get(1, "/v1/shards?node=9").await;
    assert_eq!((code, unknown["error"]["code"].as_str()), (404, Some("not_found")), "{unknown}");
    assert!(unknown["error"]["message"].as_str().unwrap().contains("node 9 is not in the cluster"), "{unknown}");
    let (_, healthy) = cluster.coord_get(1, "/v1/shards?unhealthy=true").await;
    assert_eq!(ids(&healthy), Vec::<u64>::new(), "nothing needs attention: {healthy}");
    for bad in ["limit=0", "limit=10001", "bogus=1", "node=x", "unhealthy=maybe"] {
        let (code, refused) = cluster.coord_get(1, &format!("/v1/shards?{bad}")).await;
        assert_eq!((code, refused["error"]["code"].as_str()), (400, Some("bad_query")), "{bad}: {refused}");
    }

    // A leader that dies is noticed through batches alone; until the node
    // comes back, every shard it holds needs attention.
    let leader = cluster.leader_of(1, 1).await.unwrap().0;
    cluster.node(leader).kill9();
    let next = cluster.wait_leader(1, Some(leader), Duration::from_secs(30)).await;
    assert_ne!(next, leader);
    wait_until("every shard listed as needing attention", Duration::from_secs(30), || {
        let (_, listed) = futures::executor::block_on(cluster.coord_get(1, "/v1/shards?unhealthy=true"));
        async move { ids(&listed).len() == 24 }
    })
    .await;
}
