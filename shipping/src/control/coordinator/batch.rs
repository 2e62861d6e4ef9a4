//! The coordinator's Fence and Assign calls, coalesced per node: up to
//! [`IN_FLIGHT`] calls to a node go at once; calls made while that many are
//! in flight queue, and go together as one FenceMany / AssignMany the moment
//! one returns (group commit, for RPCs). A lone call goes at once, alone:
//! batching adds no wait, and a node losing many shards' leaders at once
//! costs each other node a handful of calls instead of one per shard. More
//! than one in flight keeps a slow batch (thousands of fences, each an
//! epoch made durable) from holding every call behind it past its deadline.
//!
//! Nothing about a call changes but its transport: each item is done by the
//! node exactly as the single call would be, and its caller gets the answer
//! or the error the single call would have given. A node that does not know
//! the batch calls (an older build) gets single calls from then on.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::oneshot;
use tonic::{Code, Status};
use walship_proto::log::control_client::ControlClient;
use walship_proto::log::{
    AssignManyRequest, AssignRequest, AssignResponse, FenceManyRequest, FenceRequest, FenceResponse, ItemError,
};

use crate::NodeId;
use crate::peers::{PeerChannel, Peers};
use crate::server::MAX_BATCH_ITEMS;

/// How long one batch call may take before every item in it fails as timed
/// out (a caller's own deadline may be shorter: it then stops waiting): as
/// long as a bulk failover's fences may take.
const BATCH_TIMEOUT: Duration = super::promote::MAX_FENCE_DEADLINE;

/// Calls of one kind to one node in flight at once.
const IN_FLIGHT: usize = 4;

/// One kind of call that can go alone or in a batch.
pub(super) trait Batched: Send + 'static {
    type Answer: Send + 'static;
    const NAME: &'static str;
    fn one(client: ControlClient<PeerChannel>, item: Self)
    -> impl Future<Output = Result<Self::Answer, Status>> + Send;
    fn many(
        client: ControlClient<PeerChannel>,
        items: Vec<Self>,
    ) -> impl Future<Output = Result<Vec<Result<Self::Answer, Status>>, Status>> + Send
    where
        Self: Sized;
}

fn timed<T>(message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(BATCH_TIMEOUT);
    request
}

/// A batch call's outcomes as each item's own result: exactly one outcome
/// per item, in order, each an answer or an error (`split` takes an
/// outcome apart).
fn per_item<O, A>(
    outcomes: Vec<O>,
    items: usize,
    name: &str,
    split: impl Fn(O) -> (Option<A>, Option<ItemError>),
) -> Result<Vec<Result<A, Status>>, Status> {
    if outcomes.len() != items {
        return Err(Status::internal(format!("{name}: {} outcomes for {items} items", outcomes.len())));
    }
    Ok(outcomes
        .into_iter()
        .map(|outcome| match split(outcome) {
            (Some(answer), _) => Ok(answer),
            (None, Some(e)) => Err(Status::new(Code::from(e.code), e.message)),
            (None, None) => Err(Status::internal("the node answered an item with neither an answer nor an error")),
        })
        .collect())
}

impl Batched for FenceRequest {
    type Answer = FenceResponse;
    const NAME: &'static str = "FenceMany";

    async fn one(mut client: ControlClient<PeerChannel>, item: Self) -> Result<FenceResponse, Status> {
        client.fence(timed(item)).await.map(tonic::Response::into_inner)
    }

    async fn many(
        mut client: ControlClient<PeerChannel>,
        items: Vec<Self>,
    ) -> Result<Vec<Result<FenceResponse, Status>>, Status> {
        let n = items.len();
        let outcomes = client.fence_many(timed(FenceManyRequest { fences: items })).await?.into_inner().outcomes;
        per_item(outcomes, n, Self::NAME, |o| (o.answer, o.error))
    }
}

impl Batched for AssignRequest {
    type Answer = AssignResponse;
    const NAME: &'static str = "AssignMany";

    async fn one(mut client: ControlClient<PeerChannel>, item: Self) -> Result<AssignResponse, Status> {
        client.assign(timed(item)).await.map(tonic::Response::into_inner)
    }

    async fn many(
        mut client: ControlClient<PeerChannel>,
        items: Vec<Self>,
    ) -> Result<Vec<Result<AssignResponse, Status>>, Status> {
        let n = items.len();
        let outcomes = client.assign_many(timed(AssignManyRequest { assigns: items })).await?.into_inner().outcomes;
        per_item(outcomes, n, Self::NAME, |o| (o.answer, o.error))
    }
}

