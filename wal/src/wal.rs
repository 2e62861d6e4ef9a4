//! The node's WAL: every shard's log in one [`LogStore`], fed by one
//! group-commit writer thread.
//!
//! Appenders (async, on any tokio task, for any shard) queue requests; the
//! writer thread takes everything queued, assigns seqnos, encodes each record
//! once into a [`Frame`], writes the whole batch, publishes it as *written*
//! (the shard's `written` watch and its tail cache, so a leader can ship it
//! while the fsync runs), fsyncs once, then publishes the new durable
//! positions and wakes every waiter. Blocking storage calls happen only on
//! that thread (and on `spawn_blocking` for reads).
//!
//! Invariants kept here:
//! * seqnos are assigned by the single writer, so each shard's log is
//!   contiguous; the store refuses anything else;
//! * an append is acknowledged only after the fsync that covers it, and the
//!   durable watch never runs ahead of what is fsynced;
//! * `durable <= written` at every instant: the written watch moves first,
//!   and only once the store's write has returned (a process crash after it
//!   loses nothing, since the page cache survives; only a machine crash can
//!   lose written records that are not yet durable);
//! * a storage failure (a failed write or fsync) stops the process: the WAL
//!   never continues with unknown durability.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use parking_lot::RwLock;
use tokio::sync::{oneshot, watch};

use crate::metrics::{ShardGauges, WalMetrics};
use crate::record::{Frame, RecordFields};
use crate::store::{LogBounds, LogStore, ShardAppend, ShardId, StoreError};

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
}

impl WalError {
    /// The shard this node does not host, if that is the error.
    pub fn unknown_shard(&self) -> Option<ShardId> {
        match self {
            WalError::Store(StoreError::UnknownShard(shard)) => Some(*shard),
            _ => None,
        }
    }
}

pub type WalResult<T> = Result<T, WalError>;

/// Group-commit tuning.
#[derive(Debug, Clone)]
pub struct WalConfig {
    /// Stop draining the queue into one commit past this many bytes.
    pub max_batch_bytes: usize,
    /// Requests that may wait for the writer before appenders are pushed back.
    pub queue_capacity: usize,
    /// How long the writer may wait for the appenders it just woke to queue
    /// again before it commits a smaller batch. It waits only while fewer
    /// requests are queued than the previous commit carried, so a lone
    /// appender never waits.
    pub linger: Duration,
    /// Bytes of each shard's newest written frames kept in memory, so the
    /// readers at the head of the log (shippers, tails, short catch-ups)
    /// never go back to the storage engine.
    pub tail_cache_bytes: usize,
    /// Fault injection for tests only (`None` in production): once this many
    /// leader-path records (appends, not replicated frames) have been made
    /// durable, the next batch carrying leader appends is published as
    /// written *without* being written, and after [`UNWRITTEN_FAULT_GRACE`]
    /// (time for a leader to ship it) the process aborts. This is the
    /// machine crash that loses a shipped, never-fsynced batch, which a
    /// SIGKILL cannot produce (the page cache survives it).
    pub fault_unwritten_batch_after: Option<u64>,
}

/// How long an injected unwritten batch stays visible before the abort.
pub const UNWRITTEN_FAULT_GRACE: Duration = Duration::from_millis(300);

impl Default for WalConfig {
    fn default() -> Self {
        WalConfig {
            max_batch_bytes: 8 << 20,
            queue_capacity: 16 * 1024,
            linger: Duration::from_micros(200),
            tail_cache_bytes: 8 << 20,
            fault_unwritten_batch_after: None,
        }
    }
}

type Reply = oneshot::Sender<WalResult<Appended>>;

enum Request {
    /// Leader path: the writer assigns seqnos.
    Append {
        shard: ShardId,
        epoch: u64,
        records: Vec<NewRecord>,
        reply: Reply,
    },
    /// Follower path: frames arrive with the leader's seqnos.
    AppendFrames {
        shard: ShardId,
        frames: Vec<Frame>,
        reply: Reply,
    },
    Truncate {
        shard: ShardId,
        keep_through: u64,
        reply: oneshot::Sender<WalResult<()>>,
    },
    Compact {
        shard: ShardId,
        first_kept: u64,
        reply: oneshot::Sender<WalResult<()>>,
    },
}

impl Request {
    fn bytes(&self) -> usize {
        match self {
            Request::Append { records, .. } => {
                records.iter().map(|r| Frame::encoded_len(r.key.len(), r.payload.len())).sum()
            }
            Request::AppendFrames { frames, .. } => frames.iter().map(Frame::len).sum(),
            _ => 0,
        }
    }
}

