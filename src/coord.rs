//! Process wiring of `walship coord`: the leadership KV (file or NATS), the
//! coordinator runtime, its gRPC port (heartbeats) and its admin API.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use tokio::net::TcpListener;
use walship_admin_api::coord::{CoordAdmin, coord_router};
use walship_dataplane::bus::{LocalBus, NatsBus, TaskBus};
use walship_dataplane::coordinator::{BuildPolicy, DataPlaneService, DataPlaneSettings, Dispatcher};
use walship_proto::dataplane::data_plane_server::DataPlaneServer;
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
    /// What to do with a node whose build differs from this coordinator's
    /// when it connects to the DataPlane: `warn` (take it, show it) or
    /// `refuse`.
    #[arg(long, env = "WALSHIP_BUILD_POLICY", value_enum, default_value = "warn")]
    build_policy: BuildPolicyArg,
    /// Seconds a running task may go without its counters growing before
    /// it is cancelled and dispatched again.
    #[arg(long, default_value_t = 30)]
    task_stall_s: u64,
    /// Dispatches of one task before it fails for good (a dead letter).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    task_attempts: u32,
    /// Seconds between scheduled verifies of every shard (a scrub: each
    /// shard in turn, all it has committed, compared across its replicas;
    /// a divergence is logged at ERROR and shown in GET /v1/cluster).
    /// 0: only on demand.
    #[arg(long, env = "WALSHIP_VERIFY_EVERY_S", default_value_t = 86_400)]
    verify_every_s: u64,
}

pub async fn run_coord(args: CoordArgs) -> Result<()> {
    // Test builds only: failpoints (`FAILPOINTS`), e.g. one holding a
    // replica change's joint step open.
    walship_wal::failpoints::configure_from_env().map_err(anyhow::Error::msg)?;
    let mut config = ClusterConfig::load(&args.cluster)?;
    args.own_certificate.apply(&mut config)?;
    let unspread = config.unspread_shards();
    if let Some((shard, spans, could)) = unspread.first() {
        tracing::warn!(
            shards = unspread.len(),
            first = shard,
            "{} shard(s) have replicas in fewer regions than the cluster has (shard {shard}: {spans} of {could}): \
             losing one region can take such a shard's majority. Spread each shard's replicas over the regions \
             (`walship replica replace` keeps the spread)",
            unspread.len()
        );
    }
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
    // Task cancels and dead letters: shared over NATS when the KV is, else
    // in this process with the dead letters in the data dir.
    let bus: Arc<dyn TaskBus> = match &nats {
        Some(client) => Arc::new(NatsBus::open(client.clone(), &config.cluster_id).await?),
        None => Arc::new(LocalBus::open(&args.data_dir.join("tasks"))?),
    };
    let (token, generated) = match args.admin_token {
        Some(t) if t.len() >= 8 => (t, false),
        Some(_) => bail!("--admin-token must be at least 8 characters"),
        None => (format!("{:032x}", rand::random::<u128>()), true),
    };
    let registry = prometheus::Registry::new();
    let gate = crate::node::cluster_gate(&config);
    let data_plane_gate = crate::node::cluster_gate(&config);
    let cluster_id = config.cluster_id.clone();
    let transport = PeerTransport::new(&config).context("the cluster's TLS files")?;
    let cluster_tls = config.tls.clone();
    let metrics = CoordinatorMetrics::new(&registry)?;
    let token_key = crate::peer::token_key(&config);
    let coordinator = Coordinator::start(args.id.clone(), Arc::new(config), kv.clone(), metrics, transport);
    coordinator.set_token_minter(Box::new(move |task, shard, ttl| {
        let expires = std::time::SystemTime::now() + ttl;
        let expires_unix_ms = expires.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let grant = walship_peer::token::Grant { task: task.to_string(), shard, expires_unix_ms };
        token_key.mint(&grant).as_str().to_string()
    }));
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
    let active_check = {
        let coordinator = coordinator.clone();
        Arc::new(move || if coordinator.is_active() { Ok(()) } else { Err(None) })
    };
    let dataplane = Dispatcher::start(
        DataPlaneSettings {
            cluster_id: cluster_id.clone(),
            coordinator_id: args.id.clone(),
            build_sha: crate::BUILD.to_string(),
            build_policy: match args.build_policy {
                BuildPolicyArg::Warn => BuildPolicy::Warn,
                BuildPolicyArg::Refuse => BuildPolicy::Refuse,
            },
            stall: Duration::from_secs(args.task_stall_s.max(1)),
            max_attempts: args.task_attempts,
        },
        active_check,
        bus.clone(),
        shutdown.clone(),
    );
    let data_plane = tonic::service::interceptor::InterceptedService::new(
        DataPlaneServer::new(DataPlaneService(dataplane.clone()))
            .max_decoding_message_size(walship_dataplane::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(walship_dataplane::MAX_MESSAGE_BYTES),
        data_plane_gate,
    );
    let router = tonic::transport::Server::builder()
        // A worker that vanished without closing its stream is noticed
        // within ten seconds, so its tasks are dispatched again.
        .http2_keepalive_interval(Some(Duration::from_secs(5)))
        .http2_keepalive_timeout(Some(Duration::from_secs(5)))
        .add_service(health_service)
        .add_service(heartbeats)
        .add_service(data_plane);
    let tls = cluster_tls.clone();
    let grpc =
        tokio::spawn(async move { crate::tls::serve_grpc(router, grpc_listener, tls.as_ref(), grpc_shutdown).await });
    let admin = Arc::new(CoordAdmin {
        coordinator,
        registry,
        token: token.clone(),
        started: Instant::now(),
        lag_history: Default::default(),
        verify_schedule: Default::default(),
        dataplane,
        exports_dir: args.data_dir.join("exports"),
        catchups: Default::default(),
    });
    walship_admin_api::jobs::schedule_verify(admin.clone(), Duration::from_secs(args.verify_every_s));
    let admin_shutdown = shutdown.clone();
    let http = tokio::spawn(async move {
        crate::tls::serve_admin(coord_router(admin), admin_listener, cluster_tls.as_ref(), admin_shutdown).await
    });
    let shown = if generated { token.as_str() } else { "(given)" };
    let stop = crate::node::shutdown_signal()?;
    println!(
        "walship coord {} listening grpc={grpc_addr} admin={admin_addr} kv={} token={shown}",
        args.id,
        kv.describe()
    );
    tracing::info!(bus = %bus.describe(), "task bus");
    stop.await;
    shutdown.cancel();
    grpc.await??;
    http.await??;
    Ok(())
}

/// `--build-policy`.
#[derive(clap::ValueEnum, Debug, Clone, Copy)]
enum BuildPolicyArg {
    Warn,
    Refuse,
}
