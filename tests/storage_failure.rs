//! Black-box test of a storage failure on a real node process: a leader
//! whose fsync fails must end itself, so the coordinator fails its shard
//! over and no acknowledged record is lost.
//!
//! The failure is injected with the `wal::sync` failpoint of walship-wal's
//! `testing` feature (`wal/src/failpoints.rs`), which the test build of the
//! `walship` binary has (the root package's dev-dependency). raft-engine
//! panics on a failed sync; before the WAL turned that panic into the end of
//! the process, only its persister thread died, appends failed with
//! UNAVAILABLE forever and the node went on heartbeating as leader, so this
//! test timed out waiting for the exit. It also fails if the failpoint is
//! inert (a binary built without the feature): the leader never exits.

mod common;

use std::cell::Cell;
use std::os::unix::process::ExitStatusExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::{Acked, Cluster, ClusterSpec, append_and_record, read_all, wait_until};
use walship_proto::log::Durability;

const WAIT: Duration = Duration::from_secs(40);
/// Loss after 1 s of silence, as in `tests/failover.rs`.
const FAST: &str = "heartbeat_ms = 50\nleader_timeout_ms = 1000\nkeepalive_ms = 100\nship_timeout_ms = 1000";
/// The node's first 60 log syncs succeed (opening the WAL, creating the
/// shard, taking the leadership, then group commits), every later one fails:
/// the failure comes while the leader serves appends.
const FAILING_SYNC: &str = "wal::sync=60*off->return";
const CLIENTS: u32 = 4;

/// The leader and epoch of `shard` the coordinator at `admin` records.
async fn recorded_leader(admin: &str, shard: u32) -> Option<(u32, u64)> {
    let (code, body) = common::http_get(&format!("{admin}/v1/shards/{shard}")).await;
    let v: serde_json::Value = (code == 200).then(|| serde_json::from_str(&body).ok()).flatten()?;
    Some((v["leader"].as_u64()? as u32, v["epoch"].as_u64()?))
}

/// Whether node `id`'s own status says it leads `shard`.
async fn leads(cluster: &Cluster, id: u32, shard: u32) -> bool {
    cluster.status(id).await.is_some_and(|s| {
        s["shards"].as_array().is_some_and(|a| a.iter().any(|e| e["shard_id"] == shard && e["role"] == "leader"))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_fsync_fails_ends_itself_and_its_shard_fails_over() {
    // Node 1 is the shard's leader in the cluster config; it alone gets the
    // failing sync.
    let failing = 1;
    let mut cluster = Cluster::launch(&ClusterSpec {
        coordinators: 1,
        replication: FAST,
        node_env: vec![(failing, vec![("FAILPOINTS".to_string(), FAILING_SYNC.to_string())])],
        ..ClusterSpec::default()
    });
    let admin = cluster.coordinator(1).admin.clone();

    // The shard's leader, as the coordinator records it and as it says.
    let first = Cell::new(None);
    wait_until("a leader for shard 1", WAIT, || {
        let (admin, cluster, first) = (admin.clone(), &cluster, &first);
        async move {
            let Some((leader, epoch)) = recorded_leader(&admin, 1).await else { return false };
            first.set(Some((leader, epoch)));
            leads(cluster, leader, 1).await
        }
    })
    .await;
    let (leader, epoch) = first.get().expect("a leader was found");
    assert_eq!(leader, failing, "the coordinator chose node {leader}, not the node with the failing sync");

    // QUORUM appends from a few clients until the leader stops answering;
    // every acknowledged seqno is recorded with its payload.
    let acked: Acked = Arc::default();
    let appended = Arc::new(AtomicU64::new(0));
    let grpc = cluster.node(leader).grpc.clone();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|client| {
            let (grpc, acked, appended) = (grpc.clone(), acked.clone(), appended.clone());
            tokio::spawn(async move {
                let channel =
                    tonic::transport::Endpoint::from_shared(format!("http://{grpc}")).unwrap().connect().await.unwrap();
                let mut log = walship_proto::log::log_client::LogClient::new(channel);
                for n in 0u64.. {
                    let payloads =
                        (0..1 + n % 3).map(|i| Bytes::from(format!("client{client}-n{n}-{i}"))).collect::<Vec<_>>();
                    let result =
                        append_and_record(&mut log, 1, payloads, Durability::Quorum, Duration::from_secs(5), &acked)
                            .await;
                    // A refusal (the node died, or its WAL stopped) has an
                    // unknown outcome: not recorded, and this client stops.
                    if result.is_err() {
                        break;
                    }
                    appended.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();

    // The leader ends by itself: aborted on the failed fsync.
    let mut exit = None;
    wait_until(
        "the leader to end itself after its fsync failed (it does not if it outlives the failure, nor if the \
         failpoint is inert: a walship binary built without walship-wal's `testing` feature)",
        WAIT,
        || {
            if exit.is_none() {
                exit = cluster.node(leader).child.try_wait().unwrap();
            }
            let exited = exit.is_some();
            async move { exited }
        },
    )
    .await;
    let exit = exit.expect("exited");
    assert_eq!(exit.signal(), Some(libc::SIGABRT), "the node must abort on a storage failure, it ended with {exit}");
    for client in clients {
        client.await.unwrap();
    }
    let before_exit = appended.load(Ordering::Relaxed);
    assert!(before_exit > 0, "no append was acknowledged before the failure: the test proves nothing");

    // The coordinator fails the shard over to another node, in a new epoch.
    let next = Cell::new(None);
    wait_until("the coordinator to fail shard 1 over to another node", WAIT, || {
        let (admin, cluster, next) = (admin.clone(), &cluster, &next);
        async move {
            match recorded_leader(&admin, 1).await {
                Some((l, e)) if l != leader && e > epoch => {
                    next.set(Some(l));
                    leads(cluster, l, 1).await
                }
                _ => false,
            }
        }
    })
    .await;
    let new_leader = next.get().expect("a new leader was found");

    // The new leader serves: one more acknowledged append, which also
    // commits everything before it in its epoch.
    let mut log = cluster.node(new_leader).client().await;
    let after = Bytes::from_static(b"after-failover");
    append_and_record(&mut log, 1, vec![after.clone()], Durability::Quorum, Duration::from_secs(10), &acked)
        .await
        .expect("the new leader acknowledges appends");

    // Every acknowledged record reads back from the new leader, identical,
    // at the seqno it was acknowledged with.
    let acked = acked.lock().await.remove(&1).unwrap_or_default();
    let last = *acked.keys().next_back().expect("acknowledged records");
    assert_eq!(acked[&last], after);
    let records = read_all(&cluster.node(new_leader).grpc.clone(), 1, last).await;
    assert_eq!(records.len() as u64, last, "node {new_leader} holds seqnos 1..={last}");
    for (i, record) in records.iter().enumerate() {
        assert_eq!(record.seqno, i as u64 + 1, "contiguous seqnos");
    }
    for (seqno, payload) in &acked {
        assert_eq!(&records[*seqno as usize - 1].payload, payload, "acknowledged record {seqno} LOST or replaced");
    }
    eprintln!(
        "node {leader} aborted ({exit}) after {before_exit} acknowledged appends; node {new_leader} leads and \
         holds all {} acknowledged records",
        acked.len()
    );
}
