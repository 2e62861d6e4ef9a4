//! Smoke run of `walship bench` (a fraction of a second per cell) so the
//! harness cannot rot. It checks the harness produces figures, never their
//! values: speed lives in the benchmark's printed ratios, not in tests.

mod common;

use std::process::Command;

/// `walship bench` with `paths` and `shards`, 100 B records, 2 appenders,
/// half-second cells: its stdout and its `--json` report.
fn bench(paths: &str, shards: &str) -> (String, serde_json::Value) {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("out.json");
    let output = Command::new(common::walship_bin())
        .args(["bench", "--paths", paths, "--sizes", "100", "--appenders", "2", "--shards", shards])
        .args(["--duration", "0.5", "--warmup", "0.2"])
        // Its half-second cells stay inside each node's first WAL file.
        .args(["--wal-spare-bytes", "0"])
        .arg("--dir")
        .arg(dir.path().join("data"))
        .arg("--json")
        .arg(&json)
        .env("WALSHIP_LOG", "warn")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(output.status.success(), "bench failed: {}", String::from_utf8_lossy(&output.stderr));
    (stdout, serde_json::from_slice(&std::fs::read(json).unwrap()).unwrap())
}

#[test]
fn bench_prints_figures_and_ratios() {
    let (stdout, report) = bench("wal,local,quorum,quorum-tls,all", "1");
    assert!(stdout.contains("raw disk: 4 KiB write+fdatasync"), "{stdout}");
    for path in ["wal", "local", "rf3-quorum", "rf3-quorum-tls", "rf3-all"] {
        assert!(stdout.contains(&format!("| {path} | 100 | 1 | 2 |")), "no {path} row in:\n{stdout}");
    }
    assert!(report["baseline"]["seq_write_mib_s"].as_f64().unwrap() > 0.0);
    let cells = report["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 5);
    for cell in cells {
        assert!(cell["records_per_s"].as_f64().unwrap() > 0.0, "{cell}");
        assert!(cell["p99_ratio"].as_f64().unwrap() > 0.0, "{cell}");
        let replicated = cell["path"].as_str().unwrap().starts_with("rf3");
        assert_eq!(cell["vs_local"].as_f64().is_some(), replicated, "{cell}");
        // TLS's cost: the TLS cell against the same cell in plaintext.
        assert_eq!(cell["vs_plaintext"].as_f64().is_some(), cell["path"] == "rf3-quorum-tls", "{cell}");
        // CPU per record, servers and load generator, for the gRPC paths
        // (the wal path has no server process).
        let over_grpc = cell["path"] != "wal";
        for side in ["server_cpu_us_per_record", "client_cpu_us_per_record"] {
            assert_eq!(cell[side].as_f64().is_some_and(|us| us > 0.0), over_grpc, "{side} of {cell}");
        }
    }
}

/// Cells over several shards report their records/s ÷ the same cell on one
/// shard (`vs_one_shard`, the table's "÷ 1 shard"); one-shard cells do not.
#[test]
fn bench_prints_many_shards_against_one() {
    let (stdout, report) = bench("quorum", "1,4");
    assert!(stdout.contains("| ÷ 1 shard |"), "{stdout}");
    let cells = report["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 2, "{report}");
    for cell in cells {
        let ratio = cell["vs_one_shard"].as_f64();
        match cell["shards"].as_u64().unwrap() {
            1 => assert!(ratio.is_none(), "{cell}"),
            _ => {
                let records = cell["records_per_s"].as_f64().unwrap();
                let one = cells[0]["records_per_s"].as_f64().unwrap();
                assert!(ratio.is_some_and(|r| (r - records / one).abs() < 1e-9), "{cell}");
            }
        }
    }
}

/// `walship bench-dataplane` on a 4 MiB shard with 1 s windows: every
/// figure is printed and lands in the JSON, and the ratios are positive
/// finite numbers. The page cache is left alone (`--keep-cache`): a test
/// must not slow down everything else on the machine.
#[test]
fn bench_dataplane_prints_every_figure() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("out.json");
    let output = Command::new(common::walship_bin())
        .args(["bench-dataplane", "--mib", "4", "--appenders", "4", "--seconds", "1", "--keep-cache"])
        .args(["--wal-spare-bytes", "0"])
        .arg("--dir")
        .arg(dir.path().join("data"))
        .arg("--json")
        .arg(&json)
        .env("WALSHIP_LOG", "warn")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "bench-dataplane failed: {}", String::from_utf8_lossy(&output.stderr));
    for line in [
        "raw sequential read:",
        "verify: 4 MiB of payload on 3 replicas",
        "export: 4 MiB of payload to a",
        "QUORUM appends undisturbed:",
        "QUORUM appends during verify+export:",
    ] {
        assert!(stdout.contains(line), "no {line:?} in:\n{stdout}");
    }
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(json).unwrap()).unwrap();
    let positive = |v: &serde_json::Value| v.as_f64().is_some_and(|f| f.is_finite() && f > 0.0);
    for figure in [
        &report["raw_read"]["mib_per_s"],
        &report["verify"]["payload_mib_per_s"],
        &report["verify"]["ratio_to_raw"],
        &report["export"]["payload_mib_per_s"],
        &report["export"]["ratio_to_raw"],
        &report["quorum_appends"]["undisturbed"]["records_per_s"],
        &report["quorum_appends"]["during_verify_export"]["records_per_s"],
        &report["quorum_appends"]["ratio"],
    ] {
        assert!(positive(figure), "not a positive finite figure: {figure} in {report}");
    }
    assert_eq!(report["shard"]["records"], 1024, "{report}");
    assert!(report["export"]["arrow_file_bytes"].as_u64().unwrap() > 4 << 20, "{report}");
    assert_eq!(report["page_cache_dropped"], false, "{report}");
    // The nodes ran with the default task read budget.
    assert_eq!(report["settings"]["task_read_mib_per_s"], 64, "{report}");
    // The cluster's data is removed at the end.
    assert!(!dir.path().join("data").join("cluster").exists());
}

