//! gRPC channels to the other nodes, created lazily (a peer that is down
//! costs nothing until it is dialed) with TCP_NODELAY and bounded connect
//! times. Every cluster RPC sent through them carries the cluster secret
//! ([`crate::auth`]); `Log` calls (drills act as clients) carry it too,
//! harmlessly.

use std::collections::BTreeMap;
use std::time::Duration;

use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use walship_proto::log::control_client::ControlClient;
use walship_proto::log::log_client::LogClient;
use walship_proto::replication::wal_shipping_client::WalShippingClient;

use crate::NodeId;
use crate::auth::ClusterCredentials;
use crate::config::{Address, ClusterConfig};

/// A channel to a peer whose calls carry the cluster's credentials.
pub type PeerChannel = InterceptedService<Channel, ClusterCredentials>;

/// Largest message a replication client sends or accepts.
pub const MAX_PEER_MESSAGE_BYTES: usize = 64 << 20;

/// Lazily connected channels, one per peer node.
#[derive(Clone)]
pub struct Peers {
    peers: BTreeMap<NodeId, (Address, PeerChannel)>,
}

/// A lazily connected channel to `addr`.
pub fn lazy_channel(addr: &Address) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .expect("a socket address is a valid URI authority")
        .connect_timeout(Duration::from_secs(1))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(5))
        .keep_alive_timeout(Duration::from_secs(5))
        .connect_lazy()
}

/// A lazily connected channel to a member of `cluster` at `addr`, its
/// calls carrying the cluster's credentials.
pub fn peer_channel(cluster: &ClusterConfig, addr: &Address) -> PeerChannel {
    InterceptedService::new(lazy_channel(addr), ClusterCredentials::of(cluster.secret()))
}

impl Peers {
    /// Channels to every node of `cluster`.
    pub fn new(cluster: &ClusterConfig) -> Peers {
        let addresses = cluster.addresses();
        Peers { peers: addresses.iter().map(|(&id, addr)| (id, (addr.clone(), peer_channel(cluster, addr)))).collect() }
    }

    pub fn address(&self, node: NodeId) -> Option<&Address> {
        self.peers.get(&node).map(|(addr, _)| addr)
    }

    pub fn shipping(&self, node: NodeId) -> Option<WalShippingClient<PeerChannel>> {
        self.peers.get(&node).map(|(_, channel)| {
            WalShippingClient::new(channel.clone())
                .max_decoding_message_size(MAX_PEER_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_PEER_MESSAGE_BYTES)
        })
    }

    pub fn control(&self, node: NodeId) -> Option<ControlClient<PeerChannel>> {
        self.peers.get(&node).map(|(_, channel)| ControlClient::new(channel.clone()))
    }

    pub fn log(&self, node: NodeId) -> Option<LogClient<PeerChannel>> {
        self.peers.get(&node).map(|(_, channel)| {
            LogClient::new(channel.clone())
                .max_decoding_message_size(MAX_PEER_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_PEER_MESSAGE_BYTES)
        })
    }
}
