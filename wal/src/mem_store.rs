//! In-memory [`LogStore`]: the test double for the pure core's unit tests.
//!
//! It keeps the same contract as the raft-engine store and adds
//! [`MemStore::crash`], which drops every non-durable record the way a
//! process crash (with the page cache lost) would.

use std::collections::{BTreeMap, VecDeque};

use parking_lot::Mutex;

use crate::record::Frame;
use crate::store::{
    LogBounds, LogStore, ShardAppend, ShardId, StoreError, StoreResult, check_compact, check_continues, check_range,
    check_truncate,
};

#[derive(Debug)]
struct MemShard {
    first_seqno: u64,
    epoch: u64,
    log_epoch: u64,
    durable_seqno: u64,
    /// Frames `first_seqno..`, in order.
    frames: VecDeque<Frame>,
}

impl MemShard {
    fn bounds(&self) -> LogBounds {
        LogBounds {
            first_seqno: self.first_seqno,
            last_seqno: self.first_seqno + self.frames.len() as u64 - 1,
            durable_seqno: self.durable_seqno,
        }
    }
}

/// In-memory multi-shard log.
#[derive(Debug, Default)]
pub struct MemStore {
    shards: Mutex<BTreeMap<ShardId, MemShard>>,
}

impl MemStore {
    pub fn new() -> MemStore {
        MemStore::default()
    }

    /// Simulates a crash: every record past each shard's durable position is
    /// lost.
    pub fn crash(&self) {
        for shard in self.shards.lock().values_mut() {
            let keep = (shard.durable_seqno + 1 - shard.first_seqno) as usize;
            shard.frames.truncate(keep);
        }
    }
}

impl LogStore for MemStore {
    fn create_shard(&self, shard: ShardId) -> StoreResult<()> {
        self.shards.lock().entry(shard).or_insert(MemShard {
            first_seqno: 1,
            epoch: 0,
            log_epoch: 0,
            durable_seqno: 0,
            frames: VecDeque::new(),
        });
        Ok(())
    }

    fn shards(&self) -> Vec<ShardId> {
        self.shards.lock().keys().copied().collect()
    }

    fn bounds(&self, shard: ShardId) -> StoreResult<LogBounds> {
        let shards = self.shards.lock();
        Ok(shards.get(&shard).ok_or(StoreError::UnknownShard(shard))?.bounds())
    }

    fn append(&self, batch: &[ShardAppend], sync: bool) -> StoreResult<()> {
        let mut shards = self.shards.lock();
        // Validate every part before touching anything: all or nothing.
        let mut next: BTreeMap<ShardId, u64> = BTreeMap::new();
        for part in batch {
            let s = shards.get(&part.shard).ok_or(StoreError::UnknownShard(part.shard))?;
            let expected = *next.entry(part.shard).or_insert(s.bounds().last_seqno + 1);
            check_continues(part.shard, expected, &part.frames)?;
            next.insert(part.shard, expected + part.frames.len() as u64);
        }
        for part in batch {
            let s = shards.get_mut(&part.shard).expect("validated");
            s.frames.extend(part.frames.iter().cloned());
        }
        if sync {
            for s in shards.values_mut() {
                s.durable_seqno = s.bounds().last_seqno;
            }
        }
        Ok(())
    }

    fn read(&self, shard: ShardId, from: u64, to: u64, max_bytes: usize) -> StoreResult<Vec<Frame>> {
        let shards = self.shards.lock();
        let s = shards.get(&shard).ok_or(StoreError::UnknownShard(shard))?;
        check_range(shard, s.bounds(), from, to)?;
        let mut out = Vec::new();
        let mut size = 0usize;
        for frame in s.frames.range((from - s.first_seqno) as usize..=(to - s.first_seqno) as usize) {
            size += frame.len();
            if size > max_bytes && !out.is_empty() {
                break;
            }
            out.push(frame.clone());
        }
        Ok(out)
    }

    fn truncate_suffix(&self, shard: ShardId, keep_through: u64) -> StoreResult<()> {
        let mut shards = self.shards.lock();
        let s = shards.get_mut(&shard).ok_or(StoreError::UnknownShard(shard))?;
        check_truncate(shard, s.bounds(), keep_through)?;
        let keep = (keep_through + 1 - s.first_seqno) as usize;
        s.frames.truncate(keep);
        s.durable_seqno = s.durable_seqno.min(keep_through);
        Ok(())
    }

    fn compact_prefix(&self, shard: ShardId, first_kept: u64) -> StoreResult<()> {
        let mut shards = self.shards.lock();
        let s = shards.get_mut(&shard).ok_or(StoreError::UnknownShard(shard))?;
        check_compact(shard, s.bounds(), first_kept)?;
        if first_kept > s.first_seqno {
            let drop = (first_kept - s.first_seqno) as usize;
            s.frames.drain(..drop.min(s.frames.len()));
            s.first_seqno = first_kept;
        }
        Ok(())
    }

    fn set_epoch(&self, shard: ShardId, epoch: u64) -> StoreResult<()> {
        let mut shards = self.shards.lock();
        let s = shards.get_mut(&shard).ok_or(StoreError::UnknownShard(shard))?;
        s.epoch = s.epoch.max(epoch);
        Ok(())
    }

    fn epoch(&self, shard: ShardId) -> StoreResult<u64> {
        Ok(self.shards.lock().get(&shard).ok_or(StoreError::UnknownShard(shard))?.epoch)
    }

    fn set_log_epoch(&self, shard: ShardId, epoch: u64) -> StoreResult<()> {
        let mut shards = self.shards.lock();
        let s = shards.get_mut(&shard).ok_or(StoreError::UnknownShard(shard))?;
        s.log_epoch = s.log_epoch.max(epoch);
        Ok(())
    }

    fn log_epoch(&self, shard: ShardId) -> StoreResult<u64> {
        Ok(self.shards.lock().get(&shard).ok_or(StoreError::UnknownShard(shard))?.log_epoch)
    }
}
