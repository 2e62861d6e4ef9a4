//! `walship-rebuild --smoke` end to end (8 MiB per system), against real
//! servers: a `walship dev` cluster (the `walship` binary cargo built beside
//! this package's) running its re-seed drill, and a PostgreSQL primary
//! (Debian's) cloned with `pg_basebackup`. The report must hold positive
//! figures for both systems, and no server or data may be left behind.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;

use common::processes_mentioning;

fn walship_binary() -> PathBuf {
    common::walship_beside(env!("CARGO_BIN_EXE_walship-rebuild"))
}

fn work_dir() -> tempfile::TempDir {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/tmp");
    std::fs::create_dir_all(&root).unwrap();
    tempfile::tempdir_in(&root).unwrap()
}

fn rebuild(args: &[&str], data: &Path, out: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_walship-rebuild"))
        .args(args)
        .arg("--dir")
        .arg(data)
        .arg("--out")
        .arg(out)
        .arg("--walship")
        .arg(walship_binary())
        .output()
        .unwrap()
}

fn positive(value: &serde_json::Value, field: &str) -> f64 {
    let v = value[field].as_f64().unwrap_or_else(|| panic!("no number {field} in {value}"));
    assert!(v > 0.0 && v.is_finite(), "{field} = {v} in {value}");
    v
}

/// PostgreSQL's half: the data directory pg_basebackup wrote holds at
/// least what was loaded, and took a measurable time.
fn check_postgres(report: &serde_json::Value) {
    let pg = &report["postgres"];
    assert_eq!(pg["loaded_bytes"], 8 << 20, "{pg}");
    assert_eq!(pg["rows"], 2048, "{pg}");
    assert!(pg["table_bytes"].as_u64().unwrap() >= 8 << 20, "{pg}");
    assert!(pg["backup_bytes"].as_u64().unwrap() > pg["table_bytes"].as_u64().unwrap(), "{pg}");
    let (seconds, rate) = (positive(pg, "seconds"), positive(pg, "mib_per_s"));
    let expected = pg["backup_bytes"].as_f64().unwrap() / (1 << 20) as f64 / seconds;
    assert!((rate - expected).abs() < 1e-6 * expected, "{pg}");
}

#[test]
fn rebuild_smoke_run_measures_both_systems_and_leaves_nothing_running() {
    let work = work_dir();
    let (data, out) = (work.path().join("data"), work.path().join("out"));
    let run = rebuild(&["--smoke"], &data, &out);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "walship-rebuild --smoke failed:\n{stderr}");

    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("rebuild.json")).unwrap()).unwrap();
    let raw = positive(&report["disk"], "seq_write_mib_s");
    assert_eq!(report["settings"]["volume_bytes"], 8 << 20);

    let w = &report["walship"];
    for field in ["archive_mib_per_s", "total_mib_per_s", "seconds", "append_rate_before", "append_rate_during"] {
        positive(w, field);
    }
    let sealed = w["bytes_archive"].as_u64().unwrap() + w["bytes_peer"].as_u64().unwrap();
    assert!(sealed > 0, "nothing re-seeded from sealed segments (peers or the archive): {w}");
    assert_eq!(w["source"], "all", "{w}");
    assert!(w["records"].as_u64().unwrap() > 0, "{w}");
    assert_eq!(w["lost"], 0, "{w}");
    assert_eq!(w["divergent_replicas"], 0, "{w}");
    check_postgres(&report);

    let rows = report["rows"].as_array().unwrap();
    let figures: Vec<&str> = rows.iter().map(|r| r["figure"].as_str().unwrap()).collect();
    assert_eq!(
        figures,
        [
            "walship re-seed, sealed-segment tiers",
            "walship re-seed, overall",
            "PostgreSQL pg_basebackup",
            "walship live appends during re-seed"
        ]
    );
    for r in &rows[..3] {
        let ratio = positive(r, "ratio");
        assert!((ratio - r["value"].as_f64().unwrap() / raw).abs() < 1e-9, "{r}");
    }
    assert_eq!(rows[0]["target"], 0.6);
    assert_eq!(rows[3]["target"], 0.8);
    positive(&rows[3], "ratio");

    let markdown = std::fs::read_to_string(out.join("rebuild.md")).unwrap();
    assert!(markdown.contains("Re-seed from the archive vs pg_basebackup"), "{markdown}");
    assert!(markdown.contains("| PostgreSQL pg_basebackup |"), "{markdown}");
    assert!(String::from_utf8_lossy(&run.stdout).contains("| walship re-seed, overall |"));

    let left = processes_mentioning(&data.display().to_string());
    assert!(left.is_empty(), "servers still running after the harness exited: {left:?}");
    assert!(!data.exists(), "the harness leaves no data behind");
}

