//! The pure failover decisions: which replica to promote, and exactly which
//! seqnos a promotion would lose.
//!
//! The rule: among the replicas that answered the fence (a majority for an
//! automatic failover), promote the one with the highest
//! `(last_epoch, last_seqno)`. Every record acknowledged at `quorum` is
//! durable on a majority, which shares a replica with any fenced majority,
//! and logs agree on every record up to where their epochs agree, so that
//! replica holds every acknowledged record.
//!
//! A replica whose disk is full (below `wal.min_free_bytes`) refuses
//! appends, and a replica holding a known-corrupt record cannot serve it;
//! either is *unhealthy*, and promoted only when no healthy replica can take over
//! without losing an acknowledged record: among replicas of equal rank the
//! healthy one wins ([`best`]), and when the most up-to-date replica is
//! unhealthy, the most up-to-date healthy one that holds every acknowledged
//! record is promoted instead ([`promote`]); it loses at most records no
//! client was told were written. When none can, the unhealthy one leads: a
//! corrupt leader serves everything below the damage and refuses the
//! damaged seqnos with `DATA_LOSS`; a full one serves every record and
//! refuses appends until it has room. Which records may have been
//! acknowledged is judged from where the logs end, not only from the commit
//! positions replicas know ([`maybe_acknowledged_through`]).

use serde::{Deserialize, Serialize};

use crate::NodeId;

/// Where one replica's log ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Candidate {
    pub node: NodeId,
    pub last_epoch: u64,
    pub last_seqno: u64,
    pub commit_seqno: u64,
    /// Its disk is below the free-space reserve: it would refuse to lead.
    #[serde(default)]
    pub disk_full: bool,
    /// The first seqno of its log known to be corrupt.
    #[serde(default)]
    pub corrupt_from: Option<u64>,
    /// The leader being replaced by an automatic failover: it lost its
    /// followers, its quorum, or its process. Promoted again only when no
    /// other replica holds every acknowledged record, so a leader cut off
    /// from its followers is not handed the shard straight back.
    #[serde(default)]
    pub replaced: bool,
}

impl Candidate {
    fn rank(&self) -> (u64, u64) {
        (self.last_epoch, self.last_seqno)
    }

    /// Neither out of disk space nor holding a known-corrupt record.
    pub fn healthy(&self) -> bool {
        !self.disk_full && self.corrupt_from.is_none() && !self.replaced
    }
}

/// The replica with the most up-to-date log; among equally up-to-date ones,
/// a healthy one before an unhealthy one, then the lowest node id.
pub fn best(candidates: &[Candidate]) -> Option<Candidate> {
    best_spread(candidates, |_| 0)
}

/// [`best`], except that among equally up-to-date replicas of equal health
/// the one leading the fewest shards (`leads`) wins before the lowest node
/// id. Rank still comes first, so the choice holds every record the
/// most up-to-date replica holds; only a tie is spread.
fn best_spread(candidates: &[Candidate], leads: impl Fn(NodeId) -> usize) -> Option<Candidate> {
    use std::cmp::Reverse;
    candidates.iter().copied().max_by_key(|c| (c.rank(), c.healthy(), Reverse(leads(c.node)), Reverse(c.node)))
}

/// The replica an automatic failover promotes: the best (ties going to
/// the replica leading the fewest shards now, `leads`, so that the shards
/// of a lost node, or every idle shard of a start-up, do not all land on
/// the lowest node id), unless that one is unhealthy and a healthy replica
/// holds every acknowledged record (`loses_acknowledged` says it would
/// not); then the most up-to-date such healthy replica.
pub fn promote(
    candidates: &[Candidate],
    loses_acknowledged: impl Fn(&Candidate) -> bool,
    leads: impl Fn(NodeId) -> usize,
) -> Option<Candidate> {
    let top = best_spread(candidates, &leads)?;
    if top.healthy() {
        return Some(top);
    }
    let healthy: Vec<Candidate> =
        candidates.iter().copied().filter(|c| c.healthy() && !loses_acknowledged(c)).collect();
    Some(best_spread(&healthy, &leads).unwrap_or(top))
}

/// The ties of [`promote`] for a move that may keep its leader (`keep`: a
/// rebalance whose preferred replica was passed over, `rebalance.rs`):
/// among equals `keep` counts as leading nothing and every other replica
/// as leading one more than it does (`leads`), so a replica as good as the
/// old leader does not take the shard in a move nobody planned. Rank and
/// health still come first. Without `keep`, `leads` unchanged.
pub fn ties_keeping(keep: Option<NodeId>, leads: impl Fn(NodeId) -> usize) -> impl Fn(NodeId) -> usize {
    move |n| match keep {
        Some(k) if k == n => 0,
        Some(_) => 1 + leads(n),
        None => leads(n),
    }
}

