//! The node pair's ship stream: one task per follower node carries the
//! pushes every shipper of this node makes to it (`send.rs`) and hands each
//! its answer. Over `ShipBatches` the pushes queued when the task runs go
//! as one message and come back answered in one; a peer without it gets
//! `ShipSegments` (one push to a message), and a peer older still unary
//! `ShipSegment` calls.
//!
//! Invariants kept here: every push is answered exactly once, by its own
//! answer or by a failure (never by another push's answer: an answer
//! message whose count does not match its batch fails the batch); pushes
//! reach the follower in the order the shippers handed them over.

use tonic::Status;
use walship_proto::replication::wal_shipping_client::WalShippingClient;
use walship_proto::replication::{ShipBatch, ShipSegmentResponse};

use super::SHIP_BATCH_MAX_PUSHES;
use super::pushes::ShipCall;

/// Carries one follower node's pushes: over one `ShipBatches` stream, many
/// pushes to a message (those queued when the stream's task runs, at most
/// [`SHIP_BATCH_MAX_PUSHES`] and about [`SHIP_BATCH_BYTES`]); each push is
/// answered in order by its own answer in the message answering its batch.
/// The stream reopens on the next push after it ends (the follower
/// restarted). Refusals come in place: a refused push is answered with its
/// status and the stream goes on.
///
/// A peer without `ShipBatches` (an older node) answers `UNIMPLEMENTED`; the
/// pushes then go over a `ShipSegments` stream, one to a message
/// ([`run_segment_stream`]), or unary `ShipSegment` calls for a peer older
/// still. Once that `ShipSegments` stream ends (the peer restarted: in a
/// rolling upgrade, maybe as a newer node), the next push asks for
/// `ShipBatches` again.
pub(super) async fn run_ship_stream(
    client: WalShippingClient<crate::peers::PeerChannel>,
    mut calls: tokio::sync::mpsc::Receiver<ShipCall>,
    pushes_per_message: prometheus::Histogram,
) {
    loop {
        let Some((rest, first)) = run_batch_stream(client.clone(), calls, pushes_per_message.clone()).await else {
            return;
        };
        match run_segment_stream(client.clone(), first, rest).await {
            Some(rest) => calls = rest,
            None => return,
        }
    }
}

