//! Two `walship coord` processes sharing a NATS JetStream KV (a real
//! `nats-server -js`): one holds the lease, the other stands by. The active
//! one is stopped (SIGSTOP: paused, not dead); the standby takes the lease
//! over with a higher term and fails over a killed leader; the old one,
//! resumed, finds itself deposed and can change nothing.

mod common;

use std::time::{Duration, Instant};

use common::{Acked, Cluster, TOKEN};
use walship_proto::log::Durability;

const WAIT: Duration = Duration::from_secs(30);
const REPLICATION: &str = "coordinator_lease_ms = 600\nleader_timeout_ms = 1000\nheartbeat_ms = 50";

/// A throwaway `nats-server -js` (shared with the shipping crate's tests).
#[path = "../shipping/tests/support/nats.rs"]
mod nats;

/// `coordinator` of `GET /v1/cluster` on coordinator `c`, or None if it
/// does not answer within 2 s (never ask a stopped process: it would not).
async fn coordinator_view(cluster: &mut Cluster, c: u32) -> Option<serde_json::Value> {
    let (code, body) = tokio::time::timeout(Duration::from_secs(2), cluster.coord_get(c, "/v1/cluster")).await.ok()?;
    (code == 200).then(|| body["coordinator"].clone())
}

/// (active, lease_holder, lease_term) as coordinator `c` reports them.
async fn lease_view(cluster: &mut Cluster, c: u32) -> Option<(bool, String, u64)> {
    let v = coordinator_view(cluster, c).await?;
    Some((v["active"].as_bool()?, v["lease_holder"].as_str()?.to_string(), v["lease_term"].as_u64()?))
}

/// (leader, epoch) of `shard` as coordinator `c` records it.
async fn shard_view(cluster: &mut Cluster, c: u32, shard: u32) -> Option<(Option<u32>, u64)> {
    let (code, v) = tokio::time::timeout(Duration::from_secs(2), cluster.coord_get(c, &format!("/v1/shards/{shard}")))
        .await
        .ok()?;
    if code != 200 {
        return None;
    }
    Some((v["leader"].as_u64().map(|l| l as u32), v["epoch"].as_u64()?))
}

