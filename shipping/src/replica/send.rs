//! The leader side of replication: a driver per leadership folds the WAL's
//! positions into the leader core, and one shipper per follower asks the
//! core what to send, keeps up to `ship_window` pushes in flight and feeds
//! the replies back. Pushes to one follower node travel over one stream
//! (`ship_stream.rs`).
//!
//! Invariants kept here: only records in the leader's own log are shipped
//! (durable ones, or written ones with early shipping); a reply counts only
//! through [`LeaderCore::on_reply`](crate::core::leader::LeaderCore::on_reply);
//! a reply revealing a newer epoch deposes the leader (the rules decide,
//! `leadership::step_down` performs it); a push not answered within
//! `ship_timeout_ms` counts as failed.

use std::sync::Arc;
use std::time::Duration;

use walship_proto::replication::{ShipSegmentRequest, WalSegmentId};
use walship_wal::Segment;
use walship_wal::position as watch;

use super::error::{APPLIED_METADATA_KEY, EPOCH_METADATA_KEY, metadata_u64, refused_by_replica};
use super::probe::{NOT_MY_TURN_US, PROBE_FAILURES_BEFORE_BACKOFF, PeerProbe, probe_backoff_us};
use super::pushes::{Outcome, Pushes, Sent};
use super::shard::{LeaderState, ShardReplica};
use super::ship_stream::{SHIP_STREAM_DEPTH, run_ship_stream};
use super::{ReplicationNode, now_us};
use crate::NodeId;
use crate::core::leader::{ShipDecision, ShipReply};
use crate::core::{Epoch, Seqno};

/// Waits for a change of `watch` (false once its sender is gone); never
/// resolves without a watch.
async fn changed_if_watched(watch: Option<&mut watch::Receiver>) -> bool {
    match watch {
        Some(w) => w.changed().await.is_ok(),
        None => std::future::pending().await,
    }
}

impl ReplicationNode {
    /// Folds the leader's own WAL positions into its core: durable ones,
    /// and with early shipping the flushing ones too (what the WAL is
    /// committing), so shippers send a batch while the leader's fsync of it
    /// still runs. Written positions, which move with every append, are
    /// read by the shippers themselves (see [`ReplicationNode::run_shipper`]).
    pub(super) async fn run_leader_driver(self: Arc<Self>, replica: Arc<ShardReplica>, leader: Arc<LeaderState>) {
        let Ok(mut durable) = self.wal.durable_watch(replica.shard) else { return };
        let mut flushing = if self.early_shipping() { self.wal.flushing_watch(replica.shard).ok() } else { None };
        // Made once: a cancellation future made anew on every wake-up locks
        // the token's node to look at it (per commit of every shard).
        let stopped = leader.stop.cancelled();
        tokio::pin!(stopped);
        loop {
            let committing = flushing.as_mut().map(|f| *f.borrow_and_update());
            let seqno = *durable.borrow_and_update();
            let counters = self.wal.counters(replica.shard).unwrap_or_default();
            let limit = {
                let mut core = leader.core.lock();
                if let Some(committing) = committing {
                    core.on_local_written(Seqno(committing));
                    core.on_local_flushing(Seqno(committing));
                }
                core.on_local_durable(Seqno(seqno), counters.records, counters.bytes, now_us());
                replica.publish_leader(&core, &self.metrics);
                core.flushing().0
            };
            leader.ship_limit.send_if_modified(|l| std::mem::replace(l, limit) != limit);
            tokio::select! {
                changed = durable.changed() => if changed.is_err() { return },
                open = changed_if_watched(flushing.as_mut()) => if !open { return },
                _ = &mut stopped => return,
            }
        }
    }

