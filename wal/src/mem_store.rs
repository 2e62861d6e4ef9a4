//! In-memory [`LogStore`]: the test double for the pure core's unit tests.
//!
//! It keeps the same contract as the raft-engine store and adds
//! [`MemStore::crash`], which drops every non-durable record the way a
//! process crash (with the page cache lost) would, then "reopens": unless
//! [`LogStore::mark_clean_shutdown`] came first, it verifies every record
//! written since its previous check, as the raft-engine store verifies its
//! newest files. [`MemStore::corrupt`] flips a stored byte, so the WAL's
//! damage handling can be tested without files.
//!
//! Records are kept as their encoded bytes and parsed (crc32 verified) on
//! every read, so damage is found exactly as a disk store finds it.

use std::collections::{BTreeMap, VecDeque};

use bytes::Bytes;
use parking_lot::Mutex;

use crate::record::Frame;
use crate::store::{
    LogBounds, LogStore, ShardAppend, ShardId, SnapshotChanges, StartupDamage, StoreError, StoreResult, check_compact,
    check_continues, check_range, check_truncate,
};

#[derive(Debug)]
struct MemShard {
    first_seqno: u64,
    epoch: u64,
    log_epoch: u64,
    durable_seqno: u64,
    /// Encoded frames `first_seqno..`, in order.
    frames: VecDeque<Bytes>,
    /// Records through this seqno were verified by the last check (a clean
    /// shutdown or a crash's tail check).
    checked_through: u64,
    /// Producer snapshots by seqno.
    snapshots: BTreeMap<u64, Bytes>,
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
    /// Set by a clean shutdown, cleared by the next "open" (a crash).
    clean: Mutex<bool>,
    damage: Mutex<Vec<StartupDamage>>,
}

/// Parses a stored frame, reporting damage as [`StoreError::Corrupt`].
fn parse(shard: ShardId, seqno: u64, bytes: &Bytes) -> StoreResult<Frame> {
    let frame = Frame::parse(bytes.clone()).map_err(|e| StoreError::Corrupt {
        shard,
        first_seqno: seqno,
        last_seqno: seqno,
        file: None,
        detail: e.to_string(),
    })?;
    if frame.seqno() != seqno {
        return Err(StoreError::Corrupt {
            shard,
            first_seqno: seqno,
            last_seqno: seqno,
            file: None,
            detail: format!("holds the record of seqno {}", frame.seqno()),
        });
    }
    Ok(frame)
}

impl MemStore {
    pub fn new() -> MemStore {
        MemStore::default()
    }

    /// Simulates a crash and a restart: every record past each shard's
    /// durable position is lost; then, unless the store was shut down
    /// cleanly, every record written since the previous check is verified
    /// and the damage kept for [`LogStore::startup_damage`].
    pub fn crash(&self) {
        let clean = std::mem::replace(&mut *self.clean.lock(), false);
        let mut damage = Vec::new();
        for (&id, shard) in self.shards.lock().iter_mut() {
            let keep = (shard.durable_seqno + 1 - shard.first_seqno) as usize;
            shard.frames.truncate(keep);
            let last = shard.bounds().last_seqno;
            shard.snapshots.retain(|seqno, _| *seqno <= last);
            if !clean {
                let from = shard.checked_through.max(shard.first_seqno - 1) + 1;
                let mut seqno = from;
                while seqno <= last {
                    let at = (seqno - shard.first_seqno) as usize;
                    if let Err(StoreError::Corrupt { detail, .. }) = parse(id, seqno, &shard.frames[at]) {
                        // Extend over the adjacent damaged records.
                        let mut end = seqno;
                        while end < last && parse(id, end + 1, &shard.frames[at + (end + 1 - seqno) as usize]).is_err()
                        {
                            end += 1;
                        }
                        damage.push(StartupDamage {
                            shard: id,
                            first_seqno: seqno,
                            last_seqno: end,
                            file: None,
                            detail,
                        });
                        seqno = end;
                    }
                    seqno += 1;
                }
            }
            shard.checked_through = last;
        }
        *self.damage.lock() = damage;
    }

    /// Flips one byte in the middle of the stored record at `seqno` (tests):
    /// reads covering it fail with [`StoreError::Corrupt`] from now on.
    pub fn corrupt(&self, shard: ShardId, seqno: u64) {
        let mut shards = self.shards.lock();
        let s = shards.get_mut(&shard).expect("a hosted shard");
        let at = (seqno - s.first_seqno) as usize;
        let mut bytes = s.frames[at].to_vec();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0xff;
        s.frames[at] = Bytes::from(bytes);
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
            checked_through: 0,
            snapshots: BTreeMap::new(),
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

    fn append_with_snapshots(&self, batch: &[ShardAppend], snapshots: &SnapshotChanges, sync: bool) -> StoreResult<()> {
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
            s.frames.extend(part.frames.iter().map(|f| f.as_bytes().clone()));
        }
        for (shard, seqno) in &snapshots.drop {
            if let Some(s) = shards.get_mut(shard) {
                s.snapshots.remove(seqno);
            }
        }
        for (shard, seqno, bytes) in &snapshots.put {
            if let Some(s) = shards.get_mut(shard) {
                s.snapshots.insert(*seqno, bytes.clone());
            }
        }
        if sync {
            for s in shards.values_mut() {
                s.durable_seqno = s.bounds().last_seqno;
            }
        }
        Ok(())
    }

    fn producer_snapshots(&self, shard: ShardId) -> StoreResult<Vec<(u64, Bytes)>> {
        let shards = self.shards.lock();
        let s = shards.get(&shard).ok_or(StoreError::UnknownShard(shard))?;
        Ok(s.snapshots.iter().map(|(seqno, bytes)| (*seqno, bytes.clone())).collect())
    }

    fn read(&self, shard: ShardId, from: u64, to: u64, max_bytes: usize) -> StoreResult<Vec<Frame>> {
        let shards = self.shards.lock();
        let s = shards.get(&shard).ok_or(StoreError::UnknownShard(shard))?;
        check_range(shard, s.bounds(), from, to)?;
        let mut out = Vec::new();
        let mut size = 0usize;
        let stored = s.frames.range((from - s.first_seqno) as usize..=(to - s.first_seqno) as usize);
        for (seqno, bytes) in (from..).zip(stored) {
            let frame = match parse(shard, seqno, bytes) {
                Ok(frame) => frame,
                Err(StoreError::Corrupt { detail, file, .. }) => {
                    // Name every adjacent damaged record, up to the log's end.
                    let last = s.bounds().last_seqno;
                    let mut end = seqno;
                    while end < last && parse(shard, end + 1, &s.frames[(end + 1 - s.first_seqno) as usize]).is_err() {
                        end += 1;
                    }
                    return Err(StoreError::Corrupt { shard, first_seqno: seqno, last_seqno: end, file, detail });
                }
                Err(e) => return Err(e),
            };
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
        s.snapshots.retain(|seqno, _| *seqno <= keep_through);
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
        s.snapshots.retain(|seqno, _| *seqno + 1 >= first_kept);
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

    fn startup_damage(&self) -> Vec<StartupDamage> {
        self.damage.lock().clone()
    }

    fn mark_clean_shutdown(&self) -> StoreResult<()> {
        for shard in self.shards.lock().values_mut() {
            shard.checked_through = shard.bounds().last_seqno;
        }
        *self.clean.lock() = true;
        Ok(())
    }
}
