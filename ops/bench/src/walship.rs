//! walship: three `walship node` processes, one shard at RF=3, appends at
//! `QUORUM` or `ALL`.
//!
//! The nodes run from the release binary the script builds (`--walship`),
//! each with its own data directory on the benchmark disk, with the
//! replication settings a default deployment gets (`[replication]` left
//! at its defaults), and a `walship coord` (embedded file KV, default loss
//! detection: 50 ms heartbeats, 200 ms timeout) that owns leadership as in
//! production. Under a coordinator leaders ship each batch while their own
//! fsync runs (`shipping/EARLY-SHIPPING.md`). Clients append through
//! `Log.AppendStream`, walship's API for many appends in flight.
//!
//! [`WalshipCluster::with_unary`] has every client call the plain unary
//! `Log.Append` instead, one record per call (`walship-unary`): how most
//! clients append; the same cluster, shard and connections.
//!
//! [`WalshipCluster::with_producers`] makes every client an exactly-once
//! producer session of its own (`walship-quorum-producer`): the same cluster,
//! shard and connections, each append carrying `AppendRequest.producer`.
//!
//! [`WalshipCluster::with_batching`] has the clients share one
//! [`walship_client::Producer`] (`walship-batched`), as the threads of a
//! process share a Kafka producer: each client still sends one record and
//! waits for that record's acknowledgement before its next, and the
//! producer batches what the clients send while its earlier batches are in
//! flight ([`BATCHING`]).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use async_trait::async_trait;
use bytes::Bytes;
use futures::future::BoxFuture;
use rand::Rng;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::transport::{Channel, Endpoint};
use walship_client::{Connect, ConnectError, ProducerConfig};
use walship_proto::log::log_client::LogClient;
use walship_proto::log::{AppendRecord, AppendRequest, Durability, Producer};
use walship_proto::pipeline::AppendPipeline;
use walship_shipping::config::CoordinatorSpec;
use walship_shipping::{ClusterConfig, NodeSpec};

use crate::proc::{Server, distinct_ports, wait_for_port};
use crate::system::{Appender, Cluster};

/// Most HTTP/2 connections the clients share (the same cap as the
/// JetStream clients' connections).
pub const MAX_CONNECTIONS: usize = 8;

pub struct WalshipCluster {
    durability: Durability,
    /// gRPC address of node i+1 at index i.
    nodes: Vec<SocketAddr>,
    /// Admin HTTP address of node i+1 at index i.
    admins: Vec<SocketAddr>,
    /// The configured leader's index into `nodes` (where leader-following
    /// clients start looking).
    leader: usize,
    /// Node servers, index as `nodes`.
    servers: Vec<Server>,
    /// The coordinator's process and admin address.
    coordinator: (Server, SocketAddr),
    /// How the clients of [`Cluster::appenders`] append.
    clients: Clients,
}

/// How the clients of [`Cluster::appenders`] append.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Clients {
    /// One record per append on their connection's `Log.AppendStream`.
    Stream,
    /// The same, each client an exactly-once producer session of its own
    /// ([`WalshipCluster::with_producers`]).
    Sessions,
    /// One record per unary `Log.Append` call ([`WalshipCluster::with_unary`]).
    Unary,
    /// One record at a time through a producer they share
    /// ([`WalshipCluster::with_batching`]).
    Batched,
}

/// The shared producer of `walship-batched`: a batch goes out as soon as one
/// of the shard's `in_flight` pipeline slots is free (no linger), holding
/// every record the clients sent while all the slots were busy. So a lone
/// client's record goes at once, and under load the batches grow with the
/// number of clients waiting; the durability is the cluster's.
pub const BATCHING: ProducerConfig = ProducerConfig {
    durability: Durability::Quorum,
    linger: Duration::ZERO,
    batch_records: 1_000,
    batch_bytes: 1 << 20,
    buffer_bytes: 64 << 20,
    in_flight: 16,
    deadline: Duration::from_secs(30),
    request_timeout: Duration::from_secs(5),
    id: None,
    epoch: None,
    max_request_bytes: 32 << 20,
};

/// Leader loss timeout for throughput cells. The default (200 ms, kept for
/// the failover measurement) is for machines whose nodes have cores of their
/// own; here four processes and the load share two cores, and a heartbeat
/// late by 200 ms under a 256-client load once failed a leader over in the
/// middle of a cell, which measures the scheduler rather than throughput.
const THROUGHPUT_LEADER_TIMEOUT_MS: u64 = 1_000;

