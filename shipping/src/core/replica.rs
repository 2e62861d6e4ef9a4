//! One shard replica's role and epoch rules: fencing, assignment, following
//! a newer leader met in a shipment, stepping down, the restarted-epoch
//! rule, repair gating, drills' pause, and what a corrupt log or a full disk
//! forbids. Pure: events in, [`Command`]s (or a [`Refusal`]) out; the async
//! shell (`crate::replica`) performs the commands in order, under its
//! per-shard transition lock, and reports back what it did
//! ([`ReplicaCore::started_leading`], [`ReplicaCore::repaired`]).
//!
//! Invariants kept here:
//! * the promised epoch never decreases, and nothing from an older epoch is
//!   accepted: fences, assignments and shipments alike ([`Refusal::StaleEpoch`]);
//!   every change of promise is persisted first ([`Command::PersistEpoch`]);
//! * at most one role per epoch: a replica leads only the epoch it was
//!   assigned, follows at most one leader per epoch (a shipment from another
//!   node in that epoch is refused), and a fence at or past its leading
//!   epoch stops its leadership;
//! * under a coordinator a replica never leads in the epoch it restarted in
//!   (early shipping: it may have shipped records its disk then lost;
//!   `shipping/EARLY-SHIPPING.md`), nor again in an epoch it stepped down
//!   from for want of a majority (CheckQuorum), and reports that it needs a
//!   new epoch;
//! * a follower applies nothing of an epoch before its log is reconciled
//!   with that epoch's leader (EpochEnd repair): until then shipments are
//!   refused as retryable and a catch-up is asked for;
//! * a full disk changes no role: the replica reports it (the coordinator
//!   leads elsewhere when a healthy caught-up replica exists), still takes
//!   the leadership it is assigned and admits shipments, and only what needs
//!   room is refused, by its WAL: new records (`RESOURCE_EXHAUSTED`). The
//!   epoch promises, keepalives and commit positions go on, so a shard
//!   whose every replica is full keeps a leader and serves every
//!   acknowledged record from every replica; refusing the leadership instead
//!   left such a shard with none, and restarted replicas unable to learn
//!   its commit;
//! * a follower that finds corruption in its own log truncates from the
//!   first bad seqno and refetches; a leader reports it (the coordinator
//!   fails over when an intact caught-up replica exists) and keeps serving
//!   what is below the damage.

use super::{Epoch, Seqno};
use crate::NodeId;

/// A replica's role in its shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Leader,
    Follower {
        leader: NodeId,
    },
    /// Fenced, or restarted under a coordinator: waits for an assignment.
    Unassigned,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Leader => "leader",
            Role::Follower { .. } => "follower",
            Role::Unassigned => "unassigned",
        }
    }
}

/// What [`ReplicaCore::follows`] reads, copied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FollowsInputs {
    view: View,
    promised: Epoch,
    repaired: Epoch,
    paused: bool,
    promise_lost: bool,
}

/// A replica's role and the epoch it holds it in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct View {
    pub role: Role,
    pub epoch: Epoch,
}

/// What the shell must do, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// Record the promise of `epoch` durably (refuse older ones from now on).
    PersistEpoch(Epoch),
    /// Stop leading: the leadership's tasks end, appends waiting on it give
    /// up with an unknown outcome.
    StopLeading,
    /// Wait for everything queued to the WAL to be durable, then lead
    /// `epoch` and report it with [`ReplicaCore::started_leading`].
    StartLeading { epoch: Epoch },
    /// Reconcile with and pull from the leader of the current view, unless
    /// a catch-up already runs.
    CatchUp,
    /// Remove every record after `keep_through` (a corrupt tail found in
    /// this follower's own log), then catch up to refetch it.
    Truncate { keep_through: Seqno },
}

