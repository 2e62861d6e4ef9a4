//! Black-box durability: many concurrent clients append to a real `walship
//! node` process, which is killed with SIGKILL mid-load and restarted, twice.
//! Every acknowledged record must read back intact (payload, key, crc32) at
//! the seqno it was acknowledged with, seqnos must be contiguous from 1, and
//! the durable position must cover everything acknowledged (invariant 4).

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::{NodeProcess, wait_until};
use tokio::sync::Mutex;
use walship_proto::log::{AppendRecord, AppendRequest, Durability, ReadRequest};
use walship_wal::{Frame, RecordFields};

const SHARDS: u32 = 4;
const CLIENTS: u32 = 32;

/// What the clients were told: shard -> seqno -> (key, payload).
type Acked = Arc<Mutex<BTreeMap<u32, BTreeMap<u64, (Bytes, Bytes)>>>>;

fn payload(client: u32, n: u64) -> Bytes {
    // Varying sizes, content unique per (client, n).
    let len = 16 + ((client as u64 * 7919 + n * 31) % 2000) as usize;
    let mut p = format!("c{client}-n{n}-").into_bytes();
    p.resize(len, b'a' + (n % 26) as u8);
    Bytes::from(p)
}

/// Appends from `CLIENTS` tasks until `stop` is set; records every ack.
fn start_load(
    grpc: String,
    acked: Acked,
    stop: Arc<AtomicBool>,
    counter: Arc<AtomicU64>,
    round: u64,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..CLIENTS)
        .map(|client| {
            let (grpc, acked, stop, counter) = (grpc.clone(), acked.clone(), stop.clone(), counter.clone());
            tokio::spawn(async move {
                let channel =
                    tonic::transport::Endpoint::from_shared(format!("http://{grpc}")).unwrap().connect().await.unwrap();
                let mut log = walship_proto::log::log_client::LogClient::new(channel);
                let shard = 1 + client % SHARDS;
                let mut n = round << 32;
                while !stop.load(Ordering::Relaxed) {
                    let count = 1 + (n % 4);
                    let records: Vec<AppendRecord> = (0..count)
                        .map(|i| AppendRecord {
                            key: Bytes::from(format!("k{client}")),
                            payload: payload(client, n + i),
                        })
                        .collect();
                    n += count;
                    let request = AppendRequest {
                        shard_id: shard,
                        records: records.clone(),
                        durability: Durability::Local as i32,
                        ..Default::default()
                    };
                    match log.append(request).await {
                        Ok(r) => {
                            let r = r.into_inner();
                            assert_eq!(r.last_seqno - r.first_seqno + 1, count);
                            let mut acked = acked.lock().await;
                            let shard_acked = acked.entry(shard).or_default();
                            for (i, rec) in records.into_iter().enumerate() {
                                let previous = shard_acked.insert(r.first_seqno + i as u64, (rec.key, rec.payload));
                                assert!(previous.is_none(), "seqno {} acknowledged twice", r.first_seqno + i as u64);
                            }
                            counter.fetch_add(count, Ordering::Relaxed);
                        }
                        // The node died: this append's outcome is unknown, which is allowed.
                        Err(_) => break,
                    }
                }
            })
        })
        .collect()
}

