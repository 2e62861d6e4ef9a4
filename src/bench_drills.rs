//! `walship bench-drills`: the failover drill N times and the catch-up drill
//! once on a fresh 3-node `walship dev` cluster (default settings, release
//! build), with the raw disk measured in the same run.
//!
//! Prints p50/p99/max of `time_to_new_leader_ms` and the total lost, and
//! the catch-up rate against the raw sequential-write limit and the live
//! append throughput during catch-up against before it.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::json;

use crate::drill::{Admin, run_drill};

#[derive(Args, Debug)]
pub struct BenchDrillsArgs {
    /// Where the cluster and the baseline files live.
    #[arg(long, default_value = ".walship/bench-drills")]
    dir: PathBuf,
    /// Failover drills to run (shards rotate).
    #[arg(long, default_value_t = 50)]
    failovers: usize,
    /// MiB the catch-up drill appends while its follower is paused (0 skips it).
    #[arg(long, default_value_t = 256)]
    catchup_mib: u64,
    /// Also write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn percentile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() as f64 - 1.0) * q).round() as usize]
}

pub async fn run(args: BenchDrillsArgs) -> Result<()> {
    let _ = std::fs::remove_dir_all(&args.dir);
    std::fs::create_dir_all(&args.dir)?;
    eprintln!("measuring the raw disk under {} ...", args.dir.display());
    let base = crate::bench::measure_baseline(&args.dir)?;
    let token = format!("{:032x}", rand::random::<u128>());
    let mut dev = Command::new(std::env::current_exe()?)
        .args(["dev", "--base-port", "0", "--admin-token", &token, "--data-dir"])
        .arg(args.dir.join("cluster"))
        .env("WALSHIP_LOG", "error")
        .stdout(Stdio::piped())
        .spawn()
        .context("starting walship dev")?;
    let stdout = dev.stdout.take().context("dev stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let admin = loop {
        let line = lines.next().context("walship dev ended before printing its coordinator")??;
        if let Some(url) = line.split_whitespace().find(|w| w.starts_with("http://") && line.contains("coordinator")) {
            break url.trim_end_matches("/v1/shards").to_string();
        }
    };
    // Keep draining dev's stdout so it never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    let admin = Admin { url: admin, token: Some(token) };
    let result = drills(&args, &admin, &base).await;
    // SAFETY: kill(2) on the child this process spawned; dev stops its own children on SIGTERM.
    unsafe { libc::kill(dev.id() as i32, libc::SIGTERM) };
    let _ = dev.wait();
    result
}

async fn wait_healthy(admin: &Admin) -> Result<()> {
    for _ in 0..300 {
        let (code, shards) = crate::http::request("GET", &admin.url, "/v1/shards", None, None).await?;
        let healthy = code == 200
            && shards.as_array().is_some_and(|a| {
                a.iter().all(|s| {
                    s["leader"].is_u64()
                        && s["replicas"]
                            .as_array()
                            .is_some_and(|r| r.iter().all(|r| r["alive"] == true && r["role"] != "unassigned"))
                })
            });
        if healthy {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bail!("the cluster did not become healthy within 30 s")
}

async fn drills(args: &BenchDrillsArgs, admin: &Admin, base: &crate::bench::Baseline) -> Result<()> {
    let mut times = Vec::new();
    let mut lost = 0;
    let mut divergent = 0;
    let mut acked = 0;
    for i in 0..args.failovers {
        wait_healthy(admin).await?;
        let shard = 1 + (i % 4) as u32;
        let report = run_drill(admin, "/v1/drills/failover", json!({"shard": shard}), true).await?;
        if report["state"] != "done" {
            bail!("drill {i} failed: {report}");
        }
        let f = &report["failover"];
        times.push(f["time_to_new_leader_ms"].as_u64().unwrap_or(0));
        lost += f["lost"].as_u64().unwrap_or(0);
        divergent += f["divergent_replicas"].as_u64().unwrap_or(0);
        acked += f["acked"].as_u64().unwrap_or(0);
        eprintln!("failover drill {:>2}/{}: shard {shard}, {} ms, lost {}", i + 1, args.failovers, times[i], f["lost"]);
    }
    times.sort_unstable();
    let mut out = json!({
        "baseline": base,
        "failover_drills": {
            "runs": times.len(),
            "time_to_new_leader_ms": {"p50": percentile(&times, 0.5), "p99": percentile(&times, 0.99), "max": times.last().copied().unwrap_or(0)},
            "acked": acked,
            "lost": lost,
            "divergent_replicas": divergent,
        },
    });
    println!(
        "failover drill x{}: time to new leader p50 {} ms, p99 {} ms, max {} ms; {} acknowledged, lost {}, divergent replicas {}",
        times.len(),
        percentile(&times, 0.5),
        percentile(&times, 0.99),
        times.last().copied().unwrap_or(0),
        acked,
        lost,
        divergent
    );
    if args.catchup_mib > 0 {
        wait_healthy(admin).await?;
        let report = run_drill(
            admin,
            "/v1/drills/catchup",
            json!({"shard": 1, "volume_bytes": args.catchup_mib << 20, "record_bytes": 16384, "clients": 16}),
            false,
        )
        .await?;
        if report["state"] != "done" {
            bail!("catch-up drill failed: {report}");
        }
        let c = &report["catchup"];
        let rate = c["catchup_mib_per_s"].as_f64().unwrap_or(0.0);
        let before = c["append_rate_before"].as_f64().unwrap_or(0.0);
        let during = c["append_rate_during_catchup"].as_f64().unwrap_or(0.0);
        println!(
            "catch-up drill: {} MiB behind caught up in {:.2} s = {:.0} MiB/s = {:.2} x raw sequential write ({:.0} MiB/s); live appends {:.0}/s during vs {:.0}/s before = {:.2}",
            c["bytes_behind"].as_u64().unwrap_or(0) >> 20,
            c["catchup_seconds"].as_f64().unwrap_or(0.0),
            rate,
            rate / base.seq_write_mib_s,
            base.seq_write_mib_s,
            during,
            before,
            if before > 0.0 { during / before } else { 0.0 }
        );
        out["catchup_drill"] = c.clone();
        out["catchup_drill"]["ratio_to_disk"] = json!(rate / base.seq_write_mib_s);
        out["catchup_drill"]["live_ratio"] = json!(if before > 0.0 { during / before } else { 0.0 });
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&out)? + "\n")?;
    }
    if lost > 0 || divergent > 0 {
        bail!("drills found lost or divergent records");
    }
    Ok(())
}
