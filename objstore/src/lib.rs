//! The object store: where sealed WAL segments are kept as the durable
//! copy of every shard. One trait, [`ObjectStore`], with two
//! implementations that pass one conformance suite:
//!
//! * `LocalDirStore` (embedded default, `walship dev`): a directory;
//! * `S3Store`: any S3-compatible service through `aws-sdk-s3`.
//!
//! Keys are [`ObjectKey`]s: relative, `/`-separated, validated so that no
//! key escapes its store (no `..`, no absolute paths, no empty segments).
//! Every put carries the object's CRC32C, which the store checks; every get
//! checks it again, so a corrupted object is an error
//! ([`StoreError::Corrupt`]), never wrong bytes.

use bytes::Bytes;

/// Longest key taken, in bytes (S3's limit).
pub const MAX_KEY_BYTES: usize = 1024;

/// A validated object key: `a/b/c.wseg`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectKey(String);

impl ObjectKey {
    /// Checks `key`: 1 to [`MAX_KEY_BYTES`] bytes of `/`-separated segments,
    /// each of ASCII letters, digits, `-`, `_`, `.` and `=`, none empty,
    /// `.` or `..`.
    pub fn new(key: impl Into<String>) -> Result<ObjectKey, StoreError> {
        let key = key.into();
        let bad = |why: &str| Err(StoreError::InvalidKey { key: key.clone(), reason: why.to_string() });
        if key.is_empty() || key.len() > MAX_KEY_BYTES {
            return bad("must be 1 to 1024 bytes");
        }
        for segment in key.split('/') {
            if segment.is_empty() {
                return bad("has an empty segment (a leading, trailing or doubled '/')");
            }
            if segment == "." || segment == ".." {
                return bad("has a '.' or '..' segment");
            }
            if !segment.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.=".contains(&b)) {
                return bad("may hold only ASCII letters, digits, '-', '_', '.', '=' and '/'");
            }
        }
        Ok(ObjectKey(key))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// `self/child` (`child` validated like a key).
    pub fn join(&self, child: &str) -> Result<ObjectKey, StoreError> {
        ObjectKey::new(format!("{}/{child}", self.0))
    }
}

impl std::fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// One listed object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectMeta {
    pub key: ObjectKey,
    pub size: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("object key {key:?} {reason}")]
    InvalidKey { key: String, reason: String },
    /// The store refused our credentials or permissions (a wrong secret):
    /// retrying will not help until the configuration is fixed.
    #[error("object store refused access: {0}")]
    Denied(String),
    /// The object's bytes do not match their checksum.
    #[error("object {key} is corrupt: {detail}")]
    Corrupt { key: String, detail: String },
    /// Anything else (network, server errors, timeouts): retry with backoff.
    #[error("object store unavailable: {0}")]
    Unavailable(String),
}

/// Where archived segments live.
#[async_trait::async_trait]
pub trait ObjectStore: Send + Sync + 'static {
    /// Stores `bytes` at `key` (replacing what is there), sending its
    /// CRC32C for the store to check; done only when the object is durable.
    async fn put(&self, key: &ObjectKey, bytes: Bytes) -> Result<(), StoreError>;
    /// The object at `key` (checked against its CRC32C), or `None`.
    async fn get(&self, key: &ObjectKey) -> Result<Option<Bytes>, StoreError>;
    /// Every object whose key starts with `prefix` (a key prefix, not
    /// necessarily ending at a `/`), sorted by key.
    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>, StoreError>;
    /// Removes `key`; removing a missing key is not an error.
    async fn delete(&self, key: &ObjectKey) -> Result<(), StoreError>;
    /// What it is (`s3://bucket/prefix at http://…`, `dir:/path`), for
    /// status pages and logs; never a secret.
    fn describe(&self) -> String;
}
