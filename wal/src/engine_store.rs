//! The production [`LogStore`]: one raft-engine instance per node, one
//! raft-engine region per shard (region id = shard id), one entry per record
//! (entry index = seqno, entry term = epoch, entry data = the record's
//! [`Frame`]).
//!
//! raft-engine has no suffix truncation without a replacing append, so a
//! truncation is recorded as a per-shard marker key (`walship/truncated`) that
//! hides the stale tail until the next append overwrites it; that append
//! deletes the marker in the same atomic batch. The oldest retained seqno is
//! kept under `walship/first`, so a fully compacted shard still knows where
//! its log continues after a restart.
//!
//! raft-engine panics on a failed fsync (`LogFileWriter::sync` unwraps the
//! file handle's sync), in whichever thread leads its write group. A panic
//! ends only that thread, so the WAL runs every call into this store under
//! `wal::fatal_on_panic`, which ends the process: a WAL whose durability is
//! unknown must stop it, and the coordinator fails its shards over. Errors
//! this store returns as [`StoreError::Io`] or [`StoreError::Corrupt`] end it
//! the same way; a read that loses a race with a compaction or truncation is
//! not one of them ([`StoreError::OutOfRange`]).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use parking_lot::Mutex;
use raft_engine::{Command, Config, LogBatch, MessageExt, ReadableSize};
use raft_proto::eraftpb::Entry;

use crate::record::{FRAME_OVERHEAD, Frame};
use crate::store::{
    LogBounds, LogStore, ShardAppend, ShardId, StoreError, StoreResult, check_compact, check_continues, check_range,
    check_truncate,
};
use crate::zero_fill::ZeroFilledFs;

const FIRST_KEY: &[u8] = b"walship/first";
const TRUNCATED_KEY: &[u8] = b"walship/truncated";
const EPOCH_KEY: &[u8] = b"walship/epoch";
/// Upper bound of the protobuf framing raft-engine adds around one frame
/// (tags and varints of index, term and the data length).
const ENTRY_FRAMING_BYTES: usize = 32;

/// raft-engine's typed-entry adapter for walship records.
#[derive(Clone)]
struct RecordEntry;

impl MessageExt for RecordEntry {
    type Entry = Entry;

    fn index(e: &Entry) -> u64 {
        e.index
    }
}

/// Tuning for the raft-engine store.
#[derive(Debug, Clone)]
pub struct EngineStoreConfig {
    /// Target size of one raft-engine log file before rotation.
    pub target_file_bytes: u64,
    /// Compress a write batch larger than this with LZ4; 0 disables
    /// compression (the default: records are often already compressed, and
    /// the CPU is better spent elsewhere on a small node).
    pub compression_threshold_bytes: u64,
    /// Zero-fill a fresh store's first log file while it opens, and a
    /// reopened store's active file behind its recovered end, so a group
    /// commit's fdatasync overwrites written blocks instead of converting
    /// fresh ones ([`crate::zero_fill`]; later files are recycled ones once
    /// compaction purges). Costs up to one file of zeros written and synced
    /// at every open. Off here (tests open many stores); a node turns it
    /// on by default (`wal.prefill`).
    pub prefill: bool,
    /// With `prefill`: bytes of spare log files of zeros, written and synced
    /// when the store opens with fewer, that rotations take instead of
    /// allocating a new file ([`crate::zero_fill::spare_files`]; rounded down
    /// to the whole files raft-engine's recycle pool holds). 0 lays out none.
    pub spare_bytes: u64,
}

/// A node's default [`EngineStoreConfig::spare_bytes`] (`wal.spare_bytes`).
pub const DEFAULT_SPARE_BYTES: u64 = 2 << 30;

impl Default for EngineStoreConfig {
    fn default() -> Self {
        EngineStoreConfig {
            target_file_bytes: 128 << 20,
            compression_threshold_bytes: 0,
            prefill: false,
            spare_bytes: 0,
        }
    }
}

