//! Unit tests of the leader core: each feeds events (local durability,
//! sends, replies, confirmations) and asserts its decisions.

use super::*;
use crate::core::{Epoch, Seqno};

const SETTINGS: LeaderSettings =
    LeaderSettings { window: 2, catchup_threshold_bytes: 10_000, keepalive_us: 1_000, probe_us: 1_000, lease_us: None };

fn start(epoch: u64, durable: u64, epoch_start: u64, commit_floor: u64) -> LeaderStart {
    LeaderStart {
        epoch: Epoch(epoch),
        first: Seqno(1),
        durable: Seqno(durable),
        epoch_start: Seqno(epoch_start),
        commit_floor: Seqno(commit_floor),
    }
}

fn leader() -> LeaderCore {
    LeaderCore::new(start(5, 0, 1, 0), &[2, 3], SETTINGS, 0)
}

/// Puts a follower into push mode at `acked` by answering a probe.
fn probe(core: &mut LeaderCore, f: NodeId, acked: u64, now: u64) {
    assert_eq!(core.poll_ship(f, now), ShipDecision::Keepalive);
    core.on_keepalive_sent(f, now);
    core.on_reply(f, ShipReply::Applied { applied: Seqno(acked) }, now).unwrap();
}

#[test]
fn followers_start_in_probe_and_get_one_keepalive() {
    let mut core = leader();
    assert_eq!(core.poll_ship(2, 5_000), ShipDecision::Keepalive);
    core.on_keepalive_sent(2, 5_000);
    assert_eq!(core.poll_ship(2, 9_000), ShipDecision::Idle, "one probe at a time");
    core.on_reply(2, ShipReply::Applied { applied: Seqno(0) }, 9_000).unwrap();
    assert_eq!(core.progress(2).unwrap().mode, ShipMode::Push);
}

#[test]
fn only_durable_records_are_offered_and_the_window_bounds_in_flight() {
    let mut core = leader();
    probe(&mut core, 2, 0, 1_000);
    assert_eq!(core.poll_ship(2, 1_500), ShipDecision::Idle, "nothing durable yet and keepalive not due");
    core.on_local_durable(Seqno(10), 10, 1_000, 2_000);
    assert_eq!(core.poll_ship(2, 2_000), ShipDecision::Send { from: Seqno(1), up_to: Seqno(10) });
    core.on_sent(2, Seqno(1), Seqno(4), 2_000);
    assert_eq!(core.poll_ship(2, 2_000), ShipDecision::Send { from: Seqno(5), up_to: Seqno(10) });
    core.on_sent(2, Seqno(5), Seqno(10), 2_000);
    core.on_local_durable(Seqno(12), 12, 1_200, 2_100);
    assert_eq!(core.poll_ship(2, 2_100), ShipDecision::Idle, "window of 2 is full");
    core.on_reply(2, ShipReply::Applied { applied: Seqno(4) }, 2_200).unwrap();
    assert_eq!(core.poll_ship(2, 2_200), ShipDecision::Send { from: Seqno(11), up_to: Seqno(12) });
}

#[test]
fn early_shipping_sends_written_records_but_commits_only_what_the_leader_has_durable() {
    let mut core = leader();
    probe(&mut core, 2, 0, 0);
    probe(&mut core, 3, 0, 0);
    core.on_local_written(Seqno(6));
    assert_eq!(
        core.poll_ship(2, 100),
        ShipDecision::Send { from: Seqno(1), up_to: Seqno(6) },
        "written records go out"
    );
    core.on_sent(2, Seqno(1), Seqno(6), 100);
    assert_eq!(core.poll_ship(3, 100), ShipDecision::Send { from: Seqno(1), up_to: Seqno(6) });
    core.on_sent(3, Seqno(1), Seqno(6), 100);
    // Both followers have them durable before the leader does: nothing
    // commits, since the leader's own copy could still be lost.
    core.on_reply(2, ShipReply::Applied { applied: Seqno(6) }, 200).unwrap();
    core.on_reply(3, ShipReply::Applied { applied: Seqno(6) }, 200).unwrap();
    assert_eq!(core.commit(), 0, "commit never passes the leader's durable position");
    assert_eq!(core.all_durable(), 0);
    // The followers' acks are kept: the leader's fsync alone commits.
    core.on_local_durable(Seqno(4), 4, 400, 300);
    assert_eq!(core.commit(), 4);
    core.on_local_durable(Seqno(6), 6, 600, 400);
    assert_eq!((core.commit(), core.all_durable()), (Seqno(6), Seqno(6)));
}

