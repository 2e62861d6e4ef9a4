//! The coordinator runtime (`walship coord`): holds the lease, receives
//! heartbeats, detects lost leaders, drives failovers, and keeps every
//! replica's role in line with the KV.
//!
//! Failover, exactly as DESIGN.md orders it:
//! 1. raise the shard's epoch in the KV (compare-and-set; leader unset);
//! 2. fence every replica with the new epoch; each refuses older epochs from
//!    then on and answers `(last_epoch, last_seqno)`;
//! 3. with a majority of answers (no automatic failover without one), pick
//!    the replica with the highest `(last_epoch, last_seqno)`;
//! 4. record it as leader (compare-and-set) and assign it; its stream
//!    baseline is its last seqno;
//! 5. assign the others as followers: they truncate any divergent tail
//!    against it, then catch up.
//!
//! Every KV write is a bucket-wide compare-and-set on the revision this
//! coordinator last wrote or read; a coordinator whose lease was taken over
//! fails its next write and goes back to standby without having changed
//! anything.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use parking_lot::Mutex;
use prometheus::{Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts, Registry};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;
use walship_proto::log::FenceResponse;
use walship_proto::replication::{HeartbeatBatchRequest, HeartbeatRequest};

use crate::NodeId;
use crate::config::ClusterConfig;
use crate::control::failover::{self, Candidate};
use crate::control::kv::{Kv, KvError};
use crate::control::state::{ClusterState, FailoverRecord, LeaseAction, ShardRecord, Stored, lease_action};
use crate::peers::{PeerTransport, Peers};

mod batch;
mod members;
mod promote;
mod rebalance;
mod reconcile;
mod seen;
mod write;

pub use members::{ReplicaAction, ReplicaChange, ReplicaChangeRequest, ReplicaChanges};
pub use rebalance::{RebalanceMove, RebalanceOutcome, RebalanceRequest};
use seen::NodeSeen;
pub use seen::Reports;

pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Why a coordinator operation was refused.
#[derive(Debug, thiserror::Error)]
pub enum CoordError {
    #[error("this coordinator is not the active one (standby, or its lease was taken over)")]
    NotActive,
    #[error("shard {0} does not exist")]
    UnknownShard(u32),
    #[error("node {node} holds no replica of shard {shard}")]
    NotAReplica { shard: u32, node: NodeId },
    #[error(
        "only {answered} of {replicas} replicas of shard {shard} answered the fence ({silent}): no majority, no automatic failover"
    )]
    NoMajority { shard: u32, answered: usize, replicas: usize, silent: String },
    #[error("promoting node {node} would lose acknowledged records {from}..={to}; pass allow_loss to force it")]
    WouldLose { node: NodeId, from: u64, to: u64 },
    #[error("node {0} did not answer; it cannot be promoted")]
    Unreachable(NodeId),
    #[error("a failover of shard {0} is already running")]
    Busy(u32),
    #[error(
        "the drill would write about {needs} bytes into shard {shard}, which retains {retained} of its {retain_bytes}-byte \
         retention (replication.retain_bytes): retention would then compact the shard's oldest records, yours among them. \
         Drill a shard with room, or write less (a smaller volume)"
    )]
    DrillWouldEvict { shard: u32, needs: u64, retained: u64, retain_bytes: u64 },
    /// The cluster is not in a state the request needs (a drill that
    /// needs an archive on a shard whose leader does not archive, or a
    /// follower that is the leader now); `code` names it.
    #[error("{message}")]
    Conflict { code: &'static str, message: String },
    #[error("KV: {0}")]
    Kv(#[from] KvError),
    #[error("{0}")]
    BadRequest(String),
}

/// A failover request (the admin API's body).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FailoverRequest {
    /// Replica to promote; default: the most up-to-date one.
    #[serde(default, deserialize_with = "crate::control::lenient::opt_int")]
    pub target: Option<NodeId>,
    /// Change nothing; report what each candidate would lose.
    #[serde(default)]
    pub preview: bool,
    /// Required to promote a replica that would lose acknowledged records,
    /// or to fail over without a majority.
    #[serde(default)]
    pub allow_loss: bool,
}

