//! raft-engine's file system with zero-filled log files (`wal.prefill`).
//!
//! On ext4, an fdatasync after appending into a fresh or fallocated region
//! must also make the region's new extent state durable (a metadata write
//! and its wait, on top of the data), while an fdatasync after overwriting
//! blocks that already hold zeros writes the data alone. Measured on this
//! project's machines: ~180 µs for a 4 KiB append + fdatasync, ~150 µs into a
//! fallocated region, ~105 µs over written blocks. A WAL pays that on every
//! group commit of every replica.
//!
//! raft-engine already recycles purged log files, so a node whose compaction
//! has purged files overwrites written blocks. What that does not cover is a
//! fresh node, whose first log file raft-engine creates empty and grows by
//! `fallocate`. [`ZeroFilledFs`] fills that file with
//! zeros up to the target file size and fsyncs it, once, while the engine
//! opens, as PostgreSQL's `wal_init_zero` does for each new WAL segment.
//!
//! Only append-queue files (`*.raftlog`) created while the engine opens are
//! filled that way. The files a growing log rotates into come from a pool of
//! spare files of zeros (`wal.spare_bytes`, [`with_spare_files`]):
//! raft-engine's `prefill_for_recycle` lays them out as `*.raftlog.reserved`
//! files while it opens, a rotation renames one into place, and files that
//! compaction purges refill the pool. The store syncs them before it serves
//! ([`sync_spare_files`]), so their write-back never queues in front of a
//! group commit. A rotation that finds the pool empty falls back to
//! raft-engine's own `fallocate`; no group commit ever waits for zeros.
//!
//! Measured (`walship-compare`, walship `QUORUM`, 4 KiB records, 64
//! clients, two alternating rounds): 36,471 / 36,284 records/s without
//! spares, 44,456 / 44,979 with them, and p999 30 ms → 5 ms, since a
//! 10 s cell at ~180 MiB/s per node grows every node's log by 1.8 GiB. A
//! thread that filled the next spare while the log wrote was measured too
//! and made it worse (24–28k, p99 16–19 ms): it doubles the bytes the disk
//! must write exactly when the log is busiest. Spares are written before the
//! node serves, or not at all.
//!
//! A fill that fails (a full disk) leaves the file as it was and the store
//! goes on without zeros.
//!
//! Crash safety is unchanged: a zero tail is what raft-engine's own
//! `fallocate` leaves behind a crash; its recovery stops there and truncates
//! the file to its last whole batch, and a rotation truncates the unused
//! tail before it syncs the file. After a restart, [`refill_active_tail`]
//! writes the zeros back behind the recovered end, so a restarted node keeps
//! the cheaper fdatasync too. Tested in `conformance::engine_prefilled`.
//!
//! Every write and sync of a log file goes through this file system's
//! [`LogHandle`] and [`LogWriter`], so that is where the `testing` feature's
//! failpoints sit (`wal::write`, `wal::sync`: [`crate::failpoints`]). Without
//! the feature both only delegate, and the writer of the newest log file
//! keeps [`WrittenEnd`]: where its written bytes end. Behind that end lie the
//! zeros of a prefill or of raft-engine's `fallocate` (which only its
//! `Engine` drop cuts, and a node exits without dropping it), or the bytes
//! of a recycled file's previous life: a clean shutdown records the end, so
//! that the next open can tell the cut recovery makes there from damage.

