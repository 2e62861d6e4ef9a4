//! The async shell around the replication core: one [`ReplicationNode`] per
//! process, one [`ShardReplica`] per shard it hosts.
//!
//! Leader side, per shard: a driver folds the WAL's durable watch (and,
//! under a coordinator, its written watch) into the [`LeaderCore`] and
//! publishes the commit position; one shipper task per follower asks the
//! core what to send and keeps up to `ship_window` `ShipSegment`s in flight;
//! a retention task compacts what nobody needs.
//!
//! Follower side, per shard: inbound segments (pushed or streamed) pass the
//! envelope check and [`classify`], then are queued to the WAL under a
//! per-shard ordering lock that is held only until they are queued, so many
//! small ships share one group commit. A gap, a boot or a leader's nudge
//! starts one catch-up stream (`StreamSegments`) at a time.
//!
//! Only durable records are ever served, and a follower's `applied_seqno`
//! is its durable frontier; reads on any replica stop at the commit position
//! it knows. Shipping differs by mode. A static cluster's leader ships
//! durable records only. Under a coordinator the leader ships each batch as
//! soon as its WAL has *written* it, while its own fsync runs ("early
//! shipping", `shipping/EARLY-SHIPPING.md`): one fsync less on every
//! acknowledgement. The commit still waits for the leader's own durable
//! copy. The hazard is a machine crash: followers may then hold records the
//! leader lost. It is closed by one rule: a replica never leads in the epoch
//! it restarted in. It refuses such an Assign and reports `needs_new_epoch`
//! in its heartbeats, and the coordinator fails over to a new epoch instead
//! (EpochEnd repair then settles any difference).
//!
//! Leadership is dynamic: `fence` raises a replica's promised epoch (durably;
//! it refuses everything older from then on and stops leading), `assign`
//! makes it the leader of an epoch or a follower of one. A follower repairs
//! its log against a new leader before applying anything from it: it asks
//! where its last record's epoch ends in the leader's log (`EpochEnd`) and
//! truncates the divergent tail, like Kafka's leader-epoch truncation. Role
//! changes are serialised per shard.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::Status;
use tonic::metadata::MetadataValue;
use walship_proto::log::{AssignResponse, EpochEndRequest, FenceResponse};
use walship_proto::replication::{
    HeartbeatRequest, ShipSegmentRequest, ShipSegmentResponse, StreamRequest, WalSegmentId,
};
use walship_wal::{Segment, ShardId, Wal, WalError};

use crate::NodeId;
use crate::config::{ClusterConfig, ShardSpec};
use crate::core::follower::{FollowerView, Inbound, InboundSegment, check_envelope, classify};
use crate::core::leader::{FollowerProgress, Lag, LeaderCore, LeaderSettings, LeaderStart, ShipDecision, ShipReply};
use crate::limiter::RateLimiter;
use crate::metrics::ReplicationMetrics;
use crate::peers::Peers;

/// A segment queued to the WAL, resolving when it is durable.
type Queued =
    std::pin::Pin<Box<dyn std::future::Future<Output = walship_wal::wal::WalResult<walship_wal::Appended>> + Send>>;

/// Waits for a change of `watch` (false once its sender is gone); never
/// resolves without a watch.
async fn changed_if_watched(watch: Option<&mut watch::Receiver<u64>>) -> bool {
    match watch {
        Some(w) => w.changed().await.is_ok(),
        None => std::future::pending().await,
    }
}

/// Catch-up chunks queued to the WAL before the oldest must be durable.
const CATCHUP_PIPELINE: usize = 4;

/// Response metadata: the newest epoch a refusing replica has seen.
pub const EPOCH_METADATA_KEY: &str = "walship-epoch";
/// Response metadata: a follower's durable frontier on a gap refusal.
pub const APPLIED_METADATA_KEY: &str = "walship-applied-seqno";

pub fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as u64).unwrap_or(0)
}

/// A replica's role in its shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Leader,
    Follower {
        leader: NodeId,
    },
    /// Fenced, or restarted under a coordinator: waits for an assignment.
    Unassigned,
}

/// A replica's role and the epoch it holds it in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct View {
    pub role: Role,
    pub epoch: u64,
}

/// Where an inbound segment came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Push,
    Stream,
}

impl Source {
    fn as_str(self) -> &'static str {
        match self {
            Source::Push => "push",
            Source::Stream => "stream",
        }
    }
}

struct LeaderState {
    epoch: u64,
    core: Mutex<LeaderCore>,
    /// What the WAL is committing (the core's `flushing`; its durable
    /// position without early shipping): shippers with segments in flight
    /// wait on it.
    ship_limit: watch::Sender<u64>,
    /// Stops this leadership's tasks.
    stop: CancellationToken,
}

struct FollowerState {
    /// Serialises queueing to the WAL so frames enter it in seqno order.
    apply_lock: tokio::sync::Mutex<()>,
    /// One past everything applied or queued.
    next_expected: watch::Sender<u64>,
    /// The epoch whose leader this log has been reconciled with.
    repaired_epoch: AtomicU64,
    /// The newest commit position a leader told us.
    leader_commit: AtomicU64,
    catchup_running: AtomicBool,
    last_contact_us: AtomicU64,
}

/// One shard's replica on this node.
pub struct ShardReplica {
    pub shard: ShardId,
    pub replicas: Vec<NodeId>,
    view: parking_lot::RwLock<View>,
    /// The newest epoch promised (durable in the WAL); mirrors `Wal::epoch`.
    epoch_seen: AtomicU64,
    /// What reads may return through: the commit position (leader) or
    /// `min(durable, leader's commit)` (follower).
    readable: watch::Sender<u64>,
    /// Highest seqno durable on every replica (leader only).
    all_durable: watch::Sender<u64>,
    /// Bumped whenever this replica stops leading: appends waiting for a
    /// commit under the old leadership give up (their outcome is unknown).
    generation: watch::Sender<u64>,
    /// Until when (µs) the leader lease holds ([`LeaderCore::lease_until`];
    /// `u64::MAX` without a bound, 0 while not leading).
    lease_until: watch::Sender<u64>,
    leader: Mutex<Option<Arc<LeaderState>>>,
    follower: FollowerState,
    /// Drills: a paused follower refuses ships and does not catch up.
    paused: AtomicBool,
    /// The epoch this replica had promised when the process started. Under
    /// a coordinator it never leads in it: before the restart it may have
    /// led that epoch and shipped records its own disk then lost (early
    /// shipping; a machine crash). Leading again in the same epoch would
    /// write different records at seqnos the followers already hold, and
    /// they would keep theirs. A new epoch makes EpochEnd repair settle it.
    restarted_in: u64,
    /// Serialises role changes.
    transition: tokio::sync::Mutex<()>,
}

/// A follower as the leader sees it, for status pages.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct FollowerStatus {
    pub node_id: NodeId,
    pub mode: String,
    pub acked_seqno: u64,
    pub in_flight: usize,
    pub lag_records: u64,
    pub lag_bytes: u64,
    pub lag_write_seconds: f64,
    pub lag_flush_seconds: f64,
    pub lag_apply_seconds: f64,
    /// Milliseconds since the follower last answered; none if never.
    pub last_reply_ms_ago: Option<u64>,
}

/// One shard replica's state, for `/v1/status`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct ReplicaStatus {
    pub shard_id: u32,
    /// `leader`, `follower` or `unassigned` (fenced, awaiting the
    /// coordinator).
    pub role: String,
    /// The epoch of the replica's current role.
    pub epoch: u64,
    /// The newest epoch it has promised to (refuses anything older).
    pub epoch_seen: u64,
    /// None while unassigned.
    pub leader: Option<NodeId>,
    pub replicas: Vec<NodeId>,
    pub first_seqno: u64,
    pub last_seqno: u64,
    pub durable_seqno: u64,
    /// Leader: durable on a majority. Follower: the newest commit position
    /// its leader reported.
    pub commit_seqno: u64,
    /// Leader only.
    pub followers: Vec<FollowerStatus>,
}

/// A heartbeat this node received, for status pages.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct ReceivedHeartbeat {
    pub node_id: NodeId,
    pub shard_id: u32,
    pub epoch: u64,
    pub last_seqno: u64,
    pub durable_seqno: u64,
    pub commit_seqno: u64,
    pub entity_count: u64,
    pub replication_lag: BTreeMap<u32, u64>,
    pub received_ms_ago: u64,
}

