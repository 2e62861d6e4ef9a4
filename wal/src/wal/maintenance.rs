//! Everything but appends and reads: what changes a shard's log other than
//! appends ([`Wal::truncate_suffix`], [`Wal::compact_prefix`]), damage (the
//! corruption registry's answers, scrubbing, verifying and locating
//! records), the background scrubber, and a clean shutdown.

use super::*;

impl Wal {
    /// Removes every record after `keep_through`, in order with appends.
    /// Known damage after it leaves the corruption registry: truncating to
    /// `first_bad_seqno - 1` is how a corrupt range is repaired (then the
    /// replica's copy is appended).
    /// The shard's producer table is rebuilt as of `keep_through` (from its
    /// newest snapshot at or before it and the records after that).
    pub async fn truncate_suffix(&self, shard: ShardId, keep_through: u64) -> WalResult<()> {
        self.control(shard, move |shared| {
            if let Ok(p) = shared.shard(shard) {
                p.tail.lock().truncate(keep_through);
            }
            shared.store.truncate_suffix(shard, keep_through)?;
            if let Ok(p) = shared.shard(shard) {
                let mut state = p.producers.lock();
                let last = shared.store.bounds(shard)?.last_seqno;
                if state.damaged.is_some() || state.table.applied_through() != last {
                    let duplicates = state.duplicates;
                    *state = rebuild_producers(shared.store.as_ref(), &shared.producer_limits, shard, last)?;
                    state.duplicates = duplicates;
                }
            }
            Ok(())
        })
        .await?;
        // Only once the positions say the records are gone: a reader seeing
        // no damage then never sees the old, longer log with it (a repair
        // looked finished before its refetch began).
        self.shared.corruption.truncated(shard, keep_through);
        Ok(())
    }

    /// Discards durable records before `first_kept`, in order with appends,
    /// and returns the shard's first seqno after it. Known damage before it
    /// leaves the corruption registry.
    ///
    /// Once producers have written to the shard, compaction stops at its
    /// newest producer snapshot at or before `first_kept - 1` (one is taken
    /// every [`WalConfig::producer_snapshot_bytes`]): the table must be rebuildable
    /// from a snapshot and the records after it, so a compaction may keep
    /// up to that much more than asked.
    pub async fn compact_prefix(&self, shard: ShardId, first_kept: u64) -> WalResult<u64> {
        let first = std::sync::Arc::new(AtomicU64::new(0));
        let answer = first.clone();
        self.control(shard, move |shared| {
            let p = shared.shard(shard).map_err(|_| StoreError::UnknownShard(shard))?;
            let mut state = p.producers.lock();
            // The newest snapshot at or before `first_kept - 1`; none when
            // every snapshot is newer (the records before the oldest hold no
            // stamp) or there is none (no record holds one).
            let retained_from = shared.store.bounds(shard)?.first_seqno;
            let to = match state.snapshots.iter().rev().find(|s| **s < first_kept).copied() {
                None => first_kept,
                // Compaction stops at it, keeping at most one snapshot
                // interval more than asked.
                Some(snapshot) if snapshot + 1 > retained_from => first_kept.min(snapshot + 1),
                // Stopping there would compact nothing: the table as of
                // `first_kept - 1` is built from it and the records after it
                // (those about to go), and kept as a snapshot.
                Some(snapshot) => {
                    let limits = &shared.producer_limits;
                    let stored = shared.store.producer_snapshots(shard)?;
                    let bytes = stored.iter().find(|(s, _)| *s == snapshot).map(|(_, b)| b.clone());
                    let table = match bytes.map(|b| ProducerTable::decode(&b)) {
                        Some(Ok(table)) if table.applied_through() == snapshot => Some(table),
                        // A damaged snapshot: everything after it is kept.
                        _ => None,
                    };
                    let replayed = match table {
                        Some(mut table) => replay(shared.store.as_ref(), limits, shard, &mut table, first_kept - 1)?
                            .map(|_| table),
                        None => Err(format!("the producer snapshot at seqno {snapshot} is damaged")),
                    };
                    match replayed {
                        Ok(table) => {
                            let put = vec![(shard, first_kept - 1, table.encode(limits))];
                            shared.store.append_with_snapshots(&[], &SnapshotChanges { put, drop: Vec::new() }, true)?;
                            shared.metrics.producer_snapshots.inc();
                            let at = state.snapshots.partition_point(|s| *s < first_kept - 1);
                            if state.snapshots.get(at) != Some(&(first_kept - 1)) {
                                state.snapshots.insert(at, first_kept - 1);
                            }
                            first_kept
                        }
                        Err(why) => {
                            tracing::warn!(shard, first_kept, %why, "compaction held back: the producer table cannot be rebuilt past the damage");
                            snapshot + 1
                        }
                    }
                }
            };
            shared.store.compact_prefix(shard, to)?;
            state.snapshots.retain(|s| s + 1 >= to);
            drop(state);
            shared.corruption.compacted(shard, to);
            p.tail.lock().compact(to);
            first.store(shared.store.bounds(shard)?.first_seqno, Ordering::Release);
            Ok(())
        })
        .await?;
        Ok(answer.load(Ordering::Acquire))
    }

