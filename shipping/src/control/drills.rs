//! Drills the coordinator runs against the live cluster.
//!
//! * Failover drill: a load generator appends at `QUORUM` through the
//!   shard's leader; the leader is made to fail (a crash, as `kill -9`, on
//!   nodes started with `--allow-crash-drills`; otherwise it is fenced by an
//!   immediate failover); the drill measures the time from the loss to the
//!   first append acknowledged by the new leader, then checks that every
//!   acknowledged record is present and identical on every live replica.
//! * Catch-up drill: pause a follower, append a volume, resume it, and
//!   measure how fast it catches up and what live appends achieve meanwhile.
//! * Corruption drill ([`corruption`]): under a light QUORUM load, a
//!   replica (a follower unless asked otherwise) damages its own stored
//!   copy of one committed record (`Control.DamageRecord`, honoured only by nodes started with
//!   `--allow-crash-drills`: dev and test clusters); the drill measures how
//!   fast the node reports it and repairs it from an intact replica, how
//!   many bytes it refetched, and checks that every acknowledged record
//!   reads back identical from the damaged node and the leader.
//! * Partition drill ([`partition`]): under QUORUM load, the leader is cut
//!   from its followers (or one follower from the leader) at the
//!   replication layer (`Control.Partition`, dev and test clusters only),
//!   while everyone still reaches the coordinator; per trial it measures
//!   the time to a new leader's first QUORUM acknowledgement, counts
//!   failovers and the old leader's `LOCAL` acknowledgements after it lost
//!   its majority, heals, and verifies every acknowledged record.
//!
//! Every drill appends records into the live shard it drills (that is what
//! it measures), and they stay in its log like any other. They never cost
//! the operator's own records through retention: before a drill starts, the
//! coordinator asks the shard's replicas how many bytes each retains and
//! takes the headroom below `replication.retain_bytes` (the fullest
//! replica's); a drill that needs more than that is refused
//! ([`CoordError::DrillWouldEvict`], 409) before it writes anything, and
//! the drill's load generators stop appending once they have written the
//! headroom ([`Budget`]), so retention has nothing to compact on the
//! drill's account. The report says how many bytes the drill wrote
//! (`bytes_written`) and what headroom it had. Retention weighs a shard's
//! log by its average record size, so the check is as exact as retention
//! itself.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::FutureExt;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::Mutex as AsyncMutex;
use walship_proto::log::{AppendRecord, AppendRequest, CrashRequest, Durability, PositionRequest, ReadRequest, Record};

use crate::NodeId;
use crate::control::coordinator::{CoordError, Coordinator, FailoverRequest, now_ms};

mod catchup;
mod corruption;
mod partition;
mod reseed;
pub use catchup::{CatchupDrillRequest, CatchupDrillResult};
pub use corruption::{CorruptionDrillRequest, CorruptionDrillResult};
pub use partition::{PartitionDrillRequest, PartitionDrillResult, PartitionTrial, TimeSummary};
pub use reseed::{ReseedDrillRequest, ReseedDrillResult, ReseedSource};

/// `POST /v1/drills/failover`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FailoverDrillRequest {
    #[serde(deserialize_with = "crate::control::lenient::int")]
    pub shard: u32,
    /// Concurrent appenders of the load generator (1..=256).
    #[serde(default = "default_clients", deserialize_with = "crate::control::lenient::int")]
    #[schema(minimum = 1, maximum = 256)]
    pub clients: usize,
    /// Load before the leader is failed, and after the new one answers (at most 60 s).
    #[serde(default = "default_phase_ms", deserialize_with = "crate::control::lenient::int")]
    #[schema(maximum = 60000)]
    pub phase_ms: u64,
}

