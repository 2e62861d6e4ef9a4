//! The storage seam: a multi-shard, append-only log of [`Frame`]s with
//! explicit positions.
//!
//! Every implementation keeps, per shard:
//! * `first_seqno`: the oldest record still retained (compaction moves it up);
//! * `last_seqno`: the newest record written;
//! * `durable_seqno`: the newest record fsynced, `durable_seqno <= last_seqno`.
//!
//! An empty log has `last_seqno == first_seqno - 1`. Appends must continue a
//! shard's log exactly (`first == last_seqno + 1`, contiguous): gaps and
//! overwrites are refused and leave the store unchanged. The only way to
//! replace records is [`LogStore::truncate_suffix`] followed by an append.
//! Positions survive restarts, including a fully compacted shard's.
//!
//! Mutating calls are made by one writer at a time (the group-commit thread);
//! reads may run concurrently with them. Calls block: never make them on a
//! tokio worker thread.
//!
//! Damage is reported, never hidden: a read that meets a record whose bytes
//! fail a checksum (the store's own, or the [`Frame`]'s crc32) fails with
//! [`StoreError::Corrupt`] naming the shard, the seqnos that cannot be read
//! and, when the store can tell, the file holding them. A corrupt record is
//! not fatal: the rest of the log stays readable and writable, and the
//! replication layer repairs the range from an intact replica (truncating it
//! away and appending the replica's copy). Only failed writes and fsyncs
//! ([`StoreError::Io`]) are fatal.
//!
//! Implementations: [`crate::EngineStore`] (raft-engine, production) and
//! [`crate::MemStore`] (in-memory test double). Both pass the conformance
//! suite in `conformance.rs`.

use bytes::Bytes;
use std::path::{Path, PathBuf};

use crate::record::Frame;

/// A shard's id. In raft-engine it is the region id.
pub type ShardId = u32;

/// Positions of one shard's log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogBounds {
    pub first_seqno: u64,
    pub last_seqno: u64,
    pub durable_seqno: u64,
}

impl LogBounds {
    /// The bounds of a shard that has never held a record.
    pub const EMPTY: LogBounds = LogBounds { first_seqno: 1, last_seqno: 0, durable_seqno: 0 };

    pub fn is_empty(&self) -> bool {
        self.last_seqno < self.first_seqno
    }
}

/// Frames to append to one shard; `frames` must be non-empty and contiguous.
#[derive(Debug, Clone)]
pub struct ShardAppend {
    pub shard: ShardId,
    pub frames: Vec<Frame>,
}

/// Where an append may find a shard's recent frames in memory (see
/// [`LogStore::append_with_earlier`]): `(shard, from, to)` to the frames
/// `[from, to]`, or `None` when not all of them are held.
pub type Earlier<'a> = dyn Fn(ShardId, u64, u64) -> Option<Vec<Frame>> + 'a;

/// Producer snapshots to store and drop with an append (see
/// [`LogStore::append_with_snapshots`]).
#[derive(Debug, Clone, Default)]
pub struct SnapshotChanges {
    /// `(shard, seqno, bytes)`: the snapshot after record `seqno`. A shard's
    /// snapshot seqno must be among the records written (or already held).
    pub put: Vec<(ShardId, u64, Bytes)>,
    /// `(shard, seqno)` of snapshots to forget.
    pub drop: Vec<(ShardId, u64)>,
}

impl SnapshotChanges {
    pub fn is_empty(&self) -> bool {
        self.put.is_empty() && self.drop.is_empty()
    }
}

/// A per-shard counter that only moves up (see [`LogStore::raise_many`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Counter {
    /// The newest epoch promised to ([`LogStore::set_epoch`]).
    Epoch,
    /// The log epoch ([`LogStore::set_log_epoch`]).
    LogEpoch,
}

/// One raise of a [`Counter`] to `value` in [`LogStore::raise_many`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Raise {
    pub shard: ShardId,
    pub counter: Counter,
    pub value: u64,
}

