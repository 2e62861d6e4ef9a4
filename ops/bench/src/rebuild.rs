//! `walship-rebuild`: how fast a lost replica comes back, walship against
//! PostgreSQL, on the same disk in one run.
//!
//! * **Raw sequential write** of the disk under `--dir`
//!   ([`walship_wal::disk::measure`]: 1 MiB writes, an fdatasync every
//!   8 MiB and at the end): the limit both systems are divided by.
//! * **walship re-seed from the archive** ([`walship_reseed`]): a
//!   `walship dev` cluster (three nodes, a coordinator, archiving into a
//!   local directory) runs the coordinator's re-seed drill
//!   (`POST /v1/drills/reseed`): it appends `volume_bytes` into a shard
//!   under live load, wipes one follower's copy of it, and lets that
//!   follower re-seed from the object store while the load goes on. Its
//!   report gives the re-seed rate from the sealed-segment tiers (peers, object store) and overall
//!   (object store, catch-up stream from the leader and live pushes
//!   together), and the live append rate before and during.
//! * **PostgreSQL standby rebuild** ([`crate::pg::rebuild_standby`]): the
//!   same number of bytes loaded into a primary, then `pg_basebackup -X
//!   stream --checkpoint=fast` into a fresh directory, timed.
//! * **NATS JetStream replica catch-up**
//!   ([`crate::nats_rebuild::rebuild_replica`]): the same volume appended
//!   into an R3 stream with the drill's load, then one non-leader server
//!   killed, its store deleted and the server restarted, timed until its
//!   replica has caught up, with a live load on the two others.
//!
//! Each system runs on a quiet disk (everything written before is flushed
//! first) and its data is removed after it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde::{Deserialize, Serialize};
use serde_json::json;
use walship_wal::disk::DiskBaseline;

use crate::nats_rebuild::NatsCatchup;
use crate::pg::Basebackup;
use crate::proc::Server;
use crate::walship::http_request;

/// Re-seed rate a re-seed should reach, as a fraction of raw sequential write.
pub const RESEED_TARGET: f64 = 0.60;
/// Live append rate during a re-seed a re-seed should leave, as a fraction
/// of the rate before it.
pub const LIVE_TARGET: f64 = 0.80;

/// How long `walship dev` may take to print its coordinator, and its shards
/// to get leaders and live replicas.
const DEV_READY_TIMEOUT: Duration = Duration::from_secs(90);

/// The re-seed drill to run.
#[derive(Debug, Clone)]
pub struct ReseedSpec {
    /// The walship binary (`walship dev` runs from it).
    pub walship: PathBuf,
    /// The run's directory: the dev cluster keeps its data in `dir/walship`
    /// (wiped first, removed after) and its output in `dir/walship-dev.log`.
    pub dir: PathBuf,
    pub shard: u32,
    pub follower: Option<u32>,
    pub volume_bytes: u64,
    pub record_bytes: usize,
    pub clients: usize,
    /// Which tier the follower takes sealed segments from (`all`, `peer`,
    /// `archive`, `stream`; the drill's `source`).
    pub source: String,
    /// `walship dev --peer-serve-mib-per-s` (0 = unlimited); `None` leaves
    /// the nodes' default (64 MiB/s).
    pub peer_serve_mib_per_s: Option<u64>,
}

/// The drill report's `reseed` object, as the coordinator gives it
/// (`walship_shipping::control::ReseedDrillResult`; read here field by
/// field, so a renamed field fails the run instead of reading as zero).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Reseed {
    /// The wiped follower and the leader it rebuilt from.
    pub follower: u32,
    pub leader: u32,
    /// Records the follower held when wiped.
    pub records_wiped: u64,
    /// Records it had to rebuild.
    pub records: u64,
    pub archived_seqno_at_wipe: u64,
    /// Segment bytes the follower applied during the rebuild, by source.
    pub bytes_archive: u64,
    /// Sealed segments fetched from other replicas (PeerExchange).
    pub bytes_peer: u64,
    /// The tier the drill was told to use.
    pub source: String,
    pub bytes_stream: u64,
    pub bytes_push: u64,
    /// Wipe → the follower durable at the leader's position at the wipe.
    pub seconds: f64,
    /// Wipe → its last segment from the object store.
    pub archive_seconds: f64,
    /// `bytes_archive` over `archive_seconds`.
    pub archive_mib_per_s: f64,
    /// Every byte applied over `seconds`.
    pub total_mib_per_s: f64,
    /// QUORUM appends/s before the drill and during the rebuild.
    pub append_rate_before: f64,
    pub append_rate_during: f64,
    pub acked: u64,
    pub lost: u64,
    pub divergent_replicas: u64,
}

