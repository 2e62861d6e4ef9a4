//! Reads: from a shard's tail cache when it holds the range, else from the
//! store on a blocking thread, with any damage met recorded.

use super::*;

impl Wal {
    /// Reads frames `[from, to]` (see [`LogStore::read`]) on a blocking
    /// thread. Callers bound `to` by the position they may expose (durable or
    /// committed).
    pub async fn read(&self, shard: ShardId, from: u64, to: u64, max_bytes: usize) -> WalResult<Vec<Frame>> {
        if let Some(frames) = self.shared.shard(shard)?.tail.lock().read(from, to, max_bytes) {
            return Ok(frames);
        }
        self.read_stored(shard, from, to, max_bytes).await
    }

    /// Like [`Wal::read`], but from the store only, never the tail cache
    /// (which holds intact copies of the newest records even when their
    /// stored bytes are damaged): what a cross-replica verify compares.
    /// Records not yet in the store are not returned (a short read).
    pub async fn read_stored(&self, shard: ShardId, from: u64, to: u64, max_bytes: usize) -> WalResult<Vec<Frame>> {
        self.shared.shard(shard)?;
        let shared = self.shared.clone();
        // Frames past the store's last are staged and cached (the cache never
        // evicts them), so a range that missed the cache and runs past the
        // store's end is read up to that end: a short read, as `max_bytes`
        // may also make it. A read that meets damage fails as a whole with
        // the corrupt range (the records before it read with `to` below it)
        // and records the range.
        let what = move || format!("reading shard {shard} [{from}, {to}]");
        read_blocking(shared, what, Detection::Read, move |shared| {
            let stored = shared.store.bounds(shard)?.last_seqno;
            shared.store.read(shard, from, to.min(stored.max(from)), max_bytes)
        })
        .await
    }
}

/// Runs `read` of the store on a blocking thread under [`fatal_on_panic`]
/// (`what` names it), records the damage it meets in the corruption
/// registry as found by `detection`, and ends the process on a storage
/// failure ([`fatal_if`]).
pub(super) async fn read_blocking<T: Send + 'static>(
    shared: Arc<Shared>,
    what: impl Fn() -> String + Send + 'static,
    detection: Detection,
    read: impl FnOnce(&Shared) -> Result<T, StoreError> + Send + 'static,
) -> WalResult<T> {
    tokio::task::spawn_blocking(move || {
        let read = fatal_on_panic(&what, || {
            let generation = shared.corruption.generation();
            let read = read(&shared);
            if let Err(e) = &read {
                shared.corruption.record_error(e, detection, shared.store.location(), generation);
            }
            read
        });
        read.map_err(|e| fatal_if(&what(), e))
    })
    .await
    .map_err(|_| WalError::Closed)?
    .map_err(Into::into)
}
