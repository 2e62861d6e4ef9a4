//! walship's admin HTTP API (axum): JSON models, node status, health and
//! Prometheus metrics exposition.
//!
//! * [`models`]: the JSON shapes, shared with the CLI client.
//! * [`node_router`]: a node's `/healthz`, `/metrics` and `/v1/status`.
//!
//! Errors are JSON `{"error": {"code", "message"}}` with the matching HTTP
//! status; unknown paths answer 404 in that shape.

pub mod models;

use std::sync::Arc;
use std::time::Instant;

use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus::{Encoder, Registry, TextEncoder};
use walship_wal::Wal;

use crate::models::{ApiError, NodeStatus, ShardStatus};

/// What a node's admin API reads from.
pub struct NodeAdmin {
    pub node_id: u32,
    pub wal: Wal,
    /// The epoch this node writes in (static until failover exists).
    pub epoch: u64,
    pub registry: Registry,
    pub started: Instant,
}

/// The router of a node's admin HTTP API.
pub fn node_router(admin: Arc<NodeAdmin>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .route("/v1/status", get(status))
        .fallback(not_found)
        .with_state(admin)
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn not_found() -> Response {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint").into_response()
}

async fn metrics(State(admin): State<Arc<NodeAdmin>>) -> Response {
    let mut body = Vec::new();
    match TextEncoder::new().encode(&admin.registry.gather(), &mut body) {
        Ok(()) => ([(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)], body).into_response(),
        Err(e) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "metrics", e.to_string()).into_response(),
    }
}

async fn status(State(admin): State<Arc<NodeAdmin>>) -> Response {
    let mut shards = Vec::new();
    for shard in admin.wal.shards() {
        match admin.wal.positions(shard) {
            Ok(p) => shards.push(ShardStatus {
                shard_id: shard,
                role: "leader".into(),
                epoch: admin.epoch,
                first_seqno: p.first_seqno,
                last_seqno: p.last_seqno,
                durable_seqno: p.durable_seqno,
            }),
            Err(e) => {
                return ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "wal", e.to_string()).into_response();
            }
        }
    }
    Json(NodeStatus { node_id: admin.node_id, uptime_seconds: admin.started.elapsed().as_secs(), shards })
        .into_response()
}
