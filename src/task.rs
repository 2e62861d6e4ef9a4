//! `walship task list|show|cancel|redrive` and `walship verify`: the
//! coordinator's DataPlane tasks through its admin API.

use std::time::Duration;

use anyhow::{Result, bail};
use clap::{Args, Subcommand};
use serde_json::Value;

use crate::drill::{Admin, AdminArgs};
use crate::http;

#[derive(Args, Debug)]
pub struct TaskArgs {
    #[command(subcommand)]
    pub command: TaskCommand,
    /// Print JSON on stdout instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(flatten)]
    pub admin: AdminArgs,
}

#[derive(Subcommand, Debug)]
pub enum TaskCommand {
    /// List tasks, newest first.
    List {
        /// queued, running, succeeded, failed or cancelled.
        #[arg(long)]
        state: Option<String>,
        /// A task kind, e.g. verify.
        #[arg(long)]
        kind: Option<String>,
        #[arg(long)]
        shard: Option<u32>,
        /// A worker, e.g. node-2.
        #[arg(long)]
        node: Option<String>,
        #[arg(long, default_value_t = 20)]
        limit: u32,
    },
    /// Show one task.
    Show { id: String },
    /// Stop a task on its node.
    Cancel { id: String },
    /// Queue a dead letter (a task that failed on every attempt) again.
    Redrive { id: String },
    /// List the dead letters.
    DeadLetters,
}

/// Refuses an admin answer that is not `want`.
fn expect(status: u16, want: u16, answer: &Value) -> Result<()> {
    if status != want {
        bail!(
            "{} ({status}): {}",
            answer["error"]["code"].as_str().unwrap_or("refused"),
            answer["error"]["message"].as_str().unwrap_or_default()
        );
    }
    Ok(())
}

fn line(t: &Value) -> String {
    format!(
        "{:<24} {:<8} {:<10} shard {:<5} node {:<8} attempts {} rows {}{}",
        t["task_id"].as_str().unwrap_or_default(),
        t["kind"].as_str().unwrap_or_default(),
        t["state"].as_str().unwrap_or_default(),
        t["shard"].as_u64().map_or("-".to_string(), |s| s.to_string()),
        t["node"].as_str().unwrap_or("-"),
        t["attempts"],
        t["rows"],
        t["error"].as_str().map(|e| format!("  error: {e}")).unwrap_or_default()
    )
}

pub async fn run(args: TaskArgs) -> Result<()> {
    let admin = args.admin.resolve()?;
    let token = admin.token.as_deref();
    let (status, answer, want) = match &args.command {
        TaskCommand::List { state, kind, shard, node, limit } => {
            let mut query = vec![format!("limit={limit}")];
            for (k, v) in [("state", state.clone()), ("kind", kind.clone()), ("node", node.clone())] {
                if let Some(v) = v {
                    query.push(format!("{k}={v}"));
                }
            }
            if let Some(shard) = shard {
                query.push(format!("shard={shard}"));
            }
            let (s, a) =
                http::request("GET", &admin.url, &format!("/v1/tasks?{}", query.join("&")), None, None).await?;
            (s, a, 200)
        }
        TaskCommand::Show { id } => {
            let (s, a) = http::request("GET", &admin.url, &format!("/v1/tasks/{id}"), None, None).await?;
            (s, a, 200)
        }
        TaskCommand::Cancel { id } => {
            let (s, a) =
                http::request("POST", &admin.url, &format!("/v1/tasks/{id}/cancel"), Some("{}"), token).await?;
            // 202: another coordinator's task, the cancel broadcast to it.
            (s, a, if s == 202 { 202 } else { 200 })
        }
        TaskCommand::Redrive { id } => {
            let path = format!("/v1/dead-letters/{id}/redrive");
            let (s, a) = http::request("POST", &admin.url, &path, Some("{}"), token).await?;
            (s, a, 200)
        }
        TaskCommand::DeadLetters => {
            let (s, a) = http::request("GET", &admin.url, "/v1/dead-letters", None, None).await?;
            (s, a, 200)
        }
    };
    expect(status, want, &answer)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&answer)?);
        return Ok(());
    }
    match &args.command {
        TaskCommand::List { .. } => {
            for t in answer["tasks"].as_array().into_iter().flatten() {
                println!("{}", line(t));
            }
            println!("({} of {} tasks)", answer["tasks"].as_array().map_or(0, Vec::len), answer["total"]);
        }
        TaskCommand::DeadLetters => {
            for t in answer.as_array().into_iter().flatten() {
                println!(
                    "{:<24} {:<8} shard {:<5} last node {:<8} attempts {}  error: {}",
                    t["task_id"].as_str().unwrap_or_default(),
                    t["kind"].as_str().unwrap_or_default(),
                    t["shard"].as_u64().map_or("-".to_string(), |s| s.to_string()),
                    t["last_worker"].as_str().unwrap_or("-"),
                    t["attempts"],
                    t["error"].as_str().unwrap_or_default()
                );
            }
        }
        TaskCommand::Cancel { .. } if status == 202 => println!("{}", answer["message"].as_str().unwrap_or_default()),
        _ => println!("{}", line(&answer)),
    }
    Ok(())
}

