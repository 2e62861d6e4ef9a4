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
    /// This node's DataPlane worker (absent without coordinators).
    #[serde(default)]
    pub dataplane: Option<WorkerStatus>,
}

/// A node's DataPlane worker.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct WorkerStatus {
    /// The coordinator its stream is open to (`None`: reconnecting).
    pub coordinator: Option<String>,
    /// Ids of the tasks running here now, sorted.
    pub running_tasks: Vec<String>,
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
    /// Shards whose recorded leader reports leading them in the recorded
    /// epoch and is not lost to the coordinator: alive (heard within its
    /// silence bound: the leader timeout, longer while its heartbeats have
    /// lately come late), or, unheard, still heard by followers that make
    /// a majority with it (the coordinator fails nothing over then). Every
    /// shard once a cluster has started and settled; a crashed leader's
    /// shards leave the count when the coordinator counts them lost.
    pub shards_leading: usize,
    pub recent_failovers: Vec<FailoverRecord>,
    /// Nodes connected to this coordinator's DataPlane as workers.
    pub workers: Vec<walship_dataplane::coordinator::WorkerView>,
    pub dataplane: DataPlaneView,
}

/// What the DataPlane has done since this coordinator started.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct DataPlaneView {
    pub dispatched: u64,
    /// Tasks requeued after their worker went away or they stalled.
    pub redispatched: u64,
    /// Result batches for an unknown job or task, dropped.
    pub dropped_results: u64,
    /// Results of tasks already finished or moved elsewhere, dropped.
    pub duplicate_completions: u64,
    /// Connect streams refused (standby, no Hello, a duplicate worker id, bad build).
    pub refused_streams: u64,
    /// Cancels sent to workers for tasks no coordinator tracks (dispatched
    /// before a coordinator change).
    #[serde(default)]
    pub orphans_cancelled: u64,
    /// Where cancels travel and dead letters are kept.
    #[serde(default)]
    pub task_bus: String,
    /// Scheduled verifies: how often, and each shard's last verdict.
    #[serde(default)]
    pub verify_schedule: crate::jobs::VerifySchedule,
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
    /// Heard from within its silence bound: the leader timeout, or longer
    /// (at most 4 s) while its heartbeats have lately come late; past it
    /// the coordinator counts the shards it leads as lost.
    pub alive: bool,
    /// How long its process has run, as of its last heartbeat plus that
    /// heartbeat's age; none until heard from.
    #[serde(default)]
    pub uptime_seconds: Option<u64>,
    /// Bytes its WAL takes on disk (its last heartbeat).
    #[serde(default)]
    pub wal_disk_bytes: Option<u64>,
    /// Free bytes of its WAL disk (its last heartbeat).
    #[serde(default)]
    pub disk_free_bytes: Option<u64>,
    /// Its WAL disk is below the free-space reserve (`wal.min_free_bytes`).
    #[serde(default)]
    pub disk_full: bool,
    /// Shards whose replica on this node reports a corrupt range.
    #[serde(default)]
    pub corrupt_shards: Vec<u32>,
    /// Shards the KV records this node as leader of (a node back from a
    /// failover leads none until a rebalance moves some back).
    #[serde(default)]
    pub leads: u64,
}

/// `GET /v1/shards/{id}` on the coordinator.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct ShardView {
    pub shard_id: u32,
    pub leader: Option<u32>,
    pub epoch: u64,
    pub commit_floor: u64,
    /// Newest seqno of the shard in the object store (`[archive]`), as its
    /// leader's last heartbeat reports it; none when the shard is not
    /// archived (no `[archive]`, or no leader reporting as one).
    #[serde(default)]
    pub archived_seqno: Option<u64>,
    /// Committed records not yet archived: the leader's `commit_seqno` minus
    /// `archived_seqno` (same heartbeat); none when not archived.
    #[serde(default)]
    pub archive_lag_records: Option<u64>,
    /// Age of the oldest committed record not yet archived (0 when none
    /// waits); none when not archived.
    #[serde(default)]
    pub archive_lag_seconds: Option<f64>,
    /// Every node holding the shard: voters, then learners and, during a
    /// replica change, the replicas leaving (see `membership`).
    pub replicas: Vec<ReplicaView>,
    /// Replicas being added (shipped to, not counted yet).
    #[serde(default)]
    pub learners: Vec<u32>,
    /// During a replica change's joint step: the voting set before it
    /// (commits need a majority of both sets); empty otherwise.
    #[serde(default)]
    pub joint_replicas: Vec<u32>,
    pub last_failover: Option<FailoverRecord>,
}

