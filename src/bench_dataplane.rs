//! `walship bench-dataplane`: DataPlane `verify` and `export` throughput on
//! a shard of `--mib` MiB, against the raw sequential read of the same WAL
//! files measured in the same run, and live `QUORUM` append throughput
//! while they run against the same cluster undisturbed.
//!
//! It measures the raw disk's write rate first (`walship bench`'s
//! yardstick), starts three `walship node` processes (RF=3, one shard, the
//! whole log retained, `--task-read-mib-per-s` as given: the nodes' default
//! 64 MiB/s task read budget unless told otherwise) and a `walship coord` on free loopback ports, as
//! `walship bench` does, fills the shard with `QUORUM` appends of
//! `--record-bytes` and waits until every replica holds it durably. Then,
//! the page cache dropped before each one:
//! * raw: every `*.raftlog` file of the leader's WAL read whole, in order,
//!   with an 8 MiB buffer (file bytes ÷ wall time);
//! * verify of the whole range on all three replicas, and export of it (read
//!   on the leader) into the coordinator's Arrow IPC file: the shard's
//!   *payload* bytes (records × record bytes, one replica's worth) ÷ wall
//!   time from `POST /v1/tasks` to the job's report. All three replicas sit
//!   on this one disk, so a verify reads three copies: its disk bandwidth is
//!   three times the figure (printed too); an export also writes its
//!   file, so it is printed against raw read then raw write too;
//! * `QUORUM` appends of `--appenders` closed-loop clients for `--seconds`
//!   undisturbed, then as long again while verify and export of the filled
//!   range run back to back (cache dropped before each), and the ratio.
//!
//! Every process it started is killed (by PID) and its data removed when
//! it ends, also on error. Nothing here asserts a speed: it prints figures.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use clap::Args;
use serde_json::{Value, json};
use walship_proto::log::{AppendRecord, AppendRequest, Durability};

use crate::bench::{BENCH_ADMIN_TOKEN, Baseline, Connection, Leadership, Target, Transport};
use crate::http;

const MIB: f64 = (1 << 20) as f64;

#[derive(Args, Debug)]
pub struct BenchDataplaneArgs {
    /// Where the cluster's data lives (removed at the end).
    #[arg(long, default_value = ".walship/bench-dataplane")]
    dir: PathBuf,
    /// MiB of record payload to fill the shard with.
    #[arg(long, default_value_t = 1024)]
    mib: u64,
    /// Payload bytes per record.
    #[arg(long, default_value_t = 4096)]
    record_bytes: usize,
    /// Concurrent closed-loop appenders of the live-append measurement.
    #[arg(long, default_value_t = 64)]
    appenders: usize,
    /// Measured seconds of each live-append window (undisturbed, then during verify and export).
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Bytes of spare WAL files of zeros each node lays out before serving.
    #[arg(long, default_value_t = 512 << 20)]
    wal_spare_bytes: u64,
    /// The nodes' DataPlane task read budget (`walship node
    /// --task-read-mib-per-s`; 0 = unlimited).
    #[arg(long, default_value_t = walship_dataplane::limiter::DEFAULT_TASK_READ_BYTES_PER_S >> 20)]
    task_read_mib_per_s: u64,
    /// Leave the page cache alone (for smoke tests on shared machines; the
    /// figures then measure reads from memory, and the report says so).
    #[arg(long)]
    keep_cache: bool,
    /// Also write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// The cluster under measurement and how to reach it.
struct Bench<'a> {
    args: &'a BenchDataplaneArgs,
    admin: String,
    leader: Connection,
    /// The filled range is `[1, last]`.
    last: u64,
    /// Whether every drop of the page cache so far worked.
    cache_dropped: bool,
}

/// `sync`, then drops the page cache (dentries and inodes too), on a
/// blocking thread (the appenders' runtime threads keep running). Answers
/// whether it could; says so when not.
async fn drop_cache(keep: bool) -> bool {
    if keep {
        return false;
    }
    let dropped = tokio::task::spawn_blocking(|| {
        // SAFETY: sync(2) takes no arguments and cannot fail.
        unsafe { libc::sync() };
        std::fs::write("/proc/sys/vm/drop_caches", "3")
    })
    .await;
    match dropped {
        Ok(Ok(())) => true,
        Ok(Err(e)) => {
            eprintln!("the page cache could not be dropped ({e}); measuring on");
            false
        }
        Err(e) => {
            eprintln!("the page cache could not be dropped ({e}); measuring on");
            false
        }
    }
}

