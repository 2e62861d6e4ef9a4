//! Node-level contact: when each peer node last answered this node, and
//! when it last reached it, whatever shard the traffic was for.
//!
//! Crashes and partitions happen to nodes, not to shards. A shard's own
//! contact (its shipments' replies, its quiet link's keepalives) can lag on
//! a saturated node that leads thousands of shards while the nodes still
//! talk; judged per shard, that lag looked like thousands of lost leaders at
//! once, and the failovers it caused saturated the nodes further. So:
//! * CheckQuorum (`send::run_lease_watch`) steps a leader down only when
//!   the nodes of a majority of its replica set have stopped *answering*
//!   this node ([`LeaderCore::nodes_reach_majority`](crate::core::leader::LeaderCore::nodes_reach_majority));
//!   a leader whose lease lapsed while they answer keeps waiting and
//!   acknowledges nothing (the lease alone gates acknowledgements);
//! * a follower reports its leader silent (`leader_silent_ms`, which the
//!   coordinator's partition rule reads) only when the leader's *node* has
//!   not reached it.
//!
//! Only traffic a partition drill lets through counts (the drill's checks
//! come first), and an answer counts from when its request was sent, as a
//! shipment reply counts for the lease.

use std::collections::BTreeMap;

use parking_lot::Mutex;

use crate::NodeId;

#[derive(Default)]
pub(crate) struct NodeContact {
    /// Per peer node: when the newest request it answered was sent (µs).
    answered: Mutex<BTreeMap<NodeId, u64>>,
    /// Per peer node: when a request from it last arrived (µs).
    heard: Mutex<BTreeMap<NodeId, u64>>,
}

impl NodeContact {
    /// `node` answered a request this node sent at `sent_us` (refusals
    /// included: it was reachable; transport failures are not answers).
    pub(crate) fn answered(&self, node: NodeId, sent_us: u64) {
        raise(&self.answered, node, sent_us);
    }

    /// A request from `node` arrived at `at_us`.
    pub(crate) fn heard(&self, node: NodeId, at_us: u64) {
        raise(&self.heard, node, at_us);
    }

    /// When the newest request `node` answered was sent.
    pub(crate) fn answered_at(&self, node: NodeId) -> Option<u64> {
        self.answered.lock().get(&node).copied()
    }

    /// When a request from `node` last arrived.
    pub(crate) fn heard_at(&self, node: NodeId) -> Option<u64> {
        self.heard.lock().get(&node).copied()
    }
}

/// Moves `node`'s time in `times` forward to `at_us` (never back: a late
/// reply to an older request changes nothing).
fn raise(times: &Mutex<BTreeMap<NodeId, u64>>, node: NodeId, at_us: u64) {
    let mut times = times.lock();
    let at = times.entry(node).or_default();
    *at = (*at).max(at_us);
}

/// Whether a call's outcome is the peer node's own answer: a success or a
/// refusal it decided, not a transport failure or a timeout. `Unavailable`
/// never counts: transports fail with it, and so does a peer's partition
/// drill and a follower still repairing (a refusal worth nothing here).
pub(crate) fn is_answer<T>(outcome: &Result<T, tonic::Status>) -> bool {
    use tonic::Code;
    match outcome {
        Ok(_) => true,
        Err(status) => {
            !matches!(status.code(), Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contact_only_moves_forward_and_is_kept_per_node() {
        let c = NodeContact::default();
        assert_eq!(c.answered_at(2), None);
        c.answered(2, 500);
        c.answered(2, 300);
        assert_eq!(c.answered_at(2), Some(500), "a late answer to an older request moves nothing back");
        c.heard(3, 700);
        c.heard(3, 600);
        assert_eq!(c.heard_at(3), Some(700));
        assert_eq!(c.heard_at(2), None, "answers and arrivals are kept apart");
        assert_eq!(c.answered_at(3), None);
    }

    #[test]
    fn a_refusal_is_an_answer_and_a_transport_failure_is_not() {
        assert!(is_answer::<()>(&Ok(())));
        assert!(is_answer::<()>(&Err(tonic::Status::failed_precondition("stale epoch"))));
        assert!(is_answer::<()>(&Err(tonic::Status::out_of_range("gap"))));
        assert!(!is_answer::<()>(&Err(tonic::Status::unavailable("connection refused"))));
        assert!(!is_answer::<()>(&Err(tonic::Status::deadline_exceeded("timed out"))));
        assert!(!is_answer::<()>(&Err(tonic::Status::cancelled("dropped"))));
    }
}
