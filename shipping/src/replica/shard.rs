//! One shard's replica on this node: its role rules ([`ReplicaCore`], behind
//! a lock), and the watches the rest of the node reads (what is readable,
//! what every replica holds, the leader lease, a generation bumped whenever
//! it stops leading).
//!
//! Invariants kept here:
//! * `readable` only moves forward: the commit position (leader) or
//!   `min(durable, leader's commit)` (follower); only a truncation of this
//!   replica's log lowers it, to the truncation point;
//! * an append waiting for a commit, an `ALL` acknowledgement or the lease
//!   gives up as soon as this replica stops leading (`generation`): its
//!   outcome is then unknown, never reported as acknowledged;
//! * role changes are serialised by `transition` (an async lock: the shell
//!   persists the epoch and settles the WAL while holding it).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;
use walship_wal::ShardId;
use walship_wal::position as watch;

use crate::NodeId;
use crate::core::Epoch;
use crate::core::leader::LeaderCore;
use crate::core::replica::{ReplicaCore, Role, View};
use crate::metrics::ReplicationMetrics;
use crate::replica::now_us;

/// One leadership term of this replica: created when it starts leading,
/// dropped (and its tasks stopped) when it stops.
pub(crate) struct LeaderState {
    pub(crate) epoch: u64,
    pub(crate) core: Mutex<LeaderCore>,
    /// What the WAL is committing (the core's `flushing`; its durable
    /// position without early shipping): shippers with segments in flight
    /// wait on it.
    pub(crate) ship_limit: watch::Sender,
    /// Stops this leadership's tasks.
    pub(crate) stop: CancellationToken,
    /// The follower this leader chose to archive the shard (0: itself),
    /// sent with every shipment (`archiver_node_id`).
    pub(crate) archiver: AtomicU32,
    /// The newest archived seqno a follower archiving the shard reported.
    pub(crate) archived_by_follower: Arc<AtomicU64>,
    /// Each follower's shipper stops with its token (a child of `stop`).
    pub(crate) shippers: Mutex<std::collections::BTreeMap<NodeId, CancellationToken>>,
    /// Followers this shard is quiet towards, and the link standing in for
    /// its keepalives to each (`super::quiet`).
    pub(crate) quiet: Mutex<std::collections::BTreeMap<NodeId, Arc<super::quiet::QuietLink>>>,
    /// Fires when a follower stops being quiet: the lease watch then
    /// judges the lease by the core again.
    pub(crate) quiet_changed: tokio::sync::Notify,
    /// Bumped when a follower pulls a catch-up stream from this leadership
    /// (it has reconciled its log with it): shippers that follower refused
    /// meanwhile retry at once instead of waiting out their backoff.
    pub(crate) pulled: tokio::sync::watch::Sender<u64>,
}

/// What the follower side keeps between shipments.
pub(crate) struct FollowerState {
    /// Serialises queueing to the WAL so frames enter it in seqno order.
    pub(crate) apply_lock: tokio::sync::Mutex<()>,
    /// One past everything applied or queued.
    pub(crate) next_expected: watch::Sender,
    /// The newest commit position a leader told us.
    pub(crate) leader_commit: LeaderCommit,
    pub(crate) catchup_running: AtomicBool,
    /// The last seqno held before a corrupt tail was truncated: records up
    /// to it applied again are refetched bytes (0: none pending).
    pub(crate) refetch_through: AtomicU64,
    pub(crate) last_contact_us: AtomicU64,
    /// The newest archived seqno a leader told us (retention keeps what
    /// the archive lacks while the cluster archives).
    pub(crate) archived: AtomicU64,
    /// Segment bytes applied to this shard since start, by [`super::Source`]
    /// (push, stream, archive, peer): what a re-seed drill reports per source.
    pub(crate) applied_bytes: [AtomicU64; 4],
    /// The replica the leader said archives the shard (0: the leader).
    pub(crate) archiver: AtomicU32,
    /// The tiers the current rebuild may take sealed segments from
    /// ([`super::wipe::Tiers`] bits; all outside a drill's rebuild).
    pub(crate) rebuild_tiers: std::sync::atomic::AtomicU8,
}

/// Who holds a shard, as the coordinator last said (the cluster config
/// until it speaks).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Members {
    /// The voting replica set.
    pub voters: Vec<NodeId>,
    /// Replicas being added: shipped to, never counted.
    pub learners: Vec<NodeId>,
    /// While the set changes: the voting set before the change.
    pub joint: Vec<NodeId>,
    /// The assignment these came with: its epoch and `members_version`
    /// (an older one never replaces them).
    pub epoch: u64,
    pub version: u64,
}

