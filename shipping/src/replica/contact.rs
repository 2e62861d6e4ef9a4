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
//!   not reached it;
//! * a replica waiting only on nodes not heard from at all is dormant in
//!   the heartbeat loop (`silence.rs`): the [`Contact`] it compares moves
//!   when one of those nodes is heard from again or another falls silent.
//!
//! Only traffic a partition drill lets through counts (the drill's checks
//! come first), and an answer counts from when its request was sent, as a
//! shipment reply counts for the lease.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::NodeId;

#[derive(Default)]
pub(crate) struct NodeContact {
    /// Per peer node: when the newest request it answered was sent (µs).
    answered: Mutex<BTreeMap<NodeId, u64>>,
    /// Per peer node: when a request from it last arrived (µs).
    heard: Mutex<BTreeMap<NodeId, u64>>,
    /// Silent peer nodes that dormant replicas wait on (see
    /// [`NodeContact::await_return`]). Locked after `answered` and `heard`.
    awaited: Mutex<BTreeSet<NodeId>>,
    /// How many times an awaited node answered or was heard from.
    returns: AtomicU64,
}

impl NodeContact {
    /// `node` answered a request this node sent at `sent_us` (refusals
    /// included: it was reachable; transport failures are not answers).
    pub(crate) fn answered(&self, node: NodeId, sent_us: u64) {
        self.raise(&self.answered, node, sent_us);
    }

    /// A request from `node` arrived at `at_us`.
    pub(crate) fn heard(&self, node: NodeId, at_us: u64) {
        self.raise(&self.heard, node, at_us);
    }

    /// Whether `node` has neither answered a request sent after
    /// `silent_since_us` nor been heard from since: if so, it is awaited
    /// from now on, and the next answer from it or request from it counts
    /// one more [`NodeContact::returns`]. A replica whose every long-silent
    /// peer is such a node can say nothing new until one of them returns
    /// (see `silence.rs`, dormant replicas).
    pub(crate) fn await_return(&self, node: NodeId, silent_since_us: u64) -> bool {
        // Both times and the awaited set under their locks at once: an
        // answer raised before this looks is seen here, one raised after
        // finds the node awaited.
        let answered = self.answered.lock();
        let heard = self.heard.lock();
        if latest(&answered, &heard, node) >= silent_since_us {
            return false;
        }
        self.awaited.lock().insert(node);
        true
    }

    /// What dormant replicas compare (see [`Contact`]), with nodes silent
    /// since before `silent_since_us`: read before awaiting, a value that
    /// differs later says an awaited node may be back or another went
    /// silent.
    pub(crate) fn contact(&self, silent_since_us: u64) -> Contact {
        use std::hash::{Hash, Hasher};
        let returns = self.returns.load(Ordering::Acquire);
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        let answered = self.answered.lock();
        let heard = self.heard.lock();
        for &node in answered.keys().chain(heard.keys()).collect::<BTreeSet<_>>() {
            (node, latest(&answered, &heard, node) < silent_since_us).hash(&mut hasher);
        }
        Contact { returns, silent: hasher.finish() }
    }

    /// Moves `node`'s time in `times` forward to `at_us` (never back: a late
    /// reply to an older request changes nothing), and counts a return of
    /// an awaited node (any answer or arrival: it is reachable again).
    fn raise(&self, times: &Mutex<BTreeMap<NodeId, u64>>, node: NodeId, at_us: u64) {
        let mut times = times.lock();
        let at = times.entry(node).or_default();
        *at = (*at).max(at_us);
        if self.awaited.lock().remove(&node) {
            self.returns.fetch_add(1, Ordering::AcqRel);
        }
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

/// When `node` last answered or was heard from (µs; 0: never).
fn latest(answered: &BTreeMap<NodeId, u64>, heard: &BTreeMap<NodeId, u64>, node: NodeId) -> u64 {
    answered.get(&node).copied().max(heard.get(&node).copied()).unwrap_or(0)
}

/// The node-level contact a dormant replica waits to see move: how many
/// times an awaited node returned ([`NodeContact::await_return`]), and a
/// digest of which peer nodes have been silent past the replication
/// timeout. A dormant leader's report names its live followers' silences
/// as within or past that timeout, so one of them going silent (the whole
/// node: a quiet follower is heard through its node's keepalives) wakes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Contact {
    pub(crate) returns: u64,
    pub(crate) silent: u64,
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
    fn an_awaited_silent_node_counts_a_return_when_it_answers_or_is_heard() {
        let c = NodeContact::default();
        c.answered(2, 1_000);
        c.heard(3, 1_000);
        assert!(!c.await_return(2, 900), "answered since: not silent");
        assert!(!c.await_return(3, 1_000), "heard since: not silent");
        let returns = |c: &NodeContact| c.returns.load(Ordering::Acquire);
        let before = returns(&c);
        assert!(c.await_return(2, 5_000));
        assert!(c.await_return(4, 5_000), "never heard from: silent");
        c.answered(3, 6_000);
        assert_eq!(returns(&c), before, "a node nobody awaits returns nothing");
        c.answered(2, 900);
        assert_eq!(returns(&c), before + 1, "any answer from an awaited node counts, even to an old request");
        c.answered(2, 7_000);
        assert_eq!(returns(&c), before + 1, "counted once until awaited again");
        c.heard(4, 7_000);
        assert_eq!(returns(&c), before + 2, "a request from it counts too");
    }

    #[test]
    fn the_contact_moves_with_a_return_or_a_node_going_silent_not_with_traffic() {
        let c = NodeContact::default();
        c.answered(2, 1_000);
        c.heard(3, 1_000);
        let seen = c.contact(500);
        c.answered(2, 1_100);
        c.heard(3, 1_200);
        assert_eq!(c.contact(600), seen, "traffic from live nodes changes nothing");
        assert_ne!(c.contact(1_150), seen, "node 2 silent since before 1,150");
        assert!(c.await_return(2, 1_150));
        let awaiting = c.contact(1_150);
        c.heard(2, 1_300);
        assert_ne!(c.contact(1_150), awaiting, "node 2 returned");
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
