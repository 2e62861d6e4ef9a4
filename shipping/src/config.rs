//! The cluster configuration: nodes, shards with their replica sets and
//! initial leaders, and replication tuning. One TOML file, the same on every
//! node (`ops/cluster.example.toml` documents every key).
//!
//! Leadership is static in this file: the failover issue moves it into the
//! coordinator's KV. The epoch is carried everywhere already.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use crate::auth::{ClusterSecret, MIN_SECRET_LEN, SECRET_ENV};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::NodeId;

/// `host:port`, the host an IP address or a DNS name (Kubernetes service
/// names, say). Peers dial it; a process binds it (resolved) unless its
/// `--grpc`/`--admin` flags say where to listen.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Address(String);

impl TryFrom<String> for Address {
    type Error = String;

    fn try_from(text: String) -> Result<Address, String> {
        let (host, port) = text.rsplit_once(':').ok_or_else(|| format!("address {text:?} is not host:port"))?;
        port.parse::<u16>().map_err(|_| format!("address {text:?} has no valid port"))?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() || host.contains(char::is_whitespace) {
            return Err(format!("address {text:?} has no valid host"));
        }
        Ok(Address(text))
    }
}

impl From<Address> for String {
    fn from(a: Address) -> String {
        a.0
    }
}

impl From<SocketAddr> for Address {
    fn from(a: SocketAddr) -> Address {
        Address(a.to_string())
    }
}

impl std::fmt::Display for Address {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for Address {
    type Err = String;

    fn from_str(s: &str) -> Result<Address, String> {
        Address::try_from(s.to_string())
    }
}

impl Address {
    pub fn port(&self) -> u16 {
        self.0.rsplit_once(':').and_then(|(_, p)| p.parse().ok()).unwrap_or(0)
    }

    /// The first socket address the name resolves to (for binding).
    pub fn resolve(&self) -> std::io::Result<SocketAddr> {
        use std::net::ToSocketAddrs;
        self.0.to_socket_addrs()?.next().ok_or_else(|| std::io::Error::other(format!("{} resolves to nothing", self.0)))
    }
}

/// A node of the cluster.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct NodeSpec {
    pub id: NodeId,
    /// gRPC address peers and clients dial (Log, WalShipping).
    pub grpc_addr: Address,
    /// Admin HTTP address.
    pub admin_addr: Address,
    /// Failure domain (zone or region); `region_id` on the wire.
    #[serde(default)]
    pub region: u32,
}

/// A shard: who holds replicas and who leads.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ShardSpec {
    pub id: u32,
    /// Node ids holding a replica (the leader included).
    pub replicas: Vec<NodeId>,
    /// The initial leader.
    pub leader: NodeId,
    /// The leader's epoch (static until failover exists).
    #[serde(default = "one")]
    pub epoch: u64,
}

fn one() -> u64 {
    1
}

