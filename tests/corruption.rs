//! WAL corruption on a live cluster (real node and coordinator processes,
//! real sockets, bytes flipped in the real raft-engine files): a damaged
//! replica is found out (start-up check, read), never promoted while an
//! intact caught-up replica exists, and repairs itself byte-identical from
//! its leader; with no intact copy anywhere the damage is served as
//! `DATA_LOSS` naming shard and seqnos while the rest of the log stays
//! readable; and the torn tail a `kill -9` leaves is never called corruption.

mod common;

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::{Acked, Cluster, ClusterSpec, append_and_record, http_get, numbers_in, wait_until};
use walship_proto::log::{Durability, ReadRequest, Record};

/// Loss is detected after 1 s of silence (as in the failover tests).
const FAST: &str = "heartbeat_ms = 50\nleader_timeout_ms = 1000\nkeepalive_ms = 100\nship_timeout_ms = 1000";
const WAIT: Duration = Duration::from_secs(60);
/// The record whose copy is damaged: well inside the log, not its tail.
const DAMAGED: u64 = 100;

/// A distinct payload per record, long enough that the search for it in a
/// WAL file cannot match anything else.
fn payload(seqno_hint: u64) -> Bytes {
    Bytes::from(format!("corruption-test-record-{seqno_hint:06}|").repeat(6))
}

/// Appends `count` records one request at a time (so each is its own WAL
/// batch on the leader) at QUORUM through node `leader`, recording them.
async fn append_records(cluster: &mut Cluster, leader: u32, count: u64, acked: &Acked) {
    let mut log = cluster.node(leader).client().await;
    for _ in 0..count {
        let next = acked.lock().await.get(&1).map_or(0, |m| m.len() as u64) + 1;
        append_and_record(&mut log, 1, vec![payload(next)], Durability::Quorum, Duration::from_secs(5), acked)
            .await
            .unwrap_or_else(|s| panic!("append {next} through node {leader}: {s}"));
    }
}

/// The `*.raftlog` file of `data_dir` holding the newest copy of `pattern`,
/// and the offset of the middle of it. raft-engine stores a record's frame
/// verbatim (compression is off), so its payload is in the file as written;
/// a merge of small chunks writes it again further on (files are named in
/// the order they are written), and only that newest copy is read.
fn find_payload(data_dir: &Path, pattern: &[u8]) -> (PathBuf, u64) {
    let mut files: Vec<PathBuf> = std::fs::read_dir(data_dir.join("wal"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "raftlog"))
        .collect();
    files.sort();
    let mut newest = None;
    for file in files {
        let bytes = std::fs::read(&file).unwrap();
        if let Some(at) = bytes.windows(pattern.len()).rposition(|w| w == pattern) {
            newest = Some((file, (at + pattern.len() / 2) as u64));
        }
    }
    newest.unwrap_or_else(|| panic!("no WAL file under {} holds the payload", data_dir.display()))
}

/// Flips 4 bytes in the middle of record `seqno`'s payload in place (pwrite
/// and fsync; on a running node the page cache serves raft-engine's next
/// read of it the damaged bytes). Returns the file.
fn damage(data_dir: &Path, seqno: u64) -> PathBuf {
    let (file, offset) = find_payload(data_dir, &payload(seqno));
    let handle = std::fs::OpenOptions::new().read(true).write(true).open(&file).unwrap();
    let mut bytes = [0u8; 4];
    handle.read_exact_at(&mut bytes, offset).unwrap();
    for b in &mut bytes {
        *b ^= 0x5a;
    }
    handle.write_all_at(&bytes, offset).unwrap();
    handle.sync_all().unwrap();
    file
}

/// raft-engine's log file header (magic, version, alignment) and the
/// header of each log batch: its length (shifted left 8, over the
/// compression byte) and the offset of its item metadata, big-endian.
const FILE_HEADER_LEN: usize = 69;
const BATCH_HEADER_LEN: usize = 16;

