//! The active coordinator's reconcile loop: every few milliseconds it
//! checks each shard's recorded leader (lost: heartbeats stopped past
//! `leader_timeout_ms`, restarted in its epoch, or unhealthy: a full disk or
//! a known corrupt record while a healthy caught-up replica exists) and
//! starts a failover, and re-assigns any replica whose heartbeat disagrees
//! with the record.

use std::sync::Arc;
use std::time::{Duration, Instant};

use walship_proto::log::AssignRequest;

use super::promote::Lost;
use super::*;
use crate::control::liveness::{self, FollowerReport};

/// What the next reconcile round looks at. A *full* round looks at every
/// shard: the first round after this coordinator becomes active, then
/// every [`FULL_ROUND_EVERY`] (or less often when a full round is costly:
/// at most 1 % of the time goes to them, see [`full_round_every`]). While
/// a node misses its heartbeats, a *silence* round also looks at every
/// shard it or no node leads (their leaders may be lost: no heartbeat will
/// say so), as often as keeps those rounds under a quarter of the time.
/// Otherwise a round looks
/// only at the shards a heartbeat reported a change of, those the
/// leadership record changed for, and those a round left something under
/// way for (an assignment not yet taken, a replica change): an idle
/// cluster's rounds cost nothing per shard. A shard queued for a failover
/// or being failed over is looked at again when its failover ends
/// (`fail_over_lost`), not every round meanwhile; one whose replica was
/// just assigned and does not report it yet is looked at again when the
/// assignment may be repeated ([`REASSIGN_AFTER`], `later`), or when a
/// report of it changes, not every round meanwhile.
#[derive(Default)]
pub(crate) struct Pending {
    pub(crate) shards: std::collections::BTreeSet<u32>,
    /// Shards to look at once their time comes (see the type's docs).
    later: std::collections::BTreeSet<(Instant, u32)>,
    last_full: Option<Instant>,
    /// How long the last full round took.
    full_cost: Duration,
    last_silence: Option<Instant>,
    /// How long the last silence round took.
    silence_cost: Duration,
}

/// The shards a reconcile round looks at (see [`Pending`]).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Scope {
    Every,
    /// The pending shards and those one of these (silent) nodes leads, or
    /// no node does.
    LedBy(std::collections::BTreeSet<NodeId>),
    Pending,
}

/// Bulk failovers running at once. The reconcile loop queues every shard
/// it finds without a working leader; a bulk failover takes all the queued
/// shards (at most [`BULK_FAILOVER_SHARDS`]) and fails them over together
/// (`promote.rs`): one KV write raises their epochs, their fences reach
/// each node as a few FenceMany calls (`batch.rs`), each node makes the
/// epochs durable with one fsync (the WAL's group commit of epoch raises),
/// and one KV write records the new leaders, whose assignments end the
/// bulk. Shards found lost meanwhile queue for the next bulk, which starts
/// as soon as one of these has ended. A bulk holds its slot through its
/// assignments: with the next bulk started as soon as one had recorded its
/// leaders, a lost node's 3,334 shards went through the failover about
/// half a second sooner, but their assignments piled up on the two
/// surviving nodes, and in 2 of 24 runs on two cores those nodes answered
/// each other so late that thousands of the new leaders stepped down
/// (CheckQuorum) and failed over again, for seven seconds
/// (ops/bench/RESULTS.md).
pub(crate) const BULK_FAILOVERS_AT_ONCE: usize = 2;

/// The most shards one bulk failover takes. Bulks of 4,096 (everything
/// one node of a 10,000-shard cluster leads) started thousands of
/// leaderships at once during a start-up on two cores: the nodes starved
/// past CheckQuorum's lease, leaders stepped down by the thousand and the
/// cluster churned for minutes. Bulks of 512, two at a time, keep the
/// nodes answering (ops/bench/RESULTS.md, "Bulk failover").
pub(crate) const BULK_FAILOVER_SHARDS: usize = 512;

/// Assignments the reconcile loop has in flight at once, the rest queued.
/// 1,024 were tried for a 10,000-shard start-up (2026-12-03): the nodes,
/// taking a thousand leaderships at once, answered their followers too
/// late, 12,000 leaders stepped down (CheckQuorum) and start-up took
/// longer (32 s to every leader, against 16 s with 128).
pub(crate) const ASSIGNMENTS_AT_ONCE: usize = 128;