fn default_light_clients() -> usize {
    2
}
fn default_clients() -> usize {
    8
}
fn default_phase_ms() -> u64 {
    500
}
fn default_volume() -> u64 {
    64 << 20
}
fn default_record_bytes() -> usize {
    4096
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct FailoverDrillResult {
    pub old_leader: NodeId,
    pub new_leader: NodeId,
    pub old_epoch: u64,
    pub new_epoch: u64,
    /// `crash` (the leader process aborted) or `fence` (failed over in place).
    pub method: String,
    pub time_to_new_leader_ms: u64,
    /// Records acknowledged during the drill.
    pub acked: u64,
    /// Acknowledged records missing or different on some live replica.
    pub lost: u64,
    /// Live replicas whose records differ from the leader's up to the commit point.
    pub divergent_replicas: u64,
    pub checked_replicas: Vec<NodeId>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct DrillReport {
    pub id: String,
    /// `failover`, `catchup`, `corruption`, `partition` or `reseed`.
    pub kind: String,
    pub shard: u32,
    /// `running`, `done` or `failed`.
    pub state: String,
    pub progress: String,
    pub started_unix_ms: u64,
    pub finished_unix_ms: Option<u64>,
    pub failover: Option<FailoverDrillResult>,
    pub catchup: Option<CatchupDrillResult>,
    pub corruption: Option<CorruptionDrillResult>,
    pub partition: Option<PartitionDrillResult>,
    #[serde(default)]
    pub reseed: Option<ReseedDrillResult>,
    pub error: Option<String>,
    /// Bytes of records (frames) the drill appended to the shard, so far.
    #[serde(default)]
    pub bytes_written: u64,
    /// What the drill could write before retention would compact records
    /// written before it (`retain_bytes` less what the shard retained).
    #[serde(default)]
    pub retention_headroom_bytes: u64,
}

/// Drill reports, newest last.
#[derive(Default)]
pub struct Drills {
    reports: Mutex<BTreeMap<String, DrillReport>>,
    next: AtomicU64,
}

impl Drills {
    pub fn get(&self, id: &str) -> Option<DrillReport> {
        self.reports.lock().get(id).cloned()
    }

    pub fn list(&self) -> Vec<DrillReport> {
        let mut all: Vec<_> = self.reports.lock().values().cloned().collect();
        all.sort_by_key(|r| r.started_unix_ms);
        all
    }

    /// Registers a drill of `kind` on `shard`; refused while another drill
    /// runs on the shard. Two drills at once could each find the other's
    /// follower healthy before either acts: two re-seeds would wipe both
    /// followers, two catch-ups pause both, leaving acknowledged records on
    /// the leader alone or the shard without a quorum.
    fn create(&self, kind: &str, shard: u32) -> Result<String, CoordError> {
        let mut reports = self.reports.lock();
        if let Some(running) = reports.values().find(|r| r.shard == shard && r.state == "running") {
            return Err(CoordError::Conflict {
                code: "drill_in_progress",
                message: format!(
                    "drill {} ({}) is running on shard {shard}; one drill runs on a shard at a time",
                    running.id, running.kind
                ),
            });
        }
        let id = format!("{kind}-{}", self.next.fetch_add(1, Ordering::Relaxed) + 1);
        reports.insert(
            id.clone(),
            DrillReport {
                id: id.clone(),
                kind: kind.into(),
                shard,
                state: "running".into(),
                progress: "starting".into(),
                started_unix_ms: now_ms(),
                finished_unix_ms: None,
                failover: None,
                catchup: None,
                corruption: None,
                partition: None,
                reseed: None,
                error: None,
                bytes_written: 0,
                retention_headroom_bytes: 0,
            },
        );
        Ok(id)
    }

    fn update(&self, id: &str, f: impl FnOnce(&mut DrillReport)) {
        if let Some(r) = self.reports.lock().get_mut(id) {
            f(r);
        }
    }

    fn progress(&self, id: &str, text: &str) {
        self.update(id, |r| r.progress = text.into());
    }
}

/// Bytes a frame takes in the log beyond its payload, as drills count it
/// (the frame header with crc, seqno, epoch, timestamp, and some slack).
pub(crate) const FRAME_OVERHEAD: u64 = 64;

/// The least headroom below `retain_bytes` a drill with a light load
/// (failover, corruption, partition) starts with.
pub const MIN_DRILL_HEADROOM: u64 = 4 << 20;

/// The most a failover, corruption or partition drill's load writes.
pub(crate) const MAX_LOAD_BYTES: u64 = 256 << 20;

/// The bytes a drill's load generators may still append. Every appender
/// takes a record's bytes before sending it and stops when none are left.
pub(crate) struct Budget {
    remaining: AtomicI64,
    /// Bytes taken by this budget and every one split from it.
    written: Arc<AtomicU64>,
}

impl Budget {
    pub(crate) fn new(bytes: u64) -> Arc<Budget> {
        Arc::new(Budget { remaining: AtomicI64::new(bytes.min(i64::MAX as u64) as i64), written: Arc::default() })
    }

    /// A budget of its own, counted in this one's `written`.
    pub(crate) fn split(&self, bytes: u64) -> Arc<Budget> {
        Arc::new(Budget { remaining: AtomicI64::new(bytes.min(i64::MAX as u64) as i64), written: self.written.clone() })
    }

    /// Takes `bytes` if that many are left.
    pub(crate) fn take(&self, bytes: u64) -> bool {
        let bytes = bytes as i64;
        if self.remaining.fetch_sub(bytes, Ordering::AcqRel) >= bytes {
            self.written.fetch_add(bytes as u64, Ordering::Relaxed);
            true
        } else {
            self.remaining.fetch_add(bytes, Ordering::AcqRel);
            false
        }
    }

    pub(crate) fn written(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }
}

/// What appending `volume_bytes` in records of `record_bytes` takes in the
/// log (records as the drills count them, framed), with an eighth more for
/// appends that time out unacknowledged.
fn framed_bytes(volume_bytes: u64, record_bytes: usize) -> u64 {
    let records = volume_bytes / record_bytes.max(1) as u64;
    // A payload is at least its tag (~30 bytes).
    let framed = records.max(1) * (record_bytes.max(64) as u64 + FRAME_OVERHEAD);
    framed + framed / 8
}

/// Acknowledged appends: seqno -> (the payload's digest, epoch).
type Acks = Arc<AsyncMutex<BTreeMap<u64, (Digest, u64)>>>;

/// What a drill keeps of an acknowledged payload to check the replicas
/// against: its length and crc32, not its bytes, so a drill's volume (up
/// to 16 GiB) does not sit in the coordinator's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Digest {
    len: usize,
    crc: u32,
}

impl Digest {
    fn of(payload: &[u8]) -> Digest {
        Digest { len: payload.len(), crc: crc32fast::hash(payload) }
    }

    fn matches(&self, payload: &[u8]) -> bool {
        payload.len() == self.len && crc32fast::hash(payload) == self.crc
    }
}

/// What a [`Load`] keeps of each acknowledgement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Keep {
    /// Its seqno, payload digest and epoch, for the drill to verify the
    /// replicas against.
    Digests,
    /// Only the count: for a drill that verifies nothing, whose volume (up
    /// to 16 GiB of small records) would otherwise fill the map.
    Count,
}

