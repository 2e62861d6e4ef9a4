//! Catch-up, both ends: a leader serves `StreamSegments` (durable segments
//! from a follower's next seqno, rate-limited so catch-up cannot starve the
//! live append path); a follower reconciles its log with a new leader
//! (EpochEnd repair: truncate the divergent tail, record the leader's epoch
//! as its log epoch) and then pulls, pipelined, one catch-up at a time. A
//! follower whose own log turned out corrupt truncates from the first bad
//! seqno here and pulls the rest again, byte-identical, from its leader.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use walship_proto::log::EpochEndRequest;
use walship_proto::replication::{ShipSegmentRequest, StreamRequest, WalSegmentId};
use walship_wal::Segment;

use super::shard::ShardReplica;
use super::wipe::Tiers;
use super::{ReplicaError, ReplicationNode, Source};
use crate::NodeId;
use crate::core::{Epoch, Seqno};

/// Catch-up chunks queued to the WAL before the oldest must be durable.
const CATCHUP_PIPELINE: usize = 4;

impl ReplicationNode {
    /// Serves `StreamSegments` (leader side): durable segments from
    /// `from_seqno` up to the durable position reached, rate-limited.
    pub fn stream_segments(
        self: &Arc<Self>,
        request: StreamRequest,
    ) -> Result<tokio::sync::mpsc::Receiver<Result<ShipSegmentRequest, tonic::Status>>, ReplicaError> {
        self.serve_stream(request).map_err(|e| self.counted(e))
    }

    fn serve_stream(
        self: &Arc<Self>,
        request: StreamRequest,
    ) -> Result<tokio::sync::mpsc::Receiver<Result<ShipSegmentRequest, tonic::Status>>, ReplicaError> {
        // Partition drill: a cut follower's catch-up request is refused.
        self.check_partition(request.follower_node_id)?;
        self.peer_alive(request.follower_node_id);
        let replica = self.replica_or_not_found(request.shard_id)?;
        let Some(leader) = replica.leader_state() else {
            let hint = replica.leader_id(self.me).map_or("unknown".to_string(), |l| self.describe(l));
            return Err(ReplicaError::NotLeader { shard: replica.shard, node: self.me, hint });
        };
        if request.epoch > leader.epoch {
            return Err(ReplicaError::NewerRequester { epoch: leader.epoch, seen: request.epoch });
        }
        // Reconciled with this leadership: its shippers to the follower
        // that it refused meanwhile may push again.
        leader.pulled.send_modify(|n| *n += 1);
        if request.from_seqno == 0 {
            return Err(ReplicaError::BadRequest("from_seqno must be >= 1".into()));
        }
        let positions = self.wal.positions(replica.shard)?;
        let (durable, baseline) = {
            let core = leader.core.lock();
            (core.durable().0, core.epoch_start().prev().0)
        };
        if request.from_seqno < positions.first_seqno {
            return Err(ReplicaError::NeedsReseed {
                shard: replica.shard,
                from: request.from_seqno,
                first: positions.first_seqno,
            });
        }
        if request.from_seqno > durable + 1 {
            return Err(ReplicaError::PastDurable { shard: replica.shard, from: request.from_seqno, durable });
        }
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let node = self.clone();
        tokio::spawn(async move {
            let mut next = request.from_seqno;
            // Catch-up moves bulk: bigger chunks than live pushes, so each
            // follower fsync covers more.
            let batch = node.config.replication.ship_batch_bytes.saturating_mul(4);
            loop {
                if leader.stop.is_cancelled() {
                    let _ = tx.send(Err(tonic::Status::unavailable("this replica stopped leading"))).await;
                    return;
                }
                // Partition drill: a stream already running when the cut
                // came ends as a broken connection would end it.
                if let Err(e) = node.check_partition(request.follower_node_id) {
                    let _ = tx.send(Err(e.into())).await;
                    return;
                }
                let (durable, commit) = {
                    let core = leader.core.lock();
                    (core.durable().0, core.commit().0)
                };
                if next > durable {
                    return;
                }
                let frames = match node.wal.read(replica.shard, next, durable, batch).await {
                    Ok(frames) => frames,
                    Err(e) => {
                        // Damage in this leader's own log is data loss for
                        // the requester; anything else (a compaction raced
                        // the read) is a range no longer here.
                        let status = match e.corrupt_range() {
                            Some(_) => tonic::Status::from(ReplicaError::Wal(e)),
                            None => tonic::Status::out_of_range(e.to_string()),
                        };
                        let _ = tx.send(Err(status)).await;
                        return;
                    }
                };
                let segment = match Segment::encode(replica.shard, frames) {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = tx.send(Err(tonic::Status::internal(e.to_string()))).await;
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
                    stream_baseline: baseline,
                    epoch: leader.epoch,
                    leader_node_id: node.me,
                    commit_seqno: commit,
                    payload: segment.encoded().clone(),
                    archived_seqno: node.archived_through(replica.shard).unwrap_or(0),
                    archiver_node_id: leader.archiver.load(Ordering::Acquire),
                };
                next = segment.last_seqno() + 1;
                if tx.send(Ok(message)).await.is_err() {
                    return;
                }
            }
        });
        Ok(rx)
    }

