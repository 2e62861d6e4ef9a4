//! Quiet shards (`shipping/src/replica/quiet.rs`), against real processes:
//! an idle shard's followers go quiet (no per-shard keepalives; one
//! `NodeKeepalive` per node pair stands in), the leader keeps its lease and
//! nobody fails it over while it is idle, the first append wakes it and is
//! acknowledged and readable on the followers, a dead leader's quiet shards
//! fail over with nothing acknowledged lost, and a `NodeKeepalive` naming
//! what a follower does not follow, or malformed, changes nothing.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{Acked, Cluster, append_and_record, read_all, wait_until};
use tonic::Code;
use walship_proto::log::Durability;
use walship_proto::replication::wal_shipping_client::WalShippingClient;
use walship_proto::replication::{NodeKeepaliveRequest, QuietShard};

const SHARDS: u32 = 12;

/// The value of one series (`name{labels}` exactly as exposed) on a node.
async fn metric(cluster: &mut Cluster, id: u32, series: &str) -> f64 {
    metric_at(&cluster.node(id).admin, series).await
}

/// The value of one series on the node whose admin address is `admin`.
async fn metric_at(admin: &str, series: &str) -> f64 {
    let body = common::http_get(&format!("{admin}/metrics")).await.1;
    body.lines().find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok())).unwrap_or(0.0)
}

/// (shard, follower) pairs quiet over the nodes in `nodes`.
async fn quiet_pairs(cluster: &mut Cluster, nodes: &[u32]) -> f64 {
    let mut sum = 0.0;
    for &id in nodes {
        sum += metric(cluster, id, "walship_quiet_followers").await;
    }
    sum
}

async fn wait_all_quiet(cluster: &mut Cluster, nodes: &[u32], pairs: f64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let now = quiet_pairs(cluster, nodes).await;
        if now == pairs {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "{now} of {pairs} (shard, follower) pairs went quiet");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// How many records `shard` serves on the node at `grpc` (none: refused).
async fn served(grpc: &str, shard: u32) -> Option<usize> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc}")).ok()?.connect().await.ok()?;
    let mut log = walship_proto::log::log_client::LogClient::new(channel);
    let request = walship_proto::log::ReadRequest { shard_id: shard, from_seqno: 1, to_seqno: 1, ..Default::default() };
    Some(log.read(request).await.ok()?.into_inner().records.len())
}

async fn epochs(cluster: &mut Cluster) -> Vec<(u32, u64)> {
    let mut all = Vec::new();
    for shard in 1..=SHARDS {
        all.push(cluster.leader_of(1, shard).await.expect("a leader"));
    }
    all
}

/// Three nodes and `SHARDS` shards (leader timeout 1 s), every shard led.
async fn led_cluster() -> Cluster {
    let mut cluster = Cluster::start_with(3, SHARDS, 1, "leader_timeout_ms = 1000", None);
    for shard in 1..=SHARDS {
        cluster.wait_leader(shard, None, Duration::from_secs(60)).await;
    }
    cluster
}

