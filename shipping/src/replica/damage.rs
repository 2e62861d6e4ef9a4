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
        // A record in a shard's unsealed tail may be rewritten (merged with
        // the chunks after it) between the damage and the check, from the
        // intact copy in memory: the damaged copy is then superseded, and
        // nothing would ever read it. Or it moves while being looked for,
        // and is not where the WAL said. The newest copy is damaged again
        // until the check finds the damage.
        let mut attempt = 0;
        loop {
            attempt += 1;
            let (file, offset) = match self.damage_newest_copy(shard, seqno).await {
                Ok(damaged) => damaged,
                Err(e) if attempt < DAMAGE_ATTEMPTS => {
                    tracing::info!(shard, seqno, attempt, error = %e, "damaging a stored record; trying again");
                    tokio::time::sleep(DAMAGE_RETRY).await;
                    continue;
                }
                Err(e) => return Err(e),
            };
            // The damage is found now, not at the next scrub pass: the error
            // it returns is the point.
            let found = match self.wal.verify_range(shard, seqno, seqno).await {
                Ok(()) => None,
                Err(e) => e.corrupt_range().map(|(_, first, last)| (first, last)),
            };
            if found.is_none() && attempt < DAMAGE_ATTEMPTS {
                tracing::info!(shard, seqno, attempt, "the damaged copy was rewritten before the check; damaging anew");
                tokio::time::sleep(DAMAGE_RETRY).await;
                continue;
            }
            let (first_bad_seqno, last_bad_seqno) = found.unwrap_or((0, 0));
            return Ok(DamageRecordResponse {
                file: file.display().to_string(),
                offset,
                bytes: FLIPPED as u32,
                first_bad_seqno,
                last_bad_seqno,
            });
        }
    }

    /// Flips bytes of the newest stored copy of `seqno`; the file and offset.
    async fn damage_newest_copy(&self, shard: ShardId, seqno: u64) -> Result<(std::path::PathBuf, u64), ReplicaError> {
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
        Ok((file, offset))
    }
}

/// How many times a damage rewritten before its check is made anew, and
/// how long apart: a record in a tail being merged while appends go on is
/// rewritten every few milliseconds until its chunk fills and is sealed.
const DAMAGE_ATTEMPTS: u32 = 100;
const DAMAGE_RETRY: std::time::Duration = std::time::Duration::from_millis(20);

/// Flips up to [`FLIPPED`] bytes around the middle of the payload of every
/// copy of `frame` in `file` and in the log files that may hold a newer copy
/// (later append files, raft-engine's rewrite files); returns the offset of
/// the last copy in `file` (or the first found elsewhere). Every copy: which
/// one raft-engine reads cannot be told from the bytes (a truncated and
/// rewritten record, or a merged tail, leaves older copies; a recycled log
/// file keeps a previous life's bytes past its end), and the others are
/// never read. Fails, writing nothing, if the frame is in none of them.
fn flip_in_file(file: &Path, frame: &[u8], payload_at: usize) -> std::io::Result<u64> {
    let payload = frame.len() - payload_at;
    // An empty payload: flip the end of the frame header instead (still
    // under the batch checksum).
    let (start, len) = if payload == 0 {
        (frame.len().saturating_sub(FLIPPED), FLIPPED.min(frame.len()))
    } else {
        let len = FLIPPED.min(payload);
        (payload_at + (payload - len) / 2, len)
    };
    let mut reported = None;
    for path in files_to_search(file)? {
        let contents = std::fs::read(&path)?;
        let copies: Vec<usize> =
            contents.windows(frame.len()).enumerate().filter(|(_, w)| *w == frame).map(|(at, _)| at).collect();
        if copies.is_empty() {
            continue;
        }
        let handle = std::fs::OpenOptions::new().write(true).open(&path)?;
        for &at in &copies {
            let flipped: Vec<u8> = contents[at + start..at + start + len].iter().map(|b| b ^ 0x5a).collect();
            handle.write_all_at(&flipped, (at + start) as u64)?;
        }
        handle.sync_all()?;
        let last = (copies[copies.len() - 1] + start) as u64;
        if path == file || reported.is_none() {
            reported = Some(last);
        }
    }
    reported.ok_or_else(|| {
        std::io::Error::other("the record's bytes are not in the WAL's files (is WAL compression on?); nothing changed")
    })
}

/// `file` first, then the append files after it and every rewrite file of
/// its directory.
fn files_to_search(file: &Path) -> std::io::Result<Vec<std::path::PathBuf>> {
    let sequence = |p: &Path| -> Option<(u64, bool)> {
        let name = p.file_name()?.to_str()?;
        if let Some(seq) = name.strip_suffix(".raftlog") {
            return Some((seq.parse().ok()?, false));
        }
        Some((name.strip_suffix(".rewrite")?.parse().ok()?, true))
    };
    let own = sequence(file).map_or(0, |(seq, _)| seq);
    let mut files = vec![file.to_path_buf()];
    let Some(dir) = file.parent() else { return Ok(files) };
    let mut others: Vec<(u64, bool, std::path::PathBuf)> = std::fs::read_dir(dir)?
        .filter_map(|e| {
            let path = e.ok()?.path();
            let (seq, rewrite) = sequence(&path)?;
            (path != file && (rewrite || seq > own)).then_some((seq, rewrite, path))
        })
        .collect();
    others.sort();
    files.extend(others.into_iter().map(|(_, _, path)| path));
    Ok(files)
}
