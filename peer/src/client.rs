//! Fetching a sealed segment from a peer: one cached channel per peer, an
//! idle timeout between chunks, every chunk's CRC32C checked as it arrives,
//! and a fetch cut short resumed from its last good chunk (once per peer).
//! The caller checks the whole segment (its header and every record's crc)
//! and falls through to the next peer, then to the object store.

use std::collections::HashMap;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;
use tonic::transport::{Channel, Endpoint};
use walship_proto::dataplane::FetchShuffleRequest;
use walship_proto::dataplane::peer_exchange_client::PeerExchangeClient;

use crate::server::MAX_CHUNK_BYTES;
use crate::token::Token;

/// Why a fetch from one peer failed (the caller tries the next source).
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("peer {peer}: {status}")]
    Refused { peer: String, status: tonic::Status },
    #[error("peer {peer} sent nothing for {idle:?}")]
    Idle { peer: String, idle: Duration },
    #[error("peer {peer} sent a damaged chunk at byte {offset}")]
    DamagedChunk { peer: String, offset: u64 },
    #[error("peer {peer}: {detail}")]
    Broken { peer: String, detail: String },
}

/// Makes a channel to a peer's gRPC address (TLS, secrets: the caller's).
pub type Dial = Box<dyn Fn(&str) -> Option<Channel> + Send + Sync>;

pub struct PeerFetcher {
    dial: Dial,
    channels: Mutex<HashMap<String, Channel>>,
    /// The longest wait for the next chunk.
    pub idle_timeout: Duration,
    /// The slowest a whole fetch may go: past three `idle_timeout`s plus
    /// the segment's size at this rate, it is given up (a peer dripping a byte
    /// now and then would otherwise hold a re-seed for ever).
    pub min_bytes_per_s: u64,
}

/// A plain channel (no TLS, no cluster secret) with keepalives; for tests
/// and `insecure_no_auth` clusters.
pub fn plain_dial() -> Dial {
    Box::new(|addr: &str| {
        let endpoint = Endpoint::from_shared(format!("http://{addr}")).ok()?;
        Some(
            endpoint
                .connect_timeout(Duration::from_secs(2))
                .http2_keep_alive_interval(Duration::from_secs(5))
                .keep_alive_timeout(Duration::from_secs(5))
                .connect_lazy(),
        )
    })
}

impl PeerFetcher {
    pub fn new(dial: Dial) -> PeerFetcher {
        PeerFetcher {
            dial,
            channels: Mutex::default(),
            idle_timeout: Duration::from_secs(15),
            min_bytes_per_s: 1 << 20,
        }
    }

    fn channel(&self, peer: &str) -> Option<Channel> {
        let mut channels = self.channels.lock();
        if let Some(channel) = channels.get(peer) {
            return Some(channel.clone());
        }
        let channel = (self.dial)(peer)?;
        channels.insert(peer.to_string(), channel.clone());
        Some(channel)
    }

    /// Fetches segment `key` of task `task` from `peer`, whole: `size`
    /// bytes, as the archive lists it (the peer encodes it exactly as the
    /// archiver did), and no more. A stream that breaks after good chunks is
    /// resumed once from the last one.
    pub async fn fetch(
        &self,
        peer: &str,
        task: &str,
        key: &str,
        token: &Token,
        size: u64,
    ) -> Result<Bytes, FetchError> {
        let rate = self.min_bytes_per_s.max(1);
        // Room for the idle waits of a first try and its resume, and the
        // bytes at the slowest rate.
        let deadline = tokio::time::Instant::now() + 3 * self.idle_timeout + Duration::from_secs(size / rate);
        let channel = self
            .channel(peer)
            .ok_or_else(|| FetchError::Broken { peer: peer.into(), detail: "no address to dial".into() })?;
        let mut client = PeerExchangeClient::new(channel).max_decoding_message_size(MAX_CHUNK_BYTES + 1024);
        let mut got = BytesMut::new();
        let mut resumed = false;
        loop {
            let request = FetchShuffleRequest {
                query_id: task.into(),
                key: key.into(),
                token: token.as_str().into(),
                offset: got.len() as u64,
            };
            let outcome = self.stream_into(&mut client, peer, request, &mut got, size, deadline).await;
            match outcome {
                Ok(()) => return Ok(got.freeze()),
                // A break after progress, once: go on from the last good chunk.
                Err(FetchError::Broken { .. } | FetchError::Idle { .. }) if !resumed && !got.is_empty() => {
                    resumed = true;
                    tracing::debug!(peer, key, at = got.len(), "resuming a peer fetch");
                }
                Err(e) => {
                    // A dead peer's channel is dialled afresh next time.
                    if matches!(e, FetchError::Broken { .. } | FetchError::Idle { .. }) {
                        self.channels.lock().remove(peer);
                    }
                    return Err(e);
                }
            }
        }
    }

