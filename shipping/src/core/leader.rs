//! One shard's leader: what to ship to each follower, when a record is
//! committed, how far behind each follower is, and what retention may
//! discard.
//!
//! Invariants kept here:
//! * `commit` is the highest seqno durable on a majority of the replica set
//!   (the leader counts with its own durable position); it never decreases
//!   and never passes the leader's durable position, whatever the followers
//!   report. Only records in the leader's own log are offered for shipping:
//!   durable ones, or, once the shell reports writes with
//!   [`LeaderCore::on_local_written`] (early shipping), written ones whose
//!   fsync may still be running. A follower may then hold and acknowledge
//!   records the leader could still lose in a machine crash; they are never
//!   committed until the leader's own copy is durable, and the coordinator
//!   never lets a restarted leader lead again in the same epoch (see
//!   `shipping/EARLY-SHIPPING.md`).
//! * Counting replicas commits older-epoch records at once, without waiting
//!   for a record of this leader's own epoch: a new leader makes everything
//!   durable on a majority readable without a client write. This is safe
//!   because of the *log epoch* every replica records durably (see
//!   `shipping/src/replica.rs`): the leader records its epoch before it
//!   leads, and a follower records it once its log is reconciled with this
//!   leader's (a prefix of it) and before it answers anything of this
//!   epoch. A failover compares `(log epoch, last seqno)`, Viewstamped
//!   Replication's "last normal view", so any majority that could elect a
//!   later leader holds a replica stamped with this epoch and at least as
//!   long as the commit; Raft's "figure 8" (older-epoch records on a
//!   majority overwritten by a leader with a newer last record) cannot
//!   happen. The coordinator's hand-over floor still applies from the start.
//! * Leader lease (coordinated clusters): the leader acknowledges appends
//!   at any durability only while it has heard, within `lease_us`, from a
//!   majority of its replica set (positive ship replies, dated by when the
//!   request they answer was sent; its own start counts as contact). A leader frozen or cut off from its followers past
//!   the failure timeout stops acknowledging even `LOCAL` appends and, once
//!   a majority had answered it in this leadership, steps down (Raft's
//!   CheckQuorum), even while it still reaches the coordinator. `LOCAL` is still not failover-safe: it is acknowledged
//!   before any follower holds the record.
//! * Membership ([`LeaderCore::set_members`]): *learners* are shipped to
//!   like any follower but count for nothing — no commit, no `ALL`, no
//!   lease. While the replica set changes (*joint*), a record is committed
//!   only once a majority of the new set *and* a majority of the old set
//!   hold it, so whichever set a failover then fences finds it.
//! * A follower's `acked` only ever comes from its own reply (its durable
//!   frontier); nothing the leader sends counts until the follower says so.
//! * At most `window` requests are in flight per follower, and a follower
//!   more than `catchup_threshold_bytes` behind gets no pushes at all (it
//!   pulls), so a slow or dead follower costs bounded memory and never
//!   blocks appends, other followers or other shards.
//! * Replies from an older session are the shell's to drop; a reply that
//!   reveals a newer epoch makes this leader deposed.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::Serialize;

use super::{Epoch, Seqno};
use crate::NodeId;

/// How the leader feeds one follower.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ShipMode {
    /// State unknown (start, or after a failed RPC): one keepalive at a time
    /// until the follower answers with its position.
    Probe,
    /// Live push of durable segments, windowed.
    Push,
    /// Too far behind for push: the follower pulls with StreamSegments; the
    /// leader only sends keepalives (which nudge it) and watches it progress.
    CatchUp,
    /// It needs records the leader no longer retains: it must be re-seeded
    /// from archived segments (the object-store issue); keepalives only.
    NeedsReseed,
}

impl ShipMode {
    pub fn as_str(self) -> &'static str {
        match self {
            ShipMode::Probe => "probe",
            ShipMode::Push => "push",
            ShipMode::CatchUp => "catch_up",
            ShipMode::NeedsReseed => "needs_reseed",
        }
    }

    pub const ALL: [ShipMode; 4] = [ShipMode::Probe, ShipMode::Push, ShipMode::CatchUp, ShipMode::NeedsReseed];
}

