//! `walship-memory`: how a node's resident memory grows with the records
//! its WAL retains, and how long a single-record read from the middle of
//! the log takes.
//!
//! One run ([`run`]) starts the comparison's walship cluster (three
//! `walship node`s and a `walship coord`, one shard at RF=3, the settings of
//! a `walship-compare` throughput cell; see [`crate::walship`]) from one
//! binary on fresh data directories, and has `clients` clients append
//! `record_bytes` records at `QUORUM` through `Log.AppendStream` (closed
//! loop, the same path as the comparison) for the run's duration. Every
//! `sample_every` it reads each node process's `VmRSS` (and `RssAnon`) from
//! `/proc/<pid>/status`, the node's own first/last seqno of the shard from
//! its admin `/v1/status`, and `walship_wal_index_bytes` from its `/metrics`
//! when the binary exports it. With the load stopped and the cluster still
//! up, one client then reads `reads` single records (`Log.Read` with
//! `from_seqno = to_seqno`) from the leader at uniformly random seqnos in
//! the older half of the retained log, far behind the tail so the node's
//! in-memory tail cache does not serve them, and checks each answer holds
//! exactly the record asked for.
//!
//! The cluster's retention is raised to `retain_bytes` (both `retain_bytes`
//! and `max_retain_bytes`): with the default 1 GiB per shard a 100 B run
//! would start compacting after about 7 M records, and the retained count,
//! the figure memory is measured against, would stop growing mid-run.
//!
//! [`report`] turns the samples into per-node figures (RSS growth per 10 M
//! records between the warm-up sample and the end, the least-squares slope
//! of RSS against retained records, the index gauge) and writes the report.

pub mod report;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use async_trait::async_trait;
use bytes::Bytes;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use walship_proto::log::{Durability, ReadRequest};

use crate::system::{Appender, Cluster};
use crate::walship::{self as cluster, http_get};

/// The shard every run appends to and reads from.
const SHARD: u32 = 1;
/// The gauge the sparse-index WAL exports (absent from older binaries).
pub const INDEX_GAUGE: &str = "walship_wal_index_bytes";
/// How long one admin HTTP request (status, metrics) may take.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one `Log.Read` may take.
const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// What one run measures, and with which binary.
#[derive(Debug, Clone)]
pub struct RunSpec {
    /// `new` or `baseline`, in reports and as the data directory's name.
    pub label: String,
    pub walship: PathBuf,
    /// The run's data directory (removed first, and after the run).
    pub dir: PathBuf,
    pub clients: usize,
    pub record_bytes: usize,
    pub duration: Duration,
    /// The sample at or after this many seconds of load is the warm-up
    /// point of the growth figures.
    pub warmup_s: f64,
    pub reads: usize,
    pub retain_bytes: u64,
    pub sample_every: Duration,
    /// Extra `walship node` flags (e.g. `--wal-spare-bytes 0`).
    pub node_flags: Vec<String>,
}

/// One node at one instant.
#[derive(Debug, Clone, Serialize)]
pub struct NodeSample {
    /// 1-based node id.
    pub node: u32,
    pub pid: u32,
    pub rss_bytes: u64,
    pub rss_anon_bytes: u64,
    /// `leader`, `follower`, ..., empty when `/v1/status` did not answer.
    pub role: String,
    /// The shard's oldest and newest seqno in this node's WAL (none when
    /// `/v1/status` did not answer).
    pub first_seqno: Option<u64>,
    pub last_seqno: Option<u64>,
    /// `walship_wal_index_bytes` (summed over its series), when exported.
    pub index_bytes: Option<u64>,
}

impl NodeSample {
    /// Records this node's WAL retains for the shard.
    pub fn retained(&self) -> Option<u64> {
        let (first, last) = (self.first_seqno?, self.last_seqno?);
        Some(if last == 0 || last < first { 0 } else { last - first + 1 })
    }
}

/// Every node at one instant.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    /// Seconds since the load started (0: the sample before it).
    pub t_s: f64,
    /// Appends acknowledged to the clients so far.
    pub acked: u64,
    pub nodes: Vec<NodeSample>,
}

/// The read measurement.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Reads {
    pub requested: usize,
    /// Reads that failed or did not hold exactly the record asked for.
    pub errors: usize,
    pub first_error: Option<String>,
    pub p50_us: f64,
    pub p99_us: f64,
    pub mean_us: f64,
    pub max_us: f64,
    /// 1-based id of the node read from (the shard's leader).
    pub node: u32,
    /// The range the seqnos were drawn from (uniformly, inclusive).
    pub from_seqno: u64,
    pub to_seqno: u64,
    /// The leader's newest seqno when the reads started.
    pub last_seqno: u64,
}

