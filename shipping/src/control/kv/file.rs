//! [`FileKv`]: the embedded leadership KV, an append-only log in one
//! directory.
//!
//! `kv.log` is a sequence of records, one per write (a single key, or a
//! whole [`Kv::write_batch`]):
//!
//! ```text
//! [u32 LE payload length][u32 LE crc32 of payload][payload: JSON LogRecord]
//! ```
//!
//! A write appends one record and fdatasyncs it, so it costs what it
//! changes, not the size of the bucket, and a batch is atomic: a record cut
//! short by a crash fails its length or checksum and is dropped (the next
//! writer truncates it away before appending). A record that fails its
//! checksum with whole records after it is damage, not a torn write: the
//! store refuses to work on it rather than drop what follows. When the log grows past
//! [`COMPACT_AT`] and four times what is live, the writer rewrites it as one
//! record of the live keys (temp file, fsync, rename, fsync the dir).
//!
//! Every operation holds an exclusive `flock` on `kv.lock`, then reads what
//! was appended since it last looked (a new inode means another process
//! compacted: it reads the whole file), so processes sharing the directory
//! see one store. A `kv.json` left by walship before this layout (one JSON
//! file rewritten on every write) is converted on first use.

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use futures::stream::BoxStream;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::{Kv, KvEntry, KvError, KvSnapshot};

const LOG: &str = "kv.log";
const LEGACY_JSON: &str = "kv.json";
/// Compact once the log is this long and four times the live data.
const COMPACT_AT: u64 = 4 << 20;
/// Refuse records longer than this (a corrupt length field).
const MAX_RECORD: u32 = 256 << 20;

#[derive(Debug, Serialize, Deserialize)]
struct LogRecord {
    /// The bucket revision after this record.
    revision: u64,
    puts: Vec<LogPut>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct LogPut {
    key: String,
    value_b64: String,
    revision: u64,
}

/// What the log holds, as of `offset`.
#[derive(Debug, Default)]
struct Loaded {
    /// Inode of the log read (0: no log yet).
    ino: u64,
    /// End of the last whole record read.
    offset: u64,
    /// Bytes past `offset` that do not form a whole record (a torn write).
    torn: bool,
    revision: u64,
    entries: BTreeMap<String, (Bytes, u64)>,
    /// Encoded size of the live entries (for compaction).
    live_bytes: u64,
}

/// The bytes a key holding a value of `value_len` bytes takes in a
/// compacted log: its base64 value, the key, and about 48 bytes of JSON
/// around them. Only an estimate, which decides when to compact.
fn live_size(key: &str, value_len: usize) -> u64 {
    (key.len() + value_len.div_ceil(3) * 4 + 48) as u64
}

impl Loaded {
    fn apply(&mut self, record: LogRecord) -> Result<(), String> {
        for put in record.puts {
            let value = base64::engine::general_purpose::STANDARD
                .decode(&put.value_b64)
                .map_err(|e| format!("key {}: {e}", put.key))?;
            let size = live_size(&put.key, value.len());
            if let Some((old, _)) = self.entries.insert(put.key.clone(), (Bytes::from(value), put.revision)) {
                self.live_bytes = self.live_bytes.saturating_sub(live_size(&put.key, old.len()));
            }
            self.live_bytes += size;
        }
        self.revision = self.revision.max(record.revision);
        Ok(())
    }

