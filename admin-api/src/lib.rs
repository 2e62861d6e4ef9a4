//! walship's admin HTTP API (axum): JSON models, node status, health and
//! Prometheus metrics exposition.
//!
//! * [`models`]: the JSON shapes, shared with the CLI client.
//! * [`node_router`]: a node's `/healthz`, `/metrics` and `/v1/status`.
//!
//! Errors are JSON `{"error": {"code", "message"}}` with the matching HTTP
//! status; unknown paths answer 404 in that shape.

pub mod coord;
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
use walship_shipping::ReplicationNode;

use crate::models::{ApiError, NodeStatus};

/// What a node's admin API reads from.
pub struct NodeAdmin {
    pub node: Arc<ReplicationNode>,
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
    Json(NodeStatus {
        node_id: admin.node.me,
        uptime_seconds: admin.started.elapsed().as_secs(),
        shards: admin.node.status(),
        heartbeats_received: admin.node.received_heartbeats(),
    })
    .into_response()
}