/// [`led_cluster`], with every (shard, follower) pair quiet.
async fn quiet_cluster() -> Cluster {
    let mut cluster = led_cluster().await;
    wait_all_quiet(&mut cluster, &[1, 2, 3], f64::from(SHARDS * 2)).await;
    cluster
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_shards_go_quiet_keep_their_leaders_and_wake_on_the_first_append() {
    let mut cluster = quiet_cluster().await;
    let before = epochs(&mut cluster).await;
    let links_before = metric(&mut cluster, 1, "walship_node_keepalives_total{outcome=\"ok\"}").await;

    // Idle for several failure timeouts: the node links keep every lease
    // and every follower's view of its leader; nothing fails over.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(epochs(&mut cluster).await, before, "an idle quiet cluster changes no leader");
    assert_eq!(quiet_pairs(&mut cluster, &[1, 2, 3]).await, f64::from(SHARDS * 2), "still quiet");
    let links_after = metric(&mut cluster, 1, "walship_node_keepalives_total{outcome=\"ok\"}").await;
    assert!(links_after > links_before + 5.0, "node keepalives ran: {links_before} -> {links_after}");

    // The first append wakes the shard: LOCAL needs the lease the links
    // kept, QUORUM a follower's fresh copy.
    let acked = Acked::default();
    for (shard, durability) in [(1, Durability::Local), (2, Durability::Quorum), (3, Durability::All)] {
        let leader = cluster.leader_of(1, shard).await.unwrap().0;
        let mut log = cluster.node(leader).client().await;
        let payload = Bytes::from(format!("first after quiet {shard}"));
        append_and_record(&mut log, shard, vec![payload], durability, Duration::from_secs(5), &acked)
            .await
            .unwrap_or_else(|e| panic!("shard {shard} at {durability:?}: {e}"));
    }
    // Every replica serves it (the followers learned the commit before the
    // shard went quiet again), and the shards go quiet again.
    for shard in 1..=3 {
        for id in 1..=3 {
            let grpc = cluster.node(id).grpc.clone();
            wait_until(&format!("node {id} serves shard {shard}'s record"), Duration::from_secs(10), || {
                let grpc = grpc.clone();
                async move { served(&grpc, shard).await == Some(1) }
            })
            .await;
        }
    }
    wait_all_quiet(&mut cluster, &[1, 2, 3], f64::from(SHARDS * 2)).await;
    assert_eq!(epochs(&mut cluster).await, before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_leaders_quiet_shards_fail_over_and_lose_nothing_acknowledged() {
    let mut cluster = led_cluster().await;
    let acked = Acked::default();
    for shard in 1..=SHARDS {
        let leader = cluster.leader_of(1, shard).await.unwrap().0;
        let mut log = cluster.node(leader).client().await;
        let payloads = (0..5).map(|i| Bytes::from(format!("s{shard}-r{i}"))).collect();
        append_and_record(&mut log, shard, payloads, Durability::Quorum, Duration::from_secs(5), &acked).await.unwrap();
    }
    wait_all_quiet(&mut cluster, &[1, 2, 3], f64::from(SHARDS * 2)).await;
    let led_by_1: Vec<u32> = {
        let mut led = Vec::new();
        for shard in 1..=SHARDS {
            if cluster.leader_of(1, shard).await.unwrap().0 == 1 {
                led.push(shard);
            }
        }
        led
    };
    assert!(!led_by_1.is_empty(), "node 1 leads some shards");
    cluster.node(1).kill9();
    for &shard in &led_by_1 {
        cluster.wait_leader(shard, Some(1), Duration::from_secs(30)).await;
    }
    // Every acknowledged record reads back from the new leaders.
    for shard in 1..=SHARDS {
        let leader = cluster.leader_of(1, shard).await.unwrap().0;
        let grpc = cluster.node(leader).grpc.clone();
        let records = read_all(&grpc, shard, 5).await;
        let payloads: Vec<String> = records.iter().map(|r| String::from_utf8_lossy(&r.payload).into_owned()).collect();
        let expected: Vec<String> = (0..5).map(|i| format!("s{shard}-r{i}")).collect();
        assert_eq!(payloads, expected, "shard {shard} after its leader died");
    }
    // Node 1 comes back as a follower everywhere; its shards go quiet again.
    cluster.restart(1);
    wait_all_quiet(&mut cluster, &[2, 3], f64::from(SHARDS * 2)).await;
}

/// A follower whose node is down holds everything an idle shard has, but
/// its shippers do not go quiet towards it: they would, and the node link's
/// failed call would wake them, every keepalive period, for as long as the
/// node stays down. Enough shards that most of those towards the dead node
/// never make a call of their own (one probes for the node at a time once
/// it counts as down): those are the ones that went quiet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shards_do_not_go_quiet_towards_a_dead_follower() {
    const MANY: u32 = 60;
    let mut cluster = Cluster::start_with(3, MANY, 1, "leader_timeout_ms = 1000", None);
    for shard in 1..=MANY {
        cluster.wait_leader(shard, None, Duration::from_secs(60)).await;
    }
    wait_all_quiet(&mut cluster, &[1, 2, 3], f64::from(MANY * 2)).await;
    cluster.node(3).kill9();
    for shard in 1..=MANY {
        cluster.wait_leader(shard, Some(3), Duration::from_secs(30)).await;
    }
    // Every shard's pair towards its live follower goes quiet; none towards
    // node 3.
    wait_all_quiet(&mut cluster, &[1, 2], f64::from(MANY)).await;
    let failed = "walship_node_keepalives_total{outcome=\"error\"}";
    let before = [metric(&mut cluster, 1, failed).await, metric(&mut cluster, 2, failed).await];
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(quiet_pairs(&mut cluster, &[1, 2]).await, f64::from(MANY), "quiet towards the live follower only");
    }
    let after = [metric(&mut cluster, 1, failed).await, metric(&mut cluster, 2, failed).await];
    assert_eq!(after, before, "no node keepalive to the dead node: no shard is quiet towards it");
}

/// A replica of `shard` in the coordinator's view (`GET /v1/shards/{id}`),
/// or null while it has none.
async fn replica_view(cluster: &mut Cluster, shard: u32, node: u64) -> serde_json::Value {
    let (_, view) = cluster.coord_get(1, &format!("/v1/shards/{shard}")).await;
    view["replicas"].as_array().and_then(|r| r.iter().find(|r| r["node_id"] == node)).cloned().unwrap_or_default()
}

/// Waits until node 1's count of dormant replicas satisfies `ok`.
async fn wait_dormant(cluster: &mut Cluster, what: &str, ok: impl Fn(f64) -> bool) {
    let admin = cluster.node(1).admin.clone();
    wait_until(what, Duration::from_secs(30), || {
        let (admin, ok) = (&admin, &ok);
        async move { ok(metric_at(admin, "walship_dormant_replicas").await) }
    })
    .await;
}

/// Node 1's dormant replicas woken for `reason` so far.
async fn wakes(cluster: &mut Cluster, reason: &str) -> f64 {
    metric(cluster, 1, &format!("walship_dormant_wakes_total{{reason=\"{reason}\"}}")).await
}

/// A leader whose follower's node is down holds those shards dormant: their
/// reports can change only with what happens to them or that node's return,
/// so the heartbeat loop looks at them in two loads a quarter second and
/// never rebuilds them meanwhile. Still, an append to one is reported with
/// the dead follower's lag grown, and the node's return is reported (the
/// follower caught up and no longer stale, as the leader's report counts
/// it) because it woke them: a dormant replica left asleep would show the
/// old figures until a full report (a minute here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_followers_shards_go_dormant_and_report_appends_and_its_return() {
    // Full reports (which look at every replica) only after a minute: what
    // the coordinator learns here, the wakes told it.
    let mut cluster = Cluster::start_with(3, SHARDS, 1, "leader_timeout_ms = 1000\nfull_report_ms = 60000", None);
    for shard in 1..=SHARDS {
        cluster.wait_leader(shard, None, Duration::from_secs(60)).await;
    }
    cluster.node(3).kill9();
    for shard in 1..=SHARDS {
        cluster.wait_leader(shard, Some(3), Duration::from_secs(30)).await;
    }
    // Every shard node 1 leads now (its own and those of node 3's it took
    // over) has node 3 as a follower (RF=3 on 3 nodes): each goes dormant.
    let mut led = Vec::new();
    for shard in 1..=SHARDS {
        if cluster.leader_of(1, shard).await.unwrap().0 == 1 {
            led.push(shard);
        }
    }
    assert!(!led.is_empty());
    let want = led.len() as f64;
    wait_dormant(&mut cluster, "node 1's shards dormant", |n| n >= want).await;
    let shard = led[0];
    let leader = replica_view(&mut cluster, shard, 1).await;
    assert!(!leader.is_null(), "node 1 holds shard {shard}");
    let known = leader["durable_seqno"].as_u64().unwrap_or(0);
    let woken_by_appends = wakes(&mut cluster, "activity").await + wakes(&mut cluster, "progress").await;
    let acked = Acked::default();
    let mut log = cluster.node(1).client().await;
    let records: Vec<Bytes> = (0..5).map(|i| Bytes::from(format!("dormant {i}"))).collect();
    append_and_record(&mut log, shard, records, Durability::Quorum, Duration::from_secs(5), &acked)
        .await
        .expect("QUORUM with one follower down");
    let last = known + 5;
    wait_until("the leader's new records and the dead follower's grown lag", Duration::from_secs(10), || {
        let (leader, dead) = futures::executor::block_on(async {
            (replica_view(&mut cluster, shard, 1).await, replica_view(&mut cluster, shard, 3).await)
        });
        async move { leader["durable_seqno"] == last && dead["lag_records"].as_u64().is_some_and(|l| l >= 5) }
    })
    .await;
    assert!(
        wakes(&mut cluster, "activity").await + wakes(&mut cluster, "progress").await > woken_by_appends,
        "the append woke its dormant leader"
    );
    let woken = wakes(&mut cluster, "peer_contact").await + wakes(&mut cluster, "activity").await;
    cluster.restart(3);
    wait_until(&format!("node 3 caught up and fresh in shard {shard}'s view"), Duration::from_secs(30), || {
        let dead = futures::executor::block_on(replica_view(&mut cluster, shard, 3));
        async move { dead["durable_seqno"] == last && dead["lag_records"] == 0 && dead["lag_stale"] == false }
    })
    .await;
    // Its return moves the node contact (`peer_contact`) and, once its
    // leaders ship to it again, their activity: whichever a dormant
    // replica sees first woke it.
    assert!(
        wakes(&mut cluster, "peer_contact").await + wakes(&mut cluster, "activity").await > woken,
        "node 3's return woke node 1's dormant shards"
    );
    wait_dormant(&mut cluster, "no shard dormant on node 1 with every node up", |n| n == 0.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_keepalive_for_what_the_follower_does_not_follow_or_malformed_changes_nothing() {
    let mut cluster = quiet_cluster().await;
    let before = epochs(&mut cluster).await;
    // A shard node 1 leads, a shard node 2 (the receiver) leads itself.
    let (led_by_1, epoch_1) =
        before.iter().enumerate().find(|(_, (l, _))| *l == 1).map(|(i, (_, e))| (i as u32 + 1, *e)).unwrap();
    let (led_by_2, epoch_2) =
        before.iter().enumerate().find(|(_, (l, _))| *l == 2).map(|(i, (_, e))| (i as u32 + 1, *e)).unwrap();

    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{}", cluster.node(2).grpc)).unwrap();
    let mut client = WalShippingClient::new(common::as_member(endpoint.connect().await.unwrap()));
    let quiet = |shard_id: u32, epoch: u64| QuietShard { shard_id, epoch, commit_seqno: 0 };

    // Refused, and forgotten: a newer epoch than the follower follows, a
    // shard it leads itself, a shard it does not host.
    let answer = client
        .node_keepalive(NodeKeepaliveRequest {
            leader_node_id: 1,
            quiet: vec![quiet(led_by_1, epoch_1 + 5), quiet(led_by_2, epoch_2), quiet(999, 1)],
            woke: vec![],
            full: false,
        })
        .await
        .expect("answered")
        .into_inner();
    let mut refused = answer.refused.clone();
    refused.sort_unstable();
    let mut expected = vec![led_by_1, led_by_2, 999];
    expected.sort_unstable();
    assert_eq!(refused, expected, "{answer:?}");

    // Malformed: INVALID_ARGUMENT, nothing applied.
    let bad = [
        (NodeKeepaliveRequest { leader_node_id: 9, ..Default::default() }, "not another node"),
        (NodeKeepaliveRequest { leader_node_id: 2, ..Default::default() }, "not another node"),
        (NodeKeepaliveRequest { leader_node_id: 1, quiet: vec![quiet(0, 1)], ..Default::default() }, "start at 1"),
        (NodeKeepaliveRequest { leader_node_id: 1, quiet: vec![quiet(1, 0)], ..Default::default() }, "start at 1"),
        (
            NodeKeepaliveRequest { leader_node_id: 1, quiet: vec![quiet(1, 1), quiet(1, 2)], ..Default::default() },
            "named twice",
        ),
        (NodeKeepaliveRequest { leader_node_id: 1, woke: vec![1; 100_001], ..Default::default() }, "at most"),
    ];
    for (request, says) in bad {
        let status = client.node_keepalive(request).await.expect_err("refused");
        assert_eq!(status.code(), Code::InvalidArgument, "{status}");
        assert!(status.message().contains(says), "{says}: {status}");
    }
    // The coordinator is not a node.
    let coordinator = cluster.coordinator(1).grpc.clone();
    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{coordinator}")).unwrap();
    let mut to_coordinator = WalShippingClient::new(common::as_member(endpoint.connect().await.unwrap()));
    let refused = to_coordinator
        .node_keepalive(NodeKeepaliveRequest { leader_node_id: 1, ..Default::default() })
        .await
        .expect_err("not a node");
    assert_ne!(refused.code(), Code::Ok);

    // Nothing moved: same leaders and epochs; node 1's real link heals the
    // set it shares with node 2 and everything is quiet again.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(epochs(&mut cluster).await, before);
    wait_all_quiet(&mut cluster, &[1, 2, 3], f64::from(SHARDS * 2)).await;
}

/// A follower re-checks the quiet shards it already holds only when some
/// replica's rules changed since it last looked (`Touched::rules_changes`):
/// a shard fenced after the keepalives that announced it must be refused
/// by the next keepalive that merely names nothing, never credited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_shard_fenced_after_it_was_announced_is_refused_by_the_next_keepalive() {
    let mut cluster = quiet_cluster().await;
    let led_by_1: Vec<(u32, u64)> = epochs(&mut cluster)
        .await
        .iter()
        .enumerate()
        .filter(|(_, (leader, _))| *leader == 1)
        .map(|(i, (_, epoch))| (i as u32 + 1, *epoch))
        .collect();
    assert!(!led_by_1.is_empty(), "node 1 leads some shards");
    let mut led: Vec<u32> = led_by_1.iter().map(|(shard, _)| *shard).collect();
    led.sort_unstable();

    let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{}", cluster.node(2).grpc)).unwrap();
    let mut client = WalShippingClient::new(common::as_member(endpoint.connect().await.unwrap()));
    let as_node_1 =
        |quiet: Vec<QuietShard>| NodeKeepaliveRequest { leader_node_id: 1, quiet, woke: vec![], full: false };
    let announce: Vec<QuietShard> =
        led_by_1.iter().map(|&(shard_id, epoch)| QuietShard { shard_id, epoch, commit_seqno: 0 }).collect();
    // Announced twice while node 2 follows node 1 in all of them: the
    // second call finds no rules changed and checks only what it names.
    for _ in 0..2 {
        let answer = client.node_keepalive(as_node_1(announce.clone())).await.expect("answered").into_inner();
        assert!(answer.refused.iter().all(|s| !led.contains(s)), "{answer:?}");
        assert!(answer.quiet_count >= led.len() as u64, "{answer:?}");
    }
    // Node 1 dies; the coordinator fences node 2's replicas of its shards
    // and they fail over. Node 1's own keepalives stopped with it.
    cluster.node(1).kill9();
    for &shard in &led {
        cluster.wait_leader(shard, Some(1), Duration::from_secs(30)).await;
    }
    let answer = client.node_keepalive(as_node_1(vec![])).await.expect("answered").into_inner();
    let mut refused = answer.refused.clone();
    refused.sort_unstable();
    assert_eq!(refused, led, "every shard fenced since is refused: {answer:?}");
    assert_eq!(answer.quiet_count, 0, "nothing is quiet from a leader node 2 follows in no shard: {answer:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_per_shard_metrics_a_scrape_has_one_series_per_follower() {
    let mut cluster = Cluster::start_with(3, 6, 1, "per_shard_metrics = false", None);
    for shard in 1..=6 {
        cluster.wait_leader(shard, None, Duration::from_secs(60)).await;
    }
    let leader = cluster.leader_of(1, 1).await.unwrap().0;
    let mut log = cluster.node(leader).client().await;
    let acked = Acked::default();
    append_and_record(&mut log, 1, vec![Bytes::from_static(b"x")], Durability::Quorum, Duration::from_secs(5), &acked)
        .await
        .unwrap();
    let admin = cluster.node(leader).admin.clone();
    let follower = (1..=3).find(|&n| n != leader).unwrap();
    let series = format!("walship_replica_lag_records{{follower=\"{follower}\",shard=\"all\"}}");
    wait_until("the aggregate follower series", Duration::from_secs(10), || {
        let admin = admin.clone();
        let series = series.clone();
        async move { common::http_get(&format!("{admin}/metrics")).await.1.lines().any(|l| l.starts_with(&series)) }
    })
    .await;
    let body = common::http_get(&format!("{admin}/metrics")).await.1;
    let per_shard: Vec<&str> = body
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains("shard=\"") && !l.contains("shard=\"all\""))
        .collect();
    assert!(per_shard.is_empty(), "no per-shard series: {per_shard:?}");
    // The mode gauge counts shards: every shard this node leads, per follower.
    let modes: f64 = body
        .lines()
        .filter(|l| l.starts_with("walship_replica_ship_mode{") && l.contains(&format!("follower=\"{follower}\"")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    let led = metric(&mut cluster, leader, "walship_quiet_followers").await;
    assert!((1.0..=6.0).contains(&modes), "shards counted by mode: {modes} (quiet pairs {led})");
}
