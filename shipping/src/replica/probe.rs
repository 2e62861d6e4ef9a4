//! How a leader's shippers see one follower node: up, or down and probed
//! by one shard at a time with a growing backoff (see [`PeerProbe`]).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// A follower whose calls failed this many times in a row is probed with
/// a backoff: the next waits [`PROBE_BACKOFF_FIRST_US`], doubling with
/// every further failure up to [`PROBE_BACKOFF_MAX_US`]. The first call
/// that gets through (on any shard) ends every shard's backoff towards
/// that node, as does that node pulling a catch-up stream or sending a
/// node keepalive here (`ReplicationNode::peer_back`).
pub(super) const PROBE_FAILURES_BEFORE_BACKOFF: u32 = 4;
const PROBE_BACKOFF_FIRST_US: u64 = 25_000;
const PROBE_BACKOFF_MAX_US: u64 = 1_000_000;

/// How long a shipper that found another shard's probe of a down node
/// within the backoff (a window it did not open: its turn not come)
/// sleeps before it looks again,
/// unless the node is back first (a probe got through, the node pulled a
/// catch-up or sent a node keepalive: [`PeerProbe::back`]) or it has
/// records to ship. Waking every backoff (a second) to find another shard
/// probing, the 5,000 shippers of a survivor towards a dead node were a
/// quarter of its CPU with the node down, at 10,000 shards; one shipper in
/// thirty seconds' worth of them waking is enough to keep a probe going
/// every second.
pub(super) const NOT_MY_TURN_US: u64 = 30_000_000;

/// One follower node as this node's shippers see it. While calls to it
/// keep failing (more than [`PROBE_FAILURES_BEFORE_BACKOFF`] in a row, on
/// any of its shards, with no call getting through in between) it is down,
/// and its shards' shippers take turns probing it: one probe per backoff
/// (doubling from [`PROBE_BACKOFF_FIRST_US`] to [`PROBE_BACKOFF_MAX_US`])
/// for the whole node, not one per shard. A node leading thousands of
/// shards whose follower died made a connection attempt per shard every
/// second: a third of its CPU at 10,000 shards, for as long as the node
/// stayed down.
pub(super) struct PeerProbe {
    /// Bumped when the node answers again after failures: shippers backing
    /// off from it probe at once.
    pub(super) back: tokio::sync::watch::Sender<u64>,
    /// Calls failed in a row, over all shards.
    failures: AtomicU32,
    /// While down: when (µs) the next probe may go.
    next_probe_us: AtomicU64,
}

impl PeerProbe {
    pub(super) fn new() -> PeerProbe {
        PeerProbe {
            back: tokio::sync::watch::Sender::new(0),
            failures: AtomicU32::new(0),
            next_probe_us: AtomicU64::new(0),
        }
    }

    pub(super) fn failed(&self) {
        self.failures.fetch_add(1, Ordering::AcqRel);
    }

    /// A call got through.
    pub(super) fn answered(&self) {
        if self.failures.load(Ordering::Acquire) != 0 {
            self.failures.store(0, Ordering::Release);
        }
    }

    pub(super) fn down(&self) -> bool {
        self.failures.load(Ordering::Acquire) > PROBE_FAILURES_BEFORE_BACKOFF
    }

    /// Whether a shipper backing off may call the node now: yes unless the
    /// node is down and a probe went within the backoff. `Ok` holds the
    /// probe window this call opened (0 while the node is up), `Err` the
    /// one in force: a shipper that finds a window it did not open waits
    /// for another shard's probe (see [`NOT_MY_TURN_US`]).
    pub(super) fn may_probe(&self, now: u64) -> Result<u64, u64> {
        if !self.down() {
            return Ok(0);
        }
        let next = self.next_probe_us.load(Ordering::Acquire);
        if now < next {
            return Err(next);
        }
        let window = now + probe_backoff_us(self.failures.load(Ordering::Acquire));
        match self.next_probe_us.compare_exchange(next, window, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => Ok(window),
            Err(other) => Err(other),
        }
    }
}

/// How long to wait before the next call after `failures` failed calls in
/// a row (none until [`PROBE_FAILURES_BEFORE_BACKOFF`]).
pub(super) fn probe_backoff_us(failures: u32) -> u64 {
    if failures <= PROBE_FAILURES_BEFORE_BACKOFF {
        return 0;
    }
    PROBE_BACKOFF_FIRST_US
        .saturating_mul(1 << (failures - PROBE_FAILURES_BEFORE_BACKOFF - 1).min(16))
        .min(PROBE_BACKOFF_MAX_US)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_down_is_probed_by_one_shard_per_backoff_and_freely_once_it_answers() {
        let peer = PeerProbe::new();
        // Up (or not failing enough to count as down): every call goes.
        for _ in 0..PROBE_FAILURES_BEFORE_BACKOFF {
            peer.failed();
        }
        assert!(peer.may_probe(1_000).is_ok() && peer.may_probe(1_000).is_ok());
        peer.failed();
        assert!(peer.down());
        // Down: one probe, then none until the backoff ran out; the window
        // in force says whose probe it was.
        let now = 10_000_000;
        let window = peer.may_probe(now).expect("the first probe goes");
        assert_eq!(window, now + PROBE_BACKOFF_FIRST_US);
        assert_eq!(peer.may_probe(now), Err(window));
        assert_eq!(peer.may_probe(now + PROBE_BACKOFF_FIRST_US - 1), Err(window));
        let next = peer.may_probe(now + PROBE_BACKOFF_FIRST_US).expect("the next probe after the backoff");
        assert_ne!(next, window, "a new window: the shard that opened the first sees another's");
        assert_eq!(peer.may_probe(now + PROBE_BACKOFF_FIRST_US), Err(next));
        // A call that gets through ends it.
        peer.answered();
        assert!(!peer.down());
        assert_eq!(peer.may_probe(now + PROBE_BACKOFF_FIRST_US), Ok(0));
    }

    #[test]
    fn the_probe_backoff_doubles_to_a_bound() {
        assert_eq!(probe_backoff_us(PROBE_FAILURES_BEFORE_BACKOFF), 0);
        assert_eq!(probe_backoff_us(PROBE_FAILURES_BEFORE_BACKOFF + 1), PROBE_BACKOFF_FIRST_US);
        assert_eq!(probe_backoff_us(PROBE_FAILURES_BEFORE_BACKOFF + 2), 2 * PROBE_BACKOFF_FIRST_US);
        assert_eq!(probe_backoff_us(u32::MAX), PROBE_BACKOFF_MAX_US);
    }
}
