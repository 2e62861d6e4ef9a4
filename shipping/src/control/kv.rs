//! The leadership KV seam: compare-and-set on revisions, behind one trait
//! with two implementations that pass one conformance suite
//! (`shipping/tests/kv_conformance.rs`):
//!
//! * [`FileKv`]: the embedded default, an append-only log of write batches
//!   in the coordinator's data dir; every operation holds an exclusive
//!   `flock` and reads what other processes appended, so coordinators on
//!   one machine sharing the directory still get CAS;
//! * [`NatsKv`]: a NATS JetStream KV bucket (production).
//!
//! Revisions are bucket-wide and increase by one per key written, like a
//! JetStream stream's sequence: a key's revision is the bucket revision of
//! its last write. Two kinds of compare-and-set:
//! * per key ([`Kv::update`]): succeeds only against the key's revision the
//!   caller read;
//! * bucket-wide ([`Kv::write_batch`]): succeeds only if nothing at all was
//!   written since the bucket revision the caller read. This is what fences
//!   a deposed coordinator while the state is spread over many keys (the
//!   lease, one record per shard, the failover history): its next write
//!   fails whatever key it touches.

use bytes::Bytes;
use futures::stream::BoxStream;

mod file;
mod nats;

pub use file::FileKv;
pub use nats::NatsKv;

/// One key's current value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEntry {
    pub key: String,
    pub value: Bytes,
    pub revision: u64,
}

/// Every key of the bucket, read at once.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvSnapshot {
    pub entries: Vec<KvEntry>,
    /// The bucket revision when read. A [`Kv::write_batch`] against it
    /// succeeds only if nothing was written since, so a write that
    /// succeeds was decided on exactly these entries. (On NATS a scan
    /// racing writes may hand back an entry newer than this revision, or
    /// miss a key rewritten many times while it read; a write against the
    /// snapshot then fails, and the caller reads again.)
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

/// Most keys one [`Kv::write_batch`] applies atomically on NATS (JetStream
/// refuses atomic batches of more than 1,000 messages). FileKv applies any
/// batch atomically.
pub const ATOMIC_BATCH_KEYS: usize = 1_000;

/// A compare-and-set key-value store.
#[async_trait::async_trait]
pub trait Kv: Send + Sync + 'static {
    async fn get(&self, key: &str) -> Result<Option<KvEntry>, KvError>;
    /// Creates `key`; fails with [`KvError::Exists`] if it exists.
    async fn create(&self, key: &str, value: Bytes) -> Result<u64, KvError>;
    /// Replaces `key` if its revision is still `revision`.
    async fn update(&self, key: &str, value: Bytes, revision: u64) -> Result<u64, KvError>;
    /// Every key and the bucket revision, in a bounded number of round
    /// trips (one file read; one stream info and one consumer on NATS).
    async fn scan(&self) -> Result<KvSnapshot, KvError>;
    /// Writes every `(key, value)` (created or replaced) if the bucket's
    /// revision is still `revision`: nothing at all was written since.
    /// Returns the bucket revision after the write. Otherwise
    /// [`KvError::Conflict`] (its `key` names the first key of the batch)
    /// and nothing is written.
    ///
    /// Atomic on FileKv. On NATS, atomic per run of [`ATOMIC_BATCH_KEYS`]
    /// keys (the last run is a whole one, the first takes the remainder),
    /// each run fenced on the revision the one before it left: a failure
    /// may leave a prefix of runs written, never anything after a write of
    /// another client, and the last [`ATOMIC_BATCH_KEYS`] keys land
    /// together or not at all. A caller treats any error as "maybe
    /// written" and re-reads (the next fenced write fails anyway: the
    /// bucket moved).
    async fn write_batch(&self, revision: u64, puts: Vec<(String, Bytes)>) -> Result<u64, KvError>;
    /// New values of `key` from now on.
    async fn watch(&self, key: &str) -> Result<BoxStream<'static, KvEntry>, KvError>;
    /// What backs it, for status pages.
    fn describe(&self) -> String;
}
