//! Changing a shard's replica set under load (`POST /v1/shards/{id}/replicas`,
//! `walship replica add|remove|replace`).
//!
//! A change never forms a majority from two different sets, and never needs
//! an epoch change of its own (appends keep flowing through it):
//!
//! 1. **Leadership off a leaving replica.** Removing (or replacing) the
//!    leader first fails the shard over to another replica that holds every
//!    acknowledged record.
//! 2. **Learner.** A node being added joins as a *learner*: the leader ships
//!    to it, it seeds from peers and the object store then the leader's
//!    stream (its log is empty), and it counts for nothing — no commit, no
//!    `ALL`, no failover. The coordinator mints it a PeerExchange fetch
//!    token for this task. It is caught up when its durable position,
//!    checked consistent with the leader's log, reaches the commit the
//!    leader reported one poll earlier.
//! 3. **Joint.** The record names the new voting set and keeps the old one
//!    (`joint`); the leader, told so, commits only what a majority of *both*
//!    sets hold, and answers where its log ends at that moment (`s`). A
//!    failover meanwhile needs a majority of both sets and goes back to the
//!    old one (everything acknowledged is on a majority of it).
//! 4. **Final.** Once a majority of the new set holds the leader's log
//!    through `s` (checked against the leader's epoch ends), every record
//!    acknowledged before the joint rule is on a majority of the new set,
//!    and every record after it was committed under the joint rule: the
//!    record drops the old set and the leader commits by the new one alone.
//!
//! A change that cannot finish (the learner does not catch up in time, the
//! new majority does not form, a failover went back) undoes what it did:
//! the learner is dropped, a joint record goes back to the old set. One
//! change per shard at a time; none while the shard has no leader.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use walship_proto::log::{AssignResponse, FenceResponse};

use super::*;

/// Changes remembered (running and finished; a coordinator restart forgets them).
const CHANGES_KEPT: usize = 100;
/// How often a running change looks at the replicas' positions.
const POLL: Duration = Duration::from_millis(250);
/// How long the new set may take to hold the leader's log once joint.
const JOINT_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the leader's assignment is retried before a step gives up.
const ASSIGN_TIMEOUT: Duration = Duration::from_secs(5);

fn default_catch_up_timeout() -> u64 {
    600
}

/// What a replica change does.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ReplicaAction {
    /// One more voting replica.
    Add,
    /// One voting replica fewer (never below `replication.min_replicas`).
    Remove,
    /// One voting replica for another (a dead node's, typically).
    Replace,
}

impl ReplicaAction {
    pub fn as_str(self) -> &'static str {
        match self {
            ReplicaAction::Add => "add",
            ReplicaAction::Remove => "remove",
            ReplicaAction::Replace => "replace",
        }
    }
}

/// `POST /v1/shards/{id}/replicas`, by `action`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
#[serde(tag = "action", rename_all = "lowercase", deny_unknown_fields)]
pub enum ReplicaChangeRequest {
    /// One more voting replica.
    Add {
        /// The node to add (default: placement chooses a live node outside
        /// the set, in a region the set does not cover when one is free).
        #[serde(default, deserialize_with = "crate::control::lenient::opt_int")]
        node: Option<NodeId>,
        /// Accept a named node whose region another replica already covers
        /// while a live node in an uncovered region exists.
        #[serde(default)]
        allow_same_region: bool,
        /// How long the new replica may take to seed and catch up, in seconds.
        #[serde(default = "default_catch_up_timeout", deserialize_with = "crate::control::lenient::int")]
        #[schema(minimum = 1, maximum = 86400)]
        catch_up_timeout_s: u64,
    },
    /// One voting replica fewer (never below `replication.min_replicas`).
    Remove {
        /// The replica to take out.
        #[serde(deserialize_with = "crate::control::lenient::int")]
        node: NodeId,
    },
    /// One voting replica for another.
    Replace {
        /// The replica to take out.
        #[serde(deserialize_with = "crate::control::lenient::int")]
        node: NodeId,
        /// The node taking its place (default: placement chooses).
        #[serde(default, deserialize_with = "crate::control::lenient::opt_int")]
        with: Option<NodeId>,
        #[serde(default)]
        allow_same_region: bool,
        #[serde(default = "default_catch_up_timeout", deserialize_with = "crate::control::lenient::int")]
        #[schema(minimum = 1, maximum = 86400)]
        catch_up_timeout_s: u64,
    },
}

