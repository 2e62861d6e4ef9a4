//! Unit tests of the replica's role and epoch rules: each feeds events to a
//! [`ReplicaCore`] and asserts the commands or the refusal.

use super::*;
use crate::core::{Epoch, Seqno};

const ME: NodeId = 1;

/// A coordinated replica on node 1 of {1, 2, 3} that restarted having
/// promised `promised`.
fn replica(promised: u64) -> ReplicaCore {
    ReplicaCore::new(ME, vec![1, 2, 3], true, Epoch(promised))
}

/// A replica following node 2 in `epoch`, reconciled with it.
fn following(epoch: u64) -> ReplicaCore {
    let mut r = replica(0);
    r.assign(Epoch(epoch), 2).unwrap();
    r.repaired(Epoch(epoch));
    r
}

/// A replica leading `epoch`.
fn leading(epoch: u64) -> ReplicaCore {
    let mut r = replica(0);
    assert_eq!(
        r.assign(Epoch(epoch), ME).unwrap(),
        vec![Command::PersistEpoch(Epoch(epoch)), Command::StopLeading, Command::StartLeading { epoch: Epoch(epoch) }]
    );
    r.started_leading(Epoch(epoch));
    r
}

#[test]
fn a_restarted_replica_waits_unassigned_in_its_promised_epoch() {
    let r = replica(4);
    assert_eq!(r.view(), View { role: Role::Unassigned, epoch: Epoch(4) });
    assert_eq!(r.promised(), Epoch(4));
    assert!(r.needs_new_epoch());
    assert!(!replica(0).needs_new_epoch(), "a fresh replica led nothing");
    assert!(!ReplicaCore::new(ME, vec![1, 2, 3], false, Epoch(4)).needs_new_epoch(), "static clusters never move");
}

#[test]
fn fence_promises_the_epoch_first_and_stops_leading() {
    let mut r = leading(3);
    assert_eq!(r.fence(Epoch(5)).unwrap(), vec![Command::PersistEpoch(Epoch(5)), Command::StopLeading]);
    assert_eq!(r.view(), View { role: Role::Unassigned, epoch: Epoch(5) });
    assert_eq!(r.promised(), Epoch(5));
}

#[test]
fn fence_at_the_leading_epoch_stops_leading_without_a_new_promise() {
    let mut r = leading(3);
    assert_eq!(r.fence(Epoch(3)).unwrap(), vec![Command::StopLeading]);
    assert_eq!(r.view().role, Role::Unassigned);
}

#[test]
fn fence_at_a_followers_current_epoch_changes_nothing() {
    let mut r = following(3);
    assert_eq!(r.fence(Epoch(3)).unwrap(), vec![]);
    assert_eq!(r.view(), View { role: Role::Follower { leader: 2 }, epoch: Epoch(3) });
}

#[test]
fn an_older_fence_assign_or_shipment_is_refused_and_changes_nothing() {
    let mut r = following(5);
    let before = r.clone().view();
    assert_eq!(r.fence(Epoch(4)), Err(Refusal::StaleEpoch { epoch: Epoch(4), seen: Epoch(5) }));
    assert_eq!(r.assign(Epoch(4), 3), Err(Refusal::StaleEpoch { epoch: Epoch(4), seen: Epoch(5) }));
    assert_eq!(r.inbound(Epoch(4), 2).outcome, Err(Refusal::StaleEpoch { epoch: Epoch(4), seen: Epoch(5) }));
    assert_eq!(r.view(), before);
    assert_eq!(r.promised(), Epoch(5));
}

#[test]
fn assign_to_a_node_outside_the_replica_set_is_refused() {
    let mut r = replica(0);
    assert_eq!(r.assign(Epoch(2), 9), Err(Refusal::NotAReplica { node: 9 }));
    assert_eq!(r.promised(), Epoch(0), "nothing promised");
}

#[test]
fn assign_is_idempotent_for_the_current_view() {
    let mut r = following(3);
    assert_eq!(r.assign(Epoch(3), 2).unwrap(), vec![]);
    let mut l = leading(3);
    assert_eq!(l.assign(Epoch(3), ME).unwrap(), vec![]);
}

