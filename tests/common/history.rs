//! The history checker shared by the failover and partition suites: a QUORUM
//! load that follows the coordinator's leader and records every acknowledged
//! append (and when it was acknowledged), and the checks run once the
//! cluster is whole again: replicas converge, are byte-identical, and hold
//! every acknowledged record.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use walship_proto::log::Durability;
use walship_proto::log::log_client::LogClient;

use super::{Acked, Cluster, read_all, wait_until};

/// How long the history helpers wait for a condition before failing.
pub const WAIT: Duration = Duration::from_secs(40);

/// Replication settings of the failover and partition suites. Loss is
/// detected after 1 s of silence: quick enough for the tests, slow enough
/// that a loaded CI machine delaying heartbeats does not fail over a live
/// leader in the middle of a test that expects it to stay.
pub const FAST: &str = "heartbeat_ms = 50\nleader_timeout_ms = 1000\nkeepalive_ms = 100\nship_timeout_ms = 1000";

/// `leader_timeout_ms` of [`FAST`].
pub const FAST_LEADER_TIMEOUT: Duration = Duration::from_millis(1000);

/// A gRPC client on `grpc`, or `None` when it cannot connect within 300 ms.
pub async fn client(grpc: &str) -> Option<LogClient<tonic::transport::Channel>> {
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))
        .ok()?
        .connect_timeout(Duration::from_millis(300));
    Some(LogClient::new(endpoint.connect().await.ok()?))
}

/// When each acknowledgement of a load arrived, to measure how long the
/// shard had no writable leader.
#[derive(Clone, Default)]
pub struct AckTimes(Arc<std::sync::Mutex<Vec<Instant>>>);

impl AckTimes {
    fn record(&self) {
        self.0.lock().unwrap().push(Instant::now());
    }

    /// Acknowledgements in `[from, to)`.
    pub fn count_between(&self, from: Instant, to: Instant) -> usize {
        self.0.lock().unwrap().iter().filter(|&&t| t >= from && t < to).count()
    }

    /// The longest time in `[from, to]` without an acknowledgement: between
    /// consecutive ones, or from `from` to the first, or from the last to
    /// `to`. A window with none at all is one whole gap.
    pub fn longest_gap(&self, from: Instant, to: Instant) -> Duration {
        let times = self.0.lock().unwrap();
        let mut inside: Vec<Instant> = times.iter().copied().filter(|&t| t >= from && t <= to).collect();
        inside.sort();
        let mut previous = from;
        let mut longest = Duration::ZERO;
        for t in inside.into_iter().chain(std::iter::once(to)) {
            longest = longest.max(t - previous);
            previous = t;
        }
        longest
    }
}

/// Appends to `shard` at QUORUM through whichever node the coordinator
/// names as leader, until `stop`. Failed appends (leader died, fenced,
/// deadline) have an unknown outcome and are not recorded as acknowledged.
pub fn load(
    cluster_nodes: Vec<String>,
    coordinator_admin: String,
    shard: u32,
    acked: Acked,
    stop: Arc<AtomicBool>,
    count: Arc<AtomicU64>,
) -> tokio::task::JoinHandle<()> {
    load_timed(cluster_nodes, coordinator_admin, shard, acked, stop, count, AckTimes::default())
}

/// Like [`load`], recording when each acknowledgement arrived in `times`.
pub fn load_timed(
    cluster_nodes: Vec<String>,
    coordinator_admin: String,
    shard: u32,
    acked: Acked,
    stop: Arc<AtomicBool>,
    count: Arc<AtomicU64>,
    times: AckTimes,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut n = 0u64;
        let mut current: Option<(u32, LogClient<tonic::transport::Channel>)> = None;
        while !stop.load(Ordering::Relaxed) {
            if current.is_none() {
                // Bounded: a coordinator the test has cut off must not hang
                // the load past its stop.
                let url = format!("{coordinator_admin}/v1/shards/{shard}");
                let answer = tokio::time::timeout(Duration::from_secs(1), super::http_get(&url)).await;
                let leader = answer
                    .ok()
                    .filter(|(code, _)| *code == 200)
                    .and_then(|(_, body)| serde_json::from_str::<serde_json::Value>(&body).ok())
                    .and_then(|v| v["leader"].as_u64());
                if let Some(leader) = leader
                    && let Some(c) = client(&cluster_nodes[leader as usize - 1]).await
                {
                    current = Some((leader as u32, c));
                }
                if current.is_none() {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            }
            let (_, log) = current.as_mut().unwrap();
            let payloads: Vec<Bytes> = (0..1 + n % 3).map(|i| Bytes::from(format!("shard{shard}-n{n}-{i}"))).collect();
            n += 1;
            match super::append_and_record(log, shard, payloads, Durability::Quorum, Duration::from_secs(3), &acked)
                .await
            {
                Ok(()) => {
                    count.fetch_add(1, Ordering::Relaxed);
                    times.record();
                }
                Err(_) => current = None,
            }
        }
    })
}

