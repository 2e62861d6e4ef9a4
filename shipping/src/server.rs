//! The `tidal.replication.v1.WalShipping` service of a node: the follower
//! side of `ShipSegment`, the leader side of `StreamSegments`, and the
//! `Heartbeat` receiver. Every refusal is a clear status, counted in
//! `walship_ship_refused_total{reason}`, and applies nothing:
//!
//! | condition | status |
//! | --- | --- |
//! | shard not hosted here | `NOT_FOUND` |
//! | corrupt segment (crc, truncation), envelope not matching the segment, `from_seqno` 0, unknown heartbeat node, a `ShipBatch` of no push or more than 256 (ends the stream) | `INVALID_ARGUMENT` |
//! | older epoch than seen (metadata `walship-epoch`), sent to the leader, from a node that is not the leader | `FAILED_PRECONDITION` |
//! | gap (metadata `walship-applied-seqno`), catch-up from a compacted seqno (needs re-seed) | `OUT_OF_RANGE` |
//! | message over the size limit | `OUT_OF_RANGE` (tonic's frame check) |
//! | from a peer a partition drill cuts (`Control.Partition`) | `UNAVAILABLE` |
//!
//! `ShipSegments` (walship's streaming form of `ShipSegment`, see the proto)
//! answers each push in order with what `ShipSegment` would; a refusal ends
//! the stream with the same status, after the answers to the pushes before
//! it (or, asked for, is answered in place). `ShipBatches` carries many
//! pushes to a message and answers each message with one holding every
//! push's answer in order, refusals in place; a batch of no push or more
//! than [`SHIP_BATCH_MAX_PUSHES`] ends the stream (`INVALID_ARGUMENT`),
//! none of it applied.

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use walship_proto::log::control_server::Control;
use walship_proto::log::{
    AssignManyRequest, AssignManyResponse, AssignOutcome, AssignRequest, AssignResponse, CrashRequest, CrashResponse,
    DamageRecordRequest, DamageRecordResponse, EpochEndRequest, EpochEndResponse, FenceManyRequest, FenceManyResponse,
    FenceOutcome, FenceRequest, FenceResponse, ItemError, PartitionRequest, PartitionResponse, PauseRequest,
    PauseResponse, PositionRequest, WipeRequest, WipeResponse,
};
use walship_proto::replication::wal_shipping_server::WalShipping;
use walship_proto::replication::{
    HeartbeatBatchRequest, HeartbeatRequest, HeartbeatResponse, ShipBatch, ShipBatchAnswer, ShipSegmentRequest,
    ShipSegmentResponse, StreamRequest,
};

use crate::replica::{Members, ReplicationNode, SHIP_BATCH_MAX_PUSHES, Source};

/// The WalShipping service over a node's replication runtime.
#[derive(Clone)]
pub struct WalShippingService {
    node: Arc<ReplicationNode>,
}

impl WalShippingService {
    pub fn new(node: Arc<ReplicationNode>) -> WalShippingService {
        WalShippingService { node }
    }
}

type SegmentStream = Pin<Box<dyn Stream<Item = Result<ShipSegmentRequest, Status>> + Send>>;

/// One push's answer on a `ShipSegments` stream, being worked out.
type Answer = Pin<Box<dyn std::future::Future<Output = Result<ShipSegmentResponse, Status>> + Send>>;

/// Applies one pushed segment and answers as `ShipSegment` does.
async fn answer_push(node: &Arc<ReplicationNode>, request: ShipSegmentRequest) -> Result<ShipSegmentResponse, Status> {
    let applied = node.apply_inbound(&request, Source::Push).await?;
    let shard = request.id.unwrap_or_default().shard_id;
    let epoch = node.replica(shard).map_or(0, |r| r.epoch_seen().max(request.epoch));
    // What this follower archived, when the leader chose it to.
    let archived_seqno = match request.archiver_node_id == node.me {
        true => node.archive_status(shard).map_or(0, |a| a.archived_seqno),
        false => 0,
    };
    Ok(ShipSegmentResponse { accepted: true, applied_seqno: applied, epoch, archived_seqno, ..Default::default() })
}
type AnswerStream = Pin<Box<dyn Stream<Item = Result<ShipSegmentResponse, Status>> + Send>>;