async fn verify(node: &NodeProcess, acked: &Acked) -> u64 {
    let mut client = node.client().await;
    let acked = acked.lock().await;
    let mut checked = 0;
    for shard in 1..=SHARDS {
        let expected = acked.get(&shard).cloned().unwrap_or_default();
        let max_acked = expected.keys().next_back().copied().unwrap_or(0);
        let mut from = 1;
        let mut durable = None;
        loop {
            let r = client
                .read(ReadRequest {
                    shard_id: shard,
                    from_seqno: from,
                    to_seqno: 0,
                    max_bytes: 1 << 20,
                    ..Default::default()
                })
                .await;
            let r = match r {
                Ok(r) => r.into_inner(),
                // Empty shard: nothing durable to read.
                Err(s) if s.code() == tonic::Code::OutOfRange && from == 1 => {
                    assert_eq!(max_acked, 0, "shard {shard} lost everything: {s:?}");
                    break;
                }
                Err(s) if s.code() == tonic::Code::OutOfRange => break,
                Err(s) => panic!("read shard {shard} from {from}: {s:?}"),
            };
            let durable = *durable.get_or_insert(r.durable_seqno);
            assert!(durable >= max_acked, "shard {shard}: durable {durable} < acknowledged {max_acked}");
            for record in &r.records {
                assert_eq!(record.seqno, from, "shard {shard}: seqnos must be contiguous");
                // The crc32 the node reports is the one of the stored frame:
                // recompute it from the fields it returned.
                let frame = Frame::encode(RecordFields {
                    seqno: record.seqno,
                    epoch: record.epoch,
                    timestamp_us: record.timestamp_us,
                    key: &record.key,
                    payload: &record.payload,
                });
                assert_eq!(frame.crc32(), record.crc32, "shard {shard} seqno {}: crc", record.seqno);
                if let Some((key, payload)) = expected.get(&record.seqno) {
                    assert_eq!(&record.payload, payload, "shard {shard} seqno {}: payload", record.seqno);
                    assert_eq!(&record.key, key, "shard {shard} seqno {}: key", record.seqno);
                    checked += 1;
                }
                from += 1;
            }
            if from > durable {
                break;
            }
        }
        assert!(from > max_acked, "shard {shard}: read stopped at {from}, acknowledged up to {max_acked}");
    }
    assert_eq!(checked as usize, acked.values().map(BTreeMap::len).sum::<usize>(), "every ack checked");
    checked
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_records_survive_kill9() {
    kill9_rounds(false).await;
}

/// The production default (`wal.prefill`): every crash lands inside the
/// zero-filled first WAL file, whose zeros recovery cuts and the node writes
/// back behind the last record before it appends again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_records_survive_kill9_in_a_zero_filled_wal() {
    kill9_rounds(true).await;
}

