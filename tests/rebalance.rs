//! Leadership rebalancing against real processes: a node killed and
//! restarted gets its share of leaderships back, by request
//! (`POST /v1/rebalance`, `walship rebalance`) or by the coordinator on its
//! own, without losing an acknowledged record under load; bad requests
//! change nothing.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use common::history::{FAST, WAIT, check_history, converge, entry, load, wait_for_more_appends};
use common::{Acked, Cluster, TOKEN, wait_until};

const SHARDS: u32 = 6;

/// Shards each node leads, as the coordinator records them (none led
/// before it wrote its first state).
async fn leads(cluster: &mut Cluster) -> BTreeMap<u64, usize> {
    let (code, list) = cluster.coord_get(1, &format!("/v1/shards?limit={SHARDS}")).await;
    let mut leads: BTreeMap<u64, usize> = (1..=3).map(|n| (n, 0)).collect();
    if code == 503 {
        return leads;
    }
    assert_eq!(code, 200, "{list}");
    for leader in list.as_array().expect("a list of shards").iter().filter_map(|s| s["leader"].as_u64()) {
        *leads.entry(leader).or_default() += 1;
    }
    leads
}

/// Waits until the coordinator's `walship_coordinator_shards_led` gauges
/// (set every lease round) say `leads`.
async fn wait_for_led_gauges(admin: &str, leads: &BTreeMap<u64, usize>) {
    let url = format!("{admin}/metrics");
    let expected: Vec<String> =
        leads.iter().map(|(node, n)| format!("walship_coordinator_shards_led{{node=\"{node}\"}} {n}")).collect();
    wait_until(&format!("the shards-led gauges to say {leads:?}"), WAIT, || {
        let (url, expected) = (url.clone(), expected.clone());
        async move {
            let metrics = common::http_get(&url).await.1;
            expected.iter().all(|line| metrics.lines().any(|l| l == line))
        }
    })
    .await;
}

