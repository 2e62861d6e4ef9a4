//! Leadership rebalancing: moving the leadership of some shards from the
//! nodes that lead more than their share to those that lead less.
//!
//! A failover leaves the shards of a lost node with the survivors, and
//! nothing moves them back when it returns: after a node of three leading
//! 3,334 of 10,000 shards restarts, the other two lead 5,000 each and it
//! leads none, so it appends nothing and the others carry every client.
//! A rebalance evens that out, by the same failover as any other, one per
//! moved shard, in bulks (`promote.rs`): raise the epoch, fence every
//! replica, choose, record, assign. Each moved shard is told which replica
//! to *prefer* ([`plan`] picks it), and the choice takes it only when it
//! answered the fence healthy, holds every acknowledged record and reaches
//! the archive's end: the rules of a targeted failover without
//! `allow_loss`. Otherwise the shard's new leader is chosen as by an
//! automatic failover, except that a tie keeps the old leader: the most
//! up-to-date healthy replica, the old leader when it holds as much as
//! any, which it mostly does:
//! under load the preferred replica may miss the last acknowledged record
//! at the fence (a QUORUM append waits for one follower, not both), and
//! the move is then left to the next rebalance. So a rebalance never
//! loses an acknowledged record; what it costs is a failover's pause of
//! each moved shard's appends (clients see the not-leader answer or a
//! brief unavailability and retry, as at any failover), and records the
//! old leader held that were never acknowledged may be discarded, as at
//! any failover.
//!
//! Who moves ([`plan`]): the fair share is the led shards over the live
//! nodes, rounded up. A shard moves when its leader leads more than that,
//! to the replica of it (a voter, live, its last report a follower's in
//! the shard's epoch, healthy and holding the commit it knew) that leads
//! fewest, if that one leads less than the fair share. Shards whose
//! replica set is changing, or that are failing over, are left alone.
//!
//! When: on request (`POST /v1/rebalance`, `walship rebalance`), and by
//! the coordinator itself every `replication.rebalance_interval_ms` (5
//! minutes by default; 0: never) when a node leads more or less than its
//! share by over `replication.rebalance_slack_percent` of it (at least one
//! shard), no node is silent and no automatic failover is queued or
//! running. Both take the same lock: one rebalance at a time.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::promote::Failing;
use super::reconcile::BULK_FAILOVER_SHARDS;
use super::*;
use crate::control::state::ShardRecord;

/// A rebalance request (the admin API's body).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RebalanceRequest {
    /// Change nothing: report the moves a rebalance would make.
    #[serde(default)]
    pub preview: bool,
    /// The most shards to move (default: every move planned).
    #[serde(default, deserialize_with = "crate::control::lenient::opt_int")]
    #[schema(minimum = 1)]
    pub max_moves: Option<i32>,
}

/// One leadership move.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct RebalanceMove {
    pub shard: u32,
    pub from: NodeId,
    /// The replica planned to take over.
    pub to: NodeId,
    /// The leader the failover chose (after a rebalance that ran): `to`,
    /// or another replica when `to` did not hold every acknowledged
    /// record at the fence; none when it failed (`error`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leader: Option<NodeId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// What a rebalance did (or, for a preview, would do).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct RebalanceOutcome {
    pub preview: bool,
    /// The most shards a live node should lead: the led shards over the
    /// live nodes, rounded up.
    pub fair_share: u64,
    /// Shards each live node led before (by node id).
    #[schema(value_type = BTreeMap<String, u64>)]
    pub leads_before: BTreeMap<NodeId, u64>,
    /// The moves planned (and, unless a preview, made).
    pub moves: Vec<RebalanceMove>,
    /// Moves whose shard is now led by the planned replica.
    pub moved: u64,
    /// Shards each live node leads now (a preview: would lead).
    #[schema(value_type = BTreeMap<String, u64>)]
    pub leads_after: BTreeMap<NodeId, u64>,
    pub took_ms: u64,
}

/// Moves [`plan`] chose, with the share they aim at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub fair_share: usize,
    pub leads_before: BTreeMap<NodeId, usize>,
    /// What each live node would lead once the moves are made.
    pub leads_after: BTreeMap<NodeId, usize>,
    /// `(shard, from, to)`, in shard order.
    pub moves: Vec<(u32, NodeId, NodeId)>,
}

