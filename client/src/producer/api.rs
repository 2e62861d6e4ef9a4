//! What a producer's caller sees: its settings, the connector it is given,
//! and each record's acknowledgement or error.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::oneshot;
use tonic::Status;
use tonic::transport::Channel;
use walship_proto::log::Durability;
use walship_proto::log::log_client::LogClient;

/// Why a node could not be reached, as the caller's connector says it.
pub type ConnectError = Arc<dyn std::error::Error + Send + Sync>;

/// Opens a client to a node's gRPC address (the caller's TLS, timeouts and
/// health checks).
pub type Connect = Arc<dyn Fn(String) -> BoxFuture<'static, Result<LogClient<Channel>, ConnectError>> + Send + Sync>;

/// How a [`Producer`](super::Producer) batches, pipelines and retries.
#[derive(Debug, Clone)]
pub struct ProducerConfig {
    pub durability: Durability,
    /// How long a batch waits for more records while earlier batches of
    /// its shard are in flight and a pipeline slot is free. With every slot
    /// busy it waits for one, whatever its linger, and keeps taking records.
    pub linger: Duration,
    /// A batch is sent once it holds this many records ...
    pub batch_records: usize,
    /// ... or this many key + payload bytes.
    pub batch_bytes: usize,
    /// `send` waits while this many key + payload bytes are queued and not
    /// yet acknowledged (every shard together).
    pub buffer_bytes: usize,
    /// Batches of one shard in flight at once.
    pub in_flight: usize,
    /// A batch not acknowledged this long after it was first sent fails as
    /// outcome unknown (one never sent, as not written).
    pub deadline: Duration,
    /// One attempt's wait for its answer; past it the attempt's outcome is
    /// unknown and the batch is sent again.
    pub request_timeout: Duration,
    /// The producer id (non-zero); random when `None`.
    pub id: Option<u64>,
    /// The producer epoch (non-zero); 1 when `None`.
    pub epoch: Option<u64>,
    /// A batch whose request would be larger than this is refused before it
    /// is sent (`INVALID_ARGUMENT`): the node would refuse it anyway, and a
    /// message past the transport's limit breaks the whole stream.
    pub max_request_bytes: usize,
}

impl Default for ProducerConfig {
    fn default() -> Self {
        ProducerConfig {
            durability: Durability::Quorum,
            linger: Duration::from_millis(1),
            batch_records: 1_000,
            batch_bytes: 1 << 20,
            buffer_bytes: 64 << 20,
            in_flight: 8,
            deadline: Duration::from_secs(30),
            request_timeout: Duration::from_secs(5),
            id: None,
            epoch: None,
            max_request_bytes: 32 << 20,
        }
    }
}

/// Where an acknowledged record was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Acked {
    pub shard: u32,
    /// Its seqno; 0 in the rare case of a batch a failover cut in two (its
    /// first part was written by a leader that then died, the rest by the
    /// next), or of an answer whose seqno range does not hold exactly the
    /// batch's records: the batch's records are written, in order, but
    /// this one's seqno is not known.
    pub seqno: u64,
    /// The epoch of the leader that acknowledged it.
    pub epoch: u64,
    /// An earlier attempt had written it (its answer was lost); nothing was
    /// written again.
    pub duplicate: bool,
}

/// Why a record was not acknowledged.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ProduceError {
    /// The server refused the record's batch; nothing was written.
    #[error("refused: {}: {}", .0.code(), .0.message())]
    Refused(Status),
    /// No answer within the deadline: it may or may not be written.
    /// `server` is the node last sent it, when known.
    #[error("outcome unknown: {detail}")]
    OutcomeUnknown { server: Option<String>, detail: String },
    /// Not written: no leader took it within the deadline (every attempt
    /// was certainly not applied).
    #[error("not written: {0}")]
    NotWritten(String),
    /// Never sent: no server could be reached (every one failed in a row,
    /// and no attempt may have been applied); the last failure.
    #[error("no server could be reached; not written: {0}")]
    Unreachable(ConnectError),
    /// Written, but the shard no longer remembers where (a retry older than
    /// the producer's last five batches).
    #[error("written, seqno unknown: {0}")]
    WrittenSeqnoUnknown(String),
    /// The producer was shut down, or a newer epoch of it took over.
    #[error("the producer is closed: {0}")]
    Closed(String),
}

/// Resolves once the record is acknowledged or has failed.
pub struct RecordAck(pub(super) oneshot::Receiver<Result<Acked, ProduceError>>);

impl Future for RecordAck {
    type Output = Result<Acked, ProduceError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.0)
            .poll(cx)
            .map(|r| r.unwrap_or_else(|_| Err(ProduceError::Closed("the shard's task stopped".into()))))
    }
}