/// Tuning the leader core needs.
#[derive(Debug, Clone, Copy)]
pub struct LeaderSettings {
    pub window: usize,
    pub catchup_threshold_bytes: u64,
    pub keepalive_us: u64,
    /// How soon an unanswered (probe-mode) follower is probed again.
    pub probe_us: u64,
    /// The leader lease (the coordinator's failure timeout); none in a static
    /// cluster, whose leadership never moves.
    pub lease_us: Option<u64>,
}

/// Where a leader starts.
#[derive(Debug, Clone, Copy)]
pub struct LeaderStart {
    pub epoch: Epoch,
    /// The leader's WAL holds `[first, durable]`.
    pub first: Seqno,
    pub durable: Seqno,
    /// The first seqno of this leader's own epoch (its last seqno + 1 when it
    /// is promoted).
    pub epoch_start: Seqno,
    /// A commit position known to be safe (announced by an earlier leader).
    pub commit_floor: Seqno,
}

/// What the leader knows of one follower.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct FollowerProgress {
    /// The follower's durable frontier, as it last reported.
    pub acked: Seqno,
    /// Next seqno to push.
    pub next: Seqno,
    /// Requests sent and not yet answered.
    pub in_flight: usize,
    pub mode: ShipMode,
    /// When the last request went out (µs); none yet = a keepalive is due.
    pub last_sent_us: Option<u64>,
    /// When the last reply came back (µs).
    pub last_reply_us: Option<u64>,
}

impl FollowerProgress {
    /// A follower whose position is unknown: probed first, pushed from `next`.
    fn probing(next: Seqno) -> FollowerProgress {
        FollowerProgress {
            acked: Seqno(0),
            next,
            in_flight: 0,
            mode: ShipMode::Probe,
            last_sent_us: None,
            last_reply_us: None,
        }
    }
}

/// What the shell should send next to a follower.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShipDecision {
    /// Ship frames `[from, up_to]`; the shell may stop earlier at its
    /// byte bound and reports what it sent with [`LeaderCore::on_sent`].
    Send {
        from: Seqno,
        up_to: Seqno,
    },
    /// Send an empty segment carrying the leader's positions.
    Keepalive,
    Idle,
}

/// A follower's answer to one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShipReply {
    /// Accepted; `applied` is its durable frontier.
    Applied { applied: Seqno },
    /// Refused as a gap; it holds everything through `applied`.
    Gap { applied: Seqno },
    /// Refused: it has seen a newer epoch.
    StaleEpoch { epoch: Epoch },
    /// No answer (transport failure, timeout) or an unexpected refusal.
    Failed,
}

/// Lag of one follower, measured on the leader's clock.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Lag {
    pub records: u64,
    pub bytes: u64,
    /// A follower writes, fsyncs and makes records readable in one group
    /// commit and answers only after that, so write, flush and apply lag are
    /// the same span: now minus when the leader made the oldest record the
    /// follower lacks durable.
    pub write_seconds: f64,
    pub flush_seconds: f64,
    pub apply_seconds: f64,
}

/// What a retention pass should do.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RetentionPlan {
    /// Discard records before this seqno.
    pub compact_to: Option<Seqno>,
    /// Followers that will need records no longer retained.
    pub reseed: Vec<NodeId>,
}

/// One group commit as the leader saw it: the basis of byte and time lag.
#[derive(Debug, Clone, Copy)]
struct Mark {
    seqno: Seqno,
    /// Cumulative durable bytes of this shard (process-local counter).
    bytes: u64,
    at_us: u64,
}

/// Marks kept at most per shard, whatever the followers lack: past it the
/// ledger is thinned (every other mark after the two oldest dropped), so a
/// dead follower costs a bounded ledger, the slowest follower's time lag
/// stays exact and the others' is at worst that of a neighbouring mark.
pub(crate) const LEDGER_CAP: usize = 4_096;

