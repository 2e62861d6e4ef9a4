//! The leader side of replication: a driver per leadership folds the WAL's
//! positions into the leader core, and one shipper per follower asks the
//! core what to send, keeps up to `ship_window` pushes in flight and feeds
//! the replies back. Pushes to one follower node travel over one
//! `ShipSegments` stream (unary `ShipSegment` for a peer without it).
//!
//! Invariants kept here: only records in the leader's own log are shipped
//! (durable ones, or written ones with early shipping); a reply counts only
//! through [`LeaderCore::on_reply`](crate::core::leader::LeaderCore::on_reply);
//! a reply revealing a newer epoch deposes the leader (the rules decide,
//! `leadership::step_down` performs it); a push not answered within
//! `ship_timeout_ms` counts as failed.

use std::sync::Arc;
use std::time::Duration;

use tonic::Status;
use walship_proto::replication::wal_shipping_client::WalShippingClient;
use walship_proto::replication::{ShipBatch, ShipSegmentRequest, ShipSegmentResponse, WalSegmentId};
use walship_wal::Segment;
use walship_wal::position as watch;

use super::error::{APPLIED_METADATA_KEY, EPOCH_METADATA_KEY, metadata_u64, refused_by_replica};
use super::probe::{PROBE_FAILURES_BEFORE_BACKOFF, PeerProbe, probe_backoff_us};
use super::pushes::{Outcome, Pushes, Sent, ShipCall};
use super::shard::{LeaderState, ShardReplica};
use super::{ReplicationNode, SHIP_BATCH_MAX_PUSHES, now_us};
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

/// Carries one follower node's pushes: over one `ShipBatches` stream, many
/// pushes to a message (those queued when the stream's task runs, at most
/// [`SHIP_BATCH_MAX_PUSHES`] and about [`SHIP_BATCH_BYTES`]); each push is
/// answered in order by its own answer in the message answering its batch.
/// The stream reopens on the next push after it ends (the follower
/// restarted). Refusals come in place: a refused push is answered with its
/// status and the stream goes on.
///
/// A peer without `ShipBatches` (an older node) answers `UNIMPLEMENTED`; the
/// pushes then go over a `ShipSegments` stream, one to a message
/// ([`run_segment_stream`]), or unary `ShipSegment` calls for a peer older
/// still.
async fn run_ship_stream(
    client: WalShippingClient<crate::peers::PeerChannel>,
    calls: tokio::sync::mpsc::Receiver<ShipCall>,
    pushes_per_message: prometheus::Histogram,
) {
    if let Some((calls, first)) = run_batch_stream(client.clone(), calls, pushes_per_message).await {
        run_segment_stream(client, first, calls).await;
    }
}

