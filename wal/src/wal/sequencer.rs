//! The WAL's sequencer: seqno assignment, run by the appenders themselves
//! under the WAL's sequencer lock (see [`Sequencer`]).

use super::*;

/// Seqno assignment, run by the appenders themselves under the WAL's
/// sequencer lock: it validates an append, gives it seqnos, encodes its
/// frames, publishes them as *written* (tail cache, then the written watch)
/// and stages them for the [`Persister`]. It never waits for storage, except
/// for a truncation or a compaction, which first wait for everything staged
/// before them.
pub(super) struct Sequencer {
    pub(super) shared: Arc<Shared>,
    pub(super) to_persister: flume::Sender<Staged>,
    pub(super) config: WalConfig,
    /// Next seqno per shard, counting everything sequenced; read from the
    /// store the first time a shard is seen and after a control operation.
    pub(super) next: HashMap<ShardId, u64>,
    /// Leader-path records sequenced so far (for the injected fault).
    pub(super) leader_records: u64,
}

/// What a sequenced append answers with once durable.
pub(super) enum Sequenced {
    /// Written: the seqnos, once durable.
    Staged(oneshot::Receiver<WalResult<Appended>>),
    /// A producer's duplicate: the original seqnos, answered once
    /// everything staged before it is durable.
    Duplicate(Appended, oneshot::Receiver<()>),
    /// A batch whose prefix survived a failover: the rest is written and the
    /// answer starts at the prefix's first seqno.
    Prefixed(u64, oneshot::Receiver<WalResult<Appended>>),
}

/// `None` only for the injected fault, after which nothing is sequenced
/// again.
pub(super) type SequenceResult = WalResult<Option<Sequenced>>;

impl Sequencer {
    fn next_seqno(&mut self, shard: ShardId) -> Result<u64, StoreError> {
        if let Some(next) = self.next.get(&shard) {
            return Ok(*next);
        }
        let next = self.shared.store.bounds(shard)?.last_seqno + 1;
        self.next.insert(shard, next);
        Ok(next)
    }

