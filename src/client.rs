//! Client subcommands: `append`, `read`, `tail`. Text output by default;
//! `--json` prints one JSON object per line for scripts.

use std::io::BufRead;

use anyhow::{Context, Result, bail};
use base64::Engine as _;
use bytes::Bytes;
use clap::{Args, ValueEnum};
use serde_json::json;
use tonic::transport::Channel;
use walship_proto::log::log_client::LogClient;
use walship_proto::log::{AppendRecord, AppendRequest, Durability, ReadRequest, Record, TailRequest};

#[derive(Args, Debug, Clone)]
pub struct ServerArgs {
    /// gRPC address of a node, e.g. 127.0.0.1:7401; appends take a
    /// comma-separated list and find the leader among them.
    /// [default: the client config's `server`, else 127.0.0.1:7401]
    #[arg(long, env = "WALSHIP_SERVER")]
    pub server: Option<String>,
    /// Shard id.
    #[arg(long)]
    pub shard: u32,
    /// One JSON object per line instead of text.
    #[arg(long)]
    pub json: bool,
}

impl ServerArgs {
    /// The node address(es): flag or environment, else the client config.
    fn address(&self) -> Result<String> {
        match &self.server {
            Some(s) => Ok(s.clone()),
            None => Ok(crate::client_config::load()?.server.unwrap_or_else(|| "127.0.0.1:7401".into())),
        }
    }

    /// The first address, for commands that talk to one node.
    fn first(&self) -> Result<String> {
        Ok(self.address()?.split(',').next().unwrap_or_default().trim().to_string())
    }
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
    /// How long one append may keep looking for a leader (through failovers).
    #[arg(long, default_value = "10s", value_parser = humantime_secs)]
    deadline: std::time::Duration,
}

fn humantime_secs(text: &str) -> Result<std::time::Duration, String> {
    let (number, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(text.len()));
    let value: f64 = number.parse().map_err(|_| format!("bad duration {text:?}"))?;
    let seconds = match unit {
        "" | "s" => value,
        "ms" => value / 1000.0,
        "m" => value * 60.0,
        _ => return Err(format!("bad duration unit in {text:?} (use ms, s or m)")),
    };
    Ok(std::time::Duration::from_secs_f64(seconds))
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
    let endpoint = crate::tls::client_endpoint(server)?;
    let url = endpoint.uri().to_string();
    let channel = endpoint.connect().await.with_context(|| format!("connecting to {url}"))?;
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

/// How an append ended when it did not succeed.
#[derive(Debug)]
pub enum AppendFailure {
    /// The request may or may not have been applied (the leader died or was
    /// deposed mid-flight, or the deadline passed): never safe to assume it
    /// failed.
    Unknown(String),
    /// Refused; nothing was applied.
    Refused(String),
}

impl std::fmt::Display for AppendFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AppendFailure::Unknown(m) => write!(f, "outcome unknown: {m}"),
            AppendFailure::Refused(m) => write!(f, "refused: {m}"),
        }
    }
}

/// Whether a failed call certainly did not apply the append: a not-leader
/// refusal, no leader assigned yet, a leadership change before the write,
/// or a connection that never opened.
fn not_applied(status: &tonic::Status) -> bool {
    let m = status.message();
    match status.code() {
        tonic::Code::FailedPrecondition => leader_hint(status).is_some(),
        tonic::Code::Unavailable => {
            !walship_proto::outcome_unknown(status)
                && (m.contains("no leader assigned") || m.contains("it was not written") || m.contains("connect"))
        }
        _ => false,
    }
}

/// A client that finds the leader among `servers` and follows it through
/// failovers: requests that certainly were not applied are retried (on the
/// hinted leader, else the next server) until `deadline`; anything that may
/// have been applied is reported as [`AppendFailure::Unknown`].
pub struct LeaderClient {
    servers: Vec<String>,
    next: usize,
    current: Option<LogClient<Channel>>,
    pub deadline: std::time::Duration,
}

impl LeaderClient {
    pub fn new(servers: Vec<String>, deadline: std::time::Duration) -> LeaderClient {
        LeaderClient { servers, next: 0, current: None, deadline }
    }

    async fn client(&mut self, hint: Option<String>) -> Result<LogClient<Channel>> {
        if let Some(c) = &self.current {
            return Ok(c.clone());
        }
        let server = hint.unwrap_or_else(|| {
            let s = self.servers[self.next % self.servers.len()].clone();
            self.next += 1;
            s
        });
        let c = connect(&server).await?;
        self.current = Some(c.clone());
        Ok(c)
    }

