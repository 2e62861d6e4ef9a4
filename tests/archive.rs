//! The archive: each shard's leader uploads sealed segments of committed
//! records to the object store (here the directory store); across a leader
//! crash the archive holds every committed record exactly once; `walship
//! archive ls|verify` read it and `walship restore` rebuilds the shard from
//! it alone, to a seqno or a time, into a data dir a node then serves. The
//! leader's scrub finds a damaged or deleted segment and uploads it again
//! from its WAL (or another replica's), or reports it unrepairable once no replica holds it.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Cluster, ClusterSpec, wait_until};
use walship_proto::log::{AppendRecord, AppendRequest, Durability};

const WAIT: Duration = Duration::from_secs(60);

/// Small segments sealed quickly, so a short test makes many.
const ARCHIVE: &str = "[archive]\nstore = \"dir\"\ndir = \"archive\"\nsegment_bytes = 8192\nsegment_age_ms = 100\n";

fn walship(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(common::walship_bin()).args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Three nodes, `shards` shards, one coordinator, archiving to a dir store.
fn archived_cluster(shards: u32) -> Cluster {
    Cluster::launch(&ClusterSpec {
        nodes: 3,
        shards,
        coordinators: 1,
        replication: "heartbeat_ms = 50\nleader_timeout_ms = 1000\nkeepalive_ms = 100",
        cluster_toml: ARCHIVE.into(),
        ..ClusterSpec::default()
    })
}

/// The shard's archive status on node `id` (its leader).
async fn archive_of(cluster: &Cluster, id: u32) -> serde_json::Value {
    shard_archive(cluster, id, 1).await
}

/// Appends `n` records of about 300 bytes through node `id`, QUORUM;
/// answers the acknowledged seqnos (a failed append is not acknowledged).
async fn append(cluster: &Cluster, id: u32, n: usize, tag: &str) -> Vec<u64> {
    let Some(mut log) = common::history::client(&cluster.nodes[id as usize - 1].grpc).await else { return vec![] };
    let mut acked = Vec::new();
    for i in 0..n {
        let record = AppendRecord {
            key: format!("k{i}").into_bytes().into(),
            payload: format!("{tag}-{i}-").repeat(30).into_bytes().into(),
        };
        let request = AppendRequest {
            shard_id: 1,
            records: vec![record],
            durability: Durability::Quorum as i32,
            ..Default::default()
        };
        match log.append(request).await {
            Ok(r) => acked.push(r.into_inner().first_seqno),
            Err(_) => break,
        }
    }
    acked
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_archive_holds_every_committed_record_once_across_a_leader_crash_and_restores() {
    let mut cluster = archived_cluster(1);
    let config = cluster.config_path.clone();
    let archive_dir = cluster.dir.path().join("archive");
    let first_leader = cluster.wait_leader(1, None, WAIT).await;
    let mut acked = append(&cluster, first_leader, 300, "before").await;
    assert_eq!(acked.len(), 300);
    // The leader archives: its status shows the position, the store the files.
    wait_until("the leader to archive what it committed", WAIT, || async {
        archive_of(&cluster, first_leader).await["archived_seqno"].as_u64() >= Some(300)
    })
    .await;
    let status = archive_of(&cluster, first_leader).await;
    assert!(status["segments_uploaded"].as_u64().unwrap() >= 2, "small segments: {status}");
    assert!(status["store"].as_str().unwrap().contains("archive"), "{status}");
    assert_eq!(status["error"], serde_json::Value::Null, "{status}");
    let metrics = reqwest_metrics(&cluster, first_leader).await;
    assert!(metrics.contains("walship_archive_seqno{shard=\"1\"}"), "no archive metric");

    // Crash the leader; the new one goes on from what the archive holds.
    cluster.node(first_leader).kill9();
    let new_leader = cluster.wait_leader(1, Some(first_leader), WAIT).await;
    acked.extend(append(&cluster, new_leader, 200, "after").await);
    let last = *acked.last().unwrap();
    wait_until("the new leader to archive everything committed", WAIT, || async {
        archive_of(&cluster, new_leader).await["archived_seqno"].as_u64() >= Some(last)
    })
    .await;

    // The archive: one run of segments, every record intact.
    let (ok, out, err) = walship(&["archive", "verify", "--cluster", path(&config), "--shard", "1", "--json"]);
    assert!(ok, "{out}{err}");
    let verified: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(verified["first_seqno"], 1, "{verified}");
    assert!(verified["last_seqno"].as_u64().unwrap() >= last, "{verified}");
    let (ok, out, err) = walship(&["archive", "ls", "--cluster", path(&config), "--shard", "1"]);
    assert!(ok && out.contains("segments") && out.contains(".wseg"), "{out}{err}");

    // Restore all of it: the same records as the cluster serves, each once.
    let restored = cluster.dir.path().join("restored-all");
    let (ok, out, err) = walship(&["restore", "--cluster", path(&config), "--shard", "1", "--into", path(&restored)]);
    assert!(ok, "{out}{err}");
    assert!(out.contains("crc verified"), "{out}");
    let served = common::read_all(&cluster.nodes[new_leader as usize - 1].grpc, 1, last).await;
    assert_eq!(served.len() as u64, last);
    for seqno in &acked {
        assert!(served.iter().any(|r| r.seqno == *seqno), "acknowledged {seqno} is not served");
    }
    let restored_records = serve_restored(&restored, last).await;
    assert_eq!(restored_records.len(), served.len(), "restored a different number of records");
    for (a, b) in restored_records.iter().zip(&served) {
        assert_eq!((a.seqno, &a.key, &a.payload, a.epoch), (b.seqno, &b.key, &b.payload, b.epoch), "seqno {}", b.seqno);
    }

    // To a seqno, and to a time.
    let to_seqno = cluster.dir.path().join("restored-to-seqno");
    let (ok, out, err) = walship(&[
        "restore",
        "--cluster",
        path(&config),
        "--shard",
        "1",
        "--to-seqno",
        "123",
        "--into",
        path(&to_seqno),
    ]);
    assert!(ok && out.contains("123 records (seqnos 1..=123)"), "{out}{err}");
    assert_eq!(serve_restored(&to_seqno, 123).await.len(), 123);
    let cut = &served[249];
    let at = cut.timestamp_us;
    let time = chrono_rfc3339(at);
    let to_time = cluster.dir.path().join("restored-to-time");
    let (ok, out, err) =
        walship(&["restore", "--cluster", path(&config), "--shard", "1", "--to-time", &time, "--into", path(&to_time)]);
    assert!(ok, "{out}{err}");
    let expected = served.iter().take_while(|r| r.timestamp_us <= at).count();
    assert!(out.contains(&format!("{expected} records")), "{out} (expected {expected})");

    // Bad input changes nothing: an existing dir, a bad time, no [archive].
    let (ok, _, err) = walship(&["restore", "--cluster", path(&config), "--shard", "1", "--into", path(&to_seqno)]);
    assert!(!ok && err.contains("exists"), "{err}");
    let (ok, _, err) = walship(&[
        "restore",
        "--cluster",
        path(&config),
        "--shard",
        "1",
        "--to-time",
        "yesterday",
        "--into",
        path(&archive_dir.join("x")),
    ]);
    assert!(!ok && err.contains("RFC 3339"), "{err}");
    assert!(!archive_dir.join("x").exists(), "a refused restore created its dir");
    let bare = cluster.dir.path().join("bare.toml");
    std::fs::write(&bare, std::fs::read_to_string(&config).unwrap().replace(ARCHIVE, "")).unwrap();
    let (ok, _, err) = walship(&["archive", "ls", "--cluster", path(&bare), "--shard", "1"]);
    assert!(!ok && err.contains("no [archive]"), "{err}");

    // An archive that starts past seqno 1 (archiving turned on after the
    // oldest records were compacted): a copy without its first segments
    // restores from where it starts, and a node serves it from there.
    let late = cluster.dir.path().join("late-archive");
    copy_dir(&archive_dir, &late);
    let segments = late.join("shards/1/segments");
    let mut names: Vec<_> = std::fs::read_dir(&segments).unwrap().map(|e| e.unwrap().path()).collect();
    names.sort();
    let dropped = names.len() / 3;
    for name in &names[..dropped] {
        std::fs::remove_file(name).unwrap();
    }
    let late_config = cluster.dir.path().join("late.toml");
    let late_toml = ARCHIVE.replace("dir = \"archive\"", &format!("dir = \"{}\"", late.display()));
    std::fs::write(&late_config, std::fs::read_to_string(&config).unwrap().replace(ARCHIVE, &late_toml)).unwrap();
    let (ok, out, err) = walship(&["archive", "verify", "--cluster", path(&late_config), "--shard", "1", "--json"]);
    assert!(ok, "{out}{err}");
    let start = serde_json::from_str::<serde_json::Value>(&out).unwrap()["first_seqno"].as_u64().unwrap();
    assert!(start > 1, "the copy still starts at 1: {out}");
    let restored = cluster.dir.path().join("restored-late");
    let (ok, out, err) =
        walship(&["restore", "--cluster", path(&late_config), "--shard", "1", "--into", path(&restored)]);
    assert!(ok, "{out}{err}");
    assert!(out.contains(&format!("(seqnos {start}..=")), "{out}");
    let records = serve_restored_from(&restored, start, last).await;
    assert_eq!(records.len() as u64, last - start + 1);
    for (a, b) in records.iter().zip(&served[start as usize - 1..]) {
        assert_eq!((a.seqno, &a.payload), (b.seqno, &b.payload), "seqno {}", b.seqno);
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// `[archive]` settings a node refuses to start with, each named.
#[test]
fn bad_archive_settings_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    for (archive, named) in [
        ("[archive]\nstore = \"dir\"\n", "needs `dir`"),
        ("[archive]\nstore = \"s3\"\n", "needs `bucket`"),
        ("[archive]\nstore = \"ftp\"\ndir = \"x\"\n", "store"),
        ("[archive]\nstore = \"dir\"\ndir = \"x\"\nprefix = \"../up\"\n", "prefix"),
        ("[archive]\nstore = \"dir\"\ndir = \"x\"\nsegment_bytes = 0\n", "segment_bytes"),
        ("[archive]\nstore = \"dir\"\ndir = \"x\"\nsurprise = 1\n", "surprise"),
        ("[archive]\nstore = \"dir\"\ndir = \"x\"\nscrub_interval_ms = 999\n", "scrub_interval_ms 999 is outside"),
        ("[archive]\nstore = \"dir\"\ndir = \"x\"\nscrub_interval_ms = 86400001\n", "scrub_interval_ms 86400001"),
        ("[archive]\nstore = \"dir\"\ndir = \"x\"\nscrub_interval_ms = -1\n", "scrub_interval_ms"),
    ] {
        let config = dir.path().join("cluster.toml");
        std::fs::write(
            &config,
            format!(
                "insecure_no_auth = true\n[[nodes]]\nid = 1\ngrpc_addr = \"127.0.0.1:1\"\nadmin_addr = \"127.0.0.1:2\"\n\
                 [[shards]]\nid = 1\nreplicas = [1]\nleader = 1\n{archive}"
            ),
        )
        .unwrap();
        let (ok, _, err) = walship(&["archive", "ls", "--cluster", path(&config), "--shard", "1"]);
        assert!(!ok && err.contains(named), "{archive}: {err}");
    }
}

async fn reqwest_metrics(cluster: &Cluster, id: u32) -> String {
    common::http_get(&format!("{}/metrics", cluster.nodes[id as usize - 1].admin)).await.1
}

fn chrono_rfc3339(us: u64) -> String {
    let secs = (us / 1_000_000) as i64;
    let micros = (us % 1_000_000) as u32;
    chrono::DateTime::from_timestamp(secs, micros * 1000).unwrap().to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

/// Starts a one-node static cluster on a restored data dir and reads the
/// shard through `to`; stops it.
async fn serve_restored(data: &Path, to: u64) -> Vec<walship_proto::log::Record> {
    serve_restored_from(data, 1, to).await
}

/// Starts a one-node cluster over a restored data dir and reads `from..=to`.
async fn serve_restored_from(data: &Path, from: u64, to: u64) -> Vec<walship_proto::log::Record> {
    let (grpc, admin) = (common::free_port(), common::free_port());
    let config = data.join("cluster.toml");
    std::fs::write(
        &config,
        format!(
            "insecure_no_auth = true\n[[nodes]]\nid = 1\ngrpc_addr = \"127.0.0.1:{grpc}\"\nadmin_addr = \"127.0.0.1:{admin}\"\n\
             [[shards]]\nid = 1\nreplicas = [1]\nleader = 1\nepoch = 1000\n"
        ),
    )
    .unwrap();
    let (mut child, _) = common::spawn_listening(
        Command::new(common::walship_bin())
            .args(["node", "--node-id", "1", "--wal-prefill", "false", "--cluster"])
            .arg(&config)
            .arg("--data-dir")
            .arg(data),
        "restored node",
    );
    let grpc = format!("127.0.0.1:{grpc}");
    let deadline = Instant::now() + WAIT;
    while common::history::client(&grpc).await.is_none() {
        assert!(Instant::now() < deadline, "the restored node never served");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let records = common::read_from(&grpc, 1, from, to).await;
    let _ = child.kill();
    let _ = child.wait();
    records
}

/// A follower stopped while its leader compacted past it (retention keeps
/// only what the archive already holds) comes back, re-seeds from the
/// archive by itself, then streams the rest: byte-identical to the archive
/// and to the leader, nothing acknowledged lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_the_leader_compacted_past_reseeds_from_the_archive() {
    let mut cluster = Cluster::launch(&ClusterSpec {
        nodes: 3,
        shards: 1,
        coordinators: 1,
        replication: "heartbeat_ms = 50\nleader_timeout_ms = 1000\nkeepalive_ms = 100\nretain_bytes = 16384\n\
                      max_retain_bytes = 65536\nretention_interval_ms = 100",
        cluster_toml: ARCHIVE.into(),
        ..ClusterSpec::default()
    });
    let config = cluster.config_path.clone();
    let leader = cluster.wait_leader(1, None, WAIT).await;
    let follower = if leader == 3 { 2 } else { 3 };
    let mut acked = append(&cluster, leader, 50, "early").await;
    cluster.node(follower).kill9();
    acked.extend(append(&cluster, leader, 600, "while-away").await);
    assert_eq!(acked.len(), 650, "QUORUM appends go on with two of three");
    let last = *acked.last().unwrap();
    // The leader archived it all and compacted past where the follower stopped.
    wait_until("the leader to archive and compact past the stopped follower", WAIT, || async {
        let s = cluster.status(leader).await.unwrap_or_default();
        s["shards"][0]["archive"]["archived_seqno"].as_u64() >= Some(last)
            && s["shards"][0]["first_seqno"].as_u64() > Some(60)
    })
    .await;

    cluster.restart(follower);
    wait_until("the follower to catch up", WAIT, || async {
        let s = cluster.status(follower).await.unwrap_or_default();
        s["shards"][0]["durable_seqno"].as_u64() >= Some(last)
    })
    .await;
    let metrics = reqwest_metrics(&cluster, follower).await;
    let from_archive: f64 = metrics
        .lines()
        .find(|l| l.starts_with("walship_catchup_bytes_total{source=\"archive\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0);
    assert!(from_archive > 0.0, "the follower did not re-seed from the archive:\n{metrics}");

    // Byte-identical: the follower's log against a restore of the archive.
    let restored = cluster.dir.path().join("restored-for-reseed");
    let (ok, out, err) = walship(&[
        "restore",
        "--cluster",
        path(&config),
        "--shard",
        "1",
        "--to-seqno",
        &last.to_string(),
        "--into",
        path(&restored),
    ]);
    assert!(ok, "{out}{err}");
    let follower_dir = cluster.node(follower).data_dir.join("wal");
    cluster.node(follower).kill9();
    // (Its own retention may have compacted the oldest since: compare what
    // it holds, which ends at the last acknowledged record.)
    let theirs = frames(&follower_dir, last);
    let archived = frames(&restored.join("wal"), last);
    assert_eq!(theirs.last().map(|f| f.seqno()), Some(last));
    let first = theirs[0].seqno();
    assert!(theirs[..] == archived[first as usize - 1..], "the re-seeded follower differs from the archive");
    for seqno in acked.iter().filter(|s| **s >= first) {
        assert!(theirs.iter().any(|f| f.seqno() == *seqno), "acknowledged {seqno} missing on the follower");
    }
}

/// The frames of shard 1 through `to` in the WAL at `dir`, from its first
/// (read offline).
fn frames(dir: &Path, to: u64) -> Vec<walship_wal::Frame> {
    use walship_wal::store::LogStore;
    let store = walship_wal::EngineStore::open(dir, &walship_wal::EngineStoreConfig::default()).unwrap();
    let mut out = Vec::new();
    let mut next = store.bounds(1).unwrap().first_seqno;
    while next <= to {
        let page = store.read(1, next, to, 8 << 20).unwrap();
        next = page.last().unwrap().seqno() + 1;
        out.extend(page);
    }
    out
}

/// The "Trying it" walkthrough of ops/README.md's archive section runs as
/// printed (with this build's `walship` first on PATH).
#[test]
fn the_archive_walkthrough_in_the_ops_readme_runs_as_printed() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/ops/README.md")).unwrap();
    let section = readme.find("### The archive").expect("the archive section");
    let from = section + readme[section..].find("**Trying it.**").expect("the walkthrough");
    let block = readme[from..].split("```sh\n").nth(1).unwrap().split("```").next().unwrap();
    assert!(block.contains("walship restore") && block.contains("trap 'kill %1' EXIT"), "{block}");
    let bin = common::walship_bin();
    let path = format!("{}:{}", bin.parent().unwrap().display(), std::env::var("PATH").unwrap_or_default());
    for dir in ["/tmp/walship-archive", "/tmp/walship-archive-restored"] {
        let _ = std::fs::remove_dir_all(dir);
    }
    let output =
        Command::new("bash").args(["-e", "-c", block]).env("PATH", path).env("WALSHIP_LOG", "warn").output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "the walkthrough failed:\n{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    assert!(stdout.contains("segments intact"), "{stdout}");
    assert!(stdout.contains("restored shard 1: 100 records"), "{stdout}");
    for dir in ["/tmp/walship-archive", "/tmp/walship-archive-restored"] {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// The archive's segment files on disk (the directory store), by name.
fn segment_files(archive_dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(archive_dir.join("shards/1/segments"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "wseg"))
        .collect();
    files.sort();
    files
}

/// Flips one byte of the object's own bytes (past the directory store's
/// 16-byte header) in place.
fn flip_byte(file: &Path) -> Vec<u8> {
    let mut bytes = std::fs::read(file).unwrap();
    let at = 16 + (bytes.len() - 16) / 2;
    bytes[at] ^= 0x5a;
    std::fs::write(file, &bytes).unwrap();
    bytes
}

/// `walship_archive_damaged_objects_total{outcome}` on node `id`.
async fn damaged_count(cluster: &Cluster, id: u32, outcome: &str) -> u64 {
    let metrics = reqwest_metrics(cluster, id).await;
    let series = format!("walship_archive_damaged_objects_total{{outcome=\"{outcome}\"}} ");
    metrics.lines().find_map(|l| l.strip_prefix(&series)).map_or(0, |v| v.trim().parse().unwrap())
}

const SCRUBBED: &str = "[archive]\nstore = \"dir\"\ndir = \"archive\"\nsegment_bytes = 8192\nsegment_age_ms = 100\n\
                        scrub_interval_ms = 1000\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_archived_segment_is_found_and_uploaded_again_from_the_leaders_wal() {
    let mut cluster = Cluster::launch(&ClusterSpec {
        nodes: 3,
        shards: 1,
        coordinators: 1,
        replication: "heartbeat_ms = 50\nleader_timeout_ms = 1000\nkeepalive_ms = 100",
        cluster_toml: SCRUBBED.into(),
        ..ClusterSpec::default()
    });
    let config = cluster.config_path.clone();
    let archive_dir = cluster.dir.path().join("archive");
    let leader = cluster.wait_leader(1, None, WAIT).await;
    let acked = append(&cluster, leader, 300, "scrub").await;
    assert_eq!(acked.len(), 300);
    let last = *acked.last().unwrap();
    wait_until("the leader to archive everything and scrub it once", WAIT, || async {
        let a = archive_of(&cluster, leader).await;
        a["archived_seqno"].as_u64() >= Some(last) && a["scrubs"].as_u64() >= Some(1)
    })
    .await;
    let status = archive_of(&cluster, leader).await;
    assert_eq!(
        (status["damaged_repaired"].as_u64(), status["damaged_unrepairable"].as_array().map(Vec::len)),
        (Some(0), Some(0)),
        "an intact archive: {status}"
    );
    let (ok, out, err) = walship(&["archive", "verify", "--cluster", path(&config), "--shard", "1"]);
    assert!(ok, "{out}{err}");
    let files = segment_files(&archive_dir);
    assert!(files.len() >= 4, "{files:?}");
    let victim = files[files.len() - 2].clone();
    let intact = std::fs::read(&victim).unwrap();

    // Damage it right after a scrub pass ended (passes are 1 s apart), so
    // that `verify` sees it before the next one repairs it; should the
    // repair win the race anyway, damage it again.
    let mut caught = None;
    for _ in 0..5 {
        let scrubs = archive_of(&cluster, leader).await["scrubs"].as_u64().unwrap();
        wait_until("a scrub pass to end", WAIT, || async {
            archive_of(&cluster, leader).await["scrubs"].as_u64() > Some(scrubs)
        })
        .await;
        let damaged = flip_byte(&victim);
        assert_ne!(damaged, intact);
        let (ok, out, err) = walship(&["archive", "verify", "--cluster", path(&config), "--shard", "1"]);
        if !ok {
            caught = Some(err);
            break;
        }
        assert!(out.contains("intact"), "{out}");
    }
    let err = caught.expect("`walship archive verify` never saw the damaged segment");
    let name = victim.file_name().unwrap().to_str().unwrap();
    assert!(err.contains("damaged") && err.contains(name), "verify names the damaged segment: {err}");

    // The leader's scrub finds it and uploads it again from its WAL.
    wait_until("the scrub to repair the damaged segment", WAIT, || async {
        damaged_count(&cluster, leader, "repaired").await >= 1
            && walship(&["archive", "verify", "--cluster", path(&config), "--shard", "1"]).0
    })
    .await;
    assert_eq!(std::fs::read(&victim).unwrap(), intact, "the same bytes again, under the same key");
    let status = archive_of(&cluster, leader).await;
    assert!(status["damaged_repaired"].as_u64() >= Some(1), "{status}");
    assert_eq!(status["damaged_unrepairable"], serde_json::json!([]), "{status}");
    assert_eq!(damaged_count(&cluster, leader, "unrepairable").await, 0);
    let (ok, out, err) = walship(&["archive", "verify", "--cluster", path(&config), "--shard", "1", "--json"]);
    assert!(ok, "{out}{err}");
    let verified: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (verified["first_seqno"].as_u64(), verified["last_seqno"].as_u64()),
        (Some(1), Some(last)),
        "{verified}"
    );

    // A segment deleted: a gap before later segments, which the archive's
    // run (and a restore) stops at; the scrub uploads the records again.
    let gone = files[1].clone(); // neither the first (where the run starts) nor the victim
    std::fs::remove_file(&gone).unwrap();
    let verified_through = || {
        let (ok, out, _) = walship(&["archive", "verify", "--cluster", path(&config), "--shard", "1", "--json"]);
        if ok { serde_json::from_str::<serde_json::Value>(&out).unwrap()["last_seqno"].as_u64() } else { None }
    };
    assert!(verified_through() < Some(last), "the run stops at the gap");
    // A restore across the gap refuses to pass for complete (before, it
    // restored up to the gap and exited 0) unless the scrub filled it.
    let across = cluster.dir.path().join("restored-across-a-gap");
    let (ok, out, err) = walship(&["restore", "--cluster", path(&config), "--shard", "1", "--into", path(&across)]);
    if ok {
        assert_eq!(verified_through(), Some(last), "restored across a gap: {out}");
    } else {
        assert!(err.contains("lacks seqnos") && err.contains("nothing restored"), "{out}{err}");
        assert!(!across.join("wal").exists(), "a refused restore leaves no WAL behind");
    }
    wait_until("the scrub to fill the gap", WAIT, || async {
        damaged_count(&cluster, leader, "repaired").await >= 2 && verified_through() == Some(last)
    })
    .await;
    assert!(gone.exists(), "uploaded again under its own name");

    // A restore equals what the cluster serves.
    let restored = cluster.dir.path().join("restored");
    let (ok, out, err) = walship(&["restore", "--cluster", path(&config), "--shard", "1", "--into", path(&restored)]);
    assert!(ok, "{out}{err}");
    let served = common::read_all(&cluster.nodes[leader as usize - 1].grpc, 1, last).await;
    let restored = serve_restored(&restored, last).await;
    assert_eq!((restored.len(), served.len()), (last as usize, last as usize));
    for (a, b) in restored.iter().zip(&served) {
        assert_eq!((a.seqno, &a.key, &a.payload, a.epoch), (b.seqno, &b.key, &b.payload, b.epoch), "seqno {}", b.seqno);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_segment_the_leader_compacted_is_reported_unrepairable() {
    // Retention keeps 64 KiB: once archived, the oldest records leave the
    // leader's WAL, and with them the means to repair their segment.
    let mut cluster = Cluster::launch(&ClusterSpec {
        nodes: 3,
        shards: 1,
        coordinators: 1,
        replication: "heartbeat_ms = 50\nleader_timeout_ms = 1000\nkeepalive_ms = 100\nretain_bytes = 65536\n\
                      max_retain_bytes = 67108864\nretention_interval_ms = 100",
        cluster_toml: SCRUBBED.into(),
        ..ClusterSpec::default()
    });
    let config = cluster.config_path.clone();
    let archive_dir = cluster.dir.path().join("archive");
    let leader = cluster.wait_leader(1, None, WAIT).await;
    let acked = append(&cluster, leader, 600, "gone").await;
    let last = *acked.last().unwrap();
    let first_file = || segment_files(&archive_dir)[0].clone();
    wait_until("everything archived and the first segment compacted on the leader", WAIT, || async {
        let shard = cluster.status(leader).await.unwrap_or_default()["shards"][0].clone();
        let name = first_file().file_name().unwrap().to_str().unwrap().to_string();
        let first_last: u64 = name[21..41].parse().unwrap();
        shard["archive"]["archived_seqno"].as_u64() >= Some(last) && shard["first_seqno"].as_u64() > Some(first_last)
    })
    .await;
    let victim = first_file();
    flip_byte(&victim);
    let name = victim.file_name().unwrap().to_str().unwrap().to_string();
    wait_until("the scrub to report the segment unrepairable", WAIT, || async {
        let a = archive_of(&cluster, leader).await;
        a["damaged_unrepairable"].as_array().is_some_and(|u| u.iter().any(|k| k.as_str().unwrap().contains(&name)))
    })
    .await;
    let status = archive_of(&cluster, leader).await;
    let why = status["damaged_unrepairable"][0].as_str().unwrap();
    assert!(why.contains("no other replica served") && why.contains("compacted"), "{status}");
    assert_eq!(damaged_count(&cluster, leader, "unrepairable").await, 1, "counted once");
    assert_eq!(damaged_count(&cluster, leader, "repaired").await, 0);
    // Still damaged: verify says so; the count stays at one across passes.
    let (ok, _, err) = walship(&["archive", "verify", "--cluster", path(&config), "--shard", "1"]);
    assert!(!ok && err.contains(&name), "{err}");
    let scrubs = archive_of(&cluster, leader).await["scrubs"].as_u64().unwrap();
    wait_until("another scrub pass", WAIT, || async {
        archive_of(&cluster, leader).await["scrubs"].as_u64() > Some(scrubs)
    })
    .await;
    assert_eq!(damaged_count(&cluster, leader, "unrepairable").await, 1, "counted once");
}

/// A forced failover (`allow_loss`) to a replica whose log ends before the
/// archive does is refused, naming both positions: new records there would
/// reuse seqnos the archive holds with the given-up contents, the archiver
/// would skip them and retention would compact them as archived. Nothing
/// changes: the shard stays without a leader until the operator promotes a
/// replica holding the archive's records or re-seeds this one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_failover_to_a_replica_behind_the_archive_is_refused() {
    let mut cluster = archived_cluster(1);
    let leader = cluster.wait_leader(1, None, WAIT).await;
    let behind = (1..=3).find(|&n| n != leader).unwrap();
    let other = (1..=3).find(|&n| n != leader && n != behind).unwrap();
    cluster.node(behind).kill9();
    let acked = append(&cluster, leader, 300, "archived").await;
    assert_eq!(acked.len(), 300, "QUORUM appends with one follower down");
    let last = *acked.last().unwrap();
    wait_until("the leader to archive what it committed", WAIT, || async {
        archive_of(&cluster, leader).await["archived_seqno"].as_u64() >= Some(last)
    })
    .await;
    cluster.node(leader).kill9();
    cluster.node(other).kill9();
    cluster.restart(behind);

    let body = format!(r#"{{"target": {behind}, "allow_loss": true}}"#);
    let (code, refused) = cluster.coord_post(1, "/v1/shards/1/failover", &body, Some(common::TOKEN)).await;
    assert_eq!(code, 409, "{refused}");
    assert_eq!(refused["error"]["code"], "archive_ahead", "{refused}");
    let message = refused["error"]["message"].as_str().unwrap_or_default();
    // The archive's end as the coordinator last heard it (a floor: the
    // archive only grows), and the replica's log end.
    let named: u64 = message
        .split("through seqno ")
        .nth(1)
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the archive's end is not named: {message}"));
    assert!(named > 0 && named <= last, "named {named}, archived {last}: {message}");
    let ends: u64 = message
        .split("it ends at ")
        .nth(1)
        .and_then(|rest| rest.split(')').next())
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("the replica's end is not named: {message}"));
    assert!(ends < named, "the replica ends at {ends}, the archive at {named}: {message}");
    assert!(message.contains(&format!("node {behind}")) && message.contains("re-seed"), "{message}");
    let (_, shard) = cluster.coord_get(1, "/v1/shards/1").await;
    assert!(shard["leader"].is_null() || shard["leader"] != behind, "node {behind} leads after the refusal: {shard}");
    let status = cluster.status(behind).await.unwrap_or_default();
    assert_ne!(status["shards"][0]["role"], "leader", "node {behind} leads: {status}");

    // The way forward the refusal names (ops/runbooks/failover.md): restore
    // the replica's data dir from the archive and force the failover again.
    cluster.node(behind).kill9();
    let data = cluster.node(behind).data_dir.clone();
    std::fs::rename(&data, data.with_extension("behind")).unwrap();
    let config = cluster.config_path.clone();
    let (ok, out, err) = walship(&["restore", "--cluster", path(&config), "--shard", "1", "--into", path(&data)]);
    assert!(ok, "restore: {out}{err}");
    cluster.restart(behind);
    let deadline = Instant::now() + WAIT;
    let forced = loop {
        let (code, forced) = cluster.coord_post(1, "/v1/shards/1/failover", &body, Some(common::TOKEN)).await;
        if code == 200 {
            break forced;
        }
        assert!(Instant::now() < deadline, "the forced failover to the restored replica: {code} {forced}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(forced["to"], behind, "{forced}");
    assert_eq!(cluster.wait_leader(1, None, WAIT).await, behind);
    // The others come back and follow it; the shard commits again.
    cluster.restart(leader);
    cluster.restart(other);
    wait_until("the restored leader to commit what the archive held", WAIT, || async {
        let status = cluster.status(behind).await.unwrap_or_default();
        status["shards"][0]["commit_seqno"].as_u64() >= Some(last)
    })
    .await;
    let records = common::read_all(&cluster.node(behind).grpc, 1, last).await;
    assert_eq!(
        records.iter().map(|r| r.seqno).collect::<Vec<_>>(),
        acked,
        "every archived record on the restored leader"
    );
    let after = append(&cluster, behind, 5, "after").await;
    assert_eq!(after.first(), Some(&(last + 1)), "new records continue past the archive");
}

/// A shard with no committed record is not listed in the archive, when its
/// leadership starts nor when it moves: a failover of a node leading
/// thousands of empty shards listed each one (thousands of `LIST` requests
/// to an S3 bucket at once). Its first committed record brings the listing
/// and the upload, as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_shards_are_not_listed_until_their_first_committed_record() {
    const SHARDS: u32 = 6;
    let mut cluster = archived_cluster(SHARDS);
    // Summed over the live nodes (a killed one had listed nothing).
    let listings = async |cluster: &Cluster, dead: Option<u32>| {
        let mut total = 0.0;
        for (i, node) in cluster.nodes.iter().enumerate() {
            if dead != Some(i as u32 + 1) {
                total += common::metric(&node.admin, "walship_archive_listings_total").await;
            }
        }
        total
    };
    // Waits until `node`'s archive loop for `shard` has shown a tick as its
    // archiver (a tick lists, if it lists at all, before it shows itself).
    let archiving = async |cluster: &Cluster, node: u32, shard: u32| {
        wait_until(&format!("node {node} archives shard {shard}"), WAIT, || async move {
            shard_archive(cluster, node, shard).await["archiver"].as_u64() == Some(node as u64)
        })
        .await;
    };
    let mut leaders = Vec::new();
    for shard in 1..=SHARDS {
        leaders.push(cluster.wait_leader(shard, None, WAIT).await);
    }
    for shard in 1..=SHARDS {
        archiving(&cluster, leaders[shard as usize - 1], shard).await;
    }
    assert_eq!(listings(&cluster, None).await, 0.0, "no shard has a committed record: nothing listed");

    // A leader of an empty shard dies: the new leaders list nothing either.
    let victim = leaders[1];
    let moved: Vec<u32> = (1..=SHARDS).filter(|s| leaders[*s as usize - 1] == victim).collect();
    cluster.node(victim).kill9();
    let mut new_leaders = Vec::new();
    for &shard in &moved {
        let leader = cluster.wait_leader(shard, Some(victim), WAIT).await;
        archiving(&cluster, leader, shard).await;
        new_leaders.push(leader);
    }
    assert_eq!(listings(&cluster, Some(victim)).await, 0.0, "shards {moved:?} moved, empty: nothing listed");

    // The first committed record: its leader lists the archive and uploads.
    let (shard, leader) = (moved[0], new_leaders[0]);
    let mut log = common::history::client(&cluster.nodes[leader as usize - 1].grpc).await.expect("leader client");
    let request = AppendRequest {
        shard_id: shard,
        records: vec![AppendRecord { key: b"k".to_vec().into(), payload: b"first".to_vec().into() }],
        durability: Durability::Quorum as i32,
        ..Default::default()
    };
    log.append(request).await.expect("appended");
    wait_until(&format!("shard {shard}'s first record archived"), WAIT, || async {
        shard_archive(&cluster, leader, shard).await["archived_seqno"].as_u64() >= Some(1)
    })
    .await;
    assert_eq!(listings(&cluster, Some(victim)).await, 1.0, "one listing: shard {shard}'s, once it had a record");
}

/// `shard`'s archive status on node `node` (null while it shows none).
async fn shard_archive(cluster: &Cluster, node: u32, shard: u32) -> serde_json::Value {
    let status = cluster.status(node).await.unwrap_or_default();
    let shards = status["shards"].as_array().cloned().unwrap_or_default();
    shards
        .iter()
        .find(|s| s["shard_id"].as_u64() == Some(shard as u64))
        .map_or(serde_json::Value::Null, |s| s["archive"].clone())
}
