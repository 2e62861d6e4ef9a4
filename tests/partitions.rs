//! Network-partition black-box tests: a 3-node cluster and one coordinator,
//! each a real process running as a Unix user of its own, with links cut
//! and healed by nftables on loopback (`common::partition`). Each case runs a
//! QUORUM load through the coordinator's leader, holds a partition for a few
//! seconds, heals it, and checks the recorded history: nothing acknowledged
//! is lost, the replicas end byte-identical, and failovers happen exactly
//! where the case says. Each prints how long the shard had no writable
//! leader (the longest gap between consecutive acknowledgements) and how
//! many failovers it saw. Needs root and `nft` (`ops/install.sh`).
//!
//! Some targets here (a leader cut off from its followers loses leadership
//! within about a second; a leader without a majority acknowledges nothing
//! more) need the coordinator to hear followers' view of their leader and
//! the leader to step down without a majority (CheckQuorum).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::history::{
    AckTimes, FAST, FAST_LEADER_TIMEOUT, WAIT, check_history, client, converge, load_timed, wait_leading,
};
use common::partition::{Partition, Party};
use common::{Acked, Cluster, ClusterSpec, read_all, wait_until};
use walship_proto::log::{AppendRecord, AppendRequest, Durability};

/// The longest a shard may go without a writable leader when a majority
/// can still form: a second to notice the loss, the failover itself, and
/// slack for a loaded 2-core CI machine.
const GAP_BOUND: Duration = Duration::from_millis(3 * FAST_LEADER_TIMEOUT.as_millis() as u64);
/// How long a partition is held: long enough for a failover at the target
/// (about one leader timeout) and well within the gap bound.
const CUT: Duration = Duration::from_secs(4);
/// Load workers: enough to keep the leader busy, few enough for 2 cores.
const WORKERS: usize = 4;

/// A running cluster under load, with its partition helper.
struct Scenario {
    cluster: Cluster,
    partition: Partition,
    acked: Acked,
    stop: Arc<AtomicBool>,
    count: Arc<AtomicU64>,
    times: AckTimes,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// The epoch before any cut.
    epoch0: u64,
    /// When the first cut was made.
    cut_at: Option<Instant>,
}

/// What [`Scenario::hold`] saw while it held a partition.
#[derive(Debug, Default)]
struct Held {
    /// When the coordinator was first seen to record a newer epoch.
    failover_seen_at: Option<Instant>,
    /// `GET /v1/cluster` once counted every shard led while node 1 was not
    /// alive to the coordinator (its followers vouching for it).
    led_while_node_1_unheard: bool,
}

impl Scenario {
    /// Launches the cluster, waits for node 1 to lead shard 1 and for the
    /// load to be flowing.
    async fn start() -> Scenario {
        let mut cluster = Cluster::launch(&ClusterSpec {
            coordinators: 1,
            replication: FAST,
            separate_users: true,
            ..ClusterSpec::default()
        });
        wait_leading(&mut cluster, 1, 1).await;
        let partition = Partition::new(&cluster);
        let nodes: Vec<String> = cluster.nodes.iter().map(|n| n.grpc.clone()).collect();
        let admin = cluster.coordinator(1).admin.clone();
        let (acked, stop, count, times) = (Acked::default(), Arc::default(), Arc::default(), AckTimes::default());
        let tasks = (0..WORKERS)
            .map(|_| {
                let (acked, stop, count, times) =
                    (Arc::clone(&acked), Arc::clone(&stop), Arc::clone(&count), times.clone());
                load_timed(nodes.clone(), admin.clone(), 1, acked, stop, count, times)
            })
            .collect();
        let (_, epoch0) = cluster.leader_of(1, 1).await.expect("a recorded leader");
        let scenario = Scenario { cluster, partition, acked, stop, count, times, tasks, epoch0, cut_at: None };
        scenario.wait_for_acks("the load to flow before any cut", 50).await;
        scenario
    }

    async fn wait_for_acks(&self, what: &str, n: u64) {
        let before = self.count.load(Ordering::Relaxed);
        let count = Arc::clone(&self.count);
        wait_until(what, WAIT, || {
            let count = Arc::clone(&count);
            async move { count.load(Ordering::Relaxed) >= before + n }
        })
        .await;
    }

    /// Records the moment of the first cut; call right after cutting.
    fn mark_cut(&mut self) -> Instant {
        let now = Instant::now();
        self.cut_at.get_or_insert(now);
        eprintln!("cut: {}", self.partition.describe());
        now
    }

