//! The `walship` binary: CLI parsing, configuration and process wiring only.
//! Everything with behaviour lives in the workspace crates.

mod archive;
mod bench;
mod bench_dataplane;
mod bench_drills;
mod bench_target;
mod catchup;
mod client;
mod client_config;
mod client_error;
mod client_pipeline;
mod config;
mod coord;
mod dev;
mod drill;
mod failover;
mod http;
mod memory;
mod node;
mod peer;
mod replica;
mod status;
mod task;
mod tls;

use std::io::IsTerminal;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// The build a process runs: its version and, when built from git with
/// `WALSHIP_BUILD_SHA` set, the commit (DataPlane workers are compared on it).
pub const BUILD: &str = match option_env!("WALSHIP_BUILD_SHA") {
    Some(sha) => sha,
    None => env!("CARGO_PKG_VERSION"),
};

#[derive(Parser)]
#[command(name = "walship", version, about = "A sharded, replicated write-ahead-log service", after_help = LOGGING_HELP)]
struct Cli {
    /// Log line format on stderr: `text` or `json` [env: WALSHIP_LOG_FORMAT; default: text].
    #[arg(long, global = true, value_enum)]
    log_format: Option<LogFormat>,
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    tls: tls::ClientTls,
}

#[derive(Subcommand)]
enum Command {
    /// Run a shard node: its WAL, the client Log service (gRPC) and its admin HTTP API.
    #[command(after_help = LOGGING_HELP)]
    Node(node::NodeArgs),
    /// Run a coordinator: leadership in a compare-and-set KV, failure detection, failover, the cluster admin API.
    #[command(after_help = LOGGING_HELP)]
    Coord(coord::CoordArgs),
    /// Run an embedded local cluster: three nodes on loopback, shards at RF=3, no other setup.
    #[command(after_help = LOGGING_HELP)]
    Dev(dev::DevArgs),
    /// Append records to a shard: one per stdin line, or generated with --count/--size.
    Append(client::AppendArgs),
    /// Read a range of records from a shard.
    Read(client::ReadArgs),
    /// Stream a shard's records from a seqno, following new appends.
    Tail(client::TailArgs),
    /// Measure DataPlane verify and export throughput against the raw read of the same WAL files, and live appends beside them.
    BenchDataplane(bench_dataplane::BenchDataplaneArgs),
    /// Run the failover drill N times and the catch-up drill on a fresh dev cluster; print the figures.
    BenchDrills(bench_drills::BenchDrillsArgs),
    /// Show the cluster as the coordinator sees it: shards, leaders, epochs, replicas, lag.
    Status(status::StatusArgs),
    /// Preview or perform a shard failover through the coordinator.
    Failover(failover::FailoverArgs),
    /// Move leaderships from nodes leading more than their share to those leading less (after a failover).
    Rebalance(failover::RebalanceArgs),
    /// Run a failover or catch-up drill on the live cluster through the coordinator.
    Drill(drill::DrillArgs),
    /// Add, remove or replace a shard's replica under load through the coordinator.
    Replica(replica::ReplicaArgs),
    /// Measure append throughput and latency against this machine's raw disk limits.
    Bench(bench::BenchArgs),
    /// List, show, cancel and re-drive the coordinator's DataPlane tasks.
    Task(task::TaskArgs),
    /// Compare every replica of a shard record by record; report the first seqno where one differs.
    Verify(task::VerifyArgs),
    /// Write a shard's records of a range to an Arrow IPC file (seqno, epoch, timestamp, key, payload).
    Export(task::ExportArgs),
    /// Measure DataPlane dispatch on a live cluster: no-op tasks per second and their latency.
    BenchTasks(task::BenchTasksArgs),
    /// List or check what the object store holds of a shard.
    Archive(archive::ArchiveArgs),
    /// Rebuild a shard's log from the object store alone, to a seqno or a time, into a new data dir.
    Restore(archive::RestoreArgs),
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // Client commands name their failure and exit with its code.
            if let Some(failed) = e.downcast_ref::<client_error::Failed>() {
                return std::process::ExitCode::from(failed.error.report(failed.json));
            }
            if e.downcast_ref::<task::Diverged>().is_some() {
                return std::process::ExitCode::from(4);
            }
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// How log lines are written to stderr (`WALSHIP_LOG_FORMAT` or `--log-format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    /// One human-readable line per event (colours only at a terminal).
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, `fields`
    /// (with `message`) and the enclosing `spans`.
    Json,
}

