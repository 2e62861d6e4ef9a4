//! The `walship.v1.Log` service: append, read and tail a shard's log.
//!
//! Every request is validated completely before anything is queued, so a
//! refused request changes nothing. Each refusal maps to one gRPC status:
//!
//! | condition | status |
//! | --- | --- |
//! | shard not hosted by this node | `NOT_FOUND` |
//! | append to a follower (metadata `walship-leader: <id>@<addr>` names the leader) | `FAILED_PRECONDITION` |
//! | empty batch, record over the size limit, too many records, unknown durability, seqno 0, `to < from` | `INVALID_ARGUMENT` |
//! | `last` with a non-zero `from_seqno` | `INVALID_ARGUMENT` |
//! | range before the oldest retained or past the newest committed record | `OUT_OF_RANGE` |
//! | a read's `min_seqno` not committed here before the call's deadline (names the seqno committed) | `UNAVAILABLE` |
//! | WAL writer stopped | `UNAVAILABLE` (retryable) |
//! | producer id, epoch or sequence 0, or sequences past 2^64-1 | `INVALID_ARGUMENT` |
//! | producer epoch older than the shard has seen (`walship-refusal: producer-fenced`) | `FAILED_PRECONDITION` |
//! | producer unknown to the shard and not starting at sequence 1 (`producer-unknown`) | `FAILED_PRECONDITION` |
//! | producer sequence leaving a gap (`producer-sequence`) | `OUT_OF_RANGE` |
//! | retry of producer records older than its last five runs | `ALREADY_EXISTS` |
//! | `expected_last_seqno` not the shard's newest (`expected-last`, `walship-last-seqno: N`) | `FAILED_PRECONDITION` |
//! | producer table under repair on this replica | `UNAVAILABLE` (retryable; nothing written) |
//! | a record in range is corrupt in this replica's copy (names shard, seqnos, file) | `DATA_LOSS` |
//!
//! Appends are acknowledged at the durability asked for: `LOCAL` once the
//! leader has fsynced, `QUORUM` (the default) once a majority of the replica
//! set has, `ALL` once every replica has. Reads and tails, on any replica,
//! only return committed records (durable on a majority), so nothing a read
//! returned can be lost in a failover. A read carrying `min_seqno` (the
//! caller's own last write) waits, within its deadline, until this replica
//! has committed it: read-your-writes on a follower.

use std::pin::Pin;
use std::time::{Duration, Instant};

use std::collections::HashSet;

use futures::stream::FuturesUnordered;
use futures::{Stream, StreamExt};
use prometheus::{Histogram, HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use walship_proto::log::append_stream_response;
use walship_proto::log::log_server::Log;
use walship_proto::log::{
    AppendRecord, AppendRequest, AppendResponse, AppendStreamRequest, AppendStreamResponse, Durability, ReadRequest,
    ReadResponse, Record, TailRequest, TailResponse,
};

use walship_wal::{
    AppendOptions, Frame, NewRecord, ProducerRefusal, ProducerStamp, ShardId, StoreError, Wal, WalError,
};

use crate::read_memory::{HeldByAnswer, ReadMemory};
use crate::replica::{ReplicationNode, Role, ShardReplica};

mod read;
pub use self::read::MAX_READ_WAIT;
use self::read::{call_deadline, tail_stream};

/// Request limits a node enforces on its clients.
#[derive(Debug, Clone, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogLimits {
    /// Largest key + payload of one record.
    pub max_record_bytes: usize,
    /// Most records in one append.
    pub max_batch_records: usize,
    /// Largest total key + payload of one append.
    pub max_batch_bytes: usize,
    /// Read response size when the client asks for 0 (the default).
    pub default_read_bytes: usize,
    /// Upper bound on a read response's size, whatever the client asks.
    pub max_read_bytes: usize,
    /// Bytes of read answers (`Read`, `Tail` batches) the node holds at
    /// once, built or waiting for their callers to take them
    /// ([`crate::read_memory`]).
    pub read_memory_bytes: usize,
}

