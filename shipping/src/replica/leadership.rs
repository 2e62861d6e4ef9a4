//! Role changes: the coordinator's fence and assignment, a leader deposed
//! by a newer epoch, drills' pause and crash, and the positions a failover
//! compares. The rules (`core/replica.rs`) decide; this file performs their
//! [`Command`]s in order, under the shard's transition lock.
//!
//! A promise is recorded durably before anything that relies on it is
//! answered: a fence answers only after its epoch is in the WAL. A leader's
//! state is installed under the rules' lock and only if no newer epoch was
//! promised meanwhile, so a leadership decided before a fence can never
//! start after it.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use parking_lot::Mutex;
use walship_proto::log::{AssignResponse, EpochEndRequest, FenceResponse};
use walship_wal::ShardId;
use walship_wal::position as watch;

use std::collections::BTreeMap;

use tokio_util::sync::CancellationToken;

use super::shard::{LeaderState, Members};
use super::{ReplicaError, ReplicationNode, ShardReplica, Source, now_us};
use crate::NodeId;
use crate::core::leader::{LeaderCore, LeaderStart};

/// How long [`ReplicationNode::settle`] waits before it reports a wait
/// that should have ended.
const SETTLE_WARN_AFTER: Duration = Duration::from_secs(5);
use crate::core::replica::{Command, Refusal, Role};
use crate::core::{Epoch, Seqno};

impl ReplicationNode {
    /// Refusal of `refusal` for `replica`'s shard.
    pub(crate) fn refused(&self, replica: &ShardReplica, refusal: Refusal) -> ReplicaError {
        ReplicaError::Refused { shard: replica.shard, node: self.me, refusal }
    }

