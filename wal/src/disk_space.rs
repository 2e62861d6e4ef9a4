//! The free-space reserve of the WAL's disk (`wal.min_free_bytes`): appends
//! are refused while the file system under the data dir has less free space
//! than the reserve, so the WAL never runs into a real `ENOSPC`.
//!
//! A write raft-engine cannot complete leaves the WAL's durability unknown
//! and stops the process (`wal.rs`, `fatal`); a node that ran its disk full
//! under load would abort, and abort again at every restart that tried to
//! write. The reserve moves the refusal in front of the disk: with less than
//! `min_free_bytes` free, [`DiskSpace::check`] refuses new leader appends and
//! replicated segments (`RESOURCE_EXHAUSTED` to clients and leaders) while
//! the node keeps serving reads and the small metadata writes (epochs,
//! fences) the reserve leaves room for.
//!
//! The append path never makes a syscall for this: a small thread refreshes
//! the free space with `statvfs(2)` every [`REFRESH`], and the bytes
//! appended since the last refresh are charged against it
//! ([`DiskSpace::charge`]), so a burst between two refreshes cannot overrun
//! the reserve unseen. Leaving the full state takes the reserve plus
//! [`hysteresis`] free, so a disk hovering at the threshold does not flap
//! between refusing and accepting (and move leadership back and forth).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use prometheus::{IntGauge, Registry};

/// How often the monitor thread refreshes the free space.
pub const REFRESH: Duration = Duration::from_millis(200);

/// A node's default `wal.min_free_bytes`.
pub const DEFAULT_MIN_FREE_BYTES: u64 = 256 << 20;

/// Extra free space, beyond the reserve, a full disk needs before appends
/// are accepted again: an eighth of the reserve, at most 64 MiB.
pub fn hysteresis(min_free_bytes: u64) -> u64 {
    (min_free_bytes / 8).min(64 << 20)
}

/// Whether the disk counts as full, given whether it did before and the
/// free bytes now (the pure decision the monitor and appends make).
/// A reserve of 0 turns the check off.
pub fn is_full(was_full: bool, free_bytes: u64, min_free_bytes: u64) -> bool {
    if min_free_bytes == 0 {
        return false;
    }
    if was_full { free_bytes < min_free_bytes + hysteresis(min_free_bytes) } else { free_bytes < min_free_bytes }
}

/// Free bytes of the file system holding `dir`, as an unprivileged process
/// may use them (`f_bavail`).
pub fn free_bytes(dir: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "path holds a NUL byte"))?;
    // SAFETY: statvfs(3) on a NUL-terminated path into a zeroed struct it fills.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(path.as_ptr(), &mut stat) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((stat.f_bavail as u64).saturating_mul(stat.f_frsize as u64))
}

/// Why an append was refused: the disk under the WAL is (nearly) full.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "disk full: the WAL's disk ({dir}) has {free_bytes} bytes free, less than the {min_free_bytes}-byte reserve \
     (wal.min_free_bytes); appends are refused until space is freed"
)]
pub struct DiskFull {
    pub dir: String,
    pub free_bytes: u64,
    pub min_free_bytes: u64,
}

/// The free space of the WAL's disk, refreshed in the background.
#[derive(Debug)]
pub struct DiskSpace {
    dir: PathBuf,
    min_free_bytes: u64,
    /// Free bytes at the last refresh.
    free: AtomicU64,
    /// Bytes appended since the last refresh (not yet in `free`).
    charged: AtomicU64,
    full: AtomicBool,
    free_gauge: IntGauge,
    full_gauge: IntGauge,
}

impl DiskSpace {
    /// Measures the disk under `dir` once; [`DiskSpace::start_monitor`]
    /// keeps it fresh. A `statvfs` that fails here is an error (a wrong
    /// path); later failures keep the last reading.
    pub fn new(dir: &Path, min_free_bytes: u64) -> std::io::Result<Arc<DiskSpace>> {
        let free = free_bytes(dir)?;
        let space = Arc::new(DiskSpace {
            dir: dir.to_path_buf(),
            min_free_bytes,
            free: AtomicU64::new(free),
            charged: AtomicU64::new(0),
            full: AtomicBool::new(false),
            free_gauge: IntGauge::new("walship_wal_disk_free_bytes", "Free bytes of the file system under the WAL")
                .expect("valid metric"),
            full_gauge: IntGauge::new(
                "walship_wal_disk_full",
                "1 while the WAL's disk has less free space than wal.min_free_bytes (appends refused), else 0",
            )
            .expect("valid metric"),
        });
        space.update(free);
        Ok(space)
    }

    /// Registers the free-bytes and disk-full gauges.
    pub fn register(&self, registry: &Registry) -> prometheus::Result<()> {
        registry.register(Box::new(self.free_gauge.clone()))?;
        registry.register(Box::new(self.full_gauge.clone()))
    }

    /// Refreshes every [`REFRESH`] on a small thread until every other
    /// handle is gone.
    pub fn start_monitor(self: &Arc<Self>) -> std::io::Result<()> {
        let weak: Weak<DiskSpace> = Arc::downgrade(self);
        std::thread::Builder::new().name("walship-disk-space".into()).spawn(move || {
            while let Some(space) = weak.upgrade() {
                space.refresh();
                drop(space);
                std::thread::sleep(REFRESH);
            }
        })?;
        Ok(())
    }

