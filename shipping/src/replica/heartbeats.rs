//! A node's heartbeats to its coordinators: every `heartbeat_ms` one batch
//! carrying the reports of the replicas whose report changed (all of them
//! in a periodic full report), built by [`ReplicationNode::run_heartbeats`]
//! and sent by [`HeartbeatTarget`]; what makes a report change
//! ([`same_report`], [`comparable`]). `status.rs` holds what a node shows
//! of its replicas and the heartbeats it receives; `silence.rs` when a
//! replica's report would say something new.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use walship_proto::replication::HeartbeatRequest;
use walship_wal::ShardId;

use super::shard::ShardReplica;
use super::silence::{LastBuild, Standing, follower_silence_class, silence_class};
use super::{ReplicationNode, now_us};
use crate::NodeId;
use crate::core::replica::Role;

/// An unsettled replica the heartbeat loop looks at every tick, and what
/// its last report said (see [`LastBuild`]; none: report it in full).
struct Watched {
    replica: Arc<ShardReplica>,
    build: Option<LastBuild>,
}

impl ReplicationNode {
    pub(super) async fn run_heartbeats(self: Arc<Self>) {
        let interval = Duration::from_millis(self.config.replication.heartbeat_ms);
        let mut targets: Vec<HeartbeatTarget> = self
            .config
            .coordinators
            .iter()
            .map(|c| c.grpc_addr.clone())
            .chain(self.config.replication.heartbeat_to.map(crate::config::Address::from))
            .map(|a| HeartbeatTarget::new(self.peers.transport().channel(&a)))
            .collect();
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_records: BTreeMap<ShardId, (u64, Instant)> = BTreeMap::new();
        // Replicas not settled when last looked at: looked at again every
        // tick, with those touched since (see `shard::Touched`). Each is
        // kept with its last build between ticks (a replica, once hosted,
        // stays in the node's map): looked up again every tick, the 6,700
        // unsettled replicas of a survivor taking over a lost node's shards
        // cost it a map lookup, a copy and a drop each, every 50 ms.
        let mut unsettled: BTreeMap<ShardId, Watched> = BTreeMap::new();
        // Unsettled replicas whose last report rests (a peer silent past
        // twice the replication timeout: a node down): their silences are
        // looked at only every quarter second, so they are, with the rest,
        // on those ticks only, or at once when touched. Looked at every
        // tick to learn nothing, the 5,000 leaders of a survivor whose
        // follower's node was down took it a fifth of a core.
        let mut resting: BTreeMap<ShardId, Watched> = BTreeMap::new();
        // Resting replicas found dormant (see `ReplicationNode::dormancy`:
        // every peer they find silent is a node not heard from at all):
        // looked at every quarter second too, but in place, at two loads
        // each (`LastBuild::wakes`), and never rebuilt while they
        // stay so. Rebuilt every second as resting replicas are, the 5,000
        // leaders of a survivor whose followers' node was down took it a
        // tenth of a core at 10,000 shards, to say the same.
        let mut dormant: BTreeMap<ShardId, Watched> = BTreeMap::new();
        // The replication timeout, which the coordinator compares silences
        // with (see `comparable`), and twice it.
        let silence_ms = self.config.replication.replication_timeout().as_millis() as u64;
        let long_silence_ms = 2 * silence_ms;
        // Resting replicas' silences are looked at every quarter second.
        let resting_look_every = (250 / self.config.replication.heartbeat_ms.max(1)).max(1);
        let mut ticks = 0u64;
        let least_full_every = Duration::from_millis(self.config.replication.full_report_ms);
        let mut full_every = least_full_every;
        loop {
            let due = tokio::select! {
                due = tick.tick() => due,
                _ = self.shutdown.cancelled() => return,
            };
            // How late the round starts: a runtime too busy to run this
            // task on time delays every report as much.
            let late = tokio::time::Instant::now().saturating_duration_since(due);
            self.metrics.heartbeat_round_seconds.with_label_values(&["late"]).observe(late.as_secs_f64());
            let disk = (self.disk_bytes)();
            self.metrics.disk_bytes.set(disk as i64);
            let mut node_rate = 0.0;
            let mut requests = Vec::new();
            // Between full reports only shards that are not settled (quiet
            // and unchanged since their last report) are looked at: an idle
            // shard costs a tick nothing.
            let full = targets.iter().any(|t| t.wants_full(full_every));
            let building = Instant::now();
            ticks = ticks.wrapping_add(1);
            let resting_look = ticks.is_multiple_of(resting_look_every);
            self.unsettle_silent_leaders();
            let watch = |unsettled: &mut BTreeMap<ShardId, Watched>, replica: Arc<ShardReplica>| {
                unsettled.entry(replica.shard).or_insert(Watched { replica, build: None });
            };
            let touched = self.touched.take_heartbeats();
            if full || resting_look {
                unsettled.append(&mut resting);
            }
            if full {
                self.wake(&mut dormant, &mut unsettled, |_| Some("full_report"));
            } else if resting_look && !dormant.is_empty() {
                let contact = self.node_contact(long_silence_ms);
                self.wake(&mut dormant, &mut unsettled, |w| {
                    w.build.as_ref()?.wakes(w.replica.activity(), w.replica.readable(), contact)
                });
            }
            match full {
                true => self.replicas().into_iter().for_each(|r| watch(&mut unsettled, r)),
                false => {
                    for shard in touched {
                        if let Some(watched) = resting.remove(&shard) {
                            unsettled.insert(shard, watched);
                        } else if let Some(mut watched) = dormant.remove(&shard) {
                            self.metrics.dormant_wakes.with_label_values(&["activity"]).inc();
                            watched.build.as_mut().map(LastBuild::wake);
                            unsettled.insert(shard, watched);
                        } else if !unsettled.contains_key(&shard)
                            && let Some(replica) = self.replica(shard)
                        {
                            watch(&mut unsettled, replica);
                        }
                    }
                }
            }
            let looked_at = unsettled.len();
            for watched in unsettled.values_mut() {
                let replica = &watched.replica;
                if !full && replica.settled() {
                    continue;
                }
                let activity = replica.activity();
                let progress = replica.readable();
                // The peers' silences, looked at once per replica, and only
                // when a check below or the report needs them.
                let silences = std::sync::OnceLock::new();
                let silences_now = || silences.get_or_init(|| self.silences(replica, now_us()));
                let last_build = if full { None } else { watched.build.as_ref() };
                if last_build
                    .is_some_and(|b| b.says_the_same(activity, progress, resting_look, long_silence_ms, silences_now))
                {
                    continue;
                }
                let quiet = self.is_quiet(replica);
                let view = replica.view();
                let corrupt_from = self.corrupt_from(replica.shard);
                let disk_full = self.disk_full();
                let standing = Standing {
                    role: view.role,
                    epoch: view.epoch.0,
                    needs_new_epoch: replica.needs_new_epoch(),
                    disk_full,
                    corrupt_from,
                    quiet,
                };
                // Appends moved it and nothing else: its positions wait for
                // the next report (it stays unsettled, so it is looked at
                // again next tick).
                if last_build.is_some_and(|b| b.only_progress_since(standing, long_silence_ms, silences_now)) {
                    continue;
                }
                let silences = silences.into_inner().unwrap_or_else(|| self.silences(replica, now_us()));
                let (Ok(p), Ok(c)) = (self.wal.positions(replica.shard), self.wal.counters(replica.shard)) else {
                    continue;
                };
                // The positions' time, taken as they are read: the
                // coordinator shows each position with its age, so a
                // follower reported ahead of its leader is visibly younger.
                let last_seqno = self.last_written(replica.shard, &p);
                let positions_us = now_us();
                let now = Instant::now();
                let (prev, at) = last_records.insert(replica.shard, (c.records, now)).unwrap_or((c.records, now));
                let elapsed = now.duration_since(at).as_secs_f64();
                let rate = if elapsed > 0.0 { (c.records - prev) as f64 / elapsed } else { 0.0 };
                node_rate += rate;
                let last_epoch = self.log_rank_epoch(replica.shard, &p).await.unwrap_or(0);
                let producers = self.wal.producer_stats(replica.shard, positions_us).ok();
                let mut lag_records = std::collections::BTreeMap::new();
                let mut lag_bytes = std::collections::BTreeMap::new();
                let mut lag_seconds = std::collections::BTreeMap::new();
                let built = LastBuild::new(activity, progress, standing, &silences, long_silence_ms);
                let commit = match replica.leader_state() {
                    Some(leader) => {
                        let core = leader.core.lock();
                        for (id, _) in core.followers() {
                            if let Some(lag) = core.lag(id, now_us()) {
                                lag_records.insert(id, lag.records);
                                lag_bytes.insert(id, lag.bytes);
                                lag_seconds.insert(id, lag.flush_seconds);
                            }
                        }
                        core.commit().0
                    }
                    None => replica.readable(),
                };
                // Leader only: the archive status exists while it leads.
                let archive = if view.role == Role::Leader { self.archive_status(replica.shard) } else { None };
                // Nothing of its own in flight: what it wrote is durable, a
                // leader's commit reached it and every follower not silent
                // holds it, and its archive (if it archives) has it. What
                // else its report says then moves only with its activity,
                // its progress or a silent peer's return (see `dormancy`).
                let at_rest = p.durable_seqno >= last_seqno
                    && (view.role != Role::Leader || commit >= last_seqno)
                    && lag_records.iter().all(|(id, &lag)| {
                        lag == 0 || silences.followers.get(id).is_some_and(|&ms| ms >= long_silence_ms)
                    })
                    && archive.as_ref().is_none_or(|a| a.archived_seqno >= commit && a.lag_seconds == 0.0);
                let built = built.dormant_from(self.dormancy(&silences, long_silence_ms, at_rest));
                requests.push(HeartbeatRequest {
                    shard_id: replica.shard,
                    region_id: self.region,
                    entity_count: (p.last_seqno + 1).saturating_sub(p.first_seqno),
                    signal_throughput_eps: rate,
                    disk_bytes: disk,
                    replication_lag: lag_records,
                    replication_lag_bytes: lag_bytes,
                    replication_lag_seconds: lag_seconds,
                    last_heartbeat_ns: positions_us * 1_000,
                    node_id: self.me,
                    epoch: view.epoch.0,
                    last_seqno,
                    durable_seqno: p.durable_seqno,
                    commit_seqno: commit,
                    is_leader: view.role == Role::Leader,
                    leader_node_id: replica.leader_id(self.me).unwrap_or(0),
                    last_epoch,
                    needs_new_epoch: standing.needs_new_epoch,
                    disk_full,
                    disk_free_bytes: self.wal.disk_space().map_or(0, |d| d.free()),
                    corrupt_from_seqno: corrupt_from.unwrap_or(0),
                    leader_silent_ms: silences.leader_ms,
                    follower_silent_ms: silences.followers,
                    uptime_ms: self.started.elapsed().as_millis() as u64,
                    archiving: archive.is_some(),
                    archived_seqno: archive.as_ref().map_or(0, |a| a.archived_seqno),
                    archive_lag_seconds: archive.as_ref().map_or(0.0, |a| a.lag_seconds),
                    producers: producers.as_ref().map_or(0, |p| p.producers as u64),
                    producer_duplicates: producers.as_ref().map_or(0, |p| p.duplicates),
                });
                // An unassigned replica (fenced, new, restarted: no leader
                // to hear, nothing shipped to it) reports nothing that time
                // changes: like a quiet one, it is reported again when
                // something happens to it (a fence or an assignment
                // unsettles it) or in the next full report. At start-up a
                // node's thousands of leaderless shards would otherwise be
                // reported every tick until each gets a leader.
                let unassigned = view.role == Role::Unassigned;
                replica.reported(activity, quiet || unassigned);
                watched.build = Some(built);
            }
            let build_took = building.elapsed();
            self.metrics.heartbeat_round_seconds.with_label_values(&["build"]).observe(build_took.as_secs_f64());
            if full {
                full_every = full_report_every(build_took, looked_at, least_full_every);
            }
            unsettled.retain(|_, w| !w.replica.settled());
            dormant.extend(unsettled.extract_if(.., |_, w| w.build.as_ref().is_some_and(LastBuild::dormant)));
            resting.extend(unsettled.extract_if(.., |_, w| w.build.as_ref().is_some_and(LastBuild::rests)));
            self.metrics.dormant_replicas.set(dormant.len() as i64);
            self.metrics.append_rate.set(node_rate);
            let timeout = interval.max(Duration::from_millis(200));
            let sending = Instant::now();
            let sends = targets.iter_mut().map(|t| t.send(self.me, &requests, full, timeout, silence_ms));
            let sent = futures::future::join_all(sends).await;
            self.metrics.heartbeat_round_seconds.with_label_values(&["send"]).observe(sending.elapsed().as_secs_f64());
            for outcomes in sent {
                for ok in outcomes {
                    self.metrics.heartbeats_sent.with_label_values(&[if ok { "ok" } else { "error" }]).inc();
                }
            }
        }
    }
}

