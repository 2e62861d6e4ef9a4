//! `walship dev`: the embedded local cluster. A coordinator (`walship
//! coord`, file KV under the data folder) and three `walship node` child
//! processes on loopback (a real gRPC hop between them), several shards at
//! RF=3 with leaders spread over the nodes, no other setup. A node that dies
//! (a crash drill, a kill) is restarted and rejoins as a follower. Runs until
//! Ctrl-C, then stops its children.

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use walship_shipping::config::CoordinatorSpec;
use walship_shipping::{ClusterConfig, NodeSpec};

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
    /// Node i listens on gRPC port base+i and admin port base+80+i; the
    /// coordinator on gRPC base+90 and admin base+80. 0 picks free ports.
    #[arg(long, default_value_t = 7400)]
    base_port: u16,
    /// Admin token of the coordinator (generated when absent).
    #[arg(long, env = "WALSHIP_TOKEN")]
    admin_token: Option<String>,
    /// Serve TLS on every listener, with mutual TLS between members and on
    /// the gRPC ports: a throwaway CA and certificates are generated under
    /// <data-dir>/tls, and the line to point the CLI at them is printed.
    #[arg(long)]
    tls: bool,
}

/// How long a dead node stays down before `walship dev` restarts it.
const RESTART_DELAY: Duration = Duration::from_secs(1);

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
            grpc_addr: address(args.base_port, offset)?.into(),
            admin_addr: address(args.base_port, 80 + offset)?.into(),
            region: id,
        });
    }
    let mut config = ClusterConfig::replicated_everywhere(nodes, args.shards);
    config.cluster_id = "walship-dev".into();
    config.coordinators = vec![CoordinatorSpec {
        id: "dev".into(),
        grpc_addr: address(args.base_port, 90)?.into(),
        admin_addr: address(args.base_port, 80)?.into(),
    }];
    config.validate()?;
    Ok(config)
}

/// Waits for a child's "listening" line on stdout.
fn wait_listening(child: &mut Child, what: &str) -> Result<()> {
    let stdout = child.stdout.take().context("child stdout")?;
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line)?;
    if !line.contains("listening") {
        bail!("{what} did not start (see its errors above)");
    }
    Ok(())
}

pub async fn run_dev(args: DevArgs) -> Result<()> {
    let mut cluster = dev_cluster(&args)?;
    std::fs::create_dir_all(&args.data_dir).with_context(|| format!("creating {}", args.data_dir.display()))?;
    let certificates = match args.tls {
        true => Some(crate::tls::LocalCertificates::generate(&args.data_dir.join("tls"))?),
        false => None,
    };
    cluster.tls = certificates.as_ref().map(|c| c.cluster_tls());
    let scheme = if args.tls { "https" } else { "http" };
    let cluster_file = args.data_dir.join("cluster.toml");
    cluster.save(&cluster_file).with_context(|| format!("writing {}", cluster_file.display()))?;
    let exe = std::env::current_exe()?;
    let token = args.admin_token.clone().unwrap_or_else(|| format!("{:032x}", rand::random::<u128>()));
    let log = std::env::var("WALSHIP_LOG").unwrap_or_else(|_| "warn".into());
    let coordinator = Command::new(&exe)
        .args(["coord", "--id", "dev", "--admin-token", &token, "--cluster"])
        .arg(&cluster_file)
        .arg("--data-dir")
        .arg(args.data_dir.join("coord"))
        .env("WALSHIP_LOG", &log)
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the coordinator")?;
    let mut children = Children(vec![(0, coordinator)]);
    wait_listening(&mut children.0[0].1, "the coordinator")?;
    let spawn_node = |id: u32| -> Result<Child> {
        let mut child = Command::new(&exe)
            // A dev cluster starts in a blink rather than writing a WAL file of
            // zeros and its spares per node first (`wal.prefill`).
            .args(["node", "--allow-crash-drills", "--wal-prefill", "false", "--node-id", &id.to_string(), "--cluster"])
            .arg(&cluster_file)
            .arg("--data-dir")
            .arg(args.data_dir.join(format!("node-{id}")))
            .env("WALSHIP_LOG", &log)
            .stdout(Stdio::piped())
            .spawn()
            .context("starting a node")?;
        wait_listening(&mut child, &format!("node {id}"))?;
        Ok(child)
    };
    for node in &cluster.nodes {
        let child = spawn_node(node.id)?;
        children.0.push((node.id, child));
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
            "  node {}  gRPC {}  admin {scheme}://{}/v1/status  leads shards [{}]",
            node.id,
            node.grpc_addr,
            node.admin_addr,
            leads.join(", ")
        );
    }
    let coord = &cluster.coordinators[0];
    println!("  coordinator  admin {scheme}://{}/v1/shards  (token {token})", coord.admin_addr);
    if let Some(certificates) = &certificates {
        println!("TLS on every port, mutual on gRPC; point the CLI at the throwaway CA:");
        println!("  {}", certificates.export_line());
    }
    let first = &cluster.nodes[0].grpc_addr;
    // Shard 2 is led by node 2, so the example shows the leader hint at
    // work; a one-shard cluster has only shard 1.
    let example = args.shards.min(2);
    println!("try (any node works: clients follow the leader hint):");
    println!("  echo hello | walship append --server {first} --shard {example}");
    println!("  walship read --server {first} --shard {example} --from 1");
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
                        if *id == 0 {
                            bail!("the coordinator exited ({status}); stopping the dev cluster");
                        }
                        // Restart only after the coordinator has noticed the
                        // loss (leader_timeout_ms), so a crash drill sees a
                        // real failover rather than the same leader back.
                        println!("node {id} exited ({status}); restarting it in {RESTART_DELAY:?}");
                        tokio::time::sleep(RESTART_DELAY).await;
                        *child = spawn_node(*id)?;
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
        let args =
            DevArgs { data_dir: "x".into(), shards: 4, nodes: 3, base_port: 7400, admin_token: None, tls: false };
        let c = dev_cluster(&args).unwrap();
        assert_eq!(c.shards.iter().map(|s| s.leader).collect::<Vec<_>>(), vec![1, 2, 3, 1]);
        assert!(c.shards.iter().all(|s| s.replicas == vec![1, 2, 3]));
        assert_eq!(c.nodes[1].grpc_addr.port(), 7402);
        assert_eq!(c.nodes[1].admin_addr.port(), 7482);
        assert_eq!(c.coordinators[0].admin_addr.port(), 7480);
        assert!(c.coordinated());
    }
}
