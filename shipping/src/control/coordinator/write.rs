//! Writing the leadership state: every change, and every lease renewal,
//! writes the keys it changes (see `control::state` for the layout) in one
//! bucket-wide compare-and-set on the revision this coordinator last wrote
//! or read, so a coordinator whose lease was taken over changes nothing
//! (its revision is stale, whatever key it writes).
//!
//! Writes are *batched* (group commit): a change is applied at once to a
//! working copy (the written state plus the changes queued since), then its
//! caller waits for a write that carries it (the keys that differ between
//! the working copy and the written state). Whoever holds the write lock
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
use crate::control::state::{LEASE_KEY, LEGACY_MARKER, LEGACY_STATE_KEY, Lease, Stored};

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

    /// Writes the keys the working copy changed, with everything queued.
    /// Call with the write lock held.
    async fn flush(&self) {
        // The copy written and the changes it carries, read together: a
        // change applied after the copy was taken is not settled by it.
        let (state, upto, revision, puts) = {
            let mut queued = self.queued.lock();
            let Some(state) = queued.state.clone() else { return };
            let active = self.active.lock();
            let Some(a) = active.as_ref().filter(|a| Instant::now() < a.lease_until) else {
                drop(active);
                queued.settle(Some(Failure::NotActive));
                return;
            };
            let puts = state.changes_from(&a.state);
            (state, queued.applied, a.revision, puts)
        };
        if puts.is_empty() {
            // Every change carried was a no-op: nothing to write.
            self.queued.lock().settle_through(upto, None);
            return;
        }
        self.metrics.state_writes.inc();
        match self.kv.write_batch(revision, puts).await {
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

    /// One round of the lease: the active coordinator renews it (with
    /// whatever is queued); any other reads the lease key and, if the lease
    /// is its own or has run out, reads the whole state and takes it.
    pub(super) async fn lease_round(&self) -> Result<(), CoordError> {
        let _write = self.write.lock().await;
        if self.active.lock().is_some() {
            return self.renew().await;
        }
        let now = now_ms();
        if let Some(entry) = self.kv.get(LEASE_KEY).await? {
            let lease: Lease = serde_json::from_slice(&entry.value)
                .map_err(|e| CoordError::Kv(KvError::Unavailable(format!("KV key {LEASE_KEY}: {e}"))))?;
            self.metrics.lease_term.set(lease.term as i64);
            if lease_action(&lease, &self.id, now) == LeaseAction::Standby {
                self.queued.lock().settle(Some(Failure::NotActive));
                return Ok(());
            }
        }
        self.take_lease().await
    }

    /// Renews the lease this coordinator holds, carrying the queued
    /// changes, fenced on the revision it wrote last.
    async fn renew(&self) -> Result<(), CoordError> {
        let started = Instant::now();
        let lease_until = started + Duration::from_millis(self.lease_ms);
        // With nothing queued only the lease is written, and the state
        // is not copied: at 10,000 shards copying and comparing every
        // record on each renewal was a tenth of an idle coordinator.
        let (next, lease, upto, revision, puts) = {
            let queued = self.queued.lock();
            let active = self.active.lock();
            let Some(a) = active.as_ref() else { return Ok(()) };
            let expires_unix_ms = now_ms() + self.lease_ms;
            match &queued.state {
                Some(working) => {
                    let mut state = working.clone();
                    state.lease.expires_unix_ms = expires_unix_ms;
                    let puts = state.changes_from(&a.state);
                    let lease = state.lease.clone();
                    (Some(state), lease, Some(queued.applied), a.revision, puts)
                }
                None => {
                    let lease = Lease { expires_unix_ms, ..a.state.lease.clone() };
                    let puts = vec![(
                        LEASE_KEY.to_string(),
                        Bytes::from(serde_json::to_vec(&lease).expect("a lease serialises")),
                    )];
                    (None, lease, None, a.revision, puts)
                }
            }
        };
        self.metrics.state_writes.inc();
        match self.kv.write_batch(revision, puts).await {
            Ok(new_revision) => {
                let mut queued = self.queued.lock();
                if let Some(upto) = upto {
                    queued.settle_through(upto, None);
                }
                // The working copy carries the renewed lease too.
                if let Some(working) = queued.state.as_mut() {
                    working.lease = lease.clone();
                }
                drop(queued);
                match next {
                    Some(state) => self.become_active(state, new_revision, lease_until),
                    None => self.renewed(lease, new_revision, lease_until),
                }
                Ok(())
            }
            Err(KvError::Conflict { .. }) => {
                tracing::warn!(id = %self.id, "the KV moved under this coordinator's lease: stepping down to re-read");
                self.step_down();
                self.queued.lock().settle(Some(Failure::NotActive));
                Ok(())
            }
            Err(e) => {
                self.queued.lock().settle(Some(Failure::Kv(e.to_string())));
                Err(e.into())
            }
        }
    }

    /// Reads the whole state and takes the lease (renewing its own after a
    /// step-down, taking over an expired one, or bootstrapping), or
    /// converts the single-value layout of earlier builds.
    async fn take_lease(&self) -> Result<(), CoordError> {
        let started = Instant::now();
        let lease_until = started + Duration::from_millis(self.lease_ms);
        let now = now_ms();
        let snapshot = self.kv.scan().await?;
        let unreadable = |e: String| CoordError::Kv(KvError::Unavailable(e));
        let (mut state, puts_all, converting) = match Stored::decode(&snapshot.entries).map_err(unreadable)? {
            // A new cluster: the bootstrap lease is this coordinator's.
            Stored::Empty => (ClusterState::bootstrap(&self.config, &self.id, now, self.lease_ms), true, false),
            Stored::Legacy(state) => (state, true, true),
            Stored::Current(state) => (state, false, false),
        };
        self.queued.lock().settle(Some(Failure::NotActive));
        match lease_action(&state.lease, &self.id, now) {
            LeaseAction::Standby => {
                self.metrics.lease_term.set(state.lease.term as i64);
                return Ok(());
            }
            LeaseAction::TakeOver => {
                state.lease.term += 1;
                state.lease.holder = self.id.clone();
                tracing::info!(id = %self.id, term = state.lease.term, "taking over the coordinator lease");
            }
            _ => {}
        }
        state.lease.expires_unix_ms = now + self.lease_ms;
        let puts = if puts_all {
            let mut puts = state.to_entries();
            if converting {
                // With the lease, in the last atomic run: once the lease
                // key exists the old value is never read again.
                let lease = puts.pop().expect("the lease is last");
                puts.push((LEGACY_STATE_KEY.to_string(), Bytes::from_static(LEGACY_MARKER.as_bytes())));
                puts.push(lease);
            }
            puts
        } else {
            vec![(LEASE_KEY.to_string(), Bytes::from(serde_json::to_vec(&state.lease).expect("a lease serialises")))]
        };
        self.metrics.state_writes.inc();
        match self.kv.write_batch(snapshot.revision, puts).await {
            Ok(revision) => {
                if converting {
                    tracing::info!(
                        id = %self.id,
                        shards = state.shards.len(),
                        "converted the leadership state from one value to one key per shard"
                    );
                }
                self.become_active(state, revision, lease_until);
                Ok(())
            }
            // Another coordinator wrote in between: read again next round.
            Err(KvError::Conflict { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
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