impl ReplicationNode {
    /// Moves the `dormant` replicas that `woken` names a reason for (the
    /// wake counter's label) to `unsettled`, as resting ones: the next
    /// report built decides again whether they are dormant.
    fn wake(
        &self,
        dormant: &mut BTreeMap<ShardId, Watched>,
        unsettled: &mut BTreeMap<ShardId, Watched>,
        mut woken: impl FnMut(&Watched) -> Option<&'static str>,
    ) {
        let mut reasons: BTreeMap<&'static str, u64> = BTreeMap::new();
        unsettled.extend(dormant.extract_if(.., |_, w| match woken(w) {
            Some(reason) => {
                *reasons.entry(reason).or_default() += 1;
                w.build.as_mut().map(LastBuild::wake);
                true
            }
            None => false,
        }));
        for (reason, count) in reasons {
            self.metrics.dormant_wakes.with_label_values(&[reason]).inc_by(count);
        }
    }
}

/// The longest wait between full reports (a `full` batch, every shard's
/// report; between them a batch holds only the shards whose report
/// changed), however costly they are, unless `replication.full_report_ms`
/// (2 s by default, the shortest wait) is longer: what a report leaves out
/// of its comparison (clocks, disk figures, rates, a stuck follower's lag
/// in seconds) is never older than this.
const MAX_FULL_HEARTBEAT_EVERY: Duration = Duration::from_secs(10);

