//! `walship-memory`: a walship node's resident memory per retained record,
//! and single-record read latency from the middle of the log, for one
//! binary or a binary against a baseline. See `walship_compare::memory`
//! for what a run does and `ops/bench/README.md` for how to run it.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Parser;
use walship_compare::memory::report::{self, MemoryReport, Settings};
use walship_compare::memory::{self, RunSpec};
use walship_compare::walship;

#[derive(Parser, Debug)]
#[command(about = "walship node memory per retained record, and single-record read latency")]
struct Args {
    /// The walship binary measured (default: `walship` beside this binary).
    #[arg(long)]
    walship: Option<PathBuf>,
    /// Measure this binary too, the same way, after the first, and report
    /// new ÷ baseline.
    #[arg(long)]
    baseline: Option<PathBuf>,
    /// Data directories of the clusters and the disk measurement.
    #[arg(long, default_value = ".walship/memory")]
    dir: PathBuf,
    /// Where memory.md, memory.json and memory-samples.csv are written.
    #[arg(long, default_value = "ops/bench/results")]
    out: PathBuf,
    /// Seconds of append load per binary.
    #[arg(long, default_value_t = 180.0)]
    duration: f64,
    /// The growth figures run from the first sample at or after this many
    /// seconds of load to the end.
    #[arg(long, default_value_t = 10.0)]
    warmup: f64,
    /// Concurrent clients, each with one append outstanding.
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// Payload bytes per record.
    #[arg(long, default_value_t = 100)]
    record_bytes: usize,
    /// Single-record reads from the older half of the log, after the load.
    #[arg(long, default_value_t = 2000)]
    reads: usize,
    /// Seconds between samples.
    #[arg(long, default_value_t = 1.0)]
    sample_every: f64,
    /// Retention per shard (`replication.retain_bytes` and
    /// `max_retain_bytes`): high enough that nothing is compacted in a run.
    #[arg(long, default_value_t = 64 << 30)]
    retain_bytes: u64,
    /// Passed to every node as `--wal-spare-bytes` (default: not passed,
    /// so the node's default of 2 GiB of spare WAL files applies).
    #[arg(long)]
    wal_spare_bytes: Option<u64>,
    /// Do not write memory-samples.csv.
    #[arg(long)]
    no_samples: bool,
}

impl Args {
    fn validate(&self) -> Result<()> {
        if !(self.duration > 0.0 && self.duration.is_finite()) {
            bail!("--duration must be a positive number of seconds");
        }
        if !(self.warmup >= 0.0 && self.warmup < self.duration) {
            bail!("--warmup must be at least 0 and less than --duration");
        }
        if !(self.sample_every >= 0.1 && self.sample_every <= self.duration) {
            bail!("--sample-every must be between 0.1 s and --duration");
        }
        if self.clients == 0 || self.reads == 0 || self.record_bytes == 0 {
            bail!("--clients, --reads and --record-bytes must be at least 1");
        }
        if self.record_bytes > 1 << 20 {
            bail!("--record-bytes above 1 MiB are not supported");
        }
        for binary in
            std::iter::once(self.walship.clone().unwrap_or_else(walship::default_binary)).chain(self.baseline.clone())
        {
            if !binary.is_file() {
                bail!("walship binary not found at {}", binary.display());
            }
        }
        Ok(())
    }

    fn spec(&self, label: &str, binary: PathBuf) -> RunSpec {
        let node_flags = match self.wal_spare_bytes {
            Some(n) => vec!["--wal-spare-bytes".into(), n.to_string()],
            None => Vec::new(),
        };
        RunSpec {
            label: label.into(),
            walship: binary,
            dir: memory::run_dir(&self.dir, label),
            clients: self.clients,
            record_bytes: self.record_bytes,
            duration: Duration::from_secs_f64(self.duration),
            warmup_s: self.warmup,
            reads: self.reads,
            retain_bytes: self.retain_bytes,
            sample_every: Duration::from_secs_f64(self.sample_every),
            node_flags,
        }
    }
}