/// Flips a byte of the item metadata of the log batch holding the newest
/// copy of record `seqno`, in place: raft-engine's recovery then cuts the
/// file at that batch, dropping it and every batch after it. (Damage to a
/// record's bytes alone leaves recovery alone: the read or the scrubber
/// finds it.) Walks the file's batches from its header to find the batch.
fn damage_batch(data_dir: &Path, seqno: u64) -> PathBuf {
    let (file, offset) = find_payload(data_dir, &payload(seqno));
    let bytes = std::fs::read(&file).unwrap();
    let mut at = FILE_HEADER_LEN;
    let item_metadata = loop {
        let header: [u8; BATCH_HEADER_LEN] = bytes[at..at + BATCH_HEADER_LEN].try_into().unwrap();
        let len = (u64::from_be_bytes(header[..8].try_into().unwrap()) >> 8) as usize;
        let footer = u64::from_be_bytes(header[8..].try_into().unwrap()) as usize;
        assert!(len > BATCH_HEADER_LEN && footer < len, "a batch header at {at} of {}", file.display());
        if (at..at + len).contains(&(offset as usize)) {
            break at + footer;
        }
        at += len;
    };
    let handle = std::fs::OpenOptions::new().read(true).write(true).open(&file).unwrap();
    let mut byte = [0u8; 1];
    handle.read_exact_at(&mut byte, item_metadata as u64).unwrap();
    handle.write_all_at(&[byte[0] ^ 0x5a], item_metadata as u64).unwrap();
    handle.sync_all().unwrap();
    file
}

/// Node `id`'s view of shard 1 in its `/v1/status`.
async fn shard_status(cluster: &Cluster, id: u32) -> Option<serde_json::Value> {
    let status = cluster.status(id).await?;
    status["shards"].as_array()?.iter().find(|s| s["shard_id"] == 1).cloned()
}

/// The corrupt ranges node `id` reports for shard 1 (None: no answer).
async fn corruption(cluster: &Cluster, id: u32) -> Option<Vec<serde_json::Value>> {
    Some(shard_status(cluster, id).await?["corruption"].as_array()?.clone())
}

/// A counter or gauge from node `id`'s `/metrics` (0 when absent or while
/// the node does not answer: the helper's GET panics on a refused
/// connection, which a spawned task contains).
async fn metric(cluster: &Cluster, id: u32, series: &str) -> u64 {
    let url = format!("{}/metrics", cluster.nodes[id as usize - 1].admin);
    let Ok((_, body)) = tokio::spawn(async move { http_get(&url).await }).await else { return 0 };
    body.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|rest| rest.trim().parse::<f64>().ok()))
        .map_or(0, |v| v as u64)
}

/// Records `1..=to` of shard 1 read from the node at `grpc`.
async fn try_read_all(grpc: &str, to: u64) -> Result<Vec<Record>, tonic::Status> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))
        .unwrap()
        .connect()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let mut log = walship_proto::log::log_client::LogClient::new(channel).max_decoding_message_size(64 << 20);
    let mut out = Vec::new();
    let mut from = 1;
    while from <= to {
        let request = ReadRequest { shard_id: 1, from_seqno: from, to_seqno: to, max_bytes: 0, ..Default::default() };
        let r = log.read(request).await?.into_inner();
        from = r.next_seqno;
        out.extend(r.records);
    }
    Ok(out)
}

/// A read of `[from, to]` of shard 1 on the node at `grpc`.
async fn read_range(grpc: &str, from: u64, to: u64) -> Result<Vec<Record>, tonic::Status> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{grpc}")).unwrap().connect().await.unwrap();
    let mut log = walship_proto::log::log_client::LogClient::new(channel).max_decoding_message_size(64 << 20);
    let request = ReadRequest { shard_id: 1, from_seqno: from, to_seqno: to, max_bytes: 0, ..Default::default() };
    log.read(request).await.map(|r| r.into_inner().records)
}

/// Asserts `result` is `DATA_LOSS` naming shard 1 and a range holding
/// `seqno` (a follower stores several records per WAL batch, and a batch
/// shares one checksum, so the range can be wider than the damaged record).
fn assert_data_loss(what: &str, result: Result<Vec<Record>, tonic::Status>, seqno: u64) {
    let status = match result {
        Ok(records) => panic!("{what}: served {} records over damage at seqno {seqno}", records.len()),
        Err(status) => status,
    };
    assert_eq!(status.code(), tonic::Code::DataLoss, "{what}: {status:?}");
    let message = status.message();
    assert!(message.contains("shard 1") && message.contains("corruption"), "{what}: {message}");
    let numbers = numbers_in(message.split_once('[').map_or("", |(_, r)| r));
    assert!(numbers.len() >= 2 && numbers[0] <= seqno && seqno <= numbers[1], "{what}: {message}");
}