/// Answers one `ShipBatches` message: its pushes applied together, as the
/// pushes in flight on a `ShipSegments` stream are (a shard's later push
/// may wait a moment for its earlier one, see `queue_inbound`), each
/// answered as `ShipSegment` would, a refusal in its place.
async fn answer_batch(node: Arc<ReplicationNode>, batch: ShipBatch) -> ShipBatchAnswer {
    let node = &node;
    let answers = futures::future::join_all(batch.pushes.into_iter().map(|push| async move {
        answer_push(node, push).await.unwrap_or_else(|status| crate::replica::refusal_answer(&status))
    }))
    .await;
    ShipBatchAnswer { answers }
}

/// One `ShipBatches` message's answer being worked out, and its pushes.
type BatchAnswer = Pin<Box<dyn std::future::Future<Output = (usize, Result<ShipBatchAnswer, Status>)> + Send>>;
type BatchAnswerStream = Pin<Box<dyn Stream<Item = Result<ShipBatchAnswer, Status>> + Send>>;

#[tonic::async_trait]
impl WalShipping for WalShippingService {
    async fn ship_segment(
        &self,
        request: Request<ShipSegmentRequest>,
    ) -> Result<Response<ShipSegmentResponse>, Status> {
        answer_push(&self.node, request.into_inner()).await.map(Response::new)
    }

    type ShipSegmentsStream = AnswerStream;

