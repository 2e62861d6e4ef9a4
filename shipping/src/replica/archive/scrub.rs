//! The archiving replica's scrub: every `scrub_interval` it reads the
//! shard's archived segments back, one at a time, and uploads a damaged
//! or missing one again from its WAL, or from another replica's (see the
//! parent module's docs).

use std::sync::Arc;

use bytes::Bytes;
use walship_objstore::{ObjectKey, StoreError};
use walship_wal::Segment;

use super::{Archive, Duty, now_ms};
use crate::NodeId;
use crate::archive::SegmentRef;
use crate::replica::ReplicationNode;
use crate::replica::shard::ShardReplica;

/// What a scrub found wrong with one object, and what became of it.
enum Damage {
    Repaired,
    Unrepairable(String),
}

impl ReplicationNode {
    /// One scrub pass of a shard this node archives (the archive loop
    /// starts one every `scrub_interval`), shown in its archive status.
    pub(in crate::replica) async fn scrub_pass(self: Arc<Self>, replica: Arc<ShardReplica>, archive: Arc<Archive>) {
        let shard = replica.shard;
        match self.scrub(&replica, &archive).await {
            Ok(Some(unrepairable)) => {
                if let Some(status) = self.archive_status.lock().get_mut(&shard) {
                    status.scrubs += 1;
                    status.last_scrub_unix_ms = Some(now_ms());
                    status.damaged_unrepairable = unrepairable;
                }
            }
            Ok(None) => {} // leadership moved on mid-pass
            // The store did not answer: the uploader shows and counts that.
            Err(e) => {
                tracing::warn!(shard, error = %e, next_in = ?archive.scrub_interval, "scrubbing the archive stopped");
            }
        }
    }

    /// One pass: reads every listed segment of the shard back, one at a
    /// time, repairing what it can; then fills a gap before later segments.
    /// Answers the unrepairable objects (`key: why`), or `None` when this
    /// node stopped leading mid-pass.
    async fn scrub(&self, replica: &ShardReplica, archive: &Archive) -> Result<Option<Vec<String>>, StoreError> {
        use crate::archive::restore::{self, RestoreError};
        let shard = replica.shard;
        // What this node had uploaded without a hole before listing: a gap
        // below it is missing from the store; one at or past it may be
        // uploads still in flight (they end out of order).
        let uploaded_before = self.archive_status.lock().get(&shard).map_or(0, |s| s.archived_seqno);
        self.metrics.archive_listings.inc();
        let listing = restore::list(archive.store.as_ref(), &archive.layout, shard).await?;
        let mut all: Vec<SegmentRef> = listing.chain.iter().chain(&listing.unused).cloned().collect();
        all.sort_by_key(|s| (s.first, s.last));
        let mut unrepairable = Vec::new();
        for segment in &all {
            if self.shutdown.is_cancelled() || !matches!(self.duty(replica, archive), Duty::Archive { .. }) {
                return Ok(None);
            }
            let detail = match restore::fetch_segment(archive.store.as_ref(), shard, segment).await {
                Ok(_) => continue,
                Err(RestoreError::Damaged { detail, .. }) => detail,
                Err(RestoreError::Store(e)) => return Err(e),
                Err(RestoreError::Sink(e)) => return Err(StoreError::Unavailable(e)),
            };
            tracing::error!(shard, key = %segment.key, detail, "an archived segment object is damaged");
            let damage = self.reupload(replica, archive, segment.first, segment.last, Some(segment)).await?;
            self.count_damage(archive, shard, &segment.key, damage, &mut unrepairable);
        }
        // Segments past a gap: the records between are missing from the
        // archive (an object deleted); uploaded again like a damaged one.
        // Only a gap below what was uploaded before the listing: one past
        // it belongs to uploads in flight (a failed one is retried).
        let end = listing.archived_seqno;
        if let Some(next) = listing.unused.iter().map(|s| s.first).filter(|&f| f > end + 1).min()
            && end > 0
            && end < uploaded_before
        {
            let (first, last) = (end + 1, next - 1);
            let name = format!("{}{first:020}-{last:020} (missing)", archive.layout.segments_prefix(shard));
            tracing::error!(shard, first, last, "the archive misses records before later segments");
            let damage = self.reupload(replica, archive, first, last, None).await?;
            self.count_damage(archive, shard, &name, damage, &mut unrepairable);
        }
        Ok(Some(unrepairable))
    }

