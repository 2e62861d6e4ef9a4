//! The peer tier of a re-seed: archived segments fetched from other
//! replicas' WALs (PeerExchange) before the object store, and the serving
//! side's reading of a segment from this node's WAL.
//!
//! The transport (tokens, channels, chunks) lives in `walship-peer`; the
//! binary joins the two through [`PeerTier`], so replication does not
//! depend on it.

use std::sync::Arc;

use bytes::Bytes;
use walship_wal::Segment;

use super::ReplicationNode;
use crate::NodeId;
use crate::archive::SegmentRef;

/// Fetches one archived segment of a shard from one of `peers` (in order),
/// checked whole; `None` when none of them served it intact. `token`: the
/// fetch token a coordinator minted for the task this fetch serves, when
/// it sent one (the tier signs its own otherwise, or once it expired).
#[tonic::async_trait]
pub trait PeerTier: Send + Sync + 'static {
    async fn fetch(&self, shard: u32, segment: &SegmentRef, peers: &[NodeId], token: Option<&str>) -> Option<Bytes>;
}

impl ReplicationNode {
    /// Keeps the fetch token a coordinator minted for this node's task on
    /// `shard` (adding this replica), for its peer fetches.
    pub fn set_fetch_token(&self, shard: u32, token: String) {
        self.fetch_tokens.lock().insert(shard, token);
    }

    pub(super) fn fetch_token(&self, shard: u32) -> Option<String> {
        self.fetch_tokens.lock().get(&shard).cloned()
    }

    /// Installs the peer tier (once).
    pub fn set_peer_tier(&self, tier: Arc<dyn PeerTier>) {
        let _ = self.peer_tier.set(tier);
    }

    pub(super) fn peer_tier(&self) -> Option<Arc<dyn PeerTier>> {
        self.peer_tier.get().cloned()
    }

    /// The segment of `shard` holding `first..=last` whose last record has
    /// `epoch`, encoded from this node's WAL exactly as the archiver
    /// encodes it (so the bytes are the archived object's); `None` unless
    /// this replica holds all of them durably and knows them committed.
    pub async fn sealed_segment(&self, shard: u32, first: u64, last: u64, epoch: u64) -> Result<Option<Bytes>, String> {
        let Some(replica) = self.replica(shard) else { return Ok(None) };
        let Ok(p) = self.wal.positions(shard) else { return Ok(None) };
        let committed = match replica.leader_state() {
            Some(leader) => leader.core.lock().commit().0,
            None => self.follower_committed(&replica).map_or(0, |(_, commit)| commit),
        };
        if first == 0 || first > last || first < p.first_seqno || last > p.durable_seqno.min(committed) {
            return Ok(None);
        }
        // No more than the archiver puts in a segment (`segment_bytes`, or
        // one larger record): a caller naming a range of the whole log gets
        // nothing, not the log in memory. A compaction racing the read: not
        // held any more.
        let limit = self.archive.get().map_or(crate::config::DEFAULT_SEGMENT_BYTES, |a| a.segment_bytes);
        let Ok(frames) = self.wal.read(shard, first, last, limit as usize).await else { return Ok(None) };
        let contiguous = frames.len() as u64 == last - first + 1
            && frames.first().is_some_and(|f| f.seqno() == first)
            && frames.last().is_some_and(|f| f.seqno() == last && f.epoch() == epoch);
        if !contiguous {
            return Ok(None);
        }
        Segment::encode(shard, frames).map(|s| Some(s.encoded().clone())).map_err(|e| e.to_string())
    }
}
