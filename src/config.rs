//! Node configuration: a TOML file, overridden by command-line flags.
//! `ops/node.example.toml` documents every key.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use walship_shipping::LogLimits;

/// A node's configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    pub node_id: u32,
    /// gRPC listen address (Log, and later WalShipping and PeerExchange);
    /// port 0 picks a free port, printed at start.
    #[serde(default = "default_listen")]
    pub grpc_addr: SocketAddr,
    /// Admin HTTP listen address; port 0 picks a free port.
    #[serde(default = "default_listen")]
    pub admin_addr: SocketAddr,
    /// Where the WAL lives (`<data_dir>/wal`).
    pub data_dir: PathBuf,
    /// Shards this node hosts when it runs alone (no cluster config); with a
    /// cluster config the shards come from there.
    #[serde(default)]
    pub shards: Vec<u32>,
    #[serde(default)]
    pub limits: LogLimits,
    #[serde(default)]
    pub wal: WalTuning,
    /// MiB per second the node's DataPlane tasks (verify, export) may read
    /// from its WAL, all together; 0 = unlimited. Default 64.
    #[serde(default = "default_task_read_mib_per_s")]
    pub task_read_mib_per_s: u64,
    /// Serving archived segments to peers (PeerExchange).
    #[serde(default)]
    pub peer_serve: PeerServe,
}

fn default_task_read_mib_per_s() -> u64 {
    walship_dataplane::limiter::DEFAULT_TASK_READ_BYTES_PER_S >> 20
}

/// `[peer_serve]`: how a node serves PeerExchange fetches.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PeerServe {
    /// MiB per second over all fetches (0 = unlimited; default 64), so the
    /// live append path keeps its throughput.
    pub mib_per_s: u64,
    /// Fetches streaming at once (default 16, 1..=1024).
    pub concurrency: usize,
    /// How long a fetch waits for a slot before RESOURCE_EXHAUSTED
    /// (default 10000, at most 600000).
    pub wait_ms: u64,
}

impl Default for PeerServe {
    fn default() -> PeerServe {
        PeerServe { mib_per_s: 64, concurrency: 16, wait_ms: 10_000 }
    }
}

impl PeerServe {
    pub fn settings(&self) -> anyhow::Result<walship_peer::server::ServeSettings> {
        anyhow::ensure!(
            (1..=1024).contains(&self.concurrency),
            "peer_serve.concurrency {} is outside 1..=1024",
            self.concurrency
        );
        anyhow::ensure!(self.wait_ms <= 600_000, "peer_serve.wait_ms {} is above 600000", self.wait_ms);
        Ok(walship_peer::server::ServeSettings {
            max_concurrent: self.concurrency,
            queue_wait: std::time::Duration::from_millis(self.wait_ms),
            bytes_per_s: self.mib_per_s.checked_mul(1 << 20).context("peer_serve.mib_per_s is too large")?,
            chunk_bytes: walship_peer::server::MAX_CHUNK_BYTES,
            ..walship_peer::server::ServeSettings::default()
        })
    }
}

/// WAL tuning (see `walship_wal::WalConfig`).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WalTuning {
    /// Microseconds the WAL's persister may wait for appenders it just woke
    /// before committing a smaller batch (not for a leader's `QUORUM`/`ALL`
    /// appends with followers; see `walship_wal::WalConfig::linger`).
    pub linger_us: u64,
    /// Bytes after which one group commit stops taking appends; appenders
    /// also wait while this much is sequenced and not yet durable.
    pub max_batch_bytes: usize,
    /// raft-engine log file size before rotation.
    pub target_file_bytes: u64,
    /// Bytes of each shard's newest records kept in memory for shippers and
    /// tails, at most.
    pub tail_cache_bytes: usize,
    /// Bytes of newest records the node keeps in memory for all its shards
    /// together: past it, a shard keeps its share (this over the shards
    /// hosted); what the node holds stays under twice this.
    pub tail_cache_total_bytes: usize,
    /// Zero-fill the WAL file appends go to (up to `target_file_bytes` of
    /// zeros, written and synced at start: a fresh node's first file, or a
    /// restarted node's file behind its recovered end), so group commits
    /// overwrite written blocks instead of allocating them; see
    /// `walship_wal::zero_fill`. On by default, as PostgreSQL's
    /// `wal_init_zero`; dev and test clusters turn it off to start fast.
    pub prefill: bool,
    /// With `prefill`: bytes of spare WAL files of zeros, written and synced
    /// before the node serves whenever it has fewer (a fresh node, or one
    /// whose log grew since it started), that rotations take instead of
    /// allocating new files; purged files refill the pool. Rounded down to
    /// the whole files raft-engine lays out. See `walship_wal::zero_fill`.
    pub spare_bytes: u64,
    /// Frame bytes per stored chunk: the WAL keeps one storage entry (and
    /// one index entry in memory) per chunk of a shard's records, so its
    /// memory grows with the log's bytes over this, not with its records;
    /// reading one record reads its chunk. 1 KiB to 16 MiB; default 64 KiB.
    /// See `walship_wal::chunk`.
    pub chunk_bytes: u64,
    /// Bytes of the written shards' unsealed tails (their small chunks not
    /// yet merged) kept in memory for the node, so a merge rewrites them
    /// without reading them back from the log. Memory against CPU: many
    /// shards appended to at once (1,000 at 100 B) need about 32 KiB each;
    /// past the budget a merge takes the tail from the tail cache
    /// (`tail_cache_total_bytes`) when it holds all of it, else reads it
    /// back from the log (up to 7 % of a node's CPU there). 0 ..= 4 GiB;
    /// default 16 MiB.
    /// See `docs/storage.md`, "Memory".
    pub tail_frames_bytes: u64,
    /// Read rate of the background WAL scrubber, which reads and verifies
    /// every shard's retained log, in record bytes per second; 0 disables
    /// it. See `walship_wal::corruption` for the default (8 MiB/s).
    pub scrub_bytes_per_s: u64,
    /// Seconds from the start of one scrub pass to the next (default a day).
    pub scrub_interval_s: u64,
    /// Free-space reserve of the WAL's disk: while the file system under the
    /// data dir has less free than this, the node refuses appends and
    /// replicated segments (`RESOURCE_EXHAUSTED`), hands over leadership and
    /// reports `disk_full`, so the WAL never meets a real `ENOSPC` (which
    /// stops the process). 0 turns the check off. See
    /// `walship_wal::disk_space` and the full-disk runbook.
    pub min_free_bytes: u64,
    /// Frame bytes between a shard's producer snapshots (once producers
    /// write to it): a restart replays at most about this much of the
    /// shard's log to rebuild its producer table, and compaction stops at
    /// a snapshot, so up to this much more than `retain_bytes` may be
    /// kept. 64 KiB ..= 1 GiB; default 16 MiB.
    pub producer_snapshot_bytes: u64,
}

