//! Process wiring of a node: open the WAL, serve the Log service (with gRPC
//! health and reflection) and the admin HTTP API, stop on Ctrl-C/SIGTERM.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::service::interceptor::InterceptedService;
use walship_admin_api::NodeAdmin;
use walship_admin_api::models::WorkerStatus;
use walship_dataplane::worker::{Dial, Worker, WorkerSettings};
use walship_proto::dataplane::data_plane_client::DataPlaneClient;
use walship_proto::dataplane::peer_exchange_server::PeerExchangeServer;
use walship_proto::log::control_server::ControlServer;
use walship_proto::log::log_server::LogServer;
use walship_proto::replication::wal_shipping_server::WalShippingServer;
use walship_shipping::auth::{ClusterSecret, SECRET_ENV};
use walship_shipping::peers::{MAX_PEER_MESSAGE_BYTES, PeerTransport};
use walship_shipping::{
    ClusterConfig, ControlService, LogLimits, LogService, LogServiceMetrics, NodeSpec, ReplicationMetrics,
    ReplicationNode, WalShippingService,
};
use walship_wal::{EngineStore, EngineStoreConfig, Wal, WalConfig, WalMetrics};

use crate::config::{NodeConfig, WalTuning, parse_shards};

#[derive(Args, Debug)]
pub struct NodeArgs {
    /// TOML config file (see ops/node.example.toml); flags override its values.
    #[arg(long, env = "WALSHIP_NODE_CONFIG")]
    config: Option<PathBuf>,
    /// Cluster config (see ops/cluster.example.toml): peers, shards, replica
    /// sets, leaders and the cluster secret (or WALSHIP_CLUSTER_SECRET)
    /// that node-to-node and coordinator calls carry. Without it the node
    /// runs alone with --shards.
    #[arg(long, env = "WALSHIP_CLUSTER_CONFIG")]
    cluster: Option<PathBuf>,
    #[command(flatten)]
    own_certificate: crate::tls::OwnCertificate,
    /// This node's id.
    #[arg(long)]
    node_id: Option<u32>,
    /// gRPC listen address (default: this node's address in the cluster
    /// config, resolved); port 0 picks a free port.
    #[arg(long)]
    grpc: Option<SocketAddr>,
    /// Admin HTTP listen address; port 0 picks a free port.
    #[arg(long)]
    admin: Option<SocketAddr>,
    /// Data directory (the WAL lives in <data-dir>/wal).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Shards hosted, e.g. `1-4` or `1,2,7`.
    #[arg(long)]
    shards: Option<String>,
    /// Largest key + payload of one record, in bytes.
    #[arg(long)]
    max_record_bytes: Option<usize>,
    /// Bytes of read answers (Read, Tail) the node holds at once, built or
    /// not yet taken by their callers (`limits.read_memory_bytes`, default
    /// 256 MiB).
    #[arg(long)]
    read_memory_bytes: Option<usize>,
    /// Zero-fill the WAL file appends go to, at start (`wal.prefill`,
    /// default true): `--wal-prefill false` starts faster and makes early
    /// group commits slower.
    #[arg(long)]
    wal_prefill: Option<bool>,
    /// Bytes of spare WAL files of zeros laid out before serving, with
    /// `--wal-prefill` (`wal.spare_bytes`, default 2 GiB; 0 lays out none).
    #[arg(long)]
    wal_spare_bytes: Option<u64>,
    /// Read rate of the background WAL scrubber in bytes per second
    /// (`wal.scrub_bytes_per_s`, default 8 MiB/s; 0 disables it).
    #[arg(long)]
    wal_scrub_bytes_per_s: Option<u64>,
    /// Seconds between the starts of two WAL scrub passes
    /// (`wal.scrub_interval_s`, default 86400).
    #[arg(long)]
    wal_scrub_interval_s: Option<u64>,
    /// Free-space reserve of the WAL's disk, in bytes: appends are refused
    /// (`RESOURCE_EXHAUSTED`) and leadership handed over while less is free
    /// (`wal.min_free_bytes`, default 256 MiB; 0 turns the check off).
    #[arg(long)]
    wal_min_free_bytes: Option<u64>,
    /// MiB per second this node's DataPlane tasks (verify, export) may
    /// read from its WAL, all together (`task_read_mib_per_s`, default 64;
    /// 0 = unlimited).
    #[arg(long)]
    task_read_mib_per_s: Option<u64>,
    /// MiB per second this node serves archived segments to peers at, all
    /// fetches together (`peer_serve.mib_per_s`, default 64; 0 = unlimited).
    #[arg(long)]
    peer_serve_mib_per_s: Option<u64>,
    /// PeerExchange fetches served at once (`peer_serve.concurrency`, default 16).
    #[arg(long)]
    peer_serve_concurrency: Option<usize>,
    /// How long a fetch waits for a serving slot before RESOURCE_EXHAUSTED
    /// (`peer_serve.wait_ms`, default 10000).
    #[arg(long)]
    peer_serve_wait_ms: Option<u64>,
    /// Honour the coordinator's crash drills (the process aborts as if
    /// killed). For dev and test clusters only.
    #[arg(long)]
    allow_crash_drills: bool,
    /// Test-only fault: after this many records appended as leader, publish
    /// the next leader batch as written without writing it, let it ship, and
    /// abort (a machine crash losing a shipped, never-fsynced batch). Needs
    /// --allow-crash-drills.
    #[arg(long, hide = true, requires = "allow_crash_drills")]
    fault_unwritten_batch_after: Option<u64>,
    /// Frame bytes between a shard's producer snapshots
    /// (`wal.producer_snapshot_bytes`, default 16 MiB; 64 KiB ..= 1 GiB).
    #[arg(long)]
    wal_producer_snapshot_bytes: Option<u64>,
}

