//! Process wiring of `walship coord`: the leadership KV (file or NATS), the
//! coordinator runtime, its gRPC port (heartbeats) and its admin API.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Args;
use tokio::net::TcpListener;
use walship_admin_api::coord::{CoordAdmin, coord_router};
use walship_proto::replication::wal_shipping_server::WalShippingServer;
use walship_shipping::ClusterConfig;
use walship_shipping::control::service::CoordinatorHeartbeats;
use walship_shipping::control::{Coordinator, CoordinatorMetrics, FileKv, Kv, NatsKv};
use walship_shipping::peers::PeerTransport;

#[derive(Args, Debug)]
pub struct CoordArgs {
    /// Cluster config (see ops/cluster.example.toml); this coordinator's
    /// addresses come from its [[coordinators]] entry, the secret its calls
    /// to nodes carry from `secret`/`secret_file` or WALSHIP_CLUSTER_SECRET.
    #[arg(long, env = "WALSHIP_CLUSTER_CONFIG")]
    cluster: PathBuf,
    #[command(flatten)]
    own_certificate: crate::tls::OwnCertificate,
    /// This coordinator's id (its [[coordinators]] entry).
    #[arg(long, env = "WALSHIP_COORD_ID")]
    id: String,
    /// Data dir (the embedded file KV lives in <data-dir>/kv).
    #[arg(long)]
    data_dir: PathBuf,
    /// NATS server URL: keep leadership in a JetStream KV bucket instead of
    /// the embedded file KV.
    #[arg(long, env = "WALSHIP_NATS")]
    nats: Option<String>,
    /// JetStream KV bucket name.
    #[arg(long, default_value = "walship")]
    nats_bucket: String,
    /// gRPC listen address (default: this coordinator's address in the cluster config, resolved).
    #[arg(long)]
    grpc: Option<SocketAddr>,
    /// Admin HTTP listen address (default: from the cluster config, resolved).
    #[arg(long)]
    admin: Option<SocketAddr>,
    /// Bearer token for mutating admin endpoints; generated and printed when absent.
    #[arg(long, env = "WALSHIP_TOKEN")]
    admin_token: Option<String>,
}

pub async fn run_coord(args: CoordArgs) -> Result<()> {
    let mut config = ClusterConfig::load(&args.cluster)?;
    args.own_certificate.apply(&mut config)?;
    let spec = config
        .coordinators
        .iter()
        .find(|c| c.id == args.id)
        .with_context(|| format!("coordinator {} is not in the cluster config", args.id))?
        .clone();
    let (kv, nats): (Arc<dyn Kv>, Option<async_nats::Client>) = match &args.nats {
        Some(url) => {
            let kv = NatsKv::connect(url, &args.nats_bucket).await?;
            let client = kv.client();
            (Arc::new(kv), Some(client))
        }
        None => (Arc::new(FileKv::open(&args.data_dir.join("kv"))?), None),
    };
    let (token, generated) = match args.admin_token {
        Some(t) if t.len() >= 8 => (t, false),
        Some(_) => bail!("--admin-token must be at least 8 characters"),
        None => (format!("{:032x}", rand::random::<u128>()), true),
    };
    let registry = prometheus::Registry::new();
    let gate = crate::node::cluster_gate(&config);
    let transport = PeerTransport::new(&config).context("the cluster's TLS files")?;
    let cluster_tls = config.tls.clone();
    let metrics = CoordinatorMetrics::new(&registry)?;
    let coordinator = Coordinator::start(args.id.clone(), Arc::new(config), kv.clone(), metrics, transport);
    if let Some(client) = nats {
        coordinator.publish_heartbeats(client);
    }
    let grpc_bind = match args.grpc {
        Some(a) => a,
        None => spec.grpc_addr.resolve().with_context(|| format!("resolving {}", spec.grpc_addr))?,
    };
    let admin_bind = match args.admin {
        Some(a) => a,
        None => spec.admin_addr.resolve().with_context(|| format!("resolving {}", spec.admin_addr))?,
    };
    let grpc_listener = TcpListener::bind(grpc_bind).await.with_context(|| format!("binding {grpc_bind}"))?;
    let admin_listener = TcpListener::bind(admin_bind).await.with_context(|| format!("binding {admin_bind}"))?;
    let (grpc_addr, admin_addr): (SocketAddr, SocketAddr) = (grpc_listener.local_addr()?, admin_listener.local_addr()?);
    let shutdown = coordinator.shutdown.clone();
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<WalShippingServer<CoordinatorHeartbeats>>().await;
    // Heartbeats move failure detection: members of the cluster only.
    let heartbeats = tonic::service::interceptor::InterceptedService::new(
        WalShippingServer::new(CoordinatorHeartbeats::new(coordinator.clone())),
        gate,
    );
    let grpc_shutdown = shutdown.clone();
    let router = tonic::transport::Server::builder().add_service(health_service).add_service(heartbeats);
    let tls = cluster_tls.clone();
    let grpc =
        tokio::spawn(async move { crate::tls::serve_grpc(router, grpc_listener, tls.as_ref(), grpc_shutdown).await });
    let admin = Arc::new(CoordAdmin {
        coordinator,
        registry,
        token: token.clone(),
        started: Instant::now(),
        lag_history: Default::default(),
    });
    let admin_shutdown = shutdown.clone();
    let http = tokio::spawn(async move {
        crate::tls::serve_admin(coord_router(admin), admin_listener, cluster_tls.as_ref(), admin_shutdown).await
    });
    let shown = if generated { token.as_str() } else { "(given)" };
    println!(
        "walship coord {} listening grpc={grpc_addr} admin={admin_addr} kv={} token={shown}",
        args.id,
        kv.describe()
    );
    crate::node::shutdown_signal().await;
    shutdown.cancel();
    grpc.await??;
    http.await??;
    Ok(())
}
