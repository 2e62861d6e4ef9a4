//! The dashboard in a real browser (headless Chromium, driven by
//! playwright-core from tests/browser/): against a live cluster it shows the
//! real leader in the shard table, runs a failover drill from its button
//! (answering the token prompt), and the drill reports a new leader with
//! nothing lost. A screenshot is saved under the test's output directory.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{Cluster, TOKEN};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_shows_the_leader_and_runs_a_drill() {
    let browser = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser");
    assert!(
        browser.join("node_modules/playwright-core").is_dir(),
        "playwright-core is not installed in tests/browser: run ops/test.sh (npm ci there)"
    );
    let mut cluster = Cluster::start_with(3, 2, 1, "heartbeat_ms = 50\nleader_timeout_ms = 1000", None);
    cluster.wait_node_leads(1, 1, Duration::from_secs(30)).await;
    let url = format!("http://{}/", cluster.coordinator(1).admin);
    let shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard.png");
    let _ = std::fs::remove_file(&shot);
    let output = tokio::task::spawn_blocking({
        let (url, shot, browser) = (url.clone(), shot.clone(), browser.clone());
        move || {
            std::process::Command::new("node")
                .current_dir(&browser)
                .args(["dashboard.mjs", &url, TOKEN, "1", "1"])
                .arg(&shot)
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "browser run failed:\n{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    let result: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(result["errors"], serde_json::json!([]), "page errors");
    assert!(result["summary"].as_str().unwrap().contains("coordinator c1 (active"), "{result}");
    let report = &result["report"];
    assert_eq!(report["state"], "done", "{report}");
    assert_eq!(report["failover"]["old_leader"], 1);
    assert_eq!(report["failover"]["lost"], 0);
    assert_eq!(report["failover"]["divergent_replicas"], 0);
    // The drill really moved leadership.
    let (leader, epoch) = cluster.leader_of(1, 1).await.unwrap();
    assert_ne!(leader, 1);
    assert!(epoch >= 2);
    let png = std::fs::read(&shot).unwrap();
    assert!(png.len() > 10_000 && png.starts_with(b"\x89PNG"), "screenshot at {}", shot.display());
    eprintln!("screenshot: {}", shot.display());
}
