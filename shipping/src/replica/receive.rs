//! The follower side: an inbound segment or keepalive (pushed by
//! `ShipSegment(s)` or streamed by catch-up) passes the envelope check, the
//! role gate (`core/replica.rs`) and [`classify`], then is queued to the WAL
//! in seqno order under a per-shard lock held only until it is queued, so
//! many small shipments share one group commit. The answer is the durable
//! frontier once the queued frames are durable.
//!
//! Invariants kept here: validation happens before anything is queued, so a
//! refusal changes nothing; nothing of an epoch is applied before this log
//! is reconciled with that epoch's leader; frames enter the WAL only where
//! they continue the log.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use walship_proto::replication::ShipSegmentRequest;
use walship_wal::{Segment, ShardId};

use super::shard::ShardReplica;
use super::{ReplicaError, ReplicationNode, Source, now_us};
use crate::core::follower::{FollowerView, Inbound, InboundSegment, check_envelope, classify};
use crate::core::{Epoch, Seqno};

/// A segment queued to the WAL, resolving when it is durable.
pub(super) type Queued =
    std::pin::Pin<Box<dyn std::future::Future<Output = walship_wal::wal::WalResult<walship_wal::Appended>> + Send>>;

impl ReplicationNode {
    /// Applies an inbound segment or keepalive (pushed by ShipSegment or
    /// streamed by catch-up). Returns the durable frontier to report.
    /// Validation happens before anything is queued: a refusal changes
    /// nothing. A segment from the leader of an epoch this replica has not
    /// reconciled with yet is refused (`UNAVAILABLE`, retryable) while the
    /// replica repairs its log against that leader.
    pub async fn apply_inbound(
        self: &Arc<Self>,
        request: &ShipSegmentRequest,
        source: Source,
    ) -> Result<u64, ReplicaError> {
        let (replica, pending) = self.queue_inbound(request, source).await?;
        self.settle_inbound(&replica, pending).await
    }

    /// Waits for a queued inbound segment to be durable and returns the
    /// durable frontier (see [`ReplicationNode::apply_inbound`]).
    pub(super) async fn settle_inbound(
        &self,
        replica: &ShardReplica,
        pending: Option<Queued>,
    ) -> Result<u64, ReplicaError> {
        if let Some(queued) = pending
            && let Err(e) = queued.await
        {
            // Our bookkeeping and the WAL disagree: resynchronise from the WAL.
            let last = self.wal.positions(replica.shard).map(|p| p.last_seqno).unwrap_or(0);
            replica.follower.next_expected.send_replace(last + 1);
            return Err(ReplicaError::Apply { shard: replica.shard, source: e });
        }
        let durable = self.wal.positions(replica.shard)?.durable_seqno;
        replica.publish_follower(durable);
        Ok(durable)
    }

    /// Validates, classifies and queues an inbound segment to the WAL in
    /// order, without waiting for it to be durable. Refusals are counted.
    pub(super) async fn queue_inbound(
        self: &Arc<Self>,
        request: &ShipSegmentRequest,
        source: Source,
    ) -> Result<(Arc<ShardReplica>, Option<Queued>), ReplicaError> {
        self.queue_checked(request, source).await.map_err(|e| self.counted(e))
    }