/// Replication tuning; defaults suit loopback tests and `walship dev`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ReplicationConfig {
    /// ShipSegment requests in flight per follower.
    pub ship_window: usize,
    /// Largest segment payload per ShipSegment / stream chunk.
    pub ship_batch_bytes: usize,
    /// Deadline of one ShipSegment RPC.
    pub ship_timeout_ms: u64,
    /// An idle leader sends keepalives this often, so a caught-up follower
    /// reports zero lag rather than a stale one.
    pub keepalive_ms: u64,
    /// A follower more than this many bytes behind is switched from push to
    /// pull (StreamSegments catch-up).
    pub catchup_threshold_bytes: u64,
    /// Bytes per second one node serves to catch-up streams, all of them
    /// together, so catch-up cannot starve live appends; a follower's
    /// re-seed from peers or the object store takes from the same budget.
    pub catchup_rate_bytes_per_s: u64,
    /// How long a follower holds an out-of-order segment waiting for the one
    /// before it (windowed ships can overtake each other) before calling it
    /// a gap.
    pub reorder_wait_ms: u64,
    /// Bytes of WAL each replica keeps for readers, per shard.
    pub retain_bytes: u64,
    /// Hard bound per shard: past it the leader discards WAL a lagging
    /// follower still needs and marks that follower as needing re-seed.
    pub max_retain_bytes: u64,
    /// How often retention runs.
    pub retention_interval_ms: u64,
    /// How often a node sends Heartbeat.
    pub heartbeat_ms: u64,
    /// How often, at least, a node's heartbeat carries every replica's
    /// report (between them only changed reports go; longer at thousands
    /// of shards, see docs/replication.md "Heartbeats and status"). What a
    /// report leaves out of its comparison, and what a settled or dormant
    /// replica would report without anything happening to it, is never
    /// older than this.
    pub full_report_ms: u64,
    /// Where heartbeats go besides every coordinator (e.g. a node's gRPC
    /// address in a static cluster); none = coordinators only.
    pub heartbeat_to: Option<SocketAddr>,
    /// Coordinator: a leader whose heartbeats stop for this long is lost and
    /// its shards fail over (defaults tuned for loopback).
    pub leader_timeout_ms: u64,
    /// Coordinator: the active coordinator's lease; a standby takes over
    /// this long after the active one stops renewing.
    pub coordinator_lease_ms: u64,
    /// Coordinator: the fewest voting replicas a shard may be left with by
    /// `walship replica remove` (a replace never lowers the count).
    pub min_replicas: usize,
    /// Idle shards go quiet: a follower holding everything gets no
    /// per-shard keepalives, one node-level keepalive per peer node stands
    /// in for all of them (ops/README "Many shards"). Off: every shard
    /// keeps its own keepalives (the behaviour before quiet shards).
    pub quiesce: bool,
    /// Metrics with a `shard` label get one series per shard; false: one
    /// per follower with `shard="all"` (worst lag, shards per mode), so a
    /// scrape of a node with thousands of shards stays small.
    pub per_shard_metrics: bool,
    /// Drills: a paused follower resumes by itself this long after the
    /// last pause call (the drill renews it every sixth of it), so a
    /// drill whose coordinator dies cannot leave it paused for good.
    pub pause_lease_ms: u64,
    /// Coordinator: how often it checks whether some node leads more than
    /// its share of the shards (after a failover, say) and moves
    /// leaderships to the nodes leading less (ops/README "Leadership
    /// rebalancing"); 0: never on its own (`walship rebalance` still does).
    pub rebalance_interval_ms: u64,
    /// Coordinator: a node's leaderships past its fair share that start an
    /// automatic rebalance, in percent of the share (at least one shard).
    pub rebalance_slack_percent: u64,
}

impl Default for ReplicationConfig {
    fn default() -> Self {
        ReplicationConfig {
            ship_window: 8,
            ship_batch_bytes: 1 << 20,
            ship_timeout_ms: 5_000,
            keepalive_ms: 200,
            catchup_threshold_bytes: 64 << 20,
            catchup_rate_bytes_per_s: 256 << 20,
            reorder_wait_ms: 500,
            retain_bytes: 1 << 30,
            max_retain_bytes: 4 << 30,
            retention_interval_ms: 5_000,
            heartbeat_ms: 50,
            full_report_ms: 2_000,
            heartbeat_to: None,
            leader_timeout_ms: 200,
            coordinator_lease_ms: 2_000,
            min_replicas: 3,
            quiesce: true,
            per_shard_metrics: true,
            pause_lease_ms: 60_000,
            rebalance_interval_ms: 300_000,
            rebalance_slack_percent: 10,
        }
    }
}

impl ReplicationConfig {
    pub fn keepalive(&self) -> Duration {
        Duration::from_millis(self.keepalive_ms)
    }

    /// How long replication may be silent before it counts as broken: a
    /// leader that heard from no majority of its replicas for this long
    /// stops acknowledging and steps down (its lease), and a majority of
    /// followers that heard nothing from their leader for this long makes
    /// the coordinator fail the shard over. `leader_timeout_ms`, but at least
    /// three keepalive intervals, so an idle shard's keepalives always renew
    /// it in time.
    pub fn replication_timeout(&self) -> Duration {
        Duration::from_millis(self.leader_timeout_ms.max(3 * self.keepalive_ms))
    }
}