/// Waits until node `id` reports no corruption for shard 1, answers
/// `/readyz` 200, has every record through `last` durable and knows it
/// committed; then asserts its records 1..=last equal the leader's and the
/// acknowledged ones, byte for byte.
async fn assert_repaired(cluster: &mut Cluster, id: u32, leader: u32, last: u64, acked: &Acked) {
    let view: &Cluster = cluster;
    wait_until(&format!("node {id} to repair shard 1 and catch up to {last}"), WAIT, || async move {
        let Some(s) = shard_status(view, id).await else { return false };
        let ready = http_get(&format!("{}/readyz", view.nodes[id as usize - 1].admin)).await.0 == 200;
        s["corruption"].as_array().is_some_and(Vec::is_empty)
            && ready
            && s["durable_seqno"].as_u64() >= Some(last)
            && s["commit_seqno"].as_u64() >= Some(last)
    })
    .await;
    let repaired = try_read_all(&cluster.node(id).grpc.clone(), last).await.expect("read the repaired node");
    let reference = try_read_all(&cluster.node(leader).grpc.clone(), last).await.expect("read the leader");
    assert_eq!(repaired.len() as u64, last);
    assert!(repaired == reference, "node {id}'s records differ from leader {leader}'s");
    let acked = acked.lock().await;
    for (seqno, payload) in &acked[&1] {
        let r = &repaired[*seqno as usize - 1];
        assert_eq!((r.seqno, &r.payload), (*seqno, payload), "record {seqno} on node {id}");
    }
}

/// Waits until the coordinator records an acting leader of shard 1 that
/// says so itself; returns it.
async fn wait_leader(cluster: &mut Cluster, not: Option<u32>) -> u32 {
    let mut found = 0;
    wait_until("a leader of shard 1 the coordinator records", WAIT, || {
        let recorded = futures::executor::block_on(cluster.leader_of(1, 1)).map(|(l, _)| l);
        let leads = recorded.filter(|l| Some(*l) != not).is_some_and(|l| {
            futures::executor::block_on(shard_status(cluster, l)).is_some_and(|s| s["role"] == "leader")
        });
        if leads {
            found = recorded.unwrap();
        }
        async move { leads }
    })
    .await;
    found
}

/// A 3-node cluster with a coordinator whose node 1 writes its log (INFO
/// and up) to a file, kept across restarts; the dir holding it, its path.
fn cluster_logging_node_1() -> (tempfile::TempDir, std::path::PathBuf, Cluster) {
    let dir = tempfile::tempdir().unwrap();
    let log_path = dir.path().join("node-1.stderr");
    let cluster = Cluster::launch(&ClusterSpec {
        coordinators: 1,
        replication: FAST,
        stderr_logs: vec![(1, log_path.clone())],
        ..ClusterSpec::default()
    });
    (dir, log_path, cluster)
}