impl Default for LogLimits {
    fn default() -> Self {
        LogLimits {
            max_record_bytes: 1 << 20,
            max_batch_records: 100_000,
            max_batch_bytes: 32 << 20,
            default_read_bytes: 4 << 20,
            max_read_bytes: 32 << 20,
            read_memory_bytes: 256 << 20,
        }
    }
}

/// Metrics of the client API.
#[derive(Clone)]
pub struct LogServiceMetrics {
    /// Append latency, request received to acknowledged, by durability.
    append_seconds: HistogramVec,
    /// Records per append request.
    append_batch_records: Histogram,
    /// Refused requests by RPC and gRPC status code.
    rejected: IntCounterVec,
    /// Bytes held in the read memory budget.
    read_memory_held: prometheus::IntGauge,
}

impl LogServiceMetrics {
    pub fn new(registry: &Registry) -> prometheus::Result<LogServiceMetrics> {
        let append_seconds = HistogramVec::new(
            HistogramOpts::new(
                "walship_append_seconds",
                "Append latency on the node, request received to acknowledged",
            )
            .buckets(prometheus::exponential_buckets(25e-6, 2.0, 20)?),
            &["durability"],
        )?;
        let append_batch_records = Histogram::with_opts(
            HistogramOpts::new("walship_append_batch_records", "Records carried by one append request")
                .buckets(prometheus::exponential_buckets(1.0, 4.0, 10)?),
        )?;
        let rejected = IntCounterVec::new(
            Opts::new("walship_requests_rejected_total", "Client requests refused, by RPC and gRPC status code"),
            &["rpc", "code"],
        )?;
        registry.register(Box::new(append_seconds.clone()))?;
        registry.register(Box::new(append_batch_records.clone()))?;
        registry.register(Box::new(rejected.clone()))?;
        crate::metrics::UndecodableMessages::register(registry)?;
        let read_memory_held = ReadMemory::gauge(registry)?;
        Ok(LogServiceMetrics { append_seconds, append_batch_records, rejected, read_memory_held })
    }
}

/// The Log service of one node.
#[derive(Clone)]
pub struct LogService {
    node: Arc<ReplicationNode>,
    wal: Wal,
    limits: LogLimits,
    metrics: LogServiceMetrics,
    read_memory: ReadMemory,
}

fn wal_status(error: WalError) -> Status {
    match error {
        WalError::Store(StoreError::UnknownShard(shard)) => {
            Status::not_found(format!("shard {shard} is not hosted by this node"))
        }
        WalError::Store(e @ StoreError::OutOfRange { .. }) => Status::out_of_range(e.to_string()),
        WalError::Store(e @ StoreError::EmptyAppend { .. }) => Status::invalid_argument(e.to_string()),
        WalError::Store(e @ (StoreError::NotContinuous { .. } | StoreError::NotContiguous { .. })) => {
            Status::failed_precondition(e.to_string())
        }
        WalError::Store(e @ StoreError::BadPosition { .. }) => Status::failed_precondition(e.to_string()),
        // Damage in this replica's copy: never served. A follower repairs
        // it from its leader by itself; a leader hands over to an intact
        // replica when one holds everything acknowledged. Other replicas
        // may serve the range meanwhile.
        WalError::Store(e @ StoreError::Corrupt { .. }) => Status::data_loss(format!(
            "{e}; this replica does not serve them (another replica may hold intact copies; see /v1/status)"
        )),
        WalError::Store(e @ StoreError::Io(_)) => Status::internal(e.to_string()),
        WalError::Closed => Status::unavailable("the WAL writer has stopped"),
        // Nothing was written: the client may retry elsewhere (after a
        // failover) or later.
        e @ WalError::DiskFull(_) => Status::resource_exhausted(e.to_string()),
        WalError::StaleEpoch { shard, epoch, promised } => Status::unavailable(format!(
            "shard {shard}: leadership moved on (epoch {promised}) before this append in epoch {epoch} was written; it was not written"
        )),
        ref e @ WalError::Producer { ref refusal, .. } => {
            let refused = |code: tonic::Code, why: &'static str| {
                let mut status = Status::new(code, e.to_string());
                status.metadata_mut().insert(walship_proto::REFUSAL_METADATA_KEY, why.parse().expect("ascii"));
                status
            };
            match refusal {
                ProducerRefusal::Invalid(_) => Status::invalid_argument(e.to_string()),
                ProducerRefusal::Fenced { .. } => {
                    refused(tonic::Code::FailedPrecondition, walship_proto::REFUSAL_PRODUCER_FENCED)
                }
                ProducerRefusal::Unknown { .. } => {
                    refused(tonic::Code::FailedPrecondition, walship_proto::REFUSAL_PRODUCER_UNKNOWN)
                }
                // Both name the next sequence expected: send from there.
                ProducerRefusal::Gap { .. } | ProducerRefusal::ForgottenPrefix { .. } => {
                    refused(tonic::Code::OutOfRange, walship_proto::REFUSAL_PRODUCER_SEQUENCE)
                }
                ProducerRefusal::Forgotten { .. } => Status::already_exists(e.to_string()),
            }
        }
        ref e @ WalError::ExpectedLast { last, .. } => {
            let mut status = Status::failed_precondition(e.to_string());
            let metadata = status.metadata_mut();
            metadata.insert(
                walship_proto::REFUSAL_METADATA_KEY,
                walship_proto::REFUSAL_EXPECTED_LAST.parse().expect("ascii"),
            );
            metadata.insert(walship_proto::LAST_SEQNO_METADATA_KEY, last.into());
            status
        }
        e @ WalError::ProducersUnavailable { .. } => Status::unavailable(format!("{e}; it was not written")),
    }
}

