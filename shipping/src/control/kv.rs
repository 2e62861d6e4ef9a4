//! The leadership KV seam: compare-and-set on revisions, behind one trait
//! with two implementations that pass one conformance suite:
//!
//! * [`FileKv`]: the embedded default, a JSON file in the coordinator's data
//!   dir; every operation holds an exclusive `flock` and re-reads the file,
//!   so coordinators on one machine sharing the directory still get CAS;
//! * [`NatsKv`]: a NATS JetStream KV bucket (production).
//!
//! Revisions increase on every write of a key; `update` succeeds only
//! against the revision the caller read, which is what fences a deposed
//! coordinator.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use futures::stream::BoxStream;
use serde::{Deserialize, Serialize};

/// One key's current value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEntry {
    pub key: String,
    pub value: Bytes,
    pub revision: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum KvError {
    #[error("key {0} already exists")]
    Exists(String),
    #[error("revision conflict on {key}: expected revision {expected}")]
    Conflict { key: String, expected: u64 },
    #[error("key {0} does not exist")]
    Missing(String),
    #[error("KV unavailable: {0}")]
    Unavailable(String),
}

/// A compare-and-set key-value store.
#[async_trait::async_trait]
pub trait Kv: Send + Sync + 'static {
    async fn get(&self, key: &str) -> Result<Option<KvEntry>, KvError>;
    /// Creates `key`; fails with [`KvError::Exists`] if it exists.
    async fn create(&self, key: &str, value: Bytes) -> Result<u64, KvError>;
    /// Replaces `key` if its revision is still `revision`.
    async fn update(&self, key: &str, value: Bytes, revision: u64) -> Result<u64, KvError>;
    /// New values of `key` from now on.
    async fn watch(&self, key: &str) -> Result<BoxStream<'static, KvEntry>, KvError>;
    /// What backs it, for status pages.
    fn describe(&self) -> String;
}

// ---- file ----------------------------------------------------------------

#[derive(Debug, Default, Serialize, Deserialize)]
struct FileState {
    /// Last revision handed out (bucket-wide, like JetStream's sequence).
    revision: u64,
    entries: BTreeMap<String, FileEntry>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct FileEntry {
    value_b64: String,
    revision: u64,
}

/// File-backed KV (the embedded default).
#[derive(Clone)]
pub struct FileKv {
    dir: PathBuf,
}

struct Flock(std::fs::File);

impl Drop for Flock {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        // SAFETY: flock(2) on a descriptor this value owns.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

impl FileKv {
    pub fn open(dir: &Path) -> Result<FileKv, KvError> {
        std::fs::create_dir_all(dir).map_err(|e| KvError::Unavailable(format!("{}: {e}", dir.display())))?;
        Ok(FileKv { dir: dir.to_path_buf() })
    }

    fn lock(&self) -> Result<Flock, KvError> {
        use std::os::fd::AsRawFd;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(self.dir.join("kv.lock"))
            .map_err(|e| KvError::Unavailable(e.to_string()))?;
        // SAFETY: flock(2) on a descriptor we own; released in Drop.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(KvError::Unavailable(std::io::Error::last_os_error().to_string()));
        }
        Ok(Flock(file))
    }

    fn load(&self) -> Result<FileState, KvError> {
        match std::fs::read(self.dir.join("kv.json")) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| KvError::Unavailable(format!("kv.json: {e}"))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(FileState::default()),
            Err(e) => Err(KvError::Unavailable(e.to_string())),
        }
    }

    /// Writes the state durably: temp file, fsync, rename, fsync the dir.
    fn store(&self, state: &FileState) -> Result<(), KvError> {
        use std::io::Write;
        let io = |e: std::io::Error| KvError::Unavailable(e.to_string());
        let tmp = self.dir.join("kv.json.tmp");
        let mut file = std::fs::File::create(&tmp).map_err(io)?;
        file.write_all(&serde_json::to_vec(state).map_err(|e| KvError::Unavailable(e.to_string()))?).map_err(io)?;
        file.sync_all().map_err(io)?;
        std::fs::rename(&tmp, self.dir.join("kv.json")).map_err(io)?;
        std::fs::File::open(&self.dir).and_then(|d| d.sync_all()).map_err(io)
    }

    fn entry(key: &str, e: &FileEntry) -> KvEntry {
        let value = base64::engine::general_purpose::STANDARD.decode(&e.value_b64).unwrap_or_default();
        KvEntry { key: key.to_string(), value: Bytes::from(value), revision: e.revision }
    }

    fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&FileKv) -> Result<T, KvError> + Send + 'static,
    ) -> impl std::future::Future<Output = Result<T, KvError>> {
        let kv = self.clone();
        async move { tokio::task::spawn_blocking(move || f(&kv)).await.map_err(|e| KvError::Unavailable(e.to_string()))? }
    }

    fn put(&self, key: &str, value: &Bytes, expect: Option<u64>) -> Result<u64, KvError> {
        let _lock = self.lock()?;
        let mut state = self.load()?;
        let current = state.entries.get(key).map(|e| e.revision);
        match (expect, current) {
            (None, Some(_)) => return Err(KvError::Exists(key.to_string())),
            (Some(expected), Some(rev)) if rev != expected => {
                return Err(KvError::Conflict { key: key.to_string(), expected });
            }
            (Some(expected), None) => return Err(KvError::Conflict { key: key.to_string(), expected }),
            _ => {}
        }
        state.revision += 1;
        let revision = state.revision;
        let value_b64 = base64::engine::general_purpose::STANDARD.encode(value);
        state.entries.insert(key.to_string(), FileEntry { value_b64, revision });
        self.store(&state)?;
        Ok(revision)
    }
}

