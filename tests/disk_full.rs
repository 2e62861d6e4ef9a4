//! A node whose disk fills up (issue defect 4): real processes, one node's
//! data dir on a 64 MiB tmpfs that the test fills with a file of its own
//! while that node leads a shard under QUORUM load. The node must refuse
//! appends with `RESOURCE_EXHAUSTED` naming the disk (not abort and reset
//! connections), hand its leadership to a healthy replica through the
//! coordinator, lose no acknowledged record, stay up reporting `disk_full`,
//! start again on the still-full disk (no crash loop), and resume by itself
//! once the space is back.
//!
//! Mounting a tmpfs needs root: without it the test fails and says so.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::{Acked, Cluster, ClusterSpec, append_and_record, http_get, read_all, wait_until};
use walship_proto::log::Durability;

const FAST: &str = "heartbeat_ms = 50\nleader_timeout_ms = 1000\nkeepalive_ms = 100\nship_timeout_ms = 1000";
const WAIT: Duration = Duration::from_secs(30);
/// The full node's `wal.min_free_bytes`, and what the filler leaves free:
/// below the reserve, but room for the small metadata writes it covers.
const RESERVE: u64 = 24 << 20;
const LEFT_FREE: u64 = 12 << 20;

/// A tmpfs mounted on a fresh temp dir, unmounted on drop.
struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    fn mount(size_mib: u64) -> Tmpfs {
        // SAFETY: geteuid(2) has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        assert!(root, "tests/disk_full.rs needs root: it mounts a small tmpfs as one node's data dir");
        let dir = tempfile::tempdir().unwrap();
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size_mib}m"), "tmpfs"])
            .arg(dir.path())
            .status()
            .expect("running mount");
        assert!(status.success(), "mount -t tmpfs failed: {status}");
        Tmpfs { dir }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        // Lazy: a node killed a moment ago may still hold files open.
        let _ = std::process::Command::new("umount").arg("-l").arg(self.dir.path()).status();
    }
}

/// Writes zeros to `path` until `left` bytes remain free on its file system
/// (`left = 0`: until the disk refuses more), and syncs it.
fn fill(path: &Path, left: u64) {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new().create(true).append(true).open(path).unwrap();
    let chunk = vec![0u8; 1 << 20];
    loop {
        let free = walship_wal::disk_space::free_bytes(path.parent().unwrap()).unwrap();
        if free <= left {
            break;
        }
        let n = ((free - left) as usize).min(chunk.len());
        if file.write_all(&chunk[..n]).is_err() {
            assert_eq!(left, 0, "the filler could not leave {left} bytes free");
            break;
        }
    }
    let _ = file.sync_all();
}

async fn readyz(admin: &str) -> (u16, String) {
    http_get(&format!("{admin}/readyz")).await
}

fn shard_entry(status: &serde_json::Value, shard: u32) -> serde_json::Value {
    status["shards"].as_array().and_then(|a| a.iter().find(|s| s["shard_id"] == shard).cloned()).unwrap_or_default()
}

