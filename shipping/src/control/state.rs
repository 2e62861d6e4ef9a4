//! What the coordinator keeps in the KV: the coordinator lease, every
//! shard's leadership record and the recent failovers, one key each:
//!
//! | key | value |
//! | --- | --- |
//! | [`LEASE_KEY`] (`lease`) | [`Lease`] |
//! | `shard.<id>` ([`shard_key`]) | [`ShardRecord`] |
//! | [`FAILOVERS_KEY`] (`failovers`) | the last 100 [`FailoverRecord`]s |
//!
//! A change writes only the keys it changes ([`ClusterState::changes_from`]),
//! so a failover of one shard writes one small record whatever the number of
//! shards. Every write is a bucket-wide compare-and-set
//! ([`crate::control::Kv::write_batch`]) on the revision this coordinator
//! last wrote or read: a coordinator whose lease was taken over can change
//! nothing, whichever key it writes, because the takeover moved the bucket.
//!
//! Before this layout the whole state was one JSON value under
//! [`LEGACY_STATE_KEY`]; the first coordinator of this build to take the
//! lease converts it ([`Stored::Legacy`]) and overwrites the old key with a
//! marker an older coordinator cannot parse, so it stands down rather than
//! act on a stale copy.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::NodeId;
use crate::config::ClusterConfig;
use crate::control::kv::KvEntry;

/// The coordinator lease.
pub const LEASE_KEY: &str = "lease";
/// The failover history.
pub const FAILOVERS_KEY: &str = "failovers";
/// Prefix of the per-shard records (`shard.<id>`).
pub const SHARD_KEY_PREFIX: &str = "shard.";
/// The single value of the layout before per-shard records.
pub const LEGACY_STATE_KEY: &str = "cluster-state";
/// What [`LEGACY_STATE_KEY`] holds once converted.
pub const LEGACY_MARKER: &str =
    r#"{"moved":"walship keeps its leadership state per key now (lease, shard.<id>, failovers)"}"#;

/// The KV key of one shard's record.
pub fn shard_key(shard: u32) -> String {
    format!("{SHARD_KEY_PREFIX}{shard}")
}
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

    /// The voters a failover chooses among: while the replica set changes,
    /// the set before the change (everything acknowledged is on a majority
    /// of it), so only one of its members is promoted.
    pub fn failover_voters(&self) -> Vec<NodeId> {
        if self.joint.is_empty() { self.replicas.clone() } else { self.joint.clone() }
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
    /// Shared, copied on write ([`ClusterState::shard_mut`]): copying the
    /// state (each round of writes does) shares every record, and a record
    /// still shared with the copy last written is known unchanged without
    /// comparing it.
    pub shards: BTreeMap<u32, Arc<ShardRecord>>,
    pub failovers: VecDeque<FailoverRecord>,
}

/// How many of `shards` each node leads (nodes leading none are absent).
pub fn leads(shards: &BTreeMap<u32, Arc<ShardRecord>>) -> BTreeMap<NodeId, usize> {
    let mut leads = BTreeMap::new();
    for leader in shards.values().filter_map(|r| r.leader) {
        *leads.entry(leader).or_default() += 1;
    }
    leads
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
                        Arc::new(ShardRecord {
                            epoch: s.epoch,
                            leader: Some(s.leader),
                            replicas: s.replicas.clone(),
                            commit_floor: 0,
                            learners: Vec::new(),
                            joint: Vec::new(),
                            members_version: 0,
                        }),
                    )
                })
                .collect(),
            failovers: VecDeque::new(),
        }
    }

    /// Every key of the state, shards first and the lease last (a write
    /// split into several atomic runs then publishes the lease, which makes
    /// the layout current, only once everything else is written).
    pub fn to_entries(&self) -> Vec<(String, Bytes)> {
        let mut out: Vec<(String, Bytes)> = self.shards.iter().map(|(id, r)| (shard_key(*id), json(r))).collect();
        out.push((FAILOVERS_KEY.to_string(), json(&self.failovers)));
        out.push((LEASE_KEY.to_string(), json(&self.lease)));
        out
    }

    /// The keys to write to go from `written` to this state: changed and
    /// new shard records, the history if it changed, the lease if it did.
    /// A shard's record to change (copied first if shared).
    pub fn shard_mut(&mut self, shard: u32) -> Option<&mut ShardRecord> {
        self.shards.get_mut(&shard).map(Arc::make_mut)
    }

    pub fn changes_from(&self, written: &ClusterState) -> Vec<(String, Bytes)> {
        let mut out: Vec<(String, Bytes)> = self
            .shards
            .iter()
            .filter(|(id, r)| written.shards.get(id).is_none_or(|w| !Arc::ptr_eq(w, r) && w != *r))
            .map(|(id, r)| (shard_key(*id), json(r)))
            .collect();
        if self.failovers != written.failovers {
            out.push((FAILOVERS_KEY.to_string(), json(&self.failovers)));
        }
        if self.lease != written.lease {
            out.push((LEASE_KEY.to_string(), json(&self.lease)));
        }
        out
    }

    pub fn record_failover(&mut self, record: FailoverRecord) {
        self.failovers.push_back(record);
        while self.failovers.len() > FAILOVER_HISTORY {
            self.failovers.pop_front();
        }
    }
}

