//! Black-box `walship dev`: the real binary started on free ports (`--base-port
//! 0`) with a data dir of its own. What it prints is what an operator pastes:
//! the dashboard URL, the `export WALSHIP_ADMIN=… WALSHIP_TOKEN=…` line, the
//! leaders the coordinator reports; the token survives a restart; a killed
//! node comes back unless `--no-restart`; the disk cap refuses appends.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::dev::{self, DevProcess};
use common::{http_get, wait_until};

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_prints_what_to_paste_and_keeps_its_token_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("dev");
    let dev = DevProcess::start(&data, &[]);
    // The paste-ready export line names the coordinator and the token.
    let (admin, token) = (dev.admin.clone(), dev.token.clone());
    assert!(admin.starts_with("http://127.0.0.1:"), "{admin}");
    assert_eq!(token.len(), 32, "a generated token: {token:?}");
    assert!(dev.printed(&format!("dashboard: {admin}/")), "no dashboard URL:\n{}", dev.output());
    assert!(dev.printed("restarted after 1s") && dev.printed("--no-restart"), "{}", dev.output());
    assert!(dev.printed("may use up to 2048 MiB") && dev.printed("--max-disk-mib"), "{}", dev.output());
    // The dashboard answers where it says.
    let (code, page) = http_get(&format!("{}/", admin.trim_start_matches("http://"))).await;
    assert_eq!(code, 200, "dashboard: {page}");
    // The token is kept, readable by its owner only.
    let token_file = data.join("admin-token");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(&token_file).unwrap().permissions().mode() & 0o777, 0o600);
    assert_eq!(std::fs::read_to_string(&token_file).unwrap().trim(), token);
    // The token works on a mutating endpoint (and a wrong one does not).
    let preview = r#"{"preview":true}"#;
    let addr = admin.trim_start_matches("http://");
    let (code, body) = common::http_post(&format!("{addr}/v1/shards/1/failover"), preview, Some(&token)).await;
    assert_eq!(code, 200, "{body}");
    let (code, _) = common::http_post(&format!("{addr}/v1/shards/1/failover"), preview, Some("wrong-token")).await;
    assert_eq!(code, 403, "a wrong token");
    // The printed leaders are the coordinator's; on a fresh start, those of
    // the cluster file, spread over the nodes (the nodes start before the
    // coordinator, so it fails nothing over while they come up).
    let file: BTreeMap<u32, u32> = (1..=4).map(|s| (s, (s - 1) % 3 + 1)).collect();
    assert_eq!(dev.printed_leaders(3), coordinator_leaders(addr).await, "{}", dev.output());
    assert_eq!(dev.printed_leaders(3), file, "{}", dev.output());
    drop(dev);

    // Restarted, every leader restarted in its epoch and the coordinator
    // moved each shard to another replica: the leaders printed are those,
    // not the cluster file's (shard i led by node ((i-1) mod 3)+1).
    // A token file others may read is restricted again at the next start.
    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let dev = DevProcess::start(&data, &[]);
    assert_eq!(dev.token, token, "the restarted dev cluster changed its token:\n{}", dev.output());
    assert_eq!(std::fs::metadata(&token_file).unwrap().permissions().mode() & 0o777, 0o600);
    assert!(dev.printed("kept in"), "{}", dev.output());
    let printed = dev.printed_leaders(3);
    let addr = dev.admin.trim_start_matches("http://").to_string();
    assert_eq!(printed, coordinator_leaders(&addr).await, "{}", dev.output());
    assert_ne!(printed, file, "the leaders printed after a restart are the cluster file's:\n{}", dev.output());
}

/// shard -> leader as the coordinator at `addr` reports it now.
async fn coordinator_leaders(addr: &str) -> BTreeMap<u32, u32> {
    let (code, body) = http_get(&format!("{addr}/v1/shards")).await;
    assert_eq!(code, 200, "{body}");
    let shards: serde_json::Value = serde_json::from_str(&body).unwrap();
    shards
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["shard_id"].as_u64().unwrap() as u32, s["leader"].as_u64().expect("a leader") as u32))
        .collect()
}