type Engine = raft_engine::Engine<ZeroFilledFs>;

#[derive(Debug, Clone, Copy)]
struct ShardState {
    bounds: LogBounds,
    /// A truncation marker is stored and must be deleted by the next append.
    truncated: bool,
}

/// raft-engine-backed multi-shard log.
pub struct EngineStore {
    engine: Engine,
    rotations: Arc<crate::zero_fill::Rotations>,
    shards: Mutex<BTreeMap<ShardId, ShardState>>,
    /// Serialises epoch read-modify-writes so the epoch never moves back.
    epoch_lock: Mutex<()>,
}

fn io(e: raft_engine::Error) -> StoreError {
    StoreError::Io(e.to_string())
}

fn get_u64(engine: &Engine, shard: ShardId, key: &[u8]) -> Option<u64> {
    engine.get(shard as u64, key).and_then(|v| v.as_slice().try_into().ok().map(u64::from_le_bytes))
}

impl EngineStore {
    /// Opens (or creates) the store under `dir` and recovers every shard's
    /// positions. Everything recovered is synced before this returns, so it
    /// counts as durable.
    pub fn open(dir: &Path, config: &EngineStoreConfig) -> StoreResult<EngineStore> {
        let cfg = Config {
            dir: dir.to_string_lossy().into_owned(),
            target_file_size: ReadableSize(config.target_file_bytes),
            batch_compression_threshold: ReadableSize(config.compression_threshold_bytes),
            ..Config::default()
        };
        let spares = if config.prefill { config.spare_bytes } else { 0 };
        let cfg = crate::zero_fill::with_spare_files(cfg, spares);
        let fs = Arc::new(ZeroFilledFs::new(if config.prefill { config.target_file_bytes } else { 0 }));
        let engine = Engine::open_with_file_system(cfg, fs.clone()).map_err(io)?;
        let created = fs.opened();
        if config.prefill && !created {
            crate::zero_fill::refill_active_tail(dir, config.target_file_bytes)
                .map_err(|e| StoreError::Io(format!("zero-filling the WAL file's tail: {e}")))?;
        }
        if spares > 0 {
            let expected = crate::zero_fill::spare_files(spares, config.target_file_bytes);
            crate::zero_fill::sync_spare_files(dir, config.target_file_bytes, expected)
                .map_err(|e| StoreError::Io(format!("syncing the spare WAL files: {e}")))?;
        }
        let mut shards = BTreeMap::new();
        for region in engine.raft_groups() {
            let Ok(shard) = ShardId::try_from(region) else { continue };
            let Some(first_kv) = get_u64(&engine, shard, FIRST_KEY) else { continue };
            let marker = get_u64(&engine, shard, TRUNCATED_KEY);
            let (first, last) = match (engine.first_index(region), engine.last_index(region)) {
                (Some(first), Some(last)) => (first, last),
                _ => (first_kv, first_kv - 1),
            };
            let last = marker.map_or(last, |m| m.min(last)).max(first - 1);
            let bounds = LogBounds { first_seqno: first, last_seqno: last, durable_seqno: last };
            shards.insert(shard, ShardState { bounds, truncated: marker.is_some() });
        }
        let store =
            EngineStore { engine, rotations: fs.rotations(), shards: Mutex::new(shards), epoch_lock: Mutex::new(()) };
        // Whatever recovery found may still sit in the page cache only.
        store.write(&mut Self::sync_marker(), true)?;
        Ok(store)
    }

    /// A tiny non-empty batch: raft-engine skips empty writes entirely, even
    /// when asked to sync.
    fn sync_marker() -> LogBatch {
        let mut batch = LogBatch::default();
        batch.put(0, b"walship/sync".to_vec(), vec![1]).expect("small key-value");
        batch
    }

