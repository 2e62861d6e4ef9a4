//! Exactly-once appends through failures, against real processes: clients
//! append as producers and retry every unknown outcome with the same
//! sequences; leaders (and a coordinator) are killed with `kill -9`. The
//! checker finds every acknowledged record exactly once, no record twice,
//! each producer's sequences contiguous and seqnos contiguous. Dedupe is
//! also checked after every node restarts, after a follower that was behind
//! becomes leader, after compaction past the producer's last write, and
//! after the producer restarts with a new epoch. Randomised choices print
//! their seed: `WALSHIP_SEED=<n>` replays.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::history::{FAST, WAIT, check_history, client, converge, entry, wait_leading};
use common::{Acked, Cluster, ClusterSpec, TOKEN, read_all, wait_until};
use rand::{Rng, SeedableRng};
use tonic::transport::Channel;
use walship_proto::log::control_client::ControlClient;
use walship_proto::log::log_client::LogClient;
use walship_proto::log::{AppendRecord, AppendRequest, AppendResponse, Durability, PauseRequest, Producer, Record};

/// What the producer clients saw.
#[derive(Default)]
struct Seen {
    /// Attempts whose outcome was unknown (no answer, or the leader lost its
    /// lease or leadership while waiting) and were retried.
    unknown: AtomicU64,
    /// Retries answered as duplicates: the first attempt had landed.
    duplicates: AtomicU64,
    /// Batches acknowledged.
    batches: AtomicU64,
}

/// The payload of producer `id`'s record of `sequence` on `shard`: unique,
/// so a record written twice shows up as a repeated payload.
fn payload(shard: u32, id: u64, sequence: u64) -> Bytes {
    Bytes::from(format!("s{shard}-p{id}-q{sequence}"))
}

/// A client of the shard's leader among `nodes`: it follows not-leader
/// hints and otherwise tries the nodes in turn.
struct LeaderFinder {
    nodes: Vec<String>,
    next: usize,
    current: Option<LogClient<Channel>>,
    hint: Option<String>,
}

impl LeaderFinder {
    fn new(nodes: Vec<String>) -> LeaderFinder {
        LeaderFinder { nodes, next: 0, current: None, hint: None }
    }

    async fn client(&mut self) -> Option<LogClient<Channel>> {
        if self.current.is_none() {
            let target = self.hint.take().unwrap_or_else(|| {
                self.next += 1;
                self.nodes[self.next % self.nodes.len()].clone()
            });
            self.current = client(&target).await;
        }
        self.current.clone()
    }

    /// Drops the current node, following `status`'s leader hint if any.
    fn failed(&mut self, status: Option<&tonic::Status>) {
        self.current = None;
        self.hint = status
            .and_then(|s| s.metadata().get(walship_proto::LEADER_METADATA_KEY))
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once('@').map(|(_, addr)| addr.to_string()));
    }
}

