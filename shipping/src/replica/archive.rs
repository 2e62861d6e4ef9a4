//! Archiving: the leader of each shard seals its committed records into
//! segments and uploads them to the object store, in seqno order.
//!
//! * **Who.** The shard's leader (it knows the commit position and is the
//!   one replica guaranteed to hold every committed record). After a
//!   failover the new leader lists the archive and goes on from what it
//!   holds ([`crate::archive::chain`]), so nothing is skipped (a shard
//!   with no committed record is listed only once it has one:
//!   `walship_archive_listings_total`); a segment
//!   the old leader uploaded without the new one seeing it only overlaps
//!   records the new one uploads again, which are the same committed
//!   records, and readers take each seqno once.
//! * **Or a follower.** With `archiver = "follower"` the leader chooses a
//!   caught-up follower (the lowest node id among those it pushes to live;
//!   kept while it stays caught up; the leader itself while none is) and
//!   names it in every shipment; that follower archives from its own WAL
//!   what it holds durably of what is committed, and reports its archived
//!   seqno in its answers, which the leader uses for retention and shows.
//!   A change of archiver lists the archive again, like a failover.
//! * **When.** A segment is sealed once `segment_bytes` of committed records
//!   wait, or the oldest waiting record is `segment_age` old; then it is
//!   read from the WAL (at most `segment_bytes`), encoded and uploaded with
//!   its checksum. Up to `uploads` segments of a shard upload at once and
//!   may end in any order; `archived_seqno` moves only over segments that
//!   are all uploaded, in seqno order, so it never passes a hole.
//! * **Failures.** A failed upload is retried, to the same key, with its
//!   own backoff (200 ms doubling to 10 s; a refusal of our credentials
//!   waits 10 s between tries and is shown as such). The other uploads go
//!   on and new segments are sealed into the free slots meanwhile, so a
//!   store that fails some requests (throttling) slows archiving by those
//!   requests only; a store that fails them all holds at most `uploads`
//!   segments waiting. A failed listing or WAL read waits the same backoff
//!   for the whole shard. Appends never wait for the archive. Archive lag
//!   (records, seconds) is in the replica's status and in metrics.
//! * **Scrubbing.** Every `scrub_interval` the leader reads its shard's
//!   archived segments back, one at a time, and checks each whole
//!   ([`crate::archive::restore::fetch_segment`]). A damaged one (fails its
//!   checksum, does not decode, holds another range than its name says,
//!   listed but gone), or a gap before later segments, is logged at ERROR
//!   and uploaded again from the leader's WAL, to the same key, when the
//!   WAL still holds those records, else fetched from another replica's
//!   WAL (PeerExchange, the same bytes) and uploaded; otherwise it is
//!   reported unrepairable. Counted in `walship_archive_damaged_objects_total`
//!   and shown in the status.
//! * **Cost.** A shard's archive loop (one task, the scrub passes started
//!   from it) runs only while this node leads or archives the shard: a
//!   replica that only follows holds none, so most of the replicas of a
//!   node with thousands of shards cost no task or timer for archiving.
//! * **Retention.** While archiving is on, the leader compacts no record
//!   that is not archived yet (see `retention.rs`): the local disk holds
//!   what the store does not, until the disk-full reserve refuses appends.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use prometheus::{IntCounterVec, IntGaugeVec, Opts, Registry};
use serde::{Deserialize, Serialize};
use walship_objstore::{ObjectKey, ObjectStore, StoreError};
use walship_wal::Segment;

use super::ReplicationNode;
use super::shard::{LeaderState, ShardReplica};
use crate::NodeId;
use crate::archive::{ArchiveLayout, Manifest, SegmentRef, chain};
use crate::config::ArchiverChoice;
use crate::core::leader::ShipMode;

mod scrub;

