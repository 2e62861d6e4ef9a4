//! The pure liveness decisions of the coordinator: from what the replicas of
//! a shard last reported, is its leader lost? Failure detection sees
//! replication, not only the leader's own heartbeats:
//!
//! * a majority of the replica set that cannot hear the leader (followers
//!   whose shipments stopped past the replication timeout) fails it over,
//!   even while the leader still heartbeats the coordinator (it is cut off
//!   from its followers);
//! * the leader's own silence towards the coordinator fails it over only
//!   when the coordinator hears a follower just now (its own network works)
//!   and the followers do not vouch for the leader (they would if it were
//!   alive and shipping to them: then only the coordinator is cut off from
//!   it, and the shard works without a failover);
//! * a minority that cannot hear the leader changes nothing.

use crate::control::failover::is_majority;

/// What one follower of the shard last reported, as the coordinator sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FollowerReport {
    /// Its last heartbeat arrived "just now" (within a few heartbeat
    /// intervals).
    pub fresh: bool,
    /// Its last heartbeat arrived within the leader timeout.
    pub recent: bool,
    /// It follows the recorded leader in the record's epoch.
    pub follows_leader: bool,
    /// How long its leader had been silent when it reported.
    pub leader_silent_ms: u64,
}

/// A majority of the replica set (`replicas` replicas, the leader one of
/// them) cannot hear the leader: followers heard recently, following it,
/// silent past `silence_ms`.
pub fn majority_cannot_hear_leader(followers: &[FollowerReport], replicas: usize, silence_ms: u64) -> bool {
    let unheard = followers.iter().filter(|f| f.recent && f.follows_leader && f.leader_silent_ms > silence_ms).count();
    is_majority(unheard, replicas)
}

/// The leader's silence towards the coordinator means it is lost: some
/// follower reported just now, and the fresh followers that hear the leader
/// (within `silence_ms`) do not make a majority with it.
pub fn leader_silence_means_lost(followers: &[FollowerReport], replicas: usize, silence_ms: u64) -> bool {
    let hears_a_follower = followers.iter().any(|f| f.fresh);
    let vouching = followers.iter().filter(|f| f.fresh && f.follows_leader && f.leader_silent_ms <= silence_ms).count();
    hears_a_follower && !is_majority(vouching + 1, replicas)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SILENCE: u64 = 1_000;

    fn report(fresh: bool, follows_leader: bool, leader_silent_ms: u64) -> FollowerReport {
        FollowerReport { fresh, recent: fresh, follows_leader, leader_silent_ms }
    }

    #[test]
    fn both_followers_cut_from_the_leader_is_a_majority_that_cannot_hear_it() {
        let cut = [report(true, true, 1_500), report(true, true, 1_200)];
        assert!(majority_cannot_hear_leader(&cut, 3, SILENCE));
    }

    #[test]
    fn one_follower_cut_from_the_leader_changes_nothing() {
        assert!(!majority_cannot_hear_leader(&[report(true, true, 5_000), report(true, true, 50)], 3, SILENCE));
        // In five replicas, two followers are still a minority.
        let five =
            [report(true, true, 5_000), report(true, true, 5_000), report(true, true, 10), report(true, true, 10)];
        assert!(!majority_cannot_hear_leader(&five, 5, SILENCE));
    }

    #[test]
    fn stale_reports_and_followers_of_another_leader_do_not_count() {
        let stale = FollowerReport { fresh: false, recent: false, follows_leader: true, leader_silent_ms: 9_000 };
        assert!(!majority_cannot_hear_leader(&[stale, report(true, true, 9_000)], 3, SILENCE));
        assert!(!majority_cannot_hear_leader(&[report(true, false, 9_000), report(true, true, 9_000)], 3, SILENCE));
    }

    #[test]
    fn a_silent_leader_the_followers_still_hear_is_not_lost() {
        // Only the coordinator is cut off from the leader.
        assert!(!leader_silence_means_lost(&[report(true, true, 40), report(true, true, 60)], 3, SILENCE));
        // One follower hearing it makes a majority of three with it.
        assert!(!leader_silence_means_lost(&[report(true, true, 40), report(true, true, 5_000)], 3, SILENCE));
    }

    #[test]
    fn a_silent_leader_nobody_hears_is_lost() {
        // Crashed: its followers hear nothing from it either.
        assert!(leader_silence_means_lost(&[report(true, true, 1_500), report(true, true, 1_500)], 3, SILENCE));
        // Gone from the followers' view altogether (they follow nobody yet).
        assert!(leader_silence_means_lost(&[report(true, false, 0), report(false, false, 0)], 3, SILENCE));
    }

    #[test]
    fn a_coordinator_that_hears_nobody_calls_nobody_lost() {
        // The coordinator is cut off (or just healed): no fresh report.
        let stale = [report(false, true, 0), report(false, true, 0)];
        assert!(!leader_silence_means_lost(&stale, 3, SILENCE));
        assert!(!leader_silence_means_lost(&[], 1, SILENCE), "a lone replica has no witness");
    }
}