/// One candidate in a preview.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct CandidatePreview {
    pub node: NodeId,
    pub last_epoch: u64,
    pub last_seqno: u64,
    /// Seqnos promoting it would discard: those the most up-to-date replica
    /// holds and it does not, and those up to the highest commit known that
    /// its log does not reach (none if it holds everything).
    #[schema(value_type = Option<Vec<u64>>)]
    pub would_lose: Option<(u64, u64)>,
    /// The part of `would_lose` that may have been acknowledged: at or below
    /// the highest commit known, or held by enough replicas that, with those
    /// that did not answer, it may be on a majority.
    #[schema(value_type = Option<Vec<u64>>)]
    pub would_lose_acknowledged: Option<(u64, u64)>,
    pub is_best: bool,
}

/// What a failover did (or, for a preview, would do).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct FailoverOutcome {
    pub shard: u32,
    pub preview: bool,
    pub epoch: u64,
    pub from: Option<NodeId>,
    pub to: Option<NodeId>,
    #[schema(value_type = Option<Vec<u64>>)]
    pub lost: Option<(u64, u64)>,
    pub took_ms: u64,
    pub candidates: Vec<CandidatePreview>,
    /// Replicas that did not answer.
    pub unreachable: Vec<NodeId>,
    pub commit_seqno: u64,
}

struct Active {
    state: ClusterState,
    revision: u64,
    since: Instant,
    /// Local deadline of the lease: past it, act no more until renewed.
    lease_until: Instant,
}

#[derive(Clone)]
pub struct CoordinatorMetrics {
    active: IntGauge,
    lease_term: IntGauge,
    failovers: IntCounterVec,
    failover_seconds: Histogram,
    /// Each step of a failover (`raise`, `fence`, `choose`, `record`,
    /// `assign`), so a slow failover says where its time went.
    failover_step_seconds: HistogramVec,
    /// Shards each bulk failover took together.
    bulk_failover_shards: Histogram,
    assigns: IntCounterVec,
    replica_changes: IntCounterVec,
    /// Writes of the leadership state (each carries every change queued).
    state_writes: prometheus::IntCounter,
    /// Time between two heartbeat arrivals of each node: what its silence
    /// bound adapts to (`control/liveness.rs`).
    heartbeat_gap_seconds: HistogramVec,
    /// Shards the KV records each node as leader of (the active
    /// coordinator's view; 0 on a standby): how balanced leadership is.
    shards_led: prometheus::IntGaugeVec,
}

impl CoordinatorMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<CoordinatorMetrics> {
        let active = IntGauge::new("walship_coordinator_active", "1 while this coordinator holds the lease")?;
        let lease_term =
            IntGauge::new("walship_coordinator_lease_term", "Term of the lease this coordinator last saw")?;
        let failovers = IntCounterVec::new(
            Opts::new("walship_failovers_total", "Failovers by reason and outcome"),
            &["reason", "outcome"],
        )?;
        let failover_seconds = Histogram::with_opts(
            HistogramOpts::new("walship_failover_seconds", "Time from starting a failover to the new leader assigned")
                .buckets(prometheus::exponential_buckets(0.001, 2.0, 14)?),
        )?;
        let failover_step_seconds = HistogramVec::new(
            HistogramOpts::new(
                "walship_failover_step_seconds",
                "Time each step of a successful failover took: raise (the epoch in the KV), fence, choose, record (the leader in the KV), assign (leader and followers)",
            )
            .buckets(prometheus::exponential_buckets(0.0005, 2.0, 14)?),
            &["step"],
        )?;
        registry.register(Box::new(failover_step_seconds.clone()))?;
        let bulk_failover_shards = Histogram::with_opts(
            HistogramOpts::new("walship_bulk_failover_shards", "Shards each automatic (bulk) failover took together")
                .buckets(prometheus::exponential_buckets(1.0, 4.0, 7)?),
        )?;
        registry.register(Box::new(bulk_failover_shards.clone()))?;
        let assigns = IntCounterVec::new(
            Opts::new("walship_assignments_total", "Assign calls sent to replicas, by outcome"),
            &["outcome"],
        )?;
        registry.register(Box::new(active.clone()))?;
        registry.register(Box::new(lease_term.clone()))?;
        registry.register(Box::new(failovers.clone()))?;
        registry.register(Box::new(failover_seconds.clone()))?;
        let replica_changes = IntCounterVec::new(
            Opts::new(
                "walship_replica_changes_total",
                "Replica changes ended, by action (add, remove, replace) and outcome (done, failed)",
            ),
            &["action", "outcome"],
        )?;
        registry.register(Box::new(assigns.clone()))?;
        registry.register(Box::new(replica_changes.clone()))?;
        let state_writes = prometheus::IntCounter::new(
            "walship_coordinator_state_writes_total",
            "Compare-and-set writes of the leadership state (lease renewals included); each carries every change queued",
        )?;
        registry.register(Box::new(state_writes.clone()))?;
        let heartbeat_gap_seconds = HistogramVec::new(
            HistogramOpts::new(
                "walship_coordinator_heartbeat_gap_seconds",
                "Time between two heartbeat arrivals of a node at this coordinator, by node (one series per node); \
                 gaps past the leader timeout lengthen that node's silence bound",
            )
            .buckets(vec![0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 4.0, 8.0]),
            &["node"],
        )?;
        registry.register(Box::new(heartbeat_gap_seconds.clone()))?;
        let shards_led = prometheus::IntGaugeVec::new(
            Opts::new(
                "walship_coordinator_shards_led",
                "Shards the leadership state records each node as leader of, by node (the active coordinator's \
                 view, updated every lease round; 0 on a standby)",
            ),
            &["node"],
        )?;
        registry.register(Box::new(shards_led.clone()))?;
        crate::metrics::UndecodableMessages::register(registry)?;
        Ok(CoordinatorMetrics {
            active,
            lease_term,
            failovers,
            failover_seconds,
            failover_step_seconds,
            bulk_failover_shards,
            assigns,
            replica_changes,
            state_writes,
            heartbeat_gap_seconds,
            shards_led,
        })
    }
}