/// Starts `walship dev` under `spec.dir`, runs the re-seed drill to its
/// end, stops the cluster and returns the drill's figures.
pub async fn walship_reseed(spec: &ReseedSpec) -> Result<Reseed> {
    ensure!(spec.walship.is_file(), "walship binary not found at {}", spec.walship.display());
    let data = spec.dir.join("walship");
    let log = spec.dir.join("walship-dev.log");
    let _ = std::fs::remove_dir_all(&data);
    let _ = std::fs::remove_file(&log);
    std::fs::create_dir_all(&spec.dir).with_context(|| format!("creating {}", spec.dir.display()))?;
    let token = format!("{:032x}", rand::random::<u128>());
    let mut command = Command::new(&spec.walship);
    command
        .args(["dev", "--base-port", "0", "--admin-token", &token, "--data-dir"])
        .arg(&data)
        // Room for the volume on three replicas, the archive and the
        // rebuilt copy, and the WAL files' preallocation: dev's default
        // budget (2 GiB) would end a large drill in its disk-full rule.
        .args(["--max-disk-mib", &(4096 + 8 * (spec.volume_bytes >> 20)).to_string()])
        // Retention with room for the drill's volume (and its framing)
        // besides what the shard holds: at dev's default (1 GiB) the
        // coordinator refuses a 1 GiB drill (`drill_would_evict`).
        .args(["--retain-mib", &(1024 + 2 * (spec.volume_bytes >> 20)).to_string()])
        .env("WALSHIP_LOG", "warn");
    if let Some(mib) = spec.peer_serve_mib_per_s {
        command.args(["--peer-serve-mib-per-s", &mib.to_string()]);
    }
    // SIGTERM: dev stops its nodes and coordinator, then exits.
    let mut dev = Server::spawn("walship dev", command, &log, libc::SIGTERM)?;
    let outcome = drive(&mut dev, &log, &token, spec).await;
    let stopped = tokio::task::block_in_place(|| dev.stop());
    let reseed = outcome.with_context(|| format!("walship dev log: {}", log.display()))?;
    stopped.with_context(|| format!("stopping walship dev (log: {})", log.display()))?;
    let _ = std::fs::remove_dir_all(&data);
    Ok(reseed)
}

async fn drive(dev: &mut Server, log: &Path, token: &str, spec: &ReseedSpec) -> Result<Reseed> {
    let admin = coordinator_admin(dev, log).await?;
    wait_healthy(dev, admin, spec.shard).await?;
    let mut body = json!({
        "shard": spec.shard,
        "volume_bytes": spec.volume_bytes,
        "record_bytes": spec.record_bytes,
        "clients": spec.clients,
        "source": spec.source,
    });
    if let Some(follower) = spec.follower {
        body["follower"] = json!(follower);
    }
    let report = run_drill(dev, admin, token, "/v1/drills/reseed", &body, drill_timeout(spec.volume_bytes)).await?;
    if report["state"] != "done" {
        bail!("the re-seed drill ended {}: {}", report["state"], report["error"]);
    }
    let reseed: Reseed = serde_json::from_value(report["reseed"].clone())
        .with_context(|| format!("the drill report's reseed object: {report}"))?;
    Ok(reseed)
}

/// Time allowed for a drill over `volume_bytes`: ten minutes, plus a
/// second per MiB (far below any rate worth reporting).
fn drill_timeout(volume_bytes: u64) -> Duration {
    Duration::from_secs(600 + (volume_bytes >> 20))
}