type Waiting<Q> = Vec<(Q, oneshot::Sender<Result<<Q as Batched>::Answer, Status>>)>;

/// The calls of one kind to one node.
struct Lane<Q: Batched> {
    client: ControlClient<PeerChannel>,
    state: Mutex<LaneState<Q>>,
}

struct LaneState<Q: Batched> {
    waiting: Waiting<Q>,
    /// Sender tasks draining `waiting` (at most [`IN_FLIGHT`]).
    sending: usize,
    /// The node answered a batch call UNIMPLEMENTED: single calls only.
    singles: bool,
}

impl<Q: Batched> Lane<Q> {
    /// Sends whatever waits, batch after batch, until nothing does.
    async fn drain(self: Arc<Self>) {
        // Callers pushing many items in one go (a bulk failover's fences)
        // finish before the first batch is cut: without this yield a
        // drainer started on another worker took the first two or three
        // items alone, and a bulk went as dozens of tiny calls.
        tokio::task::yield_now().await;
        loop {
            let (batch, singles) = {
                let mut state = self.state.lock();
                // A caller that stopped waiting (its deadline passed) has
                // its item dropped unsent, as its own call would have been.
                state.waiting.retain(|(_, reply)| !reply.is_closed());
                if state.waiting.is_empty() {
                    state.sending -= 1;
                    return;
                }
                let take = state.waiting.len().min(MAX_BATCH_ITEMS);
                let batch: Waiting<Q> = state.waiting.drain(..take).collect();
                (batch, state.singles)
            };
            if singles || batch.len() == 1 {
                self.send_singly(batch).await;
                continue;
            }
            let (items, replies): (Vec<Q>, Vec<_>) = batch.into_iter().unzip();
            match Q::many(self.client.clone(), items).await {
                Ok(answers) => {
                    for (reply, answer) in replies.into_iter().zip(answers) {
                        let _ = reply.send(answer);
                    }
                }
                Err(status) if status.code() == Code::Unimplemented => {
                    // An older node: its items were not looked at. Say so
                    // once, and from now on call it one item at a time; the
                    // callers see a failed call (they retry, as after any).
                    tracing::info!(call = Q::NAME, "a node does not know batched calls: calling it one by one");
                    self.state.lock().singles = true;
                    for reply in replies {
                        let _ = reply.send(Err(status.clone()));
                    }
                }
                Err(status) => {
                    for reply in replies {
                        let _ = reply.send(Err(status.clone()));
                    }
                }
            }
        }
    }

    async fn send_singly(&self, batch: Waiting<Q>) {
        let calls = batch.into_iter().map(|(item, reply)| {
            let client = self.client.clone();
            async move {
                let _ = reply.send(Q::one(client, item).await);
            }
        });
        futures::future::join_all(calls).await;
    }
}

/// Every node's lanes for one kind of call.
pub(super) struct Lanes<Q: Batched> {
    lanes: Mutex<HashMap<NodeId, Arc<Lane<Q>>>>,
}

impl<Q: Batched> Default for Lanes<Q> {
    fn default() -> Self {
        Lanes { lanes: Mutex::default() }
    }
}

impl<Q: Batched> Lanes<Q> {
    /// Calls `node` with `item`, in a batch with whatever else is being
    /// sent to it meanwhile. `None` for a node the coordinator has no
    /// address for.
    pub(super) async fn call(&self, peers: &Peers, node: NodeId, item: Q) -> Option<Result<Q::Answer, Status>> {
        let lane = {
            let mut lanes = self.lanes.lock();
            match lanes.get(&node) {
                Some(lane) => lane.clone(),
                None => {
                    let lane = Arc::new(Lane {
                        client: peers.control(node)?,
                        state: Mutex::new(LaneState { waiting: Vec::new(), sending: 0, singles: false }),
                    });
                    lanes.insert(node, lane.clone());
                    lane
                }
            }
        };
        let (tx, rx) = oneshot::channel();
        let start = {
            let mut state = lane.state.lock();
            state.waiting.push((item, tx));
            let start = state.sending < IN_FLIGHT;
            if start {
                state.sending += 1;
            }
            start
        };
        if start {
            tokio::spawn(lane.drain());
        }
        Some(rx.await.unwrap_or_else(|_| Err(Status::cancelled("the coordinator is shutting down"))))
    }
}