    /// Performs what the rules decided, in order. `commit_floor` is handed
    /// to a leadership this starts. Call with the transition lock held.
    ///
    /// Boxed: leading spawns shippers whose replies may depose it, which
    /// performs again; a declared `Send` future breaks that cycle for the
    /// compiler.
    pub(crate) fn perform<'a>(
        self: &'a Arc<Self>,
        replica: &'a Arc<ShardReplica>,
        commands: Vec<Command>,
        commit_floor: u64,
    ) -> futures::future::BoxFuture<'a, Result<(), ReplicaError>> {
        Box::pin(self.perform_inner(replica, commands, commit_floor))
    }

    async fn perform_inner(
        self: &Arc<Self>,
        replica: &Arc<ShardReplica>,
        commands: Vec<Command>,
        commit_floor: u64,
    ) -> Result<(), ReplicaError> {
        if !commands.is_empty() {
            replica.unsettle();
        }
        for command in commands {
            match command {
                Command::PersistEpoch(epoch) => self.wal.set_epoch(replica.shard, epoch.0).await?,
                Command::StopLeading => replica.stop_leading(),
                Command::StartLeading { epoch } => {
                    self.settle(replica).await?;
                    self.become_leader(replica, epoch.0, commit_floor).await?;
                }
                Command::CatchUp => {
                    replica.follower.last_contact_us.store(now_us(), std::sync::atomic::Ordering::Release);
                    if let Some((leader, epoch)) = replica.rules.lock().catch_up_source() {
                        tracing::debug!(shard = replica.shard, epoch = epoch.0, leader, "catching up");
                    }
                    self.start_catchup(replica.clone());
                }
                Command::Truncate { keep_through } => self.truncate_corrupt(replica, keep_through.0).await?,
            }
        }
        Ok(())
    }

    /// Waits until everything queued to the WAL from ships is durable, so a
    /// position reported afterwards covers it.
    pub(crate) async fn settle(&self, replica: &ShardReplica) -> Result<(), ReplicaError> {
        let _guard = replica.follower.apply_lock.lock().await;
        let queued = *replica.follower.next_expected.borrow() - 1;
        let mut durable = self.wal.durable_watch(replica.shard)?;
        // Every queued record becomes durable or the process aborts (a
        // failed write or fsync is fatal), so this wait ends; should it
        // not, say so once with what it waits for.
        if tokio::time::timeout(SETTLE_WARN_AFTER, durable.wait_for(|d| *d >= queued)).await.is_err() {
            let p = self.wal.positions(replica.shard)?;
            let written = *self.wal.written_watch(replica.shard)?.borrow();
            tracing::warn!(
                shard = replica.shard,
                queued,
                durable = p.durable_seqno,
                written,
                stored = p.last_seqno,
                "still waiting for queued records to become durable"
            );
            let _ = durable.wait_for(|d| *d >= queued).await;
        }
        Ok(())
    }

    /// The epoch a failover ranks this replica's log by (reported as
    /// `last_epoch`): its log epoch, the newest epoch whose leader's log it
    /// is a prefix of (Viewstamped Replication's "last normal view"; see
    /// `core/leader.rs` for why commits rely on it), or its last record's
    /// epoch where that is newer (a log from before log epochs were kept).
    ///
    /// A damaged newest record ranks the log by its log epoch alone: the
    /// read that failed put the damage in the corruption registry, so the
    /// answer reports it (`corrupt_from_seqno`) and a failover takes this
    /// replica for unhealthy. Failing instead would leave the replica
    /// unable to answer any fence until something repaired it, and one
    /// that is not following anyone repairs nothing: with its leader gone,
    /// the shard could not gather a majority.
    pub(crate) async fn log_rank_epoch(&self, shard: ShardId, p: &walship_wal::Positions) -> Result<u64, ReplicaError> {
        let last_record = if p.last_seqno >= p.first_seqno {
            match self.wal.epoch_at(shard, p.last_seqno).await {
                Ok(epoch) => epoch,
                Err(e) if e.corrupt_range().is_some() => {
                    tracing::warn!(shard, seqno = p.last_seqno, error = %e, "the newest record is damaged; ranked by the log epoch");
                    0
                }
                Err(e) => return Err(e.into()),
            }
        } else {
            0
        };
        Ok(last_record.max(self.wal.log_epoch(shard)?))
    }

    /// Where this replica's log stands.
    pub async fn position(&self, shard: ShardId) -> Result<FenceResponse, ReplicaError> {
        let replica = self.replica_or_not_found(shard).map_err(|e| self.counted(e))?;
        // Damage is looked up before the positions too: a truncation that
        // cuts it away lowers the positions first, so an answer never pairs
        // the old, longer log with no damage (a repair that looks finished
        // before its refetch began).
        let damaged_before = self.corrupt_from(shard);
        let p = self.wal.positions(shard)?;
        let last_epoch = self.log_rank_epoch(shard, &p).await?;
        // And after: ranking the log may have read damage and reported it.
        let corrupt_from = match (damaged_before, self.corrupt_from(shard)) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let commit = match replica.leader_state() {
            Some(leader) => leader.core.lock().commit().0,
            None => replica.follower.leader_commit.get().max(replica.readable()),
        };
        Ok(FenceResponse {
            node_id: self.me,
            last_epoch,
            last_seqno: p.last_seqno,
            durable_seqno: p.durable_seqno,
            commit_seqno: commit,
            epoch_seen: replica.epoch_seen(),
            first_seqno: p.first_seqno,
            disk_full: self.disk_full(),
            corrupt_from_seqno: corrupt_from.unwrap_or(0),
            retained_bytes: self.retained_bytes(shard, &p),
            applied_push_bytes: replica.follower.applied_bytes[Source::Push.index()].load(Ordering::Relaxed),
            applied_stream_bytes: replica.follower.applied_bytes[Source::Stream.index()].load(Ordering::Relaxed),
            applied_archive_bytes: replica.follower.applied_bytes[Source::Archive.index()].load(Ordering::Relaxed),
            applied_peer_bytes: replica.follower.applied_bytes[Source::Peer.index()].load(Ordering::Relaxed),
        })
    }

    /// Bytes of the shard's retained durable records, as retention counts
    /// them (records times the average frame size).
    fn retained_bytes(&self, shard: ShardId, p: &walship_wal::Positions) -> u64 {
        let Ok(c) = self.wal.counters(shard) else { return 0 };
        let average = c.bytes.checked_div(c.records).unwrap_or(0);
        (p.durable_seqno + 1).saturating_sub(p.first_seqno.max(1)) * average
    }

    /// Raises the replica's epoch: it refuses anything older from now on
    /// and stops leading. Answers where its log ends.
    pub async fn fence(self: &Arc<Self>, shard: ShardId, epoch: u64) -> Result<FenceResponse, ReplicaError> {
        let replica = self.replica_or_not_found(shard).map_err(|e| self.counted(e))?;
        let transition = replica.transition.lock().await;
        let decided = replica.rules.lock().fence(Epoch(epoch));
        let commands = decided.map_err(|r| self.counted(self.refused(&replica, r)))?;
        self.perform(&replica, commands, 0).await?;
        drop(transition);
        self.settle(&replica).await?;
        self.position(shard).await
    }

    /// Makes this replica the leader of `epoch` (when `leader` is this node)
    /// or a follower of `leader` in it. Idempotent for the current epoch.
    /// `members` (a coordinator's assignment; none from a static cluster's
    /// config) is who holds the shard from this epoch on: a node it names
    /// that does not host the shard creates it, and a leader of this epoch
    /// takes a change of learners or of the voting set in place.
    /// `fetch_token` (the coordinator's PeerExchange token for the shard)
    /// is kept only once the assignment is taken: a refused one, stale say,
    /// changes nothing.
    pub fn assign(
        self: &Arc<Self>,
        shard: ShardId,
        epoch: u64,
        leader: NodeId,
        commit_floor: u64,
        members: Option<Members>,
        fetch_token: Option<String>,
    ) -> impl std::future::Future<Output = Result<AssignResponse, ReplicaError>> + Send + 'static {
        let node = self.clone();
        async move {
            node.assign_inner(shard, epoch, leader, commit_floor, members, fetch_token)
                .await
                .map_err(|e| node.counted(e))
        }
    }

    async fn assign_inner(
        self: &Arc<Self>,
        shard: ShardId,
        epoch: u64,
        leader: NodeId,
        commit_floor: u64,
        members: Option<Members>,
        fetch_token: Option<String>,
    ) -> Result<AssignResponse, ReplicaError> {
        let replica = match &members {
            Some(m) => {
                let mut named = m.others(0);
                named.push(leader);
                self.replica_or_create(shard, &named)?
            }
            None => self.replica_or_not_found(shard)?,
        };
        let transition = replica.transition.lock().await;
        let mut commands = self.sync_disk(&replica);
        let decided = {
            let mut rules = replica.rules.lock();
            let mut current = replica.members.lock();
            if let Some(m) = members.as_ref().filter(|m| Epoch(epoch) >= rules.promised() && m.not_older_than(&current))
            {
                rules.set_replicas(Epoch(epoch), &m.all_voters());
                *current = m.clone();
            }
            drop(current);
            let decided = rules.assign(Epoch(epoch), leader);
            replica.note_new_leader(decided.as_deref().unwrap_or_default());
            decided
        };
        commands.extend(decided.map_err(|r| self.refused(&replica, r))?);
        // Before the catch-up below starts fetching with it.
        if let Some(token) = fetch_token {
            self.set_fetch_token(shard, token);
        }
        if let Some(Command::CatchUp) = commands.last() {
            tracing::info!(shard, epoch, leader, "following");
        }
        self.perform(&replica, commands, commit_floor).await?;
        if let Some(state) = replica.leader_state().filter(|s| s.epoch == epoch && leader == self.me) {
            self.apply_members(&replica, &state);
        }
        drop(transition);
        let last = self.wal.positions(shard).map(|p| p.last_seqno).unwrap_or(0);
        let role = if leader == self.me { "leader" } else { "follower" };
        Ok(AssignResponse { epoch, role: role.into(), last_seqno: last })
    }

    /// A leader takes the replica set it was just assigned in its own
    /// epoch: followers added start being shipped to (probed first), those
    /// no longer in any set stop, and the commit rule follows the new
    /// voters (both sets while joint).
    fn apply_members(self: &Arc<Self>, replica: &Arc<ShardReplica>, state: &Arc<LeaderState>) {
        let members = replica.members();
        let change = {
            let mut core = state.core.lock();
            let change = core.set_members(self.me, &members.voters, &members.learners, &members.joint);
            replica.publish_leader(&core, &self.metrics);
            change
        };
        for follower in change.removed {
            if let Some(stop) = state.shippers.lock().remove(&follower) {
                stop.cancel();
            }
            tracing::info!(shard = replica.shard, follower, "no longer shipping: not a member any more");
        }
        for follower in change.added {
            tracing::info!(
                shard = replica.shard,
                follower,
                learner = members.learners.contains(&follower),
                "shipping to a new member"
            );
            self.spawn_shipper(replica, state, follower);
        }
    }

    /// Starts shipping to `follower` under its own stop token (a member
    /// change stops one shipper without the others).
    fn spawn_shipper(self: &Arc<Self>, replica: &Arc<ShardReplica>, state: &Arc<LeaderState>, follower: NodeId) {
        let stop: CancellationToken = state.stop.child_token();
        if let Some(previous) = state.shippers.lock().insert(follower, stop.clone()) {
            previous.cancel();
        }
        tokio::spawn(self.clone().run_shipper(replica.clone(), state.clone(), follower, stop));
    }

    /// Installs a leadership of `epoch` and starts its tasks, unless a newer
    /// epoch was promised since the rules decided it.
    async fn become_leader(
        self: &Arc<Self>,
        replica: &Arc<ShardReplica>,
        epoch: u64,
        commit_floor: u64,
    ) -> Result<(), ReplicaError> {
        // Before it leads, its log is this epoch's: a failover ranks it so.
        self.wal.set_log_epoch(replica.shard, epoch).await?;
        let p = self.wal.positions(replica.shard)?;
        // The stream baseline: everything up to here predates this epoch.
        let (_, before) = self.wal.epoch_end(replica.shard, epoch - 1).await?;
        let members = replica.members();
        let followers = members.others(self.me);
        let start = LeaderStart {
            epoch: Epoch(epoch),
            first: Seqno(p.first_seqno),
            durable: Seqno(p.durable_seqno),
            epoch_start: Seqno(before + 1),
            commit_floor: Seqno(commit_floor.max(replica.follower.leader_commit.get())),
        };
        let mut core = LeaderCore::new(start, &followers, self.settings, now_us());
        core.set_members(self.me, &members.voters, &members.learners, &members.joint);
        let state = Arc::new(LeaderState {
            epoch,
            core: Mutex::new(core),
            ship_limit: watch::Sender::new(p.durable_seqno),
            stop: self.shutdown.child_token(),
            archiver: std::sync::atomic::AtomicU32::new(0),
            archived_by_follower: Arc::default(),
            shippers: Mutex::new(BTreeMap::new()),
            quiet: Mutex::new(BTreeMap::new()),
            quiet_changed: tokio::sync::Notify::new(),
            pulled: tokio::sync::watch::Sender::new(0),
        });
        {
            let mut rules = replica.rules.lock();
            if rules.promised() != Epoch(epoch) {
                tracing::info!(shard = replica.shard, epoch, "not leading: a newer epoch was promised meanwhile");
                return Ok(());
            }
            replica.publish_leader(&state.core.lock(), &self.metrics);
            *replica.leader.lock() = Some(state.clone());
            rules.started_leading(Epoch(epoch));
        }
        // The view became Leader after the assignment unsettled the replica:
        // a heartbeat may have reported it unassigned, and so settled, in
        // between.
        replica.unsettle();
        tokio::spawn(self.clone().run_leader_driver(replica.clone(), state.clone()));
        self.ensure_archiving(replica);
        if self.settings.lease_us.is_some() {
            tokio::spawn(self.clone().run_lease_watch(replica.clone(), state.clone()));
        }
        for follower in followers {
            self.spawn_shipper(replica, &state, follower);
        }
        tracing::info!(shard = replica.shard, epoch, stream_baseline = before, "leading");
        Ok(())
    }

    /// A follower answered with a newer epoch: this leader was deposed.
    pub(crate) async fn step_down(self: Arc<Self>, replica: Arc<ShardReplica>, epoch: u64) {
        let _transition = replica.transition.lock().await;
        let commands = replica.rules.lock().deposed(Epoch(epoch));
        if commands.is_empty() {
            return;
        }
        if let Err(error) = self.perform(&replica, commands, 0).await {
            tracing::error!(shard = replica.shard, %error, "recording the newer epoch");
        }
        tracing::warn!(shard = replica.shard, epoch, "deposed: a follower has seen a newer epoch");
    }

    /// CheckQuorum: the leader of `epoch` heard from no majority within its
    /// lease; it stops leading and asks for a newer epoch.
    pub(crate) async fn step_down_without_quorum(self: &Arc<Self>, replica: &Arc<ShardReplica>, epoch: u64) {
        let _transition = replica.transition.lock().await;
        let commands = replica.rules.lock().quorum_lost(Epoch(epoch));
        if let Err(error) = self.perform(replica, commands, 0).await {
            tracing::error!(shard = replica.shard, %error, "stepping down");
        }
    }

    /// The last seqno of this replica's log whose epoch is `<= epoch`.
    pub async fn epoch_end(&self, request: EpochEndRequest) -> Result<(u64, u64), ReplicaError> {
        self.replica_or_not_found(request.shard_id).map_err(|e| self.counted(e))?;
        Ok(self.wal.epoch_end(request.shard_id, request.epoch).await?)
    }

    /// Drills: pause or resume a follower replica. A pause is a lease: it
    /// ends by itself `replication.pause_lease_ms` after the last pause
    /// call (a drill renews it while it runs), so a drill whose coordinator
    /// dies mid-way does not leave its follower paused for good.
    pub fn pause(self: &Arc<Self>, shard: ShardId, paused: bool) -> Result<(), ReplicaError> {
        let replica = self.replica_or_not_found(shard).map_err(|e| self.counted(e))?;
        let decided = replica.rules.lock().pause(paused);
        let commands = decided.map_err(|r| self.refused(&replica, r))?;
        let generation = replica.pause_generation.fetch_add(1, std::sync::atomic::Ordering::AcqRel) + 1;
        if paused {
            let (node, replica) = (self.clone(), replica.clone());
            let lease = Duration::from_millis(self.config.replication.pause_lease_ms);
            tokio::spawn(async move {
                tokio::time::sleep(lease).await;
                if replica.pause_generation.load(std::sync::atomic::Ordering::Acquire) == generation
                    && replica.rules.lock().paused()
                {
                    tracing::warn!(
                        shard = replica.shard,
                        lease_ms = lease.as_millis() as u64,
                        "a drill's pause was not renewed within its lease: resuming the replica"
                    );
                    if let Err(e) = node.pause(replica.shard, false) {
                        tracing::warn!(shard = replica.shard, error = %e, "resuming a paused replica");
                    }
                }
            });
        }
        if commands.contains(&Command::CatchUp) {
            self.start_catchup(replica);
        }
        Ok(())
    }

    /// Drills: abort like a crash, if allowed.
    pub fn crash(&self, reason: &str) -> Result<(), ReplicaError> {
        if !self.allow_crash_drills {
            return Err(ReplicaError::CrashDrillsDisabled);
        }
        tracing::warn!(reason, "crash drill: aborting");
        tokio::spawn(async {
            // Usually enough for the answer to leave; the drill also takes a
            // dropped connection as the crash it asked for.
            tokio::time::sleep(Duration::from_millis(5)).await;
            std::process::abort();
        });
        Ok(())
    }

    /// Whether `replica` currently follows (for the catch-up loop).
    pub(crate) fn following(replica: &ShardReplica) -> Option<(NodeId, u64)> {
        let rules = replica.rules.lock();
        match rules.view().role {
            Role::Follower { .. } => rules.catch_up_source().map(|(leader, epoch)| (leader, epoch.0)),
            _ => None,
        }
    }
}