/// What a node archives to, and how.
pub struct Archive {
    pub store: Arc<dyn ObjectStore>,
    pub layout: ArchiveLayout,
    /// Seal a segment once this many bytes of committed records wait.
    pub segment_bytes: u64,
    /// ... or once the oldest waiting record is this old.
    pub segment_age: Duration,
    /// How often the archiving replica reads the archived segments back.
    pub scrub_interval: Duration,
    /// Segments of one shard uploading at once.
    pub uploads: usize,
    /// Which replica archives each shard.
    pub archiver: ArchiverChoice,
    pub metrics: ArchiveMetrics,
}

/// `walship_archive_*`.
pub struct ArchiveMetrics {
    archived_seqno: IntGaugeVec,
    lag_records: IntGaugeVec,
    lag_seconds: prometheus::GaugeVec,
    uploaded_bytes: IntCounterVec,
    upload_failures: IntCounterVec,
    damaged_objects: IntCounterVec,
}

/// Counts one running archive loop in `walship_archive_loops` while it
/// lives (an aborted or ended loop drops it).
struct LoopRunning(prometheus::IntGauge);

impl LoopRunning {
    fn new(gauge: &prometheus::IntGauge) -> LoopRunning {
        gauge.inc();
        LoopRunning(gauge.clone())
    }
}

impl Drop for LoopRunning {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl ArchiveMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<ArchiveMetrics> {
        let archived_seqno = IntGaugeVec::new(
            Opts::new("walship_archive_seqno", "Newest seqno of the shard in the object store (leader's view)"),
            &["shard"],
        )?;
        let lag_records = IntGaugeVec::new(
            Opts::new("walship_archive_lag_records", "Committed records of the shard not yet in the object store"),
            &["shard"],
        )?;
        let lag_seconds = prometheus::GaugeVec::new(
            Opts::new(
                "walship_archive_lag_seconds",
                "Age of the oldest committed record not yet in the object store (0 when none waits)",
            ),
            &["shard"],
        )?;
        let uploaded_bytes = IntCounterVec::new(
            Opts::new("walship_archive_uploaded_bytes_total", "Bytes of segments uploaded to the object store"),
            &["shard"],
        )?;
        let upload_failures = IntCounterVec::new(
            Opts::new(
                "walship_archive_upload_failures_total",
                "Failed archive uploads and listings, by reason (denied, unavailable, corrupt, invalid_key)",
            ),
            &["reason"],
        )?;
        let damaged_objects = IntCounterVec::new(
            Opts::new(
                "walship_archive_damaged_objects_total",
                "Damaged or missing archived segment objects a scrub found, by outcome (repaired: uploaded again from \
                 the leader's WAL; unrepairable: the WAL no longer holds the records)",
            ),
            &["outcome"],
        )?;
        registry.register(Box::new(archived_seqno.clone()))?;
        registry.register(Box::new(damaged_objects.clone()))?;
        registry.register(Box::new(lag_records.clone()))?;
        registry.register(Box::new(lag_seconds.clone()))?;
        registry.register(Box::new(uploaded_bytes.clone()))?;
        registry.register(Box::new(upload_failures.clone()))?;
        Ok(ArchiveMetrics {
            archived_seqno,
            lag_records,
            lag_seconds,
            uploaded_bytes,
            upload_failures,
            damaged_objects,
        })
    }
}

/// A shard's archive as its replica reports it (leader only).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
pub struct ArchiveStatus {
    /// Newest seqno in the object store (0: none yet, or not listed yet).
    pub archived_seqno: u64,
    /// Committed records not yet archived.
    pub lag_records: u64,
    /// Age of the oldest committed record not yet archived.
    pub lag_seconds: f64,
    pub segments_uploaded: u64,
    pub bytes_uploaded: u64,
    /// The last failure, while failing (cleared by a success).
    pub error: Option<String>,
    /// What the store is (never a secret).
    pub store: String,
    /// Scrub passes this leader completed over the shard's archive, and
    /// when the last one ended (unix ms).
    #[serde(default)]
    pub scrubs: u64,
    #[serde(default)]
    pub last_scrub_unix_ms: Option<u64>,
    /// Damaged or missing segment objects this leader found and uploaded
    /// again from its WAL.
    #[serde(default)]
    pub damaged_repaired: u64,
    /// Damaged or missing segment objects it could not repair (its WAL no
    /// longer holds their records), as of its last scrub: `key: why`.
    #[serde(default)]
    pub damaged_unrepairable: Vec<String>,
    /// The node archiving the shard: this one, or (on a leader with
    /// `archiver = "follower"`) the follower it chose.
    #[serde(default)]
    pub archiver: u32,
    /// Sealed through here (archived, or uploading).
    #[serde(default)]
    pub sealed_seqno: u64,
    /// Segments uploading, or uploaded and waiting for an earlier one.
    #[serde(default)]
    pub uploads_in_flight: u64,
}

