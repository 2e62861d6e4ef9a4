//! Failover black-box tests: real `walship node` processes and a real
//! `walship coord`, leaders killed (`kill -9`) or stopped (`SIGSTOP`) under
//! load. Invariants are checked over the recorded history of acknowledged
//! appends. Randomised choices print their seed: `WALSHIP_SEED=<n>` replays.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::{Cluster, TOKEN, append_and_record, read_all, wait_until};
use rand::{Rng, SeedableRng};
use tonic::transport::Channel;
use walship_proto::log::control_client::ControlClient;
use walship_proto::log::log_client::LogClient;
use walship_proto::log::{AppendRecord, AppendRequest, Durability, PauseRequest};

/// shard -> seqno -> payload of every acknowledged append.
use common::Acked;
use common::history::{FAST, WAIT, check_history, client, converge, entry, load, wait_for_more_appends, wait_leading};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_leader_kills_lose_no_acknowledged_record() {
    let seed: u64 = std::env::var("WALSHIP_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random);
    eprintln!("WALSHIP_SEED={seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut cluster = Cluster::start_with(3, 2, 1, FAST, None);
    let nodes: Vec<String> = cluster.nodes.iter().map(|n| n.grpc.clone()).collect();
    let admin = cluster.coordinator(1).admin.clone();
    let acked: Acked = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for shard in [1, 2] {
        for _ in 0..4 {
            tasks.push(load(nodes.clone(), admin.clone(), shard, acked.clone(), stop.clone(), count.clone()));
        }
    }
    let epochs = |c: &mut Cluster| {
        let c1 = futures::executor::block_on(c.leader_of(1, 1));
        let c2 = futures::executor::block_on(c.leader_of(1, 2));
        (c1, c2)
    };
    let mut failovers = 0;
    let mut round = 0;
    while failovers < 20 {
        round += 1;
        wait_for_more_appends(&count, 50, "appends to flow").await;
        let (Some((l1, e1)), Some((l2, e2))) = epochs(&mut cluster) else { panic!("no leaders recorded") };
        // Kill one of the current leaders, chosen by the seed.
        let victim = if rng.gen_bool(0.5) { l1 } else { l2 };
        cluster.node(victim).kill9();
        eprintln!("round {round}: killed node {victim} (leaders {l1}@{e1}, {l2}@{e2})");
        wait_until("new leaders for the victim's shards", WAIT, || {
            let (a, b) = epochs(&mut cluster);
            let ok = [(a, l1, e1), (b, l2, e2)].iter().all(|(now, before_leader, before_epoch)| match now {
                Some((leader, epoch)) => *before_leader != victim || (*leader != victim && epoch > before_epoch),
                None => false,
            });
            async move { ok }
        })
        .await;
        let (Some((_, n1)), Some((_, n2))) = epochs(&mut cluster) else { unreachable!() };
        failovers += (n1 - e1) + (n2 - e2);
        cluster.restart(victim);
        wait_until("the restarted node to follow again", WAIT, || {
            let s = futures::executor::block_on(cluster.status(victim));
            let ok = s.is_some_and(|s| [1, 2].iter().all(|&sh| entry(&s, sh)["role"] != "unassigned"));
            async move { ok }
        })
        .await;
    }
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let mut total = 0;
    for shard in [1, 2] {
        let last = converge(&mut cluster, shard).await;
        total += check_history(&mut cluster, shard, last, &acked).await;
    }
    eprintln!("{failovers} failovers over {round} kills; {total} acknowledged records all present, replicas identical");
    assert!(total > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopped_old_leader_cannot_commit_and_its_tail_is_truncated() {
    let mut cluster = Cluster::start_with(3, 1, 1, FAST, None);
    let acked: Acked = Arc::default();
    wait_leading(&mut cluster, 1, 1).await;
    let mut old = client(&cluster.node(1).grpc.clone()).await.unwrap();
    let append = |text: &str| AppendRequest {
        shard_id: 1,
        records: vec![AppendRecord { key: Bytes::new(), payload: Bytes::from(text.to_string()) }],
        durability: Durability::Quorum as i32,
        ..Default::default()
    };
    for i in 0..10 {
        let r = old.append(append(&format!("before-{i}"))).await.unwrap().into_inner();
        acked.lock().await.entry(1).or_default().insert(r.first_seqno, Bytes::from(format!("before-{i}")));
    }
    // An unacknowledged tail on the leader alone: its followers are paused,
    // so these QUORUM appends are written and fsynced on node 1 and time out.
    for id in [2, 3] {
        common::pause_shard(&cluster.node(id).grpc, 1, true).await;
    }
    for text in ["tail-1", "tail-2"] {
        let mut request = tonic::Request::new(append(text));
        request.set_timeout(Duration::from_millis(300));
        assert!(old.append(request).await.is_err(), "no quorum: {text} must not be acknowledged");
    }
    assert_eq!(entry(&cluster.status(1).await.unwrap(), 1)["durable_seqno"], 12, "the tail is durable on node 1");
    cluster.signal(1, libc::SIGSTOP);
    wait_until("a new leader elected while node 1 is stopped", WAIT, || {
        let l = futures::executor::block_on(cluster.leader_of(1, 1));
        async move { l.is_some_and(|(leader, epoch)| leader != 1 && epoch >= 2) }
    })
    .await;
    let (new_leader, epoch) = cluster.leader_of(1, 1).await.unwrap();
    for id in [2, 3] {
        common::pause_shard(&cluster.node(id).grpc, 1, false).await;
    }
    let mut new = client(&cluster.node(new_leader).grpc.clone()).await.unwrap();
    wait_until("the new leader to accept appends", WAIT, || {
        let mut new = new.clone();
        async move { new.append(append("probe")).await.is_ok() }
    })
    .await;
    // The probe above was acknowledged too; record what the log will hold.
    // Send the old leader an append while it is stopped: it sits in its
    // socket and runs when it resumes, in its old epoch.
    let mut stale = old.clone();
    let stale_append = tokio::spawn(async move {
        let mut request = tonic::Request::new(append("stale-from-old-leader"));
        request.set_timeout(Duration::from_secs(5));
        stale.append(request).await
    });
    tokio::time::sleep(Duration::from_millis(100)).await; // let the request reach the stopped process's socket
    cluster.signal(1, libc::SIGCONT);
    let outcome = stale_append.await.unwrap();
    assert!(outcome.is_err(), "the deposed leader acknowledged an append in its old epoch: {outcome:?}");
    eprintln!("old leader's answer: {:?}", outcome.unwrap_err());
    for i in 0..10 {
        let r = new.append(append(&format!("after-{i}"))).await.unwrap().into_inner();
        assert!(r.epoch >= epoch);
        acked.lock().await.entry(1).or_default().insert(r.first_seqno, Bytes::from(format!("after-{i}")));
    }
    let last = converge(&mut cluster, 1).await;
    check_history(&mut cluster, 1, last, &acked).await;
    let on_old = read_all(&cluster.node(1).grpc.clone(), 1, last).await;
    for gone in ["stale-from-old-leader", "tail-1", "tail-2"] {
        assert!(
            on_old.iter().all(|r| &r.payload[..] != gone.as_bytes()),
            "the old leader's unacknowledged {gone} survived its rejoin"
        );
    }
    let s1 = entry(&cluster.status(1).await.unwrap(), 1);
    assert_eq!(s1["last_seqno"], last, "the old leader's log ends exactly where the new leader's does");
}

/// A QUORUM append to shard 1 of one record, payload `r{i}`.
fn record_r(i: u32) -> AppendRequest {
    AppendRequest {
        shard_id: 1,
        records: vec![AppendRecord { key: Bytes::new(), payload: Bytes::from(format!("r{i}")) }],
        durability: Durability::Quorum as i32,
        ..Default::default()
    }
}

/// Appends `r{i}` to shard 1 for each `i` of `range`, one QUORUM call each
/// within `timeout`, recording what is acknowledged in `acked`; stops at
/// the first refusal.
async fn append_r(
    leader: &mut LogClient<Channel>,
    range: std::ops::RangeInclusive<u32>,
    timeout: Duration,
    acked: &Acked,
) -> Result<(), tonic::Status> {
    for i in range {
        append_and_record(leader, 1, vec![Bytes::from(format!("r{i}"))], Durability::Quorum, timeout, acked).await?;
    }
    Ok(())
}

/// A 3-node cluster with one coordinator whose shard 1 node 1 leads,
/// holding `r1..=r10` (recorded in `acked`) on every replica; node 1's
/// client.
async fn led_by_node_1_holding_ten(acked: &Acked) -> (Cluster, LogClient<Channel>) {
    let mut cluster = Cluster::start_with(3, 1, 1, FAST, None);
    wait_leading(&mut cluster, 1, 1).await;
    let mut leader = client(&cluster.node(1).grpc.clone()).await.unwrap();
    append_r(&mut leader, 1..=10, WAIT, acked).await.unwrap();
    assert_eq!(converge(&mut cluster, 1).await, 10);
    (cluster, leader)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preview_and_forced_failover_report_the_exact_loss_and_need_the_token() {
    let (mut cluster, mut leader) = led_by_node_1_holding_ten(&Acked::default()).await;
    let append = record_r;
    // Node 3 stops receiving; 11..=15 are acknowledged by nodes 1 and 2.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", cluster.node(3).grpc))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let channel = common::as_member(channel);
    ControlClient::new(channel.clone()).pause(PauseRequest { shard_id: 1, paused: true }).await.unwrap();
    for i in 11..=15 {
        leader.append(append(i)).await.unwrap();
    }
    let before = cluster.leader_of(1, 1).await.unwrap();

    // Without the token: 401; a wrong token: 403; nothing changes.
    let (code, body) = cluster.coord_post(1, "/v1/shards/1/failover", r#"{"target": 3}"#, None).await;
    assert_eq!((code, body["error"]["code"].as_str()), (401, Some("unauthorized")), "{body}");
    let (code, _) = cluster.coord_post(1, "/v1/shards/1/failover", r#"{"target": 3}"#, Some("wrong-token-123")).await;
    assert_eq!(code, 403);
    assert_eq!(cluster.leader_of(1, 1).await.unwrap(), before);

    // Preview: exactly what each candidate would lose; nothing changes.
    let (code, preview) =
        cluster.coord_post(1, "/v1/shards/1/failover", r#"{"preview": true, "target": 3}"#, Some(TOKEN)).await;
    assert_eq!(code, 200, "{preview}");
    let candidate =
        |n: u64| preview["candidates"].as_array().unwrap().iter().find(|c| c["node"] == n).cloned().unwrap();
    assert_eq!(candidate(3)["would_lose"], serde_json::json!([11, 15]), "{preview}");
    assert_eq!(candidate(3)["would_lose_acknowledged"], serde_json::json!([11, 15]));
    assert!(candidate(1)["would_lose"].is_null() && candidate(2)["would_lose"].is_null());
    assert_eq!(cluster.leader_of(1, 1).await.unwrap(), before, "a preview changes nothing");

    // Promoting node 3 without allow_loss is refused, naming the range.
    let (code, refused) = cluster.coord_post(1, "/v1/shards/1/failover", r#"{"target": 3}"#, Some(TOKEN)).await;
    assert_eq!((code, refused["error"]["code"].as_str()), (409, Some("would_lose_acknowledged_records")), "{refused}");
    assert!(refused["error"]["message"].as_str().unwrap().contains("11..=15"));
    assert_eq!(cluster.leader_of(1, 1).await.unwrap(), before);

    // Forced: done, and it loses exactly 11..=15 everywhere.
    let (code, forced) =
        cluster.coord_post(1, "/v1/shards/1/failover", r#"{"target": 3, "allow_loss": true}"#, Some(TOKEN)).await;
    assert_eq!(code, 200, "{forced}");
    assert_eq!(forced["lost"], serde_json::json!([11, 15]));
    assert_eq!(forced["to"], 3);
    let (leader_now, epoch_now) = cluster.leader_of(1, 1).await.unwrap();
    assert_eq!(leader_now, 3);
    assert!(epoch_now > before.1);
    ControlClient::new(channel).pause(PauseRequest { shard_id: 1, paused: false }).await.unwrap();
    let mut new_leader = client(&cluster.node(3).grpc.clone()).await.unwrap();
    let r = new_leader.append(append(99)).await.unwrap().into_inner();
    assert_eq!(r.first_seqno, 11, "the new history continues after 10");
    let last = converge(&mut cluster, 1).await;
    assert_eq!(last, 11);
    for id in 1..=3 {
        let records = read_all(&cluster.node(id).grpc.clone(), 1, last).await;
        assert_eq!(&records[10].payload[..], b"r99", "node {id} truncated 11..=15 and took the new record");
    }
    let (_, cluster_view) = cluster.coord_get(1, "/v1/cluster").await;
    let last_failover = &cluster_view["recent_failovers"][0];
    assert_eq!(
        (last_failover["reason"].as_str(), &last_failover["lost"]),
        (Some("forced"), &serde_json::json!([11, 15]))
    );
    // What was given up is not counted against the next failover: the
    // commit the old history reached (15) is gone with it, so a plain
    // failover, which refuses to lose committed records, goes through.
    let (code, moved) = cluster.coord_post(1, "/v1/shards/1/failover", r#"{"target": 1}"#, Some(TOKEN)).await;
    assert_eq!(code, 200, "{moved}");
    assert!(moved["lost"].is_null(), "{moved}");
}

/// Two faults at once: the leader dies while one follower has dropped
/// a corrupt tail of committed records (and cannot refetch it) and the
/// other lags. The most up-to-date survivor lacks records a majority held:
/// the automatic failover refuses to promote it (before, it did, and those
/// acknowledged records were gone without a word); a forced one names them.
/// A follower whose data dir was wiped comes back having promised no epoch.
/// A leader deposed meanwhile could still ship to it in its old epoch, and
/// its acknowledgements would make a majority the new leader never had; so
/// it takes nothing from any leader until the coordinator fences or assigns
/// it. Here the coordinator is down: the leader's shipments to the wiped
/// node are refused (`awaiting_assignment`) and, its other follower gone,
/// it acknowledges nothing; the coordinator back, the wiped node is
/// assigned, catches up, and every acknowledged record is everywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wiped_follower_takes_nothing_from_a_leader_until_the_coordinator_assigns_it() {
    let acked: Acked = Arc::default();
    let (mut cluster, mut leader) = led_by_node_1_holding_ten(&acked).await;
    cluster.coordinator(1).kill9();
    cluster.node(3).kill9();
    let data = cluster.node(3).data_dir.clone();
    std::fs::remove_dir_all(&data).unwrap();
    std::fs::create_dir_all(&data).unwrap();
    cluster.restart(3);
    let admin3 = cluster.node(3).admin.clone();
    let refused = "walship_ship_refused_total{reason=\"awaiting_assignment\"}";
    wait_until("node 3 to refuse node 1's shipments", WAIT, || async { common::metric(&admin3, refused).await > 0.0 })
        .await;
    let s3 = entry(&cluster.status(3).await.unwrap(), 1);
    assert_eq!((&s3["role"], &s3["last_seqno"]), (&serde_json::json!("unassigned"), &serde_json::json!(0)), "{s3}");
    // Node 3 is the leader's only follower now: nothing is acknowledged.
    cluster.node(2).kill9();
    let mut request = tonic::Request::new(record_r(11));
    request.set_timeout(Duration::from_secs(3));
    let outcome = leader.append(request).await;
    assert!(outcome.is_err(), "acknowledged with a wiped, unassigned node as the majority: {outcome:?}");
    assert_eq!(entry(&cluster.status(3).await.unwrap(), 1)["last_seqno"], 0, "node 3 took nothing");
    cluster.restart_coordinator(1);
    cluster.restart(2);
    let mut appended = 11;
    wait_until("appends to be acknowledged again", WAIT, || {
        let grpc = futures::executor::block_on(cluster.leader_of(1, 1)).map(|(l, _)| cluster.node(l).grpc.clone());
        let acked = acked.clone();
        appended += 1;
        let i = appended;
        async move {
            let Some(mut leader) = (match grpc {
                Some(grpc) => client(&grpc).await,
                None => None,
            }) else {
                return false;
            };
            append_r(&mut leader, i..=i, Duration::from_secs(2), &acked).await.is_ok()
        }
    })
    .await;
    let last = converge(&mut cluster, 1).await;
    check_history(&mut cluster, 1, last, &acked).await;
}

/// The coordinator's file KV restored from an older copy (what
/// `ops/runbooks/corruption.md` has an operator do with a damaged one)
/// records epochs the replicas promised long ago: every assignment in them
/// is refused. The coordinator sees the replicas report a newer epoch and
/// fails the shard over once, past it, instead of assigning in vain (while
/// the leader lives) or walking up one refused fence at a time (once it is
/// gone); nothing acknowledged is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_on_a_kv_restored_from_an_older_copy_raises_past_every_promised_epoch() {
    let acked: Acked = Arc::default();
    let (mut cluster, _) = led_by_node_1_holding_ten(&acked).await;
    let kv = cluster.dir.path().join("coord").join("kv");
    let copy = cluster.dir.path().join("kv-copy");
    cluster.coordinator(1).kill9();
    copy_files(&kv, &copy);
    let (_, old_epoch) = {
        cluster.restart_coordinator(1);
        wait_leading(&mut cluster, 1, 1).await;
        cluster.leader_of(1, 1).await.unwrap()
    };
    // Eight manual failovers later the replicas have promised epochs the
    // copy never recorded.
    for round in 0..8u32 {
        let to = 2 + round % 2;
        let body = format!(r#"{{"target": {to}}}"#);
        let (code, answer) = cluster.coord_post(1, "/v1/shards/1/failover", &body, Some(TOKEN)).await;
        assert_eq!(code, 200, "{answer}");
        wait_leading(&mut cluster, 1, to).await;
    }
    let (leader_now, promised) = cluster.leader_of(1, 1).await.unwrap();
    assert!(promised >= old_epoch + 8, "{promised} {old_epoch}");
    let mut leader = client(&cluster.node(leader_now).grpc.clone()).await.unwrap();
    append_r(&mut leader, 11..=15, WAIT, &acked).await.unwrap();
    cluster.coordinator(1).kill9();
    std::fs::remove_dir_all(&kv).unwrap();
    copy_files(&copy, &kv);
    cluster.restart_coordinator(1);
    wait_until("the restored coordinator to record an epoch past every promised one", WAIT, || {
        let recorded = futures::executor::block_on(cluster.leader_of(1, 1));
        async move { recorded.is_some_and(|(_, epoch)| epoch > promised) }
    })
    .await;
    // And it fails over as it should from there: the leader killed, one
    // of the others leads in a newer epoch.
    let (leader_now, epoch) = cluster.leader_of(1, 1).await.unwrap();
    wait_leading(&mut cluster, 1, leader_now).await;
    cluster.node(leader_now).kill9();
    let next = cluster.wait_leader(1, Some(leader_now), WAIT).await;
    let (_, after) = cluster.leader_of(1, 1).await.unwrap();
    assert!(after > epoch, "{after} {epoch}");
    let mut leader = client(&cluster.node(next).grpc.clone()).await.unwrap();
    append_r(&mut leader, 16..=20, WAIT, &acked).await.unwrap();
    cluster.restart(leader_now);
    let last = converge(&mut cluster, 1).await;
    check_history(&mut cluster, 1, last, &acked).await;
}

/// Copies the files of `from` (no subdirectories) into a new `to`.
fn copy_files(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_automatic_failover_to_a_replica_missing_committed_records() {
    let (mut cluster, mut leader) = led_by_node_1_holding_ten(&Acked::default()).await;
    let append = record_r;
    // Node 3 lags from here; 11..=20 are acknowledged by nodes 1 and 2.
    common::pause_shard(&cluster.node(3).grpc, 1, true).await;
    for i in 11..=20 {
        leader.append(append(i)).await.unwrap();
    }
    wait_until("node 2 to know 20 committed", WAIT, || {
        let status = futures::executor::block_on(cluster.status(2));
        async move { status.is_some_and(|s| entry(&s, 1)["commit_seqno"] == 20) }
    })
    .await;
    // Node 2 damages its copy of 15 and drops its tail from the damage on;
    // paused, it cannot refetch it.
    common::pause_shard(&cluster.node(2).grpc, 1, true).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", cluster.node(2).grpc))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let damage = walship_proto::log::DamageRecordRequest { shard_id: 1, seqno: 15 };
    let damaged = ControlClient::new(common::as_member(channel)).damage_record(damage).await.unwrap().into_inner();
    let first_bad = damaged.first_bad_seqno;
    assert!((11..=15).contains(&first_bad), "{damaged:?}");
    wait_until("node 2 to drop its corrupt tail", WAIT, || {
        let status = futures::executor::block_on(cluster.status(2));
        async move { status.is_some_and(|s| entry(&s, 1)["last_seqno"].as_u64() < Some(first_bad)) }
    })
    .await;
    cluster.node(1).kill9();
    let coordinator = cluster.coordinator(1).admin.clone();
    let refused = || async {
        let body = common::http_get(&format!("{coordinator}/metrics")).await.1;
        body.lines()
            .filter(|l| l.starts_with("walship_failovers_total") && l.contains("outcome=\"refused\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    wait_until("the coordinator to refuse the automatic failover", WAIT, || {
        let refused = futures::executor::block_on(refused());
        async move { refused > 0.0 }
    })
    .await;
    let (_, shard) = cluster.coord_get(1, "/v1/shards/1").await;
    assert!(shard["leader"].is_null(), "nobody leads with committed records missing: {shard}");
    // The preview names the range the best survivor lacks.
    let (code, preview) = cluster.coord_post(1, "/v1/shards/1/failover", r#"{"preview": true}"#, Some(TOKEN)).await;
    assert_eq!(code, 200, "{preview}");
    let best = preview["candidates"].as_array().unwrap().iter().find(|c| c["is_best"] == true).cloned().unwrap();
    assert_eq!(best["node"], 2, "{preview}");
    assert_eq!(best["would_lose_acknowledged"], serde_json::json!([first_bad, 20]), "{preview}");
    // Forced, the loss is recorded as such.
    let (code, forced) = cluster.coord_post(1, "/v1/shards/1/failover", r#"{"allow_loss": true}"#, Some(TOKEN)).await;
    assert_eq!(code, 200, "{forced}");
    assert_eq!((&forced["to"], &forced["lost"]), (&serde_json::json!(2), &serde_json::json!([first_bad, 20])));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_append_finds_the_new_leader_after_a_failover() {
    let mut cluster = Cluster::start_with(3, 1, 1, FAST, None);
    wait_leading(&mut cluster, 1, 1).await;
    let servers: Vec<String> = cluster.nodes.iter().map(|n| n.grpc.clone()).collect();
    let run = move |input: &'static str| {
        let mut child = std::process::Command::new(common::walship_bin())
            .args(["append", "--json", "--shard", "1", "--deadline", "20s", "--server", &servers.join(",")])
            .env("WALSHIP_LOG", "warn")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
        child.wait_with_output().unwrap()
    };
    let first = run("a\nb\n");
    assert!(first.status.success());
    cluster.node(1).kill9();
    // Node 1 is first in --server and dead: the client moves on, follows the
    // not-leader hint or waits out the failover, and the append lands.
    let second = tokio::task::spawn_blocking(move || run("c\n")).await.unwrap();
    let out = String::from_utf8_lossy(&second.stdout).to_string();
    assert!(second.status.success(), "{out}");
    let line: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert_eq!(line["outcome"], "acknowledged");
    assert_eq!(line["first_seqno"], 3);
    assert!(line["epoch"].as_u64().unwrap() >= 2, "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_automatic_failover_without_a_majority_but_a_forced_one_works() {
    let mut cluster = Cluster::start_with(3, 1, 1, FAST, None);
    wait_leading(&mut cluster, 1, 1).await;
    let mut leader = client(&cluster.node(1).grpc.clone()).await.unwrap();
    let append = |text: &str, durability: Durability| AppendRequest {
        shard_id: 1,
        records: vec![AppendRecord { key: Bytes::new(), payload: Bytes::from(text.to_string()) }],
        durability: durability as i32,
        ..Default::default()
    };
    for i in 0..5 {
        leader.append(append(&format!("r{i}"), Durability::All)).await.unwrap();
    }
    cluster.node(1).kill9();
    cluster.node(2).kill9();
    // The coordinator tries, finds one replica of three, and promotes nobody.
    let coord_admin = cluster.coordinator(1).admin.clone();
    wait_until("three failover attempts refused for lack of a majority", WAIT, || {
        let url = format!("{coord_admin}/metrics");
        async move {
            let body = common::http_get(&url).await.1;
            body.lines()
                .find(|l| l.starts_with("walship_failovers_total{outcome=\"no_majority\",reason=\"automatic\"}"))
                .and_then(|l| l.split_whitespace().last()?.parse::<f64>().ok())
                .is_some_and(|n| n >= 3.0)
        }
    })
    .await;
    let (code, shard) = cluster.coord_get(1, "/v1/shards/1").await;
    assert_eq!(code, 200);
    assert!(shard["leader"].is_null(), "no leader without a majority: {shard}");
    let s3 = entry(&cluster.status(3).await.unwrap(), 1);
    assert_ne!(s3["role"], "leader", "node 3 must not lead on its own: {s3}");

    // The operator forces it, knowingly.
    let (code, refused) = cluster.coord_post(1, "/v1/shards/1/failover", r#"{"target": 3}"#, Some(TOKEN)).await;
    assert_ne!(code, 200, "without allow_loss a lone replica is not promoted: {refused}");
    let (code, forced) =
        cluster.coord_post(1, "/v1/shards/1/failover", r#"{"target": 3, "allow_loss": true}"#, Some(TOKEN)).await;
    assert_eq!(code, 200, "{forced}");
    assert_eq!(forced["to"], 3);
    wait_leading(&mut cluster, 1, 3).await;
    let mut node3 = client(&cluster.node(3).grpc.clone()).await.unwrap();
    let r = node3.append(append("alone", Durability::Local)).await.unwrap().into_inner();
    assert_eq!(r.first_seqno, 6, "node 3 held all five ALL-acknowledged records");
    // The others come back, follow node 3, and converge on its history.
    cluster.restart(1);
    cluster.restart(2);
    let last = converge(&mut cluster, 1).await;
    assert_eq!(last, 6);
    for id in 1..=3 {
        let records = read_all(&cluster.node(id).grpc.clone(), 1, last).await;
        assert_eq!(&records[5].payload[..], b"alone", "node {id}");
    }
}

/// Early shipping's hazard, injected: the leader ships a batch, dies before
/// that batch reaches its own disk (what a machine crash does; a SIGKILL
/// cannot, the page cache survives it), and comes back within the loss
/// timeout. It must not lead again in the same epoch: its log lacks seqnos
/// the followers hold, and new records there would diverge from theirs.
/// The coordinator raises the epoch instead, and everything acknowledged
/// survives on replicas that end byte-identical.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_lost_shipped_records_never_leads_their_epoch_again() {
    let node_args = vec![(1, vec!["--fault-unwritten-batch-after".to_string(), "400".to_string()])];
    let mut cluster = Cluster::launch(&common::ClusterSpec {
        coordinators: 1,
        replication: FAST,
        node_args,
        ..common::ClusterSpec::default()
    });
    wait_leading(&mut cluster, 1, 1).await;
    let nodes: Vec<String> = cluster.nodes.iter().map(|n| n.grpc.clone()).collect();
    let admin = cluster.coordinator(1).admin.clone();
    let acked: Acked = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> =
        (0..4).map(|_| load(nodes.clone(), admin.clone(), 1, acked.clone(), stop.clone(), count.clone())).collect();

    // The injected fault aborts node 1 after 400 leader records.
    let exited = {
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            if let Some(status) = cluster.node(1).child.try_wait().unwrap() {
                break status;
            }
            assert!(std::time::Instant::now() < deadline, "the injected fault did not fire");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(exited.signal(), Some(libc::SIGABRT), "node 1 aborted by the injected fault: {exited:?}");
    // Back at once, well within the 1 s loss timeout, on its shorter log.
    cluster.restart(1);
    let (_, epoch_at_fault) = cluster.leader_of(1, 1).await.unwrap_or((0, 1));

    wait_for_more_appends(&count, 200, "appends to flow again").await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let last = converge(&mut cluster, 1).await;
    let (leader, epoch) = cluster.leader_of(1, 1).await.unwrap();
    let acknowledged = check_history(&mut cluster, 1, last, &acked).await;
    eprintln!(
        "fault at epoch {epoch_at_fault}; now node {leader} leads epoch {epoch}; {acknowledged} acknowledged records present, replicas identical through {last}"
    );
    assert!(epoch >= 2, "the restarted leader must not have led epoch 1 again");
}

/// A bulk failover decides each shard on its own. Node 1 leads eight
/// shards and dies with node 2: the four whose replicas are {1, 3, 4}
/// still have a majority and fail over to node 3 or 4 with every
/// acknowledged record; the four whose replicas are {1, 2, 3} have one
/// replica of three and get no leader, in the same bulks. Once node 2 is
/// back, they fail over too, with theirs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_failover_fails_each_shard_over_or_refuses_it_on_its_own() {
    let stranded = [1u32, 2, 3, 4];
    let movable = [5u32, 6, 7, 8];
    let spec = common::ClusterSpec {
        nodes: 4,
        shards: 8,
        coordinators: 1,
        replication: FAST,
        shard_replicas: (1..=8)
            .map(|s| (s, if stranded.contains(&s) { vec![1, 2, 3] } else { vec![1, 3, 4] }))
            .collect(),
        ..common::ClusterSpec::default()
    };
    let mut cluster = Cluster::launch(&spec);
    // Polled in this task (no helper that blocks inside a closure).
    let deadline = std::time::Instant::now() + WAIT;
    for shard in 1..=8 {
        while !(cluster.leader_of(1, shard).await.is_some_and(|(l, _)| l == 1) && cluster.leads(1, shard).await) {
            poll_again(deadline, &format!("shard {shard} led by node 1")).await;
        }
    }
    let mut leader = client(&cluster.node(1).grpc.clone()).await.unwrap();
    let payload = |shard: u32, i: u32| Bytes::from(format!("shard {shard} record {i}"));
    for shard in 1..=8 {
        let records = (1..=3).map(|i| AppendRecord { key: Bytes::new(), payload: payload(shard, i) }).collect();
        let request =
            AppendRequest { shard_id: shard, records, durability: Durability::All as i32, ..Default::default() };
        let r = leader.append(request).await.unwrap().into_inner();
        assert_eq!(r.first_seqno, 1);
    }
    // The cluster summary counts the shards led as their records say.
    while cluster.coord_get(1, "/v1/cluster").await.1["shards_leading"] != 8 {
        poll_again(deadline, "the summary to count 8 shards led").await;
    }
    let coord_admin = cluster.coordinator(1).admin.clone();
    let bulks_before = common::metric(&coord_admin, "walship_bulk_failover_shards_count ").await;
    cluster.node(1).kill9();
    cluster.node(2).kill9();

    let deadline = std::time::Instant::now() + WAIT;
    for shard in movable {
        while !cluster.leader_of(1, shard).await.is_some_and(|(l, epoch)| (l == 3 || l == 4) && epoch > 1) {
            poll_again(deadline, &format!("shard {shard} led by node 3 or 4")).await;
        }
    }
    let no_majority = "walship_failovers_total{outcome=\"no_majority\",reason=\"automatic\"} ";
    while common::metric(&coord_admin, no_majority).await < stranded.len() as f64 {
        poll_again(deadline, "shards 1-4 refused for want of a majority").await;
    }
    for shard in stranded {
        let (code, record) = cluster.coord_get(1, &format!("/v1/shards/{shard}")).await;
        assert_eq!(code, 200);
        assert!(record["leader"].is_null(), "shard {shard} has one replica of three and no leader: {record}");
    }
    // Only the moved shards are led now.
    loop {
        let (_, summary) = cluster.coord_get(1, "/v1/cluster").await;
        if summary["shards_leading"] == 4 {
            assert_eq!(summary["shards_without_leader"], 4, "{summary}");
            break;
        }
        poll_again(deadline, "the summary to count the 4 moved shards led").await;
    }
    // The eight shards were lost together: some bulk took more than one.
    let total = common::metric(&coord_admin, "walship_bulk_failover_shards_count ").await;
    let alone = common::metric(&coord_admin, "walship_bulk_failover_shards_bucket{le=\"1\"} ").await;
    assert!(
        total > bulks_before && alone < total,
        "{} bulks since the kill, {alone} of {total} with one shard",
        total - bulks_before
    );
    for shard in movable {
        assert_records_on_leader(&mut cluster, shard, (1..=3).map(|i| payload(shard, i)).collect(), deadline).await;
    }

    cluster.restart(2);
    let deadline = std::time::Instant::now() + WAIT;
    for shard in stranded {
        while !cluster.leader_of(1, shard).await.is_some_and(|(l, _)| l == 2 || l == 3) {
            poll_again(deadline, &format!("shard {shard} led by node 2 or 3")).await;
        }
        assert_records_on_leader(&mut cluster, shard, (1..=3).map(|i| payload(shard, i)).collect(), deadline).await;
    }
    while cluster.coord_get(1, "/v1/cluster").await.1["shards_leading"] != 8 {
        poll_again(deadline, "the summary to count 8 shards led again").await;
    }
}

/// One more poll of a condition before `deadline`, after a pause; past it,
/// a failure naming `what` was waited for.
async fn poll_again(deadline: std::time::Instant, what: &str) {
    assert!(std::time::Instant::now() < deadline, "{what}");
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// Waits (until `deadline`) for the recorded leader of `shard` to commit
/// every record of `expected`, then reads them back from it.
async fn assert_records_on_leader(
    cluster: &mut Cluster,
    shard: u32,
    expected: Vec<Bytes>,
    deadline: std::time::Instant,
) {
    let (node, _) = cluster.leader_of(1, shard).await.unwrap();
    let count = expected.len() as u64;
    while cluster.status(node).await.is_none_or(|s| entry(&s, shard)["commit_seqno"].as_u64().unwrap_or(0) < count) {
        poll_again(deadline, &format!("shard {shard}'s new leader, node {node}, committing {count}")).await;
    }
    let records = read_all(&cluster.node(node).grpc.clone(), shard, count).await;
    let payloads: Vec<Bytes> = records.iter().map(|r| r.payload.clone()).collect();
    assert_eq!(payloads, expected, "shard {shard} on node {node}");
}

/// The shards a lost node led are spread over the survivors: among
/// replicas equally caught up (idle shards all are), the one leading the
/// fewest shards is promoted, not the lowest node id. Before, every idle
/// shard of a lost node went to node 1, and a cluster whose nodes came up
/// one by one ended with node 1 leading all 1,000 shards of a benchmark.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_nodes_idle_shards_are_spread_over_the_survivors() {
    const SHARDS: u32 = 12;
    let mut cluster = Cluster::start_with(3, SHARDS, 1, FAST, None);
    let deadline = std::time::Instant::now() + WAIT;
    let before = leaders_once(&mut cluster, SHARDS, deadline, "every shard led", |_| true).await;
    let count = |led: &[u64], node: u64| led.iter().filter(|&&l| l == node).count();
    // The node leading the most goes (a third of the shards, as placed).
    let victim = (1..=3).max_by_key(|&n| (count(&before, n), n)).unwrap();
    let lost = count(&before, victim);
    assert!(lost >= 2, "node {victim} leads {lost} of {before:?}");
    let survivors: Vec<u64> = (1..=3).filter(|&n| n != victim).collect();
    cluster.node(victim as u32).kill9();

    let what = format!("every shard of node {victim} led by a survivor");
    let after = leaders_once(&mut cluster, SHARDS, deadline, &what, |l| l != victim).await;
    let (a, b) = (survivors[0], survivors[1]);
    let gained = |n: u64| count(&after, n) - count(&before, n);
    assert_eq!(gained(a) + gained(b), lost, "before {before:?}, after {after:?}");
    // Every tie went to the survivor leading fewer: each took some, and the
    // difference between them did not grow past one.
    let gap = |led: &[u64]| count(led, a).abs_diff(count(led, b));
    assert!(gained(a) > 0 && gained(b) > 0, "node {victim}'s {lost} shards all went one way: {before:?} -> {after:?}");
    assert!(gap(&after) <= gap(&before).max(1), "{before:?} -> {after:?}");
}

/// Every shard's recorded leader (shard i's at i-1), once all `shards`
/// have one that `ready` accepts; polled until `deadline`.
async fn leaders_once(
    cluster: &mut Cluster,
    shards: u32,
    deadline: std::time::Instant,
    what: &str,
    ready: impl Fn(u64) -> bool,
) -> Vec<u64> {
    loop {
        let (code, list) = cluster.coord_get(1, &format!("/v1/shards?limit={shards}")).await;
        // 503 until the coordinator wrote its first state.
        assert!(code == 200 || code == 503, "{code}: {list}");
        let led: Vec<Option<u64>> = match code {
            200 => list.as_array().expect("a list of shards").iter().map(|s| s["leader"].as_u64()).collect(),
            _ => Vec::new(),
        };
        if led.len() == shards as usize && led.iter().all(|l| l.is_some_and(&ready)) {
            return led.into_iter().map(Option::unwrap).collect();
        }
        poll_again(deadline, what).await;
    }
}

/// A cluster brought up coordinator first fails nothing over as its nodes
/// come up: a leader the coordinator has not heard from yet counts its
/// silence from when the coordinator first heard one of its shard's
/// replicas, not from the coordinator's own start. Counted from there, the
/// node reporting first took over the shards of the nodes reporting a
/// moment after it (a third of 1,000 shards in a benchmark, and a 1-shard
/// benchmark's only shard one start in four).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_started_after_the_coordinator_keep_their_configured_leaderships() {
    const SHARDS: u32 = 12;
    let mut cluster = Cluster::launch(&common::ClusterSpec {
        shards: SHARDS,
        coordinators: 1,
        replication: FAST,
        coordinators_first: Some(Duration::from_secs(2)),
        ..Default::default()
    });
    let configured: Vec<u64> = (1..=SHARDS as u64).map(|s| (s - 1) % 3 + 1).collect();
    let deadline = std::time::Instant::now() + WAIT;
    leaders_once(&mut cluster, SHARDS, deadline, "every shard led", |_| true).await;
    for id in 1..=3 {
        for shard in (id..=SHARDS).step_by(3) {
            cluster.wait_node_leads(id, shard, WAIT).await;
        }
    }
    // Past the failure timeout (1 s here) from the last node's start: a
    // failover of a leader thought lost would have happened by now.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (code, list) = cluster.coord_get(1, &format!("/v1/shards?limit={SHARDS}")).await;
    assert_eq!(code, 200, "{list}");
    let now: Vec<(u64, u64)> = list
        .as_array()
        .expect("a list of shards")
        .iter()
        .map(|s| (s["leader"].as_u64().unwrap_or(0), s["epoch"].as_u64().unwrap_or(0)))
        .collect();
    let expected: Vec<(u64, u64)> = configured.iter().map(|&l| (l, 1)).collect();
    assert_eq!(now, expected, "(leader, epoch) of every shard against the configured ones at epoch 1");
    let metrics = common::http_get(&format!("{}/metrics", cluster.coordinator(1).admin)).await.1;
    let failovers: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("walship_failovers_total{"))
        .filter(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) != Some(0.0))
        .collect();
    assert!(failovers.is_empty(), "failovers while the nodes came up: {failovers:?}");
}
