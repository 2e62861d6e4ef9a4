//! The async shell around the replication core: one [`ReplicationNode`] per
//! process, one [`ShardReplica`] per shard it hosts.
//!
//! Leader side, per shard: a driver folds the WAL's durable watch into the
//! [`LeaderCore`] and publishes the commit position; one shipper task per
//! follower asks the core what to send and keeps up to `ship_window`
//! `ShipSegment`s in flight; a retention task compacts what nobody needs.
//!
//! Follower side, per shard: inbound segments (pushed or streamed) pass the
//! envelope check and [`classify`], then are queued to the WAL under a
//! per-shard ordering lock that is held only until they are queued, so many
//! small ships share one group commit. A gap, a boot or a leader's nudge
//! starts one catch-up stream (`StreamSegments`) at a time.
//!
//! Only durable records are ever shipped or served; a follower's
//! `applied_seqno` is its durable frontier; reads on any replica stop at the
//! commit position it knows.

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
use walship_proto::replication::{HeartbeatRequest, ShipSegmentRequest, StreamRequest, WalSegmentId};
use walship_wal::{Segment, ShardId, Wal};

use crate::NodeId;
use crate::config::{ClusterConfig, ShardSpec};
use crate::core::follower::{FollowerView, Inbound, InboundSegment, check_envelope, classify};
use crate::core::leader::{FollowerProgress, Lag, LeaderCore, LeaderSettings, ShipDecision, ShipReply};
use crate::limiter::RateLimiter;
use crate::metrics::ReplicationMetrics;
use crate::peers::Peers;

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
    Follower { leader: NodeId },
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
    core: Mutex<LeaderCore>,
    /// The durable position the core has folded in; shippers wait on it.
    core_durable: watch::Sender<u64>,
}

struct FollowerState {
    /// Serialises queueing to the WAL so frames enter it in seqno order.
    apply_lock: tokio::sync::Mutex<()>,
    /// One past everything applied or queued.
    next_expected: watch::Sender<u64>,
    epoch_seen: AtomicU64,
    /// The newest commit position a leader told us.
    leader_commit: AtomicU64,
    catchup_running: AtomicBool,
    last_contact_us: AtomicU64,
}

/// One shard's replica on this node.
pub struct ShardReplica {
    pub shard: ShardId,
    pub epoch: u64,
    pub role: Role,
    pub replicas: Vec<NodeId>,
    /// What reads may return through: the commit position (leader) or
    /// `min(durable, leader's commit)` (follower).
    readable: watch::Sender<u64>,
    /// Highest seqno durable on every replica (leader only).
    all_durable: watch::Sender<u64>,
    leader: Option<LeaderState>,
    follower: Option<FollowerState>,
}

