//! What went wrong in a client command (`append`, `read`, `tail`), named for
//! what it is, with one exit code per kind and a JSON form for `--json`.

use serde_json::json;

/// The exit codes of `append`, `read` and `tail`, for their `--help`.
pub const EXIT_CODES: &str = "\
Exit codes:
  0   success
  1   any other error (a server fault such as DATA_LOSS, an unreadable client config or stdin)
  2   bad command line (clap's usage errors; also bad flag values)
  3   outcome unknown: an append reached a leader and got no answer; it may or may not be written
  4   invalid server address (not host:port)
  5   DNS failure: the host name does not resolve
  6   connection refused or host unreachable
  7   not a walship server (e.g. the HTTP admin port, another gRPC or TCP service)
  8   deadline exceeded: no answer within --connect-timeout / --request-timeout / --deadline,
      or a tailed node stopped answering heartbeats (--idle-timeout) and no replica took over
  9   too large: the request exceeds a size limit (the message names it)
  10  rejected: the server refused the request (unknown shard, range, bad argument); nothing changed
  11  unavailable: reachable but not serving it now (no leader, read-your-writes seqno not reached)
  12  TLS: the handshake failed (no or a refused client certificate, a server not signed by --ca,
      or a TLS port spoken to without --ca)
  13  conflict: an append's --expect-last did not match the shard's newest seqno (the message
      names it), or its producer was fenced by a newer epoch; nothing was written
With several --server addresses the exit code is that of the last failure; the message names each.
With --json an error is also printed as one JSON object on stderr:
  {\"error\": {\"kind\": \"connection_refused\", \"message\": \"...\", \"server\": \"127.0.0.1:7401\", \"exit_code\": 6}}";

/// What kind of failure a client command met.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Other,
    Usage,
    OutcomeUnknown,
    InvalidAddress,
    DnsFailure,
    ConnectionRefused,
    Unreachable,
    NotWalship,
    DeadlineExceeded,
    TooLarge,
    Rejected,
    Unavailable,
    Tls,
    Conflict,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Other => "error",
            Kind::Usage => "usage",
            Kind::OutcomeUnknown => "outcome_unknown",
            Kind::InvalidAddress => "invalid_address",
            Kind::DnsFailure => "dns_failure",
            Kind::ConnectionRefused => "connection_refused",
            Kind::Unreachable => "unreachable",
            Kind::NotWalship => "not_walship",
            Kind::DeadlineExceeded => "deadline_exceeded",
            Kind::TooLarge => "too_large",
            Kind::Rejected => "rejected",
            Kind::Unavailable => "unavailable",
            Kind::Tls => "tls",
            Kind::Conflict => "conflict",
        }
    }

    /// What a person reads before the message.
    fn text(self) -> &'static str {
        match self {
            Kind::Other => "error",
            Kind::Usage => "usage",
            Kind::OutcomeUnknown => "outcome unknown",
            Kind::InvalidAddress => "invalid address",
            Kind::DnsFailure => "DNS failure",
            Kind::ConnectionRefused => "connection refused",
            Kind::Unreachable => "unreachable",
            Kind::NotWalship => "not a walship server",
            Kind::DeadlineExceeded => "deadline exceeded",
            Kind::TooLarge => "too large",
            Kind::Rejected => "rejected",
            Kind::Unavailable => "unavailable",
            Kind::Tls => "TLS",
            Kind::Conflict => "conflict",
        }
    }

    pub fn exit_code(self) -> u8 {
        match self {
            Kind::Other => 1,
            Kind::Usage => 2,
            Kind::OutcomeUnknown => 3,
            Kind::InvalidAddress => 4,
            Kind::DnsFailure => 5,
            Kind::ConnectionRefused | Kind::Unreachable => 6,
            Kind::NotWalship => 7,
            Kind::DeadlineExceeded => 8,
            Kind::TooLarge => 9,
            Kind::Rejected => 10,
            Kind::Unavailable => 11,
            Kind::Tls => 12,
            Kind::Conflict => 13,
        }
    }

    /// Whether another server may do better: the server could not be
    /// reached, did not answer in time, or cannot serve right now.
    pub fn try_elsewhere(self) -> bool {
        matches!(
            self,
            Kind::InvalidAddress
                | Kind::DnsFailure
                | Kind::ConnectionRefused
                | Kind::Unreachable
                | Kind::NotWalship
                | Kind::DeadlineExceeded
                | Kind::Unavailable
                | Kind::Tls
        )
    }
}

