//! Moving leadership over HTTP: `POST /v1/shards/{id}/failover` previews
//! or performs one shard's failover (targeted, or forced with
//! `allow_loss`), `POST /v1/rebalance` moves leaderships from the nodes
//! leading more than their share to those leading less (the coordinator's
//! `rebalance` module has the rules).

use std::sync::Arc;

use axum::Json;
use axum::extract::{ConnectInfo, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use walship_shipping::control::coordinator::{RebalanceOutcome, RebalanceRequest};
use walship_shipping::control::{FailoverOutcome, FailoverRequest};

use crate::body::{ObjectJson, PathId};
use crate::coord::{CoordAdmin, authorize, coord_error, parse_shard};
use crate::models::ApiError;

#[utoipa::path(post, path = "/v1/shards/{id}/failover", tag = "shards",
    params(("id" = u32, Path, description = "shard id")),
    request_body = FailoverRequest,
    security(("bearer" = [])),
    responses((status = 200, description = "done, or the preview", body = FailoverOutcome),
        (status = 400, description = "malformed body or bad shard id", body = crate::models::ErrorBody),
        (status = 401, description = "no token", body = crate::models::ErrorBody), (status = 403, description = "wrong token", body = crate::models::ErrorBody),
        (status = 404, description = "unknown shard, or the target holds no replica of it", body = crate::models::ErrorBody),
        (status = 409, description = "would lose acknowledged records, or a failover is running", body = crate::models::ErrorBody),
        (status = 413, description = "body over 64 KiB", body = crate::models::ErrorBody),
        (status = 415, description = "not application/json", body = crate::models::ErrorBody),
        (status = 503, description = "not the active coordinator, no majority, target unreachable", body = crate::models::ErrorBody)))]
pub async fn failover(
    State(admin): State<Arc<CoordAdmin>>,
    ConnectInfo(who): ConnectInfo<std::net::SocketAddr>,
    PathId(id): PathId,
    headers: HeaderMap,
    body: Result<ObjectJson<FailoverRequest>, ApiError>,
) -> Response {
    if let Err(e) = authorize(&headers, &admin.token) {
        return e.into_response();
    }
    let id = match parse_shard(&id) {
        Ok(id) => id,
        Err(e) => return e.into_response(),
    };
    let ObjectJson(request) = match body {
        Ok(body) => body,
        Err(refused) => return refused.into_response(),
    };
    tracing::info!(%who, shard = id, ?request, "admin: failover requested");
    let reason = if request.allow_loss { "forced" } else { "manual" };
    match admin.coordinator.failover(id, request, reason).await {
        Ok(outcome) => Json(outcome).into_response(),
        Err(e) => coord_error(e).into_response(),
    }
}

#[utoipa::path(post, path = "/v1/rebalance", tag = "shards",
    request_body = RebalanceRequest,
    security(("bearer" = [])),
    responses((status = 200, description = "the moves made (each moved shard failed over, preferring the replica planned), or the preview", body = RebalanceOutcome),
        (status = 400, description = "malformed body, unknown field, or max_moves 0", body = crate::models::ErrorBody),
        (status = 401, description = "no token", body = crate::models::ErrorBody), (status = 403, description = "wrong token", body = crate::models::ErrorBody),
        (status = 409, description = "a rebalance is already running", body = crate::models::ErrorBody),
        (status = 413, description = "body over 64 KiB", body = crate::models::ErrorBody),
        (status = 415, description = "not application/json", body = crate::models::ErrorBody),
        (status = 503, description = "not the active coordinator", body = crate::models::ErrorBody)))]
/// Moves leaderships from the nodes leading more than their share to the
/// replicas leading less (`rebalance.rs` in the shipping crate).
pub async fn rebalance(
    State(admin): State<Arc<CoordAdmin>>,
    ConnectInfo(who): ConnectInfo<std::net::SocketAddr>,
    headers: HeaderMap,
    body: Result<ObjectJson<RebalanceRequest>, ApiError>,
) -> Response {
    if let Err(e) = authorize(&headers, &admin.token) {
        return e.into_response();
    }
    let ObjectJson(request) = match body {
        Ok(body) => body,
        Err(refused) => return refused.into_response(),
    };
    tracing::info!(%who, ?request, "admin: leadership rebalance requested");
    match admin.coordinator.rebalance(request).await {
        Ok(outcome) => Json(outcome).into_response(),
        Err(e) => coord_error(e).into_response(),
    }
}
