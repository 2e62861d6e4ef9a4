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
//! this store returns as [`StoreError::Io`] end it the same way. A corrupt
//! record ([`StoreError::Corrupt`]) does not: the replication layer repairs
//! it from an intact replica. Nor does a read that loses a race with a
//! compaction or truncation ([`StoreError::OutOfRange`]).
//!
//! Damage. raft-engine checks an entry batch's checksum only when an entry of
//! it is read, and reports a mismatch without naming a region, an index or
//! a file. A read that fails that way (or whose frame fails its crc32) is
//! retried entry by entry to find exactly which seqnos cannot be read (a
//! batch shares one checksum, so the whole run of the shard's records in it
//! is reported), and the file holding them is found from raft-engine's file
//! layout: the item batches of the `*.raftlog` files (then `*.rewrite`),
//! newest first, name the file of every entry ([`EngineStore::locate`]; the
//! newest file naming the entry is the copy raft-engine reads). When no file
//! names it (its item batch is damaged too) the error says "file unknown" and
//! the data dir is reported by [`LogStore::location`].
//!
//! Unclean shutdowns. A graceful shutdown leaves `walship-clean-shutdown` in
//! the directory ([`LogStore::mark_clean_shutdown`]); an open removes it.
//! `walship-tail-check` holds the sequence number of the newest log file at
//! the previous open: files before it were complete then, and only that file
//! and newer ones can have been written since. An open that finds no clean
//! marker reads and verifies every record those files hold (just the newest
//! file when there is no `walship-tail-check` yet) before it returns, and
//! keeps what it found for [`LogStore::startup_damage`]. That is at most a
//! few log files (`target_file_bytes` each) read at start. Older files are
//! the scrubber's. raft-engine's own recovery truncations (torn tails and
//! damage) are classified by [`crate::recovery_log`].

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;
use raft_engine::{Command, Config, LogBatch, MessageExt, ReadableSize};
use raft_proto::eraftpb::Entry;

use crate::record::{FRAME_OVERHEAD, Frame};
use crate::recovery_log::RecoveryFinding;
use crate::store::{
    LogBounds, LogStore, ShardAppend, ShardId, StartupDamage, StoreError, StoreResult, check_compact, check_continues,
    check_range, check_truncate,
};
use crate::zero_fill::ZeroFilledFs;