/// A coordinator (`walship coord`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct CoordinatorSpec {
    pub id: String,
    /// gRPC address nodes send heartbeats to.
    pub grpc_addr: Address,
    /// Admin HTTP address (cluster API and dashboard).
    pub admin_addr: Address,
}

/// The whole cluster.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    #[serde(default = "default_cluster_id")]
    pub cluster_id: String,
    /// Coordinators. With none, leadership is static (the shards' `leader`
    /// and `epoch` below); with some, the active coordinator owns it and the
    /// shards' `leader` is only the initial assignment.
    #[serde(default)]
    pub coordinators: Vec<CoordinatorSpec>,
    pub nodes: Vec<NodeSpec>,
    pub shards: Vec<ShardSpec>,
    #[serde(default)]
    pub replication: ReplicationConfig,
    /// The secret every cluster RPC (`WalShipping`, `Control`, node to
    /// coordinator heartbeats) carries; see [`crate::auth`]. Set here, in
    /// `secret_file`, or in `WALSHIP_CLUSTER_SECRET` (which wins).
    /// Never serialized: [`ClusterConfig::save`] writes it to its own file.
    #[serde(default, skip_serializing)]
    pub secret: Option<ClusterSecret>,
    /// A file holding the secret (its surrounding whitespace ignored);
    /// relative paths are relative to the config file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_file: Option<PathBuf>,
    /// Runs the cluster RPCs without authentication. Anyone who reaches a
    /// node's gRPC port can then fence or reassign its shards: only for a
    /// network nobody else can reach.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub insecure_no_auth: bool,
    /// TLS on every listener and every call between members; see [`TlsConfig`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<TlsConfig>,
    /// The object store sealed segments are archived to; none: no archive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub archive: Option<ArchiveConfig>,
    /// How many producer sessions each shard remembers, and for how long.
    #[serde(default)]
    pub producers: crate::producer_config::ProducerConfig,
}

/// `[archive]`: where each shard's leader uploads sealed segments of its
/// committed records (see `walship_shipping::archive`).
///
/// ```toml
/// [archive]
/// store = "dir"            # a directory (the embedded default of `walship dev`)
/// dir = "archive"          # relative to this file
///
/// [archive]
/// store = "s3"             # any S3-compatible service
/// bucket = "walship-prod"
/// prefix = "eu-1"          # optional key prefix
/// endpoint = "https://10.0.0.20:9000"   # optional; omit for AWS itself
/// region = "eu-central-1"
/// path_style = false       # true for most self-hosted servers
/// ```
///
/// Both also take `segment_bytes` (seal a segment once this many bytes of
/// committed records wait; default 64 MiB), `segment_age_ms` (... or once the
/// oldest waiting record is this old; default 5 s), `uploads` (segments of
/// a shard uploading at once, default 4, 1..=32: a shard's archiving holds
/// at most `uploads × segment_bytes` in memory; the archived seqno still
/// only moves in order, over the segments all uploaded), `archiver`
/// (`"leader"`, the default, or `"follower"`: the leader chooses a caught-up
/// follower, the lowest node id among those it pushes to live, keeps it
/// while it stays caught up, and archives itself while none is; the
/// follower archives from its own WAL, sparing the leader's disk and
/// network) and `scrub_interval_ms`
/// (default 600000, 10 min; 1000..=86400000): how often each shard's leader
/// reads its archived segments back, one at a time, checking each whole
/// (checksums, every record's crc, its name's shard and range); a damaged
/// or missing one is uploaded again from the leader's WAL when it still
/// holds those records, else reported as unrepairable (`/v1/status`,
/// `walship_archive_damaged_objects_total`). A pass reads the whole
/// archive of the shard: on a large archive in a metered store, choose a
/// longer interval.
///
/// S3 credentials come from the standard AWS chain (`AWS_ACCESS_KEY_ID` /
/// `AWS_SECRET_ACCESS_KEY`, a profile, an instance role), never from this
/// file.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ArchiveConfig {
    /// `dir` or `s3`.
    pub store: ArchiveStoreKind,
    /// `dir`: the directory (relative paths are relative to the config file).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dir: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bucket: Option<String>,
    /// A key prefix every object of the cluster goes under.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    #[serde(default)]
    pub path_style: bool,
    /// Seal a segment once this many bytes of committed records wait
    /// (default 64 MiB).
    #[serde(default = "default_segment_bytes")]
    pub segment_bytes: u64,
    /// ... or once the oldest waiting record is this old (default 5 s: the
    /// archive lags a quiet shard by at most about this plus an upload).
    #[serde(default = "default_segment_age_ms")]
    pub segment_age_ms: u64,
    /// How often the leader reads its archived segments back to find
    /// damaged ones (see above).
    #[serde(default = "default_scrub_interval_ms")]
    pub scrub_interval_ms: u64,
    /// Segments of one shard uploading at once (see above).
    #[serde(default = "default_uploads")]
    pub uploads: usize,
    /// Which replica archives each shard (see above).
    #[serde(default)]
    pub archiver: ArchiverChoice,
}