/// Starts the coordinator and the three nodes under `dir` (fresh) and
/// returns once an append is acknowledged at `durability`. `default_timeouts`
/// keeps the default leader loss timeout (for the failover measurement);
/// otherwise it is [`THROUGHPUT_LEADER_TIMEOUT_MS`]. Every node also gets
/// `node_flags`.
pub async fn start(
    dir: &Path,
    walship: &Path,
    durability: Durability,
    default_timeouts: bool,
    node_flags: &[&str],
) -> Result<Box<dyn Cluster>> {
    Ok(Box::new(start_cluster(dir, walship, durability, default_timeouts, node_flags, |_| {}).await?))
}

/// [`start`], returning the cluster itself (its nodes' PIDs and addresses),
/// with `configure` applied to the cluster config after the harness's own
/// settings.
pub async fn start_cluster(
    dir: &Path,
    walship: &Path,
    durability: Durability,
    default_timeouts: bool,
    node_flags: &[&str],
    configure: impl FnOnce(&mut ClusterConfig),
) -> Result<WalshipCluster> {
    if !walship.is_file() {
        bail!("walship binary not found at {} (build it: cargo build --release)", walship.display());
    }
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    // Three nodes and the coordinator, two ports each, all different.
    let mut ports = distinct_ports(8)?.into_iter().map(|p| SocketAddr::from(([127, 0, 0, 1], p)));
    let mut loopback = || ports.next().context("a port for every listener");
    let mut specs = Vec::new();
    for id in 1..=3 {
        specs.push(NodeSpec { id, grpc_addr: loopback()?.into(), admin_addr: loopback()?.into(), region: id });
    }
    let mut config = ClusterConfig::replicated_everywhere(specs, 1);
    config.cluster_id = "compare".into();
    if !default_timeouts {
        config.replication.leader_timeout_ms = THROUGHPUT_LEADER_TIMEOUT_MS;
    }
    let spec = CoordinatorSpec { id: "bench".into(), grpc_addr: loopback()?.into(), admin_addr: loopback()?.into() };
    config.coordinators = vec![spec.clone()];
    configure(&mut config);
    config.validate()?;
    let file = dir.join("cluster.toml");
    config.save(&file).with_context(|| format!("writing {}", file.display()))?;
    let mut command = Command::new(walship);
    command
        .args(["coord", "--id", &spec.id, "--admin-token", "walship-compare-token", "--cluster"])
        .arg(&file)
        .arg("--data-dir")
        .arg(dir.join("coord"))
        .env("WALSHIP_LOG", "warn");
    let mut server = Server::spawn("walship coord", command, &dir.join("coord.log"), libc::SIGTERM)?;
    let admin: SocketAddr = spec.admin_addr.to_string().parse()?;
    tokio::task::block_in_place(|| wait_for_port(admin, Duration::from_secs(30), &mut server))?;
    let coordinator = (server, admin);
    let mut servers = Vec::new();
    let mut nodes = Vec::new();
    let mut admins = Vec::new();
    for node in &config.nodes {
        let mut command = Command::new(walship);
        command
            .arg("node")
            .args(["--node-id", &node.id.to_string(), "--cluster"])
            .arg(&file)
            .arg("--data-dir")
            .arg(dir.join(format!("node-{}", node.id)))
            .args(node_flags)
            .env("WALSHIP_LOG", "warn");
        let log = dir.join(format!("node-{}.log", node.id));
        servers.push(Server::spawn(&format!("walship node {}", node.id), command, &log, libc::SIGTERM)?);
        nodes.push(node.grpc_addr.to_string().parse::<SocketAddr>()?);
        admins.push(node.admin_addr.to_string().parse::<SocketAddr>()?);
    }
    for (server, addr) in servers.iter_mut().zip(&nodes) {
        tokio::task::block_in_place(|| wait_for_port(*addr, Duration::from_secs(30), server))?;
    }
    let leader = config.shards[0].leader as usize - 1;
    let cluster = WalshipCluster { durability, nodes, admins, leader, servers, coordinator, clients: Clients::Stream };
    cluster.wait_ready().await?;
    Ok(cluster)
}

/// A `Log` client of the node at `addr`.
pub async fn connect(addr: SocketAddr) -> Result<LogClient<Channel>> {
    let channel = Endpoint::from_shared(format!("http://{addr}"))?.tcp_nodelay(true).connect().await?;
    Ok(LogClient::new(channel))
}

/// How a [`walship_client::Producer`] opens a node's client: [`connect`]
/// to its `host:port`.
pub fn producer_connect() -> Connect {
    Arc::new(|server: String| -> BoxFuture<'static, Result<_, ConnectError>> {
        Box::pin(async move {
            let addr = server.parse::<SocketAddr>().map_err(|e| Arc::new(e) as ConnectError)?;
            connect(addr)
                .await
                .map_err(|e| Arc::from(Box::<dyn std::error::Error + Send + Sync>::from(e)) as ConnectError)
        })
    })
}

