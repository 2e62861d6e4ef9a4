//! Writing the leadership state: every change, and every lease renewal, is
//! one compare-and-set of the one state value on the revision this
//! coordinator last wrote or read, so a coordinator whose lease was taken
//! over changes nothing (its revision is stale).
//!
//! Writes are *batched* (group commit): a change is applied at once to a
//! working copy (the written state plus the changes queued since), then its
//! caller waits for a write that carries it. Whoever holds the write lock
//! writes the working copy with everything queued so far, so a hundred
//! failovers at once (a node leading a hundred shards died) share a few KV
//! writes instead of queueing a hundred, and the lease renewal writes
//! whatever is queued along with it instead of waiting behind it.
//!
//! Rules kept here:
//! * a change checks before it changes anything: one that fails leaves the
//!   working copy as it was, and its caller gets its error;
//! * a caller is answered `Ok` only once a write carrying its change
//!   succeeded; a failed write fails every change it carried and every
//!   change queued on top of them (they were decided on a state that was
//!   never written), and the working copy is dropped;
//! * a conflict means another coordinator wrote: this one steps down.

use std::collections::VecDeque;

use super::*;

/// Settled batches remembered for callers that have not looked yet.
const OUTCOMES_KEPT: usize = 256;

/// Changes applied and not yet settled.
#[derive(Default)]
pub(super) struct Queued {
    /// The written state plus every change queued since; none: nothing
    /// queued (a change starts from the written state).
    state: Option<ClusterState>,
    /// Changes applied so far (each gets the next number).
    applied: u64,
    /// Changes settled (written or failed) so far: `1..=settled`.
    settled: u64,
    /// Settled batches: (first, last, why they failed).
    outcomes: VecDeque<(u64, u64, Option<Failure>)>,
}

/// Why a batch failed (kept to answer each change it carried).
#[derive(Debug, Clone)]
enum Failure {
    NotActive,
    Kv(String),
}

impl Failure {
    fn error(&self) -> CoordError {
        match self {
            Failure::NotActive => CoordError::NotActive,
            Failure::Kv(e) => CoordError::Kv(KvError::Unavailable(e.clone())),
        }
    }
}

impl Queued {
    /// Settles every change applied so far.
    fn settle(&mut self, failure: Option<Failure>) {
        self.settle_through(self.applied, failure);
    }

    /// Settles the changes through `upto` (a write carried them); those
    /// applied after stay queued, on top. A failure drops the working copy,
    /// so callers settle everything on one.
    fn settle_through(&mut self, upto: u64, failure: Option<Failure>) {
        if upto > self.settled {
            self.outcomes.push_back((self.settled + 1, upto, failure.clone()));
            while self.outcomes.len() > OUTCOMES_KEPT {
                self.outcomes.pop_front();
            }
            self.settled = upto;
        }
        if failure.is_some() {
            self.state = None;
        }
    }

    /// How change `seq` ended, once settled.
    fn outcome(&self, seq: u64) -> Option<Result<(), CoordError>> {
        if seq > self.settled {
            return None;
        }
        let found = self.outcomes.iter().find(|(first, last, _)| (*first..=*last).contains(&seq));
        Some(match found {
            Some((_, _, None)) => Ok(()),
            Some((_, _, Some(failure))) => Err(failure.error()),
            // Settled so long ago its outcome was dropped: cannot happen
            // while its caller waits (it looks right after the write).
            None => Err(CoordError::Kv(KvError::Unavailable("write outcome lost".into()))),
        })
    }
}

impl Coordinator {
    pub(super) fn encode(state: &ClusterState) -> Bytes {
        Bytes::from(serde_json::to_vec(state).expect("state serialises"))
    }

    /// Applies `change` to the state and returns its output once a write
    /// carrying it succeeded (see the module docs). A change checks first
    /// and changes after: one that returns an error must have changed
    /// nothing (it is applied to the working copy in place; copying the
    /// whole state per change would cost O(shards) each).
    pub(super) async fn mutate<T>(
        &self,
        change: impl FnOnce(&mut ClusterState) -> Result<T, CoordError>,
    ) -> Result<T, CoordError> {
        let (seq, out) = {
            let mut queued = self.queued.lock();
            if queued.state.is_none() {
                let active = self.active.lock();
                let a = active.as_ref().filter(|a| Instant::now() < a.lease_until).ok_or(CoordError::NotActive)?;
                queued.state = Some(a.state.clone());
            }
            let out = change(queued.state.as_mut().expect("set above"))?;
            queued.applied += 1;
            (queued.applied, out)
        };
        let _write = self.write.lock().await;
        if let Some(outcome) = self.queued.lock().outcome(seq) {
            return outcome.map(|()| out);
        }
        self.flush().await;
        let outcome = self.queued.lock().outcome(seq).expect("the flush settled it");
        outcome.map(|()| out)
    }