    fn entry(&self, key: &str) -> Option<KvEntry> {
        self.entries.get(key).map(|(value, revision)| KvEntry {
            key: key.to_string(),
            value: value.clone(),
            revision: *revision,
        })
    }
}

/// What a write checks before it writes.
enum Expect {
    /// The key does not exist.
    Absent(String),
    /// The key exists at this revision.
    KeyAt(String, u64),
    /// Nothing was written after this bucket revision.
    BucketAt(u64),
}

/// File-backed KV (the embedded default).
#[derive(Clone)]
pub struct FileKv {
    dir: PathBuf,
    /// What this instance read of the log so far (under the flock).
    loaded: Arc<Mutex<Loaded>>,
    /// Set once this instance found no `kv.json` to convert (or converted
    /// it): the check is one failed open per operation otherwise. A `kv.json`
    /// written later by an older build is not looked for again; the
    /// upgrade notes have older coordinators stopped first.
    legacy_checked: Arc<std::sync::atomic::AtomicBool>,
}

struct Flock(std::fs::File);

impl Drop for Flock {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        // SAFETY: flock(2) on a descriptor this value owns.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

fn io(e: std::io::Error) -> KvError {
    KvError::Unavailable(e.to_string())
}

fn encode_record(record: &LogRecord) -> Vec<u8> {
    let payload = serde_json::to_vec(record).expect("a log record serialises");
    let mut out = Vec::with_capacity(payload.len() + 8);
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    out.extend_from_slice(&payload);
    out
}

/// Decodes the records in `bytes`: the records and the length of the whole
/// ones. What follows them, if anything, is a torn write (a crash cut the
/// last record short) unless a whole record starts somewhere after it:
/// then the log is damaged in the middle, and the offset of that record is
/// the third value. Dropping the damage with everything after it, as a torn
/// tail is dropped, would roll the store back over committed writes
/// (epochs handed out again), so the caller refuses such a log instead.
fn decode_records(bytes: &[u8]) -> (Vec<LogRecord>, usize, Option<usize>) {
    let (mut records, mut at) = (Vec::new(), 0);
    while let Some(record) = record_at(bytes, at) {
        at += 8 + record.1;
        records.push(record.0);
    }
    let later = (at + 1..bytes.len()).find(|&o| record_at(bytes, o).is_some());
    (records, at, later)
}

/// The whole, intact record starting at `at` and its payload's length.
fn record_at(bytes: &[u8], at: usize) -> Option<(LogRecord, usize)> {
    let header = bytes.get(at..at + 8)?;
    let len = u32::from_le_bytes(header[..4].try_into().expect("4 bytes"));
    let crc = u32::from_le_bytes(header[4..].try_into().expect("4 bytes"));
    if len > MAX_RECORD {
        return None;
    }
    let payload = bytes.get(at + 8..at + 8 + len as usize)?;
    // Every record is a JSON object starting so: a cheap test before the
    // checksum, when looking for records past a damaged one.
    if !payload.starts_with(b"{\"revision\":") || crc32fast::hash(payload) != crc {
        return None;
    }
    Some((serde_json::from_slice::<LogRecord>(payload).ok()?, len as usize))
}

fn sync_dir(dir: &Path) -> Result<(), KvError> {
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io)
}

impl FileKv {
    pub fn open(dir: &Path) -> Result<FileKv, KvError> {
        std::fs::create_dir_all(dir).map_err(|e| KvError::Unavailable(format!("{}: {e}", dir.display())))?;
        Ok(FileKv { dir: dir.to_path_buf(), loaded: Arc::default(), legacy_checked: Arc::default() })
    }

    fn lock(&self) -> Result<Flock, KvError> {
        use std::os::fd::AsRawFd;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(self.dir.join("kv.lock"))
            .map_err(io)?;
        // SAFETY: flock(2) on a descriptor we own; released in Drop.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(KvError::Unavailable(std::io::Error::last_os_error().to_string()));
        }
        Ok(Flock(file))
    }