    /// Starts reconciling with and pulling from the leader, unless that is
    /// already running: first divergence repair (once per epoch), then a
    /// catch-up stream.
    pub(crate) fn start_catchup(self: &Arc<Self>, replica: Arc<ShardReplica>) {
        if replica.follower.catchup_running.swap(true, Ordering::AcqRel) {
            return;
        }
        let node = self.clone();
        tokio::spawn(async move {
            let mut backoff = Duration::from_millis(20);
            while let Some((leader, epoch)) = ReplicationNode::following(&replica) {
                let attempt = async {
                    if !replica.rules.lock().is_repaired_for(Epoch(epoch)) {
                        node.repair(&replica, leader, epoch).await?;
                    }
                    node.catch_up_once(&replica, leader, epoch).await
                };
                match attempt.await {
                    // Re-seeded from the archive: stream the rest now.
                    Ok(Pulled::Reseeded) => backoff = Duration::from_millis(20),
                    Ok(Pulled::Streamed) => {
                        // Caught up: a drill's choice of tiers ends with its rebuild.
                        replica.follower.rebuild_tiers.store(Tiers::ALL.0, Ordering::Release);
                        break;
                    }
                    // The leader's first shipment in the epoch (a push or a
                    // keepalive to a replica not reconciled with it) starts
                    // the catch-up again; a failover assigns a new leader.
                    Err(error) if error.leader_not_leading() => {
                        tracing::debug!(shard = replica.shard, %error, "catch-up waits for the leader to lead");
                        break;
                    }
                    Err(error) => {
                        tracing::debug!(shard = replica.shard, %error, "catch-up attempt failed; retrying");
                        tokio::select! {
                            _ = tokio::time::sleep(backoff) => {}
                            _ = node.shutdown.cancelled() => break,
                        }
                        backoff = (backoff * 2).min(Duration::from_secs(1));
                    }
                }
            }
            replica.follower.catchup_running.store(false, Ordering::Release);
        });
    }

    /// Truncates whatever this follower's log holds past the point where it
    /// diverges from the leader of `epoch`: repeatedly, ask the leader where
    /// our last kept record's epoch ends in its log, and take the lower of
    /// that and where the same epoch ends in ours. The cut is found first and
    /// made once: a leader lost midway through the questions leaves the log
    /// as it was, and the cut moves where the next record is expected with
    /// it (a fence waits for everything expected before it to be durable,
    /// so a stale expectation above a cut would hold every fence of this
    /// replica until it timed out, and with it every failover needing it).
    async fn repair(&self, replica: &ShardReplica, leader: NodeId, epoch: u64) -> Result<(), ReplicaError> {
        // Partition drill: EpochEnd carries no caller id for the leader to
        // refuse, so it is blocked here, on the calling side.
        self.check_partition(leader)?;
        let mut client =
            self.peers.control(leader).ok_or_else(|| ReplicaError::Unavailable("leader address unknown".into()))?;
        let _guard = replica.follower.apply_lock.lock().await;
        let p = self.wal.positions(replica.shard)?;
        let mut end = p.last_seqno;
        for _ in 0..64 {
            if end < p.first_seqno {
                break;
            }
            let last_epoch = self.wal.epoch_at(replica.shard, end).await?;
            self.check_partition(leader)?;
            let mut request = tonic::Request::new(EpochEndRequest { shard_id: replica.shard, epoch: last_epoch });
            request.set_timeout(Duration::from_secs(2));
            let answer = client.epoch_end(request).await?.into_inner();
            let (_, ours) = self.wal.epoch_end(replica.shard, answer.epoch).await?;
            let keep = answer.end_seqno.min(ours).min(end);
            if keep == end {
                break;
            }
            if keep + 1 < p.first_seqno {
                return Err(ReplicaError::Unavailable(format!(
                    "shard {}: diverges from the leader before seqno {}, which is compacted here; needs a re-seed",
                    replica.shard, p.first_seqno
                )));
            }
            end = keep;
        }
        if end < p.last_seqno {
            tracing::warn!(
                shard = replica.shard,
                epoch,
                from = end + 1,
                to = p.last_seqno,
                "truncating a divergent tail"
            );
            self.wal.truncate_suffix(replica.shard, end).await?;
            replica.truncated(end);
        }
        let last = self.wal.positions(replica.shard)?.last_seqno;
        replica.follower.next_expected.send_replace(last + 1);
        // The log is now a prefix of this leader's: record it durably before
        // answering anything of this epoch, so every acknowledgement the
        // leader counts comes from a replica a failover ranks by this epoch
        // (what lets the leader commit older-epoch records by counting).
        self.wal.set_log_epoch(replica.shard, epoch).await?;
        replica.rules.lock().repaired(Epoch(epoch));
        Ok(())
    }

