//! The corruption drill's node-side hook (`Control.DamageRecord`): damage
//! this node's stored copy of one durable record in place, as a bad disk
//! sector would, then verify that record against the file so the WAL's
//! corruption registry knows at once. From there the ordinary repair path
//! runs (a follower truncates and refetches; a leader is failed over when an
//! intact caught-up replica exists). Only on nodes started with
//! `--allow-crash-drills`, like `Crash`: it destroys data on purpose.

use std::os::unix::fs::FileExt;
use std::path::Path;

use walship_proto::log::DamageRecordResponse;
use walship_wal::ShardId;

use super::{ReplicaError, ReplicationNode};

/// Bytes flipped: enough to fail any checksum, few enough to stay inside a
/// small payload.
const FLIPPED: usize = 4;

impl ReplicationNode {
    /// Flips [`FLIPPED`] bytes in the middle of record `seqno`'s payload in
    /// the WAL file holding it (pwrite, then fsync), then verifies the
    /// record against the store. Refuses, changing nothing, unless crash
    /// drills are allowed, the shard is hosted and the record is durable
    /// here.
    pub async fn damage_record(&self, shard: ShardId, seqno: u64) -> Result<DamageRecordResponse, ReplicaError> {
        if !self.allow_crash_drills {
            return Err(ReplicaError::CrashDrillsDisabled);
        }
        self.replica_or_not_found(shard).map_err(|e| self.counted(e))?;
        let p = self.wal.positions(shard)?;
        if seqno == 0 || seqno < p.first_seqno || seqno > p.durable_seqno {
            return Err(ReplicaError::NoSuchRecord {
                shard,
                node: self.me,
                seqno,
                first: p.first_seqno,
                durable: p.durable_seqno,
            });
        }
        // The frame as stored (from memory or the store): raft-engine keeps
        // it verbatim as the entry's data (compression is off), so these
        // bytes are in the file.
        let frame = self.wal.read(shard, seqno, seqno, 1).await?.into_iter().next().ok_or_else(|| {
            ReplicaError::Unavailable(format!("shard {shard}: record {seqno} was not returned by a read"))
        })?;
        let file = self.wal.locate(shard, seqno).await.ok_or_else(|| {
            ReplicaError::Unavailable(format!("shard {shard}: the WAL cannot name the file holding record {seqno}"))
        })?;
        let bytes = frame.as_bytes().clone();
        let payload_at = bytes.len() - frame.payload().len();
        let target = file.clone();
        let offset = tokio::task::spawn_blocking(move || flip_in_file(&target, &bytes, payload_at))
            .await
            .map_err(|e| ReplicaError::Unavailable(format!("damage task: {e}")))?
            .map_err(|e| ReplicaError::Unavailable(format!("damaging {}: {e}", file.display())))?;
        tracing::warn!(
            shard,
            seqno,
            file = %file.display(),
            offset,
            "corruption drill: flipped {FLIPPED} bytes of a stored record on purpose"
        );
        // The damage is found now, not at the next scrub pass: the error it
        // returns is the point.
        let found = match self.wal.verify_range(shard, seqno, seqno).await {
            Ok(()) => None,
            Err(e) => e.corrupt_range().map(|(_, first, last)| (first, last)),
        };
        let (first_bad_seqno, last_bad_seqno) = found.unwrap_or((0, 0));
        Ok(DamageRecordResponse {
            file: file.display().to_string(),
            offset,
            bytes: FLIPPED as u32,
            first_bad_seqno,
            last_bad_seqno,
        })
    }
}

/// Flips up to [`FLIPPED`] bytes around the middle of the payload of the
/// last copy of `frame` in `file` (a truncated and rewritten record leaves
/// older copies before it; the newest is the one read); returns the offset.
/// Fails, writing nothing, if the frame is not in the file.
fn flip_in_file(file: &Path, frame: &[u8], payload_at: usize) -> std::io::Result<u64> {
    let contents = std::fs::read(file)?;
    let at = contents.windows(frame.len()).rposition(|w| w == frame).ok_or_else(|| {
        std::io::Error::other("the record's bytes are not in the file (is WAL compression on?); nothing changed")
    })?;
    let payload = frame.len() - payload_at;
    // An empty payload: flip the end of the frame header instead (still
    // under the batch checksum).
    let (start, len) = if payload == 0 {
        (frame.len().saturating_sub(FLIPPED), FLIPPED.min(frame.len()))
    } else {
        let len = FLIPPED.min(payload);
        (payload_at + (payload - len) / 2, len)
    };
    let offset = (at + start) as u64;
    let handle = std::fs::OpenOptions::new().write(true).open(file)?;
    let flipped: Vec<u8> = contents[at + start..at + start + len].iter().map(|b| b ^ 0x5a).collect();
    handle.write_all_at(&flipped, offset)?;
    handle.sync_all()?;
    Ok(offset)
}
