//! The archive from the command line and its wiring into a node:
//! `walship archive ls|verify`, `walship restore`, and the object store a
//! node archives to (`[archive]` in the cluster config).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use walship_objstore::{LocalDirStore, ObjectStore, S3Credentials, S3Settings, S3Store};
use walship_shipping::ClusterConfig;
use walship_shipping::archive::ArchiveLayout;
use walship_shipping::archive::restore::{self, Until};
use walship_shipping::config::{ArchiveConfig, ArchiveStoreKind};

/// Opens the store `[archive]` names (S3 credentials from the AWS chain).
pub async fn open_store(config: &ArchiveConfig) -> Result<Arc<dyn ObjectStore>> {
    Ok(match config.store {
        ArchiveStoreKind::Dir => {
            let dir = config.dir.as_ref().context("[archive] store = \"dir\" needs `dir`")?;
            Arc::new(LocalDirStore::open(dir).with_context(|| format!("the archive directory {}", dir.display()))?)
        }
        ArchiveStoreKind::S3 => {
            let bucket = config.bucket.clone().context("[archive] store = \"s3\" needs `bucket`")?;
            let mut settings = S3Settings::new(bucket, S3Credentials::DefaultChain);
            settings.endpoint = config.endpoint.clone();
            if let Some(region) = &config.region {
                settings.region = region.clone();
            }
            settings.path_style = config.path_style;
            let store = S3Store::new(settings).await.context("the archive's S3 store")?;
            // A missing bucket is created; a refusal (credentials) is not
            // fatal here: uploads retry and show it until it is fixed.
            if let Err(e) = store.ensure_bucket().await {
                tracing::warn!(error = %e, "checking the archive's bucket");
            }
            Arc::new(store)
        }
    })
}

/// The key layout `[archive]` names.
pub fn layout(config: &ArchiveConfig) -> Result<ArchiveLayout> {
    ArchiveLayout::new(config.prefix.as_deref()).context("[archive] prefix")
}

fn archive_of(cluster: &std::path::Path) -> Result<ArchiveConfig> {
    let config = ClusterConfig::load(cluster).with_context(|| format!("reading {}", cluster.display()))?;
    config.archive.with_context(|| format!("{} has no [archive]: nothing is archived", cluster.display()))
}

#[derive(Args, Debug)]
pub struct ArchiveArgs {
    #[command(subcommand)]
    command: ArchiveCommand,
}

#[derive(Subcommand, Debug)]
enum ArchiveCommand {
    /// List a shard's archived segments: the run a restore reads, and any
    /// segment outside it.
    Ls {
        #[command(flatten)]
        target: Target,
    },
    /// Read every archived segment of a shard and check it whole (header
    /// checksum, every record's crc32, contiguous seqnos, its name).
    Verify {
        #[command(flatten)]
        target: Target,
    },
}