/// The leader side of one shard.
#[derive(Debug, Clone)]
pub struct LeaderCore {
    epoch: Epoch,
    epoch_start: Seqno,
    settings: LeaderSettings,
    durable: Seqno,
    /// Newest seqno in the leader's own log that may be shipped: `durable`,
    /// or ahead of it with early shipping. Never behind `durable`.
    written: Seqno,
    /// Newest seqno the leader's WAL is committing (early shipping; else
    /// `durable`): what a follower with a segment already in flight is sent
    /// up to, so appends arriving one by one travel one segment per group
    /// commit rather than one each. Between `durable` and `written`.
    flushing: Seqno,
    first: Seqno,
    commit: Seqno,
    followers: BTreeMap<NodeId, FollowerProgress>,
    ledger: VecDeque<Mark>,
    /// Average frame size so far, for estimates past the ledger.
    avg_frame_bytes: u64,
    started_us: u64,
    /// The durable position this leadership started at: records through it
    /// were durable before `started_us` (the ledger has no mark for them).
    start_durable: Seqno,
    /// Followers that vote in no set ([`LeaderCore::set_members`]).
    learners: BTreeSet<NodeId>,
    /// Followers only in the old set of a change: they vote in it alone.
    old_only: BTreeSet<NodeId>,
    /// While the replica set changes: the followers of the voting set
    /// before the change, and whether the leader was in it.
    joint: Option<(BTreeSet<NodeId>, bool)>,
}

/// What [`LeaderCore::set_members`] changed: followers to start and stop
/// shipping to.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct MemberChange {
    pub added: Vec<NodeId>,
    pub removed: Vec<NodeId>,
}

impl LeaderCore {
    /// A leader starting at `start`, with the given followers (the leader
    /// itself excluded).
    pub fn new(start: LeaderStart, followers: &[NodeId], settings: LeaderSettings, now_us: u64) -> LeaderCore {
        let progress = FollowerProgress::probing(start.durable + 1);
        let mut core = LeaderCore {
            epoch: start.epoch,
            epoch_start: start.epoch_start,
            settings,
            durable: start.durable,
            written: start.durable,
            flushing: start.durable,
            first: start.first,
            commit: start.commit_floor.min(start.durable),
            followers: followers.iter().map(|&f| (f, progress)).collect(),
            ledger: VecDeque::new(),
            avg_frame_bytes: 0,
            started_us: now_us,
            start_durable: start.durable,
            learners: BTreeSet::new(),
            old_only: BTreeSet::new(),
            joint: None,
        };
        core.recompute_commit();
        core
    }

    /// Sets who this leader (`me`) ships to and who votes: `voters` (the
    /// replica set, `me` among them), `learners` (shipped to, never
    /// counted) and, while the set changes, `joint` (the set before the
    /// change; empty otherwise). New followers start probing; followers in
    /// none of the sets are dropped. The commit position never moves back:
    /// a stricter rule only holds it until the new majority catches up.
    pub fn set_members(
        &mut self,
        me: NodeId,
        voters: &[NodeId],
        learners: &[NodeId],
        joint: &[NodeId],
    ) -> MemberChange {
        let wanted: BTreeSet<NodeId> =
            voters.iter().chain(learners).chain(joint).copied().filter(|&n| n != me).collect();
        let mut change = MemberChange::default();
        self.followers.retain(|&n, _| {
            let keep = wanted.contains(&n);
            if !keep {
                change.removed.push(n);
            }
            keep
        });
        for &n in &wanted {
            if !self.followers.contains_key(&n) {
                self.followers.insert(n, FollowerProgress::probing(self.durable + 1));
                change.added.push(n);
            }
        }
        self.learners = wanted.iter().copied().filter(|n| !voters.contains(n) && !joint.contains(n)).collect();
        self.old_only = wanted.iter().copied().filter(|n| !voters.contains(n) && joint.contains(n)).collect();
        self.joint =
            (!joint.is_empty()).then(|| (joint.iter().copied().filter(|&n| n != me).collect(), joint.contains(&me)));
        self.prune_ledger();
        self.recompute_commit();
        change
    }

