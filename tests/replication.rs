//! Replication black-box tests: three real `walship node` processes on
//! loopback, RF=3. Every test waits on conditions with timeouts, never bare
//! sleeps, and checks invariants over what clients were told (acknowledged
//! appends) against what the replicas hold.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::{Cluster, read_all, wait_until};
use serde_json::Value;
use walship_proto::log::log_client::LogClient;
use walship_proto::log::{AppendRecord, AppendRequest, Durability, ReadRequest};

const WAIT: Duration = Duration::from_secs(30);

/// shard -> seqno -> payload, for every acknowledged append.
use common::Acked;

/// One record for shard 1 at `durability`.
fn one_record(payload: &'static [u8], durability: Durability) -> AppendRequest {
    AppendRequest {
        shard_id: 1,
        records: vec![AppendRecord { key: Bytes::new(), payload: Bytes::from_static(payload) }],
        durability: durability as i32,
        ..Default::default()
    }
}

fn shard_entry(status: &Value, shard: u32) -> Option<&Value> {
    status["shards"].as_array()?.iter().find(|s| s["shard_id"] == shard)
}

fn field(status: &Value, shard: u32, name: &str) -> u64 {
    shard_entry(status, shard).and_then(|s| s[name].as_u64()).unwrap_or(0)
}

fn follower(status: &Value, shard: u32, node: u32) -> Option<Value> {
    shard_entry(status, shard)?["followers"].as_array()?.iter().find(|f| f["node_id"] == node).cloned()
}