#[derive(Args, Debug)]
#[command(after_help = "Exit codes: 0 the replicas hold the same records; 1 an error; 4 they differ (the \
report names the first seqno and the replicas that differ).")]
pub struct VerifyArgs {
    /// The shard to verify.
    #[arg(long)]
    pub shard: u32,
    /// First seqno [default: 1].
    #[arg(long)]
    pub from: Option<u64>,
    /// Last seqno [default: the leader's commit seqno now].
    #[arg(long)]
    pub to: Option<u64>,
    /// Records per chunk of the first pass [default: 4096].
    #[arg(long)]
    pub chunk_records: Option<u64>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub admin: AdminArgs,
}

/// The replicas differ (`walship verify` exits with it).
#[derive(Debug)]
pub struct Diverged;

impl std::fmt::Display for Diverged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the replicas differ")
    }
}

impl std::error::Error for Diverged {}

async fn poll_job(admin: &Admin, job: &str, bar: &indicatif::ProgressBar) -> Result<Value> {
    loop {
        let (status, view) = http::request("GET", &admin.url, &format!("/v1/jobs/{job}"), None, None).await?;
        expect(status, 200, &view)?;
        if view["state"] == "done" {
            return Ok(view["report"].clone());
        }
        bar.tick();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Starts a planned job (`body`, a `POST /v1/tasks` request) and waits for
/// its report behind a spinner saying `what`; answers the job id and report.
async fn run_job(
    admin: &Admin,
    mut body: Value,
    numbers: &[(&str, Option<u64>)],
    what: &str,
) -> Result<(String, Value)> {
    for (k, v) in numbers {
        if let Some(v) = v {
            body[*k] = (*v).into();
        }
    }
    let (status, started) =
        http::request("POST", &admin.url, "/v1/tasks", Some(&body.to_string()), admin.token.as_deref()).await?;
    expect(status, 202, &started)?;
    let job = started["query_id"].as_str().unwrap_or_default().to_string();
    let bar = indicatif::ProgressBar::new_spinner();
    bar.set_message(format!("{what} (job {job})"));
    bar.enable_steady_tick(Duration::from_millis(100));
    let report = poll_job(admin, &job, &bar).await;
    bar.finish_and_clear();
    Ok((job, report?))
}

pub async fn verify(args: VerifyArgs) -> Result<()> {
    let admin = args.admin.resolve()?;
    let body = serde_json::json!({"kind": "verify", "shard": args.shard});
    let numbers = [("from", args.from), ("to", args.to), ("chunk_records", args.chunk_records)];
    let what = format!("verifying shard {} on every replica", args.shard);
    let (_, report) = run_job(&admin, body, &numbers, &what).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        match report["verdict"].as_str().unwrap_or_default() {
            "equal" => println!(
                "shard {}: every replica ({}) holds the same records [{}, {}]",
                args.shard, report["replicas"], report["from"], report["equal_through"]
            ),
            "diverged" => println!(
                "shard {}: replicas differ from seqno {}: differing {}, missing records {}, majority {}",
                args.shard, report["first_divergent_seqno"], report["differing"], report["missing"], report["majority"]
            ),
            "empty" => println!("shard {}: no replica holds a record of the range", args.shard),
            "settled" => println!("shard {}: {}", args.shard, report["note"].as_str().unwrap_or_default()),
            _ => bail!("verify failed: {}", report["error"].as_str().unwrap_or("unknown")),
        }
    }
    if report["verdict"] == "diverged" {
        return Err(Diverged.into());
    }
    Ok(())
}

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// The shard to export.
    #[arg(long)]
    pub shard: u32,
    /// First seqno [default: 1].
    #[arg(long)]
    pub from: Option<u64>,
    /// Last seqno [default: the leader's commit seqno now].
    #[arg(long)]
    pub to: Option<u64>,
    /// The node to read on, e.g. node-2 [default: the leader].
    #[arg(long)]
    pub node: Option<String>,
    /// Where to write the Arrow IPC file (pyarrow: `pyarrow.ipc.open_file`,
    /// DuckDB: `read_arrow` / the arrow extension).
    #[arg(long)]
    pub out: std::path::PathBuf,
    #[command(flatten)]
    pub admin: AdminArgs,
}

