//! Smoke run of `walship bench` (a fraction of a second per cell) so the
//! harness cannot rot. It checks the harness produces figures, never their
//! values: speed lives in the benchmark's printed ratios, not in tests.

mod common;

use std::process::Command;

#[test]
fn bench_prints_figures_and_ratios() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("out.json");
    let output = Command::new(common::walship_bin())
        .args([
            "bench",
            "--paths",
            "wal,local,quorum,quorum-tls,all",
            "--sizes",
            "100",
            "--appenders",
            "2",
            "--shards",
            "1",
            "--duration",
            "0.5",
            "--warmup",
            "0.2",
        ])
        // Its half-second cells stay inside each node's first WAL file.
        .args(["--wal-spare-bytes", "0"])
        .arg("--dir")
        .arg(dir.path().join("data"))
        .arg("--json")
        .arg(&json)
        .env("WALSHIP_LOG", "warn")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "bench failed: {}", String::from_utf8_lossy(&output.stderr));
    assert!(stdout.contains("raw disk: 4 KiB write+fdatasync"), "{stdout}");
    for path in ["wal", "local", "rf3-quorum", "rf3-quorum-tls", "rf3-all"] {
        assert!(stdout.contains(&format!("| {path} | 100 | 1 | 2 |")), "no {path} row in:\n{stdout}");
    }
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(json).unwrap()).unwrap();
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
    }
}