/// Plans a rebalance of the leaderships in `shards` over the `live` nodes
/// (module docs): moves only when some node leads more than the fair share
/// plus `slack`, or less than it minus `slack`, then every node past the
/// fair share gives shards to the
/// replicas `can_lead` allows that lead least, until it is down to the
/// fair share or they are up to it. At most `max_moves`.
pub fn plan(
    shards: &BTreeMap<u32, Arc<ShardRecord>>,
    live: &BTreeSet<NodeId>,
    can_lead: impl Fn(u32, &ShardRecord, NodeId) -> bool,
    slack: impl Fn(usize) -> usize,
    max_moves: usize,
) -> Plan {
    let all = crate::control::state::leads(shards);
    let mut leads: BTreeMap<NodeId, usize> = live.iter().map(|n| (*n, all.get(n).copied().unwrap_or(0))).collect();
    let led: usize = leads.values().sum();
    let fair_share = if live.is_empty() { 0 } else { led.div_ceil(live.len()) };
    let leads_before = leads.clone();
    let mut moves = Vec::new();
    let slack = slack(fair_share);
    if leads.values().all(|&n| n <= fair_share + slack && n + slack >= fair_share) {
        return Plan { fair_share, leads_before, leads_after: leads, moves };
    }
    for (&shard, record) in shards {
        if moves.len() >= max_moves {
            break;
        }
        let Some(from) = record.leader else { continue };
        if leads.get(&from).is_none_or(|&n| n <= fair_share) || !record.joint.is_empty() {
            continue;
        }
        let to = record
            .replicas
            .iter()
            .copied()
            .filter(|&n| n != from && leads.get(&n).is_some_and(|&l| l < fair_share) && can_lead(shard, record, n))
            .min_by_key(|n| (leads[n], *n));
        if let Some(to) = to {
            *leads.get_mut(&from).expect("counted") -= 1;
            *leads.get_mut(&to).expect("counted") += 1;
            moves.push((shard, from, to));
        }
    }
    Plan { fair_share, leads_before, leads_after: leads, moves }
}

impl Coordinator {
    /// Runs (or previews) a rebalance on request: every node past the fair
    /// share, no slack.
    pub async fn rebalance(&self, request: RebalanceRequest) -> Result<RebalanceOutcome, CoordError> {
        let max_moves = request.max_moves.map_or(usize::MAX, |m| usize::try_from(m).unwrap_or(0));
        if max_moves == 0 {
            return Err(CoordError::BadRequest("max_moves must be at least 1".into()));
        }
        let _one = self.rebalancing.try_lock().map_err(|_| CoordError::Conflict {
            code: "rebalance_running",
            message: "a rebalance is already running; try again once it ends".into(),
        })?;
        self.rebalance_locked(request.preview, |_| 0, max_moves, "rebalance").await
    }

    /// The plan of a rebalance now, and (unless `preview`) its moves made,
    /// bulk after bulk. The caller holds `rebalancing`.
    async fn rebalance_locked(
        &self,
        preview: bool,
        slack: impl Fn(usize) -> usize,
        max_moves: usize,
        reason: &str,
    ) -> Result<RebalanceOutcome, CoordError> {
        let started = Instant::now();
        let state = self.state().filter(|_| self.is_active()).ok_or(CoordError::NotActive)?;
        let timeout = Duration::from_millis(self.config.replication.leader_timeout_ms);
        let plan = {
            // Taken before the reports' lock, never under it.
            let failing_over = self.failing_over.lock().clone();
            let changing = self.changes.shards_changing();
            let reports = self.reports();
            let live: BTreeSet<NodeId> =
                self.config.nodes.iter().map(|n| n.id).filter(|&n| reports.alive(n, timeout)).collect();
            let can_lead = |shard: u32, record: &ShardRecord, node: NodeId| {
                if failing_over.contains(&shard) || changing.contains(&shard) {
                    return false;
                }
                // Caught up by its own last report: it holds what it knows
                // committed. (Against the leader's newer commit a follower
                // under load is always a few records short.)
                reports.heartbeat(node, shard).is_some_and(|hb| {
                    hb.epoch == record.epoch
                        && !hb.is_leader
                        && !hb.disk_full
                        && hb.corrupt_from_seqno == 0
                        && hb.durable_seqno >= hb.commit_seqno.max(record.commit_floor)
                })
            };
            plan(&state.shards, &live, can_lead, slack, max_moves)
        };
        let mut moves: Vec<RebalanceMove> = plan
            .moves
            .iter()
            .map(|&(shard, from, to)| RebalanceMove { shard, from, to, leader: None, error: None })
            .collect();
        if !preview {
            for bulk in moves.chunks_mut(BULK_FAILOVER_SHARDS) {
                self.move_bulk(bulk, reason).await;
            }
        }
        let now = if preview { plan.leads_after.clone() } else { self.leads_now() };
        let leads_after = plan.leads_before.keys().map(|n| (*n, now.get(n).copied().unwrap_or(0) as u64)).collect();
        Ok(RebalanceOutcome {
            preview,
            fair_share: plan.fair_share as u64,
            leads_before: plan.leads_before.iter().map(|(&n, &l)| (n, l as u64)).collect(),
            moved: moves.iter().filter(|m| m.leader == Some(m.to)).count() as u64,
            moves,
            leads_after,
            took_ms: started.elapsed().as_millis() as u64,
        })
    }