    fn write(&self, batch: &mut LogBatch, sync: bool) -> StoreResult<()> {
        self.engine.write(batch, sync).map(|_| ()).map_err(io)
    }

    fn state(&self, shard: ShardId) -> StoreResult<ShardState> {
        self.shards.lock().get(&shard).copied().ok_or(StoreError::UnknownShard(shard))
    }

    /// Bytes the engine's log files occupy on disk.
    pub fn disk_bytes(&self) -> u64 {
        self.engine.get_used_size() as u64
    }

    /// Log file rotations since the store opened, by the file rotated into
    /// (for `/metrics`: [`crate::metrics::RotationsCollector`]).
    pub fn rotations(&self) -> Arc<crate::zero_fill::Rotations> {
        self.rotations.clone()
    }
}

impl LogStore for EngineStore {
    fn create_shard(&self, shard: ShardId) -> StoreResult<()> {
        if self.shards.lock().contains_key(&shard) {
            return Ok(());
        }
        let mut batch = LogBatch::default();
        batch.put(shard as u64, FIRST_KEY.to_vec(), 1u64.to_le_bytes().to_vec()).map_err(io)?;
        self.write(&mut batch, true)?;
        self.shards.lock().insert(shard, ShardState { bounds: LogBounds::EMPTY, truncated: false });
        Ok(())
    }

    fn shards(&self) -> Vec<ShardId> {
        self.shards.lock().keys().copied().collect()
    }

    fn bounds(&self, shard: ShardId) -> StoreResult<LogBounds> {
        Ok(self.state(shard)?.bounds)
    }

    fn append(&self, parts: &[ShardAppend], sync: bool) -> StoreResult<()> {
        // Validate everything first (all or nothing), then build one batch.
        let mut next: BTreeMap<ShardId, (u64, bool)> = BTreeMap::new();
        {
            let shards = self.shards.lock();
            for part in parts {
                let state = shards.get(&part.shard).ok_or(StoreError::UnknownShard(part.shard))?;
                let (expected, _) = *next.entry(part.shard).or_insert((state.bounds.last_seqno + 1, state.truncated));
                check_continues(part.shard, expected, &part.frames)?;
                next.get_mut(&part.shard).expect("inserted").0 = expected + part.frames.len() as u64;
            }
        }
        let mut batch = LogBatch::default();
        for part in parts {
            let entries: Vec<Entry> = part
                .frames
                .iter()
                .map(|frame| Entry {
                    index: frame.seqno(),
                    term: frame.epoch(),
                    data: frame.as_bytes().clone(),
                    ..Entry::default()
                })
                .collect();
            batch.add_entries::<RecordEntry>(part.shard as u64, &entries).map_err(io)?;
        }
        for (&shard, &(_, truncated)) in &next {
            if truncated {
                batch.delete(shard as u64, TRUNCATED_KEY.to_vec());
            }
        }
        if sync && batch.is_empty() {
            batch = Self::sync_marker();
        }
        self.write(&mut batch, sync)?;
        let mut shards = self.shards.lock();
        for (shard, (next_seqno, _)) in next {
            let state = shards.get_mut(&shard).expect("validated");
            state.bounds.last_seqno = next_seqno - 1;
            state.truncated = false;
        }
        if sync {
            for state in shards.values_mut() {
                state.bounds.durable_seqno = state.bounds.last_seqno;
            }
        }
        Ok(())
    }