    /// CheckQuorum: waits for this leadership's lease to run out without a
    /// majority answering in time (see `LeaderCore::lease_until`), then
    /// steps down once it has stayed out for one more lease; ends with the
    /// leadership.
    ///
    /// Appends stop being acknowledged the moment the lease lapses (the
    /// safety rule, kept by the append path); the step-down is liveness, and
    /// waits a further lease so that a node that answers late for a moment
    /// (thousands of shards starting on two cores) renews its shards'
    /// leases instead of making them all step down and churn. A leader cut
    /// off from its followers is replaced by the coordinator meanwhile (its
    /// followers report it silent).
    ///
    /// Nor does it step down while the nodes of a majority still answer this
    /// node within the last lease (any shard's traffic: `contact.rs`): it
    /// keeps waiting, looking again every lease, and acknowledges nothing
    /// until its own followers answer again.
    pub(super) async fn run_lease_watch(self: Arc<Self>, replica: Arc<ShardReplica>, leader: Arc<LeaderState>) {
        let grace = self.config.replication.replication_timeout().as_micros() as u64;
        let mut lease = replica.lease_until.subscribe();
        let stopped = leader.stop.cancelled();
        tokio::pin!(stopped);
        loop {
            // Quiet followers: their links' contact counts first.
            self.fold_quiet(&replica, &leader);
            let until = *lease.borrow_and_update();
            let now = now_us();
            let lapsed = until != u64::MAX && now >= until;
            let step_down_at = until.saturating_add(grace);
            let (holds, had_majority, held_by_quiet, nodes_answer) = {
                let core = leader.core.lock();
                let quiet = leader.quiet.lock().keys().copied().collect::<Vec<_>>();
                let held_by_quiet = !quiet.is_empty() && core.lease_held_by(quiet.into_iter());
                let nodes_answer =
                    core.nodes_reach_majority(|n| self.contact.answered_at(n), now.saturating_sub(grace));
                (core.lease_holds(now), core.had_majority(), held_by_quiet, nodes_answer)
            };
            let due = lapsed && now >= step_down_at && !holds && had_majority;
            if due && !nodes_answer {
                self.metrics.check_quorum.with_label_values(&["stepped_down"]).inc();
                break;
            }
            if due {
                self.metrics.check_quorum.with_label_values(&["held"]).inc();
            }
            // Lapsed before any majority answered: wait for one (a renewal
            // changes the lease) rather than step down at start. Held by
            // quiet followers: their links keep it, and wake them (which
            // wakes this watch) once they cannot; no per-shard timer.
            let wait = if due {
                Duration::from_micros(grace)
            } else if until == u64::MAX || (lapsed && !had_majority) || (holds && held_by_quiet) {
                Duration::MAX
            } else {
                Duration::from_micros(step_down_at.saturating_sub(now))
            };
            // A renewal matters only to a watch with no deadline: one with
            // a deadline looks at the lease again when it comes (every
            // reply renews the lease, and woke this watch: thousands of
            // wake-ups a second over many busy shards).
            tokio::select! {
                _ = tokio::time::sleep(wait.min(Duration::from_secs(3600))), if wait != Duration::MAX => {}
                changed = lease.changed(), if wait == Duration::MAX => if changed.is_err() { return },
                _ = leader.quiet_changed.notified() => {}
                _ = &mut stopped => return,
            }
        }
        if leader.stop.is_cancelled() {
            return;
        }
        let silent = 2 * self.config.replication.replication_timeout();
        tracing::warn!(
            shard = replica.shard,
            epoch = leader.epoch,
            ?silent,
            "stepping down: no majority of the replica set answered within twice the lease (CheckQuorum)"
        );
        self.step_down_without_quorum(&replica, leader.epoch).await;
    }

