//! A producer: exactly-once, batched, pipelined appends per shard.
//!
//! [`Producer::send`] queues one record for a shard and returns a
//! [`RecordAck`] that resolves once the record is acknowledged at the
//! configured durability (or has failed). Behind it, one task per shard:
//!
//! * **Batching.** Records queue into the shard's open batch, which is sent
//!   when it holds `batch_records` records or `batch_bytes` bytes, when
//!   `linger` has passed since its first record, or at once when nothing of
//!   the shard is in flight (a lone record never waits). While all
//!   `in_flight` pipeline slots are busy the open batch keeps taking records
//!   past its linger and goes out when a slot frees, so a busy shard sends
//!   fewer, larger batches instead of a queue of small ones.
//! * **Pipelining.** Up to `in_flight` batches per shard travel on one
//!   `Log.AppendStream` to the shard's leader. The leader writes a stream's
//!   appends in the order sent, so the batches' producer sequences arrive
//!   in order.
//! * **Exactly once.** The shard's batches carry a producer session (`id`,
//!   `epoch`, a sequence per record). When a batch's outcome is unknown (the
//!   stream broke, the leader died or lost its lease) or it reached a
//!   non-leader, the task waits for the rest of the pipeline to settle,
//!   finds the leader (following `walship-leader` hints, else trying the
//!   servers in turn) and sends every unacknowledged batch again, in order,
//!   with the same sequences: the shard answers those it holds with their
//!   original seqnos. A batch refused for itself (too large, say) fails
//!   alone; the batches after it, refused as sequence gaps, are renumbered
//!   and sent again. A batch not acknowledged within `deadline` of its first
//!   send fails as outcome unknown, with every batch sent after it; the
//!   shard's session then moves to a new epoch.
//! * **Bounded memory.** `send` waits while `buffer_bytes` of payload are
//!   queued and unacknowledged.
//!
//! A client in another language gets the same by following these rules
//! over the gRPC contract: one `AppendStream` per leader, a random producer
//! id, sequences counted per shard, and a retry of the exact same batches
//! (same sequences) after any failure that does not say "not written".

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tonic::{Code, Status};
use walship_proto::log::{AppendRecord, AppendRequest, AppendResponse, Producer as Session};
use walship_proto::pipeline::AppendPipeline;

mod api;

pub use api::{Acked, Connect, ConnectError, ProduceError, ProducerConfig, RecordAck};

struct Item {
    key: Bytes,
    payload: Bytes,
    ack: oneshot::Sender<Result<Acked, ProduceError>>,
    _permit: OwnedSemaphorePermit,
}

enum Message {
    Record(Item),
    /// Records sent as one batch of their own (contiguous seqnos).
    Batch(Vec<Item>),
    Flush(oneshot::Sender<()>),
}

struct Shared {
    servers: Vec<String>,
    connect: Connect,
    config: ProducerConfig,
    id: u64,
    buffer: Arc<Semaphore>,
}

/// Appends records to any shard exactly once; see the module docs. Cheap
/// to share (`&self` everywhere).
pub struct Producer {
    shared: Arc<Shared>,
    /// Each shard's task. A plain lock, held for a lookup and a send (never
    /// across an await): many callers sending at once must not queue
    /// behind one another's wake-ups, as they would on an async lock.
    shards: std::sync::Mutex<HashMap<u32, mpsc::UnboundedSender<Message>>>,
}

impl Producer {
    /// A producer appending through `servers` (node gRPC addresses; the
    /// leader of each shard is found among them).
    pub fn new(servers: Vec<String>, connect: Connect, config: ProducerConfig) -> Producer {
        let id = config
            .id
            .filter(|id| *id != 0)
            .unwrap_or_else(|| rand::Rng::gen_range(&mut rand::thread_rng(), 1..=u64::MAX));
        let buffer = Arc::new(Semaphore::new(config.buffer_bytes.max(1)));
        Producer {
            shared: Arc::new(Shared { servers, connect, config, id, buffer }),
            shards: std::sync::Mutex::new(HashMap::new()),
        }
    }

    /// The producer id its batches carry.
    pub fn id(&self) -> u64 {
        self.shared.id
    }