const FIRST_KEY: &[u8] = b"walship/first";
const TRUNCATED_KEY: &[u8] = b"walship/truncated";
const EPOCH_KEY: &[u8] = b"walship/epoch";
const LOG_EPOCH_KEY: &[u8] = b"walship/log-epoch";
/// Present only between a graceful shutdown and the next open.
pub const CLEAN_SHUTDOWN_FILE: &str = "walship-clean-shutdown";
/// The newest log file's sequence number at the previous open.
pub const TAIL_CHECK_FILE: &str = "walship-tail-check";
/// Frame bytes per read while verifying the tail at open.
const CHECK_READ_BYTES: usize = 1 << 20;
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
    dir: PathBuf,
    /// What the tail check at open found damaged.
    startup_damage: Vec<StartupDamage>,
    /// What raft-engine's recovery truncated, classified.
    recovery: Vec<RecoveryFinding>,
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
        let clean = dir.join(CLEAN_SHUTDOWN_FILE).exists();
        crate::recovery_log::watch(dir, clean);
        let engine = Engine::open_with_file_system(cfg, fs.clone());
        let recovery = crate::recovery_log::unwatch(dir);
        let engine = engine.map_err(io)?;
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
        let mut store = EngineStore {
            engine,
            rotations: fs.rotations(),
            shards: Mutex::new(shards),
            epoch_lock: Mutex::new(()),
            dir: dir.to_path_buf(),
            startup_damage: Vec::new(),
            recovery,
        };
        // Whatever recovery found may still sit in the page cache only.
        store.write(&mut Self::sync_marker(), true)?;
        let files = log_files(dir, ".raftlog");
        if !clean {
            let since = std::fs::read_to_string(dir.join(TAIL_CHECK_FILE)).ok().and_then(|s| s.trim().parse().ok());
            store.startup_damage = store.check_tail(&files, since);
        }
        // From here on, only the newest file and later ones can change.
        let newest = files.last().map_or(0, |f| f.0);
        write_durably(dir, TAIL_CHECK_FILE, newest.to_string().as_bytes())
            .map_err(|e| StoreError::Io(format!("recording the WAL tail check: {e}")))?;
        if clean {
            std::fs::remove_file(dir.join(CLEAN_SHUTDOWN_FILE))
                .and_then(|()| sync_dir(dir))
                .map_err(|e| StoreError::Io(format!("removing the clean-shutdown marker: {e}")))?;
        }
        Ok(store)
    }

    /// Reads and verifies every record held in log files `since` and newer
    /// (the newest file alone without `since`), returning the damage.
    fn check_tail(&self, files: &[(u64, PathBuf)], since: Option<u64>) -> Vec<StartupDamage> {
        let newest = files.last().map_or(0, |f| f.0);
        let since = since.unwrap_or(newest);
        let mut spans: BTreeMap<ShardId, (u64, u64)> = BTreeMap::new();
        for (_, path) in files.iter().filter(|f| f.0 >= since) {
            for (shard, (first, last)) in entries_in_file(path) {
                let span = spans.entry(shard).or_insert((first, last));
                *span = (span.0.min(first), span.1.max(last));
            }
        }
        let mut damage = Vec::new();
        for (shard, (first, last)) in spans {
            let Ok(bounds) = self.bounds(shard) else { continue };
            let (mut from, to) = (first.max(bounds.first_seqno), last.min(bounds.last_seqno));
            tracing::info!(shard, from, to, "verifying the WAL tail written before an unclean stop");
            while from <= to {
                match self.read(shard, from, to, CHECK_READ_BYTES) {
                    Ok(frames) => from += frames.len().max(1) as u64,
                    Err(StoreError::Corrupt { first_seqno, last_seqno, file, detail, .. }) => {
                        damage.push(StartupDamage { shard, first_seqno, last_seqno, file, detail });
                        from = last_seqno.max(from) + 1;
                    }
                    Err(e) => {
                        tracing::warn!(shard, from, to, error = %e, "could not verify the WAL tail");
                        break;
                    }
                }
            }
        }
        damage
    }

    /// What raft-engine's recovery truncated when this store opened.
    pub fn recovery_findings(&self) -> &[RecoveryFinding] {
        &self.recovery
    }

    /// Why one entry cannot be read, if it cannot: raft-engine's checksum,
    /// a missing entry, or the frame's own crc32.
    fn entry_damage(&self, shard: ShardId, seqno: u64) -> Option<String> {
        match self.engine.get_entry::<RecordEntry>(shard as u64, seqno) {
            Ok(Some(entry)) => match Frame::parse(entry.data) {
                Ok(frame) if frame.seqno() == seqno => None,
                Ok(frame) => Some(format!("entry {seqno} holds the record of seqno {}", frame.seqno())),
                Err(e) => Some(format!("record crc32: {e}")),
            },
            Ok(None) => Some("raft-engine has no entry for this seqno".to_owned()),
            Err(e) => Some(e.to_string()),
        }
    }

    /// After a failed read of `[from, to]`: the first run of adjacent seqnos
    /// (from `from`, extended up to the shard's last record) that cannot be
    /// read, as [`StoreError::Corrupt`]; `failure` itself if every entry
    /// reads (the failure was not damage).
    fn find_damage(&self, shard: ShardId, from: u64, to: u64, last: u64, failure: StoreError) -> StoreError {
        let Some((first_bad, detail)) = (from..=to).find_map(|s| self.entry_damage(shard, s).map(|d| (s, d))) else {
            return failure;
        };
        let mut last_bad = first_bad;
        while last_bad < last && self.entry_damage(shard, last_bad + 1).is_some() {
            last_bad += 1;
        }
        StoreError::Corrupt {
            shard,
            first_seqno: first_bad,
            last_seqno: last_bad,
            file: self.locate(shard, first_bad),
            detail,
        }
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

    /// Durably raises a per-shard counter kept under `key` to `value`; a
    /// lower value is ignored.
    fn raise_u64(&self, shard: ShardId, key: &[u8], value: u64) -> StoreResult<()> {
        self.state(shard)?;
        let _guard = self.epoch_lock.lock();
        if get_u64(&self.engine, shard, key).is_some_and(|current| current >= value) {
            return Ok(());
        }
        let mut batch = LogBatch::default();
        batch.put(shard as u64, key.to_vec(), value.to_le_bytes().to_vec()).map_err(io)?;
        self.write(&mut batch, true)
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
        let fetched = self.engine.fetch_entries_to::<RecordEntry>(
            shard as u64,
            from,
            end,
            Some(max_bytes.saturating_add(slack)),
            &mut entries,
        );
        match fetched {
            // An I/O error is the device's, not damage this store can name.
            Err(e @ raft_engine::Error::Io(_)) => return Err(io(e)),
            // A compaction (entries gone below) or a truncation and its
            // replacing append (fewer entries above) ran between the range
            // check and the fetch: reads are not ordered with them. A
            // refusal like any range outside the log, not a storage failure
            // (which would end the process).
            Err(raft_engine::Error::EntryCompacted | raft_engine::Error::EntryNotFound) => {
                let now = self.state(shard).map_or(bounds, |s| s.bounds);
                return Err(StoreError::OutOfRange { shard, from, to, first: now.first_seqno, last: now.last_seqno });
            }
            Err(e) => return Err(self.find_damage(shard, from, end - 1, bounds.last_seqno, io(e))),
            Ok(_) => {}
        }
        let mut size = 0usize;
        let mut frames = Vec::with_capacity(entries.len());
        for entry in entries {
            let seqno = entry.index;
            let frame = match Frame::parse(entry.data) {
                Ok(frame) if frame.seqno() == seqno => frame,
                Ok(frame) => {
                    let what = format!("shard {shard}: entry {seqno} holds the record of seqno {}", frame.seqno());
                    return Err(self.find_damage(shard, seqno, seqno, bounds.last_seqno, StoreError::Io(what)));
                }
                Err(e) => {
                    let what = StoreError::Io(format!("shard {shard}: record {seqno}: {e}"));
                    return Err(self.find_damage(shard, seqno, seqno, bounds.last_seqno, what));
                }
            };
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
        self.raise_u64(shard, EPOCH_KEY, epoch)
    }

    fn epoch(&self, shard: ShardId) -> StoreResult<u64> {
        self.state(shard)?;
        Ok(get_u64(&self.engine, shard, EPOCH_KEY).unwrap_or(0))
    }

    fn locate(&self, shard: ShardId, seqno: u64) -> Option<PathBuf> {
        let mut files = log_files(&self.dir, ".raftlog");
        files.reverse();
        let mut rewrites = log_files(&self.dir, ".rewrite");
        rewrites.reverse();
        files.extend(rewrites);
        files.into_iter().map(|f| f.1).find(|path| file_names_entry(path, shard, seqno))
    }

    fn location(&self) -> Option<PathBuf> {
        Some(self.dir.clone())
    }

    fn startup_damage(&self) -> Vec<StartupDamage> {
        self.startup_damage.clone()
    }

    fn set_log_epoch(&self, shard: ShardId, epoch: u64) -> StoreResult<()> {
        self.raise_u64(shard, LOG_EPOCH_KEY, epoch)
    }

    fn log_epoch(&self, shard: ShardId) -> StoreResult<u64> {
        self.state(shard)?;
        Ok(get_u64(&self.engine, shard, LOG_EPOCH_KEY).unwrap_or(0))
    }

    fn mark_clean_shutdown(&self) -> StoreResult<()> {
        self.engine.sync().map_err(io)?;
        write_durably(&self.dir, CLEAN_SHUTDOWN_FILE, b"clean\n")
            .map_err(|e| StoreError::Io(format!("writing the clean-shutdown marker: {e}")))
    }
}

/// raft-engine's files under `dir` ending with `suffix` (`.raftlog`,
/// `.rewrite`), as (sequence number, path), oldest first.
fn log_files(dir: &Path, suffix: &str) -> Vec<(u64, PathBuf)> {
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

/// Whether one raft-engine file's item batches name entry `seqno` of `shard`.
fn file_names_entry(path: &Path, shard: ShardId, seqno: u64) -> bool {
    let mut found = false;
    for_each_entries(path, |region, seqnos| {
        found = region == shard as u64 && seqnos.contains(&seqno);
        !found
    });
    found
}

/// The lowest and highest entry index each shard has in one raft-engine file.
fn entries_in_file(path: &Path) -> BTreeMap<ShardId, (u64, u64)> {
    let mut spans: BTreeMap<ShardId, (u64, u64)> = BTreeMap::new();
    for_each_entries(path, |region, seqnos| {
        if let (Ok(shard), Some(lo), Some(hi)) = (ShardId::try_from(region), seqnos.iter().min(), seqnos.iter().max()) {
            let span = spans.entry(shard).or_insert((*lo, *hi));
            *span = (span.0.min(*lo), span.1.max(*hi));
        }
        true
    });
    spans
}

/// Writes `name` under `dir` atomically and durably (temporary file, fsync,
/// rename, fsync of the directory).
fn write_durably(dir: &Path, name: &str, contents: &[u8]) -> std::io::Result<()> {
    let tmp = dir.join(format!("{name}.tmp"));
    let mut file = std::fs::File::create(&tmp)?;
    file.write_all(contents)?;
    file.sync_all()?;
    std::fs::rename(&tmp, dir.join(name))?;
    sync_dir(dir)
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
#[path = "engine_store_test.rs"]
mod tests;