impl WalshipCluster {
    /// Makes each client of [`Cluster::appenders`] a producer session of its
    /// own (a random non-zero id, epoch 1, sequences from 1 up by the records
    /// of each acknowledged append) on the same shard and connections as
    /// without. Failover appenders stay plain.
    pub fn with_producers(mut self) -> WalshipCluster {
        self.clients = Clients::Sessions;
        self
    }

    /// Makes each client of [`Cluster::appenders`] call the unary
    /// `Log.Append`, one record and one call outstanding at a time, over the
    /// same connections as the pipelined clients (no `AppendStream`).
    pub fn with_unary(mut self) -> WalshipCluster {
        self.clients = Clients::Unary;
        self
    }

    /// Makes the clients of [`Cluster::appenders`] share one producer
    /// ([`BATCHING`], one connection to the leader), each sending one record
    /// and waiting for its acknowledgement before the next.
    pub fn with_batching(mut self) -> WalshipCluster {
        self.clients = Clients::Batched;
        self
    }

    /// The node processes' PIDs, node i+1 at index i.
    pub fn node_pids(&self) -> Vec<u32> {
        self.servers.iter().map(Server::pid).collect()
    }

    /// The nodes' gRPC addresses, node i+1 at index i.
    pub fn node_addrs(&self) -> &[SocketAddr] {
        &self.nodes
    }

    /// The nodes' admin HTTP addresses, node i+1 at index i.
    pub fn admin_addrs(&self) -> &[SocketAddr] {
        &self.admins
    }

    /// Fails if a node or the coordinator has exited.
    pub fn check_running(&mut self) -> Result<()> {
        for server in &mut self.servers {
            server.check_running()?;
        }
        self.coordinator.0.check_running()
    }

    /// The shard's leader as the coordinator records it: index into
    /// [`Self::node_addrs`].
    pub async fn leader_index(&self) -> Result<usize> {
        let leader = self.recorded_leader(self.coordinator.1).await?;
        if leader == 0 || leader > self.nodes.len() {
            bail!("the coordinator names node {leader} as leader");
        }
        Ok(leader - 1)
    }