/// PostgreSQL alone (`--systems postgres`): checks that half on its own.
#[test]
fn rebuild_smoke_run_of_postgres_alone() {
    let work = work_dir();
    let (data, out) = (work.path().join("data"), work.path().join("out"));
    let run = rebuild(&["--smoke", "--systems", "postgres"], &data, &out);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "walship-rebuild --smoke --systems postgres failed:\n{stderr}");
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("rebuild.json")).unwrap()).unwrap();
    assert!(report["walship"].is_null(), "{report}");
    check_postgres(&report);
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "{rows:?}");
    positive(&rows[0], "ratio");
    let markdown = std::fs::read_to_string(out.join("rebuild.md")).unwrap();
    assert!(markdown.contains("walship was not run"), "{markdown}");
    assert!(processes_mentioning(&data.display().to_string()).is_empty());
    assert!(!data.exists(), "the harness leaves no data behind");
}

/// NATS JetStream alone (`--systems nats`): a replica that lost its store
/// comes back, with figures, and every nats-server is stopped.
#[test]
fn rebuild_smoke_run_of_nats_alone() {
    let nats = std::env::var("WALSHIP_NATS_SERVER")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../../.walship/tools/venv/bin/nats-server").into());
    let work = work_dir();
    let (data, out) = (work.path().join("data"), work.path().join("out"));
    let run = rebuild(&["--smoke", "--systems", "nats", "--nats-server", &nats, "--name", "nats"], &data, &out);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "walship-rebuild --smoke --systems nats failed:\n{stderr}");
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("nats.json")).unwrap()).unwrap();
    assert!(report["walship"].is_null() && report["postgres"].is_null(), "{report}");
    let n = &report["nats"];
    for field in ["mib_per_s", "seconds", "append_rate_before", "append_rate_during"] {
        positive(n, field);
    }
    assert!(n["messages"].as_u64().unwrap() >= 2048, "{n}");
    assert!(n["bytes"].as_u64().unwrap() >= 8 << 20, "{n}");
    assert_eq!(n["final_messages"], n["final_leader_messages"], "{n}");
    assert_ne!(n["server"], n["leader"], "{n}");
    let figures: Vec<&str> = report["rows"].as_array().unwrap().iter().map(|r| r["figure"].as_str().unwrap()).collect();
    assert_eq!(figures, ["NATS JetStream replica catch-up", "NATS live publishes during catch-up"]);
    assert!(processes_mentioning(&data.display().to_string()).is_empty());
    assert!(!data.exists(), "the harness leaves no data behind");
}

#[test]
fn bad_rebuild_arguments_are_refused_before_anything_starts() {
    for (args, needle) in [
        (&["--mib", "0"][..], "at least 1"),
        (&["--clients", "0"][..], "at least 1"),
        (&["--record-bytes", "2000000"][..], "1 MiB"),
        (&["--systems", "kafka"][..], "kafka"),
    ] {
        let work = tempfile::tempdir().unwrap();
        let data = work.path().join("data");
        let run = rebuild(args, &data, &work.path().join("out"));
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(!run.status.success(), "{args:?} was accepted");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!data.exists(), "{args:?} created the data dir");
    }
    let work = tempfile::tempdir().unwrap();
    let data = work.path().join("data");
    let run = Command::new(env!("CARGO_BIN_EXE_walship-rebuild"))
        .arg("--dir")
        .arg(&data)
        .args(["--walship", "/nonexistent/walship"])
        .output()
        .unwrap();
    assert!(!run.status.success());
    assert!(String::from_utf8_lossy(&run.stderr).contains("/nonexistent/walship"));
    assert!(!data.exists());
}