impl ShardReplica {
    fn new(spec: &ShardSpec, wal: &Wal) -> Result<ShardReplica, Status> {
        let positions = wal.positions(spec.id).map_err(|e| Status::internal(e.to_string()))?;
        let promised = wal.epoch(spec.id).map_err(|e| Status::internal(e.to_string()))?;
        Ok(ShardReplica {
            shard: spec.id,
            replicas: spec.replicas.clone(),
            view: parking_lot::RwLock::new(View { role: Role::Unassigned, epoch: promised }),
            epoch_seen: AtomicU64::new(promised),
            readable: watch::Sender::new(0),
            all_durable: watch::Sender::new(0),
            generation: watch::Sender::new(0),
            lease_until: watch::Sender::new(0),
            leader: Mutex::new(None),
            follower: FollowerState {
                apply_lock: tokio::sync::Mutex::new(()),
                next_expected: watch::Sender::new(positions.last_seqno + 1),
                repaired_epoch: AtomicU64::new(0),
                leader_commit: AtomicU64::new(0),
                catchup_running: AtomicBool::new(false),
                last_contact_us: AtomicU64::new(0),
            },
            paused: AtomicBool::new(false),
            restarted_in: promised,
            transition: tokio::sync::Mutex::new(()),
        })
    }

    pub fn view(&self) -> View {
        *self.view.read()
    }

    /// Under a coordinator: whether this replica still waits for an epoch
    /// newer than the one it restarted in before it may lead (see
    /// `restarted_in`). Reported in heartbeats so the coordinator raises the
    /// epoch instead of re-assigning it.
    pub fn needs_new_epoch(&self) -> bool {
        self.restarted_in > 0 && self.epoch_seen() == self.restarted_in
    }

    pub fn is_leader(&self) -> bool {
        self.view().role == Role::Leader
    }

    pub fn epoch_seen(&self) -> u64 {
        self.epoch_seen.load(Ordering::Acquire)
    }

    /// The leader as this replica knows it.
    pub fn leader_id(&self, me: NodeId) -> Option<NodeId> {
        match self.view().role {
            Role::Leader => Some(me),
            Role::Follower { leader } => Some(leader),
            Role::Unassigned => None,
        }
    }

    fn leader_state(&self) -> Option<Arc<LeaderState>> {
        self.leader.lock().clone()
    }

    /// What reads may return through.
    pub fn readable(&self) -> u64 {
        *self.readable.borrow()
    }

    pub fn readable_watch(&self) -> watch::Receiver<u64> {
        self.readable.subscribe()
    }

    /// Waits until `seqno` is durable on a majority. False if this replica
    /// stopped leading first: the append's outcome is then unknown.
    /// Cancellation-safe.
    pub async fn wait_commit(&self, seqno: u64) -> bool {
        self.wait_or_stepped_down(&self.readable, seqno).await
    }

    /// Waits until `seqno` is durable on every replica; false as
    /// [`ShardReplica::wait_commit`]. Cancellation-safe.
    pub async fn wait_all(&self, seqno: u64) -> bool {
        self.wait_or_stepped_down(&self.all_durable, seqno).await
    }

    /// Waits, up to `patience`, until the leader lease holds (see
    /// [`LeaderCore::lease_until`]): an idle leader's first append waits for
    /// the reply to its own shipment. False if it does not, or this replica
    /// stopped leading: the append's outcome is then unknown.
    /// Cancellation-safe.
    pub async fn wait_lease(&self, patience: Duration) -> bool {
        let mut generation = self.generation.subscribe();
        let current = *generation.borrow_and_update();
        if !self.is_leader() {
            return false;
        }
        let mut lease = self.lease_until.subscribe();
        let renewed = tokio::time::timeout(patience, lease.wait_for(|until| now_us() < *until));
        tokio::select! {
            renewed = renewed => matches!(renewed, Ok(Ok(_))),
            _ = generation.wait_for(|g| *g != current) => false,
        }
    }

    async fn wait_or_stepped_down(&self, position: &watch::Sender<u64>, seqno: u64) -> bool {
        let mut generation = self.generation.subscribe();
        let current = *generation.borrow_and_update();
        if !self.is_leader() {
            return false;
        }
        let mut rx = position.subscribe();
        tokio::select! {
            reached = rx.wait_for(|c| *c >= seqno) => reached.is_ok(),
            _ = generation.wait_for(|g| *g != current) => false,
        }
    }

    fn publish_leader(&self, core: &LeaderCore, metrics: &ReplicationMetrics) {
        let commit = core.commit();
        self.readable.send_if_modified(|r| {
            let changed = commit > *r;
            if changed {
                *r = commit;
            }
            changed
        });
        let all = core.all_durable();
        self.all_durable.send_if_modified(|a| std::mem::replace(a, all) != all);
        let lease = core.lease_until().unwrap_or(u64::MAX);
        self.lease_until.send_if_modified(|l| std::mem::replace(l, lease) != lease);
        metrics.set_commit(self.shard, commit);
    }

    fn publish_follower(&self, durable: u64) {
        let readable = durable.min(self.follower.leader_commit.load(Ordering::Acquire));
        self.readable.send_if_modified(|r| {
            let changed = readable > *r;
            if changed {
                *r = readable;
            }
            changed
        });
    }
}

/// Replication runtime of one node.
pub struct ReplicationNode {
    pub me: NodeId,
    pub region: u32,
    pub config: Arc<ClusterConfig>,
    pub wal: Wal,
    pub peers: Peers,
    pub metrics: ReplicationMetrics,
    replicas: BTreeMap<ShardId, Arc<ShardReplica>>,
    catchup_budget: RateLimiter,
    settings: LeaderSettings,
    allow_crash_drills: bool,
    heartbeats: Mutex<BTreeMap<(NodeId, u32), (ReceivedHeartbeat, Instant)>>,
    disk_bytes: Box<dyn Fn() -> u64 + Send + Sync>,
    pub shutdown: CancellationToken,
    /// One `ShipSegments` stream per follower node, opened by the first push
    /// (see [`run_ship_stream`]).
    ship_streams: Mutex<BTreeMap<NodeId, tokio::sync::mpsc::Sender<ShipCall>>>,
}

type ShipCall = (ShipSegmentRequest, tokio::sync::oneshot::Sender<Result<ShipSegmentResponse, Status>>);

/// Carries one follower node's `ShipSegment` pushes over one `ShipSegments`
/// stream, each answered in order by the call that sent it, and reopens the
/// stream on the next push after it ends (the follower restarted, or refused
/// a segment: a refusal ends the stream and answers the push it refused,
/// later pushes in flight fail and are shipped again).
///
/// A peer without `ShipSegments` (an older node) answers `UNIMPLEMENTED`;
/// from then on each push is a unary `ShipSegment`, as before the stream.
async fn run_ship_stream(
    mut client: walship_proto::replication::wal_shipping_client::WalShippingClient<tonic::transport::Channel>,
    mut calls: tokio::sync::mpsc::Receiver<ShipCall>,
) {
    use std::collections::VecDeque;
    loop {
        let Some((first, reply)) = calls.recv().await else { return };
        let (req_tx, req_rx) = tokio::sync::mpsc::channel(SHIP_STREAM_DEPTH);
        let mut answers = match client.ship_segments(tokio_stream::wrappers::ReceiverStream::new(req_rx)).await {
            Ok(r) => r.into_inner(),
            Err(status) if status.code() == tonic::Code::Unimplemented => {
                tracing::info!(%status, "peer has no ShipSegments stream; shipping with unary ShipSegment");
                return ship_unary(client, (first, reply), calls).await;
            }
            Err(status) => {
                let _ = reply.send(Err(status));
                continue;
            }
        };
        let mut pending = VecDeque::new();
        if req_tx.send(first).await.is_ok() {
            pending.push_back(reply);
        }
        let end = loop {
            tokio::select! {
                call = calls.recv() => match call {
                    Some((request, reply)) => {
                        if req_tx.send(request).await.is_err() {
                            let _ = reply.send(Err(Status::unavailable("the ShipSegments stream closed")));
                            break Status::unavailable("the ShipSegments stream closed");
                        }
                        pending.push_back(reply);
                    }
                    None => return,
                },
                answer = answers.message() => match answer {
                    Ok(Some(response)) => {
                        if let Some(reply) = pending.pop_front() {
                            let _ = reply.send(Ok(response));
                        }
                    }
                    Ok(None) => break Status::unavailable("the ShipSegments stream ended"),
                    Err(status) => {
                        // Answers come in order: the refusal is the oldest push's.
                        if let Some(reply) = pending.pop_front() {
                            let _ = reply.send(Err(status.clone()));
                        }
                        break Status::unavailable(format!("the ShipSegments stream ended: {}", status.message()));
                    }
                },
            }
        };
        for reply in pending.drain(..) {
            let _ = reply.send(Err(end.clone()));
        }
    }
}

/// Pushes in flight on one `ShipSegments` stream, at most; more wait.
const SHIP_STREAM_DEPTH: usize = 256;

/// Unary `ShipSegment` for every push, for a peer without `ShipSegments`.
async fn ship_unary(
    client: walship_proto::replication::wal_shipping_client::WalShippingClient<tonic::transport::Channel>,
    first: ShipCall,
    mut calls: tokio::sync::mpsc::Receiver<ShipCall>,
) {
    let mut next = Some(first);
    while let Some((request, reply)) = match next.take() {
        Some(call) => Some(call),
        None => calls.recv().await,
    } {
        let mut client = client.clone();
        tokio::spawn(async move {
            let _ = reply.send(client.ship_segment(request).await.map(tonic::Response::into_inner));
        });
    }
}

