//! PeerExchange in a node: serving archived segments from this node's WAL
//! ([`WalSegments`]) and fetching them from peers when a follower re-seeds
//! ([`PeerSegments`]), joining `walship-peer` (transport, tokens) and
//! replication (`walship_shipping::replica::peer_tier`).
//!
//! The service is not behind the cluster secret like `WalShipping`: fetch
//! tokens guard it. Their key is derived from the cluster secret, so only
//! members mint them; a cluster run with `insecure_no_auth` derives it from
//! a fixed string, and its tokens then guard against mistakes only.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use walship_objstore::ObjectKey;
use walship_peer::client::{Dial, FetchError, PeerFetcher};
use walship_peer::server::SegmentSource;
use walship_peer::token::{Grant, TokenKey};
use walship_shipping::archive::{ArchiveLayout, SegmentRef};
use walship_shipping::replica::ReplicationNode;
use walship_shipping::replica::peer_tier::PeerTier;
use walship_shipping::{ClusterConfig, NodeId};
use walship_wal::Segment;

/// How long a token a node mints for its own re-seed lasts.
const RESEED_TOKEN_TTL: Duration = Duration::from_secs(300);

/// The fetch-token key of `cluster` (see the module docs).
pub fn token_key(cluster: &ClusterConfig) -> TokenKey {
    match cluster.secret() {
        Some(secret) => TokenKey::derive(secret.expose().as_bytes()),
        None => TokenKey::derive(b"insecure_no_auth"),
    }
}

/// The archive layout segment keys follow (the cluster's `[archive]`
/// prefix; none without an archive).
pub fn layout(cluster: &ClusterConfig) -> anyhow::Result<ArchiveLayout> {
    match &cluster.archive {
        Some(archive) => crate::archive::layout(archive),
        None => Ok(ArchiveLayout::new(None)?),
    }
}

/// Serves segments from this node's WAL.
pub struct WalSegments {
    pub node: Arc<ReplicationNode>,
    pub layout: ArchiveLayout,
}

impl WalSegments {
    /// `(shard, segment)` when `key` is exactly a segment key of the layout.
    fn parse(&self, key: &ObjectKey) -> Option<(u32, SegmentRef)> {
        let parts: Vec<&str> = key.as_str().rsplitn(4, '/').collect();
        let [_, "segments", shard, _] = parts.as_slice() else { return None };
        let shard: u32 = shard.parse().ok()?;
        let segment = SegmentRef::parse(key.as_str(), 0)?;
        let canonical = self.layout.segment_key(shard, segment.first, segment.last, segment.epoch);
        (canonical.as_str() == key.as_str()).then_some((shard, segment))
    }
}

#[tonic::async_trait]
impl SegmentSource for WalSegments {
    fn shard_of(&self, key: &ObjectKey) -> Option<u32> {
        self.parse(key).map(|(shard, _)| shard)
    }

    async fn segment(&self, key: &ObjectKey) -> Result<Option<Bytes>, String> {
        let Some((shard, s)) = self.parse(key) else { return Ok(None) };
        self.node.sealed_segment(shard, s.first, s.last, s.epoch).await
    }
}

/// Fetches a re-seeding follower's segments from its peers.
pub struct PeerSegments {
    pub me: NodeId,
    pub fetcher: PeerFetcher,
    pub key: TokenKey,
    pub addresses: BTreeMap<NodeId, String>,
    /// Peers whose connection failed, skipped until then: a dead or cut
    /// peer costs one failed fetch per [`SKIP_FAILED_PEER`], not one per
    /// segment.
    skip_until: std::sync::Mutex<BTreeMap<NodeId, std::time::Instant>>,
    /// `walship_peer_fetches_total{result}`.
    fetches: prometheus::IntCounterVec,
}

/// Whether `bytes` is `segment` of `shard`, whole: it decodes (the header
/// and every record's checksum) to exactly the range its key names, and
/// its last record has the key's epoch.
fn intact(shard: u32, segment: &SegmentRef, bytes: &Bytes) -> bool {
    Segment::decode(bytes.clone()).is_ok_and(|s| {
        s.shard_id() == shard
            && s.first_seqno() == segment.first
            && s.last_seqno() == segment.last
            && s.frames().last().is_some_and(|f| f.epoch() == segment.epoch)
    })
}