#[async_trait::async_trait]
impl Kv for FileKv {
    async fn get(&self, key: &str) -> Result<Option<KvEntry>, KvError> {
        let key = key.to_string();
        self.blocking(move |kv| {
            let _lock = kv.lock()?;
            Ok(kv.load()?.entries.get(&key).map(|e| FileKv::entry(&key, e)))
        })
        .await
    }

    async fn create(&self, key: &str, value: Bytes) -> Result<u64, KvError> {
        let key = key.to_string();
        self.blocking(move |kv| kv.put(&key, &value, None)).await
    }

    async fn update(&self, key: &str, value: Bytes, revision: u64) -> Result<u64, KvError> {
        let key = key.to_string();
        self.blocking(move |kv| kv.put(&key, &value, Some(revision))).await
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

// ---- NATS JetStream --------------------------------------------------------

/// A NATS JetStream KV bucket.
#[derive(Clone)]
pub struct NatsKv {
    client: async_nats::Client,
    store: async_nats::jetstream::kv::Store,
    url: String,
    bucket: String,
}

impl NatsKv {
    /// Connects and opens (creating if needed) `bucket`.
    pub async fn connect(url: &str, bucket: &str) -> Result<NatsKv, KvError> {
        let unavailable = |e: &dyn std::fmt::Display| KvError::Unavailable(format!("NATS {url}: {e}"));
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(2))
            .connect(url)
            .await
            .map_err(|e| unavailable(&e))?;
        let js = async_nats::jetstream::new(client.clone());
        let store = match js.get_key_value(bucket).await {
            Ok(store) => store,
            Err(_) => js
                .create_key_value(async_nats::jetstream::kv::Config {
                    bucket: bucket.to_string(),
                    // Keep a few revisions per key, so a watcher that falls a
                    // little behind still sees every write rather than only
                    // the newest.
                    history: 10,
                    ..Default::default()
                })
                .await
                .map_err(|e| unavailable(&e))?,
        };
        Ok(NatsKv { client, store, url: url.to_string(), bucket: bucket.to_string() })
    }

    /// The NATS connection, for publishing control traffic (heartbeats).
    pub fn client(&self) -> async_nats::Client {
        self.client.clone()
    }
}

#[async_trait::async_trait]
impl Kv for NatsKv {
    async fn get(&self, key: &str) -> Result<Option<KvEntry>, KvError> {
        use async_nats::jetstream::kv::Operation;
        let entry = self.store.entry(key).await.map_err(|e| KvError::Unavailable(e.to_string()))?;
        Ok(entry.filter(|e| e.operation == Operation::Put).map(|e| KvEntry {
            key: e.key,
            value: e.value,
            revision: e.revision,
        }))
    }

    async fn create(&self, key: &str, value: Bytes) -> Result<u64, KvError> {
        use async_nats::jetstream::kv::CreateErrorKind;
        self.store.create(key, value).await.map_err(|e| match e.kind() {
            CreateErrorKind::AlreadyExists => KvError::Exists(key.to_string()),
            _ => KvError::Unavailable(e.to_string()),
        })
    }

    async fn update(&self, key: &str, value: Bytes, revision: u64) -> Result<u64, KvError> {
        use async_nats::jetstream::kv::UpdateErrorKind;
        // JetStream reads an expected last revision of 0 as "the key has no
        // value", which would turn this update of a missing key into a
        // create. No write has revision 0, so it can only be a conflict (as
        // in FileKv).
        if revision == 0 {
            return Err(KvError::Conflict { key: key.to_string(), expected: revision });
        }
        self.store.update(key, value, revision).await.map_err(|e| match e.kind() {
            UpdateErrorKind::WrongLastRevision => KvError::Conflict { key: key.to_string(), expected: revision },
            _ => KvError::Unavailable(e.to_string()),
        })
    }

    async fn watch(&self, key: &str) -> Result<BoxStream<'static, KvEntry>, KvError> {
        use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
        use futures::StreamExt;
        // A pull consumer from the revision after the current one: nothing
        // is pushed before we ask, so no write can slip past while the
        // consumer is being created (the push-based KV watch can lose one).
        let seen = self.get(key).await?.map_or(0, |e| e.revision);
        let unavailable = |e: &dyn std::fmt::Display| KvError::Unavailable(e.to_string());
        let consumer = self
            .store
            .stream
            .create_consumer(pull::Config {
                filter_subject: format!("{}{key}", self.store.prefix),
                deliver_policy: DeliverPolicy::ByStartSequence { start_sequence: seen + 1 },
                ack_policy: AckPolicy::None,
                inactive_threshold: Duration::from_secs(60),
                ..Default::default()
            })
            .await
            .map_err(|e| unavailable(&e))?;
        let messages = consumer.messages().await.map_err(|e| unavailable(&e))?;
        let key = key.to_string();
        Ok(Box::pin(messages.filter_map(move |m| {
            let key = key.clone();
            async move {
                let m = m.ok()?;
                let deleted = m
                    .headers
                    .as_ref()
                    .and_then(|h| h.get("KV-Operation"))
                    .is_some_and(|op| op.as_str() == "DEL" || op.as_str() == "PURGE");
                let revision = m.info().ok()?.stream_sequence;
                (!deleted).then(|| KvEntry { key, value: m.payload.clone(), revision })
            }
        })))
    }

    fn describe(&self) -> String {
        format!("nats:{}/{}", self.url, self.bucket)
    }
}
