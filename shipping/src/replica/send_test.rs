//! The node pair's ship stream (`run_ship_stream`) against fake follower
//! nodes on loopback.

use std::pin::Pin;

use futures::Stream;
use tonic::{Request, Response};
use walship_proto::replication::wal_shipping_client::WalShippingClient;
use walship_proto::replication::wal_shipping_server::{WalShipping, WalShippingServer};
use walship_proto::replication::{HeartbeatRequest, HeartbeatResponse, ShipSegmentResponse, StreamRequest};

use super::*;

/// A fake follower node. With `per_stream` None it is a peer from
/// before `ShipSegments`: the stream is `UNIMPLEMENTED` (what tonic
/// answers for a method it does not know). Otherwise the stream answers
/// every push, in order, and ends after `per_stream` of them (as a
/// restarted follower's stream ends); `streams` counts the streams
/// opened. Unary pushes work either way. Each answer names the pushed
/// seqno.
struct FakePeer {
    per_stream: Option<usize>,
    streams: Arc<std::sync::atomic::AtomicUsize>,
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
        let Some(per_stream) = self.per_stream else {
            return Err(Status::unimplemented("unknown method ShipSegments"));
        };
        self.streams.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let pushes = futures::StreamExt::take(request.into_inner(), per_stream);
        Ok(Response::new(Box::pin(futures::StreamExt::map(pushes, |push| push.map(|p| answer(&p))))))
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
    tokio::spawn(run_ship_stream(WalShippingClient::new(channel), rx));
    (calls, server)
}

/// A push of `seqno` and where its answer arrives.
fn push(seqno: u64) -> (ShipCall, tokio::sync::oneshot::Receiver<Result<ShipSegmentResponse, Status>>) {
    let (reply, answer) = tokio::sync::oneshot::channel();
    let request =
        ShipSegmentRequest { id: Some(WalSegmentId { region_id: 1, shard_id: 1, seqno }), ..Default::default() };
    ((request, reply), answer)
}

/// Pushes queued at once, many more than one turn hands over, are each
/// answered with their own answer (the stream answers in order), and
/// once the peer ends a stream, the pushes after it go on a new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_queued_together_are_each_answered_in_order_and_go_on_after_a_stream_ends() {
    let streams = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (calls, server) = ship_stream_to(FakePeer { per_stream: Some(200), streams: streams.clone() }).await;
    // 200 pushes sent back to back, several turns of the stream's task.
    let mut answers = Vec::new();
    for seqno in 1..=200 {
        let (call, answer) = push(seqno);
        calls.send(call).await.unwrap();
        answers.push((seqno, answer));
    }
    for (seqno, answer) in answers {
        let answer = answer.await.unwrap().expect("answered on the stream");
        assert_eq!(answer.applied_seqno, seqno, "each push gets its own answer");
    }
    assert_eq!(streams.load(std::sync::atomic::Ordering::SeqCst), 1, "one stream carried them all");
    // That stream has ended (the peer took 200). A push now may meet its
    // end and fail; the next one goes on a new stream.
    let mut answered = None;
    for seqno in 201..=210 {
        let (call, answer) = push(seqno);
        calls.send(call).await.unwrap();
        if let Ok(a) = answer.await.unwrap() {
            answered = Some((seqno, a.applied_seqno));
            break;
        }
    }
    let (seqno, applied) = answered.expect("a push after the stream ended is answered on a new one");
    assert_eq!(applied, seqno);
    assert_eq!(streams.load(std::sync::atomic::Ordering::SeqCst), 2);
    server.abort();
}

#[tokio::test]
async fn a_peer_without_ship_segments_gets_unary_pushes() {
    let streams = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (calls, server) = ship_stream_to(FakePeer { per_stream: None, streams }).await;
    for seqno in [5, 9, 12] {
        let (call, answer) = push(seqno);
        calls.send(call).await.unwrap();
        let answer = answer.await.unwrap().expect("answered by the unary call");
        assert_eq!(answer.applied_seqno, seqno, "each push answered by its own call");
    }
    server.abort();
}
