//! The async shell around the replication core: one [`ReplicationNode`] per
//! process, one [`ShardReplica`] per shard it hosts. Every decision about a
//! replica's role and epoch is taken by its [`ReplicaCore`] (`core/replica.rs`)
//! and every decision about shipping, commit and lag by its leader's
//! [`crate::core::leader::LeaderCore`]; this shell performs them: IO,
//! tasks, watches. Split by direction and lifecycle:
//!
//! * [`shard`]: one replica's rules, watches and leadership state;
//! * `leadership`: fence, assign, position, stepping down, drills: the
//!   role changes the rules decide, performed under the per-shard
//!   transition lock;
//! * `send`: the leader side: a driver folds the WAL's durable (and, under
//!   a coordinator, flushing) watch into the leader core, one shipper per
//!   follower keeps up to `ship_window` `ShipSegment`s in flight over one
//!   `ShipBatches` stream per follower node (many pushes to a message);
//! * `receive`: the follower side: inbound segments (pushed or streamed)
//!   pass the envelope check, the role gate and [`classify`](crate::core::follower::classify),
//!   then are queued to the WAL in order under a per-shard lock held only
//!   until they are queued, so many small ships share one group commit;
//! * `catchup`: serving `StreamSegments` (leader), and pulling with it
//!   after reconciling a divergent tail with `EpochEnd` (follower); also
//!   truncating and refetching a corrupt tail;
//! * `retention`: compaction of what nobody needs;
//! * `damage`: the corruption drill's hook, damaging one stored record;
//! * [`drill_partition`]: the partition drill's hook, cutting replication
//!   traffic with some peers for a while (simulated at this layer);
//! * [`quiet`]: quiet shards: an idle shard's per-shard keepalives stop
//!   and one node-level keepalive per peer node stands in for them;
//! * `status`: status pages, heartbeats, per-follower gauges;
//! * [`error`]: the one error type and its gRPC mapping.
//!
//! Only durable records are ever served, and a follower's `applied_seqno`
//! is its durable frontier; reads on any replica stop at the commit position
//! it knows. Under a coordinator the leader ships each batch as soon as its
//! WAL has *written* it, while its own fsync runs ("early shipping",
//! `shipping/EARLY-SHIPPING.md`); the commit still waits for the leader's
//! own durable copy, and a replica never leads in the epoch it restarted in
//! (the rules refuse it and heartbeats report `needs_new_epoch`).
//!
//! Every replica records its *log epoch* durably: the newest epoch whose
//! leader's log its own log is a prefix of (set when it starts leading, and
//! by a follower once reconciled, before it answers anything of that
//! epoch). Failover ranks replicas by it, which lets a new leader commit
//! earlier epochs' records by counting (`core/leader.rs`).

pub mod archive;
mod catchup;
mod contact;
mod damage;
pub mod drill_partition;
pub mod error;
mod heartbeats;
mod leadership;
pub mod peer_tier;
mod probe;
mod pushes;
pub mod quiet;
mod receive;
mod retention;
mod send;
pub mod shard;
mod ship_stream;
mod silence;
mod status;
pub(crate) use heartbeats::same_report;
mod wipe;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;
use walship_wal::{ShardId, Wal};

pub use self::error::{APPLIED_METADATA_KEY, EPOCH_METADATA_KEY, ReplicaError};

/// Pushes one `ShipBatches` message carries, at most (the contract's
/// limit: a follower refuses a larger batch whole, and a leader's ship
/// stream never sends one).
pub const SHIP_BATCH_MAX_PUSHES: usize = 256;
pub(crate) use self::error::{inline_refusals, refusal_answer};
pub use self::shard::{Members, ShardReplica};
pub use self::status::{
    CorruptRangeStatus, FollowerStatus, ProducersStatus, ReceivedHeartbeat, ReplicaStatus, reporting_node_refusal,
};
use crate::NodeId;
use crate::config::ClusterConfig;
use crate::core::leader::LeaderSettings;
pub use crate::core::replica::{ReplicaCore, Role, View};
use crate::metrics::ReplicationMetrics;
use crate::peers::{PeerTransport, Peers};
use walship_wal::limiter::RateLimiter;

