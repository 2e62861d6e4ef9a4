//! The dashboard in a real browser (headless Chromium, driven by
//! playwright-core from tests/browser/): against a live cluster it shows the
//! real leader in the shard table, runs a failover drill from its button
//! (answering the token prompt), and the drill reports a new leader with
//! nothing lost. A second test opens it on a cluster with history: the lag
//! chart is drawn from the coordinator's history on open, with a time axis
//! and a legend of node names, beside the per-node panel and the results of
//! a catch-up drill run from its button; a third, that the node panel flags
//! a node below its disk reserve; a fourth, that the shard table shows an
//! archived shard's archive position and lag on its leader's row.
//! Screenshots are saved under the test's output directory.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{Cluster, ClusterSpec, TOKEN};

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
    // The rebalance preview. Whether it plans a move depends on where the
    // drill put shard 1 (beside shard 2's leader, or on the third node), so
    // the test checks what holds either way: two led shards, every planned
    // move leaves a node over the fair share, and a preview moves nothing.
    let rebalance = &result["rebalance"];
    assert_eq!(rebalance["preview"], true, "{rebalance}");
    assert_eq!(rebalance["moved"], 0, "{rebalance}");
    eprintln!("rebalance preview: {rebalance}");
    let leads_before = rebalance["leads_before"].as_object().unwrap();
    assert_eq!(leads_before.values().map(|n| n.as_u64().unwrap()).sum::<u64>(), 2, "{rebalance}");
    let share = rebalance["fair_share"].as_u64().unwrap();
    for planned in rebalance["moves"].as_array().unwrap() {
        let from = planned["from"].to_string();
        assert!(leads_before[&from].as_u64().unwrap() > share, "{rebalance}");
    }
    let (_, view) = cluster.coord_get(1, "/v1/cluster").await;
    for node in view["nodes"].as_array().unwrap() {
        if let Some(before) = leads_before.get(&node["node_id"].to_string()) {
            assert_eq!(&node["leads"], before, "a preview changed leaderships: {view}");
        }
    }
    // The drill really moved leadership.
    let (leader, epoch) = cluster.leader_of(1, 1).await.unwrap();
    assert_ne!(leader, 1);
    assert!(epoch >= 2);
    let png = std::fs::read(&shot).unwrap();
    assert!(png.len() > 10_000 && png.starts_with(b"\x89PNG"), "screenshot at {}", shot.display());
    eprintln!("screenshot: {}", shot.display());
}

/// Runs `script` (in tests/browser) with `args` and returns its last stdout
/// line as JSON.
async fn browser_run(script: &str, args: Vec<String>) -> serde_json::Value {
    let browser = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser");
    assert!(
        browser.join("node_modules/playwright-core").is_dir(),
        "playwright-core is not installed in tests/browser: run ops/test.sh (npm ci there)"
    );
    let script = script.to_string();
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new("node").current_dir(&browser).arg(script).args(args).output().unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "browser run failed:\n{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
}