#[test]
fn a_leader_is_a_leader_only_once_the_shell_says_it_leads() {
    let mut r = replica(0);
    r.assign(Epoch(2), ME).unwrap();
    assert_eq!(r.view().role, Role::Unassigned, "not yet: its leader state is not in place");
    r.started_leading(Epoch(1));
    assert_eq!(r.view().role, Role::Unassigned, "a stale report changes nothing");
    r.started_leading(Epoch(2));
    assert_eq!(r.view(), View { role: Role::Leader, epoch: Epoch(2) });
}

#[test]
fn a_report_of_leading_after_a_newer_promise_is_ignored() {
    let mut r = replica(0);
    r.assign(Epoch(2), ME).unwrap();
    r.fence(Epoch(3)).unwrap();
    r.started_leading(Epoch(2));
    assert_eq!(r.view(), View { role: Role::Unassigned, epoch: Epoch(3) });
}

#[test]
fn following_starts_a_catch_up() {
    let mut r = replica(0);
    assert_eq!(
        r.assign(Epoch(2), 3).unwrap(),
        vec![Command::PersistEpoch(Epoch(2)), Command::StopLeading, Command::CatchUp]
    );
    assert_eq!(r.view(), View { role: Role::Follower { leader: 3 }, epoch: Epoch(2) });
    assert_eq!(r.catch_up_source(), Some((3, Epoch(2))));
}

#[test]
fn under_a_coordinator_a_replica_never_leads_the_epoch_it_restarted_in() {
    let mut r = replica(4);
    assert_eq!(r.assign(Epoch(4), ME), Err(Refusal::RestartedEpoch { epoch: Epoch(4) }));
    assert_eq!(r.view().role, Role::Unassigned);
    assert_eq!(r.assign(Epoch(4), 2).unwrap().last(), Some(&Command::CatchUp), "it may follow in it");
    assert!(r.needs_new_epoch());
    assert!(r.assign(Epoch(5), ME).is_ok(), "a newer epoch is fine");
    assert!(!r.needs_new_epoch());
}

#[test]
fn a_static_replica_leads_the_epoch_it_restarted_in() {
    let mut r = ReplicaCore::new(ME, vec![1, 2, 3], false, Epoch(1));
    assert!(r.assign(Epoch(1), ME).is_ok());
}

#[test]
fn a_shipment_in_the_followed_epoch_is_admitted_once_reconciled() {
    let mut r = following(3);
    assert_eq!(r.inbound(Epoch(3), 2), Admission { commands: vec![], outcome: Ok(()) });
}

#[test]
fn a_shipment_before_reconciling_is_refused_as_retryable_and_asks_for_a_catch_up() {
    let mut r = replica(0);
    r.assign(Epoch(3), 2).unwrap();
    let a = r.inbound(Epoch(3), 2);
    assert_eq!(a.commands, vec![Command::CatchUp]);
    assert_eq!(a.outcome, Err(Refusal::Reconciling { epoch: Epoch(3) }));
    assert!(Refusal::Reconciling { epoch: Epoch(3) }.retryable());
    r.repaired(Epoch(3));
    assert_eq!(r.inbound(Epoch(3), 2).outcome, Ok(()));
}

#[test]
fn a_shipment_from_another_node_in_the_followed_epoch_is_refused() {
    let mut r = following(3);
    assert_eq!(r.inbound(Epoch(3), 3).outcome, Err(Refusal::WrongLeader { from: 3, leader: 2 }));
    assert_eq!(r.view().role, Role::Follower { leader: 2 });
}

#[test]
fn a_leader_refuses_shipments_of_its_own_or_an_older_epoch() {
    let mut r = leading(3);
    assert_eq!(r.inbound(Epoch(3), 2).outcome, Err(Refusal::NotFollower));
    assert_eq!(r.view().role, Role::Leader);
}

