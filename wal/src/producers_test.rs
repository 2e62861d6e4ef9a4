use super::*;
use crate::record::RecordFields;
use proptest::prelude::*;

const LIMITS: ProducerLimits = ProducerLimits { max_producers: 3, idle_expiry_us: 1_000 };

/// `(id, epoch, sequence)` of a record's producer.
type Stamp = Option<(u64, u64, u64)>;

fn frame(seqno: u64, at_us: u64, stamp: Stamp) -> Frame {
    Frame::encode_stamped(
        RecordFields { seqno, epoch: 1, timestamp_us: at_us, key: b"", payload: b"x" },
        stamp.map(|(id, epoch, sequence)| ProducerStamp { id, epoch, sequence }),
    )
}

/// A table with records `1..` applied, each `(at_us, stamp)`.
fn table(records: &[(u64, Stamp)]) -> ProducerTable {
    let mut t = ProducerTable::empty_at(0);
    for (i, (at, stamp)) in records.iter().enumerate() {
        t.apply(&LIMITS, &frame(i as u64 + 1, *at, *stamp));
    }
    t
}

const WRITE: Decision = Decision::Write { skip: 0, prefix_first_seqno: None };

#[test]
fn a_new_producer_starts_at_one() {
    let t = ProducerTable::empty_at(0);
    assert_eq!(t.check(&LIMITS, 7, 1, 1, 3, 0), Ok(WRITE));
    assert_eq!(t.check(&LIMITS, 7, 1, 2, 3, 0), Err(ProducerRefusal::Unknown { id: 7, epoch: 1, sequence: 2 }));
}

#[test]
fn zero_and_overflowing_values_are_invalid() {
    let t = ProducerTable::empty_at(0);
    for (id, epoch, sequence, count) in [(0, 1, 1, 1), (1, 0, 1, 1), (1, 1, 0, 1), (1, 1, 1, 0), (1, 1, u64::MAX, 2)] {
        let refused = t.check(&LIMITS, id, epoch, sequence, count, 0);
        assert!(matches!(refused, Err(ProducerRefusal::Invalid(_))), "{refused:?}");
    }
    assert_eq!(t.check(&LIMITS, 1, 1, 1, 1, 0), Ok(WRITE));
}

#[test]
fn a_retry_answers_the_original_seqnos() {
    // Producer 7 writes sequences 1..=3 at seqnos 1..=3, producer 8 at 4,
    // then 7 writes 4..=5 at 5..=6.
    let t = table(&[
        (0, Some((7, 1, 1))),
        (0, Some((7, 1, 2))),
        (0, Some((7, 1, 3))),
        (0, Some((8, 1, 1))),
        (0, Some((7, 1, 4))),
        (0, Some((7, 1, 5))),
    ]);
    assert_eq!(t.check(&LIMITS, 7, 1, 1, 3, 0), Ok(Decision::Duplicate { first_seqno: 1, last_seqno: 3 }));
    assert_eq!(t.check(&LIMITS, 7, 1, 4, 2, 0), Ok(Decision::Duplicate { first_seqno: 5, last_seqno: 6 }));
    assert_eq!(t.check(&LIMITS, 7, 1, 6, 1, 0), Ok(WRITE));
    assert_eq!(
        t.check(&LIMITS, 7, 1, 8, 1, 0),
        Err(ProducerRefusal::Gap { id: 7, epoch: 1, sequence: 8, expected: 6 })
    );
    assert_eq!(t.check(&LIMITS, 8, 1, 1, 1, 0), Ok(Decision::Duplicate { first_seqno: 4, last_seqno: 4 }));
}

#[test]
fn a_batch_whose_prefix_survived_writes_the_rest() {
    let t = table(&[(0, Some((7, 1, 1))), (0, Some((7, 1, 2)))]);
    assert_eq!(t.check(&LIMITS, 7, 1, 1, 4, 0), Ok(Decision::Write { skip: 2, prefix_first_seqno: Some(1) }));
}

#[test]
fn only_the_last_runs_are_remembered() {
    // Six runs of producer 7, each broken by producer 8.
    let mut records = Vec::new();
    for i in 0..6 {
        records.push((0, Some((7, 1, i + 1))));
        records.push((0, Some((8, 1, i + 1))));
    }
    let t = table(&records);
    assert_eq!(t.check(&LIMITS, 7, 1, 2, 1, 0), Ok(Decision::Duplicate { first_seqno: 3, last_seqno: 3 }));
    assert_eq!(
        t.check(&LIMITS, 7, 1, 1, 1, 0),
        Err(ProducerRefusal::Forgotten { id: 7, epoch: 1, first: 1, last: 1, newest: 6 })
    );
}

#[test]
fn a_retry_straddling_the_next_sequence_with_a_forgotten_prefix_writes_nothing() {
    // Six runs of producer 7, each broken by producer 8: sequence 1's
    // seqno is forgotten, 2..=6 are remembered.
    let mut records = Vec::new();
    for i in 0..6 {
        records.push((0, Some((7, 1, i + 1))));
        records.push((0, Some((8, 1, i + 1))));
    }
    let t = table(&records);
    // 1..=8: 1..=6 written (1 forgotten), 7..=8 not. Writing 7..=8 and
    // answering "already written" (the old answer) would lose nothing
    // here but told the caller 7..=8 were stored; refusing tells it to
    // send from 7.
    assert_eq!(
        t.check(&LIMITS, 7, 1, 1, 8, 0),
        Err(ProducerRefusal::ForgottenPrefix { id: 7, epoch: 1, first: 1, last: 8, newest: 6 })
    );
    let refusal = t.check(&LIMITS, 7, 1, 1, 8, 0).unwrap_err().to_string();
    assert!(refusal.contains("send the records from sequence 7"), "{refusal}");
    // Remembered, the same retry from 2 writes 7..=8.
    assert_eq!(t.check(&LIMITS, 7, 1, 2, 7, 0), Ok(Decision::Write { skip: 5, prefix_first_seqno: Some(3) }));
}

