//! LocalDirStore: the conformance suite, retries through a flaky wrapper,
//! and what its files look like on disk.

use bytes::Bytes;
use walship_objstore::{LocalDirStore, ObjectKey, ObjectStore, StoreError, conformance};

/// Flips the last byte of the object's file (a byte of the object, not of
/// its header).
fn corrupt_in(store: &LocalDirStore) -> impl Fn(&ObjectKey) + Sync + use<> {
    let root = store.root().to_path_buf();
    move |key: &ObjectKey| {
        let path = root.join(key.as_str());
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x01;
        std::fs::write(&path, bytes).unwrap();
    }
}

#[tokio::test]
async fn the_local_store_passes_the_conformance_suite() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalDirStore::open(dir.path().join("objects")).unwrap();
    assert_eq!(store.describe(), format!("dir:{}", dir.path().join("objects").canonicalize().unwrap().display()));
    conformance::run(&store, &corrupt_in(&store)).await;
    // Emptied directories went with their last object.
    assert_eq!(std::fs::read_dir(store.root()).unwrap().count(), 0);
}

#[tokio::test]
async fn puts_through_retry_land_on_a_local_store_failing_every_other_call() {
    let dir = tempfile::tempdir().unwrap();
    conformance::run_with_flaky(LocalDirStore::open(dir.path()).unwrap()).await;
}

#[tokio::test]
async fn an_object_is_one_file_with_its_checksum_in_a_header_and_damage_anywhere_is_detected() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalDirStore::open(dir.path()).unwrap();
    let key = ObjectKey::new("shard-1/seg-1.wseg").unwrap();
    store.put(&key, Bytes::from_static(b"hello")).await.unwrap();
    let path = store.root().join("shard-1/seg-1.wseg");
    let file = std::fs::read(&path).unwrap();
    assert_eq!(&file[..4], b"WSO1");
    assert_eq!(&file[4..8], &walship_objstore::crc32c(b"hello").to_le_bytes());
    assert_eq!(&file[8..16], &5u64.to_le_bytes());
    assert_eq!(&file[16..], b"hello");
    // Only the object's file in its directory: no sidecar, no temp file.
    assert_eq!(std::fs::read_dir(store.root().join("shard-1")).unwrap().count(), 1);
    // Every byte matters: magic, checksum, length, data; and truncation.
    for at in 0..file.len() {
        let mut damaged = file.clone();
        damaged[at] ^= 0x40;
        std::fs::write(&path, &damaged).unwrap();
        assert!(matches!(store.get(&key).await, Err(StoreError::Corrupt { .. })), "byte {at}");
    }
    std::fs::write(&path, &file[..file.len() - 1]).unwrap();
    assert!(matches!(store.get(&key).await, Err(StoreError::Corrupt { .. })));
    std::fs::write(&path, &file[..3]).unwrap();
    assert!(matches!(store.get(&key).await, Err(StoreError::Corrupt { .. })));
}
