//! Quiet shards: an idle shard costs nothing per shard.
//!
//! A leader's shipper for one follower goes *quiet* once that follower
//! durably holds everything the leader has written and knows the commit
//! ([`LeaderCore::may_go_quiet`](crate::core::leader::LeaderCore::may_go_quiet)):
//! it stops its per-shard keepalives and parks on its WAL watches with no
//! timer. One [`QuietLink`] per follower node then stands in for all of
//! the shards quiet towards that node: every keepalive period it sends one
//! `NodeKeepalive` naming the shards that went quiet or woke since its last
//! call, and the follower answers which of the shards it holds as quiet it
//! no longer follows at that epoch from this leader
//! ([`ReplicaCore::follows`](crate::core::replica::ReplicaCore::follows)).
//!
//! Invariants kept here:
//! * a positive answer counts as contact for a quiet shard only if the
//!   call it answers (or an earlier one) carried that shard, and only from
//!   when that call was sent (as a shipment reply counts from its request),
//!   so a shard fenced before it was announced is never credited;
//! * an answer whose count of quiet shards differs from what the leader
//!   sent (the follower restarted, a call was lost) is no contact at all,
//!   and the next call carries the whole set;
//! * a refused shard leaves the set at once and wakes: its own shipment
//!   then meets the refusal (a newer epoch deposes the leader, as it would
//!   have without quiet shards);
//! * a failed call, or no positive answer for two keepalive periods, wakes
//!   every shard quiet on the link: each falls back to its own keepalives
//!   and lease, with the last contact the link proved;
//! * on the follower, a shard quiet from a leader counts as heard from that
//!   leader when the leader's last node keepalive arrived, only while its
//!   rules still follow that leader in that epoch.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Notify;
use tonic::Status;
use walship_proto::replication::{NodeKeepaliveRequest, NodeKeepaliveResponse, QuietShard};
use walship_wal::ShardId;

use super::{ReplicationNode, ShardReplica, now_us};
use crate::NodeId;
use crate::core::Epoch;
use crate::replica::shard::LeaderState;

/// The most entries (quiet plus woke) one `NodeKeepalive` may carry.
pub const MAX_NODE_KEEPALIVE_ENTRIES: usize = 100_000;

/// The leader side's links, one per follower node, started on first use.
#[derive(Default)]
pub(crate) struct QuietLinks {
    links: Mutex<BTreeMap<NodeId, Arc<QuietLink>>>,
}

/// Shards quiet from this leader node towards one follower node.
pub(crate) struct QuietLink {
    state: Mutex<LinkState>,
    /// Wakes the link's task when its set gains a shard.
    kick: Notify,
}

#[derive(Default)]
struct LinkState {
    shards: HashMap<ShardId, Entry>,
    /// Shards announced to the follower that woke since the last call.
    woke: Vec<ShardId>,
    /// The follower holds the set as the last call left it; false: the
    /// next call carries the whole set.
    synced: bool,
    /// When the last call the follower answered positively was sent (µs).
    contact_sent_us: u64,
}

struct Entry {
    epoch: u64,
    commit: u64,
    wake: Arc<Notify>,
    /// When the first call carrying this shard was sent; none: not yet.
    announced_us: Option<u64>,
}

impl LinkState {
    /// The contact a positive answer proves for `shard` (see the module docs).
    fn credit(&self, shard: ShardId) -> Option<u64> {
        let announced = self.shards.get(&shard)?.announced_us?;
        (self.contact_sent_us >= announced).then_some(self.contact_sent_us)
    }

    /// Wakes every quiet shard and forgets the set.
    fn wake_all(&mut self) {
        for (_, entry) in self.shards.drain() {
            entry.wake.notify_one();
        }
        self.woke.clear();
        self.synced = false;
    }
}

impl QuietLink {
    /// `shard` goes quiet towards this link's follower at `epoch` (the
    /// follower knows `commit`). The returned notify fires when the link
    /// wakes it.
    pub(crate) fn quiet(&self, shard: ShardId, epoch: u64, commit: u64) -> Arc<Notify> {
        let wake = Arc::new(Notify::new());
        let mut state = self.state.lock();
        let first = state.shards.is_empty();
        state.shards.insert(shard, Entry { epoch, commit, wake: wake.clone(), announced_us: None });
        drop(state);
        if first {
            self.kick.notify_one();
        }
        wake
    }