fn to_record(frame: &Frame) -> Record {
    Record {
        seqno: frame.seqno(),
        epoch: frame.epoch(),
        timestamp_us: frame.timestamp_us(),
        key: frame.key(),
        payload: frame.payload(),
        crc32: frame.crc32(),
        producer: frame.producer().map(|p| walship_proto::log::Producer {
            id: p.id,
            epoch: p.epoch,
            sequence: p.sequence,
        }),
    }
}

fn durability_name(d: Durability) -> &'static str {
    match d {
        Durability::Local => "local",
        Durability::Quorum | Durability::Unspecified => "quorum",
        Durability::All => "all",
    }
}

type TailStream = Pin<Box<dyn Stream<Item = Result<TailResponse, Status>> + Send>>;

impl LogService {
    pub fn new(node: Arc<ReplicationNode>, limits: LogLimits, metrics: LogServiceMetrics) -> LogService {
        let read_memory = ReadMemory::new(limits.read_memory_bytes, metrics.read_memory_held.clone());
        LogService { wal: node.wal.clone(), node, limits, metrics, read_memory }
    }

    fn replica(&self, shard: ShardId) -> Result<Arc<ShardReplica>, Status> {
        self.node.replica(shard).ok_or_else(|| Status::not_found(format!("shard {shard} is not hosted by this node")))
    }

    fn reject(&self, rpc: &str, status: Status) -> Status {
        self.metrics.rejected.with_label_values(&[rpc, &format!("{:?}", status.code())]).inc();
        status
    }

    /// The leader replica of `shard` and its epoch, or the not-leader
    /// refusal naming the leader when known.
    fn leader_replica(&self, shard: ShardId) -> Result<(Arc<ShardReplica>, u64), Status> {
        let replica = self.replica(shard)?;
        let view = replica.view();
        match view.role {
            Role::Leader => Ok((replica, view.epoch.0)),
            Role::Follower { leader } => {
                let leader = self.node.describe(leader);
                let mut status = Status::failed_precondition(format!(
                    "node {} is a follower of shard {shard}; append to its leader, node {leader}",
                    self.node.me
                ));
                if let Ok(value) = leader.parse() {
                    status.metadata_mut().insert(walship_proto::LEADER_METADATA_KEY, value);
                }
                Err(status)
            }
            Role::Unassigned => Err(Status::unavailable(format!(
                "shard {shard} has no leader assigned on node {} (epoch {}); a failover is in progress",
                self.node.me, view.epoch
            ))),
        }
    }

