//! The partition drill (`POST /v1/drills/partition`): a network partition
//! between a shard's leader and its followers, while every node still
//! reaches the coordinator, repeated for a number of trials.
//!
//! The partition is *simulated at the replication layer*: each node is told
//! (`Control.Partition`, honoured only by nodes started with
//! `--allow-crash-drills`) to treat some peers as unreachable for
//! node-to-node replication traffic. A dev cluster's processes run as one
//! user, so a drill cannot cut links with a firewall the way the black-box
//! tests do; heartbeats, the coordinator's calls and client traffic are not
//! cut, which is the scenario (a leader cut from its followers while all
//! reach the coordinator). Each node's partition carries a deadline, so a
//! coordinator dying mid-drill cannot leave the cluster cut for good.
//!
//! Per trial: QUORUM load runs; the leader is cut from its followers
//! (`leader,followers`) or the first follower from the leader
//! (`follower,leader`); the drill measures the time from the cut to the
//! first QUORUM append acknowledged in a newer epoch, and sends `LOCAL`
//! appends straight to the old leader, counting those it acknowledged
//! although sent a replication timeout or more after it lost its majority
//! (CheckQuorum says: none). The partition is held `seconds` from the cut,
//! healed, and every acknowledged QUORUM record is checked on every replica
//! once they converge.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use walship_proto::log::{AppendRecord, AppendRequest, Durability, PartitionRequest};

use super::{Budget, FRAME_OVERHEAD, Keep, Load, MAX_LOAD_BYTES, MIN_DRILL_HEADROOM, default_clients};
use crate::NodeId;
use crate::control::coordinator::{CoordError, Coordinator};

/// The shapes a partition drill can cut.
const BETWEEN: [&str; 2] = ["leader,followers", "follower,leader"];
/// At most this many trials per drill.
const MAX_TRIALS: u32 = 20;
/// At most this long a partition is held, per trial.
const MAX_SECONDS: u64 = 300;
/// How long a trial waits for a new leader's first acknowledgement.
const NEW_LEADER_PATIENCE: Duration = Duration::from_secs(30);
/// Each node's partition outlives the planned hold by this much, so the
/// drill heals it itself; the deadline is only the backstop for a
/// coordinator that died mid-drill.
const PARTITION_SLACK_MS: u64 = 60_000;

/// `POST /v1/drills/partition`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PartitionDrillRequest {
    #[serde(deserialize_with = "crate::control::lenient::int")]
    pub shard: u32,
    /// `leader,followers` (the leader cut from every follower: a failover
    /// is expected) or `follower,leader` (the first follower cut from the
    /// leader: no failover is expected).
    #[serde(default = "default_between")]
    pub between: String,
    /// How long each trial's partition lasts, from the cut (1..=300).
    #[serde(default = "default_seconds", deserialize_with = "crate::control::lenient::int")]
    #[schema(minimum = 1, maximum = 300)]
    pub seconds: u64,
    /// Trials, one after another (1..=20).
    #[serde(default = "default_trials", deserialize_with = "crate::control::lenient::int")]
    #[schema(minimum = 1, maximum = 20)]
    pub trials: u32,
    /// Concurrent QUORUM appenders of the load generator (1..=256).
    #[serde(default = "default_clients", deserialize_with = "crate::control::lenient::int")]
    #[schema(minimum = 1, maximum = 256)]
    pub clients: usize,
}

fn default_between() -> String {
    BETWEEN[0].into()
}
fn default_seconds() -> u64 {
    2
}
fn default_trials() -> u32 {
    1
}

