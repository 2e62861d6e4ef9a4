//! [`NatsKv`]: the leadership KV in a NATS JetStream KV bucket.
//!
//! A key's revision is the stream sequence of its last write, so revisions
//! are bucket-wide as [`Kv`] requires. [`Kv::write_batch`] publishes its
//! keys as JetStream atomic batches (`allow_atomic` on the bucket's stream,
//! nats-server 2.12 or newer; `connect` turns it on): every message of a
//! batch is stored or none is, and its first message carries
//! `Nats-Expected-Last-Sequence`, which is the bucket-wide compare-and-set.
//! A batch of more than [`ATOMIC_BATCH_KEYS`] keys goes as several, each
//! expecting the sequence the one before it ended at.

use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;

use super::{ATOMIC_BATCH_KEYS, Kv, KvEntry, KvError, KvSnapshot};

/// How long a scan of the bucket may take.
const SCAN_TIMEOUT: Duration = Duration::from_secs(30);

/// A NATS JetStream KV bucket.
#[derive(Clone)]
pub struct NatsKv {
    client: async_nats::Client,
    js: async_nats::jetstream::Context,
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
        // Atomic batches need the stream to allow them (buckets created
        // before walship wrote per-shard records did not).
        let mut stream = store.stream.clone();
        let mut config = stream.info().await.map_err(|e| unavailable(&e))?.config.clone();
        if !config.allow_atomic_publish {
            config.allow_atomic_publish = true;
            js.update_stream(config).await.map_err(|e| unavailable(&format!("allowing atomic batches: {e}")))?;
        }
        Ok(NatsKv { client, js, store, url: url.to_string(), bucket: bucket.to_string() })
    }

    /// Publishes `puts` as one atomic batch whose first message expects the
    /// stream's last sequence to be `revision`; the sequence after it.
    async fn publish_atomic(&self, revision: u64, puts: &[(String, Bytes)]) -> Result<u64, KvError> {
        use async_nats::header::{
            NATS_BATCH_COMMIT, NATS_BATCH_COMMIT_FINAL, NATS_BATCH_ID, NATS_BATCH_SEQUENCE, NATS_EXPECTED_LAST_SEQUENCE,
        };
        use async_nats::jetstream::context::PublishErrorKind;
        use async_nats::jetstream::message::PublishMessage;
        let unavailable = |e: &dyn std::fmt::Display| KvError::Unavailable(format!("NATS {}: {e}", self.url));
        let conflict = || KvError::Conflict { key: puts[0].0.clone(), expected: revision };
        let batch_id = format!("walship-{:032x}", rand::random::<u128>());
        let last = puts.len() - 1;
        let mut ack = None;
        for (i, (key, value)) in puts.iter().enumerate() {
            let subject = format!("{}{key}", self.store.prefix);
            let mut headers = async_nats::HeaderMap::new();
            if puts.len() > 1 {
                headers.insert(NATS_BATCH_ID, batch_id.as_str());
                headers.insert(NATS_BATCH_SEQUENCE, (i + 1).to_string().as_str());
            }
            if i == 0 {
                headers.insert(NATS_EXPECTED_LAST_SEQUENCE, revision.to_string().as_str());
            }
            if i < last {
                // Staged by the server until the commit; errors come back
                // on the commit.
                self.client.publish_with_headers(subject, headers, value.clone()).await.map_err(|e| unavailable(&e))?;
                continue;
            }
            if puts.len() > 1 {
                headers.insert(NATS_BATCH_COMMIT, NATS_BATCH_COMMIT_FINAL);
            }
            let publish = PublishMessage::build().payload(value.clone()).headers(headers);
            let future = self.js.send_publish(subject, publish).await.map_err(|e| unavailable(&e))?;
            ack = Some(future.await.map_err(|e| match e.kind() {
                PublishErrorKind::WrongLastSequence => conflict(),
                _ => unavailable(&e),
            })?);
        }
        let ack = ack.expect("the batch is not empty");
        if ack.sequence != revision + puts.len() as u64 {
            // Stored, but not right after `revision`: cannot happen with
            // the expectation honoured. Say so rather than go on.
            return Err(KvError::Unavailable(format!(
                "NATS stored a batch of {} at sequence {} after expecting {revision}",
                puts.len(),
                ack.sequence
            )));
        }
        Ok(ack.sequence)
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

    async fn scan(&self) -> Result<KvSnapshot, KvError> {
        use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
        let unavailable = |e: &dyn std::fmt::Display| KvError::Unavailable(format!("NATS {}: {e}", self.url));
        let mut stream = self.store.stream.clone();
        let info = stream.info().await.map_err(|e| unavailable(&e))?;
        let revision = info.state.last_sequence;
        if info.state.messages == 0 {
            return Ok(KvSnapshot { entries: Vec::new(), revision });
        }
        // The newest message of every key, from one consumer.
        let consumer = stream
            .create_consumer(pull::Config {
                filter_subject: format!("{}>", self.store.prefix),
                deliver_policy: DeliverPolicy::LastPerSubject,
                ack_policy: AckPolicy::None,
                inactive_threshold: Duration::from_secs(30),
                ..Default::default()
            })
            .await
            .map_err(|e| unavailable(&e))?;
        let name = consumer.cached_info().name.clone();
        // By key: a write landing while the consumer reads is delivered
        // too (after the key's older value); the newest of each key wins.
        // The stream holds only this bucket's keys and at least one message,
        // so at least one is delivered: the consumer's own `num_pending` is
        // not asked first, as the server can count it 0 for a last-per-subject
        // consumer created while a key is being rewritten (a scan then came
        // back empty).
        let mut newest: std::collections::BTreeMap<String, Option<KvEntry>> = Default::default();
        let read = async {
            let mut messages = consumer.messages().await.map_err(|e| unavailable(&e))?;
            while let Some(message) = messages.next().await {
                let message = message.map_err(|e| unavailable(&e))?;
                let info = message.info().map_err(|e| unavailable(&e))?;
                let (sequence, more) = (info.stream_sequence, info.pending > 0);
                let deleted = message
                    .headers
                    .as_ref()
                    .and_then(|h| h.get("KV-Operation"))
                    .is_some_and(|op| op.as_str() == "DEL" || op.as_str() == "PURGE");
                if let Some(key) = message.subject.strip_prefix(self.store.prefix.as_str()) {
                    let entry = (!deleted).then(|| KvEntry {
                        key: key.to_string(),
                        value: message.payload.clone(),
                        revision: sequence,
                    });
                    newest.insert(key.to_string(), entry);
                }
                if !more {
                    return Ok(());
                }
            }
            Err(unavailable(&"the scan's consumer ended early"))
        };
        let outcome = tokio::time::timeout(SCAN_TIMEOUT, read).await;
        let _ = stream.delete_consumer(&name).await;
        outcome.map_err(|_| unavailable(&format!("scan took longer than {SCAN_TIMEOUT:?}")))??;
        let entries = newest.into_values().flatten().collect();
        Ok(KvSnapshot { entries, revision })
    }

    async fn write_batch(&self, revision: u64, puts: Vec<(String, Bytes)>) -> Result<u64, KvError> {
        if puts.is_empty() {
            let last = self.store.stream.clone().info().await.map(|i| i.state.last_sequence);
            return match last {
                Ok(last) if last == revision => Ok(revision),
                Ok(_) => Err(KvError::Conflict { key: String::new(), expected: revision }),
                Err(e) => Err(KvError::Unavailable(format!("NATS {}: {e}", self.url))),
            };
        }
        // The short run goes first, so the last ATOMIC_BATCH_KEYS keys are
        // always one atomic run: a caller puts the key that makes a layout
        // current (the lease) last, beside what must land with it.
        let mut revision = revision;
        let (head, tail) = puts.split_at(puts.len() % ATOMIC_BATCH_KEYS);
        if !head.is_empty() {
            revision = self.publish_atomic(revision, head).await?;
        }
        for run in tail.chunks(ATOMIC_BATCH_KEYS) {
            revision = self.publish_atomic(revision, run).await?;
        }
        Ok(revision)
    }

    async fn watch(&self, key: &str) -> Result<BoxStream<'static, KvEntry>, KvError> {
        use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
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