#[test]
fn with_a_segment_in_flight_only_what_the_wal_is_committing_is_shipped() {
    let mut core = leader();
    probe(&mut core, 2, 0, 0);
    // Nothing in flight: everything written goes at once.
    core.on_local_written(Seqno(2));
    assert_eq!(core.poll_ship(2, 100), ShipDecision::Send { from: Seqno(1), up_to: Seqno(2) });
    core.on_sent(2, Seqno(1), Seqno(2), 100);
    // One in flight: appends arriving one by one wait for the group
    // commit that takes them, then go out together.
    core.on_local_written(Seqno(3));
    core.on_local_written(Seqno(4));
    core.on_local_written(Seqno(5));
    assert_eq!(core.poll_ship(2, 110), ShipDecision::Idle, "3..=5 are not being committed yet");
    core.on_local_flushing(Seqno(5));
    assert_eq!(
        core.poll_ship(2, 120),
        ShipDecision::Send { from: Seqno(3), up_to: Seqno(5) },
        "one segment per group commit"
    );
    core.on_sent(2, Seqno(3), Seqno(5), 120);
    // Flushing never lets the leader ship past what it has written, and
    // once nothing is in flight the written records go at once again.
    core.on_local_written(Seqno(7));
    core.on_local_flushing(Seqno(9));
    assert_eq!(core.flushing(), 7);
    core.on_reply(2, ShipReply::Applied { applied: Seqno(2) }, 130).unwrap();
    assert_eq!(core.poll_ship(2, 140), ShipDecision::Send { from: Seqno(6), up_to: Seqno(7) });
    core.on_sent(2, Seqno(6), Seqno(7), 140);
    core.on_reply(2, ShipReply::Applied { applied: Seqno(5) }, 150).unwrap();
    core.on_reply(2, ShipReply::Applied { applied: Seqno(7) }, 160).unwrap();
    core.on_local_written(Seqno(8));
    assert_eq!(
        core.poll_ship(2, 170),
        ShipDecision::Send { from: Seqno(8), up_to: Seqno(8) },
        "idle again: no waiting"
    );
}

#[test]
fn a_follower_ack_past_the_leaders_log_is_not_counted() {
    let mut core = leader();
    probe(&mut core, 2, 0, 0);
    core.on_local_written(Seqno(3));
    core.on_local_durable(Seqno(3), 3, 300, 10);
    // A follower claiming more than this leader ever wrote (a suffix of
    // an older leader's) gets credit only for what the leader holds.
    core.on_reply(2, ShipReply::Applied { applied: Seqno(9) }, 20).unwrap();
    assert_eq!(core.progress(2).unwrap().acked, 3);
    assert_eq!(core.commit(), 3);
}

#[test]
fn commit_stays_within_the_leaders_durable_position_at_every_step() {
    // A deterministic walk over interleavings of written, durable and
    // replies: commit <= durable <= written after every event.
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..200 {
        let mut core = leader();
        probe(&mut core, 2, 0, 0);
        probe(&mut core, 3, 0, 0);
        let (mut written, mut durable) = (0u64, 0u64);
        for step in 0..100u64 {
            match next() % 4 {
                0 => {
                    written += 1 + next() % 5;
                    core.on_local_written(Seqno(written));
                }
                1 => {
                    durable += (written - durable).min(next() % 4);
                    core.on_local_durable(Seqno(durable), durable, durable * 100, step);
                }
                r => {
                    let f = r as NodeId; // 2 or 3
                    if let ShipDecision::Send { from, up_to } = core.poll_ship(f, step) {
                        core.on_sent(f, from, up_to, step);
                        let applied = from + next() % (up_to.since(from) + 1);
                        core.on_reply(f, ShipReply::Applied { applied }, step).unwrap();
                    }
                }
            }
            assert!(core.commit() <= Seqno(durable), "commit {} past durable {durable}", core.commit());
            assert!(core.durable() <= core.written());
            assert!(core.all_durable() <= Seqno(durable));
        }
    }
}