pub struct Coordinator {
    pub id: String,
    pub config: Arc<ClusterConfig>,
    kv: Arc<dyn Kv>,
    pub peers: Peers,
    active: Mutex<Option<Active>>,
    seen: Mutex<BTreeMap<NodeId, NodeSeen>>,
    shard_locks: BTreeMap<u32, tokio::sync::Mutex<()>>,
    assigned: Mutex<BTreeMap<(NodeId, u32), Instant>>,
    pub metrics: CoordinatorMetrics,
    pub shutdown: CancellationToken,
    lease_ms: u64,
    /// Serialises this coordinator's own KV writes (lease renewals and
    /// state changes), so a compare-and-set conflict can only mean another
    /// coordinator wrote.
    write: tokio::sync::Mutex<()>,
    /// Changes applied and waiting for the next batched write (`write.rs`).
    queued: Mutex<write::Queued>,
    /// Drill reports (in memory; a coordinator restart forgets them).
    pub drills: crate::control::drills::Drills,
    /// In NATS mode, heartbeats are republished on `walship.heartbeats.<node>.<shard>`.
    heartbeat_sink: Mutex<Option<tokio::sync::mpsc::Sender<(String, Bytes)>>>,
    /// Shards whose automatic failover found no majority: not retried before
    /// this instant (each attempt raises the epoch).
    retry_after: Mutex<BTreeMap<u32, Instant>>,
    /// When this coordinator started (see [`START_GRACE`]).
    started: Instant,
    /// Shards whose "waiting for replicas to start" line was logged once.
    waiting_logged: Mutex<std::collections::BTreeSet<u32>>,
    /// Fetch tokens minted for replica-change tasks, sent with every
    /// assignment of that replica while the task runs.
    pub(crate) fetch_tokens: Mutex<BTreeMap<(u32, NodeId), String>>,
    /// Mints a PeerExchange fetch token for `(task, shard)` (installed by
    /// the binary, which holds the token key; none: nodes sign their own).
    token_minter: std::sync::OnceLock<TokenMinter>,
    /// Replica changes (`POST /v1/shards/{id}/replicas`), in memory.
    pub changes: ReplicaChanges,
    /// What the next reconcile round looks at (see `reconcile.rs`).
    pub(crate) pending: Mutex<reconcile::Pending>,
    /// Shards whose automatic failover is queued or running.
    failing_over: Mutex<std::collections::BTreeSet<u32>>,
    /// Shards found lost, queued for the next bulk failover.
    lost: Mutex<Vec<promote::Lost>>,
    /// Bulk failovers running at once (see
    /// `reconcile::BULK_FAILOVERS_AT_ONCE`).
    failover_slots: Arc<tokio::sync::Semaphore>,
    /// Fence and Assign calls, coalesced per node (`batch.rs`).
    fences: batch::Lanes<walship_proto::log::FenceRequest>,
    assigns: batch::Lanes<walship_proto::log::AssignRequest>,
    /// Replicas (node, shard) the reconcile loop is assigning now.
    assigning: Mutex<std::collections::BTreeSet<(NodeId, u32)>>,
    /// Reconcile assignments in flight at once (`reconcile::ASSIGNMENTS_AT_ONCE`).
    assign_slots: tokio::sync::Semaphore,
    /// When each shard's leader was told it leads, and in which epoch: its
    /// followers' silence counts from then (`control/liveness.rs`).
    leader_told: Mutex<std::collections::HashMap<u32, (u64, Instant)>>,
    /// Held by the one rebalance running (`rebalance.rs`).
    rebalancing: tokio::sync::Mutex<()>,
}

