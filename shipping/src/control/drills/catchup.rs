//! The catch-up drill (`POST /v1/drills/catchup`): measure the append
//! rate, pause one follower (`Control.Pause`, a lease the drill renews),
//! append a volume while it is paused, resume it and time its catch-up
//! under a light live load, with the bytes it applied by source.
//!
//! It is refused where pausing the follower would leave the other replicas
//! no majority, gives up when its fill goes [`CATCHUP_FILL_STALL`] without
//! an acknowledgement, and resumes the follower however the paused phase
//! ends. It verifies nothing, so its loads only count their
//! acknowledgements.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use walship_proto::log::{FenceResponse, PauseRequest};

use super::*;

/// `POST /v1/drills/catchup`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CatchupDrillRequest {
    #[serde(deserialize_with = "crate::control::lenient::int")]
    pub shard: u32,
    /// Follower to pause; default: the first follower.
    #[serde(default, deserialize_with = "crate::control::lenient::opt_int")]
    pub follower: Option<NodeId>,
    /// Bytes of records appended while it is paused (at most 16 GiB).
    #[serde(default = "default_volume", deserialize_with = "crate::control::lenient::int")]
    #[schema(minimum = 1, maximum = 17179869184u64)]
    pub volume_bytes: u64,
    /// Record size (1 B..=1 MiB).
    #[serde(default = "default_record_bytes", deserialize_with = "crate::control::lenient::int")]
    #[schema(minimum = 1, maximum = 1048576)]
    pub record_bytes: usize,
    /// Concurrent appenders (1..=256).
    #[serde(default = "default_clients", deserialize_with = "crate::control::lenient::int")]
    #[schema(minimum = 1, maximum = 256)]
    pub clients: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct CatchupDrillResult {
    pub follower: NodeId,
    pub records_behind: u64,
    pub bytes_behind: u64,
    pub catchup_seconds: f64,
    pub catchup_mib_per_s: f64,
    /// Append throughput (records/s) before the pause and during catch-up.
    pub append_rate_before: f64,
    pub append_rate_during_catchup: f64,
    /// Segment bytes the follower applied while catching up, by source:
    /// live pushes, the leader's catch-up stream, the object store, peers.
    #[serde(default)]
    pub bytes_push: u64,
    #[serde(default)]
    pub bytes_stream: u64,
    #[serde(default)]
    pub bytes_archive: u64,
    #[serde(default)]
    pub bytes_peer: u64,
}

/// What a catch-up drill appends while the follower is paused: its records
/// (volume over record size, as the drill counts them) as framed.
fn catchup_fill_bytes(request: &CatchupDrillRequest) -> u64 {
    framed_bytes(request.volume_bytes, request.record_bytes)
}