/// A shard's newest written frames, contiguous, within a byte budget.
/// Only the writer thread changes it, always before the positions it covers
/// are published.
#[derive(Default)]
struct TailCache {
    frames: std::collections::VecDeque<Frame>,
    bytes: usize,
}

impl TailCache {
    fn push(&mut self, frames: &[Frame], budget: usize) {
        if let (Some(back), Some(first)) = (self.frames.back(), frames.first())
            && back.seqno() + 1 != first.seqno()
        {
            self.clear();
        }
        for frame in frames {
            self.bytes += frame.len();
            self.frames.push_back(frame.clone());
        }
        while self.bytes > budget {
            match self.frames.pop_front() {
                Some(f) => self.bytes -= f.len(),
                None => break,
            }
        }
    }

    fn clear(&mut self) {
        self.frames.clear();
        self.bytes = 0;
    }

    /// Drops frames after `keep_through`.
    fn truncate(&mut self, keep_through: u64) {
        while self.frames.back().is_some_and(|f| f.seqno() > keep_through) {
            let f = self.frames.pop_back().expect("checked");
            self.bytes -= f.len();
        }
    }

    /// Drops frames before `first_kept`.
    fn compact(&mut self, first_kept: u64) {
        while self.frames.front().is_some_and(|f| f.seqno() < first_kept) {
            let f = self.frames.pop_front().expect("checked");
            self.bytes -= f.len();
        }
    }

    /// Frames `[from, to]` if the cache holds all of them, cut at
    /// `max_bytes` like a store read (at least one frame).
    fn read(&self, from: u64, to: u64, max_bytes: usize) -> Option<Vec<Frame>> {
        let first = self.frames.front()?.seqno();
        let last = self.frames.back()?.seqno();
        if from < first || to > last || from > to {
            return None;
        }
        let mut out = Vec::new();
        let mut size = 0;
        for frame in self.frames.range((from - first) as usize..=(to - first) as usize) {
            size += frame.len();
            if size > max_bytes && !out.is_empty() {
                break;
            }
            out.push(frame.clone());
        }
        Some(out)
    }
}

/// Per-shard positions shared between the writer and readers.
struct ShardPositions {
    first: AtomicU64,
    last: AtomicU64,
    /// Counted before `durable` is published, so a reader that has seen a
    /// durable seqno also sees at least the bytes that brought it there.
    records: AtomicU64,
    bytes: AtomicU64,
    /// Leader appends in an older epoch are refused (set on fencing, so an
    /// append queued before a leadership change cannot land after it).
    min_epoch: AtomicU64,
    /// The newest written frames, contiguous, oldest first.
    tail: parking_lot::Mutex<TailCache>,
    /// Newest seqno written to the store (maybe not fsynced); never behind
    /// `durable`.
    written: watch::Sender<u64>,
    durable: watch::Sender<u64>,
    gauges: ShardGauges,
}

impl ShardPositions {
    fn new(bounds: LogBounds, gauges: ShardGauges) -> ShardPositions {
        let positions = ShardPositions {
            first: AtomicU64::new(bounds.first_seqno),
            last: AtomicU64::new(bounds.last_seqno),
            records: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            min_epoch: AtomicU64::new(0),
            tail: parking_lot::Mutex::new(TailCache::default()),
            written: watch::Sender::new(bounds.last_seqno),
            durable: watch::Sender::new(bounds.durable_seqno),
            gauges,
        };
        positions.publish(bounds);
        positions
    }

    /// Publishes `seqno` as written (the store's write has returned).
    fn publish_written(&self, seqno: u64) {
        self.written.send_if_modified(|w| {
            let changed = *w != seqno;
            *w = seqno;
            changed
        });
    }

    fn publish(&self, bounds: LogBounds) {
        self.first.store(bounds.first_seqno, Ordering::Release);
        self.last.store(bounds.last_seqno, Ordering::Release);
        // Written first: readers of both never see durable ahead of written.
        self.publish_written(bounds.last_seqno);
        self.durable.send_if_modified(|d| {
            let changed = *d != bounds.durable_seqno;
            *d = bounds.durable_seqno;
            changed
        });
        self.gauges.first_seqno.set(bounds.first_seqno as i64);
        self.gauges.last_seqno.set(bounds.last_seqno as i64);
        self.gauges.durable_seqno.set(bounds.durable_seqno as i64);
    }
}

struct Shared {
    store: Arc<dyn LogStore>,
    shards: RwLock<HashMap<ShardId, Arc<ShardPositions>>>,
    metrics: WalMetrics,
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
    tx: flume::Sender<Request>,
}

