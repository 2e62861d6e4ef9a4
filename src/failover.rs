//! `walship failover`: preview or perform a shard failover through the
//! coordinator, with a spinner while it runs and the candidates' loss
//! ranges in the report.

use std::time::Duration;

use anyhow::{Result, bail};
use clap::Args;

use crate::drill::AdminArgs;
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

fn range(v: &serde_json::Value) -> String {
    match v.as_array() {
        Some(r) if r.len() == 2 => format!("{}..={}", r[0], r[1]),
        _ => "-".into(),
    }
}

pub async fn run(args: FailoverArgs) -> Result<()> {
    let admin = args.admin.resolve()?;
    let body = serde_json::json!({"target": args.target, "preview": args.preview, "allow_loss": args.allow_loss});
    let spinner = indicatif::ProgressBar::new_spinner();
    spinner.set_message(format!(
        "{} shard {}",
        if args.preview { "previewing a failover of" } else { "failing over" },
        args.shard
    ));
    spinner.enable_steady_tick(Duration::from_millis(100));
    let path = format!("/v1/shards/{}/failover", args.shard);
    let result = http::request("POST", &admin.url, &path, Some(&body.to_string()), admin.token.as_deref()).await;
    spinner.finish_and_clear();
    let (status, outcome) = result?;
    if status != 200 {
        bail!(
            "{} ({status}): {}",
            outcome["error"]["code"].as_str().unwrap_or("refused"),
            outcome["error"]["message"].as_str().unwrap_or_default()
        );
    }
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