/// Which replica of a shard archives it.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ArchiverChoice {
    #[default]
    Leader,
    Follower,
}

fn default_uploads() -> usize {
    4
}

/// Which object store `[archive]` names.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ArchiveStoreKind {
    Dir,
    S3,
}

/// The archive's `segment_bytes` when the config leaves it out.
pub const DEFAULT_SEGMENT_BYTES: u64 = 64 << 20;

fn default_segment_bytes() -> u64 {
    DEFAULT_SEGMENT_BYTES
}

fn default_segment_age_ms() -> u64 {
    5_000
}

fn default_scrub_interval_ms() -> u64 {
    600_000
}

impl ArchiveConfig {
    /// A directory store at `dir`.
    pub fn dir(dir: PathBuf) -> ArchiveConfig {
        ArchiveConfig {
            store: ArchiveStoreKind::Dir,
            dir: Some(dir),
            bucket: None,
            prefix: None,
            endpoint: None,
            region: None,
            path_style: false,
            segment_bytes: default_segment_bytes(),
            segment_age_ms: default_segment_age_ms(),
            scrub_interval_ms: default_scrub_interval_ms(),
            uploads: default_uploads(),
            archiver: ArchiverChoice::Leader,
        }
    }

    fn validate(&self) -> Result<(), String> {
        match self.store {
            ArchiveStoreKind::Dir if self.dir.is_none() => return Err("store = \"dir\" needs `dir`".into()),
            ArchiveStoreKind::S3 if self.bucket.as_deref().is_none_or(str::is_empty) => {
                return Err("store = \"s3\" needs `bucket`".into());
            }
            _ => {}
        }
        if let Some(prefix) = &self.prefix {
            crate::archive::ArchiveLayout::new(Some(prefix)).map_err(|e| format!("prefix: {e}"))?;
        }
        if !(1 << 10..=1 << 30).contains(&self.segment_bytes) {
            return Err(format!("segment_bytes {} is outside 1 KiB..=1 GiB", self.segment_bytes));
        }
        if !(10..=3_600_000).contains(&self.segment_age_ms) {
            return Err(format!("segment_age_ms {} is outside 10..=3600000", self.segment_age_ms));
        }
        if !(1..=32).contains(&self.uploads) {
            return Err(format!("uploads {} is outside 1..=32", self.uploads));
        }
        if !(1_000..=86_400_000).contains(&self.scrub_interval_ms) {
            return Err(format!(
                "scrub_interval_ms {} is outside 1000..=86400000 (1 s to a day)",
                self.scrub_interval_ms
            ));
        }
        Ok(())
    }
}

