//! `walship dev`: the embedded local cluster. Three `walship node` child
//! processes on loopback (a real gRPC hop between them), several shards at
//! RF=3 with leaders spread over the nodes, data under a local folder, no
//! other setup. Runs until Ctrl-C, then stops its children.

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use walship_shipping::{ClusterConfig, NodeSpec, ReplicationConfig, ShardSpec};

#[derive(Args, Debug)]
pub struct DevArgs {
    /// Where the dev cluster keeps its data (node-N/ per node, cluster.toml).
    #[arg(long, default_value = ".walship/dev")]
    data_dir: PathBuf,
    /// Number of shards (ids 1..=N), each replicated on every node.
    #[arg(long, default_value_t = 4)]
    shards: u32,
    /// Number of nodes (the replication factor of every shard).
    #[arg(long, default_value_t = 3)]
    nodes: u32,
    /// Node i listens on gRPC port base+i and admin port base+80+i; 0 picks free ports.
    #[arg(long, default_value_t = 7400)]
    base_port: u16,
}

/// Child processes, stopped (SIGTERM, then SIGKILL) when dropped.
struct Children(Vec<(u32, Child)>);

impl Drop for Children {
    fn drop(&mut self) {
        for (_, child) in &mut self.0 {
            // SAFETY: plain kill(2) on a pid this process spawned and has not reaped.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        }
        for (_, child) in &mut self.0 {
            for _ in 0..50 {
                if matches!(child.try_wait(), Ok(Some(_))) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn address(base: u16, offset: u16) -> Result<SocketAddr> {
    let port = if base == 0 { free_port()? } else { base.checked_add(offset).context("port out of range")? };
    Ok(SocketAddr::from(([127, 0, 0, 1], port)))
}

/// The dev cluster's configuration: shard i led by node ((i-1) mod n)+1.
fn dev_cluster(args: &DevArgs) -> Result<ClusterConfig> {
    if args.nodes == 0 || args.shards == 0 {
        bail!("--nodes and --shards must be at least 1");
    }
    let mut nodes = Vec::new();
    for id in 1..=args.nodes {
        let offset = id as u16;
        nodes.push(NodeSpec {
            id,
            grpc_addr: address(args.base_port, offset)?,
            admin_addr: address(args.base_port, 80 + offset)?,
            region: id,
        });
    }
    let replicas: Vec<u32> = (1..=args.nodes).collect();
    let shards = (1..=args.shards)
        .map(|id| ShardSpec { id, replicas: replicas.clone(), leader: (id - 1) % args.nodes + 1, epoch: 1 })
        .collect();
    let replication = ReplicationConfig { heartbeat_to: Some(nodes[0].grpc_addr), ..ReplicationConfig::default() };
    let config =
        ClusterConfig { cluster_id: "walship-dev".into(), coordinators: Vec::new(), nodes, shards, replication };
    config.validate()?;
    Ok(config)
}

pub async fn run_dev(args: DevArgs) -> Result<()> {
    let cluster = dev_cluster(&args)?;
    std::fs::create_dir_all(&args.data_dir).with_context(|| format!("creating {}", args.data_dir.display()))?;
    let cluster_file = args.data_dir.join("cluster.toml");
    std::fs::write(&cluster_file, toml::to_string_pretty(&cluster)?)?;
    let exe = std::env::current_exe()?;
    let mut children = Children(Vec::new());
    for node in &cluster.nodes {
        let mut child = Command::new(&exe)
            .args(["node", "--node-id", &node.id.to_string(), "--cluster"])
            .arg(&cluster_file)
            .arg("--data-dir")
            .arg(args.data_dir.join(format!("node-{}", node.id)))
            .env("WALSHIP_LOG", std::env::var("WALSHIP_LOG").unwrap_or_else(|_| "warn".into()))
            .stdout(Stdio::piped())
            .spawn()
            .context("starting a node")?;
        let stdout = child.stdout.take().context("node stdout")?;
        children.0.push((node.id, child));
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        if !line.contains("listening") {
            bail!("node {} did not start (see its errors above)", node.id);
        }
    }
    println!(
        "walship dev: {} nodes, shards 1..={} at RF={}, data in {}",
        cluster.nodes.len(),
        args.shards,
        cluster.nodes.len(),
        args.data_dir.display()
    );
    for node in &cluster.nodes {
        let leads: Vec<String> =
            cluster.shards.iter().filter(|s| s.leader == node.id).map(|s| s.id.to_string()).collect();
        println!(
            "  node {}  gRPC {}  admin http://{}/v1/status  leads shards [{}]",
            node.id,
            node.grpc_addr,
            node.admin_addr,
            leads.join(", ")
        );
    }
    let first = cluster.nodes[0].grpc_addr;
    println!("try (any node works: clients follow the leader hint):");
    println!("  echo hello | walship append --server {first} --shard 2");
    println!("  walship read --server {first} --shard 2 --from 1");
    println!("cluster config: {}; Ctrl-C stops the cluster.", cluster_file.display());

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut check = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
            _ = check.tick() => {
                for (id, child) in &mut children.0 {
                    if let Ok(Some(status)) = child.try_wait() {
                        bail!("node {id} exited ({status}); stopping the dev cluster");
                    }
                }
            }
        }
    }
    println!("stopping the dev cluster");
    drop(children);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dev_cluster_spreads_leaders_at_full_replication() {
        let args = DevArgs { data_dir: "x".into(), shards: 4, nodes: 3, base_port: 7400 };
        let c = dev_cluster(&args).unwrap();
        assert_eq!(c.shards.iter().map(|s| s.leader).collect::<Vec<_>>(), vec![1, 2, 3, 1]);
        assert!(c.shards.iter().all(|s| s.replicas == vec![1, 2, 3]));
        assert_eq!(c.nodes[1].grpc_addr.port(), 7402);
        assert_eq!(c.nodes[1].admin_addr.port(), 7482);
    }
}