    /// Holds the current partition for `duration` (a load phase), watching
    /// the coordinator's record of the shard for a new epoch.
    async fn hold(&mut self, duration: Duration) -> Held {
        let mut held = Held::default();
        let end = Instant::now() + duration;
        while Instant::now() < end {
            let answer = tokio::time::timeout(Duration::from_millis(500), self.cluster.leader_of(1, 1)).await;
            if let Ok(Some((_, epoch))) = answer
                && epoch > self.epoch0
            {
                held.failover_seen_at.get_or_insert_with(Instant::now);
            }
            let (_, view) = self.cluster.coord_get(1, "/v1/cluster").await;
            let node_1_alive =
                view["nodes"].as_array().and_then(|n| n.iter().find(|n| n["node_id"] == 1)).map(|n| n["alive"].clone());
            if node_1_alive == Some(serde_json::Value::Bool(false)) && view["shards_leading"] == view["shards"] {
                held.led_while_node_1_unheard = true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        held
    }

    /// The epoch the coordinator records now.
    async fn epoch(&mut self) -> u64 {
        self.cluster.leader_of(1, 1).await.expect("the coordinator records shard 1").1
    }

    /// Heals everything, waits for appends to flow again, stops the load,
    /// waits for the replicas to converge and checks the history.
    async fn heal_and_check(mut self, case: &str) -> Report {
        self.partition.heal_all();
        let healed_at = Instant::now();
        eprintln!("{case}: healed");
        self.wait_for_acks("appends to flow after the heal", 20).await;
        self.stop.store(true, Ordering::Relaxed);
        for task in std::mem::take(&mut self.tasks) {
            task.await.unwrap();
        }
        let stopped_at = Instant::now();
        let last = converge(&mut self.cluster, 1).await;
        let acknowledged = check_history(&mut self.cluster, 1, last, &self.acked).await;
        let (leader, epoch) = self.cluster.leader_of(1, 1).await.unwrap();
        let cut_at = self.cut_at.expect("the case cut something");
        let report = Report {
            gap: self.times.longest_gap(cut_at, stopped_at),
            acks_while_cut: self.times.count_between(cut_at, healed_at),
            failovers: epoch - self.epoch0,
            failovers_metric: failovers_metric(&self.cluster.coordinator(1).admin.clone()).await,
            leader,
            last,
            cluster: self.cluster,
        };
        eprintln!(
            "{case}: longest time without an acknowledgement {:?} (bound {GAP_BOUND:?}); {} acknowledged while cut; \
             {} failover(s) (epoch {} -> {epoch}, coordinator metric {}); node {leader} leads; {acknowledged} \
             acknowledged records all present; replicas identical through {last}",
            report.gap, report.acks_while_cut, report.failovers, self.epoch0, report.failovers_metric,
        );
        report
    }
}

/// What a case measured once healed and checked.
struct Report {
    gap: Duration,
    acks_while_cut: usize,
    failovers: u64,
    failovers_metric: u64,
    leader: u32,
    last: u64,
    cluster: Cluster,
}

impl Report {
    /// The assertions of a case whose partition leaves a majority, and the
    /// leader, able to serve: no failover, appends went on.
    fn assert_no_failover_and_writable(&self, case: &str) {
        assert_eq!(self.failovers, 0, "{case}: the epoch changed: no failover was called for");
        assert_eq!(self.leader, 1, "{case}: leadership moved");
        assert!(
            self.acks_while_cut >= 20,
            "{case}: only {} QUORUM appends acknowledged while cut",
            self.acks_while_cut
        );
        assert!(self.gap < GAP_BOUND, "{case}: no acknowledgement for {:?} (bound {GAP_BOUND:?})", self.gap);
    }
}

/// `walship_failovers_total{outcome="ok"}` summed over reasons.
async fn failovers_metric(admin: &str) -> u64 {
    let body = common::http_get(&format!("{admin}/metrics")).await.1;
    body.lines()
        .filter(|l| l.starts_with("walship_failovers_total{") && l.contains("outcome=\"ok\""))
        .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .map(|n| n as u64)
        .sum()
}

fn followers_of_1() -> [(Party, Party); 2] {
    [(Party::Node(1), Party::Node(2)), (Party::Node(1), Party::Node(3))]
}

/// A LOCAL append sent straight to one node during a cut, and its answer.
#[derive(Debug)]
struct LocalAppend {
    payload: String,
    sent_at: Instant,
    /// Epoch and seqno when acknowledged.
    acknowledged: Option<(u64, u64)>,
}

/// Sends LOCAL appends one after another to the node at `grpc`, on a
/// connection made before the cut, until `stop`.
fn local_appends(grpc: String, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<Vec<LocalAppend>> {
    tokio::spawn(async move {
        let mut log = client(&grpc).await.expect("connect to the old leader");
        let mut sent = Vec::new();
        let mut i = 0;
        while !stop.load(Ordering::Relaxed) {
            let payload = format!("local-to-old-leader-{i}");
            i += 1;
            let records = vec![AppendRecord { key: Bytes::new(), payload: Bytes::from(payload.clone()) }];
            let mut request = tonic::Request::new(AppendRequest {
                shard_id: 1,
                records,
                durability: Durability::Local as i32,
                ..Default::default()
            });
            request.set_timeout(Duration::from_millis(500));
            let sent_at = Instant::now();
            let acknowledged = log.append(request).await.ok().map(|r| {
                let r = r.into_inner();
                (r.epoch, r.first_seqno)
            });
            sent.push(LocalAppend { payload, sent_at, acknowledged });
            // Paced, so a refusing node is not spun on.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        sent
    })
}

/// (a) The leader cut off from both followers, still reaching the
/// coordinator and the clients. Targets: a new leader acknowledges QUORUM
/// appends within about a leader timeout (asserted: within [`GAP_BOUND`]);
/// the old leader acknowledges no LOCAL append sent after it lost its
/// majority. "Lost": at the latest once the coordinator recorded a new
/// epoch, and by CheckQuorum within one leader timeout of the cut (allowed
/// twice that on a loaded machine). Its LOCAL records acknowledged in the
/// old epoch during the cut never reached a follower, so none of them may
/// be in the final log (the old leader's tail is truncated on rejoin).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_cut_from_both_followers_loses_leadership_within_a_timeout() {
    let case = "(a) leader <-> both followers";
    let mut s = Scenario::start().await;
    let old_leader_grpc = s.cluster.node(1).grpc.clone();
    for (a, b) in followers_of_1() {
        s.partition.cut(a, b);
    }
    let cut_at = s.mark_cut();
    let local_stop = Arc::new(AtomicBool::new(false));
    let locals = local_appends(old_leader_grpc, Arc::clone(&local_stop));
    let held = s.hold(CUT).await;
    local_stop.store(true, Ordering::Relaxed);
    let locals = locals.await.unwrap();
    let epoch0 = s.epoch0;
    let report = s.heal_and_check(case).await;

    let acked_locals: Vec<&LocalAppend> = locals.iter().filter(|l| l.acknowledged.is_some()).collect();
    let last_acked_sent = acked_locals.iter().map(|l| l.sent_at - cut_at).max();
    let failover_after = held.failover_seen_at.map(|t| t - cut_at);
    eprintln!(
        "{case}: failover seen {failover_after:?} after the cut; old leader acknowledged {} of {} LOCAL appends \
         sent to it while cut, the last sent {last_acked_sent:?} after the cut",
        acked_locals.len(),
        locals.len()
    );

    assert!(
        report.failovers >= 1 && held.failover_seen_at.is_some(),
        "{case}: no failover while the leader could reach neither follower for {CUT:?}"
    );
    assert_ne!(report.leader, 1, "{case}: the cut-off node leads again");
    assert!(report.gap < GAP_BOUND, "{case}: no writable leader for {:?} (bound {GAP_BOUND:?})", report.gap);
    let failover_seen_at = held.failover_seen_at.unwrap();
    for l in &acked_locals {
        assert!(
            l.sent_at < failover_seen_at,
            "{case}: the deposed leader acknowledged {} ({:?}), sent {:?} after the coordinator had recorded a new epoch",
            l.payload,
            l.acknowledged,
            l.sent_at - failover_seen_at
        );
        assert!(
            l.sent_at - cut_at < 2 * FAST_LEADER_TIMEOUT,
            "{case}: the leader without a majority still acknowledged {} sent {:?} after the cut (CheckQuorum \
             target: it steps down within {FAST_LEADER_TIMEOUT:?})",
            l.payload,
            l.sent_at - cut_at
        );
    }
    // The old leader was deposed (asserted above): none of its old-epoch
    // LOCAL records reached a follower, so none may be in the new history.
    let final_log = read_all(&report.cluster.nodes[report.leader as usize - 1].grpc, 1, report.last).await;
    for l in acked_locals.iter().filter(|l| l.acknowledged.is_some_and(|(epoch, _)| epoch == epoch0)) {
        assert!(
            final_log.iter().all(|r| r.payload != l.payload.as_bytes()),
            "{case}: {} was acknowledged by the cut-off leader in epoch {epoch0} yet is in the final log",
            l.payload
        );
    }
}

/// (b) The leader cut off from the coordinator only: it still reaches its
/// followers. The coordinator may fail the shard over (it no longer hears
/// the leader); either way nothing acknowledged is lost and the shard stays
/// writable within [`GAP_BOUND`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_cut_from_the_coordinator_loses_nothing() {
    let case = "(b) leader <-> coordinator";
    let mut s = Scenario::start().await;
    s.partition.cut(Party::Node(1), Party::Coordinator(1));
    s.mark_cut();
    let held = s.hold(CUT).await;
    // The coordinator cannot hear the leader, its followers can: the
    // cluster view counts the shard as led, as the coordinator acts on it.
    assert!(
        held.failover_seen_at.is_some() || held.led_while_node_1_unheard,
        "{case}: /v1/cluster never counted shard 1 led while node 1 was unheard and nothing failed over"
    );
    let report = s.heal_and_check(case).await;
    assert!(report.failovers <= 1, "{case}: {} failovers for one cut", report.failovers);
    assert!(report.gap < GAP_BOUND, "{case}: no writable leader for {:?} (bound {GAP_BOUND:?})", report.gap);
}

/// (c) One follower cut off from the leader only: the leader and the other
/// follower are a majority, so there is no failover and QUORUM appends go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_cut_from_the_leader_changes_nothing() {
    no_failover_case("(c) follower <-> leader", |p| p.cut(Party::Node(1), Party::Node(3))).await;
}

/// (d) One follower cut off from everyone (nodes, coordinator, clients):
/// no failover, QUORUM appends go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follower_isolated_from_everyone_changes_nothing() {
    no_failover_case("(d) follower <-> everyone", |p| p.isolate(Party::Node(3))).await;
}

