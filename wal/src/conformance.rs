//! The storage conformance suite: every [`LogStore`] implementation must pass
//! each case. `conformance_suite!` instantiates the cases for one harness.
//!
//! A harness can also restart its store: the raft-engine store is dropped and
//! reopened from disk; the in-memory store "crashes", losing everything not
//! durable, which is the worst a restart may do.

use bytes::Bytes;

use crate::record::{Frame, RecordFields};
use crate::store::{Counter, LogBounds, LogStore, Raise, ShardAppend, StoreError};

pub(crate) trait Harness {
    fn store(&self) -> &dyn LogStore;
    fn restart(&mut self);
}

pub(crate) fn frames(first: u64, count: u64, epoch: u64) -> Vec<Frame> {
    (first..first + count)
        .map(|seqno| {
            let payload = format!("record-{seqno}-epoch-{epoch}");
            Frame::encode(RecordFields {
                seqno,
                epoch,
                timestamp_us: seqno * 10,
                key: b"k",
                payload: payload.as_bytes(),
            })
        })
        .collect()
}

fn append(h: &dyn Harness, shard: u32, first: u64, count: u64, epoch: u64) -> Result<(), StoreError> {
    h.store().append(&[ShardAppend { shard, frames: frames(first, count, epoch) }], true)
}

fn all(h: &dyn Harness, shard: u32) -> Vec<Frame> {
    let b = h.store().bounds(shard).unwrap();
    if b.is_empty() {
        return vec![];
    }
    h.store().read(shard, b.first_seqno, b.last_seqno, usize::MAX).unwrap()
}

pub(crate) fn new_shard_is_empty(h: &mut dyn Harness) {
    h.store().create_shard(1).unwrap();
    h.store().create_shard(1).unwrap();
    assert_eq!(h.store().bounds(1).unwrap(), LogBounds::EMPTY);
    assert!(matches!(h.store().bounds(2), Err(StoreError::UnknownShard(2))));
    assert_eq!(h.store().shards(), vec![1]);
    h.restart();
    assert_eq!(h.store().shards(), vec![1]);
    assert_eq!(h.store().bounds(1).unwrap(), LogBounds::EMPTY);
}

pub(crate) fn shards_created_together_are_durable_and_leave_known_ones_alone(h: &mut dyn Harness) {
    h.store().create_shard(2).unwrap();
    append(h, 2, 1, 3, 1).unwrap();
    h.store().create_shards(&[5, 2, 1, 5]).unwrap();
    assert_eq!(h.store().shards(), vec![1, 2, 5]);
    assert_eq!(h.store().bounds(1).unwrap(), LogBounds::EMPTY);
    assert_eq!(h.store().bounds(5).unwrap(), LogBounds::EMPTY);
    assert_eq!(all(h, 2), frames(1, 3, 1), "a known shard is not created again");
    h.store().create_shards(&[]).unwrap();
    h.restart();
    assert_eq!(h.store().shards(), vec![1, 2, 5]);
    assert_eq!(all(h, 2), frames(1, 3, 1));
    append(h, 5, 1, 2, 1).unwrap();
    assert_eq!(all(h, 5), frames(1, 2, 1));
}

pub(crate) fn append_and_read_back(h: &mut dyn Harness) {
    h.store().create_shard(1).unwrap();
    append(h, 1, 1, 10, 1).unwrap();
    append(h, 1, 11, 5, 2).unwrap();
    assert_eq!(h.store().bounds(1).unwrap(), LogBounds { first_seqno: 1, last_seqno: 15, durable_seqno: 15 });
    let read = h.store().read(1, 1, 15, usize::MAX).unwrap();
    let mut expected = frames(1, 10, 1);
    expected.extend(frames(11, 5, 2));
    assert_eq!(read, expected);
    assert_eq!(h.store().read(1, 4, 6, usize::MAX).unwrap(), frames(4, 3, 1));
}