impl NodeArgs {
    fn into_config(self) -> Result<(NodeConfig, Option<ClusterConfig>, Drills)> {
        let mut cluster = self.cluster.as_deref().map(ClusterConfig::load).transpose()?;
        match &mut cluster {
            Some(cluster) => self.own_certificate.apply(cluster)?,
            None if self.own_certificate.tls_cert.is_some() => {
                bail!("--tls-cert/--tls-key need a cluster config with a [tls] section")
            }
            None => {}
        }
        let mut config = match &self.config {
            Some(path) => NodeConfig::load(path)?,
            None => NodeConfig {
                node_id: self.node_id.context("--node-id (or --config) is required")?,
                grpc_addr: "127.0.0.1:0".parse()?,
                admin_addr: "127.0.0.1:0".parse()?,
                data_dir: self.data_dir.clone().context("--data-dir (or --config) is required")?,
                shards: Vec::new(),
                limits: LogLimits::default(),
                wal: WalTuning::default(),
                task_read_mib_per_s: walship_dataplane::limiter::DEFAULT_TASK_READ_BYTES_PER_S >> 20,
                peer_serve: Default::default(),
            },
        };
        if let Some(id) = self.node_id {
            config.node_id = id;
        }
        if let Some(cluster) = &cluster {
            // The cluster config says where peers find this node; listen there
            // unless told otherwise.
            let spec = cluster
                .node(config.node_id)
                .with_context(|| format!("node {} is not in the cluster config", config.node_id))?;
            config.grpc_addr = spec.grpc_addr.resolve().with_context(|| format!("resolving {}", spec.grpc_addr))?;
            config.admin_addr = spec.admin_addr.resolve().with_context(|| format!("resolving {}", spec.admin_addr))?;
        }
        if let Some(addr) = self.grpc {
            config.grpc_addr = addr;
        }
        if let Some(addr) = self.admin {
            config.admin_addr = addr;
        }
        if let Some(dir) = self.data_dir {
            config.data_dir = dir;
        }
        if let Some(shards) = self.shards {
            config.shards = parse_shards(&shards)?;
        }
        if let Some(max) = self.max_record_bytes {
            config.limits.max_record_bytes = max;
        }
        if let Some(bytes) = self.read_memory_bytes {
            config.limits.read_memory_bytes = bytes;
        }
        if let Some(prefill) = self.wal_prefill {
            config.wal.prefill = prefill;
        }
        if let Some(bytes) = self.wal_spare_bytes {
            config.wal.spare_bytes = bytes;
        }
        if let Some(rate) = self.wal_scrub_bytes_per_s {
            config.wal.scrub_bytes_per_s = rate;
        }
        if let Some(bytes) = self.wal_producer_snapshot_bytes {
            config.wal.producer_snapshot_bytes = bytes;
        }
        if let Some(interval) = self.wal_scrub_interval_s {
            config.wal.scrub_interval_s = interval;
        }
        if let Some(bytes) = self.wal_min_free_bytes {
            config.wal.min_free_bytes = bytes;
        }
        if let Some(mib) = self.peer_serve_mib_per_s {
            config.peer_serve.mib_per_s = mib;
        }
        if let Some(n) = self.peer_serve_concurrency {
            config.peer_serve.concurrency = n;
        }
        if let Some(ms) = self.peer_serve_wait_ms {
            config.peer_serve.wait_ms = ms;
        }
        if let Some(mib) = self.task_read_mib_per_s {
            config.task_read_mib_per_s = mib;
        }
        config.validate(cluster.is_some())?;
        let drills =
            Drills { allow_crash: self.allow_crash_drills, unwritten_batch_after: self.fault_unwritten_batch_after };
        Ok((config, cluster, drills))
    }
}