/// Mints a PeerExchange fetch token: `(task id, shard, time to live)`.
pub type TokenMinter = Box<dyn Fn(&str, u32, Duration) -> String + Send + Sync>;

/// A failover that finds no majority of a shard's replicas is worth a WARN
/// when a replica this coordinator had heard from went silent, or once the
/// coordinator has run this long. Before that, replicas it never heard from
/// are taken to be still starting (a cluster whose coordinator comes up
/// before its nodes), and the refusal is logged once at INFO, then at DEBUG.
pub const START_GRACE: Duration = Duration::from_secs(60);

/// How long an automatic failover that found no majority waits to retry.
const NO_MAJORITY_BACKOFF: Duration = Duration::from_secs(1);
/// After a failover away from a disk-full leader, the next one waits this
/// long: if no healthy replica could take over, the disk-full one was
/// promoted again, and retrying at once would only churn epochs.
const DISK_FULL_BACKOFF: Duration = Duration::from_secs(2);

/// The most heartbeats one batch may carry.
pub const MAX_HEARTBEAT_BATCH: usize = 20_000;

/// Checks a heartbeat batch whole: a known node (`known`), every entry its
/// own, at most [`MAX_HEARTBEAT_BATCH`] of them.
pub fn check_heartbeat_batch(
    batch: &HeartbeatBatchRequest,
    known: impl Fn(NodeId) -> bool,
) -> Result<(), tonic::Status> {
    if batch.node_id == 0 || !known(batch.node_id) {
        return Err(tonic::Status::invalid_argument(format!("heartbeat batch from unknown node {}", batch.node_id)));
    }
    if batch.shards.len() > MAX_HEARTBEAT_BATCH {
        return Err(tonic::Status::invalid_argument(format!(
            "a heartbeat batch holds at most {MAX_HEARTBEAT_BATCH} shards, not {}",
            batch.shards.len()
        )));
    }
    if let Some(other) = batch.shards.iter().find(|s| s.node_id != batch.node_id) {
        return Err(tonic::Status::invalid_argument(format!(
            "node {}'s heartbeat batch holds a report of node {}",
            batch.node_id, other.node_id
        )));
    }
    Ok(())
}

/// A fence answer as a failover candidate.
fn candidate(a: &FenceResponse) -> Candidate {
    Candidate {
        node: a.node_id,
        last_epoch: a.last_epoch,
        last_seqno: a.last_seqno,
        commit_seqno: a.commit_seqno,
        disk_full: a.disk_full,
        corrupt_from: (a.corrupt_from_seqno > 0).then_some(a.corrupt_from_seqno),
        replaced: false,
    }
}

/// What the active coordinator publishes on NATS for every heartbeat.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct HeartbeatMessage {
    pub node_id: NodeId,
    pub shard_id: u32,
    pub region_id: u32,
    pub epoch: u64,
    pub is_leader: bool,
    pub leader_node_id: NodeId,
    pub last_epoch: u64,
    pub last_seqno: u64,
    pub durable_seqno: u64,
    pub commit_seqno: u64,
    pub entity_count: u64,
    pub signal_throughput_eps: f64,
    pub disk_bytes: u64,
    pub replication_lag: BTreeMap<u32, u64>,
    pub last_heartbeat_ns: u64,
}