pub(crate) fn gaps_and_overwrites_are_refused(h: &mut dyn Harness) {
    h.store().create_shard(1).unwrap();
    h.store().create_shard(2).unwrap();
    append(h, 1, 1, 3, 1).unwrap();
    let before = all(h, 1);
    assert!(matches!(append(h, 1, 5, 1, 1), Err(StoreError::NotContinuous { expected: 4, found: 5, .. })));
    assert!(matches!(append(h, 1, 3, 2, 1), Err(StoreError::NotContinuous { expected: 4, found: 3, .. })));
    assert!(matches!(append(h, 1, 1, 1, 9), Err(StoreError::NotContinuous { .. })));
    let mut holey = frames(4, 3, 1);
    holey.remove(1);
    assert!(matches!(
        h.store().append(&[ShardAppend { shard: 1, frames: holey }], true),
        Err(StoreError::NotContiguous { expected: 5, found: 6, .. })
    ));
    assert!(matches!(
        h.store().append(&[ShardAppend { shard: 1, frames: vec![] }], true),
        Err(StoreError::EmptyAppend { .. })
    ));
    assert!(matches!(append(h, 9, 1, 1, 1), Err(StoreError::UnknownShard(9))));
    // One bad part refuses the whole batch: shard 2's valid part is not written.
    let batch = [ShardAppend { shard: 2, frames: frames(1, 2, 1) }, ShardAppend { shard: 1, frames: frames(9, 1, 1) }];
    assert!(h.store().append(&batch, true).is_err());
    assert_eq!(h.store().bounds(2).unwrap(), LogBounds::EMPTY);
    assert_eq!(all(h, 1), before);
    assert_eq!(h.store().bounds(1).unwrap().last_seqno, 3);
}

pub(crate) fn multi_shard_batch_is_atomic_and_independent(h: &mut dyn Harness) {
    for shard in 1..=3 {
        h.store().create_shard(shard).unwrap();
    }
    let batch = [
        ShardAppend { shard: 1, frames: frames(1, 2, 1) },
        ShardAppend { shard: 3, frames: frames(1, 5, 1) },
        ShardAppend { shard: 1, frames: frames(3, 1, 1) },
    ];
    h.store().append(&batch, true).unwrap();
    assert_eq!(h.store().bounds(1).unwrap().last_seqno, 3);
    assert_eq!(h.store().bounds(2).unwrap(), LogBounds::EMPTY);
    assert_eq!(h.store().bounds(3).unwrap().last_seqno, 5);
    h.restart();
    assert_eq!(all(h, 1), frames(1, 3, 1));
    assert_eq!(all(h, 3), frames(1, 5, 1));
}

pub(crate) fn written_is_not_durable_until_synced(h: &mut dyn Harness) {
    h.store().create_shard(1).unwrap();
    append(h, 1, 1, 2, 1).unwrap();
    h.store().append(&[ShardAppend { shard: 1, frames: frames(3, 2, 1) }], false).unwrap();
    let b = h.store().bounds(1).unwrap();
    assert_eq!((b.last_seqno, b.durable_seqno), (4, 2));
    assert!(b.durable_seqno <= b.last_seqno);
    h.store().append(&[ShardAppend { shard: 1, frames: frames(5, 1, 1) }], true).unwrap();
    let b = h.store().bounds(1).unwrap();
    assert_eq!((b.last_seqno, b.durable_seqno), (5, 5));
}

pub(crate) fn read_ranges_are_checked_and_bounded(h: &mut dyn Harness) {
    h.store().create_shard(1).unwrap();
    append(h, 1, 1, 10, 1).unwrap();
    for (from, to) in [(0, 3), (5, 11), (7, 6), (11, 11)] {
        assert!(
            matches!(h.store().read(1, from, to, usize::MAX), Err(StoreError::OutOfRange { .. })),
            "[{from}, {to}]"
        );
    }
    let one = frames(1, 1, 1)[0].len();
    // max_bytes stops the read, but at least one frame always comes back.
    assert_eq!(h.store().read(1, 1, 10, 1).unwrap().len(), 1);
    assert_eq!(h.store().read(1, 1, 10, one * 3).unwrap().len(), 3);
    assert!(matches!(h.store().read(4, 1, 1, 1), Err(StoreError::UnknownShard(4))));
}

pub(crate) fn truncate_suffix_then_append(h: &mut dyn Harness) {
    h.store().create_shard(1).unwrap();
    append(h, 1, 1, 10, 1).unwrap();
    h.store().truncate_suffix(1, 6).unwrap();
    let b = h.store().bounds(1).unwrap();
    assert_eq!((b.last_seqno, b.durable_seqno), (6, 6));
    assert!(matches!(h.store().read(1, 7, 7, usize::MAX), Err(StoreError::OutOfRange { .. })));
    // The truncation survives a restart before anything replaces the tail.
    h.restart();
    assert_eq!(h.store().bounds(1).unwrap().last_seqno, 6);
    assert!(matches!(append(h, 1, 8, 1, 2), Err(StoreError::NotContinuous { expected: 7, .. })));
    append(h, 1, 7, 2, 2).unwrap();
    let mut expected = frames(1, 6, 1);
    expected.extend(frames(7, 2, 2));
    assert_eq!(all(h, 1), expected);
    h.restart();
    assert_eq!(all(h, 1), expected, "the old epoch-1 tail 9..=10 must not come back");
    // Truncating at or past the end changes nothing.
    h.store().truncate_suffix(1, 8).unwrap();
    h.store().truncate_suffix(1, 100).unwrap();
    assert_eq!(all(h, 1), expected);
    // Truncate everything, then start over at the same seqno.
    h.store().truncate_suffix(1, 0).unwrap();
    assert!(h.store().bounds(1).unwrap().is_empty());
    append(h, 1, 1, 1, 3).unwrap();
    assert_eq!(all(h, 1), frames(1, 1, 3));
}

