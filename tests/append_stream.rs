//! `Log.AppendStream` against three real `walship node` processes: pipelined
//! appends are answered exactly as unary ones, every refusal is answered on
//! the stream without changing anything, and a malformed stream ends with a
//! clear status.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{Cluster, assert_refused, read_all};
use prost::Message;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;
use walship_proto::log::append_stream_response::Result as Answer;
use walship_proto::log::{AppendRecord, AppendRequest, AppendStreamRequest, AppendStreamResponse, Durability};
use walship_proto::pipeline::{AppendPipeline, failure_status};

const WAIT: Duration = Duration::from_secs(30);

fn append(shard: u32, payload: &str, durability: Durability) -> AppendRequest {
    AppendRequest {
        shard_id: shard,
        records: vec![AppendRecord { key: Bytes::new(), payload: Bytes::from(payload.to_string()) }],
        durability: durability as i32,
        ..Default::default()
    }
}

/// An `AppendStream` driven by hand: requests go in one at a time, answers
/// are read one at a time.
struct RawStream {
    requests: mpsc::Sender<AppendStreamRequest>,
    answers: tonic::Streaming<AppendStreamResponse>,
}

impl RawStream {
    async fn open(cluster: &mut Cluster, node: u32) -> RawStream {
        let (requests, rx) = mpsc::channel(16);
        let answers =
            cluster.node(node).client().await.append_stream(ReceiverStream::new(rx)).await.unwrap().into_inner();
        RawStream { requests, answers }
    }

    async fn send(&self, request_id: u64, append: Option<AppendRequest>) {
        self.requests.send(AppendStreamRequest { request_id, append }).await.unwrap();
    }