/// What one run produced, before the figures are derived.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    pub spec: RunSpec,
    pub samples: Vec<Sample>,
    /// Acknowledged appends per second over the load.
    pub records_per_s: f64,
    pub append_p50_us: f64,
    pub append_p99_us: f64,
    pub load_seconds: f64,
    pub reads: Reads,
}

/// Removes `dirs` and flushes everything written so far, so that the next
/// run starts on a quiet disk.
pub fn quiet_disk(dirs: &[PathBuf]) -> Result<()> {
    tokio::task::block_in_place(|| -> Result<()> {
        for dir in dirs {
            if dir.exists() {
                std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
            }
        }
        // SAFETY: sync(2) takes no arguments and cannot fail.
        unsafe { libc::sync() };
        Ok(())
    })
}

/// Starts the cluster from `spec.walship`, loads it while sampling, reads
/// from the middle of its log, and stops it (also on error: the cluster's
/// processes stop when it is dropped). Leaves `spec.dir` in place.
pub async fn run(spec: &RunSpec) -> Result<RunOutcome> {
    let flags: Vec<&str> = spec.node_flags.iter().map(String::as_str).collect();
    let retain = spec.retain_bytes;
    let mut walship = cluster::start_cluster(&spec.dir, &spec.walship, Durability::Quorum, false, &flags, |config| {
        config.replication.retain_bytes = retain;
        config.replication.max_retain_bytes = retain;
    })
    .await
    .with_context(|| format!("starting walship from {}", spec.walship.display()))?;
    let pids = walship.node_pids();
    let admins = walship.admin_addrs().to_vec();
    let acked = Arc::new(AtomicU64::new(0));

    let mut samples = vec![sample(0.0, 0, &pids, &admins).await?];
    let appenders: Vec<Arc<dyn Appender>> = walship
        .appenders(spec.clients)
        .await?
        .into_iter()
        .map(|inner| Arc::new(Counting { inner, acked: acked.clone() }) as Arc<dyn Appender>)
        .collect();
    let started = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = tokio::spawn(sample_until(
        stop.clone(),
        started,
        spec.sample_every,
        acked.clone(),
        pids.clone(),
        admins.clone(),
    ));
    let measured = crate::load::closed(appenders, spec.record_bytes, Duration::ZERO, spec.duration).await;
    stop.store(true, Ordering::Relaxed);
    let during = sampler.await.context("the sampler panicked")??;
    let measured = measured.context("the append load")?;
    samples.extend(during);
    let t_end = started.elapsed().as_secs_f64();
    samples.push(sample(t_end, acked.load(Ordering::Relaxed), &pids, &admins).await?);
    walship.check_running()?;
    let summary = measured.summary(spec.record_bytes);

    let leader = walship.leader_index().await?;
    let reads = read_middle(walship.node_addrs()[leader], admins[leader], leader as u32 + 1, spec.reads).await?;
    walship.check_running()?;
    Box::new(walship).stop().await.context("stopping walship")?;
    Ok(RunOutcome {
        spec: spec.clone(),
        samples,
        records_per_s: summary.records_per_s,
        append_p50_us: summary.p50_us,
        append_p99_us: summary.p99_us,
        load_seconds: measured.seconds,
        reads,
    })
}

/// An appender that counts the appends acknowledged.
struct Counting {
    inner: Arc<dyn Appender>,
    acked: Arc<AtomicU64>,
}