pub(crate) fn compact_prefix_keeps_positions(h: &mut dyn Harness) {
    h.store().create_shard(1).unwrap();
    append(h, 1, 1, 10, 1).unwrap();
    h.store().compact_prefix(1, 4).unwrap();
    assert_eq!(h.store().bounds(1).unwrap(), LogBounds { first_seqno: 4, last_seqno: 10, durable_seqno: 10 });
    assert!(matches!(h.store().read(1, 3, 5, usize::MAX), Err(StoreError::OutOfRange { .. })));
    assert_eq!(h.store().read(1, 4, 10, usize::MAX).unwrap(), frames(4, 7, 1));
    // Compacting backwards is a no-op; past the durable point is refused.
    h.store().compact_prefix(1, 2).unwrap();
    assert_eq!(h.store().bounds(1).unwrap().first_seqno, 4);
    h.store().append(&[ShardAppend { shard: 1, frames: frames(11, 2, 1) }], false).unwrap();
    assert!(matches!(h.store().compact_prefix(1, 12), Err(StoreError::BadPosition { .. })));
    // Truncating into the compacted prefix is refused.
    assert!(matches!(h.store().truncate_suffix(1, 2), Err(StoreError::BadPosition { .. })));
    append(h, 1, 13, 1, 1).unwrap();
    // Compact everything: the log is empty but remembers where it continues.
    h.store().compact_prefix(1, 14).unwrap();
    h.restart();
    let b = h.store().bounds(1).unwrap();
    assert_eq!((b.first_seqno, b.last_seqno), (14, 13));
    assert!(b.is_empty());
    assert!(matches!(append(h, 1, 1, 1, 1), Err(StoreError::NotContinuous { expected: 14, .. })));
    append(h, 1, 14, 2, 1).unwrap();
    assert_eq!(all(h, 1), frames(14, 2, 1));
}

pub(crate) fn restart_keeps_durable_records(h: &mut dyn Harness) {
    h.store().create_shard(1).unwrap();
    h.store().create_shard(2).unwrap();
    for i in 0..20 {
        append(h, 1 + (i % 2) as u32, 1 + i / 2, 1, 1).unwrap();
    }
    h.restart();
    for shard in [1, 2] {
        let b = h.store().bounds(shard).unwrap();
        assert_eq!(b, LogBounds { first_seqno: 1, last_seqno: 10, durable_seqno: 10 });
        assert_eq!(all(h, shard), frames(1, 10, 1));
    }
    append(h, 1, 11, 1, 1).unwrap();
}

pub(crate) fn frames_survive_byte_identical(h: &mut dyn Harness) {
    h.store().create_shard(7).unwrap();
    let odd = Frame::encode(RecordFields {
        seqno: 1,
        epoch: u64::MAX,
        timestamp_us: 0,
        key: &[0u8; 300],
        payload: &Bytes::from(vec![0xAB; 70_000]),
    });
    h.store().append(&[ShardAppend { shard: 7, frames: vec![odd.clone()] }], true).unwrap();
    h.restart();
    assert_eq!(h.store().read(7, 1, 1, 1).unwrap(), vec![odd]);
}

pub(crate) fn epoch_promise_survives_and_never_moves_back(h: &mut dyn Harness) {
    h.store().create_shard(1).unwrap();
    assert_eq!(h.store().epoch(1).unwrap(), 0);
    h.store().set_epoch(1, 5).unwrap();
    h.store().set_epoch(1, 3).unwrap();
    assert_eq!(h.store().epoch(1).unwrap(), 5, "a lower epoch is ignored");
    h.restart();
    assert_eq!(h.store().epoch(1).unwrap(), 5, "the promise is durable");
    assert!(matches!(h.store().set_epoch(9, 1), Err(StoreError::UnknownShard(9))));
    assert!(matches!(h.store().epoch(9), Err(StoreError::UnknownShard(9))));
}