/// The `ShipBatches` stream of [`run_ship_stream`]. Returns the calls and
/// the first push not yet answered when the peer has no such stream; none
/// once the calls end.
async fn run_batch_stream(
    mut client: WalShippingClient<crate::peers::PeerChannel>,
    mut calls: tokio::sync::mpsc::Receiver<ShipCall>,
    pushes_per_message: prometheus::Histogram,
) -> Option<(tokio::sync::mpsc::Receiver<ShipCall>, ShipCall)> {
    use std::collections::VecDeque;
    type Reply = tokio::sync::oneshot::Sender<Result<ShipSegmentResponse, Status>>;
    let fail = |replies: Vec<Reply>, status: &Status| {
        for reply in replies {
            let _ = reply.send(Err(status.clone()));
        }
    };
    loop {
        let first = calls.recv().await?;
        let (req_tx, req_rx) = tokio::sync::mpsc::channel(SHIP_BATCH_DEPTH);
        let mut answers = match client.ship_batches(tokio_stream::wrappers::ReceiverStream::new(req_rx)).await {
            Ok(r) => r.into_inner(),
            Err(status) if status.code() == tonic::Code::Unimplemented => {
                tracing::info!(%status, "peer has no ShipBatches stream; shipping with ShipSegments");
                return Some((calls, first));
            }
            Err(status) => {
                let _ = first.1.send(Err(status));
                continue;
            }
        };
        // The replies of each batch sent and not yet answered, oldest first,
        // and the pushes they hold.
        let mut pending: VecDeque<Vec<Reply>> = VecDeque::new();
        let mut in_flight = 0;
        let mut next = Some(first);
        let end = 'stream: loop {
            if let Some(first) = next.take() {
                // The shipper that sent this ran this task straight after
                // itself (tokio runs a task woken by the running one next),
                // ahead of the other shards' shippers woken with it: one
                // yield lets their pushes queue too, to go in this batch.
                tokio::task::yield_now().await;
                let mut bytes = first.0.payload.len();
                let (mut pushes, mut replies) = (vec![first.0], vec![first.1]);
                while pushes.len() < SHIP_BATCH_MAX_PUSHES
                    && in_flight + pushes.len() < SHIP_STREAM_DEPTH
                    && bytes < SHIP_BATCH_BYTES
                    && let Ok((push, reply)) = calls.try_recv()
                {
                    bytes += push.payload.len();
                    pushes.push(push);
                    replies.push(reply);
                }
                pushes_per_message.observe(pushes.len() as f64);
                if req_tx.send(ShipBatch { pushes }).await.is_err() {
                    // The pushes still queued go on the next stream.
                    let end = Status::unavailable("the ShipBatches stream closed");
                    fail(replies, &end);
                    break 'stream end;
                }
                in_flight += replies.len();
                pending.push_back(replies);
            }
            tokio::select! {
                call = calls.recv(), if in_flight < SHIP_STREAM_DEPTH => match call {
                    Some(call) => next = Some(call),
                    None => return None,
                },
                answer = answers.message() => match answer {
                    Ok(Some(answer)) => {
                        let Some(replies) = pending.pop_front() else {
                            break Status::internal("the follower answered a ShipBatch that was not sent");
                        };
                        in_flight -= replies.len();
                        if answer.answers.len() != replies.len() {
                            let end = Status::internal(format!(
                                "the follower answered a ShipBatch of {} pushes with {} answers",
                                replies.len(),
                                answer.answers.len()
                            ));
                            fail(replies, &end);
                            break end;
                        }
                        for (reply, answer) in replies.into_iter().zip(answer.answers) {
                            let _ = reply.send(super::error::refusal_status(&answer).map_or(Ok(answer), Err));
                        }
                    }
                    Ok(None) => break Status::unavailable("the ShipBatches stream ended"),
                    Err(status) => {
                        // Batches are answered in order: the error is the oldest one's.
                        if let Some(replies) = pending.pop_front() {
                            fail(replies, &status);
                        }
                        break Status::unavailable(format!("the ShipBatches stream ended: {}", status.message()));
                    }
                },
            }
        };
        for replies in pending.drain(..) {
            fail(replies, &end);
        }
    }
}

