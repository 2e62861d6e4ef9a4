//! How the producer batches, against a scripted `Log` server on a real
//! loopback socket: the test sees every request the producer sends and
//! decides when each is answered, so what goes into a batch is not left to
//! timing.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::transport::{Endpoint, Server};
use tonic::{Request, Response, Status, Streaming};
use walship_client::{Connect, ConnectError, Producer, ProducerConfig, RecordAck};
use walship_proto::log::log_client::LogClient;
use walship_proto::log::log_server::{Log, LogServer};
use walship_proto::log::{
    AppendRequest, AppendResponse, AppendStreamRequest, AppendStreamResponse, ReadRequest, ReadResponse, TailRequest,
    TailResponse, append_stream_response,
};

type Answers = mpsc::Sender<Result<AppendStreamResponse, Status>>;

/// A `Log` server that hands every `AppendStream` request to the test, with
/// the stream's answer channel, and answers nothing by itself.
struct Scripted {
    requests: mpsc::UnboundedSender<(AppendStreamRequest, Answers)>,
}

#[tonic::async_trait]
impl Log for Scripted {
    async fn append(&self, _: Request<AppendRequest>) -> Result<Response<AppendResponse>, Status> {
        Err(Status::unimplemented("the scripted server only streams"))
    }

    type AppendStreamStream = ReceiverStream<Result<AppendStreamResponse, Status>>;

    async fn append_stream(
        &self,
        request: Request<Streaming<AppendStreamRequest>>,
    ) -> Result<Response<Self::AppendStreamStream>, Status> {
        let mut inbound = request.into_inner();
        let (answers, rx) = mpsc::channel(64);
        let requests = self.requests.clone();
        tokio::spawn(async move {
            while let Ok(Some(request)) = inbound.message().await {
                if requests.send((request, answers.clone())).is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn read(&self, _: Request<ReadRequest>) -> Result<Response<ReadResponse>, Status> {
        Err(Status::unimplemented("the scripted server only streams"))
    }

    type TailStream = ReceiverStream<Result<TailResponse, Status>>;

    async fn tail(&self, _: Request<TailRequest>) -> Result<Response<Self::TailStream>, Status> {
        Err(Status::unimplemented("the scripted server only streams"))
    }
}

/// One request the producer sent, and where to answer it.
struct Sent {
    request: AppendStreamRequest,
    answers: Answers,
}

impl Sent {
    fn payloads(&self) -> Vec<&[u8]> {
        self.request.append.as_ref().expect("an append").records.iter().map(|r| &r.payload[..]).collect()
    }

    /// Answers it as written at seqnos `first..`.
    async fn written_at(self, first: u64) {
        let n = self.payloads().len() as u64;
        let ok = AppendResponse { first_seqno: first, last_seqno: first + n - 1, epoch: 1, duplicate: false };
        let answer = AppendStreamResponse {
            request_id: self.request.request_id,
            result: Some(append_stream_response::Result::Ok(ok)),
        };
        self.answers.send(Ok(answer)).await.expect("the stream is open");
    }
}

struct Harness {
    producer: Producer,
    requests: mpsc::UnboundedReceiver<(AppendStreamRequest, Answers)>,
}

impl Harness {
    async fn start(config: ProducerConfig) -> Harness {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, requests) = mpsc::unbounded_channel();
        tokio::spawn(
            Server::builder()
                .add_service(LogServer::new(Scripted { requests: tx }))
                .serve_with_incoming(TcpListenerStream::new(listener)),
        );
        let connect: Connect = Arc::new(|server: String| {
            Box::pin(async move {
                let channel = Endpoint::from_shared(format!("http://{server}"))
                    .map_err(|e| Arc::new(e) as ConnectError)?
                    .connect()
                    .await
                    .map_err(|e| Arc::new(e) as ConnectError)?;
                Ok(LogClient::new(channel))
            })
        });
        Harness { producer: Producer::new(vec![addr.to_string()], connect, config), requests }
    }

    async fn send(&self, payload: &'static str) -> RecordAck {
        self.producer.send(1, Bytes::new(), Bytes::from_static(payload.as_bytes())).await
    }

    /// The next request the producer sends.
    async fn next_request(&mut self) -> Sent {
        let (request, answers) = tokio::time::timeout(Duration::from_secs(10), self.requests.recv())
            .await
            .expect("a request within 10 s")
            .expect("the server runs");
        Sent { request, answers }
    }

    /// Fails if the producer sends a request within `wait`.
    async fn sends_nothing_for(&mut self, wait: Duration) {
        if let Ok(Some((request, _))) = tokio::time::timeout(wait, self.requests.recv()).await {
            panic!("the producer sent {request:?} with no pipeline slot free");
        }
    }
}

fn zero_linger(in_flight: usize) -> ProducerConfig {
    ProducerConfig { linger: Duration::ZERO, in_flight, ..ProducerConfig::default() }
}

#[tokio::test]
async fn while_every_slot_is_busy_the_open_batch_takes_records_past_its_linger() {
    let mut h = Harness::start(zero_linger(1)).await;
    let a = h.send("a").await;
    let first = h.next_request().await;
    assert_eq!(first.payloads(), [b"a"], "a lone record goes at once");

    // Records sent while the one slot is busy, some of them well past a
    // linger of zero (and past the timer's millisecond), all wait...
    let mut acks = vec![h.send("b").await, h.send("c").await];
    tokio::time::sleep(Duration::from_millis(30)).await;
    acks.push(h.send("d").await);
    acks.push(h.send("e").await);
    h.sends_nothing_for(Duration::from_millis(100)).await;

    // ... and go as one batch once the slot frees.
    first.written_at(1).await;
    assert_eq!(a.await.unwrap().seqno, 1);
    let second = h.next_request().await;
    assert_eq!(second.payloads(), [b"b", b"c", b"d", b"e"]);
    let producer = second.request.append.as_ref().unwrap().producer.unwrap();
    assert_eq!(producer.sequence, 2, "the batch's sequence follows the first's record");
    second.written_at(2).await;
    for (ack, seqno) in acks.into_iter().zip(2..) {
        assert_eq!(ack.await.unwrap().seqno, seqno);
    }
}

#[tokio::test]
async fn with_a_slot_free_a_zero_linger_batch_goes_at_once() {
    let mut h = Harness::start(zero_linger(2)).await;
    let a = h.send("a").await;
    let first = h.next_request().await;
    let b = h.send("b").await;
    // Sent while the first is unanswered: the second slot is free.
    let second = h.next_request().await;
    assert_eq!((first.payloads(), second.payloads()), (vec![&b"a"[..]], vec![&b"b"[..]]));
    // A third record has no slot until one of them is answered.
    let c = h.send("c").await;
    h.sends_nothing_for(Duration::from_millis(100)).await;
    first.written_at(1).await;
    let third = h.next_request().await;
    assert_eq!(third.payloads(), [b"c"]);
    second.written_at(2).await;
    third.written_at(3).await;
    assert_eq!((a.await.unwrap().seqno, b.await.unwrap().seqno, c.await.unwrap().seqno), (1, 2, 3));
}
