//! A shard's producer table rebuilt from its snapshot and the records
//! after it: at the WAL's start and after every truncation.

use super::*;

/// A shard's producer table as of `last` (its newest record), from its
/// newest snapshot at or before it and the records after that: the start
/// of the WAL and every truncation. A corrupt record on the way leaves the
/// table marked damaged (producer appends are refused) until a truncation
/// below the damage rebuilds it; the store's other errors are returned.
pub(super) fn rebuild_producers(
    store: &dyn LogStore,
    limits: &ProducerLimits,
    shard: ShardId,
    last: u64,
) -> Result<ProducerState, StoreError> {
    let bounds = store.bounds(shard)?;
    let snapshots = store.producer_snapshots(shard)?;
    let mut state = ProducerState::empty(bounds.first_seqno - 1);
    state.snapshots = snapshots.iter().map(|(seqno, _)| *seqno).collect();
    let start = snapshots.iter().rev().find(|(seqno, _)| *seqno <= last);
    if let Some((seqno, bytes)) = start {
        match ProducerTable::decode(bytes) {
            Ok(table) if table.applied_through() == *seqno => state.table = table,
            Ok(table) => {
                state.damaged =
                    Some(format!("its producer snapshot at seqno {seqno} says seqno {}", table.applied_through()));
                return Ok(state);
            }
            Err(e) => {
                state.damaged = Some(format!("its producer snapshot at seqno {seqno}: {e}"));
                return Ok(state);
            }
        }
    } else if !state.snapshots.is_empty() {
        // Every snapshot is newer than `last`: no record up to it holds a
        // stamp (see `Sequencer::apply_producers`).
        state.table = ProducerTable::empty_at(bounds.first_seqno - 1);
    }
    let mut next = state.table.applied_through() + 1;
    // Records before the first retained are compacted: the table starts
    // where the log does when no snapshot says otherwise (no stamp there).
    if next < bounds.first_seqno {
        state.table = ProducerTable::empty_at(bounds.first_seqno - 1);
        next = bounds.first_seqno;
    }
    debug_assert!(next >= bounds.first_seqno);
    match replay(store, limits, shard, &mut state.table, last)? {
        Ok(bytes) => state.since_snapshot = bytes,
        Err(damage) => state.damaged = Some(damage),
    }
    Ok(state)
}

/// Applies the shard's stored records after `table`'s through `last` to
/// it, and answers their frame bytes; a corrupt record on the way stops it
/// (the inner error says where), other store errors are returned.
pub(super) fn replay(
    store: &dyn LogStore,
    limits: &ProducerLimits,
    shard: ShardId,
    table: &mut ProducerTable,
    last: u64,
) -> Result<Result<u64, String>, StoreError> {
    let mut bytes = 0;
    let mut next = table.applied_through() + 1;
    while next <= last {
        match store.read(shard, next, last, 4 << 20) {
            Ok(frames) if !frames.is_empty() => {
                for frame in &frames {
                    table.apply(limits, frame);
                    bytes += frame.len() as u64;
                }
                next = table.applied_through() + 1;
            }
            Ok(_) => return Ok(Err(format!("the log ends before seqno {next}"))),
            Err(StoreError::Corrupt { first_seqno, .. }) => {
                return Ok(Err(format!("record {first_seqno} is corrupt; the table stops before it")));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(Ok(bytes))
}
