//! The conformance suite every [`ObjectStore`] passes (the tests run it on
//! [`crate::LocalDirStore`] and on [`crate::S3Store`] against a real
//! S3-compatible server), and [`FlakyStore`], a wrapper failing every
//! other call, to test retries.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;

use crate::{ObjectKey, ObjectMeta, ObjectStore, StoreError};

/// Under this prefix the suite writes every key.
pub const ROOT: &str = "conformance";

/// `n` bytes of a pattern that differs with `seed` (so a torn or swapped
/// object shows).
pub fn payload(n: usize, seed: u8) -> Bytes {
    let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ (u64::from(seed) << 32 | n as u64);
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let take = (n - out.len()).min(8);
        out.extend_from_slice(&state.to_le_bytes()[..take]);
    }
    Bytes::from(out)
}

fn key(s: &str) -> ObjectKey {
    ObjectKey::new(format!("{ROOT}/{s}")).expect("a valid test key")
}

fn keys(listed: &[ObjectMeta]) -> Vec<&str> {
    listed.iter().map(|m| m.key.as_str()).collect()
}

async fn assert_get(store: &dyn ObjectStore, key: &ObjectKey, want: &Bytes) {
    let got = store.get(key).await.unwrap_or_else(|e| panic!("get {key} from {}: {e}", store.describe()));
    let got = got.unwrap_or_else(|| panic!("get {key} from {}: missing", store.describe()));
    assert!(got.len() == want.len() && got == *want, "get {key}: {} bytes, not the {} put", got.len(), want.len());
}