    fn count_damage(&self, archive: &Archive, shard: u32, key: &str, damage: Damage, unrepairable: &mut Vec<String>) {
        match damage {
            Damage::Repaired => {
                archive.metrics.damaged_objects.with_label_values(&["repaired"]).inc();
                if let Some(status) = self.archive_status.lock().get_mut(&shard) {
                    status.damaged_repaired += 1;
                }
                tracing::warn!(shard, key, "uploaded the damaged archive object again from this leader's WAL");
            }
            Damage::Unrepairable(why) => {
                // Each object once per process, whichever pass found it.
                if self.scrub_counted.lock().insert((shard, key.to_string())) {
                    archive.metrics.damaged_objects.with_label_values(&["unrepairable"]).inc();
                }
                tracing::error!(shard, key, why, "cannot repair the damaged archive object");
                unrepairable.push(format!("{key}: {why}"));
            }
        }
    }

    /// Uploads `first..=last` again from this leader's WAL: to `segment`'s
    /// own key (its records must end in the epoch its name says), or for a
    /// gap in pieces of at most `segment_bytes`, each under its own name.
    async fn reupload(
        &self,
        replica: &ShardReplica,
        archive: &Archive,
        first: u64,
        last: u64,
        segment: Option<&SegmentRef>,
    ) -> Result<Damage, StoreError> {
        let shard = replica.shard;
        let Duty::Archive { commit, .. } = self.duty(replica, archive) else {
            return Ok(Damage::Unrepairable("this node no longer archives the shard".into()));
        };
        if last > commit {
            return Ok(Damage::Unrepairable(format!("it holds seqnos past this leader's commit ({commit})")));
        }
        let held = match self.wal.positions(shard) {
            Ok(p) => p.first_seqno,
            Err(e) => return Err(StoreError::Unavailable(e.to_string())),
        };
        if first < held {
            // Another replica may still hold the records: fetch the segment
            // from its WAL (PeerExchange), checked whole, and upload that.
            if let (Some(s), Some(tier)) = (segment, self.peer_tier()) {
                let peers: Vec<NodeId> = replica.members().others(self.me);
                let intact = |bytes: &Bytes| {
                    Segment::decode(bytes.clone())
                        .is_ok_and(|d| d.shard_id() == shard && d.first_seqno() == s.first && d.last_seqno() == s.last)
                };
                if let Some(bytes) = tier.fetch(shard, s, &peers, None).await.filter(intact) {
                    archive.store.put(&ObjectKey::new(s.key.clone())?, bytes).await?;
                    return Ok(Damage::Repaired);
                }
            }
            return Ok(Damage::Unrepairable(format!(
                "this node's WAL starts at seqno {held} (older records compacted) and no other replica served \
                 seqnos {first}..={last}"
            )));
        }
        let max_bytes = if segment.is_some() { usize::MAX } else { archive.segment_bytes as usize };
        let mut from = first;
        while from <= last {
            let frames = match self.wal.read(shard, from, last, max_bytes).await {
                Ok(frames) => frames,
                Err(e) => return Ok(Damage::Unrepairable(format!("reading seqnos {from}..={last} from the WAL: {e}"))),
            };
            let (Some(head), Some(tail)) = (frames.first(), frames.last()) else {
                return Ok(Damage::Unrepairable(format!("the WAL returned no record at {from}")));
            };
            let (got_first, got_last, got_epoch) = (head.seqno(), tail.seqno(), tail.epoch());
            let contiguous = frames.len() as u64 == got_last.saturating_sub(got_first) + 1;
            if got_first != from || !contiguous || (segment.is_some() && got_last != last) {
                return Ok(Damage::Unrepairable(format!(
                    "the WAL returned seqnos {got_first}..={got_last} for {from}..={last}"
                )));
            }
            let key = match segment {
                Some(s) if s.epoch != got_epoch => {
                    return Ok(Damage::Unrepairable(format!(
                        "its name says epoch {}, this leader's record {last} has epoch {got_epoch}",
                        s.epoch
                    )));
                }
                Some(s) => walship_objstore::ObjectKey::new(s.key.clone())?,
                None => archive.layout.segment_key(shard, from, got_last, got_epoch),
            };
            let encoded = Segment::encode(shard, frames).map_err(|e| StoreError::Unavailable(e.to_string()))?;
            archive.store.put(&key, encoded.encoded().clone()).await?;
            from = got_last + 1;
        }
        Ok(Damage::Repaired)
    }
}
