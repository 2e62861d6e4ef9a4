//! [`S3Store`]: objects in an S3 bucket (AWS or any S3-compatible service)
//! through `aws-sdk-s3`.
//!
//! The key `a/b` is the S3 key `<prefix>/a/b` (just `a/b` without a
//! prefix). Every object carries its CRC32C twice:
//!
//! * as the S3 checksum (`x-amz-checksum-crc32c`, base64 of the big-endian
//!   CRC), sent with the put so the service refuses bytes that arrived
//!   damaged; objects above [`MULTIPART_THRESHOLD`] go up in
//!   [`PART_SIZE`] parts, each with its own, and the service keeps a
//!   composite checksum (`<crc of the parts' crcs>-<parts>`);
//! * as user metadata `x-amz-meta-crc32c` (same encoding, whole object),
//!   since not every S3-compatible service keeps or returns checksums.
//!
//! A get asks for the checksum (checksum mode ENABLED); the SDK checks the
//! body against a whole-object checksum when the service returns one, and
//! the store checks the bytes against the metadata CRC32C (always: an
//! object without it is reported corrupt) and against a returned checksum,
//! whole or composite. Any mismatch is [`StoreError::Corrupt`].
//!
//! Errors: a 401/403, `AccessDenied`, `SignatureDoesNotMatch`,
//! `InvalidAccessKeyId` and the like are [`StoreError::Denied`] with a
//! message naming the credentials in use (the access key id, never the
//! secret); a missing key is `None` on get and success on delete;
//! everything else, timeouts included, is [`StoreError::Unavailable`].
//! Every call has a connect timeout (3 s by default) and an operation
//! timeout covering the SDK's own retries (30 s by default).
//!
//! Puts and deletes of one key through one `S3Store` (and its clones) are
//! serialised. S3 itself makes each put atomic, bytes and metadata
//! together, but some S3-compatible servers (s3s-fs, which the tests run)
//! write an object's bytes and its metadata as separate files, so two
//! concurrent puts of one key could end with one's bytes under the other's
//! checksum: detected as corrupt, never served, but not "one whole
//! object". Across processes that can still happen on such a server.
//!
//! A failed multipart upload is aborted; one that cannot be aborted (the
//! service is down) leaves parts behind until the bucket's lifecycle rule
//! for incomplete multipart uploads removes them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use aws_sdk_s3::Client;
use aws_sdk_s3::config::retry::RetryConfig;
use aws_sdk_s3::config::timeout::TimeoutConfig;
use aws_sdk_s3::config::{BehaviorVersion, Credentials, Region, SharedCredentialsProvider};
use aws_sdk_s3::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::types::{ChecksumAlgorithm, ChecksumMode, CompletedMultipartUpload, CompletedPart};
use base64::Engine as _;
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};

use crate::{ObjectKey, ObjectMeta, ObjectStore, StoreError};

/// Objects larger than this go up as a multipart upload.
pub const MULTIPART_THRESHOLD: usize = 16 * 1024 * 1024;
/// The size of each part of a multipart upload (the last may be smaller).
pub const PART_SIZE: usize = 8 * 1024 * 1024;
/// Parts of one upload in flight at once.
const PART_CONCURRENCY: usize = 4;
/// The user-metadata name of the whole object's CRC32C (`x-amz-meta-crc32c`).
const META_CRC32C: &str = "crc32c";

/// How [`S3Store`] authenticates.
#[derive(Clone)]
pub enum S3Credentials {
    /// A fixed access key and secret.
    Static { access_key_id: String, secret_access_key: String },
    /// The standard AWS chain: `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY`
    /// (and `AWS_SESSION_TOKEN`), the shared profile (`AWS_PROFILE`,
    /// `~/.aws/credentials`), web identity, ECS and EC2 instance roles.
    DefaultChain,
}

impl std::fmt::Debug for S3Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            S3Credentials::Static { access_key_id, .. } => f
                .debug_struct("Static")
                .field("access_key_id", access_key_id)
                .field("secret_access_key", &"<redacted>")
                .finish(),
            S3Credentials::DefaultChain => f.write_str("DefaultChain"),
        }
    }
}