fn refusal(metrics: &ReplicationMetrics, reason: &str, status: Status) -> Status {
    metrics.ship_refused.with_label_values(&[reason]).inc();
    status
}

fn with_metadata(mut status: Status, key: &'static str, value: u64) -> Status {
    if let Ok(v) = MetadataValue::try_from(value.to_string()) {
        status.metadata_mut().insert(key, v);
    }
    status
}

fn metadata_u64(status: &Status, key: &str) -> Option<u64> {
    status.metadata().get(key)?.to_str().ok()?.parse().ok()
}

impl ReplicationNode {
    /// Builds the replicas this node hosts (creating their WAL shards) and
    /// starts every background task. `disk_bytes` reports the WAL's size.
    /// In a static cluster each replica takes its role from the config; under
    /// a coordinator it waits, unassigned, for the coordinator's word.
    pub async fn start(
        me: NodeId,
        config: Arc<ClusterConfig>,
        wal: Wal,
        metrics: ReplicationMetrics,
        disk_bytes: Box<dyn Fn() -> u64 + Send + Sync>,
        allow_crash_drills: bool,
    ) -> Result<Arc<ReplicationNode>, Status> {
        let node_spec = config
            .node(me)
            .ok_or_else(|| Status::invalid_argument(format!("node {me} is not in the cluster config")))?;
        let r = &config.replication;
        let settings = LeaderSettings {
            window: r.ship_window,
            catchup_threshold_bytes: r.catchup_threshold_bytes,
            keepalive_us: r.keepalive_ms * 1_000,
            probe_us: (r.keepalive_ms * 1_000).min(25_000),
            lease_us: config.coordinated().then_some(r.leader_timeout_ms * 1_000),
        };
        let mut replicas = BTreeMap::new();
        for spec in config.shards_of(me) {
            wal.create_shard(spec.id).map_err(|e| Status::internal(e.to_string()))?;
            replicas.insert(spec.id, Arc::new(ShardReplica::new(spec, &wal)?));
        }
        let mut addresses = config.addresses();
        addresses.remove(&me);
        let node = Arc::new(ReplicationNode {
            me,
            region: node_spec.region,
            peers: Peers::new(&addresses),
            catchup_budget: RateLimiter::new(r.catchup_rate_bytes_per_s),
            settings,
            allow_crash_drills,
            config,
            wal,
            metrics,
            replicas,
            heartbeats: Mutex::new(BTreeMap::new()),
            disk_bytes,
            shutdown: CancellationToken::new(),
            ship_streams: Mutex::new(BTreeMap::new()),
        });
        if !node.config.coordinated() {
            for spec in node.config.shards_of(me) {
                node.assign(spec.id, spec.epoch, spec.leader, 0).await?;
            }
        }
        for replica in node.replicas.values() {
            tokio::spawn(node.clone().run_retention(replica.clone()));
        }
        tokio::spawn(node.clone().run_heartbeats());
        tokio::spawn(node.clone().run_metrics());
        Ok(node)
    }

    pub fn replica(&self, shard: ShardId) -> Option<&Arc<ShardReplica>> {
        self.replicas.get(&shard)
    }

    fn replica_or_not_found(&self, shard: ShardId) -> Result<Arc<ShardReplica>, Status> {
        self.replica(shard).cloned().ok_or_else(|| refusal(&self.metrics, "unknown_shard", self.unknown_shard(shard)))
    }

    pub fn replicas(&self) -> impl Iterator<Item = &Arc<ShardReplica>> {
        self.replicas.values()
    }

    /// `<node id>@<grpc address>` of a node, for not-leader hints.
    pub fn describe(&self, node: NodeId) -> String {
        match self.config.node(node) {
            Some(spec) => format!("{node}@{}", spec.grpc_addr),
            None => node.to_string(),
        }
    }

    fn unknown_shard(&self, shard: u32) -> Status {
        Status::not_found(format!("shard {shard} is not hosted by node {}", self.me))
    }

    fn stale_epoch(&self, shard: ShardId, epoch: u64, seen: u64) -> Status {
        refusal(
            &self.metrics,
            "stale_epoch",
            with_metadata(
                Status::failed_precondition(format!(
                    "shard {shard}: epoch {epoch} is older than epoch {seen} already seen"
                )),
                EPOCH_METADATA_KEY,
                seen,
            ),
        )
    }

    // ---- leadership ----------------------------------------------------

    /// Durably promises `epoch` (refusing older ones from now on).
    async fn promise(&self, replica: &ShardReplica, epoch: u64) -> Result<(), Status> {
        if epoch > replica.epoch_seen() {
            self.wal.set_epoch(replica.shard, epoch).await.map_err(|e| Status::internal(e.to_string()))?;
            replica.epoch_seen.fetch_max(epoch, Ordering::AcqRel);
        }
        Ok(())
    }

    /// Stops leading, if it was: its tasks stop and appends waiting for a
    /// commit under it give up.
    fn stop_leading(&self, replica: &ShardReplica) {
        if let Some(leader) = replica.leader.lock().take() {
            leader.stop.cancel();
            replica.lease_until.send_replace(0);
            replica.generation.send_modify(|g| *g += 1);
            tracing::info!(shard = replica.shard, epoch = leader.epoch, "stopped leading");
        }
    }

    /// Waits until everything queued to the WAL from ships is durable, so a
    /// position reported afterwards covers it.
    async fn settle(&self, replica: &ShardReplica) -> Result<(), Status> {
        let _guard = replica.follower.apply_lock.lock().await;
        let queued = *replica.follower.next_expected.borrow() - 1;
        let mut durable = self.wal.durable_watch(replica.shard).map_err(|e| Status::internal(e.to_string()))?;
        let _ = durable.wait_for(|d| *d >= queued).await;
        Ok(())
    }

    /// The node's WAL disk is below its free-space reserve: appends and
    /// replicated segments are refused, and it does not take leadership.
    pub fn disk_full(&self) -> bool {
        self.wal.disk_space().is_some_and(|d| d.is_full())
    }

    /// Where this replica's log stands.
    pub async fn position(&self, shard: ShardId) -> Result<FenceResponse, Status> {
        let replica = self.replica_or_not_found(shard)?;
        let p = self.wal.positions(shard).map_err(|e| Status::internal(e.to_string()))?;
        let last_epoch = self.log_rank_epoch(shard, &p).await.map_err(|e| Status::internal(e.to_string()))?;
        let commit = match replica.leader_state() {
            Some(leader) => leader.core.lock().commit(),
            None => replica.follower.leader_commit.load(Ordering::Acquire).max(replica.readable()),
        };
        Ok(FenceResponse {
            node_id: self.me,
            last_epoch,
            last_seqno: p.last_seqno,
            durable_seqno: p.durable_seqno,
            commit_seqno: commit,
            epoch_seen: replica.epoch_seen(),
            first_seqno: p.first_seqno,
            disk_full: self.disk_full(),
        })
    }

    /// The epoch a failover ranks this replica's log by (reported as
    /// `last_epoch`): its log epoch, the newest epoch whose leader's log it
    /// is a prefix of (Viewstamped Replication's "last normal view"; see
    /// `core/leader.rs` for why commits rely on it), or its last record's
    /// epoch where that is newer (a log from before log epochs were kept).
    async fn log_rank_epoch(&self, shard: ShardId, p: &walship_wal::Positions) -> walship_wal::wal::WalResult<u64> {
        let last_record = if p.last_seqno >= p.first_seqno { self.wal.epoch_at(shard, p.last_seqno).await? } else { 0 };
        Ok(last_record.max(self.wal.log_epoch(shard)?))
    }

    /// Raises the replica's epoch: it refuses anything older from now on
    /// and stops leading. Answers where its log ends.
    pub async fn fence(&self, shard: ShardId, epoch: u64) -> Result<FenceResponse, Status> {
        let replica = self.replica_or_not_found(shard)?;
        let _transition = replica.transition.lock().await;
        let seen = replica.epoch_seen();
        if epoch < seen {
            return Err(self.stale_epoch(shard, epoch, seen));
        }
        self.promise(&replica, epoch).await?;
        let view = replica.view();
        if epoch > view.epoch || (epoch == view.epoch && view.role == Role::Leader) {
            self.stop_leading(&replica);
            *replica.view.write() = View { role: Role::Unassigned, epoch };
        }
        drop(_transition);
        self.settle(&replica).await?;
        self.position(shard).await
    }

