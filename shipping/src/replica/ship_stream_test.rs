//! The node pair's ship stream (`run_ship_stream`) against fake follower
//! nodes on loopback.

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use tonic::{Request, Response};
use walship_proto::replication::wal_shipping_client::WalShippingClient;
use walship_proto::replication::wal_shipping_server::{WalShipping, WalShippingServer};
use walship_proto::replication::{
    HeartbeatRequest, HeartbeatResponse, ShipBatchAnswer, ShipSegmentRequest, StreamRequest, WalSegmentId,
};

use super::*;

/// A fake follower node, with the streams it has (`mode`); `streams`
/// counts the streams opened and `messages` the messages that reached
/// them. Unary pushes work in every mode. Each answer names the pushed
/// seqno.
struct FakePeer {
    mode: Mode,
    streams: Arc<std::sync::atomic::AtomicUsize>,
    /// Of them, `ShipBatches` streams.
    batch_streams: Arc<std::sync::atomic::AtomicUsize>,
    messages: Arc<std::sync::atomic::AtomicUsize>,
    /// In `Mode::Upgrading`: the peer has `ShipBatches` now.
    upgraded: Arc<std::sync::atomic::AtomicBool>,
}

#[derive(Clone, Copy)]
enum Mode {
    /// `ShipBatches`, ending each stream once `per_stream` pushes came.
    Batches { per_stream: usize },
    /// `ShipBatches` answering every batch with one answer too many.
    BatchesMiscounted,
    /// A peer from before `ShipBatches` (`UNIMPLEMENTED`, what tonic
    /// answers for a method it does not know): `ShipSegments`, ending each
    /// stream after `per_stream` pushes.
    Segments { per_stream: usize },
    /// A peer from before both streams.
    Unary,
    /// `ShipSegments` as in `Segments`, and `ShipBatches` too once
    /// `upgraded` (a peer restarted as a newer node).
    Upgrading { per_stream: usize },
}

impl FakePeer {
    fn new(mode: Mode) -> FakePeer {
        FakePeer {
            mode,
            streams: Arc::default(),
            batch_streams: Arc::default(),
            messages: Arc::default(),
            upgraded: Arc::default(),
        }
    }
}

fn answer(push: &ShipSegmentRequest) -> ShipSegmentResponse {
    ShipSegmentResponse {
        accepted: true,
        applied_seqno: push.id.unwrap_or_default().seqno,
        epoch: 1,
        ..Default::default()
    }
}

type Answers = Pin<Box<dyn Stream<Item = Result<ShipSegmentResponse, Status>> + Send>>;
type BatchAnswers = Pin<Box<dyn Stream<Item = Result<ShipBatchAnswer, Status>> + Send>>;
type Segments = Pin<Box<dyn Stream<Item = Result<ShipSegmentRequest, Status>> + Send>>;

#[tonic::async_trait]
impl WalShipping for FakePeer {
    async fn ship_segment(
        &self,
        request: Request<ShipSegmentRequest>,
    ) -> Result<Response<ShipSegmentResponse>, Status> {
        Ok(Response::new(answer(request.get_ref())))
    }
    type ShipSegmentsStream = Answers;
    async fn ship_segments(
        &self,
        request: Request<tonic::Streaming<ShipSegmentRequest>>,
    ) -> Result<Response<Answers>, Status> {
        let (Mode::Segments { per_stream } | Mode::Upgrading { per_stream }) = self.mode else {
            return Err(Status::unimplemented("unknown method ShipSegments"));
        };
        self.streams.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let messages = self.messages.clone();
        let pushes = futures::StreamExt::take(request.into_inner(), per_stream);
        Ok(Response::new(Box::pin(futures::StreamExt::map(pushes, move |push| {
            messages.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            push.map(|p| answer(&p))
        }))))
    }
    type ShipBatchesStream = BatchAnswers;
    async fn ship_batches(
        &self,
        request: Request<tonic::Streaming<ShipBatch>>,
    ) -> Result<Response<BatchAnswers>, Status> {
        let (per_stream, extra) = match self.mode {
            Mode::Batches { per_stream } => (per_stream, false),
            Mode::BatchesMiscounted => (usize::MAX, true),
            Mode::Upgrading { .. } if self.upgraded.load(std::sync::atomic::Ordering::SeqCst) => (usize::MAX, false),
            Mode::Segments { .. } | Mode::Upgrading { .. } | Mode::Unary => {
                return Err(Status::unimplemented("unknown method ShipBatches"));
            }
        };
        self.streams.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.batch_streams.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let messages = self.messages.clone();
        // Batches until `per_stream` pushes have come (the last one whole).
        let mut taken = 0;
        let batches = futures::StreamExt::take_while(request.into_inner(), move |batch| {
            let more = taken < per_stream;
            taken += batch.as_ref().map_or(0, |b| b.pushes.len());
            std::future::ready(more)
        });
        Ok(Response::new(Box::pin(futures::StreamExt::map(batches, move |batch| {
            messages.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            batch.map(|b| {
                let mut answers: Vec<_> = b.pushes.iter().map(answer).collect();
                if extra {
                    answers.push(answer(&b.pushes[0]));
                }
                ShipBatchAnswer { answers }
            })
        }))))
    }
    type StreamSegmentsStream = Segments;
    async fn stream_segments(&self, _: Request<StreamRequest>) -> Result<Response<Segments>, Status> {
        Err(Status::unimplemented("not in this test"))
    }
    async fn heartbeat(&self, _: Request<HeartbeatRequest>) -> Result<Response<HeartbeatResponse>, Status> {
        Err(Status::unimplemented("not in this test"))
    }
    async fn heartbeat_batch(
        &self,
        _: Request<walship_proto::replication::HeartbeatBatchRequest>,
    ) -> Result<Response<HeartbeatResponse>, Status> {
        Err(Status::unimplemented("not in this test"))
    }
    async fn node_keepalive(
        &self,
        _: Request<walship_proto::replication::NodeKeepaliveRequest>,
    ) -> Result<Response<walship_proto::replication::NodeKeepaliveResponse>, Status> {
        Err(Status::unimplemented("not in this test"))
    }
}

