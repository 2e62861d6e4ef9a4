//! What an operator reads in the logs: a coordinator started before its
//! nodes does not WARN `no majority` for replicas that have not started
//! yet, while a real loss of majority later does; `WALSHIP_LOG_FORMAT=json`
//! (or `--log-format json`) writes one JSON object per line; `--help` says
//! how logging is set.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{TOKEN, free_port, spawn_listening_logged, wait_until, walship_bin};

const WAIT: Duration = Duration::from_secs(60);

/// A cluster file for `nodes` nodes and one coordinator on free ports, every
/// shard on every node; returns (path, coordinator admin address).
fn cluster_file(dir: &Path, nodes: u32, shards: u32) -> (std::path::PathBuf, String) {
    let admin = format!("127.0.0.1:{}", free_port());
    let mut toml = format!(
        "cluster_id = \"logs\"\nsecret = \"{}\"\n[[coordinators]]\nid = \"c1\"\ngrpc_addr = \"127.0.0.1:{}\"\nadmin_addr = \"{admin}\"\n",
        common::SECRET,
        free_port()
    );
    for id in 1..=nodes {
        toml += &format!(
            "[[nodes]]\nid = {id}\ngrpc_addr = \"127.0.0.1:{}\"\nadmin_addr = \"127.0.0.1:{}\"\nregion = {id}\n",
            free_port(),
            free_port()
        );
    }
    for shard in 1..=shards {
        toml += &format!("[[shards]]\nid = {shard}\nreplicas = [1, 2, 3]\nleader = {}\n", (shard - 1) % nodes + 1);
    }
    let path = dir.join("cluster.toml");
    std::fs::write(&path, toml).unwrap();
    (path, admin)
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_node(cluster: &Path, dir: &Path, id: u32) -> Killed {
    let (child, _) = spawn_listening_logged(
        Command::new(walship_bin())
            .args(["node", "--wal-prefill", "false", "--node-id", &id.to_string(), "--cluster"])
            .arg(cluster)
            .arg("--data-dir")
            .arg(dir.join(format!("node-{id}"))),
        &format!("node {id}"),
        Some(&dir.join(format!("node-{id}.log"))),
    );
    Killed(child)
}

fn no_majority_lines(log: &str, level: &str) -> Vec<String> {
    log.lines().filter(|l| l.contains(level) && l.contains("no majority")).map(str::to_string).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_before_its_nodes_does_not_warn_no_majority_but_a_real_loss_does() {
    let dir = tempfile::tempdir().unwrap();
    let (cluster, admin) = cluster_file(dir.path(), 3, 3);
    let coord_log = dir.path().join("coord.log");
    let (coordinator, _) = spawn_listening_logged(
        Command::new(walship_bin())
            .args(["coord", "--id", "c1", "--admin-token", TOKEN, "--cluster"])
            .arg(&cluster)
            .arg("--data-dir")
            .arg(dir.path().join("coord")),
        "coordinator",
        Some(&coord_log),
    );
    let _coordinator = Killed(coordinator);
    let log = || std::fs::read_to_string(&coord_log).unwrap_or_default();
    // Node 1 alone: the shards led by nodes 2 and 3 look lost, and their
    // failovers find one replica of three. That is start-up, not a loss.
    let _node1 = start_node(&cluster, dir.path(), 1);
    wait_until("the coordinator notes a shard waiting for its replicas", WAIT, || async {
        log().contains("waits for a majority")
    })
    .await;
    let mut node2 = start_node(&cluster, dir.path(), 2);
    let mut node3 = start_node(&cluster, dir.path(), 3);
    wait_until("every shard has a leader", WAIT, || async {
        let (code, body) = common::http_get(&format!("{admin}/v1/shards")).await;
        code == 200
            && serde_json::from_str::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v.as_array().map(|a| a.iter().all(|s| s["leader"].is_u64())))
                .unwrap_or(false)
    })
    .await;
    let text = log();
    assert_eq!(no_majority_lines(&text, "WARN"), Vec::<String>::new(), "start-up WARNed:\n{text}");
    let warnings: Vec<&str> = text.lines().filter(|l| l.contains(" WARN ") || l.contains(" ERROR ")).collect();
    assert!(warnings.is_empty(), "a start-up in order logged warnings:\n{text}");
    assert!(!no_majority_lines(&text, "INFO").is_empty(), "the waiting was not logged at INFO:\n{text}");

    // A real loss of majority: nodes 2 and 3 die; node 1 is left alone.
    let _ = node2.0.kill();
    let _ = node3.0.kill();
    let _ = (node2.0.wait(), node3.0.wait());
    wait_until("a WARN for the lost majority", WAIT, || async { !no_majority_lines(&log(), "WARN").is_empty() }).await;
    // It says which replicas did not answer, and why.
    let warned = no_majority_lines(&log(), "WARN");
    assert!(
        warned.iter().any(|l| l.contains("node 2: ") && l.contains("node 3: ")),
        "the WARN does not name the silent replicas:\n{warned:#?}"
    );
}

/// Runs `walship node` with `env`/`args` until its listening line; returns
/// its stderr (the log) after SIGTERM.
fn node_log(dir: &Path, env: &[(&str, &str)], args: &[&str]) -> String {
    let mut command = Command::new(walship_bin());
    command
        .args(["node", "--wal-prefill", "false", "--node-id", "1", "--shards", "1"])
        .args(["--grpc", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--data-dir"])
        .arg(dir)
        .args(args)
        .env("WALSHIP_LOG", "info")
        .env_remove("WALSHIP_LOG_FORMAT")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        command.env(k, v);
    }
    let mut child = command.spawn().unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut line).unwrap();
    assert!(line.contains("listening"), "{line:?}");
    // SAFETY: kill(2) on the child spawned above.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let out = child.wait_with_output().unwrap();
    String::from_utf8(out.stderr).unwrap()
}

/// A node stopped by SIGTERM and started again: its WAL's newest file goes
/// on past the written end (raft-engine's `fallocate`), and the recovery's
/// cut of that space is the end of the log the clean shutdown recorded, not
/// corruption. (Every graceful restart used to log an ERROR "corruption"
/// and make every shard wait for the coordinator.)
#[test]
fn a_graceful_restart_reports_no_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let first = node_log(dir.path(), &[], &[]);
    assert!(!first.contains(" ERROR "), "{first}");
    let again = node_log(dir.path(), &[], &[]);
    let bad: Vec<&str> = again.lines().filter(|l| l.contains(" ERROR ") || l.contains(" WARN ")).collect();
    assert!(bad.is_empty(), "a restart after a clean shutdown:\n{again}");
    assert!(again.contains("the end of the log a clean shutdown left"), "{again}");
}