    /// Leader path: the producer rules and the expected last seqno are
    /// checked, then the records (those not written before) get the
    /// shard's next seqnos.
    pub(super) fn append(
        &mut self,
        shard: ShardId,
        epoch: u64,
        records: &[NewRecord],
        options: AppendOptions,
    ) -> SequenceResult {
        let positions = self.shared.shard(shard)?;
        let promised = positions.min_epoch.load(Ordering::Acquire);
        if epoch < promised {
            return Err(WalError::StaleEpoch { shard, epoch, promised });
        }
        let first = self.next_seqno(shard)?;
        let now = now_us();
        let mut skip = 0;
        let mut prefix_first = None;
        if let Some(producer) = options.producer {
            let mut state = positions.producers.lock();
            if let Some(why) = &state.damaged {
                return Err(WalError::ProducersUnavailable { shard, why: why.clone() });
            }
            if state.table.applied_through() + 1 != first {
                return Err(WalError::ProducersUnavailable {
                    shard,
                    why: format!("its table is at seqno {}, the log at {}", state.table.applied_through(), first - 1),
                });
            }
            let decision = state
                .table
                .check(&self.shared.producer_limits, producer.id, producer.epoch, producer.sequence, records.len(), now)
                .map_err(|refusal| WalError::Producer { shard, refusal })?;
            match decision {
                Decision::Duplicate { first_seqno, last_seqno } => {
                    state.duplicates += 1;
                    let (done, durable) = oneshot::channel();
                    // If the persister is gone the sender is dropped and the
                    // appender hears `Closed`.
                    let _ = self.to_persister.send(Staged::Barrier(done));
                    return Ok(Some(Sequenced::Duplicate(Appended { first_seqno, last_seqno }, durable)));
                }
                Decision::Write { skip: s, prefix_first_seqno } => {
                    skip = s;
                    prefix_first = prefix_first_seqno;
                }
            }
        }
        // A retry whose prefix a failover left in the log is judged where
        // that prefix was written: the condition held there, and saying
        // "not written" now would hide the prefix.
        let judged_at = prefix_first.map_or(first, |p| p);
        if let Some(expected) = options.expected_last
            && expected != judged_at - 1
        {
            return Err(WalError::ExpectedLast { shard, expected, last: first - 1 });
        }
        let frames: Vec<Frame> = records[skip..]
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let fields = RecordFields {
                    seqno: first + i as u64,
                    epoch,
                    timestamp_us: now,
                    key: &r.key,
                    payload: &r.payload,
                };
                let stamp = options.producer.map(|p| ProducerStamp { sequence: p.sequence + (skip + i) as u64, ..p });
                Frame::encode_stamped(fields, stamp)
            })
            .collect();
        Ok(self.stage(shard, frames, true, !options.answered_later).map(|durable| match prefix_first {
            Some(first) => Sequenced::Prefixed(first, durable),
            None => Sequenced::Staged(durable),
        }))
    }

    /// Follower path: the frames carry the leader's seqnos and must continue
    /// the shard's log exactly.
    pub(super) fn append_frames(&mut self, shard: ShardId, frames: Vec<Frame>) -> SequenceResult {
        let next = self.next_seqno(shard)?;
        crate::store::check_continues(shard, next, &frames)?;
        // The persister lingers for replicated frames (see `WalConfig::linger`).
        Ok(self.stage(shard, frames, false, true).map(Sequenced::Staged))
    }

    /// Applies staged frames to the shard's producer table and says which
    /// snapshots to write with them: an empty one just before the first
    /// stamped record a shard ever gets (so that a shard without snapshots
    /// holds no stamped record), then one every
    /// [`WalConfig::producer_snapshot_bytes`] of frames.
    fn apply_producers(&self, shard: ShardId, frames: &[Frame]) -> SnapshotChanges {
        let mut changes = SnapshotChanges::default();
        let Ok(positions) = self.shared.shard(shard) else { return changes };
        let limits = &self.shared.producer_limits;
        let mut state = positions.producers.lock();
        let first = frames.first().map_or(0, Frame::seqno);
        if state.damaged.is_some() {
            return changes;
        }
        if state.table.applied_through() + 1 != first {
            state.damaged = Some(format!(
                "records from seqno {first} arrived while its table was at seqno {}",
                state.table.applied_through()
            ));
            return changes;
        }
        let stamped = frames.iter().position(|f| f.producer().is_some());
        if let Some(at) = stamped
            && state.snapshots.is_empty()
        {
            debug_assert!(state.table.is_empty(), "a shard without snapshots holds no stamped record");
            let before = frames[at].seqno() - 1;
            let mut empty = ProducerTable::empty_at(first - 1);
            for frame in &frames[..at] {
                empty.apply(limits, frame);
            }
            changes.put.push((shard, before, empty.encode(limits)));
            state.snapshots.push(before);
            state.since_snapshot = 0;
        }
        let forgot = state.table.forgot();
        for frame in frames {
            state.table.apply(limits, frame);
            state.since_snapshot += frame.len() as u64;
        }
        let now = state.table.forgot();
        let metrics = &self.shared.metrics;
        metrics.producers_forgotten.with_label_values(&["expired"]).inc_by(now.expired - forgot.expired);
        metrics.producers_forgotten.with_label_values(&["evicted"]).inc_by(now.evicted - forgot.evicted);
        if !state.snapshots.is_empty() && state.since_snapshot >= self.config.producer_snapshot_bytes {
            let last = state.table.applied_through();
            if let Some(now_us) = frames.last().map(Frame::timestamp_us) {
                state.table.sweep(limits, now_us);
            }
            changes.put.push((shard, last, state.table.encode(limits)));
            state.snapshots.push(last);
            state.since_snapshot = 0;
            if state.snapshots.len() > PRODUCER_SNAPSHOTS_KEPT {
                changes.drop.push((shard, state.snapshots.remove(1)));
            }
        }
        changes
    }

    /// Publishes contiguous, validated frames as written and stages them;
    /// the persister lingers for more like it if `lingers`
    /// (`WalConfig::linger`).
    fn stage(
        &mut self,
        shard: ShardId,
        frames: Vec<Frame>,
        leader: bool,
        lingers: bool,
    ) -> Option<oneshot::Receiver<WalResult<Appended>>> {
        let (Some(first), Some(last)) = (frames.first().map(Frame::seqno), frames.last().map(Frame::seqno)) else {
            unreachable!("appends are checked non-empty");
        };
        if leader && self.config.fault_unwritten_batch_after.is_some_and(|after| self.leader_records >= after) {
            self.inject_unwritten(shard, &frames);
            return None;
        }
        if leader {
            self.leader_records += frames.len() as u64;
        }
        self.next.insert(shard, last + 1);
        let snapshots = self.apply_producers(shard, &frames);
        // Counted as staged before anyone can see them written: whoever sees
        // `written` move also sees the bytes it stands for.
        self.shared.staged.add(frames.iter().map(Frame::len).sum());
        self.shared.metrics.queue_depth.inc();
        // Replicated frames are slices of the message they came in: the
        // cache, which may keep them for long, gets copies of its own.
        self.publish_written(shard, &frames, !leader);
        let (reply, durable) = oneshot::channel();
        let waiter = Waiter { reply, appended: Appended { first_seqno: first, last_seqno: last }, lingers };
        // If the persister is gone the waiter is dropped with the message,
        // and the appender hears `Closed`.
        let _ = self.to_persister.send(Staged::Frames { shard, frames, waiter, snapshots });
        Some(durable)
    }

    /// Waits until everything staged so far is durable.
    pub(super) async fn drain(&self) {
        let (done, wait) = oneshot::channel();
        if self.to_persister.send(Staged::Barrier(done)).is_ok() {
            let _ = wait.await;
        }
    }

    /// After a truncation or compaction (everything before it durable): the
    /// shard's next seqno is read from the store again and every position
    /// is published as the store has it.
    pub(super) fn after_control(&mut self, shard: ShardId, result: Result<(), StoreError>) -> WalResult<()> {
        self.next.remove(&shard);
        match result {
            Ok(()) => {
                match (self.shared.shard(shard), self.shared.store.bounds(shard)) {
                    (Ok(positions), Ok(bounds)) => positions.publish(bounds),
                    (_, Err(e)) => {
                        fatal_if(&format!("reading shard {shard}'s positions"), e);
                    }
                    _ => {}
                }
                Ok(())
            }
            Err(e) => Err(fatal_if(&format!("truncating or compacting shard {shard}"), e).into()),
        }
    }

    /// Puts the frames in the shard's tail cache (copies of them when
    /// `detach`, see [`Frame::detached`]) and moves its written watch to the
    /// last one.
    fn publish_written(&self, shard: ShardId, frames: &[Frame], detach: bool) {
        if let Ok(positions) = self.shared.shard(shard) {
            let stored = positions.last.load(Ordering::Acquire);
            positions.tail.lock().push(frames, stored, detach);
            if let Some(last) = frames.last() {
                positions.publish_written(last.seqno());
            }
        }
    }

    /// The injected fault (see [`WalConfig::fault_unwritten_batch_after`]):
    /// the frames are shipped as if written, never reach the store, and the
    /// process dies as a machine crash would.
    fn inject_unwritten(&self, shard: ShardId, frames: &[Frame]) {
        let records = frames.len();
        tracing::error!(records, "injected fault: publishing records as written without writing them");
        self.publish_written(shard, frames, false);
        std::thread::spawn(move || {
            std::thread::sleep(UNWRITTEN_FAULT_GRACE);
            eprintln!("walship: injected fault: aborting with {records} records shipped but never written");
            std::process::abort();
        });
    }
}
