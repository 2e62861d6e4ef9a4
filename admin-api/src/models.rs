//! JSON models of the admin API, shared by the server and the CLI client.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

pub use walship_shipping::replica::{FollowerStatus, ReceivedHeartbeat, ReplicaStatus};

/// `GET /v1/status` on a node.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct NodeStatus {
    pub node_id: u32,
    pub uptime_seconds: u64,
    /// Every shard replica this node hosts: role, epoch, positions and, on
    /// leaders, each follower's progress and lag.
    pub shards: Vec<ReplicaStatus>,
    /// Heartbeats this node received (when it is the configured receiver).
    pub heartbeats_received: Vec<ReceivedHeartbeat>,
    /// The WAL disk's free space against its reserve.
    #[serde(default)]
    pub disk: DiskStatus,
    /// What the WAL's index of its log costs in memory.
    #[serde(default)]
    pub wal: WalIndexStatus,
    /// Peer nodes a partition drill (`Control.Partition`, dev and test
    /// clusters only) has this node treat as unreachable for replication
    /// traffic right now; empty outside a drill.
    #[serde(default)]
    pub drill_partitioned_from: Vec<u32>,
}

/// The free space of a node's WAL disk (`wal.min_free_bytes`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct DiskStatus {
    /// The WAL directory whose file system is measured.
    pub dir: String,
    /// Free bytes (refreshed about five times a second).
    pub free_bytes: u64,
    /// The reserve: appends are refused while less is free.
    pub min_free_bytes: u64,
    /// Less than the reserve is free: appends and replicated segments are
    /// refused, the node does not lead, `/readyz` answers 503.
    pub disk_full: bool,
}

/// The memory of the WAL's index: one entry per stored chunk of records
/// (`wal.chunk_bytes` of them), not per record.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct WalIndexStatus {
    /// Bytes of memory the index takes, every shard (estimated from its
    /// structures' sizes; `walship_wal_index_bytes`).
    pub index_bytes: u64,
    /// Stored chunks it holds, every shard (`walship_wal_index_chunks`).
    pub index_chunks: u64,
    /// Records the WAL retains, every shard.
    pub records: u64,
}

/// The error body every endpoint answers with: `{"error": {"code", "message"}}`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
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

pub use walship_shipping::control::state::FailoverRecord;

/// `GET /v1/cluster` on the coordinator.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct ClusterView {
    pub cluster_id: String,
    pub coordinator: CoordinatorView,
    pub nodes: Vec<NodeView>,
    pub shards: usize,
    pub shards_without_leader: usize,
    pub recent_failovers: Vec<FailoverRecord>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct CoordinatorView {
    pub id: String,
    /// This coordinator holds the lease.
    pub active: bool,
    pub lease_holder: String,
    pub lease_term: u64,
    /// What backs the leadership KV (`file:` or `nats:`).
    pub kv: String,
    pub uptime_seconds: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct NodeView {
    pub node_id: u32,
    pub grpc_addr: String,
    pub admin_addr: String,
    pub region: u32,
    pub last_heartbeat_ms_ago: Option<u64>,
    /// Heard from within the leader timeout.
    pub alive: bool,
}

/// `GET /v1/shards/{id}` on the coordinator.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct ShardView {
    pub shard_id: u32,
    pub leader: Option<u32>,
    pub epoch: u64,
    pub commit_floor: u64,
    pub replicas: Vec<ReplicaView>,
    pub last_failover: Option<FailoverRecord>,
}

/// One replica as the coordinator sees it (from its heartbeats and, for
/// lag, its leader's).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct ReplicaView {
    pub node_id: u32,
    /// `leader`, `follower`, `unassigned`, `down` (no heartbeat within the
    /// leader timeout) or `unknown` (never heard from).
    pub role: String,
    pub alive: bool,
    pub last_heartbeat_ms_ago: Option<u64>,
    pub epoch: u64,
    pub last_epoch: u64,
    pub last_seqno: u64,
    pub durable_seqno: u64,
    pub commit_seqno: u64,
    pub lag_records: Option<u64>,
    pub lag_bytes: Option<u64>,
    pub lag_seconds: Option<f64>,
    /// Its last heartbeat reports its WAL disk below the free-space reserve
    /// (`wal.min_free_bytes`): it refuses appends and does not lead.
    #[serde(default)]
    pub disk_full: bool,
    /// The first seqno of its log its last heartbeat reports as corrupt
    /// (never served; a follower refetches it, a leader hands over to an
    /// intact replica); none when intact.
    #[serde(default)]
    pub corrupt_from_seqno: Option<u64>,
}
