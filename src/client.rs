//! Client subcommands: `append`, `read`, `tail`. Text output by default;
//! `--json` prints one JSON object per line for scripts.
//!
//! Nothing waits without a bound: opening a connection (TCP, HTTP/2 and a
//! health probe that the server is a walship node) is bounded by
//! `--connect-timeout`, each call by `--request-timeout`, a whole command by
//! `--deadline`, and a tail's stream by HTTP/2 heartbeats (`--idle-timeout`).
//! With several `--server` addresses a command moves on to the next one when
//! a server is frozen, refused or not the leader; a tail resumes on another
//! replica from the next seqno. Failures are named for what they are
//! ([`crate::client_error`]), with one exit code each.

use std::io::BufRead;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use clap::{Args, ValueEnum};
use serde_json::json;
use tonic::transport::{Channel, Endpoint};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use walship_proto::log::log_client::LogClient;
use walship_proto::log::{AppendRecord, AppendRequest, Durability, Producer};

use crate::client_error::{ClientError, EXIT_CODES, Failed, Kind, connect_error, status_error};

/// The gRPC service a walship node answers the health probe for.
const LOG_SERVICE: &str = "walship.v1.Log";

/// Largest message the client sends or accepts; the node's own limits
/// (`[limits]` in its config) are usually lower and are reported by it.
const MAX_MESSAGE_BYTES: usize = 64 << 20;

#[derive(Args, Debug, Clone)]
pub struct ServerArgs {
    /// gRPC address(es) of nodes as host:port, comma-separated, e.g.
    /// 127.0.0.1:7401,127.0.0.1:7402. Appends find the leader among them;
    /// reads and tails use the first that answers and move on to the next
    /// when one fails.
    /// [default: the client config's `server`, else 127.0.0.1:7401]
    #[arg(long, env = "WALSHIP_SERVER")]
    pub server: Option<String>,
    /// Shard id.
    #[arg(long)]
    pub shard: u32,
    /// One JSON object per line instead of text; errors too, as
    /// {"error": {...}} on stderr.
    #[arg(long)]
    pub json: bool,
    /// Bound on opening a connection to one server: TCP connect, HTTP/2 and
    /// the health probe that it is a walship node. A frozen or silent server
    /// is given up after it and the next one is tried.
    #[arg(long, env = "WALSHIP_CONNECT_TIMEOUT", default_value = "2s", value_parser = duration)]
    pub connect_timeout: Duration,
    /// Bound on one call to one server (an append, a read page).
    #[arg(long, env = "WALSHIP_REQUEST_TIMEOUT", default_value = "5s", value_parser = duration)]
    pub request_timeout: Duration,
    /// Bound on the whole operation across servers and retries: one append
    /// batch (finding the leader through failovers), a read, or a tail's
    /// search for a replica to resume on.
    #[arg(long, env = "WALSHIP_DEADLINE", default_value = "10s", value_parser = duration)]
    pub deadline: Duration,
}

impl ServerArgs {
    /// The node addresses, validated: flag or environment, else the client
    /// config.
    fn servers(&self) -> Result<Vec<String>, ClientError> {
        let list = match &self.server {
            Some(s) => s.clone(),
            None => crate::client_config::load()
                .map_err(|e| ClientError::new(Kind::Other, None, format!("{e:#}")))?
                .server
                .unwrap_or_else(|| "127.0.0.1:7401".into()),
        };
        let servers: Vec<String> = list.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect();
        if servers.is_empty() {
            return Err(ClientError::new(Kind::InvalidAddress, None, "--server needs at least one host:port address"));
        }
        for server in &servers {
            server_url(server)?;
        }
        Ok(servers)
    }

    fn options(&self) -> ChannelOptions {
        ChannelOptions { connect_timeout: self.connect_timeout, heartbeat: None }
    }
}

