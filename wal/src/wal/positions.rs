//! A shard's positions and what the WAL keeps beside them (its tail cache,
//! producer table, log epoch), shared by the sequencer, the persister and
//! readers.

use super::*;

/// Per-shard positions shared between the writer and readers.
pub(super) struct ShardPositions {
    pub(super) first: AtomicU64,
    pub(super) last: AtomicU64,
    /// Counted before `durable` is published, so a reader that has seen a
    /// durable seqno also sees at least the bytes that brought it there.
    pub(super) records: AtomicU64,
    pub(super) bytes: AtomicU64,
    /// Leader appends in an older epoch are refused (set on fencing, so an
    /// append queued before a leadership change cannot land after it).
    pub(super) min_epoch: AtomicU64,
    /// The newest written frames, contiguous, oldest first.
    pub(super) tail: parking_lot::Mutex<TailCache>,
    /// Newest seqno sequenced (in the tail cache, maybe not in the store
    /// yet); never behind `flushing`.
    pub(super) written: watch::Sender,
    /// Newest seqno handed to the store: the commit in progress ends here.
    /// Between `durable` and `written`.
    pub(super) flushing: watch::Sender,
    pub(super) durable: watch::Sender,
    /// Its position series; none without per-shard metrics.
    pub(super) gauges: Option<ShardGauges>,
    /// Changed under the sequencer lock, with the frames it applies.
    pub(super) producers: parking_lot::Mutex<ProducerState>,
    /// The log epoch as the store holds it: read from the store when the
    /// shard is first hosted, raised once each raise through this WAL is
    /// durable (nothing else writes it, and it never moves back). Read from
    /// the store each time, it was a raft-engine key lookup for every
    /// heartbeat report and fence answer: 5 % of a surviving node's CPU
    /// while it took over a lost node's 3,334 shards.
    pub(super) log_epoch: AtomicU64,
}

impl ShardPositions {
    pub(super) fn new(
        bounds: LogBounds,
        log_epoch: u64,
        gauges: Option<ShardGauges>,
        tail: Arc<TailBudget>,
    ) -> ShardPositions {
        let positions = ShardPositions {
            first: AtomicU64::new(bounds.first_seqno),
            last: AtomicU64::new(bounds.last_seqno),
            records: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            min_epoch: AtomicU64::new(0),
            tail: parking_lot::Mutex::new(TailCache::new(tail)),
            written: watch::Sender::new(bounds.last_seqno),
            flushing: watch::Sender::new(bounds.last_seqno),
            durable: watch::Sender::new(bounds.durable_seqno),
            gauges,
            producers: parking_lot::Mutex::new(ProducerState::empty(bounds.last_seqno)),
            log_epoch: AtomicU64::new(log_epoch),
        };
        positions.publish(bounds);
        positions
    }

    /// Publishes `seqno` as written (sequenced and in the tail cache).
    pub(super) fn publish_written(&self, seqno: u64) {
        set_watch(&self.written, seqno);
    }

    /// Publishes `seqno` as flushing (the persister is committing it).
    pub(super) fn publish_flushing(&self, seqno: u64) {
        set_watch(&self.flushing, seqno);
    }

    /// Publishes the store's bounds after a commit. Written and flushing are
    /// not touched: the sequencer may already be ahead of the store.
    pub(super) fn publish_durable(&self, bounds: LogBounds) {
        self.first.store(bounds.first_seqno, Ordering::Release);
        self.last.store(bounds.last_seqno, Ordering::Release);
        set_watch(&self.durable, bounds.durable_seqno);
        if let Some(gauges) = &self.gauges {
            gauges.first_seqno.set(bounds.first_seqno as i64);
            gauges.last_seqno.set(bounds.last_seqno as i64);
            gauges.durable_seqno.set(bounds.durable_seqno as i64);
        }
    }

    /// Publishes every position as the store has it, written included: at
    /// start and after a truncation or compaction, when nothing is staged.
    pub(super) fn publish(&self, bounds: LogBounds) {
        // Written first: readers never see durable ahead of flushing, nor
        // flushing ahead of written.
        self.publish_written(bounds.last_seqno);
        self.publish_flushing(bounds.last_seqno);
        self.publish_durable(bounds);
    }
}

/// Sets a position watch to `seqno`, waking its receivers only on a change.
fn set_watch(watch: &watch::Sender, seqno: u64) {
    watch.send_if_modified(|v| std::mem::replace(v, seqno) != seqno);
}