/// Reads the coordinator's admin address from the line `walship dev`
/// prints (`coordinator  admin http://127.0.0.1:PORT/v1/shards ...`).
async fn coordinator_admin(dev: &mut Server, log: &Path) -> Result<SocketAddr> {
    let deadline = Instant::now() + DEV_READY_TIMEOUT;
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(addr) = parse_coordinator_admin(&text) {
            return Ok(addr);
        }
        dev.check_running()?;
        if Instant::now() > deadline {
            bail!("walship dev printed no coordinator admin address within {DEV_READY_TIMEOUT:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The coordinator's admin address in `walship dev`'s output.
pub fn parse_coordinator_admin(text: &str) -> Option<SocketAddr> {
    text.lines().filter(|line| line.contains("coordinator")).find_map(|line| {
        line.split_whitespace().find_map(|word| {
            let rest = word.strip_prefix("http://")?;
            rest.split('/').next()?.parse().ok()
        })
    })
}

/// Waits until every shard has a leader and every replica is alive and
/// assigned (`GET /v1/shards`), as the drills need, and the drilled shard's
/// leader reports that it archives (the re-seed drill refuses it before).
async fn wait_healthy(dev: &mut Server, admin: SocketAddr, shard: u32) -> Result<()> {
    let deadline = Instant::now() + DEV_READY_TIMEOUT;
    loop {
        let last = match http_request(admin, "GET", "/v1/shards", None, None).await {
            Ok((200, body)) => {
                let shards: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                if healthy(&shards, shard) {
                    return Ok(());
                }
                body
            }
            Ok((status, body)) => format!("{status} {body}"),
            Err(e) => format!("{e:#}"),
        };
        dev.check_running()?;
        if Instant::now() > deadline {
            bail!(
                "the dev cluster's shards did not all get a leader and live replicas, with shard {shard} \
                 archiving, within {DEV_READY_TIMEOUT:?}; last: {last}"
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn healthy(shards: &serde_json::Value, drilled: u32) -> bool {
    shards.as_array().is_some_and(|shards| {
        shards.iter().any(|s| s["shard_id"] == drilled && s["archived_seqno"].is_u64())
            && shards.iter().all(|s| {
                s["leader"].is_u64()
                    && s["replicas"]
                        .as_array()
                        .is_some_and(|r| r.iter().all(|r| r["alive"] == true && r["role"] != "unassigned"))
            })
    })
}

/// Starts a drill (`POST path`, 202) and polls its report until it is no
/// longer running; returns the report.
async fn run_drill(
    dev: &mut Server,
    admin: SocketAddr,
    token: &str,
    path: &str,
    body: &serde_json::Value,
    timeout: Duration,
) -> Result<serde_json::Value> {
    let (status, text) = http_request(admin, "POST", path, Some(&body.to_string()), Some(token)).await?;
    if status != 202 {
        bail!("the coordinator refused POST {path} {body} ({status}): {text}");
    }
    let started: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("POST {path} answered {text}"))?;
    let id = started["id"].as_str().with_context(|| format!("no drill id in {text}"))?;
    let report_path = started["report"].as_str().map_or_else(|| format!("/v1/drills/{id}"), str::to_string);
    let deadline = Instant::now() + timeout;
    let mut last_progress = String::new();
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let (status, text) = http_request(admin, "GET", &report_path, None, Some(token)).await?;
        if status != 200 {
            bail!("reading {report_path}: {status} {text}");
        }
        let report: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{report_path} answered {text}"))?;
        if report["state"] != "running" {
            return Ok(report);
        }
        let progress = report["progress"].as_str().unwrap_or_default();
        if !progress.is_empty() && progress != last_progress {
            eprintln!("  drill {id}: {progress}");
            last_progress = progress.to_string();
        }
        dev.check_running()?;
        if Instant::now() > deadline {
            bail!("drill {id} still running after {timeout:?}: {report}");
        }
    }
}

/// What one run measured and how it was run (`rebuild.json`).
#[derive(Debug, Clone, Serialize)]
pub struct RebuildReport {
    pub settings: Settings,
    pub disk: DiskBaseline,
    /// The drill's figures; `None` when walship was not run.
    pub walship: Option<Reseed>,
    /// `None` when PostgreSQL was not run.
    pub postgres: Option<Basebackup>,
    /// `None` when NATS JetStream was not run.
    pub nats: Option<NatsCatchup>,
    pub rows: Vec<Row>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Settings {
    pub command: String,
    pub started_utc: String,
    pub cores: usize,
    pub walship: Option<String>,
    /// Bytes each system rebuilds (the drill's `volume_bytes`, the bytes
    /// loaded into PostgreSQL).
    pub volume_bytes: u64,
    pub record_bytes: usize,
    pub drill_clients: usize,
    pub shard: u32,
    /// The drill's `source` (the walship tier measured).
    pub source: String,
    /// The nodes' PeerExchange serve limit in MiB/s (0 = unlimited);
    /// `None`: the node default, 64.
    pub peer_serve_mib_per_s: Option<u64>,
}

/// One line of the comparison table.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub figure: String,
    pub value: f64,
    pub unit: String,
    /// Wall time of the rebuild, for the rebuild rows.
    pub seconds: Option<f64>,
    /// `value` ÷ what it is compared with (raw sequential write, or the
    /// append rate before the re-seed).
    pub ratio: f64,
    pub compared_with: String,
    /// The ratio this row should reach, if it has a target.
    pub target: Option<f64>,
    pub meets_target: Option<bool>,
    pub note: String,
}

/// How a row is compared: with what (`over`, named `compared_with`), and
/// the ratio it should reach.
struct Against<'a> {
    over: f64,
    compared_with: &'a str,
    target: Option<f64>,
}

fn row(figure: &str, (value, unit, seconds): (f64, &str, Option<f64>), against: Against, note: String) -> Row {
    let Against { over, compared_with, target } = against;
    let ratio = if over > 0.0 { value / over } else { 0.0 };
    Row {
        figure: figure.into(),
        value,
        unit: unit.into(),
        seconds,
        ratio,
        compared_with: compared_with.into(),
        target,
        meets_target: target.map(|t| ratio >= t),
        note,
    }
}

impl RebuildReport {
    pub fn new(
        settings: Settings,
        disk: DiskBaseline,
        walship: Option<Reseed>,
        postgres: Option<Basebackup>,
        nats: Option<NatsCatchup>,
    ) -> RebuildReport {
        let raw = disk.seq_write_mib_s;
        let disk_ratio = |target| Against { over: raw, compared_with: "raw sequential write", target };
        let mut rows = Vec::new();
        if let Some(w) = &walship {
            let mib = |b: u64| b as f64 / (1 << 20) as f64;
            rows.push(row(
                "walship re-seed, sealed-segment tiers",
                (w.archive_mib_per_s, "MiB/s", Some(w.archive_seconds)),
                disk_ratio(Some(RESEED_TARGET)),
                format!(
                    "{:.1} MiB from peers and {:.1} MiB from the object store in {:.2} s (source {})",
                    mib(w.bytes_peer),
                    mib(w.bytes_archive),
                    w.archive_seconds,
                    w.source
                ),
            ));
            rows.push(row(
                "walship re-seed, overall",
                (w.total_mib_per_s, "MiB/s", Some(w.seconds)),
                disk_ratio(Some(RESEED_TARGET)),
                format!(
                    "{:.1} MiB ({:.1} peer + {:.1} archive + {:.1} catch-up stream + {:.1} live push) in {:.2} s",
                    mib(w.bytes_peer + w.bytes_archive + w.bytes_stream + w.bytes_push),
                    mib(w.bytes_peer),
                    mib(w.bytes_archive),
                    mib(w.bytes_stream),
                    mib(w.bytes_push),
                    w.seconds
                ),
            ));
        }
        if let Some(p) = &postgres {
            rows.push(row(
                "PostgreSQL pg_basebackup",
                (p.mib_per_s, "MiB/s", Some(p.seconds)),
                disk_ratio(None),
                format!(
                    "{:.1} MiB data directory (catalog and WAL included) in {:.2} s; {:.1} MiB of payload loaded, \
                     {:.1} MiB/s of it",
                    p.backup_bytes as f64 / (1 << 20) as f64,
                    p.seconds,
                    p.loaded_bytes as f64 / (1 << 20) as f64,
                    p.loaded_bytes as f64 / (1 << 20) as f64 / p.seconds
                ),
            ));
        }
        if let Some(n) = &nats {
            rows.push(row(
                "NATS JetStream replica catch-up",
                (n.mib_per_s, "MiB/s", Some(n.seconds)),
                disk_ratio(None),
                format!(
                    "{:.1} MiB of stream ({} messages) back on {} after its store ({:.1} MiB on disk) was deleted, in \
                     {:.2} s from its restart (listening after {:.2} s, local copy complete after {:.2} s, current \
                     at the leader {} after {:.2} s, lag {})",
                    n.bytes as f64 / (1 << 20) as f64,
                    n.messages,
                    n.server,
                    n.store_bytes_deleted as f64 / (1 << 20) as f64,
                    n.seconds,
                    n.startup_seconds,
                    n.local_seconds,
                    n.leader,
                    n.seconds,
                    n.lag_at_end
                ),
            ));
        }
        if let Some(w) = &walship {
            rows.push(row(
                "walship live appends during re-seed",
                (w.append_rate_during, "records/s", None),
                Against { over: w.append_rate_before, compared_with: "before the re-seed", target: Some(LIVE_TARGET) },
                format!("{:.0} records/s before", w.append_rate_before),
            ));
        }
        if let Some(n) = &nats {
            rows.push(row(
                "NATS live publishes during catch-up",
                (n.append_rate_during, "records/s", None),
                Against { over: n.append_rate_before, compared_with: "before the catch-up", target: None },
                format!(
                    "{:.0} records/s before, on the two servers that kept their store; {} publishes acknowledged",
                    n.append_rate_before, n.acked
                ),
            ));
        }
        RebuildReport { settings, disk, walship, postgres, nats, rows }
    }

    /// Lost or divergent records the drill found (a failed run).
    /// (JetStream's replica is checked by the run itself: it fails unless
    /// the replica matches the leader.)
    pub fn damage(&self) -> Option<String> {
        let w = self.walship.as_ref()?;
        (w.lost > 0 || w.divergent_replicas > 0)
            .then(|| format!("the re-seed drill lost {} records; {} divergent replicas", w.lost, w.divergent_replicas))
    }

    pub fn markdown(&self) -> String {
        let s = &self.settings;
        let mut md = String::new();
        md.push_str("## Re-seed from the archive vs pg_basebackup\n\n");
        let peer_limit = match s.peer_serve_mib_per_s {
            None => "default 64 MiB/s".to_string(),
            Some(0) => "unlimited".to_string(),
            Some(mib) => format!("{mib} MiB/s"),
        };
        md.push_str(&format!("walship tier `{}`, PeerExchange serve limit {peer_limit}.\n", s.source));
        md.push_str(&format!(
            "{:.0} MiB rebuilt per system ({} B records), {} cores, started {}.\n\
             Raw sequential write of the disk: **{:.0} MiB/s**; 4 KiB fdatasync p50 {:.0} µs, p99 {:.0} µs.\n\n",
            s.volume_bytes as f64 / (1 << 20) as f64,
            s.record_bytes,
            s.cores,
            s.started_utc,
            self.disk.seq_write_mib_s,
            self.disk.fdatasync_4k_p50_us,
            self.disk.fdatasync_4k_p99_us,
        ));
        md.push_str("| figure | value | time | ratio | of | target | |\n|---|---:|---:|---:|---|---:|---|\n");
        for r in &self.rows {
            let (target, verdict) = match (r.target, r.meets_target) {
                (Some(t), Some(true)) => (format!("≥ {t:.2}"), "met"),
                (Some(t), _) => (format!("≥ {t:.2}"), "**missed**"),
                _ => ("—".to_string(), ""),
            };
            let time = r.seconds.map_or(String::new(), |s| format!("{s:.2} s"));
            md.push_str(&format!(
                "| {} | {:.1} {} | {} | {:.2} | {} | {} | {} |\n",
                r.figure, r.value, r.unit, time, r.ratio, r.compared_with, target, verdict
            ));
        }
        md.push('\n');
        for r in &self.rows {
            md.push_str(&format!("- {}: {}\n", r.figure, r.note));
        }
        if self.walship.is_none() {
            md.push_str("- walship was not run in this report.\n");
        }
        if self.postgres.is_none() {
            md.push_str("- PostgreSQL was not run in this report.\n");
        }
        if self.nats.is_none() {
            md.push_str("- NATS JetStream was not run in this report.\n");
        }
        if let Some(w) = &self.walship {
            md.push_str(&format!(
                "- re-seed drill: follower {} wiped ({} records) and rebuilt from leader {} and the archive \
                 ({} records); {} acknowledged, lost {}, divergent replicas {}\n",
                w.follower, w.records_wiped, w.leader, w.records, w.acked, w.lost, w.divergent_replicas
            ));
        }
        md.push_str(&format!("\nCommand: `{}`\n", s.command));
        md
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_coordinator_admin_address_in_dev_output() {
        let text = "walship dev: 3 nodes, shards 1..=4 at RF=3, data in x\n  \
                    node 1  gRPC 127.0.0.1:4001  admin http://127.0.0.1:4081/v1/status  leads shards [1]\n  \
                    coordinator  admin http://127.0.0.1:40180/v1/shards  (leaders above as it reports them now)\n";
        assert_eq!(parse_coordinator_admin(text), Some("127.0.0.1:40180".parse().unwrap()));
        assert_eq!(parse_coordinator_admin("  node 1 admin http://127.0.0.1:4081/v1/status\n"), None);
    }

    #[test]
    fn health_needs_a_leader_and_live_replicas_everywhere_and_the_drilled_shard_archiving() {
        let replicas = json!([{"alive": true, "role": "leader"}, {"alive": true, "role": "follower"}]);
        let good = json!([
            {"shard_id": 1, "leader": 1, "archived_seqno": 0, "replicas": replicas},
            {"shard_id": 2, "leader": 2, "archived_seqno": null, "replicas": replicas},
        ]);
        assert!(healthy(&good, 1));
        assert!(!healthy(&good, 2), "shard 2 does not archive yet");
        assert!(!healthy(&good, 3), "no shard 3");
        let no_leader = json!([{"shard_id": 1, "leader": null, "archived_seqno": 0, "replicas": replicas}]);
        assert!(!healthy(&no_leader, 1));
        let dead = json!([{"shard_id": 1, "leader": 1, "archived_seqno": 0,
            "replicas": [{"alive": false, "role": "follower"}]}]);
        assert!(!healthy(&dead, 1));
        assert!(!healthy(&json!([]), 1));
    }

    #[test]
    fn ratios_and_targets_follow_the_figures() {
        let disk = DiskBaseline {
            fdatasync_4k_p50_us: 100.0,
            fdatasync_4k_p99_us: 200.0,
            fdatasync_4k_p999_us: 300.0,
            seq_write_mib_s: 200.0,
            fdatasync_4k_three_p50_us: 250.0,
            fdatasync_4k_three_p99_us: 600.0,
        };
        let walship = Reseed {
            archive_mib_per_s: 150.0,
            total_mib_per_s: 100.0,
            append_rate_before: 1000.0,
            append_rate_during: 700.0,
            ..Default::default()
        };
        let postgres = Basebackup { mib_per_s: 50.0, seconds: 2.0, backup_bytes: 100 << 20, ..Default::default() };
        let settings = Settings {
            command: "walship-rebuild".into(),
            started_utc: "now".into(),
            cores: 2,
            walship: None,
            volume_bytes: 1 << 20,
            record_bytes: 4096,
            drill_clients: 8,
            shard: 1,
            source: "all".into(),
            peer_serve_mib_per_s: None,
        };
        let report = RebuildReport::new(settings.clone(), disk.clone(), Some(walship), Some(postgres), None);
        let ratios: Vec<(f64, Option<bool>)> = report.rows.iter().map(|r| (r.ratio, r.meets_target)).collect();
        assert_eq!(ratios, [(0.75, Some(true)), (0.5, Some(false)), (0.25, None), (0.7, Some(false))]);
        let md = report.markdown();
        assert!(md.contains("| walship re-seed, sealed-segment tiers | 150.0 MiB/s | 0.00 s | 0.75 |"), "{md}");
        assert!(md.contains("| PostgreSQL pg_basebackup | 50.0 MiB/s | 2.00 s | 0.25 |"), "{md}");
        assert!(md.contains("**missed**"), "{md}");
        assert!(report.damage().is_none());
        assert!(md.contains("PeerExchange serve limit default 64 MiB/s"), "{md}");

        let nats = NatsCatchup {
            mib_per_s: 100.0,
            seconds: 3.0,
            append_rate_before: 1000.0,
            append_rate_during: 900.0,
            ..Default::default()
        };
        let settings = Settings { peer_serve_mib_per_s: Some(0), ..settings };
        let report = RebuildReport::new(settings, disk, None, None, Some(nats));
        let rows: Vec<(&str, f64, Option<bool>)> =
            report.rows.iter().map(|r| (r.figure.as_str(), r.ratio, r.meets_target)).collect();
        assert_eq!(
            rows,
            [("NATS JetStream replica catch-up", 0.5, None), ("NATS live publishes during catch-up", 0.9, None)]
        );
        let md = report.markdown();
        assert!(md.contains("| NATS JetStream replica catch-up | 100.0 MiB/s | 3.00 s | 0.50 |"), "{md}");
        assert!(md.contains("serve limit unlimited"), "{md}");
    }
}
