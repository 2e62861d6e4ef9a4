//! Archiving with several uploads in flight per shard while a third of them
//! fail (failpoint `archive::upload`): the archived seqno the leader shows
//! never passes a hole in the store and only moves forward, and in the end
//! the archive holds every committed record exactly once. With `archiver =
//! "follower"` a caught-up follower archives instead of the leader, and when
//! it dies another replica takes over with nothing missing.

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{Cluster, ClusterSpec, wait_until};
use walship_proto::log::{AppendRecord, AppendRequest, Durability};

const WAIT: Duration = Duration::from_secs(90);

const FAST: &str = "heartbeat_ms = 50\nleader_timeout_ms = 1000\nkeepalive_ms = 100";

/// Segments of 4 KiB (about a dozen records) sealed after 20 ms, eight
/// uploading at once.
const PARALLEL: &str =
    "[archive]\nstore = \"dir\"\ndir = \"archive\"\nsegment_bytes = 4096\nsegment_age_ms = 20\nuploads = 8\n";

/// The archived segments' ranges, from the directory store's file names.
fn segments(archive: &Path) -> Vec<(u64, u64)> {
    let Ok(dir) = std::fs::read_dir(archive.join("shards/1/segments")) else { return Vec::new() };
    let mut out: Vec<(u64, u64)> = dir
        .filter_map(|e| {
            let name = e.ok()?.file_name().into_string().ok()?;
            let stem = name.strip_suffix(".wseg")?;
            let mut parts = stem.splitn(3, '-');
            Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
        })
        .collect();
    out.sort();
    out
}

/// The last seqno the segments cover without a hole from seqno 1.
fn contiguous_end(segments: &[(u64, u64)]) -> u64 {
    let mut end = 0;
    for &(first, last) in segments {
        if first > end + 1 {
            break;
        }
        end = end.max(last);
    }
    end
}

/// Appends `n` records with `clients` concurrent QUORUM appenders through
/// node `id`; answers the acknowledged seqnos.
async fn append(cluster: &Cluster, id: u32, clients: usize, n: usize, tag: &str) -> BTreeSet<u64> {
    let grpc = cluster.nodes[id as usize - 1].grpc.clone();
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let (grpc, tag) = (grpc.clone(), tag.to_string());
            tokio::spawn(async move {
                let mut acked = Vec::new();
                let Some(mut log) = common::history::client(&grpc).await else { return acked };
                for i in 0..n / clients {
                    let record =
                        AppendRecord { key: Default::default(), payload: format!("{tag}-{c}-{i}-").repeat(20).into() };
                    let request = AppendRequest {
                        shard_id: 1,
                        records: vec![record],
                        durability: Durability::Quorum as i32,
                        ..Default::default()
                    };
                    if let Ok(r) = log.append(request).await {
                        acked.push(r.into_inner().first_seqno);
                    }
                }
                acked
            })
        })
        .collect();
    let mut all = BTreeSet::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    all
}

