//! `ops/deploy/nats-3-node.md`'s files, started as the guide says, on
//! loopback: a real `nats-server -c` with the guide's `nats.conf`, three
//! `walship node --node-id "$WALSHIP_NODE_ID" --data-dir …` and three
//! `walship coord --data-dir …`, each with its `machine-N.env` as its
//! environment. What is substituted, and only that: each `10.0.0.N:port`
//! of `cluster.toml` and the env files becomes a free loopback port, the
//! NATS listen address and store dir, the env files' path of `cluster.toml`,
//! and the data dirs (a temporary directory); the nodes also skip the 2 GiB
//! of spare WAL files a fresh node lays out. Then: every coordinator on the
//! NATS KV with the env file's token, exactly one active, every shard led,
//! `walship status` and an append at QUORUM through the CLI, a read on
//! another node, and the token accepted by a mutating endpoint.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{free_port, http_get, spawn_listening, wait_until, walship_bin};

#[path = "../shipping/tests/support/nats.rs"]
mod nats;

const WAIT: Duration = Duration::from_secs(60);

fn guide_file(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("ops/deploy/nats-3-node").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Replaces every `10.0.0.N:port` in `text` with its loopback stand-in.
fn to_loopback(text: &str, ports: &mut BTreeMap<String, u16>) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(i) = rest.find("10.0.0.") {
        out += &rest[..i];
        let addr: String = rest[i..].chars().take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ':').collect();
        if !addr.contains(':') {
            // A mention in a comment ("10.0.0.1-3"), not an address.
            out += &addr;
            rest = &rest[i + addr.len()..];
            continue;
        }
        let port = *ports.entry(addr.clone()).or_insert_with(free_port);
        out += &format!("127.0.0.1:{port}");
        rest = &rest[i + addr.len()..];
    }
    out + rest
}

