//! The upgrade path: shards written one raft-engine entry per record (by
//! walship before chunks: region `shard`, entry index = seqno, a stale tail
//! hidden by a `walship/truncated` marker) are converted into chunks while
//! the store opens, before anything reads or writes them.
//!
//! A shard converts in steps. The first writes the shard's keys (first
//! retained seqno, epoch, log epoch) into its chunk region. Each later step
//! reads up to [`CONVERT_READ_BYTES`] of records from the old region,
//! verifying every frame, and writes them as chunks together with a
//! compaction of the old region up to them, in one atomic batch: a crash at
//! any point leaves every record in exactly one of the two regions, and the
//! next open resumes after the last chunk written. The old region's keys
//! go last. The old log files are freed as raft-engine purges them.
//!
//! A record that cannot be read ends the shard's conversion there: it and
//! every later record are dropped, logged at ERROR as corruption. The
//! shard then holds an intact prefix of its log (what the replication
//! layer expects of a replica that lost a tail) and fetches the rest again
//! from its peers.

use super::*;
use crate::record::FRAME_OVERHEAD;

/// The old layout's truncation marker.
const LEGACY_TRUNCATED_KEY: &[u8] = b"walship/truncated";
/// Frame bytes read from the old layout per conversion step.
#[cfg(not(test))]
const CONVERT_READ_BYTES: usize = 4 << 20;
/// Small steps in tests, so a fixture converts in several.
#[cfg(test)]
const CONVERT_READ_BYTES: usize = 16 << 10;

#[cfg(test)]
thread_local! {
    /// Tests: fail the conversion (as a crash would end it) after this many
    /// steps of record copying, before the next step's write.
    pub(super) static STOP_AFTER_STEPS: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

impl EngineStore {
    /// Converts every shard still in the one-entry-per-record layout.
    pub(super) fn convert_legacy_shards(&mut self) -> StoreResult<()> {
        let legacy: Vec<ShardId> = self
            .engine
            .raft_groups()
            .into_iter()
            .filter(|&group| group < CHUNK_REGION && get_u64(&self.engine, group, FIRST_KEY).is_some())
            .filter_map(|group| ShardId::try_from(group).ok())
            .collect();
        for &shard in &legacy {
            self.convert_legacy_shard(shard)?;
        }
        if !legacy.is_empty() {
            self.engine.purge_expired_files().map_err(io)?;
        }
        Ok(())
    }

    fn convert_legacy_shard(&mut self, shard: ShardId) -> StoreResult<()> {
        let old = u64::from(shard);
        let first = get_u64(&self.engine, old, FIRST_KEY).expect("a legacy shard has its first key");
        let marker = get_u64(&self.engine, old, LEGACY_TRUNCATED_KEY);
        let last = match self.engine.last_index(old) {
            Some(last) => marker.map_or(last, |m| m.min(last)),
            None => first - 1,
        }
        .max(first - 1);
        if !self.shards.lock().contains_key(&shard) {
            let mut batch = LogBatch::default();
            put_u64(&mut batch, region(shard), FIRST_KEY, first)?;
            for key in [EPOCH_KEY, LOG_EPOCH_KEY] {
                if let Some(value) = get_u64(&self.engine, old, key) {
                    put_u64(&mut batch, region(shard), key, value)?;
                }
            }
            self.write(&mut batch, true)?;
            let bounds = LogBounds { first_seqno: first, last_seqno: first - 1, durable_seqno: first - 1 };
            self.insert_state(shard, ShardState { bounds, chunks: Chunks::empty(1), tail: Some(KnownTail::default()) });
        }
        let resumed = self.state(shard)?.last_seqno + 1;
        tracing::info!(shard, from = resumed, to = last, "converting a shard stored one entry per record into chunks");
        let mut next = resumed;
        let mut steps = 0usize;
        while next <= last {
            #[cfg(test)]
            if STOP_AFTER_STEPS.with(|s| s.get()).is_some_and(|stop| steps >= stop) {
                return Err(StoreError::Io("test: conversion stopped".into()));
            }
            steps += 1;
            let frames = match legacy_read(&self.engine, old, next, last) {
                Ok(frames) => frames,
                Err(detail) => {
                    tracing::error!(
                        shard,
                        first_lost = next,
                        last_lost = last,
                        %detail,
                        "corruption: a record of the WAL being converted cannot be read; it and every later record of \
                         the shard are dropped and will be fetched again from its peers"
                    );
                    break;
                }
            };
            let end = frames.last().expect("at least one frame").seqno();
            let mut batch = LogBatch::default();
            let frames: Vec<&Frame> = frames.iter().collect();
            let plan = self.plan_append(shard, &frames, &mut batch, &|_, _, _| None)?;
            batch.add_command(old, Command::Compact { index: end + 1 });
            self.write(&mut batch, false)?;
            self.apply(self.shards.lock().get_mut(&shard).expect("inserted"), plan);
            next = end + 1;
        }
        let mut batch = LogBatch::default();
        for key in [FIRST_KEY, LEGACY_TRUNCATED_KEY, EPOCH_KEY, LOG_EPOCH_KEY] {
            batch.delete(old, key.to_vec());
        }
        if let Some(index) = self.engine.last_index(old) {
            batch.add_command(old, Command::Compact { index: index + 1 });
        }
        self.write(&mut batch, true)?;
        let mut shards = self.shards.lock();
        let state = shards.get_mut(&shard).expect("inserted");
        state.bounds.durable_seqno = state.bounds.last_seqno;
        tracing::info!(shard, records = next - resumed, steps, chunks = state.chunks.len(), "converted into chunks");
        Ok(())
    }
}

/// Records `[from, ..]` (up to `to`, about [`CONVERT_READ_BYTES`]) of an
/// old-layout region, each frame verified and at its index.
fn legacy_read(engine: &Engine, group: u64, from: u64, to: u64) -> Result<Vec<Frame>, String> {
    let max_frames = (CONVERT_READ_BYTES / FRAME_OVERHEAD) as u64 + 1;
    let end = (to + 1).min(from.saturating_add(max_frames));
    let mut entries = Vec::new();
    engine
        .fetch_entries_to::<ChunkEntry>(group, from, end, Some(CONVERT_READ_BYTES), &mut entries)
        .map_err(|e| e.to_string())?;
    if entries.is_empty() {
        return Err(format!("no entry for seqno {from}"));
    }
    let mut frames = Vec::with_capacity(entries.len());
    for (i, entry) in entries.into_iter().enumerate() {
        let expected = from + i as u64;
        let frame = Frame::parse(entry.data).map_err(|e| format!("record {expected}: {e}"))?;
        if entry.index != expected || frame.seqno() != expected {
            return Err(format!(
                "entry {} holds the record of seqno {} (expected {expected})",
                entry.index,
                frame.seqno()
            ));
        }
        frames.push(frame);
    }
    Ok(frames)
}