    /// Retries one append (following the leader) until the followers are
    /// connected and it is acknowledged at the benchmark's durability.
    async fn wait_ready(&self) -> Result<()> {
        let appender = self.following_appenders(1).await?.remove(0);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match appender.append(Bytes::from_static(b"ready")).await {
                Ok(()) => return Ok(()),
                Err(e) if Instant::now() > deadline => return Err(e.context("walship never became ready")),
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    /// `n` leader-following clients sharing one connection per node, each
    /// with its own idea of who leads.
    async fn following_appenders(&self, n: usize) -> Result<Vec<FollowingAppender>> {
        let mut clients = Vec::new();
        for addr in &self.nodes {
            clients.push(connect(*addr).await?);
        }
        Ok((0..n)
            .map(|_| FollowingAppender {
                clients: clients.clone(),
                current: AtomicUsize::new(self.leader),
                durability: self.durability,
            })
            .collect())
    }

    /// The shard's leader as the coordinator records it (1-based node id).
    async fn recorded_leader(&self, admin: SocketAddr) -> Result<usize> {
        let body = http_get(admin, "/v1/shards/1").await?;
        let value: serde_json::Value = serde_json::from_str(&body).context("coordinator's /v1/shards/1")?;
        let leader = value["leader"].as_u64().with_context(|| format!("no leader in {body}"))?;
        Ok(leader as usize)
    }
}

#[async_trait]
impl Cluster for WalshipCluster {
    async fn appenders(&self, clients: usize) -> Result<Vec<Arc<dyn Appender>>> {
        // The coordinator's leader: usually node 1, unless a node was slow
        // enough to start that it failed over before the first append.
        let leader = self.recorded_leader(self.coordinator.1).await?;
        let addr = *self.nodes.get(leader.wrapping_sub(1)).with_context(|| format!("no node {leader}"))?;
        if self.clients == Clients::Batched {
            // The leader first: the producer tries the servers in turn.
            let mut servers = vec![addr.to_string()];
            servers.extend(self.nodes.iter().filter(|a| **a != addr).map(ToString::to_string));
            let config = ProducerConfig { durability: self.durability, ..BATCHING };
            let producer = Arc::new(walship_client::Producer::new(servers, producer_connect(), config));
            return Ok((0..clients)
                .map(|_| Arc::new(BatchedAppender { producer: producer.clone() }) as Arc<dyn Appender>)
                .collect());
        }
        let mut connections = Vec::new();
        for _ in 0..clients.clamp(1, MAX_CONNECTIONS) {
            connections.push(connect(addr).await?);
        }
        if self.clients == Clients::Unary {
            return Ok((0..clients)
                .map(|i| {
                    let client = connections[i % connections.len()].clone();
                    Arc::new(UnaryAppender { client, durability: self.durability }) as Arc<dyn Appender>
                })
                .collect());
        }
        let mut pipelines = Vec::new();
        for client in connections {
            pipelines.push(Arc::new(AppendPipeline::open(client).await.context("opening an AppendStream")?));
        }
        Ok((0..clients)
            .map(|i| {
                let pipeline = pipelines[i % pipelines.len()].clone();
                let producer = (self.clients == Clients::Sessions).then(ProducerSession::new);
                Arc::new(WalshipAppender { pipeline, durability: self.durability, producer }) as Arc<dyn Appender>
            })
            .collect())
    }

    async fn stop(mut self: Box<Self>) -> Result<()> {
        // Stopping waits on the processes: off the async workers.
        tokio::task::block_in_place(|| {
            for server in &mut self.servers {
                server.stop()?;
            }
            self.coordinator.0.stop()?;
            Ok(())
        })
    }

    async fn kill_leader(&mut self) -> Result<Option<String>> {
        let leader = self.recorded_leader(self.coordinator.1).await?;
        let server = self.servers.get_mut(leader - 1).with_context(|| format!("no node {leader}"))?;
        server.kill()?;
        Ok(Some(server.name.clone()))
    }

    async fn failover_appenders(&self, clients: usize) -> Result<Vec<Arc<dyn Appender>>> {
        let appenders = self.following_appenders(clients).await?;
        Ok(appenders.into_iter().map(|a| Arc::new(a) as Arc<dyn Appender>).collect())
    }
}

fn request(payload: Bytes, durability: Durability) -> AppendRequest {
    AppendRequest {
        shard_id: 1,
        records: vec![AppendRecord { key: Bytes::new(), payload }],
        durability: durability as i32,
        ..Default::default()
    }
}

/// One client of the leader: one append in flight at a time, sharing its
/// connection's `AppendStream` (walship's client API for many concurrent
/// appends) with the other clients on that connection.
struct WalshipAppender {
    pipeline: Arc<AppendPipeline>,
    durability: Durability,
    /// This client's producer session, for `walship-quorum-producer`.
    producer: Option<ProducerSession>,
}

/// One client's producer session: epoch 1 and the sequence of its next
/// record. The client has one append in flight at a time, so the sequence
/// only moves once an append is acknowledged; a retry after an error would
/// send the same sequence again, as a real producer does.
struct ProducerSession {
    id: u64,
    next: AtomicU64,
}

impl ProducerSession {
    fn new() -> ProducerSession {
        ProducerSession { id: rand::thread_rng().gen_range(1..=u64::MAX), next: AtomicU64::new(1) }
    }
}

#[async_trait]
impl Appender for WalshipAppender {
    async fn append(&self, payload: Bytes) -> Result<()> {
        let mut request = request(payload, self.durability);
        let Some(session) = &self.producer else {
            self.pipeline.append(request).await.map_err(|s| anyhow::anyhow!("walship append: {s}"))?;
            return Ok(());
        };
        let (sequence, records) = (session.next.load(Ordering::Relaxed), request.records.len() as u64);
        request.producer = Some(Producer { id: session.id, epoch: 1, sequence });
        let answer =
            self.pipeline.append(request).await.map_err(|s| anyhow::anyhow!("walship producer append: {s}"))?;
        // Every sequence is new: a duplicate answer would mean a record the
        // benchmark counts was not written.
        if answer.duplicate || answer.last_seqno.checked_sub(answer.first_seqno) != Some(records - 1) {
            bail!(
                "producer {:x} sequence {sequence}: answered seqnos {}..={} duplicate {} for {records} new records",
                session.id,
                answer.first_seqno,
                answer.last_seqno,
                answer.duplicate
            );
        }
        session.next.store(sequence + records, Ordering::Relaxed);
        Ok(())
    }
}

/// One client of the leader calling the unary `Log.Append`, one record per
/// call and one call at a time, on a connection shared with other clients
/// (each call its own HTTP/2 stream).
struct UnaryAppender {
    client: LogClient<Channel>,
    durability: Durability,
}

#[async_trait]
impl Appender for UnaryAppender {
    async fn append(&self, payload: Bytes) -> Result<()> {
        let mut client = self.client.clone();
        client
            .append(request(payload, self.durability))
            .await
            .map_err(|s| anyhow::anyhow!("walship unary append: {s}"))?;
        Ok(())
    }
}

/// One client sending through the producer its process shares, one record
/// at a time (`walship-batched`).
struct BatchedAppender {
    producer: Arc<walship_client::Producer>,
}

#[async_trait]
impl Appender for BatchedAppender {
    async fn append(&self, payload: Bytes) -> Result<()> {
        let acked = self.producer.send(1, Bytes::new(), payload).await.await?;
        // Every record is sent once: an answer naming it a duplicate would
        // mean a record the benchmark counts was not written by this send.
        if acked.duplicate || acked.shard != 1 {
            bail!("walship producer answered {acked:?} for a new record of shard 1");
        }
        Ok(())
    }
}

/// A client that knows every node: each attempt gives up after
/// [`crate::failover::ATTEMPT`], and after any error the next attempt goes
/// to the next node, so it finds whoever leads (followers refuse appends).
struct FollowingAppender {
    clients: Vec<LogClient<Channel>>,
    current: AtomicUsize,
    durability: Durability,
}

#[async_trait]
impl Appender for FollowingAppender {
    async fn append(&self, payload: Bytes) -> Result<()> {
        let turn = self.current.load(Ordering::Relaxed);
        let at = turn % self.clients.len();
        let mut request = tonic::Request::new(request(payload, self.durability));
        request.set_timeout(crate::failover::ATTEMPT);
        let mut client = self.clients[at].clone();
        let outcome = tokio::time::timeout(crate::failover::ATTEMPT, client.append(request)).await;
        match outcome {
            Ok(Ok(_)) => Ok(()),
            failed => {
                // Move on, unless a concurrent attempt already did.
                let _ = self.current.compare_exchange(turn, turn + 1, Ordering::Relaxed, Ordering::Relaxed);
                match failed {
                    Ok(Err(status)) => bail!("walship append to node {}: {status}", at + 1),
                    _ => bail!("walship append to node {}: no answer within {:?}", at + 1, crate::failover::ATTEMPT),
                }
            }
        }
    }
}

/// A plain HTTP/1.1 GET; returns the body of a 200 answer.
pub async fn http_get(addr: SocketAddr, path: &str) -> Result<String> {
    let (status, body) = http_request(addr, "GET", path, None, None).await?;
    if status != 200 {
        bail!("GET {path} from {addr}: {status} {body}");
    }
    Ok(body)
}

/// One plain HTTP/1.1 request (a JSON `body`, a bearer `token`, both
/// optional); returns the status and the body (de-chunked if chunked).
pub async fn http_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&str>,
    token: Option<&str>,
) -> Result<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect(addr).await.with_context(|| format!("connecting to {addr}"))?;
    let body = body.unwrap_or("");
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\n\
         {auth}Content-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await?;
    let split = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .with_context(|| format!("no HTTP answer from {addr} to {method} {path}"))?;
    let head = String::from_utf8_lossy(&response[..split]).to_string();
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("malformed HTTP status from {addr}: {head}"))?;
    let payload = &response[split + 4..];
    let payload = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        dechunk(payload)?
    } else {
        payload.to_vec()
    };
    Ok((status, String::from_utf8_lossy(&payload).into_owned()))
}