pub async fn run(args: BenchDataplaneArgs) -> Result<()> {
    if args.mib == 0 || args.record_bytes == 0 || args.appenders == 0 || args.seconds <= 0.0 {
        bail!("--mib, --record-bytes, --appenders and --seconds must be positive");
    }
    let data = args.dir.join("cluster");
    let _ = std::fs::remove_dir_all(&data);
    std::fs::create_dir_all(&args.dir).with_context(|| format!("creating {}", args.dir.display()))?;
    eprintln!("measuring the raw disk under {} ...", args.dir.display());
    // Other work on the machine shows here (the figures share its CPUs and disk).
    let load_before = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let base = crate::bench::measure_baseline(&args.dir)?;
    eprintln!(
        "starting three nodes (RF=3, one shard, task read budget {}) and a coordinator under {} ...",
        match args.task_read_mib_per_s {
            0 => "unlimited".to_string(),
            mib => format!("{mib} MiB/s per node"),
        },
        data.display()
    );
    // Retention keeps 1 GiB of frames per shard by default: the filled range
    // would lose its first records to it (more so while the live appends
    // run), so every replica keeps the whole log here.
    let keep_all = |config: &mut walship_shipping::ClusterConfig| {
        config.replication.retain_bytes = 1 << 50;
        config.replication.max_retain_bytes = 1 << 50;
    };
    let node_args = ["--task-read-mib-per-s".to_string(), args.task_read_mib_per_s.to_string()];
    let target = crate::bench::three_nodes(
        &data,
        1,
        Leadership::Coordinated,
        args.wal_spare_bytes,
        false,
        &keep_all,
        &node_args,
    )?;
    // `target` kills every process it started when dropped, also on error.
    let result = measure(&args, &data, &target, &base).await.map(|mut report| {
        report["machine"]["loadavg_before"] = load_before.trim().into();
        report
    });
    drop(target);
    let _ = std::fs::remove_dir_all(&data);
    let report = result?;
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

async fn measure(args: &BenchDataplaneArgs, data: &Path, target: &Target, base: &Baseline) -> Result<Value> {
    let admin = target.coord_admin.clone().context("the cluster runs no coordinator")?;
    let leader = Connection::open(&target.leaders[0], Transport::Stream, None).await?;
    let mut bench = Bench { args, admin, leader, last: 0, cache_dropped: !args.keep_cache };
    let body = crate::bench::payload(args.record_bytes);
    let records = (args.mib << 20).div_ceil(args.record_bytes as u64);
    let started = Instant::now();
    bench.fill(records, &body).await?;
    let fill_s = started.elapsed().as_secs_f64();
    let leader_id = bench.wait_replicated().await?;
    let payload_mib = bench.last as f64 * args.record_bytes as f64 / MIB;
    eprintln!(
        "filled shard 1 with {} records ({payload_mib:.0} MiB of payload) in {fill_s:.1} s; every replica holds them",
        bench.last
    );

    let cache = bench.drop_cache().await;
    let raw = raw_read(&data.join(format!("node-{leader_id}")).join("wal")).await?;
    println!(
        "raw sequential read: {:.0} MiB of node-{leader_id}'s WAL files ({} files) in {:.2} s = {:.1} MiB/s{} \
         (raw sequential write, measured first: {:.1} MiB/s)",
        raw.bytes as f64 / MIB,
        raw.files,
        raw.seconds,
        raw.mib_per_s(),
        cached(cache),
        base.seq_write_mib_s
    );

    let cache = bench.drop_cache().await;
    let verify = bench.verify().await?;
    let verify_mib_s = payload_mib / verify;
    println!(
        "verify: {payload_mib:.0} MiB of payload on 3 replicas in {verify:.2} s = {verify_mib_s:.1} MiB/s \
         = {:.2} x raw read (target >= 0.50){}; it reads all three copies from this one disk: \
         {:.1} MiB/s = {:.2} x raw read",
        verify_mib_s / raw.mib_per_s(),
        cached(cache),
        3.0 * verify_mib_s,
        3.0 * verify_mib_s / raw.mib_per_s()
    );

    let cache = bench.drop_cache().await;
    let (export, export_bytes) = bench.export().await?;
    let export_mib_s = payload_mib / export;
    // Reading the records and writing (and syncing) the file on one disk,
    // each at its raw rate, one after the other.
    let read_write_mib_s = 1.0 / (1.0 / raw.mib_per_s() + 1.0 / base.seq_write_mib_s);
    println!(
        "export: {payload_mib:.0} MiB of payload to a {:.0} MiB Arrow file in {export:.2} s = {export_mib_s:.1} MiB/s \
         = {:.2} x raw read (target >= 0.50){}; it also writes the file to this disk: raw read then raw write of \
         as many bytes is {read_write_mib_s:.1} MiB/s, export = {:.2} x that",
        export_bytes as f64 / MIB,
        export_mib_s / raw.mib_per_s(),
        cached(cache),
        export_mib_s / read_write_mib_s
    );

    bench.drop_cache().await;
    let quiet = bench.appends(Duration::from_secs_f64(args.seconds)).await?;
    println!(
        "QUORUM appends undisturbed: {:.0} records/s ({} appenders, {} B records, {:.0} s)",
        quiet.records_per_s, args.appenders, args.record_bytes, args.seconds
    );
    let (busy, jobs) = bench.appends_under_jobs().await?;
    let live_ratio = busy.records_per_s / quiet.records_per_s;
    println!(
        "QUORUM appends during verify+export: {:.0} records/s = {live_ratio:.2} x undisturbed (target >= 0.80); \
         {} verify and {} export jobs ran in the window",
        busy.records_per_s,
        jobs.iter().filter(|j| j["kind"] == "verify").count(),
        jobs.iter().filter(|j| j["kind"] == "export").count()
    );

    Ok(json!({
        "machine": machine(&args.dir),
        "build": crate::BUILD,
        "page_cache_dropped": bench.cache_dropped,
        "settings": {
            "mib": args.mib, "record_bytes": args.record_bytes, "appenders": args.appenders,
            "seconds": args.seconds, "wal_spare_bytes": args.wal_spare_bytes,
            "task_read_mib_per_s": args.task_read_mib_per_s,
        },
        "shard": {"records": bench.last, "payload_mib": payload_mib, "fill_seconds": fill_s, "leader": leader_id},
        "raw_disk": base,
        "raw_read": {"node": leader_id, "files": raw.files, "bytes": raw.bytes, "seconds": raw.seconds, "mib_per_s": raw.mib_per_s()},
        "verify": {
            "replicas": 3, "seconds": verify, "payload_mib_per_s": verify_mib_s,
            "all_copies_mib_per_s": 3.0 * verify_mib_s, "all_copies_ratio_to_raw": 3.0 * verify_mib_s / raw.mib_per_s(),
            "ratio_to_raw": verify_mib_s / raw.mib_per_s(), "target": 0.5,
        },
        "export": {
            "seconds": export, "payload_mib_per_s": export_mib_s, "arrow_file_bytes": export_bytes,
            "ratio_to_raw": export_mib_s / raw.mib_per_s(), "target": 0.5,
            "raw_read_then_write_mib_per_s": read_write_mib_s, "ratio_to_raw_read_then_write": export_mib_s / read_write_mib_s,
        },
        "quorum_appends": {
            "undisturbed": quiet, "during_verify_export": busy, "ratio": live_ratio, "target": 0.8,
            "jobs_during": jobs,
        },
    }))
}

fn cached(dropped: bool) -> &'static str {
    if dropped { "" } else { " [page cache NOT dropped]" }
}