    /// `shard` is no longer quiet (its shipper woke): returns the contact
    /// the link proved for it, if any.
    pub(crate) fn wake(&self, shard: ShardId) -> Option<u64> {
        let mut state = self.state.lock();
        let credit = state.credit(shard);
        if let Some(entry) = state.shards.remove(&shard)
            && entry.announced_us.is_some()
        {
            state.woke.push(shard);
        }
        credit
    }

    /// The contact the link proved for quiet `shard`, leaving it quiet.
    pub(crate) fn credit(&self, shard: ShardId) -> Option<u64> {
        self.state.lock().credit(shard)
    }
}

impl QuietLinks {
    /// The link to `follower`, its task started on first use.
    pub(crate) fn link(&self, node: &Arc<ReplicationNode>, follower: NodeId) -> Arc<QuietLink> {
        let mut links = self.links.lock();
        links
            .entry(follower)
            .or_insert_with(|| {
                let link = Arc::new(QuietLink { state: Mutex::default(), kick: Notify::new() });
                tokio::spawn(node.clone().run_quiet_link(follower, link.clone()));
                link
            })
            .clone()
    }
}

/// What the follower side holds from one leader node.
#[derive(Default)]
struct FromLeader {
    /// Quiet shards and the epoch each is quiet in.
    shards: HashMap<ShardId, u64>,
    /// When the leader's last node keepalive arrived (µs).
    contact_us: u64,
    /// Its shards were unsettled for a silence of the leader since that.
    silence_reported: bool,
    /// The node's [`rules_changes`](super::shard::Touched::rules_changes)
    /// when every shard in `shards` was last checked against its rules.
    checked_at: Option<u64>,
}

/// The follower side: shards quiet from each leader node.
#[derive(Default)]
pub(crate) struct QuietFrom {
    from: Mutex<BTreeMap<NodeId, FromLeader>>,
}

impl QuietFrom {
    /// When `leader`'s node keepalive last vouched for `shard` in `epoch`.
    pub(crate) fn contact(&self, shard: ShardId, leader: NodeId, epoch: u64) -> Option<u64> {
        let from = self.from.lock();
        let f = from.get(&leader)?;
        (f.shards.get(&shard) == Some(&epoch)).then_some(f.contact_us)
    }
}

/// Checks a `NodeKeepalive` before anything changes: INVALID_ARGUMENT for
/// an entry count over the bound, a shard or epoch 0, a shard named twice.
pub fn check_node_keepalive(request: &NodeKeepaliveRequest) -> Result<(), Status> {
    if request.quiet.len() + request.woke.len() > MAX_NODE_KEEPALIVE_ENTRIES {
        return Err(Status::invalid_argument(format!(
            "a NodeKeepalive carries at most {MAX_NODE_KEEPALIVE_ENTRIES} entries"
        )));
    }
    let mut seen = std::collections::HashSet::with_capacity(request.quiet.len());
    for q in &request.quiet {
        if q.shard_id == 0 || q.epoch == 0 {
            return Err(Status::invalid_argument(format!(
                "quiet shard {} at epoch {}: shard ids and epochs start at 1",
                q.shard_id, q.epoch
            )));
        }
        if !seen.insert(q.shard_id) {
            return Err(Status::invalid_argument(format!("quiet shard {} is named twice", q.shard_id)));
        }
    }
    Ok(())
}

impl ReplicationNode {
    /// Whether idle shards go quiet here.
    pub(super) fn quiesce(&self) -> bool {
        self.config.replication.quiesce
    }

    /// How long a node link may go without a positive node keepalive (two
    /// periods) before its quiet shards count as unheard, on both sides.
    fn quiet_silence_us(&self) -> u64 {
        2 * self.config.replication.keepalive().as_micros() as u64
    }