/// Destructive behaviour a dev or test node may be started with; all off
/// in production.
#[derive(Debug, Clone, Copy, Default)]
pub struct Drills {
    /// Honour the coordinator's crash drills.
    pub allow_crash: bool,
    /// `WalConfig::fault_unwritten_batch_after`.
    pub unwritten_batch_after: Option<u64>,
}

/// A started node.
pub struct RunningNode {
    pub grpc_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    shutdown: CancellationToken,
    servers: Vec<tokio::task::JoinHandle<Result<()>>>,
    wal: Wal,
}

impl RunningNode {
    /// Waits for `stop` (see [`shutdown_signal`]), then stops serving.
    pub async fn run_until(self, stop: impl std::future::Future<Output = ()>) -> Result<()> {
        stop.await;
        tracing::info!("shutting down");
        self.shutdown.cancel();
        for server in self.servers {
            server.await??;
        }
        // The next start then skips the WAL tail check.
        self.wal.shutdown_clean().await.context("recording the WAL's clean shutdown")?;
        Ok(())
    }
}

/// Resolves at the first SIGTERM or SIGINT (Ctrl-C) delivered after this
/// call: register it before announcing "listening", so a supervisor that
/// stops the process right after that line is never missed.
pub fn shutdown_signal() -> Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    Ok(async move {
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
    })
}

