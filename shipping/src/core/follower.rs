//! How a follower replica classifies an inbound `ShipSegment` (or a catch-up
//! stream chunk) against what it already holds.
//!
//! Invariants kept here:
//! * a segment from an epoch older than the newest the follower has seen is
//!   refused (fencing: a deposed leader can change nothing);
//! * a segment is applied only where it continues the follower's log without
//!   a gap; what the follower already holds is skipped, never re-applied;
//! * a gap is refused (the caller starts catch-up), not papered over.

use super::{Epoch, Seqno};

/// What the follower already holds of the shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FollowerView {
    /// Newest epoch seen from any leader of this shard.
    pub epoch_seen: Epoch,
    /// The next seqno this follower will accept: one past everything applied
    /// or queued for the WAL.
    pub next_expected: Seqno,
    /// The contiguous durable frontier (what it reports as `applied_seqno`).
    pub durable: Seqno,
}

/// The parts of a segment the decision needs (already decoded and verified).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InboundSegment {
    pub epoch: Epoch,
    /// `None` for a keepalive / nudge that carries no records.
    pub range: Option<(Seqno, Seqno)>,
    /// The leader's durable position when it sent this.
    pub leader_last_seq: Seqno,
}

/// The follower's decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inbound {
    /// Older epoch than the newest seen: refuse, apply nothing.
    StaleEpoch { seen: Epoch },
    /// No records. `behind`: the leader holds durable records this follower
    /// lacks, so it should pull them (catch-up).
    Keepalive { behind: bool },
    /// Everything in it is already held: acknowledge, apply nothing.
    Duplicate,
    /// Apply the segment's frames after skipping the first `skip` (already held).
    Apply { skip: usize },
    /// It starts past `expected`: refuse and catch up.
    Gap { expected: Seqno },
}

/// Classifies an inbound segment. Pure: the caller applies the decision and,
/// for a newer epoch, records it as seen.
pub fn classify(view: FollowerView, segment: InboundSegment) -> Inbound {
    if segment.epoch < view.epoch_seen {
        return Inbound::StaleEpoch { seen: view.epoch_seen };
    }
    let Some((first, last)) = segment.range else {
        return Inbound::Keepalive { behind: segment.leader_last_seq >= view.next_expected };
    };
    if last < view.next_expected {
        Inbound::Duplicate
    } else if first > view.next_expected {
        Inbound::Gap { expected: view.next_expected }
    } else {
        Inbound::Apply { skip: view.next_expected.since(first) as usize }
    }
}

/// Checks a `ShipSegmentRequest`'s envelope against the segment it carries.
/// Returns what is wrong, for an `INVALID_ARGUMENT` answer.
pub fn check_envelope(
    id_shard: u32,
    id_seqno: u64,
    event_count: u64,
    leader_last_seq: u64,
    segment: Option<(u32, u64, u64)>,
) -> Result<(), String> {
    match segment {
        None => {
            if event_count != 0 {
                return Err(format!("event_count {event_count} but the payload is empty"));
            }
        }
        Some((shard, first, last)) => {
            if shard != id_shard {
                return Err(format!("id.shard_id {id_shard} but the segment belongs to shard {shard}"));
            }
            if id_seqno != first {
                return Err(format!("id.seqno {id_seqno} but the segment starts at {first}"));
            }
            if event_count != last - first + 1 {
                return Err(format!("event_count {event_count} but the segment holds {} records", last - first + 1));
            }
            if leader_last_seq != 0 && leader_last_seq < last {
                return Err(format!("leader_last_seq {leader_last_seq} is before the segment's last seqno {last}"));
            }
        }
    }
    Ok(())
}

