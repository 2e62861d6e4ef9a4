//! Shared helpers for black-box tests: start `walship node` as a real process
//! on free loopback ports, talk to it over gRPC, wait on conditions.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use walship_proto::log::log_client::LogClient;
use walship_shipping::auth::{ClusterCredentials, ClusterSecret};

pub use ports::free_port;

pub mod cli;
pub mod dev;
pub mod history;
pub mod partition;
pub mod ports;
#[allow(clippy::duplicate_mod)]
#[path = "../../objstore/tests/support/signal.rs"]
pub mod process_signal;

/// Path of the `walship` binary under test.
pub fn walship_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_walship"))
}

/// A `walship node` child process. Killed (SIGKILL) on drop.
pub struct NodeProcess {
    pub child: Child,
    pub grpc: String,
    pub admin: String,
    pub data_dir: PathBuf,
    pub node_id: u32,
    pub shards: String,
    /// The extra flags it was started with; a restart passes them again.
    pub extra: Vec<String>,
    /// The file its stderr is appended to (at INFO), if not inherited.
    pub stderr_log: Option<PathBuf>,
}

/// Spawns a `walship` subcommand with piped stdout and returns the child
/// with the `name=value` fields of its first ("listening") line.
pub fn spawn_listening(command: &mut Command, what: &str) -> (Child, std::collections::HashMap<String, String>) {
    spawn_listening_logged(command, what, None)
}

/// Like [`spawn_listening`]; with `stderr_log`, the child logs at INFO
/// without colours, appending to that file (kept across restarts, so a test
/// can read what every incarnation of a node said).
pub fn spawn_listening_logged(
    command: &mut Command,
    what: &str,
    stderr_log: Option<&Path>,
) -> (Child, std::collections::HashMap<String, String>) {
    let (level, stderr) = match stderr_log {
        Some(path) => {
            let file = std::fs::OpenOptions::new().create(true).append(true).open(path).expect("open the stderr log");
            command.env("NO_COLOR", "1");
            ("info,raft_engine=warn".to_string(), Stdio::from(file))
        }
        None => (std::env::var("WALSHIP_TEST_LOG").unwrap_or_else(|_| "warn".into()), Stdio::inherit()),
    };
    let mut child = command
        .env("WALSHIP_LOG", level)
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {what}: {e}"));
    let stdout = child.stdout.take().expect("piped stdout");
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).expect("read listening line");
    assert!(line.contains("listening"), "{what} did not start: {line:?}");
    let fields = line
        .split_whitespace()
        .filter_map(|w| w.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    (child, fields)
}

impl NodeProcess {
    /// Waits (up to 20 s) until the node's admin `/healthz` answers 200.
    pub async fn wait_healthy(&self) {
        wait_until("admin /healthz answers 200", Duration::from_secs(20), || async {
            http_get(&format!("{}/healthz", self.admin)).await.0 == 200
        })
        .await;
    }

    /// Starts a node hosting `shards` (e.g. "1-4") with its WAL under
    /// `data_dir`, on free ports, and waits for its "listening" line.
    pub fn start(node_id: u32, data_dir: &Path, shards: &str, extra: &[&str]) -> NodeProcess {
        // Hundreds of test nodes: no WAL file of zeros for each, unless a
        // test asks for the production default.
        let prefill = if extra.contains(&"--wal-prefill") { &[][..] } else { &["--wal-prefill", "false"][..] };
        let (child, fields) = spawn_listening(
            Command::new(walship_bin())
                .args(["node", "--node-id", &node_id.to_string(), "--grpc", "127.0.0.1:0", "--admin", "127.0.0.1:0"])
                .args(prefill)
                .arg("--data-dir")
                .arg(data_dir)
                .args(["--shards", shards])
                .args(extra)
                .env("WALSHIP_CLUSTER_SECRET", SECRET),
            &format!("node {node_id}"),
        );
        NodeProcess {
            child,
            grpc: fields["grpc"].clone(),
            admin: fields["admin"].clone(),
            data_dir: data_dir.to_path_buf(),
            node_id,
            shards: shards.to_string(),
            extra: extra.iter().map(|s| s.to_string()).collect(),
            stderr_log: None,
        }
    }

    /// Restarts the node on the same data dir and flags (new ports).
    pub fn restart(&mut self) {
        self.kill9();
        let extra = self.extra.clone();
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        *self = NodeProcess::start(self.node_id, &self.data_dir.clone(), &self.shards.clone(), &extra);
    }

