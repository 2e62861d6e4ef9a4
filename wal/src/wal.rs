//! The node's WAL: every shard's log in one [`LogStore`], written in two
//! steps.
//!
//! Appenders (async, on any tokio task, for any shard) *sequence* their own
//! appends under the WAL's sequencer lock: validate, assign seqnos, encode
//! each record once into a [`Frame`], publish the frames as *written* (the
//! shard's tail cache, then its `written` watch, so a leader can ship them at
//! once) and stage them for the *persister* thread. No thread hand-off stands
//! between an append and its shipping. The persister gathers everything
//! staged while its previous commit ran, writes it with one fsync, publishes
//! the new durable positions and wakes every waiter. Blocking storage calls
//! happen only on the persister (and on `spawn_blocking` for reads,
//! truncations and compactions).
//!
//! Invariants kept here:
//! * seqnos are assigned under the one sequencer lock, so each shard's log
//!   is contiguous; the store refuses anything else;
//! * an append is acknowledged only after the fsync that covers it, and the
//!   durable watch never runs ahead of what is fsynced;
//! * `durable <= flushing <= written` at every instant (flushing: what the
//!   persister has handed to the store): the written watch moves first.
//!   Written records may not be in the store yet: a process crash can lose
//!   them, and a leader that ships them relies on the rule that it never
//!   leads again in an epoch it led before it restarted
//!   (`shipping/EARLY-SHIPPING.md`);
//! * every written record is readable: the tail cache never evicts a frame
//!   the store does not hold yet, and appenders wait while more than
//!   `max_batch_bytes` are staged;
//! * a storage failure (a failed or refused write or fsync) stops the
//!   process: the WAL never continues with unknown durability;
//! * a corrupt record is not a storage failure: a read that meets one fails
//!   with [`StoreError::Corrupt`] (shard, seqnos, file; see
//!   [`WalError::corrupt_range`]) and the process goes on. Every corrupt
//!   read, scrub finding and start-up finding is recorded in the WAL's
//!   corruption registry ([`Wal::corruption`], `crate::corruption`), which
//!   forgets a range only when it is truncated or compacted away;
//! * a background scrubber reads every shard's durable log at a bounded rate
//!   (`WalConfig::scrub_bytes_per_s`), off the tokio workers.
//!
//! A storage failure is a failed or refused write or fsync, an IO error on a
//! read ([`StoreError::is_fatal`]), or a panic in any storage call:
//! raft-engine panics when an fsync fails (`engine_store.rs`), in whichever
//! thread leads its write group (the persister, or the blocking task of a
//! truncation, compaction or epoch change). A panic would unwind that thread
//! alone: a dead persister leaves appends failing forever while the node
//! still heartbeats as leader, and no failover happens. So every storage
//! call runs under [`fatal_on_panic`], and [`fatal`] logs what failed at
//! ERROR and aborts the process; the coordinator then fails its shards over,
//! and a supervisor (systemd, Kubernetes) restarts it on whatever the disk
//! kept. The persister's whole loop runs under it too: a panic there, for
//! whatever reason, must never leave the process running without one.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use parking_lot::RwLock;
use tokio::sync::oneshot;

use crate::position as watch;

use crate::corruption::{CorruptRange, Detection, Registry, ScrubReport};
use crate::disk_space::{DiskFull, DiskSpace};
use crate::metrics::{ShardGauges, WalMetrics};
use crate::producers::{Decision, ProducerLimits, ProducerRefusal, ProducerTable};
use crate::raises::Raises;
use crate::record::{Frame, ProducerStamp, RecordFields};
use crate::store::{Counter, LogBounds, LogStore, Raise, ShardId, SnapshotChanges, StoreError};
use crate::tail_cache::{TailBudget, TailCache};

/// A record as a client submits it; the WAL assigns seqno, epoch and time.
#[derive(Debug, Clone, Default)]
pub struct NewRecord {
    pub key: Bytes,
    pub payload: Bytes,
}

/// The seqnos an append was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Appended {
    pub first_seqno: u64,
    pub last_seqno: u64,
}