/// Why a store call was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("shard {0} is not hosted here")]
    UnknownShard(ShardId),
    #[error("shard {shard}: append starting at seqno {found} does not continue the log (next is {expected})")]
    NotContinuous { shard: ShardId, expected: u64, found: u64 },
    #[error("shard {shard}: frames are not contiguous at seqno {found} (expected {expected})")]
    NotContiguous { shard: ShardId, expected: u64, found: u64 },
    #[error("shard {shard}: an append must carry at least one record")]
    EmptyAppend { shard: ShardId },
    #[error("shard {shard}: range [{from}, {to}] is outside the retained log [{first}, {last}]")]
    OutOfRange { shard: ShardId, from: u64, to: u64, first: u64, last: u64 },
    #[error("shard {shard}: {what}")]
    BadPosition { shard: ShardId, what: String },
    /// Stored records `[first_seqno, last_seqno]` fail a checksum (the
    /// store's or the frame's crc32): they cannot be read, only replaced.
    /// `file` is the store file holding them, when the store can tell.
    #[error("shard {shard}: corruption: stored records [{first_seqno}, {last_seqno}] are unreadable ({}): {detail}", file_label(.file.as_deref()))]
    Corrupt { shard: ShardId, first_seqno: u64, last_seqno: u64, file: Option<PathBuf>, detail: String },
    #[error("storage failure: {0}")]
    Io(String),
}

fn file_label(file: Option<&Path>) -> String {
    match file {
        Some(file) => format!("file {}", file.display()),
        None => "file unknown".to_owned(),
    }
}

impl StoreError {
    /// A fatal error leaves the WAL's durability unknown: the process must
    /// stop rather than continue on it. Only a failed storage operation is
    /// fatal; a corrupt record found by a read is not (the rest of the log
    /// is intact and the range can be repaired from a replica).
    pub fn is_fatal(&self) -> bool {
        matches!(self, StoreError::Io(_))
    }

    /// `(shard, first_seqno, last_seqno)` of the corrupt records, if that is
    /// the error.
    pub fn corrupt_range(&self) -> Option<(ShardId, u64, u64)> {
        match self {
            StoreError::Corrupt { shard, first_seqno, last_seqno, .. } => Some((*shard, *first_seqno, *last_seqno)),
            _ => None,
        }
    }
}

/// Records a store found damaged while it opened (see
/// [`LogStore::startup_damage`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartupDamage {
    pub shard: ShardId,
    pub first_seqno: u64,
    pub last_seqno: u64,
    pub file: Option<PathBuf>,
    pub detail: String,
}

pub type StoreResult<T> = Result<T, StoreError>;