/// TLS for a cluster: every gRPC and admin listener of its nodes and
/// coordinators serves TLS with `cert`/`key`, and members dial each other
/// over TLS, trusting `ca`. Paths are relative to the cluster config; a
/// process's `--tls-cert`/`--tls-key` (or `WALSHIP_TLS_CERT`/`_KEY`) name
/// its own pair instead. Servers reload the pair on SIGHUP and when the
/// files change.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM: the certificate authority members' certificates are signed by.
    pub ca: PathBuf,
    /// PEM: this process's certificate chain (server and, for mutual TLS,
    /// client authentication).
    pub cert: PathBuf,
    /// PEM: the private key of `cert`.
    pub key: PathBuf,
    /// Mutual TLS on the gRPC listeners: a connection without a certificate
    /// signed by `ca` is refused in the handshake (clients of `Log` then
    /// need one too: `walship append --cert/--key`). Admin HTTP listeners
    /// serve TLS without asking for one (browsers, bearer tokens).
    #[serde(default)]
    pub require_client_cert: bool,
}

impl TlsConfig {
    /// Makes relative paths relative to `base` (the config file's directory).
    pub fn rebase(&mut self, base: &Path) {
        for path in [&mut self.ca, &mut self.cert, &mut self.key] {
            if path.is_relative() {
                *path = base.join(&*path);
            }
        }
    }

    /// Reads the three PEM files (checked for at least one PEM block each).
    pub fn read(&self) -> Result<TlsPems, ConfigError> {
        let read = |path: &Path| {
            let bytes =
                std::fs::read(path).map_err(|source| ConfigError::Read { path: path.display().to_string(), source })?;
            if !bytes.windows(11).any(|w| w == b"-----BEGIN ") {
                return Err(ConfigError::Invalid(format!("tls: {} holds no PEM block", path.display())));
            }
            Ok(bytes)
        };
        Ok(TlsPems { ca: read(&self.ca)?, cert: read(&self.cert)?, key: read(&self.key)? })
    }
}

/// The PEM contents of a [`TlsConfig`]'s files.
#[derive(Clone)]
pub struct TlsPems {
    pub ca: Vec<u8>,
    pub cert: Vec<u8>,
    pub key: Vec<u8>,
}

impl std::fmt::Debug for TlsPems {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsPems(<redacted>)")
    }
}

/// Writes `text` to a new file only its owner may read (replacing any
/// file at `path`), and syncs it: secrets, keys, tokens.
pub fn write_private(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let _ = std::fs::remove_file(path);
    let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
    file.write_all(text.as_bytes())?;
    file.sync_all()
}

fn default_cluster_id() -> String {
    "walship".into()
}

/// Why a cluster configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("parsing {path}: {source}")]
    Parse { path: String, source: toml::de::Error },
    #[error("invalid cluster config: {0}")]
    Invalid(String),
}