#[test]
fn a_shipment_from_a_newer_leader_is_followed_then_reconciled() {
    let mut r = leading(3);
    let a = r.inbound(Epoch(4), 2);
    assert_eq!(a.commands, vec![Command::PersistEpoch(Epoch(4)), Command::StopLeading, Command::CatchUp]);
    assert_eq!(a.outcome, Err(Refusal::Reconciling { epoch: Epoch(4) }));
    assert_eq!(r.view(), View { role: Role::Follower { leader: 2 }, epoch: Epoch(4) });
}

#[test]
fn a_fenced_replica_follows_the_leader_of_the_epoch_it_was_fenced_at() {
    let mut r = following(3);
    r.fence(Epoch(4)).unwrap();
    r.repaired(Epoch(4));
    let a = r.inbound(Epoch(4), 3);
    assert_eq!(a.commands, vec![Command::StopLeading, Command::CatchUp]);
    assert_eq!(a.outcome, Ok(()));
    assert_eq!(r.view(), View { role: Role::Follower { leader: 3 }, epoch: Epoch(4) });
}

#[test]
fn a_shipment_from_outside_the_replica_set_or_from_itself_is_refused() {
    let mut r = replica(0);
    assert_eq!(r.inbound(Epoch(2), 9).outcome, Err(Refusal::ForeignLeader { node: 9 }));
    assert_eq!(r.inbound(Epoch(2), ME).outcome, Err(Refusal::ForeignLeader { node: ME }));
    assert_eq!(r.promised(), Epoch(0));
}

#[test]
fn a_newer_epoch_in_a_reply_deposes_the_leader_once() {
    let mut r = leading(3);
    assert_eq!(r.deposed(Epoch(5)), vec![Command::PersistEpoch(Epoch(5)), Command::StopLeading]);
    assert_eq!(r.view(), View { role: Role::Unassigned, epoch: Epoch(5) });
    assert_eq!(r.deposed(Epoch(5)), vec![], "already there");
    assert_eq!(r.deposed(Epoch(4)), vec![], "older news");
}

#[test]
fn a_paused_follower_refuses_shipments_and_a_leader_cannot_be_paused() {
    let mut r = following(3);
    assert_eq!(r.pause(true).unwrap(), vec![]);
    assert_eq!(r.inbound(Epoch(3), 2).outcome, Err(Refusal::Paused));
    assert_eq!(r.catch_up_source(), None);
    assert_eq!(r.pause(false).unwrap(), vec![Command::CatchUp]);
    assert_eq!(r.inbound(Epoch(3), 2).outcome, Ok(()));
    assert_eq!(leading(3).pause(true), Err(Refusal::LeaderCannotPause));
}

/// A full disk changes no role: a full follower still admits its leader's
/// shipments (its WAL refuses the records it has no room for, not the
/// keepalives and commit positions) and still takes a leadership it is
/// assigned (the coordinator assigns a full replica only when no healthy one
/// holds every acknowledged record); room again starts a catch-up.
#[test]
fn a_full_disk_takes_its_assignments_and_shipments_and_catches_up_when_room_returns() {
    let mut r = following(3);
    assert_eq!(r.disk(true), vec![]);
    assert_eq!(r.inbound(Epoch(3), 2).outcome, Ok(()));
    assert!(r.follows(Epoch(3), 2), "a quiet shard's node keepalive is enough");
    assert_eq!(r.disk(false), vec![Command::CatchUp], "room again: fetch what was refused");
    r.disk(true);
    assert_eq!(
        r.assign(Epoch(4), ME).unwrap(),
        vec![Command::PersistEpoch(Epoch(4)), Command::StopLeading, Command::StartLeading { epoch: Epoch(4) }]
    );
    r.started_leading(Epoch(4));
    assert_eq!(r.view().role, Role::Leader);
    assert_eq!(r.disk(false), vec![], "a leader has nothing to catch up");
}

#[test]
fn a_full_disk_leaves_a_leader_leading_until_the_coordinator_moves_it() {
    let mut r = leading(3);
    assert_eq!(r.disk(true), vec![]);
    assert_eq!(r.view().role, Role::Leader);
    assert!(r.disk_full());
}