fn archive_verify(config: &Path) -> serde_json::Value {
    let out = Command::new(common::walship_bin())
        .args(["archive", "verify", "--cluster", config.to_str().unwrap(), "--shard", "1", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

async fn archive_of(cluster: &Cluster, id: u32) -> serde_json::Value {
    cluster.status(id).await.unwrap_or_default()["shards"][0]["archive"].clone()
}

/// The archive status of whichever node leads shard 1 now (a leader that
/// steps down under load hands archiving to the next one).
async fn archive_of_leader(cluster: &Cluster) -> serde_json::Value {
    for id in 1..=cluster.nodes.len() as u32 {
        if cluster.leads(id, 1).await {
            return archive_of(cluster, id).await;
        }
    }
    serde_json::Value::Null
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_uploads_with_failures_keep_the_archived_seqno_in_order_and_lose_nothing() {
    let failpoints = vec![("FAILPOINTS".to_string(), "archive::upload=30%return".to_string())];
    let mut cluster = Cluster::launch(&ClusterSpec {
        nodes: 3,
        shards: 1,
        coordinators: 1,
        replication: FAST,
        cluster_toml: PARALLEL.into(),
        node_env: (1..=3).map(|id| (id, failpoints.clone())).collect(),
        ..ClusterSpec::default()
    });
    let archive = cluster.dir.path().join("archive");
    let leader = cluster.wait_leader(1, None, WAIT).await;

    // While the load runs, every archived seqno the leader shows is covered
    // without a hole by what the store holds right after (the store only
    // grows), and it never moves back.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (stop, status_addr, archive) =
            (stop.clone(), cluster.nodes[leader as usize - 1].admin.clone(), archive.clone());
        tokio::spawn(async move {
            let (mut last, mut samples, mut most_in_flight) = (0u64, 0u64, 0u64);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let (_, body) = common::http_get(&format!("{status_addr}/v1/status")).await;
                let Ok(status) = serde_json::from_str::<serde_json::Value>(&body) else { continue };
                let a = &status["shards"][0]["archive"];
                if let Some(shown) = a["archived_seqno"].as_u64() {
                    let end = contiguous_end(&segments(&archive));
                    assert!(
                        shown <= end,
                        "the leader shows {shown} archived but the store holds 1..={end} without a hole"
                    );
                    assert!(shown >= last, "the archived seqno moved back from {last} to {shown}");
                    last = shown;
                    samples += 1;
                    most_in_flight = most_in_flight.max(a["uploads_in_flight"].as_u64().unwrap_or(0));
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            (samples, most_in_flight)
        })
    };
    let acked = append(&cluster, leader, 8, 1600, "parallel").await;
    assert!(acked.len() >= 1400, "only {} appends acknowledged", acked.len());
    let last = *acked.last().unwrap();
    let appended = std::time::Instant::now();
    wait_until("the archive to hold everything acknowledged", WAIT, || async {
        archive_of_leader(&cluster).await["archived_seqno"].as_u64() >= Some(last)
    })
    .await;
    let behind = appended.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (samples, most_in_flight) = sampler.await.unwrap();
    eprintln!(
        "{samples} samples, at most {most_in_flight} segments in flight, all archived {behind:?} after the appends"
    );
    assert!(samples > 20, "too few samples to mean anything: {samples}");
    assert!(most_in_flight > 1, "uploads never overlapped");
    let metrics = common::http_get(&format!("{}/metrics", cluster.nodes[leader as usize - 1].admin)).await.1;
    let failures: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("walship_archive_upload_failures_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(failures > 0.0, "the failpoint failed no upload");

    // Every committed record exactly once, each crc checked.
    let verified = archive_verify(&cluster.config_path);
    assert_eq!(verified["first_seqno"], 1, "{verified}");
    let through = verified["last_seqno"].as_u64().unwrap();
    assert!(through >= last, "{verified}");
    assert_eq!(verified["records"].as_u64(), Some(through), "each seqno once: {verified}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_archives_and_another_replica_takes_over_when_it_dies() {
    let mut cluster = Cluster::launch(&ClusterSpec {
        nodes: 3,
        shards: 1,
        coordinators: 1,
        replication: FAST,
        cluster_toml: format!("{PARALLEL}archiver = \"follower\"\n"),
        ..ClusterSpec::default()
    });
    let leader = cluster.wait_leader(1, None, WAIT).await;
    let first = append(&cluster, leader, 4, 400, "follower").await;
    let last = *first.last().unwrap();
    wait_until("a follower to archive the records", WAIT, || async {
        let a = archive_of(&cluster, leader).await;
        a["archived_seqno"].as_u64() >= Some(last) && a["archiver"].as_u64().is_some_and(|n| n != leader as u64)
    })
    .await;
    let archiver = archive_of(&cluster, leader).await["archiver"].as_u64().unwrap() as u32;
    let lead = archive_of(&cluster, leader).await;
    assert_eq!(lead["segments_uploaded"], 0, "the leader uploaded nothing itself: {lead}");
    let theirs = archive_of(&cluster, archiver).await;
    assert!(theirs["segments_uploaded"].as_u64().unwrap() > 0, "{theirs}");
    assert_eq!(theirs["archiver"], archiver, "{theirs}");
    // The coordinator shows the archive position the leader reports (with
    // the leader's next heartbeat).
    wait_until("the coordinator to show the archived seqno", WAIT, || {
        let (_, shard) = futures::executor::block_on(cluster.coord_get(1, "/v1/shards/1"));
        async move { shard["archived_seqno"].as_u64() >= Some(last) }
    })
    .await;

    // The archiving follower dies: another replica archives from where the
    // store stands, with no hole.
    cluster.node(archiver).kill9();
    let more = append(&cluster, leader, 4, 400, "after").await;
    let last = *more.last().unwrap();
    wait_until("another replica to archive the rest", WAIT, || async {
        let a = archive_of(&cluster, leader).await;
        a["archived_seqno"].as_u64() >= Some(last) && a["archiver"].as_u64() != Some(archiver as u64)
    })
    .await;
    let verified = archive_verify(&cluster.config_path);
    assert_eq!(verified["first_seqno"], 1, "{verified}");
    let through = verified["last_seqno"].as_u64().unwrap();
    assert!(through >= last, "{verified}");
    assert_eq!(verified["records"].as_u64(), Some(through), "each seqno once: {verified}");
}
