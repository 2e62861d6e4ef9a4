//! Reading around damage in the raft-engine store: which chunks cannot be
//! read and why, salvaging the intact records of a damaged chunk from the
//! log file itself, and the scans of raft-engine's files these need (which
//! file names an entry, what entries a file holds).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::*;

impl EngineStore {
    /// Why the chunk at `index` cannot be read, if it cannot: raft-engine's
    /// checksum, a missing entry, or the chunk's own checks (header, every
    /// frame's crc32 and seqno, the shard it names).
    pub(super) fn chunk_damage(&self, shard: ShardId, index: u64) -> Option<String> {
        let bytes = match self.fetch_chunk(shard, index) {
            Ok(bytes) => bytes,
            Err(raft_engine::Error::EntryNotFound) => return Some("raft-engine has no entry for this chunk".into()),
            Err(e) => return Some(e.to_string()),
        };
        match Segment::decode(bytes) {
            Ok(segment) if segment.shard_id() == shard => None,
            Ok(segment) => Some(format!("chunk {index} holds records of shard {}", segment.shard_id())),
            Err(e) => Some(format!("chunk {index}: {e}")),
        }
    }

    /// After a failed read of the chunk at `index`: the run of adjacent
    /// chunks from it that cannot be read, as [`StoreError::Corrupt`] over
    /// their retained records; `failure` itself if the chunk reads (the
    /// failure was not damage).
    pub(super) fn find_damage(&self, shard: ShardId, index: u64, failure: StoreError) -> StoreError {
        let Some(detail) = self.chunk_damage(shard, index) else { return failure };
        let (bounds, next_index, span) = {
            let shards = self.shards.lock();
            let Some(state) = shards.get(&shard) else { return failure };
            (state.bounds, state.chunks.next_index(), state.chunks.span(index))
        };
        let Some((first, mut last)) = span else { return failure };
        let mut at = index + 1;
        while at < next_index
            && !self.shards.lock().get(&shard).is_some_and(|s| s.chunks.is_tombstone(at))
            && self.chunk_damage(shard, at).is_some()
        {
            match self.shards.lock().get(&shard).and_then(|s| s.chunks.span(at)) {
                Some((_, chunk_last)) => last = chunk_last,
                None => break,
            }
            at += 1;
        }
        let first_seqno = first.max(bounds.first_seqno);
        let last_seqno = last.min(bounds.last_seqno).max(first_seqno);
        StoreError::Corrupt { shard, first_seqno, last_seqno, file: self.locate(shard, first_seqno), detail }
    }

    /// The frames of the chunk at `index`, read around raft-engine after its
    /// batch checksum failed: the chunk's exact header (known from the
    /// directory) is looked for in the newest log file naming the entry,
    /// and each frame after it is checked on its own (crc32 and seqno).
    /// `None` for a frame that fails, so damage is reported per record and
    /// the intact records of a damaged chunk stay readable, as with one
    /// entry per record. `None` overall when the chunk's bytes cannot be
    /// found (its header or the file's metadata is damaged too), or are
    /// found more than once (which copy raft-engine wrote last cannot be
    /// told from the bytes: the whole chunk is then reported damaged).
    pub(super) fn salvage(&self, shard: ShardId, index: u64) -> Option<Vec<Option<Frame>>> {
        let (chunk, (first, last)) = {
            let shards = self.shards.lock();
            let chunks = &shards.get(&shard)?.chunks;
            (chunks.get(index)?, chunks.span(index)?)
        };
        if chunk.bytes == 0 {
            return None;
        }
        let header = crate::segment::SegmentHeader {
            shard_id: shard,
            first_seqno: first,
            record_count: u32::try_from(last - first + 1).ok()?,
            frames_len: chunk.bytes as usize,
        }
        .encode();
        let file = self.locate(shard, first)?;
        let bytes = std::fs::read(file).ok()?;
        // Only a chunk found once: another copy with the same header may be
        // a previous life's (a recycled log file keeps its old bytes past
        // the end of its new ones; a tail truncated and rewritten in a new
        // epoch leaves its old chunk before the new), and salvaging it
        // would serve records that are not the log's.
        let mut copies = bytes.windows(header.len()).enumerate().filter(|(_, w)| *w == header).map(|(at, _)| at);
        let at = copies.next()? + header.len();
        if copies.next().is_some() {
            return None;
        }
        let mut rest = bytes::Bytes::copy_from_slice(&bytes[at..(at + chunk.bytes as usize).min(bytes.len())]);
        let mut frames = Vec::with_capacity(header.len());
        for seqno in first..=last {
            match Frame::split_first(&rest) {
                Ok((frame, tail)) if frame.seqno() == seqno => {
                    frames.push(Some(frame));
                    rest = tail;
                }
                _ => {
                    frames.push(None);
                    match Frame::skip_len(&rest) {
                        Ok(len) => rest = rest.slice(len..),
                        Err(_) => rest = bytes::Bytes::new(),
                    }
                }
            }
        }
        Some(frames)
    }