impl S3Credentials {
    /// For messages: which credentials these are, never the secret.
    fn describe(&self) -> String {
        match self {
            S3Credentials::Static { access_key_id, .. } => format!("static credentials, access key id {access_key_id:?}"),
            S3Credentials::DefaultChain => {
                "credentials from the AWS default chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, instance role)"
                    .to_string()
            }
        }
    }
}

/// Where and how [`S3Store`] reaches its bucket.
#[derive(Debug, Clone)]
pub struct S3Settings {
    pub bucket: String,
    /// Prepended (with a `/`) to every key; validated like an [`ObjectKey`].
    pub prefix: Option<String>,
    /// The service's URL (`http://127.0.0.1:9000`); `None` is AWS itself.
    pub endpoint: Option<String>,
    /// `us-east-1` by default.
    pub region: String,
    /// Path-style addressing (`<endpoint>/<bucket>/<key>`), which most
    /// S3-compatible services need; virtual-hosted style otherwise.
    pub path_style: bool,
    pub credentials: S3Credentials,
    /// Longest a call may take, the SDK's retries included (30 s).
    pub operation_timeout: Duration,
    /// Longest a connection may take to open (3 s).
    pub connect_timeout: Duration,
}

impl S3Settings {
    /// `bucket` with the defaults: no prefix, AWS's endpoint, `us-east-1`,
    /// virtual-hosted style, 30 s per call, 3 s to connect.
    pub fn new(bucket: impl Into<String>, credentials: S3Credentials) -> S3Settings {
        S3Settings {
            bucket: bucket.into(),
            prefix: None,
            endpoint: None,
            region: "us-east-1".to_string(),
            path_style: false,
            credentials,
            operation_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(3),
        }
    }
}

/// An S3 bucket (optionally under a key prefix) as an [`ObjectStore`].
#[derive(Debug, Clone)]
pub struct S3Store {
    client: Client,
    bucket: String,
    prefix: Option<ObjectKey>,
    region: String,
    endpoint: Option<String>,
    credentials: String,
    operation_timeout: Duration,
    /// A lock for each S3 key being put or deleted.
    writing: Arc<Mutex<HashMap<String, Weak<tokio::sync::Mutex<()>>>>>,
}

/// How a failed call ended.
enum Failure {
    NotFound,
    Error(StoreError),
}

impl S3Store {
    /// Builds the client (no request is made: a wrong endpoint or secret
    /// shows on the first call). Refuses an empty bucket, an invalid
    /// prefix or an endpoint that is not an `http(s)://` URL.
    pub async fn new(settings: S3Settings) -> Result<S3Store, StoreError> {
        let invalid = |what: String| StoreError::Unavailable(format!("invalid S3 settings: {what}"));
        if settings.bucket.is_empty() {
            return Err(invalid("the bucket is empty".into()));
        }
        let prefix = settings.prefix.as_deref().filter(|p| !p.is_empty()).map(ObjectKey::new).transpose()?;
        if let Some(endpoint) = &settings.endpoint
            && !(endpoint.starts_with("http://") || endpoint.starts_with("https://"))
        {
            return Err(invalid(format!("the endpoint {endpoint:?} is not an http:// or https:// URL")));
        }
        let region = Region::new(settings.region.clone());
        let provider = match &settings.credentials {
            S3Credentials::Static { access_key_id, secret_access_key } => SharedCredentialsProvider::new(
                Credentials::new(access_key_id, secret_access_key, None, None, "walship-static"),
            ),
            S3Credentials::DefaultChain => SharedCredentialsProvider::new(
                aws_config::default_provider::credentials::DefaultCredentialsChain::builder()
                    .region(region.clone())
                    .build()
                    .await,
            ),
        };
        let timeouts = TimeoutConfig::builder()
            .connect_timeout(settings.connect_timeout)
            .operation_timeout(settings.operation_timeout)
            .build();
        let retries = RetryConfig::standard()
            .with_max_attempts(3)
            .with_initial_backoff(Duration::from_millis(200))
            .with_max_backoff(Duration::from_secs(5));
        let mut config = aws_sdk_s3::Config::builder()
            .behavior_version(BehaviorVersion::latest())
            .region(region)
            .credentials_provider(provider)
            .force_path_style(settings.path_style)
            .timeout_config(timeouts)
            .retry_config(retries);
        if let Some(endpoint) = &settings.endpoint {
            config = config.endpoint_url(endpoint.trim_end_matches('/'));
        }
        Ok(S3Store {
            client: Client::from_conf(config.build()),
            bucket: settings.bucket,
            prefix,
            region: settings.region,
            endpoint: settings.endpoint,
            credentials: settings.credentials.describe(),
            operation_timeout: settings.operation_timeout,
            writing: Arc::default(),
        })
    }