impl Wal {
    /// Starts the WAL over `store` (already opened and recovered) and its
    /// group-commit writer thread. The thread stops when every handle is gone.
    pub fn start(store: Arc<dyn LogStore>, config: WalConfig, metrics: WalMetrics) -> WalResult<Wal> {
        let mut shards = HashMap::new();
        for shard in store.shards() {
            let bounds = store.bounds(shard)?;
            shards.insert(shard, Arc::new(ShardPositions::new(bounds, metrics.shard(shard))));
        }
        let shared = Arc::new(Shared { store, shards: RwLock::new(shards), metrics });
        let (tx, rx) = flume::bounded(config.queue_capacity);
        let writer = Writer { shared: shared.clone(), rx, config, leader_records: std::cell::Cell::new(0) };
        std::thread::Builder::new()
            .name("walship-wal-writer".into())
            .spawn(move || writer.run())
            .map_err(|e| WalError::Store(StoreError::Io(format!("spawning the WAL writer: {e}"))))?;
        Ok(Wal { shared, tx })
    }

    /// Hosts a shard on this node (idempotent). Blocks on one small fsync.
    pub fn create_shard(&self, shard: ShardId) -> WalResult<()> {
        if self.shared.shards.read().contains_key(&shard) {
            return Ok(());
        }
        self.shared.store.create_shard(shard)?;
        let bounds = self.shared.store.bounds(shard)?;
        self.shared
            .shards
            .write()
            .entry(shard)
            .or_insert_with(|| Arc::new(ShardPositions::new(bounds, self.shared.metrics.shard(shard))));
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
        let store = self.shared.store.clone();
        tokio::task::spawn_blocking(move || store.set_epoch(shard, epoch)).await.map_err(|_| WalError::Closed)??;
        Ok(())
    }