    /// Measures the free space now.
    pub fn refresh(&self) {
        match free_bytes(&self.dir) {
            Ok(free) => {
                // What was charged before this reading is in it.
                self.charged.store(0, Ordering::Release);
                self.update(free);
            }
            Err(error) => tracing::warn!(dir = %self.dir.display(), %error, "measuring the WAL disk's free space"),
        }
    }

    fn update(&self, free: u64) {
        self.free.store(free, Ordering::Release);
        self.set_full(free);
        self.free_gauge.set(free.min(i64::MAX as u64) as i64);
    }

    fn set_full(&self, free: u64) {
        let was = self.full.load(Ordering::Acquire);
        let now = is_full(was, free, self.min_free_bytes);
        if now != was {
            self.full.store(now, Ordering::Release);
            self.full_gauge.set(i64::from(now));
            if now {
                tracing::warn!(dir = %self.dir.display(), free, min_free = self.min_free_bytes,
                    "the WAL's disk is full (less free than wal.min_free_bytes): refusing appends");
            } else {
                tracing::info!(dir = %self.dir.display(), free, "the WAL's disk has space again: accepting appends");
            }
        }
    }

    /// Estimated free bytes: the last reading less what was appended since.
    pub fn free(&self) -> u64 {
        self.free.load(Ordering::Acquire).saturating_sub(self.charged.load(Ordering::Acquire))
    }

    pub fn is_full(&self) -> bool {
        self.full.load(Ordering::Acquire)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn min_free_bytes(&self) -> u64 {
        self.min_free_bytes
    }

    /// Refuses an append of about `bytes` while the disk is full, else
    /// charges them against the free space until the next refresh. Atomics
    /// only: no syscall.
    pub fn check(&self, bytes: u64) -> Result<(), DiskFull> {
        if !self.is_full() {
            let charged = self.charged.fetch_add(bytes, Ordering::AcqRel) + bytes;
            let free = self.free.load(Ordering::Acquire).saturating_sub(charged);
            if !is_full(false, free, self.min_free_bytes) {
                return Ok(());
            }
            self.set_full(free);
        }
        Err(self.refusal())
    }

    /// The refusal a full disk answers with.
    pub fn refusal(&self) -> DiskFull {
        DiskFull { dir: self.dir.display().to_string(), free_bytes: self.free(), min_free_bytes: self.min_free_bytes }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_below_the_reserve_and_clear_only_past_the_hysteresis() {
        let min = 64 << 20;
        assert!(!is_full(false, min, min));
        assert!(is_full(false, min - 1, min));
        // Once full, the reserve alone is not enough to resume.
        assert!(is_full(true, min, min));
        assert!(is_full(true, min + hysteresis(min) - 1, min));
        assert!(!is_full(true, min + hysteresis(min), min));
        // A reserve of 0 never refuses, even on a disk with no space.
        assert!(!is_full(false, 0, 0));
        assert!(!is_full(true, 0, 0));
        assert_eq!(hysteresis(8 << 30), 64 << 20);
    }

    #[test]
    fn appends_are_charged_until_the_next_refresh() {
        let dir = tempfile::tempdir().unwrap();
        // A reserve just under what is free: a few appends cross it before
        // any refresh, with no syscall of their own. Other tests share the
        // disk: measure until the free space held still across the store's
        // own measurement.
        let (free, space) = (0..100)
            .find_map(|_| {
                let free = free_bytes(dir.path()).unwrap();
                assert!(free > 4096, "the test needs some free space");
                let space = DiskSpace::new(dir.path(), free - 2048).unwrap();
                (space.free() == free).then_some((free, space))
            })
            .expect("the disk's free space held still once in 100 tries");
        assert!(!space.is_full());
        space.check(1000).unwrap();
        let refused = space.check(2000).unwrap_err();
        assert!(space.is_full());
        assert_eq!(refused.min_free_bytes, free - 2048);
        assert!(refused.to_string().contains(&dir.path().display().to_string()), "{refused}");
        // Still refused, whatever the size.
        assert!(space.check(0).is_err());
    }

    #[test]
    fn a_disk_with_room_refuses_nothing_and_the_gauges_follow() {
        let dir = tempfile::tempdir().unwrap();
        let space = DiskSpace::new(dir.path(), 1).unwrap();
        let registry = Registry::new();
        space.register(&registry).unwrap();
        space.refresh();
        assert!(space.check(10).is_ok());
        assert!(!space.is_full());
        assert_eq!(space.full_gauge.get(), 0);
        assert!(space.free_gauge.get() > 0);
        // An impossible reserve: full at the next refresh, gauge set.
        let space = DiskSpace::new(dir.path(), u64::MAX / 2).unwrap();
        assert!(space.is_full());
        assert_eq!(space.full_gauge.get(), 1);
        assert!(DiskSpace::new(Path::new("/nonexistent/walship"), 1).is_err());
    }
}