    /// Creates the bucket if it does not exist (`walship dev` and tests).
    pub async fn ensure_bucket(&self) -> Result<(), StoreError> {
        match self.client.head_bucket().bucket(&self.bucket).send().await {
            Ok(_) => return Ok(()),
            Err(e) => match self.classify("checking bucket", &self.bucket, e) {
                Failure::NotFound => {}
                Failure::Error(e) => return Err(e),
            },
        }
        let mut create = self.client.create_bucket().bucket(&self.bucket);
        if self.region != "us-east-1" {
            create = create.create_bucket_configuration(
                aws_sdk_s3::types::CreateBucketConfiguration::builder()
                    .location_constraint(aws_sdk_s3::types::BucketLocationConstraint::from(self.region.as_str()))
                    .build(),
            );
        }
        match create.send().await {
            Ok(_) => Ok(()),
            // Created meanwhile (by us or a concurrent caller).
            Err(e) if matches!(e.code(), Some("BucketAlreadyOwnedByYou" | "BucketAlreadyExists")) => Ok(()),
            Err(e) => match self.classify("creating bucket", &self.bucket, e) {
                Failure::NotFound => {
                    Err(StoreError::Unavailable(format!("creating bucket {}: not found", self.bucket)))
                }
                Failure::Error(e) => Err(e),
            },
        }
    }

    /// The S3 key of `key`: `<prefix>/<key>`.
    pub fn s3_key(&self, key: &ObjectKey) -> String {
        match &self.prefix {
            Some(prefix) => format!("{prefix}/{key}"),
            None => key.as_str().to_string(),
        }
    }

    /// Waits for the other puts and deletes of `s3_key` through this store.
    async fn lock_key(&self, s3_key: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = {
            let mut writing = self.writing.lock().expect("key locks");
            writing.retain(|_, lock| lock.strong_count() > 0);
            match writing.get(s3_key).and_then(Weak::upgrade) {
                Some(lock) => lock,
                None => {
                    let lock = Arc::new(tokio::sync::Mutex::new(()));
                    writing.insert(s3_key.to_string(), Arc::downgrade(&lock));
                    lock
                }
            }
        };
        lock.lock_owned().await
    }