    /// Fails over the shards of `bulk` together, each preferring its
    /// planned replica, in one of the bulk failover slots; fills in what
    /// became of each. A shard whose failover is running already, or whose
    /// leader changed since the plan, is left alone and says so.
    async fn move_bulk(&self, bulk: &mut [RebalanceMove], reason: &str) {
        let Ok(_slot) = self.failover_slots.acquire().await else { return };
        let mut failing = Vec::with_capacity(bulk.len());
        for m in bulk.iter_mut() {
            let Some(guard) = self.shard_locks.get(&m.shard).and_then(|l| l.try_lock().ok()) else {
                m.error = Some(CoordError::Busy(m.shard).to_string());
                continue;
            };
            match self.shard_record(m.shard) {
                Ok(record) if record.leader == Some(m.from) => failing.push(Failing {
                    shard: m.shard,
                    target: None,
                    prefer: Some(m.to),
                    allow_loss: false,
                    reason: reason.to_string(),
                    // Not marked replaced: when the preferred replica lacks
                    // a record at the fence, the best one takes the shard,
                    // the old leader itself when it is as good as any.
                    replaced: None,
                    record,
                    _guard: guard,
                }),
                Ok(record) => {
                    m.error = Some(format!("its leader changed since the plan (now {:?})", record.leader));
                }
                Err(e) => m.error = Some(e.to_string()),
            }
        }
        if failing.is_empty() {
            return;
        }
        let outcomes: BTreeMap<u32, Result<FailoverOutcome, CoordError>> =
            self.failover_together(failing).await.into_iter().collect();
        for m in bulk.iter_mut() {
            match outcomes.get(&m.shard) {
                Some(Ok(outcome)) => m.leader = outcome.to,
                Some(Err(e)) => {
                    tracing::warn!(shard = m.shard, error = %e, "rebalance: the shard's failover failed; reconciliation takes it over");
                    m.error = Some(e.to_string());
                }
                None => {}
            }
            self.pending.lock().shards.insert(m.shard);
        }
    }