#[async_trait]
impl Appender for Counting {
    async fn append(&self, payload: Bytes) -> Result<()> {
        self.inner.append(payload).await?;
        self.acked.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// Samples every `every` until `stop`.
async fn sample_until(
    stop: Arc<AtomicBool>,
    started: Instant,
    every: Duration,
    acked: Arc<AtomicU64>,
    pids: Vec<u32>,
    admins: Vec<SocketAddr>,
) -> Result<Vec<Sample>> {
    let mut samples = Vec::new();
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::from_std(started) + every, every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        if stop.load(Ordering::Relaxed) {
            return Ok(samples);
        }
        let t = started.elapsed().as_secs_f64();
        samples.push(sample(t, acked.load(Ordering::Relaxed), &pids, &admins).await?);
    }
}

/// Every node's memory, positions and index gauge now. A node whose admin
/// API does not answer in time gets no positions in this sample (logged);
/// a node whose `/proc` entry is gone fails the run.
async fn sample(t_s: f64, acked: u64, pids: &[u32], admins: &[SocketAddr]) -> Result<Sample> {
    let mut nodes = Vec::new();
    for (i, (&pid, &admin)) in pids.iter().zip(admins).enumerate() {
        let node = i as u32 + 1;
        let (rss_bytes, rss_anon_bytes) = process_rss(pid).with_context(|| format!("node {node} (pid {pid})"))?;
        let mut sample = NodeSample {
            node,
            pid,
            rss_bytes,
            rss_anon_bytes,
            role: String::new(),
            first_seqno: None,
            last_seqno: None,
            index_bytes: None,
        };
        match admin_get(admin, "/v1/status").await.and_then(|body| shard_status(&body, SHARD)) {
            Ok(status) => {
                sample.role = status.role;
                sample.first_seqno = Some(status.first_seqno);
                sample.last_seqno = Some(status.last_seqno);
            }
            Err(e) => eprintln!("  t={t_s:.1} s: node {node} /v1/status: {e:#} (sample kept without positions)"),
        }
        match admin_get(admin, "/metrics").await {
            Ok(body) => sample.index_bytes = gauge_sum(&body, INDEX_GAUGE),
            Err(e) => eprintln!("  t={t_s:.1} s: node {node} /metrics: {e:#}"),
        }
        nodes.push(sample);
    }
    Ok(Sample { t_s, acked, nodes })
}

async fn admin_get(admin: SocketAddr, path: &str) -> Result<String> {
    match tokio::time::timeout(ADMIN_TIMEOUT, http_get(admin, path)).await {
        Ok(body) => body,
        Err(_) => bail!("no answer within {ADMIN_TIMEOUT:?}"),
    }
}

/// `VmRSS` and `RssAnon` of process `pid`, in bytes.
pub fn process_rss(pid: u32) -> Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).context("reading /proc/<pid>/status")?;
    let rss = status_kib(&status, "VmRSS").context("no VmRSS in /proc/<pid>/status")?;
    Ok((rss * 1024, status_kib(&status, "RssAnon").unwrap_or(0) * 1024))
}

/// A `Name:   123 kB` line of `/proc/<pid>/status`, in KiB.
pub fn status_kib(status: &str, name: &str) -> Option<u64> {
    status.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// The sum of every series of the Prometheus gauge `name` in `text`, or
/// none when the family is absent.
pub fn gauge_sum(text: &str, name: &str) -> Option<u64> {
    let mut sum: Option<f64> = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else { continue };
        let value = if let Some(labelled) = rest.strip_prefix('{') {
            labelled.split_once('}').map(|(_, v)| v)
        } else if rest.starts_with(' ') {
            Some(rest)
        } else {
            None // another family whose name starts with this one
        };
        if let Some(v) = value.and_then(|v| v.split_whitespace().next()).and_then(|v| v.parse::<f64>().ok()) {
            *sum.get_or_insert(0.0) += v;
        }
    }
    sum.map(|s| s.max(0.0).round() as u64)
}

/// One shard replica's entry of a node's `/v1/status`.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardStatus {
    pub role: String,
    pub first_seqno: u64,
    pub last_seqno: u64,
}

/// Shard `shard`'s entry in a node's `/v1/status` body.
pub fn shard_status(body: &str, shard: u32) -> Result<ShardStatus> {
    let value: serde_json::Value = serde_json::from_str(body).context("/v1/status is not JSON")?;
    let shards = value["shards"].as_array().context("no shards in /v1/status")?;
    let entry = shards
        .iter()
        .find(|s| s["shard_id"].as_u64() == Some(shard as u64))
        .with_context(|| format!("no shard {shard} in /v1/status"))?;
    let number = |field: &str| entry[field].as_u64().with_context(|| format!("no {field} for shard {shard}"));
    Ok(ShardStatus {
        role: entry["role"].as_str().unwrap_or("").to_string(),
        first_seqno: number("first_seqno")?,
        last_seqno: number("last_seqno")?,
    })
}

/// The older half of a retained log `[first, last]`: the range single
/// reads are drawn from.
pub fn older_half(first: u64, last: u64) -> Option<(u64, u64)> {
    let first = first.max(1);
    if last < first {
        return None;
    }
    Some((first, first + (last - first) / 2))
}

