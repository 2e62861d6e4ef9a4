//! What the coordinator keeps of each node's heartbeats: when they
//! arrived (for its silence bound), which run of the node sent them, and
//! the newest report of each of its replicas.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus::HistogramVec;
use walship_proto::replication::{HeartbeatBatchRequest, HeartbeatRequest};

use crate::NodeId;
use crate::replica::same_report;

pub(super) struct NodeSeen {
    pub(super) at: Instant,
    /// When this coordinator first heard from the node.
    pub(super) first: Instant,
    /// Its heartbeats' arrivals: how long its silence must last to count.
    pub(super) arrivals: crate::control::liveness::Arrivals,
    /// The last batch from the node: every shard it holds counts as
    /// reported unchanged then (kept once per node, not per shard).
    pub(super) refreshed: Option<Instant>,
    /// The newest heartbeat of each of its replicas, with when it arrived
    /// (shared: reconcile rounds look at every one of them).
    pub(super) shards: BTreeMap<u32, (Arc<HeartbeatRequest>, Instant)>,
    /// The uptime its newest reports gave, and when they arrived: when the
    /// node started, to tell a restart (see [`NodeSeen::restarted`]).
    run: Option<(u64, Instant)>,
}

/// A node whose reports say it started this much later than its earlier
/// reports did has restarted. Far above how late a batch may arrive (its
/// call's 200 ms deadline) and how long a heartbeat round takes to build;
/// far below the time a node takes to restart and report again.
const RESTART_MARGIN: Duration = Duration::from_secs(1);

impl NodeSeen {
    pub(super) fn first(now: Instant) -> NodeSeen {
        NodeSeen {
            at: now,
            first: now,
            arrivals: Default::default(),
            refreshed: None,
            shards: BTreeMap::new(),
            run: None,
        }
    }

    /// Reports with `uptime_ms` arrived at `now`. When they come from a
    /// new run of the node (their uptime went back, and the start they
    /// give is past [`RESTART_MARGIN`] after the one given before), the
    /// reports of its previous run are dropped, and the shards they were
    /// of answered: until the new run reports a shard, nothing is known of
    /// it. Kept, they said the node still led the shards it led before it
    /// died (a restarted leader never leads in its old epoch again), so
    /// those shards looked led again the moment its first batch came, and
    /// reconcile rounds read its old positions and roles as current.
    fn restarted(&mut self, uptime_ms: u64, now: Instant) -> Option<BTreeSet<u32>> {
        if uptime_ms == 0 {
            return None; // an older build: no uptime in its reports
        }
        let uptime = Duration::from_millis(uptime_ms);
        let restarted = self.run.is_some_and(|(before, at)| {
            let started_before = at.checked_sub(Duration::from_millis(before));
            let started_now = now.checked_sub(uptime);
            uptime_ms < before
                && match (started_before, started_now) {
                    (Some(b), Some(n)) => n > b + RESTART_MARGIN,
                    _ => false,
                }
        });
        if !restarted {
            if self.run.is_none_or(|(before, _)| uptime_ms >= before) {
                self.run = Some((uptime_ms, now));
            }
            return None;
        }
        self.run = Some((uptime_ms, now));
        let dropped = std::mem::take(&mut self.shards);
        Some(dropped.into_keys().collect())
    }

    /// A heartbeat (a lone one or a batch) arrived at `now`; whether the
    /// node had been silent past `timeout` (reconcile rounds left its
    /// shards alone meanwhile, `reconcile.rs`: the next looks at every one).
    /// Reports giving `uptime_ms` (0: none in them) arrived from `node` at
    /// `now`: whether the node had been silent past `timeout` (see
    /// [`NodeSeen::arrived`]), and the shards of its previous run's
    /// reports, dropped when it restarted (see [`NodeSeen::restarted`]).
    pub(super) fn heard(
        &mut self,
        node: NodeId,
        uptime_ms: u64,
        now: Instant,
        timeout: Duration,
        gaps: &HistogramVec,
    ) -> (bool, Option<BTreeSet<u32>>) {
        let back = self.arrived(now, timeout, gaps, node);
        let dropped = self.restarted(uptime_ms, now);
        if let Some(dropped) = &dropped {
            tracing::info!(
                node,
                shards = dropped.len(),
                "the node restarted: the reports of its previous run are dropped"
            );
        }
        (back, dropped)
    }