/// Parses a duration: a number with `ms`, `s` (the default) or `m`; > 0.
fn duration(text: &str) -> Result<Duration, String> {
    let (number, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(text.len()));
    let value: f64 = number.parse().map_err(|_| format!("bad duration {text:?} (e.g. 500ms, 2s, 1m)"))?;
    let seconds = match unit {
        "" | "s" => value,
        "ms" => value / 1000.0,
        "m" => value * 60.0,
        _ => return Err(format!("bad duration unit in {text:?} (use ms, s or m)")),
    };
    if !(seconds > 0.0 && seconds < 1e9) {
        return Err(format!("duration {text:?} must be greater than 0"));
    }
    Ok(Duration::from_secs_f64(seconds))
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
#[command(after_help = EXIT_CODES)]
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
    /// Key stored with every record (default: none for stdin lines, the
    /// record's index for generated ones).
    #[arg(long)]
    key: Option<String>,
    /// Write only if the shard's newest seqno is exactly this (0: an empty
    /// shard); each later batch then expects the previous one's last seqno.
    /// A mismatch writes nothing and exits 13 (conflict), naming the
    /// shard's newest seqno.
    #[arg(long, value_name = "SEQNO")]
    expect_last: Option<u64>,
    /// Producer id (non-zero) the appends are written as. By default each
    /// run is a new producer with a random id, so a retried batch (after a
    /// timeout or a leader's death) is never written twice.
    #[arg(long, value_name = "ID", value_parser = clap::value_parser!(u64).range(1..), conflicts_with = "no_producer")]
    producer_id: Option<u64>,
    /// Producer epoch (non-zero) with --producer-id: a run with a higher
    /// epoch fences the runs with lower ones of the same id. Default: the
    /// Unix time in microseconds, so each run of a stable id takes over.
    #[arg(long, value_name = "EPOCH", requires = "producer_id", value_parser = clap::value_parser!(u64).range(1..))]
    producer_epoch: Option<u64>,
    /// Append without a producer: no deduplication, and a batch whose answer
    /// is lost ends the run with exit code 3 (outcome unknown) instead of
    /// being retried.
    #[arg(long)]
    no_producer: bool,
    /// With a producer (and without --expect-last): how many batches may be
    /// on the way to the leader at once, pipelined over one AppendStream.
    /// Each batch is still acknowledged and printed in input order; 1 sends
    /// the next only once the previous is acknowledged.
    #[arg(long, default_value_t = 8)]
    in_flight: usize,
}

/// How a channel to a node is opened.
#[derive(Debug, Clone, Copy)]
pub struct ChannelOptions {
    pub connect_timeout: Duration,
    /// HTTP/2 heartbeat: a connection that answers no PING for this long is
    /// closed (for long-lived streams).
    pub heartbeat: Option<Duration>,
}

/// `server` as a URL: `host:port` (or `http://host:port`), the port required.
fn server_url(server: &str) -> Result<String, ClientError> {
    let invalid = |why: &str| {
        ClientError::new(
            Kind::InvalidAddress,
            Some(server),
            format!("{server:?} is not a server address ({why}); expected host:port, e.g. 127.0.0.1:7401"),
        )
    };
    // --ca (WALSHIP_CA) turns TLS on for addresses given without a scheme.
    let scheme = if crate::tls::ClientTls::current().is_some() { "https" } else { "http" };
    let url = if server.contains("://") { server.to_string() } else { format!("{scheme}://{server}") };
    let uri: tonic::codegen::http::Uri = url.parse().map_err(|_| invalid("does not parse"))?;
    if !matches!(uri.scheme_str(), Some("http") | Some("https")) {
        return Err(invalid("the scheme must be http or https"));
    }
    let authority = uri.authority().ok_or_else(|| invalid("no host"))?;
    if authority.host().is_empty() {
        return Err(invalid("no host"));
    }
    if authority.port_u16().is_none() {
        return Err(invalid("no port"));
    }
    if !matches!(uri.path(), "" | "/") || uri.query().is_some() || authority.as_str().contains('@') {
        return Err(invalid("only host and port"));
    }
    Ok(url)
}

/// The one place a client channel to a node is configured (timeouts,
/// heartbeats, TLS with --ca/--cert/--key for https addresses).
pub fn endpoint(server: &str, options: &ChannelOptions) -> Result<Endpoint, ClientError> {
    let url = server_url(server)?;
    let https = url.starts_with("https://");
    let mut endpoint = Endpoint::from_shared(url)
        .map_err(|e| ClientError::new(Kind::InvalidAddress, Some(server), e.to_string()))?
        .connect_timeout(options.connect_timeout)
        .tcp_nodelay(true);
    if https {
        let tls = crate::tls::ClientTls::current().ok_or_else(|| {
            ClientError::new(Kind::Usage, Some(server), "an https:// address needs --ca (or WALSHIP_CA)".to_string())
        })?;
        let config = tls.grpc().map_err(|e| ClientError::new(Kind::Usage, Some(server), format!("{e:#}")))?;
        endpoint = endpoint
            .tls_config(config)
            .map_err(|e| ClientError::new(Kind::Tls, Some(server), format!("TLS settings: {e}")))?;
    }
    if let Some(heartbeat) = options.heartbeat {
        let half = heartbeat / 2;
        endpoint = endpoint.http2_keep_alive_interval(half).keep_alive_timeout(half).keep_alive_while_idle(true);
    }
    Ok(endpoint)
}