#[test]
fn a_newer_epoch_fences_the_older() {
    let t = table(&[(0, Some((7, 1, 1))), (0, Some((7, 2, 1)))]);
    assert_eq!(t.check(&LIMITS, 7, 1, 2, 1, 0), Err(ProducerRefusal::Fenced { id: 7, epoch: 1, current: 2 }));
    assert_eq!(t.check(&LIMITS, 7, 2, 2, 1, 0), Ok(WRITE));
    // A newer epoch still starts at 1.
    assert_eq!(t.check(&LIMITS, 7, 3, 5, 1, 0), Err(ProducerRefusal::Unknown { id: 7, epoch: 3, sequence: 5 }));
    assert_eq!(t.check(&LIMITS, 7, 3, 1, 1, 0), Ok(WRITE));
}

#[test]
fn an_idle_producer_expires_in_log_time() {
    let mut t = table(&[(100, Some((7, 1, 1)))]);
    assert_eq!(t.check(&LIMITS, 7, 1, 2, 1, 1_100), Ok(WRITE));
    assert_eq!(t.check(&LIMITS, 7, 1, 2, 1, 1_101), Err(ProducerRefusal::Unknown { id: 7, epoch: 1, sequence: 2 }));
    t.sweep(&LIMITS, 1_101);
    assert_eq!(t.len(), 0);
    assert_eq!(t.forgot().expired, 1);
}

#[test]
fn a_new_producer_past_the_limit_evicts_the_least_recent() {
    let t = table(&[
        (0, Some((1, 1, 1))),
        (0, Some((2, 1, 1))),
        (0, Some((3, 1, 1))),
        (0, Some((1, 1, 2))),
        (0, Some((4, 1, 1))),
    ]);
    assert_eq!(t.len(), 3);
    assert_eq!(t.forgot().evicted, 1);
    assert!(t.producer(2, &LIMITS, 0).is_none(), "producer 2 wrote least recently");
    assert!(t.producer(1, &LIMITS, 0).is_some());
}

#[test]
fn unstamped_records_only_advance_the_table() {
    let t = table(&[(0, None), (0, Some((7, 1, 1))), (0, None)]);
    assert_eq!(t.applied_through(), 3);
    assert_eq!(t.producer(7, &LIMITS, 0), Some((1, 1, 2)));
}

#[test]
fn bad_snapshots_are_refused() {
    let t = table(&[(0, Some((7, 1, 1)))]);
    let bytes = t.encode(&LIMITS).to_vec();
    assert_eq!(ProducerTable::decode(&bytes).unwrap(), t);
    assert_eq!(ProducerTable::decode(&bytes[..10]), Err(SnapshotError::Truncated));
    let mut magic = bytes.clone();
    magic[0] = b'X';
    assert!(matches!(ProducerTable::decode(&magic), Err(SnapshotError::Magic(_))));
    let mut version = bytes.clone();
    version[4] = 9;
    assert_eq!(ProducerTable::decode(&version), Err(SnapshotError::Version(9)));
    let mut flipped = bytes.clone();
    flipped[20] ^= 1;
    assert!(matches!(ProducerTable::decode(&flipped), Err(SnapshotError::Checksum { .. })));
}

#[test]
fn a_snapshot_claiming_more_producers_than_its_bytes_is_refused() {
    let t = ProducerTable::empty_at(5);
    let mut bytes = t.encode(&LIMITS).to_vec();
    bytes.truncate(bytes.len() - 4);
    bytes[21..25].copy_from_slice(&u32::MAX.to_le_bytes());
    let crc = crc32fast::hash(&bytes);
    bytes.extend_from_slice(&crc.to_le_bytes());
    assert!(matches!(ProducerTable::decode(&bytes), Err(SnapshotError::Malformed(_))));
}

proptest! {
    /// Garbage never panics the snapshot decoder.
    #[test]
    fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = ProducerTable::decode(&bytes);
    }

    /// A table rebuilt from a snapshot taken anywhere plus the records
    /// after it answers every check as the table applied in one go, and
    /// its snapshot decodes to itself.
    #[test]
    fn snapshot_and_replay_equal_one_replay(
        records in proptest::collection::vec((0u64..3_000, proptest::option::of((1u64..6, 1u64..3, 1u64..8))), 1..60),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut at = 0;
        let records: Vec<_> = records.into_iter().map(|(step, stamp)| { at += step; (at, stamp) }).collect();
        let whole = table(&records);
        let cut = cut.index(records.len());
        let mut head = table(&records[..cut]);
        head = ProducerTable::decode(&head.encode(&LIMITS)).unwrap();
        for (i, (at, stamp)) in records.iter().enumerate().skip(cut) {
            head.apply(&LIMITS, &frame(i as u64 + 1, *at, *stamp));
        }
        for id in 1..6 {
            for epoch in 1..3 {
                for sequence in 1..9 {
                    for count in 1..3 {
                        prop_assert_eq!(
                            head.check(&LIMITS, id, epoch, sequence, count, at),
                            whole.check(&LIMITS, id, epoch, sequence, count, at)
                        );
                    }
                }
            }
        }
        let round = ProducerTable::decode(&whole.encode(&LIMITS)).unwrap();
        prop_assert_eq!(round.encode(&LIMITS), whole.encode(&LIMITS));
    }
}
