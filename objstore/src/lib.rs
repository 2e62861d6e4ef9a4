//! The object store: where sealed WAL segments are kept as the durable
//! copy of every shard. One trait, [`ObjectStore`], with two
//! implementations that pass one conformance suite:
//!
//! * [`LocalDirStore`] (embedded default, `walship dev`): a directory;
//! * [`S3Store`]: any S3-compatible service through `aws-sdk-s3`.
//!
//! [`conformance`] is the suite both pass (and [`conformance::FlakyStore`],
//! a wrapper failing every other call, for testing retries); [`retry`]
//! retries what is worth retrying, with exponential backoff and jitter.
//!
//! Keys are [`ObjectKey`]s: relative, `/`-separated, validated so that no
//! key escapes its store (no `..`, no absolute paths, no empty segments).
//! Every put carries the object's CRC32C, which the store checks; every get
//! checks it again, so a corrupted object is an error
//! ([`StoreError::Corrupt`]), never wrong bytes.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;

pub mod conformance;
mod local;
mod s3;

pub use local::LocalDirStore;
pub use s3::{S3Credentials, S3Settings, S3Store};

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

impl StoreError {
    /// Whether trying again may succeed: only [`StoreError::Unavailable`].
    /// A refused key, refused credentials or a corrupt object stay so.
    pub fn is_retryable(&self) -> bool {
        matches!(self, StoreError::Unavailable(_))
    }
}

/// The CRC32C (Castagnoli) of `bytes`, as every store keeps it.
pub fn crc32c(bytes: &[u8]) -> u32 {
    ::crc32c::crc32c(bytes)
}

/// Runs `op` up to `attempts` times (at least once) while it fails with a
/// retryable error ([`StoreError::is_retryable`]), sleeping between tries:
/// `backoff`, then doubling, capped at 30 s (or `backoff` if larger), each
/// delay with random jitter. `Denied`, `InvalidKey` and `Corrupt` are
/// returned at once; after the last attempt, its error.
///
/// ```no_run
/// # async fn f(store: &dyn walship_objstore::ObjectStore, key: &walship_objstore::ObjectKey) {
/// use std::time::Duration;
/// let bytes = bytes::Bytes::from_static(b"segment");
/// walship_objstore::retry(|| store.put(key, bytes.clone()), 5, Duration::from_millis(100)).await.unwrap();
/// # }
/// ```
pub async fn retry<T, F, Fut>(op: F, attempts: usize, backoff: Duration) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, StoreError>>,
{
    use backon::{ExponentialBuilder, Retryable};
    let policy = ExponentialBuilder::default()
        .with_min_delay(backoff)
        .with_max_delay(backoff.max(Duration::from_secs(30)))
        .with_factor(2.0)
        .with_max_times(attempts.saturating_sub(1))
        .with_jitter();
    op.retry(policy).when(StoreError::is_retryable).await
}

