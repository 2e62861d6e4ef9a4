//! Client subcommands: `append`, `read`, `tail`. Text output by default;
//! `--json` prints one JSON object per line for scripts.

use std::io::BufRead;

use anyhow::{Context, Result, bail};
use base64::Engine as _;
use bytes::Bytes;
use clap::{Args, ValueEnum};
use serde_json::json;
use tonic::transport::{Channel, Endpoint};
use walship_proto::log::log_client::LogClient;
use walship_proto::log::{AppendRecord, AppendRequest, Durability, ReadRequest, Record, TailRequest};

#[derive(Args, Debug, Clone)]
pub struct ServerArgs {
    /// gRPC address of a node, e.g. 127.0.0.1:7400.
    #[arg(long, env = "WALSHIP_SERVER", default_value = "127.0.0.1:7400")]
    pub server: String,
    /// Shard id.
    #[arg(long)]
    pub shard: u32,
    /// One JSON object per line instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(ValueEnum, Debug, Clone, Copy)]
pub enum DurabilityArg {
    Local,
    Quorum,
    All,
}

impl From<DurabilityArg> for Durability {
    fn from(d: DurabilityArg) -> Durability {
        match d {
            DurabilityArg::Local => Durability::Local,
            DurabilityArg::Quorum => Durability::Quorum,
            DurabilityArg::All => Durability::All,
        }
    }
}

#[derive(Args, Debug)]
pub struct AppendArgs {
    #[command(flatten)]
    server: ServerArgs,
    /// Durability the append waits for.
    #[arg(long, value_enum, default_value = "quorum")]
    durability: DurabilityArg,
    /// Generate this many records instead of reading stdin lines.
    #[arg(long, requires = "size")]
    count: Option<u64>,
    /// Payload size of generated records, in bytes.
    #[arg(long)]
    size: Option<usize>,
    /// Records per append request.
    #[arg(long, default_value_t = 100)]
    batch: usize,
}

#[derive(Args, Debug)]
pub struct ReadArgs {
    #[command(flatten)]
    server: ServerArgs,
    /// First seqno to read.
    #[arg(long, default_value_t = 1)]
    from: u64,
    /// Last seqno to read (inclusive); default: the newest durable record.
    #[arg(long)]
    to: Option<u64>,
}

#[derive(Args, Debug)]
pub struct TailArgs {
    #[command(flatten)]
    server: ServerArgs,
    /// First seqno to stream.
    #[arg(long, default_value_t = 1)]
    from: u64,
}

/// Connects to a node's gRPC address (`host:port` or a URL).
pub async fn connect(server: &str) -> Result<LogClient<Channel>> {
    let url = if server.contains("://") { server.to_string() } else { format!("http://{server}") };
    let channel =
        Endpoint::from_shared(url.clone())?.connect().await.with_context(|| format!("connecting to {url}"))?;
    Ok(LogClient::new(channel).max_decoding_message_size(64 << 20).max_encoding_message_size(64 << 20))
}

/// The leader's gRPC address from a not-leader refusal (`<id>@<addr>`).
fn leader_hint(status: &tonic::Status) -> Option<String> {
    if status.code() != tonic::Code::FailedPrecondition {
        return None;
    }
    let hint = status.metadata().get(walship_proto::LEADER_METADATA_KEY)?.to_str().ok()?;
    hint.split_once('@').map(|(_, addr)| addr.to_string())
}

/// Sends an append, following not-leader hints (a refused append was not
/// applied, so retrying it on the leader is safe).
async fn append_following_leader(
    client: &mut LogClient<Channel>,
    request: AppendRequest,
) -> Result<walship_proto::log::AppendResponse> {
    for _ in 0..4 {
        match client.append(request.clone()).await {
            Ok(response) => return Ok(response.into_inner()),
            Err(status) => match leader_hint(&status) {
                Some(leader) => {
                    tracing::info!(%leader, "following the leader hint");
                    *client = connect(&leader).await?;
                }
                None => return Err(status_error(status)),
            },
        }
    }
    anyhow::bail!("gave up after following 4 leader hints")
}

fn status_error(status: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{:?}: {}", status.code(), status.message())
}

pub async fn append(args: AppendArgs) -> Result<()> {
    if args.batch == 0 {
        bail!("--batch must be at least 1");
    }
    let mut client = connect(&args.server.server).await?;
    let mut send = async |records: Vec<AppendRecord>| -> Result<()> {
        let request = AppendRequest {
            shard_id: args.server.shard,
            records,
            durability: Durability::from(args.durability) as i32,
        };
        let r = append_following_leader(&mut client, request).await?;
        if args.server.json {
            println!(
                "{}",
                json!({"shard": args.server.shard, "first_seqno": r.first_seqno, "last_seqno": r.last_seqno, "epoch": r.epoch})
            );
        } else {
            println!(
                "appended shard {} seqnos {}..={} (epoch {})",
                args.server.shard, r.first_seqno, r.last_seqno, r.epoch
            );
        }
        Ok(())
    };
    let mut pending = Vec::with_capacity(args.batch);
    if let Some(count) = args.count {
        let size = args.size.unwrap_or(100);
        for i in 0..count {
            let mut payload = vec![0u8; size];
            rand::Rng::fill(&mut rand::thread_rng(), &mut payload[..]);
            pending.push(AppendRecord { key: Bytes::from(i.to_string()), payload: Bytes::from(payload) });
            if pending.len() == args.batch {
                send(std::mem::take(&mut pending)).await?;
            }
        }
    } else {
        for line in std::io::stdin().lock().lines() {
            pending.push(AppendRecord { key: Bytes::new(), payload: Bytes::from(line.context("reading stdin")?) });
            if pending.len() == args.batch {
                send(std::mem::take(&mut pending)).await?;
            }
        }
    }
    if !pending.is_empty() {
        send(pending).await?;
    }
    Ok(())
}

fn print_record(shard: u32, record: &Record, as_json: bool) {
    if as_json {
        let b64 = base64::engine::general_purpose::STANDARD;
        println!(
            "{}",
            json!({
                "shard": shard,
                "seqno": record.seqno,
                "epoch": record.epoch,
                "timestamp_us": record.timestamp_us,
                "crc32": record.crc32,
                "key": String::from_utf8_lossy(&record.key),
                "payload": String::from_utf8_lossy(&record.payload),
                "payload_b64": b64.encode(&record.payload),
            })
        );
    } else {
        println!("{}\t{}\t{}", record.seqno, record.epoch, String::from_utf8_lossy(&record.payload));
    }
}

pub async fn read(args: ReadArgs) -> Result<()> {
    let mut client = connect(&args.server.server).await?;
    let mut from = args.from;
    let mut to = args.to.unwrap_or(0);
    loop {
        let request = ReadRequest { shard_id: args.server.shard, from_seqno: from, to_seqno: to, max_bytes: 0 };
        let response = client.read(request).await.map_err(status_error)?.into_inner();
        if to == 0 {
            // Pin the end of the range at the first answer's durable seqno.
            to = response.durable_seqno;
        }
        for record in &response.records {
            print_record(args.server.shard, record, args.server.json);
        }
        from = response.next_seqno;
        if from > to || response.records.is_empty() {
            return Ok(());
        }
    }
}

pub async fn tail(args: TailArgs) -> Result<()> {
    let mut client = connect(&args.server.server).await?;
    let request = TailRequest { shard_id: args.server.shard, from_seqno: args.from };
    let mut stream = client.tail(request).await.map_err(status_error)?.into_inner();
    while let Some(response) = stream.message().await.map_err(status_error)? {
        for record in &response.records {
            print_record(args.server.shard, record, args.server.json);
        }
    }
    Ok(())
}