    /// Every corrupt range known now, by shard then seqno.
    /// Whether the store's recovery cut damaged records away when it
    /// opened (ERROR logged, `walship_wal_corruption_detected_total{how=
    /// "recovery"}`): records that had been durable here are gone, and
    /// maybe the newest epoch a shard promised with them. Every replica on
    /// this node then waits for its coordinator to assign it again before
    /// it takes anything from a leader.
    pub fn recovery_cut(&self) -> bool {
        self.shared.recovery_cut
    }

    pub fn corruption(&self) -> Vec<CorruptRange> {
        self.shared.corruption.all()
    }

    /// One shard's corrupt ranges known now, by seqno.
    pub fn shard_corruption(&self, shard: ShardId) -> Vec<CorruptRange> {
        self.shared.corruption.shard(shard)
    }

    /// Runs one scrub pass over every shard's durable log now, on a blocking
    /// thread, at the configured rate (unthrottled when the background
    /// scrubber is disabled: someone asked for this pass), and returns what
    /// it did. Damage goes into the registry as [`Detection::Scrub`].
    pub async fn scrub_now(&self) -> WalResult<ScrubReport> {
        let shared = self.shared.clone();
        tokio::task::spawn_blocking(move || {
            crate::corruption::scrub_pass(
                shared.store.as_ref(),
                &shared.corruption,
                &shared.metrics,
                shared.scrub_bytes_per_s,
            )
        })
        .await
        .map_err(|_| WalError::Closed)
    }

    /// The store file holding record `seqno` of `shard`, if the store keeps
    /// files and can tell (reads the store's metadata, on a blocking thread).
    pub async fn locate(&self, shard: ShardId, seqno: u64) -> Option<std::path::PathBuf> {
        let shared = self.shared.clone();
        tokio::task::spawn_blocking(move || shared.store.locate(shard, seqno)).await.ok().flatten()
    }

    /// Verifies `[from, to]` of `shard` against the store itself, never the
    /// in-memory tail cache (which holds intact copies of the newest
    /// records even when their stored bytes are damaged), recording damage
    /// as found by a scrub. For drills and checks of one range; the
    /// background scrubber covers the whole log.
    pub async fn verify_range(&self, shard: ShardId, from: u64, to: u64) -> WalResult<()> {
        let shared = self.shared.clone();
        let what = move || format!("verifying shard {shard} [{from}, {to}]");
        read_blocking(shared, what, Detection::Scrub, move |shared| {
            shared.store.read(shard, from, to, usize::MAX).map(|_| ())
        })
        .await
    }

    /// Graceful shutdown: waits until everything sequenced is durable, then
    /// records a clean shutdown in the store, so the next start skips the
    /// tail check. Nothing is sequenced after it: later appends wait
    /// forever (the process is exiting).
    pub async fn shutdown_clean(&self) -> WalResult<()> {
        let sequencer = self.sequencer.clone().lock_owned().await;
        sequencer.drain().await;
        let store = self.shared.store.clone();
        tokio::task::spawn_blocking(move || store.mark_clean_shutdown()).await.map_err(|_| WalError::Closed)??;
        // Keep the lock: nothing may be written after the marker.
        std::mem::forget(sequencer);
        Ok(())
    }

    /// Runs a truncation or compaction once everything sequenced before it
    /// is durable, holding the sequencer lock until its positions are
    /// published (on a blocking thread, so a dropped caller cannot leave it
    /// half done).
    async fn control(
        &self,
        shard: ShardId,
        op: impl FnOnce(&Shared) -> Result<(), StoreError> + Send + 'static,
    ) -> WalResult<()> {
        self.shared.shard(shard)?;
        let mut sequencer = self.sequencer.clone().lock_owned().await;
        sequencer.drain().await;
        tokio::task::spawn_blocking(move || {
            let result = fatal_on_panic(|| format!("truncating or compacting shard {shard}"), || op(&sequencer.shared));
            sequencer.after_control(shard, result)
        })
        .await
        .map_err(|_| WalError::Closed)?
    }
}

/// The background scrubber: a pass at start, then one every `interval` from
/// the start of the previous one, until the WAL is dropped (`stop` then
/// disconnects). Holds the WAL only during a pass.
pub(super) fn scrubber(shared: std::sync::Weak<Shared>, stop: flume::Receiver<()>, interval: Duration) {
    loop {
        let started = Instant::now();
        {
            let Some(shared) = shared.upgrade() else { return };
            crate::corruption::scrub_pass(
                shared.store.as_ref(),
                &shared.corruption,
                &shared.metrics,
                shared.scrub_bytes_per_s,
            );
        }
        if let Err(flume::RecvTimeoutError::Disconnected) = stop.recv_deadline(started + interval) {
            return;
        }
    }
}