pub(crate) fn log_epoch_survives_and_never_moves_back(h: &mut dyn Harness) {
    h.store().create_shard(1).unwrap();
    assert_eq!(h.store().log_epoch(1).unwrap(), 0);
    h.store().set_log_epoch(1, 4).unwrap();
    h.store().set_log_epoch(1, 2).unwrap();
    h.store().set_epoch(1, 9).unwrap();
    assert_eq!(h.store().log_epoch(1).unwrap(), 4, "a lower log epoch is ignored, the promise is separate");
    h.restart();
    assert_eq!(h.store().log_epoch(1).unwrap(), 4, "the log epoch is durable");
    assert_eq!(h.store().epoch(1).unwrap(), 9);
    assert!(matches!(h.store().set_log_epoch(9, 1), Err(StoreError::UnknownShard(9))));
    assert!(matches!(h.store().log_epoch(9), Err(StoreError::UnknownShard(9))));
}

/// `raise_many`: each raise as its single call would do it, one outcome per
/// raise in order, an unknown shard refused alone, durable on return.
pub(crate) fn raise_many_is_each_raise_in_one_write(h: &mut dyn Harness) {
    for shard in [1, 2, 3] {
        h.store().create_shard(shard).unwrap();
    }
    h.store().set_epoch(2, 7).unwrap();
    let raise = |shard, counter, value| Raise { shard, counter, value };
    let outcomes = h.store().raise_many(&[
        raise(1, Counter::Epoch, 3),
        raise(9, Counter::Epoch, 5),
        raise(2, Counter::Epoch, 4),
        raise(1, Counter::LogEpoch, 2),
        raise(3, Counter::Epoch, 6),
        raise(3, Counter::Epoch, 8),
        raise(3, Counter::Epoch, 5),
    ]);
    assert_eq!(outcomes.len(), 7, "one outcome per raise");
    assert!(matches!(outcomes[1], Err(StoreError::UnknownShard(9))), "{:?}", outcomes[1]);
    for i in [0, 2, 3, 4, 5, 6] {
        assert!(outcomes[i].is_ok(), "raise {i}: {:?}", outcomes[i]);
    }
    let check = |h: &dyn Harness| {
        assert_eq!(h.store().epoch(1).unwrap(), 3);
        assert_eq!(h.store().log_epoch(1).unwrap(), 2, "a log-epoch raise moves the log epoch only");
        assert_eq!(h.store().epoch(2).unwrap(), 7, "a lower epoch is ignored");
        assert_eq!(h.store().log_epoch(2).unwrap(), 0);
        assert_eq!(h.store().epoch(3).unwrap(), 8, "the highest of one shard's raises wins, whatever the order");
        assert!(matches!(h.store().epoch(9), Err(StoreError::UnknownShard(9))), "an unknown shard stays unknown");
    };
    check(h);
    h.restart();
    check(h);
    assert!(h.store().raise_many(&[]).is_empty(), "no raise, no outcome");
}

/// Batch sizes the position cases append in: single records, small and
/// large batches, so a store that stores runs of records (the raft-engine
/// store's chunks, small in the `engine_small_chunks` suite) has records at
/// the first, middle and last position of its runs, and runs merged and
/// split.
const POSITION_BATCHES: [u64; 12] = [1, 2, 5, 1, 1, 9, 3, 1, 14, 1, 2, 6];

/// Appends the position workload to `shard` (seqnos 1..=46, epoch 1).
fn append_position_workload(h: &dyn Harness, shard: u32) -> Vec<Frame> {
    let mut first = 1;
    for count in POSITION_BATCHES {
        append(h, shard, first, count, 1).unwrap();
        first += count;
    }
    frames(1, first - 1, 1)
}

/// Reads from, to and across every position: one record, to the end, from
/// the start, and cut by size right after it, before and after a restart.
pub(crate) fn reads_at_every_position(h: &mut dyn Harness) {
    h.store().create_shard(1).unwrap();
    let all = append_position_workload(h, 1);
    let last = all.len() as u64;
    for round in 0..2 {
        for s in 1..=last {
            let at = (s - 1) as usize;
            let store = h.store();
            assert_eq!(store.read(1, s, s, usize::MAX).unwrap(), all[at..=at], "round {round}: record {s}");
            assert_eq!(store.read(1, s, last, usize::MAX).unwrap(), all[at..], "round {round}: {s}..");
            assert_eq!(store.read(1, 1, s, usize::MAX).unwrap(), all[..=at], "round {round}: ..={s}");
            // A size limit that fits exactly the records 1..=s, and one a
            // byte short of it (which still returns at least one record).
            let fit: usize = all[..=at].iter().map(Frame::len).sum();
            assert_eq!(store.read(1, 1, last, fit).unwrap(), all[..=at], "round {round}: {fit} bytes");
            let short = if s == 1 { &all[..1] } else { &all[..at] };
            assert_eq!(store.read(1, 1, last, fit - 1).unwrap(), short, "round {round}: {} bytes", fit - 1);
            assert_eq!(store.read(1, s, last, 0).unwrap(), all[at..=at], "round {round}: at least one record");
        }
        h.restart();
    }
}