    /// Makes this replica the leader of `epoch` (when `leader` is this node)
    /// or a follower of `leader` in it. Idempotent for the current epoch.
    pub fn assign(
        self: &Arc<Self>,
        shard: ShardId,
        epoch: u64,
        leader: NodeId,
        commit_floor: u64,
    ) -> impl std::future::Future<Output = Result<AssignResponse, Status>> + Send + 'static {
        let node = self.clone();
        async move { node.assign_inner(shard, epoch, leader, commit_floor).await }
    }

    async fn assign_inner(
        self: &Arc<Self>,
        shard: ShardId,
        epoch: u64,
        leader: NodeId,
        commit_floor: u64,
    ) -> Result<AssignResponse, Status> {
        let replica = self.replica_or_not_found(shard)?;
        if !replica.replicas.contains(&leader) {
            return Err(refusal(
                &self.metrics,
                "bad_request",
                Status::invalid_argument(format!("node {leader} holds no replica of shard {shard}")),
            ));
        }
        let _transition = replica.transition.lock().await;
        let seen = replica.epoch_seen();
        if epoch < seen {
            return Err(self.stale_epoch(shard, epoch, seen));
        }
        let view = replica.view();
        let wanted = if leader == self.me { Role::Leader } else { Role::Follower { leader } };
        if leader == self.me && self.early_shipping() && epoch == replica.restarted_in && view.role != Role::Leader {
            return Err(refusal(
                &self.metrics,
                "restarted_epoch",
                Status::failed_precondition(format!(
                    "node {} restarted in epoch {epoch} of shard {shard}, which it may have led before; \
                     it leads only in a newer epoch (a failover raises it)",
                    self.me
                )),
            ));
        }
        if leader == self.me && view.role != Role::Leader && self.disk_full() {
            let full = self.wal.disk_space().map(|d| d.refusal().to_string()).unwrap_or_default();
            return Err(refusal(
                &self.metrics,
                "disk_full",
                Status::resource_exhausted(format!("node {} will not lead shard {shard}: {full}", self.me)),
            ));
        }
        if !(view.epoch == epoch && view.role == wanted) {
            self.promise(&replica, epoch).await?;
            self.stop_leading(&replica);
            if leader == self.me {
                drop(_transition);
                self.settle(&replica).await?;
                self.become_leader(&replica, epoch, commit_floor).await?;
            } else {
                *replica.view.write() = View { role: wanted, epoch };
                replica.follower.last_contact_us.store(now_us(), Ordering::Release);
                tracing::info!(shard, epoch, leader, "following");
                self.start_catchup(replica.clone());
            }
        }
        let last = self.wal.positions(shard).map(|p| p.last_seqno).unwrap_or(0);
        let role = if leader == self.me { "leader" } else { "follower" };
        Ok(AssignResponse { epoch, role: role.into(), last_seqno: last })
    }

    async fn become_leader(
        self: &Arc<Self>,
        replica: &Arc<ShardReplica>,
        epoch: u64,
        commit_floor: u64,
    ) -> Result<(), Status> {
        let internal = |e: walship_wal::WalError| Status::internal(e.to_string());
        // Before it leads, its log is this epoch's: a failover ranks it so.
        self.wal.set_log_epoch(replica.shard, epoch).await.map_err(internal)?;
        let p = self.wal.positions(replica.shard).map_err(internal)?;
        // The stream baseline: everything up to here predates this epoch.
        let (_, before) = self.wal.epoch_end(replica.shard, epoch - 1).await.map_err(internal)?;
        let followers: Vec<NodeId> = replica.replicas.iter().copied().filter(|&r| r != self.me).collect();
        let start = LeaderStart {
            epoch,
            first: p.first_seqno,
            durable: p.durable_seqno,
            epoch_start: before + 1,
            commit_floor: commit_floor.max(replica.follower.leader_commit.load(Ordering::Acquire)),
        };
        let core = LeaderCore::new(start, &followers, self.settings, now_us());
        let state = Arc::new(LeaderState {
            epoch,
            core: Mutex::new(core),
            ship_limit: watch::Sender::new(p.durable_seqno),
            stop: self.shutdown.child_token(),
        });
        {
            let core = state.core.lock();
            replica.publish_leader(&core, &self.metrics);
        }
        *replica.leader.lock() = Some(state.clone());
        *replica.view.write() = View { role: Role::Leader, epoch };
        tokio::spawn(self.clone().run_leader_driver(replica.clone(), state.clone()));
        for follower in followers {
            tokio::spawn(self.clone().run_shipper(replica.clone(), state.clone(), follower));
        }
        tracing::info!(shard = replica.shard, epoch, stream_baseline = before, "leading");
        Ok(())
    }

    /// A follower answered with a newer epoch: this leader was deposed.
    async fn step_down(self: Arc<Self>, replica: Arc<ShardReplica>, epoch: u64) {
        let _transition = replica.transition.lock().await;
        if replica.view().epoch >= epoch {
            return;
        }
        if let Err(status) = self.promise(&replica, epoch).await {
            tracing::error!(shard = replica.shard, %status, "recording the newer epoch");
        }
        self.stop_leading(&replica);
        *replica.view.write() = View { role: Role::Unassigned, epoch };
        tracing::warn!(shard = replica.shard, epoch, "deposed: a follower has seen a newer epoch");
    }

    /// The last seqno of this replica's log whose epoch is `<= epoch`.
    pub async fn epoch_end(&self, request: EpochEndRequest) -> Result<(u64, u64), Status> {
        self.replica_or_not_found(request.shard_id)?;
        self.wal.epoch_end(request.shard_id, request.epoch).await.map_err(|e| Status::internal(e.to_string()))
    }

    /// Drills: pause or resume a follower replica.
    pub fn pause(self: &Arc<Self>, shard: ShardId, paused: bool) -> Result<(), Status> {
        let replica = self.replica_or_not_found(shard)?;
        if replica.is_leader() && paused {
            return Err(Status::failed_precondition(format!("node {} leads shard {shard}: pause a follower", self.me)));
        }
        replica.paused.store(paused, Ordering::Release);
        if !paused {
            self.start_catchup(replica);
        }
        Ok(())
    }

    /// Drills: abort like a crash, if allowed.
    pub fn crash(&self, reason: &str) -> Result<(), Status> {
        if !self.allow_crash_drills {
            return Err(Status::permission_denied("crash drills are not enabled on this node (--allow-crash-drills)"));
        }
        tracing::warn!(reason, "crash drill: aborting");
        tokio::spawn(async {
            // Usually enough for the answer to leave; the drill also takes a
            // dropped connection as the crash it asked for.
            tokio::time::sleep(Duration::from_millis(5)).await;
            std::process::abort();
        });
        Ok(())
    }

    // ---- leader side -------------------------------------------------

    /// Folds the leader's own WAL positions into its core: durable ones,
    /// and with early shipping the flushing ones too (what the WAL is
    /// committing), so shippers send a batch while the leader's fsync of it
    /// still runs. Written positions, which move with every append, are
    /// read by the shippers themselves (see [`ReplicationNode::run_shipper`]).
    async fn run_leader_driver(self: Arc<Self>, replica: Arc<ShardReplica>, leader: Arc<LeaderState>) {
        let Ok(mut durable) = self.wal.durable_watch(replica.shard) else { return };
        let mut flushing = if self.early_shipping() { self.wal.flushing_watch(replica.shard).ok() } else { None };
        loop {
            let committing = flushing.as_mut().map(|f| *f.borrow_and_update());
            let seqno = *durable.borrow_and_update();
            let counters = self.wal.counters(replica.shard).unwrap_or_default();
            let limit = {
                let mut core = leader.core.lock();
                if let Some(committing) = committing {
                    core.on_local_written(committing);
                    core.on_local_flushing(committing);
                }
                core.on_local_durable(seqno, counters.records, counters.bytes, now_us());
                replica.publish_leader(&core, &self.metrics);
                core.flushing()
            };
            leader.ship_limit.send_if_modified(|l| std::mem::replace(l, limit) != limit);
            tokio::select! {
                changed = durable.changed() => if changed.is_err() { return },
                open = changed_if_watched(flushing.as_mut()) => if !open { return },
                _ = leader.stop.cancelled() => return,
            }
        }
    }

    /// Whether leaders ship records before their own fsync. Only under a
    /// coordinator, which never lets a restarted leader lead again in the
    /// same epoch (see [`ShardReplica::restarted_in`]); a static cluster's
    /// leader leads epoch 1 forever, so it ships durable records only.
    fn early_shipping(&self) -> bool {
        self.config.coordinated()
    }

    async fn run_shipper(self: Arc<Self>, replica: Arc<ShardReplica>, leader: Arc<LeaderState>, follower: NodeId) {
        let mut ship_limit = leader.ship_limit.subscribe();
        // Early shipping: with nothing in flight to this follower, each
        // written append wakes this shipper directly; with segments in
        // flight it waits for what the WAL commits (`ship_limit`) or a
        // reply, so appends arriving one by one wake nothing.
        let mut written = if self.early_shipping() { self.wal.written_watch(replica.shard).ok() } else { None };
        let mut in_flight = FuturesUnordered::new();
        let keepalive = Duration::from_micros(self.settings.probe_us.min(self.settings.keepalive_us));
        let batch_bytes = self.config.replication.ship_batch_bytes;
        loop {
            if let Some(written) = written.as_mut() {
                let wrote = *written.borrow_and_update();
                leader.core.lock().on_local_written(wrote);
            }
            // Issue everything the core allows right now.
            loop {
                let decision = leader.core.lock().poll_ship(follower, now_us());
                match decision {
                    ShipDecision::Send { from, up_to } => {
                        let frames = match self.wal.read(replica.shard, from, up_to, batch_bytes).await {
                            Ok(frames) => frames,
                            Err(e) => {
                                tracing::warn!(shard = replica.shard, follower, error = %e, "reading the WAL to ship");
                                break;
                            }
                        };
                        let last = frames.last().map_or(from, |f| f.seqno());
                        let segment = match Segment::encode(replica.shard, frames) {
                            Ok(segment) => segment,
                            Err(e) => {
                                tracing::error!(shard = replica.shard, error = %e, "encoding a segment to ship");
                                break;
                            }
                        };
                        leader.core.lock().on_sent(follower, from, last, now_us());
                        in_flight.push(self.ship(&replica, &leader, follower, Some(segment)));
                    }
                    ShipDecision::Keepalive => {
                        leader.core.lock().on_keepalive_sent(follower, now_us());
                        in_flight.push(self.ship(&replica, &leader, follower, None));
                    }
                    ShipDecision::Idle => break,
                }
            }
            tokio::select! {
                Some(reply) = in_flight.next(), if !in_flight.is_empty() => {
                    if matches!(reply, ShipReply::Failed) {
                        self.metrics.ship_errors.with_label_values(&[&follower.to_string()]).inc();
                    }
                    let deposed = {
                        let mut core = leader.core.lock();
                        let deposed = core.on_reply(follower, reply, now_us()).err();
                        replica.publish_leader(&core, &self.metrics);
                        deposed
                    };
                    if let Some(epoch) = deposed {
                        tokio::spawn(self.clone().step_down(replica.clone(), epoch));
                        return;
                    }
                }
                changed = ship_limit.changed() => if changed.is_err() { return },
                open = changed_if_watched(written.as_mut()), if in_flight.is_empty() => if !open { return },
                _ = tokio::time::sleep(keepalive) => {}
                _ = leader.stop.cancelled() => return,
            }
        }
    }

    /// One ShipSegment (or keepalive when `segment` is none) to `follower`.
    fn ship(
        &self,
        replica: &ShardReplica,
        leader: &LeaderState,
        follower: NodeId,
        segment: Option<Segment>,
    ) -> impl std::future::Future<Output = ShipReply> + use<> {
        let (durable, written, commit) = {
            let core = leader.core.lock();
            (core.durable(), core.written(), core.commit())
        };
        let (seqno, count, payload) = match &segment {
            Some(s) => (s.first_seqno(), s.frames().len() as u64, s.encoded().clone()),
            None => (0, 0, bytes::Bytes::new()),
        };
        if segment.is_some() {
            self.metrics.segments_shipped.inc();
            self.metrics.bytes_shipped.inc_by(payload.len() as u64);
            self.metrics.ship_batch_records.observe(count as f64);
        }
        let request = ShipSegmentRequest {
            id: Some(WalSegmentId { region_id: self.region, shard_id: replica.shard, seqno }),
            payload,
            event_count: count,
            // A segment's envelope must cover it (it may be written, not yet
            // durable); a keepalive announces the durable position only, so
            // a follower pulls catch-up for records it can actually get.
            leader_last_seq: if segment.is_some() { written } else { durable },
            stream_baseline: 0,
            epoch: leader.epoch,
            leader_node_id: self.me,
            commit_seqno: commit,
        };
        let stream = {
            let mut streams = self.ship_streams.lock();
            match streams.get(&follower) {
                Some(tx) if !tx.is_closed() => Some(tx.clone()),
                _ => self.peers.shipping(follower).map(|client| {
                    let (tx, rx) = tokio::sync::mpsc::channel(SHIP_STREAM_DEPTH);
                    tokio::spawn(run_ship_stream(client, rx));
                    streams.insert(follower, tx.clone());
                    tx
                }),
            }
        };
        let timeout = Duration::from_millis(self.config.replication.ship_timeout_ms);
        async move {
            let Some(stream) = stream else { return ShipReply::Failed };
            let call = async move {
                let (reply, answer) = tokio::sync::oneshot::channel();
                stream.send((request, reply)).await.ok()?;
                answer.await.ok()
            };
            // A push not answered in time fails; its answer, if it comes
            // later, goes nowhere.
            let Ok(Some(outcome)) = tokio::time::timeout(timeout, call).await else { return ShipReply::Failed };
            match outcome {
                Ok(r) if r.accepted => ShipReply::Applied { applied: r.applied_seqno },
                Ok(_) => ShipReply::Failed,
                Err(status) => {
                    match (metadata_u64(&status, APPLIED_METADATA_KEY), metadata_u64(&status, EPOCH_METADATA_KEY)) {
                        (Some(applied), _) if status.code() == tonic::Code::OutOfRange => ShipReply::Gap { applied },
                        (_, Some(epoch)) if status.code() == tonic::Code::FailedPrecondition => {
                            ShipReply::StaleEpoch { epoch }
                        }
                        _ => {
                            tracing::debug!(follower, %status, "ShipSegment failed");
                            ShipReply::Failed
                        }
                    }
                }
            }
        }
    }

    /// Serves `StreamSegments` (leader side): durable segments from
    /// `from_seqno` up to the durable position reached, rate-limited.
    pub fn stream_segments(
        self: &Arc<Self>,
        request: StreamRequest,
    ) -> Result<tokio::sync::mpsc::Receiver<Result<ShipSegmentRequest, Status>>, Status> {
        let replica = self.replica_or_not_found(request.shard_id)?;
        let Some(leader) = replica.leader_state() else {
            let hint = replica.leader_id(self.me).map_or("unknown".to_string(), |l| self.describe(l));
            return Err(refusal(
                &self.metrics,
                "not_leader",
                Status::failed_precondition(format!(
                    "node {} is not the leader of shard {}; the leader is {hint}",
                    self.me, replica.shard
                )),
            ));
        };
        if request.epoch > leader.epoch {
            return Err(refusal(
                &self.metrics,
                "stale_epoch",
                with_metadata(
                    Status::failed_precondition(format!(
                        "requester has seen epoch {} but this leader is at epoch {}",
                        request.epoch, leader.epoch
                    )),
                    EPOCH_METADATA_KEY,
                    request.epoch,
                ),
            ));
        }
        if request.from_seqno == 0 {
            return Err(refusal(&self.metrics, "bad_request", Status::invalid_argument("from_seqno must be >= 1")));
        }
        let positions = self.wal.positions(replica.shard).map_err(|e| Status::internal(e.to_string()))?;
        let (durable, baseline) = {
            let core = leader.core.lock();
            (core.durable(), core.epoch_start() - 1)
        };
        if request.from_seqno < positions.first_seqno {
            return Err(refusal(
                &self.metrics,
                "needs_reseed",
                Status::out_of_range(format!(
                    "shard {}: seqno {} is no longer retained (oldest is {}); the replica needs a re-seed",
                    replica.shard, request.from_seqno, positions.first_seqno
                )),
            ));
        }
        if request.from_seqno > durable + 1 {
            return Err(refusal(
                &self.metrics,
                "bad_request",
                Status::out_of_range(format!(
                    "shard {}: from_seqno {} is past the leader's durable seqno {durable}",
                    replica.shard, request.from_seqno
                )),
            ));
        }
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let node = self.clone();
        tokio::spawn(async move {
            let mut next = request.from_seqno;
            // Catch-up moves bulk: bigger chunks than live pushes, so each
            // follower fsync covers more.
            let batch = node.config.replication.ship_batch_bytes.saturating_mul(4);
            loop {
                if leader.stop.is_cancelled() {
                    let _ = tx.send(Err(Status::unavailable("this replica stopped leading"))).await;
                    return;
                }
                let (durable, commit) = {
                    let core = leader.core.lock();
                    (core.durable(), core.commit())
                };
                if next > durable {
                    return;
                }
                let frames = match node.wal.read(replica.shard, next, durable, batch).await {
                    Ok(frames) => frames,
                    Err(e) => {
                        let _ = tx.send(Err(Status::out_of_range(e.to_string()))).await;
                        return;
                    }
                };
                let segment = match Segment::encode(replica.shard, frames) {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = tx.send(Err(Status::internal(e.to_string()))).await;
                        return;
                    }
                };
                node.catchup_budget.acquire(segment.encoded().len()).await;
                node.metrics.catchup_served_bytes.inc_by(segment.encoded().len() as u64);
                let message = ShipSegmentRequest {
                    id: Some(WalSegmentId {
                        region_id: node.region,
                        shard_id: replica.shard,
                        seqno: segment.first_seqno(),
                    }),
                    event_count: segment.frames().len() as u64,
                    leader_last_seq: durable,
                    stream_baseline: baseline,
                    epoch: leader.epoch,
                    leader_node_id: node.me,
                    commit_seqno: commit,
                    payload: segment.encoded().clone(),
                };
                next = segment.last_seqno() + 1;
                if tx.send(Ok(message)).await.is_err() {
                    return;
                }
            }
        });
        Ok(rx)
    }

    // ---- follower side -----------------------------------------------

    /// Applies an inbound segment or keepalive (pushed by ShipSegment or
    /// streamed by catch-up). Returns the durable frontier to report.
    /// Validation happens before anything is queued: a refusal changes
    /// nothing. A segment from the leader of an epoch this replica has not
    /// reconciled with yet is refused (`UNAVAILABLE`, retryable) while the
    /// replica repairs its log against that leader.
    pub async fn apply_inbound(self: &Arc<Self>, request: &ShipSegmentRequest, source: Source) -> Result<u64, Status> {
        let (replica, pending) = self.queue_inbound(request, source).await?;
        self.settle_inbound(&replica, pending).await
    }

    /// Waits for a queued inbound segment to be durable and returns the
    /// durable frontier (see [`ReplicationNode::apply_inbound`]).
    async fn settle_inbound(&self, replica: &ShardReplica, pending: Option<Queued>) -> Result<u64, Status> {
        if let Some(queued) = pending
            && let Err(e) = queued.await
        {
            // Our bookkeeping and the WAL disagree: resynchronise from the WAL.
            let last = self.wal.positions(replica.shard).map(|p| p.last_seqno).unwrap_or(0);
            replica.follower.next_expected.send_replace(last + 1);
            return Err(Status::failed_precondition(format!("shard {}: applying the segment: {e}", replica.shard)));
        }
        let durable = self.wal.positions(replica.shard).map_err(|e| Status::internal(e.to_string()))?.durable_seqno;
        replica.publish_follower(durable);
        Ok(durable)
    }

    /// Validates, classifies and queues an inbound segment to the WAL in
    /// order, without waiting for it to be durable.
    async fn queue_inbound(
        self: &Arc<Self>,
        request: &ShipSegmentRequest,
        source: Source,
    ) -> Result<(Arc<ShardReplica>, Option<Queued>), Status> {
        let id = request.id.unwrap_or_default();
        let replica = self.replica_or_not_found(id.shard_id)?;
        let segment = if request.payload.is_empty() {
            None
        } else {
            Some(Segment::decode(request.payload.clone()).map_err(|e| {
                refusal(
                    &self.metrics,
                    "corrupt",
                    Status::invalid_argument(format!("corrupt segment for shard {}: {e}", id.shard_id)),
                )
            })?)
        };
        check_envelope(
            id.shard_id,
            id.seqno,
            request.event_count,
            request.leader_last_seq,
            segment.as_ref().map(|s| (s.shard_id(), s.first_seqno(), s.last_seqno())),
        )
        .map_err(|m| refusal(&self.metrics, "bad_request", Status::invalid_argument(m)))?;
        let seen = replica.epoch_seen();
        if request.epoch < seen {
            return Err(self.stale_epoch(replica.shard, request.epoch, seen));
        }
        let view = replica.view();
        match view.role {
            Role::Leader if request.epoch <= view.epoch => {
                return Err(refusal(
                    &self.metrics,
                    "not_follower",
                    Status::failed_precondition(format!(
                        "node {} is the leader of shard {}, not a follower",
                        self.me, replica.shard
                    )),
                ));
            }
            Role::Follower { leader } if request.epoch == view.epoch && request.leader_node_id != leader => {
                return Err(refusal(
                    &self.metrics,
                    "wrong_leader",
                    Status::failed_precondition(format!(
                        "shard {}: segment from node {} but the leader is node {leader}",
                        replica.shard, request.leader_node_id
                    )),
                ));
            }
            Role::Follower { .. } if request.epoch == view.epoch => {}
            _ => {
                // A leader of a newer epoch (or of the epoch we were fenced
                // at) we have not been told about: epochs are unique per
                // leader, so follow it.
                if !replica.replicas.contains(&request.leader_node_id) {
                    return Err(refusal(
                        &self.metrics,
                        "wrong_leader",
                        Status::failed_precondition(format!(
                            "node {} holds no replica of shard {}",
                            request.leader_node_id, replica.shard
                        )),
                    ));
                }
                self.assign(replica.shard, request.epoch, request.leader_node_id, 0).await?;
            }
        }
        let follower = &replica.follower;
        if replica.paused.load(Ordering::Acquire) {
            return Err(Status::unavailable(format!(
                "shard {} replica on node {} is paused (drill)",
                replica.shard, self.me
            )));
        }
        if follower.repaired_epoch.load(Ordering::Acquire) < request.epoch {
            self.start_catchup(replica.clone());
            return Err(Status::unavailable(format!(
                "shard {}: reconciling with the leader of epoch {} before applying its segments",
                replica.shard, request.epoch
            )));
        }
        let inbound = InboundSegment {
            epoch: request.epoch,
            range: segment.as_ref().map(|s| (s.first_seqno(), s.last_seqno())),
            leader_last_seq: request.leader_last_seq,
        };
        // Windowed pushes may overtake each other: give the one before a
        // moment to be queued before calling this a gap.
        if let Some((first, _)) = inbound.range {
            let mut next = follower.next_expected.subscribe();
            let wait = Duration::from_millis(self.config.replication.reorder_wait_ms);
            let _ = tokio::time::timeout(wait, next.wait_for(|n| *n >= first)).await;
        }
        let guard = follower.apply_lock.lock().await;
        let durable = self.wal.positions(replica.shard).map_err(|e| Status::internal(e.to_string()))?.durable_seqno;
        let view =
            FollowerView { epoch_seen: replica.epoch_seen(), next_expected: *follower.next_expected.borrow(), durable };
        let pending = match classify(view, inbound) {
            Inbound::StaleEpoch { seen } => return Err(self.stale_epoch(replica.shard, request.epoch, seen)),
            Inbound::Gap { expected } => {
                drop(guard);
                self.start_catchup(replica.clone());
                return Err(refusal(
                    &self.metrics,
                    "gap",
                    with_metadata(
                        Status::out_of_range(format!(
                            "shard {}: segment starts at {} but this replica expects {expected}; catching up",
                            replica.shard,
                            inbound.range.map_or(0, |r| r.0)
                        )),
                        APPLIED_METADATA_KEY,
                        durable,
                    ),
                ));
            }
            Inbound::Keepalive { behind } => {
                if behind {
                    self.start_catchup(replica.clone());
                }
                None
            }
            Inbound::Duplicate => {
                // Already queued here (a catch-up chunk and a push racing
                // over the same records), maybe not durable yet: answer once
                // the queued copy is, so the answer covers the segment and
                // the leader counts it now, not at its next keepalive.
                let queued = inbound.range.map_or(0, |(_, last)| last).min(view.next_expected.saturating_sub(1));
                (queued > durable).then(|| self.durable_at(replica.shard, queued))
            }
            Inbound::Apply { skip } => {
                let segment = segment.expect("apply implies records");
                let last = segment.last_seqno();
                let bytes: usize = segment.frames()[skip..].iter().map(|f| f.len()).sum();
                let frames = segment.into_frames().split_off(skip);
                let queued = self.wal.enqueue_frames(replica.shard, frames).await.map_err(|e| match e {
                    // The leader counts this follower out until the disk
                    // has space again; nothing was queued.
                    WalError::DiskFull(full) => {
                        refusal(&self.metrics, "disk_full", Status::resource_exhausted(full.to_string()))
                    }
                    e => Status::unavailable(e.to_string()),
                })?;
                follower.next_expected.send_replace(last + 1);
                self.metrics.received_bytes.with_label_values(&[source.as_str()]).inc_by(bytes as u64);
                Some(Box::pin(queued) as Queued)
            }
        };
        follower.leader_commit.fetch_max(request.commit_seqno, Ordering::AcqRel);
        follower.last_contact_us.store(now_us(), Ordering::Release);
        drop(guard);
        Ok((replica, pending))
    }

    /// Resolves once the shard's durable seqno reaches `seqno`, which is
    /// already queued to the WAL; gives up after `reorder_wait_ms` (a repair
    /// may have truncated it), and the answer then says what is durable.
    fn durable_at(&self, shard: ShardId, seqno: u64) -> Queued {
        let durable = self.wal.durable_watch(shard);
        let wait = Duration::from_millis(self.config.replication.reorder_wait_ms);
        Box::pin(async move {
            let mut durable = durable?;
            let _ = tokio::time::timeout(wait, durable.wait_for(|d| *d >= seqno)).await;
            Ok(walship_wal::Appended { first_seqno: seqno, last_seqno: seqno })
        })
    }

    /// Starts reconciling with and pulling from the leader, unless that is
    /// already running: first divergence repair (once per epoch), then a
    /// catch-up stream.
    pub fn start_catchup(self: &Arc<Self>, replica: Arc<ShardReplica>) {
        if replica.follower.catchup_running.swap(true, Ordering::AcqRel) {
            return;
        }
        let node = self.clone();
        tokio::spawn(async move {
            let mut backoff = Duration::from_millis(20);
            loop {
                let view = replica.view();
                let Role::Follower { leader } = view.role else { break };
                if replica.paused.load(Ordering::Acquire) {
                    break;
                }
                let attempt = async {
                    if replica.follower.repaired_epoch.load(Ordering::Acquire) < view.epoch {
                        node.repair(&replica, leader, view.epoch).await?;
                    }
                    node.catch_up_once(&replica, leader, view.epoch).await
                };
                match attempt.await {
                    Ok(()) => break,
                    Err(status) => {
                        tracing::debug!(shard = replica.shard, %status, "catch-up attempt failed; retrying");
                        tokio::select! {
                            _ = tokio::time::sleep(backoff) => {}
                            _ = node.shutdown.cancelled() => break,
                        }
                        backoff = (backoff * 2).min(Duration::from_secs(1));
                    }
                }
            }
            replica.follower.catchup_running.store(false, Ordering::Release);
        });
    }

    /// Truncates whatever this follower's log holds past the point where it
    /// diverges from the leader of `epoch`: repeatedly, ask the leader where
    /// our last record's epoch ends in its log, and cut to the lower of that
    /// and where the same epoch ends in ours.
    async fn repair(&self, replica: &ShardReplica, leader: NodeId, epoch: u64) -> Result<(), Status> {
        let internal = |e: walship_wal::WalError| Status::internal(e.to_string());
        let mut client = self.peers.control(leader).ok_or_else(|| Status::unavailable("leader address unknown"))?;
        let _guard = replica.follower.apply_lock.lock().await;
        for _ in 0..64 {
            let p = self.wal.positions(replica.shard).map_err(internal)?;
            if p.last_seqno < p.first_seqno {
                break;
            }
            let last_epoch = self.wal.epoch_at(replica.shard, p.last_seqno).await.map_err(internal)?;
            let mut request = tonic::Request::new(EpochEndRequest { shard_id: replica.shard, epoch: last_epoch });
            request.set_timeout(Duration::from_secs(2));
            let answer = client.epoch_end(request).await?.into_inner();
            let (_, ours) = self.wal.epoch_end(replica.shard, answer.epoch).await.map_err(internal)?;
            let keep = answer.end_seqno.min(ours);
            if keep >= p.last_seqno {
                break;
            }
            if keep + 1 < p.first_seqno {
                return Err(Status::out_of_range(format!(
                    "shard {}: diverges from the leader before seqno {}, which is compacted here; needs a re-seed",
                    replica.shard, p.first_seqno
                )));
            }
            tracing::warn!(
                shard = replica.shard,
                epoch,
                from = keep + 1,
                to = p.last_seqno,
                "truncating a divergent tail"
            );
            self.wal.truncate_suffix(replica.shard, keep).await.map_err(internal)?;
        }
        let last = self.wal.positions(replica.shard).map_err(internal)?.last_seqno;
        // The log is now a prefix of this leader's: record it durably before
        // answering anything of this epoch, so every acknowledgement the
        // leader counts comes from a replica a failover ranks by this epoch
        // (what lets the leader commit older-epoch records by counting).
        self.wal.set_log_epoch(replica.shard, epoch).await.map_err(internal)?;
        replica.follower.next_expected.send_replace(last + 1);
        replica.follower.repaired_epoch.fetch_max(epoch, Ordering::AcqRel);
        Ok(())
    }

    async fn catch_up_once(
        self: &Arc<Self>,
        replica: &Arc<ShardReplica>,
        leader: NodeId,
        epoch: u64,
    ) -> Result<(), Status> {
        let mut client = self.peers.shipping(leader).ok_or_else(|| Status::unavailable("leader address unknown"))?;
        let from = *replica.follower.next_expected.borrow();
        let request = StreamRequest { shard_id: replica.shard, from_seqno: from, epoch, follower_node_id: self.me };
        let mut stream = client.stream_segments(request).await?.into_inner();
        // Pipelined: receive the next chunk while earlier ones are written
        // and fsynced (they still enter the WAL in order, and consecutive
        // chunks share group commits), with a bounded number in flight.
        let mut in_flight = std::collections::VecDeque::new();
        while let Some(message) = stream.message().await? {
            let (_, pending) = self.queue_inbound(&message, Source::Stream).await?;
            in_flight.push_back(pending);
            if in_flight.len() >= CATCHUP_PIPELINE {
                self.settle_inbound(replica, in_flight.pop_front().flatten()).await?;
            }
        }
        for pending in in_flight {
            self.settle_inbound(replica, pending).await?;
        }
        Ok(())
    }

    // ---- both ----------------------------------------------------------

    async fn run_retention(self: Arc<Self>, replica: Arc<ShardReplica>) {
        let r = self.config.replication.clone();
        let mut tick = tokio::time::interval(Duration::from_millis(r.retention_interval_ms));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = self.shutdown.cancelled() => return,
            }
            let compact_to = match replica.leader_state() {
                Some(leader) => {
                    let plan = leader.core.lock().plan_retention(r.retain_bytes, r.max_retain_bytes);
                    if !plan.reseed.is_empty() {
                        tracing::warn!(shard = replica.shard, followers = ?plan.reseed, "retention bound reached: followers need a re-seed");
                        leader.core.lock().mark_reseed(&plan.reseed);
                    }
                    plan.compact_to
                }
                None => {
                    let (Ok(p), Ok(c)) = (self.wal.positions(replica.shard), self.wal.counters(replica.shard)) else {
                        continue;
                    };
                    let avg = c.bytes.checked_div(c.records).unwrap_or(0);
                    let keep = r.retain_bytes.checked_div(avg).unwrap_or(u64::MAX);
                    let to = (p.durable_seqno + 1).saturating_sub(keep);
                    (avg > 0 && to > p.first_seqno).then_some(to)
                }
            };
            if let Some(to) = compact_to {
                match self.wal.compact_prefix(replica.shard, to).await {
                    Ok(()) => {
                        if let Some(leader) = replica.leader_state() {
                            leader.core.lock().on_compacted(to);
                        }
                        tracing::info!(shard = replica.shard, first_seqno = to, "compacted");
                    }
                    Err(e) => tracing::warn!(shard = replica.shard, error = %e, "compaction"),
                }
            }
        }
    }

    /// Current state of every replica, for `/v1/status`.
    pub fn status(&self) -> Vec<ReplicaStatus> {
        let now = now_us();
        self.replicas
            .values()
            .map(|replica| {
                let p = self.wal.positions(replica.shard).unwrap_or(walship_wal::Positions {
                    first_seqno: 0,
                    last_seqno: 0,
                    durable_seqno: 0,
                });
                let view = replica.view();
                let (commit, followers) = match replica.leader_state() {
                    Some(leader) => {
                        let core = leader.core.lock();
                        let followers = core
                            .followers()
                            .map(|(id, progress)| {
                                follower_status(id, &progress, &core.lag(id, now).expect("known follower"), now)
                            })
                            .collect();
                        (core.commit(), followers)
                    }
                    None => (replica.follower.leader_commit.load(Ordering::Acquire), Vec::new()),
                };
                let role = match view.role {
                    Role::Leader => "leader",
                    Role::Follower { .. } => "follower",
                    Role::Unassigned => "unassigned",
                };
                ReplicaStatus {
                    shard_id: replica.shard,
                    role: role.into(),
                    epoch: view.epoch,
                    epoch_seen: replica.epoch_seen(),
                    leader: replica.leader_id(self.me),
                    replicas: replica.replicas.clone(),
                    first_seqno: p.first_seqno,
                    last_seqno: p.last_seqno,
                    durable_seqno: p.durable_seqno,
                    commit_seqno: commit,
                    followers,
                }
            })
            .collect()
    }

    /// Heartbeats received (newest per node and shard).
    pub fn received_heartbeats(&self) -> Vec<ReceivedHeartbeat> {
        self.heartbeats
            .lock()
            .values()
            .map(|(hb, at)| ReceivedHeartbeat { received_ms_ago: at.elapsed().as_millis() as u64, ..hb.clone() })
            .collect()
    }

    /// Records a heartbeat (the `Heartbeat` RPC).
    pub fn on_heartbeat(&self, request: &HeartbeatRequest) -> Result<(), Status> {
        if request.node_id == 0 || self.config.node(request.node_id).is_none() {
            return Err(refusal(
                &self.metrics,
                "bad_request",
                Status::invalid_argument(format!("heartbeat from unknown node {}", request.node_id)),
            ));
        }
        self.metrics.heartbeats_received.inc();
        let hb = ReceivedHeartbeat {
            node_id: request.node_id,
            shard_id: request.shard_id,
            epoch: request.epoch,
            last_seqno: request.last_seqno,
            durable_seqno: request.durable_seqno,
            commit_seqno: request.commit_seqno,
            entity_count: request.entity_count,
            replication_lag: request.replication_lag.iter().map(|(&k, &v)| (k, v)).collect(),
            received_ms_ago: 0,
        };
        self.heartbeats.lock().insert((request.node_id, request.shard_id), (hb, Instant::now()));
        Ok(())
    }

    async fn run_heartbeats(self: Arc<Self>) {
        let interval = Duration::from_millis(self.config.replication.heartbeat_ms);
        let targets: Vec<_> = self
            .config
            .coordinators
            .iter()
            .map(|c| c.grpc_addr.clone())
            .chain(self.config.replication.heartbeat_to.map(crate::config::Address::from))
            .map(|a| crate::peers::lazy_channel(&a))
            .collect();
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_records: BTreeMap<ShardId, (u64, Instant)> = BTreeMap::new();
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = self.shutdown.cancelled() => return,
            }
            let disk = (self.disk_bytes)();
            self.metrics.disk_bytes.set(disk as i64);
            let mut node_rate = 0.0;
            let mut requests = Vec::new();
            for replica in self.replicas.values() {
                let (Ok(p), Ok(c)) = (self.wal.positions(replica.shard), self.wal.counters(replica.shard)) else {
                    continue;
                };
                let now = Instant::now();
                let (prev, at) = last_records.insert(replica.shard, (c.records, now)).unwrap_or((c.records, now));
                let elapsed = now.duration_since(at).as_secs_f64();
                let rate = if elapsed > 0.0 { (c.records - prev) as f64 / elapsed } else { 0.0 };
                node_rate += rate;
                let view = replica.view();
                let last_epoch = self.log_rank_epoch(replica.shard, &p).await.unwrap_or(0);
                let mut lag_records = std::collections::HashMap::new();
                let mut lag_bytes = std::collections::HashMap::new();
                let mut lag_seconds = std::collections::HashMap::new();
                let commit = match replica.leader_state() {
                    Some(leader) => {
                        let core = leader.core.lock();
                        for (id, _) in core.followers() {
                            if let Some(lag) = core.lag(id, now_us()) {
                                lag_records.insert(id, lag.records);
                                lag_bytes.insert(id, lag.bytes);
                                lag_seconds.insert(id, lag.flush_seconds);
                            }
                        }
                        core.commit()
                    }
                    None => replica.readable(),
                };
                requests.push(HeartbeatRequest {
                    shard_id: replica.shard,
                    region_id: self.region,
                    entity_count: (p.last_seqno + 1).saturating_sub(p.first_seqno),
                    signal_throughput_eps: rate,
                    disk_bytes: disk,
                    replication_lag: lag_records,
                    replication_lag_bytes: lag_bytes,
                    replication_lag_seconds: lag_seconds,
                    last_heartbeat_ns: now_us() * 1_000,
                    node_id: self.me,
                    epoch: view.epoch,
                    last_seqno: p.last_seqno,
                    durable_seqno: p.durable_seqno,
                    commit_seqno: commit,
                    is_leader: view.role == Role::Leader,
                    leader_node_id: replica.leader_id(self.me).unwrap_or(0),
                    last_epoch,
                    needs_new_epoch: self.early_shipping() && replica.needs_new_epoch(),
                    disk_full: self.disk_full(),
                    disk_free_bytes: self.wal.disk_space().map_or(0, |d| d.free()),
                });
            }
            self.metrics.append_rate.set(node_rate);
            let mut sends = Vec::new();
            let sent_us = now_us();
            for channel in &targets {
                for request in &requests {
                    let mut client =
                        walship_proto::replication::wal_shipping_client::WalShippingClient::new(channel.clone());
                    let (shard, epoch) = (request.shard_id, request.epoch);
                    let mut request = tonic::Request::new(request.clone());
                    request.set_timeout(interval.max(Duration::from_millis(200)));
                    sends.push(async move { (shard, epoch, client.heartbeat(request).await) });
                }
            }
            for (shard, epoch, answer) in futures::future::join_all(sends).await {
                self.metrics.heartbeats_sent.with_label_values(&[if answer.is_ok() { "ok" } else { "error" }]).inc();
                if answer.is_ok_and(|a| a.get_ref().leader_confirmed) {
                    self.on_leader_confirmed(shard, epoch, sent_us);
                }
            }
        }
    }

    /// The active coordinator confirmed that this node leads `shard` in
    /// `epoch`, answering a heartbeat sent at `sent_us`: the lease renews.
    fn on_leader_confirmed(&self, shard: ShardId, epoch: u64, sent_us: u64) {
        let Some(replica) = self.replica(shard) else { return };
        let Some(leader) = replica.leader_state().filter(|l| l.epoch == epoch) else { return };
        let mut core = leader.core.lock();
        core.on_coordinator_confirmed(sent_us);
        replica.publish_leader(&core, &self.metrics);
    }

    /// Refreshes the per-follower gauges often enough that an idle,
    /// caught-up follower shows zero lag rather than a stale figure.
    async fn run_metrics(self: Arc<Self>) {
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = self.shutdown.cancelled() => return,
            }
            let now = now_us();
            for replica in self.replicas.values() {
                let Some(leader) = replica.leader_state() else { continue };
                let core = leader.core.lock();
                for (id, progress) in core.followers() {
                    if let Some(lag) = core.lag(id, now) {
                        self.metrics.set_follower(replica.shard, id, &progress, &lag);
                    }
                }
            }
        }
    }
}