/// Shard reports a node's full reports carry per second, on average, at
/// most: each costs every receiver (the coordinators decode and compare
/// it) about what it costs the node to build. At 10,000 shards three
/// nodes' full reports every 2-3 s were a quarter of an idle coordinator's
/// CPU (2026-12-06).
const FULL_REPORTS_PER_SECOND: u32 = 2_000;

/// How long to wait after a full report of `shards` replicas that took
/// `cost` to build: `least` (`replication.full_report_ms`), or longer when building
/// every shard's report is costly (so that full reports take at most 1 %
/// of the node's core) or they are many (at most
/// [`FULL_REPORTS_PER_SECOND`]), up to [`MAX_FULL_HEARTBEAT_EVERY`]. At
/// 10,000 shards building them every 2 s was about a third of an idle
/// node's CPU.
fn full_report_every(cost: Duration, shards: usize, least: Duration) -> Duration {
    let by_count = Duration::from_secs(shards as u64) / FULL_REPORTS_PER_SECOND;
    (cost * 100).max(by_count).clamp(least, MAX_FULL_HEARTBEAT_EVERY.max(least))
}

/// Shards per heartbeat batch (a full report of more goes out as several
/// batches, none of them `full`).
const HEARTBEAT_BATCH: usize = 5_000;

/// One place heartbeats go, and what it was last sent.
struct HeartbeatTarget {
    channel: crate::peers::PeerChannel,
    /// A digest of each shard's report as last sent (and acknowledged), of
    /// its [`comparable`] form ([`report_digest`]).
    last: std::collections::HashMap<u32, u64>,
    last_full: Option<Instant>,
    /// It does not know `HeartbeatBatch` (an older build): one `Heartbeat`
    /// per shard, every tick.
    legacy: bool,
}