    fn validate_append(&self, req: &AppendRequest) -> Result<(Durability, Arc<ShardReplica>, u64), Status> {
        let durability = Durability::try_from(req.durability)
            .map_err(|_| Status::invalid_argument(format!("unknown durability {}", req.durability)))?;
        let (replica, epoch) = self.leader_replica(req.shard_id)?;
        if req.records.is_empty() {
            return Err(Status::invalid_argument("an append must carry at least one record"));
        }
        if req.records.len() > self.limits.max_batch_records {
            return Err(Status::invalid_argument(format!(
                "{} records in one append; the limit is {} (max_batch_records)",
                req.records.len(),
                self.limits.max_batch_records
            )));
        }
        let mut total = 0usize;
        for (index, record) in req.records.iter().enumerate() {
            let size = record.key.len() + record.payload.len();
            if size > self.limits.max_record_bytes {
                return Err(Status::invalid_argument(format!(
                    "record {index} is {size} bytes (key + payload); the limit is {} bytes (max_record_bytes)",
                    self.limits.max_record_bytes
                )));
            }
            total += size;
        }
        if total > self.limits.max_batch_bytes {
            return Err(Status::invalid_argument(format!(
                "append carries {total} bytes; the limit is {} bytes (max_batch_bytes)",
                self.limits.max_batch_bytes
            )));
        }
        if let Some(p) = &req.producer {
            let bad = |what: &str| Err(Status::invalid_argument(format!("producer {what} must not be 0")));
            match (p.id, p.epoch, p.sequence) {
                (0, _, _) => return bad("id"),
                (_, 0, _) => return bad("epoch"),
                (_, _, 0) => return bad("sequence (sequences start at 1)"),
                (_, _, s) if s.checked_add(req.records.len() as u64 - 1).is_none() => {
                    return Err(Status::invalid_argument(format!(
                        "producer sequence {s} with {} records runs past 2^64-1",
                        req.records.len()
                    )));
                }
                _ => {}
            }
        }
        Ok((durability, replica, epoch))
    }

    /// One append, as both the unary RPC and the stream serve it; refusals
    /// are counted under `rpc`.
    async fn append_one(&self, req: AppendRequest, rpc: &str) -> Result<AppendResponse, Status> {
        let started = Instant::now();
        let (durability, replica, epoch) = self.validate_append(&req).map_err(|s| self.reject(rpc, s))?;
        let replica = replica.clone();
        self.metrics.append_batch_records.observe(req.records.len() as f64);
        let records = req.records.into_iter().map(|r| NewRecord { key: r.key, payload: r.payload }).collect();
        // Answered by the local commit only at LOCAL or as the one voter;
        // otherwise the WAL does not linger for this appender.
        let alone = replica.members.lock().voters.len() == 1;
        let options = AppendOptions {
            producer: req.producer.map(|p| ProducerStamp { id: p.id, epoch: p.epoch, sequence: p.sequence }),
            expected_last: req.expected_last_seqno,
            answered_later: durability != Durability::Local && !alone,
        };
        let outcome = self
            .wal
            .append_with(req.shard_id, epoch, records, options)
            .await
            .map_err(|e| self.reject(rpc, wal_status(e)))?;
        let appended = outcome.appended;
        let reached = match durability {
            // With one replica the commit is the local fsync; waiting for it
            // to be published keeps read-your-write for every level.
            Durability::Local if replica.members.lock().voters.len() == 1 => {
                replica.wait_commit(appended.last_seqno).await
            }
            Durability::Local => true,
            Durability::Quorum | Durability::Unspecified => replica.wait_commit(appended.last_seqno).await,
            Durability::All => replica.wait_all(appended.last_seqno).await,
        };
        let lease = self.node.config.replication.replication_timeout();
        if reached && !replica.wait_lease(lease).await {
            let mut status = Status::unavailable(format!(
                "shard {}: this leader has not heard from a majority of its replicas or the coordinator within \
                 {} ms (its lease), so it may have been deposed; seqnos {}..={} were not acknowledged and their \
                 outcome is unknown",
                req.shard_id,
                lease.as_millis(),
                appended.first_seqno,
                appended.last_seqno,
            ));
            walship_proto::mark_outcome_unknown(&mut status);
            return Err(self.reject(rpc, status));
        }
        if !reached {
            let mut status = Status::unavailable(format!(
                "shard {}: this node stopped leading before seqnos {}..={} reached {} durability; their outcome is unknown",
                req.shard_id,
                appended.first_seqno,
                appended.last_seqno,
                durability_name(durability)
            ));
            walship_proto::mark_outcome_unknown(&mut status);
            return Err(self.reject(rpc, status));
        }
        self.metrics
            .append_seconds
            .with_label_values(&[durability_name(durability)])
            .observe(started.elapsed().as_secs_f64());
        Ok(AppendResponse {
            first_seqno: appended.first_seqno,
            last_seqno: appended.last_seqno,
            epoch,
            duplicate: outcome.duplicate,
        })
    }
}

