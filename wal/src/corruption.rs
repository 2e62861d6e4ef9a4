//! Known damage in the node's WAL, and the scrubber that looks for it.
//!
//! The [`Registry`] holds, per shard, the ranges of records known to be
//! corrupt: found by a read ([`Detection::Read`]), by the background scrubber
//! ([`Detection::Scrub`]) or by the start-up check of the tail an unclean
//! stop left ([`Detection::Startup`]). Invariants:
//! * a shard's ranges are disjoint, not adjacent, and sorted; a report that
//!   overlaps or touches known ranges merges into them, so the same damage
//!   found twice (every read of it, every scrub pass) is one range, logged at
//!   ERROR and counted in `walship_wal_corruption_detected_total` once;
//! * a range only ever shrinks by leaving the log: a truncation drops what is
//!   after its point and a compaction what is before its point. Damage is
//!   never "forgotten" while the records are retained: the only repair is
//!   replacing them (truncate, then append a replica's copy);
//! * `walship_wal_corrupt_records{shard}` is the number of records the
//!   shard's ranges cover, updated under the same lock.
//!
//! The scrubber ([`scrub_pass`]) reads every shard's durable, retained log in
//! order through the store, which verifies raft-engine's batch checksum and
//! each frame's crc32, at a bounded rate. The default, 8 MiB/s, reads a 675
//! GiB log once a day (86,400 s x 8 MiB) while taking about 1 % of an NVMe
//! disk's (or 5 % of a SATA SSD's) sequential read bandwidth; recent records
//! usually come from the page cache anyway. A pass starts when the WAL
//! starts and then every `scrub_interval` (24 h) from the start of the
//! previous one; a log too big to finish in the interval starts the next pass
//! as soon as the last one ends. A rate of 0 disables the background passes;
//! [`crate::Wal::scrub_now`] still runs one on demand.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

use crate::metrics::WalMetrics;
use crate::store::{LogStore, ShardId, StoreError};

/// How a corrupt range was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Detection {
    /// A read (shipping, a client, a catch-up) hit it.
    Read,
    /// The background scrubber (or [`crate::Wal::scrub_now`]).
    Scrub,
    /// The check of the tail an unclean stop left, at start.
    Startup,
}

impl Detection {
    /// The `how` label of `walship_wal_corruption_detected_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            Detection::Read => "read",
            Detection::Scrub => "scrub",
            Detection::Startup => "startup",
        }
    }
}

/// Records `[first_bad_seqno, last_bad_seqno]` of one shard cannot be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CorruptRange {
    pub shard: ShardId,
    pub first_bad_seqno: u64,
    pub last_bad_seqno: u64,
    /// The store file holding them, when the store could tell; otherwise
    /// see `location`.
    pub file: Option<PathBuf>,
    /// Where the store keeps its files (the data dir), if it has any.
    pub location: Option<PathBuf>,
    /// When the first part of the range was found.
    pub found_at: SystemTime,
    /// How the first part of the range was found.
    pub how: Detection,
    /// The checksum failure as the store reported it.
    pub detail: String,
}

impl CorruptRange {
    pub fn records(&self) -> u64 {
        self.last_bad_seqno - self.first_bad_seqno + 1
    }
}

/// The WAL's known corrupt ranges (module docs).
pub(crate) struct Registry {
    ranges: Mutex<BTreeMap<ShardId, Vec<CorruptRange>>>,
    metrics: WalMetrics,
    /// Bumped by every truncation and compaction. A read that began before
    /// one may have met records it then removed (a repair truncating the
    /// very damage the read found): its finding is dropped, never recorded
    /// after the repair as if the replica's fresh copy were damaged (a
    /// follower would then drop good, acknowledged records to refetch them).
    generation: std::sync::atomic::AtomicU64,
}

impl Registry {
    pub(crate) fn new(metrics: WalMetrics) -> Registry {
        Registry { ranges: Mutex::new(BTreeMap::new()), metrics, generation: Default::default() }
    }

    /// The current generation; take it before a read whose damage may be
    /// recorded with [`Registry::record_error`].
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Records a store error if it is [`StoreError::Corrupt`] and no
    /// truncation or compaction ran since `generation` was taken (before the
    /// read that failed); true if it names records not known to be corrupt
    /// before.
    pub(crate) fn record_error(
        &self,
        error: &StoreError,
        how: Detection,
        location: Option<PathBuf>,
        generation: u64,
    ) -> bool {
        let StoreError::Corrupt { shard, first_seqno, last_seqno, file, detail } = error else { return false };
        let mut all = self.ranges.lock();
        if self.generation() != generation {
            tracing::debug!(shard, first_seqno, "a read met damage a truncation or compaction removed meanwhile");
            return false;
        }
        self.record_locked(
            &mut all,
            CorruptRange {
                shard: *shard,
                first_bad_seqno: *first_seqno,
                last_bad_seqno: *last_seqno,
                file: file.clone(),
                location,
                found_at: SystemTime::now(),
                how,
                detail: detail.clone(),
            },
        )
    }