    fn classify<E>(&self, op: &str, target: &str, err: SdkError<E>) -> Failure
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        let status = err.raw_response().map(|r| r.status().as_u16());
        let code = err.code().map(str::to_string);
        match (&err, status, code.as_deref()) {
            (_, _, Some("NoSuchKey" | "NotFound" | "NoSuchUpload")) | (SdkError::ServiceError(_), Some(404), None) => {
                return Failure::NotFound;
            }
            (
                _,
                _,
                Some(
                    "AccessDenied"
                    | "SignatureDoesNotMatch"
                    | "InvalidAccessKeyId"
                    | "InvalidToken"
                    | "ExpiredToken"
                    | "InvalidSecurity"
                    | "AllAccessDisabled"
                    | "AccountProblem",
                ),
            )
            | (SdkError::ServiceError(_), Some(401 | 403), _) => {
                let why = match (code.as_deref(), err.message()) {
                    (Some(code), Some(message)) => format!("{code}: {message}"),
                    (Some(code), None) => code.to_string(),
                    (None, _) => format!("HTTP {}", status.unwrap_or_default()),
                };
                return Failure::Error(StoreError::Denied(format!(
                    "{op} {target} in {} was refused ({why}): check the S3 credentials ({}) and their permissions on the bucket",
                    self.describe(),
                    self.credentials
                )));
            }
            _ => {}
        }
        let detail = match &err {
            SdkError::TimeoutError(_) => format!("timed out (operation timeout {:?})", self.operation_timeout),
            SdkError::ServiceError(_) => match (code.as_deref(), err.message()) {
                (Some(code), Some(message)) => format!("HTTP {}: {code}: {message}", status.unwrap_or_default()),
                _ => format!("HTTP {}: {}", status.unwrap_or_default(), DisplayErrorContext(&err)),
            },
            _ => DisplayErrorContext(&err).to_string(),
        };
        Failure::Error(StoreError::Unavailable(format!("{op} {target} in {}: {detail}", self.describe())))
    }

    fn fail<E>(&self, op: &str, target: &str, err: SdkError<E>) -> StoreError
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        match self.classify(op, target, err) {
            Failure::NotFound => StoreError::Unavailable(format!("{op} {target} in {}: not found", self.describe())),
            Failure::Error(e) => e,
        }
    }

    async fn put_multipart(&self, s3_key: &str, bytes: Bytes, crc: &str) -> Result<(), StoreError> {
        let created = self
            .client
            .create_multipart_upload()
            .bucket(&self.bucket)
            .key(s3_key)
            .checksum_algorithm(ChecksumAlgorithm::Crc32C)
            .metadata(META_CRC32C, crc)
            .send()
            .await
            .map_err(|e| self.fail("starting multipart upload of", s3_key, e))?;
        let upload_id = created
            .upload_id()
            .ok_or_else(|| StoreError::Unavailable(format!("starting multipart upload of {s3_key}: no upload id")))?
            .to_string();
        let uploaded = async {
            let parts: Vec<CompletedPart> = futures::stream::iter(part_ranges(bytes.len()).into_iter().enumerate())
                .map(|(i, (start, end))| {
                    let part = bytes.slice(start..end);
                    let upload_id = &upload_id;
                    async move {
                        let number = i as i32 + 1;
                        let part_crc = b64_crc(crate::crc32c(&part));
                        let out = self
                            .client
                            .upload_part()
                            .bucket(&self.bucket)
                            .key(s3_key)
                            .upload_id(upload_id)
                            .part_number(number)
                            .checksum_algorithm(ChecksumAlgorithm::Crc32C)
                            .checksum_crc32_c(&part_crc)
                            .body(ByteStream::from(part))
                            .send()
                            .await
                            .map_err(|e| self.fail(&format!("uploading part {number} of"), s3_key, e))?;
                        Ok::<_, StoreError>(
                            CompletedPart::builder()
                                .part_number(number)
                                .set_e_tag(out.e_tag().map(str::to_string))
                                .checksum_crc32_c(part_crc)
                                .build(),
                        )
                    }
                })
                .buffered(PART_CONCURRENCY)
                .try_collect()
                .await?;
            self.client
                .complete_multipart_upload()
                .bucket(&self.bucket)
                .key(s3_key)
                .upload_id(&upload_id)
                .multipart_upload(CompletedMultipartUpload::builder().set_parts(Some(parts)).build())
                .send()
                .await
                .map_err(|e| self.fail("completing multipart upload of", s3_key, e))?;
            Ok(())
        }
        .await;
        if let Err(e) = &uploaded
            && let Err(abort) =
                self.client.abort_multipart_upload().bucket(&self.bucket).key(s3_key).upload_id(&upload_id).send().await
        {
            tracing::warn!(
                key = s3_key,
                upload_id,
                error = %DisplayErrorContext(&abort),
                "could not abort a failed multipart upload ({e}); the bucket's lifecycle rule must remove its parts"
            );
        }
        uploaded
    }
}

/// `(start, end)` of each part of an object of `len` bytes.
fn part_ranges(len: usize) -> Vec<(usize, usize)> {
    (0..len.div_ceil(PART_SIZE)).map(|i| (i * PART_SIZE, ((i + 1) * PART_SIZE).min(len))).collect()
}

/// A CRC32C as S3 spells it: base64 of its 4 big-endian bytes.
fn b64_crc(crc: u32) -> String {
    base64::engine::general_purpose::STANDARD.encode(crc.to_be_bytes())
}