/// Opens a channel to `server` and checks, within the connect timeout,
/// that it is a live walship node (its health service answers SERVING for
/// `walship.v1.Log`). Nothing is sent to the Log service before that, so
/// a server given up here certainly applied nothing.
pub async fn connect(server: &str, options: &ChannelOptions) -> Result<LogClient<Channel>, ClientError> {
    let endpoint = endpoint(server, options)?;
    let started = Instant::now();
    let bound = options.connect_timeout;
    let silent = || {
        ClientError::new(
            Kind::DeadlineExceeded,
            Some(server),
            format!(
                "no answer within {bound:?} (--connect-timeout): the process may be frozen or overloaded, or \
                 the port is not a walship node"
            ),
        )
    };
    let channel = match tokio::time::timeout(bound, endpoint.connect()).await {
        Err(_) => return Err(silent()),
        Ok(Err(e)) => return Err(connect_error(server, &e)),
        Ok(Ok(channel)) => channel,
    };
    let mut probe = tonic::Request::new(HealthCheckRequest { service: LOG_SERVICE.into() });
    let left = bound.saturating_sub(started.elapsed()).max(Duration::from_millis(50));
    probe.set_timeout(left);
    match tokio::time::timeout(left, HealthClient::new(channel.clone()).check(probe)).await {
        Err(_) => return Err(silent()),
        Ok(Err(status)) if status.code() == tonic::Code::NotFound => {
            return Err(ClientError::new(
                Kind::NotWalship,
                Some(server),
                "a gRPC server without the walship.v1.Log service".to_string(),
            ));
        }
        Ok(Err(status)) => {
            let error = status_error(server, &status);
            if error.kind == Kind::DeadlineExceeded {
                return Err(silent());
            }
            if !matches!(error.kind, Kind::Rejected | Kind::Other | Kind::NotWalship) {
                return Err(error);
            }
            return Err(ClientError::new(
                Kind::NotWalship,
                Some(server),
                format!(
                    "not a walship node's gRPC address (the HTTP admin port, say{}): its answer to the health \
                     probe was {:?}: {}",
                    crate::tls::plaintext_note(),
                    status.code(),
                    status.message()
                ),
            ));
        }
        Ok(Ok(answer)) if answer.get_ref().status() != ServingStatus::Serving => {
            return Err(ClientError::new(
                Kind::Unavailable,
                Some(server),
                format!("the node's Log service is {:?}", answer.get_ref().status()),
            ));
        }
        Ok(Ok(_)) => {}
    }
    Ok(LogClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES))
}

/// The leader's gRPC address from a not-leader refusal (`<id>@<addr>`).
fn leader_hint(status: &tonic::Status) -> Option<String> {
    if status.code() != tonic::Code::FailedPrecondition {
        return None;
    }
    walship_proto::leader_address(status).map(str::to_string)
}

/// Whether a failed append certainly was not applied: a not-leader
/// refusal, no leader assigned yet, a leadership change before the write,
/// or a connection that never opened.
fn not_applied(status: &tonic::Status) -> bool {
    let m = status.message();
    match status.code() {
        tonic::Code::FailedPrecondition => leader_hint(status).is_some(),
        tonic::Code::Unavailable => {
            !walship_proto::outcome_unknown(status)
                && (m.contains("no leader assigned")
                    || m.contains("it was not written")
                    || crate::client_error::chain_has::<tonic::ConnectError>(status))
        }
        _ => false,
    }
}

/// Picks servers in turn and remembers the one that answered.
struct Servers {
    list: Vec<String>,
    next: usize,
    options: ChannelOptions,
    current: Option<(String, LogClient<Channel>)>,
    /// Failures since a server last answered.
    failures: Vec<ClientError>,
}