/// What a node does for one shard's archive (see [`ReplicationNode::duty`]).
enum Duty {
    /// Nothing: it neither leads the shard nor was chosen to archive it.
    None,
    /// Seal and upload the shard's committed records through `commit`.
    /// `term` (epoch, leading) changes with the role or the epoch; the
    /// archive is listed again then.
    Archive { term: (u64, bool), commit: u64 },
    /// Lead the shard while `follower` archives it: show its progress.
    Watch { follower: NodeId, commit: u64 },
}

/// The follower a leader has archive the shard: the one it chose before
/// while that one is still pushed to live (caught up), else the lowest
/// node id among those that are; 0 (the leader itself) when none is.
fn choose_archiver(leader: &LeaderState) -> NodeId {
    let current = leader.archiver.load(Ordering::Acquire);
    let core = leader.core.lock();
    let live: std::collections::BTreeSet<NodeId> =
        core.followers().filter(|(_, p)| p.mode == ShipMode::Push).map(|(id, _)| id).collect();
    if live.contains(&current) { current } else { live.first().copied().unwrap_or(0) }
}

/// The segments of a shard this node is uploading.
struct Uploads {
    term: (u64, bool),
    /// Archived without a gap through here: the store's listing, then this
    /// node's uploads, in order.
    archived: u64,
    /// Sealed through here: every seqno up to it is archived or queued.
    sealed: u64,
    /// Sealed segments not archived yet, in seqno order (done ones wait for
    /// those before them, without their bytes).
    queue: VecDeque<Upload>,
}

impl Uploads {
    /// Segments uploading or waiting to retry (at most `uploads`).
    fn in_flight(&self) -> usize {
        self.queue.iter().filter(|u| !u.done).count()
    }

    /// Stops every upload under way (leadership moved, or shutdown); what
    /// they would have uploaded is uploaded by whoever archives next.
    fn abort(self) {
        for upload in self.queue {
            if let Some(task) = upload.task {
                task.abort();
            }
        }
    }
}

struct Upload {
    first: u64,
    last: u64,
    key: ObjectKey,
    /// The encoded segment (dropped once uploaded) and its size.
    bytes: Bytes,
    size: u64,
    /// Running, or ended and not looked at yet; none: failed, to retry.
    task: Option<tokio::task::JoinHandle<Result<(), StoreError>>>,
    done: bool,
    /// Failed tries in a row, and when the next may start.
    failures: u32,
    retry_at: Instant,
}

impl Upload {
    fn start(
        &self,
        store: &Arc<dyn ObjectStore>,
        finished: &Arc<tokio::sync::Notify>,
    ) -> tokio::task::JoinHandle<Result<(), StoreError>> {
        let (store, key, bytes, finished) = (store.clone(), self.key.clone(), self.bytes.clone(), finished.clone());
        tokio::spawn(async move {
            let result = async {
                #[cfg(feature = "testing")]
                fail::fail_point!("archive::upload", |_| Err(StoreError::Unavailable(
                    "injected by failpoint archive::upload".into()
                )));
                store.put(&key, bytes).await
            }
            .await;
            finished.notify_one();
            result
        })
    }
}