    /// The newest epoch this replica promised to (0 if never).
    pub fn epoch(&self, shard: ShardId) -> WalResult<u64> {
        let promised = self.shared.store.epoch(shard)?;
        self.shared.shard(shard)?.min_epoch.fetch_max(promised, Ordering::AcqRel);
        Ok(promised)
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

    pub fn counters(&self, shard: ShardId) -> WalResult<ShardCounters> {
        let p = self.shared.shard(shard)?;
        Ok(ShardCounters { records: p.records.load(Ordering::Acquire), bytes: p.bytes.load(Ordering::Acquire) })
    }

    /// A watch of the shard's newest written seqno (the store's write has
    /// returned; the fsync may still be running). Always `>=` the durable
    /// watch. A leader may ship up to it; nothing else may expose it.
    pub fn written_watch(&self, shard: ShardId) -> WalResult<watch::Receiver<u64>> {
        Ok(self.shared.shard(shard)?.written.subscribe())
    }

    /// A watch of the shard's durable seqno: senders, tails and uploads wait
    /// on it so they only ever see fsynced records.
    pub fn durable_watch(&self, shard: ShardId) -> WalResult<watch::Receiver<u64>> {
        Ok(self.shared.shard(shard)?.durable.subscribe())
    }

    async fn submit<T>(&self, request: Request, rx: oneshot::Receiver<WalResult<T>>) -> WalResult<T> {
        self.shared.metrics.queue_depth.inc();
        if self.tx.send_async(request).await.is_err() {
            self.shared.metrics.queue_depth.dec();
            return Err(WalError::Closed);
        }
        rx.await.map_err(|_| WalError::Closed)?
    }

    /// Appends records to a shard in `epoch`, answering once they are
    /// durable. Not cancellation-safe: once queued, the records are written
    /// even if this future is dropped, and their seqnos are then unknown to
    /// the caller.
    pub async fn append(&self, shard: ShardId, epoch: u64, records: Vec<NewRecord>) -> WalResult<Appended> {
        self.shared.shard(shard)?;
        if records.is_empty() {
            return Err(StoreError::EmptyAppend { shard }.into());
        }
        let (reply, rx) = oneshot::channel();
        self.submit(Request::Append { shard, epoch, records, reply }, rx).await
    }

    /// Appends frames that already carry their seqnos (a follower applying
    /// the leader's segment); they must continue the shard's log exactly.
    /// Not cancellation-safe, like [`Wal::append`].
    pub async fn append_frames(&self, shard: ShardId, frames: Vec<Frame>) -> WalResult<Appended> {
        self.enqueue_frames(shard, frames).await?.await
    }

    /// Queues frames like [`Wal::append_frames`] and returns once they are in
    /// the writer's queue, in order behind everything queued before; the
    /// returned future resolves when they are durable. A follower holds its
    /// per-shard ordering lock only across this call, so segments queued back
    /// to back still share one group commit.
    pub async fn enqueue_frames(
        &self,
        shard: ShardId,
        frames: Vec<Frame>,
    ) -> WalResult<impl std::future::Future<Output = WalResult<Appended>> + use<>> {
        self.shared.shard(shard)?;
        let (reply, rx) = oneshot::channel();
        self.shared.metrics.queue_depth.inc();
        if self.tx.send_async(Request::AppendFrames { shard, frames, reply }).await.is_err() {
            self.shared.metrics.queue_depth.dec();
            return Err(WalError::Closed);
        }
        Ok(async move { rx.await.map_err(|_| WalError::Closed)? })
    }

    /// Removes every record after `keep_through`, in order with appends.
    pub async fn truncate_suffix(&self, shard: ShardId, keep_through: u64) -> WalResult<()> {
        self.shared.shard(shard)?;
        let (reply, rx) = oneshot::channel();
        self.submit(Request::Truncate { shard, keep_through, reply }, rx).await
    }

    /// Discards durable records before `first_kept`, in order with appends.
    pub async fn compact_prefix(&self, shard: ShardId, first_kept: u64) -> WalResult<()> {
        self.shared.shard(shard)?;
        let (reply, rx) = oneshot::channel();
        self.submit(Request::Compact { shard, first_kept, reply }, rx).await
    }

    /// Reads frames `[from, to]` (see [`LogStore::read`]) on a blocking
    /// thread. Callers bound `to` by the position they may expose (durable or
    /// committed).
    pub async fn read(&self, shard: ShardId, from: u64, to: u64, max_bytes: usize) -> WalResult<Vec<Frame>> {
        if let Some(frames) = self.shared.shard(shard)?.tail.lock().read(from, to, max_bytes) {
            return Ok(frames);
        }
        let store = self.shared.store.clone();
        tokio::task::spawn_blocking(move || store.read(shard, from, to, max_bytes))
            .await
            .map_err(|_| WalError::Closed)?
            .map_err(WalError::from)
    }
}

/// The group-commit writer, alone on its thread.
struct Writer {
    shared: Arc<Shared>,
    rx: flume::Receiver<Request>,
    config: WalConfig,
    /// Leader-path records made durable by this writer (for the injected
    /// fault).
    leader_records: std::cell::Cell<u64>,
}

/// One append waiting for the commit that covers it.
struct Waiter {
    reply: Reply,
    appended: Appended,
}

/// The batch being assembled: runs per shard plus who waits on them.
#[derive(Default)]
struct Batch {
    parts: Vec<ShardAppend>,
    part_of: HashMap<ShardId, usize>,
    /// Next seqno per shard, counting what this batch already holds.
    next: HashMap<ShardId, u64>,
    waiters: Vec<Waiter>,
    records: usize,
    /// Records of leader appends (the WAL assigned their seqnos).
    leader_records: usize,
    bytes: usize,
}

impl Batch {
    fn push(&mut self, shard: ShardId, frames: Vec<Frame>) {
        self.records += frames.len();
        self.bytes += frames.iter().map(Frame::len).sum::<usize>();
        let index = *self.part_of.entry(shard).or_insert_with(|| {
            self.parts.push(ShardAppend { shard, frames: Vec::new() });
            self.parts.len() - 1
        });
        self.parts[index].frames.extend(frames);
    }
}

fn fatal(error: &StoreError) -> ! {
    tracing::error!(%error, "WAL storage failure; stopping the process rather than continue with unknown durability");
    eprintln!("walship: fatal WAL storage failure: {error}");
    std::process::abort();
}

fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as u64).unwrap_or(0)
}

impl Writer {
    fn run(self) {
        let mut last_commit_requests = 1usize;
        while let Ok(first) = self.rx.recv() {
            let mut queued = vec![first];
            let mut bytes = queued[0].bytes();
            while bytes < self.config.max_batch_bytes {
                match self.rx.try_recv() {
                    Ok(request) => {
                        bytes += request.bytes();
                        queued.push(request);
                    }
                    Err(_) => break,
                }
            }
            if queued.len() < last_commit_requests && !self.config.linger.is_zero() {
                let deadline = Instant::now() + self.config.linger;
                while queued.len() < last_commit_requests && bytes < self.config.max_batch_bytes {
                    match self.rx.recv_deadline(deadline) {
                        Ok(request) => {
                            bytes += request.bytes();
                            queued.push(request);
                        }
                        Err(_) => break,
                    }
                }
            }
            self.shared.metrics.queue_depth.sub(queued.len() as i64);
            last_commit_requests = queued.len();
            self.process(queued);
        }
    }

    fn next_seqno(&self, batch: &mut Batch, shard: ShardId) -> Result<u64, StoreError> {
        if let Some(next) = batch.next.get(&shard) {
            return Ok(*next);
        }
        let next = self.shared.store.bounds(shard)?.last_seqno + 1;
        batch.next.insert(shard, next);
        Ok(next)
    }

