//! S3Store against a real S3-compatible server (s3s-fs on a loopback port):
//! the conformance suite, retries, refused credentials, a server that is
//! gone or frozen.

mod support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use support::s3::{S3sFs, flip_a_byte};
use walship_objstore::{ObjectKey, ObjectStore, S3Store, StoreError, conformance};

async fn store(server: &S3sFs, bucket: &str, prefix: Option<&str>) -> S3Store {
    let store = S3Store::new(server.settings(bucket, prefix)).await.expect("S3Store::new");
    store.ensure_bucket().await.expect("ensure_bucket");
    store
}

#[tokio::test]
async fn the_s3_store_passes_the_conformance_suite() {
    let server = S3sFs::start();
    // Without a prefix, and under one.
    for (bucket, prefix) in [("plain", None), ("prefixed", Some("walship/cluster-1"))] {
        let store = store(&server, bucket, prefix).await;
        store.ensure_bucket().await.expect("ensure_bucket is idempotent");
        let data = server.data_dir().join(bucket);
        let corrupt = |key: &ObjectKey| flip_a_byte(&data.join(store.s3_key(key)));
        conformance::run(&store, &corrupt).await;
    }
}

#[tokio::test]
async fn puts_through_retry_land_on_an_s3_store_failing_every_other_call() {
    let server = S3sFs::start();
    conformance::run_with_flaky(store(&server, "flaky", Some("p")).await).await;
}

#[tokio::test]
async fn objects_carry_their_crc32c_as_the_s3_checksum_and_as_metadata() {
    let server = S3sFs::start();
    let store = store(&server, "meta", None).await;
    let key = ObjectKey::new("a/b.wseg").unwrap();
    store.put(&key, Bytes::from_static(b"123456789")).await.unwrap();
    // s3s-fs keeps the object as a plain file; beside it (hidden files in
    // the data dir) our metadata and the checksum it verified and kept.
    assert_eq!(std::fs::read(server.data_dir().join("meta/a/b.wseg")).unwrap(), b"123456789");
    let hidden = |suffix: &str| {
        std::fs::read_dir(server.data_dir())
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.to_string_lossy().ends_with(suffix))
            .map(|p| std::fs::read_to_string(p).unwrap())
            .unwrap_or_else(|| panic!("no *{suffix} in s3s-fs's data dir"))
    };
    let (metadata, internal) = (hidden(".metadata.json"), hidden(".internal.json"));
    // CRC32C("123456789") = e3069283, base64 "4waSgw==".
    assert!(metadata.contains("crc32c") && metadata.contains("4waSgw=="), "user metadata: {metadata}");
    assert!(internal.contains("4waSgw=="), "the server's own checksum: {internal}");
}

#[tokio::test]
async fn a_wrong_secret_is_denied_naming_the_credentials_and_the_right_one_works() {
    let server = S3sFs::start();
    store(&server, "creds", None).await;
    let wrong = S3Store::new(server.settings_with_secret("creds", None, "not-the-secret")).await.unwrap();
    let key = ObjectKey::new("k.wseg").unwrap();
    let started = Instant::now();
    for (op, result) in [
        ("put", wrong.put(&key, Bytes::from_static(b"x")).await.map(|_| ())),
        ("get", wrong.get(&key).await.map(|_| ())),
        ("list", wrong.list("").await.map(|_| ())),
        ("delete", wrong.delete(&key).await),
        ("HEAD bucket", wrong.ensure_bucket().await),
    ] {
        match result {
            Err(StoreError::Denied(message)) => {
                assert!(message.contains("credentials"), "{message}");
                assert!(message.contains(support::s3::ACCESS_KEY), "names the access key id: {message}");
                // A HEAD response has no body to name the error: just 403.
                let why = if op == "HEAD bucket" { "HTTP 403" } else { "SignatureDoesNotMatch" };
                assert!(message.contains(why), "{op}: {message}");
                assert!(!message.contains("not-the-secret"), "never the secret: {message}");
            }
            other => panic!("with a wrong secret: {other:?}"),
        }
    }
    assert!(started.elapsed() < Duration::from_secs(10), "a refusal is not retried: {:?}", started.elapsed());
    // Refusals are not retried by the retry helper either.
    let started = Instant::now();
    let err = walship_objstore::retry(|| wrong.put(&key, Bytes::from_static(b"x")), 5, Duration::from_secs(1))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Denied(_)) && started.elapsed() < Duration::from_secs(1), "{err}");

    // An unknown access key is refused too.
    let mut settings = server.settings("creds", None);
    settings.credentials = walship_objstore::S3Credentials::Static {
        access_key_id: "nobody".into(),
        secret_access_key: support::s3::SECRET_KEY.into(),
    };
    let stranger = S3Store::new(settings).await.unwrap();
    match stranger.get(&key).await {
        Err(StoreError::Denied(message)) => assert!(message.contains("nobody"), "{message}"),
        other => panic!("with an unknown access key: {other:?}"),
    }

    // Fixed credentials (a new store with the right secret): a put works.
    let fixed = S3Store::new(server.settings("creds", None)).await.unwrap();
    fixed.put(&key, Bytes::from_static(b"x")).await.expect("put with the right secret");
    assert_eq!(fixed.get(&key).await.unwrap().unwrap(), Bytes::from_static(b"x"));
}

