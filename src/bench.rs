//! `walship bench`: append throughput and latency, printed beside this
//! machine's raw disk limits measured in the same run.
//!
//! Paths measured over the same matrix (record sizes x concurrent appenders
//! x shards), each appender issuing one single-record append at a time;
//! appender i writes shards i, i + appenders, i + 2 x appenders, ... in
//! turn, so with more shards than appenders every shard is written (the
//! appenders share a few connections per node):
//! * `wal`: the node's WAL in process (group commit on raft-engine, no
//!   network) — what the storage path can do;
//! * `local`: one `walship node` child process over loopback gRPC at `local`
//!   durability — what a client of a single node sees;
//! * `quorum`, `all`: three `walship node` processes (RF=3, leaders spread
//!   over the nodes, appenders sending to each shard's leader, following
//!   `walship-leader` hints when one moves) at `quorum` and `all`
//!   durability. All three replicas write to the same disk here,
//!   so the disk ratio counts three copies of every byte.
//!
//! The three-node paths run with a `walship coord` by default, as production
//! does, so leaders ship each batch while their own fsync runs;
//! `--leadership static` takes the leaders from the config instead (they
//! ship durable records only).
//!
//! The gRPC paths append through `Log.AppendStream` by default (each
//! connection's appenders pipelined over one stream, as a client with many
//! appends in flight should); `--transport unary` sends one `Append` call per
//! append instead.
//!
//! The raw baseline is a 4 KiB write + fdatasync loop (latency) and 1 MiB
//! sequential writes with an fdatasync every 8 MiB (bandwidth), on the same
//! filesystem as the WAL. Figures on shared machines swing several-fold
//! between runs, so every result is also printed as a ratio to the baseline.
//! Nothing here asserts a speed: it prints figures.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use clap::{Args, ValueEnum};
use serde::Serialize;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use walship_loadgen::Measured;
use walship_proto::log::log_client::LogClient;
use walship_proto::log::{AppendRecord, AppendRequest, Durability};
use walship_proto::pipeline::AppendPipeline;
use walship_wal::{EngineStore, NewRecord, Wal, WalConfig, WalMetrics};

use crate::bench_target::single_node;
pub(crate) use crate::bench_target::{BENCH_ADMIN_TOKEN, Target, three_nodes};

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum BenchPath {
    Wal,
    Local,
    Quorum,
    /// `quorum` with TLS on every connection (mutual between members and
    /// from the appenders): its throughput ÷ `quorum`'s is TLS's cost.
    QuorumTls,
    /// `quorum` with `[archive]` on (a directory store on the same disk):
    /// its throughput ÷ `quorum`'s is what archiving costs live appends, and
    /// the cell reports the archive's upload rate and its lag at the end.
    QuorumArchive,
    /// `quorum-archive` with `archiver = "follower"`: a caught-up follower
    /// uploads instead of the leader.
    QuorumArchiveFollower,
    All,
}