/// The composite checksum S3 keeps for a multipart upload of `bytes` in
/// [`PART_SIZE`] parts: the CRC32C of the parts' CRC32Cs, `-<parts>`.
fn composite_crc(bytes: &[u8]) -> String {
    let ranges = part_ranges(bytes.len());
    let mut crcs = Vec::with_capacity(ranges.len() * 4);
    for (start, end) in &ranges {
        crcs.extend_from_slice(&crate::crc32c(&bytes[*start..*end]).to_be_bytes());
    }
    format!("{}-{}", b64_crc(crate::crc32c(&crcs)), ranges.len())
}

/// Whether an error chain says a checksum did not match (the SDK's own
/// response validation).
fn is_checksum_mismatch(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(err);
    while let Some(e) = source {
        if e.to_string().to_ascii_lowercase().contains("checksum mismatch") {
            return true;
        }
        source = e.source();
    }
    false
}

#[async_trait::async_trait]
impl ObjectStore for S3Store {
    async fn put(&self, key: &ObjectKey, bytes: Bytes) -> Result<(), StoreError> {
        let s3_key = self.s3_key(key);
        let crc = b64_crc(crate::crc32c(&bytes));
        let _writing = self.lock_key(&s3_key).await;
        if bytes.len() > MULTIPART_THRESHOLD {
            return self.put_multipart(&s3_key, bytes, &crc).await;
        }
        self.client
            .put_object()
            .bucket(&self.bucket)
            .key(&s3_key)
            .checksum_algorithm(ChecksumAlgorithm::Crc32C)
            .checksum_crc32_c(&crc)
            .metadata(META_CRC32C, &crc)
            .body(ByteStream::from(bytes))
            .send()
            .await
            .map_err(|e| self.fail("putting", &s3_key, e))?;
        Ok(())
    }

    async fn get(&self, key: &ObjectKey) -> Result<Option<Bytes>, StoreError> {
        let s3_key = self.s3_key(key);
        let out = match self
            .client
            .get_object()
            .bucket(&self.bucket)
            .key(&s3_key)
            .checksum_mode(ChecksumMode::Enabled)
            .send()
            .await
        {
            Ok(out) => out,
            Err(e) => {
                return match self.classify("getting", &s3_key, e) {
                    Failure::NotFound => Ok(None),
                    Failure::Error(e) => Err(e),
                };
            }
        };
        let corrupt = |detail: String| StoreError::Corrupt { key: key.as_str().to_string(), detail };
        let returned = out.checksum_crc32_c().map(str::to_string);
        let stored = out.metadata().and_then(|m: &HashMap<String, String>| m.get(META_CRC32C)).cloned();
        let bytes = match out.body.collect().await {
            Ok(body) => body.into_bytes(),
            Err(e) if is_checksum_mismatch(&e) => {
                return Err(corrupt(format!("the body does not match the checksum the service returned: {e}")));
            }
            Err(e) => {
                return Err(StoreError::Unavailable(format!(
                    "reading {s3_key} from {}: {}",
                    self.describe(),
                    DisplayErrorContext(&e)
                )));
            }
        };
        let actual = b64_crc(crate::crc32c(&bytes));
        match stored {
            Some(stored) if stored == actual => {}
            Some(stored) => {
                return Err(corrupt(format!("CRC32C of the {} bytes read is {actual}, stored {stored}", bytes.len())));
            }
            None => {
                return Err(corrupt(format!("no stored CRC32C (metadata x-amz-meta-{META_CRC32C}) to check against")));
            }
        }
        if let Some(returned) = returned {
            let expected = if returned.contains('-') { composite_crc(&bytes) } else { actual };
            // A composite checksum of another part layout (an object not put
            // by this store) cannot be recomputed: the metadata check stands.
            let comparable = !returned.contains('-') || returned.rsplit('-').next() == expected.rsplit('-').next();
            if comparable && returned != expected {
                return Err(corrupt(format!("the service's checksum is {returned}, the bytes read give {expected}")));
            }
        }
        Ok(Some(bytes))
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectMeta>, StoreError> {
        let full_prefix = match &self.prefix {
            Some(store_prefix) => format!("{store_prefix}/{prefix}"),
            None => prefix.to_string(),
        };
        let mut found = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let out = self
                .client
                .list_objects_v2()
                .bucket(&self.bucket)
                .prefix(&full_prefix)
                .set_continuation_token(token.take())
                .send()
                .await
                .map_err(|e| self.fail("listing", &format!("{full_prefix:?}"), e))?;
            for object in out.contents() {
                let Some(s3_key) = object.key() else { continue };
                let relative = match &self.prefix {
                    Some(store_prefix) => {
                        match s3_key.strip_prefix(store_prefix.as_str()).and_then(|k| k.strip_prefix('/')) {
                            Some(relative) => relative,
                            None => continue,
                        }
                    }
                    None => s3_key,
                };
                match ObjectKey::new(relative) {
                    Ok(key) => found.push(ObjectMeta { key, size: object.size().unwrap_or(0).max(0) as u64 }),
                    Err(e) => {
                        tracing::debug!(s3_key, error = %e, "skipping an object whose key this store would not write")
                    }
                }
            }
            match out.next_continuation_token() {
                Some(next) if out.is_truncated() == Some(true) => token = Some(next.to_string()),
                _ => break,
            }
        }
        found.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(found)
    }

