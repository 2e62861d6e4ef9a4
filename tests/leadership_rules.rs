//! Black-box tests of two leadership rules, on real `walship node` and
//! `walship coord` processes:
//! * a new leader makes everything durable on a majority readable at once,
//!   without waiting for a client write: after the whole cluster stops
//!   (SIGTERM, or SIGKILL) and starts again, the last acknowledged record
//!   reads back within a second of the new leader taking its role;
//! * a leader frozen past the failure timeout and then resumed acknowledges
//!   nothing, at any durability (its lease lapsed; a new leader exists);
//! * a record acknowledged by the leader and one follower survives a crash
//!   of the whole cluster that the follower stays down through: the
//!   commit every process knew is gone, so the record counts as
//!   acknowledged because it may be on a majority, and the follower that
//!   lacks it is not promoted over the old leader that holds it;
//! * a leader whose own followers stop answering its shard while their
//!   nodes keep answering another shard it leads does not step down
//!   (CheckQuorum steps down for a cut node, not a lagging shard): it
//!   acknowledges nothing meanwhile, and the same leadership acknowledges
//!   again once they answer.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{Acked, Cluster, wait_until};
use walship_proto::log::log_client::LogClient;
use walship_proto::log::{AppendRecord, AppendRequest, Durability, ReadRequest};

const WAIT: Duration = Duration::from_secs(40);
/// Loss is detected after 1 s of silence (see `tests/failover.rs`).
const FAST: &str = "heartbeat_ms = 50\nleader_timeout_ms = 1000\nkeepalive_ms = 100\nship_timeout_ms = 1000";

fn entry(status: &serde_json::Value, shard: u32) -> serde_json::Value {
    status["shards"].as_array().and_then(|a| a.iter().find(|s| s["shard_id"] == shard).cloned()).unwrap_or_default()
}

