//! `walship drill failover|catchup|corruption|partition|reseed`: start a drill on
//! the coordinator's admin API, show its progress, print a summary of its
//! report (the report as JSON with `--json`). Warns first that the drill
//! appends records into the live shard. Exits non-zero when the drill
//! failed or found what it must not (records lost, a leader acknowledging
//! after losing its majority).

use std::time::Duration;

use anyhow::{Result, bail};
use clap::{Args, Subcommand};

use crate::http;

#[derive(Args, Debug, Clone)]
pub struct AdminArgs {
    /// The coordinator's admin URL [default: the client config's `admin`, else http://127.0.0.1:7480].
    #[arg(long, global = true, env = "WALSHIP_ADMIN")]
    pub admin: Option<String>,
    /// Bearer token of the coordinator's mutating endpoints [default: the client config's `token`].
    #[arg(long, global = true, env = "WALSHIP_TOKEN")]
    pub token: Option<String>,
}

/// Where the coordinator's admin API is, resolved from flags, environment
/// and the client config file (in that order).
#[derive(Debug, Clone)]
pub struct Admin {
    pub url: String,
    pub token: Option<String>,
}

impl AdminArgs {
    pub fn resolve(&self) -> Result<Admin> {
        let file = crate::client_config::load()?;
        Ok(Admin {
            url: self.admin.clone().or(file.admin).unwrap_or_else(|| "http://127.0.0.1:7480".into()),
            token: self.token.clone().or(file.token),
        })
    }
}

#[derive(Args, Debug)]
#[command(after_help = "A drill appends records into the live shard it drills; they stay in its log. The coordinator \
refuses (409 drill_would_evict) a drill that would write more than the shard's headroom below \
replication.retain_bytes, so that retention never compacts records written before the drill on its account.")]
pub struct DrillArgs {
    #[command(subcommand)]
    pub kind: DrillKind,
    /// Print the drill's report as JSON on stdout instead of a summary.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(flatten)]
    pub admin: AdminArgs,
}

#[derive(Subcommand, Debug)]
pub enum DrillKind {
    /// Fail the shard's leader under QUORUM load; report the time to a new leader and verify nothing acknowledged was lost.
    Failover {
        #[arg(long)]
        shard: u32,
        /// Concurrent appenders of the load generator.
        #[arg(long, default_value_t = 8)]
        clients: usize,
    },
    /// Pause a follower, append a volume, resume it; report catch-up time and rate and live throughput meanwhile.
    Catchup {
        #[arg(long)]
        shard: u32,
        /// Follower to pause (default: the first follower).
        #[arg(long)]
        follower: Option<u32>,
        /// MiB appended while the follower is paused.
        #[arg(long, default_value_t = 64)]
        volume_mib: u64,
        /// Record size in bytes.
        #[arg(long, default_value_t = 4096)]
        record_bytes: usize,
    },
    /// Dev and test clusters only (nodes started with --allow-crash-drills): under a light QUORUM load, make a replica damage its stored copy of one committed record; report detection and repair times, bytes refetched and records lost (must be 0).
    Corruption {
        #[arg(long)]
        shard: u32,
        /// Replica whose copy is damaged (default: the first follower).
        #[arg(long)]
        node: Option<u32>,
        /// Allow damaging the leader's copy (the shard then fails over).
        #[arg(long)]
        allow_leader: bool,
        /// Concurrent appenders of the light load.
        #[arg(long, default_value_t = 2)]
        clients: usize,
    },
    /// Dev and test clusters only (nodes started with --allow-crash-drills): cut the shard's leader from its followers (or one follower from the leader) under QUORUM load, while every node still reaches the coordinator. The partition is simulated at the replication layer by the nodes themselves (they drop replication traffic with the cut peers), not by the network. Per trial and overall: time to a new leader's first QUORUM ack (p50, p99, max), failovers, records lost (must be 0), and LOCAL acks the old leader gave after losing its majority (must be 0 past the replication timeout).
    Partition {
        #[arg(long)]
        shard: u32,
        /// What is cut: `leader,followers` (a failover is expected) or `follower,leader` (the first follower cut from the leader; no failover is expected).
        #[arg(long, default_value = "leader,followers")]
        between: String,
        /// How long each trial's partition lasts, from the cut.
        #[arg(long, default_value_t = 2)]
        seconds: u64,
        /// Trials, one after another (1..=20).
        #[arg(long, default_value_t = 1)]
        trials: u32,
        /// Concurrent QUORUM appenders of the load generator.
        #[arg(long, default_value_t = 8)]
        clients: usize,
    },
    /// Dev and test clusters only (nodes started with --allow-crash-drills, an [archive] configured): append a volume, wait until the object store holds it, wipe one follower's copy of the shard and let it rebuild by tiers (peers, the object store, then the leader; --source picks one) under QUORUM load; report bytes and MiB/s by source, live throughput during the rebuild, and records lost (must be 0) with every replica byte-identical.
    #[command(alias = "rebuild")]
    Reseed {
        #[arg(long)]
        shard: u32,
        /// Where the follower takes sealed segments from: all (peers, then the object store), peer, archive, or stream (the leader only).
        #[arg(long, default_value = "all")]
        source: String,
        /// Follower to wipe (default: the first follower).
        #[arg(long)]
        follower: Option<u32>,
        /// MiB appended (and archived) before the wipe.
        #[arg(long, default_value_t = 64)]
        volume_mib: u64,
        /// Record size in bytes.
        #[arg(long, default_value_t = 4096)]
        record_bytes: usize,
        /// Concurrent appenders of the live load.
        #[arg(long, default_value_t = 8)]
        clients: usize,
    },
}

