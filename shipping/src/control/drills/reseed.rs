//! The re-seed drill (`POST /v1/drills/reseed`): append a volume into an
//! archiving shard, wait until the object store holds it, then wipe one
//! follower's copy (`Control.Wipe`, honoured only by nodes started with
//! `--allow-crash-drills`: dev and test clusters) and let it rebuild by
//! itself under a live QUORUM load: from the object store first, then by
//! catch-up from the leader for what the archive does not hold yet. The
//! drill reports bytes and MiB/s by source, live throughput during the
//! rebuild against before it, and checks that every replica is
//! byte-identical and that no acknowledged record is lost.
//!
//! It is refused unless the shard's leader archives, and it wipes the
//! follower only once every other replica holds everything committed, so
//! the shard keeps every acknowledged record on a majority throughout.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use walship_proto::log::{FenceResponse, WipeRequest};

use super::*;

/// `POST /v1/drills/reseed`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReseedDrillRequest {
    #[serde(deserialize_with = "crate::control::lenient::int")]
    pub shard: u32,
    /// Follower to wipe; default: the first follower.
    #[serde(default, deserialize_with = "crate::control::lenient::opt_int")]
    pub follower: Option<NodeId>,
    /// Bytes of records appended (and archived) before the wipe (at most 16 GiB).
    #[serde(default = "default_volume", deserialize_with = "crate::control::lenient::int")]
    #[schema(minimum = 1, maximum = 17179869184u64)]
    pub volume_bytes: u64,
    /// Record size (1 B..=1 MiB).
    #[serde(default = "default_record_bytes", deserialize_with = "crate::control::lenient::int")]
    #[schema(minimum = 1, maximum = 1048576)]
    pub record_bytes: usize,
    /// Concurrent appenders of the live load (1..=256); the fill uses four times as many.
    #[serde(default = "default_clients", deserialize_with = "crate::control::lenient::int")]
    #[schema(minimum = 1, maximum = 256)]
    pub clients: usize,
    /// Where the follower takes sealed segments from, to measure one tier:
    /// `all` (peers, then the object store; the default), `peer`, `archive`,
    /// or `stream` (none: the leader streams everything).
    #[serde(default)]
    pub source: ReseedSource,
}

/// Where a re-seeding follower takes sealed segments from.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ReseedSource {
    /// Peers, then the object store (what a real rebuild does).
    #[default]
    All,
    Peer,
    Archive,
    /// None: the leader streams everything.
    Stream,
}