async fn run(args: Args) -> Result<()> {
    args.validate()?;
    let started_utc = walship_compare::report::utc_now();
    std::fs::create_dir_all(&args.dir).with_context(|| format!("creating {}", args.dir.display()))?;
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    eprintln!("measuring the raw disk under {} ...", args.dir.display());
    let disk = walship_wal::disk::measure(&args.dir).context("measuring the disk")?;
    eprintln!(
        "raw disk: 4 KiB fdatasync p50 {:.0} µs, p99 {:.0} µs; sequential write {:.0} MiB/s",
        disk.fdatasync_4k_p50_us, disk.fdatasync_4k_p99_us, disk.seq_write_mib_s
    );
    let mut specs = vec![args.spec("new", args.walship.clone().unwrap_or_else(walship::default_binary))];
    if let Some(baseline) = &args.baseline {
        specs.push(args.spec("baseline", baseline.clone()));
    }
    let run_dirs: Vec<PathBuf> = specs.iter().map(|s| s.dir.clone()).collect();
    let mut outcomes = Vec::new();
    for spec in &specs {
        // A quiet disk: no run pays for the writeback of the one before.
        memory::quiet_disk(&run_dirs)?;
        eprintln!(
            "{}: {} clients × {} B for {} s against {} ...",
            spec.label,
            spec.clients,
            spec.record_bytes,
            spec.duration.as_secs_f64(),
            spec.walship.display()
        );
        let outcome = memory::run(spec).await.with_context(|| format!("the {} run", spec.label))?;
        let f = report::figures(&outcome);
        for n in &f.nodes {
            eprintln!(
                "{:>9} node {} ({}): RSS {:.1} → {:.1} MiB, {} records, {} MiB per 10 M records, slope {} bytes/record",
                spec.label,
                n.node,
                n.role,
                n.rss_warmup_bytes as f64 / (1 << 20) as f64,
                n.rss_end_bytes as f64 / (1 << 20) as f64,
                n.retained_end,
                n.rss_growth_per_10m_mib.map_or("n/a".into(), |v| format!("{v:.1}")),
                n.slope_bytes_per_record.map_or("n/a".into(), |v| format!("{v:.1}")),
            );
        }
        eprintln!(
            "{:>9}: {:.0} records/s; reads p50 {:.0} µs, p99 {:.0} µs, {} errors",
            spec.label, f.records_per_s, f.reads.p50_us, f.reads.p99_us, f.reads.errors
        );
        outcomes.push(outcome);
    }
    memory::quiet_disk(&run_dirs)?;
    let _ = std::fs::remove_dir_all(&args.dir);

    let runs: Vec<_> = outcomes.iter().map(report::figures).collect();
    let ratios = match runs.as_slice() {
        [new, baseline] => report::ratios(new, baseline),
        _ => Vec::new(),
    };
    let doc = MemoryReport {
        settings: Settings {
            command: std::env::args().collect::<Vec<_>>().join(" "),
            started_utc,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            walship: specs[0].walship.display().to_string(),
            baseline: args.baseline.as_ref().map(|b| b.display().to_string()),
            clients: args.clients,
            record_bytes: args.record_bytes,
            duration_s: args.duration,
            warmup_s: args.warmup,
            reads: args.reads,
            retain_bytes: args.retain_bytes,
            sample_every_s: args.sample_every,
            node_flags: specs[0].node_flags.clone(),
        },
        disk,
        runs,
        ratios,
    };
    let markdown = doc.markdown();
    std::fs::write(args.out.join("memory.md"), &markdown)?;
    std::fs::write(args.out.join("memory.json"), serde_json::to_string_pretty(&doc)? + "\n")?;
    if !args.no_samples {
        std::fs::write(args.out.join("memory-samples.csv"), report::samples_csv(&outcomes))?;
    }
    println!("{markdown}");
    eprintln!(
        "wrote memory.md, memory.json{} to {}",
        if args.no_samples { "" } else { ", memory-samples.csv" },
        args.out.display()
    );
    let failed: Vec<String> = doc
        .runs
        .iter()
        .filter(|r| r.reads.errors > 0)
        .map(|r| format!("{}: {} of {} reads failed", r.label, r.reads.errors, r.reads.requested))
        .collect();
    if !failed.is_empty() {
        bail!("{}", failed.join("; "));
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    // Ctrl-C returns through the normal path: dropping the running cluster
    // stops every process it started.
    tokio::select! {
        result = run(args) => result,
        _ = tokio::signal::ctrl_c() => bail!("interrupted"),
    }
}
