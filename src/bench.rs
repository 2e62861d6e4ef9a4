//! `walship bench`: append throughput and latency, printed beside this
//! machine's raw disk limits measured in the same run.
//!
//! Two paths are measured over the same matrix (record sizes x concurrent
//! appenders x shards), each appender issuing one single-record append at a
//! time:
//! * `wal`: the node's WAL in process (group commit on raft-engine, no
//!   network) — what the storage path can do;
//! * `grpc`: a real `walship node` child process driven over loopback gRPC
//!   at `local` durability — what a client sees.
//!
//! The raw baseline is a 4 KiB write + fdatasync loop (latency) and 1 MiB
//! sequential writes with an fdatasync every 8 MiB (bandwidth), on the same
//! filesystem as the WAL. Figures on shared machines swing several-fold
//! between runs, so every result is also printed as a ratio to the baseline.
//! Nothing here asserts a speed: it prints figures.

use std::fs::OpenOptions;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use clap::{Args, ValueEnum};
use hdrhistogram::Histogram;
use serde::Serialize;
use tonic::transport::{Channel, Endpoint};
use walship_proto::log::log_client::LogClient;
use walship_proto::log::{AppendRecord, AppendRequest, Durability};
use walship_wal::{EngineStore, NewRecord, Wal, WalConfig, WalMetrics};

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Wal,
    Grpc,
    Both,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Directory for the baseline files and WAL data (same disk as a real node's).
    #[arg(long, default_value = ".walship/bench")]
    dir: PathBuf,
    /// Which paths to measure.
    #[arg(long, value_enum, default_value = "both")]
    mode: Mode,
    /// Record payload sizes in bytes.
    #[arg(long, value_delimiter = ',', default_value = "100,1024,16384")]
    sizes: Vec<usize>,
    /// Concurrent appenders.
    #[arg(long, value_delimiter = ',', default_value = "1,16,256")]
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
    /// Also write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Debug, Clone, Serialize)]
struct Baseline {
    fdatasync_4k_p50_us: f64,
    fdatasync_4k_p99_us: f64,
    fdatasync_4k_p999_us: f64,
    seq_write_mib_s: f64,
}

#[derive(Debug, Clone, Serialize)]
struct Cell {
    mode: &'static str,
    record_bytes: usize,
    shards: u32,
    appenders: usize,
    records_per_s: f64,
    mib_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    p999_us: f64,
    /// MiB/s of record payload ÷ raw sequential write MiB/s.
    bandwidth_ratio: f64,
    /// p99 append latency ÷ raw 4 KiB fdatasync p99.
    p99_ratio: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    baseline: Baseline,
    cells: Vec<Cell>,
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid bounds")
}

/// Raw limits of the disk under `dir`.
fn measure_baseline(dir: &Path) -> Result<Baseline> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join("baseline.dat");
    let file = OpenOptions::new().create(true).truncate(true).read(true).write(true).open(&path)?;
    let block = vec![0x5Au8; 4096];
    let mut lat = histogram();
    let started = Instant::now();
    let mut offset = 0u64;
    while lat.len() < 2000 && started.elapsed() < Duration::from_secs(3) {
        let t = Instant::now();
        file.write_all_at(&block, offset)?;
        file.sync_data()?;
        lat.record(t.elapsed().as_micros().max(1) as u64)?;
        offset += 4096;
    }
    drop(file);
    let file = OpenOptions::new().create(true).truncate(true).write(true).open(&path)?;
    let chunk = vec![0xA5u8; 1 << 20];
    let started = Instant::now();
    let mut written = 0u64;
    while written < (1 << 30) && started.elapsed() < Duration::from_secs(3) {
        file.write_all_at(&chunk, written)?;
        written += chunk.len() as u64;
        if written.is_multiple_of(8 << 20) {
            file.sync_data()?;
        }
    }
    file.sync_data()?;
    let seconds = started.elapsed().as_secs_f64();
    drop(file);
    std::fs::remove_file(&path)?;
    Ok(Baseline {
        fdatasync_4k_p50_us: lat.value_at_quantile(0.5) as f64,
        fdatasync_4k_p99_us: lat.value_at_quantile(0.99) as f64,
        fdatasync_4k_p999_us: lat.value_at_quantile(0.999) as f64,
        seq_write_mib_s: written as f64 / (1 << 20) as f64 / seconds,
    })
}

