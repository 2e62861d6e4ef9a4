//! A scripted `Log` server on a real loopback socket for the producer's
//! tests: the test sees every request the producer sends and decides when
//! and how each is answered, so nothing is left to timing.

// Each test crate uses its own part of it.
#![allow(dead_code)]

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

pub type Answers = mpsc::Sender<Result<AppendStreamResponse, Status>>;

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
pub struct Sent {
    pub request: AppendStreamRequest,
    pub answers: Answers,
}

impl Sent {
    pub fn payloads(&self) -> Vec<&[u8]> {
        self.request.append.as_ref().expect("an append").records.iter().map(|r| &r.payload[..]).collect()
    }

    /// Answers it as written at seqnos `first..`.
    pub async fn written_at(self, first: u64) {
        let n = self.payloads().len() as u64;
        self.answer(AppendResponse { first_seqno: first, last_seqno: first + n - 1, epoch: 1, duplicate: false }).await;
    }

    /// Answers it with `ok`, whatever that says.
    pub async fn answer(self, ok: AppendResponse) {
        let answer = AppendStreamResponse {
            request_id: self.request.request_id,
            result: Some(append_stream_response::Result::Ok(ok)),
        };
        self.answers.send(Ok(answer)).await.expect("the stream is open");
    }

    /// Answers it with neither a response nor a failure.
    pub async fn answer_nothing(self) {
        let answer = AppendStreamResponse { request_id: self.request.request_id, result: None };
        self.answers.send(Ok(answer)).await.expect("the stream is open");
    }

    /// The producer session the request carries: (id, epoch, sequence).
    pub fn session(&self) -> (u64, u64, u64) {
        let p = self.request.append.as_ref().expect("an append").producer.expect("a producer session");
        (p.id, p.epoch, p.sequence)
    }
}

pub struct Harness {
    pub producer: Arc<Producer>,
    requests: mpsc::UnboundedReceiver<(AppendStreamRequest, Answers)>,
}

impl Harness {
    pub async fn start(config: ProducerConfig) -> Harness {
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
        Harness { producer: Arc::new(Producer::new(vec![addr.to_string()], connect, config)), requests }
    }

    pub async fn send(&self, payload: &'static str) -> RecordAck {
        self.send_bytes(Bytes::from_static(payload.as_bytes())).await
    }

    pub async fn send_bytes(&self, payload: Bytes) -> RecordAck {
        self.producer.send(1, Bytes::new(), payload).await
    }

    /// The next request the producer sends.
    pub async fn next_request(&mut self) -> Sent {
        let (request, answers) = tokio::time::timeout(Duration::from_secs(10), self.requests.recv())
            .await
            .expect("a request within 10 s")
            .expect("the server runs");
        Sent { request, answers }
    }

    /// Fails if the producer sends a request within `wait`.
    pub async fn sends_nothing_for(&mut self, wait: Duration) {
        if let Ok(Some((request, _))) = tokio::time::timeout(wait, self.requests.recv()).await {
            panic!("the producer sent {request:?} when it should have sent nothing");
        }
    }
}

pub fn zero_linger(in_flight: usize) -> ProducerConfig {
    ProducerConfig { linger: Duration::ZERO, in_flight, ..ProducerConfig::default() }
}
