//! The re-seed drill's node-side hook (`Control.Wipe`): drop every record
//! a follower holds of a shard, as a replaced disk would, and let it
//! rebuild its copy by itself: from the object store first when the node
//! archives (see `catchup.rs`), then by catch-up from the leader. Only on
//! nodes started with `--allow-crash-drills`: it destroys data on purpose.
//!
//! What stays: the replica's epoch promises (they live beside the log, not
//! in it), so a wiped replica still refuses older leaders, and a failover
//! ranks it by its now empty log, below every replica that holds records.
//! Only a follower is wiped; the coordinator's drill wipes one only while
//! the others hold everything committed.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use walship_proto::log::WipeResponse;
use walship_wal::ShardId;

use super::{ReplicaError, ReplicationNode};
use crate::core::replica::Refusal;

impl ReplicationNode {
    /// Drops this follower's records of `shard` and starts its rebuild.
    /// Refuses, changing nothing, unless crash drills are allowed, the
    /// shard is hosted and this replica follows a leader.
    pub async fn wipe(self: &Arc<Self>, shard: ShardId, source: &str) -> Result<WipeResponse, ReplicaError> {
        if !self.allow_crash_drills {
            return Err(ReplicaError::CrashDrillsDisabled);
        }
        let tiers = Tiers::parse(source).ok_or_else(|| {
            ReplicaError::BadRequest(format!(
                "source {source:?} is not one of \"all\", \"peer\", \"archive\", \"stream\""
            ))
        })?;
        let replica = self.replica_or_not_found(shard).map_err(|e| self.counted(e))?;
        let transition = replica.transition.lock().await;
        if replica.leader_state().is_some() {
            return Err(ReplicaError::Refused { shard, node: self.me, refusal: Refusal::NotFollower });
        }
        if Self::following(&replica).is_none() {
            return Err(ReplicaError::NotFollowing { shard, node: self.me });
        }
        let before = {
            // In order with whatever is queued: segments queued before the
            // wipe settle as truncated (their apply resynchronises).
            let _apply = replica.follower.apply_lock.lock().await;
            let before = self.wal.positions(shard)?;
            self.wal.truncate_suffix(shard, before.first_seqno - 1).await?;
            replica.follower.next_expected.send_replace(before.first_seqno);
            replica.follower.rebuild_tiers.store(tiers.0, Ordering::Release);
            replica.truncated(before.first_seqno - 1);
            before
        };
        drop(transition);
        tracing::warn!(
            shard,
            first = before.first_seqno,
            last = before.last_seqno,
            "re-seed drill: dropped this follower's records of the shard on purpose; rebuilding"
        );
        self.start_catchup(replica);
        Ok(WipeResponse {
            first_seqno: before.first_seqno,
            last_seqno: before.last_seqno,
            restart_seqno: before.first_seqno,
        })
    }
}

/// The tiers a rebuild takes sealed segments from (the leader's stream
/// always serves the rest).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tiers(pub(crate) u8);

impl Tiers {
    pub(crate) const PEER: u8 = 1;
    pub(crate) const ARCHIVE: u8 = 2;
    pub(crate) const ALL: Tiers = Tiers(Tiers::PEER | Tiers::ARCHIVE);

    fn parse(source: &str) -> Option<Tiers> {
        Some(Tiers(match source {
            "" | "all" => Tiers::PEER | Tiers::ARCHIVE,
            "peer" => Tiers::PEER,
            "archive" => Tiers::ARCHIVE,
            "stream" => 0,
            _ => return None,
        }))
    }

    pub(crate) fn has(self, tier: u8) -> bool {
        self.0 & tier != 0
    }
}