/// Waits until the coordinator records a leader of `shard` (other than
/// `not`) and that node has taken the role; returns it and when that was
/// first seen.
async fn wait_new_leader(cluster: &mut Cluster, shard: u32, not: Option<u32>) -> (u32, Instant) {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some((leader, _)) = cluster.leader_of(1, shard).await
            && Some(leader) != not
            && cluster.status(leader).await.is_some_and(|s| entry(&s, shard)["role"] == "leader")
        {
            return (leader, Instant::now());
        }
        assert!(Instant::now() < deadline, "no new leader of shard {shard} within {WAIT:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Appends one record; its seqno.
async fn append(
    log: &mut LogClient<tonic::transport::Channel>,
    shard: u32,
    payload: &str,
    durability: Durability,
) -> u64 {
    let request = AppendRequest {
        shard_id: shard,
        records: vec![AppendRecord { key: Bytes::new(), payload: Bytes::from(payload.to_string()) }],
        durability: durability as i32,
        ..Default::default()
    };
    log.append(request).await.unwrap_or_else(|s| panic!("append {payload}: {s}")).into_inner().last_seqno
}

/// Appends one record, giving up after 2 s: the leader's answer.
async fn try_append(
    log: &mut LogClient<tonic::transport::Channel>,
    shard: u32,
    payload: &str,
    durability: Durability,
) -> Result<tonic::Response<walship_proto::log::AppendResponse>, tonic::Status> {
    let mut request = tonic::Request::new(AppendRequest {
        shard_id: shard,
        records: vec![AppendRecord { key: Bytes::new(), payload: Bytes::from(payload.to_string()) }],
        durability: durability as i32,
        ..Default::default()
    });
    request.set_timeout(Duration::from_secs(2));
    log.append(request).await
}

/// Appends QUORUM records to both shards, stops every node with `signal`,
/// starts them again and checks the last acknowledged record of each shard
/// reads back from its new leader within a second of it taking the role,
/// with no append in between.
async fn whole_cluster_restart(signal: i32) {
    let mut cluster = Cluster::start_with(3, 2, 1, FAST, None);
    let mut last = Vec::new();
    for shard in 1..=2 {
        let (leader, _) = wait_new_leader(&mut cluster, shard, None).await;
        let mut log = cluster.node(leader).client().await;
        for i in 1..=5 {
            append(&mut log, shard, &format!("shard{shard}-record{i}"), Durability::Quorum).await;
        }
        last.push((shard, 5u64, format!("shard{shard}-record5")));
    }
    for id in 1..=3 {
        cluster.signal(id, signal);
    }
    for id in 1..=3 {
        let status = cluster.node(id).child.wait().unwrap();
        assert!(signal == libc::SIGKILL || status.success(), "node {id} stopped on SIGTERM with {status}");
    }
    for id in 1..=3 {
        cluster.restart(id);
    }
    for (shard, seqno, payload) in last {
        let (leader, led_at) = wait_new_leader(&mut cluster, shard, None).await;
        let mut log = cluster.node(leader).client().await;
        let read =
            ReadRequest { shard_id: shard, from_seqno: seqno, to_seqno: seqno, max_bytes: 0, ..Default::default() };
        let mut outcome = log.read(read).await;
        while outcome.is_err() && led_at.elapsed() < Duration::from_secs(1) {
            tokio::time::sleep(Duration::from_millis(10)).await;
            outcome = log.read(read).await;
        }
        let records = outcome
            .unwrap_or_else(|s| {
                panic!("shard {shard}: seqno {seqno} not readable from node {leader} 1 s after it took the lead: {s}")
            })
            .into_inner()
            .records;
        assert_eq!(records.len(), 1, "shard {shard}");
        assert_eq!(records[0].payload, payload.as_bytes(), "shard {shard}");
        eprintln!("shard {shard}: seqno {seqno} readable {:?} after node {leader} took the lead", led_at.elapsed());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_whole_cluster_sigterm_the_last_acknowledged_record_reads_back_without_a_new_append() {
    whole_cluster_restart(libc::SIGTERM).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_whole_cluster_sigkill_the_last_acknowledged_record_reads_back_without_a_new_append() {
    whole_cluster_restart(libc::SIGKILL).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_on_the_leader_and_a_follower_that_stays_down_survives_a_whole_cluster_crash() {
    let mut cluster = Cluster::start_with(3, 1, 1, FAST, None);
    let (leader, _) = wait_new_leader(&mut cluster, 1, None).await;
    let mut log = cluster.node(leader).client().await;
    append(&mut log, 1, "everyone", Durability::All).await;
    let followers: Vec<u32> = (1..=3).filter(|&id| id != leader).collect();
    let (behind, holder) = (followers[0], followers[1]);
    // `behind` misses the next record; the leader and `holder` acknowledge it.
    cluster.signal(behind, libc::SIGSTOP);
    let seqno = append(&mut log, 1, "on-two", Durability::Quorum).await;
    // The whole cluster crashes; `holder` stays down, so only the leader's
    // copy of `seqno` answers the fences, and no process remembers that it
    // was committed.
    for id in 1..=3 {
        cluster.node(id).kill9();
    }
    cluster.restart(behind);
    cluster.restart(leader);
    let (new, _) = wait_new_leader(&mut cluster, 1, None).await;
    let mut log = cluster.node(new).client().await;
    let read = ReadRequest { shard_id: 1, from_seqno: seqno, to_seqno: seqno, max_bytes: 0, ..Default::default() };
    let readable = format!(
        "seqno {seqno}, acknowledged by nodes {leader} and {holder}, readable from node {new} \
         (if never: was node {behind}, which lacks it, promoted?)"
    );
    wait_until(&readable, Duration::from_secs(10), || {
        let mut log = log.clone();
        async move { log.read(read).await.is_ok() }
    })
    .await;
    let records = log.read(read).await.unwrap_or_else(|s| panic!("{readable}: {s}")).into_inner().records;
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].payload, Bytes::from_static(b"on-two"), "seqno {seqno} from node {new}");
    assert_ne!(new, behind, "the replica without seqno {seqno} was promoted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_frozen_past_the_failure_timeout_acknowledges_nothing_once_resumed() {
    let mut cluster = Cluster::start_with(3, 1, 1, FAST, None);
    let (old, _) = wait_new_leader(&mut cluster, 1, None).await;
    let mut log = cluster.node(old).client().await;
    let acked = Acked::default();
    for i in 0..5 {
        let payload = vec![Bytes::from(format!("before-{i}"))];
        common::append_and_record(&mut log, 1, payload, Durability::Quorum, Duration::from_secs(5), &acked)
            .await
            .unwrap();
    }

    cluster.signal(old, libc::SIGSTOP);
    let (new, _) = wait_new_leader(&mut cluster, 1, Some(old)).await;
    // Appends of every durability wait in the frozen leader's socket, and
    // more arrive the moment it resumes: none may be acknowledged.
    let levels = [Durability::Local, Durability::Quorum, Durability::All];
    let mut sent = Vec::new();
    for i in 0..12 {
        let mut log = log.clone();
        let durability = levels[i % 3];
        sent.push(tokio::spawn(async move {
            let request = AppendRequest {
                shard_id: 1,
                records: vec![AppendRecord { key: Bytes::new(), payload: Bytes::from(format!("frozen-{i}")) }],
                durability: durability as i32,
                ..Default::default()
            };
            let mut request = tonic::Request::new(request);
            request.set_timeout(Duration::from_secs(10));
            (durability, log.append(request).await)
        }));
    }
    // Give them time to reach the frozen leader's socket; one that has not
    // by then is sent after the resume, which must be refused all the same.
    tokio::time::sleep(Duration::from_millis(100)).await;
    cluster.signal(old, libc::SIGCONT);
    for i in 0..12 {
        let mut request = tonic::Request::new(AppendRequest {
            shard_id: 1,
            records: vec![AppendRecord { key: Bytes::new(), payload: Bytes::from(format!("resumed-{i}")) }],
            durability: Durability::Local as i32,
            ..Default::default()
        });
        request.set_timeout(Duration::from_secs(10));
        let outcome = log.append(request).await;
        assert!(outcome.is_err(), "the deposed leader acknowledged LOCAL append resumed-{i}: {outcome:?}");
    }
    for task in sent {
        let (durability, outcome) = task.await.unwrap();
        assert!(outcome.is_err(), "the deposed leader acknowledged a {durability:?} append: {outcome:?}");
    }

    // Nothing acknowledged before the freeze is lost on the new leader.
    let mut new_log = cluster.node(new).client().await;
    append(&mut new_log, 1, "after", Durability::Quorum).await;
    let expected = acked.lock().await.get(&1).cloned().unwrap();
    wait_until("the old leader follows the new one", WAIT, || {
        let status = futures::executor::block_on(cluster.status(old));
        async move { status.is_some_and(|s| entry(&s, 1)["role"] == "follower") }
    })
    .await;
    let newest = *expected.keys().last().unwrap();
    let records = common::read_all(&cluster.node(new).grpc.clone(), 1, newest).await;
    for (seqno, payload) in expected {
        assert_eq!(records[seqno as usize - 1].payload, payload, "seqno {seqno}");
    }
}

/// Both followers of shard 1 are paused (they refuse its shipments) while
/// their nodes keep answering the same leader's traffic for shard 2: shard
/// 1's lease lapses, so its leader acknowledges nothing, not even LOCAL, but
/// it does not step down (the nodes of a majority answer it) and the
/// coordinator does not fail it over (its followers still hear its node).
/// Resumed, they answer again and the same leadership acknowledges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_follower_nodes_still_answer_waits_instead_of_stepping_down() {
    let mut cluster = Cluster::start_with(3, 2, 1, FAST, None);
    let (leader, _) = wait_new_leader(&mut cluster, 1, None).await;
    let (other, _) = wait_new_leader(&mut cluster, 2, None).await;
    if other != leader {
        let target = format!(r#"{{"target": {leader}}}"#);
        let (code, body) = cluster.coord_post(1, "/v1/shards/2/failover", &target, Some(common::TOKEN)).await;
        assert_eq!(code, 200, "{body}");
        cluster.wait_node_leads(leader, 2, WAIT).await;
    }
    let (_, epoch) = cluster.leader_of(1, 1).await.unwrap();
    let mut log = cluster.node(leader).client().await;
    append(&mut log, 1, "before", Durability::Quorum).await;
    append(&mut log, 2, "before", Durability::Quorum).await;

    let followers: Vec<u32> = (1..=3).filter(|&n| n != leader).collect();
    for &f in &followers {
        common::pause_shard(&cluster.node(f).grpc, 1, true).await;
    }
    // Until the lapsed lease has been looked at twice (each look is where a
    // leader judged by its own shard's contact steps down): held both times.
    // Shard 2's QUORUM appends meanwhile prove the nodes still answer this
    // leader.
    let admin = cluster.node(leader).admin.clone();
    wait_until("the lapsed lease held twice for answering nodes", WAIT, || {
        let (mut log, admin) = (log.clone(), admin.clone());
        async move {
            append(&mut log, 2, "meanwhile", Durability::Quorum).await;
            common::metric(&admin, "walship_check_quorum_total{outcome=\"held\"}").await >= 2.0
        }
    })
    .await;
    let stepped = common::metric(&admin, "walship_check_quorum_total{outcome=\"stepped_down\"}").await;
    assert_eq!(stepped, 0.0, "a leader stepped down although its followers' nodes answered");
    let status = cluster.status(leader).await.unwrap();
    assert_eq!(entry(&status, 1)["role"], "leader", "{status}");
    assert_eq!(cluster.leader_of(1, 1).await, Some((leader, epoch)), "shard 1 was failed over");
    // Its lease lapsed: nothing is acknowledged, LOCAL included.
    let outcome = try_append(&mut log, 1, "lapsed", Durability::Local).await;
    assert!(outcome.is_err(), "a leader without its lease acknowledged a LOCAL append: {outcome:?}");

    for &f in &followers {
        common::pause_shard(&cluster.node(f).grpc, 1, false).await;
    }
    wait_until("the leader acknowledging again after its followers resumed", WAIT, || {
        let mut log = log.clone();
        async move { try_append(&mut log, 1, "after", Durability::Quorum).await.is_ok() }
    })
    .await;
    assert_eq!(cluster.leader_of(1, 1).await, Some((leader, epoch)), "the same leadership acknowledges again");
}