    /// Whether the node is alive at `now` as the coordinator acts on it:
    /// heard within its silence bound (the leader `timeout`, or longer
    /// while its heartbeats have lately come late; `liveness::Arrivals`).
    pub(super) fn alive(&self, timeout: Duration, now: Instant) -> bool {
        now.saturating_duration_since(self.at) <= self.arrivals.silence_bound(timeout, now)
    }

    fn arrived(&mut self, now: Instant, timeout: Duration, gaps: &HistogramVec, node: NodeId) -> bool {
        let gap = now.duration_since(self.at);
        if self.arrivals.heard() {
            gaps.with_label_values(&[&node.to_string()]).observe(gap.as_secs_f64());
        }
        self.at = now;
        self.arrivals.arrived(now);
        gap > timeout
    }

    /// Keeps a batch's reports; answers the shards whose report changed:
    /// new, different from the last one (see `same_report`; `silence_ms`
    /// the replication timeout), or no longer reported by a full batch
    /// (dropped).
    pub(super) fn take_reports(
        &mut self,
        batch: HeartbeatBatchRequest,
        now: Instant,
        silence_ms: u64,
    ) -> BTreeSet<u32> {
        let mut changed = std::collections::BTreeSet::new();
        if batch.full {
            let hosted: BTreeSet<u32> = batch.shards.iter().map(|s| s.shard_id).collect();
            let gone: Vec<u32> = self.shards.keys().filter(|id| !hosted.contains(id)).copied().collect();
            for id in gone {
                self.shards.remove(&id);
                changed.insert(id);
            }
        }
        for s in batch.shards {
            let (id, s) = (s.shard_id, Arc::new(s));
            let old = self.shards.insert(id, (s.clone(), now));
            if old.is_none_or(|(old, _)| !same_report(&old, &s, silence_ms)) {
                changed.insert(id);
            }
        }
        changed
    }
}

/// The replicas' newest heartbeats, locked (see [`Coordinator::reports`]).
pub struct Reports<'a>(pub(super) parking_lot::MutexGuard<'a, BTreeMap<NodeId, NodeSeen>>);