/// Truncation at every position (and of everything), then an append of a
/// new epoch's records: the log is exactly the kept prefix and the new
/// records, before and after a restart, and the old tail never returns.
pub(crate) fn truncation_at_every_position_then_append(h: &mut dyn Harness) {
    let last = POSITION_BATCHES.iter().sum::<u64>();
    let mut expected = Vec::new();
    for keep in 0..=last {
        let shard = keep as u32 + 1;
        h.store().create_shard(shard).unwrap();
        let all = append_position_workload(h, shard);
        h.store().truncate_suffix(shard, keep).unwrap();
        let b = h.store().bounds(shard).unwrap();
        assert_eq!((b.first_seqno, b.last_seqno, b.durable_seqno), (1, keep, keep), "keep {keep}");
        if keep < last {
            assert!(matches!(
                h.store().read(shard, keep + 1, keep + 1, usize::MAX),
                Err(StoreError::OutOfRange { .. })
            ));
        }
        append(h, shard, keep + 1, 3, 2).unwrap();
        let mut want = all[..keep as usize].to_vec();
        want.extend(frames(keep + 1, 3, 2));
        assert_eq!(self::all(h, shard), want, "keep {keep}");
        expected.push(want);
    }
    h.restart();
    for (keep, want) in expected.iter().enumerate() {
        assert_eq!(all(h, keep as u32 + 1), *want, "after a restart, keep {keep}");
    }
}

/// Compaction at every position: reads start exactly at the new first
/// seqno, before and after a restart, and appends continue.
pub(crate) fn compaction_at_every_position(h: &mut dyn Harness) {
    let last = POSITION_BATCHES.iter().sum::<u64>();
    for first_kept in 1..=last + 1 {
        let shard = first_kept as u32;
        h.store().create_shard(shard).unwrap();
        let all = append_position_workload(h, shard);
        h.store().compact_prefix(shard, first_kept).unwrap();
        assert_eq!(self::all(h, shard), all[first_kept as usize - 1..], "first kept {first_kept}");
        if first_kept > 1 {
            let below = first_kept - 1;
            assert!(matches!(h.store().read(shard, below, below, usize::MAX), Err(StoreError::OutOfRange { .. })));
        }
    }
    h.restart();
    for first_kept in 1..=last + 1 {
        let shard = first_kept as u32;
        let b = h.store().bounds(shard).unwrap();
        assert_eq!((b.first_seqno, b.last_seqno), (first_kept, last), "after a restart");
        append(h, shard, last + 1, 2, 2).unwrap();
        let mut want = frames(first_kept, last + 1 - first_kept, 1);
        want.extend(frames(last + 1, 2, 2));
        assert_eq!(all(h, shard), want, "first kept {first_kept}");
    }
}

/// Copies every file of `from` into a fresh directory: what a crash leaves
/// of a store that is open.
pub(crate) fn crash_copy(from: &std::path::Path) -> tempfile::TempDir {
    let copy = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, copy.path().join(path.file_name().unwrap())).unwrap();
    }
    copy
}

macro_rules! conformance_suite {
    ($harness:expr) => {
        #[test]
        fn new_shard_is_empty() {
            crate::conformance::new_shard_is_empty(&mut $harness);
        }
        #[test]
        fn shards_created_together_are_durable_and_leave_known_ones_alone() {
            crate::conformance::shards_created_together_are_durable_and_leave_known_ones_alone(&mut $harness);
        }
        #[test]
        fn append_and_read_back() {
            crate::conformance::append_and_read_back(&mut $harness);
        }
        #[test]
        fn gaps_and_overwrites_are_refused() {
            crate::conformance::gaps_and_overwrites_are_refused(&mut $harness);
        }
        #[test]
        fn multi_shard_batch_is_atomic_and_independent() {
            crate::conformance::multi_shard_batch_is_atomic_and_independent(&mut $harness);
        }
        #[test]
        fn written_is_not_durable_until_synced() {
            crate::conformance::written_is_not_durable_until_synced(&mut $harness);
        }
        #[test]
        fn read_ranges_are_checked_and_bounded() {
            crate::conformance::read_ranges_are_checked_and_bounded(&mut $harness);
        }
        #[test]
        fn truncate_suffix_then_append() {
            crate::conformance::truncate_suffix_then_append(&mut $harness);
        }
        #[test]
        fn compact_prefix_keeps_positions() {
            crate::conformance::compact_prefix_keeps_positions(&mut $harness);
        }
        #[test]
        fn restart_keeps_durable_records() {
            crate::conformance::restart_keeps_durable_records(&mut $harness);
        }
        #[test]
        fn epoch_promise_survives_and_never_moves_back() {
            crate::conformance::epoch_promise_survives_and_never_moves_back(&mut $harness);
        }
        #[test]
        fn log_epoch_survives_and_never_moves_back() {
            crate::conformance::log_epoch_survives_and_never_moves_back(&mut $harness);
        }
        #[test]
        fn raise_many_is_each_raise_in_one_write() {
            crate::conformance::raise_many_is_each_raise_in_one_write(&mut $harness);
        }
        #[test]
        fn reads_at_every_position() {
            crate::conformance::reads_at_every_position(&mut $harness);
        }
        #[test]
        fn truncation_at_every_position_then_append() {
            crate::conformance::truncation_at_every_position_then_append(&mut $harness);
        }
        #[test]
        fn compaction_at_every_position() {
            crate::conformance::compaction_at_every_position(&mut $harness);
        }
        #[test]
        fn frames_survive_byte_identical() {
            crate::conformance::frames_survive_byte_identical(&mut $harness);
        }
    };
}