/// Runs every check on an empty store (it writes under [`ROOT`] and
/// leaves the store empty again). `corrupt`
/// damages the stored bytes of an object on the backend behind the
/// store's back (flips a byte of its data, not of any checksum), as a
/// disk or a bug might.
pub async fn run(store: &dyn ObjectStore, corrupt: &(dyn Fn(&ObjectKey) + Sync)) {
    assert!(store.list("").await.expect("list").is_empty(), "the suite needs an empty store");
    assert!(!store.describe().is_empty());

    // Round trips: empty, one byte, 20 MiB (S3 goes multipart above 16 MiB).
    for (name, bytes) in [("empty", Bytes::new()), ("one", Bytes::from_static(b"x")), ("big", payload(20 << 20, 1))] {
        let k = key(&format!("round/{name}.wseg"));
        store.put(&k, bytes.clone()).await.unwrap_or_else(|e| panic!("put {k}: {e}"));
        assert_get(store, &k, &bytes).await;
    }
    let listed = store.list(&format!("{ROOT}/round/")).await.expect("list");
    assert_eq!(
        listed.iter().map(|m| (m.key.as_str(), m.size)).collect::<Vec<_>>(),
        vec![
            ("conformance/round/big.wseg", 20 << 20),
            ("conformance/round/empty.wseg", 0),
            ("conformance/round/one.wseg", 1)
        ]
    );

    // A put replaces (with a shorter object too).
    let k = key("replace.wseg");
    store.put(&k, payload(5000, 2)).await.expect("put");
    store.put(&k, payload(300, 3)).await.expect("replace");
    assert_get(store, &k, &payload(300, 3)).await;
    assert_eq!(store.list(k.as_str()).await.expect("list")[0].size, 300);

    // Missing keys: get is None, delete is fine (twice), a deleted key is gone.
    let missing = key("nothing/here.wseg");
    assert!(store.get(&missing).await.expect("get of a missing key").is_none());
    store.delete(&missing).await.expect("delete of a missing key");
    store.delete(&k).await.expect("delete");
    store.delete(&k).await.expect("delete again");
    assert!(store.get(&k).await.expect("get after delete").is_none());
    assert!(store.list(k.as_str()).await.expect("list").is_empty());

    // Listing: by prefixes ending mid-segment, at a '/', nested; sorted;
    // sizes of the objects alone.
    let tree = [
        ("list/shard-1/seg-000002.wseg", 20),
        ("list/shard-1/seg-000001.wseg", 10),
        ("list/shard-1/deep/er/x.wseg", 3),
        ("list/shard-10/seg-000001.wseg", 7),
        ("list/shard-2/seg-000001.wseg", 0),
        ("list/top.wseg", 1),
    ];
    for (i, (name, size)) in tree.iter().enumerate() {
        store.put(&key(name), payload(*size, i as u8)).await.expect("put");
    }
    let all = store.list(&format!("{ROOT}/list/")).await.expect("list");
    let mut want: Vec<(String, u64)> = tree.iter().map(|(n, s)| (format!("{ROOT}/{n}"), *s as u64)).collect();
    want.sort();
    assert_eq!(all.iter().map(|m| (m.key.as_str().to_string(), m.size)).collect::<Vec<_>>(), want);
    assert_eq!(
        keys(&store.list(&format!("{ROOT}/list/shard-1")).await.expect("list")),
        vec![
            "conformance/list/shard-1/deep/er/x.wseg",
            "conformance/list/shard-1/seg-000001.wseg",
            "conformance/list/shard-1/seg-000002.wseg",
            "conformance/list/shard-10/seg-000001.wseg",
        ],
        "a prefix ending mid-segment matches every key that starts with it"
    );
    assert_eq!(
        keys(&store.list(&format!("{ROOT}/list/shard-1/")).await.expect("list")),
        vec![
            "conformance/list/shard-1/deep/er/x.wseg",
            "conformance/list/shard-1/seg-000001.wseg",
            "conformance/list/shard-1/seg-000002.wseg",
        ]
    );
    assert_eq!(
        keys(&store.list(&format!("{ROOT}/list/shard-1/seg-00000")).await.expect("list")),
        vec!["conformance/list/shard-1/seg-000001.wseg", "conformance/list/shard-1/seg-000002.wseg"]
    );
    assert_eq!(keys(&store.list(&format!("{ROOT}/list/shard-1/deep/er/x.wseg")).await.expect("list")).len(), 1);
    assert!(store.list(&format!("{ROOT}/list/shard-3")).await.expect("list").is_empty());
    assert!(store.list(&format!("{ROOT}/list/top.wseg/")).await.expect("list").is_empty());
    assert!(store.list(&format!("{ROOT}/lis/")).await.expect("list").is_empty());
    // Everything the suite wrote so far, and nothing else (no checksum
    // sidecars, temp files or markers).
    let everything = store.list("").await.expect("list everything");
    assert_eq!(keys(&everything).len(), 3 + tree.len(), "{:?}", keys(&everything));
    assert!(everything.windows(2).all(|w| w[0].key < w[1].key), "sorted");

    // 16 concurrent uploads of different keys all land.
    let puts = (0..16u8).map(|i| {
        let k = key(&format!("concurrent/obj-{i:02}.wseg"));
        async move { store.put(&k, payload(64 * 1024 + usize::from(i), i)).await.map(|()| k) }
    });
    for k in futures::future::join_all(puts).await {
        let k = k.expect("a concurrent put");
        let i: u8 = k.as_str()[k.as_str().len() - 7..k.as_str().len() - 5].parse().unwrap();
        assert_get(store, &k, &payload(64 * 1024 + usize::from(i), i)).await;
    }
    assert_eq!(store.list(&format!("{ROOT}/concurrent/")).await.expect("list").len(), 16);

    // Concurrent puts of one key end with one of them, whole.
    let k = key("same.wseg");
    let candidates: Vec<Bytes> = (0..8u8).map(|i| payload(256 * 1024 + usize::from(i) * 1000, 100 + i)).collect();
    let puts = candidates.iter().map(|b| store.put(&k, b.clone()));
    for result in futures::future::join_all(puts).await {
        result.expect("a concurrent put of one key");
    }
    let got = store.get(&k).await.expect("get after concurrent puts").expect("present");
    assert!(candidates.contains(&got), "one whole object, not a mix ({} bytes)", got.len());
    let listed = store.list(k.as_str()).await.expect("list");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].size, got.len() as u64);

    // A corrupted object is an error, never wrong bytes; a fresh put heals it.
    for (name, bytes) in [("corrupt/small.wseg", payload(4096, 7)), ("corrupt/big.wseg", payload(17 << 20, 8))] {
        let k = key(name);
        store.put(&k, bytes.clone()).await.expect("put");
        corrupt(&k);
        match store.get(&k).await {
            Err(StoreError::Corrupt { key: named, .. }) => assert_eq!(named, k.as_str()),
            other => panic!("get of corrupted {k}: {:?}", other.map(|b| b.map(|b| b.len()))),
        }
        store.put(&k, bytes.clone()).await.expect("put over a corrupt object");
        assert_get(store, &k, &bytes).await;
    }

    // Clean up: the store is empty again.
    for meta in store.list(ROOT).await.expect("list") {
        store.delete(&meta.key).await.expect("delete");
    }
    assert!(store.list(ROOT).await.expect("list").is_empty());
}