impl BenchPath {
    fn name(self) -> &'static str {
        match self {
            BenchPath::Wal => "wal",
            BenchPath::Local => "local",
            BenchPath::Quorum => "rf3-quorum",
            BenchPath::QuorumTls => "rf3-quorum-tls",
            BenchPath::QuorumArchive => "rf3-quorum-archive",
            BenchPath::QuorumArchiveFollower => "rf3-quorum-archive-follower",
            BenchPath::All => "rf3-all",
        }
    }

    /// Copies of every record the one disk writes.
    fn copies(self) -> f64 {
        match self {
            BenchPath::Wal | BenchPath::Local => 1.0,
            BenchPath::Quorum | BenchPath::QuorumTls | BenchPath::All => 3.0,
            // The leader's archive writes a fourth copy to the same disk.
            BenchPath::QuorumArchive | BenchPath::QuorumArchiveFollower => 4.0,
        }
    }
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Directory for the baseline files and WAL data (same disk as a real node's).
    #[arg(long, default_value = ".walship/bench")]
    dir: PathBuf,
    /// Which paths to measure.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "wal,local,quorum,all")]
    paths: Vec<BenchPath>,
    /// Record payload sizes in bytes.
    #[arg(long, value_delimiter = ',', default_value = "100,1024,16384")]
    sizes: Vec<usize>,
    /// Concurrent appenders.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,256")]
    appenders: Vec<usize>,
    /// Shard counts.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    shards: Vec<u32>,
    /// Measured seconds per cell.
    #[arg(long, default_value_t = 3.0)]
    duration: f64,
    /// Warm-up seconds per cell (not measured).
    #[arg(long, default_value_t = 0.5)]
    warmup: f64,
    /// How the appenders reach a node: `stream` pipelines them over one
    /// `AppendStream` per connection, `unary` sends one `Append` call each.
    #[arg(long, value_enum, default_value = "stream")]
    transport: Transport,
    /// How the three-node paths (`quorum`, `all`) are led: `coordinated`
    /// starts a `walship coord` as production runs (leaders ship while their
    /// own fsync runs), `static` takes leaders from the config (they ship
    /// durable records only).
    #[arg(long, value_enum, default_value = "coordinated")]
    leadership: Leadership,
    /// Bytes of spare WAL files of zeros each cell's fresh nodes (and the
    /// `wal` path's store) lay out before serving (`wal.spare_bytes`). The
    /// default, four 128 MiB files, keeps a default cell (3.5 s at the
    /// ~180 MiB/s a node's log grows at 4 KiB × 64) on zeros without
    /// writing a node's 2 GiB default at every cell's start.
    #[arg(long, default_value_t = 512 << 20)]
    wal_spare_bytes: u64,
    /// Also write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Who assigns the three-node paths' leaders.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Leadership {
    Coordinated,
    Static,
}

/// The client API the gRPC paths append through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Transport {
    Stream,
    Unary,
}

/// One connection to a leader, as the chosen transport uses it.
#[derive(Clone)]
pub(crate) enum Connection {
    Stream(Arc<AppendPipeline>),
    Unary(LogClient<Channel>),
}

impl Connection {
    pub(crate) async fn open(leader: &str, transport: Transport, tls: Option<&ClientTlsConfig>) -> Result<Connection> {
        let endpoint = match tls {
            Some(tls) => Endpoint::from_shared(format!("https://{leader}"))?.tls_config(tls.clone())?,
            None => Endpoint::from_shared(format!("http://{leader}"))?,
        };
        let channel: Channel = endpoint.tcp_nodelay(true).connect().await?;
        let client = LogClient::new(channel);
        Ok(match transport {
            Transport::Stream => Connection::Stream(Arc::new(AppendPipeline::open(client).await?)),
            Transport::Unary => Connection::Unary(client),
        })
    }

    pub(crate) async fn append(&self, request: AppendRequest) -> Result<(), tonic::Status> {
        match self {
            Connection::Stream(pipeline) => pipeline.append(request).await.map(drop),
            Connection::Unary(client) => client.clone().append(request).await.map(drop),
        }
    }
}

/// The appenders' connections: a few per node, and which node leads each
/// shard (from the config, then from `walship-leader` hints when a leader
/// moves).
pub(crate) struct Router {
    /// gRPC address of each node, and its connections.
    nodes: Vec<(String, Vec<Connection>)>,
    /// Index into `nodes` of shard i's leader, at i-1.
    leaders: Vec<AtomicUsize>,
}

impl Router {
    pub(crate) async fn open(target: &Target, appenders: usize, transport: Transport) -> Result<Router> {
        // Every node, not only the configured leaders: a shard's leader
        // may move to any of them (a 1-shard cell whose leader moved at
        // start-up followed its hint nowhere and gave up).
        let mut addresses: Vec<String> = target.nodes.clone();
        addresses.sort();
        addresses.dedup();
        let per_node = appenders.div_ceil(addresses.len()).clamp(1, 4);
        let mut nodes = Vec::new();
        for address in addresses {
            let mut connections = Vec::new();
            for _ in 0..per_node {
                connections.push(Connection::open(&address, transport, target.client_tls.as_ref()).await?);
            }
            nodes.push((address, connections));
        }
        let leaders = target
            .leaders
            .iter()
            .map(|l| AtomicUsize::new(nodes.iter().position(|(a, _)| a == l).expect("listed")))
            .collect();
        Ok(Router { nodes, leaders })
    }

