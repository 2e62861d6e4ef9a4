//! Replica changes over HTTP: `POST /v1/shards/{id}/replicas` starts one
//! (add, remove or replace a replica of a shard, under load; see the
//! coordinator's `members` module for the rules), `GET /v1/replica-changes`
//! and `GET /v1/replica-changes/{id}` follow them. Each change is also a
//! row of the task table (`replica-add`, `replica-remove`,
//! `replica-replace`), run by the coordinator, with its progress: the new
//! replica's position, bytes by source and MiB/s.

use std::sync::Arc;

use axum::Json;
use axum::extract::{ConnectInfo, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use walship_shipping::control::coordinator::{ReplicaChange, ReplicaChangeRequest};

use crate::body::{ObjectJson, PathId};
use crate::coord::{CoordAdmin, authorize, coord_error};
use crate::models::ApiError;

/// Starts a change of shard `id`'s replica set: `add` a node (placement
/// chooses one when none is named: live, outside the shard, in a region
/// the shard does not cover when one is free), `remove` one (never below
/// `replication.min_replicas`; a leader hands over first), `replace` one
/// with another (a dead node's, typically). The new replica seeds from
/// peers, the object store and the leader's stream as a learner, then
/// joins the voting set through a joint step; appends continue throughout.
#[utoipa::path(post, path = "/v1/shards/{id}/replicas", tag = "shards",
    params(("id" = u32, Path, description = "shard id")),
    request_body = ReplicaChangeRequest,
    security(("bearer" = [])),
    responses((status = 202, description = "started; follow it at /v1/replica-changes/{id}", body = ReplicaChange),
        (status = 400, description = "malformed body or shard id, `node` missing for remove or replace, `with` outside replace", body = crate::models::ErrorBody),
        (status = 401, description = "no token", body = crate::models::ErrorBody), (status = 403, description = "wrong token", body = crate::models::ErrorBody),
        (status = 404, description = "unknown shard", body = crate::models::ErrorBody),
        (status = 409, description = "a change or failover is running (change_in_progress, failover_in_progress), the node is not in the cluster (unknown_node), holds no replica (not_a_replica) or already holds one (already_a_replica), the removal would go below replication.min_replicas (below_min_replicas), no live candidate (no_candidate), or the named node's region is covered while another is free (same_region)", body = crate::models::ErrorBody),
        (status = 413, description = "body over 64 KiB", body = crate::models::ErrorBody),
        (status = 415, description = "not application/json", body = crate::models::ErrorBody),
        (status = 503, description = "not the active coordinator", body = crate::models::ErrorBody)))]
pub async fn start(
    State(admin): State<Arc<CoordAdmin>>,
    ConnectInfo(who): ConnectInfo<std::net::SocketAddr>,
    PathId(id): PathId,
    headers: HeaderMap,
    body: Result<ObjectJson<ReplicaChangeRequest>, ApiError>,
) -> Response {
    if let Err(e) = authorize(&headers, &admin.token) {
        return e.into_response();
    }
    let shard = match crate::coord::parse_shard(&id) {
        Ok(id) => id,
        Err(e) => return e.into_response(),
    };
    let ObjectJson(request) = match body {
        Ok(body) => body,
        Err(refused) => return refused.into_response(),
    };
    tracing::info!(%who, shard, ?request, "admin: replica change requested");
    match admin.coordinator.start_replica_change(shard, request) {
        Ok(change) => {
            track(&admin, &change.id);
            (StatusCode::ACCEPTED, Json(change)).into_response()
        }
        Err(e) => coord_error(e).into_response(),
    }
}

/// Replica changes this coordinator ran or runs, oldest first (the last
/// 100; a coordinator restart forgets them).
#[utoipa::path(get, path = "/v1/replica-changes", tag = "shards",
    responses((status = 200, body = Vec<ReplicaChange>)))]
pub async fn list(State(admin): State<Arc<CoordAdmin>>) -> Response {
    Json(admin.coordinator.changes.list()).into_response()
}

#[utoipa::path(get, path = "/v1/replica-changes/{id}", tag = "shards",
    params(("id" = String, Path, description = "change id")),
    responses((status = 200, body = ReplicaChange), (status = 404, description = "unknown change", body = crate::models::ErrorBody)))]
pub async fn show(State(admin): State<Arc<CoordAdmin>>, PathId(id): PathId) -> Response {
    match admin.coordinator.changes.get(&id) {
        Some(change) => Json(change).into_response(),
        None => {
            ApiError::new(StatusCode::NOT_FOUND, "unknown_change", format!("no replica change {id:?}")).into_response()
        }
    }
}

/// Lists the change in the task table as a task the coordinator runs, with
/// its progress (bytes the new replica applied) until it ends.
fn track(admin: &CoordAdmin, id: &str) {
    let coordinator = admin.coordinator.clone();
    let Some(change) = coordinator.changes.get(id) else { return };
    let (kind, shard) = (format!("replica-{}", change.action.as_str()), change.shard);
    let watched = id.to_string();
    crate::jobs::track_here(admin, id, kind, shard, move || {
        let change = coordinator.changes.get(&watched)?;
        let applied = change.bytes_peer + change.bytes_archive + change.bytes_stream + change.bytes_push;
        Some(crate::jobs::Tick {
            rows: change.learner_durable_seqno as i64,
            bytes: applied as i64,
            summary: serde_json::to_value(&change).expect("plain data"),
            ended: (change.state != "running").then(|| (change.state == "done", change.error.clone())),
        })
    });
}