    /// Writes the working copy with everything queued. Call with the write
    /// lock held.
    async fn flush(&self) {
        // The copy written and the changes it carries, read together: a
        // change applied after the copy was taken is not settled by it.
        let (state, upto, revision) = {
            let mut queued = self.queued.lock();
            let Some(state) = queued.state.clone() else { return };
            let revision = self.active.lock().as_ref().filter(|a| Instant::now() < a.lease_until).map(|a| a.revision);
            let Some(revision) = revision else {
                queued.settle(Some(Failure::NotActive));
                return;
            };
            (state, queued.applied, revision)
        };
        self.metrics.state_writes.inc();
        match self.kv.update(STATE_KEY, Self::encode(&state), revision).await {
            Ok(new_revision) => {
                if let Some(a) = self.active.lock().as_mut()
                    && a.revision == revision
                {
                    // The next reconcile round looks at what changed.
                    let changed =
                        state.shards.iter().filter(|(id, r)| a.state.shards.get(id) != Some(r)).map(|(id, _)| *id);
                    self.pending.lock().shards.extend(changed);
                    a.state = state;
                    a.revision = new_revision;
                }
                self.queued.lock().settle_through(upto, None);
            }
            Err(KvError::Conflict { .. }) => {
                tracing::warn!(id = %self.id, "KV revision moved under this coordinator: stepping down");
                self.step_down();
                self.queued.lock().settle(Some(Failure::NotActive));
            }
            Err(e) => self.queued.lock().settle(Some(Failure::Kv(e.to_string()))),
        }
    }

    pub(super) async fn lease_round(&self) -> Result<(), CoordError> {
        let _write = self.write.lock().await;
        let now = now_ms();
        let started = Instant::now();
        let lease_for = Duration::from_millis(self.lease_ms);
        let Some(entry) = self.kv.get(STATE_KEY).await? else {
            let state = ClusterState::bootstrap(&self.config, &self.id, now, self.lease_ms);
            match self.kv.create(STATE_KEY, Self::encode(&state)).await {
                Ok(revision) => self.become_active(state, revision, started + lease_for),
                Err(KvError::Exists(_)) => {}
                Err(e) => return Err(e.into()),
            }
            return Ok(());
        };
        let read: ClusterState = serde_json::from_slice(&entry.value)
            .map_err(|e| CoordError::Kv(KvError::Unavailable(format!("cluster state: {e}"))))?;
        self.metrics.lease_term.set(read.lease.term as i64);
        let ours = self.active.lock().as_ref().map(|a| a.revision);
        match lease_action(&read.lease, &self.id, now) {
            LeaseAction::Standby => {
                if self.active.lock().is_some() {
                    tracing::warn!(id = %self.id, holder = %read.lease.holder, "another coordinator holds the lease");
                }
                self.step_down();
                self.queued.lock().settle(Some(Failure::NotActive));
            }
            action => {
                // Renewing what this coordinator wrote last: the queued
                // changes go with the renewal. Anything else (a takeover,
                // or the state moved under an active lease) starts from
                // what was read, and the queued changes fail.
                let continuing = action == LeaseAction::Renew && ours == Some(entry.revision);
                let (mut state, upto) = {
                    let mut queued = self.queued.lock();
                    match (continuing, queued.state.clone()) {
                        (true, Some(state)) => (state, Some(queued.applied)),
                        (true, None) => (read, None),
                        (false, _) => {
                            queued.settle(Some(Failure::NotActive));
                            (read, None)
                        }
                    }
                };
                if action == LeaseAction::TakeOver {
                    state.lease.term += 1;
                    state.lease.holder = self.id.clone();
                    tracing::info!(id = %self.id, term = state.lease.term, "taking over the coordinator lease");
                }
                if action == LeaseAction::Renew && ours.is_some_and(|r| r != entry.revision) {
                    tracing::warn!(id = %self.id, "state changed under an active lease: re-reading");
                }
                state.lease.expires_unix_ms = now + self.lease_ms;
                self.metrics.state_writes.inc();
                match self.kv.update(STATE_KEY, Self::encode(&state), entry.revision).await {
                    Ok(revision) => {
                        if let Some(upto) = upto {
                            let mut queued = self.queued.lock();
                            queued.settle_through(upto, None);
                            // The working copy carries the renewed lease too.
                            if let Some(working) = queued.state.as_mut() {
                                working.lease = state.lease.clone();
                            }
                        }
                        self.become_active(state, revision, started + lease_for)
                    }
                    Err(KvError::Conflict { .. }) => {
                        self.step_down();
                        self.queued.lock().settle(Some(Failure::NotActive));
                    }
                    Err(e) => {
                        self.queued.lock().settle(Some(Failure::Kv(e.to_string())));
                        return Err(e.into());
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_learns_its_batchs_outcome() {
        let mut q = Queued { applied: 3, ..Default::default() };
        assert!(q.outcome(1).is_none(), "not settled yet");
        q.settle(None);
        q.applied = 5;
        q.settle(Some(Failure::NotActive));
        assert!(matches!(q.outcome(2), Some(Ok(()))));
        assert!(matches!(q.outcome(4), Some(Err(CoordError::NotActive))));
        assert!(q.outcome(6).is_none());
        assert!(q.state.is_none(), "a failed batch drops the working copy");
    }

    #[test]
    fn a_write_settles_only_what_it_carried() {
        let mut q = Queued { applied: 5, ..Default::default() };
        q.settle_through(3, None);
        assert!(matches!(q.outcome(3), Some(Ok(()))));
        assert!(q.outcome(4).is_none(), "applied after the write's copy: still queued");
        assert_eq!(q.applied, 5);
    }

    #[test]
    fn settling_nothing_records_nothing() {
        let mut q = Queued::default();
        q.settle(None);
        assert!(q.outcomes.is_empty());
    }
}