/// One replica as the coordinator sees it (from its heartbeats and, for
/// lag, its leader's).
///
/// Positions are not one snapshot of the shard: each replica's come from its
/// own newest heartbeat, and each says how old it is (`position_age_ms`,
/// `position_unix_us`). A follower shown ahead of its leader's `last_seqno`
/// is always the younger report: its `position_unix_us` is later than the
/// leader's (both are read on the nodes' clocks, so across machines clock
/// skew adds in).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct ReplicaView {
    pub node_id: u32,
    /// `voter`; `learner` (being added: receives records, counts for
    /// nothing yet); during a change's joint step, `joining` (in the new
    /// voting set only) or `leaving` (in the old one only).
    #[serde(default)]
    pub membership: String,
    /// `leader`, `follower`, `unassigned`, `down` (its node not alive: no
    /// heartbeat within its silence bound, see `NodeView::alive`) or
    /// `unknown` (never heard from).
    pub role: String,
    pub alive: bool,
    /// Milliseconds since this coordinator heard from the node (any shard).
    pub last_heartbeat_ms_ago: Option<u64>,
    /// Milliseconds since this coordinator received the heartbeat this
    /// replica's positions come from (grows while the replica is silent);
    /// none if never heard from.
    #[serde(default)]
    pub position_age_ms: Option<u64>,
    /// When the node read those positions (unix microseconds, its clock).
    #[serde(default)]
    pub position_unix_us: Option<u64>,
    pub epoch: u64,
    pub last_epoch: u64,
    pub last_seqno: u64,
    pub durable_seqno: u64,
    pub commit_seqno: u64,
    /// Records the follower lacks: the leader's durable position minus the
    /// follower's. Live (the leader's count) while the leader hears from it;
    /// otherwise counted from its last known position and `lag_stale`.
    pub lag_records: Option<u64>,
    /// Bytes it lacks; none when stale and the leader never heard from it in
    /// this leadership (unknown).
    pub lag_bytes: Option<u64>,
    /// The age of the oldest record it lacks (when its leader wrote it); 0
    /// when it lacks nothing.
    pub lag_seconds: Option<f64>,
    /// The lag is not live: the follower is down, or its leader has not
    /// heard from it in this leadership, so the figures count from its last
    /// known position, `lag_position_age_ms` old.
    #[serde(default)]
    pub lag_stale: bool,
    /// The follower position the lag counts from.
    #[serde(default)]
    pub lag_from_seqno: Option<u64>,
    /// How old that position is (milliseconds, this coordinator's clock).
    #[serde(default)]
    pub lag_position_age_ms: Option<u64>,
    /// Its last heartbeat reports its WAL disk below the free-space reserve
    /// (`wal.min_free_bytes`): it refuses appends and does not lead.
    #[serde(default)]
    pub disk_full: bool,
    /// The first seqno of its log its last heartbeat reports as corrupt
    /// (never served; a follower refetches it, a leader hands over to an
    /// intact replica); none when intact.
    #[serde(default)]
    pub corrupt_from_seqno: Option<u64>,
    /// Producer sessions (exactly-once appends) its table remembers, and
    /// the appends it answered as duplicates since it started, as its last
    /// heartbeat reports them.
    #[serde(default)]
    pub producers: u64,
    #[serde(default)]
    pub producer_duplicates: u64,
}

/// `GET /v1/shards/{id}/lag-history`: the coordinator's recent lag samples
/// of one shard's followers, oldest first (one a second, the last 15
/// minutes at most; memory is bounded).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct LagHistoryView {
    pub shard_id: u32,
    /// Milliseconds between samples.
    pub interval_ms: u64,
    /// The coordinator's clock when answering (unix ms).
    pub now_unix_ms: u64,
    pub series: Vec<LagSeries>,
}

/// One follower's lag over time.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct LagSeries {
    pub node_id: u32,
    /// A readable name: `node <id> (<grpc address>)`.
    pub name: String,
    pub samples: Vec<LagSample>,
}

/// One sample of a follower's lag (see `ReplicaView`); taken while it was
/// not the leader.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct LagSample {
    pub at_unix_ms: u64,
    pub lag_records: Option<u64>,
    pub lag_bytes: Option<u64>,
    pub lag_seconds: Option<f64>,
    pub stale: bool,
}