/// Why an event was refused; nothing changed. The words an operator
/// reads (with the shard and node) are the shell's: `replica/error.rs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// `epoch` is older than the newest promised (`seen`).
    StaleEpoch { epoch: Epoch, seen: Epoch },
    /// An assignment naming a leader outside the replica set.
    NotAReplica { node: NodeId },
    /// A shipment from a node outside the replica set (or from itself).
    ForeignLeader { node: NodeId },
    /// Leading the epoch this replica restarted in.
    RestartedEpoch { epoch: Epoch },
    /// Leading again the epoch it stepped down from (CheckQuorum).
    SteppedDown { epoch: Epoch },
    /// A shipment to the leader of its own (or an older) epoch.
    NotFollower,
    /// A shipment from another node than the leader of the followed epoch.
    WrongLeader { from: NodeId, leader: NodeId },
    /// A paused follower (drills).
    Paused,
    /// Not reconciled with the leader of `epoch` yet (retryable).
    Reconciling { epoch: Epoch },
    /// Pausing the leader.
    LeaderCannotPause,
    /// Its epoch promise may have been lost (a data dir without one, or
    /// records its WAL's recovery cut away): it takes nothing from a leader
    /// until its coordinator fences or assigns it again (retryable).
    AwaitingAssignment,
    /// An epoch at or past [`Epoch::CEILING`]: no coordinator hands it out.
    EpochTooLarge { epoch: Epoch },
}

impl Refusal {
    /// The `reason` label of `walship_ship_refused_total` (and of logs).
    pub fn reason(self) -> &'static str {
        match self {
            Refusal::StaleEpoch { .. } => "stale_epoch",
            Refusal::NotAReplica { .. } => "bad_request",
            Refusal::ForeignLeader { .. } => "wrong_leader",
            Refusal::RestartedEpoch { .. } => "restarted_epoch",
            Refusal::SteppedDown { .. } => "stepped_down",
            Refusal::NotFollower => "not_follower",
            Refusal::WrongLeader { .. } => "wrong_leader",
            Refusal::Paused => "paused",
            Refusal::Reconciling { .. } => "reconciling",
            Refusal::LeaderCannotPause => "bad_request",
            Refusal::AwaitingAssignment => "awaiting_assignment",
            Refusal::EpochTooLarge { .. } => "bad_request",
        }
    }

    /// Whether the same request may succeed if sent again later.
    pub fn retryable(self) -> bool {
        matches!(self, Refusal::Paused | Refusal::Reconciling { .. } | Refusal::AwaitingAssignment)
    }
}

/// An inbound shipment's fate at the role gate: commands to perform first
/// (following a newer leader, starting a catch-up), then go on or refuse.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admission {
    pub commands: Vec<Command>,
    pub outcome: Result<(), Refusal>,
}

/// The role and epoch state of one shard replica.
#[derive(Debug, Clone)]
pub struct ReplicaCore {
    me: NodeId,
    replicas: Vec<NodeId>,
    /// Under a coordinator: leadership moves, so the restarted-epoch rule
    /// applies (and leaders ship early).
    coordinated: bool,
    view: View,
    /// The newest epoch promised (persisted before it is acted on).
    promised: Epoch,
    /// The epoch promised when the process started (see the module docs).
    restarted_in: Epoch,
    /// The epoch it last stepped down from for want of a majority.
    stepped_down_in: Epoch,
    /// The epoch whose leader this log has been reconciled with.
    repaired: Epoch,
    paused: bool,
    disk_full: bool,
    /// The first seqno of this replica's log known to be corrupt.
    corrupt_from: Option<Seqno>,
    /// `promised` may be older than what this replica promised before (see
    /// [`ReplicaCore::promise_lost`]) until the coordinator fences or
    /// assigns it.
    promise_lost: bool,
}

