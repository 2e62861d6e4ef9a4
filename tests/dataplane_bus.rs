//! The task bus: cancels that reach every coordinator and every worker,
//! and dead letters that outlive the coordinator they failed under: over a
//! real NATS server (JetStream), and in process with the dead letters in
//! the coordinator's data dir.

mod common;

use std::time::{Duration, Instant};

use common::{Cluster, ClusterSpec, TOKEN, wait_until};
use serde_json::{Value, json};
use walship_dataplane::bus::{CancelNotice, NatsBus, TaskBus, conformance};

/// A throwaway `nats-server -js` (shared with the shipping crate's tests).
#[path = "../shipping/tests/support/nats.rs"]
mod nats;

const WAIT: Duration = Duration::from_secs(60);

fn spec(nodes: u32, coordinators: u32, nats: Option<&str>) -> ClusterSpec<'_> {
    ClusterSpec {
        nodes,
        shards: 1,
        coordinators,
        nats,
        // Quick stalls, one attempt: a task that does not advance is a dead
        // letter within seconds.
        coord_args: ["--task-stall-s", "3", "--task-attempts", "1"].map(String::from).to_vec(),
        ..ClusterSpec::default()
    }
}

/// The active coordinator once it has `workers` workers.
async fn active_with(cluster: &mut Cluster, coordinators: &[u32], workers: usize) -> u32 {
    let deadline = Instant::now() + WAIT;
    loop {
        for &c in coordinators {
            let (code, view) = cluster.coord_get(c, "/v1/cluster").await;
            if code == 200
                && view["coordinator"]["active"] == true
                && view["workers"].as_array().is_some_and(|w| w.len() == workers)
            {
                return c;
            }
        }
        assert!(Instant::now() < deadline, "no active coordinator with {workers} workers");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn start(cluster: &mut Cluster, c: u32, body: Value) -> String {
    let (code, started) = cluster.coord_post(c, "/v1/tasks", &body.to_string(), Some(TOKEN)).await;
    assert_eq!(code, 202, "{started}");
    started["task_ids"][0].as_str().unwrap().to_string()
}

async fn wait_task(cluster: &mut Cluster, c: u32, id: &str, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + WAIT;
    loop {
        let (_, task) = cluster.coord_get(c, &format!("/v1/tasks/{id}")).await;
        if ok(&task) {
            return task;
        }
        assert!(Instant::now() < deadline, "task {id} never {what}: {task}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The tasks node `id`'s DataPlane worker runs now.
async fn running_on(cluster: &Cluster, id: u32) -> Vec<String> {
    let status = cluster.status(id).await.expect("node status");
    status["dataplane"]["running_tasks"]
        .as_array()
        .unwrap_or_else(|| panic!("no dataplane in the status of node {id}: {status}"))
        .iter()
        .map(|t| t.as_str().unwrap().to_string())
        .collect()
}

async fn dead_letter_ids(cluster: &mut Cluster, c: u32) -> Vec<String> {
    let (code, dead) = cluster.coord_get(c, "/v1/dead-letters").await;
    assert_eq!(code, 200, "{dead}");
    dead.as_array().unwrap().iter().map(|l| l["task_id"].as_str().unwrap().to_string()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_nats_task_bus_passes_the_conformance_suite_and_is_shared() {
    let server = nats::NatsServer::start();
    let first = NatsBus::open(async_nats::connect(&server.url).await.unwrap(), "conformance.cluster").await.unwrap();
    conformance::run(&first).await;
    // A second coordinator's bus hears the first one's cancels and sees its
    // dead letters; another cluster's bus sees neither.
    let second = NatsBus::open(async_nats::connect(&server.url).await.unwrap(), "conformance.cluster").await.unwrap();
    let other = NatsBus::open(async_nats::connect(&server.url).await.unwrap(), "another").await.unwrap();
    assert_eq!(first.dead_letters().await.unwrap(), second.dead_letters().await.unwrap());
    assert_eq!(other.dead_letters().await.unwrap(), vec![]);
    let mut heard = second.cancels().await.unwrap();
    let mut elsewhere = other.cancels().await.unwrap();
    let notice = CancelNotice { task_id: "t-9".into(), reason: "test".into(), origin: "c1".into() };
    // Core NATS delivers to subscriptions the server already has; the
    // second bus's, made on its own connection, may still be on its way:
    // publish until it is heard (a cancel is idempotent).
    let deadline = Instant::now() + Duration::from_secs(10);
    let got = loop {
        first.publish_cancel(&notice).await.unwrap();
        match tokio::time::timeout(Duration::from_millis(500), futures::StreamExt::next(&mut heard)).await {
            Ok(got) => break got,
            Err(_) => assert!(Instant::now() < deadline, "the second bus never heard the cancel"),
        }
    };
    assert_eq!(got, Some(notice.clone()));
    // Drain repeats of it, if any were published before it was heard.
    while let Ok(Some(n)) = tokio::time::timeout(Duration::from_millis(300), futures::StreamExt::next(&mut heard)).await
    {
        assert_eq!(n, notice);
    }
    let leaked = tokio::time::timeout(Duration::from_millis(300), futures::StreamExt::next(&mut elsewhere)).await;
    assert!(leaked.is_err(), "another cluster heard the cancel: {leaked:?}");
    // Garbage on the cancel subject is ignored; the stream goes on.
    let client = async_nats::connect(&server.url).await.unwrap();
    client.publish("walship.conformance_cluster.tasks.cancel", "not json".into()).await.unwrap();
    first.publish_cancel(&CancelNotice { task_id: "t-10".into(), ..Default::default() }).await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(5), futures::StreamExt::next(&mut heard)).await;
    assert_eq!(got.expect("in time").map(|n| n.task_id), Some("t-10".to_string()));
}

/// Two coordinators on NATS: a cancel sent to the standby stops the task on
/// its node; a dead letter is seen by the standby and re-driven by it
/// after the active one dies; a task the dead coordinator dispatched is
/// stopped on its node by the new one (nobody waits for its result).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancels_and_dead_letters_travel_between_coordinators_over_nats() {
    let server = nats::NatsServer::start();
    let mut cluster = Cluster::launch(&spec(2, 2, Some(&server.url)));
    let active = active_with(&mut cluster, &[1, 2], 2).await;
    let standby = 3 - active;

    // Cancel through the standby, which has never heard of the task.
    let long = start(&mut cluster, active, json!({"kind": "noop", "sleep_ms": 120_000})).await;
    let running = wait_task(&mut cluster, active, &long, "ran", |t| t["state"] == "running").await;
    let node: u32 = running["node"].as_str().unwrap().trim_start_matches("node-").parse().unwrap();
    wait_until("the node to run it", WAIT, || async { running_on(&cluster, node).await.contains(&long) }).await;
    let asked = Instant::now();
    let (code, answer) = cluster.coord_post(standby, &format!("/v1/tasks/{long}/cancel"), "{}", Some(TOKEN)).await;
    assert_eq!((code, answer["broadcast"].as_bool()), (202, Some(true)), "{answer}");
    // The CLI says the same (exit 0, the broadcast named).
    let admin = format!("http://{}", cluster.coordinator(standby).admin);
    let out = std::process::Command::new(common::walship_bin())
        .args(["task", "cancel", &long, "--admin", &admin, "--token", TOKEN])
        .output()
        .unwrap();
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && printed.contains("broadcast"), "{printed}{}", String::from_utf8_lossy(&out.stderr));
    wait_task(&mut cluster, active, &long, "cancelled", |t| t["state"] == "cancelled").await;
    wait_until("the node to stop it", WAIT, || async { !running_on(&cluster, node).await.contains(&long) }).await;
    let took = asked.elapsed();
    eprintln!("cancel through the standby: stopped on node {node} {} ms after the request", took.as_millis());
    assert!(took < Duration::from_secs(5), "the cancel took {took:?}");

    // A dead letter under the active coordinator, listed by both.
    let stuck = start(&mut cluster, active, json!({"kind": "noop", "sleep_ms": 120_000, "advance": false})).await;
    let failed = wait_task(&mut cluster, active, &stuck, "died", |t| t["dead_letter"] == true).await;
    assert_eq!(failed["state"], "failed", "{failed}");
    for c in [active, standby] {
        let deadline = Instant::now() + WAIT;
        while !dead_letter_ids(&mut cluster, c).await.contains(&stuck) {
            assert!(Instant::now() < deadline, "coordinator c{c} never listed dead letter {stuck}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    // A task still running when the active coordinator dies.
    let orphan = start(&mut cluster, active, json!({"kind": "noop", "sleep_ms": 120_000})).await;
    let running = wait_task(&mut cluster, active, &orphan, "ran", |t| t["state"] == "running").await;
    let orphan_node: u32 = running["node"].as_str().unwrap().trim_start_matches("node-").parse().unwrap();
    wait_until("the node to run it", WAIT, || async { running_on(&cluster, orphan_node).await.contains(&orphan) })
        .await;
    cluster.coordinator(active).kill9();
    assert_eq!(active_with(&mut cluster, &[standby], 2).await, standby);
    wait_until("the new coordinator to stop the orphan", WAIT, || async {
        !running_on(&cluster, orphan_node).await.contains(&orphan)
    })
    .await;
    let (_, view) = cluster.coord_get(standby, "/v1/cluster").await;
    assert!(view["dataplane"]["orphans_cancelled"].as_u64() >= Some(1), "{view}");
    assert!(view["dataplane"]["task_bus"].as_str().unwrap().contains("NATS"), "{view}");

    // The new coordinator never ran the dead task, yet re-drives it from
    // its letter: queued and dispatched on its own workers.
    let (code, _) = cluster.coord_get(standby, &format!("/v1/tasks/{stuck}")).await;
    assert_eq!(code, 404, "the new coordinator had no table entry for it");
    let (code, redriven) =
        cluster.coord_post(standby, &format!("/v1/dead-letters/{stuck}/redrive"), "{}", Some(TOKEN)).await;
    assert_eq!(code, 200, "{redriven}");
    assert_eq!(redriven["kind"], "noop", "{redriven}");
    let again = wait_task(&mut cluster, standby, &stuck, "ran again", |t| t["attempts"] == 1).await;
    assert!(["running", "failed"].contains(&again["state"].as_str().unwrap()), "{again}");
    // Taken once: a second re-drive of the same letter while it runs is refused.
    let (code, body) =
        cluster.coord_post(standby, &format!("/v1/dead-letters/{stuck}/redrive"), "{}", Some(TOKEN)).await;
    if again["state"] == "running" {
        assert_eq!((code, body["error"]["code"].as_str()), (409, Some("not_dead_letter")), "{body}");
    }
}

/// The embedded bus: dead letters are kept in the coordinator's data dir,
/// so a restarted coordinator lists and re-drives them; a cancel for a task
/// it does not know changes nothing (no other coordinator could know it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_outlive_a_coordinator_restart_without_nats() {
    let mut cluster = Cluster::launch(&spec(1, 1, None));
    active_with(&mut cluster, &[1], 1).await;
    let stuck = start(&mut cluster, 1, json!({"kind": "noop", "sleep_ms": 120_000, "advance": false})).await;
    wait_task(&mut cluster, 1, &stuck, "died", |t| t["dead_letter"] == true).await;
    let deadline = Instant::now() + WAIT;
    while !dead_letter_ids(&mut cluster, 1).await.contains(&stuck) {
        assert!(Instant::now() < deadline, "dead letter {stuck} never listed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (_, letters) = cluster.coord_get(1, "/v1/dead-letters").await;
    let letter = letters.as_array().unwrap().iter().find(|l| l["task_id"] == *stuck).unwrap().clone();
    assert_eq!((letter["kind"].as_str(), letter["attempts"].as_u64()), (Some("noop"), Some(1)), "{letter}");
    assert!(letter["error"].as_str().unwrap().contains("no progress"), "{letter}");
    assert!(cluster.dir.path().join("coord/tasks/dead-letters.json").exists());

    cluster.restart_coordinator(1);
    active_with(&mut cluster, &[1], 1).await;
    assert!(dead_letter_ids(&mut cluster, 1).await.contains(&stuck), "the restart lost the dead letter");
    let (code, _) = cluster.coord_post(1, "/v1/tasks/t-never-was/cancel", "{}", Some(TOKEN)).await;
    assert_eq!(code, 404);
    let (code, _) = cluster.coord_post(1, &format!("/v1/dead-letters/{stuck}/redrive"), "{}", None).await;
    assert_eq!(code, 401, "a re-drive needs the token");
    assert!(dead_letter_ids(&mut cluster, 1).await.contains(&stuck), "a refused re-drive took the letter");
    let (code, redriven) = cluster.coord_post(1, &format!("/v1/dead-letters/{stuck}/redrive"), "{}", Some(TOKEN)).await;
    assert_eq!(code, 200, "{redriven}");
    wait_task(&mut cluster, 1, &stuck, "ran again", |t| t["attempts"] == 1).await;
    let (code, _) = cluster.coord_post(1, "/v1/dead-letters/t-never-was/redrive", "{}", Some(TOKEN)).await;
    assert_eq!(code, 404);
}
