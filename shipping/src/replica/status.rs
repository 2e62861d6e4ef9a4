//! What a node tells about its replicas: `/v1/status` entries, heartbeats
//! received, and the per-follower gauges refreshed often enough that an
//! idle caught-up follower shows zero lag. The heartbeats it sends to the
//! coordinator (positions, lag, the log epoch a failover ranks by, whether
//! it needs a new epoch, known corruption) are `heartbeats.rs`.
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use walship_proto::replication::HeartbeatRequest;
use walship_wal::ShardId;

use super::{ReplicaError, ReplicationNode, now_us};
use crate::NodeId;
use crate::config::ClusterConfig;
use crate::core::leader::{FollowerProgress, Lag};

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
    /// The follower has told this leader its position. Until it does (it
    /// has been down since this leadership began), `acked_seqno` is 0 and
    /// the lag counts the whole log: an upper bound, not its position. The
    /// coordinator then counts from the follower's own last heartbeat.
    #[serde(default)]
    pub position_known: bool,
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
    /// Ranges of this replica's log known to be corrupt (a checksum failed
    /// on a read, a scrub or the start-up check): never served; a follower
    /// truncates and refetches them, a leader hands over when an intact
    /// replica holds everything acknowledged. Empty when none.
    pub corruption: Vec<CorruptRangeStatus>,
    /// The shard's archive, on the leader that archives it (`None` on
    /// followers and without an object store).
    #[serde(default)]
    pub archive: Option<super::archive::ArchiveStatus>,
    /// The shard's producer sessions as this replica's table holds them
    /// (every replica builds the same table from the log).
    #[serde(default)]
    pub producers: ProducersStatus,
}

/// A replica's producer-session table (exactly-once appends).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct ProducersStatus {
    /// Producers remembered and not idle past `[producers] idle_expiry_s`.
    pub count: u64,
    /// Appends this replica answered as duplicates (retries of records
    /// already written) since it started.
    pub duplicates: u64,
    /// Producers forgotten since the table was last rebuilt (start, or a
    /// truncation): idle past the expiry, or evicted past
    /// `[producers] max_per_shard`.
    pub expired: u64,
    pub evicted: u64,
    /// Snapshots of the table kept beside the log.
    pub snapshots: u64,
    /// Why producer appends are refused here, if they are (the table met a
    /// corrupt record; repaired with the log).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unavailable: Option<String>,
}

impl ProducersStatus {
    fn of(stats: walship_wal::ProducerStats) -> ProducersStatus {
        ProducersStatus {
            count: stats.producers as u64,
            duplicates: stats.duplicates,
            expired: stats.expired,
            evicted: stats.evicted,
            snapshots: stats.snapshots as u64,
            unavailable: stats.damaged,
        }
    }
}

/// A corrupt range of one replica's log.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct CorruptRangeStatus {
    pub first_seqno: u64,
    pub last_seqno: u64,
    /// The WAL file holding them, or the data dir when the file is unknown.
    pub file: String,
    /// `read`, `scrub` or `startup`.
    pub found_by: String,
    pub found_unix_ms: u64,
}

impl CorruptRangeStatus {
    fn of(range: &walship_wal::CorruptRange) -> CorruptRangeStatus {
        let file = range.file.as_ref().or(range.location.as_ref());
        CorruptRangeStatus {
            first_seqno: range.first_bad_seqno,
            last_seqno: range.last_bad_seqno,
            file: file.map_or_else(|| "unknown".to_string(), |f| f.display().to_string()),
            found_by: range.how.as_str().to_string(),
            found_unix_ms: range.found_at.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64),
        }
    }
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

/// Why a heartbeat of `node` is refused, if it is: no `node_id` (a sender
/// knowing only the seed's fields 1..7; walship judges liveness and
/// failover per node, so a report must name its node), or a node not of
/// `cluster`. Nodes and the coordinator answer alike.
pub fn reporting_node_refusal(node: NodeId, cluster: &ClusterConfig) -> Option<String> {
    if node == 0 {
        return Some(
            "heartbeat without node_id (field 8): walship needs the reporting node (its liveness and failover are per \
             node)"
                .to_string(),
        );
    }
    cluster.node(node).is_none().then(|| format!("heartbeat from unknown node {node}"))
}

