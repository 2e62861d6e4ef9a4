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
//! filled. A rotation that finds no recycled file later falls back to
//! raft-engine's own `fallocate`, so no group commit ever waits for a file
//! of zeros to be written. (raft-engine's `prefill_for_recycle` could fill
//! spare files for those rotations too; at a file of zeros per spare at
//! every fresh start it is not turned on.)
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

use std::io::{Result, Seek, SeekFrom, Write};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use raft_engine::env::{DefaultFileSystem, FileSystem, Permission};

type Inner = DefaultFileSystem;

/// [`DefaultFileSystem`] whose append-queue log files created while the
/// engine opens are zero-filled to `fill_bytes` and synced.
pub struct ZeroFilledFs {
    inner: Inner,
    /// Bytes of zeros a new log file gets; 0 fills nothing.
    fill_bytes: u64,
    /// Set while the engine opens: only then are new log files filled.
    opening: AtomicBool,
    /// A log file was created (and a fill tried) while the engine opened.
    created: AtomicBool,
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
            opening: AtomicBool::new(fill_bytes > 0),
            created: AtomicBool::new(false),
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
        self.opening.load(Ordering::Acquire) && path.extension().is_some_and(|ext| ext == "raftlog")
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
        if path.extension().is_some_and(|ext| ext == "raftlog") && newest.as_ref().is_none_or(|(n, _)| name > *n) {
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

impl FileSystem for ZeroFilledFs {
    type Handle = <Inner as FileSystem>::Handle;
    type Reader = <Inner as FileSystem>::Reader;
    type Writer = <Inner as FileSystem>::Writer;

    fn create<P: AsRef<Path>>(&self, path: P) -> Result<Self::Handle> {
        let path = path.as_ref();
        if !self.fills(path) {
            return self.inner.create(path);
        }
        // raft-engine creates a log file only where none is in use, and
        // resets its header right after.
        drop(std::fs::OpenOptions::new().write(true).create(true).truncate(true).open(path)?);
        self.created.store(true, Ordering::Release);
        fill(path, 0, self.fill_bytes, "zero-filling a new WAL file");
        self.inner.open(path, Permission::ReadWrite)
    }

    fn open<P: AsRef<Path>>(&self, path: P, perm: Permission) -> Result<Self::Handle> {
        self.inner.open(path, perm)
    }

    fn delete<P: AsRef<Path>>(&self, path: P) -> Result<()> {
        self.inner.delete(path)
    }

    fn rename<P: AsRef<Path>>(&self, src_path: P, dst_path: P) -> Result<()> {
        self.inner.rename(src_path, dst_path)
    }

    fn new_reader(&self, handle: Arc<Self::Handle>) -> Result<Self::Reader> {
        self.inner.new_reader(handle)
    }

    fn new_writer(&self, handle: Arc<Self::Handle>) -> Result<Self::Writer> {
        self.inner.new_writer(handle)
    }
}
