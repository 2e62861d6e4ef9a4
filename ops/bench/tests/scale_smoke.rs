//! `ops/bench/scale.sh` end to end on small clusters:
//! - `--kill --load N`: `walship-history` appends QUORUM records to a
//!   sample of shards while node 1 (leading some of them) is killed with
//!   SIGKILL, then every acknowledged record is read back from every node.
//!   Nothing acknowledged may be lost, the load must have run before the
//!   kill, and every shard must have been read on every node (node 1
//!   restarted and caught up);
//!   With node 1 left down, it is unchecked, not a loss;
//! - `--throughput M`: the QUORUM bench on one shard and over M, and their
//!   ratio;
//! - `walship-history` alone: a shard larger than a client message is read
//!   back whole.
//!
//! Bad arguments are refused before anything starts.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;

fn walship_binary() -> PathBuf {
    common::walship_beside(env!("CARGO_BIN_EXE_walship-history"))
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `ops/bench/scale.sh --walship <the walship cargo built> args...`.
fn scale(args: &[&str]) -> Output {
    Command::new("bash")
        .arg("ops/bench/scale.sh")
        .arg("--walship")
        .arg(walship_binary())
        .args(args)
        .current_dir(root())
        .output()
        .unwrap()
}

/// A successful run's last line, its JSON object.
fn last_line(run: &Output) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "scale.sh failed:\n{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    serde_json::from_str(stdout.lines().last().unwrap_or("")).expect("one JSON line")
}

/// The load-and-check command `ops/README.md` prints under "Many shards"
/// (its second `sh` block).
fn printed_command() -> String {
    let readme = std::fs::read_to_string(root().join("ops/README.md")).unwrap();
    let section = readme.split("### Many shards").nth(1).expect("a Many shards section");
    let command = section.split("```sh\n").nth(2).and_then(|b| b.split("```").next()).expect("a second sh block");
    command.trim().to_string()
}

#[test]
fn a_node_killed_under_load_loses_no_acknowledged_record_of_the_sample() {
    // Run as printed, with the binaries cargo built for this test (the
    // script's own choice is target/release, else target/debug).
    let command = printed_command();
    assert_eq!(command, "ops/bench/scale.sh --shards 30 --idle-s 1 --load 8");
    let run = Command::new("bash")
        .arg("-c")
        .arg(format!("{command} --walship {}", walship_binary().display()))
        .current_dir(root())
        .output()
        .unwrap();
    let line = last_line(&run);
    let failover = &line["failover"];
    assert!(failover["shards_led"].as_u64().unwrap() > 0, "node 1 led shards: {line}");
    assert!(failover["p99_s"].as_f64().is_some(), "its shards got leaders again: {line}");
    let history = &line["history"];
    assert_eq!(history["shards"], 8, "{history}");
    assert_eq!(history["lost"], 0, "{history}");
    assert_eq!(history["shards_unread"], 0, "{history}");
    let acked = history["acked"].as_u64().unwrap();
    let before = history["acked_before_mark"].as_u64().unwrap();
    assert!(before > 0 && acked > before, "appends acknowledged before and after the kill: {history}");
    // Every shard on all three nodes: node 1 came back and caught up.
    assert_eq!(history["checked"], 24, "{history}");
    assert_eq!(history["unchecked"], 0, "{history}");
    assert!(
        common::processes_mentioning("walship-history").is_empty(),
        "walship-history left running: {:?}",
        common::processes_mentioning("walship-history")
    );
}

#[test]
fn a_node_left_down_is_unchecked_not_lost() {
    let line = last_line(&scale(&["--shards", "30", "--idle-s", "1", "--load", "8", "--no-restart"]));
    let history = &line["history"];
    assert_eq!(history["lost"], 0, "{history}");
    // Node 1 stayed down: each of the 8 shards read on the two others only.
    assert_eq!((history["checked"].as_u64(), history["unchecked"].as_u64()), (Some(16), Some(8)), "{history}");
    assert_eq!(history["unreadable"].as_array().map(Vec::len), Some(1), "node 1, and why: {history}");
    assert_eq!(history["shards_unread"], 0, "{history}");
}

#[test]
fn the_throughput_line_gives_many_shards_against_one() {
    let line = last_line(&scale(&["--shards", "", "--throughput", "4", "--throughput-s", "0.5"]));
    let figures = &line["throughput"];
    assert_eq!(figures["shards"], 4, "{line}");
    let one = figures["one_shard_records_per_s"].as_f64().unwrap();
    let many = figures["many_shards_records_per_s"].as_f64().unwrap();
    assert!(one > 0.0 && many > 0.0, "{line}");
    let ratio = figures["ratio"].as_f64().unwrap();
    // Rounded rates and ratio: within a rounding of each other.
    assert!((ratio - many / one).abs() < 0.01, "{line}");
    assert!(figures["server_cpu_us_per_record"]["many_shards"].as_f64().is_some(), "{line}");
}

