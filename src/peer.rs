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
}

/// How long a peer whose connection failed is skipped.
const SKIP_FAILED_PEER: Duration = Duration::from_secs(30);

impl PeerSegments {
    pub fn new(me: NodeId, cluster: &ClusterConfig, dial: Dial) -> PeerSegments {
        let addresses = cluster.addresses().into_iter().map(|(id, addr)| (id, addr.to_string())).collect();
        let fetcher = PeerFetcher::new(dial);
        PeerSegments { me, fetcher, key: token_key(cluster), addresses, skip_until: Default::default() }
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
            match self.fetcher.fetch(addr, &task, &segment.key, &token).await {
                Ok(bytes) => return Some(bytes),
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