impl Members {
    /// Every node holding the shard but `me`.
    pub fn others(&self, me: NodeId) -> Vec<NodeId> {
        let mut all: Vec<NodeId> =
            self.voters.iter().chain(&self.learners).chain(&self.joint).copied().filter(|&n| n != me).collect();
        all.sort_unstable();
        all.dedup();
        all
    }

    /// Whether these sets are at least as new as `other`'s.
    pub fn not_older_than(&self, other: &Members) -> bool {
        (self.epoch, self.version) >= (other.epoch, other.version)
    }

    /// The voters of both sets (who may lead).
    pub fn all_voters(&self) -> Vec<NodeId> {
        let mut all: Vec<NodeId> = self.voters.iter().chain(&self.joint).copied().collect();
        all.sort_unstable();
        all.dedup();
        all
    }
}

/// One shard's replica on this node.
pub struct ShardReplica {
    pub shard: ShardId,
    /// Who holds the shard; changed by assignments.
    pub(crate) members: Mutex<Members>,
    /// The role and epoch rules; every decision about them is taken here.
    pub(crate) rules: Rules,
    /// What reads may return through: the commit position (leader) or
    /// `min(durable, leader's commit)` (follower).
    pub(crate) readable: watch::Sender,
    /// Highest seqno durable on every replica (leader only).
    pub(crate) all_durable: watch::Sender,
    /// Bumped whenever this replica stops leading: appends waiting for a
    /// commit under the old leadership give up (their outcome is unknown).
    pub(crate) generation: watch::Sender,
    /// Until when (µs) the leader lease holds ([`LeaderCore::lease_until`];
    /// `u64::MAX` without a bound, 0 while not leading).
    pub(crate) lease_until: watch::Sender,
    pub(crate) leader: Mutex<Option<Arc<LeaderState>>>,
    pub(crate) follower: FollowerState,
    /// Serialises role changes.
    pub(crate) transition: tokio::sync::Mutex<()>,
    /// Bumped by anything that may change this replica's heartbeat report
    /// (a role change, a shipment, leaving quiet): see
    /// [`ShardReplica::settled`].
    activity: AtomicU64,
    /// The `activity` at which a report found this replica quiet.
    settled_at: AtomicU64,
    /// Where [`ShardReplica::unsettle`] says so, for the node's loops.
    touched: Arc<Touched>,
    /// `walship_commit_seqno` of this shard, looked up once (a label
    /// lookup formats and hashes the shard id: per commit, at thousands of
    /// shards, it showed in profiles).
    commit_gauge: std::sync::OnceLock<Option<prometheus::IntGauge>>,
    /// Whether its archive loop runs (only while this node leads or
    /// archives the shard: see `ReplicationNode::ensure_archiving`).
    pub(crate) archiving: std::sync::atomic::AtomicBool,
    /// Bumped by every pause or resume (drills): a pause's lease expires
    /// only if no later pause or resume came since.
    pub(crate) pause_generation: AtomicU64,
}

/// The shards whose activity moved since each of the node's periodic loops
/// last looked (heartbeat reports, follower gauges), so that those loops
/// visit only them and the replicas they found unsettled, never every
/// shard: an idle shard costs a tick nothing.
#[derive(Default)]
pub(crate) struct Touched {
    heartbeats: Mutex<std::collections::BTreeSet<ShardId>>,
    gauges: Mutex<std::collections::BTreeSet<ShardId>>,
    /// Bumped by every change to what any replica's rules' `follows` reads
    /// on this node, while that replica's rules are still locked: see
    /// [`Touched::rules_changes`].
    rules_changes: AtomicU64,
}

impl Touched {
    /// How many times what any replica's rules' `follows` reads
    /// ([`ReplicaCore::follows_inputs`]) changed on this node. A reader that
    /// saw the same count twice knows no such change finished in between (a
    /// change bumps it before it releases the rules' lock), so whatever
    /// `follows` answered then still holds: a node keepalive re-checks its
    /// quiet shards only when this moved (`super::quiet`). Shipments lock
    /// the rules for a change on every push; they bump it only when they
    /// change a role, an epoch or what else `follows` reads.
    pub(crate) fn rules_changes(&self) -> u64 {
        self.rules_changes.load(Ordering::SeqCst)
    }