/// (a) A leader's copy of record 100 is damaged while it is down. On
/// restart the start-up check (the stop was unclean) finds it; the node is
/// not made leader again while intact caught-up replicas exist, appends go
/// on, and it truncates and refetches the damaged tail from the new leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_damaged_while_down_is_not_promoted_and_repairs_itself() {
    let (_dir, log_path, mut cluster) = cluster_logging_node_1();
    assert_eq!(wait_leader(&mut cluster, None).await, 1, "the configured leader leads");
    let acked: Acked = Arc::default();
    append_records(&mut cluster, 1, 300, &acked).await;

    cluster.node(1).kill9();
    let file = damage(&cluster.node(1).data_dir.clone(), DAMAGED);
    let leader = wait_leader(&mut cluster, Some(1)).await;
    cluster.restart(1);

    // The start-up check finds it before the node answers anything: its
    // ERROR line names shard, seqno and file, and the `startup` counter
    // (which a repair does not reset) says how; /v1/status shows the range
    // until the repair drops it.
    let seen = std::cell::RefCell::new(None);
    wait_until("node 1 to report the damage it found at start", WAIT, || {
        let (cluster, seen) = (&cluster, &seen);
        async move {
            if let Some(ranges) = corruption(cluster, 1).await
                && let Some(range) = ranges.first()
            {
                *seen.borrow_mut() = Some(range.clone());
            }
            metric(cluster, 1, "walship_wal_corruption_detected_total{how=\"startup\"}").await == 1
        }
    })
    .await;
    let log = std::fs::read_to_string(&log_path).unwrap();
    let line = log
        .lines()
        .find(|l| l.contains("ERROR") && l.contains("WAL corruption"))
        .unwrap_or_else(|| panic!("no corruption ERROR line in node 1's log:\n{log}"));
    assert!(line.contains("shard=1") && line.contains("how=\"startup\""), "{line}");
    assert!(line.contains(&format!("file={}", file.display())), "{line}");
    let first_bad: u64 = line.split("first_bad_seqno=").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    let last_bad: u64 = line.split("last_bad_seqno=").nth(1).unwrap().split(' ').next().unwrap().parse().unwrap();
    assert_eq!((first_bad, last_bad), (DAMAGED, DAMAGED), "one record per leader batch: {line}");
    // The range stays in /v1/status until the node learns it follows (an
    // Assign after its restart) and its corruption watch (every 250 ms)
    // truncates it; the polls above run every 20 ms from the moment the
    // node listens, well inside that window.
    let range = seen.into_inner().expect("/v1/status showed the range before the repair");
    assert_eq!((range["first_seqno"].as_u64(), range["last_seqno"].as_u64()), (Some(DAMAGED), Some(DAMAGED)));
    assert_eq!(range["file"], file.display().to_string());
    assert_eq!(range["found_by"], "startup");

    // Appends go on through the intact leader, and the damaged node is
    // never made leader meanwhile.
    append_records(&mut cluster, leader, 40, &acked).await;
    let last = 340;
    wait_until("node 1 to repair while an intact replica leads", WAIT, || {
        let recorded = futures::executor::block_on(cluster.leader_of(1, 1)).map(|(l, _)| l);
        assert!(recorded.is_some_and(|l| l != 1), "the damaged node was made leader: {recorded:?}");
        let s = futures::executor::block_on(shard_status(&cluster, 1));
        assert!(s.as_ref().is_none_or(|s| s["role"] != "leader"), "node 1 leads: {s:?}");
        let repaired =
            s.is_some_and(|s| s["corruption"].as_array().is_some_and(Vec::is_empty) && s["durable_seqno"] == last);
        async move { repaired }
    })
    .await;
    assert_repaired(&mut cluster, 1, leader, last, &acked).await;
    assert_eq!(cluster.leader_of(1, 1).await.map(|(l, _)| l), Some(leader));
}

/// With node 1 leading: 300 records acknowledged (returned), held durably
/// by node 3, which is then stopped cleanly (SIGTERM): no start-up check
/// looks at its tail when it returns (after kill -9 one would, and drop a
/// damaged newest record as torn).
async fn node_3_stopped_cleanly_holding_300(cluster: &mut Cluster) -> Acked {
    assert_eq!(wait_leader(cluster, None).await, 1, "the configured leader leads");
    let acked: Acked = Arc::default();
    append_records(cluster, 1, 300, &acked).await;
    wait_until("node 3 to hold record 300", WAIT, || {
        let s = futures::executor::block_on(shard_status(cluster, 3));
        async move { s.is_some_and(|s| s["durable_seqno"] == 300) }
    })
    .await;
    cluster.node(3).stop_on_sigterm(WAIT).await;
    acked
}