#[test]
fn commit_is_the_majority_durable_position() {
    let mut core = leader();
    probe(&mut core, 2, 0, 0);
    probe(&mut core, 3, 0, 0);
    assert!(!core.on_local_durable(Seqno(10), 10, 100, 1));
    assert_eq!(core.commit(), 0, "leader alone is not a majority of 3");
    assert!(core.on_reply(2, ShipReply::Applied { applied: Seqno(7) }, 2).unwrap());
    assert_eq!(core.commit(), 7);
    assert_eq!(core.all_durable(), 0);
    assert!(core.on_reply(3, ShipReply::Applied { applied: Seqno(10) }, 3).unwrap());
    assert_eq!(core.commit(), 10);
    assert_eq!(core.all_durable(), 7);
    // A late, smaller reply never moves commit back.
    core.on_keepalive_sent(2, 4);
    assert!(!core.on_reply(2, ShipReply::Applied { applied: Seqno(3) }, 4).unwrap());
    assert_eq!((core.commit(), core.progress(2).unwrap().acked), (Seqno(10), Seqno(7)));
}

#[test]
fn a_follower_cannot_ack_past_the_leaders_durable_position() {
    let mut core = leader();
    core.on_local_durable(Seqno(5), 5, 50, 0);
    probe(&mut core, 2, 9, 0);
    assert_eq!(core.progress(2).unwrap().acked, 5);
    assert_eq!(core.commit(), 5);
}

#[test]
fn single_replica_commits_on_local_durability() {
    let mut core = LeaderCore::new(start(1, 0, 1, 0), &[], SETTINGS, 0);
    assert!(core.on_local_durable(Seqno(3), 3, 30, 0));
    assert_eq!((core.commit(), core.all_durable()), (Seqno(3), Seqno(3)));
}

#[test]
fn gap_rewinds_and_failure_probes() {
    let mut core = leader();
    probe(&mut core, 2, 0, 0);
    core.on_local_durable(Seqno(20), 20, 200, 1);
    core.on_sent(2, Seqno(1), Seqno(10), 1);
    core.on_sent(2, Seqno(11), Seqno(20), 1);
    core.on_reply(2, ShipReply::Gap { applied: Seqno(0) }, 2).unwrap();
    assert_eq!(core.progress(2).unwrap().next, 1, "rewound to the follower's frontier");
    core.on_reply(2, ShipReply::Failed, 3).unwrap();
    let p = core.progress(2).unwrap();
    assert_eq!((p.mode, p.in_flight, p.next), (ShipMode::Probe, 0, Seqno(1)));
    assert_eq!(core.poll_ship(2, 3), ShipDecision::Idle, "keepalive interval not passed since the last send");
    assert_eq!(core.poll_ship(2, 1_001), ShipDecision::Keepalive);
}

#[test]
fn a_newer_epoch_deposes_the_leader() {
    let mut core = leader();
    core.on_keepalive_sent(2, 0);
    assert_eq!(core.on_reply(2, ShipReply::StaleEpoch { epoch: Epoch(6) }, 1), Err(Epoch(6)));
    core.on_keepalive_sent(3, 0);
    assert_eq!(core.on_reply(3, ShipReply::StaleEpoch { epoch: Epoch(5) }, 1), Ok(false));
}

#[test]
fn far_behind_follower_is_switched_to_catch_up_and_back() {
    let mut core = leader();
    core.on_local_durable(Seqno(1_000), 1_000, 100_000, 0);
    // 100 B a record: 1,000 records behind = 100 KB > 10 KB threshold.
    probe(&mut core, 2, 0, 10);
    assert_eq!(core.progress(2).unwrap().mode, ShipMode::CatchUp);
    assert_eq!(core.poll_ship(2, 20), ShipDecision::Idle);
    assert_eq!(core.poll_ship(2, 2_000), ShipDecision::Keepalive, "catch-up gets nudges, no pushes");
    core.on_keepalive_sent(2, 2_000);
    // It pulled most of it: 96 records (9.6 KB) behind is not yet below 5 KB.
    core.on_reply(2, ShipReply::Applied { applied: Seqno(904) }, 2_100).unwrap();
    assert_eq!(core.progress(2).unwrap().mode, ShipMode::CatchUp);
    core.on_keepalive_sent(2, 3_200);
    core.on_reply(2, ShipReply::Applied { applied: Seqno(990) }, 3_300).unwrap();
    let p = core.progress(2).unwrap();
    assert_eq!((p.mode, p.next), (ShipMode::Push, Seqno(991)));
    assert_eq!(core.poll_ship(2, 3_300), ShipDecision::Send { from: Seqno(991), up_to: Seqno(1_000) });
}

