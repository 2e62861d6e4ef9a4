//! `walship status` against a live coordinated cluster: the table names the
//! real leader of each shard, and `--json` carries the coordinator's view.

mod common;

use std::time::Duration;

use common::{Cluster, wait_until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_the_real_leaders() {
    let mut cluster = Cluster::start_with(3, 2, 1, "leader_timeout_ms = 2000", None);
    // Followed: every follower's lag live (its leader has heard from it).
    wait_until("both shards led and followed", Duration::from_secs(30), || {
        let (code, shards) = futures::executor::block_on(cluster.coord_get(1, "/v1/shards"));
        let ok = code == 200
            && shards.as_array().is_some_and(|a| {
                a.iter().all(|s| {
                    s["replicas"].as_array().is_some_and(|r| {
                        r.iter().all(|r| r["role"] == "leader" || (r["role"] == "follower" && r["lag_stale"] == false))
                    })
                })
            });
        async move { ok }
    })
    .await;
    let admin = format!("http://{}", cluster.coordinator(1).admin);
    let run = |json: bool| {
        let mut command = std::process::Command::new(common::walship_bin());
        command.args(["status", "--admin", &admin]);
        if json {
            command.arg("--json");
        }
        command.output().unwrap()
    };
    let table = run(false);
    assert!(table.status.success());
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(text.contains("coordinator c1 (active)"), "{text}");
    let row = |shard: u32, node: u32| {
        text.lines()
            .find(|l| {
                let cells: Vec<&str> = l.split('|').map(str::trim).collect();
                cells.len() > 5 && cells[1] == shard.to_string() && cells[4] == node.to_string()
            })
            .unwrap_or_else(|| panic!("no row for shard {shard} node {node} in\n{text}"))
            .to_string()
    };
    assert!(row(1, 1).contains("leader") && row(1, 2).contains("follower"), "{text}");
    assert!(row(2, 2).contains("leader") && row(2, 1).contains("follower"), "{text}");
    let json = run(true);
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(v["cluster"]["coordinator"]["active"], true);
    assert_eq!(v["shards"][0]["leader"], 1);
    assert_eq!(v["shards"][1]["leader"], 2);
    // Each position's age is in the table, and a caught-up follower's lag
    // is live.
    let header: Vec<&str> = text.lines().find(|l| l.contains("shard")).unwrap().split('|').map(str::trim).collect();
    let column = |name: &str| header.iter().position(|h| *h == name).unwrap_or_else(|| panic!("no {name}: {text}"));
    let cells =
        |shard: u32, node: u32| row(shard, node).split('|').map(str::trim).map(String::from).collect::<Vec<_>>();
    assert!(cells(1, 1)[column("pos age")].ends_with('s'), "{text}");
    assert_eq!(cells(1, 1)[column("lag is")], "-", "a leader has no lag: {text}");
    assert_eq!(cells(1, 2)[column("lag is")], "live", "{text}");
    assert!(!text.contains("STALE"), "every replica is up: {text}");
    // `--json` is the coordinator's own view: it matches GET /v1/shards, but
    // for how long ago each heartbeat was and when positions were read.
    let strip = |mut shards: serde_json::Value| {
        for shard in shards.as_array_mut().unwrap() {
            for replica in shard["replicas"].as_array_mut().unwrap() {
                let replica = replica.as_object_mut().unwrap();
                for varying in ["last_heartbeat_ms_ago", "position_age_ms", "position_unix_us", "lag_position_age_ms"] {
                    assert!(replica.remove(varying).is_some(), "{varying} missing");
                }
            }
        }
        shards
    };
    let (code, api) = cluster.coord_get(1, "/v1/shards").await;
    assert_eq!(code, 200);
    assert_eq!(strip(v["shards"].clone()), strip(api));
    // Filters and paging go to the coordinator.
    let filtered = |args: &[&str]| {
        let out = std::process::Command::new(common::walship_bin())
            .args(["status", "--json", "--admin", &admin])
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["shards"].as_array().unwrap().iter().map(|s| s["shard_id"].as_u64().unwrap()).collect::<Vec<_>>()
    };
    assert_eq!(filtered(&["--limit", "1", "--offset", "1"]), vec![2]);
    assert_eq!(filtered(&["--node", "3"]), vec![1, 2]);
    assert_eq!(filtered(&["--unhealthy"]), Vec::<u64>::new(), "every shard is healthy");
    // A wrong address is a clear error, not a hang.
    let bad = std::process::Command::new(common::walship_bin())
        .args(["status", "--admin", "http://127.0.0.1:1"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("connecting to 127.0.0.1:1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_command_previews_and_moves_leadership_using_the_client_config() {
    let mut cluster = Cluster::start_with(3, 1, 1, "leader_timeout_ms = 2000", None);
    cluster.wait_node_leads(1, 1, Duration::from_secs(30)).await;
    // The target must answer the fence: wait until the coordinator hears
    // every replica (right after start, node 2 may not be up yet).
    wait_until("every replica of shard 1 alive", Duration::from_secs(30), || {
        let (code, s) = futures::executor::block_on(cluster.coord_get(1, "/v1/shards/1"));
        let ok = code == 200
            && s["replicas"].as_array().is_some_and(|r| r.len() == 3 && r.iter().all(|r| r["alive"] == true));
        async move { ok }
    })
    .await;
    // Admin URL and token from the client config file, not flags.
    let config = cluster.dir.path().join("client.toml");
    std::fs::write(
        &config,
        format!("admin = \"http://{}\"\ntoken = \"{}\"\n", cluster.coordinator(1).admin, common::TOKEN),
    )
    .unwrap();
    let walship = |args: &[&str]| {
        std::process::Command::new(common::walship_bin())
            .args(args)
            .env("WALSHIP_CLIENT_CONFIG", &config)
            .env_remove("WALSHIP_ADMIN")
            .env_remove("WALSHIP_TOKEN")
            .output()
            .unwrap()
    };
    let preview = walship(&["failover", "--shard", "1", "--target", "2", "--preview"]);
    let text = String::from_utf8_lossy(&preview.stdout);
    assert!(preview.status.success(), "{text}{}", String::from_utf8_lossy(&preview.stderr));
    assert!(text.contains("nothing changed"), "{text}");
    assert_eq!(cluster.leader_of(1, 1).await.unwrap().0, 1, "a preview changes nothing");
    let done = walship(&["failover", "--shard", "1", "--target", "2"]);
    let text = String::from_utf8_lossy(&done.stdout);
    assert!(done.status.success(), "{text}{}", String::from_utf8_lossy(&done.stderr));
    assert!(text.contains("leader 1 -> 2"), "{text}");
    assert_eq!(cluster.leader_of(1, 1).await.unwrap().0, 2);
    let refused = walship(&["failover", "--shard", "1", "--target", "9"]);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("not_a_replica"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_config_with_dns_names() {
    // "localhost" rather than an IP everywhere: nodes and the coordinator
    // resolve their own addresses to bind, and dial each other by name.
    let mut cluster = Cluster::start_on("localhost", 3, 1, 1, "leader_timeout_ms = 2000", None);
    let mut leader = None;
    wait_until("shard 1 led and followed over names", Duration::from_secs(30), || {
        let (code, shard) = futures::executor::block_on(cluster.coord_get(1, "/v1/shards/1"));
        let ok = code == 200
            && shard["replicas"]
                .as_array()
                .is_some_and(|r| r.iter().all(|r| r["role"] == "leader" || r["role"] == "follower"));
        leader = shard["leader"].as_u64();
        async move { ok }
    })
    .await;
    let leader = leader.unwrap() as u32;
    let mut log = cluster.node(leader).client().await;
    let request = walship_proto::log::AppendRequest {
        shard_id: 1,
        records: vec![walship_proto::log::AppendRecord {
            key: Default::default(),
            payload: bytes::Bytes::from_static(b"named"),
        }],
        durability: walship_proto::log::Durability::All as i32,
        ..Default::default()
    };
    let r = log.append(request).await.unwrap().into_inner();
    assert_eq!(r.first_seqno, 1, "replicated to every replica by name");
}