/// Runs `appenders` loops of `append_once` for warm-up + duration and
/// returns the latency histogram of the measured part and its length.
async fn drive<F, Fut>(
    appenders: usize,
    warmup: Duration,
    duration: Duration,
    append_once: F,
) -> Result<(Histogram<u64>, f64)>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<()>> + Send,
{
    let append_once = Arc::new(append_once);
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for i in 0..appenders {
        let (append_once, measuring, stop) = (append_once.clone(), measuring.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = histogram();
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                append_once(i).await?;
                if measuring.load(Ordering::Relaxed) {
                    lat.record(t.elapsed().as_micros().max(1) as u64)?;
                }
            }
            anyhow::Ok(lat)
        }));
    }
    tokio::time::sleep(warmup).await;
    measuring.store(true, Ordering::Relaxed);
    let started = Instant::now();
    tokio::time::sleep(duration).await;
    measuring.store(false, Ordering::Relaxed);
    let seconds = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let mut total = histogram();
    for task in tasks {
        total.add(task.await??)?;
    }
    Ok((total, seconds))
}

fn cell(
    mode: &'static str,
    size: usize,
    shards: u32,
    appenders: usize,
    lat: &Histogram<u64>,
    seconds: f64,
    base: &Baseline,
) -> Cell {
    let records_per_s = lat.len() as f64 / seconds;
    let mib_per_s = records_per_s * size as f64 / (1 << 20) as f64;
    let p99 = lat.value_at_quantile(0.99) as f64;
    Cell {
        mode,
        record_bytes: size,
        shards,
        appenders,
        records_per_s,
        mib_per_s,
        p50_us: lat.value_at_quantile(0.5) as f64,
        p99_us: p99,
        p999_us: lat.value_at_quantile(0.999) as f64,
        bandwidth_ratio: mib_per_s / base.seq_write_mib_s,
        p99_ratio: p99 / base.fdatasync_4k_p99_us,
    }
}

fn payload(size: usize) -> Bytes {
    Bytes::from((0..size).map(|i| (i * 131 % 251) as u8).collect::<Vec<u8>>())
}

async fn wal_cell(
    dir: &Path,
    size: usize,
    shards: u32,
    appenders: usize,
    args: &BenchArgs,
) -> Result<(Histogram<u64>, f64)> {
    let data = dir.join(format!("wal-{size}-{shards}-{appenders}"));
    let _ = std::fs::remove_dir_all(&data);
    let store = {
        let data = data.clone();
        tokio::task::spawn_blocking(move || EngineStore::open(&data, &Default::default())).await??
    };
    let wal = Wal::start(Arc::new(store), WalConfig::default(), WalMetrics::unregistered())?;
    for shard in 1..=shards {
        wal.create_shard(shard)?;
    }
    let body = payload(size);
    let wal2 = wal.clone();
    let result =
        drive(appenders, Duration::from_secs_f64(args.warmup), Duration::from_secs_f64(args.duration), move |i| {
            let (wal, body) = (wal2.clone(), body.clone());
            async move {
                let shard = 1 + (i as u32 % shards);
                wal.append(shard, 1, vec![NewRecord { key: Bytes::new(), payload: body }]).await?;
                Ok(())
            }
        })
        .await;
    drop(wal);
    let _ = std::fs::remove_dir_all(&data);
    result
}

/// A `walship node` child process for the gRPC path.
struct ChildNode {
    child: std::process::Child,
    grpc: String,
}