#[test]
fn slow_pushed_follower_falls_back_to_catch_up() {
    let mut core = leader();
    probe(&mut core, 2, 0, 0);
    core.on_local_durable(Seqno(10), 10, 1_000, 1);
    core.on_sent(2, Seqno(1), Seqno(10), 1);
    core.on_local_durable(Seqno(1_000), 1_000, 100_000, 2);
    core.on_reply(2, ShipReply::Applied { applied: Seqno(10) }, 3).unwrap();
    assert_eq!(core.progress(2).unwrap().mode, ShipMode::CatchUp);
}

#[test]
fn lag_in_records_bytes_and_seconds() {
    let mut core = leader();
    probe(&mut core, 2, 0, 0);
    probe(&mut core, 3, 0, 0);
    core.on_local_durable(Seqno(10), 10, 1_000, 1_000_000);
    core.on_local_durable(Seqno(20), 20, 2_000, 2_000_000);
    core.on_reply(3, ShipReply::Applied { applied: Seqno(20) }, 2_000_000).unwrap();
    core.on_keepalive_sent(2, 2_000_000);
    core.on_reply(2, ShipReply::Applied { applied: Seqno(10) }, 2_500_000).unwrap();
    let lag = core.lag(2, 4_000_000).unwrap();
    assert_eq!((lag.records, lag.bytes), (10, 1_000));
    // Record 11 became durable at t=2 s; now is 4 s.
    assert!((lag.flush_seconds - 2.0).abs() < 1e-9, "{lag:?}");
    assert_eq!(lag.write_seconds, lag.apply_seconds);
    // Caught up: zero, not stale, however long ago the last write was.
    let caught_up = core.lag(3, 60_000_000).unwrap();
    assert_eq!((caught_up.records, caught_up.bytes, caught_up.flush_seconds), (0, 0, 0.0));
}

#[test]
fn a_follower_lacking_records_from_before_the_leadership_shows_their_age_from_its_start() {
    // Leader since t=10 s with 100 records durable from an earlier epoch;
    // follower 2 holds 50 of them, follower 3 all.
    let mut core = LeaderCore::new(start(6, 100, 101, 100), &[2, 3], SETTINGS, 10_000_000);
    probe(&mut core, 2, 50, 10_000_000);
    probe(&mut core, 3, 100, 10_000_000);
    // Light load: one append, made durable at t=30 s.
    core.on_local_durable(Seqno(101), 101, 10_100, 30_000_000);
    core.on_reply(3, ShipReply::Applied { applied: Seqno(101) }, 30_000_000).unwrap();
    let lag = core.lag(2, 30_001_000).unwrap();
    assert_eq!(lag.records, 51);
    // Record 51 was durable before the leadership started: at least 20 s
    // old, not the 1 ms of the newest append.
    assert!(lag.flush_seconds >= 20.0, "{lag:?}");
    // And it keeps growing while the follower lacks it.
    assert!(core.lag(2, 40_000_000).unwrap().flush_seconds >= 30.0);
}

#[test]
fn a_dead_follower_costs_a_bounded_ledger_and_keeps_its_time_lag() {
    let mut core = leader();
    probe(&mut core, 2, 0, 0);
    probe(&mut core, 3, 0, 0);
    // Follower 2 answered through 1 (durable at t=1 s), then died; follower
    // 3 keeps up with one group commit per record.
    core.on_local_durable(Seqno(1), 1, 100, 1_000_000);
    core.on_reply(2, ShipReply::Applied { applied: Seqno(1) }, 1_000_000).unwrap();
    core.on_local_durable(Seqno(2), 2, 200, 2_000_000);
    for s in 3..=(4 * LEDGER_CAP as u64) {
        core.on_local_durable(Seqno(s), s, s * 100, 2_000_000 + s);
        core.on_keepalive_sent(3, 2_000_000 + s);
        core.on_reply(3, ShipReply::Applied { applied: Seqno(s) }, 2_000_000 + s).unwrap();
        assert!(core.ledger_len() <= LEDGER_CAP, "ledger grew to {} marks", core.ledger_len());
    }
    // Record 2, the oldest follower 2 lacks, became durable at t=2 s.
    let lag = core.lag(2, 12_000_000).unwrap();
    assert_eq!(lag.records, 4 * LEDGER_CAP as u64 - 1);
    assert!((lag.flush_seconds - 10.0).abs() < 1e-9, "{lag:?}");
    assert_eq!(core.lag(3, 12_000_000).unwrap().flush_seconds, 0.0);
}

