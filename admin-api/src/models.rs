//! JSON models of the admin API, shared by the server and the CLI client.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

pub use walship_shipping::replica::{FollowerStatus, ReceivedHeartbeat, ReplicaStatus};

/// `GET /v1/status` on a node.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct NodeStatus {
    pub node_id: u32,
    pub uptime_seconds: u64,
    /// Every shard replica this node hosts: role, epoch, positions and, on
    /// leaders, each follower's progress and lag.
    pub shards: Vec<ReplicaStatus>,
    /// Heartbeats this node received (when it is the configured receiver).
    pub heartbeats_received: Vec<ReceivedHeartbeat>,
}

/// The error body every endpoint answers with: `{"error": {"code", "message"}}`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ErrorDetail {
    pub code: String,
    pub message: String,
}

/// An error answer with its HTTP status.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub body: ErrorBody,
}

impl ApiError {
    pub fn new(status: StatusCode, code: impl Into<String>, message: impl Into<String>) -> ApiError {
        ApiError { status, body: ErrorBody { error: ErrorDetail { code: code.into(), message: message.into() } } }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body)).into_response()
    }
}