impl ReplicaCore {
    /// A replica that starts unassigned, having promised `promised` before.
    pub fn new(me: NodeId, replicas: Vec<NodeId>, coordinated: bool, promised: Epoch) -> ReplicaCore {
        ReplicaCore {
            me,
            replicas,
            coordinated,
            view: View { role: Role::Unassigned, epoch: promised },
            promised,
            restarted_in: promised,
            stepped_down_in: Epoch(0),
            repaired: Epoch(0),
            paused: false,
            disk_full: false,
            corrupt_from: None,
            promise_lost: false,
        }
    }

    /// The promise this replica read back at start may be older than one it
    /// gave: the WAL's recovery cut damaged records away, and maybe the
    /// newest epoch promised with them, or the data dir holds no promise at
    /// all (new, or wiped or replaced since it promised). A leader deposed
    /// since could then ship to it again, and its acknowledgements would
    /// count toward a majority the new leader never had. Under a coordinator, whose epochs are newer
    /// than every one it handed out before, this replica takes nothing from
    /// a leader until the coordinator fences or assigns it. A static
    /// cluster has no such authority; its epochs do not move.
    pub fn promise_lost(&mut self) {
        self.promise_lost = self.coordinated;
    }

    pub fn view(&self) -> View {
        self.view
    }

    /// Takes the coordinator's replica set for `epoch` (the voters of both
    /// sets while it changes), who may lead and ship to this replica. Only
    /// from an epoch not older than the promised one: a stale assignment
    /// changes nothing.
    pub fn set_replicas(&mut self, epoch: Epoch, replicas: &[NodeId]) {
        if epoch >= self.promised && !replicas.is_empty() {
            self.replicas = replicas.to_vec();
        }
    }

    pub fn promised(&self) -> Epoch {
        self.promised
    }

    pub fn paused(&self) -> bool {
        self.paused
    }

    pub fn disk_full(&self) -> bool {
        self.disk_full
    }

    pub fn corrupt_from(&self) -> Option<Seqno> {
        self.corrupt_from
    }

    /// Under a coordinator: this replica still waits for an epoch newer than
    /// the one it restarted in before it may lead; heartbeats say so, and
    /// the coordinator raises the epoch instead of re-assigning it.
    pub fn needs_new_epoch(&self) -> bool {
        self.coordinated
            && self.promised > Epoch(0)
            && (self.promised == self.restarted_in || self.promised == self.stepped_down_in)
    }

    /// Whether this log is reconciled with the leader of `epoch`.
    pub fn is_repaired_for(&self, epoch: Epoch) -> bool {
        self.repaired >= epoch
    }

    /// The leader a catch-up should pull from, and its epoch: none unless
    /// following and not paused.
    pub fn catch_up_source(&self) -> Option<(NodeId, Epoch)> {
        match self.view.role {
            Role::Follower { leader } if !self.paused => Some((leader, self.view.epoch)),
            _ => None,
        }
    }

    fn check_epoch(&self, epoch: Epoch) -> Result<(), Refusal> {
        if epoch.0 >= Epoch::CEILING {
            return Err(Refusal::EpochTooLarge { epoch });
        }
        if epoch < self.promised { Err(Refusal::StaleEpoch { epoch, seen: self.promised }) } else { Ok(()) }
    }

    /// Raises the promise to `epoch` if it is newer.
    fn promise(&mut self, epoch: Epoch, commands: &mut Vec<Command>) {
        if epoch > self.promised {
            self.promised = epoch;
            commands.push(Command::PersistEpoch(epoch));
        }
    }

    /// Leaves the leader role, if held, for `Unassigned` in `epoch`.
    fn stop_leading(&mut self, commands: &mut Vec<Command>) {
        commands.push(Command::StopLeading);
    }

    /// The coordinator fences at `epoch`: refuse anything older from now on,
    /// and stop leading unless leading a newer epoch.
    pub fn fence(&mut self, epoch: Epoch) -> Result<Vec<Command>, Refusal> {
        self.check_epoch(epoch)?;
        self.promise_lost = false;
        let mut commands = Vec::new();
        self.promise(epoch, &mut commands);
        if epoch > self.view.epoch || (epoch == self.view.epoch && self.view.role == Role::Leader) {
            self.stop_leading(&mut commands);
            self.view = View { role: Role::Unassigned, epoch };
        }
        Ok(commands)
    }