    /// Brings `loaded` up to the log's end. Call with the flock held.
    fn refresh(&self, loaded: &mut Loaded) -> Result<(), KvError> {
        use std::sync::atomic::Ordering;
        if !self.legacy_checked.load(Ordering::Acquire) {
            self.convert_legacy()?;
            self.legacy_checked.store(true, Ordering::Release);
        }
        let mut file = match std::fs::File::open(self.dir.join(LOG)) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                *loaded = Loaded::default();
                return Ok(());
            }
            Err(e) => return Err(io(e)),
        };
        let meta = file.metadata().map_err(io)?;
        if meta.ino() != loaded.ino || meta.len() < loaded.offset {
            *loaded = Loaded { ino: meta.ino(), ..Loaded::default() };
        }
        if meta.len() == loaded.offset {
            loaded.torn = false;
            return Ok(());
        }
        file.seek(SeekFrom::Start(loaded.offset)).map_err(io)?;
        let mut tail = Vec::with_capacity((meta.len() - loaded.offset) as usize);
        file.read_to_end(&mut tail).map_err(io)?;
        let (records, whole, later) = decode_records(&tail);
        if let Some(later) = later {
            return Err(KvError::Unavailable(format!(
                "{}: the record at byte {} is damaged but whole records follow at byte {}; refusing to \
                 drop them (that would hand out epochs again); restore the directory from a copy taken \
                 while the coordinators were stopped (docs/storage.md)",
                self.dir.join(LOG).display(),
                loaded.offset + whole as u64,
                loaded.offset + later as u64,
            )));
        }
        for record in records {
            loaded.apply(record).map_err(|e| KvError::Unavailable(format!("{LOG}: {e}")))?;
        }
        loaded.offset += whole as u64;
        loaded.torn = whole < tail.len();
        Ok(())
    }

    /// Converts a `kv.json` of the earlier layout into the log, once.
    fn convert_legacy(&self) -> Result<(), KvError> {
        #[derive(Deserialize)]
        struct LegacyState {
            revision: u64,
            entries: BTreeMap<String, LegacyEntry>,
        }
        #[derive(Deserialize)]
        struct LegacyEntry {
            value_b64: String,
            revision: u64,
        }
        let legacy = self.dir.join(LEGACY_JSON);
        let bytes = match std::fs::read(&legacy) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io(e)),
        };
        if !self.dir.join(LOG).exists() {
            let state: LegacyState = serde_json::from_slice(&bytes)
                .map_err(|e| KvError::Unavailable(format!("{}: {e}", legacy.display())))?;
            let puts = state
                .entries
                .into_iter()
                .map(|(key, e)| LogPut { key, value_b64: e.value_b64, revision: e.revision })
                .collect();
            self.replace_log(&LogRecord { revision: state.revision, puts })?;
            tracing::info!(dir = %self.dir.display(), "file KV: converted kv.json into the append-only kv.log");
        }
        std::fs::remove_file(&legacy).map_err(io)?;
        sync_dir(&self.dir)
    }

    /// Replaces the log by one record, atomically.
    fn replace_log(&self, record: &LogRecord) -> Result<(), KvError> {
        let tmp = self.dir.join("kv.log.tmp");
        let mut file = std::fs::File::create(&tmp).map_err(io)?;
        file.write_all(&encode_record(record)).map_err(io)?;
        file.sync_all().map_err(io)?;
        std::fs::rename(&tmp, self.dir.join(LOG)).map_err(io)?;
        sync_dir(&self.dir)
    }

    /// Reads the store under the flock.
    fn read<T>(&self, f: impl FnOnce(&Loaded) -> T) -> Result<T, KvError> {
        let _lock = self.lock()?;
        let mut loaded = self.loaded.lock();
        self.refresh(&mut loaded)?;
        Ok(f(&loaded))
    }

    /// Checks `expect`, then appends `puts` as one record. Returns the
    /// bucket revision after it.
    fn write(&self, expect: Expect, puts: Vec<(String, Bytes)>) -> Result<u64, KvError> {
        let _lock = self.lock()?;
        let mut loaded = self.loaded.lock();
        self.refresh(&mut loaded)?;
        match &expect {
            Expect::Absent(key) if loaded.entries.contains_key(key) => return Err(KvError::Exists(key.clone())),
            Expect::KeyAt(key, expected) if loaded.entries.get(key).map(|(_, r)| *r) != Some(*expected) => {
                return Err(KvError::Conflict { key: key.clone(), expected: *expected });
            }
            Expect::BucketAt(expected) if loaded.revision != *expected => {
                let key = puts.first().map(|(k, _)| k.clone()).unwrap_or_default();
                return Err(KvError::Conflict { key, expected: *expected });
            }
            _ => {}
        }
        if puts.is_empty() {
            return Ok(loaded.revision);
        }
        let first = loaded.revision;
        let puts: Vec<LogPut> = puts
            .into_iter()
            .enumerate()
            .map(|(i, (key, value))| LogPut {
                key,
                value_b64: base64::engine::general_purpose::STANDARD.encode(&value),
                revision: first + 1 + i as u64,
            })
            .collect();
        let record = LogRecord { revision: first + puts.len() as u64, puts };
        let bytes = encode_record(&record);
        let path = self.dir.join(LOG);
        let created = !path.exists();
        let mut file = std::fs::OpenOptions::new().create(true).append(true).open(&path).map_err(io)?;
        if loaded.torn {
            // A record a crash cut short: it was never acknowledged.
            file.set_len(loaded.offset).map_err(io)?;
            loaded.torn = false;
        }
        file.write_all(&bytes).map_err(io)?;
        file.sync_data().map_err(io)?;
        if created {
            sync_dir(&self.dir)?;
            loaded.ino = file.metadata().map_err(io)?.ino();
        }
        loaded.offset += bytes.len() as u64;
        loaded.apply(record).map_err(KvError::Unavailable)?;
        if loaded.offset > COMPACT_AT && loaded.offset > 4 * loaded.live_bytes {
            self.compact(&mut loaded)?;
        }
        Ok(loaded.revision)
    }

    /// Rewrites the log as one record of the live keys.
    fn compact(&self, loaded: &mut Loaded) -> Result<(), KvError> {
        let puts = loaded
            .entries
            .iter()
            .map(|(key, (value, revision))| LogPut {
                key: key.clone(),
                value_b64: base64::engine::general_purpose::STANDARD.encode(value),
                revision: *revision,
            })
            .collect();
        let record = LogRecord { revision: loaded.revision, puts };
        self.replace_log(&record)?;
        let meta = std::fs::metadata(self.dir.join(LOG)).map_err(io)?;
        (loaded.ino, loaded.offset, loaded.torn) = (meta.ino(), meta.len(), false);
        tracing::debug!(dir = %self.dir.display(), bytes = meta.len(), "file KV: compacted kv.log");
        Ok(())
    }

    fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&FileKv) -> Result<T, KvError> + Send + 'static,
    ) -> impl std::future::Future<Output = Result<T, KvError>> {
        let kv = self.clone();
        async move { tokio::task::spawn_blocking(move || f(&kv)).await.map_err(|e| KvError::Unavailable(e.to_string()))? }
    }
}