    /// Sends `request` to its shard's leader, on one of that node's
    /// connections (chosen by `appender`).
    pub(crate) async fn append(&self, appender: usize, request: AppendRequest) -> Result<(), tonic::Status> {
        let node = self.leaders[request.shard_id as usize - 1].load(Ordering::Relaxed);
        let connections = &self.nodes[node].1;
        connections[appender % connections.len()].append(request).await
    }

    /// Follows the leader hint `status` carries (`<id>@<address>`) for
    /// `shard`; whether there was one to follow.
    pub(crate) fn followed(&self, shard: u32, status: &tonic::Status) -> bool {
        let Some(address) = walship_proto::leader_address(status) else { return false };
        match (self.nodes.iter().position(|(a, _)| a == address), self.leaders.get(shard as usize - 1)) {
            (Some(node), Some(slot)) => {
                slot.store(node, Ordering::Relaxed);
                true
            }
            _ => false,
        }
    }
}

pub use walship_wal::disk::DiskBaseline as Baseline;

#[derive(Debug, Clone, Serialize)]
struct Cell {
    path: &'static str,
    record_bytes: usize,
    shards: u32,
    appenders: usize,
    records_per_s: f64,
    mib_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    p999_us: f64,
    /// MiB/s of record payload written to the one disk (all copies) ÷ raw
    /// sequential write MiB/s.
    bandwidth_ratio: f64,
    /// records/s ÷ the single-node `local` path's records/s in the same cell,
    /// when both were measured.
    vs_local: Option<f64>,
    /// A TLS cell's records/s ÷ the same cell without TLS, when measured.
    #[serde(skip_serializing_if = "Option::is_none")]
    vs_plaintext: Option<f64>,
    /// An archiving cell's records/s ÷ the same cell without the archive.
    #[serde(skip_serializing_if = "Option::is_none")]
    vs_unarchived: Option<f64>,
    /// A cell over more than one shard: its records/s ÷ the same path,
    /// record size and appenders on one shard, when both were measured
    /// (`--shards 1,1000`: what spreading the appenders over many shards
    /// costs).
    #[serde(skip_serializing_if = "Option::is_none")]
    vs_one_shard: Option<f64>,
    /// Archiving cells: segment MiB/s uploaded over the cell (warm-up
    /// included), and the archive lag (seconds, worst shard) at its end.
    #[serde(skip_serializing_if = "Option::is_none")]
    archive_mib_per_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    archive_lag_s: Option<f64>,
    /// p99 append latency ÷ raw 4 KiB fdatasync p99.
    p99_ratio: f64,
    /// CPU time per acknowledged record over the measured window, in µs:
    /// every server process of the cell together (nodes and coordinator),
    /// and the load generator (this process). The machine has no hardware
    /// counters to give instructions; CPU time is their stand-in, and the
    /// pair says where a path's cost sits. gRPC cells only.
    #[serde(skip_serializing_if = "Option::is_none")]
    server_cpu_us_per_record: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    client_cpu_us_per_record: Option<f64>,
}

#[derive(Debug, Serialize)]
struct Report {
    baseline: Baseline,
    cells: Vec<Cell>,
}

/// Raw limits of the disk under `dir`.
pub fn measure_baseline(dir: &Path) -> Result<Baseline> {
    walship_wal::disk::measure(dir).with_context(|| format!("measuring the disk under {}", dir.display()))
}

/// What a cell measured besides the latencies: the archive's figures
/// (upload MiB/s, lag s) and the CPU seconds spent over the measured window
/// (servers, load generator).
#[derive(Default)]
struct Extra {
    archive: Option<(f64, f64)>,
    cpu_s: Option<(f64, f64)>,
}