/// `KEY=VALUE` lines of an env file (comments and blank lines skipped).
fn env_file(text: &str) -> Vec<(String, String)> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (k, v) = l.split_once('=').unwrap_or_else(|| panic!("not KEY=VALUE: {l:?}"));
            (k.to_string(), v.to_string())
        })
        .collect()
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The guide's NATS server: its `nats.conf` with the listen address and
/// store dir moved; returns it and its URL.
fn start_nats(dir: &Path) -> (Killed, String) {
    let conf = guide_file("nats.conf");
    assert!(conf.contains("listen: 0.0.0.0:4222") && conf.contains("store_dir: \"/var/lib/nats\""), "{conf}");
    let port = free_port();
    let conf = conf
        .replace("listen: 0.0.0.0:4222", &format!("listen: 127.0.0.1:{port}"))
        .replace("/var/lib/nats", &dir.join("nats").display().to_string());
    let path = dir.join("nats.conf");
    std::fs::write(&path, conf).unwrap();
    let child = Command::new(nats::nats_server_bin())
        .arg("-c")
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("nats.log")).unwrap())
        .spawn()
        .expect("nats-server (run ops/test.sh, which installs it, or set WALSHIP_NATS_SERVER)");
    let child = Killed(child);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "nats-server -c nats.conf did not listen: {}",
            std::fs::read_to_string(dir.join("nats.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    (child, format!("nats://127.0.0.1:{port}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_nats_3_node_guide_files_describe_a_cluster_that_starts() {
    let dir = tempfile::tempdir().unwrap();
    let (_nats, nats_url) = start_nats(dir.path());
    let mut ports = BTreeMap::new();
    let cluster = to_loopback(&guide_file("cluster.toml"), &mut ports);
    let cluster_path: PathBuf = dir.path().join("cluster.toml");
    std::fs::write(&cluster_path, &cluster).unwrap();
    let config: toml::Value = toml::from_str(&cluster).unwrap();
    let coordinator_admin: Vec<String> = config["coordinators"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["admin_addr"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(coordinator_admin.len(), 3);

    let mut processes = Vec::new();
    let mut token = String::new();
    let mut node_grpc = BTreeMap::new();
    let mut machines = Vec::new();
    for machine in 1..=3u32 {
        let env = env_file(&to_loopback(&guide_file(&format!("machine-{machine}.env")), &mut ports));
        let get = |k: &str| env.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone()).unwrap();
        assert_eq!(get("WALSHIP_CLUSTER_CONFIG"), "/etc/walship/cluster.toml");
        assert_eq!(get("WALSHIP_NODE_ID"), machine.to_string());
        // machine 1's NATS, moved to loopback like every other address.
        assert!(get("WALSHIP_NATS").starts_with("nats://127.0.0.1:"), "{}", get("WALSHIP_NATS"));
        token = get("WALSHIP_TOKEN");
        let env: Vec<(String, String)> = env
            .into_iter()
            .map(|(k, v)| match k.as_str() {
                "WALSHIP_CLUSTER_CONFIG" => (k, cluster_path.display().to_string()),
                "WALSHIP_NATS" => (k, nats_url.clone()),
                _ => (k, v),
            })
            .collect();
        machines.push((machine, env));
    }
    // As the guide orders it: the three nodes, then the three coordinators.
    for (machine, env) in &machines {
        // walship node --node-id "$WALSHIP_NODE_ID" --data-dir /var/lib/walship
        let node_id = env.iter().find(|(k, _)| k == "WALSHIP_NODE_ID").unwrap().1.clone();
        let mut node = Command::new(walship_bin());
        node.envs(env.iter().map(|(k, v)| (k, v)))
            .args(["node", "--node-id", &node_id, "--data-dir"])
            .arg(dir.path().join(format!("machine-{machine}/walship")))
            // Not in the guide: spare WAL files of zeros (2 GiB per node)
            // are left out here so three nodes fit a test machine.
            .args(["--wal-prefill", "false"]);
        let (child, fields) = spawn_listening(&mut node, &format!("node {machine}"));
        node_grpc.insert(*machine, fields["grpc"].clone());
        processes.push(Killed(child));
    }
    for (machine, env) in &machines {
        // walship coord --data-dir /var/lib/walship-coord
        let mut coord = Command::new(walship_bin());
        coord
            .envs(env.iter().map(|(k, v)| (k, v)))
            .args(["coord", "--data-dir"])
            .arg(dir.path().join(format!("machine-{machine}/walship-coord")));
        let (child, fields) = spawn_listening(&mut coord, &format!("coordinator {machine}"));
        assert_eq!(fields["kv"], format!("nats:{nats_url}/walship"), "coordinator {machine} is not on NATS");
        assert_eq!(fields["token"], "(given)", "the env file's token was not taken");
        processes.push(Killed(child));
    }

    // One active coordinator; every shard led by a replica that leads.
    let active = std::sync::Arc::new(std::sync::Mutex::new(None));
    wait_until("one active coordinator and a leader for every shard", WAIT, || {
        let admins = coordinator_admin.clone();
        let found = active.clone();
        async move {
            let mut actives = Vec::new();
            for admin in &admins {
                let (code, body) = http_get(&format!("{admin}/v1/cluster")).await;
                let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                if code == 200 && v["coordinator"]["active"] == true {
                    actives.push(admin.clone());
                }
            }
            let [one] = &actives[..] else { return false };
            let (code, body) = http_get(&format!("{one}/v1/shards")).await;
            let shards: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            let led = code == 200
                && shards.as_array().is_some_and(|a| {
                    a.len() == 3
                        && a.iter().all(|s| {
                            s["replicas"].as_array().is_some_and(|r| {
                                r.iter().any(|r| r["role"] == "leader" && r["node_id"] == s["leader"])
                                    && r.iter().all(|r| r["alive"] == true)
                            })
                        })
                });
            if led {
                *found.lock().unwrap() = Some(one.clone());
            }
            led
        }
    })
    .await;
    let active = active.lock().unwrap().clone().unwrap();
    // Nodes first, as the guide says: the leaders are cluster.toml's.
    let (_, body) = http_get(&format!("{active}/v1/shards")).await;
    let shards: serde_json::Value = serde_json::from_str(&body).unwrap();
    for (shard, spec) in shards.as_array().unwrap().iter().zip(config["shards"].as_array().unwrap()) {
        assert_eq!(shard["shard_id"].as_i64(), spec["id"].as_integer(), "{body}");
        assert_eq!(shard["leader"].as_i64(), spec["leader"].as_integer(), "the guide's leaders moved: {body}");
    }

    // The guide's "check the cluster" commands, against the loopback stand-ins.
    let status = Command::new(walship_bin())
        .args(["status", "--admin", &format!("http://{active}")])
        .env("WALSHIP_LOG", "warn")
        .output()
        .unwrap();
    assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stderr));
    let table = String::from_utf8_lossy(&status.stdout);
    assert!(table.lines().next().is_some_and(|l| l.contains("(active)") && l.contains("kv nats:")), "{table}");
    let mut append = Command::new(walship_bin())
        .args(["append", "--server", &node_grpc[&1], "--shard", "2"])
        .env("WALSHIP_LOG", "warn")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        append.stdin.take().unwrap().write_all(b"hello\n").unwrap();
    }
    let out = append.wait_with_output().unwrap();
    assert!(out.status.success(), "append: {}", String::from_utf8_lossy(&out.stderr));
    // Node 3 serves it once it knows the commit (the leader's next
    // shipment or keepalive tells it).
    let grpc3 = node_grpc[&3].clone();
    wait_until("node 3 serves the record", WAIT, || {
        let grpc3 = grpc3.clone();
        async move {
            let out = Command::new(walship_bin())
                .args(["read", "--server", &grpc3, "--shard", "2", "--from", "1", "--json"])
                .env("WALSHIP_LOG", "warn")
                .output()
                .unwrap();
            out.status.success() && String::from_utf8_lossy(&out.stdout).contains("\"payload\":\"hello\"")
        }
    })
    .await;

    // The env file's token opens the coordinator's mutating endpoints.
    let preview = r#"{"preview":true}"#;
    let (code, body) = common::http_post(&format!("{active}/v1/shards/1/failover"), preview, Some(&token)).await;
    assert_eq!(code, 200, "{body}");
}

/// The guide's cluster binds a dozen ports a test picked in advance; CI once
/// saw one taken by an outgoing connection before the coordinator bound it.
#[test]
fn ports_are_outside_the_ephemeral_range_and_never_handed_out_twice() {
    let (low, high) = common::ports::ephemeral_range();
    let ports: Vec<u16> = (0..50).map(|_| free_port()).collect();
    let mut unique = ports.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), ports.len(), "a port was handed out twice: {ports:?}");
    if low >= 1024 + common::ports::POOL || high <= u16::MAX - common::ports::POOL {
        assert!(ports.iter().all(|p| !(low..=high).contains(p)), "{ports:?} meet the ephemeral range {low}-{high}");
    }
}