#[test]
fn bad_arguments_are_refused_before_anything_starts() {
    let refused = scale(&["--shards", "10", "--load", "some"]);
    assert_eq!(refused.status.code(), Some(2), "{refused:?}");
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--load takes a number of shards"), "{refused:?}");
    assert!(refused.stdout.is_empty(), "nothing measured: {refused:?}");
    for (flag, value, why) in [
        ("--throughput", "1", "--throughput takes a shard count above 1"),
        ("--throughput", "x", "--throughput takes a shard count above 1"),
        ("--throughput-s", "0", "--throughput-s takes a positive number"),
        ("--throughput-s", "-3", "--throughput-s takes a positive number"),
    ] {
        let mut args = vec!["--shards", "10", "--throughput", "4"];
        args.extend([flag, value]);
        let refused = scale(&args);
        assert_eq!(refused.status.code(), Some(2), "{flag} {value}: {refused:?}");
        assert!(String::from_utf8_lossy(&refused.stderr).contains(why), "{flag} {value}: {refused:?}");
        assert!(refused.stdout.is_empty(), "{flag} {value}: nothing measured: {refused:?}");
    }

    let stop = tempfile::NamedTempFile::new().unwrap();
    for (shards, why) in [("0", "shard ids start at 1"), ("1,x", "shard id"), ("", "names no shard")] {
        let run = Command::new(env!("CARGO_BIN_EXE_walship-history"))
            .args(["--servers", "127.0.0.1:1", "--shards", shards, "--stop-file"])
            .arg(stop.path())
            .env("RUST_BACKTRACE", "0")
            .output()
            .unwrap();
        assert!(!run.status.success(), "--shards {shards:?} accepted");
        assert!(String::from_utf8_lossy(&run.stderr).contains(why), "--shards {shards:?}: {run:?}");
        assert!(run.stdout.is_empty(), "--shards {shards:?}: {run:?}");
    }
    let run = Command::new(env!("CARGO_BIN_EXE_walship-history"))
        .args(["--servers", "127.0.0.1:1", "--shards", "1", "--max-seconds", "0", "--stop-file"])
        .arg(stop.path())
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    assert!(!run.status.success(), "--max-seconds 0 accepted: {run:?}");
    assert!(String::from_utf8_lossy(&run.stderr).contains("must be positive"), "{run:?}");
}

#[test]
fn a_check_without_a_reachable_node_fails() {
    // The stop file exists: no append is made, nothing is acknowledged,
    // and a history that showed nothing does not pass.
    let stop = tempfile::NamedTempFile::new().unwrap();
    let run = Command::new(env!("CARGO_BIN_EXE_walship-history"))
        .args(["--servers", "127.0.0.1:1", "--shards", "1,2", "--wait-seconds", "1", "--stop-file"])
        .arg(stop.path())
        .output()
        .unwrap();
    assert_eq!(run.status.code(), Some(1), "{run:?}");
    let verdict: serde_json::Value = serde_json::from_slice(&run.stdout).expect("the verdict is printed");
    assert_eq!(verdict["acked"], 0, "{verdict}");
    // Why the node could not be read is said.
    let unreadable = verdict["unreadable"].as_array().expect("unreadable listed");
    assert!(unreadable.len() == 1 && unreadable[0].as_str().unwrap().starts_with("127.0.0.1:1: "), "{verdict}");
}

/// A shard holding more than a client message (4 MiB) is still read back
/// whole on every node: the check reads it a page at a time. (It asked for
/// the node's default page, up to 32 MiB, which the client then refused to
/// decode; every node of such a shard counted as unreadable.)
#[test]
fn a_shard_larger_than_a_client_message_is_checked_on_every_node() {
    use std::io::BufRead;
    let data = tempfile::tempdir().unwrap();
    let mut dev = Command::new(walship_binary())
        .args(["dev", "--shards", "1", "--base-port", "0", "--data-dir"])
        .arg(data.path().join("dev"))
        .env("WALSHIP_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut servers = Vec::new();
    let mut lines = std::io::BufReader::new(dev.stdout.take().unwrap()).lines().map_while(Result::ok);
    for line in lines.by_ref() {
        let words: Vec<&str> = line.split_whitespace().collect();
        if let [node, _, grpc, address, ..] = words[..]
            && node == "node"
            && grpc == "gRPC"
        {
            servers.push(address.to_string());
        }
        if line.starts_with("dashboard:") {
            break;
        }
    }
    assert_eq!(servers.len(), 3, "the dev cluster printed its nodes");
    // Read to the end, so the dev cluster never writes into a closed pipe.
    std::thread::spawn(move || lines.for_each(drop));
    let never = data.path().join("stop");
    let run = Command::new(env!("CARGO_BIN_EXE_walship-history"))
        .args(["--servers", &servers.join(","), "--shards", "1", "--size", "100000", "--max-seconds", "4"])
        .arg("--stop-file")
        .arg(&never)
        .output()
        .unwrap();
    // SAFETY: kill(2) on the dev cluster this test started; it stops its nodes.
    unsafe { libc::kill(dev.id() as i32, libc::SIGTERM) };
    let _ = dev.wait();
    let verdict: serde_json::Value = serde_json::from_slice(&run.stdout).expect("the verdict is printed");
    assert!(run.status.success(), "{verdict}\n{}", String::from_utf8_lossy(&run.stderr));
    let acked = verdict["acked"].as_u64().unwrap();
    assert!(acked * 100_000 > 6 << 20, "only {acked} records of 100 kB: the shard must outgrow a 4 MiB message");
    assert_eq!((verdict["checked"].as_u64(), verdict["lost"].as_u64()), (Some(3), Some(0)), "{verdict}");
    assert_eq!(verdict["unreadable"], serde_json::json!([]), "{verdict}");
}