/// `reads` single-record reads from the node at `addr` (admin `admin`), one
/// at a time, at uniformly random seqnos in the older half of its log.
async fn read_middle(addr: SocketAddr, admin: SocketAddr, node: u32, reads: usize) -> Result<Reads> {
    let status = shard_status(&admin_get(admin, "/v1/status").await?, SHARD)?;
    let (from, to) = older_half(status.first_seqno, status.last_seqno)
        .with_context(|| format!("node {node} retains no records ({status:?})"))?;
    let mut client = cluster::connect(addr).await?;
    let mut rng = rand::rngs::StdRng::from_entropy();
    let mut latency = walship_loadgen::histogram();
    let mut out = Reads {
        requested: reads,
        node,
        from_seqno: from,
        to_seqno: to,
        last_seqno: status.last_seqno,
        ..Default::default()
    };
    for _ in 0..reads {
        let seqno = rng.gen_range(from..=to);
        let mut request = tonic::Request::new(ReadRequest {
            shard_id: SHARD,
            from_seqno: seqno,
            to_seqno: seqno,
            max_bytes: 0,
            ..Default::default()
        });
        request.set_timeout(READ_TIMEOUT);
        let t = Instant::now();
        let answer = tokio::time::timeout(READ_TIMEOUT, client.read(request)).await;
        let us = t.elapsed().as_micros().max(1) as u64;
        let problem = match answer {
            Err(_) => Some(format!("seqno {seqno}: no answer within {READ_TIMEOUT:?}")),
            Ok(Err(status)) => Some(format!("seqno {seqno}: {status}")),
            Ok(Ok(response)) => {
                let seqnos: Vec<u64> = response.get_ref().records.iter().map(|r| r.seqno).collect();
                (seqnos != [seqno]).then(|| format!("asked for seqno {seqno}, got {seqnos:?}"))
            }
        };
        match problem {
            None => latency.record(us)?,
            Some(problem) => {
                out.errors += 1;
                out.first_error.get_or_insert(problem);
            }
        }
    }
    if !latency.is_empty() {
        out.p50_us = latency.value_at_quantile(0.5) as f64;
        out.p99_us = latency.value_at_quantile(0.99) as f64;
        out.mean_us = latency.mean();
        out.max_us = latency.max() as f64;
    }
    Ok(out)
}

/// The data directory of run `label` under `dir`.
pub fn run_dir(dir: &Path, label: &str) -> PathBuf {
    dir.join(label)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rss_lines_of_proc_status() {
        let status =
            "Name:\twalship\nVmPeak:\t  900 kB\nVmRSS:\t   51234 kB\nRssAnon:\t   40000 kB\nRssFile:\t 11234 kB\n";
        assert_eq!(status_kib(status, "VmRSS"), Some(51234));
        assert_eq!(status_kib(status, "RssAnon"), Some(40000));
        assert_eq!(status_kib(status, "VmSwap"), None);
        let (rss, anon) = process_rss(std::process::id()).unwrap();
        assert!(rss > 0 && anon > 0 && anon <= rss, "{rss} {anon}");
    }

    #[test]
    fn the_index_gauge_is_summed_over_its_series_and_absent_when_not_exported() {
        let text = "# HELP walship_wal_index_bytes RAM of the index\n# TYPE walship_wal_index_bytes gauge\n\
                    walship_wal_index_bytes{shard=\"1\"} 1000\nwalship_wal_index_bytes{shard=\"2\"} 24.0\n\
                    walship_wal_index_bytes_total 5\nwalship_wal_fsyncs_total 7\n";
        assert_eq!(gauge_sum(text, INDEX_GAUGE), Some(1024));
        assert_eq!(gauge_sum("walship_wal_index_bytes 3e3\n", INDEX_GAUGE), Some(3000));
        assert_eq!(gauge_sum("walship_wal_fsyncs_total 7\nwalship_wal_index_bytes_total 5\n", INDEX_GAUGE), None);
    }

    #[test]
    fn the_shards_positions_come_from_its_status_entry() {
        let body = r#"{"node_id":2,"shards":[{"shard_id":3,"role":"leader","first_seqno":1,"last_seqno":9},
                      {"shard_id":1,"role":"follower","first_seqno":5,"last_seqno":1005}]}"#;
        let s = shard_status(body, 1).unwrap();
        assert_eq!(s, ShardStatus { role: "follower".into(), first_seqno: 5, last_seqno: 1005 });
        assert!(shard_status(body, 7).is_err());
        assert!(shard_status("{}", 1).is_err());
    }

    #[test]
    fn reads_come_from_the_older_half() {
        assert_eq!(older_half(1, 1001), Some((1, 501)));
        assert_eq!(older_half(0, 10), Some((1, 5)));
        assert_eq!(older_half(7, 7), Some((7, 7)));
        assert_eq!(older_half(1, 0), None);
        let node = |first, last| NodeSample {
            node: 1,
            pid: 1,
            rss_bytes: 1,
            rss_anon_bytes: 1,
            role: String::new(),
            first_seqno: first,
            last_seqno: last,
            index_bytes: None,
        };
        assert_eq!(node(Some(1), Some(100)).retained(), Some(100));
        assert_eq!(node(Some(1), Some(0)).retained(), Some(0));
        assert_eq!(node(None, Some(3)).retained(), None);
    }
}