fn follower_status(id: NodeId, progress: &FollowerProgress, lag: &Lag, now: u64) -> FollowerStatus {
    FollowerStatus {
        node_id: id,
        mode: progress.mode.as_str().into(),
        acked_seqno: progress.acked,
        in_flight: progress.in_flight,
        lag_records: lag.records,
        lag_bytes: lag.bytes,
        lag_write_seconds: lag.write_seconds,
        lag_flush_seconds: lag.flush_seconds,
        lag_apply_seconds: lag.apply_seconds,
        last_reply_ms_ago: progress.last_reply_us.map(|t| now.saturating_sub(t) / 1_000),
    }
}

#[cfg(test)]
mod ship_stream_tests {
    use std::pin::Pin;

    use futures::Stream;
    use tonic::{Request, Response};
    use walship_proto::replication::wal_shipping_client::WalShippingClient;
    use walship_proto::replication::wal_shipping_server::{WalShipping, WalShippingServer};
    use walship_proto::replication::{HeartbeatResponse, StreamRequest};

    use super::*;

    /// A peer from before `ShipSegments`: the stream is `UNIMPLEMENTED` (what
    /// tonic answers for a method it does not know), unary pushes work and
    /// answer with the pushed seqno.
    struct OldPeer;

    type Answers = Pin<Box<dyn Stream<Item = Result<ShipSegmentResponse, Status>> + Send>>;
    type Segments = Pin<Box<dyn Stream<Item = Result<ShipSegmentRequest, Status>> + Send>>;