struct MemHarness(crate::MemStore);

impl Harness for MemHarness {
    fn store(&self) -> &dyn LogStore {
        &self.0
    }
    fn restart(&mut self) {
        self.0.crash();
    }
}

struct EngineHarness {
    dir: tempfile::TempDir,
    config: crate::EngineStoreConfig,
    store: Option<crate::EngineStore>,
}

impl EngineHarness {
    fn new() -> EngineHarness {
        Self::with(Default::default())
    }

    fn with(config: crate::EngineStoreConfig) -> EngineHarness {
        let dir = tempfile::tempdir().unwrap();
        let store = crate::EngineStore::open(dir.path(), &config).unwrap();
        EngineHarness { dir, config, store: Some(store) }
    }

    /// Small log files, the first zero-filled (`wal.prefill`) and three
    /// spares of zeros (`wal.spare_bytes`), so the cases also cross
    /// rotations out of a filled file and into spares.
    fn prefilled() -> EngineHarness {
        Self::with(crate::EngineStoreConfig {
            target_file_bytes: PREFILL_TEST_FILE_BYTES,
            prefill: true,
            spare_bytes: PREFILL_TEST_SPARES * PREFILL_TEST_FILE_BYTES,
            ..Default::default()
        })
    }
}

/// Spare files the prefilled harness asks for (three: raft-engine's pool for
/// a prefill limit of two files).
const PREFILL_TEST_SPARES: u64 = 3;

/// Above raft-engine's 2 MiB `fallocate` step, so a file it grew by itself
/// is smaller than a filled one.
const PREFILL_TEST_FILE_BYTES: u64 = 4 << 20;

impl Harness for EngineHarness {
    fn store(&self) -> &dyn LogStore {
        self.store.as_ref().unwrap()
    }
    fn restart(&mut self) {
        drop(self.store.take());
        self.store = Some(crate::EngineStore::open(self.dir.path(), &self.config).unwrap());
    }
}

mod mem {
    use super::*;
    conformance_suite!(MemHarness(crate::MemStore::new()));

    /// Only the double can lose unsynced writes on demand; this checks that
    /// the double really models a crash (the engine case cannot be forced
    /// without killing the process, which the black-box tests do).
    #[test]
    fn crash_loses_only_the_unsynced_tail() {
        let mut h = MemHarness(crate::MemStore::new());
        h.store().create_shard(1).unwrap();
        append(&h, 1, 1, 3, 1).unwrap();
        h.store().append(&[ShardAppend { shard: 1, frames: frames(4, 2, 1) }], false).unwrap();
        h.restart();
        assert_eq!(all(&h, 1), frames(1, 3, 1));
    }
}

mod engine {
    use super::*;
    conformance_suite!(EngineHarness::new());
}

/// Chunks of at most 512 bytes (a handful of the suite's records): every
/// case also runs across chunk boundaries, merges of small chunks and
/// splits of large batches.
mod engine_small_chunks {
    use super::*;
    conformance_suite!(EngineHarness::with(crate::EngineStoreConfig { chunk_bytes: 512, ..Default::default() }));
}

mod engine_prefilled {
    use std::path::{Path, PathBuf};

    use super::*;
    conformance_suite!(EngineHarness::prefilled());

