//! Drill endpoints of the coordinator's admin API: start a failover,
//! catch-up, re-seed, corruption or partition drill (dev and test
//! clusters; 202 with its id), list them and show one. Each drill is also
//! a row of the task table while it runs (`jobs::track_drill`).

use std::sync::Arc;

use axum::Json;
use axum::extract::rejection::QueryRejection;
use axum::extract::{ConnectInfo, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use walship_shipping::control::drills::{
    CatchupDrillRequest, CorruptionDrillRequest, DrillReport, FailoverDrillRequest, PartitionDrillRequest,
    ReseedDrillRequest,
};
use walship_shipping::control::{CoordError, Coordinator};

use crate::body::{ObjectJson, PathId};
use crate::coord::{CoordAdmin, authorize, coord_error};
use crate::models::ApiError;

/// Drills the coordinator ran,
/// oldest first, the newest `limit` (default 100, at most 1000).
#[utoipa::path(get, path = "/v1/drills", tag = "drills",
    params(("limit" = Option<u32>, Query, minimum = 1, maximum = 1000, description = "newest N (default 100)")),
    responses((status = 200, body = Vec<DrillReport>), (status = 400, description = "bad query", body = crate::models::ErrorBody)))]
pub(crate) async fn drills(
    State(admin): State<Arc<CoordAdmin>>,
    page: Result<Query<Page>, QueryRejection>,
) -> Response {
    let Query(page) = match page {
        Ok(page) => page,
        Err(rejection) => {
            return ApiError::new(StatusCode::BAD_REQUEST, "bad_query", rejection.body_text()).into_response();
        }
    };
    let limit = match page.limit {
        None => 100,
        Some(n @ 1..=1000) => n as usize,
        Some(n) => {
            return ApiError::new(StatusCode::BAD_REQUEST, "bad_query", format!("limit {n} is outside 1..=1000"))
                .into_response();
        }
    };
    let all = admin.coordinator.drills.list();
    let skip = all.len().saturating_sub(limit);
    Json(all.into_iter().skip(skip).collect::<Vec<_>>()).into_response()
}

/// `?limit=` on list endpoints.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Page {
    limit: Option<u64>,
}

#[utoipa::path(get, path = "/v1/drills/{id}", tag = "drills",
    params(("id" = String, Path, description = "drill id")),
    responses((status = 200, body = DrillReport), (status = 404, description = "unknown drill", body = crate::models::ErrorBody)))]
pub(crate) async fn drill(State(admin): State<Arc<CoordAdmin>>, PathId(id): PathId) -> Response {
    match admin.coordinator.drills.get(&id) {
        Some(report) => Json(report).into_response(),
        None => ApiError::new(StatusCode::NOT_FOUND, "unknown_drill", format!("no drill {id:?}")).into_response(),
    }
}

fn started(id: String) -> Response {
    let report = format!("/v1/drills/{id}");
    (StatusCode::ACCEPTED, Json(DrillStarted { id, report })).into_response()
}

/// Starts a drill after the token and body checks; 202 with its id.
pub(crate) async fn start_drill<R: std::fmt::Debug, F: std::future::Future<Output = Result<String, CoordError>>>(
    admin: &CoordAdmin,
    who: std::net::SocketAddr,
    headers: &HeaderMap,
    body: Result<ObjectJson<R>, ApiError>,
    start: impl FnOnce(Arc<Coordinator>, R) -> F,
) -> Response {
    if let Err(e) = authorize(headers, &admin.token) {
        return e.into_response();
    }
    let ObjectJson(request) = match body {
        Ok(body) => body,
        Err(refused) => return refused.into_response(),
    };
    tracing::info!(%who, ?request, "admin: drill requested");
    match start(admin.coordinator.clone(), request).await {
        Ok(id) => {
            crate::jobs::track_drill(admin, &id);
            started(id)
        }
        Err(e) => coord_error(e).into_response(),
    }
}

#[utoipa::path(post, path = "/v1/drills/failover", tag = "drills", request_body = FailoverDrillRequest,
    security(("bearer" = [])), responses((status = 202, description = "started", body = DrillStarted),
        (status = 400, description = "malformed body", body = crate::models::ErrorBody), (status = 401, body = crate::models::ErrorBody), (status = 403, body = crate::models::ErrorBody),
        (status = 404, description = "unknown shard", body = crate::models::ErrorBody), (status = 409, description = "another drill is running on the shard (drill_in_progress), the shard has no leader now (failover_in_progress), or the drill needs more than its headroom below replication.retain_bytes (drill_would_evict)", body = crate::models::ErrorBody), (status = 413, body = crate::models::ErrorBody),
        (status = 415, description = "not application/json", body = crate::models::ErrorBody),
        (status = 503, description = "not the active coordinator", body = crate::models::ErrorBody)))]
pub(crate) async fn failover_drill(
    State(admin): State<Arc<CoordAdmin>>,
    ConnectInfo(who): ConnectInfo<std::net::SocketAddr>,
    headers: HeaderMap,
    body: Result<ObjectJson<FailoverDrillRequest>, ApiError>,
) -> Response {
    start_drill(&admin, who, &headers, body, async |c, r| c.start_failover_drill(r).await).await
}

#[utoipa::path(post, path = "/v1/drills/catchup", tag = "drills", request_body = CatchupDrillRequest,
    security(("bearer" = [])), responses((status = 202, description = "started", body = DrillStarted),
        (status = 400, description = "malformed body", body = crate::models::ErrorBody), (status = 401, body = crate::models::ErrorBody), (status = 403, body = crate::models::ErrorBody),
        (status = 404, description = "unknown shard", body = crate::models::ErrorBody), (status = 409, description = "another drill is running on the shard (drill_in_progress), the shard has no leader now (failover_in_progress), or the drill needs more than its headroom below replication.retain_bytes (drill_would_evict), or pausing the follower would leave the shard without a majority (no_quorum_without_follower)", body = crate::models::ErrorBody), (status = 413, body = crate::models::ErrorBody),
        (status = 415, description = "not application/json", body = crate::models::ErrorBody),
        (status = 503, description = "not the active coordinator", body = crate::models::ErrorBody)))]