impl Coordinator {
    /// Starts a catch-up drill; returns its id.
    pub async fn start_catchup_drill(self: &Arc<Self>, request: CatchupDrillRequest) -> Result<String, CoordError> {
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
            Some(f) if f == leader || !record.replicas.contains(&f) => {
                return Err(CoordError::NotAReplica { shard: request.shard, node: f });
            }
            Some(f) => f,
            None => *record
                .replicas
                .iter()
                .find(|&&r| r != leader)
                .ok_or(CoordError::NotAReplica { shard: request.shard, node: leader })?,
        };
        // Paused, the follower refuses shipments: the others must still make
        // a majority, or no QUORUM append (the drill's, or anyone's) could
        // be acknowledged until it is resumed.
        let others = record.replicas.iter().filter(|&&r| r != follower).count();
        if !crate::control::failover::is_majority(others, record.replicas.len()) {
            return Err(CoordError::Conflict {
                code: "no_quorum_without_follower",
                message: format!(
                    "shard {} has {} replicas: with node {follower} paused the other {others} are no majority, so no \
                     QUORUM append could be acknowledged until it is resumed",
                    request.shard,
                    record.replicas.len()
                ),
            });
        }
        // The volume while the follower is paused, plus light loads before
        // and during its catch-up.
        let fill = catchup_fill_bytes(&request);
        let needs = fill.saturating_add(MIN_DRILL_HEADROOM);
        let headroom = self.retention_headroom(request.shard, &record.replicas, needs).await?;
        let budget = Budget::new(fill);
        let id = self.drills.create("catchup", request.shard)?;
        let (me, drill, load_budget) = (self.clone(), id.clone(), budget.clone());
        let spare = (headroom - fill) / 2;
        self.run_drill(
            id.clone(),
            headroom,
            budget,
            async move { me.catchup_drill(&drill, &request, leader, follower, &load_budget, spare).await },
            |r, out| r.catchup = Some(out),
        );
        Ok(id)
    }

    async fn catchup_drill(
        self: &Arc<Self>,
        id: &str,
        request: &CatchupDrillRequest,
        leader: NodeId,
        follower: NodeId,
        fill_budget: &Arc<Budget>,
        spare: u64,
    ) -> Result<CatchupDrillResult, String> {
        let shard = request.shard;
        let mut control = self.peers.control(follower).ok_or("no follower client")?;
        self.drills.progress(id, "measuring append throughput before the pause");
        let before = Load::start(
            self,
            shard,
            request.clients.max(1),
            request.record_bytes,
            id,
            &fill_budget.split(spare),
            Keep::Count,
        );
        let t = Instant::now();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let rate_before = before.acked_count.load(Ordering::Relaxed) as f64 / t.elapsed().as_secs_f64();
        before.stop().await;
        control
            .pause(PauseRequest { shard_id: shard, paused: true })
            .await
            .map_err(|s| format!("pausing node {follower}: {s}"))?;
        // From here the follower is resumed however the paused phase ends.
        let paused = self.catchup_paused(id, request, leader, follower, fill_budget, spare).await;
        let resumed = Instant::now();
        let resumed_ok = control.pause(PauseRequest { shard_id: shard, paused: false }).await;
        let (leader_pos, records_behind, during, applied_before) = match (paused, resumed_ok) {
            (Ok(phase), Ok(_)) => phase,
            (Ok(_), Err(s)) => return Err(format!("resuming node {follower}: {s}")),
            (Err(e), Ok(_)) => return Err(format!("{e}; the follower was resumed")),
            (Err(e), Err(s)) => return Err(format!("{e}; resuming node {follower} failed too: {s}")),
        };
        let bytes_behind = records_behind * (request.record_bytes as u64 + 36);
        let caught_up = loop {
            let p = self.position_of(follower, shard).await;
            if let Some(p) = p.filter(|p| p.durable_seqno >= leader_pos.durable_seqno) {
                break p;
            }
            if resumed.elapsed() > Duration::from_secs(120) {
                during.stop().await;
                return Err("the follower did not catch up within 120 s".into());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        let seconds = resumed.elapsed().as_secs_f64();
        let by = |f: fn(&FenceResponse) -> u64| f(&caught_up).saturating_sub(f(&applied_before));
        let rate_during = during.acked_count.load(Ordering::Relaxed) as f64 / seconds;
        during.stop().await;
        Ok(CatchupDrillResult {
            follower,
            records_behind,
            bytes_behind,
            catchup_seconds: seconds,
            catchup_mib_per_s: bytes_behind as f64 / (1 << 20) as f64 / seconds,
            append_rate_before: rate_before,
            append_rate_during_catchup: rate_during,
            bytes_push: by(|p| p.applied_push_bytes),
            bytes_stream: by(|p| p.applied_stream_bytes),
            bytes_archive: by(|p| p.applied_archive_bytes),
            bytes_peer: by(|p| p.applied_peer_bytes),
        })
    }

    /// The catch-up drill while its follower is paused: fills the shard
    /// with the drill's volume, then starts the light load that runs during
    /// the catch-up and takes the follower's position for the bytes by
    /// source. Fails when no append is acknowledged for
    /// [`CATCHUP_FILL_STALL`] (the shard lost its quorum meanwhile): the
    /// caller resumes the follower either way.
    async fn catchup_paused(
        self: &Arc<Self>,
        id: &str,
        request: &CatchupDrillRequest,
        leader: NodeId,
        follower: NodeId,
        fill_budget: &Arc<Budget>,
        spare: u64,
    ) -> Result<(FenceResponse, u64, Load, FenceResponse), String> {
        let shard = request.shard;
        let start_pos = self.position_of(follower, shard).await.ok_or("follower position")?;
        self.drills.progress(id, &format!("follower {follower} paused; appending {} bytes", request.volume_bytes));
        let fill =
            Load::start(self, shard, request.clients.max(1) * 4, request.record_bytes, id, fill_budget, Keep::Count);
        let records_wanted = request.volume_bytes / request.record_bytes.max(1) as u64;
        let (mut acked, mut progressed) = (0, Instant::now());
        // The node resumes a pause nobody renews (its lease): renewed while
        // the fill runs, however long a large volume takes.
        let mut control = self.peers.control(follower).ok_or("no follower client")?;
        let renew_every = Duration::from_millis(self.config.replication.pause_lease_ms / 6);
        let mut renewed = Instant::now();
        loop {
            let now = fill.acked_count.load(Ordering::Relaxed);
            if now >= records_wanted {
                break;
            }
            if renewed.elapsed() > renew_every {
                control
                    .pause(PauseRequest { shard_id: shard, paused: true })
                    .await
                    .map_err(|s| format!("renewing node {follower}'s pause: {s}"))?;
                renewed = Instant::now();
            }
            if now > acked {
                (acked, progressed) = (now, Instant::now());
            } else if progressed.elapsed() > CATCHUP_FILL_STALL {
                return Err(format!(
                    "no append was acknowledged for {} s with node {follower} paused ({now} of {records_wanted} \
                     records): the shard has no quorum without it",
                    CATCHUP_FILL_STALL.as_secs()
                ));
            }
            if fill.tasks.iter().all(|t| t.is_finished()) {
                // Its budget spent on appends that were not acknowledged.
                return Err(format!(
                    "the load wrote its {} bytes without {records_wanted} acknowledgements",
                    fill_budget.written()
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        fill.stop().await;
        let leader_pos = self.position_of(leader, shard).await.ok_or("leader position")?;
        let records_behind = leader_pos.durable_seqno.saturating_sub(start_pos.durable_seqno);
        self.drills.progress(id, &format!("resuming follower {follower}: {records_behind} records behind"));
        let during = Load::start(
            self,
            shard,
            request.clients.max(1),
            request.record_bytes,
            id,
            &fill_budget.split(spare),
            Keep::Count,
        );
        // Bytes by source count from here (the follower applied nothing while paused).
        let applied_before = self.position_of(follower, shard).await.ok_or("follower position")?;
        Ok((leader_pos, records_behind, during, applied_before))
    }
}

/// How long the catch-up drill's fill may go without an acknowledgement
/// before the drill gives up and resumes its follower.
const CATCHUP_FILL_STALL: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_catch_up_drill_accounts_for_its_records_as_stored() {
        let request =
            CatchupDrillRequest { shard: 1, follower: None, volume_bytes: 4096 * 100, record_bytes: 4096, clients: 8 };
        let framed = 100 * (4096 + FRAME_OVERHEAD);
        assert_eq!(catchup_fill_bytes(&request), framed + framed / 8);
        // Tiny records still count at least their tag's size.
        let tiny = CatchupDrillRequest { volume_bytes: 10, record_bytes: 1, ..request };
        assert_eq!(catchup_fill_bytes(&tiny), 10 * (64 + FRAME_OVERHEAD) + 10 * (64 + FRAME_OVERHEAD) / 8);
    }
}