impl Coordinator {
    pub fn start(
        id: String,
        config: Arc<ClusterConfig>,
        kv: Arc<dyn Kv>,
        metrics: CoordinatorMetrics,
        transport: PeerTransport,
    ) -> Arc<Coordinator> {
        let lease_ms = config.replication.coordinator_lease_ms;
        let coordinator = Arc::new(Coordinator {
            id,
            peers: Peers::new(&config, &transport),
            shard_locks: config.shards.iter().map(|s| (s.id, tokio::sync::Mutex::new(()))).collect(),
            config,
            kv,
            active: Mutex::new(None),
            seen: Mutex::new(BTreeMap::new()),
            assigned: Mutex::new(BTreeMap::new()),
            metrics,
            shutdown: CancellationToken::new(),
            lease_ms,
            write: tokio::sync::Mutex::new(()),
            queued: Mutex::default(),
            drills: Default::default(),
            heartbeat_sink: Mutex::new(None),
            retry_after: Mutex::new(BTreeMap::new()),
            pending: Mutex::default(),
            failing_over: Mutex::default(),
            lost: Mutex::default(),
            failover_slots: Arc::new(tokio::sync::Semaphore::new(reconcile::BULK_FAILOVERS_AT_ONCE)),
            assigning: Mutex::default(),
            assign_slots: tokio::sync::Semaphore::new(reconcile::ASSIGNMENTS_AT_ONCE),
            leader_told: Mutex::default(),
            started: Instant::now(),
            waiting_logged: Mutex::new(Default::default()),
            fetch_tokens: Default::default(),
            fences: Default::default(),
            assigns: Default::default(),
            token_minter: Default::default(),
            changes: Default::default(),
            rebalancing: Default::default(),
        });
        tokio::spawn(coordinator.clone().run_lease());
        tokio::spawn(coordinator.clone().run_reconcile());
        tokio::spawn(coordinator.clone().run_rebalance());
        coordinator
    }

    /// Publishes every heartbeat this coordinator receives while active on
    /// NATS (`walship.heartbeats.<node>.<shard>`, JSON). A slow NATS drops
    /// messages rather than delaying heartbeat handling.
    pub fn publish_heartbeats(&self, client: async_nats::Client) {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<(String, Bytes)>(4096);
        tokio::spawn(async move {
            while let Some((subject, payload)) = rx.recv().await {
                if let Err(e) = client.publish(subject, payload).await {
                    tracing::debug!(error = %e, "publishing a heartbeat on NATS");
                }
            }
        });
        *self.heartbeat_sink.lock() = Some(tx);
    }

    pub fn kv_description(&self) -> String {
        self.kv.describe()
    }

    /// The state as this coordinator last wrote or read it, if active: a
    /// copy of every shard's record, costly with many shards (see
    /// [`Coordinator::shard_record`] for one).
    pub fn state(&self) -> Option<ClusterState> {
        self.active.lock().as_ref().map(|a| a.state.clone())
    }

    /// One shard's leadership record, as written.
    pub fn shard_record(&self, shard: u32) -> Result<Arc<ShardRecord>, CoordError> {
        let active = self.active.lock();
        let a = active.as_ref().ok_or(CoordError::NotActive)?;
        a.state.shards.get(&shard).cloned().ok_or(CoordError::UnknownShard(shard))
    }

    /// How many shards each node leads, as recorded (none while not active).
    fn leads_now(&self) -> BTreeMap<NodeId, usize> {
        self.active.lock().as_ref().map(|a| crate::control::state::leads(&a.state.shards)).unwrap_or_default()
    }

    pub fn is_active(&self) -> bool {
        self.active.lock().as_ref().is_some_and(|a| Instant::now() < a.lease_until)
    }

    /// Reads the state from the KV (what a standby shows).
    pub async fn read_state(&self) -> Result<Option<ClusterState>, CoordError> {
        let snapshot = self.kv.scan().await?;
        match Stored::decode(&snapshot.entries).map_err(|e| CoordError::Kv(KvError::Unavailable(e)))? {
            Stored::Empty => Ok(None),
            Stored::Legacy(state) | Stored::Current(state) => Ok(Some(state)),
        }
    }