/// Puts through [`crate::retry`] all land on a store that fails every
/// other call, and what failed is never half done.
pub async fn run_with_flaky<S: ObjectStore>(inner: S) {
    let flaky = FlakyStore::new(inner);
    let mut landed = BTreeSet::new();
    for i in 0..10u8 {
        let k = key(&format!("flaky/obj-{i}.wseg"));
        let bytes = payload(1000 + usize::from(i), i);
        crate::retry(|| flaky.put(&k, bytes.clone()), 4, Duration::from_millis(5)).await.expect("a put through retry");
        landed.insert(k);
    }
    assert!(flaky.failures() >= 10, "the wrapper failed {} calls", flaky.failures());
    let prefix = format!("{ROOT}/flaky/");
    let listed = crate::retry(|| flaky.list(&prefix), 4, Duration::from_millis(5)).await.expect("list");
    assert_eq!(listed.iter().map(|m| m.key.clone()).collect::<BTreeSet<_>>(), landed);
    for (i, k) in landed.iter().enumerate() {
        let got = crate::retry(|| flaky.get(k), 4, Duration::from_millis(5)).await.expect("get").expect("present");
        assert_eq!(got, payload(1000 + i, i as u8));
    }
    // Without retries, every other call fails, as Unavailable.
    let k = key("flaky/obj-0.wseg");
    let results = [flaky.get(&k).await.map(|_| ()), flaky.get(&k).await.map(|_| ())];
    assert_eq!(results.iter().filter(|r| matches!(r, Err(StoreError::Unavailable(_)))).count(), 1);
    // Refusals are not retried: a Denied error comes back after one call.
    let denied = Arc::new(AtomicU64::new(0));
    let calls = denied.clone();
    let err = crate::retry(
        || {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Err::<(), _>(StoreError::Denied("test".into())) }
        },
        5,
        Duration::from_millis(1),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, StoreError::Denied(_)));
    assert_eq!(denied.load(Ordering::SeqCst), 1);
    for k in &landed {
        crate::retry(|| flaky.delete(k), 4, Duration::from_millis(5)).await.expect("delete");
    }
}

/// Test support: an [`ObjectStore`] that fails every other call (the 1st,
/// 3rd, 5th, …) with [`StoreError::Unavailable`] before reaching the store
/// it wraps, and passes the others through.
pub struct FlakyStore<S> {
    inner: S,
    calls: AtomicU64,
    failures: AtomicU64,
}

impl<S: ObjectStore> FlakyStore<S> {
    pub fn new(inner: S) -> FlakyStore<S> {
        FlakyStore { inner, calls: AtomicU64::new(0), failures: AtomicU64::new(0) }
    }

    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Calls failed so far.
    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::SeqCst)
    }

    fn gate(&self, op: &str) -> Result<(), StoreError> {
        if self.calls.fetch_add(1, Ordering::SeqCst).is_multiple_of(2) {
            self.failures.fetch_add(1, Ordering::SeqCst);
            return Err(StoreError::Unavailable(format!("{op}: injected failure (FlakyStore)")));
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl<S: ObjectStore> ObjectStore for FlakyStore<S> {
    async fn put(&self, key: &ObjectKey, bytes: Bytes) -> Result<(), StoreError> {
        self.gate("put")?;
        self.inner.put(key, bytes).await
    }

    async fn get(&self, key: &ObjectKey) -> Result<Option<Bytes>, StoreError> {
        self.gate("get")?;
        self.inner.get(key).await
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>, StoreError> {
        self.gate("list")?;
        self.inner.list(prefix).await
    }

    async fn delete(&self, key: &ObjectKey) -> Result<(), StoreError> {
        self.gate("delete")?;
        self.inner.delete(key).await
    }

    fn describe(&self) -> String {
        format!("flaky({})", self.inner.describe())
    }
}