/// The `ShipBatches` stream of [`run_ship_stream`]. Returns the calls and
/// the first push not yet answered when the peer has no such stream; none
/// once the calls end.
async fn run_batch_stream(
    mut client: WalShippingClient<crate::peers::PeerChannel>,
    mut calls: tokio::sync::mpsc::Receiver<ShipCall>,
    pushes_per_message: prometheus::Histogram,
) -> Option<(tokio::sync::mpsc::Receiver<ShipCall>, ShipCall)> {
    use std::collections::VecDeque;
    type Reply = tokio::sync::oneshot::Sender<Result<ShipSegmentResponse, Status>>;
    let fail = |replies: Vec<Reply>, status: &Status| {
        for reply in replies {
            let _ = reply.send(Err(status.clone()));
        }
    };
    loop {
        let first = calls.recv().await?;
        let (req_tx, req_rx) = tokio::sync::mpsc::channel(SHIP_BATCH_DEPTH);
        let mut answers = match client.ship_batches(tokio_stream::wrappers::ReceiverStream::new(req_rx)).await {
            Ok(r) => r.into_inner(),
            Err(status) if status.code() == tonic::Code::Unimplemented => {
                tracing::info!(%status, "peer has no ShipBatches stream; shipping with ShipSegments");
                return Some((calls, first));
            }
            Err(status) => {
                let _ = first.1.send(Err(status));
                continue;
            }
        };
        // The replies of each batch sent and not yet answered, oldest first,
        // and the pushes they hold.
        let mut pending: VecDeque<Vec<Reply>> = VecDeque::new();
        let mut in_flight = 0;
        let mut next = Some(first);
        let end = 'stream: loop {
            if let Some(first) = next.take() {
                // The shipper that sent this ran this task straight after
                // itself (tokio runs a task woken by the running one next),
                // ahead of the other shards' shippers woken with it: one
                // yield lets their pushes queue too, to go in this batch.
                tokio::task::yield_now().await;
                let mut bytes = first.0.payload.len();
                let (mut pushes, mut replies) = (vec![first.0], vec![first.1]);
                while pushes.len() < SHIP_BATCH_MAX_PUSHES
                    && in_flight + pushes.len() < SHIP_STREAM_DEPTH
                    && bytes < SHIP_BATCH_BYTES
                    && let Ok((push, reply)) = calls.try_recv()
                {
                    bytes += push.payload.len();
                    pushes.push(push);
                    replies.push(reply);
                }
                pushes_per_message.observe(pushes.len() as f64);
                if req_tx.send(ShipBatch { pushes }).await.is_err() {
                    // The pushes still queued go on the next stream.
                    let end = Status::unavailable("the ShipBatches stream closed");
                    fail(replies, &end);
                    break 'stream end;
                }
                in_flight += replies.len();
                pending.push_back(replies);
            }
            tokio::select! {
                call = calls.recv(), if in_flight < SHIP_STREAM_DEPTH => match call {
                    Some(call) => next = Some(call),
                    None => return None,
                },
                answer = answers.message() => match answer {
                    Ok(Some(answer)) => {
                        let Some(replies) = pending.pop_front() else {
                            break Status::internal("the follower answered a ShipBatch that was not sent");
                        };
                        in_flight -= replies.len();
                        if answer.answers.len() != replies.len() {
                            let end = Status::internal(format!(
                                "the follower answered a ShipBatch of {} pushes with {} answers",
                                replies.len(),
                                answer.answers.len()
                            ));
                            fail(replies, &end);
                            break end;
                        }
                        for (reply, answer) in replies.into_iter().zip(answer.answers) {
                            let _ = reply.send(super::error::refusal_status(&answer).map_or(Ok(answer), Err));
                        }
                    }
                    Ok(None) => break Status::unavailable("the ShipBatches stream ended"),
                    Err(status) => {
                        // Batches are answered in order: the error is the oldest one's.
                        if let Some(replies) = pending.pop_front() {
                            fail(replies, &status);
                        }
                        break Status::unavailable(format!("the ShipBatches stream ended: {}", status.message()));
                    }
                },
            }
        };
        for replies in pending.drain(..) {
            fail(replies, &end);
        }
    }
}