    /// Records a heartbeat.
    pub fn on_heartbeat(&self, request: &HeartbeatRequest) -> Result<(), tonic::Status> {
        if let Some(refusal) = crate::replica::reporting_node_refusal(request.node_id, &self.config) {
            return Err(tonic::Status::invalid_argument(refusal));
        }
        let timeout = Duration::from_millis(self.config.replication.leader_timeout_ms);
        let mut seen = self.seen.lock();
        let now = Instant::now();
        let node = seen.entry(request.node_id).or_insert_with(|| NodeSeen::first(now));
        let (back, dropped) =
            node.heard(request.node_id, request.uptime_ms, now, timeout, &self.metrics.heartbeat_gap_seconds);
        node.shards.insert(request.shard_id, (Arc::new(request.clone()), now));
        drop(seen);
        let mut pending = self.pending.lock();
        pending.shards.extend(dropped.into_iter().flatten());
        pending.shards.insert(request.shard_id);
        if back {
            pending.force_full();
        }
        drop(pending);
        self.republish(std::slice::from_ref(request));
        Ok(())
    }

    /// Records one node's batch of heartbeats: the shards in it as sent,
    /// the node's other shards as unchanged as of now (and, for a `full`
    /// batch, no longer hosted). Checked whole first: INVALID_ARGUMENT
    /// applies nothing.
    pub fn on_heartbeat_batch(&self, batch: HeartbeatBatchRequest) -> Result<(), tonic::Status> {
        check_heartbeat_batch(&batch, |n| self.config.node(n).is_some())?;
        self.republish(&batch.shards);
        let node_id = batch.node_id;
        let now = Instant::now();
        let timeout = Duration::from_millis(self.config.replication.leader_timeout_ms);
        let (changed, back) = {
            let mut seen = self.seen.lock();
            let node = seen.entry(node_id).or_insert_with(|| NodeSeen::first(now));
            let uptime = batch.shards.iter().map(|s| s.uptime_ms).max().unwrap_or(0);
            let (back, dropped) = node.heard(node_id, uptime, now, timeout, &self.metrics.heartbeat_gap_seconds);
            node.refreshed = Some(now);
            let silence_ms = self.config.replication.replication_timeout().as_millis() as u64;
            let mut changed = node.take_reports(batch, now, silence_ms);
            changed.extend(dropped.into_iter().flatten());
            (changed, back)
        };
        if back {
            self.pending.lock().force_full();
        }
        // A full batch repeats every report every few seconds: the
        // reconcile loop looks again only at the shards whose report
        // changed (or that the node stopped reporting). At 10,000 shards,
        // looking at every repeated report cost the coordinator about a
        // tenth of a core while nothing happened.
        self.pending.lock().shards.extend(changed);
        Ok(())
    }

    /// In NATS mode, republishes heartbeats (active coordinator only).
    fn republish(&self, requests: &[HeartbeatRequest]) {
        let sink = self.heartbeat_sink.lock();
        let Some(sink) = sink.as_ref().filter(|_| self.is_active()) else { return };
        for request in requests {
            let message = HeartbeatMessage {
                node_id: request.node_id,
                shard_id: request.shard_id,
                region_id: request.region_id,
                epoch: request.epoch,
                is_leader: request.is_leader,
                leader_node_id: request.leader_node_id,
                last_epoch: request.last_epoch,
                last_seqno: request.last_seqno,
                durable_seqno: request.durable_seqno,
                commit_seqno: request.commit_seqno,
                entity_count: request.entity_count,
                signal_throughput_eps: request.signal_throughput_eps,
                disk_bytes: request.disk_bytes,
                replication_lag: request.replication_lag.iter().map(|(&k, &v)| (k, v)).collect(),
                last_heartbeat_ns: request.last_heartbeat_ns,
            };
            let subject = format!("walship.heartbeats.{}.{}", request.node_id, request.shard_id);
            let _ = sink.try_send((subject, Bytes::from(serde_json::to_vec(&message).expect("serialisable"))));
        }
    }

    /// Milliseconds since a node's last heartbeat.
    pub fn last_seen_ms(&self, node: NodeId) -> Option<u64> {
        self.seen.lock().get(&node).map(|n| n.at.elapsed().as_millis() as u64)
    }