impl HeartbeatTarget {
    fn new(channel: crate::peers::PeerChannel) -> HeartbeatTarget {
        HeartbeatTarget { channel, last: Default::default(), last_full: None, legacy: false }
    }

    /// Whether its next call must carry every shard: a full report is due
    /// (`every`, see [`full_report_every`], or after a failed send), or it
    /// takes one `Heartbeat` per shard.
    fn wants_full(&self, every: Duration) -> bool {
        self.legacy || self.last_full.is_none_or(|t| t.elapsed() >= every)
    }

    /// Sends this tick's reports: the changed ones (all of them when
    /// `full`), in batches; one (possibly empty) batch at least, which
    /// keeps the node alive to the receiver. Answers each call's success.
    /// `reports` holds every shard when `full`; otherwise the shards left
    /// out are unchanged since this target last heard of them. `silence_ms`
    /// is the replication timeout (see [`comparable`]).
    async fn send(
        &mut self,
        me: NodeId,
        reports: &[HeartbeatRequest],
        full: bool,
        timeout: Duration,
        silence_ms: u64,
    ) -> Vec<bool> {
        use walship_proto::replication::HeartbeatBatchRequest;
        use walship_proto::replication::wal_shipping_client::WalShippingClient;
        let mut client = WalShippingClient::new(self.channel.clone());
        if self.legacy {
            let mut outcomes = Vec::new();
            for report in reports {
                let mut request = tonic::Request::new(report.clone());
                request.set_timeout(timeout);
                outcomes.push(client.heartbeat(request).await.is_ok());
            }
            return outcomes;
        }
        let changed: Vec<(&HeartbeatRequest, u64)> = reports
            .iter()
            .map(|r| (r, report_digest(r, silence_ms)))
            .filter(|(r, digest)| full || self.last.get(&r.shard_id) != Some(digest))
            .collect();
        let chunks: Vec<&[(&HeartbeatRequest, u64)]> =
            if changed.is_empty() { vec![&[][..]] } else { changed.chunks(HEARTBEAT_BATCH).collect() };
        let whole = chunks.len() == 1;
        let mut outcomes = Vec::new();
        for chunk in chunks {
            let batch = HeartbeatBatchRequest {
                node_id: me,
                shards: chunk.iter().map(|(r, _)| (*r).clone()).collect(),
                full: full && whole,
            };
            let mut request = tonic::Request::new(batch);
            request.set_timeout(timeout);
            match client.heartbeat_batch(request).await {
                Ok(_) => outcomes.push(true),
                Err(status) if status.code() == tonic::Code::Unimplemented => {
                    tracing::info!("the heartbeat receiver does not take batches (an older build): one call per shard");
                    self.legacy = true;
                    return outcomes;
                }
                Err(_) => outcomes.push(false),
            }
        }
        if outcomes.iter().all(|&ok| ok) {
            if full {
                self.last.clear();
                self.last_full = Some(Instant::now());
            }
            for (r, c) in changed {
                self.last.insert(r.shard_id, c);
            }
        } else {
            // The receiver may have missed a change: tell it everything next.
            self.last_full = None;
        }
        outcomes
    }
}

