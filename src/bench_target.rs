//! The processes a `walship bench` cell measures: one node, or three
//! nodes (with a coordinator by default), started on fresh loopback ports
//! and killed when the cell's [`Target`] is dropped.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context, Result};
use tonic::transport::{Certificate, ClientTlsConfig, Identity};

use crate::bench::Leadership;

/// `walship node` child processes, killed when dropped.
pub(crate) struct Target {
    /// gRPC address of shard i's leader at index i-1.
    pub(crate) leaders: Vec<String>,
    /// gRPC address of every node: a leader may move to any of them.
    pub(crate) nodes: Vec<String>,
    children: Vec<std::process::Child>,
    /// How appenders connect when the cluster serves TLS.
    pub(crate) client_tls: Option<ClientTlsConfig>,
    /// The coordinator's admin URL (`http://host:port`), when one runs;
    /// its bearer token is [`BENCH_ADMIN_TOKEN`].
    pub(crate) coord_admin: Option<String>,
}

/// The admin token of the coordinator the three-node paths start.
pub(crate) const BENCH_ADMIN_TOKEN: &str = "walship-bench";

impl Target {
    /// The process ids of the nodes (and coordinator) it started.
    pub(crate) fn pids(&self) -> Vec<u32> {
        self.children.iter().map(|c| c.id()).collect()
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Spawns `walship <command> <args> --data-dir <data>` and returns it with
/// the gRPC address from its "listening" line.
fn spawn_listening(command: &str, args: &[String], data: &Path) -> Result<(std::process::Child, String)> {
    let mut child = spawn(command, args, data)?;
    match listening(&mut child, command) {
        Ok(grpc) => Ok((child, grpc)),
        Err(error) => {
            // A process that did not come up must not outlive the bench.
            let _ = child.kill();
            let _ = child.wait();
            Err(error)
        }
    }
}

/// Spawns `walship <command> <args> --data-dir <data>`, its stdout piped
/// for [`listening`].
fn spawn(command: &str, args: &[String], data: &Path) -> Result<std::process::Child> {
    Command::new(std::env::current_exe()?)
        .arg(command)
        .args(args)
        .arg("--data-dir")
        .arg(data)
        .env("WALSHIP_LOG", std::env::var("WALSHIP_BENCH_LOG").unwrap_or("warn".into()))
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawning walship {command}"))
}

/// The gRPC address from the "listening" line of `child`, spawned by
/// [`spawn`]; waits for it.
fn listening(child: &mut std::process::Child, command: &str) -> Result<String> {
    let mut line = String::new();
    let out = child.stdout.take().context("node stdout")?;
    BufReader::new(out).read_line(&mut line)?;
    line.split_whitespace()
        .find_map(|w| w.strip_prefix("grpc="))
        .map(str::to_string)
        .with_context(|| format!("walship {command} did not print its address: {line:?}"))
}

/// One node hosting shards `1..=shards` alone, laying out `spare_bytes`
/// of spare WAL files.
pub(crate) fn single_node(data: &Path, shards: u32, spare_bytes: u64) -> Result<Target> {
    let args: Vec<String> = ["--node-id", "1", "--grpc", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--shards"]
        .iter()
        .map(|s| s.to_string())
        .chain([format!("1-{shards}"), "--wal-spare-bytes".into(), spare_bytes.to_string()])
        .collect();
    let (child, grpc) = spawn_listening("node", &args, data)?;
    Ok(Target {
        leaders: vec![grpc.clone(); shards as usize],
        nodes: vec![grpc],
        children: vec![child],
        client_tls: None,
        coord_admin: None,
    })
}

/// Attempts at starting a three-node cluster: its ports are picked before
/// the processes bind them, and another process (a parallel test) can take
/// one in between.
const CLUSTER_START_ATTEMPTS: usize = 3;

/// Three nodes, every shard at RF=3, leaders spread over the nodes; with
/// a coordinator when `leadership` says so; each node lays out
/// `spare_bytes` of spare WAL files. A start that fails (a port taken in
/// the meantime) stops what it started and tries again on fresh ports.
/// `tweak` adjusts the cluster's config before it is written.
pub(crate) fn three_nodes(
    data: &Path,
    shards: u32,
    leadership: Leadership,
    spare_bytes: u64,
    tls: bool,
    tweak: &dyn Fn(&mut walship_shipping::ClusterConfig),
    node_args: &[String],
) -> Result<Target> {
    let mut attempt = 1;
    loop {
        match start_three_nodes(data, shards, leadership, spare_bytes, tls, tweak, node_args) {
            Ok(target) => return Ok(target),
            Err(error) if attempt < CLUSTER_START_ATTEMPTS => {
                eprintln!("starting the three-node cluster failed ({error:#}); trying again on fresh ports");
                let _ = std::fs::remove_dir_all(data);
                attempt += 1;
            }
            Err(error) => return Err(error),
        }
    }
}

fn start_three_nodes(
    data: &Path,
    shards: u32,
    leadership: Leadership,
    spare_bytes: u64,
    tls: bool,
    tweak: &dyn Fn(&mut walship_shipping::ClusterConfig),
    node_args: &[String],
) -> Result<Target> {
    use walship_shipping::{ClusterConfig, NodeSpec};
    // Every listener stays bound until all ports are picked, so no two are
    // the same.
    let mut listeners = Vec::new();
    let mut port = || -> Result<std::net::SocketAddr> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        listeners.push(listener);
        Ok(addr)
    };
    let mut nodes = Vec::new();
    for id in 1..=3 {
        nodes.push(NodeSpec { id, grpc_addr: port()?.into(), admin_addr: port()?.into(), region: id });
    }
    let mut config = ClusterConfig::replicated_everywhere(nodes, shards);
    config.cluster_id = "bench".into();
    let mut coord_admin = None;
    if leadership == Leadership::Coordinated {
        let admin_addr = port()?;
        coord_admin = Some(format!("http://{admin_addr}"));
        config.coordinators = vec![walship_shipping::config::CoordinatorSpec {
            id: "bench".into(),
            grpc_addr: port()?.into(),
            admin_addr: admin_addr.into(),
        }];
    }
    drop(listeners);
    let leaders = config.shards.iter().map(|s| config.nodes[s.leader as usize - 1].grpc_addr.to_string()).collect();
    std::fs::create_dir_all(data)?;
    let certificates = match tls {
        true => Some(crate::tls::LocalCertificates::generate(&data.join("tls"))?),
        false => None,
    };
    config.tls = certificates.as_ref().map(|c| c.cluster_tls());
    tweak(&mut config);
    let file = data.join("cluster.toml");
    config.save(&file).with_context(|| format!("writing {}", file.display()))?;
    // Every process started is in `target` at once, so an early return
    // stops it (Target's drop) instead of leaving it running.
    let nodes = config.nodes.iter().map(|n| n.grpc_addr.to_string()).collect();
    let mut target = Target { leaders, nodes, children: Vec::new(), client_tls: None, coord_admin };
    if let Some(c) = &certificates {
        let read = |p: &Path| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
        target.client_tls = Some(
            ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(read(&c.ca)?))
                .identity(Identity::from_pem(read(&c.client_cert)?, read(&c.client_key)?)),
        );
    }
    let children = &mut target.children;
    if leadership == Leadership::Coordinated {
        let args: Vec<String> =
            ["--id", "bench", "--admin-token", BENCH_ADMIN_TOKEN, "--cluster"].iter().map(|s| s.to_string()).collect();
        let args = [args, vec![file.display().to_string()]].concat();
        children.push(spawn_listening("coord", &args, &data.join("coord"))?.0);
    }
    // The three start together, and only then is each waited for: started
    // one after another, the first came up seconds before the last at
    // 1,000 shards, and the coordinator failed the late ones' shards over
    // (to the nodes already up), so a cell measured a leadership other
    // than the configured one, different from run to run.
    for id in 1..=3 {
        let args = [
            vec![
                "--node-id".to_string(),
                id.to_string(),
                "--cluster".into(),
                file.display().to_string(),
                "--wal-spare-bytes".into(),
                spare_bytes.to_string(),
            ],
            node_args.to_vec(),
        ]
        .concat();
        children.push(spawn("node", &args, &data.join(format!("node-{id}")))?);
    }
    for node in children.iter_mut().rev().take(3) {
        listening(node, "node")?;
    }
    Ok(target)
}