/// A token file that holds no token is an error that names the file, and
/// the file is left as it was; a short --admin-token is refused.
#[test]
fn dev_refuses_a_bad_token_file_and_a_short_token_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("dev");
    std::fs::create_dir_all(&data).unwrap();
    let file = data.join("admin-token");
    std::fs::write(&file, "short\n").unwrap();
    let out = dev::run_to_end(&data, &[]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("admin-token") && stderr.contains("does not hold a token"), "{stderr}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "short\n");
    assert!(!data.join("cluster.toml").exists(), "nothing else was written");

    std::fs::remove_file(&file).unwrap();
    let out = dev::run_to_end(&data, &["--admin-token", "abc"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("at least 8 characters"), "{stderr}");
    assert!(!file.exists(), "a refused start keeps no token");
}

/// A killed node is restarted after 1 s by default, and left down with
/// `--no-restart`; each says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_node_comes_back_unless_no_restart() {
    for no_restart in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("dev");
        let extra: &[&str] = if no_restart { &["--no-restart", "--shards", "1"] } else { &["--shards", "1"] };
        let mut dev = DevProcess::start(&data, extra);
        if no_restart {
            assert!(dev.printed("restarts: off (--no-restart)"), "{}", dev.output());
        }
        let node3 = dev.node_admin(3);
        let pid = dev::node_pid(&data, 3).expect("node 3's process");
        // SAFETY: kill(2) on a process this test's dev cluster started.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
        let expected = if no_restart { "left down (--no-restart)" } else { "restarting it in 1s" };
        dev.wait_printed(expected, WAIT);
        if no_restart {
            wait_until("node 3 stays down", Duration::from_secs(10), || async { dev::node_pid(&data, 3).is_none() })
                .await;
            // Give a restart (1 s) ample time to happen if it were going to.
            tokio::time::sleep(Duration::from_secs(3)).await;
            assert_eq!(dev::node_pid(&data, 3), None, "node 3 was restarted:\n{}", dev.output());
            assert!(http_get_quick(&node3).await.is_none(), "node 3 answers on its admin port");
        } else {
            wait_until("node 3 answers again", WAIT, || async {
                http_get_quick(&node3).await == Some(200) && dev::node_pid(&data, 3).is_some_and(|p| p != pid)
            })
            .await;
        }
    }
}