#[derive(Args, Debug)]
struct Target {
    /// The cluster config whose [archive] to read.
    #[arg(long, env = "WALSHIP_CLUSTER_CONFIG")]
    cluster: PathBuf,
    #[arg(long)]
    shard: u32,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

pub async fn run(args: ArchiveArgs) -> Result<()> {
    match args.command {
        ArchiveCommand::Ls { target } => {
            let config = archive_of(&target.cluster)?;
            let store = open_store(&config).await?;
            let listing = restore::list(store.as_ref(), &layout(&config)?, target.shard).await?;
            if target.json {
                println!("{}", serde_json::to_string_pretty(&listing)?);
                return Ok(());
            }
            for s in &listing.chain {
                println!("{:>20} {:>20}  e{:<6} {:>12} B  {}", s.first, s.last, s.epoch, s.size, s.key);
            }
            for s in &listing.unused {
                println!("(not read: covered or past a gap) {}", s.key);
            }
            let bytes: u64 = listing.chain.iter().map(|s| s.size).sum();
            println!(
                "shard {}: {} segments, {} bytes, archived through seqno {} in {}",
                target.shard,
                listing.chain.len(),
                bytes,
                listing.archived_seqno,
                store.describe()
            );
        }
        ArchiveCommand::Verify { target } => {
            let config = archive_of(&target.cluster)?;
            let store = open_store(&config).await?;
            let read =
                restore::read_back(store.as_ref(), &layout(&config)?, target.shard, Until::End, |_| Ok(())).await?;
            if let Some((from, to)) = read.gap {
                bail!(
                    "shard {}: the archive lacks seqnos {from}..={to}, and segments after them exist: {} segments \
                     ({}..={}) are intact before the gap",
                    target.shard,
                    read.segments,
                    read.first_seqno,
                    read.last_seqno
                );
            }
            if target.json {
                println!("{}", serde_json::to_string_pretty(&read)?);
            } else {
                println!(
                    "shard {}: {} segments intact, {} records ({}..={}) with every crc verified, {} bytes",
                    target.shard, read.segments, read.records, read.first_seqno, read.last_seqno, read.bytes
                );
            }
        }
    }
    Ok(())
}

#[derive(Args, Debug)]
#[command(after_help = "The restored directory is a node's data dir: `walship node --data-dir DIR` serves the \
shard from it (up to the seqno restored).")]
pub struct RestoreArgs {
    /// The cluster config whose [archive] to read.
    #[arg(long, env = "WALSHIP_CLUSTER_CONFIG")]
    cluster: PathBuf,
    #[arg(long)]
    shard: u32,
    /// Restore through this seqno.
    #[arg(long, conflicts_with = "to_time")]
    to_seqno: Option<u64>,
    /// Restore the records appended at or before this time (RFC 3339, e.g.
    /// 2026-12-01T12:00:00Z).
    #[arg(long)]
    to_time: Option<String>,
    /// The data dir to create (its `wal/` must not exist yet).
    #[arg(long)]
    into: PathBuf,
}

pub async fn run_restore(args: RestoreArgs) -> Result<()> {
    use walship_wal::store::{LogStore, ShardAppend};
    let until = match (args.to_seqno, &args.to_time) {
        (Some(s), _) => Until::Seqno(s),
        (None, Some(t)) => {
            let time = chrono::DateTime::parse_from_rfc3339(t)
                .with_context(|| format!("--to-time {t:?} is not an RFC 3339 time (2026-12-01T12:00:00Z)"))?;
            let us = time.timestamp_micros();
            if us < 0 {
                bail!("--to-time {t:?} is before 1970");
            }
            Until::TimeUs(us as u64)
        }
        (None, None) => Until::End,
    };
    let config = archive_of(&args.cluster)?;
    let store = open_store(&config).await?;
    let wal_dir = args.into.join("wal");
    if wal_dir.exists() {
        bail!("{} exists: restore writes only into a new data dir", wal_dir.display());
    }
    std::fs::create_dir_all(&wal_dir).with_context(|| format!("creating {}", wal_dir.display()))?;
    let engine = walship_wal::EngineStore::open(&wal_dir, &walship_wal::EngineStoreConfig::default())
        .with_context(|| format!("opening a WAL in {}", wal_dir.display()))?;
    let mut written_crc = crc32fast::Hasher::new();
    let shard = args.shard;
    let mut created = false;
    let read = restore::read_back(store.as_ref(), &layout(&config)?, shard, until, |frames| {
        // The restored log starts where the archive does (past seqno 1 when
        // archiving was turned on after older records were compacted).
        if !created && let Some(first) = frames.first() {
            engine.create_shard_at(shard, first.seqno()).map_err(|e| e.to_string())?;
            created = true;
        }
        for f in &frames {
            written_crc.update(f.as_bytes());
        }
        engine.append(&[ShardAppend { shard, frames }], true).map_err(|e| e.to_string())
    })
    .await?;
    if read.records == 0 {
        bail!("the archive holds no record of shard {shard} in the range asked for");
    }
    // Records asked for that the archive lacks while later ones exist: the
    // restored log would end early and look complete.
    let short = match until {
        Until::Seqno(to) => read.last_seqno < to,
        Until::End | Until::TimeUs(_) => read.gap.is_some_and(|(from, _)| from == read.last_seqno + 1),
    };
    if short {
        let _ = std::fs::remove_dir_all(&wal_dir);
        match read.gap {
            Some((from, to)) => bail!(
                "the archive of shard {shard} lacks seqnos {from}..={to} (segments after them exist); nothing \
                 restored"
            ),
            None => bail!(
                "the archive of shard {shard} ends at seqno {}, before the seqno asked for; nothing restored",
                read.last_seqno
            ),
        }
    }
    // Read the restored log back: every record again, crc checked by the
    // store, the same bytes as what was written.
    let mut read_crc = crc32fast::Hasher::new();
    let mut next = read.first_seqno;
    let mut verified = 0u64;
    while next <= read.last_seqno {
        let frames = engine.read(shard, next, read.last_seqno, 8 << 20)?;
        let Some(last) = frames.last() else { bail!("the restored log ends at {next} before {}", read.last_seqno) };
        next = last.seqno() + 1;
        verified += frames.len() as u64;
        for f in &frames {
            read_crc.update(f.as_bytes());
        }
    }
    if verified != read.records || read_crc.finalize() != written_crc.finalize() {
        bail!("the restored log does not read back as written ({verified} of {} records)", read.records);
    }
    engine.mark_clean_shutdown()?;
    println!(
        "restored shard {shard}: {} records (seqnos {}..={}) from {} segments ({} bytes) of {} into {}; every record's \
         crc verified on the way in and {verified} read back unchanged",
        read.records,
        read.first_seqno,
        read.last_seqno,
        read.segments,
        read.bytes,
        store.describe(),
        wal_dir.display()
    );
    Ok(())
}