/// Polls `probe` every 20 ms until it returns Some; panics after `timeout`.
async fn eventually<T>(
    cluster: &mut Cluster,
    what: &str,
    timeout: Duration,
    mut probe: impl AsyncFnMut(&mut Cluster) -> Option<T>,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = probe(cluster).await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn id(c: u32) -> String {
    format!("c{c}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standby_takes_over_a_stopped_coordinator_which_is_fenced_on_resume() {
    let nats = nats::NatsServer::start();
    let t0 = Instant::now();
    let mut cluster = Cluster::start_with(3, 2, 2, REPLICATION, Some(&nats.url));
    eprintln!("{:>6} ms: cluster up (3 nodes, 2 shards, coordinators c1 c2 on {})", t0.elapsed().as_millis(), nats.url);

    // Exactly one active coordinator; the other stands by naming it.
    let (a, b, term_a) = eventually(&mut cluster, "exactly one active coordinator", WAIT, async |c| {
        let (v1, v2) = (lease_view(c, 1).await?, lease_view(c, 2).await?);
        let (a, b, va, vb) = match (v1.0, v2.0) {
            (true, false) => (1, 2, v1, v2),
            (false, true) => (2, 1, v2, v1),
            _ => return None,
        };
        (va.1 == id(a) && vb.1 == id(a) && vb.2 == va.2).then_some((a, b, va.2))
    })
    .await;
    eprintln!("{:>6} ms: c{a} active (term {term_a}), c{b} standby", t0.elapsed().as_millis());
    for c in [a, b] {
        let kv = coordinator_view(&mut cluster, c).await.unwrap()["kv"].as_str().unwrap().to_string();
        assert_eq!(kv, format!("nats:{}/walship", nats.url), "c{c} is not on the NATS KV");
    }
    // The bootstrap leaders are in place before anything is disturbed.
    let (leader_1, epoch_1) = eventually(&mut cluster, "shard 1 led by node 1", WAIT, async |c| {
        shard_view(c, a, 1).await.filter(|(l, _)| *l == Some(1)).map(|(l, e)| (l.unwrap(), e))
    })
    .await;
    assert_eq!(leader_1, 1);

    // Pause A: it holds the lease but renews it no more.
    cluster.coordinator(a).signal(libc::SIGSTOP);
    let stopped = Instant::now();
    eprintln!("{:>6} ms: SIGSTOP c{a}", t0.elapsed().as_millis());
    let term_b = eventually(&mut cluster, "the standby to take the lease over", WAIT, async |c| {
        let (active, holder, term) = lease_view(c, b).await?;
        (active && holder == id(b) && term > term_a).then_some(term)
    })
    .await;
    eprintln!(
        "{:>6} ms: c{b} active with term {term_b}, {} ms after the stop (lease 600 ms)",
        t0.elapsed().as_millis(),
        stopped.elapsed().as_millis()
    );

    // B drives a failover: kill the leader of shard 1.
    let (_, epoch_1) = eventually(&mut cluster, &format!("c{b} to show shard 1"), WAIT, async |c| {
        shard_view(c, b, 1).await.filter(|(l, e)| *l == Some(1) && *e >= epoch_1)
    })
    .await;
    cluster.node(1).kill9();
    let killed = Instant::now();
    eprintln!("{:>6} ms: kill -9 node 1 (leader of shard 1 at epoch {epoch_1})", t0.elapsed().as_millis());
    let (new_leader, new_epoch) = eventually(&mut cluster, &format!("c{b} to fail shard 1 over"), WAIT, async |c| {
        match shard_view(c, b, 1).await? {
            (Some(leader), epoch) if leader != 1 && epoch > epoch_1 => Some((leader, epoch)),
            _ => None,
        }
    })
    .await;
    eprintln!(
        "{:>6} ms: c{b} failed shard 1 over to node {new_leader} at epoch {new_epoch}, {} ms after the kill",
        t0.elapsed().as_millis(),
        killed.elapsed().as_millis()
    );
    let (_, body) = cluster.coord_get(b, "/v1/shards/1").await;
    let last = &body["last_failover"];
    assert_eq!(last["epoch"].as_u64(), Some(new_epoch), "{body}");
    assert_eq!(last["from"].as_u64(), Some(1), "{body}");
    assert_eq!(last["to"].as_u64(), Some(new_leader as u64), "{body}");

    // Resume A: deposed while paused, it must find out and change nothing.
    let shard_2_before = shard_view(&mut cluster, b, 2).await.unwrap_or_else(|| panic!("c{b} does not show shard 2"));
    cluster.coordinator(a).signal(libc::SIGCONT);
    let resumed = Instant::now();
    eprintln!(
        "{:>6} ms: SIGCONT c{a} after {} ms stopped",
        t0.elapsed().as_millis(),
        resumed.duration_since(stopped).as_millis()
    );
    // At once, before its lease round has run: it still holds its old state
    // in memory, but its lease ran out, so it may not act on it.
    let (code, body) = cluster.coord_post(a, "/v1/shards/2/failover", "{}", Some(TOKEN)).await;
    eprintln!(
        "{:>6} ms: c{a} POST /v1/shards/2/failover {} ms after resuming -> {code} {body}",
        t0.elapsed().as_millis(),
        resumed.elapsed().as_millis()
    );
    assert_eq!(code, 503, "{body}");
    assert_eq!(body["error"]["code"], "not_active", "{body}");
    eventually(&mut cluster, "the resumed coordinator to step down", WAIT, async |c| {
        let (active, holder, term) = lease_view(c, a).await?;
        (!active && holder == id(b) && term == term_b).then_some(())
    })
    .await;
    eprintln!(
        "{:>6} ms: c{a} reports active=false, lease c{b} term {term_b}, {} ms after resuming",
        t0.elapsed().as_millis(),
        resumed.elapsed().as_millis()
    );

    let (code, body) = cluster.coord_post(a, "/v1/shards/2/failover", "{}", Some(TOKEN)).await;
    eprintln!("{:>6} ms: c{a} POST /v1/shards/2/failover -> {code} {body}", t0.elapsed().as_millis());
    assert_eq!(code, 503, "{body}");
    assert_eq!(body["error"]["code"], "not_active", "{body}");
    // Nor does it rebalance leaderships, or plan a rebalance from reports
    // it no longer receives.
    for request in ["{}", r#"{"preview": true}"#] {
        let (code, body) = cluster.coord_post(a, "/v1/rebalance", request, Some(TOKEN)).await;
        assert_eq!(code, 503, "{request}: {body}");
        assert_eq!(body["error"]["code"], "not_active", "{request}: {body}");
    }

    // Nothing changed: B still holds the lease and shard 2 is as it was.
    let shard_2_after = shard_view(&mut cluster, b, 2).await.unwrap_or_else(|| panic!("c{b} does not show shard 2"));
    assert_eq!(shard_2_after, shard_2_before, "shard 2 (leader, epoch) changed under the deposed coordinator");
    assert_eq!(shard_view(&mut cluster, a, 2).await, Some(shard_2_before), "c{a} reads shard 2 from the KV");
    assert_eq!(lease_view(&mut cluster, b).await, Some((true, id(b), term_b)));
    assert_eq!(lease_view(&mut cluster, a).await, Some((false, id(b), term_b)));
    eprintln!("{:>6} ms: shard 2 unchanged at {shard_2_after:?}; c{b} still active", t0.elapsed().as_millis());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_are_published_on_nats_subjects() {
    use futures::StreamExt;
    let nats = nats::NatsServer::start();
    let client = async_nats::connect(&nats.url).await.unwrap();
    let mut subscription = client.subscribe("walship.heartbeats.>").await.unwrap();
    let _cluster = Cluster::start_with(3, 2, 1, "heartbeat_ms = 50", Some(&nats.url));
    let mut seen = std::collections::BTreeSet::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while seen.len() < 6 {
        let message = tokio::time::timeout_at(deadline, subscription.next())
            .await
            .expect("heartbeats from every node for every shard on NATS within 30 s")
            .unwrap();
        let hb: serde_json::Value = serde_json::from_slice(&message.payload).unwrap();
        let (node, shard) = (hb["node_id"].as_u64().unwrap(), hb["shard_id"].as_u64().unwrap());
        assert_eq!(message.subject.as_str(), format!("walship.heartbeats.{node}.{shard}"));
        assert!((1..=3).contains(&node) && (1..=2).contains(&shard), "{hb}");
        // Once roles are assigned, the message carries them.
        if hb["epoch"].as_u64().unwrap() >= 1 && hb["leader_node_id"].as_u64().unwrap() != 0 {
            assert_eq!(hb["is_leader"].as_bool().unwrap(), hb["leader_node_id"] == node, "{hb}");
            seen.insert((node, shard));
        }
    }
}

/// Appends one record to `shard` on `log` at QUORUM (2 s deadline),
/// recording it in `acked` once acknowledged.
async fn append_one(
    log: &mut walship_proto::log::log_client::LogClient<tonic::transport::Channel>,
    shard: u32,
    n: u64,
    acked: &Acked,
) -> Result<(), tonic::Status> {
    let payload = bytes::Bytes::from(format!("record {n}"));
    common::append_and_record(log, shard, vec![payload], Durability::Quorum, Duration::from_secs(2), acked).await
}

/// Appends record `n` to shard 1 until it is acknowledged (a shard without
/// a working leader yet refuses), for at most [`WAIT`].
async fn append_until_acknowledged(
    log: &mut walship_proto::log::log_client::LogClient<tonic::transport::Channel>,
    n: u64,
    acked: &Acked,
    when: &str,
) {
    let started = Instant::now();
    while let Err(status) = append_one(log, 1, n, acked).await {
        assert!(started.elapsed() < WAIT, "no append acknowledged {when}: {status}");
        eprintln!("append {when}: {status}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_outage_stops_no_append_and_the_coordinator_fails_over_again_once_nats_is_back() {
    let mut nats = nats::NatsServer::start();
    let t0 = Instant::now();
    let mut cluster = Cluster::start_with(3, 2, 1, REPLICATION, Some(&nats.url));
    let term = eventually(&mut cluster, "c1 active", WAIT, async |c| {
        lease_view(c, 1).await.filter(|(active, holder, _)| *active && holder == "c1").map(|v| v.2)
    })
    .await;
    let (_, epoch) = eventually(&mut cluster, "shard 1 led by node 1", WAIT, async |c| {
        shard_view(c, 1, 1).await.filter(|(l, _)| *l == Some(1))
    })
    .await;
    let acked = Acked::default();
    let mut log = cluster.node(1).client().await;
    let mut n = 0u64;
    while n < 10 {
        append_until_acknowledged(&mut log, n, &acked, "before the outage").await;
        n += 1;
    }

    // NATS dies. The shard's leader and followers do not depend on it: QUORUM
    // appends go on being acknowledged for five lease periods.
    nats.kill();
    eprintln!("{:>6} ms: nats-server killed; c1 held the lease at term {term}", t0.elapsed().as_millis());
    let outage = Instant::now();
    while outage.elapsed() < Duration::from_secs(3) {
        append_one(&mut log, 1, n, &acked).await.unwrap_or_else(|s| panic!("append {n} during the NATS outage: {s}"));
        n += 1;
    }
    eprintln!("{:>6} ms: {n} records acknowledged, the last {} during the outage", t0.elapsed().as_millis(), n - 10);
    // The coordinator cannot renew its lease, so it stops acting on it.
    eventually(&mut cluster, "c1 to stop acting without its KV", WAIT, async |c| {
        lease_view(c, 1).await.filter(|(active, _, _)| !*active)
    })
    .await;
    let (code, body) = cluster.coord_post(1, "/v1/shards/2/failover", "{}", Some(TOKEN)).await;
    assert_eq!(code, 503, "a failover without the KV: {body}");

    // NATS returns with its store: the coordinator takes its lease again
    // and fails a killed leader over.
    nats.restart();
    eprintln!("{:>6} ms: nats-server restarted on {}", t0.elapsed().as_millis(), nats.url);
    eventually(&mut cluster, "c1 active again", WAIT, async |c| {
        lease_view(c, 1).await.filter(|(active, holder, t)| *active && holder == "c1" && *t >= term)
    })
    .await;
    eprintln!("{:>6} ms: c1 active again", t0.elapsed().as_millis());
    cluster.node(1).kill9();
    let (leader, new_epoch) =
        eventually(&mut cluster, "c1 to fail shard 1 over", WAIT, async |c| match shard_view(c, 1, 1).await? {
            (Some(leader), e) if leader != 1 && e > epoch => Some((leader, e)),
            _ => None,
        })
        .await;
    eprintln!("{:>6} ms: shard 1 failed over to node {leader} at epoch {new_epoch}", t0.elapsed().as_millis());
    let mut log = cluster.node(leader).client().await;
    append_until_acknowledged(&mut log, n, &acked, "by the new leader").await;
    let last = n;
    // Every acknowledged record is on the new leader, at its seqno.
    let acked = acked.lock().await;
    let shard = &acked[&1];
    let newest = *shard.keys().next_back().unwrap();
    let records = common::read_all(&cluster.node(leader).grpc, 1, newest).await;
    for (seqno, payload) in shard {
        let record = records.iter().find(|r| r.seqno == *seqno);
        assert_eq!(record.map(|r| &r.payload), Some(payload), "acknowledged seqno {seqno} on node {leader}");
    }
    eprintln!(
        "{:>6} ms: {} acknowledged records (the last, {last}, after the failover) all on node {leader}",
        t0.elapsed().as_millis(),
        shard.len()
    );
}