fn alive(cluster: &mut Cluster, id: u32) -> bool {
    cluster.node(id).child.try_wait().unwrap().is_none()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_refuses_appends_hands_over_leadership_restarts_and_recovers() {
    let tmpfs = Tmpfs::mount(64);
    let data = tmpfs.path().join("node-1");
    let node_args = vec![(1, vec!["--wal-min-free-bytes".to_string(), RESERVE.to_string()])];
    let mut cluster = Cluster::launch(&ClusterSpec {
        coordinators: 1,
        replication: FAST,
        node_args,
        data_dirs: vec![(1, data.clone())],
        ..ClusterSpec::default()
    });
    cluster.wait_node_leads(1, 1, WAIT).await;
    wait_until("the coordinator records node 1 as leader", WAIT, || {
        let recorded = futures::executor::block_on(cluster.leader_of(1, 1)).is_some_and(|(l, _)| l == 1);
        async move { recorded }
    })
    .await;
    assert_eq!(readyz(&cluster.node(1).admin.clone()).await.0, 200);

    // QUORUM load through node 1 only, so its own answers are what we see.
    let acked: Acked = Acked::default();
    let refusals = Arc::new(tokio::sync::Mutex::new(Vec::<tonic::Status>::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let (acked, refusals, stop) = (acked.clone(), refusals.clone(), stop.clone());
        let mut log = cluster.node(1).client().await;
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Acquire) {
                let payloads: Vec<Bytes> =
                    (0..16).map(|i| Bytes::from(format!("{n}-{i}-{}", "x".repeat(4000)))).collect();
                n += 1;
                let timeout = Duration::from_secs(5);
                if let Err(status) = append_and_record(&mut log, 1, payloads, Durability::Quorum, timeout, &acked).await
                {
                    refusals.lock().await.push(status);
                    tokio::time::sleep(Duration::from_millis(20)).await; // pacing a refused client, not a wait
                }
            }
        })
    };
    wait_until("some records acknowledged", WAIT, || {
        let acked = acked.clone();
        async move { acked.lock().await.get(&1).is_some_and(|s| s.len() >= 320) }
    })
    .await;

    // Fill node 1's disk to below its reserve.
    let filler = tmpfs.path().join("filler");
    fill(&filler, LEFT_FREE);
    let wal_dir = data.join("wal").display().to_string();
    wait_until("an append refused with RESOURCE_EXHAUSTED naming the disk", WAIT, || {
        let refusals = refusals.clone();
        let wal_dir = wal_dir.clone();
        async move {
            refusals.lock().await.iter().any(|s| {
                s.code() == tonic::Code::ResourceExhausted
                    && s.message().contains(&wal_dir)
                    && s.message().contains("bytes free")
            })
        }
    })
    .await;
    assert!(alive(&mut cluster, 1), "node 1 died when its disk filled");

    // The coordinator moves the leadership to a healthy node.
    let mut new_leader = 0;
    wait_until("the coordinator moves shard 1 off node 1", WAIT, || {
        let led = futures::executor::block_on(cluster.leader_of(1, 1));
        if let Some((l, _)) = led {
            new_leader = l;
        }
        async move { led.is_some_and(|(l, _)| l != 1) }
    })
    .await;
    cluster.wait_node_leads(new_leader, 1, WAIT).await;
    stop.store(true, Ordering::Release);
    load.await.unwrap();
    for status in refusals.lock().await.iter() {
        // A reset or an abort shows up as UNKNOWN/INTERNAL ("transport error").
        assert!(
            !matches!(status.code(), tonic::Code::Unknown | tonic::Code::Internal | tonic::Code::DataLoss),
            "an append failed other than by a clean refusal: {status:?}"
        );
    }

    // Every acknowledged record is on the new leader.
    let acked = acked.lock().await.get(&1).cloned().unwrap_or_default();
    let last = *acked.keys().last().unwrap();
    let new_grpc = cluster.node(new_leader).grpc.clone();
    let mut leader_log = cluster.node(new_leader).client().await;
    let commit = Acked::default();
    append_and_record(&mut leader_log, 1, vec![Bytes::from_static(b"after")], Durability::Quorum, WAIT, &commit)
        .await
        .expect("the new leader takes appends");
    let records = read_all(&new_grpc, 1, last).await;
    for (seqno, payload) in &acked {
        let record = records.iter().find(|r| r.seqno == *seqno);
        assert_eq!(record.map(|r| &r.payload), Some(payload), "acknowledged seqno {seqno} lost");
    }

    // Node 1 is up, not ready, and says why.
    let admin1 = cluster.node(1).admin.clone();
    let (code, body) = readyz(&admin1).await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("disk_full") && body.contains(&wal_dir), "{body}");
    let status = cluster.status(1).await.unwrap();
    assert_eq!(status["disk"]["disk_full"], true, "{status}");
    let metrics = http_get(&format!("{admin1}/metrics")).await.1;
    assert!(metrics.contains("walship_wal_disk_full 1"), "{metrics}");
    assert!(alive(&mut cluster, 1));

    // kill -9, use up every last byte, restart: it comes up, disk_full.
    cluster.node(1).kill9();
    fill(&filler, 0);
    cluster.restart_with_args(1);
    let admin1 = cluster.node(1).admin.clone();
    wait_until("restarted node 1 follows, reporting disk_full", WAIT, || {
        let admin1 = admin1.clone();
        let status = futures::executor::block_on(cluster.status(1));
        async move {
            let (code, body) = readyz(&admin1).await;
            let following = status
                .as_ref()
                .is_some_and(|s| s["disk"]["disk_full"] == true && shard_entry(s, 1)["role"] == "follower");
            code == 503 && body.contains("disk_full") && following
        }
    })
    .await;
    // It stays up while the leader keeps appending and shipping to it.
    for _ in 0..5 {
        append_and_record(
            &mut leader_log,
            1,
            vec![Bytes::from_static(b"while full")],
            Durability::Quorum,
            WAIT,
            &commit,
        )
        .await
        .expect("the cluster takes appends while one node's disk is full");
    }
    assert!(alive(&mut cluster, 1), "node 1 exited on its full disk after a restart");
    assert_eq!(readyz(&admin1).await.0, 503);

    // Space comes back: ready again, and it catches up with the leader.
    std::fs::remove_file(&filler).unwrap();
    wait_until("node 1 ready again", WAIT, || {
        let admin1 = admin1.clone();
        async move { readyz(&admin1).await.0 == 200 }
    })
    .await;
    let leader_durable = shard_entry(&cluster.status(new_leader).await.unwrap(), 1)["durable_seqno"].as_u64().unwrap();
    assert!(leader_durable > last);
    wait_until("node 1 catches up with the leader", WAIT, || {
        let status = futures::executor::block_on(cluster.status(1));
        async move {
            status.is_some_and(|s| shard_entry(&s, 1)["durable_seqno"].as_u64().is_some_and(|d| d >= leader_durable))
        }
    })
    .await;
    assert!(alive(&mut cluster, 1));
    drop(cluster);
    drop(tmpfs);
}