/// What the raw read found.
struct Raw {
    files: usize,
    bytes: u64,
    seconds: f64,
}

impl Raw {
    fn mib_per_s(&self) -> f64 {
        self.bytes as f64 / MIB / self.seconds
    }
}

/// Reads every `*.raftlog` file under `wal` whole (oldest first) with an
/// 8 MiB buffer. Spare files of zeros (`*.raftlog.reserved`) hold no record
/// and are not read.
async fn raw_read(wal: &Path) -> Result<Raw> {
    let wal = wal.to_path_buf();
    tokio::task::spawn_blocking(move || {
        let mut files: Vec<PathBuf> = std::fs::read_dir(&wal)
            .with_context(|| format!("listing {}", wal.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "raftlog"))
            .collect();
        files.sort();
        if files.is_empty() {
            bail!("no *.raftlog file under {}", wal.display());
        }
        let mut buf = vec![0u8; 8 << 20];
        let started = Instant::now();
        let mut bytes = 0u64;
        for path in &files {
            let mut file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
            loop {
                let n = file.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                bytes += n as u64;
            }
        }
        Ok(Raw { files: files.len(), bytes, seconds: started.elapsed().as_secs_f64() })
    })
    .await?
}

/// Machine facts for the JSON.
fn machine(dir: &Path) -> Value {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpu = read("/proc/cpuinfo")
        .lines()
        .find_map(|l| l.strip_prefix("model name").map(|m| m.trim_start_matches([' ', '\t', ':']).to_string()));
    let mem_kib = read("/proc/meminfo")
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:").and_then(|v| v.trim().trim_end_matches(" kB").parse::<u64>().ok()));
    json!({
        "cpu": cpu,
        "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "mem_gib": mem_kib.map(|k| k as f64 / (1 << 20) as f64),
        "kernel": read("/proc/sys/kernel/osrelease").trim(),
        "loadavg_after": read("/proc/loadavg").trim(),
        "dir": std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf()),
    })
}