/// How long to wait before trying again after `failures` failed tries in
/// a row, the last failing with `e`: 200 ms doubling to 10 s; a refusal of
/// our credentials 10 s (retrying sooner cannot help).
fn backoff(failures: u32, e: &StoreError) -> Duration {
    match e {
        StoreError::Denied(_) => MAX_BACKOFF,
        _ => MIN_BACKOFF.saturating_mul(1 << failures.saturating_sub(1).min(16)).min(MAX_BACKOFF),
    }
}

/// How many rounds of `uploads` segments a shard's queue holds at most:
/// uploaded ones wait there for a failed one before them.
const QUEUED_ROUNDS: usize = 4;

const MIN_BACKOFF: Duration = Duration::from_millis(200);
const MAX_BACKOFF: Duration = Duration::from_secs(10);

fn reason(e: &StoreError) -> &'static str {
    match e {
        StoreError::Denied(_) => "denied",
        StoreError::Unavailable(_) => "unavailable",
        StoreError::Corrupt { .. } => "corrupt",
        StoreError::InvalidKey { .. } => "invalid_key",
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// How often an archiving shard with work waiting looks at it.
const ARCHIVE_TICK: Duration = Duration::from_millis(200);

/// How often an idle shard's archive loop looks anyway (it otherwise waits
/// for its commit, role or lease to change).
const ARCHIVE_IDLE_TICK: Duration = Duration::from_secs(10);

impl ReplicationNode {
    /// Starts archiving the shards this node hosts, each while it leads or
    /// archives it.
    pub fn start_archiving(self: &Arc<Self>, archive: Archive) {
        if self.archive.set(Arc::new(archive)).is_err() {
            return;
        }
        // A replica that starts leading from here on starts its own loop.
        for replica in self.replicas() {
            self.ensure_archiving(&replica);
        }
    }

    /// Starts the shard's archive loop unless it runs. Called whenever this
    /// node may have come to archive the shard (it leads, or its leader
    /// named it archiver); the loop ends once it has nothing to do, so a
    /// shard this node only follows costs no task. Idempotent and cheap.
    pub(super) fn ensure_archiving(self: &Arc<Self>, replica: &Arc<ShardReplica>) {
        let Some(archive) = self.archive.get() else { return };
        if !replica.archiving.swap(true, Ordering::AcqRel) {
            tokio::spawn(self.clone().run_archive(replica.clone(), archive.clone()));
        }
    }

    /// The shard's archive status, when this node archives it.
    pub fn archive_status(&self, shard: u32) -> Option<ArchiveStatus> {
        self.archive_status.lock().get(&shard).cloned()
    }

    /// Newest archived seqno of a shard this node leads and archives (what
    /// retention may compact through); `None` when archiving is off.
    pub(super) fn archived_through(&self, shard: u32) -> Option<u64> {
        self.archive.get()?;
        let own = self.archive_status.lock().get(&shard).map_or(0, |s| s.archived_seqno);
        // The store only grows: what an archiving follower reported holds.
        let reported = self
            .replica(shard)
            .and_then(|r| r.leader_state())
            .map_or(0, |l| l.archived_by_follower.load(Ordering::Acquire));
        Some(own.max(reported))
    }

    /// What this node does for `replica`'s archive now. A leader with
    /// `archiver = "follower"` chooses the follower here (sticky while it
    /// stays caught up).
    fn duty(&self, replica: &ShardReplica, archive: &Archive) -> Duty {
        if let Some(leader) = replica.leader_state() {
            let commit = leader.core.lock().commit().0;
            let follower = match archive.archiver {
                ArchiverChoice::Leader => 0,
                ArchiverChoice::Follower => choose_archiver(&leader),
            };
            leader.archiver.store(follower, Ordering::Release);
            return match follower {
                0 => Duty::Archive { term: (leader.epoch, true), commit },
                follower => Duty::Watch { follower, commit },
            };
        }
        if replica.follower.archiver.load(Ordering::Acquire) != self.me {
            return Duty::None;
        }
        // A follower archives what it holds durably of what is committed.
        match self.follower_committed(replica) {
            Some((epoch, commit)) => Duty::Archive { term: (epoch, false), commit },
            None => Duty::None,
        }
    }

    /// A follower's epoch and the newest seqno it holds durably and knows
    /// committed (its durable position capped by its leader's commit);
    /// `None` while it follows no leader or its log is not yet repaired for
    /// the epoch (before that its tail may diverge from the leader's, so a
    /// record below the leader's commit may not be a committed one).
    pub(super) fn follower_committed(&self, replica: &ShardReplica) -> Option<(u64, u64)> {
        let (_, epoch) = Self::following(replica)?;
        if !replica.rules.lock().is_repaired_for(crate::core::Epoch(epoch)) {
            return None;
        }
        let durable = self.wal.positions(replica.shard).map_or(0, |p| p.durable_seqno);
        Some((epoch, durable.min(replica.follower.leader_commit.get())))
    }

    pub(super) async fn run_archive(self: Arc<Self>, replica: Arc<ShardReplica>, archive: Arc<Archive>) {
        let shard = replica.shard;
        let label = shard.to_string();
        let _running = LoopRunning::new(&self.metrics.archive_loops);
        // Nothing waiting (all committed archived, no upload in flight, or
        // nothing to archive here): wait for the commit, the role or the
        // lease to change instead of ticking, so an idle shard costs
        // nothing; a slow tick still catches anything else.
        let mut idle = false;
        let mut readable = replica.readable.subscribe();
        let mut generation = replica.generation.subscribe();
        let mut lease = replica.lease_until.subscribe();
        // An upload ending wakes the loop.
        let finished = Arc::new(tokio::sync::Notify::new());
        // Known while this node archives the shard; listed again whenever
        // its role or the epoch changes.
        let mut state: Option<Uploads> = None;
        // A failed listing or WAL read: tries in a row, and when the shard
        // may try again.
        let mut failures = 0u32;
        let mut retry_at = Instant::now();
        // While this node archives the shard, a scrub pass every
        // `scrub_interval` (the first one interval after it began).
        let mut archives = false;
        let mut scrub_at = Instant::now() + archive.scrub_interval;
        let mut scrubbing: Option<tokio::task::JoinHandle<()>> = None;
        loop {
            let mut period = if idle { ARCHIVE_IDLE_TICK } else { ARCHIVE_TICK };
            if archives {
                period = period.min(scrub_at.saturating_duration_since(Instant::now()));
            }
            tokio::select! {
                _ = tokio::time::sleep(period) => {}
                _ = readable.changed(), if idle => {}
                _ = generation.changed(), if idle => {}
                _ = lease.changed(), if idle => {}
                _ = finished.notified() => {}
                _ = self.shutdown.cancelled() => {
                    if let Some(state) = state.take() {
                        state.abort();
                    }
                    if let Some(pass) = scrubbing.take() {
                        pass.abort();
                    }
                    return;
                }
            }
            let duty = self.duty(&replica, &archive);
            archives = matches!(duty, Duty::Archive { .. });
            if !archives && let Some(pass) = scrubbing.take() {
                pass.abort();
            }
            let (term, commit) = match duty {
                Duty::None => {
                    if let Some(state) = state.take() {
                        state.abort();
                    }
                    self.archive_status.lock().remove(&shard);
                    // Nothing to do here: the loop ends, unless the duty came
                    // back meanwhile (the swap reads what a concurrent
                    // `ensure_archiving` wrote, and whoever sets the flag
                    // again runs the loop).
                    replica.archiving.swap(false, Ordering::AcqRel);
                    if matches!(self.duty(&replica, &archive), Duty::None)
                        || replica.archiving.swap(true, Ordering::AcqRel)
                    {
                        return;
                    }
                    idle = true;
                    continue;
                }
                Duty::Watch { follower, commit } => {
                    if let Some(state) = state.take() {
                        state.abort();
                    }
                    let through = self.archived_through(shard).unwrap_or(0);
                    idle = through >= commit;
                    self.set_archive_lag(&archive, shard, through, commit, through + 1).await;
                    if let Some(status) = self.archive_status.lock().get_mut(&shard) {
                        (status.archiver, status.sealed_seqno, status.uploads_in_flight) = (follower, through, 0);
                        status.error = None;
                    }
                    continue;
                }
                Duty::Archive { term, commit } => (term, commit),
            };
            if Instant::now() >= scrub_at {
                scrub_at = Instant::now() + archive.scrub_interval;
                // A shard with no committed record has nothing of its own
                // in the store to check, nor to repair it from.
                if commit > 0 && scrubbing.as_ref().is_none_or(|pass| pass.is_finished()) {
                    scrubbing = Some(tokio::spawn(self.clone().scrub_pass(replica.clone(), archive.clone())));
                }
            }
            // Whether this tick recorded the lag already (one WAL read of the
            // oldest waiting record per tick, not two).
            let mut lag_shown = false;
            // An upload that failed this tick (it retries on its own), and
            // when it will.
            let mut upload_failed: Option<(StoreError, Duration)> = None;
            // Ok(true): the store answered (a listing, an upload done).
            let outcome: Result<bool, StoreError> = async {
                let mut answered = false;
                if state.as_ref().is_none_or(|s| s.term != term) {
                    if let Some(old) = state.take() {
                        old.abort();
                    }
                    if Instant::now() < retry_at {
                        return Ok(false);
                    }
                    // Nothing committed, nothing to upload: the listing
                    // waits for the first committed record (the commit's
                    // move wakes this loop). A failover of a node leading
                    // thousands of empty shards listed each one: thousands
                    // of LIST requests to an S3 bucket at once.
                    if commit == 0 {
                        return Ok(false);
                    }
                    self.metrics.archive_listings.inc();
                    let prefix = archive.layout.segments_prefix(shard);
                    let listed = self.showing_lag(&archive, shard, commit, archive.store.list(&prefix)).await?;
                    let segments = listed.iter().filter_map(|m| SegmentRef::parse(m.key.as_str(), m.size));
                    let (_, end) = chain(segments.collect());
                    state = Some(Uploads { term, archived: end, sealed: end, queue: VecDeque::new() });
                    answered = true;
                }
                let uploads = state.as_mut().expect("listed above");
                // Uploads that ended: a failed one is retried after its own
                // backoff while the others go on.
                for upload in &mut uploads.queue {
                    if !upload.task.as_ref().is_some_and(|t| t.is_finished()) {
                        continue;
                    }
                    let e = match upload.task.take().expect("finished").await {
                        Ok(Ok(())) => {
                            (upload.done, answered) = (true, true);
                            upload.bytes = Bytes::new();
                            continue;
                        }
                        Ok(Err(e)) => e,
                        Err(e) => StoreError::Unavailable(format!("upload task: {e}")),
                    };
                    archive.metrics.upload_failures.with_label_values(&[reason(&e)]).inc();
                    upload.failures += 1;
                    let wait = backoff(upload.failures, &e);
                    upload.retry_at = Instant::now() + wait;
                    upload_failed = Some((e, wait));
                }
                // The archived seqno moves over the uploaded segments, in order.
                let mut advanced = false;
                while uploads.queue.front().is_some_and(|u| u.done) {
                    let upload = uploads.queue.pop_front().expect("checked");
                    uploads.archived = upload.last;
                    advanced = true;
                    let size = upload.size;
                    let label = if self.metrics.per_shard { label.as_str() } else { "all" };
                    archive.metrics.uploaded_bytes.with_label_values(&[label]).inc_by(size);
                    let mut all = self.archive_status.lock();
                    let status = all.entry(shard).or_default();
                    status.segments_uploaded += 1;
                    status.bytes_uploaded += size;
                    tracing::debug!(
                        shard,
                        first = upload.first,
                        last = upload.last,
                        bytes = size,
                        "archived a segment"
                    );
                }
                if advanced {
                    self.write_manifest(&archive, shard, uploads.archived).await;
                }
                if Instant::now() < retry_at {
                    return Ok(answered);
                }
                // Failed uploads whose backoff passed go again, in order.
                let now = Instant::now();
                for upload in uploads.queue.iter_mut().filter(|u| !u.done && u.task.is_none() && u.retry_at <= now) {
                    upload.task = Some(upload.start(&archive.store, &finished));
                }
                // Seal more while there is room.
                let positions = self.wal.positions(shard).map_err(|e| StoreError::Unavailable(e.to_string()))?;
                let lag_age =
                    self.set_archive_lag(&archive, shard, uploads.archived, commit, uploads.archived + 1).await;
                lag_shown = true;
                // Uploaded segments waiting behind a failed one hold no slot
                // (nor their bytes); the queue stays within a few rounds.
                while uploads.in_flight() < archive.uploads && uploads.queue.len() < QUEUED_ROUNDS * archive.uploads {
                    // An archive behind the local log's start (archiving turned
                    // on late, or a gap) restarts at the local start.
                    let from = (uploads.sealed + 1).max(positions.first_seqno);
                    if commit < from {
                        break;
                    }
                    let age = match from == uploads.archived + 1 {
                        true => lag_age,
                        false => self.waiting_age(shard, from).await,
                    };
                    let counters = self.wal.counters(shard).map_err(|e| StoreError::Unavailable(e.to_string()))?;
                    let average = counters.bytes.checked_div(counters.records).unwrap_or(0).max(1);
                    let waiting_bytes = (commit - from + 1).saturating_mul(average);
                    if waiting_bytes < archive.segment_bytes && age < archive.segment_age.as_secs_f64() {
                        break;
                    }
                    let frames = self
                        .wal
                        .read(shard, from, commit, archive.segment_bytes as usize)
                        .await
                        .map_err(|e| StoreError::Unavailable(format!("reading the WAL: {e}")))?;
                    let Some(last) = frames.last() else { break };
                    let (last, epoch) = (last.seqno(), last.epoch());
                    let segment = Segment::encode(shard, frames).map_err(|e| StoreError::Unavailable(e.to_string()))?;
                    let bytes = segment.encoded().clone();
                    let mut upload = Upload {
                        first: from,
                        last,
                        key: archive.layout.segment_key(shard, from, last, epoch),
                        size: bytes.len() as u64,
                        bytes,
                        task: None,
                        done: false,
                        failures: 0,
                        retry_at: Instant::now(),
                    };
                    upload.task = Some(upload.start(&archive.store, &finished));
                    uploads.queue.push_back(upload);
                    uploads.sealed = last;
                }
                Ok(answered)
            }
            .await;
            let (archived, sealed, in_flight) =
                state.as_ref().map_or((0, 0, 0), |s| (s.archived, s.sealed, s.in_flight() as u64));
            idle = outcome.is_ok() && in_flight == 0 && archived >= commit;
            if !lag_shown {
                self.set_archive_lag(&archive, shard, archived, commit, archived + 1).await;
            }
            // A failure is shown until the store answers again without one.
            let (failure, answered) = match outcome {
                Ok(answered) => {
                    if answered {
                        failures = 0;
                    }
                    (upload_failed, answered)
                }
                Err(e) => {
                    archive.metrics.upload_failures.with_label_values(&[reason(&e)]).inc();
                    failures += 1;
                    let wait = backoff(failures, &e);
                    retry_at = Instant::now() + wait;
                    (Some((e, wait)), false)
                }
            };
            let mut all = self.archive_status.lock();
            let status = all.entry(shard).or_default();
            (status.archiver, status.sealed_seqno, status.uploads_in_flight) = (self.me, sealed, in_flight);
            match failure {
                Some((e, retry_in)) => {
                    let error = e.to_string();
                    if status.error.as_deref() != Some(error.as_str()) {
                        tracing::warn!(shard, error, ?retry_in, "archiving failed; retrying");
                    }
                    status.error = Some(error);
                }
                None if answered => status.error = None,
                None => {}
            }
        }
    }

    /// Rewrites the shard's `manifest.json` (a summary for people and
    /// tools; nothing depends on it, so a failure is only logged).
    async fn write_manifest(&self, archive: &Archive, shard: u32, archived_seqno: u64) {
        let manifest = Manifest {
            shard,
            first_seqno: self.wal.positions(shard).map_or(0, |p| p.first_seqno),
            archived_seqno,
            segments: 0,
            bytes: 0,
            written_by: self.me,
            written_unix_ms: now_ms(),
        };
        let manifest = serde_json::to_vec_pretty(&manifest).expect("plain data");
        if let Err(e) = archive.store.put(&archive.layout.manifest_key(shard), manifest.into()).await {
            tracing::debug!(shard, error = %e, "writing the archive manifest (a summary only)");
        }
    }

    /// Awaits `call` (a slow or hung store: up to its operation timeout),
    /// keeping the shard's archive lag current meanwhile.
    async fn showing_lag<T>(
        &self,
        archive: &Archive,
        shard: u32,
        commit: u64,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        tokio::pin!(call);
        loop {
            tokio::select! {
                done = &mut call => return done,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {
                    let known = self.archive_status.lock().get(&shard).map_or(0, |s| s.archived_seqno);
                    let commit = match self.replica(shard).map(|r| self.duty(&r, archive)) {
                        Some(Duty::Archive { commit, .. }) => commit,
                        _ => commit,
                    };
                    self.set_archive_lag(archive, shard, known, commit, known + 1).await;
                }
            }
        }
    }

    /// The age in seconds of record `seqno` of the shard (0 when it cannot
    /// be read).
    async fn waiting_age(&self, shard: u32, seqno: u64) -> f64 {
        match self.wal.read(shard, seqno, seqno, usize::MAX).await {
            Ok(frames) => {
                frames.first().map_or(0.0, |f| (now_ms() * 1000).saturating_sub(f.timestamp_us()) as f64 / 1e6)
            }
            Err(_) => 0.0,
        }
    }

    /// Records the archive position and lag of a shard: `through` archived,
    /// `commit` committed, the oldest waiting record at `waiting_from`.
    /// Answers the lag in seconds (the oldest waiting record's age).
    async fn set_archive_lag(
        &self,
        archive: &Archive,
        shard: u32,
        through: u64,
        commit: u64,
        waiting_from: u64,
    ) -> f64 {
        let lag_records = commit.saturating_sub(through);
        let lag_seconds =
            if lag_records == 0 || waiting_from > commit { 0.0 } else { self.waiting_age(shard, waiting_from).await };
        if self.metrics.per_shard {
            let label = shard.to_string();
            archive.metrics.archived_seqno.with_label_values(&[&label]).set(through as i64);
            archive.metrics.lag_records.with_label_values(&[&label]).set(lag_records as i64);
            archive.metrics.lag_seconds.with_label_values(&[&label]).set(lag_seconds);
        }
        let moved = {
            let mut all = self.archive_status.lock();
            let fresh = !all.contains_key(&shard);
            let status = all.entry(shard).or_default();
            let moved = fresh || status.archived_seqno != through;
            status.archived_seqno = through;
            status.lag_records = lag_records;
            status.lag_seconds = lag_seconds;
            status.store = archive.store.describe();
            moved
        };
        // The heartbeat says whether the leader archives and how far: a
        // settled replica reports again only when unsettled, and a new
        // leader's first report that it archives should not wait for the
        // next full report (seconds at thousands of shards).
        if moved && let Some(replica) = self.replica(shard) {
            replica.unsettle();
        }
        lag_seconds
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_failure_in_a_row_doubles_the_wait_up_to_ten_seconds() {
        let down = StoreError::Unavailable("503".into());
        let waits: Vec<u64> = (1..=8).map(|n| backoff(n, &down).as_millis() as u64).collect();
        assert_eq!(waits, [200, 400, 800, 1600, 3200, 6400, 10_000, 10_000]);
        assert_eq!(backoff(u32::MAX, &down), MAX_BACKOFF);
        // Retrying refused credentials sooner cannot help.
        assert_eq!(backoff(1, &StoreError::Denied("403".into())), MAX_BACKOFF);
    }
}