/// Carries one follower node's pushes over one `ShipSegments` stream, one
/// to a message, each answered in order by the call that sent it, and
/// reopens the stream on the next push after it ends (the follower
/// restarted). The stream asks for refusals in place: a refused push is
/// answered with its status and the stream goes on. (A follower that ends
/// the stream on a refusal instead, as the contract allows without that
/// metadata, fails the later pushes in flight; they are shipped again.
/// Every shard on the stream paid for one shard's refusal that way: at
/// start-up, with thousands of replicas reconciling, some 100,000 pushes a
/// node failed.)
///
/// A peer without `ShipSegments` (an older node) answers `UNIMPLEMENTED`;
/// from then on each push is a unary `ShipSegment`, as before the stream.
async fn run_segment_stream(
    mut client: WalShippingClient<crate::peers::PeerChannel>,
    first: ShipCall,
    mut calls: tokio::sync::mpsc::Receiver<ShipCall>,
) {
    use std::collections::VecDeque;
    let mut carried = Some(first);
    loop {
        let Some((first, reply)) = (match carried.take() {
            Some(call) => Some(call),
            None => calls.recv().await,
        }) else {
            return;
        };
        let (req_tx, req_rx) = tokio::sync::mpsc::channel(SHIP_STREAM_DEPTH);
        let mut call = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(req_rx));
        call.metadata_mut().insert(super::error::INLINE_REFUSALS_KEY, tonic::metadata::MetadataValue::from_static("1"));
        let mut answers = match client.ship_segments(call).await {
            Ok(r) => r.into_inner(),
            Err(status) if status.code() == tonic::Code::Unimplemented => {
                tracing::info!(%status, "peer has no ShipSegments stream; shipping with unary ShipSegment");
                return ship_unary(client, (first, reply), calls).await;
            }
            Err(status) => {
                let _ = reply.send(Err(status));
                continue;
            }
        };
        let mut pending = VecDeque::new();
        if req_tx.send(first).await.is_ok() {
            pending.push_back(reply);
        }
        let end = 'stream: loop {
            tokio::select! {
                call = calls.recv() => match call {
                    Some(first) => {
                        // The shipper that sent this ran this task straight
                        // after itself (tokio runs a task woken by the
                        // running one next), ahead of the other shards'
                        // shippers woken with it: one yield lets their
                        // pushes queue too, and they go to the stream
                        // together, to be encoded into one write.
                        tokio::task::yield_now().await;
                        // A bounded turn: answers are read between turns.
                        let mut call = Some(first);
                        let mut turn = 0;
                        while let Some((request, reply)) = call {
                            if req_tx.send(request).await.is_err() {
                                // The pushes still queued go on the next stream.
                                let _ = reply.send(Err(Status::unavailable("the ShipSegments stream closed")));
                                break 'stream Status::unavailable("the ShipSegments stream closed");
                            }
                            pending.push_back(reply);
                            turn += 1;
                            call = if turn < SHIP_TURN { calls.try_recv().ok() } else { None };
                        }
                    }
                    None => return,
                },
                answer = answers.message() => match answer {
                    Ok(Some(response)) => {
                        if let Some(reply) = pending.pop_front() {
                            let _ = reply.send(super::error::refusal_status(&response).map_or(Ok(response), Err));
                        }
                    }
                    Ok(None) => break Status::unavailable("the ShipSegments stream ended"),
                    Err(status) => {
                        // Answers come in order: the refusal is the oldest push's.
                        if let Some(reply) = pending.pop_front() {
                            let _ = reply.send(Err(status.clone()));
                        }
                        break Status::unavailable(format!("the ShipSegments stream ended: {}", status.message()));
                    }
                },
            }
        };
        for reply in pending.drain(..) {
            let _ = reply.send(Err(end.clone()));
        }
    }
}

/// Pushes in flight on one ship stream, at most; more wait.
const SHIP_STREAM_DEPTH: usize = 256;

/// Batches a `ShipBatches` stream's sender holds before the transport
/// takes them.
const SHIP_BATCH_DEPTH: usize = 16;

/// Segment bytes past which a `ShipBatches` message takes no further push
/// (one push alone may be larger: up to `ship_batch_bytes`).
const SHIP_BATCH_BYTES: usize = 4 << 20;

/// Pushes handed to the stream in one turn, at most, before its answers
/// are read again.
const SHIP_TURN: usize = 32;

/// Unary `ShipSegment` for every push, for a peer without `ShipSegments`.
async fn ship_unary(
    client: walship_proto::replication::wal_shipping_client::WalShippingClient<crate::peers::PeerChannel>,
    first: ShipCall,
    mut calls: tokio::sync::mpsc::Receiver<ShipCall>,
) {
    let mut next = Some(first);
    while let Some((request, reply)) = match next.take() {
        Some(call) => Some(call),
        None => calls.recv().await,
    } {
        let mut client = client.clone();
        tokio::spawn(async move {
            let _ = reply.send(client.ship_segment(request).await.map(tonic::Response::into_inner));
        });
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
            while !in_flight.is_blocked() {
                let decision = leader.core.lock().poll_ship(follower, now_us());
                // A node that is down is probed by one shard at a time
                // (see `PeerProbe`); this one waits its turn.
                if decision != ShipDecision::Idle && !peer.may_probe(now_us()) {
                    failures += 1;
                    last_failure_us = now_us();
                    break;
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

#[cfg(test)]
#[path = "send_test.rs"]
mod ship_stream_tests;