/// Serves `peer` on a loopback port and runs a ship stream towards it;
/// pushes go in through the returned sender.
async fn ship_stream_to(peer: FakePeer) -> (tokio::sync::mpsc::Sender<ShipCall>, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(WalShippingServer::new(peer))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
            .await;
    });
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}")).unwrap().connect_lazy();
    let (calls, rx) = tokio::sync::mpsc::channel(SHIP_STREAM_DEPTH);
    let channel =
        tonic::service::interceptor::InterceptedService::new(channel, crate::auth::ClusterCredentials::of(None));
    let histogram = prometheus::Histogram::with_opts(prometheus::HistogramOpts::new("pushes", "pushes")).unwrap();
    tokio::spawn(run_ship_stream(WalShippingClient::new(channel), rx, histogram));
    (calls, server)
}

/// A push of `seqno` and where its answer arrives.
fn push(seqno: u64) -> (ShipCall, tokio::sync::oneshot::Receiver<Result<ShipSegmentResponse, Status>>) {
    let (reply, answer) = tokio::sync::oneshot::channel();
    let request =
        ShipSegmentRequest { id: Some(WalSegmentId { region_id: 1, shard_id: 1, seqno }), ..Default::default() };
    ((request, reply), answer)
}

/// Sends `count` pushes from `first` back to back, then awaits their
/// answers: each must be its own (the pushed seqno), in order.
async fn push_and_check(calls: &tokio::sync::mpsc::Sender<ShipCall>, first: u64, count: u64) {
    let mut answers = Vec::new();
    for seqno in first..first + count {
        let (call, answer) = push(seqno);
        calls.send(call).await.unwrap();
        answers.push((seqno, answer));
    }
    for (seqno, answer) in answers {
        let answer = answer.await.unwrap().expect("answered on the stream");
        assert_eq!(answer.applied_seqno, seqno, "each push gets its own answer");
    }
}

/// After a stream ended, pushes from `first` until one is answered (a push
/// may meet the old stream's end and fail); that one's seqno.
async fn push_until_answered(calls: &tokio::sync::mpsc::Sender<ShipCall>, first: u64) -> u64 {
    for seqno in first..first + 10 {
        let (call, answer) = push(seqno);
        calls.send(call).await.unwrap();
        if let Ok(a) = answer.await.unwrap() {
            assert_eq!(a.applied_seqno, seqno, "answered with its own answer");
            return seqno;
        }
    }
    panic!("no push after the stream ended was answered on a new one");
}

/// Pushes queued at once go to a `ShipBatches` peer many to a message,
/// are each answered with their own answer, in order, and once the peer
/// ends a stream the pushes after it go on a new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_queued_together_share_messages_are_each_answered_in_order_and_go_on_after_a_stream_ends() {
    let peer = FakePeer::new(Mode::Batches { per_stream: 200 });
    let (streams, messages) = (peer.streams.clone(), peer.messages.clone());
    let (calls, server) = ship_stream_to(peer).await;
    push_and_check(&calls, 1, 200).await;
    assert_eq!(streams.load(std::sync::atomic::Ordering::SeqCst), 1, "one stream carried them all");
    let sent = messages.load(std::sync::atomic::Ordering::SeqCst);
    assert!(sent < 200, "200 pushes sent back to back shared messages: {sent} messages");
    // That stream has ended (the peer took 200).
    push_until_answered(&calls, 201).await;
    assert_eq!(streams.load(std::sync::atomic::Ordering::SeqCst), 2);
    server.abort();
}

