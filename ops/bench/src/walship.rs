//! walship: three `walship node` processes, one shard at RF=3, static
//! leadership (node 1 leads), appends at `QUORUM` or `ALL`.
//!
//! The nodes run from the release binary the script builds (`--walship`),
//! each with its own data directory on the benchmark disk, with the
//! replication settings a default deployment gets (`[replication]` left
//! at its defaults). No coordinator runs: failover is not being measured.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use async_trait::async_trait;
use bytes::Bytes;
use tonic::transport::{Channel, Endpoint};
use walship_proto::log::log_client::LogClient;
use walship_proto::log::{AppendRecord, AppendRequest, Durability};
use walship_shipping::{ClusterConfig, NodeSpec};

use crate::proc::{Server, free_port, wait_for_port};
use crate::system::{Appender, Cluster};

/// Most HTTP/2 connections the clients share (the same cap as the
/// JetStream clients' connections).
pub const MAX_CONNECTIONS: usize = 8;

pub struct WalshipCluster {
    durability: Durability,
    leader: SocketAddr,
    servers: Vec<Server>,
}

/// Starts the three nodes under `dir` (fresh) and returns once the leader
/// acknowledges an append at `durability`.
pub async fn start(dir: &Path, walship: &Path, durability: Durability) -> Result<Box<dyn Cluster>> {
    if !walship.is_file() {
        bail!("walship binary not found at {} (build it: cargo build --release)", walship.display());
    }
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut nodes = Vec::new();
    for id in 1..=3 {
        let grpc = SocketAddr::from(([127, 0, 0, 1], free_port()?));
        let admin = SocketAddr::from(([127, 0, 0, 1], free_port()?));
        nodes.push(NodeSpec { id, grpc_addr: grpc.into(), admin_addr: admin.into(), region: id });
    }
    let mut config = ClusterConfig::replicated_everywhere(nodes, 1);
    config.cluster_id = "compare".into();
    config.validate()?;
    let file = dir.join("cluster.toml");
    std::fs::write(&file, toml::to_string_pretty(&config)?)?;
    let mut servers = Vec::new();
    let mut addrs = Vec::new();
    for node in &config.nodes {
        let mut command = Command::new(walship);
        command
            .arg("node")
            .args(["--node-id", &node.id.to_string(), "--cluster"])
            .arg(&file)
            .arg("--data-dir")
            .arg(dir.join(format!("node-{}", node.id)))
            .env("WALSHIP_LOG", "warn");
        let log = dir.join(format!("node-{}.log", node.id));
        servers.push(Server::spawn(&format!("walship node {}", node.id), command, &log, libc::SIGTERM)?);
        addrs.push(node.grpc_addr.to_string().parse::<SocketAddr>()?);
    }
    for (server, addr) in servers.iter_mut().zip(&addrs) {
        wait_for_port(*addr, Duration::from_secs(30), server)?;
    }
    let leader = addrs[config.shards[0].leader as usize - 1];
    let cluster = WalshipCluster { durability, leader, servers };
    cluster.wait_ready().await?;
    Ok(Box::new(cluster))
}

impl WalshipCluster {
    /// Retries one append until the followers are connected and it is
    /// acknowledged at the benchmark's durability.
    async fn wait_ready(&self) -> Result<()> {
        let client = self.connect().await?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match (WalshipAppender { client: client.clone(), durability: self.durability })
                .append(Bytes::from_static(b"ready"))
                .await
            {
                Ok(()) => return Ok(()),
                Err(e) if Instant::now() > deadline => return Err(e.context("walship never became ready")),
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    async fn connect(&self) -> Result<LogClient<Channel>> {
        let channel = Endpoint::from_shared(format!("http://{}", self.leader))?.tcp_nodelay(true).connect().await?;
        Ok(LogClient::new(channel))
    }
}

#[async_trait]
impl Cluster for WalshipCluster {
    fn name(&self) -> String {
        match self.durability {
            Durability::All => "walship-all".into(),
            _ => "walship-quorum".into(),
        }
    }

    async fn appenders(&self, clients: usize) -> Result<Vec<Arc<dyn Appender>>> {
        let mut connections = Vec::new();
        for _ in 0..clients.clamp(1, MAX_CONNECTIONS) {
            connections.push(self.connect().await?);
        }
        Ok((0..clients)
            .map(|i| {
                let client = connections[i % connections.len()].clone();
                Arc::new(WalshipAppender { client, durability: self.durability }) as Arc<dyn Appender>
            })
            .collect())
    }

    async fn stop(mut self: Box<Self>) -> Result<()> {
        for server in &mut self.servers {
            server.stop()?;
        }
        Ok(())
    }
}

struct WalshipAppender {
    client: LogClient<Channel>,
    durability: Durability,
}

#[async_trait]
impl Appender for WalshipAppender {
    async fn append(&self, payload: Bytes) -> Result<()> {
        let request = AppendRequest {
            shard_id: 1,
            records: vec![AppendRecord { key: Bytes::new(), payload }],
            durability: self.durability as i32,
        };
        self.client.clone().append(request).await.map_err(|s| anyhow::anyhow!("walship append: {s}"))?;
        Ok(())
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