    async fn queue_checked(
        self: &Arc<Self>,
        request: &ShipSegmentRequest,
        source: Source,
    ) -> Result<(Arc<ShardReplica>, Option<Queued>), ReplicaError> {
        // Partition drill: nothing from a cut peer is looked at (pushes and
        // catch-up chunks alike name the leader that sent them).
        self.check_partition(request.leader_node_id)?;
        if request.leader_node_id != self.me && self.config.node(request.leader_node_id).is_some() {
            self.contact.heard(request.leader_node_id, now_us());
        }
        let id = request.id.unwrap_or_default();
        let replica = self.replica_or_not_found(id.shard_id)?;
        let segment = if request.payload.is_empty() {
            None
        } else {
            Some(
                Segment::decode(request.payload.clone())
                    .map_err(|e| ReplicaError::CorruptSegment { shard: id.shard_id, detail: e.to_string() })?,
            )
        };
        check_envelope(
            id.shard_id,
            id.seqno,
            request.event_count,
            request.leader_last_seq,
            segment.as_ref().map(|s| (s.shard_id(), s.first_seqno(), s.last_seqno())),
        )
        .map_err(ReplicaError::BadRequest)?;
        self.admit(&replica, request.epoch, request.leader_node_id).await?;
        let follower = &replica.follower;
        let inbound = InboundSegment {
            epoch: Epoch(request.epoch),
            range: segment.as_ref().map(|s| (Seqno(s.first_seqno()), Seqno(s.last_seqno()))),
            leader_last_seq: Seqno(request.leader_last_seq),
        };
        // Windowed pushes may overtake each other: give the one before a
        // moment to be queued before calling this a gap.
        if let Some((first, _)) = inbound.range {
            let mut next = follower.next_expected.subscribe();
            let wait = Duration::from_millis(self.config.replication.reorder_wait_ms);
            let _ = tokio::time::timeout(wait, next.wait_for(|n| *n >= first.0)).await;
        }
        let guard = follower.apply_lock.lock().await;
        let durable = self.wal.positions(replica.shard)?.durable_seqno;
        let view = FollowerView {
            epoch_seen: Epoch(replica.epoch_seen()),
            next_expected: Seqno(*follower.next_expected.borrow()),
            durable: Seqno(durable),
        };
        let pending = match classify(view, inbound) {
            Inbound::StaleEpoch { seen } => {
                return Err(self.refused(
                    &replica,
                    crate::core::replica::Refusal::StaleEpoch { epoch: Epoch(request.epoch), seen },
                ));
            }
            Inbound::Gap { expected } => {
                drop(guard);
                self.start_catchup(replica.clone());
                return Err(ReplicaError::Gap {
                    shard: replica.shard,
                    first: inbound.range.map_or(0, |r| r.0.0),
                    expected: expected.0,
                    durable,
                });
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
                let queued = inbound.range.map_or(0, |(_, last)| last.0).min(view.next_expected.prev().0);
                (queued > durable).then(|| self.durable_at(replica.shard, queued))
            }
            Inbound::Apply { skip } => {
                let segment = segment.expect("apply implies records");
                let last = segment.last_seqno();
                let frames = segment.into_frames().split_off(skip);
                let bytes: usize = frames.iter().map(|f| f.len()).sum();
                // Records this replica held before it dropped a corrupt tail:
                // what the repair refetches (counted once queued).
                let refetch_through = follower.refetch_through.load(Ordering::Acquire);
                let refetched: usize = frames.iter().filter(|f| f.seqno() <= refetch_through).map(|f| f.len()).sum();
                let queued = self.wal.enqueue_frames(replica.shard, frames).await.map_err(|e| match e {
                    // The leader counts this follower out until the disk has
                    // space again; nothing was queued.
                    walship_wal::WalError::DiskFull(full) => ReplicaError::NoSpace(full.to_string()),
                    e => ReplicaError::Busy(e),
                })?;
                follower.next_expected.send_replace(last + 1);
                self.metrics.received_bytes.with_label_values(&[source.as_str()]).inc_by(bytes as u64);
                follower.applied_bytes[source.index()].fetch_add(bytes as u64, Ordering::Relaxed);
                if refetch_through > 0 {
                    self.metrics.repair_refetched_bytes.inc_by(refetched as u64);
                    if last >= refetch_through {
                        follower.refetch_through.store(0, Ordering::Release);
                    }
                }
                Some(Box::pin(queued) as Queued)
            }
        };
        follower.leader_commit.raise(request.epoch, request.commit_seqno);
        follower.archived.fetch_max(request.archived_seqno, Ordering::AcqRel);
        if source == Source::Push {
            // The leader's live pushes and keepalives say who archives.
            follower.archiver.store(request.archiver_node_id, Ordering::Release);
        }
        follower.last_contact_us.store(now_us(), Ordering::Release);
        replica.unsettle();
        drop(guard);
        if source == Source::Push && request.archiver_node_id == self.me {
            self.ensure_archiving(&replica);
        }
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

    /// The role gate: the rules admit a shipment from `from` in `epoch`, or
    /// refuse it; what they decide on the way (following a leader met here,
    /// starting a catch-up) is performed first, under the transition lock.
    async fn admit(
        self: &Arc<Self>,
        replica: &Arc<ShardReplica>,
        epoch: u64,
        from: crate::NodeId,
    ) -> Result<(), ReplicaError> {
        let mut commands = self.sync_disk(replica);
        let admission = {
            let mut rules = replica.rules.lock();
            let admission = rules.inbound(Epoch(epoch), from);
            replica.note_new_leader(&admission.commands);
            admission
        };
        commands.extend(admission.commands);
        if !commands.is_empty() {
            let _transition = replica.transition.lock().await;
            self.perform(replica, commands, 0).await?;
        }
        admission.outcome.map_err(|refusal| self.refused(replica, refusal))
    }
}