/// Microseconds on a clock that never steps: the wall clock read once, the
/// first time any caller asks, plus the monotonic time since. A leader's
/// lease, its followers' contact and silence times, keepalives and lag are
/// intervals on this clock, so a step of the wall clock (an NTP correction,
/// an operator's `date -s`) neither stretches a lease past the replication
/// timeout nor fakes a silence. The values still read as Unix time where a
/// report shows them: they drift from the wall clock only by the
/// adjustments made since the process started.
pub fn now_us() -> u64 {
    static ANCHOR: std::sync::OnceLock<(u64, Instant)> = std::sync::OnceLock::new();
    let (wall_us, at) = ANCHOR.get_or_init(|| {
        let wall = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64);
        (wall, Instant::now())
    });
    wall_us + at.elapsed().as_micros() as u64
}

#[cfg(test)]
mod clock_tests {
    use super::now_us;
    use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

    #[test]
    fn now_us_moves_with_the_monotonic_clock_and_reads_as_unix_time() {
        let (first, started) = (now_us(), Instant::now());
        let wall = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_micros() as u64;
        assert!(first.abs_diff(wall) < 60_000_000, "now_us {first} is not near the wall clock {wall}");
        let mut last = first;
        for _ in 0..1000 {
            let now = now_us();
            assert!(now >= last, "now_us went back from {last} to {now}");
            last = now;
        }
        std::thread::sleep(Duration::from_millis(20));
        let moved = now_us() - first;
        let elapsed = started.elapsed().as_micros() as u64;
        assert!(moved >= 20_000 && moved <= elapsed + 1_000, "moved {moved} µs in {elapsed} µs");
    }
}

/// Where an inbound segment came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Push,
    Stream,
    /// Segments read from the object store (a re-seed).
    Archive,
    /// Archived segments fetched from a peer's WAL (PeerExchange).
    Peer,
}

impl Source {
    /// Its slot in [`shard::FollowerState::applied_bytes`].
    pub(crate) fn index(self) -> usize {
        self as usize
    }

    fn as_str(self) -> &'static str {
        match self {
            Source::Push => "push",
            Source::Stream => "stream",
            Source::Archive => "archive",
            Source::Peer => "peer",
        }
    }
}

/// Replication runtime of one node.
pub struct ReplicationNode {
    pub me: NodeId,
    pub region: u32,
    pub config: Arc<ClusterConfig>,
    pub wal: Wal,
    pub peers: Peers,
    pub metrics: ReplicationMetrics,
    /// The shards this node hosts: those the cluster config gives it, and
    /// those a coordinator assigned it since (replicas added at run time).
    replicas: parking_lot::RwLock<BTreeMap<ShardId, Arc<ShardReplica>>>,
    /// Shards whose replicas changed, for the loops that skip settled ones.
    touched: Arc<shard::Touched>,
    catchup_budget: RateLimiter,
    settings: LeaderSettings,
    allow_crash_drills: bool,
    heartbeats: Mutex<BTreeMap<(NodeId, u32), (ReceivedHeartbeat, Instant)>>,
    /// Every shard of the cluster config: the heartbeats kept are of these
    /// and the hosted ones ([`ReplicationNode::check_heartbeat`]).
    configured_shards: std::collections::HashSet<ShardId>,
    disk_bytes: Box<dyn Fn() -> u64 + Send + Sync>,
    pub shutdown: CancellationToken,
    /// One ship stream per follower node, opened by the first push (see
    /// `ship_stream::run_ship_stream`).
    ship_streams: Mutex<BTreeMap<NodeId, tokio::sync::mpsc::Sender<pushes::ShipCall>>>,
    /// Peers a partition drill cuts replication traffic with, for a while.
    drill_partition: Arc<drill_partition::DrillPartition>,
    /// When this node started (its heartbeats report the uptime).
    started: Instant,
    /// Where sealed segments go, once [`ReplicationNode::start_archiving`] ran.
    archive: std::sync::OnceLock<Arc<archive::Archive>>,
    /// Fetching archived segments from peers (PeerExchange), tried before
    /// the object store when this follower re-seeds.
    peer_tier: std::sync::OnceLock<Arc<dyn peer_tier::PeerTier>>,
    /// Each archived shard's position and lag (shards this node leads).
    archive_status: Mutex<BTreeMap<ShardId, archive::ArchiveStatus>>,
    /// Unrepairable archive objects already counted in
    /// `walship_archive_damaged_objects_total` (each once per process).
    scrub_counted: Mutex<std::collections::BTreeSet<(ShardId, String)>>,
    /// PeerExchange fetch tokens a coordinator minted for this node's
    /// tasks, by shard (see [`peer_tier::PeerTier::fetch`]).
    fetch_tokens: Mutex<BTreeMap<ShardId, String>>,
    /// Leader side of quiet shards: one link per follower node.
    quiet_links: quiet::QuietLinks,
    /// Follower side of quiet shards: what each leader node said is quiet.
    quiet_from: quiet::QuietFrom,
    /// Per follower node: whether it is down as far as this node's
    /// shippers know, and who may probe it next (see `probe::PeerProbe`).
    peer_probes: Mutex<BTreeMap<NodeId, Arc<probe::PeerProbe>>>,
    /// When each peer node last answered this node, and last reached it.
    contact: Arc<contact::NodeContact>,
}