    /// Applies queued requests in order: appends gather into one commit;
    /// a truncation or compaction first commits what is gathered before it.
    fn process(&self, queued: Vec<Request>) {
        let mut batch = Batch::default();
        let now = now_us();
        for request in queued {
            match request {
                Request::Append { shard, epoch, records, reply } => {
                    let promised = self.shared.shard(shard).map_or(0, |p| p.min_epoch.load(Ordering::Acquire));
                    if epoch < promised {
                        let _ = reply.send(Err(WalError::StaleEpoch { shard, epoch, promised }));
                        continue;
                    }
                    let first = match self.next_seqno(&mut batch, shard) {
                        Ok(next) => next,
                        Err(e) => {
                            let _ = reply.send(Err(e.into()));
                            continue;
                        }
                    };
                    let frames: Vec<Frame> = records
                        .iter()
                        .enumerate()
                        .map(|(i, r)| {
                            Frame::encode(RecordFields {
                                seqno: first + i as u64,
                                epoch,
                                timestamp_us: now,
                                key: &r.key,
                                payload: &r.payload,
                            })
                        })
                        .collect();
                    let last = first + frames.len() as u64 - 1;
                    batch.next.insert(shard, last + 1);
                    batch.leader_records += frames.len();
                    batch.push(shard, frames);
                    batch.waiters.push(Waiter { reply, appended: Appended { first_seqno: first, last_seqno: last } });
                }
                Request::AppendFrames { shard, frames, reply } => {
                    let checked = self.next_seqno(&mut batch, shard).and_then(|next| {
                        crate::store::check_continues(shard, next, &frames)?;
                        Ok(next)
                    });
                    match checked {
                        Ok(first) => {
                            let last = first + frames.len() as u64 - 1;
                            batch.next.insert(shard, last + 1);
                            batch.push(shard, frames);
                            batch
                                .waiters
                                .push(Waiter { reply, appended: Appended { first_seqno: first, last_seqno: last } });
                        }
                        Err(e) => {
                            let _ = reply.send(Err(e.into()));
                        }
                    }
                }
                Request::Truncate { shard, keep_through, reply } => {
                    self.commit(std::mem::take(&mut batch));
                    if let Ok(p) = self.shared.shard(shard) {
                        p.tail.lock().truncate(keep_through);
                    }
                    let result = self.shared.store.truncate_suffix(shard, keep_through);
                    let _ = reply.send(self.after_control(shard, result));
                }
                Request::Compact { shard, first_kept, reply } => {
                    self.commit(std::mem::take(&mut batch));
                    let result = self.shared.store.compact_prefix(shard, first_kept);
                    if result.is_ok()
                        && let Ok(p) = self.shared.shard(shard)
                    {
                        p.tail.lock().compact(first_kept);
                    }
                    let _ = reply.send(self.after_control(shard, result));
                }
            }
        }
        self.commit(batch);
    }

    fn after_control(&self, shard: ShardId, result: Result<(), StoreError>) -> WalResult<()> {
        match result {
            Ok(()) => {
                self.publish(&[shard]);
                Ok(())
            }
            Err(e) if e.is_fatal() => fatal(&e),
            Err(e) => Err(e.into()),
        }
    }

    fn publish(&self, shards: &[ShardId]) {
        for &shard in shards {
            match (self.shared.shard(shard), self.shared.store.bounds(shard)) {
                (Ok(positions), Ok(bounds)) => positions.publish(bounds),
                (_, Err(e)) if e.is_fatal() => fatal(&e),
                _ => {}
            }
        }
    }

    fn commit(&self, batch: Batch) {
        if batch.parts.is_empty() {
            return;
        }
        if batch.leader_records > 0
            && self.config.fault_unwritten_batch_after.is_some_and(|after| self.leader_records.get() >= after)
        {
            self.inject_unwritten_batch(&batch);
        }
        let started = Instant::now();
        // Write, publish as written (the shippers may go), then fsync.
        if let Err(e) = self.shared.store.append(&batch.parts, false) {
            if e.is_fatal() {
                fatal(&e);
            }
            // Every part was validated above; a refusal here is a bug in the
            // writer's bookkeeping, and nothing was written.
            tracing::error!(error = %e, "WAL store refused a validated batch");
            for waiter in batch.waiters {
                let _ = waiter.reply.send(Err(WalError::Store(StoreError::Io(e.to_string()))));
            }
            return;
        }
        self.publish_written(&batch);
        if let Err(e) = self.shared.store.append(&[], true) {
            // A failed fsync leaves the written records' durability unknown.
            fatal(&e);
        }
        let metrics = &self.shared.metrics;
        metrics.fsync_seconds.observe(started.elapsed().as_secs_f64());
        metrics.group_commit_records.observe(batch.records as f64);
        metrics.records_appended.inc_by(batch.records as u64);
        metrics.bytes_appended.inc_by(batch.bytes as u64);
        self.leader_records.set(self.leader_records.get() + batch.leader_records as u64);
        for part in &batch.parts {
            if let Ok(positions) = self.shared.shard(part.shard) {
                let bytes: usize = part.frames.iter().map(Frame::len).sum();
                positions.records.fetch_add(part.frames.len() as u64, Ordering::AcqRel);
                positions.bytes.fetch_add(bytes as u64, Ordering::AcqRel);
            }
        }
        let shards: Vec<ShardId> = batch.parts.iter().map(|p| p.shard).collect();
        self.publish(&shards);
        for waiter in batch.waiters {
            let _ = waiter.reply.send(Ok(waiter.appended));
        }
    }