    /// The followers that vote in the current replica set.
    fn voters(&self) -> impl Iterator<Item = &FollowerProgress> + '_ {
        self.followers.iter().filter(|(n, _)| !self.learners.contains(n) && !self.old_only.contains(n)).map(|(_, p)| p)
    }

    /// Whether `n` follows this leader without voting anywhere.
    pub fn is_learner(&self, n: NodeId) -> bool {
        self.learners.contains(&n)
    }

    /// The highest seqno durable on a majority of a set: `followers`'
    /// positions, and the leader's own when it belongs to the set.
    fn majority_position<'a>(&self, followers: impl Iterator<Item = &'a FollowerProgress>, leader: bool) -> Seqno {
        let mut durable: Vec<Seqno> = followers.map(|p| p.acked).collect();
        if leader {
            durable.push(self.durable);
        }
        if durable.is_empty() {
            return self.durable;
        }
        durable.sort_unstable_by(|a, b| b.cmp(a));
        durable[durable.len() / 2]
    }

    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    /// The first seqno of this leader's own epoch.
    pub fn epoch_start(&self) -> Seqno {
        self.epoch_start
    }

    pub fn durable(&self) -> Seqno {
        self.durable
    }

    pub fn commit(&self) -> Seqno {
        self.commit
    }

    /// The newest seqno that may be shipped (see [`LeaderCore::on_local_written`]).
    pub fn written(&self) -> Seqno {
        self.written
    }

    /// What a follower with a segment in flight is sent up to (see the
    /// field's doc); never past `written`.
    pub fn flushing(&self) -> Seqno {
        self.flushing.min(self.written)
    }

    /// Early shipping: the leader's WAL wrote records through `written`
    /// (the fsync may still be running). They may be shipped now; they count
    /// towards the commit only once [`LeaderCore::on_local_durable`] covers
    /// them.
    pub fn on_local_written(&mut self, written: Seqno) {
        self.written = self.written.max(written);
    }

    /// Early shipping: the leader's WAL is committing records through
    /// `flushing` (see the field's doc).
    pub fn on_local_flushing(&mut self, flushing: Seqno) {
        self.flushing = self.flushing.max(flushing);
    }

    /// The highest seqno durable on every replica.
    pub fn all_durable(&self) -> Seqno {
        self.followers
            .iter()
            .filter(|(n, _)| !self.learners.contains(n))
            .map(|(_, f)| f.acked)
            .fold(self.durable, Seqno::min)
    }

    pub fn progress(&self, follower: NodeId) -> Option<FollowerProgress> {
        self.followers.get(&follower).copied()
    }

    pub fn followers(&self) -> impl Iterator<Item = (NodeId, FollowerProgress)> + '_ {
        self.followers.iter().map(|(&n, &p)| (n, p))
    }

    /// The leader's own WAL made records durable through `durable`;
    /// `bytes`/`records` are the shard's cumulative durable counters.
    /// Returns whether the commit position moved.
    pub fn on_local_durable(&mut self, durable: Seqno, records: u64, bytes: u64, now_us: u64) -> bool {
        if durable <= self.durable {
            return false;
        }
        self.durable = durable;
        self.written = self.written.max(durable);
        self.flushing = self.flushing.max(durable);
        if let Some(avg) = bytes.checked_div(records) {
            self.avg_frame_bytes = avg;
        }
        self.ledger.push_back(Mark { seqno: durable, bytes, at_us: now_us });
        if self.ledger.len() > LEDGER_CAP {
            self.thin_ledger();
        }
        self.recompute_commit()
    }

    /// The leader's WAL now starts at `first` (after compaction).
    pub fn on_compacted(&mut self, first: Seqno) {
        self.first = self.first.max(first);
    }

    /// Decides what to send to `follower` now.
    pub fn poll_ship(&mut self, follower: NodeId, now_us: u64) -> ShipDecision {
        let settings = self.settings;
        let (written, flushing) = (self.written, self.flushing());
        let Some(p) = self.followers.get_mut(&follower) else { return ShipDecision::Idle };
        let interval = if p.mode == ShipMode::Probe { settings.probe_us } else { settings.keepalive_us };
        let keepalive_due = p.last_sent_us.is_none_or(|t| now_us.saturating_sub(t) >= interval);
        // Nothing in flight: everything written goes at once (the lowest
        // latency). Something in flight: only what the WAL is already
        // committing, so records arriving one by one are batched per group
        // commit instead of costing a request each; they still reach the
        // follower while the leader's own fsync of them runs.
        let limit = if p.in_flight == 0 { written } else { flushing };
        match p.mode {
            ShipMode::Push if p.next <= limit => {
                if p.in_flight < settings.window {
                    ShipDecision::Send { from: p.next, up_to: limit }
                } else {
                    ShipDecision::Idle
                }
            }
            // Caught up (push), or not pushing: a keepalive when nothing is
            // in flight and the interval has passed.
            _ if p.in_flight == 0 && keepalive_due => ShipDecision::Keepalive,
            _ => ShipDecision::Idle,
        }
    }

    /// When (µs) `follower` is next due a keepalive or probe (now, if it
    /// never had one): how long a shipper with nothing to send may sleep.
    pub fn keepalive_due_at(&self, follower: NodeId) -> Option<u64> {
        let p = self.followers.get(&follower)?;
        let interval = if p.mode == ShipMode::Probe { self.settings.probe_us } else { self.settings.keepalive_us };
        Some(p.last_sent_us.map_or(0, |t| t.saturating_add(interval)))
    }

    /// The shell sent frames `[from, last]` to `follower`.
    pub fn on_sent(&mut self, follower: NodeId, from: Seqno, last: Seqno, now_us: u64) {
        if let Some(p) = self.followers.get_mut(&follower) {
            debug_assert_eq!(from, p.next);
            p.next = last + 1;
            p.in_flight += 1;
            p.last_sent_us = Some(now_us);
        }
    }

    /// The shell sent a keepalive to `follower`.
    pub fn on_keepalive_sent(&mut self, follower: NodeId, now_us: u64) {
        if let Some(p) = self.followers.get_mut(&follower) {
            p.in_flight += 1;
            p.last_sent_us = Some(now_us);
        }
    }

    /// A follower answered. Returns `Ok(commit moved)` or `Err(newer epoch)`
    /// when the follower has seen a newer epoch than this leader's.
    /// `sent_us` is when the request this reply answers was sent: a
    /// positive reply shows the follower accepted this leadership at some
    /// instant after it, not at the instant the reply is read. The lease
    /// counts from it, so replies that waited in a socket while this leader
    /// was frozen (SIGSTOP, a long pause) cannot extend a lease that lapsed
    /// meanwhile.
    pub fn on_reply(&mut self, follower: NodeId, reply: ShipReply, sent_us: u64) -> Result<bool, Epoch> {
        let first = self.first;
        let durable = self.durable;
        let written = self.written;
        let threshold = self.settings.catchup_threshold_bytes;
        let Some(p) = self.followers.get(&follower).copied() else { return Ok(false) };
        let was = p.mode;
        let mut p = FollowerProgress { in_flight: p.in_flight.saturating_sub(1), ..p };
        match reply {
            ShipReply::StaleEpoch { epoch } if epoch > self.epoch => {
                self.followers.insert(follower, p);
                return Err(epoch);
            }
            ShipReply::StaleEpoch { .. } | ShipReply::Failed => {
                // An unreachable follower that needs a re-seed still does.
                if p.mode != ShipMode::NeedsReseed {
                    p.mode = ShipMode::Probe;
                }
                p.next = p.acked + 1;
            }
            ShipReply::Applied { applied } | ShipReply::Gap { applied } => {
                p.last_reply_us = Some(p.last_reply_us.map_or(sent_us, |last| last.max(sent_us)));
                // Never past what this leader's log holds: a longer log on
                // the follower is a divergence for EpochEnd repair, not an ack.
                p.acked = p.acked.max(applied.min(written));
                if matches!(reply, ShipReply::Gap { .. }) || p.next <= p.acked {
                    p.next = p.acked + 1;
                }
                let behind = self.bytes_between(p.acked, durable);
                p.mode = if p.acked + 1 < first {
                    ShipMode::NeedsReseed
                } else {
                    match p.mode {
                        ShipMode::Push if behind > threshold => ShipMode::CatchUp,
                        ShipMode::Push => ShipMode::Push,
                        // Leave catch-up once half the threshold away, so a
                        // follower near the line does not flap.
                        _ if behind <= threshold / 2 => ShipMode::Push,
                        _ => ShipMode::CatchUp,
                    }
                };
                if p.mode == ShipMode::Push && was != ShipMode::Push {
                    p.next = p.acked + 1;
                }
            }
        }
        self.followers.insert(follower, p);
        self.prune_ledger();
        Ok(self.recompute_commit())
    }

    /// Whether `follower` may go quiet: pushed to, nothing in flight, it
    /// durably holds everything this leader has written, and it has been
    /// told the current commit (`told_commit`, the commit carried by the
    /// last request it answered). A quiet follower gets no per-shard
    /// traffic; node-level keepalives stand in for it (see
    /// `shipping/src/replica/quiet.rs`).
    pub fn may_go_quiet(&self, follower: NodeId, told_commit: Seqno) -> bool {
        self.followers.get(&follower).is_some_and(|p| {
            p.mode == ShipMode::Push
                && p.in_flight == 0
                && p.acked == self.written
                && p.acked == self.durable
                && p.last_reply_us.is_some()
                && told_commit >= self.commit
        })
    }

    /// A node-level keepalive sent at `sent_us` was answered positively by
    /// `follower` while this shard was quiet towards it: as a positive
    /// shipment reply, it counts as contact from then (lease, silences).
    /// Moves nothing else.
    pub fn on_node_contact(&mut self, follower: NodeId, sent_us: u64) {
        if let Some(p) = self.followers.get_mut(&follower) {
            p.last_reply_us = Some(p.last_reply_us.map_or(sent_us, |last| last.max(sent_us)));
        }
    }

    /// Until when (µs) this leader may acknowledge appends: its last
    /// contact with a majority (counting itself; the time of each follower's
    /// last positive reply) or its own start, whichever is newer, plus the
    /// lease. The coordinator's word does not count: a leader cut off from
    /// its followers must stop acknowledging even while it reaches the
    /// coordinator (CheckQuorum); past this instant it steps down. `None`: no bound (a
    /// static cluster, or a replica set the leader is a majority of alone).
    pub fn lease_until(&self) -> Option<u64> {
        let lease = self.settings.lease_us?;
        // Followers needed besides the leader: a majority of the replica
        // set minus the leader itself.
        let replicas = self.voters().count() + 1;
        let needed = replicas / 2;
        if needed == 0 {
            return None;
        }
        let mut contacts: Vec<u64> = self.voters().filter_map(|p| p.last_reply_us).collect();
        contacts.sort_unstable_by(|a, b| b.cmp(a));
        let majority = contacts.get(needed - 1).copied();
        let contact = majority.unwrap_or(0).max(self.started_us);
        Some(contact.saturating_add(lease))
    }

    /// Whether the followers in `quiet` alone are enough for the lease (as
    /// many voters as [`LeaderCore::lease_until`] needs): while they stay
    /// quiet, their node-level keepalives keep it, and the shell watches
    /// those links instead of a per-shard timer. True without a lease.
    pub fn lease_held_by(&self, quiet: impl Iterator<Item = NodeId>) -> bool {
        if self.settings.lease_us.is_none() {
            return true;
        }
        let replicas = self.voters().count() + 1;
        let needed = replicas / 2;
        let quiet_voters = quiet
            .filter(|n| self.followers.contains_key(n) && !self.learners.contains(n) && !self.old_only.contains(n))
            .count();
        quiet_voters >= needed
    }

    /// Whether a majority of the replica set has answered this leadership
    /// at least once. Until then a lapsed lease only stops acknowledgements:
    /// a leader whose followers are still starting waits for them instead of
    /// stepping down (CheckQuorum is about losing a majority; a leader that
    /// never reached one is the coordinator's to replace, as its followers
    /// report they cannot hear it).
    pub fn had_majority(&self) -> bool {
        let replicas = self.voters().count() + 1;
        self.voters().filter(|p| p.last_reply_us.is_some()).count() >= replicas / 2
    }

    /// Whether the nodes of a majority of the replica set (counting the
    /// leader's own) still answer this node: `node_answered` gives, per
    /// follower node, when the newest request of any kind it answered was
    /// sent (any shard's shipment, a node keepalive), and a voter counts if
    /// that is at or after `since_us`.
    ///
    /// CheckQuorum asks it before stepping down. Crashes and partitions cut
    /// nodes, not shards: while a majority's nodes answer, a lapsed lease is
    /// this shard's own delay (its shipper starved on a saturated node, a
    /// follower still repairing) and the leader keeps waiting, acknowledging
    /// nothing (the lease still gates every acknowledgement). Stepping down
    /// then would only hand the shard over, and on a node that leads
    /// thousands of shards, hand them all over at once: the work of those
    /// failovers starved the nodes further and the cluster churned.
    pub fn nodes_reach_majority(&self, node_answered: impl Fn(NodeId) -> Option<u64>, since_us: u64) -> bool {
        let replicas = self.voters().count() + 1;
        let reached = self
            .followers
            .keys()
            .filter(|n| !self.learners.contains(n) && !self.old_only.contains(n))
            .filter(|&&n| node_answered(n).is_some_and(|at| at >= since_us))
            .count();
        reached + 1 > replicas / 2
    }

    /// Whether the lease holds at `now_us` (see [`LeaderCore::lease_until`]).
    pub fn lease_holds(&self, now_us: u64) -> bool {
        self.lease_until().is_none_or(|until| now_us < until)
    }

    /// Lag of `follower` at `now_us`.
    pub fn lag(&self, follower: NodeId, now_us: u64) -> Option<Lag> {
        let p = self.followers.get(&follower)?;
        let records = self.durable.since(p.acked);
        let bytes = self.bytes_between(p.acked, self.durable);
        let seconds = if records == 0 {
            0.0
        } else {
            // When the oldest record it lacks became durable here. One from
            // before this leadership has no mark: it was durable before the
            // leadership started, so its age is at least that long (a later
            // mark would make a follower that lacks old records look current).
            let since = if p.acked < self.start_durable {
                self.started_us
            } else {
                self.ledger.iter().find(|m| m.seqno > p.acked).map_or(self.started_us, |m| m.at_us)
            };
            now_us.saturating_sub(since) as f64 / 1e6
        };
        Some(Lag { records, bytes, write_seconds: seconds, flush_seconds: seconds, apply_seconds: seconds })
    }

    /// Plans a retention pass. `retain_bytes`: what readers keep;
    /// `max_retain_bytes`: the hard bound even for lagging followers.
    pub fn plan_retention(&self, retain_bytes: u64, max_retain_bytes: u64) -> RetentionPlan {
        let avg = self.avg_frame_bytes;
        if avg == 0 {
            return RetentionPlan::default();
        }
        let end = self.durable + 1;
        let desired = Seqno(end.0.saturating_sub(retain_bytes / avg)).max(self.first);
        let hold = self
            .followers
            .values()
            .filter(|p| p.mode != ShipMode::NeedsReseed)
            .map(|p| p.acked + 1)
            .fold(end, Seqno::min);
        let hard = Seqno(end.0.saturating_sub(max_retain_bytes / avg));
        let mut compact_to = desired.min(hold);
        let mut reseed = Vec::new();
        if compact_to < hard {
            compact_to = hard;
            reseed = self
                .followers
                .iter()
                .filter(|(_, p)| p.mode != ShipMode::NeedsReseed && p.acked + 1 < hard)
                .map(|(&n, _)| n)
                .collect();
        }
        RetentionPlan { compact_to: (compact_to > self.first).then_some(compact_to), reseed }
    }

    /// Marks followers as needing re-seed (retention discarded what they need).
    pub fn mark_reseed(&mut self, followers: &[NodeId]) {
        for f in followers {
            if let Some(p) = self.followers.get_mut(f) {
                p.mode = ShipMode::NeedsReseed;
            }
        }
    }

    /// Bytes of the records `(from, to]`, from the ledger where it reaches,
    /// estimated from the average frame size where it does not.
    fn bytes_between(&self, from: Seqno, to: Seqno) -> u64 {
        if to <= from {
            return 0;
        }
        let at = |s: Seqno| self.ledger.iter().rev().find(|m| m.seqno <= s).map(|m| m.bytes);
        match (at(from), at(to)) {
            (Some(a), Some(b)) => b.saturating_sub(a),
            _ => to.since(from) * self.avg_frame_bytes,
        }
    }

    /// Halves a full ledger: keeps the two oldest marks (the slowest
    /// follower's base and the mark of the oldest record it lacks) and the
    /// newest, and every other mark between.
    fn thin_ledger(&mut self) {
        let last = self.ledger.len() - 1;
        let mut i = 0;
        self.ledger.retain(|_| {
            let keep = i < 2 || i == last || i % 2 == 0;
            i += 1;
            keep
        });
    }

    /// The number of marks the ledger holds (bounded by [`LEDGER_CAP`]).
    pub fn ledger_len(&self) -> usize {
        self.ledger.len()
    }

    /// Drops marks no follower's lag needs (all but the newest one at or
    /// below the slowest follower's acked position).
    fn prune_ledger(&mut self) {
        let slowest = self.followers.values().map(|p| p.acked).min().unwrap_or(self.durable);
        while self.ledger.len() > 1 && self.ledger[1].seqno <= slowest {
            self.ledger.pop_front();
        }
    }

    fn recompute_commit(&mut self) -> bool {
        let mut quorum = self.majority_position(self.voters(), true);
        if let Some((old, leader)) = &self.joint {
            let old = self.followers.iter().filter(|(n, _)| old.contains(n)).map(|(_, p)| p);
            quorum = quorum.min(self.majority_position(old, *leader));
        }
        let quorum = quorum.min(self.durable);
        if quorum > self.commit {
            self.commit = quorum;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
#[path = "leader_test.rs"]
mod tests;
