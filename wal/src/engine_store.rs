//! The production [`LogStore`]: one raft-engine instance per node, one
//! raft-engine region per shard, one raft-engine entry per *chunk* of the
//! shard's records.
//!
//! Layout. A shard's region is `CHUNK_REGION | shard` ([`region`]). Its
//! entries are chunks ([`crate::chunk`]): consecutive records encoded as a
//! [`Segment`] (the frames byte-identical to what was shipped), at
//! consecutive raft-engine indexes. Each chunk has a directory key
//! (`walship/c/<index>` → first and last seqno, bytes, sealed) written in
//! the same atomic batch as the chunk, so the map from seqno to chunk is
//! rebuilt at open without reading the log. Keys beside them:
//! `walship/first` (the oldest retained seqno; a fully compacted shard
//! still knows where its log continues), `walship/epoch`,
//! `walship/log-epoch`, and `walship/next-chunk` (the index after the last
//! chunk, kept when none is left).
//!
//! Memory. raft-engine keeps an index entry per entry and every key in
//! memory; with one entry per chunk (`chunk_bytes` of frames, 64 KiB by
//! default) the node's memory grows with the log's bytes over that, about
//! 0.3 % of a log of chunks, not 49 bytes per record as one entry per record
//! did ([`LogStore::index_bytes`], `walship_wal_index_bytes`).
//!
//! Writing. A group commit's records for a shard become one or more chunks
//! (split at `chunk_bytes`; all sealed when there are several). A small
//! commit leaves a small *unsealed* chunk at the shard's end (its tail);
//! once the tail and the new records add up to `chunk_bytes`, or the tail
//! holds [`MAX_TAIL_CHUNKS`] chunks, the append rewrites the tail and the
//! new records as full chunks at the tail's first index (the remainder one
//! unsealed chunk, the start of the next tail), in the same atomic batch:
//! raft-engine replaces every entry from that index, and a crash before the
//! batch is durable leaves the old tail as it was. The tail's frames are
//! kept in memory (less than a chunk per shard, every shard's together
//! within [`EngineStoreConfig::tail_frames_bytes`]), so a merge mostly
//! reads nothing back; past that budget the WAL offers its tail cache's
//! copy ([`LogStore::append_with_earlier`]), taken only when it is exactly
//! the tail (seqnos, count and bytes), and otherwise the tail is read back. Records that arrive in small commits are written
//! two to a few times; large commits, once. The superseded copies stay in
//! older log files until raft-engine purges them; nothing reads them, and
//! damage to them is harmless.
//! A suffix truncation at a seqno inside a chunk rewrites that chunk's
//! prefix at the chunk's index; compaction drops whole chunks before the
//! one holding the new first seqno (that one is kept whole; reads never
//! return its records below `walship/first`).
//!
//! Reading. A read finds the chunk holding its first seqno in the map,
//! fetches the chunk (raft-engine verifies its batch checksum), and walks
//! the frames by their length prefixes to the ones asked for, verifying
//! each returned frame's crc32 and seqno ([`Segment::frames_in`]). A read
//! that races a merge or truncation of the chunk it looked up looks again.
//!
//! Upgrade. Stores written by walship before chunks kept one entry per
//! record in region `shard` (index = seqno). [`EngineStore::open`] converts
//! each such shard into chunks before it returns (`engine_store_legacy.rs`).
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
//! a file. A chunk whose read fails that way is *salvaged*: its exact header
//! (known from the directory) is found in the log file holding it, and each
//! frame after it is checked on its own crc32 and seqno, so a read reports
//! exactly the damaged records and serves the chunk's intact ones, as when
//! each record had its own entry. A chunk that cannot be salvaged (its
//! header or its file's metadata is damaged too), or whose own checks fail,
//! is reported whole, with the run of adjacent damaged chunks. The file
//! holding damage is found from raft-engine's file layout: the item batches of
//! the `*.raftlog` files (then `*.rewrite`), newest first, name the file of
//! every entry ([`EngineStore::locate`]; the newest file naming the entry is
//! the copy raft-engine reads). When no file names it (its item batch is
//! damaged too) the error says "file unknown" and the data dir is reported
//! by [`LogStore::location`]. A merge never copies damage: a tail that
//! cannot be read back is left as it is and sealed.
//!
//! Unclean shutdowns. A graceful shutdown leaves `walship-clean-shutdown` in
//! the directory ([`LogStore::mark_clean_shutdown`]); an open removes it.
//! `walship-tail-check` holds the sequence number of the newest log file at
//! the previous open: files before it were complete then, and only that file
//! and newer ones can have been written since. An open that finds no clean
//! marker reads and verifies every chunk those files hold (just the newest
//! file when there is no `walship-tail-check` yet) before it returns, and
//! keeps what it found for [`LogStore::startup_damage`]. That is at most a
//! few log files (`target_file_bytes` each) read at start. Older files are
//! the scrubber's. raft-engine's own recovery truncations (torn tails and
//! damage) are classified by [`crate::recovery_log`].

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::Mutex;
use raft_engine::{Command, Config, LogBatch, MessageExt, ReadableSize};
use raft_proto::eraftpb::Entry;