impl Default for WalTuning {
    fn default() -> Self {
        let wal = walship_wal::WalConfig::default();
        let store = walship_wal::EngineStoreConfig::default();
        WalTuning {
            linger_us: wal.linger.as_micros() as u64,
            max_batch_bytes: wal.max_batch_bytes,
            target_file_bytes: store.target_file_bytes,
            tail_cache_bytes: wal.tail_cache_bytes,
            tail_cache_total_bytes: wal.tail_cache_total_bytes,
            prefill: true,
            spare_bytes: walship_wal::DEFAULT_SPARE_BYTES,
            chunk_bytes: store.chunk_bytes,
            tail_frames_bytes: store.tail_frames_bytes as u64,
            scrub_bytes_per_s: wal.scrub_bytes_per_s,
            scrub_interval_s: wal.scrub_interval.as_secs(),
            min_free_bytes: walship_wal::disk_space::DEFAULT_MIN_FREE_BYTES,
            producer_snapshot_bytes: wal.producer_snapshot_bytes,
        }
    }
}

fn default_listen() -> SocketAddr {
    "127.0.0.1:0".parse().expect("valid address")
}

/// The largest `limits.max_record_bytes` a node accepts.
pub const MAX_RECORD_BYTES_LIMIT: usize = 32 << 20;
/// The largest `limits.max_batch_bytes` a node accepts.
pub const MAX_BATCH_BYTES_LIMIT: usize = 1 << 30;
/// The largest `limits.max_read_bytes` a node accepts.
pub const MAX_READ_BYTES_LIMIT: usize = 1 << 30;
/// The largest `limits.max_batch_records` a node accepts.
pub const MAX_BATCH_RECORDS_LIMIT: usize = 10_000_000;

