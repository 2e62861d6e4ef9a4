//! The `PeerExchange.FetchShuffle` server: streams one sealed segment of a
//! shard this node holds, in chunks of at most 256 KiB, to a peer holding a
//! fetch token for it.
//!
//! Every fetch is checked in this order, and a refusal changes nothing:
//!
//! 1. the token ([`crate::token`]): `PERMISSION_DENIED` when it is empty,
//!    malformed, forged, expired or minted for another task;
//! 2. the key: `INVALID_ARGUMENT` unless it is an object key (no `..`, no
//!    leading `/`, no `%`, at most 1024 bytes) that names a segment of this
//!    cluster's archive layout ([`SegmentSource::shard_of`]);
//! 3. the token's shard: `PERMISSION_DENIED` for a segment of another shard;
//! 4. a serving slot: at most `max_concurrent` fetches (16) stream at once;
//!    one waits up to `queue_wait` (10 s) for a slot, then is refused with
//!    `RESOURCE_EXHAUSTED`;
//! 5. the segment: `NOT_FOUND` when this node does not hold it (never did,
//!    or compacted it); `OUT_OF_RANGE` for an offset past its end.
//!
//! The bytes are those the archive holds under the same key (the same
//! records, encoded the same way), each chunk with its CRC32C. Serving is
//! rate-limited (`bytes_per_s`, shared by all fetches of the node) so the
//! live append path keeps its throughput.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use prometheus::{IntCounter, IntCounterVec, Opts, Registry};
use tokio::sync::Semaphore;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use walship_objstore::ObjectKey;
use walship_proto::dataplane::peer_exchange_server::PeerExchange;
use walship_proto::dataplane::{FetchShuffleRequest, ShuffleChunk};
use walship_wal::limiter::RateLimiter;

use crate::token::TokenKey;

/// The largest chunk sent.
pub const MAX_CHUNK_BYTES: usize = 256 << 10;

/// Where the served segments come from (the node's WAL, in walship).
#[tonic::async_trait]
pub trait SegmentSource: Send + Sync + 'static {
    /// The shard whose segment `key` names; `None` when `key` names no
    /// segment of this cluster.
    fn shard_of(&self, key: &ObjectKey) -> Option<u32>;

    /// The segment `key` names, byte for byte as archived; `None` when this
    /// node does not hold its records.
    async fn segment(&self, key: &ObjectKey) -> Result<Option<Bytes>, String>;
}

/// How a node serves fetches.
#[derive(Debug, Clone)]
pub struct ServeSettings {
    pub max_concurrent: usize,
    pub queue_wait: Duration,
    /// Bytes per second over all fetches (0: unlimited).
    pub bytes_per_s: u64,
    /// Chunk size (at most [`MAX_CHUNK_BYTES`]).
    pub chunk_bytes: usize,
}

impl Default for ServeSettings {
    fn default() -> ServeSettings {
        ServeSettings {
            max_concurrent: 16,
            queue_wait: Duration::from_secs(10),
            bytes_per_s: 64 << 20,
            chunk_bytes: MAX_CHUNK_BYTES,
        }
    }
}

/// `walship_peer_serve*`.
#[derive(Clone)]
pub struct ServeMetrics {
    serves: IntCounterVec,
    bytes: IntCounter,
}

impl ServeMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<ServeMetrics> {
        let serves = IntCounterVec::new(
            Opts::new(
                "walship_peer_serves_total",
                "PeerExchange fetches this node answered, by result (ok, denied, invalid, busy, not_found, \
                 out_of_range, failed)",
            ),
            &["result"],
        )?;
        let bytes = IntCounter::new("walship_peer_served_bytes_total", "Segment bytes this node streamed to peers")?;
        registry.register(Box::new(serves.clone()))?;
        registry.register(Box::new(bytes.clone()))?;
        Ok(ServeMetrics { serves, bytes })
    }
}

pub struct PeerExchangeService {
    source: Arc<dyn SegmentSource>,
    key: TokenKey,
    settings: ServeSettings,
    slots: Arc<Semaphore>,
    limiter: Arc<RateLimiter>,
    metrics: ServeMetrics,
}