/// Where a follower's retention pass compacts its log to: keep about
/// `retain_bytes` of durable records (estimated from `average_frame_bytes`),
/// never anything past `durable`; none when there is nothing to discard or
/// no size known yet.
pub fn compact_to(first: u64, durable: u64, average_frame_bytes: u64, retain_bytes: u64) -> Option<u64> {
    if average_frame_bytes == 0 {
        return None;
    }
    let keep = retain_bytes / average_frame_bytes;
    let to = (durable + 1).saturating_sub(keep);
    (to > first).then_some(to)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_follower_keeps_its_retain_bytes_of_durable_records() {
        // 100-byte frames, 1,000 bytes to keep: the newest 10 durable ones.
        assert_eq!(compact_to(1, 50, 100, 1_000), Some(41));
        assert_eq!(compact_to(41, 50, 100, 1_000), None, "already there");
        assert_eq!(compact_to(1, 5, 100, 1_000), None, "less than the budget");
        assert_eq!(compact_to(1, 50, 0, 1_000), None, "no size known yet");
        assert_eq!(compact_to(1, 50, 100, 0), Some(51), "nothing to keep: up to the durable end, never past it");
    }

    use super::*;

    const VIEW: FollowerView = FollowerView { epoch_seen: Epoch(3), next_expected: Seqno(11), durable: Seqno(10) };

    fn seg(epoch: u64, first: u64, last: u64) -> InboundSegment {
        InboundSegment { epoch: Epoch(epoch), range: Some((Seqno(first), Seqno(last))), leader_last_seq: Seqno(last) }
    }

    #[test]
    fn continuing_segment_is_applied_whole() {
        assert_eq!(classify(VIEW, seg(3, 11, 20)), Inbound::Apply { skip: 0 });
    }

    #[test]
    fn newer_epoch_is_accepted() {
        assert_eq!(classify(VIEW, seg(4, 11, 11)), Inbound::Apply { skip: 0 });
    }

    #[test]
    fn stale_epoch_is_refused_even_if_it_continues() {
        assert_eq!(classify(VIEW, seg(2, 11, 20)), Inbound::StaleEpoch { seen: Epoch(3) });
        let keepalive = InboundSegment { epoch: Epoch(1), range: None, leader_last_seq: Seqno(99) };
        assert_eq!(classify(VIEW, keepalive), Inbound::StaleEpoch { seen: Epoch(3) });
    }

    #[test]
    fn overlap_skips_what_is_held() {
        assert_eq!(classify(VIEW, seg(3, 5, 15)), Inbound::Apply { skip: 6 });
        assert_eq!(classify(VIEW, seg(3, 10, 11)), Inbound::Apply { skip: 1 });
    }

    #[test]
    fn fully_held_segment_is_a_duplicate() {
        assert_eq!(classify(VIEW, seg(3, 1, 10)), Inbound::Duplicate);
        assert_eq!(classify(VIEW, seg(3, 10, 10)), Inbound::Duplicate);
    }

    #[test]
    fn gap_is_refused() {
        assert_eq!(classify(VIEW, seg(3, 12, 20)), Inbound::Gap { expected: Seqno(11) });
    }

    #[test]
    fn keepalive_says_whether_the_follower_is_behind() {
        let ka =
            |leader_last_seq| InboundSegment { epoch: Epoch(3), range: None, leader_last_seq: Seqno(leader_last_seq) };
        assert_eq!(classify(VIEW, ka(10)), Inbound::Keepalive { behind: false });
        assert_eq!(classify(VIEW, ka(11)), Inbound::Keepalive { behind: true });
        assert_eq!(classify(VIEW, ka(0)), Inbound::Keepalive { behind: false });
    }

    #[test]
    fn envelope_mismatches_are_named() {
        assert!(check_envelope(1, 5, 3, 7, Some((1, 5, 7))).is_ok());
        assert!(check_envelope(1, 0, 0, 7, None).is_ok());
        let cases = [
            (check_envelope(2, 5, 3, 7, Some((1, 5, 7))), "belongs to shard 1"),
            (check_envelope(1, 4, 3, 7, Some((1, 5, 7))), "starts at 5"),
            (check_envelope(1, 5, 2, 7, Some((1, 5, 7))), "holds 3 records"),
            (check_envelope(1, 5, 3, 6, Some((1, 5, 7))), "before the segment's last seqno 7"),
            (check_envelope(1, 0, 4, 7, None), "payload is empty"),
        ];
        for (result, expected) in cases {
            let err = result.unwrap_err();
            assert!(err.contains(expected), "{err:?} should mention {expected:?}");
        }
    }
}
