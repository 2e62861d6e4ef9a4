//! `walship dev`: the embedded local cluster. A coordinator (`walship
//! coord`, file KV under the data folder) and three `walship node` child
//! processes on loopback (a real gRPC hop between them), several shards at
//! RF=3 with leaders spread over the nodes, no other setup. A node that dies
//! (a crash drill, a kill) is restarted after [`RESTART_DELAY`] and rejoins
//! as a follower, and so is the coordinator, which finds its leases and
//! shard records in its file KV (`--no-restart` leaves either down). One
//! that dies again before it is listening (killed while it recovers, its
//! port taken by another process meanwhile) is restarted again, each time
//! waiting twice as long, up to [`MAX_RESTART_DELAY`]; the rest of the
//! cluster runs on.
//! Runs until Ctrl-C, then stops its children.
//!
//! The nodes start first and the coordinator after them, so that it hears
//! every replica from its first rounds: a fresh dev cluster keeps the
//! leaders of its cluster file, spread over the nodes, rather than failing
//! over shards whose leaders had not started yet.
//!
//! What it prints is meant to be pasted: the dashboard URL, an
//! `export WALSHIP_ADMIN=… WALSHIP_TOKEN=…` line for the admin commands,
//! and the leaders the coordinator reports once every shard has one. The
//! admin token is generated once and kept in `<data-dir>/admin-token`
//! (mode 0600), so a restarted dev cluster keeps it. The cluster's disk use
//! is capped (`--max-disk-mib`) with the nodes' free-space reserve
//! (`wal.min_free_bytes`): set to the free space at start plus what the
//! data dir already holds, less the cap, so the nodes refuse appends
//! (`RESOURCE_EXHAUSTED`) once they have written the cap's worth.

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use walship_shipping::config::CoordinatorSpec;
use walship_shipping::{ClusterConfig, NodeSpec};

#[derive(Args, Debug, Clone)]
pub struct DevArgs {
    /// Where the dev cluster keeps its data (node-N/ per node, cluster.toml).
    #[arg(long, default_value = ".walship/dev")]
    data_dir: PathBuf,
    /// Number of shards (ids 1..=N), each replicated on every node. Past 1,000 the nodes export per-node sums
    /// instead of per-shard metric series (`replication.per_shard_metrics = false`).
    #[arg(long, default_value_t = 4)]
    shards: u32,
    /// Number of nodes (the replication factor of every shard).
    #[arg(long, default_value_t = 3)]
    nodes: u32,
    /// Node i listens on gRPC port base+i and admin port base+80+i; the
    /// coordinator on gRPC base+90 and admin base+80. 0 picks free ports.
    #[arg(long, default_value_t = 7400)]
    base_port: u16,
    /// Admin token of the coordinator [default: the one kept in
    /// <data-dir>/admin-token, generated there (mode 0600) on first start].
    #[arg(long, env = "WALSHIP_TOKEN")]
    admin_token: Option<String>,
    /// Disk the whole dev cluster may use, in MiB: past it its nodes refuse
    /// appends with RESOURCE_EXHAUSTED (and keep serving reads) until the
    /// data dir is deleted or the cap raised. Enforced with the nodes'
    /// free-space reserve (`wal.min_free_bytes`), so anything else filling
    /// the same file system counts against it too. 0: no cap (the nodes'
    /// default 256 MiB reserve only).
    #[arg(long, default_value_t = DEFAULT_MAX_DISK_MIB)]
    max_disk_mib: u64,
    /// Leave a node or the coordinator that exits down instead of
    /// restarting it after 1 s.
    #[arg(long)]
    no_restart: bool,
    /// Serve TLS on every listener, with mutual TLS between members and on
    /// the gRPC ports: a throwaway CA and certificates are generated under
    /// <data-dir>/tls, and the line to point the CLI at them is printed.
    #[arg(long)]
    tls: bool,
    /// MiB per second each node serves sealed segments to its peers at
    /// (PeerExchange, all fetches together), passed to every node as
    /// `walship node --peer-serve-mib-per-s`; 0 = unlimited [default: the
    /// node's, `peer_serve.mib_per_s` = 64].
    #[arg(long)]
    peer_serve_mib_per_s: Option<u64>,
    /// WAL each replica keeps per shard, in MiB (`replication.retain_bytes`
    /// in the cluster config dev writes; its hard bound `max_retain_bytes`,
    /// 4 GiB, is raised to it when smaller). A re-seed drill needs its
    /// volume's room below it. [default: 1024]
    #[arg(long)]
    retain_mib: Option<u64>,
}