impl Servers {
    fn new(list: Vec<String>, options: ChannelOptions) -> Servers {
        Servers { list, next: 0, options, current: None, failures: Vec::new() }
    }

    /// The current server's client, else a connection to `hint` or the
    /// next server in turn; a connection failure is recorded and returned.
    async fn client(
        &mut self,
        hint: Option<String>,
        remaining: Duration,
    ) -> Result<(String, LogClient<Channel>), ClientError> {
        if let Some(current) = &self.current {
            return Ok(current.clone());
        }
        let server = hint.unwrap_or_else(|| {
            let s = self.list[self.next % self.list.len()].clone();
            self.next += 1;
            s
        });
        let options = ChannelOptions { connect_timeout: self.options.connect_timeout.min(remaining), ..self.options };
        match connect(&server, &options).await {
            Ok(client) => {
                self.current = Some((server.clone(), client.clone()));
                Ok((server, client))
            }
            Err(e) => {
                self.failures.push(e.clone());
                Err(e)
            }
        }
    }

    /// Records a failure of the current server and drops it.
    fn failed(&mut self, error: ClientError) {
        self.current = None;
        self.failures.push(error);
    }

    /// Whether the last failures cover every server in a row: nobody
    /// answered usefully, so waiting longer would not help.
    fn all_failed(&self) -> bool {
        self.failures.len() >= self.list.len()
    }

    fn give_up(&self, what: &str) -> ClientError {
        ClientError::of_all(what, &self.failures[self.failures.len().saturating_sub(self.list.len().max(3))..])
    }
}

/// Refuses `request` before anything is sent when it encodes to more than
/// `limit` bytes: [`Kind::TooLarge`], naming its size, then what `limit`
/// says (the limit and what was not sent).
pub(crate) fn refuse_if_larger(
    request: &AppendRequest,
    limit: usize,
    explain: impl FnOnce() -> String,
) -> Result<(), ClientError> {
    let size = prost::Message::encoded_len(request);
    if size <= limit {
        return Ok(());
    }
    Err(ClientError::new(Kind::TooLarge, None, format!("the append request is {size} bytes; {}", explain())))
}

/// A client that finds the leader among `servers` and follows it through
/// failovers: requests that certainly were not applied are retried (on the
/// hinted leader, else the next server) until the deadline; one sent to a
/// live server that then gave no answer is [`Kind::OutcomeUnknown`].
struct LeaderClient {
    servers: Servers,
    request_timeout: Duration,
    deadline: Duration,
}