#[test]
fn retention_holds_for_followers_up_to_the_hard_bound() {
    let mut core = leader();
    probe(&mut core, 2, 0, 0);
    probe(&mut core, 3, 0, 0);
    core.on_local_durable(Seqno(1_000), 1_000, 100_000, 1);
    core.on_reply(3, ShipReply::Applied { applied: Seqno(1_000) }, 2).unwrap();
    core.on_keepalive_sent(2, 2);
    core.on_reply(2, ShipReply::Applied { applied: Seqno(600) }, 2).unwrap();
    // Readers keep 10 KB (100 records); follower 2 needs 601.. : held.
    assert_eq!(core.plan_retention(10_000, 100_000), RetentionPlan { compact_to: Some(Seqno(601)), reseed: vec![] });
    // Hard bound 20 KB (200 records): discard to 801, follower 2 needs re-seed.
    let plan = core.plan_retention(10_000, 20_000);
    assert_eq!(plan, RetentionPlan { compact_to: Some(Seqno(801)), reseed: vec![2] });
    core.mark_reseed(&plan.reseed);
    core.on_compacted(Seqno(801));
    assert_eq!(core.progress(2).unwrap().mode, ShipMode::NeedsReseed);
    // A re-seed follower no longer holds retention back.
    assert_eq!(core.plan_retention(10_000, 20_000).compact_to, Some(Seqno(901)));
    // Its replies, and its silence, keep it in NeedsReseed while it
    // lacks compacted records.
    core.on_keepalive_sent(2, 3);
    core.on_reply(2, ShipReply::Applied { applied: Seqno(600) }, 3).unwrap();
    assert_eq!(core.progress(2).unwrap().mode, ShipMode::NeedsReseed);
    core.on_keepalive_sent(2, 4);
    core.on_reply(2, ShipReply::Failed, 4).unwrap();
    assert_eq!(core.progress(2).unwrap().mode, ShipMode::NeedsReseed);
}

#[test]
fn older_epoch_records_on_a_majority_commit_without_a_record_of_this_epoch() {
    // Promoted at epoch 4 holding 1..=9 from earlier epochs; an earlier
    // leader had announced commit 6. Every follower reply of this
    // session comes from a replica whose log epoch is 4 (see the module
    // docs), so counting commits the older records at once: a restarted
    // cluster serves what it acknowledged without a new append.
    let mut core = LeaderCore::new(start(4, 9, 10, 6), &[2, 3], SETTINGS, 0);
    assert_eq!(core.commit(), 6, "starts at the handed-over floor");
    probe(&mut core, 2, 7, 1);
    assert_eq!(core.commit(), 7, "7 is durable on the leader and node 2");
    probe(&mut core, 3, 9, 2);
    assert_eq!(core.commit(), 9, "9 is durable on all three");
    core.on_local_durable(Seqno(10), 10, 1_000, 3);
    assert_eq!(core.commit(), 9, "10 is on the leader alone");
}

#[test]
fn older_epoch_records_held_by_a_minority_stay_uncommitted() {
    let mut core = LeaderCore::new(start(4, 9, 10, 0), &[2, 3, 4, 5], SETTINGS, 0);
    probe(&mut core, 2, 9, 1);
    assert_eq!(core.commit(), 0, "two of five is no majority");
    probe(&mut core, 3, 5, 2);
    assert_eq!(core.commit(), 5, "three of five hold 1..=5");
}

fn leased(followers: &[NodeId]) -> LeaderCore {
    let settings = LeaderSettings { lease_us: Some(1_000), ..SETTINGS };
    LeaderCore::new(start(5, 0, 1, 0), followers, settings, 10_000)
}

#[test]
fn a_new_leader_holds_the_lease_from_its_start() {
    let core = leased(&[2, 3]);
    assert!(core.lease_holds(10_999));
    assert!(!core.lease_holds(11_000), "nobody answered within the lease");
}