    /// Whether `node` is alive as this coordinator acts on it: heard within
    /// its silence bound, the leader timeout or longer while its heartbeats
    /// have lately come late (`liveness::Arrivals`), the same bound past
    /// which its leaders count as lost. What the admin API shows as alive:
    /// judged by the leader timeout alone, a surviving node whose heartbeat
    /// came 210 ms after the one before, on two cores failing over 3,334
    /// shards, showed every shard it led as without a working leader while
    /// it led them and nothing failed them over.
    /// Holding [`Coordinator::reports`], ask [`Reports::alive`] instead
    /// (this takes the same lock).
    pub fn node_alive(&self, node: NodeId) -> bool {
        let timeout = Duration::from_millis(self.config.replication.leader_timeout_ms);
        self.reports().alive(node, timeout)
    }

    /// The newest heartbeat of a replica.
    pub fn heartbeat(&self, node: NodeId, shard: u32) -> Option<Arc<HeartbeatRequest>> {
        self.reports().heartbeat(node, shard)
    }

    /// The newest epoch `shard`'s `replicas` reported holding, when it is
    /// past `recorded`, the epoch the KV records: the KV lost writes it
    /// acknowledged (restored from an older copy, say) and handed out
    /// again epochs the replicas promised, whose fences they refuse. An
    /// epoch at or past [`crate::core::Epoch::CEILING`] is no honest report (replicas
    /// refuse it) and is ignored: adopting it would leave no epoch to raise
    /// to.
    pub fn epoch_ahead_of(&self, shard: u32, replicas: &[NodeId], recorded: u64) -> Option<u64> {
        let reports = self.reports();
        replicas
            .iter()
            .filter_map(|&r| reports.heartbeat(r, shard).map(|hb| hb.epoch))
            .filter(|&e| e > recorded && e < crate::core::Epoch::CEILING)
            .max()
    }

    /// The newest heartbeat of a replica, with milliseconds since it arrived.
    pub fn heartbeat_aged(&self, node: NodeId, shard: u32) -> Option<(Arc<HeartbeatRequest>, u64)> {
        self.reports().heartbeat_aged(node, shard)
    }

    /// Every replica's newest heartbeat, for a pass over many shards: one
    /// lock for the pass instead of one per look-up (heartbeats wait for
    /// it: hold it for a pass, not across an await).
    pub fn reports(&self) -> Reports<'_> {
        Reports(self.seen.lock())
    }

    fn step_down(&self) {
        *self.active.lock() = None;
        self.metrics.active.set(0);
    }

    async fn run_lease(self: Arc<Self>) {
        let mut tick = tokio::time::interval(Duration::from_millis((self.lease_ms / 4).max(10)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = self.shutdown.cancelled() => return,
            }
            if let Err(e) = self.lease_round().await {
                tracing::warn!(id = %self.id, error = %e, "lease round");
            }
            self.publish_leads();
        }
    }

    /// `walship_coordinator_shards_led`: every configured node's count,
    /// zeros while this coordinator is not the active one.
    fn publish_leads(&self) {
        let leads = if self.is_active() { self.leads_now() } else { BTreeMap::new() };
        for node in &self.config.nodes {
            let led = leads.get(&node.id).copied().unwrap_or(0);
            self.metrics.shards_led.with_label_values(&[&node.id.to_string()]).set(led as i64);
        }
    }

    /// The lease alone was renewed (written at `revision`): the state
    /// written before stands.
    fn renewed(&self, lease: crate::control::state::Lease, revision: u64, lease_until: Instant) {
        let mut active = self.active.lock();
        let Some(a) = active.as_mut() else { return };
        self.metrics.lease_term.set(lease.term as i64);
        a.state.lease = lease;
        a.revision = revision;
        a.lease_until = lease_until;
    }

    fn become_active(&self, state: ClusterState, revision: u64, lease_until: Instant) {
        let mut active = self.active.lock();
        let since = active.as_ref().map_or_else(Instant::now, |a| a.since);
        if active.is_none() {
            tracing::info!(id = %self.id, term = state.lease.term, "active coordinator");
            self.pending.lock().force_full();
        } else if active.as_ref().is_some_and(|a| a.state.shards != state.shards) {
            // The state moved under this lease (re-read): look at all of it.
            self.pending.lock().force_full();
        }
        self.metrics.active.set(1);
        self.metrics.lease_term.set(state.lease.term as i64);
        *active = Some(Active { state, revision, since, lease_until });
    }
}
