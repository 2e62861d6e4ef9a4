//! Unit tests of a node's heartbeat reports: what makes a report change,
//! when full reports go out.

use super::*;

/// `same_report` (field by field) answers as comparing the reports'
/// `comparable` forms (what the node's digest hashes), for a change of
/// every field, moving or not.
#[test]
fn same_report_agrees_with_the_comparable_forms_for_every_field() {
    let base = HeartbeatRequest {
        shard_id: 7,
        region_id: 1,
        entity_count: 3,
        signal_throughput_eps: 2.5,
        disk_bytes: 100,
        replication_lag: [(2, 5), (3, 0)].into_iter().collect(),
        last_heartbeat_ns: 11,
        node_id: 1,
        epoch: 4,
        last_seqno: 10,
        durable_seqno: 9,
        commit_seqno: 8,
        is_leader: true,
        leader_node_id: 1,
        last_epoch: 4,
        replication_lag_bytes: [(2, 50), (3, 0)].into_iter().collect(),
        replication_lag_seconds: [(2, 0.5)].into_iter().collect(),
        needs_new_epoch: false,
        disk_full: false,
        disk_free_bytes: 1_000,
        corrupt_from_seqno: 0,
        leader_silent_ms: 100,
        follower_silent_ms: [(2, 100), (3, 40)].into_iter().collect(),
        uptime_ms: 5_000,
        archiving: false,
        archived_seqno: 6,
        archive_lag_seconds: 1.2,
        producers: 2,
        producer_duplicates: 0,
    };
    type Change = fn(&mut HeartbeatRequest);
    let changes: &[(&str, Change)] = &[
        ("shard_id", |r| r.shard_id += 1),
        ("region_id", |r| r.region_id += 1),
        ("entity_count", |r| r.entity_count += 1),
        ("signal_throughput_eps", |r| r.signal_throughput_eps += 1.0),
        ("disk_bytes", |r| r.disk_bytes += 1),
        ("replication_lag", |r| _ = r.replication_lag.insert(2, 6)),
        ("replication_lag, a follower more", |r| _ = r.replication_lag.insert(4, 0)),
        ("last_heartbeat_ns", |r| r.last_heartbeat_ns += 1),
        ("node_id", |r| r.node_id += 1),
        ("epoch", |r| r.epoch += 1),
        ("last_seqno", |r| r.last_seqno += 1),
        ("durable_seqno", |r| r.durable_seqno += 1),
        ("commit_seqno", |r| r.commit_seqno += 1),
        ("is_leader", |r| r.is_leader = false),
        ("leader_node_id", |r| r.leader_node_id = 2),
        ("last_epoch", |r| r.last_epoch += 1),
        ("replication_lag_bytes", |r| _ = r.replication_lag_bytes.insert(3, 1)),
        ("replication_lag_seconds", |r| _ = r.replication_lag_seconds.insert(3, 9.0)),
        ("needs_new_epoch", |r| r.needs_new_epoch = true),
        ("disk_full", |r| r.disk_full = true),
        ("disk_free_bytes", |r| r.disk_free_bytes -= 1),
        ("corrupt_from_seqno", |r| r.corrupt_from_seqno = 3),
        ("leader_silent_ms within its class", |r| r.leader_silent_ms = 120),
        ("leader_silent_ms to the next class", |r| r.leader_silent_ms = 250),
        ("leader_silent_ms past the timeout", |r| r.leader_silent_ms = 601),
        ("follower_silent_ms within its class", |r| _ = r.follower_silent_ms.insert(3, 0)),
        ("follower_silent_ms a quarter second on", |r| _ = r.follower_silent_ms.insert(3, 260)),
        ("follower_silent_ms past the timeout", |r| _ = r.follower_silent_ms.insert(3, 601)),
        ("follower_silent_ms, a follower more", |r| _ = r.follower_silent_ms.insert(4, 0)),
        ("follower_silent_ms, a follower less", |r| _ = r.follower_silent_ms.remove(&3)),
        ("uptime_ms", |r| r.uptime_ms += 1),
        ("archiving", |r| r.archiving = true),
        ("archived_seqno", |r| r.archived_seqno += 1),
        ("archive_lag_seconds within its second", |r| r.archive_lag_seconds = 1.9),
        ("archive_lag_seconds to the next second", |r| r.archive_lag_seconds = 2.1),
        ("producers", |r| r.producers += 1),
        ("producer_duplicates", |r| r.producer_duplicates += 1),
    ];
    assert!(same_report(&base, &base.clone(), 600));
    let mut moved = 0;
    for (what, change) in changes {
        let mut other = base.clone();
        change(&mut other);
        let by_forms = comparable(&base, 600) == comparable(&other, 600);
        assert_eq!(same_report(&base, &other, 600), by_forms, "{what}");
        assert_eq!(same_report(&other, &base, 600), by_forms, "{what}, the other way");
        moved += usize::from(!by_forms);
    }
    assert_eq!(moved, 27, "the changes a report must tell apart");
}