/// Clients appending to `shard` through `grpc` until `stop`; acks recorded.
/// A failed append (node down, deadline) ends that client: its outcome is
/// unknown, which is allowed.
fn load(
    grpc: String,
    shard: u32,
    clients: u32,
    durability: Durability,
    acked: Acked,
    stop: Arc<AtomicBool>,
    count: Arc<AtomicU64>,
) -> Vec<tokio::task::JoinHandle<u64>> {
    (0..clients)
        .map(|c| {
            let (grpc, acked, stop, count) = (grpc.clone(), acked.clone(), stop.clone(), count.clone());
            tokio::spawn(async move {
                let channel =
                    tonic::transport::Endpoint::from_shared(format!("http://{grpc}")).unwrap().connect().await.unwrap();
                let mut log = LogClient::new(channel);
                let mut n = 0u64;
                let mut failures = 0;
                while !stop.load(Ordering::Relaxed) {
                    let payloads: Vec<Bytes> = (0..1 + n % 3)
                        .map(|i| Bytes::from(format!("s{shard}-c{c}-n{n}-{i}-{}", "x".repeat((n % 50) as usize))))
                        .collect();
                    n += 1;
                    match common::append_and_record(
                        &mut log,
                        shard,
                        payloads,
                        durability,
                        Duration::from_secs(10),
                        &acked,
                    )
                    .await
                    {
                        Ok(()) => {
                            count.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(_) => {
                            failures += 1;
                            if failures > 3 {
                                break;
                            }
                        }
                    }
                }
                n
            })
        })
        .collect()
}

async fn wait_acks(count: &Arc<AtomicU64>, at_least: u64) {
    let c = count.clone();
    wait_until(&format!("{at_least} acknowledged appends"), WAIT, move || {
        let c = c.clone();
        async move { c.load(Ordering::Relaxed) >= at_least }
    })
    .await;
}

async fn stop_load(stop: &Arc<AtomicBool>, tasks: Vec<tokio::task::JoinHandle<u64>>) {
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
}

/// Waits until every node holds `shard` durable through the leader's last
/// seqno and knows it committed; returns that seqno.
async fn converge(cluster: &mut Cluster, shard: u32, leader: u32) -> u64 {
    let target = Arc::new(AtomicU64::new(0));
    let mut last_seen = String::new();
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let Some(ls) = cluster.status(leader).await else { panic!("leader {leader} status") };
        let last = field(&ls, shard, "last_seqno");
        let mut all = field(&ls, shard, "commit_seqno") == last && field(&ls, shard, "durable_seqno") == last;
        for id in 1..=cluster.nodes.len() as u32 {
            let s = cluster.status(id).await;
            let ok = s
                .as_ref()
                .is_some_and(|s| field(s, shard, "durable_seqno") == last && field(s, shard, "commit_seqno") >= last);
            all &= ok;
            if !ok {
                last_seen = format!("node {id}: {:?}", s.as_ref().and_then(|s| shard_entry(s, shard)));
            }
        }
        if all {
            target.store(last, Ordering::Relaxed);
            return last;
        }
        assert!(std::time::Instant::now() < deadline, "shard {shard} did not converge on {last}: {last_seen}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The value of one series (`name{labels}` exactly as exposed) on a node.
async fn metric(cluster: &mut Cluster, id: u32, series: &str) -> f64 {
    let body = common::http_get(&format!("{}/metrics", cluster.node(id).admin)).await.1;
    body.lines().find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok())).unwrap_or(0.0)
}

/// All replicas hold byte-identical records `1..=last` (seqno, epoch,
/// timestamp, key, payload and crc32), contiguous, and every acknowledged
/// record is among them with its payload.
async fn assert_identical(cluster: &mut Cluster, shard: u32, last: u64, acked: &Acked) {
    let reference = read_all(&cluster.node(1).grpc.clone(), shard, last).await;
    assert_eq!(reference.len() as u64, last, "node 1 holds 1..={last} of shard {shard}");
    for (i, r) in reference.iter().enumerate() {
        assert_eq!(r.seqno, 1 + i as u64, "contiguous seqnos");
    }
    for id in 2..=cluster.nodes.len() as u32 {
        let other = read_all(&cluster.node(id).grpc.clone(), shard, last).await;
        assert!(other == reference, "node {id} differs from node 1 on shard {shard}");
    }
    let acked = acked.lock().await;
    for (seqno, payload) in acked.get(&shard).into_iter().flatten() {
        assert!(*seqno <= last, "acknowledged seqno {seqno} beyond the log's end {last}");
        assert_eq!(&reference[*seqno as usize - 1].payload, payload, "acknowledged record {seqno}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorum_appends_leave_all_replicas_byte_identical() {
    let mut cluster = Cluster::start(3, 2, "");
    let acked: Acked = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let mut tasks =
        load(cluster.node(1).grpc.clone(), 1, 16, Durability::Quorum, acked.clone(), stop.clone(), count.clone());
    tasks.extend(load(
        cluster.node(2).grpc.clone(),
        2,
        16,
        Durability::Quorum,
        acked.clone(),
        stop.clone(),
        count.clone(),
    ));
    wait_acks(&count, 3_000).await;
    stop_load(&stop, tasks).await;
    for (shard, leader) in [(1, 1), (2, 2)] {
        let last = converge(&mut cluster, shard, leader).await;
        assert_identical(&mut cluster, shard, last, &acked).await;
        eprintln!("shard {shard}: {last} records identical on 3 replicas");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_follower_catches_up_and_lag_returns_to_zero() {
    let mut cluster = Cluster::start(3, 1, "keepalive_ms = 100");
    let acked: Acked = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let tasks =
        load(cluster.node(1).grpc.clone(), 1, 8, Durability::Quorum, acked.clone(), stop.clone(), count.clone());
    wait_acks(&count, 500).await;
    cluster.node(3).kill9();
    let at_kill = count.load(Ordering::Relaxed);
    // QUORUM keeps succeeding with one follower down.
    wait_acks(&count, at_kill + 1_000).await;
    stop_load(&stop, tasks).await;
    let leader_last = field(&cluster.status(1).await.unwrap(), 1, "last_seqno");
    cluster.restart(3);
    let last = converge(&mut cluster, 1, 1).await;
    assert_eq!(last, leader_last);
    assert_identical(&mut cluster, 1, last, &acked).await;
    // What it missed came by the catch-up stream it pulls at boot, or by the
    // leader's pushes, whichever reached it first (the streaming pushes
    // often win; a follower far behind always pulls, see
    // `paused_follower_lag_grows_in_all_units_then_returns_to_zero`)...
    let streamed = metric(&mut cluster, 3, "walship_catchup_bytes_total{source=\"stream\"}").await;
    let pushed = metric(&mut cluster, 3, "walship_catchup_bytes_total{source=\"push\"}").await;
    assert!(streamed + pushed > 0.0, "node 3 applied nothing, neither pulled nor pushed");
    // ...and live push carries what comes afterwards.
    let mut leader = cluster.node(1).client().await;
    let after = leader.append(one_record(b"after", Durability::All)).await.unwrap().into_inner();
    assert_eq!(after.first_seqno, last + 1);
    assert!(metric(&mut cluster, 3, "walship_catchup_bytes_total{source=\"push\"}").await > pushed);
    assert_eq!(
        metric(&mut cluster, 3, "walship_catchup_bytes_total{source=\"stream\"}").await,
        streamed,
        "no second stream needed"
    );
    // Lag back to zero in every unit, and it stays zero while idle.
    let mut zero_checks = 0;
    wait_until("follower 3's lag to read zero 10 times in a row", WAIT, || {
        let f = futures::executor::block_on(cluster.status(1)).and_then(|s| follower(&s, 1, 3));
        let zero = f.is_some_and(|f| {
            f["lag_records"] == 0
                && f["lag_bytes"] == 0
                && f["lag_flush_seconds"] == 0.0
                && f["lag_write_seconds"] == 0.0
        });
        zero_checks = if zero { zero_checks + 1 } else { 0 };
        async move { zero_checks >= 10 }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_leader_keeps_every_acknowledged_record() {
    let mut cluster = Cluster::start(3, 1, "");
    let acked: Acked = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let tasks =
        load(cluster.node(1).grpc.clone(), 1, 16, Durability::Quorum, acked.clone(), stop.clone(), count.clone());
    wait_acks(&count, 2_000).await;
    cluster.node(1).kill9();
    stop_load(&stop, tasks).await;
    let max_acked = acked.lock().await[&1].keys().next_back().copied().unwrap();
    // Before the leader returns: every acknowledged record is durable on at
    // least one follower, which with the dead leader's copy is a majority.
    let mut follower_durable = Vec::new();
    for id in [2, 3] {
        follower_durable.push(field(&cluster.status(id).await.unwrap(), 1, "durable_seqno"));
    }
    let best = *follower_durable.iter().max().unwrap();
    assert!(best >= max_acked, "followers hold {follower_durable:?}, acknowledged through {max_acked}");
    cluster.restart(1);
    let leader_durable = field(&cluster.status(1).await.unwrap(), 1, "durable_seqno");
    assert!(leader_durable >= max_acked, "restarted leader holds {leader_durable} < {max_acked} acknowledged");
    let last = converge(&mut cluster, 1, 1).await;
    assert_identical(&mut cluster, 1, last, &acked).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_follower_lag_grows_in_all_units_then_returns_to_zero() {
    // A low catch-up threshold: once resumed, the follower is too far behind
    // for push and must pull.
    let mut cluster =
        Cluster::start(3, 1, "keepalive_ms = 100\nship_timeout_ms = 1000\ncatchup_threshold_bytes = 20000");
    let acked: Acked = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let tasks =
        load(cluster.node(1).grpc.clone(), 1, 4, Durability::Quorum, acked.clone(), stop.clone(), count.clone());
    wait_acks(&count, 200).await;
    cluster.signal(3, libc::SIGSTOP);
    let lag = |cluster: &mut Cluster| {
        let f = futures::executor::block_on(cluster.status(1)).and_then(|s| follower(&s, 1, 3)).unwrap();
        (f["lag_records"].as_u64().unwrap(), f["lag_bytes"].as_u64().unwrap(), f["lag_flush_seconds"].as_f64().unwrap())
    };
    let mut first = None;
    wait_until("lag of the paused follower to grow in records, bytes and seconds", WAIT, || {
        let now = lag(&mut cluster);
        let grown = match first {
            None => {
                if now.0 > 0 {
                    first = Some(now);
                }
                false
            }
            Some(f) => now.0 > f.0 && now.1 > f.1 && now.2 > f.2 && now.2 > 0.5,
        };
        async move { grown }
    })
    .await;
    let appended_while_paused = count.load(Ordering::Relaxed);
    wait_acks(&count, appended_while_paused + 100).await;
    cluster.signal(3, libc::SIGCONT);
    stop_load(&stop, tasks).await;
    let last = converge(&mut cluster, 1, 1).await;
    wait_until("paused follower's lag back to zero", WAIT, || {
        let zero = lag(&mut cluster) == (0, 0, 0.0);
        async move { zero }
    })
    .await;
    assert!(
        metric(&mut cluster, 3, "walship_catchup_bytes_total{source=\"stream\"}").await > 0.0,
        "a follower far past the threshold pulls with StreamSegments"
    );
    assert!(metric(&mut cluster, 1, "walship_catchup_served_bytes_total").await > 0.0);
    let mode = follower(&cluster.status(1).await.unwrap(), 1, 3).unwrap()["mode"].clone();
    assert_eq!(mode, "push", "back to push once caught up");
    assert_identical(&mut cluster, 1, last, &acked).await;
}

/// The client's deadline passed (tonic's server answers an expired
/// `grpc-timeout` with CANCELLED, the client's own timer with
/// DEADLINE_EXCEEDED).
fn assert_timed_out(status: tonic::Status) {
    assert!(matches!(status.code(), tonic::Code::DeadlineExceeded | tonic::Code::Cancelled), "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_waits_for_every_replica_and_local_waits_for_none() {
    let mut cluster = Cluster::start(3, 1, "keepalive_ms = 100");
    let mut client = cluster.node(1).client().await;
    let append = |durability: Durability, text: &str| AppendRequest {
        shard_id: 1,
        records: vec![AppendRecord { key: Bytes::new(), payload: Bytes::from(text.to_string()) }],
        durability: durability as i32,
        ..Default::default()
    };
    client.append(append(Durability::All, "all-up")).await.unwrap();
    cluster.node(3).kill9();

    // ALL blocks while node 3 is down...
    let mut all_client = client.clone();
    let pending_all = tokio::spawn(async move { all_client.append(append(Durability::All, "all-pending")).await });
    // ...while QUORUM and LOCAL appends issued after it complete.
    for i in 0..20 {
        client.append(append(Durability::Quorum, &format!("q{i}"))).await.unwrap();
        client.append(append(Durability::Local, &format!("l{i}"))).await.unwrap();
    }
    assert!(!pending_all.is_finished(), "ALL completed with a replica down");
    let mut bounded = tonic::Request::new(append(Durability::All, "all-deadline"));
    bounded.set_timeout(Duration::from_millis(500));
    assert_timed_out(client.append(bounded).await.unwrap_err());

    // ...and completes when it returns.
    cluster.restart(3);
    let done = tokio::time::timeout(WAIT, pending_all).await.expect("ALL completes once the replica is back");
    let r = done.unwrap().unwrap().into_inner();
    let durable3 = field(&cluster.status(3).await.unwrap(), 1, "durable_seqno");
    assert!(durable3 >= r.last_seqno, "ALL acknowledged {} but node 3 holds {durable3}", r.last_seqno);

    // LOCAL never waits for followers: both down, it still succeeds, QUORUM cannot.
    cluster.node(2).kill9();
    cluster.node(3).kill9();
    let local = client.append(append(Durability::Local, "local-alone")).await.unwrap().into_inner();
    assert!(local.last_seqno > r.last_seqno);
    let mut quorum = tonic::Request::new(append(Durability::Quorum, "quorum-alone"));
    quorum.set_timeout(Duration::from_millis(500));
    assert_timed_out(client.append(quorum).await.unwrap_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn followers_refuse_appends_naming_the_leader_and_serve_committed_reads() {
    let mut cluster = Cluster::start(3, 1, "keepalive_ms = 100");
    let mut follower = cluster.node(2).client().await;
    let request = one_record(b"x", Durability::Unspecified);
    let refused = follower.append(request.clone()).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    let hint = refused.metadata().get(walship_proto::LEADER_METADATA_KEY).unwrap().to_str().unwrap().to_string();
    assert_eq!(hint, format!("1@{}", cluster.node(1).grpc));
    assert!(refused.message().contains("leader"), "{}", refused.message());
    assert_eq!(field(&cluster.status(2).await.unwrap(), 1, "last_seqno"), 0, "the refused append changed nothing");

    // The hint leads to a leader that accepts; the follower then serves the
    // committed record.
    let mut leader = cluster.node(1).client().await;
    let r = leader.append(request).await.unwrap().into_inner();
    wait_until("follower to serve the committed record", WAIT, || {
        let mut f = follower.clone();
        async move {
            f.read(ReadRequest {
                shard_id: 1,
                from_seqno: r.first_seqno,
                to_seqno: 0,
                max_bytes: 0,
                ..Default::default()
            })
            .await
            .is_ok_and(|resp| resp.into_inner().records.first().is_some_and(|rec| &rec.payload[..] == b"x"))
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_reach_the_configured_receiver() {
    let mut cluster = Cluster::start(3, 2, "heartbeat_ms = 100");
    let mut client = cluster.node(1).client().await;
    let request = one_record(b"hb", Durability::All);
    client.append(request).await.unwrap();
    // Node 1 is the receiver: it sees every node's report for every shard,
    // with positions and, from the leader, per-follower lag.
    wait_until("heartbeats from all 3 nodes for both shards, showing seqno 1", WAIT, || {
        let status = futures::executor::block_on(cluster.status(1));
        let ok = status.is_some_and(|s| {
            let hbs = s["heartbeats_received"].as_array().cloned().unwrap_or_default();
            let from =
                |node: u64, shard: u64| hbs.iter().find(|h| h["node_id"] == node && h["shard_id"] == shard).cloned();
            (1..=3).all(|n| (1..=2).all(|sh| from(n, sh).is_some()))
                && (1..=3).all(|n| from(n, 1).is_some_and(|h| h["durable_seqno"] == 1 && h["entity_count"] == 1))
                && from(1, 1).is_some_and(|h| h["replication_lag"].as_object().is_some_and(|m| m.len() == 2))
        });
        async move { ok }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_holds_for_a_lagging_follower_up_to_the_bound_then_marks_it_for_reseed() {
    // Readers keep ~20 KB; a lagging follower is waited for up to ~200 KB.
    let mut cluster = Cluster::start(
        3,
        1,
        "retain_bytes = 20000\nmax_retain_bytes = 200000\nretention_interval_ms = 100\nkeepalive_ms = 100\nship_timeout_ms = 1000",
    );
    let mut leader = cluster.node(1).client().await;
    let append = |n: usize| AppendRequest {
        shard_id: 1,
        records: (0..n)
            .map(|i| AppendRecord { key: Bytes::new(), payload: Bytes::from(format!("{i:0>100}")) })
            .collect(),
        durability: Durability::Quorum as i32,
        ..Default::default()
    };
    leader.append(append(100)).await.unwrap();
    converge(&mut cluster, 1, 1).await;
    cluster.node(3).kill9();
    // ~136 B frames: 600 more records (~80 KB) is past what readers keep but
    // within the bound, so the leader must keep everything node 3 lacks.
    for _ in 0..6 {
        leader.append(append(100)).await.unwrap();
    }
    wait_until("node 2 (caught up) to compact its own copy past what readers keep", WAIT, || {
        let s = futures::executor::block_on(cluster.status(2));
        let first = s.map_or(0, |s| field(&s, 1, "first_seqno"));
        async move { first > 100 }
    })
    .await;
    wait_until("leader to compact up to what node 3 still needs, and no further", WAIT, || {
        let s = futures::executor::block_on(cluster.status(1)).unwrap();
        let first = field(&s, 1, "first_seqno");
        // What the leader last heard node 3 hold (its reply may have been in
        // flight when it was killed, so up to the 100 it had).
        let acked = follower(&s, 1, 3).and_then(|f| f["acked_seqno"].as_u64()).unwrap_or(0);
        assert!(first <= acked + 1, "leader discarded records node 3 needs: first_seqno {first}, node 3 acked {acked}");
        async move { acked > 0 && first == acked + 1 }
    })
    .await;
    // Node 3 comes back within the bound and catches up from the leader.
    cluster.restart(3);
    let last = converge(&mut cluster, 1, 1).await;
    assert_eq!(last, 700);

    // Now past the bound: node 3 down while ~400 KB are appended.
    cluster.node(3).kill9();
    for _ in 0..30 {
        leader.append(append(100)).await.unwrap();
    }
    wait_until("leader to mark node 3 as needing a re-seed and compact past it", WAIT, || {
        let s = futures::executor::block_on(cluster.status(1));
        let ok = s.is_some_and(|s| {
            follower(&s, 1, 3).is_some_and(|f| f["mode"] == "needs_reseed") && field(&s, 1, "first_seqno") > 701
        });
        async move { ok }
    })
    .await;
    // The quorum still works, and node 3's catch-up is refused (it needs
    // records no longer retained) rather than served a gap.
    leader.append(append(1)).await.unwrap();
    cluster.restart(3);
    wait_until("node 3's catch-up to be refused as needing a re-seed", WAIT, || {
        let refused =
            futures::executor::block_on(metric(&mut cluster, 1, "walship_ship_refused_total{reason=\"needs_reseed\"}"));
        async move { refused > 0.0 }
    })
    .await;
    let s3 = cluster.status(3).await.unwrap();
    assert_eq!(field(&s3, 1, "durable_seqno"), 700, "nothing was applied to node 3 across the gap");
    let f = follower(&cluster.status(1).await.unwrap(), 1, 3).unwrap();
    assert_eq!(f["mode"], "needs_reseed");
}

/// A segment that arrives again while the follower's first copy of it is
/// still being made durable (after a failover, a catch-up chunk and a push
/// race over the same records) is answered once that copy is durable, so
/// the answer covers the segment. Answered at once with the older durable
/// position, it left the new leader's first commit waiting for the next
/// keepalive (the bimodal failover times of issue 6).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_segment_sent_twice_is_answered_with_its_durable_end_both_times() {
    use walship_proto::replication::wal_shipping_client::WalShippingClient;
    use walship_proto::replication::{ShipSegmentRequest, WalSegmentId};
    use walship_wal::{Frame, RecordFields, Segment};

    let mut cluster = Cluster::start(3, 1, "keepalive_ms = 100");
    let mut leader = cluster.node(1).client().await;
    leader.append(one_record(b"first", Durability::All)).await.unwrap();
    // 4 MiB of records after the leader's log, sent as the leader (node 1,
    // epoch 1) twice at once: the second finds the first queued, and its
    // fsync takes long enough for the race to show every time.
    const COUNT: u64 = 1024;
    let frames: Vec<Frame> = (2..2 + COUNT)
        .map(|seqno| {
            Frame::encode(RecordFields { seqno, epoch: 1, timestamp_us: seqno, key: b"k", payload: &[0xA5; 4096] })
        })
        .collect();
    let segment = Segment::encode(1, frames).unwrap();
    let last = 1 + COUNT;
    let request = ShipSegmentRequest {
        id: Some(WalSegmentId { region_id: 1, shard_id: 1, seqno: 2 }),
        payload: segment.encoded().clone(),
        event_count: COUNT,
        leader_last_seq: last,
        stream_baseline: 0,
        epoch: 1,
        leader_node_id: 1,
        commit_seqno: 1,
        archived_seqno: 0,
        archiver_node_id: 0,
    };
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", cluster.node(2).grpc))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let client = WalShippingClient::new(common::as_member(channel)).max_encoding_message_size(64 << 20);
    let (mut first, mut second) = (client.clone(), client);
    let (a, b) = tokio::join!(first.ship_segment(request.clone()), second.ship_segment(request));
    for (which, answer) in [("one", a), ("the other", b)] {
        let answer = answer.unwrap_or_else(|s| panic!("{which} of the two sends refused: {s:?}")).into_inner();
        assert!(answer.accepted, "{which}: {answer:?}");
        assert_eq!(answer.applied_seqno, last, "{which} of the two sends answered before its records were durable");
    }
}

/// A client's open `Tail` of an idle shard and its open, idle
/// `AppendStream` do not keep a node from stopping on SIGTERM (its gRPC
/// server waits for every open stream); the tail ends saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_stops_on_sigterm_with_a_tail_and_an_append_stream_open() {
    use tokio_stream::StreamExt;
    let dir = tempfile::tempdir().unwrap();
    let mut node = common::NodeProcess::start(1, dir.path(), "1", &[]);
    node.wait_healthy().await;
    let mut client = node.client().await;
    client.append(one_record(b"before", Durability::Local)).await.unwrap();
    let mut tail =
        client.tail(walship_proto::log::TailRequest { shard_id: 1, from_seqno: 1 }).await.unwrap().into_inner();
    assert_eq!(tail.next().await.unwrap().unwrap().records.len(), 1, "the tail reads the one record");
    // An append stream with nothing sent: the client keeps its side open.
    let (_keep_open, requests) = tokio::sync::mpsc::channel::<walship_proto::log::AppendStreamRequest>(1);
    let _appends = client.append_stream(tokio_stream::wrappers::ReceiverStream::new(requests)).await.unwrap();
    node.stop_on_sigterm(Duration::from_secs(10)).await;
    let ended = tail.next().await.expect("the tail ends with a status").unwrap_err();
    assert_eq!(ended.code(), tonic::Code::Unavailable, "{ended:?}");
}

/// A follower holds its leader's ship stream (`ShipBatches`) open for as long as
/// the leader ships; SIGTERM must still stop it promptly (its gRPC server's
/// graceful shutdown waits for every open stream), and the leader after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_stop_on_sigterm_while_their_leader_ships_to_them() {
    let mut cluster = Cluster::start(3, 1, "");
    let mut leader = cluster.node(1).client().await;
    for _ in 0..20 {
        leader.append(one_record(b"shipped", Durability::All)).await.unwrap();
    }
    for id in [2, 1] {
        cluster.node(id).stop_on_sigterm(Duration::from_secs(5)).await;
    }
}