struct Load {
    stop: Arc<AtomicBool>,
    acked_count: Arc<AtomicU64>,
    acks: Acks,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    /// `clients` appenders on `shard` at QUORUM through the leader the
    /// coordinator records, following it through failovers, until stopped
    /// or `budget` is spent, keeping what `keep` says of each
    /// acknowledgement.
    fn start(
        coordinator: &Arc<Coordinator>,
        shard: u32,
        clients: usize,
        record_bytes: usize,
        tag: &str,
        budget: &Arc<Budget>,
        keep: Keep,
    ) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let acked_count = Arc::new(AtomicU64::new(0));
        let acks: Acks = Arc::default();
        let tasks = (0..clients)
            .map(|c| {
                let (coordinator, stop, count, acks, tag, budget) = (
                    coordinator.clone(),
                    stop.clone(),
                    acked_count.clone(),
                    acks.clone(),
                    tag.to_string(),
                    budget.clone(),
                );
                tokio::spawn(async move {
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let leader = coordinator.state().and_then(|s| s.shards.get(&shard).and_then(|r| r.leader));
                        let Some(mut log) = leader.and_then(|l| coordinator.peers.log(l)) else {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                            continue;
                        };
                        let mut payload = format!("{tag}-c{c}-n{n}-").into_bytes();
                        payload.resize(record_bytes.max(payload.len()), b'.');
                        if !budget.take(payload.len() as u64 + FRAME_OVERHEAD) {
                            break;
                        }
                        n += 1;
                        let payload = Bytes::from(payload);
                        let mut request = tonic::Request::new(AppendRequest {
                            shard_id: shard,
                            records: vec![AppendRecord { key: Bytes::new(), payload: payload.clone() }],
                            durability: Durability::Quorum as i32,
                            ..Default::default()
                        });
                        request.set_timeout(Duration::from_secs(2));
                        match log.append(request).await {
                            Ok(r) => {
                                let r = r.into_inner();
                                if keep == Keep::Digests {
                                    acks.lock().await.insert(r.first_seqno, (Digest::of(&payload), r.epoch));
                                }
                                count.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(_) => tokio::time::sleep(Duration::from_millis(2)).await,
                        }
                    }
                })
            })
            .collect();
        Load { stop, acked_count, acks, tasks }
    }

    async fn stop(mut self) -> Acks {
        self.stop.store(true, Ordering::Relaxed);
        for t in std::mem::take(&mut self.tasks) {
            let _ = t.await;
        }
        self.acks.clone()
    }
}