    /// Lead `epoch` (when `leader` is this node) or follow `leader` in it.
    /// Idempotent for the current view.
    pub fn assign(&mut self, epoch: Epoch, leader: NodeId) -> Result<Vec<Command>, Refusal> {
        if !self.replicas.contains(&leader) {
            return Err(Refusal::NotAReplica { node: leader });
        }
        self.check_epoch(epoch)?;
        self.promise_lost = false;
        let wanted = if leader == self.me { Role::Leader } else { Role::Follower { leader } };
        if self.view == (View { role: wanted, epoch }) {
            return Ok(Vec::new());
        }
        if leader == self.me {
            if self.coordinated && epoch == self.restarted_in {
                return Err(Refusal::RestartedEpoch { epoch });
            }
            if epoch == self.stepped_down_in {
                return Err(Refusal::SteppedDown { epoch });
            }
        }
        Ok(self.take(epoch, wanted))
    }

    /// Moves to `wanted` in `epoch`: promise, stop leading, then lead or
    /// follow. A leader's view changes once the shell reports it leads.
    fn take(&mut self, epoch: Epoch, wanted: Role) -> Vec<Command> {
        let mut commands = Vec::new();
        self.promise(epoch, &mut commands);
        self.stop_leading(&mut commands);
        match wanted {
            Role::Leader => {
                self.view = View { role: Role::Unassigned, epoch };
                commands.push(Command::StartLeading { epoch });
            }
            role => {
                self.view = View { role, epoch };
                commands.push(Command::CatchUp);
            }
        }
        commands
    }

    /// The shell leads `epoch` now (its leader state is in place).
    pub fn started_leading(&mut self, epoch: Epoch) {
        if epoch == self.promised {
            self.view = View { role: Role::Leader, epoch };
        }
    }

    /// A shipment (push, stream chunk or keepalive) from `from` in `epoch`
    /// reaches the role gate: refuse it, or follow a leader this replica had
    /// not been told about (epochs are unique per leader), then admit it
    /// once this log is reconciled with that leader.
    pub fn inbound(&mut self, epoch: Epoch, from: NodeId) -> Admission {
        let refuse = |refusal| Admission { commands: Vec::new(), outcome: Err(refusal) };
        if let Err(refusal) = self.check_epoch(epoch) {
            return refuse(refusal);
        }
        if self.promise_lost {
            return refuse(Refusal::AwaitingAssignment);
        }
        let mut commands = Vec::new();
        match self.view.role {
            Role::Leader if epoch <= self.view.epoch => return refuse(Refusal::NotFollower),
            Role::Follower { leader } if epoch == self.view.epoch && from != leader => {
                return refuse(Refusal::WrongLeader { from, leader });
            }
            Role::Follower { .. } if epoch == self.view.epoch => {}
            _ => {
                if !self.replicas.contains(&from) || from == self.me {
                    return refuse(Refusal::ForeignLeader { node: from });
                }
                commands = self.take(epoch, Role::Follower { leader: from });
            }
        }
        let outcome = if self.paused {
            Err(Refusal::Paused)
        } else if !self.is_repaired_for(epoch) {
            if !commands.contains(&Command::CatchUp) {
                commands.push(Command::CatchUp);
            }
            Err(Refusal::Reconciling { epoch })
        } else {
            Ok(())
        };
        Admission { commands, outcome }
    }