async fn append_one(grpc: &str) {
    let mut log = common::history::client(grpc).await.expect("leader reachable");
    let request = walship_proto::log::AppendRequest {
        shard_id: 1,
        records: vec![walship_proto::log::AppendRecord {
            key: Default::default(),
            payload: bytes::Bytes::from_static(b"x"),
        }],
        durability: walship_proto::log::Durability::Quorum as i32,
        ..Default::default()
    };
    log.append(request).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_draws_the_lag_history_on_open_with_a_time_axis_nodes_and_catchup_drills() {
    let mut cluster = Cluster::start_with(3, 1, 1, "heartbeat_ms = 50\nleader_timeout_ms = 1000", None);
    cluster.wait_node_leads(1, 1, Duration::from_secs(30)).await;
    // A catch-up drill on node 3, from the page's button.
    let url = format!("http://{}/", cluster.coordinator(1).admin);
    let shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard-catchup.png");
    let run = browser_run(
        "lag.mjs",
        vec!["catchup".into(), url.clone(), TOKEN.into(), "3".into(), shot.display().to_string()],
    )
    .await;
    assert_eq!(run["errors"], serde_json::json!([]), "page errors: {run}");
    let report = &run["report"];
    assert_eq!((report["state"].as_str(), report["catchup"]["follower"].as_u64()), (Some("done"), Some(3)), "{report}");
    let drill = report["id"].as_str().unwrap().to_string();
    let behind = report["catchup"]["records_behind"].as_u64().unwrap();
    assert!(behind > 0, "{report}");
    // The coordinator holds the same report.
    let (_, held) = cluster.coord_get(1, &format!("/v1/drills/{drill}")).await;
    assert_eq!((held["state"].as_str(), held["catchup"]["records_behind"].as_u64()), (Some("done"), Some(behind)));
    // Node 2 dies; one more record, so its lag is 1 and stale.
    cluster.node(2).kill9();
    append_one(&cluster.node(1).grpc.clone()).await;
    common::wait_until("10 samples of node 3 and node 2's newest stale", Duration::from_secs(60), || {
        let (_, h) = futures::executor::block_on(cluster.coord_get(1, "/v1/shards/1/lag-history"));
        let series = |n: u64| h["series"].as_array().and_then(|s| s.iter().find(|s| s["node_id"] == n)).cloned();
        // A margin over the 10 points asserted below: a sample taken while
        // a lag in seconds is still unknown draws no point.
        let ok = series(3).is_some_and(|s| s["samples"].as_array().unwrap().len() >= 13)
            && series(2).is_some_and(|s| s["samples"].as_array().unwrap().last().unwrap()["stale"] == true);
        async move { ok }
    })
    .await;
    let (grpc2, grpc3) = (cluster.node(2).grpc.clone(), cluster.node(3).grpc.clone());
    let shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard-lag.png");
    let _ = std::fs::remove_file(&shot);
    let page = browser_run("lag.mjs", vec!["inspect".into(), url, shot.display().to_string()]).await;
    assert_eq!(page["errors"], serde_json::json!([]), "page errors: {page}");
    // On its first render the chart already holds the coordinator's history.
    let points3 = page["first"]["points"]["3"].as_u64().unwrap_or(0);
    assert!(points3 >= 10, "node 3's line on open has {points3} points: {page}");
    assert!(page["first"]["stale"]["2"].as_u64().unwrap_or(0) >= 1, "node 2's stale stretch: {page}");
    // A time axis: wall-clock labels and "now", and a value axis.
    let x_ticks: Vec<String> =
        page["x_ticks"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect();
    assert!(x_ticks.iter().any(|t| t.starts_with("now ")), "{x_ticks:?}");
    assert!(x_ticks.iter().filter(|t| t.contains(':') && !t.starts_with("now")).count() >= 4, "{x_ticks:?}");
    assert_eq!(page["y_ticks"].as_array().unwrap().len(), 5, "{page}");
    // The legend names the followers, each with its own colour.
    let legend: Vec<&str> = page["legend"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    assert!(legend.iter().any(|l| l.starts_with(&format!("node 3 ({grpc3})"))), "{legend:?}");
    assert!(legend.iter().any(|l| l.starts_with(&format!("node 2 ({grpc2})")) && l.ends_with("(stale)")), "{legend:?}");
    let colours = page["legend_colours"].as_array().unwrap();
    assert!(colours.len() == 2 && colours[0] != colours[1], "{colours:?}");
    // The node panel: addresses, shards led, uptime, WAL bytes, heartbeat
    // age, state.
    let node1: Vec<&str> = page["nodes"]["1"].as_array().unwrap().iter().map(|c| c.as_str().unwrap()).collect();
    assert_eq!(node1[1], cluster.node(1).grpc, "{node1:?}");
    assert_eq!(node1[4], "1", "node 1 leads the shard: {node1:?}");
    assert!(node1[5] != "-" && node1[6].ends_with('B') && node1[8] != "-" && node1[9] == "ok", "{node1:?}");
    let node2: Vec<&str> = page["nodes"]["2"].as_array().unwrap().iter().map(|c| c.as_str().unwrap()).collect();
    assert!(node2[3] == "NO" && node2[4] == "0" && node2[9].contains("down"), "{node2:?}");
    // The shard table marks node 2's lag as stale, from its last position.
    let row2: Vec<&str> = page["shard_rows"]["2"].as_array().unwrap().iter().map(|c| c.as_str().unwrap()).collect();
    assert!(row2.last().unwrap().starts_with("stale: from "), "{row2:?}");
    // The catch-up drill's results.
    let catchup: Vec<&str> = page["catchups"][&drill].as_array().unwrap().iter().map(|c| c.as_str().unwrap()).collect();
    assert_eq!((catchup[2], catchup[3], catchup[4]), ("done", "3", behind.to_string().as_str()), "{catchup:?}");
    let png = std::fs::read(&shot).unwrap();
    assert!(png.len() > 10_000 && png.starts_with(b"\x89PNG"), "screenshot at {}", shot.display());
    eprintln!("screenshot: {}", shot.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reseed_drill_runs_from_the_dashboard_and_its_table_shows_the_bytes_by_source() {
    let mut cluster = Cluster::launch(&ClusterSpec {
        coordinators: 1,
        replication: "heartbeat_ms = 50\nleader_timeout_ms = 1000",
        cluster_toml: "[archive]\nstore = \"dir\"\ndir = \"archive\"\nsegment_bytes = 262144\nsegment_age_ms = 100\n"
            .into(),
        ..ClusterSpec::default()
    });
    cluster.wait_node_leads(1, 1, Duration::from_secs(30)).await;
    common::wait_until("the coordinator to see the leader archive", Duration::from_secs(30), || {
        let (_, shard) = futures::executor::block_on(cluster.coord_get(1, "/v1/shards/1"));
        async move { shard["leader"] == 1 && shard["archived_seqno"].is_u64() }
    })
    .await;
    let url = format!("http://{}/", cluster.coordinator(1).admin);
    let shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard-reseed.png");
    let run =
        browser_run("lag.mjs", vec!["reseed".into(), url, TOKEN.into(), "3".into(), shot.display().to_string()]).await;
    assert_eq!(run["errors"], serde_json::json!([]), "page errors: {run}");
    let report = &run["report"];
    assert_eq!((report["state"].as_str(), report["reseed"]["follower"].as_u64()), (Some("done"), Some(3)), "{report}");
    assert_eq!(report["reseed"]["lost"], 0, "{report}");
    let drill = report["id"].as_str().unwrap();
    // id, shard, state, follower, records, peers, archive, streamed, s, MiB/s, before, during, lost
    let row: Vec<&str> = run["rows"][drill].as_array().unwrap().iter().map(|c| c.as_str().unwrap()).collect();
    assert_eq!((row[2], row[3], row[12]), ("done", "3", "0"), "{row:?}");
    assert_eq!(row[4], report["reseed"]["records"].to_string(), "{row:?}");
    assert!(row[5].ends_with('B') && row[6].ends_with('B'), "bytes by source: {row:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_panel_flags_a_node_below_its_disk_reserve() {
    // Node 3 wants 1 PiB free: its disk is "full" from the start.
    let mut cluster = Cluster::launch(&ClusterSpec {
        coordinators: 1,
        replication: "heartbeat_ms = 50\nleader_timeout_ms = 1000",
        node_args: vec![(3, vec!["--wal-min-free-bytes".to_string(), (1u64 << 50).to_string()])],
        ..ClusterSpec::default()
    });
    cluster.wait_node_leads(1, 1, Duration::from_secs(30)).await;
    common::wait_until("the coordinator to see node 3's full disk", Duration::from_secs(30), || {
        let (_, c) = futures::executor::block_on(cluster.coord_get(1, "/v1/cluster"));
        let full = c["nodes"].as_array().is_some_and(|n| {
            n.iter().any(|n| n["node_id"] == 3 && n["disk_full"] == true)
                && n.iter().any(|n| n["node_id"] == 1 && n["disk_full"] == false)
        });
        async move { full }
    })
    .await;
    // A DataPlane task, finished, for the tasks panel; every node a worker.
    let (code, started) =
        cluster.coord_post(1, "/v1/tasks", r#"{"kind": "noop", "sleep_ms": 50}"#, Some(common::TOKEN)).await;
    assert_eq!(code, 202, "{started}");
    let task = started["task_ids"][0].as_str().unwrap().to_string();
    common::wait_until("the task done and three workers connected", Duration::from_secs(30), || {
        let (_, t) = futures::executor::block_on(cluster.coord_get(1, &format!("/v1/tasks/{task}")));
        let (_, c) = futures::executor::block_on(cluster.coord_get(1, "/v1/cluster"));
        let ok = t["state"] == "succeeded" && c["workers"].as_array().is_some_and(|w| w.len() == 3);
        async move { ok }
    })
    .await;
    let url = format!("http://{}/", cluster.coordinator(1).admin);
    let shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard-disk-full.png");
    let page = browser_run("lag.mjs", vec!["inspect".into(), url, shot.display().to_string()]).await;
    assert_eq!(page["errors"], serde_json::json!([]), "page errors: {page}");
    let state = |n: &str| page["nodes"][n].as_array().unwrap().last().unwrap().as_str().unwrap().to_string();
    assert_eq!(state("3"), "DISK FULL", "{page}");
    assert_eq!(state("1"), "ok", "{page}");
    // The DataPlane panels: the workers with their capacity, and the task.
    let workers = page["workers"].as_object().unwrap();
    assert_eq!(workers.len(), 3, "{page}");
    assert!(workers.contains_key("node-1") && workers.contains_key("node-3"), "{page}");
    let row = page["tasks"][task.as_str()].as_array().unwrap_or_else(|| panic!("no row for {task}: {page}"));
    assert_eq!(row[1], "noop", "{page}");
    assert_eq!(row[2], "succeeded", "{page}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shard_table_shows_the_archive_position() {
    let mut cluster = Cluster::launch(&ClusterSpec {
        coordinators: 1,
        replication: "heartbeat_ms = 50\nleader_timeout_ms = 1000",
        cluster_toml: "[archive]\nstore = \"dir\"\ndir = \"archive\"\nsegment_bytes = 8192\nsegment_age_ms = 100\n"
            .into(),
        ..ClusterSpec::default()
    });
    cluster.wait_node_leads(1, 1, Duration::from_secs(30)).await;
    for _ in 0..20 {
        append_one(&cluster.node(1).grpc.clone()).await;
    }
    common::wait_until("the coordinator to show all 20 records archived", Duration::from_secs(30), || {
        let (_, s) = futures::executor::block_on(cluster.coord_get(1, "/v1/shards/1"));
        let ok = s["leader"] == 1 && s["archived_seqno"] == 20 && s["archive_lag_records"] == 0;
        async move { ok }
    })
    .await;
    let url = format!("http://{}/", cluster.coordinator(1).admin);
    let shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard-archive.png");
    let page = browser_run("lag.mjs", vec!["inspect".into(), url, shot.display().to_string()]).await;
    assert_eq!(page["errors"], serde_json::json!([]), "page errors: {page}");
    // Columns: shard, leader, epoch, replica, role, alive, wal, last,
    // durable, commit, archived, ...
    let cells = |n: &str| -> Vec<String> {
        page["shard_rows"][n].as_array().unwrap().iter().map(|c| c.as_str().unwrap().to_string()).collect()
    };
    assert_eq!(cells("1")[10], "20 (lag 0, 0 s)", "the leader's row: {page}");
    assert_eq!(cells("2")[10], "-", "a follower's row: {page}");
}

/// A cluster with more shards than one page: the shard table draws one
/// page of 50, pages on, and filters to the shards needing attention; the
/// summary counts those.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_pages_and_filters_the_shard_table() {
    let mut cluster = Cluster::start_with(3, 120, 1, "leader_timeout_ms = 1000", None);
    for shard in [1, 60, 120] {
        cluster.wait_leader(shard, None, Duration::from_secs(60)).await;
    }
    // Every shard healthy first (all replicas alive, nothing lagging).
    let admin = cluster.coordinator(1).admin.clone();
    common::wait_until("no shard needs attention", Duration::from_secs(60), || {
        let admin = admin.clone();
        async move {
            let (code, body) = common::http_get(&format!("{admin}/v1/shards?unhealthy=true")).await;
            code == 200 && body.trim() == "[]"
        }
    })
    .await;
    let url = format!("http://{admin}/");
    let result = browser_run("pages.mjs", vec![url]).await;
    assert_eq!(result["errors"], serde_json::json!([]), "page errors: {result}");
    let first = &result["first"];
    assert_eq!(first["label"], "page 1 of 3 (120 shards)", "{result}");
    assert_eq!(first["shards"], serde_json::json!((1..=50).collect::<Vec<u32>>()), "{result}");
    assert!(
        first["summary"].as_str().unwrap().contains("120 shards, 0 without leader, 0 needing attention"),
        "{result}"
    );
    let second = &result["second"];
    assert_eq!(second["shards"], serde_json::json!((51..=100).collect::<Vec<u32>>()), "{result}");
    let attention = &result["attention"];
    assert_eq!(attention["label"], "page 1 of 1 (0 shards needing attention)", "{result}");
    assert_eq!(attention["shards"], serde_json::json!([]), "{result}");
}