/// What an append is conditioned on (see [`Wal::append_with`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AppendOptions {
    /// Written as this producer session: `sequence` is the first record's
    /// sequence, the others follow (see `crate::producers`).
    pub producer: Option<ProducerStamp>,
    /// Written only if the shard's newest seqno is exactly this.
    pub expected_last: Option<u64>,
    /// The caller is answered only after more than this replica's commit
    /// (a `QUORUM` or `ALL` append waiting for followers): the persister
    /// does not linger for such appenders ([`WalConfig::linger`]), since
    /// the commit that covers them does not send them back.
    pub answered_later: bool,
}

/// What [`Wal::append_with`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AppendOutcome {
    pub appended: Appended,
    /// Every record had been written before by the same producer; nothing
    /// was written, `appended` holds the original seqnos (durable here).
    pub duplicate: bool,
}

/// A shard's producer table and its snapshots (see `crate::producers`).
struct ProducerState {
    table: ProducerTable,
    /// Seqnos of the snapshots the store holds, ascending.
    snapshots: Vec<u64>,
    /// Frame bytes applied since the newest snapshot.
    since_snapshot: u64,
    /// Why the table is not complete, if it is not (a corrupt record met
    /// while rebuilding it): producer appends are refused until a
    /// truncation rebuilds it.
    damaged: Option<String>,
    /// Appends answered as duplicates here since the process started.
    duplicates: u64,
}

/// The default [`WalConfig::producer_snapshot_bytes`].
pub const DEFAULT_PRODUCER_SNAPSHOT_BYTES: u64 = 16 << 20;
/// Producer snapshots kept per shard; past it the second oldest goes (the
/// oldest is where the table starts from after compaction).
pub const PRODUCER_SNAPSHOTS_KEPT: usize = 16;

impl ProducerState {
    fn empty(at: u64) -> ProducerState {
        ProducerState {
            table: ProducerTable::empty_at(at),
            snapshots: Vec::new(),
            since_snapshot: 0,
            damaged: None,
            duplicates: 0,
        }
    }
}

/// Producer-session figures of one shard (for status pages and metrics).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProducerStats {
    /// Producers remembered and alive now.
    pub producers: usize,
    /// Snapshots of the table kept beside the log.
    pub snapshots: usize,
    /// Why producer appends are refused, if they are.
    pub damaged: Option<String>,
    /// Appends this replica answered as duplicates since it started.
    pub duplicates: u64,
    /// Producers forgotten since the table was last rebuilt (at start or
    /// by a truncation): expired, then evicted.
    pub expired: u64,
    pub evicted: u64,
}

/// A shard replica's positions in this node's WAL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Positions {
    /// Oldest retained seqno.
    pub first_seqno: u64,
    /// Newest seqno written (possibly not yet fsynced).
    pub last_seqno: u64,
    /// Newest seqno fsynced; `durable_seqno <= last_seqno`.
    pub durable_seqno: u64,
}

/// Work a shard's WAL has done since this process started: the basis of
/// byte-lag and throughput figures (differences of two readings).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ShardCounters {
    /// Records made durable.
    pub records: u64,
    /// Encoded frame bytes made durable.
    pub bytes: u64,
}

/// Errors of the WAL's API.
#[derive(Debug, thiserror::Error)]
pub enum WalError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the WAL writer has stopped")]
    Closed,
    #[error("shard {shard}: epoch {epoch} is older than epoch {promised} this replica has promised to")]
    StaleEpoch { shard: ShardId, epoch: u64, promised: u64 },
    /// Refused before anything was sequenced: the disk is below its reserve.
    #[error(transparent)]
    DiskFull(#[from] DiskFull),
    /// A producer append refused by the producer rules; nothing written.
    #[error("shard {shard}: {refusal}")]
    Producer { shard: ShardId, refusal: ProducerRefusal },
    /// A conditional append whose expected last seqno is not the shard's.
    #[error("shard {shard}: the newest seqno is {last}, not the expected {expected}; nothing was written")]
    ExpectedLast { shard: ShardId, expected: u64, last: u64 },
    /// The shard's producer table is incomplete here (a corrupt record met
    /// while rebuilding it); producer appends wait for its repair.
    #[error("shard {shard}: producer sessions are unavailable on this replica until its log is repaired: {why}")]
    ProducersUnavailable { shard: ShardId, why: String },
}