/// (e) The coordinator cut off from every node (the test still reads it):
/// the nodes need it only for failovers, so appends go on, and when it
/// hears them again it must not take the silence for a lost leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coordinator_cut_from_every_node_changes_nothing() {
    no_failover_case("(e) coordinator <-> every node", |p| {
        for id in 1..=3 {
            p.cut(Party::Coordinator(1), Party::Node(id));
        }
    })
    .await;
}

/// A partition after which the leader and a majority still reach each
/// other (`cut` makes it): nothing may fail over during the cut or after
/// the heal, and QUORUM appends go on throughout.
async fn no_failover_case(case: &str, cut: impl FnOnce(&mut Partition)) {
    let mut s = Scenario::start().await;
    cut(&mut s.partition);
    s.mark_cut();
    let held = s.hold(CUT).await;
    assert_eq!(held.failover_seen_at, None, "{case}: the coordinator recorded a new epoch during the cut");
    assert_eq!(s.epoch().await, s.epoch0, "{case}: epoch changed during the cut");
    s.heal_and_check(case).await.assert_no_failover_and_writable(case);
}

/// (f) The leader cut off from the clients only: it still reaches its
/// followers and the coordinator, so there is no failover. The cut itself
/// is checked too: no append can be acknowledged while it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_isolated_from_clients_only_keeps_leading() {
    let case = "(f) leader <-> clients";
    let mut s = Scenario::start().await;
    s.partition.cut(Party::Node(1), Party::Clients);
    let cut_at = s.mark_cut();
    let held = s.hold(CUT).await;
    // An append already in flight at the cut may still be answered within
    // one TCP retransmission; none can be after that.
    let late = s.times.count_between(cut_at + Duration::from_millis(500), Instant::now());
    assert_eq!(late, 0, "{case}: appends acknowledged through a cut link: the partition does not hold");
    assert_eq!(held.failover_seen_at, None, "{case}: the coordinator recorded a new epoch during the cut");
    let report = s.heal_and_check(case).await;
    assert_eq!(report.failovers, 0, "{case}: the epoch changed: no failover was called for");
    assert_eq!(report.leader, 1, "{case}: leadership moved");
}

/// (g) The current leader's links to both followers cut and healed every
/// ~300 ms for 20 s. Each cut is shorter than the leader timeout, so no
/// failover is needed; at most one per heal is allowed, and nothing
/// acknowledged may be lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flapping_leader_links_lose_nothing() {
    let case = "(g) flapping leader <-> followers";
    let mut s = Scenario::start().await;
    let flap = Duration::from_millis(300);
    let end = Instant::now() + Duration::from_secs(20);
    let mut heals = 0u64;
    while Instant::now() < end {
        let leader = s.cluster.leader_of(1, 1).await.map_or(1, |(l, _)| l);
        for other in (1..=3).filter(|&n| n != leader) {
            s.partition.cut(Party::Node(leader), Party::Node(other));
        }
        s.mark_cut();
        s.hold(flap).await;
        s.partition.heal_all();
        heals += 1;
        s.hold(flap).await;
    }
    let report = s.heal_and_check(case).await;
    eprintln!("{case}: {heals} cut/heal cycles");
    assert!(report.failovers <= heals, "{case}: {} failovers for {heals} heals", report.failovers);
}