impl LeaderClient {
    async fn append(&mut self, request: AppendRequest) -> Result<walship_proto::log::AppendResponse, ClientError> {
        refuse_if_larger(&request, MAX_MESSAGE_BYTES, || {
            format!(
                "the client's limit is {MAX_MESSAGE_BYTES} bytes (a node's own max_batch_bytes is usually lower): use \
                 a smaller --batch; nothing was sent"
            )
        })?;
        let started = Instant::now();
        let mut hint = None;
        self.servers.failures.clear();
        // Servers of the list that could not be reached in a row.
        let mut unreachable = 0usize;
        // With a producer, an attempt whose outcome is unknown is retried
        // (the leader answers a retry of written records with their seqnos);
        // this is the last such attempt's error.
        let retry_unknown = request.producer.is_some();
        let mut unknown: Option<ClientError> = None;
        loop {
            let remaining = self.deadline.saturating_sub(started.elapsed());
            if remaining.is_zero() {
                if let Some(error) = unknown {
                    return Err(ClientError::new(
                        Kind::OutcomeUnknown,
                        error.server.as_deref(),
                        format!(
                            "an attempt reached a leader and got no answer, and no retry was answered within {:?} \
                             (--deadline); the append may or may not have been written: {}",
                            self.deadline, error.message
                        ),
                    ));
                }
                let last = self.servers.give_up("no leader accepted the append");
                return Err(ClientError::new(
                    Kind::DeadlineExceeded,
                    None,
                    format!(
                        "no leader accepted the append within {:?} (--deadline); it was not written: {last}",
                        self.deadline
                    ),
                ));
            }
            let hinted = hint.is_some() && self.servers.current.is_none();
            let (server, mut client) = match self.servers.client(hint.take(), remaining).await {
                Ok(c) => {
                    unreachable = 0;
                    c
                }
                // A hinted leader that cannot be reached (it died; the
                // failover is under way) does not count: the servers
                // that hinted it answered.
                Err(_) if hinted => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                Err(_) => {
                    unreachable += 1;
                    if unreachable >= self.servers.list.len() {
                        if unknown.is_some() {
                            // Sent before: keep trying until the deadline.
                            unreachable = 0;
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            continue;
                        }
                        return Err(self.servers.give_up("no server could be reached; the append was not sent"));
                    }
                    continue;
                }
            };
            let attempt = self.request_timeout.min(remaining).max(Duration::from_millis(100));
            let mut call = tonic::Request::new(request.clone());
            call.set_timeout(attempt);
            match tokio::time::timeout(attempt, client.append(call)).await {
                Err(_) => {
                    self.servers.current = None;
                    let error = ClientError::new(
                        Kind::OutcomeUnknown,
                        Some(&server),
                        format!(
                            "the append was sent and no answer came within {attempt:?} (--request-timeout); it may \
                             or may not have been written"
                        ),
                    );
                    if !retry_unknown {
                        return Err(error);
                    }
                    unknown = Some(error);
                }
                Ok(Ok(response)) => return Ok(response.into_inner()),
                Ok(Err(status)) if not_applied(&status) => {
                    hint = leader_hint(&status);
                    self.servers.failed(status_error(&server, &status));
                    if hint.is_none() {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
                Ok(Err(status)) => {
                    self.servers.current = None;
                    let error = status_error(&server, &status);
                    if walship_proto::outcome_unknown(&status)
                        || matches!(error.kind, Kind::Other | Kind::DeadlineExceeded)
                        || (error.kind == Kind::Unavailable && status.code() == tonic::Code::Unavailable)
                        || (error.kind == Kind::NotWalship && status.code() != tonic::Code::Unimplemented)
                    {
                        let error = ClientError::new(
                            Kind::OutcomeUnknown,
                            Some(&server),
                            format!("the append may or may not have been written: {}", error.message),
                        );
                        if !retry_unknown {
                            return Err(error);
                        }
                        unknown = Some(error);
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                    // A retry the shard no longer recognises (the producer
                    // was forgotten): whether the first attempt landed is
                    // unknown.
                    let forgotten = [walship_proto::REFUSAL_PRODUCER_UNKNOWN, walship_proto::REFUSAL_PRODUCER_SEQUENCE];
                    if let Some(first) = &unknown
                        && walship_proto::refusal(&status).is_some_and(|r| forgotten.contains(&r))
                    {
                        return Err(ClientError::new(
                            Kind::OutcomeUnknown,
                            Some(&server),
                            format!(
                                "an attempt got no answer ({}) and the retry was refused ({}); the append may or may \
                                 not have been written",
                                first.message, error.message
                            ),
                        ));
                    }
                    return Err(error);
                }
            }
        }
    }
}

/// The producer epoch of a run: `--producer-epoch`; with only
/// `--producer-id`, the Unix time in microseconds (each run of a stable id
/// takes over); 1 for a random id.
fn producer_epoch(args: &AppendArgs) -> u64 {
    args.producer_epoch.unwrap_or_else(|| match args.producer_id {
        Some(_) => SystemTime::now().duration_since(UNIX_EPOCH).map_or(1, |d| d.as_micros() as u64).max(1),
        None => 1,
    })
}

/// Runs a client command, attaching how its error should be printed.
async fn run<F>(json: bool, command: F) -> anyhow::Result<()>
where
    F: std::future::Future<Output = Result<(), ClientError>>,
{
    command.await.map_err(|error| anyhow::Error::new(Failed { error, json }))
}

pub async fn append(args: AppendArgs) -> anyhow::Result<()> {
    run(args.server.json, append_records(args)).await
}

async fn append_records(args: AppendArgs) -> Result<(), ClientError> {
    if args.batch == 0 {
        return Err(ClientError::usage("--batch must be at least 1"));
    }
    if args.in_flight == 0 {
        return Err(ClientError::usage("--in-flight must be at least 1"));
    }
    let mut groups = groups(&args);
    if !args.no_producer && args.expect_last.is_none() {
        let settings = crate::client_pipeline::Settings {
            servers: args.server.servers()?,
            options: args.server.options(),
            shard: args.server.shard,
            durability: Durability::from(args.durability),
            json: args.server.json,
            in_flight: args.in_flight,
            request_timeout: args.server.request_timeout,
            deadline: args.server.deadline,
            producer_id: args.producer_id,
            producer_epoch: Some(producer_epoch(&args)),
        };
        return crate::client_pipeline::append(settings, groups).await;
    }
    let options = args.server.options();
    let mut client = LeaderClient {
        servers: Servers::new(args.server.servers()?, options),
        request_timeout: args.server.request_timeout,
        deadline: args.server.deadline,
    };
    let shard = args.server.shard;
    let as_json = args.server.json;
    let mut producer = (!args.no_producer).then(|| Producer {
        id: args.producer_id.unwrap_or_else(|| rand::Rng::gen_range(&mut rand::thread_rng(), 1..=u64::MAX)),
        epoch: producer_epoch(&args),
        sequence: 1,
    });
    let mut expect_last = args.expect_last;
    let mut send = async |records: Vec<AppendRecord>| -> Result<(), ClientError> {
        let count = records.len();
        let request = AppendRequest {
            shard_id: shard,
            records,
            durability: Durability::from(args.durability) as i32,
            producer,
            expected_last_seqno: expect_last,
        };
        if let Some(p) = &mut producer {
            p.sequence += count as u64;
        }
        match client.append(request).await {
            Ok(r) => {
                if expect_last.is_some() {
                    expect_last = Some(r.last_seqno);
                }
                if as_json {
                    println!(
                        "{}",
                        json!({"shard": shard, "outcome": "acknowledged", "first_seqno": r.first_seqno, "last_seqno": r.last_seqno, "epoch": r.epoch, "duplicate": r.duplicate})
                    );
                } else if r.duplicate {
                    println!(
                        "appended shard {shard} seqnos {}..={} (already written by an earlier attempt of this \
                         producer; nothing written again)",
                        r.first_seqno, r.last_seqno
                    );
                } else {
                    println!("appended shard {shard} seqnos {}..={} (epoch {})", r.first_seqno, r.last_seqno, r.epoch);
                }
                Ok(())
            }
            Err(error) => {
                if as_json && error.kind == Kind::OutcomeUnknown {
                    println!(
                        "{}",
                        json!({"shard": shard, "outcome": "unknown", "records": count, "detail": error.to_string()})
                    );
                }
                Err(error)
            }
        }
    };
    while let Some(group) = groups.recv().await {
        send(group?).await?;
    }
    Ok(())
}

/// The records to append in groups of `--batch`: stdin's lines, or
/// `--count` generated ones. Read on a thread of their own, a couple of
/// groups ahead of the appends, so a pipelined run sends while it reads; a
/// run that ends early leaves the thread blocked on stdin, which the
/// process's exit ends.
fn groups(args: &AppendArgs) -> tokio::sync::mpsc::Receiver<Result<Vec<AppendRecord>, ClientError>> {
    let (tx, rx) = tokio::sync::mpsc::channel(2);
    let (batch, count, size) = (args.batch, args.count, args.size.unwrap_or(100));
    let key = args.key.as_ref().map(|k| Bytes::from(k.clone()));
    std::thread::spawn(move || {
        let mut pending = Vec::with_capacity(batch.min(100_000));
        // Whether the appends still want records.
        let mut push = |record: AppendRecord| -> bool {
            pending.push(record);
            pending.len() < batch || tx.blocking_send(Ok(std::mem::take(&mut pending))).is_ok()
        };
        let wanted = match count {
            Some(count) => (0..count).all(|i| {
                let mut payload = vec![0u8; size];
                rand::Rng::fill(&mut rand::thread_rng(), &mut payload[..]);
                let key = key.clone().unwrap_or_else(|| Bytes::from(i.to_string()));
                push(AppendRecord { key, payload: Bytes::from(payload) })
            }),
            None => std::io::stdin().lock().lines().all(|line| match line {
                Ok(line) => push(AppendRecord { key: key.clone().unwrap_or_default(), payload: Bytes::from(line) }),
                Err(e) => {
                    let _ = tx.blocking_send(Err(ClientError::new(Kind::Other, None, format!("reading stdin: {e}"))));
                    false
                }
            }),
        };
        if wanted && !pending.is_empty() {
            let _ = tx.blocking_send(Ok(pending));
        }
    });
    rx
}

#[path = "client_read.rs"]
mod read;
pub use read::{ReadArgs, TailArgs, read, tail};