#[tokio::test]
async fn a_killed_server_is_unavailable_within_the_timeout_not_a_hang() {
    let mut server = S3sFs::start();
    let store = store(&server, "gone", None).await;
    let key = ObjectKey::new("k.wseg").unwrap();
    store.put(&key, Bytes::from_static(b"before")).await.unwrap();
    server.kill();
    let started = Instant::now();
    for (op, result) in [
        ("put", tokio::time::timeout(Duration::from_secs(40), store.put(&key, Bytes::from_static(b"x"))).await),
        ("get", tokio::time::timeout(Duration::from_secs(40), async { store.get(&key).await.map(|_| ()) }).await),
        ("list", tokio::time::timeout(Duration::from_secs(40), async { store.list("").await.map(|_| ()) }).await),
        ("delete", tokio::time::timeout(Duration::from_secs(40), store.delete(&key)).await),
    ] {
        match result {
            Ok(Err(StoreError::Unavailable(message))) => assert!(message.contains(&server.endpoint), "{op}: {message}"),
            Ok(other) => panic!("{op} on a killed server: {other:?}"),
            Err(_) => panic!("{op} on a killed server hung"),
        }
    }
    // Refused connections fail fast (the SDK's 3 attempts, short backoff).
    assert!(started.elapsed() < Duration::from_secs(30), "{:?}", started.elapsed());
}

#[tokio::test]
async fn a_frozen_server_is_unavailable_after_the_operation_timeout_then_works_again() {
    let server = S3sFs::start();
    store(&server, "frozen", None).await;
    let mut settings = server.settings("frozen", None);
    settings.operation_timeout = Duration::from_secs(2);
    let store = S3Store::new(settings).await.unwrap();
    let key = ObjectKey::new("k.wseg").unwrap();
    store.put(&key, Bytes::from_static(b"before")).await.unwrap();
    // SIGSTOP: connections are accepted by the kernel, never answered.
    server.signal(libc::SIGSTOP);
    let started = Instant::now();
    let result = tokio::time::timeout(Duration::from_secs(20), store.get(&key)).await;
    let elapsed = started.elapsed();
    server.signal(libc::SIGCONT);
    match result {
        Ok(Err(StoreError::Unavailable(message))) => assert!(message.contains("timed out"), "{message}"),
        Ok(other) => panic!("get from a frozen server: {other:?}"),
        Err(_) => panic!("get from a frozen server hung past 20 s"),
    }
    assert!(elapsed >= Duration::from_millis(1900) && elapsed < Duration::from_secs(10), "{elapsed:?}");
    assert_eq!(store.get(&key).await.unwrap().unwrap(), Bytes::from_static(b"before"));
}

#[tokio::test]
async fn a_missing_bucket_is_unavailable_and_named() {
    let server = S3sFs::start();
    let store = S3Store::new(server.settings("never-made", None)).await.unwrap();
    match store.list("").await {
        Err(StoreError::Unavailable(message)) => {
            assert!(message.contains("never-made") && message.contains("NoSuchBucket"), "{message}")
        }
        other => panic!("list of a missing bucket: {other:?}"),
    }
}
