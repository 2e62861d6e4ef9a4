//! Group commit for epoch raises. A fence or an assignment makes one shard's
//! epoch (or log epoch) durable before it answers; a node losing a leader
//! of thousands of shards gets thousands of them at once. Made one by one,
//! each is a raft-engine write with its own fsync on a blocking thread. Here
//! a raise made while another write is under way waits, and every raise
//! waiting when that write ends goes in the next one: one
//! [`LogStore::raise_many`], one fsync. A lone raise goes at once, alone.
//!
//! Nothing about a raise changes but its write: each is checked and applied
//! by the store exactly as [`LogStore::set_epoch`] would, its caller gets its
//! own outcome, and it is durable when the caller hears `Ok`.

use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::metrics::WalMetrics;
use crate::store::{LogStore, Raise, StoreError, StoreResult};

type Waiting = Vec<(Raise, oneshot::Sender<StoreResult<()>>)>;

/// The raises waiting for a write, and whether a writer is running.
#[derive(Default)]
pub(crate) struct Raises {
    queue: Mutex<Queue>,
}

#[derive(Default)]
struct Queue {
    waiting: Waiting,
    writing: bool,
}

impl Raises {
    /// Makes `raise` durable, together with every raise made meanwhile.
    /// `Err(None)`: the WAL closed before the raise was written (nothing is
    /// known of it).
    pub(crate) async fn raise(
        self: &Arc<Self>,
        store: &Arc<dyn LogStore>,
        metrics: &WalMetrics,
        raise: Raise,
    ) -> Result<(), Option<StoreError>> {
        let (done, outcome) = oneshot::channel();
        let start_writer = {
            let mut queue = self.queue.lock();
            queue.waiting.push((raise, done));
            !std::mem::replace(&mut queue.writing, true)
        };
        if start_writer {
            let writer =
                Writer { raises: self.clone(), store: store.clone(), metrics: metrics.clone(), finished: false };
            tokio::task::spawn_blocking(move || writer.run());
        }
        match outcome.await {
            Ok(result) => result.map_err(Some),
            Err(_) => Err(None),
        }
    }
}

/// Writes every waiting raise, batch after batch, until none waits. If it
/// is dropped before (its task never ran: the runtime is shutting down),
/// the waiting raises are dropped with it and their callers hear that the
/// WAL closed, and the next raise starts a writer of its own.
struct Writer {
    raises: Arc<Raises>,
    store: Arc<dyn LogStore>,
    metrics: WalMetrics,
    /// Set as it gives up the writer's place (under the queue's lock): a
    /// writer started after it must not be disturbed by its drop.
    finished: bool,
}

impl Writer {
    fn run(mut self) {
        loop {
            let batch = {
                let mut queue = self.raises.queue.lock();
                if queue.waiting.is_empty() {
                    queue.writing = false;
                    self.finished = true;
                    return;
                }
                std::mem::take(&mut queue.waiting)
            };
            let (raises, callers): (Vec<Raise>, Vec<_>) = batch.into_iter().unzip();
            let what = || format!("recording {} epoch raise(s), the first {:?}", raises.len(), raises[0]);
            let outcomes = crate::wal::fatal_on_panic(what, || self.store.raise_many(&raises));
            debug_assert_eq!(outcomes.len(), raises.len());
            self.metrics.epoch_raises.inc_by(raises.len() as u64);
            self.metrics.epoch_writes.inc();
            for (caller, outcome) in callers.into_iter().zip(outcomes) {
                let _ = caller.send(outcome);
            }
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let mut queue = self.raises.queue.lock();
        if queue.writing {
            queue.waiting.clear();
            queue.writing = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::MemStore;
    use crate::store::Counter;

    fn setup(shards: u32) -> (Arc<Raises>, Arc<dyn LogStore>, WalMetrics) {
        let store = Arc::new(MemStore::new());
        for shard in 1..=shards {
            store.create_shard(shard).unwrap();
        }
        (Arc::default(), store, WalMetrics::unregistered())
    }

    /// Stands in for a write under way: raises made now queue.
    fn occupy(raises: &Raises) {
        assert!(!std::mem::replace(&mut raises.queue.lock().writing, true));
    }

    async fn wait_queued(raises: &Raises, n: usize) {
        while raises.queue.lock().waiting.len() < n {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    fn spawn_raises(
        raises: &Arc<Raises>,
        store: &Arc<dyn LogStore>,
        metrics: &WalMetrics,
        shards: impl Iterator<Item = u32>,
    ) -> Vec<tokio::task::JoinHandle<Result<(), Option<StoreError>>>> {
        shards
            .map(|shard| {
                let (raises, store, metrics) = (raises.clone(), store.clone(), metrics.clone());
                tokio::spawn(async move {
                    raises
                        .raise(&store, &metrics, Raise { shard, counter: Counter::Epoch, value: 10 + shard as u64 })
                        .await
                })
            })
            .collect()
    }

    #[tokio::test]
    async fn raises_made_during_a_write_share_the_next_one_and_each_gets_its_own_outcome() {
        let (raises, store, metrics) = setup(100);
        occupy(&raises);
        // Shards 1..=100 are hosted, 101 is not.
        let calls = spawn_raises(&raises, &store, &metrics, 1..=101);
        wait_queued(&raises, 101).await;
        assert_eq!(metrics.epoch_writes.get(), 0, "nothing is written while the write under way runs");
        // The write under way ends: its writer takes the queue.
        raises.queue.lock().writing = false;
        let writer = Writer { raises: raises.clone(), store: store.clone(), metrics: metrics.clone(), finished: false };
        tokio::task::spawn_blocking(move || writer.run()).await.unwrap();
        for (i, call) in calls.into_iter().enumerate() {
            let shard = i as u32 + 1;
            match call.await.unwrap() {
                Ok(()) if shard <= 100 => assert_eq!(store.epoch(shard).unwrap(), 10 + shard as u64),
                Err(Some(StoreError::UnknownShard(101))) if shard == 101 => {}
                other => panic!("shard {shard}: {other:?}"),
            }
        }
        assert_eq!(metrics.epoch_writes.get(), 1, "101 raises made during one write go in one");
        assert_eq!(metrics.epoch_raises.get(), 101);
        // A lone raise goes at once, alone.
        raises.raise(&store, &metrics, Raise { shard: 1, counter: Counter::LogEpoch, value: 4 }).await.unwrap();
        assert_eq!(store.log_epoch(1).unwrap(), 4);
        assert_eq!(metrics.epoch_writes.get(), 2);
    }

    #[tokio::test]
    async fn a_writer_dropped_before_it_ran_fails_its_raises_as_closed_and_the_next_raise_still_goes() {
        let (raises, store, metrics) = setup(3);
        occupy(&raises);
        let calls = spawn_raises(&raises, &store, &metrics, 1..=3);
        wait_queued(&raises, 3).await;
        drop(Writer { raises: raises.clone(), store: store.clone(), metrics: metrics.clone(), finished: false });
        for call in calls {
            assert!(matches!(call.await.unwrap(), Err(None)), "a raise never written is reported as the WAL closed");
        }
        assert_eq!(store.epoch(1).unwrap(), 0, "nothing was written");
        raises.raise(&store, &metrics, Raise { shard: 1, counter: Counter::Epoch, value: 2 }).await.unwrap();
        assert_eq!(store.epoch(1).unwrap(), 2, "the next raise starts a writer of its own");
    }
}