/// A multi-shard log store. See the module docs for the contract.
pub trait LogStore: Send + Sync + 'static {
    /// Registers a shard (idempotent, durable on return).
    fn create_shard(&self, shard: ShardId) -> StoreResult<()>;

    /// Registers every shard of `shards` not registered yet (idempotent,
    /// durable on return). A store that can makes them durable together:
    /// one by one, a node hosting 10,000 new shards started with 10,000
    /// fsyncs (about 2 s of its start).
    fn create_shards(&self, shards: &[ShardId]) -> StoreResult<()> {
        shards.iter().try_for_each(|&shard| self.create_shard(shard))
    }

    /// Every shard registered, in ascending order.
    fn shards(&self) -> Vec<ShardId>;

    fn bounds(&self, shard: ShardId) -> StoreResult<LogBounds>;

    /// Appends to one or more shards as one atomic write: every part is
    /// validated before anything is written, and either all parts are written
    /// or none. With `sync`, everything written so far (on every shard) is
    /// durable on return.
    fn append(&self, batch: &[ShardAppend], sync: bool) -> StoreResult<()> {
        self.append_with_snapshots(batch, &SnapshotChanges::default(), sync)
    }

    /// [`LogStore::append`], and in the same atomic write, the producer
    /// snapshot changes (`crate::producers`): every put and drop of
    /// `snapshots` lands with the frames or none does.
    fn append_with_snapshots(&self, batch: &[ShardAppend], snapshots: &SnapshotChanges, sync: bool) -> StoreResult<()>;

    /// [`LogStore::append_with_snapshots`], told where recent records may
    /// be found in memory: `earlier(shard, from, to)` gives the frames
    /// `[from, to]` of `shard`'s log when its caller holds them all (the
    /// WAL's tail cache), for a store that rewrites a shard's newest
    /// records with an append (the engine store's merge of a shard's
    /// unsealed tail) instead of reading them back. The store checks what
    /// it gets against what it knows of those records (seqnos, count,
    /// bytes) and reads them back when they do not match.
    fn append_with_earlier(
        &self,
        batch: &[ShardAppend],
        snapshots: &SnapshotChanges,
        sync: bool,
        earlier: &Earlier<'_>,
    ) -> StoreResult<()> {
        let _ = earlier;
        self.append_with_snapshots(batch, snapshots, sync)
    }

    /// The shard's producer snapshots kept beside its log, as
    /// `(seqno, bytes)` ascending by seqno: each is the producer table after
    /// the record at `seqno`. [`LogStore::truncate_suffix`] drops the ones
    /// past what it keeps and [`LogStore::compact_prefix`] the ones before
    /// `first_kept - 1`, in the same atomic write.
    fn producer_snapshots(&self, shard: ShardId) -> StoreResult<Vec<(u64, Bytes)>>;

    /// Frames `[from, to]` (inclusive, within the retained, written log),
    /// stopping before the total size passes `max_bytes` but always returning
    /// at least one frame. Every frame's checksum is verified.
    fn read(&self, shard: ShardId, from: u64, to: u64, max_bytes: usize) -> StoreResult<Vec<Frame>>;

    /// Removes every record after `keep_through` (divergence repair), and
    /// every producer snapshot past it.
    /// `first_seqno - 1 <= keep_through`; a `keep_through >= last_seqno` is a
    /// no-op for the records. Durable on return.
    fn truncate_suffix(&self, shard: ShardId, keep_through: u64) -> StoreResult<()>;

    /// Discards records before `first_kept` (retention), and every producer
    /// snapshot before `first_kept - 1`. Only durable records may be
    /// discarded: `first_kept <= durable_seqno + 1`. Durable on return.
    fn compact_prefix(&self, shard: ShardId, first_kept: u64) -> StoreResult<()>;

    /// Records the newest epoch this replica has promised to (it refuses
    /// older ones from then on). Never moves backwards: a lower value is
    /// ignored. Durable on return.
    fn set_epoch(&self, shard: ShardId, epoch: u64) -> StoreResult<()>;

    /// The epoch last recorded with [`LogStore::set_epoch`] (0 if none).
    fn epoch(&self, shard: ShardId) -> StoreResult<u64>;

    /// Records the shard's *log epoch*: the newest epoch whose leader's log
    /// this replica's log is known to be a prefix of (the replication layer
    /// sets it when it starts leading, or once a follower has reconciled
    /// its log with a leader). Never moves backwards: a lower value is
    /// ignored. Durable on return.
    fn set_log_epoch(&self, shard: ShardId, epoch: u64) -> StoreResult<()>;

    /// The log epoch last recorded with [`LogStore::set_log_epoch`] (0 if
    /// none).
    fn log_epoch(&self, shard: ShardId) -> StoreResult<u64>;

    /// Raises several shards' epochs and log epochs with one durable write
    /// (one fsync for all): each raise as [`LogStore::set_epoch`] or
    /// [`LogStore::set_log_epoch`] would do it (a lower value is ignored).
    /// Returns one outcome per raise, in order: a raise naming a shard not
    /// hosted here fails alone with [`StoreError::UnknownShard`]; a failed
    /// write fails every other raise (fatal, as for the single calls).
    /// Every raise that succeeded is durable on return.
    fn raise_many(&self, raises: &[Raise]) -> Vec<StoreResult<()>> {
        raises
            .iter()
            .map(|r| match r.counter {
                Counter::Epoch => self.set_epoch(r.shard, r.value),
                Counter::LogEpoch => self.set_log_epoch(r.shard, r.value),
            })
            .collect()
    }

    /// The file holding the record at `seqno`, for reports of damage; `None`
    /// when the store keeps no files or cannot tell. May read the store's
    /// metadata: call it only once damage is found.
    fn locate(&self, _shard: ShardId, _seqno: u64) -> Option<PathBuf> {
        None
    }

    /// Where the store keeps its files, reported when [`LogStore::locate`]
    /// cannot name the file.
    fn location(&self) -> Option<PathBuf> {
        None
    }

    /// The damage the store found while it opened, when its last shutdown
    /// was not clean and it verified the tail written since its previous
    /// check (each implementation defines that tail). Empty after a clean
    /// shutdown.
    fn startup_damage(&self) -> Vec<StartupDamage> {
        Vec::new()
    }

    /// Damage the store's own recovery cut away while it opened, with the
    /// records after it (a file and offset, and what was there), beyond a
    /// torn tail: records that had been durable are gone from this node,
    /// and with them maybe the newest epoch it promised. Empty by default.
    fn recovery_cuts(&self) -> Vec<(PathBuf, u64, String)> {
        Vec::new()
    }

    /// Bytes of memory the store's index of the log takes (every shard),
    /// an estimate from its structures' sizes. Grows with what the store
    /// keeps an index entry for (a chunk of records in the raft-engine
    /// store), not with the records themselves.
    fn index_bytes(&self) -> u64 {
        0
    }

    /// Entries the store's index holds (every shard): chunks in the
    /// raft-engine store.
    fn index_chunks(&self) -> u64 {
        0
    }

    /// Records a graceful shutdown, so the next open skips the tail check.
    /// Nothing may be written after it. Durable on return.
    fn mark_clean_shutdown(&self) -> StoreResult<()> {
        Ok(())
    }
}