/// `--max-disk-mib`'s default: 2 GiB for the whole dev cluster.
pub const DEFAULT_MAX_DISK_MIB: u64 = 2048;

/// The file under the data dir that keeps the generated admin token.
const TOKEN_FILE: &str = "admin-token";

/// How long a dead node stays down before `walship dev` restarts it.
const RESTART_DELAY: Duration = Duration::from_secs(1);

/// The longest a node that keeps dying before it listens waits for its
/// next restart.
const MAX_RESTART_DELAY: Duration = Duration::from_secs(16);

/// Child processes, stopped (SIGTERM, then SIGKILL) when dropped.
struct Children(Vec<(u32, Child)>);

impl Drop for Children {
    fn drop(&mut self) {
        for (_, child) in &mut self.0 {
            // An exited child is reaped: its pid may be another process's now.
            if matches!(child.try_wait(), Ok(Some(_))) {
                continue;
            }
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

/// Addresses on loopback: `base + offset`, or with base 0 a free port,
/// held until the whole cluster is laid out so no two are the same.
#[derive(Default)]
struct Ports(Vec<TcpListener>);

impl Ports {
    fn address(&mut self, base: u16, offset: u16) -> Result<SocketAddr> {
        let port = if base == 0 {
            let listener = TcpListener::bind("127.0.0.1:0")?;
            let port = listener.local_addr()?.port();
            self.0.push(listener);
            port
        } else {
            base.checked_add(offset).context("port out of range")?
        };
        Ok(SocketAddr::from(([127, 0, 0, 1], port)))
    }
}

/// The most shards a dev cluster exports per-shard metric series for.
const PER_SHARD_METRICS_UP_TO: u32 = 1000;

/// The dev cluster's configuration: shard i led by node ((i-1) mod n)+1.
fn dev_cluster(args: &DevArgs) -> Result<ClusterConfig> {
    if args.nodes == 0 || args.shards == 0 {
        bail!("--nodes and --shards must be at least 1");
    }
    let mut ports = Ports::default();
    let mut nodes = Vec::new();
    for id in 1..=args.nodes {
        let offset = id as u16;
        nodes.push(NodeSpec {
            id,
            grpc_addr: ports.address(args.base_port, offset)?.into(),
            admin_addr: ports.address(args.base_port, 80 + offset)?.into(),
            region: id,
        });
    }
    let mut config = ClusterConfig::replicated_everywhere(nodes, args.shards);
    config.cluster_id = "walship-dev".into();
    if let Some(mib) = args.retain_mib {
        let bytes = mib.checked_mul(1 << 20).context("--retain-mib is too large")?;
        config.replication.retain_bytes = bytes;
        config.replication.max_retain_bytes = config.replication.max_retain_bytes.max(bytes);
    }
    // Past a thousand shards a scrape would carry about fifteen series per
    // shard, and each series costs memory on the node: the dev cluster
    // exports the per-node sums instead.
    config.replication.per_shard_metrics = args.shards <= PER_SHARD_METRICS_UP_TO;
    // Archives out of the box: a directory beside the nodes' data (the
    // path is relative to the cluster config written into the data dir).
    config.archive = Some(walship_shipping::config::ArchiveConfig::dir("archive".into()));
    config.coordinators = vec![CoordinatorSpec {
        id: "dev".into(),
        grpc_addr: ports.address(args.base_port, 90)?.into(),
        admin_addr: ports.address(args.base_port, 80)?.into(),
    }];
    config.validate()?;
    Ok(config)
}

/// The admin token: given, else the one kept in `<data_dir>/admin-token`,
/// else a new one written there with mode 0600. Returns it and where it
/// came from.
fn admin_token(args: &DevArgs) -> Result<(String, String)> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(token) = &args.admin_token {
        if token.len() < 8 {
            bail!("--admin-token (WALSHIP_TOKEN) must be at least 8 characters");
        }
        return Ok((token.clone(), "given with --admin-token or WALSHIP_TOKEN".into()));
    }
    let path = args.data_dir.join(TOKEN_FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let token = text.trim().to_string();
            if token.len() < 8 || token.chars().any(char::is_whitespace) {
                bail!(
                    "{} does not hold a token (8 or more characters, no spaces); delete it to get a new one",
                    path.display()
                );
            }
            // Whoever can read the file can use the admin API.
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
                .with_context(|| format!("restricting {} to its owner", path.display()))?;
            Ok((token, format!("kept in {}", path.display())))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let token = format!("{:032x}", rand::random::<u128>());
            walship_shipping::config::write_private(&path, &format!("{token}\n"))
                .with_context(|| format!("creating {}", path.display()))?;
            Ok((token, format!("new, kept in {} for the next start", path.display())))
        }
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// Bytes the files under `dir` take on disk.
fn disk_usage(dir: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => disk_usage(&e.path()),
            Ok(m) => m.blocks() * 512,
            Err(_) => 0,
        })
        .sum()
}

/// The nodes' `--wal-min-free-bytes` that caps the cluster at `cap` bytes
/// under `dir`: refuse appends once the free space is what it is now plus
/// what the data dir holds, less the cap (never below the default reserve).
fn reserve_for_cap(dir: &std::path::Path, cap: u64) -> Result<Option<u64>> {
    if cap == 0 {
        return Ok(None);
    }
    let free = walship_wal::disk_space::free_bytes(dir).with_context(|| format!("measuring {}", dir.display()))?;
    let reserve = (free + disk_usage(dir)).saturating_sub(cap);
    Ok(Some(reserve.max(walship_wal::disk_space::DEFAULT_MIN_FREE_BYTES)))
}

/// Waits until the coordinator reports a leader for every shard that also
/// reports itself leading; returns shard -> leader.
async fn current_leaders(admin: &str, shards: u32) -> Result<std::collections::BTreeMap<u32, u32>> {
    // A minute, and 20 ms more per shard (about 4 minutes at 10,000): the
    // coordinator assigns every shard once at start.
    let patience = Duration::from_secs(60) + Duration::from_millis(20) * shards;
    // Each poll counts over every shard: poll less often the more there are.
    let poll = Duration::from_millis(100) + Duration::from_micros(20) * shards;
    let deadline = std::time::Instant::now() + patience;
    loop {
        // The cluster summary counts the shards led (cheap); the whole list
        // (a view of every shard) is read once they all are.
        let all_lead = match crate::http::request("GET", admin, "/v1/cluster", None, None).await {
            Ok((200, cluster)) => cluster["shards_leading"].as_u64() == Some(u64::from(shards)),
            _ => false,
        };
        if all_lead && let Ok((200, list)) = crate::http::request("GET", admin, "/v1/shards", None, None).await {
            let leaders: std::collections::BTreeMap<u32, u32> =
                list.as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|s| {
                        let leader = s["leader"].as_u64()?;
                        let leading = s["replicas"].as_array()?.iter().any(|r| {
                            r["node_id"].as_u64() == Some(leader) && r["role"] == "leader" && r["alive"] == true
                        });
                        leading.then_some((s["shard_id"].as_u64()? as u32, leader as u32))
                    })
                    .collect();
            if leaders.len() == shards as usize {
                return Ok(leaders);
            }
        }
        if std::time::Instant::now() > deadline {
            bail!("the coordinator at {admin} reported no leader for every shard within {} s", patience.as_secs());
        }
        tokio::time::sleep(poll).await;
    }
}