use crate::chunk::{self, Chunk, ChunkMeta, Chunks, MAX_TAIL_CHUNKS};
use crate::record::Frame;
use crate::recovery_log::{CleanEnd, RecoveryFinding};
use crate::segment::Segment;
use crate::store::{
    Counter, Earlier, LogBounds, LogStore, Raise, ShardAppend, ShardId, SnapshotChanges, StartupDamage, StoreError,
    StoreResult, check_compact, check_continues, check_range, check_truncate,
};
use crate::zero_fill::ZeroFilledFs;
use bytes::Bytes;

/// Stripes of the per-shard epoch lock.
const EPOCH_LOCK_STRIPES: usize = 64;
const FIRST_KEY: &[u8] = b"walship/first";
const EPOCH_KEY: &[u8] = b"walship/epoch";
const LOG_EPOCH_KEY: &[u8] = b"walship/log-epoch";
const NEXT_CHUNK_KEY: &[u8] = b"walship/next-chunk";
/// Producer snapshots: this prefix, then the seqno big-endian (so keys sort
/// by seqno).
const PRODUCERS_PREFIX: &[u8] = b"walship/producers/";

fn producers_key(seqno: u64) -> Vec<u8> {
    let mut key = PRODUCERS_PREFIX.to_vec();
    key.extend_from_slice(&seqno.to_be_bytes());
    key
}

/// The first key after every producer snapshot key.
fn producers_end() -> Vec<u8> {
    let mut end = PRODUCERS_PREFIX.to_vec();
    *end.last_mut().expect("non-empty") += 1;
    end
}
/// Present only between a graceful shutdown and the next open.
pub const CLEAN_SHUTDOWN_FILE: &str = "walship-clean-shutdown";
/// The newest log file's sequence number at the previous open.
pub const TAIL_CHECK_FILE: &str = "walship-tail-check";
/// Frame bytes per read while verifying the tail at open.
const CHECK_READ_BYTES: usize = 1 << 20;
/// Regions at and above this hold chunks; below it, shards of the
/// one-entry-per-record layout awaiting conversion (and region 0's sync
/// marker).
const CHUNK_REGION: u64 = 1 << 32;
/// Times a read looks its chunk up again after the chunk was replaced (by
/// a merge or a truncation) between the lookup and the fetch.
const READ_RETRIES: usize = 8;
/// The default [`EngineStoreConfig::chunk_bytes`] (`wal.chunk_bytes`).
pub const DEFAULT_CHUNK_BYTES: u64 = 64 << 10;

/// The raft-engine region holding `shard`'s chunks.
pub fn region(shard: ShardId) -> u64 {
    CHUNK_REGION | u64::from(shard)
}

/// The shard a chunk region holds, if `region` is one.
fn shard_of(region: u64) -> Option<ShardId> {
    (region & CHUNK_REGION != 0).then(|| ShardId::try_from(region & !CHUNK_REGION).ok()).flatten()
}