/// A round that looks at every shard runs this often, or less often when
/// it is costly: see [`full_round_every`]. It is a safety net: every change
/// a round acts on also reaches the pending set, and a silent node brings
/// the shards it led to silence rounds. At 10,000 shards a full round
/// costs 14-40 ms (release build, by the machine's load); once a second it
/// was a sixth of an idle coordinator's CPU, and at 5 % of the time (every
/// 2 s) still a quarter of it (2026-12-06).
const FULL_ROUND_EVERY: Duration = Duration::from_secs(2);

/// The longest wait between full rounds, however costly they are.
const MAX_FULL_ROUND_EVERY: Duration = Duration::from_secs(10);

/// How long after a full round that took `cost` the next one is due:
/// [`FULL_ROUND_EVERY`], or longer so that full rounds take at most 1 % of
/// a core, up to [`MAX_FULL_ROUND_EVERY`].
fn full_round_every(cost: Duration) -> Duration {
    (cost * 100).clamp(FULL_ROUND_EVERY, MAX_FULL_ROUND_EVERY)
}

/// How long after an assignment to a replica that does not report it yet
/// the assignment is sent again.
const REASSIGN_AFTER: Duration = Duration::from_millis(200);

/// How long after a node goes silent rounds keep looking at every shard
/// (see [`Coordinator::node_silent`]): past the longest a node may be
/// silent before it counts as lost ([`liveness::MAX_SILENCE_BOUND`]), with
/// a few full rounds to spare.
const SILENT_WATCH: Duration = Duration::from_secs(liveness::MAX_SILENCE_BOUND.as_secs() + 2);

impl Pending {
    /// What the round starting `now` looks at, `silent` the nodes that
    /// went silent lately (see [`Coordinator::silent_nodes`]); the pending
    /// shards are taken.
    fn scope(&mut self, silent: std::collections::BTreeSet<NodeId>, now: Instant) -> Scope {
        let full_due =
            self.last_full.is_none_or(|last| now.saturating_duration_since(last) >= full_round_every(self.full_cost));
        let silence_due = !silent.is_empty()
            && self.last_silence.is_none_or(|last| now.saturating_duration_since(last) >= self.silence_cost * 4);
        if full_due {
            self.last_full = Some(now);
            Scope::Every
        } else if silence_due {
            self.last_silence = Some(now);
            Scope::LedBy(silent)
        } else {
            Scope::Pending
        }
    }

    /// The next round looks at every shard (a new active term).
    pub(crate) fn force_full(&mut self) {
        self.last_full = None;
    }

    /// A round of `scope` took `cost`.
    fn took(&mut self, scope: &Scope, cost: Duration) {
        match scope {
            Scope::Every => self.full_cost = cost,
            Scope::LedBy(_) => self.silence_cost = cost,
            Scope::Pending => {}
        }
    }
}

/// One reconcile round's records, when this coordinator became active, and
/// what the round looks at.
type Round = (Vec<(u32, Arc<ShardRecord>)>, Instant, Scope);