impl WalError {
    /// The shard this node does not host, if that is the error.
    pub fn unknown_shard(&self) -> Option<ShardId> {
        match self {
            WalError::Store(StoreError::UnknownShard(shard)) => Some(*shard),
            _ => None,
        }
    }

    /// `(shard, first_seqno, last_seqno)` of stored records that cannot be
    /// read because they are corrupt, if that is the error (gRPC: DATA_LOSS;
    /// the range is repaired from a replica). Not fatal.
    pub fn corrupt_range(&self) -> Option<(ShardId, u64, u64)> {
        match self {
            WalError::Store(e) => e.corrupt_range(),
            _ => None,
        }
    }
}

pub type WalResult<T> = Result<T, WalError>;

/// Group-commit tuning.
#[derive(Debug, Clone)]
pub struct WalConfig {
    /// Stop gathering staged appends into one commit past this many bytes;
    /// appenders also wait while more than this is staged and not yet
    /// durable.
    pub max_batch_bytes: usize,
    /// How long the persister may wait for the appenders it just woke to
    /// append again before it commits a smaller batch. It waits only while
    /// fewer such appends are staged than the previous commit carried, so a
    /// lone appender never waits. A leader's appends with
    /// [`AppendOptions::answered_later`] do not count: their callers wait
    /// for followers after the commit, so it does not send them back. A
    /// follower's replicated frames do: its leader keeps shipping while it
    /// commits, and a follower that gathers more of them per fsync keeps a
    /// disk-bound load at the disk's pace (`ops/bench/RESULTS.md`, "The
    /// WAL lingers only for appenders its commit answers").
    pub linger: Duration,
    /// Bytes of each shard's newest written frames kept in memory at most,
    /// so the readers at the head of the log (shippers, tails, short
    /// catch-ups) never go back to the storage engine.
    pub tail_cache_bytes: usize,
    /// Bytes of newest frames the node keeps in memory for all its shards
    /// together: a shard is cut back to its share of this (over the shards
    /// hosted) once the others use the rest. See `crate::tail_cache`.
    pub tail_cache_total_bytes: usize,
    /// Fault injection for tests only (`None` in production): once this many
    /// leader-path records (appends, not replicated frames) have been
    /// sequenced, the next leader append is published as
    /// written *without* being written, and after [`UNWRITTEN_FAULT_GRACE`]
    /// (time for a leader to ship it) the process aborts. This is the
    /// machine crash that loses a shipped, never-fsynced batch, which a
    /// SIGKILL cannot produce (the page cache survives it).
    pub fault_unwritten_batch_after: Option<u64>,
    /// Read rate of the background scrubber, in record bytes per second; 0
    /// disables it ([`Wal::scrub_now`] still works). See
    /// `crate::corruption` for the default: 8 MiB/s reads 675 GiB a day.
    pub scrub_bytes_per_s: u64,
    /// Time from the start of one background scrub pass to the next.
    pub scrub_interval: Duration,
    /// The free-space reserve appends are checked against (`None`: never
    /// refused for space). See [`crate::disk_space`].
    pub disk_space: Option<Arc<DiskSpace>>,
    /// How many producers each shard remembers, and for how long.
    pub producers: ProducerLimits,
    /// Frame bytes between a shard's producer snapshots (see
    /// [`Wal::compact_prefix`]): a restart replays at most about this much
    /// of a shard's log to rebuild its producer table.
    pub producer_snapshot_bytes: u64,
}

/// Default [`WalConfig::scrub_bytes_per_s`] (`wal.scrub_bytes_per_s`).
pub const DEFAULT_SCRUB_BYTES_PER_S: u64 = 8 << 20;
/// Default [`WalConfig::scrub_interval`] (`wal.scrub_interval_s`).
pub const DEFAULT_SCRUB_INTERVAL: Duration = Duration::from_secs(24 * 3600);

