//! `walship status`: the cluster as the active coordinator sees it, as a
//! table (like `patronictl list`) or JSON. Each replica's positions come
//! from its own newest heartbeat (`pos age` says how old); a follower's lag
//! is `live` while its leader hears from it, else `STALE`, counted from its
//! last known position. `archived` is, on an archived shard's leader row,
//! the newest seqno in the object store and the committed records not yet
//! there.

use anyhow::{Result, bail};
use clap::Args;

use crate::drill::AdminArgs;
use crate::http;

#[derive(Args, Debug)]
pub struct StatusArgs {
    #[command(flatten)]
    admin: AdminArgs,
    /// Print the coordinator's JSON (cluster and shards) instead of a table.
    #[arg(long)]
    json: bool,
    /// Only shards needing attention (no leader, a member down, a stale lag, a full disk, a corrupt record).
    #[arg(long)]
    unhealthy: bool,
    /// Only shards this node holds.
    #[arg(long)]
    node: Option<u32>,
    /// At most this many shards (1..=10000), in shard order, after --offset.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    limit: Option<u32>,
    /// Shards skipped before --limit.
    #[arg(long)]
    offset: Option<u32>,
}

fn cell(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Null => "-".into(),
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Number(n) => match n.as_f64() {
            Some(f) if n.is_f64() => format!("{f:.2}"),
            _ => n.to_string(),
        },
        other => other.to_string(),
    }
}

/// Milliseconds as seconds with one decimal, `-` when absent.
fn age(ms: &serde_json::Value) -> String {
    ms.as_u64().map_or_else(|| "-".into(), |ms| format!("{:.1}s", ms as f64 / 1e3))
}

/// `live`, or `STALE` with the age of the position the lag counts from
/// (the follower is down or its leader has not heard from it), or `-` for a
/// leader.
fn lag_state(replica: &serde_json::Value) -> String {
    if replica["lag_records"].is_null() && replica["lag_stale"] != true {
        return "-".into();
    }
    if replica["lag_stale"] == true {
        return format!(
            "STALE from {} ({} old)",
            cell(&replica["lag_from_seqno"]),
            age(&replica["lag_position_age_ms"])
        );
    }
    "live".into()
}

/// On the leader's row of an archived shard, its archived seqno and how
/// many committed records wait (`300 (lag 0)`); `-` elsewhere.
fn archived(shard: &serde_json::Value, replica: &serde_json::Value) -> String {
    match shard["archived_seqno"].as_u64() {
        Some(seqno) if replica["node_id"] == shard["leader"] => {
            format!("{seqno} (lag {})", cell(&shard["archive_lag_records"]))
        }
        _ => "-".into(),
    }
}

pub async fn run(args: StatusArgs) -> Result<()> {
    let admin = args.admin.resolve()?;
    let (code, cluster) = http::request("GET", &admin.url, "/v1/cluster", None, None).await?;
    if code != 200 {
        bail!("GET /v1/cluster: {code} {cluster}");
    }
    let mut query: Vec<String> = Vec::new();
    if args.unhealthy {
        query.push("unhealthy=true".into());
    }
    query.extend(args.node.map(|n| format!("node={n}")));
    query.extend(args.limit.map(|n| format!("limit={n}")));
    query.extend(args.offset.map(|n| format!("offset={n}")));
    let path = if query.is_empty() { "/v1/shards".to_string() } else { format!("/v1/shards?{}", query.join("&")) };
    let (code, shards) = http::request("GET", &admin.url, &path, None, None).await?;
    if code != 200 {
        bail!("GET /v1/shards: {code} {shards}");
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&serde_json::json!({"cluster": cluster, "shards": shards}))?);
        return Ok(());
    }
    let c = &cluster["coordinator"];
    println!(
        "cluster {} — coordinator {} ({}), lease term {}, kv {}",
        cell(&cluster["cluster_id"]),
        cell(&c["id"]),
        if c["active"] == true { "active" } else { "standby" },
        cell(&c["lease_term"]),
        cell(&c["kv"])
    );
    let leads: Vec<String> = cluster["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|n| format!("node {} {}", cell(&n["node_id"]), cell(&n["leads"])))
        .collect();
    println!("leaderships: {} (of {})", leads.join(", "), cell(&cluster["shards"]));
    let header = [
        "shard",
        "leader",
        "epoch",
        "node",
        "role",
        "alive",
        "disk",
        "wal",
        "last",
        "durable",
        "commit",
        "archived",
        "pos age",
        "lag rec",
        "lag bytes",
        "lag s",
        "lag is",
    ];
    let mut rows: Vec<Vec<String>> = Vec::new();
    for shard in shards.as_array().into_iter().flatten() {
        for replica in shard["replicas"].as_array().into_iter().flatten() {
            rows.push(vec![
                cell(&shard["shard_id"]),
                cell(&shard["leader"]),
                cell(&shard["epoch"]),
                cell(&replica["node_id"]),
                cell(&replica["role"]),
                if replica["alive"] == true { "yes".into() } else { "NO".into() },
                if replica["disk_full"] == true { "FULL".into() } else { "ok".into() },
                match replica["corrupt_from_seqno"].as_u64() {
                    Some(seqno) => format!("CORRUPT from {seqno}"),
                    None => "ok".into(),
                },
                cell(&replica["last_seqno"]),
                cell(&replica["durable_seqno"]),
                cell(&replica["commit_seqno"]),
                archived(shard, replica),
                age(&replica["position_age_ms"]),
                cell(&replica["lag_records"]),
                cell(&replica["lag_bytes"]),
                cell(&replica["lag_seconds"]),
                lag_state(replica),
            ]);
        }
    }
    let widths: Vec<usize> = (0..header.len())
        .map(|i| rows.iter().map(|r| r[i].len()).chain([header[i].len()]).max().unwrap_or(0))
        .collect();
    let line = |cells: Vec<String>| {
        let padded: Vec<String> = cells.iter().zip(&widths).map(|(c, w)| format!("{c:>w$}")).collect();
        format!("| {} |", padded.join(" | "))
    };
    let rule = format!("+{}+", widths.iter().map(|w| "-".repeat(w + 2)).collect::<Vec<_>>().join("+"));
    println!("{rule}");
    println!("{}", line(header.iter().map(|h| h.to_string()).collect()));
    println!("{rule}");
    for row in rows {
        println!("{}", line(row));
    }
    println!("{rule}");
    let stale = shards
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|s| s["replicas"].as_array().into_iter().flatten())
        .any(|r| r["lag_stale"] == true);
    if stale {
        println!(
            "STALE lag: the follower is down or its leader has not heard from it; it lacks at least the records \
             after its last known position"
        );
    }
    let without = cluster["shards_without_leader"].as_u64().unwrap_or(0);
    if without > 0 {
        println!("{without} shard(s) without a leader");
    }
    Ok(())
}