use std::io::{Result, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use raft_engine::env::{DefaultFileSystem, FileSystem, Handle, Permission, WriteExt};
use raft_engine::{Config, ReadableSize};

type Inner = DefaultFileSystem;

/// [`DefaultFileSystem`] whose append-queue log files created while the
/// engine opens are zero-filled to `fill_bytes` and synced.
pub struct ZeroFilledFs {
    inner: Inner,
    /// Bytes of zeros a new log file gets; 0 fills nothing.
    fill_bytes: u64,
    /// Set while the engine opens: only then are new log files filled;
    /// a log file started after it is a rotation, counted in `rotations`.
    opening: AtomicBool,
    /// A log file was created (and a fill tried) while the engine opened.
    created: AtomicBool,
    rotations: Arc<Rotations>,
    written_end: Arc<WrittenEnd>,
}

/// WAL file rotations since the store opened, by the file rotated into.
#[derive(Debug, Default)]
pub struct Rotations {
    /// Into a spare of zeros or a recycled file: blocks already written.
    pub spare: AtomicU64,
    /// Into a file created empty and allocated as the log grows (the spare
    /// pool was empty): its group commits' fdatasyncs also write extent
    /// metadata.
    pub new: AtomicU64,
}

/// Where the append queue's newest log file ends: the file its current
/// writer writes and the offset past the last byte written (or sought to)
/// there. Shared by the file system and the store.
#[derive(Debug, Default)]
pub struct WrittenEnd {
    state: parking_lot::Mutex<EndState>,
}

#[derive(Debug, Default)]
struct EndState {
    /// The writer whose positions count (the newest one made).
    writer: u64,
    file: Option<PathBuf>,
    end: u64,
}

impl WrittenEnd {
    /// The newest log file's path and the end of what was written to it.
    pub fn get(&self) -> Option<(PathBuf, u64)> {
        let state = self.state.lock();
        state.file.clone().map(|f| (f, state.end))
    }

    /// A new writer of `file`: it is the newest from now on; its id.
    fn start(&self, file: PathBuf) -> u64 {
        let mut state = self.state.lock();
        state.writer += 1;
        state.file = Some(file);
        state.end = 0;
        state.writer
    }

    /// Writer `id` is at `at`: the end, if it is still the newest.
    fn at(&self, id: u64, at: u64) {
        let mut state = self.state.lock();
        if state.writer == id {
            state.end = at;
        }
    }
}

/// Write zeros in pieces of this size.
const ZEROS_CHUNK: usize = 1 << 20;

impl ZeroFilledFs {
    /// `fill_bytes` of zeros for every log file created until
    /// [`opened`](Self::opened) is called; 0 behaves as the default file
    /// system.
    pub fn new(fill_bytes: u64) -> ZeroFilledFs {
        ZeroFilledFs {
            inner: DefaultFileSystem,
            fill_bytes,
            opening: AtomicBool::new(true),
            created: AtomicBool::new(false),
            rotations: Arc::default(),
            written_end: Arc::default(),
        }
    }

    /// Where the newest log file's written bytes end (shared).
    pub fn written_end(&self) -> Arc<WrittenEnd> {
        self.written_end.clone()
    }

    /// The rotation counts, shared (the node's `/metrics` reads them).
    pub fn rotations(&self) -> Arc<Rotations> {
        self.rotations.clone()
    }

    /// Counts a log file started at `path` as a rotation into `kind`, once
    /// the engine has opened.
    fn count_rotation(&self, path: &Path, kind: &AtomicU64) {
        if !self.opening.load(Ordering::Acquire) && is_log_file(path) {
            kind.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The engine has opened: later files are created as raft-engine does.
    /// Returns whether it created (and tried to fill) a log file while it
    /// opened; if not, it reopened files and [`refill_active_tail`] applies.
    pub fn opened(&self) -> bool {
        self.opening.store(false, Ordering::Release);
        self.created.load(Ordering::Acquire)
    }

    fn fills(&self, path: &Path) -> bool {
        self.fill_bytes > 0 && self.opening.load(Ordering::Acquire) && is_log_file(path)
    }
}

/// Writes zeros over `[from, to)` of the file at `path` and fsyncs it (not
/// fdatasync: the size and the extents are the point); `what` names the
/// fill in the log. Returns whether the zeros are there.
///
/// A failure (a full disk, a file size limit) is not an error: the file is
/// cut back to `from` and the store goes on without the zeros, which only
/// make fsyncs cheaper. A node must not refuse to start for want of them.
fn fill(path: &Path, from: u64, to: u64, what: &str) -> bool {
    let started = std::time::Instant::now();
    let mut file = match std::fs::OpenOptions::new().write(true).open(path) {
        Ok(file) => file,
        Err(error) => {
            tracing::warn!(file = %path.display(), %error, "{what} failed to open the file; going on without zeros");
            return false;
        }
    };
    match write_zeros(&mut file, from, to) {
        Ok(()) => {
            tracing::info!(
                file = %path.display(),
                mib = (to - from) >> 20,
                ms = started.elapsed().as_millis() as u64,
                "{what}: done"
            );
            true
        }
        Err(error) => {
            let cut = file.set_len(from).and_then(|()| file.sync_all());
            tracing::warn!(
                file = %path.display(),
                %error,
                cut_back = cut.is_ok(),
                "{what} failed; going on without zeros (group commits pay for allocating new blocks)"
            );
            false
        }
    }
}

fn write_zeros(file: &mut std::fs::File, from: u64, to: u64) -> Result<()> {
    file.seek(SeekFrom::Start(from))?;
    let zeros = vec![0u8; ZEROS_CHUNK];
    let mut at = from;
    while at < to {
        let n = (to - at).min(ZEROS_CHUNK as u64) as usize;
        file.write_all(&zeros[..n])?;
        at += n as u64;
    }
    file.sync_all()
}

/// After the engine under `dir` has opened: extends its active (newest)
/// append-queue log file with zeros up to `fill_bytes`, durably, and
/// returns how many bytes it wrote (0 also when it could not: see [`fill`]).
///
/// Recovery cuts a file's zero tail at the last whole batch, and raft-engine
/// then grows the file by `fallocate` again. Its writer continues at the
/// recovered end and only ever `fallocate`s ahead of itself, which leaves
/// blocks already written untouched; so the zeros written here are what its
/// next appends overwrite. Call it before the first write after opening,
/// while nothing else writes to the engine.
pub fn refill_active_tail(dir: &Path, fill_bytes: u64) -> Result<u64> {
    let mut newest: Option<(String, std::path::PathBuf)> = None;
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        // Names are zero-padded sequence numbers: the greatest is the newest.
        let Some(name) = path.file_name().and_then(|n| n.to_str()).map(str::to_owned) else { continue };
        if is_log_file(&path) && newest.as_ref().is_none_or(|(n, _)| name > *n) {
            newest = Some((name, path));
        }
    }
    let Some((_, path)) = newest else { return Ok(0) };
    let len = std::fs::metadata(&path)?.len();
    if len >= fill_bytes || !fill(&path, len, fill_bytes, "zero-filling the recovered WAL file's tail") {
        return Ok(0);
    }
    Ok(fill_bytes - len)
}

/// An append-queue log file of raft-engine's (`*.raftlog`).
fn is_log_file(path: &Path) -> bool {
    path.extension().is_some_and(|ext| ext == "raftlog")
}

/// raft-engine's name suffix for a spare file of zeros.
pub const SPARE_SUFFIX: &str = ".raftlog.reserved";

/// `cfg` with a pool of about `spare_bytes` of spare log files of zeros:
/// raft-engine lays out `k * 3 / 2` files for a prefill limit of `k` files
/// (its margin against jitter), so `k` is the largest whose pool fits in
/// `spare_bytes`. Less than one file turns the pool off.
pub fn with_spare_files(mut cfg: Config, spare_bytes: u64) -> Config {
    let limit_files = prefill_limit_files(spare_bytes, cfg.target_file_size.0);
    cfg.prefill_for_recycle = limit_files > 0;
    cfg.prefill_limit = (limit_files > 0).then(|| ReadableSize(limit_files * cfg.target_file_size.0));
    cfg
}

/// Whole spare files of `target_file_bytes` that a pool of `spare_bytes`
/// holds, as raft-engine lays them out (see [`with_spare_files`]).
pub fn spare_files(spare_bytes: u64, target_file_bytes: u64) -> u64 {
    prefill_limit_files(spare_bytes, target_file_bytes) * 3 / 2
}

/// The largest prefill limit, in files, whose `k * 3 / 2` files fit in
/// `spare_bytes`.
fn prefill_limit_files(spare_bytes: u64, target_file_bytes: u64) -> u64 {
    let whole = spare_bytes.checked_div(target_file_bytes).unwrap_or(0);
    (1..=whole).rev().find(|k| k * 3 / 2 <= whole).unwrap_or(0)
}

/// Syncs every spare file of zeros under `dir` (raft-engine writes them
/// without a sync): their write-back is done before the store serves, not
/// queued in front of its first group commits. Cheap for files already
/// synced. Returns how many spares hold at least `file_bytes`.
///
/// raft-engine stops laying out spares at the first full disk and keeps a
/// short one after other write errors, and says so only through the `log`
/// crate, which a node does not print; a store with fewer whole spares than
/// `expected` says so here, as a warning.
pub fn sync_spare_files(dir: &Path, file_bytes: u64, expected: u64) -> Result<u64> {
    let mut whole = 0;
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.ends_with(SPARE_SUFFIX)) {
            let file = std::fs::File::open(&path)?;
            file.sync_all()?;
            whole += u64::from(file.metadata()?.len() >= file_bytes);
        }
    }
    if whole < expected {
        tracing::warn!(
            dir = %dir.display(),
            whole,
            expected,
            "fewer spare WAL files of zeros than wal.spare_bytes asks for (a full disk or a file size limit?): \
             rotations past them allocate new blocks"
        );
    } else {
        tracing::info!(dir = %dir.display(), files = whole, "spare WAL files of zeros ready");
    }
    Ok(whole)
}