/// Where archived segments live.
///
/// Errors: [`StoreError::Unavailable`] is worth retrying (see [`retry`]);
/// [`StoreError::Denied`], [`StoreError::InvalidKey`] and
/// [`StoreError::Corrupt`] are not.
#[async_trait::async_trait]
pub trait ObjectStore: Send + Sync + 'static {
    /// Stores `bytes` at `key` (replacing what is there), sending its
    /// CRC32C for the store to check; done only when the object is durable.
    /// A put that fails leaves the old object or the new one, never a torn
    /// one; concurrent puts of one key end with one of them, whole.
    async fn put(&self, key: &ObjectKey, bytes: Bytes) -> Result<(), StoreError>;
    /// The object at `key` (checked against its CRC32C), or `None`. Bytes
    /// that do not match their checksum (or an object whose checksum is
    /// missing) are [`StoreError::Corrupt`], never returned.
    async fn get(&self, key: &ObjectKey) -> Result<Option<Bytes>, StoreError>;
    /// Every object whose key starts with `prefix` (a key prefix, not
    /// necessarily ending at a `/`; `""` lists everything), sorted by key,
    /// with the size of its bytes alone (no checksum or header). Only
    /// objects: no checksum files, temp files or directory markers.
    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>, StoreError>;
    /// Removes `key`; removing a missing key is not an error.
    async fn delete(&self, key: &ObjectKey) -> Result<(), StoreError>;
    /// What it is (`s3://bucket/prefix at http://…`, `dir:/path`), for
    /// status pages and logs; never a secret.
    fn describe(&self) -> String;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_that_could_escape_the_store_are_refused() {
        let long = "a".repeat(MAX_KEY_BYTES + 1);
        for bad in [
            "",
            "..",
            ".",
            "../x",
            "a/../b",
            "a/..",
            "/abs",
            "/",
            "a/",
            "a//b",
            "a/./b",
            "./a",
            "a\0b",
            "\0",
            "%2e%2e",
            "a/%2e%2e/b",
            "a\\..\\b",
            "~x",
            "a b",
            "segment\n",
            "é",
            "a/ünï/b",
            "\u{2024}\u{2024}", // ONE DOT LEADER twice, a '..' look-alike
            "ａ",               // fullwidth 'a'
            long.as_str(),
        ] {
            match ObjectKey::new(bad) {
                Err(StoreError::InvalidKey { key, reason }) => {
                    assert_eq!(key, bad);
                    assert!(!reason.is_empty());
                }
                other => panic!("{bad:?} was not refused: {other:?}"),
            }
        }
    }

    #[test]
    fn plain_keys_are_taken() {
        let longest = "a".repeat(MAX_KEY_BYTES);
        for good in ["a", "shard-1/seg-000001.wseg", "a/b/c", "x=1/y_2/.hidden", "...", "a..b", longest.as_str()] {
            assert_eq!(ObjectKey::new(good).unwrap().as_str(), good);
        }
        let base = ObjectKey::new("shard-1").unwrap();
        assert_eq!(base.join("seg.wseg").unwrap().as_str(), "shard-1/seg.wseg");
        assert!(base.join("../x").is_err());
        assert!(base.join("").is_err());
    }

    #[tokio::test]
    async fn retry_retries_only_what_may_succeed() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let calls = AtomicUsize::new(0);
        let fails_twice = || {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            async move { if n < 2 { Err(StoreError::Unavailable("down".into())) } else { Ok(n) } }
        };
        assert_eq!(retry(fails_twice, 3, Duration::from_millis(1)).await.unwrap(), 2);

        calls.store(0, Ordering::SeqCst);
        let always_down = || {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Err::<(), _>(StoreError::Unavailable("down".into())) }
        };
        assert!(matches!(retry(always_down, 3, Duration::from_millis(1)).await, Err(StoreError::Unavailable(_))));
        assert_eq!(calls.load(Ordering::SeqCst), 3, "attempts counts every call");

        for refusal in [
            StoreError::Denied("no".into()),
            StoreError::Corrupt { key: "k".into(), detail: "crc".into() },
            StoreError::InvalidKey { key: "..".into(), reason: "no".into() },
        ] {
            calls.store(0, Ordering::SeqCst);
            let message = refusal.to_string();
            let refusal = std::sync::Mutex::new(Some(refusal));
            let op = || {
                calls.fetch_add(1, Ordering::SeqCst);
                let e = refusal.lock().unwrap().take().expect("called once");
                async move { Err::<(), _>(e) }
            };
            assert_eq!(retry(op, 5, Duration::from_millis(1)).await.unwrap_err().to_string(), message);
            assert_eq!(calls.load(Ordering::SeqCst), 1);
        }
        // Zero attempts still tries once.
        assert_eq!(retry(|| async { Ok::<_, StoreError>(7) }, 0, Duration::from_millis(1)).await.unwrap(), 7);
    }
}
