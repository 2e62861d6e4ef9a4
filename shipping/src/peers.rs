//! gRPC channels to the other nodes, created lazily (a peer that is down
//! costs nothing until it is dialed) with TCP_NODELAY and bounded connect
//! times. Every cluster RPC sent through them carries the cluster secret
//! ([`crate::auth`]); `Log` calls (drills act as clients) carry it too,
//! harmlessly.

use std::collections::BTreeMap;
use std::time::Duration;

use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use walship_proto::log::control_client::ControlClient;
use walship_proto::log::log_client::LogClient;
use walship_proto::replication::wal_shipping_client::WalShippingClient;

use crate::NodeId;
use crate::auth::ClusterCredentials;
use crate::config::{Address, ClusterConfig, ConfigError};

/// A channel to a peer whose calls carry the cluster's credentials.
pub type PeerChannel = InterceptedService<Channel, ClusterCredentials>;

/// Largest message a replication client sends or accepts.
pub const MAX_PEER_MESSAGE_BYTES: usize = 64 << 20;

/// How this process reaches the other members of its cluster: the
/// credentials every call carries and, when the cluster runs TLS, the
/// client TLS settings (the cluster CA, and this process's certificate as
/// its client identity for mutual TLS). Read once at start: a renewed
/// certificate reaches the client side at the next restart (servers
/// reload theirs without one).
#[derive(Clone)]
pub struct PeerTransport {
    credentials: ClusterCredentials,
    tls: Option<ClientTlsConfig>,
}

impl PeerTransport {
    /// The transport `cluster` asks for, reading its TLS files if any.
    pub fn new(cluster: &ClusterConfig) -> Result<PeerTransport, ConfigError> {
        let tls = match &cluster.tls {
            Some(tls) => {
                let pems = tls.read()?;
                Some(
                    ClientTlsConfig::new()
                        .ca_certificate(Certificate::from_pem(pems.ca))
                        .identity(Identity::from_pem(pems.cert, pems.key)),
                )
            }
            None => None,
        };
        Ok(PeerTransport { credentials: ClusterCredentials::of(cluster.secret()), tls })
    }

    /// A transport with `cluster`'s credentials and no TLS (tests of the
    /// pure parts; a cluster with `[tls]` needs [`PeerTransport::new`]).
    pub fn plaintext(cluster: &ClusterConfig) -> PeerTransport {
        PeerTransport { credentials: ClusterCredentials::of(cluster.secret()), tls: None }
    }

    /// A lazily connected channel to the member at `addr`, its calls
    /// carrying the cluster's credentials.
    /// A channel to `addr` with this transport's TLS but without the
    /// cluster credentials: for PeerExchange, which fetch tokens guard.
    pub fn token_channel(&self, addr: &Address) -> Channel {
        endpoint(addr, self.tls.clone()).connect_lazy()
    }

    pub fn channel(&self, addr: &Address) -> PeerChannel {
        InterceptedService::new(endpoint(addr, self.tls.clone()).connect_lazy(), self.credentials.clone())
    }
}

/// Lazily connected channels, one per peer node.
#[derive(Clone)]
pub struct Peers {
    peers: BTreeMap<NodeId, (Address, PeerChannel)>,
    transport: PeerTransport,
}

/// The endpoint for `addr`: TCP_NODELAY, bounded connect time, HTTP/2
/// keepalives, over TLS when `tls` is given.
fn endpoint(addr: &Address, tls: Option<ClientTlsConfig>) -> Endpoint {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let endpoint = Endpoint::from_shared(format!("{scheme}://{addr}"))
        .expect("a socket address is a valid URI authority")
        .connect_timeout(Duration::from_secs(1))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(5))
        .keep_alive_timeout(Duration::from_secs(5));
    match tls {
        Some(tls) => endpoint.tls_config(tls).expect("TLS settings for an https endpoint"),
        None => endpoint,
    }
}

impl Peers {
    /// Channels to every node of `cluster`.
    pub fn new(cluster: &ClusterConfig, transport: &PeerTransport) -> Peers {
        let peers = cluster.addresses().into_iter().map(|(id, addr)| (id, (addr.clone(), transport.channel(&addr))));
        Peers { peers: peers.collect(), transport: transport.clone() }
    }

    /// How this process reaches members (for channels to coordinators).
    pub fn transport(&self) -> &PeerTransport {
        &self.transport
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