    /// SIGTERM, then waits up to `within` for the process to exit (panics
    /// if it does not): its clean shutdown path runs.
    pub async fn stop_on_sigterm(&mut self, within: Duration) {
        process_signal::send(self.child.id(), libc::SIGTERM);
        let node_id = self.node_id;
        let child = &mut self.child;
        let deadline = std::time::Instant::now() + within;
        while child.try_wait().unwrap().is_none() {
            assert!(std::time::Instant::now() < deadline, "node {node_id} did not stop within {within:?} of SIGTERM");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGKILL: no shutdown path runs, exactly like a crash.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub async fn client(&self) -> LogClient<Channel> {
        let channel = Endpoint::from_shared(format!("http://{}", self.grpc)).unwrap().connect().await.unwrap();
        LogClient::new(channel).max_decoding_message_size(64 << 20).max_encoding_message_size(64 << 20)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin, path)
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Polls `condition` until it holds or `timeout` passes; panics with `what`.
pub async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !condition().await {
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Blocks until the coordinator at `admin` (`http://host:port`) says it
/// holds the lease, for at most `within`; whether it did. For the
/// synchronous cluster launch, so a plain HTTP/1.0 GET.
fn wait_active_blocking(admin: &str, within: Duration) -> bool {
    use std::io::{Read, Write};
    let addr = admin.trim_start_matches("http://").trim_end_matches('/');
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if let Ok(mut socket) = std::net::TcpStream::connect(addr) {
            let _ = socket.set_read_timeout(Some(Duration::from_secs(2)));
            let request = format!("GET /v1/cluster HTTP/1.0\r\nHost: {addr}\r\n\r\n");
            let mut answer = String::new();
            if socket.write_all(request.as_bytes()).is_ok() && socket.read_to_string(&mut answer).is_ok() {
                let body = answer.split_once("\r\n\r\n").map_or("", |(_, body)| body);
                if serde_json::from_str::<serde_json::Value>(body).is_ok_and(|v| v["coordinator"]["active"] == true) {
                    return true;
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// Plain HTTP GET over loopback (no client crate needed): status and body.
pub async fn http_get(addr_and_path: &str) -> (u16, String) {
    http_request("GET", addr_and_path, None).await
}

/// The value of one Prometheus series (`name{labels}` exactly as exposed)
/// at an admin address's `/metrics`; 0 when it is not there.
pub async fn metric(admin: &str, series: &str) -> f64 {
    let body = http_get(&format!("{admin}/metrics")).await.1;
    body.lines().find_map(|l| l.strip_prefix(series).and_then(|v| v.trim().parse().ok())).unwrap_or(0.0)
}

/// POST with a JSON body and an optional bearer token.
pub async fn http_post(addr_and_path: &str, body: &str, token: Option<&str>) -> (u16, String) {
    let authorization = token.map(|t| format!("Bearer {t}"));
    http_request_with("POST", addr_and_path, Some(body), authorization.as_deref()).await
}

/// A POST with this exact `Authorization` header value.
pub async fn http_post_authorized(addr_and_path: &str, body: &str, authorization: &str) -> (u16, String) {
    http_request_with("POST", addr_and_path, Some(body), Some(authorization)).await
}

/// Minimal HTTP/1.1 request: `addr_and_path` is `host:port/path`.
pub async fn http_request(method: &str, addr_and_path: &str, body: Option<&str>) -> (u16, String) {
    http_request_with(method, addr_and_path, body, None).await
}

async fn http_request_with(
    method: &str,
    addr_and_path: &str,
    body: Option<&str>,
    authorization: Option<&str>,
) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (addr, path) = match addr_and_path.find('/') {
        Some(i) => (&addr_and_path[..i], &addr_and_path[i..]),
        None => (addr_and_path, "/"),
    };
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let body = body.unwrap_or("");
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\n{}Content-Length: {}\r\n\r\n{body}",
        authorization.map_or(String::new(), |a| format!("Authorization: {a}\r\n")),
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.unwrap();
    let text = String::from_utf8_lossy(&response).to_string();
    let status = text.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (status, body)
}

/// A cluster of `walship node` processes sharing one cluster config.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub config_path: PathBuf,
    pub nodes: Vec<NodeProcess>,
    pub coordinators: Vec<CoordProcess>,
    pub nats: Option<String>,
    /// Every process runs as a Unix user of its own ([`ClusterSpec::separate_users`]);
    /// restarts keep it.
    pub separate_users: bool,
    /// Extra arguments of every coordinator (restarts too).
    pub coord_args: Vec<String>,
}

/// The admin token test coordinators run with.
pub const TOKEN: &str = "test-token-0123456789";

/// The cluster secret test clusters run with: every WalShipping and
/// Control call a test makes as a member of the cluster carries it.
pub const SECRET: &str = "test-cluster-secret-0123456789";

/// A channel whose calls carry the test clusters' secret.
pub type Member = InterceptedService<Channel, ClusterCredentials>;

/// `channel` with the test clusters' secret on every call, as a member of
/// the cluster sends them.
pub fn as_member(channel: Channel) -> Member {
    InterceptedService::new(channel, ClusterSecret::new(SECRET).unwrap().credentials())
}

/// Pauses (or resumes) `shard` on the node serving gRPC at `grpc`, calling
/// as a member of the cluster (drills' hook; nodes run with
/// `--allow-crash-drills`).
pub async fn pause_shard(grpc: &str, shard: u32, paused: bool) {
    use walship_proto::log::PauseRequest;
    use walship_proto::log::control_client::ControlClient;
    let channel = Endpoint::from_shared(format!("http://{grpc}")).unwrap().connect().await.unwrap();
    ControlClient::new(as_member(channel)).pause(PauseRequest { shard_id: shard, paused }).await.unwrap();
}

/// A `walship coord` child process. Killed (SIGKILL) on drop.
pub struct CoordProcess {
    pub child: Child,
    pub admin: String,
    pub grpc: String,
    pub id: u32,
}

impl CoordProcess {
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends `signal`; a SIGSTOP returns once every thread is stopped.
    pub fn signal(&mut self, signal: i32) {
        process_signal::send(self.child.id(), signal);
    }
}

impl Drop for CoordProcess {
    fn drop(&mut self) {
        // SAFETY: kill(2) on a child process this test spawned.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGCONT) };
        self.kill9();
    }
}

/// A cluster to start with [`Cluster::launch`].
pub struct ClusterSpec<'a> {
    /// The IP or DNS name in every address of the cluster config.
    pub host: &'a str,
    pub nodes: u32,
    pub shards: u32,
    pub coordinators: u32,
    /// Extra TOML for the `[replication]` table.
    pub replication: &'a str,
    /// NATS URL for the coordinators' KV (file KV without).
    pub nats: Option<&'a str>,
    /// Extra command-line arguments for some nodes' first start (not for
    /// restarts).
    pub node_args: Vec<(u32, Vec<String>)>,
    /// Extra environment variables for some nodes' first start (not for
    /// restarts), e.g. `FAILPOINTS`.
    pub node_env: Vec<(u32, Vec<(String, String)>)>,
    /// Data dirs for some nodes, instead of `<cluster dir>/node-<id>` (a
    /// small file system of their own, say); kept across restarts.
    pub data_dirs: Vec<(u32, PathBuf)>,
    /// Nodes whose stderr goes to a file (at INFO), kept across restarts,
    /// instead of the test's own stderr.
    pub stderr_logs: Vec<(u32, PathBuf)>,
    /// Runs node i as Unix user `walship-n<i>` and coordinator c as
    /// `walship-c<c>` (created on first use; needs root), so that
    /// [`partition::Partition`] can cut links by socket owner.
    pub separate_users: bool,
    /// Extra arguments of every coordinator (restarts too), e.g.
    /// `--task-stall-s 2`.
    pub coord_args: Vec<String>,
    /// Extra TOML at the end of the cluster config (tables such as
    /// `[archive]`).
    pub cluster_toml: String,
    /// Replica sets of some shards (led by the first listed), instead of
    /// every node.
    pub shard_replicas: Vec<(u32, Vec<u32>)>,
    /// Regions of some nodes, instead of node i in region i.
    pub regions: Vec<(u32, u32)>,
    /// Starts the coordinators first, waits until one is active and then
    /// this long, and only then starts the nodes, all at once (as an
    /// operator bringing a cluster up may); none: the nodes first, one
    /// after another.
    pub coordinators_first: Option<Duration>,
}

impl Default for ClusterSpec<'_> {
    fn default() -> Self {
        ClusterSpec {
            host: "127.0.0.1",
            nodes: 3,
            shards: 1,
            coordinators: 0,
            replication: "",
            nats: None,
            node_args: Vec::new(),
            node_env: Vec::new(),
            data_dirs: Vec::new(),
            stderr_logs: Vec::new(),
            separate_users: false,
            coord_args: Vec::new(),
            cluster_toml: String::new(),
            shard_replicas: Vec::new(),
            regions: Vec::new(),
            coordinators_first: None,
        }
    }
}

impl Cluster {
    /// `nodes` nodes, shards `1..=shards` replicated on all of them; shard i
    /// is led by node ((i-1) mod nodes)+1. `replication` is extra TOML for
    /// the `[replication]` table (e.g. "keepalive_ms = 100").
    pub fn start(nodes: u32, shards: u32, replication: &str) -> Cluster {
        Self::start_with(nodes, shards, 0, replication, None)
    }

    /// Like [`Cluster::start`], plus `coordinators` coordinator processes
    /// (ids `c1`, `c2`, ...; file KV in a shared dir, or NATS at `nats`).
    /// Nodes run with `--allow-crash-drills`.
    pub fn start_with(nodes: u32, shards: u32, coordinators: u32, replication: &str, nats: Option<&str>) -> Cluster {
        Self::start_on("127.0.0.1", nodes, shards, coordinators, replication, nats)
    }

    /// Like [`Cluster::start_with`], with `host` (an IP or a DNS name) in
    /// every address of the cluster config.
    pub fn start_on(
        host: &str,
        nodes: u32,
        shards: u32,
        coordinators: u32,
        replication: &str,
        nats: Option<&str>,
    ) -> Cluster {
        Self::launch(&ClusterSpec { host, nodes, shards, coordinators, replication, nats, ..ClusterSpec::default() })
    }

    /// Starts what `spec` describes.
    pub fn launch(spec: &ClusterSpec) -> Cluster {
        // Free ports are probed, then released: another test's process can
        // take one before our node binds it. Start over on fresh ports then.
        for attempt in 1..=3 {
            let start = std::panic::AssertUnwindSafe(|| Self::try_launch(spec));
            match std::panic::catch_unwind(start) {
                Ok(cluster) => return cluster,
                Err(e) if attempt < 3 => {
                    eprintln!("cluster start attempt {attempt} failed ({e:?}); retrying on fresh ports")
                }
                Err(e) => std::panic::resume_unwind(e),
            }
        }
        unreachable!()
    }

    fn try_launch(spec: &ClusterSpec) -> Cluster {
        let ClusterSpec { host, nodes, shards, coordinators, replication, nats, .. } = *spec;
        let dir = tempfile::tempdir().unwrap();
        if spec.separate_users {
            partition::open_cluster_dir(dir.path(), coordinators, nats.is_some());
        }
        let mut toml = format!("cluster_id = \"test\"\nsecret = \"{SECRET}\"\n");
        for c in 1..=coordinators {
            let (g, a) = (free_port(), free_port());
            toml +=
                &format!("[[coordinators]]\nid = \"c{c}\"\ngrpc_addr = \"{host}:{g}\"\nadmin_addr = \"{host}:{a}\"\n");
        }
        let mut ports = Vec::new();
        for id in 1..=nodes {
            let (g, a) = (free_port(), free_port());
            ports.push((g, a));
            let region = spec.regions.iter().find(|(n, _)| *n == id).map_or(id, |(_, r)| *r);
            toml += &format!(
                "[[nodes]]\nid = {id}\ngrpc_addr = \"{host}:{g}\"\nadmin_addr = \"{host}:{a}\"\nregion = {region}\n"
            );
        }
        for shard in 1..=shards {
            let (replicas, leader) = match spec.shard_replicas.iter().find(|(s, _)| *s == shard) {
                Some((_, set)) => (set.clone(), set[0]),
                None => ((1..=nodes).collect(), (shard - 1) % nodes + 1),
            };
            let replicas: Vec<String> = replicas.iter().map(|n| n.to_string()).collect();
            toml += &format!("[[shards]]\nid = {shard}\nreplicas = [{}]\nleader = {leader}\n", replicas.join(", "));
        }
        let heartbeat_to =
            if coordinators == 0 { format!("heartbeat_to = \"127.0.0.1:{}\"\n", ports[0].0) } else { String::new() };
        toml += &format!("[replication]\n{heartbeat_to}{replication}\n");
        toml += &spec.cluster_toml;
        let config_path = dir.path().join("cluster.toml");
        std::fs::write(&config_path, toml).unwrap();
        let mut cluster = Cluster {
            dir,
            config_path,
            nodes: Vec::new(),
            coordinators: Vec::new(),
            nats: nats.map(str::to_string),
            separate_users: spec.separate_users,
            coord_args: spec.coord_args.clone(),
        };
        if let Some(wait) = spec.coordinators_first {
            cluster.spawn_coordinators(coordinators);
            assert!(
                wait_active_blocking(&cluster.coordinators[0].admin, Duration::from_secs(20)),
                "no coordinator took the lease within 20 s"
            );
            std::thread::sleep(wait);
        }
        let (dir, config_path) = (cluster.dir.path(), &cluster.config_path);
        let spawn_node = |id: u32| {
            let extra = spec.node_args.iter().find(|(n, _)| *n == id).map_or(&[][..], |(_, a)| &a[..]);
            let env = spec.node_env.iter().find(|(n, _)| *n == id).map_or(&[][..], |(_, e)| &e[..]);
            let data = spec.data_dirs.iter().find(|(n, _)| *n == id).map(|(_, d)| d.clone());
            let data = data.unwrap_or_else(|| dir.join(format!("node-{id}")));
            let log = spec.stderr_logs.iter().find(|(n, _)| *n == id).map(|(_, l)| l.as_path());
            Self::spawn(config_path, &data, id, extra, env, log, spec.separate_users)
        };
        cluster.nodes = match spec.coordinators_first {
            None => (1..=nodes).map(spawn_node).collect(),
            // Under a running coordinator the nodes start together, as an
            // operator's would: one after another, on a loaded machine the
            // last came up past the leader timeout after the first.
            Some(_) => std::thread::scope(|scope| {
                let spawn_node = &spawn_node;
                let started: Vec<_> = (1..=nodes).map(|id| scope.spawn(move || spawn_node(id))).collect();
                started.into_iter().map(|s| s.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect()
            }),
        };
        if spec.coordinators_first.is_none() {
            cluster.spawn_coordinators(coordinators);
        }
        cluster
    }

    fn spawn_coordinators(&mut self, coordinators: u32) {
        for c in 1..=coordinators {
            let coordinator = self.spawn_coordinator(c);
            if c == 1 && coordinators > 1 {
                // Coordinator 1 takes the lease before the next one starts:
                // tests name it the active one, and on a loaded machine a
                // standby started at once can win the race for the lease
                // (a DataPlane test then waited a minute for workers that
                // had connected to coordinator 2).
                assert!(
                    wait_active_blocking(&coordinator.admin, Duration::from_secs(20)),
                    "coordinator 1 did not take the lease within 20 s"
                );
            }
            self.coordinators.push(coordinator);
        }
    }

    fn spawn_coordinator(&self, c: u32) -> CoordProcess {
        let mut command = Command::new(walship_bin());
        command
            .args(["coord", "--id", &format!("c{c}"), "--admin-token", TOKEN, "--cluster"])
            .arg(&self.config_path)
            .arg("--data-dir")
            // One shared dir: with the file KV every coordinator sees one KV.
            .arg(self.dir.path().join("coord"));
        if let Some(url) = &self.nats {
            command.args(["--nats", url]);
        }
        command.args(&self.coord_args);
        if self.separate_users {
            partition::run_as(&mut command, &partition::coordinator_user(c), &[&self.dir.path().join("coord")]);
        }
        let (child, fields) = spawn_listening(&mut command, &format!("coordinator c{c}"));
        CoordProcess { child, admin: fields["admin"].clone(), grpc: fields["grpc"].clone(), id: c }
    }

    pub fn coordinator(&mut self, c: u32) -> &mut CoordProcess {
        &mut self.coordinators[c as usize - 1]
    }

    pub fn restart_coordinator(&mut self, c: u32) {
        self.coordinator(c).kill9();
        let coordinator = self.spawn_coordinator(c);
        self.coordinators[c as usize - 1] = coordinator;
    }

    /// A coordinator admin GET, as JSON (status, body).
    pub async fn coord_get(&mut self, c: u32, path: &str) -> (u16, serde_json::Value) {
        let url = format!("{}{path}", self.coordinator(c).admin);
        let (code, body) = http_get(&url).await;
        (code, serde_json::from_str(&body).unwrap_or(serde_json::Value::Null))
    }

    /// A coordinator admin POST with JSON `body` and optional token.
    pub async fn coord_post(
        &mut self,
        c: u32,
        path: &str,
        body: &str,
        token: Option<&str>,
    ) -> (u16, serde_json::Value) {
        let url = format!("{}{path}", self.coordinator(c).admin);
        let (code, body) = http_post(&url, body, token).await;
        (code, serde_json::from_str(&body).unwrap_or(serde_json::Value::Null))
    }

    /// The shard's leader and epoch as the active coordinator `c` records them.
    pub async fn leader_of(&mut self, c: u32, shard: u32) -> Option<(u32, u64)> {
        let (code, v) = self.coord_get(c, &format!("/v1/shards/{shard}")).await;
        if code != 200 {
            return None;
        }
        Some((v["leader"].as_u64()? as u32, v["epoch"].as_u64()?))
    }

    fn spawn(
        config: &Path,
        data: &Path,
        id: u32,
        extra: &[String],
        env: &[(String, String)],
        stderr_log: Option<&Path>,
        separate_user: bool,
    ) -> NodeProcess {
        let data = data.to_path_buf();
        let mut command = Command::new(walship_bin());
        if separate_user {
            partition::run_as(&mut command, &partition::node_user(id), &[&data]);
        }
        let (child, fields) = spawn_listening_logged(
            command
                .envs(env.iter().map(|(k, v)| (k, v)))
                // No WAL file of zeros per test node (`wal.prefill`).
                .args([
                    "node",
                    "--allow-crash-drills",
                    "--wal-prefill",
                    "false",
                    "--node-id",
                    &id.to_string(),
                    "--cluster",
                ])
                .arg(config)
                .arg("--data-dir")
                .arg(&data)
                .args(extra),
            &format!("node {id}"),
            stderr_log,
        );
        NodeProcess {
            grpc: fields["grpc"].clone(),
            admin: fields["admin"].clone(),
            child,
            data_dir: data,
            node_id: id,
            shards: String::new(),
            extra: extra.to_vec(),
            stderr_log: stderr_log.map(Path::to_path_buf),
        }
    }

    pub fn node(&mut self, id: u32) -> &mut NodeProcess {
        &mut self.nodes[id as usize - 1]
    }

    /// Restarts a (killed) node on its data dir and configured ports.
    pub fn restart(&mut self, id: u32) {
        self.node(id).kill9();
        let (data, log) = (self.node(id).data_dir.clone(), self.node(id).stderr_log.clone());
        let node = Self::spawn(&self.config_path, &data, id, &[], &[], log.as_deref(), self.separate_users);
        self.nodes[id as usize - 1] = node;
    }

    /// Like [`Cluster::restart`], with the arguments of the node's first
    /// start ([`ClusterSpec::node_args`]).
    pub fn restart_with_args(&mut self, id: u32) {
        self.node(id).kill9();
        let (data, extra, log) =
            (self.node(id).data_dir.clone(), self.node(id).extra.clone(), self.node(id).stderr_log.clone());
        let node = Self::spawn(&self.config_path, &data, id, &extra, &[], log.as_deref(), self.separate_users);
        self.nodes[id as usize - 1] = node;
    }

    /// Sends a signal (SIGSTOP/SIGCONT) to a node; a SIGSTOP returns once
    /// every thread of the node is stopped.
    pub fn signal(&mut self, id: u32, signal: i32) {
        process_signal::send(self.node(id).child.id(), signal);
    }

    /// `GET /v1/status` of a node, as JSON.
    pub async fn status(&self, id: u32) -> Option<serde_json::Value> {
        let url = format!("{}/v1/status", self.nodes[id as usize - 1].admin);
        let (code, body) = tokio::time::timeout(Duration::from_secs(2), http_get(&url)).await.ok()?;
        (code == 200).then(|| serde_json::from_str(&body).ok()).flatten()
    }

    /// Waits until node `id`'s own /v1/status says it leads `shard`.
    pub async fn wait_node_leads(&self, id: u32, shard: u32, timeout: Duration) {
        wait_until(&format!("node {id} leading shard {shard}"), timeout, || self.leads(id, shard)).await;
    }

    /// Whether node `id` says it leads `shard` now.
    pub async fn leads(&self, id: u32, shard: u32) -> bool {
        self.status(id).await.is_some_and(|s| {
            s["shards"].as_array().is_some_and(|a| a.iter().any(|e| e["shard_id"] == shard && e["role"] == "leader"))
        })
    }

    /// Waits until coordinator 1 records a leader of `shard` other than
    /// `not` and that node leads it (the record is read again each time: it
    /// moves across a failover); answers the leader.
    pub async fn wait_leader(&mut self, shard: u32, not: Option<u32>, timeout: Duration) -> u32 {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some((leader, _)) = self.leader_of(1, shard).await
                && Some(leader) != not
                && self.leads(leader, shard).await
            {
                return leader;
            }
            assert!(Instant::now() < deadline, "no leader of shard {shard} (other than {not:?}) within {timeout:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Resume anything stopped so the kill in NodeProcess::drop lands.
        for node in &mut self.nodes {
            // SAFETY: kill(2) on a child process this test spawned.
            unsafe { libc::kill(node.child.id() as i32, libc::SIGCONT) };
        }
    }
}

/// Sends `body` verbatim as the protobuf message of the unary RPC at `path`
/// (e.g. `/walship.v1.Log/Append`), to test decoders with malformed bytes.
/// The response comes back as raw bytes.
pub async fn raw_unary(
    channel: tonic::transport::Channel,
    path: &'static str,
    body: &[u8],
) -> Result<bytes::Bytes, tonic::Status> {
    ready(channel)
        .await
        .unary(member_request(bytes::Bytes::copy_from_slice(body)), raw_path(path), raw::RawCodec)
        .await
        .map(tonic::Response::into_inner)
}

/// A request carrying the test clusters' secret (raw calls reach the
/// cluster's own services too; `Log` ignores it).
fn member_request<T>(message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.metadata_mut().insert(walship_shipping::auth::SECRET_HEADER, SECRET.parse().unwrap());
    request
}

/// A generic gRPC client on `channel`, ready to send.
async fn ready(channel: tonic::transport::Channel) -> tonic::client::Grpc<tonic::transport::Channel> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("channel ready");
    grpc
}

fn raw_path(path: &'static str) -> tonic::codegen::http::uri::PathAndQuery {
    tonic::codegen::http::uri::PathAndQuery::from_static(path)
}

/// Sends `body` verbatim as the one message of a streaming RPC at `path`
/// and returns its first answer, none when the stream ended well without
/// one (a `StreamSegments` from a follower's own end: nothing to send), or
/// the status the stream ended with.
pub async fn raw_stream_first(
    channel: tonic::transport::Channel,
    path: &'static str,
    body: &[u8],
) -> Result<Option<bytes::Bytes>, tonic::Status> {
    let messages = tokio_stream::iter(vec![bytes::Bytes::copy_from_slice(body)]);
    let mut answers =
        ready(channel).await.streaming(member_request(messages), raw_path(path), raw::RawCodec).await?.into_inner();
    answers.message().await
}

/// A codec that puts arbitrary bytes on the wire as a request body.
pub mod raw {
    use bytes::{Buf, BufMut, Bytes};
    use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};

    /// Encodes `Bytes` verbatim; decodes the response as its raw bytes.
    #[derive(Debug, Clone, Default)]
    pub struct RawCodec;

    #[derive(Debug)]
    pub struct RawEncoder;

    #[derive(Debug)]
    pub struct RawDecoder;

    impl Codec for RawCodec {
        type Encode = Bytes;
        type Decode = Bytes;
        type Encoder = RawEncoder;
        type Decoder = RawDecoder;

        fn encoder(&mut self) -> RawEncoder {
            RawEncoder
        }

        fn decoder(&mut self) -> RawDecoder {
            RawDecoder
        }
    }

    impl Encoder for RawEncoder {
        type Item = Bytes;
        type Error = tonic::Status;

        fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
            dst.put_slice(&item);
            Ok(())
        }
    }

    impl Decoder for RawDecoder {
        type Item = Bytes;
        type Error = tonic::Status;

        fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, tonic::Status> {
            Ok(Some(src.copy_to_bytes(src.remaining())))
        }
    }
}

/// Every record of `shard` on the node at `grpc`, `1..=to`.
pub async fn read_all(grpc: &str, shard: u32, to: u64) -> Vec<walship_proto::log::Record> {
    read_from(grpc, shard, 1, to).await
}

/// Every record of `shard` from `from` through `to`, read from `grpc`.
pub async fn read_from(grpc: &str, shard: u32, from: u64, to: u64) -> Vec<walship_proto::log::Record> {
    let channel = Endpoint::from_shared(format!("http://{grpc}")).unwrap().connect().await.unwrap();
    let mut log = LogClient::new(channel).max_decoding_message_size(64 << 20);
    let mut out = Vec::new();
    let mut from = from;
    while from <= to {
        let request = walship_proto::log::ReadRequest {
            shard_id: shard,
            from_seqno: from,
            to_seqno: to,
            max_bytes: 0,
            ..Default::default()
        };
        let r = log.read(request).await.unwrap().into_inner();
        from = r.next_seqno;
        out.extend(r.records);
    }
    out
}

/// The whole numbers a message names.
pub fn numbers_in(message: &str) -> Vec<u64> {
    message.split(|c: char| !c.is_ascii_digit()).filter(|s| !s.is_empty()).filter_map(|s| s.parse().ok()).collect()
}

/// Asserts that `result` is a refusal with `code` whose message contains
/// every word (case-insensitive) and names every number; returns the status.
pub fn assert_refused<T: std::fmt::Debug, W: AsRef<str>>(
    what: &str,
    result: Result<T, tonic::Status>,
    code: tonic::Code,
    words: &[W],
    numbers: &[u64],
) -> tonic::Status {
    let status = match result {
        Ok(ok) => panic!("{what}: expected {code:?}, but the server accepted it: {ok:?}"),
        Err(status) => status,
    };
    assert_eq!(status.code(), code, "{what}: wrong status code (message: {:?})", status.message());
    let message = status.message();
    assert!(!message.trim().is_empty(), "{what}: empty status message");
    for word in words {
        let word = word.as_ref();
        assert!(
            message.to_lowercase().contains(&word.to_lowercase()),
            "{what}: message {message:?} does not mention {word:?}"
        );
    }
    let named = numbers_in(message);
    for n in numbers {
        assert!(named.contains(n), "{what}: message {message:?} does not name {n}");
    }
    status
}

/// A `/proc/<pid>/status` memory figure of process `pid` (`VmRSS`,
/// `VmHWM`, ...), in bytes.
pub fn proc_status_bytes(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let prefix = format!("{field}:");
    let line =
        status.lines().find(|l| l.starts_with(&prefix)).unwrap_or_else(|| panic!("{field} in /proc/{pid}/status"));
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

/// Acknowledged appends per shard (seqno → payload): the history load
/// generators record and invariant checks read.
pub type Acked =
    std::sync::Arc<tokio::sync::Mutex<std::collections::BTreeMap<u32, std::collections::BTreeMap<u64, bytes::Bytes>>>>;

/// Appends `payloads` to `shard` as one request and, once acknowledged,
/// records every seqno it was given in `acked`. A seqno acknowledged twice
/// is a broken invariant and panics. Returns the refusal when the append
/// was not acknowledged (its outcome is then unknown to the caller).
pub async fn append_and_record(
    log: &mut LogClient<Channel>,
    shard: u32,
    payloads: Vec<bytes::Bytes>,
    durability: walship_proto::log::Durability,
    timeout: Duration,
    acked: &Acked,
) -> Result<(), tonic::Status> {
    use walship_proto::log::{AppendRecord, AppendRequest};
    let records = payloads.iter().map(|p| AppendRecord { key: bytes::Bytes::new(), payload: p.clone() }).collect();
    let mut request = tonic::Request::new(AppendRequest {
        shard_id: shard,
        records,
        durability: durability as i32,
        ..Default::default()
    });
    request.set_timeout(timeout);
    let response = log.append(request).await?.into_inner();
    let mut acked = acked.lock().await;
    let shard_acked = acked.entry(shard).or_default();
    for (i, payload) in payloads.into_iter().enumerate() {
        let seqno = response.first_seqno + i as u64;
        if let Some(previous) = shard_acked.insert(seqno, payload.clone()) {
            panic!("shard {shard} seqno {seqno} acknowledged twice: {previous:?} then {payload:?}");
        }
    }
    Ok(())
}