    pub async fn append(
        &mut self,
        request: AppendRequest,
    ) -> Result<walship_proto::log::AppendResponse, AppendFailure> {
        let started = std::time::Instant::now();
        let mut hint = None;
        loop {
            if started.elapsed() > self.deadline {
                return Err(AppendFailure::Refused(format!(
                    "no leader accepted the append within {:?}",
                    self.deadline
                )));
            }
            let mut client = match self.client(hint.take()).await {
                Ok(c) => c,
                Err(_) => {
                    self.current = None;
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            };
            let mut call = tonic::Request::new(request.clone());
            call.set_timeout(
                self.deadline.saturating_sub(started.elapsed()).max(std::time::Duration::from_millis(100)),
            );
            match client.append(call).await {
                Ok(response) => return Ok(response.into_inner()),
                Err(status) if not_applied(&status) => {
                    self.current = None;
                    hint = leader_hint(&status);
                    if hint.is_none() {
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    }
                }
                Err(status) => {
                    self.current = None;
                    let detail = format!("{:?}: {}", status.code(), status.message());
                    return Err(match status.code() {
                        tonic::Code::InvalidArgument | tonic::Code::NotFound | tonic::Code::OutOfRange => {
                            AppendFailure::Refused(detail)
                        }
                        _ => AppendFailure::Unknown(detail),
                    });
                }
            }
        }
    }
}

fn status_error(status: tonic::Status) -> anyhow::Error {
    match crate::tls::explain(&status) {
        Some(why) => anyhow::anyhow!("{:?}: {}: {why}", status.code(), status.message()),
        None => anyhow::anyhow!("{:?}: {}", status.code(), status.message()),
    }
}

pub async fn append(args: AppendArgs) -> Result<()> {
    if args.batch == 0 {
        bail!("--batch must be at least 1");
    }
    let servers: Vec<String> =
        args.server.address()?.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect();
    if servers.is_empty() {
        bail!("--server needs at least one address");
    }
    let mut client = LeaderClient::new(servers, args.deadline);
    let mut send = async |records: Vec<AppendRecord>| -> Result<()> {
        let count = records.len();
        let request = AppendRequest {
            shard_id: args.server.shard,
            records,
            durability: Durability::from(args.durability) as i32,
        };
        match client.append(request).await {
            Ok(r) => {
                if args.server.json {
                    println!(
                        "{}",
                        json!({"shard": args.server.shard, "outcome": "acknowledged", "first_seqno": r.first_seqno, "last_seqno": r.last_seqno, "epoch": r.epoch})
                    );
                } else {
                    println!(
                        "appended shard {} seqnos {}..={} (epoch {})",
                        args.server.shard, r.first_seqno, r.last_seqno, r.epoch
                    );
                }
                Ok(())
            }
            Err(AppendFailure::Unknown(detail)) => {
                if args.server.json {
                    println!(
                        "{}",
                        json!({"shard": args.server.shard, "outcome": "unknown", "records": count, "detail": detail})
                    );
                }
                Err(anyhow::Error::new(UnknownOutcome(detail)))
            }
            Err(AppendFailure::Refused(detail)) => bail!("append refused: {detail}"),
        }
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

/// An append whose outcome is unknown: `walship append` exits with code 3.
#[derive(Debug)]
pub struct UnknownOutcome(pub String);

impl std::fmt::Display for UnknownOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the append's outcome is unknown (it may or may not have been applied): {}", self.0)
    }
}

impl std::error::Error for UnknownOutcome {}

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
    let mut client = connect(&args.server.first()?).await?;
    let mut from = args.from;
    let mut to = args.to.unwrap_or(0);
    loop {
        let request = ReadRequest { shard_id: args.server.shard, from_seqno: from, to_seqno: to, max_bytes: 0 };
        let response = match client.read(request).await {
            Ok(r) => r.into_inner(),
            // An open-ended read of a shard with nothing (more) committed
            // prints nothing: there is simply nothing to read yet.
            Err(s)
                if args.to.is_none()
                    && s.code() == tonic::Code::OutOfRange
                    && s.message().contains("nothing at seqno") =>
            {
                return Ok(());
            }
            Err(s) => return Err(status_error(s)),
        };
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
    let mut client = connect(&args.server.first()?).await?;
    let request = TailRequest { shard_id: args.server.shard, from_seqno: args.from };
    let mut stream = client.tail(request).await.map_err(status_error)?.into_inner();
    while let Some(response) = stream.message().await.map_err(status_error)? {
        for record in &response.records {
            print_record(args.server.shard, record, args.server.json);
        }
    }
    Ok(())
}