    fn mark(&self, shard: ShardId) {
        self.heartbeats.lock().insert(shard);
        self.gauges.lock().insert(shard);
    }

    /// The shards touched since the heartbeat loop last took them.
    pub(crate) fn take_heartbeats(&self) -> std::collections::BTreeSet<ShardId> {
        std::mem::take(&mut self.heartbeats.lock())
    }

    /// The shards touched since the gauge loop last took them.
    pub(crate) fn take_gauges(&self) -> std::collections::BTreeSet<ShardId> {
        std::mem::take(&mut self.gauges.lock())
    }
}

/// A replica's [`ReplicaCore`] behind its lock. A change through the guard
/// (any `&mut` use of it) that changes what `follows` reads bumps the
/// node's [`Touched::rules_changes`] before the lock is released.
pub(crate) struct Rules {
    core: Mutex<ReplicaCore>,
    touched: Arc<Touched>,
}

impl Rules {
    pub(crate) fn lock(&self) -> RulesGuard<'_> {
        RulesGuard { core: self.core.lock(), touched: &self.touched, before: None }
    }
}

/// The locked rules; see [`Rules`].
pub(crate) struct RulesGuard<'a> {
    core: parking_lot::MutexGuard<'a, ReplicaCore>,
    touched: &'a Touched,
    /// What `follows` read when the guard was first used for a change.
    before: Option<crate::core::replica::FollowsInputs>,
}

impl std::ops::Deref for RulesGuard<'_> {
    type Target = ReplicaCore;
    fn deref(&self) -> &ReplicaCore {
        &self.core
    }
}

impl std::ops::DerefMut for RulesGuard<'_> {
    fn deref_mut(&mut self) -> &mut ReplicaCore {
        if self.before.is_none() {
            self.before = Some(self.core.follows_inputs());
        }
        &mut self.core
    }
}