fn json<T: Serialize>(value: &T) -> Bytes {
    Bytes::from(serde_json::to_vec(value).expect("the state serialises"))
}

/// What a scan of the KV holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stored {
    /// Nothing: a new cluster.
    Empty,
    /// Only the single value of the earlier layout (to convert).
    Legacy(ClusterState),
    /// The per-key layout.
    Current(ClusterState),
}

impl Stored {
    /// Reads the state out of a scan. A value that does not parse is an
    /// error (naming its key), never skipped: acting on part of the state
    /// could fail a shard over twice.
    pub fn decode(entries: &[KvEntry]) -> Result<Stored, String> {
        fn parse<T: serde::de::DeserializeOwned>(entry: &KvEntry) -> Result<T, String> {
            serde_json::from_slice(&entry.value).map_err(|e| format!("KV key {}: {e}", entry.key))
        }
        let Some(lease) = entries.iter().find(|e| e.key == LEASE_KEY) else {
            return match entries.iter().find(|e| e.key == LEGACY_STATE_KEY) {
                Some(legacy) => Ok(Stored::Legacy(parse(legacy)?)),
                None => Ok(Stored::Empty),
            };
        };
        let mut state = ClusterState { lease: parse(lease)?, shards: BTreeMap::new(), failovers: VecDeque::new() };
        for entry in entries {
            if entry.key == FAILOVERS_KEY {
                state.failovers = parse(entry)?;
            } else if let Some(id) = entry.key.strip_prefix(SHARD_KEY_PREFIX) {
                let id: u32 = id.parse().map_err(|_| format!("KV key {}: not a shard id", entry.key))?;
                state.shards.insert(id, parse(entry)?);
            }
        }
        Ok(Stored::Current(state))
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

    fn record(epoch: u64) -> Arc<ShardRecord> {
        Arc::new(ShardRecord {
            epoch,
            leader: Some(1),
            replicas: vec![1, 2, 3],
            commit_floor: 0,
            learners: Vec::new(),
            joint: Vec::new(),
            members_version: 0,
        })
    }

    #[test]
    fn changes_are_the_records_changed_since_the_copy_written() {
        let written = ClusterState {
            lease: Lease { holder: "a".into(), term: 1, expires_unix_ms: 0 },
            shards: (1..=1000).map(|id| (id, record(1))).collect(),
            failovers: VecDeque::new(),
        };
        let mut next = written.clone();
        assert!(next.changes_from(&written).is_empty(), "a copy shares every record: nothing to write");
        next.shard_mut(7).unwrap().epoch = 2;
        // A record replaced by an equal one is no change either.
        next.shards.insert(9, record(1));
        // A record the written copy does not have is one.
        next.shards.insert(2000, record(1));
        let keys: Vec<String> = next.changes_from(&written).into_iter().map(|(k, _)| k).collect();
        assert_eq!(keys, vec![shard_key(7), shard_key(2000)]);
        assert_eq!(written.shards[&7].epoch, 1, "a change copies a shared record, never writes through it");
        assert!(Arc::ptr_eq(&next.shards[&8], &written.shards[&8]));
    }
}