/// Whether two reports of a shard say the same (see [`comparable`]): the
/// node sends only changed reports between full ones, and the coordinator
/// looks again only at shards whose report changed. `silence_ms` is the
/// replication timeout.
/// Field by field, copying nothing (the coordinator compares every report
/// of a full batch with the one it holds: two copies a report were a tenth
/// of an idle coordinator at 10,000 shards); the same answer as comparing
/// their [`comparable`] forms, which a test checks field by field.
pub(crate) fn same_report(a: &HeartbeatRequest, b: &HeartbeatRequest, silence_ms: u64) -> bool {
    let class = |ms: u64| silence_class(ms, silence_ms);
    let follower_class = |ms: u64| follower_silence_class(ms, silence_ms);
    // Exhaustive on purpose: a field added to the report fails to compile
    // here until it is compared or named as moving while nothing happens
    // (as `comparable` leaves it out).
    let HeartbeatRequest {
        shard_id,
        region_id,
        entity_count,
        signal_throughput_eps: _,
        disk_bytes: _,
        replication_lag,
        last_heartbeat_ns: _,
        node_id,
        epoch,
        last_seqno,
        durable_seqno,
        commit_seqno,
        is_leader,
        leader_node_id,
        last_epoch,
        replication_lag_bytes,
        replication_lag_seconds: _,
        needs_new_epoch,
        disk_full,
        disk_free_bytes: _,
        corrupt_from_seqno,
        leader_silent_ms,
        follower_silent_ms,
        uptime_ms: _,
        archiving,
        archived_seqno,
        archive_lag_seconds,
        producers,
        producer_duplicates,
    } = a;
    *shard_id == b.shard_id
        && *region_id == b.region_id
        && *entity_count == b.entity_count
        && *replication_lag == b.replication_lag
        && *node_id == b.node_id
        && *epoch == b.epoch
        && *last_seqno == b.last_seqno
        && *durable_seqno == b.durable_seqno
        && *commit_seqno == b.commit_seqno
        && *is_leader == b.is_leader
        && *leader_node_id == b.leader_node_id
        && *last_epoch == b.last_epoch
        && *replication_lag_bytes == b.replication_lag_bytes
        && *needs_new_epoch == b.needs_new_epoch
        && *disk_full == b.disk_full
        && *corrupt_from_seqno == b.corrupt_from_seqno
        && class(*leader_silent_ms) == class(b.leader_silent_ms)
        && follower_silent_ms.len() == b.follower_silent_ms.len()
        && follower_silent_ms.iter().all(|(n, &ms)| {
            b.follower_silent_ms.get(n).is_some_and(|&other| follower_class(ms) == follower_class(other))
        })
        && *archiving == b.archiving
        && *archived_seqno == b.archived_seqno
        && archive_lag_seconds.floor() == b.archive_lag_seconds.floor()
        && *producers == b.producers
        && *producer_duplicates == b.producer_duplicates
}

