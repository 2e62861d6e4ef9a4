//! `walship replica add|remove|replace`: change a shard's replica set
//! through the coordinator (`POST /v1/shards/{id}/replicas`), and by
//! default wait for the change to end, with its progress on a spinner.
//! Exit status: 0 done, 1 refused or failed (the change undid itself).

use std::time::Duration;

use anyhow::{Result, bail};
use clap::{Args, Subcommand};

use crate::drill::AdminArgs;
use crate::http;

#[derive(Args, Debug)]
pub struct ReplicaArgs {
    #[command(subcommand)]
    command: ReplicaCommand,
}

#[derive(Subcommand, Debug)]
enum ReplicaCommand {
    /// Add a voting replica: it seeds from peers, the object store and the leader as a learner, then joins.
    Add {
        #[command(flatten)]
        change: Change,
        /// Node to add (default: the coordinator places one: live, outside the shard, in an uncovered region first).
        #[arg(long)]
        node: Option<u32>,
    },
    /// Remove a voting replica (never below replication.min_replicas; a leader hands over first).
    Remove {
        #[command(flatten)]
        change: Change,
        /// Replica to remove.
        #[arg(long)]
        node: u32,
    },
    /// Replace a replica (a dead node's) with another node; without --shard, on every shard the node holds, one after another.
    Replace {
        #[command(flatten)]
        change: Change,
        /// Replica to take out.
        #[arg(long)]
        node: u32,
        /// Node taking its place (default: the coordinator places one).
        #[arg(long)]
        with: Option<u32>,
    },
}

#[derive(Args, Debug)]
struct Change {
    #[command(flatten)]
    admin: AdminArgs,
    /// Shard whose replica set changes (required but for replace).
    #[arg(long)]
    shard: Option<u32>,
    /// Place a named node in a region another replica already covers.
    #[arg(long)]
    allow_same_region: bool,
    /// Seconds the new replica may take to seed and catch up.
    #[arg(long, default_value_t = 600)]
    catch_up_timeout_s: u64,
    /// Start the change and print its id without waiting for it.
    #[arg(long)]
    no_wait: bool,
    /// Print the change's report as JSON.
    #[arg(long)]
    json: bool,
}

pub async fn run(args: ReplicaArgs) -> Result<()> {
    let (action, change, node, with) = match args.command {
        ReplicaCommand::Add { change, node } => ("add", change, node, None),
        ReplicaCommand::Remove { change, node } => ("remove", change, Some(node), None),
        ReplicaCommand::Replace { change, node, with } => ("replace", change, Some(node), with),
    };
    let admin = change.admin.resolve()?;
    let shards = match (change.shard, action, node) {
        (Some(shard), _, _) => vec![shard],
        (None, "replace", Some(node)) => {
            let (status, shards) = http::request("GET", &admin.url, "/v1/shards", None, None).await?;
            if status != 200 {
                bail!("listing shards ({status}): {}", shards["error"]["message"].as_str().unwrap_or_default());
            }
            let held: Vec<u32> = shards
                .as_array()
                .into_iter()
                .flatten()
                .filter(|s| {
                    s["replicas"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .any(|r| r["node_id"] == node && r["membership"] == "voter")
                })
                .filter_map(|s| s["shard_id"].as_u64().map(|id| id as u32))
                .collect();
            if held.is_empty() {
                bail!("node {node} holds no replica of any shard");
            }
            held
        }
        (None, _, _) => bail!("{action} needs --shard"),
    };
    for shard in shards {
        change_one(&admin, &change, shard, action, node, with).await?;
    }
    Ok(())
}

/// One replica change of `shard`, waited for unless `--no-wait`.
async fn change_one(
    admin: &crate::drill::Admin,
    change: &Change,
    shard: u32,
    action: &str,
    node: Option<u32>,
    with: Option<u32>,
) -> Result<()> {
    let body = match action {
        "remove" => serde_json::json!({ "action": action, "node": node }),
        _ => {
            let mut body = serde_json::json!({
                "action": action,
                "node": node,
                "allow_same_region": change.allow_same_region,
                "catch_up_timeout_s": change.catch_up_timeout_s,
            });
            if action == "replace" {
                body["with"] = serde_json::json!(with);
            }
            body
        }
    };
    let path = format!("/v1/shards/{}/replicas", shard);
    let (status, started) =
        http::request("POST", &admin.url, &path, Some(&body.to_string()), admin.token.as_deref()).await?;
    if status != 202 {
        bail!(
            "{} ({status}): {}",
            started["error"]["code"].as_str().unwrap_or("refused"),
            started["error"]["message"].as_str().unwrap_or_default()
        );
    }
    let id = started["id"].as_str().unwrap_or_default().to_string();
    if change.no_wait {
        if change.json {
            println!("{}", serde_json::to_string_pretty(&started)?);
        } else {
            println!("{id}: started (follow it with `walship task show {id}`)");
        }
        return Ok(());
    }
    let spinner = indicatif::ProgressBar::new_spinner();
    spinner.enable_steady_tick(Duration::from_millis(100));
    let report = loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let (status, report) =
            http::request("GET", &admin.url, &format!("/v1/replica-changes/{id}"), None, None).await?;
        if status != 200 {
            bail!("the coordinator lost track of {id} ({status}): was it restarted?");
        }
        if report["state"] != "running" {
            break report;
        }
        spinner.set_message(format!(
            "{id}: {}, new replica at {} of {} committed, {:.1} MiB/s",
            report["step"].as_str().unwrap_or("?"),
            report["learner_durable_seqno"],
            report["leader_commit_seqno"],
            report["catch_up_mib_per_s"].as_f64().unwrap_or(0.0)
        ));
    };
    spinner.finish_and_clear();
    if change.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        let mib = |k: &str| report[k].as_u64().unwrap_or(0) as f64 / (1 << 20) as f64;
        println!(
            "{id}: shard {} replicas {} -> {} {} in {} ms",
            shard,
            report["from_replicas"],
            report["to_replicas"],
            report["state"].as_str().unwrap_or("?"),
            report["took_ms"]
        );
        if report["adding"].is_u64() {
            println!(
                "  node {} caught up in {} ms at {:.1} MiB/s: peers {:.1} MiB, object store {:.1} MiB, leader stream {:.1} MiB, live pushes {:.1} MiB",
                report["adding"],
                report["catch_up_ms"],
                report["catch_up_mib_per_s"].as_f64().unwrap_or(0.0),
                mib("bytes_peer"),
                mib("bytes_archive"),
                mib("bytes_stream"),
                mib("bytes_push")
            );
        }
        if let Some(to) = report["leadership_moved_to"].as_u64() {
            println!("  leadership moved to node {to} first");
        }
    }
    if report["state"] != "done" {
        bail!("{id} failed and was undone: {}", report["error"].as_str().unwrap_or("?"));
    }
    Ok(())
}