    /// The follower side of `NodeKeepalive` (see the module docs).
    pub fn on_node_keepalive(&self, request: &NodeKeepaliveRequest) -> Result<NodeKeepaliveResponse, Status> {
        let leader = request.leader_node_id;
        if leader == self.me || self.config.node(leader).is_none() {
            return Err(Status::invalid_argument(format!(
                "leader_node_id {leader} is not another node of the cluster"
            )));
        }
        check_node_keepalive(request)?;
        if self.drill_partition.blocks(leader) {
            return Err(Status::unavailable(format!("partition drill: node {leader} is cut off")));
        }
        self.peer_alive(leader);
        self.contact.heard(leader, now_us());
        let mut refused = Vec::new();
        let mut from = self.quiet_from.from.lock();
        let f = from.entry(leader).or_default();
        let mut forgotten: Vec<ShardId> = Vec::new();
        if request.full {
            forgotten.extend(f.shards.drain().map(|(shard, _)| shard));
        }
        for shard in &request.woke {
            if f.shards.remove(shard).is_some() {
                forgotten.push(*shard);
            }
        }
        // A positive answer is lease contact, so it must not cover a shard
        // whose rules no longer follow this leader in that epoch. The shards
        // already held were checked when `checked_at` was read; they are
        // checked again, all of them under one read of the replica map, only
        // if what some replica's `follows` reads changed since (replicas are
        // never removed from the map). The count is read before any check:
        // a change finishing during them is seen by the next call.
        let changes = self.touched.rules_changes();
        for q in &request.quiet {
            // Named again (maybe at another epoch): checked below as new.
            f.shards.remove(&q.shard_id);
        }
        if f.checked_at != Some(changes) {
            let replicas = self.replicas.read();
            f.shards.retain(|&shard, &mut epoch| {
                let follows = replicas.get(&shard).is_some_and(|r| r.rules.lock().follows(Epoch(epoch), leader));
                if !follows {
                    refused.push(shard);
                }
                follows
            });
            drop(replicas);
            f.checked_at = Some(changes);
        }
        // The shards this call adds are checked one by one.
        for q in &request.quiet {
            let replica = self.replica(q.shard_id).filter(|r| r.rules.lock().follows(Epoch(q.epoch), leader));
            let Some(replica) = replica else {
                refused.push(q.shard_id);
                continue;
            };
            f.shards.insert(q.shard_id, q.epoch);
            replica.follower.leader_commit.raise(q.epoch, q.commit_seqno);
            if let Ok(p) = self.wal.positions(q.shard_id) {
                replica.publish_follower(p.durable_seqno);
            }
        }
        f.contact_us = now_us();
        f.silence_reported = false;
        let quiet_count = f.shards.len() as u64;
        drop(from);
        // Their reports change (the leader's silence is their own again).
        for shard in forgotten.iter().chain(&refused) {
            if let Some(replica) = self.replica(*shard) {
                replica.unsettle();
            }
        }
        self.metrics.quiet_refused.inc_by(refused.len() as u64);
        Ok(NodeKeepaliveResponse { refused, quiet_count })
    }

    /// Whether `replica` is quiet: a leader all of whose followers are, or a
    /// follower its leader keeps quiet by node keepalives.
    pub(super) fn is_quiet(&self, replica: &ShardReplica) -> bool {
        if let Some(leader) = replica.leader_state() {
            let quiet = leader.quiet.lock().len();
            return quiet > 0 && quiet == leader.core.lock().followers().count();
        }
        let view = replica.view();
        match view.role {
            crate::core::replica::Role::Follower { leader } => {
                let silent_after = self.quiet_silence_us();
                self.quiet_from
                    .contact(replica.shard, leader, view.epoch.0)
                    .is_some_and(|heard| now_us().saturating_sub(heard) <= silent_after)
            }
            _ => false,
        }
    }