/// A follower as the leader sees it, for status pages.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
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
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ReplicaStatus {
    pub shard_id: u32,
    /// `leader` or `follower`.
    pub role: String,
    pub epoch: u64,
    pub leader: NodeId,
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
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
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
    fn new(spec: &ShardSpec, me: NodeId, wal: &Wal, settings: LeaderSettings) -> Result<ShardReplica, Status> {
        let positions = wal.positions(spec.id).map_err(|e| Status::internal(e.to_string()))?;
        let followers: Vec<NodeId> = spec.replicas.iter().copied().filter(|&r| r != me).collect();
        let (role, leader, follower) = if spec.leader == me {
            let core = LeaderCore::new(
                spec.epoch,
                &followers,
                positions.first_seqno,
                positions.durable_seqno,
                settings,
                now_us(),
            );
            let state =
                LeaderState { core: Mutex::new(core), core_durable: watch::Sender::new(positions.durable_seqno) };
            (Role::Leader, Some(state), None)
        } else {
            let state = FollowerState {
                apply_lock: tokio::sync::Mutex::new(()),
                next_expected: watch::Sender::new(positions.last_seqno + 1),
                epoch_seen: AtomicU64::new(spec.epoch),
                leader_commit: AtomicU64::new(0),
                catchup_running: AtomicBool::new(false),
                last_contact_us: AtomicU64::new(0),
            };
            (Role::Follower { leader: spec.leader }, None, Some(state))
        };
        Ok(ShardReplica {
            shard: spec.id,
            epoch: spec.epoch,
            role,
            replicas: spec.replicas.clone(),
            readable: watch::Sender::new(0),
            all_durable: watch::Sender::new(0),
            leader,
            follower,
        })
    }

    pub fn is_leader(&self) -> bool {
        self.role == Role::Leader
    }

    pub fn leader_id(&self, me: NodeId) -> NodeId {
        match self.role {
            Role::Leader => me,
            Role::Follower { leader } => leader,
        }
    }

    /// What reads may return through.
    pub fn readable(&self) -> u64 {
        *self.readable.borrow()
    }

    pub fn readable_watch(&self) -> watch::Receiver<u64> {
        self.readable.subscribe()
    }

    /// Waits until `seqno` is durable on a majority (leader only).
    /// Cancellation-safe.
    pub async fn wait_commit(&self, seqno: u64) {
        let mut rx = self.readable.subscribe();
        let _ = rx.wait_for(|c| *c >= seqno).await;
    }

    /// Waits until `seqno` is durable on every replica (leader only).
    /// Cancellation-safe.
    pub async fn wait_all(&self, seqno: u64) {
        let mut rx = self.all_durable.subscribe();
        let _ = rx.wait_for(|c| *c >= seqno).await;
    }

    fn publish_leader(&self, core: &LeaderCore, metrics: &ReplicationMetrics) {
        let commit = core.commit();
        self.readable.send_if_modified(|r| std::mem::replace(r, commit) != commit);
        let all = core.all_durable();
        self.all_durable.send_if_modified(|a| std::mem::replace(a, all) != all);
        metrics.set_commit(self.shard, commit);
    }

    fn publish_follower(&self, durable: u64) {
        let Some(f) = &self.follower else { return };
        let readable = durable.min(f.leader_commit.load(Ordering::Acquire));
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
    heartbeats: Mutex<BTreeMap<(NodeId, u32), (ReceivedHeartbeat, Instant)>>,
    disk_bytes: Box<dyn Fn() -> u64 + Send + Sync>,
    pub shutdown: CancellationToken,
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
    pub fn start(
        me: NodeId,
        config: Arc<ClusterConfig>,
        wal: Wal,
        metrics: ReplicationMetrics,
        disk_bytes: Box<dyn Fn() -> u64 + Send + Sync>,
    ) -> Result<Arc<ReplicationNode>, Status> {
        let node_spec = config
            .node(me)
            .ok_or_else(|| Status::invalid_argument(format!("node {me} is not in the cluster config")))?;
        let r = &config.replication;
        let settings = LeaderSettings {
            window: r.ship_window,
            catchup_threshold_bytes: r.catchup_threshold_bytes,
            keepalive_us: r.keepalive_ms * 1_000,
        };
        let mut replicas = BTreeMap::new();
        for spec in config.shards_of(me) {
            wal.create_shard(spec.id).map_err(|e| Status::internal(e.to_string()))?;
            replicas.insert(spec.id, Arc::new(ShardReplica::new(spec, me, &wal, settings)?));
        }
        let mut addresses = config.addresses();
        addresses.remove(&me);
        let node = Arc::new(ReplicationNode {
            me,
            region: node_spec.region,
            peers: Peers::new(&addresses),
            catchup_budget: RateLimiter::new(r.catchup_rate_bytes_per_s),
            config,
            wal,
            metrics,
            replicas,
            heartbeats: Mutex::new(BTreeMap::new()),
            disk_bytes,
            shutdown: CancellationToken::new(),
        });
        for replica in node.replicas.values() {
            if replica.is_leader() {
                tokio::spawn(node.clone().run_leader_driver(replica.clone()));
                for &follower in replica.replicas.iter().filter(|&&r| r != me) {
                    tokio::spawn(node.clone().run_shipper(replica.clone(), follower));
                }
            } else {
                // Boot: pull whatever was missed while this node was away.
                node.start_catchup(replica.clone());
            }
            tokio::spawn(node.clone().run_retention(replica.clone()));
        }
        tokio::spawn(node.clone().run_heartbeats());
        tokio::spawn(node.clone().run_metrics());
        Ok(node)
    }

    pub fn replica(&self, shard: ShardId) -> Option<&Arc<ShardReplica>> {
        self.replicas.get(&shard)
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

    // ---- leader side -------------------------------------------------

    async fn run_leader_driver(self: Arc<Self>, replica: Arc<ShardReplica>) {
        let Ok(mut durable) = self.wal.durable_watch(replica.shard) else { return };
        let leader = replica.leader.as_ref().expect("leader replica");
        loop {
            let seqno = *durable.borrow_and_update();
            let counters = self.wal.counters(replica.shard).unwrap_or_default();
            {
                let mut core = leader.core.lock();
                core.on_local_durable(seqno, counters.records, counters.bytes, now_us());
                replica.publish_leader(&core, &self.metrics);
            }
            leader.core_durable.send_replace(seqno);
            tokio::select! {
                changed = durable.changed() => if changed.is_err() { return },
                _ = self.shutdown.cancelled() => return,
            }
        }
    }

    async fn run_shipper(self: Arc<Self>, replica: Arc<ShardReplica>, follower: NodeId) {
        let leader = replica.leader.as_ref().expect("leader replica");
        let mut core_durable = leader.core_durable.subscribe();
        let mut in_flight = FuturesUnordered::new();
        let keepalive = self.config.replication.keepalive();
        let batch_bytes = self.config.replication.ship_batch_bytes;
        loop {
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
                        in_flight.push(self.ship(&replica, follower, Some(segment)));
                    }
                    ShipDecision::Keepalive => {
                        leader.core.lock().on_keepalive_sent(follower, now_us());
                        in_flight.push(self.ship(&replica, follower, None));
                    }
                    ShipDecision::Idle => break,
                }
            }
            tokio::select! {
                Some(reply) = in_flight.next(), if !in_flight.is_empty() => {
                    if matches!(reply, ShipReply::Failed) {
                        self.metrics.ship_errors.with_label_values(&[&follower.to_string()]).inc();
                    }
                    let mut core = leader.core.lock();
                    if let Err(epoch) = core.on_reply(follower, reply, now_us()) {
                        // Static leadership: this can only be a misconfiguration
                        // until the coordinator drives failover.
                        tracing::error!(shard = replica.shard, follower, epoch, mine = core.epoch(), "follower has seen a newer epoch: this leader is deposed");
                    }
                    replica.publish_leader(&core, &self.metrics);
                }
                changed = core_durable.changed() => if changed.is_err() { return },
                _ = tokio::time::sleep(keepalive) => {}
                _ = self.shutdown.cancelled() => return,
            }
        }
    }

    /// One ShipSegment (or keepalive when `segment` is none) to `follower`.
    fn ship(
        &self,
        replica: &ShardReplica,
        follower: NodeId,
        segment: Option<Segment>,
    ) -> impl std::future::Future<Output = ShipReply> + use<> {
        let (durable, commit) = {
            let core = replica.leader.as_ref().expect("leader").core.lock();
            (core.durable(), core.commit())
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
            leader_last_seq: durable,
            stream_baseline: 0,
            epoch: replica.epoch,
            leader_node_id: self.me,
            commit_seqno: commit,
        };
        let client = self.peers.shipping(follower);
        let timeout = Duration::from_millis(self.config.replication.ship_timeout_ms);
        async move {
            let Some(mut client) = client else { return ShipReply::Failed };
            let mut request = tonic::Request::new(request);
            request.set_timeout(timeout);
            match client.ship_segment(request).await {
                Ok(r) if r.get_ref().accepted => ShipReply::Applied { applied: r.get_ref().applied_seqno },
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
        let replica = self
            .replica(request.shard_id)
            .ok_or_else(|| refusal(&self.metrics, "unknown_shard", self.unknown_shard(request.shard_id)))?
            .clone();
        let Some(leader) = &replica.leader else {
            let hint = self.describe(replica.leader_id(self.me));
            return Err(refusal(
                &self.metrics,
                "not_leader",
                Status::failed_precondition(format!(
                    "node {} is not the leader of shard {}; the leader is {hint}",
                    self.me, replica.shard
                )),
            ));
        };
        if request.epoch > replica.epoch {
            return Err(refusal(
                &self.metrics,
                "stale_epoch",
                with_metadata(
                    Status::failed_precondition(format!(
                        "requester has seen epoch {} but this leader is at epoch {}",
                        request.epoch, replica.epoch
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
        let durable = leader.core.lock().durable();
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
        let (tx, rx) = tokio::sync::mpsc::channel(2);
        let node = self.clone();
        tokio::spawn(async move {
            let mut next = request.from_seqno;
            let batch = node.config.replication.ship_batch_bytes;
            loop {
                let (durable, commit) = {
                    let core = replica.leader.as_ref().expect("leader").core.lock();
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
                    stream_baseline: 0,
                    epoch: replica.epoch,
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
    /// nothing.
    pub async fn apply_inbound(self: &Arc<Self>, request: &ShipSegmentRequest, source: Source) -> Result<u64, Status> {
        let id = request.id.unwrap_or_default();
        let replica = self
            .replica(id.shard_id)
            .ok_or_else(|| refusal(&self.metrics, "unknown_shard", self.unknown_shard(id.shard_id)))?
            .clone();
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
        let Some(follower) = &replica.follower else {
            return Err(refusal(
                &self.metrics,
                "not_follower",
                Status::failed_precondition(format!(
                    "node {} is the leader of shard {}, not a follower",
                    self.me, replica.shard
                )),
            ));
        };
        let expected_leader = replica.leader_id(self.me);
        if request.leader_node_id != expected_leader {
            return Err(refusal(
                &self.metrics,
                "wrong_leader",
                Status::failed_precondition(format!(
                    "shard {}: segment from node {} but the leader is node {expected_leader}",
                    replica.shard, request.leader_node_id
                )),
            ));
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
        let view = FollowerView {
            epoch_seen: follower.epoch_seen.load(Ordering::Acquire),
            next_expected: *follower.next_expected.borrow(),
            durable,
        };
        let pending = match classify(view, inbound) {
            Inbound::StaleEpoch { seen } => {
                return Err(refusal(
                    &self.metrics,
                    "stale_epoch",
                    with_metadata(
                        Status::failed_precondition(format!(
                            "shard {}: epoch {} is older than epoch {seen} already seen",
                            replica.shard, request.epoch
                        )),
                        EPOCH_METADATA_KEY,
                        seen,
                    ),
                ));
            }
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
            Inbound::Duplicate => None,
            Inbound::Apply { skip } => {
                let segment = segment.expect("apply implies records");
                let last = segment.last_seqno();
                let bytes: usize = segment.frames()[skip..].iter().map(|f| f.len()).sum();
                let frames = segment.into_frames().split_off(skip);
                let queued = self
                    .wal
                    .enqueue_frames(replica.shard, frames)
                    .await
                    .map_err(|e| Status::unavailable(e.to_string()))?;
                follower.next_expected.send_replace(last + 1);
                self.metrics.received_bytes.with_label_values(&[source.as_str()]).inc_by(bytes as u64);
                Some(queued)
            }
        };
        follower.epoch_seen.fetch_max(request.epoch, Ordering::AcqRel);
        follower.leader_commit.fetch_max(request.commit_seqno, Ordering::AcqRel);
        follower.last_contact_us.store(now_us(), Ordering::Release);
        drop(guard);
        if let Some(queued) = pending
            && let Err(e) = queued.await
        {
            // Our bookkeeping and the WAL disagree: resynchronise from the WAL.
            let last = self.wal.positions(replica.shard).map(|p| p.last_seqno).unwrap_or(0);
            follower.next_expected.send_replace(last + 1);
            return Err(Status::failed_precondition(format!("shard {}: applying the segment: {e}", replica.shard)));
        }
        let durable = self.wal.positions(replica.shard).map_err(|e| Status::internal(e.to_string()))?.durable_seqno;
        replica.publish_follower(durable);
        Ok(durable)
    }

    /// Starts a catch-up stream for a follower shard unless one runs.
    pub fn start_catchup(self: &Arc<Self>, replica: Arc<ShardReplica>) {
        let Some(follower) = &replica.follower else { return };
        if follower.catchup_running.swap(true, Ordering::AcqRel) {
            return;
        }
        let node = self.clone();
        tokio::spawn(async move {
            let mut backoff = Duration::from_millis(100);
            loop {
                match node.catch_up_once(&replica).await {
                    Ok(()) => break,
                    Err(status) => {
                        tracing::debug!(shard = replica.shard, %status, "catch-up attempt failed; retrying");
                        tokio::select! {
                            _ = tokio::time::sleep(backoff) => {}
                            _ = node.shutdown.cancelled() => break,
                        }
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                    }
                }
            }
            replica.follower.as_ref().expect("follower").catchup_running.store(false, Ordering::Release);
        });
    }

    async fn catch_up_once(self: &Arc<Self>, replica: &Arc<ShardReplica>) -> Result<(), Status> {
        let follower = replica.follower.as_ref().expect("follower");
        let leader = replica.leader_id(self.me);
        let mut client = self.peers.shipping(leader).ok_or_else(|| Status::unavailable("leader address unknown"))?;
        let from = *follower.next_expected.borrow();
        let request = StreamRequest {
            shard_id: replica.shard,
            from_seqno: from,
            epoch: follower.epoch_seen.load(Ordering::Acquire),
            follower_node_id: self.me,
        };
        let mut stream = client.stream_segments(request).await?.into_inner();
        while let Some(message) = stream.message().await? {
            self.apply_inbound(&message, Source::Stream).await?;
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
            let compact_to = match &replica.leader {
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
                        if let Some(leader) = &replica.leader {
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
                let (commit, followers) = match &replica.leader {
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
                    None => {
                        (replica.follower.as_ref().map_or(0, |f| f.leader_commit.load(Ordering::Acquire)), Vec::new())
                    }
                };
                ReplicaStatus {
                    shard_id: replica.shard,
                    role: if replica.is_leader() { "leader" } else { "follower" }.into(),
                    epoch: replica.epoch,
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
        let target = self.config.replication.heartbeat_to.map(crate::peers::lazy_channel);
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
                let (commit, lag) = match &replica.leader {
                    Some(leader) => {
                        let core = leader.core.lock();
                        let lag =
                            core.followers().map(|(id, pr)| (id, core.durable().saturating_sub(pr.acked))).collect();
                        (core.commit(), lag)
                    }
                    None => (replica.readable(), Default::default()),
                };
                requests.push(HeartbeatRequest {
                    shard_id: replica.shard,
                    region_id: self.region,
                    entity_count: (p.last_seqno + 1).saturating_sub(p.first_seqno),
                    signal_throughput_eps: rate,
                    disk_bytes: disk,
                    replication_lag: lag,
                    last_heartbeat_ns: now_us() * 1_000,
                    node_id: self.me,
                    epoch: replica.epoch,
                    last_seqno: p.last_seqno,
                    durable_seqno: p.durable_seqno,
                    commit_seqno: commit,
                });
            }
            self.metrics.append_rate.set(node_rate);
            let Some(channel) = &target else { continue };
            let mut client = walship_proto::replication::wal_shipping_client::WalShippingClient::new(channel.clone());
            for request in requests {
                let mut request = tonic::Request::new(request);
                request.set_timeout(interval);
                let outcome = if client.heartbeat(request).await.is_ok() { "ok" } else { "error" };
                self.metrics.heartbeats_sent.with_label_values(&[outcome]).inc();
            }
        }
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
                let Some(leader) = &replica.leader else { continue };
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