impl Coordinator {
    pub(super) async fn run_reconcile(self: Arc<Self>) {
        // Checked more often than heartbeats arrive, so a loss is noticed
        // within a few ms of the timeout rather than up to a period late.
        let period = Duration::from_millis((self.config.replication.heartbeat_ms / 5).clamp(5, 20));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = self.shutdown.cancelled() => return,
            }
            self.reconcile_round();
        }
    }

    /// Which shards this round looks at (see [`Pending`]): their records,
    /// when this coordinator became active, and the round's scope.
    fn round_records(&self) -> Option<Round> {
        let active = self.active.lock();
        let now = Instant::now();
        let a = active.as_ref().filter(|a| now < a.lease_until)?;
        let silent = self.silent_nodes(a.since);
        let mut pending = self.pending.lock();
        let scope = pending.scope(silent, now);
        let mut ids = std::mem::take(&mut pending.shards);
        while let Some(&(at, shard)) = pending.later.first()
            && at <= now
        {
            pending.later.pop_first();
            ids.insert(shard);
        }
        drop(pending);
        // Shards queued for a failover or being failed over are left out:
        // they are looked at again when it ends (`fail_over_lost`).
        let failing_over = self.failing_over.lock();
        let listed = |ids: std::collections::BTreeSet<u32>| -> Vec<(u32, Arc<ShardRecord>)> {
            ids.into_iter()
                .filter(|id| !failing_over.contains(id))
                .filter_map(|id| a.state.shards.get(&id).map(|r| (id, r.clone())))
                .collect()
        };
        let records = match &scope {
            Scope::Every => a
                .state
                .shards
                .iter()
                .filter(|(id, _)| !failing_over.contains(id))
                .map(|(&id, r)| (id, r.clone()))
                .collect(),
            Scope::LedBy(silent) => {
                let mut ids = ids;
                ids.extend(
                    a.state
                        .shards
                        .iter()
                        .filter(|(_, r)| r.leader.is_none_or(|l| silent.contains(&l)))
                        .map(|(&id, _)| id),
                );
                listed(ids)
            }
            Scope::Pending => listed(ids),
        };
        drop(failing_over);
        Some((records, a.since, scope))
    }

    /// The nodes that went silent lately: each missed two heartbeat periods
    /// (or was never heard from since this coordinator became active at
    /// `since`) within the last [`SILENT_WATCH`]. The leaders among them
    /// may be lost, and no heartbeat will say so, so silence rounds look at
    /// the shards they lead while they are so. Past the watch those shards
    /// have been looked at long after any silence bound ran out: failed
    /// over, or still queued for a failover (a node down for hours made
    /// every round a full one, a quarter of the coordinator's time at
    /// 10,000 shards).
    fn silent_nodes(&self, since: Instant) -> std::collections::BTreeSet<NodeId> {
        let missed = Duration::from_millis(2 * self.config.replication.heartbeat_ms);
        let seen = self.seen.lock();
        self.config
            .nodes
            .iter()
            .filter(|n| {
                let silent_for = seen.get(&n.id).map_or(since.elapsed(), |s| s.at.elapsed());
                silent_for > missed && silent_for <= missed + SILENT_WATCH
            })
            .map(|n| n.id)
            .collect()
    }

    /// When this coordinator first heard from any of `nodes`. A leader it
    /// never heard from counts its silence from then, not from when the
    /// coordinator became active: nodes started with the coordinator come
    /// up after it (each lays out its WAL files first), and their first
    /// reports arrive some milliseconds apart; counted from the
    /// coordinator's start, the follower that reported first took over a
    /// shard whose leader reported a moment later (a failover at start-up
    /// of one shard in four of a 1-shard bench, of about 320 shards of
    /// 1,000). Heard from none of them, no follower can say the leader is
    /// lost anyway ([`liveness::leader_silence_means_lost`]).
    fn first_heard(&self, nodes: &[NodeId]) -> Option<Instant> {
        let seen = self.seen.lock();
        nodes.iter().filter_map(|n| seen.get(n).map(|s| s.first)).min()
    }

    fn reconcile_round(self: &Arc<Self>) {
        let started = Instant::now();
        let Some((records, since, scope)) = self.round_records() else { return };
        let timeout = Duration::from_millis(self.config.replication.leader_timeout_ms);
        // Shards to look at again next round: something is under way.
        let mut again = Vec::new();
        // Shards to look at again once an assignment may be repeated.
        let mut later = Vec::new();
        let mut queued_lost = false;
        // Shards queued for a failover or being failed over are not in
        // `records` (`round_records`): looked at every round meanwhile, the
        // 3,334 shards of a lost node of a 10,000-shard cluster took most of
        // the coordinator's CPU while they failed over, and a copy of the
        // set each round (every 10 ms) still showed in its profile.
        for (shard, record) in &records {
            let (shard, record) = (*shard, record);
            let unhealthy = self.leader_unhealthy(shard, record, timeout);
            let reports = self.follower_reports(shard, record, timeout);
            let silence = self.config.replication.replication_timeout().as_millis() as u64;
            let unheard = record.leader.is_some_and(|leader| {
                let told = self.leader_told_ms(shard, record.epoch, leader);
                liveness::majority_cannot_hear_leader(&reports, record.replicas.len(), silence, told)
            });
            // A replica holds an epoch the record never reached: the KV
            // lost acknowledged writes (restored from an older copy), and
            // every assignment in the recorded epoch would be refused. A
            // failover raises past it (`failover_together`). The report is
            // read before the live record, which a failover raises before
            // it fences: a report of a raise newer than this round's
            // snapshot finds the record already there.
            let behind = self
                .epoch_ahead_of(shard, &record.members(), record.epoch)
                .is_some_and(|reported| self.shard_record(shard).is_ok_and(|current| current.epoch < reported));
            let lost = unhealthy.is_some()
                || unheard
                || behind
                || match record.leader {
                    None => true,
                    Some(leader) => {
                        // Silent past its own bound: the leader timeout, or
                        // longer while its heartbeats have lately come late.
                        let (last, bound) = self.seen.lock().get(&leader).map_or((None, timeout), |n| {
                            (Some(n.at), n.arrivals.silence_bound(timeout, Instant::now()))
                        });
                        let reference = match last {
                            Some(at) => at.max(since),
                            None => self.first_heard(&record.replicas).map_or(since, |first| first.max(since)),
                        };
                        // A recorded leader that restarted in the record's epoch
                        // never leads in it again (it may have shipped records
                        // its disk lost): it needs a new epoch, as a lost one does.
                        let restarted = self
                            .heartbeat(leader, shard)
                            .is_some_and(|hb| hb.epoch == record.epoch && hb.needs_new_epoch);
                        // Its silence towards this coordinator alone proves
                        // little (see `control/liveness.rs`).
                        restarted
                            || (reference.elapsed() > bound
                                && liveness::leader_silence_means_lost(&reports, record.replicas.len(), silence))
                    }
                };
            let backing_off = self.retry_after.lock().get(&shard).is_some_and(|t| Instant::now() < *t);
            if lost {
                again.push(shard);
            }
            if lost && !backing_off && self.failing_over.lock().insert(shard) {
                if unhealthy.is_some() || unheard {
                    self.retry_after.lock().insert(shard, Instant::now() + DISK_FULL_BACKOFF);
                }
                let reason = unhealthy
                    .or(unheard.then_some("leader_unreachable"))
                    .or(behind.then_some("kv_behind"))
                    .unwrap_or("automatic");
                self.lost.lock().push(Lost { shard, reason, replaced: record.leader });
                queued_lost = true;
                continue;
            }
            let Some(leader) = record.leader else { continue };
            self.undo_abandoned_change(shard, record);
            for replica in record.members() {
                // A member not heard from within the timeout is left alone
                // (its last reports are old, and an assignment would find
                // nobody): its heartbeats, once they come back, bring its
                // shards to a round. While a node was down, every shard it
                // hosted was assigned to it again every 200 ms and looked at
                // every round. A member that reports nothing of the shard
                // while it reports other shards does not host it yet (a
                // replica being added, after a restart): the assignment
                // creates it.
                let in_line = {
                    let reports = self.reports();
                    !reports.heard_within(replica, timeout)
                        || reports.heartbeat(replica, shard).is_some_and(|hb| {
                            hb.epoch == record.epoch
                                && hb.is_leader == (replica == leader)
                                && (replica == leader || hb.leader_node_id == leader)
                        })
                };
                if in_line {
                    continue;
                }
                // At most one assignment per replica in flight, at most
                // ASSIGNMENTS_AT_ONCE in all (a coordinator starting on
                // thousands of shards would otherwise open tens of
                // thousands of calls at once), and none again within
                // REASSIGN_AFTER (a failover's own assignments count).
                let (due, in_flight, repeat_at) = {
                    let mut assigned = self.assigned.lock();
                    let mut assigning = self.assigning.lock();
                    let in_flight = assigning.contains(&(replica, shard));
                    let repeat_at = assigned.get(&(replica, shard)).map(|&t| t + REASSIGN_AFTER);
                    let due = !in_flight
                        && repeat_at.is_none_or(|at| Instant::now() > at)
                        && assigning.insert((replica, shard));
                    if due {
                        assigned.insert((replica, shard), Instant::now());
                    }
                    (due, in_flight, repeat_at)
                };
                // An assignment sent now or still in flight (queued for a
                // slot, say) puts the shard back in the pending set when it
                // ends; otherwise (assigned lately, not in line yet) it is
                // looked at again when the assignment may be repeated, or
                // sooner if a report of it changes. Looked at every round
                // while their assignments queued or their reports were on
                // the way, the thousands of shards of a failover or a
                // start-up kept the coordinator busy.
                // (Neither due nor in flight: assigned lately, so
                // `repeat_at` is there.)
                if !due
                    && !in_flight
                    && let Some(at) = repeat_at
                {
                    later.push((at + Duration::from_millis(1), shard));
                }
                if due {
                    let me = self.clone();
                    let record = record.clone();
                    tokio::spawn(async move {
                        let slot = me.assign_slots.acquire().await;
                        // The record may have moved on while it queued.
                        let current = me.shard_record(shard).ok();
                        if current.as_ref() == Some(&record) {
                            me.assign(shard, &record, leader, replica).await;
                        }
                        drop(slot);
                        me.assigning.lock().remove(&(replica, shard));
                        // Looked at again: assigned now, or still not in line.
                        me.pending.lock().shards.insert(shard);
                    });
                }
            }
            if !record.joint.is_empty() || !record.learners.is_empty() {
                again.push(shard);
            }
        }
        if queued_lost {
            tokio::spawn(self.clone().fail_over_lost());
        }
        let mut pending = self.pending.lock();
        pending.shards.extend(again);
        pending.later.extend(later);
        pending.took(&scope, started.elapsed());
    }

    /// Fails over the shards queued as lost, bulk after bulk, until none
    /// is queued: each bulk runs as a task of its own, the next started as
    /// soon as a slot frees (see [`BULK_FAILOVERS_AT_ONCE`]). Awaited here
    /// one by one, the 3,334 shards of a lost node went through their seven
    /// bulks one at a time, though two slots were there.
    async fn fail_over_lost(self: Arc<Self>) {
        loop {
            let Ok(slot) = self.failover_slots.clone().acquire_owned().await else { return };
            let lost: Vec<Lost> = {
                let mut queue = self.lost.lock();
                let take = queue.len().min(BULK_FAILOVER_SHARDS);
                queue.drain(..take).collect()
            };
            if lost.is_empty() {
                return;
            }
            tokio::spawn(self.clone().fail_over_one_bulk(lost, slot));
        }
    }

    /// One bulk of [`Coordinator::fail_over_lost`]; `slot` is given back
    /// once its new leaders are assigned.
    async fn fail_over_one_bulk(self: Arc<Self>, lost: Vec<Lost>, slot: tokio::sync::OwnedSemaphorePermit) {
        let bulk = lost.len();
        self.metrics.bulk_failover_shards.observe(bulk as f64);
        let started = Instant::now();
        let outcomes = self.failover_bulk(lost).await;
        drop(slot);
        let failed_over = outcomes.iter().filter(|(_, o)| o.is_ok()).count();
        if bulk > 1 {
            tracing::info!(shards = bulk, failed_over, took_ms = started.elapsed().as_millis() as u64, "bulk failover");
        }
        for (shard, outcome) in outcomes {
            self.failing_over.lock().remove(&shard);
            // Looked at again, whatever the outcome (the rounds left it
            // alone while it was queued and failed over).
            self.pending.lock().shards.insert(shard);
            match outcome {
                Err(e @ CoordError::NoMajority { .. }) => {
                    self.retry_after.lock().insert(shard, Instant::now() + NO_MAJORITY_BACKOFF);
                    self.log_no_majority(shard, &e);
                }
                Ok(outcome) => {
                    tracing::info!(shard, to = ?outcome.to, epoch = outcome.epoch, took_ms = outcome.took_ms, "automatic failover")
                }
                Err(CoordError::Busy(_)) => {}
                Err(e) => tracing::warn!(shard, error = %e, "automatic failover"),
            }
        }
    }

    /// Logs an automatic failover that found no majority: WARN once a
    /// replica of the shard that this coordinator had heard from went
    /// silent, or past [`START_GRACE`]; before that (replicas not started
    /// yet) INFO the first time for the shard, DEBUG after.
    fn log_no_majority(&self, shard: u32, error: &CoordError) {
        let timeout = Duration::from_millis(self.config.replication.leader_timeout_ms);
        let replicas =
            self.config.shards.iter().find(|s| s.id == shard).map(|s| s.replicas.clone()).unwrap_or_default();
        let lost_one = {
            let seen = self.seen.lock();
            replicas.iter().any(|r| seen.get(r).is_some_and(|n| n.at.elapsed() > timeout))
        };
        if lost_one || self.started.elapsed() > START_GRACE {
            tracing::warn!(shard, %error, "automatic failover");
        } else if self.waiting_logged.lock().insert(shard) {
            tracing::info!(
                shard,
                %error,
                "automatic failover waits for a majority of the shard's replicas (never heard from since this coordinator started: still starting?)"
            );
        } else {
            tracing::debug!(shard, %error, "automatic failover");
        }
    }

    /// Why the shard's recorded leader should hand over, if it should: it
    /// reports a full disk (it refuses appends; `disk_full`) or a known
    /// corrupt record in its log (`corruption`) in the record's epoch, while
    /// another replica heard from within `timeout` reports neither and, for
    /// corruption, holds everything the leader committed.
    fn leader_unhealthy(&self, shard: u32, record: &ShardRecord, timeout: Duration) -> Option<&'static str> {
        let leader = record.leader?;
        let hb = self.heartbeat(leader, shard).filter(|hb| hb.epoch == record.epoch)?;
        let reason = if hb.disk_full {
            "disk_full"
        } else if hb.corrupt_from_seqno > 0 {
            "corruption"
        } else {
            return None;
        };
        let seen = self.seen.lock();
        let takes_over = |r: &NodeId| {
            seen.get(r).is_some_and(|n| {
                n.at.elapsed() <= timeout
                    && n.shards.get(&shard).is_some_and(|(f, _)| {
                        !f.disk_full
                            && f.corrupt_from_seqno == 0
                            && (reason == "disk_full" || f.durable_seqno >= hb.commit_seqno)
                    })
            })
        };
        record.replicas.iter().filter(|&&r| r != leader).any(takes_over).then_some(reason)
    }

    /// Whether the fresh followers of `shard` that still hear its recorded
    /// leader make a majority with it ([`liveness::followers_vouch`]): then
    /// its silence towards this coordinator alone does not make it lost,
    /// and the cluster view counts it as working, as the reconcile rounds
    /// do.
    pub fn followers_vouch(&self, shard: u32, record: &ShardRecord) -> bool {
        let timeout = Duration::from_millis(self.config.replication.leader_timeout_ms);
        let silence = self.config.replication.replication_timeout().as_millis() as u64;
        let reports = self.follower_reports(shard, record, timeout);
        liveness::followers_vouch(&reports, record.replicas.len(), silence)
    }

    /// What each follower of `shard` (every replica but the recorded
    /// leader) last reported, for `control/liveness.rs`: "fresh" within
    /// three heartbeat intervals (at most half the leader timeout), "recent"
    /// within `timeout`.
    fn follower_reports(&self, shard: u32, record: &ShardRecord, timeout: Duration) -> Vec<FollowerReport> {
        let r = &self.config.replication;
        let fresh = Duration::from_millis((3 * r.heartbeat_ms).min(r.leader_timeout_ms / 2).max(1));
        let seen = self.seen.lock();
        record
            .replicas
            .iter()
            .filter(|&&n| Some(n) != record.leader)
            .map(|n| {
                let node = seen.get(n);
                let hb = node.and_then(|s| s.shards.get(&shard)).map(|(hb, _)| hb);
                let age = node.map(|s| s.at.elapsed());
                FollowerReport {
                    fresh: hb.is_some() && age.is_some_and(|a| a <= fresh),
                    recent: hb.is_some() && age.is_some_and(|a| a <= timeout),
                    follows_leader: hb
                        .is_some_and(|hb| hb.epoch == record.epoch && Some(hb.leader_node_id) == record.leader),
                    leader_silent_ms: hb.map_or(0, |hb| hb.leader_silent_ms),
                }
            })
            .collect()
    }

    /// Milliseconds since `leader` was told it leads `shard` in `epoch`: its
    /// assignment in that epoch concluded (answered, refused or failed), or
    /// it reported leading in it (a coordinator that took over assigns
    /// nothing to a leader already leading). None: not yet.
    fn leader_told_ms(&self, shard: u32, epoch: u64, leader: NodeId) -> Option<u64> {
        let mut told = self.leader_told.lock();
        if let Some((e, at)) = told.get(&shard)
            && *e == epoch
        {
            return Some(at.elapsed().as_millis() as u64);
        }
        let leading = self.heartbeat(leader, shard).is_some_and(|hb| hb.epoch == epoch && hb.is_leader);
        leading.then(|| {
            told.insert(shard, (epoch, Instant::now()));
            0
        })
    }

    /// Notes that the leader of `shard` was told it leads in `epoch` (see
    /// [`Coordinator::leader_told_ms`]); the first time counts.
    fn note_leader_told(&self, shard: u32, epoch: u64) {
        let mut told = self.leader_told.lock();
        if told.get(&shard).is_none_or(|(e, _)| *e != epoch) {
            told.insert(shard, (epoch, Instant::now()));
        }
    }

    pub(super) async fn assign(&self, shard: u32, record: &ShardRecord, leader: NodeId, replica: NodeId) -> bool {
        self.assign_call(shard, record, leader, replica).await.is_some()
    }

    /// Assigns `record` to `replica`; its answer, or none if it refused or
    /// did not answer.
    pub(super) async fn assign_call(
        &self,
        shard: u32,
        record: &ShardRecord,
        leader: NodeId,
        replica: NodeId,
    ) -> Option<walship_proto::log::AssignResponse> {
        // Rounds repeat it only if it is not reported taken by then.
        self.assigned.lock().insert((replica, shard), Instant::now());
        let request = AssignRequest {
            shard_id: shard,
            epoch: record.epoch,
            leader,
            replicas: record.replicas.clone(),
            commit_seqno: record.commit_floor,
            learners: record.learners.clone(),
            joint_replicas: record.joint.clone(),
            fetch_token: self.fetch_tokens.lock().get(&(shard, replica)).cloned().unwrap_or_default(),
            members_version: record.members_version,
        };
        // In a batch with whatever else goes to this node meanwhile.
        let answer = match self.assigns.call(&self.peers, replica, request).await? {
            Ok(answer) => Some(answer),
            Err(status) => {
                tracing::debug!(shard, replica, %status, "assign");
                None
            }
        };
        self.metrics.assigns.with_label_values(&[if answer.is_some() { "ok" } else { "error" }]).inc();
        if replica == leader {
            self.note_leader_told(shard, record.epoch);
        }
        answer
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(ids: &[NodeId]) -> std::collections::BTreeSet<NodeId> {
        ids.iter().copied().collect()
    }

    #[test]
    fn rounds_look_at_every_shard_on_their_cadence_and_at_silent_leaders_meanwhile() {
        let t0 = Instant::now();
        let mut p = Pending::default();
        assert_eq!(p.scope(nodes(&[]), t0), Scope::Every, "the first round after becoming active");
        p.took(&Scope::Every, Duration::from_millis(10));
        assert_eq!(p.scope(nodes(&[]), t0 + Duration::from_millis(20)), Scope::Pending, "nobody silent");
        // A node goes silent: a silence round at once, then once its
        // cost four times over has passed.
        let at = t0 + Duration::from_millis(40);
        assert_eq!(p.scope(nodes(&[2]), at), Scope::LedBy(nodes(&[2])));
        p.took(&Scope::LedBy(nodes(&[2])), Duration::from_millis(5));
        assert_eq!(p.scope(nodes(&[2]), at + Duration::from_millis(19)), Scope::Pending);
        assert_eq!(p.scope(nodes(&[2, 3]), at + Duration::from_millis(20)), Scope::LedBy(nodes(&[2, 3])));
        // Full rounds keep their own cadence, silent nodes or not.
        assert_eq!(p.scope(nodes(&[2]), t0 + FULL_ROUND_EVERY), Scope::Every);
        assert_eq!(p.scope(nodes(&[]), t0 + FULL_ROUND_EVERY + Duration::from_millis(30)), Scope::Pending);
        // A costly full round spaces them out (at most 1 % of the time).
        let t1 = t0 + FULL_ROUND_EVERY;
        p.took(&Scope::Every, Duration::from_millis(40));
        assert_eq!(p.scope(nodes(&[]), t1 + Duration::from_millis(3_999)), Scope::Pending, "4 s after 40 ms");
        assert_eq!(p.scope(nodes(&[]), t1 + Duration::from_secs(4)), Scope::Every);
        // However costly, at least every 10 s.
        let t2 = t1 + Duration::from_secs(4);
        p.took(&Scope::Every, Duration::from_millis(500));
        assert_eq!(p.scope(nodes(&[]), t2 + Duration::from_millis(9_999)), Scope::Pending);
        assert_eq!(p.scope(nodes(&[]), t2 + MAX_FULL_ROUND_EVERY), Scope::Every, "500 ms rounds");
        p.force_full();
        assert_eq!(p.scope(nodes(&[]), t2 + MAX_FULL_ROUND_EVERY), Scope::Every, "forced");
    }
}