/// A node that cannot start again (another process took its gRPC port
/// while it was down) does not take the dev cluster with it: the other
/// nodes keep serving, its restarts wait longer each time (1 s, 2 s, 4 s),
/// and it comes back once its port is free. (Before, the first failed
/// restart stopped the whole dev cluster.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_fails_to_restart_is_retried_while_the_cluster_runs_on() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("dev");
    let mut dev = DevProcess::start(&data, &["--shards", "1"]);
    let (grpc3, node1, node3) = (dev.node_grpc(3), dev.node_admin(1), dev.node_admin(3));
    let pid = dev::node_pid(&data, 3).expect("node 3's process");
    // SAFETY: kill(2) on a process this test's dev cluster started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    // Its port, taken before the restart (1 s after dev notices the exit).
    let deadline = std::time::Instant::now() + Duration::from_millis(900);
    let squatter = loop {
        match std::net::TcpListener::bind(&grpc3) {
            Ok(listener) => break listener,
            Err(e) if std::time::Instant::now() > deadline => panic!("node 3's port {grpc3} stayed taken: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    };
    dev.wait_printed("node 3 exited (signal: 9 (SIGKILL)); restarting it in 1s", WAIT);
    dev.wait_printed("node 3 exited before it was listening (exit status: 1); restarting it in 2s", WAIT);
    dev.wait_printed("node 3 exited before it was listening (exit status: 1); restarting it in 4s", WAIT);
    assert!(matches!(dev.child.try_wait(), Ok(None)), "walship dev stopped:\n{}", dev.output());
    assert_eq!(http_get_quick(&node1).await, Some(200), "node 1 stopped serving:\n{}", dev.output());
    assert!(!dev.printed("node 3 is back"), "{}", dev.output());
    drop(squatter);
    dev.wait_printed("node 3 is back (listening)", WAIT);
    wait_until("node 3 answers again", WAIT, || async { http_get_quick(&node3).await == Some(200) }).await;
}

/// A killed coordinator is restarted like a node, and takes up where it
/// left off from its file KV: every shard keeps its leader, and a node lost
/// afterwards is still failed over. (The first exit of the coordinator
/// used to stop the whole dev cluster.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_coordinator_comes_back_and_still_fails_over() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("dev");
    let mut dev = DevProcess::start(&data, &["--shards", "1"]);
    let before = working_leader(&dev.admin).await.expect("shard 1 led at start");
    let pid = dev::coordinator_pid(&data).expect("the coordinator's process");
    // SAFETY: kill(2) on a process this test's dev cluster started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    dev.wait_printed("the coordinator exited (signal: 9 (SIGKILL)); restarting it in 1s", WAIT);
    dev.wait_printed("the coordinator is back (listening)", WAIT);
    assert!(matches!(dev.child.try_wait(), Ok(None)), "walship dev stopped:\n{}", dev.output());
    let admin = dev.admin.clone();
    wait_until("the restarted coordinator to report shard 1 led", WAIT, || {
        let admin = admin.clone();
        async move { working_leader(&admin).await.is_some() }
    })
    .await;
    let leader = working_leader(&admin).await.unwrap();
    assert_eq!(leader, before, "a coordinator restart moved no leadership");
    let pid = dev::node_pid(&data, leader).expect("the leader's process");
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    wait_until("shard 1 failed over by the restarted coordinator", WAIT, || {
        let admin = admin.clone();
        async move { working_leader(&admin).await.is_some_and(|l| l != leader) }
    })
    .await;
}

/// The status code at `url` (`http://host:port/path`), or None when
/// nothing listens there.
async fn http_get_quick(url: &str) -> Option<u16> {
    let addr_and_path = url.trim_start_matches("http://");
    let addr = addr_and_path.split('/').next().unwrap();
    tokio::net::TcpStream::connect(addr).await.ok()?;
    Some(http_get(addr_and_path).await.0)
}

/// The disk cap: a dev cluster capped at 48 MiB refuses appends (its nodes
/// report their disk full) once its nodes have written about that much,
/// and its data dir stays near the cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_disk_cap_refuses_appends_past_it() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("dev");
    let cap_mib = 48u64;
    let dev = DevProcess::start(&data, &["--shards", "1", "--max-disk-mib", &cap_mib.to_string()]);
    assert!(dev.printed(&format!("may use up to {cap_mib} MiB")), "{}", dev.output());
    let server = dev.node_grpc(1);
    let mut refused = None;
    // 3 replicas of 4 MiB per round: the cap is reached within a few rounds;
    // 40 rounds (480 MiB written) would mean no cap at all.
    for round in 0..40 {
        let out = std::process::Command::new(common::walship_bin())
            .args(["append", "--server", &server, "--shard", "1", "--count", "16", "--size", "262144"])
            .env("WALSHIP_LOG", "warn")
            .output()
            .unwrap();
        if !out.status.success() {
            refused = Some((round, String::from_utf8_lossy(&out.stderr).into_owned()));
            break;
        }
    }
    let (round, stderr) = refused.expect("no append was refused: the cap did not hold");
    // Refused for a full disk: the nodes run with the cap's reserve, and
    // report the disk full (each hands its leaderships over and nobody can
    // take them, so the client may hear of no leader, or of an outcome it
    // cannot know, rather than RESOURCE_EXHAUSTED itself).
    let admins: Vec<String> = (1..=3).map(|id| dev.node_admin(id).trim_start_matches("http://").to_string()).collect();
    let mut reserves = std::collections::BTreeSet::new();
    for admin in &admins {
        let (code, body) = http_get(admin).await;
        assert_eq!(code, 200, "{body}");
        let status: serde_json::Value = serde_json::from_str(&body).unwrap();
        reserves.insert(status["disk"]["min_free_bytes"].as_u64().unwrap());
    }
    assert_eq!(reserves.len(), 1, "the nodes run with different reserves: {reserves:?}");
    let reserve = *reserves.first().unwrap();
    assert!(reserve > 256 << 20, "the nodes run with the default reserve, not the cap's: {reserve}");
    wait_until(&format!("a node to report its disk full after round {round} ({stderr})"), WAIT, || async {
        let mut full = false;
        for admin in &admins {
            let (_, body) = http_get(admin).await;
            full |= serde_json::from_str::<serde_json::Value>(&body).is_ok_and(|s| s["disk"]["disk_full"] == true);
        }
        full
    })
    .await;
    let used = dev::disk_usage(&data);
    // The nodes see each other's writes every 200 ms (statvfs), so they
    // overshoot by what three replicas write in that time. (The reserve
    // counts the whole file system: another process freeing space while
    // this runs moves the cap up by as much.)
    assert!(used <= (cap_mib + 64) << 20, "the data dir holds {} MiB, cap {cap_mib} MiB", used >> 20);
}

/// Its nodes and coordinator never outlive `walship dev`, even when it is
/// killed with SIGKILL (no chance to stop them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_outlives_a_killed_dev_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("dev");
    let mut dev = DevProcess::start(&data, &["--shards", "1"]);
    let children = dev::processes_under(&data);
    assert!(children.len() >= 4, "a coordinator and three nodes: {children:?}\n{}", dev.output());
    let _ = dev.child.kill();
    let _ = dev.child.wait();
    wait_until("every node and the coordinator to stop", WAIT, || async { dev::processes_under(&data).is_empty() })
        .await;
}