/// (a') A follower's newest record is damaged while it is down (after a
/// clean stop), and its leader dies too. Restarted, it is nobody's follower
/// yet, so nothing repairs it before the fences come: they must find it
/// answering, or the two survivors make no majority and the shard has no
/// leader until the old leader returns. (Recovery drops a damaged newest
/// batch as a torn tail, so its log ends one record short; a damaged
/// newest record that stays readable is ranked by the log epoch, see
/// `log_rank_epoch`.) The intact replica leads and the damaged one catches
/// up byte-identical.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_newest_record_is_damaged_still_answers_fences() {
    let (_dir, _log, mut cluster) = cluster_logging_node_1();
    let acked = node_3_stopped_cleanly_holding_300(&mut cluster).await;
    damage(&cluster.node(3).data_dir.clone(), 300);
    cluster.node(1).kill9();
    // Node 2 alone is no majority: the coordinator clears the leader and
    // keeps trying. Node 3 comes back only then, so no assignment as node
    // 1's follower reaches it first (as a follower it would repair itself).
    wait_until("the coordinator to give up on node 1", WAIT, || {
        let (_, shard) = futures::executor::block_on(cluster.coord_get(1, "/v1/shards/1"));
        async move { shard["leader"].is_null() }
    })
    .await;
    cluster.restart(3);
    let leader = wait_leader(&mut cluster, Some(1)).await;
    assert_eq!(leader, 2, "the intact replica leads, not the damaged one");
    append_records(&mut cluster, leader, 10, &acked).await;
    assert_repaired(&mut cluster, 3, leader, 310, &acked).await;
}

/// (a'') The log batch holding a follower's record 100 of 300 is damaged
/// (its item metadata) while the follower is cleanly stopped.
/// raft-engine's recovery cuts its log file at the damaged batch, and every
/// batch after it: records that had been durable there are gone, and maybe
/// an epoch it promised. The node says so (an ERROR, the `recovery` count),
/// takes nothing from a leader until its coordinator assigns it again, then
/// refetches what was cut, byte-identical.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_cut_by_the_wals_recovery_are_reported_and_refetched() {
    let (_dir, _log, mut cluster) = cluster_logging_node_1();
    let acked = node_3_stopped_cleanly_holding_300(&mut cluster).await;
    damage_batch(&cluster.node(3).data_dir.clone(), DAMAGED);
    cluster.restart(3);
    wait_until("node 3 to count the records its recovery cut", WAIT, || async {
        metric(&cluster, 3, "walship_wal_corruption_detected_total{how=\"recovery\"}").await == 1
    })
    .await;
    append_records(&mut cluster, 1, 10, &acked).await;
    assert_repaired(&mut cluster, 3, 1, 310, &acked).await;
}