    /// Feeds `follower` what the leader core decides, keeping up to
    /// `ship_window` pushes in flight, until this leadership stops or a
    /// reply deposes it.
    pub(super) async fn run_shipper(
        self: Arc<Self>,
        replica: Arc<ShardReplica>,
        leader: Arc<LeaderState>,
        follower: NodeId,
        stop: tokio_util::sync::CancellationToken,
    ) {
        let mut ship_limit = leader.ship_limit.subscribe();
        // Early shipping: with nothing in flight to this follower, each
        // written append wakes this shipper directly; with segments in
        // flight it waits for what the WAL commits (`ship_limit`) or a
        // reply, so appends arriving one by one wake nothing.
        let mut written = if self.early_shipping() { self.wal.written_watch(replica.shard).ok() } else { None };
        let mut in_flight = Pushes::new(Duration::from_millis(self.config.replication.ship_timeout_ms));
        let batch_bytes = self.config.replication.ship_batch_bytes;
        // The commit the follower was last told in a request it answered:
        // a follower may go quiet only once it knows the commit.
        let mut told_commit = Seqno(0);
        // Quiet towards this follower: the link standing in for keepalives
        // and the notify it wakes this shipper with.
        let mut quiet: Option<(Arc<super::quiet::QuietLink>, Arc<tokio::sync::Notify>)> = None;
        // Calls failed in a row, and when the last one failed; `refused`:
        // the last failure was the follower's own answer (this shard only:
        // it is reconciling, say), not a call that never reached it.
        let (mut failures, mut last_failure_us, mut refused) = (0u32, 0u64, false);
        // The follower's last answer was that it awaits its coordinator's
        // assignment: no push until it pulls a catch-up (which its
        // assignment starts), but for one probe every AWAITING_PROBE.
        let mut awaiting = false;
        let peer = self.peer_probe(follower);
        let mut peer_back = peer.back.subscribe();
        let mut pulled = leader.pulled.subscribe();
        // The probe window of a down follower node this shipper opened
        // last (see `PeerProbe::may_probe`).
        let mut my_probe_window = 0u64;
        let stopped = stop.cancelled();
        tokio::pin!(stopped);
        loop {
            if let Some(written) = written.as_mut() {
                let wrote = *written.borrow_and_update();
                leader.core.lock().on_local_written(Seqno(wrote));
            }
            // Awake again: what the link proved counts as contact.
            if let Some((link, _)) = quiet.take() {
                self.leave_quiet(&replica, &leader, follower, &link);
            }
            // Issue everything the core allows right now (nothing while a
            // push waits for room on the stream: pushes go in order).
            let mut not_my_turn = false;
            while !in_flight.is_blocked() {
                let decision = leader.core.lock().poll_ship(follower, now_us());
                // A node that is down is probed by one shard at a time
                // (see `PeerProbe`); this one waits its turn: a window it
                // opened itself ends with its backoff, another shard's
                // probe leaves it asleep for long.
                if decision != ShipDecision::Idle {
                    match peer.may_probe(now_us()) {
                        Ok(window) => my_probe_window = window,
                        Err(window) => {
                            failures += 1;
                            last_failure_us = now_us();
                            not_my_turn = window != my_probe_window;
                            break;
                        }
                    }
                }
                // A follower awaiting its assignment takes nothing: new
                // records wait with the rest for its catch-up pull.
                if awaiting && now_us() < last_failure_us + AWAITING_PROBE.as_micros() as u64 {
                    break;
                }
                match decision {
                    ShipDecision::Send { from, up_to } => {
                        let frames = match self.wal.read(replica.shard, from.0, up_to.0, batch_bytes).await {
                            Ok(frames) => frames,
                            Err(e) => {
                                tracing::warn!(shard = replica.shard, follower, error = %e, "reading the WAL to ship");
                                break;
                            }
                        };
                        let last = frames.last().map_or(from, |f| Seqno(f.seqno()));
                        let segment = match Segment::encode(replica.shard, frames) {
                            Ok(segment) => segment,
                            Err(e) => {
                                tracing::error!(shard = replica.shard, error = %e, "encoding a segment to ship");
                                break;
                            }
                        };
                        let sent = now_us();
                        leader.core.lock().on_sent(follower, from, last, sent);
                        self.ship(&replica, &leader, follower, Some(segment), sent, &mut in_flight);
                    }
                    ShipDecision::Keepalive => {
                        let sent = now_us();
                        leader.core.lock().on_keepalive_sent(follower, sent);
                        self.ship(&replica, &leader, follower, None, sent, &mut in_flight);
                    }
                    ShipDecision::Idle => break,
                }
            }
            // Never towards a follower whose last call failed or was
            // refused: an empty shard's dead follower holds "everything" it
            // has, and its shippers went quiet, had the node link's failed
            // call wake them, and went quiet again every keepalive period,
            // touching their replicas each time (with one node of a
            // 10,000-shard cluster down, a quarter of each survivor's core).
            if in_flight.is_empty() && failures == 0 && self.may_go_quiet(&replica, &leader, follower, told_commit) {
                let link = self.quiet_links.link(&self, follower);
                let commit = leader.core.lock().commit().0;
                let wake = link.quiet(replica.shard, leader.epoch, commit);
                leader.quiet.lock().insert(follower, link.clone());
                self.metrics.quiet_pairs.inc();
                // Its last report and gauges are taken once more, quiet.
                replica.unsettle();
                quiet = Some((link, wake));
            }
            // Nothing to send: sleep until the next keepalive is due (none
            // while quiet: the link wakes this shipper if it must, and none
            // while a call is in flight: no keepalive goes before it
            // returns, and its return wakes this shipper. A timer then
            // would fire every millisecond once the keepalive is overdue,
            // for as long as a slow or partitioned follower takes to
            // answer or time out: thousands of shards spinning at once).
            let due = leader.core.lock().keepalive_due_at(follower).unwrap_or(0);
            // A follower whose calls keep failing (its node is down) is
            // probed less and less often, up to once a second: hundreds of
            // shards probing a dead node every few milliseconds would take
            // the CPU the live followers' answers need.
            let backing_off = failures > PROBE_FAILURES_BEFORE_BACKOFF;
            let due = if backing_off { due.max(last_failure_us + probe_backoff_us(failures)) } else { due };
            // Another shard probes the down node: this one sleeps long
            // (see `NOT_MY_TURN_US`); the node's return wakes it.
            let due =
                if not_my_turn && backing_off && !refused { due.max(last_failure_us + NOT_MY_TURN_US) } else { due };
            let due = if awaiting { due.max(last_failure_us + AWAITING_PROBE.as_micros() as u64) } else { due };
            let keepalive = Duration::from_micros(due.saturating_sub(now_us()).max(1_000));
            let woken = quiet.as_ref().map(|(_, wake)| wake.clone());
            tokio::select! {
                (sent, outcome) = in_flight.next(), if !in_flight.is_empty() => {
                    let Shipped { reply, commit, answered, awaiting: awaiting_assignment } =
                        self.settle_push(&leader, follower, sent, outcome);
                    let sent = sent.at_us;
                    if matches!(reply, ShipReply::Failed) {
                        self.metrics.ship_errors.with_label_values(&[&follower.to_string()]).inc();
                        failures += 1;
                        // At a cluster's first start every follower
                        // awaits so until the coordinator's assignments
                        // reach it.
                        awaiting = awaiting_assignment;
                        last_failure_us = now_us();
                        refused = answered;
                        // A refusal is this shard's alone: the node is up.
                        // Counted against the node, thousands of shards
                        // refused while their followers reconcile at start
                        // made it "down", and each catch-up pulled (which
                        // says it is up) woke them all to be refused again.
                        if answered {
                            peer.answered();
                        } else {
                            peer.failed();
                        }
                    } else {
                        if (failures > PROBE_FAILURES_BEFORE_BACKOFF && !refused) || peer.down() {
                            // Back: every shard backing off from it probes now.
                            self.peer_alive(follower);
                        }
                        peer.answered();
                        (failures, refused, awaiting) = (0, false, false);
                    }
                    if matches!(reply, ShipReply::Applied { .. }) {
                        told_commit = told_commit.max(commit);
                    }
                    let deposed = {
                        let mut core = leader.core.lock();
                        let deposed = core.on_reply(follower, reply, sent).err();
                        replica.publish_leader(&core, &self.metrics);
                        deposed
                    };
                    if let Some(epoch) = deposed {
                        tokio::spawn(self.clone().step_down(replica.clone(), epoch.0));
                        return;
                    }
                }
                changed = ship_limit.changed() => if changed.is_err() { break },
                open = changed_if_watched(written.as_mut()), if in_flight.is_empty() => if !open { break },
                _ = tokio::time::sleep(keepalive), if woken.is_none() && in_flight.is_empty() => {}
                _ = peer_back.changed(), if backing_off && !refused => failures = 0,
                // The follower reconciled with this leadership: it takes
                // pushes again.
                _ = pulled.changed(), if (backing_off || awaiting) && refused => (failures, awaiting) = (0, false),
                _ = async { woken.as_ref().expect("quiet").notified().await }, if woken.is_some() => {}
                _ = &mut stopped => break,
            }
        }
        if let Some((link, _)) = quiet.take() {
            self.leave_quiet(&replica, &leader, follower, &link);
        }
    }

