//! `walship-memory` end to end in seconds, against real `walship node`
//! processes (the binary cargo built beside this package's): a few seconds of
//! load, a small read count, and the same binary again as the baseline. The
//! report must hold sane figures, and no process or data may be left behind.

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;

use common::processes_mentioning;

/// The `walship` binary cargo built beside this package's binaries.
fn walship_binary() -> PathBuf {
    common::walship_beside(env!("CARGO_BIN_EXE_walship-memory"))
}

#[test]
fn memory_smoke_run_reports_sane_figures_and_leaves_nothing_running() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/tmp");
    std::fs::create_dir_all(&root).unwrap();
    let work = tempfile::tempdir_in(&root).unwrap();
    let data = work.path().join("data");
    let out = work.path().join("out");
    let walship = walship_binary();

    let run = Command::new(env!("CARGO_BIN_EXE_walship-memory"))
        .args(["--duration", "4", "--warmup", "1", "--reads", "50", "--wal-spare-bytes", "0"])
        .arg("--dir")
        .arg(&data)
        .arg("--out")
        .arg(&out)
        .arg("--walship")
        .arg(&walship)
        .arg("--baseline")
        .arg(&walship)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "walship-memory failed:\n{stderr}");

    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("memory.json")).unwrap()).unwrap();
    assert!(report["disk"]["fdatasync_4k_p99_us"].as_f64().unwrap() > 0.0);
    let runs = report["runs"].as_array().unwrap();
    assert_eq!(runs.iter().map(|r| r["label"].as_str().unwrap()).collect::<Vec<_>>(), ["new", "baseline"]);
    for run in runs {
        let label = run["label"].as_str().unwrap();
        assert!(run["records_per_s"].as_f64().unwrap() > 10.0, "{label}: {run}");
        let nodes = run["nodes"].as_array().unwrap();
        assert_eq!(nodes.len(), 3, "{label}: {run}");
        assert_eq!(nodes.iter().filter(|n| n["role"] == "leader").count(), 1, "{label}: {run}");
        for n in nodes {
            assert!(n["rss_end_bytes"].as_u64().unwrap() > 1 << 20, "{label}: {n}");
            assert!(n["rss_warmup_bytes"].as_u64().unwrap() > 1 << 20, "{label}: {n}");
            let retained = n["retained_end"].as_u64().unwrap();
            assert!(retained > n["retained_warmup"].as_u64().unwrap() && retained > 10, "{label}: {n}");
            assert_eq!(n["first_seqno_end"], 1, "nothing compacted: {n}");
            assert!(n["rss_growth_per_10m_mib"].is_number(), "{label}: {n}");
            assert!(n["slope_bytes_per_record"].is_number(), "{label}: {n}");
        }
        let reads = &run["reads"];
        assert_eq!(reads["requested"], 50, "{label}: {reads}");
        assert_eq!(reads["errors"], 0, "{label}: {reads}");
        let (p50, p99) = (reads["p50_us"].as_f64().unwrap(), reads["p99_us"].as_f64().unwrap());
        assert!(p50 > 0.0 && p50 <= p99, "{label}: {reads}");
        let (from, to) = (reads["from_seqno"].as_u64().unwrap(), reads["to_seqno"].as_u64().unwrap());
        assert!(from >= 1 && from <= to && to * 2 <= reads["last_seqno"].as_u64().unwrap() + 1, "{label}: {reads}");
    }
    // The same binary twice: every ratio is there (the index is n/a when
    // the binary exports no index gauge).
    let ratios = report["ratios"].as_array().unwrap();
    assert_eq!(ratios.len(), 7, "{ratios:?}");
    for r in ratios.iter().filter(|r| !r["figure"].as_str().unwrap().starts_with("index")) {
        assert!(r["ratio"].as_f64().unwrap() > 0.0, "{r}");
    }

    let markdown = std::fs::read_to_string(out.join("memory.md")).unwrap();
    assert!(markdown.contains("**Resident memory per node**"), "{markdown}");
    assert!(markdown.contains("**new ÷ baseline**"), "{markdown}");
    assert!(String::from_utf8_lossy(&run.stdout).contains("**Resident memory per node**"));
    let csv = std::fs::read_to_string(out.join("memory-samples.csv")).unwrap();
    assert!(csv.starts_with("run,t_s,acked,node,pid,role,rss_bytes,"), "{csv}");
    // A sample before the load, about one a second, one after it: per node and run.
    assert!(csv.lines().filter(|l| l.starts_with("baseline,")).count() >= 3 * 5, "{csv}");

    let left = processes_mentioning(&data.display().to_string());
    assert!(left.is_empty(), "walship still running after the harness exited: {left:?}");
    assert!(!data.exists(), "the harness leaves no data behind");
}

#[test]
fn bad_memory_arguments_are_refused_before_anything_starts() {
    for (args, needle) in [
        (&["--duration", "0"][..], "--duration"),
        (&["--duration", "5", "--warmup", "5"][..], "--warmup"),
        (&["--reads", "0"][..], "at least 1"),
        (&["--clients", "0"][..], "at least 1"),
        (&["--baseline", "/nonexistent/walship"][..], "/nonexistent/walship"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let run = Command::new(env!("CARGO_BIN_EXE_walship-memory"))
            .args(args)
            .arg("--walship")
            .arg(walship_binary())
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
