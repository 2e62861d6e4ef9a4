//! S3Store with `S3Credentials::DefaultChain`, fed by the standard
//! environment variables, against a real s3s-fs. Its own test binary with
//! one test: it sets environment variables, which no other test may see.

mod support;

use bytes::Bytes;
use support::s3::{ACCESS_KEY, S3sFs, SECRET_KEY};
use walship_objstore::{ObjectKey, ObjectStore, S3Credentials, S3Store, StoreError};

fn set_env(key: &str, value: &str) {
    // SAFETY: this binary's only test sets the environment before it starts
    // a runtime or any other thread.
    unsafe { std::env::set_var(key, value) }
}

#[test]
fn the_default_chain_takes_the_standard_environment_variables() {
    let server = S3sFs::start();
    // Hermetic: no profile files, no instance metadata service.
    set_env("AWS_CONFIG_FILE", "/nonexistent/walship-test/config");
    set_env("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/walship-test/credentials");
    set_env("AWS_EC2_METADATA_DISABLED", "true");
    set_env("AWS_ACCESS_KEY_ID", ACCESS_KEY);
    set_env("AWS_SECRET_ACCESS_KEY", "wrong-secret");
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let key = ObjectKey::new("chain/k.wseg").unwrap();
    let mut settings = server.settings("chain", None);
    settings.credentials = S3Credentials::DefaultChain;
    runtime.block_on(async {
        let store = S3Store::new(settings.clone()).await.unwrap();
        match store.ensure_bucket().await {
            Err(StoreError::Denied(message)) => {
                assert!(message.contains("default chain") && message.contains("AWS_ACCESS_KEY_ID"), "{message}")
            }
            other => panic!("with a wrong secret in the environment: {other:?}"),
        }
    });
    set_env("AWS_SECRET_ACCESS_KEY", SECRET_KEY);
    runtime.block_on(async {
        let store = S3Store::new(settings).await.unwrap();
        store.ensure_bucket().await.expect("ensure_bucket with the environment's credentials");
        store.put(&key, Bytes::from_static(b"chained")).await.unwrap();
        assert_eq!(store.get(&key).await.unwrap().unwrap(), Bytes::from_static(b"chained"));
    });
}