    async fn catch_up_once(
        self: &Arc<Self>,
        replica: &Arc<ShardReplica>,
        leader: NodeId,
        epoch: u64,
    ) -> Result<Pulled, ReplicaError> {
        // Partition drill: no catch-up from a cut leader (each chunk is
        // checked again in `queue_checked`, ending a stream cut midway).
        self.check_partition(leader)?;
        let mut client =
            self.peers.shipping(leader).ok_or_else(|| ReplicaError::Unavailable("leader address unknown".into()))?;
        // An empty log (a replaced disk, a wiped or new replica) seeds from
        // the archive first, sparing the leader: whatever the archive holds
        // from where this log starts, then the leader streams the rest.
        if self.archive.get().is_some() {
            let p = self.wal.positions(replica.shard)?;
            let tiers = Tiers(replica.follower.rebuild_tiers.load(Ordering::Acquire));
            if p.last_seqno < p.first_seqno && tiers != Tiers(0) {
                match self.reseed_from_archive(replica, leader, epoch, None).await {
                    Ok(0) => {}
                    Ok(_) => return Ok(Pulled::Reseeded),
                    // The archive is a way to spare the leader, never a
                    // condition for catching up.
                    Err(error) => {
                        tracing::warn!(shard = replica.shard, %error, "seeding from the archive failed; streaming from the leader");
                    }
                }
            }
        }
        let from = *replica.follower.next_expected.borrow();
        let request = StreamRequest { shard_id: replica.shard, from_seqno: from, epoch, follower_node_id: self.me };
        let mut stream = match client.stream_segments(request).await {
            Ok(stream) => stream.into_inner(),
            Err(status) => {
                // The leader no longer holds what comes next here: re-seed
                // from the archive up to what it holds, then stream the rest.
                if let Some(first) = super::error::metadata_u64(&status, super::error::RETAINED_METADATA_KEY) {
                    self.reseed_from_archive(replica, leader, epoch, Some(first)).await?;
                    return Ok(Pulled::Reseeded);
                }
                return Err(status.into());
            }
        };
        // Pipelined: receive the next chunk while earlier ones are written
        // and fsynced (they still enter the WAL in order, and consecutive
        // chunks share group commits), with a bounded number in flight.
        let mut in_flight = std::collections::VecDeque::new();
        while let Some(message) = stream.message().await? {
            let (_, pending) = self.queue_inbound(&message, Source::Stream).await?;
            in_flight.push_back(pending);
            if in_flight.len() >= CATCHUP_PIPELINE {
                self.settle_inbound(replica, in_flight.pop_front().flatten()).await?;
            }
        }
        for pending in in_flight {
            self.settle_inbound(replica, pending).await?;
        }
        Ok(Pulled::Streamed)
    }

