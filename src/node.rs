//! Process wiring of a node: open the WAL, serve the Log service (with gRPC
//! health and reflection) and the admin HTTP API, stop on Ctrl-C/SIGTERM.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use walship_admin_api::NodeAdmin;
use walship_proto::log::log_server::LogServer;
use walship_shipping::{LogLimits, LogService, LogServiceMetrics};
use walship_wal::{EngineStore, EngineStoreConfig, Wal, WalConfig, WalMetrics};

use crate::config::{NodeConfig, WalTuning, parse_shards};

/// The epoch every node writes in until leadership becomes dynamic.
const STATIC_EPOCH: u64 = 1;

#[derive(Args, Debug)]
pub struct NodeArgs {
    /// TOML config file (see ops/node.example.toml); flags override its values.
    #[arg(long, env = "WALSHIP_NODE_CONFIG")]
    config: Option<PathBuf>,
    /// This node's id.
    #[arg(long)]
    node_id: Option<u32>,
    /// gRPC listen address; port 0 picks a free port.
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
}

impl NodeArgs {
    fn into_config(self) -> Result<NodeConfig> {
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
            },
        };
        if let Some(id) = self.node_id {
            config.node_id = id;
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
        config.validate()?;
        Ok(config)
    }
}

#[derive(Args, Debug)]
pub struct DevArgs {
    /// Where the dev cluster keeps its data.
    #[arg(long, default_value = ".walship/dev")]
    data_dir: PathBuf,
    /// Number of shards (ids 1..=N).
    #[arg(long, default_value_t = 4)]
    shards: u32,
    /// gRPC listen address of the node.
    #[arg(long, default_value = "127.0.0.1:7400")]
    grpc: SocketAddr,
    /// Admin HTTP listen address of the node.
    #[arg(long, default_value = "127.0.0.1:7480")]
    admin: SocketAddr,
}

/// A started node.
pub struct RunningNode {
    pub grpc_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    shutdown: CancellationToken,
    servers: Vec<tokio::task::JoinHandle<Result<()>>>,
}

impl RunningNode {
    /// Waits for Ctrl-C or SIGTERM, then stops serving.
    pub async fn run_until_signal(self) -> Result<()> {
        shutdown_signal().await;
        tracing::info!("shutting down");
        self.shutdown.cancel();
        for server in self.servers {
            server.await??;
        }
        Ok(())
    }
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// Opens the WAL and starts serving. Returns once both listeners are bound.
pub async fn start_node(config: NodeConfig) -> Result<RunningNode> {
    let registry = prometheus::Registry::new();
    let wal_dir = config.data_dir.join("wal");
    std::fs::create_dir_all(&wal_dir).with_context(|| format!("creating {}", wal_dir.display()))?;
    let store_config =
        EngineStoreConfig { target_file_bytes: config.wal.target_file_bytes, ..EngineStoreConfig::default() };
    let opened = Instant::now();
    let store = tokio::task::spawn_blocking(move || EngineStore::open(&wal_dir, &store_config))
        .await?
        .context("opening the WAL")?;
    let wal_config = WalConfig {
        linger: Duration::from_micros(config.wal.linger_us),
        max_batch_bytes: config.wal.max_batch_bytes,
        ..WalConfig::default()
    };
    let wal = Wal::start(Arc::new(store), wal_config, WalMetrics::new(&registry)?)?;
    for &shard in &config.shards {
        wal.create_shard(shard)?;
    }
    for shard in wal.shards() {
        let p = wal.positions(shard)?;
        tracing::info!(shard, first = p.first_seqno, last = p.last_seqno, durable = p.durable_seqno, "recovered");
    }
    tracing::info!(elapsed_ms = opened.elapsed().as_millis() as u64, "WAL open");

    let log = LogService::new(wal.clone(), config.limits.clone(), LogServiceMetrics::new(&registry)?, STATIC_EPOCH);
    // Room for a maximal append plus protobuf framing of every record.
    let max_message = config.limits.max_batch_bytes + config.limits.max_batch_records * 16 + (1 << 20);
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<LogServer<LogService>>().await;
    // Both reflection versions: older grpcurl and tools only speak v1alpha.
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(walship_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection().build_v1()?;
    let reflection_v1alpha = reflection().build_v1alpha()?;

    let grpc_listener =
        TcpListener::bind(config.grpc_addr).await.with_context(|| format!("binding gRPC {}", config.grpc_addr))?;
    let admin_listener =
        TcpListener::bind(config.admin_addr).await.with_context(|| format!("binding admin {}", config.admin_addr))?;
    let grpc_addr = grpc_listener.local_addr()?;
    let admin_addr = admin_listener.local_addr()?;
    let shutdown = CancellationToken::new();

    let grpc_shutdown = shutdown.clone();
    let grpc = tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(health_service)
            .add_service(reflection_v1)
            .add_service(reflection_v1alpha)
            .add_service(
                LogServer::new(log).max_decoding_message_size(max_message).max_encoding_message_size(max_message),
            )
            .serve_with_incoming_shutdown(
                // Small request/response RPCs: Nagle plus delayed ACKs would add ~40 ms.
                tonic::transport::server::TcpIncoming::from(grpc_listener).with_nodelay(Some(true)),
                grpc_shutdown.cancelled_owned(),
            )
            .await
            .context("gRPC server")
    });
    let admin =
        Arc::new(NodeAdmin { node_id: config.node_id, wal, epoch: STATIC_EPOCH, registry, started: Instant::now() });
    let admin_shutdown = shutdown.clone();
    let http = tokio::spawn(async move {
        axum::serve(admin_listener, walship_admin_api::node_router(admin))
            .with_graceful_shutdown(admin_shutdown.cancelled_owned())
            .await
            .context("admin server")
    });
    tracing::info!(node_id = config.node_id, %grpc_addr, %admin_addr, "serving");
    Ok(RunningNode { grpc_addr, admin_addr, shutdown, servers: vec![grpc, http] })
}

pub async fn run_node(args: NodeArgs) -> Result<()> {
    let config = args.into_config()?;
    let node_id = config.node_id;
    let node = start_node(config).await?;
    // One stable, parseable line for scripts and tests.
    println!("walship node {node_id} listening grpc={} admin={}", node.grpc_addr, node.admin_addr);
    node.run_until_signal().await
}

pub async fn run_dev(args: DevArgs) -> Result<()> {
    let config = NodeConfig {
        node_id: 1,
        grpc_addr: args.grpc,
        admin_addr: args.admin,
        data_dir: args.data_dir.join("node-1"),
        shards: (1..=args.shards.max(1)).collect(),
        limits: LogLimits::default(),
        wal: WalTuning::default(),
    };
    let data_dir = config.data_dir.clone();
    let node = start_node(config).await?;
    let (grpc, admin) = (node.grpc_addr, node.admin_addr);
    println!("walship dev: 1 node, shards 1..={}, data in {}", args.shards.max(1), data_dir.display());
    println!("  node 1  gRPC   http://{grpc}");
    println!("  node 1  admin  http://{admin}/v1/status   http://{admin}/metrics");
    println!("try:");
    println!("  echo hello | walship append --server {grpc} --shard 1");
    println!("  walship read --server {grpc} --shard 1 --from 1");
    println!("Ctrl-C stops the cluster.");
    node.run_until_signal().await
}