/// Makes `command`'s process receive SIGTERM when `walship dev` dies, even
/// by SIGKILL, so that no node or coordinator outlives it.
fn die_with_parent(command: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: prctl(2) only, in the child between fork and exec. The signal
    // follows the thread that forked: `run_dev` spawns every child from the
    // thread that runs it to the end (the runtime's block_on).
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    }
}

/// A restarted node's stdout read on a thread of its own (it reads to the
/// end, so the node never writes into a full pipe): says when the node is
/// listening again. True at once for a node already seen listening.
struct Listening(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Listening {
    fn already() -> Listening {
        Listening(std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true)))
    }

    fn watch(child: &mut Child, name: String) -> Listening {
        let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        if let Some(stdout) = child.stdout.take() {
            let seen = flag.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    if line.contains("listening") && !seen.swap(true, std::sync::atomic::Ordering::SeqCst) {
                        println!("{name} is back (listening)");
                    }
                }
            });
        }
        Listening(flag)
    }

    fn is_listening(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// How `walship dev` names its child `id` (0: the coordinator).
fn child_name(id: u32) -> String {
    if id == 0 { "the coordinator".into() } else { format!("node {id}") }
}

/// How long a node that exited waits for its restart: [`RESTART_DELAY`]
/// after it had been listening, else twice its last wait (up to
/// [`MAX_RESTART_DELAY`]): a node that keeps failing to start is not
/// restarted in a tight loop.
fn restart_delay(was_listening: bool, last: Option<Duration>) -> Duration {
    match last {
        Some(last) if !was_listening => (last * 2).min(MAX_RESTART_DELAY),
        _ => RESTART_DELAY,
    }
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
    if let Some(c) = &certificates {
        // What this process itself asks the coordinator over https.
        crate::tls::ClientTls::for_local(c).install()?;
    }
    let (token, token_from) = admin_token(&args)?;
    let cap = args.max_disk_mib.checked_mul(1 << 20).context("--max-disk-mib is too large")?;
    let reserve = reserve_for_cap(&args.data_dir, cap)?;
    let used_at_start = disk_usage(&args.data_dir);
    let cluster_file = args.data_dir.join("cluster.toml");
    cluster.save(&cluster_file).with_context(|| format!("writing {}", cluster_file.display()))?;
    let exe = std::env::current_exe()?;
    let log = std::env::var("WALSHIP_LOG").unwrap_or_else(|_| "warn".into());
    let reserve_arg = reserve.map(|r| r.to_string());
    let start_node = |id: u32| -> Result<Child> {
        let mut command = Command::new(&exe);
        die_with_parent(&mut command);
        // A dev cluster starts in a blink rather than writing a WAL file of
        // zeros and its spares per node first (`wal.prefill`).
        command.args(["node", "--allow-crash-drills", "--wal-prefill", "false", "--node-id", &id.to_string()]);
        if let Some(reserve) = &reserve_arg {
            command.args(["--wal-min-free-bytes", reserve]);
        }
        if let Some(mib) = args.peer_serve_mib_per_s {
            command.args(["--peer-serve-mib-per-s", &mib.to_string()]);
        }
        command
            .arg("--cluster")
            .arg(&cluster_file)
            .arg("--data-dir")
            .arg(args.data_dir.join(format!("node-{id}")))
            .env("WALSHIP_LOG", &log)
            .stdout(Stdio::piped())
            .spawn()
            .context("starting a node")
    };
    // Nodes first, then the coordinator: it then hears every replica from
    // its first rounds and keeps the leaders of the cluster file, instead
    // of failing over shards whose leaders have not started yet. The nodes
    // start together and only then is each waited for: one after another,
    // at 10,000 shards they took about 6 s of the cluster's start.
    let mut children = Children(Vec::new());
    for node in &cluster.nodes {
        children.0.push((node.id, start_node(node.id)?));
    }
    for (id, child) in children.0.iter_mut() {
        wait_listening(child, &format!("node {id}"))?;
    }
    let start_coordinator = || -> Result<Child> {
        die_with_parent(&mut Command::new(&exe))
            .args(["coord", "--id", "dev", "--admin-token", &token, "--cluster"])
            .arg(&cluster_file)
            .arg("--data-dir")
            .arg(args.data_dir.join("coord"))
            .env("WALSHIP_LOG", &log)
            .stdout(Stdio::piped())
            .spawn()
            .context("starting the coordinator")
    };
    // The coordinator is child 0.
    let start_child = |id: u32| if id == 0 { start_coordinator() } else { start_node(id) };
    children.0.push((0, start_coordinator()?));
    wait_listening(&mut children.0.last_mut().expect("just pushed").1, "the coordinator")?;
    let coord = &cluster.coordinators[0];
    let admin = format!("{scheme}://{}", coord.admin_addr);
    let leaders = current_leaders(&admin, args.shards).await?;
    println!(
        "walship dev: {} nodes, shards 1..={} at RF={}, data in {}",
        cluster.nodes.len(),
        args.shards,
        cluster.nodes.len(),
        args.data_dir.display()
    );
    for node in &cluster.nodes {
        let leads: Vec<u32> =
            leaders.iter().filter(|&(_, &leader)| leader == node.id).map(|(&shard, _)| shard).collect();
        println!(
            "  node {}  gRPC {}  admin {scheme}://{}/v1/status  {}",
            node.id,
            node.grpc_addr,
            node.admin_addr,
            led_shards(&leads)
        );
    }
    println!("  coordinator  admin {admin}/v1/shards  (leaders above as it reports them now)");
    println!("dashboard: {admin}/");
    println!("admin token ({token_from}); for walship status/failover/drill and curl:");
    println!("  export WALSHIP_ADMIN={admin} WALSHIP_TOKEN={token}");
    if let Some(certificates) = &certificates {
        println!("TLS on every port, mutual on gRPC; point the CLI at the throwaway CA:");
        println!("  {}", certificates.export_line());
    }
    match reserve {
        Some(_) => println!(
            "disk: the cluster may use up to {} MiB under {} (--max-disk-mib; {} MiB used now); past it nodes refuse appends (RESOURCE_EXHAUSTED) and keep serving reads",
            args.max_disk_mib,
            args.data_dir.display(),
            used_at_start >> 20
        ),
        None => println!(
            "disk: no cap (--max-disk-mib 0); nodes refuse appends only when the file system under {} has less than 256 MiB free",
            args.data_dir.display()
        ),
    }
    if used_at_start >= cap && cap > 0 {
        println!(
            "  warning: the data dir already holds the cap: appends will be refused (delete {} or raise --max-disk-mib)",
            args.data_dir.display()
        );
    }
    if args.no_restart {
        println!("restarts: off (--no-restart): a node or the coordinator that exits stays down");
    } else {
        println!(
            "restarts: a node or the coordinator that exits (a crash drill, a kill) is restarted after {}s; --no-restart leaves it down",
            RESTART_DELAY.as_secs()
        );
    }
    let first = &cluster.nodes[0].grpc_addr;
    // Shard 2 is led by node 2, so the example shows the leader hint at
    // work; a one-shard cluster has only shard 1.
    let example = args.shards.min(2);
    println!("try (any node works: clients follow the leader hint):");
    println!("  echo hello | walship append --server {first} --shard {example}");
    println!("  walship read --server {first} --shard {example} --from 1");
    println!("  walship status --admin {admin}");
    println!("cluster config: {}; Ctrl-C stops the cluster.", cluster_file.display());

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut check = tokio::time::interval(Duration::from_millis(500));
    let mut left_down = std::collections::BTreeSet::new();
    let mut listening: std::collections::BTreeMap<u32, Listening> =
        children.0.iter().map(|(id, _)| (*id, Listening::already())).collect();
    // When each child waiting for a restart is due, and the wait each was
    // last given (the next failed start doubles it).
    let mut restarts: std::collections::BTreeMap<u32, tokio::time::Instant> = std::collections::BTreeMap::new();
    let mut last_delay: std::collections::BTreeMap<u32, Duration> = std::collections::BTreeMap::new();
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
            _ = check.tick() => {
                let now = tokio::time::Instant::now();
                for (id, child) in &mut children.0 {
                    if let Some(&due) = restarts.get(id) {
                        if now < due {
                            continue;
                        }
                        restarts.remove(id);
                        match start_child(*id) {
                            Ok(mut fresh) => {
                                listening.insert(*id, Listening::watch(&mut fresh, child_name(*id)));
                                *child = fresh;
                            }
                            Err(e) => {
                                let delay = restart_delay(false, last_delay.get(id).copied());
                                println!("{} could not be started ({e:#}); trying again in {}s", child_name(*id), delay.as_secs());
                                last_delay.insert(*id, delay);
                                restarts.insert(*id, now + delay);
                            }
                        }
                        continue;
                    }
                    let Ok(Some(status)) = child.try_wait() else { continue };
                    let name = child_name(*id);
                    if args.no_restart {
                        if left_down.insert(*id) {
                            println!("{name} exited ({status}); left down (--no-restart)");
                        }
                        continue;
                    }
                    // Restart only after the coordinator has noticed the
                    // loss (leader_timeout_ms), so a crash drill sees a
                    // real failover rather than the same leader back.
                    let was_listening = listening.get(id).is_some_and(Listening::is_listening);
                    let delay = restart_delay(was_listening, last_delay.get(id).copied());
                    let when = if was_listening { "" } else { " before it was listening" };
                    println!("{name} exited{when} ({status}); restarting it in {}s", delay.as_secs());
                    last_delay.insert(*id, delay);
                    restarts.insert(*id, now + delay);
                }
            }
        }
    }
    println!("stopping the dev cluster");
    drop(children);
    Ok(())
}

