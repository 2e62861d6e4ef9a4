//! `walship failover`: preview or perform a shard failover through the
//! coordinator, with a spinner while it runs and the candidates' loss
//! ranges in the report. `walship rebalance`: move leaderships from the
//! nodes leading more than their share to those leading less.

use std::time::Duration;

use anyhow::{Result, bail};
use clap::Args;

use crate::drill::{Admin, AdminArgs};
use crate::http;

#[derive(Args, Debug)]
pub struct FailoverArgs {
    #[command(flatten)]
    admin: AdminArgs,
    /// Shard to fail over.
    #[arg(long)]
    shard: u32,
    /// Replica to promote (default: the most up-to-date one).
    #[arg(long)]
    target: Option<u32>,
    /// Change nothing: show what each candidate would lose.
    #[arg(long)]
    preview: bool,
    /// Promote even if acknowledged records would be lost (forced failover).
    #[arg(long)]
    allow_loss: bool,
    /// Print the coordinator's JSON.
    #[arg(long)]
    json: bool,
}

/// POSTs `body` to the coordinator's `path` with a spinner saying `doing`;
/// its JSON answer, or an error naming the refusal.
async fn post(admin: &Admin, path: &str, body: &serde_json::Value, doing: String) -> Result<serde_json::Value> {
    let spinner = indicatif::ProgressBar::new_spinner();
    spinner.set_message(doing);
    spinner.enable_steady_tick(Duration::from_millis(100));
    let result = http::request("POST", &admin.url, path, Some(&body.to_string()), admin.token.as_deref()).await;
    spinner.finish_and_clear();
    let (status, outcome) = result?;
    if status != 200 {
        bail!(
            "{} ({status}): {}",
            outcome["error"]["code"].as_str().unwrap_or("refused"),
            outcome["error"]["message"].as_str().unwrap_or_default()
        );
    }
    Ok(outcome)
}

fn range(v: &serde_json::Value) -> String {
    match v.as_array() {
        Some(r) if r.len() == 2 => format!("{}..={}", r[0], r[1]),
        _ => "-".into(),
    }
}

pub async fn run(args: FailoverArgs) -> Result<()> {
    let admin = args.admin.resolve()?;
    let body = serde_json::json!({"target": args.target, "preview": args.preview, "allow_loss": args.allow_loss});
    let doing =
        format!("{} shard {}", if args.preview { "previewing a failover of" } else { "failing over" }, args.shard);
    let outcome = post(&admin, &format!("/v1/shards/{}/failover", args.shard), &body, doing).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&outcome)?);
        return Ok(());
    }
    if outcome["preview"] == true {
        println!(
            "shard {}: epoch {}, leader {}, commit {} (nothing changed)",
            args.shard, outcome["epoch"], outcome["from"], outcome["commit_seqno"]
        );
    } else {
        println!(
            "shard {}: leader {} -> {} in epoch {} ({} ms){}",
            args.shard,
            outcome["from"],
            outcome["to"],
            outcome["epoch"],
            outcome["took_ms"],
            if outcome["lost"].is_null() { String::new() } else { format!(", LOST {}", range(&outcome["lost"])) }
        );
    }
    println!(
        "{:>6} {:>10} {:>10} {:>14} {:>26}",
        "node", "last epoch", "last seqno", "would lose", "of which acknowledged"
    );
    for c in outcome["candidates"].as_array().into_iter().flatten() {
        println!(
            "{:>6} {:>10} {:>10} {:>14} {:>26}{}",
            c["node"].to_string(),
            c["last_epoch"].to_string(),
            c["last_seqno"].to_string(),
            range(&c["would_lose"]),
            range(&c["would_lose_acknowledged"]),
            if c["is_best"] == true { "  (most up to date)" } else { "" }
        );
    }
    if let Some(down) = outcome["unreachable"].as_array().filter(|d| !d.is_empty()) {
        println!("unreachable: {down:?}");
    }
    Ok(())
}

#[derive(Args, Debug)]
pub struct RebalanceArgs {
    #[command(flatten)]
    admin: AdminArgs,
    /// Change nothing: show the moves a rebalance would make.
    #[arg(long)]
    preview: bool,
    /// The most shards to move (default: every move planned).
    #[arg(long, value_parser = clap::value_parser!(i32).range(1..))]
    max_moves: Option<i32>,
    /// Print the coordinator's JSON.
    #[arg(long)]
    json: bool,
}

/// Shards led per node, as `node 1: 5, node 2: 4`.
fn leads(v: &serde_json::Value) -> String {
    let Some(by_node) = v.as_object() else { return "-".into() };
    by_node.iter().map(|(node, n)| format!("node {node}: {n}")).collect::<Vec<_>>().join(", ")
}

pub async fn rebalance(args: RebalanceArgs) -> Result<()> {
    let admin = args.admin.resolve()?;
    let body = serde_json::json!({"preview": args.preview, "max_moves": args.max_moves});
    let doing = if args.preview { "planning a rebalance" } else { "rebalancing leaderships" };
    let outcome = post(&admin, "/v1/rebalance", &body, doing.to_string()).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&outcome)?);
        return Ok(());
    }
    let moves = outcome["moves"].as_array().cloned().unwrap_or_default();
    println!("leading before: {} (fair share {})", leads(&outcome["leads_before"]), outcome["fair_share"]);
    if moves.is_empty() {
        println!("balanced: nothing to move");
        return Ok(());
    }
    if outcome["preview"] == true {
        println!("would move {} shards (nothing changed):", moves.len());
    } else {
        println!("moved {} of {} shards in {} ms:", outcome["moved"], moves.len(), outcome["took_ms"]);
    }
    // One line per pair of nodes (thousands of shards move at once), then
    // each shard that did not end where planned.
    let mut pairs: std::collections::BTreeMap<(String, String), (usize, usize)> = Default::default();
    for m in &moves {
        let pair = pairs.entry((m["from"].to_string(), m["to"].to_string())).or_default();
        pair.0 += 1;
        pair.1 += usize::from(m["leader"] == m["to"]);
    }
    for ((from, to), (planned, moved)) in pairs {
        match outcome["preview"] == true {
            true => println!("  node {from} -> node {to}: {planned} shards"),
            false => println!("  node {from} -> node {to}: {moved} of {planned} shards moved"),
        }
    }
    for m in moves.iter().filter(|m| !m["leader"].is_null() || !m["error"].is_null()) {
        match (&m["leader"], &m["error"]) {
            (_, serde_json::Value::String(error)) => println!("  shard {}: not moved: {error}", m["shard"]),
            (leader, _) if *leader != m["to"] => println!(
                "  shard {}: node {leader} leads it (node {} lacked records at the fence; the next rebalance tries again)",
                m["shard"], m["to"]
            ),
            _ => {}
        }
    }
    println!("leading after: {}", leads(&outcome["leads_after"]));
    Ok(())
}
