//! What the coordinator keeps in the KV: one value (key [`STATE_KEY`]) with
//! the coordinator lease, every shard's leadership record and the recent
//! failovers. One key means every change — a lease renewal, an epoch raise,
//! a new leader — is one compare-and-set on one revision, so a coordinator
//! whose lease was taken over can change nothing: its revision is stale.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::NodeId;
use crate::config::ClusterConfig;

pub const STATE_KEY: &str = "cluster-state";
/// Failover records kept.
const FAILOVER_HISTORY: usize = 100;

/// The active coordinator's lease.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct Lease {
    pub holder: String,
    /// Raised by every takeover.
    pub term: u64,
    pub expires_unix_ms: u64,
}

/// One shard's leadership.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct ShardRecord {
    pub epoch: u64,
    /// None while a failover is between raising the epoch and choosing.
    pub leader: Option<NodeId>,
    pub replicas: Vec<NodeId>,
    /// A commit position known to be safe, handed to new leaders.
    pub commit_floor: u64,
    /// Replicas being added: shipped to, never counted (no commit, no
    /// failover) until a replica change makes them voters.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub learners: Vec<NodeId>,
    /// While the voting set changes: the set before the change. A failover
    /// then needs a majority of both sets and goes back to this one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub joint: Vec<NodeId>,
    /// Raised by every change of `replicas`, `learners` or `joint` (sent
    /// with assignments: nodes never go back to an older set).
    #[serde(default)]
    pub members_version: u64,
}

impl ShardRecord {
    /// Every node that holds or receives the shard: voters, the old set of
    /// a change, learners. Fences and assignments go to all of them.
    pub fn members(&self) -> Vec<NodeId> {
        let mut all: Vec<NodeId> = self.replicas.iter().chain(&self.joint).chain(&self.learners).copied().collect();
        all.sort_unstable();
        all.dedup();
        all
    }

    /// Nodes that vote in either set (failover candidates).
    pub fn voters(&self) -> Vec<NodeId> {
        let mut all: Vec<NodeId> = self.replicas.iter().chain(&self.joint).copied().collect();
        all.sort_unstable();
        all.dedup();
        all
    }
}

/// A completed failover.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct FailoverRecord {
    pub shard: u32,
    pub epoch: u64,
    pub from: Option<NodeId>,
    pub to: NodeId,
    /// `automatic`, `manual`, `forced` or `drill`.
    pub reason: String,
    pub at_unix_ms: u64,
    pub took_ms: u64,
    /// Seqnos the promoted replica did not hold (forced failovers only).
    #[schema(value_type = Option<Vec<u64>>)]
    pub lost: Option<(u64, u64)>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ClusterState {
    pub lease: Lease,
    pub shards: BTreeMap<u32, ShardRecord>,
    pub failovers: VecDeque<FailoverRecord>,
}

impl ClusterState {
    /// The first state: leaders and epochs from the cluster config.
    pub fn bootstrap(config: &ClusterConfig, holder: &str, now_ms: u64, lease_ms: u64) -> ClusterState {
        ClusterState {
            lease: Lease { holder: holder.to_string(), term: 1, expires_unix_ms: now_ms + lease_ms },
            shards: config
                .shards
                .iter()
                .map(|s| {
                    (
                        s.id,
                        ShardRecord {
                            epoch: s.epoch,
                            leader: Some(s.leader),
                            replicas: s.replicas.clone(),
                            commit_floor: 0,
                            learners: Vec::new(),
                            joint: Vec::new(),
                            members_version: 0,
                        },
                    )
                })
                .collect(),
            failovers: VecDeque::new(),
        }
    }

    pub fn record_failover(&mut self, record: FailoverRecord) {
        self.failovers.push_back(record);
        while self.failovers.len() > FAILOVER_HISTORY {
            self.failovers.pop_front();
        }
    }
}

/// What a coordinator should do about the lease it reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseAction {
    /// It holds the lease: renew it.
    Renew,
    /// The holder let it expire: take it over with the next term.
    TakeOver,
    /// Someone else holds a live lease.
    Standby,
}

pub fn lease_action(lease: &Lease, me: &str, now_ms: u64) -> LeaseAction {
    if lease.holder == me {
        LeaseAction::Renew
    } else if lease.expires_unix_ms <= now_ms {
        LeaseAction::TakeOver
    } else {
        LeaseAction::Standby
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_actions() {
        let lease = Lease { holder: "a".into(), term: 3, expires_unix_ms: 1_000 };
        assert_eq!(lease_action(&lease, "a", 2_000), LeaseAction::Renew);
        assert_eq!(lease_action(&lease, "b", 999), LeaseAction::Standby);
        assert_eq!(lease_action(&lease, "b", 1_000), LeaseAction::TakeOver);
    }

    #[test]
    fn failover_history_is_bounded() {
        let mut state = ClusterState {
            lease: Lease { holder: "a".into(), term: 1, expires_unix_ms: 0 },
            shards: BTreeMap::new(),
            failovers: VecDeque::new(),
        };
        for i in 0..150 {
            state.record_failover(FailoverRecord {
                shard: 1,
                epoch: i,
                from: None,
                to: 1,
                reason: "automatic".into(),
                at_unix_ms: 0,
                took_ms: 0,
                lost: None,
            });
        }
        assert_eq!(state.failovers.len(), 100);
        assert_eq!(state.failovers.front().unwrap().epoch, 50);
    }
}