/// Three rounds of load, SIGKILL mid-load, restart and verify; on a node
/// started with `--wal-prefill` as given.
async fn kill9_rounds(prefill: bool) {
    let dir = tempfile::tempdir().unwrap();
    let prefill_arg = if prefill { "true" } else { "false" };
    // Three spares (384 MiB) rather than the default sixteen keep the test
    // light; the load stays inside the first file.
    let mut node = NodeProcess::start(
        1,
        dir.path(),
        &format!("1-{SHARDS}"),
        &["--wal-prefill", prefill_arg, "--wal-spare-bytes", &(384u64 << 20).to_string()],
    );
    // The first log file: filled to the default 128 MiB target, or grown by
    // raft-engine's 2 MiB fallocate steps; beside it, the spares of zeros
    // (only with prefill), whole after every crash.
    let first_log = dir.path().join("wal/0000000000000001.raftlog");
    let spares = || -> Vec<u64> {
        let mut lens: Vec<u64> = std::fs::read_dir(dir.path().join("wal"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.to_string_lossy().ends_with(".raftlog.reserved"))
            .map(|p| std::fs::metadata(p).unwrap().len())
            .collect();
        lens.sort();
        lens
    };
    let expected_spares = if prefill { vec![128 << 20; 3] } else { vec![] };
    let len = std::fs::metadata(&first_log).unwrap().len();
    assert_eq!(len == 128 << 20, prefill, "{} is {len} bytes", first_log.display());
    assert_eq!(spares(), expected_spares);
    let acked: Acked = Arc::default();
    for round in 0..3u64 {
        let stop = Arc::new(AtomicBool::new(false));
        let counter = Arc::new(AtomicU64::new(0));
        let tasks = start_load(node.grpc.clone(), acked.clone(), stop.clone(), counter.clone(), round);
        let c = counter.clone();
        wait_until("the load to get 10000 acknowledgements", Duration::from_secs(60), || {
            let c = c.clone();
            async move { c.load(Ordering::Relaxed) >= 10_000 }
        })
        .await;
        // Crash mid-load: appends are in flight right now.
        node.kill9();
        stop.store(true, Ordering::Relaxed);
        for task in tasks {
            task.await.unwrap();
        }
        node.restart();
        // Recovery cut the zeros at the last record; the node wrote them
        // back behind it before serving.
        let len = std::fs::metadata(&first_log).unwrap().len();
        assert_eq!(len == 128 << 20, prefill, "after restart {round}, {} is {len} bytes", first_log.display());
        assert_eq!(spares(), expected_spares, "after restart {round}");
        let checked = verify(&node, &acked).await;
        eprintln!("round {round}: {checked} acknowledged records verified after kill -9");
    }
}

/// A node whose WAL file cannot be zero-filled (here a 32 MiB file size
/// limit, as a nearly full disk would refuse it) still starts, appends and
/// recovers: the zeros only make fsyncs cheaper (`wal.prefill`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_starts_when_its_wal_file_cannot_be_zero_filled() {
    use std::os::unix::process::CommandExt;
    const LIMIT: u64 = 32 << 20;
    let dir = tempfile::tempdir().unwrap();
    let start = || {
        let mut command = std::process::Command::new(common::walship_bin());
        command
            .args(["node", "--node-id", "1", "--grpc", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--shards", "1"])
            .args(["--wal-prefill", "true", "--data-dir"])
            .arg(dir.path());
        // SAFETY: only async-signal-safe calls between fork and exec. An
        // ignored SIGXFSZ stays ignored across exec, so a write past the
        // limit fails with EFBIG instead of killing the node.
        unsafe {
            command.pre_exec(|| {
                let limit = libc::rlimit { rlim_cur: LIMIT, rlim_max: LIMIT };
                if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
                Ok(())
            });
        }
        let (child, fields) = common::spawn_listening(&mut command, "node with a file size limit");
        NodeProcess {
            child,
            grpc: fields["grpc"].clone(),
            admin: fields["admin"].clone(),
            data_dir: dir.path().to_path_buf(),
            node_id: 1,
            shards: "1".into(),
            extra: Vec::new(),
            stderr_log: None,
        }
    };
    let first_log = dir.path().join("wal/0000000000000001.raftlog");
    async fn append(node: &NodeProcess, payload: &'static str) -> u64 {
        let request = AppendRequest {
            shard_id: 1,
            records: vec![AppendRecord {
                key: Bytes::from_static(b"k"),
                payload: Bytes::from_static(payload.as_bytes()),
            }],
            durability: Durability::Local as i32,
            ..Default::default()
        };
        node.client().await.append(request).await.unwrap().into_inner().first_seqno
    }

    let mut node = start();
    let len = std::fs::metadata(&first_log).unwrap().len();
    assert!(len <= LIMIT, "{} is {len} bytes: the fill was cut back", first_log.display());
    // The spares of zeros (default `wal.spare_bytes`) stop at the limit too.
    for entry in std::fs::read_dir(dir.path().join("wal")).unwrap() {
        let path = entry.unwrap().path();
        let len = std::fs::metadata(&path).unwrap().len();
        assert!(len <= LIMIT, "{} is {len} bytes", path.display());
    }
    assert_eq!(append(&node, "one").await, 1);
    node.kill9();

    // The refill behind the recovered end fails the same way.
    let node = start();
    assert_eq!(append(&node, "two").await, 2);
    let mut client = node.client().await;
    let read = client
        .read(ReadRequest { shard_id: 1, from_seqno: 1, to_seqno: 2, max_bytes: 1 << 20, ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    let payloads: Vec<_> = read.records.iter().map(|r| r.payload.clone()).collect();
    assert_eq!(payloads, vec![Bytes::from_static(b"one"), Bytes::from_static(b"two")]);
}