    /// The next answer, as (request id, what the unary call would return).
    async fn next(&mut self) -> (u64, Result<walship_proto::log::AppendResponse, tonic::Status>) {
        let answer = tokio::time::timeout(WAIT, self.answers.message()).await.expect("an answer in time");
        let answer = answer.expect("stream still up").expect("an answer, not the end of the stream");
        let outcome = match answer.result.expect("every answer carries a result") {
            Answer::Ok(ok) => Ok(ok),
            Answer::Failure(failure) => Err(failure_status(failure)),
        };
        (answer.request_id, outcome)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_appends_get_contiguous_seqnos_and_are_stored_as_sent() {
    let mut cluster = Cluster::start(3, 1, "keepalive_ms = 100");
    let pipeline = Arc::new(AppendPipeline::open(cluster.node(1).client().await).await.unwrap());
    let mut tasks = Vec::new();
    for i in 0..300 {
        let pipeline = pipeline.clone();
        tasks.push(tokio::spawn(async move {
            let payload = format!("record-{i}");
            let durability = if i % 3 == 0 { Durability::All } else { Durability::Quorum };
            let r = pipeline.append(append(1, &payload, durability)).await.unwrap();
            assert_eq!(r.first_seqno, r.last_seqno, "one record, one seqno");
            assert_eq!(r.epoch, 1);
            (r.first_seqno, payload)
        }));
    }
    let mut acked = BTreeMap::new();
    for task in tasks {
        let (seqno, payload) = task.await.unwrap();
        assert!(acked.insert(seqno, payload).is_none(), "seqno {seqno} given to two appends");
    }
    assert_eq!(acked.keys().copied().collect::<Vec<_>>(), (1..=300).collect::<Vec<_>>(), "contiguous from 1");

    // Every acknowledged record reads back as sent, from every replica once
    // committed there.
    for node in 1..=3 {
        let grpc = cluster.node(node).grpc.clone();
        let client = cluster.node(node).client().await;
        common::wait_until("every replica to commit 300 records", WAIT, || {
            let mut client = client.clone();
            async move {
                let read = walship_proto::log::ReadRequest {
                    shard_id: 1,
                    from_seqno: 1,
                    to_seqno: 0,
                    max_bytes: 0,
                    ..Default::default()
                };
                client.read(read).await.map(|r| r.into_inner().durable_seqno >= 300).unwrap_or(false)
            }
        })
        .await;
        let records = read_all(&grpc, 1, 300).await;
        let stored: BTreeMap<u64, String> =
            records.iter().map(|r| (r.seqno, String::from_utf8(r.payload.to_vec()).unwrap())).collect();
        assert_eq!(stored, acked, "node {node} holds exactly what was acknowledged");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_answered_on_the_stream_and_change_nothing() {
    let mut cluster = Cluster::start(3, 1, "keepalive_ms = 100");
    let mut stream = RawStream::open(&mut cluster, 1).await;

    // Each refusal answers its own id, with the unary call's status, and the
    // stream stays up for the next request.
    let empty =
        AppendRequest { shard_id: 1, records: vec![], durability: Durability::Quorum as i32, ..Default::default() };
    let mut unknown_durability = append(1, "x", Durability::Quorum);
    unknown_durability.durability = 42;
    let oversized = AppendRequest {
        shard_id: 1,
        records: vec![AppendRecord { key: Bytes::new(), payload: Bytes::from(vec![0u8; (1 << 20) + 1]) }],
        durability: Durability::Quorum as i32,
        ..Default::default()
    };
    // (request id, append, expected code, words and numbers of the message)
    type Refusal<'a> = (u64, Option<AppendRequest>, Code, &'a [&'a str], Vec<u64>);
    let refusals: Vec<Refusal> = vec![
        (11, Some(empty), Code::InvalidArgument, &["at least one record"], vec![]),
        (12, None, Code::InvalidArgument, &["carries no append"], vec![12]),
        (13, Some(unknown_durability), Code::InvalidArgument, &["durability"], vec![42]),
        (14, Some(append(9, "x", Durability::Quorum)), Code::NotFound, &["shard", "not hosted"], vec![9]),
        (15, Some(oversized), Code::InvalidArgument, &["limit", "max_record_bytes"], vec![(1 << 20) + 1]),
    ];
    for (id, request, code, words, numbers) in refusals {
        stream.send(id, request).await;
        let (answered, outcome) = stream.next().await;
        assert_eq!(answered, id, "the refusal names the request it answers");
        assert_refused(&format!("request {id}"), outcome, code, words, &numbers);
    }

    // Nothing was written: the first valid append gets seqno 1.
    stream.send(16, Some(append(1, "first", Durability::Quorum))).await;
    let (answered, outcome) = stream.next().await;
    assert_eq!(answered, 16);
    assert_eq!(outcome.unwrap().first_seqno, 1, "the refused requests wrote nothing");

    // A follower refuses on the stream too, naming the leader as the unary
    // refusal's metadata does.
    let leader_grpc = cluster.node(1).grpc.clone();
    let mut follower = RawStream::open(&mut cluster, 2).await;
    follower.send(1, Some(append(1, "to a follower", Durability::Quorum))).await;
    let (answered, outcome) = follower.next().await;
    assert_eq!(answered, 1);
    let status =
        assert_refused("append to a follower", outcome, Code::FailedPrecondition, &["follower", "leader"], &[1]);
    let leader = status.metadata().get(walship_proto::LEADER_METADATA_KEY).expect("leader named").to_str().unwrap();
    assert_eq!(leader, format!("1@{leader_grpc}"));
    assert_eq!(read_all(&leader_grpc, 1, 1).await.len(), 1, "still one record on the leader");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_id_in_flight_cannot_be_reused_and_a_closed_stream_still_answers() {
    let mut cluster = Cluster::start(3, 1, "keepalive_ms = 100");
    let mut stream = RawStream::open(&mut cluster, 1).await;
    stream.send(1, Some(append(1, "warm", Durability::All))).await;
    assert_eq!(stream.next().await.1.unwrap().first_seqno, 1);

    // With node 3 down an ALL append stays in flight...
    cluster.node(3).kill9();
    stream.send(7, Some(append(1, "held", Durability::All))).await;
    // ...so its id cannot be reused, while other ids go through.
    stream.send(7, Some(append(1, "reused id", Durability::Quorum))).await;
    let (answered, outcome) = stream.next().await;
    assert_eq!(answered, 7);
    assert_refused("a reused id", outcome, Code::InvalidArgument, &["already in flight"], &[7]);
    stream.send(8, Some(append(1, "other id", Durability::Quorum))).await;
    let (answered, outcome) = stream.next().await;
    assert_eq!(answered, 8);
    assert_eq!(outcome.unwrap().first_seqno, 3, "the held append took seqno 2; the reused id wrote nothing");

    // The client closes its side; the held append is still answered once
    // node 3 is back, and then the stream ends cleanly.
    let RawStream { requests, mut answers } = stream;
    drop(requests);
    cluster.restart(3);
    let answer = tokio::time::timeout(WAIT, answers.message()).await.expect("answered in time").unwrap().unwrap();
    assert_eq!(answer.request_id, 7);
    match answer.result {
        Some(Answer::Ok(ok)) => assert_eq!(ok.first_seqno, 2),
        other => panic!("the held append should succeed once all replicas are up: {other:?}"),
    }
    assert!(answers.message().await.unwrap().is_none(), "the stream ends after the last answer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_message_ends_the_stream_after_the_answers_owed() {
    let mut cluster = Cluster::start(3, 1, "keepalive_ms = 100");
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", cluster.node(1).grpc))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let valid =
        AppendStreamRequest { request_id: 5, append: Some(append(1, "before the garbage", Durability::Quorum)) };
    // Field 2 (append) as a length-delimited field whose length runs past the end.
    let garbage = Bytes::from_static(&[0x08, 0x06, 0x12, 0x7f, 0x01]);
    let bodies = vec![Bytes::from(valid.encode_to_vec()), garbage];
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let mut answers = grpc
        .streaming(
            tonic::Request::new(tokio_stream::iter(bodies)),
            tonic::codegen::http::uri::PathAndQuery::from_static("/walship.v1.Log/AppendStream"),
            common::raw::RawCodec,
        )
        .await
        .unwrap()
        .into_inner();
    let first =
        tokio::time::timeout(WAIT, answers.message()).await.unwrap().unwrap().expect("the valid request's answer");
    let first = AppendStreamResponse::decode(first).unwrap();
    assert_eq!(first.request_id, 5);
    assert!(matches!(first.result, Some(Answer::Ok(ref ok)) if ok.first_seqno == 1), "{first:?}");
    let end = tokio::time::timeout(WAIT, answers.message()).await.unwrap();
    assert_refused("an undecodable stream message", end, Code::InvalidArgument, &["malformed protobuf"], &[]);

    // Only the valid append was written.
    let mut client = cluster.node(1).client().await;
    let r = client.append(append(1, "after", Durability::Quorum)).await.unwrap().into_inner();
    assert_eq!(r.first_seqno, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_to_a_dead_node_fails_its_appends_with_an_unknown_outcome() {
    let mut cluster = Cluster::start(3, 1, "keepalive_ms = 100");
    let pipeline = AppendPipeline::open(cluster.node(1).client().await).await.unwrap();
    pipeline.append(append(1, "up", Durability::Quorum)).await.unwrap();
    cluster.node(1).kill9();
    let first = tokio::time::timeout(WAIT, pipeline.append(append(1, "down", Durability::Quorum))).await.unwrap();
    let status = first.expect_err("the node is gone");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    // Once the stream has ended every later append fails at once.
    let later = tokio::time::timeout(Duration::from_secs(1), pipeline.append(append(1, "later", Durability::Quorum)))
        .await
        .expect("no wait on an ended stream");
    assert_eq!(later.expect_err("still gone").code(), Code::Unavailable);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_stops_reading_past_its_in_flight_bytes() {
    let mut cluster = Cluster::start(3, 1, "keepalive_ms = 100");
    let mut stream = RawStream::open(&mut cluster, 1).await;
    // With node 3 down, ALL appends stay in flight: 64 of 1 MiB fill the
    // stream's 64 MiB budget.
    cluster.node(3).kill9();
    let big = |id: u64| AppendRequest {
        shard_id: 1,
        records: vec![AppendRecord { key: Bytes::new(), payload: Bytes::from(vec![id as u8; 1 << 20]) }],
        durability: Durability::All as i32,
        ..Default::default()
    };
    for id in 1..=64 {
        stream.send(id, Some(big(id))).await;
    }
    stream.send(100, Some(append(1, "behind the budget", Durability::Quorum))).await;
    // The server does not read the QUORUM append while the budget is full,
    // so it is not answered although a quorum is up.
    let early = tokio::time::timeout(Duration::from_secs(2), stream.answers.message()).await;
    assert!(early.is_err(), "an answer came while 64 MiB were in flight: {early:?}");
    // Once every replica is back, everything is answered, the QUORUM append too.
    cluster.restart(3);
    let mut answered = Vec::new();
    for _ in 0..65 {
        let (id, outcome) = stream.next().await;
        outcome.unwrap_or_else(|s| panic!("request {id}: {s:?}"));
        answered.push(id);
    }
    answered.sort_unstable();
    let expected: Vec<u64> = (1..=64).chain([100]).collect();
    assert_eq!(answered, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_forgets_appends_whose_callers_gave_up() {
    let mut cluster = Cluster::start(3, 1, "keepalive_ms = 100");
    let pipeline = AppendPipeline::open(cluster.node(1).client().await).await.unwrap();
    pipeline.append(append(1, "up", Durability::All)).await.unwrap();
    assert_eq!(pipeline.in_flight(), 0);
    // With node 3 down an ALL append waits; its caller gives up.
    cluster.node(3).kill9();
    let gave_up = tokio::time::timeout(Duration::from_millis(300), pipeline.append(append(1, "held", Durability::All)));
    assert!(gave_up.await.is_err(), "the ALL append cannot complete with node 3 down");
    assert_eq!(pipeline.in_flight(), 0, "no waiter left behind by the abandoned call");
    // The pipeline still works for everyone else.
    let r = pipeline.append(append(1, "after", Durability::Quorum)).await.unwrap();
    assert_eq!(r.first_seqno, 3, "the abandoned append itself was still written (seqno 2)");
}