/// raft-engine's typed-entry adapter for walship chunks.
#[derive(Clone)]
struct ChunkEntry;

impl MessageExt for ChunkEntry {
    type Entry = Entry;

    fn index(e: &Entry) -> u64 {
        e.index
    }
}

type Engine = raft_engine::Engine<ZeroFilledFs>;

#[derive(Debug, Clone)]
struct ShardState {
    bounds: LogBounds,
    chunks: Chunks,
    /// The frames of the unsealed chunks at the end (the tail a merge
    /// rewrites), one slice of each chunk as written, when known (not after
    /// an open, a truncation or a compaction: read from the engine at the
    /// next merge, nor while the store's [`TailFrames`] budget is spent).
    /// Less than `chunk_bytes` in all: a merge writes them without reading
    /// the log back.
    tail: Option<KnownTail>,
}

/// raft-engine-backed multi-shard log.
pub struct EngineStore {
    engine: Engine,
    rotations: Arc<crate::zero_fill::Rotations>,
    /// Where the newest log file's written bytes end (for the clean-shutdown
    /// marker).
    written_end: Arc<crate::zero_fill::WrittenEnd>,
    shards: Mutex<BTreeMap<ShardId, ShardState>>,
    /// Serialises the calls that change chunks (append, truncate, compact):
    /// each plans from the chunk map, writes, then applies its plan.
    write_lock: Mutex<()>,
    /// Serialise epoch read-modify-writes of one shard so its epoch never
    /// moves back; striped by shard, so raises of different shards run at
    /// once and share fsyncs in raft-engine's write group (ten thousand
    /// shards assigned at start-up would otherwise pay one fsync each, one
    /// after the other).
    epoch_locks: Box<[Mutex<()>]>,
    dir: PathBuf,
    chunk_bytes: usize,
    tail_frames: TailFrames,
    /// Shards appended to without a sync since the last synced append:
    /// the ones whose `durable_seqno` a sync raises. (Every shard was
    /// walked on every sync: 10,000 map entries per group commit.)
    unsynced: Mutex<std::collections::BTreeSet<ShardId>>,
    /// What the tail check at open found damaged.
    startup_damage: Vec<StartupDamage>,
    /// What raft-engine's recovery truncated, classified.
    recovery: Vec<RecoveryFinding>,
}

fn io(e: raft_engine::Error) -> StoreError {
    StoreError::Io(e.to_string())
}

fn get_u64(engine: &Engine, region: u64, key: &[u8]) -> Option<u64> {
    engine.get(region, key).and_then(|v| v.as_slice().try_into().ok().map(u64::from_le_bytes))
}

fn put_u64(batch: &mut LogBatch, region: u64, key: &[u8], value: u64) -> StoreResult<()> {
    batch.put(region, key.to_vec(), value.to_le_bytes().to_vec()).map_err(io)
}

/// What a write does to one shard's chunk map, applied once the write
/// returned: the chunks from `write_from` on are replaced by `written`.
struct Plan {
    shard: ShardId,
    write_from: u64,
    written: Vec<ChunkMeta>,
    /// The old tail could not be read back for a merge: seal it.
    seal_old_tail: bool,
    /// The tail's frames after the write, when known.
    tail_after: Option<KnownTail>,
}

impl EngineStore {
    /// What raft-engine's recovery truncated when this store opened.
    pub fn recovery_findings(&self) -> &[RecoveryFinding] {
        &self.recovery
    }

    /// The encoded chunk at `index` of `shard`.
    fn fetch_chunk(&self, shard: ShardId, index: u64) -> Result<bytes::Bytes, raft_engine::Error> {
        match self.engine.get_entry::<ChunkEntry>(region(shard), index)? {
            Some(entry) => Ok(entry.data),
            None => Err(raft_engine::Error::EntryNotFound),
        }
    }

