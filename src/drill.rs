//! `walship drill failover|catchup`: start a drill on the coordinator's
//! admin API, show its progress, print its report (JSON on stdout).

use std::time::Duration;

use anyhow::{Result, bail};
use clap::{Args, Subcommand};

use crate::http;

#[derive(Args, Debug, Clone)]
pub struct AdminArgs {
    /// The coordinator's admin URL.
    #[arg(long, global = true, env = "WALSHIP_ADMIN", default_value = "http://127.0.0.1:7480")]
    pub admin: String,
    /// Bearer token of the coordinator's mutating endpoints.
    #[arg(long, global = true, env = "WALSHIP_TOKEN")]
    pub token: Option<String>,
}

#[derive(Args, Debug)]
pub struct DrillArgs {
    #[command(subcommand)]
    pub kind: DrillKind,
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
}

/// Starts a drill and waits for its report; returns the report.
pub async fn run_drill(
    admin: &AdminArgs,
    path: &str,
    body: serde_json::Value,
    quiet: bool,
) -> Result<serde_json::Value> {
    let (status, started) =
        http::request("POST", &admin.admin, path, Some(&body.to_string()), admin.token.as_deref()).await?;
    if status != 202 {
        bail!("the coordinator refused the drill ({status}): {started}");
    }
    let report_path = started["report"].as_str().unwrap_or_default().to_string();
    let mut last = String::new();
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (status, report) = http::request("GET", &admin.admin, &report_path, None, None).await?;
        if status != 200 {
            bail!("reading {report_path}: {status} {report}");
        }
        let progress = report["progress"].as_str().unwrap_or_default().to_string();
        if progress != last && !quiet {
            eprintln!("[{}] {progress}", report["id"].as_str().unwrap_or_default());
            last = progress;
        }
        if report["state"] != "running" {
            return Ok(report);
        }
    }
}

pub async fn run(args: DrillArgs) -> Result<()> {
    let (path, body) = match args.kind {
        DrillKind::Failover { shard, clients } => {
            ("/v1/drills/failover", serde_json::json!({"shard": shard, "clients": clients}))
        }
        DrillKind::Catchup { shard, follower, volume_mib, record_bytes } => (
            "/v1/drills/catchup",
            serde_json::json!({"shard": shard, "follower": follower, "volume_bytes": volume_mib << 20, "record_bytes": record_bytes}),
        ),
    };
    let report = run_drill(&args.admin, path, body, false).await?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    if report["state"] != "done" {
        bail!("drill failed: {}", report["error"]);
    }
    if report["failover"]["lost"].as_u64().is_some_and(|l| l > 0)
        || report["failover"]["divergent_replicas"].as_u64().is_some_and(|d| d > 0)
    {
        bail!("the drill found lost or divergent records");
    }
    Ok(())
}
