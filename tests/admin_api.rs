//! Admin API edges on real processes: readiness, JSON errors for wrong
//! methods, oversized bodies and bad queries, and the task list bounds.

mod common;

use std::time::Duration;

use common::{Cluster, TOKEN, http_request, wait_until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_and_error_shapes() {
    let mut cluster = Cluster::start_with(3, 1, 1, "leader_timeout_ms = 2000", None);
    // Nodes are ready once the coordinator gave every replica a role.
    for id in 1..=3 {
        let url = format!("{}/readyz", cluster.node(id).admin);
        wait_until(&format!("node {id} ready"), Duration::from_secs(30), || {
            let url = url.clone();
            async move { common::http_get(&url).await.0 == 200 }
        })
        .await;
    }
    let coord = cluster.coordinator(1).admin.clone();
    let json = |body: &str| serde_json::from_str::<serde_json::Value>(body).unwrap_or_default();

    // Wrong methods: 405 with the JSON error body.
    for (method, path) in [("GET", "/v1/shards/1/failover"), ("POST", "/v1/cluster"), ("DELETE", "/v1/shards/1")] {
        let (code, body) = http_request(method, &format!("{coord}{path}"), None).await;
        assert_eq!(code, 405, "{method} {path}: {body}");
        assert_eq!(json(&body)["error"]["code"], "method_not_allowed", "{body}");
    }
    let node = cluster.node(1).admin.clone();
    let (code, body) = http_request("POST", &format!("{node}/v1/status"), Some("{}")).await;
    assert_eq!((code, json(&body)["error"]["code"].as_str()), (405, Some("method_not_allowed")));

    // Oversized body: 413, nothing changes.
    let before = cluster.leader_of(1, 1).await.unwrap();
    let big = format!("{{\"target\": 2, \"pad\": \"{}\"}}", "x".repeat(100 << 10));
    let (code, body) = cluster.coord_post(1, "/v1/shards/1/failover", &big, Some(TOKEN)).await;
    assert_eq!((code, body["error"]["code"].as_str()), (413, Some("body_too_large")), "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("64 KiB limit"), "{body}");
    // Far over it (10 MiB): still an answer the caller can read, not a
    // connection closed under it.
    let huge = format!("{{\"target\": 2, \"pad\": \"{}\"}}", "x".repeat(10 << 20));
    let (code, body) = cluster.coord_post(1, "/v1/shards/1/failover", &huge, Some(TOKEN)).await;
    assert_eq!((code, body["error"]["code"].as_str()), (413, Some("body_too_large")), "{body}");
    assert_eq!(cluster.leader_of(1, 1).await.unwrap(), before, "an oversized request changed leadership");
    // Malformed and wrongly typed bodies: 400 naming the problem.
    let (code, body) = cluster.coord_post(1, "/v1/shards/1/failover", "{not json", Some(TOKEN)).await;
    assert_eq!(code, 400, "{body}");
    let (code, body) = cluster.coord_post(1, "/v1/shards/1/failover", r#"{"target": "two"}"#, Some(TOKEN)).await;
    assert_eq!(code, 400, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("target"), "{body}");
    let (code, body) = cluster.coord_post(1, "/v1/shards/1/failover", r#"{"targett": 2}"#, Some(TOKEN)).await;
    assert_eq!(code, 400, "unknown fields are refused: {body}");
    let (code, body) = cluster.coord_post(1, "/v1/shards/x/failover", "{}", Some(TOKEN)).await;
    assert_eq!((code, body["error"]["code"].as_str()), (400, Some("bad_shard_id")));
    // Path ids: only decimal digits within u32 name a shard, and a segment
    // that is no UTF-8 once decoded gets the same JSON error shape.
    for (path, error) in [
        ("/v1/shards/+1", "bad_shard_id"),
        ("/v1/shards/4294967296", "bad_shard_id"),
        ("/v1/shards/%20%201", "bad_shard_id"),
        ("/v1/shards/%FF", "bad_path"),
        ("/v1/tasks/%FF%FE", "bad_path"),
        ("/v1/drills/%C3%28", "bad_path"),
    ] {
        let (code, body) = cluster.coord_get(1, path).await;
        assert_eq!((code, body["error"]["code"].as_str()), (400, Some(error)), "{path}: {body}");
    }
    let (code, body) = cluster.coord_post(1, "/v1/shards/%FF/failover", "{}", Some(TOKEN)).await;
    assert_eq!((code, body["error"]["code"].as_str()), (400, Some("bad_path")), "{body}");
    assert_eq!(cluster.leader_of(1, 1).await.unwrap(), before, "no refused request changed leadership");

    // Task list: bounded, and a bad query is a JSON 400.
    let (code, tasks) = cluster.coord_get(1, "/v1/tasks?limit=5").await;
    assert_eq!(code, 200);
    assert!(tasks["tasks"].as_array().unwrap().len() <= 5, "{tasks}");
    let (code, body) = cluster.coord_get(1, "/v1/tasks?limit=many").await;
    assert_eq!((code, body["error"]["code"].as_str()), (400, Some("bad_query")));
    let (code, _) = cluster.coord_get(1, "/v1/tasks/none").await;
    assert_eq!(code, 404);
}

/// Request bodies must be one JSON object: arrays (which a derived
/// deserializer would map by position, so `[]` was a real failover and
/// `[1]` a drill), scalars, `null`, duplicate keys and unknown fields are a
/// 400 naming the problem, and change nothing (no failover, no drill). The
/// bearer scheme is matched case-insensitively.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_json_objects_are_requests_and_refused_ones_change_nothing() {
    let mut cluster = Cluster::start_with(3, 1, 1, "leader_timeout_ms = 2000", None);
    let coord = cluster.coordinator(1).admin.clone();
    wait_until("shard 1 led", Duration::from_secs(30), || {
        let url = format!("{coord}/v1/shards/1");
        async move {
            let (_, body) = common::http_get(&url).await;
            serde_json::from_str::<serde_json::Value>(&body).is_ok_and(|v| v["leader"].is_u64())
        }
    })
    .await;
    let before = cluster.leader_of(1, 1).await.expect("a leader");
    let (_, drills_before) = cluster.coord_get(1, "/v1/drills").await;
    let hostile = [
        "[]",
        "[null, true]",
        "[1]",
        "[2, false, true]",
        "null",
        "true",
        "1",
        "\"x\"",
        "",
        r#"{"allow_loss": false, "allow_loss": true}"#,
        r#"{"bogus": 1}"#,
    ];
    for path in [
        "/v1/shards/1/failover",
        "/v1/drills/failover",
        "/v1/drills/catchup",
        "/v1/drills/corruption",
        "/v1/drills/reseed",
    ] {
        for body in hostile {
            let (code, answer) = cluster.coord_post(1, path, body, Some(TOKEN)).await;
            assert_eq!(
                (code, answer["error"]["code"].as_str()),
                (400, Some("bad_request")),
                "{path} {body:?}: {answer}"
            );
        }
    }
    let (code, answer) = cluster.coord_post(1, "/v1/shards/1/failover", "[]", None).await;
    assert_eq!(code, 401, "the token is checked first: {answer}");
    assert_eq!(cluster.leader_of(1, 1).await.unwrap(), before, "no refused body moved leadership");
    let (_, drills_after) = cluster.coord_get(1, "/v1/drills").await;
    assert_eq!(drills_after, drills_before, "no refused body started a drill");

    // A preview with a lower-case scheme is accepted.
    let url = format!("{coord}/v1/shards/1/failover");
    let (code, answer) = common::http_post_authorized(&url, r#"{"preview": true}"#, &format!("bearer {TOKEN}")).await;
    assert_eq!(code, 200, "{answer}");
    assert_eq!(cluster.leader_of(1, 1).await.unwrap(), before, "a preview moves nothing");
}