fn cell(
    path: BenchPath,
    size: usize,
    shards: u32,
    appenders: usize,
    (m, extra): (&Measured, Extra),
    base: &Baseline,
    duration_s: f64,
) -> Cell {
    let f = m.summary(size);
    let records = f.records_per_s * duration_s;
    let per_record = |cpu_s: f64| (records > 0.0).then(|| cpu_s * 1e6 / records);
    let archive = extra.archive;
    Cell {
        path: path.name(),
        record_bytes: size,
        shards,
        appenders,
        records_per_s: f.records_per_s,
        mib_per_s: f.mib_per_s,
        p50_us: f.p50_us,
        p99_us: f.p99_us,
        p999_us: f.p999_us,
        bandwidth_ratio: f.mib_per_s * path.copies() / base.seq_write_mib_s,
        vs_local: None,
        vs_plaintext: None,
        vs_unarchived: None,
        vs_one_shard: None,
        archive_mib_per_s: archive.map(|a| a.0),
        archive_lag_s: archive.map(|a| a.1),
        p99_ratio: f.p99_us / base.fdatasync_4k_p99_us,
        server_cpu_us_per_record: extra.cpu_s.and_then(|(server, _)| per_record(server)),
        client_cpu_us_per_record: extra.cpu_s.and_then(|(_, client)| per_record(client)),
    }
}

/// CPU seconds (user + system, every thread) process `pid` has used, from
/// `/proc/<pid>/stat`.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may hold
    // spaces: state is the first, utime and stime the 12th and 13th.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    // SAFETY: sysconf only reads a configuration value.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (per_second > 0.0).then(|| ticks / per_second)
}

/// CPU seconds the `servers` together and this process used between
/// `warmup` and `warmup + duration` from now: the load generator's
/// measured window.
async fn cpu_over_window(servers: Vec<u32>, warmup: Duration, duration: Duration) -> Option<(f64, f64)> {
    let sample = || -> Option<(f64, f64)> {
        let servers = servers.iter().map(|&pid| cpu_seconds(pid)).sum::<Option<f64>>()?;
        Some((servers, cpu_seconds(std::process::id())?))
    };
    tokio::time::sleep(warmup).await;
    let before = sample()?;
    tokio::time::sleep(duration).await;
    let after = sample()?;
    Some((after.0 - before.0, after.1 - before.1))
}

pub(crate) fn payload(size: usize) -> Bytes {
    Bytes::from((0..size).map(|i| (i * 131 % 251) as u8).collect::<Vec<u8>>())
}

async fn wal_cell(dir: &Path, size: usize, shards: u32, appenders: usize, args: &BenchArgs) -> Result<Measured> {
    let data = dir.join(format!("wal-{size}-{shards}-{appenders}"));
    let _ = std::fs::remove_dir_all(&data);
    let store = {
        let data = data.clone();
        // As a node opens it (`wal.prefill`, `wal.spare_bytes`).
        let config =
            walship_wal::EngineStoreConfig { prefill: true, spare_bytes: args.wal_spare_bytes, ..Default::default() };
        tokio::task::spawn_blocking(move || EngineStore::open(&data, &config)).await??
    };
    let wal = Wal::start(Arc::new(store), WalConfig::default(), WalMetrics::unregistered())?;
    for shard in 1..=shards {
        wal.create_shard(shard)?;
    }
    let body = payload(size);
    let wal2 = wal.clone();
    let result = walship_loadgen::closed(
        appenders,
        Duration::from_secs_f64(args.warmup),
        Duration::from_secs_f64(args.duration),
        move |i| {
            let (wal, body) = (wal2.clone(), body.clone());
            async move {
                let shard = 1 + (i as u32 % shards);
                wal.append(shard, 1, vec![NewRecord { key: Bytes::new(), payload: body }]).await?;
                Ok(())
            }
        },
    )
    .await;
    drop(wal);
    let _ = std::fs::remove_dir_all(&data);
    result
}