/// The payload of a `Transfer-Encoding: chunked` body.
fn dechunk(mut raw: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = raw.windows(2).position(|w| w == b"\r\n").context("malformed chunked body")?;
        let size_text = String::from_utf8_lossy(&raw[..line_end]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .with_context(|| format!("malformed chunk size {size_text:?}"))?;
        raw = &raw[line_end + 2..];
        if size == 0 {
            return Ok(out);
        }
        let chunk = raw.get(..size).context("truncated chunked body")?;
        out.extend_from_slice(chunk);
        raw = raw.get(size + 2..).context("truncated chunked body")?;
    }
}

/// The `walship` binary beside this one (`target/release/walship` when
/// the harness runs from `target/release`).
pub fn default_binary() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|dir| dir.join("walship")))
        .unwrap_or_else(|| PathBuf::from("target/release/walship"))
}

#[cfg(test)]
mod tests {
    use super::dechunk;

    #[test]
    fn dechunks_a_chunked_body() {
        assert_eq!(dechunk(b"5\r\nhello\r\n7;x=1\r\n, world\r\n0\r\n\r\n").unwrap(), b"hello, world");
        assert!(dechunk(b"9\r\nhello\r\n").is_err());
        assert!(dechunk(b"zz\r\n").is_err());
    }
}