/// The seqnos `best` holds that `candidate` does not, given where
/// `candidate`'s last epoch ends in `best`'s log (`best_end_of_candidate_epoch`,
/// from `EpochEnd`): promoting `candidate` discards them.
pub fn loss(candidate: &Candidate, best: &Candidate, best_end_of_candidate_epoch: u64) -> Option<(u64, u64)> {
    if candidate.rank() >= best.rank() {
        return None;
    }
    let agree_through = candidate.last_seqno.min(best_end_of_candidate_epoch);
    (agree_through < best.last_seqno).then_some((agree_through + 1, best.last_seqno))
}

/// The seqnos up to `commit` (the highest commit any replica knew) that
/// `candidate`'s log does not reach. They were on a majority, so maybe
/// acknowledged, and when `candidate` is the best no answering replica
/// holds them: a majority lost them together (a leader gone while a
/// follower dropped a corrupt tail and another lagged, say). Promoting it
/// anyway discards them, so an automatic failover does not.
pub fn lacks_committed(candidate: &Candidate, commit: u64) -> Option<(u64, u64)> {
    (candidate.last_seqno < commit).then_some((candidate.last_seqno + 1, commit))
}

/// The smallest range covering both (either may be none).
pub fn cover(a: Option<(u64, u64)>, b: Option<(u64, u64)>) -> Option<(u64, u64)> {
    match (a, b) {
        (Some((a0, a1)), Some((b0, b1))) => Some((a0.min(b0), a1.max(b1))),
        (one, None) | (None, one) => one,
    }
}

/// The part of a loss range that may have been acknowledged (at or below
/// `through`, from [`maybe_acknowledged_through`]).
pub fn acknowledged(range: Option<(u64, u64)>, through: u64) -> Option<(u64, u64)> {
    let (from, to) = range?;
    (from <= through).then_some((from, to.min(through)))
}

/// The highest seqno that may have been acknowledged, given where the logs
/// of the voters that answered end (`answered_last`, one per voter), how
/// many voters there are, and the highest commit anyone knew (`commit`).
///
/// A commit position is only a lower bound: a leader acknowledges a record
/// once a majority holds it, and the others may never hear of it (the
/// leader dies first, or every process restarts and forgets it). So a
/// record counts as possibly acknowledged whenever it may be on a majority:
/// the voters that answered and hold it, plus every voter that did not
/// answer (it may hold anything). A voter counts as holding everything up to
/// its last seqno, whatever its epochs say, which can only overcount.
/// Records above the result are on no majority in any case, so no client
/// was told they were written at `quorum` or `all`.
pub fn maybe_acknowledged_through(answered_last: &[u64], voters: usize, commit: u64) -> u64 {
    let silent = voters.saturating_sub(answered_last.len());
    let majority = voters / 2 + 1;
    if silent >= majority {
        return u64::MAX;
    }
    let mut last = answered_last.to_vec();
    last.sort_unstable_by(|a, b| b.cmp(a));
    // The `needed`-th longest answered log: every seqno up to it is held by
    // `needed` answering voters, which with the silent ones make a majority.
    let needed = majority - silent;
    last.get(needed - 1).map_or(commit, |&through| through.max(commit))
}