/// Checks that `frames` may be appended to a shard whose next seqno is `next`.
pub(crate) fn check_continues(shard: ShardId, next: u64, frames: &[Frame]) -> StoreResult<()> {
    let first = frames.first().ok_or(StoreError::EmptyAppend { shard })?.seqno();
    if first != next {
        return Err(StoreError::NotContinuous { shard, expected: next, found: first });
    }
    for (i, frame) in frames.iter().enumerate() {
        let expected = first + i as u64;
        if frame.seqno() != expected {
            return Err(StoreError::NotContiguous { shard, expected, found: frame.seqno() });
        }
    }
    Ok(())
}

/// Checks a read range against a shard's bounds.
pub(crate) fn check_range(shard: ShardId, bounds: LogBounds, from: u64, to: u64) -> StoreResult<()> {
    if from > to || from < bounds.first_seqno || to > bounds.last_seqno {
        return Err(StoreError::OutOfRange { shard, from, to, first: bounds.first_seqno, last: bounds.last_seqno });
    }
    Ok(())
}

/// Checks a truncation point against a shard's bounds.
pub(crate) fn check_truncate(shard: ShardId, bounds: LogBounds, keep_through: u64) -> StoreResult<()> {
    if keep_through + 1 < bounds.first_seqno {
        return Err(StoreError::BadPosition {
            shard,
            what: format!("cannot truncate to {keep_through}: records before {} are compacted", bounds.first_seqno),
        });
    }
    Ok(())
}

/// Checks a compaction point against a shard's bounds.
pub(crate) fn check_compact(shard: ShardId, bounds: LogBounds, first_kept: u64) -> StoreResult<()> {
    if first_kept > bounds.durable_seqno + 1 {
        return Err(StoreError::BadPosition {
            shard,
            what: format!("cannot compact to {first_kept}: only records through {} are durable", bounds.durable_seqno),
        });
    }
    Ok(())
}