    /// The coordinator's own rebalances (module docs): every
    /// `rebalance_interval_ms`, while active.
    pub(super) async fn run_rebalance(self: Arc<Self>) {
        let every = self.config.replication.rebalance_interval_ms;
        if every == 0 {
            return;
        }
        let percent = self.config.replication.rebalance_slack_percent;
        let slack = move |fair: usize| (fair * percent as usize / 100).max(1);
        loop {
            tokio::select! {
                _ = self.shutdown.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_millis(every)) => {}
            }
            if !self.is_active() || !self.quiet_for_rebalance() {
                continue;
            }
            let Ok(_one) = self.rebalancing.try_lock() else { continue };
            match self.rebalance_locked(false, slack, usize::MAX, "rebalance").await {
                Ok(outcome) if !outcome.moves.is_empty() => tracing::info!(
                    planned = outcome.moves.len(),
                    moved = outcome.moved,
                    fair_share = outcome.fair_share,
                    before = ?outcome.leads_before,
                    after = ?outcome.leads_after,
                    took_ms = outcome.took_ms,
                    "automatic leadership rebalance"
                ),
                Ok(_) => {}
                Err(e) => tracing::debug!(error = %e, "automatic leadership rebalance skipped"),
            }
        }
    }

    /// No node silent, no automatic failover queued or running: the
    /// cluster is settled enough to move leaderships on its own.
    fn quiet_for_rebalance(&self) -> bool {
        let timeout = Duration::from_millis(self.config.replication.leader_timeout_ms);
        let all_alive = {
            let reports = self.reports();
            self.config.nodes.iter().all(|n| reports.alive(n.id, timeout))
        };
        all_alive && self.failing_over.lock().is_empty() && self.lost.lock().is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(leader: NodeId, replicas: &[NodeId]) -> Arc<ShardRecord> {
        Arc::new(ShardRecord {
            epoch: 1,
            leader: Some(leader),
            replicas: replicas.to_vec(),
            commit_floor: 0,
            learners: Vec::new(),
            joint: Vec::new(),
            members_version: 0,
        })
    }

    fn nodes(ids: &[NodeId]) -> BTreeSet<NodeId> {
        ids.iter().copied().collect()
    }

    #[test]
    fn a_returned_node_gets_its_share_back_from_the_survivors() {
        // Node 3 came back after its shards failed over to 1 and 2.
        let shards: BTreeMap<u32, Arc<ShardRecord>> =
            (0..9).map(|s| (s, record(if s % 2 == 0 { 1 } else { 2 }, &[1, 2, 3]))).collect();
        let plan = plan(&shards, &nodes(&[1, 2, 3]), |_, _, _| true, |_| 0, usize::MAX);
        assert_eq!(plan.fair_share, 3);
        assert_eq!(plan.leads_before, BTreeMap::from([(1, 5), (2, 4), (3, 0)]));
        assert_eq!(plan.leads_after, BTreeMap::from([(1, 3), (2, 3), (3, 3)]));
        assert!(plan.moves.iter().all(|&(_, _, to)| to == 3), "{:?}", plan.moves);
        for &(shard, from, _) in &plan.moves {
            assert_eq!(shards[&shard].leader, Some(from));
        }
    }

    #[test]
    fn a_balanced_cluster_or_one_within_the_slack_moves_nothing() {
        let shards: BTreeMap<u32, Arc<ShardRecord>> = (0..10).map(|s| (s, record(s % 3 + 1, &[1, 2, 3]))).collect();
        assert!(plan(&shards, &nodes(&[1, 2, 3]), |_, _, _| true, |_| 0, usize::MAX).moves.is_empty());
        // 5, 3, 3 against a fair share of 4: within a slack of 1.
        let skewed: BTreeMap<u32, Arc<ShardRecord>> =
            (0..11).map(|s| (s, record([1, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3][s as usize], &[1, 2, 3]))).collect();
        assert!(plan(&skewed, &nodes(&[1, 2, 3]), |_, _, _| true, |_| 1, usize::MAX).moves.is_empty());
        // 3, 3, 0 against a fair share of 2: node 3 leads less than the
        // share by more than the slack of 1.
        let one_empty: BTreeMap<u32, Arc<ShardRecord>> = (0..6).map(|s| (s, record(s % 2 + 1, &[1, 2, 3]))).collect();
        let plan_ = plan(&one_empty, &nodes(&[1, 2, 3]), |_, _, _| true, |_| 1, usize::MAX);
        assert_eq!(plan_.leads_after, BTreeMap::from([(1, 2), (2, 2), (3, 2)]));
        let plan = plan(&skewed, &nodes(&[1, 2, 3]), |_, _, _| true, |_| 0, usize::MAX);
        assert_eq!(plan.moves.len(), 1);
        assert_eq!(plan.leads_after, BTreeMap::from([(1, 4), (2, 4), (3, 3)]));
    }

    #[test]
    fn moves_go_only_to_live_replicas_that_may_lead_and_stop_at_the_limit() {
        // Node 4 holds no replica of these shards; node 3 is not live.
        let shards: BTreeMap<u32, Arc<ShardRecord>> = (0..8).map(|s| (s, record(1, &[1, 2, 3]))).collect();
        let plan_ = plan(&shards, &nodes(&[1, 2, 4]), |_, _, _| true, |_| 0, usize::MAX);
        assert!(plan_.moves.iter().all(|&(_, from, to)| from == 1 && to == 2), "{:?}", plan_.moves);
        assert_eq!(plan_.fair_share, 3);
        assert_eq!(plan_.leads_after[&2], 3);
        // Shard 0 has no replica fit to lead but its leader.
        let plan_ = plan(&shards, &nodes(&[1, 2, 3]), |s, _, _| s != 0, |_| 0, usize::MAX);
        assert!(plan_.moves.iter().all(|&(s, _, _)| s != 0));
        assert_eq!(plan(&shards, &nodes(&[1, 2, 3]), |_, _, _| true, |_| 0, 2).moves.len(), 2);
    }

    #[test]
    fn shards_changing_their_replica_set_or_without_a_leader_stay() {
        let mut shards: BTreeMap<u32, Arc<ShardRecord>> = BTreeMap::new();
        shards.insert(0, Arc::new(ShardRecord { joint: vec![1, 2], ..(*record(1, &[1, 2, 3])).clone() }));
        shards.insert(1, Arc::new(ShardRecord { leader: None, ..(*record(1, &[1, 2, 3])).clone() }));
        shards.insert(2, record(1, &[1, 2, 3]));
        shards.insert(3, record(1, &[1, 2, 3]));
        let plan = plan(&shards, &nodes(&[1, 2, 3]), |_, _, _| true, |_| 0, usize::MAX);
        assert!(plan.moves.iter().all(|&(s, _, _)| s >= 2), "{:?}", plan.moves);
        assert_eq!(plan.moves.len(), 2);
    }
}