    /// `follower`'s node as this node's shippers see it.
    fn peer_probe(&self, follower: NodeId) -> Arc<PeerProbe> {
        self.peer_probes.lock().entry(follower).or_insert_with(|| Arc::new(PeerProbe::new())).clone()
    }

    /// `node` showed it is up (a call got through, it pulled a catch-up
    /// stream from this node, or sent it a node keepalive): shippers backing
    /// off from it probe now.
    pub(super) fn peer_alive(&self, node: NodeId) {
        if node != self.me && self.config.node(node).is_some() {
            let peer = self.peer_probe(node);
            peer.answered();
            peer.back.send_modify(|g| *g += 1);
        }
    }

    /// Whether this shipper may go quiet towards `follower` (see
    /// `super::quiet`): the core says the follower holds everything and
    /// knows the commit, and no archive progress still has to travel.
    fn may_go_quiet(&self, replica: &ShardReplica, leader: &LeaderState, follower: NodeId, told: Seqno) -> bool {
        if !self.quiesce() {
            return false;
        }
        let durable = {
            let core = leader.core.lock();
            if !core.may_go_quiet(follower, told) {
                return false;
            }
            core.durable().0
        };
        // The archive's progress travels in per-shard traffic: the leader's
        // to its followers (retention), an archiving follower's back.
        let archived = self.archived_through(replica.shard);
        if archived.is_some_and(|a| a < durable) {
            return false;
        }
        let archiver = leader.archiver.load(std::sync::atomic::Ordering::Acquire);
        archiver != follower || leader.archived_by_follower.load(std::sync::atomic::Ordering::Acquire) >= durable
    }

