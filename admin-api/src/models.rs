//! JSON models of the admin API, shared by the server and the CLI client.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

/// `GET /v1/status` on a node.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct NodeStatus {
    pub node_id: u32,
    pub uptime_seconds: u64,
    pub shards: Vec<ShardStatus>,
}

/// One shard replica on a node.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ShardStatus {
    pub shard_id: u32,
    /// `leader` or `follower`.
    pub role: String,
    pub epoch: u64,
    pub first_seqno: u64,
    pub last_seqno: u64,
    pub durable_seqno: u64,
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