#[test]
fn json_log_format_writes_one_object_per_line_from_env_or_flag() {
    for (env, args) in [(&[("WALSHIP_LOG_FORMAT", "json")][..], &[][..]), (&[][..], &["--log-format", "json"][..])] {
        let dir = tempfile::tempdir().unwrap();
        let log = node_log(dir.path(), env, args);
        let lines: Vec<&str> = log.lines().collect();
        assert!(!lines.is_empty(), "no log lines at INFO");
        for line in &lines {
            let v: serde_json::Value =
                serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line:?}\n{log}"));
            assert!(v["level"].is_string() && v["timestamp"].is_string(), "{line}");
            assert!(v["fields"]["message"].is_string(), "{line}");
        }
        assert!(!log.contains('\u{1b}'), "ANSI codes in a JSON log");
    }
    // The default stays text.
    let dir = tempfile::tempdir().unwrap();
    let log = node_log(dir.path(), &[], &[]);
    assert!(log.lines().any(|l| l.contains(" INFO ")), "{log}");
    assert!(log.lines().all(|l| serde_json::from_str::<serde_json::Value>(l).is_err()), "{log}");
}

#[test]
fn a_bad_log_format_is_refused_and_help_documents_logging() {
    let out = Command::new(walship_bin()).args(["status"]).env("WALSHIP_LOG_FORMAT", "yaml").output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("WALSHIP_LOG_FORMAT must be `text` or `json`"), "{stderr}");
    let out = Command::new(walship_bin()).args(["--log-format", "yaml", "status"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid value 'yaml'"));
    for args in [&["--help"][..], &["node", "--help"], &["coord", "--help"], &["dev", "--help"]] {
        let out = Command::new(walship_bin()).args(args).output().unwrap();
        let help = String::from_utf8_lossy(&out.stdout);
        for word in ["WALSHIP_LOG ", "WALSHIP_LOG_FORMAT", "--log-format", "json"] {
            assert!(help.contains(word), "`walship {}` does not mention {word}:\n{help}", args.join(" "));
        }
    }
}