    /// A leader node whose node keepalives stopped for two periods: the
    /// shards quiet from it are reported again (their leader's silence
    /// grows). Per leader node, not per shard, while nothing is silent.
    pub(super) fn unsettle_silent_leaders(&self) {
        let silent_after = self.quiet_silence_us();
        let now = now_us();
        let mut silent = Vec::new();
        for f in self.quiet_from.from.lock().values_mut() {
            if !f.silence_reported && now.saturating_sub(f.contact_us) > silent_after {
                f.silence_reported = true;
                silent.extend(f.shards.keys().copied());
            }
        }
        for shard in silent {
            if let Some(replica) = self.replica(shard) {
                replica.unsettle();
            }
        }
    }

    /// When the leader of follower `replica` was last heard from: its own
    /// shipments, the node keepalive of a leader it is quiet from, or any
    /// traffic from the leader's node (see `contact.rs`: a partition cuts
    /// the node; a shard's own traffic lagging on a busy node is no silence).
    pub(super) fn leader_heard_us(&self, replica: &ShardReplica) -> u64 {
        let heard = replica.follower.last_contact_us.load(std::sync::atomic::Ordering::Acquire);
        let view = replica.view();
        match view.role {
            crate::core::replica::Role::Follower { leader } => heard
                .max(self.quiet_from.contact(replica.shard, leader, view.epoch.0).unwrap_or(0))
                .max(self.contact.heard_at(leader).unwrap_or(0)),
            _ => heard,
        }
    }

    /// The leader side of one follower node's link: every keepalive period
    /// while any shard is quiet towards it, one `NodeKeepalive`.
    async fn run_quiet_link(self: Arc<Self>, follower: NodeId, link: Arc<QuietLink>) {
        let period = self.config.replication.keepalive();
        let timeout = Duration::from_millis(self.config.replication.ship_timeout_ms).min(period * 4);
        loop {
            let idle = link.state.lock().shards.is_empty();
            tokio::select! {
                _ = link.kick.notified(), if idle => continue,
                _ = tokio::time::sleep(period), if !idle => {}
                _ = self.shutdown.cancelled() => return,
            }
            let sent = now_us();
            let (request, expected) = {
                let mut state = link.state.lock();
                if state.shards.is_empty() {
                    continue;
                }
                let full = !state.synced;
                let woke = if full { Vec::new() } else { std::mem::take(&mut state.woke) };
                state.woke.clear();
                let mut quiet = Vec::new();
                for (&shard, entry) in state.shards.iter_mut() {
                    if full || entry.announced_us.is_none() {
                        quiet.push(QuietShard { shard_id: shard, epoch: entry.epoch, commit_seqno: entry.commit });
                        entry.announced_us = Some(sent);
                    }
                }
                let expected = state.shards.len();
                (NodeKeepaliveRequest { leader_node_id: self.me, quiet, woke, full }, expected)
            };
            let answer = match (self.drill_partition.blocks(follower), self.peers.shipping(follower)) {
                (false, Some(mut client)) => tokio::time::timeout(timeout, client.node_keepalive(request))
                    .await
                    .map_err(|_| Status::deadline_exceeded("NodeKeepalive timed out"))
                    .and_then(|r| r.map(tonic::Response::into_inner)),
                (true, _) => Err(Status::unavailable("partition drill")),
                (false, None) => Err(Status::not_found("no address for the follower")),
            };
            let mut state = link.state.lock();
            match answer {
                Ok(answer) => {
                    self.contact.answered(follower, sent);
                    let mut gone = 0;
                    for shard in &answer.refused {
                        if let Some(entry) = state.shards.remove(shard) {
                            entry.wake.notify_one();
                        }
                        gone += 1;
                    }
                    if answer.quiet_count as usize + gone == expected && !(self.drill_partition.blocks(follower)) {
                        state.synced = true;
                        state.contact_sent_us = state.contact_sent_us.max(sent);
                    } else {
                        state.synced = false;
                    }
                    self.metrics.node_keepalives.with_label_values(&["ok"]).inc();
                }
                Err(status) => {
                    tracing::debug!(follower, %status, "NodeKeepalive failed: waking the shards quiet towards it");
                    self.metrics.node_keepalives.with_label_values(&["error"]).inc();
                    state.wake_all();
                }
            }
            // No positive answer for two periods (answers that keep
            // disagreeing on the set): the shards look after themselves.
            let stale = now_us().saturating_sub(state.contact_sent_us) > self.quiet_silence_us();
            if stale && !state.shards.is_empty() && state.shards.values().all(|e| e.announced_us.is_some()) {
                state.wake_all();
            }
        }
    }