/// A load dropped unstopped (a drill that failed or returned early) stops
/// its appenders at their next append: they never outlive the drill.
impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl Coordinator {
    /// Starts a failover drill; returns its id. Progress and the report are
    /// under [`Coordinator::drills`].
    pub async fn start_failover_drill(self: &Arc<Self>, request: FailoverDrillRequest) -> Result<String, CoordError> {
        if !(1..=256).contains(&request.clients) || request.phase_ms > 60_000 {
            return Err(CoordError::BadRequest("clients must be 1..=256 and phase_ms at most 60000".into()));
        }
        let state = self.state().ok_or(CoordError::NotActive)?;
        let record = state.shards.get(&request.shard).ok_or(CoordError::UnknownShard(request.shard))?;
        if record.leader.is_none() {
            return Err(CoordError::Busy(request.shard));
        }
        let headroom = self.retention_headroom(request.shard, &record.replicas, MIN_DRILL_HEADROOM).await?;
        let budget = Budget::new(headroom.min(MAX_LOAD_BYTES));
        let id = self.drills.create("failover", request.shard)?;
        let (me, drill, load_budget) = (self.clone(), id.clone(), budget.clone());
        self.run_drill(
            id.clone(),
            headroom,
            budget,
            async move { me.failover_drill(&drill, &request, &load_budget).await },
            |r, out| r.failover = Some(out),
        );
        Ok(id)
    }

    /// The bytes `shard` can take before retention compacts any record
    /// already in it: `retain_bytes` less what its fullest answering replica
    /// retains. Refuses with [`CoordError::DrillWouldEvict`] below `needs`,
    /// and with [`CoordError::NoMajority`] when no majority answers.
    pub(crate) async fn retention_headroom(
        &self,
        shard: u32,
        replicas: &[NodeId],
        needs: u64,
    ) -> Result<u64, CoordError> {
        let retain_bytes = self.config.replication.retain_bytes;
        let mut answered = 0;
        let mut retained = 0;
        let mut silent = Vec::new();
        for &node in replicas {
            let position = tokio::time::timeout(Duration::from_secs(2), self.position_of(node, shard)).await;
            if let Ok(Some(p)) = position {
                answered += 1;
                retained = retained.max(p.retained_bytes);
            } else {
                silent.push(format!("node {node}: no position within 2 s"));
            }
        }
        if !crate::control::failover::is_majority(answered, replicas.len()) {
            return Err(CoordError::NoMajority {
                shard,
                answered,
                replicas: replicas.len(),
                silent: silent.join("; "),
            });
        }
        let headroom = retain_bytes.saturating_sub(retained);
        if headroom < needs {
            return Err(CoordError::DrillWouldEvict { shard, needs, retained, retain_bytes });
        }
        Ok(headroom)
    }

    /// Runs a drill in the background and records how it ended and what it
    /// wrote.
    fn run_drill<T: Send + 'static>(
        self: &Arc<Self>,
        id: String,
        headroom: u64,
        budget: Arc<Budget>,
        drill: impl std::future::Future<Output = Result<T, String>> + Send + 'static,
        record: impl FnOnce(&mut DrillReport, T) + Send + 'static,
    ) {
        let me = self.clone();
        self.drills.update(&id, |r| r.retention_headroom_bytes = headroom);
        let watched = budget.clone();
        let (watcher_me, watcher_id) = (self.clone(), id.clone());
        let watcher = tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                watcher_me.drills.update(&watcher_id, |r| r.bytes_written = watched.written());
            }
        });
        tokio::spawn(async move {
            // A drill that panics ends as failed, not "running" for ever
            // (which would also bar every later drill on its shard).
            let result = std::panic::AssertUnwindSafe(drill).catch_unwind().await.unwrap_or_else(|panic| {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "no message".into());
                tracing::error!(drill = %id, panic = %what, "drill panicked");
                Err(format!("the drill stopped on an internal error: {what}"))
            });
            watcher.abort();
            me.drills.update(&id, |r| {
                r.bytes_written = budget.written();
                r.finished_unix_ms = Some(now_ms());
                match result {
                    Ok(out) => {
                        r.state = "done".into();
                        r.progress = "done".into();
                        record(r, out);
                    }
                    Err(e) => {
                        r.state = "failed".into();
                        r.error = Some(e);
                    }
                }
            });
        });
    }

    async fn failover_drill(
        self: &Arc<Self>,
        id: &str,
        request: &FailoverDrillRequest,
        budget: &Arc<Budget>,
    ) -> Result<FailoverDrillResult, String> {
        let shard = request.shard;
        let record = self.shard_record(shard).map_err(|_| "not active")?;
        let (old_leader, old_epoch) = (record.leader.ok_or("no leader")?, record.epoch);
        self.drills.progress(id, "load running");
        let load = Load::start(self, shard, request.clients.max(1), 64, id, budget, Keep::Digests);
        tokio::time::sleep(Duration::from_millis(request.phase_ms)).await;
        if load.acked_count.load(Ordering::Relaxed) == 0 {
            load.stop().await;
            return Err("the load generator got no acknowledgement before the drill".into());
        }
        self.drills.progress(id, &format!("failing leader {old_leader}"));
        let lost_at = Instant::now();
        let crashed = match self.peers.control(old_leader) {
            // A refusal means crash drills are off on that node; any other
            // failure is the connection dying with the process.
            Some(mut c) => match c.crash(CrashRequest { reason: format!("drill {id}") }).await {
                Ok(_) => true,
                Err(status) => status.code() != tonic::Code::PermissionDenied,
            },
            None => false,
        };
        let method = if crashed {
            "crash"
        } else {
            // Not allowed to crash it: fence it by failing over in place.
            self.failover(shard, FailoverRequest::default(), "drill").await.map_err(|e| e.to_string())?;
            "fence"
        };
        self.drills.progress(id, "waiting for the first acknowledgement from a new leader");
        let acks = load.acks.clone();
        let first_new = loop {
            if lost_at.elapsed() > Duration::from_secs(30) {
                load.stop().await;
                return Err(format!(
                    "no new leader acknowledged an append within 30 s (the drill wrote {} bytes; its load stops at the shard's retention headroom)",
                    budget.written()
                ));
            }
            let newest = acks.lock().await.values().map(|(_, e)| *e).max().unwrap_or(0);
            if newest > old_epoch {
                break lost_at.elapsed();
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        tokio::time::sleep(Duration::from_millis(request.phase_ms)).await;
        let acks = load.stop().await;
        let acks = acks.lock().await.clone();
        let record = self.shard_record(shard).map_err(|_| "not active")?;
        let new_leader = record.leader.ok_or("no leader after the drill")?;
        self.drills.progress(id, "verifying acknowledged records on every live replica");
        let (lost, divergent, checked) = self.verify(shard, new_leader, &record.replicas, &acks).await?;
        Ok(FailoverDrillResult {
            old_leader,
            new_leader,
            old_epoch,
            new_epoch: record.epoch,
            method: method.into(),
            time_to_new_leader_ms: first_new.as_millis() as u64,
            acked: acks.len() as u64,
            lost,
            divergent_replicas: divergent,
            checked_replicas: checked,
        })
    }

    /// Reads every live replica up to the leader's commit point once they
    /// have all caught up, and compares them with the acknowledged records
    /// and with the leader. Returns (lost, divergent replicas, replicas checked).
    async fn verify(
        &self,
        shard: u32,
        leader: NodeId,
        replicas: &[NodeId],
        acks: &BTreeMap<u64, (Digest, u64)>,
    ) -> Result<(u64, u64, Vec<NodeId>), String> {
        let max_acked = acks.keys().next_back().copied().unwrap_or(0);
        // Live replicas: those answering a position query.
        let deadline = Instant::now() + Duration::from_secs(20);
        let (target, live) = loop {
            let mut positions = BTreeMap::new();
            for &node in replicas {
                if let Some(mut c) = self.peers.control(node) {
                    let mut r = tonic::Request::new(PositionRequest { shard_id: shard });
                    r.set_timeout(Duration::from_millis(300));
                    if let Ok(p) = c.position(r).await {
                        positions.insert(node, p.into_inner());
                    }
                }
            }
            let target = positions.get(&leader).map_or(0, |p| p.commit_seqno).max(max_acked);
            let caught_up = positions.values().all(|p| p.durable_seqno >= target && p.commit_seqno >= target);
            if caught_up && positions.contains_key(&leader) {
                break (target, positions.keys().copied().collect::<Vec<_>>());
            }
            if Instant::now() > deadline {
                return Err(format!("replicas did not catch up to {target} within 20 s: {positions:?}"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        // The drill's own range only (its first acknowledged record on), a
        // window at a time: the shard's older records are not the drill's
        // to check (and may be compacted), and the coordinator never holds
        // more than one window of each replica.
        let Some(&from) = acks.keys().next() else { return Ok((0, 0, live)) };
        let mut clients = BTreeMap::new();
        for &node in &live {
            clients.insert(node, self.peers.log(node).ok_or("no client")?);
        }
        // Seqnos of acknowledged records some live replica lacks.
        let mut lost = std::collections::BTreeSet::new();
        let mut divergent = std::collections::BTreeSet::new();
        let mut next = from;
        while next <= target {
            let reference =
                read_range(clients.get_mut(&leader).expect("live"), leader, shard, next, target, true).await?;
            let Some(end) = reference.last().map(|r| r.seqno) else {
                return Err(format!("node {leader} returned no records of {next}..={target}"));
            };
            for (&node, client) in clients.iter_mut().filter(|(n, _)| **n != leader) {
                if read_range(client, node, shard, next, end, false).await? != reference {
                    divergent.insert(node);
                }
            }
            mark_missing(&reference, next, end, acks, &mut lost);
            next = end + 1;
        }
        // A replica that diverges may lack acknowledged records the leader
        // holds: looked for in each such replica too, window by window.
        for &node in &divergent {
            let client = clients.get_mut(&node).expect("live");
            let mut next = from;
            while next <= target {
                let window = read_range(client, node, shard, next, target, true).await?;
                let Some(end) = window.last().map(|r| r.seqno) else {
                    return Err(format!("node {node} returned no records of {next}..={target}"));
                };
                mark_missing(&window, next, end, acks, &mut lost);
                next = end + 1;
            }
        }
        Ok((lost.len() as u64, divergent.len() as u64, live))
    }

    pub(crate) async fn position_of(&self, node: NodeId, shard: u32) -> Option<walship_proto::log::FenceResponse> {
        let mut c = self.peers.control(node)?;
        c.position(PositionRequest { shard_id: shard }).await.ok().map(|r| r.into_inner())
    }
}

/// Adds to `lost` the acknowledged records of `next..=end` that `window`
/// (a replica's records from `next` on) does not hold as acknowledged.
fn mark_missing(
    window: &[Record],
    next: u64,
    end: u64,
    acks: &BTreeMap<u64, (Digest, u64)>,
    lost: &mut std::collections::BTreeSet<u64>,
) {
    for (&seqno, (digest, _)) in acks.range(next..=end) {
        let held = window.get((seqno - next) as usize).is_some_and(|r| r.seqno == seqno && digest.matches(&r.payload));
        if !held {
            lost.insert(seqno);
        }
    }
}

/// The records `[from, to]` of `node`'s copy of `shard`: one read's worth
/// when `one_window` (from `from` on, however many the node's read size
/// gives), else all of them.
async fn read_range(
    client: &mut walship_proto::log::log_client::LogClient<crate::peers::PeerChannel>,
    node: NodeId,
    shard: u32,
    from: u64,
    to: u64,
    one_window: bool,
) -> Result<Vec<Record>, String> {
    let mut records = Vec::new();
    let mut next = from;
    while next <= to {
        let r = client
            .read(ReadRequest { shard_id: shard, from_seqno: next, to_seqno: to, max_bytes: 0, ..Default::default() })
            .await
            .map_err(|s| format!("reading node {node}: {s}"))?
            .into_inner();
        if r.records.is_empty() {
            break;
        }
        next = r.next_seqno;
        records.extend(r.records);
        if one_window {
            break;
        }
    }
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_digest_matches_its_payload_only() {
        let d = Digest::of(b"drill-c0-n1-....");
        assert!(d.matches(b"drill-c0-n1-...."));
        assert!(!d.matches(b"drill-c0-n1-...,"), "one byte changed");
        assert!(!d.matches(b"drill-c0-n1-..."), "one byte shorter");
        assert!(!d.matches(b""));
    }

    #[test]
    fn mark_missing_finds_records_absent_or_different_in_a_window() {
        let record = |seqno: u64, payload: &str| Record {
            seqno,
            payload: Bytes::from(payload.to_string()),
            ..Default::default()
        };
        let acks: BTreeMap<u64, (Digest, u64)> =
            [(10, "a"), (11, "b"), (13, "d")].iter().map(|&(s, p)| (s, (Digest::of(p.as_bytes()), 1))).collect();
        // Seqnos 10..=12 held, 11 with other bytes; 13 past the window.
        let window = [record(10, "a"), record(11, "B"), record(12, "c")];
        let mut lost = std::collections::BTreeSet::new();
        mark_missing(&window, 10, 12, &acks, &mut lost);
        assert_eq!(lost.into_iter().collect::<Vec<_>>(), [11]);
        // A window shorter than its range: the records it lacks are missing.
        let mut lost = std::collections::BTreeSet::new();
        mark_missing(&window[..1], 10, 13, &acks, &mut lost);
        assert_eq!(lost.into_iter().collect::<Vec<_>>(), [11, 13]);
    }

    #[test]
    fn a_budget_gives_out_exactly_its_bytes_and_counts_what_its_splits_take() {
        let budget = Budget::new(1_000);
        assert!(budget.take(600));
        assert!(!budget.take(401), "past what is left: refused, and nothing taken");
        assert!(budget.take(400));
        assert!(!budget.take(1));
        assert_eq!(budget.written(), 1_000);
        let split = budget.split(50);
        assert!(split.take(50) && !split.take(1));
        assert_eq!(budget.written(), 1_050, "a split's bytes count in its parent's written");
        assert_eq!(split.written(), 1_050);
    }

    #[test]
    fn concurrent_takers_never_overspend_a_budget() {
        let budget = Budget::new(10_000);
        let taken: u64 = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| {
                        let mut mine = 0;
                        while budget.take(7) {
                            mine += 7;
                        }
                        mine
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert!(taken <= 10_000 && taken > 10_000 - 7 * 8, "taken {taken}");
        assert_eq!(budget.written(), taken);
    }
}