/// A digest of a shard's report in its [`comparable`] form: equal for two
/// reports that say the same (maps encode in key order). A collision, one
/// in 2^64, would hold a change back until the next full report.
fn report_digest(r: &HeartbeatRequest, silence_ms: u64) -> u64 {
    use prost::Message;
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    comparable(r, silence_ms).encode_to_vec().hash(&mut hasher);
    hasher.finish()
}

/// A shard's report without what moves while nothing happens to the
/// shard (clocks, the node's disk figures, rates; silences kept as
/// [`silence_class`] and [`follower_silence_class`] tell them apart,
/// `silence_ms` the replication timeout): two reports say the same when
/// these are equal.
fn comparable(r: &HeartbeatRequest, silence_ms: u64) -> HeartbeatRequest {
    let class = |ms: u64| silence_class(ms, silence_ms);
    HeartbeatRequest {
        last_heartbeat_ns: 0,
        uptime_ms: 0,
        disk_bytes: 0,
        disk_free_bytes: 0,
        signal_throughput_eps: 0.0,
        replication_lag_seconds: Default::default(),
        archive_lag_seconds: r.archive_lag_seconds.floor(),
        leader_silent_ms: class(r.leader_silent_ms),
        follower_silent_ms: r
            .follower_silent_ms
            .iter()
            .map(|(&n, &ms)| (n, follower_silence_class(ms, silence_ms)))
            .collect(),
        ..r.clone()
    }
}

#[cfg(test)]
#[path = "heartbeats_test.rs"]
mod tests;