/// Sends `request` until it is answered: the same request (same producer
/// sequences) through every failover. Panics on a producer refusal (a retry
/// must never be refused) and after `give_up`; and on a duplicate answer to
/// a first attempt unless the request is itself a retry (`is_retry`).
async fn append_exactly_once(
    finder: &mut LeaderFinder,
    request: &AppendRequest,
    seen: &Seen,
    give_up: Duration,
    is_retry: bool,
) -> AppendResponse {
    let started = Instant::now();
    let mut retried = is_retry;
    loop {
        assert!(started.elapsed() < give_up, "no leader answered {:?} within {give_up:?}", request.producer);
        let Some(mut log) = finder.client().await else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let mut call = tonic::Request::new(request.clone());
        call.set_timeout(Duration::from_secs(3));
        match log.append(call).await {
            Ok(answer) => {
                let answer = answer.into_inner();
                if answer.duplicate {
                    seen.duplicates.fetch_add(1, Ordering::Relaxed);
                    assert!(retried, "a first attempt answered as a duplicate: {request:?}");
                }
                seen.batches.fetch_add(1, Ordering::Relaxed);
                return answer;
            }
            Err(status) => {
                assert!(
                    walship_proto::refusal(&status).is_none() && status.code() != tonic::Code::AlreadyExists,
                    "a retry was refused: {status:?}"
                );
                let not_leader = status.metadata().get(walship_proto::LEADER_METADATA_KEY).is_some()
                    || status.message().contains("no leader assigned")
                    || status.message().contains("it was not written");
                if !not_leader {
                    seen.unknown.fetch_add(1, Ordering::Relaxed);
                    retried = true;
                }
                finder.failed(Some(&status));
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

/// Producer `id` appends batches of 1-3 records to `shard` until `stop`,
/// finishing the batch in flight; returns its last acknowledged sequence.
fn producer_load(
    nodes: Vec<String>,
    shard: u32,
    id: u64,
    acked: Acked,
    stop: Arc<AtomicBool>,
    seen: Arc<Seen>,
) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let mut finder = LeaderFinder::new(nodes);
        let mut sequence = 1u64;
        while !stop.load(Ordering::Relaxed) {
            let n = 1 + sequence % 3;
            let records: Vec<AppendRecord> =
                (0..n).map(|i| AppendRecord { key: Bytes::new(), payload: payload(shard, id, sequence + i) }).collect();
            let request = AppendRequest {
                shard_id: shard,
                records,
                durability: Durability::Quorum as i32,
                producer: Some(Producer { id, epoch: 1, sequence }),
                expected_last_seqno: None,
            };
            let answer = append_exactly_once(&mut finder, &request, &seen, Duration::from_secs(90), false).await;
            assert_eq!(answer.last_seqno - answer.first_seqno + 1, n, "{answer:?}");
            let mut acked = acked.lock().await;
            let shard_acked = acked.entry(shard).or_default();
            for (i, record) in request.records.iter().enumerate() {
                let seqno = answer.first_seqno + i as u64;
                if let Some(previous) = shard_acked.insert(seqno, record.payload.clone()) {
                    assert_eq!(previous, record.payload, "shard {shard} seqno {seqno} acknowledged for two records");
                }
            }
            sequence += n;
        }
        sequence - 1
    })
}

/// Every record of `records` appears once; each producer's records carry
/// stamps that match their payloads, with sequences `1..=last` in log
/// order, where `last` is what the producer had acknowledged.
fn check_exactly_once(shard: u32, records: &[Record], producers: &HashMap<u64, u64>) {
    let mut payloads = HashMap::new();
    for r in records {
        if let Some(previous) = payloads.insert(r.payload.clone(), r.seqno) {
            panic!("shard {shard}: {:?} written twice, at seqnos {previous} and {}", r.payload, r.seqno);
        }
    }
    let mut next: HashMap<u64, u64> = HashMap::new();
    for r in records {
        let p = r.producer.unwrap_or_else(|| panic!("shard {shard} seqno {} has no producer stamp", r.seqno));
        assert_eq!(r.payload, payload(shard, p.id, p.sequence), "shard {shard} seqno {}: stamp {p:?}", r.seqno);
        let expected = next.entry(p.id).or_insert(1);
        assert_eq!(p.sequence, *expected, "shard {shard}: producer {} out of sequence at seqno {}", p.id, r.seqno);
        *expected += 1;
    }
    for (id, last) in producers {
        assert_eq!(next.get(id).copied().unwrap_or(1) - 1, *last, "shard {shard}: producer {id}'s records");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producers_append_exactly_once_through_leader_and_coordinator_kills() {
    let seed: u64 = std::env::var("WALSHIP_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random);
    eprintln!("WALSHIP_SEED={seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut cluster = Cluster::start_with(3, 2, 2, FAST, None);
    let nodes: Vec<String> = cluster.nodes.iter().map(|n| n.grpc.clone()).collect();
    let acked: Acked = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Seen::default());
    let mut tasks = Vec::new();
    for shard in [1u32, 2] {
        for _ in 0..3 {
            let id = rng.gen_range(1..=u64::MAX);
            let task = producer_load(nodes.clone(), shard, id, acked.clone(), stop.clone(), seen.clone());
            tasks.push((shard, id, task));
        }
    }
    // The coordinator that answers: c1, or c2 while c1 is down.
    let mut coordinator = 1;
    let leaders = |c: &mut Cluster, coordinator: u32| {
        let a = futures::executor::block_on(c.leader_of(coordinator, 1));
        let b = futures::executor::block_on(c.leader_of(coordinator, 2));
        (a, b)
    };
    let mut kills = 0;
    while kills < 20 {
        let before = seen.batches.load(Ordering::Relaxed);
        wait_until("appends to flow", WAIT, || {
            let seen = seen.clone();
            async move { seen.batches.load(Ordering::Relaxed) >= before + 30 }
        })
        .await;
        if kills == 8 {
            cluster.coordinator(1).kill9();
            coordinator = 2;
            eprintln!("killed coordinator c1");
        }
        if kills == 14 {
            cluster.restart_coordinator(1);
            eprintln!("restarted coordinator c1");
        }
        let (Some((l1, e1)), Some((l2, e2))) = leaders(&mut cluster, coordinator) else {
            // The standby has not taken over yet.
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        let victim = if rng.gen_bool(0.5) { l1 } else { l2 };
        cluster.node(victim).kill9();
        kills += 1;
        eprintln!("kill {kills}: node {victim} (leaders {l1}@{e1}, {l2}@{e2})");
        wait_until("new leaders for the victim's shards", WAIT, || {
            let (a, b) = leaders(&mut cluster, coordinator);
            let ok = [(a, l1, e1), (b, l2, e2)].iter().all(|(now, old, old_epoch)| match now {
                Some((leader, epoch)) => *old != victim || (*leader != victim && epoch > old_epoch),
                None => false,
            });
            async move { ok }
        })
        .await;
        cluster.restart(victim);
        wait_until("the restarted node to follow again", WAIT, || {
            let s = futures::executor::block_on(cluster.status(victim));
            let ok = s.is_some_and(|s| [1, 2].iter().all(|&sh| entry(&s, sh)["role"] != "unassigned"));
            async move { ok }
        })
        .await;
    }
    stop.store(true, Ordering::Relaxed);
    let mut producers: BTreeMap<u32, HashMap<u64, u64>> = BTreeMap::new();
    for (shard, id, task) in tasks {
        producers.entry(shard).or_default().insert(id, task.await.unwrap());
    }
    let mut total = 0;
    for shard in [1, 2] {
        let last = converge(&mut cluster, shard).await;
        total += check_history(&mut cluster, shard, last, &acked).await;
        let records = read_all(&cluster.node(1).grpc.clone(), shard, last).await;
        check_exactly_once(shard, &records, &producers[&shard]);
    }
    let (unknown, duplicates) = (seen.unknown.load(Ordering::Relaxed), seen.duplicates.load(Ordering::Relaxed));
    eprintln!(
        "{kills} leader kills and a coordinator kill: {total} acknowledged records each exactly once; \
         {unknown} unknown outcomes retried, {duplicates} of them answered as duplicates"
    );
    assert!(unknown > 0, "no attempt had an unknown outcome: the kills did not exercise the retries");
    assert!(total > 0);
}

/// A 3-node cluster with one coordinator and one shard led by node 1.
async fn three_nodes(extra: &str, node_args: Vec<(u32, Vec<String>)>) -> Cluster {
    let replication = format!("{FAST}\n{extra}");
    let mut cluster = Cluster::launch(&ClusterSpec {
        nodes: 3,
        shards: 1,
        coordinators: 1,
        replication: &replication,
        node_args,
        ..ClusterSpec::default()
    });
    wait_leading(&mut cluster, 1, 1).await;
    cluster
}

fn batch(id: u64, epoch: u64, sequence: u64, n: u64) -> AppendRequest {
    AppendRequest {
        shard_id: 1,
        records: (0..n).map(|i| AppendRecord { key: Bytes::new(), payload: payload(1, id, sequence + i) }).collect(),
        durability: Durability::Quorum as i32,
        producer: Some(Producer { id, epoch, sequence }),
        expected_last_seqno: None,
    }
}

fn plain(n: usize, size: usize) -> AppendRequest {
    AppendRequest {
        shard_id: 1,
        records: (0..n).map(|_| AppendRecord { key: Bytes::new(), payload: Bytes::from(vec![b'x'; size]) }).collect(),
        durability: Durability::Quorum as i32,
        ..Default::default()
    }
}

/// Sends `request` to the shard's leader (through failovers) and answers.
async fn send(cluster: &Cluster, request: &AppendRequest) -> AppendResponse {
    let mut finder = LeaderFinder::new(cluster.nodes.iter().map(|n| n.grpc.clone()).collect());
    append_exactly_once(&mut finder, request, &Seen::default(), WAIT, false).await
}

/// Sends a retry of `request` (it may be answered as a duplicate).
async fn resend(cluster: &Cluster, request: &AppendRequest) -> AppendResponse {
    let mut finder = LeaderFinder::new(cluster.nodes.iter().map(|n| n.grpc.clone()).collect());
    append_exactly_once(&mut finder, request, &Seen::default(), WAIT, true).await
}

/// A retry of `request`, written at `original`, is answered as a duplicate
/// with the same seqnos, and writes nothing: plain records appended just
/// before and just after it are neighbours.
async fn assert_duplicate(cluster: &Cluster, request: &AppendRequest, original: &AppendResponse) {
    let before = send(cluster, &plain(1, 1)).await;
    let retry = resend(cluster, request).await;
    assert!(retry.duplicate, "{retry:?}");
    assert_eq!((retry.first_seqno, retry.last_seqno), (original.first_seqno, original.last_seqno));
    let after = send(cluster, &plain(1, 1)).await;
    assert_eq!(after.first_seqno, before.last_seqno + 1, "the retry wrote nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedupe_survives_a_restart_of_every_node() {
    let mut cluster = three_nodes("", Vec::new()).await;
    let first = batch(7, 1, 1, 3);
    let written = send(&cluster, &first).await;
    send(&cluster, &plain(5, 10)).await;
    let second = batch(7, 1, 4, 2);
    let written_second = send(&cluster, &second).await;
    converge(&mut cluster, 1).await;
    for id in 1..=3 {
        cluster.node(id).kill9();
    }
    for id in 1..=3 {
        cluster.restart(id);
    }
    assert_duplicate(&cluster, &second, &written_second).await;
    assert_duplicate(&cluster, &first, &written).await;
    let next = send(&cluster, &batch(7, 1, 6, 1)).await;
    assert!(!next.duplicate);
    // A gap is still refused after the restart.
    let (leader, _) = cluster.leader_of(1, 1).await.unwrap();
    let mut leader = client(&cluster.node(leader).grpc.clone()).await.unwrap();
    let gap = leader.append(batch(7, 1, 9, 1)).await.unwrap_err();
    assert_eq!(walship_proto::refusal(&gap), Some(walship_proto::REFUSAL_PRODUCER_SEQUENCE), "{gap:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_that_was_behind_dedupes_once_it_leads() {
    let mut cluster = three_nodes("", Vec::new()).await;
    let node3 = common::as_member(
        tonic::transport::Endpoint::from_shared(format!("http://{}", cluster.node(3).grpc))
            .unwrap()
            .connect()
            .await
            .unwrap(),
    );
    // Node 3 stops receiving while the producer writes; it catches up by
    // the catch-up stream once resumed, and builds its table from that.
    ControlClient::new(node3.clone()).pause(PauseRequest { shard_id: 1, paused: true }).await.unwrap();
    let mut written = Vec::new();
    for s in 0..5 {
        let request = batch(9, 1, 1 + s * 2, 2);
        let answer = send(&cluster, &request).await;
        written.push((request, answer));
        send(&cluster, &plain(3, 10)).await;
    }
    ControlClient::new(node3).pause(PauseRequest { shard_id: 1, paused: false }).await.unwrap();
    converge(&mut cluster, 1).await;
    let (code, body) = cluster.coord_post(1, "/v1/shards/1/failover", r#"{"target": 3}"#, Some(TOKEN)).await;
    assert_eq!(code, 200, "{body}");
    wait_leading(&mut cluster, 1, 3).await;
    for (request, answer) in &written {
        assert_duplicate(&cluster, request, answer).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedupe_survives_compaction_past_the_producers_last_write() {
    let snapshots = vec!["--wal-producer-snapshot-bytes".to_string(), "65536".to_string()];
    let mut cluster = three_nodes(
        "retain_bytes = 20000\nmax_retain_bytes = 200000\nretention_interval_ms = 100",
        (1..=3).map(|id| (id, snapshots.clone())).collect(),
    )
    .await;
    let request = batch(11, 1, 1, 3);
    let written = send(&cluster, &request).await;
    // ~400 KB of plain records: past several snapshots and far past
    // retain_bytes, so every replica compacts the producer's records away.
    for _ in 0..40 {
        send(&cluster, &plain(10, 1000)).await;
    }
    wait_until("every replica to compact past the producer's records", WAIT, || {
        let firsts: Vec<u64> = (1..=3)
            .map(|id| {
                let s = futures::executor::block_on(cluster.status(id));
                s.map_or(0, |s| entry(&s, 1)["first_seqno"].as_u64().unwrap_or(0))
            })
            .collect();
        async move { firsts.iter().all(|f| *f > written.last_seqno) }
    })
    .await;
    assert_duplicate(&cluster, &request, &written).await;
    // And on a restarted leader, and on its successor.
    cluster.restart_with_args(1);
    assert_duplicate(&cluster, &request, &written).await;
    let (leader, _) = cluster.leader_of(1, 1).await.unwrap();
    cluster.node(leader).kill9();
    assert_duplicate(&cluster, &request, &written).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_restarted_with_a_new_epoch_fences_its_old_epochs_retries() {
    let mut cluster = three_nodes("", Vec::new()).await;
    let old = send(&cluster, &batch(5, 1, 1, 2)).await;
    // The old session's next batch never got an answer; the producer
    // restarts as epoch 2 before it is retried.
    let new = send(&cluster, &batch(5, 2, 1, 1)).await;
    assert_eq!(new.first_seqno, old.last_seqno + 1);
    let mut leader = client(&cluster.node(1).grpc.clone()).await.unwrap();
    let before = converge(&mut cluster, 1).await;
    for late in [batch(5, 1, 3, 1), batch(5, 1, 1, 2)] {
        let refused = leader.append(late).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused:?}");
        assert_eq!(walship_proto::refusal(&refused), Some(walship_proto::REFUSAL_PRODUCER_FENCED));
        assert!(refused.message().contains("epoch 2"), "{}", refused.message());
    }
    assert_eq!(converge(&mut cluster, 1).await, before, "the fenced retries wrote nothing");
    // After a failover the fence holds.
    cluster.node(1).kill9();
    let mut finder = LeaderFinder::new(cluster.nodes.iter().map(|n| n.grpc.clone()).collect());
    let started = Instant::now();
    let refused = loop {
        assert!(started.elapsed() < WAIT, "no new leader answered");
        let Some(mut log) = finder.client().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        match log.append(batch(5, 1, 3, 1)).await {
            Err(status) if walship_proto::refusal(&status).is_some() => break status,
            Err(status) => finder.failed(Some(&status)),
            Ok(answer) => panic!("a fenced epoch was written after the failover: {answer:?}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(walship_proto::refusal(&refused), Some(walship_proto::REFUSAL_PRODUCER_FENCED));
}

/// `walship append` (a producer by default) through a frozen, then killed,
/// leader: the batch sent to it gets no answer (an unknown outcome, which
/// without a producer ends the run with exit 3) and is retried on the new
/// leader; every line of the input is in the log exactly once and the run
/// succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_appends_every_line_once_through_a_frozen_leader() {
    use std::io::{BufRead, Write};
    let mut cluster = three_nodes("", Vec::new()).await;
    let servers: Vec<String> = cluster.nodes.iter().map(|n| n.grpc.clone()).collect();
    let mut child = std::process::Command::new(common::walship_bin())
        .args(["append", "--json", "--shard", "1", "--batch", "4", "--deadline", "30s", "--request-timeout", "1s"])
        .args(["--server", &servers.join(",")])
        .env("WALSHIP_LOG", "warn")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let lines: Vec<String> = (0..600).map(|i| format!("cli-line-{i}")).collect();
    let mut stdin = child.stdin.take().unwrap();
    let input = lines.clone();
    let writer = std::thread::spawn(move || {
        for line in input {
            // Slowly enough that the kill lands mid-run.
            writeln!(stdin, "{line}").unwrap();
            std::thread::sleep(Duration::from_millis(2));
        }
    });
    let stdout = child.stdout.take().unwrap();
    let (acks_tx, acks) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut answers = Vec::new();
        for line in std::io::BufReader::new(stdout).lines() {
            let line = line.unwrap();
            let _ = acks_tx.send(());
            answers.push(serde_json::from_str::<serde_json::Value>(&line).unwrap());
        }
        answers
    });
    for _ in 0..20 {
        acks.recv_timeout(WAIT).expect("the CLI acknowledges batches");
    }
    let (leader, _) = cluster.leader_of(1, 1).await.unwrap();
    cluster.signal(leader, libc::SIGSTOP);
    wait_until("a new leader", WAIT, || {
        let now = futures::executor::block_on(cluster.leader_of(1, 1));
        async move { now.is_some_and(|(l, _)| l != leader) }
    })
    .await;
    cluster.node(leader).kill9();
    writer.join().unwrap();
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap()).await.unwrap();
    let answers = reader.join().unwrap();
    assert!(status.success(), "exit {status:?}; answers {answers:?}");
    assert_eq!(answers.len(), 150, "one answer per batch of 4");
    assert!(answers.iter().all(|a| a["outcome"] == "acknowledged"));
    cluster.restart(leader);
    let last = converge(&mut cluster, 1).await;
    let records = read_all(&cluster.node(1).grpc.clone(), 1, last).await;
    let written: Vec<String> = records.iter().map(|r| String::from_utf8_lossy(&r.payload).to_string()).collect();
    assert_eq!(written, lines, "every line once, in order");
    let duplicates = answers.iter().filter(|a| a["duplicate"] == true).count();
    eprintln!("{duplicates} batches were answered as duplicates of an attempt whose answer was lost");
}