impl Drop for RulesGuard<'_> {
    fn drop(&mut self) {
        // Runs before the fields drop: the lock is still held here.
        if self.before.is_some_and(|before| before != self.core.follows_inputs()) {
            self.touched.rules_changes.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl ShardReplica {
    /// A replica that restarted having promised `promised` and whose log
    /// ends at `last_seqno`.
    pub(crate) fn new(
        shard: ShardId,
        replicas: &[NodeId],
        me: NodeId,
        coordinated: bool,
        promised: u64,
        last_seqno: u64,
        touched: Arc<Touched>,
    ) -> Self {
        touched.mark(shard);
        ShardReplica {
            shard,
            members: Mutex::new(Members { voters: replicas.to_vec(), ..Members::default() }),
            rules: Rules {
                core: Mutex::new(ReplicaCore::new(me, replicas.to_vec(), coordinated, Epoch(promised))),
                touched: touched.clone(),
            },
            readable: watch::Sender::new(0),
            all_durable: watch::Sender::new(0),
            generation: watch::Sender::new(0),
            lease_until: watch::Sender::new(0),
            activity: AtomicU64::new(1),
            settled_at: AtomicU64::new(0),
            leader: Mutex::new(None),
            follower: FollowerState {
                apply_lock: tokio::sync::Mutex::new(()),
                next_expected: watch::Sender::new(last_seqno + 1),
                leader_commit: LeaderCommit::default(),
                catchup_running: AtomicBool::new(false),
                refetch_through: AtomicU64::new(0),
                last_contact_us: AtomicU64::new(0),
                archived: AtomicU64::new(0),
                applied_bytes: Default::default(),
                archiver: AtomicU32::new(0),
                rebuild_tiers: std::sync::atomic::AtomicU8::new(super::wipe::Tiers::ALL.0),
            },
            transition: tokio::sync::Mutex::new(()),
            touched,
            commit_gauge: std::sync::OnceLock::new(),
            archiving: Default::default(),
            pause_generation: AtomicU64::new(0),
        }
    }

    pub fn view(&self) -> View {
        self.rules.lock().view()
    }

    /// Who holds the shard, as last assigned.
    pub fn members(&self) -> Members {
        self.members.lock().clone()
    }

    /// Under a coordinator: whether this replica still waits for an epoch
    /// newer than the one it restarted in before it may lead.
    pub fn needs_new_epoch(&self) -> bool {
        self.rules.lock().needs_new_epoch()
    }

    pub fn is_leader(&self) -> bool {
        self.view().role == Role::Leader
    }

    /// The newest epoch promised (refuses anything older).
    pub fn epoch_seen(&self) -> u64 {
        self.rules.lock().promised().0
    }

    /// The leader as this replica knows it.
    pub fn leader_id(&self, me: NodeId) -> Option<NodeId> {
        match self.view().role {
            Role::Leader => Some(me),
            Role::Follower { leader } => Some(leader),
            Role::Unassigned => None,
        }
    }

    pub(crate) fn leader_state(&self) -> Option<Arc<LeaderState>> {
        self.leader.lock().clone()
    }

    /// What reads may return through.
    pub fn readable(&self) -> u64 {
        *self.readable.borrow()
    }

    pub fn readable_watch(&self) -> watch::Receiver {
        self.readable.subscribe()
    }

    /// After this replica's log was truncated after `kept_through`: nothing
    /// past it is readable, nor known committed, any more (what was there
    /// is gone, and a divergent tail was never committed unless a forced
    /// failover gave it up).
    pub(crate) fn truncated(&self, kept_through: u64) {
        self.readable.send_if_modified(|r| {
            let lowered = (*r).min(kept_through);
            std::mem::replace(r, lowered) != lowered
        });
        self.follower.leader_commit.lower(kept_through);
    }

    /// Waits until `seqno` is durable on a majority. False if this replica
    /// stopped leading first: the append's outcome is then unknown.
    /// Cancellation-safe.
    pub async fn wait_commit(&self, seqno: u64) -> bool {
        self.wait_or_stepped_down(&self.readable, seqno).await
    }

    /// Waits until `seqno` is durable on every replica; false as
    /// [`ShardReplica::wait_commit`]. Cancellation-safe.
    pub async fn wait_all(&self, seqno: u64) -> bool {
        self.wait_or_stepped_down(&self.all_durable, seqno).await
    }

    /// Waits, up to `patience`, until the leader lease holds (see
    /// [`LeaderCore::lease_until`]): an idle leader's first append waits for
    /// the reply to its own shipment. False if it does not, or this replica
    /// stopped leading: the append's outcome is then unknown.
    /// Cancellation-safe.
    pub async fn wait_lease(&self, patience: Duration) -> bool {
        let mut generation = self.generation.subscribe();
        let current = *generation.borrow_and_update();
        if !self.is_leader() {
            return false;
        }
        let mut lease = self.lease_until.subscribe();
        let renewed = tokio::time::timeout(patience, lease.wait_for(|until| now_us() < *until));
        tokio::select! {
            renewed = renewed => matches!(renewed, Ok(Ok(_))),
            _ = generation.wait_for(|g| *g != current) => false,
        }
    }

    async fn wait_or_stepped_down(&self, position: &watch::Sender, seqno: u64) -> bool {
        let mut generation = self.generation.subscribe();
        let current = *generation.borrow_and_update();
        if !self.is_leader() {
            return false;
        }
        let mut rx = position.subscribe();
        tokio::select! {
            reached = rx.wait_for(|c| *c >= seqno) => reached.is_ok(),
            _ = generation.wait_for(|g| *g != current) => false,
        }
    }

    /// Publishes what a leader's core says: commit, all-durable, lease.
    pub(crate) fn publish_leader(&self, core: &LeaderCore, metrics: &ReplicationMetrics) {
        let commit = core.commit().0;
        self.readable.send_if_modified(|r| {
            let changed = commit > *r;
            if changed {
                *r = commit;
            }
            changed
        });
        let all = core.all_durable().0;
        self.all_durable.send_if_modified(|a| std::mem::replace(a, all) != all);
        let lease = core.lease_until().unwrap_or(u64::MAX);
        self.lease_until.send_if_modified(|l| std::mem::replace(l, lease) != lease);
        if let Some(gauge) = self.commit_gauge.get_or_init(|| metrics.commit_gauge(self.shard)) {
            gauge.set(commit as i64);
        }
    }

    /// Publishes a follower's readable position after its WAL reached
    /// `durable`.
    pub(crate) fn publish_follower(&self, durable: u64) {
        let readable = durable.min(self.follower.leader_commit.get());
        self.readable.send_if_modified(|r| {
            let changed = readable > *r;
            if changed {
                *r = readable;
            }
            changed
        });
    }

    /// The rules just made this replica follow a leader (`commands` start a
    /// catch-up after a role change): its silence towards that leader counts
    /// from now. Call with the rules' lock held, so a heartbeat that sees the
    /// new role also sees this.
    pub(crate) fn note_new_leader(&self, commands: &[crate::core::replica::Command]) {
        use crate::core::replica::Command;
        if commands.contains(&Command::StopLeading) && commands.contains(&Command::CatchUp) {
            self.follower.last_contact_us.store(now_us(), Ordering::Release);
        }
    }

    /// Something that may change this replica's report happened: the next
    /// heartbeat tick reports it.
    pub(crate) fn unsettle(&self) {
        self.activity.fetch_add(1, Ordering::AcqRel);
        self.touched.mark(self.shard);
    }

    /// The activity count, read before a report is built.
    pub(crate) fn activity(&self) -> u64 {
        self.activity.load(Ordering::Acquire)
    }

    /// A report built after [`ShardReplica::activity`] read `at` found the
    /// replica quiet (`quiet`), or not.
    pub(crate) fn reported(&self, at: u64, quiet: bool) {
        self.settled_at.store(if quiet { at } else { 0 }, Ordering::Release);
    }

    /// Quiet, and nothing happened since its last report said so: a
    /// heartbeat tick between full reports leaves it out (its report is
    /// unchanged).
    pub(crate) fn settled(&self) -> bool {
        self.settled_at.load(Ordering::Acquire) == self.activity.load(Ordering::Acquire)
    }

    /// Stops leading, if it was: its tasks stop and appends waiting for a
    /// commit under it give up.
    pub(crate) fn stop_leading(&self) {
        self.unsettle();
        if let Some(leader) = self.leader.lock().take() {
            leader.stop.cancel();
            self.lease_until.send_replace(0);
            self.generation.send_modify(|g| *g += 1);
            tracing::info!(shard = self.shard, epoch = leader.epoch, "stopped leading");
        }
    }
}

#[cfg(test)]
mod touched_tests {
    use super::*;

    #[test]
    fn a_new_or_unsettled_replica_is_touched_for_each_loop_once() {
        let touched = Arc::new(Touched::default());
        let a = ShardReplica::new(7, &[1, 2, 3], 1, true, 0, 0, touched.clone());
        let _b = ShardReplica::new(9, &[1, 2, 3], 1, true, 0, 0, touched.clone());
        assert_eq!(touched.take_heartbeats().into_iter().collect::<Vec<_>>(), [7, 9]);
        assert!(touched.take_heartbeats().is_empty(), "taking empties it");
        assert_eq!(touched.take_gauges().into_iter().collect::<Vec<_>>(), [7, 9], "each loop has its own set");

        // Settled once reported quiet at its activity; touched again (and
        // unsettled) by the next change.
        a.reported(a.activity(), true);
        assert!(a.settled());
        a.unsettle();
        assert!(!a.settled());
        assert_eq!(touched.take_heartbeats().into_iter().collect::<Vec<_>>(), [7]);
        assert_eq!(touched.take_gauges().into_iter().collect::<Vec<_>>(), [7]);
    }
}

/// The newest commit position a follower was told, with the epoch of the
/// leader that told it. A newer epoch's leader replaces it (after a forced
/// failover that gave records up, the old commit names records no log holds
/// any more, and a failover would count them as lost again); within one
/// epoch it only grows.
#[derive(Debug, Default)]
pub(crate) struct LeaderCommit(Mutex<(u64, u64)>);

impl LeaderCommit {
    pub(crate) fn get(&self) -> u64 {
        self.0.lock().1
    }

    /// `commit`, as the leader of `epoch` said it.
    pub(crate) fn raise(&self, epoch: u64, commit: u64) {
        let mut known = self.0.lock();
        if epoch > known.0 {
            *known = (epoch, commit);
        } else if epoch == known.0 {
            known.1 = known.1.max(commit);
        }
    }

    fn lower(&self, to: u64) {
        let mut known = self.0.lock();
        known.1 = known.1.min(to);
    }
}

#[cfg(test)]
mod leader_commit_tests {
    use super::LeaderCommit;

    #[test]
    fn a_newer_leader_replaces_the_commit_and_one_leader_only_raises_it() {
        let c = LeaderCommit::default();
        c.raise(3, 15);
        c.raise(3, 12);
        assert_eq!(c.get(), 15, "one leader's commit never goes back");
        c.raise(2, 40);
        assert_eq!(c.get(), 15, "an older leader's word does not count");
        c.raise(4, 10);
        assert_eq!(c.get(), 10, "a newer leader's replaces it");
        c.lower(7);
        assert_eq!(c.get(), 7);
        c.raise(4, 11);
        assert_eq!(c.get(), 11);
    }
}
