//! `read` and `tail`: a shard's records from any replica, paged or
//! streamed, moving on to the next server when one fails (a tail resumes
//! from the next seqno).

use base64::Engine as _;
use walship_proto::log::{ReadRequest, Record, TailRequest};

use super::*;

/// Where a read starts.
#[derive(Debug, Clone, Copy)]
enum Start {
    Oldest,
    Seqno(u64),
}

fn from_arg(text: &str) -> Result<Start, String> {
    if text == "oldest" {
        return Ok(Start::Oldest);
    }
    match text.parse::<u64>() {
        Ok(0) => Err("seqnos start at 1".into()),
        Ok(n) => Ok(Start::Seqno(n)),
        Err(_) => Err(format!("{text:?} is neither a seqno nor \"oldest\"")),
    }
}

fn at_least_one(text: &str) -> Result<u64, String> {
    match text.parse::<u64>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

#[derive(Args, Debug)]
#[command(after_help = EXIT_CODES)]
pub struct ReadArgs {
    #[command(flatten)]
    server: ServerArgs,
    /// First seqno to read, or `oldest` (the oldest retained record).
    #[arg(long, default_value = "oldest", value_parser = from_arg, conflicts_with = "last")]
    from: Start,
    /// Last seqno to read (inclusive); past the newest committed record the
    /// read ends there. Default: the newest committed record when the read
    /// starts.
    #[arg(long, conflicts_with = "last")]
    to: Option<u64>,
    /// Read the newest N committed records.
    #[arg(long, value_parser = at_least_one)]
    last: Option<u64>,
    /// Print at most N records (after --key filtering).
    #[arg(long, value_parser = at_least_one)]
    limit: Option<u64>,
    /// Print only records with this key. Filtered by the client: the node
    /// still sends every record in range.
    #[arg(long)]
    key: Option<String>,
    /// Read-your-writes: the seqno of your own last append (`append` prints
    /// it as the end of `seqnos A..=B`, or `last_seqno` with --json). A
    /// replica that has not committed it yet waits (up to
    /// --request-timeout) before serving; others are tried next.
    #[arg(long, value_name = "SEQNO")]
    after_write: Option<u64>,
}

#[derive(Args, Debug)]
#[command(after_help = EXIT_CODES)]
pub struct TailArgs {
    #[command(flatten)]
    server: ServerArgs,
    /// First seqno to stream.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    from: u64,
    /// Liveness bound on the stream: the client sends HTTP/2 heartbeats
    /// (PINGs) and gives a server up when it answers nothing for this long,
    /// then resumes on another replica from the next seqno. A healthy but
    /// quiet stream runs forever.
    #[arg(long, env = "WALSHIP_IDLE_TIMEOUT", default_value = "5s", value_parser = duration)]
    idle_timeout: Duration,
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

/// Whether a read failed only because nothing is committed at `from` yet.
fn nothing_yet(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::OutOfRange && status.message().contains("nothing at seqno")
}

/// One read call on any replica, moving on to the next when one fails,
/// within `deadline_at`. `Ok(None)`: nothing is committed in range yet.
async fn read_page(
    servers: &mut Servers,
    request: &ReadRequest,
    request_timeout: Duration,
    deadline_at: Instant,
) -> Result<Option<walship_proto::log::ReadResponse>, ClientError> {
    servers.failures.clear();
    loop {
        let remaining = deadline_at.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            let last = servers.give_up("no replica served the read");
            return Err(ClientError::new(
                if last.kind == Kind::Unavailable { Kind::Unavailable } else { Kind::DeadlineExceeded },
                None,
                format!("no replica served the read within the --deadline: {last}"),
            ));
        }
        let (server, mut client) = match servers.client(None, remaining).await {
            Ok(c) => c,
            Err(_) if servers.all_failed() => return Err(servers.give_up("no replica served the read")),
            Err(_) => continue,
        };
        let attempt = request_timeout.min(remaining).max(Duration::from_millis(100));
        let mut call = tonic::Request::new(*request);
        call.set_timeout(attempt);
        let error = match tokio::time::timeout(attempt, client.read(call)).await {
            Ok(Ok(response)) => return Ok(Some(response.into_inner())),
            Ok(Err(status)) if nothing_yet(&status) => return Ok(None),
            Ok(Err(status)) => status_error(&server, &status),
            Err(_) => ClientError::new(
                Kind::DeadlineExceeded,
                Some(&server),
                format!("no answer to the read within {attempt:?} (--request-timeout)"),
            ),
        };
        if !error.kind.try_elsewhere() {
            return Err(error);
        }
        servers.failed(error);
        if servers.all_failed() {
            return Err(servers.give_up("no replica served the read"));
        }
    }
}

pub async fn read(args: ReadArgs) -> anyhow::Result<()> {
    run(args.server.json, read_records(args)).await
}

async fn read_records(args: ReadArgs) -> Result<(), ClientError> {
    if let (Start::Seqno(from), Some(to)) = (args.from, args.to)
        && to < from
    {
        return Err(ClientError::usage(format!("--to {to} is before --from {from}")));
    }
    let mut servers = Servers::new(args.server.servers()?, args.server.options());
    let deadline_at = Instant::now() + args.server.deadline;
    let shard = args.server.shard;
    let key = args.key.as_ref().map(|k| k.as_bytes());
    let mut printed = 0u64;
    // The next seqno to ask for (None: the first request picks the start)
    // and the end of the range, pinned by the first answer.
    let mut next = match args.from {
        Start::Seqno(s) if args.last.is_none() => Some(s),
        _ => None,
    };
    let mut end: Option<u64> = None;
    loop {
        let request = ReadRequest {
            shard_id: shard,
            from_seqno: next.unwrap_or(0),
            to_seqno: end.unwrap_or(0),
            max_bytes: 0,
            // After the first page, a replica taken over mid-read waits
            // until it has committed the pinned end.
            min_seqno: args.after_write.unwrap_or(0).max(end.unwrap_or(0)),
            last: if next.is_none() { args.last.unwrap_or(u64::MAX) } else { 0 },
        };
        let Some(response) = read_page(&mut servers, &request, args.server.request_timeout, deadline_at).await? else {
            return Ok(());
        };
        let to = *end.get_or_insert(args.to.map_or(response.durable_seqno, |t| t.min(response.durable_seqno)));
        for record in &response.records {
            if record.seqno > to {
                return Ok(());
            }
            if key.is_some_and(|k| k != &record.key[..]) {
                continue;
            }
            print_record(shard, record, args.server.json);
            printed += 1;
            if args.limit.is_some_and(|l| printed >= l) {
                return Ok(());
            }
        }
        if response.next_seqno > to || response.records.is_empty() {
            return Ok(());
        }
        next = Some(response.next_seqno);
    }
}

pub async fn tail(args: TailArgs) -> anyhow::Result<()> {
    run(args.server.json, tail_records(args)).await
}

async fn tail_records(args: TailArgs) -> Result<(), ClientError> {
    let options = ChannelOptions { heartbeat: Some(args.idle_timeout), ..args.server.options() };
    let mut servers = Servers::new(args.server.servers()?, options);
    let shard = args.server.shard;
    let mut next = args.from;
    // Whether a stream was ever opened: before that, servers that all fail
    // end the command at once; after, the tail keeps looking for a replica
    // to resume on until --deadline.
    let mut streamed = false;
    let mut since = Instant::now();
    loop {
        let remaining = args.server.deadline.saturating_sub(since.elapsed());
        if remaining.is_zero() {
            let last = servers.give_up("no replica resumed the tail");
            return Err(ClientError::new(
                if last.kind.try_elsewhere() { Kind::DeadlineExceeded } else { last.kind },
                None,
                format!(
                    "no replica resumed the tail at seqno {next} within {:?} (--deadline): {last}",
                    args.server.deadline
                ),
            ));
        }
        let (server, mut client) = match servers.client(None, remaining).await {
            Ok(c) => c,
            Err(_) => {
                if !streamed && servers.all_failed() {
                    return Err(servers.give_up("no replica could be reached"));
                }
                if servers.failures.len().is_multiple_of(servers.list.len()) {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                continue;
            }
        };
        let attempt = args.server.request_timeout.min(remaining).max(Duration::from_millis(100));
        let opened =
            tokio::time::timeout(attempt, client.tail(TailRequest { shard_id: shard, from_seqno: next })).await;
        let mut stream = match opened {
            Ok(Ok(response)) => response.into_inner(),
            Ok(Err(status)) => {
                let error = status_error(&server, &status);
                let behind = status.code() == tonic::Code::OutOfRange && status.message().contains("cannot tail from");
                if !streamed && !error.kind.try_elsewhere() && !behind {
                    return Err(error);
                }
                servers.failed(error);
                if servers.failures.len().is_multiple_of(servers.list.len()) {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                continue;
            }
            Err(_) => {
                servers.failed(ClientError::new(
                    Kind::DeadlineExceeded,
                    Some(&server),
                    format!("the tail did not start within {attempt:?} (--request-timeout)"),
                ));
                continue;
            }
        };
        streamed = true;
        servers.failures.clear();
        let (opened_at, first_of_stream) = (Instant::now(), next);
        let ended = 'stream: loop {
            match stream.message().await {
                Ok(Some(response)) => {
                    for record in &response.records {
                        // A replica only streams committed records, which
                        // every replica holds alike; resuming from `next`
                        // neither skips nor repeats one.
                        if record.seqno > next {
                            break 'stream ClientError::new(
                                Kind::Other,
                                Some(&server),
                                format!("the stream skipped from seqno {next} to {}", record.seqno),
                            );
                        }
                        if record.seqno == next {
                            print_record(shard, record, args.server.json);
                            next += 1;
                        }
                    }
                }
                Ok(None) => {
                    break ClientError::new(Kind::Unavailable, Some(&server), "the node ended the tail stream");
                }
                Err(status) => break status_error(&server, &status),
            }
        };
        // Resume elsewhere: this server is dead, frozen or stopping. The
        // deadline starts over only after a stream that did some good, so
        // replicas that fail every stream at once do not loop forever.
        servers.failed(ended);
        if next > first_of_stream || opened_at.elapsed() >= args.idle_timeout {
            since = Instant::now();
        }
    }
}