    #[tonic::async_trait]
    impl WalShipping for OldPeer {
        async fn ship_segment(
            &self,
            request: Request<ShipSegmentRequest>,
        ) -> Result<Response<ShipSegmentResponse>, Status> {
            let seqno = request.get_ref().id.unwrap_or_default().seqno;
            Ok(Response::new(ShipSegmentResponse { accepted: true, applied_seqno: seqno, epoch: 1 }))
        }
        type ShipSegmentsStream = Answers;
        async fn ship_segments(
            &self,
            _: Request<tonic::Streaming<ShipSegmentRequest>>,
        ) -> Result<Response<Answers>, Status> {
            Err(Status::unimplemented("unknown method ShipSegments"))
        }
        type StreamSegmentsStream = Segments;
        async fn stream_segments(&self, _: Request<StreamRequest>) -> Result<Response<Segments>, Status> {
            Err(Status::unimplemented("not in this test"))
        }
        async fn heartbeat(&self, _: Request<HeartbeatRequest>) -> Result<Response<HeartbeatResponse>, Status> {
            Err(Status::unimplemented("not in this test"))
        }
    }

    #[tokio::test]
    async fn a_peer_without_ship_segments_gets_unary_pushes() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(WalShippingServer::new(OldPeer))
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
        );
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}")).unwrap().connect_lazy();
        let (calls, rx) = tokio::sync::mpsc::channel(SHIP_STREAM_DEPTH);
        tokio::spawn(run_ship_stream(WalShippingClient::new(channel), rx));
        for seqno in [5, 9, 12] {
            let (reply, answer) = tokio::sync::oneshot::channel();
            let request = ShipSegmentRequest {
                id: Some(WalSegmentId { region_id: 1, shard_id: 1, seqno }),
                ..Default::default()
            };
            calls.send((request, reply)).await.unwrap();
            let answer = answer.await.unwrap().expect("answered by the unary call");
            assert_eq!(answer.applied_seqno, seqno, "each push answered by its own call");
        }
        server.abort();
    }
}