    /// The files under `dir` whose names end with `suffix`, by name, with
    /// their lengths.
    fn files_ending(dir: &Path, suffix: &str) -> Vec<(PathBuf, u64)> {
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.to_string_lossy().ends_with(suffix))
            .map(|p| {
                let len = std::fs::metadata(&p).unwrap().len();
                (p, len)
            })
            .collect();
        files.sort();
        files
    }

    /// The raft-engine log files under `dir`, by name.
    fn log_files(dir: &Path) -> Vec<(PathBuf, u64)> {
        files_ending(dir, ".raftlog")
    }

    /// The spare log files of zeros under `dir`, by name.
    fn spare_files(dir: &Path) -> Vec<(PathBuf, u64)> {
        files_ending(dir, crate::zero_fill::SPARE_SUFFIX)
    }

    #[test]
    fn a_fresh_store_zero_fills_its_first_log_file_only_when_asked() {
        let filled = EngineHarness::prefilled();
        assert_eq!(log_files(filled.dir.path()).iter().map(|f| f.1).collect::<Vec<_>>(), vec![PREFILL_TEST_FILE_BYTES]);
        let plain = EngineHarness::with(crate::EngineStoreConfig {
            target_file_bytes: PREFILL_TEST_FILE_BYTES,
            ..Default::default()
        });
        let sizes: Vec<_> = log_files(plain.dir.path()).iter().map(|f| f.1).collect();
        assert_eq!(sizes.len(), 1);
        assert!(sizes[0] < PREFILL_TEST_FILE_BYTES, "unfilled first file is {} bytes", sizes[0]);
    }

    /// A crash leaves the filled file with its zero tail: a copy of the
    /// directory taken while the store is open is exactly that. Recovery
    /// must keep every synced record and the next appends must land right
    /// after the last one: an append after the zeros would be cut by the
    /// next recovery.
    #[test]
    fn a_crash_inside_a_zero_filled_file_keeps_every_synced_record() {
        let h = EngineHarness::prefilled();
        h.store().create_shard(1).unwrap();
        append(&h, 1, 1, 100, 1).unwrap();
        let copy = crate::conformance::crash_copy(h.dir.path());
        assert_eq!(log_files(copy.path())[0].1, PREFILL_TEST_FILE_BYTES, "the copy holds the zero tail");

        let mut crashed = EngineHarness { dir: copy, config: h.config.clone(), store: None };
        crashed.restart();
        assert_eq!(all(&crashed, 1), frames(1, 100, 1));
        // Recovery cut the zeros at the last record and the store wrote them
        // back behind it (`refill_active_tail`); appends continue after the
        // last record, not after the zeros.
        let after_recovery = log_files(crashed.dir.path());
        assert_eq!(after_recovery.len(), 1);
        assert_eq!(after_recovery[0].1, PREFILL_TEST_FILE_BYTES, "{after_recovery:?}");
        append(&crashed, 1, 101, 50, 2).unwrap();
        crashed.restart();
        let mut expected = frames(1, 100, 1);
        expected.extend(frames(101, 50, 2));
        assert_eq!(all(&crashed, 1), expected);
    }

    /// Rotating out of the filled file cuts its unused zeros before the next
    /// file starts; every record survives a restart across the rotation.
    #[test]
    fn rotating_out_of_a_zero_filled_file_keeps_every_record() {
        let mut h = EngineHarness::prefilled();
        // Fourteen batches cross the 4 MiB target.
        let expected = append_big_batches(&h, 16);
        let files = log_files(h.dir.path());
        assert!(files.len() >= 2, "the log rotated: {files:?}");
        h.restart();
        assert_eq!(all(&h, 1), expected);
    }

    /// Appends `batches` batches of ten 30 KiB records (~300 KiB each) to
    /// shard 1 (created here): fourteen fill a 4 MiB file. Returns the
    /// frames.
    fn append_big_batches(h: &EngineHarness, batches: u64) -> Vec<Frame> {
        h.store().create_shard(1).unwrap();
        let mut expected = Vec::new();
        for batch in 0..batches {
            let frames: Vec<Frame> = (1 + batch * 10..11 + batch * 10)
                .map(|seqno| {
                    let payload = vec![seqno as u8; 30 << 10];
                    Frame::encode(RecordFields { seqno, epoch: 1, timestamp_us: seqno, key: b"k", payload: &payload })
                })
                .collect();
            h.store().append(&[ShardAppend { shard: 1, frames: frames.clone() }], true).unwrap();
            expected.extend(frames);
        }
        expected
    }

    /// `walship_wal_rotations_total` for `into="spare"` and `into="new"`,
    /// as a scrape of a registry holding the store's collector reads them.
    fn scraped_rotations(h: &EngineHarness) -> (u64, u64) {
        use prometheus::Encoder;
        let registry = prometheus::Registry::new();
        let rotations = h.store.as_ref().unwrap().rotations();
        registry.register(Box::new(crate::metrics::RotationsCollector::new(rotations).unwrap())).unwrap();
        let mut text = Vec::new();
        prometheus::TextEncoder::new().encode(&registry.gather(), &mut text).unwrap();
        let text = String::from_utf8(text).unwrap();
        let value = |into: &str| -> u64 {
            let prefix = format!("walship_wal_rotations_total{{into=\"{into}\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(&prefix))
                .unwrap_or_else(|| panic!("{prefix} in {text}"))
                .parse()
                .unwrap()
        };
        (value("spare"), value("new"))
    }

    #[test]
    fn spare_pools_round_down_to_the_files_raft_engine_lays_out() {
        let files = |spare_bytes: u64| crate::zero_fill::spare_files(spare_bytes, 128 << 20);
        assert_eq!(files(0), 0);
        assert_eq!(files((128 << 20) - 1), 0, "less than one file");
        assert_eq!(files(128 << 20), 1);
        assert_eq!(files(256 << 20), 1, "a limit of two files would lay out three");
        assert_eq!(files(384 << 20), 3);
        assert_eq!(files(1 << 30), 7);
        assert_eq!(files(crate::DEFAULT_SPARE_BYTES), 16, "2 GiB: sixteen spares");
        assert_eq!(crate::zero_fill::spare_files(1 << 30, 0), 0, "no file size, no spares");
    }

    /// A fresh store lays out its spares of zeros, whole; a rotation renames
    /// one into place instead of creating a file, and every record, synced
    /// into a spare, survives both a crash and a restart.
    #[test]
    fn rotations_take_spares_of_zeros_and_keep_every_record() {
        let mut h = EngineHarness::prefilled();
        let spares = spare_files(h.dir.path());
        assert_eq!(spares.len() as u64, PREFILL_TEST_SPARES, "{spares:?}");
        for (path, len) in &spares {
            assert_eq!(*len, PREFILL_TEST_FILE_BYTES, "{}", path.display());
            assert!(std::fs::read(path).unwrap().iter().all(|b| *b == 0), "{} holds only zeros", path.display());
        }
        let unfilled = EngineHarness::with(crate::EngineStoreConfig {
            target_file_bytes: PREFILL_TEST_FILE_BYTES,
            spare_bytes: PREFILL_TEST_SPARES * PREFILL_TEST_FILE_BYTES,
            ..Default::default()
        });
        assert_eq!(spare_files(unfilled.dir.path()), vec![], "spares only come with wal.prefill");

        // Thirty batches rotate twice and leave the newest file mostly unused.
        let expected = append_big_batches(&h, 30);
        let files = log_files(h.dir.path());
        assert_eq!(files.len(), 3, "two rotations: {files:?}");
        assert_eq!(spare_files(h.dir.path()).len() as u64, PREFILL_TEST_SPARES - 2, "each rotation took a spare");
        let newest = files.last().unwrap();
        assert_eq!(newest.1, PREFILL_TEST_FILE_BYTES, "the newest file is a whole spare, not grown by fallocate");
        assert_eq!(scraped_rotations(&h), (2, 0), "both rotations counted as into a spare");
        append_big_batches(&unfilled, 30);
        assert_eq!(scraped_rotations(&unfilled), (0, 2), "without spares, both rotations allocate new files");

        let mut crashed =
            EngineHarness { dir: crate::conformance::crash_copy(h.dir.path()), config: h.config.clone(), store: None };
        crashed.restart();
        assert_eq!(all(&crashed, 1), expected, "after a crash");
        h.restart();
        assert_eq!(all(&h, 1), expected, "after a restart");
    }

    /// A crash in the middle of a rotation into a spare: the spare is
    /// renamed into place (the next file's name) and its header was never
    /// written, so the newest file is all zeros. Recovery must keep every
    /// record, append after the last one, and keep that through another
    /// restart.
    #[test]
    fn a_crash_between_taking_a_spare_and_writing_its_header_keeps_every_record() {
        let mut h = EngineHarness::prefilled();
        h.store().create_shard(1).unwrap();
        append(&h, 1, 1, 100, 1).unwrap();
        drop(h.store.take());
        let files = log_files(h.dir.path());
        assert_eq!(files.len(), 1, "{files:?}");
        let spare = spare_files(h.dir.path()).remove(0).0;
        let next = h.dir.path().join("0000000000000002.raftlog");
        std::fs::rename(&spare, &next).unwrap();

        h.restart();
        assert_eq!(all(&h, 1), frames(1, 100, 1));
        let newest = log_files(h.dir.path()).pop().unwrap().0;
        assert_eq!(newest, next, "recovery took the headerless file as the active one");
        append(&h, 1, 101, 50, 2).unwrap();
        h.restart();
        let mut expected = frames(1, 100, 1);
        expected.extend(frames(101, 50, 2));
        assert_eq!(all(&h, 1), expected);
    }
}
