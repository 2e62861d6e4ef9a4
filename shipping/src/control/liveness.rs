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
//! * a follower's silence counts only from when the leader was told it
//!   leads (its assignment in the epoch concluded, or it reported leading):
//!   a follower counts from when it began to follow, and at start-up it can
//!   be assigned seconds before its leader, whose assignment queues behind
//!   thousands; without this such shards failed over before their leader
//!   ever started, each new epoch queueing more assignments;
//! * a minority that cannot hear the leader changes nothing;
//! * how long a node's silence towards the coordinator must last before it
//!   counts adapts to how late its heartbeats have recently arrived
//!   ([`Arrivals`]): a node saturated by thousands of shards taking their
//!   leaders answers late but is not lost.

use std::time::{Duration, Instant};

use crate::control::failover::is_majority;

/// A recent late heartbeat's weight halves every this long.
pub const LATE_HALF_LIFE: Duration = Duration::from_secs(5);

/// However late a node's heartbeats have been, its silence counts past this
/// (or the configured leader timeout, if longer).
pub const MAX_SILENCE_BOUND: Duration = Duration::from_secs(4);

/// When one node's heartbeats arrived, for an adaptive silence bound: the
/// idea of the accrual failure detectors (Cassandra's, Akka's), kept to one
/// figure. The worst gap between two arrivals lately, decaying by half
/// every [`LATE_HALF_LIFE`], doubled, is how long the node may go silent
/// before its leaders count as lost, never less than the configured leader
/// timeout and never more than [`MAX_SILENCE_BOUND`]. A node whose
/// heartbeats arrive on time keeps the configured timeout (a crash is
/// noticed as fast as before); one whose heartbeats came 600 ms apart while
/// it took on thousands of leaderships gets 1.2 s, then the timeout again
/// within a few half-lives. Timeouts only decide liveness: the epoch fences
/// keep failovers safe whatever they are.
#[derive(Debug, Clone, Copy, Default)]
pub struct Arrivals {
    last: Option<Instant>,
    /// The worst gap lately, and when it was last raised.
    worst: Duration,
    worst_at: Option<Instant>,
}

impl Arrivals {
    /// A heartbeat arrived at `at`.
    pub fn arrived(&mut self, at: Instant) {
        if let Some(last) = self.last {
            let gap = at.saturating_duration_since(last);
            self.worst = self.worst_at_time(at).max(gap);
            self.worst_at = Some(at);
        }
        self.last = Some(at);
    }

    /// Whether a heartbeat arrived before.
    pub fn heard(&self) -> bool {
        self.last.is_some()
    }

    /// The worst recent gap as of `now`, decayed.
    fn worst_at_time(&self, now: Instant) -> Duration {
        let Some(at) = self.worst_at else { return Duration::ZERO };
        let halvings = now.saturating_duration_since(at).as_secs_f64() / LATE_HALF_LIFE.as_secs_f64();
        self.worst.mul_f64(0.5f64.powf(halvings))
    }

    /// How long the node may stay silent, as of `now`, before it counts as
    /// lost (see the type's docs).
    pub fn silence_bound(&self, timeout: Duration, now: Instant) -> Duration {
        (2 * self.worst_at_time(now)).min(MAX_SILENCE_BOUND).max(timeout)
    }
}

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
/// silent past `silence_ms`. A follower's silence counts at most from when
/// the leader was told it leads, `leader_told_ms` ago (none: not told yet,
/// so nobody could have heard it and its silence proves nothing; the
/// leader's own silence towards the coordinator still counts, see
/// [`leader_silence_means_lost`]).
pub fn majority_cannot_hear_leader(
    followers: &[FollowerReport],
    replicas: usize,
    silence_ms: u64,
    leader_told_ms: Option<u64>,
) -> bool {
    let Some(told_ms) = leader_told_ms else { return false };
    let unheard = followers
        .iter()
        .filter(|f| f.recent && f.follows_leader && f.leader_silent_ms.min(told_ms) > silence_ms)
        .count();
    is_majority(unheard, replicas)
}

/// The leader's silence towards the coordinator means it is lost: some
/// follower reported just now, and the fresh followers that hear the leader
/// (within `silence_ms`) do not make a majority with it.
pub fn leader_silence_means_lost(followers: &[FollowerReport], replicas: usize, silence_ms: u64) -> bool {
    let hears_a_follower = followers.iter().any(|f| f.fresh);
    hears_a_follower && !followers_vouch(followers, replicas, silence_ms)
}