    async fn stream_into(
        &self,
        client: &mut PeerExchangeClient<Channel>,
        peer: &str,
        request: FetchShuffleRequest,
        got: &mut BytesMut,
        size: u64,
        deadline: tokio::time::Instant,
    ) -> Result<(), FetchError> {
        let broken = |detail: String| FetchError::Broken { peer: peer.into(), detail };
        let idle = || FetchError::Idle { peer: peer.into(), idle: self.idle_timeout };
        let too_slow = |got: usize| broken(format!("{got} of {size} bytes by the fetch's deadline (too slow)"));
        let mut stream = match tokio::time::timeout(self.idle_timeout, client.fetch_shuffle(request)).await {
            Err(_) => return Err(idle()),
            Ok(Err(status)) if is_transport(&status) => return Err(broken(status.to_string())),
            Ok(Err(status)) => return Err(FetchError::Refused { peer: peer.into(), status }),
            Ok(Ok(response)) => response.into_inner(),
        };
        let mut total = None;
        loop {
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Err(too_slow(got.len()));
            }
            let wait = self.idle_timeout.min(deadline - now);
            let chunk = match tokio::time::timeout(wait, stream.message()).await {
                Err(_) if tokio::time::Instant::now() >= deadline => return Err(too_slow(got.len())),
                Err(_) => return Err(idle()),
                Ok(Err(status)) if is_transport(&status) => return Err(broken(status.to_string())),
                Ok(Err(status)) => return Err(FetchError::Refused { peer: peer.into(), status }),
                Ok(Ok(None)) => break,
                Ok(Ok(Some(chunk))) => chunk,
            };
            if chunk.crc32c != Some(crc32c::crc32c(&chunk.data)) || chunk.data.len() > MAX_CHUNK_BYTES {
                return Err(FetchError::DamagedChunk { peer: peer.into(), offset: got.len() as u64 });
            }
            if chunk.total_bytes != size {
                return Err(broken(format!(
                    "says the segment holds {} bytes; the archive lists {size}",
                    chunk.total_bytes
                )));
            }
            if *total.get_or_insert(chunk.total_bytes) != chunk.total_bytes
                || got.len() as u64 + chunk.data.len() as u64 > chunk.total_bytes
            {
                return Err(broken(format!("chunks disagree on the size ({} bytes so far)", got.len())));
            }
            got.extend_from_slice(&chunk.data);
        }
        match total {
            Some(t) if t != got.len() as u64 => Err(broken(format!("the stream ended at byte {} of {t}", got.len()))),
            None if got.is_empty() => Err(broken("the stream ended before any chunk".into())),
            _ => Ok(()),
        }
    }
}

/// A status that means the connection, not the server, failed.
fn is_transport(status: &tonic::Status) -> bool {
    matches!(status.code(), tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled)
        && status.message().contains("transport")
        || status.code() == tonic::Code::Unavailable && status.message().contains("connect")
}

#[cfg(test)]
mod tests {
    //! The client against an in-process PeerExchange server that misbehaves
    //! on purpose (a damaged chunk, silence, a stream cut short).

    use std::pin::Pin;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio_stream::Stream;
    use tonic::{Request, Response, Status};
    use walship_proto::dataplane::peer_exchange_server::{PeerExchange, PeerExchangeServer};
    use walship_proto::dataplane::{FetchShuffleRequest, ShuffleChunk};

    use super::*;
    use crate::token::{Grant, TokenKey};

    #[derive(Clone, Copy)]
    enum Behaviour {
        /// The second chunk's crc32c does not match its data.
        DamageSecondChunk,
        /// One chunk, then nothing (the stream stays open).
        GoSilent,
        /// The first call ends after one chunk; later calls send the rest.
        CutFirstCall,
        /// Chunks claiming a segment of `u64::MAX` bytes.
        Bloated,
        /// Ten bytes every 100 ms, for ever.
        Drip,
    }

    struct Fake {
        file: Bytes,
        behaviour: Behaviour,
        calls: Arc<AtomicUsize>,
    }

    fn chunk(file: &Bytes, from: usize, to: usize) -> ShuffleChunk {
        let data = file.slice(from..to);
        ShuffleChunk { crc32c: Some(crc32c::crc32c(&data)), total_bytes: file.len() as u64, data }
    }

    #[tonic::async_trait]
    impl PeerExchange for Fake {
        type FetchShuffleStream = Pin<Box<dyn Stream<Item = Result<ShuffleChunk, Status>> + Send>>;

        async fn fetch_shuffle(
            &self,
            request: Request<FetchShuffleRequest>,
        ) -> Result<Response<Self::FetchShuffleStream>, Status> {
            let call = self.calls.fetch_add(1, Ordering::SeqCst);
            let offset = request.into_inner().offset as usize;
            let (file, behaviour) = (self.file.clone(), self.behaviour);
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            tokio::spawn(async move {
                let half = file.len() / 2;
                match behaviour {
                    Behaviour::DamageSecondChunk => {
                        let _ = tx.send(Ok(chunk(&file, 0, half))).await;
                        let mut bad = chunk(&file, half, file.len());
                        bad.crc32c = bad.crc32c.map(|c| c ^ 1);
                        let _ = tx.send(Ok(bad)).await;
                    }
                    Behaviour::GoSilent => {
                        let _ = tx.send(Ok(chunk(&file, offset, (offset + 10).min(file.len())))).await;
                        tokio::time::sleep(Duration::from_secs(3600)).await;
                    }
                    Behaviour::CutFirstCall if call == 0 => {
                        let _ = tx.send(Ok(chunk(&file, 0, half))).await;
                    }
                    Behaviour::CutFirstCall => {
                        let _ = tx.send(Ok(chunk(&file, offset, file.len()))).await;
                    }
                    Behaviour::Bloated => loop {
                        let mut c = chunk(&file, 0, half);
                        c.total_bytes = u64::MAX;
                        if tx.send(Ok(c)).await.is_err() {
                            break;
                        }
                    },
                    Behaviour::Drip => {
                        let mut at = offset;
                        while at < file.len() {
                            if tx.send(Ok(chunk(&file, at, at + 10))).await.is_err() {
                                break;
                            }
                            at += 10;
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }
                }
            });
            Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
        }
    }

