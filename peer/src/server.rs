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
    /// How long a chunk may wait for a fetcher that stopped reading (a
    /// frozen node) before the serve ends and frees its slot.
    pub send_timeout: Duration,
}

impl Default for ServeSettings {
    fn default() -> ServeSettings {
        ServeSettings {
            max_concurrent: 16,
            queue_wait: Duration::from_secs(10),
            bytes_per_s: 64 << 20,
            chunk_bytes: MAX_CHUNK_BYTES,
            send_timeout: Duration::from_secs(15),
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
        let send_timeout = self.settings.send_timeout;
        tokio::spawn(async move {
            let _slot = slot; // held until the last chunk is out
            let mut at = r.offset as usize;
            while at < bytes.len() {
                let end = (at + chunk_bytes).min(bytes.len());
                let data = bytes.slice(at..end);
                limiter.acquire(data.len()).await;
                let chunk = ShuffleChunk { crc32c: Some(crc32c::crc32c(&data)), total_bytes: total, data };
                match tokio::time::timeout(send_timeout, tx.send(Ok(chunk))).await {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) => return, // the fetcher went away
                    Err(_) => {
                        // It stopped reading: the slot goes to another fetch,
                        // and this one, cut short, resumes or moves on.
                        tracing::info!(at, total, "a peer fetch stopped reading; serve ended");
                        return;
                    }
                }
                served.inc_by((end - at) as u64);
                at = end;
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }
}

#[cfg(test)]
mod tests {
    //! The server over a source whose segment vanishes (compacted) while a
    //! fetch of it is under way.

    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio_stream::StreamExt;
    use walship_proto::dataplane::peer_exchange_server::PeerExchangeServer;

    use super::*;
    use crate::client::{FetchError, PeerFetcher, plain_dial};
    use crate::token::Grant;

    const TASK: &str = "t";
    const KEY: &str = "shards/1/segments/s.wseg";
    const CHUNK: usize = 4096;

    /// Holds one segment of shard 1 for the first `segment` call only: a
    /// compaction drops it right after.
    struct Vanishing {
        file: Bytes,
        calls: AtomicUsize,
    }

    #[tonic::async_trait]
    impl SegmentSource for Vanishing {
        fn shard_of(&self, _: &ObjectKey) -> Option<u32> {
            Some(1)
        }

        async fn segment(&self, key: &ObjectKey) -> Result<Option<Bytes>, String> {
            let first = self.calls.fetch_add(1, Ordering::SeqCst) == 0;
            Ok((first && key.as_str() == KEY).then(|| self.file.clone()))
        }
    }

    fn file() -> Bytes {
        Bytes::from((0..10 * CHUNK as u32 + 123).map(|i| (i % 251) as u8).collect::<Vec<u8>>())
    }

    fn service(source: Arc<Vanishing>) -> (PeerExchangeService, ServeMetrics) {
        let metrics = ServeMetrics::new(&Registry::new()).unwrap();
        let settings = ServeSettings { bytes_per_s: 0, chunk_bytes: CHUNK, ..ServeSettings::default() };
        (PeerExchangeService::new(source, TokenKey::derive(b"k"), settings, metrics.clone()), metrics)
    }

    fn token() -> crate::token::Token {
        TokenKey::derive(b"k").mint(&Grant { task: TASK.into(), shard: 1, expires_unix_ms: u64::MAX })
    }

    fn request(offset: u64) -> Request<FetchShuffleRequest> {
        Request::new(FetchShuffleRequest {
            query_id: TASK.into(),
            key: KEY.into(),
            token: token().as_str().into(),
            offset,
        })
    }

    #[tokio::test]
    async fn a_fetcher_that_stops_reading_gives_its_slot_back() {
        let source = Arc::new(Vanishing { file: file(), calls: AtomicUsize::new(0) });
        let settings = ServeSettings {
            max_concurrent: 1,
            queue_wait: Duration::from_secs(2),
            bytes_per_s: 0,
            chunk_bytes: CHUNK,
            send_timeout: Duration::from_millis(100),
        };
        let metrics = ServeMetrics::new(&Registry::new()).unwrap();
        let service = PeerExchangeService::new(source, TokenKey::derive(b"k"), settings, metrics);
        // One chunk read, then nothing: the serve blocks on the full channel.
        let mut stalled = service.fetch_shuffle(request(0)).await.unwrap().into_inner();
        stalled.next().await.unwrap().unwrap();
        // The next fetch gets the one slot (and is answered: the segment is
        // gone by then) instead of waiting 2 s and being refused as busy.
        let started = std::time::Instant::now();
        let answer = service.fetch_shuffle(request(0)).await.map(|_| ()).unwrap_err();
        assert_eq!(answer.code(), tonic::Code::NotFound, "{answer:?}");
        assert!(started.elapsed() < Duration::from_secs(1), "waited {:?} for the slot", started.elapsed());
        drop(stalled);
    }

    #[tokio::test]
    async fn a_serve_under_way_keeps_its_bytes_and_a_later_fetch_is_not_found() {
        let file = file();
        let source = Arc::new(Vanishing { file: file.clone(), calls: AtomicUsize::new(0) });
        let (service, metrics) = service(source.clone());
        let mut stream = service.fetch_shuffle(request(0)).await.unwrap().into_inner();
        let first = stream.next().await.unwrap().unwrap();
        assert_eq!(first.data.len(), CHUNK);
        // Compacted now: the fetch under way was answered from the bytes it
        // read, so it ends whole, every chunk checked, never cut short.
        let mut got = first.data.to_vec();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.expect("a chunk, not an error");
            assert_eq!(chunk.crc32c, Some(crc32c::crc32c(&chunk.data)));
            assert_eq!(chunk.total_bytes, file.len() as u64);
            got.extend_from_slice(&chunk.data);
        }
        assert!(
            got == file[..],
            "the serve under way differs from the segment ({} of {} bytes)",
            got.len(),
            file.len()
        );
        // A resume from the last good chunk, and a fresh fetch: NOT_FOUND.
        for offset in [CHUNK as u64, 0] {
            let status = service.fetch_shuffle(request(offset)).await.err().expect("a refusal");
            assert_eq!(status.code(), tonic::Code::NotFound, "{status}");
            assert!(status.message().contains("does not hold"), "{status}");
        }
        assert_eq!(source.calls.load(Ordering::SeqCst), 3);
        assert_eq!(metrics.serves.with_label_values(&["ok"]).get(), 1);
        assert_eq!(metrics.serves.with_label_values(&["not_found"]).get(), 2);
    }

    /// The real service, but its first stream ends after one chunk (a
    /// connection cut while the segment is compacted).
    struct CutFirstStream {
        inner: PeerExchangeService,
        calls: Arc<AtomicUsize>,
    }

    #[tonic::async_trait]
    impl PeerExchange for CutFirstStream {
        type FetchShuffleStream = ChunkStream;

        async fn fetch_shuffle(
            &self,
            request: Request<FetchShuffleRequest>,
        ) -> Result<Response<Self::FetchShuffleStream>, Status> {
            let call = self.calls.fetch_add(1, Ordering::SeqCst);
            let stream = self.inner.fetch_shuffle(request).await?.into_inner();
            Ok(Response::new(if call == 0 { Box::pin(stream.take(1)) } else { stream }))
        }
    }

    #[tokio::test]
    async fn a_fetch_whose_segment_vanishes_before_its_resume_fails_not_found() {
        let file = file();
        let source = Arc::new(Vanishing { file, calls: AtomicUsize::new(0) });
        let (inner, metrics) = service(source.clone());
        let calls = Arc::new(AtomicUsize::new(0));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(PeerExchangeServer::new(CutFirstStream { inner, calls: calls.clone() }))
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
        );
        let fetcher = PeerFetcher::new(plain_dial());
        let error = fetcher.fetch(&addr.to_string(), TASK, KEY, &token(), source.file.len() as u64).await.unwrap_err();
        // The cut stream is resumed from its last good chunk; the segment is
        // gone by then: a failed fetch (the caller's next source), never the
        // first chunk passed off as the segment.
        match &error {
            FetchError::Refused { status, .. } => assert_eq!(status.code(), tonic::Code::NotFound, "{error}"),
            other => panic!("expected NOT_FOUND, got {other}"),
        }
        assert_eq!(calls.load(Ordering::SeqCst), 2, "one resume");
        assert_eq!(source.calls.load(Ordering::SeqCst), 2);
        assert_eq!(metrics.serves.with_label_values(&["not_found"]).get(), 1);
        server.abort();
    }
}