/// `ops/bench/callgrind.sh` as `ops/bench/README.md` prints it, with the
/// walship under test and a few appends: it counts both windows and prints
/// the per-append figures and the table by crate. It checks figures are
/// produced, not their values.
#[test]
fn the_instruction_count_in_the_bench_readme_runs_as_printed() {
    let root = env!("CARGO_MANIFEST_DIR");
    let readme = std::fs::read_to_string(format!("{root}/ops/bench/README.md")).unwrap();
    let section = readme.split("## Instructions per append").nth(1).expect("an Instructions per append section");
    let block = section.split("```sh\n").nth(1).and_then(|b| b.split("```").next()).expect("a sh block");
    let command = block.lines().find(|l| l.starts_with("ops/bench/callgrind.sh")).expect("the script's line");
    let out_dir = tempfile::tempdir().unwrap();
    // Later flags win: the built walship, 20 appends, a 1 s idle window.
    let command = format!(
        "{command} --walship {} --count 20 --idle-s 1 --out {}",
        common::walship_bin().display(),
        out_dir.path().display()
    );
    let output = Command::new("bash").arg("-c").arg(&command).current_dir(root).output().unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{command}: {stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    for window in ["unary", "stream"] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("{window}: 20 appends")))
            .unwrap_or_else(|| panic!("no {window} line in:\n{stdout}"));
        let per_append: f64 = line
            .split(", ")
            .last()
            .and_then(|s| s.split(' ').next())
            .map(|n| n.replace(',', ""))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no per-append figure in {line:?}"));
        assert!(per_append > 0.0, "{line}");
        assert!(out_dir.path().join(format!("{window}.callgrind")).exists(), "the {window} dump is kept");
    }
    assert!(stdout.contains("| h2 |") && stdout.contains("| **all (after idle)** |"), "{stdout}");
}
