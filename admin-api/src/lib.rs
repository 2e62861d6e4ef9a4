//! walship's admin HTTP API (axum): JSON models, node status, health and
//! Prometheus metrics exposition.
//!
//! * [`models`]: the JSON shapes, shared with the CLI client.
//! * [`node_router`]: a node's `/healthz`, `/metrics` and `/v1/status`.
//!
//! Errors are JSON `{"error": {"code", "message"}}` with the matching HTTP
//! status; unknown paths answer 404 in that shape.

pub mod body;
pub mod catchup;
pub mod coord;
pub mod drills;
pub mod history;
pub mod jobs;
pub mod leadership;
pub mod models;
pub mod openapi;
pub mod replicas;
pub mod tasks;

use std::sync::Arc;
use std::time::Instant;

use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus::{Encoder, Registry, TextEncoder};
use walship_shipping::ReplicationNode;

use crate::models::{ApiError, DiskStatus, NodeStatus, WalIndexStatus, WorkerStatus};

/// What a node's admin API reads from.
pub struct NodeAdmin {
    pub node: Arc<ReplicationNode>,
    pub registry: Registry,
    pub started: Instant,
    /// The DataPlane worker's state now (`None`: no coordinator configured).
    pub worker: Option<Arc<dyn Fn() -> WorkerStatus + Send + Sync>>,
}

/// The router of a node's admin HTTP API.
pub fn node_router(admin: Arc<NodeAdmin>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/status", get(status))
        .route("/openapi.json", get(openapi))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(admin)
}

/// Largest request body any admin endpoint takes (413 beyond).
pub const MAX_BODY_BYTES: usize = 64 << 10;

/// A wrong method on a known path: 405 in the JSON error shape.
pub async fn method_not_allowed() -> Response {
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "this path does not take that method")
        .into_response()
}

/// Ready when every shard replica this node hosts has a role (a leader or
/// a follower that knows its leader), its WAL holds no known corrupt range,
/// and its WAL disk has more free space than its reserve: load balancers and Kubernetes probes keep traffic away
/// from a node still waiting for the coordinator or refusing appends for
/// want of space (it keeps serving reads; its process stays up).
#[utoipa::path(get, path = "/readyz", tag = "health",
    responses((status = 200, description = "every replica has a role", body = String),
        (status = 503, description = "waiting for the coordinator, the disk is full (`disk_full`), or a known corrupt range in the WAL (`corruption`)", body = models::ErrorBody)))]
async fn readyz(State(admin): State<Arc<NodeAdmin>>) -> Response {
    let disk = disk_status(&admin);
    if disk.disk_full {
        return ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "disk_full",
            format!(
                "disk full: the WAL's disk ({}) has {} bytes free, less than the {}-byte reserve \
                 (wal.min_free_bytes); appends are refused, reads are served",
                disk.dir, disk.free_bytes, disk.min_free_bytes
            ),
        )
        .into_response();
    }
    let shards = admin.node.status();
    let corrupt: Vec<String> = shards
        .iter()
        .flat_map(|s| {
            s.corruption
                .iter()
                .map(move |c| format!("shard {} seqnos {}..={} ({})", s.shard_id, c.first_seqno, c.last_seqno, c.file))
        })
        .collect();
    if !corrupt.is_empty() {
        return ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "corruption",
            format!(
                "corruption in this node's WAL: {}; those records are not served (DATA_LOSS) until repaired from an \
                 intact replica",
                corrupt.join("; ")
            ),
        )
        .into_response();
    }
    let waiting: Vec<u32> = shards.into_iter().filter(|s| s.role == "unassigned").map(|s| s.shard_id).collect();
    if waiting.is_empty() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "not_ready",
            format!("shards {waiting:?} have no role yet (waiting for the coordinator)"),
        )
        .into_response()
    }
}

#[utoipa::path(get, path = "/healthz", tag = "health", responses((status = 200, description = "the process is up", body = String)))]
async fn healthz() -> &'static str {
    "ok\n"
}

async fn not_found() -> Response {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint").into_response()
}

#[utoipa::path(get, path = "/metrics", tag = "health",
    responses((status = 200, description = "Prometheus text exposition", body = String, content_type = "text/plain")))]
async fn metrics(State(admin): State<Arc<NodeAdmin>>) -> Response {
    let mut body = Vec::new();
    match TextEncoder::new().encode(&admin.registry.gather(), &mut body) {
        Ok(()) => ([(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)], body).into_response(),
        Err(e) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "metrics", e.to_string()).into_response(),
    }
}

#[utoipa::path(get, path = "/v1/status", tag = "node", responses((status = 200, body = NodeStatus)))]
async fn status(State(admin): State<Arc<NodeAdmin>>) -> Response {
    Json(NodeStatus {
        node_id: admin.node.me,
        uptime_seconds: admin.started.elapsed().as_secs(),
        shards: admin.node.status(),
        heartbeats_received: admin.node.received_heartbeats(),
        disk: disk_status(&admin),
        wal: wal_index_status(&admin),
        drill_partitioned_from: admin.node.drill_partitioned_from(),
        dataplane: admin.worker.as_ref().map(|status| status()),
    })
    .into_response()
}

/// The WAL index's memory, read from the store (no I/O).
fn wal_index_status(admin: &NodeAdmin) -> WalIndexStatus {
    let wal = &admin.node.wal;
    let records = wal
        .shards()
        .into_iter()
        .filter_map(|shard| wal.positions(shard).ok())
        .map(|p| (p.last_seqno + 1).saturating_sub(p.first_seqno))
        .sum();
    WalIndexStatus { index_bytes: wal.index_bytes(), index_chunks: wal.index_chunks(), records }
}

/// The WAL disk's free space as the node last measured it (no syscall).
fn disk_status(admin: &NodeAdmin) -> DiskStatus {
    match admin.node.wal.disk_space() {
        Some(d) => DiskStatus {
            dir: d.dir().display().to_string(),
            free_bytes: d.free(),
            min_free_bytes: d.min_free_bytes(),
            disk_full: d.is_full(),
        },
        None => DiskStatus::default(),
    }
}

#[utoipa::path(get, path = "/openapi.json", tag = "health", responses((status = 200, description = "this document")))]
async fn openapi() -> Response {
    Json(openapi::node()).into_response()
}