/// A WAL file damaged where recovery cannot cut it away (the header of an
/// older log file): the node stops at start, naming the WAL's directory,
/// the damaged file and the runbook, every time, instead of serving from a
/// log it cannot read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_wal_cannot_be_opened_says_where_and_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    // 64 KiB log files: the 20 KiB records below fill several.
    let config = dir.path().join("node.toml");
    let toml =
        format!("node_id = 1\ndata_dir = {:?}\n[wal]\ntarget_file_bytes = 65536\n", dir.path().display().to_string());
    std::fs::write(&config, toml).unwrap();
    let config_arg = config.display().to_string();
    let mut node = common::NodeProcess::start(1, dir.path(), "1", &["--config", &config_arg]);
    node.wait_healthy().await;
    let mut client = node.client().await;
    for i in 0..12u8 {
        let request = walship_proto::log::AppendRequest {
            shard_id: 1,
            records: vec![walship_proto::log::AppendRecord { key: Bytes::new(), payload: vec![i; 20 << 10].into() }],
            durability: Durability::Local as i32,
            ..Default::default()
        };
        client.append(request).await.unwrap();
    }
    node.kill9();
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir.path().join("wal"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "raftlog"))
        .collect();
    files.sort();
    assert!(files.len() >= 3, "{files:?}");
    let handle = std::fs::OpenOptions::new().read(true).write(true).open(&files[0]).unwrap();
    let mut header = [0u8; 4];
    handle.read_exact_at(&mut header, 20).unwrap();
    handle.write_all_at(&header.map(|b| b ^ 0xff), 20).unwrap();
    handle.sync_all().unwrap();
    for attempt in 1..=2 {
        let mut child = std::process::Command::new(common::walship_bin())
            .args(["node", "--node-id", "1", "--grpc", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
            .args(["--wal-prefill", "false", "--shards", "1", "--config", &config_arg, "--data-dir"])
            .arg(dir.path())
            .env("WALSHIP_CLUSTER_SECRET", common::SECRET)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                panic!("attempt {attempt}: the node kept running on a WAL it cannot read");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let mut stderr = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
        assert!(!status.success(), "attempt {attempt}: {stderr}");
        let wal = dir.path().join("wal");
        assert!(stderr.contains(&format!("opening the WAL under {}", wal.display())), "{stderr}");
        assert!(stderr.contains("ops/runbooks/corruption.md"), "{stderr}");
        // The damaged file, named in the node's last words.
        let last = stderr.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or_default();
        assert!(last.contains(&format!("{} is damaged at offset 0", files[0].display())), "{stderr}");
    }
}

/// Scrub passes every second at up to 64 MiB/s: the whole test log each
/// time.
const FAST_SCRUB: [&str; 4] = ["--wal-scrub-interval-s", "1", "--wal-scrub-bytes-per-s", "67108864"];

/// (b) A running follower's copy is damaged under it. Its newest records
/// are also in its WAL's in-memory tail cache (8 MiB by default), which a
/// read is served from, so a read would not see the damage: the scrubber,
/// which reads the store, finds it. The follower then truncates and
/// refetches from the leader by itself, byte-identical.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_damaged_while_running_is_found_by_the_scrubber_and_repairs_itself() {
    let follower = 2;
    let mut cluster = Cluster::launch(&ClusterSpec {
        coordinators: 1,
        replication: FAST,
        node_args: vec![(follower, FAST_SCRUB.iter().map(|s| s.to_string()).collect())],
        ..ClusterSpec::default()
    });
    let leader = wait_leader(&mut cluster, None).await;
    assert_ne!(leader, follower, "the configured leader is node 1");
    let acked: Acked = Arc::default();
    append_records(&mut cluster, leader, 200, &acked).await;
    wait_until("the follower to hold every record durably", WAIT, || async {
        shard_status(&cluster, follower).await.is_some_and(|s| s["durable_seqno"] == 200 && s["commit_seqno"] == 200)
    })
    .await;
    assert_eq!(corruption(&cluster, follower).await, Some(Vec::new()));

    let scrubbed = "walship_wal_scrubbed_bytes_total";
    let before = metric(&cluster, follower, scrubbed).await;
    wait_until("a scrub pass before the damage", WAIT, || async {
        metric(&cluster, follower, scrubbed).await > before
    })
    .await;
    assert_eq!(metric(&cluster, follower, "walship_wal_corruption_detected_total{how=\"scrub\"}").await, 0);
    damage(&cluster.node(follower).data_dir.clone(), DAMAGED);
    // Found once by a scrub pass (the counter is not reset by the repair,
    // which can drop the range before a status poll sees it; a pass that
    // read the range while the repair truncated it must not count it again).
    wait_until("the scrubber to find the damage", WAIT, || async {
        metric(&cluster, follower, "walship_wal_corruption_detected_total{how=\"scrub\"}").await == 1
    })
    .await;

    append_records(&mut cluster, leader, 30, &acked).await;
    assert_repaired(&mut cluster, follower, leader, 230, &acked).await;
    assert_eq!(cluster.leader_of(1, 1).await.map(|(l, _)| l), Some(leader), "the leader did not change");
}

/// A one-node cluster (shard 1 has a single replica) whose node keeps a
/// tiny tail cache, so reads of its records go to the store (a cached copy
/// is served from memory, where it is intact); led by node 1.
async fn single_replica_cluster() -> (tempfile::TempDir, Cluster) {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("node-1.toml");
    let data = dir.path().join("node-1");
    std::fs::write(&config, format!("node_id = 1\ndata_dir = {:?}\n[wal]\ntail_cache_bytes = 1024\n", data)).unwrap();
    let mut cluster = Cluster::launch(&ClusterSpec {
        nodes: 1,
        coordinators: 1,
        replication: FAST,
        node_args: vec![(1, vec!["--config".into(), config.display().to_string()])],
        data_dirs: vec![(1, data)],
        ..ClusterSpec::default()
    });
    assert_eq!(wait_leader(&mut cluster, None).await, 1);
    (dir, cluster)
}