    async fn delete(&self, key: &ObjectKey) -> Result<(), StoreError> {
        let s3_key = self.s3_key(key);
        let _writing = self.lock_key(&s3_key).await;
        match self.client.delete_object().bucket(&self.bucket).key(&s3_key).send().await {
            Ok(_) => Ok(()),
            Err(e) => match self.classify("deleting", &s3_key, e) {
                Failure::NotFound => Ok(()),
                Failure::Error(e) => Err(e),
            },
        }
    }

    fn describe(&self) -> String {
        let location = match &self.prefix {
            Some(prefix) => format!("s3://{}/{prefix}", self.bucket),
            None => format!("s3://{}", self.bucket),
        };
        match &self.endpoint {
            Some(endpoint) => format!("{location} at {endpoint}"),
            None => format!("{location} at AWS ({})", self.region),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_the_object_in_8_mib_pieces() {
        assert_eq!(part_ranges(0), vec![]);
        assert_eq!(part_ranges(1), vec![(0, 1)]);
        assert_eq!(part_ranges(PART_SIZE), vec![(0, PART_SIZE)]);
        assert_eq!(
            part_ranges(2 * PART_SIZE + 3),
            vec![(0, PART_SIZE), (PART_SIZE, 2 * PART_SIZE), (2 * PART_SIZE, 2 * PART_SIZE + 3)]
        );
    }

    #[test]
    fn checksums_are_spelled_as_s3_spells_them() {
        // CRC32C("123456789") = 0xE3069283.
        assert_eq!(
            b64_crc(crate::crc32c(b"123456789")),
            base64::engine::general_purpose::STANDARD.encode([0xE3, 0x06, 0x92, 0x83])
        );
        assert!(composite_crc(&vec![7u8; PART_SIZE + 1]).ends_with("-2"));
    }

    #[tokio::test]
    async fn settings_are_checked_and_the_secret_never_shown() {
        let creds = S3Credentials::Static { access_key_id: "AKID".into(), secret_access_key: "hunter2".into() };
        let mut settings = S3Settings::new("b", creds);
        settings.endpoint = Some("http://127.0.0.1:9".into());
        settings.prefix = Some("walship/c1".into());
        let store = S3Store::new(settings.clone()).await.unwrap();
        assert_eq!(store.describe(), "s3://b/walship/c1 at http://127.0.0.1:9");
        assert!(!format!("{store:?}{settings:?}").contains("hunter2"));
        assert_eq!(store.s3_key(&ObjectKey::new("x/y").unwrap()), "walship/c1/x/y");
        let mut bad = settings.clone();
        bad.prefix = Some("../up".into());
        assert!(matches!(S3Store::new(bad).await, Err(StoreError::InvalidKey { .. })));
        let mut bad = settings;
        bad.endpoint = Some("127.0.0.1:9".into());
        assert!(S3Store::new(bad).await.is_err());
    }
}