/// Default [`WalConfig::tail_cache_total_bytes`]: at 1,000 written shards
/// 64 KiB each (hundreds of small records, more than shipping at the head
/// of a shard's log needs), one shard alone up to its 8 MiB.
pub const DEFAULT_TAIL_CACHE_TOTAL_BYTES: usize = 64 << 20;

/// How long an injected unwritten batch stays visible before the abort.
pub const UNWRITTEN_FAULT_GRACE: Duration = Duration::from_millis(300);

impl Default for WalConfig {
    fn default() -> Self {
        WalConfig {
            max_batch_bytes: 8 << 20,
            linger: Duration::from_micros(200),
            tail_cache_bytes: 8 << 20,
            tail_cache_total_bytes: DEFAULT_TAIL_CACHE_TOTAL_BYTES,
            fault_unwritten_batch_after: None,
            scrub_bytes_per_s: DEFAULT_SCRUB_BYTES_PER_S,
            scrub_interval: DEFAULT_SCRUB_INTERVAL,
            disk_space: None,
            producers: ProducerLimits::default(),
            producer_snapshot_bytes: DEFAULT_PRODUCER_SNAPSHOT_BYTES,
        }
    }
}

mod fatal;
mod maintenance;
mod persister;
mod positions;
mod producers_rebuild;
mod read;
mod sequencer;
mod staged;

pub(crate) use fatal::fatal_on_panic;
use fatal::{fatal, fatal_if};
use maintenance::scrubber;
use positions::ShardPositions;
use producers_rebuild::{rebuild_producers, replay};
use read::read_blocking;
use staged::StagedBytes;

use persister::{Persister, Staged, Waiter};
use sequencer::{SequenceResult, Sequenced, Sequencer};

type Reply = oneshot::Sender<WalResult<Appended>>;

struct Shared {
    store: Arc<dyn LogStore>,
    shards: RwLock<HashMap<ShardId, Arc<ShardPositions>>>,
    metrics: WalMetrics,
    staged: StagedBytes,
    corruption: Registry,
    scrub_bytes_per_s: u64,
    /// Dropped with the last handle: the scrubber thread sees it and stops.
    _scrubber_stop: flume::Sender<()>,
    disk: Option<Arc<DiskSpace>>,
    producer_limits: ProducerLimits,
    raises: Arc<Raises>,
    /// What every shard's tail cache draws on.
    tail_budget: Arc<TailBudget>,
    /// See [`Wal::recovery_cut`].
    recovery_cut: bool,
}

impl Shared {
    fn shard(&self, shard: ShardId) -> WalResult<Arc<ShardPositions>> {
        self.shards.read().get(&shard).cloned().ok_or(WalError::Store(StoreError::UnknownShard(shard)))
    }
}

/// Handle to the node's WAL. Cheap to clone.
#[derive(Clone)]
pub struct Wal {
    shared: Arc<Shared>,
    sequencer: Arc<tokio::sync::Mutex<Sequencer>>,
}