    /// `follower` is no longer quiet: credit what its link proved, and let
    /// the lease watch judge by the core again.
    fn leave_quiet(
        &self,
        replica: &ShardReplica,
        leader: &LeaderState,
        follower: NodeId,
        link: &super::quiet::QuietLink,
    ) {
        let credit = link.wake(replica.shard);
        leader.quiet.lock().remove(&follower);
        replica.unsettle();
        self.metrics.quiet_pairs.dec();
        if let Some(sent) = credit {
            let mut core = leader.core.lock();
            core.on_node_contact(follower, sent);
            replica.publish_leader(&core, &self.metrics);
        }
        leader.quiet_changed.notify_one();
    }

    /// One ShipSegment (or keepalive when `segment` is none) to `follower`,
    /// made at `sent` (unix µs), kept in `in_flight` until it is answered
    /// or fails ([`ReplicationNode::settle_push`]).
    fn ship(
        &self,
        replica: &ShardReplica,
        leader: &LeaderState,
        follower: NodeId,
        segment: Option<Segment>,
        sent: u64,
        in_flight: &mut Pushes<PushNote>,
    ) {
        let (durable, written, commit) = {
            let core = leader.core.lock();
            (core.durable(), core.written(), core.commit())
        };
        let (seqno, count, payload) = match &segment {
            Some(s) => (s.first_seqno(), s.frames().len() as u64, s.encoded().clone()),
            None => (0, 0, bytes::Bytes::new()),
        };
        // Partition drill: a cut peer is sent nothing (the push fails at
        // once, as a transport failure would), and an answer arriving after
        // the cut is dropped as a cut link would drop it, so the lease
        // counts no contact from after the cut.
        let cut = self.drill_partition.blocks(follower);
        if segment.is_some() && !cut {
            self.metrics.segments_shipped.inc();
            self.metrics.bytes_shipped.inc_by(payload.len() as u64);
            self.metrics.ship_batch_records.observe(count as f64);
        }
        let request = ShipSegmentRequest {
            id: Some(WalSegmentId { region_id: self.region, shard_id: replica.shard, seqno }),
            payload,
            event_count: count,
            // A segment's envelope must cover it (it may be written, not yet
            // durable); a keepalive announces the durable position only, so
            // a follower pulls catch-up for records it can actually get.
            leader_last_seq: if segment.is_some() { written.0 } else { durable.0 },
            stream_baseline: 0,
            epoch: leader.epoch,
            leader_node_id: self.me,
            commit_seqno: commit.0,
            archived_seqno: self.archived_through(replica.shard).unwrap_or(0),
            archiver_node_id: leader.archiver.load(std::sync::atomic::Ordering::Acquire),
        };
        let note = PushNote { commit, archiver: request.archiver_node_id };
        let stream = if cut {
            None
        } else {
            let mut streams = self.ship_streams.lock();
            match streams.get(&follower) {
                Some(tx) if !tx.is_closed() => Some(tx.clone()),
                _ => self.peers.shipping(follower).map(|client| {
                    let (tx, rx) = tokio::sync::mpsc::channel(SHIP_STREAM_DEPTH);
                    tokio::spawn(run_ship_stream(client, rx, self.metrics.ship_message_pushes.clone()));
                    streams.insert(follower, tx.clone());
                    tx
                }),
            }
        };
        in_flight.push(Sent { at_us: sent, note }, request, stream.as_ref());
    }