impl Drop for ChildNode {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn_node(data: &Path, shards: u32) -> Result<ChildNode> {
    let exe = std::env::current_exe()?;
    let mut child = Command::new(exe)
        .args(["node", "--node-id", "1", "--grpc", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--shards"])
        .arg(format!("1-{shards}"))
        .arg("--data-dir")
        .arg(data)
        .env("WALSHIP_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .context("spawning walship node")?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().context("node stdout")?).read_line(&mut line)?;
    let grpc = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("grpc="))
        .with_context(|| format!("node did not print its address: {line:?}"))?
        .to_string();
    Ok(ChildNode { child, grpc })
}

async fn grpc_cell(
    dir: &Path,
    size: usize,
    shards: u32,
    appenders: usize,
    args: &BenchArgs,
) -> Result<(Histogram<u64>, f64)> {
    let data = dir.join(format!("node-{size}-{shards}-{appenders}"));
    let _ = std::fs::remove_dir_all(&data);
    let node = spawn_node(&data, shards)?;
    // A few HTTP/2 connections, shared round-robin by the appenders.
    let mut clients = Vec::new();
    for _ in 0..appenders.clamp(1, 8) {
        let channel: Channel = Endpoint::from_shared(format!("http://{}", node.grpc))?.connect().await?;
        clients.push(LogClient::new(channel));
    }
    let clients = Arc::new(clients);
    let body = payload(size);
    let result =
        drive(appenders, Duration::from_secs_f64(args.warmup), Duration::from_secs_f64(args.duration), move |i| {
            let mut client = clients[i % clients.len()].clone();
            let body = body.clone();
            async move {
                let request = AppendRequest {
                    shard_id: 1 + (i as u32 % shards),
                    records: vec![AppendRecord { key: Bytes::new(), payload: body }],
                    durability: Durability::Local as i32,
                };
                client.append(request).await.map_err(|s| anyhow::anyhow!("append: {s}"))?;
                Ok(())
            }
        })
        .await;
    drop(node);
    let _ = std::fs::remove_dir_all(&data);
    result
}

fn print_table(base: &Baseline, cells: &[Cell]) {
    println!();
    println!(
        "raw disk: 4 KiB write+fdatasync p50 {:.0} µs, p99 {:.0} µs, p999 {:.0} µs; sequential write {:.0} MiB/s",
        base.fdatasync_4k_p50_us, base.fdatasync_4k_p99_us, base.fdatasync_4k_p999_us, base.seq_write_mib_s
    );
    println!();
    println!(
        "| path | record B | shards | appenders | records/s | MiB/s | p50 µs | p99 µs | p999 µs | MiB/s ÷ disk | p99 ÷ fsync p99 |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for c in cells {
        println!(
            "| {} | {} | {} | {} | {:.0} | {:.1} | {:.0} | {:.0} | {:.0} | {:.2} | {:.2} |",
            c.mode,
            c.record_bytes,
            c.shards,
            c.appenders,
            c.records_per_s,
            c.mib_per_s,
            c.p50_us,
            c.p99_us,
            c.p999_us,
            c.bandwidth_ratio,
            c.p99_ratio
        );
    }
}

pub async fn run(args: BenchArgs) -> Result<()> {
    if args.sizes.is_empty() || args.appenders.is_empty() || args.shards.is_empty() || args.duration <= 0.0 {
        bail!("--sizes, --appenders and --shards need values and --duration must be positive");
    }
    if args.appenders.contains(&0) || args.shards.contains(&0) {
        bail!("--appenders and --shards must be at least 1");
    }
    std::fs::create_dir_all(&args.dir).with_context(|| format!("creating {}", args.dir.display()))?;
    eprintln!("measuring the raw disk under {} ...", args.dir.display());
    let base = measure_baseline(&args.dir)?;
    let mut cells = Vec::new();
    let modes: &[&'static str] = match args.mode {
        Mode::Wal => &["wal"],
        Mode::Grpc => &["grpc"],
        Mode::Both => &["wal", "grpc"],
    };
    for &mode in modes {
        for &shards in &args.shards {
            for &size in &args.sizes {
                for &appenders in &args.appenders {
                    let (lat, seconds) = match mode {
                        "wal" => wal_cell(&args.dir, size, shards, appenders, &args).await?,
                        _ => grpc_cell(&args.dir, size, shards, appenders, &args).await?,
                    };
                    let c = cell(mode, size, shards, appenders, &lat, seconds, &base);
                    eprintln!(
                        "{mode:>4} {size:>6} B  {shards} shard(s)  {appenders:>3} appenders: {:>9.0} rec/s {:>7.1} MiB/s  p99 {:>6.0} µs",
                        c.records_per_s, c.mib_per_s, c.p99_us
                    );
                    cells.push(c);
                }
            }
        }
    }
    print_table(&base, &cells);
    if let Some(path) = &args.json {
        let mut file = std::fs::File::create(path)?;
        serde_json::to_writer_pretty(&mut file, &Report { baseline: base, cells })?;
        file.write_all(b"\n")?;
    }
    Ok(())
}