/// Shard ids a node's line lists in full; past it the line says how many
/// and lists the first and last few (ten thousand shards printed every id,
/// some 20 KB of terminal a node). `walship status --node N` lists them.
const LISTED_SHARDS: usize = 24;

/// `leads shards [1, 4, 7]`, or `leads 3334 shards [1, 4, ..., 9997, 10000]`.
fn led_shards(shards: &[u32]) -> String {
    let ids = |s: &[u32]| s.iter().map(u32::to_string).collect::<Vec<_>>().join(", ");
    if shards.len() <= LISTED_SHARDS {
        return format!("leads shards [{}]", ids(shards));
    }
    let (head, tail) = (&shards[..8], &shards[shards.len() - 4..]);
    format!("leads {} shards [{}, ..., {}]", shards.len(), ids(head), ids(tail))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_failing_to_start_waits_twice_as_long_each_time_up_to_the_cap() {
        let seconds = |d: Duration| d.as_secs();
        assert_eq!(seconds(restart_delay(true, None)), 1, "a first exit");
        assert_eq!(seconds(restart_delay(false, None)), 1, "dead before its first restart was seen");
        assert_eq!(seconds(restart_delay(false, Some(RESTART_DELAY))), 2);
        assert_eq!(seconds(restart_delay(false, Some(Duration::from_secs(8)))), 16);
        assert_eq!(seconds(restart_delay(false, Some(MAX_RESTART_DELAY))), 16, "capped");
        assert_eq!(seconds(restart_delay(true, Some(MAX_RESTART_DELAY))), 1, "it had started: back to 1 s");
    }

    #[test]
    fn a_node_line_lists_few_shards_whole_and_many_by_their_ends() {
        assert_eq!(led_shards(&[]), "leads shards []");
        assert_eq!(led_shards(&[1, 4, 7]), "leads shards [1, 4, 7]");
        let many: Vec<u32> = (1..=10_000).step_by(3).collect();
        assert_eq!(led_shards(&many), "leads 3334 shards [1, 4, 7, 10, 13, 16, 19, 22, ..., 9991, 9994, 9997, 10000]");
        let line = led_shards(&many[..LISTED_SHARDS]);
        assert!(line.starts_with("leads shards [1, 4,") && !line.contains("..."), "{line}");
    }

    #[test]
    fn dev_cluster_spreads_leaders_at_full_replication() {
        let args = DevArgs {
            data_dir: "x".into(),
            shards: 4,
            nodes: 3,
            base_port: 7400,
            admin_token: None,
            max_disk_mib: DEFAULT_MAX_DISK_MIB,
            no_restart: false,
            tls: false,
            peer_serve_mib_per_s: None,
            retain_mib: None,
        };
        let c = dev_cluster(&args).unwrap();
        assert_eq!(c.shards.iter().map(|s| s.leader).collect::<Vec<_>>(), vec![1, 2, 3, 1]);
        assert!(c.shards.iter().all(|s| s.replicas == vec![1, 2, 3]));
        assert_eq!(c.nodes[1].grpc_addr.port(), 7402);
        assert_eq!(c.nodes[1].admin_addr.port(), 7482);
        assert_eq!(c.coordinators[0].admin_addr.port(), 7480);
        assert!(c.coordinated());
        assert_eq!(c.replication.retain_bytes, 1 << 30);
        assert!(c.replication.per_shard_metrics);
        assert!(!dev_cluster(&DevArgs { shards: 1001, ..args.clone() }).unwrap().replication.per_shard_metrics);
        let c = dev_cluster(&DevArgs { retain_mib: Some(8192), ..args }).unwrap();
        assert_eq!((c.replication.retain_bytes, c.replication.max_retain_bytes), (8 << 30, 8 << 30));
    }
}
