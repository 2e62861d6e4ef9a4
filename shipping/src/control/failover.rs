//! The pure failover decisions: which replica to promote, and exactly which
//! seqnos a promotion would lose.
//!
//! The rule: among the replicas that answered the fence (a majority for an
//! automatic failover), promote the one with the highest
//! `(last_epoch, last_seqno)`. Every record acknowledged at `quorum` is
//! durable on a majority, which shares a replica with any fenced majority,
//! and logs agree on every record up to where their epochs agree, so that
//! replica holds every acknowledged record.

use serde::{Deserialize, Serialize};

use crate::NodeId;

/// Where one replica's log ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Candidate {
    pub node: NodeId,
    pub last_epoch: u64,
    pub last_seqno: u64,
    pub commit_seqno: u64,
}

impl Candidate {
    fn rank(&self) -> (u64, u64) {
        (self.last_epoch, self.last_seqno)
    }
}

/// The replica with the most up-to-date log.
pub fn best(candidates: &[Candidate]) -> Option<Candidate> {
    candidates.iter().copied().max_by_key(|c| (c.rank(), std::cmp::Reverse(c.node)))
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

/// The part of a loss range that was acknowledged (at or below `commit`).
pub fn acknowledged(range: Option<(u64, u64)>, commit: u64) -> Option<(u64, u64)> {
    let (from, to) = range?;
    (from <= commit).then_some((from, to.min(commit)))
}

/// Whether `responders` out of `replicas` is a majority.
pub fn is_majority(responders: usize, replicas: usize) -> bool {
    responders > replicas / 2
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(node: NodeId, last_epoch: u64, last_seqno: u64) -> Candidate {
        Candidate { node, last_epoch, last_seqno, commit_seqno: 0 }
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