    /// Re-seeds this follower from the object store: every archived
    /// segment from its next expected seqno until the leader's oldest
    /// retained one (`leader_first`; `None`: an empty log taking what the
    /// archive holds, and nothing when the archive does not reach its start)
    /// is applied as a catch-up chunk would be (each record's crc checked,
    /// overlaps skipped, in order, fsynced); the caller's next catch-up
    /// streams the rest from the leader. Only committed records are
    /// archived and a repaired follower's log is a prefix of its leader's,
    /// so what is applied is exactly what the leader holds. Answers the
    /// bytes applied, counted as `walship_catchup_bytes_total{source="archive"}`.
    async fn reseed_from_archive(
        self: &Arc<Self>,
        replica: &Arc<ShardReplica>,
        leader: NodeId,
        epoch: u64,
        leader_first: Option<u64>,
    ) -> Result<u64, ReplicaError> {
        let shard = replica.shard;
        let Some(archive) = self.archive.get().cloned() else {
            return Err(ReplicaError::Unavailable(format!(
                "shard {shard}: the leader keeps records from seqno {} only and this node has no [archive] to \
                 re-seed from",
                leader_first.unwrap_or(0)
            )));
        };
        let unavailable =
            |e: String| ReplicaError::Unavailable(format!("shard {shard}: re-seeding from the archive: {e}"));
        let listing = crate::archive::restore::list(archive.store.as_ref(), &archive.layout, shard)
            .await
            .map_err(|e| unavailable(e.to_string()))?;
        let from = *replica.follower.next_expected.borrow();
        let covers_start = listing.chain.first().is_some_and(|s| s.first <= from) && listing.archived_seqno >= from;
        let Some(leader_first) = leader_first else {
            if !covers_start {
                return Ok(0); // nothing to gain: the leader streams it all
            }
            return self.apply_archived(replica, leader, epoch, &archive, &listing, u64::MAX).await;
        };
        if listing.archived_seqno + 1 < leader_first || listing.chain.first().is_some_and(|s| s.first > from) {
            return Err(unavailable(format!(
                "it holds {}..={}, this replica needs {from}.. and the leader keeps {leader_first}..: no source covers \
                 the gap",
                listing.chain.first().map_or(0, |s| s.first),
                listing.archived_seqno
            )));
        }
        self.apply_archived(replica, leader, epoch, &archive, &listing, leader_first).await
    }

    /// Applies the archived segments of `listing` from this follower's next
    /// expected seqno up to the first one starting at or past `until`.
    async fn apply_archived(
        self: &Arc<Self>,
        replica: &Arc<ShardReplica>,
        leader: NodeId,
        epoch: u64,
        archive: &super::archive::Archive,
        listing: &crate::archive::restore::Listing,
        until: u64,
    ) -> Result<u64, ReplicaError> {
        let shard = replica.shard;
        let unavailable =
            |e: String| ReplicaError::Unavailable(format!("shard {shard}: re-seeding from the archive: {e}"));
        let from = *replica.follower.next_expected.borrow();
        tracing::info!(shard, from, until, archived = listing.archived_seqno, "re-seeding from the archive");
        let mut in_flight = std::collections::VecDeque::new();
        let mut applied_bytes = 0u64;
        for segment in listing.chain.iter().filter(|s| s.last >= from) {
            if segment.first >= until {
                break; // the leader streams the rest
            }
            // Peers first (their WALs hold the same bytes), the store second
            // (a drill may have chosen one of them).
            let tiers = Tiers(replica.follower.rebuild_tiers.load(Ordering::Acquire));
            let from_peer = match tiers.has(Tiers::PEER) {
                true => self.fetch_from_peers(replica, leader, segment).await,
                false => None,
            };
            let (payload, source) = match from_peer {
                Some(payload) => (payload, Source::Peer),
                None if !tiers.has(Tiers::ARCHIVE) => {
                    return Err(unavailable(format!("no peer served {} (this rebuild takes peers only)", segment.key)));
                }
                None => {
                    let key = walship_objstore::ObjectKey::new(segment.key.clone())
                        .map_err(|e| unavailable(e.to_string()))?;
                    let payload = archive
                        .store
                        .get(&key)
                        .await
                        .map_err(|e| unavailable(e.to_string()))?
                        .ok_or_else(|| unavailable(format!("{} was listed but is gone", segment.key)))?;
                    (payload, Source::Archive)
                }
            };
            applied_bytes += payload.len() as u64;
            // A re-seed moves bulk like a catch-up stream: it takes from the
            // same per-node budget (`catchup_rate_bytes_per_s`), so it
            // cannot starve live appends of the disk.
            self.catchup_budget.acquire(payload.len()).await;
            let message = ShipSegmentRequest {
                id: Some(WalSegmentId { region_id: self.region, shard_id: shard, seqno: segment.first }),
                event_count: segment.last - segment.first + 1,
                leader_last_seq: segment.last,
                stream_baseline: 0,
                epoch,
                leader_node_id: leader,
                commit_seqno: segment.last,
                payload,
                archived_seqno: listing.archived_seqno,
                archiver_node_id: replica.follower.archiver.load(Ordering::Acquire),
            };
            let (_, pending) = self.queue_inbound(&message, source).await?;
            in_flight.push_back(pending);
            if in_flight.len() >= CATCHUP_PIPELINE {
                self.settle_inbound(replica, in_flight.pop_front().flatten()).await?;
            }
        }
        for pending in in_flight {
            self.settle_inbound(replica, pending).await?;
        }
        tracing::info!(
            shard,
            bytes = applied_bytes,
            through = *replica.follower.next_expected.borrow() - 1,
            "re-seeded from the archive"
        );
        Ok(applied_bytes)
    }