impl NodeConfig {
    pub fn load(path: &Path) -> Result<NodeConfig> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }

    pub fn validate(&self, clustered: bool) -> Result<()> {
        if self.shards.is_empty() && !clustered {
            bail!("a node must host at least one shard (--shards), or take its shards from --cluster");
        }
        if !self.shards.is_empty() && clustered {
            bail!("shards come from the cluster config; do not also give --shards");
        }
        let mut seen = self.shards.clone();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != self.shards.len() {
            bail!("shard list {:?} has duplicates", self.shards);
        }
        let l = &self.limits;
        if l.max_record_bytes == 0 || l.max_batch_records == 0 || l.max_batch_bytes == 0 {
            bail!("limits must be positive");
        }
        // A record travels between nodes in one message (64 MiB at most,
        // headers included) and is stored within one frame.
        if l.max_record_bytes > MAX_RECORD_BYTES_LIMIT {
            bail!(
                "limits.max_record_bytes must be at most {MAX_RECORD_BYTES_LIMIT} (32 MiB: a record must fit in one \
                 shipment between nodes), got {}",
                l.max_record_bytes
            );
        }
        if l.max_batch_bytes > MAX_BATCH_BYTES_LIMIT || l.max_batch_records > MAX_BATCH_RECORDS_LIMIT {
            bail!(
                "limits.max_batch_bytes must be at most {MAX_BATCH_BYTES_LIMIT} (1 GiB) and limits.max_batch_records at \
                 most {MAX_BATCH_RECORDS_LIMIT}, got {} and {}",
                l.max_batch_bytes,
                l.max_batch_records
            );
        }
        if l.max_read_bytes == 0 || l.default_read_bytes == 0 || l.default_read_bytes > l.max_read_bytes {
            bail!(
                "limits.default_read_bytes ({}) must be positive and at most limits.max_read_bytes ({})",
                l.default_read_bytes,
                l.max_read_bytes
            );
        }
        // A read takes room for its whole answer before reading (u32 counts).
        if l.max_read_bytes > MAX_READ_BYTES_LIMIT {
            bail!("limits.max_read_bytes must be at most {MAX_READ_BYTES_LIMIT} (1 GiB), got {}", l.max_read_bytes);
        }
        if l.read_memory_bytes < l.max_read_bytes {
            bail!(
                "limits.read_memory_bytes ({}) must be at least limits.max_read_bytes ({}): the largest read must fit \
                 in the node's read memory budget",
                l.read_memory_bytes,
                l.max_read_bytes
            );
        }
        if !(1 << 10..=16 << 20).contains(&self.wal.chunk_bytes) {
            bail!("wal.chunk_bytes must be between 1024 and 16777216 (16 MiB), got {}", self.wal.chunk_bytes);
        }
        if self.wal.tail_frames_bytes > 4 << 30 {
            bail!("wal.tail_frames_bytes must be at most 4294967296 (4 GiB), got {}", self.wal.tail_frames_bytes);
        }
        if !(64 << 10..=1 << 30).contains(&self.wal.producer_snapshot_bytes) {
            bail!("wal.producer_snapshot_bytes must be within 64 KiB ..= 1 GiB");
        }
        if self.wal.scrub_bytes_per_s > 0 && self.wal.scrub_interval_s == 0 {
            bail!("wal.scrub_interval_s must be positive (or disable the scrubber with wal.scrub_bytes_per_s = 0)");
        }
        Ok(())
    }
}

/// Parses a shard list such as `1,2,5-8`.
pub fn parse_shards(text: &str) -> Result<Vec<u32>> {
    let mut shards = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (u32, u32) = (a.trim().parse()?, b.trim().parse()?);
                if a > b {
                    bail!("bad shard range {part}");
                }
                shards.extend(a..=b);
            }
            None => shards.push(part.parse().with_context(|| format!("bad shard id {part:?}"))?),
        }
    }
    Ok(shards)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_lists() {
        assert_eq!(parse_shards("1,2,5-7").unwrap(), vec![1, 2, 5, 6, 7]);
        assert!(parse_shards("3-1").is_err());
        assert!(parse_shards("x").is_err());
    }

    #[test]
    fn example_config_parses() {
        let text = include_str!("../ops/node.example.toml");
        let config: NodeConfig = toml::from_str(text).unwrap();
        config.validate(false).unwrap();
    }

    #[test]
    fn a_tail_frames_budget_past_4_gib_is_refused() {
        let config = |bytes: u64| {
            let text = format!("node_id = 1\ndata_dir = \"x\"\nshards = [1]\n[wal]\ntail_frames_bytes = {bytes}\n");
            toml::from_str::<NodeConfig>(&text).unwrap().validate(false)
        };
        let err = config((4 << 30) + 1).unwrap_err().to_string();
        assert!(err.contains("wal.tail_frames_bytes") && err.contains("4294967297"), "{err}");
        config(0).unwrap();
        config(4 << 30).unwrap();
    }

    #[test]
    fn chunk_sizes_outside_the_range_are_refused() {
        let config = |chunk_bytes: u64| {
            let text = format!("node_id = 1\ndata_dir = \"x\"\nshards = [1]\n[wal]\nchunk_bytes = {chunk_bytes}\n");
            toml::from_str::<NodeConfig>(&text).unwrap().validate(false)
        };
        for bad in [0, 1023, (16 << 20) + 1] {
            let err = config(bad).unwrap_err().to_string();
            assert!(err.contains("wal.chunk_bytes") && err.contains(&bad.to_string()), "{err}");
        }
        config(1024).unwrap();
        config(16 << 20).unwrap();
    }

    #[test]
    fn the_task_read_budget_defaults_to_64_mib_per_s() {
        let config = |extra: &str| {
            toml::from_str::<NodeConfig>(&format!("node_id = 1\ndata_dir = \"x\"\nshards = [1]\n{extra}")).unwrap()
        };
        assert_eq!(config("").task_read_mib_per_s, 64);
        assert_eq!(config("task_read_mib_per_s = 0\n").task_read_mib_per_s, 0);
    }

    #[test]
    fn unknown_keys_are_refused() {
        let err = toml::from_str::<NodeConfig>("node_id = 1\ndata_dir = \"x\"\nshards = [1]\nbogus = 2\n");
        assert!(err.is_err());
    }
}