    /// Adds a range, merging it with the known ones it overlaps or touches;
    /// true (and logged at ERROR, and counted) if any of it is new.
    pub(crate) fn record(&self, range: CorruptRange) -> bool {
        let mut all = self.ranges.lock();
        self.record_locked(&mut all, range)
    }

    fn record_locked(&self, all: &mut BTreeMap<ShardId, Vec<CorruptRange>>, range: CorruptRange) -> bool {
        let ranges = all.entry(range.shard).or_default();
        let covered = ranges
            .iter()
            .any(|r| r.first_bad_seqno <= range.first_bad_seqno && range.last_bad_seqno <= r.last_bad_seqno);
        if covered {
            return false;
        }
        tracing::error!(
            shard = range.shard,
            first_bad_seqno = range.first_bad_seqno,
            last_bad_seqno = range.last_bad_seqno,
            file = %range.file.as_ref().map_or_else(|| "unknown".to_owned(), |f| f.display().to_string()),
            data_dir = %range.location.as_ref().map_or_else(String::new, |d| d.display().to_string()),
            how = range.how.as_str(),
            detail = %range.detail,
            "WAL corruption: stored records cannot be read; they must be repaired from a replica"
        );
        self.metrics.corruption_detected.with_label_values(&[range.how.as_str()]).inc();
        let mut merged = range;
        ranges.retain(|r| {
            let touches = r.first_bad_seqno <= merged.last_bad_seqno.saturating_add(1)
                && merged.first_bad_seqno <= r.last_bad_seqno.saturating_add(1);
            if touches {
                // The older finding keeps its time, way and file.
                let (first, last) =
                    (r.first_bad_seqno.min(merged.first_bad_seqno), r.last_bad_seqno.max(merged.last_bad_seqno));
                if r.found_at <= merged.found_at {
                    merged = CorruptRange { first_bad_seqno: first, last_bad_seqno: last, ..r.clone() };
                } else {
                    merged.first_bad_seqno = first;
                    merged.last_bad_seqno = last;
                }
            }
            !touches
        });
        let at = ranges.partition_point(|r| r.first_bad_seqno < merged.first_bad_seqno);
        let shard = merged.shard;
        ranges.insert(at, merged);
        self.publish(shard, ranges);
        true
    }

    /// A truncation kept records through `keep_through`: damage after it is
    /// gone.
    pub(crate) fn truncated(&self, shard: ShardId, keep_through: u64) {
        self.retain(shard, |r| {
            r.last_bad_seqno = r.last_bad_seqno.min(keep_through);
            r.first_bad_seqno <= keep_through
        });
    }

    /// A compaction discarded records before `first_kept`: damage before it
    /// is gone.
    pub(crate) fn compacted(&self, shard: ShardId, first_kept: u64) {
        self.retain(shard, |r| {
            r.first_bad_seqno = r.first_bad_seqno.max(first_kept);
            r.last_bad_seqno >= first_kept
        });
    }

    fn retain(&self, shard: ShardId, mut keep: impl FnMut(&mut CorruptRange) -> bool) {
        let mut all = self.ranges.lock();
        self.generation.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        let Some(ranges) = all.get_mut(&shard) else { return };
        ranges.retain_mut(|r| keep(r));
        self.publish(shard, ranges);
        if ranges.is_empty() {
            all.remove(&shard);
        }
    }

    fn publish(&self, shard: ShardId, ranges: &[CorruptRange]) {
        let records: u64 = ranges.iter().map(CorruptRange::records).sum();
        self.metrics.corrupt_records.with_label_values(&[&shard.to_string()]).set(records as i64);
    }

    pub(crate) fn all(&self) -> Vec<CorruptRange> {
        self.ranges.lock().values().flatten().cloned().collect()
    }

    pub(crate) fn shard(&self, shard: ShardId) -> Vec<CorruptRange> {
        self.ranges.lock().get(&shard).cloned().unwrap_or_default()
    }
}

/// What one scrub pass did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ScrubReport {
    /// Records read and verified intact.
    pub records: u64,
    /// Their frame bytes.
    pub bytes: u64,
    /// Corrupt ranges found that were not known before.
    pub new_ranges: u64,
}

/// Frame bytes per scrub read: small enough that the rate limit is smooth.
const SCRUB_READ_BYTES: usize = 256 << 10;