    /// What a push's `outcome` comes to for the shipper (a push not
    /// answered in time, or whose call failed on the way, failed; its
    /// answer, if it comes later, goes nowhere), with the follower's
    /// contact and archive progress it proves counted.
    fn settle_push(&self, leader: &LeaderState, follower: NodeId, sent: Sent<PushNote>, outcome: Outcome) -> Shipped {
        let PushNote { commit, archiver } = sent.note;
        let failed = Shipped { reply: ShipReply::Failed, commit, answered: false, awaiting: false };
        let Some(outcome) = outcome else { return failed };
        if self.drill_partition.blocks(follower) {
            return failed;
        }
        if super::contact::is_answer(&outcome) {
            self.contact.answered(follower, sent.at_us);
        }
        let answered = match &outcome {
            Ok(_) => true,
            Err(status) => refused_by_replica(status),
        };
        let awaiting = matches!(&outcome, Err(status) if super::error::awaits_assignment(status));
        let reply = match outcome {
            Ok(r) if r.accepted => {
                // The archiving follower's progress, for retention and the
                // status (the store only grows, so the newest holds).
                if archiver == follower && r.archived_seqno > 0 {
                    leader.archived_by_follower.fetch_max(r.archived_seqno, std::sync::atomic::Ordering::AcqRel);
                }
                ShipReply::Applied { applied: Seqno(r.applied_seqno) }
            }
            Ok(_) => ShipReply::Failed,
            Err(status) => {
                match (metadata_u64(&status, APPLIED_METADATA_KEY), metadata_u64(&status, EPOCH_METADATA_KEY)) {
                    (Some(applied), _) if status.code() == tonic::Code::OutOfRange => {
                        ShipReply::Gap { applied: Seqno(applied) }
                    }
                    (_, Some(epoch)) if status.code() == tonic::Code::FailedPrecondition => {
                        ShipReply::StaleEpoch { epoch: Epoch(epoch) }
                    }
                    _ => {
                        tracing::debug!(follower, %status, "ShipSegment failed");
                        ShipReply::Failed
                    }
                }
            }
        };
        Shipped { reply, commit, answered, awaiting }
    }
}

/// How often a leader probes a follower that awaits its coordinator's
/// assignment (see [`AWAITING_ASSIGNMENT_METADATA_KEY`]): its assignment
/// makes it pull a catch-up, which wakes the shipper at once; the probe
/// only bounds how long a missed wake-up could last.
///
/// [`AWAITING_ASSIGNMENT_METADATA_KEY`]: super::error::AWAITING_ASSIGNMENT_METADATA_KEY
const AWAITING_PROBE: Duration = Duration::from_secs(5);

/// What a shipper notes of a push it made: the commit the request told and
/// the archiver it named.
#[derive(Debug, Clone, Copy)]
struct PushNote {
    commit: Seqno,
    archiver: NodeId,
}

/// What one ship call came to: the reply for the core, the commit the
/// request told, and whether the follower answered it itself (an answer or
/// its own refusal) rather than the call failing on the way.
struct Shipped {
    reply: ShipReply,
    commit: Seqno,
    answered: bool,
    /// The follower refused it awaiting its coordinator's assignment.
    awaiting: bool,
}