/// With one thread, every push queued before the stream's task runs goes
/// in its first message: 200 pushes, one message.
#[tokio::test(flavor = "current_thread")]
async fn pushes_queued_before_the_stream_runs_go_in_one_message() {
    let peer = FakePeer::new(Mode::Batches { per_stream: usize::MAX });
    let messages = peer.messages.clone();
    let (calls, server) = ship_stream_to(peer).await;
    push_and_check(&calls, 1, 200).await;
    assert_eq!(messages.load(std::sync::atomic::Ordering::SeqCst), 1);
    server.abort();
}

/// A peer answering a batch with more answers than it had pushes breaks
/// the contract: those pushes fail (none takes another's answer), and the
/// stream is opened again for the next.
#[tokio::test(flavor = "current_thread")]
async fn a_batch_answered_with_the_wrong_count_fails_its_pushes() {
    let peer = FakePeer::new(Mode::BatchesMiscounted);
    let streams = peer.streams.clone();
    let (calls, server) = ship_stream_to(peer).await;
    let mut answers = Vec::new();
    for seqno in 1..=3 {
        let (call, answer) = push(seqno);
        calls.send(call).await.unwrap();
        answers.push(answer);
    }
    for answer in answers {
        let status = answer.await.unwrap().expect_err("a miscounted answer settles nothing");
        assert_eq!(status.code(), tonic::Code::Internal, "{status}");
        assert!(status.message().contains("3 pushes with 4 answers"), "{status}");
    }
    let (call, answer) = push(4);
    calls.send(call).await.unwrap();
    assert!(answer.await.unwrap().is_err(), "the peer miscounts again");
    assert_eq!(streams.load(std::sync::atomic::Ordering::SeqCst), 2, "a new stream for the next push");
    server.abort();
}

/// A peer from before `ShipBatches` gets the pushes on `ShipSegments`, one
/// to a message, each answered in order, across the stream's ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_without_ship_batches_gets_ship_segments() {
    let peer = FakePeer::new(Mode::Segments { per_stream: 200 });
    let (streams, messages) = (peer.streams.clone(), peer.messages.clone());
    let (calls, server) = ship_stream_to(peer).await;
    push_and_check(&calls, 1, 200).await;
    assert_eq!(streams.load(std::sync::atomic::Ordering::SeqCst), 1, "one ShipSegments stream carried them all");
    assert_eq!(messages.load(std::sync::atomic::Ordering::SeqCst), 200, "one push to a message");
    push_until_answered(&calls, 201).await;
    assert_eq!(streams.load(std::sync::atomic::Ordering::SeqCst), 2);
    server.abort();
}

/// A peer upgraded under a running leader (it restarts as a newer node):
/// its `ShipSegments` stream ends, and the next push asks for
/// `ShipBatches` again and gets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_ship_segments_stream_ends_the_next_push_asks_for_ship_batches_again() {
    let peer = FakePeer::new(Mode::Upgrading { per_stream: 5 });
    let (streams, batch_streams, upgraded) = (peer.streams.clone(), peer.batch_streams.clone(), peer.upgraded.clone());
    let (calls, server) = ship_stream_to(peer).await;
    push_and_check(&calls, 1, 5).await;
    assert_eq!(streams.load(std::sync::atomic::Ordering::SeqCst), 1, "one ShipSegments stream");
    assert_eq!(batch_streams.load(std::sync::atomic::Ordering::SeqCst), 0, "no ShipBatches before the upgrade");
    // The peer took its 5 pushes and ended the stream; now it has ShipBatches.
    upgraded.store(true, std::sync::atomic::Ordering::SeqCst);
    push_until_answered(&calls, 6).await;
    assert_eq!(batch_streams.load(std::sync::atomic::Ordering::SeqCst), 1, "the next stream is ShipBatches");
    assert_eq!(streams.load(std::sync::atomic::Ordering::SeqCst), 2);
    server.abort();
}

#[tokio::test]
async fn a_peer_without_either_stream_gets_unary_pushes() {
    let peer = FakePeer::new(Mode::Unary);
    let streams = peer.streams.clone();
    let (calls, server) = ship_stream_to(peer).await;
    for seqno in [5, 9, 12] {
        let (call, answer) = push(seqno);
        calls.send(call).await.unwrap();
        let answer = answer.await.unwrap().expect("answered by the unary call");
        assert_eq!(answer.applied_seqno, seqno, "each push answered by its own call");
    }
    assert_eq!(streams.load(std::sync::atomic::Ordering::SeqCst), 0);
    server.abort();
}