async fn grpc_cell(
    path: BenchPath,
    dir: &Path,
    size: usize,
    shards: u32,
    appenders: usize,
    args: &BenchArgs,
) -> Result<(Measured, Extra)> {
    let data = dir.join(format!("{}-{size}-{shards}-{appenders}", path.name()));
    let _ = std::fs::remove_dir_all(&data);
    let (target, durability) = match path {
        BenchPath::Local => (single_node(&data, shards, args.wal_spare_bytes)?, Durability::Local),
        BenchPath::Quorum | BenchPath::QuorumTls => {
            let tls = path == BenchPath::QuorumTls;
            (three_nodes(&data, shards, args.leadership, args.wal_spare_bytes, tls, &|_| {}, &[])?, Durability::Quorum)
        }
        BenchPath::All => {
            (three_nodes(&data, shards, args.leadership, args.wal_spare_bytes, false, &|_| {}, &[])?, Durability::All)
        }
        BenchPath::QuorumArchive | BenchPath::QuorumArchiveFollower => {
            let archiver = match path {
                BenchPath::QuorumArchiveFollower => walship_shipping::config::ArchiverChoice::Follower,
                _ => walship_shipping::config::ArchiverChoice::Leader,
            };
            let archive = move |c: &mut walship_shipping::ClusterConfig| {
                let mut archive = walship_shipping::config::ArchiveConfig::dir("archive".into());
                archive.archiver = archiver;
                c.archive = Some(archive);
            };
            (
                three_nodes(&data, shards, args.leadership, args.wal_spare_bytes, false, &archive, &[])?,
                Durability::Quorum,
            )
        }
        BenchPath::Wal => bail!("the wal path runs in process"),
    };
    let router = Arc::new(Router::open(&target, appenders, args.transport).await?);
    // Under a coordinator the leaders take their role a moment after start
    // (and may move while thousands of shards start): every shard must
    // take an append, at its leader, before the clock starts.
    for shard in 1..=shards {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let ready = || AppendRequest {
            shard_id: shard,
            records: vec![AppendRecord { key: Bytes::new(), payload: Bytes::from_static(b"ready") }],
            durability: durability as i32,
            ..Default::default()
        };
        while let Err(status) = router.append(0, ready()).await {
            if std::time::Instant::now() > deadline {
                bail!("shard {shard} never accepted an append: {status}");
            }
            if !router.followed(shard, &status) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    // Appender i writes shards i, i + appenders, i + 2 x appenders, ...
    // (mod the shard count) in turn: with more shards than appenders every
    // shard is written, and each append goes to its shard's leader.
    let turns: Arc<Vec<AtomicUsize>> = Arc::new((0..appenders).map(|_| AtomicUsize::new(0)).collect());
    let body = payload(size);
    let (warmup, duration) = (Duration::from_secs_f64(args.warmup), Duration::from_secs_f64(args.duration));
    let cpu = tokio::spawn(cpu_over_window(target.pids(), warmup, duration));
    let result = walship_loadgen::closed(
        appenders,
        Duration::from_secs_f64(args.warmup),
        Duration::from_secs_f64(args.duration),
        move |i| {
            let turn = turns[i].fetch_add(1, Ordering::Relaxed);
            let shard = ((i + turn * appenders) % shards as usize) as u32 + 1;
            let (router, body) = (router.clone(), body.clone());
            async move {
                let request = || AppendRequest {
                    shard_id: shard,
                    records: vec![AppendRecord { key: Bytes::new(), payload: body.clone() }],
                    durability: durability as i32,
                    ..Default::default()
                };
                // A leader that moved answers with a hint: the router
                // follows it and the append goes again.
                let mut attempts = 0;
                loop {
                    match router.append(i, request()).await {
                        Ok(()) => return Ok(()),
                        Err(status) if attempts < 3 && router.followed(shard, &status) => attempts += 1,
                        Err(status) => return Err(anyhow::anyhow!("append to shard {shard}: {status}")),
                    }
                }
            }
        },
    )
    .await;
    let cpu_s = cpu.await.ok().flatten();
    let archive = match path {
        BenchPath::QuorumArchive | BenchPath::QuorumArchiveFollower => {
            Some(archive_figures(&data, args.warmup + args.duration).await?)
        }
        _ => None,
    };
    drop(target);
    let _ = std::fs::remove_dir_all(&data);
    Ok((result?, Extra { archive, cpu_s }))
}

/// An archiving cell's upload rate (MiB/s over `seconds`) and its worst
/// shard's archive lag now, from every node's `/v1/status`.
async fn archive_figures(data: &Path, seconds: f64) -> Result<(f64, f64)> {
    let config = walship_shipping::ClusterConfig::load(&data.join("cluster.toml"))?;
    let (mut bytes, mut lag) = (0u64, 0f64);
    for node in &config.nodes {
        let base = format!("http://{}", node.admin_addr);
        let (_, status) = crate::http::request("GET", &base, "/v1/status", None, None).await?;
        for shard in status["shards"].as_array().into_iter().flatten() {
            let archive = &shard["archive"];
            bytes += archive["bytes_uploaded"].as_u64().unwrap_or(0);
            lag = lag.max(archive["lag_seconds"].as_f64().unwrap_or(0.0));
        }
    }
    Ok((bytes as f64 / (1 << 20) as f64 / seconds, lag))
}

fn print_table(base: &Baseline, cells: &[Cell]) {
    println!();
    println!(
        "raw disk: 4 KiB write+fdatasync p50 {:.0} µs, p99 {:.0} µs, p999 {:.0} µs (three writers at once: p50 {:.0} \
         µs, p99 {:.0} µs); sequential write {:.0} MiB/s",
        base.fdatasync_4k_p50_us,
        base.fdatasync_4k_p99_us,
        base.fdatasync_4k_p999_us,
        base.fdatasync_4k_three_p50_us,
        base.fdatasync_4k_three_p99_us,
        base.seq_write_mib_s
    );
    println!();
    println!(
        "| path | record B | shards | appenders | records/s | MiB/s | p50 µs | p99 µs | p999 µs | disk MiB/s ÷ disk limit | p99 ÷ fsync p99 | ÷ local | ÷ plaintext | ÷ unarchived | ÷ 1 shard | archive MiB/s | archive lag s | server CPU µs/rec | client CPU µs/rec |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for c in cells {
        let vs_local = c.vs_local.map_or("".to_string(), |r| format!("{r:.2}"));
        let vs_plaintext = c.vs_plaintext.map_or("".to_string(), |r| format!("{r:.2}"));
        let vs_unarchived = c.vs_unarchived.map_or("".to_string(), |r| format!("{r:.2}"));
        let vs_one_shard = c.vs_one_shard.map_or("".to_string(), |r| format!("{r:.2}"));
        let archive_mib = c.archive_mib_per_s.map_or("".to_string(), |r| format!("{r:.1}"));
        let archive_lag = c.archive_lag_s.map_or("".to_string(), |r| format!("{r:.1}"));
        let server_cpu = c.server_cpu_us_per_record.map_or("".to_string(), |r| format!("{r:.1}"));
        let client_cpu = c.client_cpu_us_per_record.map_or("".to_string(), |r| format!("{r:.1}"));
        println!(
            "| {} | {} | {} | {} | {:.0} | {:.1} | {:.0} | {:.0} | {:.0} | {:.2} | {:.2} | {} | {} | {} | {} | {} | {} | {} | {} |",
            c.path,
            c.record_bytes,
            c.shards,
            c.appenders,
            c.records_per_s,
            c.mib_per_s,
            c.p50_us,
            c.p99_us,
            c.p999_us,
            c.bandwidth_ratio,
            c.p99_ratio,
            vs_local,
            vs_plaintext,
            vs_unarchived,
            vs_one_shard,
            archive_mib,
            archive_lag,
            server_cpu,
            client_cpu
        );
    }
}

/// Each cell's ratios to the cell measured beside it: a replicated cell's
/// records/s ÷ the `local` cell's, a TLS or archiving cell's ÷ the plain
/// `rf3-quorum` cell's (same record size, shards and appenders), and a cell
/// over several shards ÷ the same path on one shard; none when that cell
/// was not measured.
fn set_ratios(cells: &mut [Cell]) {
    let ratio = |c: &Cell, base: &dyn Fn(&Cell) -> bool| {
        cells.iter().find(|o| base(o)).map(|o| c.records_per_s / o.records_per_s)
    };
    let ratios: Vec<_> = cells
        .iter()
        .map(|c| {
            let alike = |o: &Cell| (o.record_bytes, o.shards, o.appenders) == (c.record_bytes, c.shards, c.appenders);
            let beside = |path: &str| ratio(c, &|o| o.path == path && alike(o));
            let one_shard = || {
                ratio(c, &|o| {
                    o.shards == 1 && (o.path, o.record_bytes, o.appenders) == (c.path, c.record_bytes, c.appenders)
                })
            };
            (
                c.path.starts_with("rf3").then(|| beside("local")).flatten(),
                (c.path == "rf3-quorum-tls").then(|| beside("rf3-quorum")).flatten(),
                c.path.starts_with("rf3-quorum-archive").then(|| beside("rf3-quorum")).flatten(),
                (c.shards > 1).then(one_shard).flatten(),
            )
        })
        .collect();
    for (c, (local, plaintext, unarchived, one_shard)) in cells.iter_mut().zip(ratios) {
        (c.vs_local, c.vs_plaintext, c.vs_unarchived, c.vs_one_shard) = (local, plaintext, unarchived, one_shard);
    }
}

pub async fn run(args: BenchArgs) -> Result<()> {
    if args.paths.is_empty()
        || args.sizes.is_empty()
        || args.appenders.is_empty()
        || args.shards.is_empty()
        || args.duration <= 0.0
    {
        bail!("--paths, --sizes, --appenders and --shards need values and --duration must be positive");
    }
    if args.appenders.contains(&0) || args.shards.contains(&0) {
        bail!("--appenders and --shards must be at least 1");
    }
    std::fs::create_dir_all(&args.dir).with_context(|| format!("creating {}", args.dir.display()))?;
    eprintln!("measuring the raw disk under {} ...", args.dir.display());
    let base = measure_baseline(&args.dir)?;
    let mut cells: Vec<Cell> = Vec::new();
    let total = args.paths.len() * args.shards.len() * args.sizes.len() * args.appenders.len();
    let bar = indicatif::ProgressBar::new(total as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} cells [{elapsed}, ~{eta} left] {msg}")
            .expect("valid template"),
    );
    for &path in &args.paths {
        for &shards in &args.shards {
            for &size in &args.sizes {
                for &appenders in &args.appenders {
                    bar.set_message(format!("{} {size} B, {shards} shard(s), {appenders} appenders", path.name()));
                    let (measured, extra) = match path {
                        BenchPath::Wal => {
                            (wal_cell(&args.dir, size, shards, appenders, &args).await?, Extra::default())
                        }
                        _ => grpc_cell(path, &args.dir, size, shards, appenders, &args).await?,
                    };
                    let c = cell(path, size, shards, appenders, (&measured, extra), &base, args.duration);
                    bar.println(format!(
                        "{:>10} {size:>6} B  {shards} shard(s)  {appenders:>3} appenders: {:>9.0} rec/s {:>7.1} MiB/s  p99 {:>6.0} µs",
                        c.path, c.records_per_s, c.mib_per_s, c.p99_us
                    ));
                    cells.push(c);
                    bar.inc(1);
                }
            }
        }
    }
    bar.finish_and_clear();
    set_ratios(&mut cells);
    print_table(&base, &cells);
    if let Some(path) = &args.json {
        let mut file = std::fs::File::create(path)?;
        serde_json::to_writer_pretty(&mut file, &Report { baseline: base, cells })?;
        file.write_all(b"\n")?;
    }
    Ok(())
}