    /// Folds what the quiet links proved into `leader`'s core and publishes
    /// the lease: called before the lease is judged lapsed.
    pub(super) fn fold_quiet(&self, replica: &ShardReplica, leader: &LeaderState) {
        let quiet: Vec<(NodeId, Arc<QuietLink>)> = leader.quiet.lock().iter().map(|(&n, l)| (n, l.clone())).collect();
        if quiet.is_empty() {
            return;
        }
        let mut core = leader.core.lock();
        for (follower, link) in quiet {
            if let Some(sent) = link.credit(replica.shard) {
                core.on_node_contact(follower, sent);
            }
        }
        replica.publish_leader(&core, &self.metrics);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link() -> QuietLink {
        QuietLink { state: Mutex::default(), kick: Notify::new() }
    }

    #[test]
    fn a_shard_is_credited_only_from_a_call_that_carried_it() {
        let link = link();
        link.quiet(7, 3, 10);
        link.state.lock().contact_sent_us = 500;
        assert_eq!(link.credit(7), None, "not announced yet: an answer from before says nothing of it");
        link.state.lock().shards.get_mut(&7).unwrap().announced_us = Some(600);
        assert_eq!(link.credit(7), None, "announced by a call not answered yet");
        link.state.lock().contact_sent_us = 600;
        assert_eq!(link.credit(7), Some(600));
        link.state.lock().contact_sent_us = 900;
        assert_eq!(link.wake(7), Some(900), "waking returns the last contact");
        assert_eq!(link.credit(7), None, "no longer quiet");
        assert_eq!(link.state.lock().woke, vec![7], "the follower is told it woke");
    }

    #[test]
    fn a_shard_woken_before_it_was_announced_is_not_reported_as_woken() {
        let link = link();
        link.quiet(7, 3, 10);
        assert_eq!(link.wake(7), None);
        assert!(link.state.lock().woke.is_empty());
    }

    #[tokio::test]
    async fn waking_everything_notifies_each_shard_and_asks_for_a_full_resend() {
        let link = link();
        let a = link.quiet(1, 3, 0);
        let b = link.quiet(2, 3, 0);
        link.state.lock().synced = true;
        link.state.lock().wake_all();
        assert!(link.state.lock().shards.is_empty());
        assert!(!link.state.lock().synced);
        let woken = tokio::time::timeout(Duration::from_millis(100), async {
            a.notified().await;
            b.notified().await;
        })
        .await;
        assert!(woken.is_ok(), "both shards were woken");
    }

    #[test]
    fn a_node_keepalive_with_bad_entries_is_refused() {
        let ok = NodeKeepaliveRequest {
            leader_node_id: 2,
            quiet: vec![QuietShard { shard_id: 1, epoch: 1, commit_seqno: 0 }],
            woke: vec![3],
            full: false,
        };
        assert!(check_node_keepalive(&ok).is_ok());
        for (bad, why) in [
            (QuietShard { shard_id: 0, epoch: 1, commit_seqno: 0 }, "shard 0"),
            (QuietShard { shard_id: 1, epoch: 0, commit_seqno: 0 }, "epoch 0"),
            (QuietShard { shard_id: 1, epoch: 2, commit_seqno: 0 }, "named twice"),
        ] {
            let mut request = ok.clone();
            request.quiet.push(bad);
            let status = check_node_keepalive(&request).unwrap_err();
            assert_eq!(status.code(), tonic::Code::InvalidArgument, "{why}");
        }
        let flood = NodeKeepaliveRequest { woke: vec![1; MAX_NODE_KEEPALIVE_ENTRIES + 1], ..ok };
        assert_eq!(check_node_keepalive(&flood).unwrap_err().code(), tonic::Code::InvalidArgument);
    }
}