#[tonic::async_trait]
impl Log for LogService {
    async fn append(&self, request: Request<AppendRequest>) -> Result<Response<AppendResponse>, Status> {
        self.append_one(request.into_inner(), "append").await.map(Response::new)
    }

    type AppendStreamStream = AppendStreamOut;

    async fn append_stream(
        &self,
        request: Request<Streaming<AppendStreamRequest>>,
    ) -> Result<Response<AppendStreamOut>, Status> {
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(STREAM_ANSWER_BUFFER);
        tokio::spawn(serve_append_stream(self.clone(), inbound, tx));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn read(&self, request: Request<ReadRequest>) -> Result<Response<ReadResponse>, Status> {
        let deadline = call_deadline(request.metadata());
        let (answer, room) =
            self.read_inner(request.into_inner(), deadline).await.map_err(|s| self.reject("read", s))?;
        let mut response = Response::new(answer);
        if let Some(room) = room {
            // Held until the answer has left (`read_memory::HoldUntilSent`).
            response.extensions_mut().insert(HeldByAnswer::new(room));
        }
        Ok(response)
    }

    type TailStream = TailStream;

    async fn tail(&self, request: Request<TailRequest>) -> Result<Response<TailStream>, Status> {
        let req = request.into_inner();
        let shard = req.shard_id;
        let (_, readable) = self.check_from(shard, req.from_seqno).map_err(|s| self.reject("tail", s))?;
        if req.from_seqno > readable + 1 {
            return Err(self.reject(
                "tail",
                Status::out_of_range(format!(
                    "shard {shard}: cannot tail from {}; the newest committed seqno is {readable}",
                    req.from_seqno
                )),
            ));
        }
        let durable = self.replica(shard)?.readable_watch();
        let stop = Stop { node: self.node.me, shutdown: self.node.shutdown.clone() };
        let stream = tail_stream(
            self.wal.clone(),
            shard,
            durable,
            req.from_seqno,
            self.limits.default_read_bytes,
            stop,
            self.read_memory.clone(),
        );
        Ok(Response::new(Box::pin(stream)))
    }
}

/// A long-lived stream's view of its node's shutdown: a node stopping ends
/// its open tails and append streams (`UNAVAILABLE`) instead of waiting on
/// them, which would keep the server, and so the process, from stopping.
#[derive(Clone)]
struct Stop {
    node: crate::NodeId,
    shutdown: tokio_util::sync::CancellationToken,
}

/// What a call still waiting when its node shuts down gets.
fn shutting_down(node: crate::NodeId) -> Status {
    Status::unavailable(format!("node {node} is shutting down"))
}

/// Most appends one `AppendStream` keeps in flight; past it the server stops
/// reading the stream (HTTP/2 flow control pushes back on the client).
pub const STREAM_MAX_IN_FLIGHT: usize = 4096;
/// Most payload bytes (keys + payloads) one `AppendStream` keeps in flight;
/// the server stops reading past it too (one append is always admitted).
pub const STREAM_MAX_IN_FLIGHT_BYTES: usize = 64 << 20;
/// Answers buffered for a client that reads slower than appends complete.
const STREAM_ANSWER_BUFFER: usize = 1024;

type AppendStreamOut = Pin<Box<dyn Stream<Item = Result<AppendStreamResponse, Status>> + Send>>;

/// An append's outcome as a stream answer: what the unary RPC would have
/// said, status metadata included.
fn stream_answer(request_id: u64, outcome: Result<AppendResponse, Status>) -> AppendStreamResponse {
    let result = match outcome {
        Ok(ok) => append_stream_response::Result::Ok(ok),
        Err(status) => append_stream_response::Result::Failure(walship_proto::pipeline::append_failure(&status)),
    };
    AppendStreamResponse { request_id, result: Some(result) }
}

/// Serves one `AppendStream`: reads requests while fewer than
/// [`STREAM_MAX_IN_FLIGHT`] appends and [`STREAM_MAX_IN_FLIGHT_BYTES`] are
/// in flight, runs each as the unary append
/// does, and answers each as it completes. A request without an append, or
/// reusing the id of one still in flight, is refused on its own. When the
/// client closes its side the in-flight appends are still answered; an
/// undecodable message ends the stream with its status after them. When
/// the client goes away the waits are dropped at once (the appends
/// themselves go on, as a cancelled unary append's do), and when the node
/// shuts down the stream ends with `UNAVAILABLE` (the appends in flight
/// then have an unknown outcome, as on a crash).
async fn serve_append_stream(
    service: LogService,
    mut inbound: Streaming<AppendStreamRequest>,
    tx: mpsc::Sender<Result<AppendStreamResponse, Status>>,
) {
    const RPC: &str = "append_stream";
    let mut in_flight = FuturesUnordered::new();
    let mut in_flight_bytes = 0usize;
    let mut ids = HashSet::new();
    let mut reading = true;
    let mut ended_with: Option<Status> = None;
    loop {
        let answer = tokio::select! {
            next = inbound.message(),
                if reading && in_flight.len() < STREAM_MAX_IN_FLIGHT && in_flight_bytes < STREAM_MAX_IN_FLIGHT_BYTES =>
            match next {
                Ok(Some(request)) => {
                    let AppendStreamRequest { request_id, append } = request;
                    let refusal = match append {
                        None => Some(Status::invalid_argument(format!("request {request_id} carries no append"))),
                        Some(_) if ids.contains(&request_id) => Some(Status::invalid_argument(format!(
                            "request id {request_id} is already in flight on this stream"
                        ))),
                        Some(append) => {
                            ids.insert(request_id);
                            // A decoded record holds its bytes and its own
                            // struct: empty ones are not free.
                            let bytes: usize = append
                                .records
                                .iter()
                                .map(|r| r.key.len() + r.payload.len() + std::mem::size_of::<AppendRecord>())
                                .sum();
                            in_flight_bytes += bytes;
                            let service = &service;
                            in_flight.push(async move { (request_id, bytes, service.append_one(append, RPC).await) });
                            None
                        }
                    };
                    match refusal {
                        Some(status) => stream_answer(request_id, Err(service.reject(RPC, status))),
                        None => continue,
                    }
                }
                Ok(None) => {
                    reading = false;
                    continue;
                }
                Err(status) => {
                    reading = false;
                    ended_with = Some(status);
                    continue;
                }
            },
            Some((request_id, bytes, outcome)) = in_flight.next(), if !in_flight.is_empty() => {
                ids.remove(&request_id);
                in_flight_bytes -= bytes;
                stream_answer(request_id, outcome)
            }
            // The client went away: nobody hears the answers (an append
            // at ALL with a replica down could wait for hours).
            _ = tx.closed(), if reading || !in_flight.is_empty() => return,
            _ = service.node.shutdown.cancelled(), if reading || !in_flight.is_empty() => {
                let _ = tx.send(Err(shutting_down(service.node.me))).await;
                return;
            }
            else => break,
        };
        if tx.send(Ok(answer)).await.is_err() {
            return;
        }
    }
    if let Some(status) = ended_with {
        let _ = tx.send(Err(status)).await;
    }
}