/// One trial of a partition drill.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct PartitionTrial {
    /// 1-based.
    pub trial: u32,
    pub old_leader: NodeId,
    pub old_epoch: u64,
    pub new_leader: NodeId,
    pub new_epoch: u64,
    /// The node cut from the leader (`follower,leader`); none for `leader,followers`.
    pub cut_follower: Option<NodeId>,
    /// Cut -> the first QUORUM append acknowledged in a newer epoch; none
    /// if no new leader acknowledged one (expected for `follower,leader`).
    pub time_to_new_leader_ms: Option<u64>,
    /// Cut -> the coordinator records a newer epoch (the failover itself;
    /// the first acknowledgement also waits for clients to leave the old
    /// leader, whose pending appends fail when its lease runs out).
    pub time_to_failover_ms: Option<u64>,
    /// Failovers the coordinator recorded for the shard from the cut to
    /// convergence after the heal.
    pub failovers: u64,
    /// QUORUM records acknowledged during the trial.
    pub acked: u64,
    /// Acknowledged records missing or different on some replica after the
    /// heal, plus replicas diverging from the leader (must be 0).
    pub records_lost: u64,
    /// `LOCAL` appends sent straight to the old leader after it lost its
    /// majority and acknowledged by it: within the replication timeout
    /// (its lease still running: allowed), and sent a replication timeout
    /// or more after (must be 0). None for `follower,leader`.
    pub old_leader_local_acks_within_timeout: Option<u64>,
    pub old_leader_local_acks_after_timeout: Option<u64>,
    /// Cut -> the old leader's last `LOCAL` acknowledgement.
    pub old_leader_last_local_ack_ms: Option<u64>,
}

/// p50, p99 (nearest rank) and max of a set of times.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct TimeSummary {
    pub count: u64,
    pub p50_ms: u64,
    pub p99_ms: u64,
    pub max_ms: u64,
}