impl Reports<'_> {
    /// Whether `node` is alive as the coordinator acts on it (see
    /// [`NodeSeen::alive`]), `timeout` the leader timeout.
    pub fn alive(&self, node: NodeId, timeout: Duration) -> bool {
        self.0.get(&node).is_some_and(|n| n.alive(timeout, Instant::now()))
    }

    /// The newest heartbeat of a replica.
    pub fn heartbeat(&self, node: NodeId, shard: u32) -> Option<Arc<HeartbeatRequest>> {
        self.0.get(&node).and_then(|n| n.shards.get(&shard).map(|(hb, _)| hb.clone()))
    }

    /// Whether `node` last reported leading `shard` in `epoch` (no copy of
    /// the report).
    pub fn leads(&self, node: NodeId, shard: u32, epoch: u64) -> bool {
        self.0.get(&node).and_then(|n| n.shards.get(&shard)).is_some_and(|(hb, _)| hb.is_leader && hb.epoch == epoch)
    }

    /// The newest heartbeat of a replica, with milliseconds since it
    /// arrived (or since its node's last batch, which repeats it).
    pub fn heartbeat_aged(&self, node: NodeId, shard: u32) -> Option<(Arc<HeartbeatRequest>, u64)> {
        self.0.get(&node).and_then(|n| {
            let (hb, at) = n.shards.get(&shard)?;
            let at = n.refreshed.map_or(*at, |r| r.max(*at));
            Some((hb.clone(), at.elapsed().as_millis() as u64))
        })
    }

    /// Whether `node` was heard from within `timeout`.
    pub fn heard_within(&self, node: NodeId, timeout: Duration) -> bool {
        self.0.get(&node).is_some_and(|n| n.at.elapsed() <= timeout)
    }

    /// The newest heartbeat of every replica `node` reported.
    pub fn of_node(&self, node: NodeId) -> impl Iterator<Item = &HeartbeatRequest> {
        self.0.get(&node).into_iter().flat_map(|n| n.shards.values().map(|(hb, _)| &**hb))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(shard: u32, durable: u64, uptime_ms: u64) -> HeartbeatRequest {
        HeartbeatRequest {
            shard_id: shard,
            node_id: 1,
            epoch: 1,
            durable_seqno: durable,
            uptime_ms,
            ..Default::default()
        }
    }

    fn batch(full: bool, shards: Vec<HeartbeatRequest>) -> HeartbeatBatchRequest {
        HeartbeatBatchRequest { node_id: 1, shards, full }
    }

    #[test]
    fn only_changed_reports_are_looked_at_again() {
        let now = Instant::now();
        let mut node = NodeSeen::first(now);
        let first =
            node.take_reports(batch(true, vec![report(1, 5, 10), report(2, 5, 10), report(3, 5, 10)]), now, 600);
        assert_eq!(first.into_iter().collect::<Vec<_>>(), vec![1, 2, 3], "new reports are changes");
        // The next full batch repeats them, clocks moved, shard 2 grew, and
        // shard 3 is no longer hosted.
        let later = now + Duration::from_secs(2);
        let changed = node.take_reports(batch(true, vec![report(1, 5, 2010), report(2, 6, 2010)]), later, 600);
        assert_eq!(changed.into_iter().collect::<Vec<_>>(), vec![2, 3]);
        assert!(!node.shards.contains_key(&3), "a shard a full batch leaves out is dropped");
        let (kept, at) = &node.shards[&1];
        assert_eq!((kept.uptime_ms, *at), (2010, later), "an unchanged report is still kept, with its arrival");
        // A batch that is not full drops nothing.
        assert!(node.take_reports(batch(false, vec![report(2, 6, 4010)]), later, 600).is_empty());
        assert!(node.shards.contains_key(&1));
    }

    #[test]
    fn a_restarted_nodes_reports_of_its_previous_run_are_dropped() {
        let t0 = Instant::now();
        let mut node = NodeSeen::first(t0);
        assert_eq!(node.restarted(60_000, t0), None, "the first reports heard");
        node.take_reports(batch(true, vec![report(1, 5, 60_000), report(2, 5, 60_000)]), t0, 600);
        // The same run, later; and a batch of that run arriving late (its
        // uptime went back, the start it gives is earlier): no restart.
        assert_eq!(node.restarted(62_000, t0 + Duration::from_secs(2)), None);
        assert_eq!(node.restarted(61_800, t0 + Duration::from_millis(2_100)), None, "a late batch");
        // Built 300 ms before it arrived: a start 300 ms later, not a restart.
        assert_eq!(node.restarted(62_100, t0 + Duration::from_millis(2_400)), None, "a slow round");
        assert_eq!(node.shards.len(), 2);
        // Killed, restarted, reporting 500 ms into its new run.
        let after = t0 + Duration::from_secs(4);
        let dropped = node.restarted(500, after).expect("a restart");
        assert_eq!(dropped.into_iter().collect::<Vec<_>>(), vec![1, 2], "the previous run's shards, answered");
        assert!(node.shards.is_empty(), "nothing is known of the new run yet");
        let changed = node.take_reports(batch(false, vec![report(2, 5, 500)]), after, 600);
        assert_eq!(changed.into_iter().collect::<Vec<_>>(), vec![2]);
        // The new run goes on: no second restart.
        assert_eq!(node.restarted(900, after + Duration::from_millis(400)), None);
        // An older build gives no uptime: nothing is told.
        assert_eq!(node.restarted(0, after + Duration::from_secs(1)), None);
        assert_eq!(node.shards.len(), 1);
    }

    #[test]
    fn a_node_whose_heartbeats_came_late_stays_alive_within_its_bound() {
        let gaps = HistogramVec::new(prometheus::HistogramOpts::new("g", "g"), &["node"]).expect("histogram");
        let timeout = Duration::from_millis(200);
        let t0 = Instant::now();
        let mut on_time = NodeSeen::first(t0);
        for i in 1..=20 {
            on_time.arrived(t0 + Duration::from_millis(50 * i), timeout, &gaps, 1);
        }
        let last = t0 + Duration::from_millis(1_000);
        assert!(on_time.alive(timeout, last + Duration::from_millis(200)));
        assert!(!on_time.alive(timeout, last + Duration::from_millis(201)), "on time: the leader timeout");
        // One heartbeat 300 ms after the one before: silence counts from
        // twice that, decaying.
        let mut late = NodeSeen::first(t0);
        late.arrived(t0 + Duration::from_millis(50), timeout, &gaps, 2);
        late.arrived(t0 + Duration::from_millis(350), timeout, &gaps, 2);
        let last = t0 + Duration::from_millis(350);
        assert!(late.alive(timeout, last + Duration::from_millis(250)), "a 250 ms gap after a 300 ms one");
        assert!(!late.alive(timeout, last + Duration::from_millis(700)), "past twice the late gap");
    }
}