#[test]
fn a_follower_truncates_a_corrupt_tail_and_refetches_it() {
    let mut r = following(3);
    assert_eq!(r.corruption_found(Seqno(40)), vec![Command::Truncate { keep_through: Seqno(39) }, Command::CatchUp]);
    assert_eq!(r.corrupt_from(), Some(Seqno(40)));
    assert_eq!(
        r.corruption_found(Seqno(55)),
        vec![Command::Truncate { keep_through: Seqno(39) }, Command::CatchUp],
        "the first damage rules"
    );
    r.corruption_repaired();
    assert_eq!(r.corrupt_from(), None);
}

#[test]
fn a_leader_keeps_a_corrupt_log_and_reports_it() {
    let mut r = leading(3);
    assert_eq!(r.corruption_found(Seqno(7)), vec![]);
    assert_eq!(r.corrupt_from(), Some(Seqno(7)));
    assert_eq!(r.view().role, Role::Leader);
    // Once moved to follower, the damage is truncated and refetched.
    assert_eq!(r.fence(Epoch(4)).unwrap(), vec![Command::PersistEpoch(Epoch(4)), Command::StopLeading]);
    assert_eq!(r.corruption_found(Seqno(7)), vec![]);
    r.assign(Epoch(4), 2).unwrap();
    assert_eq!(r.corruption_found(Seqno(7)), vec![Command::Truncate { keep_through: Seqno(6) }, Command::CatchUp]);
}

#[test]
fn a_leader_without_a_majority_steps_down_and_leads_again_only_in_a_newer_epoch() {
    let mut r = leading(3);
    assert!(!r.needs_new_epoch());
    assert_eq!(r.quorum_lost(Epoch(3)), vec![Command::StopLeading]);
    assert_eq!(r.view(), View { role: Role::Unassigned, epoch: Epoch(3) });
    assert!(r.needs_new_epoch(), "heartbeats ask the coordinator for a new epoch");
    assert_eq!(r.assign(Epoch(3), ME), Err(Refusal::SteppedDown { epoch: Epoch(3) }));
    assert!(r.assign(Epoch(3), 2).is_ok(), "it may follow in that epoch");
    assert!(r.assign(Epoch(4), ME).is_ok());
    assert!(!r.needs_new_epoch());
}

#[test]
fn a_stale_quorum_loss_changes_nothing() {
    let mut r = leading(3);
    assert_eq!(r.quorum_lost(Epoch(2)), vec![], "an older leadership's timer");
    assert_eq!(following(3).quorum_lost(Epoch(3)), vec![], "not leading");
    assert_eq!(r.view().role, Role::Leader);
}

#[test]
fn a_quiet_shard_is_followed_only_in_its_exact_epoch_from_its_leader_while_healthy() {
    let r = following(4);
    assert!(r.follows(Epoch(4), 2));
    assert!(!r.follows(Epoch(3), 2), "an older epoch");
    assert!(!r.follows(Epoch(5), 2), "a newer epoch it was not told of: the shard must ship to say it");
    assert!(!r.follows(Epoch(4), 3), "another node");

    let mut fenced = following(4);
    fenced.fence(Epoch(6)).unwrap();
    assert!(!fenced.follows(Epoch(4), 2), "fenced past the quiet epoch");

    let mut reconciling = replica(0);
    reconciling.assign(Epoch(4), 2).unwrap();
    assert!(!reconciling.follows(Epoch(4), 2), "its log is not reconciled with that leader yet");

    let mut paused = following(4);
    paused.pause(true).unwrap();
    assert!(!paused.follows(Epoch(4), 2), "paused");

    let mut full = following(4);
    full.disk(true);
    assert!(full.follows(Epoch(4), 2), "a full disk still follows");

    assert!(!leading(4).follows(Epoch(4), 2), "a leader follows nobody");
    assert!(!replica(4).follows(Epoch(4), 2), "unassigned");

    // `follows` is a question: it changes nothing.
    let before = following(4);
    let _ = before.follows(Epoch(9), 3);
    assert_eq!(before.view(), following(4).view());
    assert_eq!(before.promised(), Epoch(4));
}