    /// Frames `[from, to]` (within the chunk at `index`) of a chunk whose
    /// read failed: the salvaged frames when every one of them is intact;
    /// else [`StoreError::Corrupt`] over the first run of damaged records
    /// among them (the chunk-level report of [`EngineStore::find_damage`]
    /// when the chunk cannot be salvaged).
    pub(super) fn read_damaged(
        &self,
        shard: ShardId,
        index: u64,
        from: u64,
        to: u64,
        failure: StoreError,
    ) -> StoreResult<Vec<Frame>> {
        let Some(salvaged) = self.salvage(shard, index) else { return Err(self.find_damage(shard, index, failure)) };
        let Some((first, _)) = self.shards.lock().get(&shard).and_then(|s| s.chunks.span(index)) else {
            return Err(failure);
        };
        let wanted = (from - first) as usize..=((to - first) as usize).min(salvaged.len() - 1);
        let Some(bad) = wanted.clone().find(|&i| salvaged[i].is_none()) else {
            return Ok(salvaged[wanted].iter().map(|f| f.clone().expect("intact")).collect());
        };
        let run = salvaged[bad..].iter().take_while(|f| f.is_none()).count();
        let (first_seqno, last_seqno) = (first + bad as u64, first + (bad + run) as u64 - 1);
        let detail = format!("{failure}; the chunk's other records are intact");
        tracing::debug!(shard, first_seqno, last_seqno, "salvaged a damaged chunk");
        Err(StoreError::Corrupt { shard, first_seqno, last_seqno, file: self.locate(shard, first_seqno), detail })
    }

    /// Whether the chunk at `index` is no longer the one a read looked up
    /// (it starts elsewhere, holds no record, or is gone), once the write in
    /// flight is done.
    pub(super) fn replaced(&self, shard: ShardId, index: u64, first_seqno: u64) -> bool {
        drop(self.write_lock.lock());
        let shards = self.shards.lock();
        !shards
            .get(&shard)
            .and_then(|s| s.chunks.get(index))
            .is_some_and(|c| c.first_seqno == first_seqno && c.bytes > 0)
    }
}

/// raft-engine's files under `dir` ending with `suffix` (`.raftlog`,
/// `.rewrite`), as (sequence number, path), oldest first.
pub(super) fn log_files(dir: &Path, suffix: &str) -> Vec<(u64, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut files: Vec<(u64, PathBuf)> = entries
        .filter_map(|e| {
            let path = e.ok()?.path();
            let seq = path.file_name()?.to_str()?.strip_suffix(suffix)?.parse().ok()?;
            Some((seq, path))
        })
        .collect();
    files.sort();
    files
}

/// Calls `each(shard, entry indexes)` for every entry batch the item batches
/// of one raft-engine file name, in file order, until it returns false or
/// the file ends (or its metadata stops being readable).
///
/// raft-engine's public dump iterator yields its log items, but the item
/// content type is not exported (only with its `internals` feature, and not
/// even there), so the entry indexes are read from the item's `Debug` form:
/// `EntryIndexes(EntryIndexes([EntryIndex { index: 7, .. }, ..]))`. The
/// tests locating damaged records catch a change of that form.
fn for_each_entries(path: &Path, mut each: impl FnMut(u64, &[u64]) -> bool) {
    const ENTRY: &str = "EntryIndex { index: ";
    let fs = Arc::new(raft_engine::env::DefaultFileSystem);
    let Ok(items) = raft_engine::Engine::dump_with_file_system(path, fs) else { return };
    for item in items {
        let Ok(item) = item else { return };
        let content = format!("{:?}", item.content);
        if !content.starts_with("EntryIndexes(") {
            continue;
        }
        let seqnos: Vec<u64> = content
            .match_indices(ENTRY)
            .filter_map(|(at, _)| {
                let digits = &content[at + ENTRY.len()..];
                let end = digits.find(|c: char| !c.is_ascii_digit())?;
                digits[..end].parse().ok()
            })
            .collect();
        if !each(item.raft_group_id, &seqnos) {
            return;
        }
    }
}

/// Whether one raft-engine file's item batches name entry `index` of
/// region `group`.
pub(super) fn file_names_entry(path: &Path, group: u64, index: u64) -> bool {
    let mut found = false;
    for_each_entries(path, |region, indexes| {
        found = region == group && indexes.contains(&index);
        !found
    });
    found
}

/// The lowest and highest entry index each region has in one raft-engine
/// file.
pub(super) fn entries_in_file(path: &Path) -> BTreeMap<u64, (u64, u64)> {
    let mut spans: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
    for_each_entries(path, |region, indexes| {
        if let (Some(lo), Some(hi)) = (indexes.iter().min(), indexes.iter().max()) {
            let span = spans.entry(region).or_insert((*lo, *hi));
            *span = (span.0.min(*lo), span.1.max(*hi));
        }
        true
    });
    spans
}