impl Bench<'_> {
    async fn drop_cache(&mut self) -> bool {
        let dropped = drop_cache(self.args.keep_cache).await;
        self.cache_dropped &= dropped;
        dropped
    }

    fn request(&self, records: Vec<AppendRecord>) -> AppendRequest {
        AppendRequest { shard_id: 1, records, durability: Durability::Quorum as i32, ..Default::default() }
    }

    /// Appends `records` records of `body` at QUORUM, 32 to a request from
    /// 16 concurrent appenders, after the leader's first acknowledged one.
    async fn fill(&mut self, records: u64, body: &Bytes) -> Result<()> {
        let one = || vec![AppendRecord { key: Bytes::new(), payload: body.clone() }];
        // Under a coordinator the leader takes its role a moment after
        // start, and not always on the configured node: a refusal naming
        // another leader moves the connection there.
        let deadline = Instant::now() + Duration::from_secs(30);
        while let Err(status) = self.leader.append(self.request(one())).await {
            if Instant::now() > deadline {
                bail!("shard 1 never accepted an append: {status}");
            }
            if let Some(address) = walship_proto::leader_address(&status) {
                self.leader = Connection::open(address, Transport::Stream, None).await?;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let claimed = Arc::new(AtomicU64::new(1));
        let mut tasks = Vec::new();
        for _ in 0..16 {
            let (claimed, leader, body) = (claimed.clone(), self.leader.clone(), body.clone());
            tasks.push(tokio::spawn(async move {
                loop {
                    let from = claimed.fetch_add(32, Ordering::Relaxed);
                    if from >= records {
                        return anyhow::Ok(());
                    }
                    let n = 32.min(records - from);
                    let batch = (0..n).map(|_| AppendRecord { key: Bytes::new(), payload: body.clone() }).collect();
                    let request = AppendRequest {
                        shard_id: 1,
                        records: batch,
                        durability: Durability::Quorum as i32,
                        ..Default::default()
                    };
                    leader.append(request).await.map_err(|s| anyhow::anyhow!("append: {s}"))?;
                }
            }));
        }
        for task in tasks {
            task.await??;
        }
        self.last = records;
        Ok(())
    }

    /// Waits until every replica of shard 1 holds `[1, last]` durably;
    /// answers the leader's node id.
    async fn wait_replicated(&mut self) -> Result<u32> {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let (code, shards) = http::request("GET", &self.admin, "/v1/shards", None, None).await?;
            let shard = &shards[0];
            let replicas = shard["replicas"].as_array().cloned().unwrap_or_default();
            let durable: Vec<u64> = replicas.iter().filter_map(|r| r["durable_seqno"].as_u64()).collect();
            if code == 200 && durable.len() == 3 && durable.iter().all(|&d| d >= self.last) {
                if let Some(max) = replicas.iter().filter_map(|r| r["last_seqno"].as_u64()).max() {
                    // Every record the fill acknowledged, and nothing else.
                    if max != self.last {
                        bail!("shard 1 holds {max} records, the fill appended {}", self.last);
                    }
                }
                return shard["leader"].as_u64().map(|l| l as u32).context("shard 1 has no leader");
            }
            if Instant::now() > deadline {
                bail!("the replicas did not all hold [1, {}] within 120 s: {shards}", self.last);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Submits a job (`POST /v1/tasks`) and waits for its report.
    async fn job(&self, body: Value) -> Result<(f64, Value)> {
        let started = Instant::now();
        let (status, answer) =
            http::request("POST", &self.admin, "/v1/tasks", Some(&body.to_string()), Some(BENCH_ADMIN_TOKEN)).await?;
        if status != 202 {
            bail!("POST /v1/tasks {body} ({status}): {answer}");
        }
        let job = answer["query_id"].as_str().context("no query_id")?.to_string();
        loop {
            let (status, view) = http::request("GET", &self.admin, &format!("/v1/jobs/{job}"), None, None).await?;
            if status != 200 {
                bail!("GET /v1/jobs/{job} ({status}): {view}");
            }
            if view["state"] == "done" {
                return Ok((started.elapsed().as_secs_f64(), view["report"].clone()));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Verifies `[1, last]` on every replica; answers its seconds.
    async fn verify(&self) -> Result<f64> {
        let (seconds, report) = self.job(json!({"kind": "verify", "shard": 1, "from": 1, "to": self.last})).await?;
        if report["verdict"] != "equal" || report["equal_through"].as_u64() != Some(self.last) {
            // Its tasks (rows read per replica, errors) say what went wrong.
            let (_, tasks) = http::request("GET", &self.admin, "/v1/tasks?kind=verify&limit=6", None, None).await?;
            let tasks: Vec<Value> = tasks["tasks"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|t| json!([t["query_id"], t["node"], t["state"], t["rows"], t["bytes"], t["error"]]))
                .collect();
            bail!("verify did not find [1, {}] equal on every replica: {report}; its tasks: {tasks:?}", self.last);
        }
        Ok(seconds)
    }

    /// Exports `[1, last]` (read on the leader) to an Arrow file on the
    /// coordinator; answers its seconds and the file's size, and removes it.
    async fn export(&self) -> Result<(f64, u64)> {
        let (seconds, report) = self.job(json!({"kind": "export", "shard": 1, "from": 1, "to": self.last})).await?;
        if report["state"] != "done" || report["rows"].as_u64() != Some(self.last) {
            bail!("export did not write [1, {}]: {report}", self.last);
        }
        let file = PathBuf::from(report["file"].as_str().context("the export report names no file")?);
        let file = if file.is_absolute() { file } else { std::env::current_dir()?.join(file) };
        let size = std::fs::metadata(&file).with_context(|| format!("the export file {}", file.display()))?.len();
        if size < self.last * self.args.record_bytes as u64 {
            bail!("the export file {} holds {size} bytes, less than the payload it exported", file.display());
        }
        let _ = std::fs::remove_file(&file);
        Ok((seconds, size))
    }

    /// `--appenders` closed-loop QUORUM appenders on shard 1 for `window`
    /// (after a 0.5 s warm-up).
    async fn appends(&self, window: Duration) -> Result<walship_loadgen::Summary> {
        let (leader, body) = (self.leader.clone(), crate::bench::payload(self.args.record_bytes));
        let measured = walship_loadgen::closed(self.args.appenders, Duration::from_millis(500), window, move |_| {
            let (leader, body) = (leader.clone(), body.clone());
            async move {
                let records = vec![AppendRecord { key: Bytes::new(), payload: body }];
                let request =
                    AppendRequest { shard_id: 1, records, durability: Durability::Quorum as i32, ..Default::default() };
                leader.append(request).await.map_err(|s| anyhow::anyhow!("append: {s}"))?;
                Ok(())
            }
        })
        .await?;
        Ok(measured.summary(self.args.record_bytes))
    }

    /// The live appends again while verify and export of `[1, last]` run
    /// back to back (cache dropped before each); answers the appends'
    /// figures and each job that finished in the window.
    async fn appends_under_jobs(&mut self) -> Result<(walship_loadgen::Summary, Vec<Value>)> {
        let stop = AtomicBool::new(false);
        let mut jobs = Vec::new();
        let mut dropped = true;
        let load = async {
            // The jobs start first, so the whole window after the warm-up is disturbed.
            tokio::time::sleep(Duration::from_millis(100)).await;
            let summary = self.appends(Duration::from_secs_f64(self.args.seconds)).await;
            stop.store(true, Ordering::Relaxed);
            summary
        };
        let background = async {
            let payload_mib = self.last as f64 * self.args.record_bytes as f64 / MIB;
            while !stop.load(Ordering::Relaxed) {
                for kind in ["verify", "export"] {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    dropped &= drop_cache(self.args.keep_cache).await;
                    let seconds = if kind == "verify" { self.verify().await? } else { self.export().await?.0 };
                    // A job still running when the window closed is not counted.
                    if !stop.load(Ordering::Relaxed) {
                        jobs.push(
                            json!({"kind": kind, "seconds": seconds, "payload_mib_per_s": payload_mib / seconds}),
                        );
                    }
                }
            }
            anyhow::Ok(())
        };
        // The background ends with the first job to finish after the window.
        let (summary, background) = tokio::join!(load, background);
        background?;
        self.cache_dropped &= dropped;
        for j in &jobs {
            eprintln!(
                "  in the window: {} {:.2} s = {:.1} MiB/s",
                j["kind"].as_str().unwrap_or_default(),
                j["seconds"].as_f64().unwrap_or_default(),
                j["payload_mib_per_s"].as_f64().unwrap_or_default()
            );
        }
        Ok((summary?, jobs))
    }
}