impl ReplicationNode {
    pub fn status(&self) -> Vec<ReplicaStatus> {
        let now = now_us();
        self.replicas()
            .iter()
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
                        (core.commit().0, followers)
                    }
                    None => (replica.follower.leader_commit.get(), Vec::new()),
                };
                let role = view.role.as_str();
                ReplicaStatus {
                    shard_id: replica.shard,
                    role: role.into(),
                    epoch: view.epoch.0,
                    epoch_seen: replica.epoch_seen(),
                    leader: replica.leader_id(self.me),
                    replicas: replica.members().voters,
                    first_seqno: p.first_seqno,
                    last_seqno: self.last_written(replica.shard, &p),
                    durable_seqno: p.durable_seqno,
                    commit_seqno: commit,
                    followers,
                    corruption: self.wal.shard_corruption(replica.shard).iter().map(CorruptRangeStatus::of).collect(),
                    archive: self.archive_status(replica.shard),
                    producers: self.wal.producer_stats(replica.shard, now).map(ProducersStatus::of).unwrap_or_default(),
                }
            })
            .collect()
    }

    /// The newest seqno this replica has written: the store's last, or
    /// beyond it what the WAL has sequenced and a leader may already have
    /// shipped (early shipping). Reporting less would show a follower ahead
    /// of its leader.
    pub(super) fn last_written(&self, shard: ShardId, p: &walship_wal::Positions) -> u64 {
        let written = self.wal.written_watch(shard).map_or(0, |w| *w.borrow());
        p.last_seqno.max(written)
    }

    /// Heartbeats received (newest per node and shard).
    pub fn received_heartbeats(&self) -> Vec<ReceivedHeartbeat> {
        self.heartbeats
            .lock()
            .values()
            .map(|(hb, at)| ReceivedHeartbeat { received_ms_ago: at.elapsed().as_millis() as u64, ..hb.clone() })
            .collect()
    }

    /// Whether this node keeps `request` (see [`Self::on_heartbeat`]): from
    /// a node of the cluster, about a shard of the cluster config (replica
    /// changes move replicas, not shards) or one this node hosts. Anything else would grow the store
    /// without bound (one entry per shard id a caller makes up).
    pub fn check_heartbeat(&self, request: &HeartbeatRequest) -> Result<(), ReplicaError> {
        if let Some(refusal) = reporting_node_refusal(request.node_id, &self.config) {
            return Err(self.counted(ReplicaError::BadRequest(refusal)));
        }
        let configured = self.configured_shards.contains(&request.shard_id);
        if !configured && self.replica(request.shard_id).is_none() {
            return Err(self.counted(ReplicaError::UnknownShard { shard: request.shard_id, node: self.me }));
        }
        Ok(())
    }

    /// Records a heartbeat (the `Heartbeat` RPC), refused as
    /// [`Self::check_heartbeat`] says, changing nothing.
    pub fn on_heartbeat(&self, request: &HeartbeatRequest) -> Result<(), ReplicaError> {
        self.check_heartbeat(request)?;
        self.record_heartbeat(request);
        Ok(())
    }

    /// Records a checked heartbeat.
    pub fn record_heartbeat(&self, request: &HeartbeatRequest) {
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
    }

    /// Refreshes the per-follower gauges often enough that an idle,
    /// caught-up follower shows zero lag rather than a stale figure.
    pub(super) async fn run_metrics(self: Arc<Self>) {
        if !self.metrics.per_shard {
            return self.run_metrics_aggregate().await;
        }
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        // A settled shard's gauges, once set after it settled, stay true
        // (nothing moved): the activity at which each was last set.
        let mut set_at: std::collections::HashMap<ShardId, u64> = Default::default();
        // Replicas whose gauges may still move: those touched since the
        // last tick and those not settled then (see `shard::Touched`).
        let mut moving: std::collections::BTreeSet<ShardId> = Default::default();
        // Each pair's gauges, looked up once (a lookup formats and hashes
        // labels: for thousands of shards taking leaders at once it showed).
        let mut gauges: std::collections::HashMap<(ShardId, NodeId), crate::metrics::FollowerGauges> =
            Default::default();
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = self.shutdown.cancelled() => return,
            }
            let now = now_us();
            moving.append(&mut self.touched.take_gauges());
            moving.retain(|&shard| {
                let Some(replica) = self.replica(shard) else { return false };
                let activity = replica.activity();
                if replica.settled() && set_at.get(&shard) == Some(&activity) {
                    return false;
                }
                set_at.insert(shard, activity);
                each_follower_lag(&replica, now, |id, progress, lag| {
                    gauges
                        .entry((shard, id))
                        .or_insert_with(|| self.metrics.follower_gauges(shard, id))
                        .set(progress, lag)
                });
                true
            });
        }
    }

    /// The follower gauges without per-shard series
    /// (`[replication] per_shard_metrics = false`): once a second, each
    /// follower's worst lag over every shard this node leads.
    async fn run_metrics_aggregate(self: Arc<Self>) {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = self.shutdown.cancelled() => return,
            }
            let now = now_us();
            let mut followers = BTreeMap::<NodeId, crate::metrics::FollowerAggregate>::new();
            for replica in self.replicas() {
                each_follower_lag(&replica, now, |id, progress, lag| {
                    followers.entry(id).or_default().add(progress, lag)
                });
            }
            self.metrics.set_followers_aggregate(&followers);
        }
    }
}

fn follower_status(id: NodeId, progress: &FollowerProgress, lag: &Lag, now: u64) -> FollowerStatus {
    FollowerStatus {
        node_id: id,
        mode: progress.mode.as_str().into(),
        acked_seqno: progress.acked.0,
        in_flight: progress.in_flight,
        lag_records: lag.records,
        lag_bytes: lag.bytes,
        lag_write_seconds: lag.write_seconds,
        lag_flush_seconds: lag.flush_seconds,
        lag_apply_seconds: lag.apply_seconds,
        last_reply_ms_ago: progress.last_reply_us.map(|t| now.saturating_sub(t) / 1_000),
        position_known: progress.last_reply_us.is_some(),
    }
}

/// Each follower's progress and lag at `now`, if `replica` leads.
fn each_follower_lag(
    replica: &super::ShardReplica,
    now: u64,
    mut f: impl FnMut(NodeId, &crate::core::leader::FollowerProgress, &crate::core::leader::Lag),
) {
    let Some(leader) = replica.leader_state() else { return };
    let core = leader.core.lock();
    for (id, progress) in core.followers() {
        if let Some(lag) = core.lag(id, now) {
            f(id, &progress, &lag);
        }
    }
}