    /// Queues a record for `shard`, waiting while the buffer is full.
    pub async fn send(&self, shard: u32, key: Bytes, payload: Bytes) -> RecordAck {
        let (ack, answer) = oneshot::channel();
        let bytes = (key.len() + payload.len()).clamp(1, self.shared.config.buffer_bytes.max(1));
        let permit = self.shared.buffer.clone().acquire_many_owned(bytes as u32).await.expect("never closed");
        let item = Item { key, payload, ack, _permit: permit };
        self.dispatch(shard, Message::Record(item));
        RecordAck(answer)
    }

    /// Queues `records` for `shard` as one batch of their own, so that they
    /// get contiguous seqnos (`batch_records` and `batch_bytes` do not split
    /// it; the node's limits still apply), waiting while the buffer is full.
    pub async fn send_batch(&self, shard: u32, records: Vec<(Bytes, Bytes)>) -> Vec<RecordAck> {
        let mut items = Vec::with_capacity(records.len());
        let mut acks = Vec::with_capacity(records.len());
        for (key, payload) in records {
            let (ack, answer) = oneshot::channel();
            let bytes = (key.len() + payload.len()).clamp(1, self.shared.config.buffer_bytes.max(1));
            let permit = self.shared.buffer.clone().acquire_many_owned(bytes as u32).await.expect("never closed");
            items.push(Item { key, payload, ack, _permit: permit });
            acks.push(RecordAck(answer));
        }
        self.dispatch(shard, Message::Batch(items));
        acks
    }

    fn dispatch(&self, shard: u32, message: Message) {
        let mut shards = self.shards.lock().expect("never poisoned");
        let tx = shards.entry(shard).or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(ShardTask::new(shard, self.shared.clone()).run(rx));
            tx
        });
        if let Err(mpsc::error::SendError(message)) = tx.send(message) {
            let items = match message {
                Message::Record(item) => vec![item],
                Message::Batch(items) => items,
                Message::Flush(_) => Vec::new(),
            };
            for item in items {
                let _ = item.ack.send(Err(ProduceError::Closed("the shard's task stopped".into())));
            }
        }
    }

    /// Sends every open batch now and waits until every record sent so far
    /// is acknowledged or has failed.
    pub async fn flush(&self) {
        let waits: Vec<_> = {
            let shards = self.shards.lock().expect("never poisoned");
            shards
                .values()
                .filter_map(|tx| {
                    let (done, wait) = oneshot::channel();
                    tx.send(Message::Flush(done)).ok().map(|()| wait)
                })
                .collect()
        };
        for wait in waits {
            let _ = wait.await;
        }
    }
}

/// A batch of one shard, in the order its records were sent.
struct Batch {
    records: Vec<Item>,
    /// Its first record's sequence; 0 until first sent.
    sequence: u64,
    /// The link generation it was last sent on (`None`: not sent on the
    /// current link).
    sent_on: Option<u64>,
    first_sent: Option<Instant>,
    queued: Instant,
    attempts: u32,
    /// An attempt may have been applied (no answer, or an answer that does
    /// not say "not written"); only such a batch can end as outcome
    /// unknown, the others as not written.
    maybe_written: bool,
}

impl Batch {
    fn fail(self, error: ProduceError) {
        for item in self.records {
            let _ = item.ack.send(Err(error.clone()));
        }
    }
}

/// What the pipeline settling should do before sending again.
#[derive(Default)]
struct Repair {
    /// Find the leader again.
    reconnect: bool,
    /// Give the unacknowledged batches new sequences from this one.
    renumber_from: Option<u64>,
    /// Start a new epoch and renumber every unacknowledged batch from 1.
    new_epoch: bool,
}

type Answer = (u64, u64, Result<AppendResponse, Status>);

struct ShardTask {
    shard: u32,
    shared: Arc<Shared>,
    epoch: u64,
    next_sequence: u64,
    open: Vec<Item>,
    open_bytes: usize,
    open_since: Option<Instant>,
    /// Unacknowledged batches, in sequence order.
    queue: VecDeque<Batch>,
    link: Option<Arc<AppendPipeline>>,
    generation: u64,
    hint: Option<String>,
    next_server: usize,
    /// The node the current (or last) pipeline goes to.
    target: Option<String>,
    /// Connections that failed in a row.
    unreachable: usize,
    in_flight: FuturesUnordered<BoxFuture<'static, Answer>>,
    /// Set on a failure: nothing is sent until the pipeline has settled.
    repair: Option<Repair>,
    flushes: Vec<oneshot::Sender<()>>,
    /// Set once a newer epoch of this producer fenced it.
    fenced: Option<Status>,
}