impl PeerExchangeService {
    pub fn new(
        source: Arc<dyn SegmentSource>,
        key: TokenKey,
        settings: ServeSettings,
        metrics: ServeMetrics,
    ) -> PeerExchangeService {
        let limiter = match settings.bytes_per_s {
            0 => RateLimiter::unlimited(),
            n => RateLimiter::new(n),
        };
        PeerExchangeService {
            source,
            key,
            slots: Arc::new(Semaphore::new(settings.max_concurrent.max(1))),
            settings,
            limiter: Arc::new(limiter),
            metrics,
        }
    }

    fn refuse(&self, result: &str, status: Status) -> Status {
        self.metrics.serves.with_label_values(&[result]).inc();
        status
    }
}

fn now_unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// A key as a message shows it: never more than 128 characters of it.
fn shown(key: &str) -> String {
    match key.char_indices().nth(128) {
        Some((at, _)) => format!("{}... ({} bytes)", &key[..at], key.len()),
        None => key.to_string(),
    }
}

type ChunkStream = Pin<Box<dyn Stream<Item = Result<ShuffleChunk, Status>> + Send>>;

#[tonic::async_trait]
impl PeerExchange for PeerExchangeService {
    type FetchShuffleStream = ChunkStream;

    async fn fetch_shuffle(
        &self,
        request: Request<FetchShuffleRequest>,
    ) -> Result<Response<Self::FetchShuffleStream>, Status> {
        let r = request.into_inner();
        let grant = self
            .key
            .verify(&r.token, &r.query_id, now_unix_ms())
            .map_err(|e| self.refuse("denied", Status::permission_denied(e.to_string())))?;
        let invalid =
            |why: String| self.refuse("invalid", Status::invalid_argument(format!("key {:?}: {why}", shown(&r.key))));
        let key = ObjectKey::new(r.key.clone()).map_err(|_| {
            invalid("not an object key (1 to 1024 bytes of '/'-separated letters, digits, '-', '_', '.', '=')".into())
        })?;
        let shard = self.source.shard_of(&key).ok_or_else(|| invalid("names no segment of this cluster".into()))?;
        if shard != grant.shard {
            return Err(self.refuse(
                "denied",
                Status::permission_denied(format!(
                    "the fetch token grants shard {}'s segments, not shard {shard}'s",
                    grant.shard
                )),
            ));
        }
        let slot = match tokio::time::timeout(self.settings.queue_wait, self.slots.clone().acquire_owned()).await {
            Ok(Ok(slot)) => slot,
            _ => {
                return Err(self.refuse(
                    "busy",
                    Status::resource_exhausted(format!(
                        "all {} serving slots stayed busy for {:?}; try another peer or the object store",
                        self.settings.max_concurrent, self.settings.queue_wait
                    )),
                ));
            }
        };
        let bytes = match self.source.segment(&key).await {
            Ok(Some(bytes)) => bytes,
            Ok(None) => {
                return Err(self.refuse(
                    "not_found",
                    Status::not_found(format!("this node does not hold segment {}", key.as_str())),
                ));
            }
            Err(e) => return Err(self.refuse("failed", Status::unavailable(format!("reading the segment: {e}")))),
        };
        let total = bytes.len() as u64;
        if r.offset > total {
            return Err(self.refuse(
                "out_of_range",
                Status::out_of_range(format!("offset {} is past the segment's {total} bytes", r.offset)),
            ));
        }
        self.metrics.serves.with_label_values(&["ok"]).inc();
        let (tx, rx) = tokio::sync::mpsc::channel(2);
        let (limiter, served, chunk_bytes) =
            (self.limiter.clone(), self.metrics.bytes.clone(), self.settings.chunk_bytes.clamp(1, MAX_CHUNK_BYTES));
        tokio::spawn(async move {
            let _slot = slot; // held until the last chunk is out
            let mut at = r.offset as usize;
            while at < bytes.len() {
                let end = (at + chunk_bytes).min(bytes.len());
                let data = bytes.slice(at..end);
                limiter.acquire(data.len()).await;
                let chunk = ShuffleChunk { crc32c: Some(crc32c::crc32c(&data)), total_bytes: total, data };
                if tx.send(Ok(chunk)).await.is_err() {
                    return; // the fetcher went away
                }
                served.inc_by((end - at) as u64);
                at = end;
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }
}