    /// Every frame of the chunks at indexes `[from, to]`, fully verified.
    fn read_chunks_whole(&self, shard: ShardId, from: u64, to: u64) -> StoreResult<Vec<Frame>> {
        let mut frames = Vec::new();
        for index in from..=to {
            let bytes = self.fetch_chunk(shard, index).map_err(io)?;
            let segment = Segment::decode(bytes).map_err(|e| StoreError::Io(format!("chunk {index}: {e}")))?;
            if segment.shard_id() != shard {
                return Err(StoreError::Io(format!("chunk {index} holds records of shard {}", segment.shard_id())));
            }
            if let Some(last) = frames.last().map(Frame::seqno)
                && segment.first_seqno() != last + 1
            {
                return Err(StoreError::Io(format!("chunk {index} starts at {} after {last}", segment.first_seqno())));
            }
            frames.extend(segment.into_frames());
        }
        Ok(frames)
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

    /// The shard's producer snapshots, ascending by seqno.
    fn snapshot_keys(&self, shard: ShardId) -> StoreResult<Vec<(u64, Bytes)>> {
        let mut found = Vec::new();
        let mut bad = None;
        self.engine
            .scan_raw_messages(region(shard), Some(PRODUCERS_PREFIX), Some(&producers_end()), false, |key, value| {
                match key[PRODUCERS_PREFIX.len().min(key.len())..].try_into() {
                    Ok(seqno) => found.push((u64::from_be_bytes(seqno), Bytes::copy_from_slice(value))),
                    Err(_) => bad = Some(key.to_vec()),
                }
                true
            })
            .map_err(io)?;
        if let Some(key) = bad {
            return Err(StoreError::Io(format!("shard {shard}: malformed producer snapshot key {key:?}")));
        }
        Ok(found)
    }

    /// Durably raises a per-shard counter kept under `key` to `value`; a
    /// lower value is ignored.
    fn raise_u64(&self, shard: ShardId, key: &[u8], value: u64) -> StoreResult<()> {
        self.state(shard)?;
        let _guard = self.epoch_locks[shard as usize % EPOCH_LOCK_STRIPES].lock();
        if get_u64(&self.engine, region(shard), key).is_some_and(|current| current >= value) {
            return Ok(());
        }
        let mut batch = LogBatch::default();
        put_u64(&mut batch, region(shard), key, value)?;
        self.write(&mut batch, true)
    }

    fn state(&self, shard: ShardId) -> StoreResult<LogBounds> {
        self.shards.lock().get(&shard).map(|s| s.bounds).ok_or(StoreError::UnknownShard(shard))
    }

    /// Adds `shard`'s new `frames` (validated, contiguous, continuing its
    /// log) to `batch` as chunks, merging the shard's tail into them when
    /// it is due, and returns what to apply once the batch is written.
    fn plan_append(
        &self,
        shard: ShardId,
        frames: &[&Frame],
        batch: &mut LogBatch,
        earlier: &Earlier<'_>,
    ) -> StoreResult<Plan> {
        let ((tail_start, tail_count, tail_bytes), tail_records, next, old_end, known_tail) = {
            let mut shards = self.shards.lock();
            let state = shards.get_mut(&shard).ok_or(StoreError::UnknownShard(shard))?;
            let chunks = &state.chunks;
            (
                chunks.tail(),
                chunks.tail_records(),
                chunks.end_index(),
                chunks.next_index(),
                self.tail_frames.take(state),
            )
        };
        let first_new = frames.first().ok_or(StoreError::EmptyAppend { shard })?.seqno();
        let new_bytes: u64 = frames.iter().map(|f| f.len() as u64).sum();
        let by_count = tail_count >= MAX_TAIL_CHUNKS;
        let merge_due = tail_count > 0 && (tail_bytes + new_bytes >= self.chunk_bytes as u64 || by_count);
        let mut known_tail = known_tail.filter(|t| t.records == tail_records);
        let mut seal_old_tail = false;
        let mut merged = Vec::new();
        if merge_due {
            // The tail's frames: kept here, else held by the caller (checked
            // against the tail's seqnos, count and bytes), else read back.
            let tail_first = first_new - tail_records;
            let tail = match known_tail.take() {
                Some(tail) => Ok(tail.chunks),
                None => earlier(shard, tail_first, first_new - 1)
                    .filter(|held| holds_tail(held, tail_first, tail_records, tail_bytes))
                    .map_or_else(|| self.read_chunks_whole(shard, tail_start, next - 1), Ok)
                    .map(|frames| {
                        frames.into_iter().map(|f| TailChunk { frames: f.into_bytes(), records: 1 }).collect()
                    }),
            };
            match tail {
                Ok(tail) => merged = tail,
                Err(e) => {
                    tracing::warn!(shard, error = %e, "cannot read the unsealed chunks back to merge them; left as they are");
                    seal_old_tail = true;
                }
            }
        }
        let is_merge = !merged.is_empty();
        let (write_from, first) = if is_merge { (tail_start, first_new - tail_records) } else { (next, first_new) };
        let pieces = split(merged, first, frames, self.chunk_bytes);
        let count = pieces.len() as u64;
        // The remainder of new records split into several chunks (a large
        // group commit) is sealed, which the next commit would otherwise
        // rewrite. A merge's remainder stays the tail, one chunk: a merge
        // forced by the count merges it again with the next ones until it is
        // full (see `MAX_TAIL_CHUNKS`).
        let seal_last = !is_merge && count > 1;
        let (written, last) = self.add_chunks(batch, shard, write_from, pieces, seal_last)?;
        let tail_after = match last {
            None => Some(KnownTail::default()),
            // Appended to the old tail (they add up to less than a chunk).
            Some(last) if !is_merge && !seal_old_tail && tail_count > 0 => known_tail.map(|mut tail| {
                tail.push(last);
                tail
            }),
            Some(last) => {
                let mut tail = KnownTail::default();
                tail.push(last);
                Some(tail)
            }
        };
        for index in write_from + count..old_end {
            batch.delete(region(shard), chunk::key(index));
        }
        Ok(Plan { shard, write_from, written, seal_old_tail, tail_after })
    }

    /// Adds `pieces` to `batch` as the chunks at `write_from` and on (each
    /// with its directory key), replacing whatever is there. Every piece
    /// but the last is sealed; the last is sealed when it is full, or when
    /// `seal_last`. Returns the chunks' directory entries, and the frames of
    /// the last one when it is unsealed.
    fn add_chunks(
        &self,
        batch: &mut LogBatch,
        shard: ShardId,
        write_from: u64,
        pieces: Vec<Piece<'_>>,
        seal_last: bool,
    ) -> StoreResult<(Vec<ChunkMeta>, Option<TailChunk>)> {
        let count = pieces.len();
        let mut written = Vec::with_capacity(count);
        let mut entries = Vec::with_capacity(count);
        let mut tail = None;
        for (i, piece) in pieces.into_iter().enumerate() {
            let index = write_from + i as u64;
            let sealed = i + 1 < count || piece.bytes >= self.chunk_bytes || seal_last;
            let data = piece.encode(shard);
            let meta = ChunkMeta {
                chunk: Chunk { first_seqno: piece.first_seqno, bytes: piece.bytes as u32, sealed },
                last_seqno: piece.first_seqno + piece.records - 1,
            };
            batch.put(region(shard), chunk::key(index), meta.encode()).map_err(io)?;
            if !sealed {
                let frames = data.slice(crate::segment::SEGMENT_HEADER_LEN..);
                tail = Some(TailChunk { frames, records: piece.records });
            }
            entries.push(Entry { index, data, ..Entry::default() });
            written.push(meta);
        }
        batch.add_entries::<ChunkEntry>(region(shard), &entries).map_err(io)?;
        Ok((written, tail))
    }

    /// Puts a fresh `state` for `shard` in the map, replacing any older one
    /// (whose known tail leaves the count).
    fn insert_state(&self, shard: ShardId, mut state: ShardState) {
        // Not counted yet: counted once in the map.
        let tail = state.tail.take();
        let mut shards = self.shards.lock();
        if let Some(mut old) = shards.insert(shard, state) {
            self.tail_frames.take(&mut old);
        }
        let state = shards.get_mut(&shard).expect("just inserted");
        self.tail_frames.set(state, tail);
    }

    /// Applies a written plan to the chunk map and the bounds.
    fn apply(&self, state: &mut ShardState, plan: Plan) {
        if plan.seal_old_tail {
            state.chunks.seal_all();
        }
        state.chunks.replace_from(plan.write_from, plan.written);
        self.tail_frames.set(state, plan.tail_after);
        if let Some(last) = state.chunks.last_seqno() {
            state.bounds.last_seqno = last;
        }
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

    /// Registers a new, empty shard whose log starts at `first_seqno`
    /// instead of 1: restoring an archive that starts there (archiving was
    /// turned on after the shard's oldest records were compacted). Durable
    /// on return. Refuses a shard that exists and `first_seqno` 0.
    pub fn create_shard_at(&self, shard: ShardId, first_seqno: u64) -> StoreResult<()> {
        let _writer = self.write_lock.lock();
        if first_seqno == 0 {
            return Err(StoreError::BadPosition { shard, what: "a log starts at seqno 1 or later, not 0".into() });
        }
        if self.shards.lock().contains_key(&shard) {
            return Err(StoreError::BadPosition { shard, what: "the shard exists already".into() });
        }
        let mut batch = LogBatch::default();
        put_u64(&mut batch, region(shard), FIRST_KEY, first_seqno)?;
        self.write(&mut batch, true)?;
        let last = first_seqno - 1;
        let bounds = LogBounds { first_seqno, last_seqno: last, durable_seqno: last };
        self.insert_state(shard, ShardState { bounds, chunks: Chunks::empty(1), tail: Some(KnownTail::default()) });
        Ok(())
    }

    /// Chunks of `shard` (for tests and the status of one shard).
    pub fn chunk_count(&self, shard: ShardId) -> StoreResult<usize> {
        self.shards.lock().get(&shard).map(|s| s.chunks.len()).ok_or(StoreError::UnknownShard(shard))
    }
}

/// Recovers one shard's positions and chunk map from its region.
impl LogStore for EngineStore {
    fn create_shard(&self, shard: ShardId) -> StoreResult<()> {
        self.create_shards(&[shard])
    }

    /// The new shards' first keys in one batch, written with one fsync.
    fn create_shards(&self, shards: &[ShardId]) -> StoreResult<()> {
        let new: std::collections::BTreeSet<ShardId> = {
            let known = self.shards.lock();
            shards.iter().copied().filter(|s| !known.contains_key(s)).collect()
        };
        if new.is_empty() {
            return Ok(());
        }
        let mut batch = LogBatch::default();
        for &shard in &new {
            put_u64(&mut batch, region(shard), FIRST_KEY, 1)?;
        }
        self.write(&mut batch, true)?;
        for shard in new {
            self.insert_state(
                shard,
                ShardState { bounds: LogBounds::EMPTY, chunks: Chunks::empty(1), tail: Some(KnownTail::default()) },
            );
        }
        Ok(())
    }

    fn shards(&self) -> Vec<ShardId> {
        self.shards.lock().keys().copied().collect()
    }

    fn bounds(&self, shard: ShardId) -> StoreResult<LogBounds> {
        self.state(shard)
    }

    fn append_with_snapshots(&self, parts: &[ShardAppend], snapshots: &SnapshotChanges, sync: bool) -> StoreResult<()> {
        self.append_with_earlier(parts, snapshots, sync, &|_, _, _| None)
    }

    fn append_with_earlier(
        &self,
        parts: &[ShardAppend],
        snapshots: &SnapshotChanges,
        sync: bool,
        earlier: &Earlier<'_>,
    ) -> StoreResult<()> {
        let _writer = self.write_lock.lock();
        // Validate everything first (all or nothing), then build one batch.
        let mut per_shard: BTreeMap<ShardId, Vec<&Frame>> = BTreeMap::new();
        {
            let shards = self.shards.lock();
            for part in parts {
                let state = shards.get(&part.shard).ok_or(StoreError::UnknownShard(part.shard))?;
                let frames = per_shard.entry(part.shard).or_default();
                let expected = frames.last().map_or(state.bounds.last_seqno + 1, |f| f.seqno() + 1);
                check_continues(part.shard, expected, &part.frames)?;
                frames.extend(part.frames.iter());
            }
        }
        let mut batch = LogBatch::default();
        let mut plans = Vec::with_capacity(per_shard.len());
        for (shard, frames) in per_shard {
            plans.push(self.plan_append(shard, &frames, &mut batch, earlier)?);
        }
        for (shard, seqno) in &snapshots.drop {
            batch.delete(region(*shard), producers_key(*seqno));
        }
        for (shard, seqno, bytes) in &snapshots.put {
            batch.put(region(*shard), producers_key(*seqno), bytes.to_vec()).map_err(io)?;
        }
        if sync && batch.is_empty() {
            batch = Self::sync_marker();
        }
        self.write(&mut batch, sync)?;
        let mut shards = self.shards.lock();
        let mut unsynced = self.unsynced.lock();
        let synced = if sync { std::mem::take(&mut *unsynced) } else { Default::default() };
        for plan in plans {
            let shard = plan.shard;
            let state = shards.get_mut(&shard).expect("validated");
            self.apply(state, plan);
            if sync {
                state.bounds.durable_seqno = state.bounds.last_seqno;
            } else {
                unsynced.insert(shard);
            }
        }
        // A sync makes what earlier unsynced appends wrote durable too.
        for shard in synced {
            if let Some(state) = shards.get_mut(&shard) {
                state.bounds.durable_seqno = state.bounds.last_seqno;
            }
        }
        Ok(())
    }

    fn producer_snapshots(&self, shard: ShardId) -> StoreResult<Vec<(u64, Bytes)>> {
        self.state(shard)?;
        self.snapshot_keys(shard)
    }

    fn read(&self, shard: ShardId, from: u64, to: u64, max_bytes: usize) -> StoreResult<Vec<Frame>> {
        self.read_chunks(shard, from, to, max_bytes)
    }

    fn truncate_suffix(&self, shard: ShardId, keep_through: u64) -> StoreResult<()> {
        self.cut_suffix(shard, keep_through)
    }

    fn compact_prefix(&self, shard: ShardId, first_kept: u64) -> StoreResult<()> {
        self.cut_prefix(shard, first_kept)
    }

    fn set_epoch(&self, shard: ShardId, epoch: u64) -> StoreResult<()> {
        self.raise_u64(shard, EPOCH_KEY, epoch)
    }

    fn epoch(&self, shard: ShardId) -> StoreResult<u64> {
        self.state(shard)?;
        Ok(get_u64(&self.engine, region(shard), EPOCH_KEY).unwrap_or(0))
    }

    fn locate(&self, shard: ShardId, seqno: u64) -> Option<PathBuf> {
        let index = self.shards.lock().get(&shard)?.chunks.find(seqno)?;
        let mut files = log_files(&self.dir, ".raftlog");
        files.reverse();
        let mut rewrites = log_files(&self.dir, ".rewrite");
        rewrites.reverse();
        files.extend(rewrites);
        files.into_iter().map(|f| f.1).find(|path| file_names_entry(path, region(shard), index))
    }

    fn location(&self) -> Option<PathBuf> {
        Some(self.dir.clone())
    }

    fn startup_damage(&self) -> Vec<StartupDamage> {
        self.startup_damage.clone()
    }

    fn recovery_cuts(&self) -> Vec<(PathBuf, u64, String)> {
        self.recovery
            .iter()
            .filter_map(|f| match f {
                RecoveryFinding::Corruption { file, offset, detail } => Some((file.clone(), *offset, detail.clone())),
                RecoveryFinding::TornTail { .. }
                | RecoveryFinding::CleanEnd { .. }
                | RecoveryFinding::Unopenable { .. } => None,
            })
            .collect()
    }

    fn set_log_epoch(&self, shard: ShardId, epoch: u64) -> StoreResult<()> {
        self.raise_u64(shard, LOG_EPOCH_KEY, epoch)
    }

    fn raise_many(&self, raises: &[Raise]) -> Vec<StoreResult<()>> {
        let mut outcomes: Vec<StoreResult<()>> = raises.iter().map(|r| self.state(r.shard).map(|_| ())).collect();
        let hosted = || raises.iter().zip(&outcomes).filter(|(_, o)| o.is_ok()).map(|(r, _)| r);
        // The stripes of every shard raised, each taken once and in order
        // (no deadlock with another batch): no single raise of these shards
        // can come between the check against the stored value and the write.
        let stripes: std::collections::BTreeSet<usize> =
            hosted().map(|r| r.shard as usize % EPOCH_LOCK_STRIPES).collect();
        let _guards: Vec<_> = stripes.into_iter().map(|i| self.epoch_locks[i].lock()).collect();
        let mut highest: BTreeMap<(ShardId, Counter), u64> = BTreeMap::new();
        for r in hosted() {
            let value = highest.entry((r.shard, r.counter)).or_default();
            *value = (*value).max(r.value);
        }
        let mut batch = LogBatch::default();
        let mut written = Ok(());
        for ((shard, counter), value) in highest {
            let key = match counter {
                Counter::Epoch => EPOCH_KEY,
                Counter::LogEpoch => LOG_EPOCH_KEY,
            };
            if get_u64(&self.engine, region(shard), key).is_some_and(|current| current >= value) {
                continue;
            }
            if let Err(e) = put_u64(&mut batch, region(shard), key, value) {
                written = Err(e);
                break;
            }
        }
        if written.is_ok() && !batch.is_empty() {
            written = self.write(&mut batch, true);
        }
        if let Err(e) = written {
            let message = match e {
                StoreError::Io(message) => message,
                other => other.to_string(),
            };
            for outcome in outcomes.iter_mut().filter(|o| o.is_ok()) {
                *outcome = Err(StoreError::Io(message.clone()));
            }
        }
        outcomes
    }

    fn log_epoch(&self, shard: ShardId) -> StoreResult<u64> {
        self.state(shard)?;
        Ok(get_u64(&self.engine, region(shard), LOG_EPOCH_KEY).unwrap_or(0))
    }

    /// Records the end of the newest log file with the marker: the next
    /// open tells recovery's cut there (of the space behind it) from damage
    /// (`crate::recovery_log`).
    fn mark_clean_shutdown(&self) -> StoreResult<()> {
        self.engine.sync().map_err(io)?;
        let end = self
            .written_end
            .get()
            .and_then(|(file, end)| Some(CleanEnd { file: file.file_name()?.to_str()?.to_owned(), end }));
        write_durably(&self.dir, CLEAN_SHUTDOWN_FILE, CleanEnd::marker(end.as_ref()).as_bytes())
            .map_err(|e| StoreError::Io(format!("writing the clean-shutdown marker: {e}")))
    }

    fn index_bytes(&self) -> u64 {
        self.shards.lock().values().map(|s| s.chunks.index_bytes()).sum()
    }

    fn index_chunks(&self) -> u64 {
        self.shards.lock().values().map(|s| s.chunks.len() as u64).sum()
    }
}

#[cfg(test)]
#[path = "engine_store_test.rs"]
mod tests;

#[path = "engine_store_legacy.rs"]
mod legacy;

#[path = "engine_store_damage.rs"]
mod damage;

#[path = "engine_store_tail.rs"]
mod tail;

#[path = "engine_store_open.rs"]
mod open;

#[path = "engine_store_read.rs"]
mod read;

#[path = "engine_store_cut.rs"]
mod cut;
use damage::{entries_in_file, file_names_entry, log_files};
use open::write_durably;
pub use open::{DEFAULT_SPARE_BYTES, EngineStoreConfig};
use tail::{KnownTail, Piece, TailChunk, TailFrames, holds_tail, split};

#[cfg(test)]
#[path = "engine_store_chunks_test.rs"]
mod chunks_tests;