    fn read(&self, shard: ShardId, from: u64, to: u64, max_bytes: usize) -> StoreResult<Vec<Frame>> {
        let bounds = self.state(shard)?.bounds;
        check_range(shard, bounds, from, to)?;
        // raft-engine bounds reads by encoded entry size, which is a frame
        // plus a few bytes of protobuf framing: ask it for enough entries to
        // be sure, then cut in frame bytes exactly.
        let max_frames = (max_bytes / FRAME_OVERHEAD).saturating_add(1) as u64;
        let end = (to + 1).min(from.saturating_add(max_frames));
        let slack = ENTRY_FRAMING_BYTES.saturating_mul((end - from) as usize);
        let mut entries = Vec::new();
        self.engine
            .fetch_entries_to::<RecordEntry>(
                shard as u64,
                from,
                end,
                Some(max_bytes.saturating_add(slack)),
                &mut entries,
            )
            .map_err(|e| match e {
                // A compaction (entries gone below) or a truncation and its
                // replacing append (fewer entries above) ran between the
                // range check and the fetch: reads are not ordered with
                // them. A refusal like any range outside the log, not a
                // storage failure (which would end the process).
                raft_engine::Error::EntryCompacted | raft_engine::Error::EntryNotFound => {
                    let now = self.state(shard).map_or(bounds, |s| s.bounds);
                    StoreError::OutOfRange { shard, from, to, first: now.first_seqno, last: now.last_seqno }
                }
                e => io(e),
            })?;
        let mut size = 0usize;
        let mut frames = Vec::with_capacity(entries.len());
        for entry in entries {
            let seqno = entry.index;
            let frame = Frame::parse(entry.data).map_err(|source| StoreError::Corrupt { shard, seqno, source })?;
            if frame.seqno() != seqno {
                return Err(StoreError::Io(format!(
                    "shard {shard}: entry {seqno} holds the record of seqno {}",
                    frame.seqno()
                )));
            }
            size += frame.len();
            if size > max_bytes && !frames.is_empty() {
                break;
            }
            frames.push(frame);
        }
        Ok(frames)
    }

    fn truncate_suffix(&self, shard: ShardId, keep_through: u64) -> StoreResult<()> {
        let bounds = self.state(shard)?.bounds;
        check_truncate(shard, bounds, keep_through)?;
        if keep_through >= bounds.last_seqno {
            return Ok(());
        }
        let mut batch = LogBatch::default();
        batch.put(shard as u64, TRUNCATED_KEY.to_vec(), keep_through.to_le_bytes().to_vec()).map_err(io)?;
        self.write(&mut batch, true)?;
        let mut shards = self.shards.lock();
        let state = shards.get_mut(&shard).expect("checked");
        state.bounds.last_seqno = keep_through;
        state.bounds.durable_seqno = state.bounds.durable_seqno.min(keep_through);
        state.truncated = true;
        Ok(())
    }

    fn compact_prefix(&self, shard: ShardId, first_kept: u64) -> StoreResult<()> {
        let bounds = self.state(shard)?.bounds;
        check_compact(shard, bounds, first_kept)?;
        if first_kept <= bounds.first_seqno {
            return Ok(());
        }
        let mut batch = LogBatch::default();
        batch.add_command(shard as u64, Command::Compact { index: first_kept });
        batch.put(shard as u64, FIRST_KEY.to_vec(), first_kept.to_le_bytes().to_vec()).map_err(io)?;
        self.write(&mut batch, true)?;
        self.shards.lock().get_mut(&shard).expect("checked").bounds.first_seqno = first_kept;
        // Drop whole log files no shard needs any more.
        self.engine.purge_expired_files().map_err(io)?;
        Ok(())
    }

    fn set_epoch(&self, shard: ShardId, epoch: u64) -> StoreResult<()> {
        self.state(shard)?;
        let _guard = self.epoch_lock.lock();
        if get_u64(&self.engine, shard, EPOCH_KEY).is_some_and(|current| current >= epoch) {
            return Ok(());
        }
        let mut batch = LogBatch::default();
        batch.put(shard as u64, EPOCH_KEY.to_vec(), epoch.to_le_bytes().to_vec()).map_err(io)?;
        self.write(&mut batch, true)
    }

    fn epoch(&self, shard: ShardId) -> StoreResult<u64> {
        self.state(shard)?;
        Ok(get_u64(&self.engine, shard, EPOCH_KEY).unwrap_or(0))
    }
}