/// A log file's handle: raft-engine syncs every log file through it. Holds
/// the path of an append-queue log file (`*.raftlog`), whose writer keeps
/// the [`WrittenEnd`].
pub struct LogHandle(Arc<<Inner as FileSystem>::Handle>, Option<PathBuf>);

impl LogHandle {
    fn new(inner: <Inner as FileSystem>::Handle, path: &Path) -> LogHandle {
        LogHandle(Arc::new(inner), is_log_file(path).then(|| path.to_path_buf()))
    }
}

impl Handle for LogHandle {
    fn truncate(&self, offset: usize) -> Result<()> {
        self.0.truncate(offset)
    }

    fn file_size(&self) -> Result<usize> {
        self.0.file_size()
    }

    fn sync(&self) -> Result<()> {
        // raft-engine panics when this fails (`LogFileWriter::sync`): the
        // WAL turns that panic into the end of the process (`wal.rs`).
        #[cfg(feature = "testing")]
        fail::fail_point!("wal::sync", |_| Err(crate::failpoints::injected("wal::sync")));
        self.0.sync()
    }
}

/// A log file's writer: every byte raft-engine writes to a log file. The
/// writer of an append-queue file keeps [`WrittenEnd`] at its position.
pub struct LogWriter {
    inner: <Inner as FileSystem>::Writer,
    /// This writer's id and the end it keeps, for an append-queue file.
    tracked: Option<(u64, Arc<WrittenEnd>)>,
    /// Where the next write lands.
    at: u64,
}