#[test]
fn the_lease_needs_a_majority_of_recent_positive_replies() {
    let mut core = leased(&[2, 3, 4, 5]);
    probe(&mut core, 2, 0, 20_000);
    assert!(!core.lease_holds(20_001), "the leader and one follower of five are no majority");
    probe(&mut core, 3, 0, 20_500);
    assert!(core.lease_holds(20_999), "three of five answered within the lease");
    assert!(!core.lease_holds(21_000), "the older of the two needed replies is past the lease");
    // Refusals and failures renew nothing.
    assert_eq!(core.poll_ship(4, 21_000), ShipDecision::Keepalive);
    core.on_keepalive_sent(4, 21_000);
    core.on_reply(4, ShipReply::Failed, 21_100).unwrap();
    assert!(!core.lease_holds(21_200));
}

#[test]
fn a_reply_read_after_a_freeze_dates_from_its_request_and_renews_no_lapsed_lease() {
    let mut core = leased(&[2, 3]);
    // Keepalives sent at 10_500; the leader then freezes until 50_000 and
    // reads the replies that waited in its sockets.
    for follower in [2, 3] {
        assert_eq!(core.poll_ship(follower, 10_500), ShipDecision::Keepalive);
        core.on_keepalive_sent(follower, 10_500);
        core.on_reply(follower, ShipReply::Applied { applied: Seqno(0) }, 10_500).unwrap();
    }
    assert!(core.lease_holds(11_499), "the replies show contact as of their requests");
    assert!(!core.lease_holds(50_000), "nothing since: the lease lapsed during the freeze");
    // A later request's reply does renew it, from that request on.
    core.on_keepalive_sent(2, 50_000);
    core.on_reply(2, ShipReply::Applied { applied: Seqno(0) }, 50_000).unwrap();
    assert!(core.lease_holds(50_999));
    // A reply to an older request never moves the contact back.
    core.on_keepalive_sent(2, 40_000);
    core.on_reply(2, ShipReply::Applied { applied: Seqno(0) }, 40_000).unwrap();
    assert!(core.lease_holds(50_999));
}

#[test]
fn a_majority_has_answered_once_any_majority_replied_in_this_leadership() {
    let mut core = leased(&[2, 3, 4, 5]);
    assert!(!core.had_majority(), "nobody answered yet: followers may still be starting");
    probe(&mut core, 2, 0, 20_000);
    assert!(!core.had_majority());
    probe(&mut core, 3, 0, 20_100);
    assert!(core.had_majority(), "three of five");
    assert!(!core.lease_holds(40_000), "long since: the lease lapsed, and CheckQuorum may step it down");
    assert!(leased(&[]).had_majority(), "alone it is its own majority");
}

#[test]
fn a_static_leader_or_a_lone_replica_has_no_lease_bound() {
    let core = LeaderCore::new(start(1, 0, 1, 0), &[2, 3], SETTINGS, 0);
    assert_eq!(core.lease_until(), None);
    assert!(core.lease_holds(u64::MAX));
    assert_eq!(leased(&[]).lease_until(), None, "alone it is its own majority");
}

#[test]
fn commit_floor_never_passes_the_leaders_log() {
    assert_eq!(LeaderCore::new(start(2, 5, 6, 99), &[2], SETTINGS, 0).commit(), 5);
}

#[test]
fn retention_without_data_does_nothing() {
    assert_eq!(leader().plan_retention(0, 0), RetentionPlan::default());
}

/// Acknowledges `f` at `acked` (it must be probed already).
fn ack(core: &mut LeaderCore, f: NodeId, acked: u64, now: u64) {
    core.on_keepalive_sent(f, now);
    core.on_reply(f, ShipReply::Applied { applied: Seqno(acked) }, now).unwrap();
}

#[test]
fn a_learner_is_shipped_to_but_counts_for_no_commit_and_no_all() {
    // Leader 1, voters 1,2,3, learner 4.
    let mut core = leader();
    let change = core.set_members(1, &[1, 2, 3], &[4], &[]);
    assert_eq!(change, MemberChange { added: vec![4], removed: vec![] });
    assert!(core.is_learner(4));
    assert_eq!(core.poll_ship(4, 100), ShipDecision::Keepalive, "a learner is probed like any follower");
    probe(&mut core, 2, 0, 0);
    probe(&mut core, 3, 0, 0);
    core.on_local_durable(Seqno(10), 10, 1_000, 200);
    ack(&mut core, 4, 10, 300);
    assert_eq!(core.commit(), 0, "the leader and a learner are no majority of 1,2,3");
    ack(&mut core, 2, 10, 400);
    assert_eq!(core.commit(), 10);
    assert_eq!(core.all_durable(), 0, "ALL waits for voter 3, not for the learner");
    ack(&mut core, 3, 10, 500);
    assert_eq!(core.all_durable(), 10);
}