impl ReplicationNode {
    /// Builds the replicas this node hosts (creating their WAL shards) and
    /// starts every background task. `disk_bytes` reports the WAL's size.
    /// In a static cluster each replica takes its role from the config; under
    /// a coordinator it waits, unassigned, for the coordinator's word.
    pub async fn start(
        me: NodeId,
        config: Arc<ClusterConfig>,
        wal: Wal,
        metrics: ReplicationMetrics,
        disk_bytes: Box<dyn Fn() -> u64 + Send + Sync>,
        allow_crash_drills: bool,
        transport: PeerTransport,
    ) -> Result<Arc<ReplicationNode>, ReplicaError> {
        let node_spec = config
            .node(me)
            .ok_or_else(|| ReplicaError::BadRequest(format!("node {me} is not in the cluster config")))?;
        let r = &config.replication;
        let settings = LeaderSettings {
            window: r.ship_window,
            catchup_threshold_bytes: r.catchup_threshold_bytes,
            keepalive_us: r.keepalive_ms * 1_000,
            probe_us: (r.keepalive_ms * 1_000).min(25_000),
            lease_us: config.coordinated().then_some(r.replication_timeout().as_micros() as u64),
        };
        let mut replicas = BTreeMap::new();
        let touched = Arc::new(shard::Touched::default());
        if wal.recovery_cut() && config.coordinated() {
            tracing::error!(
                "the WAL's recovery cut damaged records away: every shard here waits for the coordinator to assign \
                 it before it takes anything from a leader (an epoch it promised may have been cut with them)"
            );
        }
        // Registered together: one fsync, not one per shard.
        wal.create_shards(&config.shards_of(me).iter().map(|s| s.id).collect::<Vec<_>>())?;
        for spec in config.shards_of(me) {
            let last = wal.positions(spec.id)?.last_seqno;
            let promised = wal.epoch(spec.id)?;
            let replica =
                ShardReplica::new(spec.id, &spec.replicas, me, config.coordinated(), promised, last, touched.clone());
            // A replica that never promised an epoch here has a new data
            // dir, or one wiped or replaced since it promised: under a
            // coordinator it takes nothing from a leader (a deposed one
            // might still ship at an old epoch) until the coordinator fences
            // or assigns it, which it does for every replica it hears
            // unassigned.
            if wal.recovery_cut() || promised == 0 {
                replica.rules.lock().promise_lost();
            }
            replicas.insert(spec.id, Arc::new(replica));
        }
        let mut metrics = metrics;
        metrics.per_shard = r.per_shard_metrics;
        let configured_shards = config.shards.iter().map(|s| s.id).collect();
        let node = Arc::new(ReplicationNode {
            me,
            region: node_spec.region,
            peers: Peers::new(&config, &transport),
            catchup_budget: RateLimiter::new(r.catchup_rate_bytes_per_s),
            settings,
            allow_crash_drills,
            config,
            wal,
            metrics,
            replicas: parking_lot::RwLock::new(replicas),
            touched,
            heartbeats: Mutex::new(BTreeMap::new()),
            configured_shards,
            disk_bytes,
            shutdown: CancellationToken::new(),
            ship_streams: Mutex::new(BTreeMap::new()),
            drill_partition: Default::default(),
            started: Instant::now(),
            archive: Default::default(),
            peer_tier: Default::default(),
            archive_status: Default::default(),
            scrub_counted: Default::default(),
            fetch_tokens: Default::default(),
            quiet_links: Default::default(),
            quiet_from: Default::default(),
            peer_probes: Default::default(),
            contact: Default::default(),
        });
        if !node.config.coordinated() {
            for spec in node.config.shards_of(me) {
                node.assign(spec.id, spec.epoch, spec.leader, 0, None, None).await?;
            }
        }
        tokio::spawn(node.clone().run_retention());
        tokio::spawn(node.clone().run_heartbeats());
        tokio::spawn(node.clone().run_metrics());
        tokio::spawn(node.clone().run_corruption_watch());
        Ok(node)
    }