impl ClusterConfig {
    pub fn load(path: &Path) -> Result<ClusterConfig, ConfigError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: shown.clone(), source })?;
        let mut config: ClusterConfig =
            toml::from_str(&text).map_err(|source| ConfigError::Parse { path: shown, source })?;
        let base = path.parent().unwrap_or(Path::new("."));
        config.resolve_secret(base, std::env::var(SECRET_ENV).ok())?;
        if let Some(tls) = &mut config.tls {
            tls.rebase(base);
        }
        if let Some(dir) = config.archive.as_mut().and_then(|a| a.dir.as_mut())
            && dir.is_relative()
        {
            *dir = base.join(&*dir);
        }
        config.validate()?;
        Ok(config)
    }

    /// Settles the cluster secret: `env` (the value of
    /// `WALSHIP_CLUSTER_SECRET`) wins over `secret`, which wins over
    /// `secret_file` (read relative to `base`). A cluster without one is
    /// refused unless `insecure_no_auth` says so.
    pub fn resolve_secret(&mut self, base: &Path, env: Option<String>) -> Result<(), ConfigError> {
        let invalid = |what: &str, e: crate::auth::SecretError| ConfigError::Invalid(format!("{what}: {e}"));
        if let Some(env) = env.filter(|e| !e.is_empty()) {
            self.secret = Some(ClusterSecret::new(&env).map_err(|e| invalid(SECRET_ENV, e))?);
        } else if self.secret.is_none()
            && let Some(file) = &self.secret_file
        {
            let file = base.join(file);
            let text = std::fs::read_to_string(&file)
                .map_err(|source| ConfigError::Read { path: file.display().to_string(), source })?;
            self.secret = Some(ClusterSecret::new(&text).map_err(|e| invalid(&file.display().to_string(), e))?);
        }
        if self.secret.is_none() && !self.insecure_no_auth {
            return Err(ConfigError::Invalid(format!(
                "no cluster secret: set `secret` or `secret_file` in the cluster config, or {SECRET_ENV} \
                 (at least {MIN_SECRET_LEN} characters; e.g. `openssl rand -hex 16`), or accept an \
                 unauthenticated cluster with `insecure_no_auth = true`"
            )));
        }
        Ok(())
    }

    /// Writes this config to `path` as TOML for other processes to load.
    /// Its secret goes to `<path>.secret` (mode 0600), which the written
    /// config names as its `secret_file`: never into the config itself.
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        let mut written = self.clone();
        if let Some(secret) = &self.secret {
            let name = format!("{}.secret", path.file_name().and_then(|n| n.to_str()).unwrap_or("cluster.toml"));
            let file = path.with_file_name(&name);
            write_private(&file, secret.expose())?;
            written.secret_file = Some(PathBuf::from(name));
        }
        let text = toml::to_string_pretty(&written).map_err(std::io::Error::other)?;
        std::fs::write(path, text)
    }

    /// The secret cluster RPCs carry, if the cluster has one.
    pub fn secret(&self) -> Option<&ClusterSecret> {
        self.secret.as_ref()
    }

    /// A one-node cluster: every shard has this node as its only replica.
    pub fn single_node(node: NodeSpec, shards: &[u32]) -> ClusterConfig {
        let id = node.id;
        ClusterConfig {
            cluster_id: default_cluster_id(),
            coordinators: Vec::new(),
            nodes: vec![node],
            shards: shards.iter().map(|&s| ShardSpec { id: s, replicas: vec![id], leader: id, epoch: 1 }).collect(),
            replication: ReplicationConfig::default(),
            // Nobody else is a member: a random secret nobody holds keeps
            // its cluster RPCs closed.
            secret: Some(ClusterSecret::random()),
            secret_file: None,
            insecure_no_auth: false,
            tls: None,
            archive: None,
            producers: Default::default(),
        }
    }

    /// Every shard `1..=shards` replicated on every node, leadership static,
    /// shard i led by node ((i-1) mod n)+1 so leaders spread over the nodes.
    pub fn replicated_everywhere(nodes: Vec<NodeSpec>, shards: u32) -> ClusterConfig {
        let replicas: Vec<u32> = nodes.iter().map(|n| n.id).collect();
        let shards = (1..=shards)
            .map(|id| ShardSpec {
                id,
                replicas: replicas.clone(),
                leader: replicas[(id as usize - 1) % replicas.len()],
                epoch: 1,
            })
            .collect();
        ClusterConfig {
            cluster_id: default_cluster_id(),
            coordinators: Vec::new(),
            nodes,
            shards,
            replication: ReplicationConfig::default(),
            secret: Some(ClusterSecret::random()),
            secret_file: None,
            insecure_no_auth: false,
            tls: None,
            archive: None,
            producers: Default::default(),
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if let Some(archive) = &self.archive {
            archive.validate().map_err(|e| ConfigError::Invalid(format!("[archive]: {e}")))?;
        }
        self.producers.validate().map_err(|e| ConfigError::Invalid(format!("[producers]: {e}")))?;
        if !(1..=64).contains(&self.replication.min_replicas) {
            return bad(format!("[replication] min_replicas {} is outside 1..=64", self.replication.min_replicas));
        }
        let mut ids = BTreeSet::new();
        let mut addrs = BTreeSet::new();
        for node in &self.nodes {
            if !ids.insert(node.id) {
                return bad(format!("node id {} appears twice", node.id));
            }
            for addr in [&node.grpc_addr, &node.admin_addr] {
                if addr.port() != 0 && !addrs.insert(addr.clone()) {
                    return bad(format!("address {addr} is used twice"));
                }
            }
        }
        if self.shards.is_empty() {
            return bad("no shards".into());
        }
        let mut shard_ids = BTreeSet::new();
        for shard in &self.shards {
            if !shard_ids.insert(shard.id) {
                return bad(format!("shard {} appears twice", shard.id));
            }
            let replicas: BTreeSet<_> = shard.replicas.iter().collect();
            if replicas.len() != shard.replicas.len() || replicas.is_empty() {
                return bad(format!(
                    "shard {}: replicas {:?} must be distinct and non-empty",
                    shard.id, shard.replicas
                ));
            }
            if let Some(unknown) = shard.replicas.iter().find(|r| !ids.contains(r)) {
                return bad(format!("shard {}: replica {unknown} is not a configured node", shard.id));
            }
            if !shard.replicas.contains(&shard.leader) {
                return bad(format!("shard {}: leader {} is not one of its replicas", shard.id, shard.leader));
            }
            if shard.epoch == 0 {
                return bad(format!("shard {}: epochs start at 1", shard.id));
            }
        }
        let r = &self.replication;
        if r.ship_window == 0 || r.ship_batch_bytes == 0 || r.keepalive_ms == 0 || r.heartbeat_ms == 0 {
            return bad(
                "replication: ship_window, ship_batch_bytes, keepalive_ms and heartbeat_ms must be positive".into()
            );
        }
        if !(r.heartbeat_ms..=3_600_000).contains(&r.full_report_ms) {
            return bad(format!(
                "replication: full_report_ms must be within heartbeat_ms ({}) ..= 3600000 (an hour), got {}",
                r.heartbeat_ms, r.full_report_ms
            ));
        }
        if !(600..=86_400_000).contains(&r.pause_lease_ms) {
            return bad(format!(
                "replication: pause_lease_ms must be within 600 ..= 86400000 (a day), got {}",
                r.pause_lease_ms
            ));
        }
        if r.max_retain_bytes < r.retain_bytes {
            return bad("replication: max_retain_bytes must be >= retain_bytes".into());
        }
        Ok(())
    }

    /// Leadership comes from a coordinator rather than this file.
    pub fn coordinated(&self) -> bool {
        !self.coordinators.is_empty()
    }

    pub fn node(&self, id: NodeId) -> Option<&NodeSpec> {
        self.nodes.iter().find(|n| n.id == id)
    }

    /// Shards whose replicas span fewer regions than they could: a shard
    /// of k replicas in a cluster of R regions should span min(k, R), or
    /// losing one region can take its majority. Replica changes keep the
    /// spread (`control/coordinator/members.rs`); a hand-written config
    /// may not, so the coordinator warns at start. `(shard, regions it
    /// spans, regions it could span)`, in shard order.
    pub fn unspread_shards(&self) -> Vec<(u32, usize, usize)> {
        let region: BTreeMap<NodeId, u32> = self.nodes.iter().map(|n| (n.id, n.region)).collect();
        let regions = region.values().collect::<BTreeSet<_>>().len();
        self.shards
            .iter()
            .filter_map(|s| {
                let spans = s.replicas.iter().filter_map(|r| region.get(r)).collect::<BTreeSet<_>>().len();
                let could = s.replicas.len().min(regions);
                (spans < could).then_some((s.id, spans, could))
            })
            .collect()
    }

    /// The shards `node` holds a replica of.
    pub fn shards_of(&self, node: NodeId) -> Vec<&ShardSpec> {
        self.shards.iter().filter(|s| s.replicas.contains(&node)).collect()
    }

    /// Node id -> gRPC address.
    pub fn addresses(&self) -> BTreeMap<NodeId, Address> {
        self.nodes.iter().map(|n| (n.id, n.grpc_addr.clone())).collect()
    }
}

#[cfg(test)]
#[path = "config_test.rs"]
mod tests;
