//! Opening the raft-engine store: the engine itself, every shard's chunk
//! map rebuilt from its directory keys, the conversion of shards written one
//! entry per record, and the check of the log files an unclean stop may have
//! left half-written (see the module docs of `engine_store.rs`); and the
//! store's tuning.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;

use super::*;

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
    /// Frame bytes per stored chunk (a single larger record makes a chunk
    /// of its own). The index costs [`chunk::CHUNK_INDEX_BYTES`] of memory
    /// per chunk, and reading one record reads its whole chunk: 64 KiB
    /// keeps the index near 0.3 % of the log and a one-record read from the
    /// middle of the log within about 1.5x of the one-entry-per-record
    /// store's (`ops/bench/results/memory.md`; 128 KiB halves the index and
    /// costs reads more).
    pub chunk_bytes: u64,
    /// Bytes of the shards' unsealed tails (their small chunks not yet
    /// merged) kept in memory together, so a merge writes them without
    /// reading them back. Past it a shard's tail is read back from the log
    /// at its next merge. Without a bound a node holds up to `chunk_bytes`
    /// for every shard written small appends (64 MiB at 1,000 shards).
    pub tail_frames_bytes: usize,
    /// Log bytes past which raft-engine rewrites what still pins old files
    /// (the shards' small keys), so that they can be purged; purged files
    /// are recycled for later rotations, their earlier bytes left in place
    /// ([`crate::recovery_log`] tells those from damage). At least one log
    /// file more than `target_file_bytes` (raft-engine's rule with
    /// recycling); raft-engine's default, 10 GiB.
    pub purge_threshold_bytes: u64,
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
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            tail_frames_bytes: 16 << 20,
            purge_threshold_bytes: 10 << 30,
        }
    }
}