/// Waits until `count` (the acknowledged appends a [`load`] counts) has
/// grown by `more` from now: the load flows (`what` names the wait).
pub async fn wait_for_more_appends(count: &Arc<AtomicU64>, more: u64, what: &str) {
    let target = count.load(Ordering::Relaxed) + more;
    wait_until(what, WAIT, || {
        let c = count.clone();
        async move { c.load(Ordering::Relaxed) >= target }
    })
    .await;
}

/// Waits until the coordinator names `node` leader of `shard` and the node
/// itself has taken the role.
pub async fn wait_leading(cluster: &mut Cluster, shard: u32, node: u32) {
    wait_until(&format!("shard {shard} led by node {node}"), WAIT, || {
        let recorded = futures::executor::block_on(cluster.leader_of(1, shard)).is_some_and(|(l, _)| l == node);
        let taken =
            futures::executor::block_on(cluster.status(node)).is_some_and(|s| entry(&s, shard)["role"] == "leader");
        async move { recorded && taken }
    })
    .await;
}

/// The `shards[]` entry of `shard` in a node's `/v1/status`.
pub fn entry(status: &serde_json::Value, shard: u32) -> serde_json::Value {
    status["shards"].as_array().and_then(|a| a.iter().find(|s| s["shard_id"] == shard).cloned()).unwrap_or_default()
}

/// Waits until every node holds the shard through the leader's last seqno,
/// knows it committed, and agrees on the leader; returns that seqno.
pub async fn converge(cluster: &mut Cluster, shard: u32) -> u64 {
    let mut last_seen = String::new();
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        if let Some((leader, epoch)) = cluster.leader_of(1, shard).await
            && let Some(ls) = cluster.status(leader).await
        {
            let l = entry(&ls, shard);
            let last = l["last_seqno"].as_u64().unwrap_or(0);
            let mut ok = l["role"] == "leader" && l["epoch"] == epoch && l["commit_seqno"] == last;
            for id in 1..=cluster.nodes.len() as u32 {
                let e = cluster.status(id).await.map(|s| entry(&s, shard)).unwrap_or_default();
                let good = e["durable_seqno"] == last
                    && e["commit_seqno"].as_u64().unwrap_or(0) >= last
                    && e["epoch"] == epoch;
                if !good {
                    last_seen = format!("node {id}: {e}");
                }
                ok &= good;
            }
            if ok {
                return last;
            }
        }
        assert!(std::time::Instant::now() < deadline, "shard {shard} did not converge: {last_seen}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every replica holds byte-identical records 1..=last, contiguous, and
/// every acknowledged record is there with its payload. Returns how many
/// acknowledged records were checked.
pub async fn check_history(cluster: &mut Cluster, shard: u32, last: u64, acked: &Acked) -> usize {
    let reference = read_all(&cluster.node(1).grpc.clone(), shard, last).await;
    assert_eq!(reference.len() as u64, last);
    for (i, r) in reference.iter().enumerate() {
        assert_eq!(r.seqno, i as u64 + 1, "contiguous seqnos");
    }
    for id in 2..=cluster.nodes.len() as u32 {
        let other = read_all(&cluster.node(id).grpc.clone(), shard, last).await;
        assert!(other == reference, "node {id} diverges from node 1 on shard {shard}");
    }
    let acked = acked.lock().await;
    let mine = acked.get(&shard).cloned().unwrap_or_default();
    for (seqno, payload) in &mine {
        assert!(*seqno <= last, "shard {shard}: acknowledged seqno {seqno} beyond the log's end {last}: LOST");
        assert_eq!(
            &reference[*seqno as usize - 1].payload,
            payload,
            "shard {shard}: acknowledged record {seqno} LOST or replaced"
        );
    }
    mine.len()
}