    /// `segment` from the replicas other than this one and the leader (the
    /// leader only when it is the only other one), through the peer tier,
    /// checked whole against its key (shard, range); `None` when there is
    /// no peer tier or no peer served it intact.
    async fn fetch_from_peers(
        &self,
        replica: &ShardReplica,
        leader: NodeId,
        segment: &crate::archive::SegmentRef,
    ) -> Option<bytes::Bytes> {
        let tier = self.peer_tier()?;
        let mut peers: Vec<NodeId> = replica.members().others(self.me).into_iter().filter(|&n| n != leader).collect();
        if peers.is_empty() && leader != self.me {
            peers.push(leader);
        }
        // Spread the load: each follower starts with another peer.
        if !peers.is_empty() {
            let start = (self.me as usize + replica.shard as usize) % peers.len();
            peers.rotate_left(start);
        }
        let bytes = tier.fetch(replica.shard, segment, &peers, self.fetch_token(replica.shard).as_deref()).await?;
        let decoded = Segment::decode(bytes.clone()).ok()?;
        let intact = decoded.shard_id() == replica.shard
            && decoded.first_seqno() == segment.first
            && decoded.last_seqno() == segment.last;
        if !intact {
            tracing::warn!(shard = replica.shard, key = %segment.key, "a peer served another range; using the store");
        }
        intact.then_some(bytes)
    }

    /// Drops this follower's log after `keep_through` (a corrupt tail found
    /// in it) so catch-up refetches it from the leader; nothing that is not
    /// also held intact elsewhere is dropped by a follower.
    pub(crate) async fn truncate_corrupt(&self, replica: &ShardReplica, keep_through: u64) -> Result<(), ReplicaError> {
        let _guard = replica.follower.apply_lock.lock().await;
        let p = self.wal.positions(replica.shard)?;
        if keep_through < p.last_seqno {
            tracing::warn!(
                shard = replica.shard,
                from = keep_through + 1,
                to = p.last_seqno,
                "truncating a corrupt tail to refetch it from the leader"
            );
            self.wal.truncate_suffix(replica.shard, keep_through.max(p.first_seqno - 1)).await?;
            replica.follower.refetch_through.fetch_max(p.last_seqno, Ordering::AcqRel);
        }
        let last = self.wal.positions(replica.shard)?.last_seqno;
        replica.follower.next_expected.send_replace(last + 1);
        if self.wal.shard_corruption(replica.shard).is_empty() {
            replica.rules.lock().corruption_repaired();
        }
        Ok(())
    }

    /// Feeds what the WAL's corruption registry knows into each replica's
    /// rules, every `CORRUPTION_POLL`: a follower truncates a newly found
    /// corrupt tail and refetches it; a leader keeps it and reports it (its
    /// heartbeats carry it, and the coordinator fails over when an intact
    /// caught-up replica exists).
    pub(super) async fn run_corruption_watch(self: Arc<Self>) {
        let mut tick = tokio::time::interval(CORRUPTION_POLL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Shards found corrupt at the last look: each is told once it is
        // repaired. Only the WAL's (short) list of damage is read per tick,
        // never every shard.
        let mut flagged: std::collections::BTreeSet<walship_wal::ShardId> = Default::default();
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = self.shutdown.cancelled() => return,
            }
            let mut damaged: std::collections::BTreeMap<walship_wal::ShardId, u64> = Default::default();
            for range in self.wal.corruption() {
                let first = damaged.entry(range.shard).or_insert(range.first_bad_seqno);
                *first = (*first).min(range.first_bad_seqno);
            }
            for shard in flagged.iter().filter(|s| !damaged.contains_key(s)) {
                if let Some(replica) = self.replica(*shard) {
                    replica.rules.lock().corruption_repaired();
                }
            }
            flagged = damaged.keys().copied().collect();
            for (shard, first_bad) in damaged {
                let Some(replica) = self.replica(shard) else { continue };
                let _transition = replica.transition.lock().await;
                let commands = replica.rules.lock().corruption_found(Seqno(first_bad));
                if let Err(error) = self.perform(&replica, commands, 0).await {
                    tracing::warn!(shard = replica.shard, %error, "repairing a corrupt tail");
                }
            }
        }
    }
}

/// What one catch-up attempt did.
enum Pulled {
    /// Streamed from the leader to the end of the stream.
    Streamed,
    /// Re-seeded from the archive up to the leader's oldest record; the
    /// rest is still to stream.
    Reseeded,
}

/// How often the corruption registry is read into the replicas' rules.
const CORRUPTION_POLL: Duration = Duration::from_millis(250);