impl EngineStore {
    /// Opens (or creates) the store under `dir`, converts shards written one
    /// entry per record, and recovers every shard's positions. Everything
    /// recovered is synced before this returns, so it counts as durable.
    pub fn open(dir: &Path, config: &EngineStoreConfig) -> StoreResult<EngineStore> {
        let cfg = Config {
            dir: dir.to_string_lossy().into_owned(),
            target_file_size: ReadableSize(config.target_file_bytes),
            batch_compression_threshold: ReadableSize(config.compression_threshold_bytes),
            purge_threshold: ReadableSize(config.purge_threshold_bytes.max(config.target_file_bytes + 1)),
            ..Config::default()
        };
        let spares = if config.prefill { config.spare_bytes } else { 0 };
        let cfg = crate::zero_fill::with_spare_files(cfg, spares);
        let fs = Arc::new(ZeroFilledFs::new(if config.prefill { config.target_file_bytes } else { 0 }));
        let marker = std::fs::read_to_string(dir.join(CLEAN_SHUTDOWN_FILE)).ok();
        let clean = marker.is_some();
        crate::recovery_log::watch(dir, marker.as_deref().map(CleanEnd::parse));
        let engine = Engine::open_with_file_system(cfg, fs.clone());
        let recovery = crate::recovery_log::unwatch(dir);
        let engine = engine.map_err(|e| match recovery.iter().find_map(RecoveryFinding::unopenable) {
            Some((file, offset)) => StoreError::Io(format!(
                "{} is damaged at offset {offset}, where recovery cannot cut it away (newer log files follow it, or \
                 it is the file's header): {e}",
                file.display()
            )),
            None => io(e),
        })?;
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
        for group in engine.raft_groups() {
            let Some(shard) = shard_of(group) else { continue };
            if let Some(state) = load_shard(&engine, shard)? {
                shards.insert(shard, state);
            }
        }
        let mut store = EngineStore {
            engine,
            rotations: fs.rotations(),
            written_end: fs.written_end(),
            shards: Mutex::new(shards),
            write_lock: Mutex::new(()),
            epoch_locks: (0..EPOCH_LOCK_STRIPES).map(|_| Mutex::new(())).collect(),
            dir: dir.to_path_buf(),
            chunk_bytes: config.chunk_bytes.clamp(1, u64::from(u32::MAX)) as usize,
            tail_frames: TailFrames { used: AtomicUsize::new(0), limit: config.tail_frames_bytes },
            unsynced: Mutex::new(Default::default()),
            startup_damage: Vec::new(),
            recovery,
        };
        store.convert_legacy_shards()?;
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

    /// Reads and verifies every chunk held in log files `since` and newer
    /// (the newest file alone without `since`), returning the damage.
    fn check_tail(&self, files: &[(u64, PathBuf)], since: Option<u64>) -> Vec<StartupDamage> {
        let newest = files.last().map_or(0, |f| f.0);
        let since = since.unwrap_or(newest);
        let mut spans: BTreeMap<ShardId, (u64, u64)> = BTreeMap::new();
        for (_, path) in files.iter().filter(|f| f.0 >= since) {
            for (group, (lo, hi)) in entries_in_file(path) {
                let Some(shard) = shard_of(group) else { continue };
                let Some(seqnos) = self.seqnos_of_chunks(shard, lo, hi) else { continue };
                let span = spans.entry(shard).or_insert(seqnos);
                *span = (span.0.min(seqnos.0), span.1.max(seqnos.1));
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

    /// The seqnos held by `shard`'s chunks at indexes `[lo, hi]` (clamped
    /// to the chunks it still has).
    fn seqnos_of_chunks(&self, shard: ShardId, lo: u64, hi: u64) -> Option<(u64, u64)> {
        let shards = self.shards.lock();
        let chunks = &shards.get(&shard)?.chunks;
        if chunks.is_empty() {
            return None;
        }
        let lo = lo.max(chunks.first_index());
        let hi = hi.min(chunks.next_index() - 1);
        (lo <= hi).then(|| (chunks.span(lo).expect("in range").0, chunks.span(hi).expect("in range").1))
    }
}

pub(super) fn load_shard(engine: &Engine, shard: ShardId) -> StoreResult<Option<ShardState>> {
    let group = region(shard);
    let Some(first) = get_u64(engine, group, FIRST_KEY) else { return Ok(None) };
    let inconsistent = |what: String| StoreError::Io(format!("shard {shard}: the WAL's chunk directory {what}"));
    let mut directory = Vec::new();
    let mut bad_key = None;
    let (lo, hi) = chunk::key_range();
    engine
        .scan_raw_messages(group, Some(&lo), Some(&hi), false, |key, value| {
            match (chunk::index_of_key(key), ChunkMeta::decode(value)) {
                (Some(index), Some(meta)) => directory.push((index, meta)),
                _ => bad_key = Some(key.to_vec()),
            }
            true
        })
        .map_err(io)?;
    if let Some(key) = bad_key {
        return Err(inconsistent(format!("holds an unreadable key {key:?}")));
    }
    let mut chunks = Chunks::from_directory(&directory).map_err(|e| inconsistent(format!("has a gap: {e}")))?;
    match (engine.first_index(group), engine.last_index(group)) {
        (Some(lo), Some(hi)) if !chunks.is_empty() && lo == chunks.first_index() && hi + 1 == chunks.next_index() => {}
        (None, None) if chunks.is_empty() => {
            chunks = Chunks::empty(get_u64(engine, group, NEXT_CHUNK_KEY).unwrap_or(1));
        }
        (lo, hi) => {
            return Err(inconsistent(format!(
                "names chunks [{}, {}) but the log holds entries {lo:?}..={hi:?}",
                chunks.first_index(),
                chunks.next_index()
            )));
        }
    }
    let last = chunks.last_seqno().unwrap_or(first - 1).max(first - 1);
    let bounds = LogBounds { first_seqno: first, last_seqno: last, durable_seqno: last };
    Ok(Some(ShardState { bounds, chunks, tail: None }))
}

/// Writes `name` under `dir` atomically and durably (temporary file, fsync,
/// rename, fsync of the directory).
pub(super) fn write_durably(dir: &Path, name: &str, contents: &[u8]) -> std::io::Result<()> {
    let tmp = dir.join(format!("{name}.tmp"));
    let mut file = std::fs::File::create(&tmp)?;
    file.write_all(contents)?;
    file.sync_all()?;
    std::fs::rename(&tmp, dir.join(name))?;
    sync_dir(dir)
}

pub(super) fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}