#[async_trait::async_trait]
impl Kv for FileKv {
    async fn get(&self, key: &str) -> Result<Option<KvEntry>, KvError> {
        let key = key.to_string();
        self.blocking(move |kv| kv.read(|l| l.entry(&key))).await
    }

    async fn create(&self, key: &str, value: Bytes) -> Result<u64, KvError> {
        let key = key.to_string();
        self.blocking(move |kv| kv.write(Expect::Absent(key.clone()), vec![(key, value)])).await
    }

    async fn update(&self, key: &str, value: Bytes, revision: u64) -> Result<u64, KvError> {
        let key = key.to_string();
        self.blocking(move |kv| kv.write(Expect::KeyAt(key.clone(), revision), vec![(key, value)])).await
    }

    async fn scan(&self) -> Result<KvSnapshot, KvError> {
        self.blocking(|kv| {
            kv.read(|l| KvSnapshot {
                entries: l.entries.keys().filter_map(|k| l.entry(k)).collect(),
                revision: l.revision,
            })
        })
        .await
    }

    async fn write_batch(&self, revision: u64, puts: Vec<(String, Bytes)>) -> Result<u64, KvError> {
        self.blocking(move |kv| kv.write(Expect::BucketAt(revision), puts)).await
    }

    async fn watch(&self, key: &str) -> Result<BoxStream<'static, KvEntry>, KvError> {
        // Polling keeps the watch working across processes sharing the dir.
        let start = self.get(key).await?.map_or(0, |e| e.revision);
        let (kv, key) = (self.clone(), key.to_string());
        let stream = futures::stream::unfold(start, move |seen| {
            let (kv, key) = (kv.clone(), key.clone());
            async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    if let Ok(Some(entry)) = kv.get(&key).await
                        && entry.revision > seen
                    {
                        let revision = entry.revision;
                        return Some((entry, revision));
                    }
                }
            }
        });
        Ok(Box::pin(stream))
    }

    fn describe(&self) -> String {
        format!("file:{}", self.dir.display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(s: &str) -> Bytes {
        Bytes::copy_from_slice(s.as_bytes())
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
    }

    #[test]
    fn a_torn_tail_is_dropped_and_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let rt = runtime();
        let kv = FileKv::open(dir.path()).unwrap();
        let r1 = rt.block_on(kv.write_batch(0, vec![("a".into(), b("1")), ("b".into(), b("2"))])).unwrap();
        assert_eq!(r1, 2);
        let log = dir.path().join(LOG);
        let whole = std::fs::metadata(&log).unwrap().len();
        // A crash in the middle of the next record: half of it on disk.
        let next = encode_record(&LogRecord {
            revision: 3,
            puts: vec![LogPut { key: "a".into(), value_b64: "OQ==".into(), revision: 3 }],
        });
        let mut file = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
        file.write_all(&next[..next.len() / 2]).unwrap();
        drop(file);

        // A fresh process sees what was whole, and the revision before it.
        let other = FileKv::open(dir.path()).unwrap();
        let snapshot = rt.block_on(other.scan()).unwrap();
        assert_eq!(snapshot.revision, 2);
        assert_eq!(snapshot.entries.len(), 2);
        assert_eq!(snapshot.entries[0].value, b("1"));
        // Its next write replaces the torn bytes.
        assert_eq!(rt.block_on(other.update("a", b("3"), 1)).unwrap(), 3);
        let bytes = std::fs::read(&log).unwrap();
        let (records, read, later) = decode_records(&bytes);
        assert_eq!(
            (records.len(), read, later),
            (2, bytes.len(), None),
            "the torn half was truncated before the append"
        );
        assert!(bytes.len() as u64 > whole);
        assert_eq!(rt.block_on(FileKv::open(dir.path()).unwrap().get("a")).unwrap().unwrap().value, b("3"));
        // The first instance catches up.
        assert_eq!(rt.block_on(kv.get("a")).unwrap().unwrap().revision, 3);
    }

    #[test]
    fn a_corrupt_record_ends_the_log_there() {
        let dir = tempfile::tempdir().unwrap();
        let rt = runtime();
        let kv = FileKv::open(dir.path()).unwrap();
        rt.block_on(kv.create("a", b("1"))).unwrap();
        rt.block_on(kv.create("b", b("2"))).unwrap();
        let mut bytes = std::fs::read(dir.path().join(LOG)).unwrap();
        let last = bytes.len() - 2;
        bytes[last] ^= 0xff;
        std::fs::write(dir.path().join(LOG), &bytes).unwrap();
        let fresh = FileKv::open(dir.path()).unwrap();
        let snapshot = rt.block_on(fresh.scan()).unwrap();
        assert_eq!((snapshot.revision, snapshot.entries.len()), (1, 1), "the flipped record is not read");
    }

    #[test]
    fn a_damaged_record_followed_by_whole_ones_is_refused_not_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let rt = runtime();
        let kv = FileKv::open(dir.path()).unwrap();
        for (key, value) in [("a", "1"), ("b", "2"), ("c", "3")] {
            rt.block_on(kv.create(key, b(value))).unwrap();
        }
        let log = dir.path().join(LOG);
        let mut bytes = std::fs::read(&log).unwrap();
        // A flipped byte inside the first record's payload.
        bytes[12] ^= 0xff;
        std::fs::write(&log, &bytes).unwrap();
        let fresh = FileKv::open(dir.path()).unwrap();
        let refused = rt.block_on(fresh.scan()).unwrap_err().to_string();
        assert!(refused.contains("byte 0") && refused.contains("whole records follow"), "{refused}");
        // A write is refused too, and nothing is truncated or appended (the
        // old reader dropped records 2 and 3 at its next write).
        assert!(rt.block_on(fresh.create("d", b("4"))).is_err());
        assert_eq!(std::fs::read(&log).unwrap(), bytes);
    }

    #[test]
    fn compaction_keeps_every_key_and_revision() {
        let dir = tempfile::tempdir().unwrap();
        let rt = runtime();
        let kv = FileKv::open(dir.path()).unwrap();
        let other = FileKv::open(dir.path()).unwrap();
        let value = Bytes::from(vec![b'x'; 4096]);
        let mut revision = 0;
        // About 12 MiB of rewrites of 10 keys: compacts at least once.
        for round in 0..300u64 {
            let puts = (0..10).map(|k| (format!("k{k}"), value.clone())).collect();
            revision = rt.block_on(kv.write_batch(revision, puts)).unwrap();
            assert_eq!(revision, (round + 1) * 10);
        }
        let len = std::fs::metadata(dir.path().join(LOG)).unwrap().len();
        assert!(len < COMPACT_AT, "the log was compacted: {len} bytes");
        // Another process (it read an older inode) and a fresh one agree.
        for reader in [&other, &FileKv::open(dir.path()).unwrap()] {
            let snapshot = rt.block_on(reader.scan()).unwrap();
            assert_eq!(snapshot.revision, 3000);
            let revisions: Vec<u64> = snapshot.entries.iter().map(|e| e.revision).collect();
            assert_eq!(revisions, (2991..=3000).collect::<Vec<_>>());
            assert!(snapshot.entries.iter().all(|e| e.value == value));
        }
        // And it keeps writing where it was.
        assert_eq!(rt.block_on(other.write_batch(3000, vec![("k0".into(), b("new"))])).unwrap(), 3001);
    }

    #[test]
    fn a_legacy_json_file_is_converted_once() {
        let dir = tempfile::tempdir().unwrap();
        let rt = runtime();
        let legacy = serde_json::json!({
            "revision": 7,
            "entries": {
                "cluster-state": {"value_b64": "eyJ4IjoxfQ==", "revision": 7},
                "other": {"value_b64": "dg==", "revision": 3},
            }
        });
        std::fs::write(dir.path().join(LEGACY_JSON), serde_json::to_vec(&legacy).unwrap()).unwrap();
        let kv = FileKv::open(dir.path()).unwrap();
        let entry = rt.block_on(kv.get("cluster-state")).unwrap().unwrap();
        assert_eq!((entry.value, entry.revision), (b("{\"x\":1}"), 7));
        assert!(!dir.path().join(LEGACY_JSON).exists());
        assert!(dir.path().join(LOG).exists());
        // Revisions go on from the legacy bucket's.
        assert_eq!(rt.block_on(kv.update("other", b("w"), 3)).unwrap(), 8);
        assert!(matches!(rt.block_on(kv.write_batch(7, vec![])), Err(KvError::Conflict { .. })));
    }

    #[test]
    fn an_unreadable_legacy_file_is_an_error_and_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let rt = runtime();
        std::fs::write(dir.path().join(LEGACY_JSON), b"{not json").unwrap();
        let kv = FileKv::open(dir.path()).unwrap();
        let err = rt.block_on(kv.scan()).unwrap_err();
        assert!(matches!(&err, KvError::Unavailable(m) if m.contains("kv.json")), "{err}");
        assert!(dir.path().join(LEGACY_JSON).exists());
        assert!(!dir.path().join(LOG).exists());
    }
}
