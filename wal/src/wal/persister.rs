//! The WAL's persister: the write path's only thread, turning what the
//! sequencer staged into group commits (one store write and one fsync for
//! everything staged while the previous commit ran), then publishing the
//! durable positions and answering the appenders.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use tokio::sync::oneshot;

use super::{Appended, Reply, Shared, WalConfig, fatal, fatal_if};
use crate::record::Frame;
use crate::store::{ShardAppend, ShardId, SnapshotChanges};

/// The write path's only thread: it gathers everything staged while its
/// previous commit ran, writes it with one fsync, then publishes the durable
/// positions and answers the appenders.
pub(super) struct Persister {
    pub(super) shared: Arc<Shared>,
    pub(super) rx: flume::Receiver<Staged>,
    pub(super) config: WalConfig,
}

/// What the sequencer hands the persister.
pub(super) enum Staged {
    Frames {
        shard: ShardId,
        frames: Vec<Frame>,
        waiter: Waiter,
        /// Producer snapshots written with the frames.
        snapshots: SnapshotChanges,
    },
    /// Answered once everything staged before it is durable.
    Barrier(oneshot::Sender<()>),
}

/// One append waiting for the commit that covers it.
pub(super) struct Waiter {
    pub(super) reply: Reply,
    pub(super) appended: Appended,
    /// The persister lingers for more appends like this one
    /// (`WalConfig::linger`): answered by the commit, its caller may append
    /// again at once.
    pub(super) lingers: bool,
}

/// Staged frames per shard plus who waits on them: one commit.
#[derive(Default)]
struct Batch {
    parts: Vec<ShardAppend>,
    part_of: HashMap<ShardId, usize>,
    waiters: Vec<Waiter>,
    /// Waiters the persister lingers for.
    lingering: usize,
    records: usize,
    bytes: usize,
    barrier: Option<oneshot::Sender<()>>,
    snapshots: SnapshotChanges,
}

impl Batch {
    /// Adds one staged item; per shard, frames follow the ones before.
    fn take(&mut self, staged: Staged) {
        match staged {
            Staged::Frames { shard, frames, waiter, snapshots } => {
                self.snapshots.put.extend(snapshots.put);
                self.snapshots.drop.extend(snapshots.drop);
                self.records += frames.len();
                self.bytes += frames.iter().map(Frame::len).sum::<usize>();
                let index = *self.part_of.entry(shard).or_insert_with(|| {
                    self.parts.push(ShardAppend { shard, frames: Vec::new() });
                    self.parts.len() - 1
                });
                self.parts[index].frames.extend(frames);
                self.lingering += usize::from(waiter.lingers);
                self.waiters.push(waiter);
            }
            Staged::Barrier(done) => self.barrier = Some(done),
        }
    }
}

impl Persister {
    pub(super) fn run(self) {
        let mut last_commit_appends = 0usize;
        while let Ok(first) = self.rx.recv() {
            let mut batch = Batch::default();
            batch.take(first);
            // Everything staged while the previous commit ran joins this one.
            while batch.barrier.is_none() && batch.bytes < self.config.max_batch_bytes {
                match self.rx.try_recv() {
                    Ok(staged) => batch.take(staged),
                    Err(_) => break,
                }
            }
            // Linger for the appenders the previous commit woke, but never
            // for a lone appender, and never past a barrier.
            if batch.lingering < last_commit_appends && !self.config.linger.is_zero() {
                let deadline = Instant::now() + self.config.linger;
                while batch.barrier.is_none()
                    && batch.lingering < last_commit_appends
                    && batch.bytes < self.config.max_batch_bytes
                {
                    match self.rx.recv_deadline(deadline) {
                        Ok(staged) => batch.take(staged),
                        Err(_) => break,
                    }
                }
            }
            if !batch.waiters.is_empty() {
                last_commit_appends = batch.lingering;
            }
            let barrier = batch.barrier.take();
            self.commit(batch);
            if let Some(done) = barrier {
                let _ = done.send(());
            }
        }
    }

    fn commit(&self, batch: Batch) {
        if batch.parts.is_empty() {
            return;
        }
        for part in &batch.parts {
            if let (Ok(positions), Some(last)) = (self.shared.shard(part.shard), part.frames.last()) {
                positions.publish_flushing(last.seqno());
            }
        }
        let started = Instant::now();
        // A merge of a shard's unsealed tail takes its frames from the tail
        // cache rather than reading them back (the store checks them).
        let earlier = |shard, from, to| self.shared.shard(shard).ok()?.tail.lock().read(from, to, usize::MAX);
        if let Err(e) = self.shared.store.append_with_earlier(&batch.parts, &batch.snapshots, true, &earlier) {
            // The sequencer validated every part and published them as
            // written; a store that refuses them leaves the log's state
            // unknown, as a failed write or fsync does.
            fatal("writing and syncing a group commit", &e);
        }
        let metrics = &self.shared.metrics;
        metrics.producer_snapshots.inc_by(batch.snapshots.put.len() as u64);
        metrics.fsync_seconds.observe(started.elapsed().as_secs_f64());
        metrics.group_commit_records.observe(batch.records as f64);
        metrics.records_appended.inc_by(batch.records as u64);
        metrics.bytes_appended.inc_by(batch.bytes as u64);
        metrics.queue_depth.sub(batch.waiters.len() as i64);
        for part in &batch.parts {
            if let Ok(positions) = self.shared.shard(part.shard) {
                let bytes: usize = part.frames.iter().map(Frame::len).sum();
                positions.records.fetch_add(part.frames.len() as u64, Ordering::AcqRel);
                positions.bytes.fetch_add(bytes as u64, Ordering::AcqRel);
                match self.shared.store.bounds(part.shard) {
                    Ok(bounds) => positions.publish_durable(bounds),
                    Err(e) => {
                        fatal_if(&format!("reading shard {}'s positions", part.shard), e);
                    }
                }
            }
        }
        self.shared.staged.release(batch.bytes);
        for waiter in batch.waiters {
            let _ = waiter.reply.send(Ok(waiter.appended));
        }
    }
}