    /// Serves `behaviour` on a free loopback port; answers its address and
    /// the call counter.
    async fn serve(behaviour: Behaviour) -> (String, Arc<AtomicUsize>, Bytes) {
        let file = Bytes::from((0..FILE_BYTES as u32).map(|i| (i % 251) as u8).collect::<Vec<u8>>());
        let calls = Arc::new(AtomicUsize::new(0));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let fake = Fake { file: file.clone(), behaviour, calls: calls.clone() };
        tokio::spawn(tonic::transport::Server::builder().add_service(PeerExchangeServer::new(fake)).serve(addr));
        // Listening once a connection is accepted.
        for _ in 0..200 {
            if tokio::net::TcpStream::connect(addr).await.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        (addr.to_string(), calls, file)
    }

    /// The size of the file every fake serves.
    const FILE_BYTES: u64 = 100_000;

    fn token() -> Token {
        TokenKey::derive(b"k").mint(&Grant { task: "t".into(), shard: 1, expires_unix_ms: u64::MAX })
    }

    #[tokio::test]
    async fn a_damaged_chunk_is_caught_when_it_arrives() {
        let (addr, _, _) = serve(Behaviour::DamageSecondChunk).await;
        let fetcher = PeerFetcher::new(plain_dial());
        let error = fetcher.fetch(&addr, "t", "k", &token(), FILE_BYTES).await.unwrap_err();
        assert!(matches!(error, FetchError::DamagedChunk { offset: 50_000, .. }), "{error}");
    }

    #[tokio::test]
    async fn a_silent_peer_is_given_up_after_the_idle_timeout() {
        let (addr, calls, _) = serve(Behaviour::GoSilent).await;
        let mut fetcher = PeerFetcher::new(plain_dial());
        fetcher.idle_timeout = Duration::from_millis(300);
        let started = std::time::Instant::now();
        let error = fetcher.fetch(&addr, "t", "k", &token(), FILE_BYTES).await.unwrap_err();
        assert!(matches!(error, FetchError::Idle { .. }), "{error}");
        assert!(started.elapsed() < Duration::from_secs(5), "gave up after {:?}", started.elapsed());
        assert_eq!(calls.load(Ordering::SeqCst), 2, "one resume after the first silence, then it gives up");
    }

    #[tokio::test]
    async fn a_stream_cut_short_resumes_from_its_last_good_chunk() {
        let (addr, calls, file) = serve(Behaviour::CutFirstCall).await;
        let fetcher = PeerFetcher::new(plain_dial());
        let got = fetcher.fetch(&addr, "t", "k", &token(), FILE_BYTES).await.unwrap();
        assert!(got == file, "the resumed fetch differs from the file");
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_peer_claiming_a_larger_segment_than_listed_is_refused_at_its_first_chunk() {
        let (addr, _, _) = serve(Behaviour::Bloated).await;
        let fetcher = PeerFetcher::new(plain_dial());
        let error = fetcher.fetch(&addr, "t", "k", &token(), FILE_BYTES).await.unwrap_err();
        assert!(matches!(&error, FetchError::Broken { detail, .. } if detail.contains("lists 100000")), "{error}");
    }

    #[tokio::test]
    async fn a_peer_dripping_bytes_is_given_up_at_the_fetchs_deadline() {
        let (addr, _, _) = serve(Behaviour::Drip).await;
        let mut fetcher = PeerFetcher::new(plain_dial());
        // Each chunk comes well within the idle timeout; the whole would
        // take 1,000 s.
        fetcher.idle_timeout = Duration::from_millis(500);
        let started = std::time::Instant::now();
        let error = fetcher.fetch(&addr, "t", "k", &token(), FILE_BYTES).await.unwrap_err();
        assert!(matches!(&error, FetchError::Broken { detail, .. } if detail.contains("too slow")), "{error}");
        assert!(started.elapsed() < Duration::from_secs(5), "gave up after {:?}", started.elapsed());
    }

    #[tokio::test]
    async fn an_unreachable_peer_fails_fast() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        drop(listener);
        let fetcher = PeerFetcher::new(plain_dial());
        let started = std::time::Instant::now();
        let error = fetcher.fetch(&addr, "t", "k", &token(), FILE_BYTES).await.unwrap_err();
        assert!(matches!(error, FetchError::Broken { .. }), "{error}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