/// Kills node 1 (leading shards 1 and 4 as placed), waits until the
/// survivors lead everything, restarts it and waits until it follows
/// every shard, caught up.
async fn survivors_lead_everything(cluster: &mut Cluster) {
    wait_until("every shard led as placed", WAIT, || {
        let l = futures::executor::block_on(leads(cluster));
        async move { l.values().all(|&n| n == 2) }
    })
    .await;
    cluster.node(1).kill9();
    wait_until("the survivors to lead every shard", WAIT, || {
        let l = futures::executor::block_on(leads(cluster));
        async move { l[&1] == 0 && l[&2] + l[&3] == SHARDS as usize }
    })
    .await;
    cluster.restart(1);
    wait_until("node 1 to follow every shard, caught up", WAIT, || {
        let s = futures::executor::block_on(cluster.status(1));
        let ok = s.is_some_and(|s| {
            (1..=SHARDS).all(|shard| {
                let e = entry(&s, shard);
                e["role"] == "follower" && e["durable_seqno"].as_u64() >= e["commit_seqno"].as_u64()
            })
        });
        async move { ok }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebalance_under_load_gives_a_returned_node_its_share_and_loses_no_acknowledged_record() {
    // Automatic rebalancing off: this test asks for it.
    let mut cluster = Cluster::start_with(3, SHARDS, 1, &format!("{FAST}\nrebalance_interval_ms = 0"), None);
    let nodes: Vec<String> = cluster.nodes.iter().map(|n| n.grpc.clone()).collect();
    let admin = cluster.coordinator(1).admin.clone();
    let acked: Acked = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = (1..=SHARDS)
        .map(|shard| load(nodes.clone(), admin.clone(), shard, acked.clone(), stop.clone(), count.clone()))
        .collect();
    survivors_lead_everything(&mut cluster).await;
    let before = leads(&mut cluster).await;
    wait_for_led_gauges(&admin, &before).await;

    // A preview plans the moves and changes nothing.
    let (code, preview) = cluster.coord_post(1, "/v1/rebalance", r#"{"preview": true}"#, Some(TOKEN)).await;
    assert_eq!(code, 200, "{preview}");
    assert_eq!(preview["preview"], true);
    assert_eq!(preview["fair_share"], 2);
    let planned = preview["moves"].as_array().expect("moves").clone();
    assert_eq!(planned.len(), 2, "{preview}");
    assert!(planned.iter().all(|m| m["to"] == 1 && m["leader"].is_null()), "{preview}");
    assert_eq!(preview["leads_after"], serde_json::json!({"1": 2, "2": 2, "3": 2}), "{preview}");
    assert_eq!(leads(&mut cluster).await, before, "a preview moved a leadership");

    // Rebalance, under load, until balanced: a move whose replica missed
    // the last acknowledged record at the fence is left to the next one.
    let mut rounds = 0;
    loop {
        rounds += 1;
        let (code, outcome) = cluster.coord_post(1, "/v1/rebalance", "{}", Some(TOKEN)).await;
        assert_eq!(code, 200, "{outcome}");
        eprintln!("rebalance {rounds}: {outcome}");
        for m in outcome["moves"].as_array().expect("moves") {
            assert!(m["error"].is_null(), "{outcome}");
            assert!(m["leader"].is_u64(), "every planned shard got a leader: {outcome}");
        }
        if leads(&mut cluster).await.values().all(|&n| n == 2) {
            break;
        }
        assert!(rounds < 10, "still unbalanced after {rounds} rebalances: {:?}", leads(&mut cluster).await);
        wait_for_more_appends(&count, 20, "appends to flow again").await;
    }
    wait_for_led_gauges(&admin, &leads(&mut cluster).await).await;
    // Balanced: another rebalance has nothing to move.
    let (code, again) = cluster.coord_post(1, "/v1/rebalance", "{}", Some(TOKEN)).await;
    assert_eq!(code, 200, "{again}");
    assert_eq!(again["moves"], serde_json::json!([]), "{again}");

    // Appends go on at the new leaders.
    wait_for_more_appends(&count, 60, "appends after the rebalance").await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    let mut total = 0;
    for shard in 1..=SHARDS {
        let last = converge(&mut cluster, shard).await;
        total += check_history(&mut cluster, shard, last, &acked).await;
    }
    eprintln!("{total} acknowledged records all present after {rounds} rebalances");
    assert!(total > 0);
    let metrics = common::http_get(&format!("{admin}/metrics")).await.1;
    let moved: f64 = metrics
        .lines()
        .find(|l| l.starts_with("walship_failovers_total{outcome=\"ok\",reason=\"rebalance\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0);
    assert!(moved >= 2.0, "rebalance failovers counted: {moved}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinator_rebalances_on_its_own_once_a_returned_node_caught_up() {
    let mut cluster = Cluster::start_with(3, SHARDS, 1, &format!("{FAST}\nrebalance_interval_ms = 500"), None);
    survivors_lead_everything(&mut cluster).await;
    wait_until("every node to lead two shards again", WAIT, || {
        let l = futures::executor::block_on(leads(&mut cluster));
        async move { l.values().all(|&n| n == 2) }
    })
    .await;
    // Each shard works at its new leader.
    for shard in 1..=SHARDS {
        let (leader, _) = cluster.leader_of(1, shard).await.expect("a leader");
        common::history::wait_leading(&mut cluster, shard, leader).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_rebalance_requests_are_refused_and_change_nothing() {
    let mut cluster = Cluster::start_with(3, SHARDS, 1, &format!("{FAST}\nrebalance_interval_ms = 0"), None);
    survivors_lead_everything(&mut cluster).await;
    let before = leads(&mut cluster).await;
    let refusals: [(&str, Option<&str>, u16, &str); 7] = [
        ("{}", None, 401, "unauthorized"),
        ("{}", Some("wrong-token-123"), 403, "forbidden"),
        (r#"{"max_moves": 0}"#, Some(TOKEN), 400, "max_moves"),
        (r#"{"max_moves": -1}"#, Some(TOKEN), 400, "non-negative"),
        (r#"{"max_move": 1}"#, Some(TOKEN), 400, "max_move"),
        (r#"{"preview": "yes"}"#, Some(TOKEN), 400, "preview"),
        ("[1]", Some(TOKEN), 400, ""),
    ];
    for (body, token, code, says) in refusals {
        let (got, answer) = cluster.coord_post(1, "/v1/rebalance", body, token).await;
        assert_eq!(got, code, "{body}: {answer}");
        assert!(answer["error"].to_string().contains(says), "{body}: {answer}");
    }
    assert_eq!(leads(&mut cluster).await, before, "a refused rebalance moved a leadership");

    // The CLI: a preview, then one move at a time.
    let coord = cluster.coordinator(1).admin.clone();
    let cli = |args: &[&str]| {
        let mut all = vec!["rebalance", "--admin", coord.as_str(), "--token", TOKEN];
        all.extend_from_slice(args);
        common::cli::walship(&all)
    };
    // As ops/runbooks/failover.md prints it: admin URL and token from the
    // environment.
    let mut preview = common::cli::walship(&["rebalance", "--preview"]);
    preview.env("WALSHIP_ADMIN", &coord).env("WALSHIP_TOKEN", TOKEN);
    let out = common::cli::run(preview, None).await;
    assert!(out.status.success(), "{}", common::cli::describe(&out));
    let printed = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(printed.contains("leading before: node 1: 0, node 2: 3, node 3: 3 (fair share 2)"), "{printed}");
    assert!(printed.contains("would move 2 shards (nothing changed)"), "{printed}");
    assert!(
        printed.contains("node 2 -> node 1: 1 shards") && printed.contains("node 3 -> node 1: 1 shards"),
        "{printed}"
    );
    assert!(printed.contains("leading after: node 1: 2, node 2: 2, node 3: 2"), "{printed}");
    assert_eq!(leads(&mut cluster).await, before);
    let out = common::cli::run(cli(&["--max-moves", "0"]), None).await;
    assert!(!out.status.success(), "{}", common::cli::describe(&out));
    let out = common::cli::run(cli(&["--max-moves", "1", "--json"]), None).await;
    assert!(out.status.success(), "{}", common::cli::describe(&out));
    let outcome: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(outcome["moves"].as_array().map(Vec::len), Some(1), "{outcome}");
    assert_eq!(outcome["moves"][0]["to"], 1, "{outcome}");
    let after = leads(&mut cluster).await;
    assert_eq!(after[&1], usize::from(outcome["moved"] == 1), "{outcome}: {after:?}");
    // The cluster view and `walship status` count each node's leaderships.
    let (_, view) = cluster.coord_get(1, "/v1/cluster").await;
    for node in view["nodes"].as_array().expect("nodes") {
        let id = node["node_id"].as_u64().expect("an id");
        assert_eq!(node["leads"].as_u64(), Some(after[&id] as u64), "{view}");
    }
    let out = common::cli::run(common::cli::walship(&["status", "--admin", coord.as_str()]), None).await;
    assert!(out.status.success(), "{}", common::cli::describe(&out));
    let expected =
        format!("leaderships: node 1 {}, node 2 {}, node 3 {} (of {SHARDS})", after[&1], after[&2], after[&3]);
    assert!(String::from_utf8_lossy(&out.stdout).contains(&expected), "{expected}: {}", common::cli::describe(&out));
}

/// The planned replica lacks acknowledged records (its replica of every
/// shard paused while the others took QUORUM appends): each move's failover
/// passes it over for the most up-to-date replica, the old leader keeps
/// the shard, and no acknowledged record is lost. Were the preference taken
/// without that check, node 1 would lead with a shorter log and the others
/// would truncate to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planned_replica_missing_acknowledged_records_is_passed_over() {
    let mut cluster = Cluster::start_with(3, SHARDS, 1, &format!("{FAST}\nrebalance_interval_ms = 0"), None);
    survivors_lead_everything(&mut cluster).await;
    let node1 = cluster.node(1).grpc.clone();
    for shard in 1..=SHARDS {
        common::pause_shard(&node1, shard, true).await;
    }
    let acked: Acked = Arc::default();
    for shard in 1..=SHARDS {
        let (leader, _) = cluster.leader_of(1, shard).await.expect("a leader");
        let mut log = common::history::client(&cluster.node(leader).grpc.clone()).await.expect("the leader answers");
        for n in 0..5 {
            let payload = bytes::Bytes::from(format!("shard{shard}-{n}"));
            common::append_and_record(
                &mut log,
                shard,
                vec![payload],
                walship_proto::log::Durability::Quorum,
                std::time::Duration::from_secs(5),
                &acked,
            )
            .await
            .expect("a QUORUM append with node 1 paused");
        }
    }
    let before = leads(&mut cluster).await;
    let (code, outcome) = cluster.coord_post(1, "/v1/rebalance", "{}", Some(TOKEN)).await;
    assert_eq!(code, 200, "{outcome}");
    let moves = outcome["moves"].as_array().expect("moves");
    assert_eq!(moves.len(), 2, "node 1 looks caught up by its own reports, so moves are planned: {outcome}");
    for m in moves {
        assert_eq!(m["to"], 1, "{outcome}");
        assert!(m["error"].is_null(), "{outcome}");
        assert_eq!(m["leader"], m["from"], "the old leader, holding everything, keeps the shard: {outcome}");
    }
    assert_eq!(outcome["moved"], 0, "{outcome}");
    assert_eq!(leads(&mut cluster).await, before, "{outcome}");
    for shard in 1..=SHARDS {
        common::pause_shard(&node1, shard, false).await;
    }
    let mut total = 0;
    for shard in 1..=SHARDS {
        let last = converge(&mut cluster, shard).await;
        total += check_history(&mut cluster, shard, last, &acked).await;
    }
    assert_eq!(total, 5 * SHARDS as usize);
}