    pub fn replica(&self, shard: ShardId) -> Option<Arc<ShardReplica>> {
        self.replicas.read().get(&shard).cloned()
    }

    fn replica_or_not_found(&self, shard: ShardId) -> Result<Arc<ShardReplica>, ReplicaError> {
        self.replica(shard).ok_or(ReplicaError::UnknownShard { shard, node: self.me })
    }

    /// Every replica this node hosts, in shard order (a snapshot).
    pub fn replicas(&self) -> Vec<Arc<ShardReplica>> {
        self.replicas.read().values().cloned().collect()
    }

    /// The replica of `shard`, created when a coordinator assigns this
    /// node a shard it does not host yet (a replica being added, or one
    /// added before this node restarted): its WAL shard is created (or
    /// reopened, keeping what it holds and the epoch it promised). Only
    /// under a coordinator, and only for a node the assignment names.
    fn replica_or_create(
        self: &Arc<Self>,
        shard: ShardId,
        members: &[NodeId],
    ) -> Result<Arc<ShardReplica>, ReplicaError> {
        if let Some(replica) = self.replica(shard) {
            return Ok(replica);
        }
        if !self.config.coordinated() || !members.contains(&self.me) {
            return Err(ReplicaError::UnknownShard { shard, node: self.me });
        }
        let mut replicas = self.replicas.write();
        if let Some(replica) = replicas.get(&shard) {
            return Ok(replica.clone());
        }
        self.wal.create_shard(shard)?;
        let last = self.wal.positions(shard)?.last_seqno;
        let promised = self.wal.epoch(shard)?;
        let replica = Arc::new(ShardReplica::new(shard, &[], self.me, true, promised, last, self.touched.clone()));
        if promised == 0 {
            // As at start (`ReplicationNode::new`): nothing from a leader
            // before the coordinator's fence or assignment.
            replica.rules.lock().promise_lost();
        }
        replicas.insert(shard, replica.clone());
        drop(replicas);
        tracing::info!(shard, promised, last, "hosting a shard the coordinator assigned this node");
        // Retention's pass looks at it from now on; its archive loop starts
        // when it leads or archives (`ensure_archiving`).
        Ok(replica)
    }

    /// `<node id>@<grpc address>` of a node, for not-leader hints.
    pub fn describe(&self, node: NodeId) -> String {
        match self.config.node(node) {
            Some(spec) => format!("{node}@{}", spec.grpc_addr),
            None => node.to_string(),
        }
    }

    /// A `ShipBatches` message with no push or more than
    /// [`SHIP_BATCH_MAX_PUSHES`]: refused whole (`INVALID_ARGUMENT`,
    /// counted as `bad_request`), none of it applied.
    pub fn refuse_batch(&self, pushes: usize) -> tonic::Status {
        let detail = format!("a ShipBatch carries 1 to {SHIP_BATCH_MAX_PUSHES} pushes, this one {pushes}");
        self.counted(ReplicaError::BadRequest(detail)).into()
    }

    /// Counts a refusal under its reason (`walship_ship_refused_total`) and
    /// passes it on: every entry point's errors go through here once.
    fn counted(&self, error: ReplicaError) -> ReplicaError {
        if let Some(reason) = error.reason() {
            self.metrics.ship_refused.with_label_values(&[reason]).inc();
        }
        error
    }

    /// The node's WAL disk is below its free-space reserve: appends and
    /// replicated segments are refused, and it does not take leadership.
    pub fn disk_full(&self) -> bool {
        self.wal.disk_space().is_some_and(|d| d.is_full())
    }

    /// The first seqno of `shard`'s log here known to be corrupt (the WAL's
    /// registry: reads, scrubs and the start-up check feed it).
    pub fn corrupt_from(&self, shard: ShardId) -> Option<u64> {
        self.wal.shard_corruption(shard).iter().map(|r| r.first_bad_seqno).min()
    }

    /// Feeds the node's disk state into `replica`'s rules before they
    /// decide; returns what they say to do about a change.
    fn sync_disk(&self, replica: &ShardReplica) -> Vec<crate::core::replica::Command> {
        replica.rules.lock().disk(self.disk_full())
    }

    /// Whether leaders ship records before their own fsync. Only under a
    /// coordinator, which never lets a restarted leader lead again in the
    /// same epoch (see `core/replica.rs`); a static cluster's leader leads
    /// epoch 1 forever, so it ships durable records only.
    fn early_shipping(&self) -> bool {
        self.config.coordinated()
    }
}