impl Wal {
    /// Starts the WAL over `store` (already opened and recovered; the damage
    /// its start-up check found goes into the corruption registry), its
    /// persister thread and, unless disabled, its scrubber thread. The
    /// threads stop when every handle is gone.
    pub fn start(store: Arc<dyn LogStore>, config: WalConfig, metrics: WalMetrics) -> WalResult<Wal> {
        let tail_budget =
            TailBudget::new(config.tail_cache_total_bytes, config.tail_cache_bytes, metrics.tail_cache_bytes.clone());
        let mut shards = HashMap::new();
        for shard in store.shards() {
            let bounds = store.bounds(shard)?;
            let positions =
                ShardPositions::new(bounds, store.log_epoch(shard)?, metrics.shard(shard), tail_budget.clone());
            *positions.producers.lock() =
                rebuild_producers(store.as_ref(), &config.producers, shard, bounds.last_seqno)?;
            shards.insert(shard, Arc::new(positions));
        }
        let staged = StagedBytes::new(config.max_batch_bytes, &metrics);
        let corruption = Registry::new(metrics.clone());
        let recovery_cuts = store.recovery_cuts();
        metrics.corruption_detected.with_label_values(&["recovery"]).inc_by(recovery_cuts.len() as u64);
        for d in store.startup_damage() {
            corruption.record(CorruptRange {
                shard: d.shard,
                first_bad_seqno: d.first_seqno,
                last_bad_seqno: d.last_seqno,
                file: d.file,
                location: store.location(),
                found_at: SystemTime::now(),
                how: Detection::Startup,
                detail: d.detail,
            });
        }
        let (scrubber_stop, stopped) = flume::bounded(1);
        let shared = Arc::new(Shared {
            store,
            shards: RwLock::new(shards),
            metrics,
            staged,
            corruption,
            scrub_bytes_per_s: config.scrub_bytes_per_s,
            _scrubber_stop: scrubber_stop,
            disk: config.disk_space.clone(),
            producer_limits: config.producers,
            raises: Arc::default(),
            tail_budget,
            recovery_cut: !recovery_cuts.is_empty(),
        });
        let (to_persister, staged) = flume::unbounded();
        let persister = Persister { shared: shared.clone(), rx: staged, config: config.clone() };
        std::thread::Builder::new()
            .name("walship-wal-persister".into())
            .spawn(move || fatal_on_panic(|| "running the WAL persister".into(), || persister.run()))
            .map_err(|e| WalError::Store(StoreError::Io(format!("spawning the WAL persister: {e}"))))?;
        if config.scrub_bytes_per_s > 0 {
            let shared = Arc::downgrade(&shared);
            let interval = config.scrub_interval;
            std::thread::Builder::new()
                .name("walship-wal-scrubber".into())
                .spawn(move || scrubber(shared, stopped, interval))
                .map_err(|e| WalError::Store(StoreError::Io(format!("spawning the WAL scrubber: {e}"))))?;
        }
        let sequencer =
            Sequencer { shared: shared.clone(), to_persister, config, next: HashMap::new(), leader_records: 0 };
        Ok(Wal { shared, sequencer: Arc::new(tokio::sync::Mutex::new(sequencer)) })
    }

    /// Hosts a shard on this node (idempotent). Blocks on one small fsync.
    pub fn create_shard(&self, shard: ShardId) -> WalResult<()> {
        self.create_shards(&[shard])
    }

    /// Hosts every shard of `shards` on this node (idempotent). Blocks on
    /// one small fsync for all the new ones (the store permitting).
    pub fn create_shards(&self, shards: &[ShardId]) -> WalResult<()> {
        let new: Vec<ShardId> = {
            let hosted = self.shared.shards.read();
            shards.iter().copied().filter(|s| !hosted.contains_key(s)).collect()
        };
        if new.is_empty() {
            return Ok(());
        }
        let store = &self.shared.store;
        let what = || match new.as_slice() {
            [one] => format!("creating shard {one}"),
            many => format!("creating {} shards", many.len()),
        };
        fatal_on_panic(what, || store.create_shards(&new)).map_err(|e| fatal_if(&what(), e))?;
        for shard in new {
            self.host(shard)?;
        }
        Ok(())
    }

    /// Keeps the positions of `shard`, registered in the store.
    fn host(&self, shard: ShardId) -> WalResult<()> {
        let bounds = self.shared.store.bounds(shard)?;
        let log_epoch = self.shared.store.log_epoch(shard)?;
        let producers =
            rebuild_producers(self.shared.store.as_ref(), &self.shared.producer_limits, shard, bounds.last_seqno)?;
        self.shared.shards.write().entry(shard).or_insert_with(|| {
            let positions = ShardPositions::new(
                bounds,
                log_epoch,
                self.shared.metrics.shard(shard),
                self.shared.tail_budget.clone(),
            );
            *positions.producers.lock() = producers;
            Arc::new(positions)
        });
        Ok(())
    }