/// `walship_peer_fetches_total{result}`: this node's fetches from peers.
fn fetch_counter() -> prometheus::IntCounterVec {
    prometheus::IntCounterVec::new(
        prometheus::Opts::new(
            "walship_peer_fetches_total",
            "PeerExchange fetches this node made, by result (ok, damaged, refused, idle, unreachable)",
        ),
        &["result"],
    )
    .expect("a valid metric")
}

/// How long a peer whose connection failed is skipped.
const SKIP_FAILED_PEER: Duration = Duration::from_secs(30);

impl PeerSegments {
    pub fn new(
        me: NodeId,
        cluster: &ClusterConfig,
        dial: Dial,
        registry: &prometheus::Registry,
    ) -> prometheus::Result<PeerSegments> {
        let addresses = cluster.addresses().into_iter().map(|(id, addr)| (id, addr.to_string())).collect();
        let fetcher = PeerFetcher::new(dial);
        let fetches = fetch_counter();
        registry.register(Box::new(fetches.clone()))?;
        Ok(PeerSegments { me, fetcher, key: token_key(cluster), addresses, skip_until: Default::default(), fetches })
    }
}

impl PeerSegments {
    fn skipped(&self) -> std::sync::MutexGuard<'_, BTreeMap<NodeId, std::time::Instant>> {
        self.skip_until.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[tonic::async_trait]
impl PeerTier for PeerSegments {
    async fn fetch(&self, shard: u32, segment: &SegmentRef, peers: &[NodeId], token: Option<&str>) -> Option<Bytes> {
        // The coordinator's token for the task this fetch serves (adding
        // this replica) while it holds for this shard; otherwise the node
        // mints its own, as a member holding the key: a re-seed or repair
        // it runs by itself is its own task.
        let now = std::time::SystemTime::now();
        let now_ms = now.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let coordinators = token.and_then(|t| {
            let grant = self.key.open(t, now_ms).ok().filter(|g| g.shard == shard)?;
            Some((grant.task, walship_peer::token::Token::from(t.to_string())))
        });
        let (task, token) = coordinators.unwrap_or_else(|| {
            let task = format!("reseed-shard{shard}-node{}", self.me);
            let expires_unix_ms = now_ms + RESEED_TOKEN_TTL.as_millis() as u64;
            let token = self.key.mint(&Grant { task: task.clone(), shard, expires_unix_ms });
            (task, token)
        });
        for peer in peers {
            let Some(addr) = self.addresses.get(peer) else { continue };
            if self.skipped().get(peer).is_some_and(|until| std::time::Instant::now() < *until) {
                continue;
            }
            let fetched = self.fetcher.fetch(addr, &task, &segment.key, &token, segment.size).await;
            let result = match &fetched {
                Ok(bytes) if intact(shard, segment, bytes) => "ok",
                Ok(_) | Err(FetchError::DamagedChunk { .. }) => "damaged",
                Err(FetchError::Refused { .. }) => "refused",
                Err(FetchError::Idle { .. }) => "idle",
                Err(FetchError::Broken { .. }) => "unreachable",
            };
            self.fetches.with_label_values(&[result]).inc();
            match fetched {
                Ok(bytes) if result == "ok" => return Some(bytes),
                // Every chunk arrived as sent, but what was sent is damaged
                // (its WAL's copy, or another segment): the next peer.
                Ok(_) => {
                    tracing::warn!(shard, peer, key = %segment.key, "a peer served a damaged segment; next source")
                }
                Err(error) => {
                    if matches!(error, FetchError::Broken { .. } | FetchError::Idle { .. }) {
                        self.skipped().insert(*peer, std::time::Instant::now() + SKIP_FAILED_PEER);
                    }
                    tracing::debug!(shard, peer, key = %segment.key, %error, "peer fetch failed; next source");
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    //! [`PeerSegments`] against in-process PeerExchange servers on loopback:
    //! the real service over segments held in memory, some of them made to
    //! misbehave (a chunk damaged after its crc was computed, silence, a
    //! damaged or wrong segment, a closed port).

    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio_stream::StreamExt;
    use tonic::{Request, Response, Status};
    use walship_peer::client::plain_dial;
    use walship_peer::server::{PeerExchangeService, ServeMetrics, ServeSettings};
    use walship_proto::dataplane::peer_exchange_server::{PeerExchange, PeerExchangeServer};
    use walship_proto::dataplane::{FetchShuffleRequest, ShuffleChunk};
    use walship_wal::{Frame, RecordFields};

    use super::*;

    const SHARD: u32 = 1;
    /// Chunks this small make a segment of ~20 KiB several chunks.
    const CHUNK: usize = 4096;
    const ME: NodeId = 9;

    fn key() -> TokenKey {
        TokenKey::derive(b"test-cluster-secret")
    }

    /// Records `first..=last` of `SHARD` with `epoch`, encoded as the
    /// archiver encodes them, and their segment's reference.
    fn segment(first: u64, last: u64, epoch: u64) -> (SegmentRef, Bytes) {
        let frames = (first..=last)
            .map(|seqno| {
                let payload = format!("record-{seqno:04}-").repeat(20);
                Frame::encode(RecordFields {
                    seqno,
                    epoch,
                    timestamp_us: seqno,
                    key: b"k",
                    payload: payload.as_bytes(),
                })
            })
            .collect();
        let bytes = Segment::encode(SHARD, frames).unwrap().encoded().clone();
        let key = ArchiveLayout::new(None).unwrap().segment_key(SHARD, first, last, epoch);
        (SegmentRef::parse(key.as_str(), bytes.len() as u64).unwrap(), bytes)
    }

    /// What one peer's WAL holds: segment key -> the bytes it serves.
    struct Held(BTreeMap<String, Bytes>);

    #[tonic::async_trait]
    impl SegmentSource for Held {
        fn shard_of(&self, _: &ObjectKey) -> Option<u32> {
            Some(SHARD)
        }

        async fn segment(&self, key: &ObjectKey) -> Result<Option<Bytes>, String> {
            Ok(self.0.get(key.as_str()).cloned())
        }
    }

    #[derive(Clone, Copy)]
    enum Fault {
        None,
        /// The second chunk has a byte flipped after its crc32c was computed.
        DamageSecondChunk,
        /// One chunk, then nothing (the stream stays open).
        GoSilent,
    }

    /// The real service, its chunks altered by `fault` on the way out.
    struct Peer {
        inner: PeerExchangeService,
        fault: Fault,
        calls: Arc<AtomicUsize>,
    }

    type Chunks = std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<ShuffleChunk, Status>> + Send>>;

    #[tonic::async_trait]
    impl PeerExchange for Peer {
        type FetchShuffleStream = Chunks;

        async fn fetch_shuffle(&self, request: Request<FetchShuffleRequest>) -> Result<Response<Chunks>, Status> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let stream = self.inner.fetch_shuffle(request).await?.into_inner();
            let stream: Chunks = match self.fault {
                Fault::None => stream,
                Fault::DamageSecondChunk => {
                    let mut n = 0;
                    Box::pin(stream.map(move |chunk| {
                        n += 1;
                        chunk.map(|mut chunk| {
                            if n == 2 {
                                let mut data = chunk.data.to_vec();
                                data[7] ^= 0x40;
                                chunk.data = data.into();
                            }
                            chunk
                        })
                    }))
                }
                Fault::GoSilent => Box::pin(stream.take(1).chain(tokio_stream::pending())),
            };
            Ok(Response::new(stream))
        }
    }

    /// Serves `held` with `fault` on a free loopback port: its address and
    /// its count of fetches.
    async fn serve(held: &[(&SegmentRef, &Bytes)], fault: Fault) -> (String, Arc<AtomicUsize>) {
        let held = Held(held.iter().map(|(s, b)| (s.key.clone(), (*b).clone())).collect());
        let settings = ServeSettings { bytes_per_s: 0, chunk_bytes: CHUNK, ..ServeSettings::default() };
        let metrics = ServeMetrics::new(&prometheus::Registry::new()).unwrap();
        let inner = PeerExchangeService::new(Arc::new(held), key(), settings, metrics);
        let calls = Arc::new(AtomicUsize::new(0));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(PeerExchangeServer::new(Peer { inner, fault, calls: calls.clone() }))
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
        );
        (addr, calls)
    }

    /// A loopback address nothing listens on.
    fn closed_port() -> String {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().to_string()
    }

    fn tier(addresses: &[(NodeId, &str)], idle_timeout: Duration) -> PeerSegments {
        let mut fetcher = PeerFetcher::new(plain_dial());
        fetcher.idle_timeout = idle_timeout;
        PeerSegments {
            me: ME,
            fetcher,
            key: key(),
            addresses: addresses.iter().map(|(id, addr)| (*id, addr.to_string())).collect(),
            skip_until: Default::default(),
            fetches: fetch_counter(),
        }
    }

    fn is_skipped(tier: &PeerSegments, peer: NodeId) -> bool {
        tier.skipped().get(&peer).is_some_and(|until| std::time::Instant::now() < *until)
    }

    #[tokio::test]
    async fn a_damaged_chunk_is_caught_and_the_next_peer_serves_the_segment() {
        let (s, bytes) = segment(1, 60, 3);
        assert!(bytes.len() > 2 * CHUNK, "the segment is {} bytes: no second chunk", bytes.len());
        let (bad, bad_calls) = serve(&[(&s, &bytes)], Fault::DamageSecondChunk).await;
        let (good, good_calls) = serve(&[(&s, &bytes)], Fault::None).await;
        let tier = tier(&[(1, &bad), (2, &good)], Duration::from_secs(15));

        // The damage is caught at the chunk that carries it.
        let task = format!("reseed-shard{SHARD}-node{ME}");
        let token = key().mint(&Grant { task: task.clone(), shard: SHARD, expires_unix_ms: u64::MAX });
        let error = tier.fetcher.fetch(&bad, &task, &s.key, &token, s.size).await.unwrap_err();
        assert!(matches!(error, FetchError::DamagedChunk { offset, .. } if offset == CHUNK as u64), "{error}");

        let got = tier.fetch(SHARD, &s, &[1, 2], None).await.expect("the second peer serves it");
        assert!(got == bytes, "the segment fetched differs from the one held ({} vs {} bytes)", got.len(), bytes.len());
        assert_eq!(bad_calls.load(Ordering::SeqCst), 2, "the damaged peer was asked first (once above)");
        assert_eq!(good_calls.load(Ordering::SeqCst), 1);
        // A damaged chunk is no dead connection: the peer is not skipped.
        assert!(!is_skipped(&tier, 1));
        let counted = |result: &str| tier.fetches.with_label_values(&[result]).get();
        assert_eq!((counted("damaged"), counted("ok"), counted("unreachable")), (1, 1, 0), "fetches by result");
    }

    #[tokio::test]
    async fn a_damaged_or_wrong_segment_served_intact_is_passed_over_for_the_next_peer() {
        let (s, bytes) = segment(1, 60, 3);
        // A record's payload damaged in the serving peer's copy: every chunk's
        // crc32c is computed over the damaged bytes, so only the segment's
        // own checks see it.
        let mut damaged = bytes.to_vec();
        let at = damaged.len() - 10;
        damaged[at] ^= 0x01;
        let damaged = Bytes::from(damaged);
        // Another range (a valid segment) under this key; the right range
        // from another epoch.
        let (_, other_range) = segment(1, 59, 3);
        let (_, other_epoch) = segment(1, 60, 2);
        let (p1, c1) = serve(&[(&s, &damaged)], Fault::None).await;
        let (p2, c2) = serve(&[(&s, &other_range)], Fault::None).await;
        let (p3, c3) = serve(&[(&s, &other_epoch)], Fault::None).await;
        let (p4, c4) = serve(&[(&s, &bytes)], Fault::None).await;
        let tier = tier(&[(1, &p1), (2, &p2), (3, &p3), (4, &p4)], Duration::from_secs(15));

        let got = tier.fetch(SHARD, &s, &[1, 2, 3, 4], None).await.expect("the fourth peer serves it");
        assert!(got == bytes, "the segment fetched differs from the one held ({} vs {} bytes)", got.len(), bytes.len());
        for (peer, calls) in [(1, &c1), (2, &c2), (3, &c3), (4, &c4)] {
            assert_eq!(calls.load(Ordering::SeqCst), 1, "peer {peer} asked once");
        }
        // Without the good peer: none of them served it intact.
        assert_eq!(tier.fetch(SHARD, &s, &[1, 2, 3], None).await, None);
    }

    #[tokio::test]
    async fn an_unreachable_peer_is_skipped_and_the_next_serves_the_segment() {
        let (s, bytes) = segment(1, 60, 3);
        let closed = closed_port();
        let (good, good_calls) = serve(&[(&s, &bytes)], Fault::None).await;
        let tier = tier(&[(1, &closed), (2, &good)], Duration::from_secs(15));

        let started = std::time::Instant::now();
        let got = tier.fetch(SHARD, &s, &[1, 2], None).await.expect("the second peer serves it");
        assert!(got == bytes, "the segment fetched differs from the one held");
        assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
        assert_eq!(good_calls.load(Ordering::SeqCst), 1);
        assert!(is_skipped(&tier, 1), "a peer whose connection failed is skipped for a while");
        assert!(!is_skipped(&tier, 2));
    }

    #[tokio::test]
    async fn a_peer_gone_silent_is_given_up_after_the_idle_timeout_and_the_next_serves() {
        let (s, bytes) = segment(1, 60, 3);
        let (silent, silent_calls) = serve(&[(&s, &bytes)], Fault::GoSilent).await;
        let (good, good_calls) = serve(&[(&s, &bytes)], Fault::None).await;
        let idle = Duration::from_millis(300);
        let tier = tier(&[(1, &silent), (2, &good)], idle);

        let started = std::time::Instant::now();
        let got = tier.fetch(SHARD, &s, &[1, 2], None).await.expect("the second peer serves it");
        let took = started.elapsed();
        assert!(got == bytes, "the segment fetched differs from the one held");
        // Silent after one chunk, resumed once, silent again: two idle
        // timeouts, not the default 15 s.
        assert!(took >= 2 * idle && took < Duration::from_secs(5), "took {took:?}");
        assert_eq!(silent_calls.load(Ordering::SeqCst), 2, "one resume, then the next peer");
        assert_eq!(good_calls.load(Ordering::SeqCst), 1);
        assert!(is_skipped(&tier, 1), "a silent peer is skipped for a while");
    }

    #[tokio::test]
    async fn when_every_peer_fails_the_tier_answers_none() {
        let (s, bytes) = segment(1, 60, 3);
        let (other, _) = segment(61, 90, 3);
        let closed = closed_port();
        let (damaging, damaging_calls) = serve(&[(&s, &bytes)], Fault::DamageSecondChunk).await;
        let (silent, silent_calls) = serve(&[(&s, &bytes)], Fault::GoSilent).await;
        let (not_holding, not_holding_calls) = serve(&[(&other, &bytes)], Fault::None).await;
        let (good, good_calls) = serve(&[(&s, &bytes)], Fault::None).await;
        let tier = tier(
            &[(1, &closed), (2, &damaging), (3, &silent), (4, &not_holding), (6, &good)],
            Duration::from_millis(300),
        );

        // Peer 5 has no address.
        assert_eq!(tier.fetch(SHARD, &s, &[1, 2, 3, 4, 5], None).await, None);
        for (what, calls) in
            [("damaging", &damaging_calls), ("silent", &silent_calls), ("not holding", &not_holding_calls)]
        {
            assert!(calls.load(Ordering::SeqCst) >= 1, "the {what} peer was never asked");
        }
        assert_eq!(good_calls.load(Ordering::SeqCst), 0);
        // The same tier, with a good peer last, gets it (the failures above
        // were the peers', not the tier's).
        let got = tier.fetch(SHARD, &s, &[1, 2, 3, 4, 5, 6], None).await.expect("the good peer serves it");
        assert!(got == bytes, "the segment fetched differs from the one held");
        assert_eq!(good_calls.load(Ordering::SeqCst), 1);
    }
}