/// A client command's failure.
#[derive(Debug, Clone)]
pub struct ClientError {
    pub kind: Kind,
    pub message: String,
    /// The server it concerns, when one.
    pub server: Option<String>,
}

impl ClientError {
    pub fn new(kind: Kind, server: Option<&str>, message: impl Into<String>) -> ClientError {
        ClientError { kind, message: message.into(), server: server.map(str::to_string) }
    }

    pub fn usage(message: impl Into<String>) -> ClientError {
        ClientError::new(Kind::Usage, None, message)
    }

    /// The error as one JSON object, for `--json`.
    pub fn to_json(&self) -> serde_json::Value {
        json!({"error": {
            "kind": self.kind.name(),
            "message": self.to_string(),
            "server": self.server,
            "exit_code": self.kind.exit_code(),
        }})
    }

    /// Prints the error on stderr (as JSON with `json`) and gives the exit code.
    pub fn report(&self, json: bool) -> u8 {
        if json {
            eprintln!("{}", self.to_json());
        } else {
            eprintln!("error: {}: {self}", self.kind.text());
        }
        self.kind.exit_code()
    }

    /// Several servers' failures as one: the last one's kind, every message.
    pub fn of_all(what: &str, failures: &[ClientError]) -> ClientError {
        match failures {
            [] => ClientError::new(Kind::Other, None, what.to_string()),
            [one] => one.clone(),
            [.., last] => {
                let each: Vec<String> = failures.iter().map(|f| format!("[{}] {f}", f.kind.text())).collect();
                ClientError::new(last.kind, last.server.as_deref(), format!("{what}: {}", each.join("; ")))
            }
        }
    }
}

impl std::fmt::Display for ClientError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.server {
            // An aggregate already names its servers.
            Some(server) if !self.message.contains(server.as_str()) => write!(f, "{server}: {}", self.message),
            _ => write!(f, "{}", self.message),
        }
    }
}

impl std::error::Error for ClientError {}

/// A failed client command and how it wants its error printed.
#[derive(Debug)]
pub struct Failed {
    pub error: ClientError,
    pub json: bool,
}

impl std::fmt::Display for Failed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for Failed {}

/// Every message in an error's source chain, joined.
fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut parts = vec![error.to_string()];
    let mut source = error.source();
    while let Some(e) = source {
        let text = e.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        source = e.source();
    }
    parts.join(": ")
}

/// The first `io::Error` in an error's source chain.
fn io_error<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a std::io::Error> {
    let mut current = Some(error);
    while let Some(e) = current {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return Some(io);
        }
        current = e.source();
    }
    None
}

/// Whether an error's source chain holds a `T`.
pub fn chain_has<T: std::error::Error + 'static>(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut current = Some(error);
    while let Some(e) = current {
        if e.is::<T>() {
            return true;
        }
        current = e.source();
    }
    false
}