#[test]
fn while_joint_a_record_commits_only_on_a_majority_of_both_sets() {
    // Replace 3 by 4: old set 1,2,3, new set 1,2,4; leader 1.
    let mut core = leader();
    core.set_members(1, &[1, 2, 3], &[4], &[]);
    for f in [2, 3, 4] {
        probe(&mut core, f, 0, 0);
    }
    core.on_local_durable(Seqno(10), 10, 1_000, 100);
    let change = core.set_members(1, &[1, 2, 4], &[], &[1, 2, 3]);
    assert_eq!(change, MemberChange::default(), "every member is still shipped to");
    // 1 and 3 hold 10: a majority of the old set, not of the new one.
    ack(&mut core, 3, 10, 200);
    assert_eq!(core.commit(), 0);
    // 1 and 4: a majority of the new set; with 3, of the old one too.
    ack(&mut core, 4, 10, 300);
    assert_eq!(core.commit(), 10);
    ack(&mut core, 2, 10, 350);
    // Past the change: the new set alone, and 3 is dropped.
    core.on_local_durable(Seqno(20), 20, 2_000, 400);
    let change = core.set_members(1, &[1, 2, 4], &[], &[]);
    assert_eq!(change, MemberChange { added: vec![], removed: vec![3] });
    assert_eq!(core.progress(3), None);
    ack(&mut core, 4, 20, 500);
    assert_eq!(core.commit(), 20);
    assert_eq!(core.all_durable(), 10, "ALL counts the new set: 2 lacks 11..=20");
}

#[test]
fn a_joint_leader_needs_the_old_majority_even_when_the_new_one_is_fast() {
    // Add 4 (and 5): old 1,2,3, new 1,2,3,4,5; followers 4 and 5 are fast.
    let mut core = leader();
    core.set_members(1, &[1, 2, 3, 4, 5], &[], &[1, 2, 3]);
    for f in [2, 3, 4, 5] {
        probe(&mut core, f, 0, 0);
    }
    core.on_local_durable(Seqno(7), 7, 700, 100);
    ack(&mut core, 4, 7, 200);
    ack(&mut core, 5, 7, 200);
    assert_eq!(core.commit(), 0, "1,4,5 are a majority of the new set only");
    ack(&mut core, 2, 7, 300);
    assert_eq!(core.commit(), 7);
}

#[test]
fn the_commit_position_never_moves_back_when_the_rule_gets_stricter() {
    let mut core = leader();
    probe(&mut core, 2, 0, 0);
    probe(&mut core, 3, 0, 0);
    core.on_local_durable(Seqno(5), 5, 500, 100);
    ack(&mut core, 2, 5, 200);
    assert_eq!(core.commit(), 5);
    core.set_members(1, &[1, 2, 4], &[], &[1, 2, 3]);
    assert_eq!(core.commit(), 5, "a stricter rule holds the commit, it never takes it back");
}

#[test]
fn a_follower_goes_quiet_only_when_it_holds_everything_and_knows_the_commit() {
    let mut core = leader();
    assert!(!core.may_go_quiet(2, Seqno(0)), "a probed follower's position is unknown");
    probe(&mut core, 2, 0, 1_000);
    probe(&mut core, 3, 0, 1_000);
    assert!(core.may_go_quiet(2, Seqno(0)), "nothing written, it holds all");

    core.on_local_written(Seqno(3));
    assert!(!core.may_go_quiet(2, Seqno(0)), "written records it lacks");
    core.on_local_durable(Seqno(3), 3, 300, 2_000);
    assert_eq!(core.poll_ship(2, 2_000), ShipDecision::Send { from: Seqno(1), up_to: Seqno(3) });
    core.on_sent(2, Seqno(1), Seqno(3), 2_000);
    assert!(!core.may_go_quiet(2, Seqno(0)), "in flight");
    core.on_reply(2, ShipReply::Applied { applied: Seqno(3) }, 2_000).unwrap();
    assert_eq!(core.commit(), Seqno(3));
    assert!(!core.may_go_quiet(2, Seqno(0)), "it was not told the commit yet");
    assert!(core.may_go_quiet(2, Seqno(3)));
    assert!(!core.may_go_quiet(3, Seqno(3)), "follower 3 lacks the records");

    core.on_reply(2, ShipReply::Failed, 2_100).unwrap_or_default();
    assert!(!core.may_go_quiet(2, Seqno(3)), "a failed call puts it back to probing");
    assert!(!core.may_go_quiet(9, Seqno(3)), "not a follower");
}