impl TimeSummary {
    fn of(mut values: Vec<u64>) -> Option<TimeSummary> {
        if values.is_empty() {
            return None;
        }
        values.sort_unstable();
        let rank = |p: f64| values[((p * values.len() as f64).ceil() as usize).clamp(1, values.len()) - 1];
        Some(TimeSummary {
            count: values.len() as u64,
            p50_ms: rank(0.50),
            p99_ms: rank(0.99),
            max_ms: *values.last().expect("not empty"),
        })
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct PartitionDrillResult {
    pub between: String,
    pub seconds: u64,
    /// The cluster's replication timeout (max of leader_timeout_ms and 3
    /// keepalives): a leader cut from its majority stops acknowledging
    /// within it.
    pub replication_timeout_ms: u64,
    pub trials: Vec<PartitionTrial>,
    /// Over the trials that got a new leader.
    pub time_to_new_leader: Option<TimeSummary>,
    pub failovers: u64,
    pub records_lost: u64,
    /// Summed over the trials; none for `follower,leader`.
    pub old_leader_local_acks_after_timeout: Option<u64>,
}

/// `LOCAL` appends sent one after another straight to one node: (sent,
/// acknowledged) instants of each acknowledged in `epoch` or older.
struct LocalProbe {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Vec<(Instant, Instant)>>,
}

impl LocalProbe {
    fn start(
        coordinator: &Arc<Coordinator>,
        node: NodeId,
        shard: u32,
        epoch: u64,
        tag: String,
        budget: &Arc<Budget>,
    ) -> LocalProbe {
        let stop = Arc::new(AtomicBool::new(false));
        let (flag, log, budget) = (stop.clone(), coordinator.peers.log(node), budget.clone());
        let task = tokio::spawn(async move {
            let mut acked = Vec::new();
            let Some(mut log) = log else { return acked };
            let mut n = 0u64;
            while !flag.load(Ordering::Relaxed) {
                n += 1;
                let payload = Bytes::from(format!("{tag}-local-{n}"));
                if !budget.take(payload.len() as u64 + FRAME_OVERHEAD) {
                    break;
                }
                let mut request = tonic::Request::new(AppendRequest {
                    shard_id: shard,
                    records: vec![AppendRecord { key: Bytes::new(), payload }],
                    durability: Durability::Local as i32,
                    ..Default::default()
                });
                request.set_timeout(Duration::from_secs(2));
                let sent = Instant::now();
                match log.append(request).await {
                    // Only the old leadership's acknowledgements count (a
                    // node never forwards, but an ack in a newer epoch
                    // would be another leadership's).
                    Ok(r) if r.get_ref().epoch <= epoch => acked.push((sent, Instant::now())),
                    _ => {}
                }
                // Paced: these records only probe the old leader's lease,
                // and they are truncated from its log after the heal.
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            acked
        });
        LocalProbe { stop, task }
    }

    async fn stop(self) -> Vec<(Instant, Instant)> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap_or_default()
    }
}

impl Coordinator {
    /// Starts a partition drill; returns its id. Refuses, changing nothing,
    /// an unknown shard (404), `between` other than the supported shapes,
    /// trials outside 1..=20, seconds outside 1..=300, clients outside
    /// 1..=256, and a shard with fewer than 3 replicas (400).
    pub async fn start_partition_drill(self: &Arc<Self>, request: PartitionDrillRequest) -> Result<String, CoordError> {
        if !BETWEEN.contains(&request.between.as_str()) {
            return Err(CoordError::BadRequest(format!(
                "between must be one of {}, not {:?}",
                BETWEEN.map(|b| format!("{b:?}")).join(", "),
                request.between
            )));
        }
        if !(1..=MAX_TRIALS).contains(&request.trials)
            || !(1..=MAX_SECONDS).contains(&request.seconds)
            || !(1..=256).contains(&request.clients)
        {
            return Err(CoordError::BadRequest(format!(
                "trials must be 1..={MAX_TRIALS}, seconds 1..={MAX_SECONDS} and clients 1..=256"
            )));
        }
        let state = self.state().ok_or(CoordError::NotActive)?;
        let record = state.shards.get(&request.shard).ok_or(CoordError::UnknownShard(request.shard))?;
        if record.leader.is_none() {
            return Err(CoordError::Busy(request.shard));
        }
        if record.replicas.len() < 3 {
            // With two replicas neither side of the cut is a majority: no
            // leader could acknowledge anything until the heal.
            return Err(CoordError::BadRequest(format!(
                "shard {} has {} replicas; a partition drill needs at least 3",
                request.shard,
                record.replicas.len()
            )));
        }
        let headroom = self.retention_headroom(request.shard, &record.replicas, MIN_DRILL_HEADROOM).await?;
        let budget = Budget::new(headroom.min(MAX_LOAD_BYTES));
        let id = self.drills.create("partition", request.shard)?;
        let (me, drill, load_budget) = (self.clone(), id.clone(), budget.clone());
        self.run_drill(
            id.clone(),
            headroom,
            budget,
            async move { me.partition_drill(&drill, &request, &load_budget).await },
            |r, out| r.partition = Some(out),
        );
        Ok(id)
    }

    async fn partition_drill(
        self: &Arc<Self>,
        id: &str,
        request: &PartitionDrillRequest,
        budget: &Arc<Budget>,
    ) -> Result<PartitionDrillResult, String> {
        let timeout = self.config.replication.replication_timeout();
        let mut trials = Vec::new();
        for trial in 1..=request.trials {
            trials.push(self.partition_trial(id, request, trial, budget).await?);
        }
        let leader_cut = request.between == BETWEEN[0];
        Ok(PartitionDrillResult {
            between: request.between.clone(),
            seconds: request.seconds,
            replication_timeout_ms: timeout.as_millis() as u64,
            time_to_new_leader: TimeSummary::of(trials.iter().filter_map(|t| t.time_to_new_leader_ms).collect()),
            failovers: trials.iter().map(|t| t.failovers).sum(),
            records_lost: trials.iter().map(|t| t.records_lost).sum(),
            old_leader_local_acks_after_timeout: leader_cut
                .then(|| trials.iter().filter_map(|t| t.old_leader_local_acks_after_timeout).sum()),
            trials,
        })
    }

    /// Tells each `(node, peers)` to treat `peers` as unreachable for
    /// `millis` (0 heals); returns when each answered. Every node is asked
    /// even if one fails; the first failure is returned.
    async fn set_partition(&self, cuts: &[(NodeId, Vec<NodeId>)], millis: u64) -> Result<Vec<Instant>, String> {
        let mut answered = Vec::new();
        let mut first_error = None;
        for (node, peers) in cuts {
            let outcome = match self.peers.control(*node) {
                Some(mut c) => {
                    let mut r = tonic::Request::new(PartitionRequest { peers: peers.clone(), millis });
                    r.set_timeout(Duration::from_secs(2));
                    c.partition(r).await.map_err(|s| format!("node {node}: {}: {}", s.code(), s.message()))
                }
                None => Err(format!("no client for node {node}")),
            };
            answered.push(Instant::now());
            if let Err(e) = outcome {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(answered), Err)
    }

    async fn partition_trial(
        self: &Arc<Self>,
        id: &str,
        request: &PartitionDrillRequest,
        trial: u32,
        budget: &Arc<Budget>,
    ) -> Result<PartitionTrial, String> {
        let shard = request.shard;
        let of = request.trials;
        let record = self.state().and_then(|s| s.shards.get(&shard).cloned()).ok_or("not active")?;
        let (old_leader, old_epoch) = (record.leader.ok_or("no leader")?, record.epoch);
        let followers: Vec<NodeId> = record.replicas.iter().copied().filter(|&r| r != old_leader).collect();
        let leader_cut = request.between == BETWEEN[0];
        // The leader's call comes first: from its answer on, it hears no
        // follower, which is when it lost its majority.
        let (cuts, cut_follower) = if leader_cut {
            let mut cuts = vec![(old_leader, followers.clone())];
            cuts.extend(followers.iter().map(|&f| (f, vec![old_leader])));
            (cuts, None)
        } else {
            let f = *followers.first().ok_or("no follower")?;
            (vec![(old_leader, vec![f]), (f, vec![old_leader])], Some(f))
        };
        let tag = format!("{id}-t{trial}");
        self.drills.progress(id, &format!("trial {trial}/{of}: load running"));
        let load = Load::start(self, shard, request.clients, 64, &tag, budget, Keep::Digests);
        let deadline = Instant::now() + Duration::from_secs(10);
        while load.acked_count.load(Ordering::Relaxed) == 0 {
            if Instant::now() > deadline {
                load.stop().await;
                return Err(format!("trial {trial}: the load got no acknowledgement within 10 s before the cut"));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.drills.progress(id, &format!("trial {trial}/{of}: cutting {}", describe(&cuts)));
        let millis = request.seconds * 1_000 + PARTITION_SLACK_MS;
        let cut_at = Instant::now();
        let answered = match self.set_partition(&cuts, millis).await {
            Ok(answered) => answered,
            Err(e) => {
                let _ = self.set_partition(&heal(&cuts), 0).await;
                load.stop().await;
                return Err(format!("trial {trial}: cutting: {e}"));
            }
        };
        let lost_majority_at = answered[0];
        let probe = leader_cut.then(|| LocalProbe::start(self, old_leader, shard, old_epoch, tag.clone(), budget));
        let hold_until = cut_at + Duration::from_secs(request.seconds);
        let mut failed_over = None;
        let first_new = if leader_cut {
            self.drills.progress(id, &format!("trial {trial}/{of}: waiting for a new leader's first QUORUM ack"));
            let mut first = None;
            while cut_at.elapsed() < NEW_LEADER_PATIENCE {
                if failed_over.is_none()
                    && self.state().and_then(|s| s.shards.get(&shard).map(|r| r.epoch)).is_some_and(|e| e > old_epoch)
                {
                    failed_over = Some(cut_at.elapsed());
                }
                if load.acks.lock().await.values().any(|(_, e)| *e > old_epoch) {
                    failed_over.get_or_insert_with(|| cut_at.elapsed());
                    first = Some(cut_at.elapsed());
                    break;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            first
        } else {
            None
        };
        self.drills.progress(id, &format!("trial {trial}/{of}: holding the partition"));
        tokio::time::sleep(hold_until.saturating_duration_since(Instant::now())).await;
        self.drills.progress(id, &format!("trial {trial}/{of}: healing"));
        let healed = self.set_partition(&heal(&cuts), 0).await;
        let local_acks = match probe {
            Some(p) => Some(p.stop().await),
            None => None,
        };
        let acks = load.stop().await;
        let acks = acks.lock().await.clone();
        healed.map_err(|e| format!("trial {trial}: healing: {e}"))?;
        if leader_cut && first_new.is_none() {
            return Err(format!(
                "trial {trial}: no new leader acknowledged a QUORUM append within {NEW_LEADER_PATIENCE:?} of the cut"
            ));
        }
        self.drills.progress(id, &format!("trial {trial}/{of}: healed; verifying acknowledged records"));
        let record = self.state().and_then(|s| s.shards.get(&shard).cloned()).ok_or("not active")?;
        let new_leader = record.leader.ok_or("no leader after the heal")?;
        let (lost, divergent, _) = self.verify(shard, new_leader, &record.replicas, &acks).await?;
        let state = self.state().ok_or("not active")?;
        let failovers = state.failovers.iter().filter(|f| f.shard == shard && f.epoch > old_epoch).count() as u64;
        let new_epoch = state.shards.get(&shard).map_or(record.epoch, |r| r.epoch);
        let new_leader = state.shards.get(&shard).and_then(|r| r.leader).unwrap_or(new_leader);
        // An acknowledgement decided after the lease ran out would be a
        // request sent after it too: counting by send time cannot blame the
        // node for network delay on the way back.
        let lease_end = lost_majority_at + self.config.replication.replication_timeout();
        let counts = local_acks.as_ref().map(|acks| {
            let after = acks.iter().filter(|(sent, _)| *sent >= lease_end).count() as u64;
            let within = acks.iter().filter(|(sent, _)| *sent >= lost_majority_at).count() as u64 - after;
            (within, after)
        });
        let last_local_ack = local_acks
            .as_ref()
            .and_then(|acks| acks.iter().map(|(_, at)| *at).max())
            .map(|at| at.saturating_duration_since(cut_at).as_millis() as u64);
        Ok(PartitionTrial {
            trial,
            old_leader,
            old_epoch,
            new_leader,
            new_epoch,
            cut_follower,
            time_to_new_leader_ms: first_new.map(|d| d.as_millis() as u64),
            time_to_failover_ms: failed_over.map(|d| d.as_millis() as u64),
            failovers,
            acked: acks.len() as u64,
            records_lost: lost + divergent,
            old_leader_local_acks_within_timeout: counts.map(|c| c.0),
            old_leader_local_acks_after_timeout: counts.map(|c| c.1),
            old_leader_last_local_ack_ms: last_local_ack,
        })
    }
}

/// The heal of `cuts`: every node it cut, cut from nobody.
fn heal(cuts: &[(NodeId, Vec<NodeId>)]) -> Vec<(NodeId, Vec<NodeId>)> {
    cuts.iter().map(|(node, _)| (*node, Vec::new())).collect()
}

fn describe(cuts: &[(NodeId, Vec<NodeId>)]) -> String {
    let (node, peers) = &cuts[0];
    format!("node {node} from nodes {peers:?}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summaries_use_the_nearest_rank() {
        assert_eq!(TimeSummary::of(vec![]), None);
        let one = TimeSummary::of(vec![7]).unwrap();
        assert_eq!((one.p50_ms, one.p99_ms, one.max_ms), (7, 7, 7));
        let s = TimeSummary::of((1..=20).rev().collect()).unwrap();
        assert_eq!((s.count, s.p50_ms, s.p99_ms, s.max_ms), (20, 10, 20, 20));
    }
}