impl ReplicaChangeRequest {
    pub fn action(&self) -> ReplicaAction {
        match self {
            ReplicaChangeRequest::Add { .. } => ReplicaAction::Add,
            ReplicaChangeRequest::Remove { .. } => ReplicaAction::Remove,
            ReplicaChangeRequest::Replace { .. } => ReplicaAction::Replace,
        }
    }

    fn catch_up_timeout_s(&self) -> u64 {
        match self {
            ReplicaChangeRequest::Add { catch_up_timeout_s, .. }
            | ReplicaChangeRequest::Replace { catch_up_timeout_s, .. } => *catch_up_timeout_s,
            ReplicaChangeRequest::Remove { .. } => default_catch_up_timeout(),
        }
    }

    fn allow_same_region(&self) -> bool {
        match self {
            ReplicaChangeRequest::Add { allow_same_region, .. }
            | ReplicaChangeRequest::Replace { allow_same_region, .. } => *allow_same_region,
            ReplicaChangeRequest::Remove { .. } => false,
        }
    }
}

/// A replica change, running or finished.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct ReplicaChange {
    pub id: String,
    pub shard: u32,
    pub action: ReplicaAction,
    pub adding: Option<NodeId>,
    pub removing: Option<NodeId>,
    /// The voting set before and after.
    pub from_replicas: Vec<NodeId>,
    pub to_replicas: Vec<NodeId>,
    /// `running`, `done` or `failed`.
    pub state: String,
    /// The step: `moving_leadership`, `catching_up`, `joint`, `finished`.
    pub step: String,
    pub error: Option<String>,
    pub started_unix_ms: u64,
    pub finished_unix_ms: Option<u64>,
    /// Where leadership went when the leaving replica led.
    pub leadership_moved_to: Option<NodeId>,
    /// The new replica's durable position and the leader's commit, as last seen.
    pub learner_durable_seqno: u64,
    pub leader_commit_seqno: u64,
    /// Segment bytes the new replica applied, by source.
    pub bytes_peer: u64,
    pub bytes_archive: u64,
    pub bytes_stream: u64,
    pub bytes_push: u64,
    /// Seeding and catching up: time and rate (all sources).
    pub catch_up_ms: u64,
    pub catch_up_mib_per_s: f64,
    /// Time in the joint state.
    pub joint_ms: u64,
    pub took_ms: u64,
}

/// The coordinator's replica changes.
#[derive(Default)]
pub struct ReplicaChanges {
    reports: Mutex<BTreeMap<String, ReplicaChange>>,
    next: AtomicU64,
    running: Mutex<BTreeSet<u32>>,
}

impl ReplicaChanges {
    pub fn get(&self, id: &str) -> Option<ReplicaChange> {
        self.reports.lock().get(id).cloned()
    }

    /// Shards whose replica change is running.
    pub fn shards_changing(&self) -> BTreeSet<u32> {
        self.running.lock().clone()
    }

    pub fn list(&self) -> Vec<ReplicaChange> {
        let mut all: Vec<_> = self.reports.lock().values().cloned().collect();
        all.sort_by_key(|c| c.started_unix_ms);
        all
    }

    fn update(&self, id: &str, f: impl FnOnce(&mut ReplicaChange)) {
        if let Some(c) = self.reports.lock().get_mut(id) {
            f(c);
        }
    }

    fn insert(&self, change: ReplicaChange) {
        let mut reports = self.reports.lock();
        reports.insert(change.id.clone(), change);
        while reports.len() > CHANGES_KEPT {
            let Some(oldest) = reports.values().filter(|c| c.state != "running").min_by_key(|c| c.started_unix_ms)
            else {
                break;
            };
            let oldest = oldest.id.clone();
            reports.remove(&oldest);
        }
    }
}

/// What a change will do, settled when it is asked for.
#[derive(Debug, Clone)]
struct Plan {
    adding: Option<NodeId>,
    removing: Option<NodeId>,
    catch_up_timeout: Duration,
}

fn conflict(code: &'static str, message: String) -> CoordError {
    CoordError::Conflict { code, message }
}