    /// Every shard hosted, ascending.
    pub fn shards(&self) -> Vec<ShardId> {
        let mut shards: Vec<_> = self.shared.shards.read().keys().copied().collect();
        shards.sort_unstable();
        shards
    }

    pub fn positions(&self, shard: ShardId) -> WalResult<Positions> {
        let p = self.shared.shard(shard)?;
        Ok(Positions {
            first_seqno: p.first.load(Ordering::Acquire),
            durable_seqno: *p.durable.borrow(),
            last_seqno: p.last.load(Ordering::Acquire),
        })
    }

    /// Records the newest epoch this replica promised to, durably, and
    /// refuses leader appends in older epochs from now on.
    pub async fn set_epoch(&self, shard: ShardId, epoch: u64) -> WalResult<()> {
        self.shared.shard(shard)?.min_epoch.fetch_max(epoch, Ordering::AcqRel);
        self.raise(Raise { shard, counter: Counter::Epoch, value: epoch }).await
    }

    /// Makes `raise` durable; raises made at once share one write and one
    /// fsync (`raises.rs`).
    async fn raise(&self, raise: Raise) -> WalResult<()> {
        let shared = &self.shared;
        match shared.raises.raise(&shared.store, &shared.metrics, raise).await {
            Ok(()) => Ok(()),
            Err(None) => Err(WalError::Closed),
            Err(Some(e)) => Err(fatal_if(&format!("recording {raise:?}"), e).into()),
        }
    }

    /// The newest epoch this replica promised to (0 if never).
    pub fn epoch(&self, shard: ShardId) -> WalResult<u64> {
        let promised = self.shared.store.epoch(shard)?;
        self.shared.shard(shard)?.min_epoch.fetch_max(promised, Ordering::AcqRel);
        Ok(promised)
    }

    /// Records the shard's log epoch durably (see
    /// [`LogStore::set_log_epoch`]); a lower value is ignored.
    pub async fn set_log_epoch(&self, shard: ShardId, epoch: u64) -> WalResult<()> {
        let positions = self.shared.shard(shard)?;
        self.raise(Raise { shard, counter: Counter::LogEpoch, value: epoch }).await?;
        positions.log_epoch.fetch_max(epoch, Ordering::AcqRel);
        Ok(())
    }

    /// The shard's log epoch (0 if never recorded), as durable in the store.
    pub fn log_epoch(&self, shard: ShardId) -> WalResult<u64> {
        Ok(self.shared.shard(shard)?.log_epoch.load(Ordering::Acquire))
    }

    /// The epoch of the record at `seqno`.
    pub async fn epoch_at(&self, shard: ShardId, seqno: u64) -> WalResult<u64> {
        let frames = self.read(shard, seqno, seqno, 1).await?;
        Ok(frames.first().map_or(0, Frame::epoch))
    }