/// `walship append` to `server`: the last seqno it acknowledged, or its
/// error.
fn append_16(server: &str) -> Result<u64, String> {
    let out = std::process::Command::new(common::walship_bin())
        .args(["append", "--json", "--server", server, "--shard", "1", "--count", "16", "--size", "262144"])
        .env("WALSHIP_LOG", "warn")
        .output()
        .unwrap();
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok());
    Ok(last.filter_map(|v| v["last_seqno"].as_u64()).max().expect("an acknowledged batch names its last seqno"))
}

/// Whether `server` serves shard 1's records 1..=`through`, every one,
/// having committed `through` (read-your-writes); why not otherwise.
fn serves_through(server: &str, through: u64) -> Result<(), String> {
    let out = std::process::Command::new(common::walship_bin())
        .args(["read", "--json", "--server", server, "--shard", "1", "--to", &through.to_string()])
        .args(["--after-write", &through.to_string(), "--request-timeout", "3s", "--deadline", "4s"])
        .env("WALSHIP_LOG", "warn")
        .output()
        .unwrap();
    if !out.status.success() {
        return Err(format!("{server}: {}", String::from_utf8_lossy(&out.stderr).trim()));
    }
    let seqnos: Vec<u64> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["seqno"].as_u64().unwrap())
        .collect();
    match seqnos == (1..=through).collect::<Vec<_>>() {
        true => Ok(()),
        false => {
            Err(format!("{server} served seqnos {:?}..{:?} ({} records)", seqnos.first(), seqnos.last(), seqnos.len()))
        }
    }
}

/// The node shard 1's coordinator record names as leader, when that node
/// reports leading it.
async fn working_leader(admin: &str) -> Option<u32> {
    let (code, body) = http_get(&format!("{}/v1/shards/1", admin.trim_start_matches("http://"))).await;
    let shard: serde_json::Value = serde_json::from_str(&body).ok().filter(|_| code == 200)?;
    let leader = shard["leader"].as_u64()? as u32;
    let replicas = shard["replicas"].as_array()?;
    replicas.iter().any(|r| r["node_id"] == leader && r["role"] == "leader").then_some(leader)
}

/// Every disk of the cluster full (the dev cap holds the whole cluster, so
/// its nodes fill up together): appends are refused, yet the shard keeps a
/// working leader and every replica serves every acknowledged record
/// (read-your-writes), and so it stays after its leader is killed and
/// restarts on its full disk. (A full replica used to refuse every
/// leadership and every shipment: the shard lost its leader as the disks
/// filled, and the followers never learnt the last acknowledged records
/// were committed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_whose_every_disk_is_full_keeps_a_leader_and_serves_what_it_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("dev");
    let mut dev = DevProcess::start(&data, &["--shards", "1", "--max-disk-mib", "48"]);
    let servers: Vec<String> = (1..=3).map(|id| dev.node_grpc(id)).collect();
    let admins: Vec<String> = (1..=3).map(|id| dev.node_admin(id).trim_start_matches("http://").to_string()).collect();
    let mut acked = 0;
    for _ in 0..40 {
        match append_16(&servers[0]) {
            Ok(last) => acked = last,
            Err(_) => break,
        }
    }
    assert!(acked > 0, "nothing was acknowledged before the disks filled");
    wait_until("every node to report its disk full", WAIT, || async {
        let mut full = 0;
        for admin in &admins {
            let (_, body) = http_get(admin).await;
            full +=
                serde_json::from_str::<serde_json::Value>(&body).is_ok_and(|s| s["disk"]["disk_full"] == true) as usize;
        }
        full == 3
    })
    .await;
    assert!(append_16(&servers[0]).is_err(), "an append was taken on full disks");
    let coordinator = dev.admin.clone();
    let every_replica_serves = |why: &'static str| {
        let (servers, admin) = (servers.clone(), coordinator.clone());
        async move {
            let mut last_error = String::new();
            let deadline = std::time::Instant::now() + WAIT;
            while std::time::Instant::now() < deadline {
                let served: Result<Vec<()>, String> = servers.iter().map(|s| serves_through(s, acked)).collect();
                match (working_leader(&admin).await, served) {
                    (Some(leader), Ok(_)) => return leader,
                    (None, _) => last_error = "shard 1 has no working leader".into(),
                    (_, Err(e)) => last_error = e,
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            panic!("{why}: records 1..={acked} are not served by every replica: {last_error}");
        }
    };
    let leader = every_replica_serves("full disks").await;

    let pid = dev::node_pid(&data, leader).expect("the leader's process");
    // SAFETY: kill(2) on a process this test's dev cluster started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    dev.wait_printed(&format!("node {leader} is back (listening)"), WAIT);
    every_replica_serves("the leader killed and restarted on its full disk").await;
}
