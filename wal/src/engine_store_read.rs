//! Reading a shard's records from the raft-engine store, chunk by chunk,
//! within a size limit, around merges and truncations that race the read.

use super::*;

/// The frames a read has taken so far, against its size limit.
struct Taken {
    frames: Vec<Frame>,
    size: usize,
    /// The seqno the read continues from.
    next: u64,
    max_bytes: usize,
}

impl Taken {
    /// Takes `got` in order until the next would pass the size limit (the
    /// first frame is always taken); true when the limit stopped it.
    fn take(&mut self, got: Vec<Frame>) -> bool {
        for frame in got {
            if self.size + frame.len() > self.max_bytes && !self.frames.is_empty() {
                return true;
            }
            self.size += frame.len();
            self.next = frame.seqno() + 1;
            self.frames.push(frame);
        }
        false
    }

    /// Bytes still allowed (all of them until a frame is taken).
    fn budget(&self) -> usize {
        if self.frames.is_empty() { self.max_bytes } else { self.max_bytes - self.size }
    }
}

impl EngineStore {
    /// [`LogStore::read`]: the chunk holding each next seqno, found in the
    /// chunk map and fetched, its frames walked to the ones asked for; a
    /// chunk replaced under the read is looked up again, a damaged one
    /// salvaged (`engine_store_damage.rs`).
    pub(super) fn read_chunks(&self, shard: ShardId, from: u64, to: u64, max_bytes: usize) -> StoreResult<Vec<Frame>> {
        let bounds = self.state(shard)?;
        check_range(shard, bounds, from, to)?;
        let mut taken = Taken { frames: Vec::new(), size: 0, next: from, max_bytes };
        let mut retries = 0;
        // Past its retries (or with its range gone since the range check) a
        // read lost a race with a compaction or truncation: a refusal like
        // any range outside the log, not a storage failure.
        let out_of_range = || {
            let now = self.state(shard).unwrap_or(bounds);
            StoreError::OutOfRange { shard, from, to, first: now.first_seqno, last: now.last_seqno }
        };
        // A chunk found replaced (merged, or cut by a truncation) between the
        // lookup and the fetch: wait for the write in flight, then look
        // again, a bounded number of times.
        let retry = |retries: &mut usize| {
            *retries += 1;
            if *retries > READ_RETRIES {
                return Err(out_of_range());
            }
            drop(self.write_lock.lock());
            Ok(())
        };
        while taken.next <= to {
            let next = taken.next;
            let found = {
                let shards = self.shards.lock();
                let chunks = &shards.get(&shard).ok_or(StoreError::UnknownShard(shard))?.chunks;
                chunks.find(next).map(|index| (index, chunks.span(index).expect("found")))
            };
            let Some((index, (chunk_first, chunk_last))) = found else { return Err(out_of_range()) };
            let bytes = match self.fetch_chunk(shard, index) {
                Ok(bytes) => bytes,
                // An I/O error is the device's, not damage this store can name.
                Err(e @ raft_engine::Error::Io(_)) => return Err(io(e)),
                Err(raft_engine::Error::EntryCompacted | raft_engine::Error::EntryNotFound) => {
                    retry(&mut retries)?;
                    continue;
                }
                Err(e) => match self.read_damaged(shard, index, next, to.min(chunk_last), io(e)) {
                    // The chunk holds none of them: replaced since the lookup.
                    Ok(got) if got.is_empty() => {
                        retry(&mut retries)?;
                        continue;
                    }
                    Ok(got) => {
                        if taken.take(got) {
                            return Ok(taken.frames);
                        }
                        continue;
                    }
                    Err(e) if retries < READ_RETRIES && self.replaced(shard, index, chunk_first) => {
                        tracing::debug!(shard, index, error = %e, "a chunk changed under a read; reading again");
                        retry(&mut retries)?;
                        continue;
                    }
                    Err(e) => return Err(e),
                },
            };
            match Segment::frames_in(&bytes, next, to, taken.budget()) {
                Ok((header, _)) if header.shard_id != shard => {
                    let what = format!("shard {shard}: chunk {index} holds records of shard {}", header.shard_id);
                    return Err(self.find_damage(shard, index, StoreError::Io(what)));
                }
                Ok((header, got)) if header.first_seqno != chunk_first || got.is_empty() => retry(&mut retries)?,
                Ok((_, got)) => {
                    if taken.take(got) || taken.size >= max_bytes {
                        return Ok(taken.frames);
                    }
                }
                // A chunk a truncation replaced (by a tombstone, or by its
                // prefix) since the lookup is not damage: look again.
                Err(_) if retries < READ_RETRIES && self.replaced(shard, index, chunk_first) => retry(&mut retries)?,
                Err(e) => {
                    let what = StoreError::Io(format!("shard {shard}: chunk {index}: {e}"));
                    return Err(self.find_damage(shard, index, what));
                }
            }
        }
        Ok(taken.frames)
    }
}