impl LogWriter {
    fn moved_to(&mut self, at: u64) {
        self.at = at;
        if let Some((id, end)) = &self.tracked {
            end.at(*id, at);
        }
    }
}

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> Result<usize> {
        // raft-engine returns this error from `Engine::write` (after seeking
        // back), and the WAL treats it as fatal.
        #[cfg(feature = "testing")]
        fail::fail_point!("wal::write", |_| Err(crate::failpoints::injected("wal::write")));
        let written = self.inner.write(buf)?;
        self.moved_to(self.at + written as u64);
        Ok(written)
    }

    fn flush(&mut self) -> Result<()> {
        self.inner.flush()
    }
}

impl Seek for LogWriter {
    fn seek(&mut self, pos: SeekFrom) -> Result<u64> {
        let at = self.inner.seek(pos)?;
        self.moved_to(at);
        Ok(at)
    }
}

impl WriteExt for LogWriter {
    fn truncate(&mut self, offset: usize) -> Result<()> {
        self.inner.truncate(offset)
    }

    fn allocate(&mut self, offset: usize, size: usize) -> Result<()> {
        self.inner.allocate(offset, size)
    }
}

impl FileSystem for ZeroFilledFs {
    type Handle = LogHandle;
    type Reader = <Inner as FileSystem>::Reader;
    type Writer = LogWriter;

    fn create<P: AsRef<Path>>(&self, path: P) -> Result<Self::Handle> {
        let path = path.as_ref();
        self.count_rotation(path, &self.rotations.new);
        if !self.fills(path) {
            return Ok(LogHandle::new(self.inner.create(path)?, path));
        }
        // raft-engine creates a log file only where none is in use, and
        // resets its header right after.
        drop(std::fs::OpenOptions::new().write(true).create(true).truncate(true).open(path)?);
        self.created.store(true, Ordering::Release);
        fill(path, 0, self.fill_bytes, "zero-filling a new WAL file");
        self.open(path, Permission::ReadWrite)
    }

    fn open<P: AsRef<Path>>(&self, path: P, perm: Permission) -> Result<Self::Handle> {
        let path = path.as_ref();
        Ok(LogHandle::new(self.inner.open(path, perm)?, path))
    }

    fn delete<P: AsRef<Path>>(&self, path: P) -> Result<()> {
        self.inner.delete(path)
    }

    fn rename<P: AsRef<Path>>(&self, src_path: P, dst_path: P) -> Result<()> {
        self.inner.rename(src_path, dst_path)
    }

    /// raft-engine takes a spare or recycled file for a rotation this way.
    fn reuse<P: AsRef<Path>>(&self, src_path: P, dst_path: P) -> Result<()> {
        self.count_rotation(dst_path.as_ref(), &self.rotations.spare);
        self.inner.reuse(src_path, dst_path)
    }

    fn new_reader(&self, handle: Arc<Self::Handle>) -> Result<Self::Reader> {
        self.inner.new_reader(handle.0.clone())
    }

    fn new_writer(&self, handle: Arc<Self::Handle>) -> Result<Self::Writer> {
        let tracked = handle.1.clone().map(|path| (self.written_end.start(path), self.written_end.clone()));
        Ok(LogWriter { inner: self.inner.new_writer(handle.0.clone())?, tracked, at: 0 })
    }
}