/// Opens the WAL, starts replication and serving. Returns once both
/// listeners are bound. Without a cluster config the node is a one-node
/// cluster of its `shards`.
pub async fn start_node(config: NodeConfig, cluster: Option<ClusterConfig>, drills: Drills) -> Result<RunningNode> {
    let grpc_listener =
        TcpListener::bind(config.grpc_addr).await.with_context(|| format!("binding gRPC {}", config.grpc_addr))?;
    let admin_listener =
        TcpListener::bind(config.admin_addr).await.with_context(|| format!("binding admin {}", config.admin_addr))?;
    let grpc_addr = grpc_listener.local_addr()?;
    let admin_addr = admin_listener.local_addr()?;
    let cluster = cluster.unwrap_or_else(|| {
        let spec =
            NodeSpec { id: config.node_id, grpc_addr: grpc_addr.into(), admin_addr: admin_addr.into(), region: 0 };
        ClusterConfig::single_node(spec, &config.shards)
    });
    // A node without a cluster config: its cluster RPCs (drills, say) are
    // for whoever holds WALSHIP_CLUSTER_SECRET; without it, for nobody.
    let mut cluster = cluster;
    if cluster.nodes.len() == 1
        && let Some(secret) = std::env::var(SECRET_ENV).ok().filter(|s| !s.is_empty())
    {
        cluster.secret = Some(ClusterSecret::new(&secret).context(SECRET_ENV)?);
    }

    let gate = cluster_gate(&cluster);
    let transport = PeerTransport::new(&cluster).context("the cluster's TLS files")?;
    let worker_transport = transport.clone();
    let cluster_coordinated = cluster.coordinated();
    let coordinator_addrs: Vec<String> = cluster.coordinators.iter().map(|c| c.grpc_addr.to_string()).collect();
    let cluster_tls = cluster.tls.clone();
    let registry = prometheus::Registry::new();
    let wal_dir = config.data_dir.join("wal");
    std::fs::create_dir_all(&wal_dir).with_context(|| format!("creating {}", wal_dir.display()))?;
    let store_config = EngineStoreConfig {
        target_file_bytes: config.wal.target_file_bytes,
        prefill: config.wal.prefill,
        spare_bytes: config.wal.spare_bytes,
        chunk_bytes: config.wal.chunk_bytes,
        tail_frames_bytes: config.wal.tail_frames_bytes as usize,
        ..EngineStoreConfig::default()
    };
    // Measured before the store opens: opening may lay out spare files of
    // zeros, and a node that starts on a full disk must know it is full
    // before it is asked to lead.
    let disk_space = walship_wal::DiskSpace::new(&wal_dir, config.wal.min_free_bytes)
        .with_context(|| format!("measuring the free space under {}", wal_dir.display()))?;
    disk_space.register(&registry)?;
    disk_space.start_monitor()?;
    let opened = Instant::now();
    let opening = wal_dir.clone();
    let store =
        tokio::task::spawn_blocking(move || EngineStore::open(&wal_dir, &store_config)).await?.with_context(|| {
            format!(
                "opening the WAL under {}: a file there is damaged where recovery cannot cut it away, or unreadable \
                 (ops/runbooks/corruption.md, \"A node that cannot open its WAL\")",
                opening.display()
            )
        })?;
    registry.register(Box::new(walship_wal::metrics::RotationsCollector::new(store.rotations())?))?;
    let store = Arc::new(store);
    registry.register(Box::new(walship_wal::metrics::IndexCollector::new(store.clone())?))?;
    let wal_config = WalConfig {
        linger: Duration::from_micros(config.wal.linger_us),
        max_batch_bytes: config.wal.max_batch_bytes,
        tail_cache_bytes: config.wal.tail_cache_bytes,
        tail_cache_total_bytes: config.wal.tail_cache_total_bytes,
        fault_unwritten_batch_after: drills.unwritten_batch_after,
        scrub_bytes_per_s: config.wal.scrub_bytes_per_s,
        scrub_interval: Duration::from_secs(config.wal.scrub_interval_s),
        disk_space: Some(disk_space),
        producers: cluster.producers.limits(),
        producer_snapshot_bytes: config.wal.producer_snapshot_bytes,
    };
    let mut wal_metrics = WalMetrics::new(&registry)?;
    wal_metrics.per_shard = cluster.replication.per_shard_metrics;
    let wal = {
        let store = store.clone();
        tokio::task::spawn_blocking(move || Wal::start(store, wal_config, wal_metrics)).await??
    };
    registry.register(Box::new(walship_wal::metrics::ProducersCollector::new(
        wal.clone(),
        cluster.replication.per_shard_metrics,
    )?))?;
    let disk_bytes = Box::new(move || store.disk_bytes());
    let node = ReplicationNode::start(
        config.node_id,
        Arc::new(cluster),
        wal.clone(),
        ReplicationMetrics::new(&registry)?,
        disk_bytes,
        drills.allow_crash,
        transport,
    )
    .await
    .map_err(|error| anyhow::anyhow!("starting replication: {error}"))?;
    if let Some(archive) = &node.config.archive {
        let store = crate::archive::open_store(archive).await?;
        tracing::info!(store = %store.describe(), "archiving sealed segments of the shards this node leads (or archives for their leader)");
        node.start_archiving(walship_shipping::replica::archive::Archive {
            store,
            layout: crate::archive::layout(archive)?,
            segment_bytes: archive.segment_bytes,
            segment_age: std::time::Duration::from_millis(archive.segment_age_ms),
            scrub_interval: std::time::Duration::from_millis(archive.scrub_interval_ms),
            uploads: archive.uploads,
            archiver: archive.archiver,
            metrics: walship_shipping::replica::archive::ArchiveMetrics::new(&registry)?,
        });
    }
    // PeerExchange: serve archived segments from this WAL to peers; fetch
    // them from peers (before the object store) when a follower re-seeds.
    let peer_transport = worker_transport.clone();
    let dial: walship_peer::client::Dial = Box::new(move |addr: &str| {
        addr.parse::<walship_shipping::config::Address>().ok().map(|a| peer_transport.token_channel(&a))
    });
    node.set_peer_tier(Arc::new(crate::peer::PeerSegments::new(config.node_id, &node.config, dial, &registry)?));
    let peer_exchange = walship_peer::server::PeerExchangeService::new(
        Arc::new(crate::peer::WalSegments { node: node.clone(), layout: crate::peer::layout(&node.config)? }),
        crate::peer::token_key(&node.config),
        config.peer_serve.settings()?,
        walship_peer::server::ServeMetrics::new(&registry)?,
    );
    for shard in wal.shards() {
        let p = wal.positions(shard)?;
        tracing::info!(shard, first = p.first_seqno, last = p.last_seqno, durable = p.durable_seqno, "recovered");
    }
    tracing::info!(elapsed_ms = opened.elapsed().as_millis() as u64, "WAL open");

    let log = LogService::new(node.clone(), config.limits.clone(), LogServiceMetrics::new(&registry)?);
    // Room for a maximal append plus protobuf framing of every record; the
    // codec refuses an append of more records than allowed before decoding
    // it (a message of empty records decodes to 32 times its size).
    let max_message = config.limits.max_batch_bytes + config.limits.max_batch_records * 16 + (1 << 20);
    walship_proto::codec::limit_append_records(config.limits.max_batch_records);
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<LogServer<LogService>>().await;
    health.set_serving::<WalShippingServer<WalShippingService>>().await;
    health.set_serving::<ControlServer<ControlService>>().await;
    health.set_serving::<PeerExchangeServer<walship_peer::server::PeerExchangeService>>().await;
    // Both reflection versions: older grpcurl and tools only speak v1alpha.
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(walship_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection().build_v1()?;
    let reflection_v1alpha = reflection().build_v1alpha()?;

    let shutdown = node.shutdown.clone();
    let control_node = node.clone();
    let grpc_shutdown = shutdown.clone();
    // The cluster's own services admit only callers holding its secret
    // (`walship_shipping::auth`); Log, health and reflection stay open.
    let shipping = InterceptedService::new(
        WalShippingServer::new(WalShippingService::new(node.clone()))
            .max_decoding_message_size(MAX_PEER_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_PEER_MESSAGE_BYTES),
        gate.clone(),
    );
    let control = InterceptedService::new(ControlServer::new(ControlService::new(control_node)), gate);
    let tls = cluster_tls.clone();
    let router = tonic::transport::Server::builder()
        // Peers may send a whole shipped segment (often 100 KiB and more)
        // as one HTTP/2 DATA frame instead of 16 KiB pieces: fewer frames
        // to encode, decode and flow-control. +4–8 % at 4 KiB × 64
        // (`ops/bench/README.md`). Message size limits are separate.
        .max_frame_size(1 << 20)
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(walship_shipping::read_memory::HoldUntilSent(
            LogServer::new(log).max_decoding_message_size(max_message).max_encoding_message_size(max_message),
        ))
        .add_service(shipping)
        .add_service(control)
        .add_service(PeerExchangeServer::new(peer_exchange));
    let grpc =
        tokio::spawn(async move { crate::tls::serve_grpc(router, grpc_listener, tls.as_ref(), grpc_shutdown).await });
    let mut worker_status: Option<Arc<dyn Fn() -> WorkerStatus + Send + Sync>> = None;
    if cluster_coordinated {
        // The DataPlane worker: one stream to the active coordinator.
        let settings = WorkerSettings {
            worker_id: format!("node-{}", config.node_id),
            build_sha: crate::BUILD.to_string(),
            num_cpus: std::thread::available_parallelism().map_or(1, |n| n.get() as i32),
            memory_bytes: TASK_MEMORY_BYTES,
            coordinators: coordinator_addrs.clone(),
        };
        let dial_transport = worker_transport.clone();
        let dial: Dial<_> = Arc::new(move |addr: &str| {
            let address = addr.parse().ok()?;
            Some(
                DataPlaneClient::new(dial_transport.channel(&address))
                    .max_decoding_message_size(walship_dataplane::MAX_MESSAGE_BYTES)
                    .max_encoding_message_size(walship_dataplane::MAX_MESSAGE_BYTES),
            )
        });
        let read_budget =
            config.task_read_mib_per_s.checked_mul(1 << 20).context("task_read_mib_per_s is too large")?;
        let read_budget = Arc::new(walship_dataplane::limiter::RateLimiter::new(read_budget));
        let replicas = node.clone();
        let committed: walship_dataplane::kinds::Committed =
            Arc::new(move |shard| replicas.replica(shard).map(|r| r.readable()));
        let mut runners = walship_dataplane::kinds::runners(wal.clone(), read_budget, committed);
        runners.push(Arc::new(crate::catchup::CatchupRunner { node: node.clone() }));
        let worker = Worker::new(settings, dial, runners);
        tokio::spawn(worker.clone().run(shutdown.clone()));
        worker_status = Some(Arc::new(move || {
            let mut running_tasks = worker.running();
            running_tasks.sort();
            WorkerStatus { coordinator: worker.connected_to.lock().clone(), running_tasks }
        }));
    }
    tokio::spawn(crate::memory::return_freed_memory(shutdown.clone()));
    let admin = Arc::new(NodeAdmin { node, registry, started: Instant::now(), worker: worker_status });
    let admin_shutdown = shutdown.clone();
    let http = tokio::spawn(async move {
        let app = walship_admin_api::node_router(admin);
        crate::tls::serve_admin(app, admin_listener, cluster_tls.as_ref(), admin_shutdown).await
    });
    tracing::info!(node_id = config.node_id, %grpc_addr, %admin_addr, "serving");
    Ok(RunningNode { grpc_addr, admin_addr, shutdown, servers: vec![grpc, http], wal })
}

/// The memory a node's DataPlane tasks may use, announced to the
/// coordinator (`Hello.gomemlimit`), which bounds how many it sends at once.
pub const TASK_MEMORY_BYTES: i64 = 1 << 30;

/// The interceptor that admits cluster RPCs: with the cluster's secret
/// when it has one, everyone when it runs with `insecure_no_auth`.
pub fn cluster_gate(cluster: &ClusterConfig) -> impl tonic::service::Interceptor + Clone + Send + Sync + 'static {
    let gate = cluster.secret().map(|s| s.gate());
    move |request: tonic::Request<()>| match gate.clone() {
        Some(mut gate) => tonic::service::Interceptor::call(&mut gate, request),
        None => Ok(request),
    }
}

pub async fn run_node(args: NodeArgs) -> Result<()> {
    let (config, cluster, drills) = args.into_config()?;
    let node_id = config.node_id;
    // Test builds only (walship-wal's `testing` feature): storage faults to
    // inject, set before the WAL opens so a failpoint's count covers it too.
    walship_wal::failpoints::configure_from_env().map_err(anyhow::Error::msg)?;
    let stop = shutdown_signal()?;
    let node = start_node(config, cluster, drills).await?;
    // One stable, parseable line for scripts and tests.
    println!("walship node {node_id} listening grpc={} admin={}", node.grpc_addr, node.admin_addr);
    node.run_until(stop).await
}