/// (c) A single-replica shard: no intact copy exists anywhere. Reads below
/// the damage work; a read covering it is `DATA_LOSS` naming the shard and
/// seqno; /v1/status shows exactly which seqno and file; /readyz says
/// `corruption`; the shard keeps its leader; nothing "repairs" it. The
/// node's in-memory tail cache is kept tiny so reads of these records go to
/// the store (a cached copy is served from memory, where it is intact).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_intact_copy_the_damage_is_data_loss_and_the_rest_is_served() {
    let (_dir, mut cluster) = single_replica_cluster().await;
    let acked: Acked = Arc::default();
    append_records(&mut cluster, 1, 200, &acked).await;
    let file = damage(&cluster.node(1).data_dir.clone(), DAMAGED);
    let grpc = cluster.node(1).grpc.clone();

    let below = read_range(&grpc, 1, DAMAGED - 1).await.expect("records below the damage");
    assert_eq!(below.len() as u64, DAMAGED - 1);
    let acked = acked.lock().await;
    assert!(below.iter().all(|r| r.payload == acked[&1][&r.seqno]), "records below the damage are intact");
    let covering = read_range(&grpc, 90, 120).await;
    let message = covering.as_ref().err().map(|s| s.message().to_string()).unwrap_or_default();
    assert_data_loss("read covering the damage", covering, DAMAGED);
    assert!(message.contains(&format!("[{DAMAGED}, {DAMAGED}]")), "exactly the damaged record: {message}");
    assert!(message.contains(&file.display().to_string()), "names the file: {message}");
    // Above the damage is intact too.
    assert_eq!(read_range(&grpc, DAMAGED + 1, 200).await.expect("records above the damage").len(), 100);

    let ranges = corruption(&cluster, 1).await.unwrap();
    assert_eq!(ranges.len(), 1, "{ranges:?}");
    let range = &ranges[0];
    assert_eq!((range["first_seqno"].as_u64(), range["last_seqno"].as_u64()), (Some(DAMAGED), Some(DAMAGED)));
    assert_eq!(
        (range["file"].as_str(), range["found_by"].as_str()),
        (Some(&*file.display().to_string()), Some("read"))
    );
    let (code, body) = http_get(&format!("{}/readyz", cluster.node(1).admin)).await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("corruption"), "{body}");
    // Still led, and still damaged: a second look a corruption-watch period
    // later (the watch runs every 250 ms) finds the same one range, since
    // there is nothing to repair it from.
    assert_eq!(cluster.leader_of(1, 1).await.map(|(l, _)| l), Some(1));
    assert_eq!(shard_status(&cluster, 1).await.unwrap()["role"], "leader");
    assert_data_loss("a later read", read_range(&grpc, DAMAGED, DAMAGED).await, DAMAGED);
    assert_eq!(corruption(&cluster, 1).await.unwrap(), ranges);
}

/// (d) `kill -9` in the middle of appends leaves at most a torn tail: the
/// restarted node checks its tail (INFO), may report a torn tail (INFO),
/// and never says "corruption" at WARN or ERROR nor reports a range.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_torn_tail_after_kill_9_is_not_called_corruption() {
    let (_dir, log_path, mut cluster) = cluster_logging_node_1();
    assert_eq!(wait_leader(&mut cluster, None).await, 1);
    // Appends in flight on node 1 (the leader) when it is killed.
    let grpc = cluster.node(1).grpc.clone();
    let (stop, count) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
    let load = {
        let (stop, count) = (stop.clone(), count.clone());
        tokio::spawn(async move {
            let acked: Acked = Arc::default();
            let channel =
                tonic::transport::Endpoint::from_shared(format!("http://{grpc}")).unwrap().connect().await.unwrap();
            let mut log = walship_proto::log::log_client::LogClient::new(channel);
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let payloads = (0..8).map(|i| payload(n * 8 + i)).collect();
                let timeout = Duration::from_secs(2);
                match append_and_record(&mut log, 1, payloads, Durability::Local, timeout, &acked).await {
                    Ok(()) => count.fetch_add(1, Ordering::Relaxed),
                    Err(_) => return,
                };
            }
        })
    };
    wait_until("appends flowing", WAIT, || async { count.load(Ordering::Relaxed) >= 200 }).await;
    cluster.node(1).kill9();
    stop.store(true, Ordering::Relaxed);
    let _ = load.await;
    let leader = wait_leader(&mut cluster, Some(1)).await;
    cluster.restart(1);
    let target = shard_status(&cluster, leader).await.unwrap()["commit_seqno"].as_u64().unwrap();
    wait_until("node 1 to rejoin and catch up", WAIT, || async {
        shard_status(&cluster, 1).await.is_some_and(|s| s["durable_seqno"].as_u64() >= Some(target))
    })
    .await;
    assert_eq!(corruption(&cluster, 1).await, Some(Vec::new()));
    for how in ["startup", "read", "scrub"] {
        let series = format!("walship_wal_corruption_detected_total{{how=\"{how}\"}}");
        assert_eq!(metric(&cluster, 1, &series).await, 0, "{series}");
    }
    let log = std::fs::read_to_string(&log_path).unwrap();
    assert!(
        log.contains("verifying the WAL tail written before an unclean stop"),
        "the restart after kill -9 checked its tail at INFO:\n{log}"
    );
    let torn = log.lines().filter(|l| l.contains(" INFO ") && l.contains("torn tail")).count();
    eprintln!("torn-tail INFO lines after the kill: {torn}");
    let alarms: Vec<&str> =
        log.lines().filter(|l| (l.contains(" WARN ") || l.contains(" ERROR ")) && l.contains("orruption")).collect();
    assert!(alarms.is_empty(), "a kill -9 was reported as corruption: {alarms:#?}");
}