pub async fn export(args: ExportArgs) -> Result<()> {
    let admin = args.admin.resolve()?;
    let mut body = serde_json::json!({"kind": "export", "shard": args.shard});
    if let Some(node) = &args.node {
        body["node"] = node.clone().into();
    }
    let what = format!("exporting shard {}", args.shard);
    let (job, report) = run_job(&admin, body, &[("from", args.from), ("to", args.to)], &what).await?;
    if report["state"] != "done" {
        bail!("export failed: {}", report["error"].as_str().unwrap_or("unknown"));
    }
    let (status, bytes) = http::request_raw("GET", &admin.url, &format!("/v1/jobs/{job}/export"), None, None).await?;
    if status != 200 {
        bail!("fetching the export ({status}): {}", String::from_utf8_lossy(&bytes));
    }
    let tmp = args.out.with_extension("arrow.partial");
    std::fs::write(&tmp, &bytes).map_err(|e| anyhow::anyhow!("writing {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, &args.out).map_err(|e| anyhow::anyhow!("writing {}: {e}", args.out.display()))?;
    let (from, to, rows) = (report["from"].as_u64(), report["to"].as_u64(), report["rows"].as_u64());
    println!(
        "exported shard {} {}, {} bytes to {}",
        args.shard,
        exported_range(from, to, rows),
        bytes.len(),
        args.out.display()
    );
    Ok(())
}

/// What an export's report says it wrote: the replica exports from `from`
/// up to `to` or what it holds committed and durable, whichever is lower,
/// so fewer rows than asked for means the range was cut short there.
fn exported_range(from: Option<u64>, to: Option<u64>, rows: Option<u64>) -> String {
    match (from, to, rows) {
        (Some(from), Some(to), Some(0)) => {
            format!("no records of the requested [{from}, {to}]: 0 rows (none committed there yet)")
        }
        (Some(from), Some(to), Some(rows)) if rows < to.saturating_sub(from).saturating_add(1) => format!(
            "records [{from}, {}] of the requested [{from}, {to}]: {rows} rows (the replica held no further committed records)",
            from + rows - 1
        ),
        (Some(from), Some(to), Some(rows)) => format!("records [{from}, {to}]: {rows} rows"),
        _ => "records (the report gave no range)".to_string(),
    }
}

#[cfg(test)]
mod export_tests {
    use super::exported_range;

    #[test]
    fn a_short_export_says_what_it_wrote_not_what_was_asked() {
        assert_eq!(exported_range(Some(1), Some(10), Some(10)), "records [1, 10]: 10 rows");
        assert_eq!(
            exported_range(Some(1), Some(10), Some(4)),
            "records [1, 4] of the requested [1, 10]: 4 rows (the replica held no further committed records)"
        );
        assert!(exported_range(Some(5), Some(9), Some(0)).starts_with("no records of the requested [5, 9]"));
        assert_eq!(exported_range(None, Some(9), Some(3)), "records (the report gave no range)");
    }
}

#[derive(Args, Debug)]
#[command(after_help = "Runs against a live cluster (e.g. `walship dev`): starts --tasks no-op tasks as one job \
and prints tasks/s and each one's dispatch-to-completion latency (p50, p99, max), measured by the coordinator.")]
pub struct BenchTasksArgs {
    /// No-op tasks to dispatch.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub tasks: u32,
    #[command(flatten)]
    pub admin: AdminArgs,
}

/// The dispatch benchmark: how fast the coordinator gets no-op tasks to
/// the workers and their completions back.
pub async fn bench_tasks(args: BenchTasksArgs) -> Result<()> {
    let admin = args.admin.resolve()?;
    let body = serde_json::json!({"kind": "noop", "count": args.tasks});
    let started = std::time::Instant::now();
    let (status, job) =
        http::request("POST", &admin.url, "/v1/tasks", Some(&body.to_string()), admin.token.as_deref()).await?;
    expect(status, 202, &job)?;
    let query = job["query_id"].as_str().unwrap_or_default().to_string();
    let finished = loop {
        let path = format!("/v1/tasks?query_id={query}&state=succeeded&limit=1");
        let (status, page) = http::request("GET", &admin.url, &path, None, None).await?;
        expect(status, 200, &page)?;
        if page["total"].as_u64() == Some(u64::from(args.tasks)) {
            break started.elapsed();
        }
        if started.elapsed() > Duration::from_secs(600) {
            bail!("the tasks did not all succeed within 10 minutes ({} did)", page["total"]);
        }
        // Polling lists the coordinator's tasks: not so often that the
        // benchmark measures its own polling.
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let mut took = Vec::new();
    let mut offset = 0;
    while took.len() < args.tasks as usize {
        let path = format!("/v1/tasks?query_id={query}&limit=1000&offset={offset}");
        let (status, page) = http::request("GET", &admin.url, &path, None, None).await?;
        expect(status, 200, &page)?;
        let tasks = page["tasks"].as_array().cloned().unwrap_or_default();
        if tasks.is_empty() {
            break;
        }
        took.extend(tasks.iter().filter_map(|t| t["took_us"].as_u64()));
        offset += tasks.len();
    }
    took.sort_unstable();
    let at =
        |q: f64| took.get(((took.len() as f64 * q) as usize).min(took.len().saturating_sub(1))).copied().unwrap_or(0);
    println!(
        "{} no-op tasks in {:.2} s: {:.0} tasks/s (wall, including the API round trips); dispatch to completion \
         p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        args.tasks,
        finished.as_secs_f64(),
        f64::from(args.tasks) / finished.as_secs_f64(),
        at(0.5) as f64 / 1000.0,
        at(0.99) as f64 / 1000.0,
        took.last().copied().unwrap_or(0) as f64 / 1000.0
    );
    Ok(())
}