/// Carries one follower node's pushes over one `ShipSegments` stream, one
/// to a message, each answered in order by the call that sent it, until
/// the stream ends (the follower restarted): then answers the calls for
/// [`run_ship_stream`] to try `ShipBatches` again; none once the calls end
/// or for a peer on unary calls. The stream asks for refusals in place: a refused push is
/// answered with its status and the stream goes on. (A follower that ends
/// the stream on a refusal instead, as the contract allows without that
/// metadata, fails the later pushes in flight; they are shipped again.
/// Every shard on the stream paid for one shard's refusal that way: at
/// start-up, with thousands of replicas reconciling, some 100,000 pushes a
/// node failed.)
///
/// A peer without `ShipSegments` (an older node) answers `UNIMPLEMENTED`;
/// from then on each push is a unary `ShipSegment`, as before the stream.
async fn run_segment_stream(
    mut client: WalShippingClient<crate::peers::PeerChannel>,
    first: ShipCall,
    mut calls: tokio::sync::mpsc::Receiver<ShipCall>,
) -> Option<tokio::sync::mpsc::Receiver<ShipCall>> {
    use std::collections::VecDeque;
    let mut carried = Some(first);
    loop {
        let (first, reply) = match carried.take() {
            Some(call) => call,
            None => calls.recv().await?,
        };
        let (req_tx, req_rx) = tokio::sync::mpsc::channel(SHIP_STREAM_DEPTH);
        let mut call = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(req_rx));
        call.metadata_mut().insert(super::error::INLINE_REFUSALS_KEY, tonic::metadata::MetadataValue::from_static("1"));
        let mut answers = match client.ship_segments(call).await {
            Ok(r) => r.into_inner(),
            Err(status) if status.code() == tonic::Code::Unimplemented => {
                tracing::info!(%status, "peer has no ShipSegments stream; shipping with unary ShipSegment");
                ship_unary(client, (first, reply), calls).await;
                return None;
            }
            Err(status) => {
                let _ = reply.send(Err(status));
                continue;
            }
        };
        let mut pending = VecDeque::new();
        if req_tx.send(first).await.is_ok() {
            pending.push_back(reply);
        }
        let end = 'stream: loop {
            tokio::select! {
                call = calls.recv() => match call {
                    Some(first) => {
                        // The shipper that sent this ran this task straight
                        // after itself (tokio runs a task woken by the
                        // running one next), ahead of the other shards'
                        // shippers woken with it: one yield lets their
                        // pushes queue too, and they go to the stream
                        // together, to be encoded into one write.
                        tokio::task::yield_now().await;
                        // A bounded turn: answers are read between turns.
                        let mut call = Some(first);
                        let mut turn = 0;
                        while let Some((request, reply)) = call {
                            if req_tx.send(request).await.is_err() {
                                // The pushes still queued go on the next stream.
                                let _ = reply.send(Err(Status::unavailable("the ShipSegments stream closed")));
                                break 'stream Status::unavailable("the ShipSegments stream closed");
                            }
                            pending.push_back(reply);
                            turn += 1;
                            call = if turn < SHIP_TURN { calls.try_recv().ok() } else { None };
                        }
                    }
                    None => return None,
                },
                answer = answers.message() => match answer {
                    Ok(Some(response)) => {
                        if let Some(reply) = pending.pop_front() {
                            let _ = reply.send(super::error::refusal_status(&response).map_or(Ok(response), Err));
                        }
                    }
                    Ok(None) => break Status::unavailable("the ShipSegments stream ended"),
                    Err(status) => {
                        // Answers come in order: the refusal is the oldest push's.
                        if let Some(reply) = pending.pop_front() {
                            let _ = reply.send(Err(status.clone()));
                        }
                        break Status::unavailable(format!("the ShipSegments stream ended: {}", status.message()));
                    }
                },
            }
        };
        for reply in pending.drain(..) {
            let _ = reply.send(Err(end.clone()));
        }
        return Some(calls);
    }
}

/// Pushes in flight on one ship stream, at most; more wait.
pub(super) const SHIP_STREAM_DEPTH: usize = 256;

/// Batches a `ShipBatches` stream's sender holds before the transport
/// takes them.
const SHIP_BATCH_DEPTH: usize = 16;

/// Segment bytes past which a `ShipBatches` message takes no further push
/// (one push alone may be larger: up to `ship_batch_bytes`).
const SHIP_BATCH_BYTES: usize = 4 << 20;

/// Pushes handed to the stream in one turn, at most, before its answers
/// are read again.
const SHIP_TURN: usize = 32;

/// Unary `ShipSegment` for every push, for a peer without `ShipSegments`.
async fn ship_unary(
    client: WalShippingClient<crate::peers::PeerChannel>,
    first: ShipCall,
    mut calls: tokio::sync::mpsc::Receiver<ShipCall>,
) {
    let mut next = Some(first);
    while let Some((request, reply)) = match next.take() {
        Some(call) => Some(call),
        None => calls.recv().await,
    } {
        let mut client = client.clone();
        tokio::spawn(async move {
            let _ = reply.send(client.ship_segment(request).await.map(tonic::Response::into_inner));
        });
    }
}

#[cfg(test)]
#[path = "ship_stream_test.rs"]
mod tests;