/// Whether `a` holds the leader's log through `target`: its durable
/// records reach it and agree with the leader's (the same epoch as the
/// leader's last record, or the leader's log keeps `a`'s last epoch at
/// least that far: log matching by epochs, as failover ranks replicas).
fn holds_through(a: &FenceResponse, leader: &FenceResponse, target: u64, leader_epoch_end: Option<u64>) -> bool {
    let held = a.last_seqno.min(a.durable_seqno);
    if a.node_id == leader.node_id || target == 0 {
        return held >= target;
    }
    held >= target && (a.last_epoch == leader.last_epoch || leader_epoch_end.is_some_and(|end| end >= target))
}

impl Coordinator {
    /// Installs what mints PeerExchange fetch tokens for replica changes:
    /// `(task id, shard, time to live)` to the token.
    pub fn set_token_minter(&self, mint: TokenMinter) {
        let _ = self.token_minter.set(mint);
    }

    /// A PeerExchange fetch token for `task` on `shard`, valid for `ttl`
    /// (none when no minter was installed: nodes then sign their own).
    pub fn mint_fetch_token(&self, task: &str, shard: u32, ttl: Duration) -> Option<String> {
        self.token_minter.get().map(|mint| mint(task, shard, ttl))
    }

    /// Starts a replica change; answers its report (state `running`).
    pub fn start_replica_change(
        self: &Arc<Self>,
        shard: u32,
        request: ReplicaChangeRequest,
    ) -> Result<ReplicaChange, CoordError> {
        let action = request.action();
        if !(1..=86_400).contains(&request.catch_up_timeout_s()) {
            return Err(CoordError::BadRequest(format!(
                "catch_up_timeout_s {} is outside 1..=86400",
                request.catch_up_timeout_s()
            )));
        }
        let record = self.shard_record(shard)?;
        let plan = self.plan(shard, &record, &request)?;
        if !self.changes.running.lock().insert(shard) {
            return Err(conflict("change_in_progress", format!("a replica change of shard {shard} is running")));
        }
        let mut to: Vec<NodeId> =
            record.replicas.iter().copied().filter(|&n| Some(n) != plan.removing).chain(plan.adding).collect();
        to.sort_unstable();
        let id = format!("replica-{}-{}", action.as_str(), self.changes.next.fetch_add(1, Ordering::Relaxed) + 1);
        let change = ReplicaChange {
            id: id.clone(),
            shard,
            action,
            adding: plan.adding,
            removing: plan.removing,
            from_replicas: record.replicas.clone(),
            to_replicas: to,
            state: "running".into(),
            step: "starting".into(),
            error: None,
            started_unix_ms: now_ms(),
            finished_unix_ms: None,
            leadership_moved_to: None,
            learner_durable_seqno: 0,
            leader_commit_seqno: 0,
            bytes_peer: 0,
            bytes_archive: 0,
            bytes_stream: 0,
            bytes_push: 0,
            catch_up_ms: 0,
            catch_up_mib_per_s: 0.0,
            joint_ms: 0,
            took_ms: 0,
        };
        self.changes.insert(change.clone());
        tracing::info!(id = %id, shard, action = action.as_str(), adding = ?plan.adding, removing = ?plan.removing, "replica change");
        let me = self.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let result = me.drive_change(&id, shard, &plan).await;
            if let Some(new) = plan.adding {
                me.fetch_tokens.lock().remove(&(shard, new));
            }
            me.changes.running.lock().remove(&shard);
            let outcome = if result.is_ok() { "done" } else { "failed" };
            me.metrics.replica_changes.with_label_values(&[action.as_str(), outcome]).inc();
            match &result {
                Ok(()) => {
                    tracing::info!(id = %id, shard, took_ms = started.elapsed().as_millis() as u64, "replica change done")
                }
                Err(e) => tracing::warn!(id = %id, shard, error = %e, "replica change failed; undone"),
            }
            me.changes.update(&id, |c| {
                c.state = if result.is_ok() { "done" } else { "failed" }.into();
                c.step = "finished".into();
                c.error = result.err().map(|e| e.to_string());
                c.finished_unix_ms = Some(now_ms());
                c.took_ms = started.elapsed().as_millis() as u64;
            });
        });
        Ok(change)
    }

    /// Settles who joins and who leaves, or refuses (nothing changed).
    fn plan(&self, shard: u32, record: &ShardRecord, request: &ReplicaChangeRequest) -> Result<Plan, CoordError> {
        if record.leader.is_none() {
            return Err(conflict("failover_in_progress", format!("shard {shard} has no leader now")));
        }
        if !record.learners.is_empty() || !record.joint.is_empty() || self.changes.running.lock().contains(&shard) {
            return Err(conflict("change_in_progress", format!("a replica change of shard {shard} is running")));
        }
        let known = |n: NodeId| -> Result<NodeId, CoordError> {
            if self.config.node(n).is_none() {
                return Err(conflict("unknown_node", format!("node {n} is not in the cluster config")));
            }
            Ok(n)
        };
        let leaving = |n: NodeId| -> Result<NodeId, CoordError> {
            let n = known(n)?;
            if !record.replicas.contains(&n) {
                return Err(conflict("not_a_replica", format!("node {n} holds no replica of shard {shard}")));
            }
            Ok(n)
        };
        let (adding, removing) = match *request {
            ReplicaChangeRequest::Add { node, .. } => (Some(node), None),
            ReplicaChangeRequest::Remove { node } => {
                let gone = leaving(node)?;
                let min = self.config.replication.min_replicas;
                if record.replicas.len() - 1 < min {
                    return Err(conflict(
                        "below_min_replicas",
                        format!(
                            "removing node {gone} would leave shard {shard} {} voting replicas, below replication.min_replicas = {min}; add one first, or replace it",
                            record.replicas.len() - 1
                        ),
                    ));
                }
                (None, Some(gone))
            }
            ReplicaChangeRequest::Replace { node, with, .. } => (Some(with), Some(leaving(node)?)),
        };
        let adding = match adding {
            None => None,
            Some(named) => {
                let kept: Vec<NodeId> = record.replicas.iter().copied().filter(|&n| Some(n) != removing).collect();
                let best = self.place(record, &kept, removing);
                Some(match named {
                    None => best.ok_or_else(|| {
                        conflict(
                            "no_candidate",
                            format!("no live node outside shard {shard}'s replica set; name one (`node`, or `with` for replace)"),
                        )
                    })?,
                    Some(n) => {
                        let n = known(n)?;
                        if record.members().contains(&n) || Some(n) == removing {
                            return Err(conflict("already_a_replica", format!("node {n} already holds shard {shard}")));
                        }
                        let region = |m: NodeId| self.config.node(m).map(|s| s.region);
                        let covered: BTreeSet<_> = kept.iter().map(|&m| region(m)).collect();
                        if !request.allow_same_region()
                            && covered.contains(&region(n))
                            && let Some(b) = best.filter(|&b| !covered.contains(&region(b)))
                        {
                            return Err(conflict(
                                "same_region",
                                format!(
                                    "node {n} is in region {} which shard {shard}'s replicas already cover, while node {b} (region {}) is live; pass allow_same_region to place it anyway",
                                    region(n).unwrap_or(0),
                                    region(b).unwrap_or(0)
                                ),
                            ));
                        }
                        n
                    }
                })
            }
        };
        Ok(Plan { adding, removing, catch_up_timeout: Duration::from_secs(request.catch_up_timeout_s()) })
    }

    /// The best live node to add beside `kept`: outside the shard, heard
    /// from lately, disk not full; first in a region `kept` does not cover,
    /// then hosting the fewest shards, then the lowest id.
    fn place(&self, record: &ShardRecord, kept: &[NodeId], removing: Option<NodeId>) -> Option<NodeId> {
        let region = |m: NodeId| self.config.node(m).map(|s| s.region);
        let covered: BTreeSet<_> = kept.iter().map(|&m| region(m)).collect();
        let recent = Duration::from_millis(self.config.replication.leader_timeout_ms.max(1_000));
        let members = record.members();
        let seen = self.seen.lock();
        self.config
            .nodes
            .iter()
            .map(|n| n.id)
            .filter(|n| !members.contains(n) && Some(*n) != removing)
            .filter_map(|n| {
                let s = seen.get(&n).filter(|s| s.at.elapsed() <= recent)?;
                let disk_full = s.shards.values().any(|(hb, _)| hb.disk_full);
                (!disk_full).then_some((covered.contains(&region(n)), s.shards.len(), n))
            })
            .min()
            .map(|(_, _, n)| n)
    }

    async fn drive_change(self: &Arc<Self>, id: &str, shard: u32, plan: &Plan) -> Result<(), CoordError> {
        let step = |s: &str| self.changes.update(id, |c| c.step = s.into());
        // 1. Leadership off a leaving replica.
        let record = self.shard_record(shard)?;
        if plan.removing.is_some() && record.leader == plan.removing {
            step("moving_leadership");
            let outcome =
                self.failover_replacing(shard, FailoverRequest::default(), "replica_change", plan.removing).await?;
            if outcome.to == plan.removing {
                return Err(conflict(
                    "not_caught_up",
                    format!(
                        "no other replica of shard {shard} holds every acknowledged record: leadership stays on node {}",
                        outcome.to.unwrap_or(0)
                    ),
                ));
            }
            self.changes.update(id, |c| c.leadership_moved_to = outcome.to);
        }
        // 2. The new replica seeds and catches up as a learner.
        if let Some(new) = plan.adding {
            step("catching_up");
            if let Err(e) = self.catch_up_learner(id, shard, new, plan.catch_up_timeout).await {
                self.drop_learner(shard, new).await;
                return Err(e);
            }
        }
        // 3. Joint.
        step("joint");
        let joint_started = Instant::now();
        let (epoch, old, new_voters, log_end) = self.enter_joint(shard, plan).await?;
        // Tests hold the joint step open to fail the shard over inside it.
        #[cfg(feature = "testing")]
        if let Some(ms) = (|| {
            fail::fail_point!("replica_change::joint", |ms| ms.and_then(|ms| ms.parse::<u64>().ok()));
            None
        })() {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        let formed = self.wait_new_majority(shard, epoch, &new_voters, log_end).await;
        self.changes.update(id, |c| c.joint_ms = joint_started.elapsed().as_millis() as u64);
        if let Err(e) = formed {
            self.leave_joint(shard, epoch, &old, false).await;
            return Err(e);
        }
        // 4. The new set alone.
        if !self.leave_joint(shard, epoch, &new_voters, true).await {
            return Err(conflict(
                "failover_in_progress",
                format!("shard {shard} failed over during the change, back to its replica set before it"),
            ));
        }
        Ok(())
    }

    /// Adds `new` as a learner and waits until it holds what the leader had
    /// committed one poll earlier (consistently with the leader's log).
    async fn catch_up_learner(
        self: &Arc<Self>,
        id: &str,
        shard: u32,
        new: NodeId,
        timeout: Duration,
    ) -> Result<(), CoordError> {
        if let Some(mint) = self.token_minter.get() {
            let token = mint(id, shard, timeout + Duration::from_secs(60));
            self.fetch_tokens.lock().insert((shard, new), token);
        }
        self.mutate(|s| {
            let r = s.shard_mut(shard).ok_or(CoordError::UnknownShard(shard))?;
            if !r.joint.is_empty() || r.members().contains(&new) {
                return Err(conflict("change_in_progress", format!("shard {shard} changed meanwhile")));
            }
            r.learners.push(new);
            r.members_version += 1;
            Ok(())
        })
        .await?;
        self.assign_members(shard).await?;
        let started = Instant::now();
        let mut previous_commit: Option<u64> = None;
        loop {
            if started.elapsed() > timeout {
                return Err(conflict(
                    "not_caught_up",
                    format!("node {new} did not catch up with shard {shard} within {} s", timeout.as_secs()),
                ));
            }
            tokio::time::sleep(POLL).await;
            let record = self.shard_record(shard)?;
            if !record.learners.contains(&new) {
                return Err(conflict(
                    "change_in_progress",
                    format!("node {new} is no longer a learner of shard {shard}"),
                ));
            }
            let Some(leader) = record.leader else {
                previous_commit = None;
                continue;
            };
            let answers = self.positions(shard, &[leader, new], None).await;
            let (Some(l), Some(a)) =
                (answers.iter().find(|a| a.node_id == leader), answers.iter().find(|a| a.node_id == new))
            else {
                // Not hosting it yet (its assignment is retried by reconciliation).
                continue;
            };
            let applied =
                a.applied_peer_bytes + a.applied_archive_bytes + a.applied_stream_bytes + a.applied_push_bytes;
            let secs = started.elapsed().as_secs_f64();
            self.changes.update(id, |c| {
                c.learner_durable_seqno = a.durable_seqno;
                c.leader_commit_seqno = l.commit_seqno;
                c.bytes_peer = a.applied_peer_bytes;
                c.bytes_archive = a.applied_archive_bytes;
                c.bytes_stream = a.applied_stream_bytes;
                c.bytes_push = a.applied_push_bytes;
                c.catch_up_ms = (secs * 1000.0) as u64;
                c.catch_up_mib_per_s = if secs > 0.0 { applied as f64 / secs / (1 << 20) as f64 } else { 0.0 };
            });
            if let Some(target) = previous_commit
                && a.epoch_seen == record.epoch
            {
                let end = self.epoch_end(leader, shard, a.last_epoch).await;
                if holds_through(a, l, target, end) {
                    return Ok(());
                }
            }
            previous_commit = Some(l.commit_seqno);
        }
    }

    /// A record left mid-change with no change running here (its
    /// coordinator stopped or lost its lease during it) is undone: learners
    /// dropped, a joint record back to the set before the change (safe:
    /// everything acknowledged is on a majority of it). Called by
    /// reconciliation; the shard counts as changing until it is done.
    pub(super) fn undo_abandoned_change(self: &Arc<Self>, shard: u32, record: &ShardRecord) {
        if record.learners.is_empty() && record.joint.is_empty() {
            return;
        }
        if !self.changes.running.lock().insert(shard) {
            return;
        }
        let (me, epoch) = (self.clone(), record.epoch);
        tokio::spawn(async move {
            let undone = me
                .mutate(|s| {
                    let r = s.shard_mut(shard).ok_or(CoordError::UnknownShard(shard))?;
                    if r.epoch != epoch || (r.learners.is_empty() && r.joint.is_empty()) {
                        return Ok(false);
                    }
                    if !r.joint.is_empty() {
                        r.replicas = std::mem::take(&mut r.joint);
                    }
                    r.learners.clear();
                    r.members_version += 1;
                    Ok(true)
                })
                .await;
            if let Ok(true) = undone {
                tracing::warn!(shard, epoch, "a replica change left unfinished (by a stopped coordinator) is undone");
                let _ = me.assign_members(shard).await;
            }
            me.changes.running.lock().remove(&shard);
        });
    }

    /// Drops a learner after a failed change (best effort: a later
    /// change or failover assigns the record as it stands).
    async fn drop_learner(&self, shard: u32, new: NodeId) {
        let dropped = self
            .mutate(|s| {
                let r = s.shard_mut(shard).ok_or(CoordError::UnknownShard(shard))?;
                r.learners.retain(|&n| n != new);
                r.members_version += 1;
                Ok(())
            })
            .await;
        if dropped.is_ok() {
            let _ = self.assign_members(shard).await;
        }
    }

    /// Records the joint state (new voters, the old set kept) and tells the
    /// leader; answers the epoch, both sets, and where the leader's log
    /// ended once it committed by the joint rule.
    async fn enter_joint(&self, shard: u32, plan: &Plan) -> Result<(u64, Vec<NodeId>, Vec<NodeId>, u64), CoordError> {
        let (epoch, old, new_voters) = self
            .mutate(|s| {
                let r = s.shard_mut(shard).ok_or(CoordError::UnknownShard(shard))?;
                let leader = r.leader.ok_or_else(|| conflict("failover_in_progress", format!("shard {shard} has no leader now")))?;
                if Some(leader) == plan.removing {
                    return Err(conflict(
                        "failover_in_progress",
                        format!("leadership of shard {shard} moved back to node {leader}, the replica being removed; try again"),
                    ));
                }
                if !r.joint.is_empty() {
                    return Err(conflict("change_in_progress", format!("shard {shard} is already changing")));
                }
                let mut new_voters: Vec<NodeId> =
                    r.replicas.iter().copied().filter(|&n| Some(n) != plan.removing).chain(plan.adding).collect();
                new_voters.sort_unstable();
                new_voters.dedup();
                let old = std::mem::replace(&mut r.replicas, new_voters.clone());
                r.joint = old.clone();
                r.learners.retain(|n| !new_voters.contains(n));
                r.members_version += 1;
                Ok((r.epoch, old, new_voters))
            })
            .await?;
        match self.assign_members(shard).await {
            Ok(answer) => Ok((epoch, old, new_voters, answer.last_seqno)),
            Err(e) => {
                self.leave_joint(shard, epoch, &old, false).await;
                Err(e)
            }
        }
    }

    /// Waits until a majority of `new_voters` holds the leader's log through
    /// `log_end`, while the shard stays joint in `epoch`.
    async fn wait_new_majority(
        &self,
        shard: u32,
        epoch: u64,
        new_voters: &[NodeId],
        log_end: u64,
    ) -> Result<(), CoordError> {
        let started = Instant::now();
        let needed = new_voters.len() / 2 + 1;
        while started.elapsed() < JOINT_TIMEOUT {
            let record = self.shard_record(shard)?;
            if record.epoch != epoch || record.joint.is_empty() {
                return Err(conflict(
                    "failover_in_progress",
                    format!("shard {shard} failed over during the change, back to its replica set before it"),
                ));
            }
            let Some(leader) = record.leader else { break };
            let answers = self.positions(shard, new_voters, None).await;
            if let Some(l) = answers.iter().find(|a| a.node_id == leader) {
                let mut holding = 0;
                for a in &answers {
                    let end = if a.last_epoch == l.last_epoch {
                        None
                    } else {
                        self.epoch_end(leader, shard, a.last_epoch).await
                    };
                    if a.epoch_seen == epoch && holds_through(a, l, log_end, end) {
                        holding += 1;
                    }
                }
                if holding >= needed {
                    return Ok(());
                }
            }
            tokio::time::sleep(POLL).await;
        }
        Err(conflict(
            "not_caught_up",
            format!(
                "a majority of shard {shard}'s new replica set {new_voters:?} did not hold its log within {} s",
                JOINT_TIMEOUT.as_secs()
            ),
        ))
    }

    /// Ends the joint state of `epoch` with `voters` (the new set when
    /// `forward`, the old one to undo), and tells the replicas. False when
    /// the shard is no longer joint in that epoch (a failover ended it).
    async fn leave_joint(&self, shard: u32, epoch: u64, voters: &[NodeId], forward: bool) -> bool {
        let left = self
            .mutate(|s| {
                let r = s.shard_mut(shard).ok_or(CoordError::UnknownShard(shard))?;
                if r.epoch != epoch || r.joint.is_empty() {
                    return Ok(false);
                }
                if !forward {
                    // The record goes back to the set before the change;
                    // a node that was being added leaves with it.
                    r.learners.clear();
                }
                r.replicas = voters.to_vec();
                r.members_version += 1;
                r.joint.clear();
                Ok(true)
            })
            .await
            .unwrap_or(false);
        if left {
            let _ = self.assign_members(shard).await;
        }
        left
    }

    /// Assigns the shard's record as it stands to every member, the leader
    /// first (retried for [`ASSIGN_TIMEOUT`]; its answer is returned).
    async fn assign_members(&self, shard: u32) -> Result<AssignResponse, CoordError> {
        let started = Instant::now();
        loop {
            let record = self.shard_record(shard)?;
            if let Some(leader) = record.leader
                && let Some(answer) = self.assign_call(shard, &record, leader, leader).await
            {
                let others: Vec<NodeId> = record.members().into_iter().filter(|&n| n != leader).collect();
                futures::future::join_all(others.iter().map(|&n| self.assign(shard, &record, leader, n))).await;
                return Ok(answer);
            }
            if started.elapsed() > ASSIGN_TIMEOUT {
                return Err(conflict(
                    "failover_in_progress",
                    format!(
                        "shard {shard}'s leader did not take the new replica set within {} s",
                        ASSIGN_TIMEOUT.as_secs()
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(node: NodeId, last_epoch: u64, last: u64, durable: u64) -> FenceResponse {
        FenceResponse { node_id: node, last_epoch, last_seqno: last, durable_seqno: durable, ..Default::default() }
    }

    #[test]
    fn a_replica_holds_the_log_only_through_what_is_durable_and_agrees() {
        let leader = at(1, 5, 100, 100);
        // The same last epoch as the leader: its records are the leader's.
        assert!(holds_through(&at(2, 5, 100, 100), &leader, 100, None));
        // Durable short of the target.
        assert!(!holds_through(&at(2, 5, 100, 90), &leader, 100, None));
        // An older last epoch: only as far as the leader kept that epoch.
        assert!(!holds_through(&at(2, 4, 120, 120), &leader, 100, Some(80)));
        assert!(holds_through(&at(2, 4, 120, 120), &leader, 100, Some(100)));
        assert!(!holds_through(&at(2, 4, 120, 120), &leader, 100, None));
        // The leader holds its own log through what is durable.
        assert!(holds_through(&leader, &leader, 100, None));
        assert!(!holds_through(&leader, &leader, 101, None));
        // An empty log holds an empty target.
        assert!(holds_through(&at(2, 0, 0, 0), &leader, 0, None));
    }
}