    async fn ship_segments(
        &self,
        request: Request<tonic::Streaming<ShipSegmentRequest>>,
    ) -> Result<Response<AnswerStream>, Status> {
        use futures::StreamExt;
        // Pushes being applied at once on one stream (the leaders' ship
        // windows keep far fewer in flight); past it the stream is not read.
        const IN_FLIGHT: usize = 64;
        let inline = crate::replica::inline_refusals(request.metadata());
        let mut inbound = request.into_inner();
        let node = self.node.clone();
        let (tx, rx) = tokio::sync::mpsc::channel(IN_FLIGHT);
        tokio::spawn(async move {
            let mut in_flight = futures::stream::FuturesOrdered::new();
            let mut reading = true;
            loop {
                // The sender closed its side and every push is answered.
                if !reading && in_flight.is_empty() {
                    return;
                }
                tokio::select! {
                    next = inbound.message(), if reading && in_flight.len() < IN_FLIGHT => match next {
                        Ok(Some(request)) => {
                            let node = node.clone();
                            in_flight.push_back(Box::pin(async move {
                                let answer = answer_push(&node, request).await;
                                if inline { Ok(answer.unwrap_or_else(|s| crate::replica::refusal_answer(&s))) } else { answer }
                            }) as Answer);
                        }
                        Ok(None) => reading = false,
                        // A message that does not decode: answered after the
                        // pushes before it, as the stream's last word.
                        Err(status) => {
                            reading = false;
                            in_flight.push_back(Box::pin(async move { Err(status) }) as Answer);
                        }
                    },
                    Some(answer) = in_flight.next(), if !in_flight.is_empty() => {
                        let failed = answer.is_err();
                        if tx.send(answer).await.is_err() || failed {
                            return;
                        }
                    }
                    // The stream lives as long as the leader keeps it; a
                    // stopping node ends it, or its graceful shutdown would
                    // wait for the leader forever.
                    _ = node.shutdown.cancelled() => return,
                    else => return,
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    type ShipBatchesStream = BatchAnswerStream;

    async fn ship_batches(
        &self,
        request: Request<tonic::Streaming<ShipBatch>>,
    ) -> Result<Response<BatchAnswerStream>, Status> {
        use futures::StreamExt;
        // Pushes being applied at once on one stream, over all its batches
        // (a leader keeps at most 256 in flight to a node); past it the
        // stream is not read.
        const IN_FLIGHT: usize = 256;
        let mut inbound = request.into_inner();
        let node = self.node.clone();
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        tokio::spawn(async move {
            let mut in_flight = futures::stream::FuturesOrdered::<BatchAnswer>::new();
            let mut pushes = 0;
            let mut reading = true;
            loop {
                if !reading && in_flight.is_empty() {
                    return;
                }
                tokio::select! {
                    next = inbound.message(), if reading && pushes < IN_FLIGHT => match next {
                        Ok(Some(batch)) if (1..=SHIP_BATCH_MAX_PUSHES).contains(&batch.pushes.len()) => {
                            let count = batch.pushes.len();
                            pushes += count;
                            let answer = answer_batch(node.clone(), batch);
                            in_flight.push_back(Box::pin(async move { (count, Ok(answer.await)) }));
                        }
                        // Refused whole, after the batches before it are
                        // answered, as the stream's last word.
                        Ok(Some(batch)) => {
                            reading = false;
                            let status = node.refuse_batch(batch.pushes.len());
                            in_flight.push_back(Box::pin(async move { (0, Err(status)) }));
                        }
                        Ok(None) => reading = false,
                        Err(status) => {
                            reading = false;
                            in_flight.push_back(Box::pin(async move { (0, Err(status)) }));
                        }
                    },
                    Some((count, answer)) = in_flight.next(), if !in_flight.is_empty() => {
                        pushes -= count;
                        let failed = answer.is_err();
                        if tx.send(answer).await.is_err() || failed {
                            return;
                        }
                    }
                    _ = node.shutdown.cancelled() => return,
                    else => return,
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    type StreamSegmentsStream = SegmentStream;

    async fn stream_segments(&self, request: Request<StreamRequest>) -> Result<Response<SegmentStream>, Status> {
        let rx = self.node.stream_segments(request.into_inner())?;
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn heartbeat(&self, request: Request<HeartbeatRequest>) -> Result<Response<HeartbeatResponse>, Status> {
        self.node.on_heartbeat(request.get_ref())?;
        Ok(Response::new(HeartbeatResponse { acknowledged: true }))
    }

    async fn heartbeat_batch(
        &self,
        request: Request<HeartbeatBatchRequest>,
    ) -> Result<Response<HeartbeatResponse>, Status> {
        let batch = request.get_ref();
        crate::control::coordinator::check_heartbeat_batch(batch, |n| self.node.config.node(n).is_some())?;
        // Checked whole first: a refused batch records none of its reports.
        for s in &batch.shards {
            self.node.check_heartbeat(s)?;
        }
        for s in &batch.shards {
            self.node.record_heartbeat(s);
        }
        Ok(Response::new(HeartbeatResponse { acknowledged: true }))
    }

    async fn node_keepalive(
        &self,
        request: Request<walship_proto::replication::NodeKeepaliveRequest>,
    ) -> Result<Response<walship_proto::replication::NodeKeepaliveResponse>, Status> {
        self.node.on_node_keepalive(request.get_ref()).map(Response::new)
    }
}

/// The `walship.v1.Control` service of a node: leadership changes from the
/// coordinator, epoch ends for followers repairing their logs, and drill
/// hooks. Refusals: `NOT_FOUND` (shard not hosted), `FAILED_PRECONDITION`
/// with `walship-epoch` (an older epoch than promised), `INVALID_ARGUMENT`
/// (epoch 0, leader outside the replica set; a partition naming this node,
/// an unknown node or too long), `PERMISSION_DENIED` (crash drills not
/// enabled).
#[derive(Clone)]
pub struct ControlService {
    node: Arc<ReplicationNode>,
}

impl ControlService {
    pub fn new(node: Arc<ReplicationNode>) -> ControlService {
        ControlService { node }
    }
}

/// The longest fetch token an assignment may carry.
const MAX_FETCH_TOKEN: usize = 1024;

/// Who holds the shard per an assignment, checked: every node named is one
/// of the cluster's, none twice, the leader a voter (of both sets while
/// joint), learners outside the voting sets. None for an assignment that
/// names no replica set (the set stays as it is). INVALID_ARGUMENT,
/// changing nothing, otherwise.
fn assigned_members(node: &ReplicationNode, r: &AssignRequest) -> Result<Option<Members>, Status> {
    if r.fetch_token.len() > MAX_FETCH_TOKEN {
        return Err(Status::invalid_argument(format!("fetch_token is longer than {MAX_FETCH_TOKEN} bytes")));
    }
    if r.replicas.is_empty() {
        if !r.learners.is_empty() || !r.joint_replicas.is_empty() {
            return Err(Status::invalid_argument("learners or joint_replicas without replicas"));
        }
        return Ok(None);
    }
    let mut seen = std::collections::BTreeSet::new();
    for (name, list) in [("replicas", &r.replicas), ("learners", &r.learners), ("joint_replicas", &r.joint_replicas)] {
        let mut distinct = std::collections::BTreeSet::new();
        for &id in list {
            if node.config.node(id).is_none() {
                return Err(Status::invalid_argument(format!("{name}: node {id} is not in the cluster config")));
            }
            if !distinct.insert(id) {
                return Err(Status::invalid_argument(format!("{name}: node {id} is named twice")));
            }
        }
        if name == "learners" && distinct.iter().any(|id| seen.contains(id)) {
            return Err(Status::invalid_argument("a learner is also a voter"));
        }
        seen.extend(distinct);
    }
    if r.learners.iter().any(|id| r.joint_replicas.contains(id)) {
        return Err(Status::invalid_argument("a learner is also a voter"));
    }
    if !r.replicas.contains(&r.leader) || (!r.joint_replicas.is_empty() && !r.joint_replicas.contains(&r.leader)) {
        return Err(Status::invalid_argument(format!("leader {} is not a voter of the replica set", r.leader)));
    }
    Ok(Some(Members {
        voters: r.replicas.clone(),
        learners: r.learners.clone(),
        joint: r.joint_replicas.clone(),
        epoch: r.epoch,
        version: r.members_version,
    }))
}

/// Items a FenceMany or AssignMany call may carry.
pub const MAX_BATCH_ITEMS: usize = 4096;

fn batch_size(items: usize, what: &str) -> Result<(), Status> {
    if items == 0 {
        return Err(Status::invalid_argument(format!("{what}: no item")));
    }
    if items > MAX_BATCH_ITEMS {
        return Err(Status::invalid_argument(format!("{what}: {items} items; at most {MAX_BATCH_ITEMS} per call")));
    }
    Ok(())
}

/// An item's own check failing fails its whole batch, naming the item.
fn in_item(what: &str, i: usize, status: Status) -> Status {
    Status::invalid_argument(format!("{what}[{i}]: {}", status.message()))
}

/// Each item's answer, or the error its own call would have returned, as a
/// batch's outcomes (`make` builds one from the two halves).
fn outcomes<A, O>(
    answers: Vec<Result<A, crate::replica::ReplicaError>>,
    make: impl Fn(Option<A>, Option<ItemError>) -> O,
) -> Vec<O> {
    answers
        .into_iter()
        .map(|answer| match answer {
            Ok(answer) => make(Some(answer), None),
            Err(e) => {
                let status = Status::from(e);
                make(None, Some(ItemError { code: status.code() as i32, message: status.message().to_string() }))
            }
        })
        .collect()
}

fn positive_epoch(epoch: u64) -> Result<(), Status> {
    if epoch == 0 {
        return Err(Status::invalid_argument("epochs start at 1"));
    }
    Ok(())
}

#[tonic::async_trait]
impl Control for ControlService {
    async fn fence(&self, request: Request<FenceRequest>) -> Result<Response<FenceResponse>, Status> {
        let r = request.into_inner();
        positive_epoch(r.epoch)?;
        self.node.fence(r.shard_id, r.epoch).await.map(Response::new).map_err(Status::from)
    }

    async fn assign(&self, request: Request<AssignRequest>) -> Result<Response<AssignResponse>, Status> {
        let r = request.into_inner();
        positive_epoch(r.epoch)?;
        let members = assigned_members(&self.node, &r)?;
        let token = Some(r.fetch_token).filter(|t| !t.is_empty());
        self.node
            .assign(r.shard_id, r.epoch, r.leader, r.commit_seqno, members, token)
            .await
            .map(Response::new)
            .map_err(Status::from)
    }

    async fn fence_many(&self, request: Request<FenceManyRequest>) -> Result<Response<FenceManyResponse>, Status> {
        let fences = request.into_inner().fences;
        batch_size(fences.len(), "fences")?;
        for (i, f) in fences.iter().enumerate() {
            positive_epoch(f.epoch).map_err(|s| in_item("fences", i, s))?;
        }
        let answers = futures::future::join_all(fences.iter().map(|f| self.node.fence(f.shard_id, f.epoch))).await;
        let outcomes = outcomes(answers, |answer, error| FenceOutcome { answer, error });
        Ok(Response::new(FenceManyResponse { outcomes }))
    }

    async fn assign_many(&self, request: Request<AssignManyRequest>) -> Result<Response<AssignManyResponse>, Status> {
        let assigns = request.into_inner().assigns;
        batch_size(assigns.len(), "assigns")?;
        let mut checked = Vec::with_capacity(assigns.len());
        for (i, r) in assigns.iter().enumerate() {
            positive_epoch(r.epoch).map_err(|s| in_item("assigns", i, s))?;
            checked.push(assigned_members(&self.node, r).map_err(|s| in_item("assigns", i, s))?);
        }
        let calls = assigns.into_iter().zip(checked).map(|(r, members)| {
            let token = Some(r.fetch_token).filter(|t| !t.is_empty());
            self.node.assign(r.shard_id, r.epoch, r.leader, r.commit_seqno, members, token)
        });
        let answers = futures::future::join_all(calls.collect::<Vec<_>>()).await;
        let outcomes = outcomes(answers, |answer, error| AssignOutcome { answer, error });
        Ok(Response::new(AssignManyResponse { outcomes }))
    }

    async fn position(&self, request: Request<PositionRequest>) -> Result<Response<FenceResponse>, Status> {
        self.node.position(request.into_inner().shard_id).await.map(Response::new).map_err(Status::from)
    }

    async fn epoch_end(&self, request: Request<EpochEndRequest>) -> Result<Response<EpochEndResponse>, Status> {
        let (epoch, end_seqno) = self.node.epoch_end(request.into_inner()).await?;
        Ok(Response::new(EpochEndResponse { epoch, end_seqno }))
    }

    async fn pause(&self, request: Request<PauseRequest>) -> Result<Response<PauseResponse>, Status> {
        let r = request.into_inner();
        self.node.pause(r.shard_id, r.paused)?;
        Ok(Response::new(PauseResponse {}))
    }

    async fn crash(&self, request: Request<CrashRequest>) -> Result<Response<CrashResponse>, Status> {
        self.node.crash(&request.into_inner().reason)?;
        Ok(Response::new(CrashResponse {}))
    }

    async fn damage_record(
        &self,
        request: Request<DamageRecordRequest>,
    ) -> Result<Response<DamageRecordResponse>, Status> {
        let r = request.into_inner();
        self.node.damage_record(r.shard_id, r.seqno).await.map(Response::new).map_err(Status::from)
    }

    async fn wipe(&self, request: Request<WipeRequest>) -> Result<Response<WipeResponse>, Status> {
        let r = request.into_inner();
        self.node.wipe(r.shard_id, &r.source).await.map(Response::new).map_err(Status::from)
    }

    async fn partition(&self, request: Request<PartitionRequest>) -> Result<Response<PartitionResponse>, Status> {
        let r = request.into_inner();
        self.node.partition(&r.peers, r.millis)?;
        Ok(Response::new(PartitionResponse {}))
    }
}