pub(crate) async fn catchup_drill(
    State(admin): State<Arc<CoordAdmin>>,
    ConnectInfo(who): ConnectInfo<std::net::SocketAddr>,
    headers: HeaderMap,
    body: Result<ObjectJson<CatchupDrillRequest>, ApiError>,
) -> Response {
    start_drill(&admin, who, &headers, body, async |c, r| c.start_catchup_drill(r).await).await
}

/// Dev and test clusters only: a follower (its node started with
/// `--allow-crash-drills`) drops its copy of the shard on purpose and
/// rebuilds it from the object store, then the leader, under load.
#[utoipa::path(post, path = "/v1/drills/reseed", tag = "drills", request_body = ReseedDrillRequest,
    security(("bearer" = [])), responses((status = 202, description = "started", body = DrillStarted),
        (status = 400, description = "malformed body", body = crate::models::ErrorBody), (status = 401, body = crate::models::ErrorBody), (status = 403, body = crate::models::ErrorBody),
        (status = 404, description = "unknown shard", body = crate::models::ErrorBody), (status = 409, description = "another drill is running on the shard (drill_in_progress), the shard has no leader now (failover_in_progress), the drill needs more than its headroom below replication.retain_bytes (drill_would_evict), its leader does not archive (not_archiving), or the follower named leads it (is_leader)", body = crate::models::ErrorBody), (status = 413, body = crate::models::ErrorBody),
        (status = 415, description = "not application/json", body = crate::models::ErrorBody),
        (status = 503, description = "not the active coordinator", body = crate::models::ErrorBody)))]
pub(crate) async fn reseed_drill(
    State(admin): State<Arc<CoordAdmin>>,
    ConnectInfo(who): ConnectInfo<std::net::SocketAddr>,
    headers: HeaderMap,
    body: Result<ObjectJson<ReseedDrillRequest>, ApiError>,
) -> Response {
    start_drill(&admin, who, &headers, body, async |c, r| c.start_reseed_drill(r).await).await
}

/// Dev and test clusters only: the chosen node (started with
/// `--allow-crash-drills`) damages its stored copy of one record on purpose.
#[utoipa::path(post, path = "/v1/drills/corruption", tag = "drills", request_body = CorruptionDrillRequest,
    security(("bearer" = [])), responses((status = 202, description = "started", body = DrillStarted),
        (status = 400, description = "malformed body, or the leader without allow_leader", body = crate::models::ErrorBody), (status = 401, body = crate::models::ErrorBody), (status = 403, body = crate::models::ErrorBody),
        (status = 404, description = "unknown shard", body = crate::models::ErrorBody), (status = 409, description = "another drill is running on the shard (drill_in_progress), the shard has no leader now (failover_in_progress), or the drill needs more than its headroom below replication.retain_bytes (drill_would_evict)", body = crate::models::ErrorBody), (status = 413, body = crate::models::ErrorBody),
        (status = 415, description = "not application/json", body = crate::models::ErrorBody),
        (status = 503, description = "not the active coordinator", body = crate::models::ErrorBody)))]
pub(crate) async fn corruption_drill(
    State(admin): State<Arc<CoordAdmin>>,
    ConnectInfo(who): ConnectInfo<std::net::SocketAddr>,
    headers: HeaderMap,
    body: Result<ObjectJson<CorruptionDrillRequest>, ApiError>,
) -> Response {
    start_drill(&admin, who, &headers, body, async |c, r| c.start_corruption_drill(r).await).await
}

/// Dev and test clusters only: the shard's leader is cut from its followers
/// (or one follower from the leader), simulated at the replication layer by
/// the nodes themselves (started with `--allow-crash-drills`), while every
/// node still reaches the coordinator; `trials` times.
#[utoipa::path(post, path = "/v1/drills/partition", tag = "drills", request_body = PartitionDrillRequest,
    security(("bearer" = [])), responses((status = 202, description = "started", body = DrillStarted),
        (status = 400, description = "malformed body, between not one of the supported shapes, trials, seconds or clients out of range, fewer than 3 replicas", body = crate::models::ErrorBody), (status = 401, body = crate::models::ErrorBody), (status = 403, body = crate::models::ErrorBody),
        (status = 404, description = "unknown shard", body = crate::models::ErrorBody), (status = 409, description = "another drill is running on the shard (drill_in_progress), the shard has no leader now (failover_in_progress), or the drill needs more than its headroom below replication.retain_bytes (drill_would_evict)", body = crate::models::ErrorBody), (status = 413, body = crate::models::ErrorBody),
        (status = 415, description = "not application/json", body = crate::models::ErrorBody),
        (status = 503, description = "not the active coordinator", body = crate::models::ErrorBody)))]
pub(crate) async fn partition_drill(
    State(admin): State<Arc<CoordAdmin>>,
    ConnectInfo(who): ConnectInfo<std::net::SocketAddr>,
    headers: HeaderMap,
    body: Result<ObjectJson<PartitionDrillRequest>, ApiError>,
) -> Response {
    start_drill(&admin, who, &headers, body, async |c, r| c.start_partition_drill(r).await).await
}

/// The answer to a drill request.
#[derive(Debug, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct DrillStarted {
    pub id: String,
    /// Where the report is.
    pub report: String,
}
