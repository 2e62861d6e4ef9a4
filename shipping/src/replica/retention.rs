//! Retention: every replica keeps `retain_bytes` of its log per shard for
//! readers; a leader also holds what a lagging follower still needs, up to
//! `max_retain_bytes`, past which it compacts anyway and marks that follower
//! as needing a re-seed (the leader core plans it). A follower compacts by
//! its own byte budget. Only durable records are ever compacted.
//!
//! One task per node looks at every hosted replica each
//! `retention_interval`, in shard order (a timer and a task per shard cost
//! a node with thousands of shards memory and wake-ups for nothing; a
//! pass over 10,000 idle replicas takes milliseconds).

use std::sync::Arc;
use std::time::Duration;

use super::ReplicationNode;
use super::shard::ShardReplica;

impl ReplicationNode {
    pub(super) async fn run_retention(self: Arc<Self>) {
        let interval = Duration::from_millis(self.config.replication.retention_interval_ms);
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = self.shutdown.cancelled() => return,
            }
            for replica in self.replicas() {
                if self.shutdown.is_cancelled() {
                    return;
                }
                self.retain(&replica).await;
            }
        }
    }

    /// One retention pass over a replica: compacts what its budget (and,
    /// leading, its followers and the archive) no longer needs.
    async fn retain(&self, replica: &ShardReplica) {
        let r = &self.config.replication;
        // Followers that need a re-seed when the leader compacts as
        // planned.
        let mut reseed = None;
        let compact_to = match replica.leader_state() {
            Some(leader) => {
                let plan = leader.core.lock().plan_retention(r.retain_bytes, r.max_retain_bytes);
                // Nothing the archive lacks is compacted (see archive.rs).
                let planned = plan.compact_to.map(|s| s.0);
                let to = match (planned, self.archived_through(replica.shard)) {
                    (Some(to), Some(archived)) => {
                        let first = self.wal.positions(replica.shard).map_or(u64::MAX, |p| p.first_seqno);
                        Some(to.min(archived.saturating_add(1))).filter(|to| *to > first)
                    }
                    (to, _) => to,
                };
                // Followers are marked only when the planned compaction
                // happens as planned; one the archive or a producer
                // snapshot (see `Wal::compact_prefix`) holds back leaves
                // them records, and a follower that still falls behind
                // the leader's first seqno is marked by its next reply
                // (and re-seeds from the archive).
                if !plan.reseed.is_empty() && to == planned {
                    reseed = planned.map(|planned| (leader, planned, plan.reseed));
                }
                to
            }
            None => {
                let (Ok(p), Ok(c)) = (self.wal.positions(replica.shard), self.wal.counters(replica.shard)) else {
                    return;
                };
                let average = c.bytes.checked_div(c.records).unwrap_or(0);
                let to = crate::core::follower::compact_to(p.first_seqno, p.durable_seqno, average, r.retain_bytes);
                // While the cluster archives, nothing the archive lacks
                // (as the leader last said) is compacted here either: a
                // failover to this replica must find it.
                match self.archive.get() {
                    Some(_) => {
                        let archived = replica.follower.archived.load(std::sync::atomic::Ordering::Acquire);
                        to.map(|to| to.min(archived.saturating_add(1))).filter(|to| *to > p.first_seqno)
                    }
                    None => to,
                }
            }
        };
        if let Some(to) = compact_to {
            match self.wal.compact_prefix(replica.shard, to).await {
                Ok(first) => {
                    if let Some((leader, planned, followers)) = reseed.take()
                        && first == planned
                    {
                        tracing::warn!(
                            shard = replica.shard,
                            ?followers,
                            "retention bound reached: followers need a re-seed"
                        );
                        leader.core.lock().mark_reseed(&followers);
                    }
                    if let Some(leader) = replica.leader_state() {
                        leader.core.lock().on_compacted(crate::core::Seqno(first));
                    }
                    tracing::info!(shard = replica.shard, first_seqno = first, asked = to, "compacted");
                }
                Err(e) => tracing::warn!(shard = replica.shard, error = %e, "compaction"),
            }
        }
    }
}