    /// Whether a shipment from `from` in `epoch` would be admitted now
    /// without changing anything: this replica follows `from` in exactly
    /// that epoch, with nothing newer promised, its log reconciled with
    /// that leader and not paused. What a quiet shard's
    /// node-level keepalive checks in place of a per-shard keepalive
    /// ([`ReplicaCore::inbound`] would admit it and change nothing).
    pub fn follows(&self, epoch: Epoch, from: NodeId) -> bool {
        // Reads only what `follows_inputs` copies: keep the two together.
        self.view.role == Role::Follower { leader: from }
            && self.view.epoch == epoch
            && self.promised <= epoch
            && self.is_repaired_for(epoch)
            && !self.paused
            && !self.promise_lost
    }

    /// Everything [`ReplicaCore::follows`] reads: while these are equal,
    /// so is every answer it gives (the node counts changes to them, see
    /// `replica/shard.rs`, `Rules`).
    pub fn follows_inputs(&self) -> FollowsInputs {
        FollowsInputs {
            view: self.view,
            promised: self.promised,
            repaired: self.repaired,
            paused: self.paused,
            promise_lost: self.promise_lost,
        }
    }

    /// A follower answered this leader with a newer epoch: it was deposed.
    pub fn deposed(&mut self, epoch: Epoch) -> Vec<Command> {
        if self.view.epoch >= epoch {
            return Vec::new();
        }
        let mut commands = Vec::new();
        self.promise(epoch, &mut commands);
        self.stop_leading(&mut commands);
        self.view = View { role: Role::Unassigned, epoch };
        commands
    }

    /// The leader of `epoch` has not heard from a majority of its replica
    /// set within the lease (CheckQuorum): it steps down, and leads again
    /// only in a newer epoch.
    pub fn quorum_lost(&mut self, epoch: Epoch) -> Vec<Command> {
        if self.view != (View { role: Role::Leader, epoch }) {
            return Vec::new();
        }
        self.stepped_down_in = epoch;
        self.view = View { role: Role::Unassigned, epoch };
        vec![Command::StopLeading]
    }

    /// The shell reconciled this log with the leader of `epoch` (and
    /// recorded that epoch as the log's).
    pub fn repaired(&mut self, epoch: Epoch) {
        self.repaired = self.repaired.max(epoch);
    }

    /// Drills: pause or resume this follower.
    pub fn pause(&mut self, paused: bool) -> Result<Vec<Command>, Refusal> {
        if paused && self.view.role == Role::Leader {
            return Err(Refusal::LeaderCannotPause);
        }
        self.paused = paused;
        Ok(if paused { Vec::new() } else { vec![Command::CatchUp] })
    }

    /// The node's disk filled up, or has room again. A full disk changes
    /// no role and refuses nothing here (the WAL refuses the records it has
    /// no room for, see the module docs); room again lets a follower catch
    /// up on what it refused meanwhile.
    pub fn disk(&mut self, full: bool) -> Vec<Command> {
        let was = std::mem::replace(&mut self.disk_full, full);
        if was && !full && matches!(self.view.role, Role::Follower { .. }) {
            vec![Command::CatchUp]
        } else {
            Vec::new()
        }
    }

    /// A record at `first_bad` (or later) of this replica's own log failed
    /// its checksum. A follower drops the damaged tail and refetches it; a
    /// leader keeps serving below the damage and reports it (see the module
    /// docs).
    pub fn corruption_found(&mut self, first_bad: Seqno) -> Vec<Command> {
        let first_bad = self.corrupt_from.map_or(first_bad, |known| known.min(first_bad));
        self.corrupt_from = Some(first_bad);
        match self.view.role {
            Role::Follower { .. } => vec![Command::Truncate { keep_through: first_bad.prev() }, Command::CatchUp],
            Role::Leader | Role::Unassigned => Vec::new(),
        }
    }

    /// The corrupt tail is gone (truncated); nothing known-corrupt remains.
    pub fn corruption_repaired(&mut self) {
        self.corrupt_from = None;
    }
}

#[cfg(test)]
#[path = "replica_test.rs"]
mod tests;
