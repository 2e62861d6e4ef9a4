//! `ops/bench/chaos.sh` end to end on a small dev cluster: the command
//! `ops/README.md` prints ("Chaos") runs as printed, makes its faults, and
//! every acknowledged record of the sample is read back from every node;
//! bad arguments are refused before anything starts.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The command printed under "Chaos" in `ops/README.md`, its arguments.
fn printed_command() -> Vec<String> {
    let readme = std::fs::read_to_string(root().join("ops/README.md")).unwrap();
    let section = readme.split("### Chaos").nth(1).expect("a Chaos section");
    let command = section.split("```sh\n").nth(1).and_then(|b| b.split("```").next()).expect("an sh block");
    command.split_whitespace().map(str::to_string).collect()
}

/// `ops/bench/chaos.sh --walship <the walship cargo built> args...`.
fn chaos(args: &[&str]) -> Output {
    let walship = common::walship_beside(env!("CARGO_BIN_EXE_walship-history"));
    Command::new("bash")
        .arg("ops/bench/chaos.sh")
        .arg("--walship")
        .arg(walship)
        .args(args)
        .current_dir(root())
        .output()
        .unwrap()
}

/// [`chaos`] with `args` and `--keep kept`; its JSON line, once it
/// succeeded.
fn chaos_kept(args: &[&str], kept: &Path) -> serde_json::Value {
    let mut args = args.to_vec();
    args.extend(["--keep", kept.to_str().unwrap()]);
    let run = chaos(&args);
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "chaos.sh failed:\n{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
    serde_json::from_str(stdout.lines().last().unwrap_or("")).expect("one JSON line")
}

/// The check's verdict: something acknowledged, nothing lost, every
/// shard read.
fn assert_nothing_lost(history: &serde_json::Value) {
    assert!(history["acked"].as_u64().unwrap() > 0, "{history}");
    assert_eq!(history["lost"], 0, "{history}");
    assert_eq!(history["shards_unread"], 0, "{history}");
}

#[test]
fn random_faults_under_load_lose_no_acknowledged_record() {
    let command = printed_command();
    assert_eq!(command[0], "ops/bench/chaos.sh");
    let keep = tempfile::tempdir().unwrap();
    let args: Vec<&str> = command[1..].iter().map(String::as_str).collect();
    let kept = keep.path().join("run");
    let line = chaos_kept(&args, &kept);
    let faults = &line["faults"];
    let made: u64 = ["kill", "term", "freeze", "kill2", "coord"].iter().map(|k| faults[k].as_u64().unwrap()).sum();
    assert!(made >= 2, "a 20 s run makes a fault every 3 to 7 s: {line}");
    let listed = std::fs::read_to_string(kept.join("faults.txt")).unwrap();
    assert_eq!(listed.lines().count() as u64, made, "every fault made is listed:\n{listed}");
    let history = &line["history"];
    assert_nothing_lost(history);
    assert_eq!(history["checked"], 24, "8 shards on 3 nodes: {history}");
    assert_eq!(line["wal_unopenable"], serde_json::json!([]), "{line}");
    // Nothing of the run is left behind.
    let data = kept.join("data");
    assert_eq!(common::processes_mentioning(data.to_str().unwrap()), Vec::<u32>::new());
    assert_eq!(common::processes_mentioning("walship-history"), Vec::<u32>::new());
}

/// `--faults corrupt`: bytes flipped in the nodes' WAL files, half of
/// them while the node is down. Whatever they hit, no acknowledged record
/// may be lost or served changed, and a node whose copy of a shard is
/// damaged must repair it (the check asks it again until then).
#[test]
fn flipped_wal_bytes_lose_no_acknowledged_record() {
    let keep = tempfile::tempdir().unwrap();
    let kept = keep.path().join("run");
    let args = ["--shards", "30", "--sample", "8", "--seconds", "20", "--seed", "5", "--faults", "corrupt"];
    let line = chaos_kept(&args, &kept);
    let made = line["faults"]["corrupt"].as_u64().unwrap();
    assert!(line["wal_unopenable"].is_array(), "the nodes that could not open their WAL are listed: {line}");
    assert!(made >= 2, "{line}");
    let listed = std::fs::read_to_string(kept.join("faults.txt")).unwrap();
    let flips = listed.lines().filter(|l| l.contains(".raftlog at ") && l.contains(" -> ")).count() as u64;
    assert_eq!(flips, made, "every flip names its file, offset and bytes:\n{listed}");
    assert_nothing_lost(&line["history"]);
    assert_eq!(common::processes_mentioning(kept.join("data").to_str().unwrap()), Vec::<u32>::new());
}

/// `--faults kill,rebalance`: rebalances asked for between kills, so
/// that a returned node's share of the leaderships moves back to it under
/// load. Each rebalance must be answered with its plan, and nothing
/// acknowledged may be lost.
#[test]
fn rebalances_between_kills_lose_no_acknowledged_record() {
    let keep = tempfile::tempdir().unwrap();
    let kept = keep.path().join("run");
    // Seed 9: three kills 7, 13 and 17 s in, then a rebalance 7 s later.
    let args = ["--shards", "30", "--sample", "8", "--seconds", "25", "--seed", "9", "--faults", "kill,rebalance"];
    let line = chaos_kept(&args, &kept);
    let made = line["faults"]["rebalance"].as_u64().unwrap();
    assert!(made >= 1 && line["faults"]["kill"].as_u64().unwrap() >= 1, "{line}");
    let listed = std::fs::read_to_string(kept.join("faults.txt")).unwrap();
    let answered = listed.lines().filter(|l| l.contains(" rebalance ") && l.contains(" planned, ")).count() as u64;
    assert_eq!(answered, made, "every rebalance was answered with its plan:\n{listed}");
    eprintln!("{listed}");
    assert_nothing_lost(&line["history"]);
    assert_eq!(common::processes_mentioning(kept.join("data").to_str().unwrap()), Vec::<u32>::new());
}

#[test]
fn bad_arguments_are_refused_before_anything_starts() {
    for (args, why) in [
        (
            &["--faults", "kill,boom"][..],
            "--faults: boom is not one of kill, term, freeze, kill2, coord, corrupt, rebalance",
        ),
        (&["--faults", ""][..], "--faults names none"),
        (&["--sample", "0"][..], "--sample takes a whole number of at least 1"),
        (&["--shards", "4", "--sample", "5"][..], "--sample 5 is more than the 4 shards"),
        (&["--seconds", "x"][..], "--seconds takes a whole number"),
        (&["--seed", "-1"][..], "--seed takes a whole number"),
        (&["--max-disk-mib", "1.5"][..], "--max-disk-mib takes a whole number"),
        (&["--bogus"][..], "unknown argument --bogus"),
    ] {
        let refused = chaos(args);
        assert_eq!(refused.status.code(), Some(2), "{args:?}: {refused:?}");
        assert!(String::from_utf8_lossy(&refused.stderr).contains(why), "{args:?}: {refused:?}");
        assert!(refused.stdout.is_empty(), "{args:?}: nothing run: {refused:?}");
    }
}
