//! The partition drill's node-side hook (`Control.Partition`): for a while,
//! this node treats some peer nodes as unreachable for node-to-node
//! replication traffic. It is a *simulated* partition, at the replication
//! layer: a dev cluster's processes run as one user, so a drill cannot cut
//! links per process with a firewall the way the black-box tests do
//! (`tests/common/partition.rs`). What is cut: pushes to a blocked peer fail
//! at once as a transport failure would (and a reply arriving after the cut
//! is dropped, as a cut link would drop it), catch-up `StreamSegments` and
//! `EpochEnd` calls to it fail, and its pushes and catch-up requests are
//! refused with `UNAVAILABLE` ("partitioned (drill)"). What is not:
//! heartbeats to the coordinator, the coordinator's calls, client traffic.
//!
//! The call sites are few and marked `// Partition drill:` (send: `ship`;
//! receive: `queue_checked`; catch-up: `serve_stream`, `repair`,
//! `catch_up_once`). The partition expires by itself at its deadline, so a
//! coordinator that dies mid-drill cannot leave nodes cut for good; a
//! second call replaces the first and `millis` 0 heals at once. Only on
//! nodes started with `--allow-crash-drills`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{ReplicaError, ReplicationNode};
use crate::NodeId;

/// The longest partition a drill may ask for: long enough for any drill's
/// hold, short enough that a forgotten one heals within minutes.
pub const MAX_PARTITION_MS: u64 = 600_000;

/// Peers this node treats as unreachable, each until an instant.
#[derive(Default)]
pub struct DrillPartition {
    blocked: Mutex<BTreeMap<NodeId, Instant>>,
}

impl DrillPartition {
    /// Whether traffic with `peer` is cut right now. An expired entry is
    /// dropped (logged once) the first time it is looked at.
    pub fn blocks(&self, peer: NodeId) -> bool {
        let mut blocked = self.blocked.lock();
        match blocked.get(&peer) {
            Some(until) if Instant::now() < *until => true,
            Some(_) => {
                blocked.remove(&peer);
                tracing::warn!(peer, "partition drill: the partition from this peer expired; healed");
                false
            }
            None => false,
        }
    }

    /// Peers cut right now (status and tests).
    pub fn blocked_peers(&self) -> Vec<NodeId> {
        let now = Instant::now();
        self.blocked.lock().iter().filter(|(_, until)| now < **until).map(|(peer, _)| *peer).collect()
    }

    /// Replaces the partition: `peers` are cut for `duration` (none when
    /// zero).
    fn replace(&self, peers: &[NodeId], duration: Duration) {
        let until = Instant::now() + duration;
        let mut blocked = self.blocked.lock();
        blocked.clear();
        if !duration.is_zero() {
            blocked.extend(peers.iter().map(|&p| (p, until)));
        }
    }
}

impl ReplicationNode {
    /// `Control.Partition`: cut replication traffic with `peers` for
    /// `millis` (replacing any earlier partition; 0 heals). Refuses,
    /// changing nothing, unless crash drills are allowed, every peer is
    /// another node of the cluster and `millis` is at most
    /// [`MAX_PARTITION_MS`].
    pub fn partition(&self, peers: &[NodeId], millis: u64) -> Result<(), ReplicaError> {
        if !self.allow_crash_drills {
            return Err(ReplicaError::CrashDrillsDisabled);
        }
        if millis > MAX_PARTITION_MS {
            return Err(ReplicaError::BadRequest(format!(
                "partition of {millis} ms: at most {MAX_PARTITION_MS} ms (it must heal by itself)"
            )));
        }
        for &peer in peers {
            if peer == self.me {
                return Err(ReplicaError::BadRequest(format!("node {peer} cannot be partitioned from itself")));
            }
            if self.config.node(peer).is_none() {
                return Err(ReplicaError::BadRequest(format!("node {peer} is not a node of this cluster")));
            }
        }
        self.drill_partition.replace(peers, Duration::from_millis(millis));
        if millis == 0 || peers.is_empty() {
            tracing::warn!("partition drill: healed");
        } else {
            tracing::warn!(?peers, millis, "partition drill: treating peers as unreachable for replication");
        }
        Ok(())
    }

    /// Peers a partition drill cuts this node from right now (its status
    /// page shows them).
    pub fn drill_partitioned_from(&self) -> Vec<NodeId> {
        self.drill_partition.blocked_peers()
    }

    /// `Err(Partitioned)` while a drill cuts this node from `peer` (the one
    /// check every call site makes).
    pub(super) fn check_partition(&self, peer: NodeId) -> Result<(), ReplicaError> {
        if self.drill_partition.blocks(peer) {
            return Err(ReplicaError::Partitioned { node: self.me, peer });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partition_blocks_its_peers_until_replaced_or_expired() {
        let p = DrillPartition::default();
        p.replace(&[2, 3], Duration::from_secs(60));
        assert!(p.blocks(2) && p.blocks(3) && !p.blocks(4));
        // A second call replaces the first.
        p.replace(&[3], Duration::from_secs(60));
        assert!(!p.blocks(2) && p.blocks(3));
        // Zero heals at once.
        p.replace(&[3], Duration::ZERO);
        assert!(!p.blocks(3));
        assert!(p.blocked_peers().is_empty());
        // It expires by itself.
        p.replace(&[2], Duration::from_millis(1));
        let deadline = Instant::now() + Duration::from_millis(2);
        while Instant::now() < deadline {
            std::hint::spin_loop();
        }
        assert!(!p.blocks(2), "an expired partition still blocks");
    }
}
