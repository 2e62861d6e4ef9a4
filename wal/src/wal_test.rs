//! Unit tests of the WAL: sequencing, group commit, positions and watches, the tail cache, backpressure, corruption records.

use super::*;
use crate::store::ShardAppend;
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

/// A store whose syncing appends wait until the test lets them through,
/// so the instant between sequencing and fsync can be observed.
struct GatedSync {
    inner: MemStore,
    gate: parking_lot::Mutex<std::sync::mpsc::Receiver<()>>,
    /// Syncing appends that have reached the gate.
    held: tokio::sync::watch::Sender<usize>,
}

impl GatedSync {
    /// Waits (up to 10 s) until `n` syncing appends have reached the gate.
    async fn wait_held(&self, n: usize) {
        let mut held = self.held.subscribe();
        if tokio::time::timeout(Duration::from_secs(10), held.wait_for(|h| *h >= n)).await.is_err() {
            panic!("{} commits reached the store, not {n}", *self.held.borrow());
        }
    }
}

/// A WAL with shard 1 over a [`GatedSync`] store, the store, and the
/// sender that lets one held commit through per message.
fn gated(config: WalConfig, metrics: WalMetrics) -> (Wal, Arc<GatedSync>, std::sync::mpsc::Sender<()>) {
    let (open, gate) = std::sync::mpsc::channel();
    let store = Arc::new(GatedSync {
        inner: MemStore::new(),
        gate: parking_lot::Mutex::new(gate),
        held: tokio::sync::watch::Sender::new(0),
    });
    let wal = Wal::start(store.clone(), config, metrics).unwrap();
    wal.create_shard(1).unwrap();
    (wal, store, open)
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
    fn append_with_snapshots(
        &self,
        batch: &[ShardAppend],
        snapshots: &crate::store::SnapshotChanges,
        sync: bool,
    ) -> crate::store::StoreResult<()> {
        if sync {
            self.held.send_modify(|h| *h += 1);
            self.gate.lock().recv().expect("the test holds the gate");
        }
        self.inner.append_with_snapshots(batch, snapshots, sync)
    }
    fn producer_snapshots(&self, shard: ShardId) -> crate::store::StoreResult<Vec<(u64, bytes::Bytes)>> {
        self.inner.producer_snapshots(shard)
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
    fn set_log_epoch(&self, shard: ShardId, epoch: u64) -> crate::store::StoreResult<()> {
        self.inner.set_log_epoch(shard, epoch)
    }
    fn log_epoch(&self, shard: ShardId) -> crate::store::StoreResult<u64> {
        self.inner.log_epoch(shard)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn written_is_published_before_the_fsync_and_the_next_batch_is_sequenced_during_it() {
    let (wal, store, open) = gated(WalConfig::default(), WalMetrics::unregistered());
    let mut written = wal.written_watch(1).unwrap();
    let mut flushing = wal.flushing_watch(1).unwrap();
    let durable = wal.durable_watch(1).unwrap();
    let append = |n| {
        let wal = wal.clone();
        tokio::spawn(async move { wal.append(1, 1, records(n)).await })
    };
    let first = append(3);
    // The commit is held: written moves, durable does not, the append
    // is not acknowledged, and the frames are readable for shipping
    // although the store does not hold them yet.
    tokio::time::timeout(Duration::from_secs(10), written.wait_for(|w| *w == 3)).await.unwrap().unwrap();
    assert_eq!(*durable.borrow(), 0, "durable must wait for the fsync");
    assert_eq!(store.inner.bounds(1).unwrap().last_seqno, 0, "sequenced ahead of the store");
    assert!(!first.is_finished(), "no acknowledgement before the fsync");
    let frames = wal.read(1, 1, 3, usize::MAX).await.unwrap();
    assert_eq!(frames.iter().map(Frame::seqno).collect::<Vec<_>>(), vec![1, 2, 3]);
    // The persister has taken it: flushing ends at its last record.
    tokio::time::timeout(Duration::from_secs(10), flushing.wait_for(|f| *f == 3)).await.unwrap().unwrap();
    // While that fsync is held, the next append is sequenced and
    // readable too: the sequencer does not wait for the persister.
    let second = append(2);
    tokio::time::timeout(Duration::from_secs(10), written.wait_for(|w| *w == 5)).await.unwrap().unwrap();
    let frames = wal.read(1, 4, 5, usize::MAX).await.unwrap();
    assert_eq!(frames.iter().map(Frame::seqno).collect::<Vec<_>>(), vec![4, 5]);
    assert_eq!(*durable.borrow(), 0);
    assert_eq!(*flushing.borrow(), 3, "only the commit in progress is flushing, not what came after it");
    assert!(!second.is_finished());
    // Let the commits through: durable catches up and both return.
    open.send(()).unwrap();
    assert_eq!(first.await.unwrap().unwrap(), Appended { first_seqno: 1, last_seqno: 3 });
    open.send(()).unwrap();
    assert_eq!(second.await.unwrap().unwrap(), Appended { first_seqno: 4, last_seqno: 5 });
    assert_eq!((*durable.borrow(), *written.borrow()), (5, 5));
    assert_eq!(store.inner.bounds(1).unwrap().last_seqno, 5);
    drop(open);
}

/// A WAL lingering up to a minute, after two commits: the first holds one
/// append, the second the two staged while the first was held; every
/// append made with `options`. Returns the WAL, its store and its gate.
async fn after_a_commit_of_two(options: AppendOptions) -> (Wal, Arc<GatedSync>, std::sync::mpsc::Sender<()>) {
    let config = WalConfig { linger: Duration::from_secs(60), ..WalConfig::default() };
    let (wal, store, open) = gated(config, WalMetrics::unregistered());
    let append = |wal: &Wal| {
        let wal = wal.clone();
        tokio::spawn(async move { wal.append_with(1, 1, records(1), options).await })
    };
    let first = append(&wal);
    store.wait_held(1).await;
    let (second, third) = (append(&wal), append(&wal));
    wal.written_watch(1).unwrap().wait_for(|w| *w == 3).await.unwrap();
    // An append is published as written before the sequencer hands it to
    // the persister, under the sequencer's lock: an append refused under
    // that lock (the log is not empty) returns only once the third is
    // handed over, so the next commit cannot start without it.
    let refused = AppendOptions { expected_last: Some(0), ..options };
    assert!(wal.append_with(1, 1, records(1), refused).await.is_err());
    open.send(()).unwrap();
    first.await.unwrap().unwrap();
    store.wait_held(2).await;
    open.send(()).unwrap();
    // Both answered by that one commit (a third would wait at the gate).
    let both = tokio::time::timeout(Duration::from_secs(10), async { (second.await, third.await) })
        .await
        .expect("the second commit held both staged appends");
    let mut seqnos = [both.0.unwrap().unwrap().appended.last_seqno, both.1.unwrap().unwrap().appended.last_seqno];
    seqnos.sort_unstable();
    assert_eq!(seqnos, [2, 3]);
    (wal, store, open)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_persister_lingers_for_the_appenders_its_commit_answered() {
    let (wal, store, open) = after_a_commit_of_two(AppendOptions::default()).await;
    // The previous commit answered two appenders: a lone append waits for
    // the second instead of committing alone...
    let fourth = tokio::spawn({
        let wal = wal.clone();
        async move { wal.append(1, 1, records(1)).await }
    });
    wal.written_watch(1).unwrap().wait_for(|w| *w == 4).await.unwrap();
    let fifth = tokio::spawn({
        let wal = wal.clone();
        async move { wal.append(1, 1, records(1)).await }
    });
    // ... and both go in one commit.
    store.wait_held(3).await;
    open.send(()).unwrap();
    assert_eq!(fourth.await.unwrap().unwrap().last_seqno, 4);
    assert_eq!(fifth.await.unwrap().unwrap().last_seqno, 5);
    assert_eq!(*store.held.borrow(), 3, "the fourth never committed alone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_persister_does_not_linger_for_appenders_answered_later() {
    // A QUORUM leader's appends: their callers wait for followers after the
    // commit, so the commit does not send them back.
    let later = AppendOptions { answered_later: true, ..AppendOptions::default() };
    let (wal, store, open) = after_a_commit_of_two(later).await;
    let fourth = tokio::spawn({
        let wal = wal.clone();
        async move { wal.append_with(1, 1, records(1), later).await }
    });
    // Committed alone, at once (the linger is a minute).
    store.wait_held(3).await;
    open.send(()).unwrap();
    assert_eq!(fourth.await.unwrap().unwrap().appended.last_seqno, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appenders_wait_while_more_than_max_batch_bytes_is_staged() {
    let config = WalConfig { max_batch_bytes: 1000, linger: Duration::ZERO, ..WalConfig::default() };
    let metrics = WalMetrics::unregistered();
    let (wal, _store, open) = gated(config, metrics.clone());
    let mut written = wal.written_watch(1).unwrap();
    let big = |n: usize| vec![NewRecord { key: Bytes::new(), payload: Bytes::from(vec![7u8; n]) }];
    // 1,200 bytes staged while the first commit is held: past the limit.
    let first = tokio::spawn({
        let wal = wal.clone();
        async move { wal.append(1, 1, big(1200)).await }
    });
    written.wait_for(|w| *w == 1).await.unwrap();
    assert!(metrics.staged_bytes.get() > 1000, "staged {}", metrics.staged_bytes.get());
    // The next append waits before it is sequenced: written stays.
    let second = tokio::spawn({
        let wal = wal.clone();
        async move { wal.append(1, 1, big(10)).await }
    });
    // Once it is counted as waiting it is parked before sequencing.
    tokio::time::timeout(Duration::from_secs(10), async {
        while metrics.staged_waits.get() == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the second append waits for staged bytes");
    assert_eq!(*written.borrow(), 1, "sequenced past the staged limit");
    assert_eq!(metrics.staged_waits.get(), 1);
    // The held commit completes: the waiter is sequenced and committed.
    open.send(()).unwrap();
    assert_eq!(first.await.unwrap().unwrap(), Appended { first_seqno: 1, last_seqno: 1 });
    written.wait_for(|w| *w == 2).await.unwrap();
    open.send(()).unwrap();
    assert_eq!(second.await.unwrap().unwrap(), Appended { first_seqno: 2, last_seqno: 2 });
    assert_eq!(metrics.staged_bytes.get(), 0, "everything staged is durable");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncation_waits_for_the_staged_appends_before_it() {
    let (wal, _store, open) = gated(WalConfig::default(), WalMetrics::unregistered());
    let mut written = wal.written_watch(1).unwrap();
    let appended = tokio::spawn({
        let wal = wal.clone();
        async move { wal.append_frames(1, crate::conformance::frames(1, 4, 1)).await }
    });
    written.wait_for(|w| *w == 4).await.unwrap();
    let truncated = tokio::spawn({
        let wal = wal.clone();
        async move { wal.truncate_suffix(1, 2).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!truncated.is_finished(), "the truncation waits for the staged frames");
    open.send(()).unwrap();
    appended.await.unwrap().unwrap();
    truncated.await.unwrap().unwrap();
    let p = wal.positions(1).unwrap();
    assert_eq!((p.last_seqno, p.durable_seqno, *written.borrow()), (2, 2, 2));
    // The next frames continue after the truncation point.
    let resumed = tokio::spawn({
        let wal = wal.clone();
        async move { wal.append_frames(1, crate::conformance::frames(3, 1, 2)).await }
    });
    open.send(()).unwrap();
    assert_eq!(resumed.await.unwrap().unwrap(), Appended { first_seqno: 3, last_seqno: 3 });
    let epochs: Vec<u64> = wal.read(1, 1, 3, usize::MAX).await.unwrap().iter().map(Frame::epoch).collect();
    assert_eq!(epochs, vec![1, 1, 2]);
}

/// Group commit across shards, at scale: appends to a thousand shards
/// staged while one commit is held are made durable by the next commit,
/// one store write and one fsync for all of them, however many shards
/// they touch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_to_a_thousand_shards_staged_during_a_commit_share_the_next_fsync() {
    let metrics = WalMetrics::unregistered();
    let (wal, store, open) = gated(WalConfig::default(), metrics.clone());
    let others: Vec<ShardId> = (2..=1_000).collect();
    wal.create_shards(&others).unwrap();
    let append = |shard| {
        let wal = wal.clone();
        tokio::spawn(async move { wal.append(shard, 1, records(1)).await })
    };
    let first = append(1);
    store.wait_held(1).await;
    // One record on each of the other 999 shards, all staged (written)
    // while the first commit is held.
    let appends: Vec<_> = others.iter().map(|&shard| append(shard)).collect();
    for &shard in &others {
        let mut written = wal.written_watch(shard).unwrap();
        tokio::time::timeout(Duration::from_secs(10), written.wait_for(|w| *w == 1)).await.unwrap().unwrap();
    }
    // An append publishes its frames as written, then hands them to the
    // persister, both under the sequencer lock: once the lock is free, the
    // last one seen written is staged too (else it could miss the next
    // commit and wait at the gate for one of its own).
    drop(wal.sequencer.lock().await);
    assert!(appends.iter().all(|a| !a.is_finished()), "none durable before its commit");
    open.send(()).unwrap();
    assert_eq!(first.await.unwrap().unwrap(), Appended { first_seqno: 1, last_seqno: 1 });
    // The second commit holds all 999: one more syncing write.
    store.wait_held(2).await;
    open.send(()).unwrap();
    for a in appends {
        // Bounded: commits of their own would wait at the gate for ever.
        let appended = tokio::time::timeout(Duration::from_secs(10), a).await.expect("durable in the second commit");
        assert_eq!(appended.unwrap().unwrap(), Appended { first_seqno: 1, last_seqno: 1 });
    }
    assert_eq!(*store.held.borrow(), 2, "two syncing writes for 1,000 appends");
    assert_eq!(metrics.group_commit_records.get_sample_count(), 2);
    assert_eq!(metrics.group_commit_records.get_sample_sum(), 1_000.0);
    for shard in 1..=1_000 {
        assert_eq!(wal.positions(shard).unwrap().durable_seqno, 1, "shard {shard}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_never_passes_flushing_nor_flushing_written() {
    let wal = Wal::start(Arc::new(MemStore::new()), WalConfig::default(), WalMetrics::unregistered()).unwrap();
    wal.create_shard(1).unwrap();
    let mut durable = wal.durable_watch(1).unwrap();
    let flushing = wal.flushing_watch(1).unwrap();
    let written = wal.written_watch(1).unwrap();
    let watcher = tokio::spawn(async move {
        let mut checked = 0;
        while durable.changed().await.is_ok() {
            // Read in this order: each later watch only grows meanwhile.
            let d = *durable.borrow_and_update();
            let f = *flushing.borrow();
            let w = *written.borrow();
            assert!(d <= f && f <= w, "durable {d}, flushing {f}, written {w}");
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

/// The WAL answers the log epoch from memory: it must be the store's, as
/// read when the shard is hosted (a restart, a shard created meanwhile) and
/// after every raise, a lower one ignored.
#[tokio::test]
async fn the_log_epoch_is_the_stores_after_raises_and_restarts() {
    let store = Arc::new(MemStore::new());
    let wal = Wal::start(store.clone(), WalConfig::default(), WalMetrics::unregistered()).unwrap();
    wal.create_shards(&[1, 2]).unwrap();
    assert_eq!((wal.log_epoch(1).unwrap(), wal.log_epoch(2).unwrap()), (0, 0));
    wal.set_log_epoch(1, 4).await.unwrap();
    wal.set_log_epoch(1, 2).await.unwrap();
    wal.set_log_epoch(2, 3).await.unwrap();
    assert_eq!((wal.log_epoch(1).unwrap(), wal.log_epoch(2).unwrap()), (4, 3), "a lower raise is ignored");
    assert!(matches!(wal.log_epoch(9), Err(WalError::Store(StoreError::UnknownShard(9)))));
    wal.shutdown_clean().await.unwrap();
    drop(wal);
    store.crash();
    // Raised in the store while no WAL runs over it (as a migration would):
    // a restarted WAL reads it, and a shard hosted later reads its own.
    store.set_log_epoch(2, 6).unwrap();
    let wal = Wal::start(store.clone(), WalConfig::default(), WalMetrics::unregistered()).unwrap();
    assert_eq!((wal.log_epoch(1).unwrap(), wal.log_epoch(2).unwrap()), (4, 6));
    store.create_shard(3).unwrap();
    store.set_log_epoch(3, 5).unwrap();
    wal.create_shard(3).unwrap();
    assert_eq!(wal.log_epoch(3).unwrap(), 5);
    wal.set_log_epoch(3, 7).await.unwrap();
    assert_eq!((wal.log_epoch(3).unwrap(), store.log_epoch(3).unwrap()), (7, 7));
}

/// The record crc32 path (a damaged frame behind an intact store):
/// a typed, non-fatal error naming the run of bad seqnos, recorded once,
/// trimmed and then cleared by truncations.
#[tokio::test]
async fn a_corrupt_frame_is_a_typed_read_error_recorded_once_and_cleared_by_truncation() {
    let store = Arc::new(MemStore::new());
    let config = WalConfig { tail_cache_bytes: 0, scrub_bytes_per_s: 0, ..WalConfig::default() };
    let metrics = WalMetrics::unregistered();
    let wal = Wal::start(store.clone(), config, metrics.clone()).unwrap();
    wal.create_shard(1).unwrap();
    wal.append(1, 1, records(10)).await.unwrap();
    // A later append evicts 1..=10 from the tail cache: reads go to the store.
    wal.append(1, 1, records(1)).await.unwrap();
    store.corrupt(1, 4);
    store.corrupt(1, 5);
    let err = wal.read(1, 1, 10, usize::MAX).await.unwrap_err();
    assert_eq!(err.corrupt_range(), Some((1, 4, 5)), "{err:?}");
    assert!(matches!(&err, WalError::Store(e) if !e.is_fatal()));
    assert!(wal.read(1, 4, 4, 1).await.unwrap_err().corrupt_range().is_some());
    assert_eq!(wal.read(1, 1, 3, usize::MAX).await.unwrap().len(), 3);
    let found = wal.corruption();
    assert_eq!(found.len(), 1);
    assert_eq!((found[0].first_bad_seqno, found[0].last_bad_seqno, found[0].how), (4, 5, Detection::Read));
    assert_eq!(metrics.corruption_detected.with_label_values(&["read"]).get(), 1, "logged and counted once");
    assert_eq!(metrics.corrupt_records.with_label_values(&["1"]).get(), 2);
    wal.truncate_suffix(1, 4).await.unwrap();
    assert_eq!(wal.shard_corruption(1)[0].last_bad_seqno, 4, "5 is gone, 4 is still there");
    wal.truncate_suffix(1, 3).await.unwrap();
    assert!(wal.corruption().is_empty());
    assert_eq!(metrics.corrupt_records.with_label_values(&["1"]).get(), 0);
    assert_eq!(wal.append(1, 1, records(2)).await.unwrap(), Appended { first_seqno: 4, last_seqno: 5 });
}

/// An unclean restart verifies the tail written since the previous
/// check and the WAL starts with what it found; a clean one does not.
#[tokio::test]
async fn an_unclean_restart_checks_the_tail_and_a_clean_one_does_not() {
    let store = Arc::new(MemStore::new());
    let config = WalConfig { scrub_bytes_per_s: 0, ..WalConfig::default() };
    let wal = Wal::start(store.clone(), config.clone(), WalMetrics::unregistered()).unwrap();
    wal.create_shard(1).unwrap();
    wal.append(1, 1, records(10)).await.unwrap();
    wal.shutdown_clean().await.unwrap();
    store.corrupt(1, 3);
    store.crash(); // A restart after the clean shutdown.
    let wal = Wal::start(store.clone(), config.clone(), WalMetrics::unregistered()).unwrap();
    assert!(wal.corruption().is_empty(), "records checked at the clean shutdown are the scrubber's");
    let report = wal.scrub_now().await.unwrap();
    assert_eq!((report.records, report.new_ranges), (9, 1));
    wal.append(1, 1, records(5)).await.unwrap(); // 11..=15
    store.corrupt(1, 12);
    store.crash(); // Unclean this time.
    let wal = Wal::start(store, config, WalMetrics::unregistered()).unwrap();
    let found = wal.corruption();
    assert_eq!(found.len(), 1, "only the tail since the previous check: {found:?}");
    assert_eq!((found[0].first_bad_seqno, found[0].last_bad_seqno, found[0].how), (12, 12, Detection::Startup));
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

/// Merges of unsealed tails through the WAL with no tails kept in the
/// store take them from the tail cache (or read them back): small appends,
/// a suffix truncation and appends of a new epoch in between (the cache and
/// the store replaced together) read back the same from the store alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tails_merged_from_the_tail_cache_read_back_the_same_from_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let config = crate::EngineStoreConfig { chunk_bytes: 1 << 10, tail_frames_bytes: 0, ..Default::default() };
    let store = Arc::new(EngineStore::open(dir.path(), &config).unwrap());
    let wal = Wal::start(store.clone(), WalConfig::default(), WalMetrics::unregistered()).unwrap();
    for shard in 1..=3 {
        wal.create_shard(shard).unwrap();
    }
    let mut expected: Vec<Frame> = Vec::new();
    for seqno in 1..=150u64 {
        for shard in 1..=3 {
            wal.append_frames(shard, crate::conformance::frames(seqno, 1, 1)).await.unwrap();
        }
        expected.extend(crate::conformance::frames(seqno, 1, 1));
    }
    for shard in 1..=3 {
        wal.truncate_suffix(shard, 120).await.unwrap();
    }
    expected.truncate(120);
    for seqno in 121..=300u64 {
        for shard in 1..=3 {
            wal.append_frames(shard, crate::conformance::frames(seqno, 1, 2)).await.unwrap();
        }
        expected.extend(crate::conformance::frames(seqno, 1, 2));
    }
    for shard in 1..=3 {
        assert_eq!(wal.read_stored(shard, 1, 300, usize::MAX).await.unwrap(), expected, "shard {shard}");
    }
    for shard in 1..=3 {
        assert_eq!(store.read(shard, 1, 300, usize::MAX).unwrap(), expected, "shard {shard}, the store itself");
        assert!(store.chunk_count(shard).unwrap() < 60, "merged into chunks of about a KiB");
    }
}