/// Whether `responders` out of `replicas` is a majority.
pub fn is_majority(responders: usize, replicas: usize) -> bool {
    responders > replicas / 2
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(node: NodeId, last_epoch: u64, last_seqno: u64) -> Candidate {
        Candidate {
            node,
            last_epoch,
            last_seqno,
            commit_seqno: 0,
            disk_full: false,
            corrupt_from: None,
            replaced: false,
        }
    }

    #[test]
    fn the_replaced_leader_is_promoted_again_only_when_nobody_else_holds_every_acknowledged_record() {
        let old = Candidate { replaced: true, ..c(1, 3, 90) };
        // Cut off from its followers, it holds an unacknowledged tail: a
        // follower with everything acknowledged takes over.
        assert_eq!(promote(&[old, c(2, 3, 80), c(3, 3, 85)], |c| c.last_seqno < 80, |_| 0).unwrap().node, 3);
        // Only it holds acknowledged records: it leads again.
        assert_eq!(promote(&[old, c(2, 3, 80)], |c| c.last_seqno < 88, |_| 0).unwrap().node, 1);
    }

    fn corrupt(node: NodeId, last_epoch: u64, last_seqno: u64, from: u64) -> Candidate {
        Candidate { corrupt_from: Some(from), ..c(node, last_epoch, last_seqno) }
    }

    #[test]
    fn a_corrupt_replica_is_never_promoted_while_an_intact_one_holds_every_acknowledged_record() {
        // Equally caught up: the intact one, whatever the node ids.
        assert_eq!(best(&[corrupt(1, 3, 80, 40), c(2, 3, 80)]).unwrap().node, 2);
        // The corrupt one is ahead by unacknowledged records only: the
        // intact one still.
        let candidates = [corrupt(1, 3, 90, 40), c(2, 3, 85), c(3, 3, 70)];
        assert_eq!(promote(&candidates, |c| c.last_seqno < 80, |_| 0).unwrap().node, 2);
        // No intact replica holds everything acknowledged: the corrupt one
        // leads, serving what is below the damage.
        assert_eq!(promote(&candidates, |c| c.last_seqno < 88, |_| 0).unwrap().node, 1);
        assert!(!corrupt(1, 3, 90, 40).healthy());
    }

    fn full(node: NodeId, last_epoch: u64, last_seqno: u64) -> Candidate {
        Candidate { disk_full: true, ..c(node, last_epoch, last_seqno) }
    }

    #[test]
    fn a_disk_full_replica_loses_ties_to_a_healthy_caught_up_one() {
        // Node 1 (lowest id, disk full) ties with node 3 (healthy): node 3.
        assert_eq!(best(&[full(1, 2, 50), c(2, 2, 40), c(3, 2, 50)]).unwrap().node, 3);
        // Rank still comes first: a longer log wins even on a full disk.
        assert_eq!(best(&[full(1, 2, 51), c(3, 2, 50)]).unwrap().node, 1);
        assert_eq!(promote(&[full(1, 2, 50), c(3, 2, 50)], |_| true, |_| 0).unwrap().node, 3);
    }

    #[test]
    fn promote_skips_a_disk_full_best_when_a_healthy_one_holds_every_acknowledged_record() {
        let candidates = [full(1, 2, 60), c(2, 2, 55), c(3, 2, 50)];
        // Both healthy ones hold everything acknowledged: the longer one.
        assert_eq!(promote(&candidates, |_| false, |_| 0).unwrap().node, 2);
        // Only node 3 does not... cannot happen with logs that agree, but
        // the rule follows what it is told: never an acknowledged loss.
        assert_eq!(promote(&candidates, |c| c.node == 2, |_| 0).unwrap().node, 3);
        // No healthy replica without an acknowledged loss: the best, full
        // disk or not (it leads, refusing appends until it has room).
        assert_eq!(promote(&candidates, |c| !c.disk_full, |_| 0).unwrap().node, 1);
        // Every replica full: the best.
        assert_eq!(promote(&[full(1, 2, 60), full(2, 2, 60)], |_| false, |_| 0).unwrap().node, 1);
        // A healthy best needs no help.
        assert_eq!(promote(&[c(1, 2, 60), full(2, 2, 60)], |_| false, |_| 0).unwrap().node, 1);
        assert_eq!(promote(&[], |_| false, |_| 0), None);
    }

    #[test]
    fn a_tie_goes_to_the_replica_leading_the_fewest_shards_and_never_past_rank_or_health() {
        let leads = |n: NodeId| [0, 40, 10, 25][n as usize];
        // Equally caught up: node 2 leads the fewest.
        assert_eq!(promote(&[c(1, 2, 50), c(2, 2, 50), c(3, 2, 50)], |_| false, leads).unwrap().node, 2);
        // One record ahead wins, however many shards it leads.
        assert_eq!(promote(&[c(1, 2, 51), c(2, 2, 50), c(3, 2, 50)], |_| false, leads).unwrap().node, 1);
        assert_eq!(promote(&[c(1, 3, 1), c(2, 2, 50)], |_| false, leads).unwrap().node, 1);
        // Health before load: the full disk leading nothing loses the tie.
        let leads_none = |n: NodeId| [0, 40, 0, 25][n as usize];
        assert_eq!(promote(&[c(1, 2, 50), full(2, 2, 50)], |_| false, leads_none).unwrap().node, 1);
        // Among the healthy ones promote falls back to, the least loaded.
        let candidates = [full(1, 2, 60), c(2, 2, 55), c(3, 2, 55)];
        assert_eq!(promote(&candidates, |_| false, leads).unwrap().node, 2);
        // Equal load: the lowest node id, as before.
        assert_eq!(promote(&[c(3, 2, 50), c(1, 2, 50)], |_| false, |_| 7).unwrap().node, 1);
    }

    #[test]
    fn a_rebalance_passing_over_its_replica_keeps_the_old_leader_among_equals_only() {
        let leads = |n: NodeId| [0, 0, 40, 10][n as usize];
        let equal = [c(1, 2, 50), c(2, 2, 50), c(3, 2, 50)];
        // Without a leader to keep, the tie goes to the least loaded.
        assert_eq!(promote(&equal, |_| false, ties_keeping(None, leads)).unwrap().node, 1);
        // The old leader (node 2, leading the most) keeps the shard.
        assert_eq!(promote(&equal, |_| false, ties_keeping(Some(2), leads)).unwrap().node, 2);
        // Never past rank: a replica holding more takes it.
        let ahead = [c(1, 2, 50), c(2, 2, 50), c(3, 2, 51)];
        assert_eq!(promote(&ahead, |_| false, ties_keeping(Some(2), leads)).unwrap().node, 3);
        // Nor past health: a full old leader loses the tie.
        let full_old = [c(1, 2, 50), full(2, 2, 50), c(3, 2, 50)];
        assert_eq!(promote(&full_old, |_| false, ties_keeping(Some(2), leads)).unwrap().node, 1);
    }

    #[test]
    fn highest_epoch_then_longest_log_wins() {
        assert_eq!(best(&[c(1, 1, 90), c(2, 2, 50), c(3, 2, 40)]).unwrap().node, 2);
        assert_eq!(best(&[c(1, 2, 10), c(2, 2, 12)]).unwrap().node, 2);
        // Ties go to the lowest node id, so the choice is deterministic.
        assert_eq!(best(&[c(3, 2, 10), c(2, 2, 10)]).unwrap().node, 2);
        assert_eq!(best(&[]), None);
    }

    #[test]
    fn loss_ranges() {
        let top = c(1, 2, 100);
        // Same epoch, shorter: loses the tail.
        assert_eq!(loss(&c(2, 2, 90), &top, 100), Some((91, 100)));
        // Older last epoch: its records past where that epoch ends in the
        // best log are not the best log's, so the loss starts there.
        assert_eq!(loss(&c(3, 1, 95), &top, 60), Some((61, 100)));
        // Older epoch but fully a prefix.
        assert_eq!(loss(&c(3, 1, 50), &top, 60), Some((51, 100)));
        assert_eq!(loss(&top, &top, 100), None);
    }

    #[test]
    fn a_record_on_a_possible_majority_counts_as_acknowledged_whatever_the_known_commit() {
        // Every process restarted and forgot its commit (0). Node 2 holds 5,
        // node 1 holds 4, node 3 did not answer: 5 may be on nodes 2 and 3.
        assert_eq!(maybe_acknowledged_through(&[4, 5], 3, 0), 5);
        // All three answered and only node 2 holds 5: 5 is on no majority.
        assert_eq!(maybe_acknowledged_through(&[4, 5, 4], 3, 0), 4);
        assert_eq!(maybe_acknowledged_through(&[4, 5, 3], 3, 0), 4);
        // A known commit is never lowered.
        assert_eq!(maybe_acknowledged_through(&[4, 5, 3], 3, 5), 5);
        // Five voters, two silent: one answering holder makes a majority.
        assert_eq!(maybe_acknowledged_through(&[9, 7, 2], 5, 0), 9);
        // No majority answered (a forced failover): anything may be.
        assert_eq!(maybe_acknowledged_through(&[9], 3, 0), u64::MAX);
        assert_eq!(maybe_acknowledged_through(&[], 1, 0), u64::MAX);
        // The scenario the rule exists for: the replaced leader holds the
        // only copy the answers show of 5, a silent replica may hold
        // another, so the shorter follower would lose an acknowledged
        // record and the replaced leader leads again.
        let through = maybe_acknowledged_through(&[4, 5], 3, 0);
        let old = Candidate { replaced: true, ..c(2, 1, 5) };
        let follower = c(1, 1, 4);
        let loses = |x: &Candidate| acknowledged(loss(x, &old, 5), through).is_some();
        assert_eq!(promote(&[follower, old], loses, |_| 0).unwrap().node, 2);
    }

    #[test]
    fn a_log_short_of_the_known_commit_lacks_committed_records() {
        assert_eq!(lacks_committed(&c(1, 2, 14), 20), Some((15, 20)));
        assert_eq!(lacks_committed(&c(1, 2, 20), 20), None);
        assert_eq!(lacks_committed(&c(1, 2, 25), 20), None);
        assert_eq!(lacks_committed(&c(1, 0, 0), 0), None, "an empty shard lacks nothing");
        assert_eq!(cover(Some((15, 20)), Some((11, 18))), Some((11, 20)));
        assert_eq!(cover(None, Some((11, 18))), Some((11, 18)));
        assert_eq!(cover(Some((15, 20)), None), Some((15, 20)));
        assert_eq!(cover(None, None), None);
    }

    #[test]
    fn acknowledged_part_of_a_loss() {
        assert_eq!(acknowledged(Some((91, 100)), 95), Some((91, 95)));
        assert_eq!(acknowledged(Some((91, 100)), 90), None);
        assert_eq!(acknowledged(None, 100), None);
    }

    #[test]
    fn majorities() {
        assert!(is_majority(2, 3));
        assert!(!is_majority(1, 3));
        assert!(is_majority(3, 5));
        assert!(!is_majority(2, 4));
    }
}