const LOGGING_HELP: &str = "Logging (to stderr):
  WALSHIP_LOG         which events are logged, as a tracing filter: a level (error, warn, info, debug, trace)
                      and per-module levels, e.g. `info,walship_shipping=debug` [default: info,raft_engine=warn]
  WALSHIP_LOG_FORMAT  `text` (default) or `json` (one JSON object per line); `--log-format` overrides it
  NO_COLOR            no ANSI colours even at a terminal (a pipe or a file never gets them)";

fn run() -> Result<()> {
    let cli = Cli::parse();
    let format = match cli.log_format {
        Some(format) => format,
        None => match std::env::var("WALSHIP_LOG_FORMAT") {
            Ok(value) => <LogFormat as clap::ValueEnum>::from_str(&value, true)
                .map_err(|_| anyhow::anyhow!("WALSHIP_LOG_FORMAT must be `text` or `json`, not {value:?}"))?,
            Err(_) => LogFormat::Text,
        },
    };
    let filter =
        tracing_subscriber::EnvFilter::try_from_env("WALSHIP_LOG").unwrap_or_else(|_| "info,raft_engine=warn".into());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => tracing::subscriber::set_global_default(
            builder
                // Colours only for a person at a terminal: a log file, a pipe or a
                // journal gets plain text (and NO_COLOR turns them off anywhere).
                .with_ansi(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none())
                .finish(),
        )?,
        LogFormat::Json => tracing::subscriber::set_global_default(builder.json().with_ansi(false).finish())?,
    }
    if cli.log_format.is_some() {
        // Processes this one starts (`walship dev`'s nodes) log the same way.
        // SAFETY: no other thread runs yet (the runtime starts below).
        unsafe { std::env::set_var("WALSHIP_LOG_FORMAT", if format == LogFormat::Json { "json" } else { "text" }) };
    }
    // In place of tracing-log's bridge: raft-engine's recovery truncations
    // are told apart as a torn tail (INFO) or corruption (ERROR).
    walship_wal::recovery_log::install()?;
    // The client commands' TLS (`walship dev --tls` installs its own).
    if matches!(
        cli.command,
        Command::Append(_)
            | Command::Read(_)
            | Command::Tail(_)
            | Command::Status(_)
            | Command::Failover(_)
            | Command::Rebalance(_)
            | Command::Drill(_)
            | Command::Replica(_)
            | Command::BenchDrills(_)
            | Command::Task(_)
            | Command::Verify(_)
            | Command::Export(_)
            | Command::BenchTasks(_)
    ) {
        cli.tls.clone().install()?;
    }
    if matches!(
        cli.command,
        Command::Append(_)
            | Command::Read(_)
            | Command::Tail(_)
            | Command::Status(_)
            | Command::Failover(_)
            | Command::Rebalance(_)
    ) {
        exit_quietly_on_closed_pipe();
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        match cli.command {
            Command::Node(args) => node::run_node(args).await,
            Command::Dev(args) => dev::run_dev(args).await,
            Command::Coord(args) => coord::run_coord(args).await,
            Command::Append(args) => client::append(args).await,
            Command::Read(args) => client::read(args).await,
            Command::Tail(args) => client::tail(args).await,
            Command::Bench(args) => bench::run(args).await,
            Command::Drill(args) => drill::run(args).await,
            Command::Status(args) => status::run(args).await,
            Command::Failover(args) => failover::run(args).await,
            Command::Rebalance(args) => failover::rebalance(args).await,
            Command::Replica(args) => replica::run(args).await,
            Command::BenchDrills(args) => bench_drills::run(args).await,
            Command::BenchDataplane(args) => bench_dataplane::run(args).await,
            Command::Task(args) => task::run(args).await,
            Command::Verify(args) => task::verify(args).await,
            Command::Export(args) => task::export(args).await,
            Command::BenchTasks(args) => task::bench_tasks(args).await,
            Command::Archive(args) => archive::run(args).await,
            Command::Restore(args) => archive::run_restore(args).await,
        }
    })
}

/// A client command whose output goes to `head` (or any reader that stops
/// early) ends quietly when the reader goes away, as Unix tools do. Not by
/// restoring SIGPIPE's default action: that would also kill the client when
/// a *socket* it writes to was closed by the server (a TLS port spoken to
/// in plaintext, a node that dies), silently, with status 141. Instead a
/// print to a closed stdout (which panics in Rust, the signal being
/// ignored) exits with status 0, and every other panic is reported as
/// before.
fn exit_quietly_on_closed_pipe() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or_default();
        if message.starts_with("failed printing to stdout") && message.contains("Broken pipe") {
            std::process::exit(0);
        }
        report(info);
    }));
}