    /// Puts the batch's frames in the tail cache and moves each shard's
    /// written watch to its last frame. The store's write has returned.
    fn publish_written(&self, batch: &Batch) {
        for part in &batch.parts {
            if let Ok(positions) = self.shared.shard(part.shard) {
                positions.tail.lock().push(&part.frames, self.config.tail_cache_bytes);
                if let Some(last) = part.frames.last() {
                    positions.publish_written(last.seqno());
                }
            }
        }
    }

    /// The injected fault (see [`WalConfig::fault_unwritten_batch_after`]):
    /// the batch is shipped as if written, never reaches the store, and the
    /// process dies as a machine crash would.
    fn inject_unwritten_batch(&self, batch: &Batch) -> ! {
        tracing::error!(records = batch.records, "injected fault: publishing a batch as written without writing it");
        self.publish_written(batch);
        std::thread::sleep(UNWRITTEN_FAULT_GRACE);
        eprintln!("walship: injected fault: aborting with {} records shipped but never written", batch.records);
        std::process::abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{EngineStore, MemStore};

    fn records(n: usize) -> Vec<NewRecord> {
        (0..n).map(|i| NewRecord { key: Bytes::new(), payload: Bytes::from(format!("p{i}")) }).collect()
    }

    async fn many_appenders_get_contiguous_seqnos(store: Arc<dyn LogStore>) {
        let wal = Wal::start(store, WalConfig::default(), WalMetrics::unregistered()).unwrap();
        for shard in 1..=4 {
            wal.create_shard(shard).unwrap();
        }
        let mut tasks = Vec::new();
        for task in 0..64u32 {
            let wal = wal.clone();
            tasks.push(tokio::spawn(async move {
                let shard = 1 + task % 4;
                let mut got = Vec::new();
                for i in 0..20 {
                    let n = 1 + (task as usize + i) % 3;
                    let a = wal.append(shard, 1, records(n)).await.unwrap();
                    assert_eq!(a.last_seqno - a.first_seqno + 1, n as u64);
                    // Acknowledged means durable: the watch is already there.
                    assert!(*wal.durable_watch(shard).unwrap().borrow() >= a.last_seqno);
                    got.push((shard, a));
                }
                got
            }));
        }
        let mut per_shard: HashMap<ShardId, Vec<Appended>> = HashMap::new();
        for task in tasks {
            for (shard, a) in task.await.unwrap() {
                per_shard.entry(shard).or_default().push(a);
            }
        }
        for (shard, mut ranges) in per_shard {
            ranges.sort_by_key(|a| a.first_seqno);
            let mut next = 1;
            for a in &ranges {
                assert_eq!(a.first_seqno, next, "shard {shard}: ranges must tile the log");
                next = a.last_seqno + 1;
            }
            let p = wal.positions(shard).unwrap();
            assert_eq!((p.last_seqno, p.durable_seqno), (next - 1, next - 1));
            let frames = wal.read(shard, 1, next - 1, usize::MAX).await.unwrap();
            assert!(frames.iter().enumerate().all(|(i, f)| f.seqno() == 1 + i as u64));
        }
    }

    /// A store whose fsyncs (`append(&[], true)`) wait until the test lets
    /// them through, so the instant between write and fsync can be observed.
    struct GatedSync {
        inner: MemStore,
        gate: parking_lot::Mutex<std::sync::mpsc::Receiver<()>>,
    }

    impl LogStore for GatedSync {
        fn create_shard(&self, shard: ShardId) -> crate::store::StoreResult<()> {
            self.inner.create_shard(shard)
        }
        fn shards(&self) -> Vec<ShardId> {
            self.inner.shards()
        }
        fn bounds(&self, shard: ShardId) -> crate::store::StoreResult<LogBounds> {
            self.inner.bounds(shard)
        }
        fn append(&self, batch: &[ShardAppend], sync: bool) -> crate::store::StoreResult<()> {
            if sync {
                self.gate.lock().recv().expect("the test holds the gate");
            }
            self.inner.append(batch, sync)
        }
        fn read(&self, shard: ShardId, from: u64, to: u64, max_bytes: usize) -> crate::store::StoreResult<Vec<Frame>> {
            self.inner.read(shard, from, to, max_bytes)
        }
        fn truncate_suffix(&self, shard: ShardId, keep_through: u64) -> crate::store::StoreResult<()> {
            self.inner.truncate_suffix(shard, keep_through)
        }
        fn compact_prefix(&self, shard: ShardId, first_kept: u64) -> crate::store::StoreResult<()> {
            self.inner.compact_prefix(shard, first_kept)
        }
        fn set_epoch(&self, shard: ShardId, epoch: u64) -> crate::store::StoreResult<()> {
            self.inner.set_epoch(shard, epoch)
        }
        fn epoch(&self, shard: ShardId) -> crate::store::StoreResult<u64> {
            self.inner.epoch(shard)
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn written_is_published_after_the_write_and_before_the_fsync() {
        let (open, gate) = std::sync::mpsc::channel();
        let store = Arc::new(GatedSync { inner: MemStore::new(), gate: parking_lot::Mutex::new(gate) });
        let wal = Wal::start(store.clone(), WalConfig::default(), WalMetrics::unregistered()).unwrap();
        wal.create_shard(1).unwrap();
        let mut written = wal.written_watch(1).unwrap();
        let durable = wal.durable_watch(1).unwrap();
        let pending = tokio::spawn({
            let wal = wal.clone();
            async move { wal.append(1, 1, records(3)).await }
        });
        // The fsync is held: written moves, durable does not, the append
        // is not acknowledged, and the frames are readable for shipping.
        tokio::time::timeout(Duration::from_secs(10), written.wait_for(|w| *w == 3)).await.unwrap().unwrap();
        assert_eq!(*durable.borrow(), 0, "durable must wait for the fsync");
        assert_eq!(store.inner.bounds(1).unwrap().last_seqno, 3, "written only once the store's write returned");
        assert!(!pending.is_finished(), "no acknowledgement before the fsync");
        let frames = wal.read(1, 1, 3, usize::MAX).await.unwrap();
        assert_eq!(frames.iter().map(Frame::seqno).collect::<Vec<_>>(), vec![1, 2, 3]);
        // Let the fsync through: durable catches up and the append returns.
        open.send(()).unwrap();
        let appended = pending.await.unwrap().unwrap();
        assert_eq!(appended, Appended { first_seqno: 1, last_seqno: 3 });
        assert_eq!((*durable.borrow(), *written.borrow()), (3, 3));
        drop(open);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn durable_never_passes_written() {
        let wal = Wal::start(Arc::new(MemStore::new()), WalConfig::default(), WalMetrics::unregistered()).unwrap();
        wal.create_shard(1).unwrap();
        let mut durable = wal.durable_watch(1).unwrap();
        let written = wal.written_watch(1).unwrap();
        let watcher = tokio::spawn(async move {
            let mut checked = 0;
            while durable.changed().await.is_ok() {
                let d = *durable.borrow_and_update();
                assert!(d <= *written.borrow(), "durable {d} ahead of written {}", *written.borrow());
                checked += 1;
                if d >= 400 {
                    break;
                }
            }
            checked
        });
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let wal = wal.clone();
            tasks.push(tokio::spawn(async move {
                for _ in 0..25 {
                    wal.append(1, 1, records(2)).await.unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert!(watcher.await.unwrap() > 0, "the watcher saw durable move");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn group_commit_mem() {
        many_appenders_get_contiguous_seqnos(Arc::new(MemStore::new())).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn group_commit_engine() {
        let dir = tempfile::tempdir().unwrap();
        let store = EngineStore::open(dir.path(), &Default::default()).unwrap();
        many_appenders_get_contiguous_seqnos(Arc::new(store)).await;
    }

    #[test]
    fn tail_cache_keeps_the_newest_contiguous_frames_within_budget() {
        let frames = crate::conformance::frames(1, 10, 1);
        let one = frames[0].len();
        let mut cache = TailCache::default();
        cache.push(&frames[..6], one * 4);
        assert_eq!(cache.frames.len(), 4, "budget of 4 frames");
        assert_eq!(cache.read(3, 6, usize::MAX).unwrap(), frames[2..6].to_vec());
        assert_eq!(cache.read(2, 6, usize::MAX), None, "2 was evicted: the store serves it");
        assert_eq!(cache.read(5, 7, usize::MAX), None, "7 is not cached yet");
        assert_eq!(cache.read(3, 6, one).unwrap().len(), 1, "max_bytes cuts, at least one frame");
        // A push that does not continue the cached run replaces it.
        cache.push(&frames[7..9], one * 4);
        assert_eq!(cache.read(8, 9, usize::MAX).unwrap(), frames[7..9].to_vec());
        assert_eq!(cache.read(6, 6, usize::MAX), None);
        cache.truncate(8);
        assert_eq!(cache.read(9, 9, usize::MAX), None);
        cache.compact(9);
        assert!(cache.frames.is_empty());
        assert_eq!(cache.bytes, 0);
    }

    #[tokio::test]
    async fn reads_after_truncation_see_the_replacement_not_the_cached_tail() {
        let wal = Wal::start(Arc::new(MemStore::new()), WalConfig::default(), WalMetrics::unregistered()).unwrap();
        wal.create_shard(1).unwrap();
        wal.append(1, 1, records(5)).await.unwrap();
        wal.truncate_suffix(1, 3).await.unwrap();
        wal.append_frames(1, crate::conformance::frames(4, 2, 2)).await.unwrap();
        let epochs: Vec<u64> = wal.read(1, 1, 5, usize::MAX).await.unwrap().iter().map(Frame::epoch).collect();
        assert_eq!(epochs, vec![1, 1, 1, 2, 2]);
    }

    #[tokio::test]
    async fn epochs_fence_leader_appends_and_locate_epoch_ends() {
        let wal = Wal::start(Arc::new(MemStore::new()), WalConfig::default(), WalMetrics::unregistered()).unwrap();
        wal.create_shard(1).unwrap();
        assert_eq!(wal.epoch_end(1, 5).await.unwrap(), (0, 0), "empty log");
        wal.append(1, 2, records(3)).await.unwrap(); // 1..=3 in epoch 2
        wal.append(1, 4, records(2)).await.unwrap(); // 4..=5 in epoch 4
        wal.append(1, 7, records(1)).await.unwrap(); // 6 in epoch 7
        assert_eq!(wal.epoch_end(1, 1).await.unwrap(), (0, 0));
        assert_eq!(wal.epoch_end(1, 2).await.unwrap(), (2, 3));
        assert_eq!(wal.epoch_end(1, 3).await.unwrap(), (2, 3));
        assert_eq!(wal.epoch_end(1, 6).await.unwrap(), (4, 5));
        assert_eq!(wal.epoch_end(1, 9).await.unwrap(), (7, 6));
        wal.set_epoch(1, 8).await.unwrap();
        assert_eq!(wal.epoch(1).unwrap(), 8);
        assert!(matches!(wal.append(1, 7, records(1)).await, Err(WalError::StaleEpoch { promised: 8, .. })));
        assert_eq!(wal.positions(1).unwrap().last_seqno, 6, "the refused append wrote nothing");
        // Followers still apply older-epoch records from the new leader.
        wal.append_frames(1, crate::conformance::frames(7, 1, 7)).await.unwrap();
        wal.append(1, 8, records(1)).await.unwrap();
    }

    #[tokio::test]
    async fn refusals_change_nothing() {
        let wal = Wal::start(Arc::new(MemStore::new()), WalConfig::default(), WalMetrics::unregistered()).unwrap();
        wal.create_shard(1).unwrap();
        wal.append(1, 1, records(3)).await.unwrap();
        assert_eq!(wal.append(9, 1, records(1)).await.unwrap_err().unknown_shard(), Some(9));
        assert!(matches!(wal.append(1, 1, vec![]).await, Err(WalError::Store(StoreError::EmptyAppend { .. }))));
        let foreign = crate::conformance::frames(7, 2, 1);
        assert!(matches!(
            wal.append_frames(1, foreign).await,
            Err(WalError::Store(StoreError::NotContinuous { expected: 4, found: 7, .. }))
        ));
        let p = wal.positions(1).unwrap();
        assert_eq!((p.first_seqno, p.last_seqno, p.durable_seqno), (1, 3, 3));
        // Follower path continues exactly; truncate and compact go in order.
        wal.append_frames(1, crate::conformance::frames(4, 2, 2)).await.unwrap();
        wal.truncate_suffix(1, 4).await.unwrap();
        assert_eq!(wal.positions(1).unwrap().last_seqno, 4);
        wal.compact_prefix(1, 3).await.unwrap();
        assert_eq!(wal.positions(1).unwrap().first_seqno, 3);
        assert!(wal.compact_prefix(1, 9).await.is_err());
        let a = wal.append(1, 3, records(1)).await.unwrap();
        assert_eq!(a, Appended { first_seqno: 5, last_seqno: 5 });
    }
}
