//! `walship-history`: QUORUM appends on a sample of shards until told to
//! stop, then every acknowledged record checked on every node. Run beside
//! a failover (`ops/bench/scale.sh --kill --load N`); see
//! `walship_compare::history` for what it checks and `ops/bench/README.md`
//! for how to run it. Prints one JSON object; exits 1 when an acknowledged
//! record is lost, a shard could be read on no node, or nothing was
//! acknowledged at all.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use clap::Parser;
use walship_client::{Producer, ProducerConfig};
use walship_compare::history;
use walship_proto::log::Durability;

#[derive(Parser, Debug)]
#[command(
    about = "QUORUM appends on a sample of shards until told to stop, then every acknowledged record checked on every node"
)]
struct Args {
    /// Node gRPC addresses (host:port), comma-separated: appends find each
    /// shard's leader among them, and every one is checked.
    #[arg(long, value_delimiter = ',', required = true)]
    servers: Vec<String>,
    /// The sampled shard ids, comma-separated: one client each, one record
    /// in flight.
    #[arg(long)]
    shards: String,
    /// Payload bytes per record.
    #[arg(long, default_value_t = 100)]
    size: usize,
    /// The appends stop once this file exists, or its directory no longer
    /// does (or after --max-seconds).
    #[arg(long)]
    stop_file: PathBuf,
    /// Acknowledgements made before this file exists are counted apart
    /// (`acked_before_mark`): create it as the failover begins.
    #[arg(long)]
    mark_file: Option<PathBuf>,
    /// Appends stop after this long even without the stop file.
    #[arg(long, default_value_t = 300.0)]
    max_seconds: f64,
    /// How long each node may take to commit a shard's newest acknowledged
    /// record before it is read (a restarted node catching up); past it the
    /// node is unchecked for that shard.
    #[arg(long, default_value_t = 30.0)]
    wait_seconds: f64,
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let shards = history::parse_shards(&args.shards)?;
    if args.max_seconds <= 0.0
        || args.wait_seconds <= 0.0
        || !args.max_seconds.is_finite()
        || !args.wait_seconds.is_finite()
    {
        bail!("--max-seconds and --wait-seconds must be positive");
    }
    // One record at a time per shard: each acknowledgement names its own
    // seqno, and a failover finds at most one record in flight per shard.
    let config = ProducerConfig {
        durability: Durability::Quorum,
        in_flight: 1,
        linger: Duration::ZERO,
        deadline: Duration::from_secs(30),
        request_timeout: Duration::from_secs(2),
        ..ProducerConfig::default()
    };
    let producer = Arc::new(Producer::new(args.servers.clone(), walship_compare::walship::producer_connect(), config));
    let run = rand::random::<u64>();
    let (stop, marked) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
    let acked_before_mark = Arc::new(AtomicU64::new(0));
    let clients: Vec<_> = shards
        .iter()
        .map(|&shard| {
            tokio::spawn(history::append_until(
                producer.clone(),
                run,
                shard,
                args.size,
                stop.clone(),
                marked.clone(),
                acked_before_mark.clone(),
            ))
        })
        .collect();
    let started = Instant::now();
    let max = Duration::from_secs_f64(args.max_seconds);
    // A stop file whose directory is gone (the script that ran this ended)
    // stops it too.
    let abandoned = |f: &PathBuf| f.parent().is_some_and(|d| !d.as_os_str().is_empty() && !d.exists());
    while !args.stop_file.exists() && !abandoned(&args.stop_file) && started.elapsed() < max {
        if args.mark_file.as_ref().is_some_and(|f| f.exists()) {
            marked.store(true, Ordering::Relaxed);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    marked.store(true, Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    let mut histories = Vec::with_capacity(clients.len());
    for client in clients {
        histories.push(client.await?);
    }
    let wait = Duration::from_secs_f64(args.wait_seconds);
    let verdict = history::check(&histories, &args.servers, wait, acked_before_mark.load(Ordering::Relaxed)).await;
    println!("{}", serde_json::to_string(&verdict)?);
    if !verdict.passed() {
        std::process::exit(1);
    }
    Ok(())
}