    /// The last seqno whose record's epoch is `<= epoch`, with that record's
    /// epoch (`(0, first_seqno - 1)` when there is none). Epochs never
    /// decrease along a log, so this is a binary search of O(log n) reads.
    pub async fn epoch_end(&self, shard: ShardId, epoch: u64) -> WalResult<(u64, u64)> {
        let p = self.positions(shard)?;
        let none = (0, p.first_seqno - 1);
        if p.last_seqno < p.first_seqno || self.epoch_at(shard, p.first_seqno).await? > epoch {
            return Ok(none);
        }
        let (mut lo, mut hi) = (p.first_seqno, p.last_seqno);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if self.epoch_at(shard, mid).await? <= epoch {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        Ok((self.epoch_at(shard, lo).await?, lo))
    }

    /// Bytes of memory the store's index of the log takes (every shard;
    /// [`LogStore::index_bytes`]).
    pub fn index_bytes(&self) -> u64 {
        self.shared.store.index_bytes()
    }

    /// Entries the store's index holds (every shard; chunks).
    pub fn index_chunks(&self) -> u64 {
        self.shared.store.index_chunks()
    }

    pub fn counters(&self, shard: ShardId) -> WalResult<ShardCounters> {
        let p = self.shared.shard(shard)?;
        Ok(ShardCounters { records: p.records.load(Ordering::Acquire), bytes: p.bytes.load(Ordering::Acquire) })
    }

    /// A watch of the shard's newest written seqno: sequenced, readable, and
    /// maybe not in the store yet (the persister may still be writing or
    /// fsyncing it). Always `>=` the durable watch. A coordinated leader may
    /// ship up to it; nothing else may expose it.
    pub fn written_watch(&self, shard: ShardId) -> WalResult<watch::Receiver> {
        Ok(self.shared.shard(shard)?.written.subscribe())
    }

    /// A watch of the newest seqno the persister has handed to the store
    /// (its commit in progress ends there): between durable and written. A
    /// leader with a segment already in flight ships only up to it, so
    /// appends arriving one by one travel one segment per group commit.
    pub fn flushing_watch(&self, shard: ShardId) -> WalResult<watch::Receiver> {
        Ok(self.shared.shard(shard)?.flushing.subscribe())
    }

    /// A watch of the shard's durable seqno: senders, tails and uploads wait
    /// on it so they only ever see fsynced records.
    pub fn durable_watch(&self, shard: ShardId) -> WalResult<watch::Receiver> {
        Ok(self.shared.shard(shard)?.durable.subscribe())
    }

    /// Sequences one append under the sequencer lock (holding it while too
    /// much is staged) and returns what answers once it is durable.
    ///
    /// Appends are sequenced in the order they first asked for the lock
    /// (tokio's mutex is fair): the backpressure wait happens under it, so
    /// an append that finds room never overtakes one that is waiting for
    /// room. A caller that starts its appends in order (one `AppendStream`:
    /// a producer pipelining its batches) gets them written in that order.
    async fn sequence(&self, sequence: impl FnOnce(&mut Sequencer) -> SequenceResult) -> WalResult<Sequenced> {
        let mut sequencer = self.sequencer.lock().await;
        self.shared.staged.wait_below_limit().await;
        match sequence(&mut sequencer)? {
            Some(sequenced) => Ok(sequenced),
            // The injected fault: nothing is sequenced any more until the
            // process aborts.
            None => std::future::pending().await,
        }
    }

    /// Appends records to a shard in `epoch`, answering once they are
    /// durable. Not cancellation-safe: once sequenced, the records are
    /// written even if this future is dropped, and their seqnos are then
    /// unknown to the caller.
    pub async fn append(&self, shard: ShardId, epoch: u64, records: Vec<NewRecord>) -> WalResult<Appended> {
        Ok(self.append_with(shard, epoch, records, AppendOptions::default()).await?.appended)
    }

    /// [`Wal::append`] as a producer session and/or conditioned on the
    /// shard's newest seqno (see [`AppendOptions`] and `crate::producers`).
    /// The producer rules and the condition are checked under the
    /// sequencer lock, so of two appends racing on them exactly one wins.
    /// A duplicate answers once the original records are durable here.
    pub async fn append_with(
        &self,
        shard: ShardId,
        epoch: u64,
        records: Vec<NewRecord>,
        options: AppendOptions,
    ) -> WalResult<AppendOutcome> {
        self.shared.shard(shard)?;
        if records.is_empty() {
            return Err(StoreError::EmptyAppend { shard }.into());
        }
        self.check_disk(records.iter().map(|r| (r.key.len() + r.payload.len()) as u64).sum())?;
        let durable = self.sequence(|s| s.append(shard, epoch, &records, options)).await;
        let refusal = |reason: &str| self.shared.metrics.producer_refusals.with_label_values(&[reason]).inc();
        match &durable {
            Err(WalError::Producer { refusal: r, .. }) => refusal(match r {
                ProducerRefusal::Invalid(_) => "invalid",
                ProducerRefusal::Fenced { .. } => "fenced",
                ProducerRefusal::Unknown { .. } => "unknown",
                ProducerRefusal::Gap { .. } => "gap",
                ProducerRefusal::Forgotten { .. } => "forgotten",
                ProducerRefusal::ForgottenPrefix { .. } => "forgotten_prefix",
            }),
            Err(WalError::ExpectedLast { .. }) => refusal("expected_last"),
            Err(WalError::ProducersUnavailable { .. }) => refusal("unavailable"),
            _ => {}
        }
        match durable? {
            Sequenced::Staged(durable) => {
                let appended = durable.await.map_err(|_| WalError::Closed)??;
                Ok(AppendOutcome { appended, duplicate: false })
            }
            Sequenced::Duplicate(appended, durable) => {
                self.shared.metrics.producer_duplicates.inc();
                durable.await.map_err(|_| WalError::Closed)?;
                Ok(AppendOutcome { appended, duplicate: true })
            }
            Sequenced::Prefixed(prefix_first, durable) => {
                let appended = durable.await.map_err(|_| WalError::Closed)??;
                Ok(AppendOutcome { appended: Appended { first_seqno: prefix_first, ..appended }, duplicate: false })
            }
        }
    }

    /// Producer-session figures of a shard, at log time `now_us`.
    pub fn producer_stats(&self, shard: ShardId, now_us: u64) -> WalResult<ProducerStats> {
        let p = self.shared.shard(shard)?;
        let state = p.producers.lock();
        Ok(ProducerStats {
            producers: state.table.live(&self.shared.producer_limits, now_us),
            snapshots: state.snapshots.len(),
            damaged: state.damaged.clone(),
            duplicates: state.duplicates,
            expired: state.table.forgot().expired,
            evicted: state.table.forgot().evicted,
        })
    }

    /// A producer's epoch, newest sequence and the seqno of that record, if
    /// the shard remembers it (at log time `now_us`).
    pub fn producer(&self, shard: ShardId, id: u64, now_us: u64) -> WalResult<Option<(u64, u64, u64)>> {
        let p = self.shared.shard(shard)?;
        let state = p.producers.lock();
        Ok(state.table.producer(id, &self.shared.producer_limits, now_us))
    }

    /// Appends frames that already carry their seqnos (a follower applying
    /// the leader's segment); they must continue the shard's log exactly.
    /// Not cancellation-safe, like [`Wal::append`].
    pub async fn append_frames(&self, shard: ShardId, frames: Vec<Frame>) -> WalResult<Appended> {
        self.enqueue_frames(shard, frames).await?.await
    }

    /// Sequences frames like [`Wal::append_frames`] and returns once they
    /// are in order behind everything sequenced before; the returned future
    /// resolves when they are durable. A follower holds its per-shard
    /// ordering lock only across this call, so segments queued back to back
    /// still share one group commit.
    pub async fn enqueue_frames(
        &self,
        shard: ShardId,
        frames: Vec<Frame>,
    ) -> WalResult<impl std::future::Future<Output = WalResult<Appended>> + use<>> {
        self.shared.shard(shard)?;
        if frames.is_empty() {
            return Err(StoreError::EmptyAppend { shard }.into());
        }
        self.check_disk(frames.iter().map(|f| f.len() as u64).sum())?;
        let Sequenced::Staged(durable) = self.sequence(|s| s.append_frames(shard, frames)).await? else {
            unreachable!("replicated frames are always staged");
        };
        Ok(async move { durable.await.map_err(|_| WalError::Closed)? })
    }

    /// Refuses an append of about `bytes` while the disk is below its
    /// reserve (atomics only, see [`DiskSpace::check`]).
    fn check_disk(&self, bytes: u64) -> Result<(), DiskFull> {
        self.shared.disk.as_ref().map_or(Ok(()), |disk| disk.check(bytes))
    }

    /// The disk-space reserve appends are checked against, if any.
    pub fn disk_space(&self) -> Option<&Arc<DiskSpace>> {
        self.shared.disk.as_ref()
    }
}

fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as u64).unwrap_or(0)
}

#[cfg(test)]
#[path = "wal_test.rs"]
mod tests;

#[cfg(test)]
#[path = "wal_producers_test.rs"]
mod producer_tests;