/// A failure to open a connection to `server`.
pub fn connect_error(server: &str, error: &(dyn std::error::Error + 'static)) -> ClientError {
    let text = chain(error);
    if let Some(hint) = crate::tls::hint(&text) {
        return ClientError::new(Kind::Tls, Some(server), format!("{hint} ({text})"));
    }
    let lower = text.to_lowercase();
    let kind = if lower.contains("dns error") || lower.contains("failed to lookup address") {
        Kind::DnsFailure
    } else if let Some(io) = io_error(error) {
        match io.kind() {
            std::io::ErrorKind::ConnectionRefused => Kind::ConnectionRefused,
            std::io::ErrorKind::TimedOut => Kind::DeadlineExceeded,
            _ => Kind::Unreachable,
        }
    } else if lower.contains("timed out") || lower.contains("timeout") {
        Kind::DeadlineExceeded
    } else if lower.contains("h2 protocol") || lower.contains("http2") || lower.contains("frame") {
        Kind::NotWalship
    } else {
        Kind::Unreachable
    };
    let message = match kind {
        Kind::DnsFailure => format!("the host name does not resolve ({text})"),
        Kind::ConnectionRefused => format!("connection refused; is a walship node listening there? ({text})"),
        Kind::NotWalship => {
            format!("the server does not speak gRPC over HTTP/2{} ({text})", crate::tls::plaintext_note())
        }
        _ => format!("cannot connect ({text})"),
    };
    ClientError::new(kind, Some(server), message)
}

/// Whether a status says the answer was not a gRPC answer at all: an HTTP
/// server, or something that does not speak HTTP/2.
fn not_grpc(status: &tonic::Status) -> bool {
    let message = status.message().to_lowercase();
    let text = chain(status).to_lowercase();
    status.code() == tonic::Code::Unimplemented
        || message.contains("invalid content-type")
        || message.contains("grpc-status header missing")
        || (matches!(status.code(), tonic::Code::Unknown | tonic::Code::Internal | tonic::Code::Unavailable)
            && (text.contains("h2 protocol error")
                || text.contains("http2 error")
                || text.contains("frame with invalid size")))
}

/// A status from `server` (after it answered the walship probe, or while
/// probing), named for what it is.
pub fn status_error(server: &str, status: &tonic::Status) -> ClientError {
    if chain_has::<tonic::ConnectError>(status) {
        return connect_error(server, status);
    }
    if let Some(hint) = crate::tls::hint(&chain(status)) {
        return ClientError::new(
            Kind::Tls,
            Some(server),
            format!("{hint} ({:?}: {})", status.code(), status.message()),
        );
    }
    let detail = format!("{:?}: {}", status.code(), status.message());
    let lower = status.message().to_lowercase();
    let conflict = [walship_proto::REFUSAL_EXPECTED_LAST, walship_proto::REFUSAL_PRODUCER_FENCED];
    let kind = if walship_proto::refusal(status).is_some_and(|r| conflict.contains(&r)) {
        Kind::Conflict
    } else if lower.contains("message length too large") || lower.contains("the limit is") {
        Kind::TooLarge
    } else if not_grpc(status) {
        Kind::NotWalship
    } else {
        match status.code() {
            tonic::Code::InvalidArgument
            | tonic::Code::NotFound
            | tonic::Code::OutOfRange
            | tonic::Code::FailedPrecondition
            | tonic::Code::AlreadyExists
            | tonic::Code::PermissionDenied
            | tonic::Code::Unauthenticated => Kind::Rejected,
            tonic::Code::DeadlineExceeded => Kind::DeadlineExceeded,
            tonic::Code::Cancelled if lower.contains("timeout") => Kind::DeadlineExceeded,
            tonic::Code::Unavailable | tonic::Code::ResourceExhausted | tonic::Code::Aborted => Kind::Unavailable,
            _ => Kind::Other,
        }
    };
    let message = match kind {
        Kind::NotWalship => {
            format!("answered, but not as a walship node's gRPC Log service{} ({detail})", crate::tls::plaintext_note())
        }
        Kind::DeadlineExceeded => format!("no answer within the call's deadline (--request-timeout) ({detail})"),
        _ if status.code() == tonic::Code::Unknown || status.code() == tonic::Code::Internal => {
            format!("{detail} ({})", chain(status))
        }
        _ => detail,
    };
    ClientError::new(kind, Some(server), message)
}