/// Flips 4 bytes in the middle of every copy of record `seqno`'s payload in
/// the WAL's log files (pwrite and fsync). Once a record's small chunk was
/// merged into a full one, an older log file still holds the superseded
/// copy; this damages the live one whichever it is.
fn damage_every_copy(data_dir: &Path, seqno: u64) -> usize {
    let pattern = payload(seqno);
    let mut copies = 0;
    for entry in std::fs::read_dir(data_dir.join("wal")).unwrap() {
        let file = entry.unwrap().path();
        if file.extension().is_none_or(|e| e != "raftlog") {
            continue;
        }
        let bytes = std::fs::read(&file).unwrap();
        let handle = std::fs::OpenOptions::new().read(true).write(true).open(&file).unwrap();
        let mut from = 0;
        while let Some(at) = bytes[from..].windows(pattern.len()).position(|w| w == &pattern[..]) {
            let offset = (from + at + pattern.len() / 2) as u64;
            let mut four = [0u8; 4];
            handle.read_exact_at(&mut four, offset).unwrap();
            for b in &mut four {
                *b ^= 0x5a;
            }
            handle.write_all_at(&four, offset).unwrap();
            copies += 1;
            from += at + pattern.len();
        }
        handle.sync_all().unwrap();
    }
    copies
}

/// (e) Damage inside a full chunk (a node stores a shard's records in chunks
/// of up to 64 KiB; one request at a time leaves small chunks that later
/// appends merge): a read covering the damaged record is `DATA_LOSS` naming
/// exactly it, and every other record of the same chunk is still served
/// (the chunk is salvaged record by record).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damage_inside_a_merged_chunk_costs_only_the_damaged_record() {
    const RECORDS: u64 = 700;
    const HIT: u64 = 400;
    let (_dir, mut cluster) = single_replica_cluster().await;
    let acked: Acked = Arc::default();
    append_records(&mut cluster, 1, RECORDS, &acked).await;
    let status = cluster.status(1).await.unwrap();
    let chunks = status["wal"]["index_chunks"].as_u64().unwrap();
    assert!(chunks < RECORDS / 4, "{RECORDS} single-record appends merged into {chunks} chunks");
    assert!(damage_every_copy(&cluster.node(1).data_dir.clone(), HIT) >= 1);
    let grpc = cluster.node(1).grpc.clone();

    let covering = read_range(&grpc, HIT - 5, HIT + 5).await;
    let message = covering.as_ref().err().map(|s| s.message().to_string()).unwrap_or_default();
    assert_data_loss("read covering the damage", covering, HIT);
    assert!(message.contains(&format!("[{HIT}, {HIT}]")), "exactly the damaged record: {message}");
    let acked = acked.lock().await;
    let below = read_range(&grpc, 1, HIT - 1).await.expect("records below the damage");
    let above = read_range(&grpc, HIT + 1, RECORDS).await.expect("records above the damage");
    assert_eq!((below.len() as u64, above.len() as u64), (HIT - 1, RECORDS - HIT));
    assert!(below.iter().chain(&above).all(|r| r.payload == acked[&1][&r.seqno]), "the other records are intact");
}