#[test]
fn a_node_keepalive_answer_counts_as_contact_for_the_lease_and_nothing_else() {
    let settings = LeaderSettings { lease_us: Some(1_000), ..SETTINGS };
    let mut core = LeaderCore::new(start(5, 0, 1, 0), &[2, 3], settings, 0);
    probe(&mut core, 2, 0, 100);
    assert_eq!(core.lease_until(), Some(1_100));
    core.on_node_contact(2, 5_000);
    assert_eq!(core.lease_until(), Some(6_000), "renewed from when the node keepalive was sent");
    core.on_node_contact(2, 4_000);
    assert_eq!(core.lease_until(), Some(6_000), "an older contact never moves the lease back");
    let before = core.progress(2).unwrap();
    assert_eq!((before.acked, before.mode, before.in_flight), (Seqno(0), ShipMode::Push, 0));
    core.on_node_contact(9, 9_000);
    assert_eq!(core.lease_until(), Some(6_000), "an unknown node is no contact");
}

#[test]
fn a_keepalive_is_due_an_interval_after_the_last_request() {
    let mut core = leader();
    assert_eq!(core.keepalive_due_at(2), Some(0), "never sent: due now");
    core.on_keepalive_sent(2, 5_000);
    assert_eq!(core.keepalive_due_at(2), Some(5_000 + SETTINGS.probe_us));
    core.on_reply(2, ShipReply::Applied { applied: Seqno(0) }, 5_000).unwrap();
    assert_eq!(core.keepalive_due_at(2), Some(5_000 + SETTINGS.keepalive_us));
    assert_eq!(core.keepalive_due_at(9), None);
}

#[test]
fn quiet_followers_hold_the_lease_only_as_a_majority_of_voters() {
    let settings = LeaderSettings { lease_us: Some(1_000), ..SETTINGS };
    let core = LeaderCore::new(start(5, 0, 1, 0), &[2, 3], settings, 0);
    assert!(core.lease_held_by([2].into_iter()), "one follower and the leader are a majority of three");
    assert!(!core.lease_held_by(std::iter::empty()));
    assert!(!core.lease_held_by([9].into_iter()), "not a follower");
    let five = LeaderCore::new(start(5, 0, 1, 0), &[2, 3, 4, 5], settings, 0);
    assert!(!five.lease_held_by([2].into_iter()), "five replicas need two followers");
    assert!(five.lease_held_by([2, 4].into_iter()));
    assert!(leader().lease_held_by(std::iter::empty()), "no lease, nothing to hold");
}

#[test]
fn a_majority_of_nodes_answering_anything_keeps_a_lapsed_leader_waiting() {
    let core = leased(&[2, 3]);
    let answered = |at: &'static [(NodeId, u64)]| move |n: NodeId| at.iter().find(|(m, _)| *m == n).map(|(_, t)| *t);
    assert!(!core.nodes_reach_majority(answered(&[]), 5_000), "no node answered: cut off, step down");
    assert!(core.nodes_reach_majority(answered(&[(3, 5_000)]), 5_000), "one follower node of two answers: a majority");
    assert!(!core.nodes_reach_majority(answered(&[(2, 4_999), (3, 1_000)]), 5_000), "answers older than the window");
    let five = leased(&[2, 3, 4, 5]);
    assert!(!five.nodes_reach_majority(answered(&[(2, 9_000)]), 5_000), "two of five is no majority");
    assert!(five.nodes_reach_majority(answered(&[(2, 9_000), (5, 6_000)]), 5_000), "three of five");
    // A learner's node answering counts for nothing: it votes nowhere.
    let mut with_learner = leader();
    with_learner.set_members(1, &[1, 2, 3], &[4], &[]);
    assert!(!with_learner.nodes_reach_majority(answered(&[(4, 9_000)]), 5_000));
    assert!(with_learner.nodes_reach_majority(answered(&[(4, 9_000), (2, 9_000)]), 5_000));
}