impl ShardTask {
    fn new(shard: u32, shared: Arc<Shared>) -> ShardTask {
        let epoch = shared.config.epoch.filter(|e| *e != 0).unwrap_or(1);
        ShardTask {
            shard,
            shared,
            epoch,
            next_sequence: 1,
            open: Vec::new(),
            open_bytes: 0,
            open_since: None,
            queue: VecDeque::new(),
            link: None,
            generation: 0,
            hint: None,
            next_server: 0,
            target: None,
            unreachable: 0,
            in_flight: FuturesUnordered::new(),
            repair: None,
            flushes: Vec::new(),
            fenced: None,
        }
    }

    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Message>) {
        let config = self.shared.config.clone();
        let mut receiving = true;
        let mut tick = tokio::time::interval(Duration::from_millis(20));
        loop {
            // An open batch lingers only while it could be sent: with every
            // pipeline slot busy it stays open and keeps taking records (as
            // a Kafka producer's batch does until its sender drains it).
            let linger_until = self.open_since.filter(|_| self.has_room()).map(|t| t + config.linger);
            tokio::select! {
                message = rx.recv(), if receiving => {
                    receiving = self.receive(message);
                    // Everything already queued joins the open batch before
                    // it can be sent: callers woken together by one answer
                    // send together. The first caller's send woke this task
                    // straight after itself (tokio runs a task woken by the
                    // running one next), before the other callers that
                    // answer woke; one yield lets them queue their records
                    // first, where a lone caller loses one trip through the
                    // scheduler.
                    tokio::task::yield_now().await;
                    while receiving {
                        match rx.try_recv() {
                            Ok(message) => receiving = self.receive(Some(message)),
                            Err(mpsc::error::TryRecvError::Empty) => break,
                            Err(mpsc::error::TryRecvError::Disconnected) => receiving = self.receive(None),
                        }
                    }
                }
                Some((generation, sequence, outcome)) = self.in_flight.next(), if !self.in_flight.is_empty() => {
                    self.answered(generation, sequence, outcome);
                }
                _ = sleep_until(linger_until), if linger_until.is_some() => self.close_batch(),
                _ = tick.tick() => self.check_deadlines(),
            }
            let lingered = self.open_since.is_some_and(|t| t + config.linger <= Instant::now());
            if !self.open.is_empty() && (self.in_flight.is_empty() || (lingered && self.has_room())) {
                // Nothing in flight: a lone record never waits. A linger
                // already over (a zero one, say) is not left to the timer,
                // which would round it up to its next millisecond.
                self.close_batch();
            }
            self.settle().await;
            self.send_ready().await;
            if self.queue.is_empty() && self.open.is_empty() {
                for done in self.flushes.drain(..) {
                    let _ = done.send(());
                }
                if !receiving {
                    return;
                }
            }
        }
    }

    /// Takes one message from the callers (`None`: every caller is gone);
    /// returns whether to go on receiving.
    fn receive(&mut self, message: Option<Message>) -> bool {
        match message {
            Some(Message::Record(item)) => self.take(item),
            Some(Message::Batch(items)) => {
                self.close_batch();
                for item in items {
                    self.open_bytes += item.key.len() + item.payload.len();
                    self.open.push(item);
                }
                self.close_batch();
                if let Some(status) = self.fenced.clone() {
                    for batch in self.queue.drain(..) {
                        batch.fail(ProduceError::Refused(status.clone()));
                    }
                }
            }
            Some(Message::Flush(done)) => {
                self.close_batch();
                self.flushes.push(done);
            }
            None => {
                self.close_batch();
                return false;
            }
        }
        true
    }

    /// Whether every queued batch travels on the current link.
    fn all_sent(&self) -> bool {
        self.queue.iter().all(|b| b.sent_on == Some(self.generation))
    }

    /// Whether a batch closed now would be sent at once: nothing waits in
    /// the queue (a retry, a batch the pipeline had no room for), so the
    /// queue is what travels, and fewer than `in_flight` batches do.
    fn has_room(&self) -> bool {
        self.repair.is_none() && self.all_sent() && self.queue.len() < self.shared.config.in_flight
    }

    fn take(&mut self, item: Item) {
        if let Some(status) = &self.fenced {
            let _ = item.ack.send(Err(ProduceError::Refused(status.clone())));
            return;
        }
        self.open_bytes += item.key.len() + item.payload.len();
        self.open.push(item);
        self.open_since.get_or_insert_with(Instant::now);
        let config = &self.shared.config;
        if self.open.len() >= config.batch_records || self.open_bytes >= config.batch_bytes {
            self.close_batch();
        }
    }

    fn close_batch(&mut self) {
        if self.open.is_empty() {
            return;
        }
        let records = std::mem::take(&mut self.open);
        self.open_bytes = 0;
        self.open_since = None;
        self.queue.push_back(Batch {
            records,
            sequence: 0,
            sent_on: None,
            first_sent: None,
            queued: Instant::now(),
            attempts: 0,
            maybe_written: false,
        });
    }

    /// Once nothing is in flight, applies what the failures asked for.
    async fn settle(&mut self) {
        if !self.in_flight.is_empty() {
            return;
        }
        let Some(repair) = self.repair.take() else { return };
        if repair.new_epoch {
            self.epoch += 1;
            self.next_sequence = 1;
            for batch in &mut self.queue {
                batch.sequence = 0;
            }
        } else if let Some(from) = repair.renumber_from {
            self.next_sequence = from;
            for batch in self.queue.iter_mut().filter(|b| b.sequence >= from) {
                batch.sequence = 0;
            }
        }
        if repair.reconnect {
            self.link = None;
            // Do not spin on a server that just failed.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.generation += 1;
        for batch in &mut self.queue {
            batch.sent_on = None;
        }
    }

    /// Sends the batches not yet sent on the current link, in order, while
    /// fewer than `in_flight` are.
    async fn send_ready(&mut self) {
        if self.repair.is_some() || self.all_sent() {
            return;
        }
        let Some(link) = self.link().await else { return };
        let config = &self.shared.config;
        let in_flight = self.queue.iter().filter(|b| b.sent_on == Some(self.generation)).count();
        let mut room = config.in_flight.saturating_sub(in_flight);
        for batch in self.queue.iter_mut().filter(|b| b.sent_on != Some(self.generation)) {
            if room == 0 {
                break;
            }
            room -= 1;
            if batch.sequence == 0 {
                batch.sequence = self.next_sequence;
                self.next_sequence += batch.records.len() as u64;
            }
            let size: usize = batch.records.iter().map(|r| r.key.len() + r.payload.len() + 16).sum();
            if size > config.max_request_bytes {
                // Answered as the node would (nothing written); its
                // successors take its sequences.
                let status = Status::invalid_argument(format!(
                    "a batch of {} records is about {size} bytes; the producer's limit is {} bytes \
                     (max_request_bytes); nothing was sent",
                    batch.records.len(),
                    config.max_request_bytes
                ));
                let (generation, sequence) = (self.generation, batch.sequence);
                batch.sent_on = Some(generation);
                self.in_flight.push(Box::pin(async move { (generation, sequence, Err(status)) }));
                continue;
            }
            batch.sent_on = Some(self.generation);
            batch.first_sent.get_or_insert_with(Instant::now);
            batch.attempts += 1;
            let request = AppendRequest {
                shard_id: self.shard,
                records: batch
                    .records
                    .iter()
                    .map(|r| AppendRecord { key: r.key.clone(), payload: r.payload.clone() })
                    .collect(),
                durability: config.durability as i32,
                producer: Some(Session { id: self.shared.id, epoch: self.epoch, sequence: batch.sequence }),
                expected_last_seqno: None,
            };
            let (generation, sequence, link) = (self.generation, batch.sequence, link.clone());
            let timeout = config.request_timeout;
            // Pushed in order and first polled in order: the requests enter
            // the stream in sequence order.
            self.in_flight.push(Box::pin(async move {
                let answer = match tokio::time::timeout(timeout, link.append(request)).await {
                    Ok(answer) => answer,
                    Err(_) => {
                        let mut status = Status::deadline_exceeded(format!("no answer within {timeout:?}"));
                        walship_proto::mark_outcome_unknown(&mut status);
                        Err(status)
                    }
                };
                (generation, sequence, answer)
            }));
        }
    }

    /// The pipeline to the shard's leader, opening one if needed.
    async fn link(&mut self) -> Option<Arc<AppendPipeline>> {
        if let Some(link) = &self.link {
            return Some(link.clone());
        }
        let servers = &self.shared.servers;
        let target = self.hint.take().unwrap_or_else(|| {
            let server = servers[self.next_server % servers.len()].clone();
            self.next_server += 1;
            server
        });
        self.target = Some(target.clone());
        let client = match (self.shared.connect)(target.clone()).await {
            Ok(client) => {
                self.unreachable = 0;
                client
            }
            Err(e) => {
                tracing::debug!(shard = self.shard, server = %target, error = %e, "producer: cannot connect");
                self.unreachable += 1;
                // Every server failed in a row and nothing may have been
                // applied: the batches were never sent; waiting longer
                // would not help.
                if self.unreachable >= servers.len() && self.queue.iter().all(|b| !b.maybe_written) {
                    self.unreachable = 0;
                    for batch in self.queue.drain(..) {
                        batch.fail(ProduceError::Unreachable(e.clone()));
                    }
                    return None;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
                return None;
            }
        };
        match AppendPipeline::open(client).await {
            Ok(pipeline) => {
                let pipeline = Arc::new(pipeline);
                self.link = Some(pipeline.clone());
                Some(pipeline)
            }
            Err(status) => {
                tracing::debug!(shard = self.shard, server = %target, %status, "producer: cannot open a stream");
                tokio::time::sleep(Duration::from_millis(50)).await;
                None
            }
        }
    }

    fn repair(&mut self) -> &mut Repair {
        self.repair.get_or_insert_with(Repair::default)
    }

    fn answered(&mut self, generation: u64, sequence: u64, outcome: Result<AppendResponse, Status>) {
        let Some(at) = self.queue.iter().position(|b| b.sent_on == Some(generation) && b.sequence == sequence) else {
            return;
        };
        let status = match outcome {
            Ok(response) => {
                let batch = self.queue.remove(at).expect("found");
                let n = batch.records.len() as u64;
                // A range of exactly the batch's records names each one's
                // seqno; any other answer (a batch a failover cut in two,
                // or a range that is none at all) leaves them unknown.
                let contiguous = response.first_seqno > 0
                    && response.last_seqno.checked_sub(response.first_seqno).map(|d| d + 1) == Some(n);
                for (i, item) in batch.records.into_iter().enumerate() {
                    let seqno = if contiguous { response.first_seqno + i as u64 } else { 0 };
                    let acked =
                        Acked { shard: self.shard, seqno, epoch: response.epoch, duplicate: response.duplicate };
                    let _ = item.ack.send(Ok(acked));
                }
                return;
            }
            Err(status) => status,
        };
        let refusal = walship_proto::refusal(&status).map(str::to_string);
        match (status.code(), refusal.as_deref()) {
            (_, Some(walship_proto::REFUSAL_PRODUCER_FENCED)) => {
                self.fenced = Some(status.clone());
                for batch in self.queue.drain(..) {
                    batch.fail(ProduceError::Refused(status.clone()));
                }
                for item in self.open.drain(..) {
                    let _ = item.ack.send(Err(ProduceError::Refused(status.clone())));
                }
                self.open_bytes = 0;
                self.open_since = None;
            }
            (_, Some(walship_proto::REFUSAL_PRODUCER_SEQUENCE | walship_proto::REFUSAL_PRODUCER_UNKNOWN)) => {
                // Nothing written. After an earlier batch failed, its
                // successors are gaps: they are renumbered or sent again
                // once the pipeline settles. At the front, the shard does
                // not know where this producer is (it forgot it): a new
                // epoch starts; a batch sent before may have been written
                // and forgotten, so its outcome is unknown.
                let renumbering = self.repair.as_ref().is_some_and(|r| r.renumber_from.is_some());
                self.repair();
                if at == 0 && !renumbering {
                    if self.queue[0].maybe_written {
                        let batch = self.queue.remove(0).expect("front");
                        batch.fail(ProduceError::OutcomeUnknown {
                            server: self.target.clone(),
                            detail: format!(
                                "a retry was refused because the shard no longer knows this producer: {}",
                                status.message()
                            ),
                        });
                    }
                    self.repair().new_epoch = true;
                }
            }
            (Code::AlreadyExists, _) => {
                let batch = self.queue.remove(at).expect("found");
                batch.fail(ProduceError::WrittenSeqnoUnknown(status.message().to_string()));
            }
            (code, _) if transient(code, &status) => {
                if !not_applied(&status) {
                    self.queue[at].maybe_written = true;
                }
                self.hint = walship_proto::leader_address(&status).map(str::to_string);
                self.repair().reconnect = true;
            }
            _ => {
                // Refused for itself: it alone fails; its successors (gaps
                // now) take its sequences.
                let batch = self.queue.remove(at).expect("found");
                let from = batch.sequence;
                batch.fail(ProduceError::Refused(status));
                let repair = self.repair();
                repair.renumber_from = Some(repair.renumber_from.map_or(from, |f| f.min(from)));
            }
        }
    }

    /// Fails the batches not acknowledged within `deadline` of being
    /// queued: as outcome unknown when an attempt may have been applied
    /// (with every later batch that may have been: their sequences follow
    /// it), as not written otherwise. The batches kept are certainly not
    /// written; the session moves to a new epoch and they are renumbered.
    fn check_deadlines(&mut self) {
        let deadline = self.shared.config.deadline;
        if self.queue.front().is_none_or(|b| b.queued.elapsed() <= deadline) {
            return;
        }
        let generation = self.generation;
        let mut kept = VecDeque::new();
        let mut expired_any = false;
        for (i, mut batch) in std::mem::take(&mut self.queue).into_iter().enumerate() {
            // An attempt still in flight may be applied.
            batch.maybe_written |= batch.sent_on == Some(generation);
            if batch.maybe_written {
                batch.fail(ProduceError::OutcomeUnknown {
                    server: self.target.clone(),
                    detail: format!(
                        "no leader acknowledged the batch within {deadline:?} of it being queued; it may or may not \
                         have been written"
                    ),
                });
                expired_any = true;
            } else if i == 0 || batch.queued.elapsed() > deadline {
                batch.fail(ProduceError::NotWritten(format!(
                    "no leader of the shard took it within {deadline:?} (the last tried: {})",
                    self.target.as_deref().unwrap_or("none")
                )));
            } else {
                kept.push_back(batch);
            }
        }
        self.queue = kept;
        let repair = self.repair();
        repair.reconnect = true;
        repair.new_epoch |= expired_any;
    }
}

/// Whether a failed attempt certainly was not applied: a not-leader
/// refusal, no leader assigned, leadership moved before the write, or a
/// stream that ended before the request went out.
fn not_applied(status: &Status) -> bool {
    if walship_proto::outcome_unknown(status) {
        return false;
    }
    let m = status.message();
    match status.code() {
        Code::FailedPrecondition => status.metadata().get(walship_proto::LEADER_METADATA_KEY).is_some(),
        Code::Unavailable => {
            m.contains("no leader assigned")
                || m.contains("it was not written")
                || m.contains("the append stream is closed")
                || m.contains("the append stream ended")
        }
        _ => false,
    }
}

/// Failures after which the batch is sent again (to the leader found
/// anew): not-leader refusals, no leader yet, leadership or lease lost,
/// unknown outcomes, a broken stream or connection, a full disk (the
/// leadership moves).
fn transient(code: Code, status: &Status) -> bool {
    match code {
        Code::FailedPrecondition => status.metadata().get(walship_proto::LEADER_METADATA_KEY).is_some(),
        Code::Unavailable
        | Code::Cancelled
        | Code::DeadlineExceeded
        | Code::Unknown
        | Code::Internal
        | Code::Aborted
        | Code::ResourceExhausted => true,
        _ => walship_proto::outcome_unknown(status),
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}