/// Reads and verifies every shard's durable, retained log once, in order, at
/// most `bytes_per_s` (0: as fast as the store reads), recording damage.
pub(crate) fn scrub_pass(
    store: &dyn LogStore,
    registry: &Registry,
    metrics: &WalMetrics,
    bytes_per_s: u64,
) -> ScrubReport {
    let started = Instant::now();
    let mut report = ScrubReport::default();
    for shard in store.shards() {
        let Ok(bounds) = store.bounds(shard) else { continue };
        // Only durable records: the rest may still be on their way.
        let end = bounds.durable_seqno;
        let mut from = bounds.first_seqno;
        // A read meeting damage fails as a whole: the records before the
        // damage are then read up to it (`to`) before going past it.
        let mut to = end;
        while from <= end {
            let generation = registry.generation();
            match store.read(shard, from, to, SCRUB_READ_BYTES) {
                Ok(frames) => {
                    let bytes: u64 = frames.iter().map(|f| f.len() as u64).sum();
                    report.records += frames.len() as u64;
                    report.bytes += bytes;
                    metrics.scrubbed_bytes.inc_by(bytes);
                    from += frames.len().max(1) as u64;
                    if from > to {
                        to = end;
                    }
                }
                Err(e @ StoreError::Corrupt { .. }) => {
                    let (_, first, last) = e.corrupt_range().expect("corrupt");
                    if registry.record_error(&e, Detection::Scrub, store.location(), generation) {
                        report.new_ranges += 1;
                    }
                    if first > from {
                        to = first - 1;
                    } else {
                        from = last.max(from) + 1;
                        to = end;
                    }
                }
                // Truncated or compacted meanwhile, or the shard is gone:
                // the next pass reads what is retained then.
                Err(StoreError::OutOfRange { .. } | StoreError::UnknownShard(_)) => break,
                Err(e) => {
                    tracing::warn!(shard, from, error = %e, "WAL scrub could not read the shard; skipping it this pass");
                    break;
                }
            }
            throttle(started, report.bytes, bytes_per_s);
        }
    }
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    metrics.scrub_last_pass.set(now as i64);
    tracing::info!(
        records = report.records,
        bytes = report.bytes,
        new_corrupt_ranges = report.new_ranges,
        elapsed_s = started.elapsed().as_secs(),
        "WAL scrub pass done"
    );
    report
}

/// Sleeps until `bytes` read since `started` are within `bytes_per_s`.
fn throttle(started: Instant, bytes: u64, bytes_per_s: u64) {
    if bytes_per_s == 0 {
        return;
    }
    let due = Duration::from_secs_f64(bytes as f64 / bytes_per_s as f64);
    if let Some(ahead) = due.checked_sub(started.elapsed()) {
        std::thread::sleep(ahead);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_finding_from_a_read_that_a_truncation_overtook_is_dropped() {
        let registry = Registry::new(WalMetrics::unregistered());
        let corrupt = StoreError::Corrupt { shard: 1, first_seqno: 10, last_seqno: 12, file: None, detail: "x".into() };
        // The read began, then a repair truncated the damage away.
        let began = registry.generation();
        registry.truncated(1, 9);
        assert!(!registry.record_error(&corrupt, Detection::Scrub, None, began), "stale: dropped");
        assert!(registry.shard(1).is_empty());
        // A read after the truncation that still meets damage records it.
        assert!(registry.record_error(&corrupt, Detection::Scrub, None, registry.generation()));
        assert_eq!(registry.shard(1).len(), 1);
    }

    fn range(first: u64, last: u64, how: Detection) -> CorruptRange {
        CorruptRange {
            shard: 1,
            first_bad_seqno: first,
            last_bad_seqno: last,
            file: None,
            location: None,
            found_at: SystemTime::now(),
            how,
            detail: "test".into(),
        }
    }

    fn spans(registry: &Registry) -> Vec<(u64, u64)> {
        registry.shard(1).iter().map(|r| (r.first_bad_seqno, r.last_bad_seqno)).collect()
    }

    #[test]
    fn ranges_merge_count_once_and_leave_only_by_truncation_or_compaction() {
        let metrics = WalMetrics::unregistered();
        let registry = Registry::new(metrics.clone());
        let gauge = || metrics.corrupt_records.with_label_values(&["1"]).get();
        let found = |how: &str| metrics.corruption_detected.with_label_values(&[how]).get();
        assert!(registry.record(range(10, 12, Detection::Scrub)));
        assert!(!registry.record(range(11, 11, Detection::Read)), "already known");
        assert_eq!((found("scrub"), found("read")), (1, 0));
        assert!(registry.record(range(13, 14, Detection::Read)), "adjacent, new records");
        assert!(registry.record(range(20, 20, Detection::Read)));
        assert_eq!(spans(&registry), vec![(10, 14), (20, 20)]);
        assert_eq!(registry.shard(1)[0].how, Detection::Scrub, "the first finding names the range");
        assert_eq!(gauge(), 6);
        registry.compacted(1, 12);
        assert_eq!(spans(&registry), vec![(12, 14), (20, 20)]);
        registry.truncated(1, 19);
        assert_eq!(spans(&registry), vec![(12, 14)]);
        assert_eq!(gauge(), 3);
        registry.truncated(1, 11);
        assert!(registry.all().is_empty());
        assert_eq!(gauge(), 0);
    }
}