/// The fresh followers that hear the leader (within `silence_ms`) make a
/// majority of the replica set with it: it works, whatever the coordinator
/// hears of it. Followers not heard just now vouch for nothing.
pub fn followers_vouch(followers: &[FollowerReport], replicas: usize, silence_ms: u64) -> bool {
    let vouching = followers.iter().filter(|f| f.fresh && f.follows_leader && f.leader_silent_ms <= silence_ms).count();
    is_majority(vouching + 1, replicas)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_on_time_keeps_the_configured_timeout() {
        let timeout = Duration::from_millis(200);
        let t0 = Instant::now();
        let mut a = Arrivals::default();
        assert_eq!(a.silence_bound(timeout, t0), timeout, "never heard: the configured timeout");
        for i in 0..100 {
            a.arrived(t0 + Duration::from_millis(50 * i));
        }
        assert_eq!(a.silence_bound(timeout, t0 + Duration::from_secs(5)), timeout);
    }

    #[test]
    fn late_heartbeats_stretch_the_bound_until_they_are_on_time_again() {
        let timeout = Duration::from_millis(200);
        let t0 = Instant::now();
        let mut a = Arrivals::default();
        a.arrived(t0);
        a.arrived(t0 + Duration::from_millis(600));
        let just_after = t0 + Duration::from_millis(600);
        assert_eq!(a.silence_bound(timeout, just_after), Duration::from_millis(1_200), "twice the late gap");
        // On time again: the late gap's weight halves every half-life.
        let mut t = just_after;
        for _ in 0..100 {
            t += Duration::from_millis(50);
            a.arrived(t);
        }
        let later = just_after + LATE_HALF_LIFE;
        let bound = a.silence_bound(timeout, later);
        assert!(bound < Duration::from_millis(650) && bound > Duration::from_millis(550), "{bound:?}");
        assert_eq!(a.silence_bound(timeout, just_after + 4 * LATE_HALF_LIFE), timeout);
    }

    #[test]
    fn the_bound_is_capped_however_late_a_node_was() {
        let t0 = Instant::now();
        let mut a = Arrivals::default();
        a.arrived(t0);
        a.arrived(t0 + Duration::from_secs(30));
        assert_eq!(a.silence_bound(Duration::from_millis(200), t0 + Duration::from_secs(30)), MAX_SILENCE_BOUND);
        // A configured timeout above the cap stays.
        let long = Duration::from_secs(10);
        assert_eq!(a.silence_bound(long, t0 + Duration::from_secs(30)), long);
    }

    const SILENCE: u64 = 1_000;
    /// The leader was told it leads long ago.
    const TOLD: Option<u64> = Some(60_000);

    fn report(fresh: bool, follows_leader: bool, leader_silent_ms: u64) -> FollowerReport {
        FollowerReport { fresh, recent: fresh, follows_leader, leader_silent_ms }
    }

    #[test]
    fn both_followers_cut_from_the_leader_is_a_majority_that_cannot_hear_it() {
        let cut = [report(true, true, 1_500), report(true, true, 1_200)];
        assert!(majority_cannot_hear_leader(&cut, 3, SILENCE, TOLD));
    }

    #[test]
    fn one_follower_cut_from_the_leader_changes_nothing() {
        assert!(!majority_cannot_hear_leader(&[report(true, true, 5_000), report(true, true, 50)], 3, SILENCE, TOLD));
        // In five replicas, two followers are still a minority.
        let five =
            [report(true, true, 5_000), report(true, true, 5_000), report(true, true, 10), report(true, true, 10)];
        assert!(!majority_cannot_hear_leader(&five, 5, SILENCE, TOLD));
    }

    #[test]
    fn stale_reports_and_followers_of_another_leader_do_not_count() {
        let stale = FollowerReport { fresh: false, recent: false, follows_leader: true, leader_silent_ms: 9_000 };
        assert!(!majority_cannot_hear_leader(&[stale, report(true, true, 9_000)], 3, SILENCE, TOLD));
        assert!(!majority_cannot_hear_leader(
            &[report(true, false, 9_000), report(true, true, 9_000)],
            3,
            SILENCE,
            TOLD
        ));
    }

    #[test]
    fn followers_silence_counts_only_from_when_the_leader_was_told() {
        // Both followers began to follow long ago; the leader's assignment
        // is still queued: nobody could hear it yet.
        let waiting = [report(true, true, 5_000), report(true, true, 5_000)];
        assert!(!majority_cannot_hear_leader(&waiting, 3, SILENCE, None));
        // Told 300 ms ago: 300 ms of silence at most.
        assert!(!majority_cannot_hear_leader(&waiting, 3, SILENCE, Some(300)));
        // Told past the silence bound and still unheard: cut off.
        assert!(majority_cannot_hear_leader(&waiting, 3, SILENCE, Some(SILENCE + 1)));
        // A follower that heard it since is not silent however long ago it was told.
        let heard = [report(true, true, 5_000), report(true, true, 20)];
        assert!(!majority_cannot_hear_leader(&heard, 3, SILENCE, Some(9_000)));
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
        // Not lost is not vouched for: nobody fresh vouches for the leader.
        assert!(!followers_vouch(&stale, 3, SILENCE));
    }

    #[test]
    fn followers_vouch_for_a_leader_only_as_a_fresh_majority_that_hears_it() {
        assert!(followers_vouch(&[report(true, true, 40), report(true, true, 5_000)], 3, SILENCE));
        assert!(followers_vouch(&[report(true, true, SILENCE), report(false, true, 0)], 3, SILENCE));
        assert!(!followers_vouch(&[report(true, true, SILENCE + 1), report(true, true, 5_000)], 3, SILENCE));
        assert!(!followers_vouch(&[report(true, false, 0), report(true, true, 5_000)], 3, SILENCE), "another leader's");
        // Five replicas: the leader and two hearing followers.
        let five = [report(true, true, 10), report(true, true, 10), report(true, true, 5_000), report(false, true, 0)];
        assert!(followers_vouch(&five, 5, SILENCE));
        assert!(!followers_vouch(&five[1..], 5, SILENCE));
    }
}