#[test]
fn reports_that_say_the_same_share_a_digest_and_changes_do_not() {
    let report = |silent: &[(u32, u64)], uptime_ms: u64| HeartbeatRequest {
        shard_id: 7,
        uptime_ms,
        follower_silent_ms: silent.iter().copied().collect(),
        replication_lag: [(2, 5), (3, 0)].into_iter().collect(),
        ..Default::default()
    };
    let base = report_digest(&report(&[(2, 100), (3, 40)], 1), 600);
    // Map entries in another order, a clock moved, a follower's silence
    // moving within the timeout: the same.
    assert_eq!(report_digest(&report(&[(3, 40), (2, 100)], 9_000), 600), base);
    assert_eq!(report_digest(&report(&[(2, 240), (3, 0)], 1), 600), base);
    assert_eq!(report_digest(&report(&[(2, 600), (3, 40)], 1), 600), base);
    // A follower's silence past the timeout, a follower more: changed.
    assert_ne!(report_digest(&report(&[(2, 601), (3, 40)], 1), 600), base);
    assert_ne!(report_digest(&report(&[(2, 100), (3, 40), (4, 0)], 1), 600), base);
    let mut lagging = report(&[(2, 100), (3, 40)], 1);
    lagging.replication_lag.insert(3, 1);
    assert_ne!(report_digest(&lagging, 600), base);
}

#[test]
fn costly_full_reports_go_less_often_within_a_bound() {
    let least = Duration::from_secs(2);
    assert_eq!(full_report_every(Duration::from_millis(3), 4, least), least);
    assert_eq!(full_report_every(Duration::from_millis(3), 1_000, least), least);
    assert_eq!(full_report_every(Duration::from_millis(40), 10, least), Duration::from_secs(4), "1 % of a core");
    assert_eq!(full_report_every(Duration::from_millis(3), 10_000, least), Duration::from_secs(5), "2,000 a second");
    assert_eq!(full_report_every(Duration::from_millis(60), 10_000, least), Duration::from_secs(6));
    assert_eq!(full_report_every(Duration::from_secs(1), 10, least), MAX_FULL_HEARTBEAT_EVERY);
    assert_eq!(full_report_every(Duration::ZERO, 100_000, least), MAX_FULL_HEARTBEAT_EVERY);
    // A configured shortest wait past the bound is the wait.
    let hour = Duration::from_secs(3_600);
    assert_eq!(full_report_every(Duration::from_secs(1), 10, hour), hour);
}

#[test]
fn a_report_changes_with_positions_and_roles_not_with_clocks() {
    let base =
        HeartbeatRequest { shard_id: 1, node_id: 2, durable_seqno: 10, leader_silent_ms: 40, ..Default::default() };
    let ticked = HeartbeatRequest {
        last_heartbeat_ns: 123,
        uptime_ms: 999,
        disk_bytes: 5,
        disk_free_bytes: 6,
        signal_throughput_eps: 1.5,
        leader_silent_ms: 180,
        ..base.clone()
    };
    assert!(same_report(&base, &ticked, 600), "clocks and disk figures alone change nothing");
    assert!(!same_report(&base, &HeartbeatRequest { durable_seqno: 11, ..base.clone() }, 600));
    assert!(!same_report(&base, &HeartbeatRequest { is_leader: true, ..base.clone() }, 600));
    assert!(!same_report(&base, &HeartbeatRequest { epoch: 3, ..base.clone() }, 600));
    assert!(!same_report(&base, &HeartbeatRequest { disk_full: true, ..base.clone() }, 600));
    assert!(
        !same_report(&base, &HeartbeatRequest { leader_silent_ms: 900, ..base.clone() }, 600),
        "a leader going silent"
    );
    // A silence crossing the replication timeout (600 ms) within its
    // quarter second changes the report: the coordinator's rules
    // compare silences with the timeout, and must see it crossed at
    // the next tick, not at 750 ms.
    let silent = |ms: u64| HeartbeatRequest { leader_silent_ms: ms, ..base.clone() };
    assert!(same_report(&silent(500), &silent(600), 600));
    assert!(!same_report(&silent(600), &silent(601), 600), "past the timeout");
    assert!(same_report(&silent(601), &silent(749), 600));
    assert!(!same_report(&silent(749), &silent(750), 600));
    assert!(!same_report(&silent(100), &silent(101), 100), "the timeout as configured");
}