impl ReseedSource {
    pub fn as_str(self) -> &'static str {
        match self {
            ReseedSource::All => "all",
            ReseedSource::Peer => "peer",
            ReseedSource::Archive => "archive",
            ReseedSource::Stream => "stream",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct ReseedDrillResult {
    /// The tiers it was told to take sealed segments from (`all`, `peer`,
    /// `archive`, `stream`).
    #[serde(default)]
    pub source: ReseedSource,
    /// The wiped follower and the leader it rebuilt from.
    pub follower: NodeId,
    pub leader: NodeId,
    /// Records the follower held when wiped.
    pub records_wiped: u64,
    /// Records it had to rebuild: through the leader's durable position at the wipe.
    pub records: u64,
    /// The archive's newest seqno when the follower was wiped.
    pub archived_seqno_at_wipe: u64,
    /// Segment bytes the follower applied during the rebuild, by source.
    pub bytes_archive: u64,
    pub bytes_stream: u64,
    pub bytes_push: u64,
    /// Archived segments fetched from other replicas (PeerExchange).
    #[serde(default)]
    pub bytes_peer: u64,
    /// Wipe -> the follower durable at the leader's durable position at the wipe.
    pub seconds: f64,
    /// Wipe -> its last sealed segment (from a peer or the object store).
    pub archive_seconds: f64,
    /// Sealed-segment bytes (peers and object store) over `archive_seconds`.
    pub archive_mib_per_s: f64,
    /// All bytes applied over `seconds`.
    pub total_mib_per_s: f64,
    /// QUORUM append throughput (records/s) before the drill and during the rebuild.
    pub append_rate_before: f64,
    pub append_rate_during: f64,
    /// Records the drill's loads had acknowledged.
    pub acked: u64,
    /// Acknowledged records missing or different on some replica afterwards.
    pub lost: u64,
    /// Replicas whose records differ from the leader's up to the commit point.
    pub divergent_replicas: u64,
}

/// How long the rebuild may take before the drill gives up on it.
const REBUILD_BOUND: Duration = Duration::from_secs(600);

/// How long a new leader may take to report that it archives before the
/// drill is refused as `not_archiving` (a few heartbeat intervals).
const ARCHIVING_REPORT_BOUND: Duration = Duration::from_secs(3);

/// How long the archive may take to hold the volume before the wipe.
const ARCHIVE_BOUND: Duration = Duration::from_secs(120);

impl Coordinator {
    /// Starts a re-seed drill; returns its id. Refuses (changing nothing) an
    /// unknown shard, a node without a replica or the leader as the one to
    /// wipe, and a shard whose leader does not archive.
    pub async fn start_reseed_drill(self: &Arc<Self>, request: ReseedDrillRequest) -> Result<String, CoordError> {
        if !(1..=256).contains(&request.clients)
            || !(1..=(1 << 20)).contains(&request.record_bytes)
            || !(1..=(16u64 << 30)).contains(&request.volume_bytes)
        {
            return Err(CoordError::BadRequest(
                "clients must be 1..=256, record_bytes 1..=1048576 and volume_bytes 1..=17179869184".into(),
            ));
        }
        let state = self.state().ok_or(CoordError::NotActive)?;
        let record = state.shards.get(&request.shard).ok_or(CoordError::UnknownShard(request.shard))?;
        let leader = record.leader.ok_or(CoordError::Busy(request.shard))?;
        let follower = match request.follower {
            Some(f) if !record.replicas.contains(&f) => {
                return Err(CoordError::NotAReplica { shard: request.shard, node: f });
            }
            Some(f) if f == leader => {
                return Err(CoordError::Conflict {
                    code: "is_leader",
                    message: format!("node {f} leads shard {}: the re-seed drill wipes a follower", request.shard),
                });
            }
            Some(f) => f,
            None => *record
                .replicas
                .iter()
                .find(|&&r| r != leader)
                .ok_or(CoordError::NotAReplica { shard: request.shard, node: leader })?,
        };
        if !self.reports_archiving(leader, request.shard).await {
            return Err(CoordError::Conflict {
                code: "not_archiving",
                message: format!(
                    "shard {}'s leader (node {leader}) does not archive: the re-seed drill rebuilds a follower from \
                     the object store ([archive] in the cluster config)",
                    request.shard
                ),
            });
        }
        let fill = super::framed_bytes(request.volume_bytes, request.record_bytes);
        let needs = fill.saturating_add(MIN_DRILL_HEADROOM);
        let headroom = self.retention_headroom(request.shard, &record.replicas, needs).await?;
        let budget = Budget::new(fill);
        let id = self.drills.create("reseed", request.shard)?;
        let (me, drill, load_budget) = (self.clone(), id.clone(), budget.clone());
        let spare = (headroom - fill) / 2;
        self.run_drill(
            id.clone(),
            headroom,
            budget,
            async move { me.reseed_drill(&drill, &request, leader, follower, &load_budget, spare).await },
            |r, out| r.reseed = Some(out),
        );
        Ok(id)
    }

    /// Whether `leader` says it archives `shard`, waiting up to
    /// [`ARCHIVING_REPORT_BOUND`] for it to say so: a leader elected a moment
    /// ago (a failover drill just ended, say) has not yet sent the heartbeat
    /// that reports its archiver, and refusing it then would be wrong.
    async fn reports_archiving(&self, leader: NodeId, shard: u32) -> bool {
        let deadline = Instant::now() + ARCHIVING_REPORT_BOUND;
        loop {
            if self.archive_position(leader, shard).is_some() {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The archived seqno `leader` last reported for `shard` as its
    /// archiving leader; `None` when it does not archive (or has not said).
    fn archive_position(&self, leader: NodeId, shard: u32) -> Option<u64> {
        self.heartbeat(leader, shard).filter(|h| h.is_leader && h.archiving).map(|h| h.archived_seqno)
    }

    async fn reseed_drill(
        self: &Arc<Self>,
        id: &str,
        request: &ReseedDrillRequest,
        leader: NodeId,
        follower: NodeId,
        fill_budget: &Arc<Budget>,
        spare: u64,
    ) -> Result<ReseedDrillResult, String> {
        let shard = request.shard;
        let clients = request.clients.max(1);
        let mut acks = BTreeMap::new();

        self.drills.progress(id, "measuring append throughput before the drill");
        let before =
            Load::start(self, shard, clients, request.record_bytes, id, &fill_budget.split(spare), Keep::Digests);
        let t = Instant::now();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let rate_before = before.acked_count.load(Ordering::Relaxed) as f64 / t.elapsed().as_secs_f64();
        acks.extend(before.stop().await.lock().await.clone());

        self.drills.progress(id, &format!("appending {} bytes", request.volume_bytes));
        let fill = Load::start(self, shard, clients * 4, request.record_bytes, id, fill_budget, Keep::Digests);
        let records_wanted = request.volume_bytes / request.record_bytes.max(1) as u64;
        while fill.acked_count.load(Ordering::Relaxed) < records_wanted {
            if fill.tasks.iter().all(|t| t.is_finished()) {
                fill.stop().await;
                return Err(format!(
                    "the load wrote its {} bytes without {records_wanted} acknowledgements; nothing was wiped",
                    fill_budget.written()
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        acks.extend(fill.stop().await.lock().await.clone());

        // The archive holds the volume, and every replica but the one to
        // wipe holds everything committed.
        let commit = self.position_of(leader, shard).await.ok_or("leader position")?.commit_seqno;
        self.drills.progress(id, &format!("waiting for the archive to hold seqno {commit}"));
        let waited = Instant::now();
        while self.archive_position(leader, shard).unwrap_or(0) < commit {
            if waited.elapsed() > ARCHIVE_BOUND {
                return Err(format!(
                    "the archive did not reach seqno {commit} within {ARCHIVE_BOUND:?} (it holds through {}); nothing \
                     was wiped",
                    self.archive_position(leader, shard).unwrap_or(0)
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let replicas = self.state().and_then(|s| s.shards.get(&shard).map(|r| r.replicas.clone())).unwrap_or_default();
        for &node in replicas.iter().filter(|&&n| n != follower) {
            let deadline = Instant::now() + Duration::from_secs(20);
            while self.position_of(node, shard).await.is_none_or(|p| p.durable_seqno < commit) {
                if Instant::now() > deadline {
                    return Err(format!("node {node} did not hold seqno {commit} within 20 s; nothing was wiped"));
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let archived_at_wipe = self.archive_position(leader, shard).unwrap_or(0);
        let start = self.position_of(follower, shard).await.ok_or("follower position")?;

        self.drills.progress(id, &format!("wiping follower {follower}'s copy of shard {shard}"));
        let mut control = self.peers.control(follower).ok_or("no follower client")?;
        let wiped = control
            .wipe(WipeRequest { shard_id: shard, source: request.source.as_str().into() })
            .await
            .map_err(|s| format!("wiping node {follower}: {s}"))?
            .into_inner();
        let wiped_at = Instant::now();
        let target = self.position_of(leader, shard).await.ok_or("leader position")?.durable_seqno;
        let during =
            Load::start(self, shard, clients, request.record_bytes, id, &fill_budget.split(spare), Keep::Digests);
        self.drills.progress(id, &format!("follower {follower} rebuilding {target} records"));
        // Sealed segments come from peers, then the object store.
        let sealed = |p: &FenceResponse| p.applied_archive_bytes + p.applied_peer_bytes;
        let mut last_archive = (sealed(&start), Duration::ZERO);
        let end: FenceResponse = loop {
            let p = self.position_of(follower, shard).await;
            if let Some(p) = &p {
                if sealed(p) > last_archive.0 {
                    last_archive = (sealed(p), wiped_at.elapsed());
                }
                if p.durable_seqno >= target {
                    break *p;
                }
            }
            if wiped_at.elapsed() > REBUILD_BOUND {
                during.stop().await;
                return Err(format!("follower {follower} did not rebuild within {REBUILD_BOUND:?}: {p:?}"));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        let seconds = wiped_at.elapsed().as_secs_f64();
        let rate_during = during.acked_count.load(Ordering::Relaxed) as f64 / seconds;
        acks.extend(during.stop().await.lock().await.clone());

        self.drills.progress(id, "verifying every replica against the acknowledged records");
        let (lost, divergent, _) = self.verify(shard, leader, &replicas, &acks).await?;
        let mib = |bytes: u64, s: f64| if s > 0.0 { bytes as f64 / (1 << 20) as f64 / s } else { 0.0 };
        let bytes_archive = end.applied_archive_bytes.saturating_sub(start.applied_archive_bytes);
        let bytes_stream = end.applied_stream_bytes.saturating_sub(start.applied_stream_bytes);
        let bytes_push = end.applied_push_bytes.saturating_sub(start.applied_push_bytes);
        let bytes_peer = end.applied_peer_bytes.saturating_sub(start.applied_peer_bytes);
        let archive_seconds = last_archive.1.as_secs_f64();
        Ok(ReseedDrillResult {
            source: request.source,
            follower,
            leader,
            records_wiped: (wiped.last_seqno + 1).saturating_sub(wiped.first_seqno),
            records: (target + 1).saturating_sub(wiped.restart_seqno),
            archived_seqno_at_wipe: archived_at_wipe,
            bytes_archive,
            bytes_stream,
            bytes_push,
            bytes_peer,
            seconds,
            archive_seconds,
            archive_mib_per_s: mib(bytes_archive + bytes_peer, archive_seconds),
            total_mib_per_s: mib(bytes_archive + bytes_stream + bytes_push + bytes_peer, seconds),
            append_rate_before: rate_before,
            append_rate_during: rate_during,
            acked: acks.len() as u64,
            lost,
            divergent_replicas: divergent,
        })
    }
}