/// Starts a drill and waits for its report; returns the report.
pub async fn run_drill(admin: &Admin, path: &str, body: serde_json::Value, quiet: bool) -> Result<serde_json::Value> {
    let (status, started) =
        http::request("POST", &admin.url, path, Some(&body.to_string()), admin.token.as_deref()).await?;
    if status != 202 {
        bail!("the coordinator refused the drill ({status}): {started}");
    }
    let report_path = started["report"].as_str().unwrap_or_default().to_string();
    let spinner = if quiet { indicatif::ProgressBar::hidden() } else { indicatif::ProgressBar::new_spinner() };
    spinner.set_style(
        indicatif::ProgressStyle::with_template("{spinner} [{elapsed}] {prefix}: {msg}").expect("valid template"),
    );
    spinner.set_prefix(started["id"].as_str().unwrap_or_default().to_string());
    spinner.enable_steady_tick(Duration::from_millis(100));
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (status, report) = http::request("GET", &admin.url, &report_path, None, None).await?;
        if status != 200 {
            spinner.abandon();
            bail!("reading {report_path}: {status} {report}");
        }
        spinner.set_message(report["progress"].as_str().unwrap_or_default().to_string());
        if report["state"] != "running" {
            spinner.finish_with_message(report["state"].as_str().unwrap_or_default().to_string());
            return Ok(report);
        }
    }
}

pub async fn run(args: DrillArgs) -> Result<()> {
    let shard = match &args.kind {
        DrillKind::Failover { shard, .. }
        | DrillKind::Catchup { shard, .. }
        | DrillKind::Corruption { shard, .. }
        | DrillKind::Partition { shard, .. }
        | DrillKind::Reseed { shard, .. } => *shard,
    };
    eprintln!(
        "note: this drill appends records into the live shard {shard}, and they stay in its log; the coordinator \
         refuses it if they would make retention compact records written before it"
    );
    let (path, body) = match args.kind {
        DrillKind::Failover { shard, clients } => {
            ("/v1/drills/failover", serde_json::json!({"shard": shard, "clients": clients}))
        }
        DrillKind::Catchup { shard, follower, volume_mib, record_bytes } => (
            "/v1/drills/catchup",
            serde_json::json!({"shard": shard, "follower": follower, "volume_bytes": volume_mib << 20, "record_bytes": record_bytes}),
        ),
        DrillKind::Corruption { shard, node, allow_leader, clients } => (
            "/v1/drills/corruption",
            serde_json::json!({"shard": shard, "node": node, "allow_leader": allow_leader, "clients": clients}),
        ),
        DrillKind::Partition { shard, between, seconds, trials, clients } => (
            "/v1/drills/partition",
            serde_json::json!({"shard": shard, "between": between, "seconds": seconds, "trials": trials, "clients": clients}),
        ),
        DrillKind::Reseed { shard, source, follower, volume_mib, record_bytes, clients } => (
            "/v1/drills/reseed",
            serde_json::json!({"shard": shard, "follower": follower, "volume_bytes": volume_mib << 20,
                "record_bytes": record_bytes, "clients": clients, "source": source}),
        ),
    };
    let report = run_drill(&args.admin.resolve()?, path, body, args.json).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", summary(&report));
    }
    if report["state"] != "done" {
        bail!("drill failed: {}", report["error"]);
    }
    if report["failover"]["lost"].as_u64().is_some_and(|l| l > 0)
        || report["failover"]["divergent_replicas"].as_u64().is_some_and(|d| d > 0)
    {
        bail!("the drill found lost or divergent records");
    }
    let corruption = &report["corruption"];
    if !corruption.is_null()
        && (corruption["records_lost"].as_u64() != Some(0) || corruption["repaired"] != serde_json::Value::Bool(true))
    {
        bail!("the damaged replica did not repair itself, or records were lost");
    }
    let reseed = &report["reseed"];
    if !reseed.is_null() && (reseed["lost"].as_u64() != Some(0) || reseed["divergent_replicas"].as_u64() != Some(0)) {
        bail!("the re-seeded follower lost acknowledged records or differs from the leader");
    }
    let partition = &report["partition"];
    if !partition.is_null() {
        if partition["records_lost"].as_u64() != Some(0) {
            bail!("the partition drill lost acknowledged records");
        }
        if partition["old_leader_local_acks_after_timeout"].as_u64().is_some_and(|n| n > 0) {
            bail!("the old leader acknowledged LOCAL appends after losing its majority for the replication timeout");
        }
        if partition["between"] == "follower,leader" && partition["failovers"].as_u64() != Some(0) {
            bail!("cutting one follower from the leader failed the shard over");
        }
    }
    Ok(())
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64)
}