#[test]
fn a_replica_whose_promise_may_be_lost_takes_nothing_from_a_leader_until_the_coordinator_speaks() {
    // Its WAL's recovery cut records, maybe a promise of epoch 7 with them:
    // it read back 5. A leader of epoch 6, deposed since, ships to it.
    let mut r = replica(5);
    r.promise_lost();
    let admission = r.inbound(Epoch(6), 2);
    assert_eq!(admission, Admission { commands: Vec::new(), outcome: Err(Refusal::AwaitingAssignment) });
    assert!(Refusal::AwaitingAssignment.retryable());
    assert_eq!(r.promised(), Epoch(5), "nothing promised to that leader");
    assert!(!r.follows(Epoch(5), 2));
    // The coordinator's fence (a newer epoch than any it handed out) ends
    // the wait; the next leader's shipments are taken as usual.
    assert_eq!(r.fence(Epoch(8)).unwrap()[0], Command::PersistEpoch(Epoch(8)));
    assert_eq!(r.inbound(Epoch(6), 2).outcome, Err(Refusal::StaleEpoch { epoch: Epoch(6), seen: Epoch(8) }));
    assert!(r.inbound(Epoch(8), 2).commands.contains(&Command::CatchUp));
    // An assignment ends it as well.
    let mut r = replica(5);
    r.promise_lost();
    r.assign(Epoch(8), 2).unwrap();
    r.repaired(Epoch(8));
    assert_eq!(r.inbound(Epoch(8), 2).outcome, Ok(()));
    // A static cluster has no coordinator to wait for.
    let mut r = ReplicaCore::new(ME, vec![1, 2, 3], false, Epoch(1));
    r.promise_lost();
    assert_ne!(r.inbound(Epoch(1), 2).outcome, Err(Refusal::AwaitingAssignment));
}

#[test]
fn an_epoch_past_the_ceiling_is_refused_everywhere_and_promises_nothing() {
    // A forged u64::MAX, promised, would refuse every epoch after it: the
    // shard could never fail over again.
    let huge = Epoch(Epoch::CEILING);
    let mut r = replica(5);
    assert_eq!(r.fence(huge), Err(Refusal::EpochTooLarge { epoch: huge }));
    assert_eq!(r.assign(Epoch(u64::MAX), 2), Err(Refusal::EpochTooLarge { epoch: Epoch(u64::MAX) }));
    assert_eq!(r.inbound(huge, 2).outcome, Err(Refusal::EpochTooLarge { epoch: huge }));
    assert_eq!(r.promised(), Epoch(5), "nothing promised");
    assert!(r.fence(Epoch(Epoch::CEILING - 1)).is_ok(), "the largest epoch is still taken");
}

/// Whatever changes an answer of `follows` changes `follows_inputs` (the
/// node skips re-checking its quiet shards while those stay equal); an
/// admitted shipment or a disk report leaves them.
#[test]
fn every_change_to_what_follows_answers_changes_its_inputs() {
    let r = following(3);
    let before = r.follows_inputs();
    assert!(r.follows(Epoch(3), 2));
    type Change = fn(&mut ReplicaCore);
    let changes: Vec<(&str, Change)> = vec![
        ("a fence", |r| _ = r.fence(Epoch(4))),
        ("a pause", |r| _ = r.pause(true)),
        ("a lost promise", |r| r.promise_lost()),
        ("an assignment to lead", |r| _ = r.assign(Epoch(4), ME)),
        ("a shipment of a newer leader", |r| _ = r.inbound(Epoch(5), 3)),
    ];
    for (what, change) in changes {
        let mut r = following(3);
        change(&mut r);
        assert!(!r.follows(Epoch(3), 2), "{what}");
        assert_ne!(r.follows_inputs(), before, "{what}");
    }
    let mut r = following(3);
    assert_eq!(r.inbound(Epoch(3), 2).outcome, Ok(()));
    assert_eq!(r.disk(false), vec![]);
    r.disk(true);
    assert_eq!(r.follows_inputs(), before, "an admitted shipment and a disk report");
    assert!(r.follows(Epoch(3), 2));
}