fn nodes(list: &serde_json::Value) -> String {
    list.as_array().map_or_else(String::new, |a| a.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(", "))
}

/// A few lines a person reads: what the drill did and found.
pub fn summary(report: &serde_json::Value) -> String {
    let n = |v: &serde_json::Value| v.as_u64().unwrap_or(0);
    let f = |v: &serde_json::Value| v.as_f64().unwrap_or(0.0);
    let mut out = format!(
        "{} drill {} on shard {}: {}\n",
        report["kind"].as_str().unwrap_or("?"),
        report["id"].as_str().unwrap_or("?"),
        report["shard"],
        report["state"].as_str().unwrap_or("?")
    );
    if let Some(error) = report["error"].as_str() {
        out += &format!("  error: {error}\n");
    }
    let failover = &report["failover"];
    if !failover.is_null() {
        out += &format!(
            "  leader {} -> {} (epoch {} -> {}, by {}); the new leader acknowledged {} ms after the loss\n",
            failover["old_leader"],
            failover["new_leader"],
            failover["old_epoch"],
            failover["new_epoch"],
            failover["method"].as_str().unwrap_or("?"),
            n(&failover["time_to_new_leader_ms"])
        );
        out += &format!(
            "  {} records acknowledged under load: {} lost, {} divergent replicas (checked nodes {})\n",
            n(&failover["acked"]),
            n(&failover["lost"]),
            n(&failover["divergent_replicas"]),
            nodes(&failover["checked_replicas"])
        );
    }
    let catchup = &report["catchup"];
    if !catchup.is_null() {
        out += &format!(
            "  follower {} was {} records ({}) behind; caught up in {:.2} s ({:.1} MiB/s)\n",
            catchup["follower"],
            n(&catchup["records_behind"]),
            mib(n(&catchup["bytes_behind"])),
            f(&catchup["catchup_seconds"]),
            f(&catchup["catchup_mib_per_s"])
        );
        out += &format!(
            "  appends: {:.0}/s before the pause, {:.0}/s during the catch-up\n",
            f(&catchup["append_rate_before"]),
            f(&catchup["append_rate_during_catchup"])
        );
    }
    let corruption = &report["corruption"];
    if !corruption.is_null() {
        out += &format!(
            "  node {} damaged seqno {}: detected after {} ms, repaired after {} ms, {} refetched; {} acknowledged, {} lost\n",
            corruption["node"],
            corruption["seqno"],
            n(&corruption["detection_ms"]),
            n(&corruption["repair_ms"]),
            mib(n(&corruption["bytes_refetched"])),
            n(&corruption["acked"]),
            n(&corruption["records_lost"])
        );
    }
    let reseed = &report["reseed"];
    if !reseed.is_null() {
        out += &format!(
            "  follower {} wiped ({} records) and rebuilt {} records in {:.2} s ({:.1} MiB/s overall)\n",
            reseed["follower"],
            n(&reseed["records_wiped"]),
            n(&reseed["records"]),
            f(&reseed["seconds"]),
            f(&reseed["total_mib_per_s"])
        );
        out += &format!(
            "  by source ({}): peers {} and archive {} in {:.2} s ({:.1} MiB/s), stream {}, push {}\n",
            reseed["source"].as_str().unwrap_or("all"),
            mib(n(&reseed["bytes_peer"])),
            mib(n(&reseed["bytes_archive"])),
            f(&reseed["archive_seconds"]),
            f(&reseed["archive_mib_per_s"]),
            mib(n(&reseed["bytes_stream"])),
            mib(n(&reseed["bytes_push"]))
        );
        out += &format!(
            "  appends: {:.0}/s before, {:.0}/s during the rebuild; {} acknowledged, {} lost, {} divergent replicas\n",
            f(&reseed["append_rate_before"]),
            f(&reseed["append_rate_during"]),
            n(&reseed["acked"]),
            n(&reseed["lost"]),
            n(&reseed["divergent_replicas"])
        );
    }
    let partition = &report["partition"];
    if !partition.is_null() {
        let times = &partition["time_to_new_leader"];
        out += &format!(
            "  cut {} for {} s, {} trial(s): {} failovers, {} records lost",
            partition["between"].as_str().unwrap_or("?"),
            partition["seconds"],
            partition["trials"].as_array().map_or(0, Vec::len),
            n(&partition["failovers"]),
            n(&partition["records_lost"])
        );
        if !times.is_null() {
            out += &format!("; time to a new leader p50 {} ms, max {} ms", n(&times["p50_ms"]), n(&times["max_ms"]));
        }
        if !partition["old_leader_local_acks_after_timeout"].is_null() {
            out += &format!(
                "; old leader's LOCAL acks past the replication timeout: {}",
                n(&partition["old_leader_local_acks_after_timeout"])
            );
        }
        out += "\n";
    }
    out += &format!(
        "  wrote {} into shard {} (its retention headroom was {}); --json prints the whole report\n",
        mib(n(&report["bytes_written"])),
        report["shard"],
        mib(n(&report["retention_headroom_bytes"]))
    );
    out
}
